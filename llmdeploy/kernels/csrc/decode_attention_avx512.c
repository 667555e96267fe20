/* The decode attention's two passes over a float32 or bfloat16 K/V cache on AVX-512 CPUs, called by
 * decode_attention.c's decode_part for one (sequence, split); each returns -1 where it does not apply, and the
 * 8-lane passes run.
 * - scores: q . k in 512-bit vectors, each K row loaded once for its query heads and each head's 16 partial sums
 *   folded to 8 for the 8-lane reduction. Over a bf16 cache with vdpbf16ps on pairs of dimensions (AVX-512 BF16),
 *   32 dimensions an instruction where the 8-lane pass took 4 FMAs and the widening of every K element: bf16
 *   products are exact in float32, so this is float32 multiply-add in another order; q must be bf16 already (the
 *   bf16 model's queries are: they come from its bf16 projection). The scale multiplies the sums.
 * - P.V: the sums of up to 24 vectors of query heads of one kv head stay in registers over a chunk of tokens, each
 *   V row loaded (widened from bf16) once per kv head, where the 8-lane pass loaded and stored every sum a token.
 * The score pass prefetches K and V rows to L2 a fixed number of tokens ahead through the block table (the paged
 * cache puts blocks anywhere, so the hardware prefetcher stops at each block's end), and P.V the next chunk's V rows
 * to L1.
 * Why: the 8-lane passes ran compute-bound (SmolLM2, Zen 4: bf16 32 sequences x 192 tokens, 166 us a layer from L3
 * and 284 behind the weight stream, a fifth of a batch-32 bf16 decode step; 4 x 140: 21 / 43 us). */
#include <float.h>
#include <stdint.h>

#include "lanes.h"
#include "prefetch.h"

int llmd_attn_scores_avx512(int bf16, const float *q, const void *k_cache, const void *v_cache, const int64_t *slots,
                            int64_t n, int64_t H, int64_t Hkv, int64_t D, float scale, float *scores, int64_t n8,
                            float *m);
int llmd_attn_pv_avx512(int bf16, const void *v_cache, const int64_t *slots, int64_t n, const float *probs,
                        int64_t n8, int64_t H, int64_t Hkv, int64_t D, float *acc);

#if defined(__AVX512F__)
/* tokens ahead whose K and V rows the score pass prefetches to L2, so P.V finds V there (SmolLM2 bf16, Zen 4, behind
 * a weight stream: 32 x 192 0.86x the time of K alone to L1 32 ahead and V 16 ahead in P.V; 16 ahead 0.97x of 64) */
#define AHEAD 16
#define PV_CHUNK 16 /* tokens a P.V block runs between loading and storing its sums, and its V prefetch to L1 */
#define PV_SUMS 28  /* registers a P.V block may fill with sums and one V row */


