/* SPDX-License-Identifier: Apache-2.0 */
/* The frame of the NVLink dispatchers on the host (see peer_dispatch.h). */
#include "peer_dispatch.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "peer_reach.h"
#include "tensor_args.h"
#ifdef MOERT_HAVE_CUDA
#include "plugin_cuda_check.h"
#endif

moert_result peer_dispatch_create(const moert_host *host, const moert_layer_info *layer, const char *name,
                                  size_t ctx_size, void **ctx)
{
    *ctx = NULL;
    moert_result rc = moert_arg_check_dispatch_layer(host, layer, name, PEER_MAX_RANKS);
    if (rc != MOERT_OK) return rc;
    peer_dispatch *d = calloc(1, ctx_size);
    if (!d) {
        host->set_error(host, "out of memory for the dispatcher state");
        return MOERT_ERR_OUT_OF_MEMORY;
    }
    d->host = host;
    moert_layer_info_copy(&d->layer, layer);
    d->name = name;
    d->world = host->world_size;
    d->rank = host->rank;
    d->on_cuda = layer->device.type == MOERT_DEVICE_CUDA;
    *ctx = d;
    return MOERT_OK;
}

void peer_dispatch_metric(const peer_dispatch *d, const char *name, double value, const char *unit)
{
    const moert_host *h = d->host;
    if (h->struct_size >= offsetof(moert_host, metric) + sizeof h->metric && h->metric) h->metric(h, name, value, unit);
}

moert_result peer_dispatch_read_timeout(peer_dispatch *d)
{
    return d->host->option_int(d->host, "timeout_ms", 60000, 10, 3600000,
                               "bound of every wait for a peer's rows or flags; a stalled peer is named in the error",
                               &d->timeout_ms);
}

moert_result peer_dispatch_group_max_tokens(peer_dispatch *d, int64_t *rows_cap)
{
    *rows_cap = d->layer.max_tokens > 0 ? d->layer.max_tokens : 1;
    if (d->world == 1) return MOERT_OK;
    int64_t gathered[PEER_MAX_RANKS];
    moert_result rc = d->host->allgather(d->host, rows_cap, gathered, sizeof(int64_t), moert_cpu(), NULL);
    if (rc != MOERT_OK) return rc;
    for (int r = 0; r < d->world; r++)
        if (gathered[r] > *rows_cap) *rows_cap = gathered[r];
    return MOERT_OK;
}

moert_result peer_dispatch_mark_broken(peer_dispatch *d, moert_result code, const char *call, const char *why)
{
    d->broken = code;
    snprintf(d->broken_msg, sizeof d->broken_msg, "%s on rank %d: %s; this dispatcher instance cannot be used again",
             call, d->rank, why);
    return peer_dispatch_fail(d, code, "%s", d->broken_msg);
}

/* ---- argument checks ---- */

moert_result peer_dispatch_check_tensor(const peer_dispatch *d, const char *call, const char *name,
                                        const moert_tensor *t, int ndim, int64_t rows, bool rows_at_least, int64_t cols,
                                        const char *rows_what, int need_dtype)
{
    return moert_arg_check_tensor(d->host, d->layer.device, call, name, t, ndim, rows, rows_at_least, cols, rows_what,
                                  need_dtype);
}

moert_result peer_dispatch_check_layout(const peer_dispatch *d, const moert_dispatch_layout *layout)
{
    if (!layout) return peer_dispatch_fail(d, MOERT_ERR_INVALID_ARGUMENT, "prepare(): layout is NULL");
    return moert_arg_check_struct_size(d->host, "prepare()", "layout", layout->struct_size, sizeof *layout);
}

moert_result peer_dispatch_check_topk_idx(const peer_dispatch *d, const moert_tensor *topk_idx)
{
    const char *call = "prepare()";
    char a[64];
    if (!topk_idx) return peer_dispatch_fail(d, MOERT_ERR_INVALID_ARGUMENT, "%s: topk_idx is NULL", call);
    if (topk_idx->ndim != 2 || topk_idx->shape[1] != d->layer.topk)
        return peer_dispatch_fail(d, MOERT_ERR_INVALID_ARGUMENT,
                                  "%s: topk_idx has shape %s, expected [T, %lld] (T tokens, topk)", call,
                                  moert_arg_shape_text(topk_idx, a, sizeof a), (long long)d->layer.topk);
    return peer_dispatch_check_tensor(d, call, "topk_idx", topk_idx, 2, topk_idx->shape[0], false, d->layer.topk,
                                      "T tokens, topk", MOERT_I32);
}

