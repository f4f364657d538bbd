/* Skinny matrix products for decode: y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]) for the
 * rows of a decode step, with W in the reference's [out, in] row-major layout stored as fp32, bf16 or int8
 * (int8: times a per-row scale). Decode is bound by streaming W from memory, so each W row is
 * read from memory once for all rows of x, 16 lanes per instruction (8 on AVX2), and the output
 * columns are split between OpenMP threads (the same runtime PyTorch uses).
 *
 * Two implementations, chosen at compile time by the target flags (kernels/isa.py, one build
 * each: KVSTACK_KERNELS=avx512|avx2): AVX-512 (F, BW, VL; VNNI and BF16 per function) and
 * AVX2 + FMA. They export the same symbols and signatures.
 *
 * The reduction order of a row never depends on how many rows x has, so a token's result is
 * the same whatever else shares its step.
 */
#include <immintrin.h>

#include "avx2.h"
#include "products.h"
#include "q8.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>

/* ---- shared by both implementations ---------------------------------------------------- */

/* A thread's groups of 4 W rows follow each other in memory, but a row of the embedded
 * model's shapes is only 576-1536 bytes: the 4 short streams of a group ended before the
 * hardware prefetcher caught on, and weights from memory came at a quarter of the bandwidth
 * (3-5 GB/s against 13 on one thread). A single x row reads the 4 rows one after another,
 * each block prefetched this many groups ahead (both ISAs; also AVX-512's bf16 x bf16). */
#define Q8_AHEAD 2

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


#if defined(__AVX512F__) && defined(__AVX512BW__)
/* ---- AVX-512 ------------------------------------------------------------------------------- */

/* 32 int8 codes -> 32 bf16 (widen_i8_bf16): via fp32, the high 16-bit word of each lane. */
static inline void widen32(const int8_t *src, uint16_t *dst) {
    const __m512i hi_words = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41,
                                              39, 37, 35, 33, 31, 29, 27, 25, 23, 21, 19, 17,
                                              15, 13, 11, 9, 7, 5, 3, 1);
    const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)src)));
    const __m512 b = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + 16))));
    _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(_mm512_castps_si512(a), hi_words,
                                                       _mm512_castps_si512(b)));
}


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


/* int8 weights x int8 activations (AVX512-VNNI), for decode with int8 weights: each 64-element
 * block of an x row is quantized to int8 with its own scale (amax / 127; measured on the
 * embedded model: +0.01% perplexity over fp32 activations), and 64 weights x activations
 * become one vpdpbusd instead of 4 widenings, conversions and FMAs -- the int8 path stops
 * being bound by arithmetic. vpdpbusd wants unsigned x signed bytes, so the weights are fed
 * as q + 128 (q ^ 0x80) and the extra 128 * sum(x) -- the same for every output -- is
 * subtracted at the end.
 *
 * Each output is sum over blocks b of s_b * D_b, D_b the block's exact int32 sum, accumulated
 * in fp32 by one FMA per block in block order: the arithmetic of gemm_q8.c, which takes over
 * from a few rows up with the same numbers bit for bit, so a row's result never depends on
 * how many rows share its step. */

/* The int32 totals of four vectors: [sum a, sum b, sum c, sum d]. */
__attribute__((target("avx512f,avx512bw")))
static inline __m128i reduce4(__m512i a, __m512i b, __m512i c, __m512i d) {
    const __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
    const __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
    const __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd),
                                       _mm512_unpackhi_epi64(ab, cd));
    const __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(u), _mm512_extracti64x4_epi64(u, 1));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

