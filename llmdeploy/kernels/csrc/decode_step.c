/* A decode step's decoder layers in one call (Llama family, one rank): per layer add + RMSNorm, fused qkv, rotary
 * + K/V store, paged decode attention, o, add + RMSNorm, fused gate/up, silu * up, down; built into one library with cpu_kernels.c
 * and calling its kernels in the order the Python layers do, on the same buffers, so the results are the same.
 *
 * Why: at batch 1 the weights stream in ~8 ms (bf16 SmolLM2 on 2 Zen 4 cores) but the step took 16 ms: ~270 kernel
 * calls from Python, each 10-18 us of wrapper, ctypes and small tensor ops around 2-3 us of native call cost.
 *
 * Activations are float32 or bf16 (`act_bf16`); each projection is one llmd_linear: the float32 or bf16 packed
 * weight of the activations' dtype, or block-quantized weights (float32 activations only). All shapes are checked
 * before anything is written, so a -1 leaves the hidden state, the residual and the caches as they were. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "head_screen.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#else
#include "bf16_lanes.h"
#endif

enum { LIN_F32 = 0, LIN_BF16 = 1, LIN_Q = 2, LIN_QV = 3 }; /* LinearKind in kernels/decode_step.py */

typedef struct {
    int32_t kind, fmt; /* fmt: QFormat for LIN_Q / LIN_QV */
    const void *w;     /* packed by the kind's pack function */
    const void *bias;  /* NULL, or N of the activations' dtype (float32 for the quantized kinds) */
    int64_t n, k;
} llmd_linear;

typedef struct {
    const void *in_norm, *post_norm; /* E of the activations' dtype */
    llmd_linear qkv, o, gate_up, down;
    void *k_cache, *v_cache; /* [num_blocks * block_size, Hkv, D] of the activations' dtype */
} llmd_layer;

int llmd_f32_linear(const float *, int64_t, const float *, const float *, float *, int64_t, int64_t, int64_t, int);
int llmd_bf16_linear(const uint16_t *, int64_t, const uint16_t *, const uint16_t *, uint16_t *, int64_t, int64_t,
                     int64_t, int);
int llmd_q_linear(int, const float *, int64_t, const uint8_t *, const float *, float *, int64_t, int64_t, int64_t,
                  int);
int llmd_q_bf16_linear(int, const float *, int64_t, const uint8_t *, const float *, float *, int64_t, int64_t,
                       int64_t, int);
int llmd_qv_linear(int, const float *, int64_t, const uint8_t *, const float *, float *, int64_t, int64_t, int64_t,
                   int);
int llmd_add_rms_norm(const float *, const float *, const float *, float *, float *, int64_t, int64_t, float, int);
int llmd_add_rms_norm_bf16(const uint16_t *, const uint16_t *, const uint16_t *, uint16_t *, uint16_t *, int64_t,
                           int64_t, float, int);
int llmd_rope_store(float *, int64_t, int64_t, int64_t, int64_t, const float *, const float *, const int64_t *,
                    float *, float *, int);
int llmd_rope_store_bf16(uint16_t *, int64_t, int64_t, int64_t, int64_t, const float *, const float *,
                         const int64_t *, uint16_t *, uint16_t *, int);
int llmd_paged_decode_attention_bf16io(const uint16_t *, int64_t, const void *, const void *, const int32_t *, int64_t,
                                       const int32_t *, uint16_t *, int64_t, int64_t, int64_t, int64_t, int64_t, float,
                                       int);
int llmd_paged_decode_attention(const float *, int64_t, const void *, const void *, int, const int32_t *, int64_t,
                                const int32_t *, float *, int64_t, int64_t, int64_t, int64_t, int64_t, float, int);
