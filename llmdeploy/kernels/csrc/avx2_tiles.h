/* What the AVX2 linears (f32_linear_avx2.c, q_linear_avx2.c) share: the shape of their row blocks and the store of a
 * row's float32 sums. Both walk tiles of NR = 32 channels: one or two rows against the whole tile (4 accumulators a
 * row: the bandwidth-bound decode case), from three rows blocks of up to MR_HALF rows against each 16-channel half
 * (12 accumulators, 2 weight registers, 1 broadcast of AVX2's 16 registers: compute-bound). */
#ifndef LLMD_AVX2_TILES_H
#define LLMD_AVX2_TILES_H
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#include "row_chunk.h"

#define NR 32       /* channels per packed tile (F32_NR in linear_avx512.c, Q_NR in q_format.h) */
#define HALF 16     /* channels per half tile */
#define MR_FULL 2   /* rows up to which a block takes the whole tile */
#define MR_HALF 6   /* rows per half-tile block */

/* rows in block j of M rows cut into ceil(M / most) blocks of balanced sizes: 32 rows in blocks of up to 6 run
 * 6+6+5+5+5+5, not 6+6+6+6+6+2, whose 2-row block costs a 6-row one's time (0.89x the time at 32 rows on Zen 2) */
static inline int64_t balanced_block_rows(int64_t M, int64_t j, int64_t most) {
    const int64_t blocks = (M + most - 1) / most;
    return M / blocks + (j < M % blocks);
}

static inline int64_t half_block_rows(int64_t M, int64_t j) { return balanced_block_rows(M, j, MR_HALF); }

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
