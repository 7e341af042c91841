/* SPDX-License-Identifier: Apache-2.0 */
/* The "allgather" dispatcher plugin: Megatron's allgather token dispatcher (MoEAllGatherTokenDispatcher) over the
 * host's communicator. Every rank gathers every rank's tokens, routing and probs, keeps the copies routed to its own
 * experts (grouped by local expert), and the combine is a reduce-scatter of each rank's partial sums back to the
 * tokens' owners. This file: vtable, buffers and communication, and the CUDA path's sequence (the kernels are in
 * allgather_cuda.cu and plugins/lib/dispatch_alltoall_cuda.cu); the CPU algorithm over plain arrays is in
 * allgather_cpu.c; the argument checks, buffers and count exchange the host-collective dispatchers share are
 * plugins/lib/dispatch_common.c's. */
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "allgather_cpu.h"
#include "dispatch_common.h"
#include "moert/dispatcher.h"
#include "plugin_report.h"
#include "tensor_args.h"
#ifdef MOERT_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "allgather_cuda.h"
#include "plugin_cuda_check.h"

#include "../lib/dispatch_alltoall_cuda.h"
#endif

/* A buffer on the layer's device, grown on demand and reused across steps. */
typedef moert_dispatch_buffer ag_buffer;

#ifdef MOERT_HAVE_CUDA
/* The CUDA path's step state: the routing of the gathered tokens on the device. */
typedef struct ag_cuda_state {
    ag_buffer counts;            /* int64 [E+1]: this rank's copies per expert, then the bad-id counter */
    ag_buffer local_idx;         /* int32 [world*max_tokens*K]: the gathered routing, local experts only */
    ag_buffer copy_row;          /* int32 [world*max_tokens*K]: grouped row of each gathered copy, -1 elsewhere */
    ag_buffer grouped_copy;      /* int32 [world*max_tokens*K]: gathered copy of each grouped row (num_recv used) */
    ag_buffer tokens_per_expert; /* int64 [El] */
    ag_buffer expert_offsets;    /* int64 [El+1] */
    ag_buffer layout_scratch;    /* moert_a2a_cuda_layout_scratch_bytes(world*max_tokens, El) */
    int64_t *pinned_counts;      /* [E+1] pinned host: the counts and the bad-id counter, copied down */
} ag_cuda_state;
#endif

typedef struct allgather_ctx {
    const moert_host *host;
    moert_layer_info layer;
    int world, rank;

    bool prepared;                 /* prepare() succeeded since init */
    ag_plan plan;                  /* this step's routing; grouped_copy and copy_row point into the buffers below */
    int64_t *exchange_row;         /* [E+2] this rank's copies per expert, then T, then a failure flag */
    int64_t *gathered;             /* [world][E+2] every rank's exchange_row */
    int64_t *all_counts;           /* [world][E] copies from rank s to expert e */
    moert_dispatch_alltoallv a2av; /* [world] sizes and offsets for the reduce-scatter's alltoallv */

    ag_buffer idx_send;       /* int32 [max_tokens*K]: this rank's topk_idx, padded with -1 */
    ag_buffer gathered_idx;   /* int32 [world*max_tokens*K]: every rank's (this rank's own at rank*max_tokens*K) */
    ag_buffer grouped_copy;   /* CPU: int64 [num_recv] */
    ag_buffer copy_row;       /* CPU: int64 [world*max_tokens*K] */
    ag_buffer rows_send;      /* [max_tokens, H]: x or d_y, padded (when T < max_tokens) */
    ag_buffer gathered_rows;  /* [world*max_tokens, H] */
    ag_buffer probs_send;     /* [max_tokens*K]: double on the CPU, the probs' dtype on CUDA */
    ag_buffer gathered_probs; /* [world*max_tokens*K] */
    ag_buffer partial;        /* [world*max_tokens, width]: double on the CPU, fp32 on CUDA */
    ag_buffer recv_partial;   /* [world][T][width]: every rank's partials of this rank's tokens */

    bool on_cuda; /* the layer is on a CUDA device: the CUDA path serves it */
#ifdef MOERT_HAVE_CUDA
    ag_cuda_state cu;
#endif
} allgather_ctx;

/* Reports a figure for this step's report, if the host is new enough to take it. */
static void report_metric(const allgather_ctx *c, const char *name, double value, const char *unit)
{
    moert_dispatch_metric(c->host, name, value, unit);
}

/* Sets the instance's error message and returns code, so checks can `return fail(...)`. */
#define fail(c, ...) report((c)->host, __VA_ARGS__)

/* Makes buf at least `bytes` long on the layer's device (contents not kept). */
static moert_result buffer_reserve(allgather_ctx *c, ag_buffer *buf, size_t bytes)
{
    return moert_dispatch_buffer_reserve(c->host, c->layer.device, buf, bytes);
}

static void buffer_release(allgather_ctx *c, ag_buffer *buf)
{
    moert_dispatch_buffer_release(c->host, c->layer.device, buf);
}

