/* One decoder layer of a decode step in one call: the fused decode step.
 *
 * A batch-1 decode step of a small model is ~16 ms of weights streaming through the matrix
 * products and, run op by op through torch, another ~5 ms of ~40 small ops per layer (norms,
 * rotary, cache writes, activations, residual adds) and the Python that calls them. Here a layer
 * is one call: the small ops run in C on the step's few rows, between the native matrix
 * products and the paged decode attention, with no tensor allocated on the way.
 *
 * Per layer, for nd decoding tokens x[nd, hidden] (updated in place):
 *   h = rmsnorm(x) * w_in; qkv = h @ Wqkv^T (+ bias); [q/k rmsnorm per head]; rotary on q and k;
 *   k and v stored at each token's cache slot (float32 rows, or int8 rows with their scale);
 *   a = attention(q, cache); x += a @ Wo^T;
 *   h = rmsnorm(x) * w_post; g, u = h @ Wgu^T; x += (silu(g) * u) @ Wdown^T.
 * The same arithmetic as the torch modules (pdserve/models/llama.py, kv_quant.py) in float32;
 * only the order of a few sums differs. `pd_decode_step` runs all the layers of a step, the
 * final norm and, when asked, the output head in one call: between calls from Python the
 * interpreter's own state has been pushed out of the caches by the weights that streamed
 * through them, so each return to Python cost 30-40 us of cache misses (0.45 ms a step over 12
 * layers, and 0.2 ms for the final norm).
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "kernels.h"
#include "rows.h"
#include "vec.h"

enum { PD_F32 = 0, PD_INT8 = 1, PD_INT4 = 2 };

typedef struct {
    int64_t kind, group, n, k;   /* PD_F32 / PD_INT8 / PD_INT4; int4 group size; W[n, k] */
    const void *w;               /* panels (cpu_linear.c) */
    const void *scale;           /* int8 (float) scales / int4 (float16) scales and minima */
    const float *bias;           /* NULL, or [n] (float32: padded to the panels) */
} pd_linear_t;

typedef struct {
    int64_t hidden, hq, hkv, d, inter, kv_int8;
    float eps;
    const float *in_norm, *post_norm;  /* [hidden] */
    const float *q_norm, *k_norm;      /* [d] per-head norms (Qwen3), or NULL */
    pd_linear_t qkv, o, gate_up, down;
    void *k_cache, *v_cache;           /* [slots, hkv, d] float32 or [slots, hkv, d + 4] int8 */
} pd_layer_t;

typedef struct {
    int64_t nd;
    const int64_t *positions;    /* [nd] */
    const int64_t *new_slots;    /* [nd] the cache slot of each token's own K and V */
    const int64_t *ctx_slots;    /* [nd, slots_stride] each context's slots, in order */
    int64_t slots_stride;
    const int64_t *lens;         /* [nd] context lengths (the token's own included) */
    const float *cos, *sin;      /* rotary tables [positions, d / 2] */
    float *scratch;              /* pd_decode_scratch_floats() floats */
} pd_step_t;

static int64_t qkv_width(const pd_layer_t *L) { return (L->hq + 2 * L->hkv) * L->d; }

/* Floats of scratch one step of `nd` tokens needs for this layer shape. */
int64_t pd_decode_scratch_floats(const pd_layer_t *L, int64_t nd) {
    return nd * (L->hidden + qkv_width(L) + L->hq * L->d + 3 * L->inter + L->hidden);
}

static int linear(const pd_linear_t *W, const float *x, int64_t m, float *y) {
    int rc;
    switch (W->kind) {
    case PD_F32: return pd_f32_linear(x, m, W->k, W->w, W->bias, W->n, y);
    case PD_INT8: rc = pd_int8_linear(x, m, W->k, W->w, W->scale, W->n, y); break;
    case PD_INT4: rc = pd_int4_linear(x, m, W->k, W->w, W->scale, W->n, W->group, y); break;
    default: return -2;
    }
    if (rc == 0 && W->bias)
        for (int64_t i = 0; i < m; i++)
            for (int64_t j = 0; j < W->n; j++) y[i * W->n + j] += W->bias[j];
    return rc;
}

