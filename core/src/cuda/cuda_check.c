/* SPDX-License-Identifier: Apache-2.0 */
/* Messages for failed CUDA runtime, NCCL and cuBLASLt calls (see cuda_check.h). */
#include "cuda_check.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>

/* The source path from "core/" on, so messages read the same whatever the build directory is. */
static const char *short_path(const char *file)
{
    const char *p = strstr(file, "core/src/");
    if (!p) p = strstr(file, "tests/");
    return p ? p : file;
}

moert_result moert_cuda_fail(const char *call, cudaError_t err, const char *file, int line)
{
    (void)cudaGetLastError(); /* forget a non-sticky error; a sticky one stays whatever we do */
    moert_result code = (err == cudaErrorMemoryAllocation) ? MOERT_ERR_OUT_OF_MEMORY : MOERT_ERR_CUDA;
    return moert_error(code, "%s failed: %s (%s:%d)", call, cudaGetErrorString(err), short_path(file), line);
}

static char nccl_version_text[32] = "unknown";
static pthread_once_t nccl_version_once = PTHREAD_ONCE_INIT;

/* Reads the version of the libnccl actually loaded (may differ from the headers we built with). */
static void read_nccl_version(void)
{
    int v = 0;
    if (ncclGetVersion(&v) != ncclSuccess || v <= 0) return;
    /* Codes since 2.9: major*10000 + minor*100 + patch; before: major*1000 + minor*100 + patch. */
    if (v >= 10000)
        snprintf(nccl_version_text, sizeof nccl_version_text, "%d.%d.%d", v / 10000, (v % 10000) / 100, v % 100);
    else
        snprintf(nccl_version_text, sizeof nccl_version_text, "%d.%d.%d", v / 1000, (v % 1000) / 100, v % 100);
}

const char *moert_nccl_runtime_version(void)
{
    pthread_once(&nccl_version_once, read_nccl_version);
    return nccl_version_text;
}

moert_result moert_nccl_fail(const char *call, ncclResult_t err, ncclComm_t comm, const char *file, int line)
{
    const char *detail = ncclGetLastError(comm);
    if (detail && detail[0])
        return moert_error(MOERT_ERR_NCCL, "%s failed: %s: %s (NCCL %s, %s:%d)", call, ncclGetErrorString(err), detail,
                           moert_nccl_runtime_version(), short_path(file), line);
    return moert_error(MOERT_ERR_NCCL, "%s failed: %s (NCCL %s, %s:%d)", call, ncclGetErrorString(err),
                       moert_nccl_runtime_version(), short_path(file), line);
}

moert_result moert_cublas_fail(const char *call, cublasStatus_t status, const char *file, int line)
{
    moert_result code = (status == CUBLAS_STATUS_ALLOC_FAILED) ? MOERT_ERR_OUT_OF_MEMORY : MOERT_ERR_CUDA;
    return moert_error(code, "%s failed: %s (%s) (%s:%d)", call, cublasLtGetStatusName(status),
                       cublasLtGetStatusString(status), short_path(file), line);
}
