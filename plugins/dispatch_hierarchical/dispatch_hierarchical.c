/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The "hierarchical" dispatcher plugin: a token crosses between nodes once per destination node, to the rank with its
 * own local index there, which fans it out inside its node to the ranks owning its experts; combine reduces inside
 * the node first and sends one row per token and node back (the idea of DeepEP's internode kernels, over moert's host
 * collectives). Ranks form nodes of `ranks_per_node`; a "node" is a group of ranks, so one host can simulate several.
 *
 * This file: vtable, options, checks, buffers and communication (two alltoallv phases over the world, zero sizes to
 * the ranks that are not peers of the phase), and the CUDA path's sequence (the row kernels of
 * plugins/lib/dispatch_alltoall_cuda.cu driven by index maps planned on the host). The CPU algorithm over plain arrays
 * is in hier_plan.c; the argument checks, buffers, count exchange and alltoallv the host-collective dispatchers share
 * are plugins/lib/dispatch_common.c's.
 */
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dispatch_common.h"
#include "hier_plan.h"
#include "moert/dispatcher.h"
#include "plugin_report.h"
#include "tensor_args.h"
#ifdef MOERT_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "plugin_cuda_check.h"

#include "../lib/dispatch_alltoall_cuda.h"
#endif

/* A buffer, grown on demand and reused across steps: on the layer's device (rows) or in host memory (plans). */
typedef moert_dispatch_buffer hier_buffer;

/* The two phases of every call: between nodes (peers: the rank with this local index in each node), and inside this
 * node (peers: its ranks). */
typedef enum hier_phase { PHASE_NODES, PHASE_LOCAL } hier_phase;

#ifdef MOERT_HAVE_CUDA
/* The index maps the CUDA path's kernels take, int32 each, as offsets into one device buffer (cuda_plan). */
enum {
    MAP_NODE_ROW_TOKEN,     /* [num_node_send] token of each phase-1 row */
    MAP_COPY_OF_NODE_SLOT,  /* [num_node_send_copies] copy t*K+k of each phase-1 prob slot */
    MAP_LOCAL_ROW_FWD,      /* [num_local_send] received token (phase-1 row) of each phase-2 row */
    MAP_LOCAL_ROW_FWD_SLOT, /* [num_local_send] received prob slot of each phase-2 row */
    MAP_FWD_SLOT_LOCAL_ROW, /* [num_node_recv_copies] phase-2 row of each received prob slot */
    MAP_GROUPED_SRC,        /* [capacity] phase-2 received row of each grouped row */
    MAP_STAGING_SRC,        /* [num_recv] grouped row of each phase-2 received row */
    MAP_FWD_COPY_ROW,       /* [num_node_recv*K] phase-2 row of each received copy, -1 */
    MAP_TOKEN_NODE_ROW,     /* [T*N] phase-1 row of token t for node m, -1 */
    MAP_COPY_NODE_SLOT,     /* [T*K] phase-1 prob slot of each copy, -1 */
    MAP_COUNT
};

typedef struct hier_cuda_state {
    hier_buffer maps;              /* device int32: every map, MAP_COUNT of them */
    hier_buffer tokens_per_expert; /* device int64 [El] */
    size_t map_at[MAP_COUNT];      /* offset (in int32) of each map */
    int32_t *pinned_maps;          /* pinned host, grown: the maps before their upload */
    size_t pinned_maps_bytes;
    int32_t *pinned_idx; /* pinned host, grown: topk_idx copied down */
    size_t pinned_idx_bytes;
    int64_t *pinned_counts; /* pinned host [El]: tokens_per_expert before its upload */
} hier_cuda_state;
#endif

typedef struct hier_ctx {
    const moert_host *host;
    moert_layer_info layer;
    int world, rank;
    int64_t ranks_per_node;

    bool prepared;                 /* prepare() succeeded since init */
    hier_plan plan;                /* this step's routing; its per-step arrays point into the host buffers below */
    int64_t row_len;               /* E + N + 2: the exchanged counts of one rank */
    int64_t *exchange_row;         /* [row_len] copies per expert, tokens per node, T, a failure flag */
    int64_t *gathered;             /* [world][row_len] */
    int64_t *all_counts;           /* [world][E] */
    int64_t *all_node_tokens;      /* [world][N] */
    moert_dispatch_alltoallv a2av; /* [world] sizes and offsets for alltoallv */

    /* host memory: the plan's per-step arrays and the routing that crosses in prepare() */
    hier_buffer token_node_row, node_row_token, copy_node_slot, fwd_idx, fwd_copy_row, recv_final_row;
    hier_buffer routing_send; /* int32 [num_node_send][K] */

    /* the layer's device: rows and probs at each stage */
    hier_buffer node_rows;    /* [num_node_send] phase-1 rows at the token's rank */
    hier_buffer fwd_rows;     /* [num_node_recv] phase-1 rows at the forwarder (partials on the way back) */
    hier_buffer local_rows;   /* [num_local_send] phase-2 rows at the forwarder */
    hier_buffer staging_rows; /* [num_recv] phase-2 rows at the expert's rank */
    hier_buffer node_probs, fwd_probs, local_probs, staging_probs; /* the same for the probs */
    hier_buffer acc;                                               /* double [H] scratch of the CPU reductions */

    bool on_cuda; /* the layer is on a CUDA device: the CUDA path serves it */
#ifdef MOERT_HAVE_CUDA
    hier_cuda_state cu;
#endif
} hier_ctx;

/* Sets the instance's error message and returns code, so checks can `return fail(...)`. */
#define fail(c, ...) report((c)->host, __VA_ARGS__)

/* Reports a figure for this step's report, if the host is new enough to take it. */
static void report_metric(const hier_ctx *c, const char *name, double value, const char *unit)
{
    moert_dispatch_metric(c->host, name, value, unit);
}

/* Makes buf at least `bytes` long on the layer's device (contents not kept). */
static moert_result buffer_reserve(hier_ctx *c, hier_buffer *buf, size_t bytes)
{
    return moert_dispatch_buffer_reserve(c->host, c->layer.device, buf, bytes);
}

static void buffer_release(hier_ctx *c, hier_buffer *buf)
{
    moert_dispatch_buffer_release(c->host, c->layer.device, buf);
}

/* Makes a host-memory buffer at least `bytes` long (contents not kept). */
static moert_result host_reserve(hier_ctx *c, hier_buffer *buf, size_t bytes)
{
    if (bytes < 64) bytes = 64;
    if (buf->bytes >= bytes) return MOERT_OK;
    free(buf->data);
    size_t grown = bytes + bytes / 2;
    buf->data = malloc(grown);
    buf->bytes = buf->data ? grown : 0;
    if (!buf->data)
        return fail(c, MOERT_ERR_OUT_OF_MEMORY, "out of host memory for the dispatch plan (%zu bytes)", grown);
    return MOERT_OK;
}