/* One token's K or V head into its cache row: float32 as is, int8 as kv_quant.quantize_rows. */
static void store_row(void *cache, int64_t row, const float *x, int64_t d, int int8) {
    if (!int8) {
        memcpy((float *)cache + row * d, x, sizeof(float) * d);
        return;
    }
    int8_t *dst = (int8_t *)cache + row * (d + 4);
    float amax = 0;
    for (int64_t i = 0; i < d; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    float scale = amax / 127.0f;
    if (scale < 1.17549435e-38f) scale = 1.17549435e-38f; /* float32's smallest normal */
    for (int64_t i = 0; i < d; i++) {
        float q = nearbyintf(x[i] / scale); /* round half to even, as torch.round */
        dst[i] = (int8_t)(q > 127 ? 127 : q < -127 ? -127 : q);
    }
    memcpy(dst + d, &scale, sizeof scale);
}

static int pd_decode_layer(const pd_layer_t *L, const pd_step_t *S, float *x) {
    const int64_t nd = S->nd, hid = L->hidden, d = L->d, hq = L->hq, hkv = L->hkv;
    const int64_t qkvw = qkv_width(L), inter = L->inter;
    if (d % 2 || hkv <= 0 || hq % hkv) return -2;
    float *h = S->scratch, *qkv = h + nd * hid, *att = qkv + nd * qkvw;
    float *gu = att + nd * hq * d, *act = gu + nd * 2 * inter, *out = act + nd * inter;
    int rc;

    for (int64_t t = 0; t < nd; t++)
        rmsnorm_row(x + t * hid, L->in_norm, hid, L->eps, h + t * hid);
    if ((rc = linear(&L->qkv, h, nd, qkv))) return rc;
    for (int64_t t = 0; t < nd; t++) {
        float *row = qkv + t * qkvw;
        const float *c = S->cos + S->positions[t] * (d / 2), *s = S->sin + S->positions[t] * (d / 2);
        for (int64_t j = 0; j < hq + hkv; j++) {
            float *head = row + j * d;
            if (L->q_norm) rmsnorm_row(head, j < hq ? L->q_norm : L->k_norm, d, L->eps, head);
            rotate_row(head, c, s, d);
        }
        for (int64_t j = 0; j < hkv; j++) {
            const int64_t cache_row = S->new_slots[t] * hkv + j;
            store_row(L->k_cache, cache_row, row + (hq + j) * d, d, (int)L->kv_int8);
            store_row(L->v_cache, cache_row, row + (hq + hkv + j) * d, d, (int)L->kv_int8);
        }
    }
    rc = pd_decode_attention(qkv, qkvw, nd, hq, hkv, d, L->k_cache, L->v_cache, (int)L->kv_int8,
                             S->ctx_slots, S->slots_stride, S->lens, 1.0f / sqrtf((float)d), att);
    if (rc || (rc = linear(&L->o, att, nd, out))) return rc;
    for (int64_t i = 0; i < nd * hid; i++) x[i] += out[i];

    for (int64_t t = 0; t < nd; t++)
        rmsnorm_row(x + t * hid, L->post_norm, hid, L->eps, h + t * hid);
    if ((rc = linear(&L->gate_up, h, nd, gu))) return rc;
    for (int64_t t = 0; t < nd; t++)
        silu_mul_row(gu + t * 2 * inter, gu + t * 2 * inter + inter, inter, act + t * inter);
    if ((rc = linear(&L->down, act, nd, out))) return rc;
    for (int64_t i = 0; i < nd * hid; i++) x[i] += out[i];
    return 0;
}

/* The index of the largest of x[0 .. n), the first of equals: torch.argmax's answer, where a
 * NaN counts as the largest (the first NaN). */
static int64_t argmax_row(const float *x, int64_t n) {
    vf top = splat(-INFINITY);
    vi nan = {0};
    int64_t i = 0;
    for (; i + V <= n; i += V) {
        const vf v = load_f(x + i);
        const vi gt = v > top;
        nan |= v != v;
        top = (vf)(((vi)v & gt) | ((vi)top & ~gt));
    }
    float best = -INFINITY;
    int any_nan = 0;
    for (int j = 0; j < V; j++) {
        best = top[j] > best ? top[j] : best;
        any_nan |= nan[j] != 0;
    }
    for (; i < n; i++) {
        any_nan |= x[i] != x[i];
        best = x[i] > best ? x[i] : best;
    }
    for (i = 0; i < n; i++)
        if (any_nan ? x[i] != x[i] : x[i] == best) return i;
    return 0; /* every value -inf */
}

/* out[r] = the argmax of row r of x[m, n] (as the fused step takes it; for the tests). */
int pd_argmax_rows(const float *x, int64_t m, int64_t n, int64_t *out) {
    for (int64_t r = 0; r < m; r++) out[r] = argmax_row(x + r * n, n);
    return 0;
}

/* The step's `n` layers in order, then out = rmsnorm(x) * norm (the model's final norm) and,
 * with a head, logits[nd, head->n] = out @ head^T, and with `tokens` each row's argmax (its
 * greedy token): the whole forward of a decode step in one call. Returning to Python between
 * the layers and the head cost ~0.3 ms a step on an Intel Xeon (the interpreter's state is
 * cold after the layers' weights streamed), 1.5% of a float32 step of llama-125m and more of
 * a quantized one; torch's argmax on those cold caches another ~0.1 ms. */
int pd_decode_step(const pd_layer_t *layers, int64_t n, const pd_step_t *S, float *x,
                   const float *norm, float eps, float *out, const pd_linear_t *head,
                   float *logits, int64_t *tokens) {
    for (int64_t i = 0; i < n; i++) {
        int rc = pd_decode_layer(&layers[i], S, x);
        if (rc) return rc;
    }
    const int64_t hid = n ? layers[0].hidden : 0;
    for (int64_t t = 0; t < S->nd && n; t++)
        rmsnorm_row(x + t * hid, norm, hid, eps, out + t * hid);
    if (head && n) {
        if (head->k != hid) return -2;
        int rc = linear(head, out, S->nd, logits);
        for (int64_t t = 0; t < S->nd && tokens && !rc; t++)
            tokens[t] = argmax_row(logits + t * head->n, head->n);
        return rc;
    }
    return 0;
}

/* `steps` decode steps of the same rows in one call (`--num-scheduler-steps`): S[s] describes
 * step s (its positions, cache slots and context lengths, each one further than step s - 1's),
 * tokens[s * nd + t] gets row t's greedy token of step s, and that token's embedding (a row of
 * embed[vocab, hidden]) is the row's input to step s + 1. Between the steps of a burst nothing
 * returns to Python: the host's work for a step (laying out its inputs, sampling, updating the
 * requests), slow on caches the weights have just swept, is paid once per burst. */
int pd_decode_burst(const pd_layer_t *layers, int64_t n, const pd_step_t *S, int64_t steps,
                    float *x, const float *norm, float eps, float *out, const pd_linear_t *head,
                    float *logits, int64_t *tokens, const float *embed, int64_t vocab) {
    if (!n || !head || steps < 1 || head->n > vocab) return -2;
    const int64_t hid = layers[0].hidden, nd = S[0].nd;
    for (int64_t s = 0; s < steps; s++) {
        if (S[s].nd != nd) return -2;
        for (int64_t t = 0; s && t < nd; t++)
            memcpy(x + t * hid, embed + tokens[(s - 1) * nd + t] * hid, sizeof(float) * hid);
        int rc = pd_decode_step(layers, n, &S[s], x, norm, eps, out, head, logits,
                                tokens + s * nd);
        if (rc) return rc;
    }
    return 0;
}
