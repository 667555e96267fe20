/* paged_prefill_attention for a float32 cache on CPUs with AVX2 + FMA (and for a bf16 one, widened, where AVX-512
 * BF16's kernel does not run): one sequence's chunk of queries (the chunk's K/V already stored) against its whole
 * context, read from the paged cache. Built into one library with cpu_kernels.c.
 *
 * Why: float32 prefill attention ran on the torch path (kernels/reference.py causal_attention: a gathered copy of
 * the context and a dozen small ops per 64-query block, for every sequence and layer of a step). The plan is
 * prefill_attention.c's (bf16, AVX-512) in AVX2's 16 registers, with float32 products:
 *   1. per kv head, the context's K is packed once into tiles of 16 keys, one 16-key row per head dim, and V into
 *      16-dim columns, key-major (each p.v pass one sequential stream); zero past the context;
 *   2. per block of MR query rows (a kv head's query heads x chunk positions, position-major), the scores against
 *      every key the block's last row may see (MR x 2 accumulators, 2 K vectors, one broadcast q), an exact
 *      softmax per row over the keys its own position sees (causal), then p.v 16 head dims at a time, divided by
 *      the row's sum. Equal to the float32 definition up to summation order. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "prefetch.h"
#include "unroll.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "avx2_exp.h"
#include "avx2_reduce.h"
#include "bf16_lanes.h"

#define PF_KEYS 16 /* keys per K tile: two 8-lane score vectors */
#define PF_MR 6    /* query rows per block: 6 x 2 accumulators + 2 K (or V) vectors + 1 broadcast = 15 registers */
#define PF_DV 16   /* head dims per p.v pass (two vectors) */

typedef struct {
    const float *q; /* chunk position j, query head hq: q + j * q_stride + hq * D */
    int64_t q_stride;
    const float *kp, *vp; /* packed K and V, per kv head: ctx_pad * D floats each */
    int64_t n, ctx, ctx_pad, H, G, D;
    float scale;
} PrefillArgs;

/* 8 x 8 floats transposed in registers: r[i] lane j -> r[j] lane i */
static inline void transpose_8x8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

/* the element where key t's row of kv head h starts in the cache, -1 past the context */
static inline int64_t row_at(const int32_t *table, int64_t block_size, int64_t Hkv, int64_t h, const PrefillArgs *a,
                             int64_t t) {
    if (t >= a->ctx) return -1;
    return (((int64_t)table[t / block_size] * block_size + t % block_size) * Hkv + h) * a->D;
}

/* 8 cache elements from element i as float32 (zero for i < 0, past the context) */
static inline __m256 load8(const void *cache, int bf16, int64_t i) {
    if (i < 0) return _mm256_setzero_ps();
    return bf16 ? v8_load_bf16((const uint16_t *)cache + i) : _mm256_loadu_ps((const float *)cache + i);
}

/* K tile t, dim d -> 16 keys; V columns c (dims 16c .. 16c + 15) -> one 16-float row per key. Keys [t0, t1) of kv
 * head h, whole tiles. A K tile is 8 x 8 transposes in registers; the next tile's rows are prefetched (the cache is
 * read once a call, from memory: the whole context is packed again for every chunk of a long prompt). */
