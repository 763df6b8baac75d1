/* The vector helpers every kernel shares: V floats as one GCC vector, V the floats of one of
 * the CPU's vector registers (-march=native): 16 with AVX-512, 8 with AVX, 4 elsewhere (SSE,
 * NEON). GCC keeps a vector type wider than the machine's registers in memory, every
 * accumulator loaded and stored around each multiply-add (seen on an AVX2 machine: 16-float
 * vectors made the float32 product 2x slower at one row and 7x at 256), so the kernels compute
 * in vectors of V floats and walk the 16 lanes of a weight panel (PW, the layouts' width on
 * every machine) in PW / V of them. Unaligned loads and stores by memcpy, and the int8 -> float
 * widening spelled with the x86 instructions where the CPU has them (GCC lowers the portable
 * form to scalar code). */
#ifndef PD_VEC_H
#define PD_VEC_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define V 16
#elif defined(__AVX__)
#define V 8
#else
#define V 4
#endif
#define PW 16        /* lanes of a weight panel: output channels per panel in every layout */
#define VP (PW / V)  /* vectors per panel */

typedef float vf __attribute__((vector_size(4 * V)));
typedef int32_t vi __attribute__((vector_size(4 * V)));
typedef int8_t vb __attribute__((vector_size(V)));

static inline vf load_f(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline vb load_b(const int8_t *p) { vb v; memcpy(&v, p, sizeof v); return v; }
static inline void store_f(float *p, vf v) { memcpy(p, &v, sizeof v); }
static inline vf splat(float s) { return (vf){0} + s; }
static inline int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

/* Lanes of v to y[n0 ..], the ones below N: a panel's last channels may be padding. */
static inline void store_out(float *y, int64_t n0, int64_t N, vf v) {
    if (n0 + V <= N) {
        store_f(y + n0, v);
        return;
    }
    for (int64_t j = 0; n0 + j < N; j++) y[n0 + j] = v[j];
}

/* V int8 as V floats. */
#if defined(__AVX512F__)
#include <immintrin.h>
static inline vf int8_f(const int8_t *p) {
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
#elif defined(__AVX2__)
#include <immintrin.h>
static inline vf int8_f(const int8_t *p) {
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#else
static inline vf int8_f(const int8_t *p) {
    vb b = load_b(p);
    vf v;
    for (int i = 0; i < V; i++) v[i] = (float)b[i];
    return v;
}
#endif

/* The sum of a vector's lanes. */
#if defined(__AVX512F__)
static inline float hsum(vf v) { return _mm512_reduce_add_ps((__m512)v); }
#else
static inline float hsum(vf v) {
    float s = 0;
    for (int i = 0; i < V; i++) s += v[i];
    return s;
}
#endif

/* e^x for x <= 0 (attention scores less their maximum; -|x| for a sigmoid), V lanes at a time:
 * x = n ln2 + r with |r| <= ln2 / 2, e^r by the polynomial of Cephes' expf (relative error
 * ~1e-7), 2^n by the exponent bits. */
static inline vf exp_neg(vf x) {
    const vi low = x < -87.0f; /* lanes all ones where true: below -87, e^x is under normals */
    x = (vf)(((vi)x & ~low) | ((vi)splat(-87.0f) & low));
    const vf magic = splat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    vf n = (x * 1.44269504f + magic) - magic;
    vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vf p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    vf scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#endif
