/* SPDX-License-Identifier: Apache-2.0 */
/* Host services: the moert_host table handed to one plugin instance.
 *
 * Device-specific work goes through the small device_* functions below: the CPU (and pinned host memory,
 * which on the CPU is plain memory) is served directly; CUDA devices through core/src/cuda (the caching
 * pool, streams and events, and NCCL for collectives on device buffers).
 */
#include "host.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "error.h"
#include "log.h"
#ifdef MOERT_HAVE_CUDA
#include "cuda/comm_nccl.h"
#include "cuda/device.h"
#include "cuda/pool.h"
#endif

#define HOST_MESSAGE_SIZE 4096
#define HOST_ALIGNMENT    64

typedef struct host_impl {
    moert_host table; /* what the plugin sees; table.impl points back here */
    char who[256];
    moert_section *options; /* borrowed, or owned_options */
    moert_section *owned_options;
    moert_comm_group *comm; /* NULL: a world of one */
    moert_device device;
    moert_metric_sink metric;
    void *metric_user;
    struct moert_cuda_pool *pool; /* CUDA ranks: device memory */
    struct moert_nccl_comm *nccl; /* CUDA ranks: collectives on device buffers */
    moert_stream stream;          /* CUDA ranks: the stream allocations are ordered on */
    char error[HOST_MESSAGE_SIZE];
    char taken[HOST_MESSAGE_SIZE];
    bool flags_set; /* the plugin called set_flags */
    uint32_t flags; /* what it declared */
} host_impl;

static host_impl *impl_of(const moert_host *h) { return (host_impl *)h->impl; }
static void host_set_flags(const moert_host *h, uint32_t flags);

