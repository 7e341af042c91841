/* SPDX-License-Identifier: Apache-2.0 */
/* The "hybridep" dispatcher plugin, in the spirit of NVIDIA's HybridEP: tokens move by direct writes into the peers'
 * buffers (exchanged once at init), TMA bulk copies on CUDA, the permutation fused into dispatch (each copy written
 * straight into its expert-grouped row) and the unpermutation into combine, buffers sized for the worst case so that
 * no call of a step waits for the GPU on the host. This file: vtable, options, the peer buffer's size, prepare()
 * (layout and notify through the buffers) and the CUDA path's backend (TMA copies, hybridep_cuda.cu); the frame it
 * shares with "deepep" (argument checks, the peer buffer, prepare()'s shared steps, the calls after prepare() and the
 * CPU path's send/receive) is ../lib/peer_dispatch.c and peer_dispatch_cpu.c, its own layout pass and notify
 * hybridep_cpu.c. */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hybridep_buffer.h"
#include "hybridep_cpu.h"
#include "moert/dispatcher.h"
#include "../lib/peer_dispatch.h"
#ifdef MOERT_HAVE_CUDA
#include "hybridep_cuda.h"
#endif

#ifdef MOERT_HAVE_CUDA
/* The CUDA path's state: every array sized at init for the worst case, so a step allocates nothing. */
typedef struct hybridep_cuda_state {
    void *arrays; /* one device block holding the arrays below */
    int32_t *topk_idx, *copy_index, *excl, *recv_meta;
    int64_t *base, *tokens_per_expert, *recv_tokens;
    unsigned *done_blocks;          /* the consuming kernels' finished-block counter */
    unsigned *sent_blocks;          /* low-latency kernels: blocks whose sends are complete (the last one flags) */
    int64_t *seq_dev;               /* device: sequence number of the last call (the kernels advance it) */
    int64_t *ll_calls;              /* device: low-latency calls so far */
    void *staging;                  /* normal mode, world > 1: the combine partials sent over NVLink */
    int sms;                        /* SMs of the device (the local kernels use all of them) */
    unsigned long long *error_word; /* device: error word, then the int abort flag */
    unsigned long long *pinned;     /* pinned host: the error word the kernels mirror (read without a sync) */
    unsigned long long *pinned_dev; /* its device address */
    bool tma;
} hybridep_cuda_state;
#endif

typedef struct hybridep_ctx {
    peer_dispatch core; /* first: the frame it shares with "deepep" (host, layer, peer buffer, the step) */
    int64_t low_latency_tokens;
    int low_latency_mode;         /* 0 auto, 1 on, 2 off */
    bool low_latency;             /* decided at init from the group's largest max_tokens */
    int copy;                     /* 0 tma, 1 vector */
    int64_t ll_threads, ll_piece; /* low-latency CUDA kernels: threads per block, bytes per row piece */
    int ll_flag, ll_fence;        /* HYBRIDEP_LL_FLAG_*, HYBRIDEP_LL_FENCE_* */
    int64_t capacity;             /* rows_cap * world * min(K, El): the worst case a rank receives */

    hybridep_plan plan;
    int64_t *notify_row;  /* [E + extra] (CPU path) */
    int64_t *notify_rows; /* [W][E + extra] (CPU path) */
    int64_t *recv_meta;   /* [W][rows_cap][K] (CPU path) */
    int32_t *idx;         /* [rows_cap*K] topk_idx kept from prepare (CPU path) */
#ifdef MOERT_HAVE_CUDA
    hybridep_cuda_state cu;
#endif
} hybridep_ctx;

/* The next call's sequence number (the CPU path's; the CUDA kernels keep theirs on the device, alike in eager use). */
static int64_t next_seq(hybridep_ctx *c) { return ++c->core.seq; }

/* ---- the peer buffer ---- */

/* Bytes per buffer row: rows of the layer's dtype on CUDA, of any dtype (8 bytes) on the CPU. */
static size_t buffer_row_bytes(const hybridep_ctx *c)
{
    size_t es = c->core.on_cuda ? moert_dtype_size(c->core.layer.dtype) : 8;
    return (size_t)c->core.layer.hidden * es;
}

