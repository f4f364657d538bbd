/* A whole Gemma 3 decode step in one C call (float32 models over a plain float32 cache, or an
 * int8 / fp8 one: codes and float16 scales, kv/storage/quantized.py's scheme).
 *
 * The per-layer plan of models/gemma3.py's forward, driven from C so that a step costs one
 * call instead of ~25 PyTorch ops per layer: Gemma's RMSNorm (scaled by 1 + w in float32)
 * before and after attention and the MLP, Q/K RMSNorm per head, RoPE from the layer's own
 * table (sliding layers: local theta; full layers: global), K/V stored at each layer's own
 * group's slots, decode attention over each layer's own slots (a sliding layer's last
 * `window` positions, narrowed by the caller), GELU (tanh) times up. The matrix products are
 * the per-op path's kernels (gemv.c, gguf.c, gguf_x8.c); a fused QKV may be several parts of
 * different types (the 270M's Q5_0 q/k and Q8_0 v). Norms, RoPE and GELU are float32 loops
 * here; models/gemma3.py's decode-sized steps call the same loops one by one (`gemma_norm_f32`
 * and the rest below), so a row gets the same bits through either, as with Llama's step. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "products.h"

void rope_f32(float *x, int64_t rows, int64_t stride, int64_t heads, int64_t dim,
              const float *cos, const float *sin);
void store_kv_f32(const float *k, const float *v, int64_t rows, int64_t stride,
                  const int64_t *slots, float *k_cache, float *v_cache, int64_t width);
int decode_attention_f32(const float *q, const float *k, const float *v, const int64_t *slots,
                         const int64_t *lens, int64_t seqs, int64_t max_ctx, int64_t heads,
                         int64_t kv_heads, int64_t dim, float scale, float *out, int threads);
void store_kv_quant_f32(const float *k, const float *v, int64_t rows, int64_t k_stride,
                        int64_t v_stride, const int64_t *slots, void *kv, uint16_t *kv_scale,
                        int fp8, int rotate, int64_t kv_heads, int64_t dim);
int decode_attention_quant_f32(const float *q, const void *kv, const uint16_t *kv_scale, int fp8,
                               int rotate, const int64_t *slots, const int64_t *lens,
                               int64_t seqs, int64_t max_ctx, int64_t heads, int64_t kv_heads,
                               int64_t dim, float scale, float *out, int threads);

/* As ops.c's Lin (kernels/decode_step.py's LinEntry): kind 0-4 dense gemv, GGUF_KIND / GGUF_X8_KIND
 * + the ggml type for GGUF blocks. */
#define GGUF_KIND 100
#define GGUF_X8_KIND 200
#define MAX_PARTS 3

typedef struct {
    const void *w;
    const float *scale, *bias;
    int64_t n, k, kind;
} GLin;

typedef struct {
    GLin qkv[MAX_PARTS]; /* the fused QKV's parts, their outputs side by side */
    int64_t num_qkv;
    GLin o, gate_up, down;
    const float *input_norm, *post_attn_norm, *pre_ffw_norm, *post_ffw_norm; /* 1 + w */
    const float *q_norm, *k_norm;
    float *k_cache, *v_cache; /* [slots, kv_heads, head_dim]; quantized (GDims.kv_kind):
                                 k_cache is the codes [slots, 2, kv_heads, head_dim], v_cache
                                 unused */
    uint16_t *kv_scale;       /* quantized: float16 [slots, 2, kv_heads]; else NULL */
    int64_t rope;             /* 0: the sliding layers' table, 1: the full layers' */
} GLayer;

/* Per step and layer: where its new K/V go and which slots its query reads (its group's
 * block table; a sliding layer's narrowed to its window). */
typedef struct {
    const int64_t *slot_mapping, *slots, *lens;
    int64_t max_ctx;
} GView;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, inter, num_layers;
    float eps, scale;
    int64_t kv_kind; /* 0: plain float32, 1: int8 codes, 2: e4m3 codes (ops.c's Dims) */
    int64_t rotate;  /* quantized K/V stored in the Hadamard basis */
} GDims;

