/* Batch-invariant GEMM straight from GGUF's quantized blocks, int8 activations: y = x @ W.T.
 *
 * Why: a GGUF file's matrices are rows of blocks (ggml's ggml-common.h: block_q4_0 .. block_q6_K).
 * Reading them as they are keeps the resident weight exactly the file's size (no repacking, no
 * fp32 scale planes, no dense copy) and is what llama.cpp's vec_dot does for one row of
 * activations: decode a block's codes in registers, multiply them with int8 activations in
 * integer, scale in float. A decode step (1 row) is then bound by how fast the weights stream.
 *
 * Weight model. Every supported type decodes, per unit of 32 consecutive weights of a row, to
 * codes c (uint8, Q8_0: |q| with the sign moved onto the activations) and, per 16 weights, an
 * fp32 scale s and offset z: W[n, k] = c s + z (all exact in fp32: fp16 d times a <= 8-bit
 * integer):
 *   Q4_0  c = q (0..15)         s = d        z = -8 d          Q4_1  s = d, z = m
 *   Q5_0  c = q (0..31)         s = d        z = -16 d         Q5_1  s = d, z = m
 *   Q8_0  c = |q|, sign(q)      s = d        z = 0   (byte dot products: c = q, see ISAs)
 *   Q4_K  c = q (0..15), Q5_K c = q (0..31): s = d sc_j, z = -(dmin m_j), j the sub-block of 32
 *   Q6_K  c = q (0..63)         s = d sc_j   z = -32 s, j the sub-block of 16 (in W and M, below)
 *
 * Activations (per row and group, the two int8 terms of vnni_gemm.c; a group is 32 inputs for
 * the 32-weight types and a whole super-block of 256 for the k-quants, whose sub-block scales
 * are then applied in integer): dq = max|x_g| / 127, q1 = clamp(round(x / dq)),
 * q2 = clamp(round((x - q1 dq) 256 / dq)), both in -127..127, so x = dq (q1 + q2 / 256) + e,
 * |e| <= max|x_g| / 32512 (up to fp32 rounding: a residual a hair over half a step, its q2 clamped
 * from 128 to 127, reaches 1.0002 times that); dx = dq / 256 (exact), stored once per 32 inputs. The sums of each 16
 * inputs: for the 32-weight types X16, fp32 sums of the raw x (the two halves added lane-wise,
 * then hsum's order); for the k-quants B16, the exact int32 sums of 256 q1 + q2 (the inputs in
 * units of dx: every weight's offset meets the same activations as its codes). With one term
 * (q2 NULL) the activations are dq q1 alone (|e| <= max|x_g| / 254, as llama.cpp's Q8_0 / Q8_K
 * blocks) and every dot product with q2 is skipped: half the integer work. One term is
 * llama.cpp's arithmetic, not only its precision (ggml-cpu's quantize_row_q8_0 / q8_K and
 * vec_dot_*_q8_*): the group's scale is 1 / (127 / max|x|) for a super-block (Q8_K keeps an fp32
 * d) and max|x| / 127 rounded to fp16 for 32 inputs (Q8_0 stores d as fp16; the codes still come
 * from the fp32 127 / max), and X16 sums the quantized inputs, dq * (sum of the 16 q1) (B16: 256
 * times the sum of the q1), so that y = W . (dq q1) up to fp32 rounding, as llama.cpp gets it (its
 * integer dot products fold the offsets in; Q4_1 / Q5_1's Q8_1 sums are also rounded to fp16
 * there, not here). stencil_gguf_quantize writes them; kernels/ggml_blocks.py's
 * reference_activations is the same arithmetic in torch.
 *
 * Per output element y[r, n], in this order and nothing else (so a row's bits never depend on
 * the batch, the columns asked for or the threads), for each span of 256 weights (8 units of 32;
 * the last span of a 32-block type may have fewer):
 *   Q4_K, Q5_K: two exact integers per span, W = sum_u sc_u (256 c_u . q1_u + c_u . q2_u) (int64;
 *             one term: 256 sum_u sc_u c_u . q1_u) and M = sum_j m_j B32_j (int32, B32_j =
 *             B16[2j] + B16[2j + 1], the sums of sub-block j's inputs), sc_u, m_j the 6-bit
 *             scales and mins; the span's value v = float(W) (d dx) - float(M) (dmin dx), and
 *             y = ((0 + v_0) + v_1) + ... in span order.
 *   Q6_K:     likewise W = sum_j sc_j (256 c_j . q1_j + c_j . q2_j) over its 16 sub-blocks j of 16
 *             weights (int64; sc_j the signed 8-bit scales), M = sum_j sc_j B16_j (int32), and
 *             v = float(W - 32 M) (d dx): the weights d sc_j (c - 32), exactly.
 *             W and M being exact, the integer work of the k-quants may be organised in any way
 *             that fits the rows at hand, with the same bits: one column at a time
 *             (kquant_column, column_tile), eight columns whose lane sums are taken together
 *             (kquant_cols8_few, q6k_cols8_few: a decode step's rows), or sixteen columns
 *             transposed so that a vector lane holds a column and an activation word is broadcast
 *             (cols16, AVX512: from COLS16_MIN_ROWS rows, prompts and large batches).
 *   The 32-blocks, acc and zacc 8 fp32 lanes from 0, y = hsum(acc) + hsum(zacc) (hsum in a
 *   fixed order):
 *   32-blocks: per unit u, S = 256 dot(c_u, q1_u) + dot(c_u, q2_u) (exact, |S| < 2^24)
 *             acc = acc + float(S) * (d_u dx_u)
 *             zacc = (zacc + z[0:8] X16[0:8]) + z[8:16] X16[8:16]
 *             Lane l of S holds the products of the unit's weights 4l..4l+3, so these float sums
 *             depend on that lane layout; a lane may still live elsewhere with its operations
 *             unchanged: one column at a time keeps acc in a 256-bit register (column_tile), and
 *             from BLOCKS16_MIN_ROWS rows (AVX512) each of the eight lanes becomes a register of
 *             sixteen columns (blocks16), which saves the decode and the lane shuffles per row.
 * The file is compiled with -ffp-contract=off: no multiply-add is fused, so every ISA below gives
 * the same bits (the integer sums are exact whichever instruction computes them).
 *
 * With byte dot products (DOT_BYTES: AVX512-VNNI, AVX-VNNI), a 32-weight unit's S is one VPDPBUSD
 * per term and a shift; Q8_0, whose codes are signed, keeps them so, and multiplies activations
 * made unsigned once per call (u = a + 128, the bytes XOR 0x80): u . q - 128 sum(q) = a . q, the
 * weights' sum from one more VPDPBUSD against 128s. Against moving the sign onto the activations
 * per column, six instructions a unit instead of eleven: a 4096 x 14336 Q8_0 matrix at one row
 * and one thread 21.2 -> 25.8 GB/s, llama.cpp 24.5-25.3 (2-core AMD EPYC, `stencil bench rows`).
 *
 * ISAs (chosen at compile time by -march=native): AVX512-VNNI and AVX-VNNI (VPDPBUSD multiplies
 * four pairs of bytes and accumulates in one instruction; VPDPWSSD applies Q6_K's integer scales
 * likewise), AVX2 (VPMADDUBSW + VPMADDWD; no saturation: c <= 63 with |q| <= 127, or c = |q8| <=
 * 128, keeps each i16 pair below 32767), or plain C (tests/test_kquants.py checks that it gives
 * this build's bits). GCC vector extensions carry the rest, on 256-bit vectors, but for the
 * 512-bit paths of AVX512 builds (WIDE_SPANS, cols16).
 *
 * One row (a decode step) is bound by how fast the weights arrive: the k-quant spans are
 * prefetched PREFETCH_SPANS ahead (the hardware prefetcher alone kept a 1B model's Q4_K / Q6_K
 * matrices at 18 GB/s on a 2-core AMD EPYC whose DRAM streams 34; with it 24-25 GB/s), the
 * 32-weight types' spans BLOCK_SPANS_AHEAD ahead (Q8_0 from DRAM at one thread 5-6 -> 9-10 GB/s,
 * Q5_0 4 -> 6-8: `stencil bench rows`). Both distances are 40 spans (5.6-8.4 KB for the k-quants,
 * 7-11 KB for the 32-weight types): on a 2-core AMD EPYC whose one thread streams 25-28 GB/s
 * (llama.cpp's own kernels), 16 k-quant and 8 block spans left one row at 15-20 GB/s (Q4_K, Q6_K)
 * and 12-16 (Q5_0, Q8_0); at 40, 18-27 and 15-24, two exact terms (`stencil bench rows`, 2026-12-07;
 * 32 and 64 measured too, 64 a little slower). Q6_K's
 * integer sums run in four independent chains per term and a sub-block's scale reaches every
 * lane by one byte shuffle; Q4_K / Q5_K merge the two terms before their unit's scale (one
 * VPMULLD a unit) and read the 12 scale bytes with vector shifts. Many rows (a prompt, a batch)
 * are bound by the integer work: Q4_K / Q5_K's eight transposed columns do a span's 512 products
 * a row in 16 VPDPBUSD and two VPMULLD (one column at a time needs about 55 instructions): on a
 * 2-core AMD EPYC, a 8192 x 2048 Q4_K matrix at 32-128 rows 71 -> 120 G multiply-adds a second
 * (`stencil bench cpu_kernels`); at one row see kquant_cols8_few. With AVX512 (WIDE_SPANS), sixteen
 * columns share a 512-bit register (cols16, the same bits): on a 2-core AMD EPYC with 512-bit
 * datapaths, one thread, Q4_K 8192 x 2048 at 32 rows 1.5 -> 2.5 GB/s of weights, at 8 rows 4.8 -> 6.8.
 *
 * Layouts: w uint8 [N, row_bytes] (GGUF rows of blocks); q1, q2 int8 [M, K]; dx fp32
 * [M, 8 S], X16 fp32 or B16 int32 [M, 16 S] (the same place) with S = ceil(K / 256) spans
 * (padding zero); y fp32 [M, ldy].
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

typedef uint8_t u8x32 __attribute__((vector_size(32)));
typedef int8_t i8x32 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef int16_t i16x16 __attribute__((vector_size(32)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef int8_t i8x16 __attribute__((vector_size(16)));
typedef int8_t i8x8 __attribute__((vector_size(8)));
typedef uint8_t u8x8 __attribute__((vector_size(8)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));

enum { Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, NTYPES };
static const int BLOCK_BYTES[NTYPES] = {18, 20, 22, 24, 34, 144, 176, 210};
static const int BLOCK_WEIGHTS[NTYPES] = {32, 32, 32, 32, 32, 256, 256, 256};
#define SPAN 256
#define TILE_MAX 8
#if defined(__AVX512F__)
/* Activation rows a weight column is decoded for at once (column_tile): 8 where 32 vector
 * registers hold their accumulators (the 32-weight types at 32 rows, two threads, 2-core AMD
 * EPYC: Q5_0 / Q4_1 / Q8_0 1.4-2.2 -> 1.6-2.3 GB/s against 4), else 4. */
#define TILE_ROWS 8
#else
#define TILE_ROWS 4
#endif
#ifndef PREFETCH_SPANS
#define PREFETCH_SPANS 40
#endif
#define ROW_BLOCK 32 /* rows whose activations stay in cache while the columns stream past */

#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
/* Byte dot products in one instruction (VPDPBUSD): the 32-weight types take them per term, and
 * Q8_0 keeps its signed codes, the activations biased to unsigned instead (column_tile). */
#define DOT_BYTES 1
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* The k-quants at a few rows: two units' codes in one 512-bit register (kquant_span_sum,
 * q6k_span); at many rows sixteen columns in one (cols16). */
#define WIDE_SPANS 1
#endif

static inline u8x32 load32(const void *p) {
    u8x32 v;
    memcpy(&v, p, 32);
    return v;
}

/* IEEE half to float, exact (subnormals, infinities and NaNs included). */
static inline float h2f(const uint8_t *p) {
#ifdef __F16C__
    return _cvtsh_ss((unsigned short)(p[0] | p[1] << 8));
#endif
    const uint32_t h = (uint32_t)p[0] | (uint32_t)p[1] << 8;
    const uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 31, m = h & 1023;
    uint32_t bits;
    if (e == 0) {
        float f = (float)m * 0x1p-24f; /* exact: m < 2^10 */
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (e == 31) {
        bits = sign | 0x7f800000u | m << 13;
    } else {
        bits = sign | (e + 112) << 23 | m << 13;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* byte i of BIT_BYTES[b] is 16 where bit i of b is set: a 5th code bit in place. */
static uint64_t BIT_BYTES[256];
__attribute__((constructor)) static void init_bit_bytes(void) {
    for (int b = 0; b < 256; ++b) {
        uint64_t v = 0;
        for (int i = 0; i < 8; ++i)
            if (b >> i & 1) v |= (uint64_t)16 << (8 * i);
        BIT_BYTES[b] = v;
    }
}

/* The 32 high bits of a Q5_0 / Q5_1 block (little-endian uint32 qh) as 0 / 16 bytes. */
static inline u8x32 high_bits32(const uint8_t *qh) {
#if defined(__AVX2__)
    uint32_t bits;
    memcpy(&bits, qh, 4);
    /* lane i takes byte i / 8 of qh and keeps bit i % 8 of it */
    const __m256i which = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    const __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), which), bit);
    return (u8x32)_mm256_and_si256(_mm256_cmpeq_epi8(v, bit), _mm256_set1_epi8(16));
#else
    uint64_t t[4] = {BIT_BYTES[qh[0]], BIT_BYTES[qh[1]], BIT_BYTES[qh[2]], BIT_BYTES[qh[3]]};
    u8x32 v;
    memcpy(&v, t, 32);
    return v;
#endif
}

