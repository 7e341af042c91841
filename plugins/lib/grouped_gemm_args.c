/* SPDX-License-Identifier: Apache-2.0 */
/* Argument checks shared by the precision plugins (see grouped_gemm_args.h). */
#include "grouped_gemm_args.h"
#include "tensor_args.h"

#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>

#include "plugin_report.h"

/* What the checks need: where errors go and which layer the GEMM belongs to. */
typedef struct gemm_check {
    const moert_host *host;
    const moert_layer_info *layer;
    moert_gemm_fetch_counts fetch;
    void *user;
} gemm_check;

/* Sets the instance's error message and returns code, so checks can `return fail(...)`. */
#define fail(c, ...) report((c)->host, __VA_ARGS__)

const char *moert_gemm_dims_text(int ndim, const int64_t *shape, char *buf, size_t size)
{
    size_t used = (size_t)snprintf(buf, size, "[");
    for (int i = 0; i < ndim && used < size; i++)
        used += (size_t)snprintf(buf + used, size - used, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (used < size) snprintf(buf + used, size - used, "]");
    return buf;
}

#define dims_text moert_gemm_dims_text

/* Whether a tensor's memory is the layer's device (the same CUDA ordinal on CUDA). */
static bool on_layer_device(const gemm_check *c, moert_device d)
{
    if (d.type != c->layer->device.type) return false;
    return d.type != MOERT_DEVICE_CUDA || d.id == c->layer->device.id;
}

/*
 * Checks one tensor argument: present, on the layer's device, a float dtype, contiguous, with data, and of
 * shape `want` (ndim dims); `why` explains where the expected sizes come from.
 */
static moert_result check_tensor(const gemm_check *c, const char *call, const char *name, const moert_tensor *t,
                                 int ndim, const int64_t *want, const char *why)
{
    char a[64], b[64];
    if (!t) return fail(c, MOERT_ERR_INVALID_ARGUMENT, "%s: %s is NULL", call, name);
    if (!on_layer_device(c, t->device))
        return fail(c, MOERT_ERR_UNSUPPORTED, "%s: %s is on %s, but the layer is on %s", call, name,
                    moert_arg_device_text(t->device, a, sizeof a),
                    moert_arg_device_text(c->layer->device, b, sizeof b));
    if (t->dtype != MOERT_F32 && t->dtype != MOERT_F64 && t->dtype != MOERT_BF16 && t->dtype != MOERT_F16)
        return fail(c, MOERT_ERR_UNSUPPORTED, "%s: %s has dtype %s, expected fp32, fp64, bf16 or fp16", call, name,
                    moert_dtype_name(t->dtype));
    bool same = t->ndim == ndim;
    for (int i = 0; same && i < ndim; i++) same = t->shape[i] == want[i];
    if (!same)
        return fail(c, MOERT_ERR_INVALID_ARGUMENT, "%s: %s has shape %s, expected %s (%s)", call, name,
                    dims_text(t->ndim, t->shape, a, sizeof a), dims_text(ndim, want, b, sizeof b), why);
    if (!moert_tensor_is_contiguous(t))
        return fail(c, MOERT_ERR_INVALID_ARGUMENT, "%s: %s must be contiguous (row-major)", call, name);
    if (!t->data && moert_tensor_numel(t) > 0)
        return fail(c, MOERT_ERR_INVALID_ARGUMENT, "%s: %s has no data", call, name);
    return MOERT_OK;
}

/*
 * The rows per expert, from the host array or the tensor (on the CPU read in place; on the layer's CUDA device
 * through the plugin's fetch: the one host sync, only when no host copy is given).
 * Checks length and signs.
 */
static moert_result read_counts(const gemm_check *c, const char *call, const moert_grouped_gemm_args *args,
                                const int64_t **counts)
{
    const int64_t El = c->layer->num_local_experts;
    const moert_tensor *t = args->tokens_per_expert;
    char a[64], b[64];
    if (t && (t->dtype != MOERT_I64 || t->ndim != 1 || t->shape[0] != El))
        return fail(c, MOERT_ERR_INVALID_ARGUMENT,
                    "%s: tokens_per_expert is %s %s, expected int64 [%lld] "
                    "(num_local_experts)",
                    call, moert_dtype_name(t->dtype), dims_text(t->ndim, t->shape, a, sizeof a), (long long)El);
    if (args->tokens_per_expert_host) {
        *counts = args->tokens_per_expert_host;
    } else if (!t || !t->data) {
        return fail(c, MOERT_ERR_INVALID_ARGUMENT, "%s: tokens_per_expert and tokens_per_expert_host are both NULL",
                    call);
    } else if (c->fetch && t->device.type == MOERT_DEVICE_CUDA && on_layer_device(c, t->device)) {
        moert_result rc = c->fetch(c->user, t, counts);
        if (rc != MOERT_OK) return rc;
    } else if (t->device.type != MOERT_DEVICE_CPU) {
        return fail(c, MOERT_ERR_UNSUPPORTED,
                    "%s: tokens_per_expert is on %s and tokens_per_expert_host is NULL; "
                    "the counts must be on the host or on the layer's device (%s)",
                    call, moert_arg_device_text(t->device, a, sizeof a),
                    moert_arg_device_text(c->layer->device, b, sizeof b));
    } else {
        *counts = t->data;
    }
    for (int64_t e = 0; e < El; e++)
        if ((*counts)[e] < 0)
            return fail(c, MOERT_ERR_INVALID_ARGUMENT, "%s: tokens_per_expert[%lld] is %lld, expected >= 0", call,
                        (long long)e, (long long)(*counts)[e]);
    return MOERT_OK;
}

moert_result moert_gemm_check_args(const moert_host *host, const moert_layer_info *layer,
                                   const moert_grouped_gemm_args *args, moert_gemm_fetch_counts fetch, void *user,
                                   char *call, size_t call_size, moert_gemm_shape *shape)
{
    const gemm_check check = {host, layer, fetch, user}, *c = &check;
    static const char *const pass_names[] = {"forward", "dgrad", "wgrad"};
    if (!args) return fail(c, MOERT_ERR_INVALID_ARGUMENT, "grouped_gemm(): args is NULL");
    if (args->which != MOERT_GEMM_FC1 && args->which != MOERT_GEMM_FC2)
        return fail(c, MOERT_ERR_INVALID_ARGUMENT, "grouped_gemm(): which is %d, expected fc1 (0) or fc2 (1)",
                    (int)args->which);
    if (args->pass < MOERT_GEMM_FORWARD || args->pass > MOERT_GEMM_WGRAD)
        return fail(c, MOERT_ERR_INVALID_ARGUMENT,
                    "grouped_gemm(): pass is %d, expected forward (0), dgrad (1) "
                    "or wgrad (2)",
                    (int)args->pass);
    snprintf(call, call_size, "grouped_gemm(%s, %s)", args->which == MOERT_GEMM_FC1 ? "fc1" : "fc2",
             pass_names[args->pass]);
    if (args->struct_size < sizeof *args)
        return fail(c, MOERT_ERR_INVALID_ARGUMENT,
                    "%s: args.struct_size is %u, expected at least %zu (set it to "
                    "sizeof the struct)",
                    call, args->struct_size, sizeof *args);

    const int64_t El = c->layer->num_local_experts, H = c->layer->hidden, F = c->layer->ffn_hidden;
    shape->num_experts = El;
    shape->k_in = args->which == MOERT_GEMM_FC1 ? H : F;
    shape->n_out = args->which == MOERT_GEMM_FC1 ? 2 * F : H;
    const char *k_name = args->which == MOERT_GEMM_FC1 ? "hidden" : "ffn_hidden";
    const char *n_name = args->which == MOERT_GEMM_FC1 ? "2*ffn_hidden" : "hidden";
    char weight_why[96], in_why[96], out_why[96];
    snprintf(weight_why, sizeof weight_why, "num_local_experts, %s, %s", k_name, n_name);
    moert_result rc = read_counts(c, call, args, &shape->counts);
    if (rc != MOERT_OK) return rc;
    int64_t total = 0;
    for (int64_t e = 0; e < El; e++) total += shape->counts[e];

    /* The tensor that fixes the row count: input, or grad_output for DGRAD. */
    const bool dgrad = args->pass == MOERT_GEMM_DGRAD;
    const moert_tensor *lead = dgrad ? args->grad_output : args->input;
    const char *lead_name = dgrad ? "grad_output" : "input";
    if (!lead) return fail(c, MOERT_ERR_INVALID_ARGUMENT, "%s: %s is NULL", call, lead_name);
    if (lead->ndim != 2) {
        char a[64];
        return fail(c, MOERT_ERR_INVALID_ARGUMENT, "%s: %s has shape %s, expected [rows, %lld] (rows, %s)", call,
                    lead_name, dims_text(lead->ndim, lead->shape, a, sizeof a),
                    (long long)(dgrad ? shape->n_out : shape->k_in), dgrad ? n_name : k_name);
    }
    const int64_t rows = lead->shape[0];
    int64_t in_shape[2] = {rows, shape->k_in}, out_shape[2] = {rows, shape->n_out};
    int64_t w_shape[3] = {El, shape->k_in, shape->n_out};
    snprintf(in_why, sizeof in_why, "rows of %s, %s", lead_name, k_name);
    snprintf(out_why, sizeof out_why, "rows of %s, %s", lead_name, n_name);
    rc = dgrad ? check_tensor(c, call, lead_name, lead, 2, out_shape, out_why)
               : check_tensor(c, call, lead_name, lead, 2, in_shape, in_why);
    if (rc != MOERT_OK) return rc;
    if (total > rows)
        return fail(c, MOERT_ERR_INVALID_ARGUMENT, "%s: tokens_per_expert sums to %lld rows but %s has only %lld", call,
                    (long long)total, lead_name, (long long)rows);

    switch (args->pass) {
    case MOERT_GEMM_FORWARD:
        rc = check_tensor(c, call, "weight", args->weight, 3, w_shape, weight_why);
        if (rc == MOERT_OK) rc = check_tensor(c, call, "output", args->output, 2, out_shape, out_why);
        break;
    case MOERT_GEMM_DGRAD:
        rc = check_tensor(c, call, "weight", args->weight, 3, w_shape, weight_why);
        if (rc == MOERT_OK) rc = check_tensor(c, call, "grad_input", args->grad_input, 2, in_shape, in_why);
        break;
    case MOERT_GEMM_WGRAD:
        rc = check_tensor(c, call, "grad_output", args->grad_output, 2, out_shape, out_why);
        if (rc == MOERT_OK) rc = check_tensor(c, call, "grad_weight", args->grad_weight, 3, w_shape, weight_why);
        break;
    }
    return rc;
}
