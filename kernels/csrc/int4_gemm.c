/* Batch-invariant int4 GEMM for x86 CPUs with AVX512-BF16: y = x @ W.T.
 *
 * Why: torch's CPU int4 kernel (aten._weight_int4pack_mm_for_cpu) converts weights to fp32
 * and multiplies them 4 rows of x at a time with fp32 FMAs, so each extra 4 rows cost about
 * what the first 4 did. A speculative verification step (a decode row plus its draft rows) or
 * a batch of decodes has 8-32 rows. Here the codes themselves become bf16 integers (c - 8 is
 * exact in bf16) by one table lookup (VPERMW) per 32 weights, and VDPBF16PS multiplies them
 * into every row two products per fp32 lane; the group's scale is applied once per 32 inputs.
 *
 * Weights: W[n, k] = sum_p (c_p[n, k] - 8) * s_p[n, g] + z[n, g], g = k / 32, P = 1 or 2 planes
 * (Q8_0 is two planes, see engine/models/quant.py), z the planes' zeros added.
 * Per output element y[r, n], with acc = 0 and for g = 0, 1, ... in order:
 *   part_p = sum over the group's k-pairs, in order, of VDPBF16PS steps
 *            (x[r, k] (c_p[n, k] - 8) + x[r, k+1] (c_p[n, k+1] - 8)), fp32, from 0
 *   acc = fma(part_0, s_0[n, g], acc); acc = fma(part_1, s_1[n, g], acc) (two planes)
 *   acc = fma(X[r, g], z[n, g], acc),  X[r, g] = sum of the group's x[r, k] in fp32, in order.
 * Nothing in that order depends on how many rows x has, which columns are asked for, how rows
 * are grouped into register tiles or how many threads run: a row's result is the same bits
 * whatever batch it is in.
 *
 * planes = 0 is one plane of int8 codes q (GGUF Q8_0: W = q * s): codes int8 [NB, K / 2, 32], byte
 * e of (block b, k-pair q) the code of column 16 b + e / 2 at k = 2 q + e % 2; q is exact in bf16,
 * and the same order as above applies with one part per group.
 *
 * Layouts (prepared by kernels/native.py; NB = N / 16 column blocks, K % 32 == 0):
 *   x      uint16 (bf16 bits) [M, K], rows contiguous
 *   codes  uint8  [P, NB, K / 4, 32]: byte e of (block b, quad q) holds in its low nibble the
 *          code of column 16 b + e / 2 at k = 4 q + e % 2 and in its high nibble the code of the
 *          same column at k = 4 q + 2 + e % 2 (so lane e / 2 of VDPBF16PS is column e / 2)
 *   scales fp32   [P, NB, K / 32, 16]; zeros fp32 [NB, K / 32, 16]
 *   blocks int32  [nb] which column blocks to compute (NULL: all NB, in order)
 *   y      fp32   [M, nb * 16], row stride ldy
 * Instructions: Intel SDM, VDPBF16PS (AVX512_BF16), VPERMW (AVX512BW).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define MAX_CB 4

typedef struct {
    const uint8_t *codes;
    const float *scales, *zeros, *xsum;
    int nblocks, k;
} weights_t;

/* bf16 bits of c - 8 for c = 0..15 (twice, VPERMW reads 5 index bits). */
static __m512i code_table(void) {
    uint16_t t[32];
    for (int c = 0; c < 32; ++c) {
        float f = (float)((c & 15) - 8);
        uint32_t bits;
        __builtin_memcpy(&bits, &f, 4);
        t[c] = (uint16_t)(bits >> 16); /* exact: small integers */
    }
    return _mm512_loadu_si512(t);
}

ALWAYS_INLINE __m512 dp(__m512 acc, uint32_t xpair, __m512i w) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32((int)xpair), (__m512bh)w);
}