/* 16 bytes of nibbles -> 32 codes: the low nibbles (weights 0-15), then the high ones. */
static inline u8x32 nibbles16(const uint8_t *qs) {
#if defined(__AVX2__)
    const __m128i q = _mm_loadu_si128((const __m128i *)qs);
    return (u8x32)_mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(15));
#endif
    uint8_t t[32];
    memcpy(t, qs, 16);
    memcpy(t + 16, qs, 16);
    const u8x32 v = load32(t);
    const u8x32 lo = {15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15};
    return (v & lo) | ((v >> 4) & ~lo & 15);
}

static inline f32x8 splat(float f) { return (f32x8){f, f, f, f, f, f, f, f}; }

static inline float hsum(f32x8 v) {
    return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}


/* Exact i16 pair products: lane l = c[2l] a[2l] + c[2l+1] a[2l+1] (no saturation: c <= 128 and
 * |a| <= 127, and c <= 63 when a pair can reach 2 * 128 * 127 > 32767 is impossible). */
static inline i16x16 pairs(u8x32 c, i8x32 a) {
#if defined(__AVX2__)
    return (i16x16)_mm256_maddubs_epi16((__m256i)c, (__m256i)a);
#else
    i16x16 p;
    for (int l = 0; l < 16; ++l) p[l] = (int16_t)(c[2 * l] * a[2 * l] + c[2 * l + 1] * a[2 * l + 1]);
    return p;
#endif
}

/* acc + lane sums of p * s over pairs of i16 lanes (exact in int32). */
static inline i32x8 madd_acc(i32x8 acc, i16x16 p, i16x16 s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return (i32x8)_mm256_dpwssd_epi32((__m256i)acc, (__m256i)p, (__m256i)s);
#elif defined(__AVXVNNI__)
    return (i32x8)_mm256_dpwssd_avx_epi32((__m256i)acc, (__m256i)p, (__m256i)s);
#elif defined(__AVX2__)
    return acc + (i32x8)_mm256_madd_epi16((__m256i)p, (__m256i)s);
#else
    for (int l = 0; l < 8; ++l) acc[l] += p[2 * l] * s[2 * l] + p[2 * l + 1] * s[2 * l + 1];
    return acc;
#endif
}

/* acc + lane sums of four products: lane l gains c[4l..4l+3] . a[4l..4l+3] (exact in int32:
 * c <= 31, |a| <= 127). */
static inline i32x8 dot4_acc(i32x8 acc, u8x32 c, i8x32 a) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return (i32x8)_mm256_dpbusd_epi32((__m256i)acc, (__m256i)c, (__m256i)a);
#elif defined(__AVXVNNI__)
    return (i32x8)_mm256_dpbusd_avx_epi32((__m256i)acc, (__m256i)c, (__m256i)a);
#elif defined(__AVX2__)
    return acc + (i32x8)_mm256_madd_epi16(_mm256_maddubs_epi16((__m256i)c, (__m256i)a), _mm256_set1_epi16(1));
#else
    for (int l = 0; l < 8; ++l)
        for (int i = 0; i < 4; ++i) acc[l] += c[4 * l + i] * a[4 * l + i];
    return acc;
#endif
}

/* Lane u = the sum of t[u]'s eight lanes, for lanes whose absolute values sum below 2^31 (exact
 * in any order). */
static inline i32x8 lane_sums8(const i32x8 *t) {
#if defined(__AVX2__)
    const __m256i s01 = _mm256_hadd_epi32((__m256i)t[0], (__m256i)t[1]);
    const __m256i s23 = _mm256_hadd_epi32((__m256i)t[2], (__m256i)t[3]);
    const __m256i s45 = _mm256_hadd_epi32((__m256i)t[4], (__m256i)t[5]);
    const __m256i s67 = _mm256_hadd_epi32((__m256i)t[6], (__m256i)t[7]);
    /* per 128-bit half: the sums of lanes 0-3 (low half) and 4-7 (high half) of t[0..3], t[4..7] */
    const __m256i a = _mm256_hadd_epi32(s01, s23), b = _mm256_hadd_epi32(s45, s67);
    return (i32x8)_mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
#else
    i32x8 d;
    for (int u = 0; u < 8; ++u) {
        int32_t v = 0;
        for (int l = 0; l < 8; ++l) v += t[u][l];
        d[u] = v;
    }
    return d;
#endif
}

/* The integer sums of 32 activations from those of 16 (b0 = B16[0:8], b1 = B16[8:16]): lane j =
 * B16[2j] + B16[2j + 1]. */
static inline i32x8 sums32(i32x8 b0, i32x8 b1) {
    return __builtin_shuffle(b0, b1, (i32x8){0, 2, 4, 6, 8, 10, 12, 14}) +
           __builtin_shuffle(b0, b1, (i32x8){1, 3, 5, 7, 9, 11, 13, 15});
}

/* The eight bytes of v as int32 lanes (zero-extended). */
static inline i32x8 widen8(uint64_t v) {
#if defined(__AVX2__)
    return (i32x8)_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)v));
#else
    i32x8 out;
    for (int l = 0; l < 8; ++l) out[l] = (int32_t)((v >> (8 * l)) & 0xff);
    return out;
#endif
}

static inline f32x8 load8f(const float *p) {
    f32x8 v;
    memcpy(&v, p, 32);
    return v;
}

typedef int64_t i64x8 __attribute__((vector_size(64)));

static inline i64x8 wide(i32x8 v) { return __builtin_convertvector(v, i64x8); }

/* The sum of v's lanes, for lanes whose absolute values sum below 2^31 (exact in any order). */
static inline int32_t hsum_i32(i32x8 v) {
    uint32_t t = 0; /* unsigned: wraps nowhere for such lanes, and never undefined */
    for (int l = 0; l < 8; ++l) t += (uint32_t)v[l];
    return (int32_t)t;
}

/* W of a Q4_K / Q5_K span for eight outputs (lanes), exact, from the lane sums A, B of the high
 * and low halves of kquant_span's S. */
static inline i64x8 span_w(const int TERMS, i32x8 A, i32x8 B) {
    return ((wide(A) << 16) + wide(B)) << (TERMS == 2 ? 0 : 8); /* in units of dx */
}

/* The span's values v = float(W) (d dx) - float(M) (dmin dx), d, dmin, dx per lane (int64 ->
 * float rounds to nearest on every path). */
static inline f32x8 span_values(i64x8 W, i32x8 M, f32x8 d, f32x8 dmin, f32x8 dx) {
    return __builtin_convertvector(W, f32x8) * (d * dx) - __builtin_convertvector(M, f32x8) * (dmin * dx);
}

/* One span of one weight row, decoded. */
typedef struct {
    u8x32 c[8];     /* codes of units 0..7 */
#ifdef WIDE_SPANS
    __m512i c2[4];  /* k-quants decoded wide: the codes of units 2i (low half) and 2i + 1 */
    __m512i sc2[4]; /* Q6_K decoded wide: sc[2i] and sc[2i + 1] (its pairs' scales) in one register */
#endif
    i8x32 neg[8];   /* Q8_0: -1 where the weight is negative, else 0 */
    i16x16 sc[8];   /* Q6_K: the integer sub-block scale of each pair of weights of a unit */
    i32x8 sc32;     /* Q4_K, Q5_K: lane u the integer scale of unit u */
    const int8_t *sc16; /* Q6_K: the 16 sub-blocks' integer scales (in the block) */
    i32x8 m32;      /* Q4_K, Q5_K: lane u the integer min of unit u */
    uint64_t m8;    /* Q4_K, Q5_K: byte u the integer min of unit u */
    float dmin;     /* Q4_K, Q5_K: the super-block's dmin */
    f32x8 d;        /* k-quants: lane 0 the super-block's d; 32-blocks: each block's d */
    f32x8 z[2];     /* offsets of the span's 16 groups of 16 weights (32-blocks: 0 past the row's end) */
    int units;
} span_t;

/* sc (bytes 0-7) and m (bytes 8-15) of Q4_K / Q5_K's 8 sub-blocks, 6 bits each, from the 12
 * packed bytes (ggml's get_scale_min_k4, four words at a time). */
static inline void scale_min_k4(const uint8_t *q, uint8_t *out) {
    uint32_t w[3], o[4];
    memcpy(w, q, 12);
    const uint32_t low6 = 0x3f3f3f3fu, low4 = 0x0f0f0f0fu, top2 = 0x03030303u;
    o[0] = w[0] & low6;
    o[1] = (w[2] & low4) | (((w[0] >> 6) & top2) << 4);
    o[2] = w[1] & low6;
    o[3] = ((w[2] >> 4) & low4) | (((w[1] >> 6) & top2) << 4);
    memcpy(out, o, 16);
}

/* 8 halves at p, p + stride, ... as floats (exact). */
static inline f32x8 halves8(const uint8_t *p, size_t stride, int n) {
    uint16_t h[8] = {0};
    for (int i = 0; i < n; ++i) memcpy(h + i, p + i * stride, 2);
#ifdef __F16C__
    __m128i v;
    memcpy(&v, h, 16);
    return (f32x8)_mm256_cvtph_ps(v);
#else
    f32x8 f;
    for (int i = 0; i < 8; ++i) f[i] = h2f((const uint8_t *)(h + i));
    return f;
#endif
}

static const i32x8 PAIRS_LO = {0, 0, 1, 1, 2, 2, 3, 3}, PAIRS_HI = {4, 4, 5, 5, 6, 6, 7, 7};

/* Decode span `span` of row `row` (K weights) into sp; a k-quant's codes into c2 (Q6_K's pair
 * scales into sc2) where `wide` (and WIDE_SPANS), else into c (and sc). */
__attribute__((always_inline)) static inline void decode_span(const int type, const uint8_t *row, int k, int span,
                                                              span_t *sp, const int wide) {
    if (type >= Q4_K) {
        const uint8_t *b = row + (size_t)span * BLOCK_BYTES[type];
        sp->units = 8;
        if (type == Q6_K) {
            const uint8_t *ql = b, *qh = b + 128;
            const float d = h2f(b + 208);
            sp->d = splat(d);
            sp->sc16 = (const int8_t *)(b + 192);
#ifdef WIDE_SPANS
            if (wide) {
                /* units 4n, 4n + 1 (ql's 64 bytes from 64n, low nibbles) and 4n + 2, 4n + 3 (high
                 * nibbles), the two high bits from qh's 32 bytes in both halves, shifted per half */
                const __m512i low4 = _mm512_set1_epi8(15), top2 = _mm512_set1_epi8(0x30);
                const __m512i up = _mm512_mask_blend_epi64(0xf0, _mm512_set1_epi16(4), _mm512_set1_epi16(2));
                const __m512i down = _mm512_mask_blend_epi64(0xf0, _mm512_setzero_si512(), _mm512_set1_epi16(2));
                for (int n = 0; n < 2; ++n) {
                    const __m512i L = _mm512_loadu_si512(ql + 64 * n);
                    const __m512i H = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qh + 32 * n)));
                    sp->c2[2 * n] = _mm512_or_si512(_mm512_and_si512(L, low4),
                                                    _mm512_and_si512(_mm512_sllv_epi16(H, up), top2));
                    sp->c2[2 * n + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L, 4), low4),
                                                        _mm512_and_si512(_mm512_srlv_epi16(H, down), top2));
                }
                /* i16 lane l of sc2[i]: the scale of weights 2l, 2l + 1 of units 2i, 2i + 1 */
                const __m512i sc16 = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192))));
                for (int i = 0; i < 4; ++i) {
                    const __m512i at = _mm512_add_epi16(_mm512_set1_epi16((short)(4 * i)),
                                                        _mm512_srli_epi16(_mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16,
                                                                                           15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 3));
                    sp->sc2[i] = _mm512_permutexvar_epi16(at, sc16);
                }
                return;
            }
