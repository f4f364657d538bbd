/* The small per-layer operations of a decode step, fused: each is one call instead of the
 * 5-10 PyTorch ops (and allocations) it replaces, which at one token per step cost more than
 * their arithmetic. fp32 and bf16 tensors (bf16: computed in fp32, rounded to nearest even
 * where the reference rounds). Row-major, contiguous unless a stride is given.
 */
#include "avx2.h"
#include "half.h"
#include "products.h"
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

/* ---- decode attention's vectors: 16 floats (AVX-512), 8 (AVX2 + FMA) or 1 (plain C) -------
 * One set of names over each width, so the attention below is written once: vf a vector of
 * VW floats; vk_<type>(p) VW cache elements from p as floats; v_lanesum(a) the vector whose
 * lane i is the sum of a[i]'s lanes (a[0..VW)); v_exp Cephes' expf (range reduction by ln 2
 * in two parts, degree-5 polynomial; within 2 ulp of expf; inputs clamped to +-88.38, so
 * -inf and very negative scores give exactly 0: glibc's scalar expf was over half of
 * attention's time). */
#if defined(__AVX512F__)
#define VW 16
typedef __m512 vf;
static inline vf v_zero(void) { return _mm512_setzero_ps(); }
static inline vf v_set1(float x) { return _mm512_set1_ps(x); }
static inline vf v_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void v_store(float *p, vf x) { _mm512_storeu_ps(p, x); }
static inline vf v_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf v_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf v_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf v_max(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf v_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline float v_hmax(vf a) { return _mm512_reduce_max_ps(a); }
static inline float v_hsum(vf a) { return _mm512_reduce_add_ps(a); }
static inline vf vk_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline vf vk_bf16(const uint16_t *p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
static inline vf vk_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline vf vk_f8(const uint8_t *p) {
    const __m256i w = _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)), 7);
    return _mm512_cvtph_ps(_mm256_and_si256(w, _mm256_set1_epi16((short)0xBF80)));
}
/* pairs, then quads within each 128-bit lane, then across the four lanes: 45 instructions
 * for 16 sums instead of 16 reductions of 8 */