/* Rows r0 .. r0+R-1 of x, column blocks bl[0 .. CB-1], P planes: all in registers. */
ALWAYS_INLINE void tile(const weights_t *w, const uint32_t *x, int r0, const int R, const int *bl,
                        const int CB, const int P, int col0, float *y, int ldy) {
    const __m512i table = code_table(), nib = _mm512_set1_epi16(15);
    const int groups = w->k / 32, quads = w->k / 4, ldx = w->k / 2;
    __m512 acc[12][MAX_CB];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < CB; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int g = 0; g < groups; ++g) {
        __m512 part[2][12][MAX_CB];
        for (int p = 0; p < (P ? P : 1); ++p)
            for (int r = 0; r < R; ++r)
                for (int c = 0; c < CB; ++c) part[p][r][c] = _mm512_setzero_ps();
        if (P == 0) { /* one int8 plane: 16 k-pairs of 32 bytes per column block */
            for (int qq = 0; qq < 16; ++qq) {
                const int q = g * 16 + qq; /* k-pair: k = 2q, 2q + 1 */
                for (int c = 0; c < CB; ++c) {
                    const uint8_t *src = w->codes + ((size_t)bl[c] * (w->k / 2) + q) * 32;
                    const __m256i v = _mm256_loadu_si256((const __m256i *)src);
                    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v)));
                    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1)));
                    const __m512i wv = (__m512i)_mm512_cvtne2ps_pbh(hi, lo); /* exact: |q| <= 128 */
                    for (int r = 0; r < R; ++r)
                        part[0][r][c] = dp(part[0][r][c], x[(size_t)(r0 + r) * ldx + q], wv);
                }
            }
        } else
        for (int qq = 0; qq < 8; ++qq) {
            const int q = g * 8 + qq; /* quad: k = 4q .. 4q+3 */
            for (int p = 0; p < P; ++p)
                for (int c = 0; c < CB; ++c) {
                    const uint8_t *src = w->codes + (((size_t)p * w->nblocks + bl[c]) * quads + q) * 32;
                    __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)src));
                    __m512i lo = _mm512_permutexvar_epi16(_mm512_and_si512(v, nib), table);
                    __m512i hi = _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), table);
                    for (int r = 0; r < R; ++r) {
                        const uint32_t *xr = x + (size_t)(r0 + r) * ldx + 2 * q;
                        part[p][r][c] = dp(part[p][r][c], xr[0], lo);
                        part[p][r][c] = dp(part[p][r][c], xr[1], hi);
                    }
                }
        }
        for (int c = 0; c < CB; ++c) {
            const size_t off = ((size_t)bl[c] * groups + g) * 16;
            const __m512 z = _mm512_loadu_ps(w->zeros + off);
            __m512 s[2];
            for (int p = 0; p < (P ? P : 1); ++p)
                s[p] = _mm512_loadu_ps(w->scales + (size_t)p * w->nblocks * groups * 16 + off);
            for (int r = 0; r < R; ++r) {
                for (int p = 0; p < (P ? P : 1); ++p) acc[r][c] = _mm512_fmadd_ps(part[p][r][c], s[p], acc[r][c]);
                const __m512 xs = _mm512_set1_ps(w->xsum[(size_t)(r0 + r) * groups + g]);
                acc[r][c] = _mm512_fmadd_ps(xs, z, acc[r][c]);
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < CB; ++c)
            _mm512_storeu_ps(y + (size_t)(r0 + r) * ldy + col0 + 16 * c, acc[r][c]);
}

/* One function per (R, CB, P) so that the loops unroll and the tiles stay in registers. */
typedef void (*tile_fn)(const weights_t *, const uint32_t *, int, const int *, int, float *, int);
#define TILE(R, CB, P)                                                                          \
    static void tile_##R##_##CB##_##P(const weights_t *w, const uint32_t *x, int r0,           \
                                      const int *bl, int col0, float *y, int ldy) {            \
        tile(w, x, r0, R, bl, CB, P, col0, y, ldy);                                             \
    }
/* Registers: CB * R * (P + 1) accumulators of 32. Each R has a CB = 1 tile for the tail. */
TILE(1, 4, 1) TILE(2, 4, 1) TILE(3, 2, 1) TILE(4, 2, 1) TILE(5, 2, 1) TILE(6, 2, 1)
TILE(1, 1, 1) TILE(2, 1, 1) TILE(3, 1, 1) TILE(4, 1, 1) TILE(5, 1, 1) TILE(6, 1, 1)
TILE(7, 1, 1) TILE(8, 1, 1) TILE(9, 1, 1) TILE(10, 1, 1) TILE(11, 1, 1) TILE(12, 1, 1)
TILE(1, 4, 2) TILE(2, 2, 2)
TILE(1, 1, 2) TILE(2, 1, 2) TILE(3, 1, 2) TILE(4, 1, 2) TILE(5, 1, 2) TILE(6, 1, 2)
TILE(7, 1, 2) TILE(8, 1, 2)
TILE(1, 4, 0) TILE(2, 4, 0) TILE(3, 2, 0) TILE(4, 2, 0) TILE(5, 2, 0) TILE(6, 2, 0)
TILE(1, 1, 0) TILE(2, 1, 0) TILE(3, 1, 0) TILE(4, 1, 0) TILE(5, 1, 0) TILE(6, 1, 0)
TILE(7, 1, 0) TILE(8, 1, 0) TILE(9, 1, 0) TILE(10, 1, 0) TILE(11, 1, 0) TILE(12, 1, 0)
#define MAX_ROWS 12
/* Indexed by planes: 0 = one int8 plane, 1 or 2 = int4 planes. */
static const tile_fn WIDE[3][MAX_ROWS + 1] = {
    {0, tile_1_4_0, tile_2_4_0, tile_3_2_0, tile_4_2_0, tile_5_2_0, tile_6_2_0},
    {0, tile_1_4_1, tile_2_4_1, tile_3_2_1, tile_4_2_1, tile_5_2_1, tile_6_2_1},
    {0, tile_1_4_2, tile_2_2_2}};
