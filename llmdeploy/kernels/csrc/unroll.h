/* Loops over a micro-kernel's rows (a compile-time count once the kernel is inlined) are unrolled whole. Without
 * it gcc 12 keeps the accumulator arrays in memory and stores every accumulator to the stack on each iteration of
 * the inner loop: one store per FMA, seen in the assembly of every row-blocked kernel here (at -march=native on
 * Zen 2 and at -march=sapphirerapids), which cost the AVX2 float32 linear a third of its speed. */
#ifndef LLMD_UNROLL_H
#define LLMD_UNROLL_H
#define ROWS_UNROLLED _Pragma("GCC unroll 16")
#endif
