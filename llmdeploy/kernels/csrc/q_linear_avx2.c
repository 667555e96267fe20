/* The block-quantized linear (Q8 / Q4, the float kernel's layout from llmd_q_pack with vnni = 0) on AVX2 + FMA CPUs
 * without AVX-512: the same contract as llmd_q_linear in q_linear.c, which hands its calls here on such CPUs.
 *
 * Why its own kernel: the portable one keeps two sums per channel (x . q per block, then d times it) in 16-lane
 * pairs of AVX2 registers, 8 registers a row, so on AVX2's 16 registers it spills at any row count and ran one
 * SmolLM2 decode step slower in int8 than in float32 (Zen 2: 22 vs 20 ms). Here each weight is dequantized in a
 * register, w = d * q (+ m), exactly the float32 value a dequantizing loader computes (d * q is exact in float32; Q4
 * adds m in the one rounding of an FMA), and multiplied in the float32 linear's block shapes (avx2_tiles.h), so the
 * dequantizing is shared by the rows of a block; from DEQUANT_MIN_ROWS rows a tile is dequantized once per call
 * and run by the float32 kernel itself (f32_linear_avx2.c). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "unroll.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#include <omp.h>

#include "avx2_tiles.h"

#define QB 32 /* inputs per block */
/* From how many rows each tile is dequantized once per call instead of per row block. Zen 2, 2 threads, Q8, 32
 * of SmolLM2's projections, dequantized tile / in registers: 8 rows 1.14x, 12 0.98x, 16 1.07x, 24 0.83x, 32 0.81x,
 * 128 0.71x the time. */
#define DEQUANT_MIN_ROWS 20
enum { Q8 = 0, Q4 = 1 }; /* Q_FMT_* in q_format.h */

static inline int64_t block_bytes(int fmt) { return fmt == Q4 ? 2 * 64 + QB * 16 : 64 + QB * 32; }

/* the block header's float16 d (and Q4's m) of the 32 channels -> float32 dm[0, 32) (and dm[32, 64)) */
static inline void block_scales(int fmt, const uint8_t *hdr, float *dm) {
    for (int v = 0; v < (fmt == Q4 ? 8 : 4); v++)
        _mm256_storeu_ps(dm + 8 * v, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(hdr + 16 * v))));
}

/* the weights of channels [c0, c0 + 8) (c0 a multiple of 8) for block input kk, in float32 */
static inline __attribute__((always_inline)) __m256 dequant8(const int fmt, const uint8_t *qs, int64_t kk, int c0,
                                                             const float *dm) {
    if (fmt == Q8) {
        const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qs + kk * 32 + c0)));
        return _mm256_mul_ps(_mm256_cvtepi32_ps(q), _mm256_loadu_ps(dm + c0));
    }
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + kk * 16 + (c0 & 15))));
    const __m256i q = c0 < 16 ? _mm256_and_si256(b, _mm256_set1_epi32(15)) : _mm256_srli_epi32(b, 4);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_loadu_ps(dm + c0), _mm256_loadu_ps(dm + 32 + c0));
}

static inline void prefetch_ahead(const uint8_t *hdr, int64_t bb, int64_t kk) {
    if (kk * 64 < bb) __builtin_prefetch(hdr + 4 * bb + kk * 64, 0, 3); /* four blocks ahead, a line per input */
}

/* rows [0, MR) against channels [c0, c0 + 8 NV) of the tile: NV = 4 (the whole tile, MR <= MR_FULL) or 2 (a half,
 * MR <= MR_HALF) */