/* What the checks of the calls after prepare() know of this step (plugins/lib/dispatch_common.h); the grouped buffers
 * have num_recv rows. */
static moert_dispatch_step_shape step_shape(const allgather_ctx *c)
{
    return (moert_dispatch_step_shape){.prepared = c->prepared,
                                       .device = c->layer.device,
                                       .tokens = c->plan.num_tokens,
                                       .topk = c->layer.topk,
                                       .hidden = c->layer.hidden,
                                       .capacity = c->plan.num_recv};
}

/* The gathered copies of this step: world blocks of max_tokens tokens with K copies each. */
static int64_t gathered_copies(const allgather_ctx *c) { return (int64_t)c->world * c->plan.max_tokens * c->plan.topk; }

/* This rank's own topk_idx [T,K], its block of the gathered routing (prepare() keeps it for the reductions). */
static const int32_t *own_idx(const allgather_ctx *c)
{
    return (const int32_t *)c->gathered_idx.data + (int64_t)c->rank * c->plan.max_tokens * c->plan.topk;
}

/* Copies `bytes` on the layer's device (stream-ordered on CUDA). */
static moert_result device_copy(allgather_ctx *c, moert_stream stream, void *dst, const void *src, size_t bytes)
{
    return moert_dispatch_copy(c->host, c->layer.device, stream, dst, src, bytes);
}

/* The allgather: recv gets every rank's block of block_bytes, in rank order. At world 1 a copy, no collective. */
static moert_result gather_blocks(allgather_ctx *c, moert_stream stream, const void *send, void *recv,
                                  size_t block_bytes)
{
    if (c->world == 1) return device_copy(c, stream, recv, send, block_bytes);
    if (!block_bytes) return MOERT_OK; /* no rank has tokens: every rank skips alike (the sizes are the step's) */
    return c->host->allgather(c->host, send, recv, block_bytes, c->layer.device, stream);
}

/*
 * The data movement of the reduce-scatter: rank s gets the partials of its own tokens (rows [s*max_tokens,
 * s*max_tokens + T_s) of `partial`, token_bytes each) from every rank, into recv_partial [world][T_s]. The sum is
 * then taken at the owner in rank order (deterministic, and it works for any dtype the host's allreduce does not
 * take). At world 1 the partials are the sum already: *sums points at them, no collective is called.
 */
static moert_result reduce_scatter_exchange(allgather_ctx *c, moert_stream stream, size_t token_bytes,
                                            const void **sums)
{
    const ag_plan *p = &c->plan;
    if (c->world == 1) {
        *sums = c->partial.data;
        return MOERT_OK;
    }
    moert_result rc = buffer_reserve(c, &c->recv_partial, (size_t)(c->world * p->num_tokens) * token_bytes);
    if (rc != MOERT_OK) return rc;
    moert_dispatch_alltoallv *v = &c->a2av;
    for (int s = 0; s < c->world; s++) {
        v->send_bytes[s] = (size_t)p->rank_tokens[s] * token_bytes;
        v->send_offsets[s] = (size_t)((int64_t)s * p->max_tokens) * token_bytes;
        v->recv_bytes[s] = (size_t)p->num_tokens * token_bytes;
        v->recv_offsets[s] = (size_t)((int64_t)s * p->num_tokens) * token_bytes;
    }
    *sums = c->recv_partial.data;
    return c->host->alltoallv(c->host, c->partial.data, v->send_bytes, v->send_offsets, c->recv_partial.data,
                              v->recv_bytes, v->recv_offsets, c->layer.device, stream);
}

/*
 * Allgathers a [T, width] block of this rank (row_bytes per token) into gathered [world*max_tokens, width]: the
 * block goes as it is when T is the largest T, else padded through `send` (the padding rows are never read: their
 * copies are dropped in the gathered routing).
 */
static moert_result gather_token_rows(allgather_ctx *c, moert_stream stream, const void *rows, size_t row_bytes,
                                      ag_buffer *send, ag_buffer *gathered)
{
    const ag_plan *p = &c->plan;
    const size_t block_bytes = (size_t)p->max_tokens * row_bytes;
    moert_result rc = buffer_reserve(c, gathered, (size_t)c->world * block_bytes);
    if (rc != MOERT_OK) return rc;
    const void *block = rows;
    if (p->num_tokens < p->max_tokens) {
        rc = buffer_reserve(c, send, block_bytes);
        if (rc == MOERT_OK) rc = device_copy(c, stream, send->data, rows, (size_t)p->num_tokens * row_bytes);
        if (rc != MOERT_OK) return rc;
        block = send->data;
    }
    return gather_blocks(c, stream, block, gathered->data, block_bytes);
}