static void host_release(hier_buffer *buf)
{
    free(buf->data);
    buf->data = NULL;
    buf->bytes = 0;
}

/* What the checks of the calls after prepare() know of this step (plugins/lib/dispatch_common.h). */
static moert_dispatch_step_shape step_shape(const hier_ctx *c)
{
    return (moert_dispatch_step_shape){.prepared = c->prepared,
                                       .device = c->layer.device,
                                       .tokens = c->plan.num_tokens,
                                       .topk = c->layer.topk,
                                       .hidden = c->layer.hidden,
                                       .capacity = c->plan.capacity};
}

/*
 * One phase's exchange: send_rows[i] rows of row_bytes from `send` (packed in peer order) to peer i, recv_rows[i]
 * rows from peer i into `recv` (packed in peer order). An alltoallv over the world with zero sizes to the ranks that
 * are not peers; a phase whose only peer is this rank (one node, or one rank per node) is a copy, no collective
 * (every rank has the same ranks_per_node, so all skip it alike).
 */
static moert_result exchange(hier_ctx *c, moert_stream stream, moert_device dev, hier_phase phase, const void *send,
                             const int64_t *send_rows, void *recv, const int64_t *recv_rows, size_t row_bytes)
{
    const hier_plan *p = &c->plan;
    const int R = p->ranks_per_node;
    /* peer i: the rank with this local index in node i, or rank i of this node */
    if (phase == PHASE_NODES)
        return moert_dispatch_exchange_rows(c->host, dev, stream, &c->a2av, c->world, p->num_nodes, p->local, R, send,
                                            send_rows, recv, recv_rows, row_bytes);
    return moert_dispatch_exchange_rows(c->host, dev, stream, &c->a2av, c->world, R, p->node * R, 1, send, send_rows,
                                        recv, recv_rows, row_bytes);
}

/* Bytes of `rows[i] * row_bytes` to the peers of a phase other than this rank (inside the node: the other ranks of
 * this node; between nodes: the other nodes). */
static double phase_bytes(const hier_ctx *c, hier_phase phase, const int64_t *rows, double row_bytes)
{
    const hier_plan *p = &c->plan;
    const int peers = phase == PHASE_NODES ? p->num_nodes : p->ranks_per_node;
    const int self = phase == PHASE_NODES ? p->node : p->local;
    return moert_dispatch_bytes_to_peers(rows, peers, self, row_bytes);
}

/* The figures of a dispatch-like call: rows (and probs of prob_bytes each, 0 without) between nodes and inside. */
static void report_dispatch_bytes(const hier_ctx *c, double row_bytes, double prob_bytes)
{
    const hier_plan *p = &c->plan;
    double inter = phase_bytes(c, PHASE_NODES, p->node_send_tokens, row_bytes) +
                   phase_bytes(c, PHASE_NODES, p->node_send_copies, prob_bytes);
    double intra = phase_bytes(c, PHASE_LOCAL, p->local_send_rows, row_bytes + prob_bytes);
    report_metric(c, "dispatch.bytes_internode", inter, "bytes");
    report_metric(c, "dispatch.bytes_intranode", intra, "bytes");
    report_metric(c, "dispatch.bytes_sent", inter + intra, "bytes");
}

/* The figures of combine: one partial row per token and node back between nodes, one row per copy inside. */
static void report_combine_bytes(const hier_ctx *c, double row_bytes)
{
    const hier_plan *p = &c->plan;
    report_metric(c, "combine.bytes_internode", phase_bytes(c, PHASE_NODES, p->node_recv_tokens, row_bytes), "bytes");
    report_metric(c, "combine.bytes_intranode", phase_bytes(c, PHASE_LOCAL, p->local_recv_rows, row_bytes), "bytes");
}

static void hier_finalize(void *ctx);

#ifdef MOERT_HAVE_CUDA
/* The CUDA path's fixed state: the layer's device answers, the host can allocate on it; pinned counts. */
static moert_result cuda_init(hier_ctx *c)
{
    const moert_host *h = c->host;
    char dev[32];
    moert_arg_device_text(c->layer.device, dev, sizeof dev);
    MOK(check_cuda_device_visible(h, (int)c->layer.device.id, dev));
    moert_result rc = moert_dispatch_buffer_reserve_first(h, c->layer.device, &c->cu.tokens_per_expert,
                                                          (size_t)c->layer.num_local_experts * sizeof(int64_t));
    if (rc == MOERT_OK)
        rc = h->alloc_pinned(h, (size_t)c->layer.num_local_experts * sizeof(int64_t), (void **)&c->cu.pinned_counts);
    return rc;
}

static void cuda_finalize(hier_ctx *c)
{
    const moert_host *h = c->host;
    buffer_release(c, &c->cu.maps);
    buffer_release(c, &c->cu.tokens_per_expert);
    if (c->cu.pinned_maps) h->free_pinned(h, c->cu.pinned_maps);
    if (c->cu.pinned_idx) h->free_pinned(h, c->cu.pinned_idx);
    if (c->cu.pinned_counts) h->free_pinned(h, c->cu.pinned_counts);
    memset(&c->cu, 0, sizeof c->cu);
}
#endif

/* Checks ranks_per_node against the world: nodes of equal size. */
static moert_result check_ranks_per_node(const moert_host *host, int64_t ranks_per_node, int world)
{
    if (world % ranks_per_node == 0) return MOERT_OK;
    char divisors[256] = "";
    size_t at = 0;
    for (int d = 1; d <= world && at < sizeof divisors - 16; d++)
        if (world % d == 0) at += (size_t)snprintf(divisors + at, sizeof divisors - at, "%s%d", at ? ", " : "", d);
    host->set_error(
        host,
        "config error at $.dispatcher.ranks_per_node: %lld does not divide the expert-parallel world of %d ranks "
        "(every node has the same number of ranks); expected one of %s",
        (long long)ranks_per_node, world, divisors);
    return MOERT_ERR_CONFIG;
}

