/* The small per-layer operations of a decode step, fused: each is one call instead of the
 * 5-10 PyTorch ops (and allocations) it replaces, which at one token per step cost more than
 * their arithmetic. fp32 and bf16 tensors (bf16: computed in fp32, rounded to nearest even
 * where the reference rounds). Row-major, contiguous unless a stride is given.
 */
#include "avx2.h"
#include "half.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
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

/* Quantized K/V elements (kv/storage/quantized.py): int8 codes, and float8 e4m3 codes read as
 * value / 256 (moved up 7 bits, bit 14 cleared, an e4m3 code is the fp16 of value / 2^8,
 * subnormals included; the caller multiplies the row's scale by 256 instead). */
static inline float get_i8(const int8_t *p, int64_t i) { return (float)p[i]; }
static inline float get_f8(const uint8_t *p, int64_t i) {
    return f16_to_f32((uint16_t)(((int16_t)(int8_t)p[i] * 128) & 0xBF80));
}
#if defined(__AVX2__)
static inline __m256 load8_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline __m256 load8_f8(const uint8_t *p) {
#if defined(__F16C__)
    const __m128i w = _mm_slli_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p)), 7);
    return _mm256_cvtph_ps(_mm_and_si128(w, _mm_set1_epi16((short)0xBF80)));
#else
    return _mm256_setr_ps(get_f8(p, 0), get_f8(p, 1), get_f8(p, 2), get_f8(p, 3), get_f8(p, 4),
                          get_f8(p, 5), get_f8(p, 6), get_f8(p, 7));
#endif
}
#endif

/* float -> e4m3 code, rounded to nearest even; |x| <= 448 (the caller clamps). */
static inline uint8_t f32_to_e4m3(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80);
    const float a = fabsf(x);
    if (a < 0.015625f) /* below 2^-6: subnormal, steps of 2^-9 (8 is the smallest normal) */
        return sign | (uint8_t)nearbyintf(a * 512.0f);
    memcpy(&u, &a, 4);
    u += 0x7ffffu + ((u >> 20) & 1u); /* drop 20 mantissa bits, ties to even */
    return sign | (uint8_t)((u - (120u << 23)) >> 20); /* exponent bias 127 -> 7 */
}

/* x[0..n) = x B with B the normalized Walsh-Hadamard matrix (n a power of two; symmetric and
 * orthonormal, so it is its own inverse): the basis quantized K/V are stored in. */
static void hadamard(float *x, int64_t n) {
    for (int64_t len = 1; len < n; len <<= 1)
        for (int64_t i = 0; i < n; i += 2 * len)
            for (int64_t j = i; j < i + len; j++) {
                const float a = x[j], b = x[j + len];
                x[j] = a + b;
                x[j + len] = a - b;
            }
    const float norm = 1.0f / sqrtf((float)n);
    for (int64_t i = 0; i < n; i++) x[i] *= norm;
}

/* ---- attention's inner loops: AVX2 + FMA where the target has it, else plain C ---------- */
#if defined(__AVX2__) && defined(__FMA__)
/* exp of 8 floats: Cephes' expf (range reduction by ln 2 in two parts, degree-5 polynomial;
 * within 2 ulp of expf), inputs clamped to +-88.38 so very negative scores give 0. glibc's
 * scalar expf was over half of attention's time. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)),
                      _mm256_set1_ps(-88.3762626647949f));
    const __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f),
                                                      _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
    const __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx),
                                                         _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}
#endif

/* s[0..n) = exp(s - mx) in place; returns their sum. */
static inline float exp_sum(float *s, int64_t n, float mx) {
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 m = _mm256_set1_ps(mx);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j += 8) {
        const int64_t left = n - j < 8 ? n - j : 8;
        const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)left),
                                                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        const __m256 e = exp8(_mm256_sub_ps(_mm256_maskload_ps(s + j, mask), m));
        _mm256_maskstore_ps(s + j, mask, e);
        acc = _mm256_add_ps(acc, _mm256_and_ps(e, _mm256_castsi256_ps(mask)));
    }
    return hsum8(acc);
#else
    float sum = 0.f;
    for (int64_t j = 0; j < n; j++) {
        s[j] = expf(s[j] - mx);
        sum += s[j];
    }
    return sum;
#endif
}