/* Bytes this rank sends to the other ranks in a dispatch: its block of rows, probs and routing, once per peer. */
static double dispatch_bytes_sent(const allgather_ctx *c, size_t row_bytes, size_t prob_bytes)
{
    const ag_plan *p = &c->plan;
    const double per_token = (double)row_bytes + (double)p->topk * ((double)prob_bytes + sizeof(int32_t));
    return (double)(c->world - 1) * (double)p->max_tokens * per_token;
}

static void allgather_finalize(void *ctx);

#ifdef MOERT_HAVE_CUDA
/*
 * The CUDA path's fixed state: checks that the layer's device answers and that the kernels take E experts, then
 * allocates the device and pinned count arrays (the first allocation also tells whether the host can allocate on
 * the device at all).
 */
static moert_result cuda_init(allgather_ctx *c)
{
    const moert_host *h = c->host;
    const int64_t E = c->layer.num_experts;
    char dev[32];
    moert_arg_device_text(c->layer.device, dev, sizeof dev);
    if (E > MOERT_AG_CUDA_MAX_EXPERTS || E > MOERT_A2A_CUDA_MAX_EXPERTS)
        return fail(c, MOERT_ERR_UNSUPPORTED,
                    "the allgather dispatcher's CUDA path takes at most %d experts, the "
                    "layer has %lld",
                    MOERT_AG_CUDA_MAX_EXPERTS, (long long)E);
    MOK(check_cuda_device_visible(c->host, (int)c->layer.device.id, dev));
    moert_result rc =
        moert_dispatch_buffer_reserve_first(h, c->layer.device, &c->cu.counts, (size_t)(E + 1) * sizeof(int64_t));
    if (rc == MOERT_OK) rc = h->alloc_pinned(h, (size_t)(E + 1) * sizeof(int64_t), (void **)&c->cu.pinned_counts);
    return rc;
}

/* Frees the CUDA path's buffers (device ones back to the host's pool, stream-ordered). */
static void cuda_finalize(allgather_ctx *c)
{
    ag_buffer *device_buffers[] = {&c->cu.counts,        &c->cu.local_idx,         &c->cu.copy_row,
                                   &c->cu.grouped_copy,  &c->cu.tokens_per_expert, &c->cu.expert_offsets,
                                   &c->cu.layout_scratch};
    for (size_t i = 0; i < sizeof device_buffers / sizeof device_buffers[0]; i++) buffer_release(c, device_buffers[i]);
    if (c->cu.pinned_counts) c->host->free_pinned(c->host, c->cu.pinned_counts);
    memset(&c->cu, 0, sizeof c->cu);
}
#endif

/* Creates one instance: checks the layer, allocates the fixed-size arrays. The dispatcher has no options. */
static moert_result allgather_init(void **out, const moert_host *host, const moert_layer_info *layer)
{
    *out = NULL;
    moert_result check = moert_arg_check_dispatch_layer(host, layer, "allgather", 0);
    if (check != MOERT_OK) return check;

    allgather_ctx *c = calloc(1, sizeof *c);
    if (!c) {
        host->set_error(host, "out of memory for the dispatcher state");
        return MOERT_ERR_OUT_OF_MEMORY;
    }
    c->host = host;
    moert_layer_info_copy(&c->layer, layer);
    c->world = host->world_size;
    c->rank = host->rank;

    const int64_t E = layer->num_experts, El = layer->num_local_experts, W = c->world;
    c->exchange_row = calloc((size_t)(E + 2), sizeof(int64_t));
    c->gathered = calloc((size_t)(W * (E + 2)), sizeof(int64_t));
    c->all_counts = calloc((size_t)(W * E), sizeof(int64_t));
    bool a2av_ok = moert_dispatch_alltoallv_alloc(&c->a2av, c->world);
    c->plan.rank_tokens = calloc((size_t)W, sizeof(int64_t));
    c->plan.tokens_per_expert = calloc((size_t)El, sizeof(int64_t));
    c->plan.group_start = calloc((size_t)El, sizeof(int64_t));
    c->plan.cursor = calloc((size_t)El, sizeof(int64_t));
    if (!c->exchange_row || !c->gathered || !c->all_counts || !a2av_ok || !c->plan.rank_tokens ||
        !c->plan.tokens_per_expert || !c->plan.group_start || !c->plan.cursor) {
        allgather_finalize(c);
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
        moert_result rc = cuda_init(c);
        if (rc != MOERT_OK) {
            allgather_finalize(c);
            return rc;
        }
    }
#endif
    *out = c;
    return MOERT_OK;
}

/* Frees everything the instance owns. */
static void allgather_finalize(void *ctx)
{
    allgather_ctx *c = ctx;
    if (!c) return;
    ag_buffer *buffers[] = {&c->idx_send,      &c->gathered_idx, &c->grouped_copy,   &c->copy_row, &c->rows_send,
                            &c->gathered_rows, &c->probs_send,   &c->gathered_probs, &c->partial,  &c->recv_partial};
    for (size_t i = 0; i < sizeof buffers / sizeof buffers[0]; i++) buffer_release(c, buffers[i]);
#ifdef MOERT_HAVE_CUDA
    cuda_finalize(c);
#endif
    free(c->exchange_row);
    free(c->gathered);
    free(c->all_counts);
    moert_dispatch_alltoallv_free(&c->a2av);
    free(c->plan.rank_tokens);
    free(c->plan.tokens_per_expert);
    free(c->plan.group_start);
    free(c->plan.cursor);
    free(c);
}

