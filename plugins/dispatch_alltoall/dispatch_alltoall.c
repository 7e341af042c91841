/* SPDX-License-Identifier: Apache-2.0 */
/* The "alltoall" dispatcher plugin: Megatron's all-to-all token dispatcher over the host's communicator.
 * This file: vtable, options, buffers and communication, and the CUDA path (the same algorithm, step by step,
 * through the kernels of dispatch_alltoall_cuda.cu); the CPU algorithm over plain arrays is in
 * dispatch_alltoall_cpu.c; the argument checks, buffers and moves the host-collective dispatchers share are
 * plugins/lib/dispatch_common.c's. */
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dispatch_alltoall_cpu.h"
#include "dispatch_common.h"
#include "moert/dispatcher.h"
#include "plugin_report.h"
#include "tensor_args.h"
#ifdef MOERT_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "plugin_cuda_check.h"

#include "../lib/dispatch_alltoall_cuda.h"
#endif

/* A buffer on the layer's device, grown on demand and reused across steps. */
typedef moert_dispatch_buffer a2a_buffer;

#ifdef MOERT_HAVE_CUDA
/* The CUDA path's step state: the layout on the device and the maps between received and grouped order. */
typedef struct a2a_cuda_state {
    a2a_buffer expert_counts;  /* int64 [E]: this rank's kept copies per expert (layout kernel) */
    a2a_buffer expert_offsets; /* int64 [E+1]: their exclusive prefix sum */
    a2a_buffer row_of_copy;    /* int32 [T*K]: send row of copy t*K+k, -1 if dropped */
    a2a_buffer copy_of_row;    /* int32 [T*K]: the copy in each send row (num_send of them) */
    a2a_buffer layout_scratch; /* moert_a2a_cuda_layout_scratch_bytes(T, E) */
    a2a_buffer upload;         /* int64 [El + world*El]: tokens_per_expert, then counts [source rank][local expert] */
    a2a_buffer grouped_src;    /* int32 [capacity]: staging row of each grouped row, -1 for padding */
    a2a_buffer staging_src;    /* int32 [num_recv]: grouped row of each staging row */
    /* on one rank the exchange moves nothing, and each way is one pass over the rows through these: */
    a2a_buffer direct_src;         /* int32 [capacity]: the copy (t*K+k) in each grouped row, -1 for padding */
    a2a_buffer direct_row_of_copy; /* int32 [T*K]: the grouped row of copy t*K+k, -1 if dropped */
    int64_t *pinned_counts;        /* [E+1] pinned host: the counts, then the bad-id counter, copied down */
    int64_t *pinned_upload;        /* [El + world*El] pinned host: what `upload` gets */
    int32_t *pinned_maps;          /* pinned host, grown: host-built maps (with pad_to_capacity) */
    size_t pinned_maps_bytes;
    int64_t *recv_final_row; /* host [num_recv], grown: a2a_plan_recv_order's answer (with pad_to_capacity) */
    size_t recv_final_row_len;
} a2a_cuda_state;
#endif

/* capacity_factor's default: with pad_to_capacity, each source rank's balanced share; set otherwise, it is warned about */
#define DEFAULT_CAPACITY_FACTOR 1.0

typedef struct alltoall_ctx {
    const moert_host *host;
    moert_layer_info layer;
    int world, rank;
    bool pad_to_capacity;
    double capacity_factor;

    bool prepared;                 /* prepare() succeeded since init */
    a2a_plan plan;                 /* this step's routing; its arrays point into the buffers below */
    int64_t *exchange_row;         /* [E+2] this rank's copies per expert, then T, then a failure flag */
    int64_t *gathered;             /* [world][E+2] every rank's exchange_row */
    int64_t *all_counts;           /* [world][E] copies from rank s to expert e */
    moert_dispatch_alltoallv a2av; /* [world] sizes and offsets for alltoallv */

    a2a_buffer copy_send_row;  /* int64 [T*K] */
    a2a_buffer recv_final_row; /* int64 [num_recv] */
    a2a_buffer send_rows;      /* rows in send order (copy order) */
    a2a_buffer staging_rows;   /* rows in receive order */
    a2a_buffer send_probs;     /* double, in send order */
    a2a_buffer staging_probs;  /* double, in receive order */
    a2a_buffer acc;            /* double [H] scratch of the reductions */

    bool on_cuda; /* the layer is on a CUDA device: the CUDA path serves it */
#ifdef MOERT_HAVE_CUDA
    a2a_cuda_state cu;
#endif
} alltoall_ctx;

