/* SPDX-License-Identifier: Apache-2.0 */
/* Caching device-memory pool with size classes and stream-ordered reuse (see pool.h). */
#include "pool.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_check.h"
#include "log.h"

#define POOL_MIN_SHIFT      9  /* smallest class: 512 B */
#define POOL_POW2_MAX_SHIFT 20 /* classes are powers of two up to 1 MiB */
#define POOL_MAX_SHIFT      46 /* largest request: 64 TiB, far beyond any device */
#define POOL_CLASS_COUNT    (POOL_POW2_MAX_SHIFT - POOL_MIN_SHIFT + 1 + (POOL_MAX_SHIFT - POOL_POW2_MAX_SHIFT + 1) * 4)
#define POOL_HASH_BUCKETS   1024

typedef struct pool_block {
    void *ptr;
    size_t size;      /* its class size */
    size_t requested; /* while live */
    int size_class;
    bool in_use;
    bool has_stream;     /* false after forget_stream: reuse only through the event */
    cudaStream_t stream; /* the stream it was last freed on */
    cudaEvent_t event;   /* recorded on `stream` at the last free; created at the first free */
    bool reserved;       /* in the pool's reservation (moert_cuda_pool_reserve_begin) */
    struct pool_block *hash_next;
    struct pool_block *free_next;
    struct pool_block *reserve_next; /* the reservation's list of its blocks */
} pool_block;

struct moert_cuda_pool {
    int device;
    pthread_mutex_t mutex;
    pool_block *buckets[POOL_HASH_BUCKETS];
    pool_block *free_lists[POOL_CLASS_COUNT];
    moert_cuda_pool_stats stats;
    /* the reservation: recording while `reserving`; its blocks, and those of them freed (reusable within it) */
    bool reserving, has_reservation;
    cudaStream_t reserve_stream;
    pool_block *reserved;
    pool_block *reserve_free[POOL_CLASS_COUNT];
    size_t reserved_bytes;
};

/* floor(log2(n)) for n > 0. */
static int floor_log2(size_t n) { return 63 - __builtin_clzll((unsigned long long)n); }

/* The class of a request: its index and the size it is rounded up to. False if too large. */
static bool size_class_of(size_t bytes, int *index, size_t *class_size)
{
    if (bytes <= ((size_t)1 << POOL_MIN_SHIFT)) {
        *index = 0;
        *class_size = (size_t)1 << POOL_MIN_SHIFT;
        return true;
    }
    if (bytes <= ((size_t)1 << POOL_POW2_MAX_SHIFT)) {
        int e = floor_log2(bytes - 1) + 1; /* the next power of two */
        *index = e - POOL_MIN_SHIFT;
        *class_size = (size_t)1 << e;
        return true;
    }
    int e = floor_log2(bytes);
    if (e >= POOL_MAX_SHIFT) return false;
    size_t step = (size_t)1 << (e - 2); /* four classes per power of two */
    size_t rounded = (bytes + step - 1) / step * step;
    *index = (POOL_POW2_MAX_SHIFT - POOL_MIN_SHIFT + 1) + (e - POOL_POW2_MAX_SHIFT) * 4 + (int)(rounded / step - 4);
    *class_size = rounded;
    return true;
}

/* The size of class `index` (size_class_of's inverse). */
static size_t class_size_at(int index)
{
    const int pow2_classes = POOL_POW2_MAX_SHIFT - POOL_MIN_SHIFT + 1;
    if (index < pow2_classes) return (size_t)1 << (index + POOL_MIN_SHIFT);
    const int k = index - pow2_classes;
    return (size_t)(4 + k % 4) << (POOL_POW2_MAX_SHIFT + k / 4 - 2);
}

size_t moert_cuda_pool_round_size(size_t bytes)
{
    int index;
    size_t size;
    return size_class_of(bytes, &index, &size) ? size : 0;
}

/* "1.50 GiB": a size for messages. */
static const char *format_bytes(size_t bytes, char *buf, size_t len)
{
    const char *units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double v = (double)bytes;
    int u = 0;
    while (v >= 1024.0 && u < 4) {
        v /= 1024.0;
        u++;
    }
    snprintf(buf, len, u == 0 ? "%.0f %s" : "%.2f %s", v, units[u]);
    return buf;
}

static size_t hash_ptr(const void *ptr)
{
    uint64_t x = (uint64_t)(uintptr_t)ptr >> POOL_MIN_SHIFT;
    x *= 0x9e3779b97f4a7c15ull;
    return (size_t)(x >> 32) % POOL_HASH_BUCKETS;
}

