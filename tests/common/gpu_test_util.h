/* Helpers of the GPU tests that call plugin CUDA code directly (no runtime): a checked CUDA call that ends the
 * test, and a host table that keeps the last error message a plugin hands over. */
#ifndef MOERT_GPU_TEST_UTIL_H
#define MOERT_GPU_TEST_UTIL_H

#include <cuda_runtime_api.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "moert/plugin.h"

/* A CUDA call of the test's own scaffolding: a failure ends the test. */
#define CK(call)                                                                                             \
    do {                                                                                                     \
        cudaError_t e_ = (call);                                                                             \
        if (e_ != cudaSuccess) {                                                                             \
            fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));    \
            exit(1);                                                                                         \
        }                                                                                                    \
    } while (0)

/* The last message handed to gpu_test_host's set_error. */
static char gpu_test_error[1024];

static void gpu_test_log(const moert_host *h, moert_log_level level, const char *fmt, ...)
{
    (void)h, (void)level, (void)fmt;
}

static void gpu_test_set_error(const moert_host *h, const char *fmt, ...)
{
    (void)h;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(gpu_test_error, sizeof gpu_test_error, fmt, ap);
    va_end(ap);
}

/* A host with messages only (no memory services: plugin code falls back to cudaMalloc). */
static const moert_host gpu_test_host = {.struct_size = sizeof(moert_host), .log = gpu_test_log,
                                         .set_error = gpu_test_set_error};

#endif
