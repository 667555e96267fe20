/* The linears on packed weights for AVX-512 CPUs: float32 (AVX2 in f32_linear_avx2.c), bfloat16 (AVX-512 BF16;
 * AMX tiles in amx_linear.c), and GGUF-quantized weights at prefill sizes through the bf16 kernel. */
#include "q_format.h"
#include "tile_groups.h"

extern int llmd_tile_ahead_rows; /* cpu_kernels.c */
int llmd_has_avx512(void);      /* cpu_kernels.c */

/* ---------------------------------------------------------------- float32 linear (AVX-512) */

/* Weights packed at load (llmd_f32_pack) in tiles of F32_NR output channels, k-major inside a tile: tile t,
 * input k -> F32_NR contiguous floats (N padded with zero channels). One tile is one sequential stream, and a
 * micro-kernel of up to 12 rows x 32 channels keeps 24 accumulators in registers: bandwidth-bound at one row
 * (1.6x oneDNN's packed GEMM on SmolLM2's projections, Zen 4) and compute-bound at many (on par at 2048 rows). */
#define F32_NR 32
#define F32_MR 12

/* Tiles side by side on `nthreads`: packing is part of every engine start (SmolLM2's 478 MB of projections took 1.6 s
 * on one thread, Zen 3), and a tile's 32 source rows walked in k order read each cache line once. */
int llmd_f32_pack(const float *w, int64_t N, int64_t K, float *packed, int nthreads) {
    const int64_t tiles = (N + F32_NR - 1) / F32_NR;
#pragma omp parallel for schedule(static) num_threads(nthreads > 0 ? nthreads : 1)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t real = N - t * F32_NR < F32_NR ? N - t * F32_NR : F32_NR;
        float *out = packed + t * K * F32_NR;
        for (int64_t k = 0; k < K; k++) {
            for (int64_t c = 0; c < real; c++) out[k * F32_NR + c] = w[(t * F32_NR + c) * K + k];
            for (int64_t c = real; c < F32_NR; c++) out[k * F32_NR + c] = 0.0f;
        }
    }
    return 0;
}

#if defined(__AVX512F__)
/* rows [0, MR) of x against one tile: y[i * ys + c] = x_i . w_c (+ bias) for the tile's `real` channels */
static inline __attribute__((always_inline)) void f32_block(const float *x, int64_t xs, const float *tile,
                                                           int64_t K, const float *bias, float *y, int64_t ys,
                                                           int real, const int MR) {
    __m512 a0[F32_MR], a1[F32_MR];
    ROWS_UNROLLED for (int i = 0; i < MR; i++) a0[i] = a1[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const float *wp = tile + k * F32_NR;
        _mm_prefetch((const char *)(wp + F32_NR * 8), _MM_HINT_T0);
        _mm_prefetch((const char *)(wp + F32_NR * 8 + 16), _MM_HINT_T0);
        const __m512 w0 = _mm512_loadu_ps(wp), w1 = _mm512_loadu_ps(wp + 16);
        ROWS_UNROLLED for (int i = 0; i < MR; i++) {
            const __m512 xb = _mm512_set1_ps(x[i * xs + k]);
            a0[i] = _mm512_fmadd_ps(xb, w0, a0[i]);
            a1[i] = _mm512_fmadd_ps(xb, w1, a1[i]);
        }
    }
    float tmp[F32_NR];
    ROWS_UNROLLED for (int i = 0; i < MR; i++) {
        _mm512_storeu_ps(tmp, a0[i]);
        _mm512_storeu_ps(tmp + 16, a1[i]);
        q_store_row(tmp, bias, y + i * ys, real);
    }
}

/* f32_block's walk that also prefetches another tile: one k-row of `ahead` (both lines) every `every` iterations.
 * A copy, as in f32_linear_avx2.c (rows_block_ahead): a flag on the plain walk slowed it there. */