/* What every call after prepare() checks first. */
static moert_result check_call(const peer_dispatch *d, const char *call, const void *args, uint32_t struct_size,
                               size_t expected_size, bool needs_dispatch)
{
    if (d->broken != MOERT_OK) return peer_dispatch_fail(d, d->broken, "%s: %s", call, d->broken_msg);
    if (!d->prepared)
        return peer_dispatch_fail(d, MOERT_ERR_INVALID_ARGUMENT, "%s: called before a successful prepare()", call);
    if (needs_dispatch && !d->dispatched)
        return peer_dispatch_fail(d, MOERT_ERR_INVALID_ARGUMENT,
                                  "%s: called before dispatch() or combine_backward() "
                                  "of this step (the rows to combine are known from the dispatch)",
                                  call);
    if (!args) return peer_dispatch_fail(d, MOERT_ERR_INVALID_ARGUMENT, "%s: args is NULL", call);
    return moert_arg_check_struct_size(d->host, call, "args", struct_size, expected_size);
}

/* A [T, hidden] tensor of this step's tokens. */
static moert_result check_token_rows(const peer_dispatch *d, const char *call, const char *name, const moert_tensor *t,
                                     int64_t tokens)
{
    return peer_dispatch_check_tensor(d, call, name, t, 2, tokens, false, d->layer.hidden, "T from prepare(), hidden",
                                      -1);
}

/* A [>= recv_rows, hidden] tensor of received rows (of dtype need_dtype when >= 0). */
static moert_result check_received_rows(const peer_dispatch *d, const char *call, const char *name,
                                        const moert_tensor *t, int64_t recv_rows, int need_dtype)
{
    return peer_dispatch_check_tensor(d, call, name, t, 2, recv_rows, true, d->layer.hidden,
                                      "capacity from prepare(), hidden", need_dtype);
}

/* Two optional prob tensors, given together or not at all (named in the message in this order). */
static moert_result check_probs_together(const peer_dispatch *d, const char *call, const char *first_name,
                                         const moert_tensor *first, const char *second_name, const moert_tensor *second)
{
    if ((first == NULL) == (second == NULL)) return MOERT_OK;
    return peer_dispatch_fail(d, MOERT_ERR_INVALID_ARGUMENT, "%s: %s and %s must be given together (or both NULL)",
                              call, first_name, second_name);
}

/* Probs per token copy, [T, topk], when given. */
static moert_result check_token_probs(const peer_dispatch *d, const char *call, const char *name, const moert_tensor *t,
                                      int64_t tokens)
{
    if (!t) return MOERT_OK;
    return peer_dispatch_check_tensor(d, call, name, t, 2, tokens, false, d->layer.topk, "T from prepare(), topk", -1);
}

/* Probs per received row, [>= recv_rows], when given. */
static moert_result check_row_probs(const peer_dispatch *d, const char *call, const char *name, const moert_tensor *t,
                                    int64_t recv_rows)
{
    if (!t) return MOERT_OK;
    return peer_dispatch_check_tensor(d, call, name, t, 1, recv_rows, true, 0, "capacity from prepare()", -1);
}

moert_result peer_dispatch_check_dispatch(const peer_dispatch *d, const moert_dispatch_args *args, int64_t tokens,
                                          int64_t recv_rows)
{
    const char *call = "dispatch()";
    moert_result rc = check_call(d, call, args, args ? args->struct_size : 0, sizeof *args, false);
    if (rc == MOERT_OK) rc = check_token_rows(d, call, "x", args->x, tokens);
    if (rc == MOERT_OK) rc = check_received_rows(d, call, "recv_x", args->recv_x, recv_rows, args->x->dtype);
    if (rc == MOERT_OK)
        rc = check_probs_together(d, call, "topk_probs", args->topk_probs, "recv_probs", args->recv_probs);
    if (rc == MOERT_OK) rc = check_token_probs(d, call, "topk_probs", args->topk_probs, tokens);
    if (rc == MOERT_OK) rc = check_row_probs(d, call, "recv_probs", args->recv_probs, recv_rows);
    return rc;
}