static inline __attribute__((always_inline)) void rows_block(const int fmt, const float *x, int64_t xs,
                                                            const uint8_t *tile, int64_t K, int c0,
                                                            const float *bias, float *y, int64_t ys, int real,
                                                            const int MR, const int NV) {
    __m256 a[MR_HALF][4];
    ROWS_UNROLLED for (int i = 0; i < MR; i++) ROWS_UNROLLED for (int v = 0; v < NV; v++) a[i][v] = _mm256_setzero_ps();
    const int64_t bb = block_bytes(fmt);
    for (int64_t b = 0; b < K / QB; b++) {
        const uint8_t *hdr = tile + b * bb, *qs = hdr + (fmt == Q4 ? 128 : 64);
        float dm[64];
        block_scales(fmt, hdr, dm);
        for (int64_t kk = 0; kk < QB; kk++) {
            prefetch_ahead(hdr, bb, kk);
            __m256 w[4];
            ROWS_UNROLLED for (int v = 0; v < NV; v++) w[v] = dequant8(fmt, qs, kk, c0 + 8 * v, dm);
            ROWS_UNROLLED for (int i = 0; i < MR; i++) {
                const __m256 xb = _mm256_broadcast_ss(x + i * xs + b * QB + kk);
                ROWS_UNROLLED for (int v = 0; v < NV; v++) a[i][v] = _mm256_fmadd_ps(xb, w[v], a[i][v]);
            }
        }
    }
    ROWS_UNROLLED for (int i = 0; i < MR; i++) ROWS_UNROLLED for (int v = 0; v < NV; v++)
        store_lanes(a[i][v], c0 + 8 * v, bias, y + i * ys, real);
}

void llmd_f32_tile_rows_avx2(const float *, int64_t, const float *, int64_t, const float *, float *, int64_t, int,
                             int64_t, const void *, int); /* f32_linear_avx2.c */

/* a tile as float32 in llmd_f32_pack's layout (k-major, NR channels a row): wt[K * NR], each weight as dequant8 makes
 * it (Q8 d * q, exact; Q4 one FMA q * d + m), from the float layout or the VNNI one (q_linear.c: per 4 inputs, a
 * channel's 4 quants a 32-bit lane; Q8 stored + 128) */
static void dequant_tile(int fmt, int vnni, const uint8_t *tile, int64_t K, float *wt) {
    const int64_t bb = block_bytes(fmt);
    for (int64_t b = 0; b < K / QB; b++) {
        const uint8_t *hdr = tile + b * bb, *qs = hdr + (fmt == Q4 ? 128 : 64);
        float dm[64];
        block_scales(fmt, hdr, dm);
        float *w = wt + b * QB * NR;
        if (!vnni) {
            for (int64_t kk = 0; kk < QB; kk++)
                for (int c0 = 0; c0 < NR; c0 += 8)
                    _mm256_storeu_ps(w + kk * NR + c0, fmt == Q4 ? dequant8(Q4, qs, kk, c0, dm) : dequant8(Q8, qs, kk, c0, dm));
            continue;
        }
        for (int g = 0; g < QB / 4; g++)
            for (int v = 0; v < 4; v++) { /* lanes: channels 8 v.., a lane's 4 bytes the inputs 4 g .. 4 g + 3 */
                const __m256i lanes =
                    fmt == Q8 ? _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(qs + g * 128 + 32 * v)),
                                                 _mm256_set1_epi8((char)0x80))
                              : _mm256_loadu_si256((const __m256i *)(qs + g * 64 + 32 * (v & 1)));
                const __m256 d = _mm256_loadu_ps(dm + 8 * v);
                for (int j = 0; j < 4; j++) {
                    if (fmt == Q8) {
                        const __m256i q = _mm256_srai_epi32(_mm256_slli_epi32(lanes, 24 - 8 * j), 24);
                        _mm256_storeu_ps(w + (4 * g + j) * NR + 8 * v, _mm256_mul_ps(_mm256_cvtepi32_ps(q), d));
                    } else { /* channels 16-31: the high nibbles */
                        const __m256i q = _mm256_and_si256(_mm256_srli_epi32(lanes, 8 * j + (v < 2 ? 0 : 4)),
                                                           _mm256_set1_epi32(15));
                        _mm256_storeu_ps(w + (4 * g + j) * NR + 8 * v,
                                         _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), d, _mm256_loadu_ps(dm + 32 + 8 * v)));
                    }
                }
            }
    }
}

#define ROWS(F, R, NV) rows_block(F, x, xs, tile, K, c0, bias, y, ys, real, R, NV)
#define ROWS_OF(R, NV) do { if (fmt == Q4) ROWS(Q4, R, NV); else ROWS(Q8, R, NV); } while (0)
#define HALF_CASE(R) case R: ROWS_OF(R, 2); break;
static void half_rows(int fmt, const float *x, int64_t xs, const uint8_t *tile, int64_t K, int c0, const float *bias,
                      float *y, int64_t ys, int real, int64_t mr) {
    switch (mr) {
    HALF_CASE(1) HALF_CASE(2) HALF_CASE(3) HALF_CASE(4) HALF_CASE(5)
    default: ROWS_OF(MR_HALF, 2);
    }
}

