/* SPDX-License-Identifier: Apache-2.0 */
/* GPU smoke test of the CUDA core: device queries, the caching pool (steady-state reuse, stream-ordered
 * safety, out-of-memory path), pinned copies and, with two or more GPUs, the thread-per-GPU NCCL
 * communicator (allgather, allreduce, uneven alltoallv, barrier, peer buffers) checked against values
 * computed on the host. Exits 77 without a GPU (and in builds without CUDA). */
#include "test_util.h"

#ifndef MOERT_HAVE_CUDA

int main(void)
{
    printf("gpu_smoke: built without CUDA, skipped\n");
    return TEST_SKIP;
}

#else

#include <cuda_runtime_api.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>

#include "cuda/comm_nccl.h"
#include "cuda/device.h"
#include "cuda/pool.h"
#include "error.h"

#define MAX_RANKS 8

/* ---- device queries and checked-call messages ---- */

static void check_devices(int count)
{
    for (int d = 0; d < count; d++) {
        moert_cuda_device_info info;
        EXPECT_OK(moert_cuda_device_info_get(d, &info));
        printf("device %d: %s, cc %d.%d, %d SMs, %.1f GiB (%.1f free), L2 %d MiB, driver %d, runtime %d\n", d,
               info.name, info.cc_major, info.cc_minor, info.sm_count, info.total_bytes / 1073741824.0,
               info.free_bytes / 1073741824.0, info.l2_bytes >> 20, info.driver_version, info.runtime_version);
        EXPECT(info.sm_count > 0);
        EXPECT(info.total_bytes > ((size_t)1 << 30));
        EXPECT(info.free_bytes > 0 && info.free_bytes <= info.total_bytes);
        EXPECT(info.name[0] != '\0');
    }
    /* a failing call names the call text, the CUDA error string, the file and the line */
    EXPECT_EQ_INT(moert_cuda_set_device(count + 7), MOERT_ERR_CUDA);
    EXPECT_ERROR_CONTAINS("cudaSetDevice(device) failed: invalid device ordinal (core/src/cuda/device.c:");
    EXPECT_OK(moert_cuda_set_device(0));
    /* the failure did not leave a sticky error behind */
    EXPECT(cudaGetLastError() == cudaSuccess);
}

/* ---- pool ---- */

static void check_round_sizes(void)
{
    EXPECT_EQ_INT(moert_cuda_pool_round_size(0), 512);
    EXPECT_EQ_INT(moert_cuda_pool_round_size(1), 512);
    EXPECT_EQ_INT(moert_cuda_pool_round_size(513), 1024);
    EXPECT_EQ_INT(moert_cuda_pool_round_size(1u << 20), 1u << 20);
    EXPECT_EQ_INT(moert_cuda_pool_round_size((1u << 20) + 1), (1u << 20) + (1u << 18)); /* 1.25 MiB */
    EXPECT_EQ_INT(moert_cuda_pool_round_size(3u << 20), 3u << 20);
    EXPECT_EQ_INT(moert_cuda_pool_round_size((5u << 20) + 1), 6u << 20);
    EXPECT_EQ_INT(moert_cuda_pool_round_size((7u << 20) + 1), 8u << 20);
}

static atomic_int gate_open;

/* Host function queued on a stream: holds the stream until gate_open is set. */
static void CUDART_CB hold_stream(void *user)
{
    (void)user;
    while (!atomic_load(&gate_open)) usleep(1000);
}

/* Opens the gate after 5 s whatever happens, so a bug cannot hang the test. */
static void *gate_watchdog(void *user)
{
    (void)user;
    for (int i = 0; i < 5000 && !atomic_load(&gate_open); i++) usleep(1000);
    atomic_store(&gate_open, 1);
    return NULL;
}

/* A pool on device 0 and two streams for the pool checks; false (a check failed) if any is missing. */
static bool pool_with_streams(moert_cuda_pool **pool, moert_stream *s1, moert_stream *s2)
{
    EXPECT_OK(moert_cuda_pool_create(0, pool));
    EXPECT_OK(moert_cuda_stream_create(0, s1));
    EXPECT_OK(moert_cuda_stream_create(0, s2));
    return *pool && *s1 && *s2;
}

