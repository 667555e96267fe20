/* The float32 linear on AVX2 + FMA CPUs without AVX-512 (AMD Zen 2/3, older Xeons), over the same packed layout as
 * the AVX-512 kernel (llmd_f32_pack: tiles of 32 channels, k-major): packs are interchangeable between the two.
 *
 * Why its own micro-kernel: AVX2 has 16 vector registers of 8 floats, so the AVX-512 kernel's 12 rows x 32
 * channels do not fit; the block shapes it uses instead are in avx2_tiles.h. */
#include <stdint.h>
#include <string.h>

#include "unroll.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "avx2_side_walk.h"
#include "avx2_tiles.h"
#include "tile_groups.h"

extern int llmd_side_rows; /* cpu_kernels.c: rows up to which a call walks tiles side by side (rows_tiles) */
extern int llmd_tile_ahead_rows; /* cpu_kernels.c: rows up to which a tile's later walks prefetch the next one */

/* rows [0, MR) against channels [c0, c0 + 8 NV) of a tile: NV = 4 (the whole tile, MR <= MR_FULL) or 2 (a half,
 * MR <= MR_HALF). Both lines of a k-row are prefetched PF rows ahead; a half block's 16 (0.93x the time of 8 at 12
 * and 64 rows on Zen 2) because the first half's first block is the tile's first touch, from memory. */
static inline __attribute__((always_inline)) void rows_block(const float *x, int64_t xs, const float *tile, int64_t K,
                                                            int c0, const float *bias, float *y, int64_t ys,
                                                            int real, const int MR, const int NV) {
    const int64_t PF = NV == 4 ? 8 : 16;
    __m256 a[MR_HALF][4];
    ROWS_UNROLLED for (int i = 0; i < MR; i++) ROWS_UNROLLED for (int v = 0; v < NV; v++) a[i][v] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const float *wp = tile + k * NR;
        _mm_prefetch((const char *)(wp + NR * PF), _MM_HINT_T0);
        _mm_prefetch((const char *)(wp + NR * PF + HALF), _MM_HINT_T0);
        __m256 w[4];
        ROWS_UNROLLED for (int v = 0; v < NV; v++) w[v] = _mm256_loadu_ps(wp + c0 + 8 * v);
        ROWS_UNROLLED for (int i = 0; i < MR; i++) {
            const __m256 xb = _mm256_broadcast_ss(x + i * xs + k);
            ROWS_UNROLLED for (int v = 0; v < NV; v++) a[i][v] = _mm256_fmadd_ps(xb, w[v], a[i][v]);
        }
    }
    ROWS_UNROLLED for (int i = 0; i < MR; i++) ROWS_UNROLLED for (int v = 0; v < NV; v++)
        store_lanes(a[i][v], c0 + 8 * v, bias, y + i * ys, real);
}

#define HALF_CASE(R) case R: rows_block(x, xs, tile, K, c0, bias, y, ys, real, R, 2); break;
static void half_rows(const float *x, int64_t xs, const float *tile, int64_t K, int c0, const float *bias, float *y,
                      int64_t ys, int real, int64_t mr) {
    switch (mr) {
    HALF_CASE(1) HALF_CASE(2) HALF_CASE(3) HALF_CASE(4) HALF_CASE(5)
    default: rows_block(x, xs, tile, K, c0, bias, y, ys, real, MR_HALF, 2);
    }
}

/* rows_block's half-tile walk that also prefetches another tile: one k-row of `ahead` (both lines) every 8
 * iterations, `ahead` advancing a k-row at a time. A copy rather than a flag on rows_block: with both loops in one
 * function the plain walks of a prefill ran 5-15% slower (Zen 2, gcc 12). */
static inline __attribute__((always_inline)) void rows_block_ahead(const float *x, int64_t xs, const float *tile,
                                                                  int64_t K, int c0, const float *bias, float *y,
                                                                  int64_t ys, int real, const float *ahead,
                                                                  const int MR) {
    __m256 a[MR_HALF][2];
    ROWS_UNROLLED for (int i = 0; i < MR; i++) a[i][0] = a[i][1] = _mm256_setzero_ps();
    for (int64_t k0 = 0; k0 < K; k0 += 8, ahead += NR) {
        _mm_prefetch((const char *)ahead, _MM_HINT_T1);
        _mm_prefetch((const char *)(ahead + HALF), _MM_HINT_T1);
        for (int64_t k = k0; k < k0 + 8 && k < K; k++) {
            const float *wp = tile + k * NR;
            _mm_prefetch((const char *)(wp + NR * 16), _MM_HINT_T0);
            _mm_prefetch((const char *)(wp + NR * 16 + HALF), _MM_HINT_T0);
            const __m256 w0 = _mm256_loadu_ps(wp + c0), w1 = _mm256_loadu_ps(wp + c0 + 8);
            ROWS_UNROLLED for (int i = 0; i < MR; i++) {
                const __m256 xb = _mm256_broadcast_ss(x + i * xs + k);
                a[i][0] = _mm256_fmadd_ps(xb, w0, a[i][0]);
                a[i][1] = _mm256_fmadd_ps(xb, w1, a[i][1]);
            }
        }
    }
    ROWS_UNROLLED for (int i = 0; i < MR; i++) {
        store_lanes(a[i][0], c0, bias, y + i * ys, real);
        store_lanes(a[i][1], c0 + 8, bias, y + i * ys, real);
    }
}

