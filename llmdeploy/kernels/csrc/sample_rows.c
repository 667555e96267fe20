/* Sampled rows' draw: one token per float32 logit row from softmax(x / T), with min_p, by inverse CDF in token order
 * (the Python sampler's definition: engine/sampler.py). NaN counts as -inf and +inf as the largest float, as the
 * sampler's nan_to_num; the best logit is moved to 0 before the temperature, so a low T cannot overflow.
 *
 * Why: the sampler's torch ops over [rows, 49152] logits (copy, nan_to_num, max, shift, divide, softmax, min_p,
 * cumsum, searchsorted) took ~1.3 ms at one row and ~5 ms at 32 on 2 Zen 4 cores: a fifth of a batch-1 bf16 decode
 * step of SmolLM2. Here: three passes over the row, ~0.1 ms. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include "avx2_exp.h"
#endif

#define DRAW_BLOCK 64 /* tokens per partial sum: the walk looks inside one block only */

static inline float sanitized(float v) { return v != v ? -INFINITY : (v == INFINITY ? FLT_MAX : v); }

static float row_max(const float *x, int64_t n) {
    float m = -INFINITY;
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 big = _mm256_set1_ps(FLT_MAX), ninf = _mm256_set1_ps(-INFINITY);
    __m256 vm = ninf;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        v = _mm256_blendv_ps(v, ninf, _mm256_cmp_ps(v, v, _CMP_UNORD_Q)); /* as sanitized() */
        vm = _mm256_max_ps(vm, _mm256_min_ps(v, big));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, vm);
    for (int j = 0; j < 8; j++) m = lanes[j] > m ? lanes[j] : m;
#endif
    for (; i < n; i++) {
        const float v = sanitized(x[i]);
        m = v > m ? v : m;
    }
    return m > -FLT_MAX ? m : -FLT_MAX; /* a row of -inf: every weight is exp(-inf) = 0 */
}

/* e[i] = exp((x[i] - m) * inv_t), 0 below min_p (the best token's weight is 1: min_p of it) */
static void weights(const float *x, int64_t n, float m, float inv_t, float min_p, float *e) {
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 vm = _mm256_set1_ps(m), vt = _mm256_set1_ps(inv_t), floor = _mm256_set1_ps(min_p);
    const __m256 big = _mm256_set1_ps(FLT_MAX), ninf = _mm256_set1_ps(-INFINITY);
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        v = _mm256_blendv_ps(v, ninf, _mm256_cmp_ps(v, v, _CMP_UNORD_Q)); /* NaN -> -inf */
        v = _mm256_min_ps(v, big);                                          /* +inf -> FLT_MAX */
        const __m256 z = _mm256_mul_ps(_mm256_sub_ps(v, vm), vt);
        /* avx2_exp clamps its input at -87.3: a weight below e^-87 is 0 here, as expf's is a denormal */
        __m256 w = _mm256_and_ps(avx2_exp(z), _mm256_cmp_ps(z, _mm256_set1_ps(-87.0f), _CMP_GT_OQ));
        w = _mm256_and_ps(w, _mm256_cmp_ps(w, floor, _CMP_GE_OQ));
        _mm256_storeu_ps(e + i, w);
    }
#endif
    for (; i < n; i++) {
        const float z = (sanitized(x[i]) - m) * inv_t;
        const float w = z > -87.0f ? expf(z) : 0.0f;
        e[i] = w >= min_p ? w : 0.0f;
    }
}

/* sum of e[i0, end) in float64: one block's 64 weights in two vector chains of float64 sums on AVX2 (the one
 * chain of 64 dependent adds was most of the draw: ~0.09 ms a row of 49,152), in token order elsewhere */
