/* The bfloat16 linear on AVX2 + FMA CPUs without AVX-512 BF16 (AMD Zen 2/3, Intel before Cooper Lake):
 * llmd_bf16_linear's contract over llmd_bf16_pack's layout, which hands its calls here on such CPUs. Without bf16
 * instructions torch emulates bf16 matmuls (SmolLM2's decode step at batch 8: 159 ms in bf16 against 27.5 in
 * float32 on Zen 2), so the weights are widened to float32 here: a bf16 is a float32's top half, and a packed lane
 * holds a channel's input pair (even input low, odd high), so the odd weight is the lane AND 0xffff0000 and the
 * even one the lane shifted left by 16.
 *
 * The arithmetic is vdpbf16ps's: an output's float32 sum adds, pair by pair, the odd input's product, then the
 * even one's (a bf16 times a bf16 is exact in float32, so each add is one FMA's rounding), and sum + bias (0
 * without one) rounds once to bf16, to nearest even; vdpbf16ps also flushes subnormals, this does not. The rows of
 * x go to float32 with each pair swapped (odd input first), so the weights widened in that order run through the
 * float32 kernel's own walks (f32_linear_avx2.c), to the same bits at any row count: a chunk of a few tiles at a
 * time up to llmd_side_rows rows, each tile whole past them. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "unroll.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <omp.h>

#include "avx2_side_walk.h"
#include "avx2_tiles.h"
#include "bf16_lanes.h"
#include "tile_groups.h"

extern int llmd_side_rows; /* cpu_kernels.c: rows up to which a call walks tiles side by side (rows_tiles) */

#define PAIR_ROW (2 * NR) /* bf16 elements of one input pair across a tile */

static inline __m256 odd_weights(__m256i lanes) {
    return _mm256_castsi256_ps(_mm256_and_si256(lanes, _mm256_set1_epi32((int)0xffff0000u)));
}
static inline __m256 even_weights(__m256i lanes) { return _mm256_castsi256_ps(_mm256_slli_epi32(lanes, 16)); }
static inline __m256i pair_lanes(const uint16_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline __m256 widen8(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }

/* rows of x (bf16, stride xs) -> float32 rows of K with each input pair swapped: xf[2p] = x[2p + 1], xf[2p + 1] =
 * x[2p] */
static void swapped_rows(const uint16_t *x, int64_t xs, int64_t M, int64_t K, float *xf) {
    const __m128i swap = _mm_setr_epi8(2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    for (int64_t i = 0; i < M; i++) {
        const uint16_t *r = x + i * xs;
        float *o = xf + i * K;
        int64_t k = 0;
        for (; k + 8 <= K; k += 8)
            _mm256_storeu_ps(o + k, widen8(_mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(r + k)), swap)));
        for (; k < K; k++) o[k] = bf16_to_f32(r[k ^ 1]);
    }
}

/* `pairs` input pairs of a tile (from where `tile` points) -> float32 in llmd_f32_pack's layout (k-major, NR channels
 * a row), each pair's odd weight first; where `ahead` is given, the same pairs of that tile are prefetched to L2 */
static void widen_pairs(const uint16_t *tile, int64_t pairs, float *w, const uint16_t *ahead) {
    for (int64_t p = 0; p < pairs; p++) {
        if (ahead) {
            _mm_prefetch((const char *)(ahead + p * PAIR_ROW), _MM_HINT_T1);
            _mm_prefetch((const char *)(ahead + p * PAIR_ROW + 32), _MM_HINT_T1);
        }
        for (int v = 0; v < 4; v++) {
            const __m256i lanes = pair_lanes(tile + p * PAIR_ROW + 16 * v);
            _mm256_storeu_ps(w + 2 * p * NR + 8 * v, odd_weights(lanes));
            _mm256_storeu_ps(w + (2 * p + 1) * NR + 8 * v, even_weights(lanes));
        }
    }
}

