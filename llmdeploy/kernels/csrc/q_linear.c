/* q_linear: y = x @ w^T + bias with w in GGUF's block-quantized formats (Q8_0, Q4_0/Q4_1; q_format.h), read once
 * per call and widened in registers (bandwidth-bound decode reads 5-8.5 bits per weight instead of 32): the packing,
 * the float32 kernel (AVX-512; AVX2 in q_linear_avx2.c) and the int8 VNNI one. */
#include "q_format.h"

/* where channel c's quant of block input kk sits in a block's quant bytes: the float kernel's layout (vnni = 0:
 * per input, 32 channels) or the VNNI kernel's (per 4 inputs, each channel's 4 adjacent); Q4 keeps channel c + 16
 * in the high nibble of channel c's byte */
static inline int64_t q_pos(int fmt, int vnni, int64_t kk, int64_t c) {
    if (!vnni) return fmt == Q_FMT_Q8 ? kk * 32 + c : kk * 16 + (c & 15);
    return fmt == Q_FMT_Q8 ? (kk / 4) * 128 + (c / 16) * 64 + (c % 16) * 4 + kk % 4 : (kk / 4) * 64 + (c % 16) * 4 + kk % 4;
}

/* q [N, K] (int8 for Q8; 0..15 for Q4), d and m [N, K / QB] float16 bits (m unused for Q8) -> packed for the
 * float kernel (vnni = 0) or the VNNI one (size: ceil(N / Q_NR) * (K / QB) * q_block_bytes(fmt)); channels past N
 * get d = 0, so whatever their quants they give zero. VNNI Q8 quants are stored + 128 (vpdpbusd's unsigned side). */
int llmd_q_pack(int fmt, int vnni, const uint8_t *q, const uint16_t *d, const uint16_t *m, int64_t N, int64_t K,
                uint8_t *packed) {
    if (K % QB || (fmt != Q_FMT_Q8 && fmt != Q_FMT_Q4)) return -1;
    const int64_t tiles = (N + Q_NR - 1) / Q_NR, blocks = K / QB, bb = q_block_bytes(fmt);
    memset(packed, 0, (size_t)(tiles * blocks * bb));
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t b = 0; b < blocks; b++) {
            uint8_t *hdr = packed + (t * blocks + b) * bb;
            uint8_t *qs = hdr + (fmt == Q_FMT_Q4 ? 128 : 64);
            for (int64_t c = 0; c < Q_NR && t * Q_NR + c < N; c++) {
                const int64_t n = t * Q_NR + c;
                memcpy(hdr + 2 * c, d + n * blocks + b, 2);
                if (fmt == Q_FMT_Q4) memcpy(hdr + 64 + 2 * c, m + n * blocks + b, 2);
                for (int64_t kk = 0; kk < QB; kk++) {
                    const uint8_t v = q[n * K + b * QB + kk];
                    if (fmt == Q_FMT_Q8) qs[q_pos(fmt, vnni, kk, c)] = vnni ? (uint8_t)((int)(int8_t)v + 128) : v;
                    else qs[q_pos(fmt, vnni, kk, c)] |= (uint8_t)((v & 15) << (c < 16 ? 0 : 4));
                }
            }
        }
    return 0;
}

/* out [N, K] float32 = the weights llmd_q_pack packed for either kernel, as a dequantizing
 * loader computes them (d * q is exact in float32, then + m) */
