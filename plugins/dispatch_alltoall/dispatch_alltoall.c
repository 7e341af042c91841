/* SPDX-License-Identifier: Apache-2.0 */
/* The "alltoall" dispatcher plugin: Megatron's all-to-all token dispatcher over the host's communicator.
 * This file: vtable, options, argument checks, buffers and communication, and the CUDA path (the same
 * algorithm, step by step, through the kernels of dispatch_alltoall_cuda.cu); the CPU algorithm over plain
 * arrays is in dispatch_alltoall_cpu.c. */
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dispatch_alltoall_cpu.h"
#include "moert/dispatcher.h"
#include "plugin_report.h"
#include "tensor_args.h"
#ifdef MOERT_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "plugin_cuda_check.h"

#include "../lib/dispatch_alltoall_cuda.h"
#endif

/* A buffer on the layer's device, grown on demand and reused across steps. */
typedef struct a2a_buffer {
    void *data;
    size_t bytes;
} a2a_buffer;

#ifdef MOERT_HAVE_CUDA
/* The CUDA path's step state: the layout on the device and the maps between received and grouped order. */
typedef struct a2a_cuda_state {
    a2a_buffer expert_counts;   /* int64 [E]: this rank's kept copies per expert (layout kernel) */
    a2a_buffer expert_offsets;  /* int64 [E+1]: their exclusive prefix sum */
    a2a_buffer row_of_copy;     /* int32 [T*K]: send row of copy t*K+k, -1 if dropped */
    a2a_buffer copy_of_row;     /* int32 [T*K]: the copy in each send row (num_send of them) */
    a2a_buffer layout_scratch;  /* moert_a2a_cuda_layout_scratch_bytes(T, E) */
    a2a_buffer upload;          /* int64 [El + world*El]: tokens_per_expert, then counts [source rank][local expert] */
    a2a_buffer grouped_src;     /* int32 [capacity]: staging row of each grouped row, -1 for padding */
    a2a_buffer staging_src;     /* int32 [num_recv]: grouped row of each staging row */
    int64_t *pinned_counts;     /* [E+1] pinned host: the counts, then the bad-id counter, copied down */
    int64_t *pinned_upload;     /* [El + world*El] pinned host: what `upload` gets */
    int32_t *pinned_maps;       /* pinned host, grown: host-built maps (with pad_to_capacity) */
    size_t pinned_maps_bytes;
    int64_t *recv_final_row;    /* host [num_recv], grown: a2a_plan_recv_order's answer (with pad_to_capacity) */
    size_t recv_final_row_len;
} a2a_cuda_state;
#endif

typedef struct alltoall_ctx {
    const moert_host *host;
    moert_layer_info layer;
    int world, rank;
    bool pad_to_capacity;
    double capacity_factor;

    bool prepared;              /* prepare() succeeded since init */
    a2a_plan plan;              /* this step's routing; its arrays point into the buffers below */
    int64_t *exchange_row;      /* [E+2] this rank's copies per expert, then T, then a failure flag */
    int64_t *gathered;          /* [world][E+2] every rank's exchange_row */
    int64_t *all_counts;        /* [world][E] copies from rank s to expert e */
    size_t *send_bytes, *send_offsets, *recv_bytes, *recv_offsets; /* [world] for alltoallv */

    a2a_buffer copy_send_row;   /* int64 [T*K] */
    a2a_buffer recv_final_row;  /* int64 [num_recv] */
    a2a_buffer send_rows;       /* rows in send order (copy order) */
    a2a_buffer staging_rows;    /* rows in receive order */
    a2a_buffer send_probs;      /* double, in send order */
    a2a_buffer staging_probs;   /* double, in receive order */
    a2a_buffer acc;             /* double [H] scratch of the reductions */

    bool on_cuda;               /* the layer is on a CUDA device: the CUDA path serves it */
#ifdef MOERT_HAVE_CUDA
    a2a_cuda_state cu;
#endif
} alltoall_ctx;

/* Reports a figure for this step's report, if the host is new enough to take it. */
static void report_metric(const alltoall_ctx *c, const char *name, double value, const char *unit)
{
    const moert_host *h = c->host;
    if (h->struct_size >= offsetof(moert_host, metric) + sizeof h->metric && h->metric)
        h->metric(h, name, value, unit);
}

/* Sets the instance's error message and returns code, so checks can `return fail(...)`. */
#define fail(c, ...) report((c)->host, __VA_ARGS__)

/* Makes buf at least `bytes` long on the layer's device (contents not kept). */
static moert_result buffer_reserve(alltoall_ctx *c, a2a_buffer *buf, size_t bytes)
{
    if (bytes < 64) bytes = 64; /* never hand a NULL pointer to the communicator */
    if (buf->bytes >= bytes) return MOERT_OK;
    if (buf->data) c->host->free(c->host, c->layer.device, buf->data);
    buf->data = NULL;
    buf->bytes = 0;
    size_t grown = bytes + bytes / 2; /* some slack: routing changes from step to step */
    moert_result rc = c->host->alloc(c->host, c->layer.device, grown, &buf->data);
    if (rc != MOERT_OK) return rc;
    buf->bytes = grown;
    return MOERT_OK;
}

static void buffer_release(alltoall_ctx *c, a2a_buffer *buf)
{
    if (buf->data) c->host->free(c->host, c->layer.device, buf->data);
    buf->data = NULL;
    buf->bytes = 0;
}

/* Fails when prepare() has not run (every other step call uses its plan). */
static moert_result check_prepared(const alltoall_ctx *c, const char *call)
{
    if (c->prepared) return MOERT_OK;
    c->host->set_error(c->host, "%s: called before a successful prepare()", call);
    return MOERT_ERR_INVALID_ARGUMENT;
}

/* The shared checks (plugins/lib/tensor_args.h) for this instance's host and layer device. */
static moert_result check_tensor(const alltoall_ctx *c, const char *call, const char *name, const moert_tensor *t,
                                 int ndim, int64_t rows, bool rows_at_least, int64_t cols, const char *rows_what,
                                 int need_dtype)
{
    return moert_arg_check_tensor(c->host, c->layer.device, call, name, t, ndim, rows, rows_at_least, cols,
                                  rows_what, need_dtype);
}

static moert_result check_struct_size(const alltoall_ctx *c, const char *call, const char *what, uint32_t got,
                                      size_t need)
{
    return moert_arg_check_struct_size(c->host, call, what, got, need);
}

