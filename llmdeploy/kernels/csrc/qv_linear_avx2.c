/* The VNNI layout's linear (llmd_qv_linear: x rounded to int8 per block, exact integer dot products, as llama.cpp
 * computes GGUF weights) on AVX2 CPUs without AVX-512 VNNI: q_linear.c hands its calls here on such CPUs.
 *
 * Why: the float kernel (q_linear_avx2.c) widens, converts and scales every weight once per row block: from cache,
 * 2 Zen 2 threads, one row of SmolLM2's projections ran 23-31 G multiply-adds a second there and 53 here, 8 rows
 * 59 and 78-81. vpdpbusd's 4 products a lane become vpmaddubsw (pairs into int16) + vpmaddwd (pairs of those into
 * int32): Q8 through the sign trick (|q| unsigned times xq with q's sign, so no pair can saturate: |q| <= 128,
 * |xq| <= 127), Q4 directly (q <= 15). The integer sums are exact, x is rounded as in q_linear.c and each block's
 * sums go into the float32 sums in the VNNI kernel's float steps in its order (tested against a float64 model of
 * those steps: the emulated AVX-512 build rounds its FMAs twice, so it cannot stand in for the hardware's bits). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "unroll.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#include "avx2_reduce.h"
#include "q_format.h"
#include "tile_groups.h"

/* q_linear_avx2.c: from these rows a call runs float32 rows against each tile dequantized once (either layout), the
 * float layout's bits at as many rows. Here too: Zen 2, SmolLM2 gguf (Q4_1) prefill of 128 and 512 tokens, the int8
 * products ran 15-23% slower than that path (both compute-bound there). */
int llmd_q_dequant_min_rows_avx2(void);
int llmd_q_dequantized_linear_avx2(int, int, const float *, int64_t, const uint8_t *, const float *, float *, int64_t,
                                   int64_t, int64_t, int);
#define QV_MR 2 /* rows a pass over a tile: 4 int32 accumulators a row of AVX2's 16 registers */

/* x row -> per block: int8 quants (xq), scale dx, sum of quants (q_linear.c qv_quantize_row's rounding) */
static void quantize_row(const float *x, int64_t blocks, int8_t *xq, float *dx, int32_t *xqsum) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t b = 0; b < blocks; b++) {
        __m256 v[4];
        for (int j = 0; j < 4; j++) v[j] = _mm256_loadu_ps(x + b * QB + 8 * j);
        const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask)),
                                       _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)));
        const float amax = hmax8(m), inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        __m256i i[4];
        for (int j = 0; j < 4; j++) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], _mm256_set1_ps(inv)));
        /* packs work within 128-bit lanes: the permute puts the 32 bytes back in input order */
        const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
        _mm256_storeu_si256((__m256i *)(xq + b * QB),
                            _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        dx[b] = amax / 127.0f;
        xqsum[b] = hsum8_epi32(_mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3])));
    }
}

/* the 4 products of a lane's 4 quants (q, signed) with 4 inputs (xb), summed into int32 */
static inline __m256i dot4_q8(__m256i abs_q, __m256i q, __m256i xb) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(abs_q, _mm256_sign_epi8(xb, q)), _mm256_set1_epi16(1));
}
static inline __m256i dot4_q4(__m256i q, __m256i xb) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(q, xb), _mm256_set1_epi16(1));
}

/* rows [0, MR) of xq against block b of a tile, the float32 sums of its 32 channels carried in acc (row i at
 * acc + i * Q_NR). Vector v of a group's quants holds channels 8 v .. 8 v + 7 (Q8: the 128 bytes in order; Q4: the
 * low nibbles of the two 32-byte halves are channels 0-15, the high nibbles 16-31). */
static inline __attribute__((always_inline)) void qv_block(const int8_t *xq, int64_t K, const float *dx,
                                                          const int32_t *xqsum, const uint8_t *hdr, int64_t b,
                                                          float *acc, const int MR, const int fmt) {
    const int64_t blocks = K / QB;
    const uint8_t *qs = hdr + (fmt == Q_FMT_Q4 ? 128 : 64);
    __m256i s[QV_MR][4];
    ROWS_UNROLLED for (int i = 0; i < MR; i++) ROWS_UNROLLED for (int v = 0; v < 4; v++) s[i][v] =
        _mm256_setzero_si256();
    for (int g = 0; g < QB / 4; g++) {
        __m256i xb[QV_MR];
        ROWS_UNROLLED for (int i = 0; i < MR; i++) {
            int32_t four;
            memcpy(&four, xq + i * K + b * QB + 4 * g, 4);
            xb[i] = _mm256_set1_epi32(four);
        }
        if (fmt == Q_FMT_Q8) {
            ROWS_UNROLLED for (int v = 0; v < 4; v++) {
                const __m256i q = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(qs + g * 128 + 32 * v)),
                                                   _mm256_set1_epi8((char)0x80)); /* stored + 128 */
                const __m256i abs_q = _mm256_abs_epi8(q);
                ROWS_UNROLLED for (int i = 0; i < MR; i++) s[i][v] =
                    _mm256_add_epi32(s[i][v], dot4_q8(abs_q, q, xb[i]));
            }
        } else {
            const __m256i low4 = _mm256_set1_epi8(15);
            ROWS_UNROLLED for (int h = 0; h < 2; h++) {
                const __m256i bytes = _mm256_loadu_si256((const __m256i *)(qs + g * 64 + 32 * h));
                const __m256i lo = _mm256_and_si256(bytes, low4);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
                ROWS_UNROLLED for (int i = 0; i < MR; i++) {
                    s[i][h] = _mm256_add_epi32(s[i][h], dot4_q4(lo, xb[i]));
                    s[i][2 + h] = _mm256_add_epi32(s[i][2 + h], dot4_q4(hi, xb[i]));
                }
            }
        }
    }
    ROWS_UNROLLED for (int v = 0; v < 4; v++) {
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(hdr + 16 * v)));
        const __m256 m = fmt == Q_FMT_Q4 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(hdr + 64 + 16 * v)))
                                   : _mm256_setzero_ps();
        ROWS_UNROLLED for (int i = 0; i < MR; i++) {
            const float sx = dx[i * blocks + b];
            __m256 a = b == 0 ? _mm256_setzero_ps() : _mm256_load_ps(acc + i * Q_NR + 8 * v);
            a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[i][v]), _mm256_mul_ps(d, _mm256_set1_ps(sx)), a);
            if (fmt == Q_FMT_Q4) a = _mm256_fmadd_ps(_mm256_set1_ps(sx * (float)xqsum[i * blocks + b]), m, a);
            _mm256_store_ps(acc + i * Q_NR + 8 * v, a);
        }
    }
}