#define DEFINE_Q8_BLOCK(R)                                                                     \
    __attribute__((target("avx512f,avx512bw,avx512vnni")))                                    \
    static inline void q8_block_##R(const int8_t *xq, const float *sx, int64_t nb, int64_t k, \
                                    const int8_t *w, int64_t nn, float out[R][4]) {            \
        const __m512i flip = _mm512_set1_epi8((char)0x80);                                    \
        __m128 tot[R];                                                                         \
        for (int r = 0; r < R; r++) tot[r] = _mm_setzero_ps();                                 \
        for (int64_t b = 0; b < nb; b++) {                                                     \
            const int64_t lo = b * QB;                                                         \
            const __mmask64 m = k - lo >= QB ? ~(__mmask64)0 : (((__mmask64)1 << (k - lo)) - 1); \
            __m512i wv[4];                                                                     \
            for (int j = 0; j < 4; j++)                                                        \
                wv[j] = j < nn ? _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, w + j * k + lo), flip) \
                               : _mm512_setzero_si512();                                       \
            for (int r = 0; r < R; r++) {                                                      \
                const __m512i xv = _mm512_loadu_si512(xq + (r * nb + b) * QB);                  \
                const __m512i z = _mm512_setzero_si512();                                      \
                const __m128i d = reduce4(_mm512_dpbusd_epi32(z, wv[0], xv),                   \
                                          _mm512_dpbusd_epi32(z, wv[1], xv),                   \
                                          _mm512_dpbusd_epi32(z, wv[2], xv),                   \
                                          _mm512_dpbusd_epi32(z, wv[3], xv));                  \
                tot[r] = _mm_fmadd_ps(_mm_cvtepi32_ps(d), _mm_set1_ps(sx[r * nb + b]), tot[r]); \
            }                                                                                  \
        }                                                                                      \
        for (int r = 0; r < R; r++) _mm_storeu_ps(out[r], tot[r]);                             \
    }

/* One x row (decode): the 4 W rows one after another rather than side by side, each block
 * prefetched Q8_AHEAD groups ahead, as on AVX2 (576-byte rows side by side were 4 streams too
 * short for the hardware prefetcher); a row's blocks summed 4 at a time, then the same FMAs in
 * the same order as q8_block_2..4. */
__attribute__((target("avx512f,avx512bw,avx512vnni")))
static inline void q8_block_1(const int8_t *xq, const float *sx, int64_t nb, int64_t k,
                              const int8_t *w, int64_t nn, float out[1][4]) {
    const __m512i flip = _mm512_set1_epi8((char)0x80), z = _mm512_setzero_si512();
    for (int j = 0; j < 4; j++) {
        if (j >= nn) {
            out[0][j] = 0.f;
            continue;
        }
        const int8_t *wr = w + j * k;
        __m128 tot = _mm_setzero_ps();
        for (int64_t b0 = 0; b0 < nb; b0 += 4) {
            __m512i d[4];
            for (int i = 0; i < 4; i++) {
                const int64_t lo = (b0 + i) * QB;
                if (b0 + i >= nb) {
                    d[i] = z;
                    continue;
                }
                const __mmask64 m = k - lo >= QB ? ~(__mmask64)0 : (((__mmask64)1 << (k - lo)) - 1);
                _mm_prefetch((const char *)(wr + lo + Q8_AHEAD * 4 * k), _MM_HINT_T0);
                const __m512i wv = _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, wr + lo), flip);
                d[i] = _mm512_dpbusd_epi32(z, wv, _mm512_loadu_si512(xq + (b0 + i) * QB));
            }
            float f[4];
            _mm_storeu_ps(f, _mm_cvtepi32_ps(reduce4(d[0], d[1], d[2], d[3])));
            for (int i = 0; i < 4 && b0 + i < nb; i++)
                tot = _mm_fmadd_ss(_mm_set_ss(f[i]), _mm_set_ss(sx[b0 + i]), tot);
        }
        out[0][j] = _mm_cvtss_f32(tot);
    }
}
DEFINE_Q8_BLOCK(2)
DEFINE_Q8_BLOCK(3)
DEFINE_Q8_BLOCK(4)

