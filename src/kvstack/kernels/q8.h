/* The int8 activations of the int8 x int8 kernels (gemv.c's gemv_q8, gemm_q8.c's gemm_q8;
 * gguf.c's blocks of 32 too), shared so all quantize alike. */
#ifndef KVSTACK_Q8_H
#define KVSTACK_Q8_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

/* Each 64-element block of an activation row is rounded to int8 with its own scale,
 * amax / 127 (zero-padded to whole blocks). */
#define QB 64

/* One block v[n] (n = 32 or 64: gguf.c's blocks and these) -> its codes; returns their sum,
 * *scale = amax / 127 (1 for an all-zero block). Vector code for what was a scalar loop of
 * lrintf calls here (a libm call per element, run before the product's threads start: about a
 * tenth of an int8 decode step on AVX2), with the same results: the max of |x| is exact in any
 * order, and cvtps rounds as lrintf does, in the current mode (to nearest, ties to even).
 * |x * inv| <= 127 (plus a rounding), so the saturating packs keep every code as it is. */
static inline int32_t q8_round_block(const float *v, int n, int8_t *dst, float *scale) {
#if !defined(__AVX2__) /* gguf.c's portable build (baseline x86-64) */
    float amax = 0.f;
    for (int i = 0; i < n; i++) {
        const float a = fabsf(v[i]);
        amax = a > amax ? a : amax;
    }
    const float s = amax > 0.f ? amax / 127.f : 1.f, inv = 1.f / s;
    int32_t sum = 0;
    for (int i = 0; i < n; i++) {
        dst[i] = (int8_t)lrintf(v[i] * inv);
        sum += dst[i];
    }
    *scale = s;
    return sum;
#else
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 f[QB / 8], m = _mm256_setzero_ps();
    for (int i = 0; i < n / 8; i++) {
        f[i] = _mm256_loadu_ps(v + 8 * i);
        m = _mm256_max_ps(_mm256_andnot_ps(sign, f[i]), m); /* a NaN lane keeps m, as a > m */
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    const float s = amax > 0.f ? amax / 127.f : 1.f;
    const __m256 inv = _mm256_set1_ps(1.f / s);
    __m256i total = _mm256_setzero_si256();
    for (int g = 0; g < n / 32; g++) {
        __m256i n[4];
        for (int i = 0; i < 4; i++) {
            n[i] = _mm256_cvtps_epi32(_mm256_mul_ps(f[4 * g + i], inv));
            total = _mm256_add_epi32(total, n[i]);
        }
        const __m256i w01 = _mm256_packs_epi32(n[0], n[1]), w23 = _mm256_packs_epi32(n[2], n[3]);
        /* packs interleave 128-bit lanes: put the 32 bytes back in order */
        const __m256i bytes = _mm256_permutevar8x32_epi32(
            _mm256_packs_epi16(w01, w23), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(dst + 32 * g), bytes);
    }
    __m128i u = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0x4e));
    u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0xb1));
    *scale = s;
    return _mm_cvtsi128_si32(u);
#endif
}

/* corr (or NULL): per row, 128 * sum(x as rounded); see gemv_q8. */
static inline void q8_quantize_rows(const float *x, int64_t rows, int64_t k, int8_t *xq,
                                    float *sx, float *corr) {
    const int64_t nb = (k + QB - 1) / QB;
    for (int64_t r = 0; r < rows; r++) {
        float c = 0.f;
        for (int64_t b = 0; b < nb; b++) {
            const int64_t lo = b * QB, len = k - lo < QB ? k - lo : QB;
            const float *v = x + r * k + lo;
            float pad[QB];
            if (len < QB) { /* the row's last, partial block */
                memset(pad, 0, sizeof pad);
                memcpy(pad, v, sizeof(float) * (size_t)len);
                v = pad;
            }
            const int32_t sum = q8_round_block(v, QB, xq + (r * nb + b) * QB, sx + r * nb + b);
            c += sx[r * nb + b] * (float)sum;
        }
        if (corr) corr[r] = 128.f * c;
    }
}

#endif
