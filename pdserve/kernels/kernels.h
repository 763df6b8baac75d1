/* What the native kernels export: the functions `linear.py`, `attention.py` and `decode.py` call
 * through ctypes, and that the fused decode step (cpu_decode.c) calls directly. One library is
 * built from every source of this folder (build.py). Every function returns 0 on success, -1
 * when out of memory and -2 for arguments it cannot take. */
#ifndef PD_KERNELS_H
#define PD_KERNELS_H

#include <stdint.h>

/* cpu_linear.c: y[M, N] = x[M, K] @ W^T, W in panels of 16 output channels (see there). */
int pd_f32_linear(const float *x, int64_t M, int64_t K, const float *w, const float *bias,
                  int64_t N, float *y);

/* cpu_quant.c: the same with int8 or int4 weights and activations quantized to 8 bits in
 * blocks of 32 (see there); pd_vnni() says whether the AVX-512 VNNI path was built. */
int pd_vnni(void);
int pd_int8_linear(const float *x, int64_t M, int64_t K, const uint8_t *q, const float *scale,
                   int64_t N, float *y);
int pd_int4_linear(const float *x, int64_t M, int64_t K, const uint8_t *q, const uint16_t *scale,
                   int64_t N, int64_t G, float *y);

/* cpu_attention.c: one query token per sequence against its context in the paged cache. */
int pd_decode_attention(const float *q, int64_t q_stride, int64_t nd, int64_t hq, int64_t hkv,
                        int64_t d, const void *k_cache, const void *v_cache, int kv_int8,
                        const int64_t *slots, int64_t slots_stride, const int64_t *lens,
                        float scale, float *out);

/* cpu_attention.c: causal prefill chunks against their contexts in the paged cache. */
int pd_prefill_attention(const float *q, int64_t q_stride, int64_t n_tokens,
                         const int64_t *chunks, int64_t n_chunks, const int64_t *slots,
                         int64_t n_slots, int64_t hq, int64_t hkv, int64_t d,
                         const void *k_cache, const void *v_cache, int64_t cache_slots,
                         int kv_int8, float scale, float *out, int64_t out_stride);

/* cpu_layer.c: per-token operations over m rows. RMSNorm of x[m, n] (out may be x); the
 * rotary embedding in place of `heads` heads of d values per row (row t at x + t * stride, its
 * cosines and sines at cos/sin + t * d / 2); out[m, n] = silu(gate) * up of gu[m, 2n]. */
int pd_rms_norm(const float *x, int64_t m, int64_t n, const float *w, float eps, float *out);
int pd_rope(float *x, int64_t m, int64_t stride, int64_t heads, int64_t d, const float *cos,
            const float *sin);
int pd_silu_mul(const float *gu, int64_t m, int64_t n, float *out);

/* cpu_memory.c: the sum of x[0 .. n), read at the speed the memory system allows. */
float pd_read_sum(const float *x, int64_t n);

#endif
