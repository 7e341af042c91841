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

#define device_name moert_gemm_device_text

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

static moert_result fp8_grouped_gemm(void *ctx, moert_stream stream, const moert_grouped_gemm_args *args)
{
    fp8_ctx *c = ctx;
    (void)stream;
    char call[64] = "grouped_gemm()";
    fp8_gemm_shape shape;
    moert_result rc = moert_gemm_check_args(c->host, &c->layer, args, NULL, NULL, call, sizeof call, &shape);
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
