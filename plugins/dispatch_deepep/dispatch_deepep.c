/* SPDX-License-Identifier: Apache-2.0 */
/* The "deepep" dispatcher plugin: tokens move by direct writes into the peers' buffers (exchanged once at init),
 * the way DeepEP's intranode kernels work. This file: vtable, options, the peer buffer's size, prepare() (layout
 * pass, then the count exchange through host->allgather) and the CUDA path's backend (NVLink copies by warps,
 * deepep_cuda.cu); the frame it shares with "hybridep" (argument checks, the peer buffer, prepare()'s shared steps,
 * the calls after prepare() and the CPU path's send/receive) is ../lib/peer_dispatch.c and peer_dispatch_cpu.c, its
 * own layout pass deepep_cpu.c. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "deepep_buffer.h"
#include "deepep_cpu.h"
#include "moert/dispatcher.h"
#include "../lib/peer_dispatch.h"
#ifdef MOERT_HAVE_CUDA
#include "deepep_cuda.h"
#include "../lib/dispatch_alltoall_cuda.h"
#endif

/* A host or device array grown on demand and reused across steps. */
typedef struct deepep_array {
    void *data;
    size_t bytes;
} deepep_array;

#define CALL_NAMES 64 /* names of recent CUDA calls by sequence number, for the stall messages */

#ifdef MOERT_HAVE_CUDA
/* The CUDA path's state: the layout on the device, the saved receive metadata, the stall word. */
typedef struct deepep_cuda_state {
    deepep_array expert_counts;  /* int64 [E] */
    deepep_array expert_offsets; /* int64 [E+1] */
    deepep_array row_of_copy;    /* int32 [T*K] */
    deepep_array copy_of_row;    /* int32 [T*K] (the layout kernel's, unused here) */
    deepep_array layout_scratch;
    deepep_array excl;      /* int32 [W][T+1] */
    deepep_array tokens_to; /* int64 [W] */
    deepep_array upload;    /* int64 [El + E]: tokens_per_expert, then base */
    deepep_array recv_meta; /* int32 [W][rows_cap][K] */
    deepep_array staging;   /* combine: staged partials, deepep_cuda_staging_bytes() */
    int sms;                /* SMs of the device: the local kernels' grid */
    deepep_array topk_idx;  /* int32 [T*K]: prepare()'s routing, kept for the step */
    deepep_array status;    /* device: unsigned long long error word, int abort flag (at 8), unsigned
                                   * finished-block counter (at 16); at DEEPEP_STATS_OFFSET the kernels' wait
                                   * statistics (option peer_wait_stats: DEEPEP_STAT_WORDS per PEER_CALL_*) */
    int64_t *pinned;        /* [E + W + 2]: counts, tokens_to, bad ids, error word */
    int64_t *pinned_upload; /* [El + E] */
} deepep_cuda_state;
#endif

/* The NVLink phase's blocks under "num_sms" 0 when the layer runs beside another micro-batch's GEMMs: few, so the
 * kernel finds free SMs (DeepEP's intranode kernels use 20 to 24); measured in docs/executor.md. */
#define DEEPEP_OVERLAP_SMS 24

/* Where the wait statistics start in the status array, and their words. */
#define DEEPEP_STATS_OFFSET 64
#define DEEPEP_STATS_WORDS  (DEEPEP_STAT_WORDS * (PEER_CALL_DISPATCH_BACKWARD + 1))

typedef struct deepep_ctx {
    peer_dispatch core; /* first: the frame it shares with "hybridep" (host, layer, peer buffer, the step) */
    bool nvlink_only;   /* bench_nvlink_only: CUDA calls run only their NVLink phase */
    bool wait_stats;    /* peer_wait_stats: the CUDA kernels sum their waits for peers, logged at finalize */
    char call_names[CALL_NAMES][24];

    deepep_plan plan;
    int64_t row_len;       /* entries of an exchange row: E counts, W tokens_to, T, channels, rc */
    int64_t *exchange_row; /* [row_len] */
    int64_t *gathered;     /* [W][row_len] */
    deepep_array copy_dst, excl, recv_meta, idx; /* host arrays of the CPU path (idx: topk_idx kept from prepare) */
#ifdef MOERT_HAVE_CUDA
    deepep_cuda_state cu;
#endif
} deepep_ctx;