int llmd_q_unpack(int fmt, int vnni, const uint8_t *packed, int64_t N, int64_t K, float *out) {
    if (K % QB || (fmt != Q_FMT_Q8 && fmt != Q_FMT_Q4)) return -1;
    const int64_t tiles = (N + Q_NR - 1) / Q_NR, blocks = K / QB, bb = q_block_bytes(fmt);
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *hdr = packed + (t * blocks + b) * bb, *qs = hdr + (fmt == Q_FMT_Q4 ? 128 : 64);
            for (int64_t c = 0; c < Q_NR && t * Q_NR + c < N; c++) {
                uint16_t dh, mh = 0;
                memcpy(&dh, hdr + 2 * c, 2);
                if (fmt == Q_FMT_Q4) memcpy(&mh, hdr + 64 + 2 * c, 2);
                const float d = half_to_float(dh), m = half_to_float(mh);
                float *row = out + (t * Q_NR + c) * K + b * QB;
                for (int64_t kk = 0; kk < QB; kk++) {
                    const uint8_t v = qs[q_pos(fmt, vnni, kk, c)];
                    const float q = fmt == Q_FMT_Q4 ? (float)((v >> (c < 16 ? 0 : 4)) & 15)
                                    : vnni          ? (float)((int)v - 128)
                                                    : (float)(int8_t)v;
                    row[kk] = fmt == Q_FMT_Q8 ? d * q : d * q + m;
                }
            }
        }
    return 0;
}

/* rows [0, MR) of x against one packed tile: y[i * ys + c] = x_i . w_c (+ bias) for the tile's `real` channels.
 * Per block, sums of x * q (the quants widened to float32) are scaled once: sum_k x_k (d q_k + m) = d sum_k x_k q_k
 * + m sum_k x_k, with the block sums of x (xsum, Q4 only) computed once per call. MR and fmt are constants where
 * it is inlined. */
static inline __attribute__((always_inline)) void q_block(const float *x, int64_t xs, const float *xsum,
                                                         const uint8_t *tile, int64_t K, const float *bias, float *y,
                                                         int64_t ys, int real, const int MR, const int fmt) {
    v16 a0[Q_MR], a1[Q_MR], s0[Q_MR], s1[Q_MR];
    ROWS_UNROLLED for (int i = 0; i < MR; i++) a0[i] = a1[i] = v16_zero();
    const int64_t bb = q_block_bytes(fmt), blocks = K / QB;
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *hdr = tile + b * bb, *qs = hdr + (fmt == Q_FMT_Q4 ? 128 : 64);
        const float *xb = x + b * QB;
        ROWS_UNROLLED for (int i = 0; i < MR; i++) s0[i] = s1[i] = v16_zero();
        for (int kk = 0; kk < QB; kk++) {
            if (kk * 64 < bb) __builtin_prefetch(hdr + 4 * bb + kk * 64, 0, 3);
            v16 q0, q1;
            if (fmt == Q_FMT_Q4) v16_u4(qs + kk * 16, &q0, &q1);
            else q0 = v16_i8(qs + kk * 32), q1 = v16_i8(qs + kk * 32 + 16);
            ROWS_UNROLLED for (int i = 0; i < MR; i++) {
                const v16 xv = v16_set1(xb[i * xs + kk]);
                s0[i] = v16_fma(xv, q0, s0[i]);
                s1[i] = v16_fma(xv, q1, s1[i]);
            }
        }
        const v16 d0 = v16_half(hdr), d1 = v16_half(hdr + 32);
        ROWS_UNROLLED for (int i = 0; i < MR; i++) a0[i] = v16_fma(s0[i], d0, a0[i]), a1[i] = v16_fma(s1[i], d1, a1[i]);
        if (fmt == Q_FMT_Q4) {
            const v16 m0 = v16_half(hdr + 64), m1 = v16_half(hdr + 96);
            ROWS_UNROLLED for (int i = 0; i < MR; i++) {
                const v16 sx = v16_set1(xsum[i * blocks + b]);
                a0[i] = v16_fma(sx, m0, a0[i]), a1[i] = v16_fma(sx, m1, a1[i]);
            }
        }
    }
    float tmp[Q_NR];
    ROWS_UNROLLED for (int i = 0; i < MR; i++) {
        v16_store(tmp, a0[i]);
        v16_store(tmp + 16, a1[i]);
        q_store_row(tmp, bias, y + i * ys, real);
    }
}

#define Q_CASE(R)                                                                                            \
    case R:                                                                                                  \
        if (fmt == Q_FMT_Q4) q_block(x, xs, xsum, tile, K, bias, y, ys, real, R, Q_FMT_Q4);                  \
        else q_block(x, xs, xsum, tile, K, bias, y, ys, real, R, Q_FMT_Q8);                                  \
        break;