__attribute__((target("avx512f,avx512bw,avx512vnni")))
void gemv_q8(const float *x, int64_t rows, int64_t k, const int8_t *w, int64_t n,
             const float *scale, const float *bias, float *y, int threads) {
    if (rows >= q8_gemm_rows() && gemm_q8(x, rows, k, w, n, scale, bias, y, threads)) return;
    const int64_t nb = (k + QB - 1) / QB;
    int8_t xq[rows * nb * QB];
    float sx[rows * nb], corr[rows];
    q8_quantize_rows(x, rows, k, xq, sx, corr);
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

/* One x row: W rows one after another, prefetched, as q8_block_1 (same sums, same order). */
__attribute__((target("avx512f,avx512bw,avx512bf16")))
static inline void bf16dp_block_1(const uint16_t *xb, int64_t kp, int64_t k, const uint16_t *w,
                                  int64_t nn, float out[1][4]) {
    (void)kp;
    for (int j = 0; j < 4; j++) {
        if (j >= nn) {
            out[0][j] = 0.f;
            continue;
        }
        const uint16_t *wr = w + j * k;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < k; i += 32) {
            const __mmask32 m = k - i >= 32 ? ~(__mmask32)0 : (((__mmask32)1 << (k - i)) - 1);
            _mm_prefetch((const char *)(wr + i + Q8_AHEAD * 4 * k), _MM_HINT_T0);
            const __m512i wv = _mm512_maskz_loadu_epi16(m, wr + i);
            acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(xb + i), (__m512bh)wv);
        }
        out[0][j] = _mm512_reduce_add_ps(acc);
    }
}
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

#else
/* ---- AVX2 + FMA ---------------------------------------------------------------------------
 * The same kernels with 8 lanes and 16 vector registers: a block of x rows x W rows keeps its
 * accumulators in registers, so fewer W rows share a pass when more x rows do (1 x 8, 2 x 4,
 * 3-4 x 2). Each (x row, W row) sum sees the same FMAs in the same order whatever the block,
 * so a row's result does not depend on the others in its step. */

/* 32 int8 codes -> 32 bf16 (widen_i8_bf16): via fp32, the high 16-bit word of each lane. */
static inline void widen32(const int8_t *src, uint16_t *dst) {
    for (int h = 0; h < 32; h += 16) {
        const __m128i q = _mm_loadu_si128((const __m128i *)(src + h));
        const __m256i a = _mm256_castps_si256(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
        const __m256i b = _mm256_castps_si256(
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))));
        /* packus keeps each 128-bit lane's order: a's words then b's, per lane; permute fixes */
        const __m256i p = _mm256_packus_epi32(_mm256_srli_epi32(a, 16), _mm256_srli_epi32(b, 16));
        _mm256_storeu_si256((__m256i *)(dst + h), _mm256_permute4x64_epi64(p, 0xD8));
    }
}

static inline __m256 load8_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* R rows of x against NB W rows. The K % 8 tail goes through zero-padded copies (AVX2 has
 * no byte/word masked loads), so any K works and nothing past a row's end is read. */
#define DEFINE_BLOCK8(SUF, WT, LOAD, R, NB)                                                   \
    static inline void block_##SUF##_##R##_##NB(const float *x, int64_t k, const WT *w,      \
                                               float out[R][NB]) {                            \
        const int64_t k8 = k & ~(int64_t)7;                                                   \
        __m256 acc[R][NB];                                                                     \
        for (int r = 0; r < R; r++)                                                            \
            for (int j = 0; j < NB; j++) acc[r][j] = _mm256_setzero_ps();                      \
        for (int64_t i = 0; i < k8; i += 8) {                                                  \
            __m256 xv[R];                                                                      \
            for (int r = 0; r < R; r++) xv[r] = _mm256_loadu_ps(x + r * k + i);                \
            for (int j = 0; j < NB; j++) {                                                     \
                const __m256 wv = LOAD(w + j * k + i);                                         \
                for (int r = 0; r < R; r++) acc[r][j] = _mm256_fmadd_ps(xv[r], wv, acc[r][j]); \
            }                                                                                  \
        }                                                                                      \
        if (k8 < k) {                                                                          \
            __m256 xv[R];                                                                      \
            for (int r = 0; r < R; r++) {                                                      \
                float xt[8] = {0};                                                             \
                memcpy(xt, x + r * k + k8, sizeof(float) * (size_t)(k - k8));                  \
                xv[r] = _mm256_loadu_ps(xt);                                                   \
            }                                                                                  \
            for (int j = 0; j < NB; j++) {                                                     \
                WT wt[8] = {0};                                                                \
                memcpy(wt, w + j * k + k8, sizeof(WT) * (size_t)(k - k8));                     \
                const __m256 wv = LOAD(wt);                                                    \
                for (int r = 0; r < R; r++) acc[r][j] = _mm256_fmadd_ps(xv[r], wv, acc[r][j]); \
            }                                                                                  \
        }                                                                                      \
        for (int r = 0; r < R; r++)                                                            \
            for (int j = 0; j < NB; j++) out[r][j] = hsum8(acc[r][j]);                         \
    }