/* sum_i q[i] * k[i] and acc[i] += p * v[i] over a head's dim elements, k and v of type T. */
#if defined(__AVX2__) && defined(__FMA__)
#define DEFINE_HEAD_LOOPS(SUF, T)                                                             \
    static inline float head_dot_##SUF(const float *q, const T *k, int64_t dim) {            \
        if (dim % 8) {                                                                       \
            float dot = 0.f;                                                                 \
            for (int64_t i = 0; i < dim; i++) dot += q[i] * get_##SUF(k, i);                 \
            return dot;                                                                      \
        }                                                                                    \
        __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();                             \
        int64_t i = 0;                                                                       \
        for (; i + 16 <= dim; i += 16) {                                                     \
            a = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8_##SUF(k + i), a);              \
            b = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), load8_##SUF(k + i + 8), b);      \
        }                                                                                    \
        if (i < dim) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8_##SUF(k + i), a);     \
        return hsum8(_mm256_add_ps(a, b));                                                   \
    }                                                                                        \
    static inline void head_axpy_##SUF(float *acc, float p, const T *v, int64_t dim) {       \
        if (dim % 8) {                                                                       \
            for (int64_t i = 0; i < dim; i++) acc[i] += p * get_##SUF(v, i);                 \
            return;                                                                          \
        }                                                                                    \
        const __m256 pp = _mm256_set1_ps(p);                                                 \
        for (int64_t i = 0; i < dim; i += 8)                                                 \
            _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(pp, load8_##SUF(v + i),                \
                                                      _mm256_loadu_ps(acc + i)));            \
    }
#else
#define DEFINE_HEAD_LOOPS(SUF, T)                                                             \
    static inline float head_dot_##SUF(const float *q, const T *k, int64_t dim) {            \
        float dot = 0.f;                                                                     \
        for (int64_t i = 0; i < dim; i++) dot += q[i] * get_##SUF(k, i);                     \
        return dot;                                                                          \
    }                                                                                        \
    static inline void head_axpy_##SUF(float *acc, float p, const T *v, int64_t dim) {       \
        for (int64_t i = 0; i < dim; i++) acc[i] += p * get_##SUF(v, i);                     \
    }