int llmd_silu_mul(const float *, float *, int64_t, int64_t, int);
int llmd_silu_mul_bf16(const uint16_t *, uint16_t *, int64_t, int64_t, int);
int llmd_has_avx512_bf16(void);
int llmd_argmax_rows(const float *, int64_t, int64_t, int64_t, int64_t *, int); /* argmax.c */
int llmd_sample_rows(const float *, int64_t, int64_t, int64_t, const float *, const float *, const double *,
                     int64_t *, int); /* sample_rows.c */
int llmd_top_k_top_p_rows(float *, int64_t, int64_t, int64_t, const int64_t *, const double *, const float *,
                          int); /* sample_rows.c */
int llmd_has_bf16_linear(void);

/* A sampled burst's draw: each row's 1 / temperature (0: that row greedy) and min_p, and the uniform numbers of
 * every step, step-major (u[j * M + n]: step j, row n); top_k and top_p (NULL: no row has either) as
 * llmd_top_k_top_p_rows takes them, applied before the draw as the sampler's ordinary step does. */
typedef struct {
    const float *inv_temp, *min_p;
    const double *u;
    const int64_t *top_k;
    const double *top_p;
} llmd_draw;

/* the kernel q_linear in kernels/native_quant.py picks for this kind and row count */
static int linear(const llmd_linear *l, int act_bf16, const void *x, void *y, int64_t M, int64_t q_bf16_min_rows,
                  int nthreads) {
    switch (l->kind) {
    case LIN_F32:
        return llmd_f32_linear(x, l->k, l->w, l->bias, y, M, l->n, l->k, nthreads);
    case LIN_BF16:
        return llmd_bf16_linear(x, l->k, l->w, l->bias, y, M, l->n, l->k, nthreads);
    case LIN_QV:
        return llmd_qv_linear(l->fmt, x, l->k, l->w, l->bias, y, M, l->n, l->k, nthreads);
    case LIN_Q:
        if (M >= q_bf16_min_rows && llmd_has_avx512_bf16())
            return llmd_q_bf16_linear(l->fmt, x, l->k, l->w, l->bias, y, M, l->n, l->k, nthreads);
        return llmd_q_linear(l->fmt, x, l->k, l->w, l->bias, y, M, l->n, l->k, nthreads);
    }
    (void)act_bf16;
    return -1;
}

static int linear_fits(const llmd_linear *l, int act_bf16, int64_t n, int64_t k) {
    const int kind_ok = act_bf16 ? l->kind == LIN_BF16 : l->kind != LIN_BF16;
    return kind_ok && l->w && l->n == n && l->k == k && (l->kind == LIN_F32 || k % 32 == 0);
}

static int shapes_fit(int act_bf16, int64_t n_layers, const llmd_layer *L, int64_t E, int64_t H, int64_t Hkv,
                      int64_t D, int64_t I) {
    if (E % 8 || I % 8 || D % 16 || H % Hkv || H > 256 || D > 512 || E % 2 || I % 2) return 0;
    const int64_t qkv = (H + 2 * Hkv) * D;
    for (int64_t i = 0; i < n_layers; i++) {
        const llmd_layer *l = L + i;
        if (!l->in_norm || !l->post_norm || !l->k_cache || !l->v_cache) return 0;
        if (!linear_fits(&l->qkv, act_bf16, qkv, E) || !linear_fits(&l->o, act_bf16, E, H * D) ||
            !linear_fits(&l->gate_up, act_bf16, 2 * I, E) || !linear_fits(&l->down, act_bf16, E, I))
            return 0;
    }
    return 1;
}

/* The rotary tables of reference.rotary_tables for each row's position: cos_sin rows are [cos | sin] (half width
 * each); cos = cos | cos, sin = -sin | sin (negation is exact: the Python layers' values). */
static void rotary_tables(const int64_t *positions, const float *cos_sin, int64_t M, int64_t D, float *cos_out,
                          float *sin_out) {
    const int64_t half = D / 2;
    for (int64_t n = 0; n < M; n++) {
        const float *c = cos_sin + positions[n] * D, *s = c + half;
        for (int64_t d = 0; d < half; d++) {
            cos_out[n * D + d] = cos_out[n * D + half + d] = c[d];
            sin_out[n * D + d] = -s[d], sin_out[n * D + half + d] = s[d];
        }
    }
}