/* Frees this rank's buffer once every peer has released the last call (channel 0: a reader stamps once its whole call
 * is read; on CUDA the kernels number the calls on the device). */
static void buffer_release(hybridep_ctx *c)
{
    const int64_t *device_seq = NULL;
#ifdef MOERT_HAVE_CUDA
    device_seq = c->cu.seq_dev;
#endif
    peer_dispatch_buffer_release(&c->core, 1, device_seq);
}

/* ---- init and finalize ---- */

static void hybridep_finalize(void *ctx);

#ifdef MOERT_HAVE_CUDA
static moert_result cuda_init(hybridep_ctx *c);
static void cuda_finalize(hybridep_ctx *c);
static const peer_dispatch_cuda hybridep_cuda_backend;
#endif

/* Reads the options into c; MOERT_ERR_CONFIG with the message set on a bad one. */
static moert_result read_options(hybridep_ctx *c)
{
    const moert_host *host = c->core.host;
    static const char *const modes[] = {"auto", "on", "off", NULL};
    static const char *const copies[] = {"tma", "vector", NULL};
    static const char *const flags[] = {"last_block", "per_block", NULL};
    static const char *const fences[] = {"thread", "block", NULL};
    moert_result rc =
        host->option_int(host, "num_sms", 0, 0, PEER_MAX_CHANNELS,
                         "SMs (thread blocks, every one sending) of the NVLink phase of each call; 0: 16, "
                         "or every SM in low-latency mode (one kernel per call, at most every SM); the "
                         "local kernels around the NVLink phase use every SM; the CPU path ignores it",
                         &c->core.num_sms);
    if (rc == MOERT_OK) rc = peer_dispatch_read_timeout(&c->core);
    if (rc == MOERT_OK)
        rc = host->option_enum(host, "low_latency", modes, 0,
                               "low-latency mode for small batches (vector copies, every SM): \"auto\" when the "
                               "group's max_tokens is at most low_latency_tokens, \"on\", \"off\"",
                               &c->low_latency_mode);
    if (rc == MOERT_OK)
        rc = host->option_int(host, "low_latency_tokens", 256, 1, 1 << 20,
                              "largest max_tokens (of any rank) for which low_latency \"auto\" turns the mode on",
                              &c->low_latency_tokens);
    if (rc == MOERT_OK)
        rc = host->option_enum(host, "copy", copies, 0,
                               "how CUDA rows move outside low-latency mode: \"tma\" bulk copies through shared "
                               "memory, or \"vector\" 16-byte loads and stores by warps",
                               &c->copy);
    if (rc == MOERT_OK)
        rc = host->option_int(host, "ll_threads", 512, 512, 1024,
                              "low-latency CUDA kernels: threads per block, 512 or 1024 (16 or 32 warps)",
                              &c->ll_threads);
    if (rc == MOERT_OK && c->ll_threads != 512 && c->ll_threads != 1024) {
        host->set_error(host, "config error at $.dispatcher.ll_threads: got %lld, expected 512 or 1024",
                        (long long)c->ll_threads);
        rc = MOERT_ERR_CONFIG;
    }
    if (rc == MOERT_OK)
        rc = host->option_int(host, "ll_piece", 1024, 512, 8192,
                              "low-latency CUDA kernels: bytes of a row piece (a warp's item), a multiple of 512",
                              &c->ll_piece);
    if (rc == MOERT_OK && c->ll_piece % 512 != 0) {
        host->set_error(host, "config error at $.dispatcher.ll_piece: got %lld, expected a multiple of 512",
                        (long long)c->ll_piece);
        rc = MOERT_ERR_CONFIG;
    }
    if (rc == MOERT_OK)
        rc = host->option_enum(host, "ll_flag", flags, 0,
                               "low-latency CUDA kernels: how a source flags its rows: \"last_block\" (the last "
                               "sending block stores one flag per destination) or \"per_block\" (every block adds "
                               "to a count at every destination)",
                               &c->ll_flag);
    if (rc == MOERT_OK)
        rc = host->option_enum(host, "ll_fence", fences, 1,
                               "low-latency CUDA kernels: after the block barrier, only the publishing threads fence "
                               "(\"block\") or, before the flag, every thread fences (\"thread\")",
                               &c->ll_fence);
    return rc;
}