/* Makes the pool's device current, remembering the previous one. */
static moert_result enter_device(int device, int *prev)
{
    moert_result rc = MOERT_OK;
    MOERT_CUDA_CHECK(cudaGetDevice(prev));
    if (*prev != device) MOERT_CUDA_CHECK(cudaSetDevice(device));
fail:
    return rc;
}

static void restore_device(int device, int prev)
{
    if (prev != device) (void)cudaSetDevice(prev);
}

moert_result moert_cuda_pool_create(int device, moert_cuda_pool **out)
{
    moert_result rc = MOERT_OK;
    *out = NULL;
    moert_cuda_pool *pool = calloc(1, sizeof *pool);
    MOERT_CHECK_ALLOC(pool);
    pool->device = device;
    pool->stats.device = device;
    pthread_mutex_init(&pool->mutex, NULL);
    *out = pool;
fail:
    return rc;
}

int moert_cuda_pool_device(const moert_cuda_pool *pool) { return pool->device; }

/* Takes a reusable block of class `index` off its free list, or returns NULL: first one last freed on
 * `stream`, else one whose free-time event has completed. Caller holds the mutex. */
static pool_block *take_cached(moert_cuda_pool *pool, int index, cudaStream_t stream)
{
    pool_block **link;
    for (link = &pool->free_lists[index]; *link; link = &(*link)->free_next) {
        if ((*link)->has_stream && (*link)->stream == stream) break;
    }
    if (!*link) {
        for (link = &pool->free_lists[index]; *link; link = &(*link)->free_next) {
            cudaError_t err = cudaEventQuery((*link)->event);
            if (err == cudaSuccess) break;
            if (err != cudaErrorNotReady)
                moert_log(MOERT_LOG_WARN, "CUDA pool on device %d: cudaEventQuery: %s", pool->device,
                          cudaGetErrorString(err));
            (void)cudaGetLastError();
        }
    }
    pool_block *b = *link;
    if (b) {
        *link = b->free_next;
        b->free_next = NULL;
    }
    return b;
}

/* Under memory pressure (cudaMalloc failed): a cached block for a request of class `index` on `stream` without
 * releasing the cache, which would wait on the host for every cached block's work and leave the next steps to
 * cudaMalloc it all again. First one of the class itself freed on another stream whose work is still pending,
 * handed over behind a stream wait for it (cudaStreamWaitEvent: `stream` runs after that work, the host does not
 * wait); then one of a larger class, at most twice the size: reusable at once (take_cached), else the same way.
 * NULL while `stream` is capturing a graph (a wait on an event recorded outside the capture is not allowed there), or
 * if no such block is cached. Caller holds the mutex and has the pool's device current. */
static pool_block *take_under_pressure(moert_cuda_pool *pool, int index, size_t class_size, cudaStream_t stream)
{
    enum cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess || capture != cudaStreamCaptureStatusNone) {
        (void)cudaGetLastError();
        return NULL;
    }
    for (int c = index; c < POOL_CLASS_COUNT && class_size_at(c) <= 2 * class_size; c++) {
        pool_block *b = pool->free_lists[c];
        if (!b) continue;
        pool_block *ready = c > index ? take_cached(pool, c, stream) : NULL;
        if (ready) return ready;
        if (cudaStreamWaitEvent(stream, b->event, 0) != cudaSuccess) {
            moert_log(MOERT_LOG_WARN, "CUDA pool on device %d: cudaStreamWaitEvent: %s", pool->device,
                      cudaGetErrorString(cudaGetLastError()));
            return NULL;
        }
        pool->free_lists[c] = b->free_next;
        b->free_next = NULL;
        return b;
    }
    return NULL;
}

/* Gives every cached block back to CUDA once its pending work is done. Caller holds the mutex and has the
 * pool's device current. */
static size_t release_cached(moert_cuda_pool *pool)
{
    size_t released = 0;
    for (int c = 0; c < POOL_CLASS_COUNT; c++) {
        while (pool->free_lists[c]) {
            pool_block *b = pool->free_lists[c];
            pool->free_lists[c] = b->free_next;
            (void)cudaEventSynchronize(b->event);
            (void)cudaEventDestroy(b->event);
            (void)cudaFree(b->ptr);
            (void)cudaGetLastError();
            pool_block **link = &pool->buckets[hash_ptr(b->ptr)];
            while (*link != b) link = &(*link)->hash_next;
            *link = b->hash_next;
            released += b->size;
            pool->stats.bytes_reserved -= b->size;
            pool->stats.bytes_cached -= b->size;
            pool->stats.cached_blocks--;
            pool->stats.cuda_free_count++;
            free(b);
        }
    }
    return released;
}