/* Reports a figure for this step's report, if the host is new enough to take it. */
static void report_metric(const alltoall_ctx *c, const char *name, double value, const char *unit)
{
    moert_dispatch_metric(c->host, name, value, unit);
}

/* Sets the instance's error message and returns code, so checks can `return fail(...)`. */
#define fail(c, ...) report((c)->host, __VA_ARGS__)

/* Makes buf at least `bytes` long on the layer's device (contents not kept). */
static moert_result buffer_reserve(alltoall_ctx *c, a2a_buffer *buf, size_t bytes)
{
    return moert_dispatch_buffer_reserve(c->host, c->layer.device, buf, bytes);
}

static void buffer_release(alltoall_ctx *c, a2a_buffer *buf)
{
    moert_dispatch_buffer_release(c->host, c->layer.device, buf);
}

/* What the checks of the calls after prepare() know of this step (plugins/lib/dispatch_common.h). */
static moert_dispatch_step_shape step_shape(const alltoall_ctx *c)
{
    return (moert_dispatch_step_shape){.prepared = c->prepared,
                                       .device = c->layer.device,
                                       .tokens = c->plan.num_tokens,
                                       .topk = c->layer.topk,
                                       .hidden = c->layer.hidden,
                                       .capacity = c->plan.capacity};
}

/*
 * Moves rows between ranks: send_rows[r] rows of row_bytes from `send` (packed in rank order) to rank r,
 * recv_rows[r] rows from rank r into `recv` (packed in rank order). On CUDA, device buffers, queued on stream.
 */
static moert_result exchange(alltoall_ctx *c, moert_stream stream, const void *send, const int64_t *send_rows,
                             void *recv, const int64_t *recv_rows, size_t row_bytes)
{
    return moert_dispatch_exchange_rows(c->host, c->layer.device, stream, &c->a2av, c->world, c->world, 0, 1, send,
                                        send_rows, recv, recv_rows, row_bytes);
}

/* Bytes this rank sends to other ranks as rows of row_bytes (rows kept on this rank not counted). */
static double bytes_to_peers(const alltoall_ctx *c, size_t row_bytes)
{
    return moert_dispatch_bytes_to_peers(c->plan.send_rows, c->world, c->rank, (double)row_bytes);
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
        return fail(c, MOERT_ERR_UNSUPPORTED,
                    "the alltoall dispatcher's CUDA path takes at most %d experts, the layer "
                    "has %lld",
                    MOERT_A2A_CUDA_MAX_EXPERTS, (long long)E);
    MOK(check_cuda_device_visible(c->host, id, dev));
    const size_t upload_bytes = (size_t)(El + W * El) * sizeof(int64_t);
    moert_result rc = moert_dispatch_buffer_reserve_first(h, c->layer.device, &c->cu.upload, upload_bytes);
    if (rc == MOERT_OK) rc = h->alloc_pinned(h, (size_t)(E + 1) * sizeof(int64_t), (void **)&c->cu.pinned_counts);
    if (rc == MOERT_OK) rc = h->alloc_pinned(h, upload_bytes, (void **)&c->cu.pinned_upload);
    return rc;
}