#endif
            /* Shifts by 16-bit lanes, then masks: the bits a lane's neighbour pushes in are masked
             * off (x86 has no byte shift; one emulated by additions cost 32 instructions a span). */
            for (int n = 0; n < 2; ++n) {
                const u8x32 l0 = load32(ql + 64 * n), l1 = load32(ql + 64 * n + 32), h = load32(qh + 32 * n);
                const u16x16 h16 = (u16x16)h;
                sp->c[4 * n + 0] = (l0 & 15) | ((u8x32)(h16 << 4) & 0x30);
                sp->c[4 * n + 1] = (l1 & 15) | ((u8x32)(h16 << 2) & 0x30);
                sp->c[4 * n + 2] = ((u8x32)((u16x16)l0 >> 4) & 15) | (h & 0x30);
                sp->c[4 * n + 3] = ((u8x32)((u16x16)l1 >> 4) & 15) | ((u8x32)(h16 >> 2) & 0x30);
            }
            i8x16 sc8;
            memcpy(&sc8, b + 192, 16);
            const i16x16 sc = __builtin_convertvector(sc8, i16x16);
#define UNIT_SCALES(u) __builtin_shuffle(sc, (i16x16){2 * u, 2 * u, 2 * u, 2 * u, 2 * u, 2 * u, 2 * u, 2 * u, \
                                     2 * u + 1, 2 * u + 1, 2 * u + 1, 2 * u + 1, 2 * u + 1, 2 * u + 1, 2 * u + 1, 2 * u + 1})
            sp->sc[0] = UNIT_SCALES(0); sp->sc[1] = UNIT_SCALES(1); sp->sc[2] = UNIT_SCALES(2);
            sp->sc[3] = UNIT_SCALES(3); sp->sc[4] = UNIT_SCALES(4); sp->sc[5] = UNIT_SCALES(5);
            sp->sc[6] = UNIT_SCALES(6); sp->sc[7] = UNIT_SCALES(7);
#undef UNIT_SCALES
            return;
        }
        const float d = h2f(b), dmin = h2f(b + 2);
        sp->d = splat(d);
        const uint8_t *qs = b + (type == Q4_K ? 16 : 48);
#ifdef WIDE_SPANS
        if (wide) {
            /* 32 bytes of nibbles in both halves, the high half's 16-bit words shifted by 4: units
             * 2i and 2i + 1 (the 5th bits likewise, each half by its unit's shift) */
            const __m512i nib = _mm512_set1_epi8(15);
            const __m512i by4 = _mm512_mask_blend_epi64(0xf0, _mm512_setzero_si512(), _mm512_set1_epi16(4));
            __m512i h5 = _mm512_setzero_si512();
            if (type == Q5_K) h5 = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 16)));
            for (int i = 0; i < 4; ++i) {
                const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qs + 32 * i)));
                __m512i c = _mm512_and_si512(_mm512_srlv_epi16(v, by4), nib);
                if (type == Q5_K) {
                    /* unit j's bit j moves to bit 4: left by 4 - j (j <= 4), right by j - 4 */
                    const __m512i lo = _mm512_set1_epi16((short)(2 * i)), hi = _mm512_set1_epi16((short)(2 * i + 1));
                    const __m512i j = _mm512_mask_blend_epi64(0xf0, lo, hi);
                    const __m512i up = _mm512_sllv_epi16(h5, _mm512_sub_epi16(_mm512_set1_epi16(4), j));
                    const __m512i down = _mm512_srlv_epi16(h5, _mm512_sub_epi16(j, _mm512_set1_epi16(4)));
                    const __m512i bit = i < 2 ? up : (i == 2 ? _mm512_mask_blend_epi64(0xf0, up, down) : down);
                    c = _mm512_or_si512(c, _mm512_and_si512(bit, _mm512_set1_epi8(16)));
                }
                sp->c2[i] = c;
            }
        } else
#endif
        for (int i = 0; i < 4; ++i) {
            const u8x32 v = load32(qs + 32 * i);
            sp->c[2 * i] = v & 15;
            sp->c[2 * i + 1] = v >> 4;
        }
        if (type == Q5_K) {
            const u16x16 h = (u16x16)load32(b + 16); /* bit j of byte l: the 5th bit of unit j's weight l */
            for (int j = 0; j < 8; ++j) sp->c[j] |= (u8x32)(j <= 4 ? h << (4 - j) : h >> (j - 4)) & 16;
        }
#if defined(__AVX2__)
        /* get_scale_min_k4 on the three words w0 w1 w2 at once, as 32-bit lanes: lanes 0-3 of the
         * result are sc 0-3, sc 4-7, m 0-3, m 4-7 (scale_min_k4's o[0..3]) */
        const __m128i w = _mm_loadu_si128((const __m128i *)(b + 4)); /* 12 bytes used (inside the block) */
        const __m128i lo = _mm_and_si128(_mm_srlv_epi32(_mm_shuffle_epi32(w, 0x98), _mm_setr_epi32(0, 0, 0, 4)),
                                         _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
        const __m128i hi = _mm_and_si128(_mm_srli_epi32(_mm_shuffle_epi32(w, 0x50), 2),
                                         _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
        const __m128i smv = _mm_or_si128(lo, hi);
        sp->sc32 = (i32x8)_mm256_cvtepu8_epi32(smv);
        sp->m32 = (i32x8)_mm256_cvtepu8_epi32(_mm_srli_si128(smv, 8));
        sp->m8 = (uint64_t)_mm_extract_epi64(smv, 1);
#else
        uint8_t sm[16];
        scale_min_k4(b + 4, sm);
        for (int j = 0; j < 8; ++j) {
            sp->sc32[j] = sm[j];
            sp->m32[j] = sm[8 + j];
        }
        sp->m8 = 0;
        for (int j = 0; j < 8; ++j) sp->m8 |= (uint64_t)sm[8 + j] << (8 * j);
#endif
        sp->dmin = dmin;
        return;
    }
    const int first = span * 8, blocks = k / 32, units = blocks - first < 8 ? blocks - first : 8;
    const int bb = BLOCK_BYTES[type];
    const uint8_t *b0 = row + (size_t)first * bb;
    sp->units = units;
    sp->d = halves8(b0, bb, units);
    f32x8 z = splat(0.0f);
    if (type == Q4_0) z = splat(-8.0f) * sp->d;
    if (type == Q5_0) z = splat(-16.0f) * sp->d;
    if (type == Q4_1 || type == Q5_1) z = halves8(b0 + 2, bb, units);
    sp->z[0] = __builtin_shuffle(z, PAIRS_LO);
    sp->z[1] = __builtin_shuffle(z, PAIRS_HI);
    for (int u = 0; u < units; ++u) {
        const uint8_t *b = b0 + (size_t)u * bb;
        switch (type) {
        case Q4_0: sp->c[u] = nibbles16(b + 2); break;
        case Q4_1: sp->c[u] = nibbles16(b + 4); break;
        case Q5_0: sp->c[u] = nibbles16(b + 6) | high_bits32(b + 2); break;
        case Q5_1: sp->c[u] = nibbles16(b + 8) | high_bits32(b + 4); break;
        default: { /* Q8_0 */
#ifdef DOT_BYTES
            sp->c[u] = load32(b + 2); /* q itself (signed): column_tile biases the activations */
#else
            const i8x32 q = (i8x32)load32(b + 2);
            sp->neg[u] = q < 0;
            sp->c[u] = (u8x32)((q ^ sp->neg[u]) - sp->neg[u]); /* |q|; -128 -> 128 as uint8 */
#endif
        }
        }
    }
}

/* Lane u of a vector, in all lanes. */
static const i32x8 LANE[8] = {{0, 0, 0, 0, 0, 0, 0, 0}, {1, 1, 1, 1, 1, 1, 1, 1}, {2, 2, 2, 2, 2, 2, 2, 2},
                              {3, 3, 3, 3, 3, 3, 3, 3}, {4, 4, 4, 4, 4, 4, 4, 4}, {5, 5, 5, 5, 5, 5, 5, 5},
                              {6, 6, 6, 6, 6, 6, 6, 6}, {7, 7, 7, 7, 7, 7, 7, 7}};

typedef struct {
    const int8_t *q1, *q2;
    const uint8_t *u1, *u2; /* DOT_BYTES, Q8_0: q1 + 128 and q2 + 128 as uint8 (NULL otherwise) */
    const float *dx, *x16;
    int k, spans, terms; /* terms: 2, or 1 (q2 neither written nor read) */
} acts_t;

/* Span s + PREFETCH_SPANS of the weight row at w on its way into the cache (past the row's end:
 * the next row's, the next column when the rows are adjacent). */
static inline void prefetch_ahead_in_row(const int type, const uint8_t *w, int s) {
    const char *p = (const char *)w + (size_t)(s + PREFETCH_SPANS) * BLOCK_BYTES[type];
    for (int l = 0; l < BLOCK_BYTES[type]; l += 64) __builtin_prefetch(p + l, 0, 0);
}

#ifndef BLOCK_SPANS_AHEAD
#define BLOCK_SPANS_AHEAD 40
#endif
/* For the 32-weight types, whose span is eight blocks: span s + BLOCK_SPANS_AHEAD of the row at w
 * on its way into the cache (past the row's end: the next row's, where the rows are adjacent).
 * Without it a one-row Q8_0 matrix streamed from DRAM at a third of its in-cache rate. */
static inline void prefetch_blocks_ahead(const int type, const uint8_t *w, int s) {
    const int bytes = 8 * BLOCK_BYTES[type];
    const char *p = (const char *)w + (size_t)(s + BLOCK_SPANS_AHEAD) * bytes;
    for (int l = 0; l < bytes; l += 64) __builtin_prefetch(p + l, 0, 0);
}

#ifndef LONG_ROW_SPANS
#define LONG_ROW_SPANS 16 /* rows of more spans take the few-row paths span by span (*_cols8_spans) */
#endif
#ifndef SIDE_AHEAD
#define SIDE_AHEAD 8 /* spans ahead in each of the eight rows read side by side (*_cols8_spans) */
#endif
#ifndef GROUP_AHEAD
#define GROUP_AHEAD 2
#endif
/* The span GROUP_AHEAD after span s of weight row w on its way into the cache: in w, or in the
 * row that the same lane reads next (wnext, none when NULL) past w's end. */
static inline void prefetch_ahead(const int type, const uint8_t *w, const uint8_t *wnext, int s, int spans) {
    const int t = s + GROUP_AHEAD;
    const uint8_t *row = t < spans ? w : wnext;
    if (!row) return;
    const char *p = (const char *)row + (size_t)(t < spans ? t : t - spans) * BLOCK_BYTES[type];
    for (int l = 0; l < BLOCK_BYTES[type]; l += 64) __builtin_prefetch(p + l, 0, 0);
}

/* Span s + SIDE_AHEAD of weight row j of eight read side by side (past the row's end: the next
 * eight rows' first spans, none when wnext[j] is NULL) on its way into the cache. */
static inline void prefetch_side(const int type, const uint8_t *const *wrow, const uint8_t *const *wnext, int j, int s,
                                 int spans) {
    const int t = s + SIDE_AHEAD, bb = BLOCK_BYTES[type];
    const uint8_t *row = t < spans ? wrow[j] : wnext[j];
    if (!row) return;
    const char *q = (const char *)row + (size_t)(t < spans ? t : t - spans) * bb;
    for (int l = 0; l < bb; l += 64) __builtin_prefetch(q + l, 0, 0);
}