/* Adds a block to the pool's reservation (once). Caller holds the mutex. */
static void reserve_block(moert_cuda_pool *pool, pool_block *b)
{
    if (b->reserved) return;
    b->reserved = true;
    b->reserve_next = pool->reserved;
    pool->reserved = b;
    pool->reserved_bytes += b->size;
}

/* Marks a block live for a request of `bytes` and updates the figures. Caller holds the mutex. */
static void mark_live(moert_cuda_pool *pool, pool_block *b, size_t bytes)
{
    b->in_use = true;
    b->requested = bytes;
    pool->stats.alloc_count++;
    pool->stats.live_blocks++;
    pool->stats.bytes_in_use += b->size;
    pool->stats.bytes_requested += bytes;
    if (pool->stats.bytes_in_use > pool->stats.peak_bytes_in_use)
        pool->stats.peak_bytes_in_use = pool->stats.bytes_in_use;
    if (pool->stats.bytes_reserved > pool->stats.peak_bytes_reserved)
        pool->stats.peak_bytes_reserved = pool->stats.bytes_reserved;
}

/* A cached block taken off a free list, live again for a request of `bytes`: its pointer. Caller holds the mutex. */
static void *hand_out_cached(moert_cuda_pool *pool, pool_block *b, size_t bytes)
{
    pool->stats.cached_blocks--;
    pool->stats.bytes_cached -= b->size;
    mark_live(pool, b, bytes);
    return b->ptr;
}

moert_result moert_cuda_pool_alloc(moert_cuda_pool *pool, size_t bytes, moert_stream stream, void **out)
{
    moert_result rc = MOERT_OK;
    int index, prev = pool->device;
    size_t size;
    bool locked = false, entered = false;
    pool_block *b = NULL;
    char b1[32], b2[32], b3[32], b4[32];
    *out = NULL;
    if (!size_class_of(bytes, &index, &size)) {
        rc = moert_error(MOERT_ERR_OUT_OF_MEMORY, "CUDA pool on device %d: a request of %zu bytes is too large",
                         pool->device, bytes);
        goto fail;
    }
    pthread_mutex_lock(&pool->mutex);
    locked = true;

    bool recording = pool->reserving && (cudaStream_t)stream == pool->reserve_stream;
    if (recording && pool->reserve_free[index]) {
        b = pool->reserve_free[index];
        pool->reserve_free[index] = b->free_next;
        b->free_next = NULL;
        pool->stats.reuse_count++;
        *out = hand_out_cached(pool, b, bytes);
        goto exit;
    }
    b = take_cached(pool, index, (cudaStream_t)stream);
    if (b) {
        if (recording) reserve_block(pool, b);
        pool->stats.reuse_count++;
        *out = hand_out_cached(pool, b, bytes);
        goto exit;
    }

    MOERT_CHECK(enter_device(pool->device, &prev));
    entered = true;
    void *ptr = NULL;
    cudaError_t err = cudaMalloc(&ptr, size);
    if (err == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();
        b = take_under_pressure(pool, index, size, (cudaStream_t)stream);
        if (b) {
            if (recording) reserve_block(pool, b);
            pool->stats.pressure_reuse_count++;
            *out = hand_out_cached(pool, b, bytes);
            goto exit;
        }
        size_t released = release_cached(pool);
        pool->stats.oom_retry_count++;
        err = cudaMalloc(&ptr, size);
        if (err == cudaErrorMemoryAllocation) {
            (void)cudaGetLastError();
            size_t free_bytes = 0, total_bytes = 0;
            (void)cudaMemGetInfo(&free_bytes, &total_bytes);
            (void)cudaGetLastError();
            rc = moert_error(MOERT_ERR_OUT_OF_MEMORY,
                             "CUDA pool on device %d: cudaMalloc of %s failed after releasing %s of cached blocks: "
                             "out of memory (pool: %s in use, %s reserved; device: %s free)",
                             pool->device, format_bytes(size, b1, sizeof b1), format_bytes(released, b2, sizeof b2),
                             format_bytes(pool->stats.bytes_in_use, b3, sizeof b3),
                             format_bytes(pool->stats.bytes_reserved, b4, sizeof b4),
                             format_bytes(free_bytes, b1, sizeof b1));
            goto fail;
        }
    }
    MOERT_CUDA_CHECK(err);
    b = calloc(1, sizeof *b);
    if (!b) {
        (void)cudaFree(ptr);
        MOERT_CHECK_ALLOC(b);
    }
    b->ptr = ptr;
    b->size = size;
    b->size_class = index;
    size_t h = hash_ptr(ptr);
    b->hash_next = pool->buckets[h];
    pool->buckets[h] = b;
    pool->stats.cuda_malloc_count++;
    pool->stats.bytes_reserved += size;
    if (recording) reserve_block(pool, b);
    mark_live(pool, b, bytes);
    *out = ptr;
exit:
fail:
    if (entered) restore_device(pool->device, prev);
    if (locked) pthread_mutex_unlock(&pool->mutex);
    return rc;
}

