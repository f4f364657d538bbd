/* Matrix-vector products straight on a GGUF file's quantized weight blocks (no dequantized
 * copy): y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]), W in the file's [out, in] row order,
 * each row a run of blocks of its ggml type: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (blocks of 32
 * weights) and Q4_K, Q6_K (super-blocks of 256). Plus their dequantization (for prefill-sized
 * steps and embedding rows), by the same decoders.
 *
 * Activations are rounded per block of 32 to int8 with their own scale (amax / 127, as
 * llama.cpp's Q8_0 -- finer than its Q8_K's 256 for the K-quants), so every product is an
 * integer dot product of 32 weights and 32 activations, done exactly in 32-bit integers, then
 * scaled in fp32. On AVX2 that is vpmaddubsw (unsigned x signed bytes -> 16-bit pair sums)
 * then vpmaddwd (-> 32 bits); elsewhere plain C with the same integer arithmetic.
 *
 * Every type is described by one decoder: weight sub-block b (32 weights) of a row ->
 *     w[i] = ws * m[i] * q[i] + wc,    i = 0..31,
 * q: int8 (signed types: q itself; unsigned types: 0..15 / 0..31), m[i]: 1, or Q6_K's
 * per-16 scale (m[0..15], m[16..31]), ws, wc: fp32 (wc only for the types with a min).
 * Then sum_i w[i] * x[i] = ws * dx * sum_i m[i] q[i] qx[i] + wc * dx * sum_i qx[i].
 *
 * Like gemv.c: output rows are split between OpenMP threads in groups of 4, each group used
 * for every x row (up to 8 a pass), so a step streams each weight block from memory once;
 * a row's result never depends on the other rows of its step, nor on the thread count.
 */
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "half.h"
#include "q8.h"

/* ggml type ids (GGMLQuantizationType). */
enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q6_K = 14 };

#define QK 32 /* weights per decoded sub-block and activations per int8 block */

/* Elements and bytes of one block of `type`; 0 if unsupported. */
static int64_t block_elems(int type) {
    switch (type) {
    case Q4_0: case Q4_1: case Q5_0: case Q5_1: case Q8_0: return 32;
    case Q4_K: case Q6_K: return 256;
    default: return 0;
    }
}

static int64_t block_bytes(int type) {
    switch (type) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q6_K: return 210;
    default: return 0;
    }
}

static inline float fp16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return f16_to_f32(h);
}

/* Q4_K's 8 pairs of 6-bit (scale, min), packed in 12 bytes:
 *   bytes 0..3:  scale j (j < 4) in bits 0..5; bits 6..7 are the top of scale j + 4
 *   bytes 4..7:  min j (j < 4) in bits 0..5;   bits 6..7 are the top of min j + 4
 *   bytes 8..11: low 4 bits of scale j + 4 | low 4 bits of min j + 4 << 4 */
static inline void q4k_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* ---- block layouts, scalar: sub-block b of a row -> q[32], m (per 16), ws, wc -------------
 * The reference for the vector decoders below and the dequantizer. Byte offsets within a
 * block; "nibbles" of 16 bytes q[0..15] = low nibbles, q[16..31] = high nibbles. */
typedef struct {
    int8_t q[QK];
    int16_t m[2]; /* multiplier of q[0..15] and of q[16..31] */
    float ws, wc;
} Sub;

static inline void nibbles(const uint8_t *qs, int8_t q[QK]) {
    for (int i = 0; i < 16; i++) {
        q[i] = (int8_t)(qs[i] & 0x0f);
        q[i + 16] = (int8_t)(qs[i] >> 4);
    }
}

static inline void fifth_bits(const uint8_t *qh, int8_t q[QK]) {
    uint32_t bits;
    memcpy(&bits, qh, 4);
    for (int i = 0; i < QK; i++) q[i] = (int8_t)(q[i] | (((bits >> i) & 1) << 4));
}