static void pool_with_streams_destroy(moert_cuda_pool *pool, moert_stream s1, moert_stream s2)
{
    moert_cuda_pool_forget_stream(pool, s1);
    moert_cuda_pool_forget_stream(pool, s2);
    moert_cuda_stream_destroy(s1);
    moert_cuda_stream_destroy(s2);
    moert_cuda_pool_destroy(pool);
}

static void check_pool(void)
{
    moert_cuda_pool *pool = NULL;
    moert_stream s1 = NULL, s2 = NULL;
    moert_cuda_pool_stats st;
    if (!pool_with_streams(&pool, &s1, &s2)) return;

    /* steady state: the same allocations every step make no cudaMalloc after the first step */
    const size_t sizes[] = {100, 1000, 5000, 1u << 20, (3u << 20) + 7, 12345678};
    const int nsizes = (int)(sizeof sizes / sizeof sizes[0]);
    uint64_t mallocs_after_first = 0;
    size_t expect_in_use = 0, expect_requested = 0;
    for (int i = 0; i < nsizes; i++) {
        expect_in_use += moert_cuda_pool_round_size(sizes[i]);
        expect_requested += sizes[i];
    }
    for (int step = 0; step < 5; step++) {
        void *p[16] = {0};
        for (int i = 0; i < nsizes; i++) {
            EXPECT_OK(moert_cuda_pool_alloc(pool, sizes[i], s1, &p[i]));
            EXPECT(p[i] != NULL);
            if (p[i]) EXPECT_OK(moert_cuda_memset_async(p[i], step, sizes[i], s1));
        }
        moert_cuda_pool_get_stats(pool, &st);
        EXPECT_EQ_INT(st.bytes_in_use, expect_in_use);
        EXPECT_EQ_INT(st.bytes_requested, expect_requested);
        EXPECT_EQ_INT(st.live_blocks, nsizes);
        for (int i = 0; i < nsizes; i++) EXPECT_OK(moert_cuda_pool_free(pool, p[i], s1));
        moert_cuda_pool_get_stats(pool, &st);
        if (step == 0) mallocs_after_first = st.cuda_malloc_count;
    }
    moert_cuda_pool_get_stats(pool, &st);
    EXPECT_EQ_INT(mallocs_after_first, nsizes);
    EXPECT_EQ_INT(st.cuda_malloc_count, mallocs_after_first);
    EXPECT_EQ_INT(st.reuse_count, 4 * nsizes);
    EXPECT_EQ_INT(st.alloc_count, 5 * nsizes);
    EXPECT_EQ_INT(st.bytes_in_use, 0);
    EXPECT_EQ_INT(st.live_blocks, 0);
    EXPECT_EQ_INT(st.bytes_reserved, expect_in_use);
    EXPECT_EQ_INT(st.bytes_cached, expect_in_use);
    EXPECT_EQ_INT(st.peak_bytes_in_use, expect_in_use);

    /* a block freed on s1 while s1 still has work queued is not handed to s2 ... */
    EXPECT_OK(moert_cuda_stream_synchronize(s1));
    atomic_store(&gate_open, 0);
    pthread_t watchdog;
    pthread_create(&watchdog, NULL, gate_watchdog, NULL);
    EXPECT(cudaLaunchHostFunc((cudaStream_t)s1, hold_stream, NULL) == cudaSuccess);
    void *a = NULL, *b = NULL, *c = NULL;
    EXPECT_OK(moert_cuda_pool_alloc(pool, 777777, s1, &a)); /* reused on the same stream: fine */
    EXPECT_OK(moert_cuda_pool_free(pool, a, s1));           /* event recorded behind the held host function */
    moert_cuda_pool_get_stats(pool, &st);
    uint64_t mallocs = st.cuda_malloc_count;
    EXPECT_OK(moert_cuda_pool_alloc(pool, 777777, s2, &b));
    moert_cuda_pool_get_stats(pool, &st);
    EXPECT(b != a);
    EXPECT_EQ_INT(st.cuda_malloc_count, mallocs + 1);
    /* ... but is on s1 itself, stream order makes that safe */
    EXPECT_OK(moert_cuda_pool_alloc(pool, 777777, s1, &c));
    EXPECT(c == a);
    atomic_store(&gate_open, 1);
    pthread_join(watchdog, NULL);
    EXPECT_OK(moert_cuda_pool_free(pool, c, s1));
    EXPECT_OK(moert_cuda_stream_synchronize(s1));
    /* once s1's work is done, its blocks serve s2 without a new cudaMalloc */
    void *d = NULL;
    EXPECT_OK(moert_cuda_pool_alloc(pool, 777777, s2, &d));
    moert_cuda_pool_get_stats(pool, &st);
    EXPECT(d == a);
    EXPECT_EQ_INT(st.cuda_malloc_count, mallocs + 1);
    EXPECT_OK(moert_cuda_pool_free(pool, b, s2));
    EXPECT_OK(moert_cuda_pool_free(pool, d, s2));

    /* bad frees are refused with a message */
    int on_host = 0;
    EXPECT_EQ_INT(moert_cuda_pool_free(pool, &on_host, s1), MOERT_ERR_INVALID_ARGUMENT);
    EXPECT_ERROR_CONTAINS("is not a live block of this pool");
    EXPECT_EQ_INT(moert_cuda_pool_free(pool, d, s2), MOERT_ERR_INVALID_ARGUMENT);
    EXPECT_ERROR_CONTAINS("(freed twice?)");

    /* more than the device has: the cache is released, the retry fails, the error says so */
    EXPECT_OK(moert_cuda_stream_synchronize(s2));
    void *huge = NULL;
    moert_result rc = moert_cuda_pool_alloc(pool, (size_t)1 << 42, s1, &huge);
    EXPECT_EQ_INT(rc, MOERT_ERR_OUT_OF_MEMORY);
    EXPECT_ERROR_CONTAINS("CUDA pool on device 0: cudaMalloc of 4.00 TiB failed after releasing");
    EXPECT(huge == NULL);
    moert_cuda_pool_get_stats(pool, &st);
    EXPECT_EQ_INT(st.oom_retry_count, 1);
    EXPECT_EQ_INT(st.bytes_reserved, 0); /* everything was cached, so everything was released */
    EXPECT(cudaGetLastError() == cudaSuccess);

    /* trim gives back exactly the cached bytes and keeps live blocks */
    void *live = NULL, *cached = NULL;
    EXPECT_OK(moert_cuda_pool_alloc(pool, 4096, s1, &live));
    EXPECT_OK(moert_cuda_pool_alloc(pool, 1u << 21, s1, &cached));
    EXPECT_OK(moert_cuda_pool_free(pool, cached, s1));
    size_t released = 0;
    EXPECT_OK(moert_cuda_pool_trim(pool, &released));
    EXPECT_EQ_INT(released, 1u << 21);
    moert_cuda_pool_get_stats(pool, &st);
    EXPECT_EQ_INT(st.bytes_reserved, 4096);
    EXPECT_EQ_INT(st.bytes_in_use, 4096);
    EXPECT_OK(moert_cuda_pool_free(pool, live, s1));

    pool_with_streams_destroy(pool, s1, s2);
}

