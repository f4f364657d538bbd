/* Skinny matrix products for decode: y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]) for the
 * rows of a decode step, with W in the reference's [out, in] row-major layout stored as fp32, bf16 or int8
 * (int8: times a per-row scale). Decode is bound by streaming W from memory, so each W row is
 * read from memory once for all rows of x, 16 lanes per instruction, and the output
 * columns are split between OpenMP threads (the same runtime PyTorch uses).
 *
 * The reduction order of a row never depends on how many rows x has, so a token's result is
 * the same whatever else shares its step.
 */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>


static inline __m512 load_f32(const float *p) { return _mm512_loadu_ps(p); }

static inline __m512 load_bf16(const uint16_t *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __m512 load_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* Masked tails (K % 16), so any K works. */
static inline __m512 load_f32_tail(const float *p, __mmask16 m) {
    return _mm512_maskz_loadu_ps(m, p);
}
static inline __m512 load_bf16_tail(const uint16_t *p, __mmask16 m) {
    __m256i h = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline __m512 load_i8_tail(const int8_t *p, __mmask16 m) {
    __m128i b = _mm_maskz_loadu_epi8(m, p);
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
}

/* R rows of x (R = 1..4, a compile-time constant so the 4R accumulators stay in registers)
 * against one block of NB W rows (NB = 4, or 1 for the last rows when n % 4 != 0). */
#define DEFINE_BLOCK(SUF, WT, LOAD, LOAD_TAIL, R, NB)                                          \
    static inline void block_##SUF##_##R##_##NB(const float *x, int64_t k, const WT *w,        \
                                               __m512 out[R][NB]) {                            \
        const int64_t k16 = k & ~(int64_t)15;                                                 \
        __m512 acc[R][NB];                                                                     \
        for (int r = 0; r < R; r++)                                                            \
            for (int j = 0; j < NB; j++) acc[r][j] = _mm512_setzero_ps();                      \
        for (int64_t i = 0; i < k16; i += 16) {                                                \
            __m512 wv[NB];                                                                     \
            for (int j = 0; j < NB; j++) wv[j] = LOAD(w + j * k + i);                          \
            for (int r = 0; r < R; r++) {                                                      \
                const __m512 xv = _mm512_loadu_ps(x + r * k + i);                               \
                for (int j = 0; j < NB; j++) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]); \
            }                                                                                  \
        }                                                                                      \
        if (k16 < k) {                                                                         \
            const __mmask16 tail = (__mmask16)((1u << (k - k16)) - 1u);                         \
            __m512 wv[NB];                                                                     \
            for (int j = 0; j < NB; j++) wv[j] = LOAD_TAIL(w + j * k + k16, tail);             \
            for (int r = 0; r < R; r++) {                                                      \
                const __m512 xv = _mm512_maskz_loadu_ps(tail, x + r * k + k16);                 \
                for (int j = 0; j < NB; j++) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]); \
            }                                                                                  \
        }                                                                                      \
        for (int r = 0; r < R; r++)                                                            \
            for (int j = 0; j < NB; j++) out[r][j] = acc[r][j];                                \
    }

#define DEFINE_BLOCKS(SUF, WT, LOAD, LOAD_TAIL)                                                 \
    DEFINE_BLOCK(SUF, WT, LOAD, LOAD_TAIL, 1, 8) DEFINE_BLOCK(SUF, WT, LOAD, LOAD_TAIL, 2, 8)  \
    DEFINE_BLOCK(SUF, WT, LOAD, LOAD_TAIL, 3, 4) DEFINE_BLOCK(SUF, WT, LOAD, LOAD_TAIL, 4, 4)  \
    DEFINE_BLOCK(SUF, WT, LOAD, LOAD_TAIL, 1, 1) DEFINE_BLOCK(SUF, WT, LOAD, LOAD_TAIL, 2, 1)  \
    DEFINE_BLOCK(SUF, WT, LOAD, LOAD_TAIL, 3, 1) DEFINE_BLOCK(SUF, WT, LOAD, LOAD_TAIL, 4, 1)