/* Checks topk_idx's shape, dtype and device (every path); sets *num_tokens. */
static moert_result check_topk_idx(allgather_ctx *c, const moert_tensor *topk_idx, int64_t *num_tokens)
{
    return moert_dispatch_check_topk_idx(c->host, c->layer.device, topk_idx, c->layer.topk, num_tokens);
}

/* prepare()'s local part on the CPU: counts this rank's copies per expert into exchange_row[0..E). */
static moert_result count_local(allgather_ctx *c, const moert_tensor *topk_idx, int64_t *num_tokens)
{
    moert_result rc = check_topk_idx(c, topk_idx, num_tokens);
    if (rc != MOERT_OK) return rc;
    const int64_t K = c->layer.topk, E = c->layer.num_experts;
    int64_t bad = moert_dispatch_count_copies(topk_idx->data, *num_tokens, K, E, c->exchange_row);
    if (bad >= 0) return moert_dispatch_bad_expert(c->host, topk_idx->data, bad, K, E);
    return MOERT_OK;
}

#ifdef MOERT_HAVE_CUDA
/*
 * prepare()'s local part on CUDA: counts this rank's copies per expert on the device and copies the counts and the
 * bad-id counter down through pinned memory, waiting for the stream with the host's bounded wait: the one host sync
 * of a step. Fills exchange_row[0..E).
 */
static moert_result cuda_count_local(allgather_ctx *c, moert_stream stream, const moert_tensor *topk_idx,
                                     int64_t *num_tokens)
{
    const moert_host *h = c->host;
    const int64_t E = c->layer.num_experts, K = c->layer.topk;
    MOK(check_topk_idx(c, topk_idx, num_tokens));
    int64_t *counts = c->cu.counts.data;
    MOK(moert_ag_cuda_count(h, (cudaStream_t)stream, topk_idx->data, *num_tokens, K, E, counts,
                            (unsigned long long *)(counts + E)));
    MOK(h->memcpy_async(h, c->cu.pinned_counts, moert_cpu(), counts, c->layer.device, (size_t)(E + 1) * sizeof(int64_t),
                        stream));
    MOK(h->stream_synchronize(h, stream));
    unsigned long long bad = 0;
    memcpy(&bad, c->cu.pinned_counts + E, sizeof bad);
    if (bad) return moert_dispatch_bad_expert_count(h, bad, E);
    memcpy(c->exchange_row, c->cu.pinned_counts, (size_t)E * sizeof(int64_t));
    return MOERT_OK;
}

/*
 * prepare()'s local permutation on CUDA, after the routing allgather: keeps the copies of local experts
 * (moert_ag_cuda_localize) and sorts them by local expert, stable in gathered copy order, with the all-to-all
 * dispatcher's layout pass: its row_of_copy is copy_row, its copy_of_row grouped_copy, its counts tokens_per_expert.
 */
static moert_result cuda_plan_rows(allgather_ctx *c, moert_stream stream)
{
    const moert_host *h = c->host;
    ag_cuda_state *cu = &c->cu;
    const int64_t El = c->layer.num_local_experts, tokens = (int64_t)c->world * c->plan.max_tokens;
    const int64_t copies = gathered_copies(c);
    const size_t map_bytes = (size_t)copies * sizeof(int32_t);
    MOK(buffer_reserve(c, &cu->local_idx, map_bytes));
    MOK(buffer_reserve(c, &cu->copy_row, map_bytes));
    MOK(buffer_reserve(c, &cu->grouped_copy, map_bytes));
    MOK(buffer_reserve(c, &cu->tokens_per_expert, (size_t)El * sizeof(int64_t)));
    MOK(buffer_reserve(c, &cu->expert_offsets, (size_t)(El + 1) * sizeof(int64_t)));
    MOK(buffer_reserve(c, &cu->layout_scratch, moert_a2a_cuda_layout_scratch_bytes(tokens, El)));
    MOK(moert_ag_cuda_localize(h, (cudaStream_t)stream, c->gathered_idx.data, copies, c->layer.first_local_expert, El,
                               cu->local_idx.data));
    moert_a2a_cuda_layout_buffers bufs = {.tokens_per_expert = cu->tokens_per_expert.data,
                                          .expert_offsets = cu->expert_offsets.data,
                                          .row_of_copy = cu->copy_row.data,
                                          .copy_of_row = cu->grouped_copy.data,
                                          .scratch = cu->layout_scratch.data};
    return moert_a2a_cuda_layout(h, (cudaStream_t)stream, cu->local_idx.data, tokens, c->layer.topk, El, &bufs, NULL);
}
#endif