#define DEFINE_BLOCKS8(SUF, WT, LOAD)                                                          \
    DEFINE_BLOCK8(SUF, WT, LOAD, 1, 8) DEFINE_BLOCK8(SUF, WT, LOAD, 2, 4)                      \
    DEFINE_BLOCK8(SUF, WT, LOAD, 3, 2) DEFINE_BLOCK8(SUF, WT, LOAD, 4, 2)                      \
    DEFINE_BLOCK8(SUF, WT, LOAD, 1, 1) DEFINE_BLOCK8(SUF, WT, LOAD, 2, 1)                      \
    DEFINE_BLOCK8(SUF, WT, LOAD, 3, 1) DEFINE_BLOCK8(SUF, WT, LOAD, 4, 1)

/* W rows [n0, n0 + nw) in passes of NB for x rows [r0, r0 + R), scaled and biased. */
#define PASSES8(SUF, R, NB, nw)                                                                \
    for (int64_t n0 = nb0; n0 < nb0 + (nw); n0 += NB) {                                       \
        float o_[R][NB];                                                                       \
        block_##SUF##_##R##_##NB(x + r0 * k, k, w + n0 * k, o_);                               \
        for (int r = 0; r < R; r++)                                                            \
            for (int j = 0; j < NB; j++) {                                                     \
                float s_ = o_[r][j];                                                           \
                if (scale) s_ *= scale[n0 + j];                                                \
                if (bias) s_ += bias[n0 + j];                                                  \
                y[(r0 + r) * n + n0 + j] = s_;                                                 \
            }                                                                                  \
    }

/* Blocks of 8 W rows split between threads; each is used for every row of x, up to 4 x rows
 * a pass, so a step streams W from memory once. A single x row (decode) reads rows of up to
 * SHORT_ROW bytes one after another: 8 side-by-side streams of 1,152-byte bf16 rows ran at
 * 7-9 GB/s from memory, one after another at 11-12 (2 threads); longer rows gain nothing (fp32
 * rows of 6 KB lost), so they stay side by side. Per (x row, W row) both take the same FMAs
 * in the same order. */
