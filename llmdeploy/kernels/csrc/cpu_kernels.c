/* CPU kernels for llmdeploy, built at first use by kernels/cpu_native.py (gcc -O3 -march=native -fopenmp) and
 * called through ctypes. No torch headers: the build takes about a second. OpenMP comes from the libgomp torch
 * already loaded (same soname), so these loops share torch's thread pool instead of starting a second one.
 *
 * paged_decode_attention: one query token per sequence against its K/V read in place from the paged cache (no
 * gather): per (sequence, kv head, context split) scores -> softmax -> P.V, the kv head's query heads (GQA) sharing
 * every K/V row. Splits of one long context are merged flash-decoding style (max, sum, rescaled partial outputs).
 *
 * q_linear: y = x @ w^T + bias with w in GGUF's block-quantized formats (Q8_0, Q4_0/Q4_1), read once per call
 * and widened in registers (bandwidth-bound decode reads 5-8.5 bits per weight instead of 32).
 *
 * Lanes are 8 floats: AVX2+FMA intrinsics where the compiler targets them, plain loops otherwise (same results up
 * to summation order).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "row_chunk.h"
#include "unroll.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "avx2_exp.h"
#define LLMD_AVX2 1
typedef __m256 v8;
static inline v8 v8_load(const float *p) { return _mm256_loadu_ps(p); }
static inline v8 v8_load_bf16(const uint16_t *p) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
static inline v8 v8_load_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline void v8_store(float *p, v8 x) { _mm256_storeu_ps(p, x); }
static inline v8 v8_set1(float x) { return _mm256_set1_ps(x); }
static inline v8 v8_zero(void) { return _mm256_setzero_ps(); }
static inline v8 v8_fma(v8 a, v8 b, v8 c) { return _mm256_fmadd_ps(a, b, c); }
static inline v8 v8_mul(v8 a, v8 b) { return _mm256_mul_ps(a, b); }
static inline v8 v8_add(v8 a, v8 b) { return _mm256_add_ps(a, b); }
static inline v8 v8_max(v8 a, v8 b) { return _mm256_max_ps(a, b); }
static inline float v8_hsum(v8 x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline float v8_hmax(v8 x) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
/* lane i = the sum of a[i]'s lanes */
static inline v8 v8_hsum8(const v8 *a) {
    __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
    __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
    __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20), hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
    return _mm256_add_ps(lo, hi);
}
static inline v8 v8_exp(v8 x) { return avx2_exp(x); }
#else
#define LLMD_AVX2 0
typedef struct {
    float x[8];
} v8;
static inline v8 v8_load(const float *p) {
    v8 r;
    memcpy(r.x, p, sizeof r.x);
    return r;
}
static inline v8 v8_load_bf16(const uint16_t *p) {
    v8 r;
    for (int i = 0; i < 8; i++) {
        uint32_t u = (uint32_t)p[i] << 16;
        memcpy(&r.x[i], &u, 4);
    }
    return r;
}
static inline v8 v8_load_i8(const int8_t *p) {
    v8 r;
    for (int i = 0; i < 8; i++) r.x[i] = (float)p[i];
    return r;
}
static inline void v8_store(float *p, v8 x) { memcpy(p, x.x, sizeof x.x); }
static inline v8 v8_set1(float v) {
    v8 r;
    for (int i = 0; i < 8; i++) r.x[i] = v;
    return r;
}
static inline v8 v8_zero(void) { return v8_set1(0.0f); }
static inline v8 v8_fma(v8 a, v8 b, v8 c) {
    for (int i = 0; i < 8; i++) c.x[i] += a.x[i] * b.x[i];
    return c;
}
static inline v8 v8_mul(v8 a, v8 b) {
    for (int i = 0; i < 8; i++) a.x[i] *= b.x[i];
    return a;
}
static inline v8 v8_add(v8 a, v8 b) {
    for (int i = 0; i < 8; i++) a.x[i] += b.x[i];
    return a;
}
static inline v8 v8_max(v8 a, v8 b) {
    for (int i = 0; i < 8; i++) a.x[i] = a.x[i] > b.x[i] ? a.x[i] : b.x[i];
    return a;
}
static inline float v8_hsum(v8 x) {
    float s = 0.0f;
    for (int i = 0; i < 8; i++) s += x.x[i];
    return s;
}
static inline float v8_hmax(v8 x) {
    float m = x.x[0];
    for (int i = 1; i < 8; i++) m = x.x[i] > m ? x.x[i] : m;
    return m;
}
static inline v8 v8_hsum8(const v8 *a) {
    v8 r;
    for (int i = 0; i < 8; i++) r.x[i] = v8_hsum(a[i]);
    return r;
}
static inline v8 v8_exp(v8 x) {
    for (int i = 0; i < 8; i++) x.x[i] = expf(x.x[i]);
    return x;
}
#endif

int llmd_has_avx2(void) { return LLMD_AVX2; }

#define MAX_GROUP 8 /* query heads of one kv head in one register block (wider groups: head_block) */
#define MAX_HEADS 256
#define MAX_HEAD_DIM 512
#define PV_PREFETCH 4 /* tokens ahead whose V row P.V prefetches */

/* ---------------------------------------------------------------- decode attention */

typedef struct {
    const float *q; /* [B, H, D] rows of q_row_stride floats between sequences */
    int64_t q_row_stride;
    const void *k_cache, *v_cache; /* [num_blocks, block_size, Hkv, D], float32 or bfloat16 */
    int cache_bf16;
    const int32_t *block_tables; /* [B, bt_stride] */
    int64_t bt_stride;
    const int32_t *context_lens;
    int64_t num_heads, num_kv_heads, head_dim, block_size;
    float scale;
    int head_block; /* query heads per register block (head_block()), worked out once per call */
} DecodeArgs;

/* K/V of one token, all kv heads: Hkv * D elements, contiguous in the cache */
static inline const char *token_row(const DecodeArgs *a, const void *cache, int64_t slot) {
    const int64_t esize = a->cache_bf16 ? 2 : 4;
    return (const char *)cache + slot * a->num_kv_heads * a->head_dim * esize;
}

static inline v8 load_elems(const int bf16, const char *row, int64_t i) {
    return bf16 ? v8_load_bf16((const uint16_t *)row + i) : v8_load((const float *)row + i);
}

/* t[g * 8] = q_g . k (8 lanes, summed later) for G query heads of one kv head, k: D elements of a token's row */
static inline __attribute__((always_inline)) void head_scores(const char *k, const float *q, int64_t D, const int G,
                                                             const int BF16, v8 *t) {
    v8 acc[MAX_GROUP];
    ROWS_UNROLLED for (int g = 0; g < G; g++) acc[g] = v8_zero();
    for (int64_t d = 0; d < D; d += 8) {
        const v8 kv = load_elems(BF16, k, d);
        ROWS_UNROLLED for (int g = 0; g < G; g++) acc[g] = v8_fma(v8_load(q + g * D + d), kv, acc[g]);
    }
    ROWS_UNROLLED for (int g = 0; g < G; g++) t[g * 8] = acc[g];
}

/* acc[g * D + d] += p[g * ps] * v[d] for G query heads of one kv head, v: D elements of a token's row. The sums
 * live in memory (L1): a whole row's worth of them would not fit the registers. */
static inline __attribute__((always_inline)) void head_pv(const char *v, const float *p, int64_t ps, int64_t D,
                                                         const int G, const int BF16, float *acc) {
    v8 pg[MAX_GROUP];
    ROWS_UNROLLED for (int g = 0; g < G; g++) pg[g] = v8_set1(p[g * ps]);
    for (int64_t d = 0; d < D; d += 8) {
        const v8 vv = load_elems(BF16, v, d);
        ROWS_UNROLLED for (int g = 0; g < G; g++) {
            float *o = acc + g * D + d;
            v8_store(o, v8_fma(pg[g], vv, v8_load(o)));
        }
    }
}

/* Scores of 8 tokens (K rows `rows`), t[hq * 8 + j] for query head hq and token j, and P.V of one token. Each row
 * is read whole, kv head after kv head, and rows in token order: a stream the hardware prefetcher follows. (Reading
 * each kv head's segment of 8 rows in turn, rows 768 bytes apart in SmolLM2, kept it from running ahead: the score
 * pass took the L3-resident time plus the DRAM time, not the larger of the two.) G: the query heads of a register
 * block (head_block); G and the cache type are constants where these are inlined (the switches below). */
static inline __attribute__((always_inline)) void group_scores(const DecodeArgs *a, const char *const *rows,
                                                              const float *q, const int G, const int BF16, v8 *t) {
    const int64_t D = a->head_dim, HG = a->num_heads / a->num_kv_heads, es = BF16 ? 2 : 4;
    for (int64_t j = 0; j < 8; j++)
        for (int64_t h = 0; h < a->num_kv_heads; h++)
            for (int64_t g0 = 0; g0 < HG; g0 += G)
                head_scores(rows[j] + h * D * es, q + (h * HG + g0) * D, D, G, BF16, t + (h * HG + g0) * 8 + j);
}