static void q_rows(int fmt, const float *x, int64_t xs, const float *xsum, const uint8_t *tile, int64_t K,
                   const float *bias, float *y, int64_t ys, int real, int64_t mr) {
    switch (mr) {
    Q_CASE(1) Q_CASE(2) Q_CASE(3) Q_CASE(4) Q_CASE(5)
    default: Q_CASE(Q_MR)
    }
}

/* y[M, N] (contiguous) = x[M, K] float32 (row stride x_stride) @ w[N, K]^T (+ bias[N]), w packed by llmd_q_pack.
 * Threads split the channel tiles; a tile meets every row block while it is in L1, so the weights are read from
 * memory once per call. */
int llmd_q_linear_avx2(int, const float *, int64_t, const uint8_t *, const float *, float *, int64_t, int64_t, int64_t,
                       int); /* q_linear_avx2.c: this contract on AVX2 + FMA + F16C, -2 without them */

int llmd_q_linear(int fmt, const float *x, int64_t x_stride, const uint8_t *packed, const float *bias, float *y,
                  int64_t M, int64_t N, int64_t K, int nthreads) {
    if (K % QB || nthreads < 1 || M < 1 || (fmt != Q_FMT_Q8 && fmt != Q_FMT_Q4)) return -1;
#if !defined(__AVX512F__)
    /* AVX2: dequantized in registers (the two-sum scheme below spills 16 AVX2 registers at any row count) */
    if (llmd_q_linear_avx2(fmt, x, x_stride, packed, bias, y, M, N, K, nthreads) == 0) return 0;
#endif
    const int64_t tiles = (N + Q_NR - 1) / Q_NR, blocks = K / QB, tile_bytes = blocks * q_block_bytes(fmt);
    float *xsum = NULL;
    if (fmt == Q_FMT_Q4) {
        xsum = malloc(sizeof(float) * (size_t)(M * blocks));
        if (!xsum) return -3;
        for (int64_t i = 0; i < M; i++)
            for (int64_t b = 0; b < blocks; b++) {
                float s = 0.0f;
                for (int64_t kk = 0; kk < QB; kk++) s += x[i * x_stride + b * QB + kk];
                xsum[i * blocks + b] = s;
            }
    }
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < tiles; t++) {
        const uint8_t *tile = packed + t * tile_bytes;
        const int real = N - t * Q_NR < Q_NR ? (int)(N - t * Q_NR) : Q_NR;
        for (int64_t m = 0; m < M; m += Q_MR)
            q_rows(fmt, x + m * x_stride, x_stride, xsum ? xsum + m * blocks : NULL, tile, K,
                   bias ? bias + t * Q_NR : NULL, y + m * N + t * Q_NR, N, real, M - m < Q_MR ? M - m : Q_MR);
    }
    free(xsum);
    return 0;
}

/* The same formats with AVX-512 VNNI (vpdpbusd: 4 u8 x s8 products into each int32 lane), as llama.cpp computes
 * them: each row of x is quantized per block to int8 (dx = amax / 127, xq = round(x / dx)) once per call, the
 * block's dot products are exact integer sums, scaled once: d dx sum q xq (+ m dx sum xq for Q4). A fifth of the
 * float kernel's instructions per weight, so one row streams at memory speed and 8-32 rows stay near it; the cost
 * is x's int8 rounding (relative error <= 1/254 of a block's largest input), as with llama.cpp.
 *
 * Layout per tile and block: d (64 bytes), Q4: m (64 bytes), then per group of 4 inputs g: Q8: 2 x 64 bytes,
 * lane c of the first = channel c's 4 quants + 128 (as u8), of the second channel c + 16; Q4: 64 bytes, byte
 * 4 c + j = channel c's quant of input 4 g + j | channel c + 16's << 4. Same sizes as the float kernel's layout. */
