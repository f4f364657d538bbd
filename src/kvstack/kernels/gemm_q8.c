/* int8 weights x int8 activations for steps of a few rows and more (AVX512-VNNI; AMX tiles
 * where the CPU has AMX-INT8): gemv.c's gemv_q8 hands its products here from
 * q8_gemm_rows() rows up, and kernels/linear.py keeps int8 steps on the C kernels up to 64
 * (VNNI) / 128 (AMX) rows.
 *
 * gemv_q8 computes each (x row, W row) sum as a dot product: 16 lanes of partial sums, reduced
 * across the lanes per 64-element block. That is compute-bound once a step has more than a
 * few rows (the embedded model's products at 32 rows: 51 ms, against 38 ms for PyTorch's
 * bf16 matmul over the widened codes). Here the lanes are output columns instead (an outer
 * product): a slab of 64 W rows is repacked, 64 columns of 4 consecutive codes side by side,
 * and each vpdpbusd adds 4 products to each of 16 columns for one broadcast 4-code group of an
 * x row: 30 ms. On AMX the tiles do the products (below): 13.5 ms.
 *
 * The numbers are gemv_q8's bit for bit: the activations are quantized alike (q8.h: each
 * 64-element block of a row to int8 with its own scale), each block's int32 sum is exact
 * whatever the order, and every path accumulates sum_b s_b * D_b with one fp32 FMA per block
 * in block order, then subtracts, scales and adds the bias in three roundings. So a row's
 * result never depends on how many rows share its step (tests/kernels/test_gemm_q8.py).
 */
#define _GNU_SOURCE /* syscall(), for the tile permission, under -std=c11 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "q8.h"

#if defined(__GNUC__) && (__GNUC__ >= 11 || defined(__clang__)) && defined(__linux__)
#define AMX_BUILD 1 /* the compiler knows the tile instructions */
#include <sys/syscall.h>
#include <unistd.h>
#else
#define AMX_BUILD 0
#endif

#define SLAB 64 /* W rows (output columns) per packed slab: 4 vectors of 16 */

#if defined(__AVX512F__) && defined(__AVX512BW__)

/* W rows n0..n0+SLAB-1 (those below n), codes kb*64 .. kb*64+63 (those below k) -> p[16][SLAB]
 * 4-code groups, flipped to unsigned (q ^ 0x80: vpdpbusd multiplies unsigned by signed bytes;
 * the caller subtracts 128 * sum(x)). Missing rows and codes past k are packed as 0x80 (a
 * zero weight). */
__attribute__((target("avx512f,avx512bw")))
static void pack_block(const int8_t *w, int64_t k, int64_t n, int64_t n0, int64_t kb,
                       int32_t *p) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const __m512i rows = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi32((int32_t)k));
    for (int g = 0; g < SLAB / 16; g++) {
        const int64_t first = n0 + g * 16;
        const int64_t have = n - first <= 0 ? 0 : (n - first < 16 ? n - first : 16);
        const __mmask16 m = have >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << have) - 1u);
        const int8_t *base = w + first * k + kb * QB;
        for (int q = 0; q < QB / 4; q++) {
            __m512i v = _mm512_setzero_si512();
            if (have > 0 && kb * QB + 4 * q < k)
                v = _mm512_mask_i32gather_epi32(v, m, rows, base + 4 * q, 1);
            _mm512_storeu_si512(p + q * SLAB + g * 16, _mm512_xor_si512(v, flip));
        }
    }
}

/* R x rows (R = 1..4) times one packed block: tot[r][SLAB] += sx[r] * (int32 block sums). */
__attribute__((target("avx512f,avx512bw,avx512vnni"), always_inline))
static inline void block_rows(const int32_t *p, const int8_t *xq, int64_t xstride,
                              const float *sx, int64_t sstride, int R, float *tot) {
    __m512i acc[4][SLAB / 16];
    for (int r = 0; r < 4; r++)
        for (int g = 0; g < SLAB / 16; g++) acc[r][g] = _mm512_setzero_si512();
    for (int q = 0; q < QB / 4; q++) {
        __m512i wv[SLAB / 16];
        for (int g = 0; g < SLAB / 16; g++) wv[g] = _mm512_loadu_si512(p + q * SLAB + g * 16);
        for (int r = 0; r < R; r++) {
            int32_t word;
            memcpy(&word, xq + r * xstride + 4 * q, 4);
            const __m512i xv = _mm512_set1_epi32(word);
            for (int g = 0; g < SLAB / 16; g++)
                acc[r][g] = _mm512_dpbusd_epi32(acc[r][g], wv[g], xv);
        }
    }
    for (int r = 0; r < R; r++) {
        const __m512 s = _mm512_set1_ps(sx[r * sstride]);
        for (int g = 0; g < SLAB / 16; g++) {
            float *t = tot + r * SLAB + g * 16;
            _mm512_storeu_ps(t, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][g]), s,
                                                _mm512_loadu_ps(t)));
        }
    }
}