static void decode_scalar(int type, const uint8_t *row, int64_t b, Sub *s) {
    s->m[0] = s->m[1] = 1;
    s->ws = s->wc = 0.f;
    switch (type) {
    case Q4_0: { /* [0,2) d  [2,18) nibbles; w = d * (q - 8) */
        const uint8_t *blk = row + b * 18;
        nibbles(blk + 2, s->q);
        for (int i = 0; i < QK; i++) s->q[i] -= 8;
        s->ws = fp16(blk);
        break;
    }
    case Q4_1: { /* [0,2) d  [2,4) m  [4,20) nibbles; w = d * q + m */
        const uint8_t *blk = row + b * 20;
        nibbles(blk + 4, s->q);
        s->ws = fp16(blk);
        s->wc = fp16(blk + 2);
        break;
    }
    case Q5_0: { /* [0,2) d  [2,6) bit 4 of q[i] = bit i  [6,22) nibbles; w = d * (q - 16) */
        const uint8_t *blk = row + b * 22;
        nibbles(blk + 6, s->q);
        fifth_bits(blk + 2, s->q);
        for (int i = 0; i < QK; i++) s->q[i] -= 16;
        s->ws = fp16(blk);
        break;
    }
    case Q5_1: { /* [0,2) d  [2,4) m  [4,8) fifth bits  [8,24) nibbles; w = d * q + m */
        const uint8_t *blk = row + b * 24;
        nibbles(blk + 8, s->q);
        fifth_bits(blk + 4, s->q);
        s->ws = fp16(blk);
        s->wc = fp16(blk + 2);
        break;
    }
    case Q8_0: { /* [0,2) d  [2,34) int8 q; w = d * q */
        const uint8_t *blk = row + b * 34;
        memcpy(s->q, blk + 2, QK);
        s->ws = fp16(blk);
        break;
    }
    case Q4_K: {
        /* 256 weights: [0,2) d  [2,4) dmin  [4,16) 6-bit scales/mins  [16,144) qs.
         * Sub-block j (32 weights) = the low (j even) or high (j odd) nibbles of
         * qs[32 (j / 2), 32 (j / 2) + 32); w = d * scale_j * q - dmin * min_j. */
        const uint8_t *blk = row + (b / 8) * 144;
        const int j = (int)(b % 8);
        const uint8_t *qs = blk + 16 + 32 * (j / 2);
        for (int i = 0; i < QK; i++) s->q[i] = (int8_t)(j & 1 ? qs[i] >> 4 : qs[i] & 0x0f);
        int sc, mn;
        q4k_scale_min(blk + 4, j, &sc, &mn);
        s->ws = fp16(blk) * (float)sc;
        s->wc = -fp16(blk + 2) * (float)mn;
        break;
    }
    case Q6_K: {
        /* 256 weights: [0,128) ql (4 low bits)  [128,192) qh (2 high bits)  [192,208) int8
         * scales, one per 16 weights  [208,210) d. Each half h (128 weights) uses ql[64h..],
         * qh[32h..], scales[8h..]; its sub-block c (0..3) is
         *     low bits:  c = 0: ql[l] & 15,  1: ql[32 + l] & 15,  2: ql[l] >> 4,  3: ql[32 + l] >> 4
         *     high bits: (qh[l] >> 2c) & 3,    l = 0..31,
         * q = (low | high << 4) - 32, scales 2c (l < 16) and 2c + 1; w = d * scale * q. */
        const uint8_t *blk = row + (b / 8) * 210;
        const int h = (int)(b % 8) / 4, c = (int)(b % 4);
        const uint8_t *ql = blk + 64 * h + 32 * (c & 1), *qh = blk + 128 + 32 * h;
        for (int l = 0; l < QK; l++) {
            const int lo = c >= 2 ? ql[l] >> 4 : ql[l] & 0x0f, hi = (qh[l] >> (2 * c)) & 3;
            s->q[l] = (int8_t)((lo | hi << 4) - 32);
        }
        const int8_t *sc = (const int8_t *)(blk + 192 + 8 * h + 2 * c);
        s->m[0] = sc[0];
        s->m[1] = sc[1];
        s->ws = fp16(blk + 208);
        break;
    }
    }
}

/* ---- activations: rows of x -> int8 blocks of 32 ------------------------------------------ */

/* xq[r, b, 0..31] = round(x / dx[r, b]) (to nearest, ties to even: q8.h's block rounding,
 * as the int8 weights' activations), dx = amax / 127 (1 for an all-zero block); sx[r, b] = dx
 * * sum of the block's xq (for the mins and offsets). K is a multiple of 32. Shared with
 * gguf_x8.c. */
