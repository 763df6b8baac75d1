/* Matrix products with weight-only quantized weights and 8-bit activations:
 * y[M, N] = x[M, K] @ W[N, K]^T, W int8 (a scale per output channel) or int4 (a scale and a
 * minimum per group of G input features).
 *
 * Widening every 4- or 8-bit weight to a float before a float multiply-add costs more
 * instructions than the weight's bytes take to arrive: such a kernel is compute-bound at a
 * fraction of the read bandwidth. So the activations are quantized too, per row in blocks of 32
 * input features (a scale each, symmetric, 8 bits: the error of llama.cpp's Q8_0), and the
 * products are integer dot products of 4 bytes: `vpdpbusd` (AVX-512 VNNI: 64 multiply-adds per
 * instruction) where the CPU has it, the same integer arithmetic in portable vector code where
 * it does not (both give the same integers). Per block b of 32 inputs and output channel n:
 *   int8: y[m, n] += sx[m, b] * sw[n] * (sum_k code[n, k] * xq[m, k] - 128 * sum_k xq[m, k])
 *   int4: y[m, n] += sx[m, b] * (sw[n, g] * sum_k code[n, k] * xq[m, k]
 *                                + mw[n, g] * sum_k xq[m, k])
 * where int8's code = w + 128 is the weight stored unsigned, since the instruction multiplies
 * unsigned bytes by signed ones, and int4's w = code * sw + mw with code 0..15 (the group's scale
 * and minimum; g the group of block b). The torch reference of the same arithmetic is
 * `pdserve.models.quant_linear` (`quantize_activations`, `dequantize_*`).
 *
 * Layouts: output channels in panels of 16 and panels in blocks of PANELS (N padded to whole
 * blocks with zero weights; a thread takes whole blocks), K padded with zero weights to whole
 * blocks of 32, and to whole groups for int4. Within a block the panels are interleaved, so a
 * thread reads its weights as one stream, front to back (four streams of a few kilobytes each,
 * one per panel, kept the hardware prefetcher from reaching the bandwidth at one row).
 *   int8: block B, quad c, panel p, lane j, byte t = code of W[16(PANELS B + p) + j, 4c + t]
 *         (w + 128); one float scale per output channel.
 *   int4: block B, octet c, panel p, lane j, byte t: low nibble = code of W[n, 8c + t], high
 *         nibble = code of W[n, 8c + 4 + t] for n = 16(PANELS B + p) + j; scales and minima as
 *         IEEE half floats (as Q4_1's: 4 bytes per group, a fifth of what a group of 32 reads
 *         in all), laid out [block][group][scale, minimum][panel][16].
 * So one 64-byte load gives each of 16 lanes the 4 consecutive bytes `vpdpbusd` multiplies by
 * one broadcast quad of activations.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "kernels.h"
#include "vec.h"

#define QB 32     /* activation block: input features per activation scale */
#define PANELS 4  /* panels per thread's block of channels, as cpu_linear.c */
#define MR 4      /* activation rows per tile */
/* Blocks go to threads guided: a large contiguous share first (one stream, as static), then
 * smaller pieces to whichever thread is free, so a thread slowed by another process on its core
 * holds the product up less (measured: as fast as static on a quiet machine, up to 10% faster
 * on a busy one; dynamic was 10-30% slower on a quiet one). */
#define PD_SCHEDULE guided

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PD_VNNI 1
#endif

/* acc + the dot products of each lane's 4 unsigned bytes of w with the 4 signed bytes of x4. */
static inline vi dot4(vi acc, vi w, int32_t x4) {
#ifdef PD_VNNI
    return (vi)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)w, _mm512_set1_epi32(x4));
#else
    int8_t x[4];
    memcpy(x, &x4, 4);
    for (int t = 0; t < 4; t++) acc += ((w >> (8 * t)) & 255) * (int32_t)x[t];
    return acc;
#endif
}

