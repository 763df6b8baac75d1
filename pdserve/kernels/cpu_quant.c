/* Matrix products with weight-only quantized weights and 8-bit activations:
 * y[M, N] = x[M, K] @ W[N, K]^T, W int8 (a scale per output channel) or int4 (a scale and a
 * minimum per group of G input features).
 *
 * Widening every 4- or 8-bit weight to a float before a float multiply-add costs more
 * instructions than the weight's bytes take to arrive: such a kernel is compute-bound at a
 * fraction of the read bandwidth. So the activations are quantized too, per row in blocks of 32
 * input features (a scale each, symmetric, 8 bits: the error of llama.cpp's Q8_0), and the
 * products are integer dot products of 4 bytes: `vpdpbusd` (AVX-512 VNNI: 64 multiply-adds per
 * instruction) where the CPU has it, `vpmaddubsw` + `vpmaddwd` (AVX2: pairs of byte products
 * to 16 bits, then pairs of those to 32) where it has AVX2 only, the same integer arithmetic
 * in portable vector code elsewhere (all give the same integers). Per block b of 32 inputs
 * and output channel n:
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
 * So one 64-byte load (two of 32 bytes with AVX2) gives each of 16 lanes the 4 consecutive bytes
 * `vpdpbusd` multiplies by one broadcast quad of activations.
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

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PD_VNNI 1
#elif defined(__AVX2__) && V == 8 /* AVX-512 without VNNI keeps the portable code, as before */
#define PD_AVX2_DOT 1
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

#ifdef PD_AVX2_DOT
/* AVX2 has no 4-byte dot product: `vpmaddubsw` multiplies unsigned bytes by signed ones and adds
 * adjacent pairs into 16 bits (saturating), `vpmaddwd` by ones adds adjacent pairs of those into
 * each 32-bit lane: the same 4-byte sums per lane as `vpdpbusd`, as long as no pair passes
 * 32767. */
static inline vi pairs(__m256i u, __m256i s) {
    return (vi)_mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

/* int4's 8 inputs a lane (codes lo for inputs 0-3 with x0, hi for 4-7 with x1) added to 16-bit
 * pair sums: a block's QB / 8 octets make QB / 4 = 8 byte-pair products of at most 2 x 15 x 128
 * = 3840 each, 30720 in all, within int16; `widen` then adds the pairs into 32 bits once per
 * block instead of once per product (`vpmaddwd` by ones: a quarter of them). */
typedef int16_t vs __attribute__((vector_size(32)));
_Static_assert(QB / 4 * 2 * 15 * 128 <= 32767, "int4 pair sums of a block must fit int16");
static inline vs dot8_int4(vs acc, vi lo, vi hi, int32_t x0, int32_t x1) {
    return acc + (vs)_mm256_maddubs_epi16((__m256i)lo, _mm256_set1_epi32(x0))
               + (vs)_mm256_maddubs_epi16((__m256i)hi, _mm256_set1_epi32(x1));
}
static inline vi widen(vs acc) {
    return (vi)_mm256_madd_epi16((__m256i)acc, _mm256_set1_epi16(1));
}

/* For int8's codes (w + 128, up to 255) a pair could reach 2 x 255 x 127 and saturate, so this
 * computes the dot product of the centred weights (w, in -127..127) instead: |x| times w with
 * x's sign, each pair at most 2 x 127 x 127. It leaves out the code offset's share,
 * 128 x sum x, which the int8 kernel then does not subtract (INT8_OFFSET). */
static inline vi dot4_centred(vi acc, vi w, int32_t x4) {
    const __m256i x = _mm256_set1_epi32(x4);
    const __m256i centred = _mm256_xor_si256((__m256i)w, _mm256_set1_epi8((char)0x80));
    return acc + pairs(_mm256_abs_epi8(x), _mm256_sign_epi8(centred, x));
}
#define INT8_OFFSET 0
#else
#define dot4_centred dot4
#define INT8_OFFSET 128 /* dot4 sums code x x: take the offset's 128 x sum x back out */
typedef vi vs; /* 32-bit sums throughout */
static inline vs dot8_int4(vs acc, vi lo, vi hi, int32_t x0, int32_t x1) {
    return dot4(dot4(acc, lo, x0), hi, x1);
}
static inline vi widen(vs acc) { return acc; }
#endif

static inline vi load_i(const void *p) { vi v; memcpy(&v, p, sizeof v); return v; }

/* V IEEE half floats as floats. */
#if defined(__AVX512F__)
static inline vf load_half(const uint16_t *p) {
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
#elif defined(__F16C__) && V == 8
static inline vf load_half(const uint16_t *p) {
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
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
#elif defined(__AVX2__)
    if (n == QB) {
        const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
        __m256 v[4], m = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(x + 8 * i);
            m = _mm256_max_ps(m, _mm256_and_ps(v[i], absmask));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
        float amax = _mm_cvtss_f32(m4);
        __m256 inv = _mm256_set1_ps(amax > 0 ? 127.f / amax : 0.f), lim = _mm256_set1_ps(127.f);
        __m256i iv[4], s8 = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {  /* as the AVX-512 path: clamp, then round half to even */
            __m256 r = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(v[i], inv), -lim), lim);
            iv[i] = _mm256_cvtps_epi32(r);
            s8 = _mm256_add_epi32(s8, iv[i]);
        }
        /* 32 int32 in -127..127 to bytes: the packs work within 128-bit lanes, so the result's
         * 4-byte groups come out in the order 0 2 4 6 1 3 5 7, which the permute undoes */
        __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]),
                                       _mm256_packs_epi32(iv[2], iv[3]));
        b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)q, b);
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
        *sum = _mm_cvtsi128_si32(s4);
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
 * minimum). Index j of the vectors is panel j / VP, lanes V (j % VP) ..: a panel's 16 lanes in
 * VP vectors. */
