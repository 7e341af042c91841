/* SPDX-License-Identifier: Apache-2.0 */
/* The host-collective dispatchers' shared host side (see dispatch_common.h). */
#include "dispatch_common.h"

#include <stdlib.h>
#include <string.h>

#include "plugin_report.h"
#include "tensor_args.h"

/* ---- buffers ---- */

moert_result moert_dispatch_buffer_reserve(const moert_host *host, moert_device dev, moert_dispatch_buffer *buf,
                                           size_t bytes)
{
    if (bytes < 64) bytes = 64; /* never hand a NULL pointer to the communicator */
    if (buf->bytes >= bytes) return MOERT_OK;
    moert_dispatch_buffer_release(host, dev, buf);
    size_t grown = bytes + bytes / 2; /* some slack: routing changes from step to step */
    moert_result rc = host->alloc(host, dev, grown, &buf->data);
    if (rc != MOERT_OK) return rc;
    buf->bytes = grown;
    return MOERT_OK;
}

moert_result moert_dispatch_buffer_reserve_first(const moert_host *host, moert_device dev, moert_dispatch_buffer *buf,
                                                 size_t bytes)
{
    moert_result rc = moert_dispatch_buffer_reserve(host, dev, buf, bytes);
    if (rc != MOERT_ERR_UNSUPPORTED) return rc;
    char text[32];
    return report(host, rc,
                  "the host serving this instance cannot allocate on %s (a CPU-only host): only a CPU path is usable "
                  "with it",
                  moert_arg_device_text(dev, text, sizeof text));
}

void moert_dispatch_buffer_release(const moert_host *host, moert_device dev, moert_dispatch_buffer *buf)
{
    if (buf->data) host->free(host, dev, buf->data);
    buf->data = NULL;
    buf->bytes = 0;
}

moert_result moert_dispatch_pinned_reserve(const moert_host *host, void **ptr, size_t *have, size_t bytes)
{
    if (bytes < 64) bytes = 64;
    if (*have >= bytes && *ptr) return MOERT_OK;
    if (*ptr) host->free_pinned(host, *ptr);
    *ptr = NULL;
    *have = 0;
    size_t grown = bytes + bytes / 2;
    moert_result rc = host->alloc_pinned(host, grown, ptr);
    if (rc != MOERT_OK) return rc;
    *have = grown;
    return MOERT_OK;
}

/* ---- host plumbing ---- */

void moert_dispatch_metric(const moert_host *host, const char *name, double value, const char *unit)
{
    if (host->struct_size >= offsetof(moert_host, metric) + sizeof host->metric && host->metric)
        host->metric(host, name, value, unit);
}

moert_result moert_dispatch_copy(const moert_host *host, moert_device dev, moert_stream stream, void *dst,
                                 const void *src, size_t bytes)
{
    if (!bytes) return MOERT_OK;
    if (dev.type == MOERT_DEVICE_CUDA) return host->memcpy_async(host, dst, dev, src, dev, bytes, stream);
    memcpy(dst, src, bytes);
    return MOERT_OK;
}

bool moert_dispatch_alltoallv_alloc(moert_dispatch_alltoallv *v, int world)
{
    v->send_bytes = calloc((size_t)world, sizeof(size_t));
    v->send_offsets = calloc((size_t)world, sizeof(size_t));
    v->recv_bytes = calloc((size_t)world, sizeof(size_t));
    v->recv_offsets = calloc((size_t)world, sizeof(size_t));
    return v->send_bytes && v->send_offsets && v->recv_bytes && v->recv_offsets;
}

void moert_dispatch_alltoallv_free(moert_dispatch_alltoallv *v)
{
    free(v->send_bytes);
    free(v->send_offsets);
    free(v->recv_bytes);
    free(v->recv_offsets);
    memset(v, 0, sizeof *v);
}

