/* The "fp8" precision plugin: the experts' grouped GEMMs with FP8 operands (E4M3, or E4M3 forward and E5M2
 * gradients) under one of three scaling recipes (current, delayed, blockwise). This file: vtable, options, argument
 * checks and the delayed recipe's per-step update; the quantization and the CPU GEMMs are in precision_fp8_cpu.c,
 * the FP8 conversions in fp8_convert.c. CPU only so far: a layer on CUDA is refused by init. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moert/precision.h"
#include "precision_fp8_cpu.h"

typedef struct fp8_ctx {
    const moert_host *host;
    moert_layer_info layer;
    fp8_settings settings;
    fp8_delayed_state delayed; /* delayed recipe only */
    fp8_scratch scratch;
} fp8_ctx;

static const char *const recipe_choices[] = {"current", "delayed", "blockwise", NULL};
static const char *const format_choices[] = {"e4m3", "hybrid", NULL};
static const char *const amax_compute_choices[] = {"max", "most_recent", NULL};

/* Sets the instance's error message and returns code, so checks can `return fail(...)`. */
static moert_result fail(const fp8_ctx *c, moert_result code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static moert_result fail(const fp8_ctx *c, moert_result code, const char *fmt, ...)
{
    char text[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    c->host->set_error(c->host, "%s", text);
    return code;
}

/* "[12, 64]" for messages, from ndim sizes. */
static const char *dims_text(int ndim, const int64_t *shape, char *buf, size_t size)
{
    size_t used = (size_t)snprintf(buf, size, "[");
    for (int i = 0; i < ndim && used < size; i++)
        used += (size_t)snprintf(buf + used, size - used, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (used < size) snprintf(buf + used, size - used, "]");
    return buf;
}

/* "cpu", "cuda:1", ... for messages. */
static const char *device_name(moert_device dev, char *buf, size_t size)
{
    if (dev.type == MOERT_DEVICE_CUDA) snprintf(buf, size, "cuda:%d", (int)dev.id);
    else snprintf(buf, size, "%s", dev.type == MOERT_DEVICE_CPU ? "cpu" : dev.type == MOERT_DEVICE_CUDA_HOST
                                                                             ? "cuda_host" : "unknown");
    return buf;
}

static void fp8_finalize(void *ctx);

/* Reads the options into s; "power_of_2_scales" defaults to true for blockwise, false otherwise. */
static moert_result read_options(const moert_host *host, fp8_settings *s)
{
    int recipe = 0, format = 1, amax_compute = 0;
    moert_result rc = host->option_enum(host, "recipe", recipe_choices, 0,
                                        "FP8 scaling: current (per tensor, from its amax), delayed (per tensor, from "
                                        "the amax history), blockwise (1x128 activation and 128x128 weight tiles)",
                                        &recipe);
    if (rc != MOERT_OK) return rc;
    rc = host->option_enum(host, "format", format_choices, 1,
                           "FP8 formats: e4m3 for every operand, or hybrid (E4M3 forward, E5M2 for gradients)",
                           &format);
    if (rc != MOERT_OK) return rc;
    bool power_of_2 = false;
    rc = host->option_bool(host, "power_of_2_scales", recipe == FP8_RECIPE_BLOCKWISE,
                           "round every scale down to a power of two (default: true for blockwise, else false)",
                           &power_of_2);
    if (rc != MOERT_OK) return rc;
    int64_t history_len = 1024, margin = 0;
    rc = host->option_int(host, "amax_history_len", 1024, 1, 1 << 20,
                          "delayed: steps of amax history a scale is computed from", &history_len);
    if (rc != MOERT_OK) return rc;
    rc = host->option_enum(host, "amax_compute", amax_compute_choices, 0,
                           "delayed: the amax a scale is computed from: max over the history, or the most recent",
                           &amax_compute);
    if (rc != MOERT_OK) return rc;
    rc = host->option_int(host, "margin", 0, 0, 64, "delayed: scale = fp8_max * 2^-margin / amax", &margin);
    if (rc != MOERT_OK) return rc;
    s->recipe = (fp8_recipe)recipe;
    s->hybrid = format == 1;
    s->power_of_2 = power_of_2;
    s->amax_history_len = history_len;
    s->amax_most_recent = amax_compute == 1;
    s->margin = margin;
    return MOERT_OK;
}

/* Creates one instance: reads the options (all of them for every recipe, so each key is known) and, for the
 * delayed recipe, allocates the amax histories. A layer that is not on the CPU is refused. */
static moert_result fp8_init(void **out, const moert_host *host, const moert_layer_info *layer)
{
    *out = NULL;
    char dev[32];
    if (layer->device.type != MOERT_DEVICE_CPU) {
        host->set_error(host, "the fp8 precision plugin has only a CPU path so far (its cuBLASLt FP8 path is not "
                        "written yet); the layer is on %s", device_name(layer->device, dev, sizeof dev));
        return MOERT_ERR_UNSUPPORTED;
    }
    fp8_settings settings;
    moert_result rc = read_options(host, &settings);
    if (rc != MOERT_OK) return rc;
    fp8_ctx *c = calloc(1, sizeof *c);
    if (!c) {
        host->set_error(host, "out of memory for the precision state");
        return MOERT_ERR_OUT_OF_MEMORY;
    }
    c->host = host;
    c->layer = *layer;
    c->settings = settings;
    if (settings.recipe == FP8_RECIPE_DELAYED &&
        !fp8_delayed_init(&c->delayed, layer->num_local_experts, settings.amax_history_len)) {
        fp8_finalize(c);
        host->set_error(host, "out of memory for the amax histories (%lld experts x 6 x %lld entries)",
                        (long long)layer->num_local_experts, (long long)settings.amax_history_len);
        return MOERT_ERR_OUT_OF_MEMORY;
    }
    host->log(host, MOERT_LOG_DEBUG, "fp8 precision: recipe %s, format %s, power-of-2 scales %s (activations %s, %s)",
              recipe_choices[settings.recipe], settings.hybrid ? "hybrid" : "e4m3",
              settings.power_of_2 ? "on" : "off", moert_dtype_name(layer->dtype),
              device_name(layer->device, dev, sizeof dev));
    *out = c;
    return MOERT_OK;
}

/* Frees the instance. */
static void fp8_finalize(void *ctx)
{
    fp8_ctx *c = ctx;
    if (!c) return;
    fp8_delayed_free(&c->delayed);
    fp8_scratch_free(&c->scratch);
    free(c);
}

/* Whether a tensor's memory is the layer's device (the same CUDA ordinal on CUDA). */
static bool on_layer_device(const fp8_ctx *c, moert_device d)
{
    if (d.type != c->layer.device.type) return false;
    return d.type != MOERT_DEVICE_CUDA || d.id == c->layer.device.id;
}

/*
 * Checks one tensor argument: present, on the layer's device, a float dtype, contiguous, with data, and of
 * shape `want` (ndim dims); `why` explains where the expected sizes come from.
 */
static moert_result check_tensor(const fp8_ctx *c, const char *call, const char *name, const moert_tensor *t,
                                 int ndim, const int64_t *want, const char *why)
{
    char a[64], b[64];
    if (!t) return fail(c, MOERT_ERR_INVALID_ARGUMENT, "%s: %s is NULL", call, name);
    if (!on_layer_device(c, t->device))
        return fail(c, MOERT_ERR_UNSUPPORTED, "%s: %s is on %s, but the layer is on %s", call, name,
                    device_name(t->device, a, sizeof a), device_name(c->layer.device, b, sizeof b));
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
 * The rows per expert, from the host array or the tensor (host memory, read in place). Checks length and signs.
 */
static moert_result read_counts(const fp8_ctx *c, const char *call, const moert_grouped_gemm_args *args,
                                const int64_t **counts)
{
    const int64_t El = c->layer.num_local_experts;
    const moert_tensor *t = args->tokens_per_expert;
    char a[64], b[64];
    if (t && (t->dtype != MOERT_I64 || t->ndim != 1 || t->shape[0] != El))
        return fail(c, MOERT_ERR_INVALID_ARGUMENT, "%s: tokens_per_expert is %s %s, expected int64 [%lld] "
                    "(num_local_experts)", call, moert_dtype_name(t->dtype), dims_text(t->ndim, t->shape, a, sizeof a),
                    (long long)El);
    if (args->tokens_per_expert_host) {
        *counts = args->tokens_per_expert_host;
    } else if (!t || !t->data) {
        return fail(c, MOERT_ERR_INVALID_ARGUMENT, "%s: tokens_per_expert and tokens_per_expert_host are both NULL",
                    call);
    } else if (t->device.type != MOERT_DEVICE_CPU) {
        return fail(c, MOERT_ERR_UNSUPPORTED, "%s: tokens_per_expert is on %s and tokens_per_expert_host is NULL; "
                    "the counts must be on the host or on the layer's device (%s)", call,
                    device_name(t->device, a, sizeof a), device_name(c->layer.device, b, sizeof b));
    } else {
        *counts = t->data;
    }
    for (int64_t e = 0; e < El; e++)
        if ((*counts)[e] < 0)
            return fail(c, MOERT_ERR_INVALID_ARGUMENT, "%s: tokens_per_expert[%lld] is %lld, expected >= 0", call,
                        (long long)e, (long long)(*counts)[e]);
    return MOERT_OK;
}

/* Checks every argument of one grouped GEMM and fills its shape. */
static moert_result check_args(const fp8_ctx *c, const moert_grouped_gemm_args *args, char *call,
                               size_t call_size, fp8_gemm_shape *shape)
{
    static const char *const pass_names[] = {"forward", "dgrad", "wgrad"};
    if (!args) return fail(c, MOERT_ERR_INVALID_ARGUMENT, "grouped_gemm(): args is NULL");
    if (args->which != MOERT_GEMM_FC1 && args->which != MOERT_GEMM_FC2)
        return fail(c, MOERT_ERR_INVALID_ARGUMENT, "grouped_gemm(): which is %d, expected fc1 (0) or fc2 (1)",
                    (int)args->which);
    if (args->pass < MOERT_GEMM_FORWARD || args->pass > MOERT_GEMM_WGRAD)
        return fail(c, MOERT_ERR_INVALID_ARGUMENT, "grouped_gemm(): pass is %d, expected forward (0), dgrad (1) "
                    "or wgrad (2)", (int)args->pass);
    snprintf(call, call_size, "grouped_gemm(%s, %s)", args->which == MOERT_GEMM_FC1 ? "fc1" : "fc2",
             pass_names[args->pass]);
    if (args->struct_size < sizeof *args)
        return fail(c, MOERT_ERR_INVALID_ARGUMENT, "%s: args.struct_size is %u, expected at least %zu (set it to "
                    "sizeof the struct)", call, args->struct_size, sizeof *args);

    const int64_t El = c->layer.num_local_experts, H = c->layer.hidden, F = c->layer.ffn_hidden;
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
        return fail(c, MOERT_ERR_INVALID_ARGUMENT, "%s: tokens_per_expert sums to %lld rows but %s has only %lld",
                    call, (long long)total, lead_name, (long long)rows);

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


/* One grouped GEMM (FORWARD, DGRAD or WGRAD) over the local experts. */
static moert_result fp8_grouped_gemm(void *ctx, moert_stream stream, const moert_grouped_gemm_args *args)
{
    fp8_ctx *c = ctx;
    (void)stream;
    char call[64] = "grouped_gemm()";
    fp8_gemm_shape shape;
    moert_result rc = check_args(c, args, call, sizeof call, &shape);
    if (rc != MOERT_OK) return rc;
    rc = fp8_cpu_grouped_gemm(args, &shape, &c->settings, &c->delayed, &c->scratch);
    if (rc != MOERT_OK) return fail(c, rc, "%s: out of memory for the GEMM's work buffers", call);
    return MOERT_OK;
}

/* After the optimizer step: the delayed recipe appends this step's amaxes to the histories and computes the
 * scales of the next step; the other recipes keep no state. */
static moert_result fp8_end_step(void *ctx, moert_stream stream)
{
    fp8_ctx *c = ctx;
    (void)stream;
    if (c->settings.recipe == FP8_RECIPE_DELAYED) fp8_delayed_end_step(&c->delayed, &c->settings);
    return MOERT_OK;
}

/* The one exported symbol, under the vtable's typedef name through an asm label (see precision_bf16.c). */
MOERT_PLUGIN_EXPORT const moert_precision_v1 fp8_vtable __asm__(MOERT_PRECISION_V1_SYMBOL) = {
    .header = {
        .abi_version = MOERT_ABI_CURRENT,
        .struct_size = sizeof(moert_precision_v1),
        .kind = MOERT_KIND_PRECISION,
        .name = "fp8",
        .version = "0.1.0",
        .description = "grouped GEMMs with FP8 operands (E4M3/E5M2), current, delayed or blockwise scaling "
                       "(CPU reference)",
        .devices = MOERT_CAP_DEVICE(MOERT_DEVICE_CPU),
        .dtypes = MOERT_CAP_DTYPE(MOERT_F32) | MOERT_CAP_DTYPE(MOERT_F64) | MOERT_CAP_DTYPE(MOERT_BF16) |
                  MOERT_CAP_DTYPE(MOERT_F16),
        .flags = MOERT_CAP_NEEDS_HOST_SYNC,
    },
    .init = fp8_init,
    .finalize = fp8_finalize,
    .grouped_gemm = fp8_grouped_gemm,
    .end_step = fp8_end_step,
};