void gguf_quantize_x(const float *x, int64_t rows, int64_t k, int8_t *xq, float *dx,
                     float *sx) {
    const int64_t nb = k / QK;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < nb; b++) {
            const float *v = x + r * k + b * QK;
            int8_t *q = xq + (r * nb + b) * QK;
            float d;
            const int32_t sum = q8_round_block(v, QK, q, &d);
            dx[r * nb + b] = d;
            sx[r * nb + b] = d * (float)sum;
        }
}

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
/* ---- AVX2 + F16C + FMA ---------------------------------------------------------------------
 * Four W rows at a time, super-block by super-block (a K-quant's 256 weights, or one legacy
 * block): first the scales of the 4 rows for the whole super-block, as fp32 vectors (lane j
 * = row j), then for each sub-block of 32 the quants of the 4 rows:
 *   `a`, the unsigned operand of vpmaddubsw: q for the types stored unsigned -- Q4_0 and
 *        Q5_0 too, as q + 8 / q + 16 with the offset folded into wc -- and |q| for Q8_0 and
 *        Q6_K, whose sign then moves onto x (vpsignb with `q`).
 * Pair sums stay within 16 bits: a <= 128 (Q8_0's -128 included), |x| <= 127, so at most
 * 2 * 128 * 127 < 2^15. vpmaddwd by ones widens them; after `sum4`, the low 128-bit half
 * holds each row's sum over weights 0..15 and the high half over 16..31, so a per-16 scale
 * (Q6_K's) is just a different fp32 scale per half. */
typedef struct {
    __m256i a, q;
} Vec;

#define SIGNED(T) ((T) == Q8_0 || (T) == Q6_K)
#define OFFSET(T) (!SIGNED(T)) /* wc != 0: a min, or Q4_0 / Q5_0's folded offset */
#define SUBS(T) ((T) == Q4_K || (T) == Q6_K ? 8 : 1) /* sub-blocks of 32 per super-block */

static inline __m256i low_high_nibbles(const uint8_t *qs) { /* 16 bytes -> 32 nibbles */
    const __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
}

/* 32 bits -> 32 bytes, byte i = 0x10 where bit i is set (Q5's fifth bit). */
static inline __m256i fifth_bit_bytes(const uint8_t *qh) {
    uint32_t bits;
    memcpy(&bits, qh, 4);
    /* Byte i takes byte i / 8 of the word (vpshufb works within 128-bit lanes; every lane
     * holds the whole word), then keeps bit i % 8. */
    const __m256i pick = _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL,
                                            0x0303030303030303LL);
    const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), pick);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
    return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

static inline void signed_q(Vec *v, __m256i q) {
    v->q = q;
    v->a = _mm256_abs_epi8(q);
}

/* Sub-block g of super-block sb of a row -> its operands. */
static inline void quants(int type, const uint8_t *row, int64_t sb, int g, Vec *v) {
    switch (type) {
    case Q4_0: v->a = low_high_nibbles(row + sb * 18 + 2); break; /* q + 8 */
    case Q4_1: v->a = low_high_nibbles(row + sb * 20 + 4); break;
    case Q5_0: { /* q + 16 */
        const uint8_t *blk = row + sb * 22;
        v->a = _mm256_or_si256(low_high_nibbles(blk + 6), fifth_bit_bytes(blk + 2));
        break;
    }
    case Q5_1: {
        const uint8_t *blk = row + sb * 24;
        v->a = _mm256_or_si256(low_high_nibbles(blk + 8), fifth_bit_bytes(blk + 4));
        break;
    }
    case Q8_0: signed_q(v, _mm256_loadu_si256((const __m256i *)(row + sb * 34 + 2))); break;
    case Q4_K: {
        __m256i raw = _mm256_loadu_si256((const __m256i *)(row + sb * 144 + 16 + 32 * (g / 2)));
        if (g & 1) raw = _mm256_srli_epi16(raw, 4);
        v->a = _mm256_and_si256(raw, _mm256_set1_epi8(0x0f));
        break;
    }
    case Q6_K: {
        const uint8_t *blk = row + sb * 210;
        const int h = g / 4, c = g % 4;
        __m256i lo = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32 * (c & 1)));
        if (c >= 2) lo = _mm256_srli_epi16(lo, 4);
        lo = _mm256_and_si256(lo, _mm256_set1_epi8(0x0f));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
        /* (qh >> 2c) & 3, moved to bits 4..5; 16-bit shifts, masked per byte */
        const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * c)),
                                            _mm256_set1_epi8(3));
        signed_q(v, _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)),
                                    _mm256_set1_epi8(32)));
        break;
    }
    }
}