/* hidden, residual: [M, E] of the activations' dtype, updated in place to what the last layer returns; where
 * final_norm is given, hidden then holds the model's final add + RMSNorm of the two (the model's output).
 * positions: [M] int64, each in [0, max_pos); cos_sin: [max_pos, D] float32 (the model's rotary cache); slots: [M]
 * int64; tables: [M, bt_stride] int32; lens: [M] int32 (context length with this token). Returns 0, -1 (shapes
 * or positions the kernels do not take: nothing written), -3 (out of memory: nothing written), or the failing
 * kernel's code (cannot happen for shapes that passed the check). */
int llmd_decode_layers(int act_bf16, int64_t n_layers, const llmd_layer *L, const void *final_norm, void *hidden,
                       void *residual, int64_t M, int64_t E, int64_t H, int64_t Hkv, int64_t D, int64_t I, float eps,
                       const int64_t *positions, const float *cos_sin, int64_t max_pos, const int64_t *slots,
                       const int32_t *tables, int64_t bt_stride, const int32_t *lens, int64_t block_size,
                       float scale, int64_t q_bf16_min_rows, int nthreads) {
    if (M < 1 || n_layers < 1 || nthreads < 1 || !shapes_fit(act_bf16, n_layers, L, E, H, Hkv, D, I)) return -1;
    for (int64_t n = 0; n < M; n++)
        if (positions[n] < 0 || positions[n] >= max_pos) return -1;
    if (act_bf16 && !llmd_has_bf16_linear()) return -1;
    const size_t es = act_bf16 ? 2 : 4, qkv_row = (size_t)((H + 2 * Hkv) * D);
    char *normed = malloc(es * (size_t)(M * E)), *qkv = malloc(es * (size_t)M * qkv_row);
    char *gate_up = malloc(es * (size_t)(M * 2 * I)), *act = malloc(es * (size_t)(M * I));
    float *attn = act_bf16 ? NULL : malloc(sizeof(float) * (size_t)(M * H * D));
    uint16_t *attn16 = act_bf16 ? malloc(2 * (size_t)(M * H * D)) : NULL;
    float *rot = malloc(2 * sizeof(float) * (size_t)(M * D)); /* this step's cos rows, then its sin rows */
    int rc = -3;
    if (!normed || !qkv || !gate_up || !act || !rot || (act_bf16 ? !attn16 : !attn)) goto done;
    const float *cos = rot, *sin = rot + M * D;
    rotary_tables(positions, cos_sin, M, D, rot, rot + M * D);
    rc = 0;
    for (int64_t i = 0; i < n_layers && rc == 0; i++) {
        const llmd_layer *l = L + i;
        rc = act_bf16 ? llmd_add_rms_norm_bf16(hidden, residual, l->in_norm, (uint16_t *)normed, residual, M, E, eps,
                                               nthreads)
                      : llmd_add_rms_norm(hidden, residual, l->in_norm, (float *)normed, residual, M, E, eps,
                                          nthreads);
        if (!rc) rc = linear(&l->qkv, act_bf16, normed, qkv, M, q_bf16_min_rows, nthreads);
        if (!rc)
            rc = act_bf16 ? llmd_rope_store_bf16((uint16_t *)qkv, M, H, Hkv, D, cos, sin, slots, l->k_cache,
                                                 l->v_cache, nthreads)
                          : llmd_rope_store((float *)qkv, M, H, Hkv, D, cos, sin, slots, l->k_cache, l->v_cache,
                                            nthreads);
        if (rc) break;
        /* bf16: the kernel reads q from qkv and writes its output in bf16 (the layers' decode attention too) */
        rc = act_bf16 ? llmd_paged_decode_attention_bf16io((const uint16_t *)qkv, (int64_t)qkv_row, l->k_cache,
                                                           l->v_cache, tables, bt_stride, lens, attn16, M, H, Hkv, D,
                                                           block_size, scale, nthreads)
                      : llmd_paged_decode_attention((const float *)qkv, (int64_t)qkv_row, l->k_cache, l->v_cache, 0,
                                                    tables, bt_stride, lens, attn, M, H, Hkv, D, block_size, scale,
                                                    nthreads);
        if (rc) break;
        rc = linear(&l->o, act_bf16, act_bf16 ? (const void *)attn16 : attn, hidden, M, q_bf16_min_rows, nthreads);
        if (!rc)
            rc = act_bf16 ? llmd_add_rms_norm_bf16(hidden, residual, l->post_norm, (uint16_t *)normed, residual, M, E,
                                                   eps, nthreads)
                          : llmd_add_rms_norm(hidden, residual, l->post_norm, (float *)normed, residual, M, E, eps,
                                              nthreads);
        if (!rc) rc = linear(&l->gate_up, act_bf16, normed, gate_up, M, q_bf16_min_rows, nthreads);
        if (!rc)
            rc = act_bf16 ? llmd_silu_mul_bf16((const uint16_t *)gate_up, (uint16_t *)act, M, I, nthreads)
                          : llmd_silu_mul((const float *)gate_up, (float *)act, M, I, nthreads);
        if (!rc) rc = linear(&l->down, act_bf16, act, hidden, M, q_bf16_min_rows, nthreads);
    }
    if (!rc && final_norm) /* as the model's norm(hidden, residual)[0], written over hidden */
        rc = act_bf16 ? llmd_add_rms_norm_bf16(hidden, residual, final_norm, hidden, residual, M, E, eps, nthreads)
                      : llmd_add_rms_norm(hidden, residual, final_norm, hidden, residual, M, E, eps, nthreads);
done:
    free(normed), free(qkv), free(gate_up), free(act), free(attn), free(attn16), free(rot);
    return rc;
}