moert_result peer_dispatch_check_combine(const peer_dispatch *d, const moert_combine_args *args, int64_t tokens,
                                         int64_t recv_rows)
{
    const char *call = "combine()";
    moert_result rc = check_call(d, call, args, args ? args->struct_size : 0, sizeof *args, true);
    if (rc == MOERT_OK) rc = check_received_rows(d, call, "y_expert", args->y_expert, recv_rows, -1);
    if (rc == MOERT_OK) rc = check_token_rows(d, call, "y", args->y, tokens);
    return rc;
}

moert_result peer_dispatch_check_combine_backward(const peer_dispatch *d, const moert_combine_backward_args *args,
                                                  int64_t tokens, int64_t recv_rows)
{
    const char *call = "combine_backward()";
    moert_result rc = check_call(d, call, args, args ? args->struct_size : 0, sizeof *args, false);
    if (rc == MOERT_OK) rc = check_token_rows(d, call, "d_y", args->d_y, tokens);
    if (rc == MOERT_OK) rc = check_received_rows(d, call, "d_y_expert", args->d_y_expert, recv_rows, args->d_y->dtype);
    return rc;
}

moert_result peer_dispatch_check_dispatch_backward(const peer_dispatch *d, const moert_dispatch_backward_args *args,
                                                   int64_t tokens, int64_t recv_rows)
{
    const char *call = "dispatch_backward()";
    moert_result rc = check_call(d, call, args, args ? args->struct_size : 0, sizeof *args, true);
    if (rc == MOERT_OK) rc = check_received_rows(d, call, "d_recv_x", args->d_recv_x, recv_rows, -1);
    if (rc == MOERT_OK) rc = check_token_rows(d, call, "d_x", args->d_x, tokens);
    if (rc == MOERT_OK)
        rc = check_probs_together(d, call, "d_recv_probs", args->d_recv_probs, "d_topk_probs", args->d_topk_probs);
    if (rc == MOERT_OK) rc = check_row_probs(d, call, "d_recv_probs", args->d_recv_probs, recv_rows);
    if (rc == MOERT_OK) rc = check_token_probs(d, call, "d_topk_probs", args->d_topk_probs, tokens);
    return rc;
}

bool peer_dispatch_wait_text(const peer_dispatch *d, int kind, int peer, char *why, size_t size)
{
    if (kind == PEER_WAIT_ARRIVAL)
        snprintf(why, size, "rank %d did not deliver its rows within %lld ms (timeout_ms)", peer,
                 (long long)d->timeout_ms);
    else if (kind == PEER_WAIT_CONSUMED)
        snprintf(why, size, "rank %d did not read the rows of the previous call within %lld ms (timeout_ms)", peer,
                 (long long)d->timeout_ms);
    else
        return false;
    return true;
}

moert_result peer_dispatch_alloc_failed(const peer_dispatch *d, moert_result rc)
{
    char dev[32];
    if (rc != MOERT_ERR_UNSUPPORTED || !d->on_cuda) return rc;
    return peer_dispatch_fail(d, rc,
                              "the host serving this instance cannot allocate on %s (a CPU-only host): only a "
                              "CPU path can run here",
                              moert_arg_device_text(d->layer.device, dev, sizeof dev));
}

/* ---- prepare() ---- */

moert_result peer_dispatch_prepare_begin(peer_dispatch *d, const moert_dispatch_layout *layout)
{
    d->prepared = false;
    d->dispatched = false;
    if (d->broken != MOERT_OK) return peer_dispatch_fail(d, d->broken, "prepare(): %s", d->broken_msg);
    return peer_dispatch_check_layout(d, layout);
}

moert_result peer_dispatch_bad_expert(const peer_dispatch *d, const moert_tensor *topk_idx, int64_t bad)
{
    const int64_t K = d->layer.topk;
    return peer_dispatch_fail(d, MOERT_ERR_INVALID_ARGUMENT,
                              "prepare(): topk_idx[%lld][%lld] is %d, expected an "
                              "expert id in [0, %lld) or -1 (dropped)",
                              (long long)(bad / K), (long long)(bad % K), (int)((const int32_t *)topk_idx->data)[bad],
                              (long long)d->layer.num_experts);
}

