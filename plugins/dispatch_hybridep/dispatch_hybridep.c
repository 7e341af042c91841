/* The "hybridep" dispatcher plugin, in the spirit of NVIDIA's HybridEP: tokens move by direct writes into the peers'
 * buffers (exchanged once at init), TMA bulk copies on CUDA, the permutation fused into dispatch (each copy written
 * straight into its expert-grouped row) and the unpermutation into combine, buffers sized for the worst case so that
 * no call of a step waits for the GPU on the host. This file: vtable, options, argument checks, the peer buffer,
 * prepare() and the calls of both paths; the CPU algorithm is in hybridep_cpu.c, the CUDA kernels in hybridep_cuda.cu. */
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hybridep_buffer.h"
#include "hybridep_cpu.h"
#include "moert/dispatcher.h"
#include "tensor_args.h"
#ifdef MOERT_HAVE_CUDA
#include "hybridep_cuda.h"
#endif


#ifdef MOERT_HAVE_CUDA
/* The CUDA path's state: every array sized at init for the worst case, so a step allocates nothing. */
typedef struct hybridep_cuda_state {
    void *arrays;                 /* one device block holding the arrays below */
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
    const moert_host *host;
    moert_layer_info layer;
    int world, rank;
    int64_t num_sms, channels, timeout_ms, low_latency_tokens;
    int low_latency_mode;       /* 0 auto, 1 on, 2 off */
    bool low_latency;           /* decided at init from the group's largest max_tokens */
    int copy;                   /* 0 tma, 1 vector */
    int64_t ll_threads, ll_piece; /* low-latency CUDA kernels: threads per block, bytes per row piece */
    int ll_flag, ll_fence;      /* HYBRIDEP_LL_FLAG_*, HYBRIDEP_LL_FENCE_* */
    bool on_cuda;
    moert_result broken;        /* MOERT_OK, or the code of a failure after which the buffers are out of step */
    char broken_msg[512];

    bool prepared, dispatched;  /* prepare() succeeded; a dispatch-like call ran since */
    int64_t seq;                /* sequence number of the last call through the buffers */

    hybridep_geometry geo;
    void *buf;                  /* this rank's peer-visible buffer on the layer's device */
    size_t buf_bytes;
    void *peers[HYBRIDEP_MAX_RANKS];
    int64_t capacity;           /* rows_cap * world * min(K, El): the worst case a rank receives */

    hybridep_plan plan;
    int64_t *notify_row;        /* [E + extra] (CPU path) */
    int64_t *notify_rows;       /* [W][E + extra] (CPU path) */
    int64_t recv_rows[HYBRIDEP_MAX_RANKS];
    int64_t *recv_meta;         /* [W][rows_cap][K] (CPU path) */
    int32_t *idx;               /* [rows_cap*K] topk_idx kept from prepare (CPU path) */
#ifdef MOERT_HAVE_CUDA
    hybridep_cuda_state cu;
#endif
} hybridep_ctx;

static void report_metric(const hybridep_ctx *c, const char *name, double value, const char *unit)
{
    const moert_host *h = c->host;
    if (h->struct_size >= offsetof(moert_host, metric) + sizeof h->metric && h->metric) h->metric(h, name, value, unit);
}

