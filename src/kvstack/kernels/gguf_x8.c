/* Decode products on GGUF weights repacked 8 rows at a time ("x8"), for Q4_0, Q4_1 and Q8_0.
 *
 * In the file's layout (gguf.c) a block's fp16 scale sits next to its quants, so a kernel
 * taking 4 rows at a time gathers 4 scalars per block into a vector and reduces each row's
 * products separately: on the embedded model's Q4_1 weights that bookkeeping outweighed the
 * dot products. The x8 layout stores, for every 8 rows and every block of 32 weights, the 8
 * scales (and mins) next to each other, then the 8 rows' quants:
 *     Q4_0:  d[8] (fp16)          quants of rows 0,4, 1,5, 2,6, 3,7 (16 bytes each)
 *     Q4_1:  d[8], m[8] (fp16)    quants as Q4_0
 *     Q8_0:  d[8] (fp16)          quants of rows 0..7 (32 bytes each)
 * so 8 rows x 32 weights take one fp16 -> fp32 conversion per field and a 3-level horizontal
 * add that leaves row j's sum in lane j. A group of 8 rows keeps the same bytes, in the same
 * place, as the 8 rows of the file; rows past the last whole group stay in the file's layout
 * and are packed into a zero-padded group per call. Packing and unpacking are byte moves.
 *
 * The arithmetic is gguf.c's: activations rounded per block of 32 to int8 (amax / 127), exact
 * integer dot products, then w = d * q + m (Q4_0: q - 8, Q8_0: signed q) scaled in fp32. The
 * fp32 sums run in another order than gguf.c's, so results agree to rounding, not bits; a
 * row's result depends only on its own x row and W row (not on its place in W, its step's
 * other rows or the thread count).
 */
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { X8_Q4_0 = 2, X8_Q4_1 = 3, X8_Q8_0 = 8 };

#define QK 32

/* gguf.c: activations rounded to int8 per block of 32, as its kernels take them. */
void gguf_quantize_x(const float *x, int64_t rows, int64_t k, int8_t *xq, float *dx,
                     float *sx);

/* Bytes of one block of a type this file runs; 0 for the others. */
static int64_t x8_block_bytes(int type) {
    switch (type) {
    case X8_Q4_0: return 18;
    case X8_Q4_1: return 20;
    case X8_Q8_0: return 34;
    default: return 0;
    }
}

/* Where row j's fields of a block go in its group's x8 block: field f of a file block
 * (bytes src[f] .. src[f] + size[f]) lands at dst[f] + size[f] * slot, slot = j for the
 * scales, and for 4-bit quants the pair order 0,4,1,5,2,6,3,7. Returns the field count. */
static int x8_fields(int type, int j, int64_t src[3], int64_t size[3], int64_t dst[3]) {
    const int pair_slot = (j % 4) * 2 + j / 4;
    switch (type) {
    case X8_Q4_0:
        src[0] = 0, size[0] = 2, dst[0] = 2 * j;
        src[1] = 2, size[1] = 16, dst[1] = 16 + 16 * pair_slot;
        return 2;
    case X8_Q4_1:
        src[0] = 0, size[0] = 2, dst[0] = 2 * j;
        src[1] = 2, size[1] = 2, dst[1] = 16 + 2 * j;
        src[2] = 4, size[2] = 16, dst[2] = 32 + 16 * pair_slot;
        return 3;
    case X8_Q8_0:
        src[0] = 0, size[0] = 2, dst[0] = 2 * j;
        src[1] = 2, size[1] = 32, dst[1] = 16 + 32 * j;
        return 2;
    default: return 0;
    }
}

/* Row `row` (of n; k weights) between the file's layout (`file`, its own row) and the x8
 * layout (`x8`, the whole tensor): to_x8 moves file -> x8, else x8 -> file. */