/* This rank's topk_idx [T,K] padded with dropped copies to [max_tokens, K] (on the layer's device). */
static moert_result pad_idx(allgather_ctx *c, moert_stream stream, const moert_tensor *topk_idx)
{
    const ag_plan *p = &c->plan;
    const int64_t K = p->topk;
    moert_result rc = buffer_reserve(c, &c->idx_send, (size_t)(p->max_tokens * K) * sizeof(int32_t));
    if (rc != MOERT_OK) return rc;
#ifdef MOERT_HAVE_CUDA
    if (c->on_cuda)
        return moert_ag_cuda_pad_idx(c->host, (cudaStream_t)stream, topk_idx->data, p->num_tokens, p->max_tokens, K,
                                     c->idx_send.data);
#endif
    (void)stream;
    int32_t *out = c->idx_send.data;
    memcpy(out, topk_idx->data, (size_t)(p->num_tokens * K) * sizeof(int32_t));
    for (int64_t i = p->num_tokens * K; i < p->max_tokens * K; i++) out[i] = -1;
    return MOERT_OK;
}

/*
 * Counts copies per expert, allgathers the [world x (E+2)] count matrix with each rank's T and a failure flag (every
 * rank takes part even when its own input was bad, so all ranks fail together instead of waiting for each other),
 * then allgathers the routing itself and plans the local permutation. This is the step's one host sync: Megatron's
 * allgather dispatcher reads tokens_per_expert on the host too.
 */
static moert_result allgather_prepare(void *ctx, moert_stream stream, const moert_tensor *topk_idx,
                                      moert_dispatch_layout *layout)
{
    allgather_ctx *c = ctx;
    const moert_host *h = c->host;
    const int64_t E = c->layer.num_experts, El = c->layer.num_local_experts, K = c->layer.topk;
    ag_plan *p = &c->plan;
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
    if (local_rc != MOERT_OK) {
        memset(c->exchange_row, 0, (size_t)E * sizeof(int64_t));
        num_tokens = 0;
    }
    c->exchange_row[E] = num_tokens;
    c->exchange_row[E + 1] = local_rc;

    moert_result rc = moert_dispatch_exchange_counts(h, c->world, c->exchange_row, c->gathered, E + 2, local_rc);
    if (rc != MOERT_OK) return rc;

    int64_t max_tokens = 0;
    for (int s = 0; s < c->world; s++) {
        const int64_t *row = c->gathered + (int64_t)s * (E + 2);
        memcpy(c->all_counts + (int64_t)s * E, row, (size_t)E * sizeof(int64_t));
        p->rank_tokens[s] = row[E];
        if (row[E] > max_tokens) max_tokens = row[E];
    }
    p->num_tokens = num_tokens;
    p->max_tokens = max_tokens;
    ag_plan_sizes(p, c->all_counts);
#ifdef MOERT_HAVE_CUDA
    /* every rank sees the same sizes, so every rank refuses together */
    if (c->on_cuda && (gathered_copies(c) > INT32_MAX || p->num_recv > INT32_MAX))
        return fail(c, MOERT_ERR_UNSUPPORTED,
                    "prepare(): %lld gathered token copies (world x largest T x topk), the "
                    "CUDA path takes at most %d",
                    (long long)gathered_copies(c), INT32_MAX);
#endif

    /* the routing allgather: every rank's topk_idx, padded to the largest T */
    rc = pad_idx(c, stream, topk_idx);
    if (rc == MOERT_OK) rc = buffer_reserve(c, &c->gathered_idx, (size_t)gathered_copies(c) * sizeof(int32_t));
    if (rc == MOERT_OK)
        rc = gather_blocks(c, stream, c->idx_send.data, c->gathered_idx.data,
                           (size_t)(max_tokens * K) * sizeof(int32_t));
    if (rc != MOERT_OK) return rc;

    void *tokens_per_expert_data = p->tokens_per_expert;
#ifdef MOERT_HAVE_CUDA
    if (c->on_cuda) {
        rc = cuda_plan_rows(c, stream);
        if (rc != MOERT_OK) return rc;
        tokens_per_expert_data = c->cu.tokens_per_expert.data;
    } else
#endif
    {
        rc = buffer_reserve(c, &c->grouped_copy, (size_t)p->num_recv * sizeof(int64_t));
        if (rc == MOERT_OK) rc = buffer_reserve(c, &c->copy_row, (size_t)gathered_copies(c) * sizeof(int64_t));
        if (rc != MOERT_OK) return rc;
        p->grouped_copy = c->grouped_copy.data;
        p->copy_row = c->copy_row.data;
        ag_plan_rows(p, c->gathered_idx.data);
    }

    layout->num_recv = p->num_recv;
    layout->capacity = p->num_recv;
    layout->tokens_per_expert = moert_tensor_1d(tokens_per_expert_data, c->layer.device, MOERT_I64, El);
    layout->tokens_per_expert_host = p->tokens_per_expert;
    c->prepared = true;
    report_metric(c, "dispatch.recv_tokens", (double)p->num_recv, "tokens");
    h->log(h, MOERT_LOG_DEBUG, "prepare: T %lld (largest %lld), receive %lld rows", (long long)num_tokens,
           (long long)max_tokens, (long long)p->num_recv);
    return MOERT_OK;
}