moert_result moert_dispatch_exchange_rows(const moert_host *host, moert_device dev, moert_stream stream,
                                          moert_dispatch_alltoallv *v, int world, int peers, int first_peer,
                                          int peer_stride, const void *send, const int64_t *send_rows, void *recv,
                                          const int64_t *recv_rows, size_t row_bytes)
{
    if (peers == 1) return moert_dispatch_copy(host, dev, stream, recv, send, (size_t)send_rows[0] * row_bytes);
    for (int r = 0; r < world; r++) v->send_bytes[r] = v->send_offsets[r] = v->recv_bytes[r] = v->recv_offsets[r] = 0;
    size_t send_at = 0, recv_at = 0;
    for (int i = 0; i < peers; i++) {
        const int r = first_peer + i * peer_stride;
        v->send_bytes[r] = (size_t)send_rows[i] * row_bytes;
        v->send_offsets[r] = send_at;
        send_at += v->send_bytes[r];
        v->recv_bytes[r] = (size_t)recv_rows[i] * row_bytes;
        v->recv_offsets[r] = recv_at;
        recv_at += v->recv_bytes[r];
    }
    return host->alltoallv(host, send, v->send_bytes, v->send_offsets, recv, v->recv_bytes, v->recv_offsets, dev,
                           stream);
}

double moert_dispatch_bytes_to_peers(const int64_t *rows, int peers, int self, double row_bytes)
{
    double total = 0;
    for (int i = 0; i < peers; i++)
        if (i != self) total += (double)rows[i] * row_bytes;
    return total;
}

/* ---- argument checks ---- */

/* One tensor argument of `call` on the step's device (plugins/lib/tensor_args.h). */
static moert_result check_tensor(const moert_host *host, const moert_dispatch_step_shape *s, const char *call,
                                 const char *name, const moert_tensor *t, int ndim, int64_t rows, bool rows_at_least,
                                 int64_t cols, const char *rows_what, int need_dtype)
{
    return moert_arg_check_tensor(host, s->device, call, name, t, ndim, rows, rows_at_least, cols, rows_what,
                                  need_dtype);
}

/* What every call after prepare() checks first: prepare() succeeded, args is there and big enough. */
static moert_result check_call(const moert_host *host, const moert_dispatch_step_shape *s, const char *call,
                               const void *args, uint32_t struct_size, size_t expected_size)
{
    if (!s->prepared) return report(host, MOERT_ERR_INVALID_ARGUMENT, "%s: called before a successful prepare()", call);
    if (!args) return report(host, MOERT_ERR_INVALID_ARGUMENT, "%s: args is NULL", call);
    return moert_arg_check_struct_size(host, call, "args", struct_size, expected_size);
}

moert_result moert_dispatch_check_dispatch(const moert_host *host, const moert_dispatch_step_shape *s,
                                           const moert_dispatch_args *args)
{
    const char *call = "dispatch()";
    const int64_t T = s->tokens, H = s->hidden, K = s->topk, cap = s->capacity;
    moert_result rc = check_call(host, s, call, args, args ? args->struct_size : 0, sizeof *args);
    if (rc == MOERT_OK) rc = check_tensor(host, s, call, "x", args->x, 2, T, false, H, "T from prepare(), hidden", -1);
    if (rc == MOERT_OK)
        rc = check_tensor(host, s, call, "recv_x", args->recv_x, 2, cap, true, H, "capacity from prepare(), hidden",
                          args->x->dtype);
    if (rc == MOERT_OK && (args->topk_probs == NULL) != (args->recv_probs == NULL))
        rc = report(host, MOERT_ERR_INVALID_ARGUMENT,
                    "%s: topk_probs and recv_probs must be given together (or both NULL)", call);
    if (rc == MOERT_OK && args->topk_probs)
        rc = check_tensor(host, s, call, "topk_probs", args->topk_probs, 2, T, false, K, "T from prepare(), topk", -1);
    if (rc == MOERT_OK && args->recv_probs)
        rc =
            check_tensor(host, s, call, "recv_probs", args->recv_probs, 1, cap, true, 0, "capacity from prepare()", -1);
    return rc;
}