/* Creates one instance: reads ranks_per_node, checks the layer, allocates the fixed-size arrays. */
static moert_result hier_init(void **out, const moert_host *host, const moert_layer_info *layer)
{
    *out = NULL;
    moert_result rc = moert_arg_check_dispatch_layer(host, layer, "hierarchical", 0);
    if (rc != MOERT_OK) return rc;
    int64_t ranks_per_node = host->world_size;
    rc = host->option_int(host, "ranks_per_node", host->world_size, 1, 1 << 20,
                          "ranks of one node (default: the whole world, one node): a token crosses between nodes once "
                          "per node holding one of its experts, to the rank with its own local index there; must "
                          "divide the world",
                          &ranks_per_node);
    if (rc == MOERT_OK) rc = check_ranks_per_node(host, ranks_per_node, host->world_size);
    if (rc != MOERT_OK) return rc;

    hier_ctx *c = calloc(1, sizeof *c);
    if (!c) {
        host->set_error(host, "out of memory for the dispatcher state");
        return MOERT_ERR_OUT_OF_MEMORY;
    }
    c->host = host;
    moert_layer_info_copy(&c->layer, layer);
    c->world = host->world_size;
    c->rank = host->rank;
    c->ranks_per_node = ranks_per_node;
    const int R = (int)ranks_per_node, N = c->world / R, W = c->world;
    const int64_t E = layer->num_experts, El = layer->num_local_experts;
    c->row_len = E + N + 2;
    c->exchange_row = calloc((size_t)c->row_len, sizeof(int64_t));
    c->gathered = calloc((size_t)(W * c->row_len), sizeof(int64_t));
    c->all_counts = calloc((size_t)(W * E), sizeof(int64_t));
    c->all_node_tokens = calloc((size_t)(W * N), sizeof(int64_t));
    bool a2av_ok = moert_dispatch_alltoallv_alloc(&c->a2av, W);
    hier_plan *p = &c->plan;
    p->node_send_tokens = calloc((size_t)N, sizeof(int64_t));
    p->node_recv_tokens = calloc((size_t)N, sizeof(int64_t));
    p->node_send_copies = calloc((size_t)N, sizeof(int64_t));
    p->node_recv_copies = calloc((size_t)N, sizeof(int64_t));
    p->local_send_rows = calloc((size_t)R, sizeof(int64_t));
    p->local_recv_rows = calloc((size_t)R, sizeof(int64_t));
    p->tokens_per_expert = calloc((size_t)El, sizeof(int64_t));
    p->group_start = calloc((size_t)El, sizeof(int64_t));
    p->cursor = calloc((size_t)(E + 2 * N), sizeof(int64_t));
    if (!c->exchange_row || !c->gathered || !c->all_counts || !c->all_node_tokens || !a2av_ok || !p->node_send_tokens ||
        !p->node_recv_tokens || !p->node_send_copies || !p->node_recv_copies || !p->local_send_rows ||
        !p->local_recv_rows || !p->tokens_per_expert || !p->group_start || !p->cursor) {
        hier_finalize(c);
        host->set_error(host, "out of memory for the dispatcher state");
        return MOERT_ERR_OUT_OF_MEMORY;
    }
    p->world = W;
    p->rank = c->rank;
    p->ranks_per_node = R;
    p->num_nodes = N;
    p->node = c->rank / R;
    p->local = c->rank % R;
    p->num_experts = E;
    p->num_local_experts = El;
    p->topk = layer->topk;
    c->on_cuda = layer->device.type == MOERT_DEVICE_CUDA;
#ifdef MOERT_HAVE_CUDA
    if (c->on_cuda) {
        rc = cuda_init(c);
        if (rc != MOERT_OK) {
            hier_finalize(c);
            return rc;
        }
    }
#endif
    host->log(host, MOERT_LOG_DEBUG, "%d nodes of %d ranks: this rank is node %d, local index %d", N, R, p->node,
              p->local);
    *out = c;
    return MOERT_OK;
}

/* Frees everything the instance owns. */
static void hier_finalize(void *ctx)
{
    hier_ctx *c = ctx;
    if (!c) return;
    hier_buffer *device_buffers[] = {&c->node_rows,    &c->fwd_rows,      &c->local_rows,
                                     &c->staging_rows, &c->node_probs,    &c->fwd_probs,
                                     &c->local_probs,  &c->staging_probs, &c->acc};
    for (size_t i = 0; i < sizeof device_buffers / sizeof device_buffers[0]; i++) buffer_release(c, device_buffers[i]);
    hier_buffer *host_buffers[] = {&c->token_node_row, &c->node_row_token, &c->copy_node_slot, &c->fwd_idx,
                                   &c->fwd_copy_row,   &c->recv_final_row, &c->routing_send};
    for (size_t i = 0; i < sizeof host_buffers / sizeof host_buffers[0]; i++) host_release(host_buffers[i]);
#ifdef MOERT_HAVE_CUDA
    cuda_finalize(c);
#endif
    hier_plan *p = &c->plan;
    free(c->exchange_row);
    free(c->gathered);
    free(c->all_counts);
    free(c->all_node_tokens);
    moert_dispatch_alltoallv_free(&c->a2av);
    free(p->node_send_tokens);
    free(p->node_recv_tokens);
    free(p->node_send_copies);
    free(p->node_recv_copies);
    free(p->local_send_rows);
    free(p->local_recv_rows);
    free(p->tokens_per_expert);
    free(p->group_start);
    free(p->cursor);
    free(c);
}

/* ---- prepare ---- */

/*
 * prepare()'s local part: checks topk_idx (int32 [T,K] on the layer's device), brings it to the host on CUDA (the
 * step's one host sync) and counts this rank's copies per expert and tokens per node into exchange_row. *idx_host
 * is the routing on the host.
 */
static moert_result count_local(hier_ctx *c, moert_stream stream, const moert_tensor *topk_idx, int64_t *num_tokens,
                                const int32_t **idx_host)
{
    const int64_t K = c->layer.topk, E = c->layer.num_experts;
    int64_t T = 0;
    moert_result rc = moert_dispatch_check_topk_idx(c->host, c->layer.device, topk_idx, K, &T);
    if (rc != MOERT_OK) return rc;
    *idx_host = topk_idx->data;
#ifdef MOERT_HAVE_CUDA
    if (c->on_cuda) {
        const char *call = "prepare()";
        const moert_host *h = c->host;
        if (T * K > INT32_MAX || T * c->plan.num_nodes > INT32_MAX)
            return fail(c, MOERT_ERR_UNSUPPORTED, "%s: %lld token copies (T*K), the CUDA path takes at most %d", call,
                        (long long)(T * K), INT32_MAX);
        size_t bytes = (size_t)(T * K) * sizeof(int32_t);
        rc = moert_dispatch_pinned_reserve(h, (void **)&c->cu.pinned_idx, &c->cu.pinned_idx_bytes, bytes);
        if (rc != MOERT_OK) return rc;
        if (bytes)
            rc = h->memcpy_async(h, c->cu.pinned_idx, moert_cpu(), topk_idx->data, c->layer.device, bytes, stream);
        if (rc == MOERT_OK) rc = h->stream_synchronize(h, stream);
        if (rc != MOERT_OK) return rc;
        *idx_host = c->cu.pinned_idx;
    }
#endif
    int64_t bad = hier_count(&c->plan, *idx_host, T, c->exchange_row, c->exchange_row + E);
    if (bad >= 0) return moert_dispatch_bad_expert(c->host, *idx_host, bad, K, E);
    *num_tokens = T;
    return MOERT_OK;
}

