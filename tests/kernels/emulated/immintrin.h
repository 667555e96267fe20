/* immintrin.h for the emulated build (tests/kernels/test_avx512_emulated.py): every x86 intrinsic the kernels use,
 * AVX-512 F/BW/VL/VNNI/BF16 included, from SIMDe (Debian's libsimde-dev) in portable C, so the AVX-512 code paths
 * run, slowly, on any CPU and a session on an AVX2-only machine still tests them. The functions below are the ones
 * SIMDe 0.7.4 lacks, written lane by lane from Intel's definitions; _mm512_roundscale_ps replaces SIMDe's, which
 * reads imm8 0x09 (round down, no exceptions) as round-to-nearest. AMX stays off: SIMDe has no tiles. */
#ifndef SHIM_IMMINTRIN_H
#define SHIM_IMMINTRIN_H
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <simde/x86/fma.h>
#include <simde/x86/f16c.h>
#include <string.h>
#include <math.h>
#include <stdint.h>
typedef simde__m512bh __m512bh;
typedef simde__m256bh __m256bh;
typedef simde__mmask16 __mmask16;
typedef simde__mmask8 __mmask8;
typedef simde__mmask32 __mmask32;
#define _MM_FROUND_NO_EXC SIMDE_MM_FROUND_NO_EXC
#define _MM_FROUND_TO_NEAREST_INT SIMDE_MM_FROUND_TO_NEAREST_INT
#define _MM_FROUND_TO_NEG_INF SIMDE_MM_FROUND_TO_NEG_INF
#define _MM_FROUND_TO_ZERO SIMDE_MM_FROUND_TO_ZERO
#define SHIM_F(name) static inline __attribute__((unused)) name
SHIM_F(simde__m512) _mm512_cvtepi32_ps(simde__m512i a) { int32_t x[16]; float y[16]; memcpy(x, &a, 64); for (int i = 0; i < 16; i++) y[i] = (float)x[i]; simde__m512 r; memcpy(&r, y, 64); return r; }
SHIM_F(simde__m512i) _mm512_cvtps_epi32(simde__m512 a) { float x[16]; int32_t y[16]; memcpy(x, &a, 64); for (int i = 0; i < 16; i++) y[i] = (int32_t)nearbyintf(x[i]); simde__m512i r; memcpy(&r, y, 64); return r; }
SHIM_F(simde__m512i) _mm512_cvtepi8_epi32(simde__m128i a) { int8_t x[16]; int32_t y[16]; memcpy(x, &a, 16); for (int i = 0; i < 16; i++) y[i] = x[i]; simde__m512i r; memcpy(&r, y, 64); return r; }
SHIM_F(simde__m512i) _mm512_cvtepu8_epi32(simde__m128i a) { uint8_t x[16]; int32_t y[16]; memcpy(x, &a, 16); for (int i = 0; i < 16; i++) y[i] = x[i]; simde__m512i r; memcpy(&r, y, 64); return r; }
SHIM_F(simde__m512i) _mm512_cvtepu16_epi32(simde__m256i a) { uint16_t x[16]; int32_t y[16]; memcpy(x, &a, 32); for (int i = 0; i < 16; i++) y[i] = x[i]; simde__m512i r; memcpy(&r, y, 64); return r; }
static inline uint16_t shim_bf16(float f) { uint32_t u; memcpy(&u, &f, 4); if ((u & 0x7f800000u) == 0) u &= 0x80000000u; if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16); }
SHIM_F(simde__m256bh) _mm512_cvtneps_pbh(simde__m512 a) { float x[16]; uint16_t y[16]; memcpy(x, &a, 64); for (int i = 0; i < 16; i++) y[i] = shim_bf16(x[i]); simde__m256bh r; memcpy(&r, y, 32); return r; }
static inline float shim_half(uint16_t h) { uint32_t s = (h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, u; if (e == 0) { float f = ldexpf((float)m, -24); return s ? -f : f; } if (e == 31) u = s | 0x7f800000u | (m << 13); else u = s | ((e + 112) << 23) | (m << 13); float f; memcpy(&f, &u, 4); return f; }
SHIM_F(simde__m512) _mm512_cvtph_ps(simde__m256i a) { uint16_t x[16]; float y[16]; memcpy(x, &a, 32); for (int i = 0; i < 16; i++) y[i] = shim_half(x[i]); simde__m512 r; memcpy(&r, y, 64); return r; }
SHIM_F(void) _mm512_mask_storeu_ps(void *p, simde__mmask16 k, simde__m512 a) { float x[16]; memcpy(x, &a, 64); for (int i = 0; i < 16; i++) if (k >> i & 1) ((float *)p)[i] = x[i]; }
SHIM_F(simde__m512) _mm512_maskz_loadu_ps(simde__mmask16 k, const void *p) { float y[16]; for (int i = 0; i < 16; i++) y[i] = (k >> i & 1) ? ((const float *)p)[i] : 0.0f; simde__m512 r; memcpy(&r, y, 64); return r; }
SHIM_F(void) _mm256_mask_storeu_epi16(void *p, simde__mmask16 k, simde__m256i a) { uint16_t x[16]; memcpy(x, &a, 32); for (int i = 0; i < 16; i++) if (k >> i & 1) ((uint16_t *)p)[i] = x[i]; }
SHIM_F(int) _mm512_reduce_add_epi32(simde__m512i a) { int32_t x[16]; memcpy(x, &a, 64); int s = 0; for (int i = 0; i < 16; i++) s += x[i]; return s; }
SHIM_F(float) _mm512_reduce_add_ps(simde__m512 a) { float x[16]; memcpy(x, &a, 64); for (int w = 8; w; w >>= 1) for (int i = 0; i < w; i++) x[i] += x[i + w]; return x[0]; }
SHIM_F(float) _mm512_reduce_max_ps(simde__m512 a) { float x[16]; memcpy(x, &a, 64); float m = x[0]; for (int i = 1; i < 16; i++) m = x[i] > m ? x[i] : m; return m; }
#undef _mm512_roundscale_ps
/* SIMDe 0.7.4 reads imm8 0x09 (to -inf, no exceptions) wrongly; scale bits are 0 everywhere here */
SHIM_F(simde__m512) _mm512_roundscale_ps(simde__m512 a, int imm) { float x[16]; memcpy(x, &a, 64); for (int i = 0; i < 16; i++) { switch (imm & 3) { case 0: x[i] = nearbyintf(x[i]); break; case 1: x[i] = floorf(x[i]); break; case 2: x[i] = ceilf(x[i]); break; default: x[i] = truncf(x[i]); } } simde__m512 r; memcpy(&r, x, 64); return r; }
#endif