/* out[l] lane j = in[j] lane l (32-bit lanes). */
static inline void transpose8(const i32x8 *in, i32x8 *out) {
#if defined(__AVX2__)
    const __m256i *v = (const __m256i *)in;
    const __m256i t0 = _mm256_unpacklo_epi32(v[0], v[1]), t1 = _mm256_unpackhi_epi32(v[0], v[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(v[2], v[3]), t3 = _mm256_unpackhi_epi32(v[2], v[3]);
    const __m256i t4 = _mm256_unpacklo_epi32(v[4], v[5]), t5 = _mm256_unpackhi_epi32(v[4], v[5]);
    const __m256i t6 = _mm256_unpacklo_epi32(v[6], v[7]), t7 = _mm256_unpackhi_epi32(v[6], v[7]);
    const __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
    const __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
    const __m256i u4 = _mm256_unpacklo_epi64(t4, t6), u5 = _mm256_unpackhi_epi64(t4, t6);
    const __m256i u6 = _mm256_unpacklo_epi64(t5, t7), u7 = _mm256_unpackhi_epi64(t5, t7);
    out[0] = (i32x8)_mm256_permute2x128_si256(u0, u4, 0x20);
    out[1] = (i32x8)_mm256_permute2x128_si256(u1, u5, 0x20);
    out[2] = (i32x8)_mm256_permute2x128_si256(u2, u6, 0x20);
    out[3] = (i32x8)_mm256_permute2x128_si256(u3, u7, 0x20);
    out[4] = (i32x8)_mm256_permute2x128_si256(u0, u4, 0x31);
    out[5] = (i32x8)_mm256_permute2x128_si256(u1, u5, 0x31);
    out[6] = (i32x8)_mm256_permute2x128_si256(u2, u6, 0x31);
    out[7] = (i32x8)_mm256_permute2x128_si256(u3, u7, 0x31);
#else
    for (int l = 0; l < 8; ++l)
        for (int j = 0; j < 8; ++j) out[l][j] = in[j][l];
#endif
}

/* One activation row against one decoded Q4_K / Q5_K span: S's lanes, the scaled integer sums of
 * four weights of each unit (header; S's lanes sum to W, or W / 256 with one term). */
__attribute__((always_inline)) static inline i32x8 kquant_span_sum(const int TERMS, const span_t *sp,
                                                                   const int8_t *q1, const int8_t *q2) {
    /* t[u]'s lanes: 256 (c . q1) + (c . q2) over four weights each; their sum times the unit's
     * scale is exact in int32 (|.| <= 32 31 127 257 63 < 2^31) */
#ifdef WIDE_SPANS
    /* two units a register (decode_span's c2): lane l of S gets the same products as below */
    const __m512i sc = _mm512_castsi256_si512((__m256i)sp->sc32);
    __m512i S2 = _mm512_setzero_si512();
    for (int i = 0; i < 4; ++i) {
        __m512i t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), sp->c2[i], _mm512_loadu_si512(q1 + 64 * i));
        if (TERMS == 2) t = _mm512_dpbusd_epi32(_mm512_slli_epi32(t, 8), sp->c2[i], _mm512_loadu_si512(q2 + 64 * i));
        const __m512i unit_sc = _mm512_permutexvar_epi32(
            _mm512_mask_blend_epi32(0xff00, _mm512_set1_epi32(2 * i), _mm512_set1_epi32(2 * i + 1)), sc);
        S2 = _mm512_add_epi32(S2, _mm512_mullo_epi32(t, unit_sc));
    }
    return (i32x8)_mm256_add_epi32(_mm512_castsi512_si256(S2), _mm512_extracti64x4_epi64(S2, 1));
#else
    i32x8 t[8];
    for (int u = 0; u < 8; ++u) {
        t[u] = dot4_acc((i32x8){0}, sp->c[u], (i8x32)load32(q1 + 32 * u));
        if (TERMS == 2) t[u] = dot4_acc(t[u] << 8, sp->c[u], (i8x32)load32(q2 + 32 * u));
    }
    int32_t sc[8];
    memcpy(sc, &sp->sc32, 32);
    i32x8 S = t[0] * sc[0]; /* |lane| <= 8 4 31 127 257 63 < 2^31 */
    for (int u = 1; u < 8; ++u) S += t[u] * sc[u];
    return S;
#endif
}

/* kquant_span_sum's S as its high and low 16 bits (p[0], p[1]: the lane sums of each fit int32). */
__attribute__((always_inline)) static inline void kquant_span(const int TERMS, const span_t *sp, const int8_t *q1,
                                                              const int8_t *q2, i32x8 *p) {
    const i32x8 S = kquant_span_sum(TERMS, sp, q1, q2);
    p[0] = S >> 16; /* S = 65536 p0 + p1 */
    p[1] = S & 0xffff;
}

/* M of a span (header) for one column: its units' mins times the sums of 32 activations. */
static inline int32_t span_m(const span_t *sp, const int32_t *b16) {
    i32x8 b0, b1;
    memcpy(&b0, b16, 32);
    memcpy(&b1, b16 + 8, 32);
    return hsum_i32(sp->m32 * sums32(b0, b1)); /* |.| summed <= 8 63 32 127 257 < 2^31 */
}

/* The span values of eight Q4_K / Q5_K columns (lanes) for one activation row: each column's S
 * (kquant_span_sum) in p[j], the mins transposed (mn[u] lane j: column j's min of unit u), d and
 * dmin per column, the row's B16 and dx (header). */
static inline f32x8 kquant_values8(const int TERMS, const i32x8 *mn, const i32x8 *p, f32x8 d, f32x8 dmin,
                                   const int32_t *b16, float dx) {
    i32x8 M = mn[0] * (b16[0] + b16[1]);
    for (int u = 1; u < 8; ++u) M += mn[u] * (b16[2 * u] + b16[2 * u + 1]);
    i32x8 hi[8], lo[8]; /* S = 65536 hi + lo: lane sums that fit int32 */
    for (int j = 0; j < 8; ++j) {
        hi[j] = p[j] >> 16;
        lo[j] = p[j] & 0xffff;
    }
    return span_values(span_w(TERMS, lane_sums8(hi), lane_sums8(lo)), M, d, dmin, splat(dx));
}

/* kquant_cols8_few's sums span by span, for rows of more than LONG_ROW_SPANS spans: the eight
 * rows stream side by side (prefetch_side), each span's S of the eight columns summed at once, and
 * nothing waits between two loops (one row, one thread, 2-core AMD EPYC: Q4_K 4096 x 14336 23.7 ->
 * 25.3 GB/s, Q5_K 21.7 -> 23.2). */
__attribute__((always_inline)) static inline void kquant_cols8_spans(const int type, const int TERMS,
                                                                     const uint8_t *const *wrow,
                                                                     const uint8_t *const *wnext, const acts_t *a,
                                                                     int r0, const int R, float *y, size_t ldy) {
    const int spans = a->spans;
    f32x8 acc[3];
    for (int r = 0; r < R; ++r) acc[r] = splat(0.0f);
    for (int s = 0; s < spans; ++s) {
        i32x8 p[R][8], mw[8], mn[8];
        float d[8], dmin[8];
        span_t sp;
        for (int j = 0; j < 8; ++j) {
            prefetch_side(type, wrow, wnext, j, s, spans);
            decode_span(type, wrow[j], a->k, s, &sp, 1);
            d[j] = sp.d[0];
            dmin[j] = sp.dmin;
            mw[j] = widen8(sp.m8);
            for (int r = 0; r < R; ++r) {
                const size_t at = (size_t)(r0 + r) * a->k + (size_t)s * SPAN;
                p[r][j] = kquant_span_sum(TERMS, &sp, a->q1 + at, a->q2 + at);
            }
        }
        transpose8(mw, mn);
        for (int r = 0; r < R; ++r) {
            const size_t rs = (size_t)(r0 + r) * spans + s;
            acc[r] = acc[r] + kquant_values8(TERMS, mn, p[r], load8f(d), load8f(dmin), (const int32_t *)a->x16 + rs * 16,
                                             a->dx[rs * 8]);
        }
    }
    for (int r = 0; r < R; ++r) memcpy(y + (size_t)r * ldy, &acc[r], 32);
}

/* y[j + r ldy] for eight Q4_K / Q5_K weight rows wrow[j] and activation rows r0 .. r0 + R - 1
 * (R <= 3, few rows: a decode step): each column's S span by span (kquant_span; the weights
 * stream one row after the other, as one column at a time would read them), then per span the
 * lane sums of the eight columns' at once (lane_sums8), their M (the mins transposed, a lane per
 * column) and the eight span values. At one row, against one column at a time with lane-wise
 * float sums (the arithmetic before W and M): as fast on rows of 2048 weights, ~15% slower on
 * rows of 8192 in cache, the 1B model's decode step unchanged (2-core AMD EPYC). The arrays kept
 * between the two loops hold S whole (its halves taken for the lane sums) and the mins as bytes,
 * 40 bytes a span and column, not 96: with the activations of a long row they fit L1 together
 * (one row through 4096 x 14336 Q4_K at one thread, two terms, 17.5 -> 19.5 GB/s; 2048-weight rows
 * 20.2 -> 21.5). Tried and dropped: passes of eight spans with M lane-summed like S (its decode
 * step 7-15% slower); passes of 4-28 spans over the eight rows with M as now, to keep a pass's
 * activations in L1 (eight weight streams at once: 15-20 GB/s on long rows, slower on short ones);
 * M per column at decode (its horizontal sum: 5-10% slower). With 512-bit registers (WIDE_SPANS)
 * two units' codes share one register and a span's S takes four VPDPBUSD a term (one row, one
 * thread, Q4_K 2048 x 2048 .. 14336 x 4096: 20-21 -> 25-27 GB/s, 2-core AMD EPYC with 48 KB L1).
 * The second loop reads no weights, and on rows of more than LONG_ROW_SPANS spans the first
 * loop's prefetch lead ran out while it ran (Q4_K 4096 x 14336 from DRAM: 19 GB/s against 25-27 on
 * shorter rows): those rows go span by span instead (kquant_cols8_spans). Tried and dropped for
 * them: requesting the next rows' spans during the second loop (23.8 GB/s), passes of 8-32 spans
 * over the eight rows with prefetches in reading order (no faster). */
__attribute__((always_inline)) static inline void kquant_cols8_few(const int type, const int TERMS,
                                                                   const uint8_t *const *wrow,
                                                                   const uint8_t *const *wnext, const acts_t *a,
                                                                   int r0, const int R, float *y, size_t ldy) {
    const int spans = a->spans;
    if (spans > LONG_ROW_SPANS) {
        kquant_cols8_spans(type, TERMS, wrow, wnext, a, r0, R, y, ldy);
        return;
    }
    i32x8 p[R][spans][8]; /* S: [row][span][column] */
    uint64_t mins[spans][8]; /* the mins' bytes: [span][column] (the arrays stay small: L1 holds them with
                              * the activations on rows of 14336) */
    float d[spans][8], dmin[spans][8];
    span_t sp;
    for (int j = 0; j < 8; ++j)
        for (int s = 0; s < spans; ++s) {
            prefetch_ahead_in_row(type, wrow[j], s);
            decode_span(type, wrow[j], a->k, s, &sp, 1);
            d[s][j] = sp.d[0];
            dmin[s][j] = sp.dmin;
            mins[s][j] = sp.m8;
            for (int r = 0; r < R; ++r) {
                const size_t at = (size_t)(r0 + r) * a->k + (size_t)s * SPAN;
                p[r][s][j] = kquant_span_sum(TERMS, &sp, a->q1 + at, a->q2 + at);
            }
        }
    f32x8 acc[3];
    for (int r = 0; r < R; ++r) acc[r] = splat(0.0f);
    for (int s = 0; s < spans; ++s) { /* each row's spans in order */
        i32x8 mw[8], mn[8];
        for (int j = 0; j < 8; ++j) mw[j] = widen8(mins[s][j]);
        transpose8(mw, mn); /* once for the rows */
        for (int r = 0; r < R; ++r) {
            const size_t rs = (size_t)(r0 + r) * spans + s;
            acc[r] = acc[r] + kquant_values8(TERMS, mn, p[r][s], load8f(d[s]), load8f(dmin[s]),
                                             (const int32_t *)a->x16 + rs * 16, a->dx[rs * 8]);
        }
    }
    for (int r = 0; r < R; ++r) memcpy(y + (size_t)r * ldy, &acc[r], 32);
}

/* Q6_K's integer sums of one span against one activation row, as lanes (their lane sums are W's
 * two terms: W = 256 sum(T[0]) + sum(T[1]), header): per unit, the pairs' products times their
 * sub-block's scale, in four independent chains per term (one chain of eight dependent VPDPWSSD
 * would bound a one-row step by its latency; integers: the same sums). Lanes |.| <= 32 63 127 128
 * (2^25), a column's lane sum <= 2^28. */
__attribute__((always_inline)) static inline void q6k_span(const int TERMS, const span_t *sp, const int8_t *q1,
                                                           const int8_t *q2, i32x8 *T, const int wide) {
#ifdef WIDE_SPANS
    if (wide) { /* decode_span's c2 and sc2: two units a register, two chains a term */
        __m512i w1[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()}, w2[2] = {w1[0], w1[1]};
        for (int i = 0; i < 4; ++i) {
            w1[i & 1] = _mm512_dpwssd_epi32(w1[i & 1], _mm512_maddubs_epi16(sp->c2[i], _mm512_loadu_si512(q1 + 64 * i)),
                                            sp->sc2[i]);
            if (TERMS == 2)
                w2[i & 1] = _mm512_dpwssd_epi32(w2[i & 1], _mm512_maddubs_epi16(sp->c2[i], _mm512_loadu_si512(q2 + 64 * i)),
                                                sp->sc2[i]);
        }
        const __m512i s1 = _mm512_add_epi32(w1[0], w1[1]), s2 = _mm512_add_epi32(w2[0], w2[1]);
        T[0] = (i32x8)_mm256_add_epi32(_mm512_castsi512_si256(s1), _mm512_extracti64x4_epi64(s1, 1));
        T[1] = (i32x8)_mm256_add_epi32(_mm512_castsi512_si256(s2), _mm512_extracti64x4_epi64(s2, 1));
        return;
    }
#endif
    (void)wide;
    i32x8 t1[4] = {{0}}, t2[4] = {{0}};
    for (int u = 0; u < 8; ++u) {
        t1[u & 3] = madd_acc(t1[u & 3], pairs(sp->c[u], (i8x32)load32(q1 + 32 * u)), sp->sc[u]);
        if (TERMS == 2) t2[u & 3] = madd_acc(t2[u & 3], pairs(sp->c[u], (i8x32)load32(q2 + 32 * u)), sp->sc[u]);
    }
    T[0] = (t1[0] + t1[1]) + (t1[2] + t1[3]);
    T[1] = (t2[0] + t2[1]) + (t2[2] + t2[3]);
}