/* Stores a message for the plugin's next returned code (and in the thread's error), returns code. */
static moert_result host_fail(host_impl *impl, moert_result code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static moert_result host_fail(host_impl *impl, moert_result code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(impl->error, sizeof impl->error, fmt, ap);
    va_end(ap);
    return moert_error(code, "%s", impl->error);
}

/* Copies the thread's last error (set by the config or comm modules) into the host's message. */
static moert_result host_keep_error(host_impl *impl, moert_result code)
{
    if (code != MOERT_OK) snprintf(impl->error, sizeof impl->error, "%s", moert_error_message());
    return code;
}

/* ---- device-specific parts ---- */

/* Memory the CPU can touch directly: plain host memory and pinned host memory. */
static bool device_is_host(moert_device dev)
{
    return dev.type == MOERT_DEVICE_CPU || dev.type == MOERT_DEVICE_CUDA_HOST;
}

/* The message for a device this build cannot serve yet. */
static moert_result device_unsupported(host_impl *impl, const char *what, moert_device dev)
{
    const char *type = dev.type == MOERT_DEVICE_CUDA ? "cuda" : "unknown";
    return host_fail(impl, MOERT_ERR_UNSUPPORTED, "%s: %s:%d is not supported by this host (CPU only)", what, type,
                     (int)dev.id);
}

/* 64-byte aligned, zeroed memory on dev. */
static moert_result device_alloc(host_impl *impl, moert_device dev, size_t bytes, void **out)
{
    *out = NULL;
#ifdef MOERT_HAVE_CUDA
    if (dev.type == MOERT_DEVICE_CUDA && impl->pool)
        return host_keep_error(impl, moert_cuda_pool_alloc(impl->pool, bytes ? bytes : 1, impl->stream, out));
    if (dev.type == MOERT_DEVICE_CUDA_HOST && impl->pool)
        return host_keep_error(impl, moert_cuda_host_alloc(bytes ? bytes : 1, out));
#endif
    if (!device_is_host(dev)) return device_unsupported(impl, "alloc", dev);
    size_t rounded = (bytes + HOST_ALIGNMENT - 1) / HOST_ALIGNMENT * HOST_ALIGNMENT;
    if (rounded == 0) rounded = HOST_ALIGNMENT;
    if (rounded < bytes) return host_fail(impl, MOERT_ERR_OUT_OF_MEMORY, "alloc: %zu bytes is too large", bytes);
    void *p = aligned_alloc(HOST_ALIGNMENT, rounded);
    if (!p) return host_fail(impl, MOERT_ERR_OUT_OF_MEMORY, "alloc: out of memory for %zu bytes", bytes);
    memset(p, 0, rounded);
    *out = p;
    return MOERT_OK;
}

static void device_free(host_impl *impl, moert_device dev, void *ptr)
{
#ifdef MOERT_HAVE_CUDA
    if (dev.type == MOERT_DEVICE_CUDA && impl->pool) {
        if (ptr) moert_cuda_pool_free(impl->pool, ptr, impl->stream);
        return;
    }
    if (dev.type == MOERT_DEVICE_CUDA_HOST && impl->pool) {
        moert_cuda_host_free(ptr);
        return;
    }
#endif
    if (device_is_host(dev)) free(ptr);
}

/* Copies bytes between two places (stream-ordered on devices; synchronous on the CPU). */
static moert_result device_memcpy(host_impl *impl, void *dst, moert_device dst_dev, const void *src,
                                  moert_device src_dev, size_t bytes, moert_stream stream)
{
#ifdef MOERT_HAVE_CUDA
    if (impl->pool && (dst_dev.type != MOERT_DEVICE_CPU || src_dev.type != MOERT_DEVICE_CPU))
        return bytes ? host_keep_error(impl, moert_cuda_memcpy_async(dst, src, bytes, stream)) : MOERT_OK;
#endif
    if (!device_is_host(dst_dev)) return device_unsupported(impl, "memcpy_async", dst_dev);
    if (!device_is_host(src_dev)) return device_unsupported(impl, "memcpy_async", src_dev);
    if (bytes) memmove(dst, src, bytes);
    return MOERT_OK;
}

/* Streams and events are NULL handles on the CPU, where work is synchronous. */
static moert_result device_stream_create(host_impl *impl, moert_stream *out)
{
    *out = NULL;
#ifdef MOERT_HAVE_CUDA
    if (impl->pool) return host_keep_error(impl, moert_cuda_stream_create(impl->device.id, out));
#endif
    if (!device_is_host(impl->device)) return device_unsupported(impl, "stream_create", impl->device);
    return MOERT_OK;
}

static moert_result device_event_create(host_impl *impl, moert_event *out)
{
    *out = NULL;
#ifdef MOERT_HAVE_CUDA
    if (impl->pool) return host_keep_error(impl, moert_cuda_event_create(impl->device.id, false, out));
#endif
    if (!device_is_host(impl->device)) return device_unsupported(impl, "event_create", impl->device);
    return MOERT_OK;
}

/* Record, wait and synchronize: nothing to do on the CPU. */
static moert_result device_stream_op(host_impl *impl, const char *what)
{
    if (!device_is_host(impl->device)) return device_unsupported(impl, what, impl->device);
    return MOERT_OK;
}

/* Collectives move host memory here; device buffers need the CUDA/NCCL path. */
static moert_result device_check_comm(host_impl *impl, const char *what, moert_device dev)
{
    if (!device_is_host(dev)) return device_unsupported(impl, what, dev);
    return MOERT_OK;
}

#ifdef MOERT_HAVE_CUDA
/* One rank per process (no threads communicator): collectives on host buffers go through NCCL by way of
 * device staging buffers from the pool, on the instance's stream, and wait for the copy back (bounded). */
static bool staged_comm(const host_impl *impl, const moert_host *h, moert_device dev)
{
    return device_is_host(dev) && !impl->comm && impl->nccl && impl->pool && h->world_size > 1;
}

typedef enum staged_op { STAGED_ALLGATHER, STAGED_ALLREDUCE, STAGED_ALLTOALLV } staged_op;

typedef struct staged_args {
    staged_op op;
    const void *send;
    void *recv;
    size_t send_bytes, recv_bytes; /* extents of the host regions */
    size_t bytes_per_rank;         /* allgather */
    size_t count;                  /* allreduce */
    moert_dtype dtype;
    const size_t *sb, *so, *rb, *ro; /* alltoallv */
} staged_args;

static moert_result staged_collective(host_impl *impl, const staged_args *a)
{
    moert_result rc = MOERT_OK;
    void *d_send = NULL, *d_recv = NULL;
    MOERT_CHECK(moert_cuda_pool_alloc(impl->pool, a->send_bytes ? a->send_bytes : 1, impl->stream, &d_send));
    MOERT_CHECK(moert_cuda_pool_alloc(impl->pool, a->recv_bytes ? a->recv_bytes : 1, impl->stream, &d_recv));
    if (a->send_bytes) MOERT_CHECK(moert_cuda_memcpy_async(d_send, a->send, a->send_bytes, impl->stream));
    switch (a->op) {
    case STAGED_ALLGATHER:
        MOERT_CHECK(moert_nccl_allgather(impl->nccl, d_send, d_recv, a->bytes_per_rank, impl->stream));
        break;
    case STAGED_ALLREDUCE:
        MOERT_CHECK(moert_nccl_allreduce_sum(impl->nccl, d_send, a->count, a->dtype, impl->stream));
        MOERT_CHECK(moert_cuda_memcpy_async(d_recv, d_send, a->recv_bytes, impl->stream));
        break;
    case STAGED_ALLTOALLV:
        MOERT_CHECK(moert_nccl_alltoallv(impl->nccl, d_send, a->sb, a->so, d_recv, a->rb, a->ro, impl->stream));
        break;
    }
    if (a->recv_bytes) MOERT_CHECK(moert_cuda_memcpy_async(a->recv, d_recv, a->recv_bytes, impl->stream));
    MOERT_CHECK(moert_nccl_stream_wait(impl->nccl, impl->stream, "a collective on host buffers"));
fail:
    if (d_send) moert_cuda_pool_free(impl->pool, d_send, impl->stream);
    if (d_recv) moert_cuda_pool_free(impl->pool, d_recv, impl->stream);
    return host_keep_error(impl, rc);
}

/* The end of the furthest region of an alltoallv side. */
static size_t region_extent(int world, const size_t *bytes, const size_t *offsets)
{
    size_t end = 0;
    for (int r = 0; r < world; r++)
        if (bytes[r] && offsets[r] + bytes[r] > end) end = offsets[r] + bytes[r];
    return end;
}
#endif

/* ---- the table's members ---- */

static void host_log(const moert_host *h, moert_log_level level, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    moert_logv_instance(level, impl_of(h)->who, fmt, ap);
    va_end(ap);
}

static void host_set_error(const moert_host *h, const char *fmt, ...)
{
    host_impl *impl = impl_of(h);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(impl->error, sizeof impl->error, fmt, ap);
    va_end(ap);
}

static moert_result host_option_int(const moert_host *h, const char *key, int64_t def, int64_t min, int64_t max,
                                    const char *help, int64_t *out)
{
    host_impl *impl = impl_of(h);
    return host_keep_error(impl, moert_section_int(impl->options, key, def, min, max, help, out));
}

static moert_result host_option_float(const moert_host *h, const char *key, double def, double min, double max,
                                      const char *help, double *out)
{
    host_impl *impl = impl_of(h);
    return host_keep_error(impl, moert_section_float(impl->options, key, def, min, max, help, out));
}

static moert_result host_option_bool(const moert_host *h, const char *key, bool def, const char *help, bool *out)
{
    host_impl *impl = impl_of(h);
    return host_keep_error(impl, moert_section_bool(impl->options, key, def, help, out));
}

static moert_result host_option_string(const moert_host *h, const char *key, const char *def, const char *help,
                                       const char **out)
{
    host_impl *impl = impl_of(h);
    return host_keep_error(impl, moert_section_string(impl->options, key, def, help, out));
}

static moert_result host_option_enum(const moert_host *h, const char *key, const char *const *choices, int def,
                                     const char *help, int *out)
{
    host_impl *impl = impl_of(h);
    return host_keep_error(impl, moert_section_enum(impl->options, key, choices, def, help, out));
}

static moert_result host_alloc(const moert_host *h, moert_device dev, size_t bytes, void **out)
{
    return device_alloc(impl_of(h), dev, bytes, out);
}

static void host_free(const moert_host *h, moert_device dev, void *ptr) { device_free(impl_of(h), dev, ptr); }

static moert_result host_alloc_pinned(const moert_host *h, size_t bytes, void **out)
{
    host_impl *impl = impl_of(h);
    moert_device pinned = {impl->device.type == MOERT_DEVICE_CPU ? MOERT_DEVICE_CPU : MOERT_DEVICE_CUDA_HOST, 0};
    return device_alloc(impl, pinned, bytes, out);
}

static void host_free_pinned(const moert_host *h, void *ptr)
{
    host_impl *impl = impl_of(h);
    moert_device pinned = {impl->device.type == MOERT_DEVICE_CPU ? MOERT_DEVICE_CPU : MOERT_DEVICE_CUDA_HOST, 0};
    device_free(impl, pinned, ptr);
}

static moert_result host_memcpy_async(const moert_host *h, void *dst, moert_device dst_dev, const void *src,
                                      moert_device src_dev, size_t bytes, moert_stream stream)
{
    return device_memcpy(impl_of(h), dst, dst_dev, src, src_dev, bytes, stream);
}

static moert_result host_stream_create(const moert_host *h, moert_stream *out)
{
    return device_stream_create(impl_of(h), out);
}

static void host_stream_destroy(const moert_host *h, moert_stream s)
{
#ifdef MOERT_HAVE_CUDA
    host_impl *impl = impl_of(h);
    if (impl->pool && s) {
        moert_cuda_pool_forget_stream(impl->pool, s);
        moert_cuda_stream_destroy(s);
    }
#endif
}

static moert_result host_event_create(const moert_host *h, moert_event *out)
{
    return device_event_create(impl_of(h), out);
}

static void host_event_destroy(const moert_host *h, moert_event e)
{
#ifdef MOERT_HAVE_CUDA
    if (impl_of(h)->pool && e) moert_cuda_event_destroy(e);
#endif
}

static moert_result host_event_record(const moert_host *h, moert_event e, moert_stream s)
{
#ifdef MOERT_HAVE_CUDA
    if (impl_of(h)->pool) return host_keep_error(impl_of(h), moert_cuda_event_record(e, s));
#endif
    return device_stream_op(impl_of(h), "event_record");
}

static moert_result host_stream_wait_event(const moert_host *h, moert_stream s, moert_event e)
{
#ifdef MOERT_HAVE_CUDA
    if (impl_of(h)->pool) return host_keep_error(impl_of(h), moert_cuda_stream_wait_event(s, e));
#endif
    return device_stream_op(impl_of(h), "stream_wait_event");
}

static moert_result host_stream_synchronize(const moert_host *h, moert_stream s)
{
#ifdef MOERT_HAVE_CUDA
    host_impl *impl = impl_of(h);
    if (impl->pool) {
        /* bounded when a communicator is there: a stalled peer's collective must not hang the host */
        if (impl->nccl) return host_keep_error(impl, moert_nccl_stream_wait(impl->nccl, s, "stream_synchronize"));
        return host_keep_error(impl, moert_cuda_stream_synchronize(s));
    }
#endif
    return device_stream_op(impl_of(h), "stream_synchronize");
}

static moert_result host_allgather(const moert_host *h, const void *send, void *recv, size_t bytes_per_rank,
                                   moert_device dev, moert_stream s)
{
    host_impl *impl = impl_of(h);
#ifdef MOERT_HAVE_CUDA
    if (dev.type == MOERT_DEVICE_CUDA && impl->nccl)
        return host_keep_error(impl, moert_nccl_allgather(impl->nccl, send, recv, bytes_per_rank, s));
#endif
#ifdef MOERT_HAVE_CUDA
    if (staged_comm(impl, h, dev)) {
        staged_args a = {.op = STAGED_ALLGATHER,
                         .send = send,
                         .recv = recv,
                         .send_bytes = bytes_per_rank,
                         .recv_bytes = bytes_per_rank * (size_t)h->world_size,
                         .bytes_per_rank = bytes_per_rank};
        return staged_collective(impl, &a);
    }
#endif
    moert_result rc = device_check_comm(impl, "allgather", dev);
    if (rc != MOERT_OK) return rc;
    if (!impl->comm) {
        if (bytes_per_rank) memmove(recv, send, bytes_per_rank);
        return MOERT_OK;
    }
    return host_keep_error(impl, moert_comm_allgather(impl->comm, h->rank, send, recv, bytes_per_rank));
}

static moert_result host_allreduce_sum(const moert_host *h, void *buf, size_t count, moert_dtype dtype,
                                       moert_device dev, moert_stream s)
{
    host_impl *impl = impl_of(h);
#ifdef MOERT_HAVE_CUDA
    if (dev.type == MOERT_DEVICE_CUDA && impl->nccl)
        return host_keep_error(impl, moert_nccl_allreduce_sum(impl->nccl, buf, count, dtype, s));
#endif
#ifdef MOERT_HAVE_CUDA
    if (staged_comm(impl, h, dev)) {
        size_t bytes = count * moert_dtype_size(dtype);
        staged_args a = {.op = STAGED_ALLREDUCE,
                         .send = buf,
                         .recv = buf,
                         .send_bytes = bytes,
                         .recv_bytes = bytes,
                         .count = count,
                         .dtype = dtype};
        return staged_collective(impl, &a);
    }
#endif
    moert_result rc = device_check_comm(impl, "allreduce_sum", dev);
    if (rc != MOERT_OK) return rc;
    if (!impl->comm) {
        if (dtype != MOERT_F32 && dtype != MOERT_F64 && dtype != MOERT_I64)
            return host_fail(impl, MOERT_ERR_UNSUPPORTED, "allreduce_sum: dtype %s, expected fp32, fp64 or int64",
                             moert_dtype_name(dtype));
        return MOERT_OK; /* the sum over one rank */
    }
    return host_keep_error(impl, moert_comm_allreduce_sum(impl->comm, h->rank, buf, count, dtype));
}

static moert_result host_alltoallv(const moert_host *h, const void *send, const size_t *send_bytes,
                                   const size_t *send_offsets, void *recv, const size_t *recv_bytes,
                                   const size_t *recv_offsets, moert_device dev, moert_stream s)
{
    host_impl *impl = impl_of(h);
#ifdef MOERT_HAVE_CUDA
    if (dev.type == MOERT_DEVICE_CUDA && impl->nccl)
        return host_keep_error(
            impl, moert_nccl_alltoallv(impl->nccl, send, send_bytes, send_offsets, recv, recv_bytes, recv_offsets, s));
#endif
#ifdef MOERT_HAVE_CUDA
    if (staged_comm(impl, h, dev)) {
        staged_args a = {.op = STAGED_ALLTOALLV,
                         .send = send,
                         .recv = recv,
                         .send_bytes = region_extent(h->world_size, send_bytes, send_offsets),
                         .recv_bytes = region_extent(h->world_size, recv_bytes, recv_offsets),
                         .sb = send_bytes,
                         .so = send_offsets,
                         .rb = recv_bytes,
                         .ro = recv_offsets};
        return staged_collective(impl, &a);
    }
#endif
    moert_result rc = device_check_comm(impl, "alltoallv", dev);
    if (rc != MOERT_OK) return rc;
    if (!impl->comm) {
        if (send_bytes[0] != recv_bytes[0])
            return host_fail(impl, MOERT_ERR_INVALID_ARGUMENT,
                             "alltoallv: rank 0 sends %zu bytes to rank 0, which expects %zu", send_bytes[0],
                             recv_bytes[0]);
        if (send_bytes[0]) memmove((char *)recv + recv_offsets[0], (const char *)send + send_offsets[0], send_bytes[0]);
        return MOERT_OK;
    }
    return host_keep_error(impl, moert_comm_alltoallv(impl->comm, h->rank, send, send_bytes, send_offsets, recv,
                                                      recv_bytes, recv_offsets));
}

static moert_result host_barrier(const moert_host *h)
{
    host_impl *impl = impl_of(h);
#ifdef MOERT_HAVE_CUDA
    if (!impl->comm && impl->nccl && h->world_size > 1)
        return host_keep_error(impl, moert_nccl_barrier(impl->nccl, "barrier"));
#endif
    if (!impl->comm) return MOERT_OK;
    return host_keep_error(impl, moert_comm_barrier(impl->comm, h->rank, "barrier"));
}

static moert_result host_exchange_peer_buffers(const moert_host *h, void *local, size_t bytes, moert_device dev,
                                               void **peers)
{
    host_impl *impl = impl_of(h);
#ifdef MOERT_HAVE_CUDA
    if (dev.type == MOERT_DEVICE_CUDA && impl->nccl)
        return host_keep_error(impl, moert_nccl_exchange_peer_buffers(impl->nccl, local, bytes, peers));
#endif
    if (device_is_host(dev) && !impl->comm && h->world_size > 1)
        return host_fail(impl, MOERT_ERR_UNSUPPORTED,
                         "exchange_peer_buffers: host memory cannot be shared between "
                         "ranks that are separate processes; offer a device buffer");
    moert_result rc = device_check_comm(impl, "exchange_peer_buffers", dev);
    if (rc != MOERT_OK) return rc;
    if (!impl->comm) {
        peers[0] = local;
        return MOERT_OK;
    }
    return host_keep_error(impl, moert_comm_exchange_pointers(impl->comm, h->rank, local, peers));
}

static void host_metric(const moert_host *h, const char *name, double value, const char *unit)
{
    host_impl *impl = impl_of(h);
    if (impl->metric) impl->metric(impl->metric_user, name, value, unit ? unit : "");
}

/* ---- create and free ---- */

/* Builds the table for one instance. */
moert_result moert_host_create(const moert_host_setup *setup, moert_host **out)
{
    *out = NULL;
    if (setup->world_size < 1 || setup->rank < 0 || setup->rank >= setup->world_size)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "host: rank %d of world %d", setup->rank, setup->world_size);
    if (!setup->comm && !setup->nccl && setup->world_size != 1)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "host: a world of %d ranks needs a communicator",
                           setup->world_size);
    if (setup->comm && moert_comm_group_size(setup->comm) != setup->world_size)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "host: world %d but the communicator has %d ranks",
                           setup->world_size, moert_comm_group_size(setup->comm));
    host_impl *impl = calloc(1, sizeof *impl);
    if (!impl) return moert_error(MOERT_ERR_OUT_OF_MEMORY, "host: out of memory");
    snprintf(impl->who, sizeof impl->who, "%s", setup->who ? setup->who : "plugin");
    impl->options = setup->options;
    if (!impl->options) {
        impl->owned_options = moert_section_create(NULL, "$.plugin");
        if (!impl->owned_options) {
            free(impl);
            return moert_error(MOERT_ERR_OUT_OF_MEMORY, "host: out of memory");
        }
        impl->options = impl->owned_options;
    }
    impl->comm = setup->comm;
    impl->device = setup->device;
    impl->metric = setup->metric;
    impl->metric_user = setup->metric_user;
    impl->pool = setup->cuda_pool;
    impl->nccl = setup->nccl;
    impl->stream = setup->stream;

    moert_host *h = &impl->table;
    h->struct_size = sizeof(moert_host);
    h->abi_version = MOERT_ABI_CURRENT;
    h->impl = impl;
    h->rank = setup->rank;
    h->world_size = setup->world_size;
    h->log = host_log;
    h->set_error = host_set_error;
    h->option_int = host_option_int;
    h->option_float = host_option_float;
    h->option_bool = host_option_bool;
    h->option_string = host_option_string;
    h->option_enum = host_option_enum;
    h->alloc = host_alloc;
    h->free = host_free;
    h->alloc_pinned = host_alloc_pinned;
    h->free_pinned = host_free_pinned;
    h->memcpy_async = host_memcpy_async;
    h->stream_create = host_stream_create;
    h->stream_destroy = host_stream_destroy;
    h->event_create = host_event_create;
    h->event_destroy = host_event_destroy;
    h->event_record = host_event_record;
    h->stream_wait_event = host_stream_wait_event;
    h->stream_synchronize = host_stream_synchronize;
    h->allgather = host_allgather;
    h->allreduce_sum = host_allreduce_sum;
    h->alltoallv = host_alltoallv;
    h->barrier = host_barrier;
    h->exchange_peer_buffers = host_exchange_peer_buffers;
    h->set_flags = host_set_flags;
    h->metric = host_metric;
    *out = h;
    return MOERT_OK;
}

