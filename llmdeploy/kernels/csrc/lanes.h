/* Lanes of 8 floats for the kernels in this folder: AVX2 + FMA intrinsics where the compiler targets them, plain
 * loops otherwise (same results up to summation order). */
#ifndef LLMD_LANES_H
#define LLMD_LANES_H

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "row_chunk.h"
#include "unroll.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "avx2_exp.h"
#define LLMD_AVX2 1
typedef __m256 v8;
static inline v8 v8_load(const float *p) { return _mm256_loadu_ps(p); }
static inline v8 v8_load_bf16(const uint16_t *p) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
static inline v8 v8_load_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline void v8_store(float *p, v8 x) { _mm256_storeu_ps(p, x); }
static inline v8 v8_set1(float x) { return _mm256_set1_ps(x); }
static inline v8 v8_zero(void) { return _mm256_setzero_ps(); }
static inline v8 v8_fma(v8 a, v8 b, v8 c) { return _mm256_fmadd_ps(a, b, c); }
static inline v8 v8_mul(v8 a, v8 b) { return _mm256_mul_ps(a, b); }
static inline v8 v8_add(v8 a, v8 b) { return _mm256_add_ps(a, b); }
static inline v8 v8_max(v8 a, v8 b) { return _mm256_max_ps(a, b); }
static inline float v8_hsum(v8 x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline float v8_hmax(v8 x) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
/* lane i = the sum of a[i]'s lanes */
static inline v8 v8_hsum8(const v8 *a) {
    __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
    __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
    __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20), hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
    return _mm256_add_ps(lo, hi);
}
static inline v8 v8_exp(v8 x) { return avx2_exp(x); }
#else
#define LLMD_AVX2 0
typedef struct {
    float x[8];
} v8;
static inline v8 v8_load(const float *p) {
    v8 r;
    memcpy(r.x, p, sizeof r.x);
    return r;
}
static inline v8 v8_load_bf16(const uint16_t *p) {
    v8 r;
    for (int i = 0; i < 8; i++) {
        uint32_t u = (uint32_t)p[i] << 16;
        memcpy(&r.x[i], &u, 4);
    }
    return r;
}
static inline v8 v8_load_i8(const int8_t *p) {
    v8 r;
    for (int i = 0; i < 8; i++) r.x[i] = (float)p[i];
    return r;
}
static inline void v8_store(float *p, v8 x) { memcpy(p, x.x, sizeof x.x); }
static inline v8 v8_set1(float v) {
    v8 r;
    for (int i = 0; i < 8; i++) r.x[i] = v;
    return r;
}
static inline v8 v8_zero(void) { return v8_set1(0.0f); }
static inline v8 v8_fma(v8 a, v8 b, v8 c) {
    for (int i = 0; i < 8; i++) c.x[i] += a.x[i] * b.x[i];
    return c;
}
static inline v8 v8_mul(v8 a, v8 b) {
    for (int i = 0; i < 8; i++) a.x[i] *= b.x[i];
    return a;
}
static inline v8 v8_add(v8 a, v8 b) {
    for (int i = 0; i < 8; i++) a.x[i] += b.x[i];
    return a;
}
static inline v8 v8_max(v8 a, v8 b) {
    for (int i = 0; i < 8; i++) a.x[i] = a.x[i] > b.x[i] ? a.x[i] : b.x[i];
    return a;
}
static inline float v8_hsum(v8 x) {
    float s = 0.0f;
    for (int i = 0; i < 8; i++) s += x.x[i];
    return s;
}
static inline float v8_hmax(v8 x) {
    float m = x.x[0];
    for (int i = 1; i < 8; i++) m = x.x[i] > m ? x.x[i] : m;
    return m;
}
static inline v8 v8_hsum8(const v8 *a) {
    v8 r;
    for (int i = 0; i < 8; i++) r.x[i] = v8_hsum(a[i]);
    return r;
}
static inline v8 v8_exp(v8 x) {
    for (int i = 0; i < 8; i++) x.x[i] = expf(x.x[i]);
    return x;
}
#endif

#endif