static inline __attribute__((always_inline)) void token_pv(const DecodeArgs *a, const char *row, const float *p,
                                                          int64_t ps, const int G, const int BF16, float *acc) {
    const int64_t D = a->head_dim, HG = a->num_heads / a->num_kv_heads, es = BF16 ? 2 : 4;
    for (int64_t h = 0; h < a->num_kv_heads; h++)
        for (int64_t g0 = 0; g0 < HG; g0 += G)
            head_pv(row + h * D * es, p + (h * HG + g0) * ps, ps, D, G, BF16, acc + (h * HG + g0) * D);
}

/* query heads per register block: the whole group up to MAX_GROUP, else its largest divisor that fits (12 -> 6).
 * Once per call: worked out per token row (its divisions in a loop) it took a tenth of the attention's time. */
static int head_block(int64_t num_heads, int64_t num_kv_heads) {
    const int64_t G = num_heads / num_kv_heads;
    int b = MAX_GROUP;
    while (G % b) b--;
    return G <= MAX_GROUP ? (int)G : b;
}

#define HEAD_CASE(G)                                                                                           \
    case G * 2:                                                                                                \
        HEAD_OP(G, 0);                                                                                         \
        break;                                                                                                 \
    case G * 2 + 1:                                                                                            \
        HEAD_OP(G, 1);                                                                                         \
        break;
#define HEAD_SWITCH(a)                                                                                         \
    switch ((a)->head_block * 2 + (a)->cache_bf16) {                                                           \
        HEAD_CASE(1) HEAD_CASE(2) HEAD_CASE(3) HEAD_CASE(4) HEAD_CASE(5) HEAD_CASE(6) HEAD_CASE(7) HEAD_CASE(8)  \
    }

static void row_scores(const DecodeArgs *a, const char *const *rows, const float *q, v8 *t) {
#define HEAD_OP(G_, BF16_) group_scores(a, rows, q, G_, BF16_, t)
    HEAD_SWITCH(a)
#undef HEAD_OP
}

static void row_pv(const DecodeArgs *a, const char *row, const float *p, int64_t ps, float *acc) {
#define HEAD_OP(G_, BF16_) token_pv(a, row, p, ps, G_, BF16_, acc)
    HEAD_SWITCH(a)
#undef HEAD_OP
}

/* cache slots (block * block_size + offset) of tokens [t0, t1) of sequence b */
static void token_slots(const DecodeArgs *a, int64_t b, int64_t t0, int64_t t1, int64_t *slots) {
    const int32_t *table = a->block_tables + b * a->bt_stride;
    const int64_t bs = a->block_size;
    for (int64_t t = t0; t < t1;) {
        const int64_t block = table[t / bs], end = (t / bs + 1) * bs < t1 ? (t / bs + 1) * bs : t1;
        for (; t < end; t++) *slots++ = block * bs + t % bs;
    }
}

/* Tokens [t0, t1) of sequence b, all heads: unnormalised softmax stats and P.V.
 * m[hq] = max score, l[hq] = sum exp(score - m), acc[hq * D ..] = sum exp(score - m) * v, for query head hq.
 * One item covers every kv head, so K and V are each read token row by token row, in order (row_scores).
 * Scratch: H * n scores, then n slots. */
static void decode_part(const DecodeArgs *a, int64_t b, int64_t t0, int64_t t1, float *scores, int64_t *slots,
                        float *m, float *l, float *acc) {
    const int64_t D = a->head_dim, H = a->num_heads, n = t1 - t0;
    const int64_t row_bytes = a->num_kv_heads * D * (a->cache_bf16 ? 2 : 4);
    float q[H * D];
    const float *qsrc = a->q + b * a->q_row_stride;
    for (int64_t i = 0; i < H * D; i++) q[i] = qsrc[i] * a->scale;
    token_slots(a, b, t0, t1, slots);
    const int64_t n8 = (n + 7) / 8 * 8; /* scores of one head: n, padded to whole groups of 8 */
    v8 mv[MAX_HEADS];
    for (int64_t hq = 0; hq < H; hq++) mv[hq] = v8_set1(-FLT_MAX);
    /* scores: 8 tokens at a time, per query head one 8-lane partial sum a token, reduced together. The lanes past
     * the end of the last group repeat its first token: harmless for the max, and masked out of the sums below. */
    v8 t[H * 8]; /* query head hq, token j: t[hq * 8 + j] */
    for (int64_t i = 0; i < n; i += 8) {
        const int64_t cnt = n - i < 8 ? n - i : 8;
        const char *rows[8];
        for (int64_t j = 0; j < 8; j++) rows[j] = token_row(a, a->k_cache, slots[i + (j < cnt ? j : 0)]);
        row_scores(a, rows, q, t);
        for (int64_t hq = 0; hq < H; hq++) {
            const v8 sc = v8_hsum8(t + hq * 8);
            v8_store(scores + hq * n8 + i, sc);
            mv[hq] = v8_max(mv[hq], sc);
        }
    }
    for (int64_t hq = 0; hq < H; hq++) {
        float *s = scores + hq * n8;
        m[hq] = v8_hmax(mv[hq]);
        const v8 neg_m = v8_set1(-m[hq]);
        v8 sum = v8_zero();
        for (int64_t i = 0; i < n8; i += 8) {
            v8 p = v8_exp(v8_add(v8_load(s + i), neg_m));
            if (i + 8 > n) { /* the last group's repeated lanes: no probability */
                float tmp[8];
                v8_store(tmp, p);
                for (int64_t j = n - i; j < 8; j++) tmp[j] = 0.0f;
                p = v8_load(tmp);
            }
            v8_store(s + i, p);
            sum = v8_add(sum, p);
        }
        l[hq] = v8_hsum(sum);
    }
    /* P.V, V row by row in order; a prefetch a few rows ahead keeps it a few misses deeper than the stream alone
     * (the score pass runs best without one) */
    memset(acc, 0, sizeof(float) * H * D);
    for (int64_t i = 0; i < n; i++) {
        if (i + PV_PREFETCH < n) {
            const char *ahead = token_row(a, a->v_cache, slots[i + PV_PREFETCH]);
            for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(ahead + off, 0, 3);
        }
        row_pv(a, token_row(a, a->v_cache, slots[i]), scores + i, n8, acc);
    }
}

/* splits per sequence: only when sequences alone would leave threads idle, >= 64 tokens each; a lone sequence's
 * splits a multiple of the threads (3 splits on 2 threads would leave one thread two). At batch 1 behind a
 * weight stream the K/V rows come from memory, and one thread alone reads them at a third of the bandwidth:
 * SmolLM2 int8 at context 250, 1.5 -> 1.1 ms of attention a step (Zen 4, 2 threads). */
static int64_t choose_splits(int64_t items, int64_t max_len, int nthreads) {
    if (items >= 2 * nthreads) return 1;
    int64_t want = (4 * nthreads + items - 1) / items;
    int64_t by_len = max_len / 64;
    int64_t s = want < by_len ? want : by_len;
    if (items == 1 && s > nthreads) s = s / nthreads * nthreads;
    return s < 1 ? 1 : s;
}

/* out: [B, H, D] float32, contiguous. Returns 0, or -1 on unsupported shapes (the caller falls back). */
int llmd_paged_decode_attention(const float *q, int64_t q_row_stride, const void *k_cache, const void *v_cache,
                                int cache_bf16, const int32_t *block_tables, int64_t bt_stride,
                                const int32_t *context_lens, float *out, int64_t B, int64_t H, int64_t Hkv,
                                int64_t D, int64_t block_size, float scale, int nthreads) {
    if (H % Hkv || H > MAX_HEADS || D % 8 || D > MAX_HEAD_DIM || nthreads < 1) return -1;
    DecodeArgs a = {q, q_row_stride, k_cache, v_cache, cache_bf16, block_tables, bt_stride, context_lens,
                    H,  Hkv,          D,       block_size, scale,     head_block(H, Hkv)};
    int64_t max_len = 0;
    for (int64_t b = 0; b < B; b++) max_len = context_lens[b] > max_len ? context_lens[b] : max_len;
    const int64_t S = choose_splits(B, max_len, nthreads);
    if (B * S < nthreads) nthreads = (int)(B * S); /* a thread without an item would only wait at the barrier */
    /* per (b, split): m[H], l[H], acc[H * D] */
    const int64_t part_size = H * (D + 2);
    float *part = S > 1 ? (float *)malloc(sizeof(float) * B * S * part_size) : NULL;
    if (S > 1 && !part) return -1;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        const int64_t most = (max_len + S - 1) / S + 16;
        float *scores = (float *)malloc((sizeof(float) * H + sizeof(int64_t)) * most);
        int64_t *slots = (int64_t *)(scores + H * most);
        float ml[2 * MAX_HEADS];
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t b = 0; b < B; b++)
            for (int64_t s = 0; s < S; s++) {
                if (!scores) continue;
                const int64_t len = context_lens[b], chunk = (len + S - 1) / S;
                const int64_t t0 = s * chunk, t1 = t0 + chunk < len ? t0 + chunk : len;
                if (S == 1) {
                    float *o = out + b * H * D;
                    decode_part(&a, b, 0, len, scores, slots, ml, ml + H, o);
                    for (int64_t hq = 0; hq < H; hq++) {
                        const float inv = 1.0f / ml[H + hq];
                        for (int64_t d = 0; d < D; d++) o[hq * D + d] *= inv;
                    }
                } else {
                    float *p = part + (b * S + s) * part_size;
                    if (t1 > t0) {
                        decode_part(&a, b, t0, t1, scores, slots, p, p + H, p + 2 * H);
                    } else { /* an empty split (a short sequence next to long ones): contributes nothing */
                        for (int64_t hq = 0; hq < H; hq++) p[hq] = -FLT_MAX, p[H + hq] = 0.0f;
                        memset(p + 2 * H, 0, sizeof(float) * H * D);
                    }
                }
            }
        free(scores);
    }
    if (!failed && S > 1) {
#pragma omp parallel for collapse(2) num_threads(nthreads)
        for (int64_t b = 0; b < B; b++)
            for (int64_t hq = 0; hq < H; hq++) {
                const float *p0 = part + b * S * part_size;
                float mx = -FLT_MAX, total = 0.0f;
                for (int64_t s = 0; s < S; s++) mx = fmaxf(mx, p0[s * part_size + hq]);
                float *o = out + (b * H + hq) * D;
                for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
                for (int64_t s = 0; s < S; s++) {
                    const float *p = p0 + s * part_size;
                    const float w = p[H + hq] > 0.0f ? expf(p[hq] - mx) : 0.0f;
                    total += w * p[H + hq];
                    for (int64_t d = 0; d < D; d++) o[d] += w * p[2 * H + hq * D + d];
                }
                for (int64_t d = 0; d < D; d++) o[d] /= total;
            }
    }
    free(part);
    return failed ? -1 : 0;
}

