/* The matrix-vector products the one-call decode steps drive (ops.c's Llama step and
 * gemma_step.c's): the dense kernels of gemv.c and the GGUF block kernels of gguf.c and
 * gguf_x8.c, declared once for both. Each computes y[rows, n] = x[rows, k] W^T (+ bias). */
#ifndef KVSTACK_PRODUCTS_H
#define KVSTACK_PRODUCTS_H
#include <stdint.h>

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
/* gemm_q8.c: gemv_q8's products for steps of several rows (returns 0 where it did not run) */
int gemm_q8(const float *, int64_t, int64_t, const int8_t *, int64_t, const float *,
            const float *, float *, int);
int q8_gemm_rows(void);
int gguf_gemv(int type, const float *x, int64_t rows, int64_t k, const uint8_t *w, int64_t n,
              const float *bias, float *y, int threads);
int gguf_gemv_x8(int type, const float *x, int64_t rows, int64_t k, const uint8_t *w,
                 int64_t n, const float *bias, float *y, int threads);

#endif