/* What every call after prepare() checks first: prepare() succeeded, args is there and big enough. */
static moert_result check_call(alltoall_ctx *c, const char *call, const void *args, uint32_t struct_size,
                               size_t expected_size)
{
    moert_result rc = check_prepared(c, call);
    if (rc == MOERT_OK && !args) rc = fail(c, MOERT_ERR_INVALID_ARGUMENT, "%s: args is NULL", call);
    if (rc == MOERT_OK) rc = check_struct_size(c, call, "args", struct_size, expected_size);
    return rc;
}

/*
 * Moves rows between ranks: send_rows[r] rows of row_bytes from `send` (packed in rank order) to rank r,
 * recv_rows[r] rows from rank r into `recv` (packed in rank order). On CUDA, device buffers, queued on stream.
 */
static moert_result exchange(alltoall_ctx *c, moert_stream stream, const void *send, const int64_t *send_rows,
                             void *recv, const int64_t *recv_rows, size_t row_bytes)
{
    if (c->world == 1) {
        size_t bytes = (size_t)send_rows[0] * row_bytes;
        if (c->on_cuda)
            return bytes ? c->host->memcpy_async(c->host, recv, c->layer.device, send, c->layer.device, bytes, stream)
                         : MOERT_OK;
        memcpy(recv, send, bytes);
        return MOERT_OK;
    }
    size_t send_at = 0, recv_at = 0;
    for (int r = 0; r < c->world; r++) {
        c->send_bytes[r] = (size_t)send_rows[r] * row_bytes;
        c->send_offsets[r] = send_at;
        send_at += c->send_bytes[r];
        c->recv_bytes[r] = (size_t)recv_rows[r] * row_bytes;
        c->recv_offsets[r] = recv_at;
        recv_at += c->recv_bytes[r];
    }
    return c->host->alltoallv(c->host, send, c->send_bytes, c->send_offsets, recv, c->recv_bytes, c->recv_offsets,
                              c->layer.device, stream);
}

/* Bytes this rank sends to other ranks as rows of row_bytes (rows kept on this rank not counted). */
static double bytes_to_peers(const alltoall_ctx *c, size_t row_bytes)
{
    double total = 0;
    for (int r = 0; r < c->world; r++)
        if (r != c->rank) total += (double)c->plan.send_rows[r] * (double)row_bytes;
    return total;
}

static void alltoall_finalize(void *ctx);

#ifdef MOERT_HAVE_CUDA
/*
 * The CUDA path's fixed state: checks that the layer's device answers and that the kernels take E experts,
 * then allocates the pinned count and upload arrays and the device upload buffer (which also tells whether the
 * host can allocate on the device at all).
 */
static moert_result cuda_init(alltoall_ctx *c)
{
    const moert_host *h = c->host;
    const int64_t E = c->layer.num_experts, El = c->layer.num_local_experts, W = c->world;
    const int id = (int)c->layer.device.id;
    char dev[32];
    moert_arg_device_text(c->layer.device, dev, sizeof dev);
    if (E > MOERT_A2A_CUDA_MAX_EXPERTS)
        return fail(c, MOERT_ERR_UNSUPPORTED, "the alltoall dispatcher's CUDA path takes at most %d experts, the layer "
                    "has %lld", MOERT_A2A_CUDA_MAX_EXPERTS, (long long)E);
    MOK(check_cuda_device_visible(c->host, id, dev));
    const size_t upload_bytes = (size_t)(El + W * El) * sizeof(int64_t);
    moert_result rc = buffer_reserve(c, &c->cu.upload, upload_bytes);
    if (rc == MOERT_ERR_UNSUPPORTED)
        return fail(c, rc, "the host serving this instance cannot allocate on %s (a CPU-only host): only a CPU path is "
                    "usable with it", dev);
    if (rc == MOERT_OK) rc = h->alloc_pinned(h, (size_t)(E + 1) * sizeof(int64_t), (void **)&c->cu.pinned_counts);
    if (rc == MOERT_OK) rc = h->alloc_pinned(h, upload_bytes, (void **)&c->cu.pinned_upload);
    return rc;
}

/* Frees the CUDA path's buffers (device ones back to the host's pool, stream-ordered). */
static void cuda_finalize(alltoall_ctx *c)
{
    const moert_host *h = c->host;
    a2a_buffer *device_buffers[] = {&c->cu.expert_counts, &c->cu.expert_offsets, &c->cu.row_of_copy,
                                    &c->cu.copy_of_row,   &c->cu.layout_scratch, &c->cu.upload,
                                    &c->cu.grouped_src,   &c->cu.staging_src};
    for (size_t i = 0; i < sizeof device_buffers / sizeof device_buffers[0]; i++) buffer_release(c, device_buffers[i]);
    if (c->cu.pinned_counts) h->free_pinned(h, c->cu.pinned_counts);
    if (c->cu.pinned_upload) h->free_pinned(h, c->cu.pinned_upload);
    if (c->cu.pinned_maps) h->free_pinned(h, c->cu.pinned_maps);
    free(c->cu.recv_final_row);
    memset(&c->cu, 0, sizeof c->cu);
}
#endif

/* Creates one instance: reads the options, checks the layer, allocates the fixed-size arrays. */
static moert_result alltoall_init(void **out, const moert_host *host, const moert_layer_info *layer)
{
    *out = NULL;
    moert_result check = moert_arg_check_dispatch_layer(host, layer, "alltoall", 0);
    if (check != MOERT_OK) return check;

    alltoall_ctx *c = calloc(1, sizeof *c);
    if (!c) {
        host->set_error(host, "out of memory for the dispatcher state");
        return MOERT_ERR_OUT_OF_MEMORY;
    }
    c->host = host;
    c->layer = *layer;
    c->world = host->world_size;
    c->rank = host->rank;

    moert_result rc = host->option_bool(host, "pad_to_capacity", false,
                                        "pad every local expert's rows to ceil(T*K/E*capacity_factor)*world_size "
                                        "(static shapes)",
                                        &c->pad_to_capacity);
    if (rc == MOERT_OK)
        rc = host->option_float(host, "capacity_factor", 1.0, 1e-3, 1e3,
                                "capacity per expert and source rank, in units of T*K/E (with pad_to_capacity)",
                                &c->capacity_factor);
    if (rc != MOERT_OK) {
        free(c);
        return rc;
    }

    const int64_t E = layer->num_experts, El = layer->num_local_experts, W = c->world;
    c->exchange_row = calloc((size_t)(E + 2), sizeof(int64_t));
    c->gathered = calloc((size_t)(W * (E + 2)), sizeof(int64_t));
    c->all_counts = calloc((size_t)(W * E), sizeof(int64_t));
    c->send_bytes = calloc((size_t)W, sizeof(size_t));
    c->send_offsets = calloc((size_t)W, sizeof(size_t));
    c->recv_bytes = calloc((size_t)W, sizeof(size_t));
    c->recv_offsets = calloc((size_t)W, sizeof(size_t));
    c->plan.send_rows = calloc((size_t)W, sizeof(int64_t));
    c->plan.recv_rows = calloc((size_t)W, sizeof(int64_t));
    c->plan.expert_rows = calloc((size_t)El, sizeof(int64_t));
    c->plan.tokens_per_expert = calloc((size_t)El, sizeof(int64_t));
    c->plan.group_start = calloc((size_t)El, sizeof(int64_t));
    c->plan.cursor = calloc((size_t)E, sizeof(int64_t));
    if (!c->exchange_row || !c->gathered || !c->all_counts || !c->send_bytes || !c->send_offsets ||
        !c->recv_bytes || !c->recv_offsets || !c->plan.send_rows || !c->plan.recv_rows || !c->plan.expert_rows ||
        !c->plan.tokens_per_expert || !c->plan.group_start || !c->plan.cursor) {
        alltoall_finalize(c);
        host->set_error(host, "out of memory for the dispatcher state");
        return MOERT_ERR_OUT_OF_MEMORY;
    }
    c->plan.world = c->world;
    c->plan.rank = c->rank;
    c->plan.num_experts = E;
    c->plan.num_local_experts = El;
    c->plan.topk = layer->topk;
    c->on_cuda = layer->device.type == MOERT_DEVICE_CUDA;
#ifdef MOERT_HAVE_CUDA
    if (c->on_cuda) {
        rc = cuda_init(c);
        if (rc != MOERT_OK) {
            alltoall_finalize(c);
            return rc;
        }
    }
#endif
    *out = c;
    return MOERT_OK;
}

