/* Attention over the paged KV cache, read in place: decode (one query token per sequence) and
 * prefill (a chunk of query tokens per sequence, causal).
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
 *
 * Prefill is compute-bound: a chunk of Lq query tokens against its Lk keys is two products,
 * scores = Q K^T and out = softmax(scores) V, which run on the matrix products' register tile
 * (tile.h) after the task's keys and values are copied out of the cache into its layout (see
 * pd_prefill_attention).
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "kernels.h"
#include "tile.h"
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

/* Scale, mask and exponentiate one row of scores in place: the first n of its w scores (the
 * keys it may see) become e^(scale * score - their maximum), the rest zeros. Returns 1 / the
 * sum of the n (prefill scales the row's output by it: d values, not n). */
static float softmax_masked(float *sc, int64_t n, int64_t w, float scale) {
    vf vtop = splat(-INFINITY);
    int64_t l = 0;
    for (; l + V <= n; l += V) {
        const vf v = load_f(sc + l);
        const vi up = v > vtop;
        vtop = (vf)(((vi)v & up) | ((vi)vtop & ~up));
    }
    float top = -INFINITY;
    for (int i = 0; i < V; i++) top = vtop[i] > top ? vtop[i] : top;
    for (; l < n; l++) top = sc[l] > top ? sc[l] : top;
    top *= scale; /* scale > 0 */
    vf acc = {0};
    for (l = 0; l + V <= n; l += V) {
        vf e = exp_neg(load_f(sc + l) * scale - top);
        store_f(sc + l, e);
        acc += e;
    }
    float sum = hsum(acc);
    for (; l < n; l++) sum += (sc[l] = expf(sc[l] * scale - top));
    for (; l < w; l++) sc[l] = 0;
    return 1.0f / sum;
}