static void pack_head(const void *k_cache, const void *v_cache, int bf16, const int32_t *table, int64_t block_size,
                      int64_t Hkv, int64_t h, const PrefillArgs *a, int64_t t0, int64_t t1, float *kp, float *vp) {
    const int64_t D = a->D, es = bf16 ? 2 : 4;
    for (int64_t t = t0; t < t1; t += PF_KEYS) {
        int64_t at[PF_KEYS];
        for (int c = 0; c < PF_KEYS; c++) {
            at[c] = row_at(table, block_size, Hkv, h, a, t + c);
            const int64_t ahead = t + PF_KEYS + c < t1 ? row_at(table, block_size, Hkv, h, a, t + PF_KEYS + c) : -1;
            if (ahead >= 0) {
                prefetch_l2((const char *)k_cache + ahead * es, D * es);
                prefetch_l2((const char *)v_cache + ahead * es, D * es);
            }
        }
        float *kt = kp + t * D;
        for (int64_t d0 = 0; d0 < D; d0 += 8)
            for (int g = 0; g < PF_KEYS; g += 8) {
                __m256 r[8];
                for (int i = 0; i < 8; i++) r[i] = load8(k_cache, bf16, at[g + i] < 0 ? -1 : at[g + i] + d0);
                transpose_8x8(r);
                for (int i = 0; i < 8; i++) _mm256_storeu_ps(kt + (d0 + i) * PF_KEYS + g, r[i]);
            }
        for (int c = 0; c < PF_KEYS; c++) {
            float *vt = vp + (t + c) * PF_DV;
            for (int64_t col = 0; col < D / PF_DV; col++)
                for (int z = 0; z < PF_DV; z += 8)
                    _mm256_storeu_ps(vt + col * a->ctx_pad * PF_DV + z,
                                     load8(v_cache, bf16, at[c] < 0 ? -1 : at[c] + col * PF_DV + z));
        }
    }
}

/* s[i * ss + key] = q_i . k_key for MR rows and keys [0, tiles * 16) of kv head h */
static inline __attribute__((always_inline)) void block_scores(const PrefillArgs *a, int64_t h, const float **q,
                                                              int64_t tiles, float *s, int64_t ss, const int MR) {
    const float *kp = a->kp + h * a->ctx_pad * a->D;
    for (int64_t t = 0; t < tiles; t++) {
        __m256 s0[PF_MR], s1[PF_MR];
        ROWS_UNROLLED for (int i = 0; i < MR; i++) s0[i] = s1[i] = _mm256_setzero_ps();
        const float *tile = kp + t * PF_KEYS * a->D;
        for (int64_t d = 0; d < a->D; d++) {
            const __m256 k0 = _mm256_loadu_ps(tile + d * PF_KEYS), k1 = _mm256_loadu_ps(tile + d * PF_KEYS + 8);
            ROWS_UNROLLED for (int i = 0; i < MR; i++) {
                const __m256 qb = _mm256_broadcast_ss(q[i] + d);
                s0[i] = _mm256_fmadd_ps(qb, k0, s0[i]);
                s1[i] = _mm256_fmadd_ps(qb, k1, s1[i]);
            }
        }
        ROWS_UNROLLED for (int i = 0; i < MR; i++) {
            _mm256_storeu_ps(s + i * ss + t * PF_KEYS, s0[i]);
            _mm256_storeu_ps(s + i * ss + t * PF_KEYS + 8, s1[i]);
        }
    }
}

/* out rows = (p_i . v) / sums[i] for MR rows over keys [0, keys) */
static inline __attribute__((always_inline)) void block_pv(const PrefillArgs *a, int64_t h, const float *p,
                                                          int64_t ps, int64_t keys, const float *sums, float **out,
                                                          const int MR) {
    for (int64_t d0 = 0; d0 < a->D; d0 += PF_DV) {
        const float *col = a->vp + h * a->ctx_pad * a->D + d0 * a->ctx_pad;
        __m256 acc0[PF_MR], acc1[PF_MR];
        ROWS_UNROLLED for (int i = 0; i < MR; i++) acc0[i] = acc1[i] = _mm256_setzero_ps();
        for (int64_t k = 0; k < keys; k++) {
            const __m256 v0 = _mm256_loadu_ps(col + k * PF_DV), v1 = _mm256_loadu_ps(col + k * PF_DV + 8);
            ROWS_UNROLLED for (int i = 0; i < MR; i++) {
                const __m256 pb = _mm256_broadcast_ss(p + i * ps + k);
                acc0[i] = _mm256_fmadd_ps(pb, v0, acc0[i]);
                acc1[i] = _mm256_fmadd_ps(pb, v1, acc1[i]);
            }
        }
        ROWS_UNROLLED for (int i = 0; i < MR; i++) {
            const __m256 inv = _mm256_set1_ps(1.0f / sums[i]);
            _mm256_storeu_ps(out[i] + d0, _mm256_mul_ps(acc0[i], inv));
            _mm256_storeu_ps(out[i] + d0 + 8, _mm256_mul_ps(acc1[i], inv));
        }
    }
}