/* Frees everything the instance owns. */
static void alltoall_finalize(void *ctx)
{
    alltoall_ctx *c = ctx;
    if (!c) return;
    buffer_release(c, &c->copy_send_row);
    buffer_release(c, &c->recv_final_row);
    buffer_release(c, &c->send_rows);
    buffer_release(c, &c->staging_rows);
    buffer_release(c, &c->send_probs);
    buffer_release(c, &c->staging_probs);
    buffer_release(c, &c->acc);
#ifdef MOERT_HAVE_CUDA
    cuda_finalize(c);
#endif
    free(c->exchange_row);
    free(c->gathered);
    free(c->all_counts);
    free(c->send_bytes);
    free(c->send_offsets);
    free(c->recv_bytes);
    free(c->recv_offsets);
    free(c->plan.send_rows);
    free(c->plan.recv_rows);
    free(c->plan.expert_rows);
    free(c->plan.tokens_per_expert);
    free(c->plan.group_start);
    free(c->plan.cursor);
    free(c);
}

/* Checks topk_idx and counts this rank's copies per expert into exchange_row; sets the message on failure. */
static moert_result count_local(alltoall_ctx *c, const moert_tensor *topk_idx, int64_t *num_tokens)
{
    const char *call = "prepare()";
    const moert_host *h = c->host;
    char a[64];
    if (!topk_idx) {
        h->set_error(h, "%s: topk_idx is NULL", call);
        return MOERT_ERR_INVALID_ARGUMENT;
    }
    if (topk_idx->ndim != 2 || topk_idx->shape[1] != c->layer.topk) {
        h->set_error(h, "%s: topk_idx has shape %s, expected [T, %lld] (T tokens, topk)", call,
                     moert_arg_shape_text(topk_idx, a, sizeof a), (long long)c->layer.topk);
        return MOERT_ERR_INVALID_ARGUMENT;
    }
    moert_result rc = check_tensor(c, call, "topk_idx", topk_idx, 2, topk_idx->shape[0], false, c->layer.topk,
                                   "T tokens, topk", MOERT_I32);
    if (rc != MOERT_OK) return rc;
    *num_tokens = topk_idx->shape[0];
    int64_t bad = a2a_count_copies(topk_idx->data, *num_tokens, c->layer.topk, c->layer.num_experts,
                                   c->exchange_row);
    if (bad >= 0) {
        h->set_error(h, "%s: topk_idx[%lld][%lld] is %d, expected an expert id in [0, %lld) or -1 (dropped)", call,
                     (long long)(bad / c->layer.topk), (long long)(bad % c->layer.topk),
                     (int)((const int32_t *)topk_idx->data)[bad], (long long)c->layer.num_experts);
        return MOERT_ERR_INVALID_ARGUMENT;
    }
    return MOERT_OK;
}

#ifdef MOERT_HAVE_CUDA
/* Grows a pinned host array to `bytes` (contents not kept; the caller has waited for copies out of it). */
static moert_result pinned_reserve(alltoall_ctx *c, void **ptr, size_t *have, size_t bytes)
{
    if (bytes < 64) bytes = 64;
    if (*have >= bytes) return MOERT_OK;
    if (*ptr) c->host->free_pinned(c->host, *ptr);
    *ptr = NULL;
    *have = 0;
    size_t grown = bytes + bytes / 2;
    moert_result rc = c->host->alloc_pinned(c->host, grown, ptr);
    if (rc != MOERT_OK) return rc;
    *have = grown;
    return MOERT_OK;
}

/*
 * prepare()'s local part on CUDA: checks topk_idx (int32 [T,K] on the layer's device), runs the layout
 * kernels (counts per expert and the stable send order, row_of_copy / copy_of_row) and copies the counts and
 * the bad-id counter down through pinned memory, waiting for the stream with the host's bounded wait: the one
 * host sync of a step. Fills exchange_row[0..E).
 */