/* Frees the CUDA path's buffers (device ones back to the host's pool, stream-ordered). */
static void cuda_finalize(alltoall_ctx *c)
{
    const moert_host *h = c->host;
    a2a_buffer *device_buffers[] = {
        &c->cu.expert_counts, &c->cu.expert_offsets, &c->cu.row_of_copy, &c->cu.copy_of_row, &c->cu.layout_scratch,
        &c->cu.upload,        &c->cu.grouped_src,    &c->cu.staging_src, &c->cu.direct_src,  &c->cu.direct_row_of_copy};
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
    moert_layer_info_copy(&c->layer, layer);
    c->world = host->world_size;
    c->rank = host->rank;

    moert_result rc = host->option_bool(host, "pad_to_capacity", false,
                                        "pad every local expert's rows to ceil(T*K/E*capacity_factor)*world_size "
                                        "(static shapes)",
                                        &c->pad_to_capacity);
    if (rc == MOERT_OK)
        rc = host->option_float(host, "capacity_factor", DEFAULT_CAPACITY_FACTOR, 1e-3, 1e3,
                                "capacity per expert and source rank, in units of T*K/E (with pad_to_capacity)",
                                &c->capacity_factor);
    if (rc != MOERT_OK) {
        free(c);
        return rc;
    }
    if (!c->pad_to_capacity && c->capacity_factor != DEFAULT_CAPACITY_FACTOR) /* set, and unused */
        host->log(host, MOERT_LOG_WARN, "$.dispatcher.capacity_factor %g has no effect without pad_to_capacity",
                  c->capacity_factor);

    const int64_t E = layer->num_experts, El = layer->num_local_experts, W = c->world;
    c->exchange_row = calloc((size_t)(E + 2), sizeof(int64_t));
    c->gathered = calloc((size_t)(W * (E + 2)), sizeof(int64_t));
    c->all_counts = calloc((size_t)(W * E), sizeof(int64_t));
    bool a2av_ok = moert_dispatch_alltoallv_alloc(&c->a2av, c->world);
    c->plan.send_rows = calloc((size_t)W, sizeof(int64_t));
    c->plan.recv_rows = calloc((size_t)W, sizeof(int64_t));
    c->plan.expert_rows = calloc((size_t)El, sizeof(int64_t));
    c->plan.tokens_per_expert = calloc((size_t)El, sizeof(int64_t));
    c->plan.group_start = calloc((size_t)El, sizeof(int64_t));
    c->plan.cursor = calloc((size_t)E, sizeof(int64_t));
    if (!c->exchange_row || !c->gathered || !c->all_counts || !a2av_ok || !c->plan.send_rows || !c->plan.recv_rows ||
        !c->plan.expert_rows || !c->plan.tokens_per_expert || !c->plan.group_start || !c->plan.cursor) {
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
    moert_dispatch_alltoallv_free(&c->a2av);
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
    const int64_t K = c->layer.topk, E = c->layer.num_experts;
    moert_result rc = moert_dispatch_check_topk_idx(c->host, c->layer.device, topk_idx, K, num_tokens);
    if (rc != MOERT_OK) return rc;
    int64_t bad = moert_dispatch_count_copies(topk_idx->data, *num_tokens, K, E, c->exchange_row);
    if (bad >= 0) return moert_dispatch_bad_expert(c->host, topk_idx->data, bad, K, E);
    return MOERT_OK;
}

#ifdef MOERT_HAVE_CUDA
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
    int64_t T = 0;
    moert_result rc = moert_dispatch_check_topk_idx(h, c->layer.device, topk_idx, K, &T);
    if (rc != MOERT_OK) return rc;
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
    if (bad) return moert_dispatch_bad_expert_count(h, bad, E);
    memcpy(c->exchange_row, cu->pinned_counts, (size_t)E * sizeof(int64_t));
    *num_tokens = T;
    return MOERT_OK;
}

/* cuda_plan's maps between received (staging) and grouped order. */
static moert_result cuda_plan_maps(alltoall_ctx *c, moert_stream stream, int64_t group_rows)
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
        for (int64_t l = 0; l < El; l++) cu->pinned_upload[El + s * El + l] = c->all_counts[s * E + first_local + l];
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
    rc = moert_dispatch_pinned_reserve(h, (void **)&cu->pinned_maps, &cu->pinned_maps_bytes, map_bytes);
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

/* On one rank: the send-order and regroup maps composed (direct_src, direct_row_of_copy), so that a dispatch, a
 * combine and their adjoints each move the rows once instead of three times (permute, exchange, regroup). */
