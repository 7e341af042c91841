/* SPDX-License-Identifier: Apache-2.0 */
/* The trainer's own CUDA work (harness/cuda_ops.cu, built with CUDA): the kernels of its loss and optimizer, and the
 * few runtime calls the step loop makes itself (device count and name, the current device, copies and waits on the
 * layers' stream). Errors are set with moert_set_last_error and return MOERT_ERR_CUDA. */
#ifndef MOERT_HARNESS_CUDA_OPS_H
#define MOERT_HARNESS_CUDA_OPS_H

#include <stddef.h>
#include <stdint.h>

#include "moert/moert.h"

#ifdef __cplusplus
extern "C" {
#endif

/* GPUs that answer (0 and an error when CUDA does not). */
moert_result trainer_cuda_device_count(int *count);
/* The device's name ("NVIDIA H100 80GB HBM3"). */
moert_result trainer_cuda_device_name(int device, char *buf, size_t size);
/* Makes device current for the calling thread. */
moert_result trainer_cuda_set_device(int device);
/* bytes from src to dst (host or device, either way), queued on s. */
moert_result trainer_cuda_copy(void *dst, const void *src, size_t bytes, moert_stream s);
/* Waits for the work queued on s. */
moert_result trainer_cuda_sync(moert_stream s);
/* bytes of zeros at ptr (device memory), queued on s. */
moert_result trainer_cuda_zero(void *ptr, size_t bytes, moert_stream s);

/* *sum = sum (pred - target)^2 over n elements of dtype (fp32 or bf16, accumulated in fp32 with a fixed reduction
 * tree), back through pinned_result (waits); grad (grad_dtype, NULL: none) = 2 scale (pred - target). workspace:
 * TRAINER_LOSS_WORKSPACE_BYTES of device memory. */
moert_result trainer_cuda_squared_error(moert_stream s, moert_dtype dtype, int64_t n, const void *pred,
                                        const void *target, double scale, moert_dtype grad_dtype, void *grad,
                                        void *workspace, float *pinned_result, double *sum);
/* One Adam(W) step over n fp32 parameters (step from 1): m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
 * param = param (1 - lr wd) - lr (m / (1-b1^step)) / (sqrt(v / (1-b2^step)) + eps). grad fp32 or bf16. */
moert_result trainer_cuda_adam(moert_stream s, int64_t n, int64_t step, double lr, double beta1, double beta2,
                               double eps, double weight_decay, float *param, moert_dtype grad_dtype, const void *grad,
                               float *m, float *v);
/* y = a x + b y over n elements, in fp32 (fp64 when either is fp64); b == 0 does not read y. */
moert_result trainer_cuda_axpby(moert_stream s, int64_t n, double a, moert_dtype x_dtype, const void *x, double b,
                                moert_dtype y_dtype, void *y);

#ifdef __cplusplus
}
#endif
#endif