/* The fp16 at byte `at` of super-block sb of each of the 4 rows, as fp32 (lane j = row j). */
static inline __m128 fp16x4(const uint8_t *const rows[4], int64_t bytes, int64_t sb, int at) {
    uint16_t h[4];
    for (int j = 0; j < 4; j++) memcpy(h + j, rows[j] + sb * bytes + at, 2);
    return _mm_cvtph_ps(_mm_setr_epi16((short)h[0], (short)h[1], (short)h[2], (short)h[3], 0,
                                       0, 0, 0));
}

/* Q4_K's 12 scale bytes (see q4k_scale_min) -> its 8 scales and 8 mins, a byte each. */
static inline void q4k_unpack(const uint8_t *s, uint64_t *sc, uint64_t *mn) {
    uint32_t w0, w1, w2;
    memcpy(&w0, s, 4);
    memcpy(&w1, s + 4, 4);
    memcpy(&w2, s + 8, 4);
    const uint32_t six = 0x3f3f3f3f, four = 0x0f0f0f0f, two = 0x03030303;
    const uint32_t sc_hi = (w2 & four) | (((w0 >> 6) & two) << 4);
    const uint32_t mn_hi = ((w2 >> 4) & four) | (((w1 >> 6) & two) << 4);
    *sc = (w0 & six) | (uint64_t)sc_hi << 32;
    *mn = (w1 & six) | (uint64_t)mn_hi << 32;
}

/* 4 rows of 16 bytes -> 4 vectors, vector i holding bytes 4i..4i+3 of every row as
 * [byte 4i of rows 0..3, byte 4i+1 of rows 0..3, ...]: interleave bytes of rows 0/1 and
 * 2/3, then 16-bit pairs of those. */
static inline void transpose_bytes(__m128i r0, __m128i r1, __m128i r2, __m128i r3,
                                   __m128i out[4]) {
    const __m128i r01lo = _mm_unpacklo_epi8(r0, r1), r01hi = _mm_unpackhi_epi8(r0, r1);
    const __m128i r23lo = _mm_unpacklo_epi8(r2, r3), r23hi = _mm_unpackhi_epi8(r2, r3);
    out[0] = _mm_unpacklo_epi16(r01lo, r23lo);
    out[1] = _mm_unpackhi_epi16(r01lo, r23lo);
    out[2] = _mm_unpacklo_epi16(r01hi, r23hi);
    out[3] = _mm_unpackhi_epi16(r01hi, r23hi);
}

/* Byte i (0..15) of the 4 rows transposed above, as fp32 (lane j = row j). */
#define BYTE_PS(t, i, CVT) _mm_cvtepi32_ps(CVT(_mm_srli_si128((t)[(i) / 4], 4 * ((i) % 4))))

static inline __m128i load8(const uint64_t v) { return _mm_cvtsi64_si128((long long)v); }

/* Super-block sb of the 4 rows -> for each of its sub-blocks g, ws[g] (lanes 0..3: rows
 * 0..3's scale of weights 0..15; lanes 4..7: of weights 16..31) and wc[g], such that
 * w = ws * a + wc for a as `quants` gives it: the scalar decoder's values, with Q4_0 / Q5_0's
 * q + 8 / q + 16 offset folded into wc. */