static moert_result cuda_count_local(alltoall_ctx *c, moert_stream stream, const moert_tensor *topk_idx,
                                     int64_t *num_tokens)
{
    const char *call = "prepare()";
    const moert_host *h = c->host;
    const int64_t E = c->layer.num_experts, K = c->layer.topk;
    char a[64];
    if (!topk_idx) return fail(c, MOERT_ERR_INVALID_ARGUMENT, "%s: topk_idx is NULL", call);
    if (topk_idx->ndim != 2 || topk_idx->shape[1] != K)
        return fail(c, MOERT_ERR_INVALID_ARGUMENT, "%s: topk_idx has shape %s, expected [T, %lld] (T tokens, topk)",
                    call, moert_arg_shape_text(topk_idx, a, sizeof a), (long long)K);
    moert_result rc = check_tensor(c, call, "topk_idx", topk_idx, 2, topk_idx->shape[0], false, K, "T tokens, topk",
                                   MOERT_I32);
    if (rc != MOERT_OK) return rc;
    const int64_t T = topk_idx->shape[0];
    if (T * K > INT32_MAX)
        return fail(c, MOERT_ERR_UNSUPPORTED, "%s: %lld token copies (T*K), the CUDA path takes at most %d", call,
                    (long long)(T * K), INT32_MAX);

    a2a_cuda_state *cu = &c->cu;
    rc = buffer_reserve(c, &cu->expert_counts, (size_t)E * sizeof(int64_t));
    if (rc == MOERT_OK) rc = buffer_reserve(c, &cu->expert_offsets, (size_t)(E + 1) * sizeof(int64_t));
    if (rc == MOERT_OK) rc = buffer_reserve(c, &cu->row_of_copy, (size_t)(T * K) * sizeof(int32_t));
    if (rc == MOERT_OK) rc = buffer_reserve(c, &cu->copy_of_row, (size_t)(T * K) * sizeof(int32_t));
    if (rc == MOERT_OK) rc = buffer_reserve(c, &cu->layout_scratch, moert_a2a_cuda_layout_scratch_bytes(T, E));
    if (rc != MOERT_OK) return rc;
    moert_a2a_cuda_layout_buffers bufs = {.tokens_per_expert = cu->expert_counts.data,
                                          .expert_offsets = cu->expert_offsets.data,
                                          .row_of_copy = cu->row_of_copy.data,
                                          .copy_of_row = cu->copy_of_row.data,
                                          .scratch = cu->layout_scratch.data};
    rc = moert_a2a_cuda_layout(h, (cudaStream_t)stream, topk_idx->data, T, K, E, &bufs, NULL);
    if (rc != MOERT_OK) return rc;
    rc = h->memcpy_async(h, cu->pinned_counts, moert_cpu(), cu->expert_counts.data, c->layer.device,
                         (size_t)E * sizeof(int64_t), stream);
    if (rc == MOERT_OK)
        rc = h->memcpy_async(h, cu->pinned_counts + E, moert_cpu(),
                             moert_a2a_cuda_layout_bad_ids(cu->layout_scratch.data, T, E), c->layer.device,
                             sizeof(unsigned long long), stream);
    if (rc == MOERT_OK) rc = h->stream_synchronize(h, stream);
    if (rc != MOERT_OK) return rc;
    unsigned long long bad = 0;
    memcpy(&bad, cu->pinned_counts + E, sizeof bad);
    if (bad)
        return fail(c, MOERT_ERR_INVALID_ARGUMENT,
                    "%s: %llu entries of topk_idx are outside [0, %lld) and not -1 (dropped); expected expert ids",
                    call, bad, (long long)E);
    memcpy(c->exchange_row, cu->pinned_counts, (size_t)E * sizeof(int64_t));
    *num_tokens = T;
    return MOERT_OK;
}

/*
 * prepare()'s plan on CUDA, after the sizes: uploads tokens_per_expert and this rank's received counts
 * [source rank][local expert] (through pinned memory, no wait), then builds the maps between received
 * (staging) and grouped order: on the device with the regroup kernel, or on the host (a2a_plan_recv_order,
 * the CPU's own order) when padding puts gaps between the groups.
 */
static moert_result cuda_plan(alltoall_ctx *c, moert_stream stream, int64_t group_rows)
{
    const moert_host *h = c->host;
    a2a_plan *p = &c->plan;
    a2a_cuda_state *cu = &c->cu;
    const int64_t E = c->layer.num_experts, El = c->layer.num_local_experts, W = c->world;
    const int64_t first_local = (int64_t)c->rank * El;
    if (p->capacity > INT32_MAX)
        return fail(c, MOERT_ERR_UNSUPPORTED, "prepare(): capacity %lld rows, the CUDA path takes at most %d",
                    (long long)p->capacity, INT32_MAX);
    for (int64_t l = 0; l < El; l++) cu->pinned_upload[l] = p->tokens_per_expert[l];
    for (int64_t s = 0; s < W; s++)
        for (int64_t l = 0; l < El; l++)
            cu->pinned_upload[El + s * El + l] = c->all_counts[s * E + first_local + l];
    moert_result rc = h->memcpy_async(h, cu->upload.data, c->layer.device, cu->pinned_upload, moert_cpu(),
                                      (size_t)(El + W * El) * sizeof(int64_t), stream);
    if (rc == MOERT_OK) rc = buffer_reserve(c, &cu->grouped_src, (size_t)p->capacity * sizeof(int32_t));
    if (rc == MOERT_OK) rc = buffer_reserve(c, &cu->staging_src, (size_t)p->num_recv * sizeof(int32_t));
    if (rc != MOERT_OK) return rc;

    if (group_rows == 0) /* compact groups: grouped order is the regroup kernel's expert-major order */
        return moert_a2a_cuda_regroup_maps(h, (cudaStream_t)stream, W, El, (const int64_t *)cu->upload.data + El,
                                           p->num_recv, cu->grouped_src.data, cu->staging_src.data, NULL, NULL);

    /* padded groups: the CPU's map, and its inverse with -1 (a zero row) for padding rows */
    if (cu->recv_final_row_len < (size_t)p->num_recv) {
        int64_t *grown = realloc(cu->recv_final_row, ((size_t)p->num_recv + 1) * sizeof(int64_t));
        if (!grown) return fail(c, MOERT_ERR_OUT_OF_MEMORY, "prepare(): out of host memory for the regroup map");
        cu->recv_final_row = grown;
        cu->recv_final_row_len = (size_t)p->num_recv;
    }
    p->recv_final_row = cu->recv_final_row;
    a2a_plan_recv_order(p, c->all_counts);
    const size_t map_bytes = (size_t)(p->capacity + p->num_recv) * sizeof(int32_t);
    rc = pinned_reserve(c, (void **)&cu->pinned_maps, &cu->pinned_maps_bytes, map_bytes);
    if (rc != MOERT_OK) return rc;
    int32_t *grouped_src = cu->pinned_maps, *staging_src = cu->pinned_maps + p->capacity;
    for (int64_t j = 0; j < p->capacity; j++) grouped_src[j] = -1;
    for (int64_t i = 0; i < p->num_recv; i++) {
        staging_src[i] = (int32_t)p->recv_final_row[i];
        grouped_src[p->recv_final_row[i]] = (int32_t)i;
    }
    rc = h->memcpy_async(h, cu->grouped_src.data, c->layer.device, grouped_src, moert_cpu(),
                         (size_t)p->capacity * sizeof(int32_t), stream);
    if (rc == MOERT_OK)
        rc = h->memcpy_async(h, cu->staging_src.data, c->layer.device, staging_src, moert_cpu(),
                             (size_t)p->num_recv * sizeof(int32_t), stream);
    return rc;
}
#endif

/*
 * Counts copies per expert, allgathers the [world x E] count matrix (every rank takes part even when its
 * own input was bad, so all ranks fail together instead of waiting for each other), and plans the step.
 */
