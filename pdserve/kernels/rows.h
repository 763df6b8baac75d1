/* A decoder layer's per-token operations, one row at a time: what the fused decode step
 * (cpu_decode.c) runs for its few rows and the layer kernels (cpu_layer.c) spread over the
 * threads for a prefill's many. Float32, in vectors of the CPU's width (vec.h). */
#ifndef PD_ROWS_H
#define PD_ROWS_H

#include <math.h>

#include "vec.h"

/* out[i] = x[i] / sqrt(mean(x^2) + eps) * w[i] over n values (out may be x). */
static inline void rmsnorm_row(const float *x, const float *w, int64_t n, float eps, float *out) {
    vf acc = {0};
    int64_t i = 0;
    for (; i + V <= n; i += V) {
        vf v = load_f(x + i);
        acc += v * v;
    }
    float ss = hsum(acc);
    for (; i < n; i++) ss += x[i] * x[i];
    const float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (i = 0; i + V <= n; i += V) store_f(out + i, load_f(x + i) * r * load_f(w + i));
    for (; i < n; i++) out[i] = x[i] * r * w[i];
}

/* Rotate-half rotary embedding of one head in place: pairs (i, i + d/2) by the angle whose
 * cosines and sines are c[i], s[i]. */
static inline void rotate_row(float *v, const float *c, const float *s, int64_t d) {
    const int64_t h = d / 2;
    int64_t i = 0;
    for (; i + V <= h; i += V) {
        const vf x1 = load_f(v + i), x2 = load_f(v + i + h), cv = load_f(c + i), sv = load_f(s + i);
        store_f(v + i, x1 * cv - x2 * sv);
        store_f(v + i + h, x2 * cv + x1 * sv);
    }
    for (; i < h; i++) {
        const float x1 = v[i], x2 = v[i + h];
        v[i] = x1 * c[i] - x2 * s[i];
        v[i + h] = x2 * c[i] + x1 * s[i];
    }
}

/* The gated MLP's activation: out[i] = silu(g[i]) * u[i], silu(g) = g * sigmoid(g), the
 * sigmoid from e^-|g| so that no exponential overflows. */
static inline void silu_mul_row(const float *g, const float *u, int64_t n, float *out) {
    int64_t i = 0;
    for (; i + V <= n; i += V) {
        const vf x = load_f(g + i);
        const vi neg = x < 0.0f;
        const vf ax = (vf)((vi)x & 0x7fffffff); /* |x|: the sign bit cleared */
        const vf e = exp_neg(-ax);
        const vf one = splat(1.0f);
        const vf num = (vf)(((vi)one & ~neg) | ((vi)e & neg)); /* x >= 0: 1, x < 0: e */
        store_f(out + i, x * num / (one + e) * load_f(u + i));
    }
    for (; i < n; i++) out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

#endif