/* Lanes a0 + a1, a2 + a3, b0 + b1, b2 + b3, a4 + a5, a6 + a7, b4 + b5, b6 + b7 (VPHADDD): a's lanes
 * are where FIRST_PAIRS is set. */
static const i32x8 FIRST_PAIRS = {-1, -1, 0, 0, -1, -1, 0, 0};
static inline i32x8 pair_sums(i32x8 a, i32x8 b) {
#if defined(__AVX2__)
    return (i32x8)_mm256_hadd_epi32((__m256i)a, (__m256i)b);
#else
    return __builtin_shuffle(a, b, (i32x8){0, 2, 8, 10, 4, 6, 12, 14}) +
           __builtin_shuffle(a, b, (i32x8){1, 3, 9, 11, 5, 7, 13, 15});
#endif
}

/* The sixteen scale bytes at sc as two int32 vectors (sub-blocks 0-7, 8-15). */
static inline void q6k_scales(const int8_t *sc, i32x8 *out) {
#if defined(__AVX2__)
    out[0] = (i32x8)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)sc));
    out[1] = (i32x8)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sc + 8)));
#else
    i8x8 lo, hi;
    memcpy(&lo, sc, 8);
    memcpy(&hi, sc + 8, 8);
    out[0] = __builtin_convertvector(lo, i32x8);
    out[1] = __builtin_convertvector(hi, i32x8);
#endif
}

/* A Q6_K span's value for one column (header): float(W - 32 M) (d dx). */
static inline float q6k_value(int64_t W, int32_t M, float d, float dx) {
    return (float)(W - 32 * (int64_t)M) * (d * dx);
}

/* The span values of eight Q6_K columns (lanes) for one activation row: their lanes' pair_sums p[j],
 * the scales transposed (sct[i] lane j: column j's scale of sub-block i), d per column, the row's
 * B16 and dx: float(W - 32 M) (d dx), lane by lane (header). */
static inline f32x8 q6k_values8(const i32x8 *sct, const i32x8 *p, f32x8 d, const int32_t *b16, float dx) {
    i32x8 M = sct[0] * b16[0];
    for (int i = 1; i < 16; ++i) M += sct[i] * b16[i];
    i32x8 t0[8], t1[8];
    for (int j = 0; j < 8; ++j) {
        t0[j] = p[j] & FIRST_PAIRS;
        t1[j] = p[j] & ~FIRST_PAIRS;
    }
    const i64x8 W = (wide(lane_sums8(t0)) << 8) + wide(lane_sums8(t1));
    return __builtin_convertvector(W - (wide(M) << 5), f32x8) * (d * splat(dx));
}

/* q6k_cols8_few's sums (below) with the loops the other way round, for long rows (more than LONG_ROW_SPANS
 * spans): span by span, the eight columns' spans decoded and summed, then their lane sums at once;
 * the eight rows stream side by side, each prefetched SIDE_AHEAD spans ahead (the next eight rows'
 * first spans past the end). No array between two loops, so no pause in the weights' stream (one
 * row, one thread, 2-core AMD EPYC: 4096 x 14336 23-24 -> 31-33 GB/s, 8192 x 8192 26 -> 32-33); on
 * short rows the column order stays faster (16384 x 2048: 35 against 31). */
__attribute__((always_inline)) static inline void q6k_cols8_spans(const int TERMS, const uint8_t *const *wrow,
                                                                const uint8_t *const *wnext, const acts_t *a, int r0,
                                                                const int R, float *y, size_t ldy) {
    const int spans = a->spans;
    f32x8 acc[3];
    for (int r = 0; r < R; ++r) acc[r] = splat(0.0f);
    for (int s = 0; s < spans; ++s) {
        i32x8 p[R][8], lo[8], hi[8], sct[16];
        float d[8];
        span_t sp;
        for (int j = 0; j < 8; ++j) {
            prefetch_side(Q6_K, wrow, wnext, j, s, spans);
            decode_span(Q6_K, wrow[j], a->k, s, &sp, 1);
            d[j] = sp.d[0];
            i32x8 two[2];
            q6k_scales(sp.sc16, two);
            lo[j] = two[0];
            hi[j] = two[1];
            for (int r = 0; r < R; ++r) {
                const size_t at = (size_t)(r0 + r) * a->k + (size_t)s * SPAN;
                i32x8 T[2];
                q6k_span(TERMS, &sp, a->q1 + at, a->q2 + at, T, 1);
                p[r][j] = pair_sums(T[0], T[1]);
            }
        }
        transpose8(lo, sct);
        transpose8(hi, sct + 8);
        for (int r = 0; r < R; ++r) {
            const size_t rs = (size_t)(r0 + r) * spans + s;
            acc[r] = acc[r] + q6k_values8(sct, p[r], load8f(d), (const int32_t *)a->x16 + rs * 16, a->dx[rs * 8]);
        }
    }
    for (int r = 0; r < R; ++r) memcpy(y + (size_t)r * ldy, &acc[r], 32);
}

/* y[j + r ldy] for eight Q6_K weight rows wrow[j] and activation rows r0 .. r0 + R - 1 (R <= 3, a
 * decode step), as kquant_cols8_few does for Q4_K: each column's lanes span by span, then per span
 * the eight columns' lane sums at once and M with the scales transposed, a lane per column. With
 * WIDE_SPANS two units a register (one row, one thread, 2-core AMD EPYC: 16384 x 2048 25 -> 34-37
 * GB/s; against the lane-wise float sums Q6_K had before its exact W and M). Rows of more than
 * LONG_ROW_SPANS spans go span by span (q6k_cols8_spans). */
__attribute__((always_inline)) static inline void q6k_cols8_few(const int TERMS, const uint8_t *const *wrow,
                                                                const uint8_t *const *wnext, const acts_t *a, int r0,
                                                                const int R, float *y, size_t ldy) {
    const int spans = a->spans;
    if (spans > LONG_ROW_SPANS) {
        q6k_cols8_spans(TERMS, wrow, wnext, a, r0, R, y, ldy);
        return;
    }
    i32x8 p[R][spans][8]; /* [row][span][column]: pair_sums of the two terms' lanes (half the bytes:
                            * with a long row's activations, L1 holds them) */
    const int8_t *scs[spans][8];
    float d[spans][8];
    span_t sp;
    for (int j = 0; j < 8; ++j)
        for (int s = 0; s < spans; ++s) {
            prefetch_ahead_in_row(Q6_K, wrow[j], s);
            decode_span(Q6_K, wrow[j], a->k, s, &sp, 1);
            d[s][j] = sp.d[0];
            scs[s][j] = sp.sc16;
            for (int r = 0; r < R; ++r) {
                const size_t at = (size_t)(r0 + r) * a->k + (size_t)s * SPAN;
                i32x8 T[2];
                q6k_span(TERMS, &sp, a->q1 + at, a->q2 + at, T, 1);
                p[r][s][j] = pair_sums(T[0], T[1]);
            }
        }
    f32x8 acc[3];
    for (int r = 0; r < R; ++r) acc[r] = splat(0.0f);
    for (int s = 0; s < spans; ++s) {
        i32x8 lo[8], hi[8], sct[16]; /* sct[i]: lane j = column j's scale of sub-block i */
        for (int j = 0; j < 8; ++j) {
            i32x8 two[2];
            q6k_scales(scs[s][j], two);
            lo[j] = two[0];
            hi[j] = two[1];
        }
        transpose8(lo, sct);
        transpose8(hi, sct + 8);
        for (int r = 0; r < R; ++r) {
            const size_t rs = (size_t)(r0 + r) * spans + s;
            acc[r] = acc[r] + q6k_values8(sct, p[r][s], load8f(d[s]), (const int32_t *)a->x16 + rs * 16, a->dx[rs * 8]);
        }
    }
    for (int r = 0; r < R; ++r) memcpy(y + (size_t)r * ldy, &acc[r], 32);
}

/* y[r ldy] for one Q4_K / Q5_K weight row and activation rows r0 .. r0 + R - 1 (the columns the
 * eight-column paths leave over): the same span values, one lane used. */
__attribute__((always_inline)) static inline void kquant_column(const int type, const int TERMS, const uint8_t *row,
                                                                const acts_t *a, int r0, const int R, float *y,
                                                                size_t ldy) {
    float acc[TILE_MAX];
    for (int r = 0; r < R; ++r) acc[r] = 0.0f;
    span_t sp;
    for (int s = 0; s < a->spans; ++s) {
        prefetch_ahead_in_row(type, row, s);
        decode_span(type, row, a->k, s, &sp, 1);
        for (int r = 0; r < R; ++r) {
            const size_t rs = (size_t)(r0 + r) * a->spans + s;
            i32x8 v[2];
            kquant_span(TERMS, &sp, a->q1 + (size_t)(r0 + r) * a->k + (size_t)s * SPAN,
                        a->q2 + (size_t)(r0 + r) * a->k + (size_t)s * SPAN, v);
            const i32x8 M = (i32x8){0} + span_m(&sp, (const int32_t *)a->x16 + rs * 16);
            const f32x8 val = span_values(span_w(TERMS, (i32x8){0} + hsum_i32(v[0]), (i32x8){0} + hsum_i32(v[1])), M,
                                          sp.d, splat(sp.dmin), splat(a->dx[rs * 8]));
            acc[r] = acc[r] + val[0];
        }
    }
    for (int r = 0; r < R; ++r) y[(size_t)r * ldy] = acc[r];
}

/* y[r * ldy] for rows r0 .. r0 + R - 1 of one weight row: Q4_K / Q5_K through kquant_column, Q6_K
 * through its W and M, the 32-weight types with lane-wise float sums (header). */
__attribute__((always_inline)) static inline void column_tile(const int type, const int TERMS, const uint8_t *row,
                                                              const acts_t *a, int r0, const int R, float *y,
                                                              size_t ldy) {
    if (type == Q4_K || type == Q5_K) {
        kquant_column(type, TERMS, row, a, r0, R, y, ldy);
        return;
    }
    const i16x16 ONE = (i16x16){0} + 1, H256 = (i16x16){0} + 256;
    f32x8 acc[TILE_MAX], zacc[TILE_MAX];
    for (int r = 0; r < R; ++r) acc[r] = zacc[r] = splat(0.0f);
    span_t sp;
    for (int s = 0; s < a->spans; ++s) {
        if (type == Q6_K) prefetch_ahead_in_row(type, row, s);
        else prefetch_blocks_ahead(type, row, s);
        decode_span(type, row, a->k, s, &sp, 0);
        for (int r = 0; r < R; ++r) {
            const size_t rr = (size_t)(r0 + r);
            const int8_t *q1 = a->q1 + rr * a->k + (size_t)s * SPAN, *q2 = a->q2 + rr * a->k + (size_t)s * SPAN;
            if (type == Q6_K) { /* W and M (header), one lane of acc used */
                i32x8 T[2], sc[2], b[2];
                q6k_span(TERMS, &sp, q1, q2, T, 0);
                q6k_scales(sp.sc16, sc);
                memcpy(b, (const int32_t *)a->x16 + (rr * a->spans + s) * 16, 64);
                const int64_t W = ((int64_t)hsum_i32(T[0]) << 8) + hsum_i32(T[1]);
                acc[r][0] = acc[r][0] + q6k_value(W, hsum_i32(sc[0] * b[0] + sc[1] * b[1]), sp.d[0],
                                                  a->dx[(rr * a->spans + s) * 8]);
                continue;
            }
            /* one activation scale per block of 32, as the weights */
            f32x8 p;
            memcpy(&p, a->dx + (rr * a->spans + s) * 8, 32);
            p = sp.d * p;
#ifdef DOT_BYTES
            if (type == Q8_0) {
                /* (a + 128) . q - 128 sum(q) = a . q: the activations made unsigned for VPDPBUSD,
                 * the weights' own sum taken back (lanes: the same integers as below) */
                const uint8_t *u1 = a->u1 + rr * a->k + (size_t)s * SPAN, *u2 = TERMS == 2 ? a->u2 + rr * a->k + (size_t)s * SPAN : NULL;
                for (int u = 0; u < sp.units; ++u) {
                    const i8x32 q = (i8x32)sp.c[u];
                    const i32x8 Z = -dot4_acc((i32x8){0}, (u8x32){0} + 128, q); /* -128 sum(q), four at a time */
                    i32x8 S = dot4_acc(Z, load32(u1 + 32 * u), q) << 8;
                    if (TERMS == 2) S += dot4_acc(Z, load32(u2 + 32 * u), q);
                    acc[r] = acc[r] + __builtin_convertvector(S, f32x8) * __builtin_shuffle(p, LANE[u]);
                }
            } else
                for (int u = 0; u < sp.units; ++u) { /* S = 256 c . a1 + c . a2, four weights a lane */
                    i32x8 S = dot4_acc((i32x8){0}, sp.c[u], (i8x32)load32(q1 + 32 * u)) << 8;
                    if (TERMS == 2) S = dot4_acc(S, sp.c[u], (i8x32)load32(q2 + 32 * u));
                    acc[r] = acc[r] + __builtin_convertvector(S, f32x8) * __builtin_shuffle(p, LANE[u]);
                }
#else
            for (int u = 0; u < sp.units; ++u) {
                i8x32 a1 = (i8x32)load32(q1 + 32 * u);
                if (type == Q8_0) a1 = (a1 ^ sp.neg[u]) - sp.neg[u];
                i32x8 S = madd_acc((i32x8){0}, pairs(sp.c[u], a1), H256);
                if (TERMS == 2) {
                    i8x32 a2 = (i8x32)load32(q2 + 32 * u);
                    if (type == Q8_0) a2 = (a2 ^ sp.neg[u]) - sp.neg[u];
                    S = madd_acc(S, pairs(sp.c[u], a2), ONE);
                }
                acc[r] = acc[r] + __builtin_convertvector(S, f32x8) * __builtin_shuffle(p, LANE[u]);
            }
#endif
            f32x8 x0, x1;
            memcpy(&x0, a->x16 + (rr * a->spans + s) * 16, 32);
            memcpy(&x1, a->x16 + (rr * a->spans + s) * 16 + 8, 32);
            zacc[r] = (zacc[r] + sp.z[0] * x0) + sp.z[1] * x1;
        }
    }
    for (int r = 0; r < R; ++r) y[(size_t)r * ldy] = type == Q6_K ? acc[r][0] : hsum(acc[r]) + hsum(zacc[r]);
}