static inline void scales(int type, const uint8_t *const rows[4], int64_t sb, __m256 ws[8],
                          __m128 wc[8]) {
    const int64_t bytes = block_bytes(type);
    const __m128 d = fp16x4(rows, bytes, sb, type == Q6_K ? 208 : 0);
    const __m256 dd = _mm256_set_m128(d, d);
    switch (type) {
    case Q4_0: ws[0] = dd; wc[0] = _mm_mul_ps(d, _mm_set1_ps(-8.f)); break;
    case Q5_0: ws[0] = dd; wc[0] = _mm_mul_ps(d, _mm_set1_ps(-16.f)); break;
    case Q4_1: case Q5_1: ws[0] = dd; wc[0] = fp16x4(rows, bytes, sb, 2); break;
    case Q8_0: ws[0] = dd; wc[0] = _mm_setzero_ps(); break;
    case Q4_K: {
        const __m128 dmin = _mm_sub_ps(_mm_setzero_ps(), fp16x4(rows, bytes, sb, 2));
        uint64_t sc[4], mn[4];
        for (int j = 0; j < 4; j++) q4k_unpack(rows[j] + sb * 144 + 4, sc + j, mn + j);
        /* scales in bytes 0..7, mins in bytes 8..15 of each row */
        __m128i t[4];
        transpose_bytes(_mm_unpacklo_epi64(load8(sc[0]), load8(mn[0])),
                        _mm_unpacklo_epi64(load8(sc[1]), load8(mn[1])),
                        _mm_unpacklo_epi64(load8(sc[2]), load8(mn[2])),
                        _mm_unpacklo_epi64(load8(sc[3]), load8(mn[3])), t);
#define Q4K_SUB(g)                                                                             \
    {                                                                                          \
        const __m128 s_ = _mm_mul_ps(d, BYTE_PS(t, g, _mm_cvtepu8_epi32));                     \
        ws[g] = _mm256_set_m128(s_, s_);                                                       \
        wc[g] = _mm_mul_ps(dmin, BYTE_PS(t, (g) + 8, _mm_cvtepu8_epi32));                      \
    }
        Q4K_SUB(0) Q4K_SUB(1) Q4K_SUB(2) Q4K_SUB(3) Q4K_SUB(4) Q4K_SUB(5) Q4K_SUB(6) Q4K_SUB(7)
#undef Q4K_SUB
        break;
    }
    case Q6_K: {
        /* 16 int8 scales a row, scale 2g for weights 0..15 of sub-block g, 2g + 1 for 16..31 */
        __m128i t[4], s16[4];
        for (int j = 0; j < 4; j++)
            s16[j] = _mm_loadu_si128((const __m128i *)(rows[j] + sb * 210 + 192));
        transpose_bytes(s16[0], s16[1], s16[2], s16[3], t);
#define Q6K_SUB(g)                                                                             \
    {                                                                                          \
        ws[g] = _mm256_set_m128(_mm_mul_ps(d, BYTE_PS(t, 2 * (g) + 1, _mm_cvtepi8_epi32)),     \
                                _mm_mul_ps(d, BYTE_PS(t, 2 * (g), _mm_cvtepi8_epi32)));         \
        wc[g] = _mm_setzero_ps();                                                              \
    }
        Q6K_SUB(0) Q6K_SUB(1) Q6K_SUB(2) Q6K_SUB(3) Q6K_SUB(4) Q6K_SUB(5) Q6K_SUB(6) Q6K_SUB(7)
#undef Q6K_SUB
        break;
    }
    }
}

/* Four int32x8 vectors -> one whose lane j of each 128-bit half is the sum of p[j]'s four
 * lanes in that half:
 *   t01 = [p0_0+p0_2, p1_0+p1_2, p0_1+p0_3, p1_1+p1_3]  (unpack 32-bit lo/hi, add)
 *   t23 = the same for p2, p3
 *   out = [p0, p1, p2, p3]                               (unpack 64-bit lo/hi, add) */
static inline __m256i sum4(__m256i p0, __m256i p1, __m256i p2, __m256i p3) {
    const __m256i t01 = _mm256_add_epi32(_mm256_unpacklo_epi32(p0, p1),
                                         _mm256_unpackhi_epi32(p0, p1));
    const __m256i t23 = _mm256_add_epi32(_mm256_unpacklo_epi32(p2, p3),
                                         _mm256_unpackhi_epi32(p2, p3));
    return _mm256_add_epi32(_mm256_unpacklo_epi64(t01, t23), _mm256_unpackhi_epi64(t01, t23));
}

/* The bytes of the 4 W rows this far ahead are prefetched, a cache line at a time: the
 * K-quants read a super-block's scales (Q6_K: at its end) before its quants, and that jump
 * within the stream left the hardware prefetcher behind. */
#define PREFETCH 1024

static inline void prefetch_rows(const uint8_t *const rows[4], int64_t from, int64_t to) {
    for (int64_t at = (from + PREFETCH + 63) & ~(int64_t)63; at < to + PREFETCH; at += 64)
        for (int j = 0; j < 4; j++) _mm_prefetch((const char *)rows[j] + at, _MM_HINT_T0);
}

/* R x rows against 4 W rows (nn of them real; the others repeat row 0 and are dropped).
 * One fp32 accumulator per x row holds all 4 W rows (lanes j and j + 4), so 8 x rows a pass
 * fit the registers (measured: 8-row steps 0-35% faster than two passes of 4, the K-quants
 * most, as their scales are decoded once instead of twice). */