moert_result moert_dispatch_check_combine(const moert_host *host, const moert_dispatch_step_shape *s,
                                          const moert_combine_args *args)
{
    const char *call = "combine()";
    moert_result rc = check_call(host, s, call, args, args ? args->struct_size : 0, sizeof *args);
    if (rc == MOERT_OK)
        rc = check_tensor(host, s, call, "y_expert", args->y_expert, 2, s->capacity, true, s->hidden,
                          "capacity from prepare(), hidden", -1);
    if (rc == MOERT_OK)
        rc = check_tensor(host, s, call, "y", args->y, 2, s->tokens, false, s->hidden, "T from prepare(), hidden", -1);
    return rc;
}

moert_result moert_dispatch_check_combine_backward(const moert_host *host, const moert_dispatch_step_shape *s,
                                                   const moert_combine_backward_args *args)
{
    const char *call = "combine_backward()";
    moert_result rc = check_call(host, s, call, args, args ? args->struct_size : 0, sizeof *args);
    if (rc == MOERT_OK)
        rc = check_tensor(host, s, call, "d_y", args->d_y, 2, s->tokens, false, s->hidden, "T from prepare(), hidden",
                          -1);
    if (rc == MOERT_OK)
        rc = check_tensor(host, s, call, "d_y_expert", args->d_y_expert, 2, s->capacity, true, s->hidden,
                          "capacity from prepare(), hidden", args->d_y->dtype);
    return rc;
}

moert_result moert_dispatch_check_dispatch_backward(const moert_host *host, const moert_dispatch_step_shape *s,
                                                    const moert_dispatch_backward_args *args)
{
    const char *call = "dispatch_backward()";
    const int64_t T = s->tokens, H = s->hidden, K = s->topk, cap = s->capacity;
    moert_result rc = check_call(host, s, call, args, args ? args->struct_size : 0, sizeof *args);
    if (rc == MOERT_OK)
        rc = check_tensor(host, s, call, "d_recv_x", args->d_recv_x, 2, cap, true, H, "capacity from prepare(), hidden",
                          -1);
    if (rc == MOERT_OK)
        rc = check_tensor(host, s, call, "d_x", args->d_x, 2, T, false, H, "T from prepare(), hidden", -1);
    if (rc == MOERT_OK && (args->d_recv_probs == NULL) != (args->d_topk_probs == NULL))
        rc = report(host, MOERT_ERR_INVALID_ARGUMENT,
                    "%s: d_recv_probs and d_topk_probs must be given together (or both NULL)", call);
    if (rc == MOERT_OK && args->d_recv_probs)
        rc = check_tensor(host, s, call, "d_recv_probs", args->d_recv_probs, 1, cap, true, 0, "capacity from prepare()",
                          -1);
    if (rc == MOERT_OK && args->d_topk_probs)
        rc = check_tensor(host, s, call, "d_topk_probs", args->d_topk_probs, 2, T, false, K, "T from prepare(), topk",
                          -1);
    return rc;
}

moert_result moert_dispatch_check_layout(const moert_host *host, const moert_dispatch_layout *layout)
{
    if (!layout) return report(host, MOERT_ERR_INVALID_ARGUMENT, "prepare(): layout is NULL");
    return moert_arg_check_struct_size(host, "prepare()", "layout", layout->struct_size, sizeof *layout);
}

moert_result moert_dispatch_check_topk_idx(const moert_host *host, moert_device dev, const moert_tensor *topk_idx,
                                           int64_t topk, int64_t *num_tokens)
{
    const char *call = "prepare()";
    char a[64];
    if (!topk_idx) return report(host, MOERT_ERR_INVALID_ARGUMENT, "%s: topk_idx is NULL", call);
    if (topk_idx->ndim != 2 || topk_idx->shape[1] != topk)
        return report(host, MOERT_ERR_INVALID_ARGUMENT,
                      "%s: topk_idx has shape %s, expected [T, %lld] (T tokens, topk)", call,
                      moert_arg_shape_text(topk_idx, a, sizeof a), (long long)topk);
    moert_result rc = moert_arg_check_tensor(host, dev, call, "topk_idx", topk_idx, 2, topk_idx->shape[0], false, topk,
                                             "T tokens, topk", MOERT_I32);
    if (rc != MOERT_OK) return rc;
    *num_tokens = topk_idx->shape[0];
    return MOERT_OK;
}

