/* Decode attention over the paged KV cache, read in place.
 *
 * Each decoding sequence has one query token per head and attends to its whole context, whose
 * keys and values lie in the cache's slots in block order. The torch path gathers a padded copy
 * of every context per layer (K and V, [batch, max_ctx, kv_heads, head_dim]) and runs SDPA over
 * it with a mask; this kernel reads each context's rows where they are, once, for all the query
 * heads that share a KV head (grouped-query attention), with no copy and no padding.
 *
 * Cache: [slots, kv_heads, W] per half (K or V); float32 rows (W = D) or int8 rows of D values
 * followed by their float32 scale (W = D + 4 bytes, `pdserve/models/kv_quant.py`).
 * Work: one task per (sequence, KV head), spread over torch's OpenMP threads. Per task and query
 * head (G of them share the KV head): its scores against every key, an exact softmax (max, exp,
 * sum), then the weighted sum of the values, all in float32. Where the head dimension is a
 * multiple of the vector width (vec.h's V) up to 128 (64 with 4-float vectors), the query and
 * the output accumulator of a head are vectors (one variant per head size; in registers up to
 * 8 vectors each) and the exponentials are vectorized; the G heads re-read the task's rows from
 * the cache (L1/L2), never from memory twice. Other head sizes take a plain
 * loop.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "kernels.h"
#include "vec.h"

/* Head sizes up to NV_MAX vectors take task_vec. */
#define NV_MAX (V >= 8 ? 128 / V : 16)

/* a . row over d values, the row float32 or int8 (then unscaled). */
static inline float dot_f(const float *a, const float *b, int64_t d) {
    vf acc = {0};
    int64_t i = 0;
    for (; i + V <= d; i += V) acc += load_f(a + i) * load_f(b + i);
    float s = hsum(acc);
    for (; i < d; i++) s += a[i] * b[i];
    return s;
}
static inline float dot_b(const float *a, const int8_t *b, int64_t d) {
    vf acc = {0};
    int64_t i = 0;
    for (; i + V <= d; i += V) acc += load_f(a + i) * int8_f(b + i);
    float s = hsum(acc);
    for (; i < d; i++) s += a[i] * (float)b[i];
    return s;
}
/* acc += p * row */
static inline void axpy_f(float *acc, float p, const float *row, int64_t d) {
    int64_t i = 0;
    vf pv = (vf){0} + p;
    for (; i + V <= d; i += V) store_f(acc + i, load_f(acc + i) + pv * load_f(row + i));
    for (; i < d; i++) acc[i] += p * row[i];
}
static inline void axpy_b(float *acc, float p, const int8_t *row, int64_t d) {
    int64_t i = 0;
    vf pv = (vf){0} + p;
    for (; i + V <= d; i += V) store_f(acc + i, load_f(acc + i) + pv * int8_f(row + i));
    for (; i < d; i++) acc[i] += p * (float)row[i];
}
static inline float row_scale(const int8_t *row, int64_t d) {
    float s;
    memcpy(&s, row + d, sizeof s);
    return s;
}

/* e^x for x <= 0 (scores minus their maximum), 16 at a time: x = n ln2 + r with |r| <= ln2 / 2,
 * e^r by the polynomial of Cephes' expf (relative error ~1e-7), 2^n by the exponent bits. */
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

/* softmax of sc[0 .. len) in place. */
static inline void softmax(float *sc, int64_t len) {
    float top = -INFINITY, sum = 0;
    for (int64_t l = 0; l < len; l++) top = sc[l] > top ? sc[l] : top;
    int64_t l = 0;
    vf acc = {0};
    for (; l + V <= len; l += V) {
        vf e = exp_neg(load_f(sc + l) - top);
        store_f(sc + l, e);
        acc += e;
    }
    sum = hsum(acc);
    for (; l < len; l++) sum += (sc[l] = expf(sc[l] - top));
    const float inv = 1.0f / sum;
    for (l = 0; l < len; l++) sc[l] *= inv;
}

