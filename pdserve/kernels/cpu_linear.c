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

#include "kernels.h"
#include "tile.h"
#include "vec.h"

/* w (and bias, if not NULL) hold N rounded up to whole blocks of PANELS panels; y[M, N] gets
 * the first N channels. */
int pd_f32_linear(const float *x, int64_t M, int64_t K, const float *w, const float *bias,
                  int64_t N, float *y) {
    int64_t blocks = (N + PANELS * PW - 1) / (PANELS * PW);
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            int mr = (int)(M - m0 < MR ? M - m0 : MR);
            TILE_ROWS(mr, x, K, K, w, bias, b * PANELS, N, y, N, m0)
        }
    return 0;
}