static moert_result alltoall_prepare(void *ctx, moert_stream stream, const moert_tensor *topk_idx,
                                     moert_dispatch_layout *layout)
{
    alltoall_ctx *c = ctx;
    const moert_host *h = c->host;
    const int64_t E = c->layer.num_experts, El = c->layer.num_local_experts, K = c->layer.topk;
    c->prepared = false;

    int64_t num_tokens = 0;
    memset(c->exchange_row, 0, (size_t)(E + 2) * sizeof(int64_t));
    moert_result local_rc = MOERT_OK;
    if (!layout)
        local_rc = fail(c, MOERT_ERR_INVALID_ARGUMENT, "prepare(): layout is NULL");
    else
        local_rc = check_struct_size(c, "prepare()", "layout", layout->struct_size, sizeof *layout);
    if (local_rc == MOERT_OK) {
#ifdef MOERT_HAVE_CUDA
        if (c->on_cuda)
            local_rc = cuda_count_local(c, stream, topk_idx, &num_tokens);
        else
#endif
            local_rc = count_local(c, topk_idx, &num_tokens);
    }
    if (local_rc != MOERT_OK) memset(c->exchange_row, 0, (size_t)E * sizeof(int64_t));
    c->exchange_row[E] = num_tokens;
    c->exchange_row[E + 1] = local_rc;

    moert_result rc = MOERT_OK;
    if (c->world == 1)
        memcpy(c->gathered, c->exchange_row, (size_t)(E + 2) * sizeof(int64_t));
    else /* host memory on every device: the threads communicator serves it */
        rc = h->allgather(h, c->exchange_row, c->gathered, (size_t)(E + 2) * sizeof(int64_t), moert_cpu(), NULL);
    if (rc != MOERT_OK) return rc;
    if (local_rc != MOERT_OK) return local_rc;

    int64_t max_tokens = 0;
    for (int s = 0; s < c->world; s++) {
        const int64_t *row = c->gathered + (int64_t)s * (E + 2);
        if (row[E + 1] != MOERT_OK) {
            h->set_error(h, "prepare(): rank %d failed its prepare() (see its error), so this step cannot dispatch",
                         s);
            return MOERT_ERR_INVALID_ARGUMENT;
        }
        memcpy(c->all_counts + (int64_t)s * E, row, (size_t)E * sizeof(int64_t));
        if (row[E] > max_tokens) max_tokens = row[E];
    }

    /* Padding: every rank computes the same group size from the largest T, so all agree on overflow. */
    int64_t group_rows = 0;
    if (c->pad_to_capacity) {
        int64_t per_source = (int64_t)ceil((double)max_tokens * (double)K / (double)E * c->capacity_factor);
        group_rows = per_source * c->world;
        int64_t rows = 0;
        int64_t e = a2a_find_overflow(c->all_counts, c->world, E, group_rows, &rows);
        if (e >= 0) {
            h->set_error(h,
                         "prepare(): expert %lld (on rank %lld) receives %lld rows, more than its padded capacity "
                         "%lld = ceil(T*K/E*capacity_factor) = %lld per source rank x world_size %d; the router "
                         "must drop copies beyond capacity (its capacity_factor <= this dispatcher's %g)",
                         (long long)e, (long long)(e / El), (long long)rows, (long long)group_rows,
                         (long long)per_source, c->world, c->capacity_factor);
            return MOERT_ERR_INVALID_ARGUMENT;
        }
    }

    a2a_plan *p = &c->plan;
    p->num_tokens = num_tokens;
    a2a_plan_sizes(p, c->all_counts, group_rows);
    void *tokens_per_expert_data = p->tokens_per_expert;
#ifdef MOERT_HAVE_CUDA
    if (c->on_cuda) {
        rc = cuda_plan(c, stream, group_rows);
        if (rc != MOERT_OK) return rc;
        tokens_per_expert_data = c->cu.upload.data; /* its first El entries */
    } else
#endif
    {
        rc = buffer_reserve(c, &c->copy_send_row, (size_t)(num_tokens * K) * sizeof(int64_t));
        if (rc == MOERT_OK) rc = buffer_reserve(c, &c->recv_final_row, (size_t)p->num_recv * sizeof(int64_t));
        if (rc != MOERT_OK) return rc;
        p->copy_send_row = c->copy_send_row.data;
        p->recv_final_row = c->recv_final_row.data;
        a2a_plan_send_order(p, topk_idx->data, c->all_counts + (int64_t)c->rank * E);
        a2a_plan_recv_order(p, c->all_counts);
    }

    layout->num_recv = p->num_recv;
    layout->capacity = p->capacity;
    layout->tokens_per_expert = moert_tensor_1d(tokens_per_expert_data, c->layer.device, MOERT_I64, El);
    layout->tokens_per_expert_host = p->tokens_per_expert;
    c->prepared = true;
    report_metric(c, "dispatch.recv_tokens", (double)p->num_recv, "tokens");
    h->log(h, MOERT_LOG_DEBUG, "prepare: T %lld, send %lld rows, receive %lld rows, capacity %lld",
           (long long)num_tokens, (long long)p->num_send, (long long)p->num_recv, (long long)p->capacity);
    return MOERT_OK;
}

#ifdef MOERT_HAVE_CUDA
/* The kernels move fp32 and bf16 data; both tensors of a pair must share the dtype (rows move as bits). */
static moert_result cuda_check_dtypes(const alltoall_ctx *c, const char *call, const char *name_a,
                                      const moert_tensor *a, const char *name_b, const moert_tensor *b)
{
    if (a->dtype != MOERT_F32 && a->dtype != MOERT_BF16)
        return fail(c, MOERT_ERR_UNSUPPORTED, "%s: %s has dtype %s; the CUDA path moves fp32 or bf16", call, name_a,
                    moert_dtype_name(a->dtype));
    if (b->dtype != a->dtype)
        return fail(c, MOERT_ERR_UNSUPPORTED, "%s: %s has dtype %s but %s has %s; on CUDA they must match", call,
                    name_b, moert_dtype_name(b->dtype), name_a, moert_dtype_name(a->dtype));
    return MOERT_OK;
}

/* Makes the send (num_send rows) and staging (num_recv rows) buffers hold rows of row_bytes. */
static moert_result cuda_reserve_rows(alltoall_ctx *c, a2a_buffer *send, a2a_buffer *staging, size_t row_bytes)
{
    moert_result rc = buffer_reserve(c, send, (size_t)c->plan.num_send * row_bytes);
    if (rc == MOERT_OK) rc = buffer_reserve(c, staging, (size_t)c->plan.num_recv * row_bytes);
    return rc;
}