/* The plan's per-step host arrays for T tokens (before the count exchange: a failure here is reported to the peers
 * through the exchange, as a bad topk_idx is). */
static moert_result reserve_token_arrays(hier_ctx *c, int64_t T)
{
    const int64_t K = c->layer.topk, N = c->plan.num_nodes;
    moert_result rc = host_reserve(c, &c->token_node_row, (size_t)(T * N) * sizeof(int64_t));
    if (rc == MOERT_OK) rc = host_reserve(c, &c->node_row_token, (size_t)(T * N) * sizeof(int64_t));
    if (rc == MOERT_OK) rc = host_reserve(c, &c->copy_node_slot, (size_t)(T * K) * sizeof(int64_t));
    if (rc == MOERT_OK) rc = host_reserve(c, &c->routing_send, (size_t)(T * N * K) * sizeof(int32_t));
    if (rc != MOERT_OK) return rc;
    c->plan.token_node_row = c->token_node_row.data;
    c->plan.node_row_token = c->node_row_token.data;
    c->plan.copy_node_slot = c->copy_node_slot.data;
    return MOERT_OK;
}

#ifdef MOERT_HAVE_CUDA
/*
 * prepare()'s CUDA part, after the plan: the index maps the row kernels take (MAP_*), built on the host from the
 * plan and uploaded through pinned memory with tokens_per_expert (no wait: the next prepare's sync orders the
 * pinned buffers' reuse).
 */
static moert_result cuda_plan(hier_ctx *c, moert_stream stream)
{
    const moert_host *h = c->host;
    const hier_plan *p = &c->plan;
    const int64_t K = p->topk, N = p->num_nodes, T = p->num_tokens, El = p->num_local_experts;
    const int64_t sizes[MAP_COUNT] = {[MAP_NODE_ROW_TOKEN] = p->num_node_send,
                                      [MAP_COPY_OF_NODE_SLOT] = p->num_node_send_copies,
                                      [MAP_LOCAL_ROW_FWD] = p->num_local_send,
                                      [MAP_LOCAL_ROW_FWD_SLOT] = p->num_local_send,
                                      [MAP_FWD_SLOT_LOCAL_ROW] = p->num_node_recv_copies,
                                      [MAP_GROUPED_SRC] = p->capacity,
                                      [MAP_STAGING_SRC] = p->num_recv,
                                      [MAP_FWD_COPY_ROW] = p->num_node_recv * K,
                                      [MAP_TOKEN_NODE_ROW] = T * N,
                                      [MAP_COPY_NODE_SLOT] = T * K};
    size_t total = 0;
    for (int i = 0; i < MAP_COUNT; i++) {
        if (sizes[i] > INT32_MAX)
            return fail(c, MOERT_ERR_UNSUPPORTED, "prepare(): a map of %lld rows, the CUDA path takes at most %d",
                        (long long)sizes[i], INT32_MAX);
        c->cu.map_at[i] = total;
        total += (size_t)sizes[i];
    }
    const size_t bytes = (total ? total : 1) * sizeof(int32_t);
    MOK(moert_dispatch_pinned_reserve(h, (void **)&c->cu.pinned_maps, &c->cu.pinned_maps_bytes, bytes));
    int32_t *m[MAP_COUNT];
    for (int i = 0; i < MAP_COUNT; i++) m[i] = c->cu.pinned_maps + c->cu.map_at[i];
    for (int64_t r = 0; r < p->num_node_send; r++) m[MAP_NODE_ROW_TOKEN][r] = (int32_t)p->node_row_token[r];
    for (int64_t i = 0; i < T * K; i++) {
        m[MAP_COPY_NODE_SLOT][i] = (int32_t)p->copy_node_slot[i];
        if (p->copy_node_slot[i] >= 0) m[MAP_COPY_OF_NODE_SLOT][p->copy_node_slot[i]] = (int32_t)i;
    }
    int64_t slot = 0;
    for (int64_t cp = 0; cp < p->num_node_recv * K; cp++) {
        const int64_t r = p->fwd_copy_row[cp];
        m[MAP_FWD_COPY_ROW][cp] = (int32_t)r;
        if (r < 0) continue;
        m[MAP_LOCAL_ROW_FWD][r] = (int32_t)(cp / K);
        m[MAP_LOCAL_ROW_FWD_SLOT][r] = (int32_t)slot;
        m[MAP_FWD_SLOT_LOCAL_ROW][slot] = (int32_t)r;
        slot++;
    }
    for (int64_t i = 0; i < p->num_recv; i++) {
        m[MAP_STAGING_SRC][i] = (int32_t)p->recv_final_row[i];
        m[MAP_GROUPED_SRC][p->recv_final_row[i]] = (int32_t)i;
    }
    for (int64_t i = 0; i < T * N; i++) m[MAP_TOKEN_NODE_ROW][i] = (int32_t)p->token_node_row[i];
    for (int64_t l = 0; l < El; l++) c->cu.pinned_counts[l] = p->tokens_per_expert[l];

    moert_result rc = buffer_reserve(c, &c->cu.maps, bytes);
    if (rc == MOERT_OK && total)
        rc = h->memcpy_async(h, c->cu.maps.data, c->layer.device, c->cu.pinned_maps, moert_cpu(),
                             total * sizeof(int32_t), stream);
    if (rc == MOERT_OK)
        rc = h->memcpy_async(h, c->cu.tokens_per_expert.data, c->layer.device, c->cu.pinned_counts, moert_cpu(),
                             (size_t)El * sizeof(int64_t), stream);
    return rc;
}

/* The device copy of map i. */
static const int32_t *cuda_map(const hier_ctx *c, int i) { return (const int32_t *)c->cu.maps.data + c->cu.map_at[i]; }
#endif

/*
 * Counts copies per expert and tokens per node, allgathers them (every rank takes part even when its own input was
 * bad, so all ranks fail together), plans both phases, and sends each token's routing once to every node holding
 * one of its copies (host memory: every forwarder plans its fan-out on the host).
 */