/* ---------------------------------------------------------------- block-quantized linear (Q8, Q4) */

/* Weight-only quantized projections in GGUF's block formats: each output channel's inputs in blocks of QB = 32,
 * one float16 scale d per block (Q8: w = d * q, q int8) or a scale and a minimum (Q4: w = d * q + m, q in 0..15;
 * GGUF's Q4_0 is m = -8 d). The weights are packed at load (llmd_q_pack) in tiles of Q_NR = 32 channels; per tile
 * and block: the 32 channels' d (64 bytes), for Q4 their m (64 bytes), then per input the 32 channels' q (32
 * bytes, or 16 for Q4: byte j = channel j's q | channel j + 16's q << 4). A tile is one sequential stream of the
 * file's own bytes (Q4_1: 5 bits a weight), widened and scaled in registers: w is exactly the float32 value a
 * dequantizing loader computes (d * q is exact in float32; Q4 adds m in one rounding), so only the summation
 * order differs from x @ dequantized(w)^T. */
#define QB 32
#define Q_NR 32
#define Q_MR 6
enum { Q_FMT_Q8 = 0, Q_FMT_Q4 = 1 };

static inline int64_t q_block_bytes(int fmt) { return fmt == Q_FMT_Q4 ? 2 * 64 + QB * 16 : 64 + QB * 32; }

/* where channel c's quant of block input kk sits in a block's quant bytes: the float kernel's layout (vnni = 0:
 * per input, 32 channels) or the VNNI kernel's (per 4 inputs, each channel's 4 adjacent); Q4 keeps channel c + 16
 * in the high nibble of channel c's byte */
static inline int64_t q_pos(int fmt, int vnni, int64_t kk, int64_t c) {
    if (!vnni) return fmt == Q_FMT_Q8 ? kk * 32 + c : kk * 16 + (c & 15);
    return fmt == Q_FMT_Q8 ? (kk / 4) * 128 + (c / 16) * 64 + (c % 16) * 4 + kk % 4 : (kk / 4) * 64 + (c % 16) * 4 + kk % 4;
}

/* q [N, K] (int8 for Q8; 0..15 for Q4), d and m [N, K / QB] float16 bits (m unused for Q8) -> packed for the
 * float kernel (vnni = 0) or the VNNI one (size: ceil(N / Q_NR) * (K / QB) * q_block_bytes(fmt)); channels past N
 * get d = 0, so whatever their quants they give zero. VNNI Q8 quants are stored + 128 (vpdpbusd's unsigned side). */
int llmd_q_pack(int fmt, int vnni, const uint8_t *q, const uint16_t *d, const uint16_t *m, int64_t N, int64_t K,
                uint8_t *packed) {
    if (K % QB || (fmt != Q_FMT_Q8 && fmt != Q_FMT_Q4)) return -1;
    const int64_t tiles = (N + Q_NR - 1) / Q_NR, blocks = K / QB, bb = q_block_bytes(fmt);
    memset(packed, 0, (size_t)(tiles * blocks * bb));
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t b = 0; b < blocks; b++) {
            uint8_t *hdr = packed + (t * blocks + b) * bb;
            uint8_t *qs = hdr + (fmt == Q_FMT_Q4 ? 128 : 64);
            for (int64_t c = 0; c < Q_NR && t * Q_NR + c < N; c++) {
                const int64_t n = t * Q_NR + c;
                memcpy(hdr + 2 * c, d + n * blocks + b, 2);
                if (fmt == Q_FMT_Q4) memcpy(hdr + 64 + 2 * c, m + n * blocks + b, 2);
                for (int64_t kk = 0; kk < QB; kk++) {
                    const uint8_t v = q[n * K + b * QB + kk];
                    if (fmt == Q_FMT_Q8) qs[q_pos(fmt, vnni, kk, c)] = vnni ? (uint8_t)((int)(int8_t)v + 128) : v;
                    else qs[q_pos(fmt, vnni, kk, c)] |= (uint8_t)((v & 15) << (c < 16 ? 0 : 4));
                }
            }
        }
    return 0;
}

static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    float f;
    if (exp == 0) f = ldexpf((float)man, -24); /* zero or subnormal */
    else if (exp == 31) {
        const uint32_t u = 0x7f800000u | (man << 13);
        memcpy(&f, &u, 4);
    } else f = ldexpf((float)(man | 0x400), (int)exp - 25);
    uint32_t u;
    memcpy(&u, &f, 4);
    u |= sign;
    memcpy(&f, &u, 4);
    return f;
}

/* out [N, K] float32 = the weights llmd_q_pack packed for either kernel, as a dequantizing
 * loader computes them (d * q is exact in float32, then + m) */
int llmd_q_unpack(int fmt, int vnni, const uint8_t *packed, int64_t N, int64_t K, float *out) {
    if (K % QB || (fmt != Q_FMT_Q8 && fmt != Q_FMT_Q4)) return -1;
    const int64_t tiles = (N + Q_NR - 1) / Q_NR, blocks = K / QB, bb = q_block_bytes(fmt);
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *hdr = packed + (t * blocks + b) * bb, *qs = hdr + (fmt == Q_FMT_Q4 ? 128 : 64);
            for (int64_t c = 0; c < Q_NR && t * Q_NR + c < N; c++) {
                uint16_t dh, mh = 0;
                memcpy(&dh, hdr + 2 * c, 2);
                if (fmt == Q_FMT_Q4) memcpy(&mh, hdr + 64 + 2 * c, 2);
                const float d = half_to_float(dh), m = half_to_float(mh);
                float *row = out + (t * Q_NR + c) * K + b * QB;
                for (int64_t kk = 0; kk < QB; kk++) {
                    const uint8_t v = qs[q_pos(fmt, vnni, kk, c)];
                    const float q = fmt == Q_FMT_Q4 ? (float)((v >> (c < 16 ? 0 : 4)) & 15)
                                    : vnni          ? (float)((int)v - 128)
                                                    : (float)(int8_t)v;
                    row[kk] = fmt == Q_FMT_Q8 ? d * q : d * q + m;
                }
            }
        }
    return 0;
}

/* rows of a tile's float32 sums (tmp, Q_NR per row) + bias -> y, the tile's `real` channels only */
static inline void q_store_row(const float *tmp, const float *bias, float *y, int real) {
    for (int c = 0; c < real; c++) y[c] = tmp[c] + (bias ? bias[c] : 0.0f);
}