/* ---- AMX (Intel's tile unit: 16 x 16 x 64 int8 products an instruction) --------------------
 * Where the CPU has AMX-INT8 the same products run on the tiles: C^T[n][m] = W[n][k] xq[m][k]
 * with W's rows loaded straight from the weight as A tiles (16 rows x one 64-code block, no
 * repacking) and the quantized x rows as B tiles (packed once per call, 4 codes of 16 rows per
 * tile row). Each block's int32 sums are stored and scaled into fp32 like the VNNI path's, so
 * the results are the same numbers up to fp32 rounding. The tile products cost almost
 * nothing here (3.1 T int8 products/s on one core): the step is bound by streaming W once. */
#if AMX_BUILD
#define AMX_N 32 /* W rows per group: two A tiles */

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Linux lends the tile registers' state to a process only on request (once; idempotent). */
static int amx_permitted(void) {
    static int state = 0; /* 0 unknown, 1 granted, -1 refused */
    if (state == 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                    18 /* XFEATURE_XTILEDATA */) == 0 ? 1 : -1;
    return state == 1;
}

/* x rows quantized (q8.h) -> B tiles xp[mg][kb][16 code groups][16 rows], their scales
 * sv[mg][kb][16] and 128 * their blocks' code sums xs[mg][kb][16] (rows past `rows`: zero).
 * The tiles multiply signed by signed; adding 128 * sum(x) to a block's sum gives the VNNI
 * path's sum over q + 128 exactly, so both round the same int32 and the same fp32 steps. */
static void amx_pack_x(const int8_t *xq, const float *sx, int64_t rows, int64_t nb,
                       int64_t groups, int32_t *xp, float *sv, int32_t *xs) {
    memset(xp, 0, sizeof(int32_t) * (size_t)(groups * nb * 256));
    memset(sv, 0, sizeof(float) * (size_t)(groups * nb * 16));
    memset(xs, 0, sizeof(int32_t) * (size_t)(groups * nb * 16));
    for (int64_t m = 0; m < rows; m++)
        for (int64_t kb = 0; kb < nb; kb++) {
            const int64_t g = m / 16, mm = m % 16, at = (g * nb + kb) * 16 + mm;
            const int8_t *codes = xq + m * nb * QB + kb * QB;
            int32_t *tile = xp + (g * nb + kb) * 256, sum = 0;
            for (int q = 0; q < QB / 4; q++) memcpy(tile + q * 16 + mm, codes + 4 * q, 4);
            for (int i = 0; i < QB; i++) sum += codes[i];
            sv[at] = sx[m * nb + kb];
            xs[at] = 128 * sum;
        }
}

