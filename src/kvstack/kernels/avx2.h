/* Small AVX2 helpers shared by the kernels (gemv.c, ops.c); nothing without AVX2. */
#ifndef KVSTACK_AVX2_H
#define KVSTACK_AVX2_H
#if defined(__AVX2__)
#include <immintrin.h>
#include <stdint.h>

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline __m256 load8_f32(const float *p) { return _mm256_loadu_ps(p); }

/* bf16 -> fp32 is a 16-bit shift into the high half of each 32-bit lane. */
static inline __m256 load8_bf16(const uint16_t *p) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif
#endif
