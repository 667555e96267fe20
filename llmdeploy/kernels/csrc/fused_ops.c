/* Small fused ops of a layer (RMSNorm with the residual add, silu * up, rotary + K/V store), float32 and bf16. */
#include "avx512_exp.h"
#include "bf16_lanes.h"

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

#if defined(__AVX512F__)
/* v8_silu on 16 lanes: the same operations in the same order, so the same bits a lane (1.3-1.7x the speed on Zen 4,
 * where silu * up was ~5% of a batch-16 bf16 decode step on 8 lanes) */
static inline __m512 v16_silu(__m512 g) {
    return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), v16_exp(_mm512_mul_ps(g, _mm512_set1_ps(-1.0f)))));
}
static inline __m512 v16_load_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
/* v8_to_bf16_bits on 16 lanes: to nearest even in integer lanes, NaN made quiet */
static inline __m256i v16_to_bf16_bits(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(r);
}
static inline __m512 v16_round_bf16(__m512 x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v16_to_bf16_bits(x)), 16));
}
#endif

/* x: rows of [gate | up] (2 * inter floats) -> out rows of inter floats: gate / (1 + exp(-gate)) * up */
int llmd_silu_mul(const float *x, float *out, int64_t rows, int64_t inter, int nthreads) {
    if (inter % 8) return -1;
#pragma omp parallel for schedule(static) num_threads(threads_for(rows, nthreads))
    for (int64_t r = 0; r < rows; r++) {
        const float *g = x + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        int64_t d = 0;
#if defined(__AVX512F__)
        for (; d + 16 <= inter; d += 16)
            _mm512_storeu_ps(o + d, _mm512_mul_ps(v16_silu(_mm512_loadu_ps(g + d)), _mm512_loadu_ps(u + d)));
#endif
        for (; d < inter; d += 8) v8_store(o + d, v8_mul(v8_silu(v8_load(g + d)), v8_load(u + d)));
    }
    return 0;
}

/* ---------------------------------------------------------------- norm and rotary in bfloat16 */

/* bf16 in and out, float32 math, each rounding where torch's bf16 ops round (a bf16 op computes in float32 and
 * rounds its result to nearest even): x + residual, the normalised value, its product with the weight; the rotated
 * q and k. The engine's bf16 decode step ran these as ~10 small torch ops a layer. Rounding: bf16_lanes.h. */
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
 * product to bf16. On 8 lanes it was slower than torch's two ops (Zen 4: 16 rows 33 against 23 us, 128 rows 122 against
 * 83), on 16 faster (20 and 74): the layers call it where the library has AVX-512 (cpu_native.silu_and_mul). */
int llmd_silu_mul_bf16(const uint16_t *x, uint16_t *out, int64_t rows, int64_t inter, int nthreads) {
    if (inter % 8) return -1;
#pragma omp parallel for schedule(static) num_threads(threads_for(rows, nthreads))
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = x + r * 2 * inter, *u = g + inter;
        uint16_t *o = out + r * inter;
        int64_t d = 0;
#if defined(__AVX512F__)
        for (; d + 16 <= inter; d += 16) {
            const __m512 act = v16_round_bf16(v16_silu(v16_load_bf16(g + d)));
            _mm256_storeu_si256((__m256i *)(o + d), v16_to_bf16_bits(_mm512_mul_ps(act, v16_load_bf16(u + d))));
        }
#endif
        for (; d < inter; d += 8)
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