#ifdef MOERT_HAVE_CUDA
/* The kernels move fp32 and bf16 data; both tensors of a pair must share the dtype. */
static moert_result cuda_check_dtypes(const allgather_ctx *c, const char *call, const char *name_a,
                                      const moert_tensor *a, const char *name_b, const moert_tensor *b)
{
    return moert_dispatch_check_cuda_dtypes(c->host, call, name_a, a, name_b, b);
}

/*
 * Token values [T, token_width] of dtype to the grouped rows of the local experts: allgather, then gather by
 * grouped_copy. Token rows: token_width = row_width = H, divisor K (copy c reads token c/K); the per-copy probs:
 * token_width K, row_width 1, divisor 1 (copy c reads value c).
 */
static moert_result cuda_forward_rows(allgather_ctx *c, moert_stream stream, moert_dtype dtype, int64_t token_width,
                                      int64_t row_width, int32_t divisor, const void *src, ag_buffer *send,
                                      ag_buffer *gathered, void *grouped)
{
    MOK(gather_token_rows(c, stream, src, (size_t)token_width * moert_dtype_size(dtype), send, gathered));
    return moert_a2a_cuda_gather_rows(c->host, (cudaStream_t)stream, dtype, c->plan.num_recv, row_width,
                                      c->cu.grouped_copy.data, divisor, NULL, gathered->data, grouped);
}

/* Grouped rows [num_recv, H] back to their tokens: fp32 partial sums of every gathered token, reduce-scatter to the
 * owners, their sum into out [T, H] (= or +=). */
static moert_result cuda_backward_rows(allgather_ctx *c, moert_stream stream, moert_dtype dtype, const void *grouped,
                                       int accumulate, void *out)
{
    const ag_plan *p = &c->plan;
    const int64_t H = c->layer.hidden, tokens = (int64_t)c->world * p->max_tokens;
    const void *sums = NULL;
    MOK(buffer_reserve(c, &c->partial, (size_t)(tokens * H) * sizeof(float)));
    MOK(moert_ag_cuda_partial_rows(c->host, (cudaStream_t)stream, dtype, tokens, p->topk, H, c->cu.copy_row.data,
                                   grouped, c->partial.data));
    MOK(reduce_scatter_exchange(c, stream, (size_t)H * sizeof(float), &sums));
    return moert_ag_cuda_sum_partials(c->host, (cudaStream_t)stream, dtype, c->world, p->num_tokens, H, p->topk, sums,
                                      own_idx(c), 0, accumulate, out);
}

/* dispatch() on CUDA: rows, then probs (a second allgather), each gathered into grouped order. */
static moert_result cuda_dispatch(allgather_ctx *c, moert_stream stream, const moert_dispatch_args *args)
{
    const char *call = "dispatch()";
    const int64_t H = c->layer.hidden;
    MOK(cuda_check_dtypes(c, call, "x", args->x, "recv_x", args->recv_x));
    if (args->topk_probs)
        MOK(cuda_check_dtypes(c, call, "topk_probs", args->topk_probs, "recv_probs", args->recv_probs));
    const moert_dtype dtype = args->x->dtype;
    MOK(cuda_forward_rows(c, stream, dtype, H, H, (int32_t)c->layer.topk, args->x->data, &c->rows_send,
                          &c->gathered_rows, args->recv_x->data));
    size_t prob_bytes = 0;
    if (args->topk_probs) {
        const moert_dtype pd = args->topk_probs->dtype;
        MOK(cuda_forward_rows(c, stream, pd, c->layer.topk, 1, 1, args->topk_probs->data, &c->probs_send,
                              &c->gathered_probs, args->recv_probs->data));
        prob_bytes = moert_dtype_size(pd);
    }
    report_metric(c, "dispatch.bytes_sent", dispatch_bytes_sent(c, (size_t)H * moert_dtype_size(dtype), prob_bytes),
                  "bytes");
    return MOERT_OK;
}
#endif

/* Gathers every rank's tokens, routing weights included, and keeps the copies of this rank's experts, grouped by
 * local expert. */