/* Grows a host (CPU path) or layer-device array to at least `bytes`; contents not kept. */
static moert_result array_reserve(deepep_ctx *c, deepep_array *a, size_t bytes, bool on_device)
{
    const moert_host *h = c->core.host;
    if (bytes < 64) bytes = 64;
    if (a->bytes >= bytes) return MOERT_OK;
    const moert_device dev = on_device ? c->core.layer.device : moert_cpu();
    if (a->data) h->free(h, dev, a->data);
    a->data = NULL;
    a->bytes = 0;
    size_t grown = bytes + bytes / 2;
    moert_result rc = h->alloc(h, dev, grown, &a->data);
    if (rc != MOERT_OK) return rc;
    a->bytes = grown;
    return MOERT_OK;
}

static void array_release(deepep_ctx *c, deepep_array *a, bool on_device)
{
    if (a->data) c->core.host->free(c->core.host, on_device ? c->core.layer.device : moert_cpu(), a->data);
    a->data = NULL;
    a->bytes = 0;
}

/* ---- the peer buffer ---- */

/* Bytes per buffer row: rows of the layer's dtype on CUDA, of any dtype (8 bytes) on the CPU; FP8 rows fit. */
static size_t buffer_row_bytes(const deepep_ctx *c)
{
    const int64_t H = c->core.layer.hidden;
    size_t es = c->core.on_cuda ? moert_dtype_size(c->core.layer.dtype) : 8;
    size_t bytes = (size_t)H * es;
    if (c->core.fp8 && peer_fp8_row_bytes(H) > bytes) bytes = peer_fp8_row_bytes(H);
    return bytes;
}

/* Frees this rank's buffer once every peer has released every channel of the last call. */
static void buffer_release(deepep_ctx *c) { peer_dispatch_buffer_release(&c->core, (int)c->core.channels, NULL); }

/* Collective: (re)allocates this rank's buffer for rows_cap rows per source and exchanges it with every rank (no
 * notify area: the counts go through host->allgather). */
static moert_result buffer_setup(deepep_ctx *c, int64_t rows_cap)
{
    buffer_release(c);
    return peer_dispatch_buffer_setup(&c->core, rows_cap, buffer_row_bytes(c), 0);
}

/* ---- init and finalize ---- */

static void deepep_finalize(void *ctx);

#ifdef MOERT_HAVE_CUDA
static moert_result cuda_init(deepep_ctx *c);
static void cuda_finalize(deepep_ctx *c);
static const peer_dispatch_cuda deepep_cuda_backend;
#endif