#endif
DEFINE_HEAD_LOOPS(f32, float)
DEFINE_HEAD_LOOPS(bf16, uint16_t)
DEFINE_HEAD_LOOPS(i8, int8_t)
DEFINE_HEAD_LOOPS(f8, uint8_t)

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
 * h / (heads / kv_heads). Scores and the softmax in fp32.
 *
 * Work is split into units of (sequence, kv head, ATTN_CHUNK positions): a unit reads each
 * of its K and V rows once for all the query heads sharing that kv head (instead of once per
 * head), and a single sequence still gives both threads work. Each unit leaves, per head, its
 * running max, softmax denominator and unnormalised output; a second pass merges a head's
 * chunks in order (flash-decoding's split). The split depends only on the positions, never
 * on the thread count or the other sequences of the step, so neither changes a result; up to
 * ATTN_CHUNK positions it is the plain softmax. Returns 0, or -1 without memory. */
#define ATTN_CHUNK 128
/* The cache rows a step reads come from memory (the weights streamed since the last step
 * evicted them), at scattered blocks: K rows are prefetched a block of 8 positions ahead, and
 * each V row as its K row is read, so it is in cache when the second pass needs it. */
#define ATTN_BLOCK 8

static inline void prefetch_row(const void *p, int64_t bytes) {
    for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch((const char *)p + at);
}

#if defined(__AVX2__) && defined(__FMA__)
/* Lane p = the sum of a[p]'s eight lanes. */
static inline __m256 hsum8x8(const __m256 a[8]) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

/* A unit's two passes over its n <= ATTN_CHUNK rows, for cache elements of type KT:
 *   scores: sc[h * ATTN_CHUNK + j] = (q_h . k_j) * ks[j] for the group's query heads;
 *   values: acc[0..dim) += sum_j p[j] * v_j.
 * With AVX2 and dim a multiple of 8, the scores take 8 rows at a time against one query
 * (8 accumulators, one horizontal reduction for all 8), and the values keep 64 columns of the
 * accumulator in registers across all rows instead of loading and storing them per row (those
 * loads and stores, not the arithmetic, bounded the old loop). A value element's sum runs in
 * row order either way; a score's order of additions differs between the two paths. */
#if defined(__AVX2__) && defined(__FMA__)
#define DEFINE_UNIT_LOOPS(KSUF, KT)                                                           \
    static void scores_##KSUF(const float *qv, int64_t group, const KT *const *kr,           \
                              const KT *const *vr, const float *ks, int64_t n, int64_t dim,  \
                              float *sc) {                                                   \
        const int64_t bytes = dim * (int64_t)sizeof(KT);                                     \
        if (dim % 8) {                                                                       \
            for (int64_t j = 0; j < n; j++)                                                  \
                for (int64_t h = 0; h < group; h++)                                          \
                    sc[h * ATTN_CHUNK + j] = head_dot_##KSUF(qv + h * dim, kr[j], dim) * ks[j]; \
            return;                                                                          \
        }                                                                                    \
        for (int64_t j = 0; j < n && j < ATTN_BLOCK; j++) prefetch_row(kr[j], bytes);        \
        int64_t j0 = 0;                                                                      \
        for (; j0 + ATTN_BLOCK <= n; j0 += ATTN_BLOCK) {                                     \
            for (int64_t j = j0 + ATTN_BLOCK; j < n && j < j0 + 2 * ATTN_BLOCK; j++)         \
                prefetch_row(kr[j], bytes);                                                  \
            for (int64_t j = j0; j < j0 + ATTN_BLOCK; j++) prefetch_row(vr[j], bytes);       \
            const __m256 scale = _mm256_loadu_ps(ks + j0);                                   \
            for (int64_t h = 0; h < group; h++) {                                            \
                const float *q = qv + h * dim;                                               \
                __m256 a[8];                                                                 \
                for (int p = 0; p < 8; p++) a[p] = _mm256_setzero_ps();                      \
                for (int64_t i = 0; i < dim; i += 8) {                                       \
                    const __m256 qi = _mm256_loadu_ps(q + i);                                \
                    for (int p = 0; p < 8; p++)                                              \
                        a[p] = _mm256_fmadd_ps(qi, load8_##KSUF(kr[j0 + p] + i), a[p]);      \
                }                                                                            \
                _mm256_storeu_ps(sc + h * ATTN_CHUNK + j0, _mm256_mul_ps(hsum8x8(a), scale)); \
            }                                                                                \
        }                                                                                    \
        for (int64_t j = j0; j < n; j++) {                                                   \
            prefetch_row(vr[j], bytes);                                                      \
            for (int64_t h = 0; h < group; h++)                                              \
                sc[h * ATTN_CHUNK + j] = head_dot_##KSUF(qv + h * dim, kr[j], dim) * ks[j];  \
        }                                                                                    \
    }                                                                                        \
    static void values_##KSUF(float *acc, const float *p, const KT *const *vr, int64_t n,    \
                              int64_t dim) {                                                 \
        int64_t c = 0;                                                                       \
        for (; dim % 8 == 0 && c + 64 <= dim; c += 64) {                                     \
            __m256 a[8];                                                                     \
            for (int v = 0; v < 8; v++) a[v] = _mm256_loadu_ps(acc + c + 8 * v);            \
            for (int64_t j = 0; j < n; j++) {                                                \
                const __m256 pj = _mm256_set1_ps(p[j]);                                      \
                for (int v = 0; v < 8; v++)                                                  \
                    a[v] = _mm256_fmadd_ps(pj, load8_##KSUF(vr[j] + c + 8 * v), a[v]);       \
            }                                                                                \
            for (int v = 0; v < 8; v++) _mm256_storeu_ps(acc + c + 8 * v, a[v]);             \
        }                                                                                    \
        for (; dim % 8 == 0 && c < dim; c += 8) {                                            \
            __m256 a = _mm256_loadu_ps(acc + c);                                             \
            for (int64_t j = 0; j < n; j++)                                                  \
                a = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), load8_##KSUF(vr[j] + c), a);       \
            _mm256_storeu_ps(acc + c, a);                                                    \
        }                                                                                    \
        if (dim % 8)                                                                         \
            for (int64_t j = 0; j < n; j++) head_axpy_##KSUF(acc, p[j], vr[j], dim);         \
    }