/* Under memory pressure (cudaMalloc fails): a block freed on s1 while s1's work is still queued serves s2 behind a
 * stream wait for that work, and a cached block of a larger class (at most twice the size) serves a smaller request,
 * instead of the cache being released (which would wait on the host for all of it and cudaMalloc it again). The
 * device is filled outside the pool first, then given back. */
static void check_pool_pressure(void)
{
    moert_cuda_pool *pool = NULL;
    moert_stream s1 = NULL, s2 = NULL;
    moert_cuda_pool_stats st;
    if (!pool_with_streams(&pool, &s1, &s2)) return;
    const size_t size = 8u << 20;
    void *a = NULL, *b = NULL, *c = NULL, *fill[64];
    int filled = 0;
    EXPECT_OK(moert_cuda_pool_alloc(pool, size, s1, &a));
    atomic_store(&gate_open, 0);
    pthread_t watchdog;
    pthread_create(&watchdog, NULL, gate_watchdog, NULL);
    EXPECT(cudaLaunchHostFunc((cudaStream_t)s1, hold_stream, NULL) == cudaSuccess);
    EXPECT_OK(moert_cuda_pool_free(pool, a, s1)); /* its event behind the held host function */
    size_t free_bytes = 0, total_bytes = 0;
    EXPECT(cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess);
    for (size_t chunk = free_bytes; chunk >= (1u << 20) && filled < 64;) {
        if (cudaMalloc(&fill[filled], chunk) == cudaSuccess)
            filled++;
        else
            (void)cudaGetLastError(), chunk /= 2;
    }
    void *probe = NULL;
    const bool full = cudaMalloc(&probe, size) != cudaSuccess;
    (void)cudaGetLastError();
    if (!full) (void)cudaFree(probe);
    EXPECT(full);
    moert_cuda_pool_get_stats(pool, &st);
    const moert_cuda_pool_stats before = st;
    EXPECT_OK(moert_cuda_pool_alloc(pool, size, s2, &b));
    moert_cuda_pool_get_stats(pool, &st);
    EXPECT(b == a); /* the pending block, not a released and re-made one */
    EXPECT_EQ_INT(st.pressure_reuse_count, before.pressure_reuse_count + 1);
    EXPECT_EQ_INT(st.oom_retry_count, before.oom_retry_count);
    EXPECT_EQ_INT(st.cuda_free_count, before.cuda_free_count);
    EXPECT_EQ_INT(st.bytes_reserved, before.bytes_reserved);
    /* s2 now runs after s1's held work: an event recorded on s2 completes only once s1 is let go */
    cudaEvent_t after = NULL;
    EXPECT(cudaEventCreateWithFlags(&after, cudaEventDisableTiming) == cudaSuccess);
    EXPECT(cudaEventRecord(after, (cudaStream_t)s2) == cudaSuccess);
    usleep(20000);
    EXPECT(cudaEventQuery(after) == cudaErrorNotReady);
    (void)cudaGetLastError();
    atomic_store(&gate_open, 1);
    pthread_join(watchdog, NULL);
    EXPECT_OK(moert_cuda_stream_synchronize(s2));
    EXPECT(cudaEventQuery(after) == cudaSuccess);
    (void)cudaEventDestroy(after);
    /* a 5 MiB request, none of its class cached: the 8 MiB block serves it */
    EXPECT_OK(moert_cuda_pool_free(pool, b, s2));
    EXPECT_OK(moert_cuda_pool_alloc(pool, 5u << 20, s1, &c));
    moert_cuda_pool_get_stats(pool, &st);
    EXPECT(c == a);
    EXPECT_EQ_INT(st.pressure_reuse_count, before.pressure_reuse_count + 2);
    EXPECT_EQ_INT(st.bytes_in_use, size);
    EXPECT_OK(moert_cuda_pool_free(pool, c, s1));
    /* more than twice the size is not taken: a 3 MiB request releases the cache as before */
    void *d = NULL;
    moert_result rc = moert_cuda_pool_alloc(pool, 3u << 20, s1, &d);
    moert_cuda_pool_get_stats(pool, &st);
    EXPECT_EQ_INT(st.pressure_reuse_count, before.pressure_reuse_count + 2);
    EXPECT_EQ_INT(st.oom_retry_count, before.oom_retry_count + 1);
    EXPECT_OK(rc); /* the released 8 MiB make room */
    if (rc == MOERT_OK) EXPECT_OK(moert_cuda_pool_free(pool, d, s1));
    for (int i = 0; i < filled; i++) (void)cudaFree(fill[i]);
    EXPECT(cudaGetLastError() == cudaSuccess);
    pool_with_streams_destroy(pool, s1, s2);
}

