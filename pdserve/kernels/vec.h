/* The vector helpers every kernel shares: 16 floats as one GCC vector (lowered to the widest
 * registers of the CPU built on, -march=native), unaligned loads and stores by memcpy, and the
 * int8 -> float widening spelled with the x86 instructions where the CPU has them (GCC lowers the
 * portable form to scalar code). */
#ifndef PD_VEC_H
#define PD_VEC_H

#include <stdint.h>
#include <string.h>

#define V 16

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

/* 16 int8 as 16 floats. */
#if defined(__AVX512F__)
#include <immintrin.h>
static inline vf int8_f(const int8_t *p) {
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
#elif defined(__AVX2__)
#include <immintrin.h>
static inline vf halves(__m256 lo, __m256 hi) {
    vf v;
    memcpy(&v, &lo, sizeof lo);
    memcpy((char *)&v + sizeof lo, &hi, sizeof hi);
    return v;
}
static inline vf int8_f(const int8_t *p) {
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    return halves(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)),
                  _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))));
}
#else
static inline vf int8_f(const int8_t *p) {
    vb b = load_b(p);
    vf v;
    for (int i = 0; i < V; i++) v[i] = (float)b[i];
    return v;
}
#endif

/* The sum of a vector's 16 lanes. */
#if defined(__AVX512F__)
static inline float hsum(vf v) { return _mm512_reduce_add_ps((__m512)v); }
#else
static inline float hsum(vf v) {
    float s = 0;
    for (int i = 0; i < V; i++) s += v[i];
    return s;
}
#endif

#endif