static moert_result hier_prepare(void *ctx, moert_stream stream, const moert_tensor *topk_idx,
                                 moert_dispatch_layout *layout)
{
    hier_ctx *c = ctx;
    const moert_host *h = c->host;
    hier_plan *p = &c->plan;
    const int64_t E = c->layer.num_experts, El = c->layer.num_local_experts, K = c->layer.topk, N = p->num_nodes;
    c->prepared = false;

    int64_t num_tokens = 0;
    const int32_t *idx_host = NULL;
    memset(c->exchange_row, 0, (size_t)c->row_len * sizeof(int64_t));
    moert_result local_rc = moert_dispatch_check_layout(h, layout);
    if (local_rc == MOERT_OK) local_rc = count_local(c, stream, topk_idx, &num_tokens, &idx_host);
    if (local_rc == MOERT_OK) local_rc = reserve_token_arrays(c, num_tokens);
    if (local_rc != MOERT_OK) memset(c->exchange_row, 0, (size_t)(E + N) * sizeof(int64_t));
    c->exchange_row[E + N] = num_tokens;
    c->exchange_row[E + N + 1] = local_rc;

    moert_result rc = moert_dispatch_exchange_counts(h, c->world, c->exchange_row, c->gathered, c->row_len, local_rc);
    if (rc != MOERT_OK) return rc;
    for (int s = 0; s < c->world; s++) {
        const int64_t *row = c->gathered + (int64_t)s * c->row_len;
        memcpy(c->all_counts + (int64_t)s * E, row, (size_t)E * sizeof(int64_t));
        memcpy(c->all_node_tokens + (int64_t)s * N, row + E, (size_t)N * sizeof(int64_t));
    }

    p->num_tokens = num_tokens;
    hier_plan_sizes(p, c->all_counts, c->all_node_tokens);
    hier_plan_send(p, idx_host);
    hier_pack_routing(p, idx_host, c->routing_send.data);
    /* sized from the gathered counts, alike on every rank: all reach the routing exchange below */
    rc = host_reserve(c, &c->fwd_idx, (size_t)(p->num_node_recv * K) * sizeof(int32_t));
    if (rc == MOERT_OK) rc = host_reserve(c, &c->fwd_copy_row, (size_t)(p->num_node_recv * K) * sizeof(int64_t));
    if (rc == MOERT_OK) rc = host_reserve(c, &c->recv_final_row, (size_t)p->num_recv * sizeof(int64_t));
    if (rc != MOERT_OK) return rc;
    p->fwd_idx = c->fwd_idx.data;
    p->fwd_copy_row = c->fwd_copy_row.data;
    p->recv_final_row = c->recv_final_row.data;
    rc = exchange(c, NULL, moert_cpu(), PHASE_NODES, c->routing_send.data, p->node_send_tokens, p->fwd_idx,
                  p->node_recv_tokens, (size_t)K * sizeof(int32_t));
    if (rc != MOERT_OK) return rc;
    hier_plan_forward(p, c->all_counts);

    void *tokens_per_expert_data = p->tokens_per_expert;
#ifdef MOERT_HAVE_CUDA
    if (c->on_cuda) {
        rc = cuda_plan(c, stream);
        if (rc != MOERT_OK) return rc;
        tokens_per_expert_data = c->cu.tokens_per_expert.data;
    }
#endif
    layout->num_recv = p->num_recv;
    layout->capacity = p->capacity;
    layout->tokens_per_expert = moert_tensor_1d(tokens_per_expert_data, c->layer.device, MOERT_I64, El);
    layout->tokens_per_expert_host = p->tokens_per_expert;
    c->prepared = true;
    report_metric(c, "dispatch.recv_tokens", (double)p->num_recv, "tokens");
    report_metric(c, "prepare.routing_bytes_internode",
                  phase_bytes(c, PHASE_NODES, p->node_send_tokens, (double)K * sizeof(int32_t)), "bytes");
    h->log(h, MOERT_LOG_DEBUG,
           "prepare: T %lld, %lld rows to %lld nodes' forwarders, %lld tokens forwarded (%lld copies), receive %lld",
           (long long)num_tokens, (long long)p->num_node_send, (long long)N, (long long)p->num_node_recv,
           (long long)p->num_local_send, (long long)p->num_recv);
    return MOERT_OK;
}

/* ---- the CPU path's moves ---- */

/* Rows [T, row_bytes] of `src` to the grouped rows `grouped` on the experts' ranks (dispatch, combine_backward). */
static moert_result cpu_rows_to_experts(hier_ctx *c, moert_stream stream, const void *src, size_t row_bytes,
                                        void *grouped)
{
    const hier_plan *p = &c->plan;
    moert_result rc = buffer_reserve(c, &c->node_rows, (size_t)p->num_node_send * row_bytes);
    if (rc == MOERT_OK) rc = buffer_reserve(c, &c->fwd_rows, (size_t)p->num_node_recv * row_bytes);
    if (rc == MOERT_OK) rc = buffer_reserve(c, &c->local_rows, (size_t)p->num_local_send * row_bytes);
    if (rc == MOERT_OK) rc = buffer_reserve(c, &c->staging_rows, (size_t)p->num_recv * row_bytes);
    if (rc != MOERT_OK) return rc;
    hier_pack_node_rows(p, src, row_bytes, c->node_rows.data);
    rc = exchange(c, stream, c->layer.device, PHASE_NODES, c->node_rows.data, p->node_send_tokens, c->fwd_rows.data,
                  p->node_recv_tokens, row_bytes);
    if (rc != MOERT_OK) return rc;
    hier_pack_local_rows(p, c->fwd_rows.data, row_bytes, c->local_rows.data);
    rc = exchange(c, stream, c->layer.device, PHASE_LOCAL, c->local_rows.data, p->local_send_rows, c->staging_rows.data,
                  p->local_recv_rows, row_bytes);
    if (rc != MOERT_OK) return rc;
    hier_scatter_rows(p, c->staging_rows.data, row_bytes, grouped);
    return MOERT_OK;
}

/* Grouped rows back: partial sums per token at the forwarders, then the nodes' partials summed into out (combine,
 * dispatch_backward with accumulate). */