static moert_result cuda_plan_direct(alltoall_ctx *c, moert_stream stream)
{
    const a2a_plan *p = &c->plan;
    a2a_cuda_state *cu = &c->cu;
    const int64_t copies = p->num_tokens * c->layer.topk;
    moert_result rc = buffer_reserve(c, &cu->direct_src, (size_t)p->capacity * sizeof(int32_t));
    if (rc == MOERT_OK) rc = buffer_reserve(c, &cu->direct_row_of_copy, (size_t)copies * sizeof(int32_t));
    if (rc == MOERT_OK)
        rc = moert_a2a_cuda_compose_maps(c->host, (cudaStream_t)stream, p->capacity, cu->grouped_src.data,
                                         cu->copy_of_row.data, cu->direct_src.data);
    if (rc == MOERT_OK)
        rc = moert_a2a_cuda_compose_maps(c->host, (cudaStream_t)stream, copies, cu->row_of_copy.data,
                                         cu->staging_src.data, cu->direct_row_of_copy.data);
    return rc;
}

/*
 * prepare()'s plan on CUDA, after the sizes: uploads tokens_per_expert and this rank's received counts
 * [source rank][local expert] (through pinned memory, no wait), then builds the maps between received
 * (staging) and grouped order: on the device with the regroup kernel, or on the host (a2a_plan_recv_order,
 * the CPU's own order) when padding puts gaps between the groups. On one rank, composes them with the send order.
 */