#define SHORT_ROW 2048
#define DEFINE_GEMV8(NAME, SUF, WT)                                                            \
    void NAME(const float *x, int64_t rows, int64_t k, const WT *w, int64_t n,                \
              const float *scale, const float *bias, float *y, int threads) {                  \
        const int64_t nblocks = (n + 7) / 8;                                                   \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                       \
        for (int64_t b = 0; b < nblocks; b++) {                                                \
            const int64_t nb0 = b * 8, nw = n - nb0 < 8 ? n - nb0 : 8;                          \
            for (int64_t r0 = 0; r0 < rows; r0 += 4) {                                         \
                const int64_t rr = rows - r0 < 4 ? rows - r0 : 4;                               \
                if (nw == 8) {                                                                 \
                    switch (rr) {                                                              \
                    case 1:                                                                    \
                        if (k * (int64_t)sizeof(WT) <= SHORT_ROW) {                            \
                            PASSES8(SUF, 1, 1, 8) /* row after row: one stream */              \
                        } else {                                                               \
                            PASSES8(SUF, 1, 8, 8)                                              \
                        }                                                                      \
                        break;                                                                 \
                    case 2: PASSES8(SUF, 2, 4, 8) break;                                       \
                    case 3: PASSES8(SUF, 3, 2, 8) break;                                       \
                    default: PASSES8(SUF, 4, 2, 8) break;                                      \
                    }                                                                          \
                } else {                                                                       \
                    switch (rr) {                                                              \
                    case 1: PASSES8(SUF, 1, 1, nw) break;                                      \
                    case 2: PASSES8(SUF, 2, 1, nw) break;                                      \
                    case 3: PASSES8(SUF, 3, 1, nw) break;                                      \
                    default: PASSES8(SUF, 4, 1, nw) break;                                     \
                    }                                                                          \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }

/* bf16 weights: widening costs little, so with one accumulator a lone W row (decode reads
 * short rows one after another) waited on each FMA's latency: 4 cycles per 8 weights, about 4
 * bytes a cycle, half the memory's pace on 2 cores. Each (x row, W row) sum is therefore kept
 * as SPLIT partial sums over interleaved 8-wide chunks (chunk c into part c % SPLIT, in
 * increasing order), added as (p0 + p1) + (p2 + p3). A lone row runs the parts side by side;
 * blocks of several rows run them one after another (the block's rows stay in L1, so memory
 * is still read once), which keeps their registers as they were and gives the same bits. */
#define SPLIT 4
/* A lone row also prefetches its weights this many elements (2 KB) ahead: decode reads the
 * short rows of a block one after another, and without it the hardware prefetcher left the
 * 30 layers' products at 15.4 GB/s (2 threads, from memory) against 20.5 with it (512-4,096
 * elements ahead: 19.6-20.5). */
#define BF16_AHEAD 1024

/* x and W chunk ch of R x rows and NB W rows (zero-padded past k) into acc. */
#define CHUNK8(WT, LOAD, R, NB, ch, acc)                                                       \
    do {                                                                                       \
        const int64_t i_ = (ch) * 8;                                                           \
        __m256 xv_[R];                                                                         \
        for (int r = 0; r < R; r++) {                                                          \
            if (i_ + 8 <= k) {                                                                 \
                xv_[r] = _mm256_loadu_ps(x + r * k + i_);                                      \
            } else {                                                                           \
                float xt_[8] = {0};                                                            \
                memcpy(xt_, x + r * k + i_, sizeof(float) * (size_t)(k - i_));                 \
                xv_[r] = _mm256_loadu_ps(xt_);                                                 \
            }                                                                                  \
        }                                                                                      \
        for (int j = 0; j < NB; j++) {                                                         \
            __m256 wv_;                                                                        \
            if (i_ + 8 <= k) {                                                                 \
                wv_ = LOAD(w + j * k + i_);                                                    \
            } else {                                                                           \
                WT wt_[8] = {0};                                                               \
                memcpy(wt_, w + j * k + i_, sizeof(WT) * (size_t)(k - i_));                    \
                wv_ = LOAD(wt_);                                                               \
            }                                                                                  \
            for (int r = 0; r < R; r++) acc[r][j] = _mm256_fmadd_ps(xv_[r], wv_, acc[r][j]);   \
        }                                                                                      \
    } while (0)

/* Chunk i of x and W (zero-padded past k), an 8-wide product added to acc. */
static inline __m256 chunk8_bf16(const float *x, const uint16_t *w, int64_t k, int64_t i,
                                 __m256 acc) {
    if (i + 8 <= k) return _mm256_fmadd_ps(_mm256_loadu_ps(x + i), load8_bf16(w + i), acc);
    float xt[8] = {0};
    uint16_t wt[8] = {0};
    memcpy(xt, x + i, sizeof(float) * (size_t)(k - i));
    memcpy(wt, w + i, sizeof(uint16_t) * (size_t)(k - i));
    return _mm256_fmadd_ps(_mm256_loadu_ps(xt), load8_bf16(wt), acc);
}

/* One x row against one W row: part[c] holds chunks c, c + SPLIT, ... in order. */
static inline void lone_row_bf16(const float *x, int64_t k, const uint16_t *w, __m256 *part) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = 0;
    for (; i + 8 * SPLIT <= k; i += 8 * SPLIT) {
        _mm_prefetch((const char *)(w + i + BF16_AHEAD), _MM_HINT_T0);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), load8_bf16(w + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), load8_bf16(w + i + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 16), load8_bf16(w + i + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 24), load8_bf16(w + i + 24), a3);
    }
    if (i < k) a0 = chunk8_bf16(x, w, k, i, a0); /* up to SPLIT chunks remain, the last partial */
    if (i + 8 < k) a1 = chunk8_bf16(x, w, k, i + 8, a1);
    if (i + 16 < k) a2 = chunk8_bf16(x, w, k, i + 16, a2);
    if (i + 24 < k) a3 = chunk8_bf16(x, w, k, i + 24, a3);
    part[0] = a0, part[1] = a1, part[2] = a2, part[3] = a3;
}