/* ---- pinned memory and copies ---- */

static void check_pinned_copies(void)
{
    const size_t n = 1u << 18; /* floats: 1 MiB */
    float *pinned_in = NULL, *pinned_out = NULL;
    float *pageable = calloc(n, sizeof *pageable);
    void *dev = NULL;
    moert_stream s = NULL;
    EXPECT_OK(moert_cuda_host_alloc(n * sizeof(float), (void **)&pinned_in));
    EXPECT_OK(moert_cuda_host_alloc(n * sizeof(float), (void **)&pinned_out));
    EXPECT_OK(moert_cuda_stream_create(0, &s));
    EXPECT(cudaMalloc(&dev, 2 * n * sizeof(float)) == cudaSuccess);
    if (!pinned_in || !pinned_out || !s || !dev || !pageable) goto exit;
    int where = 5;
    EXPECT_OK(moert_cuda_pointer_device(dev, &where));
    EXPECT_EQ_INT(where, 0);
    EXPECT_OK(moert_cuda_pointer_device(pinned_in, &where));
    EXPECT_EQ_INT(where, -1);
    uint64_t seed = 42;
    for (size_t i = 0; i < n; i++) pinned_in[i] = (float)test_uniform(&seed);
    memset(pinned_out, 0, n * sizeof(float));
    moert_event start = NULL, stop = NULL;
    EXPECT_OK(moert_cuda_event_create(0, true, &start));
    EXPECT_OK(moert_cuda_event_create(0, true, &stop));
    EXPECT_OK(moert_cuda_event_record(start, s));
    /* pinned -> device -> device (second half) -> pinned and -> pageable */
    EXPECT_OK(moert_cuda_memcpy_async(dev, pinned_in, n * sizeof(float), s));
    EXPECT_OK(moert_cuda_memcpy_async((float *)dev + n, dev, n * sizeof(float), s));
    EXPECT_OK(moert_cuda_memcpy_async(pinned_out, (float *)dev + n, n * sizeof(float), s));
    EXPECT_OK(moert_cuda_memcpy_async(pageable, dev, n * sizeof(float), s));
    EXPECT_OK(moert_cuda_event_record(stop, s));
    EXPECT_OK(moert_cuda_event_synchronize(stop));
    bool done = false;
    EXPECT_OK(moert_cuda_stream_query(s, &done));
    EXPECT(done);
    float ms = -1.0f;
    EXPECT_OK(moert_cuda_event_elapsed_ms(start, stop, &ms));
    EXPECT(ms >= 0.0f);
    EXPECT(memcmp(pinned_in, pinned_out, n * sizeof(float)) == 0);
    EXPECT(memcmp(pinned_in, pageable, n * sizeof(float)) == 0);
    moert_cuda_event_destroy(start);
    moert_cuda_event_destroy(stop);
exit:
    if (dev) cudaFree(dev);
    moert_cuda_stream_destroy(s);
    moert_cuda_host_free(pinned_in);
    moert_cuda_host_free(pinned_out);
    free(pageable);
}