/* One function per (type, rows of the tile): the type's branches and the tile's loops resolve at
 * compile time and the accumulators stay in registers. */
typedef void (*tile_fn)(const uint8_t *, const acts_t *, int, float *, size_t);
#define TILE(T, N, R)                                                                                  \
    static void tile_##T##_##N##_##R(const uint8_t *row, const acts_t *a, int r0, float *y, size_t ldy) { \
        column_tile(T, N, row, a, r0, R, y, ldy);                                                      \
    }
#define TILES(T) TILE(T, 1, 1) TILE(T, 1, 2) TILE(T, 1, 3) TILE(T, 1, 4) TILE(T, 1, 5) TILE(T, 1, 6) TILE(T, 1, 7) \
                 TILE(T, 1, 8) TILE(T, 2, 1) TILE(T, 2, 2) TILE(T, 2, 3) TILE(T, 2, 4) TILE(T, 2, 5) TILE(T, 2, 6) \
                 TILE(T, 2, 7) TILE(T, 2, 8)
TILES(Q4_0) TILES(Q4_1) TILES(Q5_0) TILES(Q5_1) TILES(Q8_0) TILES(Q4_K) TILES(Q5_K) TILES(Q6_K)
#define ROW(T) {{tile_##T##_1_1, tile_##T##_1_2, tile_##T##_1_3, tile_##T##_1_4, tile_##T##_1_5, tile_##T##_1_6, \
                 tile_##T##_1_7, tile_##T##_1_8},                                                      \
                {tile_##T##_2_1, tile_##T##_2_2, tile_##T##_2_3, tile_##T##_2_4, tile_##T##_2_5, tile_##T##_2_6, \
                 tile_##T##_2_7, tile_##T##_2_8}}
static const tile_fn TILES_OF[NTYPES][2][TILE_MAX] = {ROW(Q4_0), ROW(Q4_1), ROW(Q5_0), ROW(Q5_1),
                                                       ROW(Q8_0), ROW(Q4_K), ROW(Q5_K), ROW(Q6_K)};

/* Eight k-quant columns of up to three activation rows (kquant_cols8_few, q6k_cols8_few), one
 * function each. */
typedef void (*few_fn)(const uint8_t *const *, const uint8_t *const *, const acts_t *, int, float *, size_t);
#define FEW(T, N, R)                                                                                   \
    static void few_##T##_##N##_##R(const uint8_t *const *w, const uint8_t *const *wn, const acts_t *a, int r0, \
                                    float *y, size_t ldy) {                                              \
        kquant_cols8_few(T, N, w, wn, a, r0, R, y, ldy);                                                 \
    }
#define FEWS(T) FEW(T, 1, 1) FEW(T, 1, 2) FEW(T, 1, 3) FEW(T, 2, 1) FEW(T, 2, 2) FEW(T, 2, 3)
FEWS(Q4_K) FEWS(Q5_K)
#define FEW6(N, R)                                                                                     \
    static void few_Q6_K_##N##_##R(const uint8_t *const *w, const uint8_t *const *wn, const acts_t *a, int r0, \
                                   float *y, size_t ldy) {                                               \
        q6k_cols8_few(N, w, wn, a, r0, R, y, ldy);                                                         \
    }
FEW6(1, 1) FEW6(1, 2) FEW6(1, 3) FEW6(2, 1) FEW6(2, 2) FEW6(2, 3)
#define FEW_ROW(T) {{few_##T##_1_1, few_##T##_1_2, few_##T##_1_3}, {few_##T##_2_1, few_##T##_2_2, few_##T##_2_3}}
static const few_fn FEW_OF[3][2][3] = {FEW_ROW(Q4_K), FEW_ROW(Q5_K), FEW_ROW(Q6_K)};

static void column(int type, const uint8_t *row, const acts_t *a, int r0, int rows, float *y, size_t ldy) {
    for (int r = r0; r < r0 + rows; r += TILE_ROWS) {
        const int R = r0 + rows - r < TILE_ROWS ? r0 + rows - r : TILE_ROWS;
        TILES_OF[type][a->terms - 1][R - 1](row, a, r, y + (size_t)r * ldy, ldy);
    }
}

#if defined(WIDE_SPANS) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define COLS16 1
/* Rows (of a row block) from which sixteen transposed columns beat eight read a column at a time
 * (kquant_cols8_few): each span's codes are transposed once for all the rows (measured, one row
 * through `stencil bench rows`-style runs: at 2 rows the few-row path is faster, at 4 this one). */
#define COLS16_MIN_ROWS 4

typedef float f32x16 __attribute__((vector_size(64)));
typedef int64_t i64x16 __attribute__((vector_size(128)));

/* Lanes: sixteen columns' four products of weights 4l..4l+3 with activations p[0..3] (one
 * broadcast word), added for l = l0 .. l0 + n - 1. */
#define DOTS16(acc, w, p, l0, n)                                                                 \
    for (int l = l0; l < l0 + n; ++l) {                                                          \
        int32_t word_;                                                                           \
        memcpy(&word_, (p) + 4 * l, 4);                                                          \
        acc = _mm512_dpbusd_epi32(acc, w[l], _mm512_set1_epi32(word_));                          \
    }

/* y[r * ldy + j] for rows r0 .. r0 + nrows - 1 (nrows <= ROW_BLOCK) and the k-quant weight rows
 * wrow[j], j < n <= 16 (fewer than sixteen: the last row repeated, its lanes not stored): the same
 * integers W, M and float operations, span by span, as one column at a time (header), with a lane
 * of a 512-bit register per column: each span's codes are decoded and transposed once for all the
 * rows (lane j of Wt[u][l] = column j's codes 4l..4l+3 of unit u), each activation word broadcast,
 * 16 VPDPBUSD a row and unit for sixteen columns. Q4_K / Q5_K scale a unit's sum by its scale, Q6_K
 * each half unit's (its 16-weight sub-blocks). */
__attribute__((always_inline)) static inline void cols16(const int type, const int TERMS, const uint8_t *const *wrow,
                                                         const uint8_t *const *wnext, const acts_t *a, int r0,
                                                         int nrows, int n, float *y, size_t ldy) {
    f32x16 acc[ROW_BLOCK];
    __m512i T1[ROW_BLOCK], T2[ROW_BLOCK];
    const uint8_t *rows[16], *nexts[16];
    for (int j = 0; j < 16; ++j) {
        rows[j] = wrow[j < n ? j : n - 1];
        nexts[j] = j < n ? wnext[j] : NULL;
    }
    for (int r = 0; r < nrows; ++r) acc[r] = (f32x16){0};
    for (int s = 0; s < a->spans; ++s) {
        __m512i Wt[8][8], SC[16], MN[8]; /* SC: Q4_K / Q5_K units 0-7; Q6_K sub-blocks 0-15 */
        float dcol[16], dmcol[16];
        for (int h = 0; h < 2; ++h) {
            i32x8 cod[8][8], sca[8], scb[8], wt[8][8], sc[16], mn[8];
            span_t sp;
            for (int j = 0; j < 8; ++j) {
                prefetch_ahead(type, rows[8 * h + j], nexts[8 * h + j], s, a->spans);
                decode_span(type, rows[8 * h + j], a->k, s, &sp, 0);
                for (int u = 0; u < 8; ++u) cod[u][j] = (i32x8)sp.c[u];
                if (type == Q6_K) {
                    i32x8 two[2];
                    q6k_scales(sp.sc16, two);
                    sca[j] = two[0];
                    scb[j] = two[1];
                } else {
                    sca[j] = sp.sc32;
                    scb[j] = sp.m32;
                    dmcol[8 * h + j] = sp.dmin;
                }
                dcol[8 * h + j] = sp.d[0];
            }
            for (int u = 0; u < 8; ++u) transpose8(cod[u], wt[u]);
            transpose8(sca, sc);
            transpose8(scb, type == Q6_K ? sc + 8 : mn);
            for (int u = 0; u < 8; ++u)
                for (int l = 0; l < 8; ++l)
                    Wt[u][l] = h ? _mm512_inserti64x4(Wt[u][l], (__m256i)wt[u][l], 1)
                                 : _mm512_castsi256_si512((__m256i)wt[u][l]);
            for (int i = 0; i < (type == Q6_K ? 16 : 8); ++i)
                SC[i] = h ? _mm512_inserti64x4(SC[i], (__m256i)sc[i], 1) : _mm512_castsi256_si512((__m256i)sc[i]);
            for (int u = 0; type != Q6_K && u < 8; ++u)
                MN[u] = h ? _mm512_inserti64x4(MN[u], (__m256i)mn[u], 1) : _mm512_castsi256_si512((__m256i)mn[u]);
        }
        f32x16 dv, dmv = (f32x16){0};
        memcpy(&dv, dcol, 64);
        if (type != Q6_K) memcpy(&dmv, dmcol, 64);
        for (int r = 0; r < nrows; ++r) T1[r] = T2[r] = _mm512_setzero_si512();
        for (int u = 0; u < 8; ++u) {
            const __m512i *w = Wt[u];
            for (int r = 0; r < nrows; ++r) {
                const size_t at = (size_t)(r0 + r) * a->k + (size_t)s * SPAN + 32 * u;
                for (int term = 0; term < TERMS; ++term) {
                    const int8_t *p = (term ? a->q2 : a->q1) + at;
                    __m512i *T = term ? T2 : T1;
                    __m512i t = _mm512_setzero_si512(), t2 = _mm512_setzero_si512();
                    DOTS16(t, w, p, 0, 4); /* weights 0-15 of the unit */
                    DOTS16(t2, w, p, 4, 4); /* 16-31 */
                    if (type == Q6_K) /* |T| <= 16 16 63 127 128 */
                        T[r] = _mm512_add_epi32(T[r], _mm512_add_epi32(_mm512_mullo_epi32(t, SC[2 * u]),
                                                                       _mm512_mullo_epi32(t2, SC[2 * u + 1])));
                    else /* |T| <= 8 32 31 127 63 */
                        T[r] = _mm512_add_epi32(T[r], _mm512_mullo_epi32(_mm512_add_epi32(t, t2), SC[u]));
                }
            }
        }
        for (int r = 0; r < nrows; ++r) {
            const size_t rs = (size_t)(r0 + r) * a->spans + s;
            const int32_t *b16 = (const int32_t *)a->x16 + rs * 16;
            __m512i M = _mm512_setzero_si512();
            if (type == Q6_K)
                for (int i = 0; i < 16; ++i) M = _mm512_add_epi32(M, _mm512_mullo_epi32(SC[i], _mm512_set1_epi32(b16[i])));
            else
                for (int j = 0; j < 8; ++j)
                    M = _mm512_add_epi32(M, _mm512_mullo_epi32(MN[j], _mm512_set1_epi32(b16[2 * j] + b16[2 * j + 1])));
            /* W = 256 T1 + T2, exact */
            const i64x16 W = (__builtin_convertvector((i32x16)T1[r], i64x16) << 8) +
                             __builtin_convertvector((i32x16)T2[r], i64x16);
            const f32x16 dx = (f32x16){0} + a->dx[rs * 8];
            if (type == Q6_K) /* q6k_value's operations, lane by lane */
                acc[r] = acc[r] + __builtin_convertvector(W - (__builtin_convertvector((i32x16)M, i64x16) << 5), f32x16) *
                                      (dv * dx);
            else /* span_values' */
                acc[r] = acc[r] + (__builtin_convertvector(W, f32x16) * (dv * dx) -
                                   __builtin_convertvector((i32x16)M, f32x16) * (dmv * dx));
        }
    }
    for (int r = 0; r < nrows; ++r) memcpy(y + (size_t)(r0 + r) * ldy, &acc[r], 4 * (size_t)n);
}
#undef DOTS16