/* 16 float lanes: one AVX-512 register, else two v8 */
#if defined(__AVX512F__)
typedef __m512 v16;
static inline v16 v16_zero(void) { return _mm512_setzero_ps(); }
static inline v16 v16_set1(float x) { return _mm512_set1_ps(x); }
static inline v16 v16_fma(v16 a, v16 b, v16 c) { return _mm512_fmadd_ps(a, b, c); }
static inline v16 v16_mul(v16 a, v16 b) { return _mm512_mul_ps(a, b); }
static inline void v16_store(float *p, v16 x) { _mm512_storeu_ps(p, x); }
static inline v16 v16_half(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline v16 v16_i8(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
/* 16 bytes -> their low nibbles (lo) and high nibbles (hi) as floats */
static inline void v16_u4(const uint8_t *p, v16 *lo, v16 *hi) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
    *hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}
#else
typedef struct {
    v8 lo, hi;
} v16;
static inline v16 v16_zero(void) { return (v16){v8_zero(), v8_zero()}; }
static inline v16 v16_set1(float x) { return (v16){v8_set1(x), v8_set1(x)}; }
static inline v16 v16_fma(v16 a, v16 b, v16 c) { return (v16){v8_fma(a.lo, b.lo, c.lo), v8_fma(a.hi, b.hi, c.hi)}; }
static inline v16 v16_mul(v16 a, v16 b) { return (v16){v8_mul(a.lo, b.lo), v8_mul(a.hi, b.hi)}; }
static inline void v16_store(float *p, v16 x) { v8_store(p, x.lo); v8_store(p + 8, x.hi); }
static inline v16 v16_half(const uint8_t *p) {
    float f[16];
    for (int i = 0; i < 16; i++) {
        uint16_t h;
        memcpy(&h, p + 2 * i, 2);
        f[i] = half_to_float(h);
    }
    return (v16){v8_load(f), v8_load(f + 8)};
}
static inline v16 v16_i8(const uint8_t *p) {
    return (v16){v8_load_i8((const int8_t *)p), v8_load_i8((const int8_t *)p + 8)};
}
static inline void v16_u4(const uint8_t *p, v16 *lo, v16 *hi) {
    float l[16], h[16];
    for (int i = 0; i < 16; i++) l[i] = (float)(p[i] & 15), h[i] = (float)(p[i] >> 4);
    *lo = (v16){v8_load(l), v8_load(l + 8)};
    *hi = (v16){v8_load(h), v8_load(h + 8)};
}
#endif

/* rows [0, MR) of x against one packed tile: y[i * ys + c] = x_i . w_c (+ bias) for the tile's `real` channels.
 * Per block, sums of x * q (the quants widened to float32) are scaled once: sum_k x_k (d q_k + m) = d sum_k x_k q_k
 * + m sum_k x_k, with the block sums of x (xsum, Q4 only) computed once per call. MR and fmt are constants where
 * it is inlined. */
static inline __attribute__((always_inline)) void q_block(const float *x, int64_t xs, const float *xsum,
                                                         const uint8_t *tile, int64_t K, const float *bias, float *y,
                                                         int64_t ys, int real, const int MR, const int fmt) {
    v16 a0[Q_MR], a1[Q_MR], s0[Q_MR], s1[Q_MR];
    ROWS_UNROLLED for (int i = 0; i < MR; i++) a0[i] = a1[i] = v16_zero();
    const int64_t bb = q_block_bytes(fmt), blocks = K / QB;
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *hdr = tile + b * bb, *qs = hdr + (fmt == Q_FMT_Q4 ? 128 : 64);
        const float *xb = x + b * QB;
        ROWS_UNROLLED for (int i = 0; i < MR; i++) s0[i] = s1[i] = v16_zero();
        for (int kk = 0; kk < QB; kk++) {
            if (kk * 64 < bb) __builtin_prefetch(hdr + 4 * bb + kk * 64, 0, 3);
            v16 q0, q1;
            if (fmt == Q_FMT_Q4) v16_u4(qs + kk * 16, &q0, &q1);
            else q0 = v16_i8(qs + kk * 32), q1 = v16_i8(qs + kk * 32 + 16);
            ROWS_UNROLLED for (int i = 0; i < MR; i++) {
                const v16 xv = v16_set1(xb[i * xs + kk]);
                s0[i] = v16_fma(xv, q0, s0[i]);
                s1[i] = v16_fma(xv, q1, s1[i]);
            }
        }
        const v16 d0 = v16_half(hdr), d1 = v16_half(hdr + 32);
        ROWS_UNROLLED for (int i = 0; i < MR; i++) a0[i] = v16_fma(s0[i], d0, a0[i]), a1[i] = v16_fma(s1[i], d1, a1[i]);
        if (fmt == Q_FMT_Q4) {
            const v16 m0 = v16_half(hdr + 64), m1 = v16_half(hdr + 96);
            ROWS_UNROLLED for (int i = 0; i < MR; i++) {
                const v16 sx = v16_set1(xsum[i * blocks + b]);
                a0[i] = v16_fma(sx, m0, a0[i]), a1[i] = v16_fma(sx, m1, a1[i]);
            }
        }
    }
    float tmp[Q_NR];
    ROWS_UNROLLED for (int i = 0; i < MR; i++) {
        v16_store(tmp, a0[i]);
        v16_store(tmp + 16, a1[i]);
        q_store_row(tmp, bias, y + i * ys, real);
    }
}

#define Q_CASE(R)                                                                                            \
    case R:                                                                                                  \
        if (fmt == Q_FMT_Q4) q_block(x, xs, xsum, tile, K, bias, y, ys, real, R, Q_FMT_Q4);                  \
        else q_block(x, xs, xsum, tile, K, bias, y, ys, real, R, Q_FMT_Q8);                                  \
        break;
static void q_rows(int fmt, const float *x, int64_t xs, const float *xsum, const uint8_t *tile, int64_t K,
                   const float *bias, float *y, int64_t ys, int real, int64_t mr) {
    switch (mr) {
    Q_CASE(1) Q_CASE(2) Q_CASE(3) Q_CASE(4) Q_CASE(5)
    default: Q_CASE(Q_MR)
    }
}

/* y[M, N] (contiguous) = x[M, K] float32 (row stride x_stride) @ w[N, K]^T (+ bias[N]), w packed by llmd_q_pack.
 * Threads split the channel tiles; a tile meets every row block while it is in L1, so the weights are read from
 * memory once per call. */
int llmd_q_linear_avx2(int, const float *, int64_t, const uint8_t *, const float *, float *, int64_t, int64_t, int64_t,
                       int); /* q_linear_avx2.c: this contract on AVX2 + FMA + F16C, -2 without them */

int llmd_q_linear(int fmt, const float *x, int64_t x_stride, const uint8_t *packed, const float *bias, float *y,
                  int64_t M, int64_t N, int64_t K, int nthreads) {
    if (K % QB || nthreads < 1 || M < 1 || (fmt != Q_FMT_Q8 && fmt != Q_FMT_Q4)) return -1;
#if !defined(__AVX512F__)
    /* AVX2: dequantized in registers (the two-sum scheme below spills 16 AVX2 registers at any row count) */
    if (llmd_q_linear_avx2(fmt, x, x_stride, packed, bias, y, M, N, K, nthreads) == 0) return 0;
#endif
    const int64_t tiles = (N + Q_NR - 1) / Q_NR, blocks = K / QB, tile_bytes = blocks * q_block_bytes(fmt);
    float *xsum = NULL;
    if (fmt == Q_FMT_Q4) {
        xsum = malloc(sizeof(float) * (size_t)(M * blocks));
        if (!xsum) return -3;
        for (int64_t i = 0; i < M; i++)
            for (int64_t b = 0; b < blocks; b++) {
                float s = 0.0f;
                for (int64_t kk = 0; kk < QB; kk++) s += x[i * x_stride + b * QB + kk];
                xsum[i * blocks + b] = s;
            }
    }
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < tiles; t++) {
        const uint8_t *tile = packed + t * tile_bytes;
        const int real = N - t * Q_NR < Q_NR ? (int)(N - t * Q_NR) : Q_NR;
        for (int64_t m = 0; m < M; m += Q_MR)
            q_rows(fmt, x + m * x_stride, x_stride, xsum ? xsum + m * blocks : NULL, tile, K,
                   bias ? bias + t * Q_NR : NULL, y + m * N + t * Q_NR, N, real, M - m < Q_MR ? M - m : Q_MR);
    }
    free(xsum);
    return 0;
}

/* The same formats with AVX-512 VNNI (vpdpbusd: 4 u8 x s8 products into each int32 lane), as llama.cpp computes
 * them: each row of x is quantized per block to int8 (dx = amax / 127, xq = round(x / dx)) once per call, the
 * block's dot products are exact integer sums, scaled once: d dx sum q xq (+ m dx sum xq for Q4). A fifth of the
 * float kernel's instructions per weight, so one row streams at memory speed and 8-32 rows stay near it; the cost
 * is x's int8 rounding (relative error <= 1/254 of a block's largest input), as with llama.cpp.
 *
 * Layout per tile and block: d (64 bytes), Q4: m (64 bytes), then per group of 4 inputs g: Q8: 2 x 64 bytes,
 * lane c of the first = channel c's 4 quants + 128 (as u8), of the second channel c + 16; Q4: 64 bytes, byte
 * 4 c + j = channel c's quant of input 4 g + j | channel c + 16's << 4. Same sizes as the float kernel's layout. */
int llmd_has_avx512_vnni(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* x row -> per block: int8 quants (xq), scale dx, sum of quants */
static void qv_quantize_row(const float *x, int64_t blocks, int8_t *xq, float *dx, int32_t *xqsum) {
    for (int64_t b = 0; b < blocks; b++) {
        const __m512 v0 = _mm512_loadu_ps(x + b * QB), v1 = _mm512_loadu_ps(x + b * QB + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inv)));
        const __m512i i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inv)));
        _mm_storeu_si128((__m128i *)(xq + b * QB), _mm512_cvtsepi32_epi8(i0));
        _mm_storeu_si128((__m128i *)(xq + b * QB + 16), _mm512_cvtsepi32_epi8(i1));
        dx[b] = amax / 127.0f;
        xqsum[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
    }
}