static double block_sum(const float *e, int64_t i0, int64_t end) {
    int64_t i = i0;
    double s = 0.0;
#if defined(__AVX2__) && defined(__FMA__)
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
    for (; i + 8 <= end; i += 8) {
        const __m256 v = _mm256_loadu_ps(e + i);
        a0 = _mm256_add_pd(a0, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
        a1 = _mm256_add_pd(a1, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
    }
    double lanes[4];
    _mm256_storeu_pd(lanes, _mm256_add_pd(a0, a1));
    s = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
#endif
    for (; i < end; i++) s += e[i];
    return s;
}

/* the token whose cumulative weight (token order, float64) first exceeds u * total; u * total rounding up to the
 * total gives the last token with weight */
static int64_t draw(const float *e, int64_t n, double u, double *blocks) {
    const int64_t nb = (n + DRAW_BLOCK - 1) / DRAW_BLOCK;
    double total = 0.0;
    int64_t last = -1;
    for (int64_t b = 0; b < nb; b++) {
        const int64_t end = (b + 1) * DRAW_BLOCK < n ? (b + 1) * DRAW_BLOCK : n;
        const double s = block_sum(e, b * DRAW_BLOCK, end);
        blocks[b] = s;
        total += s;
        if (s > 0.0) last = b;
    }
    if (last < 0) return -1;
    const double target = u * total;
    double cum = 0.0;
    for (int64_t b = 0; b <= last; b++) {
        if (b < last && cum + blocks[b] <= target) {
            cum += blocks[b];
            continue;
        }
        const int64_t end = (b + 1) * DRAW_BLOCK < n ? (b + 1) * DRAW_BLOCK : n;
        int64_t pick = -1;
        for (int64_t i = b * DRAW_BLOCK; i < end; i++) {
            if (e[i] <= 0.0f) continue;
            pick = i;
            cum += e[i];
            if (cum > target) return i;
        }
        if (b == last || pick >= 0) return pick; /* rounding: the block's sum passed the target, its walk did not */
    }
    return -1;
}

int64_t llmd_argmax_row(const float *x, int64_t n); /* argmax.c */

/* out[r] = a token of row r (n floats at x + r * stride) drawn with the uniform u[r] in [0, 1) at temperature
 * 1 / inv_temp[r] with min_p[r] in [0, 1]; inv_temp[r] <= 0: the row's argmax (greedy, torch.argmax's answer).
 * -1 in out[r]: row r has no finite logit. Returns 0; -1 for bad arguments, -3 without memory. */
int llmd_sample_rows(const float *x, int64_t rows, int64_t n, int64_t stride, const float *inv_temp,
                     const float *min_p, const double *u, int64_t *out, int nthreads) {
    if (n < 1 || rows < 0 || nthreads < 1) return -1;
    int failed = 0;
#pragma omp parallel num_threads(rows >= 4 ? nthreads : 1)
    {
        float *e = malloc(sizeof(float) * (size_t)n);
        double *blocks = malloc(sizeof(double) * (size_t)((n + DRAW_BLOCK - 1) / DRAW_BLOCK));
        if (!e || !blocks) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (!e || !blocks) continue;
            const float *row = x + r * stride;
            if (inv_temp[r] <= 0.0f) {
                out[r] = llmd_argmax_row(row, n);
                continue;
            }
            weights(row, n, row_max(row, n), inv_temp[r], min_p[r], e);
            out[r] = draw(e, n, u[r], blocks);
        }
        free(e), free(blocks);
    }
    return failed ? -3 : 0;
}

/* top_k and top_p in place (engine/sampling_filters.py's definition, top_k_top_p_by_sort): of each row's tokens in
 * descending order (ties: the lower index first) the first top_k stay, and of those every one whose better tokens
 * hold at most top_p of their mass; every other logit becomes -inf. The mass is the kept tokens' float32 weights
 * exp((x - max) / T), the draw's own, summed in float64, as the candidates path measures a row's
 * (sampling_filters.from_candidates).
 *
 * Why: torch's topk over [32, 49152] logits, a second topk as wide as a wide nucleus needs (up to thousands) and
 * the row's exponentials in torch made top_p 0.9 add ~19 ms to a batch-32 float32 decode step of SmolLM2 (83 against
 * 64 ms on Zen 3; 52 against 33 bf16 on Zen 4). Here: one weight pass, a histogram of the mass by the logit's
 * distance from the best in steps of ln 2 (every token ahead of the bucket where the mass passes top_p stays, every
 * one behind it goes), and a sort of that bucket's tokens only; top_k selects its k best in linear time from the
 * buckets that hold them and sorts those. */
typedef struct {
    float v;
    int32_t i;
} ranked;

#define MASS_BUCKETS 64

static inline int better(const ranked *a, const ranked *b) { return a->v > b->v || (a->v == b->v && a->i < b->i); }

static int by_rank(const void *a, const void *b) { return better(a, b) ? -1 : (better(b, a) ? 1 : 0); }

/* c[0, k) become the k best of c[0, n) (in no order): quickselect, Hoare partitions around a middle pivot */
static void select_best(ranked *c, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        const ranked pivot = c[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (better(&c[i], &pivot)) i++;
            while (better(&pivot, &c[j])) j--;
            if (i <= j) {
                const ranked t = c[i];
                c[i++] = c[j];
                c[j--] = t;
            }
        }
        if (k - 1 <= j) hi = j;
        else if (k - 1 >= i) lo = i;
        else break; /* the pivot's own place */
    }
}

/* a token's bucket b by its logit's distance below the row's best at the temperature, in steps of ln 2 (its weight
 * in [2^-(b+1), 2^-b] up to the exponential's rounding): monotonic in the logit, so every token of a lower bucket
 * ranks ahead of every token of a higher one; MASS_BUCKETS - 1 for the rest (and -inf) */