/* n bf16 -> float32, exactly (the Python head's `.float()` of its bf16 logits) */
static void widen(const uint16_t *src, float *dst, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512BF16__)
    for (; i + 16 <= n; i += 16) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)(src + i));
        _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
    }
#endif
    for (; i < n; i++) {
        const uint32_t u = (uint32_t)src[i] << 16;
        memcpy(dst + i, &u, sizeof u);
    }
}

#define HEAD_TILE 32 /* channels a tile of the packed float32 and bf16 layouts (F32_NR, BF16_NR) */

/* row `id` of a tied model's embedding, read from its packed head (llmd_f32_pack: tile, k, channel; llmd_bf16_pack:
 * tile, input pair, channel, pair member) into out[E] */
static void head_row(const llmd_linear *head, int64_t id, int64_t E, void *out) {
    const int64_t t = id / HEAD_TILE, c = id % HEAD_TILE;
    if (head->kind == LIN_F32) {
        const float *w = (const float *)head->w + t * E * HEAD_TILE + c;
        for (int64_t k = 0; k < E; k++) ((float *)out)[k] = w[k * HEAD_TILE];
    } else {
        const uint16_t *w = (const uint16_t *)head->w + (t * (E / 2) * HEAD_TILE + c) * 2;
        for (int64_t k = 0; k < E; k++) ((uint16_t *)out)[k] = w[(k / 2) * HEAD_TILE * 2 + k % 2];
    }
}

/* Whether the embedding can be read: its own table, or (embed NULL) the packed float32 / bf16 head of a tied model */
static int embedding_fits(const void *embed, const llmd_linear *head, int act_bf16, int64_t vocab) {
    if (embed) return 1;
    return head && head->n == vocab && (act_bf16 ? head->kind == LIN_BF16 : head->kind == LIN_F32);
}