#ifndef QV_PREFETCH
#define QV_PREFETCH 8192 /* bytes ahead in a tile's stream */
#endif
static inline __attribute__((always_inline)) void qv_block(const int8_t *xq, int64_t K, const float *dx,
                                                          const int32_t *xqsum, const uint8_t *tile,
                                                          const float *bias, float *y, int64_t ys, int real,
                                                          const int MR, const int fmt) {
    __m512 a0[Q_MR], a1[Q_MR];
    __m512i s0[Q_MR], s1[Q_MR];
    ROWS_UNROLLED for (int i = 0; i < MR; i++) a0[i] = a1[i] = _mm512_setzero_ps();
    const int64_t bb = q_block_bytes(fmt), blocks = K / QB;
    const __m512i low4 = _mm512_set1_epi8(15);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *hdr = tile + b * bb, *qs = hdr + (fmt == Q_FMT_Q4 ? 128 : 64);
        for (int64_t l = 0; l < (fmt == Q_FMT_Q4 ? 128 : 64); l += 64) __builtin_prefetch(hdr + QV_PREFETCH + l, 0, 3);
        ROWS_UNROLLED for (int i = 0; i < MR; i++) s0[i] = s1[i] = _mm512_setzero_si512();
        for (int g = 0; g < QB / 4; g++) {
            __builtin_prefetch(qs + g * (fmt == Q_FMT_Q4 ? 64 : 128) + QV_PREFETCH, 0, 3);
            if (fmt == Q_FMT_Q8) __builtin_prefetch(qs + g * 128 + 64 + QV_PREFETCH, 0, 3);
            __m512i lo, hi;
            if (fmt == Q_FMT_Q4) {
                const __m512i v = _mm512_loadu_si512(qs + g * 64);
                lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            } else {
                lo = _mm512_loadu_si512(qs + g * 128), hi = _mm512_loadu_si512(qs + g * 128 + 64);
            }
            ROWS_UNROLLED for (int i = 0; i < MR; i++) {
                int32_t four;
                memcpy(&four, xq + i * K + b * QB + 4 * g, 4);
                const __m512i xb = _mm512_set1_epi32(four);
                s0[i] = _mm512_dpbusd_epi32(s0[i], lo, xb);
                s1[i] = _mm512_dpbusd_epi32(s1[i], hi, xb);
            }
        }
        const __m512 d0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)hdr));
        const __m512 d1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(hdr + 32)));
        __m512 m0 = _mm512_setzero_ps(), m1 = m0;
        if (fmt == Q_FMT_Q4) {
            m0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(hdr + 64)));
            m1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(hdr + 96)));
        }
        ROWS_UNROLLED for (int i = 0; i < MR; i++) {
            const float sx = dx[i * blocks + b];
            const __m512 scale = _mm512_set1_ps(sx);
            if (fmt == Q_FMT_Q8) { /* the quants were stored + 128: take 128 * sum(xq) back */
                const __m512i off = _mm512_set1_epi32(128 * xqsum[i * blocks + b]);
                s0[i] = _mm512_sub_epi32(s0[i], off), s1[i] = _mm512_sub_epi32(s1[i], off);
            }
            a0[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0[i]), _mm512_mul_ps(d0, scale), a0[i]);
            a1[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1[i]), _mm512_mul_ps(d1, scale), a1[i]);
            if (fmt == Q_FMT_Q4) {
                const __m512 mx = _mm512_set1_ps(sx * (float)xqsum[i * blocks + b]);
                a0[i] = _mm512_fmadd_ps(mx, m0, a0[i]), a1[i] = _mm512_fmadd_ps(mx, m1, a1[i]);
            }
        }
    }
    float tmp[Q_NR];
    ROWS_UNROLLED for (int i = 0; i < MR; i++) {
        _mm512_storeu_ps(tmp, a0[i]);
        _mm512_storeu_ps(tmp + 16, a1[i]);
        q_store_row(tmp, bias, y + i * ys, real);
    }
}

#define QV_CASE(R)                                                                                           \
    case R:                                                                                                  \
        if (fmt == Q_FMT_Q4) qv_block(xq, K, dx, xqsum, tile, bias, y, ys, real, R, Q_FMT_Q4);               \
        else qv_block(xq, K, dx, xqsum, tile, bias, y, ys, real, R, Q_FMT_Q8);                               \
        break;
static void qv_rows(int fmt, const int8_t *xq, int64_t K, const float *dx, const int32_t *xqsum,
                    const uint8_t *tile, const float *bias, float *y, int64_t ys, int real, int64_t mr) {
    switch (mr) {
    QV_CASE(1) QV_CASE(2) QV_CASE(3) QV_CASE(4) QV_CASE(5)
    default: QV_CASE(Q_MR)
    }
}
#endif

/* llmd_q_linear's contract with the weights llmd_q_pack packed with vnni = 1. -2 without AVX-512 VNNI. */
int llmd_qv_linear(int fmt, const float *x, int64_t x_stride, const uint8_t *packed, const float *bias, float *y,
                   int64_t M, int64_t N, int64_t K, int nthreads) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if (K % QB || nthreads < 1 || M < 1 || (fmt != Q_FMT_Q8 && fmt != Q_FMT_Q4)) return -1;
    const int64_t tiles = (N + Q_NR - 1) / Q_NR, blocks = K / QB, tile_bytes = blocks * q_block_bytes(fmt);
    int8_t *xq = malloc((size_t)(M * K));
    float *dx = malloc(sizeof(float) * (size_t)(M * blocks));
    int32_t *xqsum = malloc(sizeof(int32_t) * (size_t)(M * blocks));
    if (!xq || !dx || !xqsum) {
        free(xq), free(dx), free(xqsum);
        return -3;
    }
    for (int64_t i = 0; i < M; i++) qv_quantize_row(x + i * x_stride, blocks, xq + i * K, dx + i * blocks, xqsum + i * blocks);
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < tiles; t++) {
        const uint8_t *tile = packed + t * tile_bytes;
        const int real = N - t * Q_NR < Q_NR ? (int)(N - t * Q_NR) : Q_NR;
        for (int64_t m = 0; m < M; m += Q_MR)
            qv_rows(fmt, xq + m * K, K, dx + m * blocks, xqsum + m * blocks, tile, bias ? bias + t * Q_NR : NULL,
                    y + m * N + t * Q_NR, N, real, M - m < Q_MR ? M - m : Q_MR);
    }
    free(xq), free(dx), free(xqsum);
    return 0;
#else
    (void)fmt; (void)x; (void)x_stride; (void)packed; (void)bias; (void)y; (void)M; (void)N; (void)K; (void)nthreads;
    return -2;
#endif
}

/* ---------------------------------------------------------------- small fused ops (float32) */

/* Few rows are not worth waking a second thread for: its start costs more than the work. */
#define ROWS_PER_THREAD 16
static inline int threads_for(int64_t rows, int nthreads) {
    int64_t t = rows / ROWS_PER_THREAD;
    return t < 1 ? 1 : (t < nthreads ? (int)t : nthreads);
}

/* res_out = x + residual (residual may be NULL: res_out = x); out = res_out / sqrt(mean(res_out^2) + eps) * w.
 * Rows of dim floats, all contiguous; out/res_out may alias x/residual. */
int llmd_add_rms_norm(const float *x, const float *residual, const float *w, float *out, float *res_out,
                      int64_t rows, int64_t dim, float eps, int nthreads) {
    if (dim % 8) return -1;
#pragma omp parallel for schedule(static) num_threads(threads_for(rows, nthreads))
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim, *rr = residual ? residual + r * dim : NULL;
        float *orow = out + r * dim, *sr = res_out + r * dim;
        v8 ss = v8_zero();
        for (int64_t d = 0; d < dim; d += 8) {
            v8 v = v8_load(xr + d);
            if (rr) v = v8_add(v, v8_load(rr + d));
            v8_store(sr + d, v);
            ss = v8_fma(v, v, ss);
        }
        const float inv = 1.0f / sqrtf(v8_hsum(ss) / (float)dim + eps);
        const v8 iv = v8_set1(inv);
        for (int64_t d = 0; d < dim; d += 8) v8_store(orow + d, v8_mul(v8_mul(v8_load(sr + d), iv), v8_load(w + d)));
    }
    return 0;
}

/* gate / (1 + exp(-gate)), the division in scalar float32 as torch's silu rounds it */
static inline v8 v8_silu(v8 gv) {
    const v8 e = v8_exp(v8_mul(gv, v8_set1(-1.0f)));
    float tmp[8], gs[8], es[8];
    v8_store(gs, gv);
    v8_store(es, e);
    for (int j = 0; j < 8; j++) tmp[j] = gs[j] / (1.0f + es[j]);
    return v8_load(tmp);
}

/* x: rows of [gate | up] (2 * inter floats) -> out rows of inter floats: gate / (1 + exp(-gate)) * up */
int llmd_silu_mul(const float *x, float *out, int64_t rows, int64_t inter, int nthreads) {
    if (inter % 8) return -1;
#pragma omp parallel for schedule(static) num_threads(threads_for(rows, nthreads))
    for (int64_t r = 0; r < rows; r++) {
        const float *g = x + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        for (int64_t d = 0; d < inter; d += 8) v8_store(o + d, v8_mul(v8_silu(v8_load(g + d)), v8_load(u + d)));
    }
    return 0;
}

/* ---------------------------------------------------------------- norm and rotary in bfloat16 */

/* bf16 in and out, float32 math, each rounding where torch's bf16 ops round (a bf16 op computes in float32 and
 * rounds its result to nearest even): x + residual, the normalised value, its product with the weight; the rotated
 * q and k. The engine's bf16 decode step ran these as ~10 small torch ops a layer. (A bf16 silu-and-mul was slower
 * than torch's two vectorised ops at every row count: not kept.) */
