/* SPDX-License-Identifier: Apache-2.0 */
#include "gpu_test_util.h"

#include <math.h>
#include <pthread.h>
#include <unistd.h>

#include "cuda/device.h"
#include "error.h"

/* Serialises the failure and progress lines of the rank threads. */
static pthread_mutex_t output_lock = PTHREAD_MUTEX_INITIALIZER;
/* Taken once by gpu_test_die, never released: the first failing thread ends the test. */
static pthread_mutex_t die_lock = PTHREAD_MUTEX_INITIALIZER;

void gpu_test_die(void)
{
    pthread_mutex_lock(&die_lock);
    fflush(stdout);
    fflush(stderr);
    _exit(1);
}

/* ---- uploads ---- */

void gpu_upload(void *dst, const void *host, size_t bytes)
{
    if (bytes) CK(cudaMemcpy(dst, host, bytes, cudaMemcpyHostToDevice));
    CK(cudaDeviceSynchronize());
}

void *gpu_upload_new(const void *host, size_t bytes)
{
    void *d = NULL;
    CK(cudaMalloc(&d, bytes + 256));
    gpu_upload(d, host, bytes);
    return d;
}

void *gpu_filled_new(size_t bytes, int fill)
{
    void *d = NULL;
    CK(cudaMalloc(&d, bytes + 256));
    CK(cudaMemset(d, fill, bytes + 256));
    CK(cudaDeviceSynchronize());
    return d;
}

/* ---- a world of GPU ranks ---- */

int gpu_test_device_count(const char *test_name)
{
    int gpus = 0;
    cudaError_t err = cudaGetDeviceCount(&gpus);
    if (err != cudaSuccess || gpus == 0) {
        printf("%s: no GPU (%s), skipped\n", test_name, err != cudaSuccess ? cudaGetErrorString(err) : "0 devices");
        return 0;
    }
    return gpus;
}

moert_device gpu_test_rank_device(const gpu_test_rank_env *env) { return (moert_device){MOERT_DEVICE_CUDA, env->rank}; }

/* What each rank thread of gpu_test_run_world gets. */
typedef struct world_run {
    int world;
    moert_comm_group *comm;
    moert_nccl_group *nccl_group;
    void (*rank_fn)(const gpu_test_rank_env *env, void *user);
    void *user;
} world_run;

/* One rank thread: sets up the rank's device, pool, stream and NCCL communicator, runs rank_fn, tears down. */
static void rank_main(int rank, void *user)
{
    world_run *w = user;
    gpu_test_rank_env env = {.rank = rank, .world = w->world, .comm = w->comm};
    snprintf(env.where, sizeof env.where, "world %d rank %d", w->world, rank);
    moert_stream stream = NULL;
    moert_error_clear();
    if (moert_cuda_set_device(rank) != MOERT_OK || moert_cuda_pool_create(rank, &env.pool) != MOERT_OK ||
        moert_cuda_stream_create(rank, &stream) != MOERT_OK ||
        moert_nccl_comm_init_thread(w->nccl_group, rank, rank, &env.nccl) != MOERT_OK) {
        gpu_test_failure("%s: setting up the rank: %s", env.where, moert_error_message());
        moert_comm_abort(w->comm, rank, "setup failed");
    } else {
        env.stream = (cudaStream_t)stream;
        w->rank_fn(&env, w->user);
    }
    if (stream) moert_cuda_stream_synchronize(stream);
    if (env.nccl) moert_nccl_comm_free(env.nccl);
    if (env.pool) moert_cuda_pool_destroy(env.pool);
    if (stream) moert_cuda_stream_destroy(stream);
}

void gpu_test_run_world(int world, double timeout_s, void (*rank_fn)(const gpu_test_rank_env *env, void *user),
                        void *user)
{
    world_run w = {.world = world, .rank_fn = rank_fn, .user = user};
    moert_result rc = moert_comm_group_create(world, timeout_s, &w.comm);
    if (rc == MOERT_OK) rc = moert_nccl_group_create(world, timeout_s, &w.nccl_group);
    if (rc != MOERT_OK)
        gpu_test_failure("world %d: creating the communicators: %s", world, moert_error_message());
    else
        test_run_ranks(world, rank_main, &w);
    if (w.nccl_group) moert_nccl_group_free(w.nccl_group);
    if (w.comm) moert_comm_group_free(w.comm);
}

/* ---- failures and progress from many threads ---- */

void gpu_test_failure(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    pthread_mutex_lock(&output_lock);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    test_failures++;
    pthread_mutex_unlock(&output_lock);
    va_end(ap);
}

void gpu_test_progress(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    pthread_mutex_lock(&output_lock);
    vprintf(fmt, ap);
    fputc('\n', stdout);
    fflush(stdout);
    pthread_mutex_unlock(&output_lock);
    va_end(ap);
}

bool gpu_test_call_ok(test_instance *ti, moert_result rc, const char *what, const char *where, const char *file,
                      int line)
{
    if (rc == MOERT_OK) return true;
    gpu_test_failure("%s:%d: %s: %s failed (%s): %s", file, line, where, what, moert_result_name(rc),
                     moert_host_take_error(ti->host));
    return false;
}

/* ---- host and device buffers ---- */

void *gpu_test_host_alloc(size_t bytes)
{
    void *p = calloc(1, bytes + 64);
    if (!p) {
        fprintf(stderr, "out of host memory\n");
        gpu_test_die();
    }
    return p;
}

void gpu_test_fill_random(void *buf, moert_dtype dtype, int64_t n, uint64_t *rng, double scale)
{
    moert_tensor t = moert_tensor_1d(buf, moert_cpu(), dtype, n);
    for (int64_t i = 0; i < n; i++) moert_store(&t, i, scale * test_uniform(rng));
}

void *gpu_test_device_copy(cudaStream_t s, const void *host, size_t bytes)
{
    void *d = NULL;
    CK(cudaMalloc(&d, bytes + 64));
    if (bytes) CK(cudaMemcpyAsync(d, host, bytes, cudaMemcpyHostToDevice, s));
    return d;
}

void *gpu_test_device_poisoned(cudaStream_t s, size_t bytes)
{
    void *d = NULL;
    CK(cudaMalloc(&d, bytes + 64));
    CK(cudaMemsetAsync(d, 0xFF, bytes + 64, s));
    return d;
}

void gpu_test_download(cudaStream_t s, void *host, const void *d, size_t bytes)
{
    CK(cudaStreamSynchronize(s));
    if (bytes) CK(cudaMemcpy(host, d, bytes, cudaMemcpyDeviceToHost));
}

int64_t gpu_test_bytes_differ(const void *a, const void *b, size_t n)
{
    const unsigned char *x = a, *y = b;
    int64_t d = 0;
    for (size_t i = 0; i < n; i++) d += x[i] != y[i];
    return d;
}

bool gpu_test_all_poison(const void *a, size_t n)
{
    const unsigned char *x = a;
    for (size_t i = 0; i < n; i++)
        if (x[i] != 0xFF) return false;
    return true;
}

double gpu_test_rel_error(const void *got, const void *want, moert_dtype dtype, int64_t n)
{
    moert_tensor g = moert_tensor_1d((void *)got, moert_cpu(), dtype, n);
    moert_tensor w = moert_tensor_1d((void *)want, moert_cpu(), dtype, n);
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        double a = moert_load(&g, i), b = moert_load(&w, i);
        num += (a - b) * (a - b);
        den += b * b;
    }
    if (num != num) return NAN;
    if (den == 0) return num == 0 ? 0 : INFINITY;
    return sqrt(num / den);
}