#else
#define DEFINE_UNIT_LOOPS(KSUF, KT)                                                           \
    static void scores_##KSUF(const float *qv, int64_t group, const KT *const *kr,           \
                              const KT *const *vr, const float *ks, int64_t n, int64_t dim,  \
                              float *sc) {                                                   \
        (void)vr;                                                                            \
        for (int64_t j = 0; j < n; j++)                                                      \
            for (int64_t h = 0; h < group; h++)                                              \
                sc[h * ATTN_CHUNK + j] = head_dot_##KSUF(qv + h * dim, kr[j], dim) * ks[j];  \
    }                                                                                        \
    static void values_##KSUF(float *acc, const float *p, const KT *const *vr, int64_t n,    \
                              int64_t dim) {                                                 \
        for (int64_t j = 0; j < n; j++) head_axpy_##KSUF(acc, p[j], vr[j], dim);             \
    }
#endif
DEFINE_UNIT_LOOPS(f32, float)
DEFINE_UNIT_LOOPS(bf16, uint16_t)
DEFINE_UNIT_LOOPS(i8, int8_t)
DEFINE_UNIT_LOOPS(f8, uint8_t)

/* The loop over (sequence, kv head, chunk) units and the merge, for q/out of type T and cache
 * elements of type KT: row r of the cache (r = slot * slot_rows + kv head) is k + r * dim and
 * v + r * dim. Quantized caches give each row a float16 scale (ks[r], vs[r], times `unit`);
 * plain ones pass NULL (scale 1: the products are unchanged). With `rotate`, K/V are stored in
 * the Hadamard basis: the kernel turns each query into it and each output back. */
#define DEFINE_ATTEND(SUF, T, KSUF, KT)                                                       \
    static int attend_##SUF##_##KSUF(const T *q, const KT *k, const KT *v, const uint16_t *ks, \
                                     const uint16_t *vs, float unit, int rotate,             \
                                     int64_t slot_rows, const int64_t *slots,                \
                                     const int64_t *lens, int64_t seqs, int64_t max_ctx,      \
                                     int64_t heads, int64_t kv_heads, int64_t dim,            \
                                     float scale, T *out, int threads) {                     \
        const int64_t group = heads / kv_heads, width = dim + 2;                             \
        const int64_t chunks = (max_ctx + ATTN_CHUNK - 1) / ATTN_CHUNK;                      \
        const int64_t units = seqs * kv_heads * chunks;                                      \
        /* per unit and head: acc[dim], then the max and the denominator */                  \
        float *part = malloc(sizeof(float) * (size_t)(units * group * width + 1));           \
        if (!part) return -1;                                                                \
        _Pragma("omp parallel num_threads(threads)")                                         \
        {                                                                                    \
            _Pragma("omp for schedule(static)")                                              \
            for (int64_t u = 0; u < units; u++) {                                            \
                const int64_t b = u / (kv_heads * chunks), g = (u / chunks) % kv_heads;      \
                const int64_t lo = (u % chunks) * ATTN_CHUNK;                                \
                const int64_t hi = lens[b] < lo + ATTN_CHUNK ? lens[b] : lo + ATTN_CHUNK;    \
                float *pu = part + u * group * width;                                        \
                if (lo >= hi) continue; /* past the sequence: the merge never reads it */     \
                const int64_t *sl = slots + b * max_ctx, n = hi - lo;                        \
                float qv[group * dim], sc[group * ATTN_CHUNK], ksc[ATTN_CHUNK], vsc[ATTN_CHUNK];  \
                float p[ATTN_CHUNK];                                                         \
                const KT *kr[ATTN_CHUNK], *vr[ATTN_CHUNK];                                   \
                const T *qb = q + (b * heads + g * group) * dim;                             \
                for (int64_t i = 0; i < group * dim; i++) qv[i] = get_##SUF(qb, i);          \
                if (rotate)                                                                  \
                    for (int64_t h = 0; h < group; h++) hadamard(qv + h * dim, dim);         \
                for (int64_t i = 0; i < group * dim; i++) qv[i] *= scale;                    \
                for (int64_t j = 0; j < n; j++) {                                            \
                    const int64_t r = sl[lo + j] * slot_rows + g;                            \
                    kr[j] = k + r * dim;                                                     \
                    vr[j] = v + r * dim;                                                     \
                    ksc[j] = ks ? f16_to_f32(ks[r]) * unit : 1.0f;                           \
                    vsc[j] = vs ? f16_to_f32(vs[r]) * unit : 1.0f;                           \
                }                                                                            \
                scores_##KSUF(qv, group, kr, vr, ksc, n, dim, sc);                           \
                for (int64_t h = 0; h < group; h++) {                                        \
                    float *sh = sc + h * ATTN_CHUNK, *acc = pu + h * width;                  \
                    float mx = -INFINITY;                                                    \
                    for (int64_t j = 0; j < n; j++) mx = sh[j] > mx ? sh[j] : mx;            \
                    const float sum = exp_sum(sh, n, mx);                                    \
                    for (int64_t i = 0; i < dim; i++) acc[i] = 0.f;                          \
                    acc[dim] = mx;                                                           \
                    acc[dim + 1] = sum;                                                      \
                    for (int64_t j = 0; j < n; j++) p[j] = sh[j] * vsc[j];                   \
                    values_##KSUF(acc, p, vr, n, dim);                                       \
                }                                                                            \
            }                                                                                \
            /* merge a head's chunks: weights exp(max_c - max), in chunk order */             \
            _Pragma("omp for schedule(static)")                                              \
            for (int64_t bh = 0; bh < seqs * heads; bh++) {                                  \
                const int64_t b = bh / heads, g = (bh % heads) / group, hh = bh % group;     \
                const int64_t used = (lens[b] + ATTN_CHUNK - 1) / ATTN_CHUNK;                \
                const float *p0 = part + ((b * kv_heads + g) * chunks * group + hh) * width; \
                const int64_t step = group * width; /* the next chunk of this head */        \
                T *o = out + bh * dim;                                                       \
                float mx = -INFINITY, sum = 0.f, acc[dim];                                   \
                for (int64_t c = 0; c < used; c++)                                           \
                    mx = p0[c * step + dim] > mx ? p0[c * step + dim] : mx;                  \
                for (int64_t i = 0; i < dim; i++) acc[i] = 0.f;                              \
                for (int64_t c = 0; c < used; c++) {                                         \
                    const float *pc = p0 + c * step, w = expf(pc[dim] - mx);                 \
                    sum += w * pc[dim + 1];                                                  \
                    for (int64_t i = 0; i < dim; i++) acc[i] += w * pc[i];                   \
                }                                                                            \
                const float inv = 1.0f / sum;                                                \
                for (int64_t i = 0; i < dim; i++) acc[i] *= inv;                             \
                if (rotate) hadamard(acc, dim);                                              \
                for (int64_t i = 0; i < dim; i++) put_##SUF(o, i, acc[i]);                   \
            }                                                                                \
        }                                                                                    \
        free(part);                                                                          \
        return 0;                                                                            \
    }