static inline __attribute__((always_inline)) void f32_block_ahead(const float *x, int64_t xs, const float *tile,
                                                                 int64_t K, const float *bias, float *y, int64_t ys,
                                                                 int real, const float *ahead, int64_t every,
                                                                 const int MR) {
    __m512 a0[F32_MR], a1[F32_MR];
    ROWS_UNROLLED for (int i = 0; i < MR; i++) a0[i] = a1[i] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < K; k0 += every, ahead += F32_NR) {
        _mm_prefetch((const char *)ahead, _MM_HINT_T1);
        _mm_prefetch((const char *)(ahead + 16), _MM_HINT_T1);
        const int64_t k1 = k0 + every < K ? k0 + every : K;
        for (int64_t k = k0; k < k1; k++) {
            const float *wp = tile + k * F32_NR;
            _mm_prefetch((const char *)(wp + F32_NR * 8), _MM_HINT_T0);
            _mm_prefetch((const char *)(wp + F32_NR * 8 + 16), _MM_HINT_T0);
            const __m512 w0 = _mm512_loadu_ps(wp), w1 = _mm512_loadu_ps(wp + 16);
            ROWS_UNROLLED for (int i = 0; i < MR; i++) {
                const __m512 xb = _mm512_set1_ps(x[i * xs + k]);
                a0[i] = _mm512_fmadd_ps(xb, w0, a0[i]);
                a1[i] = _mm512_fmadd_ps(xb, w1, a1[i]);
            }
        }
    }
    float tmp[F32_NR];
    ROWS_UNROLLED for (int i = 0; i < MR; i++) {
        _mm512_storeu_ps(tmp, a0[i]);
        _mm512_storeu_ps(tmp + 16, a1[i]);
        q_store_row(tmp, bias, y + i * ys, real);
    }
}

#define F32_AHEAD_CASE(R) case R: f32_block_ahead(x, xs, tile, K, bias, y, ys, real, ahead, every, R); break;
static void f32_rows_ahead(const float *x, int64_t xs, const float *tile, int64_t K, const float *bias, float *y,
                           int64_t ys, int real, const float *ahead, int64_t every, int64_t mr) {
    switch (mr) {
    F32_AHEAD_CASE(1) F32_AHEAD_CASE(2) F32_AHEAD_CASE(3) F32_AHEAD_CASE(4) F32_AHEAD_CASE(5) F32_AHEAD_CASE(6)
    F32_AHEAD_CASE(7) F32_AHEAD_CASE(8) F32_AHEAD_CASE(9) F32_AHEAD_CASE(10) F32_AHEAD_CASE(11)
    default: f32_block_ahead(x, xs, tile, K, bias, y, ys, real, ahead, every, F32_MR);
    }
}

/* one row against G (1-3) adjacent tiles in lockstep: G weight streams a core, as f32_linear_avx2.c's row_tiles
 * (measured there, on Zen 2: 26 -> 37-40 GB/s; on Zen 4 even with the one-tile walk, which already reads at the
 * memory's rate there: LLMDEPLOY_ROW_STREAMS=1 restores it, and bench/linear_rows.py times both). Each output sums
 * over k in order: f32_block's bits. */
static inline __attribute__((always_inline)) void f32_row_tiles(const float *x, const float *packed, int64_t K,
                                                               int64_t N, int64_t t, const float *bias, float *y,
                                                               const int G) {
    __m512 a0[3], a1[3];
    ROWS_UNROLLED for (int g = 0; g < G; g++) a0[g] = a1[g] = _mm512_setzero_ps();
    const float *w = packed + t * F32_NR * K;
    for (int64_t k = 0; k < K; k++) {
        const __m512 xb = _mm512_set1_ps(x[k]);
        ROWS_UNROLLED for (int g = 0; g < G; g++) {
            const float *wp = w + (g * K + k) * F32_NR;
            a0[g] = _mm512_fmadd_ps(xb, _mm512_loadu_ps(wp), a0[g]);
            a1[g] = _mm512_fmadd_ps(xb, _mm512_loadu_ps(wp + 16), a1[g]);
        }
    }
    float tmp[F32_NR];
    ROWS_UNROLLED for (int g = 0; g < G; g++) {
        const int64_t c = (t + g) * F32_NR;
        _mm512_storeu_ps(tmp, a0[g]);
        _mm512_storeu_ps(tmp + 16, a1[g]);
        q_store_row(tmp, bias ? bias + c : NULL, y + c, N - c < F32_NR ? (int)(N - c) : F32_NR);
    }
}

