/* paged_prefill_attention for a bfloat16 cache on CPUs with AVX-512 BF16: one sequence's chunk of queries (the
 * chunk's K/V already stored) against its whole context, read from the paged cache. Built into one library with cpu_kernels.c.
 *
 * Why: long-context chunked prefill spent most of its attention time in float32 matmuls over a gathered copy of
 * the context (kernels/reference.py causal_attention, ~90 GFLOP/s on 2 Zen 4 cores). Here q.k and p.v run as
 * vdpbf16ps dot products (bf16 pairs, float32 sums) and the softmax stays in float32:
 *   1. per kv head, the context's K is packed once into tiles of 32 keys (pairs of head dims: the operand order of
 *      vdpbf16ps) and V into pairs of keys; zero past the context;
 *   2. per block of MR query rows (a kv head's query heads x chunk positions, position-major), the scores against
 *      every key the block's last row may see, an exact float32 softmax per row over the keys its own position
 *      sees (causal), the unnormalised probabilities rounded to bf16 (as flash attention does), then p.v with
 *      float32 sums, divided by the row's float32 sum and rounded once to bf16.
 * Scores equal the float32 reference up to summation order (bf16 x bf16 products are exact in float32); the only
 * extra rounding is p to bf16. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "avx512_exp.h"
#include "prefetch.h"
#include "unroll.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>

#define PF_KEYS 32 /* keys per K tile: two 16-lane score vectors */
#define PF_MR 6    /* query rows per block: 6 x 4 p.v accumulators + 4 V vectors fit the 32 registers */
#define PF_DV 64   /* head dims per p.v pass (4 vectors) */

typedef struct {
    const uint16_t *q; /* chunk position j, query head hq: q + j * q_stride + hq * D */
    int64_t q_stride;
    const uint16_t *kp, *vp; /* packed K and V, per kv head: ctx_pad * D elements each */
    int64_t n, ctx, ctx_pad, H, G, D;
    float scale;
} PrefillArgs;

static inline const uint16_t *row_q(const PrefillArgs *a, int64_t h, int64_t r) {
    return a->q + (r / a->G) * a->q_stride + (h * a->G + r % a->G) * a->D;
}

/* 16 x 16 32-bit elements transposed in registers: r[i] lane j -> r[j] lane i */
static inline void transpose_16x16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    }
}

/* key t's row of kv head h in a cache, or NULL past the context */
static inline const uint16_t *cache_row(const uint16_t *cache, const int32_t *table, int64_t block_size, int64_t Hkv,
                                        int64_t h, const PrefillArgs *a, int64_t t) {
    if (t >= a->ctx) return NULL;
    return cache + (((int64_t)table[t / block_size] * block_size + t % block_size) * Hkv + h) * a->D;
}

/* K tile t, dim pair p -> 32 keys x (k[2p], k[2p + 1]); V key pair P, dim d -> (v[2P][d], v[2P + 1][d]). Keys
 * [t0, t1) of kv head h, whole tiles. In registers: a K tile is four 16 x 16 transposes of 32-bit pairs, a V key pair
 * two rows interleaved; the next tile's rows are prefetched (the cache is read once a call, from memory: the whole
 * context is packed again for every chunk of a long prompt, where scalar copies took half the call). */
static void pack_head(const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *table, int64_t block_size,
                      int64_t Hkv, int64_t h, const PrefillArgs *a, int64_t t0, int64_t t1, uint16_t *kp,
                      uint16_t *vp) {
    const int64_t D = a->D;
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                        37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int64_t t = t0; t < t1; t += PF_KEYS) {
        const uint16_t *krow[PF_KEYS], *vrow[PF_KEYS];
        for (int c = 0; c < PF_KEYS; c++) {
            krow[c] = cache_row(k_cache, table, block_size, Hkv, h, a, t + c);
            vrow[c] = cache_row(v_cache, table, block_size, Hkv, h, a, t + c);
            const int64_t ahead = t + PF_KEYS + c;
            if (ahead < t1 && ahead < a->ctx) {
                prefetch_l2(cache_row(k_cache, table, block_size, Hkv, h, a, ahead), 2 * D);
                prefetch_l2(cache_row(v_cache, table, block_size, Hkv, h, a, ahead), 2 * D);
            }
        }
        uint16_t *kt = kp + t * D;
        for (int64_t p0 = 0; p0 < D / 2; p0 += 16) /* 16 dim pairs (one 512-bit load of a row) at a time */
            for (int half = 0; half < 2; half++) {
                __m512i r[16];
                for (int c = 0; c < 16; c++) {
                    const uint16_t *k = krow[half * 16 + c];
                    r[c] = k ? _mm512_loadu_si512(k + 2 * p0) : _mm512_setzero_si512();
                }
                transpose_16x16(r);
                for (int i = 0; i < 16; i++) _mm512_storeu_si512(kt + (p0 + i) * PF_KEYS * 2 + half * 32, r[i]);
            }
        for (int c = 0; c < PF_KEYS; c += 2) {
            uint16_t *vt = vp + (t + c) * D;
            for (int64_t d0 = 0; d0 < D; d0 += 32) {
                const __m512i v0 = vrow[c] ? _mm512_loadu_si512(vrow[c] + d0) : _mm512_setzero_si512();
                const __m512i v1 = vrow[c + 1] ? _mm512_loadu_si512(vrow[c + 1] + d0) : _mm512_setzero_si512();
                _mm512_storeu_si512(vt + d0 * 2, _mm512_permutex2var_epi16(v0, lo, v1));
                _mm512_storeu_si512(vt + d0 * 2 + 32, _mm512_permutex2var_epi16(v0, hi, v1));
            }
        }
    }
}

