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
