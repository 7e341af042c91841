/* SPDX-License-Identifier: Apache-2.0 */
/* The CUDA entry points of the "stride" example router (stride_kernel.cu), callable from C. */
#ifndef STRIDE_KERNEL_H
#define STRIDE_KERNEL_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Routes tokens x topk copies on the device, on stream (a cudaStream_t): idx [tokens][topk] int32, probs the same in
 * fp32 (probs_fp64 0) or fp64, counts [experts] int64 zeroed then counted. Returns a cudaError_t value (0: ok). */
int stride_route_cuda(void *stream, int64_t tokens, int64_t topk, int64_t experts, int64_t stride, int32_t *idx,
                      void *probs, int probs_fp64, int64_t *counts);

/* Makes device the calling thread's CUDA device. Returns a cudaError_t value (0: ok). */
int stride_cuda_use_device(int device);

/* cudaGetErrorString of err. */
const char *stride_cuda_error_text(int err);

#ifdef __cplusplus
}
#endif
#endif