/* The split blocks (bf16 only: a lone row takes lone_row_bf16). */
#define DEFINE_BLOCK8S(SUF, WT, LOAD, R, NB)                                                   \
    static inline void block_##SUF##_##R##_##NB(const float *x, int64_t k, const WT *w,      \
                                               float out[R][NB]) {                            \
        const int64_t nc = (k + 7) / 8;                                                        \
        __m256 part[SPLIT][R][NB];                                                             \
        for (int c = 0; c < SPLIT; c++)                                                        \
            for (int r = 0; r < R; r++)                                                        \
                for (int j = 0; j < NB; j++) part[c][r][j] = _mm256_setzero_ps();              \
        if (R * NB == 1) { /* a lone row: the SPLIT chains side by side */                     \
            lone_row_bf16(x, k, (const uint16_t *)w, (__m256 *)part);                          \
        } else {                                                                               \
            for (int c = 0; c < SPLIT; c++) {                                                  \
                __m256 acc[R][NB];                                                             \
                for (int r = 0; r < R; r++)                                                    \
                    for (int j = 0; j < NB; j++) acc[r][j] = _mm256_setzero_ps();              \
                for (int64_t ch = c; ch < nc; ch += SPLIT) CHUNK8(WT, LOAD, R, NB, ch, acc);   \
                for (int r = 0; r < R; r++)                                                    \
                    for (int j = 0; j < NB; j++) part[c][r][j] = acc[r][j];                    \
            }                                                                                  \
        }                                                                                      \
        for (int r = 0; r < R; r++)                                                            \
            for (int j = 0; j < NB; j++)                                                       \
                out[r][j] = hsum8(_mm256_add_ps(_mm256_add_ps(part[0][r][j], part[1][r][j]),   \
                                                _mm256_add_ps(part[2][r][j], part[3][r][j]))); \
    }

#define DEFINE_BLOCKS8S(SUF, WT, LOAD)                                                         \
    DEFINE_BLOCK8S(SUF, WT, LOAD, 1, 8) DEFINE_BLOCK8S(SUF, WT, LOAD, 2, 4)                    \
    DEFINE_BLOCK8S(SUF, WT, LOAD, 3, 2) DEFINE_BLOCK8S(SUF, WT, LOAD, 4, 2)                    \
    DEFINE_BLOCK8S(SUF, WT, LOAD, 1, 1) DEFINE_BLOCK8S(SUF, WT, LOAD, 2, 1)                    \
    DEFINE_BLOCK8S(SUF, WT, LOAD, 3, 1) DEFINE_BLOCK8S(SUF, WT, LOAD, 4, 1)

DEFINE_BLOCKS8(f32, float, load8_f32)
DEFINE_BLOCKS8S(bf16, uint16_t, load8_bf16)
DEFINE_BLOCKS8(i8, int8_t, load8_i8)

