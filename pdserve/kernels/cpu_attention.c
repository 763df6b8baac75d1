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
 * Work: one task per (sequence, KV head), spread over torch's OpenMP threads. Per task: the
 * scores of its G query heads against every key (one pass over K), an exact softmax (max, exp,
 * sum), then the weighted sum of the values (one pass over V), all in float32.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "kernels.h"
#include "vec.h"

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

/* q[nd, hq, d] (token s's heads at q + s * q_stride) -> out[nd, hq, d]. slots[s * slots_stride
 * + l] is the cache slot of sequence s's l-th context token, for l < lens[s]. Returns -1 when
 * out of memory, -2 for a bad shape. */
int pd_decode_attention(const float *q, int64_t q_stride, int64_t nd, int64_t hq, int64_t hkv,
                        int64_t d,
                        const void *k_cache, const void *v_cache, int kv_int8,
                        const int64_t *slots, int64_t slots_stride, const int64_t *lens,
                        float scale, float *out) {
    if (hkv <= 0 || hq % hkv != 0 || d <= 0) return -2;
    const int64_t g = hq / hkv, width = kv_int8 ? d + 4 : d;
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
                float *sc = scores + j * len, top = -INFINITY, sum = 0;
                for (int64_t l = 0; l < len; l++) top = sc[l] > top ? sc[l] : top;
                for (int64_t l = 0; l < len; l++) sum += (sc[l] = expf(sc[l] - top));
                for (int64_t l = 0; l < len; l++) sc[l] /= sum;
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
        free(scores);
    }
    return failed ? -1 : 0;
}