static moert_result deepep_init(void **out, const moert_host *host, const moert_layer_info *layer)
{
    *out = NULL;
    void *made = NULL;
    moert_result rc = peer_dispatch_create(host, layer, "deepep", sizeof(deepep_ctx), &made);
    if (rc != MOERT_OK) return rc;
    deepep_ctx *c = made;
    static const char *const dtypes[] = {"bf16", "fp8", NULL};
    int dispatch_dtype = 0;
    rc = host->option_int(host, "num_sms", 0, 0, PEER_MAX_CHANNELS,
                          "SMs (thread blocks) of the NVLink phase of each call, every one sending; the local "
                          "expansion and reductions around it use every SM; 0: every SM of the device (at most 132), "
                          "or 24 with the micro-batch overlap; the CPU path ignores it",
                          &c->core.num_sms);
    if (rc == MOERT_OK) rc = peer_dispatch_read_timeout(&c->core);
    if (rc == MOERT_OK)
        rc = host->option_enum(host, "dispatch_dtype", dtypes, 0,
                               "what forward dispatch() sends: the rows as they are (\"bf16\"), or E4M3 with one fp32 "
                               "scale per 1x128 block (\"fp8\"), dequantized on receipt",
                               &dispatch_dtype);
    if (rc == MOERT_OK)
        rc = host->option_bool(host, "bench_nvlink_only", false,
                               "benchmark aid: CUDA calls run only their NVLink phase (rows cross, arrive and are "
                               "released; recv_x, y and the prob outputs are not written); never for a layer",
                               &c->nvlink_only);
    if (rc == MOERT_OK && c->nvlink_only)
        host->log(host, MOERT_LOG_WARN,
                  "bench_nvlink_only: the calls write no outputs (recv_x, y, the probs): a benchmark aid, never for a "
                  "layer that trains");
    if (rc == MOERT_OK)
        rc = host->option_bool(host, "peer_wait_stats", false,
                               "diagnostic: the CUDA kernels sum how long they spin waiting for their peers (block 0 "
                               "of each kernel, per call kind) and each instance logs the sums at finalize (info "
                               "level, MOERT_LOG=info); the CPU path ignores it",
                               &c->wait_stats);
    if (rc != MOERT_OK) goto fail;
    c->core.fp8 = dispatch_dtype == 1;
    c->core.channels = c->core.num_sms < 1 ? 1 : c->core.num_sms; /* 0 (every SM) is resolved by cuda_init() */
    if (c->core.fp8 && layer->hidden % PEER_FP8_BLOCK != 0) {
        host->set_error(host,
                        "config error at $.dispatcher.dispatch_dtype: \"fp8\" needs hidden divisible by %d (1x%d scale "
                        "blocks); hidden is %lld",
                        PEER_FP8_BLOCK, PEER_FP8_BLOCK, (long long)layer->hidden);
        rc = MOERT_ERR_CONFIG;
        goto fail;
    }

    const int64_t E = layer->num_experts, W = c->core.world;
    c->row_len = E + W + 3;
    c->exchange_row = calloc((size_t)c->row_len, sizeof(int64_t));
    c->gathered = calloc((size_t)(W * c->row_len), sizeof(int64_t));
    c->plan.all_counts = calloc((size_t)(W * E), sizeof(int64_t));
    c->plan.tokens_to = calloc((size_t)(W * W), sizeof(int64_t));
    c->plan.tokens_per_expert = calloc((size_t)layer->num_local_experts, sizeof(int64_t));
    c->plan.group_start = calloc((size_t)layer->num_local_experts, sizeof(int64_t));
    c->plan.base = calloc((size_t)E, sizeof(int64_t));
    if (!c->exchange_row || !c->gathered || !c->plan.all_counts || !c->plan.tokens_to || !c->plan.tokens_per_expert ||
        !c->plan.group_start || !c->plan.base) {
        host->set_error(host, "out of memory for the dispatcher state");
        rc = MOERT_ERR_OUT_OF_MEMORY;
        goto fail;
    }
    c->plan.world = c->core.world;
    c->plan.rank = c->core.rank;
    c->plan.num_experts = E;
    c->plan.num_local_experts = layer->num_local_experts;
    c->plan.topk = layer->topk;

#ifdef MOERT_HAVE_CUDA
    if (c->core.on_cuda) {
        rc = cuda_init(c);
        /* ranks whose GPUs cannot reach each other by peer access are refused before any buffer is exchanged */
        if (rc == MOERT_OK) rc = peer_dispatch_cuda_check_reach(&c->core);
        if (rc != MOERT_OK) goto fail;
    }
#endif
    /* every rank's slot holds the largest max_tokens of the group (collective, as the exchange is) */
    int64_t rows_cap = 1;
    rc = peer_dispatch_group_max_tokens(&c->core, &rows_cap);
    if (rc == MOERT_OK) rc = buffer_setup(c, rows_cap);
    if (rc != MOERT_OK) goto fail;
    *out = c;
    return MOERT_OK;
fail:
    deepep_finalize(c);
    return rc;
}

static void deepep_finalize(void *ctx)
{
    deepep_ctx *c = ctx;
    if (!c) return;
#ifdef MOERT_HAVE_CUDA
    if (c->core.on_cuda) cuda_finalize(c);
#endif
    buffer_release(c);
    array_release(c, &c->copy_dst, false);
    array_release(c, &c->excl, false);
    array_release(c, &c->recv_meta, false);
    array_release(c, &c->idx, false);
    free(c->exchange_row);
    free(c->gathered);
    free(c->plan.all_counts);
    free(c->plan.tokens_to);
    free(c->plan.tokens_per_expert);
    free(c->plan.group_start);
    free(c->plan.base);
    free(c);
}

/* ---- prepare ---- */

/* The CPU layout pass: counts per expert and tokens per rank into exchange_row. */
static moert_result count_local(deepep_ctx *c, const moert_tensor *topk_idx, int64_t *num_tokens)
{
    moert_result rc = peer_dispatch_check_topk_idx(&c->core, topk_idx);
    if (rc != MOERT_OK) return rc;
    const int64_t E = c->core.layer.num_experts, K = c->core.layer.topk;
    *num_tokens = topk_idx->shape[0];
    int64_t bad = deepep_count(topk_idx->data, *num_tokens, K, E, c->core.world, c->exchange_row, c->exchange_row + E);
    if (bad >= 0) return peer_dispatch_bad_expert(&c->core, topk_idx, bad);
    return MOERT_OK;
}

#ifdef MOERT_HAVE_CUDA
static moert_result cuda_count_local(deepep_ctx *c, moert_stream stream, const moert_tensor *topk_idx,
                                     int64_t *num_tokens);
static moert_result cuda_plan(deepep_ctx *c, moert_stream stream);
#endif

/* This step's routing on this rank, as the shared CPU calls read it. */
static peer_cpu_route cpu_route(const deepep_ctx *c)
{
    const deepep_plan *p = &c->plan;
    peer_cpu_route r = {.num_tokens = p->num_tokens,
                        .topk = p->topk,
                        .num_local_experts = p->num_local_experts,
                        .num_recv = p->num_recv,
                        .topk_idx = c->idx.data,
                        .copy_dst = p->copy_dst,
                        .excl = p->excl,
                        .tokens_to = p->tokens_to + (int64_t)p->rank * p->world};
    return r;
}