static void x8_move_row(int type, int64_t k, int64_t row, const uint8_t *from, uint8_t *to,
                        int to_x8) {
    const int64_t bb = x8_block_bytes(type), nb = k / QK, g = row / 8, j = row % 8;
    int64_t src[3], size[3], dst[3];
    const int fields = x8_fields(type, (int)j, src, size, dst);
    for (int64_t b = 0; b < nb; b++)
        for (int f = 0; f < fields; f++) {
            const int64_t file_at = b * bb + src[f], x8_at = (g * nb + b) * 8 * bb + dst[f];
            if (to_x8)
                memcpy(to + x8_at, from + file_at, (size_t)size[f]);
            else
                memcpy(to + file_at, from + x8_at, (size_t)size[f]);
        }
}

/* dst (n rows of k weights, row_bytes each) = src in the x8 layout: whole groups of 8 rows
 * repacked, the rest copied. Returns 0, or -1 for a type or k this file does not run. */
int gguf_x8_pack(int type, const uint8_t *src, int64_t n, int64_t k, uint8_t *dst) {
    const int64_t bb = x8_block_bytes(type);
    if (!bb || k <= 0 || k % QK) return -1;
    const int64_t row_bytes = k / QK * bb, n8 = n / 8 * 8;
    for (int64_t r = 0; r < n8; r++) x8_move_row(type, k, r, src + r * row_bytes, dst, 1);
    memcpy(dst + n8 * row_bytes, src + n8 * row_bytes, (size_t)((n - n8) * row_bytes));
    return 0;
}

/* out[i] = row ids[i] of an x8 tensor (n rows) in the file's layout (ids NULL: rows
 * 0..count-1). Returns 0, or -1 as gguf_x8_pack. */
int gguf_x8_unpack(int type, const uint8_t *w, int64_t n, int64_t k, const int64_t *ids,
                   int64_t count, uint8_t *out) {
    const int64_t bb = x8_block_bytes(type);
    if (!bb || k <= 0 || k % QK) return -1;
    const int64_t row_bytes = k / QK * bb, n8 = n / 8 * 8;
    for (int64_t i = 0; i < count; i++) {
        const int64_t r = ids ? ids[i] : i;
        if (r < n8)
            x8_move_row(type, k, r, w, out + i * row_bytes, 0);
        else
            memcpy(out + i * row_bytes, w + r * row_bytes, (size_t)row_bytes);
    }
    return 0;
}

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)

static inline __m256 fp16x8(const uint8_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

/* Int32 [rows a | rows b] partial sums of 4 pairs -> lane j = row j's sum (pair i holds rows
 * i and i + 4). */
static inline __m256i reduce_pairs(__m256i p0, __m256i p1, __m256i p2, __m256i p3) {
    return _mm256_hadd_epi32(_mm256_hadd_epi32(p0, p1), _mm256_hadd_epi32(p2, p3));
}

/* 8 rows of whole-row partial sums (8 lanes each) -> lane j = row j's sum. */
static inline __m256i reduce_rows(const __m256i p[8]) {
    const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]),
                                        _mm256_hadd_epi32(p[2], p[3]));
    const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]),
                                        _mm256_hadd_epi32(p[6], p[7]));
    /* a: [rows 0-3 over weights 0..15 | rows 0-3 over 16..31], b likewise for rows 4-7 */
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20),
                            _mm256_permute2x128_si256(a, b, 0x31));
}

/* Bytes ahead of the block in use that are prefetched (the group's next blocks, then the
 * next group's: a thread's groups are contiguous). */
#define X8_AHEAD 1536