#define F32_CASE(R) case R: f32_block(x, xs, tile, K, bias, y, ys, real, R); break;
static void f32_rows(const float *x, int64_t xs, const float *tile, int64_t K, const float *bias, float *y,
                     int64_t ys, int real, int64_t mr) {
    switch (mr) {
    F32_CASE(1) F32_CASE(2) F32_CASE(3) F32_CASE(4) F32_CASE(5) F32_CASE(6)
    F32_CASE(7) F32_CASE(8) F32_CASE(9) F32_CASE(10) F32_CASE(11)
    default: f32_block(x, xs, tile, K, bias, y, ys, real, F32_MR);
    }
}
#endif

int llmd_f32_linear_avx2(const float *, int64_t, const float *, const float *, float *, int64_t, int64_t, int64_t,
                         int); /* f32_linear_avx2.c: the same contract on AVX2 + FMA, -2 without them */
int llmd_has_f32_linear_avx2(void);

/* Whether llmd_f32_linear runs here: AVX-512, else AVX2 + FMA (f32_linear_avx2.c) */
int llmd_has_f32_linear(void) { return llmd_has_avx512() || llmd_has_f32_linear_avx2(); }

/* y[M, N] (contiguous) = x[M, K] (row stride x_stride) @ w[N, K]^T (+ bias[N]), w packed by llmd_f32_pack.
 * Threads split the channel tiles; each tile meets every row block while it is in cache. Without AVX-512 the
 * AVX2 kernel runs (-2 without that either). */
int llmd_f32_linear(const float *x, int64_t x_stride, const float *packed, const float *bias, float *y, int64_t M,
                    int64_t N, int64_t K, int nthreads) {
#if defined(__AVX512F__)
    if (nthreads < 1 || M < 1) return -1;
    const int64_t tiles = (N + F32_NR - 1) / F32_NR;
    if (M == 1 && llmd_row_streams > 1) { /* decode at batch 1: tiles side by side (tile_groups.h) */
#define ROW_WALK(t, G) f32_row_tiles(x, packed, K, N, t, bias, y, G)
        SIDE_BY_SIDE_TILE_GROUPS(ROW_WALK);
#undef ROW_WALK
        return 0;
    }
    /* up to llmd_tile_ahead_rows rows, walks 1.. of a tile each prefetch a share of the next tile, so its first
     * walk reads cache instead of memory (as in f32_linear_avx2.c); many rows go LLMD_ROW_CHUNK at a time */
#pragma omp parallel num_threads(nthreads)
    for (int64_t m0 = 0; m0 < M; m0 += LLMD_ROW_CHUNK) {
        const int64_t mc = M - m0 < LLMD_ROW_CHUNK ? M - m0 : LLMD_ROW_CHUNK;
        const int64_t walks = (mc + F32_MR - 1) / F32_MR, every = walks > 1 ? walks - 1 : 1;
        const int ahead_on = walks > 1 && mc <= llmd_tile_ahead_rows, share = (int)((K + every - 1) / every);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const float *tile = packed + t * F32_NR * K, *next = t + 1 < tiles ? tile + F32_NR * K : NULL;
            const int real = N - t * F32_NR < F32_NR ? (int)(N - t * F32_NR) : F32_NR;
            const float *tb = bias ? bias + t * F32_NR : NULL;
            for (int64_t m = m0, walk = 0; m < m0 + mc; m += F32_MR, walk++) {
                const int64_t mr = m0 + mc - m < F32_MR ? m0 + mc - m : F32_MR;
                if (ahead_on && next && walk >= 1)
                    f32_rows_ahead(x + m * x_stride, x_stride, tile, K, tb, y + m * N + t * F32_NR, N, real,
                                   next + (walk - 1) * share * F32_NR, every, mr);
                else
                    f32_rows(x + m * x_stride, x_stride, tile, K, tb, y + m * N + t * F32_NR, N, real, mr);
            }
        }
    }
    return 0;
#else
    return llmd_f32_linear_avx2(x, x_stride, packed, bias, y, M, N, K, nthreads);
#endif
}

/* ---------------------------------------------------------------- bfloat16 linear (AVX-512 BF16) */