/* Layout pass, then the count exchange (every rank takes part even after a local failure, so all fail together),
 * then the plan: sizes, each copy's row on its expert's rank, and this rank's layout. */
static moert_result deepep_prepare(void *ctx, moert_stream stream, const moert_tensor *topk_idx,
                                   moert_dispatch_layout *layout)
{
    deepep_ctx *c = ctx;
    const moert_host *h = c->core.host;
    const int64_t E = c->core.layer.num_experts, El = c->core.layer.num_local_experts, K = c->core.layer.topk;
    const int W = c->core.world;
    int64_t num_tokens = 0;
    memset(c->exchange_row, 0, (size_t)c->row_len * sizeof(int64_t));
    moert_result local_rc = peer_dispatch_prepare_begin(&c->core, layout);
    if (local_rc == MOERT_OK) {
#ifdef MOERT_HAVE_CUDA
        if (c->core.on_cuda)
            local_rc = cuda_count_local(c, stream, topk_idx, &num_tokens);
        else
#endif
            local_rc = count_local(c, topk_idx, &num_tokens);
    }
    if (local_rc != MOERT_OK) memset(c->exchange_row, 0, (size_t)(E + W) * sizeof(int64_t));
    c->exchange_row[E + W] = num_tokens;
    c->exchange_row[E + W + 1] = c->core.channels;
    c->exchange_row[E + W + 2] = local_rc;

    moert_result rc = MOERT_OK;
    if (W == 1)
        memcpy(c->gathered, c->exchange_row, (size_t)c->row_len * sizeof(int64_t));
    else
        rc = h->allgather(h, c->exchange_row, c->gathered, (size_t)c->row_len * sizeof(int64_t), moert_cpu(), NULL);
    if (rc != MOERT_OK) return rc;
    if (local_rc != MOERT_OK) return local_rc;

    int64_t max_tokens = 0;
    for (int s = 0; s < W; s++) {
        const int64_t *row = c->gathered + (int64_t)s * c->row_len;
        rc = peer_dispatch_check_peer_prepare(&c->core, s, row[E + W + 2], row[E + W + 1]);
        if (rc != MOERT_OK) return rc;
        memcpy(c->plan.all_counts + (int64_t)s * E, row, (size_t)E * sizeof(int64_t));
        memcpy(c->plan.tokens_to + (int64_t)s * W, row + E, (size_t)W * sizeof(int64_t));
        if (row[E + W] > max_tokens) max_tokens = row[E + W];
    }
    if (max_tokens > c->core.geo.rows_cap) { /* every rank sees the same figures: all grow together */
        h->log(h, MOERT_LOG_INFO, "prepare: %lld tokens on one rank, more than the buffer's %lld rows: growing it",
               (long long)max_tokens, (long long)c->core.geo.rows_cap);
#ifdef MOERT_HAVE_CUDA
        if (c->core.on_cuda) {
            rc = h->stream_synchronize(h, stream);
            if (rc != MOERT_OK) return rc;
        }
#endif
        rc = buffer_setup(c, max_tokens);
        if (rc != MOERT_OK) return rc;
    }

    deepep_plan *p = &c->plan;
    p->num_tokens = num_tokens;
    p->num_recv = peer_plan_sizes(W, c->core.rank, E, El, p->all_counts, p->tokens_per_expert, p->group_start, p->base);
    void *tokens_per_expert_data = p->tokens_per_expert;
#ifdef MOERT_HAVE_CUDA
    if (c->core.on_cuda) {
        rc = cuda_plan(c, stream);
        if (rc != MOERT_OK) return rc;
        tokens_per_expert_data = c->cu.upload.data;
    } else
#endif
    {
        rc = array_reserve(c, &c->copy_dst, (size_t)(num_tokens * K) * sizeof(int64_t), false);
        if (rc == MOERT_OK) rc = array_reserve(c, &c->excl, (size_t)(W * (num_tokens + 1)) * sizeof(int64_t), false);
        if (rc == MOERT_OK)
            rc = array_reserve(c, &c->recv_meta, (size_t)(W * c->core.geo.rows_cap * K) * sizeof(int64_t), false);
        if (rc == MOERT_OK) rc = array_reserve(c, &c->idx, (size_t)(num_tokens * K) * sizeof(int32_t), false);
        if (rc != MOERT_OK) return rc;
        memcpy(c->idx.data, topk_idx->data, (size_t)(num_tokens * K) * sizeof(int32_t));
        p->copy_dst = c->copy_dst.data;
        p->excl = c->excl.data;
        deepep_plan_copies(p, topk_idx->data);
        c->core.route = cpu_route(c);
        c->core.recv_meta = c->recv_meta.data;
    }
    peer_dispatch_prepare_done(&c->core, layout, num_tokens, p->num_recv, p->num_recv, tokens_per_expert_data,
                               p->tokens_per_expert, p->tokens_to + (int64_t)c->core.rank * W);
    h->log(h, MOERT_LOG_DEBUG, "prepare: T %lld, receive %lld rows", (long long)num_tokens, (long long)p->num_recv);
    return MOERT_OK;
}