/* ---- NCCL, a thread per GPU ---- */

typedef struct nccl_test {
    moert_nccl_group *group;
    int world;
    int failures[MAX_RANKS];
} nccl_test;

/* A check inside a rank thread: counts into that rank's slot (EXPECT is not thread-safe). */
#define RANK_EXPECT(t, rank, cond)                                                                                     \
    do {                                                                                                               \
        if (!(cond)) {                                                                                                 \
            fprintf(stderr, "%s:%d: rank %d: expected %s\n", __FILE__, __LINE__, rank, #cond);                         \
            (t)->failures[rank]++;                                                                                     \
        }                                                                                                              \
    } while (0)

#define RANK_OK(t, rank, call)                                                                                         \
    do {                                                                                                               \
        moert_result _r = (call);                                                                                      \
        if (_r != MOERT_OK) {                                                                                          \
            fprintf(stderr, "%s:%d: rank %d: %s failed: %s\n", __FILE__, __LINE__, rank, #call,                        \
                    moert_error_message());                                                                            \
            (t)->failures[rank]++;                                                                                     \
        }                                                                                                              \
    } while (0)

/* Elements rank `from` sends to rank `to` in the alltoallv: uneven, zero for some pairs. */
static size_t a2a_count(int from, int to) { return (size_t)(((from * 3 + to * 5) % 4) * 1000 + (from == to ? 7 : 0)); }

static int32_t a2a_value(int from, int to, size_t j) { return (int32_t)(from * 10000000 + to * 100000 + (int)j); }

static void nccl_rank(int rank, void *user)
{
    nccl_test *t = user;
    int world = t->world;
    moert_nccl_comm *c = NULL;
    moert_stream s = NULL;
    void *d_send = NULL, *d_recv = NULL, *d_peer = NULL, *d_src = NULL;
    float *h_f32 = NULL;
    RANK_OK(t, rank, moert_nccl_comm_init_thread(t->group, rank, rank, &c));
    if (!c) return;
    RANK_EXPECT(t, rank, moert_nccl_comm_rank(c) == rank && moert_nccl_comm_size(c) == world);
    RANK_EXPECT(t, rank, moert_nccl_comm_device(c) == rank && moert_nccl_comm_mode(c) == MOERT_NCCL_THREADS);
    RANK_OK(t, rank, moert_cuda_stream_create(rank, &s));
    const size_t n = 4096;
    size_t bytes = n * world * sizeof(double) + 1024 * 1024;
    RANK_EXPECT(t, rank, cudaMalloc(&d_send, bytes) == cudaSuccess);
    RANK_EXPECT(t, rank, cudaMalloc(&d_recv, bytes) == cudaSuccess);
    h_f32 = calloc(bytes, 1);
    if (!s || !d_send || !d_recv || !h_f32) goto exit;

    /* allgather: rank r contributes r*1000 + i */
    for (size_t i = 0; i < n; i++) h_f32[i] = (float)(rank * 1000 + (int)i);
    RANK_OK(t, rank, moert_cuda_memcpy_async(d_send, h_f32, n * sizeof(float), s));
    RANK_OK(t, rank, moert_nccl_allgather(c, d_send, d_recv, n * sizeof(float), s));
    RANK_OK(t, rank, moert_cuda_memcpy_async(h_f32, d_recv, n * world * sizeof(float), s));
    RANK_OK(t, rank, moert_nccl_stream_wait(c, s, "allgather test"));
    int bad = 0;
    for (int r = 0; r < world; r++)
        for (size_t i = 0; i < n; i++) bad += h_f32[r * n + i] != (float)(r * 1000 + (int)i);
    RANK_EXPECT(t, rank, bad == 0);

    /* allreduce_sum fp32, fp64, int64 */
    for (size_t i = 0; i < n; i++) h_f32[i] = (float)(rank + 1) + 0.5f * (float)i;
    RANK_OK(t, rank, moert_cuda_memcpy_async(d_send, h_f32, n * sizeof(float), s));
    RANK_OK(t, rank, moert_nccl_allreduce_sum(c, d_send, n, MOERT_F32, s));
    RANK_OK(t, rank, moert_cuda_memcpy_async(h_f32, d_send, n * sizeof(float), s));
    RANK_OK(t, rank, moert_nccl_stream_wait(c, s, "allreduce f32 test"));
    bad = 0;
    for (size_t i = 0; i < n; i++)
        bad += fabs(h_f32[i] - ((double)world * (world + 1) / 2 + world * 0.5 * (double)i)) > 1e-3;
    RANK_EXPECT(t, rank, bad == 0);

    double *h_f64 = (double *)h_f32;
    for (size_t i = 0; i < n; i++) h_f64[i] = 0.1 * (rank + 1) * (double)(i + 1);
    RANK_OK(t, rank, moert_cuda_memcpy_async(d_send, h_f64, n * sizeof(double), s));
    RANK_OK(t, rank, moert_nccl_allreduce_sum(c, d_send, n, MOERT_F64, s));
    RANK_OK(t, rank, moert_cuda_memcpy_async(h_f64, d_send, n * sizeof(double), s));
    RANK_OK(t, rank, moert_nccl_stream_wait(c, s, "allreduce f64 test"));
    bad = 0;
    for (size_t i = 0; i < n; i++)
        bad += fabs(h_f64[i] - 0.1 * world * (world + 1) / 2 * (double)(i + 1)) > 1e-9 * (double)(i + 1);
    RANK_EXPECT(t, rank, bad == 0);

    int64_t *h_i64 = (int64_t *)h_f32;
    for (size_t i = 0; i < n; i++) h_i64[i] = ((int64_t)1 << 40) * (rank + 1) + (int64_t)i * rank;
    RANK_OK(t, rank, moert_cuda_memcpy_async(d_send, h_i64, n * sizeof(int64_t), s));
    RANK_OK(t, rank, moert_nccl_allreduce_sum(c, d_send, n, MOERT_I64, s));
    RANK_OK(t, rank, moert_cuda_memcpy_async(h_i64, d_send, n * sizeof(int64_t), s));
    RANK_OK(t, rank, moert_nccl_stream_wait(c, s, "allreduce i64 test"));
    bad = 0;
    int64_t rank_sum = (int64_t)world * (world - 1) / 2;
    for (size_t i = 0; i < n; i++) bad += h_i64[i] != ((int64_t)1 << 40) * (rank_sum + world) + (int64_t)i * rank_sum;
    RANK_EXPECT(t, rank, bad == 0);
    RANK_EXPECT(t, rank, moert_nccl_allreduce_sum(c, d_send, n, MOERT_F8E4M3, s) == MOERT_ERR_UNSUPPORTED);

    /* alltoallv with uneven splits (some zero) */
    size_t send_bytes[MAX_RANKS], send_off[MAX_RANKS], recv_bytes[MAX_RANKS], recv_off[MAX_RANKS];
    size_t so = 0, ro = 0;
    for (int p = 0; p < world; p++) {
        send_bytes[p] = a2a_count(rank, p) * sizeof(int32_t);
        recv_bytes[p] = a2a_count(p, rank) * sizeof(int32_t);
        send_off[p] = so;
        recv_off[p] = ro;
        so += send_bytes[p];
        ro += recv_bytes[p];
    }
    int32_t *h_i32 = (int32_t *)h_f32;
    for (int p = 0; p < world; p++)
        for (size_t j = 0; j < a2a_count(rank, p); j++) h_i32[send_off[p] / 4 + j] = a2a_value(rank, p, j);
    RANK_OK(t, rank, moert_cuda_memcpy_async(d_send, h_i32, so, s));
    RANK_OK(t, rank, moert_cuda_memset_async(d_recv, 0xff, ro, s));
    RANK_OK(t, rank, moert_nccl_alltoallv(c, d_send, send_bytes, send_off, d_recv, recv_bytes, recv_off, s));
    RANK_OK(t, rank, moert_cuda_memcpy_async(h_i32, d_recv, ro, s));
    RANK_OK(t, rank, moert_nccl_stream_wait(c, s, "alltoallv test"));
    bad = 0;
    for (int p = 0; p < world; p++)
        for (size_t j = 0; j < a2a_count(p, rank); j++) bad += h_i32[recv_off[p] / 4 + j] != a2a_value(p, rank, j);
    RANK_EXPECT(t, rank, bad == 0);

    RANK_OK(t, rank, moert_nccl_barrier(c, "after alltoallv"));

    /* peer buffers: rank r writes slot r of every peer's buffer device-to-device, then each reads its own */
    const size_t slot = 256; /* int32 per slot */
    RANK_EXPECT(t, rank, cudaMalloc(&d_peer, slot * world * sizeof(int32_t)) == cudaSuccess);
    RANK_EXPECT(t, rank, cudaMalloc(&d_src, slot * world * sizeof(int32_t)) == cudaSuccess);
    if (!d_peer || !d_src) goto exit;
    RANK_OK(t, rank, moert_cuda_memset_async(d_peer, 0, slot * world * sizeof(int32_t), s));
    for (int p = 0; p < world; p++)
        for (size_t k = 0; k < slot; k++) h_i32[p * slot + k] = rank * 1000000 + p * 1000 + (int32_t)k;
    RANK_OK(t, rank, moert_cuda_memcpy_async(d_src, h_i32, slot * world * sizeof(int32_t), s));
    RANK_OK(t, rank, moert_nccl_stream_wait(c, s, "peer buffer setup"));
    void *peers[MAX_RANKS] = {0};
    RANK_OK(t, rank, moert_nccl_exchange_peer_buffers(c, d_peer, slot * world * sizeof(int32_t), peers));
    RANK_EXPECT(t, rank, peers[rank] == d_peer);
    RANK_OK(t, rank, moert_nccl_barrier(c, "peer buffers zeroed")); /* every buffer zeroed before anyone writes */
    for (int p = 0; p < world; p++) {
        if (!peers[p]) continue;
        RANK_EXPECT(t, rank,
                    cudaMemcpyPeerAsync((int32_t *)peers[p] + rank * slot, p, (int32_t *)d_src + p * slot, rank,
                                        slot * sizeof(int32_t), (cudaStream_t)s) == cudaSuccess);
    }
    RANK_OK(t, rank, moert_nccl_stream_wait(c, s, "peer writes"));
    RANK_OK(t, rank, moert_nccl_barrier(c, "peer writes done"));
    memset(h_i32, 0, slot * world * sizeof(int32_t));
    RANK_OK(t, rank, moert_cuda_memcpy_async(h_i32, d_peer, slot * world * sizeof(int32_t), s));
    RANK_OK(t, rank, moert_nccl_stream_wait(c, s, "peer readback"));
    bad = 0;
    for (int w = 0; w < world; w++)
        for (size_t k = 0; k < slot; k++) bad += h_i32[w * slot + k] != w * 1000000 + rank * 1000 + (int32_t)k;
    RANK_EXPECT(t, rank, bad == 0);
    RANK_OK(t, rank, moert_nccl_barrier(c, "before teardown"));

exit:
    if (d_send) cudaFree(d_send);
    if (d_recv) cudaFree(d_recv);
    if (d_peer) cudaFree(d_peer);
    if (d_src) cudaFree(d_src);
    free(h_f32);
    moert_cuda_stream_destroy(s);
    moert_nccl_comm_free(c);
}

static void check_nccl_threads(int count)
{
    nccl_test t;
    memset(&t, 0, sizeof t);
    t.world = count < MAX_RANKS ? count : MAX_RANKS;
    EXPECT_OK(moert_nccl_group_create(t.world, 60.0, &t.group));
    if (!t.group) return;
    test_run_ranks(t.world, nccl_rank, &t);
    moert_nccl_group_free(t.group);
    for (int r = 0; r < t.world; r++) test_failures += t.failures[r];
    printf("NCCL thread-per-GPU communicator on %d GPUs checked\n", t.world);
}

/* ---- a stalled peer: rank 1 of 2 never joins, rank 0's init must give up in time ---- */

typedef struct stall_result {
    moert_result rc;
    char message[1024];
    double seconds;
    atomic_int finished;
} stall_result;

static void *stalled_init(void *user)
{
    stall_result *out = user;
    moert_nccl_group *g = NULL;
    moert_nccl_comm *c = NULL;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    out->rc = moert_nccl_group_create(2, 3.0, &g);
    if (out->rc == MOERT_OK) out->rc = moert_nccl_comm_init_thread(g, 0, 0, &c);
    snprintf(out->message, sizeof out->message, "%s", moert_error_message());
    clock_gettime(CLOCK_MONOTONIC, &t1);
    out->seconds = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    moert_nccl_comm_free(c);
    moert_nccl_group_free(g);
    atomic_store(&out->finished, 1);
    return NULL;
}

static void check_stalled_peer(void)
{
    static stall_result result; /* static: outlives a thread that never returns */
    atomic_init(&result.finished, 0);
    pthread_t th;
    pthread_create(&th, NULL, stalled_init, &result);
    for (int i = 0; i < 600 && !atomic_load(&result.finished); i++) usleep(100000);
    if (!atomic_load(&result.finished)) {
        fprintf(stderr, "a communicator init with a missing peer did not return within 60 s (3 s timeout)\n");
        fprintf(stderr, "gpu_smoke: FAILED\n");
        fflush(NULL);
        _exit(1);
    }
    pthread_join(th, NULL);
    EXPECT_EQ_INT(result.rc, MOERT_ERR_TIMEOUT);
    if (!strstr(result.message, "did not complete within 3.0 s on rank 0 of 2")) {
        fprintf(stderr, "unexpected stalled-init message: %s\n", result.message);
        test_failures++;
    }
    EXPECT(result.seconds >= 2.5 && result.seconds < 30.0);
    printf("stalled peer: init gave up after %.1f s: %s\n", result.seconds, result.message);
}

int main(void)
{
    int count = -1;
    EXPECT_OK(moert_cuda_device_count(&count));
    if (count == 0) {
        printf("gpu_smoke: no CUDA device, skipped\n");
        return TEST_SKIP;
    }
    check_devices(count);
    check_round_sizes();
    check_pool();
    check_pool_pressure();
    check_pinned_copies();
    if (count >= 2)
        check_nccl_threads(count);
    else
        printf("one GPU: NCCL thread-per-GPU checks skipped\n");
    check_stalled_peer();
    return test_finish("gpu_smoke");
}

#endif
