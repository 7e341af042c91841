/* SPDX-License-Identifier: Apache-2.0 */
/* Helpers of the GPU tests (CUDA builds only; link gpu_test_util.c):
 * - for tests that call plugin CUDA code directly (no runtime): a checked CUDA call that ends the test, and a host
 *   table that keeps the last error message a plugin hands over;
 * - for tests that run plugins through the host on a world of GPU ranks as threads (a rank per GPU): the ranks'
 *   set-up, failures and progress lines from many threads, checked plugin calls, and host and device buffers. */
#ifndef MOERT_GPU_TEST_UTIL_H
#define MOERT_GPU_TEST_UTIL_H

#include <cuda_runtime_api.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "cuda/comm_nccl.h"
#include "cuda/pool.h"
#include "moert/plugin.h"
#include "test_util.h"

/* Ends the test after a failure of its own scaffolding: once, even when several rank threads fail at a time (exit()
 * from several threads at a time is undefined): stdout and stderr flushed, no atexit handlers. */
void gpu_test_die(void) __attribute__((noreturn));

/* A CUDA call of the test's own scaffolding: a failure ends the test. */
#define CK(call)                                                                                                       \
    do {                                                                                                               \
        cudaError_t e_ = (call);                                                                                       \
        if (e_ != cudaSuccess) {                                                                                       \
            fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));              \
            gpu_test_die();                                                                                            \
        }                                                                                                              \
    } while (0)

/* ---- tests that call plugin CUDA code directly ---- */

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
static const moert_host gpu_test_host = {
    .struct_size = sizeof(moert_host), .log = gpu_test_log, .set_error = gpu_test_set_error};

/* Host -> device uploads that have landed when they return. A pageable cudaMemcpy (or a cudaMemset) may return
 * before the device has all of it, and the plugin code under test runs on non-blocking streams, which do not wait
 * for the legacy stream: a late chunk could overwrite what a kernel has just written (seen once in test_gpu_fp8, a
 * whole output still holding its poison). */
void gpu_upload(void *dst, const void *host, size_t bytes);
/* A new device buffer (bytes + 256, so a kernel overrunning it does not fault) holding host's bytes, landed. */
void *gpu_upload_new(const void *host, size_t bytes);
/* A new device buffer (bytes + 256) with every byte `fill`, landed. */
void *gpu_filled_new(size_t bytes, int fill);

/* ---- tests that run plugins on a world of GPU ranks (threads) ---- */

/* The number of GPUs; 0 after a line on stdout saying why there is none ("<test_name>: no GPU (...), skipped"): the
 * test then returns TEST_SKIP. */
int gpu_test_device_count(const char *test_name);

/* One rank of a world: its GPU (the rank's number), memory pool, stream and NCCL communicator. */
typedef struct gpu_test_rank_env {
    int rank, world;
    char where[32]; /* "world W rank R", for messages */
    moert_comm_group *comm;
    moert_cuda_pool *pool;
    moert_nccl_comm *nccl;
    cudaStream_t stream;
} gpu_test_rank_env;

/* The rank's GPU as a moert device. */
moert_device gpu_test_rank_device(const gpu_test_rank_env *env);

/* Runs rank_fn(env, user) on `world` GPUs, a thread each, with a threads communicator and an NCCL group whose calls
 * give up after timeout_s. A rank whose set-up fails counts a failure and aborts the communicator instead. */
void gpu_test_run_world(int world, double timeout_s, void (*rank_fn)(const gpu_test_rank_env *env, void *user),
                        void *user);

/* Counts one failed check and prints why, a line on stderr (thread-safe). */
void gpu_test_failure(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* A progress line on stdout, flushed (thread-safe), so that a hang or crash shows where it was. */
void gpu_test_progress(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* A plugin call that must succeed; counts a failure with the plugin's message otherwise (what: the call's text,
 * where: the rank and case, file and line: the caller's). Returns whether it succeeded. */
bool gpu_test_call_ok(test_instance *ti, moert_result rc, const char *what, const char *where, const char *file,
                      int line);
#define CALL(ti, call, where) gpu_test_call_ok((ti), (call), #call, (where), __FILE__, __LINE__)

/* Zeroed host memory with a little slack (64 bytes), so empty tensors still have an address; ends the test when
 * there is none. */
void *gpu_test_host_alloc(size_t bytes);

/* n random values in [-scale, scale) stored as dtype. */
void gpu_test_fill_random(void *buf, moert_dtype dtype, int64_t n, uint64_t *rng, double scale);

/* A device copy of `bytes` of host memory, queued on stream (the buffer has 64 bytes of slack). */
void *gpu_test_device_copy(cudaStream_t s, const void *host, size_t bytes);

/* A device buffer of `bytes` (and 64 of slack) filled with 0xFF (NaN as fp32 and bf16, -1 as integers), queued on
 * stream. */
void *gpu_test_device_poisoned(cudaStream_t s, size_t bytes);

/* Device to host after the stream's work. */
void gpu_test_download(cudaStream_t s, void *host, const void *d, size_t bytes);

/* Bytes that differ between two buffers (0: bit-exact). */
int64_t gpu_test_bytes_differ(const void *a, const void *b, size_t n);

/* Whether every byte is 0xFF (an untouched poisoned region). */
bool gpu_test_all_poison(const void *a, size_t n);

/* ||got - want|| / ||want|| over n values of dtype (Frobenius; NaN when got has a NaN). */
double gpu_test_rel_error(const void *got, const void *want, moert_dtype dtype, int64_t n);

#endif