/* One group of AMX_N W rows (a: the first, stride k) against every x row: tot[AMX_N][mp]. */
__attribute__((target("avx512f,avx512bw,amx-tile,amx-int8")))
static void amx_group(const int8_t *a, int64_t k, int64_t nb, const int8_t *next,
                      const int32_t *xp, const float *sv, const int32_t *xs, int64_t groups,
                      float *tot) {
    const int64_t mp = groups * 16;
    int32_t c[4][256];
    memset(tot, 0, sizeof(float) * (size_t)(AMX_N * mp));
    for (int64_t kb = 0; kb < nb; kb++) {
        if (next)  /* the next group's rows are 32 short streams: fetch them ahead */
            for (int i = 0; i < AMX_N; i++)
                _mm_prefetch((const char *)(next + i * k + kb * QB), _MM_HINT_T0);
        _tile_loadd(4, a + kb * QB, k);
        _tile_loadd(5, a + 16 * k + kb * QB, k);
        for (int64_t g = 0; g < groups; g += 2) {
            const int pair = g + 1 < groups;
            _tile_loadd(6, xp + (g * nb + kb) * 256, 64);
            _tile_zero(0);
            _tile_zero(2);
            _tile_dpbssd(0, 4, 6);
            _tile_dpbssd(2, 5, 6);
            _tile_stored(0, c[0], 64);
            _tile_stored(2, c[2], 64);
            if (pair) {
                _tile_loadd(7, xp + ((g + 1) * nb + kb) * 256, 64);
                _tile_zero(1);
                _tile_zero(3);
                _tile_dpbssd(1, 4, 7);
                _tile_dpbssd(3, 5, 7);
                _tile_stored(1, c[1], 64);
                _tile_stored(3, c[3], 64);
            }
            for (int t = 0; t < 4; t++) {
                const int half = t >> 1, col = t & 1;
                if (col && !pair) continue;
                const __m512 s = _mm512_loadu_ps(sv + ((g + col) * nb + kb) * 16);
                const __m512i off = _mm512_loadu_si512(xs + ((g + col) * nb + kb) * 16);
                for (int i = 0; i < 16; i++) {
                    float *dst = tot + (half * 16 + i) * mp + (g + col) * 16;
                    const __m512i sum = _mm512_add_epi32(_mm512_loadu_si512(c[t] + i * 16), off);
                    _mm512_storeu_ps(dst, _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), s,
                                                          _mm512_loadu_ps(dst)));
                }
            }
        }
    }
}

/* tot[j][m] (j < have, the group's W rows) -> y[m][n0 + j], less corr[m], scaled, biased: the
 * tile sums are W-row major, y is x-row major; 16 columns at a time gathered from the sums. */
__attribute__((target("avx512f,avx512bw")))
static void amx_store(const float *tot, int64_t mp, int64_t rows, int64_t n0, int64_t have,
                      int64_t n, const float *corr, const float *scale, const float *bias,
                      float *y) {
    const __m512i idx = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi32((int32_t)mp));
    for (int64_t j = 0; j < have; j += 16) {
        const int64_t cols = have - j < 16 ? have - j : 16;
        const __mmask16 m = cols == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << cols) - 1u);
        const __m512 sc = scale ? _mm512_maskz_loadu_ps(m, scale + n0 + j) : _mm512_set1_ps(1.f);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(m, bias + n0 + j) : _mm512_setzero_ps();
        for (int64_t r = 0; r < rows; r++) {
            const __m512 v = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, idx,
                                                      tot + j * mp + r, 4);
            /* three roundings, as gemv_q8's scalar tail: no FMA here */
            const __m512 t = _mm512_mul_ps(_mm512_sub_ps(v, _mm512_set1_ps(corr[r])), sc);
            _mm512_mask_storeu_ps(y + r * n + n0 + j, m, _mm512_add_ps(t, b));
        }
    }
}

__attribute__((target("avx512f,avx512bw,amx-tile,amx-int8")))
static int amx_gemm(const int8_t *xq, const float *sx, const float *corr, int64_t rows,
                    int64_t k, const int8_t *w, int64_t n, const float *scale,
                    const float *bias, float *y, int threads) {
    const int64_t nb = k / QB, groups = (rows + 15) / 16, mp = groups * 16;
    int32_t *xp = malloc(sizeof(int32_t) * (size_t)(groups * nb * 256));
    float *sv = malloc(sizeof(float) * (size_t)(groups * nb * 16));
    int32_t *xs = malloc(sizeof(int32_t) * (size_t)(groups * nb * 16));
    float *tots = malloc(sizeof(float) * (size_t)(threads * AMX_N * mp));
    int8_t *pads = calloc((size_t)threads, (size_t)(AMX_N * k));
    const int ok = xp && sv && xs && tots && pads;
    if (ok) {
        amx_pack_x(xq, sx, rows, nb, groups, xp, sv, xs);
        const int64_t ngroups = (n + AMX_N - 1) / AMX_N;
        _Pragma("omp parallel num_threads(threads)") {
            struct tile_config cfg = {.palette = 1};
            for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;
            _tile_loadconfig(&cfg); /* per thread, per call: other libraries retile too */
            const int me = omp_get_thread_num();
            float *tot = tots + (int64_t)me * AMX_N * mp;
            int8_t *pad = pads + (int64_t)me * AMX_N * k;
            _Pragma("omp for schedule(static)")
            for (int64_t gi = 0; gi < ngroups; gi++) {
                const int64_t n0 = gi * AMX_N, have = n - n0 < AMX_N ? n - n0 : AMX_N;
                const int8_t *a = w + n0 * k;
                if (have < AMX_N) { /* the last rows, zero-padded: never read past W */
                    memcpy(pad, a, (size_t)(have * k));
                    a = pad;
                }
                const int8_t *next = n0 + 2 * AMX_N <= n ? w + (n0 + AMX_N) * k : NULL;
                amx_group(a, k, nb, next, xp, sv, xs, groups, tot);
                amx_store(tot, mp, rows, n0, have, n, corr, scale, bias, y);
            }
            _tile_release();
        }
    }
    free(xp);
    free(sv);
    free(xs);
    free(tots);
    free(pads);
    return ok;
}
#endif

