/* paged_decode_attention: one query token per sequence against its K/V read in place from the paged cache (no
 * gather): per (sequence, context split) scores -> softmax -> P.V, each kv head's query heads (GQA) sharing every
 * K/V row, a split's tokens read as up to KV_STREAMS_MAX streams side by side. Splits of one long context are
 * merged flash-decoding style (max, sum, rescaled partial outputs). */
#include "bf16_lanes.h"

/* decode_attention_avx512.c: the passes on AVX-512 CPUs, -1 where they do not apply */
int llmd_attn_scores_avx512(int, const float *, const void *, const void *, const int64_t *, int64_t, int64_t,
                            int64_t, int64_t, float, float *, int64_t, float *);
int llmd_attn_pv_avx512(int, const void *, const int64_t *, int64_t, const float *, int64_t, int64_t, int64_t,
                        int64_t, float *);

#define MAX_GROUP 8 /* query heads of one kv head in one register block (wider groups: head_block) */
/* token ranges of one item read side by side (K in the score pass, V in P.V), each in token order: one stream a
 * core left memory idle (below). G * streams sums (probabilities), a row of each stream and one more vector within
 * the 16 vector registers. bench/decode_attention.py, SmolLM2 (G 3) on Zen 2, 30 layers' caches, one stream (and
 * the splits and prefetch it needed) -> three: 32 sequences of 192 tokens 496 -> 321 us a layer in float32, 383 ->
 * 256 in bf16; 1 of 430 tokens 44.6 -> 33.2 us (bench/RESULTS.md). */
#define KV_STREAMS_MAX 3
#define KV_STREAMS(G) ((G) <= 3 ? 3 : (G) <= 4 ? 2 : 1)
#define KV_STREAM_HEADS 64 /* most heads for which the streams' partial scores go on the stack */
#define MAX_HEADS 256
#define MAX_HEAD_DIM 512

/* ---------------------------------------------------------------- decode attention */

typedef struct {
    const float *q; /* [B, H, D] rows of q_row_stride floats between sequences (NULL: q16) */
    int64_t q_row_stride;
    const void *k_cache, *v_cache; /* [num_blocks, block_size, Hkv, D], float32 or bfloat16 */
    int cache_bf16;
    const int32_t *block_tables; /* [B, bt_stride] */
    int64_t bt_stride;
    const int32_t *context_lens;
    int64_t num_heads, num_kv_heads, head_dim, block_size;
    float scale;
    int head_block; /* query heads per register block (head_block()), worked out once per call */
    const uint16_t *q16; /* or bf16 query rows, q_row_stride elements apart (llmd_paged_decode_attention_bf16io) */
    uint16_t *out16;     /* and the output in bf16 */
} DecodeArgs;

/* K/V of one token, all kv heads: Hkv * D elements, contiguous in the cache */
static inline const char *token_row(const DecodeArgs *a, const void *cache, int64_t slot) {
    const int64_t esize = a->cache_bf16 ? 2 : 4;
    return (const char *)cache + slot * a->num_kv_heads * a->head_dim * esize;
}

static inline v8 load_elems(const int bf16, const char *row, int64_t i) {
    return bf16 ? v8_load_bf16((const uint16_t *)row + i) : v8_load((const float *)row + i);
}

/* t[j * ts + g * 8] = q_g . k_j (8 lanes, summed later) for G query heads of one kv head and TB K rows k_j (D
 * elements each, one row from each of TB streams: G * TB sums in registers, each K load serving G heads and each
 * q load TB rows) */
static inline __attribute__((always_inline)) void head_scores(const char *const *k, int64_t off, const float *q,
                                                             int64_t D, const int G, const int TB, const int BF16,
                                                             v8 *t, int64_t ts) {
    v8 acc[MAX_GROUP][KV_STREAMS_MAX];
    ROWS_UNROLLED for (int g = 0; g < G; g++) ROWS_UNROLLED for (int j = 0; j < TB; j++) acc[g][j] = v8_zero();
    for (int64_t d = 0; d < D; d += 8) {
        v8 kv[KV_STREAMS_MAX];
        ROWS_UNROLLED for (int j = 0; j < TB; j++) kv[j] = load_elems(BF16, k[j] + off, d);
        ROWS_UNROLLED for (int g = 0; g < G; g++) {
            const v8 qg = v8_load(q + g * D + d);
            ROWS_UNROLLED for (int j = 0; j < TB; j++) acc[g][j] = v8_fma(qg, kv[j], acc[g][j]);
        }
    }
    ROWS_UNROLLED for (int g = 0; g < G; g++) ROWS_UNROLLED for (int j = 0; j < TB; j++) t[j * ts + g * 8] =
        acc[g][j];
}