static int linear(const GLin *l, const float *x, int64_t rows, float *y, int threads) {
    if (l->kind >= GGUF_X8_KIND)
        return !gguf_gemv_x8((int)(l->kind - GGUF_X8_KIND), x, rows, l->k, l->w, l->n, l->bias,
                             y, threads);
    if (l->kind >= GGUF_KIND)
        return !gguf_gemv((int)(l->kind - GGUF_KIND), x, rows, l->k, l->w, l->n, l->bias, y,
                          threads);
    switch (l->kind) {
    case 0: gemv_f32(x, rows, l->k, l->w, l->n, l->scale, l->bias, y, threads); break;
    case 1: gemv_bf16(x, rows, l->k, l->w, l->n, l->scale, l->bias, y, threads); break;
    case 2: gemv_i8(x, rows, l->k, l->w, l->n, l->scale, l->bias, y, threads); break;
    case 3: gemv_q8(x, rows, l->k, l->w, l->n, l->scale, l->bias, y, threads); break;
    default: gemv_bf16dp(x, rows, l->k, l->w, l->n, l->scale, l->bias, y, threads); break;
    }
    return 1;
}

/* out = x * rsqrt(mean(x^2) + eps) * w over each of `count` vectors of `d` (in place allowed):
 * models/gemma3.py's gemma_rms_norm in float32. */
void gemma_norm_f32(const float *x, int64_t count, int64_t d, const float *w, float eps,
                    float *out) {
    for (int64_t r = 0; r < count; r++) {
        const float *xr = x + r * d;
        float ss = 0.f;
        _Pragma("omp simd reduction(+:ss)")
        for (int64_t i = 0; i < d; i++) ss += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(ss / (float)d + eps);
        float *o = out + r * d;
        for (int64_t i = 0; i < d; i++) o[i] = xr[i] * inv * w[i];
    }
}

/* h += norm(y) (the branch's post-norm, then the residual add); y is normed in place. */
void gemma_add_norm_f32(float *h, float *y, int64_t rows, int64_t d, const float *w, float eps) {
    gemma_norm_f32(y, rows, d, w, eps, y);
    for (int64_t i = 0; i < rows * d; i++) h[i] += y[i];
}

/* PyTorch's gelu(approximate="tanh") of the gate times up. */
void gemma_gelu_mul_f32(const float *gate_up, int64_t rows, int64_t inter, float *out) {
    const float c = 0.7978845608028654f; /* sqrt(2 / pi) */
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        for (int64_t i = 0; i < inter; i++) {
            const float x = g[i];
            o[i] = 0.5f * x * (1.0f + tanhf(c * (x + 0.044715f * x * x * x))) * u[i];
        }
    }
}

/* In place on fused QKV rows (`stride` apart): each q and k head's RMSNorm, then RoPE from
 * cos/sin [rows, dim]; v untouched. */
void gemma_qk_norm_rope_f32(float *qkv, int64_t rows, int64_t stride, int64_t heads,
                            int64_t kv_heads, int64_t dim, const float *q_norm,
                            const float *k_norm, float eps, const float *cos, const float *sin) {
    for (int64_t r = 0; r < rows; r++) {
        float *row = qkv + r * stride;
        gemma_norm_f32(row, heads, dim, q_norm, eps, row);
        gemma_norm_f32(row + heads * dim, kv_heads, dim, k_norm, eps, row + heads * dim);
    }
    rope_f32(qkv, rows, stride, heads + kv_heads, dim, cos, sin);
}

/* One layer's Q/K/V for `rows` rows of x into qkv [rows, qkv_n]: each part's product, then
 * its columns copied into place. */
static int qkv_parts(const GLayer *L, const float *x, int64_t rows, int64_t qkv_n, float *part,
                     float *qkv, int threads) {
    int64_t col = 0;
    for (int64_t p = 0; p < L->num_qkv; p++) {
        const GLin *l = L->qkv + p;
        if (!linear(l, x, rows, L->num_qkv == 1 ? qkv : part, threads)) return 0;
        if (L->num_qkv > 1)
            for (int64_t r = 0; r < rows; r++)
                memcpy(qkv + r * qkv_n + col, part + r * l->n, sizeof(float) * l->n);
        col += l->n;
    }
    return 1;
}