static moert_result cpu_rows_to_tokens(hier_ctx *c, moert_stream stream, const void *grouped, moert_dtype dtype,
                                       int accumulate, void *out, moert_dtype out_dtype)
{
    const hier_plan *p = &c->plan;
    const int64_t H = c->layer.hidden;
    const size_t row_bytes = (size_t)H * moert_dtype_size(dtype);
    moert_result rc = buffer_reserve(c, &c->node_rows, (size_t)p->num_node_send * row_bytes);
    if (rc == MOERT_OK) rc = buffer_reserve(c, &c->fwd_rows, (size_t)p->num_node_recv * row_bytes);
    if (rc == MOERT_OK) rc = buffer_reserve(c, &c->local_rows, (size_t)p->num_local_send * row_bytes);
    if (rc == MOERT_OK) rc = buffer_reserve(c, &c->staging_rows, (size_t)p->num_recv * row_bytes);
    if (rc == MOERT_OK) rc = buffer_reserve(c, &c->acc, (size_t)H * sizeof(double));
    if (rc != MOERT_OK) return rc;
    hier_gather_rows(p, grouped, row_bytes, c->staging_rows.data);
    rc = exchange(c, stream, c->layer.device, PHASE_LOCAL, c->staging_rows.data, p->local_recv_rows, c->local_rows.data,
                  p->local_send_rows, row_bytes);
    if (rc != MOERT_OK) return rc;
    hier_partial_rows(p, c->local_rows.data, dtype, H, c->fwd_rows.data, c->acc.data);
    rc = exchange(c, stream, c->layer.device, PHASE_NODES, c->fwd_rows.data, p->node_recv_tokens, c->node_rows.data,
                  p->node_send_tokens, row_bytes);
    if (rc != MOERT_OK) return rc;
    hier_sum_nodes(p, c->node_rows.data, dtype, H, accumulate, out, out_dtype, c->acc.data);
    return MOERT_OK;
}

/* The probs' buffers at every stage, as double. */
static moert_result cpu_reserve_probs(hier_ctx *c)
{
    const hier_plan *p = &c->plan;
    moert_result rc = buffer_reserve(c, &c->node_probs, (size_t)p->num_node_send_copies * sizeof(double));
    if (rc == MOERT_OK) rc = buffer_reserve(c, &c->fwd_probs, (size_t)p->num_node_recv_copies * sizeof(double));
    if (rc == MOERT_OK) rc = buffer_reserve(c, &c->local_probs, (size_t)p->num_local_send * sizeof(double));
    if (rc == MOERT_OK) rc = buffer_reserve(c, &c->staging_probs, (size_t)p->num_recv * sizeof(double));
    return rc;
}

/* Routing weights [T,K] to the grouped rows' weights (dispatch): one per copy, as double on the way. */
static moert_result cpu_probs_to_experts(hier_ctx *c, moert_stream stream, const moert_tensor *probs,
                                         moert_tensor *recv_probs)
{
    const hier_plan *p = &c->plan;
    moert_result rc = cpu_reserve_probs(c);
    if (rc != MOERT_OK) return rc;
    hier_pack_node_probs(p, probs->data, probs->dtype, c->node_probs.data);
    rc = exchange(c, stream, c->layer.device, PHASE_NODES, c->node_probs.data, p->node_send_copies, c->fwd_probs.data,
                  p->node_recv_copies, sizeof(double));
    if (rc != MOERT_OK) return rc;
    hier_pack_local_probs(p, c->fwd_probs.data, c->local_probs.data);
    rc = exchange(c, stream, c->layer.device, PHASE_LOCAL, c->local_probs.data, p->local_send_rows,
                  c->staging_probs.data, p->local_recv_rows, sizeof(double));
    if (rc != MOERT_OK) return rc;
    hier_scatter_probs(p, c->staging_probs.data, recv_probs->data, recv_probs->dtype);
    return MOERT_OK;
}

/* The grouped rows' weight gradients back to their (t, k) slots (dispatch_backward). */
static moert_result cpu_probs_to_tokens(hier_ctx *c, moert_stream stream, const moert_tensor *d_recv_probs,
                                        moert_tensor *d_topk_probs)
{
    const hier_plan *p = &c->plan;
    moert_result rc = cpu_reserve_probs(c);
    if (rc != MOERT_OK) return rc;
    hier_gather_probs(p, d_recv_probs->data, d_recv_probs->dtype, c->staging_probs.data);
    rc = exchange(c, stream, c->layer.device, PHASE_LOCAL, c->staging_probs.data, p->local_recv_rows,
                  c->local_probs.data, p->local_send_rows, sizeof(double));
    if (rc != MOERT_OK) return rc;
    hier_unpack_local_probs(p, c->local_probs.data, c->fwd_probs.data);
    rc = exchange(c, stream, c->layer.device, PHASE_NODES, c->fwd_probs.data, p->node_recv_copies, c->node_probs.data,
                  p->node_send_copies, sizeof(double));
    if (rc != MOERT_OK) return rc;
    hier_unpack_probs(p, c->node_probs.data, d_topk_probs->data, d_topk_probs->dtype);
    return MOERT_OK;
}

#ifdef MOERT_HAVE_CUDA
/* ---- the CUDA path's moves: the same stages, each a row kernel over a map from cuda_plan ---- */

/* The kernels move fp32 and bf16 data; both tensors of a pair must share the dtype (rows move as bits). */
static moert_result cuda_check_dtypes(const hier_ctx *c, const char *call, const char *name_a, const moert_tensor *a,
                                      const char *name_b, const moert_tensor *b)
{
    return moert_dispatch_check_cuda_dtypes(c->host, call, name_a, a, name_b, b);
}

/* Rows (probs: per-copy values, width 1) of `src` to the grouped buffer on the experts' ranks: gather into phase-1
 * order, exchange between nodes, gather into phase-2 order at the forwarder, exchange inside the node, regroup. */
