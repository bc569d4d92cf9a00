/* Batch-invariant GEMM of int4 / int8 GGUF weights with int8 activations on AVX512-VNNI:
 * y = x @ W.T, x fp32.
 *
 * Why: on the Xeons this project runs on (Sapphire / Emerald Rapids, no AMX in the guest), one
 * VDPBF16PS issues every third cycle (32 multiply-adds) while VPDPBUSD issues about every cycle
 * (64 multiply-adds of u8 x s8 into i32): measured 1.25 vs 3.15 G instructions/s on one core.
 * The bf16 kernel (int4_gemm.c) and oneDNN's dense bf16 GEMM both stop near 35 GMAC/s a
 * core; integer dot products do not.
 *
 * Activations (per row, per group of 32 inputs, as llama.cpp's Q8 activation blocks, with a
 * second term for the residual): d = max|x_g| / 127, q1 = round(x / d) in -127..127,
 * q2 = clamp(round((x - d q1) / (d / 256)), -127, 127); so x = d (q1 + q2 / 256) + e with
 * |e| <= d / 256 = max|x_g| / 32512 (|x - d q1| <= d / 2 = 128 (d / 256): half a step of q2,
 * or one where the clamp to 127 bites; tests/test_quant.py pins the bound). That is finer than
 * bf16 rounding of the large entries (relative 2^-9): a product's error is about 40x below the
 * bf16 kernel's. X_g, the fp32 sum of the group's x (order: see quantize_row), carries the
 * weights' zeros.
 *
 * Weights, per output column n and group g (scale s, zero z, codes c):
 *   int4 (planes = 1):  W[n, k] = (c[n, k] - 8) s[n, g] + z[n, g], c in 0..15 (u8 operand)
 *   int8 (planes = 0):  W[n, k] = c[n, k] s[n, g],  c in -128..127 (s8 operand; the
 *                        activations then enter as u8 q + 128, and 257 * 128 sum_k c is
 *                        taken off S)
 * Per output element y[r, n], acc = 0, for g = 0, 1, ... in order:
 *   S = 256 sum_k q1[r, k] c[n, k] + sum_k q2[r, k] c[n, k]   (exact, i32)
 *   int4: acc = fma((float)S, d[r, g] / 256 * s[n, g], acc);  acc = fma(X[r, g], z'[n, g], acc)
 *         with z' = z - 8 s (the code offset folded into the zero)
 *   int8: acc = fma((float)S, d[r, g] / 256 * s[n, g], acc)
 * d / 256 * s is one fp32 product. Nothing depends on the batch, the tile shape, the columns
 * asked for or the threads: each row's result is the same bits in any step.
 *
 * Layouts (prepared by kernels/native.py; NB = N / 16 column blocks, K % 32 == 0):
 *   codes  int4: uint8 [NB, K / 8, 64]: byte 4 j + t of (block b, octet o) holds in its low
 *          nibble the code of column 16 b + j at k = 8 o + t and in its high nibble the code
 *          at k = 8 o + 4 + t (t = 0..3): lane j of VPDPBUSD is column j.
 *          int8: int8 [NB, K / 4, 64]: byte 4 j + t of (block b, quad u) is the code of
 *          column 16 b + j at k = 4 u + t.
 *   scales fp32 [NB, K / 32, 16]; zeros [NB, K / 32, 16]: int4 fp32 z'; int8 int32
 *          257 * 128 * sum_k c over the group (the offset's share of 256 S1 + S2, taken off exactly)
 *   blocks int32 [nb] the column blocks to compute (NULL: all NB, in order)
 *   y      fp32 [M, nb * 16], row stride ldy
 * Instructions: Intel SDM, VPDPBUSD (AVX512_VNNI).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define MAX_CB 4

typedef struct {
    const uint8_t *codes;
    const float *scales, *zeros;
    /* Quantized activations, row chunks of VMAX_ROWS (see stencil_vnni_gemm): quads of q1, q2
     * [chunk][K / 4][rows][2] (uint32), and d, X [chunk][K / 32][rows][2] (fp32). */
    const uint32_t *act;
    const float *ds;
    int nblocks, k;
} vweights_t;

