/* Greedy decode's LM head without reading all of it: at a few rows the head's logits from a Q8 copy of its weights
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
 * More rows (float32 heads, CPUs with AVX-512 BF16): the screen's logits come from a bf16 copy of the head times x
 * rounded to bf16 (bf16 products, twice float32's a cycle, and on AMX tiles where granted), in float32 sums. For
 * x~ = bf16(x) and w~ the row's bf16 weights, by Cauchy-Schwarz
 *   |x.w - x~.w~| <= |x|_2 |w - w~|_2 + |x - x~|_2 |w~|_2,
 * plus both sums' float32 rounding (at most 2 (K + 16) units of float32's epsilon on |x|_2 |w|_2, and on
 * |x~|_2 |w~|_2 <= (|x|_2 + |x - x~|_2) |w~|_2): e_v = A[v] |x|_2 + B[v] |x - x~|_2 (c_l2, built by
 * engine/models/head_screen.py), the two norms computed here in float64 and 0.1% added for the float arithmetic
 * of e_v. The L2 norms, not sum |x| max |w|: rounding errors spread over the row, so this bound is ~4x tighter (SmolLM2
 * hidden states: 1.8 candidate tiles a row against 24 with the L1 / max bound). The rest is the Q8 screen's.
 *
 * Why: the head is a fifth of SmolLM2's bf16 weights (56.6 of 269 MB) and a fifth of float32's (113 of 538 MB); at
 * 32 float32 rows it is 9 of a 54 ms step's compute (Zen 4), which bf16 products halve. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_lanes.h"
#include "head_screen.h"

#define SCREEN_TILE 32  /* rows of a packed tile (F32_NR / BF16_NR) */
#define SCREEN_BLOCK 32 /* inputs of a Q8 block (QB) */
/* vdpbf16ps treats subnormal inputs as zero and flushes subnormal sums: an error of at most K * 2^-126 that the
 * relative bound does not cover where sum |x| itself is tiny */
#define TINY_SLACK 1e-30f
/* rows up to which the Q8 screen runs (engine steps alternating screen on / off in one process, SmolLM2 on Zen 4,
 * medians of 10-16 rounds: bf16 0.920x the time at 1 row, 0.945x at 2, 0.929x at 3, 1.015x at 4, the Q8 float32
 * products of 4 rows costing what the bf16 head's bytes did; float32 0.874x at 1 and 2 rows, 0.930x at 4) */
#define Q8_MAX_ROWS_BF16 3
#define Q8_MAX_ROWS_F32 4
/* rows from which a float32 head's bf16 copy screens instead of its Q8 one: SmolLM2's head on Zen 4, medians over
 * hidden states of W, ms: 4 rows Q8 1.7-2.7, bf16 2.2-2.4 (whole head 3.6-3.8); 5 rows bf16 1.8-2.3 (whole 3.2-4.2),
 * 16 rows 3.0-3.5 (5.4-5.8), 32 rows 5.6-6.8 (9.2-9.4) */
#define BF16_MIN_ROWS 5

typedef enum { SCREEN_NONE, SCREEN_Q8, SCREEN_BF16 } screen_kind;

int llmd_f32_linear(const float *, int64_t, const float *, const float *, float *, int64_t, int64_t, int64_t, int);
int llmd_bf16_linear(const uint16_t *, int64_t, const uint16_t *, const uint16_t *, uint16_t *, int64_t, int64_t,
                     int64_t, int);
int llmd_bf16_linear_f32out(const uint16_t *, int64_t, const uint16_t *, float *, int64_t, int64_t, int64_t, int);
int llmd_q_linear(int, const float *, int64_t, const uint8_t *, const float *, float *, int64_t, int64_t, int64_t,
                  int);

static screen_kind screen_for(const llmd_head_screen *s, int act_bf16, int64_t M) {
    if (!s || M < 1) return SCREEN_NONE;
    if (!act_bf16 && s->bf16 && s->c_l2 && M >= BF16_MIN_ROWS) return SCREEN_BF16;
    if (s->q8 && s->c_x1 && M <= (act_bf16 ? Q8_MAX_ROWS_BF16 : Q8_MAX_ROWS_F32)) return SCREEN_Q8;
    return SCREEN_NONE;
}