typedef void (*cols16_fn)(const uint8_t *const *, const uint8_t *const *, const acts_t *, int, int, int, float *,
                          size_t);
#define COLS16_FN(T, N)                                                                                 \
    static void cols16_##T##_##N(const uint8_t *const *w, const uint8_t *const *wn, const acts_t *a, int r0, int rows, \
                                 int n, float *y, size_t ldy) {                                         \
        cols16(T, N, w, wn, a, r0, rows, n, y, ldy);                                                   \
    }
COLS16_FN(Q4_K, 1) COLS16_FN(Q4_K, 2) COLS16_FN(Q5_K, 1) COLS16_FN(Q5_K, 2) COLS16_FN(Q6_K, 1) COLS16_FN(Q6_K, 2)
static const cols16_fn COLS16_OF[3][2] = {{cols16_Q4_K_1, cols16_Q4_K_2}, {cols16_Q5_K_1, cols16_Q5_K_2},
                                          {cols16_Q6_K_1, cols16_Q6_K_2}};

/* The 32-weight types at many rows, sixteen columns a 512-bit register: the same integers and float
 * operations as column_tile, lane by lane (header), so the same bits. A lane of column_tile's acc
 * and zacc (the products of one group of four weights of each unit, the offsets of two groups of
 * 16) becomes a register of sixteen columns: acc[l], zacc[l]. The columns' codes are decoded and
 * transposed once into `wt` (blocks16_fill) and read by every row: lane j of wt[8 g + l] holds
 * column j's codes 4l..4l+3 of unit g (units counted along the row), d[g] and z[8 s + u] their
 * scale and offset (z: all eight slots of each span, past the row's end what decode_span writes
 * there), and for Q8_0 nz[8 g + l] the sums that turn its biased activations back (-(256 or 257)
 * 128 sum(q)). Each activation word is broadcast against sixteen columns: per row, unit and term
 * eight 512-bit VPDPBUSD for sixteen columns' 512 products, where column_tile takes sixteen 256-bit
 * ones (one a column) and decodes each column again every TILE_ROWS rows. The buffer is each
 * thread's own, 64 (8 or 16 units + units + 8 spans) bytes (stencil_gguf_gemm allocates it; without
 * it the columns go through column_tile, with the same bits). */
typedef struct {
    __m512i *wt, *nz;
    f32x16 *d, *z;
} blocks16_t;

__attribute__((always_inline)) static inline void blocks16_fill(const int type, const int TERMS, const uint8_t *const *wrow,
                                                                const uint8_t *const *wnext, const acts_t *a, int n,
                                                                const blocks16_t *b) {
    const uint8_t *rows[16], *nexts[16];
    for (int j = 0; j < 16; ++j) {
        rows[j] = wrow[j < n ? j : n - 1];
        nexts[j] = j < n ? wnext[j] : NULL;
    }
    const int units = a->k / 32;
    /* the next sixteen rows on their way into the cache while these are decoded (the rows are
     * short against DRAM's latency: Gemma 3's 640 inputs are 2.5 spans) */
    const long row_bytes = (long)units * BLOCK_BYTES[type];
    for (int j = 0; j < 16; ++j)
        for (long o = 0; nexts[j] && o < row_bytes; o += 64) __builtin_prefetch((const char *)nexts[j] + o, 0, 0);
    for (int s = 0; s < a->spans; ++s) {
        const int here = units - 8 * s < 8 ? units - 8 * s : 8;
        float dcol[8][16], zcol[8][16];
        for (int h = 0; h < 2; ++h) {
            i32x8 cod[8][8], wt[8];
            span_t sp;
            for (int j = 0; j < 8; ++j) {
                decode_span(type, rows[8 * h + j], a->k, s, &sp, 0);
                for (int u = 0; u < here; ++u) cod[u][j] = (i32x8)sp.c[u];
                for (int u = 0; u < 8; ++u) {
                    dcol[u][8 * h + j] = sp.d[u];
                    zcol[u][8 * h + j] = u < 4 ? sp.z[0][2 * u] : sp.z[1][2 * u - 8];
                }
            }
            for (int u = 0; u < here; ++u) {
                __m512i *dst = b->wt + (size_t)(8 * s + u) * 8;
                transpose8(cod[u], wt);
                for (int l = 0; l < 8; ++l)
                    dst[l] = h ? _mm512_inserti64x4(dst[l], (__m256i)wt[l], 1) : _mm512_castsi256_si512((__m256i)wt[l]);
            }
        }
        for (int u = 0; u < 8; ++u) {
            if (u < here) memcpy(b->d + 8 * s + u, dcol[u], 64);
            memcpy(b->z + 8 * s + u, zcol[u], 64);
        }
        if (type == Q8_0) /* sum(q) 128 of each group of four, from one VPDPBUSD against 128s */
            for (int g = 8 * s; g < 8 * s + here; ++g)
                for (int l = 0; l < 8; ++l)
                    b->nz[8 * g + l] = _mm512_mullo_epi32(
                        _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8((char)0x80), b->wt[8 * g + l]),
                        _mm512_set1_epi32(TERMS == 2 ? -257 : -256));
    }
}

/* The activation word of inputs 4l..4l+3 at p, in every 32-bit lane. */
static inline __m512i word16(const void *p, int l) {
    int32_t w;
    memcpy(&w, (const char *)p + 4 * l, 4);
    return _mm512_set1_epi32(w);
}

/* y[r * ldy + j] for rows r0 .. r0 + nrows - 1 and the 32-weight rows wrow[j], j < n <= 16 (the last
 * repeated, its lanes not stored), from blocks16_fill's b. */
__attribute__((always_inline)) static inline void blocks16(const int type, const int TERMS, const uint8_t *const *wrow,
                                                           const uint8_t *const *wnext, const acts_t *a, int r0,
                                                           int nrows, int n, float *y, size_t ldy, const blocks16_t *b) {
    blocks16_fill(type, TERMS, wrow, wnext, a, n, b);
    const int units = a->k / 32;
    for (int r = 0; r < nrows; ++r) {
        const size_t rr = (size_t)(r0 + r);
        f32x16 acc[8], zacc[8];
        for (int l = 0; l < 8; ++l) acc[l] = zacc[l] = (f32x16){0};
        for (int s = 0; s < a->spans; ++s) {
            const int here = units - 8 * s < 8 ? units - 8 * s : 8;
            const float *dx = a->dx + (rr * a->spans + s) * 8, *x16 = a->x16 + (rr * a->spans + s) * 16;
            for (int u = 0; u < here; ++u) {
                const int g = 8 * s + u;
                const __m512i *w = b->wt + (size_t)g * 8;
                const f32x16 p = b->d[g] * ((f32x16){0} + dx[u]); /* d dx, as column_tile's p */
                const size_t at = rr * a->k + (size_t)32 * g;
                for (int l = 0; l < 8; ++l) {
                    __m512i S;
                    if (type == Q8_0) { /* the activations unsigned (plus 128), the codes signed */
                        S = _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), word16(a->u1 + at, l), w[l]), 8);
                        if (TERMS == 2) S = _mm512_dpbusd_epi32(S, word16(a->u2 + at, l), w[l]);
                        S = _mm512_add_epi32(S, b->nz[8 * g + l]);
                    } else {
                        S = _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w[l], word16(a->q1 + at, l)), 8);
                        if (TERMS == 2) S = _mm512_dpbusd_epi32(S, w[l], word16(a->q2 + at, l));
                    }
                    acc[l] = acc[l] + __builtin_convertvector((i32x16)S, f32x16) * p;
                }
            }
            const f32x16 *z = b->z + 8 * s;
            for (int l = 0; l < 8; ++l)
                zacc[l] = (zacc[l] + z[l / 2] * ((f32x16){0} + x16[l])) + z[4 + l / 2] * ((f32x16){0} + x16[8 + l]);
        }
        /* hsum's order, lane by lane */
        const f32x16 ya = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
        const f32x16 yz = ((zacc[0] + zacc[4]) + (zacc[2] + zacc[6])) + ((zacc[1] + zacc[5]) + (zacc[3] + zacc[7]));
        const f32x16 out = ya + yz;
        memcpy(y + rr * ldy, &out, 4 * (size_t)n);
    }
}

typedef void (*blocks16_fn)(const uint8_t *const *, const uint8_t *const *, const acts_t *, int, int, int, float *,
                            size_t, const blocks16_t *);
#define BLOCKS16_FN(T, N)                                                                               \
    static void blocks16_##T##_##N(const uint8_t *const *w, const uint8_t *const *wn, const acts_t *a, int r0,  \
                                   int rows, int n, float *y, size_t ldy, const blocks16_t *b) {        \
        blocks16(T, N, w, wn, a, r0, rows, n, y, ldy, b);                                              \
    }
BLOCKS16_FN(Q4_0, 1) BLOCKS16_FN(Q4_0, 2) BLOCKS16_FN(Q4_1, 1) BLOCKS16_FN(Q4_1, 2) BLOCKS16_FN(Q5_0, 1)
BLOCKS16_FN(Q5_0, 2) BLOCKS16_FN(Q5_1, 1) BLOCKS16_FN(Q5_1, 2) BLOCKS16_FN(Q8_0, 1) BLOCKS16_FN(Q8_0, 2)
static const blocks16_fn BLOCKS16_OF[5][2] = {{blocks16_Q4_0_1, blocks16_Q4_0_2}, {blocks16_Q4_1_1, blocks16_Q4_1_2},
                                              {blocks16_Q5_0_1, blocks16_Q5_0_2}, {blocks16_Q5_1_1, blocks16_Q5_1_2},
                                              {blocks16_Q8_0_1, blocks16_Q8_0_2}};
#ifndef BLOCKS16_MIN_ROWS
#define BLOCKS16_MIN_ROWS 4
#endif
#endif

static int valid(int type, int k, long row_bytes) {
    return type >= 0 && type < NTYPES && k > 0 && k % BLOCK_WEIGHTS[type] == 0 &&
           row_bytes == (long)(k / BLOCK_WEIGHTS[type]) * BLOCK_BYTES[type];
}

