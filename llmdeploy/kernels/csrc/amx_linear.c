/* bf16 linear on AMX tiles (Intel AMX-BF16), reading the same packed weights as the AVX-512 BF16 kernel in
 * linear_avx512.c: a 32-channel tile's pair rows (2 x 16 channels x 2 inputs, 128 bytes) are two AMX B tiles side by
 * side, so one copy of each weight serves both kernels and nothing is repacked. llmd_bf16_linear hands calls here
 * from llmd_amx_configure's row count up (many rows: one TDPBF16PS does 16 rows x 16 channels x 32 inputs, 8x a vdpbf16ps
 * loop's work per instruction); decode's few rows stay on vdpbf16ps, where the weight stream is the cost anyway.
 *
 * Tiles: 0-3 accumulators (row block r, channel half h -> 2r + h), 4-5 inputs (row block r), 6-7 weights (half h).
 * Linux hands a process AMX's tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM), once; tile
 * configuration is per thread, so every call configures in each thread it runs on (oneDNN, in the same threads,
 * configures its own) and releases at the end. */
#include <stdint.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_NR 32 /* channels per packed tile (BF16_NR in linear_avx512.c) */
#define AMX_MR 16 /* rows per tile */
#define AMX_KB 32 /* inputs per tile row: 16 pairs */
#define AMX_M_BLOCK 256 /* rows whose inputs stay in L2 while a thread walks its weight tiles */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#ifndef LLMD_AMX_REQUEST_TILES /* the tests' emulated build (tests/kernels/emulated/amx_tiles.h) grants its own */
#define LLMD_AMX_REQUEST_TILES() (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0)
#endif

typedef struct {
    __m512 b0, b1;
    __mmask16 m0, m1;
} llmd_tile_epilogue; /* linear_avx512.c: a tile's bias and channel masks */
llmd_tile_epilogue llmd_bf16_tile_epilogue(const void *bias, int real, int out_f32);

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tilecfg;

static int64_t amx_min_rows; /* 0: AMX off */
static int amx_state;        /* 0 not asked yet, 1 granted, -1 refused */

/* From min_rows rows llmd_bf16_linear runs on AMX (0: never, the benchmarks' baseline); asks Linux for the tile
 * state on the first call that wants it. Returns the threshold in force, 0 where AMX cannot run. Python calls it
 * at load, before any parallel region, so the statics are never raced. */
int llmd_amx_configure(int min_rows) {
    if (min_rows > 0 && !amx_state)
        amx_state = LLMD_AMX_REQUEST_TILES() ? 1 : -1;
    amx_min_rows = amx_state > 0 && min_rows > 0 ? min_rows : 0;
    return (int)amx_min_rows;
}

static void amx_configure(int rows0, int rows1) {
    amx_tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    const int rows[2] = {rows0, rows1};
    for (int r = 0; r < 2; r++) {
        if (!rows[r]) continue;
        c.rows[2 * r] = c.rows[2 * r + 1] = c.rows[4 + r] = (uint8_t)rows[r];
        c.colsb[2 * r] = c.colsb[2 * r + 1] = c.colsb[4 + r] = 64;
    }
    c.rows[6] = c.rows[7] = AMX_MR;
    c.colsb[6] = c.colsb[7] = 64;
    _tile_loadconfig(&c);
}