int llmd_has_avx512_vnni(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* x row -> per block: int8 quants (xq), scale dx, sum of quants */
static void qv_quantize_row(const float *x, int64_t blocks, int8_t *xq, float *dx, int32_t *xqsum) {
    for (int64_t b = 0; b < blocks; b++) {
        const __m512 v0 = _mm512_loadu_ps(x + b * QB), v1 = _mm512_loadu_ps(x + b * QB + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inv)));
        const __m512i i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inv)));
        _mm_storeu_si128((__m128i *)(xq + b * QB), _mm512_cvtsepi32_epi8(i0));
        _mm_storeu_si128((__m128i *)(xq + b * QB + 16), _mm512_cvtsepi32_epi8(i1));
        dx[b] = amax / 127.0f;
        xqsum[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
    }
}

#ifndef QV_PREFETCH
#define QV_PREFETCH 8192 /* bytes ahead in a tile's stream */
#endif
static inline __attribute__((always_inline)) void qv_block(const int8_t *xq, int64_t K, const float *dx,
                                                          const int32_t *xqsum, const uint8_t *tile,
                                                          const float *bias, float *y, int64_t ys, int real,
                                                          const int MR, const int fmt) {
    __m512 a0[Q_MR], a1[Q_MR];
    __m512i s0[Q_MR], s1[Q_MR];
    ROWS_UNROLLED for (int i = 0; i < MR; i++) a0[i] = a1[i] = _mm512_setzero_ps();
    const int64_t bb = q_block_bytes(fmt), blocks = K / QB;
    const __m512i low4 = _mm512_set1_epi8(15);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *hdr = tile + b * bb, *qs = hdr + (fmt == Q_FMT_Q4 ? 128 : 64);
        for (int64_t l = 0; l < (fmt == Q_FMT_Q4 ? 128 : 64); l += 64) __builtin_prefetch(hdr + QV_PREFETCH + l, 0, 3);
        ROWS_UNROLLED for (int i = 0; i < MR; i++) s0[i] = s1[i] = _mm512_setzero_si512();
        for (int g = 0; g < QB / 4; g++) {
            __builtin_prefetch(qs + g * (fmt == Q_FMT_Q4 ? 64 : 128) + QV_PREFETCH, 0, 3);
            if (fmt == Q_FMT_Q8) __builtin_prefetch(qs + g * 128 + 64 + QV_PREFETCH, 0, 3);
            __m512i lo, hi;
            if (fmt == Q_FMT_Q4) {
                const __m512i v = _mm512_loadu_si512(qs + g * 64);
                lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            } else {
                lo = _mm512_loadu_si512(qs + g * 128), hi = _mm512_loadu_si512(qs + g * 128 + 64);
            }
            ROWS_UNROLLED for (int i = 0; i < MR; i++) {
                int32_t four;
                memcpy(&four, xq + i * K + b * QB + 4 * g, 4);
                const __m512i xb = _mm512_set1_epi32(four);
                s0[i] = _mm512_dpbusd_epi32(s0[i], lo, xb);
                s1[i] = _mm512_dpbusd_epi32(s1[i], hi, xb);
            }
        }
        const __m512 d0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)hdr));
        const __m512 d1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(hdr + 32)));
        __m512 m0 = _mm512_setzero_ps(), m1 = m0;
        if (fmt == Q_FMT_Q4) {
            m0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(hdr + 64)));
            m1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(hdr + 96)));
        }
        ROWS_UNROLLED for (int i = 0; i < MR; i++) {
            const float sx = dx[i * blocks + b];
            const __m512 scale = _mm512_set1_ps(sx);
            if (fmt == Q_FMT_Q8) { /* the quants were stored + 128: take 128 * sum(xq) back */
                const __m512i off = _mm512_set1_epi32(128 * xqsum[i * blocks + b]);
                s0[i] = _mm512_sub_epi32(s0[i], off), s1[i] = _mm512_sub_epi32(s1[i], off);
            }
            a0[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0[i]), _mm512_mul_ps(d0, scale), a0[i]);
            a1[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1[i]), _mm512_mul_ps(d1, scale), a1[i]);
            if (fmt == Q_FMT_Q4) {
                const __m512 mx = _mm512_set1_ps(sx * (float)xqsum[i * blocks + b]);
                a0[i] = _mm512_fmadd_ps(mx, m0, a0[i]), a1[i] = _mm512_fmadd_ps(mx, m1, a1[i]);
            }
        }
    }
    float tmp[Q_NR];
    ROWS_UNROLLED for (int i = 0; i < MR; i++) {
        _mm512_storeu_ps(tmp, a0[i]);
        _mm512_storeu_ps(tmp + 16, a1[i]);
        q_store_row(tmp, bias, y + i * ys, real);
    }
}

