/* Paged causal attention for any CPU the C compiler targets (8-lane GCC vectors: AVX2 + FMA where
 * built with -march=native on such a CPU, SSE or plain code elsewhere), fp32, reading K/V through
 * block tables. The AVX512 kernel (attention.c) is the same algorithm on 16 lanes; this one serves
 * the CPUs where that one does not build (this project's AVX2 AMD EPYC machines).
 *
 * Each query row is computed on its own, against exactly the keys it sees, in a fixed order:
 *   s_j = hsum8(sum_c q[8c..] * k_j[8c..])   (q pre-scaled; D / 8 vector products in order, then
 *                                             the lanes of 8 keys reduced by one shuffle tree)
 *   m = max_j s_j;  e_j = exp(s_j - m);  l = sum_j e_j  (8 lanes in key order, then hsum8)
 *   o = (sum_j e_j v_j) * (1 / l)           (sum over j in order, 8 dims per vector)
 * so a row's output is the same bits whether it is a decode row, a draft row or one row of a
 * prefill chunk of any length, and whatever the thread count: batching, chunking, prefix caching
 * and speculation cannot change it. (How P @ V is split over heads and dims only groups
 * independent sums; each element's sum over j keeps its order.) Two-pass softmax form of scaled
 * dot-product attention (Vaswani et al. 2017); paged layout and block tables after vLLM's
 * PagedAttention (Kwon et al. 2023).
 *
 * exp: Cody-Waite range reduction x = n ln2 + r, |r| <= ln2 / 2 (n rounded by the 1.5 * 2^23
 * trick, exact for |x log2 e| < 2^22), a degree-6 Taylor polynomial for e^r (relative error below
 * 2e-7 there), times 2^n built in the exponent bits. Arguments are <= 0 (s_j - m); below -87 the
 * result is 0.
 *
 * Layouts: q, out fp32 [T, H, D] (D % 8 == 0, D <= 256); k_cache, v_cache fp32, bf16 or fp16
 * (cache_kind 0, 1, 2: widened exactly on load) [num_blocks, block_size, Hkv, D]; block_tables int32
 * [num_seqs, max_blocks]; query_start_loc int32 [num_seqs + 1]; seq_lens int32 [num_seqs]. Row
 * t = query_start_loc[i] + j of sequence i sits at position seq_lens[i] - q_len + j and sees keys
 * 0 .. that position, or with window > 0 only the last `window` of them. Head h reads kv head
 * h / (H / Hkv).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __F16C__
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));

#define MAX_DV 32 /* head_dim up to 256 */
#define PV_HEADS 3 /* P @ V: heads x dims held in accumulators at once */
#define PV_DIMS 4  /* (vectors of 8) */

static inline f32x8 splat(float f) { return (f32x8){f, f, f, f, f, f, f, f}; }

static inline f32x8 select8(i32x8 mask, f32x8 a, f32x8 b) { /* mask ? a : b, lane-wise */
    return (f32x8)(((i32x8)a & mask) | ((i32x8)b & ~mask));
}

static inline float hsum8(f32x8 v) { return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7])); }

/* One IEEE half widened to float, exactly: its exponent and mantissa bits placed as a float's are
 * the value times 2^-112 (a half subnormal becomes a float subnormal), so one exact product by
 * 2^112 restores it; infinities stay infinite, NaNs keep their payload, made quiet (F16C's bits). */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, body = (uint32_t)(h & 0x7fffu) << 13;
    float f;
    if ((h & 0x7c00u) == 0x7c00u) {
        const uint32_t payload = body & 0x007fffffu; /* a NaN comes back quiet, as F16C returns it */
        const uint32_t bits = sign | 0x7f800000u | payload | (payload ? 0x00400000u : 0u);
        memcpy(&f, &bits, 4);
        return f;
    }
    memcpy(&f, &body, 4);
    f *= 0x1p112f;
    return sign ? -f : f;
}