/* Sets the message and returns code. */
static moert_result fail(const hybridep_ctx *c, moert_result code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static moert_result fail(const hybridep_ctx *c, moert_result code, const char *fmt, ...)
{
    char text[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    c->host->set_error(c->host, "%s", text);
    return code;
}

static moert_result check_tensor(const hybridep_ctx *c, const char *call, const char *name, const moert_tensor *t,
                                 int ndim, int64_t rows, bool rows_at_least, int64_t cols, const char *rows_what,
                                 int need_dtype)
{
    return moert_arg_check_tensor(c->host, c->layer.device, call, name, t, ndim, rows, rows_at_least, cols,
                                  rows_what, need_dtype);
}

/* Marks the instance broken: the ranks' sequence numbers no longer agree. */
static moert_result mark_broken(hybridep_ctx *c, moert_result code, const char *call, const char *why)
{
    c->broken = code;
    snprintf(c->broken_msg, sizeof c->broken_msg, "%s on rank %d: %s; this dispatcher instance cannot be used again",
             call, c->rank, why);
    return fail(c, code, "%s", c->broken_msg);
}

/* The next call's sequence number (the CPU path's; the CUDA kernels keep theirs on the device, alike in eager use). */
static int64_t next_seq(hybridep_ctx *c)
{
    return ++c->seq;
}

#ifdef MOERT_HAVE_CUDA
static moert_result cuda_check_status(hybridep_ctx *c);
#endif

/* What every call after prepare() checks first. */
static moert_result check_call(hybridep_ctx *c, const char *call, const void *args, uint32_t struct_size,
                               size_t expected_size, bool needs_dispatch)
{
#ifdef MOERT_HAVE_CUDA
    if (c->on_cuda && c->broken == MOERT_OK) {
        moert_result rc = cuda_check_status(c);
        if (rc != MOERT_OK) return rc;
    }
#endif
    if (c->broken != MOERT_OK) return fail(c, c->broken, "%s: %s", call, c->broken_msg);
    if (!c->prepared) return fail(c, MOERT_ERR_INVALID_ARGUMENT, "%s: called before a successful prepare()", call);
    if (needs_dispatch && !c->dispatched)
        return fail(c, MOERT_ERR_INVALID_ARGUMENT, "%s: called before dispatch() or combine_backward() of this step "
                    "(the rows to combine are known from the dispatch)", call);
    if (!args) return fail(c, MOERT_ERR_INVALID_ARGUMENT, "%s: args is NULL", call);
    return moert_arg_check_struct_size(c->host, call, "args", struct_size, expected_size);
}

/* ---- the peer buffer ---- */

/* Bytes per buffer row: rows of the layer's dtype on CUDA, of any dtype (8 bytes) on the CPU. */
static size_t buffer_row_bytes(const hybridep_ctx *c)
{
    size_t es = c->on_cuda ? moert_dtype_size(c->layer.dtype) : 8;
    return (size_t)c->layer.hidden * es;
}

/* Frees this rank's buffer once every peer has stopped writing into it (its release stamp of the last call is the
 * last thing a peer writes here); a peer that does not within timeout_ms is logged and the buffer freed anyway. */
static void buffer_release(hybridep_ctx *c)
{
    if (c->buf && c->seq > 0 && c->broken == MOERT_OK) {
        int late = -1;
#ifdef MOERT_HAVE_CUDA
        if (c->on_cuda) late = hybridep_cuda_wait_released(c->buf, c->world, c->cu.seq_dev, c->timeout_ms);
        else
#endif
            late = hybridep_cpu_wait_released(c->buf, c->world, c->seq, c->timeout_ms);
        if (late >= 0)
            c->host->log(c->host, MOERT_LOG_WARN, "rank %d did not release this rank's rows of call %lld within %lld "
                         "ms; freeing the buffer anyway", late, (long long)c->seq, (long long)c->timeout_ms);
    }
    if (c->buf) c->host->free(c->host, c->layer.device, c->buf);
    c->buf = NULL;
    c->buf_bytes = 0;
}

/* Collective (init only): allocates this rank's buffer for rows_cap rows per source, zeroes its flags, and exchanges
 * the pointers with every rank. */
static moert_result buffer_setup(hybridep_ctx *c, int64_t rows_cap)
{
    const moert_host *h = c->host;
    size_t bytes = hybridep_geometry_make(&c->geo, c->world, c->layer.topk, c->layer.num_experts, rows_cap,
                                          buffer_row_bytes(c));
    moert_result rc = h->alloc(h, c->layer.device, bytes, &c->buf);
    if (rc == MOERT_ERR_UNSUPPORTED && c->on_cuda) {
        char dev[32];
        return fail(c, rc, "the host serving this instance cannot allocate on %s (a CPU-only host): only a CPU path "
                    "can run here", moert_arg_device_text(c->layer.device, dev, sizeof dev));
    }
    if (rc != MOERT_OK) return rc;
    c->buf_bytes = bytes;
#ifdef MOERT_HAVE_CUDA
    if (c->on_cuda) {
        rc = hybridep_cuda_zero(h, c->buf, c->geo.header_bytes);
        if (rc != MOERT_OK) return rc;
    }
#endif
    c->seq = 0;
    if (c->world == 1) {
        c->peers[0] = c->buf;
        return MOERT_OK;
    }
    return h->exchange_peer_buffers(h, c->buf, bytes, c->layer.device, c->peers);
}

/* ---- init and finalize ---- */

static void hybridep_finalize(void *ctx);

#ifdef MOERT_HAVE_CUDA
static moert_result cuda_init(hybridep_ctx *c);
static void cuda_finalize(hybridep_ctx *c);
#endif

/* Reads the options into c; MOERT_ERR_CONFIG with the message set on a bad one. */
static moert_result read_options(hybridep_ctx *c)
{
    const moert_host *host = c->host;
    static const char *const modes[] = {"auto", "on", "off", NULL};
    static const char *const copies[] = {"tma", "vector", NULL};
    static const char *const flags[] = {"last_block", "per_block", NULL};
    static const char *const fences[] = {"thread", "block", NULL};
    moert_result rc = host->option_int(host, "num_sms", 0, 0, HYBRIDEP_MAX_CHANNELS,
                                       "SMs (thread blocks, every one sending) of the NVLink phase of each call; 0: 16, "
                                       "or every SM in low-latency mode (one kernel per call, at most every SM); the "
                                       "local kernels around the NVLink phase use every SM; the CPU path ignores it",
                                       &c->num_sms);
    if (rc == MOERT_OK)
        rc = host->option_int(host, "timeout_ms", 60000, 10, 3600000,
                              "bound of every wait for a peer's rows or flags; a stalled peer is named in the error",
                              &c->timeout_ms);
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
                               "memory, or \"vector\" 16-byte loads and stores by warps", &c->copy);
    if (rc == MOERT_OK)
        rc = host->option_int(host, "ll_threads", 512, 512, 1024,
                              "low-latency CUDA kernels: threads per block, 512 or 1024 (16 or 32 warps)",
                              &c->ll_threads);
    if (rc == MOERT_OK && c->ll_threads != 512 && c->ll_threads != 1024) {
        host->set_error(host, "option ll_threads: %lld, expected 512 or 1024", (long long)c->ll_threads);
        rc = MOERT_ERR_CONFIG;
    }
    if (rc == MOERT_OK)
        rc = host->option_int(host, "ll_piece", 1024, 512, 8192,
                              "low-latency CUDA kernels: bytes of a row piece (a warp's item), a multiple of 512",
                              &c->ll_piece);
    if (rc == MOERT_OK && c->ll_piece % 512 != 0) {
        host->set_error(host, "option ll_piece: %lld, expected a multiple of 512", (long long)c->ll_piece);
        rc = MOERT_ERR_CONFIG;
    }
    if (rc == MOERT_OK)
        rc = host->option_enum(host, "ll_flag", flags, 0,
                               "low-latency CUDA kernels: how a source flags its rows: \"last_block\" (the last "
                               "sending block stores one flag per destination) or \"per_block\" (every block adds "
                               "to a count at every destination)", &c->ll_flag);
    if (rc == MOERT_OK)
        rc = host->option_enum(host, "ll_fence", fences, 1,
                               "low-latency CUDA kernels: after the block barrier, only the publishing threads fence "
                               "(\"block\") or, before the flag, every thread fences (\"thread\")", &c->ll_fence);
    return rc;
}

static moert_result hybridep_init(void **out, const moert_host *host, const moert_layer_info *layer)
{
    *out = NULL;
    moert_result check = moert_arg_check_dispatch_layer(host, layer, "hybridep", HYBRIDEP_MAX_RANKS);
    if (check != MOERT_OK) return check;

    hybridep_ctx *c = calloc(1, sizeof *c);
    if (!c) {
        host->set_error(host, "out of memory for the dispatcher state");
        return MOERT_ERR_OUT_OF_MEMORY;
    }
    c->host = host;
    c->layer = *layer;
    c->world = host->world_size;
    c->rank = host->rank;
    c->on_cuda = layer->device.type == MOERT_DEVICE_CUDA;
    moert_result rc = read_options(c);
    if (rc != MOERT_OK) {
        free(c);
        return rc;
    }

    /* every rank's slot holds the largest max_tokens of the group (collective, as the exchange is); the mode and the
     * capacity follow from it, so every rank decides them alike */
    int64_t rows_cap = layer->max_tokens > 0 ? layer->max_tokens : 1;
    if (c->world > 1) {
        int64_t gathered[HYBRIDEP_MAX_RANKS];
        rc = host->allgather(host, &rows_cap, gathered, sizeof(int64_t), moert_cpu(), NULL);
        if (rc != MOERT_OK) {
            free(c);
            return rc;
        }
        for (int r = 0; r < c->world; r++)
            if (gathered[r] > rows_cap) rows_cap = gathered[r];
    }
    c->low_latency = c->low_latency_mode == 1 || (c->low_latency_mode == 0 && rows_cap <= c->low_latency_tokens);
    c->channels = c->num_sms > 0 ? c->num_sms : 16; /* 0: 16, or every SM in low-latency mode (cuda_init) */

    const int64_t E = layer->num_experts, W = c->world, K = layer->topk, El = layer->num_local_experts;
    c->capacity = rows_cap * W * (K < El ? K : El);
    hybridep_plan *p = &c->plan;
    p->world = c->world;
    p->rank = c->rank;
    p->num_experts = E;
    p->num_local_experts = El;
    p->topk = K;
    if (!c->on_cuda) {
        p->counts = calloc((size_t)E, sizeof(int64_t));
        p->tokens_to = calloc((size_t)W, sizeof(int64_t));
        p->all_counts = calloc((size_t)(W * E), sizeof(int64_t));
        p->tokens_per_expert = calloc((size_t)El, sizeof(int64_t));
        p->base = calloc((size_t)E, sizeof(int64_t));
        p->copy_index = calloc((size_t)(rows_cap * K), sizeof(int64_t));
        p->excl = calloc((size_t)(W * (rows_cap + 1)), sizeof(int64_t));
        c->notify_row = calloc((size_t)(E + HYBRIDEP_NOTIFY_EXTRA), sizeof(int64_t));
        c->notify_rows = calloc((size_t)(W * (E + HYBRIDEP_NOTIFY_EXTRA)), sizeof(int64_t));
        c->recv_meta = calloc((size_t)(W * rows_cap * K), sizeof(int64_t));
        c->idx = calloc((size_t)(rows_cap * K), sizeof(int32_t));
        if (!p->counts || !p->tokens_to || !p->all_counts || !p->tokens_per_expert || !p->base || !p->copy_index ||
            !p->excl || !c->notify_row || !c->notify_rows || !c->recv_meta || !c->idx) {
            hybridep_finalize(c);
            host->set_error(host, "out of memory for the dispatcher state (max_tokens %lld)", (long long)rows_cap);
            return MOERT_ERR_OUT_OF_MEMORY;
        }
    }
    rc = buffer_setup(c, rows_cap);
#ifdef MOERT_HAVE_CUDA
    if (rc == MOERT_OK && c->on_cuda) rc = cuda_init(c);
#endif
    if (rc != MOERT_OK) {
        hybridep_finalize(c);
        return rc;
    }
    /* CUDA: no host sync, no allocation, no host state a replay would repeat wrongly (the kernels number their calls
     * on the device): a step can be captured in a CUDA graph. The ABI 1.1 member may be missing on an older host. */
    if (c->on_cuda && host->struct_size >= offsetof(moert_host, set_flags) + sizeof host->set_flags &&
        host->set_flags)
        host->set_flags(host, MOERT_CAP_GRAPH_CAPTURABLE);
    host->log(host, MOERT_LOG_INFO, "hybridep: rows_cap %lld, capacity %lld, %s mode, %lld channels",
              (long long)rows_cap, (long long)c->capacity, c->low_latency ? "low-latency" : "normal",
              (long long)c->channels);
    *out = c;
    return MOERT_OK;
}

static void hybridep_finalize(void *ctx)
{
    hybridep_ctx *c = ctx;
    if (!c) return;
    buffer_release(c);
#ifdef MOERT_HAVE_CUDA
    if (c->on_cuda) cuda_finalize(c);
#endif
    free(c->plan.counts);
    free(c->plan.tokens_to);
    free(c->plan.all_counts);
    free(c->plan.tokens_per_expert);
    free(c->plan.base);
    free(c->plan.copy_index);
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
    const char *call = "prepare()";
    char a[64];
    if (!topk_idx) return fail(c, MOERT_ERR_INVALID_ARGUMENT, "%s: topk_idx is NULL", call);
    if (topk_idx->ndim != 2 || topk_idx->shape[1] != c->layer.topk)
        return fail(c, MOERT_ERR_INVALID_ARGUMENT, "%s: topk_idx has shape %s, expected [T, %lld] (T tokens, topk)",
                    call, moert_arg_shape_text(topk_idx, a, sizeof a), (long long)c->layer.topk);
    moert_result rc = check_tensor(c, call, "topk_idx", topk_idx, 2, topk_idx->shape[0], false, c->layer.topk,
                                   "T tokens, topk", MOERT_I32);
    if (rc != MOERT_OK) return rc;
    if (topk_idx->shape[0] > c->geo.rows_cap)
        return fail(c, MOERT_ERR_INVALID_ARGUMENT, "%s: topk_idx has %lld tokens, more than the %lld rows the buffers "
                    "were sized for at init (the largest max_tokens of the group; no step may exceed it, the buffers "
                    "never grow: that would need a host sync)", call, (long long)topk_idx->shape[0],
                    (long long)c->geo.rows_cap);
    return MOERT_OK;
}

/* The CPU path's prepare: layout, notify through the buffers (every rank takes part even after a local failure, so
 * all fail together), plan. */
static moert_result cpu_prepare(hybridep_ctx *c, const moert_tensor *topk_idx, moert_result local_rc)
{
    const int64_t E = c->layer.num_experts, K = c->layer.topk, W = c->world, n = E + HYBRIDEP_NOTIFY_EXTRA;
    hybridep_plan *p = &c->plan;
    int64_t bad = -1;
    memset(c->notify_row, 0, (size_t)n * sizeof(int64_t));
    if (local_rc == MOERT_OK) {
        p->num_tokens = topk_idx->shape[0];
        bad = hybridep_layout(p, topk_idx->data);
        if (bad >= 0)
            local_rc = fail(c, MOERT_ERR_INVALID_ARGUMENT,
                            "prepare(): topk_idx[%lld][%lld] is %d, expected an expert id in [0, %lld) or -1 (dropped)",
                            (long long)(bad / K), (long long)(bad % K), (int)((const int32_t *)topk_idx->data)[bad],
                            (long long)E);
        else memcpy(c->notify_row, p->counts, (size_t)E * sizeof(int64_t));
    }
    c->notify_row[E + HYBRIDEP_NOTIFY_STATUS] = local_rc != MOERT_OK;
    c->notify_row[E + HYBRIDEP_NOTIFY_CHANNELS] = c->channels;
    c->notify_row[E + HYBRIDEP_NOTIFY_TOKENS] = local_rc == MOERT_OK ? p->num_tokens : 0;
    for (int d = 0; d < W && local_rc == MOERT_OK; d++)
        c->notify_row[E + HYBRIDEP_NOTIFY_TOKENS_TO + d] = p->tokens_to[d];

    char why[256] = "";
    hybridep_cpu_link l = {.geo = &c->geo, .local = c->buf, .peers = c->peers, .seq = next_seq(c),
                           .timeout_ms = c->timeout_ms, .recv_meta = c->recv_meta, .recv_rows = c->recv_rows,
                           .error = why, .error_size = sizeof why};
    int r = hybridep_cpu_notify(&l, c->notify_row, c->notify_rows);
    if (r > 0) return mark_broken(c, MOERT_ERR_TIMEOUT, "prepare()", why);
    if (local_rc != MOERT_OK) return local_rc;
    for (int s = 0; s < W; s++) {
        const int64_t *row = c->notify_rows + s * n;
        if (row[E + HYBRIDEP_NOTIFY_STATUS] != 0)
            return fail(c, MOERT_ERR_INVALID_ARGUMENT,
                        "prepare(): rank %d failed its prepare() (see its error), so this step cannot dispatch", s);
        if (row[E + HYBRIDEP_NOTIFY_CHANNELS] != c->channels)
            return fail(c, MOERT_ERR_CONFIG, "prepare(): rank %d uses %lld channels (num_sms %lld), this rank %lld: "
                        "every rank needs the same num_sms", s, (long long)row[E + HYBRIDEP_NOTIFY_CHANNELS],
                        (long long)row[E + HYBRIDEP_NOTIFY_CHANNELS], (long long)c->channels);
        memcpy(p->all_counts + s * E, row, (size_t)E * sizeof(int64_t));
    }
    hybridep_plan_sizes(p);
    memcpy(c->idx, topk_idx->data, (size_t)(p->num_tokens * K) * sizeof(int32_t));
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
    const int64_t El = c->layer.num_local_experts;
    c->prepared = false;
    c->dispatched = false;
#ifdef MOERT_HAVE_CUDA
    if (c->on_cuda && c->broken == MOERT_OK) {
        moert_result rc = cuda_check_status(c);
        if (rc != MOERT_OK) return rc;
    }
#endif
    if (c->broken != MOERT_OK) return fail(c, c->broken, "prepare(): %s", c->broken_msg);
    moert_result local_rc = MOERT_OK;
    if (!layout) local_rc = fail(c, MOERT_ERR_INVALID_ARGUMENT, "prepare(): layout is NULL");
    else local_rc = moert_arg_check_struct_size(c->host, "prepare()", "layout", layout->struct_size, sizeof *layout);
    if (local_rc == MOERT_OK) local_rc = check_topk_idx(c, topk_idx);
    void *counts = c->plan.tokens_per_expert;
    moert_result rc;
#ifdef MOERT_HAVE_CUDA
    if (c->on_cuda) {
        if (local_rc != MOERT_OK) return local_rc; /* the peers' notify waits name this rank when they run out */
        rc = cuda_prepare(c, stream, topk_idx);
        counts = c->cu.tokens_per_expert;
    } else
#endif
        rc = cpu_prepare(c, topk_idx, local_rc);
    if (rc != MOERT_OK) return rc;
    layout->num_recv = c->on_cuda ? -1 : c->plan.num_recv;
    layout->capacity = c->capacity;
    layout->tokens_per_expert = moert_tensor_1d(counts, c->layer.device, MOERT_I64, El);
    layout->tokens_per_expert_host = NULL;
    c->prepared = true;
    if (!c->on_cuda) report_metric(c, "dispatch.recv_tokens", (double)c->plan.num_recv, "tokens");
    return MOERT_OK;
}

/* ---- the CPU path's calls ---- */

static hybridep_cpu_link cpu_link(hybridep_ctx *c, int64_t seq, char *error, size_t error_size)
{
    hybridep_cpu_link l = {.geo = &c->geo, .local = c->buf, .peers = c->peers, .seq = seq,
                           .timeout_ms = c->timeout_ms, .recv_meta = c->recv_meta, .recv_rows = c->recv_rows,
                           .error = error, .error_size = error_size};
    return l;
}

static moert_result cpu_dispatch_like(hybridep_ctx *c, const char *call, const moert_tensor *x,
                                      const moert_tensor *probs, moert_tensor *out, moert_tensor *out_probs)
{
    char why[256] = "";
    hybridep_cpu_link l = cpu_link(c, next_seq(c), why, sizeof why);
    int r = hybridep_cpu_dispatch(&l, &c->plan, c->layer.hidden, c->idx, x->data, x->dtype,
                                  probs ? probs->data : NULL, probs ? probs->dtype : MOERT_F64, out->data,
                                  out_probs ? out_probs->data : NULL, out_probs ? out_probs->dtype : MOERT_F64);
    if (r > 0) return mark_broken(c, MOERT_ERR_TIMEOUT, call, why);
    c->dispatched = true;
    return MOERT_OK;
}

static moert_result cpu_combine_like(hybridep_ctx *c, const char *call, const moert_tensor *rows,
                                     const moert_tensor *row_probs, moert_tensor *out, bool accumulate,
                                     moert_tensor *out_probs)
{
    char why[256] = "";
    hybridep_cpu_link l = cpu_link(c, next_seq(c), why, sizeof why);
    int r = hybridep_cpu_combine(&l, &c->plan, c->layer.hidden, c->idx, rows->data, rows->dtype,
                                 row_probs ? row_probs->data : NULL, row_probs ? row_probs->dtype : MOERT_F64,
                                 out->data, out->dtype, accumulate, out_probs ? out_probs->data : NULL,
                                 out_probs ? out_probs->dtype : MOERT_F64);
    if (r > 0) return mark_broken(c, MOERT_ERR_TIMEOUT, call, why);
    if (r < 0) return fail(c, MOERT_ERR_OUT_OF_MEMORY, "%s: %s", call, why);
    return MOERT_OK;
}

#ifdef MOERT_HAVE_CUDA
/* ---- the CUDA path ---- */

static moert_result cuda_init(hybridep_ctx *c)
{
    const moert_host *h = c->host;
    const int64_t E = c->layer.num_experts, El = c->layer.num_local_experts, K = c->layer.topk, W = c->world;
    const int64_t R = c->geo.rows_cap;
    const int id = (int)c->layer.device.id;
    char dev[32];
    moert_arg_device_text(c->layer.device, dev, sizeof dev);
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) {
        (void)cudaGetLastError();
        count = 0;
    }
    if (id < 0 || id >= count)
        return fail(c, MOERT_ERR_UNSUPPORTED, "the layer is on %s, but this process sees %d CUDA device%s: only a "
                    "CPU path can run here", dev, count, count == 1 ? "" : "s");
    if (E > 1024)
        return fail(c, MOERT_ERR_UNSUPPORTED, "the hybridep dispatcher's CUDA path takes at most 1024 experts, the "
                    "layer has %lld", (long long)E);
    if (K > 32)
        return fail(c, MOERT_ERR_UNSUPPORTED, "the hybridep dispatcher's CUDA path takes topk <= 32 (a warp's lanes), "
                    "the layer has %lld", (long long)K);
    if (c->layer.dtype != MOERT_BF16 && c->layer.dtype != MOERT_F32)
        return fail(c, MOERT_ERR_UNSUPPORTED, "the hybridep dispatcher's CUDA path moves bf16 or fp32 rows, the layer "
                    "is %s", moert_dtype_name(c->layer.dtype));
    if (R * K > INT32_MAX / 2 || c->capacity > INT32_MAX)
        return fail(c, MOERT_ERR_UNSUPPORTED, "the hybridep dispatcher's CUDA path takes fewer than 2^31 rows (max_tokens "
                    "%lld, capacity %lld)", (long long)R, (long long)c->capacity);
    hybridep_cuda_state *cu = &c->cu;
    moert_result rc = hybridep_cuda_sm_count(h, id, &cu->sms);
    if (rc != MOERT_OK) return rc;
    /* low-latency mode: one block per SM at most (its kernels need every block resident); 0: every SM */
    if (c->low_latency && (c->num_sms == 0 || c->channels > cu->sms))
        c->channels = cu->sms > HYBRIDEP_MAX_CHANNELS ? HYBRIDEP_MAX_CHANNELS : cu->sms;
    cu->tma = !c->low_latency && c->copy == 0;
    /* one block: int32 topk_idx, copy_index [R*K], excl [W][R+1], recv_meta [W][R][K]; int64 base [E],
     * tokens_per_expert [El], recv_tokens [W]; the status words and the block counter */
    size_t off = 0, o_idx, o_ci, o_excl, o_meta, o_base, o_tpe, o_recv, o_status;
#define TAKE(o, bytes) (o = off, off = hybridep_round_up(off + (size_t)(bytes), 256))
    TAKE(o_idx, R * K * 4);
    TAKE(o_ci, R * K * 4);
    TAKE(o_excl, W * (R + 1) * 4);
    TAKE(o_meta, W * R * K * 4);
    TAKE(o_base, E * 8);
    TAKE(o_tpe, El * 8);
    TAKE(o_recv, W * 8);
    TAKE(o_status, 64);
#undef TAKE
    rc = h->alloc(h, c->layer.device, off, &cu->arrays);
    if (rc == MOERT_ERR_UNSUPPORTED)
        return fail(c, rc, "the host serving this instance cannot allocate on %s (a CPU-only host): only a CPU path "
                    "can run here", dev);
    if (rc != MOERT_OK) return rc;
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
    rc = hybridep_cuda_zero(h, cu->arrays, off);
    /* normal mode: the combine partials for the other ranks wait here for the NVLink phase (worst case: every token
     * of every other rank) */
    if (rc == MOERT_OK && !c->low_latency && W > 1)
        rc = h->alloc(h, c->layer.device, (size_t)(W - 1) * (size_t)R * c->geo.row_stride, &cu->staging);
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
    if (cu->arrays) c->host->free(c->host, c->layer.device, cu->arrays);
    if (cu->staging) c->host->free(c->host, c->layer.device, cu->staging);
    cu->staging = NULL;
    if (cu->pinned) c->host->free_pinned(c->host, cu->pinned);
    cu->arrays = NULL;
    cu->pinned = NULL;
}