static inline vf v_lanesum(const vf a[16]) {
    vf b[8], c[4];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const vf f = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x44),
                               _mm512_shuffle_f32x4(c[0], c[1], 0xEE));
    const vf g = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x44),
                               _mm512_shuffle_f32x4(c[2], c[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(f, g, 0x88), _mm512_shuffle_f32x4(f, g, 0xDD));
}
static inline vf v_exp(vf x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)),
                      _mm512_set1_ps(-88.3762626647949f));
    const vf fx = _mm512_roundscale_ps(
        _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
    vf y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
    const __m512i n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx),
                                                         _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(n));
}
#elif defined(__AVX2__) && defined(__FMA__)
#define VW 8
typedef __m256 vf;
static inline vf v_zero(void) { return _mm256_setzero_ps(); }
static inline vf v_set1(float x) { return _mm256_set1_ps(x); }
static inline vf v_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void v_store(float *p, vf x) { _mm256_storeu_ps(p, x); }
static inline vf v_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf v_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf v_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf v_max(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf v_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline float v_hsum(vf a) { return hsum8(a); }
static inline float v_hmax(vf a) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
static inline vf vk_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline vf vk_bf16(const uint16_t *p) { return load8_bf16(p); }
static inline vf vk_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline vf vk_f8(const uint8_t *p) {
    const __m128i w = _mm_slli_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p)), 7);
    return _mm256_cvtph_ps(_mm_and_si128(w, _mm_set1_epi16((short)0xBF80)));
}
static inline vf v_lanesum(const vf a[8]) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}
static inline vf v_exp(vf x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)),
                      _mm256_set1_ps(-88.3762626647949f));
    const vf fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f),
                                                  _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    vf y = _mm256_set1_ps(1.9875691500e-4f);
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
#else
#define VW 1
typedef float vf;
static inline vf v_zero(void) { return 0.f; }
static inline vf v_set1(float x) { return x; }
static inline vf v_load(const float *p) { return *p; }
static inline void v_store(float *p, vf x) { *p = x; }
static inline vf v_add(vf a, vf b) { return a + b; }
static inline vf v_sub(vf a, vf b) { return a - b; }
static inline vf v_mul(vf a, vf b) { return a * b; }
static inline vf v_max(vf a, vf b) { return a > b ? a : b; }
static inline vf v_fma(vf a, vf b, vf c) { return a * b + c; }
static inline float v_hmax(vf a) { return a; }
static inline float v_hsum(vf a) { return a; }
static inline vf vk_f32(const float *p) { return *p; }
static inline vf vk_bf16(const uint16_t *p) { return bf16_to_f32(*p); }
static inline vf vk_i8(const int8_t *p) { return (float)*p; }
static inline vf vk_f8(const uint8_t *p) { return get_f8(p, 0); }
static inline vf v_lanesum(const vf a[1]) { return a[0]; }
static inline vf v_exp(vf x) { return x < -88.3762626647949f ? 0.f : expf(x); }
#endif


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
 * Work is split into units of (sequence, ATTN_CHUNK positions), taken by whichever thread is
 * free: a unit reads its positions' K rows (every kv head: one contiguous stretch per slot,
 * a block's slots one stretch), then their V rows, each once for all the query heads sharing
 * a kv head; a single sequence still gives both threads work. Each unit leaves, per head, its
 * running max, softmax denominator and unnormalised output; a last pass merges a head's
 * chunks in order (flash-decoding's split). The split depends only on the positions, never
 * on the thread count or the other sequences of the step, so neither changes a result; up to
 * ATTN_CHUNK positions it is the plain softmax. Returns 0, or -1 without memory. */
#define ATTN_CHUNK 128
#if VW == 8
#define VH 3 /* query heads whose outputs a values tile keeps in registers (16 ymm) */
#else
#define VH 4 /* (32 zmm) */
#endif
#define VT 4 /* vectors of columns per values tile */
#ifndef ATTN_AHEAD
#define ATTN_AHEAD 32
#endif

/* The cache rows a step reads come from memory (the weights streamed since the last step
 * evicted them), at scattered blocks: the next VW positions' K rows are prefetched while a
 * sub-block's scores are computed, and its V rows, so they are in cache for the second pass. */
static inline void prefetch_span(const void *p, int64_t bytes) {
    for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch((const char *)p + at);
}

/* sc[h * ATTN_CHUNK + p] = (q_h . k_p) * ks[p] for the VW rows kf[p] (floats) and the group's
 * query heads qv [group, dim]; ks NULL: unscaled. */
static void scores_block(const float *qv, int64_t group, const float *const *kf, int64_t dim,
                         const float *ks, float *sc) {
    const int64_t dv = dim - dim % VW;
    for (int64_t h = 0; h < group; h++) {
        const float *q = qv + h * dim;
        vf a[VW];
        for (int p = 0; p < VW; p++) a[p] = v_zero();
        for (int64_t i = 0; i < dv; i += VW) {
            const vf qi = v_load(q + i);
            for (int p = 0; p < VW; p++) a[p] = v_fma(qi, v_load(kf[p] + i), a[p]);
        }
        vf s = v_lanesum(a);
        if (dv < dim) {
            float t[VW];
            for (int p = 0; p < VW; p++) {
                t[p] = 0.f;
                for (int64_t i = dv; i < dim; i++) t[p] += q[i] * kf[p][i];
            }
            s = v_add(s, v_load(t));
        }
        if (ks) s = v_mul(s, v_load(ks));
        v_store(sc + h * ATTN_CHUNK, s);
    }
}

/* Softmax numerators of a head's n scores in place (the tail to the next VW set to 0);
 * writes the max and the sum of exps to m[0], m[1]. */
static void softmax_chunk(float *sh, int64_t n, float *m) {
    const int64_t padded = (n + VW - 1) / VW * VW;
    for (int64_t j = n; j < padded; j++) sh[j] = -INFINITY;
    vf mv = v_set1(-INFINITY);
    for (int64_t j = 0; j < padded; j += VW) mv = v_max(mv, v_load(sh + j));
    const float mx = v_hmax(mv);
    const vf mm = v_set1(mx);
    vf sum = v_zero();
    for (int64_t j = 0; j < padded; j += VW) {
        const vf e = v_exp(v_sub(v_load(sh + j), mm));
        v_store(sh + j, e);
        sum = v_add(sum, e);
    }
    m[0] = mx;
    m[1] = v_hsum(sum);
}

/* Per cache element type KT:
 *   rows_KSUF: VW K rows as floats (fp32 rows are used in place, others converted into buf);
 *   vtile_KSUF: acc[h][c0 .. c0 + nt VW) = sum_j p[h][j] v_j for nh heads, nt vectors of
 *     columns, kept in registers over all n rows (each V element is loaded once per nh heads);
 *     inlined with constant nh, nt so the tile is registers, not memory;
 *   values_KSUF: the whole [group, dim] output of one kv head's rows;
 *   unit_KSUF: one unit's two passes. */
#define DEFINE_ATTN_UNIT(KSUF, KT)                                                            \
    static inline void rows_##KSUF(const KT *const *r, int64_t dim, float *buf,              \
                                   const float **kf) {                                       \
        for (int p = 0; p < VW; p++) {                                                       \
            if (sizeof(KT) == sizeof(float)) {                                               \
                kf[p] = (const float *)r[p];                                                 \
                continue;                                                                    \
            }                                                                                \
            float *b = buf + p * dim;                                                        \
            int64_t i = 0;                                                                   \
            for (; i + VW <= dim; i += VW) v_store(b + i, vk_##KSUF(r[p] + i));              \
            for (; i < dim; i++) b[i] = get_##KSUF(r[p], i);                                 \
            kf[p] = b;                                                                       \
        }                                                                                    \
    }                                                                                        \
    static inline __attribute__((always_inline)) void vtile_##KSUF(                          \
        const int nh, const int nt, const float *p, const KT *v, const int64_t *rows,        \
        int64_t n, int64_t c0, float *acc, int64_t width) {                                  \
        vf a[VH][VT];                                                                        \
        for (int h = 0; h < nh; h++)                                                         \
            for (int t = 0; t < nt; t++) a[h][t] = v_zero();                                 \
        for (int64_t j = 0; j < n; j++) {                                                    \
            const KT *vr = v + rows[j] + c0;                                                 \
            vf pb[VH];                                                                       \
            for (int h = 0; h < nh; h++) pb[h] = v_set1(p[h * ATTN_CHUNK + j]);              \
            for (int t = 0; t < nt; t++) {                                                   \
                const vf x = vk_##KSUF(vr + t * VW);                                         \
                for (int h = 0; h < nh; h++) a[h][t] = v_fma(pb[h], x, a[h][t]);             \
            }                                                                                \
        }                                                                                    \
        for (int h = 0; h < nh; h++)                                                         \
            for (int t = 0; t < nt; t++) v_store(acc + h * width + c0 + t * VW, a[h][t]);    \
    }                                                                                        \
    static void vtiles_##KSUF(int nh, const float *p, const KT *v, const int64_t *rows,      \
                              int64_t n, int64_t dv, float *acc, int64_t width) {            \
        int64_t c = 0;                                                                       \
        for (; c + VT * VW <= dv; c += VT * VW) switch (nh) {                               \
            case 1: vtile_##KSUF(1, VT, p, v, rows, n, c, acc, width); break;                \
            case 2: vtile_##KSUF(2, VT, p, v, rows, n, c, acc, width); break;                \
            case 3: vtile_##KSUF(3, VT, p, v, rows, n, c, acc, width); break;                \
            default: vtile_##KSUF(VH, VT, p, v, rows, n, c, acc, width); break;              \
            }                                                                                \
        for (; c < dv; c += VW) switch (nh) {                                               \
            case 1: vtile_##KSUF(1, 1, p, v, rows, n, c, acc, width); break;                 \
            case 2: vtile_##KSUF(2, 1, p, v, rows, n, c, acc, width); break;                 \
            case 3: vtile_##KSUF(3, 1, p, v, rows, n, c, acc, width); break;                 \
            default: vtile_##KSUF(VH, 1, p, v, rows, n, c, acc, width); break;               \
            }                                                                                \
    }                                                                                        \
    static void values_##KSUF(const float *p, int64_t group, const KT *v, const int64_t *rows, \
                              int64_t n, int64_t dim, float *acc, int64_t width) {           \
        const int64_t dv = dim - dim % VW;                                                   \
        for (int64_t h0 = 0; h0 < group; h0 += VH) {                                         \
            const int nh = (int)(group - h0 < VH ? group - h0 : VH);                         \
            const float *ph = p + h0 * ATTN_CHUNK;                                           \
            float *ah = acc + h0 * width;                                                    \
            vtiles_##KSUF(nh, ph, v, rows, n, dv, ah, width);                                \
            for (int64_t c = dv; c < dim; c++)                                               \
                for (int h = 0; h < nh; h++) {                                               \
                    float s = 0.f;                                                           \
                    for (int64_t j = 0; j < n; j++)                                          \
                        s += ph[h * ATTN_CHUNK + j] * get_##KSUF(v + rows[j], c);            \
                    ah[h * width + c] = s;                                                   \
                }                                                                            \
        }                                                                                    \
    }                                                                                        \
    static void unit_##KSUF(const float *qv, const KT *k, const KT *v, const uint16_t *ks,   \
                            const uint16_t *vs, float unit, int64_t slot_rows,               \
                            const int64_t *sl, int64_t n, int64_t kv_heads, int64_t group,    \
                            int64_t dim, float *pu) {                                        \
        const int64_t width = dim + 2, span = kv_heads * dim * (int64_t)sizeof(KT);          \
        const int64_t padded = (n + VW - 1) / VW * VW;                                       \
        int64_t row[ATTN_CHUNK], off[ATTN_CHUNK]; /* cache row of (slot, kv head 0); V's */  \
        float sc[kv_heads * group * ATTN_CHUNK], buf[VW * dim], scl[ATTN_CHUNK];             \
        for (int64_t j = 0; j < padded; j++) row[j] = sl[j < n ? j : 0] * slot_rows;         \
        for (int64_t j = 0; j < n && j < ATTN_AHEAD; j++) prefetch_span(k + row[j] * dim, span); \
        for (int64_t j0 = 0; j0 < padded; j0 += VW) {                                        \
            for (int64_t j = j0 + ATTN_AHEAD; j < n && j < j0 + VW + ATTN_AHEAD; j++)       \
                prefetch_span(k + row[j] * dim, span);                                       \
            for (int64_t j = j0; j < n && j < j0 + VW; j++) prefetch_span(v + row[j] * dim, span); \
            for (int64_t g = 0; g < kv_heads; g++) {                                         \
                const KT *r[VW];                                                             \
                const float *kf[VW];                                                         \
                float s[VW];                                                                 \
                for (int p = 0; p < VW; p++) {                                               \
                    r[p] = k + (row[j0 + p] + g) * dim;                                      \
                    s[p] = ks ? f16_to_f32(ks[row[j0 + p] + g]) * unit : 1.f;                \
                }                                                                            \
                rows_##KSUF(r, dim, buf, kf);                                                \
                scores_block(qv + g * group * dim, group, kf, dim, ks ? s : NULL,            \
                             sc + g * group * ATTN_CHUNK + j0);                              \
            }                                                                                \
        }                                                                                    \
        for (int64_t g = 0; g < kv_heads; g++) {                                             \
            for (int64_t j = 0; j < n; j++) off[j] = (row[j] + g) * dim;                     \
            for (int64_t j = n; j < padded; j++) scl[j] = 0.f;                               \
            for (int64_t j = 0; j < n; j++) scl[j] = vs ? f16_to_f32(vs[row[j] + g]) * unit : 1.f; \
            for (int64_t h = g * group; h < (g + 1) * group; h++) {                          \
                float *sh = sc + h * ATTN_CHUNK;                                             \
                softmax_chunk(sh, n, pu + h * width + dim);                                  \
                if (vs)                                                                      \
                    for (int64_t j = 0; j < padded; j += VW)                                 \
                        v_store(sh + j, v_mul(v_load(sh + j), v_load(scl + j)));             \
            }                                                                                \
            values_##KSUF(sc + g * group * ATTN_CHUNK, group, v, off, n, dim,                \
                          pu + g * group * width, width);                                    \
        }                                                                                    \
    }