static moert_result cuda_plan(alltoall_ctx *c, moert_stream stream, int64_t group_rows)
{
    moert_result rc = cuda_plan_maps(c, stream, group_rows);
    if (rc == MOERT_OK && c->world == 1) rc = cuda_plan_direct(c, stream);
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
    moert_result local_rc = moert_dispatch_check_layout(h, layout);
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

    moert_result rc = moert_dispatch_exchange_counts(h, c->world, c->exchange_row, c->gathered, E + 2, local_rc);
    if (rc != MOERT_OK) return rc;

    int64_t max_tokens = 0;
    for (int s = 0; s < c->world; s++) {
        const int64_t *row = c->gathered + (int64_t)s * (E + 2);
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
    return moert_dispatch_check_cuda_dtypes(c->host, call, name_a, a, name_b, b);
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
 * experts: permute into send order (copy_of_row), all-to-all, regroup (grouped_src; padding rows get 0); on one
 * rank one gather through direct_src. divisor: K for token rows (copy c reads row c/K), 1 for per-copy values (the
 * [T*K] probs).
 */
static moert_result cuda_forward_rows(alltoall_ctx *c, moert_stream stream, moert_dtype dtype, int64_t width,
                                      int32_t divisor, const void *src, a2a_buffer *send, a2a_buffer *staging,
                                      void *grouped)
{
    const moert_host *h = c->host;
    const a2a_plan *p = &c->plan;
    if (c->world == 1)
        return moert_a2a_cuda_gather_rows(h, (cudaStream_t)stream, dtype, p->capacity, width, c->cu.direct_src.data,
                                          divisor, NULL, src, grouped);
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
    rc = cuda_forward_rows(c, stream, dtype, H, (int32_t)c->layer.topk, args->x->data, &c->send_rows, &c->staging_rows,
                           args->recv_x->data);
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
    if (c->world == 1) /* straight from the grouped rows */
        return moert_a2a_cuda_combine_rows(c->host, (cudaStream_t)stream, dtype, p->num_tokens, c->layer.topk, H,
                                           c->cu.direct_row_of_copy.data, args->y_expert->data, args->y->data, 0);
    rc = cuda_backward_rows(c, stream, dtype, H, args->y_expert->data, &c->send_rows, &c->staging_rows);
    if (rc != MOERT_OK) return rc;
    return moert_a2a_cuda_combine_rows(c->host, (cudaStream_t)stream, dtype, p->num_tokens, c->layer.topk, H,
                                       c->cu.row_of_copy.data, c->send_rows.data, args->y->data, 0);
}

/* combine_backward() on CUDA: a dispatch of d_y's rows without probs. */
static moert_result cuda_combine_backward(alltoall_ctx *c, moert_stream stream, const moert_combine_backward_args *args)
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
    if (c->world == 1) { /* straight from the grouped rows */
        rc = moert_a2a_cuda_combine_rows(c->host, (cudaStream_t)stream, dtype, p->num_tokens, K, H,
                                         c->cu.direct_row_of_copy.data, args->d_recv_x->data, args->d_x->data, 1);
        if (rc != MOERT_OK || !args->d_recv_probs) return rc;
        return moert_a2a_cuda_gather_rows(c->host, (cudaStream_t)stream, args->d_recv_probs->dtype, p->num_tokens * K,
                                          1, c->cu.direct_row_of_copy.data, 1, NULL, args->d_recv_probs->data,
                                          args->d_topk_probs->data);
    }
    rc = cuda_backward_rows(c, stream, dtype, H, args->d_recv_x->data, &c->send_rows, &c->staging_rows);
    if (rc == MOERT_OK)
        rc = moert_a2a_cuda_combine_rows(c->host, (cudaStream_t)stream, dtype, p->num_tokens, K, H,
                                         c->cu.row_of_copy.data, c->send_rows.data, args->d_x->data, 1);
    if (rc != MOERT_OK || !args->d_recv_probs) return rc;
    const moert_dtype pd = args->d_recv_probs->dtype;
    rc = cuda_backward_rows(c, stream, pd, 1, args->d_recv_probs->data, &c->send_probs, &c->staging_probs);
    if (rc != MOERT_OK) return rc;
    /* d_topk_probs[t*K+k] = the gradient in copy (t,k)'s send row; 0 for a dropped copy (row -1) */
    return moert_a2a_cuda_gather_rows(c->host, (cudaStream_t)stream, pd, p->num_tokens * K, 1, c->cu.row_of_copy.data,
                                      1, NULL, c->send_probs.data, args->d_topk_probs->data);
}
#endif

/* Sends each kept token copy (row and routing weight) to the rank owning its expert, grouped by local expert. */
static moert_result alltoall_dispatch(void *ctx, moert_stream stream, const moert_dispatch_args *args)
{
    alltoall_ctx *c = ctx;
    const a2a_plan *p = &c->plan;
    const int64_t H = c->layer.hidden, T = p->num_tokens, K = c->layer.topk;
    const moert_dispatch_step_shape shape = step_shape(c);
    moert_result rc = moert_dispatch_check_dispatch(c->host, &shape, args);
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
    moert_dispatch_scatter_rows(p->recv_final_row, p->num_recv, c->staging_rows.data, row_bytes, args->recv_x->data);
    a2a_zero_padding(p, args->recv_x->data, row_bytes);
    double sent = bytes_to_peers(c, row_bytes);

    if (args->topk_probs) {
        rc = buffer_reserve(c, &c->send_probs, (size_t)p->num_send * sizeof(double));
        if (rc == MOERT_OK) rc = buffer_reserve(c, &c->staging_probs, (size_t)p->num_recv * sizeof(double));
        if (rc != MOERT_OK) return rc;
        moert_dispatch_pack_probs(p->copy_send_row, T * K, args->topk_probs->data, args->topk_probs->dtype,
                                  c->send_probs.data);
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
    const a2a_plan *p = &c->plan;
    const int64_t H = c->layer.hidden;
    const moert_dispatch_step_shape shape = step_shape(c);
    moert_result rc = moert_dispatch_check_combine(c->host, &shape, args);
    if (rc != MOERT_OK) return rc;
#ifdef MOERT_HAVE_CUDA
    if (c->on_cuda) return cuda_combine(c, stream, args);
#endif

    const size_t row_bytes = (size_t)H * moert_dtype_size(args->y_expert->dtype);
    rc = buffer_reserve(c, &c->send_rows, (size_t)p->num_send * row_bytes);
    if (rc == MOERT_OK) rc = buffer_reserve(c, &c->staging_rows, (size_t)p->num_recv * row_bytes);
    if (rc == MOERT_OK) rc = buffer_reserve(c, &c->acc, (size_t)H * sizeof(double));
    if (rc != MOERT_OK) return rc;
    moert_dispatch_gather_rows(p->recv_final_row, p->num_recv, args->y_expert->data, row_bytes, c->staging_rows.data);
    rc = exchange(c, stream, c->staging_rows.data, p->recv_rows, c->send_rows.data, p->send_rows, row_bytes);
    if (rc != MOERT_OK) return rc;
    moert_dispatch_sum_rows(p->copy_send_row, p->num_tokens, c->layer.topk, c->send_rows.data, args->y_expert->dtype,
                            p->num_send, H, 0, args->y->data, args->y->dtype, c->acc.data);
    return MOERT_OK;
}

/* The adjoint of combine: every received row gets its token's gradient (a dispatch of d_y without probs). */
static moert_result alltoall_combine_backward(void *ctx, moert_stream stream, const moert_combine_backward_args *args)
{
    alltoall_ctx *c = ctx;
    const a2a_plan *p = &c->plan;
    const int64_t H = c->layer.hidden;
    const moert_dispatch_step_shape shape = step_shape(c);
    moert_result rc = moert_dispatch_check_combine_backward(c->host, &shape, args);
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
    moert_dispatch_scatter_rows(p->recv_final_row, p->num_recv, c->staging_rows.data, row_bytes,
                                args->d_y_expert->data);
    a2a_zero_padding(p, args->d_y_expert->data, row_bytes);
    return MOERT_OK;
}

/* The adjoint of dispatch: row gradients summed into their tokens (+=), weight gradients to their slots. */
static moert_result alltoall_dispatch_backward(void *ctx, moert_stream stream, const moert_dispatch_backward_args *args)
{
    alltoall_ctx *c = ctx;
    const a2a_plan *p = &c->plan;
    const int64_t H = c->layer.hidden, T = p->num_tokens, K = c->layer.topk;
    const moert_dispatch_step_shape shape = step_shape(c);
    moert_result rc = moert_dispatch_check_dispatch_backward(c->host, &shape, args);
    if (rc != MOERT_OK) return rc;
#ifdef MOERT_HAVE_CUDA
    if (c->on_cuda) return cuda_dispatch_backward(c, stream, args);
#endif

    const size_t row_bytes = (size_t)H * moert_dtype_size(args->d_recv_x->dtype);
    rc = buffer_reserve(c, &c->send_rows, (size_t)p->num_send * row_bytes);
    if (rc == MOERT_OK) rc = buffer_reserve(c, &c->staging_rows, (size_t)p->num_recv * row_bytes);
    if (rc == MOERT_OK) rc = buffer_reserve(c, &c->acc, (size_t)H * sizeof(double));
    if (rc != MOERT_OK) return rc;
    moert_dispatch_gather_rows(p->recv_final_row, p->num_recv, args->d_recv_x->data, row_bytes, c->staging_rows.data);
    rc = exchange(c, stream, c->staging_rows.data, p->recv_rows, c->send_rows.data, p->send_rows, row_bytes);
    if (rc != MOERT_OK) return rc;
    moert_dispatch_sum_rows(p->copy_send_row, T, K, c->send_rows.data, args->d_recv_x->dtype, p->num_send, H, 1,
                            args->d_x->data, args->d_x->dtype, c->acc.data);

    if (args->d_recv_probs) {
        rc = buffer_reserve(c, &c->send_probs, (size_t)p->num_send * sizeof(double));
        if (rc == MOERT_OK) rc = buffer_reserve(c, &c->staging_probs, (size_t)p->num_recv * sizeof(double));
        if (rc != MOERT_OK) return rc;
        moert_dispatch_gather_probs(p->recv_final_row, p->num_recv, args->d_recv_probs->data, args->d_recv_probs->dtype,
                                    p->capacity, c->staging_probs.data);
        rc = exchange(c, stream, c->staging_probs.data, p->recv_rows, c->send_probs.data, p->send_rows, sizeof(double));
        if (rc != MOERT_OK) return rc;
        moert_dispatch_unpack_probs(p->copy_send_row, T * K, c->send_probs.data, args->d_topk_probs->data,
                                    args->d_topk_probs->dtype);
    }
    return MOERT_OK;
}

/* The one exported symbol. Its name equals the vtable's typedef name, which C does not allow for an object in the
 * same scope, so the object gets a private C name and its linker name through an asm label. */
MOERT_DISPATCHER_V1_EXPORT(alltoall_vtable) = {
    .header =
        {
            MOERT_DISPATCHER_V1_HEADER,
            .name = "alltoall",
            .version = "0.1.0",
            .description = "Megatron-style all-to-all token dispatcher (count exchange, alltoallv, regroup by expert)",
            .devices = MOERT_DISPATCH_DEVICES,
            .dtypes = MOERT_DISPATCH_DTYPES,
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