#ifdef MOERT_HAVE_CUDA
/* ---- the CUDA path ---- */

static moert_result cuda_init(deepep_ctx *c)
{
    const moert_host *h = c->core.host;
    const int64_t E = c->core.layer.num_experts, El = c->core.layer.num_local_experts, W = c->core.world;
    moert_result rc = peer_dispatch_cuda_check_layer(&c->core, MOERT_A2A_CUDA_MAX_EXPERTS);
    if (rc != MOERT_OK) return rc;
    c->core.cuda = &deepep_cuda_backend;
    if (c->core.fp8 && c->core.layer.dtype != MOERT_BF16)
        return peer_dispatch_fail(&c->core, MOERT_ERR_UNSUPPORTED,
                                  "dispatch_dtype \"fp8\" on CUDA quantizes bf16 "
                                  "rows, the layer is %s",
                                  moert_dtype_name(c->core.layer.dtype));
    deepep_cuda_state *cu = &c->cu;
    rc = peer_dispatch_cuda_sm_count(&c->core, &cu->sms);
    if (rc != MOERT_OK) return rc;
    if (cu->sms < 1) cu->sms = 1;
    if (c->core.num_sms == 0) { /* every SM of the device (at most PEER_MAX_CHANNELS), few beside the other half */
        const int most =
            MOERT_LAYER_INFO_FLAGS(&c->core.layer) & MOERT_LAYER_OVERLAPPED ? DEEPEP_OVERLAP_SMS : PEER_MAX_CHANNELS;
        c->core.channels = cu->sms > most ? most : cu->sms;
    }
    rc = array_reserve(c, &cu->status, DEEPEP_STATS_OFFSET + DEEPEP_STATS_WORDS * sizeof(unsigned long long), true);
    if (rc != MOERT_OK) return peer_dispatch_alloc_failed(&c->core, rc);
    rc = peer_dispatch_cuda_zero(h, cu->status.data, cu->status.bytes);
    if (rc == MOERT_OK) rc = array_reserve(c, &cu->upload, (size_t)(El + E) * sizeof(int64_t), true);
    if (rc == MOERT_OK) rc = h->alloc_pinned(h, (size_t)(E + W + 2) * sizeof(int64_t), (void **)&cu->pinned);
    if (rc == MOERT_OK) rc = h->alloc_pinned(h, (size_t)(El + E) * sizeof(int64_t), (void **)&cu->pinned_upload);
    return rc;
}

/* Option peer_wait_stats: logs how long this instance's kernels spun waiting for their peers, per call kind. */
static void cuda_log_wait_stats(deepep_ctx *c)
{
    const moert_host *h = c->core.host;
    unsigned long long w[DEEPEP_STATS_WORDS];
    if (deepep_cuda_read_stats(h, (const unsigned long long *)((char *)c->cu.status.data + DEEPEP_STATS_OFFSET), w,
                               DEEPEP_STATS_WORDS) != MOERT_OK) {
        h->log(h, MOERT_LOG_WARN, "peer_wait_stats: reading the kernels' sums failed");
        return;
    }
    static const char *const names[] = {"prepare", "dispatch", "combine", "combine_backward", "dispatch_backward"};
    char text[512];
    int at = snprintf(text, sizeof text, "peer waits of layer %d (block 0 of each kernel):", c->core.layer.layer_index);
    for (int id = PEER_CALL_DISPATCH; id <= PEER_CALL_DISPATCH_BACKWARD && at < (int)sizeof text; id++) {
        const unsigned long long *k = w + DEEPEP_STAT_WORDS * id;
        const unsigned long long calls = k[DEEPEP_STAT_CALLS];
        if (!calls) continue;
        at +=
            snprintf(text + at, sizeof text - (size_t)at, " %s x%llu: rows %.3f ms (%.1f us a call), release %.3f ms;",
                     names[id], calls, k[DEEPEP_STAT_ARRIVAL_NS] / 1e6, k[DEEPEP_STAT_ARRIVAL_NS] / 1e3 / (double)calls,
                     k[DEEPEP_STAT_RELEASE_NS] / 1e6);
    }
    h->log(h, MOERT_LOG_INFO, "%s", text);
}