/* channels [c0, c0 + 8) of a row's sums + bias (bf16, or none) -> bf16, the first `real` channels of the tile */
static inline void store_bf16_lanes(__m256 acc, int c0, const uint16_t *bias, uint16_t *y, int real) {
    if (c0 >= real) return;
    const int n = real - c0 < 8 ? real - c0 : 8;
    uint16_t b[8] = {0}, out[8];
    if (bias) memcpy(b, bias + c0, sizeof(uint16_t) * (size_t)n);
    const __m128i r = v8_to_bf16_bits(_mm256_add_ps(acc, v8_load_bf16(b)));
    if (n == 8) {
        _mm_storeu_si128((__m128i *)(y + c0), r);
        return;
    }
    _mm_storeu_si128((__m128i *)out, r);
    memcpy(y + c0, out, sizeof(uint16_t) * (size_t)n);
}

/* one row (xf swapped) against G (1-3) adjacent tiles t.. side by side: G weight streams a core (tile_groups.h) */
static inline __attribute__((always_inline)) void row_tiles(const float *xf, const uint16_t *packed, int64_t K,
                                                           int64_t N, int64_t t, const uint16_t *bias, uint16_t *y,
                                                           const int G) {
    __m256 a[3][4];
    ROWS_UNROLLED for (int g = 0; g < G; g++) ROWS_UNROLLED for (int v = 0; v < 4; v++) a[g][v] = _mm256_setzero_ps();
    const uint16_t *w = packed + t * NR * K;
    for (int64_t p = 0; p < K / 2; p++) {
        const __m256 xo = _mm256_broadcast_ss(xf + 2 * p), xe = _mm256_broadcast_ss(xf + 2 * p + 1);
        ROWS_UNROLLED for (int g = 0; g < G; g++) ROWS_UNROLLED for (int v = 0; v < 4; v++) {
            const __m256i lanes = pair_lanes(w + g * NR * K + p * PAIR_ROW + 16 * v);
            a[g][v] = _mm256_fmadd_ps(xe, even_weights(lanes), _mm256_fmadd_ps(xo, odd_weights(lanes), a[g][v]));
        }
    }
    ROWS_UNROLLED for (int g = 0; g < G; g++) {
        const int64_t c = (t + g) * NR;
        const int real = N - c < NR ? (int)(N - c) : NR;
        ROWS_UNROLLED for (int v = 0; v < 4; v++) store_bf16_lanes(a[g][v], 8 * v, bias ? bias + c : NULL, y + c, real);
    }
}

/* rows [0, M) (2..LLMD_SIDE_ROWS_MAX, xf swapped, K floats apart) against G (1-3) adjacent tiles t.. side by side,
 * the float32 kernel's small-batch walk (f32_linear_avx2.c rows_tiles): SIDE_KC inputs of each tile in turn,
 * widened once into L1 for all the row blocks, the widening prefetching the following tile's same pairs to L2. */
static inline __attribute__((always_inline)) void rows_tiles(const float *xf, const uint16_t *packed, int64_t K,
                                                            int64_t N, int64_t tiles, int64_t t, const uint16_t *bias,
                                                            uint16_t *y, int64_t M, const int G) {
    float acc[3][LLMD_SIDE_ROWS_MAX][NR] __attribute__((aligned(32)));
    float chunk[SIDE_KC * NR] __attribute__((aligned(32)));
    for (int64_t k0 = 0; k0 < K; k0 += SIDE_KC) {
        const int64_t n = K - k0 < SIDE_KC ? K - k0 : SIDE_KC;
        ROWS_UNROLLED for (int g = 0; g < G; g++) {
            const uint16_t *tile = packed + (t + g) * NR * K;
            const uint16_t *ahead = t + g + 1 < tiles ? tile + NR * K + k0 / 2 * PAIR_ROW : NULL;
            widen_pairs(tile + k0 / 2 * PAIR_ROW, n / 2, chunk, ahead);
            for (int64_t j = 0, m = 0, mr; m < M; m += mr, j++) {
                mr = balanced_block_rows(M, j, SIDE_MR);
                block_chunk(xf + m * K + k0, K, chunk, n, k0 == 0, acc[g][m], NULL, mr);
            }
        }
    }
    ROWS_UNROLLED for (int g = 0; g < G; g++) {
        const int64_t c = (t + g) * NR;
        const int real = N - c < NR ? (int)(N - c) : NR;
        for (int64_t i = 0; i < M; i++)
            for (int v = 0; v < 4; v++)
                store_bf16_lanes(_mm256_load_ps(acc[g][i] + 8 * v), 8 * v, bias ? bias + c : NULL, y + i * N + c, real);
    }
}