/* Reads the status word the kernels mirror into pinned host memory (no sync): a failure of an earlier call (a stalled
 * peer, bad expert ids, a channel-count mismatch) is reported here, naming the call it happened in. */
static moert_result cuda_check_status(hybridep_ctx *c)
{
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
    case HYBRIDEP_WAIT_ARRIVAL:
        snprintf(why, sizeof why, "rank %d did not deliver its rows within %lld ms (timeout_ms)", peer,
                 (long long)c->timeout_ms);
        break;
    case HYBRIDEP_WAIT_CONSUMED:
        snprintf(why, sizeof why, "rank %d did not read the rows of the previous call within %lld ms (timeout_ms)",
                 peer, (long long)c->timeout_ms);
        break;
    case HYBRIDEP_WAIT_NOTIFY:
        snprintf(why, sizeof why, "rank %d did not send its counts within %lld ms (timeout_ms)", peer,
                 (long long)c->timeout_ms);
        break;
    case HYBRIDEP_BAD_IDS:
        code = MOERT_ERR_INVALID_ARGUMENT;
        snprintf(why, sizeof why, "rank %d's topk_idx had expert ids outside [0, %lld) and not -1 (dropped); they "
                 "were treated as dropped in that step", peer, (long long)c->layer.num_experts);
        break;
    case HYBRIDEP_CHANNELS:
        code = MOERT_ERR_CONFIG;
        snprintf(why, sizeof why, "rank %d uses another channel count than this rank's %lld: every rank needs the "
                 "same num_sms", peer, (long long)c->channels);
        break;
    default:
        code = MOERT_ERR_INTERNAL;
        snprintf(why, sizeof why, "unknown failure word 0x%llx", word);
    }
    char call[64];
    snprintf(call, sizeof call, "%s (call %lld)", call_id <= HYBRIDEP_CALL_DISPATCH_BACKWARD ? names[call_id] : "?",
             (long long)seq);
    return mark_broken(c, code, call, why);
}