/* acc[g * D + d] += p[j][g * ps] * v_j[d] for TB V rows v_j (one from each of TB streams, added in stream order)
 * and G query heads of one kv head. The sums live in memory (L1): a whole row's worth of them would not fit the
 * registers; each load and store of one serves TB rows (one a row, the store port bound P.V). */
static inline __attribute__((always_inline)) void head_pv(const char *const *v, int64_t off, const float *const *p,
                                                         int64_t ps, int64_t D, const int G, const int TB,
                                                         const int BF16, float *acc) {
    v8 pg[MAX_GROUP][KV_STREAMS_MAX];
    ROWS_UNROLLED for (int g = 0; g < G; g++) ROWS_UNROLLED for (int j = 0; j < TB; j++) pg[g][j] =
        v8_set1(p[j][g * ps]);
    for (int64_t d = 0; d < D; d += 8) {
        v8 vv[KV_STREAMS_MAX];
        ROWS_UNROLLED for (int j = 0; j < TB; j++) vv[j] = load_elems(BF16, v[j] + off, d);
        ROWS_UNROLLED for (int g = 0; g < G; g++) {
            float *o = acc + g * D + d;
            v8 x = v8_load(o);
            ROWS_UNROLLED for (int j = 0; j < TB; j++) x = v8_fma(pg[g][j], vv[j], x);
            v8_store(o, x);
        }
    }
}

/* Scores of 8 tokens in each of TB streams (K rows rows[s][j]), t[s * H * 8 + hq * 8 + j] for stream s, query head
 * hq and token j, and P.V of one token of each stream. Each stream's rows are read whole, kv head after kv head,
 * in token order: streams the hardware prefetcher follows. (Reading each kv head's segment of 8 rows in turn, rows
 * 768 bytes apart in SmolLM2, kept it from running ahead: the score pass took the L3-resident time plus the DRAM
 * time, not the larger of the two; so did two rows of one stream interleaved, and software prefetches 8-64 rows
 * ahead did not help.) G: the query heads of a register block (head_block); G, TB and the cache type are constants
 * where these are inlined (the switches below, which instantiate TB up to KV_STREAMS(G) only). */
static inline __attribute__((always_inline)) void group_scores(const DecodeArgs *a, const char *const (*rows)[8],
                                                              const float *q, const int G, const int TB,
                                                              const int BF16, v8 *t) {
    const int64_t D = a->head_dim, H = a->num_heads, HG = H / a->num_kv_heads, es = BF16 ? 2 : 4;
    for (int64_t j = 0; j < 8; j++) {
        const char *k[KV_STREAMS_MAX];
        ROWS_UNROLLED for (int s = 0; s < TB; s++) k[s] = rows[s][j];
        for (int64_t h = 0; h < a->num_kv_heads; h++)
            for (int64_t g0 = 0; g0 < HG; g0 += G)
                head_scores(k, h * D * es, q + (h * HG + g0) * D, D, G, TB, BF16, t + (h * HG + g0) * 8 + j, H * 8);
    }
}