/* bf16 weights packed at load (llmd_bf16_pack) in tiles of BF16_NR channels and pairs of inputs: tile t, pair p
 * -> 2 x 16 channels x (w[c, 2p], w[c, 2p + 1]), the operand order of vdpbf16ps, which adds both products of a
 * pair into a float32 lane. Half the bytes of float32 for the bandwidth-bound rows of decode; many rows stay with
 * oneDNN (AMX or its own bf16 GEMM). K must be even. */
#define BF16_NR 32

int llmd_has_avx512_bf16(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

int llmd_bf16_pack(const uint16_t *w, int64_t N, int64_t K, uint16_t *packed, int nthreads) {
    if (K % 2) return -1;
    const int64_t tiles = (N + BF16_NR - 1) / BF16_NR;
#pragma omp parallel for schedule(static) num_threads(nthreads > 0 ? nthreads : 1)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t real = N - t * BF16_NR < BF16_NR ? N - t * BF16_NR : BF16_NR;
        uint16_t *out = packed + t * K * BF16_NR;
        for (int64_t p = 0; p < K / 2; p++) {
            for (int64_t c = 0; c < real; c++) {
                out[(p * BF16_NR + c) * 2] = w[(t * BF16_NR + c) * K + 2 * p];
                out[(p * BF16_NR + c) * 2 + 1] = w[(t * BF16_NR + c) * K + 2 * p + 1];
            }
            for (int64_t c = real; c < BF16_NR; c++) out[(p * BF16_NR + c) * 2] = out[(p * BF16_NR + c) * 2 + 1] = 0;
        }
    }
    return 0;
}

#if defined(__AVX512BF16__)
typedef struct {
    __m512 b0, b1;    /* the bias of channels 0-15 and 16-31, float32 (0 past `real`, or without a bias) */
    __mmask16 m0, m1; /* which of those channels are real */
} llmd_tile_epilogue;

/* What a 32-channel tile's store needs (here and in amx_linear.c): bias bf16, or float32 where out_f32. */
llmd_tile_epilogue llmd_bf16_tile_epilogue(const void *bias, int real, int out_f32) {
    float b[BF16_NR] = {0};
    for (int c = 0; bias && c < real; c++) {
        if (out_f32) {
            b[c] = ((const float *)bias)[c];
            continue;
        }
        const uint32_t u = (uint32_t)((const uint16_t *)bias)[c] << 16;
        memcpy(&b[c], &u, sizeof u);
    }
    llmd_tile_epilogue e = {_mm512_loadu_ps(b), _mm512_loadu_ps(b + 16), 0, 0};
    e.m0 = real >= 16 ? 0xFFFF : (__mmask16)((1u << real) - 1);
    e.m1 = real <= 16 ? 0 : real >= 32 ? 0xFFFF : (__mmask16)((1u << (real - 16)) - 1);
    return e;
}

/* OUT_F32 (a constant where inlined): float32 bias and output (q_bf16_linear) instead of bf16 ones */
static inline __attribute__((always_inline)) void bf16_block(const uint16_t *x, int64_t xs, const uint16_t *tile,
                                                            int64_t K, const void *bias, void *y, int64_t ys,
                                                            int real, const int MR, const int OUT_F32) {
    __m512 a0[F32_MR], a1[F32_MR];
    ROWS_UNROLLED for (int i = 0; i < MR; i++) a0[i] = a1[i] = _mm512_setzero_ps();
    for (int64_t p = 0; p < K / 2; p++) {
        const uint16_t *wp = tile + p * BF16_NR * 2;
        _mm_prefetch((const char *)(wp + BF16_NR * 2 * 8), _MM_HINT_T0);
        _mm_prefetch((const char *)(wp + BF16_NR * 2 * 8 + 32), _MM_HINT_T0);
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp), w1 = (__m512bh)_mm512_loadu_si512(wp + 32);
        ROWS_UNROLLED for (int i = 0; i < MR; i++) {
            int32_t pair;
            memcpy(&pair, x + i * xs + 2 * p, sizeof pair);
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            a0[i] = _mm512_dpbf16_ps(a0[i], xb, w0);
            a1[i] = _mm512_dpbf16_ps(a1[i], xb, w1);
        }
    }
    const llmd_tile_epilogue e = llmd_bf16_tile_epilogue(bias, real, OUT_F32);
    const __m512 b0 = e.b0, b1 = e.b1;
    const __mmask16 m0 = e.m0, m1 = e.m1;
    ROWS_UNROLLED for (int i = 0; i < MR; i++) {
        if (OUT_F32) {
            float *yf = (float *)y + i * ys;
            _mm512_mask_storeu_ps(yf, m0, _mm512_add_ps(a0[i], b0));
            _mm512_mask_storeu_ps(yf + 16, m1, _mm512_add_ps(a1[i], b1));
            continue;
        }
        uint16_t *yb = (uint16_t *)y + i * ys;
        const __m256bh r0 = _mm512_cvtneps_pbh(_mm512_add_ps(a0[i], b0));
        const __m256bh r1 = _mm512_cvtneps_pbh(_mm512_add_ps(a1[i], b1));
        _mm256_mask_storeu_epi16(yb, m0, (__m256i)r0);
        _mm256_mask_storeu_epi16(yb + 16, m1, (__m256i)r1);
    }
}

