/* CPU kernels for llmdeploy, built at first use by kernels/native_build.py (gcc -O3 -march=native -fopenmp, one
 * compiler process a source) into one library and called through ctypes. No torch headers. OpenMP comes from the
 * libgomp torch already loaded (same soname), so these loops share torch's thread pool instead of starting a second
 * one. This file: what the build can do, and the settings read at load. The kernels:
 *   decode_attention.c   paged decode attention, K/V read in place
 *   prefill_attention*.c paged prefill attention (bf16: AVX-512 BF16; float32: AVX2 + FMA)
 *   linear_avx512.c      float32 and bf16 linears on packed weights (AVX-512); amx_linear.c: bf16 on AMX tiles;
 *                        f32_linear_avx2.c: float32 on AVX2
 *   q_linear.c           GGUF block-quantized linears (float32 and VNNI; q_linear_avx2.c on AVX2)
 *   fused_ops.c          RMSNorm + residual, silu * up, rotary + K/V store
 *   decode_step.c        a whole decode step in one call; argmax.c: greedy sampling
 */
#include "lanes.h"
#include "tile_groups.h"

int llmd_has_avx2(void) { return LLMD_AVX2; }

int llmd_has_avx512(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

/* rows up to which a float32 linear's later walks over a tile prefetch the next tile (f32_linear_avx2.c and
 * linear_avx512.c); 0 = never. Set once at load (llmd_tile_ahead_configure), read by every call. */
int llmd_tile_ahead_rows = 64;
int llmd_tile_ahead_configure(int rows) {
    llmd_tile_ahead_rows = rows < 0 ? 0 : rows;
    return llmd_tile_ahead_rows;
}

/* weight tiles a float32 or bfloat16 linear walks at once for a single row, and the AVX2 float32 one up to
 * llmd_side_rows rows (1 = one, with a software prefetch, as for many rows; at most 3): several streams a core keep
 * more of memory busy (tile_groups.h). Set once at load (llmd_row_streams_configure), read by every call. */
int llmd_row_streams = 3;
int llmd_row_streams_configure(int streams) {
    llmd_row_streams = streams < 1 ? 1 : streams > 3 ? 3 : streams;
    return llmd_row_streams;
}

/* rows up to which the float32 linear on AVX2 walks llmd_row_streams tiles side by side as one row does, a few rows
 * at a time (f32_linear_avx2.c rows_tiles); 0 or 1 = only one row; at most LLMD_SIDE_ROWS_MAX. Set once at load
 * (llmd_side_rows_configure; SIDE_ROWS_DEFAULT in native_build.py says why 12). */
int llmd_side_rows = 12;
int llmd_side_rows_configure(int rows) {
    llmd_side_rows = rows < 0 ? 0 : rows > LLMD_SIDE_ROWS_MAX ? LLMD_SIDE_ROWS_MAX : rows;
    return llmd_side_rows;
}