/*
 * Rows of `src` [T, width] to the grouped buffer `grouped` [>= capacity, width] on the ranks owning their
 * experts: permute into send order (copy_of_row), all-to-all, regroup (grouped_src; padding rows get 0).
 * divisor: K for token rows (copy c reads row c/K), 1 for per-copy values (the [T*K] probs).
 */
static moert_result cuda_forward_rows(alltoall_ctx *c, moert_stream stream, moert_dtype dtype, int64_t width,
                                      int32_t divisor, const void *src, a2a_buffer *send, a2a_buffer *staging,
                                      void *grouped)
{
    const moert_host *h = c->host;
    const a2a_plan *p = &c->plan;
    const size_t row_bytes = (size_t)width * moert_dtype_size(dtype);
    moert_result rc = cuda_reserve_rows(c, send, staging, row_bytes);
    if (rc == MOERT_OK)
        rc = moert_a2a_cuda_gather_rows(h, (cudaStream_t)stream, dtype, p->num_send, width, c->cu.copy_of_row.data,
                                        divisor, NULL, src, send->data);
    if (rc == MOERT_OK) rc = exchange(c, stream, send->data, p->send_rows, staging->data, p->recv_rows, row_bytes);
    if (rc == MOERT_OK)
        rc = moert_a2a_cuda_gather_rows(h, (cudaStream_t)stream, dtype, p->capacity, width, c->cu.grouped_src.data, 1,
                                        NULL, staging->data, grouped);
    return rc;
}

/*
 * The way back: grouped rows [>= capacity, width] to staging order (staging_src), all-to-all back to the
 * ranks of their tokens; `send` then holds this rank's copies in send order (num_send rows).
 */
static moert_result cuda_backward_rows(alltoall_ctx *c, moert_stream stream, moert_dtype dtype, int64_t width,
                                       const void *grouped, a2a_buffer *send, a2a_buffer *staging)
{
    const moert_host *h = c->host;
    const a2a_plan *p = &c->plan;
    const size_t row_bytes = (size_t)width * moert_dtype_size(dtype);
    moert_result rc = cuda_reserve_rows(c, send, staging, row_bytes);
    if (rc == MOERT_OK)
        rc = moert_a2a_cuda_gather_rows(h, (cudaStream_t)stream, dtype, p->num_recv, width, c->cu.staging_src.data, 1,
                                        NULL, grouped, staging->data);
    if (rc == MOERT_OK) rc = exchange(c, stream, staging->data, p->recv_rows, send->data, p->send_rows, row_bytes);
    return rc;
}

/* dispatch() on CUDA: rows, then probs (a second all-to-all), each permuted, exchanged and regrouped. */
static moert_result cuda_dispatch(alltoall_ctx *c, moert_stream stream, const moert_dispatch_args *args)
{
    const char *call = "dispatch()";
    const int64_t H = c->layer.hidden;
    moert_result rc = cuda_check_dtypes(c, call, "x", args->x, "recv_x", args->recv_x);
    if (rc == MOERT_OK && args->topk_probs)
        rc = cuda_check_dtypes(c, call, "topk_probs", args->topk_probs, "recv_probs", args->recv_probs);
    if (rc != MOERT_OK) return rc;
    const moert_dtype dtype = args->x->dtype;
    rc = cuda_forward_rows(c, stream, dtype, H, (int32_t)c->layer.topk, args->x->data, &c->send_rows,
                           &c->staging_rows, args->recv_x->data);
    if (rc != MOERT_OK) return rc;
    double sent = bytes_to_peers(c, (size_t)H * moert_dtype_size(dtype));
    if (args->topk_probs) {
        const moert_dtype pd = args->topk_probs->dtype;
        rc = cuda_forward_rows(c, stream, pd, 1, 1, args->topk_probs->data, &c->send_probs, &c->staging_probs,
                               args->recv_probs->data);
        if (rc != MOERT_OK) return rc;
        sent += bytes_to_peers(c, moert_dtype_size(pd));
    }
    report_metric(c, "dispatch.bytes_sent", sent, "bytes");
    return MOERT_OK;
}

/* combine() on CUDA: back to the tokens' ranks, then each token's kept copies summed in fp32 (overwrite). */
static moert_result cuda_combine(alltoall_ctx *c, moert_stream stream, const moert_combine_args *args)
{
    const char *call = "combine()";
    const a2a_plan *p = &c->plan;
    const int64_t H = c->layer.hidden;
    moert_result rc = cuda_check_dtypes(c, call, "y_expert", args->y_expert, "y", args->y);
    if (rc != MOERT_OK) return rc;
    const moert_dtype dtype = args->y_expert->dtype;
    rc = cuda_backward_rows(c, stream, dtype, H, args->y_expert->data, &c->send_rows, &c->staging_rows);
    if (rc != MOERT_OK) return rc;
    return moert_a2a_cuda_combine_rows(c->host, (cudaStream_t)stream, dtype, p->num_tokens, c->layer.topk, H,
                                       c->cu.row_of_copy.data, c->send_rows.data, args->y->data, 0);
}

/* combine_backward() on CUDA: a dispatch of d_y's rows without probs. */
static moert_result cuda_combine_backward(alltoall_ctx *c, moert_stream stream,
                                          const moert_combine_backward_args *args)
{
    const char *call = "combine_backward()";
    moert_result rc = cuda_check_dtypes(c, call, "d_y", args->d_y, "d_y_expert", args->d_y_expert);
    if (rc != MOERT_OK) return rc;
    return cuda_forward_rows(c, stream, args->d_y->dtype, c->layer.hidden, (int32_t)c->layer.topk, args->d_y->data,
                             &c->send_rows, &c->staging_rows, args->d_y_expert->data);
}

/* dispatch_backward() on CUDA: row gradients summed into d_x (+=), prob gradients to their (t, k) slots. */
static moert_result cuda_dispatch_backward(alltoall_ctx *c, moert_stream stream,
                                           const moert_dispatch_backward_args *args)
{
    const char *call = "dispatch_backward()";
    const a2a_plan *p = &c->plan;
    const int64_t H = c->layer.hidden, K = c->layer.topk;
    moert_result rc = cuda_check_dtypes(c, call, "d_recv_x", args->d_recv_x, "d_x", args->d_x);
    if (rc == MOERT_OK && args->d_recv_probs)
        rc = cuda_check_dtypes(c, call, "d_recv_probs", args->d_recv_probs, "d_topk_probs", args->d_topk_probs);
    if (rc != MOERT_OK) return rc;
    const moert_dtype dtype = args->d_recv_x->dtype;
    rc = cuda_backward_rows(c, stream, dtype, H, args->d_recv_x->data, &c->send_rows, &c->staging_rows);
    if (rc == MOERT_OK)
        rc = moert_a2a_cuda_combine_rows(c->host, (cudaStream_t)stream, dtype, p->num_tokens, K, H,
                                         c->cu.row_of_copy.data, c->send_rows.data, args->d_x->data, 1);
    if (rc != MOERT_OK || !args->d_recv_probs) return rc;
    const moert_dtype pd = args->d_recv_probs->dtype;
    rc = cuda_backward_rows(c, stream, pd, 1, args->d_recv_probs->data, &c->send_probs, &c->staging_probs);
    if (rc != MOERT_OK) return rc;
    /* d_topk_probs[t*K+k] = the gradient in copy (t,k)'s send row; 0 for a dropped copy (row -1) */
    return moert_a2a_cuda_gather_rows(c->host, (cudaStream_t)stream, pd, p->num_tokens * K, 1,
                                      c->cu.row_of_copy.data, 1, NULL, c->send_probs.data, args->d_topk_probs->data);
}
#endif