DEFINE_GEMV8(gemv_f32, f32, float)
DEFINE_GEMV8(gemv_bf16, bf16, uint16_t)
DEFINE_GEMV8(gemv_i8, i8, int8_t)

/* int8 weights x int8 activations, the activations rounded per 64-element block exactly as
 * the AVX-512 kernel rounds them. vpmaddubsw multiplies unsigned by signed bytes into 16-bit
 * pair sums, so |x| goes in as the unsigned side and w takes x's sign (vpsignb): each pair
 * is at most 2 * 127 * 127 < 2^15, never saturating, as long as w stays in [-127, 127] (what
 * quantize_int8 makes). vpmaddwd by ones widens the pairs to 32 bits; the block's integer
 * dot product is exact, then scaled by the block's activation scale into fp32. */
static inline __m256i dot64_i8(__m256i ax0, __m256i x0, __m256i ax1, __m256i x1,
                               const int8_t *w) {
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i w0 = _mm256_loadu_si256((const __m256i *)w);
    const __m256i w1 = _mm256_loadu_si256((const __m256i *)(w + 32));
    const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(ax0, _mm256_sign_epi8(w0, x0)), ones);
    const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(ax1, _mm256_sign_epi8(w1, x1)), ones);
    return _mm256_add_epi32(p0, p1);
}

/* The 64 weights of block b of each of the nn W rows: in place, or (a partial last block)
 * copied zero-padded, so nothing past a row's end is read. Rows j >= nn repeat row 0 (their
 * sums are computed and dropped). */
static inline void q8_weight_block(const int8_t *w, int64_t k, int64_t lo, int64_t nn,
                                   int8_t pad[4][QB], const int8_t *wb[4]) {
    for (int j = 0; j < 4; j++) {
        const int64_t jj = j < nn ? j : 0;
        if (k - lo >= QB) {
            wb[j] = w + jj * k + lo;
        } else {
            memset(pad[j], 0, QB);
            memcpy(pad[j], w + jj * k + lo, (size_t)(k - lo));
            wb[j] = pad[j];
        }
    }
}

#define DEFINE_Q8_BLOCK(R)                                                                     \
    static inline void q8_block_##R(const int8_t *xq, const float *sx, int64_t nb, int64_t k, \
                                    const int8_t *w, int64_t nn, float out[R][4]) {            \
        __m256 acc[R][4];                                                                      \
        int8_t pad[4][QB];                                                                     \
        for (int r = 0; r < R; r++)                                                            \
            for (int j = 0; j < 4; j++) acc[r][j] = _mm256_setzero_ps();                       \
        for (int64_t b = 0; b < nb; b++) {                                                     \
            const int8_t *wb[4];                                                               \
            q8_weight_block(w, k, b * QB, nn, pad, wb);                                        \
            for (int j = 0; j < 4; j++) /* the same block of the rows Q8_AHEAD groups on */    \
                _mm_prefetch((const char *)(w + (j + 4 * Q8_AHEAD) * k + b * QB), _MM_HINT_T0); \
            for (int r = 0; r < R; r++) {                                                      \
                const int8_t *xb = xq + (r * nb + b) * QB;                                     \
                const __m256i x0 = _mm256_loadu_si256((const __m256i *)xb);                    \
                const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xb + 32));             \
                const __m256i ax0 = _mm256_abs_epi8(x0), ax1 = _mm256_abs_epi8(x1);            \
                const __m256 s = _mm256_set1_ps(sx[r * nb + b]);                               \
                for (int j = 0; j < 4; j++) {                                                  \
                    const __m256i d = dot64_i8(ax0, x0, ax1, x1, wb[j]);                       \
                    acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), s, acc[r][j]);          \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        for (int r = 0; r < R; r++)                                                            \
            for (int j = 0; j < 4; j++) out[r][j] = hsum8(acc[r][j]);                          \
    }