static moert_result allgather_dispatch(void *ctx, moert_stream stream, const moert_dispatch_args *args)
{
    allgather_ctx *c = ctx;
    const ag_plan *p = &c->plan;
    const int64_t H = c->layer.hidden, T = p->num_tokens, K = c->layer.topk;
    const moert_dispatch_step_shape shape = step_shape(c);
    moert_result rc = moert_dispatch_check_dispatch(c->host, &shape, args);
    if (rc != MOERT_OK) return rc;
#ifdef MOERT_HAVE_CUDA
    if (c->on_cuda) return cuda_dispatch(c, stream, args);
#endif

    const size_t row_bytes = (size_t)H * moert_dtype_size(args->x->dtype);
    rc = gather_token_rows(c, stream, args->x->data, row_bytes, &c->rows_send, &c->gathered_rows);
    if (rc != MOERT_OK) return rc;
    ag_gather_rows(p, c->gathered_rows.data, row_bytes, args->recv_x->data);
    size_t prob_bytes = 0;
    if (args->topk_probs) { /* probs travel as double on the CPU, as in the alltoall dispatcher */
        rc = buffer_reserve(c, &c->probs_send, (size_t)(p->max_tokens * K) * sizeof(double));
        if (rc == MOERT_OK) rc = buffer_reserve(c, &c->gathered_probs, (size_t)gathered_copies(c) * sizeof(double));
        if (rc != MOERT_OK) return rc;
        double *send = c->probs_send.data;
        for (int64_t i = 0; i < T * K; i++) send[i] = moert_load(args->topk_probs, i);
        rc = gather_blocks(c, stream, send, c->gathered_probs.data, (size_t)(p->max_tokens * K) * sizeof(double));
        if (rc != MOERT_OK) return rc;
        ag_gather_probs(p, c->gathered_probs.data, args->recv_probs->data, args->recv_probs->dtype);
        prob_bytes = sizeof(double);
    }
    report_metric(c, "dispatch.bytes_sent", dispatch_bytes_sent(c, row_bytes, prob_bytes), "bytes");
    return MOERT_OK;
}

#ifdef MOERT_HAVE_CUDA
/* combine() on CUDA: the partial sums of every gathered token, reduce-scattered to the owners (overwrite). */
static moert_result cuda_combine(allgather_ctx *c, moert_stream stream, const moert_combine_args *args)
{
    MOK(cuda_check_dtypes(c, "combine()", "y_expert", args->y_expert, "y", args->y));
    return cuda_backward_rows(c, stream, args->y_expert->dtype, args->y_expert->data, 0, args->y->data);
}

/* combine_backward() on CUDA: a dispatch of d_y's rows without probs. */
static moert_result cuda_combine_backward(allgather_ctx *c, moert_stream stream,
                                          const moert_combine_backward_args *args)
{
    const int64_t H = c->layer.hidden;
    MOK(cuda_check_dtypes(c, "combine_backward()", "d_y", args->d_y, "d_y_expert", args->d_y_expert));
    return cuda_forward_rows(c, stream, args->d_y->dtype, H, H, (int32_t)c->layer.topk, args->d_y->data, &c->rows_send,
                             &c->gathered_rows, args->d_y_expert->data);
}

/* dispatch_backward() on CUDA: row gradients reduce-scattered into d_x (+=); prob gradients the same way, one value
 * per gathered copy (only the rank of its expert has a nonzero one), into d_topk_probs. */
static moert_result cuda_dispatch_backward(allgather_ctx *c, moert_stream stream,
                                           const moert_dispatch_backward_args *args)
{
    const char *call = "dispatch_backward()";
    const ag_plan *p = &c->plan;
    const int64_t K = p->topk;
    MOK(cuda_check_dtypes(c, call, "d_recv_x", args->d_recv_x, "d_x", args->d_x));
    if (args->d_recv_probs)
        MOK(cuda_check_dtypes(c, call, "d_recv_probs", args->d_recv_probs, "d_topk_probs", args->d_topk_probs));
    MOK(cuda_backward_rows(c, stream, args->d_recv_x->dtype, args->d_recv_x->data, 1, args->d_x->data));
    if (!args->d_recv_probs) return MOERT_OK;
    const moert_dtype pd = args->d_recv_probs->dtype;
    const void *sums = NULL;
    MOK(buffer_reserve(c, &c->partial, (size_t)gathered_copies(c) * sizeof(float)));
    MOK(moert_ag_cuda_partial_probs(c->host, (cudaStream_t)stream, pd, gathered_copies(c), c->cu.copy_row.data,
                                    args->d_recv_probs->data, c->partial.data));
    MOK(reduce_scatter_exchange(c, stream, (size_t)K * sizeof(float), &sums));
    return moert_ag_cuda_sum_partials(c->host, (cudaStream_t)stream, pd, c->world, p->num_tokens, K, K, sums,
                                      own_idx(c), 1, 0, args->d_topk_probs->data);
}
#endif

/* Grouped rows [num_recv, H] back to their tokens on the CPU: partial sums in double of every gathered token,
 * reduce-scattered to the owners, summed into out [T, H] (= or +=). */