void llmd_f32_tile_rows_avx2(const float *, int64_t, const float *, int64_t, const float *, float *, int64_t, int,
                             int64_t, const void *, int); /* f32_linear_avx2.c */

/* every row against each tile widened once (into L2) and walked by the float32 kernel, rows LLMD_ROW_CHUNK at a
 * time as there, its walks 1-4 prefetching this thread's next bf16 tile (the float32 kernel's next-tile prefetch at
 * half the bytes: 30 layers' projections + head on Zen 2, 16 rows 42.6 -> 34.0 ms, 32 rows 71.2 -> 55.9, float32
 * 34.5 / 53.4); -3 if out of memory */
static int widened_linear(const float *xf, const uint16_t *packed, const uint16_t *bias, uint16_t *y, int64_t M,
                          int64_t N, int64_t K, int nthreads) {
    const int64_t tiles = (N + NR - 1) / NR, chunk = M < LLMD_ROW_CHUNK ? M : LLMD_ROW_CHUNK;
    float *bufs = malloc(sizeof(float) * (size_t)(nthreads * (K + chunk) * NR)); /* a thread's tile and sums */
    if (!bufs) return -3;
#pragma omp parallel num_threads(nthreads)
    {
        float *wt = bufs + omp_get_thread_num() * (K + chunk) * NR, *sums = wt + K * NR;
        for (int64_t m0 = 0; m0 < M; m0 += LLMD_ROW_CHUNK) {
            const int64_t mc = M - m0 < LLMD_ROW_CHUNK ? M - m0 : LLMD_ROW_CHUNK;
#pragma omp for schedule(static)
            for (int64_t t = 0; t < tiles; t++) {
                const int real = N - t * NR < NR ? (int)(N - t * NR) : NR;
                widen_pairs(packed + t * NR * K, K / 2, wt, NULL);
                llmd_f32_tile_rows_avx2(xf + m0 * K, K, wt, K, NULL, sums, NR, real, mc,
                                        t + 1 < tiles ? packed + (t + 1) * NR * K : NULL, 4);
                for (int64_t i = 0; i < mc; i++)
                    for (int v = 0; v < 4; v++)
                        store_bf16_lanes(_mm256_loadu_ps(sums + i * NR + 8 * v), 8 * v, bias ? bias + t * NR : NULL,
                                         y + (m0 + i) * N + t * NR, real);
            }
        }
    }
    free(bufs);
    return 0;
}
#endif

int llmd_has_bf16_linear_avx2(void) {
#if defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

/* llmd_bf16_linear's contract (y[M, N] bf16 = x[M, K] bf16 @ w^T + bias, w as llmd_bf16_pack made it) on AVX2 + FMA;
 * -2 without them, -3 out of memory. Threads split the channel tiles. */
int llmd_bf16_linear_avx2(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const uint16_t *bias,
                          uint16_t *y, int64_t M, int64_t N, int64_t K, int nthreads) {
#if defined(__AVX2__) && defined(__FMA__)
    if (nthreads < 1 || M < 1 || K % 2) return -1;
    float *xf = malloc(sizeof(float) * (size_t)(M * K));
    if (!xf) return -3;
    swapped_rows(x, x_stride, M, K, xf);
    const int64_t tiles = (N + NR - 1) / NR;
    int rc = 0;
    if (M == 1) { /* decode at batch 1: tiles side by side */
#define ROW_WALK(t, G) row_tiles(xf, packed, K, N, t, bias, y, G)
        SIDE_BY_SIDE_TILE_GROUPS(ROW_WALK);
#undef ROW_WALK
    } else if (M <= llmd_side_rows && llmd_row_streams > 1) { /* small batches: the same, a few rows at a time */
#define ROWS_WALK(t, G) rows_tiles(xf, packed, K, N, tiles, t, bias, y, M, G)
        SIDE_BY_SIDE_TILE_GROUPS(ROWS_WALK);
#undef ROWS_WALK
    } else {
        rc = widened_linear(xf, packed, bias, y, M, N, K, nthreads);
    }
    free(xf);
    return rc;
#else
    (void)x; (void)x_stride; (void)packed; (void)bias; (void)y; (void)M; (void)N; (void)K; (void)nthreads;
    return -2;
#endif
}