static moert_result cuda_to_experts(hier_ctx *c, moert_stream stream, bool probs, moert_dtype dtype, int64_t width,
                                    const void *src, void *grouped)
{
    const moert_host *h = c->host;
    const hier_plan *p = &c->plan;
    const cudaStream_t s = (cudaStream_t)stream;
    const size_t row_bytes = (size_t)width * moert_dtype_size(dtype);
    hier_buffer *node = probs ? &c->node_probs : &c->node_rows, *fwd = probs ? &c->fwd_probs : &c->fwd_rows;
    hier_buffer *local = probs ? &c->local_probs : &c->local_rows;
    hier_buffer *staging = probs ? &c->staging_probs : &c->staging_rows;
    const int64_t node_send = probs ? p->num_node_send_copies : p->num_node_send;
    const int64_t node_recv = probs ? p->num_node_recv_copies : p->num_node_recv;
    moert_result rc = buffer_reserve(c, node, (size_t)node_send * row_bytes);
    if (rc == MOERT_OK) rc = buffer_reserve(c, fwd, (size_t)node_recv * row_bytes);
    if (rc == MOERT_OK) rc = buffer_reserve(c, local, (size_t)p->num_local_send * row_bytes);
    if (rc == MOERT_OK) rc = buffer_reserve(c, staging, (size_t)p->num_recv * row_bytes);
    if (rc == MOERT_OK)
        rc = moert_a2a_cuda_gather_rows(h, s, dtype, node_send, width,
                                        cuda_map(c, probs ? MAP_COPY_OF_NODE_SLOT : MAP_NODE_ROW_TOKEN), 1, NULL, src,
                                        node->data);
    if (rc == MOERT_OK)
        rc = exchange(c, stream, c->layer.device, PHASE_NODES, node->data,
                      probs ? p->node_send_copies : p->node_send_tokens, fwd->data,
                      probs ? p->node_recv_copies : p->node_recv_tokens, row_bytes);
    if (rc == MOERT_OK)
        rc = moert_a2a_cuda_gather_rows(h, s, dtype, p->num_local_send, width,
                                        cuda_map(c, probs ? MAP_LOCAL_ROW_FWD_SLOT : MAP_LOCAL_ROW_FWD), 1, NULL,
                                        fwd->data, local->data);
    if (rc == MOERT_OK)
        rc = exchange(c, stream, c->layer.device, PHASE_LOCAL, local->data, p->local_send_rows, staging->data,
                      p->local_recv_rows, row_bytes);
    if (rc == MOERT_OK)
        rc = moert_a2a_cuda_gather_rows(h, s, dtype, p->capacity, width, cuda_map(c, MAP_GROUPED_SRC), 1, NULL,
                                        staging->data, grouped);
    return rc;
}

/* Grouped rows back to the tokens: to phase-2 order, exchange inside the node, each forwarded token's copies summed
 * (fp32, rounded to dtype) at the forwarder, exchange between nodes, the nodes' partials summed into out. */
static moert_result cuda_rows_to_tokens(hier_ctx *c, moert_stream stream, moert_dtype dtype, const void *grouped,
                                        void *out, int accumulate)
{
    const moert_host *h = c->host;
    const hier_plan *p = &c->plan;
    const cudaStream_t s = (cudaStream_t)stream;
    const int64_t H = c->layer.hidden;
    const size_t row_bytes = (size_t)H * moert_dtype_size(dtype);
    moert_result rc = buffer_reserve(c, &c->node_rows, (size_t)p->num_node_send * row_bytes);
    if (rc == MOERT_OK) rc = buffer_reserve(c, &c->fwd_rows, (size_t)p->num_node_recv * row_bytes);
    if (rc == MOERT_OK) rc = buffer_reserve(c, &c->local_rows, (size_t)p->num_local_send * row_bytes);
    if (rc == MOERT_OK) rc = buffer_reserve(c, &c->staging_rows, (size_t)p->num_recv * row_bytes);
    if (rc == MOERT_OK)
        rc = moert_a2a_cuda_gather_rows(h, s, dtype, p->num_recv, H, cuda_map(c, MAP_STAGING_SRC), 1, NULL, grouped,
                                        c->staging_rows.data);
    if (rc == MOERT_OK)
        rc = exchange(c, stream, c->layer.device, PHASE_LOCAL, c->staging_rows.data, p->local_recv_rows,
                      c->local_rows.data, p->local_send_rows, row_bytes);
    if (rc == MOERT_OK)
        rc = moert_a2a_cuda_combine_rows(h, s, dtype, p->num_node_recv, p->topk, H, cuda_map(c, MAP_FWD_COPY_ROW),
                                         c->local_rows.data, c->fwd_rows.data, 0);
    if (rc == MOERT_OK)
        rc = exchange(c, stream, c->layer.device, PHASE_NODES, c->fwd_rows.data, p->node_recv_tokens, c->node_rows.data,
                      p->node_send_tokens, row_bytes);
    if (rc == MOERT_OK)
        rc = moert_a2a_cuda_combine_rows(h, s, dtype, p->num_tokens, p->num_nodes, H, cuda_map(c, MAP_TOKEN_NODE_ROW),
                                         c->node_rows.data, out, accumulate);
    return rc;
}

/* The grouped rows' weight gradients back to their (t, k) slots; 0 for dropped copies. */
static moert_result cuda_probs_to_tokens(hier_ctx *c, moert_stream stream, moert_dtype dtype, const void *grouped,
                                         void *out)
{
    const moert_host *h = c->host;
    const hier_plan *p = &c->plan;
    const cudaStream_t s = (cudaStream_t)stream;
    const size_t es = moert_dtype_size(dtype);
    moert_result rc = buffer_reserve(c, &c->node_probs, (size_t)p->num_node_send_copies * es);
    if (rc == MOERT_OK) rc = buffer_reserve(c, &c->fwd_probs, (size_t)p->num_node_recv_copies * es);
    if (rc == MOERT_OK) rc = buffer_reserve(c, &c->local_probs, (size_t)p->num_local_send * es);
    if (rc == MOERT_OK) rc = buffer_reserve(c, &c->staging_probs, (size_t)p->num_recv * es);
    if (rc == MOERT_OK)
        rc = moert_a2a_cuda_gather_rows(h, s, dtype, p->num_recv, 1, cuda_map(c, MAP_STAGING_SRC), 1, NULL, grouped,
                                        c->staging_probs.data);
    if (rc == MOERT_OK)
        rc = exchange(c, stream, c->layer.device, PHASE_LOCAL, c->staging_probs.data, p->local_recv_rows,
                      c->local_probs.data, p->local_send_rows, es);
    if (rc == MOERT_OK)
        rc = moert_a2a_cuda_gather_rows(h, s, dtype, p->num_node_recv_copies, 1, cuda_map(c, MAP_FWD_SLOT_LOCAL_ROW), 1,
                                        NULL, c->local_probs.data, c->fwd_probs.data);
    if (rc == MOERT_OK)
        rc = exchange(c, stream, c->layer.device, PHASE_NODES, c->fwd_probs.data, p->node_recv_copies,
                      c->node_probs.data, p->node_send_copies, es);
    if (rc == MOERT_OK)
        rc = moert_a2a_cuda_gather_rows(h, s, dtype, p->num_tokens * p->topk, 1, cuda_map(c, MAP_COPY_NODE_SLOT), 1,
                                        NULL, c->node_probs.data, out);
    return rc;
}
#endif

/* ---- the calls ---- */

/* Sends each kept token copy (row and routing weight) to the rank owning its expert, grouped by local expert: once
 * per destination node between nodes, then one row per copy inside the node. */