/* softmax of s[0, len) * scale, unnormalised, in place over s[0, width) (zero from len on); returns the sum */
static float row_softmax(float *s, int64_t len, int64_t width, float scale) {
    const __m256 sc = _mm256_set1_ps(scale), lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 mx = _mm256_set1_ps(-FLT_MAX);
    for (int64_t i = 0; i < len; i += 8) {
        const __m256 valid = _mm256_cmp_ps(lane, _mm256_set1_ps((float)(len - i)), _CMP_LT_OQ);
        mx = _mm256_max_ps(mx, _mm256_blendv_ps(mx, _mm256_mul_ps(_mm256_loadu_ps(s + i), sc), valid));
    }
    const __m256 neg_max = _mm256_set1_ps(-hmax8(mx));
    __m256 sum = _mm256_setzero_ps();
    for (int64_t i = 0; i < width; i += 8) {
        const __m256 valid = _mm256_cmp_ps(lane, _mm256_set1_ps((float)(len - i)), _CMP_LT_OQ);
        const __m256 e = _mm256_and_ps(avx2_exp(_mm256_fmadd_ps(_mm256_loadu_ps(s + i), sc, neg_max)), valid);
        sum = _mm256_add_ps(sum, e);
        _mm256_storeu_ps(s + i, e);
    }
    return hsum8(sum);
}

/* query rows [r0, r0 + MR) of kv head h: row r is chunk position r / G, query head h * G + r % G */
static inline __attribute__((always_inline)) void row_block(const PrefillArgs *a, int64_t h, int64_t r0, float *s,
                                                           float *out, const int MR) {
    const float *q[PF_MR];
    float *o[PF_MR], sums[PF_MR];
    ROWS_UNROLLED for (int i = 0; i < MR; i++) {
        const int64_t pos = (r0 + i) / a->G, hq = h * a->G + (r0 + i) % a->G;
        q[i] = a->q + pos * a->q_stride + hq * a->D;
        o[i] = out + (pos * a->H + hq) * a->D;
    }
    const int64_t first = a->ctx - a->n; /* the chunk's first position */
    const int64_t seen = first + (r0 + MR - 1) / a->G + 1; /* keys the block's last row sees */
    const int64_t tiles = (seen + PF_KEYS - 1) / PF_KEYS;
    block_scores(a, h, q, tiles, s, a->ctx_pad, MR);
    ROWS_UNROLLED for (int i = 0; i < MR; i++)
        sums[i] = row_softmax(s + i * a->ctx_pad, first + (r0 + i) / a->G + 1, tiles * PF_KEYS, a->scale);
    block_pv(a, h, s, a->ctx_pad, seen, sums, o, MR);
}