/* R x rows against one group of 8 rows (nb blocks): out[r][j]. */
#define DEFINE_X8_DOT(T, R)                                                                    \
    static void x8_dot_##T##_##R(const int8_t *xq, const float *dx, const float *sx,          \
                                 int64_t nb, const uint8_t *g, float out[4][8]) {             \
        const int64_t bytes = 8 * x8_block_bytes(T);                                          \
        const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0f);               \
        __m256 acc[R], off[R];                                                                 \
        for (int r = 0; r < R; r++) acc[r] = off[r] = _mm256_setzero_ps();                     \
        for (int64_t b = 0; b < nb; b++) {                                                     \
            const uint8_t *blk = g + b * bytes;                                                \
            for (int64_t at = 0; at < bytes; at += 64)                                         \
                _mm_prefetch((const char *)blk + X8_AHEAD + at, _MM_HINT_T0);                  \
            const __m256 d = fp16x8(blk);                                                      \
            if (T == X8_Q8_0) {                                                                \
                __m256i a[8];                                                                  \
                for (int j = 0; j < 8; j++)                                                    \
                    a[j] = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * j));           \
                for (int r = 0; r < R; r++) {                                                  \
                    const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + (r * nb + b) * QK)); \
                    __m256i p[8];                                                              \
                    for (int j = 0; j < 8; j++)                                                \
                        p[j] = _mm256_madd_epi16(                                              \
                            _mm256_maddubs_epi16(_mm256_abs_epi8(a[j]),                        \
                                                 _mm256_sign_epi8(x, a[j])), ones);            \
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(reduce_rows(p)),               \
                                             _mm256_mul_ps(d, _mm256_set1_ps(dx[r * nb + b])), \
                                             acc[r]);                                          \
                }                                                                              \
            } else {                                                                           \
                const uint8_t *qs = blk + (T == X8_Q4_1 ? 32 : 16);                            \
                const __m256 m = T == X8_Q4_1 ? fp16x8(blk + 16)                               \
                                              : _mm256_mul_ps(d, _mm256_set1_ps(-8.f));        \
                __m256i lo[4], hi[4];                                                          \
                for (int i = 0; i < 4; i++) {                                                  \
                    const __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * i));    \
                    lo[i] = _mm256_and_si256(raw, low);                                        \
                    hi[i] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);                  \
                }                                                                              \
                for (int r = 0; r < R; r++) {                                                  \
                    const int8_t *xb = xq + (r * nb + b) * QK;                                 \
                    const __m256i xl = _mm256_broadcastsi128_si256(                            \
                        _mm_loadu_si128((const __m128i *)xb));                                 \
                    const __m256i xh = _mm256_broadcastsi128_si256(                            \
                        _mm_loadu_si128((const __m128i *)(xb + 16)));                          \
                    __m256i p[4];                                                              \
                    /* pair sums <= 2 * 15 * 127 each, two of them < 2^15 */                   \
                    for (int i = 0; i < 4; i++)                                                \
                        p[i] = _mm256_madd_epi16(                                              \
                            _mm256_add_epi16(_mm256_maddubs_epi16(lo[i], xl),                  \
                                             _mm256_maddubs_epi16(hi[i], xh)), ones);          \
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(reduce_pairs(p[0], p[1], p[2], p[3])), \
                                             _mm256_mul_ps(d, _mm256_set1_ps(dx[r * nb + b])), \
                                             acc[r]);                                          \
                    off[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(sx[r * nb + b]), off[r]);       \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        for (int r = 0; r < R; r++) _mm256_storeu_ps(out[r], _mm256_add_ps(acc[r], off[r]));   \
    }

#define DEFINE_X8_DOTS(T) DEFINE_X8_DOT(T, 1) DEFINE_X8_DOT(T, 2) DEFINE_X8_DOT(T, 3) DEFINE_X8_DOT(T, 4)
DEFINE_X8_DOTS(X8_Q4_0)
DEFINE_X8_DOTS(X8_Q4_1)
DEFINE_X8_DOTS(X8_Q8_0)

typedef void (*x8_fn)(const int8_t *, const float *, const float *, int64_t, const uint8_t *,
                      float[4][8]);
#define X8_OF(T) {x8_dot_##T##_1, x8_dot_##T##_2, x8_dot_##T##_3, x8_dot_##T##_4}