static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays a (quiet) NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
#if LLMD_AVX2
/* round to nearest even in integer lanes (a scalar loop here made these kernels 3-4x slower than torch's at 32+
 * rows); NaN lanes keep their payload's top bits, made quiet */
static inline __m128i v8_to_bf16_bits(v8 x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
    return _mm256_castsi256_si128(packed);
}
static inline void v8_store_bf16(uint16_t *p, v8 x) { _mm_storeu_si128((__m128i *)p, v8_to_bf16_bits(x)); }
static inline v8 v8_round_bf16(v8 x) { /* to bf16 precision, kept in float32 */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v8_to_bf16_bits(x)), 16));
}
#else
static inline void v8_store_bf16(uint16_t *p, v8 x) {
    for (int i = 0; i < 8; i++) p[i] = bf16_round(x.x[i]);
}
static inline v8 v8_round_bf16(v8 x) {
    uint16_t h[8];
    v8_store_bf16(h, x);
    return v8_load_bf16(h);
}
#endif

int llmd_add_rms_norm_bf16(const uint16_t *x, const uint16_t *residual, const uint16_t *w, uint16_t *out,
                           uint16_t *res_out, int64_t rows, int64_t dim, float eps, int nthreads) {
    if (dim % 8) return -1;
#pragma omp parallel for schedule(static) num_threads(threads_for(rows, nthreads))
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * dim, *rr = residual ? residual + r * dim : NULL;
        uint16_t *orow = out + r * dim, *sr = res_out + r * dim;
        v8 ss = v8_zero();
        for (int64_t d = 0; d < dim; d += 8) {
            v8 v = v8_load_bf16(xr + d);
            if (rr) {
                v = v8_round_bf16(v8_add(v, v8_load_bf16(rr + d)));
                v8_store_bf16(sr + d, v);
            }
            ss = v8_fma(v, v, ss);
        }
        const v8 iv = v8_set1(1.0f / sqrtf(v8_hsum(ss) / (float)dim + eps));
        for (int64_t d = 0; d < dim; d += 8) {
            const v8 normed = v8_round_bf16(v8_mul(v8_load_bf16(sr + d), iv));
            v8_store_bf16(orow + d, v8_mul(normed, v8_load_bf16(w + d)));
        }
    }
    return 0;
}

/* silu_mul on bf16 rows, rounding as torch's F.silu(gate).mul_(up) in bf16 does: silu(gate) to bf16, then the
 * product to bf16. Only the fused decode step calls it (decode_step.c): on its own, torch's two ops were faster. */
int llmd_silu_mul_bf16(const uint16_t *x, uint16_t *out, int64_t rows, int64_t inter, int nthreads) {
    if (inter % 8) return -1;
#pragma omp parallel for schedule(static) num_threads(threads_for(rows, nthreads))
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = x + r * 2 * inter, *u = g + inter;
        uint16_t *o = out + r * inter;
        for (int64_t d = 0; d < inter; d += 8)
            v8_store_bf16(o + d, v8_mul(v8_round_bf16(v8_silu(v8_load_bf16(g + d))), v8_load_bf16(u + d)));
    }
    return 0;
}

/* One step's q/k rotation and K/V store. qkv: [N, (H + 2 * Hkv) * D] of T (float32 or bf16), rows of q heads, k
 * heads, v heads; cos, sin: [N, D] float32 (full-width cos, sign-folded sin: x * cos + swap_halves(x) * sin). q and
 * k heads are rotated in place (float32 math, stored back as T); then k and v rows go to the caches
 * ([num_blocks * block_size, Hkv, D] of T) at slot_mapping[n] (-1: not stored). One body for both types. */
#define LLMD_ROPE_STORE(NAME, T, LOAD, STORE)                                                                      \
    int NAME(T *qkv, int64_t N, int64_t H, int64_t Hkv, int64_t D, const float *cos, const float *sin,          \
             const int64_t *slot_mapping, T *k_cache, T *v_cache, int nthreads) {                                \
        if (D % 16) return -1;                                                                                   \
        const int64_t row = (H + 2 * Hkv) * D, half = D / 2;                                                    \
        _Pragma("omp parallel for schedule(static) num_threads(threads_for(N, nthreads))")                      \
        for (int64_t n = 0; n < N; n++) {                                                                        \
            T *r = qkv + n * row;                                                                                \
            const float *c = cos + n * D, *s = sin + n * D;                                                      \
            for (int64_t h = 0; h < H + Hkv; h++) {                                                              \
                T *x = r + h * D;                                                                                \
                for (int64_t d = 0; d < half; d += 8) {                                                          \
                    const v8 lo = LOAD(x + d), hi = LOAD(x + half + d);                                          \
                    /* two products then a sum, as torch computes it (no fused multiply-add: same rounding) */  \
                    const v8 new_lo = v8_add(v8_mul(lo, v8_load(c + d)), v8_mul(hi, v8_load(s + d)));           \
                    const v8 new_hi = v8_add(v8_mul(hi, v8_load(c + half + d)), v8_mul(lo, v8_load(s + half + d))); \
                    STORE(x + d, new_lo);                                                                        \
                    STORE(x + half + d, new_hi);                                                                 \
                }                                                                                                \
            }                                                                                                    \
            const int64_t slot = slot_mapping[n];                                                                \
            if (slot >= 0) {                                                                                     \
                memcpy(k_cache + slot * Hkv * D, r + H * D, sizeof(T) * Hkv * D);                               \
                memcpy(v_cache + slot * Hkv * D, r + (H + Hkv) * D, sizeof(T) * Hkv * D);                       \
            }                                                                                                    \
        }                                                                                                        \
        return 0;                                                                                                \
    }

LLMD_ROPE_STORE(llmd_rope_store, float, v8_load, v8_store)
LLMD_ROPE_STORE(llmd_rope_store_bf16, uint16_t, v8_load_bf16, v8_store_bf16)

/* ---------------------------------------------------------------- float32 linear (AVX-512; AVX2 in f32_linear_avx2.c) */

/* Weights packed at load (llmd_f32_pack) in tiles of F32_NR output channels, k-major inside a tile: tile t,
 * input k -> F32_NR contiguous floats (N padded with zero channels). One tile is one sequential stream, and a
 * micro-kernel of up to 12 rows x 32 channels keeps 24 accumulators in registers: bandwidth-bound at one row
 * (1.6x oneDNN's packed GEMM on SmolLM2's projections, Zen 4) and compute-bound at many (on par at 2048 rows). */
#define F32_NR 32
#define F32_MR 12

/* rows up to which a float32 linear's later walks over a tile prefetch the next tile (f32_linear_avx2.c and the
 * AVX-512 kernel below); 0 = never. Set once at load (llmd_tile_ahead_configure), read by every call. */
int llmd_tile_ahead_rows = 64;
int llmd_tile_ahead_configure(int rows) {
    llmd_tile_ahead_rows = rows < 0 ? 0 : rows;
    return llmd_tile_ahead_rows;
}

int llmd_has_avx512(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

int llmd_f32_pack(const float *w, int64_t N, int64_t K, float *packed) {
    const int64_t tiles = (N + F32_NR - 1) / F32_NR;
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t k = 0; k < K; k++)
            for (int64_t c = 0; c < F32_NR; c++) {
                const int64_t n = t * F32_NR + c;
                packed[(t * K + k) * F32_NR + c] = n < N ? w[n * K + k] : 0.0f;
            }
    return 0;
}

#if defined(__AVX512F__)
/* rows [0, MR) of x against one tile: y[i * ys + c] = x_i . w_c (+ bias) for the tile's `real` channels */
static inline __attribute__((always_inline)) void f32_block(const float *x, int64_t xs, const float *tile,
                                                           int64_t K, const float *bias, float *y, int64_t ys,
                                                           int real, const int MR) {
    __m512 a0[F32_MR], a1[F32_MR];
    ROWS_UNROLLED for (int i = 0; i < MR; i++) a0[i] = a1[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const float *wp = tile + k * F32_NR;
        _mm_prefetch((const char *)(wp + F32_NR * 8), _MM_HINT_T0);
        _mm_prefetch((const char *)(wp + F32_NR * 8 + 16), _MM_HINT_T0);
        const __m512 w0 = _mm512_loadu_ps(wp), w1 = _mm512_loadu_ps(wp + 16);
        ROWS_UNROLLED for (int i = 0; i < MR; i++) {
            const __m512 xb = _mm512_set1_ps(x[i * xs + k]);
            a0[i] = _mm512_fmadd_ps(xb, w0, a0[i]);
            a1[i] = _mm512_fmadd_ps(xb, w1, a1[i]);
        }
    }
    float tmp[F32_NR];
    ROWS_UNROLLED for (int i = 0; i < MR; i++) {
        _mm512_storeu_ps(tmp, a0[i]);
        _mm512_storeu_ps(tmp + 16, a1[i]);
        q_store_row(tmp, bias, y + i * ys, real);
    }
}

/* f32_block's walk that also prefetches another tile: one k-row of `ahead` (both lines) every `every` iterations.
 * A copy, as in f32_linear_avx2.c (rows_block_ahead): a flag on the plain walk slowed it there. */