/* the embedding of ids (its table's rows, or with embed NULL the tied head's), every layer and the final norm:
 * hidden [M, E] of the activations' dtype (residual scratch) */
static int decode_hidden(int act_bf16, int64_t n_layers, const llmd_layer *L, const void *final_norm,
                         const void *embed, const llmd_linear *head, int64_t vocab, const int64_t *ids, char *hidden,
                         char *residual, int64_t M, int64_t E, int64_t H, int64_t Hkv, int64_t D, int64_t I, float eps,
                         const int64_t *positions, const float *cos_sin, int64_t max_pos, const int64_t *slots,
                         const int32_t *tables, int64_t bt_stride, const int32_t *lens, int64_t block_size,
                         float scale, int64_t q_bf16_min_rows, int nthreads) {
    for (int64_t n = 0; n < M; n++)
        if (ids[n] < 0 || ids[n] >= vocab) return -1;
    const size_t es = act_bf16 ? 2 : 4;
    memset(residual, 0, es * (size_t)(M * E));
    for (int64_t n = 0; n < M; n++) {
        if (embed)
            memcpy(hidden + es * (size_t)(n * E), (const char *)embed + es * (size_t)(ids[n] * E), es * (size_t)E);
        else
            head_row(head, ids[n], E, hidden + es * (size_t)(n * E));
    }
    return llmd_decode_layers(act_bf16, n_layers, L, final_norm, hidden, residual, M, E, H, Hkv, D, I, eps, positions,
                              cos_sin, max_pos, slots, tables, bt_stride, lens, block_size, scale, q_bf16_min_rows,
                              nthreads);
}

/* hidden [M, E] through the head: float32 logits [M, head->n] (bf16 logits widened from head16, [M, head->n]
 * scratch the caller allocates once; NULL in float32) */
static int head_logits(const llmd_linear *head, int act_bf16, const char *hidden, float *logits, uint16_t *head16,
                       int64_t M, int64_t q_bf16_min_rows, int nthreads) {
    if (!act_bf16) return linear(head, 0, hidden, logits, M, q_bf16_min_rows, nthreads);
    const int rc = linear(head, 1, hidden, head16, M, q_bf16_min_rows, nthreads);
    if (!rc) widen(head16, logits, M * head->n);
    return rc;
}

/* A decode-only step from token ids to float32 logits in one call: the embedding rows of `ids` (embed: [vocab, E]
 * of the activations' dtype; NULL: a tied model's, read from its packed float32 or bf16 head), every layer and the final norm (llmd_decode_layers, over a zero residual as the
 * Python model starts), then the LM head `head` (N = its vocabulary rows) into logits [M, N]: the head's own output
 * dtype widened to float32 as the Python path's `.float()`, so the values are the Python path's.
 *
 * Why: at batch 1 the Python around the layers' call (embedding, the head's module and wrapper calls, the logits'
 * dtype copy, the row selection) was ~0.35 ms of a 7.6 ms bf16 step: 5% above the bandwidth floor.
 *
 * Returns llmd_decode_layers' codes; -1 also for an id outside [0, vocab) or a head the activations cannot feed. */