/* Over a plain cache: k, v [slots, kv_heads, dim] of q's dtype. */
#define DEFINE_DECODE_ATTN(SUF, T)                                                            \
    DEFINE_ATTEND(SUF, T, SUF, T)                                                            \
    DEFINE_ATTEND(SUF, T, i8, int8_t)                                                        \
    DEFINE_ATTEND(SUF, T, f8, uint8_t)                                                       \
    int decode_attention_##SUF(const T *q, const T *k, const T *v, const int64_t *slots,     \
                               const int64_t *lens, int64_t seqs, int64_t max_ctx,           \
                               int64_t heads, int64_t kv_heads, int64_t dim, float scale,     \
                               T *out, int threads) {                                        \
        return attend_##SUF##_##SUF(q, k, v, NULL, NULL, 1.0f, 0, kv_heads, slots, lens,     \
                                    seqs, max_ctx, heads, kv_heads, dim, scale, out,         \
                                    threads);                                                \
    }                                                                                        \
    /* Over a quantized cache (kv/storage/quantized.py): kv [slots, 2 (k, v), kv_heads, dim] \
     * int8 (fp8 = 0) or e4m3 (fp8 = 1) codes, kv_scale [slots, 2, kv_heads] float16. */      \
    int decode_attention_quant_##SUF(const T *q, const void *kv, const uint16_t *kv_scale,   \
                                     int fp8, int rotate, const int64_t *slots,              \
                                     const int64_t *lens, int64_t seqs, int64_t max_ctx,      \
                                     int64_t heads, int64_t kv_heads, int64_t dim,            \
                                     float scale, T *out, int threads) {                     \
        if (fp8)                                                                             \
            return attend_##SUF##_f8(q, (const uint8_t *)kv, (const uint8_t *)kv + kv_heads * dim, \
                                     kv_scale, kv_scale + kv_heads, 256.0f, rotate,          \
                                     2 * kv_heads, slots, lens, seqs, max_ctx, heads,        \
                                     kv_heads, dim, scale, out, threads);                    \
        return attend_##SUF##_i8(q, (const int8_t *)kv, (const int8_t *)kv + kv_heads * dim,  \
                                 kv_scale, kv_scale + kv_heads, 1.0f, rotate, 2 * kv_heads,  \
                                 slots, lens, seqs, max_ctx, heads, kv_heads, dim, scale,    \
                                 out, threads);                                              \
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