/* q8_quantize_rows (q8.h) for rows lo..hi-1, 16 lanes at a time: the same operations on the
 * same fp32 values (amax, amax / 127, its inverse, products rounded to nearest even), so the
 * same codes and scales bit for bit; rows split between the threads of the caller's region. */
__attribute__((target("avx512f,avx512bw")))
static void quantize_rows_avx512(const float *x, int64_t lo, int64_t hi, int64_t k, int8_t *xq,
                                 float *sx, float *corr) {
    const int64_t nb = (k + QB - 1) / QB;
    for (int64_t r = lo; r < hi; r++) {
        float c = 0.f;
        for (int64_t b = 0; b < nb; b++) {
            const int64_t first = b * QB, len = k - first < QB ? k - first : QB;
            __m512 v[QB / 16];
            __m512 amax = _mm512_setzero_ps();
            for (int i = 0; i < QB / 16; i++) {
                const int64_t left = len - 16 * i, have = left <= 0 ? 0 : (left < 16 ? left : 16);
                const __mmask16 m = have == 16 ? (__mmask16)0xFFFF
                                               : (__mmask16)((1u << have) - 1u);
                v[i] = _mm512_maskz_loadu_ps(m, x + r * k + first + 16 * i);
                amax = _mm512_max_ps(amax, _mm512_abs_ps(v[i]));
            }
            const float a = _mm512_reduce_max_ps(amax);
            const float sc = a > 0.f ? a / 127.f : 1.f, inv = 1.f / sc;
            __m512i sum = _mm512_setzero_si512();
            for (int i = 0; i < QB / 16; i++) {
                const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v[i], _mm512_set1_ps(inv)));
                sum = _mm512_add_epi32(sum, q);
                _mm_storeu_si128((__m128i *)(xq + (r * nb + b) * QB + 16 * i),
                                 _mm512_cvtsepi32_epi8(q));
            }
            sx[r * nb + b] = sc;
            c += sc * (float)_mm512_reduce_add_epi32(sum);
        }
        corr[r] = 128.f * c;
    }
}

/* The VNNI path: slabs of SLAB W rows split between threads, each packed a block at a time
 * and used by every x row. */