void moert_host_free(moert_host *h)
{
    if (!h) return;
    host_impl *impl = impl_of(h);
    moert_section_free(impl->owned_options);
    free(impl);
}

/* Declared by the plugin in init: this instance's capability flags. */
static void host_set_flags(const moert_host *h, uint32_t flags)
{
    host_impl *impl = impl_of(h);
    impl->flags_set = true;
    impl->flags = flags;
}

moert_stream moert_host_use_stream(moert_host *h, moert_stream stream)
{
    host_impl *impl = impl_of(h);
    moert_stream before = impl->stream;
    impl->stream = stream;
    return before;
}

uint32_t moert_host_instance_flags(const moert_host *h, uint32_t header_flags)
{
    const host_impl *impl = impl_of(h);
    return impl->flags_set ? impl->flags : header_flags;
}

moert_result moert_host_call_failed(const moert_host *h, moert_result rc, const char *what, const char *activation,
                                    int layer)
{
    return moert_error(rc, "%s%s%s of layer %d (rank %d): %s", what, activation ? " " : "",
                       activation ? activation : "", layer, h->rank, moert_host_take_error((moert_host *)h));
}

/* The plugin's last message ("" if none), cleared for the next call; valid until the next take. */
const char *moert_host_take_error(moert_host *h)
{
    host_impl *impl = impl_of(h);
    memcpy(impl->taken, impl->error, sizeof impl->taken);
    impl->error[0] = '\0';
    return impl->taken;
}
