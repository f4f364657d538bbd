/* The int8 activations of the int8 x int8 kernels (gemv.c's gemv_q8, gemm_q8.c's gemm_q8),
 * shared so both quantize alike. */
#ifndef KVSTACK_Q8_H
#define KVSTACK_Q8_H
#include <math.h>
#include <stdint.h>

/* Each 64-element block of an activation row is rounded to int8 with its own scale,
 * amax / 127 (zero-padded to whole blocks). */
#define QB 64

/* corr (or NULL): per row, 128 * sum(x as rounded); see gemv_q8. */
static inline void q8_quantize_rows(const float *x, int64_t rows, int64_t k, int8_t *xq,
                                    float *sx, float *corr) {
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
        if (corr) corr[r] = 128.f * c;
    }
}

#endif
