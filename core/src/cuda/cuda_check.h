/* SPDX-License-Identifier: Apache-2.0 */
/* Checked-call macros for CUDA runtime, NCCL and cuBLASLt calls in the core's CUDA modules.
 * Each sets this thread's message, e.g.
 *   "cudaMalloc(&ptr, bytes) failed: out of memory (core/src/cuda/pool.c:42)"
 * and jumps to `fail:` with rc set, in the style of MOERT_CHECK (core/src/error.h). */
#ifndef MOERT_CORE_CUDA_CHECK_H
#define MOERT_CORE_CUDA_CHECK_H

#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include "error.h"

/* Build the message for a failed call and return its result code (MOERT_ERR_OUT_OF_MEMORY for
 * cudaErrorMemoryAllocation, MOERT_ERR_CUDA otherwise; MOERT_ERR_NCCL; MOERT_ERR_CUDA for cuBLASLt).
 * The CUDA one also clears the runtime's (non-sticky) last error so it does not leak into later calls. */
moert_result moert_cuda_fail(const char *call, cudaError_t err, const char *file, int line);
moert_result moert_nccl_fail(const char *call, ncclResult_t err, ncclComm_t comm, const char *file, int line);
moert_result moert_cublas_fail(const char *call, cublasStatus_t status, const char *file, int line);

/* "2.28.3": the NCCL library found at run time ("unknown" if ncclGetVersion fails); cached. */
const char *moert_nccl_runtime_version(void);

#define MOERT_CUDA_CHECK(call)                                                                                         \
    do {                                                                                                               \
        cudaError_t _moert_cuda_err = (call);                                                                          \
        if (_moert_cuda_err != cudaSuccess) {                                                                          \
            rc = moert_cuda_fail(#call, _moert_cuda_err, __FILE__, __LINE__);                                          \
            goto fail;                                                                                                 \
        }                                                                                                              \
    } while (0)

/* For NCCL calls on a communicator-less path (ncclGetUniqueId, ncclGroupStart/End without a comm). */
#define MOERT_NCCL_CHECK(call)                                                                                         \
    do {                                                                                                               \
        ncclResult_t _moert_nccl_err = (call);                                                                         \
        if (_moert_nccl_err != ncclSuccess) {                                                                          \
            rc = moert_nccl_fail(#call, _moert_nccl_err, NULL, __FILE__, __LINE__);                                    \
            goto fail;                                                                                                 \
        }                                                                                                              \
    } while (0)

#define MOERT_CUBLAS_CHECK(call)                                                                                       \
    do {                                                                                                               \
        cublasStatus_t _moert_cublas_status = (call);                                                                  \
        if (_moert_cublas_status != CUBLAS_STATUS_SUCCESS) {                                                           \
            rc = moert_cublas_fail(#call, _moert_cublas_status, __FILE__, __LINE__);                                   \
            goto fail;                                                                                                 \
        }                                                                                                              \
    } while (0)

#endif