/* every row of x against one tile; y and bias at the tile's first channel, `real` of its channels are outputs */
static void tile_rows(int fmt, const float *x, int64_t xs, const uint8_t *tile, int64_t K, const float *bias,
                      float *y, int64_t ys, int real, int64_t M) {
    if (M <= MR_FULL) {
        const int c0 = 0;
        if (M == 1) ROWS_OF(1, 4);
        else ROWS_OF(2, 4);
        return;
    }
    for (int c0 = 0; c0 < real; c0 += HALF)
        for (int64_t j = 0, m = 0; m < M; m += half_block_rows(M, j), j++)
            half_rows(fmt, x + m * xs, xs, tile, K, c0, bias, y + m * ys, ys, real, half_block_rows(M, j));
}
#endif

int llmd_has_q_linear_avx2(void) {
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    return 1;
#else
    return 0;
#endif
}

int llmd_q_dequant_min_rows_avx2(void) {
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    return DEQUANT_MIN_ROWS;
#else
    return 0;
#endif
}

/* y = x @ w^T + bias with each tile of either layout (`vnni`) dequantized once (into L2) and run by the float32
 * kernel: what both AVX2 block-quantized linears do from DEQUANT_MIN_ROWS rows, so the layouts give the same bits
 * there. -3 if out of memory, -2 without AVX2 + FMA + F16C. */
int llmd_q_dequantized_linear_avx2(int fmt, int vnni, const float *x, int64_t x_stride, const uint8_t *packed,
                                   const float *bias, float *y, int64_t M, int64_t N, int64_t K, int nthreads) {
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    const int64_t tiles = (N + NR - 1) / NR, tile_bytes = (K / QB) * block_bytes(fmt);
    float *wts = malloc(sizeof(float) * (size_t)(nthreads * K * NR)); /* a dequantized tile a thread */
    if (!wts) return -3;
#pragma omp parallel num_threads(nthreads)
    {
        float *wt = wts + omp_get_thread_num() * K * NR;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            dequant_tile(fmt, vnni, packed + t * tile_bytes, K, wt);
            llmd_f32_tile_rows_avx2(x, x_stride, wt, K, bias ? bias + t * NR : NULL, y + t * NR, N,
                                    N - t * NR < NR ? (int)(N - t * NR) : NR, M, NULL, 0);
        }
    }
    free(wts);
    return 0;
#else
    (void)fmt; (void)vnni; (void)x; (void)x_stride; (void)packed; (void)bias; (void)y; (void)M; (void)N; (void)K;
    (void)nthreads;
    return -2;
#endif
}

/* llmd_q_linear's contract on AVX2 + FMA + F16C; -2 without them. Threads split the channel tiles. */
int llmd_q_linear_avx2(int fmt, const float *x, int64_t x_stride, const uint8_t *packed, const float *bias, float *y,
                       int64_t M, int64_t N, int64_t K, int nthreads) {
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    if (K % QB || nthreads < 1 || M < 1 || (fmt != Q8 && fmt != Q4)) return -1;
    /* from DEQUANT_MIN_ROWS rows a tile is dequantized once and runs at the float32 kernel's speed */
    if (M >= DEQUANT_MIN_ROWS) return llmd_q_dequantized_linear_avx2(fmt, 0, x, x_stride, packed, bias, y, M, N, K, nthreads);
    const int64_t tiles = (N + NR - 1) / NR, tile_bytes = (K / QB) * block_bytes(fmt);
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < tiles; t++) {
        const int real = N - t * NR < NR ? (int)(N - t * NR) : NR;
        tile_rows(fmt, x, x_stride, packed + t * tile_bytes, K, bias ? bias + t * NR : NULL, y + t * NR, N, real, M);
    }
    return 0;
#else
    (void)fmt; (void)x; (void)x_stride; (void)packed; (void)bias; (void)y; (void)M; (void)N; (void)K; (void)nthreads;
    return -2;
#endif
}