static void block_rows(int fmt, const int8_t *xq, int64_t K, const float *dx, const int32_t *xqsum,
                       const uint8_t *hdr, int64_t b, float *acc, int64_t mr) {
    if (mr == 2) {
        if (fmt == Q_FMT_Q4) qv_block(xq, K, dx, xqsum, hdr, b, acc, 2, Q_FMT_Q4);
        else qv_block(xq, K, dx, xqsum, hdr, b, acc, 2, Q_FMT_Q8);
    } else if (fmt == Q_FMT_Q4) qv_block(xq, K, dx, xqsum, hdr, b, acc, 1, Q_FMT_Q4);
    else qv_block(xq, K, dx, xqsum, hdr, b, acc, 1, Q_FMT_Q8);
}

/* every row of xq against G (1-3) adjacent tiles t.. side by side, block by block (G weight streams at once, as the
 * float32 linears' one-row walk: tile_groups.h); each output's blocks still summed in order */
static inline __attribute__((always_inline)) void tiles_rows(int fmt, const int8_t *xq, int64_t K, const float *dx,
                                                            const int32_t *xqsum, const uint8_t *packed,
                                                            const float *bias, float *y, int64_t N, int64_t M,
                                                            int64_t t, const int G) {
    const int64_t blocks = K / QB, bb = q_block_bytes(fmt), tile_bytes = blocks * bb;
    float acc[3][QV_MR][Q_NR] __attribute__((aligned(32)));
    for (int64_t m = 0; m < M; m += QV_MR) {
        const int64_t mr = M - m < QV_MR ? M - m : QV_MR;
        for (int64_t b = 0; b < blocks; b++)
            ROWS_UNROLLED for (int g = 0; g < G; g++)
                block_rows(fmt, xq + m * K, K, dx + m * blocks, xqsum + m * blocks,
                           packed + (t + g) * tile_bytes + b * bb, b, acc[g][0], mr);
        ROWS_UNROLLED for (int g = 0; g < G; g++) {
            const int64_t c = (t + g) * Q_NR;
            const int real = N - c < Q_NR ? (int)(N - c) : Q_NR;
            for (int64_t i = 0; i < mr; i++)
                for (int j = 0; j < real; j++)
                    y[(m + i) * N + c + j] = acc[g][i][j] + (bias ? bias[c + j] : 0.0f);
        }
    }
}

#endif

int llmd_has_qv_linear_avx2(void) {
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    return 1;
#else
    return 0;
#endif
}

/* llmd_qv_linear's contract on AVX2 + FMA + F16C below llmd_q_dequant_min_rows_avx2() rows (from there float32 rows
 * and exact weights); -2 without them. Each thread walks its share of the tiles llmd_row_streams at a time (tile_groups.h). */
int llmd_qv_linear_avx2(int fmt, const float *x, int64_t x_stride, const uint8_t *packed, const float *bias, float *y,
                        int64_t M, int64_t N, int64_t K, int nthreads) {
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    if (K % QB || nthreads < 1 || M < 1 || (fmt != Q_FMT_Q8 && fmt != Q_FMT_Q4)) return -1;
    if (M >= llmd_q_dequant_min_rows_avx2()) /* prefill: float32 rows against the exact weights */
        return llmd_q_dequantized_linear_avx2(fmt, 1, x, x_stride, packed, bias, y, M, N, K, nthreads);
    const int64_t tiles = (N + Q_NR - 1) / Q_NR, blocks = K / QB;
    int8_t *xq;
    float *dx;
    int32_t *xqsum;
    void *inputs = qv_inputs_alloc(M, K, &xq, &dx, &xqsum);
    if (!inputs) return -3;
    for (int64_t i = 0; i < M; i++) quantize_row(x + i * x_stride, blocks, xq + i * K, dx + i * blocks, xqsum + i * blocks);
#define QV_WALK(t, G) tiles_rows(fmt, xq, K, dx, xqsum, packed, bias, y, N, M, t, G)
    SIDE_BY_SIDE_TILE_GROUPS(QV_WALK);
#undef QV_WALK
    free(inputs);
    return 0;
#else
    (void)fmt; (void)x; (void)x_stride; (void)packed; (void)bias; (void)y; (void)M; (void)N; (void)K; (void)nthreads;
    return -2;
#endif
}