/* acc[rows][32] float32 = x[rows (<= 32), K] @ tile^T; TWO: rows > 16 (a second row block) */
static inline __attribute__((always_inline)) void amx_block(const uint16_t *x, int64_t xs, const uint16_t *tile,
                                                           int64_t K, float *acc, const int TWO) {
    _tile_zero(0);
    _tile_zero(1);
    if (TWO) {
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t k = 0; k < K; k += AMX_KB) {
        const uint16_t *w = tile + k * AMX_NR; /* pair k / 2: 32 channels x 2 inputs */
        _tile_loadd(6, w, AMX_NR * 4);
        _tile_loadd(7, w + 32, AMX_NR * 4);
        _tile_loadd(4, x + k, xs * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (TWO) {
            _tile_loadd(5, x + AMX_MR * xs + k, xs * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, acc, AMX_NR * 4);
    _tile_stored(1, acc + 16, AMX_NR * 4);
    if (TWO) {
        _tile_stored(2, acc + AMX_MR * AMX_NR, AMX_NR * 4);
        _tile_stored(3, acc + AMX_MR * AMX_NR + 16, AMX_NR * 4);
    }
}

/* rows of acc + bias -> y (bf16, or float32 where OUT_F32), the first `real` channels */
static void amx_store(const float *acc, int rows, const void *bias, void *y, int64_t ys, int real, int out_f32) {
    const llmd_tile_epilogue e = llmd_bf16_tile_epilogue(bias, real, out_f32);
    const __m512 b0 = e.b0, b1 = e.b1;
    const __mmask16 m0 = e.m0, m1 = e.m1;
    for (int i = 0; i < rows; i++) {
        const __m512 s0 = _mm512_add_ps(_mm512_loadu_ps(acc + i * AMX_NR), b0);
        const __m512 s1 = _mm512_add_ps(_mm512_loadu_ps(acc + i * AMX_NR + 16), b1);
        if (out_f32) {
            float *yf = (float *)y + i * ys;
            _mm512_mask_storeu_ps(yf, m0, s0);
            _mm512_mask_storeu_ps(yf + 16, m1, s1);
            continue;
        }
        uint16_t *yb = (uint16_t *)y + i * ys;
        _mm256_mask_storeu_epi16(yb, m0, (__m256i)_mm512_cvtneps_pbh(s0));
        _mm256_mask_storeu_epi16(yb + 16, m1, (__m256i)_mm512_cvtneps_pbh(s1));
    }
}

/* y[M, N] = x[M, K] @ w[N, K]^T (+ bias) with w in llmd_bf16_pack's layout, float32 sums rounded once; -1 where
 * it does not apply (K not a multiple of 32, AMX not granted, fewer rows than amx_min_rows). */
int llmd_bf16_linear_amx(const uint16_t *x, int64_t xs, const uint16_t *packed, const void *bias, void *y,
                         int64_t M, int64_t N, int64_t K, int nthreads, int out_f32) {
    if (amx_min_rows < 1 || M < amx_min_rows || K % AMX_KB || nthreads < 1) return -1;
    const int64_t tiles = (N + AMX_NR - 1) / AMX_NR, blocks = (M + AMX_M_BLOCK - 1) / AMX_M_BLOCK;
    const size_t out_bytes = out_f32 ? 4 : 2;
#pragma omp parallel num_threads(nthreads)
    {
        float acc[2 * AMX_MR * AMX_NR] __attribute__((aligned(64)));
        int cfg0 = -1, cfg1 = -1;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < blocks * tiles; i++) {
            const int64_t t = i % tiles, mb = i / tiles;
            const uint16_t *tile = packed + t * AMX_NR * K;
            const int real = N - t * AMX_NR < AMX_NR ? (int)(N - t * AMX_NR) : AMX_NR;
            const void *tb = !bias ? NULL : (const char *)bias + (size_t)(t * AMX_NR) * out_bytes;
            const int64_t end = (mb + 1) * AMX_M_BLOCK < M ? (mb + 1) * AMX_M_BLOCK : M;
            for (int64_t m = mb * AMX_M_BLOCK; m < end; m += 2 * AMX_MR) {
                const int rows = end - m < 2 * AMX_MR ? (int)(end - m) : 2 * AMX_MR;
                const int r0 = rows < AMX_MR ? rows : AMX_MR, r1 = rows - r0;
                if (r0 != cfg0 || r1 != cfg1) {
                    amx_configure(r0, r1);
                    cfg0 = r0, cfg1 = r1;
                }
                if (r1) amx_block(x + m * xs, xs, tile, K, acc, 1);
                else amx_block(x + m * xs, xs, tile, K, acc, 0);
                amx_store(acc, rows, tb, (char *)y + (size_t)(m * N + t * AMX_NR) * out_bytes, N, real, out_f32);
            }
        }
        if (cfg0 >= 0) _tile_release();
    }
    return 0;
}
#else
int llmd_amx_configure(int min_rows) {
    (void)min_rows;
    return 0;
}
int llmd_bf16_linear_amx(const uint16_t *x, int64_t xs, const uint16_t *packed, const void *bias, void *y,
                         int64_t M, int64_t N, int64_t K, int nthreads, int out_f32) {
    (void)x; (void)xs; (void)packed; (void)bias; (void)y; (void)M; (void)N; (void)K; (void)nthreads; (void)out_f32;
    return -1;
}
#endif