#define AHEAD_CASE(R) case R: rows_block_ahead(x, xs, tile, K, c0, bias, y, ys, real, ahead, R); break;
static void half_rows_ahead(const float *x, int64_t xs, const float *tile, int64_t K, int c0, const float *bias,
                            float *y, int64_t ys, int real, const float *ahead, int64_t mr) {
    switch (mr) {
    AHEAD_CASE(1) AHEAD_CASE(2) AHEAD_CASE(3) AHEAD_CASE(4) AHEAD_CASE(5)
    default: rows_block_ahead(x, xs, tile, K, c0, bias, y, ys, real, ahead, MR_HALF);
    }
}

/* one row against G (1-3) adjacent tiles in lockstep, tiles t.. of a linear of N channels: G weight streams at
 * once (tile_groups.h). Each output still sums over k in order with one FMA a step: the same bits as rows_block.
 * No software prefetch: on top of the streams it cost 10-20%. */
static inline __attribute__((always_inline)) void row_tiles(const float *x, const float *packed, int64_t K, int64_t N,
                                                           int64_t t, const float *bias, float *y, const int G) {
    __m256 a[3][4];
    ROWS_UNROLLED for (int g = 0; g < G; g++) ROWS_UNROLLED for (int v = 0; v < 4; v++) a[g][v] = _mm256_setzero_ps();
    const float *w = packed + t * NR * K;
    for (int64_t k = 0; k < K; k++) {
        const __m256 xb = _mm256_broadcast_ss(x + k);
        ROWS_UNROLLED for (int g = 0; g < G; g++) ROWS_UNROLLED for (int v = 0; v < 4; v++) a[g][v] =
            _mm256_fmadd_ps(xb, _mm256_loadu_ps(w + (g * K + k) * NR + 8 * v), a[g][v]);
    }
    ROWS_UNROLLED for (int g = 0; g < G; g++) {
        const int64_t c = (t + g) * NR;
        const int real = N - c < NR ? (int)(N - c) : NR;
        ROWS_UNROLLED for (int v = 0; v < 4; v++) store_lanes(a[g][v], 8 * v, bias ? bias + c : NULL, y + c, real);
    }
}

/* rows [0, M) (2..LLMD_SIDE_ROWS_MAX) against G (1-3) adjacent tiles t.. side by side, SIDE_KC k-rows of each in
 * turn; each tile's first block prefetches the following tile's same k-rows (while it is below `tiles`). */
static inline __attribute__((always_inline)) void rows_tiles(const float *x, int64_t xs, const float *packed,
                                                            int64_t K, int64_t N, int64_t tiles, int64_t t,
                                                            const float *bias, float *y, int64_t M, const int G) {
    float acc[3][LLMD_SIDE_ROWS_MAX][NR] __attribute__((aligned(32)));
    for (int64_t k0 = 0; k0 < K; k0 += SIDE_KC) {
        const int64_t k1 = K - k0 < SIDE_KC ? K : k0 + SIDE_KC;
        ROWS_UNROLLED for (int g = 0; g < G; g++) {
            const float *tile = packed + (t + g) * NR * K;
            const float *ahead = t + g + 1 < tiles ? tile + NR * K : NULL;
            for (int64_t j = 0, m = 0, mr; m < M; m += mr, j++) {
                mr = balanced_block_rows(M, j, SIDE_MR);
                block_chunk(x + m * xs + k0, xs, tile + k0 * NR, k1 - k0, k0 == 0, acc[g][m],
                            j == 0 && ahead ? ahead + k0 * NR : NULL, mr);
            }
        }
    }
    ROWS_UNROLLED for (int g = 0; g < G; g++) {
        const int64_t c = (t + g) * NR;
        const int real = N - c < NR ? (int)(N - c) : NR;
        for (int64_t i = 0; i < M; i++)
            for (int v = 0; v < 4; v++)
                store_lanes(_mm256_load_ps(acc[g][i] + 8 * v), 8 * v, bias ? bias + c : NULL, y + i * N + c, real);
    }
}