ALWAYS_INLINE __m512i dpb(__m512i acc, __m512i u8, uint32_t s8quad) {
    return _mm512_dpbusd_epi32(acc, u8, _mm512_set1_epi32((int)s8quad));
}
ALWAYS_INLINE __m512i dpb_rev(__m512i acc, uint32_t u8quad, __m512i s8) {
    return _mm512_dpbusd_epi32(acc, _mm512_set1_epi32((int)u8quad), s8);
}

/* Rows r0 .. r0+R-1, column blocks bl[0 .. CB-1]; INT8: planes = 0. */
ALWAYS_INLINE void vtile(const vweights_t *w, int r0, const int R, const int *bl, const int CB,
                         const int INT8, int col0, float *y, int ldy) {
    const int groups = w->k / 32, ldq = w->k / 4;
    const __m512i nib = _mm512_set1_epi8(15);
    const uint32_t *a = w->act + (size_t)r0 * ldq * 2; /* this chunk: rows r0 .. r0 + R - 1 */
    const float *ds = w->ds + (size_t)r0 * groups * 2;
    __m512 acc[8][MAX_CB];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < CB; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int g = 0; g < groups; ++g) {
        __m512i s1[8][MAX_CB], s2[8][MAX_CB];
        for (int r = 0; r < R; ++r)
            for (int c = 0; c < CB; ++c) s1[r][c] = s2[r][c] = _mm512_setzero_si512();
        if (INT8) {
            for (int uu = 0; uu < 8; ++uu) {
                const int u = g * 8 + uu; /* quad: k = 4u .. 4u+3 */
                const uint32_t *au = a + (size_t)u * R * 2;
                for (int c = 0; c < CB; ++c) {
                    const __m512i wv = _mm512_loadu_si512(w->codes + ((size_t)bl[c] * ldq + u) * 64);
                    for (int r = 0; r < R; ++r) {
                        s1[r][c] = dpb_rev(s1[r][c], au[2 * r], wv);
                        s2[r][c] = dpb_rev(s2[r][c], au[2 * r + 1], wv);
                    }
                }
            }
        } else {
            for (int oo = 0; oo < 4; ++oo) {
                const int o = g * 4 + oo; /* octet: k = 8o .. 8o+7, quads 2o and 2o + 1 */
                const uint32_t *au = a + (size_t)(2 * o) * R * 2, *av = au + R * 2;
                for (int c = 0; c < CB; ++c) {
                    const __m512i v = _mm512_loadu_si512(w->codes + ((size_t)bl[c] * (w->k / 8) + o) * 64);
                    const __m512i lo = _mm512_and_si512(v, nib);
                    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
                    for (int r = 0; r < R; ++r) {
                        s1[r][c] = dpb(s1[r][c], lo, au[2 * r]);
                        s1[r][c] = dpb(s1[r][c], hi, av[2 * r]);
                        s2[r][c] = dpb(s2[r][c], lo, au[2 * r + 1]);
                        s2[r][c] = dpb(s2[r][c], hi, av[2 * r + 1]);
                    }
                }
            }
        }
        for (int c = 0; c < CB; ++c) {
            const size_t off = ((size_t)bl[c] * groups + g) * 16;
            const __m512 s = _mm512_loadu_ps(w->scales + off);
            const __m512 z = INT8 ? _mm512_setzero_ps() : _mm512_loadu_ps(w->zeros + off);
            const __m512i zi = INT8 ? _mm512_loadu_si512(w->zeros + off) : _mm512_setzero_si512();
            for (int r = 0; r < R; ++r) {
                const float *dx = ds + ((size_t)g * R + r) * 2; /* d / 256, X */
                __m512i sum = _mm512_add_epi32(_mm512_slli_epi32(s1[r][c], 8), s2[r][c]);
                if (INT8) sum = _mm512_sub_epi32(sum, zi); /* exact: |S| < 2^28 */
                const __m512 scale = _mm512_mul_ps(s, _mm512_set1_ps(dx[0]));
                acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, acc[r][c]);
                if (!INT8) acc[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(dx[1]), z, acc[r][c]);
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < CB; ++c) _mm512_storeu_ps(y + (size_t)(r0 + r) * ldy + col0 + 16 * c, acc[r][c]);
}

