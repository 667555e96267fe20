/* Rows per pass over a float32 weight, in both float32 linears (linear_avx512.c, f32_linear_avx2.c): a prefill
 * step's 2048 rows of activations (4.7 MB at 576 inputs) streamed from L3 again for every 32-channel tile ran the
 * AVX2 kernel at 136-153 GFLOP/s on Zen 2; 512 rows at a time, the weight read 4 times instead (from L3 where it
 * fits), 157-165 (256 rows: 158-163, 1024: 157-159). Calls of up to 512 rows are unchanged. */
#ifndef LLMD_ROW_CHUNK_H
#define LLMD_ROW_CHUNK_H
#define LLMD_ROW_CHUNK 512
#endif