/* Write R x NB sums, scaled and biased. */
#define STORE(R, NB)                                                                           \
    for (int r = 0; r < R; r++)                                                                \
        for (int j = 0; j < NB; j++) {                                                         \
            float s_ = _mm512_reduce_add_ps(acc##R##_##NB[r][j]);                              \
            if (scale) s_ *= scale[n0 + j];                                                    \
            if (bias) s_ += bias[n0 + j];                                                      \
            y[(r0 + r) * n + n0 + j] = s_;                                                     \
        }

#define CALL(SUF, R, NB)                                                                       \
    {                                                                                          \
        __m512 acc##R##_##NB[R][NB];                                                           \
        block_##SUF##_##R##_##NB(x + r0 * k, k, w + n0 * k, acc##R##_##NB);                    \
        STORE(R, NB)                                                                           \
    }

/* Each block of 8 W rows (18 KiB in fp32: it stays in L1) is used for every row of x, up to
 * 4 x rows at a time (1-2 rows x 8 W rows, or 3-4 x 4, fit the 32 vector registers), so a
 * batch of decodes streams W from memory once. */
#define DEFINE_GEMV(NAME, SUF, WT)                                                             \
    void NAME(const float *x, int64_t rows, int64_t k, const WT *w, int64_t n,                \
              const float *scale, const float *bias, float *y, int threads) {                  \
        const int64_t nblocks = (n + 7) / 8;                                                   \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                       \
        for (int64_t b = 0; b < nblocks; b++) {                                                \
            const int64_t nb = b * 8;                                                          \
            for (int64_t r0 = 0; r0 < rows; r0 += 4) {                                         \
                const int64_t rr = rows - r0 < 4 ? rows - r0 : 4;                               \
                if (n - nb >= 8) {                                                             \
                    const int64_t n0 = nb;                                                     \
                    switch (rr) {                                                              \
                    case 1: CALL(SUF, 1, 8) break;                                             \
                    case 2: CALL(SUF, 2, 8) break;                                             \
                    case 3: CALL(SUF, 3, 4) { const int64_t n0 = nb + 4; CALL(SUF, 3, 4) } break; \
                    default: CALL(SUF, 4, 4) { const int64_t n0 = nb + 4; CALL(SUF, 4, 4) } break; \
                    }                                                                          \
                } else {                                                                       \
                    for (int64_t n0 = nb; n0 < n; n0++) {                                      \
                        switch (rr) {                                                          \
                        case 1: CALL(SUF, 1, 1) break;                                         \
                        case 2: CALL(SUF, 2, 1) break;                                         \
                        case 3: CALL(SUF, 3, 1) break;                                         \
                        default: CALL(SUF, 4, 1) break;                                        \
                        }                                                                      \
                    }                                                                          \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }

DEFINE_BLOCKS(f32, float, load_f32, load_f32_tail)
DEFINE_BLOCKS(bf16, uint16_t, load_bf16, load_bf16_tail)
DEFINE_BLOCKS(i8, int8_t, load_i8, load_i8_tail)

DEFINE_GEMV(gemv_f32, f32, float)
DEFINE_GEMV(gemv_bf16, bf16, uint16_t)
DEFINE_GEMV(gemv_i8, i8, int8_t)


/* The loop both dot-product kernels below share: blocks of 4 W rows split between threads,
 * x rows 4 at a time through BLOCK_1..4(x rows, ..., w, nn, out); OFF[r] (or NULL) is subtracted
 * from row r's sums before the scale. */
#define DOT_PRODUCT_LOOP(BLOCK, XR, OFF, ...)                                                   \
    {                                                                                          \
        const float *off_ = (OFF);                                                             \
        const int64_t nblocks = (n + 3) / 4;                                                   \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                       \
        for (int64_t blk = 0; blk < nblocks; blk++) {                                          \
            const int64_t n0 = blk * 4, nn = n - n0 < 4 ? n - n0 : 4;                           \
            for (int64_t r0 = 0; r0 < rows; r0 += 4) {                                        \
                const int64_t rr = rows - r0 < 4 ? rows - r0 : 4;                               \
                float out[4][4];                                                               \
                switch (rr) {                                                                  \
                case 1: BLOCK##_1(XR, __VA_ARGS__, w + n0 * k, nn, out); break;                \
                case 2: BLOCK##_2(XR, __VA_ARGS__, w + n0 * k, nn, out); break;                \
                case 3: BLOCK##_3(XR, __VA_ARGS__, w + n0 * k, nn, out); break;                \
                default: BLOCK##_4(XR, __VA_ARGS__, w + n0 * k, nn, out); break;               \
                }                                                                              \
                for (int64_t r = 0; r < rr; r++)                                               \
                    for (int64_t j = 0; j < nn; j++) {                                         \
                        float s_ = out[r][j];                                                  \
                        if (off_) s_ -= off_[r0 + r];                                          \
                        if (scale) s_ *= scale[n0 + j];                                        \
                        if (bias) s_ += bias[n0 + j];                                          \
                        y[(r0 + r) * n + n0 + j] = s_;                                         \
                    }                                                                          \
            }                                                                                  \
        }                                                                                      \
    }

/* int8 weights x int8 activations (AVX512-VNNI), for decode with int8 weights: each 64-element
 * block of an x row is quantized to int8 with its own scale (amax / 127; measured on the
 * embedded model: +0.01% perplexity over fp32 activations), and 64 weights x activations
 * become one vpdpbusd instead of 4 widenings, conversions and FMAs -- the int8 path stops
 * being bound by arithmetic. vpdpbusd wants unsigned x signed bytes, so the weights are fed
 * as q + 128 (q ^ 0x80) and the extra 128 * sum(x) -- the same for every output -- is
 * subtracted at the end. */
#define QB 64

__attribute__((target("avx512f,avx512bw,avx512vnni")))
static void quantize_rows(const float *x, int64_t rows, int64_t k, int8_t *xq, float *sx,
                          float *corr) {
    const int64_t nb = (k + QB - 1) / QB;
    for (int64_t r = 0; r < rows; r++) {
        float c = 0.f;
        for (int64_t b = 0; b < nb; b++) {
            const int64_t lo = b * QB, len = k - lo < QB ? k - lo : QB;
            float amax = 0.f;
            for (int64_t i = 0; i < len; i++) {
                const float a = x[r * k + lo + i] < 0 ? -x[r * k + lo + i] : x[r * k + lo + i];
                amax = a > amax ? a : amax;
            }
            const float s = amax > 0.f ? amax / 127.f : 1.f, inv = 1.f / s;
            int32_t sum = 0;
            int8_t *dst = xq + (r * nb + b) * QB;
            for (int64_t i = 0; i < QB; i++) {
                const int32_t q = i < len ? (int32_t)lrintf(x[r * k + lo + i] * inv) : 0;
                dst[i] = (int8_t)q;
                sum += q;
            }
            sx[r * nb + b] = s;
            c += s * (float)sum;
        }
        corr[r] = 128.f * c;
    }
}

#define DEFINE_Q8_BLOCK(R)                                                                     \
    __attribute__((target("avx512f,avx512bw,avx512vnni")))                                    \
    static inline void q8_block_##R(const int8_t *xq, const float *sx, int64_t nb, int64_t k, \
                                    const int8_t *w, int64_t nn, float out[R][4]) {            \
        const __m512i flip = _mm512_set1_epi8((char)0x80);                                    \
        __m512 acc[R][4];                                                                      \
        for (int r = 0; r < R; r++)                                                            \
            for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();                       \
        for (int64_t b = 0; b < nb; b++) {                                                     \
            const int64_t lo = b * QB;                                                         \
            const __mmask64 m = k - lo >= QB ? ~(__mmask64)0 : (((__mmask64)1 << (k - lo)) - 1); \
            __m512i wv[4];                                                                     \
            for (int j = 0; j < 4; j++)                                                        \
                wv[j] = j < nn ? _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, w + j * k + lo), flip) \
                               : _mm512_setzero_si512();                                       \
            for (int r = 0; r < R; r++) {                                                      \
                const __m512i xv = _mm512_loadu_si512(xq + (r * nb + b) * QB);                  \
                const __m512 s = _mm512_set1_ps(sx[r * nb + b]);                               \
                for (int j = 0; j < 4; j++) {                                                  \
                    const __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[j], xv);  \
                    acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), s, acc[r][j]);          \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        for (int r = 0; r < R; r++)                                                            \
            for (int j = 0; j < 4; j++) out[r][j] = _mm512_reduce_add_ps(acc[r][j]);           \
    }

DEFINE_Q8_BLOCK(1)
DEFINE_Q8_BLOCK(2)
DEFINE_Q8_BLOCK(3)
DEFINE_Q8_BLOCK(4)

__attribute__((target("avx512f,avx512bw,avx512vnni")))
void gemv_q8(const float *x, int64_t rows, int64_t k, const int8_t *w, int64_t n,
             const float *scale, const float *bias, float *y, int threads) {
    const int64_t nb = (k + QB - 1) / QB;
    int8_t xq[rows * nb * QB];
    float sx[rows * nb], corr[rows];
    quantize_rows(x, rows, k, xq, sx, corr);
    DOT_PRODUCT_LOOP(q8_block, xq + r0 * nb * QB, corr, sx + r0 * nb, nb, k)
}

/* bf16 weights x bf16 activations (AVX512-BF16): 32 products per vdpbf16ps, no widening of
 * the weights, for models whose activations are bf16 anyway (x arrives as fp32 holding bf16
 * values, so narrowing it back is exact). Sums accumulate in fp32. */
#define DEFINE_BF16DP_BLOCK(R)                                                                 \
    __attribute__((target("avx512f,avx512bw,avx512bf16")))                                    \
    static inline void bf16dp_block_##R(const uint16_t *xb, int64_t kp, int64_t k,            \
                                        const uint16_t *w, int64_t nn, float out[R][4]) {     \
        __m512 acc[R][4];                                                                      \
        for (int r = 0; r < R; r++)                                                            \
            for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();                       \
        for (int64_t i = 0; i < k; i += 32) {                                                  \
            const __mmask32 m = k - i >= 32 ? ~(__mmask32)0 : (((__mmask32)1 << (k - i)) - 1); \
            __m512i wv[4];                                                                     \
            for (int j = 0; j < 4; j++)                                                        \
                wv[j] = j < nn ? _mm512_maskz_loadu_epi16(m, w + j * k + i)                    \
                               : _mm512_setzero_si512();                                       \
            for (int r = 0; r < R; r++) {                                                      \
                const __m512i xv = _mm512_loadu_si512(xb + r * kp + i);                         \
                for (int j = 0; j < 4; j++)                                                    \
                    acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)xv, (__m512bh)wv[j]);    \
            }                                                                                  \
        }                                                                                      \
        for (int r = 0; r < R; r++)                                                            \
            for (int j = 0; j < 4; j++) out[r][j] = _mm512_reduce_add_ps(acc[r][j]);           \
    }

DEFINE_BF16DP_BLOCK(1)
DEFINE_BF16DP_BLOCK(2)
DEFINE_BF16DP_BLOCK(3)
DEFINE_BF16DP_BLOCK(4)

__attribute__((target("avx512f,avx512bw,avx512bf16")))
void gemv_bf16dp(const float *x, int64_t rows, int64_t k, const uint16_t *w, int64_t n,
                 const float *scale, const float *bias, float *y, int threads) {
    const int64_t kp = (k + 31) & ~(int64_t)31; /* rows padded with zeros to whole vectors */
    uint16_t *xb = calloc((size_t)(rows * kp), sizeof(uint16_t));
    if (!xb) return;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < k; i++) {
            uint32_t u;
            memcpy(&u, x + r * k + i, 4);
            xb[r * kp + i] = (uint16_t)(u >> 16); /* exact: x holds bf16 values */
        }
    DOT_PRODUCT_LOOP(bf16dp_block, xb + r0 * kp, (const float *)NULL, kp, k)
    free(xb);
}