/* One x row (decode): the 4 W rows one after another rather than side by side, so the group
 * is read as one sequential stream (576-byte rows side by side were 4 streams too short for
 * the hardware prefetcher). Each (x row, W row) sum takes the same operations in the same
 * order as in q8_block_2..4, so a row's result does not depend on its step's other rows. */
static inline void q8_block_1(const int8_t *xq, const float *sx, int64_t nb, int64_t k,
                              const int8_t *w, int64_t nn, float out[1][4]) {
    int8_t pad[QB];
    for (int j = 0; j < 4; j++) {
        if (j >= nn) {
            out[0][j] = 0.f;
            continue;
        }
        __m256 acc = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const int64_t lo = b * QB;
            const int8_t *wb = w + j * k + lo;
            _mm_prefetch((const char *)(wb + Q8_AHEAD * 4 * k), _MM_HINT_T0);
            if (k - lo < QB) {
                memset(pad, 0, QB);
                memcpy(pad, wb, (size_t)(k - lo));
                wb = pad;
            }
            const int8_t *xb = xq + b * QB;
            const __m256i x0 = _mm256_loadu_si256((const __m256i *)xb);
            const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xb + 32));
            const __m256i d = dot64_i8(_mm256_abs_epi8(x0), x0, _mm256_abs_epi8(x1), x1, wb);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(sx[b]), acc);
        }
        out[0][j] = hsum8(acc);
    }
}
DEFINE_Q8_BLOCK(2)
DEFINE_Q8_BLOCK(3)
DEFINE_Q8_BLOCK(4)

void gemv_q8(const float *x, int64_t rows, int64_t k, const int8_t *w, int64_t n,
             const float *scale, const float *bias, float *y, int threads) {
    const int64_t nb = (k + QB - 1) / QB;
    int8_t *xq = malloc((size_t)(rows * nb * QB));
    float *sx = malloc(sizeof(float) * (size_t)(rows * nb));
    if (xq && sx) {
        q8_quantize_rows(x, rows, k, xq, sx, NULL);
        DOT_PRODUCT_LOOP(q8_block, xq + r0 * nb * QB, (const float *)NULL, sx + r0 * nb, nb, k)
    }
    free(xq);
    free(sx);
}

/* No bf16 dot-product instruction here: the products of bf16 weights and activations (x holds
 * bf16 values) are exact in fp32, so the widening kernel computes the same products. */
void gemv_bf16dp(const float *x, int64_t rows, int64_t k, const uint16_t *w, int64_t n,
                 const float *scale, const float *bias, float *y, int threads) {
    gemv_bf16(x, rows, k, w, n, scale, bias, y, threads);
}

#endif

/* int8 weight codes -> bf16 (exact: |q| <= 127 needs 7 significant bits), for the int8
 * weights' bf16 products above the decode kernels' rows (kernels/linear.py). PyTorch's own
 * int8 -> bf16 copy of the embedded model's 30 layers took 28.6 ms, this loop 8.5 ms into
 * cache-sized tiles (2 threads, one-off timings). The codes stream from memory once,
 * prefetched ahead, into a destination the caller keeps in cache. */
#define WIDEN_AHEAD 1024
void widen_i8_bf16(const int8_t *src, uint16_t *dst, int64_t count, int threads) {
    const int64_t chunk = 16384, chunks = (count + chunk - 1) / chunk;
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t lo = c * chunk, hi = count - lo < chunk ? count : lo + chunk;
        int64_t i = lo;
        for (; i + 32 <= hi; i += 32) {
            if ((i & 63) == 0) _mm_prefetch((const char *)(src + i + WIDEN_AHEAD), _MM_HINT_T0);
            widen32(src + i, dst + i);
        }
        for (; i < hi; i++) { /* the last codes of an odd count */
            const float f = (float)src[i];
            uint32_t bits;
            memcpy(&bits, &f, sizeof bits);
            dst[i] = (uint16_t)(bits >> 16);
        }
    }
}

/* Which implementation this library holds (build.isa() reads it). */
const char *kvstack_gemv_isa(void) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    return "avx512";
#else
    return "avx2";
#endif
}