/* The kernels' view of this step and of a call (HYBRIDEP_CALL_*); its sequence number lives on the device. */
static hybridep_cuda_call cuda_call(hybridep_ctx *c, int call)
{
    hybridep_cuda_state *cu = &c->cu;
    hybridep_cuda_call k;
    memset(&k, 0, sizeof k);
    k.geo = c->geo;
    k.local = c->buf;
    for (int r = 0; r < c->world; r++) k.peers[r] = c->peers[r];
    k.rank = c->rank;
    k.channels = (int)c->channels;
    k.sms = cu->sms;
    k.tma = cu->tma;
    k.low_latency = c->low_latency;
    k.call = call;
    k.ll_threads = (int)c->ll_threads;
    k.ll_flag = c->ll_flag;
    k.ll_fence = c->ll_fence;
    k.piece = c->ll_piece / 16;
    k.timeout_ns = c->timeout_ms * 1000000;
    k.tokens = c->plan.num_tokens;
    k.topk = c->layer.topk;
    k.hidden = c->layer.hidden;
    k.num_experts = c->layer.num_experts;
    k.local_experts = c->layer.num_local_experts;
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
    hybridep_cuda_call k = cuda_call(c, HYBRIDEP_CALL_PREPARE);
    return hybridep_cuda_prepare(c->host, (cudaStream_t)stream, &k, topk_idx->data);
}