static const int WIDTH[3][MAX_ROWS + 1] = {{0, 4, 4, 2, 2, 2, 2}, {0, 4, 4, 2, 2, 2, 2}, {0, 4, 2}};
static const tile_fn ONE[3][MAX_ROWS + 1] = {
    {0, tile_1_1_0, tile_2_1_0, tile_3_1_0, tile_4_1_0, tile_5_1_0, tile_6_1_0, tile_7_1_0,
     tile_8_1_0, tile_9_1_0, tile_10_1_0, tile_11_1_0, tile_12_1_0},
    {0, tile_1_1_1, tile_2_1_1, tile_3_1_1, tile_4_1_1, tile_5_1_1, tile_6_1_1, tile_7_1_1,
     tile_8_1_1, tile_9_1_1, tile_10_1_1, tile_11_1_1, tile_12_1_1},
    {0, tile_1_1_2, tile_2_1_2, tile_3_1_2, tile_4_1_2, tile_5_1_2, tile_6_1_2, tile_7_1_2,
     tile_8_1_2}};

/* y[M, nb*16] = x[M, K] @ W[blocks].T. Returns 0, or -1 on bad arguments or no memory. */
int stencil_int4_gemm(const uint16_t *x, int m, int k, const uint8_t *codes, const float *scales,
                      const float *zeros, int planes, int nblocks, const int *blocks, int nb,
                      float *y, int ldy, int threads) {
    if (m <= 0 || k <= 0 || k % 32 || planes < 0 || planes > 2 || nb <= 0) return -1;
    const int groups = k / 32;
    float *xsum = malloc(sizeof(float) * (size_t)m * groups);
    if (!xsum) return -1;
    for (int r = 0; r < m; ++r)
        for (int g = 0; g < groups; ++g) {
            float s = 0.0f;
            for (int i = 0; i < 32; ++i) {
                uint32_t bits = (uint32_t)x[(size_t)r * k + g * 32 + i] << 16;
                float f;
                __builtin_memcpy(&f, &bits, 4);
                s += f;
            }
            xsum[(size_t)r * groups + g] = s;
        }
    weights_t w = {codes, scales, zeros, xsum, nblocks, k};
    const uint32_t *x32 = (const uint32_t *)x;
    /* Rows per register tile: 12 for one int4 plane, 8 for two planes or int8 (more spill). */
    const int max_rows = planes == 1 ? 12 : 8;
    /* Column blocks (in groups of the chunk's width) times rows in chunks of max_rows, the last
     * one smaller (a small last chunk gets a wide tile; balanced chunks of 5-7 rows measured
     * slower): each pair is one work item. Row chunks run inner, so a block's weights are read
     * from memory once and from cache for the other chunks (the LM head is 28 MB). */
    const int chunks = (m + max_rows - 1) / max_rows;
    const int last = m - (chunks - 1) * max_rows;
    (void)threads;
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads > 0 ? threads : 1) if (threads > 1)
    for (int b = 0; b < nb; ++b)
        for (int ch = 0; ch < chunks; ++ch) {
            const int rows = ch == chunks - 1 ? last : max_rows, r0 = ch * max_rows;
            const int cb = WIDTH[planes][rows] ? WIDTH[planes][rows] : 1;
            if (b % cb) continue;
            int ids[MAX_CB];
            const int count = nb - b < cb ? nb - b : cb;
            for (int c = 0; c < count; ++c) ids[c] = blocks ? blocks[b + c] : b + c;
            if (count == cb && cb > 1)
                WIDE[planes][rows](&w, x32, r0, ids, 16 * b, y, ldy);
            else
                for (int c = 0; c < count; ++c)
                    ONE[planes][rows](&w, x32, r0, ids + c, 16 * (b + c), y, ldy);
        }
    free(xsum);
    return 0;
}

/* 1 when this CPU runs the instructions above (checked at run time, not compile time). */
int stencil_int4_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512bf16");
}
