/* The side-by-side walk of the float32 and bf16 linears (f32_linear_avx2.c, linear_avx512.c): decode at batch 1 is
 * bound by the weight stream, and one sequential stream a core left Zen 2's memory at 26 GB/s where three reach 37-40
 * (bench/RESULTS.md), so each thread walks its share of the tiles up to llmd_row_streams at a time, side by side: at
 * one row in every kernel, up to llmd_side_rows rows (small batches) in the AVX2 float32 one, and at any row count
 * in the AVX2 int8 products (qv_linear_avx2.c). */
#ifndef LLMD_TILE_GROUPS_H
#define LLMD_TILE_GROUPS_H
#include <omp.h>
#include <stdint.h>

#define LLMD_SIDE_ROWS_MAX 16 /* most rows a side-by-side walk takes (f32_linear_avx2.c rows_tiles) */

extern int llmd_row_streams; /* cpu_kernels.c: tiles a side-by-side walk reads at once (1 = the many-row path's walk) */

/* inside a parallel region: this thread's static share [*t0, *t1) of `tiles` */
static inline void thread_tiles(int64_t tiles, int64_t *t0, int64_t *t1) {
    const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
    *t0 = tiles * id / nt;
    *t1 = tiles * (id + 1) / nt;
}

/* tiles [t0, t1), `streams` (<= 3) at a time: WALK(t, G) with G a constant 1-3, so each walk is specialised */
#define FOR_TILE_GROUPS(t0, t1, streams, WALK)                                                              \
    for (int64_t t_ = (t0); t_ < (t1); t_ += (streams)) {                                                    \
        const int64_t g_ = (t1) - t_ < (streams) ? (t1) - t_ : (streams);                                    \
        if (g_ == 3) WALK(t_, 3);                                                                            \
        else if (g_ == 2) WALK(t_, 2);                                                                       \
        else WALK(t_, 1);                                                                                    \
    }

/* a linear's side-by-side call, whole: every thread walks its share with WALK (needs `tiles` and `nthreads`) */
#define SIDE_BY_SIDE_TILE_GROUPS(WALK)                                                                            \
    do {                                                                                                     \
        const int streams_ = llmd_row_streams;                                                               \
        _Pragma("omp parallel num_threads(nthreads)") {                                                     \
            int64_t t0_, t1_;                                                                                \
            thread_tiles(tiles, &t0_, &t1_);                                                                 \
            FOR_TILE_GROUPS(t0_, t1_, streams_, WALK)                                                        \
        }                                                                                                    \
    } while (0)
/* tiles [t0, t1) as `streams` runs of consecutive tiles read side by side: WALK(t, d, G) walks tiles t, t + d, ...
 * (G of them, a constant 1-3), so each stream goes on into the next tile of its run, which follows in memory; the
 * last (t1 - t0) % streams tiles go as one group of adjacent tiles. Why, against FOR_TILE_GROUPS' adjacent tiles
 * (each stream ending after one tile): Zen 4's bf16 one-row linears in the host's fast memory band (probe 55-65
 * GB/s) read SmolLM2's 121 weights in 1.10x the probe's time instead of 1.23x (C harness, 150 alternating pairs),
 * and bf16 batch-1 engine steps took 0.92-0.94x the time (even in the 36-38 GB/s band); float32's twice-as-long
 * tiles gained nothing (engine steps 0.90-1.13x, median 1.01), so its walks keep the groups. */
#define FOR_TILE_RUNS(t0, t1, streams, WALK)                                                                \
    do {                                                                                                     \
        const int64_t per_ = ((t1) - (t0)) / (streams), rest_ = (t0) + (streams) * per_;                     \
        for (int64_t i_ = 0; i_ < per_; i_++) {                                                              \
            if ((streams) == 3) WALK((t0) + i_, per_, 3);                                                    \
            else if ((streams) == 2) WALK((t0) + i_, per_, 2);                                               \
            else WALK((t0) + i_, per_, 1);                                                                   \
        }                                                                                                    \
        if ((t1) - rest_ == 2) WALK(rest_, 1, 2);                                                            \
        else if ((t1) - rest_ == 1) WALK(rest_, 1, 1);                                                       \
    } while (0)

/* SIDE_BY_SIDE_TILE_GROUPS with runs: every thread walks its share as FOR_TILE_RUNS does */
#define SIDE_BY_SIDE_TILE_RUNS(WALK)                                                                         \
    do {                                                                                                     \
        const int streams_ = llmd_row_streams;                                                               \
        _Pragma("omp parallel num_threads(nthreads)") {                                                     \
            int64_t t0_, t1_;                                                                                \
            thread_tiles(tiles, &t0_, &t1_);                                                                 \
            FOR_TILE_RUNS(t0_, t1_, streams_, WALK);                                                         \
        }                                                                                                    \
    } while (0)
#endif