/* Row tensors on CUDA: the layer's dtype; probs fp32. */
static moert_result cuda_check_dtype(const hybridep_ctx *c, const char *call, const char *name, const moert_tensor *t,
                                     moert_dtype want)
{
    if (!t || t->dtype == want) return MOERT_OK;
    return fail(c, MOERT_ERR_UNSUPPORTED, "%s: %s has dtype %s; the CUDA path takes %s here", call, name,
                moert_dtype_name(t->dtype), moert_dtype_name(want));
}

static moert_result cuda_dispatch_like(hybridep_ctx *c, moert_stream stream, const char *call, int call_id,
                                       const moert_tensor *x,
                                       const moert_tensor *probs, moert_tensor *out, moert_tensor *out_probs)
{
    moert_result rc = cuda_check_dtype(c, call, "rows", x, c->layer.dtype);
    if (rc == MOERT_OK) rc = cuda_check_dtype(c, call, "probs", probs, MOERT_F32);
    if (rc == MOERT_OK) rc = cuda_check_dtype(c, call, "probs out", out_probs, MOERT_F32);
    if (rc != MOERT_OK) return rc;
    next_seq(c);
    hybridep_cuda_call k = cuda_call(c, call_id);
    rc = hybridep_cuda_dispatch(c->host, (cudaStream_t)stream, &k, x->dtype, x->data, probs ? probs->data : NULL,
                                out->data, out_probs ? out_probs->data : NULL);
    if (rc == MOERT_OK) c->dispatched = true;
    return rc;
}