static void cuda_finalize(deepep_ctx *c)
{
    deepep_cuda_state *cu = &c->cu;
    if (c->wait_stats && cu->status.data) cuda_log_wait_stats(c);
    deepep_array *arrays[] = {&cu->expert_counts,  &cu->expert_offsets, &cu->row_of_copy, &cu->copy_of_row,
                              &cu->layout_scratch, &cu->excl,           &cu->tokens_to,   &cu->upload,
                              &cu->recv_meta,      &cu->staging,        &cu->status,      &cu->topk_idx};
    for (size_t i = 0; i < sizeof arrays / sizeof arrays[0]; i++) array_release(c, arrays[i], true);
    if (cu->pinned) c->core.host->free_pinned(c->core.host, cu->pinned);
    if (cu->pinned_upload) c->core.host->free_pinned(c->core.host, cu->pinned_upload);
    cu->pinned = cu->pinned_upload = NULL;
}

/* The message of a stall a kernel recorded: which call, which peer, which wait. */
static moert_result cuda_report_stall(deepep_ctx *c, unsigned long long word)
{
    const int64_t seq = (int64_t)(word >> 16);
    const int kind = (int)((word >> 8) & 0xff), peer = (int)(word & 0xff);
    char why[256];
    if (!peer_dispatch_wait_text(&c->core, kind, peer, why, sizeof why))
        snprintf(why, sizeof why, "unknown failure word 0x%llx", word);
    char call[64];
    snprintf(call, sizeof call, "%s (call %lld)", c->call_names[seq % CALL_NAMES], (long long)seq);
    return peer_dispatch_mark_broken(&c->core, MOERT_ERR_TIMEOUT, call, why);
}

/* prepare()'s local part on CUDA: the layout kernels (counts per expert, each copy's place among its expert's
 * copies, each token's position per destination rank), then one bounded wait for the counts, the bad-id counter
 * and the stall word of earlier calls. */
static moert_result cuda_count_local(deepep_ctx *c, moert_stream stream, const moert_tensor *topk_idx,
                                     int64_t *num_tokens)
{
    const moert_host *h = c->core.host;
    const int64_t E = c->core.layer.num_experts, K = c->core.layer.topk, W = c->core.world;
    moert_result rc = peer_dispatch_check_topk_idx(&c->core, topk_idx);
    if (rc != MOERT_OK) return rc;
    const int64_t T = topk_idx->shape[0];
    if (T * K > INT32_MAX)
        return peer_dispatch_fail(&c->core, MOERT_ERR_UNSUPPORTED,
                                  "prepare(): %lld token copies (T*K), the CUDA path "
                                  "takes at most %d",
                                  (long long)(T * K), INT32_MAX);
    deepep_cuda_state *cu = &c->cu;
    rc = array_reserve(c, &cu->expert_counts, (size_t)E * sizeof(int64_t), true);
    if (rc == MOERT_OK) rc = array_reserve(c, &cu->expert_offsets, (size_t)(E + 1) * sizeof(int64_t), true);
    if (rc == MOERT_OK) rc = array_reserve(c, &cu->row_of_copy, (size_t)(T * K) * sizeof(int32_t), true);
    if (rc == MOERT_OK) rc = array_reserve(c, &cu->copy_of_row, (size_t)(T * K) * sizeof(int32_t), true);
    if (rc == MOERT_OK) rc = array_reserve(c, &cu->layout_scratch, moert_a2a_cuda_layout_scratch_bytes(T, E), true);
    if (rc == MOERT_OK) rc = array_reserve(c, &cu->excl, (size_t)(W * (T + 1)) * sizeof(int32_t), true);
    if (rc == MOERT_OK) rc = array_reserve(c, &cu->tokens_to, (size_t)W * sizeof(int64_t), true);
    if (rc == MOERT_OK) rc = array_reserve(c, &cu->topk_idx, (size_t)(T * K) * sizeof(int32_t), true);
    if (rc == MOERT_OK && T > 0)
        rc = h->memcpy_async(h, cu->topk_idx.data, c->core.layer.device, topk_idx->data, c->core.layer.device,
                             (size_t)(T * K) * sizeof(int32_t), stream);
    if (rc != MOERT_OK) return rc;
    moert_a2a_cuda_layout_buffers bufs = {.tokens_per_expert = cu->expert_counts.data,
                                          .expert_offsets = cu->expert_offsets.data,
                                          .row_of_copy = cu->row_of_copy.data,
                                          .copy_of_row = cu->copy_of_row.data,
                                          .scratch = cu->layout_scratch.data};
    rc = moert_a2a_cuda_layout(h, (cudaStream_t)stream, topk_idx->data, T, K, E, &bufs, NULL);
    if (rc == MOERT_OK)
        rc = deepep_cuda_token_ranks(h, (cudaStream_t)stream, topk_idx->data, T, K, c->core.layer.num_local_experts, E,
                                     c->core.world, cu->excl.data, cu->tokens_to.data);
    const moert_device dev = c->core.layer.device, cpu = moert_cpu();
    if (rc == MOERT_OK)
        rc = h->memcpy_async(h, cu->pinned, cpu, cu->expert_counts.data, dev, (size_t)E * sizeof(int64_t), stream);
    if (rc == MOERT_OK)
        rc = h->memcpy_async(h, cu->pinned + E, cpu, cu->tokens_to.data, dev, (size_t)W * sizeof(int64_t), stream);
    if (rc == MOERT_OK)
        rc = h->memcpy_async(h, cu->pinned + E + W, cpu, moert_a2a_cuda_layout_bad_ids(cu->layout_scratch.data, T, E),
                             dev, sizeof(int64_t), stream);
    if (rc == MOERT_OK)
        rc = h->memcpy_async(h, cu->pinned + E + W + 1, cpu, cu->status.data, dev, sizeof(int64_t), stream);
    if (rc == MOERT_OK) rc = h->stream_synchronize(h, stream);
    if (rc != MOERT_OK) return rc;
    unsigned long long stall = 0, bad = 0;
    memcpy(&stall, cu->pinned + E + W + 1, sizeof stall);
    memcpy(&bad, cu->pinned + E + W, sizeof bad);
    if (stall) return cuda_report_stall(c, stall);
    if (bad)
        return peer_dispatch_fail(&c->core, MOERT_ERR_INVALID_ARGUMENT,
                                  "prepare(): %llu entries of topk_idx are "
                                  "outside [0, %lld) and not -1 (dropped); expected expert ids",
                                  bad, (long long)E);
    memcpy(c->exchange_row, cu->pinned, (size_t)(E + W) * sizeof(int64_t));
    *num_tokens = T;
    return MOERT_OK;
}

