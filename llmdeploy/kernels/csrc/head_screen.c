/* Greedy decode's LM head at a few rows without reading all of it: the head's logits from a Q8 copy of its weights
 * (llmd_q_linear: the Q8 weights exactly, times float32 x; half of bf16's bytes, a quarter of float32's), a bound on
 * how far each can be from the exact logit, and the exact logits of only the tiles of 32 rows that may hold the
 * largest. The answer is the whole head's: the first index of the largest exact logit, as llmd_argmax_rows picks.
 *
 * Why it is exact. For row v, with x the head's input, w its weights and w^ their Q8 blocks:
 *   |x.w - x.w^| <= sum |x| * max |w - w^|,
 * plus the float32 rounding of the two sums (a few K units of float32's epsilon on sum |x| max |w|). The Python side
 * folds the row's part into c_x1[v] (engine/models/head_screen.py); here e_v = c_x1[v] sum |x|, with a 0.1% margin
 * for the float arithmetic of the bound itself and an absolute TINY_SLACK for flushed subnormals. The head kernel's
 * sum s_v is then within e_v of the screened a_v, so the largest s is at least T = max_v (a_v - e_v), and a row can
 * be the largest (or tie with it) only if a_v + e_v reaches T; with bf16 logits, which round each s_v to nearest
 * (monotonic: a larger s never rounds lower), it must round to at least bf16(T), so reach the midpoint below
 * bf16(T). Every such row is in a candidate tile, computed by the head's own kernel on that tile alone, one row at
 * a time (the same bits as the whole head's call: the one-row walks give each tile's outputs the same sums at any
 * grouping, and a batched call's rows are the one-row call's, tested).
 *
 * Why: the head is a fifth of SmolLM2's bf16 weights (56.6 of 269 MB) and a fifth of float32's (113 of 538 MB). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "head_screen.h"

#define SCREEN_TILE 32  /* rows of a packed tile (F32_NR / BF16_NR) */
#define SCREEN_BLOCK 32 /* inputs of a Q8 block (QB) */
/* vdpbf16ps treats subnormal inputs as zero and flushes subnormal sums: an error of at most K * 2^-126 that the
 * relative bound does not cover where sum |x| itself is tiny */
#define TINY_SLACK 1e-30f

int llmd_f32_linear(const float *, int64_t, const float *, const float *, float *, int64_t, int64_t, int64_t, int);
int llmd_bf16_linear(const uint16_t *, int64_t, const uint16_t *, const uint16_t *, uint16_t *, int64_t, int64_t,
                     int64_t, int);
int llmd_q_linear(int, const float *, int64_t, const uint8_t *, const float *, float *, int64_t, int64_t, int64_t,
                  int);

static float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* x as float32 and sum |x|; 0 where an input is not finite */
static int screen_inputs(int act_bf16, const void *x, int64_t K, float *xf, float *x1) {
    double s1 = 0.0;
    for (int64_t k = 0; k < K; k++) {
        const float v = act_bf16 ? bf16_to_f32(((const uint16_t *)x)[k]) : ((const float *)x)[k];
        if (!isfinite(v)) return 0;
        xf[k] = v;
        s1 += fabsf(v);
    }
    *x1 = (float)s1;
    return 1;
}

/* the midpoint below bf16(t) (t rounded to nearest even): every float32 that rounds to bf16(t) or higher is at
 * least this */
static float bf16_floor_mid(float t) {
    uint32_t u;
    memcpy(&u, &t, 4);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u; /* bf16(t), as a float32's bits */
    uint32_t below;                                      /* the next bf16 below it */
    if ((u & 0x7fffffffu) == 0) below = 0x80010000u;     /* +-0: the smallest negative */
    else if (u & 0x80000000u) below = u + 0x10000u;      /* negative: one step larger in magnitude */
    else below = u - 0x10000u;
    float b, p;
    memcpy(&b, &u, 4);
    memcpy(&p, &below, 4);
    return (b + p) / 2.0f; /* exact: two bf16 values */
}

/* the exact logits of tile t (its `real` rows) by the head's kernel on that tile alone */
static int exact_tile(int act_bf16, const void *head_w, const void *x, int64_t V, int64_t K, int64_t t, float *out) {
    const int64_t real = V - t * SCREEN_TILE < SCREEN_TILE ? V - t * SCREEN_TILE : SCREEN_TILE;
    if (!act_bf16)
        return llmd_f32_linear(x, K, (const float *)head_w + t * SCREEN_TILE * K, NULL, out, 1, real, K, 1);
    uint16_t y[SCREEN_TILE];
    const int rc = llmd_bf16_linear(x, K, (const uint16_t *)head_w + t * SCREEN_TILE * K, NULL, y, 1, real, K, 1);
    for (int64_t c = 0; c < real; c++) out[c] = bf16_to_f32(y[c]);
    return rc;
}

