/* The gated activations of the MLP in one call: out = act(gate) * up over rows of a fused
 * gate/up projection, act = SiLU (Llama, Qwen) or GELU with the tanh approximation (Gemma).
 *
 * Why: torch's silu and product are two dispatches a layer and give bits that a C decoder
 * (csrc/decoder.c) cannot reproduce; with one definition here both the torch-driven layers
 * and the C-driven ones compute the same bits (a greedy output cannot depend on which ran).
 *
 * Arithmetic (each operation rounded to fp32 on its own: -ffp-contract=off, no fast-math;
 * every element is computed by the same 8-lane code, a row's tail padded, so an element's bits
 * depend on its value alone):
 *   silu:      act(g) = g / (1 + e^-g)
 *   gelu_tanh: act(g) = g / (1 + e^-2y), y = sqrt(2 / pi) (g + 0.044715 g^3)
 *              (0.5 g (1 + tanh y) = g sigmoid(2 y): the same function, no cancellation)
 *   e^x: x clamped to [-87, 88], n = round(x log2 e) (ties to even, by adding 1.5 * 2^23),
 *        r = (x - n c1) - n c2 with c1 + c2 = ln 2 (c1 exact in 12 bits), e^r by Cephes' degree-5
 *        polynomial (Moshier, Cephes Math Library, expf.c: within about 1 ulp on |r| <= ln2 / 2),
 *        times 2^n built in the exponent bits.
 *
 * Layouts: gu fp32 [T, >= 2 I] with row stride ld (gate in columns 0..I-1, up in I..2I-1);
 * out fp32 [T, I] contiguous. OpenMP over rows from 16 rows up when built with it.
 */
#include <stdint.h>
#include <string.h>

typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));

static inline __attribute__((always_inline)) f32x8 splat(float v) { return (f32x8){v, v, v, v, v, v, v, v}; }

/* lanes of a where mask, else b (mask: all-ones or zero lanes of a comparison) */
static inline __attribute__((always_inline)) f32x8 select8(i32x8 mask, f32x8 a, f32x8 b) {
    i32x8 ia, ib;
    memcpy(&ia, &a, 32);
    memcpy(&ib, &b, 32);
    const i32x8 r = (ia & mask) | (ib & ~mask);
    f32x8 out;
    memcpy(&out, &r, 32);
    return out;
}

static inline __attribute__((always_inline)) f32x8 exp8(f32x8 x) {
    x = select8(x < splat(-87.0f), splat(-87.0f), x);
    x = select8(x > splat(88.0f), splat(88.0f), x);
    const f32x8 magic = splat(12582912.0f); /* 1.5 * 2^23 */
    const f32x8 n = (x * splat(1.44269504088896341f) + magic) - magic;
    const f32x8 r = (x - n * splat(0.693359375f)) - n * splat(-2.12194440e-4f);
    f32x8 p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    p = (p * (r * r) + r) + splat(1.0f);
    const i32x8 e = (__builtin_convertvector(n, i32x8) + 127) << 23;
    f32x8 scale;
    memcpy(&scale, &e, 32);
    return p * scale;
}

static inline __attribute__((always_inline)) f32x8 act8(int kind, f32x8 g) {
    if (kind == 0) return g / (splat(1.0f) + exp8(-g));
    const f32x8 y = splat(0.7978845608028654f) * (g + splat(0.044715f) * ((g * g) * g));
    return g / (splat(1.0f) + exp8(splat(-2.0f) * y));
}

static void glu_row(int kind, const float *gate, const float *up, int n, float *out) {
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        f32x8 g, u;
        memcpy(&g, gate + i, 32);
        memcpy(&u, up + i, 32);
        const f32x8 o = act8(kind, g) * u;
        memcpy(out + i, &o, 32);
    }
    if (i < n) {
        f32x8 g = {0}, u = {0}, o;
        memcpy(&g, gate + i, sizeof(float) * (n - i));
        memcpy(&u, up + i, sizeof(float) * (n - i));
        o = act8(kind, g) * u;
        memcpy(out + i, &o, sizeof(float) * (n - i));
    }
}

/* kind 0: SiLU, 1: GELU (tanh). Returns 0, or -1 on bad arguments. */
int stencil_glu(int kind, const float *gu, long ld, long t, int inter, float *out, int threads) {
    if ((kind != 0 && kind != 1) || t < 0 || inter < 1 || ld < 2L * inter) return -1;
    (void)threads;
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1) if (threads > 1 && t >= 16)
    for (long r = 0; r < t; ++r) glu_row(kind, gu + r * ld, gu + r * ld + inter, inter, out + r * (long)inter);
    return 0;
}
