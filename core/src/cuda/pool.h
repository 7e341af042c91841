/* SPDX-License-Identifier: Apache-2.0 */
/* A caching device-memory pool, one per CUDA device.
 *
 * Requests are rounded up to a size class (powers of two from 512 B to 1 MiB; above that, four classes per
 * power of two, so at most 25% is wasted); freed blocks stay cached in a free list per class and serve later
 * requests of the same class, so a steady state (the same allocations every step) makes no cudaMalloc.
 *
 * Stream-ordered safety: a block is freed "on" the stream that last used it (work may still be queued there).
 * It is handed out again at once to a request on that same stream (stream order makes that safe); to a
 * request on another stream only once the event recorded at the free has completed, or, when cudaMalloc fails,
 * behind a wait of the requesting stream for that event (and a larger cached block, up to twice the size, may serve
 * then), before the cache is released. If several streams used
 * a block, make the freeing stream wait for the others first. Before destroying a stream that freed blocks,
 * call moert_cuda_pool_forget_stream (a new stream could otherwise get the same handle).
 *
 * Thread-safe (one mutex per pool). During CUDA graph capture, allocate only inside a reservation (below).
 */
#ifndef MOERT_CORE_CUDA_POOL_H
#define MOERT_CORE_CUDA_POOL_H

#include <stddef.h>
#include <stdint.h>

#include "moert/plugin.h"

typedef struct moert_cuda_pool moert_cuda_pool;

/* Figures for memory reports. Sizes in bytes. */
typedef struct moert_cuda_pool_stats {
    int device;
    size_t bytes_in_use;    /* size classes of live blocks */
    size_t bytes_requested; /* what callers asked for, of live blocks */
    size_t peak_bytes_in_use;
    size_t bytes_reserved; /* held from cudaMalloc: live plus cached blocks */
    size_t peak_bytes_reserved;
    size_t bytes_cached; /* reserved but free, ready for reuse */
    uint64_t live_blocks, cached_blocks;
    uint64_t alloc_count;       /* requests served */
    uint64_t reuse_count;       /* requests served from the cache, without cudaMalloc */
    uint64_t cuda_malloc_count; /* successful cudaMalloc calls */
    uint64_t cuda_free_count;   /* cudaFree calls (trim, out-of-memory retry, destroy) */
    uint64_t oom_retry_count;   /* cudaMalloc failures answered by releasing the cache and retrying */
    /* cudaMalloc failures answered without releasing the cache: a cached block freed on another stream, behind a
     * stream wait for its pending work, or of a larger class (at most twice the size) */
    uint64_t pressure_reuse_count;
} moert_cuda_pool_stats;

moert_result moert_cuda_pool_create(int device, moert_cuda_pool **out);
/* Waits for pending frees and gives every block back to CUDA, live ones too (logged as a warning). */
void moert_cuda_pool_destroy(moert_cuda_pool *pool);
int moert_cuda_pool_device(const moert_cuda_pool *pool);

/* A block of at least `bytes` (0 is allowed: the smallest class), to be used on `stream` first.
 * When cudaMalloc fails, the cache is released and the call retried once; then MOERT_ERR_OUT_OF_MEMORY. */
moert_result moert_cuda_pool_alloc(moert_cuda_pool *pool, size_t bytes, moert_stream stream, void **out);
/* Returns a block; `stream` is the last stream that used it. NULL ptr: nothing. A pointer the pool did not
 * hand out: MOERT_ERR_INVALID_ARGUMENT. */
moert_result moert_cuda_pool_free(moert_cuda_pool *pool, void *ptr, moert_stream stream);
/* The size class `bytes` is rounded up to (what an allocation really takes). */
size_t moert_cuda_pool_round_size(size_t bytes);

/*
 * Reservations, for CUDA graphs. Between reserve_begin and reserve_end every block handed out for `stream`, and every
 * block freed on it, joins the reservation: a freed one serves only later requests on that stream within the
 * reservation (stream order makes that safe, and no event is recorded, so the stream may be capturing), and none goes
 * back to the free lists until moert_cuda_pool_reserve_release. So every address a captured graph uses stays the
 * graph's for as long as it lives. Requests on other streams are served as usual, never from the reservation. A block
 * of the reservation freed after reserve_end stays reserved. One reservation per pool at a time.
 */
moert_result moert_cuda_pool_reserve_begin(moert_cuda_pool *pool, moert_stream stream);
void moert_cuda_pool_reserve_end(moert_cuda_pool *pool);
/* Records into the open reservation again after reserve_end (a later capture of more graphs on the same stream: they
 * share its freed blocks, which stream order makes safe); begins one if none is open. */
moert_result moert_cuda_pool_reserve_resume(moert_cuda_pool *pool, moert_stream stream);
/* Gives every reserved block back, live ones included, as freed on the reservation's stream (the graphs that used
 * them must be destroyed, or at least never launched again). */
moert_result moert_cuda_pool_reserve_release(moert_cuda_pool *pool);
/* Bytes (size classes) in the reservation. */
size_t moert_cuda_pool_reserved_bytes(const moert_cuda_pool *pool);

/* Cached blocks freed on `stream` become reusable only through their events (call before destroying it). */
void moert_cuda_pool_forget_stream(moert_cuda_pool *pool, moert_stream stream);
/* Gives cached (free) blocks back to CUDA after their pending work completes; *released gets the bytes
 * (may be NULL). Live blocks are untouched. */
moert_result moert_cuda_pool_trim(moert_cuda_pool *pool, size_t *released);

void moert_cuda_pool_get_stats(moert_cuda_pool *pool, moert_cuda_pool_stats *out);
/* Peaks restart from the current figures (e.g. at the start of a measured step). */
void moert_cuda_pool_reset_peaks(moert_cuda_pool *pool);

#endif
