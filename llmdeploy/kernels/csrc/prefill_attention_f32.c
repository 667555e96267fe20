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

/* n cache elements (float32, or bf16 where bf16) from element i -> float32 */
static inline void widen_elems(const void *cache, int bf16, int64_t i, int64_t n, float *dst) {
    if (!bf16) {
        memcpy(dst, (const float *)cache + i, sizeof(float) * (size_t)n);
        return;
    }
    bf16_to_f32_rows((const uint16_t *)cache + i, dst, n);
}

/* K tile t, dim d -> 16 keys; V columns c (dims 16c .. 16c + 15) -> one 16-float row per key */
static void pack_head(const void *k_cache, const void *v_cache, int bf16, const int32_t *table, int64_t block_size,
                      int64_t Hkv, int64_t h, const PrefillArgs *a, int64_t t0, int64_t t1, float *kp, float *vp) {
    const int64_t D = a->D;
    float k[D];
    for (int64_t t = t0; t < t1; t++) {
        float *kt = kp + (t / PF_KEYS) * PF_KEYS * D + t % PF_KEYS, *vt = vp + t * PF_DV;
        if (t < a->ctx) {
            const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
            widen_elems(k_cache, bf16, (slot * Hkv + h) * D, D, k);
            for (int64_t d = 0; d < D; d++) kt[d * PF_KEYS] = k[d];
            for (int64_t c = 0; c < D / PF_DV; c++)
                widen_elems(v_cache, bf16, (slot * Hkv + h) * D + c * PF_DV, PF_DV, vt + c * a->ctx_pad * PF_DV);
        } else {
            for (int64_t d = 0; d < D; d++) kt[d * PF_KEYS] = 0.0f;
            for (int64_t c = 0; c < D / PF_DV; c++) memset(vt + c * a->ctx_pad * PF_DV, 0, sizeof(float) * PF_DV);
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
