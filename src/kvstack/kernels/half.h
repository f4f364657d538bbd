/* IEEE float16 <-> float32 for scalars: F16C where the target has it, else exact C. */
#ifndef KVSTACK_HALF_H
#define KVSTACK_HALF_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

static inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    uint32_t u;
    if (e == 0x1f) {
        u = sign | 0x7f800000u | (m << 13); /* inf, nan */
    } else if (e) {
        u = sign | ((e + 112) << 23) | (m << 13);
    } else { /* zero, subnormal: m * 2^-24 */
        float f = (float)m * 5.9604644775390625e-8f;
        memcpy(&u, &f, 4);
        u |= sign;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

/* Rounded to nearest, ties to even (as PyTorch's .to(torch.float16)). */
static inline uint16_t f32_to_f16(float f) {
#if defined(__F16C__)
    return _cvtss_sh(f, 0); /* 0: round to nearest even */
#else
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
    u &= 0x7fffffffu;
    if (u > 0x7f800000u) return sign | 0x7e00;  /* nan */
    if (u >= 0x477ff000u) return sign | 0x7c00; /* >= 65520: rounds to inf */
    if (u < 0x38800000u) {                      /* below 2^-14: a subnormal, m * 2^-24 */
        float a;
        memcpy(&a, &u, 4);
        return sign | (uint16_t)nearbyintf(a * 16777216.0f);
    }
    u += 0xfffu + ((u >> 13) & 1u); /* drop 13 mantissa bits, ties to even */
    return sign | (uint16_t)((u - 0x38000000u) >> 13);
#endif
}
#endif
