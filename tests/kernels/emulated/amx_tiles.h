/* AMX-TILE / AMX-BF16 for the emulated build (tests/kernels/emulated/immintrin.h includes it): the eight tile
 * registers as thread-local memory, configured by _tile_loadconfig as the hardware is, so kernels/csrc/amx_linear.c
 * runs, slowly, on any CPU. Written from Intel's definitions (SDM vol. 2, LDTILECFG, TILELOADD, TILESTORED,
 * TILEZERO, TDPBF16PS, TILERELEASE). Every condition on which the hardware raises #UD (an unconfigured tile, a
 * shape that does not fit, a bad palette) aborts here with the reason, so a tile configuration the real unit would
 * refuse fails the tests instead of waiting for a session on an AMX machine. */
#ifndef SHIM_AMX_TILES_H
#define SHIM_AMX_TILES_H
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SHIM_TILES 8
#define SHIM_TILE_ROWS 16
#define SHIM_TILE_COLSB 64

typedef struct {
    int configured;
    uint16_t colsb[SHIM_TILES];
    uint8_t rows[SHIM_TILES];
    uint8_t data[SHIM_TILES][SHIM_TILE_ROWS][SHIM_TILE_COLSB];
} shim_tile_state;

static __thread shim_tile_state shim_tiles;

static inline __attribute__((unused, noreturn)) void shim_tile_fault(const char *what, int tile) {
    fprintf(stderr, "emulated AMX: #UD: %s (tile %d)\n", what, tile);
    abort();
}

static inline __attribute__((unused)) void shim_tile_check(int t) {
    if (t < 0 || t >= SHIM_TILES) shim_tile_fault("no such tile", t);
    if (!shim_tiles.configured) shim_tile_fault("tile use before LDTILECFG", t);
    if (!shim_tiles.rows[t] || !shim_tiles.colsb[t]) shim_tile_fault("tile not configured", t);
}

/* the 64-byte block: palette, start_row, 14 reserved bytes, colsb[16] (u16), rows[16] (u8); tiles 8-15 must be 0 */
static inline __attribute__((unused)) void _tile_loadconfig(const void *config) {
    const uint8_t *c = (const uint8_t *)config;
    shim_tile_state *s = &shim_tiles;
    if (c[0] == 0) { /* palette 0: the same as TILERELEASE */
        memset(s, 0, sizeof *s);
        return;
    }
    if (c[0] != 1) shim_tile_fault("palette other than 1", -1);
    for (int i = 2; i < 16; i++)
        if (c[i]) shim_tile_fault("reserved byte of the configuration set", -1);
    for (int t = 0; t < 16; t++) {
        uint16_t colsb;
        memcpy(&colsb, c + 16 + 2 * t, 2);
        const uint8_t rows = c[48 + t];
        if (t >= SHIM_TILES ? colsb || rows : colsb > SHIM_TILE_COLSB || rows > SHIM_TILE_ROWS || !colsb != !rows)
            shim_tile_fault("tile shape outside palette 1", t);
        if (t < SHIM_TILES) s->colsb[t] = colsb, s->rows[t] = rows;
    }
    memset(s->data, 0, sizeof s->data);
    s->configured = 1;
}

static inline __attribute__((unused)) void _tile_release(void) { memset(&shim_tiles, 0, sizeof shim_tiles); }

static inline __attribute__((unused)) void _tile_zero(int t) {
    shim_tile_check(t);
    memset(shim_tiles.data[t], 0, sizeof shim_tiles.data[t]);
}

/* rows x colsb bytes from base + row * stride; the rest of the register is zeroed */
static inline __attribute__((unused)) void _tile_loadd(int t, const void *base, long stride) {
    shim_tile_check(t);
    memset(shim_tiles.data[t], 0, sizeof shim_tiles.data[t]);
    for (int r = 0; r < shim_tiles.rows[t]; r++)
        memcpy(shim_tiles.data[t][r], (const uint8_t *)base + r * stride, shim_tiles.colsb[t]);
}

static inline __attribute__((unused)) void _tile_stored(int t, void *base, long stride) {
    shim_tile_check(t);
    for (int r = 0; r < shim_tiles.rows[t]; r++)
        memcpy((uint8_t *)base + r * stride, shim_tiles.data[t][r], shim_tiles.colsb[t]);
}

/* bf16 -> float32 with denormals as zero (TDPBF16PS's DAZ) */
static inline float shim_tile_bf16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    uint32_t u = (uint32_t)h << 16;
    if ((u & 0x7f800000u) == 0) u &= 0x80000000u;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float shim_tile_ftz(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) == 0) u &= 0x80000000u;
    memcpy(&f, &u, 4);
    return f;
}

/* dst[m][n] += (sum over k of a[m][2k] b[k][2n]) + (sum over k of a[m][2k+1] b[k][2n+1]): the SDM's order, two
 * float32 partial sums per output (each step's product exact, then rounded to nearest, denormals flushed) */
static inline __attribute__((unused)) void _tile_dpbf16ps(int dst, int a, int b) {
    shim_tile_check(dst), shim_tile_check(a), shim_tile_check(b);
    shim_tile_state *s = &shim_tiles;
    if (dst == a || dst == b || a == b) shim_tile_fault("TDPBF16PS with a tile named twice", dst);
    if (s->colsb[dst] % 4 || s->colsb[a] % 4 || s->colsb[b] % 4 || s->colsb[dst] != s->colsb[b] ||
        s->colsb[a] / 4 != s->rows[b] || s->rows[dst] != s->rows[a])
        shim_tile_fault("TDPBF16PS shapes do not fit", dst);
    const int K = s->colsb[a] / 4, N = s->colsb[dst] / 4;
    for (int m = 0; m < s->rows[dst]; m++) {
        float even[SHIM_TILE_COLSB / 4] = {0}, odd[SHIM_TILE_COLSB / 4] = {0}, acc[SHIM_TILE_COLSB / 4];
        for (int k = 0; k < K; k++)
            for (int n = 0; n < N; n++) {
                even[n] = shim_tile_ftz(even[n] + shim_tile_bf16(&s->data[a][m][4 * k]) *
                                                      shim_tile_bf16(&s->data[b][k][4 * n]));
                odd[n] = shim_tile_ftz(odd[n] + shim_tile_bf16(&s->data[a][m][4 * k + 2]) *
                                                    shim_tile_bf16(&s->data[b][k][4 * n + 2]));
            }
        memcpy(acc, s->data[dst][m], sizeof acc);
        for (int n = 0; n < N; n++) {
            const float pair = shim_tile_ftz(shim_tile_ftz(even[n]) + shim_tile_ftz(odd[n]));
            acc[n] = shim_tile_ftz(shim_tile_ftz(acc[n]) + pair);
        }
        memset(s->data[dst][m], 0, SHIM_TILE_COLSB);
        memcpy(s->data[dst][m], acc, s->colsb[dst]);
    }
}

/* Linux grants the tile state to a process that asks (amx_linear.c's hook); the emulated one always can */
#define LLMD_AMX_REQUEST_TILES() 1
#endif