/* One (sequence, KV head) task for head_dim = V * NV: each of the G query heads in turn. */
static inline __attribute__((always_inline)) void task_vec(
    const float *qs, float *os, int64_t g, int64_t d, const void *k_cache, const void *v_cache,
    int kv_int8, const int64_t *sl, int64_t len, int64_t hkv, int64_t h, float scale,
    float *sc, const int NV) {
    const int64_t width = kv_int8 ? d + 4 : d;
    for (int64_t j = 0; j < g; j++) {
        vf q[NV_MAX], acc[NV_MAX];
        for (int c = 0; c < NV; c++) q[c] = load_f(qs + j * d + c * V) * scale;
        for (int64_t l = 0; l < len; l++) {
            const int64_t row = (sl[l] * hkv + h) * width;
            vf dot = {0};
            if (kv_int8) {
                const int8_t *k = (const int8_t *)k_cache + row;
                for (int c = 0; c < NV; c++) dot += q[c] * int8_f(k + c * V);
                sc[l] = hsum(dot) * row_scale(k, d);
            } else {
                const float *k = (const float *)k_cache + row;
                for (int c = 0; c < NV; c++) dot += q[c] * load_f(k + c * V);
                sc[l] = hsum(dot);
            }
        }
        softmax(sc, len);
        for (int c = 0; c < NV; c++) acc[c] = (vf){0};
        for (int64_t l = 0; l < len; l++) {
            const int64_t row = (sl[l] * hkv + h) * width;
            if (kv_int8) {
                const int8_t *v = (const int8_t *)v_cache + row;
                const vf p = splat(sc[l] * row_scale(v, d));
                for (int c = 0; c < NV; c++) acc[c] += p * int8_f(v + c * V);
            } else {
                const float *v = (const float *)v_cache + row;
                const vf p = splat(sc[l]);
                for (int c = 0; c < NV; c++) acc[c] += p * load_f(v + c * V);
            }
        }
        for (int c = 0; c < NV; c++) store_f(os + j * d + c * V, acc[c]);
    }
}

/* Any head size: the G heads' scores in one pass over K, the weighted sum in one over V. */
static void task_any(const float *qs, float *os, int64_t g, int64_t d, const void *k_cache,
                     const void *v_cache, int kv_int8, const int64_t *sl, int64_t len,
                     int64_t hkv, int64_t h, float scale, float *scores) {
    const int64_t width = kv_int8 ? d + 4 : d;
    for (int64_t l = 0; l < len; l++) {
        const int64_t row = (sl[l] * hkv + h) * width;
        for (int64_t j = 0; j < g; j++) {
            float dot;
            if (kv_int8) {
                const int8_t *k = (const int8_t *)k_cache + row;
                dot = dot_b(qs + j * d, k, d) * row_scale(k, d);
            } else {
                dot = dot_f(qs + j * d, (const float *)k_cache + row, d);
            }
            scores[j * len + l] = dot * scale;
        }
    }
    for (int64_t j = 0; j < g; j++) {
        softmax(scores + j * len, len);
        memset(os + j * d, 0, sizeof(float) * d);
    }
    for (int64_t l = 0; l < len; l++) {
        const int64_t row = (sl[l] * hkv + h) * width;
        if (kv_int8) {
            const int8_t *v = (const int8_t *)v_cache + row;
            const float vs = row_scale(v, d);
            for (int64_t j = 0; j < g; j++) axpy_b(os + j * d, scores[j * len + l] * vs, v, d);
        } else {
            const float *v = (const float *)v_cache + row;
            for (int64_t j = 0; j < g; j++) axpy_f(os + j * d, scores[j * len + l], v, d);
        }
    }
}

/* q[nd, hq, d] (token s's heads at q + s * q_stride) -> out[nd, hq, d]. slots[s * slots_stride
 * + l] is the cache slot of sequence s's l-th context token, for l < lens[s]. Returns -1 when
 * out of memory, -2 for a bad shape. */
int pd_decode_attention(const float *q, int64_t q_stride, int64_t nd, int64_t hq, int64_t hkv,
                        int64_t d,
                        const void *k_cache, const void *v_cache, int kv_int8,
                        const int64_t *slots, int64_t slots_stride, const int64_t *lens,
                        float scale, float *out) {
    if (hkv <= 0 || hq % hkv != 0 || d <= 0) return -2;
    const int64_t g = hq / hkv;
    int64_t max_len = 0;
    for (int64_t s = 0; s < nd; s++) max_len = lens[s] > max_len ? lens[s] : max_len;
    int failed = 0;
#pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * (size_t)(g * (max_len > 0 ? max_len : 1)));
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < nd * hkv; task++) {
            if (!scores) continue;
            const int64_t s = task / hkv, h = task % hkv, len = lens[s];
            const float *qs = q + s * q_stride + h * g * d;
            float *os = out + (s * hq + h * g) * d;
            const int64_t *sl = slots + s * slots_stride;
            const int nv = d % V == 0 && d <= NV_MAX * V ? (int)(d / V) : 0;
#define TASK(n) task_vec(qs, os, g, d, k_cache, v_cache, kv_int8, sl, len, hkv, h, scale, scores, n)
            switch (nv) {
            case 1: TASK(1); break;
            case 2: TASK(2); break;
            case 3: TASK(3); break;
            case 4: TASK(4); break;
            case 5: TASK(5); break;
            case 6: TASK(6); break;
            case 7: TASK(7); break;
            case 8: TASK(8); break;
#if NV_MAX > 8
            case 9: TASK(9); break;
            case 10: TASK(10); break;
            case 11: TASK(11); break;
            case 12: TASK(12); break;
            case 13: TASK(13); break;
            case 14: TASK(14); break;
            case 15: TASK(15); break;
            case 16: TASK(16); break;
#endif
            default:
                task_any(qs, os, g, d, k_cache, v_cache, kv_int8, sl, len, hkv, h, scale, scores);
            }
#undef TASK
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
