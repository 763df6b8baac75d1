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
 * Layout: the weight in blocks of 64 output channels (tile.h; four streams, one per panel, read
 * 10% slower at one row than a block's one). A thread takes whole blocks and walks k once per
 * group of up to MR activation rows (tile.h's register tile). N is padded with zero channels to
 * whole blocks, and an optional bias per output channel is padded the same way.
 * Threads come from the OpenMP runtime torch already loaded (the same soname), so they follow
 * torch.set_num_threads.
 */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "tile.h"
#include "vec.h"

/* Between one tile of rows and many, a block's tiles take turns on the same weights: the first
 * reads them from memory, the others from the cache, and while those compute, memory idles (at
 * 30 rows, a decode batch, the chain of a step's products ran at 20 GB/s and 310 GFLOP/s, where
 * either alone allows 40 and 470). For up to SLAB_ROWS rows, each block is walked in slices of
 * SLAB_K values of k instead: every tile of rows takes a slice while it is in L1, adding into
 * the block's sums (a [M][64] buffer per thread), and prefetches part of the next slice, so
 * that memory streams while the tiles compute (without the prefetch, slices were slower than
 * the tiles in turn: the hardware prefetcher does not run a slice ahead). */
#define SLAB_ROWS 64
#define SLAB_K 64

static int f32_linear_slabs(const float *x, int64_t M, int64_t K, const float *w,
                            const float *bias, int64_t N, float *y, int64_t blocks) {
    const int64_t bw = PANELS * PW;
    int failed = 0;
#pragma omp parallel
    {
        float *c = malloc(sizeof(float) * (size_t)(M * bw));
        if (!c) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            if (!c) continue;
            const float *wb = w + b * K * bw;
            memset(c, 0, sizeof(float) * (size_t)(M * bw));
            for (int64_t k0 = 0; k0 < K; k0 += SLAB_K) {
                const int64_t kc = K - k0 < SLAB_K ? K - k0 : SLAB_K;
                /* the next slice: the rest of this block, else the next block's first */
                const float *next = k0 + SLAB_K < K ? wb + (k0 + SLAB_K) * bw
                                  : b + 1 < blocks ? wb + K * bw : NULL;
                /* tile t of T prefetches lines t, t + T, ... of each k of the next slice */
                const int tiles = (int)((M + MR - 1) / MR);
                for (int64_t m0 = 0; m0 < M; m0 += MR) {
                    int mr = (int)(M - m0 < MR ? M - m0 : MR);
                    TILE_ROWS_ACC(mr, x + k0, K, kc, wb + k0 * bw, next, (int)(m0 / MR), tiles,
                                  c, bw, m0)
                }
            }
            for (int64_t m = 0; m < M; m++)
                for (int64_t n0 = 0; n0 < bw; n0 += V) {
                    vf v = load_f(c + m * bw + n0);
                    if (bias) v += load_f(bias + b * bw + n0);
                    store_out(y + m * N, b * bw + n0, N, v);
                }
        }
        free(c);
    }
    return failed ? -1 : 0;
}

/* Up to MR rows (one tile per block, bound by memory) each k also prefetches the weights PF_K
 * values of k ahead in the thread's stream (16 KiB; past a block's end, the next block's
 * start): with the hardware prefetcher alone the step's chain streamed slower (kernel_ab with
 * 64: 1.09x and 1.17x at one row in two runs, 1.27x at six; 16 gave 1.00x at one row, 128
 * 1.19x with a p10 under 1). */
#define PF_K 64

/* Block b for one activation row: the loop in which batch-1 decode spends its time, in a
 * function of its own, aligned, so that where it lies in the code does not move with the rest
 * of the library (on an Intel Xeon, edits elsewhere in the library moved it and the product
 * chain's speed by 2-3%, with this file unchanged). */
__attribute__((noinline, aligned(64))) static void f32_row_block(
    const float *x, int64_t K, const float *w, const float *bias, int64_t b, int64_t N, float *y) {
    BLOCK_TILES(1, x, K, K, w, bias, b * PANELS, N, y, N, 0, PF_K);
}

/* w (and bias, if not NULL) hold N rounded up to whole blocks of PANELS panels; y[M, N] gets
 * the first N channels. Returns -1 when out of memory. */
int pd_f32_linear(const float *x, int64_t M, int64_t K, const float *w, const float *bias,
                  int64_t N, float *y) {
    int64_t blocks = (N + PANELS * PW - 1) / (PANELS * PW);
    if (M > MR && M <= SLAB_ROWS) return f32_linear_slabs(x, M, K, w, bias, N, y, blocks);
    if (M == 1) {
#pragma omp parallel for schedule(static)
        for (int64_t b = 0; b < blocks; b++) f32_row_block(x, K, w, bias, b, N, y);
        return 0;
    }
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            int mr = (int)(M - m0 < MR ? M - m0 : MR);
            if (M <= MR) /* pf_k a constant in each instance, not a test per k */
                TILE_ROWS(mr, x, K, K, w, bias, b * PANELS, N, y, N, m0, PF_K)
            else
                TILE_ROWS(mr, x, K, K, w, bias, b * PANELS, N, y, N, m0, 0)
        }
    return 0;
}