/* Sends each kept token copy (row and routing weight) to the rank owning its expert, grouped by local expert. */
static moert_result alltoall_dispatch(void *ctx, moert_stream stream, const moert_dispatch_args *args)
{
    alltoall_ctx *c = ctx;
    const char *call = "dispatch()";
    const a2a_plan *p = &c->plan;
    const int64_t H = c->layer.hidden, T = p->num_tokens, K = c->layer.topk;
    moert_result rc = check_call(c, call, args, args ? args->struct_size : 0, sizeof *args);
    if (rc == MOERT_OK)
        rc = check_tensor(c, call, "x", args->x, 2, T, false, H, "T from prepare(), hidden", -1);
    if (rc == MOERT_OK)
        rc = check_tensor(c, call, "recv_x", args->recv_x, 2, p->capacity, true, H,
                          "capacity from prepare(), hidden", args->x->dtype);
    if (rc == MOERT_OK && (args->topk_probs == NULL) != (args->recv_probs == NULL))
        rc = fail(c, MOERT_ERR_INVALID_ARGUMENT,
                  "%s: topk_probs and recv_probs must be given together (or both NULL)", call);
    if (rc == MOERT_OK && args->topk_probs)
        rc = check_tensor(c, call, "topk_probs", args->topk_probs, 2, T, false, K, "T from prepare(), topk", -1);
    if (rc == MOERT_OK && args->recv_probs)
        rc = check_tensor(c, call, "recv_probs", args->recv_probs, 1, p->capacity, true, 0,
                          "capacity from prepare()", -1);
    if (rc != MOERT_OK) return rc;
#ifdef MOERT_HAVE_CUDA
    if (c->on_cuda) return cuda_dispatch(c, stream, args);
#endif

    const size_t row_bytes = (size_t)H * moert_dtype_size(args->x->dtype);
    rc = buffer_reserve(c, &c->send_rows, (size_t)p->num_send * row_bytes);
    if (rc == MOERT_OK) rc = buffer_reserve(c, &c->staging_rows, (size_t)p->num_recv * row_bytes);
    if (rc != MOERT_OK) return rc;
    a2a_pack_rows(p, args->x->data, row_bytes, c->send_rows.data);
    rc = exchange(c, stream, c->send_rows.data, p->send_rows, c->staging_rows.data, p->recv_rows, row_bytes);
    if (rc != MOERT_OK) return rc;
    a2a_scatter_rows(p, c->staging_rows.data, row_bytes, args->recv_x->data);
    a2a_zero_padding(p, args->recv_x->data, row_bytes);
    double sent = bytes_to_peers(c, row_bytes);

    if (args->topk_probs) {
        rc = buffer_reserve(c, &c->send_probs, (size_t)p->num_send * sizeof(double));
        if (rc == MOERT_OK) rc = buffer_reserve(c, &c->staging_probs, (size_t)p->num_recv * sizeof(double));
        if (rc != MOERT_OK) return rc;
        a2a_pack_probs(p, args->topk_probs->data, args->topk_probs->dtype, c->send_probs.data);
        rc = exchange(c, stream, c->send_probs.data, p->send_rows, c->staging_probs.data, p->recv_rows, sizeof(double));
        if (rc != MOERT_OK) return rc;
        a2a_scatter_probs(p, c->staging_probs.data, args->recv_probs->data, args->recv_probs->dtype);
        sent += bytes_to_peers(c, sizeof(double));
    }
    report_metric(c, "dispatch.bytes_sent", sent, "bytes");
    return MOERT_OK;
}

/* Brings expert output rows back to the ranks of their tokens and sums each token's copies (in double). */
static moert_result alltoall_combine(void *ctx, moert_stream stream, const moert_combine_args *args)
{
    alltoall_ctx *c = ctx;
    const char *call = "combine()";
    const a2a_plan *p = &c->plan;
    const int64_t H = c->layer.hidden;
    moert_result rc = check_call(c, call, args, args ? args->struct_size : 0, sizeof *args);
    if (rc == MOERT_OK)
        rc = check_tensor(c, call, "y_expert", args->y_expert, 2, p->capacity, true, H,
                          "capacity from prepare(), hidden", -1);
    if (rc == MOERT_OK) rc = check_tensor(c, call, "y", args->y, 2, p->num_tokens, false, H,
                                          "T from prepare(), hidden", -1);
    if (rc != MOERT_OK) return rc;
#ifdef MOERT_HAVE_CUDA
    if (c->on_cuda) return cuda_combine(c, stream, args);
#endif

    const size_t row_bytes = (size_t)H * moert_dtype_size(args->y_expert->dtype);
    rc = buffer_reserve(c, &c->send_rows, (size_t)p->num_send * row_bytes);
    if (rc == MOERT_OK) rc = buffer_reserve(c, &c->staging_rows, (size_t)p->num_recv * row_bytes);
    if (rc == MOERT_OK) rc = buffer_reserve(c, &c->acc, (size_t)H * sizeof(double));
    if (rc != MOERT_OK) return rc;
    a2a_gather_rows(p, args->y_expert->data, row_bytes, c->staging_rows.data);
    rc = exchange(c, stream, c->staging_rows.data, p->recv_rows, c->send_rows.data, p->send_rows, row_bytes);
    if (rc != MOERT_OK) return rc;
    a2a_sum_copies(p, c->send_rows.data, args->y_expert->dtype, H, 0, args->y->data, args->y->dtype, c->acc.data);
    return MOERT_OK;
}

