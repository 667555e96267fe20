/* The store of a row's float32 sums shared by the AVX2 linears (f32_linear_avx2.c, q_linear_avx2.c). */
#ifndef LLMD_AVX2_STORE_H
#define LLMD_AVX2_STORE_H
#include <immintrin.h>
#include <stddef.h>

/* 8 lanes of sums + bias -> y[0, n) (n: the real channels left, full store from 8); by value, so the accumulators
 * stay in registers (an array of them passed by address made gcc store all twelve every iteration) */
static inline void store8(__m256 acc, const float *bias, float *y, int n) {
    if (n >= 8) {
        _mm256_storeu_ps(y, bias ? _mm256_add_ps(acc, _mm256_loadu_ps(bias)) : acc);
        return;
    }
    float tmp[8];
    _mm256_storeu_ps(tmp, acc);
    for (int c = 0; c < n; c++) y[c] = tmp[c] + (bias ? bias[c] : 0.0f);
}

/* channels [c0, c0 + 8) of a row whose first `real` channels are outputs */
static inline void store_lanes(__m256 acc, int c0, const float *bias, float *y, int real) {
    if (c0 < real) store8(acc, bias ? bias + c0 : NULL, y + c0, real - c0);
}
#endif