static inline __attribute__((always_inline)) void int4_tile(
    const acts_t *a, int64_t G, const uint8_t *q, const uint16_t *scale, int64_t p0, int64_t N,
    float *y, int64_t m0, const int mr, const int np) {
    const int64_t Kp = a->kp, nb = a->blocks, groups = Kp / G, octets = Kp / 8;
    const int64_t h = p0 % PANELS;  /* the tile's first panel within its block */
    const int64_t per_group = G / QB;
    const uint8_t *qp = q + (p0 - h) * octets * 64 + h * 64;
    const uint16_t *sp = scale + (p0 - h) * groups * 2 * PW + h * PW;
    vf acc[MR][PANELS * VP];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < np * VP; j++) acc[i][j] = (vf){0};
    for (int64_t g = 0; g < groups; g++) {
        vf sw[PANELS * VP], mw[PANELS * VP];
        for (int j = 0; j < np * VP; j++) {
            sw[j] = load_half(sp + (g * 2 * PANELS + j / VP) * PW + j % VP * V);
            mw[j] = load_half(sp + ((g * 2 + 1) * PANELS + j / VP) * PW + j % VP * V);
        }
        for (int64_t b = g * per_group; b < (g + 1) * per_group; b++) {
            vs dot[MR][PANELS * VP];
            for (int i = 0; i < mr; i++)
                for (int j = 0; j < np * VP; j++) dot[i][j] = (vs){0};
            for (int64_t c = b * (QB / 8); c < (b + 1) * (QB / 8); c++) {
                vi lo[PANELS * VP], hi[PANELS * VP];
                for (int j = 0; j < np * VP; j++) {
                    vi w = load_i(qp + (c * PANELS + j / VP) * 64 + j % VP * 4 * V);
                    lo[j] = w & 0x0F0F0F0F;
                    hi[j] = (w >> 4) & 0x0F0F0F0F;
                }
                for (int i = 0; i < mr; i++) {
                    const int8_t *xq = a->q + (m0 + i) * Kp + 8 * c;
                    int32_t x0 = quad(xq), x1 = quad(xq + 4);
                    for (int j = 0; j < np * VP; j++)
                        dot[i][j] = dot8_int4(dot[i][j], lo[j], hi[j], x0, x1);
                }
            }
            for (int i = 0; i < mr; i++) {
                float sx = a->scale[(m0 + i) * nb + b];
                vf xsum = splat(sx * (float)a->corr[(m0 + i) * nb + b]);  /* sx * sum_k xq */
                for (int j = 0; j < np * VP; j++)
                    acc[i][j] += __builtin_convertvector(widen(dot[i][j]), vf) * (sw[j] * sx)
                                 + mw[j] * xsum;
            }
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < np * VP; j++)
            store_out(y + (m0 + i) * N, (p0 + j / VP) * PW + j % VP * V, N, acc[i][j]);
}

/* Rows m0 .. m0 + mr against panels p0 .. p0 + np of int8 weights (a scale per channel). */
static inline __attribute__((always_inline)) void int8_tile(
    const acts_t *a, const uint8_t *q, const float *scale, int64_t p0, int64_t N, float *y,
    int64_t m0, const int mr, const int np) {
    const int64_t Kp = a->kp, nb = a->blocks, quads = Kp / 4;
    const int64_t h = p0 % PANELS;
    const uint8_t *qp = q + (p0 - h) * quads * 64 + h * 64;
    vf acc[MR][PANELS * VP];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < np * VP; j++) acc[i][j] = (vf){0};
    for (int64_t b = 0; b < nb; b++) {
        vi dot[MR][PANELS * VP];
        for (int i = 0; i < mr; i++)
            for (int j = 0; j < np * VP; j++) dot[i][j] = (vi){0};
        for (int64_t c = b * (QB / 4); c < (b + 1) * (QB / 4); c++) {
            vi w[PANELS * VP];
            for (int j = 0; j < np * VP; j++)
                w[j] = load_i(qp + (c * PANELS + j / VP) * 64 + j % VP * 4 * V);
            for (int i = 0; i < mr; i++) {
                int32_t x4 = quad(a->q + (m0 + i) * Kp + 4 * c);
                for (int j = 0; j < np * VP; j++) dot[i][j] = dot4_centred(dot[i][j], w[j], x4);
            }
        }
        for (int i = 0; i < mr; i++) {
            vf sx = splat(a->scale[(m0 + i) * nb + b]);
            int32_t corr = a->corr[(m0 + i) * nb + b];
            for (int j = 0; j < np * VP; j++)
                acc[i][j] += __builtin_convertvector(dot[i][j] - corr, vf) * sx;
        }
    }
    for (int j = 0; j < np * VP; j++) {
        const int64_t n0 = (p0 + j / VP) * PW + j % VP * V;
        vf s = load_f(scale + n0);
        for (int i = 0; i < mr; i++) store_out(y + (m0 + i) * N, n0, N, acc[i][j] * s);
    }
}

