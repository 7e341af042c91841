/* SPDX-License-Identifier: Apache-2.0 */
/*
 * CUDA kernels of the core's MoE executor: SwiGLU with the routing prob fused (forward and backward) and
 * small element-wise helpers (fill, axpby, convert). Plain C interfaces; every call
 * is enqueued on the given stream and returns without waiting; errors set the core's message
 * (moert_error) naming the kernel or CUDA call and return MOERT_ERR_CUDA / MOERT_ERR_INVALID_ARGUMENT.
 * Pointers are device pointers; element counts are host integers; n == 0 enqueues nothing.
 * Supported storage dtypes: fp32 and bf16 (arithmetic in fp32), and fp64 where noted.
 * 16-byte vector loads are used when the pointers and row lengths allow; any alignment works.
 */
#ifndef MOERT_CORE_CUDA_KERNELS_H
#define MOERT_CORE_CUDA_KERNELS_H

#include <cuda_runtime.h>
#include <stdint.h>

#include "moert/plugin.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * SwiGLU forward with the routing prob: in [rows, 2F] holds per row a = in[:, 0:F] and g = in[:, F:2F];
 * out[r, j] = silu(a[r, j]) * g[r, j] * prob[r], computed in fp32, stored in dtype (fp32 or bf16).
 * prob: [rows] fp32, or NULL for prob 1.
 */
moert_result moert_cuda_swiglu_forward(cudaStream_t stream, moert_dtype dtype, int64_t rows, int64_t ffn,
                                       const void *in, const float *prob, void *out);

/*
 * SwiGLU backward: from d_out [rows, F], in [rows, 2F] and prob [rows] (NULL: 1), writes
 * d_in [rows, 2F] (overwritten: d_a in the first half, d_g in the second) and, when d_prob is not NULL,
 * d_prob[r] = sum_j d_out[r, j] * silu(a[r, j]) * g[r, j] (fp32, overwritten; a deterministic per-row sum).
 */
moert_result moert_cuda_swiglu_backward(cudaStream_t stream, moert_dtype dtype, int64_t rows, int64_t ffn,
                                        const void *in, const float *prob, const void *d_out, void *d_in,
                                        float *d_prob);

/*
 * Copies `bytes` from src to dst with a kernel on `stream` (no copy engine): for small copies between device memory
 * and pinned host memory (both pointers as the device sees them). 16-byte accesses when both pointers and the size
 * allow, else bytes.
 */
moert_result moert_cuda_copy_kernel(cudaStream_t stream, void *dst, const void *src, size_t bytes);

/* x[i] = value for i < n; dtype fp32, bf16, fp64, int32 or int64. */
moert_result moert_cuda_fill(cudaStream_t stream, moert_dtype dtype, int64_t n, double value, void *x);

/* x[i] = std * normal(seed, stream, first + i) for i < n (random.h's generator, as the CPU's moert_fill_normal);
 * dtype fp32 or fp64. */
moert_result moert_cuda_fill_normal(cudaStream_t s, moert_dtype dtype, int64_t n, uint64_t seed, uint64_t stream,
                                    uint64_t first, double std, void *x);

/* y[i] = a * x[i] + b * y[i] in fp32 (fp64 when either is fp64); x and y each fp32, bf16 or fp64.
 * b == 0 does not read y (so y may hold garbage or NaN). */
moert_result moert_cuda_axpby(cudaStream_t stream, int64_t n, double a, moert_dtype x_dtype, const void *x, double b,
                              moert_dtype y_dtype, void *y);

/* y[i] += a * x[i]: moert_cuda_axpby with b = 1. */
moert_result moert_cuda_axpy(cudaStream_t stream, int64_t n, double a, moert_dtype x_dtype, const void *x,
                             moert_dtype y_dtype, void *y);

/* dst[i] = src[i] converted (round to nearest even for bf16); fp32, bf16, fp64 either way. */
moert_result moert_cuda_convert(cudaStream_t stream, int64_t n, moert_dtype src_dtype, const void *src,
                                moert_dtype dst_dtype, void *dst);

/* The shared expert's gate: prob[t] = sigmoid(x[t] . gate) for x [tokens, hidden] (fp32 or bf16), gate [hidden] fp32. */
moert_result moert_cuda_gate_forward(cudaStream_t stream, moert_dtype dtype, int64_t tokens, int64_t hidden,
                                     const void *x, const float *gate, float *prob);
/* Its backward from d_prob [tokens]: d_x [tokens, hidden] += d_logit[t] * gate, d_gate [hidden] += sum_t d_logit[t] *
 * x[t], with d_logit = d_prob * prob * (1 - prob). */
moert_result moert_cuda_gate_backward(cudaStream_t stream, moert_dtype dtype, int64_t tokens, int64_t hidden,
                                      const void *x, const float *gate, const float *prob, const float *d_prob,
                                      void *d_x, float *d_gate);

#ifdef __cplusplus
}
#endif
#endif