#define DEFINE_DOT(T, R)                                                                       \
    static void dot_##T##_##R(const int8_t *xq, const float *dx, const float *sx, int64_t nb,  \
                              const uint8_t *w, int64_t row_bytes, int64_t nn,                \
                              float out[8][4]) {                                              \
        const __m256i ones = _mm256_set1_epi16(1);                                             \
        const uint8_t *rows[4];                                                                \
        for (int j = 0; j < 4; j++) rows[j] = w + (j < nn ? j : 0) * row_bytes;                \
        __m256 acc[R];                                                                         \
        __m128 off[R];                                                                         \
        for (int r = 0; r < R; r++) {                                                          \
            acc[r] = _mm256_setzero_ps();                                                      \
            off[r] = _mm_setzero_ps();                                                         \
        }                                                                                      \
        for (int64_t sb = 0; sb < nb / SUBS(T); sb++) {                                        \
            __m256 ws[8];                                                                      \
            __m128 wc[8];                                                                      \
            prefetch_rows(rows, sb * block_bytes(T), (sb + 1) * block_bytes(T));               \
            scales(T, rows, sb, ws, wc);                                                       \
            for (int g = 0; g < SUBS(T); g++) {                                                \
                const int64_t b = sb * SUBS(T) + g;                                            \
                Vec v[4];                                                                      \
                for (int j = 0; j < 4; j++) quants(T, rows[j], sb, g, v + j);                  \
                for (int r = 0; r < R; r++) {                                                  \
                    const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + (r * nb + b) * QK)); \
                    __m256i p[4];                                                              \
                    for (int j = 0; j < 4; j++) {                                              \
                        const __m256i xs = SIGNED(T) ? _mm256_sign_epi8(x, v[j].q) : x;        \
                        p[j] = _mm256_madd_epi16(_mm256_maddubs_epi16(v[j].a, xs), ones);      \
                    }                                                                          \
                    const __m256 s = _mm256_mul_ps(ws[g], _mm256_set1_ps(dx[r * nb + b]));     \
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum4(p[0], p[1], p[2], p[3])), \
                                             s, acc[r]);                                       \
                    if (OFFSET(T))                                                             \
                        off[r] = _mm_fmadd_ps(wc[g], _mm_set1_ps(sx[r * nb + b]), off[r]);     \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        for (int r = 0; r < R; r++) {                                                          \
            const __m128 y = _mm_add_ps(_mm_add_ps(_mm256_castps256_ps128(acc[r]),             \
                                                   _mm256_extractf128_ps(acc[r], 1)), off[r]); \
            _mm_storeu_ps(out[r], y);                                                          \
        }                                                                                      \
    }

/* 32 bytes as int8 (SIGNED) or uint8 -> 4 x 8 fp32, w = ws * q + wc with ws_lo for weights
 * 0..15 and ws_hi for 16..31. */
static inline void dequant32(__m256i q, int is_signed, float ws_lo, float ws_hi, float wc,
                             float *o) {
    const __m128i h[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
    const __m256 c = _mm256_set1_ps(wc);
    for (int i = 0; i < 4; i++) {
        const __m128i part = i & 1 ? _mm_srli_si128(h[i / 2], 8) : h[i / 2];
        const __m256i v = is_signed ? _mm256_cvtepi8_epi32(part) : _mm256_cvtepu8_epi32(part);
        const __m256 s = _mm256_set1_ps(i < 2 ? ws_lo : ws_hi);
        _mm256_storeu_ps(o + 8 * i, _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), s, c));
    }
}

/* Rows rows[0..3] -> out[0..3] (k fp32 each; nn of them real), by the same decoding as the
 * products, so both see the same weights. */
