/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The CUDA half of the "stride" example router: one kernel that routes every token on the device, and a C entry point
 * the plugin (stride_router.c) calls with its stream. Kept apart from the plugin so the plugin itself stays C11 and
 * includes moert's headers only from C; this file needs nothing of moert.
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "stride_kernel.h"

/* Token t's copy j goes to expert (t * stride + j) mod E with weight 1/K; each routed copy is counted in its expert.
 * One thread per (token, copy). */
template <typename P>
__global__ void stride_route(int64_t tokens, int64_t topk, int64_t experts, int64_t stride, int32_t *idx, P *probs,
                             unsigned long long *counts)
{
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= tokens * topk) return;
    const int64_t t = i / topk, j = i % topk;
    const int64_t e = (t * stride + j) % experts;
    idx[i] = (int32_t)e;
    probs[i] = (P)(1.0 / (double)topk);
    atomicAdd(&counts[e], 1ull);
}

/* Enqueues the routing on stream: counts zeroed, then the kernel. Returns the CUDA error of the launch (0: none). */
extern "C" int stride_route_cuda(void *stream, int64_t tokens, int64_t topk, int64_t experts, int64_t stride,
                                 int32_t *idx, void *probs, int probs_fp64, int64_t *counts)
{
    cudaStream_t s = (cudaStream_t)stream;
    cudaError_t err = cudaMemsetAsync(counts, 0, (size_t)experts * sizeof(int64_t), s);
    if (err != cudaSuccess) return (int)err;
    const int64_t n = tokens * topk;
    if (n == 0) return 0;
    const unsigned threads = 256, blocks = (unsigned)((n + threads - 1) / threads);
    unsigned long long *c = (unsigned long long *)counts; /* int64 counts, added as 64-bit words */
    if (probs_fp64)
        stride_route<double><<<blocks, threads, 0, s>>>(tokens, topk, experts, stride, idx, (double *)probs, c);
    else
        stride_route<float><<<blocks, threads, 0, s>>>(tokens, topk, experts, stride, idx, (float *)probs, c);
    return (int)cudaGetLastError();
}

/* Makes device the calling thread's current device (the plugin's init runs on the rank's thread); a cudaError_t
 * value, cudaErrorInvalidDevice where this process does not see it. */
extern "C" int stride_cuda_use_device(int device)
{
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) return (int)err;
    if (device < 0 || device >= count) return (int)cudaErrorInvalidDevice;
    return (int)cudaSetDevice(device);
}

/* The message of a CUDA error code, for the plugin's error text. */
extern "C" const char *stride_cuda_error_text(int err) { return cudaGetErrorString((cudaError_t)err); }