/* 16 lanes of partial sums -> 8 */
static inline __m256 fold(__m512 s) {
    return _mm256_add_ps(_mm512_castps512_ps256(s), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
}

/* 16 elements of a row as float32 */
static inline __m512 load16(const char *row, int64_t i, const int BF16) {
    if (!BF16) return _mm512_loadu_ps((const float *)row + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* t[hq * 8 + j] = 8 partial sums of q_hq . k for every query head hq of one token's K row. float32: q is float32,
 * VZ = D / 16; bf16: q is bf16 pairs, VZ = D / 32 (vdpbf16ps) */
static inline __attribute__((always_inline)) void token_scores(const void *q, const char *k, int64_t Hkv, int64_t G,
                                                              int64_t D, int64_t j, __m256 *t, const int BF16,
                                                              const int VZ) {
    const int64_t es = BF16 ? 2 : 4, lanes = BF16 ? 32 : 16;
    for (int64_t h = 0; h < Hkv; h++) {
        __m512 kz[8];
        ROWS_UNROLLED for (int z = 0; z < VZ; z++) kz[z] = _mm512_loadu_ps(k + (h * D + lanes * z) * es);
        for (int64_t g = 0; g < G; g++) {
            const char *qh = (const char *)q + (h * G + g) * D * es;
            __m512 s = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
            if (BF16) {
                ROWS_UNROLLED for (int z = 0; z < VZ; z++) s = _mm512_dpbf16_ps(
                    s, (__m512bh)_mm512_loadu_ps(qh + lanes * z * es), (__m512bh)kz[z]);
            }
#endif
            if (!BF16) {
                ROWS_UNROLLED for (int z = 0; z < VZ; z++) s =
                    _mm512_fmadd_ps(_mm512_loadu_ps((const float *)qh + lanes * z), kz[z], s);
            }
            t[(h * G + g) * 8 + j] = fold(s);
        }
    }
}

static inline __attribute__((always_inline)) void scores_pass(const void *q, const char *k_cache,
                                                             const char *v_cache, const int64_t *slots, int64_t n,
                                                             int64_t H, int64_t Hkv, int64_t D, float scale,
                                                             float *scores, int64_t n8, float *m, const int BF16,
                                                             const int VZ) {
    const int64_t G = H / Hkv, row = Hkv * D * (BF16 ? 2 : 4);
    __m256 t[8 * H], mv[H];
    for (int64_t hq = 0; hq < H; hq++) mv[hq] = _mm256_set1_ps(-FLT_MAX);
    const __m256 sc = _mm256_set1_ps(scale);
    for (int64_t i = 0; i < n; i += 8) {
        const int64_t cnt = n - i < 8 ? n - i : 8;
        for (int64_t j = 0; j < 8; j++) { /* lanes past the end repeat the group's first token (masked later) */
            if (j < cnt) {
                if (i + j < AHEAD) prefetch_l2(v_cache + slots[i + j] * row, row);
                if (i + j + AHEAD < n) {
                    prefetch_l2(k_cache + slots[i + j + AHEAD] * row, row);
                    prefetch_l2(v_cache + slots[i + j + AHEAD] * row, row);
                }
            }
            token_scores(q, k_cache + slots[i + (j < cnt ? j : 0)] * row, Hkv, G, D, j, t, BF16, VZ);
        }
        for (int64_t hq = 0; hq < H; hq++) {
            const __m256 s = _mm256_mul_ps(v8_hsum8(t + hq * 8), sc);
            _mm256_storeu_ps(scores + hq * n8 + i, s);
            mv[hq] = _mm256_max_ps(mv[hq], s);
        }
    }
    for (int64_t hq = 0; hq < H; hq++) m[hq] = v8_hmax(mv[hq]);
}

/* scores[hq * n8 + i] = scale * q_hq . k_i for tokens i < n at `slots` (and the first token of the last group of 8
 * again in that group's lanes past n), m[hq] their maximum; V rows are prefetched for llmd_attn_pv_avx512. -1
 * (nothing written) unless D is 32, 64, 96 or 128, and for a bf16 cache the CPU has AVX-512 BF16 and every q
 * element is a bf16 value. */
int llmd_attn_scores_avx512(int bf16, const float *q, const void *k_cache, const void *v_cache, const int64_t *slots,
                            int64_t n, int64_t H, int64_t Hkv, int64_t D, float scale, float *scores, int64_t n8,
                            float *m) {
    if (D % 32 || D > 128 || H % Hkv || n < 1) return -1;
    const char *k = k_cache, *v = v_cache;
    /* vectors a head's row takes: D / 16 of float32, D / 32 of bf16 pairs; each D its own constant */
#define SCORES(QV, BF16)                                                                                         \
    switch (D / 32) {                                                                                            \
    case 1: scores_pass(QV, k, v, slots, n, H, Hkv, D, scale, scores, n8, m, BF16, 2 - BF16); break;             \
    case 2: scores_pass(QV, k, v, slots, n, H, Hkv, D, scale, scores, n8, m, BF16, 2 * (2 - BF16)); break;       \
    case 3: scores_pass(QV, k, v, slots, n, H, Hkv, D, scale, scores, n8, m, BF16, 3 * (2 - BF16)); break;       \
    default: scores_pass(QV, k, v, slots, n, H, Hkv, D, scale, scores, n8, m, BF16, 4 * (2 - BF16));             \
    }
    if (!bf16) {
        SCORES(q, 0)
        return 0;
    }
#if defined(__AVX512BF16__)
    uint16_t qb[H * D];
    for (int64_t i = 0; i < H * D; i++) {
        uint32_t bits;
        memcpy(&bits, q + i, sizeof bits);
        if (bits & 0xFFFF) return -1;
        qb[i] = (uint16_t)(bits >> 16);
    }
    SCORES(qb, 1)
    return 0;
#else
    return -1;
#endif
#undef SCORES
}

/* GB query heads (D16 vectors each) of one kv head over tokens [c0, c1): acc[g * D ..] += sum p_g[t] * v_t, the
 * sums in registers, tokens in order. `ahead`: also prefetch the V row PV_CHUNK tokens on (up to n). */
static inline __attribute__((always_inline)) void pv_block(const char *v_cache, const int64_t *slots, int64_t c0,
                                                          int64_t c1, int64_t n, int64_t row, int64_t off,
                                                          const float *p, int64_t n8, float *acc, int64_t D,
                                                          int ahead, const int BF16, const int GB, const int D16) {
    __m512 s[6][8];
    ROWS_UNROLLED for (int g = 0; g < GB; g++) ROWS_UNROLLED for (int z = 0; z < D16; z++) s[g][z] =
        _mm512_loadu_ps(acc + g * D + 16 * z);
    for (int64_t t = c0; t < c1; t++) {
        if (ahead && t + PV_CHUNK < n) prefetch_l1(v_cache + slots[t + PV_CHUNK] * row, row);
        const char *v = v_cache + slots[t] * row;
        __m512 vz[8];
        ROWS_UNROLLED for (int z = 0; z < D16; z++) vz[z] = load16(v, off + 16 * z, BF16);
        ROWS_UNROLLED for (int g = 0; g < GB; g++) {
            const __m512 pg = _mm512_set1_ps(p[g * n8 + t]);
            ROWS_UNROLLED for (int z = 0; z < D16; z++) s[g][z] = _mm512_fmadd_ps(pg, vz[z], s[g][z]);
        }
    }
    ROWS_UNROLLED for (int g = 0; g < GB; g++) ROWS_UNROLLED for (int z = 0; z < D16; z++)
        _mm512_storeu_ps(acc + g * D + 16 * z, s[g][z]);
}

#define PV_CASE(B_, G_, D16_)                                                                                    \
    case G_:                                                                                                     \
        pv_block(v_cache, slots, c0, c1, n, row, off, p, n8, acc, D, ahead, B_, G_, D16_);                        \
        break;
#define PV_SWITCH(B_)                                                                                            \
    if (D == 64) switch (gb) { PV_CASE(B_, 1, 4) PV_CASE(B_, 2, 4) PV_CASE(B_, 3, 4) PV_CASE(B_, 4, 4)           \
                               PV_CASE(B_, 5, 4) PV_CASE(B_, 6, 4) }                                             \
    else switch (gb) { PV_CASE(B_, 1, 8) PV_CASE(B_, 2, 8) }
static void pv_heads(int bf16, const char *v_cache, const int64_t *slots, int64_t c0, int64_t c1, int64_t n,
                     int64_t row, int64_t off, const float *p, int64_t n8, float *acc, int64_t D, int ahead, int gb) {
    if (bf16) {
        PV_SWITCH(1)
    } else {
        PV_SWITCH(0)
    }
}

/* acc[hq * D + d] = sum over tokens i < n (at `slots`) of probs[hq * n8 + i] * v_i[hq's kv head, d]; -1 (nothing
 * written) unless D is 64 or 128. */
int llmd_attn_pv_avx512(int bf16, const void *v_cache, const int64_t *slots, int64_t n, const float *probs,
                        int64_t n8, int64_t H, int64_t Hkv, int64_t D, float *acc) {
    if ((D != 64 && D != 128) || H % Hkv) return -1;
    const int64_t G = H / Hkv, row = Hkv * D * (bf16 ? 2 : 4), D16 = D / 16, most = (PV_SUMS - D16) / D16;
    memset(acc, 0, sizeof(float) * (size_t)(H * D));
    for (int64_t c0 = 0; c0 < n; c0 += PV_CHUNK) {
        const int64_t c1 = c0 + PV_CHUNK < n ? c0 + PV_CHUNK : n;
        for (int64_t h = 0; h < Hkv; h++)
            for (int64_t g0 = 0; g0 < G; g0 += most) {
                const int64_t hq = h * G + g0;
                pv_heads(bf16, v_cache, slots, c0, c1, n, row, h * D, probs + hq * n8, n8, acc + hq * D, D,
                         h == 0 && g0 == 0, (int)(G - g0 < most ? G - g0 : most));
            }
    }
    return 0;
}
#else
int llmd_attn_scores_avx512(int bf16, const float *q, const void *k_cache, const void *v_cache, const int64_t *slots,
                            int64_t n, int64_t H, int64_t Hkv, int64_t D, float scale, float *scores, int64_t n8,
                            float *m) {
    (void)bf16, (void)q, (void)k_cache, (void)v_cache, (void)slots, (void)n, (void)H, (void)Hkv, (void)D;
    (void)scale, (void)scores, (void)n8, (void)m;
    return -1;
}
int llmd_attn_pv_avx512(int bf16, const void *v_cache, const int64_t *slots, int64_t n, const float *probs,
                        int64_t n8, int64_t H, int64_t Hkv, int64_t D, float *acc) {
    (void)bf16, (void)v_cache, (void)slots, (void)n, (void)probs, (void)n8, (void)H, (void)Hkv, (void)D, (void)acc;
    return -1;
}
#endif