int llmd_decode_logits(int act_bf16, int64_t n_layers, const llmd_layer *L, const void *final_norm, const void *embed,
                       int64_t vocab, const int64_t *ids, const llmd_linear *head, float *logits, int64_t M, int64_t E,
                       int64_t H, int64_t Hkv, int64_t D, int64_t I, float eps, const int64_t *positions,
                       const float *cos_sin, int64_t max_pos, const int64_t *slots, const int32_t *tables,
                       int64_t bt_stride, const int32_t *lens, int64_t block_size, float scale,
                       int64_t q_bf16_min_rows, int nthreads) {
    if (M < 1 || !final_norm || !head || !linear_fits(head, act_bf16, head->n, E) || head->n < 1 ||
        !embedding_fits(embed, head, act_bf16, vocab))
        return -1;
    const size_t es = act_bf16 ? 2 : 4;
    char *hidden = malloc(es * (size_t)(M * E)), *residual = malloc(es * (size_t)(M * E));
    uint16_t *head16 = act_bf16 ? malloc(2 * (size_t)(M * head->n)) : NULL;
    int rc = -3;
    if (hidden && residual && (head16 || !act_bf16))
        rc = decode_hidden(act_bf16, n_layers, L, final_norm, embed, head, vocab, ids, hidden, residual, M, E, H, Hkv,
                           D, I, eps, positions, cos_sin, max_pos, slots, tables, bt_stride, lens, block_size, scale,
                           q_bf16_min_rows, nthreads);
    if (!rc) rc = head_logits(head, act_bf16, hidden, logits, head16, M, q_bf16_min_rows, nthreads);
    free(hidden), free(residual), free(head16);
    return rc;
}

/* `steps` greedy decode steps in one call: llmd_decode_logits, then each row's argmax (llmd_argmax_rows: the
 * first index of the largest logit, as the sampler's greedy path picks) becomes the row's next input id, at the
 * next position, its K/V stored in the slot the block table gives it. tokens: [M, steps]. positions and lens are
 * the first step's (lens[n] = positions[n] + 1 for a decode); tables must already hold the blocks of every
 * position up to positions[n] + steps - 1 (the engine reserves them).
 *
 * Why: a batch-1 bf16 step on 2 Zen 4 cores spent ~0.6 ms in Python outside the native call (scheduling, inputs,
 * sampling, output bookkeeping, all running cold after the 269 MB weight stream evicted its data): 10% of the step
 * and 0.14x of the bandwidth floor. A burst pays it once for `steps` tokens.
 *
 * yield_flag (may be NULL): read before each step after the first; once it is non-zero the burst ends there (the
 * engine sets it when a prompt arrives or a request is aborted, so neither waits for the rest of a burst). *done:
 * the steps run, their tokens in tokens[n * steps + j] for j < *done.
 *
 * screen (may be NULL): at the rows it takes (llmd_head_screen_takes), a float32 or bf16 head without bias, each
 * step's argmaxes come from the head's Q8 or bf16 screen and the exact logits of its candidate tiles (head_screen.c:
 * the same tokens, most of the head unread); where the screen declines, the whole head. screened (may be NULL): [0] the steps it
 * answered, [1] the candidate tiles they computed (all rows).
 *
 * draw (may be NULL: all greedy): each row's token is drawn from its logits instead (llmd_sample_rows: the
 * sampler's temperature, min_p and inverse-CDF draw with the step's uniform number; a row at 1 / temperature 0
 * stays greedy); no screen then. A row with no finite logit ends the burst before that step's tokens.
 *
 * Returns llmd_decode_logits' codes; -1 (nothing written) also where a position would pass max_pos or the
 * table's width, or the head has more rows than the embedding (an argmax could not be fed back). A failure after
 * the first step (out of memory) leaves the earlier steps' K/V written. */