static inline vi load_i(const void *p) { vi v; memcpy(&v, p, sizeof v); return v; }

/* 16 IEEE half floats as floats. */
#if defined(__AVX512F__)
static inline vf load_half(const uint16_t *p) {
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
#else
static inline float half_f(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 31, m = h & 1023, bits;
    if (e == 31) bits = sign | 0x7f800000 | (m << 13);  /* inf, NaN */
    else if (e) bits = sign | ((e + 112) << 23) | (m << 13);
    else if (!m) bits = sign;
    else {  /* subnormal: normalize */
        e = 113;
        while (!(m & 1024)) { m <<= 1; e--; }
        bits = sign | (e << 23) | ((m & 1023) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
static inline vf load_half(const uint16_t *p) {
    vf v;
    for (int i = 0; i < V; i++) v[i] = half_f(p[i]);
    return v;
}
#endif
static inline int32_t quad(const int8_t *p) { int32_t v; memcpy(&v, p, 4); return v; }

int pd_vnni(void) {
#ifdef PD_VNNI
    return 1;
#else
    return 0;
#endif
}

/* The activations of a product, quantized: q[M, Kp], and per row and block of QB inputs its
 * scale and `offset` times the sum of its values (int8: 128, the code offset's share of the dot
 * product; int4: 1, the sum its minima multiply). One allocation holds all three. */
typedef struct {
    int8_t *q;
    float *scale;
    int32_t *corr;
    int64_t kp, blocks;
    void *mem;
} acts_t;

/* One block of QB inputs (n of them real, the rest zeros) to 8 bits: its scale, and the sum of
 * its values. Round half to even, as torch.round; the float operations of quantize_activations
 * in quant_linear.py, in the same order, so the results are the same bits. */
static inline float quantize_block(const float *x, int64_t n, int8_t *q, int32_t *sum) {
#if defined(__AVX512F__)
    if (n == QB) {
        __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        __m512 inv = _mm512_set1_ps(amax > 0 ? 127.f / amax : 0.f);
        __m512 lim = _mm512_set1_ps(127.f);
        /* cvtps rounds half to even (the default MXCSR mode); clamp before it, as below */
        __m512i ia = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(a, inv),
                                                                    -lim), lim));  /* fmt */
        __m512i ib = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(b, inv),
                                                                    -lim), lim));
        _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(ia));
        _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(ib));
        *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(ia, ib));
        return amax / 127.f;
    }
#endif
    float amax = 0;
    for (int64_t k = 0; k < n; k++) amax = fmaxf(amax, fabsf(x[k]));
    float inv = amax > 0 ? 127.f / amax : 0.f;
    int32_t s = 0;
    for (int64_t k = 0; k < QB; k++) {
        float r = k < n ? nearbyintf(x[k] * inv) : 0.f;
        int32_t v = r > 127.f ? 127 : r < -127.f ? -127 : (int32_t)r;  /* NaN -> -127 */
        q[k] = (int8_t)v;
        s += v;
    }
    *sum = s;
    return amax / 127.f;
}

static int quantize_acts(const float *x, int64_t M, int64_t K, int64_t Kp, int32_t offset,
                         acts_t *a) {
    int64_t nb = Kp / QB, qbytes = round_up(M * Kp, 64);
    a->kp = Kp;
    a->blocks = nb;
    a->mem = aligned_alloc(64, qbytes + round_up(8 * M * nb, 64));
    if (!a->mem) return -1;
    a->q = a->mem;
    a->scale = (float *)((char *)a->mem + qbytes);
    a->corr = (int32_t *)(a->scale + M * nb);
#pragma omp parallel for schedule(static) if (M * K >= 32768)
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < nb; b++) {
            int64_t k0 = b * QB, n = k0 + QB < K ? QB : (K > k0 ? K - k0 : 0);
            int32_t sum;
            a->scale[m * nb + b] = quantize_block(x + m * K + k0, n, a->q + m * Kp + k0, &sum);
            a->corr[m * nb + b] = sum * offset;
        }
    return 0;
}

