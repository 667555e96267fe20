/* GGUF's block-quantized weight formats as the q linears pack them (q_linear.c, and the bf16 one in
 * linear_avx512.c), and the 16-lane floats they widen them into.
 *
 * Weight-only quantized projections in GGUF's block formats: each output channel's inputs in blocks of QB = 32,
 * one float16 scale d per block (Q8: w = d * q, q int8) or a scale and a minimum (Q4: w = d * q + m, q in 0..15;
 * GGUF's Q4_0 is m = -8 d). The weights are packed at load (llmd_q_pack) in tiles of Q_NR = 32 channels; per tile
 * and block: the 32 channels' d (64 bytes), for Q4 their m (64 bytes), then per input the 32 channels' q (32
 * bytes, or 16 for Q4: byte j = channel j's q | channel j + 16's q << 4). A tile is one sequential stream of the
 * file's own bytes (Q4_1: 5 bits a weight), widened and scaled in registers: w is exactly the float32 value a
 * dequantizing loader computes (d * q is exact in float32; Q4 adds m in one rounding), so only the summation
 * order differs from x @ dequantized(w)^T. */
#ifndef LLMD_Q_FORMAT_H
#define LLMD_Q_FORMAT_H

#include "lanes.h"

#define QB 32
#define Q_NR 32
#define Q_MR 6
enum { Q_FMT_Q8 = 0, Q_FMT_Q4 = 1 };

static inline int64_t q_block_bytes(int fmt) { return fmt == Q_FMT_Q4 ? 2 * 64 + QB * 16 : 64 + QB * 32; }

static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    float f;
    if (exp == 0) f = ldexpf((float)man, -24); /* zero or subnormal */
    else if (exp == 31) {
        const uint32_t u = 0x7f800000u | (man << 13);
        memcpy(&f, &u, 4);
    } else f = ldexpf((float)(man | 0x400), (int)exp - 25);
    uint32_t u;
    memcpy(&u, &f, 4);
    u |= sign;
    memcpy(&f, &u, 4);
    return f;
}

/* x's int8 copy for the VNNI layout's kernels (q_linear.c, qv_linear_avx2.c), M rows of K: per row the quants, per
 * block a scale and the quants' sum, in one allocation (the returned pointer, for free; NULL if out of memory) */
static inline void *qv_inputs_alloc(int64_t M, int64_t K, int8_t **xq, float **dx, int32_t **xqsum) {
    const size_t scales = (size_t)(M * (K / QB));
    char *p = malloc(scales * (sizeof(float) + sizeof(int32_t)) + (size_t)(M * K));
    if (!p) return NULL;
    *dx = (float *)p;
    *xqsum = (int32_t *)(p + scales * sizeof(float));
    *xq = (int8_t *)(p + scales * (sizeof(float) + sizeof(int32_t)));
    return p;
}

/* rows of a tile's float32 sums (tmp, Q_NR per row) + bias -> y, the tile's `real` channels only */
static inline void q_store_row(const float *tmp, const float *bias, float *y, int real) {
    for (int c = 0; c < real; c++) y[c] = tmp[c] + (bias ? bias[c] : 0.0f);
}

/* 16 float lanes: one AVX-512 register, else two v8 */
#if defined(__AVX512F__)
typedef __m512 v16;
static inline v16 v16_zero(void) { return _mm512_setzero_ps(); }
static inline v16 v16_set1(float x) { return _mm512_set1_ps(x); }
static inline v16 v16_fma(v16 a, v16 b, v16 c) { return _mm512_fmadd_ps(a, b, c); }
static inline v16 v16_mul(v16 a, v16 b) { return _mm512_mul_ps(a, b); }
static inline void v16_store(float *p, v16 x) { _mm512_storeu_ps(p, x); }
static inline v16 v16_half(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline v16 v16_i8(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
/* 16 bytes -> their low nibbles (lo) and high nibbles (hi) as floats */
static inline void v16_u4(const uint8_t *p, v16 *lo, v16 *hi) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
    *hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}
#else
typedef struct {
    v8 lo, hi;
} v16;
static inline v16 v16_zero(void) { return (v16){v8_zero(), v8_zero()}; }
static inline v16 v16_set1(float x) { return (v16){v8_set1(x), v8_set1(x)}; }
static inline v16 v16_fma(v16 a, v16 b, v16 c) { return (v16){v8_fma(a.lo, b.lo, c.lo), v8_fma(a.hi, b.hi, c.hi)}; }
static inline v16 v16_mul(v16 a, v16 b) { return (v16){v8_mul(a.lo, b.lo), v8_mul(a.hi, b.hi)}; }
static inline void v16_store(float *p, v16 x) { v8_store(p, x.lo); v8_store(p + 8, x.hi); }
static inline v16 v16_half(const uint8_t *p) {
    float f[16];
    for (int i = 0; i < 16; i++) {
        uint16_t h;
        memcpy(&h, p + 2 * i, 2);
        f[i] = half_to_float(h);
    }
    return (v16){v8_load(f), v8_load(f + 8)};
}
static inline v16 v16_i8(const uint8_t *p) {
    return (v16){v8_load_i8((const int8_t *)p), v8_load_i8((const int8_t *)p + 8)};
}
static inline void v16_u4(const uint8_t *p, v16 *lo, v16 *hi) {
    float l[16], h[16];
    for (int i = 0; i < 16; i++) l[i] = (float)(p[i] & 15), h[i] = (float)(p[i] >> 4);
    *lo = (v16){v8_load(l), v8_load(l + 8)};
    *hi = (v16){v8_load(h), v8_load(h + 8)};
}
#endif

#endif