/* A tile for compile-time row and panel counts, so its accumulators stay in registers. With
 * AVX-512 (one register per panel), narrow: all PANELS panels for one or two rows, two at a
 * time for more (the integer and float accumulators of 4 rows x 4 panels would not fit in 32
 * registers), so a block is walked twice, each pass reading every other pair of its lines;
 * wide: all PANELS panels for any row count, one pass over the block, the float accumulators
 * left to the compiler to keep where it can (they change once per block of QB inputs). Wide is
 * what a few rows want, where the weights' bytes decide (the int8 and int4 chains of a decode
 * step 1.27-1.45x as fast at 3-8 rows on a Zen 5); narrow is int8's choice for many rows,
 * where the products are bound by compute (wide measured 0.90x at 256 rows; int4, whose tile
 * does more arithmetic per byte, gained at every row count up to 256). With narrower vectors
 * (two or four registers per panel, 16 registers): two panels for one row, one for more, in
 * both. */
#if V == 16
#define NP_NARROW(mr) ((mr) <= 2 ? PANELS : 2)
#define NP_WIDE(mr) PANELS
#else
#define NP_NARROW(mr) ((mr) == 1 ? 4 : (mr) == 2 ? 2 : 1)
#define NP_WIDE(mr) NP_NARROW(mr)
#endif
#define INT8_WIDE_ROWS 32 /* int8 products of up to this many rows take wide tiles */
#define BLOCK_TILES(tile, mr, np, p0, ...)                                              \
    for (int h2 = 0; h2 < PANELS; h2 += np)                                             \
        tile(__VA_ARGS__, (p0) + h2, N, y, m0, mr, np)
#define TILES_NP(tile, mr, NP, p0, ...)                                 \
    switch (mr) {                                                       \
    case 1: BLOCK_TILES(tile, 1, NP(1), p0, __VA_ARGS__); break;        \
    case 2: BLOCK_TILES(tile, 2, NP(2), p0, __VA_ARGS__); break;        \
    case 3: BLOCK_TILES(tile, 3, NP(3), p0, __VA_ARGS__); break;        \
    default: BLOCK_TILES(tile, 4, NP(4), p0, __VA_ARGS__); break;       \
    }
#define TILES(tile, mr, wide, p0, ...)                          \
    do {                                                        \
        if (wide) TILES_NP(tile, mr, NP_WIDE, p0, __VA_ARGS__)  \
        else TILES_NP(tile, mr, NP_NARROW, p0, __VA_ARGS__)     \
    } while (0)

int pd_int4_linear(const float *x, int64_t M, int64_t K, const uint8_t *q, const uint16_t *scale,
                   int64_t N, int64_t G, float *y) {
    if (G % QB != 0 || G > 512) return -2;
    int64_t Kp = round_up(K, G), blocks = (N + PANELS * PW - 1) / (PANELS * PW);
    acts_t a;
    int rc = quantize_acts(x, M, K, Kp, 1, &a);  /* corr: the plain sum, for the minima */
    if (rc == 0) {
#pragma omp parallel for schedule(PD_SCHEDULE)
        for (int64_t b = 0; b < blocks; b++)
            for (int64_t m0 = 0; m0 < M; m0 += MR) {
                int mr = (int)(M - m0 < MR ? M - m0 : MR);
                TILES(int4_tile, mr, 1, b * PANELS, &a, G, q, scale);
            }
    }
    free_acts(&a);
    return rc;
}

int pd_int8_linear(const float *x, int64_t M, int64_t K, const uint8_t *q, const float *scale,
                   int64_t N, float *y) {
    int64_t Kp = round_up(K, QB), blocks = (N + PANELS * PW - 1) / (PANELS * PW);
    const int wide = M <= INT8_WIDE_ROWS;
    acts_t a;
    int rc = quantize_acts(x, M, K, Kp, INT8_OFFSET, &a);
    if (rc == 0) {
#pragma omp parallel for schedule(PD_SCHEDULE)
        for (int64_t b = 0; b < blocks; b++)
            for (int64_t m0 = 0; m0 < M; m0 += MR) {
                int mr = (int)(M - m0 < MR ? M - m0 : MR);
                TILES(int8_tile, mr, wide, b * PANELS, &a, q, scale);
            }
    }
    free_acts(&a);
    return rc;
}