static void free_acts(acts_t *a) { free(a->mem); }

/* Rows m0 .. m0 + mr against panels p0 .. p0 + np of int4 weights (G inputs per scale and
 * minimum). */
static inline __attribute__((always_inline)) void int4_tile(
    const acts_t *a, int64_t G, const uint8_t *q, const uint16_t *scale, int64_t p0, int64_t N,
    float *y, int64_t m0, const int mr, const int np) {
    const int64_t Kp = a->kp, nb = a->blocks, groups = Kp / G, octets = Kp / 8;
    const int64_t h = p0 % PANELS;  /* the tile's first panel within its block */
    const int64_t per_group = G / QB;
    const uint8_t *qp = q + (p0 - h) * octets * 64 + h * 64;
    const uint16_t *sp = scale + (p0 - h) * groups * 2 * V + h * V;
    vf acc[MR][PANELS];
    for (int i = 0; i < mr; i++)
        for (int p = 0; p < np; p++) acc[i][p] = (vf){0};
    for (int64_t g = 0; g < groups; g++) {
        vf sw[PANELS], mw[PANELS];
        for (int p = 0; p < np; p++) {
            sw[p] = load_half(sp + (g * 2 * PANELS + p) * V);
            mw[p] = load_half(sp + ((g * 2 + 1) * PANELS + p) * V);
        }
        for (int64_t b = g * per_group; b < (g + 1) * per_group; b++) {
            vi dot[MR][PANELS];
            for (int i = 0; i < mr; i++)
                for (int p = 0; p < np; p++) dot[i][p] = (vi){0};
            for (int64_t c = b * (QB / 8); c < (b + 1) * (QB / 8); c++) {
                vi lo[PANELS], hi[PANELS];
                for (int p = 0; p < np; p++) {
                    vi w = load_i(qp + (c * PANELS + p) * 64);
                    lo[p] = w & 0x0F0F0F0F;
                    hi[p] = (w >> 4) & 0x0F0F0F0F;
                }
                for (int i = 0; i < mr; i++) {
                    const int8_t *xq = a->q + (m0 + i) * Kp + 8 * c;
                    int32_t x0 = quad(xq), x1 = quad(xq + 4);
                    for (int p = 0; p < np; p++)
                        dot[i][p] = dot4(dot4(dot[i][p], lo[p], x0), hi[p], x1);
                }
            }
            for (int i = 0; i < mr; i++) {
                float sx = a->scale[(m0 + i) * nb + b];
                vf xsum = splat(sx * (float)a->corr[(m0 + i) * nb + b]);  /* sx * sum_k xq */
                for (int p = 0; p < np; p++)
                    acc[i][p] += __builtin_convertvector(dot[i][p], vf) * (sw[p] * sx)
                                 + mw[p] * xsum;
            }
        }
    }
    for (int i = 0; i < mr; i++)
        for (int p = 0; p < np; p++) store_out(y + (m0 + i) * N, (p0 + p) * V, N, acc[i][p]);
}