moert_result peer_dispatch_check_peer_prepare(const peer_dispatch *d, int s, int64_t status, int64_t channels)
{
    if (status != 0)
        return peer_dispatch_fail(d, MOERT_ERR_INVALID_ARGUMENT,
                                  "prepare(): rank %d failed its prepare() (see its "
                                  "error), so this step cannot dispatch",
                                  s);
    if (channels != d->channels)
        return peer_dispatch_fail(d, MOERT_ERR_CONFIG,
                                  "prepare(): rank %d sends with %lld blocks (num_sms), this "
                                  "rank with %lld: every rank needs the same num_sms",
                                  s, (long long)channels, (long long)d->channels);
    return MOERT_OK;
}

void peer_dispatch_prepare_done(peer_dispatch *d, moert_dispatch_layout *layout, int64_t tokens, int64_t num_recv,
                                int64_t rows, void *counts, int64_t *counts_host, const int64_t *sent_to)
{
    d->step_tokens = tokens;
    d->step_rows = rows;
    d->step_sent_to = sent_to;
    layout->num_recv = num_recv;
    layout->capacity = rows;
    layout->tokens_per_expert = moert_tensor_1d(counts, d->layer.device, MOERT_I64, d->layer.num_local_experts);
    layout->tokens_per_expert_host = counts_host;
    d->prepared = true;
    if (num_recv >= 0) peer_dispatch_metric(d, "dispatch.recv_tokens", (double)num_recv, "tokens");
}

/* ---- the calls after prepare() ---- */

moert_result peer_dispatch_check_status(peer_dispatch *d)
{
    if (d->on_cuda && d->broken == MOERT_OK && d->cuda && d->cuda->check_status) return d->cuda->check_status(d);
    return MOERT_OK;
}

/* A dispatch-like call (dispatch, combine_backward) on the instance's path; a success lets combine-like calls run. */
static moert_result dispatch_like(peer_dispatch *d, moert_stream stream, const char *call, int call_id, bool fp8,
                                  const moert_tensor *x, const moert_tensor *probs, moert_tensor *out,
                                  moert_tensor *out_probs)
{
    moert_result rc;
#ifdef MOERT_HAVE_CUDA
    if (d->on_cuda) {
        rc = peer_dispatch_cuda_dispatch_dtypes(d, call, x, probs, out_probs);
        if (rc == MOERT_OK) rc = d->cuda->dispatch_like(d, stream, call, call_id, fp8, x, probs, out, out_probs);
    } else
#endif
    {
        (void)stream;
        (void)call_id;
        rc = peer_dispatch_cpu_dispatch(d, call, ++d->seq, d->recv_meta, &d->route, fp8, x, probs, out, out_probs);
    }
    if (rc == MOERT_OK) d->dispatched = true;
    return rc;
}

/* A combine-like call (combine, dispatch_backward) on the instance's path. */
static moert_result combine_like(peer_dispatch *d, moert_stream stream, const char *call, int call_id,
                                 const moert_tensor *rows, const moert_tensor *row_probs, moert_tensor *out,
                                 bool accumulate, moert_tensor *out_probs)
{
#ifdef MOERT_HAVE_CUDA
    if (d->on_cuda) {
        moert_result rc = peer_dispatch_cuda_combine_dtypes(d, call, rows, out, row_probs, out_probs);
        if (rc != MOERT_OK) return rc;
        return d->cuda->combine_like(d, stream, call, call_id, rows, row_probs, out, accumulate, out_probs);
    }
#endif
    (void)stream;
    (void)call_id;
    return peer_dispatch_cpu_combine(d, call, ++d->seq, d->recv_meta, &d->route, rows, row_probs, out, accumulate,
                                     out_probs);
}