/* prepare()'s plan on CUDA: uploads tokens_per_expert and base (no wait), sizes the saved receive metadata and the
 * combine staging area. */
static moert_result cuda_plan(deepep_ctx *c, moert_stream stream)
{
    const moert_host *h = c->core.host;
    const int64_t E = c->core.layer.num_experts, El = c->core.layer.num_local_experts, K = c->core.layer.topk;
    const int64_t W = c->core.world;
    deepep_cuda_state *cu = &c->cu;
    if (c->plan.num_recv > INT32_MAX)
        return peer_dispatch_fail(&c->core, MOERT_ERR_UNSUPPORTED,
                                  "prepare(): %lld rows to receive, the CUDA path "
                                  "takes at most %d",
                                  (long long)c->plan.num_recv, INT32_MAX);
    memcpy(cu->pinned_upload, c->plan.tokens_per_expert, (size_t)El * sizeof(int64_t));
    memcpy(cu->pinned_upload + El, c->plan.base, (size_t)E * sizeof(int64_t));
    moert_result rc = h->memcpy_async(h, cu->upload.data, c->core.layer.device, cu->pinned_upload, moert_cpu(),
                                      (size_t)(El + E) * sizeof(int64_t), stream);
    if (rc == MOERT_OK)
        rc = array_reserve(c, &cu->recv_meta, (size_t)(W * c->core.geo.rows_cap * K) * sizeof(int32_t), true);
    int64_t staged = 0; /* rows received from other ranks: combine stages one partial per row */
    for (int s = 0; s < W; s++)
        if (s != c->core.rank) staged += c->plan.tokens_to[(int64_t)s * W + c->core.rank];
    if (rc == MOERT_OK) rc = array_reserve(c, &cu->staging, deepep_cuda_staging_bytes(&c->core.geo, staged), true);
    return rc;
}

/* The next CUDA call's sequence number, with its name remembered for stall messages (the CPU path's calls are
 * numbered by the frame). */
static int64_t next_seq(deepep_ctx *c, const char *call)
{
    c->core.seq++;
    snprintf(c->call_names[c->core.seq % CALL_NAMES], sizeof c->call_names[0], "%s", call);
    return c->core.seq;
}