moert_result moert_dispatch_bad_expert(const moert_host *host, const int32_t *topk_idx, int64_t bad, int64_t topk,
                                       int64_t num_experts)
{
    return report(host, MOERT_ERR_INVALID_ARGUMENT,
                  "prepare(): topk_idx[%lld][%lld] is %d, expected an expert id in [0, %lld) or -1 (dropped)",
                  (long long)(bad / topk), (long long)(bad % topk), (int)topk_idx[bad], (long long)num_experts);
}

moert_result moert_dispatch_bad_expert_count(const moert_host *host, unsigned long long bad, int64_t num_experts)
{
    return report(host, MOERT_ERR_INVALID_ARGUMENT,
                  "prepare(): %llu entries of topk_idx are outside [0, %lld) and not -1 (dropped); expected expert ids",
                  bad, (long long)num_experts);
}

moert_result moert_dispatch_check_cuda_dtypes(const moert_host *host, const char *call, const char *name_a,
                                              const moert_tensor *a, const char *name_b, const moert_tensor *b)
{
    if (a->dtype != MOERT_F32 && a->dtype != MOERT_BF16)
        return report(host, MOERT_ERR_UNSUPPORTED, "%s: %s has dtype %s; the CUDA path moves fp32 or bf16", call,
                      name_a, moert_dtype_name(a->dtype));
    if (b->dtype != a->dtype)
        return report(host, MOERT_ERR_UNSUPPORTED, "%s: %s has dtype %s but %s has %s; on CUDA they must match", call,
                      name_b, moert_dtype_name(b->dtype), name_a, moert_dtype_name(a->dtype));
    return MOERT_OK;
}

moert_result moert_dispatch_exchange_counts(const moert_host *host, int world, const int64_t *row, int64_t *gathered,
                                            int64_t row_len, moert_result local_rc)
{
    const size_t bytes = (size_t)row_len * sizeof(int64_t);
    moert_result rc = MOERT_OK;
    if (world == 1)
        memcpy(gathered, row, bytes);
    else /* host memory on every device: the threads communicator serves it */
        rc = host->allgather(host, row, gathered, bytes, moert_cpu(), NULL);
    if (rc != MOERT_OK) return rc;
    if (local_rc != MOERT_OK) return local_rc;
    for (int s = 0; s < world; s++)
        if (gathered[(int64_t)s * row_len + row_len - 1] != MOERT_OK)
            return report(host, MOERT_ERR_INVALID_ARGUMENT,
                          "prepare(): rank %d failed its prepare() (see its error), so this step cannot dispatch", s);
    return MOERT_OK;
}

/* ---- CPU planning over plain arrays ---- */

moert_tensor moert_dispatch_flat_view(const void *data, moert_dtype dtype, int64_t n)
{
    return moert_tensor_1d((void *)data, moert_cpu(), dtype, n);
}

int64_t moert_dispatch_count_copies(const int32_t *topk_idx, int64_t num_tokens, int64_t topk, int64_t num_experts,
                                    int64_t *counts)
{
    memset(counts, 0, (size_t)num_experts * sizeof *counts);
    for (int64_t i = 0; i < num_tokens * topk; i++) {
        int32_t e = topk_idx[i];
        if (e == -1) continue;
        if (e < -1 || e >= num_experts) return i;
        counts[e]++;
    }
    return -1;
}

