/* The float32 register tile every compute-bound product shares: y[m, n] = x[m, :] . W[n, :]
 * (+ bias) for up to MR rows of x against a block's panels of W. The matrix products
 * (cpu_linear.c) run it over weights, prefill attention (cpu_attention.c) over a context's keys
 * (the scores) and its values (the outputs), both packed into the same layout.
 *
 * Layout of W: panels of PW = 16 output channels, so one vector load gives one k for 16
 * channels, and the PANELS panels of a block (64 channels) side by side, k-major: block b, k,
 * panel h, lane j = W[64b + 16h + j, k], a block one stream from memory. A tile walks k once
 * for its rows: each k's weight vectors are loaded once and multiplied by every row's broadcast
 * x[m, k] into MR x PANELS accumulators (no horizontal sums).
 */
#ifndef PD_TILE_H
#define PD_TILE_H

#include "vec.h"

#define PANELS 4
#define MR 6

/* How many of a block's panels one tile takes, so that its accumulators (mr x np panels of
 * VP vectors), the weight vectors of a k and the broadcast x fit in the registers: with AVX-512
 * (32 registers, one per panel) all 4 panels for up to 6 rows, 28 registers; with AVX (16
 * registers, two per panel) 2 panels for up to 2 rows and 1 panel (6 x 2 accumulators, 2
 * weight registers, the broadcast: the 6x16 tile of the classic AVX2 sgemm kernels) for more. */
#if V == 16
#define TILE_PANELS(mr) PANELS
#else
#define TILE_PANELS(mr) ((mr) <= 2 ? 2 : 1)
#endif

/* Rows x[m0 .. m0 + mr) (row m at x + m * ldx) against panels [p0, p0 + np) of the blocks at w
 * (K values of k each) into y (row m at y + m * ldy), the channels below N. pf_k > 0: each k
 * also prefetches the tile's weights pf_k values of k ahead (a memory-bound tile). */
static inline __attribute__((always_inline)) void f32_tile(
    const float *x, int64_t ldx, int64_t K, const float *w, const float *bias, int64_t p0,
    int64_t N, float *y, int64_t ldy, int64_t m0, const int mr, const int np,
    const int64_t pf_k) {
    vf acc[MR][PANELS * VP];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < np * VP; j++) acc[i][j] = (vf){0};
    /* this tile's first panel in its block, at k = 0 */
    const float *wp = w + (p0 / PANELS * K * PANELS + p0 % PANELS) * PW;
    for (int64_t k = 0; k < K; k++) {
        vf wv[PANELS * VP];  /* panel j / VP, lanes V (j % VP) .. */
        if (pf_k)
            for (int j = 0; j < np; j++) __builtin_prefetch(wp + ((k + pf_k) * PANELS + j) * PW);
        for (int j = 0; j < np * VP; j++)
            wv[j] = load_f(wp + (k * PANELS + j / VP) * PW + j % VP * V);
        for (int i = 0; i < mr; i++) {
            vf xv = splat(x[(m0 + i) * ldx + k]);
            for (int j = 0; j < np * VP; j++) acc[i][j] += xv * wv[j];
        }
    }
    for (int j = 0; j < np * VP; j++) {
        int64_t n0 = (p0 + j / VP) * PW + j % VP * V;
        vf b = bias ? load_f(bias + n0) : (vf){0};
        for (int i = 0; i < mr; i++) store_out(y + (m0 + i) * ldy, n0, N, acc[i][j] + b);
    }
}

/* c[m0 + i][0 .. PANELS * PW) += x[m0 + i, 0 .. K) . (the K values of k of one block's
 * panels at w), for one tile of mr rows: the accumulators come from c (row stride ldc) and go
 * back to it, so that a block's products can be summed over slices of k. With pf, each k also
 * prefetches lines pf_first, pf_first + pf_step, ... of the same k at pf (the next slice). */
static inline __attribute__((always_inline)) void f32_tile_acc(
    const float *x, int64_t ldx, int64_t K, const float *w, const float *pf, int pf_first,
    int pf_step, float *c, int64_t ldc, int64_t m0, const int mr, const int p0, const int np) {
    vf acc[MR][PANELS * VP];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < np * VP; j++)
            acc[i][j] = load_f(c + (m0 + i) * ldc + (p0 + j / VP) * PW + j % VP * V);
    const float *wp = w + p0 * PW;
    for (int64_t k = 0; k < K; k++) {
        vf wv[PANELS * VP];
        for (int l = pf_first; pf && l < PANELS; l += pf_step)
            __builtin_prefetch(pf + (k * PANELS + l) * PW);
        for (int j = 0; j < np * VP; j++)
            wv[j] = load_f(wp + (k * PANELS + j / VP) * PW + j % VP * V);
        for (int i = 0; i < mr; i++) {
            vf xv = splat(x[(m0 + i) * ldx + k]);
            for (int j = 0; j < np * VP; j++) acc[i][j] += xv * wv[j];
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < np * VP; j++)
            store_f(c + (m0 + i) * ldc + (p0 + j / VP) * PW + j % VP * V, acc[i][j]);
}

#define BLOCK_TILES_ACC(mr, x, ldx, K, w, pf, pf_first, pf_step, c, ldc, m0)           \
    for (int h = 0; h < PANELS; h += TILE_PANELS(mr))                                   \
        f32_tile_acc(x, ldx, K, w, h ? NULL : (pf), pf_first, pf_step, c, ldc, m0, mr, h, \
                     TILE_PANELS(mr))

/* A block's panels (from p0, a multiple of PANELS) in tiles for a compile-time row count, so
 * the accumulators stay in registers. */
#define BLOCK_TILES(mr, x, ldx, K, w, bias, p0, N, y, ldy, m0, pf_k)                    \
    for (int h = 0; h < PANELS; h += TILE_PANELS(mr))                                   \
        f32_tile(x, ldx, K, w, bias, (p0) + h, N, y, ldy, m0, mr, TILE_PANELS(mr), pf_k)

/* block(mr, ...) for a row count mr <= MR known only at run time: each count its own
 * instance, so the accumulators stay in registers. */
#define FOR_ROWS(block, mr, ...)                 \
    switch (mr) {                                \
    case 1: block(1, __VA_ARGS__); break;        \
    case 2: block(2, __VA_ARGS__); break;        \
    case 3: block(3, __VA_ARGS__); break;        \
    case 4: block(4, __VA_ARGS__); break;        \
    case 5: block(5, __VA_ARGS__); break;        \
    default: block(6, __VA_ARGS__); break;       \
    }
#define TILE_ROWS(mr, ...) FOR_ROWS(BLOCK_TILES, mr, __VA_ARGS__)
#define TILE_ROWS_ACC(mr, ...) FOR_ROWS(BLOCK_TILES_ACC, mr, __VA_ARGS__)

#endif