static moert_result cuda_combine_like(hybridep_ctx *c, moert_stream stream, const char *call, int call_id,
                                      const moert_tensor *rows,
                                      const moert_tensor *row_probs, moert_tensor *out, bool accumulate,
                                      moert_tensor *out_probs)
{
    moert_result rc = cuda_check_dtype(c, call, "rows", rows, c->layer.dtype);
    if (rc == MOERT_OK) rc = cuda_check_dtype(c, call, "out", out, c->layer.dtype);
    if (rc == MOERT_OK) rc = cuda_check_dtype(c, call, "row probs", row_probs, MOERT_F32);
    if (rc == MOERT_OK) rc = cuda_check_dtype(c, call, "probs out", out_probs, MOERT_F32);
    if (rc != MOERT_OK) return rc;
    next_seq(c);
    hybridep_cuda_call k = cuda_call(c, call_id);
    return hybridep_cuda_combine(c->host, (cudaStream_t)stream, &k, rows->dtype, rows->data,
                                 row_probs ? row_probs->data : NULL, out->data, accumulate,
                                 out_probs ? out_probs->data : NULL);
}
#endif

/* ---- the calls ---- */

/* Each token once to every rank holding one of its experts, written there into its copies' expert-grouped rows. */
static moert_result hybridep_dispatch(void *ctx, moert_stream stream, const moert_dispatch_args *args)
{
    hybridep_ctx *c = ctx;
    const char *call = "dispatch()";
    const int64_t H = c->layer.hidden, T = c->plan.num_tokens, K = c->layer.topk;
    moert_result rc = check_call(c, call, args, args ? args->struct_size : 0, sizeof *args, false);
    if (rc == MOERT_OK) rc = check_tensor(c, call, "x", args->x, 2, T, false, H, "T from prepare(), hidden", -1);
    if (rc == MOERT_OK)
        rc = check_tensor(c, call, "recv_x", args->recv_x, 2, c->capacity, true, H, "capacity from prepare(), hidden",
                          args->x->dtype);
    if (rc == MOERT_OK && (args->topk_probs == NULL) != (args->recv_probs == NULL))
        rc = fail(c, MOERT_ERR_INVALID_ARGUMENT, "%s: topk_probs and recv_probs must be given together (or both NULL)",
                  call);
    if (rc == MOERT_OK && args->topk_probs)
        rc = check_tensor(c, call, "topk_probs", args->topk_probs, 2, T, false, K, "T from prepare(), topk", -1);
    if (rc == MOERT_OK && args->recv_probs)
        rc = check_tensor(c, call, "recv_probs", args->recv_probs, 1, c->capacity, true, 0, "capacity from prepare()",
                          -1);
    if (rc != MOERT_OK) return rc;
#ifdef MOERT_HAVE_CUDA
    if (c->on_cuda)
        return cuda_dispatch_like(c, stream, call, HYBRIDEP_CALL_DISPATCH, args->x, args->topk_probs, args->recv_x,
                                  args->recv_probs);
#endif
    (void)stream;
    rc = cpu_dispatch_like(c, call, args->x, args->topk_probs, args->recv_x, args->recv_probs);
    if (rc != MOERT_OK) return rc;
    double sent = 0;
    for (int d = 0; d < c->world; d++)
        if (d != c->rank)
            sent += (double)c->plan.tokens_to[d] * (double)((size_t)H * moert_dtype_size(args->x->dtype) + c->geo.meta_stride);
    report_metric(c, "dispatch.bytes_sent", sent, "bytes");
    return MOERT_OK;
}

