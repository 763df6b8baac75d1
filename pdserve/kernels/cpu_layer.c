/* A decoder layer's per-token operations over many rows (a prefill step's), spread over
 * torch's threads: RMSNorm, the rotary embedding in place, the gated MLP's activation. torch
 * runs each as several passes over memory (RMSNorm: the square, the mean, the scale, the
 * weight) and the activation over a strided view of the gate/up product, which it does not
 * vectorize; here each is one pass per row (rows.h). */
#include <omp.h>

#include "kernels.h"
#include "rows.h"

int pd_rms_norm(const float *x, int64_t m, int64_t n, const float *w, float eps, float *out) {
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < m; t++) rmsnorm_row(x + t * n, w, n, eps, out + t * n);
    return 0;
}

int pd_rope(float *x, int64_t m, int64_t stride, int64_t heads, int64_t d, const float *cos,
            const float *sin) {
    if (d % 2) return -2;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < m; t++)
        for (int64_t j = 0; j < heads; j++)
            rotate_row(x + t * stride + j * d, cos + t * (d / 2), sin + t * (d / 2), d);
    return 0;
}

int pd_silu_mul(const float *gu, int64_t m, int64_t n, float *out) {
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < m; t++)
        silu_mul_row(gu + t * 2 * n, gu + t * 2 * n + n, n, out + t * n);
    return 0;
}
