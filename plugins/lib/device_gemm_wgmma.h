/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The Hopper engine of the device-count bf16 grouped GEMM (device_gemm.h): FORWARD, DGRAD and WGRAD on a persistent
 * wgmma kernel fed by TMA (device_gemm_wgmma.cu). bf16_device_gemm picks it where the GPU has it (compute capability
 * 9.0) unless bf16_device_gemm_args.engine asks for mma.sync; WGRAD into an fp32 gradient too (a bf16 gradient runs on
 * mma.sync).
 */
#ifndef MOERT_PRECISION_BF16_DEVICE_GEMM_WGMMA_H
#define MOERT_PRECISION_BF16_DEVICE_GEMM_WGMMA_H

#include <cuda_runtime.h>

#include "device_gemm.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Prepares the wgmma kernels on the current device (their shared-memory limit, the driver's tensor-map encoder) if it
 * has them; a device without them is noted, not an error. Called by bf16_device_gemm_prepare. */
moert_result bf16_wgmma_prepare(const moert_host *host);

/* WGRAD's schedule: experts of fewer rows than this on average (capacity < this x experts) take the ping-pong (few
 * rows: the fp32 gradient's writes weigh as much as the MMA), the others the cooperative one. */
#define BF16_WGMMA_PINGPONG_ROWS 2048

/* Whether bf16_wgmma_prepare found the kernels usable on the current device. */
int bf16_wgmma_available(void);

/* Enqueues a FORWARD, DGRAD or WGRAD (fp32 gradient) whose arguments bf16_device_gemm has checked (capacity > 0). Capturable. */
moert_result bf16_wgmma_gemm(const moert_host *host, cudaStream_t stream, const bf16_device_gemm_args *a);

#ifdef __cplusplus
}
#endif
#endif