/* every row of x against one packed tile (`real` of its NR channels are outputs; y and bias at its first channel);
 * also the many-row path of q_linear_avx2.c, over a tile it dequantized. From 3 rows the tile is walked once per
 * block, the first walk from memory with few misses in flight (the hardware prefetcher retrains on each new tile).
 * Where `next` (what this thread reads next, or NULL) is given and M <= llmd_tile_ahead_rows, walks 1..next_walks
 * each prefetch an eighth of a float32 tile's bytes from it (8 walks: the next float32 tile; 4: a bf16 one), so its
 * first walk finds it in cache: the 30 layers' projections at 32 rows, interleaved as in a decode step, 64.4 -> 47.6
 * ms on Zen 2. With more rows the first walk is a small part of a tile's time. */
void llmd_f32_tile_rows_avx2(const float *x, int64_t xs, const float *tile, int64_t K, const float *bias, float *y,
                             int64_t N, int real, int64_t M, const void *next, int next_walks) {
    if (M <= MR_FULL) {
        if (M == 1) rows_block(x, xs, tile, K, 0, bias, y, N, real, 1, 4);
        else rows_block(x, xs, tile, K, 0, bias, y, N, real, 2, 4);
        return;
    }
    const int64_t share = (K + 7) / 8; /* the next tile's k-rows one walk prefetches */
    int64_t walk = 0;
    for (int c0 = 0; c0 < real; c0 += HALF)
        for (int64_t j = 0, m = 0; m < M; m += half_block_rows(M, j), j++, walk++) {
            if (next && M <= llmd_tile_ahead_rows && walk >= 1 && walk <= next_walks)
                half_rows_ahead(x + m * xs, xs, tile, K, c0, bias, y + m * N, N, real,
                                (const float *)next + (walk - 1) * share * NR, half_block_rows(M, j));
            else
                half_rows(x + m * xs, xs, tile, K, c0, bias, y + m * N, N, real, half_block_rows(M, j));
        }
}
#endif

int llmd_has_f32_linear_avx2(void) {
#if defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

/* llmd_f32_linear's contract (y[M, N] = x @ w^T + bias, w as llmd_f32_pack made it) on AVX2; -2 without it.
 * Threads split the channel tiles, as in the AVX-512 kernel; many rows go LLMD_ROW_CHUNK at a time. */
int llmd_f32_linear_avx2(const float *x, int64_t x_stride, const float *packed, const float *bias, float *y,
                         int64_t M, int64_t N, int64_t K, int nthreads) {
#if defined(__AVX2__) && defined(__FMA__)
    if (nthreads < 1 || M < 1) return -1;
    const int64_t tiles = (N + NR - 1) / NR;
    if (M == 1 && llmd_row_streams > 1) { /* decode at batch 1: tiles side by side (tile_groups.h) */
#define ROW_WALK(t, G) row_tiles(x, packed, K, N, t, bias, y, G)
        SIDE_BY_SIDE_TILE_GROUPS(ROW_WALK);
#undef ROW_WALK
        return 0;
    }
    if (M >= 2 && M <= llmd_side_rows && llmd_row_streams > 1) { /* small batches: the same, a few rows at a time */
#define ROWS_WALK(t, G) rows_tiles(x, x_stride, packed, K, N, tiles, t, bias, y, M, G)
        SIDE_BY_SIDE_TILE_GROUPS(ROWS_WALK);
#undef ROWS_WALK
        return 0;
    }
#pragma omp parallel num_threads(nthreads)
    for (int64_t m0 = 0; m0 < M; m0 += LLMD_ROW_CHUNK) {
        const int64_t mc = M - m0 < LLMD_ROW_CHUNK ? M - m0 : LLMD_ROW_CHUNK;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const int real = N - t * NR < NR ? (int)(N - t * NR) : NR;
            const float *tb = bias ? bias + t * NR : NULL;
            llmd_f32_tile_rows_avx2(x + m0 * x_stride, x_stride, packed + t * NR * K, K, tb, y + m0 * N + t * NR, N,
                                    real, mc, t + 1 < tiles ? packed + (t + 1) * NR * K : NULL, 8);
        }
    }
    return 0;
#else
    (void)x; (void)x_stride; (void)packed; (void)bias; (void)y; (void)M; (void)N; (void)K; (void)nthreads;
    return -2;
#endif
}