static const x8_fn *x8_dots(int type) {
    static const x8_fn q4_0[4] = X8_OF(X8_Q4_0), q4_1[4] = X8_OF(X8_Q4_1),
                       q8_0[4] = X8_OF(X8_Q8_0);
    switch (type) {
    case X8_Q4_0: return q4_0;
    case X8_Q4_1: return q4_1;
    case X8_Q8_0: return q8_0;
    default: return NULL;
    }
}

/* Whether this build runs the x8 layout for `type` (1) or not (0: keep the file's layout). */
int gguf_x8_supported(int type) { return x8_dots(type) != NULL; }

/* Group g's 8 rows (x8 layout at `grp`) against every x row: y[:, g * 8 + j] for j < nn. */
static void x8_group(const x8_fn *fn, const int8_t *xq, const float *dx, const float *sx,
                     int64_t rows, int64_t nb, const uint8_t *grp, int64_t g, int64_t nn,
                     int64_t n, const float *bias, float *y) {
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
        const int64_t rr = rows - r0 < 4 ? rows - r0 : 4;
        float out[4][8];
        fn[rr - 1](xq + r0 * nb * QK, dx + r0 * nb, sx + r0 * nb, nb, grp, out);
        for (int64_t r = 0; r < rr; r++)
            for (int64_t j = 0; j < nn; j++)
                y[(r0 + r) * n + g * 8 + j] = out[r][j] + (bias ? bias[g * 8 + j] : 0.f);
    }
}

/* y[rows, n] = x[rows, k] @ W.T (+ bias) with W's first n / 8 * 8 rows in the x8 layout and
 * the rest in the file's (those are packed into a zero-padded group per call, so every row
 * takes the same arithmetic wherever it sits). Returns 0, -1 (type or k), -2 (memory), as
 * gguf_gemv. */
int gguf_gemv_x8(int type, const float *x, int64_t rows, int64_t k, const uint8_t *w,
                 int64_t n, const float *bias, float *y, int threads) {
    const x8_fn *fn = x8_dots(type);
    if (!fn || k <= 0 || k % QK) return -1;
    const int64_t nb = k / QK, row_bytes = nb * x8_block_bytes(type), groups = n / 8;
    const int64_t tail = n - groups * 8;
    int8_t *xq = malloc((size_t)(rows * k));
    float *dx = malloc(sizeof(float) * (size_t)(rows * nb));
    float *sx = malloc(sizeof(float) * (size_t)(rows * nb));
    uint8_t *last = tail ? calloc(8, (size_t)row_bytes) : NULL; /* zero scales: rows of 0 */
    const int ok = xq && dx && sx && (!tail || last);
    if (ok) {
        gguf_quantize_x(x, rows, k, xq, dx, sx);
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t g = 0; g < groups; g++)
            x8_group(fn, xq, dx, sx, rows, nb, w + g * 8 * row_bytes, g, 8, n, bias, y);
        if (tail) {
            for (int64_t j = 0; j < tail; j++)
                x8_move_row(type, k, j, w + (groups * 8 + j) * row_bytes, last, 1);
            x8_group(fn, xq, dx, sx, rows, nb, last, groups, tail, n, bias, y);
        }
    }
    free(xq);
    free(dx);
    free(sx);
    free(last);
    return ok ? 0 : -2;
}

/* Several x8 weights of one type and shape [n, k], each times its own rows, in one parallel
 * region (a MoE step's chosen experts): x [total, k] holds expert e's rows at offsets[e] ..
 * offsets[e + 1] - 1, and y [total, n] gets x @ w[e].T there. Each row's arithmetic is
 * gguf_gemv_x8's, so the results are its bits. n must be a multiple of 8. 0, -1 or -2. */