/* Each expert rank sums its copies of a token into one partial row, sends it back; the token's rank sums the
 * partials in rank order (fp32; fp64 for fp64 rows) straight into y[t]. */
static moert_result hybridep_combine(void *ctx, moert_stream stream, const moert_combine_args *args)
{
    hybridep_ctx *c = ctx;
    const char *call = "combine()";
    const int64_t H = c->layer.hidden;
    moert_result rc = check_call(c, call, args, args ? args->struct_size : 0, sizeof *args, true);
    if (rc == MOERT_OK)
        rc = check_tensor(c, call, "y_expert", args->y_expert, 2, c->capacity, true, H,
                          "capacity from prepare(), hidden", -1);
    if (rc == MOERT_OK)
        rc = check_tensor(c, call, "y", args->y, 2, c->plan.num_tokens, false, H, "T from prepare(), hidden", -1);
    if (rc != MOERT_OK) return rc;
#ifdef MOERT_HAVE_CUDA
    if (c->on_cuda)
        return cuda_combine_like(c, stream, call, HYBRIDEP_CALL_COMBINE, args->y_expert, NULL, args->y, false, NULL);
#endif
    return cpu_combine_like(c, call, args->y_expert, NULL, args->y, false, NULL);
}

/* The adjoint of combine: a dispatch of d_y's rows without probs. */
static moert_result hybridep_combine_backward(void *ctx, moert_stream stream, const moert_combine_backward_args *args)
{
    hybridep_ctx *c = ctx;
    const char *call = "combine_backward()";
    const int64_t H = c->layer.hidden;
    moert_result rc = check_call(c, call, args, args ? args->struct_size : 0, sizeof *args, false);
    if (rc == MOERT_OK)
        rc = check_tensor(c, call, "d_y", args->d_y, 2, c->plan.num_tokens, false, H, "T from prepare(), hidden", -1);
    if (rc == MOERT_OK)
        rc = check_tensor(c, call, "d_y_expert", args->d_y_expert, 2, c->capacity, true, H,
                          "capacity from prepare(), hidden", args->d_y->dtype);
    if (rc != MOERT_OK) return rc;
#ifdef MOERT_HAVE_CUDA
    if (c->on_cuda)
        return cuda_dispatch_like(c, stream, call, HYBRIDEP_CALL_COMBINE_BACKWARD, args->d_y, NULL, args->d_y_expert,
                                  NULL);
#endif
    return cpu_dispatch_like(c, call, args->d_y, NULL, args->d_y_expert, NULL);
}