static inline __attribute__((always_inline)) void token_pv(const DecodeArgs *a, const char *const *rows,
                                                          const float *const *p, int64_t ps, const int G, const int TB,
                                                          const int BF16, float *acc) {
    const int64_t D = a->head_dim, HG = a->num_heads / a->num_kv_heads, es = BF16 ? 2 : 4;
    for (int64_t h = 0; h < a->num_kv_heads; h++)
        for (int64_t g0 = 0; g0 < HG; g0 += G) {
            const float *pj[KV_STREAMS_MAX];
            ROWS_UNROLLED for (int j = 0; j < TB; j++) pj[j] = p[j] + (h * HG + g0) * ps;
            head_pv(rows, h * D * es, pj, ps, D, G, TB, BF16, acc + (h * HG + g0) * D);
        }
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

/* OP(G_, BF16_, TB) with TB the constant min(streams, KV_STREAMS(G_)): only the stream counts a head block can
 * take are instantiated */
#define STREAMS_OP(G_, BF16_, OP)                                                                              \
    if (streams >= 3 && KV_STREAMS(G_) >= 3) OP(G_, BF16_, 3);                                                 \
    else if (streams >= 2 && KV_STREAMS(G_) >= 2) OP(G_, BF16_, 2);                                            \
    else OP(G_, BF16_, 1)

static void row_scores(const DecodeArgs *a, const char *const (*rows)[8], int streams, const float *q, v8 *t) {
#define SCORES(G_, BF16_, TB) group_scores(a, rows, q, G_, TB, BF16_, t)
#define HEAD_OP(G_, BF16_) STREAMS_OP(G_, BF16_, SCORES)
    HEAD_SWITCH(a)
#undef SCORES
#undef HEAD_OP
}

static void row_pv(const DecodeArgs *a, const char *const *rows, int streams, const float *const *p, int64_t ps,
                   float *acc) {
#define PV(G_, BF16_, TB) token_pv(a, rows, p, ps, G_, TB, BF16_, acc)
#define HEAD_OP(G_, BF16_) STREAMS_OP(G_, BF16_, PV)
    HEAD_SWITCH(a)
#undef PV
#undef HEAD_OP
}

/* cache slots (block * block_size + offset) of tokens [t0, t1) of sequence b */
static void token_slots(const DecodeArgs *a, int64_t b, int64_t t0, int64_t t1, int64_t *slots) {
    const int32_t *table = a->block_tables + b * a->bt_stride;
    const int64_t bs = a->block_size;
    for (int64_t t = t0; t < t1;) {
        const int64_t first = t / bs * bs, end = first + bs < t1 ? first + bs : t1, shift = table[t / bs] * bs - first;
        for (; t < end; t++) *slots++ = shift + t; /* no division a token: it showed in the profile */
    }
}

/* scores[hq * n8 + i] = scale * q_hq . k_i for the n tokens at `slots`, m[hq] their maximum: 8 tokens at a time
 * in each stream (a range of whole groups of 8 tokens), per query head one 8-lane partial sum a token, reduced
 * together. The lanes past the end of the last group repeat its first token: harmless for the max, and masked out
 * of the sums after. */
static void scores_8lanes(const DecodeArgs *a, const float *qsrc, const int64_t *slots, int64_t n, int64_t n8,
                          float *scores, float *m) {
    const int64_t D = a->head_dim, H = a->num_heads;
    float q[H * D];
    for (int64_t i = 0; i < H * D; i++) q[i] = qsrc[i] * a->scale;
    v8 mv[MAX_HEADS];
    for (int64_t hq = 0; hq < H; hq++) mv[hq] = v8_set1(-FLT_MAX);
    const int64_t groups = n8 / 8;
    int streams = H <= KV_STREAM_HEADS ? KV_STREAMS(a->head_block) : 1;
    if (streams > groups) streams = (int)groups;
    const int64_t per = (groups + streams - 1) / streams; /* groups a stream */
    v8 t[streams * H * 8]; /* stream s, query head hq, token j: t[s * H * 8 + hq * 8 + j] */
    for (int64_t step = 0; step < per; step++) {
        const char *rows[KV_STREAMS_MAX][8];
        int live = 0;
        for (int s = 0; s < streams && s * per + step < groups; s++, live++) {
            const int64_t i = (s * per + step) * 8, cnt = n - i < 8 ? n - i : 8;
            for (int64_t j = 0; j < 8; j++) rows[s][j] = token_row(a, a->k_cache, slots[i + (j < cnt ? j : 0)]);
        }
        row_scores(a, (const char *const(*)[8])rows, live, q, t);
        for (int s = 0; s < live; s++) {
            const int64_t i = (s * per + step) * 8;
            for (int64_t hq = 0; hq < H; hq++) {
                const v8 sc = v8_hsum8(t + s * H * 8 + hq * 8);
                v8_store(scores + hq * n8 + i, sc);
                mv[hq] = v8_max(mv[hq], sc);
            }
        }
    }
    for (int64_t hq = 0; hq < H; hq++) m[hq] = v8_hmax(mv[hq]);
}

/* acc[hq * D + d] = sum over the n tokens at `slots` of probs[hq * n8 + i] * v_i: V row by row in order in each of
 * the streams (token ranges) side by side, one token of each at a time (the sums add the streams' tokens in turn).
 * With three streams the hardware prefetcher keeps up: the software prefetch of each stream's row 4 ahead (what one
 * stream needed) only cost: float32 1-10% slower with it, bf16 within noise (bench/decode_attention.py, Zen 2). */
static void pv_8lanes(const DecodeArgs *a, const int64_t *slots, int64_t n, const float *probs, int64_t n8,
                      float *acc) {
    const int64_t D = a->head_dim, H = a->num_heads;
    const int groups = (int)(n8 / 8), most = H <= KV_STREAM_HEADS ? KV_STREAMS(a->head_block) : 1;
    const int streams = most > groups ? groups : most;
    memset(acc, 0, sizeof(float) * H * D);
    const int64_t span = (n + streams - 1) / streams; /* tokens a stream */
    for (int64_t step = 0; step < span; step++) {
        const char *rows[KV_STREAMS_MAX];
        const float *p[KV_STREAMS_MAX];
        int live = 0;
        for (int s = 0; s < streams && s * span + step < n; s++, live++) {
            const int64_t i = s * span + step;
            rows[s] = token_row(a, a->v_cache, slots[i]);
            p[s] = probs + i;
        }
        row_pv(a, rows, live, p, n8, acc);
    }
}

/* Tokens [t0, t1) of sequence b, all heads: unnormalised softmax stats and P.V.
 * m[hq] = max score, l[hq] = sum exp(score - m), acc[hq * D ..] = sum exp(score - m) * v, for query head hq.
 * One item covers every kv head, so K and V are each read token row by token row, in order. The AVX-512 passes run
 * where they apply (decode_attention_avx512.c), else the 8-lane ones.
 * Scratch: H * n scores, then n slots; qrow: H * D floats, where a bf16 q row (q16) is widened. */
static void decode_part(const DecodeArgs *a, int64_t b, int64_t t0, int64_t t1, float *scores, int64_t *slots,
                        float *qrow, float *m, float *l, float *acc) {
    const int64_t D = a->head_dim, H = a->num_heads, Hkv = a->num_kv_heads, n = t1 - t0;
    const float *q = a->q ? a->q + b * a->q_row_stride : qrow;
    if (!a->q) bf16_to_f32_rows(a->q16 + b * a->q_row_stride, qrow, H * D);
    token_slots(a, b, t0, t1, slots);
    const int64_t n8 = (n + 7) / 8 * 8; /* scores of one head: n, padded to whole groups of 8 */
    const int wide = llmd_attn_scores_avx512(a->cache_bf16, q, a->k_cache, a->v_cache, slots, n, H, Hkv, D, a->scale,
                                             scores, n8, m) == 0;
    if (!wide) scores_8lanes(a, q, slots, n, n8, scores, m);
    for (int64_t hq = 0; hq < H; hq++) {
        float *s = scores + hq * n8;
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
    if (!wide || llmd_attn_pv_avx512(a->cache_bf16, a->v_cache, slots, n, scores, n8, H, Hkv, D, acc) != 0)
        pv_8lanes(a, slots, n, scores, n8, acc);
}

/* splits per sequence: only when sequences alone would leave threads idle or unevenly loaded, the fewest that
 * make the items a multiple of the threads (1 sequence on 2 threads: 2; 3: 6 items), >= 64 tokens each. At batch 1
 * behind a weight stream the K/V rows come from memory, and one thread alone reads them at a third of the
 * bandwidth (SmolLM2 int8 at context 250, 1.5 -> 1.1 ms of attention a step, Zen 4, 2 threads); each split reads
 * its tokens as streams side by side, so more splits than that (4 a thread before) only add their merge: Zen 2,
 * bench/decode_attention.py, float32, 1 x 430 tokens 33.1 -> 29.7 us a layer, 2 x 430 71.3 -> 59.7, 3 x 600 131.7 ->
 * 124.3 (bf16 0.78-0.91x). */
static int64_t choose_splits(int64_t items, int64_t max_len, int nthreads) {
    if (items >= 2 * nthreads) return 1;
    int64_t s = 1;
    while ((items * s) % nthreads || items * s < nthreads) s++;
    const int64_t by_len = max_len / 64;
    return s < by_len ? s : by_len < 1 ? 1 : by_len;
}

/* the call over args a (q or q16, out or out16) */
static int decode_attention(DecodeArgs a, float *out, int64_t B, int nthreads) {
    const int64_t H = a.num_heads, D = a.head_dim;
    const int32_t *context_lens = a.context_lens;
    int64_t max_len = 0;
    for (int64_t b = 0; b < B; b++) max_len = context_lens[b] > max_len ? context_lens[b] : max_len;
    const int64_t S = choose_splits(B, max_len, nthreads);
    if (B * S < nthreads) nthreads = (int)(B * S); /* a thread without an item would only wait at the barrier */
    /* per (b, split): m[H], l[H], acc[H * D] */
    const int64_t part_size = H * (D + 2);
    float *part = S > 1 ? (float *)malloc(sizeof(float) * B * S * part_size) : NULL;
    if (S > 1 && !part) return -1;
    const int64_t rows = a.out16 ? 2 * H * D : 0; /* bf16 in and out: a sequence's q and output in float32 */
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        const int64_t most = (max_len + S - 1) / S + 16;
        float *scores = (float *)malloc((sizeof(float) * H + sizeof(int64_t)) * most + sizeof(float) * rows);
        int64_t *slots = (int64_t *)(scores + H * most);
        float *qrow = (float *)(slots + most), *orow = qrow + H * D;
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
                    float *o = a.out16 ? orow : out + b * H * D;
                    decode_part(&a, b, 0, len, scores, slots, qrow, ml, ml + H, o);
                    for (int64_t hq = 0; hq < H; hq++) {
                        const float inv = 1.0f / ml[H + hq];
                        for (int64_t d = 0; d < D; d++) o[hq * D + d] *= inv;
                    }
                    if (a.out16) f32_to_bf16_step(o, a.out16 + b * H * D, H * D);
                } else {
                    float *p = part + (b * S + s) * part_size;
                    if (t1 > t0) {
                        decode_part(&a, b, t0, t1, scores, slots, qrow, p, p + H, p + 2 * H);
                    } else { /* an empty split (a short sequence next to long ones): contributes nothing */
                        for (int64_t hq = 0; hq < H; hq++) p[hq] = -FLT_MAX, p[H + hq] = 0.0f;
                        memset(p + 2 * H, 0, sizeof(float) * H * D);
                    }
                }
            }
        free(scores);
        /* the merge in the same region: one fork and join a call (the for above ends at a barrier) */
        if (!failed && S > 1) {
            float staged[MAX_HEAD_DIM];
#pragma omp for collapse(2)
            for (int64_t b = 0; b < B; b++)
                for (int64_t hq = 0; hq < H; hq++) {
                    const float *p0 = part + b * S * part_size;
                    float mx = -FLT_MAX, total = 0.0f;
                    for (int64_t s = 0; s < S; s++) mx = fmaxf(mx, p0[s * part_size + hq]);
                    float *o = a.out16 ? staged : out + (b * H + hq) * D;
                    for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
                    for (int64_t s = 0; s < S; s++) {
                        const float *p = p0 + s * part_size;
                        const float w = p[H + hq] > 0.0f ? expf(p[hq] - mx) : 0.0f;
                        total += w * p[H + hq];
                        for (int64_t d = 0; d < D; d++) o[d] += w * p[2 * H + hq * D + d];
                    }
                    for (int64_t d = 0; d < D; d++) o[d] /= total;
                    if (a.out16) f32_to_bf16_step(o, a.out16 + (b * H + hq) * D, D);
                }
        }
    }
    free(part);
    return failed ? -1 : 0;
}