/* 8 cache elements from index i: fp32 (kind 0), or bf16 (1) / fp16 (2) widened exactly to fp32. */
static inline __attribute__((always_inline)) f32x8 load8(const void *base, size_t i, const int kind) {
    if (kind == 1) {
        u16x8 h;
        memcpy(&h, (const uint16_t *)base + i, 16);
        return (f32x8)(__builtin_convertvector(h, u32x8) << 16);
    }
    if (kind == 2) {
#ifdef __F16C__
        __m128i h;
        memcpy(&h, (const uint16_t *)base + i, 16);
        return (f32x8)_mm256_cvtph_ps(h);
#else
        f32x8 v;
        for (int l = 0; l < 8; ++l) v[l] = half_to_float(((const uint16_t *)base)[i + l]);
        return v;
#endif
    }
    f32x8 v;
    memcpy(&v, (const float *)base + i, 32);
    return v;
}

/* 8 vectors -> one: lane i = the sum of t[i]'s lanes (a fixed shuffle tree). */
static inline f32x8 sum8(const f32x8 *t) {
    f32x8 a[4], b[2];
    for (int i = 0; i < 4; ++i) /* lane 2p + r: pair p of t[2i + r] */
        a[i] = __builtin_shuffle(t[2 * i], t[2 * i + 1], (i32x8){0, 8, 2, 10, 4, 12, 6, 14}) +
               __builtin_shuffle(t[2 * i], t[2 * i + 1], (i32x8){1, 9, 3, 11, 5, 13, 7, 15});
    for (int i = 0; i < 2; ++i) /* lane s + 4 h: half h of t[4i + s] */
        b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], (i32x8){0, 1, 8, 9, 4, 5, 12, 13}) +
               __builtin_shuffle(a[2 * i], a[2 * i + 1], (i32x8){2, 3, 10, 11, 6, 7, 14, 15});
    return __builtin_shuffle(b[0], b[1], (i32x8){0, 1, 2, 3, 8, 9, 10, 11}) +
           __builtin_shuffle(b[0], b[1], (i32x8){4, 5, 6, 7, 12, 13, 14, 15});
}

static inline f32x8 exp_nonpositive(f32x8 x) {
    const i32x8 tiny = (i32x8)(x < splat(-87.0f));
    x = select8(tiny, splat(-87.0f), x);
    const f32x8 n = (x * splat(1.44269504088896341f) + splat(12582912.0f)) - splat(12582912.0f);
    f32x8 r = x - n * splat(0.693359375f);
    r = r - n * splat(-2.12194440e-4f);
    f32x8 p = splat(1.0f / 720);
    p = p * r + splat(1.0f / 120);
    p = p * r + splat(1.0f / 24);
    p = p * r + splat(1.0f / 6);
    p = p * r + splat(0.5f);
    p = p * r + splat(1.0f);
    p = p * r + splat(1.0f);
    const f32x8 two_n = (f32x8)((__builtin_convertvector(n, i32x8) + 127) << 23);
    return select8(tiny, splat(0.0f), p * two_n);
}

static const i32x8 LANES = {0, 1, 2, 3, 4, 5, 6, 7};

/* q . k for the key at cache index ko: D / 8 vector products in order, one per lane. */
static inline __attribute__((always_inline)) f32x8 dot_key(const f32x8 *qv, int dv, const void *k_cache, size_t ko,
                                                         const int kind) {
    f32x8 acc = qv[0] * load8(k_cache, ko, kind);
    for (int c = 1; c < dv; ++c) acc = acc + qv[c] * load8(k_cache, ko + 8 * (size_t)c, kind);
    return acc;
}

/* One query row's `group` heads (they share kv head h_off / d) over keys lo .. n-1.
 * q, out: [group][d]; scores: scratch of >= group * (n - lo + 8) floats. */