static moert_result cpu_backward_rows(allgather_ctx *c, moert_stream stream, const moert_tensor *grouped,
                                      int accumulate, moert_tensor *out)
{
    const ag_plan *p = &c->plan;
    const int64_t H = c->layer.hidden, tokens = (int64_t)c->world * p->max_tokens;
    const void *sums = NULL;
    moert_result rc = buffer_reserve(c, &c->partial, (size_t)(tokens * H) * sizeof(double));
    if (rc != MOERT_OK) return rc;
    ag_partial_rows(p, grouped->data, grouped->dtype, H, c->partial.data);
    rc = reduce_scatter_exchange(c, stream, (size_t)H * sizeof(double), &sums);
    if (rc != MOERT_OK) return rc;
    ag_sum_partial_rows(p, sums, H, own_idx(c), accumulate, out->data, out->dtype);
    return MOERT_OK;
}

/* Brings the expert output rows back to their tokens' ranks as a reduce-scatter: each token's copies summed. */
static moert_result allgather_combine(void *ctx, moert_stream stream, const moert_combine_args *args)
{
    allgather_ctx *c = ctx;
    const moert_dispatch_step_shape shape = step_shape(c);
    moert_result rc = moert_dispatch_check_combine(c->host, &shape, args);
    if (rc != MOERT_OK) return rc;
#ifdef MOERT_HAVE_CUDA
    if (c->on_cuda) return cuda_combine(c, stream, args);
#endif
    return cpu_backward_rows(c, stream, args->y_expert, 0, args->y);
}

/* The adjoint of combine: every grouped row gets its token's gradient (a dispatch of d_y without probs). */
static moert_result allgather_combine_backward(void *ctx, moert_stream stream, const moert_combine_backward_args *args)
{
    allgather_ctx *c = ctx;
    const ag_plan *p = &c->plan;
    const int64_t H = c->layer.hidden;
    const moert_dispatch_step_shape shape = step_shape(c);
    moert_result rc = moert_dispatch_check_combine_backward(c->host, &shape, args);
    if (rc != MOERT_OK) return rc;
#ifdef MOERT_HAVE_CUDA
    if (c->on_cuda) return cuda_combine_backward(c, stream, args);
#endif
    const size_t row_bytes = (size_t)H * moert_dtype_size(args->d_y->dtype);
    rc = gather_token_rows(c, stream, args->d_y->data, row_bytes, &c->rows_send, &c->gathered_rows);
    if (rc != MOERT_OK) return rc;
    ag_gather_rows(p, c->gathered_rows.data, row_bytes, args->d_y_expert->data);
    return MOERT_OK;
}

/* The adjoint of dispatch: row gradients summed into their tokens (+=), weight gradients to their (t, k) slots,
 * both as reduce-scatters of this rank's share. */
static moert_result allgather_dispatch_backward(void *ctx, moert_stream stream,
                                                const moert_dispatch_backward_args *args)
{
    allgather_ctx *c = ctx;
    const ag_plan *p = &c->plan;
    const int64_t K = c->layer.topk;
    const moert_dispatch_step_shape shape = step_shape(c);
    moert_result rc = moert_dispatch_check_dispatch_backward(c->host, &shape, args);
    if (rc != MOERT_OK) return rc;
#ifdef MOERT_HAVE_CUDA
    if (c->on_cuda) return cuda_dispatch_backward(c, stream, args);
#endif
    rc = cpu_backward_rows(c, stream, args->d_recv_x, 1, args->d_x);
    if (rc != MOERT_OK || !args->d_recv_probs) return rc;
    const void *sums = NULL;
    rc = buffer_reserve(c, &c->partial, (size_t)gathered_copies(c) * sizeof(double));
    if (rc != MOERT_OK) return rc;
    ag_partial_probs(p, args->d_recv_probs->data, args->d_recv_probs->dtype, c->partial.data);
    rc = reduce_scatter_exchange(c, stream, (size_t)K * sizeof(double), &sums);
    if (rc != MOERT_OK) return rc;
    ag_sum_partial_probs(p, sums, own_idx(c), args->d_topk_probs->data, args->d_topk_probs->dtype);
    return MOERT_OK;
}

/* The one exported symbol. Its name equals the vtable's typedef name, which C does not allow for an object in the
 * same scope, so the object gets a private C name and its linker name through an asm label. */
MOERT_DISPATCHER_V1_EXPORT(allgather_vtable) = {
    .header =
        {
            MOERT_DISPATCHER_V1_HEADER,
            .name = "allgather",
            .version = "0.1.0",
            .description = "Megatron-style allgather token dispatcher (allgather of tokens, routing and probs, local "
                           "permutation, reduce-scatter combine)",
            .devices = MOERT_DISPATCH_DEVICES,
            .dtypes = MOERT_DISPATCH_DTYPES,
            .flags = MOERT_CAP_NEEDS_HOST_SYNC | MOERT_CAP_GATHERS_TOKENS,
        },
    .init = allgather_init,
    .finalize = allgather_finalize,
    .prepare = allgather_prepare,
    .dispatch = allgather_dispatch,
    .combine = allgather_combine,
    .combine_backward = allgather_combine_backward,
    .dispatch_backward = allgather_dispatch_backward,
};