typedef void (*vtile_fn)(const vweights_t *, int, const int *, int, float *, int);
#define VTILE(R, CB, I8)                                                                        \
    static void vtile_##R##_##CB##_##I8(const vweights_t *w, int r0, const int *bl, int col0,  \
                                        float *y, int ldy) {                                   \
        vtile(w, r0, R, bl, CB, I8, col0, y, ldy);                                              \
    }
/* Registers: 2 R CB i32 sums + R CB fp32 accumulators + 2 CB decoded weights (of 32). */
VTILE(1, 4, 0) VTILE(2, 2, 0) VTILE(3, 2, 0) VTILE(4, 2, 0) VTILE(5, 1, 0) VTILE(6, 1, 0)
VTILE(7, 1, 0) VTILE(8, 1, 0) VTILE(1, 1, 0) VTILE(2, 1, 0) VTILE(3, 1, 0) VTILE(4, 1, 0)
VTILE(1, 4, 1) VTILE(2, 2, 1) VTILE(3, 2, 1) VTILE(4, 2, 1) VTILE(5, 1, 1) VTILE(6, 1, 1)
VTILE(7, 1, 1) VTILE(8, 1, 1) VTILE(1, 1, 1) VTILE(2, 1, 1) VTILE(3, 1, 1) VTILE(4, 1, 1)
#define VMAX_ROWS 8
static const vtile_fn VWIDE[2][VMAX_ROWS + 1] = {
    {0, vtile_1_4_0, vtile_2_2_0, vtile_3_2_0, vtile_4_2_0, vtile_5_1_0, vtile_6_1_0, vtile_7_1_0, vtile_8_1_0},
    {0, vtile_1_4_1, vtile_2_2_1, vtile_3_2_1, vtile_4_2_1, vtile_5_1_1, vtile_6_1_1, vtile_7_1_1, vtile_8_1_1}};
static const int VWIDTH[VMAX_ROWS + 1] = {0, 4, 2, 2, 2, 1, 1, 1, 1};
static const vtile_fn VONE[2][5] = {{0, vtile_1_1_0, vtile_2_1_0, vtile_3_1_0, vtile_4_1_0},
                                    {0, vtile_1_1_1, vtile_2_1_1, vtile_3_1_1, vtile_4_1_1}};

/* Quantize one row's groups (see the header) into its chunk: the quads of q1 and q2 (s8, or
 * u8 = s8 + 128 for int8 weights) at act[2 (u R)], act[2 (u R) + 1] for quad u, and d / 256, X
 * at ds[2 (g R)], ds[2 (g R) + 1] for group g (act, ds point at the row's first entries; R the
 * chunk's rows). X adds lanes 0-15 to lanes 16-31, then the 16 lanes in the fixed order of
 * _mm512_reduce_add_ps: the same for every row. */
