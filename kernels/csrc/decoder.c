/* A decoder stack's layers in one call: the forward of every layer of a Llama-family or Gemma 3
 * model over one flat batch of tokens, for CPU fp32 activations and quantized weights.
 *
 * Why: a decode step of a small model does ~12 operations a layer, each a few microseconds of
 * arithmetic and several of Python, module calls and tensor allocation around it. SmolLM2-135M
 * (30 layers) spent ~4 ms of a ~9 ms decode step outside its kernels on a 2-core AMD EPYC
 * (2026-12-05), where llama.cpp's whole step takes ~6.7 ms. Here the layers run from C: one
 * call a step, the same kernels in the same order, so each row gets the bits the torch-driven
 * layers give (engine/models/llama.py, gemma3.py; tests pin the equality).
 *
 * Per layer (h: the residual stream, fp32 [T, hidden], updated in place):
 *   x   = rms_norm(h, attn_in_norm)
 *   qkv = x @ Wqkv.T (+ bias)                       one fused projection
 *   q, k = rms_norm per head (q_norm, k_norm)        when given (Qwen3, Gemma 3)
 *   q'  = RoPE(q); k' = RoPE(k) and v into the cache (stencil_rope_cache)
 *   a   = paged attention(q', cache) (window, scale) (the attention kernel, by pointer)
 *   o   = a @ Wo.T (+ bias);  h += attn_out_norm ? rms_norm(o, attn_out_norm) : o
 *   x   = rms_norm(h, mlp_in_norm)
 *   g   = act(x @ Wgate.T) * (x @ Wup.T)            (stencil_glu on the fused projection)
 *   d   = g @ Wdown.T (+ bias); h += mlp_out_norm ? rms_norm(d, mlp_out_norm) : d
 * Additions are single fp32 roundings (h + o and o + h are the same bits).
 *
 * Projections, by kind:
 *   1: kernels/native.py's PackedInt4 packed for VNNI (stencil_vnni_gemm, output padded to
 *      whole blocks of 16 columns: ldy);
 *   2: GGUF blocks in place (kernels/ggml_blocks.py: stencil_gguf_quantize once per group size,
 *      then stencil_gguf_gemm per part, parts stacked by rows).
 * The GEMM, quantize and attention kernels live in other libraries (other compiler flags) and
 * are called through the pointers in model_t, taken from their ctypes handles.
 *
 * KV cache groups: each layer reads the step's block tables and slots numbered `table` (1: a hybrid
 * cache's sliding-window group, engine/kv_cache_manager.py) and writes a cache of `num_slots` slots.
 *
 * Memory: no allocation; the caller passes a workspace of stencil_decoder_workspace(m, T) bytes
 * (per token: the attention's buffers or the MLP's, whichever is larger, plus the residual's).
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define MAX_PARTS 4
#define ALIGN 16 /* floats */

int stencil_rms_norm(const float *x, long outer, long inner, int dim, long outer_stride, const float *w, float eps,
                     float *y, int threads);
int stencil_rope_cache(const float *q, long q_row, int heads, const float *k, long k_row, const float *v, long v_row,
                       int kv_heads, int dim, const float *cos, const float *sin, int t, const int64_t *slots,
                       long num_slots, void *k_cache, void *v_cache, int kind, float *q_out);
int stencil_glu(int kind, const float *gu, long ld, long t, int inter, float *out, int threads);

typedef int (*vnni_gemm_fn)(const float *x, int m, int k, const uint8_t *codes, const float *scales,
                            const void *zeros, int planes, int nblocks, const int *blocks, int nb, float *y, int ldy,
                            int threads);
typedef int (*gguf_quantize_fn)(const float *x, int m, int k, int group, int8_t *q1, int8_t *q2, float *dx,
                                float *x16, int threads);
typedef int (*gguf_gemm_fn)(int type, const uint8_t *w, long row_bytes, int k, const int *cols, int ncols, int group,
                            const int8_t *q1, const int8_t *q2, const float *dx, const float *x16, int m, float *y,
                            long ldy, int threads);
typedef int (*attention_fn)(const float *q, int heads, int kv_heads, int d, const void *k_cache, const void *v_cache,
                            int cache_kind, int block_size, const int *block_tables, int max_blocks,
                            const int *query_start_loc, const int *seq_lens, int num_seqs, float scale, int window,
                            float *out, int threads);

typedef struct {
    int32_t type, group; /* the GGUF kernel's type id; weights per activation scale (32 or 256) */
    int64_t row_bytes;
    const uint8_t *w;    /* uint8 [rows, row_bytes] */
    int32_t start, rows; /* output columns start .. start + rows */
} part_t;

typedef struct {
    int32_t kind;      /* 1: VNNI int4/int8, 2: GGUF blocks */
    int32_t k, n, ldy; /* in features, out features, output row stride (floats, >= n) */
    const float *bias; /* [n] or NULL */
    const uint8_t *codes;
    const float *scales;
    const void *zeros;
    int32_t planes, nblocks; /* kind 1 */
    int32_t terms, nparts;   /* kind 2 */
    part_t parts[MAX_PARTS];
} linear_t;

