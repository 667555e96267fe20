/* float32 -> bfloat16 rounded to nearest even, as torch and vcvtneps2bf16 round (NaN stays a quiet NaN), for the
 * kernels without AVX-512 BF16's instruction: the bf16 norm and rotary ops (fused_ops.c), the AVX2 bf16 linear
 * (bf16_linear_avx2.c), the bf16 decode step's activations (decode_step.c) and the widening prefill attention
 * (prefill_attention_f32.c), the head screen's bf16 inputs (head_screen.c); and bf16 -> float32 rows for the
 * decode step and the prefill attention. */
#ifndef LLMD_BF16_LANES_H
#define LLMD_BF16_LANES_H
#include "lanes.h"

static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays a (quiet) NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
#if LLMD_AVX2
/* round to nearest even in integer lanes (a scalar loop here made the bf16 norm 3-4x slower than torch's at 32+
 * rows); NaN lanes keep their payload's top bits, made quiet */
static inline __m128i v8_to_bf16_bits(v8 x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
    return _mm256_castsi256_si128(packed);
}
static inline void v8_store_bf16(uint16_t *p, v8 x) { _mm_storeu_si128((__m128i *)p, v8_to_bf16_bits(x)); }
static inline v8 v8_round_bf16(v8 x) { /* to bf16 precision, kept in float32 */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v8_to_bf16_bits(x)), 16));
}
#else
static inline void v8_store_bf16(uint16_t *p, v8 x) {
    for (int i = 0; i < 8; i++) p[i] = bf16_round(x.x[i]);
}
static inline v8 v8_round_bf16(v8 x) {
    uint16_t h[8];
    v8_store_bf16(h, x);
    return v8_load_bf16(h);
}
#endif

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* n float32 -> bf16 */
static inline void f32_to_bf16_rows(const float *src, uint16_t *dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) v8_store_bf16(dst + i, v8_load(src + i));
    for (; i < n; i++) dst[i] = bf16_round(src[i]);
}

/* n bf16 -> float32 (exact) */
static inline void bf16_to_f32_rows(const uint16_t *src, float *dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) v8_store(dst + i, v8_load_bf16(src + i));
    for (; i < n; i++) dst[i] = bf16_to_f32(src[i]);
}

/* n float32 (a multiple of 16 where the CPU has AVX-512 BF16) -> bf16 as the decode attention rounds its bf16
 * output (decode_attention.c, for the bf16 decode step and layers): vcvtneps2bf16 there (denormals flushed),
 * f32_to_bf16_rows elsewhere */
static inline void f32_to_bf16_step(const float *src, uint16_t *dst, int64_t n) {
#if defined(__AVX512BF16__)
    for (int64_t i = 0; i < n; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
#else
    f32_to_bf16_rows(src, dst, n);
#endif
}
#endif