/* The same into a quantized cache (kv [slots, 2, kv_heads, dim] int8 or e4m3 codes, kv_scale
 * [slots, 2, kv_heads] float16; kv/storage/quantized.py has the scheme): each (token, k or v,
 * head) row is turned into the Hadamard basis (with `rotate`), scaled by max |x| / QMAX
 * (float16, at least 2^-14) and rounded to nearest even; k and v rows are `k_stride` and
 * `v_stride` elements apart. */
#define KV_MIN_SCALE 6.103515625e-05f /* 2^-14, kv/storage/quantized.py's MIN_SCALE */
#define DEFINE_STORE_KV_QUANT(SUF, T)                                                         \
    void store_kv_quant_##SUF(const T *k, const T *v, int64_t rows, int64_t k_stride,        \
                              int64_t v_stride, const int64_t *slots, void *kv,              \
                              uint16_t *kv_scale, int fp8, int rotate, int64_t kv_heads,      \
                              int64_t dim) {                                                 \
        const float qmax = fp8 ? 448.0f : 127.0f;                                            \
        float y[dim];                                                                        \
        for (int64_t r = 0; r < rows; r++)                                                   \
            for (int64_t t = 0; t < 2; t++)                                                  \
                for (int64_t h = 0; h < kv_heads; h++) {                                     \
                    const T *x = (t ? v + r * v_stride : k + r * k_stride) + h * dim;        \
                    for (int64_t i = 0; i < dim; i++) y[i] = get_##SUF(x, i);                \
                    if (rotate) hadamard(y, dim);                                            \
                    float amax = 0.f;                                                        \
                    for (int64_t i = 0; i < dim; i++) amax = fmaxf(amax, fabsf(y[i]));       \
                    float s = amax * (1.0f / qmax);                                          \
                    s = s < KV_MIN_SCALE ? KV_MIN_SCALE : s;                                 \
                    const int64_t row = (slots[r] * 2 + t) * kv_heads + h;                   \
                    kv_scale[row] = f32_to_f16(s);                                           \
                    const float sf = f16_to_f32(kv_scale[row]);                              \
                    if (fp8) {                                                               \
                        uint8_t *dst = (uint8_t *)kv + row * dim;                            \
                        for (int64_t i = 0; i < dim; i++) {                                  \
                            const float z = y[i] / sf;                                       \
                            dst[i] = f32_to_e4m3(z > 448.f ? 448.f : z < -448.f ? -448.f : z); \
                        }                                                                    \
                    } else {                                                                 \
                        /* |y / sf| <= 127 (1 + 2^-11) < 127.5: no clamp needed */             \
                        int8_t *dst = (int8_t *)kv + row * dim;                              \
                        for (int64_t i = 0; i < dim; i++) dst[i] = (int8_t)nearbyintf(y[i] / sf); \
                    }                                                                        \
                }                                                                            \
    }

DEFINE_STORE_KV(f32, float)
DEFINE_STORE_KV(bf16, uint16_t)
DEFINE_STORE_KV_QUANT(f32, float)
DEFINE_STORE_KV_QUANT(bf16, uint16_t)

/* ---- a whole decode step in one call ------------------------------------------------------
 * For steps whose every row is one sequence's next token over a paged cache (the model's dtype,
 * or int8 / fp8 codes with their scales):
 * the same kernels as the per-op path above, in the same order and with the same roundings,
 * driven from C so the step costs one call instead of ~10 per layer. Buffers between the
 * kernels are T (the model dtype); matrix products take and give fp32 and are rounded to T
 * where the reference rounds. */
