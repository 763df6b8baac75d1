/* Matrix products for the CPU with the weights in panels: y[M, N] = x[M, K] @ W[N, K]^T, W
 * float32 or weight-only quantized (int8, int4).
 *
 * Decode multiplies a few activation rows by every weight, so its speed is the speed at which
 * the weights stream from memory: the panels are read once, front to back, by as many threads
 * as torch has, which is what takes a single-row product to the machine's read bandwidth (torch's
 * own kernels reach half of it); int8 and int4 weights move a quarter and an eighth of the bytes
 * of float32. With many rows (prefill) the same tiles are compute-bound. Written with GCC's portable vector types (16 floats), which the compiler
 * lowers to the widest vectors of the CPU it builds on (-march=native).
 *
 * Layout: the weight is stored in panels of 16 output channels, k-major within a panel, so one
 * vector load gives one k for 16 channels. A thread takes PANELS panels (64 channels) and walks
 * k once per group of up to MR activation rows: each k's weight vectors are converted once and
 * multiplied by every row's broadcast x[m, k] into MR x PANELS accumulators (no horizontal
 * sums). N is padded with zero channels to whole blocks of PANELS panels.
 *
 * float32: panel p, k, lane j = W[16p + j, k]; an optional bias per output channel.
 * int8: panel p, k, lane j = q[16p + j, k] (signed); a float scale per output channel.
 * int4: symmetric, a scale per group of G input features (a multiple of 32, at most 512); K is
 *       padded with zeros to whole groups; byte (p, k/2, j) holds channel 16p + j at k (low
 *       nibble) and at k + 1 (high nibble), each as v + 8; scales are laid out [panel][group][16].
 * Threads come from the OpenMP runtime torch already loaded (the same soname), so they follow
 * torch.set_num_threads.
 */
#include <omp.h>
#include <stdlib.h>

#include "kernels.h"
#include "vec.h"

#define PANELS 4
#define MR 6

static inline void store_out(float *y, int64_t n0, int64_t N, vf v) {
    if (n0 + V <= N) {
        store_f(y + n0, v);
        return;
    }
    for (int64_t j = 0; n0 + j < N; j++) y[n0 + j] = v[j];
}

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

/* rows x[m0 .. m0 + mr) against panels [p0, p0 + PANELS) of int8 weights. */
static inline __attribute__((always_inline)) void int8_tile(
    const float *x, int64_t K, const int8_t *q, const float *scale, int64_t p0, int64_t N,
    float *y, int64_t m0, const int mr) {
    vf acc[MR][PANELS];
    for (int i = 0; i < mr; i++)
        for (int p = 0; p < PANELS; p++) acc[i][p] = (vf){0};
    const int8_t *qp = q + p0 * K * V;
    for (int64_t k = 0; k < K; k++) {
        vf w[PANELS];
        for (int p = 0; p < PANELS; p++) w[p] = int8_f(qp + (p * K + k) * V);
        for (int i = 0; i < mr; i++) {
            vf xv = splat(x[(m0 + i) * K + k]);
            for (int p = 0; p < PANELS; p++) acc[i][p] += xv * w[p];
        }
    }
    for (int p = 0; p < PANELS; p++) {
        int64_t n0 = (p0 + p) * V;
        vf s = load_f(scale + n0);
        for (int i = 0; i < mr; i++) store_out(y + (m0 + i) * N, n0, N, acc[i][p] * s);
    }
}

/* rows x[m0 .. m0 + mr) (padded to Kp) against panels [p0, p0 + PANELS) of int4 weights. */
static inline __attribute__((always_inline)) void int4_tile(
    const float *x, int64_t Kp, int64_t G, const uint8_t *q, const float *scale, int64_t p0,
    int64_t N, float *y, int64_t m0, const int mr) {
    vf acc[MR][PANELS];
    for (int i = 0; i < mr; i++)
        for (int p = 0; p < PANELS; p++) acc[i][p] = (vf){0};
    int64_t groups = Kp / G;
    const uint8_t *qp = q + p0 * (Kp / 2) * V;
    const float *sp = scale + p0 * groups * V;
    for (int64_t g = 0; g < groups; g++) {
        vf s[PANELS], bias[PANELS];
        for (int p = 0; p < PANELS; p++) {
            s[p] = load_f(sp + (p * groups + g) * V);
            bias[p] = s[p] * -8.f;
        }
        for (int64_t k = g * G; k < (g + 1) * G; k += 2) {
            vf lo[PANELS], hi[PANELS];
            for (int p = 0; p < PANELS; p++) {
                vu b = load_u(qp + (p * (Kp / 2) + k / 2) * V);
                lo[p] = uint8_f(b & 15) * s[p] + bias[p];
                hi[p] = uint8_f(b >> 4) * s[p] + bias[p];
            }
            for (int i = 0; i < mr; i++) {
                vf x0 = splat(x[(m0 + i) * Kp + k]), x1 = splat(x[(m0 + i) * Kp + k + 1]);
                for (int p = 0; p < PANELS; p++) acc[i][p] += x0 * lo[p] + x1 * hi[p];
            }
        }
    }
    for (int p = 0; p < PANELS; p++)
        for (int i = 0; i < mr; i++) store_out(y + (m0 + i) * N, (p0 + p) * V, N, acc[i][p]);
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
 * the first N channels. So do q and scale below. */
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

int pd_int8_linear(const float *x, int64_t M, int64_t K, const int8_t *q, const float *scale,
                   int64_t N, float *y) {
    int64_t blocks = (N + PANELS * V - 1) / (PANELS * V);
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            int mr = (int)(M - m0 < MR ? M - m0 : MR);
            DISPATCH(int8_tile, mr, x, K, q, scale, b * PANELS, N, y, m0)
        }
    return 0;
}

int pd_int4_linear(const float *x, int64_t M, int64_t K, const uint8_t *q, const float *scale,
                   int64_t N, int64_t G, float *y) {
    if (G % (2 * V) != 0 || G > 512) return -2;
    int64_t Kp = (K + G - 1) / G * G, blocks = (N + PANELS * V - 1) / (PANELS * V);
    const float *xp = x;
    float *padded = NULL;
    if (Kp != K) {
        padded = aligned_alloc(64, sizeof(float) * round_up(M * Kp, V));
        if (!padded) return -1;
        for (int64_t m = 0; m < M; m++) {
            memcpy(padded + m * Kp, x + m * K, sizeof(float) * K);
            memset(padded + m * Kp + K, 0, sizeof(float) * (Kp - K));
        }
        xp = padded;
    }
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            int mr = (int)(M - m0 < MR ? M - m0 : MR);
            DISPATCH(int4_tile, mr, xp, Kp, G, q, scale, b * PANELS, N, y, m0)
        }
    free(padded);
    return 0;
}
