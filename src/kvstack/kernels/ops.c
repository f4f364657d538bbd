/* The small per-layer operations of a decode step, fused: each is one call instead of the
 * 5-10 PyTorch ops (and allocations) it replaces, which at one token per step cost more than
 * their arithmetic. fp32 and bf16 tensors (bf16: computed in fp32, rounded to nearest even
 * where the reference rounds). Row-major, contiguous unless a stride is given.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float rnd_f32(float f) { return f; }
static inline float rnd_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }
static inline float get_f32(const float *p, int64_t i) { return p[i]; }
static inline float get_bf16(const uint16_t *p, int64_t i) { return bf16_to_f32(p[i]); }
static inline void put_f32(float *p, int64_t i, float v) { p[i] = v; }
static inline void put_bf16(uint16_t *p, int64_t i, float v) { p[i] = f32_to_bf16(v); }

/* out = w * round(x * rsqrt(mean(x^2) + eps)), as the reference's RMSNorm; with `res`, first
 * x = round(x + res) in place (the residual add before the norm). */
#define DEFINE_NORM(SUF, T)                                                                   \
    void rms_norm_##SUF(T *x, const T *res, int64_t rows, int64_t d, const T *w, float eps, \
                        T *out) {                                                            \
        for (int64_t r = 0; r < rows; r++) {                                                 \
            T *xr = x + r * d;                                                               \
            if (res) {                                                                       \
                const T *rr = res + r * d;                                                   \
                for (int64_t i = 0; i < d; i++)                                              \
                    put_##SUF(xr, i, get_##SUF(xr, i) + get_##SUF(rr, i));                   \
            }                                                                                \
            float ss = 0.f;                                                                  \
            _Pragma("omp simd reduction(+:ss)")                                              \
            for (int64_t i = 0; i < d; i++) {                                                \
                float v = get_##SUF(xr, i);                                                  \
                ss += v * v;                                                                 \
            }                                                                                \
            const float inv = 1.0f / sqrtf(ss / (float)d + eps);                             \
            T *o = out + r * d;                                                              \
            for (int64_t i = 0; i < d; i++)                                                  \
                put_##SUF(o, i, get_##SUF(w, i) * rnd_##SUF(get_##SUF(xr, i) * inv));        \
        }                                                                                    \
    }

/* Rotary embedding ("rotate_half") in place on `heads` heads of each row (the q heads then
 * the k heads of a fused QKV row, `stride` elements apart); cos/sin: fp32 [rows, dim]. */
