/* A row's cache lines to L1 or L2. asm volatile: gcc 12's dead-code pass dropped loops of _mm_prefetch with nothing
 * else in them (no prefetch instruction left in decode_attention_avx512.c's object at -O1 and above, 1.4x the time
 * from memory), so every kernel that prefetches a row does it here. */
#ifndef LLMD_PREFETCH_H
#define LLMD_PREFETCH_H
#include <stdint.h>
static inline void prefetch_l1(const void *row, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __asm__ volatile("prefetcht0 %0" : : "m"(((const char *)row)[o]));
}
static inline void prefetch_l2(const void *row, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __asm__ volatile("prefetcht1 %0" : : "m"(((const char *)row)[o]));
}
#endif