DEFINE_ATTN_UNIT(f32, float)
DEFINE_ATTN_UNIT(bf16, uint16_t)
DEFINE_ATTN_UNIT(i8, int8_t)
DEFINE_ATTN_UNIT(f8, uint8_t)

/* A head's output from its chunks' partials (p0, the next chunk `step` floats on): weights
 * exp(max_c - max), in chunk order; with `rotate`, back out of the Hadamard basis. */
static void merge_head(const float *p0, int64_t step, int64_t used, int64_t dim, int rotate,
                       float *acc) {
    float mx = -INFINITY, sum = 0.f;
    for (int64_t c = 0; c < used; c++) mx = p0[c * step + dim] > mx ? p0[c * step + dim] : mx;
    for (int64_t i = 0; i < dim; i++) acc[i] = 0.f;
    for (int64_t c = 0; c < used; c++) {
        const float *pc = p0 + c * step, w = expf(pc[dim] - mx);
        sum += w * pc[dim + 1];
        for (int64_t i = 0; i < dim; i++) acc[i] += w * pc[i];
    }
    const float inv = used ? 1.0f / sum : 0.f; /* no positions: zeros */
    for (int64_t i = 0; i < dim; i++) acc[i] *= inv;
    if (rotate) hadamard(acc, dim);
}