/* one row against G (1-3) tiles t, t + d, ... side by side: G weight streams a core, each the run of tiles
 * FOR_TILE_RUNS gives it (tile_groups.h; Zen 4: 0.91-1.03x the one-tile walk's time at d = 1, the runs faster
 * still; LLMDEPLOY_ROW_STREAMS=1 restores the one-tile walk). Each output adds its pairs in order, one vdpbf16ps a
 * pair, and rounds once: bf16_block's bits. */
static inline __attribute__((always_inline)) void bf16_row_tiles(const uint16_t *x, const uint16_t *packed, int64_t K,
                                                                int64_t N, int64_t t, int64_t d,
                                                                const uint16_t *bias, uint16_t *y, const int G) {
    __m512 a0[3], a1[3];
    ROWS_UNROLLED for (int g = 0; g < G; g++) a0[g] = a1[g] = _mm512_setzero_ps();
    const uint16_t *w = packed + t * BF16_NR * K;
    for (int64_t p = 0; p < K / 2; p++) {
        int32_t pair;
        memcpy(&pair, x + 2 * p, sizeof pair);
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
        ROWS_UNROLLED for (int g = 0; g < G; g++) {
            const uint16_t *wp = w + g * d * BF16_NR * K + p * BF16_NR * 2;
            a0[g] = _mm512_dpbf16_ps(a0[g], xb, (__m512bh)_mm512_loadu_si512(wp));
            a1[g] = _mm512_dpbf16_ps(a1[g], xb, (__m512bh)_mm512_loadu_si512(wp + 32));
        }
    }
    ROWS_UNROLLED for (int g = 0; g < G; g++) {
        const int64_t c = (t + g * d) * BF16_NR;
        const llmd_tile_epilogue e =
            llmd_bf16_tile_epilogue(bias ? bias + c : NULL, N - c < BF16_NR ? (int)(N - c) : BF16_NR, 0);
        _mm256_mask_storeu_epi16(y + c, e.m0, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(a0[g], e.b0)));
        _mm256_mask_storeu_epi16(y + c + 16, e.m1, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(a1[g], e.b1)));
    }
}

#define BF16_CASE(R)                                                                                         \
    case R:                                                                                                  \
        if (out_f32) bf16_block(x, xs, tile, K, bias, y, ys, real, R, 1);                                    \
        else bf16_block(x, xs, tile, K, bias, y, ys, real, R, 0);                                            \
        break;
static void bf16_rows(const uint16_t *x, int64_t xs, const uint16_t *tile, int64_t K, const void *bias, void *y,
                      int64_t ys, int real, int64_t mr, int out_f32) {
    switch (mr) {
    BF16_CASE(1) BF16_CASE(2) BF16_CASE(3) BF16_CASE(4) BF16_CASE(5) BF16_CASE(6)
    BF16_CASE(7) BF16_CASE(8) BF16_CASE(9) BF16_CASE(10) BF16_CASE(11)
    default: BF16_CASE(F32_MR)
    }
}
#endif

int llmd_bf16_linear_amx(const uint16_t *, int64_t, const uint16_t *, const void *, void *, int64_t, int64_t, int64_t,
                         int, int); /* amx_linear.c: -1 where it does not apply */

int llmd_bf16_linear_avx2(const uint16_t *, int64_t, const uint16_t *, const uint16_t *, uint16_t *, int64_t, int64_t,
                          int64_t, int);