static inline __m512bh pair_of(const uint16_t *p) {
    int32_t both;
    memcpy(&both, p, sizeof both);
    return (__m512bh)_mm512_set1_epi32(both);
}

/* s[i * ss + key] = q_i . k_key for MR rows and keys [0, tiles * 32) of kv head h */
static inline __attribute__((always_inline)) void block_scores(const PrefillArgs *a, int64_t h,
                                                              const uint16_t **q, int64_t tiles, float *s,
                                                              int64_t ss, const int MR) {
    const uint16_t *kp = a->kp + h * a->ctx_pad * a->D;
    for (int64_t t = 0; t < tiles; t++) {
        __m512 s0[PF_MR], s1[PF_MR];
        ROWS_UNROLLED for (int i = 0; i < MR; i++) s0[i] = s1[i] = _mm512_setzero_ps();
        const uint16_t *tile = kp + t * PF_KEYS * a->D;
        for (int64_t p = 0; p < a->D / 2; p++) {
            const __m512bh k0 = (__m512bh)_mm512_loadu_si512(tile + p * 64);
            const __m512bh k1 = (__m512bh)_mm512_loadu_si512(tile + p * 64 + 32);
            ROWS_UNROLLED for (int i = 0; i < MR; i++) {
                const __m512bh qb = pair_of(q[i] + 2 * p);
                s0[i] = _mm512_dpbf16_ps(s0[i], qb, k0);
                s1[i] = _mm512_dpbf16_ps(s1[i], qb, k1);
            }
        }
        ROWS_UNROLLED for (int i = 0; i < MR; i++) {
            _mm512_storeu_ps(s + i * ss + t * PF_KEYS, s0[i]);
            _mm512_storeu_ps(s + i * ss + t * PF_KEYS + 16, s1[i]);
        }
    }
}

/* out rows = (p_i . v) / sums[i] for MR rows over key pairs [0, pairs), probabilities p in bf16 */
static inline __attribute__((always_inline)) void block_pv(const PrefillArgs *a, int64_t h, const uint16_t *p,
                                                          int64_t ps, int64_t pairs, const float *sums,
                                                          uint16_t **out, const int MR) {
    const uint16_t *vp = a->vp + h * a->ctx_pad * a->D;
    for (int64_t d0 = 0; d0 < a->D; d0 += PF_DV) {
        __m512 acc[PF_MR][4];
        ROWS_UNROLLED for (int i = 0; i < MR; i++)
            for (int z = 0; z < 4; z++) acc[i][z] = _mm512_setzero_ps();
        for (int64_t k = 0; k < pairs; k++) {
            const uint16_t *v = vp + (k * a->D + d0) * 2;
            __m512bh vv[4];
            for (int z = 0; z < 4; z++) vv[z] = (__m512bh)_mm512_loadu_si512(v + 32 * z);
            ROWS_UNROLLED for (int i = 0; i < MR; i++) {
                const __m512bh pb = pair_of(p + i * ps + 2 * k);
                for (int z = 0; z < 4; z++) acc[i][z] = _mm512_dpbf16_ps(acc[i][z], pb, vv[z]);
            }
        }
        ROWS_UNROLLED for (int i = 0; i < MR; i++) {
            const __m512 inv = _mm512_set1_ps(1.0f / sums[i]);
            for (int z = 0; z < 4; z++)
                _mm256_storeu_si256((__m256i *)(out[i] + d0 + 16 * z),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[i][z], inv)));
        }
    }
}

/* softmax of s[0, len) * scale in float32 -> unnormalised bf16 p[0, width) (zero from len on); returns the sum */
static float row_softmax(float *s, int64_t len, int64_t width, float scale, uint16_t *p) {
    const __m512 sc = _mm512_set1_ps(scale);
    __m512 mx = _mm512_set1_ps(-FLT_MAX);
    for (int64_t i = 0; i < len; i += 16) {
        const __mmask16 m = len - i >= 16 ? 0xFFFF : (__mmask16)((1u << (len - i)) - 1);
        const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + i), sc);
        mx = _mm512_mask_max_ps(mx, m, mx, x);
    }
    const __m512 neg_max = _mm512_set1_ps(-_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < width; i += 16) {
        const __mmask16 m = len - i >= 16 ? 0xFFFF : len <= i ? 0 : (__mmask16)((1u << (len - i)) - 1);
        const __m512 e = _mm512_maskz_mov_ps(m, v16_exp(_mm512_fmadd_ps(_mm512_loadu_ps(s + i), sc, neg_max)));
        sum = _mm512_add_ps(sum, e);
        _mm256_storeu_si256((__m256i *)(p + i), (__m256i)_mm512_cvtneps_pbh(e));
    }
    return _mm512_reduce_add_ps(sum);
}

