/* paged_decode_attention: one query token per sequence against its K/V read in place from the paged cache (no
 * gather): per (sequence, kv head, context split) scores -> softmax -> P.V, the kv head's query heads (GQA) sharing
 * every K/V row. Splits of one long context are merged flash-decoding style (max, sum, rescaled partial outputs). */
#include "lanes.h"

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