int llmd_has_bf16_linear_avx2(void);
int llmd_has_bf16_linear(void) { return llmd_has_avx512_bf16() || llmd_has_bf16_linear_avx2(); }

/* y[M, N] bf16 (contiguous) = x[M, K] bf16 (row stride x_stride) @ w[N, K]^T (+ bias[N]) with float32 sums,
 * rounded once to bf16 (as oneDNN does); w packed by llmd_bf16_pack. Without AVX-512 BF16 the AVX2 kernel runs it
 * (bf16_linear_avx2.c); -2 without either. */
int llmd_bf16_linear(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
                     int64_t M, int64_t N, int64_t K, int nthreads) {
#if defined(__AVX512BF16__)
    if (nthreads < 1 || M < 1 || K % 2) return -1;
    if (llmd_bf16_linear_amx(x, x_stride, packed, bias, y, M, N, K, nthreads, 0) == 0) return 0;
    const int64_t tiles = (N + BF16_NR - 1) / BF16_NR;
    if (M == 1 && llmd_row_streams > 1) { /* decode at batch 1: runs of tiles side by side (tile_groups.h) */
#define ROW_WALK(t, d, G) bf16_row_tiles(x, packed, K, N, t, d, bias, y, G)
        SIDE_BY_SIDE_TILE_RUNS(ROW_WALK);
#undef ROW_WALK
        return 0;
    }
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < tiles; t++) {
        const uint16_t *tile = packed + t * BF16_NR * K;
        const int real = N - t * BF16_NR < BF16_NR ? (int)(N - t * BF16_NR) : BF16_NR;
        for (int64_t m = 0; m < M; m += F32_MR)
            bf16_rows(x + m * x_stride, x_stride, tile, K, bias ? bias + t * BF16_NR : NULL, y + m * N + t * BF16_NR,
                      N, real, M - m < F32_MR ? M - m : F32_MR, 0);
    }
    return 0;
#else
    return llmd_bf16_linear_avx2(x, x_stride, packed, bias, y, M, N, K, nthreads);
#endif
}

/* llmd_bf16_linear's sums without its rounding to bf16 and without a bias: y[M, N] float32 (the head screen's
 * logits, head_screen.c). -2 without AVX-512 BF16. */
int llmd_bf16_linear_f32out(const uint16_t *x, int64_t x_stride, const uint16_t *packed, float *y, int64_t M, int64_t N,
                            int64_t K, int nthreads) {
#if defined(__AVX512BF16__)
    if (nthreads < 1 || M < 1 || K % 2) return -1;
    if (llmd_bf16_linear_amx(x, x_stride, packed, NULL, y, M, N, K, nthreads, 1) == 0) return 0;
    const int64_t tiles = (N + BF16_NR - 1) / BF16_NR;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < tiles; t++) {
        const int real = N - t * BF16_NR < BF16_NR ? (int)(N - t * BF16_NR) : BF16_NR;
        for (int64_t m = 0; m < M; m += F32_MR)
            bf16_rows(x + m * x_stride, x_stride, packed + t * BF16_NR * K, K, NULL, y + m * N + t * BF16_NR, N, real,
                      M - m < F32_MR ? M - m : F32_MR, 1);
    }
    return 0;
#else
    (void)x; (void)x_stride; (void)packed; (void)y; (void)M; (void)N; (void)K; (void)nthreads;
    return -2;
#endif
}

/* ---------------------------------------------------------------- block-quantized weights, many rows (AVX-512 BF16) */

/* The float kernel's Q8/Q4 layout (llmd_q_pack, vnni = 0) at prefill sizes: each 32-channel tile is dequantized
 * once per call (d * q (+ m) in float32, rounded to bf16) into the bf16 kernel's pair layout, x is rounded to bf16
 * once, and bf16_block multiplies with float32 sums. Weight-only quantization keeps activations out of int8 (the
 * VNNI kernel's rounding of x cost int8 half its greedy agreement with float32); this is the bf16 model's
 * precision at about the bf16 GEMM's speed, where the float32 kernel would take 2.4x the VNNI one's time. */
