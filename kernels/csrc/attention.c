/* Paged causal attention for x86 CPUs with AVX512, fp32, reading K/V through block tables.
 *
 * Each query row is computed on its own, against exactly the keys it sees, in a fixed order:
 *   s_j = reduce_add(q * k_j) * 1        (q pre-scaled; D / 16 vector products, in order)
 *   m = max_j s_j;  e_j = exp(s_j - m);  l = sum_j e_j   (16 lanes in key order, then reduced)
 *   o = (sum_j e_j v_j) * (1 / l)        (sum over j in order, 16 dims per vector)
 * so a row's output is the same bits whether it is a decode row, a draft row, or one row of a
 * prefill chunk of any length: batching, chunking and speculation cannot change it. This is
 * the online-softmax-free (two-pass) form of scaled dot-product attention (Vaswani et al.
 * 2017); the paged layout and block tables follow vLLM's PagedAttention (Kwon et al. 2023).
 *
 * exp: Cody-Waite range reduction x = n ln2 + r, |r| <= ln2 / 2, then a degree-6 polynomial
 * for e^r (Taylor coefficients; relative error below 2e-7 on that interval), times 2^n by
 * VSCALEFPS. Arguments are <= 0 here (s_j - m), and below -87 the result is flushed to 0.
 *
 * Layouts: q, out fp32 [T, H, D]; k_cache, v_cache fp32, bf16 or fp16 (cache_kind 0, 1, 2; widened exactly on
 * load) [num_blocks, block_size, Hkv, D];
 * block_tables int32 [num_seqs, max_blocks]; query_start_loc int32 [num_seqs + 1]; seq_lens
 * int32 [num_seqs]. Row t = query_start_loc[i] + j of sequence i sits at position
 * seq_lens[i] - q_len + j and sees keys 0 .. that position, or with window > 0 only the last
 * `window` of them (keys p - window + 1 .. p: a sliding-window layer). Head h reads kv head
 * h / (H / Hkv). A windowed row walks its keys from the window's first one, so its result is
 * still a function of the row alone.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

static inline __m512 exp_nonpositive(__m512 x) {
    const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
    const __m512 ln2_hi = _mm512_set1_ps(0.693359375f), ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
    __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, ln2_hi, x);
    r = _mm512_fnmadd_ps(n, ln2_lo, r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_maskz_mov_ps((__mmask16)~tiny, _mm512_scalef_ps(p, n));
}

#define MAX_DV 16  /* head_dim up to 256 */
#define MAX_ACC 24 /* group * head_dim / 16 accumulators held in registers for P @ V */
#define ROW_RUN 8 /* new rows of a sequence a thread takes at a time (stencil_paged_attention) */

/* 16 vectors -> one: lane i = sum of t[i]'s 16 lanes (fixed shuffle tree). */
static inline __m512 sum16(const __m512 *t) {
    __m512 a[8], b[4];
    for (int i = 0; i < 8; ++i)
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(t[2 * i], t[2 * i + 1]), _mm512_unpackhi_ps(t[2 * i], t[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {
        __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    __m512 e01 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(2, 0, 2, 0)),
                               _mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(3, 1, 3, 1)));
    __m512 e23 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(2, 0, 2, 0)),
                               _mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e01, e23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(e01, e23, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* 16 cache elements from index i: fp32 (kind 0), or bf16 (1) / fp16 (2) widened exactly to fp32. */
static inline __attribute__((always_inline)) __m512 load16(const void *base, size_t i, const int kind) {
    if (kind == 1)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i))), 16));
    if (kind == 2)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i)));
    return _mm512_loadu_ps((const float *)base + i);
}

/* q . k for the key at cache index ko: D / 16 vector products in order, one per lane. */
static inline __attribute__((always_inline)) __m512 dot_key(const __m512 *qv, int dv, const void *k_cache, size_t ko,
                                                          const int kind) {
    __m512 acc = _mm512_mul_ps(qv[0], load16(k_cache, ko, kind));
    for (int c = 1; c < dv; ++c) acc = _mm512_fmadd_ps(qv[c], load16(k_cache, ko + 16 * c, kind), acc);
    return acc;
}

/* One query row's `group` heads (they share kv head h_off / d) over keys lo .. n-1.
 * q, out: [group][d]; scores: scratch of >= group * (n - lo + 16) floats, key j at j - lo. */