/* Sends each token once to every rank holding one of its experts; the receiver writes it into its copies' rows. */
moert_result peer_dispatch_run_dispatch(void *ctx, moert_stream stream, const moert_dispatch_args *args)
{
    peer_dispatch *d = ctx;
    moert_result rc = peer_dispatch_check_status(d);
    if (rc == MOERT_OK) rc = peer_dispatch_check_dispatch(d, args, d->step_tokens, d->step_rows);
    if (rc == MOERT_OK)
        rc = dispatch_like(d, stream, "dispatch()", PEER_CALL_DISPATCH, d->fp8, args->x, args->topk_probs, args->recv_x,
                           args->recv_probs);
    if (rc != MOERT_OK || !d->step_sent_to) return rc;
    const int64_t H = d->layer.hidden;
    peer_dispatch_report_sent(d, d->step_sent_to,
                              d->fp8 ? peer_fp8_row_bytes(H) : (size_t)H * moert_dtype_size(args->x->dtype));
    return MOERT_OK;
}

/* Each expert rank sums its copies of a token into one partial row and sends it back; the token's rank sums the
 * partials in rank order (fp32; fp64 for fp64 rows) into y, overwritten. */
moert_result peer_dispatch_run_combine(void *ctx, moert_stream stream, const moert_combine_args *args)
{
    peer_dispatch *d = ctx;
    moert_result rc = peer_dispatch_check_status(d);
    if (rc == MOERT_OK) rc = peer_dispatch_check_combine(d, args, d->step_tokens, d->step_rows);
    if (rc != MOERT_OK) return rc;
    return combine_like(d, stream, "combine()", PEER_CALL_COMBINE, args->y_expert, NULL, args->y, false, NULL);
}

/* The adjoint of combine: a dispatch of d_y's rows (as they are, no probs). */
moert_result peer_dispatch_run_combine_backward(void *ctx, moert_stream stream, const moert_combine_backward_args *args)
{
    peer_dispatch *d = ctx;
    moert_result rc = peer_dispatch_check_status(d);
    if (rc == MOERT_OK) rc = peer_dispatch_check_combine_backward(d, args, d->step_tokens, d->step_rows);
    if (rc != MOERT_OK) return rc;
    return dispatch_like(d, stream, "combine_backward()", PEER_CALL_COMBINE_BACKWARD, false, args->d_y, NULL,
                         args->d_y_expert, NULL);
}

/* The adjoint of dispatch: a combine of d_recv_x added into d_x, and each row's prob gradient to its (t, k) slot. */
moert_result peer_dispatch_run_dispatch_backward(void *ctx, moert_stream stream,
                                                 const moert_dispatch_backward_args *args)
{
    peer_dispatch *d = ctx;
    moert_result rc = peer_dispatch_check_status(d);
    if (rc == MOERT_OK) rc = peer_dispatch_check_dispatch_backward(d, args, d->step_tokens, d->step_rows);
    if (rc != MOERT_OK) return rc;
    return combine_like(d, stream, "dispatch_backward()", PEER_CALL_DISPATCH_BACKWARD, args->d_recv_x,
                        args->d_recv_probs, args->d_x, true, args->d_topk_probs);
}

/* ---- the peer buffer ---- */

moert_result peer_dispatch_buffer_setup(peer_dispatch *d, int64_t rows_cap, size_t row_bytes,
                                        int64_t notify_row_entries)
{
    const moert_host *h = d->host;
    size_t bytes = peer_geometry_make(&d->geo, d->world, d->layer.topk, rows_cap, row_bytes, notify_row_entries);
    moert_result rc = h->alloc(h, d->layer.device, bytes, &d->buf);
    if (rc != MOERT_OK) return peer_dispatch_alloc_failed(d, rc);
    d->buf_bytes = bytes;
#ifdef MOERT_HAVE_CUDA
    if (d->on_cuda) {
        rc = peer_dispatch_cuda_zero(h, d->buf, d->geo.header_bytes);
        if (rc != MOERT_OK) return rc;
    }
#endif
    d->seq = 0;
    if (d->world == 1) {
        d->peers[0] = d->buf;
        return MOERT_OK;
    }
    return h->exchange_peer_buffers(h, d->buf, bytes, d->layer.device, d->peers);
}

#ifdef MOERT_HAVE_CUDA
/* Waits (polling, at most timeout_ms) until every rank's release stamp in this buffer's header has reached the last
 * call's number (seq, or the one at device_seq when not NULL) in the first `channels` channels. Returns -1 when done,
 * else the rank that did not (0 when the device cannot be read). */