int llmd_decode_greedy(int act_bf16, int64_t n_layers, const llmd_layer *L, const void *final_norm, const void *embed,
                       int64_t vocab, const int64_t *ids, const llmd_linear *head, const llmd_head_screen *screen,
                       int64_t *tokens, int64_t steps, const volatile int32_t *yield_flag, int64_t *done,
                       int64_t *screened, const llmd_draw *draw, int64_t M, int64_t E, int64_t H, int64_t Hkv,
                       int64_t D, int64_t I, float eps, const int64_t *positions, const float *cos_sin, int64_t max_pos,
                       const int32_t *tables, int64_t bt_stride, const int32_t *lens, int64_t block_size, float scale,
                       int64_t q_bf16_min_rows, int nthreads) {
    if (M < 1 || steps < 1 || block_size < 1 || !head || head->n < 1 || head->n > vocab || !done || !final_norm ||
        !embedding_fits(embed, head, act_bf16, vocab) || !linear_fits(head, act_bf16, head->n, E))
        return -1;
    *done = 0;
    if (screened) screened[0] = screened[1] = 0;
    for (int64_t n = 0; n < M; n++)
        if (positions[n] < 0 || positions[n] + steps > max_pos ||
            (positions[n] + steps - 1) / block_size >= bt_stride)
            return -1;
    /* the screen takes a float32 or bf16 head without bias, at the rows it has a copy for (head_screen.c) */
    const int screen_on = !draw && llmd_head_screen_takes(screen, act_bf16, M) && !head->bias &&
                          (head->kind == LIN_F32 || head->kind == LIN_BF16);
    const size_t es = act_bf16 ? 2 : 4;
    int64_t *cur = malloc(sizeof(int64_t) * (size_t)(4 * M));
    int32_t *lens_j = malloc(sizeof(int32_t) * (size_t)M);
    float *logits = malloc(sizeof(float) * (size_t)(M * head->n));
    char *hidden = malloc(es * (size_t)(M * E)), *residual = malloc(es * (size_t)(M * E));
    uint16_t *head16 = act_bf16 ? malloc(2 * (size_t)(M * head->n)) : NULL;
    int rc = -3;
    if (!cur || !lens_j || !logits || !hidden || !residual || (act_bf16 && !head16)) goto done;
    int64_t *pos = cur + M, *slots = cur + 2 * M, *best = cur + 3 * M;
    memcpy(cur, ids, sizeof(int64_t) * (size_t)M);
    rc = 0;
    for (int64_t j = 0; j < steps && rc == 0; j++) {
        if (j > 0 && yield_flag && *yield_flag) break;
        for (int64_t n = 0; n < M; n++) {
            pos[n] = positions[n] + j;
            lens_j[n] = lens[n] + (int32_t)j;
            slots[n] = (int64_t)tables[n * bt_stride + pos[n] / block_size] * block_size + pos[n] % block_size;
        }
        rc = decode_hidden(act_bf16, n_layers, L, final_norm, embed, head, vocab, cur, hidden, residual, M, E, H, Hkv,
                           D, I, eps, pos, cos_sin, max_pos, slots, tables, bt_stride, lens_j, block_size, scale,
                           q_bf16_min_rows, nthreads);
        int64_t tiles = 0;
        const int by_screen = !rc && screen_on &&
                              llmd_head_screen_argmax(screen, act_bf16, head->w, head->n, E, hidden, M, best, &tiles,
                                                      nthreads) == 0;
        if (!rc && !by_screen) {
            rc = head_logits(head, act_bf16, hidden, logits, head16, M, q_bf16_min_rows, nthreads);
            if (!rc && draw && draw->top_k)
                rc = llmd_top_k_top_p_rows(logits, M, head->n, head->n, draw->top_k, draw->top_p, draw->inv_temp,
                                           nthreads);
            if (!rc && draw)
                rc = llmd_sample_rows(logits, M, head->n, head->n, draw->inv_temp, draw->min_p, draw->u + j * M, best,
                                      nthreads);
            else if (!rc)
                rc = llmd_argmax_rows(logits, M, head->n, head->n, best, nthreads);
        }
        if (by_screen && screened) screened[0] += 1, screened[1] += tiles;
        int drawn = 1; /* a row with no finite logit ends the burst before this step (the sampler's torch ops) */
        for (int64_t n = 0; n < M && rc == 0; n++) drawn &= best[n] >= 0;
        if (!drawn) break;
        for (int64_t n = 0; n < M && rc == 0; n++) tokens[n * steps + j] = cur[n] = best[n];
        if (rc == 0) *done = j + 1;
    }
done:
    free(cur), free(lens_j), free(logits), free(hidden), free(residual), free(head16);
    return rc;
}
