/* Matrix products for the CPU with float32 weights in panels: y[M, N] = x[M, K] @ W[N, K]^T
 * (+ bias). The weight-only quantized products are in cpu_quant.c.
 *
 * Decode multiplies a few activation rows by every weight, so its speed is the speed at which
 * the weights stream from memory: the panels are read once, front to back, by as many threads
 * as torch has, which is what takes a single-row product to the machine's read bandwidth (torch's
 * own kernels reach half of it). With many rows (prefill) the same tiles are compute-bound.
 * Written with GCC's portable vector types (16 floats), which the compiler lowers to the widest
 * vectors of the CPU it builds on (-march=native).
 *
 * Layout: the weight is stored in panels of 16 output channels, k-major within a panel, so one
 * vector load gives one k for 16 channels. A thread takes PANELS panels (64 channels) and walks
 * k once per group of up to MR activation rows: each k's weight vectors are loaded once and
 * multiplied by every row's broadcast x[m, k] into MR x PANELS accumulators (no horizontal
 * sums). N is padded with zero channels to whole blocks of PANELS panels.
 *
 * Panel p, k, lane j = W[16p + j, k]; an optional bias per output channel.
 * Threads come from the OpenMP runtime torch already loaded (the same soname), so they follow
 * torch.set_num_threads.
 */
#include <omp.h>
#include <stdlib.h>

#include "kernels.h"
#include "vec.h"

#define PANELS 4
#define MR 6

/* rows x[m0 .. m0 + mr) against panels [p0, p0 + PANELS) of float32 weights. */
static inline __attribute__((always_inline)) void f32_tile(
    const float *x, int64_t K, const float *w, const float *bias, int64_t p0, int64_t N,
    float *y, int64_t m0, const int mr) {
    vf acc[MR][PANELS];
    for (int i = 0; i < mr; i++)
        for (int p = 0; p < PANELS; p++) acc[i][p] = (vf){0};
    const float *wp = w + p0 * K * V;
    for (int64_t k = 0; k < K; k++) {
        vf wv[PANELS];
        for (int p = 0; p < PANELS; p++) wv[p] = load_f(wp + (p * K + k) * V);
        for (int i = 0; i < mr; i++) {
            vf xv = splat(x[(m0 + i) * K + k]);
            for (int p = 0; p < PANELS; p++) acc[i][p] += xv * wv[p];
        }
    }
    for (int p = 0; p < PANELS; p++) {
        int64_t n0 = (p0 + p) * V;
        vf b = bias ? load_f(bias + n0) : (vf){0};
        for (int i = 0; i < mr; i++) store_out(y + (m0 + i) * N, n0, N, acc[i][p] + b);
    }
}

/* The tile for a compile-time row count, so its accumulators stay in registers. */
#define DISPATCH(tile, mr, ...)          \
    switch (mr) {                        \
    case 1: tile(__VA_ARGS__, 1); break; \
    case 2: tile(__VA_ARGS__, 2); break; \
    case 3: tile(__VA_ARGS__, 3); break; \
    case 4: tile(__VA_ARGS__, 4); break; \
    case 5: tile(__VA_ARGS__, 5); break; \
    default: tile(__VA_ARGS__, 6); break; \
    }

/* w (and bias, if not NULL) hold N rounded up to whole blocks of PANELS panels; y[M, N] gets
 * the first N channels. */
int pd_f32_linear(const float *x, int64_t M, int64_t K, const float *w, const float *bias,
                  int64_t N, float *y) {
    int64_t blocks = (N + PANELS * V - 1) / (PANELS * V);
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            int mr = (int)(M - m0 < MR ? M - m0 : MR);
            DISPATCH(f32_tile, mr, x, K, w, bias, b * PANELS, N, y, m0)
        }
    return 0;
}