static int cuda_wait_released(void *local, int world, int channels, const int64_t *device_seq, int64_t seq,
                              int64_t timeout_ms)
{
    int64_t stamps[PEER_MAX_RANKS][PEER_MAX_CHANNELS];
    const peer_header *h = (const peer_header *)local;
    struct timespec t0, now;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    if (device_seq && cudaMemcpy(&seq, device_seq, sizeof seq, cudaMemcpyDeviceToHost) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    for (;;) {
        int late = -1;
        if (cudaMemcpy(stamps, h->consumed, sizeof stamps, cudaMemcpyDeviceToHost) != cudaSuccess) {
            (void)cudaGetLastError();
            return 0;
        }
        for (int d = 0; d < world && late < 0; d++)
            for (int c = 0; c < channels; c++)
                if (stamps[d][c] < seq) {
                    late = d;
                    break;
                }
        if (late < 0) return -1;
        clock_gettime(CLOCK_MONOTONIC, &now);
        double ms = (double)(now.tv_sec - t0.tv_sec) * 1e3 + (double)(now.tv_nsec - t0.tv_nsec) * 1e-6;
        if (ms > (double)timeout_ms) return late;
        struct timespec pause = {0, 200000};
        nanosleep(&pause, NULL);
    }
}
#endif

void peer_dispatch_buffer_release(peer_dispatch *d, int channels, const int64_t *device_seq)
{
    bool leave = false; /* a peer may still read the buffer: it stays allocated (leaked) rather than freed under it */
    if (d->buf && d->seq > 0 && d->broken == MOERT_OK) {
        int late = -1;
#ifdef MOERT_HAVE_CUDA
        if (d->on_cuda)
            late = cuda_wait_released(d->buf, d->world, channels, device_seq, d->seq, d->timeout_ms);
        else
#endif
            late = peer_cpu_wait_released(d->buf, d->world, d->seq, d->timeout_ms);
        if (late >= 0) {
            d->host->log(d->host, MOERT_LOG_WARN,
                         "rank %d did not release this rank's rows of call %lld within %lld ms; leaving the buffer "
                         "allocated (%lld bytes), since that rank may still read it",
                         late, (long long)d->seq, (long long)d->timeout_ms, (long long)d->buf_bytes);
            leave = true;
        }
    }
    if (d->buf && !leave) d->host->free(d->host, d->layer.device, d->buf);
    d->buf = NULL;
    d->buf_bytes = 0;
}

/* ---- the CPU path's calls ---- */

peer_cpu_link peer_dispatch_cpu_link(peer_dispatch *d, int64_t seq, int64_t *recv_meta, char *error, size_t error_size)
{
    peer_cpu_link l = {.geo = &d->geo,
                       .local = d->buf,
                       .peers = d->peers,
                       .rank = d->rank,
                       .seq = seq,
                       .timeout_ms = d->timeout_ms,
                       .recv_meta = recv_meta,
                       .recv_rows = d->recv_rows,
                       .error = error,
                       .error_size = error_size};
    return l;
}

moert_result peer_dispatch_cpu_dispatch(peer_dispatch *d, const char *call, int64_t seq, int64_t *recv_meta,
                                        const peer_cpu_route *route, bool fp8, const moert_tensor *x,
                                        const moert_tensor *probs, moert_tensor *out, moert_tensor *out_probs)
{
    char why[256] = "";
    peer_cpu_link l = peer_dispatch_cpu_link(d, seq, recv_meta, why, sizeof why);
    int r = peer_cpu_dispatch(&l, route, d->layer.hidden, fp8, x->data, x->dtype, probs ? probs->data : NULL,
                              probs ? probs->dtype : MOERT_F64, out->data, out->dtype,
                              out_probs ? out_probs->data : NULL, out_probs ? out_probs->dtype : MOERT_F64);
    if (r > 0) return peer_dispatch_mark_broken(d, MOERT_ERR_TIMEOUT, call, why);
    if (r < 0) return peer_dispatch_fail(d, MOERT_ERR_OUT_OF_MEMORY, "%s: %s", call, why);
    return MOERT_OK;
}

moert_result peer_dispatch_cpu_combine(peer_dispatch *d, const char *call, int64_t seq, int64_t *recv_meta,
                                       const peer_cpu_route *route, const moert_tensor *rows,
                                       const moert_tensor *row_probs, moert_tensor *out, bool accumulate,
                                       moert_tensor *out_probs)
{
    char why[256] = "";
    peer_cpu_link l = peer_dispatch_cpu_link(d, seq, recv_meta, why, sizeof why);
    int r = peer_cpu_combine(&l, route, d->layer.hidden, rows->data, rows->dtype, row_probs ? row_probs->data : NULL,
                             row_probs ? row_probs->dtype : MOERT_F64, out->data, out->dtype, accumulate,
                             out_probs ? out_probs->data : NULL, out_probs ? out_probs->dtype : MOERT_F64);
    if (r > 0) return peer_dispatch_mark_broken(d, MOERT_ERR_TIMEOUT, call, why);
    if (r < 0) return peer_dispatch_fail(d, MOERT_ERR_OUT_OF_MEMORY, "%s: %s", call, why);
    return MOERT_OK;
}

void peer_dispatch_report_sent(const peer_dispatch *d, const int64_t *tokens_to, size_t row_bytes)
{
    double sent = 0;
    for (int r = 0; r < d->world; r++)
        if (r != d->rank) sent += (double)tokens_to[r] * (double)(row_bytes + d->geo.meta_stride);
    peer_dispatch_metric(d, "dispatch.bytes_sent", sent, "bytes");
}

/* ---- the CUDA path ---- */

/* A row or prob tensor on CUDA: NULL or of dtype `want`. */
static moert_result cuda_check_dtype(const peer_dispatch *d, const char *call, const char *name, const moert_tensor *t,
                                     moert_dtype want)
{
    if (!t || t->dtype == want) return MOERT_OK;
    return peer_dispatch_fail(d, MOERT_ERR_UNSUPPORTED, "%s: %s has dtype %s; the CUDA path takes %s here", call, name,
                              moert_dtype_name(t->dtype), moert_dtype_name(want));
}

moert_result peer_dispatch_cuda_dispatch_dtypes(const peer_dispatch *d, const char *call, const moert_tensor *x,
                                                const moert_tensor *probs, const moert_tensor *out_probs)
{
    moert_result rc = cuda_check_dtype(d, call, "rows", x, d->layer.dtype);
    if (rc == MOERT_OK) rc = cuda_check_dtype(d, call, "probs", probs, MOERT_F32);
    if (rc == MOERT_OK) rc = cuda_check_dtype(d, call, "probs out", out_probs, MOERT_F32);
    return rc;
}

moert_result peer_dispatch_cuda_combine_dtypes(const peer_dispatch *d, const char *call, const moert_tensor *rows,
                                               const moert_tensor *out, const moert_tensor *row_probs,
                                               const moert_tensor *out_probs)
{
    moert_result rc = cuda_check_dtype(d, call, "rows", rows, d->layer.dtype);
    if (rc == MOERT_OK) rc = cuda_check_dtype(d, call, "out", out, d->layer.dtype);
    if (rc == MOERT_OK) rc = cuda_check_dtype(d, call, "row probs", row_probs, MOERT_F32);
    if (rc == MOERT_OK) rc = cuda_check_dtype(d, call, "probs out", out_probs, MOERT_F32);
    return rc;
}

#ifdef MOERT_HAVE_CUDA
moert_result peer_dispatch_cuda_check_layer(const peer_dispatch *d, int64_t max_experts)
{
    const int id = (int)d->layer.device.id;
    char dev[32];
    moert_arg_device_text(d->layer.device, dev, sizeof dev);
    MOK(check_cuda_device_visible(d->host, id, dev));
    if (d->layer.num_experts > max_experts)
        return peer_dispatch_fail(d, MOERT_ERR_UNSUPPORTED,
                                  "the %s dispatcher's CUDA path takes at most %lld experts, "
                                  "the layer has %lld",
                                  d->name, (long long)max_experts, (long long)d->layer.num_experts);
    if (d->layer.topk > 32)
        return peer_dispatch_fail(d, MOERT_ERR_UNSUPPORTED,
                                  "the %s dispatcher's CUDA path takes topk <= 32 (a warp's "
                                  "lanes), the layer has %lld",
                                  d->name, (long long)d->layer.topk);
    if (d->layer.dtype != MOERT_BF16 && d->layer.dtype != MOERT_F32)
        return peer_dispatch_fail(d, MOERT_ERR_UNSUPPORTED,
                                  "the %s dispatcher's CUDA path moves bf16 or fp32 rows, "
                                  "the layer is %s",
                                  d->name, moert_dtype_name(d->layer.dtype));
    return MOERT_OK;
}

/* What each rank tells the others about its device for the reachability check. */
typedef struct peer_device_record {
    char host[64]; /* gethostname: ranks on different hosts never reach each other by peer access */
    char pci[32];  /* cudaDeviceGetPCIBusId of the layer's device: finds it among this process's devices */
    int32_t device;
    int32_t pad;
} peer_device_record;

/* Whether this rank's device `mine` can reach the device of record `peer` (same host, then peer access). */
static bool device_reaches(const peer_device_record *self, const peer_device_record *peer, int mine)
{
    if (strcmp(self->host, peer->host) != 0) return false;
    if (strcmp(self->pci, peer->pci) == 0) return true; /* the same GPU */
    int theirs = -1, can = 0;
    if (cudaDeviceGetByPCIBusId(&theirs, peer->pci) != cudaSuccess) {
        (void)cudaGetLastError();
        return true; /* hidden from this process: cannot be asked about here */
    }
    if (cudaDeviceCanAccessPeer(&can, mine, theirs) != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
    }
    return can != 0;
}

moert_result peer_dispatch_cuda_check_reach(peer_dispatch *d)
{
    const moert_host *h = d->host;
    const int W = d->world, mine = (int)d->layer.device.id;
    if (W == 1) return MOERT_OK;
    peer_device_record records[PEER_MAX_RANKS];
    unsigned char row[PEER_MAX_RANKS], matrix[PEER_MAX_RANKS * PEER_MAX_RANKS];
    peer_device_record self;
    memset(&self, 0, sizeof self);
    if (gethostname(self.host, sizeof self.host - 1) != 0) snprintf(self.host, sizeof self.host, "unknown host");
    self.device = mine;
    cudaError_t err = cudaDeviceGetPCIBusId(self.pci, (int)sizeof self.pci, mine);
    if (err != cudaSuccess) {
        (void)cudaGetLastError();
        snprintf(self.pci, sizeof self.pci, "rank %d", d->rank);
    }
    moert_result rc = h->allgather(h, &self, records, sizeof self, moert_cpu(), NULL);
    if (rc != MOERT_OK) return rc;
    for (int r = 0; r < W; r++) row[r] = r == d->rank || device_reaches(&self, &records[r], mine);
    rc = h->allgather(h, row, matrix, (size_t)W, moert_cpu(), NULL);
    if (rc != MOERT_OK) return rc;
    char labels[PEER_MAX_RANKS][96];
    const char *where[PEER_MAX_RANKS];
    for (int r = 0; r < W; r++) {
        snprintf(labels[r], sizeof labels[r], "%.63s cuda:%d", records[r].host, (int)records[r].device);
        where[r] = labels[r];
    }
    char msg[2048];
    if (peer_reach_unreachable(W, matrix, where, d->name, msg, sizeof msg) == 0) return MOERT_OK;
    return peer_dispatch_fail(d, MOERT_ERR_UNSUPPORTED, "%s", msg);
}

moert_result peer_dispatch_cuda_sm_count(const peer_dispatch *d, int *sms)
{
    char dev[32];
    cudaError_t err = cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, (int)d->layer.device.id);
    if (err == cudaSuccess) return MOERT_OK;
    (void)cudaGetLastError();
    return peer_dispatch_fail(d, MOERT_ERR_CUDA, "cudaDeviceGetAttribute(MultiProcessorCount) on %s failed: %s",
                              moert_arg_device_text(d->layer.device, dev, sizeof dev), cudaGetErrorString(err));
}

moert_result peer_dispatch_cuda_zero(const moert_host *host, void *ptr, size_t bytes)
{
    CUDA_CHECK(host, cudaMemsetAsync(ptr, 0, bytes, 0));
    CUDA_CHECK(host, cudaStreamSynchronize(0));
    return MOERT_OK;
}
#endif