typedef struct {
    const float *attn_in_norm, *attn_out_norm, *mlp_in_norm, *mlp_out_norm, *q_norm, *k_norm; /* [hidden] / [D] */
    linear_t qkv, o, gate_up, down;
    void *k_cache, *v_cache; /* [num_slots, kv_heads, D], fp32, bf16 or fp16 */
    int64_t num_slots;       /* slots of this layer's cache (its KV cache group's blocks x block_size) */
    int32_t window, rope;    /* window in tokens (0: none); which RoPE table of the step (0 or 1) */
    int32_t table;           /* which block tables and slots of the step it reads (1: a window group's) */
    float scale;             /* softmax scale */
} layer_t;

typedef struct {
    int32_t num_layers, hidden, heads, kv_heads, head_dim, inter;
    int32_t act; /* 0: SiLU, 1: GELU (tanh) */
    int32_t cache_kind, block_size;
    float eps;
    vnni_gemm_fn vnni_gemm;
    gguf_quantize_fn gguf_quantize;
    gguf_gemm_fn gguf_gemm;
    attention_fn attention;
    const layer_t *layers;
} model_t;

typedef struct {
    int32_t t, num_seqs, max_blocks, threads;
    float *h; /* [T, hidden], in and out */
    const float *cos[2], *sin[2]; /* [T, D / 2] each */
    const int64_t *slots[2];      /* [T] each: the new tokens' slots in table 0's group and table 1's */
    const int32_t *block_tables[2]; /* [num_seqs, max_blocks] each (the same pointers with one group) */
    const int32_t *query_start_loc, *seq_lens;
    void *workspace;
    int64_t workspace_bytes;
} step_t;

static size_t up16(size_t n) { return (n + ALIGN - 1) / ALIGN * ALIGN; }

typedef struct {
    size_t x, qkv, qn, kn, qr, ao, lo, tmp, gu, act, acts; /* offsets in floats */
    size_t floats;                                        /* total, the activation bytes included */
} layout_t;

static int max_i(int a, int b) { return a > b ? a : b; }

static layout_t layout(const model_t *m, size_t t) {
    int qkv = 0, lo = 0, gu = 0, kmax = 0;
    for (int l = 0; l < m->num_layers; ++l) {
        const layer_t *L = m->layers + l;
        qkv = max_i(qkv, L->qkv.ldy);
        lo = max_i(lo, max_i(L->o.ldy, L->down.ldy));
        gu = max_i(gu, L->gate_up.ldy);
        const linear_t *lin[4] = {&L->qkv, &L->o, &L->gate_up, &L->down};
        for (int i = 0; i < 4; ++i)
            if (lin[i]->kind == 2) kmax = max_i(kmax, lin[i]->k);
    }
    const size_t qsize = (size_t)m->heads * m->head_dim, kvsize = (size_t)m->kv_heads * m->head_dim;
    layout_t L;
    size_t at = 0;
    L.x = at, at += up16(t * m->hidden);
    L.lo = at, at += up16(t * lo);
    L.tmp = at, at += up16(t * m->hidden);
    /* The attention's buffers are dead once the output projection has read `ao`; the MLP's
     * (gate/up and the gated activation, the largest) take the same memory after them. */
    const size_t shared = at;
    L.qkv = at, at += up16(t * qkv);
    L.qn = at, at += up16(t * qsize);
    L.kn = at, at += up16(t * kvsize);
    L.qr = at, at += up16(t * qsize);
    L.ao = at, at += up16(t * qsize);
    L.gu = shared;
    L.act = shared + up16(t * gu);
    const size_t mlp_end = L.act + up16(t * m->inter);
    at = at > mlp_end ? at : mlp_end;
    /* GGUF activations (kernels/ggml_blocks.py's Activations): q1, q2 int8 [T, K]; dx, x16 */
    const size_t spans = ((size_t)kmax + 255) / 256;
    L.acts = at, at += up16((2 * t * kmax + 96 * t * spans + 3) / 4);
    L.floats = at;
    return L;
}

/* Bytes of workspace a step of t tokens needs. */
int64_t stencil_decoder_workspace(const model_t *m, int t) {
    return t < 0 ? -1 : (int64_t)(layout(m, (size_t)t).floats * sizeof(float) + 64);
}