/* Whether a greedy step of M rows reads the head through the screen (and not the whole head). */
int llmd_head_screen_takes(const llmd_head_screen *s, int act_bf16, int64_t M) {
    return screen_for(s, act_bf16, M) != SCREEN_NONE;
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

/* float32 x rounded to bf16 (to nearest even, subnormals flushed as vdpbf16ps reads them) into xb, and the two
 * norms of the bound, |x|_2 and |x - xb|_2 (float64, rounded up a little); 0 where an input is not finite */
static int bf16_inputs(const float *x, int64_t K, uint16_t *xb, float *n2) {
    double sx = 0.0, sd = 0.0;
    for (int64_t k = 0; k < K; k++) {
        if (!isfinite(x[k])) return 0;
        uint16_t h = bf16_round(x[k]);
        if ((h & 0x7f80u) == 0) h &= 0x8000u; /* subnormal (or zero): the kernel reads zero */
        const float r = bf16_to_f32(h);
        if (!isfinite(r)) return 0; /* rounded past the largest bf16 */
        xb[k] = h;
        sx += (double)x[k] * x[k];
        sd += ((double)x[k] - r) * ((double)x[k] - r);
    }
    n2[0] = (float)(sqrt(sx) * (1 + 1e-6));
    n2[1] = (float)(sqrt(sd) * (1 + 1e-6));
    return 1;
}

/* the midpoint below bf16(t) (t rounded to nearest even): every float32 that rounds to bf16(t) or higher is at
 * least this */
static float bf16_floor_mid(float t) {
    const uint32_t u = (uint32_t)bf16_round(t) << 16; /* bf16(t), as a float32's bits */
    uint32_t below;                                    /* the next bf16 below it */
    if ((u & 0x7fffffffu) == 0) below = 0x80010000u;   /* +-0: the smallest negative */
    else if (u & 0x80000000u) below = u + 0x10000u;    /* negative: one step larger in magnitude */
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

/* One row's error bound: e_v = c1[v * stride] * s1 (+ c2[v * stride] * s2) + TINY_SLACK, each s with its margin. */
typedef struct {
    const float *c1, *c2; /* c2 may be NULL */
    int64_t stride;
    float s1, s2;
} row_error;

static inline float error_at(const row_error *e, int64_t v) {
    const float t = e->c1[v * e->stride] * e->s1;
    return (e->c2 ? t + e->c2[v * e->stride] * e->s2 : t) + TINY_SLACK;
}

#if defined(__AVX512F__)
/* e_v of 16 vocabulary rows from v, as error_at computes each */
static inline __m512 error16(const row_error *e, int64_t v) {
    __m512 t;
    if (e->stride == 1) {
        t = _mm512_mul_ps(_mm512_loadu_ps(e->c1 + v), _mm512_set1_ps(e->s1));
        if (e->c2) t = _mm512_add_ps(t, _mm512_mul_ps(_mm512_loadu_ps(e->c2 + v), _mm512_set1_ps(e->s2)));
    } else { /* stride 2: c1 and c2 interleaved (c_l2's [A, B] pairs) */
        const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
        const __m512 lo = _mm512_loadu_ps(e->c1 + 2 * v), hi = _mm512_loadu_ps(e->c1 + 2 * v + 16);
        t = _mm512_mul_ps(_mm512_permutex2var_ps(lo, even, hi), _mm512_set1_ps(e->s1));
        if (e->c2) {
            const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
            t = _mm512_add_ps(t, _mm512_mul_ps(_mm512_permutex2var_ps(lo, odd, hi), _mm512_set1_ps(e->s2)));
        }
    }
    return _mm512_add_ps(t, _mm512_set1_ps(TINY_SLACK));
}
#define VECTOR_ERRORS(e) ((e)->stride == 1 || ((e)->stride == 2 && (e)->c2 == (e)->c1 + 1))
#endif

/* T = max_v (a_v - e_v): the row's largest exact logit is at least this; NaN where a screened logit is not finite
 * (a sum that overflowed: the bound assumes none, and the exact sum may overflow otherwise, in its own order) */
static float lower_max(const float *a, const row_error *e, int64_t V) {
    float best = -INFINITY;
    int64_t v = 0;
#if defined(__AVX512F__)
    if (VECTOR_ERRORS(e)) {
        __m512 m = _mm512_set1_ps(-INFINITY);
        __mmask16 off = 0;
        for (; v + 16 <= V; v += 16) {
            const __m512 av = _mm512_loadu_ps(a + v), zero = _mm512_sub_ps(av, av); /* NaN where av is not finite */
            off |= _mm512_cmp_ps_mask(zero, zero, _CMP_UNORD_Q);
            m = _mm512_max_ps(m, _mm512_sub_ps(av, error16(e, v)));
        }
        if (off) return NAN;
        best = _mm512_reduce_max_ps(m);
    }
#endif
    for (; v < V; v++) {
        if (!isfinite(a[v])) return NAN;
        const float lo = a[v] - error_at(e, v);
        best = lo > best ? lo : best;
    }
    return best;
}

/* whether a row of tile t can reach `reach` */
static int tile_reaches(const float *a, const row_error *e, int64_t V, int64_t t, float reach) {
    const int64_t end = (t + 1) * SCREEN_TILE < V ? (t + 1) * SCREEN_TILE : V;
    int64_t v = t * SCREEN_TILE;
#if defined(__AVX512F__)
    if (VECTOR_ERRORS(e)) {
        const __m512 r = _mm512_set1_ps(reach);
        for (; v + 16 <= end; v += 16)
            if (_mm512_cmp_ps_mask(_mm512_add_ps(_mm512_loadu_ps(a + v), error16(e, v)), r, _CMP_GE_OQ)) return 1;
    }
#endif
    for (; v < end; v++)
        if (a[v] + error_at(e, v) >= reach) return 1;
    return 0;
}

/* row m's candidate tiles (those with a row that can reach the largest exact logit) into cand[0..], their count; -1
 * where the row's lower bound is not finite or it has more than max_tiles */
static int64_t row_candidates(const llmd_head_screen *s, int act_bf16, const float *a, const row_error *e, int64_t V,
                              int64_t tiles, int64_t *cand) {
    const float floor_max = lower_max(a, e, V);
    if (!isfinite(floor_max)) return -1;
    const float reach = act_bf16 ? bf16_floor_mid(floor_max) : floor_max;
    int64_t n = 0;
    for (int64_t t = 0; t < tiles; t++)
        if (tile_reaches(a, e, V, t, reach)) {
            if (n == s->max_tiles) return -1;
            cand[n++] = t;
        }
    return n;
}

/* every row's screened logits a [M, V] and error bounds; 0 where it declines */
static int screened_logits(const llmd_head_screen *s, screen_kind kind, int act_bf16, const void *x, int64_t M,
                           int64_t V, int64_t K, float *a, row_error *err, int nthreads) {
    const size_t es = act_bf16 ? 2 : 4;
    int ok = 0;
    if (kind == SCREEN_Q8) {
        float *xf = malloc(sizeof(float) * (size_t)(M * K)), *x1 = malloc(sizeof(float) * (size_t)M);
        ok = xf && x1;
        for (int64_t m = 0; m < M && ok; m++)
            ok = screen_inputs(act_bf16, (const char *)x + es * (size_t)(m * K), K, xf + m * K, x1 + m);
        ok = ok && llmd_q_linear(0 /* Q8 */, xf, K, s->q8, NULL, a, M, V, K, nthreads) == 0;
        for (int64_t m = 0; m < M && ok; m++) err[m] = (row_error){s->c_x1, NULL, 1, x1[m] * 1.001f, 0.0f};
        free(xf), free(x1);
        return ok;
    }
    uint16_t *xb = malloc(sizeof(uint16_t) * (size_t)(M * K));
    float *n2 = malloc(2 * sizeof(float) * (size_t)M);
    ok = xb && n2;
    for (int64_t m = 0; m < M && ok; m++) ok = bf16_inputs((const float *)x + m * K, K, xb + m * K, n2 + 2 * m);
    ok = ok && llmd_bf16_linear_f32out(xb, K, s->bf16, a, M, V, K, nthreads) == 0;
    for (int64_t m = 0; m < M && ok; m++)
        err[m] = (row_error){s->c_l2, s->c_l2 + 1, 2, n2[2 * m] * 1.001f, n2[2 * m + 1] * 1.001f};
    free(xb), free(n2);
    return ok;
}

/* x: M rows (row stride K) of the head's input (float32, or bf16 with act_bf16); head_w: the head packed for
 * llmd_f32_linear / llmd_bf16_linear, no bias. Returns 0 with best[M] (and *tiles_read, the candidate tiles
 * computed, all rows), 1 where it declines (no screen for M rows, an input not finite, K not whole blocks, a row
 * with more candidates than s->max_tiles, out of memory): the caller then computes the whole head. */
int llmd_head_screen_argmax(const llmd_head_screen *s, int act_bf16, const void *head_w, int64_t V, int64_t K,
                            const void *x, int64_t M, int64_t *best, int64_t *tiles_read, int nthreads) {
    const screen_kind kind = screen_for(s, act_bf16, M);
    if (kind == SCREEN_NONE || V < 1 || K < 1 || K % SCREEN_BLOCK) return 1;
    const int64_t tiles = (V + SCREEN_TILE - 1) / SCREEN_TILE;
    const size_t es = act_bf16 ? 2 : 4;
    float *a = malloc(sizeof(float) * (size_t)(M * V)), *exact = NULL;
    row_error *err = malloc(sizeof(row_error) * (size_t)M);
    int64_t *cand = malloc(sizeof(int64_t) * (size_t)(M * tiles));
    int64_t *found = malloc(sizeof(int64_t) * (size_t)M);
    float *top = malloc(sizeof(float) * (size_t)M); /* each row's largest exact logit so far */
    int rc = 1;
    if (!a || !err || !cand || !found || !top) goto done;
    if (!screened_logits(s, kind, act_bf16, x, M, V, K, a, err, nthreads)) goto done;
    int declined = 0;
#pragma omp parallel for schedule(static) num_threads(nthreads) reduction(| : declined)
    for (int64_t m = 0; m < M; m++) { /* row m's tiles in cand[m * tiles ..], then its count in found[m] */
        found[m] = row_candidates(s, act_bf16, a + m * V, err + m, V, tiles, cand + m * tiles);
        declined |= found[m] < 0;
    }
    if (declined) goto done;
    int64_t n = 0; /* the candidates as m * tiles + t, rows in order, each row's tiles in order */
    for (int64_t m = 0; m < M; m++)
        for (int64_t i = 0; i < found[m]; i++) cand[n++] = m * tiles + cand[m * tiles + i];
    if (!(exact = malloc(sizeof(float) * (size_t)(n * SCREEN_TILE)))) goto done;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) reduction(| : failed)
    for (int64_t i = 0; i < n; i++) {
        const int64_t m = cand[i] / tiles, t = cand[i] % tiles;
        failed |= exact_tile(act_bf16, head_w, (const char *)x + es * (size_t)(m * K), V, K, t,
                             exact + i * SCREEN_TILE) != 0;
    }
    if (failed) goto done;
    for (int64_t m = 0; m < M; m++) best[m] = -1;
    for (int64_t i = 0; i < n; i++) { /* each row's tiles in index order, rows in order: ties keep the first */
        const int64_t m = cand[i] / tiles, t = cand[i] % tiles;
        const int64_t end = (t + 1) * SCREEN_TILE < V ? (t + 1) * SCREEN_TILE : V;
        const float *tile = exact + i * SCREEN_TILE;
        for (int64_t v = t * SCREEN_TILE; v < end; v++) {
            const float y = tile[v - t * SCREEN_TILE];
            if (y != y) goto done; /* a NaN: the whole head's argmax has its own rule for it */
            if (best[m] < 0 || y > top[m]) best[m] = v, top[m] = y;
        }
    }
    for (int64_t m = 0; m < M; m++)
        if (best[m] < 0) goto done;
    *tiles_read = n;
    rc = 0;
done:
    free(a), free(exact), free(err), free(cand), free(found), free(top);
    return rc;
}