static inline __attribute__((always_inline)) void f32_block_ahead(const float *x, int64_t xs, const float *tile,
                                                                 int64_t K, const float *bias, float *y, int64_t ys,
                                                                 int real, const float *ahead, int64_t every,
                                                                 const int MR) {
    __m512 a0[F32_MR], a1[F32_MR];
    ROWS_UNROLLED for (int i = 0; i < MR; i++) a0[i] = a1[i] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < K; k0 += every, ahead += F32_NR) {
        _mm_prefetch((const char *)ahead, _MM_HINT_T1);
        _mm_prefetch((const char *)(ahead + 16), _MM_HINT_T1);
        const int64_t k1 = k0 + every < K ? k0 + every : K;
        for (int64_t k = k0; k < k1; k++) {
            const float *wp = tile + k * F32_NR;
            _mm_prefetch((const char *)(wp + F32_NR * 8), _MM_HINT_T0);
            _mm_prefetch((const char *)(wp + F32_NR * 8 + 16), _MM_HINT_T0);
            const __m512 w0 = _mm512_loadu_ps(wp), w1 = _mm512_loadu_ps(wp + 16);
            ROWS_UNROLLED for (int i = 0; i < MR; i++) {
                const __m512 xb = _mm512_set1_ps(x[i * xs + k]);
                a0[i] = _mm512_fmadd_ps(xb, w0, a0[i]);
                a1[i] = _mm512_fmadd_ps(xb, w1, a1[i]);
            }
        }
    }
    float tmp[F32_NR];
    ROWS_UNROLLED for (int i = 0; i < MR; i++) {
        _mm512_storeu_ps(tmp, a0[i]);
        _mm512_storeu_ps(tmp + 16, a1[i]);
        q_store_row(tmp, bias, y + i * ys, real);
    }
}

#define F32_AHEAD_CASE(R) case R: f32_block_ahead(x, xs, tile, K, bias, y, ys, real, ahead, every, R); break;
static void f32_rows_ahead(const float *x, int64_t xs, const float *tile, int64_t K, const float *bias, float *y,
                           int64_t ys, int real, const float *ahead, int64_t every, int64_t mr) {
    switch (mr) {
    F32_AHEAD_CASE(1) F32_AHEAD_CASE(2) F32_AHEAD_CASE(3) F32_AHEAD_CASE(4) F32_AHEAD_CASE(5) F32_AHEAD_CASE(6)
    F32_AHEAD_CASE(7) F32_AHEAD_CASE(8) F32_AHEAD_CASE(9) F32_AHEAD_CASE(10) F32_AHEAD_CASE(11)
    default: f32_block_ahead(x, xs, tile, K, bias, y, ys, real, ahead, every, F32_MR);
    }
}

#define F32_CASE(R) case R: f32_block(x, xs, tile, K, bias, y, ys, real, R); break;
static void f32_rows(const float *x, int64_t xs, const float *tile, int64_t K, const float *bias, float *y,
                     int64_t ys, int real, int64_t mr) {
    switch (mr) {
    F32_CASE(1) F32_CASE(2) F32_CASE(3) F32_CASE(4) F32_CASE(5) F32_CASE(6)
    F32_CASE(7) F32_CASE(8) F32_CASE(9) F32_CASE(10) F32_CASE(11)
    default: f32_block(x, xs, tile, K, bias, y, ys, real, F32_MR);
    }
}
#endif

int llmd_f32_linear_avx2(const float *, int64_t, const float *, const float *, float *, int64_t, int64_t, int64_t,
                         int); /* f32_linear_avx2.c: the same contract on AVX2 + FMA, -2 without them */
int llmd_has_f32_linear_avx2(void);

/* Whether llmd_f32_linear runs here: AVX-512, else AVX2 + FMA (f32_linear_avx2.c) */
int llmd_has_f32_linear(void) { return llmd_has_avx512() || llmd_has_f32_linear_avx2(); }

/* y[M, N] (contiguous) = x[M, K] (row stride x_stride) @ w[N, K]^T (+ bias[N]), w packed by llmd_f32_pack.
 * Threads split the channel tiles; each tile meets every row block while it is in cache. Without AVX-512 the
 * AVX2 kernel runs (-2 without that either). */
int llmd_f32_linear(const float *x, int64_t x_stride, const float *packed, const float *bias, float *y, int64_t M,
                    int64_t N, int64_t K, int nthreads) {
#if defined(__AVX512F__)
    if (nthreads < 1 || M < 1) return -1;
    const int64_t tiles = (N + F32_NR - 1) / F32_NR;
    /* up to llmd_tile_ahead_rows rows, walks 1.. of a tile each prefetch a share of the next tile, so its first
     * walk reads cache instead of memory (as in f32_linear_avx2.c); many rows go LLMD_ROW_CHUNK at a time */
#pragma omp parallel num_threads(nthreads)
    for (int64_t m0 = 0; m0 < M; m0 += LLMD_ROW_CHUNK) {
        const int64_t mc = M - m0 < LLMD_ROW_CHUNK ? M - m0 : LLMD_ROW_CHUNK;
        const int64_t walks = (mc + F32_MR - 1) / F32_MR, every = walks > 1 ? walks - 1 : 1;
        const int ahead_on = walks > 1 && mc <= llmd_tile_ahead_rows, share = (int)((K + every - 1) / every);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const float *tile = packed + t * F32_NR * K, *next = t + 1 < tiles ? tile + F32_NR * K : NULL;
            const int real = N - t * F32_NR < F32_NR ? (int)(N - t * F32_NR) : F32_NR;
            const float *tb = bias ? bias + t * F32_NR : NULL;
            for (int64_t m = m0, walk = 0; m < m0 + mc; m += F32_MR, walk++) {
                const int64_t mr = m0 + mc - m < F32_MR ? m0 + mc - m : F32_MR;
                if (ahead_on && next && walk >= 1)
                    f32_rows_ahead(x + m * x_stride, x_stride, tile, K, tb, y + m * N + t * F32_NR, N, real,
                                   next + (walk - 1) * share * F32_NR, every, mr);
                else
                    f32_rows(x + m * x_stride, x_stride, tile, K, tb, y + m * N + t * F32_NR, N, real, mr);
            }
        }
    }
    return 0;
#else
    return llmd_f32_linear_avx2(x, x_stride, packed, bias, y, M, N, K, nthreads);
#endif
}

/* ---------------------------------------------------------------- bfloat16 linear (AVX-512 BF16) */

/* bf16 weights packed at load (llmd_bf16_pack) in tiles of BF16_NR channels and pairs of inputs: tile t, pair p
 * -> 2 x 16 channels x (w[c, 2p], w[c, 2p + 1]), the operand order of vdpbf16ps, which adds both products of a
 * pair into a float32 lane. Half the bytes of float32 for the bandwidth-bound rows of decode; many rows stay with
 * oneDNN (AMX or its own bf16 GEMM). K must be even. */
#define BF16_NR 32

int llmd_has_avx512_bf16(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

int llmd_bf16_pack(const uint16_t *w, int64_t N, int64_t K, uint16_t *packed) {
    if (K % 2) return -1;
    const int64_t tiles = (N + BF16_NR - 1) / BF16_NR;
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t p = 0; p < K / 2; p++)
            for (int64_t c = 0; c < BF16_NR; c++)
                for (int64_t j = 0; j < 2; j++) {
                    const int64_t n = t * BF16_NR + c;
                    packed[((t * (K / 2) + p) * BF16_NR + c) * 2 + j] = n < N ? w[n * K + 2 * p + j] : 0;
                }
    return 0;
}

#if defined(__AVX512BF16__)
typedef struct {
    __m512 b0, b1;    /* the bias of channels 0-15 and 16-31, float32 (0 past `real`, or without a bias) */
    __mmask16 m0, m1; /* which of those channels are real */
} llmd_tile_epilogue;

/* What a 32-channel tile's store needs (here and in amx_linear.c): bias bf16, or float32 where out_f32. */
llmd_tile_epilogue llmd_bf16_tile_epilogue(const void *bias, int real, int out_f32) {
    float b[BF16_NR] = {0};
    for (int c = 0; bias && c < real; c++) {
        if (out_f32) {
            b[c] = ((const float *)bias)[c];
            continue;
        }
        const uint32_t u = (uint32_t)((const uint16_t *)bias)[c] << 16;
        memcpy(&b[c], &u, sizeof u);
    }
    llmd_tile_epilogue e = {_mm512_loadu_ps(b), _mm512_loadu_ps(b + 16), 0, 0};
    e.m0 = real >= 16 ? 0xFFFF : (__mmask16)((1u << real) - 1);
    e.m1 = real <= 16 ? 0 : real >= 32 ? 0xFFFF : (__mmask16)((1u << (real - 16)) - 1);
    return e;
}