moert_result moert_cuda_pool_free(moert_cuda_pool *pool, void *ptr, moert_stream stream)
{
    moert_result rc = MOERT_OK;
    int prev = pool->device;
    bool entered = false;
    if (!ptr) return MOERT_OK;
    pthread_mutex_lock(&pool->mutex);
    pool_block *b = pool->buckets[hash_ptr(ptr)];
    while (b && b->ptr != ptr) b = b->hash_next;
    if (!b || !b->in_use) {
        rc = moert_error(MOERT_ERR_INVALID_ARGUMENT, "CUDA pool on device %d: %p is not a live block of this pool%s",
                         pool->device, ptr, b ? " (freed twice?)" : "");
        goto fail;
    }
    bool recording = pool->reserving && (cudaStream_t)stream == pool->reserve_stream;
    if (recording || b->reserved) {
        /* the reservation keeps it: reusable by the reservation's stream while recording, else only at release */
        if (recording) reserve_block(pool, b);
        b->in_use = false;
        b->free_next = pool->reserve_free[b->size_class];
        pool->reserve_free[b->size_class] = b;
    } else {
        MOERT_CHECK(enter_device(pool->device, &prev));
        entered = true;
        if (!b->event) MOERT_CUDA_CHECK(cudaEventCreateWithFlags(&b->event, cudaEventDisableTiming));
        MOERT_CUDA_CHECK(cudaEventRecord(b->event, (cudaStream_t)stream));
        b->in_use = false;
        b->has_stream = true;
        b->stream = (cudaStream_t)stream;
        b->free_next = pool->free_lists[b->size_class];
        pool->free_lists[b->size_class] = b;
    }
    pool->stats.live_blocks--;
    pool->stats.bytes_in_use -= b->size;
    pool->stats.bytes_requested -= b->requested;
    pool->stats.cached_blocks++;
    pool->stats.bytes_cached += b->size;
    b->requested = 0;
fail:
    if (entered) restore_device(pool->device, prev);
    pthread_mutex_unlock(&pool->mutex);
    return rc;
}

moert_result moert_cuda_pool_reserve_begin(moert_cuda_pool *pool, moert_stream stream)
{
    moert_result rc = MOERT_OK;
    pthread_mutex_lock(&pool->mutex);
    if (pool->has_reservation) {
        rc = moert_error(MOERT_ERR_INVALID_ARGUMENT, "CUDA pool on device %d: a reservation is already open",
                         pool->device);
    } else {
        pool->has_reservation = pool->reserving = true;
        pool->reserve_stream = (cudaStream_t)stream;
    }
    pthread_mutex_unlock(&pool->mutex);
    return rc;
}

moert_result moert_cuda_pool_reserve_resume(moert_cuda_pool *pool, moert_stream stream)
{
    moert_result rc = MOERT_OK;
    pthread_mutex_lock(&pool->mutex);
    if (pool->has_reservation && pool->reserve_stream != (cudaStream_t)stream)
        rc = moert_error(MOERT_ERR_INVALID_ARGUMENT, "CUDA pool on device %d: the open reservation is another stream's",
                         pool->device);
    else
        pool->has_reservation = pool->reserving = true, pool->reserve_stream = (cudaStream_t)stream;
    pthread_mutex_unlock(&pool->mutex);
    return rc;
}

void moert_cuda_pool_reserve_end(moert_cuda_pool *pool)
{
    pthread_mutex_lock(&pool->mutex);
    pool->reserving = false;
    /* freed blocks wait for the release: no later request takes them */
    pthread_mutex_unlock(&pool->mutex);
}

