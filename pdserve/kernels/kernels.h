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

/* cpu_memory.c: the sum of x[0 .. n), read at the speed the memory system allows. */
float pd_read_sum(const float *x, int64_t n);

#endif