#if defined(__AVX512BF16__)
/* 16 channels' weights of inputs k (even) and k + 1, float32 -> the bf16 kernel's pairs (lane c: w_k | w_k+1 << 16) */
static inline __m512i bf16_pairs(__m512 even, __m512 odd) {
    const __m512i e = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(even));
    const __m512i o = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(odd));
    return _mm512_or_si512(e, _mm512_slli_epi32(o, 16));
}

/* one packed tile (float kernel layout) -> bf16 pairs: wt[((k / 2) * 32 + c) * 2 + k % 2] = bf16(d_c q + m_c) */
static void q_tile_to_bf16(int fmt, const uint8_t *tile, int64_t blocks, uint16_t *wt) {
    const int64_t bb = q_block_bytes(fmt);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *hdr = tile + b * bb, *qs = hdr + (fmt == Q_FMT_Q4 ? 128 : 64);
        const __m512 d0 = v16_half(hdr), d1 = v16_half(hdr + 32);
        const __m512 m0 = fmt == Q_FMT_Q4 ? v16_half(hdr + 64) : _mm512_setzero_ps();
        const __m512 m1 = fmt == Q_FMT_Q4 ? v16_half(hdr + 96) : _mm512_setzero_ps();
        for (int kk = 0; kk < QB; kk += 2) {
            __m512 w[2][2]; /* [input kk, kk + 1][channels 0-15, 16-31] */
            for (int j = 0; j < 2; j++) {
                __m512 q0, q1;
                if (fmt == Q_FMT_Q4) v16_u4(qs + (kk + j) * 16, &q0, &q1);
                else q0 = v16_i8(qs + (kk + j) * 32), q1 = v16_i8(qs + (kk + j) * 32 + 16);
                /* d * q is exact in float32; + m one rounding, as the float kernel and a dequantizing loader */
                w[j][0] = fmt == Q_FMT_Q4 ? _mm512_add_ps(_mm512_mul_ps(d0, q0), m0) : _mm512_mul_ps(d0, q0);
                w[j][1] = fmt == Q_FMT_Q4 ? _mm512_add_ps(_mm512_mul_ps(d1, q1), m1) : _mm512_mul_ps(d1, q1);
            }
            uint16_t *out = wt + ((b * QB + kk) / 2) * BF16_NR * 2;
            _mm512_storeu_si512(out, bf16_pairs(w[0][0], w[1][0]));
            _mm512_storeu_si512(out + 32, bf16_pairs(w[0][1], w[1][1]));
        }
    }
}

#endif

int llmd_q_bf16_linear(int fmt, const float *x, int64_t x_stride, const uint8_t *packed, const float *bias, float *y,
                       int64_t M, int64_t N, int64_t K, int nthreads) {
#if defined(__AVX512BF16__)
    if (K % QB || nthreads < 1 || M < 1 || (fmt != Q_FMT_Q8 && fmt != Q_FMT_Q4)) return -1;
    const int64_t tiles = (N + Q_NR - 1) / Q_NR, blocks = K / QB, bb = q_block_bytes(fmt);
    uint16_t *xb = malloc(sizeof(uint16_t) * (size_t)(M * K));
    if (!xb) return -3;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t i = 0; i < M; i++)
        for (int64_t k = 0; k < K; k += 16) /* K is a multiple of 32 */
            _mm256_storeu_si256((__m256i *)(xb + i * K + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i * x_stride + k)));
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        uint16_t *wt = malloc(sizeof(uint16_t) * (size_t)(BF16_NR * K)); /* one tile, pair layout */
        if (!wt) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            if (!wt) continue;
            q_tile_to_bf16(fmt, packed + t * blocks * bb, blocks, wt);
            const int real = N - t * Q_NR < Q_NR ? (int)(N - t * Q_NR) : Q_NR;
            for (int64_t m = 0; m < M; m += F32_MR)
                bf16_rows(xb + m * K, K, wt, K, bias ? bias + t * Q_NR : NULL, y + m * N + t * Q_NR, N, real,
                          M - m < F32_MR ? M - m : F32_MR, 1);
        }
        free(wt);
    }
    free(xb);
    return failed ? -3 : 0;
#else
    (void)fmt; (void)x; (void)x_stride; (void)packed; (void)bias; (void)y; (void)M; (void)N; (void)K; (void)nthreads;
    return -2;
#endif
}
