/* The "deepep" dispatcher plugin: tokens move by direct writes into the peers' buffers (exchanged once at init),
 * the way DeepEP's intranode kernels work. This file: vtable, options, argument checks, the peer buffer, prepare()
 * (layout pass, then the count exchange, "notify") and the calls of both paths; the CPU algorithm is in
 * deepep_cpu.c, the CUDA kernels in deepep_cuda.cu. */
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "deepep_buffer.h"
#include "deepep_cpu.h"
#include "moert/dispatcher.h"
#include "tensor_args.h"
#ifdef MOERT_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "deepep_cuda.h"
#include "dispatch_alltoall_cuda.h"
#endif

/* A host or device array grown on demand and reused across steps. */
typedef struct deepep_array {
    void *data;
    size_t bytes;
} deepep_array;

#define CALL_NAMES 64 /* names of recent calls by sequence number, for the CUDA path's stall messages */

#ifdef MOERT_HAVE_CUDA
/* The CUDA path's state: the layout on the device, the saved receive metadata, the stall word. */
typedef struct deepep_cuda_state {
    deepep_array expert_counts;   /* int64 [E] */
    deepep_array expert_offsets;  /* int64 [E+1] */
    deepep_array row_of_copy;     /* int32 [T*K] */
    deepep_array copy_of_row;     /* int32 [T*K] (the layout kernel's, unused here) */
    deepep_array layout_scratch;
    deepep_array excl;            /* int32 [W][T+1] */
    deepep_array tokens_to;       /* int64 [W] */
    deepep_array upload;          /* int64 [El + E]: tokens_per_expert, then base */
    deepep_array recv_meta;       /* int32 [W][rows_cap][K] */
    deepep_array staging;         /* combine: staged partials, deepep_cuda_staging_bytes() */
    int sms;                      /* SMs of the device: the local kernels' grid */
    deepep_array topk_idx;        /* int32 [T*K]: prepare()'s routing, kept for the step */
    deepep_array status;          /* device: unsigned long long error word, int abort flag (at 8), unsigned
                                   * finished-block counter (at 16) */
    int64_t *pinned;              /* [E + W + 2]: counts, tokens_to, bad ids, error word */
    int64_t *pinned_upload;       /* [El + E] */
} deepep_cuda_state;
#endif

typedef struct deepep_ctx {
    const moert_host *host;
    moert_layer_info layer;
    int world, rank;
    int64_t num_sms, channels, timeout_ms;
    bool fp8;                   /* dispatch_dtype "fp8" */
    bool nvlink_only;           /* bench_nvlink_only: CUDA calls run only their NVLink phase */
    bool on_cuda;
    moert_result broken;        /* MOERT_OK, or the code of a stall after which the group's buffers are out of step */
    char broken_msg[512];

    bool prepared, dispatched;  /* prepare() succeeded; a dispatch-like call ran since */
    int64_t seq;                /* sequence number of the last call through the buffers */
    char call_names[CALL_NAMES][24];

    deepep_geometry geo;
    void *buf;                  /* this rank's peer-visible buffer on the layer's device */
    size_t buf_bytes;
    void *peers[DEEPEP_MAX_RANKS];

    deepep_plan plan;
    int64_t row_len;            /* entries of an exchange row: E counts, W tokens_to, T, channels, rc */
    int64_t *exchange_row;      /* [row_len] */
    int64_t *gathered;          /* [W][row_len] */
    int64_t recv_rows[DEEPEP_MAX_RANKS];
    deepep_array copy_dst, excl, recv_meta, idx; /* host arrays of the CPU path (idx: topk_idx kept from prepare) */
#ifdef MOERT_HAVE_CUDA
    deepep_cuda_state cu;
#endif
} deepep_ctx;

static void report_metric(const deepep_ctx *c, const char *name, double value, const char *unit)
{
    const moert_host *h = c->host;
    if (h->struct_size >= offsetof(moert_host, metric) + sizeof h->metric && h->metric) h->metric(h, name, value, unit);
}