#define DEFINE_ROPE(SUF, T)                                                                   \
    void rope_##SUF(T *x, int64_t rows, int64_t stride, int64_t heads, int64_t dim,          \
                    const float *cos, const float *sin) {                                    \
        const int64_t half = dim / 2;                                                        \
        for (int64_t r = 0; r < rows; r++) {                                                 \
            const float *c = cos + r * dim, *s = sin + r * dim;                              \
            for (int64_t h = 0; h < heads; h++) {                                            \
                T *p = x + r * stride + h * dim;                                             \
                for (int64_t i = 0; i < half; i++) {                                         \
                    const float a = get_##SUF(p, i), b = get_##SUF(p, i + half);             \
                    put_##SUF(p, i, a * c[i] - b * s[i]);                                    \
                    put_##SUF(p, i + half, b * c[i + half] + a * s[i + half]);               \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
    }

/* out[r, i] = round(silu(gate[r, i])) * up[r, i], gate and up the two halves of each row. */
#define DEFINE_SILU_MUL(SUF, T)                                                               \
    void silu_mul_##SUF(const T *gate_up, int64_t rows, int64_t inter, T *out) {             \
        for (int64_t r = 0; r < rows; r++) {                                                 \
            const T *g = gate_up + r * 2 * inter, *u = g + inter;                            \
            T *o = out + r * inter;                                                          \
            for (int64_t i = 0; i < inter; i++) {                                            \
                const float x = get_##SUF(g, i);                                             \
                put_##SUF(o, i, rnd_##SUF(x / (1.0f + expf(-x))) * get_##SUF(u, i));         \
            }                                                                                \
        }                                                                                    \
    }

/* One query token per sequence against its cached keys/values, read in place through its
 * slots (no gathered copy). q, out: [seqs, heads, dim]; k, v: [slots, kv_heads, dim];
 * slots: [seqs, max_ctx] (the first lens[b] are real). Grouped-query: head h reads kv head
 * h / (heads / kv_heads). Scores and the softmax in fp32. */
#define DEFINE_DECODE_ATTN(SUF, T)                                                            \
    void decode_attention_##SUF(const T *q, const T *k, const T *v, const int64_t *slots,    \
                                const int64_t *lens, int64_t seqs, int64_t max_ctx,          \
                                int64_t heads, int64_t kv_heads, int64_t dim, float scale,    \
                                T *out, int threads) {                                       \
        const int64_t group = heads / kv_heads;                                              \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                    \
        for (int64_t bh = 0; bh < seqs * heads; bh++) {                                      \
            const int64_t b = bh / heads, h = bh % heads, kvh = h / group, n = lens[b];      \
            const int64_t *sl = slots + b * max_ctx;                                         \
            float qv[dim], acc[dim], scores[n];                                              \
            for (int64_t i = 0; i < dim; i++) qv[i] = get_##SUF(q, bh * dim + i) * scale;    \
            float mx = -INFINITY;                                                            \
            for (int64_t j = 0; j < n; j++) {                                                \
                const T *kr = k + (sl[j] * kv_heads + kvh) * dim;                            \
                float dot = 0.f;                                                             \
                _Pragma("omp simd reduction(+:dot)")                                         \
                for (int64_t i = 0; i < dim; i++) dot += qv[i] * get_##SUF(kr, i);           \
                scores[j] = dot;                                                             \
                mx = dot > mx ? dot : mx;                                                    \
            }                                                                                \
            float sum = 0.f;                                                                 \
            for (int64_t j = 0; j < n; j++) {                                                \
                scores[j] = expf(scores[j] - mx);                                            \
                sum += scores[j];                                                            \
            }                                                                                \
            for (int64_t i = 0; i < dim; i++) acc[i] = 0.f;                                  \
            for (int64_t j = 0; j < n; j++) {                                                \
                const T *vr = v + (sl[j] * kv_heads + kvh) * dim;                            \
                const float p = scores[j];                                                   \
                _Pragma("omp simd")                                                          \
                for (int64_t i = 0; i < dim; i++) acc[i] += p * get_##SUF(vr, i);            \
            }                                                                                \
            const float inv = 1.0f / sum;                                                    \
            for (int64_t i = 0; i < dim; i++) put_##SUF(out, bh * dim + i, acc[i] * inv);    \
        }                                                                                    \
    }

DEFINE_NORM(f32, float)
DEFINE_NORM(bf16, uint16_t)
DEFINE_ROPE(f32, float)
DEFINE_ROPE(bf16, uint16_t)
DEFINE_SILU_MUL(f32, float)
DEFINE_SILU_MUL(bf16, uint16_t)
DEFINE_DECODE_ATTN(f32, float)
DEFINE_DECODE_ATTN(bf16, uint16_t)

/* Copy each new token's K and V row (strided views into the fused QKV output) into its slot of
 * the layer's cache tensors [slots, width]. */
#define DEFINE_STORE_KV(SUF, T)                                                               \
    void store_kv_##SUF(const T *k, const T *v, int64_t rows, int64_t stride,                \
                        const int64_t *slots, T *k_cache, T *v_cache, int64_t width) {       \
        for (int64_t r = 0; r < rows; r++) {                                                 \
            memcpy(k_cache + slots[r] * width, k + r * stride, width * sizeof(T));           \
            memcpy(v_cache + slots[r] * width, v + r * stride, width * sizeof(T));           \
        }                                                                                    \
    }

DEFINE_STORE_KV(f32, float)
DEFINE_STORE_KV(bf16, uint16_t)
