/* The LM head's screen for greedy decode: a Q8 copy for a few rows, a float32 head's bf16 copy for more
 * (head_screen.c). */
#ifndef LLMD_HEAD_SCREEN_H
#define LLMD_HEAD_SCREEN_H
#include <stdint.h>

typedef struct {
    const uint8_t *q8; /* the head's weights as Q8 blocks in llmd_q_linear's layout (llmd_q_pack, vnni = 0) */
    const float *c_x1; /* per vocabulary row: how far its screened logit can be from the exact one, per sum |x| */
    int64_t max_tiles; /* more candidate tiles than this (a row's): the caller computes the whole head */
    /* NULL, or a float32 head's weights rounded to bf16 (subnormals flushed), packed by llmd_bf16_pack: the screen
     * of more rows (bf16 products, twice float32's a cycle, where the Q8 ones are float32 products) */
    const uint16_t *bf16;
    const float *c_l2; /* with bf16, per vocabulary row [A, B]: |exact - screened| <= A |x|_2 + B |x - bf16(x)|_2 */
} llmd_head_screen;

int llmd_head_screen_takes(const llmd_head_screen *s, int act_bf16, int64_t M);

int llmd_head_screen_argmax(const llmd_head_screen *s, int act_bf16, const void *head_w, int64_t V, int64_t K,
                            const void *x, int64_t M, int64_t *best, int64_t *tiles_read, int nthreads);
#endif