/* The kernels' view of this step and call. */
static deepep_cuda_call cuda_call(deepep_ctx *c, int64_t seq)
{
    deepep_cuda_state *cu = &c->cu;
    deepep_cuda_call k;
    memset(&k, 0, sizeof k);
    k.geo = c->core.geo;
    k.local = c->core.buf;
    for (int r = 0; r < c->core.world; r++) k.peers[r] = c->core.peers[r];
    k.rank = c->core.rank;
    k.channels = (int)c->core.channels;
    k.sms = cu->sms;
    k.nvlink_only = c->nvlink_only;
    k.seq = seq;
    k.timeout_ns = c->core.timeout_ms * 1000000;
    k.tokens = c->plan.num_tokens;
    k.topk = c->core.layer.topk;
    k.hidden = c->core.layer.hidden;
    k.local_experts = c->core.layer.num_local_experts;
    k.topk_idx = cu->topk_idx.data;
    k.excl = cu->excl.data;
    k.row_of_copy = cu->row_of_copy.data;
    k.expert_offsets = cu->expert_offsets.data;
    k.base = (const int64_t *)cu->upload.data + c->core.layer.num_local_experts;
    k.recv_meta = cu->recv_meta.data;
    for (int s = 0; s < c->core.world; s++) {
        k.recv_tokens[s] = c->plan.tokens_to[(int64_t)s * c->core.world + c->core.rank];
        k.staged_off[s] = k.staging_rows;
        if (s != c->core.rank) k.staging_rows += k.recv_tokens[s];
    }
    k.staging = cu->staging.data;
    k.error_word = cu->status.data;
    k.abort_flag = (int *)((char *)cu->status.data + 8);
    k.done_blocks = (unsigned *)((char *)cu->status.data + 16);
    if (c->wait_stats) k.wait_stats = (unsigned long long *)((char *)cu->status.data + DEEPEP_STATS_OFFSET);
    return k;
}

/* A dispatch-like call on the NVLink kernels (peer_dispatch_cuda: the frame checked its arguments). */
static moert_result cuda_dispatch_like(peer_dispatch *d, moert_stream stream, const char *call, int call_id, bool fp8,
                                       const moert_tensor *x, const moert_tensor *probs, moert_tensor *out,
                                       moert_tensor *out_probs)
{
    deepep_ctx *c = (deepep_ctx *)d;
    deepep_cuda_call k = cuda_call(c, next_seq(c, call));
    k.call_id = call_id;
    return deepep_cuda_dispatch(d->host, (cudaStream_t)stream, &k, x->dtype, fp8, x->data, probs ? probs->data : NULL,
                                out->data, out_probs ? out_probs->data : NULL);
}

/* A combine-like call on the NVLink kernels. */
static moert_result cuda_combine_like(peer_dispatch *d, moert_stream stream, const char *call, int call_id,
                                      const moert_tensor *rows, const moert_tensor *row_probs, moert_tensor *out,
                                      bool accumulate, moert_tensor *out_probs)
{
    deepep_ctx *c = (deepep_ctx *)d;
    deepep_cuda_call k = cuda_call(c, next_seq(c, call));
    k.call_id = call_id;
    return deepep_cuda_combine(d->host, (cudaStream_t)stream, &k, rows->dtype, rows->data,
                               row_probs ? row_probs->data : NULL, out->data, accumulate,
                               out_probs ? out_probs->data : NULL);
}

/* The CUDA backend the shared calls run (stalls are read at prepare()'s sync: no status check per call). */
static const peer_dispatch_cuda deepep_cuda_backend = {
    .check_status = NULL,
    .dispatch_like = cuda_dispatch_like,
    .combine_like = cuda_combine_like,
};
#endif

MOERT_DISPATCHER_V1_EXPORT(deepep_vtable) = {
    .header =
        {
            MOERT_DISPATCHER_V1_HEADER,
            .name = "deepep",
            .version = "0.1.0",
            .description = "NVLink dispatcher in the way of DeepEP's intranode kernels: each token written once into "
                           "each destination rank's peer buffer, expanded there by local expert; bf16 or fp8 dispatch",
            .devices = PEER_DISPATCH_DEVICES,
            .dtypes = PEER_DISPATCH_DTYPES,
            /* on 24 SMs under the overlap (MOERT_LAYER_OVERLAPPED), where it was measured faster; prepare() counts
             * with local kernels and exchanges the counts through the host */
            .flags = MOERT_CAP_NEEDS_HOST_SYNC | MOERT_CAP_AUTO_OVERLAP | MOERT_CAP_PREPARE_OWN_STREAM,
        },
    .init = deepep_init,
    .finalize = deepep_finalize,
    .prepare = deepep_prepare,
    .dispatch = peer_dispatch_run_dispatch,
    .combine = peer_dispatch_run_combine,
    .combine_backward = peer_dispatch_run_combine_backward,
    .dispatch_backward = peer_dispatch_run_dispatch_backward,
};