/* The driver for q/out of type T and cache elements of type KT: row r of the cache (r = slot
 * * slot_rows + kv head) is k + r * dim and v + r * dim. Quantized caches give each row a
 * float16 scale (ks[r], vs[r], times `unit`); plain ones pass NULL (scale 1: the products are
 * unchanged). With `rotate`, K/V are stored in the Hadamard basis: the kernel turns each
 * query into it and each output back. */
#define DEFINE_ATTEND(SUF, T, KSUF, KT)                                                       \
    static int attend_##SUF##_##KSUF(const T *q, const KT *k, const KT *v, const uint16_t *ks, \
                                     const uint16_t *vs, float unit, int rotate,             \
                                     int64_t slot_rows, const int64_t *slots,                \
                                     const int64_t *lens, int64_t seqs, int64_t max_ctx,      \
                                     int64_t heads, int64_t kv_heads, int64_t dim,            \
                                     float scale, T *out, int threads) {                     \
        const int64_t group = heads / kv_heads, width = dim + 2;                             \
        int64_t *first = malloc(sizeof(int64_t) * (size_t)(seqs + 1)), units = 0;            \
        if (!first) return -1;                                                               \
        first[0] = 0;                                                                        \
        for (int64_t b = 0; b < seqs; b++)                                                   \
            first[b + 1] = units += (lens[b] + ATTN_CHUNK - 1) / ATTN_CHUNK;                 \
        /* per unit and head: acc[dim], then the max and the denominator */                  \
        float *part = malloc(sizeof(float) * (size_t)(units * heads * width + 1));           \
        float *qf = malloc(sizeof(float) * (size_t)(seqs * heads * dim + 1));                \
        int64_t *useq = malloc(sizeof(int64_t) * (size_t)(units + 1));                       \
        if (!part || !qf || !useq) {                                                         \
            free(first); free(part); free(qf); free(useq);                                   \
            return -1;                                                                       \
        }                                                                                    \
        for (int64_t b = 0; b < seqs; b++)                                                   \
            for (int64_t u = first[b]; u < first[b + 1]; u++) useq[u] = b;                   \
        const int team = threads < units ? threads : units > 1 ? (int)units : 1;             \
        _Pragma("omp parallel num_threads(team)")                                            \
        {                                                                                    \
            _Pragma("omp for schedule(static)")                                              \
            for (int64_t bh = 0; bh < seqs * heads; bh++) {                                  \
                float *x = qf + bh * dim;                                                    \
                for (int64_t i = 0; i < dim; i++) x[i] = get_##SUF(q + bh * dim, i);         \
                if (rotate) hadamard(x, dim);                                                \
                for (int64_t i = 0; i < dim; i++) x[i] *= scale;                             \
            }                                                                                \
            _Pragma("omp for schedule(dynamic, 1)")                                          \
            for (int64_t u = 0; u < units; u++) {                                            \
                const int64_t b = useq[u], lo = (u - first[b]) * ATTN_CHUNK;                 \
                const int64_t n = lens[b] - lo < ATTN_CHUNK ? lens[b] - lo : ATTN_CHUNK;     \
                unit_##KSUF(qf + b * heads * dim, k, v, ks, vs, unit, slot_rows,             \
                            slots + b * max_ctx + lo, n, kv_heads, group, dim,               \
                            part + u * heads * width);                                       \
            }                                                                                \
            _Pragma("omp for schedule(static)")                                              \
            for (int64_t bh = 0; bh < seqs * heads; bh++) {                                  \
                const int64_t b = bh / heads, h = bh % heads;                                \
                float acc[dim];                                                              \
                merge_head(part + (first[b] * heads + h) * width, heads * width,             \
                           first[b + 1] - first[b], dim, rotate, acc);                       \
                for (int64_t i = 0; i < dim; i++) put_##SUF(out + bh * dim, i, acc[i]);      \
            }                                                                                \
        }                                                                                    \
        free(first); free(part); free(qf); free(useq);                                       \
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
DEFINE_ATTEND(f32, float, bf16, uint16_t)

/* fp32 queries over a bfloat16 cache (kv_cache_dtype bfloat16 under a float32 model): the
 * stored values, widened exactly, as reading the cache back would give them. */
int decode_attention_bf16kv_f32(const float *q, const uint16_t *k, const uint16_t *v,
                                const int64_t *slots, const int64_t *lens, int64_t seqs,
                                int64_t max_ctx, int64_t heads, int64_t kv_heads, int64_t dim,
                                float scale, float *out, int threads) {
    return attend_f32_bf16(q, k, v, NULL, NULL, 1.0f, 0, kv_heads, slots, lens, seqs, max_ctx,
                           heads, kv_heads, dim, scale, out, threads);
}

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