static inline __attribute__((always_inline)) void attend_row(
    const float *q, int group, const int d, int lo, int n, const void *k_cache, const void *v_cache,
    int block_size, int kv_stride, int h_off, const int *table, float scale, float *scores, float *out,
    const int kind) {
    const int dv = d / 16, span = n - lo, stride = span + 16;
    for (int g = 0; g < group; ++g) {
        __m512 qv[MAX_DV];
        for (int c = 0; c < dv; ++c)
            qv[c] = _mm512_mul_ps(_mm512_loadu_ps(q + g * d + 16 * c), _mm512_set1_ps(scale));
        float *sg = scores + (size_t)g * stride;
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int j0 = lo; j0 < n; j0 += 16) {
            const int len = n - j0 < 16 ? n - j0 : 16;
            __m512 t[16];
            if (len == 16 && j0 % block_size + 16 <= block_size) { /* 16 keys of one block, kv_stride apart */
                const size_t k = ((size_t)table[j0 / block_size] * block_size + j0 % block_size) * kv_stride + h_off;
#pragma GCC unroll 16
                for (int o = 0; o < 16; ++o) t[o] = dot_key(qv, dv, k_cache, k + (size_t)o * kv_stride, kind);
            } else {
                for (int o = 0; o < 16; ++o) {
                    if (o >= len) { t[o] = _mm512_setzero_ps(); continue; }
                    const int j = j0 + o;
                    t[o] = dot_key(qv, dv, k_cache,
                                   ((size_t)table[j / block_size] * block_size + j % block_size) * kv_stride + h_off, kind);
                }
            }
            const __mmask16 live = len == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << len) - 1);
            const __m512 sv = sum16(t);
            _mm512_mask_storeu_ps(sg + (j0 - lo), live, sv);
            mx = _mm512_mask_max_ps(mx, live, mx, sv);
        }
        const __m512 mv = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
        __m512 lsum = _mm512_setzero_ps();
        for (int j = 0; j < span; j += 16) {
            const __mmask16 live = span - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (span - j)) - 1);
            __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, sg + j), mv));
            e = _mm512_maskz_mov_ps(live, e);
            _mm512_mask_storeu_ps(sg + j, live, e);
            lsum = _mm512_add_ps(lsum, e);
        }
        /* 1 / l folded into the probabilities' final scaling below */
        sg[span] = 1.0f / _mm512_reduce_add_ps(lsum);
    }
    /* P @ V for up to MAX_ACC / dv heads at a time (they share each V load); every head's sum
     * runs over j in order, so how heads are chunked never changes a bit. */
    const int chunk = MAX_ACC / dv > 0 ? MAX_ACC / dv : 1;
    for (int g0 = 0; g0 < group; g0 += chunk) {
        const int gn = group - g0 < chunk ? group - g0 : chunk;
        __m512 acc[MAX_ACC];
        for (int a = 0; a < gn * dv; ++a) acc[a] = _mm512_setzero_ps();
        for (int j0 = lo; j0 < n;) { /* the run of keys j0 .. j0 + len - 1 inside one block */
            const int off = j0 % block_size;
            size_t v = ((size_t)table[j0 / block_size] * block_size + off) * kv_stride + h_off;
            const int len = n - j0 < block_size - off ? n - j0 : block_size - off;
            for (int o = 0; o < len; ++o, v += kv_stride) {
                __m512 vv[MAX_DV];
                for (int c = 0; c < dv; ++c) vv[c] = load16(v_cache, v + 16 * c, kind);
                for (int g = 0; g < gn; ++g) {
                    const __m512 p = _mm512_set1_ps(scores[(size_t)(g0 + g) * stride + (j0 - lo) + o]);
                    for (int c = 0; c < dv; ++c) acc[g * dv + c] = _mm512_fmadd_ps(p, vv[c], acc[g * dv + c]);
                }
            }
            j0 += len;
        }
        for (int g = 0; g < gn; ++g) {
            const __m512 iv = _mm512_set1_ps(scores[(size_t)(g0 + g) * stride + span]);
            for (int c = 0; c < dv; ++c)
                _mm512_storeu_ps(out + (g0 + g) * d + 16 * c, _mm512_mul_ps(acc[g * dv + c], iv));
        }
    }
}