__attribute__((target("avx512f,avx512bw,avx512vnni")))
static int vnni_gemm(const int8_t *xq, const float *sx, const float *corr, int64_t rows,
                     int64_t k, const int8_t *w, int64_t n, const float *scale,
                     const float *bias, float *y, int threads) {
    const int64_t nb = (k + QB - 1) / QB, xstride = nb * QB;
    float *tots = malloc(sizeof(float) * (size_t)(threads * rows * SLAB));
    if (!tots) return 0;
    const int64_t slabs = (n + SLAB - 1) / SLAB;
    _Pragma("omp parallel num_threads(threads)") {
        int32_t p[QB / 4 * SLAB];
        float *tot = tots + (int64_t)omp_get_thread_num() * rows * SLAB;
        _Pragma("omp for schedule(static)")
        for (int64_t s = 0; s < slabs; s++) {
            const int64_t n0 = s * SLAB;
            memset(tot, 0, sizeof(float) * (size_t)(rows * SLAB));
            for (int64_t kb = 0; kb < nb; kb++) {
                pack_block(w, k, n, n0, kb, p);
                for (int64_t r0 = 0; r0 < rows; r0 += 4) {
                    const int64_t rr = rows - r0 < 4 ? rows - r0 : 4;
                    const int8_t *xr = xq + r0 * xstride + kb * QB;
                    const float *sr = sx + r0 * nb + kb;
                    float *tr = tot + r0 * SLAB;
                    switch (rr) {
                    case 1: block_rows(p, xr, xstride, sr, nb, 1, tr); break;
                    case 2: block_rows(p, xr, xstride, sr, nb, 2, tr); break;
                    case 3: block_rows(p, xr, xstride, sr, nb, 3, tr); break;
                    default: block_rows(p, xr, xstride, sr, nb, 4, tr); break;
                    }
                }
            }
            const int64_t have = n - n0 < SLAB ? n - n0 : SLAB;
            for (int64_t r = 0; r < rows; r++)
                for (int64_t j = 0; j < have; j++) {
                    float v = tot[r * SLAB + j] - corr[r];
                    if (scale) v *= scale[n0 + j];
                    if (bias) v += bias[n0 + j];
                    y[r * n + n0 + j] = v;
                }
        }
    }
    free(tots);
    return 1;
}

static int use_amx = 0;

/* Whether gemm_q8 runs on the tiles where it can (k whole 64-code blocks): Python turns it
 * on where the CPU has AMX-INT8 (build.py); on < 0 only asks. Returns whether it will (the
 * OS lends the tiles). */
int q8_use_amx(int on) {
#if AMX_BUILD
    if (on >= 0) use_amx = on && amx_permitted();
#else
    (void)on;
#endif
    return use_amx;
}

/* From this many rows gemv_q8 hands its products to gemm_q8 (the same numbers): measured
 * (Xeon, 2 threads, the embedded model's 30 layers and head) AMX 9.4 vs 10.2 ms at 2 rows,
 * the VNNI path 14.0 vs 14.6 at 4. */
int q8_gemm_rows(void) { return use_amx ? 2 : 4; }

/* y[rows, n] = x[rows, k] W[n, k]^T * scale[n] (+ bias[n]), x quantized as gemv_q8 does and
 * the same numbers as it gives. Returns 2 (ran on AMX), 1 (VNNI) or 0 (did not run: k % 4
 * != 0, out of memory, or an AVX2 build). */
__attribute__((target("avx512f,avx512bw,avx512vnni")))
int gemm_q8(const float *x, int64_t rows, int64_t k, const int8_t *w, int64_t n,
            const float *scale, const float *bias, float *y, int threads) {
    if (k % 4 != 0 || rows <= 0) return 0; /* a 4-code group must not straddle two W rows */
    const int64_t nb = (k + QB - 1) / QB;
    int8_t *xq = malloc((size_t)(rows * nb * QB));
    float *sx = malloc(sizeof(float) * (size_t)(rows * nb));
    float *corr = malloc(sizeof(float) * (size_t)rows);
    int ran = 0;
    if (xq && sx && corr) {
        const int64_t per = (rows + threads - 1) / threads;
        _Pragma("omp parallel for schedule(static) num_threads(threads)")
        for (int t = 0; t < threads; t++) {
            const int64_t lo = t * per, hi = lo + per < rows ? lo + per : rows;
            if (lo < hi) quantize_rows_avx512(x, lo, hi, k, xq, sx, corr);
        }
#if AMX_BUILD
        if (use_amx && k % QB == 0)
            ran = amx_gemm(xq, sx, corr, rows, k, w, n, scale, bias, y, threads) ? 2 : 0;
#endif
        if (!ran) ran = vnni_gemm(xq, sx, corr, rows, k, w, n, scale, bias, y, threads);
    }
    free(xq);
    free(sx);
    free(corr);
    return ran;
}

#else
/* AVX2 builds have no vpdpbusd: Python keeps gemv.c's kernels there (see linear.py). */
int gemm_q8(const float *x, int64_t rows, int64_t k, const int8_t *w, int64_t n,
            const float *scale, const float *bias, float *y, int threads) {
    (void)x, (void)rows, (void)k, (void)w, (void)n, (void)scale, (void)bias, (void)y;
    (void)threads;
    return 0;
}
int q8_use_amx(int on) { return (void)on, 0; }
int q8_gemm_rows(void) { return 1 << 30; }
#endif