#define DEFINE_DEQUANT(T)                                                                      \
    static void dequant_##T(const uint8_t *const rows[4], int64_t nb, int64_t nn,              \
                            float *const out[4]) {                                            \
        for (int64_t sb = 0; sb < nb / SUBS(T); sb++) {                                        \
            __m256 ws[8];                                                                      \
            __m128 wc[8];                                                                      \
            scales(T, rows, sb, ws, wc);                                                       \
            for (int g = 0; g < SUBS(T); g++) {                                                \
                float wsv[8], wcv[4];                                                          \
                _mm256_storeu_ps(wsv, ws[g]);                                                  \
                _mm_storeu_ps(wcv, wc[g]);                                                     \
                for (int j = 0; j < nn; j++) {                                                 \
                    Vec v;                                                                     \
                    quants(T, rows[j], sb, g, &v);                                             \
                    dequant32(SIGNED(T) ? v.q : v.a, SIGNED(T), wsv[j], wsv[4 + j], wcv[j],    \
                              out[j] + (sb * SUBS(T) + g) * QK);                               \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }

DEFINE_DEQUANT(Q4_0)
DEFINE_DEQUANT(Q4_1)
DEFINE_DEQUANT(Q5_0)
DEFINE_DEQUANT(Q5_1)
DEFINE_DEQUANT(Q8_0)
DEFINE_DEQUANT(Q4_K)
DEFINE_DEQUANT(Q6_K)

static void dequant4(int type, const uint8_t *const rows[4], int64_t nb, int64_t nn,
                     float *const out[4]) {
    switch (type) {
    case Q4_0: dequant_Q4_0(rows, nb, nn, out); break;
    case Q4_1: dequant_Q4_1(rows, nb, nn, out); break;
    case Q5_0: dequant_Q5_0(rows, nb, nn, out); break;
    case Q5_1: dequant_Q5_1(rows, nb, nn, out); break;
    case Q8_0: dequant_Q8_0(rows, nb, nn, out); break;
    case Q4_K: dequant_Q4_K(rows, nb, nn, out); break;
    case Q6_K: dequant_Q6_K(rows, nb, nn, out); break;
    }
}

#else
/* ---- portable C: the same integer dot products, one weight at a time ---------------------- */
#define HAS_MIN(T) ((T) == Q4_1 || (T) == Q5_1 || (T) == Q4_K)
#define DEFINE_DOT(T, R)                                                                       \
    static void dot_##T##_##R(const int8_t *xq, const float *dx, const float *sx, int64_t nb,  \
                              const uint8_t *w, int64_t row_bytes, int64_t nn,                \
                              float out[8][4]) {                                              \
        for (int r = 0; r < R; r++)                                                            \
            for (int j = 0; j < 4; j++) out[r][j] = 0.f;                                       \
        for (int64_t b = 0; b < nb; b++)                                                       \
            for (int j = 0; j < nn; j++) {                                                     \
                Sub s;                                                                         \
                decode_scalar(T, w + j * row_bytes, b, &s);                                    \
                for (int r = 0; r < R; r++) {                                                  \
                    const int8_t *x = xq + (r * nb + b) * QK;                                  \
                    int32_t lo = 0, hi = 0;                                                    \
                    for (int i = 0; i < 16; i++) {                                             \
                        lo += s.q[i] * x[i];                                                   \
                        hi += s.q[i + 16] * x[i + 16];                                         \
                    }                                                                          \
                    out[r][j] += s.ws * dx[r * nb + b] * (float)(s.m[0] * lo + s.m[1] * hi);   \
                    if (HAS_MIN(T)) out[r][j] += s.wc * sx[r * nb + b];                        \
                }                                                                              \
            }                                                                                  \
    }

static void dequant4(int type, const uint8_t *const rows[4], int64_t nb, int64_t nn,
                     float *const out[4]) {
    for (int j = 0; j < nn; j++)
        for (int64_t b = 0; b < nb; b++) {
            Sub s;
            decode_scalar(type, rows[j], b, &s);
            for (int l = 0; l < QK; l++)
                out[j][b * QK + l] = s.ws * (float)(s.m[l / 16] * s.q[l]) + s.wc;
        }
}
#endif

#define DEFINE_DOTS(T) DEFINE_DOT(T, 1) DEFINE_DOT(T, 2) DEFINE_DOT(T, 3) DEFINE_DOT(T, 4) DEFINE_DOT(T, 5) DEFINE_DOT(T, 6) DEFINE_DOT(T, 7) DEFINE_DOT(T, 8)
DEFINE_DOTS(Q4_0)
DEFINE_DOTS(Q4_1)
DEFINE_DOTS(Q5_0)
DEFINE_DOTS(Q5_1)
DEFINE_DOTS(Q8_0)
DEFINE_DOTS(Q4_K)
DEFINE_DOTS(Q6_K)

typedef void (*dot_fn)(const int8_t *, const float *, const float *, int64_t, const uint8_t *,
                       int64_t, int64_t, float[8][4]);

#define DOTS_OF(T) {dot_##T##_1, dot_##T##_2, dot_##T##_3, dot_##T##_4, dot_##T##_5, dot_##T##_6, dot_##T##_7, dot_##T##_8}

static const dot_fn *dots(int type) {
    static const dot_fn q4_0[8] = DOTS_OF(Q4_0), q4_1[8] = DOTS_OF(Q4_1),
                        q5_0[8] = DOTS_OF(Q5_0), q5_1[8] = DOTS_OF(Q5_1),
                        q8_0[8] = DOTS_OF(Q8_0), q4_k[8] = DOTS_OF(Q4_K),
                        q6_k[8] = DOTS_OF(Q6_K);
    switch (type) {
    case Q4_0: return q4_0;
    case Q4_1: return q4_1;
    case Q5_0: return q5_0;
    case Q5_1: return q5_1;
    case Q8_0: return q8_0;
    case Q4_K: return q4_k;
    case Q6_K: return q6_k;
    default: return NULL;
    }
}

/* ---- exported ------------------------------------------------------------------------------ */

/* Elements per block of a ggml type this file runs, 0 if it does not; *bytes: its size. */
int64_t gguf_block_size(int type, int64_t *bytes) {
    if (bytes) *bytes = block_bytes(type);
    return block_elems(type);
}

/* y[rows, n] = x[rows, k] @ W.T (+ bias), W: n rows of k / block elements blocks of `type`.
 * Returns 0; -1 for a type it does not run or k not a whole number of blocks; -2 without
 * memory for the quantized activations. */
int gguf_gemv(int type, const float *x, int64_t rows, int64_t k, const uint8_t *w, int64_t n,
              const float *bias, float *y, int threads) {
    const int64_t elems = block_elems(type);
    const dot_fn *fn = dots(type);
    if (!fn || k <= 0 || k % elems) return -1;
    const int64_t nb = k / QK, row_bytes = k / elems * block_bytes(type);
    int8_t *xq = malloc((size_t)(rows * k));
    float *dx = malloc(sizeof(float) * (size_t)(rows * nb));
    float *sx = malloc(sizeof(float) * (size_t)(rows * nb));
    const int ok = xq && dx && sx;
    if (ok) {
        gguf_quantize_x(x, rows, k, xq, dx, sx);
        const int64_t groups = (n + 3) / 4;
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t n0 = g * 4, nn = n - n0 < 4 ? n - n0 : 4;
            for (int64_t r0 = 0; r0 < rows; r0 += 8) {
                const int64_t rr = rows - r0 < 8 ? rows - r0 : 8;
                float out[8][4];
                fn[rr - 1](xq + r0 * k, dx + r0 * nb, sx + r0 * nb, nb, w + n0 * row_bytes,
                           row_bytes, nn, out);
                for (int64_t r = 0; r < rr; r++)
                    for (int64_t j = 0; j < nn; j++)
                        y[(r0 + r) * n + n0 + j] = out[r][j] + (bias ? bias[n0 + j] : 0.f);
            }
        }
    }
    free(xq);
    free(dx);
    free(sx);
    return ok ? 0 : -2;
}

/* out[i, :] = row ids[i] of W as fp32 (ids NULL: rows 0..count-1), k weights a row; 4 rows
 * at a time, split between threads. Returns 0, or -1 as gguf_gemv. */
int gguf_dequantize(int type, const uint8_t *w, int64_t k, const int64_t *ids, int64_t count,
                    float *out, int threads) {
    const int64_t elems = block_elems(type);
    if (!elems || !dots(type) || k <= 0 || k % elems) return -1;
    const int64_t nb = k / QK, row_bytes = k / elems * block_bytes(type);
    const int64_t groups = (count + 3) / 4;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t i0 = g * 4, nn = count - i0 < 4 ? count - i0 : 4;
        const uint8_t *rows[4];
        float *outs[4];
        for (int64_t j = 0; j < 4; j++) {
            const int64_t i = i0 + (j < nn ? j : 0);
            rows[j] = w + (ids ? ids[i] : i) * row_bytes;
            outs[j] = out + i * k;
        }
        dequant4(type, rows, nb, nn, outs);
    }
    return 0;
}

/* gguf_dequantize through the scalar decoder (one thread): the block layouts as written out
 * above, for tests to hold the vector decoders to. */
int gguf_dequantize_reference(int type, const uint8_t *w, int64_t k, const int64_t *ids,
                              int64_t count, float *out) {
    const int64_t elems = block_elems(type);
    if (!elems || !dots(type) || k <= 0 || k % elems) return -1;
    const int64_t nb = k / QK, row_bytes = k / elems * block_bytes(type);
    for (int64_t i = 0; i < count; i++)
        for (int64_t b = 0; b < nb; b++) {
            Sub s;
            decode_scalar(type, w + (ids ? ids[i] : i) * row_bytes, b, &s);
            for (int l = 0; l < QK; l++)
                out[i * k + b * QK + l] = s.ws * (float)(s.m[l / 16] * s.q[l]) + s.wc;
        }
    return 0;
}
