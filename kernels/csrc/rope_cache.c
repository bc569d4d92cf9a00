/* RoPE on q and k and the paged-cache write of k and v, in one call: the step of every
 * attention layer between the QKV projection and the attention kernel.
 *
 * Why: in torch this is about 25 small operations per layer (slices, four products, a
 * difference, a sum and a concatenation for q and again for k, then two index copies); at one
 * decode row each costs its dispatch, not its arithmetic, so a 30-layer model spent 1.5 ms of a
 * 12 ms step here. The arithmetic is exactly torch's (kernels/layer_ops.apply_rope, the
 * "rotate half" layout of Llama / Qwen / Gemma: dims i and i + D/2 form a pair):
 *   out[i]       = x[i] c[i] - x[i + D/2] s[i]
 *   out[i + D/2] = x[i + D/2] c[i] + x[i] s[i]
 * each product and each sum rounded to fp32 on its own (compiled with -ffp-contract=off: no
 * fused multiply-add), so every value has the bits torch gives. The cache write copies k (after
 * RoPE) and v into slot slots[t] of [num_slots, kv_heads, D] caches, fp32 as they are (kind 0), or
 * bf16 (1) / fp16 (2) rounded to nearest even, as torch's .to(torch.bfloat16 / torch.float16) rounds
 * (a NaN stays a NaN: 0x7FC0, or a quiet fp16 NaN of its sign).
 *
 * Layouts: q [T, heads, D], k and v [T, kv_heads, D] with row strides q_row, k_row, v_row
 * (floats; heads and dims contiguous: views of the fused QKV output); cos, sin fp32 [T, D/2];
 * slots int64 [T]; q_out fp32 [T, heads, D] contiguous.
 */
#include <stdint.h>
#include <string.h>

static inline void rotate(const float *x, const float *c, const float *s, int half, float *out) {
    for (int i = 0; i < half; ++i) {
        const float a = x[i], b = x[i + half];
        const float ac = a * c[i], bs = b * s[i], bc = b * c[i], as = a * s[i];
        out[i] = ac - bs;
        out[i + half] = bc + as;
    }
}

/* IEEE half, rounded to nearest even as torch's .to(torch.float16) rounds (subnormals kept,
 * 65520 and above to infinity, a NaN a quiet NaN of the same sign). */
static inline uint16_t to_fp16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    const uint32_t a = x & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7e00u;
    if (a >= 0x477ff000u) return sign | 0x7c00u;
    if (a < 0x38800000u) { /* below 2^-14: a multiple of 2^-24, rounded to nearest even */
        float v;
        memcpy(&v, &a, 4);
        const float scaled = v * 16777216.0f; /* exact: a power of two */
        uint32_t m = (uint32_t)scaled;        /* truncated; then to nearest, ties to even */
        const float rest = scaled - (float)m;
        if (rest > 0.5f || (rest == 0.5f && (m & 1u))) ++m;
        return sign | (uint16_t)m;
    }
    return sign | (uint16_t)((a + 0xfffu + ((a >> 13) & 1u) - 0x38000000u) >> 13);
}

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Returns 0, or -1 on bad arguments (odd D, a slot below 0 or at or past num_slots). */
int stencil_rope_cache(const float *q, long q_row, int heads, const float *k, long k_row, const float *v, long v_row,
                       int kv_heads, int dim, const float *cos, const float *sin, int t, const int64_t *slots,
                       long num_slots, void *k_cache, void *v_cache, int kind, float *q_out) {
    if (dim <= 0 || dim % 2 || t < 0 || heads <= 0 || kv_heads <= 0 || kind < 0 || kind > 2) return -1;
    for (int r = 0; r < t; ++r)
        if (slots[r] < 0 || slots[r] >= num_slots) return -1;
    const int half = dim / 2;
    float krot[dim];
    for (int r = 0; r < t; ++r) {
        const float *c = cos + (long)r * half, *s = sin + (long)r * half;
        for (int h = 0; h < heads; ++h)
            rotate(q + r * q_row + (long)h * dim, c, s, half, q_out + ((long)r * heads + h) * dim);
        const long slot = (long)slots[r] * kv_heads * dim;
        for (int h = 0; h < kv_heads; ++h) {
            rotate(k + r * k_row + (long)h * dim, c, s, half, krot);
            const float *vv = v + r * v_row + (long)h * dim;
            if (kind) {
                uint16_t *kc = (uint16_t *)k_cache + slot + (long)h * dim, *vc = (uint16_t *)v_cache + slot + (long)h * dim;
                for (int i = 0; i < dim; ++i) {
                    kc[i] = kind == 2 ? to_fp16(krot[i]) : to_bf16(krot[i]);
                    vc[i] = kind == 2 ? to_fp16(vv[i]) : to_bf16(vv[i]);
                }
            } else {
                memcpy((float *)k_cache + slot + (long)h * dim, krot, sizeof(float) * dim);
                memcpy((float *)v_cache + slot + (long)h * dim, vv, sizeof(float) * dim);
            }
        }
    }
    return 0;
}