static inline __attribute__((always_inline)) void attend_row(const float *q, int group, const int d, int lo, int n,
                                                           const void *k_cache, const void *v_cache, int block_size,
                                                           int kv_stride, int h_off, const int *table, float scale,
                                                           float *scores, float *out, const int kind) {
    const int dv = d / 8, span = n - lo, stride = span + 8;
    for (int g = 0; g < group; ++g) {
        f32x8 qv[MAX_DV];
        for (int c = 0; c < dv; ++c) {
            memcpy(qv + c, q + g * d + 8 * c, 32);
            qv[c] = qv[c] * splat(scale);
        }
        float *sg = scores + (size_t)g * stride;
        f32x8 mx = splat(-INFINITY);
        for (int j0 = lo; j0 < n; j0 += 8) {
            const int len = n - j0 < 8 ? n - j0 : 8;
            f32x8 t[8];
            for (int o = 0; o < 8; ++o) {
                const int j = j0 + o;
                t[o] = o < len ? dot_key(qv, dv, k_cache,
                                         ((size_t)table[j / block_size] * block_size + j % block_size) * kv_stride +
                                             h_off, kind)
                               : splat(0.0f);
            }
            const f32x8 sv = sum8(t);
            memcpy(sg + (j0 - lo), &sv, sizeof(float) * len);
            const i32x8 live = LANES < len;
            const f32x8 s = select8(live, sv, splat(-INFINITY));
            mx = select8((i32x8)(s > mx), s, mx);
        }
        float m = mx[0];
        for (int l = 1; l < 8; ++l) m = mx[l] > m ? mx[l] : m; /* max is exact in any order */
        f32x8 lsum = splat(0.0f);
        for (int j = 0; j < span; j += 8) {
            const i32x8 live = LANES < span - j;
            f32x8 s;
            memcpy(&s, sg + j, 32); /* lanes past span: scratch, masked below */
            const f32x8 e = select8(live, exp_nonpositive(select8(live, s, splat(m)) - splat(m)), splat(0.0f));
            memcpy(sg + j, &e, 32);
            lsum = lsum + e;
        }
        sg[span] = 1.0f / hsum8(lsum); /* after the probabilities: 1 / l, applied at the end */
    }
    for (int g0 = 0; g0 < group; g0 += PV_HEADS) {
        const int gn = group - g0 < PV_HEADS ? group - g0 : PV_HEADS;
        for (int c0 = 0; c0 < dv; c0 += PV_DIMS) {
            const int cn = dv - c0 < PV_DIMS ? dv - c0 : PV_DIMS;
            f32x8 acc[PV_HEADS * PV_DIMS];
            for (int a = 0; a < PV_HEADS * PV_DIMS; ++a) acc[a] = splat(0.0f);
            for (int j0 = lo; j0 < n;) { /* the run of keys j0 .. j0 + len - 1 inside one block */
                const int off = j0 % block_size;
                size_t v = ((size_t)table[j0 / block_size] * block_size + off) * kv_stride + h_off + 8 * (size_t)c0;
                const int len = n - j0 < block_size - off ? n - j0 : block_size - off;
                for (int o = 0; o < len; ++o, v += kv_stride) {
                    f32x8 vv[PV_DIMS];
                    for (int c = 0; c < cn; ++c) vv[c] = load8(v_cache, v + 8 * (size_t)c, kind);
                    for (int g = 0; g < gn; ++g) {
                        const f32x8 p = splat(scores[(size_t)(g0 + g) * stride + (j0 - lo) + o]);
                        for (int c = 0; c < cn; ++c) acc[g * PV_DIMS + c] = acc[g * PV_DIMS + c] + p * vv[c];
                    }
                }
                j0 += len;
            }
            for (int g = 0; g < gn; ++g) {
                const f32x8 iv = splat(scores[(size_t)(g0 + g) * stride + span]);
                for (int c = 0; c < cn; ++c) {
                    const f32x8 o = acc[g * PV_DIMS + c] * iv;
                    memcpy(out + (g0 + g) * d + 8 * (c0 + c), &o, 32);
                }
            }
        }
    }
}

/* head_dim 64, 128, 256 and each cache dtype get their own copies, so the loops unroll. */
typedef void (*attend_fn)(const float *, int, int, int, int, const void *, const void *, int, int, int,
                          const int *, float, float *, float *);
#define ATTEND(NAME, D, KIND)                                                                                \
    static void NAME(const float *q, int group, int d, int lo, int n, const void *kc, const void *vc, int bs,  \
                     int kv_stride, int h_off, const int *table, float scale, float *scores, float *out) {       \
        attend_row(q, group, D ? D : d, lo, n, kc, vc, bs, kv_stride, h_off, table, scale, scores, out, KIND); \
    }