/* The two terms of 32 inputs v for the group's amax (see the header); q1, q2 get 32 int8. */
static inline void quantize32(const float *v, float step, float inv, float inv2, int8_t *q1, int8_t *q2) {
    /* q2 == NULL: the first term only */
#if defined(__AVX2__)
    const __m256 lim = _mm256_set1_ps(127.0f), nlim = _mm256_set1_ps(-127.0f);
    const __m256 vs = _mm256_set1_ps(step), vi = _mm256_set1_ps(inv), vi2 = _mm256_set1_ps(inv2);
    __m256i a[4], b[4];
    for (int j = 0; j < 4; ++j) {
        const __m256 x = _mm256_loadu_ps(v + 8 * j);
        __m256 u = _mm256_round_ps(_mm256_mul_ps(x, vi), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        u = _mm256_min_ps(_mm256_max_ps(u, nlim), lim);
        __m256 w = _mm256_round_ps(_mm256_mul_ps(_mm256_sub_ps(x, _mm256_mul_ps(u, vs)), vi2),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        w = _mm256_min_ps(_mm256_max_ps(w, nlim), lim);
        a[j] = _mm256_cvtps_epi32(u); /* exact: integral values */
        b[j] = _mm256_cvtps_epi32(w);
    }
    /* packs interleave 128-bit lanes; the permutation puts the 32 bytes back in order */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256i p1 = _mm256_packs_epi16(_mm256_packs_epi32(a[0], a[1]), _mm256_packs_epi32(a[2], a[3]));
    const __m256i p2 = _mm256_packs_epi16(_mm256_packs_epi32(b[0], b[1]), _mm256_packs_epi32(b[2], b[3]));
    _mm256_storeu_si256((__m256i *)q1, _mm256_permutevar8x32_epi32(p1, order));
    if (q2) _mm256_storeu_si256((__m256i *)q2, _mm256_permutevar8x32_epi32(p2, order));
#else
    for (int i = 0; i < 32; ++i) {
        float u = __builtin_rintf(v[i] * inv);
        u = u > 127.0f ? 127.0f : (u < -127.0f ? -127.0f : u);
        float w = __builtin_rintf((v[i] - u * step) * inv2);
        w = w > 127.0f ? 127.0f : (w < -127.0f ? -127.0f : w);
        q1[i] = (int8_t)u;
        if (q2) q2[i] = (int8_t)w;
    }
#endif
}

/* f (finite, >= 0) rounded to the nearest fp16 value, ties to even, returned as fp32: what
 * ggml's GGML_FP32_TO_FP16 keeps of a Q8_0 block scale (fp16 subnormals below 2^-14). */
static inline float round_to_fp16(float f) {
    if (!(f > 0.0f)) return 0.0f;
    uint32_t u;
    memcpy(&u, &f, 4);
    int e = (int)((u >> 23) & 0xff) - 127; /* f in [2^e, 2^(e + 1)) */
    if (e > 15) return f;                  /* beyond fp16's range: no scale of real activations */
    const int p = e >= -14 ? e - 10 : -24; /* fp16's spacing at f */
    const uint32_t ub = (uint32_t)(p + 127) << 23;
    float ulp;
    memcpy(&ulp, &ub, 4);
    return __builtin_rintf(f / ulp) * ulp; /* f / ulp exact (a power of two); <= 2048 */
}

static inline float amax32(const float *v) {
    f32x8 m = splat(0.0f);
    for (int j = 0; j < 4; ++j) {
        f32x8 t;
        memcpy(&t, v + 8 * j, 32);
        t = (f32x8)((i32x8)t & 0x7fffffff); /* |t| */
        const i32x8 bigger = (i32x8)(m > t);
        m = (f32x8)(((i32x8)m & bigger) | ((i32x8)t & ~bigger));
    }
    float r = 0.0f;
    for (int l = 0; l < 8; ++l) r = m[l] > r ? m[l] : r; /* max is exact: any order */
    return r;
}

/* Quantize x fp32 [M, K] (K % group == 0) into q1, q2, dx and X16 (group 32) or B16 (group 256),
 * layouts in the header. X16[h] = hsum(x[16h .. 16h+7] + x[16h+8 .. 16h+15]) (lane-wise add, then
 * hsum's fixed order; one term: dq times the sum of the 16 q1). */
int stencil_gguf_quantize(const float *x, int m, int k, int group, int8_t *q1, int8_t *q2, float *dx, float *x16,
                          int threads) { /* q2 NULL: one term */
    if (m <= 0 || k <= 0 || (group != 32 && group != SPAN) || k % group) return -1;
    const int spans = (k + SPAN - 1) / SPAN;
    (void)threads;
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1) if (threads > 1 && m >= 16)
    for (int r = 0; r < m; ++r) {
        const float *xr = x + (size_t)r * k;
        float *dr = dx + (size_t)r * spans * 8, *xs = x16 + (size_t)r * spans * 16;
        memset(dr, 0, sizeof(float) * spans * 8);
        memset(xs, 0, sizeof(float) * spans * 16);
        for (int g = 0; g < k / group; ++g) {
            const float *v = xr + (size_t)group * g;
            float amax = 0.0f;
            for (int i = 0; i < group; i += 32) {
                const float t = amax32(v + i);
                amax = t > amax ? t : amax;
            }
            const float inv = amax > 0.0f ? 127.0f / amax : 0.0f, inv2 = inv * 256.0f;
            float step = amax / 127.0f;
            int8_t *g1 = q1 + (size_t)r * k + (size_t)group * g;
            for (int i = 0; i < group; i += 32)
                quantize32(v + i, step, inv, inv2, g1 + i, q2 ? q2 + (size_t)r * k + (size_t)group * g + i : NULL);
            if (!q2) /* llama.cpp's block scale (see the header) */
                step = group == SPAN ? (amax > 0.0f ? 1.0f / inv : 0.0f) : round_to_fp16(step);
            for (int b = 0; b < group / 32; ++b) dr[g * (group / 32) + b] = step / 256.0f; /* exact */
            if (group == SPAN) { /* k-quants: B16, the exact sums of 256 q1 + q2 */
                const int8_t *g2 = q2 ? q2 + (size_t)r * k + (size_t)group * g : NULL;
                int32_t *bs = (int32_t *)xs + (group * g) / 16;
                for (int h = 0; h < group / 16; ++h) {
                    int32_t sum = 0;
                    for (int i = 0; i < 16; ++i) sum += 256 * g1[16 * h + i] + (g2 ? g2[16 * h + i] : 0);
                    bs[h] = sum;
                }
            } else if (!q2)
                for (int h = 0; h < group / 16; ++h) {
                    int sum = 0;
                    for (int i = 0; i < 16; ++i) sum += g1[16 * h + i];
                    xs[(group * g) / 16 + h] = step * (float)sum;
                }
        }
        for (int h = 0; q2 && group != SPAN && h < k / 16; ++h) {
            f32x8 lo, hi;
            memcpy(&lo, xr + 16 * h, 32);
            memcpy(&hi, xr + 16 * h + 8, 32);
            xs[h] = hsum(lo + hi);
        }
    }
    return 0;
}

/* y[M, ncols] (row stride ldy) = x @ W[cols].T from stencil_gguf_quantize's activations;
 * cols int32 [ncols] weight rows (NULL: 0 .. ncols - 1). Returns 0, or -1 on bad arguments. */
int stencil_gguf_gemm(int type, const uint8_t *w, long row_bytes, int k, const int *cols, int ncols,
                      int group, const int8_t *q1, const int8_t *q2, const float *dx, const float *x16, int m,
                      float *y, long ldy, int threads) { /* q2 NULL: activations of one term */
    if (!valid(type, k, row_bytes) || group != BLOCK_WEIGHTS[type] || m <= 0 || ncols <= 0 || ldy < ncols) return -1;
    acts_t a = {q1, q2, NULL, NULL, dx, x16, k, (k + SPAN - 1) / SPAN, q2 ? 2 : 1};
    uint8_t *biased = NULL; /* Q8_0 with byte dot products: the activations plus 128, once for all columns */
#ifdef DOT_BYTES
    if (type == Q8_0) {
        const size_t n = (size_t)m * k;
        biased = malloc(n * (q2 ? 2 : 1));
        if (!biased) return -1;
        for (size_t i = 0; i < n; ++i) biased[i] = (uint8_t)q1[i] ^ 0x80;
        for (size_t i = 0; q2 && i < n; ++i) biased[n + i] = (uint8_t)q2[i] ^ 0x80;
        a.u1 = biased;
        a.u2 = q2 ? biased + n : NULL;
    }
#endif
    const int nt = threads > 0 ? threads : 1;
    (void)nt;
    /* Each thread owns a contiguous range of columns; row blocks run outer so that their
     * activations stay in cache while the thread's weight rows stream past. */
#pragma omp parallel num_threads(nt) if (nt > 1 && (size_t)ncols * m * k >= 65536)
    {
        int t = 0, n = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        n = omp_get_num_threads();
#endif
        const int c0 = (int)((long)ncols * t / n), c1 = (int)((long)ncols * (t + 1) / n);
#ifdef COLS16
        /* blocks16's buffer (NULL where not needed or not allocated: then column_tile, the same bits) */
        blocks16_t scratch = {NULL, NULL, NULL, NULL};
        void *held = NULL;
        if (type < Q4_K && m >= BLOCKS16_MIN_ROWS && c1 > c0) {
            const size_t units = (size_t)k / 32, slots = (size_t)a.spans * 8;
            held = aligned_alloc(64, 64 * (units * (type == Q8_0 ? 16 : 8) + units + slots));
            if (held) {
                scratch.wt = held;
                scratch.nz = type == Q8_0 ? scratch.wt + units * 8 : NULL;
                scratch.d = (f32x16 *)(scratch.wt + units * (type == Q8_0 ? 16 : 8));
                scratch.z = scratch.d + units;
            }
        }
#endif
        for (int r0 = 0; r0 < m; r0 += ROW_BLOCK) {
            const int rows = m - r0 < ROW_BLOCK ? m - r0 : ROW_BLOCK;
            int c = c0;
            const int kquant = type >= Q4_K;
#ifdef COLS16
            /* many rows: sixteen columns at once (the last group may hold fewer), the k-quants through
             * cols16, the 32-weight types through blocks16 and this thread's buffer */
            const int wide = kquant ? rows >= COLS16_MIN_ROWS : rows >= BLOCKS16_MIN_ROWS && scratch.wt;
            for (; wide && c < c1; c += 16) {
                const int n = c1 - c < 16 ? c1 - c : 16;
                const uint8_t *wrow[16], *wnext[16];
                for (int j = 0; j < n; ++j) {
                    wrow[j] = w + (size_t)(cols ? cols[c + j] : c + j) * row_bytes;
                    wnext[j] = c + 16 + j < c1 ? w + (size_t)(cols ? cols[c + 16 + j] : c + 16 + j) * row_bytes : NULL;
                }
                if (kquant)
                    COLS16_OF[type - Q4_K][a.terms - 1](wrow, wnext, &a, r0, rows, n, y + c, (size_t)ldy);
                else
                    BLOCKS16_OF[type][a.terms - 1](wrow, wnext, &a, r0, rows, n, y + c, (size_t)ldy, &scratch);
            }
#endif
            /* k-quants at a few rows: eight columns at once (the same bits as one at a time, header) */
            for (; kquant && c + 8 <= c1; c += 8) {
                const uint8_t *wrow[8];
                for (int j = 0; j < 8; ++j) wrow[j] = w + (size_t)(cols ? cols[c + j] : c + j) * row_bytes;
                /* the next eight rows, for the prefetches (NULL past the thread's columns) */
                const uint8_t *wnext[8];
                for (int j = 0; j < 8; ++j)
                    wnext[j] = c + 8 + j < c1 ? w + (size_t)(cols ? cols[c + 8 + j] : c + 8 + j) * row_bytes : NULL;
                for (int r = r0; r < r0 + rows; r += 3) {
                    const int R = r0 + rows - r < 3 ? r0 + rows - r : 3;
                    FEW_OF[type - Q4_K][a.terms - 1][R - 1](wrow, wnext, &a, r, y + (size_t)r * ldy + c, (size_t)ldy);
                }
            }
            for (; c < c1; ++c) {
                const int wr = cols ? cols[c] : c;
                column(type, w + (size_t)wr * row_bytes, &a, r0, rows, y + c, (size_t)ldy);
            }
        }
#ifdef COLS16
        free(held);
#endif
    }
    free(biased);
    return 0;
}

/* out fp32 [n, K] = rows `rows` (int64 [n]) of W, dequantized as gguf-py's
 * gguf.quants.dequantize does (the same fp32 operations in the same order: bit for bit). */
int stencil_gguf_dequantize(int type, const uint8_t *w, long row_bytes, int k, const int64_t *rows, int n,
                            float *out) {
    if (!valid(type, k, row_bytes) || n < 0) return -1;
    for (int i = 0; i < n; ++i) {
        const uint8_t *row = w + (size_t)rows[i] * row_bytes;
        float *o = out + (size_t)i * k;
        if (type >= Q4_K) {
            for (int s = 0; s < k / SPAN; ++s, o += SPAN) {
                const uint8_t *b = row + (size_t)s * BLOCK_BYTES[type];
                if (type == Q6_K) {
                    const float d = h2f(b + 208);
                    const int8_t *sc = (const int8_t *)(b + 192);
                    for (int j = 0; j < SPAN; ++j) {
                        const int n2 = j / 128, t = (j % 128) / 32, l = j % 32;
                        const uint8_t lq = b[64 * n2 + 32 * (t & 1) + l], hq = b[128 + 32 * n2 + l];
                        const int q = ((t < 2 ? lq & 15 : lq >> 4) | ((hq >> (2 * t)) & 3) << 4) - 32;
                        o[j] = (d * (float)sc[j / 16]) * (float)q;
                    }
                    continue;
                }
                const float d = h2f(b), dmin = h2f(b + 2);
                uint8_t sm[16];
                scale_min_k4(b + 4, sm);
                const uint8_t *sc = sm, *m = sm + 8, *qs = b + (type == Q4_K ? 16 : 48);
                for (int j = 0; j < SPAN; ++j) {
                    const int sb = j / 32, l = j % 32;
                    int q = sb & 1 ? qs[32 * (sb / 2) + l] >> 4 : qs[32 * (sb / 2) + l] & 15;
                    if (type == Q5_K) q |= ((b[16 + l] >> sb) & 1) << 4;
                    o[j] = (d * (float)sc[sb]) * (float)q - dmin * (float)m[sb];
                }
            }
            continue;
        }
        for (int g = 0; g < k / 32; ++g, o += 32) {
            const uint8_t *b = row + (size_t)g * BLOCK_BYTES[type];
            const float d = h2f(b);
            const int qs = type == Q4_0 ? 2 : type == Q4_1 ? 4 : type == Q5_0 ? 6 : 8; /* nibbles */
            for (int j = 0; j < 32; ++j) {
                const int nib = type == Q8_0 ? 0 : j < 16 ? b[qs + j] & 15 : b[qs + j - 16] >> 4;
                switch (type) {
                case Q4_0: o[j] = d * (float)(nib - 8); break;
                case Q4_1: o[j] = d * (float)nib + h2f(b + 2); break;
                case Q5_0: o[j] = d * (float)((nib | ((b[2 + j / 8] >> (j % 8)) & 1) << 4) - 16); break;
                case Q5_1: o[j] = d * (float)(nib | ((b[4 + j / 8] >> (j % 8)) & 1) << 4) + h2f(b + 2); break;
                default: o[j] = d * (float)(int8_t)b[2 + j]; break;
                }
            }
        }
    }
    return 0;
}

/* Which dot-product instructions this build uses: 3 AVX512-VNNI, 2 AVX-VNNI, 1 AVX2, 0 plain C. */
int stencil_gguf_isa(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return 3;
#elif defined(__AVXVNNI__)
    return 2;
#elif defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}