static moert_result hybridep_init(void **out, const moert_host *host, const moert_layer_info *layer)
{
    *out = NULL;
    void *made = NULL;
    moert_result rc = peer_dispatch_create(host, layer, "hybridep", sizeof(hybridep_ctx), &made);
    if (rc != MOERT_OK) return rc;
    hybridep_ctx *c = made;
    rc = read_options(c);
#ifdef MOERT_HAVE_CUDA
    /* ranks whose GPUs cannot reach each other by peer access are refused before any buffer is exchanged */
    if (rc == MOERT_OK && c->core.on_cuda) rc = peer_dispatch_cuda_check_reach(&c->core);
#endif
    if (rc != MOERT_OK) goto fail;

    /* every rank's slot holds the largest max_tokens of the group (collective, as the exchange is); the mode and the
     * capacity follow from it, so every rank decides them alike */
    int64_t rows_cap = 1;
    rc = peer_dispatch_group_max_tokens(&c->core, &rows_cap);
    if (rc != MOERT_OK) goto fail;
    c->low_latency = c->low_latency_mode == 1 || (c->low_latency_mode == 0 && rows_cap <= c->low_latency_tokens);
    c->core.channels = c->core.num_sms > 0 ? c->core.num_sms : 16; /* 0: 16, or every SM in low-latency mode */

    const int64_t E = layer->num_experts, W = c->core.world, K = layer->topk, El = layer->num_local_experts;
    c->capacity = rows_cap * W * (K < El ? K : El);
    hybridep_plan *p = &c->plan;
    p->world = c->core.world;
    p->rank = c->core.rank;
    p->num_experts = E;
    p->num_local_experts = El;
    p->topk = K;
    if (!c->core.on_cuda) {
        p->counts = calloc((size_t)E, sizeof(int64_t));
        p->tokens_to = calloc((size_t)W, sizeof(int64_t));
        p->all_counts = calloc((size_t)(W * E), sizeof(int64_t));
        p->tokens_per_expert = calloc((size_t)El, sizeof(int64_t));
        p->base = calloc((size_t)E, sizeof(int64_t));
        p->copy_index = calloc((size_t)(rows_cap * K), sizeof(int64_t));
        p->copy_dst = calloc((size_t)(rows_cap * K), sizeof(int64_t));
        p->excl = calloc((size_t)(W * (rows_cap + 1)), sizeof(int64_t));
        c->notify_row = calloc((size_t)(E + HYBRIDEP_NOTIFY_EXTRA), sizeof(int64_t));
        c->notify_rows = calloc((size_t)(W * (E + HYBRIDEP_NOTIFY_EXTRA)), sizeof(int64_t));
        c->recv_meta = calloc((size_t)(W * rows_cap * K), sizeof(int64_t));
        c->idx = calloc((size_t)(rows_cap * K), sizeof(int32_t));
        c->core.recv_meta = c->recv_meta;
        if (!p->counts || !p->tokens_to || !p->all_counts || !p->tokens_per_expert || !p->base || !p->copy_index ||
            !p->copy_dst || !p->excl || !c->notify_row || !c->notify_rows || !c->recv_meta || !c->idx) {
            host->set_error(host, "out of memory for the dispatcher state (max_tokens %lld)", (long long)rows_cap);
            rc = MOERT_ERR_OUT_OF_MEMORY;
            goto fail;
        }
    }
    rc = peer_dispatch_buffer_setup(&c->core, rows_cap, buffer_row_bytes(c), E + HYBRIDEP_NOTIFY_EXTRA);
#ifdef MOERT_HAVE_CUDA
    if (rc == MOERT_OK && c->core.on_cuda) rc = cuda_init(c);
#endif
    if (rc != MOERT_OK) goto fail;
    /* CUDA: no host sync, no allocation, no host state a replay would repeat wrongly (the kernels number their calls
     * on the device): a step can be captured in a CUDA graph. The ABI 1.1 member may be missing on an older host. */
    if (c->core.on_cuda && host->struct_size >= offsetof(moert_host, set_flags) + sizeof host->set_flags &&
        host->set_flags)
        host->set_flags(host, MOERT_CAP_GRAPH_CAPTURABLE);
    host->log(host, MOERT_LOG_INFO, "hybridep: rows_cap %lld, capacity %lld, %s mode, %lld channels",
              (long long)rows_cap, (long long)c->capacity, c->low_latency ? "low-latency" : "normal",
              (long long)c->core.channels);
    *out = c;
    return MOERT_OK;
fail:
    hybridep_finalize(c);
    return rc;
}

