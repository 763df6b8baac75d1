/* Weight-only quantized matrix products for the CPU: y[M, N] = x[M, K] @ dequant(W)[N, K]^T.
 *
 * Decode multiplies a few activation rows by every weight, so its speed is the speed at which
 * the weights stream from memory; int8 and int4 weights move a quarter and an eighth of the
 * bytes of float32. Written with GCC's portable vector types (16 floats), which the compiler
 * lowers to the widest vectors of the CPU it builds on (-march=native).
 *
 * Layout: the weight is stored in panels of 16 output channels, k-major within a panel, so one
 * vector load gives one k for 16 channels. A thread takes PANELS panels (64 channels) and walks
 * k once per group of up to MR activation rows: each k's weight vectors are converted once and
 * multiplied by every row's broadcast x[m, k] into MR x PANELS accumulators (no horizontal
 * sums). N is padded with zero channels to whole blocks of PANELS panels.
 *
 * int8: panel p, k, lane j = q[16p + j, k] (signed); a float scale per output channel.
 * int4: symmetric, a scale per group of G input features (a multiple of 32, at most 512); K is
 *       padded with zeros to whole groups; byte (p, k/2, j) holds channel 16p + j at k (low
 *       nibble) and at k + 1 (high nibble), each as v + 8; scales are laid out [panel][group][16].
 * Threads come from the OpenMP runtime torch already loaded (the same soname), so they follow
 * torch.set_num_threads.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define V 16

typedef float vf __attribute__((vector_size(4 * V)));
typedef int32_t vi __attribute__((vector_size(4 * V)));
typedef int8_t vb __attribute__((vector_size(V)));
typedef uint8_t vu __attribute__((vector_size(V)));

static inline vf load_f(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline vb load_b(const int8_t *p) { vb v; memcpy(&v, p, sizeof v); return v; }
static inline vu load_u(const uint8_t *p) { vu v; memcpy(&v, p, sizeof v); return v; }
static inline void store_f(float *p, vf v) { memcpy(p, &v, sizeof v); }
static inline vf splat(float s) { return (vf){0} + s; }
static inline int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

/* 16 int8 (or 16 uint8) as 16 floats. GCC lowers this widening conversion to scalar code, so
 * where the CPU has them it is spelled with the x86 sign/zero-extension instructions. */
#if defined(__AVX512F__)
#include <immintrin.h>
static inline vf int8_f(const int8_t *p) {
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline vf uint8_f(vu b) { return (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32((__m128i)b)); }
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
static inline vf uint8_f(vu v) {
    __m128i b = (__m128i)v;
    return halves(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)),
                  _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8))));
}
#else
static inline vf int8_f(const int8_t *p) {
    vb b = load_b(p);
    vf v;
    for (int i = 0; i < V; i++) v[i] = (float)b[i];
    return v;
}
static inline vf uint8_f(vu b) {
    vf v;
    for (int i = 0; i < V; i++) v[i] = (float)b[i];
    return v;
}
#endif

#define PANELS 4
#define MR 6

static inline void store_out(float *y, int64_t n0, int64_t N, vf v) {
    if (n0 + V <= N) {
        store_f(y + n0, v);
        return;
    }
    for (int64_t j = 0; n0 + j < N; j++) y[n0 + j] = v[j];
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

/* q holds N rounded up to whole blocks of PANELS panels; y[M, N] gets the first N channels. */
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