static void quantize_row(const float *x, int k, int offset, int R, uint32_t *act, float *ds) {
    const __m512 lim = _mm512_set1_ps(127.0f), nlim = _mm512_set1_ps(-127.0f);
    const __m512i off = _mm512_set1_epi32(offset);
    const int rn = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    for (int g = 0; g < k / 32; ++g) {
        const __m512 a0 = _mm512_loadu_ps(x + g * 32), a1 = _mm512_loadu_ps(x + g * 32 + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a0), _mm512_abs_ps(a1)));
        const float step = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        const __m512 vstep = _mm512_set1_ps(step), vinv = _mm512_set1_ps(inv), vinv2 = _mm512_set1_ps(inv * 256.0f);
        for (int h = 0; h < 2; ++h) {
            const __m512 a = h ? a1 : a0;
            __m512 u = _mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(_mm512_mul_ps(a, vinv), rn), nlim), lim);
            __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_fnmadd_ps(u, vstep, a), vinv2), rn);
            v = _mm512_min_ps(_mm512_max_ps(v, nlim), lim);
            uint32_t b1[4], b2[4];
            _mm_storeu_si128((__m128i *)b1, _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_cvtps_epi32(u), off)));
            _mm_storeu_si128((__m128i *)b2, _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_cvtps_epi32(v), off)));
            for (int t = 0; t < 4; ++t) {
                const size_t quad = (size_t)g * 8 + h * 4 + t;
                act[quad * R * 2] = b1[t];
                act[quad * R * 2 + 1] = b2[t];
            }
        }
        ds[(size_t)g * R * 2] = step / 256.0f; /* exact: a power-of-two division */
        ds[(size_t)g * R * 2 + 1] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    }
}

/* y[M, nb*16] = x[M, K] @ W[blocks].T; planes 1 (int4) or 0 (int8). Returns 0, or -1 on bad
 * arguments or no memory. */
int stencil_vnni_gemm(const float *x, int m, int k, const uint8_t *codes, const float *scales, const float *zeros,
                      int planes, int nblocks, const int *blocks, int nb, float *y, int ldy, int threads) {
    if (m <= 0 || k <= 0 || k % 32 || (planes != 0 && planes != 1) || nb <= 0) return -1;
    const int groups = k / 32;
    const int chunks = (m + VMAX_ROWS - 1) / VMAX_ROWS;
    const int last = m - (chunks - 1) * VMAX_ROWS;
    /* Row chunks of VMAX_ROWS rows (the last one smaller), each chunk's activations interleaved
     * by row, so that a tile reads every row's quads at fixed offsets from one pointer. */
    const size_t rows_alloc = (size_t)chunks * VMAX_ROWS;
    uint32_t *act = malloc(sizeof(uint32_t) * rows_alloc * (k / 4) * 2);
    float *ds = malloc(sizeof(float) * rows_alloc * groups * 2);
    if (!act || !ds) {
        free(act);
        free(ds);
        return -1;
    }
    const int offset = planes == 0 ? 128 : 0;
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1) if (threads > 1 && m >= 16)
    for (int r = 0; r < m; ++r) {
        const int ch = r / VMAX_ROWS, rows = ch == chunks - 1 ? last : VMAX_ROWS, rr = r % VMAX_ROWS;
        quantize_row(x + (size_t)r * k, k, offset, rows,
                     act + (size_t)ch * VMAX_ROWS * (k / 4) * 2 + (size_t)rr * 2,
                     ds + (size_t)ch * VMAX_ROWS * groups * 2 + (size_t)rr * 2);
    }
    vweights_t w = {codes, scales, zeros, act, ds, nblocks, k};
    const int i8 = planes == 0; /* table index: 0 = int4 weights, 1 = int8 */
    (void)threads;
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads > 0 ? threads : 1) if (threads > 1)
    for (int b = 0; b < nb; ++b)
        for (int ch = 0; ch < chunks; ++ch) {
            const int rows = ch == chunks - 1 ? last : VMAX_ROWS, r0 = ch * VMAX_ROWS;
            const int cb = VWIDTH[rows];
            if (b % cb) continue;
            int ids[MAX_CB];
            const int count = nb - b < cb ? nb - b : cb;
            for (int c = 0; c < count; ++c) ids[c] = blocks ? blocks[b + c] : b + c;
            if (count == cb)
                VWIDE[i8][rows](&w, r0, ids, 16 * b, y, ldy);
            else
                for (int c = 0; c < count; ++c) VONE[i8][rows](&w, r0, ids + c, 16 * (b + c), y, ldy);
        }
    free(act);
    free(ds);
    return 0;
}

/* 1 when this CPU runs VPDPBUSD on 512-bit registers (checked at run time). */
int stencil_vnni_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vnni");
}