static void hybridep_finalize(void *ctx)
{
    hybridep_ctx *c = ctx;
    if (!c) return;
    buffer_release(c);
#ifdef MOERT_HAVE_CUDA
    if (c->core.on_cuda) cuda_finalize(c);
#endif
    free(c->plan.counts);
    free(c->plan.tokens_to);
    free(c->plan.all_counts);
    free(c->plan.tokens_per_expert);
    free(c->plan.base);
    free(c->plan.copy_index);
    free(c->plan.copy_dst);
    free(c->plan.excl);
    free(c->notify_row);
    free(c->notify_rows);
    free(c->recv_meta);
    free(c->idx);
    free(c);
}

/* ---- prepare ---- */

/* Checks topk_idx's shape and dtype (int32 [T, K] on the layer's device, T within the buffers). */
static moert_result check_topk_idx(const hybridep_ctx *c, const moert_tensor *topk_idx)
{
    moert_result rc = peer_dispatch_check_topk_idx(&c->core, topk_idx);
    if (rc != MOERT_OK) return rc;
    if (topk_idx->shape[0] > c->core.geo.rows_cap)
        return peer_dispatch_fail(&c->core, MOERT_ERR_INVALID_ARGUMENT,
                                  "prepare(): topk_idx has %lld tokens, more "
                                  "than the %lld rows the buffers were sized for at init (the largest max_tokens of "
                                  "the group; no step may exceed it, the buffers never grow: that would need a host "
                                  "sync)",
                                  (long long)topk_idx->shape[0], (long long)c->core.geo.rows_cap);
    return MOERT_OK;
}

/* This step's routing on this rank, as the shared CPU calls read it. */
static peer_cpu_route cpu_route(const hybridep_ctx *c)
{
    const hybridep_plan *p = &c->plan;
    peer_cpu_route r = {.num_tokens = p->num_tokens,
                        .topk = p->topk,
                        .num_local_experts = p->num_local_experts,
                        .num_recv = p->num_recv,
                        .topk_idx = c->idx,
                        .copy_dst = p->copy_dst,
                        .excl = p->excl,
                        .tokens_to = p->tokens_to};
    return r;
}

/* The CPU path's prepare: layout, notify through the buffers (every rank takes part even after a local failure, so
 * all fail together), plan. */