/* row m's candidate tiles (those with a row that can reach the largest exact logit) into cand as m * tiles + t, after
 * the n already there; -1 where the row's lower bound is not finite or it has more than max_tiles */
static int64_t row_candidates(const llmd_head_screen *s, int act_bf16, const float *a, float x1, int64_t V,
                              int64_t tiles, int64_t m, int64_t *cand, int64_t n) {
    const float x1m = x1 * 1.001f;
    float floor_max = -INFINITY; /* T: the largest exact logit is at least this */
    for (int64_t v = 0; v < V; v++) {
        const float lo = a[v] - (s->c_x1[v] * x1m + TINY_SLACK);
        floor_max = lo > floor_max ? lo : floor_max;
    }
    if (!isfinite(floor_max)) return -1;
    const float reach = act_bf16 ? bf16_floor_mid(floor_max) : floor_max;
    const int64_t first = n;
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t end = (t + 1) * SCREEN_TILE < V ? (t + 1) * SCREEN_TILE : V;
        for (int64_t v = t * SCREEN_TILE; v < end; v++)
            if (a[v] + (s->c_x1[v] * x1m + TINY_SLACK) >= reach) {
                if (n - first == s->max_tiles) return -1;
                cand[n++] = m * tiles + t;
                break;
            }
    }
    return n;
}

/* x: M rows (row stride K) of the head's input (float32, or bf16 with act_bf16); head_w: the head packed for
 * llmd_f32_linear / llmd_bf16_linear, no bias. Returns 0 with best[M] (and *tiles_read, the candidate tiles
 * computed, all rows), 1 where it declines (an input not finite, K not whole blocks, a row with more candidates than
 * s->max_tiles, out of memory): the caller then computes the whole head. */
int llmd_head_screen_argmax(const llmd_head_screen *s, int act_bf16, const void *head_w, int64_t V, int64_t K,
                            const void *x, int64_t M, int64_t *best, int64_t *tiles_read, int nthreads) {
    if (!s || !s->q8 || V < 1 || K < 1 || M < 1 || K % SCREEN_BLOCK) return 1;
    const int64_t tiles = (V + SCREEN_TILE - 1) / SCREEN_TILE;
    const size_t es = act_bf16 ? 2 : 4;
    float *xf = malloc(sizeof(float) * (size_t)(M * K)), *x1 = malloc(sizeof(float) * (size_t)M);
    float *a = malloc(sizeof(float) * (size_t)(M * V));
    float *exact = malloc(sizeof(float) * (size_t)(M * tiles * SCREEN_TILE));
    int64_t *cand = malloc(sizeof(int64_t) * (size_t)(M * tiles));
    int rc = 1;
    if (!xf || !x1 || !a || !exact || !cand) goto done;
    for (int64_t m = 0; m < M; m++)
        if (!screen_inputs(act_bf16, (const char *)x + es * (size_t)(m * K), K, xf + m * K, x1 + m)) goto done;
    if (llmd_q_linear(0 /* Q8 */, xf, K, s->q8, NULL, a, M, V, K, nthreads) != 0) goto done;
    int64_t n = 0;
    for (int64_t m = 0; m < M && n >= 0; m++) n = row_candidates(s, act_bf16, a + m * V, x1[m], V, tiles, m, cand, n);
    if (n < 0) goto done;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) reduction(| : failed)
    for (int64_t i = 0; i < n; i++) {
        const int64_t m = cand[i] / tiles, t = cand[i] % tiles;
        failed |= exact_tile(act_bf16, head_w, (const char *)x + es * (size_t)(m * K), V, K, t,
                             exact + (m * tiles + t) * SCREEN_TILE) != 0;
    }
    if (failed) goto done;
    for (int64_t m = 0; m < M; m++) best[m] = -1;
    for (int64_t i = 0; i < n; i++) { /* each row's tiles in index order, rows in order: ties keep the first */
        const int64_t m = cand[i] / tiles, t = cand[i] % tiles;
        const int64_t end = (t + 1) * SCREEN_TILE < V ? (t + 1) * SCREEN_TILE : V;
        const float *row = exact + m * tiles * SCREEN_TILE;
        for (int64_t v = t * SCREEN_TILE; v < end; v++) {
            if (row[v] != row[v]) goto done; /* a NaN: the whole head's argmax has its own rule for it */
            if (best[m] < 0 || row[v] > row[best[m]]) best[m] = v;
        }
    }
    for (int64_t m = 0; m < M; m++)
        if (best[m] < 0) goto done;
    *tiles_read = n;
    rc = 0;
done:
    free(xf), free(x1), free(a), free(exact), free(cand);
    return rc;
}