/* head_dim 64 and 128 and each cache dtype get their own copies, so the loops unroll. */
typedef void (*attend_fn)(const float *, int, int, int, int, const void *, const void *, int, int, int,
                          const int *, float, float *, float *);
#define ATTEND(NAME, D, KIND)                                                                               \
    static void NAME(const float *q, int group, int d, int lo, int n, const void *kc, const void *vc, int bs, \
                     int kv_stride, int h_off, const int *table, float scale, float *scores, float *out) {      \
        attend_row(q, group, D ? D : d, lo, n, kc, vc, bs, kv_stride, h_off, table, scale, scores, out, KIND); \
    }
ATTEND(attend_64, 64, 0)
ATTEND(attend_128, 128, 0)
ATTEND(attend_any, 0, 0)
ATTEND(attend_64_bf16, 64, 1)
ATTEND(attend_128_bf16, 128, 1)
ATTEND(attend_any_bf16, 0, 1)
ATTEND(attend_64_fp16, 64, 2)
ATTEND(attend_128_fp16, 128, 2)
ATTEND(attend_any_fp16, 0, 2)

/* Returns 0, or -1 on bad arguments / no memory. */
int stencil_paged_attention(const float *q, int heads, int kv_heads, int d, const void *k_cache,
                            const void *v_cache, int cache_kind, int block_size, const int *block_tables,
                            int max_blocks, const int *query_start_loc, const int *seq_lens, int num_seqs,
                            float scale, int window, float *out, int threads) {
    if (d % 16 || d / 16 > MAX_DV || kv_heads <= 0 || heads % kv_heads || block_size <= 0 || window < 0 ||
        cache_kind < 0 || cache_kind > 2)
        return -1;
    const int group = heads / kv_heads, kv_stride = kv_heads * d;
    int longest = 0;
    for (int i = 0; i < num_seqs; ++i) longest = seq_lens[i] > longest ? seq_lens[i] : longest;
    const int items = num_seqs * kv_heads;
    /* Work units: a sequence's kv head and a run of up to ROW_RUN of its new rows, so that one long
     * prompt (one sequence; Gemma 3 has one kv head) is shared among the threads too. Each row is
     * computed alone, so how rows are shared never changes a bit. */
    int longest_new = 0;
    for (int i = 0; i < num_seqs; ++i) {
        const int q_len = query_start_loc[i + 1] - query_start_loc[i];
        longest_new = q_len > longest_new ? q_len : longest_new;
    }
    const int runs = longest_new > ROW_RUN ? (longest_new + ROW_RUN - 1) / ROW_RUN : 1, units = items * runs;
    const attend_fn attend =
        cache_kind == 2 ? (d == 64 ? attend_64_fp16 : d == 128 ? attend_128_fp16 : attend_any_fp16)
        : cache_kind ? (d == 64 ? attend_64_bf16 : d == 128 ? attend_128_bf16 : attend_any_bf16)
                     : (d == 64 ? attend_64 : d == 128 ? attend_128 : attend_any);
    int failed = 0;
    (void)threads;
#pragma omp parallel num_threads(threads > 0 ? threads : 1) if (threads > 1 && units > 1)
    {
        float *scores = malloc(sizeof(float) * (size_t)group * ((size_t)longest + 16));
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int u = 0; u < units; ++u) {
            if (!scores) continue;
            /* the last runs first: later rows see more keys, so the long units start early */
            const int it = u % items, run = runs - 1 - u / items;
            const int i = it / kv_heads, hk = it % kv_heads;
            const int start = query_start_loc[i], q_len = query_start_loc[i + 1] - start;
            const int first = seq_lens[i] - q_len + 1; /* keys seen by the sequence's first new row */
            const int *table = block_tables + (size_t)i * max_blocks;
            const int j_end = (run + 1) * ROW_RUN < q_len ? (run + 1) * ROW_RUN : q_len;
            for (int j = run * ROW_RUN; j < j_end; ++j) {
                const size_t row = ((size_t)(start + j) * heads + (size_t)hk * group) * d;
                const int n = first + j, lo = window > 0 && n > window ? n - window : 0;
                attend(q + row, group, d, lo, n, k_cache, v_cache, block_size, kv_stride, hk * d, table, scale,
                       scores, out + row);
            }
        }
        free(scores);
    }
    return failed ? -1 : 0;
}

int stencil_attention_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f");
}