/* Sets the message and returns code. */
static moert_result fail(const deepep_ctx *c, moert_result code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static moert_result fail(const deepep_ctx *c, moert_result code, const char *fmt, ...)
{
    char text[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    c->host->set_error(c->host, "%s", text);
    return code;
}

/* Grows a host (CPU path) or layer-device array to at least `bytes`; contents not kept. */
static moert_result array_reserve(deepep_ctx *c, deepep_array *a, size_t bytes, bool on_device)
{
    if (bytes < 64) bytes = 64;
    if (a->bytes >= bytes) return MOERT_OK;
    const moert_device dev = on_device ? c->layer.device : moert_cpu();
    if (a->data) c->host->free(c->host, dev, a->data);
    a->data = NULL;
    a->bytes = 0;
    size_t grown = bytes + bytes / 2;
    moert_result rc = c->host->alloc(c->host, dev, grown, &a->data);
    if (rc != MOERT_OK) return rc;
    a->bytes = grown;
    return MOERT_OK;
}

static void array_release(deepep_ctx *c, deepep_array *a, bool on_device)
{
    if (a->data) c->host->free(c->host, on_device ? c->layer.device : moert_cpu(), a->data);
    a->data = NULL;
    a->bytes = 0;
}

/* The shared checks (plugins/common/tensor_args.h) for this instance's host and layer device. */
static moert_result check_tensor(const deepep_ctx *c, const char *call, const char *name, const moert_tensor *t,
                                 int ndim, int64_t rows, bool rows_at_least, int64_t cols, const char *rows_what,
                                 int need_dtype)
{
    return moert_arg_check_tensor(c->host, c->layer.device, call, name, t, ndim, rows, rows_at_least, cols,
                                  rows_what, need_dtype);
}

static moert_result check_struct_size(const deepep_ctx *c, const char *call, const char *what, uint32_t got,
                                      size_t need)
{
    return moert_arg_check_struct_size(c->host, call, what, got, need);
}

/* What every call after prepare() checks first. */
static moert_result check_call(deepep_ctx *c, const char *call, const void *args, uint32_t struct_size,
                               size_t expected_size, bool needs_dispatch)
{
    if (c->broken != MOERT_OK) return fail(c, c->broken, "%s: %s", call, c->broken_msg);
    if (!c->prepared) return fail(c, MOERT_ERR_INVALID_ARGUMENT, "%s: called before a successful prepare()", call);
    if (needs_dispatch && !c->dispatched)
        return fail(c, MOERT_ERR_INVALID_ARGUMENT, "%s: called before dispatch() or combine_backward() of this step "
                    "(the rows to combine are known from the dispatch)", call);
    if (!args) return fail(c, MOERT_ERR_INVALID_ARGUMENT, "%s: args is NULL", call);
    return check_struct_size(c, call, "args", struct_size, expected_size);
}

/* Marks the instance broken after a stall: the ranks' sequence numbers no longer agree. */
static moert_result mark_broken(deepep_ctx *c, const char *call, const char *why)
{
    c->broken = MOERT_ERR_TIMEOUT;
    snprintf(c->broken_msg, sizeof c->broken_msg, "%s on rank %d: %s; this dispatcher instance cannot be used again",
             call, c->rank, why);
    return fail(c, MOERT_ERR_TIMEOUT, "%s", c->broken_msg);
}

/* The next call's sequence number, with its name remembered for stall messages. */
static int64_t next_seq(deepep_ctx *c, const char *call)
{
    c->seq++;
    snprintf(c->call_names[c->seq % CALL_NAMES], sizeof c->call_names[0], "%s", call);
    return c->seq;
}

/* ---- the peer buffer ---- */

/* Bytes per buffer row: rows of the layer's dtype on CUDA, of any dtype (8 bytes) on the CPU; FP8 rows fit. */
static size_t buffer_row_bytes(const deepep_ctx *c)
{
    size_t es = c->on_cuda ? moert_dtype_size(c->layer.dtype) : 8;
    size_t bytes = (size_t)c->layer.hidden * es;
    if (c->fp8 && deepep_fp8_row_bytes(c->layer.hidden) > bytes) bytes = deepep_fp8_row_bytes(c->layer.hidden);
    return bytes;
}

/* Frees this rank's buffer once every peer has stopped writing into it (its release stamp of the last call is the
 * last thing a peer writes here); a peer that does not within timeout_ms is logged and the buffer freed anyway. */
static void buffer_release(deepep_ctx *c)
{
    if (c->buf && c->seq > 0 && c->broken == MOERT_OK) {
        int late = -1;
#ifdef MOERT_HAVE_CUDA
        if (c->on_cuda) late = deepep_cuda_wait_released(c->buf, c->world, (int)c->channels, c->seq, c->timeout_ms);
        else
#endif
            late = deepep_cpu_wait_released(c->buf, c->world, c->seq, c->timeout_ms);
        if (late >= 0)
            c->host->log(c->host, MOERT_LOG_WARN, "rank %d did not release this rank's rows of call %lld within %lld ms; "
                         "freeing the buffer anyway", late, (long long)c->seq, (long long)c->timeout_ms);
    }
    if (c->buf) c->host->free(c->host, c->layer.device, c->buf);
    c->buf = NULL;
    c->buf_bytes = 0;
}

/* Collective: allocates this rank's buffer for rows_cap rows per source, zeroes its flags, and exchanges the
 * pointers with every rank. The sequence numbers restart at 0. */
static moert_result buffer_setup(deepep_ctx *c, int64_t rows_cap)
{
    const moert_host *h = c->host;
    buffer_release(c);
    size_t bytes = deepep_geometry_make(&c->geo, c->world, c->layer.topk, rows_cap, buffer_row_bytes(c));
    moert_result rc = h->alloc(h, c->layer.device, bytes, &c->buf);
    if (rc != MOERT_OK) return rc;
    c->buf_bytes = bytes;
#ifdef MOERT_HAVE_CUDA
    if (c->on_cuda) {
        rc = deepep_cuda_zero(h, c->buf, c->geo.header_bytes);
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

static void deepep_finalize(void *ctx);

#ifdef MOERT_HAVE_CUDA
static moert_result cuda_init(deepep_ctx *c);
static void cuda_finalize(deepep_ctx *c);
#endif

static moert_result deepep_init(void **out, const moert_host *host, const moert_layer_info *layer)
{
    *out = NULL;
    moert_result check = moert_arg_check_dispatch_layer(host, layer, "deepep", DEEPEP_MAX_RANKS);
    if (check != MOERT_OK) return check;

    deepep_ctx *c = calloc(1, sizeof *c);
    if (!c) {
        host->set_error(host, "out of memory for the dispatcher state");
        return MOERT_ERR_OUT_OF_MEMORY;
    }
    c->host = host;
    c->layer = *layer;
    c->world = host->world_size;
    c->rank = host->rank;
    c->on_cuda = layer->device.type == MOERT_DEVICE_CUDA;
    static const char *const dtypes[] = {"bf16", "fp8", NULL};
    int dispatch_dtype = 0;
    moert_result rc = host->option_int(host, "num_sms", 0, 0, DEEPEP_MAX_CHANNELS,
                                       "SMs (thread blocks) of the NVLink phase of each call, every one sending; the "
                                       "local expansion and reductions around it use every SM; 0: every SM of the "
                                       "device (at most 132); the CPU path ignores it", &c->num_sms);
    if (rc == MOERT_OK)
        rc = host->option_int(host, "timeout_ms", 60000, 10, 3600000,
                              "bound of every wait for a peer's rows or flags; a stalled peer is named in the error",
                              &c->timeout_ms);
    if (rc == MOERT_OK)
        rc = host->option_enum(host, "dispatch_dtype", dtypes, 0,
                               "what forward dispatch() sends: the rows as they are (\"bf16\"), or E4M3 with one fp32 "
                               "scale per 1x128 block (\"fp8\"), dequantized on receipt", &dispatch_dtype);
    if (rc == MOERT_OK)
        rc = host->option_bool(host, "bench_nvlink_only", false,
                               "benchmark aid: CUDA calls run only their NVLink phase (rows cross, arrive and are "
                               "released; recv_x, y and the prob outputs are not written); never for a layer",
                               &c->nvlink_only);
    if (rc != MOERT_OK) {
        free(c);
        return rc;
    }
    c->fp8 = dispatch_dtype == 1;
    c->channels = c->num_sms < 1 ? 1 : c->num_sms; /* 0 (every SM) is resolved by cuda_init() */
    if (c->fp8 && layer->hidden % DEEPEP_FP8_BLOCK != 0) {
        free(c);
        host->set_error(host, "config error: dispatch_dtype \"fp8\" needs hidden divisible by %d (1x%d scale "
                        "blocks); hidden is %lld", DEEPEP_FP8_BLOCK, DEEPEP_FP8_BLOCK, (long long)layer->hidden);
        return MOERT_ERR_CONFIG;
    }

    const int64_t E = layer->num_experts, W = c->world;
    c->row_len = E + W + 3;
    c->exchange_row = calloc((size_t)c->row_len, sizeof(int64_t));
    c->gathered = calloc((size_t)(W * c->row_len), sizeof(int64_t));
    c->plan.all_counts = calloc((size_t)(W * E), sizeof(int64_t));
    c->plan.tokens_to = calloc((size_t)(W * W), sizeof(int64_t));
    c->plan.tokens_per_expert = calloc((size_t)layer->num_local_experts, sizeof(int64_t));
    c->plan.group_start = calloc((size_t)layer->num_local_experts, sizeof(int64_t));
    c->plan.base = calloc((size_t)E, sizeof(int64_t));
    if (!c->exchange_row || !c->gathered || !c->plan.all_counts || !c->plan.tokens_to ||
        !c->plan.tokens_per_expert || !c->plan.group_start || !c->plan.base) {
        deepep_finalize(c);
        host->set_error(host, "out of memory for the dispatcher state");
        return MOERT_ERR_OUT_OF_MEMORY;
    }
    c->plan.world = c->world;
    c->plan.rank = c->rank;
    c->plan.num_experts = E;
    c->plan.num_local_experts = layer->num_local_experts;
    c->plan.topk = layer->topk;

#ifdef MOERT_HAVE_CUDA
    if (c->on_cuda) {
        rc = cuda_init(c);
        if (rc != MOERT_OK) {
            deepep_finalize(c);
            return rc;
        }
    }
#endif
    /* every rank's slot holds the largest max_tokens of the group (collective, as the exchange is) */
    int64_t rows_cap = layer->max_tokens > 0 ? layer->max_tokens : 1;
    if (c->world > 1) {
        rc = host->allgather(host, &rows_cap, c->gathered, sizeof(int64_t), moert_cpu(), NULL);
        if (rc != MOERT_OK) {
            deepep_finalize(c);
            return rc;
        }
        for (int r = 0; r < c->world; r++)
            if (c->gathered[r] > rows_cap) rows_cap = c->gathered[r];
    }
    rc = buffer_setup(c, rows_cap);
    if (rc != MOERT_OK) {
        deepep_finalize(c);
        return rc;
    }
    *out = c;
    return MOERT_OK;
}

static void deepep_finalize(void *ctx)
{
    deepep_ctx *c = ctx;
    if (!c) return;
#ifdef MOERT_HAVE_CUDA
    if (c->on_cuda) cuda_finalize(c);
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

/* Checks topk_idx's shape and dtype (int32 [T, K] on the layer's device). */
static moert_result check_topk_idx(const deepep_ctx *c, const moert_tensor *topk_idx)
{
    const char *call = "prepare()";
    char a[64];
    if (!topk_idx) return fail(c, MOERT_ERR_INVALID_ARGUMENT, "%s: topk_idx is NULL", call);
    if (topk_idx->ndim != 2 || topk_idx->shape[1] != c->layer.topk)
        return fail(c, MOERT_ERR_INVALID_ARGUMENT, "%s: topk_idx has shape %s, expected [T, %lld] (T tokens, topk)",
                    call, moert_arg_shape_text(topk_idx, a, sizeof a), (long long)c->layer.topk);
    return check_tensor(c, call, "topk_idx", topk_idx, 2, topk_idx->shape[0], false, c->layer.topk, "T tokens, topk",
                        MOERT_I32);
}

/* The CPU layout pass: counts per expert and tokens per rank into exchange_row. */
static moert_result count_local(deepep_ctx *c, const moert_tensor *topk_idx, int64_t *num_tokens)
{
    moert_result rc = check_topk_idx(c, topk_idx);
    if (rc != MOERT_OK) return rc;
    const int64_t E = c->layer.num_experts, K = c->layer.topk;
    *num_tokens = topk_idx->shape[0];
    int64_t bad = deepep_count(topk_idx->data, *num_tokens, K, E, c->world, c->exchange_row, c->exchange_row + E);
    if (bad >= 0)
        return fail(c, MOERT_ERR_INVALID_ARGUMENT,
                    "prepare(): topk_idx[%lld][%lld] is %d, expected an expert id in [0, %lld) or -1 (dropped)",
                    (long long)(bad / K), (long long)(bad % K), (int)((const int32_t *)topk_idx->data)[bad],
                    (long long)E);
    return MOERT_OK;
}

#ifdef MOERT_HAVE_CUDA
static moert_result cuda_count_local(deepep_ctx *c, moert_stream stream, const moert_tensor *topk_idx,
                                     int64_t *num_tokens);
static moert_result cuda_plan(deepep_ctx *c, moert_stream stream);
#endif

/* Layout pass, then the count exchange (every rank takes part even after a local failure, so all fail together),
 * then the plan: sizes, each copy's row on its expert's rank, and this rank's layout. */
static moert_result deepep_prepare(void *ctx, moert_stream stream, const moert_tensor *topk_idx,
                                   moert_dispatch_layout *layout)
{
    deepep_ctx *c = ctx;
    const moert_host *h = c->host;
    const int64_t E = c->layer.num_experts, El = c->layer.num_local_experts, K = c->layer.topk;
    const int W = c->world;
    c->prepared = false;
    c->dispatched = false;

    int64_t num_tokens = 0;
    memset(c->exchange_row, 0, (size_t)c->row_len * sizeof(int64_t));
    moert_result local_rc = MOERT_OK;
    if (c->broken != MOERT_OK) local_rc = fail(c, c->broken, "prepare(): %s", c->broken_msg);
    else if (!layout) local_rc = fail(c, MOERT_ERR_INVALID_ARGUMENT, "prepare(): layout is NULL");
    else local_rc = check_struct_size(c, "prepare()", "layout", layout->struct_size, sizeof *layout);
    if (local_rc == MOERT_OK) {
#ifdef MOERT_HAVE_CUDA
        if (c->on_cuda) local_rc = cuda_count_local(c, stream, topk_idx, &num_tokens);
        else
#endif
            local_rc = count_local(c, topk_idx, &num_tokens);
    }
    if (local_rc != MOERT_OK) memset(c->exchange_row, 0, (size_t)(E + W) * sizeof(int64_t));
    c->exchange_row[E + W] = num_tokens;
    c->exchange_row[E + W + 1] = c->channels;
    c->exchange_row[E + W + 2] = local_rc;

    moert_result rc = MOERT_OK;
    if (W == 1) memcpy(c->gathered, c->exchange_row, (size_t)c->row_len * sizeof(int64_t));
    else rc = h->allgather(h, c->exchange_row, c->gathered, (size_t)c->row_len * sizeof(int64_t), moert_cpu(), NULL);
    if (rc != MOERT_OK) return rc;
    if (local_rc != MOERT_OK) return local_rc;

    int64_t max_tokens = 0;
    for (int s = 0; s < W; s++) {
        const int64_t *row = c->gathered + (int64_t)s * c->row_len;
        if (row[E + W + 2] != MOERT_OK)
            return fail(c, MOERT_ERR_INVALID_ARGUMENT,
                        "prepare(): rank %d failed its prepare() (see its error), so this step cannot dispatch", s);
        if (row[E + W + 1] != c->channels)
            return fail(c, MOERT_ERR_CONFIG, "prepare(): rank %d sends with %lld blocks (num_sms), this rank with "
                        "%lld: every rank needs the same num_sms", s, (long long)row[E + W + 1],
                        (long long)c->channels);
        memcpy(c->plan.all_counts + (int64_t)s * E, row, (size_t)E * sizeof(int64_t));
        memcpy(c->plan.tokens_to + (int64_t)s * W, row + E, (size_t)W * sizeof(int64_t));
        if (row[E + W] > max_tokens) max_tokens = row[E + W];
    }
    if (max_tokens > c->geo.rows_cap) { /* every rank sees the same figures: all grow together */
        h->log(h, MOERT_LOG_INFO, "prepare: %lld tokens on one rank, more than the buffer's %lld rows: growing it",
               (long long)max_tokens, (long long)c->geo.rows_cap);
#ifdef MOERT_HAVE_CUDA
        if (c->on_cuda) {
            rc = h->stream_synchronize(h, stream);
            if (rc != MOERT_OK) return rc;
        }
#endif
        rc = buffer_setup(c, max_tokens);
        if (rc != MOERT_OK) return rc;
    }

    deepep_plan *p = &c->plan;
    p->num_tokens = num_tokens;
    deepep_plan_sizes(p);
    void *tokens_per_expert_data = p->tokens_per_expert;
#ifdef MOERT_HAVE_CUDA
    if (c->on_cuda) {
        rc = cuda_plan(c, stream);
        if (rc != MOERT_OK) return rc;
        tokens_per_expert_data = c->cu.upload.data;
    } else
#endif
    {
        rc = array_reserve(c, &c->copy_dst, (size_t)(num_tokens * K) * sizeof(int64_t), false);
        if (rc == MOERT_OK)
            rc = array_reserve(c, &c->excl, (size_t)(W * (num_tokens + 1)) * sizeof(int64_t), false);
        if (rc == MOERT_OK)
            rc = array_reserve(c, &c->recv_meta, (size_t)(W * c->geo.rows_cap * K) * sizeof(int64_t), false);
        if (rc == MOERT_OK) rc = array_reserve(c, &c->idx, (size_t)(num_tokens * K) * sizeof(int32_t), false);
        if (rc != MOERT_OK) return rc;
        memcpy(c->idx.data, topk_idx->data, (size_t)(num_tokens * K) * sizeof(int32_t));
        p->copy_dst = c->copy_dst.data;
        p->excl = c->excl.data;
        deepep_plan_copies(p, topk_idx->data);
    }
    layout->num_recv = p->num_recv;
    layout->capacity = p->num_recv;
    layout->tokens_per_expert = moert_tensor_1d(tokens_per_expert_data, c->layer.device, MOERT_I64, El);
    layout->tokens_per_expert_host = p->tokens_per_expert;
    c->prepared = true;
    report_metric(c, "dispatch.recv_tokens", (double)p->num_recv, "tokens");
    h->log(h, MOERT_LOG_DEBUG, "prepare: T %lld, receive %lld rows", (long long)num_tokens, (long long)p->num_recv);
    return MOERT_OK;
}

/* Bytes this rank writes into other ranks' buffers in a dispatch-like call (rows and their metadata). */
static double dispatch_bytes(const deepep_ctx *c, size_t row_bytes)
{
    double total = 0;
    for (int d = 0; d < c->world; d++)
        if (d != c->rank)
            total += (double)c->plan.tokens_to[(int64_t)c->rank * c->world + d] * (double)(row_bytes + c->geo.meta_stride);
    return total;
}

/* ---- the CPU path's calls ---- */

/* The link of one CPU call. */
static deepep_cpu_link cpu_link(deepep_ctx *c, int64_t seq, char *error, size_t error_size)
{
    deepep_cpu_link l = {.geo = &c->geo, .local = c->buf, .peers = c->peers, .seq = seq,
                         .timeout_ms = c->timeout_ms, .recv_meta = c->recv_meta.data, .recv_rows = c->recv_rows,
                         .error = error, .error_size = error_size};
    return l;
}

/* A dispatch-like call on the CPU (dispatch, combine_backward). */
static moert_result cpu_dispatch_like(deepep_ctx *c, const char *call, bool fp8, const moert_tensor *x,
                                      const moert_tensor *probs, moert_tensor *out, moert_tensor *out_probs)
{
    char why[256] = "";
    deepep_cpu_link l = cpu_link(c, next_seq(c, call), why, sizeof why);
    int r = deepep_cpu_dispatch(&l, &c->plan, c->layer.hidden, fp8, c->idx.data, x->data, x->dtype,
                                probs ? probs->data : NULL, probs ? probs->dtype : MOERT_F64, out->data, out->dtype,
                                out_probs ? out_probs->data : NULL, out_probs ? out_probs->dtype : MOERT_F64);
    if (r > 0) return mark_broken(c, call, why);
    if (r < 0) return fail(c, MOERT_ERR_OUT_OF_MEMORY, "%s: %s", call, why);
    c->dispatched = true;
    return MOERT_OK;
}

/* A combine-like call on the CPU (combine, dispatch_backward). */
static moert_result cpu_combine_like(deepep_ctx *c, const char *call, const moert_tensor *rows,
                                     const moert_tensor *row_probs, moert_tensor *out, bool accumulate,
                                     moert_tensor *out_probs)
{
    char why[256] = "";
    deepep_cpu_link l = cpu_link(c, next_seq(c, call), why, sizeof why);
    int r = deepep_cpu_combine(&l, &c->plan, c->layer.hidden, c->idx.data, rows->data, rows->dtype,
                               row_probs ? row_probs->data : NULL, row_probs ? row_probs->dtype : MOERT_F64, out->data,
                               out->dtype, accumulate, out_probs ? out_probs->data : NULL,
                               out_probs ? out_probs->dtype : MOERT_F64);
    if (r > 0) return mark_broken(c, call, why);
    if (r < 0) return fail(c, MOERT_ERR_OUT_OF_MEMORY, "%s: %s", call, why);
    return MOERT_OK;
}

#ifdef MOERT_HAVE_CUDA
/* ---- the CUDA path ---- */

static moert_result cuda_init(deepep_ctx *c)
{
    const moert_host *h = c->host;
    const int64_t E = c->layer.num_experts, El = c->layer.num_local_experts, W = c->world;
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
        return fail(c, MOERT_ERR_UNSUPPORTED, "the layer is on %s, but this process sees %d CUDA device%s (%s): "
                    "only a CPU path can run here", dev, count, count == 1 ? "" : "s",
                    err == cudaSuccess ? "cudaGetDeviceCount" : cudaGetErrorString(err));
    if (E > MOERT_A2A_CUDA_MAX_EXPERTS)
        return fail(c, MOERT_ERR_UNSUPPORTED, "the deepep dispatcher's CUDA path takes at most %d experts, the layer "
                    "has %lld", MOERT_A2A_CUDA_MAX_EXPERTS, (long long)E);
    if (c->layer.topk > 32)
        return fail(c, MOERT_ERR_UNSUPPORTED, "the deepep dispatcher's CUDA path takes topk <= 32 (a warp's lanes), "
                    "the layer has %lld", (long long)c->layer.topk);
    if (c->layer.dtype != MOERT_BF16 && c->layer.dtype != MOERT_F32)
        return fail(c, MOERT_ERR_UNSUPPORTED, "the deepep dispatcher's CUDA path moves bf16 or fp32 rows, the layer is "
                    "%s", moert_dtype_name(c->layer.dtype));
    if (c->fp8 && c->layer.dtype != MOERT_BF16)
        return fail(c, MOERT_ERR_UNSUPPORTED, "dispatch_dtype \"fp8\" on CUDA quantizes bf16 rows, the layer is %s",
                    moert_dtype_name(c->layer.dtype));
    int sms = 0;
    err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, id);
    if (err != cudaSuccess) {
        (void)cudaGetLastError();
        return fail(c, MOERT_ERR_CUDA, "cudaDeviceGetAttribute(MultiProcessorCount) on %s failed: %s", dev,
                    cudaGetErrorString(err));
    }
    deepep_cuda_state *cu = &c->cu;
    cu->sms = sms < 1 ? 1 : sms;
    if (c->num_sms == 0) /* every SM of the device, at most DEEPEP_MAX_CHANNELS */
        c->channels = cu->sms > DEEPEP_MAX_CHANNELS ? DEEPEP_MAX_CHANNELS : cu->sms;
    moert_result rc = array_reserve(c, &cu->status, 64, true);
    if (rc == MOERT_ERR_UNSUPPORTED)
        return fail(c, rc, "the host serving this instance cannot allocate on %s (a CPU-only host): only a CPU path "
                    "can run here", dev);
    if (rc == MOERT_OK) rc = deepep_cuda_zero(h, cu->status.data, cu->status.bytes);
    if (rc == MOERT_OK) rc = array_reserve(c, &cu->upload, (size_t)(El + E) * sizeof(int64_t), true);
    if (rc == MOERT_OK) rc = h->alloc_pinned(h, (size_t)(E + W + 2) * sizeof(int64_t), (void **)&cu->pinned);
    if (rc == MOERT_OK) rc = h->alloc_pinned(h, (size_t)(El + E) * sizeof(int64_t), (void **)&cu->pinned_upload);
    return rc;
}

static void cuda_finalize(deepep_ctx *c)
{
    deepep_cuda_state *cu = &c->cu;
    deepep_array *arrays[] = {&cu->expert_counts, &cu->expert_offsets, &cu->row_of_copy, &cu->copy_of_row,
                              &cu->layout_scratch, &cu->excl, &cu->tokens_to, &cu->upload, &cu->recv_meta,
                              &cu->staging, &cu->status, &cu->topk_idx};
    for (size_t i = 0; i < sizeof arrays / sizeof arrays[0]; i++) array_release(c, arrays[i], true);
    if (cu->pinned) c->host->free_pinned(c->host, cu->pinned);
    if (cu->pinned_upload) c->host->free_pinned(c->host, cu->pinned_upload);
    cu->pinned = cu->pinned_upload = NULL;
}

/* The message of a stall a kernel recorded: which call, which peer, which wait. */
static moert_result cuda_report_stall(deepep_ctx *c, unsigned long long word)
{
    const int64_t seq = (int64_t)(word >> 16);
    const int kind = (int)((word >> 8) & 0xff), peer = (int)(word & 0xff);
    char why[256];
    if (kind == DEEPEP_WAIT_ARRIVAL)
        snprintf(why, sizeof why, "rank %d did not deliver its rows within %lld ms (timeout_ms)", peer,
                 (long long)c->timeout_ms);
    else
        snprintf(why, sizeof why, "rank %d did not read the rows of the previous call within %lld ms (timeout_ms)",
                 peer, (long long)c->timeout_ms);
    char call[64];
    snprintf(call, sizeof call, "%s (call %lld)", c->call_names[seq % CALL_NAMES], (long long)seq);
    return mark_broken(c, call, why);
}

/* prepare()'s local part on CUDA: the layout kernels (counts per expert, each copy's place among its expert's
 * copies, each token's position per destination rank), then one bounded wait for the counts, the bad-id counter
 * and the stall word of earlier calls. */
static moert_result cuda_count_local(deepep_ctx *c, moert_stream stream, const moert_tensor *topk_idx,
                                     int64_t *num_tokens)
{
    const moert_host *h = c->host;
    const int64_t E = c->layer.num_experts, K = c->layer.topk, W = c->world;
    moert_result rc = check_topk_idx(c, topk_idx);
    if (rc != MOERT_OK) return rc;
    const int64_t T = topk_idx->shape[0];
    if (T * K > INT32_MAX)
        return fail(c, MOERT_ERR_UNSUPPORTED, "prepare(): %lld token copies (T*K), the CUDA path takes at most %d",
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
        rc = h->memcpy_async(h, cu->topk_idx.data, c->layer.device, topk_idx->data, c->layer.device,
                             (size_t)(T * K) * sizeof(int32_t), stream);
    if (rc != MOERT_OK) return rc;
    moert_a2a_cuda_layout_buffers bufs = {.tokens_per_expert = cu->expert_counts.data,
                                          .expert_offsets = cu->expert_offsets.data,
                                          .row_of_copy = cu->row_of_copy.data,
                                          .copy_of_row = cu->copy_of_row.data,
                                          .scratch = cu->layout_scratch.data};
    rc = moert_a2a_cuda_layout(h, (cudaStream_t)stream, topk_idx->data, T, K, E, &bufs, NULL);
    if (rc == MOERT_OK)
        rc = deepep_cuda_token_ranks(h, (cudaStream_t)stream, topk_idx->data, T, K, c->layer.num_local_experts, E,
                                     c->world, cu->excl.data, cu->tokens_to.data);
    const moert_device dev = c->layer.device, cpu = moert_cpu();
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
        return fail(c, MOERT_ERR_INVALID_ARGUMENT,
                    "prepare(): %llu entries of topk_idx are outside [0, %lld) and not -1 (dropped); expected expert ids",
                    bad, (long long)E);
    memcpy(c->exchange_row, cu->pinned, (size_t)(E + W) * sizeof(int64_t));
    *num_tokens = T;
    return MOERT_OK;
}

/* prepare()'s plan on CUDA: uploads tokens_per_expert and base (no wait), sizes the saved receive metadata and the
 * combine staging area. */
static moert_result cuda_plan(deepep_ctx *c, moert_stream stream)
{
    const moert_host *h = c->host;
    const int64_t E = c->layer.num_experts, El = c->layer.num_local_experts, K = c->layer.topk, W = c->world;
    deepep_cuda_state *cu = &c->cu;
    if (c->plan.num_recv > INT32_MAX)
        return fail(c, MOERT_ERR_UNSUPPORTED, "prepare(): %lld rows to receive, the CUDA path takes at most %d",
                    (long long)c->plan.num_recv, INT32_MAX);
    memcpy(cu->pinned_upload, c->plan.tokens_per_expert, (size_t)El * sizeof(int64_t));
    memcpy(cu->pinned_upload + El, c->plan.base, (size_t)E * sizeof(int64_t));
    moert_result rc = h->memcpy_async(h, cu->upload.data, c->layer.device, cu->pinned_upload, moert_cpu(),
                                      (size_t)(El + E) * sizeof(int64_t), stream);
    if (rc == MOERT_OK) rc = array_reserve(c, &cu->recv_meta, (size_t)(W * c->geo.rows_cap * K) * sizeof(int32_t), true);
    int64_t staged = 0; /* rows received from other ranks: combine stages one partial per row */
    for (int s = 0; s < W; s++)
        if (s != c->rank) staged += c->plan.tokens_to[(int64_t)s * W + c->rank];
    if (rc == MOERT_OK) rc = array_reserve(c, &cu->staging, deepep_cuda_staging_bytes(&c->geo, staged), true);
    return rc;
}

/* The kernels' view of this step and call. */
static deepep_cuda_call cuda_call(deepep_ctx *c, int64_t seq)
{
    deepep_cuda_state *cu = &c->cu;
    deepep_cuda_call k;
    memset(&k, 0, sizeof k);
    k.geo = c->geo;
    k.local = c->buf;
    for (int r = 0; r < c->world; r++) k.peers[r] = c->peers[r];
    k.rank = c->rank;
    k.channels = (int)c->channels;
    k.sms = cu->sms;
    k.nvlink_only = c->nvlink_only;
    k.seq = seq;
    k.timeout_ns = c->timeout_ms * 1000000;
    k.tokens = c->plan.num_tokens;
    k.topk = c->layer.topk;
    k.hidden = c->layer.hidden;
    k.local_experts = c->layer.num_local_experts;
    k.topk_idx = cu->topk_idx.data;
    k.excl = cu->excl.data;
    k.row_of_copy = cu->row_of_copy.data;
    k.expert_offsets = cu->expert_offsets.data;
    k.base = (const int64_t *)cu->upload.data + c->layer.num_local_experts;
    k.recv_meta = cu->recv_meta.data;
    for (int s = 0; s < c->world; s++) {
        k.recv_tokens[s] = c->plan.tokens_to[(int64_t)s * c->world + c->rank];
        k.staged_off[s] = k.staging_rows;
        if (s != c->rank) k.staging_rows += k.recv_tokens[s];
    }
    k.staging = cu->staging.data;
    k.error_word = cu->status.data;
    k.abort_flag = (int *)((char *)cu->status.data + 8);
    k.done_blocks = (unsigned *)((char *)cu->status.data + 16);
    return k;
}

/* Row tensors on CUDA: the layer's dtype; probs fp32. */
static moert_result cuda_check_dtype(const deepep_ctx *c, const char *call, const char *name, const moert_tensor *t,
                                     moert_dtype want)
{
    if (!t || t->dtype == want) return MOERT_OK;
    return fail(c, MOERT_ERR_UNSUPPORTED, "%s: %s has dtype %s; the CUDA path takes %s here", call, name,
                moert_dtype_name(t->dtype), moert_dtype_name(want));
}

static moert_result cuda_dispatch_like(deepep_ctx *c, moert_stream stream, const char *call, bool fp8,
                                       const moert_tensor *x, const moert_tensor *probs, moert_tensor *out,
                                       moert_tensor *out_probs)
{
    moert_result rc = cuda_check_dtype(c, call, "rows", x, c->layer.dtype);
    if (rc == MOERT_OK) rc = cuda_check_dtype(c, call, "probs", probs, MOERT_F32);
    if (rc == MOERT_OK) rc = cuda_check_dtype(c, call, "probs out", out_probs, MOERT_F32);
    if (rc != MOERT_OK) return rc;
    deepep_cuda_call k = cuda_call(c, next_seq(c, call));
    rc = deepep_cuda_dispatch(c->host, (cudaStream_t)stream, &k, x->dtype, fp8, x->data,
                              probs ? probs->data : NULL, out->data, out_probs ? out_probs->data : NULL);
    if (rc == MOERT_OK) c->dispatched = true;
    return rc;
}

static moert_result cuda_combine_like(deepep_ctx *c, moert_stream stream, const char *call, const moert_tensor *rows,
                                      const moert_tensor *row_probs, moert_tensor *out, bool accumulate,
                                      moert_tensor *out_probs)
{
    moert_result rc = cuda_check_dtype(c, call, "rows", rows, c->layer.dtype);
    if (rc == MOERT_OK) rc = cuda_check_dtype(c, call, "out", out, c->layer.dtype);
    if (rc == MOERT_OK) rc = cuda_check_dtype(c, call, "row probs", row_probs, MOERT_F32);
    if (rc == MOERT_OK) rc = cuda_check_dtype(c, call, "probs out", out_probs, MOERT_F32);
    if (rc != MOERT_OK) return rc;
    deepep_cuda_call k = cuda_call(c, next_seq(c, call));
    return deepep_cuda_combine(c->host, (cudaStream_t)stream, &k, rows->dtype, rows->data,
                               row_probs ? row_probs->data : NULL, out->data, accumulate,
                               out_probs ? out_probs->data : NULL);
}
#endif

/* ---- the calls ---- */

/* Sends each token once to every rank holding one of its experts; the receiver expands it into its copies' rows. */
static moert_result deepep_dispatch(void *ctx, moert_stream stream, const moert_dispatch_args *args)
{
    deepep_ctx *c = ctx;
    const char *call = "dispatch()";
    const deepep_plan *p = &c->plan;
    const int64_t H = c->layer.hidden, T = p->num_tokens, K = c->layer.topk;
    moert_result rc = check_call(c, call, args, args ? args->struct_size : 0, sizeof *args, false);
    if (rc == MOERT_OK) rc = check_tensor(c, call, "x", args->x, 2, T, false, H, "T from prepare(), hidden", -1);
    if (rc == MOERT_OK)
        rc = check_tensor(c, call, "recv_x", args->recv_x, 2, p->num_recv, true, H, "capacity from prepare(), hidden",
                          args->x->dtype);
    if (rc == MOERT_OK && (args->topk_probs == NULL) != (args->recv_probs == NULL))
        rc = fail(c, MOERT_ERR_INVALID_ARGUMENT, "%s: topk_probs and recv_probs must be given together (or both NULL)",
                  call);
    if (rc == MOERT_OK && args->topk_probs)
        rc = check_tensor(c, call, "topk_probs", args->topk_probs, 2, T, false, K, "T from prepare(), topk", -1);
    if (rc == MOERT_OK && args->recv_probs)
        rc = check_tensor(c, call, "recv_probs", args->recv_probs, 1, p->num_recv, true, 0, "capacity from prepare()",
                          -1);
    if (rc != MOERT_OK) return rc;
#ifdef MOERT_HAVE_CUDA
    if (c->on_cuda)
        rc = cuda_dispatch_like(c, stream, call, c->fp8, args->x, args->topk_probs, args->recv_x, args->recv_probs);
    else
#endif
        rc = cpu_dispatch_like(c, call, c->fp8, args->x, args->topk_probs, args->recv_x, args->recv_probs);
    if (rc != MOERT_OK) return rc;
    const size_t row_bytes = c->fp8 ? deepep_fp8_row_bytes(H) : (size_t)H * moert_dtype_size(args->x->dtype);
    report_metric(c, "dispatch.bytes_sent", dispatch_bytes(c, row_bytes), "bytes");
    return MOERT_OK;
}

/* Each expert rank sums its copies of a token into one partial row, sends it back; the token's rank sums the
 * partials in rank order (fp32; fp64 for fp64 rows), y overwritten in the original token order. */
static moert_result deepep_combine(void *ctx, moert_stream stream, const moert_combine_args *args)
{
    deepep_ctx *c = ctx;
    const char *call = "combine()";
    const deepep_plan *p = &c->plan;
    const int64_t H = c->layer.hidden;
    moert_result rc = check_call(c, call, args, args ? args->struct_size : 0, sizeof *args, true);
    if (rc == MOERT_OK)
        rc = check_tensor(c, call, "y_expert", args->y_expert, 2, p->num_recv, true, H,
                          "capacity from prepare(), hidden", -1);
    if (rc == MOERT_OK)
        rc = check_tensor(c, call, "y", args->y, 2, p->num_tokens, false, H, "T from prepare(), hidden", -1);
    if (rc != MOERT_OK) return rc;
#ifdef MOERT_HAVE_CUDA
    if (c->on_cuda) return cuda_combine_like(c, stream, call, args->y_expert, NULL, args->y, false, NULL);
#endif
    return cpu_combine_like(c, call, args->y_expert, NULL, args->y, false, NULL);
}

/* The adjoint of combine: a dispatch of d_y's rows (bf16 on every path, no probs). */
static moert_result deepep_combine_backward(void *ctx, moert_stream stream, const moert_combine_backward_args *args)
{
    deepep_ctx *c = ctx;
    const char *call = "combine_backward()";
    const deepep_plan *p = &c->plan;
    const int64_t H = c->layer.hidden;
    moert_result rc = check_call(c, call, args, args ? args->struct_size : 0, sizeof *args, false);
    if (rc == MOERT_OK)
        rc = check_tensor(c, call, "d_y", args->d_y, 2, p->num_tokens, false, H, "T from prepare(), hidden", -1);
    if (rc == MOERT_OK)
        rc = check_tensor(c, call, "d_y_expert", args->d_y_expert, 2, p->num_recv, true, H,
                          "capacity from prepare(), hidden", args->d_y->dtype);
    if (rc != MOERT_OK) return rc;
#ifdef MOERT_HAVE_CUDA
    if (c->on_cuda) return cuda_dispatch_like(c, stream, call, false, args->d_y, NULL, args->d_y_expert, NULL);
#endif
    return cpu_dispatch_like(c, call, false, args->d_y, NULL, args->d_y_expert, NULL);
}

/* The adjoint of dispatch: a combine of d_recv_x added into d_x, and each row's prob gradient to its (t, k) slot. */
static moert_result deepep_dispatch_backward(void *ctx, moert_stream stream, const moert_dispatch_backward_args *args)
{
    deepep_ctx *c = ctx;
    const char *call = "dispatch_backward()";
    const deepep_plan *p = &c->plan;
    const int64_t H = c->layer.hidden, T = p->num_tokens, K = c->layer.topk;
    moert_result rc = check_call(c, call, args, args ? args->struct_size : 0, sizeof *args, true);
    if (rc == MOERT_OK)
        rc = check_tensor(c, call, "d_recv_x", args->d_recv_x, 2, p->num_recv, true, H,
                          "capacity from prepare(), hidden", -1);
    if (rc == MOERT_OK) rc = check_tensor(c, call, "d_x", args->d_x, 2, T, false, H, "T from prepare(), hidden", -1);
    if (rc == MOERT_OK && (args->d_recv_probs == NULL) != (args->d_topk_probs == NULL))
        rc = fail(c, MOERT_ERR_INVALID_ARGUMENT,
                  "%s: d_recv_probs and d_topk_probs must be given together (or both NULL)", call);
    if (rc == MOERT_OK && args->d_recv_probs)
        rc = check_tensor(c, call, "d_recv_probs", args->d_recv_probs, 1, p->num_recv, true, 0,
                          "capacity from prepare()", -1);
    if (rc == MOERT_OK && args->d_topk_probs)
        rc = check_tensor(c, call, "d_topk_probs", args->d_topk_probs, 2, T, false, K, "T from prepare(), topk", -1);
    if (rc != MOERT_OK) return rc;
#ifdef MOERT_HAVE_CUDA
    if (c->on_cuda)
        return cuda_combine_like(c, stream, call, args->d_recv_x, args->d_recv_probs, args->d_x, true,
                                 args->d_topk_probs);
#endif
    return cpu_combine_like(c, call, args->d_recv_x, args->d_recv_probs, args->d_x, true, args->d_topk_probs);
}

MOERT_PLUGIN_EXPORT const moert_dispatcher_v1 deepep_vtable __asm__(MOERT_DISPATCHER_V1_SYMBOL) = {
    .header = {
        .abi_version = MOERT_ABI_CURRENT,
        .struct_size = sizeof(moert_dispatcher_v1),
        .kind = MOERT_KIND_DISPATCHER,
        .name = "deepep",
        .version = "0.1.0",
        .description = "NVLink dispatcher in the way of DeepEP's intranode kernels: each token written once into "
                       "each destination rank's peer buffer, expanded there by local expert; bf16 or fp8 dispatch",
#ifdef MOERT_HAVE_CUDA
        .devices = MOERT_CAP_DEVICE(MOERT_DEVICE_CPU) | MOERT_CAP_DEVICE(MOERT_DEVICE_CUDA),
#else
        .devices = MOERT_CAP_DEVICE(MOERT_DEVICE_CPU),
#endif
        .dtypes = MOERT_CAP_DTYPE(MOERT_F32) | MOERT_CAP_DTYPE(MOERT_F64) | MOERT_CAP_DTYPE(MOERT_BF16) |
                  MOERT_CAP_DTYPE(MOERT_F16),
        .flags = MOERT_CAP_NEEDS_HOST_SYNC,
    },
    .init = deepep_init,
    .finalize = deepep_finalize,
    .prepare = deepep_prepare,
    .dispatch = deepep_dispatch,
    .combine = deepep_combine,
    .combine_backward = deepep_combine_backward,
    .dispatch_backward = deepep_dispatch_backward,
};