/* out: [B, H, D] float32, contiguous. Returns 0, or -1 on unsupported shapes (the caller falls back). */
int llmd_paged_decode_attention(const float *q, int64_t q_row_stride, const void *k_cache, const void *v_cache,
                                int cache_bf16, const int32_t *block_tables, int64_t bt_stride,
                                const int32_t *context_lens, float *out, int64_t B, int64_t H, int64_t Hkv,
                                int64_t D, int64_t block_size, float scale, int nthreads) {
    if (H % Hkv || H > MAX_HEADS || D % 8 || D > MAX_HEAD_DIM || nthreads < 1) return -1;
    const DecodeArgs a = {q,  q_row_stride, k_cache, v_cache, cache_bf16, block_tables, bt_stride, context_lens,
                          H,  Hkv,          D,       block_size, scale,     head_block(H, Hkv), NULL,  NULL};
    return decode_attention(a, out, B, nthreads);
}

/* The same over bf16 queries (rows of q_row_stride elements: the bf16 decode step's qkv rows) and a bf16 cache, with
 * the output in bf16 [B, H, D] (as f32_to_bf16_step rounds): each worker widens its own sequences' q and rounds
 * their outputs, where the decode step's serial conversions before and after the call read what the other core had
 * written (SmolLM2 bf16, 32 sequences, Zen 4: 1.1 ms of a 34 ms step). D a multiple of 16. */
int llmd_paged_decode_attention_bf16io(const uint16_t *q, int64_t q_row_stride, const void *k_cache,
                                       const void *v_cache, const int32_t *block_tables, int64_t bt_stride,
                                       const int32_t *context_lens, uint16_t *out, int64_t B, int64_t H, int64_t Hkv,
                                       int64_t D, int64_t block_size, float scale, int nthreads) {
    if (H % Hkv || H > MAX_HEADS || D % 16 || D > MAX_HEAD_DIM || nthreads < 1) return -1;
    const DecodeArgs a = {NULL, q_row_stride, k_cache, v_cache, 1,     block_tables, bt_stride, context_lens,
                          H,    Hkv,          D,       block_size, scale, head_block(H, Hkv), q,        out};
    return decode_attention(a, NULL, B, nthreads);
}