static inline int mass_bucket(float v, float m, float inv_t) {
    const float steps = (m - v) * inv_t * 1.44269504f;
    return steps < (float)(MASS_BUCKETS - 1) ? (int)steps : MASS_BUCKETS - 1;
}

/* how many of c[0, nc) (in rank order, weights w) stay when `before` of the mass is ahead of c[0]: each while the
 * mass ahead of it is at most top_p of `total` */
static int64_t nucleus_end(const ranked *c, int64_t nc, const float *w, double before, double top_p, double total) {
    if (top_p >= 1.0) return nc;
    const double limit = top_p * total;
    int64_t j = 0;
    for (; j < nc && before <= limit; j++) before += w[c[j].i];
    return j;
}

/* c[0, nc) = the tokens of buckets [first, last] (bk: each token's), the logits of those past last -inf */
static int64_t gather(float *x, int64_t n, const uint8_t *bk, int first, int last, ranked *c) {
    int64_t nc = 0;
    for (int64_t i = 0; i < n; i++) {
        if (bk[i] > last) x[i] = -INFINITY;
        else if (bk[i] >= first) c[nc++] = (ranked){sanitized(x[i]), (int32_t)i};
    }
    return nc;
}

/* one row at temperature 1 / inv_t (the weights the draw then reads): top_k <= 0 or >= n is none, top_p >= 1 none;
 * w and bk: room for the row's weights and buckets */
static void filter_row(float *x, int64_t n, int64_t top_k, double top_p, float inv_t, float *w, uint8_t *bk,
                       ranked *c) {
    if (top_k <= 0) top_k = n;
    if (top_k >= n && top_p >= 1.0) return;
    const float m = row_max(x, n);
    weights(x, n, m, inv_t, 0.0f, w);
    double mass[MASS_BUCKETS] = {0.0}, total = 0.0, before = 0.0;
    int64_t count[MASS_BUCKETS] = {0};
    for (int64_t i = 0; i < n; i++) {
        const int b = mass_bucket(sanitized(x[i]), m, inv_t);
        bk[i] = (uint8_t)b;
        mass[b] += w[i];
        count[b]++;
    }
    if (top_k < n) { /* the k best, from the buckets that hold them, in rank order; the mass is theirs */
        int last = 0;
        for (int64_t seen = count[0]; seen < top_k; seen += count[++last]) {}
        const int64_t nc = gather(x, n, bk, 0, last, c);
        select_best(c, nc, top_k);
        qsort(c, (size_t)top_k, sizeof(ranked), by_rank);
        for (int64_t j = 0; j < top_k; j++) total += w[c[j].i];
        for (int64_t j = nucleus_end(c, top_k, w, 0.0, top_p, total); j < nc; j++) x[c[j].i] = -INFINITY;
        return;
    }
    for (int b = 0; b < MASS_BUCKETS; b++) total += mass[b];
    const double limit = top_p * total;
    int edge = 0; /* the first bucket whose mass, with the better buckets', passes top_p: those ahead of it stay */
    while (edge < MASS_BUCKETS - 1 && before + mass[edge] <= limit) before += mass[edge++];
    const int64_t nc = gather(x, n, bk, edge, edge, c); /* behind the edge's bucket: the mass ahead passed top_p */
    qsort(c, (size_t)nc, sizeof(ranked), by_rank);
    for (int64_t j = nucleus_end(c, nc, w, before, top_p, total); j < nc; j++) x[c[j].i] = -INFINITY;
}

/* top_k[r] (<= 0 or >= n: none) and top_p[r] (in (0, 1]; 1: none) for row r of x (n floats at x + r * stride; a NaN
 * counts as -inf) at 1 / inv_temp[r] (inv_temp NULL: 1; <= 0: a greedy row, left as it is). Returns 0; -1 for bad
 * arguments, -3 without memory. */
int llmd_top_k_top_p_rows(float *x, int64_t rows, int64_t n, int64_t stride, const int64_t *top_k,
                          const double *top_p, const float *inv_temp, int nthreads) {
    if (n < 1 || n > INT32_MAX || rows < 0 || nthreads < 1) return -1;
    for (int64_t r = 0; r < rows; r++)
        if (!(top_p[r] > 0.0)) return -1;
    int failed = 0;
#pragma omp parallel num_threads(rows >= 2 ? nthreads : 1)
    {
        float *w = malloc(sizeof(float) * (size_t)n);
        uint8_t *bk = malloc((size_t)n);
        ranked *c = malloc(sizeof(ranked) * (size_t)n);
        if (!w || !bk || !c) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < rows; r++) {
            const float inv_t = inv_temp ? inv_temp[r] : 1.0f;
            if (w && bk && c && inv_t > 0.0f) filter_row(x + r * stride, n, top_k[r], top_p[r], inv_t, w, bk, c);
        }
        free(w), free(bk), free(c);
    }
    return failed ? -3 : 0;
}