/* Rows m0 .. m0 + mr against panels p0 .. p0 + np of int8 weights (a scale per channel). */
static inline __attribute__((always_inline)) void int8_tile(
    const acts_t *a, const uint8_t *q, const float *scale, int64_t p0, int64_t N, float *y,
    int64_t m0, const int mr, const int np) {
    const int64_t Kp = a->kp, nb = a->blocks, quads = Kp / 4;
    const int64_t h = p0 % PANELS;
    const uint8_t *qp = q + (p0 - h) * quads * 64 + h * 64;
    vf acc[MR][PANELS];
    for (int i = 0; i < mr; i++)
        for (int p = 0; p < np; p++) acc[i][p] = (vf){0};
    for (int64_t b = 0; b < nb; b++) {
        vi dot[MR][PANELS];
        for (int i = 0; i < mr; i++)
            for (int p = 0; p < np; p++) dot[i][p] = (vi){0};
        for (int64_t c = b * (QB / 4); c < (b + 1) * (QB / 4); c++) {
            vi w[PANELS];
            for (int p = 0; p < np; p++) w[p] = load_i(qp + (c * PANELS + p) * 64);
            for (int i = 0; i < mr; i++) {
                int32_t x4 = quad(a->q + (m0 + i) * Kp + 4 * c);
                for (int p = 0; p < np; p++) dot[i][p] = dot4(dot[i][p], w[p], x4);
            }
        }
        for (int i = 0; i < mr; i++) {
            vf sx = splat(a->scale[(m0 + i) * nb + b]);
            int32_t corr = a->corr[(m0 + i) * nb + b];
            for (int p = 0; p < np; p++)
                acc[i][p] += __builtin_convertvector(dot[i][p] - corr, vf) * sx;
        }
    }
    for (int p = 0; p < np; p++) {
        vf s = load_f(scale + (p0 + p) * V);
        for (int i = 0; i < mr; i++) store_out(y + (m0 + i) * N, (p0 + p) * V, N, acc[i][p] * s);
    }
}

/* A tile for compile-time row and panel counts, so its accumulators stay in registers: all
 * PANELS panels for one or two rows (decode: more streams in flight), two at a time for more
 * rows (accumulators for 4 rows x 4 panels, int and float, would not fit in 32 registers). */
#define TILES(tile, mr, p0, ...)                                                        \
    switch (mr) {                                                                       \
    case 1: tile(__VA_ARGS__, p0, N, y, m0, 1, PANELS); break;                          \
    case 2: tile(__VA_ARGS__, p0, N, y, m0, 2, PANELS); break;                          \
    case 3: for (int h2 = 0; h2 < PANELS; h2 += 2) tile(__VA_ARGS__, p0 + h2, N, y, m0, 3, 2); break; \
    default: for (int h2 = 0; h2 < PANELS; h2 += 2) tile(__VA_ARGS__, p0 + h2, N, y, m0, 4, 2); break; \
    }

int pd_int4_linear(const float *x, int64_t M, int64_t K, const uint8_t *q, const uint16_t *scale,
                   int64_t N, int64_t G, float *y) {
    if (G % QB != 0 || G > 512) return -2;
    int64_t Kp = round_up(K, G), blocks = (N + PANELS * V - 1) / (PANELS * V);
    acts_t a;
    int rc = quantize_acts(x, M, K, Kp, 1, &a);  /* corr: the plain sum, for the minima */
    if (rc == 0) {
#pragma omp parallel for schedule(PD_SCHEDULE)
        for (int64_t b = 0; b < blocks; b++)
            for (int64_t m0 = 0; m0 < M; m0 += MR) {
                int mr = (int)(M - m0 < MR ? M - m0 : MR);
                TILES(int4_tile, mr, b * PANELS, &a, G, q, scale)
            }
    }
    free_acts(&a);
    return rc;
}

int pd_int8_linear(const float *x, int64_t M, int64_t K, const uint8_t *q, const float *scale,
                   int64_t N, float *y) {
    int64_t Kp = round_up(K, QB), blocks = (N + PANELS * V - 1) / (PANELS * V);
    acts_t a;
    int rc = quantize_acts(x, M, K, Kp, 128, &a);
    if (rc == 0) {
#pragma omp parallel for schedule(PD_SCHEDULE)
        for (int64_t b = 0; b < blocks; b++)
            for (int64_t m0 = 0; m0 < M; m0 += MR) {
                int mr = (int)(M - m0 < MR ? M - m0 : MR);
                TILES(int8_tile, mr, b * PANELS, &a, q, scale)
            }
    }
    free_acts(&a);
    return rc;
}