typedef void (*gemv_fn)(const float *, int64_t, int64_t, const void *, int64_t, const float *,
                        const float *, float *, int);
void gemv_f32(const float *, int64_t, int64_t, const float *, int64_t, const float *,
              const float *, float *, int);
void gemv_bf16(const float *, int64_t, int64_t, const uint16_t *, int64_t, const float *,
               const float *, float *, int);
void gemv_i8(const float *, int64_t, int64_t, const int8_t *, int64_t, const float *,
             const float *, float *, int);
void gemv_q8(const float *, int64_t, int64_t, const int8_t *, int64_t, const float *,
             const float *, float *, int);
void gemv_bf16dp(const float *, int64_t, int64_t, const uint16_t *, int64_t, const float *,
                 const float *, float *, int);
int gguf_gemv(int type, const float *x, int64_t rows, int64_t k, const uint8_t *w, int64_t n,
              const float *bias, float *y, int threads);

int gguf_gemv_x8(int type, const float *x, int64_t rows, int64_t k, const uint8_t *w,
                 int64_t n, const float *bias, float *y, int threads);

/* Lin.kind at or above this: GGUF blocks (gguf.c) of ggml type kind - GGUF_KIND; at or above
 * GGUF_X8_KIND, blocks in the x8 layout (gguf_x8.c) of type kind - GGUF_X8_KIND. */
#define GGUF_KIND 100
#define GGUF_X8_KIND 200

typedef struct {
    const void *w;
    const float *scale; /* int8 weights: per output row; else NULL */
    const float *bias;  /* fp32 or NULL */
    int64_t n, k;
    int64_t kind; /* 0 gemv_f32, 1 gemv_bf16, 2 gemv_i8, 3 gemv_q8, 4 gemv_bf16dp;
                     GGUF_KIND / GGUF_X8_KIND + ggml type: GGUF blocks */
} Lin;

typedef struct {
    Lin qkv, o, gate_up, down;
    const void *input_norm, *post_norm; /* T [hidden] */
    void *k_cache, *v_cache;            /* T [slots, kv_heads, head_dim]; quantized (kv_kind):
                                           k_cache is the codes, v_cache unused */
    uint16_t *kv_scale;                 /* quantized: float16 [slots, 2, kv_heads]; else NULL */
} Layer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, inter, num_layers;
    float eps, scale;
    int64_t kv_kind; /* 0: the model dtype, 1: int8 codes, 2: e4m3 codes */
    int64_t rotate;  /* quantized K/V stored in the Hadamard basis */
} Dims;

static gemv_fn pick(int64_t kind) {
    switch (kind) {
    case 0: return (gemv_fn)gemv_f32;
    case 1: return (gemv_fn)gemv_bf16;
    case 2: return (gemv_fn)gemv_i8;
    case 3: return (gemv_fn)gemv_q8;
    default: return (gemv_fn)gemv_bf16dp;
    }
}