static moert_result cpu_prepare(hybridep_ctx *c, const moert_tensor *topk_idx, moert_result local_rc)
{
    const int64_t E = c->core.layer.num_experts, K = c->core.layer.topk, W = c->core.world;
    const int64_t n = E + HYBRIDEP_NOTIFY_EXTRA;
    hybridep_plan *p = &c->plan;
    int64_t bad = -1;
    memset(c->notify_row, 0, (size_t)n * sizeof(int64_t));
    if (local_rc == MOERT_OK) {
        p->num_tokens = topk_idx->shape[0];
        bad = hybridep_layout(p, topk_idx->data);
        if (bad >= 0)
            local_rc = peer_dispatch_bad_expert(&c->core, topk_idx, bad);
        else
            memcpy(c->notify_row, p->counts, (size_t)E * sizeof(int64_t));
    }
    c->notify_row[E + HYBRIDEP_NOTIFY_STATUS] = local_rc != MOERT_OK;
    c->notify_row[E + HYBRIDEP_NOTIFY_CHANNELS] = c->core.channels;
    c->notify_row[E + HYBRIDEP_NOTIFY_TOKENS] = local_rc == MOERT_OK ? p->num_tokens : 0;
    for (int d = 0; d < W && local_rc == MOERT_OK; d++)
        c->notify_row[E + HYBRIDEP_NOTIFY_TOKENS_TO + d] = p->tokens_to[d];

    char why[256] = "";
    const peer_cpu_link l = peer_dispatch_cpu_link(&c->core, next_seq(c), c->recv_meta, why, sizeof why);
    int r = hybridep_cpu_notify(&l, c->notify_row, c->notify_rows);
    if (r > 0) return peer_dispatch_mark_broken(&c->core, MOERT_ERR_TIMEOUT, "prepare()", why);
    if (local_rc != MOERT_OK) return local_rc;
    for (int s = 0; s < W; s++) {
        const int64_t *row = c->notify_rows + s * n;
        const moert_result peer_rc = peer_dispatch_check_peer_prepare(&c->core, s, row[E + HYBRIDEP_NOTIFY_STATUS],
                                                                      row[E + HYBRIDEP_NOTIFY_CHANNELS]);
        if (peer_rc != MOERT_OK) return peer_rc;
        memcpy(p->all_counts + s * E, row, (size_t)E * sizeof(int64_t));
    }
    p->num_recv =
        peer_plan_sizes(p->world, p->rank, E, p->num_local_experts, p->all_counts, p->tokens_per_expert, NULL, p->base);
    hybridep_plan_copies(p, topk_idx->data);
    memcpy(c->idx, topk_idx->data, (size_t)(p->num_tokens * K) * sizeof(int32_t));
    c->core.route = cpu_route(c);
    return MOERT_OK;
}

#ifdef MOERT_HAVE_CUDA
static moert_result cuda_prepare(hybridep_ctx *c, moert_stream stream, const moert_tensor *topk_idx);
#endif

/* Layout and notify, then the layout: capacity is the worst case, the counts stay on the device on CUDA. */
static moert_result hybridep_prepare(void *ctx, moert_stream stream, const moert_tensor *topk_idx,
                                     moert_dispatch_layout *layout)
{
    hybridep_ctx *c = ctx;
    c->core.prepared = false;
    c->core.dispatched = false;
    moert_result rc = peer_dispatch_check_status(&c->core);
    if (rc != MOERT_OK) return rc;
    moert_result local_rc = peer_dispatch_prepare_begin(&c->core, layout);
    if (c->core.broken != MOERT_OK) return local_rc;
    if (local_rc == MOERT_OK) local_rc = check_topk_idx(c, topk_idx);
    void *counts = c->plan.tokens_per_expert;
#ifdef MOERT_HAVE_CUDA
    if (c->core.on_cuda) {
        if (local_rc != MOERT_OK) return local_rc; /* the peers' notify waits name this rank when they run out */
        rc = cuda_prepare(c, stream, topk_idx);
        counts = c->cu.tokens_per_expert;
    } else
#endif
        rc = cpu_prepare(c, topk_idx, local_rc);
    if (rc != MOERT_OK) return rc;
    /* CUDA: the counts stay on the device; the received-row tensors hold the worst case */
    peer_dispatch_prepare_done(&c->core, layout, c->plan.num_tokens, c->core.on_cuda ? -1 : c->plan.num_recv,
                               c->capacity, counts, NULL, c->core.on_cuda ? NULL : c->plan.tokens_to);
    return MOERT_OK;
}

#ifdef MOERT_HAVE_CUDA
/* ---- the CUDA path ---- */