int gguf_gemv_x8_many(int type, int64_t count, const float *x, const int64_t *offsets,
                      int64_t k, const uint8_t *const *w, int64_t n, float *y, int threads) {
    const x8_fn *fn = x8_dots(type);
    if (!fn || k <= 0 || k % QK || n % 8 || count <= 0) return -1;
    const int64_t nb = k / QK, row_bytes = nb * x8_block_bytes(type), groups = n / 8;
    const int64_t total = offsets[count];
    int8_t *xq = malloc((size_t)(total * k));
    float *dx = malloc(sizeof(float) * (size_t)(total * nb));
    float *sx = malloc(sizeof(float) * (size_t)(total * nb));
    const int ok = xq && dx && sx;
    if (ok) {
        gguf_quantize_x(x, total, k, xq, dx, sx);
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t i = 0; i < count * groups; i++) {
            const int64_t e = i / groups, g = i % groups, off = offsets[e];
            x8_group(fn, xq + off * k, dx + off * nb, sx + off * nb, offsets[e + 1] - off, nb,
                     w[e] + g * 8 * row_bytes, g, 8, n, NULL, y + off * n);
        }
    }
    free(xq);
    free(dx);
    free(sx);
    return ok ? 0 : -2;
}

int gguf_dequantize(int type, const uint8_t *w, int64_t k, const int64_t *ids, int64_t count,
                    float *out, int threads);

/* out [n, k] = every row of an x8 tensor as fp32 (prefill's temporary weight), straight from
 * the x8 layout; the same values as gguf_dequantize on the file's bytes (each weight is
 * d * q (+ m), and d * q is exact in fp32). Returns 0, or -1 as gguf_gemv_x8. */
int gguf_x8_dequantize(int type, const uint8_t *w, int64_t n, int64_t k, float *out,
                       int threads) {
    if (!x8_dots(type) || k <= 0 || k % QK) return -1;
    const int64_t bb = x8_block_bytes(type), nb = k / QK, groups = n / 8;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t g = 0; g < groups; g++)
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = w + (g * nb + b) * 8 * bb;
            float d[8], m[8];
            _mm256_storeu_ps(d, fp16x8(blk));
            _mm256_storeu_ps(m, type == X8_Q4_1 ? fp16x8(blk + 16) : _mm256_setzero_ps());
            for (int j = 0; j < 8; j++) {
                float *o = out + (g * 8 + j) * k + b * QK;
                if (type == X8_Q8_0) {
                    const int8_t *q = (const int8_t *)(blk + 16 + 32 * j);
                    for (int i = 0; i < QK; i++) o[i] = d[j] * (float)q[i];
                    continue;
                }
                const uint8_t *q = blk + (type == X8_Q4_1 ? 32 : 16) + 16 * ((j % 4) * 2 + j / 4);
                const int off = type == X8_Q4_0 ? 8 : 0;
                for (int i = 0; i < 16; i++) {
                    o[i] = d[j] * (float)((q[i] & 0x0f) - off) + m[j];
                    o[i + 16] = d[j] * (float)((q[i] >> 4) - off) + m[j];
                }
            }
        }
    if (n % 8)
        return gguf_dequantize(type, w + groups * 8 * nb * bb, k, NULL, n - groups * 8,
                               out + groups * 8 * k, threads);
    return 0;
}

#else

int gguf_x8_dequantize(int type, const uint8_t *w, int64_t n, int64_t k, float *out,
                       int threads) {
    (void)type, (void)w, (void)n, (void)k, (void)out, (void)threads;
    return -1;
}

int gguf_x8_supported(int type) {
    (void)type;
    return 0;
}

int gguf_gemv_x8(int type, const float *x, int64_t rows, int64_t k, const uint8_t *w,
                 int64_t n, const float *bias, float *y, int threads) {
    (void)type, (void)x, (void)rows, (void)k, (void)w, (void)n, (void)bias, (void)y;
    (void)threads;
    return -1;
}

int gguf_gemv_x8_many(int type, int64_t count, const float *x, const int64_t *offsets,
                      int64_t k, const uint8_t *const *w, int64_t n, float *y, int threads) {
    (void)type, (void)count, (void)x, (void)offsets, (void)k, (void)w, (void)n, (void)y;
    (void)threads;
    return -1;
}

#endif