/* query rows [r0, r0 + MR) of kv head h: row r is chunk position r / G, query head h * G + r % G */
static inline __attribute__((always_inline)) void row_block(const PrefillArgs *a, int64_t h, int64_t r0,
                                                           float *s, uint16_t *p, uint16_t *out, const int MR) {
    const uint16_t *q[PF_MR];
    uint16_t *o[PF_MR];
    float sums[PF_MR];
    ROWS_UNROLLED for (int i = 0; i < MR; i++) {
        q[i] = row_q(a, h, r0 + i);
        o[i] = out + ((r0 + i) / a->G * a->H + h * a->G + (r0 + i) % a->G) * a->D;
    }
    const int64_t first = a->ctx - a->n; /* the chunk's first position */
    const int64_t seen = first + (r0 + MR - 1) / a->G + 1; /* keys the block's last row sees */
    const int64_t tiles = (seen + PF_KEYS - 1) / PF_KEYS, width = tiles * PF_KEYS;
    block_scores(a, h, q, tiles, s, a->ctx_pad, MR);
    ROWS_UNROLLED for (int i = 0; i < MR; i++)
        sums[i] = row_softmax(s + i * a->ctx_pad, first + (r0 + i) / a->G + 1, width, a->scale, p + i * a->ctx_pad);
    block_pv(a, h, p, a->ctx_pad, (seen + 1) / 2, sums, o, MR);
}

#define PF_CASE(R) case R: row_block(a, h, r0, s, p, out, R); break;
static void rows(const PrefillArgs *a, int64_t h, int64_t r0, int64_t mr, float *s, uint16_t *p, uint16_t *out) {
    switch (mr) {
    PF_CASE(1) PF_CASE(2) PF_CASE(3) PF_CASE(4) PF_CASE(5)
    default: row_block(a, h, r0, s, p, out, PF_MR);
    }
}
#endif

/* q: [n, H, D] bf16 (rows q_stride elements apart, heads contiguous), the last n positions of a sequence whose
 * cache (block_table, block_size; [num_blocks, block_size, Hkv, D] bf16) holds ctx tokens including these; out:
 * [n, H, D] bf16, contiguous. Returns 0; -1 on shapes it does not take (D % 64, H % Hkv, n > ctx), -2 without
 * AVX-512 BF16 (the caller keeps the torch path), -3 out of memory. */
int llmd_paged_prefill_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                                      const uint16_t *v_cache, const int32_t *block_table, int64_t block_size,
                                      int64_t n, int64_t ctx, uint16_t *out, int64_t H, int64_t Hkv, int64_t D,
                                      float scale, int nthreads) {
#if defined(__AVX512BF16__)
    if (D % PF_DV || H % Hkv || n < 1 || n > ctx || nthreads < 1 || block_size < 1) return -1;
    const int64_t ctx_pad = (ctx + PF_KEYS - 1) / PF_KEYS * PF_KEYS, per_head = ctx_pad * D;
    uint16_t *kp = (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * 2 * Hkv * per_head);
    if (!kp) return -3;
    uint16_t *vp = kp + Hkv * per_head;
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
                pack_head(k_cache, v_cache, block_table, block_size, Hkv, h, &a, t0, t1, kp + h * per_head,
                          vp + h * per_head);
            }
        float *s = (float *)malloc((sizeof(float) + sizeof(uint16_t)) * PF_MR * ctx_pad);
        if (!s) {
#pragma omp atomic write
            failed = 1;
        }
        uint16_t *p = (uint16_t *)(s + PF_MR * ctx_pad);
        /* last rows first: they see the most keys, so the dynamic schedule ends balanced */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < Hkv * blocks; item++) {
            if (!s) continue;
            const int64_t h = item % Hkv, r0 = (blocks - 1 - item / Hkv) * PF_MR;
            const int64_t mr = rows_per_head - r0 < PF_MR ? rows_per_head - r0 : PF_MR;
            rows(&a, h, r0, mr, s, p, out);
        }
        free(s);
    }
    free(kp);
    return failed ? -3 : 0;
#else
    (void)q; (void)q_stride; (void)k_cache; (void)v_cache; (void)block_table; (void)block_size; (void)n; (void)ctx;
    (void)out; (void)H; (void)Hkv; (void)D; (void)scale; (void)nthreads;
    return -2;
#endif
}