/* y[T, ldy] = x[T, k] @ W.T (+ bias) */
static int linear(const model_t *m, const linear_t *L, const float *x, int t, float *y, void *acts, int threads) {
    if (L->kind == 1) {
        if (m->vnni_gemm(x, t, L->k, L->codes, L->scales, L->zeros, L->planes, L->nblocks, NULL, L->nblocks, y,
                         L->ldy, threads))
            return -1;
    } else if (L->kind == 2) {
        const size_t spans = ((size_t)L->k + 255) / 256, tk = (size_t)t * L->k;
        int8_t *q1 = acts, *q2 = L->terms == 2 ? (int8_t *)acts + tk : NULL;
        float *dx = (float *)((int8_t *)acts + 2 * tk), *x16 = dx + 8 * (size_t)t * spans;
        int have = 0; /* group of the activations quantized last (parts of one group share them) */
        for (int p = 0; p < L->nparts; ++p) {
            const part_t *P = L->parts + p;
            if (P->group != have) {
                if (m->gguf_quantize(x, t, L->k, P->group, q1, q2, dx, x16, threads)) return -1;
                have = P->group;
            }
            if (m->gguf_gemm(P->type, P->w, P->row_bytes, L->k, NULL, P->rows, P->group, q1, q2, dx, x16, t,
                             y + P->start, L->ldy, threads))
                return -1;
        }
    } else {
        return -1;
    }
    if (L->bias)
        for (int r = 0; r < t; ++r) {
            float *yr = y + (size_t)r * L->ldy;
            for (int j = 0; j < L->n; ++j) yr[j] = yr[j] + L->bias[j];
        }
    return 0;
}

/* h += norm ? rms_norm(y) : y, y [T, hidden] with row stride ldy */
static void residual(const model_t *m, float *h, const float *y, long ldy, const float *norm, float *tmp, int t,
                     int threads) {
    const int d = m->hidden;
    if (norm) {
        stencil_rms_norm(y, t, 1, d, ldy, norm, m->eps, tmp, threads);
        y = tmp, ldy = d;
    }
    for (int r = 0; r < t; ++r) {
        float *hr = h + (size_t)r * d;
        const float *yr = y + (size_t)r * ldy;
        for (int j = 0; j < d; ++j) hr[j] = hr[j] + yr[j];
    }
}

/* Returns 0; -1 bad arguments or workspace; -(100 + 10 layer + stage) where a kernel refused. */
int stencil_decoder_forward(const model_t *m, const step_t *s) {
    const int t = s->t, d = m->head_dim, th = s->threads;
    if (t <= 0) return t == 0 ? 0 : -1;
    const layout_t lay = layout(m, (size_t)t);
    if (!s->workspace || (size_t)s->workspace_bytes < lay.floats * sizeof(float)) return -1;
    float *w = s->workspace;
    float *x = w + lay.x, *qkv = w + lay.qkv, *qn = w + lay.qn, *kn = w + lay.kn, *qr = w + lay.qr, *ao = w + lay.ao,
          *lo = w + lay.lo, *tmp = w + lay.tmp, *gu = w + lay.gu, *act = w + lay.act;
    void *acts = w + lay.acts;
    const long qsize = (long)m->heads * d, kvsize = (long)m->kv_heads * d;
    for (int l = 0; l < m->num_layers; ++l) {
        const layer_t *L = m->layers + l;
        const int err = -(100 + 10 * l);
        stencil_rms_norm(s->h, t, 1, m->hidden, m->hidden, L->attn_in_norm, m->eps, x, th);
        if (linear(m, &L->qkv, x, t, qkv, acts, th)) return err - 1;
        const float *q = qkv, *k = qkv + qsize, *v = qkv + qsize + kvsize;
        long q_row = L->qkv.ldy, k_row = L->qkv.ldy;
        if (L->q_norm) {
            stencil_rms_norm(q, t, m->heads, d, q_row, L->q_norm, m->eps, qn, th);
            stencil_rms_norm(k, t, m->kv_heads, d, k_row, L->k_norm, m->eps, kn, th);
            q = qn, k = kn, q_row = qsize, k_row = kvsize;
        }
        if (stencil_rope_cache(q, q_row, m->heads, k, k_row, v, L->qkv.ldy, m->kv_heads, d, s->cos[L->rope],
                               s->sin[L->rope], t, s->slots[L->table], L->num_slots, L->k_cache, L->v_cache,
                               m->cache_kind, qr))
            return err - 2;
        if (m->attention(qr, m->heads, m->kv_heads, d, L->k_cache, L->v_cache, m->cache_kind, m->block_size,
                         s->block_tables[L->table], s->max_blocks, s->query_start_loc, s->seq_lens, s->num_seqs, L->scale,
                         L->window, ao, th))
            return err - 3;
        if (linear(m, &L->o, ao, t, lo, acts, th)) return err - 4;
        residual(m, s->h, lo, L->o.ldy, L->attn_out_norm, tmp, t, th);
        stencil_rms_norm(s->h, t, 1, m->hidden, m->hidden, L->mlp_in_norm, m->eps, x, th);
        if (linear(m, &L->gate_up, x, t, gu, acts, th)) return err - 5;
        stencil_glu(m->act, gu, L->gate_up.ldy, t, m->inter, act, th);
        if (linear(m, &L->down, act, t, lo, acts, th)) return err - 6;
        residual(m, s->h, lo, L->down.ldy, L->mlp_out_norm, tmp, t, th);
    }
    return 0;
}