/* OUT_F32 (a constant where inlined): float32 bias and output (q_bf16_linear) instead of bf16 ones */
static inline __attribute__((always_inline)) void bf16_block(const uint16_t *x, int64_t xs, const uint16_t *tile,
                                                            int64_t K, const void *bias, void *y, int64_t ys,
                                                            int real, const int MR, const int OUT_F32) {
    __m512 a0[F32_MR], a1[F32_MR];
    ROWS_UNROLLED for (int i = 0; i < MR; i++) a0[i] = a1[i] = _mm512_setzero_ps();
    for (int64_t p = 0; p < K / 2; p++) {
        const uint16_t *wp = tile + p * BF16_NR * 2;
        _mm_prefetch((const char *)(wp + BF16_NR * 2 * 8), _MM_HINT_T0);
        _mm_prefetch((const char *)(wp + BF16_NR * 2 * 8 + 32), _MM_HINT_T0);
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp), w1 = (__m512bh)_mm512_loadu_si512(wp + 32);
        ROWS_UNROLLED for (int i = 0; i < MR; i++) {
            int32_t pair;
            memcpy(&pair, x + i * xs + 2 * p, sizeof pair);
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            a0[i] = _mm512_dpbf16_ps(a0[i], xb, w0);
            a1[i] = _mm512_dpbf16_ps(a1[i], xb, w1);
        }
    }
    const llmd_tile_epilogue e = llmd_bf16_tile_epilogue(bias, real, OUT_F32);
    const __m512 b0 = e.b0, b1 = e.b1;
    const __mmask16 m0 = e.m0, m1 = e.m1;
    ROWS_UNROLLED for (int i = 0; i < MR; i++) {
        if (OUT_F32) {
            float *yf = (float *)y + i * ys;
            _mm512_mask_storeu_ps(yf, m0, _mm512_add_ps(a0[i], b0));
            _mm512_mask_storeu_ps(yf + 16, m1, _mm512_add_ps(a1[i], b1));
            continue;
        }
        uint16_t *yb = (uint16_t *)y + i * ys;
        const __m256bh r0 = _mm512_cvtneps_pbh(_mm512_add_ps(a0[i], b0));
        const __m256bh r1 = _mm512_cvtneps_pbh(_mm512_add_ps(a1[i], b1));
        _mm256_mask_storeu_epi16(yb, m0, (__m256i)r0);
        _mm256_mask_storeu_epi16(yb + 16, m1, (__m256i)r1);
    }
}

#define BF16_CASE(R)                                                                                         \
    case R:                                                                                                  \
        if (out_f32) bf16_block(x, xs, tile, K, bias, y, ys, real, R, 1);                                    \
        else bf16_block(x, xs, tile, K, bias, y, ys, real, R, 0);                                            \
        break;
static void bf16_rows(const uint16_t *x, int64_t xs, const uint16_t *tile, int64_t K, const void *bias, void *y,
                      int64_t ys, int real, int64_t mr, int out_f32) {
    switch (mr) {
    BF16_CASE(1) BF16_CASE(2) BF16_CASE(3) BF16_CASE(4) BF16_CASE(5) BF16_CASE(6)
    BF16_CASE(7) BF16_CASE(8) BF16_CASE(9) BF16_CASE(10) BF16_CASE(11)
    default: BF16_CASE(F32_MR)
    }
}
#endif

/* y[M, N] bf16 (contiguous) = x[M, K] bf16 (row stride x_stride) @ w[N, K]^T (+ bias[N]) with float32 sums,
 * rounded once to bf16 (as oneDNN does); w packed by llmd_bf16_pack. -2 without AVX-512 BF16. */
int llmd_bf16_linear_amx(const uint16_t *, int64_t, const uint16_t *, const void *, void *, int64_t, int64_t, int64_t,
                         int, int); /* amx_linear.c: -1 where it does not apply */

int llmd_bf16_linear(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
                     int64_t M, int64_t N, int64_t K, int nthreads) {
#if defined(__AVX512BF16__)
    if (nthreads < 1 || M < 1 || K % 2) return -1;
    if (llmd_bf16_linear_amx(x, x_stride, packed, bias, y, M, N, K, nthreads, 0) == 0) return 0;
    const int64_t tiles = (N + BF16_NR - 1) / BF16_NR;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < tiles; t++) {
        const uint16_t *tile = packed + t * BF16_NR * K;
        const int real = N - t * BF16_NR < BF16_NR ? (int)(N - t * BF16_NR) : BF16_NR;
        for (int64_t m = 0; m < M; m += F32_MR)
            bf16_rows(x + m * x_stride, x_stride, tile, K, bias ? bias + t * BF16_NR : NULL, y + m * N + t * BF16_NR,
                      N, real, M - m < F32_MR ? M - m : F32_MR, 0);
    }
    return 0;
#else
    (void)x; (void)x_stride; (void)packed; (void)bias; (void)y; (void)M; (void)N; (void)K; (void)nthreads;
    return -2;
#endif
}

/* ---------------------------------------------------------------- block-quantized weights, many rows (AVX-512 BF16) */

/* The float kernel's Q8/Q4 layout (llmd_q_pack, vnni = 0) at prefill sizes: each 32-channel tile is dequantized
 * once per call (d * q (+ m) in float32, rounded to bf16) into the bf16 kernel's pair layout, x is rounded to bf16
 * once, and bf16_block multiplies with float32 sums. Weight-only quantization keeps activations out of int8 (the
 * VNNI kernel's rounding of x cost int8 half its greedy agreement with float32); this is the bf16 model's
 * precision at about the bf16 GEMM's speed, where the float32 kernel would take 2.4x the VNNI one's time. */
#if defined(__AVX512BF16__)
/* 16 channels' weights of inputs k (even) and k + 1, float32 -> the bf16 kernel's pairs (lane c: w_k | w_k+1 << 16) */
static inline __m512i bf16_pairs(__m512 even, __m512 odd) {
    const __m512i e = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(even));
    const __m512i o = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(odd));
    return _mm512_or_si512(e, _mm512_slli_epi32(o, 16));
}

/* one packed tile (float kernel layout) -> bf16 pairs: wt[((k / 2) * 32 + c) * 2 + k % 2] = bf16(d_c q + m_c) */
static void q_tile_to_bf16(int fmt, const uint8_t *tile, int64_t blocks, uint16_t *wt) {
    const int64_t bb = q_block_bytes(fmt);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *hdr = tile + b * bb, *qs = hdr + (fmt == Q_FMT_Q4 ? 128 : 64);
        const __m512 d0 = v16_half(hdr), d1 = v16_half(hdr + 32);
        const __m512 m0 = fmt == Q_FMT_Q4 ? v16_half(hdr + 64) : _mm512_setzero_ps();
        const __m512 m1 = fmt == Q_FMT_Q4 ? v16_half(hdr + 96) : _mm512_setzero_ps();
        for (int kk = 0; kk < QB; kk += 2) {
            __m512 w[2][2]; /* [input kk, kk + 1][channels 0-15, 16-31] */
            for (int j = 0; j < 2; j++) {
                __m512 q0, q1;
                if (fmt == Q_FMT_Q4) v16_u4(qs + (kk + j) * 16, &q0, &q1);
                else q0 = v16_i8(qs + (kk + j) * 32), q1 = v16_i8(qs + (kk + j) * 32 + 16);
                /* d * q is exact in float32; + m one rounding, as the float kernel and a dequantizing loader */
                w[j][0] = fmt == Q_FMT_Q4 ? _mm512_add_ps(_mm512_mul_ps(d0, q0), m0) : _mm512_mul_ps(d0, q0);
                w[j][1] = fmt == Q_FMT_Q4 ? _mm512_add_ps(_mm512_mul_ps(d1, q1), m1) : _mm512_mul_ps(d1, q1);
            }
            uint16_t *out = wt + ((b * QB + kk) / 2) * BF16_NR * 2;
            _mm512_storeu_si512(out, bf16_pairs(w[0][0], w[1][0]));
            _mm512_storeu_si512(out + 32, bf16_pairs(w[0][1], w[1][1]));
        }
    }
}

#endif

int llmd_q_bf16_linear(int fmt, const float *x, int64_t x_stride, const uint8_t *packed, const float *bias, float *y,
                       int64_t M, int64_t N, int64_t K, int nthreads) {
#if defined(__AVX512BF16__)
    if (K % QB || nthreads < 1 || M < 1 || (fmt != Q_FMT_Q8 && fmt != Q_FMT_Q4)) return -1;
    const int64_t tiles = (N + Q_NR - 1) / Q_NR, blocks = K / QB, bb = q_block_bytes(fmt);
    uint16_t *xb = malloc(sizeof(uint16_t) * (size_t)(M * K));
    if (!xb) return -3;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t i = 0; i < M; i++)
        for (int64_t k = 0; k < K; k += 16) /* K is a multiple of 32 */
            _mm256_storeu_si256((__m256i *)(xb + i * K + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i * x_stride + k)));
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        uint16_t *wt = malloc(sizeof(uint16_t) * (size_t)(BF16_NR * K)); /* one tile, pair layout */
        if (!wt) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            if (!wt) continue;
            q_tile_to_bf16(fmt, packed + t * blocks * bb, blocks, wt);
            const int real = N - t * Q_NR < Q_NR ? (int)(N - t * Q_NR) : Q_NR;
            for (int64_t m = 0; m < M; m += F32_MR)
                bf16_rows(xb + m * K, K, wt, K, bias ? bias + t * Q_NR : NULL, y + m * N + t * Q_NR, N, real,
                          M - m < F32_MR ? M - m : F32_MR, 1);
        }
        free(wt);
    }
    free(xb);
    return failed ? -3 : 0;
#else
    (void)fmt; (void)x; (void)x_stride; (void)packed; (void)bias; (void)y; (void)M; (void)N; (void)K; (void)nthreads;
    return -2;
#endif
}
