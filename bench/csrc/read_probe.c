/* Memory read bandwidth for bench/ceilings.py: every thread sums its share of a buffer as `streams` sequential
 * streams walked in lockstep. One stream a core (what torch's sum does) leaves memory idle on some CPUs: on a Zen 2
 * EPYC 28 GB/s with one, 37-42 GB/s with three or four, the hardware prefetcher running ahead on each. */
#include <omp.h>
#include <stdint.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define LANES 16 /* floats a stream reads a step: independent sums, so the loop is bound by memory, not adds */

/* the sum of p[0, n): `streams` equal parts in lockstep, then what is left over */
static float sum_streams(const float *p, int64_t n, int streams) {
    float acc[LANES] = {0};
    const int64_t len = n / streams / LANES * LANES;
    for (int64_t i = 0; i < len; i += LANES)
        for (int s = 0; s < streams; s++)
            for (int l = 0; l < LANES; l++) acc[l] += p[s * len + i + l];
    float total = 0.0f;
    for (int64_t i = streams * len; i < n; i++) total += p[i];
    for (int l = 0; l < LANES; l++) total += acc[l];
    return total;
}

/* best GB/s of `reps` passes over buf[0, n) on `threads` threads; each pass's sum is added to *sink (so the reads
 * are not optimised away, and a test can check that every element was read) */
double llmd_read_probe(const float *buf, int64_t n, int streams, int threads, int reps, float *sink) {
    double best = 0.0;
    for (int r = 0; r < reps; r++) {
        float total = 0.0f;
        const double t = now();
#pragma omp parallel num_threads(threads) reduction(+ : total)
        {
            const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
            const int64_t lo = n * id / nt, hi = n * (id + 1) / nt;
            total += sum_streams(buf + lo, hi - lo, streams);
        }
        const double gbps = (double)n * 4 / (now() - t) / 1e9;
        best = gbps > best ? gbps : best;
        *sink += total;
    }
    return best;
}
