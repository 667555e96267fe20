/* immintrin.h for the emulated build (tests/kernels/test_avx512_emulated.py): every x86 intrinsic the kernels use,
 * AVX-512 F/BW/VL/VNNI/BF16 included, from SIMDe (Debian's libsimde-dev) in portable C, so the AVX-512 code paths
 * run, slowly, on any CPU and a session on an AVX2-only machine still tests them. The functions below are the ones
 * SIMDe 0.7.4 lacks, written lane by lane from Intel's definitions; _mm512_roundscale_ps replaces SIMDe's, which
 * reads imm8 0x09 (round down, no exceptions) as round-to-nearest. AMX's tiles, which SIMDe lacks, are in
 * amx_tiles.h. */
#ifndef SHIM_IMMINTRIN_H
#define SHIM_IMMINTRIN_H
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <simde/x86/fma.h>
#include <simde/x86/f16c.h>
#include <string.h>
#include <math.h>
#include <stdint.h>
#include "amx_tiles.h"
typedef simde__m512bh __m512bh;
typedef simde__m256bh __m256bh;
typedef simde__mmask16 __mmask16;
typedef simde__mmask8 __mmask8;
typedef simde__mmask32 __mmask32;
#define _MM_FROUND_NO_EXC SIMDE_MM_FROUND_NO_EXC
#define _MM_FROUND_TO_NEAREST_INT SIMDE_MM_FROUND_TO_NEAREST_INT
#define _MM_FROUND_TO_NEG_INF SIMDE_MM_FROUND_TO_NEG_INF
#define _MM_FROUND_TO_ZERO SIMDE_MM_FROUND_TO_ZERO
/* out lane i = EXPR(in lane i) over 16 lanes: the conversions SIMDe lacks */
#define LANEWISE(NAME, OUT_V, OUT_T, IN_V, IN_T, EXPR)                                                            \
    static inline __attribute__((unused)) OUT_V NAME(IN_V a) {                                                   \
        IN_T x[16];                                                                                              \
        OUT_T y[16];                                                                                             \
        memcpy(x, &a, sizeof x);                                                                                 \
        for (int i = 0; i < 16; i++) y[i] = EXPR(x[i]);                                                          \
        OUT_V r;                                                                                                 \
        memcpy(&r, y, sizeof y);                                                                                 \
        return r;                                                                                                \
    }

/* float32 -> bf16, round to nearest even, denormals flushed (vcvtneps2bf16), NaN kept quiet */
static inline uint16_t shim_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) == 0) u &= 0x80000000u;
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float shim_half(uint16_t h) { /* IEEE binary16 -> float32, exact */
    const uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ffu;
    if (e == 0) return (sign ? -1.0f : 1.0f) * ldexpf((float)m, -24);
    const uint32_t u = sign | (e == 31 ? 0x7f800000u : (e + 112) << 23) | (m << 13);
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#define AS_FLOAT(v) ((float)(v))
#define AS_INT(v) ((int32_t)(v))
#define LOW16(v) ((int16_t)(v)) /* VPMOVDW: each lane's low 16 bits, no saturation */
#define ROUND_INT(v) ((int32_t)nearbyintf(v))
LANEWISE(_mm512_cvtepi32_ps, simde__m512, float, simde__m512i, int32_t, AS_FLOAT)
LANEWISE(_mm512_cvtps_epi32, simde__m512i, int32_t, simde__m512, float, ROUND_INT)
LANEWISE(_mm512_cvtepi8_epi32, simde__m512i, int32_t, simde__m128i, int8_t, AS_INT)
LANEWISE(_mm512_cvtepu8_epi32, simde__m512i, int32_t, simde__m128i, uint8_t, AS_INT)
LANEWISE(_mm512_cvtepu16_epi32, simde__m512i, int32_t, simde__m256i, uint16_t, AS_INT)
LANEWISE(_mm512_cvtepi32_epi16, simde__m256i, int16_t, simde__m512i, int32_t, LOW16)
LANEWISE(_mm512_cvtneps_pbh, simde__m256bh, uint16_t, simde__m512, float, shim_bf16)
LANEWISE(_mm512_cvtph_ps, simde__m512, float, simde__m256i, uint16_t, shim_half)

static inline __attribute__((unused)) void _mm512_mask_storeu_ps(void *p, simde__mmask16 k, simde__m512 a) {
    float x[16];
    memcpy(x, &a, sizeof x);
    for (int i = 0; i < 16; i++)
        if (k >> i & 1) ((float *)p)[i] = x[i];
}

static inline __attribute__((unused)) void _mm256_mask_storeu_epi16(void *p, simde__mmask16 k, simde__m256i a) {
    uint16_t x[16];
    memcpy(x, &a, sizeof x);
    for (int i = 0; i < 16; i++)
        if (k >> i & 1) ((uint16_t *)p)[i] = x[i];
}

static inline __attribute__((unused)) simde__m512 _mm512_maskz_loadu_ps(simde__mmask16 k, const void *p) {
    float y[16]; /* masked-off lanes are not read: the kernels load row tails this way */
    for (int i = 0; i < 16; i++) y[i] = (k >> i & 1) ? ((const float *)p)[i] : 0.0f;
    simde__m512 r;
    memcpy(&r, y, sizeof y);
    return r;
}

static inline __attribute__((unused)) int _mm512_reduce_add_epi32(simde__m512i a) {
    int32_t x[16];
    memcpy(x, &a, sizeof x);
    int s = 0;
    for (int i = 0; i < 16; i++) s += x[i];
    return s;
}

static inline __attribute__((unused)) float _mm512_reduce_add_ps(simde__m512 a) { /* halves folded, as gcc's */
    float x[16];
    memcpy(x, &a, sizeof x);
    for (int w = 8; w; w >>= 1)
        for (int i = 0; i < w; i++) x[i] += x[i + w];
    return x[0];
}

static inline __attribute__((unused)) float _mm512_reduce_max_ps(simde__m512 a) {
    float x[16];
    memcpy(x, &a, sizeof x);
    float m = x[0];
    for (int i = 1; i < 16; i++) m = x[i] > m ? x[i] : m;
    return m;
}

/* SIMDe 0.7.4 rounds imm8 0x09 (round down, no exceptions) to nearest; the kernels use scale 0 only */
#undef _mm512_roundscale_ps
static inline __attribute__((unused)) simde__m512 _mm512_roundscale_ps(simde__m512 a, int imm) {
    float x[16];
    memcpy(x, &a, sizeof x);
    for (int i = 0; i < 16; i++) {
        const int mode = imm & 3;
        x[i] = mode == 0 ? nearbyintf(x[i]) : mode == 1 ? floorf(x[i]) : mode == 2 ? ceilf(x[i]) : truncf(x[i]);
    }
    simde__m512 r;
    memcpy(&r, x, sizeof x);
    return r;
}
#endif