ATTEND(attend_64, 64, 0)
ATTEND(attend_128, 128, 0)
ATTEND(attend_256, 256, 0)
ATTEND(attend_any, 0, 0)
ATTEND(attend_64_bf16, 64, 1)
ATTEND(attend_128_bf16, 128, 1)
ATTEND(attend_256_bf16, 256, 1)
ATTEND(attend_any_bf16, 0, 1)
ATTEND(attend_64_fp16, 64, 2)
ATTEND(attend_128_fp16, 128, 2)
ATTEND(attend_256_fp16, 256, 2)
ATTEND(attend_any_fp16, 0, 2)

/* Work (multiply-adds) below which one thread does it all: a thread team costs more than it
 * saves on a small step, and on a shared machine a waiting team is worse. */
#define PARALLEL_WORK (1L << 20)

/* Returns 0, or -1 on bad arguments / no memory. */
int stencil_vec_attention(const float *q, int heads, int kv_heads, int d, const void *k_cache, const void *v_cache,
                          int cache_kind, int block_size, const int *block_tables, int max_blocks,
                          const int *query_start_loc, const int *seq_lens, int num_seqs, float scale, int window,
                          float *out, int threads) {
    if (d % 8 || d / 8 > MAX_DV || kv_heads <= 0 || heads % kv_heads || block_size <= 0 || window < 0 ||
        num_seqs < 0 || cache_kind < 0 || cache_kind > 2)
        return -1;
    const int group = heads / kv_heads, kv_stride = kv_heads * d;
    const int rows = num_seqs ? query_start_loc[num_seqs] : 0;
    if (rows <= 0) return 0;
    int *seq_of = malloc(sizeof(int) * (size_t)rows);
    if (!seq_of) return -1;
    int longest = 0;
    long work = 0;
    for (int i = 0; i < num_seqs; ++i) {
        longest = seq_lens[i] > longest ? seq_lens[i] : longest;
        const int q_len = query_start_loc[i + 1] - query_start_loc[i];
        for (int t = query_start_loc[i]; t < query_start_loc[i + 1]; ++t) seq_of[t] = i;
        const long keys = window > 0 && seq_lens[i] > window ? window : seq_lens[i];
        work += (long)q_len * keys * heads * d * 2;
    }
    const long items = (long)rows * kv_heads;
    const attend_fn attend =
        cache_kind == 2 ? (d == 64 ? attend_64_fp16 : d == 128 ? attend_128_fp16 : d == 256 ? attend_256_fp16
                                                                                          : attend_any_fp16)
        : cache_kind ? (d == 64 ? attend_64_bf16 : d == 128 ? attend_128_bf16
                        : d == 256 ? attend_256_bf16 : attend_any_bf16)
                     : (d == 64 ? attend_64 : d == 128 ? attend_128 : d == 256 ? attend_256 : attend_any);
    int failed = 0;
    (void)threads;
#pragma omp parallel num_threads(threads > 0 ? threads : 1) if (threads > 1 && items > 1 && work >= PARALLEL_WORK)
    {
        float *scores = malloc(sizeof(float) * (size_t)group * ((size_t)longest + 8));
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (long it = 0; it < items; ++it) {
            if (!scores) continue;
            const int t = (int)(it / kv_heads), hk = (int)(it % kv_heads), i = seq_of[t];
            const int start = query_start_loc[i], q_len = query_start_loc[i + 1] - start;
            const int n = seq_lens[i] - q_len + 1 + (t - start); /* keys row t sees */
            const int lo = window > 0 && n > window ? n - window : 0;
            const size_t row = ((size_t)t * heads + (size_t)hk * group) * d;
            attend(q + row, group, d, lo, n, k_cache, v_cache, block_size, kv_stride, hk * d,
                   block_tables + (size_t)i * max_blocks, scale, scores, out + row);
        }
        free(scores);
    }
    free(seq_of);
    return failed ? -1 : 0;
}
