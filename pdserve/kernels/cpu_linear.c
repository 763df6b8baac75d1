/* Matrix products for the CPU with float32 weights in panels: y[M, N] = x[M, K] @ W[N, K]^T
 * (+ bias). The weight-only quantized products are in cpu_quant.c.
 *
 * Decode multiplies a few activation rows by every weight, so its speed is the speed at which
 * the weights stream from memory: the panels are read once, front to back, by as many threads
 * as torch has, which is what takes a single-row product to the machine's read bandwidth (torch's
 * own kernels reach half of it). With many rows (prefill) the same tiles are compute-bound.
 * Written with GCC's portable vector types of the CPU's register width (vec.h: V floats, a
 * panel's 16 lanes in 16 / V of them).
 *
 * Layout: the weight is stored in panels of 16 output channels, so one vector load gives one k
 * for 16 channels, and the PANELS panels of a block (64 channels) side by side, k-major: a
 * block is one stream from memory (as the quantized layouts are; four streams, one per panel,
 * read 10% slower at one row). A thread takes whole blocks and walks k once per group of up to
 * MR activation rows: each k's weight vectors are loaded once and multiplied by every row's
 * broadcast x[m, k] into MR x PANELS accumulators (no horizontal sums). N is padded with zero
 * channels to whole blocks.
 *
 * Block b, k, panel h, lane j = W[64b + 16h + j, k]; an optional bias per output channel.
 * Threads come from the OpenMP runtime torch already loaded (the same soname), so they follow
 * torch.set_num_threads.
 */
#include <omp.h>
#include <stdlib.h>

#include "kernels.h"
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

/* rows x[m0 .. m0 + mr) against panels [p0, p0 + np) of float32 weights. */
static inline __attribute__((always_inline)) void f32_tile(
    const float *x, int64_t K, const float *w, const float *bias, int64_t p0, int64_t N,
    float *y, int64_t m0, const int mr, const int np) {
    vf acc[MR][PANELS * VP];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < np * VP; j++) acc[i][j] = (vf){0};
    /* this tile's first panel in its block, at k = 0 */
    const float *wp = w + (p0 / PANELS * K * PANELS + p0 % PANELS) * PW;
    for (int64_t k = 0; k < K; k++) {
        vf wv[PANELS * VP];  /* panel j / VP, lanes V (j % VP) .. */
        for (int j = 0; j < np * VP; j++)
            wv[j] = load_f(wp + (k * PANELS + j / VP) * PW + j % VP * V);
        for (int i = 0; i < mr; i++) {
            vf xv = splat(x[(m0 + i) * K + k]);
            for (int j = 0; j < np * VP; j++) acc[i][j] += xv * wv[j];
        }
    }
    for (int j = 0; j < np * VP; j++) {
        int64_t n0 = (p0 + j / VP) * PW + j % VP * V;
        vf b = bias ? load_f(bias + n0) : (vf){0};
        for (int i = 0; i < mr; i++) store_out(y + (m0 + i) * N, n0, N, acc[i][j] + b);
    }
}

/* A block's panels in tiles for a compile-time row count, so the accumulators stay in
 * registers. */
#define BLOCK_TILES(mr, x, K, w, bias, p0, N, y, m0)                                    \
    for (int h = 0; h < PANELS; h += TILE_PANELS(mr))                                   \
        f32_tile(x, K, w, bias, (p0) + h, N, y, m0, mr, TILE_PANELS(mr))

#define DISPATCH(mr, ...)                            \
    switch (mr) {                                    \
    case 1: BLOCK_TILES(1, __VA_ARGS__); break;      \
    case 2: BLOCK_TILES(2, __VA_ARGS__); break;      \
    case 3: BLOCK_TILES(3, __VA_ARGS__); break;      \
    case 4: BLOCK_TILES(4, __VA_ARGS__); break;      \
    case 5: BLOCK_TILES(5, __VA_ARGS__); break;      \
    default: BLOCK_TILES(6, __VA_ARGS__); break;     \
    }

/* w (and bias, if not NULL) hold N rounded up to whole blocks of PANELS panels; y[M, N] gets
 * the first N channels. */
int pd_f32_linear(const float *x, int64_t M, int64_t K, const float *w, const float *bias,
                  int64_t N, float *y) {
    int64_t blocks = (N + PANELS * PW - 1) / (PANELS * PW);
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            int mr = (int)(M - m0 < MR ? M - m0 : MR);
            DISPATCH(mr, x, K, w, bias, b * PANELS, N, y, m0)
        }
    return 0;
}