#define QV_CASE(R)                                                                                           \
    case R:                                                                                                  \
        if (fmt == Q_FMT_Q4) qv_block(xq, K, dx, xqsum, tile, bias, y, ys, real, R, Q_FMT_Q4);               \
        else qv_block(xq, K, dx, xqsum, tile, bias, y, ys, real, R, Q_FMT_Q8);                               \
        break;
static void qv_rows(int fmt, const int8_t *xq, int64_t K, const float *dx, const int32_t *xqsum,
                    const uint8_t *tile, const float *bias, float *y, int64_t ys, int real, int64_t mr) {
    switch (mr) {
    QV_CASE(1) QV_CASE(2) QV_CASE(3) QV_CASE(4) QV_CASE(5)
    default: QV_CASE(Q_MR)
    }
}
#endif

int llmd_has_qv_linear_avx2(void);
int llmd_qv_linear_avx2(int, const float *, int64_t, const uint8_t *, const float *, float *, int64_t, int64_t,
                        int64_t, int); /* qv_linear_avx2.c */

int llmd_q_dequant_min_rows_avx2(void); /* q_linear_avx2.c */

/* whether llmd_qv_linear runs here: AVX-512 VNNI, or AVX2's pairs of multiply-adds (qv_linear_avx2.c) */
int llmd_has_qv_linear(void) { return llmd_has_avx512_vnni() || llmd_has_qv_linear_avx2(); }

/* rows from which llmd_qv_linear takes x as float32 against the exact weights instead of rounding it to int8:
 * DEQUANT_MIN_ROWS (q_linear_avx2.c) on AVX2, 0 (never) with AVX-512 VNNI or without a kernel */
int llmd_qv_exact_min_rows(void) { return llmd_has_avx512_vnni() ? 0 : llmd_q_dequant_min_rows_avx2(); }

/* llmd_q_linear's contract with the weights llmd_q_pack packed with vnni = 1; on CPUs without AVX-512 VNNI the AVX2
 * kernel's (the same integer sums and float steps below llmd_qv_exact_min_rows rows), -2 without either. */
int llmd_qv_linear(int fmt, const float *x, int64_t x_stride, const uint8_t *packed, const float *bias, float *y,
                   int64_t M, int64_t N, int64_t K, int nthreads) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if (K % QB || nthreads < 1 || M < 1 || (fmt != Q_FMT_Q8 && fmt != Q_FMT_Q4)) return -1;
    const int64_t tiles = (N + Q_NR - 1) / Q_NR, blocks = K / QB, tile_bytes = blocks * q_block_bytes(fmt);
    int8_t *xq;
    float *dx;
    int32_t *xqsum;
    void *inputs = qv_inputs_alloc(M, K, &xq, &dx, &xqsum);
    if (!inputs) return -3;
    for (int64_t i = 0; i < M; i++) qv_quantize_row(x + i * x_stride, blocks, xq + i * K, dx + i * blocks, xqsum + i * blocks);
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < tiles; t++) {
        const uint8_t *tile = packed + t * tile_bytes;
        const int real = N - t * Q_NR < Q_NR ? (int)(N - t * Q_NR) : Q_NR;
        for (int64_t m = 0; m < M; m += Q_MR)
            qv_rows(fmt, xq + m * K, K, dx + m * blocks, xqsum + m * blocks, tile, bias ? bias + t * Q_NR : NULL,
                    y + m * N + t * Q_NR, N, real, M - m < Q_MR ? M - m : Q_MR);
    }
    free(inputs);
    return 0;
#else
    return llmd_qv_linear_avx2(fmt, x, x_stride, packed, bias, y, M, N, K, nthreads);
#endif
}