#define PF_CASE(R) case R: row_block(a, h, r0, s, out, R); break;
static void rows(const PrefillArgs *a, int64_t h, int64_t r0, int64_t mr, float *s, float *out) {
    switch (mr) {
    PF_CASE(1) PF_CASE(2) PF_CASE(3) PF_CASE(4) PF_CASE(5)
    default: row_block(a, h, r0, s, out, PF_MR);
    }
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* the kernel over a float32 or bf16 cache (widened as it is packed); float32 queries and output */
static int prefill(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache, int cache_bf16,
                   const int32_t *block_table, int64_t block_size, int64_t n, int64_t ctx, float *out, int64_t H,
                   int64_t Hkv, int64_t D, float scale, int nthreads) {
    if (D % PF_DV || H % Hkv || n < 1 || n > ctx || nthreads < 1 || block_size < 1) return -1;
    const int64_t ctx_pad = (ctx + PF_KEYS - 1) / PF_KEYS * PF_KEYS, per_head = ctx_pad * D;
    float *kp = (float *)aligned_alloc(64, sizeof(float) * 2 * Hkv * per_head);
    if (!kp) return -3;
    float *vp = kp + Hkv * per_head;
    const PrefillArgs a = {q, q_stride, kp, vp, n, ctx, ctx_pad, H, H / Hkv, D, scale};
    const int64_t rows_per_head = n * a.G, blocks = (rows_per_head + PF_MR - 1) / PF_MR;
    const int64_t spans = (ctx_pad + 255) / 256; /* packing work items of 256 keys */
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for collapse(2) schedule(static)
        for (int64_t h = 0; h < Hkv; h++)
            for (int64_t sp = 0; sp < spans; sp++) {
                const int64_t t0 = sp * 256, t1 = t0 + 256 < ctx_pad ? t0 + 256 : ctx_pad;
                pack_head(k_cache, v_cache, cache_bf16, block_table, block_size, Hkv, h, &a, t0, t1,
                          kp + h * per_head, vp + h * per_head);
            }
        float *s = (float *)malloc(sizeof(float) * PF_MR * ctx_pad);
        if (!s) {
#pragma omp atomic write
            failed = 1;
        }
        /* last rows first: they see the most keys, so the dynamic schedule ends balanced */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < Hkv * blocks; item++) {
            if (!s) continue;
            const int64_t h = item % Hkv, r0 = (blocks - 1 - item / Hkv) * PF_MR;
            const int64_t mr = rows_per_head - r0 < PF_MR ? rows_per_head - r0 : PF_MR;
            rows(&a, h, r0, mr, s, out);
        }
        free(s);
    }
    free(kp);
    return failed ? -3 : 0;
}
#endif

/* q: [n, H, D] float32 (rows q_stride floats apart, heads contiguous), the last n positions of a sequence whose
 * cache (block_table, block_size; [num_blocks, block_size, Hkv, D] float32) holds ctx tokens including these; out:
 * [n, H, D] float32, contiguous. Returns 0; -1 on shapes it does not take (D % 16, H % Hkv, n > ctx), -2 without
 * AVX2 + FMA (the caller keeps the torch path), -3 out of memory. */
int llmd_paged_prefill_attention_f32(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                                     const int32_t *block_table, int64_t block_size, int64_t n, int64_t ctx,
                                     float *out, int64_t H, int64_t Hkv, int64_t D, float scale, int nthreads) {
#if defined(__AVX2__) && defined(__FMA__)
    return prefill(q, q_stride, k_cache, v_cache, 0, block_table, block_size, n, ctx, out, H, Hkv, D, scale, nthreads);
#else
    (void)q; (void)q_stride; (void)k_cache; (void)v_cache; (void)block_table; (void)block_size; (void)n; (void)ctx;
    (void)out; (void)H; (void)Hkv; (void)D; (void)scale; (void)nthreads;
    return -2;
#endif
}

/* The same for bf16 queries, cache and output where AVX-512 BF16's kernel (prefill_attention.c) does not run: float32
 * math on the widened values, the output rounded once to bf16. */
int llmd_paged_prefill_attention_bf16_avx2(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                                           const uint16_t *v_cache, const int32_t *block_table, int64_t block_size,
                                           int64_t n, int64_t ctx, uint16_t *out, int64_t H, int64_t Hkv, int64_t D,
                                           float scale, int nthreads) {
#if defined(__AVX2__) && defined(__FMA__)
    if (D % PF_DV || n < 1) return -1;
    const int64_t row = H * D;
    float *q32 = malloc(sizeof(float) * 2 * (size_t)(n * row)), *out32 = q32 + n * row;
    if (!q32) return -3;
    for (int64_t j = 0; j < n; j++) bf16_to_f32_rows(q + j * q_stride, q32 + j * row, row);
    const int rc =
        prefill(q32, row, k_cache, v_cache, 1, block_table, block_size, n, ctx, out32, H, Hkv, D, scale, nthreads);
    if (rc == 0) f32_to_bf16_rows(out32, out, n * row);
    free(q32);
    return rc;
#else
    (void)q; (void)q_stride; (void)k_cache; (void)v_cache; (void)block_table; (void)block_size; (void)n; (void)ctx;
    (void)out; (void)H; (void)Hkv; (void)D; (void)scale; (void)nthreads;
    return -2;
#endif
}