/* The adjoint of combine: every received row gets its token's gradient (a dispatch of d_y without probs). */
static moert_result alltoall_combine_backward(void *ctx, moert_stream stream, const moert_combine_backward_args *args)
{
    alltoall_ctx *c = ctx;
    const char *call = "combine_backward()";
    const a2a_plan *p = &c->plan;
    const int64_t H = c->layer.hidden;
    moert_result rc = check_call(c, call, args, args ? args->struct_size : 0, sizeof *args);
    if (rc == MOERT_OK)
        rc = check_tensor(c, call, "d_y", args->d_y, 2, p->num_tokens, false, H, "T from prepare(), hidden", -1);
    if (rc == MOERT_OK)
        rc = check_tensor(c, call, "d_y_expert", args->d_y_expert, 2, p->capacity, true, H,
                          "capacity from prepare(), hidden", args->d_y->dtype);
    if (rc != MOERT_OK) return rc;
#ifdef MOERT_HAVE_CUDA
    if (c->on_cuda) return cuda_combine_backward(c, stream, args);
#endif

    const size_t row_bytes = (size_t)H * moert_dtype_size(args->d_y->dtype);
    rc = buffer_reserve(c, &c->send_rows, (size_t)p->num_send * row_bytes);
    if (rc == MOERT_OK) rc = buffer_reserve(c, &c->staging_rows, (size_t)p->num_recv * row_bytes);
    if (rc != MOERT_OK) return rc;
    a2a_pack_rows(p, args->d_y->data, row_bytes, c->send_rows.data);
    rc = exchange(c, stream, c->send_rows.data, p->send_rows, c->staging_rows.data, p->recv_rows, row_bytes);
    if (rc != MOERT_OK) return rc;
    a2a_scatter_rows(p, c->staging_rows.data, row_bytes, args->d_y_expert->data);
    a2a_zero_padding(p, args->d_y_expert->data, row_bytes);
    return MOERT_OK;
}

/* The adjoint of dispatch: row gradients summed into their tokens (+=), weight gradients to their slots. */
static moert_result alltoall_dispatch_backward(void *ctx, moert_stream stream,
                                               const moert_dispatch_backward_args *args)
{
    alltoall_ctx *c = ctx;
    const char *call = "dispatch_backward()";
    const a2a_plan *p = &c->plan;
    const int64_t H = c->layer.hidden, T = p->num_tokens, K = c->layer.topk;
    moert_result rc = check_call(c, call, args, args ? args->struct_size : 0, sizeof *args);
    if (rc == MOERT_OK)
        rc = check_tensor(c, call, "d_recv_x", args->d_recv_x, 2, p->capacity, true, H,
                          "capacity from prepare(), hidden", -1);
    if (rc == MOERT_OK)
        rc = check_tensor(c, call, "d_x", args->d_x, 2, T, false, H, "T from prepare(), hidden", -1);
    if (rc == MOERT_OK && (args->d_recv_probs == NULL) != (args->d_topk_probs == NULL))
        rc = fail(c, MOERT_ERR_INVALID_ARGUMENT,
                  "%s: d_recv_probs and d_topk_probs must be given together (or both NULL)",
                           call);
    if (rc == MOERT_OK && args->d_recv_probs)
        rc = check_tensor(c, call, "d_recv_probs", args->d_recv_probs, 1, p->capacity, true, 0,
                          "capacity from prepare()", -1);
    if (rc == MOERT_OK && args->d_topk_probs)
        rc = check_tensor(c, call, "d_topk_probs", args->d_topk_probs, 2, T, false, K, "T from prepare(), topk",
                          -1);
    if (rc != MOERT_OK) return rc;
#ifdef MOERT_HAVE_CUDA
    if (c->on_cuda) return cuda_dispatch_backward(c, stream, args);
#endif

    const size_t row_bytes = (size_t)H * moert_dtype_size(args->d_recv_x->dtype);
    rc = buffer_reserve(c, &c->send_rows, (size_t)p->num_send * row_bytes);
    if (rc == MOERT_OK) rc = buffer_reserve(c, &c->staging_rows, (size_t)p->num_recv * row_bytes);
    if (rc == MOERT_OK) rc = buffer_reserve(c, &c->acc, (size_t)H * sizeof(double));
    if (rc != MOERT_OK) return rc;
    a2a_gather_rows(p, args->d_recv_x->data, row_bytes, c->staging_rows.data);
    rc = exchange(c, stream, c->staging_rows.data, p->recv_rows, c->send_rows.data, p->send_rows, row_bytes);
    if (rc != MOERT_OK) return rc;
    a2a_sum_copies(p, c->send_rows.data, args->d_recv_x->dtype, H, 1, args->d_x->data, args->d_x->dtype,
                   c->acc.data);

    if (args->d_recv_probs) {
        rc = buffer_reserve(c, &c->send_probs, (size_t)p->num_send * sizeof(double));
        if (rc == MOERT_OK) rc = buffer_reserve(c, &c->staging_probs, (size_t)p->num_recv * sizeof(double));
        if (rc != MOERT_OK) return rc;
        a2a_gather_probs(p, args->d_recv_probs->data, args->d_recv_probs->dtype, c->staging_probs.data);
        rc = exchange(c, stream, c->staging_probs.data, p->recv_rows, c->send_probs.data, p->send_rows, sizeof(double));
        if (rc != MOERT_OK) return rc;
        a2a_unpack_probs(p, c->send_probs.data, args->d_topk_probs->data, args->d_topk_probs->dtype);
    }
    return MOERT_OK;
}

/* The one exported symbol. Its name equals the vtable's typedef name, which C does not allow for an object in the
 * same scope, so the object gets a private C name and its linker name through an asm label. */
MOERT_DISPATCHER_V1_EXPORT(alltoall_vtable) = {
    .header = {
        MOERT_DISPATCHER_V1_HEADER,
        .name = "alltoall",
        .version = "0.1.0",
        .description = "Megatron-style all-to-all token dispatcher (count exchange, alltoallv, regroup by expert)",
#ifdef MOERT_HAVE_CUDA
        .devices = MOERT_CAP_DEVICE(MOERT_DEVICE_CPU) | MOERT_CAP_DEVICE(MOERT_DEVICE_CUDA),
#else
        .devices = MOERT_CAP_DEVICE(MOERT_DEVICE_CPU),
#endif
        .dtypes = MOERT_CAP_DTYPE(MOERT_F32) | MOERT_CAP_DTYPE(MOERT_F64) | MOERT_CAP_DTYPE(MOERT_BF16) |
                  MOERT_CAP_DTYPE(MOERT_F16),
        .flags = MOERT_CAP_NEEDS_HOST_SYNC,
    },
    .init = alltoall_init,
    .finalize = alltoall_finalize,
    .prepare = alltoall_prepare,
    .dispatch = alltoall_dispatch,
    .combine = alltoall_combine,
    .combine_backward = alltoall_combine_backward,
    .dispatch_backward = alltoall_dispatch_backward,
};