moert_result moert_cuda_pool_reserve_release(moert_cuda_pool *pool)
{
    moert_result rc = MOERT_OK;
    int prev = pool->device;
    bool entered = false;
    pthread_mutex_lock(&pool->mutex);
    if (!pool->has_reservation) goto fail;
    MOERT_CHECK(enter_device(pool->device, &prev));
    entered = true;
    memset(pool->reserve_free, 0, sizeof pool->reserve_free);
    while (pool->reserved) {
        pool_block *b = pool->reserved;
        pool->reserved = b->reserve_next;
        b->reserve_next = NULL;
        b->reserved = false;
        if (b->in_use) { /* still live for its user: counted as freed now */
            b->in_use = false;
            pool->stats.live_blocks--;
            pool->stats.bytes_in_use -= b->size;
            pool->stats.bytes_requested -= b->requested;
            pool->stats.cached_blocks++;
            pool->stats.bytes_cached += b->size;
            b->requested = 0;
        }
        if (!b->event) MOERT_CUDA_CHECK(cudaEventCreateWithFlags(&b->event, cudaEventDisableTiming));
        MOERT_CUDA_CHECK(cudaEventRecord(b->event, pool->reserve_stream));
        b->has_stream = true;
        b->stream = pool->reserve_stream;
        b->free_next = pool->free_lists[b->size_class];
        pool->free_lists[b->size_class] = b;
    }
    pool->reserved_bytes = 0;
    pool->has_reservation = pool->reserving = false;
fail:
    if (entered) restore_device(pool->device, prev);
    pthread_mutex_unlock(&pool->mutex);
    return rc;
}

size_t moert_cuda_pool_reserved_bytes(const moert_cuda_pool *pool) { return pool->reserved_bytes; }

void moert_cuda_pool_forget_stream(moert_cuda_pool *pool, moert_stream stream)
{
    pthread_mutex_lock(&pool->mutex);
    for (int c = 0; c < POOL_CLASS_COUNT; c++)
        for (pool_block *b = pool->free_lists[c]; b; b = b->free_next)
            if (b->has_stream && b->stream == (cudaStream_t)stream) b->has_stream = false;
    pthread_mutex_unlock(&pool->mutex);
}

moert_result moert_cuda_pool_trim(moert_cuda_pool *pool, size_t *released)
{
    moert_result rc = MOERT_OK;
    int prev = pool->device;
    size_t n = 0;
    pthread_mutex_lock(&pool->mutex);
    MOERT_CHECK(enter_device(pool->device, &prev));
    n = release_cached(pool);
    restore_device(pool->device, prev);
fail:
    pthread_mutex_unlock(&pool->mutex);
    if (released) *released = n;
    return rc;
}

void moert_cuda_pool_get_stats(moert_cuda_pool *pool, moert_cuda_pool_stats *out)
{
    pthread_mutex_lock(&pool->mutex);
    *out = pool->stats;
    pthread_mutex_unlock(&pool->mutex);
}

void moert_cuda_pool_reset_peaks(moert_cuda_pool *pool)
{
    pthread_mutex_lock(&pool->mutex);
    pool->stats.peak_bytes_in_use = pool->stats.bytes_in_use;
    pool->stats.peak_bytes_reserved = pool->stats.bytes_reserved;
    pthread_mutex_unlock(&pool->mutex);
}

void moert_cuda_pool_destroy(moert_cuda_pool *pool)
{
    if (!pool) return;
    int prev = pool->device;
    pthread_mutex_lock(&pool->mutex);
    bool entered = enter_device(pool->device, &prev) == MOERT_OK;
    if (pool->stats.live_blocks)
        moert_log(MOERT_LOG_WARN, "CUDA pool on device %d destroyed with %llu live block(s) (%zu bytes) still in use",
                  pool->device, (unsigned long long)pool->stats.live_blocks, pool->stats.bytes_in_use);
    (void)cudaDeviceSynchronize();
    for (int h = 0; h < POOL_HASH_BUCKETS; h++) {
        while (pool->buckets[h]) {
            pool_block *b = pool->buckets[h];
            pool->buckets[h] = b->hash_next;
            if (b->event) (void)cudaEventDestroy(b->event);
            (void)cudaFree(b->ptr);
            free(b);
        }
    }
    (void)cudaGetLastError();
    if (entered) restore_device(pool->device, prev);
    pthread_mutex_unlock(&pool->mutex);
    pthread_mutex_destroy(&pool->mutex);
    free(pool);
}