/* Store the rows' new K/V (in qkv, after q) at the layer's slots, then attend over its view:
 * the same kernels, in the same order, as the per-op path's storage write and decode
 * attention (layers/attention.py), so the cache and the output get the same bits. */
static int attend(const GDims *d, const GLayer *L, const GView *V, const float *qkv,
                  const float *q, int64_t rows, float *attn, int threads) {
    const int64_t dim = d->head_dim, qd = d->heads * dim, kvd = d->kv_heads * dim;
    const int64_t qkv_n = qd + 2 * kvd;
    if (d->kv_kind) {
        const int fp8 = d->kv_kind == 2, rotate = (int)d->rotate;
        store_kv_quant_f32(qkv + qd, qkv + qd + kvd, rows, qkv_n, qkv_n, V->slot_mapping,
                           L->k_cache, L->kv_scale, fp8, rotate, d->kv_heads, dim);
        return !decode_attention_quant_f32(q, L->k_cache, L->kv_scale, fp8, rotate, V->slots,
                                           V->lens, rows, V->max_ctx, d->heads, d->kv_heads,
                                           dim, d->scale, attn, threads);
    }
    store_kv_f32(qkv + qd, qkv + qd + kvd, rows, qkv_n, V->slot_mapping, L->k_cache,
                 L->v_cache, kvd);
    return !decode_attention_f32(q, L->k_cache, L->v_cache, V->slots, V->lens, rows,
                                 V->max_ctx, d->heads, d->kv_heads, dim, d->scale, attn,
                                 threads);
}

/* h [rows, hidden]: the embeddings, turned in place into the residual stream after every
 * layer (the caller applies the final norm). cos/sin: [2][rows, head_dim] (sliding, full). */
int gemma_decode_step(const GDims *d, const GLayer *layers, const GView *views, float *h,
                      int64_t rows, const float *cos, const float *sin, int threads) {
    const int64_t dim = d->head_dim, qd = d->heads * dim, kvd = d->kv_heads * dim;
    const int64_t qkv_n = qd + 2 * kvd, table = rows * dim;
    float *x = malloc(sizeof(float) * rows * (d->inter > d->hidden ? d->inter : d->hidden));
    float *qkv = malloc(sizeof(float) * rows * qkv_n), *part = malloc(sizeof(float) * rows * qkv_n);
    float *q = malloc(sizeof(float) * rows * qd), *attn = malloc(sizeof(float) * rows * qd);
    float *gu = malloc(sizeof(float) * rows * 2 * d->inter);
    float *y = malloc(sizeof(float) * rows * d->hidden);
    int ok = x && qkv && part && q && attn && gu && y;
    for (int64_t i = 0; ok && i < d->num_layers; i++) {
        const GLayer *L = layers + i;
        const GView *V = views + i;
        gemma_norm_f32(h, rows, d->hidden, L->input_norm, d->eps, x);
        if (!(ok = qkv_parts(L, x, rows, qkv_n, part, qkv, threads))) break;
        gemma_qk_norm_rope_f32(qkv, rows, qkv_n, d->heads, d->kv_heads, dim, L->q_norm,
                               L->k_norm, d->eps, cos + L->rope * table, sin + L->rope * table);
        for (int64_t r = 0; r < rows; r++) memcpy(q + r * qd, qkv + r * qkv_n, sizeof(float) * qd);
        if (!(ok = attend(d, L, V, qkv, q, rows, attn, threads))) break;
        if (!(ok = linear(&L->o, attn, rows, y, threads))) break;
        gemma_add_norm_f32(h, y, rows, d->hidden, L->post_attn_norm, d->eps);
        gemma_norm_f32(h, rows, d->hidden, L->pre_ffw_norm, d->eps, x);
        if (!(ok = linear(&L->gate_up, x, rows, gu, threads))) break;
        gemma_gelu_mul_f32(gu, rows, d->inter, x);
        if (!(ok = linear(&L->down, x, rows, y, threads))) break;
        gemma_add_norm_f32(h, y, rows, d->hidden, L->post_ffw_norm, d->eps);
    }
    free(x); free(qkv); free(part); free(q); free(attn); free(gu); free(y);
    return ok;
}
