/* SPDX-License-Identifier: Apache-2.0 */
/* CK(call): a CUDA runtime call a benchmark cannot go on without; prints the file, line, call and CUDA's message and
 * exits 1 when it fails. For the standalone GPU benchmarks (gemm_bench, fp8_gemm_bench, l2_ceiling). */
#ifndef MOERT_BENCH_CUDA_CHECK_H
#define MOERT_BENCH_CUDA_CHECK_H

#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>

#define CK(call)                                                                                                       \
    do {                                                                                                               \
        cudaError_t e_ = (call);                                                                                       \
        if (e_ != cudaSuccess) {                                                                                       \
            fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));              \
            exit(1);                                                                                                   \
        }                                                                                                              \
    } while (0)

#endif