static moert_result cuda_init(hybridep_ctx *c)
{
    const moert_host *h = c->core.host;
    const int64_t E = c->core.layer.num_experts, El = c->core.layer.num_local_experts, K = c->core.layer.topk;
    const int64_t W = c->core.world, R = c->core.geo.rows_cap;
    moert_result rc = peer_dispatch_cuda_check_layer(&c->core, 1024);
    if (rc != MOERT_OK) return rc;
    c->core.cuda = &hybridep_cuda_backend;
    if (R * K > INT32_MAX / 2 || c->capacity > INT32_MAX)
        return peer_dispatch_fail(&c->core, MOERT_ERR_UNSUPPORTED,
                                  "the hybridep dispatcher's CUDA path takes fewer "
                                  "than 2^31 rows (max_tokens %lld, capacity %lld)",
                                  (long long)R, (long long)c->capacity);
    hybridep_cuda_state *cu = &c->cu;
    rc = peer_dispatch_cuda_sm_count(&c->core, &cu->sms);
    if (rc != MOERT_OK) return rc;
    /* low-latency mode: one block per SM at most (its kernels need every block resident); 0: every SM */
    if (c->low_latency && (c->core.num_sms == 0 || c->core.channels > cu->sms))
        c->core.channels = cu->sms > PEER_MAX_CHANNELS ? PEER_MAX_CHANNELS : cu->sms;
    cu->tma = !c->low_latency && c->copy == 0;
    /* one block: int32 topk_idx, copy_index [R*K], excl [W][R+1], recv_meta [W][R][K]; int64 base [E],
     * tokens_per_expert [El], recv_tokens [W]; the status words and the block counter */
    size_t off = 0, o_idx, o_ci, o_excl, o_meta, o_base, o_tpe, o_recv, o_status;
#define TAKE(o, bytes) (o = off, off = peer_round_up(off + (size_t)(bytes), 256))
    TAKE(o_idx, R * K * 4);
    TAKE(o_ci, R * K * 4);
    TAKE(o_excl, W * (R + 1) * 4);
    TAKE(o_meta, W * R * K * 4);
    TAKE(o_base, E * 8);
    TAKE(o_tpe, El * 8);
    TAKE(o_recv, W * 8);
    TAKE(o_status, 64);
#undef TAKE
    rc = h->alloc(h, c->core.layer.device, off, &cu->arrays);
    if (rc != MOERT_OK) return peer_dispatch_alloc_failed(&c->core, rc);
    char *a = cu->arrays;
    cu->topk_idx = (int32_t *)(a + o_idx);
    cu->copy_index = (int32_t *)(a + o_ci);
    cu->excl = (int32_t *)(a + o_excl);
    cu->recv_meta = (int32_t *)(a + o_meta);
    cu->base = (int64_t *)(a + o_base);
    cu->tokens_per_expert = (int64_t *)(a + o_tpe);
    cu->recv_tokens = (int64_t *)(a + o_recv);
    cu->error_word = (unsigned long long *)(a + o_status);
    cu->done_blocks = (unsigned *)(a + o_status + 16);
    cu->sent_blocks = (unsigned *)(a + o_status + 20);
    cu->seq_dev = (int64_t *)(a + o_status + 24);
    cu->ll_calls = (int64_t *)(a + o_status + 32);
    rc = peer_dispatch_cuda_zero(h, cu->arrays, off);
    /* normal mode: the combine partials for the other ranks wait here for the NVLink phase (worst case: every token
     * of every other rank) */
    if (rc == MOERT_OK && !c->low_latency && W > 1)
        rc = h->alloc(h, c->core.layer.device, (size_t)(W - 1) * (size_t)R * c->core.geo.row_stride, &cu->staging);
    if (rc == MOERT_OK) rc = h->alloc_pinned(h, 64, (void **)&cu->pinned);
    if (rc == MOERT_OK) {
        memset(cu->pinned, 0, 64);
        rc = hybridep_cuda_mapped(h, cu->pinned, (void **)&cu->pinned_dev);
    }
    if (rc == MOERT_OK) rc = hybridep_cuda_setup(h);
    return rc;
}

