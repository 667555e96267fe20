/* The side-by-side walk's block over one chunk of k-rows, shared by the AVX2 float32 linear (f32_linear_avx2.c
 * rows_tiles, over the packed tiles) and the AVX2 bf16 one (bf16_linear_avx2.c, over a chunk widened to float32):
 * up to SIDE_MR rows against a whole tile, the sums carried between chunks in memory. */
#ifndef LLMD_AVX2_SIDE_WALK_H
#define LLMD_AVX2_SIDE_WALK_H
#include "avx2_tiles.h"
#include "unroll.h"

#define SIDE_MR 3  /* rows a block of the side-by-side walk takes against a whole tile: 12 accumulators */
#define SIDE_KC 16 /* k-rows (2 KB of float32) of a tile a pass takes before the next tile's */

/* rows [0, MR) (1-SIDE_MR) of x against n k-rows of a whole tile (x and w at the chunk's first k), the sums carried
 * between chunks in acc (row i at acc + i * NR): zero where `first`, else reloaded, and stored after, so each output
 * is still one FMA a k in order from zero. Where `ahead` is given (another tile at the same k), its k-rows are
 * prefetched to L2 as this chunk goes. */
static inline __attribute__((always_inline)) void rows_chunk(const float *x, int64_t xs, const float *w, int64_t n,
                                                            int first, float *acc, const float *ahead, const int MR) {
    __m256 a[SIDE_MR][4];
    ROWS_UNROLLED for (int i = 0; i < MR; i++) ROWS_UNROLLED for (int v = 0; v < 4; v++) a[i][v] =
        first ? _mm256_setzero_ps() : _mm256_load_ps(acc + i * NR + 8 * v);
    for (int64_t k = 0; k < n; k++) {
        const float *wp = w + k * NR;
        if (ahead) {
            _mm_prefetch((const char *)(ahead + k * NR), _MM_HINT_T1);
            _mm_prefetch((const char *)(ahead + k * NR + HALF), _MM_HINT_T1);
        }
        __m256 wv[4];
        ROWS_UNROLLED for (int v = 0; v < 4; v++) wv[v] = _mm256_loadu_ps(wp + 8 * v);
        ROWS_UNROLLED for (int i = 0; i < MR; i++) {
            const __m256 xb = _mm256_broadcast_ss(x + i * xs + k);
            ROWS_UNROLLED for (int v = 0; v < 4; v++) a[i][v] = _mm256_fmadd_ps(xb, wv[v], a[i][v]);
        }
    }
    ROWS_UNROLLED for (int i = 0; i < MR; i++) ROWS_UNROLLED for (int v = 0; v < 4; v++)
        _mm256_store_ps(acc + i * NR + 8 * v, a[i][v]);
}

static inline void block_chunk(const float *x, int64_t xs, const float *w, int64_t n, int first, float *acc,
                               const float *ahead, int64_t mr) {
    if (mr == SIDE_MR) rows_chunk(x, xs, w, n, first, acc, ahead, SIDE_MR);
    else if (mr == 2) rows_chunk(x, xs, w, n, first, acc, ahead, 2);
    else rows_chunk(x, xs, w, n, first, acc, ahead, 1);
}
#endif