static moert_result hier_dispatch(void *ctx, moert_stream stream, const moert_dispatch_args *args)
{
    hier_ctx *c = ctx;
    const int64_t H = c->layer.hidden;
    const moert_dispatch_step_shape shape = step_shape(c);
    moert_result rc = moert_dispatch_check_dispatch(c->host, &shape, args);
    if (rc != MOERT_OK) return rc;
    const double row_bytes = (double)H * (double)moert_dtype_size(args->x->dtype);
#ifdef MOERT_HAVE_CUDA
    if (c->on_cuda) {
        const char *call = "dispatch()";
        rc = cuda_check_dtypes(c, call, "x", args->x, "recv_x", args->recv_x);
        if (rc == MOERT_OK && args->topk_probs)
            rc = cuda_check_dtypes(c, call, "topk_probs", args->topk_probs, "recv_probs", args->recv_probs);
        if (rc == MOERT_OK)
            rc = cuda_to_experts(c, stream, false, args->x->dtype, H, args->x->data, args->recv_x->data);
        if (rc == MOERT_OK && args->topk_probs)
            rc = cuda_to_experts(c, stream, true, args->topk_probs->dtype, 1, args->topk_probs->data,
                                 args->recv_probs->data);
        if (rc == MOERT_OK)
            report_dispatch_bytes(c, row_bytes,
                                  args->topk_probs ? (double)moert_dtype_size(args->topk_probs->dtype) : 0);
        return rc;
    }
#endif
    rc = cpu_rows_to_experts(c, stream, args->x->data, (size_t)row_bytes, args->recv_x->data);
    if (rc == MOERT_OK && args->topk_probs) rc = cpu_probs_to_experts(c, stream, args->topk_probs, args->recv_probs);
    if (rc == MOERT_OK) report_dispatch_bytes(c, row_bytes, args->topk_probs ? (double)sizeof(double) : 0);
    return rc;
}

/* Brings expert output rows back: each token's copies summed inside the destination node, one row per token and
 * node back, the nodes' rows summed at the token's rank. */
static moert_result hier_combine(void *ctx, moert_stream stream, const moert_combine_args *args)
{
    hier_ctx *c = ctx;
    const int64_t H = c->layer.hidden;
    const moert_dispatch_step_shape shape = step_shape(c);
    moert_result rc = moert_dispatch_check_combine(c->host, &shape, args);
    if (rc != MOERT_OK) return rc;
    const moert_dtype dtype = args->y_expert->dtype;
#ifdef MOERT_HAVE_CUDA
    if (c->on_cuda) {
        const char *call = "combine()";
        rc = cuda_check_dtypes(c, call, "y_expert", args->y_expert, "y", args->y);
        if (rc == MOERT_OK) rc = cuda_rows_to_tokens(c, stream, dtype, args->y_expert->data, args->y->data, 0);
    } else
#endif
        rc = cpu_rows_to_tokens(c, stream, args->y_expert->data, dtype, 0, args->y->data, args->y->dtype);
    if (rc == MOERT_OK) report_combine_bytes(c, (double)H * (double)moert_dtype_size(dtype));
    return rc;
}

/* The adjoint of combine: every received row gets its token's gradient (a dispatch of d_y without probs). */
static moert_result hier_combine_backward(void *ctx, moert_stream stream, const moert_combine_backward_args *args)
{
    hier_ctx *c = ctx;
    const int64_t H = c->layer.hidden;
    const moert_dispatch_step_shape shape = step_shape(c);
    moert_result rc = moert_dispatch_check_combine_backward(c->host, &shape, args);
    if (rc != MOERT_OK) return rc;
#ifdef MOERT_HAVE_CUDA
    if (c->on_cuda) {
        const char *call = "combine_backward()";
        rc = cuda_check_dtypes(c, call, "d_y", args->d_y, "d_y_expert", args->d_y_expert);
        if (rc != MOERT_OK) return rc;
        return cuda_to_experts(c, stream, false, args->d_y->dtype, H, args->d_y->data, args->d_y_expert->data);
    }
#endif
    return cpu_rows_to_experts(c, stream, args->d_y->data, (size_t)H * moert_dtype_size(args->d_y->dtype),
                               args->d_y_expert->data);
}

/* The adjoint of dispatch: row gradients summed into their tokens (+=) the way combine sums, weight gradients back to
 * their (t, k) slots. */
static moert_result hier_dispatch_backward(void *ctx, moert_stream stream, const moert_dispatch_backward_args *args)
{
    hier_ctx *c = ctx;
    const moert_dispatch_step_shape shape = step_shape(c);
    moert_result rc = moert_dispatch_check_dispatch_backward(c->host, &shape, args);
    if (rc != MOERT_OK) return rc;
#ifdef MOERT_HAVE_CUDA
    if (c->on_cuda) {
        const char *call = "dispatch_backward()";
        rc = cuda_check_dtypes(c, call, "d_recv_x", args->d_recv_x, "d_x", args->d_x);
        if (rc == MOERT_OK && args->d_recv_probs)
            rc = cuda_check_dtypes(c, call, "d_recv_probs", args->d_recv_probs, "d_topk_probs", args->d_topk_probs);
        if (rc == MOERT_OK)
            rc = cuda_rows_to_tokens(c, stream, args->d_recv_x->dtype, args->d_recv_x->data, args->d_x->data, 1);
        if (rc == MOERT_OK && args->d_recv_probs)
            rc = cuda_probs_to_tokens(c, stream, args->d_recv_probs->dtype, args->d_recv_probs->data,
                                      args->d_topk_probs->data);
        return rc;
    }
#endif
    rc = cpu_rows_to_tokens(c, stream, args->d_recv_x->data, args->d_recv_x->dtype, 1, args->d_x->data,
                            args->d_x->dtype);
    if (rc == MOERT_OK && args->d_recv_probs)
        rc = cpu_probs_to_tokens(c, stream, args->d_recv_probs, args->d_topk_probs);
    return rc;
}

/* The one exported symbol (its linker name through an asm label: C cannot name an object like its type). */
MOERT_DISPATCHER_V1_EXPORT(hierarchical_vtable) = {
    .header =
        {
            MOERT_DISPATCHER_V1_HEADER,
            .name = "hierarchical",
            .version = "0.1.0",
            .description =
                "two-level token dispatcher: a token crosses between nodes once per destination node and fans "
                "out inside it; combine reduces inside the node first",
            .devices = MOERT_DISPATCH_DEVICES,
            .dtypes = MOERT_DISPATCH_DTYPES,
            .flags = MOERT_CAP_NEEDS_HOST_SYNC,
        },
    .init = hier_init,
    .finalize = hier_finalize,
    .prepare = hier_prepare,
    .dispatch = hier_dispatch,
    .combine = hier_combine,
    .combine_backward = hier_combine_backward,
    .dispatch_backward = hier_dispatch_backward,
};