static void cuda_finalize(hybridep_ctx *c)
{
    hybridep_cuda_state *cu = &c->cu;
    if (cu->arrays) c->core.host->free(c->core.host, c->core.layer.device, cu->arrays);
    if (cu->staging) c->core.host->free(c->core.host, c->core.layer.device, cu->staging);
    cu->staging = NULL;
    if (cu->pinned) c->core.host->free_pinned(c->core.host, cu->pinned);
    cu->arrays = NULL;
    cu->pinned = NULL;
}

/* Reads the status word the kernels mirror into pinned host memory (no sync): a failure of an earlier call (a stalled
 * peer, bad expert ids, a channel-count mismatch) is reported here, naming the call it happened in. */
static moert_result cuda_check_status(peer_dispatch *d)
{
    hybridep_ctx *c = (hybridep_ctx *)d;
    static const char *const names[] = {"prepare()", "dispatch()", "combine()", "combine_backward()",
                                        "dispatch_backward()"};
    const unsigned long long word = __atomic_load_n(c->cu.pinned, __ATOMIC_ACQUIRE);
    if (!word) return MOERT_OK;
    const int64_t seq = (int64_t)(word >> 20);
    const int call_id = (int)((word >> 16) & 0xf);
    const int kind = (int)((word >> 8) & 0xff), peer = (int)(word & 0xff);
    char why[256];
    moert_result code = MOERT_ERR_TIMEOUT;
    switch (kind) {
    case HYBRIDEP_WAIT_NOTIFY:
        snprintf(why, sizeof why, "rank %d did not send its counts within %lld ms (timeout_ms)", peer,
                 (long long)c->core.timeout_ms);
        break;
    case HYBRIDEP_BAD_IDS:
        code = MOERT_ERR_INVALID_ARGUMENT;
        snprintf(why, sizeof why,
                 "rank %d's topk_idx had expert ids outside [0, %lld) and not -1 (dropped); they "
                 "were treated as dropped in that step",
                 peer, (long long)c->core.layer.num_experts);
        break;
    case HYBRIDEP_CHANNELS:
        code = MOERT_ERR_CONFIG;
        snprintf(why, sizeof why,
                 "rank %d uses another channel count than this rank's %lld: every rank needs the "
                 "same num_sms",
                 peer, (long long)c->core.channels);
        break;
    default: /* PEER_WAIT_ARRIVAL, PEER_WAIT_CONSUMED */
        if (!peer_dispatch_wait_text(&c->core, kind, peer, why, sizeof why)) {
            code = MOERT_ERR_INTERNAL;
            snprintf(why, sizeof why, "unknown failure word 0x%llx", word);
        }
    }
    char call[64];
    snprintf(call, sizeof call, "%s (call %lld)", call_id <= PEER_CALL_DISPATCH_BACKWARD ? names[call_id] : "?",
             (long long)seq);
    return peer_dispatch_mark_broken(&c->core, code, call, why);
}

/* The kernels' view of this step and of a call (PEER_CALL_*); its sequence number lives on the device. */
static hybridep_cuda_call cuda_call(hybridep_ctx *c, int call)
{
    hybridep_cuda_state *cu = &c->cu;
    hybridep_cuda_call k;
    memset(&k, 0, sizeof k);
    k.geo = c->core.geo;
    k.local = c->core.buf;
    for (int r = 0; r < c->core.world; r++) k.peers[r] = c->core.peers[r];
    k.rank = c->core.rank;
    k.channels = (int)c->core.channels;
    k.sms = cu->sms;
    k.tma = cu->tma;
    k.low_latency = c->low_latency;
    k.call = call;
    k.ll_threads = (int)c->ll_threads;
    k.ll_flag = c->ll_flag;
    k.ll_fence = c->ll_fence;
    k.piece = c->ll_piece / 16;
    k.timeout_ns = c->core.timeout_ms * 1000000;
    k.tokens = c->plan.num_tokens;
    k.topk = c->core.layer.topk;
    k.hidden = c->core.layer.hidden;
    k.num_experts = c->core.layer.num_experts;
    k.local_experts = c->core.layer.num_local_experts;
    k.topk_idx = cu->topk_idx;
    k.copy_index = cu->copy_index;
    k.excl = cu->excl;
    k.base = cu->base;
    k.tokens_per_expert = cu->tokens_per_expert;
    k.recv_meta = cu->recv_meta;
    k.recv_tokens = cu->recv_tokens;
    k.staging = cu->staging;
    k.done_blocks = cu->done_blocks;
    k.sent_blocks = cu->sent_blocks;
    k.seq_dev = cu->seq_dev;
    k.ll_calls = cu->ll_calls;
    k.error_word = cu->error_word;
    k.abort_flag = (int *)(cu->error_word + 1);
    k.host_word = cu->pinned_dev;
    return k;
}