int64_t moert_dispatch_plan_groups(const int64_t *all_counts, int world, int rank, int64_t num_experts,
                                   int64_t num_local_experts, int64_t group_rows, int64_t *rows,
                                   int64_t *tokens_per_expert, int64_t *group_start)
{
    const int64_t first_local = (int64_t)rank * num_local_experts;
    int64_t total = 0;
    for (int64_t l = 0; l < num_local_experts; l++) {
        int64_t n = 0;
        for (int s = 0; s < world; s++) n += all_counts[(int64_t)s * num_experts + first_local + l];
        if (rows) rows[l] = n;
        tokens_per_expert[l] = group_rows > 0 ? group_rows : n;
        group_start[l] = total;
        total += tokens_per_expert[l];
    }
    return total;
}

void moert_dispatch_scatter_rows(const int64_t *dest, int64_t n, const void *staging, size_t row_bytes, void *grouped)
{
    const char *src = staging;
    char *dst = grouped;
    for (int64_t i = 0; i < n; i++) memcpy(dst + (size_t)dest[i] * row_bytes, src + (size_t)i * row_bytes, row_bytes);
}

void moert_dispatch_gather_rows(const int64_t *dest, int64_t n, const void *grouped, size_t row_bytes, void *staging)
{
    const char *src = grouped;
    char *dst = staging;
    for (int64_t i = 0; i < n; i++) memcpy(dst + (size_t)i * row_bytes, src + (size_t)dest[i] * row_bytes, row_bytes);
}

void moert_dispatch_scatter_probs(const int64_t *dest, int64_t n, const double *staging, void *out, moert_dtype dtype,
                                  int64_t size)
{
    moert_tensor view = moert_dispatch_flat_view(out, dtype, size);
    for (int64_t i = 0; i < n; i++) moert_store(&view, dest[i], staging[i]);
}

void moert_dispatch_gather_probs(const int64_t *dest, int64_t n, const void *probs, moert_dtype dtype, int64_t size,
                                 double *staging)
{
    moert_tensor view = moert_dispatch_flat_view(probs, dtype, size);
    for (int64_t i = 0; i < n; i++) staging[i] = moert_load(&view, dest[i]);
}

void moert_dispatch_pack_probs(const int64_t *slot, int64_t n, const void *probs, moert_dtype dtype, double *send)
{
    moert_tensor view = moert_dispatch_flat_view(probs, dtype, n);
    for (int64_t i = 0; i < n; i++)
        if (slot[i] >= 0) send[slot[i]] = moert_load(&view, i);
}

void moert_dispatch_unpack_probs(const int64_t *slot, int64_t n, const double *src, void *out, moert_dtype dtype)
{
    moert_tensor view = moert_dispatch_flat_view(out, dtype, n);
    for (int64_t i = 0; i < n; i++) moert_store(&view, i, slot[i] >= 0 ? src[slot[i]] : 0.0);
}

void moert_dispatch_sum_rows(const int64_t *row_of, int64_t tokens, int64_t per_token, const void *rows,
                             moert_dtype rows_dtype, int64_t num_rows, int64_t hidden, int accumulate, void *out,
                             moert_dtype out_dtype, double *acc)
{
    moert_tensor in = moert_dispatch_flat_view(rows, rows_dtype, num_rows * hidden);
    moert_tensor y = moert_dispatch_flat_view(out, out_dtype, tokens * hidden);
    for (int64_t t = 0; t < tokens; t++) {
        /* Starting from -0 (the additive identity, unlike +0 for a -0 row) keeps one row bit-exact. */
        for (int64_t h = 0; h < hidden; h++) acc[h] = accumulate ? moert_load(&y, t * hidden + h) : -0.0;
        int kept = 0;
        for (int64_t j = 0; j < per_token; j++) {
            int64_t r = row_of[t * per_token + j];
            if (r < 0) continue;
            kept++;
            for (int64_t h = 0; h < hidden; h++) acc[h] += moert_load(&in, r * hidden + h);
        }
        if (accumulate && kept == 0) continue; /* d_x of a token without kept copies stays as it was */
        for (int64_t h = 0; h < hidden; h++) moert_store(&y, t * hidden + h, kept ? acc[h] : 0.0);
    }
}
