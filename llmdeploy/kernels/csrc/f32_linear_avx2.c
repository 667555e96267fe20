/* The float32 linear on AVX2 + FMA CPUs without AVX-512 (AMD Zen 2/3, older Xeons), over the same packed layout as
 * the AVX-512 kernel (llmd_f32_pack: tiles of 32 channels, k-major): packs are interchangeable between the two.
 *
 * Why its own micro-kernels: AVX2 has 16 vector registers of 8 floats, so the AVX-512 kernel's 12 rows x 32
 * channels do not fit. One or two rows take the whole 32-channel tile (4 accumulators a row: one sequential stream,
 * the bandwidth-bound decode case); from three rows each half tile of 16 channels runs 6 rows at a time (12
 * accumulators, 2 weight registers, 1 broadcast: the classic 6x16 AVX2 shape, compute-bound). */
#include <stdint.h>

#include "unroll.h"
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "avx2_store.h"

#define NR 32     /* channels per packed tile (F32_NR in cpu_kernels.c) */
#define HALF 16   /* channels per half tile */
#define MR_HALF 6 /* rows per half-tile block */
/* k-rows ahead a half block prefetches, both halves' lines: the first half's first row block is the tile's first
 * touch, from memory. With row blocks of balanced sizes (32 rows: 6+6+5+5+5+5, not 6+6+6+6+6+2, whose 2-row block
 * costs a 6-row one's time) 0.89x the time at 32 rows, 0.93x at 12 and 64, on Zen 2 (all of SmolLM2's projections) */
#define PF_DIST 16

/* rows [0, MR) (MR <= 2) against a whole tile */
static inline __attribute__((always_inline)) void full_block(const float *x, int64_t xs, const float *tile,
                                                            int64_t K, const float *bias, float *y, int64_t ys,
                                                            int real, const int MR) {
    __m256 a[2][4];
    ROWS_UNROLLED for (int i = 0; i < MR; i++)
        ROWS_UNROLLED for (int v = 0; v < 4; v++) a[i][v] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const float *wp = tile + k * NR;
        _mm_prefetch((const char *)(wp + NR * 8), _MM_HINT_T0);
        _mm_prefetch((const char *)(wp + NR * 8 + 16), _MM_HINT_T0);
        const __m256 w0 = _mm256_loadu_ps(wp), w1 = _mm256_loadu_ps(wp + 8);
        const __m256 w2 = _mm256_loadu_ps(wp + 16), w3 = _mm256_loadu_ps(wp + 24);
        ROWS_UNROLLED for (int i = 0; i < MR; i++) {
            const __m256 xb = _mm256_broadcast_ss(x + i * xs + k);
            a[i][0] = _mm256_fmadd_ps(xb, w0, a[i][0]);
            a[i][1] = _mm256_fmadd_ps(xb, w1, a[i][1]);
            a[i][2] = _mm256_fmadd_ps(xb, w2, a[i][2]);
            a[i][3] = _mm256_fmadd_ps(xb, w3, a[i][3]);
        }
    }
    ROWS_UNROLLED for (int i = 0; i < MR; i++)
        ROWS_UNROLLED for (int v = 0; v < 4; v++) store_lanes(a[i][v], 8 * v, bias, y + i * ys, real);
}

/* rows [0, MR) (MR <= 6) against one half tile: `half` points at the tile's channel h * 16, rows stride NR */
static inline __attribute__((always_inline)) void half_block(const float *x, int64_t xs, const float *half,
                                                            int64_t K, const float *bias, float *y, int64_t ys,
                                                            int real, const int MR) {
    __m256 a0[MR_HALF], a1[MR_HALF];
    ROWS_UNROLLED for (int i = 0; i < MR; i++) a0[i] = a1[i] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const float *wp = half + k * NR;
        _mm_prefetch((const char *)(wp + NR * PF_DIST), _MM_HINT_T0);
        _mm_prefetch((const char *)(wp + NR * PF_DIST + HALF), _MM_HINT_T0); /* the other half's line, for h = 0 */
        const __m256 w0 = _mm256_loadu_ps(wp), w1 = _mm256_loadu_ps(wp + 8);
        ROWS_UNROLLED for (int i = 0; i < MR; i++) {
            const __m256 xb = _mm256_broadcast_ss(x + i * xs + k);
            a0[i] = _mm256_fmadd_ps(xb, w0, a0[i]);
            a1[i] = _mm256_fmadd_ps(xb, w1, a1[i]);
        }
    }
    ROWS_UNROLLED for (int i = 0; i < MR; i++) {
        store_lanes(a0[i], 0, bias, y + i * ys, real);
        store_lanes(a1[i], 8, bias, y + i * ys, real);
    }
}

#define HALF_CASE(R) case R: half_block(x, xs, half, K, bias, y, ys, real, R); break;
static void half_rows(const float *x, int64_t xs, const float *half, int64_t K, const float *bias, float *y,
                      int64_t ys, int real, int64_t mr) {
    switch (mr) {
    HALF_CASE(1) HALF_CASE(2) HALF_CASE(3) HALF_CASE(4) HALF_CASE(5)
    default: half_block(x, xs, half, K, bias, y, ys, real, MR_HALF);
    }
}

/* every row of x against one packed tile (`real` of its NR channels are outputs; y and bias at its first channel);
 * also the many-row path of q_linear_avx2.c, over a tile it dequantized */
void llmd_f32_tile_rows_avx2(const float *x, int64_t xs, const float *tile, int64_t K, const float *bias, float *y,
                             int64_t N, int real, int64_t M) {
    if (M <= 2) {
        if (M == 1) full_block(x, xs, tile, K, bias, y, N, real, 1);
        else full_block(x, xs, tile, K, bias, y, N, real, 2);
        return;
    }
    for (int h = 0; h < 2 && h * HALF < real; h++) {
        const int half_real = real - h * HALF < HALF ? real - h * HALF : HALF;
        const float *hb = bias ? bias + h * HALF : NULL;
        const int64_t blocks = (M + MR_HALF - 1) / MR_HALF, base = M / blocks, extra = M % blocks;
        for (int64_t j = 0, m = 0; j < blocks; m += base + (j < extra), j++)
            half_rows(x + m * xs, xs, tile + h * HALF, K, hb, y + m * N + h * HALF, N, half_real, base + (j < extra));
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
 * Threads split the channel tiles, as in the AVX-512 kernel. */
int llmd_f32_linear_avx2(const float *x, int64_t x_stride, const float *packed, const float *bias, float *y,
                         int64_t M, int64_t N, int64_t K, int nthreads) {
#if defined(__AVX2__) && defined(__FMA__)
    if (nthreads < 1 || M < 1) return -1;
    const int64_t tiles = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < tiles; t++) {
        const int real = N - t * NR < NR ? (int)(N - t * NR) : NR;
        const float *tb = bias ? bias + t * NR : NULL;
        llmd_f32_tile_rows_avx2(x, x_stride, packed + t * NR * K, K, tb, y + t * NR, N, real, M);
    }
    return 0;
#else
    (void)x; (void)x_stride; (void)packed; (void)bias; (void)y; (void)M; (void)N; (void)K; (void)nthreads;
    return -2;
#endif
}