static moert_result cuda_prepare(hybridep_ctx *c, moert_stream stream, const moert_tensor *topk_idx)
{
    c->plan.num_tokens = topk_idx->shape[0];
    next_seq(c);
    hybridep_cuda_call k = cuda_call(c, PEER_CALL_PREPARE);
    return hybridep_cuda_prepare(c->core.host, (cudaStream_t)stream, &k, topk_idx->data);
}

/* A dispatch-like call on the TMA kernels (peer_dispatch_cuda: the frame checked its arguments; rows as they are). */
static moert_result cuda_dispatch_like(peer_dispatch *d, moert_stream stream, const char *call, int call_id, bool fp8,
                                       const moert_tensor *x, const moert_tensor *probs, moert_tensor *out,
                                       moert_tensor *out_probs)
{
    hybridep_ctx *c = (hybridep_ctx *)d;
    (void)call;
    (void)fp8;
    next_seq(c);
    hybridep_cuda_call k = cuda_call(c, call_id);
    return hybridep_cuda_dispatch(d->host, (cudaStream_t)stream, &k, x->dtype, x->data, probs ? probs->data : NULL,
                                  out->data, out_probs ? out_probs->data : NULL);
}

/* A combine-like call on the TMA kernels. */
static moert_result cuda_combine_like(peer_dispatch *d, moert_stream stream, const char *call, int call_id,
                                      const moert_tensor *rows, const moert_tensor *row_probs, moert_tensor *out,
                                      bool accumulate, moert_tensor *out_probs)
{
    hybridep_ctx *c = (hybridep_ctx *)d;
    (void)call;
    next_seq(c);
    hybridep_cuda_call k = cuda_call(c, call_id);
    return hybridep_cuda_combine(d->host, (cudaStream_t)stream, &k, rows->dtype, rows->data,
                                 row_probs ? row_probs->data : NULL, out->data, accumulate,
                                 out_probs ? out_probs->data : NULL);
}

/* The CUDA backend the shared calls run: every call first reads the status word the kernels mirror (no sync). */
static const peer_dispatch_cuda hybridep_cuda_backend = {
    .check_status = cuda_check_status,
    .dispatch_like = cuda_dispatch_like,
    .combine_like = cuda_combine_like,
};
#endif

MOERT_DISPATCHER_V1_EXPORT(hybridep_vtable) = {
    .header =
        {
            MOERT_DISPATCHER_V1_HEADER,
            .name = "hybridep",
            .version = "0.1.0",
            .description =
                "NVLink dispatcher in the spirit of HybridEP: TMA bulk copies into peers' buffers, permutation "
                "fused into dispatch, worst-case buffers, no host sync in a step; low-latency mode",
            .devices = PEER_DISPATCH_DEVICES,
            .dtypes = PEER_DISPATCH_DTYPES,
            .flags = 0,
        },
    .init = hybridep_init,
    .finalize = hybridep_finalize,
    .prepare = hybridep_prepare,
    .dispatch = peer_dispatch_run_dispatch,
    .combine = peer_dispatch_run_combine,
    .combine_backward = peer_dispatch_run_combine_backward,
    .dispatch_backward = peer_dispatch_run_dispatch_backward,
};