#define DEFINE_DECODE_STEP(SUF, T)                                                            \
    static void to_f32_##SUF(const T *src, int64_t n, float *dst) {                          \
        for (int64_t i = 0; i < n; i++) dst[i] = get_##SUF(src, i);                          \
    }                                                                                        \
    static void from_f32_##SUF(const float *src, int64_t n, T *dst) {                        \
        for (int64_t i = 0; i < n; i++) put_##SUF(dst, i, src[i]);                           \
    }                                                                                        \
    static int linear_##SUF(const Lin *l, const T *x, int64_t rows, float *x32, float *y32,  \
                            T *y, int threads) {                                             \
        to_f32_##SUF(x, rows * l->k, x32);                                                   \
        if (l->kind >= GGUF_X8_KIND) {                                                       \
            if (gguf_gemv_x8((int)(l->kind - GGUF_X8_KIND), x32, rows, l->k, l->w, l->n,      \
                             l->bias, y32, threads))                                         \
                return 0;                                                                    \
        } else if (l->kind >= GGUF_KIND) {                                                   \
            if (gguf_gemv((int)(l->kind - GGUF_KIND), x32, rows, l->k, l->w, l->n, l->bias,  \
                          y32, threads))                                                     \
                return 0;                                                                    \
        } else {                                                                             \
            pick(l->kind)(x32, rows, l->k, l->w, l->n, l->scale, l->bias, y32, threads);     \
        }                                                                                    \
        from_f32_##SUF(y32, rows * l->n, y);                                                 \
        return 1;                                                                            \
    }                                                                                        \
    int decode_step_##SUF(const Dims *d, const Layer *layers, T *h, int64_t rows,            \
                          const float *cos, const float *sin, const int64_t *slot_mapping,   \
                          const int64_t *slots, const int64_t *lens, int64_t max_ctx,        \
                          T *pending, int threads) {                                         \
        const int64_t qd = d->heads * d->head_dim, kvd = d->kv_heads * d->head_dim;          \
        const int64_t qkv_n = qd + 2 * kvd, wide = 2 * d->inter > qkv_n ? 2 * d->inter : qkv_n; \
        const int64_t wide_in = d->inter > d->hidden ? d->inter : d->hidden;                 \
        float *x32 = malloc(sizeof(float) * rows * (wide_in > qd ? wide_in : qd));           \
        float *y32 = malloc(sizeof(float) * rows * wide);                                    \
        T *x = malloc(sizeof(T) * rows * d->hidden), *qkv = malloc(sizeof(T) * rows * qkv_n); \
        T *q = malloc(sizeof(T) * rows * qd), *attn = malloc(sizeof(T) * rows * qd);         \
        T *gu = malloc(sizeof(T) * rows * 2 * d->inter), *act = malloc(sizeof(T) * rows * d->inter); \
        T *y = malloc(sizeof(T) * rows * d->hidden);                                         \
        int ok = x32 && y32 && x && qkv && q && attn && gu && act && y;                      \
        for (int64_t i = 0; ok && i < d->num_layers; i++) {                                  \
            const Layer *L = layers + i;                                                     \
            rms_norm_##SUF(h, i ? pending : NULL, rows, d->hidden, L->input_norm, d->eps, x); \
            ok = linear_##SUF(&L->qkv, x, rows, x32, y32, qkv, threads);                     \
            if (!ok) break;                                                                  \
            rope_##SUF(qkv, rows, qkv_n, d->heads + d->kv_heads, d->head_dim, cos, sin);     \
            for (int64_t r = 0; r < rows; r++)                                               \
                memcpy(q + r * qd, qkv + r * qkv_n, sizeof(T) * qd);                         \
            if (d->kv_kind) {                                                                \
                store_kv_quant_##SUF(qkv + qd, qkv + qd + kvd, rows, qkv_n, qkv_n,           \
                                     slot_mapping, L->k_cache, L->kv_scale,                  \
                                     d->kv_kind == 2, (int)d->rotate, d->kv_heads,           \
                                     d->head_dim);                                           \
                ok = !decode_attention_quant_##SUF(q, L->k_cache, L->kv_scale,               \
                                                   d->kv_kind == 2, (int)d->rotate, slots,   \
                                                   lens, rows, max_ctx, d->heads,            \
                                                   d->kv_heads, d->head_dim, d->scale, attn, \
                                                   threads);                                 \
            } else {                                                                         \
                store_kv_##SUF(qkv + qd, qkv + qd + kvd, rows, qkv_n, slot_mapping,          \
                               L->k_cache, L->v_cache, kvd);                                 \
                ok = !decode_attention_##SUF(q, L->k_cache, L->v_cache, slots, lens, rows,   \
                                             max_ctx, d->heads, d->kv_heads, d->head_dim,    \
                                             d->scale, attn, threads);                       \
            }                                                                                \
            if (!ok) break;                                                                  \
            ok = linear_##SUF(&L->o, attn, rows, x32, y32, y, threads);                      \
            if (!ok) break;                                                                  \
            rms_norm_##SUF(h, y, rows, d->hidden, L->post_norm, d->eps, x);                  \
            ok = ok && linear_##SUF(&L->gate_up, x, rows, x32, y32, gu, threads);            \
            silu_mul_##SUF(gu, rows, d->inter, act);                                         \
            ok = ok && linear_##SUF(&L->down, act, rows, x32, y32, pending, threads);        \
        }                                                                                    \
        free(x32); free(y32); free(x); free(qkv); free(q); free(attn); free(gu); free(act);   \
        free(y);                                                                             \
        return ok;                                                                           \
    }

DEFINE_DECODE_STEP(f32, float)
DEFINE_DECODE_STEP(bf16, uint16_t)