/* softmax of sc[0 .. len) in place. */
static inline void softmax(float *sc, int64_t len) {
    const vf inv = splat(softmax_masked(sc, len, len, 1.0f));
    int64_t l = 0;
    for (; l + V <= len; l += V) store_f(sc + l, load_f(sc + l) * inv);
    for (; l < len; l++) sc[l] *= inv[0];
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

/* ---- prefill ---------------------------------------------------------------------------- */

#define QB 64 /* query rows per task: the rows that share one copy of the task's keys and values */

/* Row l of a context's keys or values for KV head h as floats (int8 rows times their scale). */
static inline void load_row(const void *cache, int kv_int8, int64_t slot, int64_t hkv, int64_t h,
                            int64_t d, float *dst, int64_t dst_stride) {
    if (kv_int8) {
        const int8_t *r = (const int8_t *)cache + (slot * hkv + h) * (d + 4);
        const float s = row_scale(r, d);
        for (int64_t i = 0; i < d; i++) dst[i * dst_stride] = (float)r[i] * s;
    } else {
        const float *r = (const float *)cache + (slot * hkv + h) * d;
        for (int64_t i = 0; i < d; i++) dst[i * dst_stride] = r[i];
    }
}

/* One task: query rows [r0, r1) of a chunk, the G query heads of KV head h.
 * kp: the keys [0, nk) as blocks of 64 keys (tile.h's layout: block, dim, 16-key panels);
 * vp: the values as blocks of 64 dims, each [nk keys][64]; sc: MR rows of scores. */
static void prefill_task(const float *q, int64_t q_stride, float *out, int64_t out_stride,
                         int64_t past, int64_t r0, int64_t r1, int64_t g, int64_t h, int64_t d,
                         float scale, const float *kp, const float *vp, int64_t nk, float *sc,
                         int64_t sc_stride) {
    for (int64_t j = 0; j < g; j++) {
        const int64_t head = h * g + j;
        for (int64_t m0 = r0; m0 < r1; m0 += MR) {
            const int mr = (int)(r1 - m0 < MR ? r1 - m0 : MR);
            const int64_t ks = past + m0 + mr; /* keys the tile's last row sees */
            const float *qt = q + m0 * q_stride + head * d;
            for (int64_t kb = 0; kb * PANELS * PW < ks; kb++) /* scores = Q K^T */
                TILE_ROWS(mr, qt, q_stride, d, kp + kb * d * PANELS * PW, NULL, 0,
                          ks - kb * PANELS * PW, sc + kb * PANELS * PW, sc_stride, 0, 0)
            float inv[MR];
            for (int i = 0; i < mr; i++)
                inv[i] = softmax_masked(sc + i * sc_stride, past + m0 + i + 1, ks, scale);
            float *ot = out + m0 * out_stride + head * d;
            for (int64_t db = 0; db * PANELS * PW < d; db++) /* out = e V, then / sum */
                TILE_ROWS(mr, sc, sc_stride, ks, vp + db * nk * PANELS * PW, NULL, 0,
                          d - db * PANELS * PW, ot + db * PANELS * PW, out_stride, 0, 0)
            for (int i = 0; i < mr; i++) {
                float *row = ot + i * out_stride;
                int64_t c = 0;
                for (; c + V <= d; c += V) store_f(row + c, load_f(row + c) * inv[i]);
                for (; c < d; c++) row[c] *= inv[i];
            }
        }
    }
}

/* Causal attention of prefill chunks over the paged cache, whose rows for every query token
 * are already written. Chunk c is chunks[4c .. 4c + 4) = (first query row, query rows Lq,
 * context length Lk, offset of its slots): its queries are rows [first, first + Lq) of q
 * (token t's heads at q + t * q_stride, a head's d floats contiguous), the last Lq of its Lk
 * positions, and slots[offset .. offset + Lk) are the cache slots of its keys in order; query
 * i sees keys [0, Lk - Lq + i]. out[t * out_stride + head * d ..] gets each query's heads.
 * Chunks and slots out of range (of n_tokens rows, n_slots slots, cache_slots cache rows) are
 * refused before any work. Tasks of up to QB query rows of one chunk and one KV head go to
 * torch's threads; each copies the keys and values its rows see out of the cache (dequantized
 * for int8) into the tile's layout once for its G query heads, then runs its rows MR at a
 * time: the scores tile by tile of 64 keys, an exact softmax per row (the keys past its
 * position masked), the output. Returns -1 when out of memory, -2 for a bad shape or index. */
int pd_prefill_attention(const float *q, int64_t q_stride, int64_t n_tokens,
                         const int64_t *chunks, int64_t n_chunks, const int64_t *slots,
                         int64_t n_slots, int64_t hq, int64_t hkv, int64_t d,
                         const void *k_cache, const void *v_cache, int64_t cache_slots,
                         int kv_int8, float scale, float *out, int64_t out_stride) {
    if (hkv <= 0 || hq % hkv != 0 || d <= 0) return -2;
    const int64_t g = hq / hkv, blk = PANELS * PW;
    int64_t max_ctx = 1, n_tasks = 0;
    for (int64_t c = 0; c < n_chunks; c++) {
        const int64_t *ch = chunks + 4 * c;
        if (ch[0] < 0 || ch[1] < 1 || ch[0] + ch[1] > n_tokens || ch[2] < ch[1] || ch[3] < 0 ||
            ch[3] + ch[2] > n_slots)
            return -2;
        for (int64_t l = 0; l < ch[2]; l++)
            if (slots[ch[3] + l] < 0 || slots[ch[3] + l] >= cache_slots) return -2;
        max_ctx = ch[2] > max_ctx ? ch[2] : max_ctx;
        n_tasks += hkv * ((ch[1] + QB - 1) / QB);
    }
    /* task t: its chunk, and its index among the chunk's tasks (row block, KV head) */
    int64_t *tasks = malloc(sizeof(int64_t) * (size_t)(2 * n_tasks + 1));
    if (!tasks) return -1;
    for (int64_t c = 0, t = 0; c < n_chunks; c++)
        for (int64_t i = 0; i < hkv * ((chunks[4 * c + 1] + QB - 1) / QB); i++, t++) {
            tasks[2 * t] = c;
            tasks[2 * t + 1] = i;
        }
    const int64_t kcap = round_up(max_ctx, blk), dcap = round_up(d, blk);
    int failed = 0;
#pragma omp parallel
    {
        float *kp = malloc(sizeof(float) * (size_t)(kcap * d));
        float *vp = malloc(sizeof(float) * (size_t)(kcap * dcap));
        float *sc = malloc(sizeof(float) * (size_t)(MR * kcap));
        if (!kp || !vp || !sc) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic)
        for (int64_t t = 0; t < n_tasks; t++) {
            if (!kp || !vp || !sc) continue;
            const int64_t *ch = chunks + 4 * tasks[2 * t];
            const int64_t lq = ch[1], past = ch[2] - lq, *sl = slots + ch[3];
            const int64_t h = tasks[2 * t + 1] % hkv, r0 = tasks[2 * t + 1] / hkv * QB;
            const int64_t r1 = r0 + QB < lq ? r0 + QB : lq;
            const int64_t nk = past + r1, nkb = (nk + blk - 1) / blk;
            /* keys: block b, dim i, key lane -> kp[(b * d + i) * blk + lane]; zeros past nk */
            for (int64_t l = 0; l < nkb * blk; l++) {
                float *dst = kp + (l / blk) * d * blk + l % blk;
                if (l < nk)
                    load_row(k_cache, kv_int8, sl[l], hkv, h, d, dst, blk);
                else
                    for (int64_t i = 0; i < d; i++) dst[i * blk] = 0;
            }
            /* values: dim block b, key l, lane -> vp[(b * nk + l) * blk + lane]; zeros past d */
            for (int64_t l = 0; l < nk; l++) {
                float row[dcap];
                memset(row + d, 0, sizeof(float) * (size_t)(dcap - d));
                load_row(v_cache, kv_int8, sl[l], hkv, h, d, row, 1);
                for (int64_t b = 0; b < dcap / blk; b++)
                    memcpy(vp + (b * nk + l) * blk, row + b * blk, sizeof(float) * blk);
            }
            prefill_task(q + ch[0] * q_stride, q_stride, out + ch[0] * out_stride, out_stride,
                         past, r0, r1, g, h, d, scale, kp, vp, nk, sc, kcap);
        }
        free(kp);
        free(vp);
        free(sc);
    }
    free(tasks);
    return failed ? -1 : 0;
}