/* The adjoint of dispatch: a combine of d_recv_x added into d_x, and each row's prob gradient to its (t, k) slot. */
static moert_result hybridep_dispatch_backward(void *ctx, moert_stream stream, const moert_dispatch_backward_args *args)
{
    hybridep_ctx *c = ctx;
    const char *call = "dispatch_backward()";
    const int64_t H = c->layer.hidden, T = c->plan.num_tokens, K = c->layer.topk;
    moert_result rc = check_call(c, call, args, args ? args->struct_size : 0, sizeof *args, true);
    if (rc == MOERT_OK)
        rc = check_tensor(c, call, "d_recv_x", args->d_recv_x, 2, c->capacity, true, H,
                          "capacity from prepare(), hidden", -1);
    if (rc == MOERT_OK) rc = check_tensor(c, call, "d_x", args->d_x, 2, T, false, H, "T from prepare(), hidden", -1);
    if (rc == MOERT_OK && (args->d_recv_probs == NULL) != (args->d_topk_probs == NULL))
        rc = fail(c, MOERT_ERR_INVALID_ARGUMENT,
                  "%s: d_recv_probs and d_topk_probs must be given together (or both NULL)", call);
    if (rc == MOERT_OK && args->d_recv_probs)
        rc = check_tensor(c, call, "d_recv_probs", args->d_recv_probs, 1, c->capacity, true, 0,
                          "capacity from prepare()", -1);
    if (rc == MOERT_OK && args->d_topk_probs)
        rc = check_tensor(c, call, "d_topk_probs", args->d_topk_probs, 2, T, false, K, "T from prepare(), topk", -1);
    if (rc != MOERT_OK) return rc;
#ifdef MOERT_HAVE_CUDA
    if (c->on_cuda)
        return cuda_combine_like(c, stream, call, HYBRIDEP_CALL_DISPATCH_BACKWARD, args->d_recv_x, args->d_recv_probs,
                                 args->d_x, true, args->d_topk_probs);
#endif
    return cpu_combine_like(c, call, args->d_recv_x, args->d_recv_probs, args->d_x, true, args->d_topk_probs);
}

MOERT_PLUGIN_EXPORT const moert_dispatcher_v1 hybridep_vtable __asm__(MOERT_DISPATCHER_V1_SYMBOL) = {
    .header = {
        .abi_version = MOERT_ABI_CURRENT,
        .struct_size = sizeof(moert_dispatcher_v1),
        .kind = MOERT_KIND_DISPATCHER,
        .name = "hybridep",
        .version = "0.1.0",
        .description = "NVLink dispatcher in the spirit of HybridEP: TMA bulk copies into peers' buffers, permutation "
                       "fused into dispatch, worst-case buffers, no host sync in a step; low-latency mode",
#ifdef MOERT_HAVE_CUDA
        .devices = MOERT_CAP_DEVICE(MOERT_DEVICE_CPU) | MOERT_CAP_DEVICE(MOERT_DEVICE_CUDA),
#else
        .devices = MOERT_CAP_DEVICE(MOERT_DEVICE_CPU),
#endif
        .dtypes = MOERT_CAP_DTYPE(MOERT_F32) | MOERT_CAP_DTYPE(MOERT_F64) | MOERT_CAP_DTYPE(MOERT_BF16) |
                  MOERT_CAP_DTYPE(MOERT_F16),
        .flags = 0,
    },
    .init = hybridep_init,
    .finalize = hybridep_finalize,
    .prepare = hybridep_prepare,
    .dispatch = hybridep_dispatch,
    .combine = hybridep_combine,
    .combine_backward = hybridep_combine_backward,
    .dispatch_backward = hybridep_dispatch_backward,
};
