/* SPDX-License-Identifier: Apache-2.0 */
/* The "fp8" precision plugin: the experts' grouped GEMMs with FP8 operands (E4M3, or E4M3 forward and E5M2
 * gradients) under one of three scaling recipes (current, delayed, blockwise). This file: vtable, options, argument
 * checks, the delayed recipe's per-step update and the CUDA path's state; the quantization and the CPU GEMMs are in
 * precision_fp8_cpu.c (the reference), the FP8 conversions in fp8_convert.c, the CUDA kernels and cuBLASLt FP8
 * GEMMs behind precision_fp8_cuda.h (its files are listed in precision_fp8_cuda_internal.h). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moert/precision.h"
#include "precision_fp8_cpu.h"
#include "fp8_block_tuning.h"
#include "../lib/plugin_report.h"
#include "../lib/tensor_args.h"
#include "../lib/grouped_gemm_cpu.h"
#ifdef MOERT_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "../lib/plugin_cuda_check.h"
#include "../lib/precision_bf16_cuda.h"
#include "../lib/sm_yield_counters.h"

#include "precision_fp8_cuda.h"
#endif

typedef struct fp8_ctx {
    const moert_host *host;
    moert_layer_info layer;
    fp8_settings settings;
    fp8_delayed_state delayed; /* delayed recipe on the CPU only (the CUDA path keeps its histories on the device) */
    struct fp8_ctx *owner;     /* whose delayed state this instance uses: itself, or its slot-0 twin */
    fp8_scratch scratch;
    bool on_cuda;               /* the layer is on a CUDA device: the CUDA path serves it */
    int gemm_streams;           /* option: streams of the CUDA per-expert loop */
    int gemm_engine;            /* option "gemm": GEMM_AUTO, GEMM_CUBLASLT, GEMM_KERNEL */
    bool fp8_wgrad;             /* option "fp8_wgrad": false runs WGRAD on the bf16 plugin's GEMMs, unquantized */
    bf16_scratch wgrad_scratch; /* their CPU reference's work buffers */
    moert_fp8_block_tuning block_tuning; /* options "block_*": how the wgmma kernel runs (CUDA, blockwise) */
#ifdef MOERT_HAVE_CUDA
    moert_fp8_cuda *gemm;        /* quantize kernels, FP8 weight copies, cuBLASLt handle */
    moert_bf16_cuda *wgrad_gemm; /* "fp8_wgrad": false on CUDA: the bf16 plugin's cuBLASLt loop */
    int64_t *counts_host;        /* [E_local] pinned: device counts copied down when no host copy is given */
    moert_yield_counters yield;  /* the layer's sm_yield: the wgmma kernel's work counter pair per stream (or none) */
#endif
} fp8_ctx;

static const char *const recipe_choices[] = {"current", "delayed", "blockwise", NULL};
static const char *const format_choices[] = {"e4m3", "hybrid", NULL};
static const char *const amax_compute_choices[] = {"max", "most_recent", NULL};
static const char *const gemm_choices[] = {"auto", "cublaslt", "kernel", NULL};
enum { GEMM_AUTO = 0, GEMM_CUBLASLT = 1, GEMM_KERNEL = 2 };

/* Sets the instance's error message and returns code, so checks can `return fail(...)`. */
#define fail(c, ...) report((c)->host, __VA_ARGS__)

static void fp8_finalize(void *ctx);

/* Reads the options into s, *streams, *engine and *fp8_wgrad; "power_of_2_scales" defaults to true for blockwise,
 * false otherwise, and "format" to e4m3 for blockwise (its per-128 scales cover the gradients' range, as in DeepSeek-V3's recipe; with
 * E5M2 gradients the 300-step demo curve ran 2.9% above bf16's, with E4M3 within 0.5%), hybrid otherwise. */
static moert_result read_options(const moert_host *host, fp8_settings *s, int *streams, int *engine, bool *fp8_wgrad)
{
    int recipe = 0, format = 1, amax_compute = 0;
    moert_result rc = host->option_enum(host, "recipe", recipe_choices, 0,
                                        "FP8 scaling: current (per tensor, from its amax), delayed (per tensor, from "
                                        "the amax history), blockwise (1x128 activation and 128x128 weight tiles)",
                                        &recipe);
    if (rc != MOERT_OK) return rc;
    rc = host->option_enum(host, "format", format_choices, recipe == FP8_RECIPE_BLOCKWISE ? 0 : 1,
                           "FP8 formats: e4m3 for every operand, or hybrid (E4M3 forward, E5M2 for gradients); "
                           "default: e4m3 for blockwise, else hybrid",
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
    /* past 16, fp8_max * 2^-margin (448 * 2^-17 for E4M3) is under the format's smallest subnormal: every operand
     * would quantize to 0 */
    rc = host->option_int(host, "margin", 0, 0, 16, "delayed: scale = fp8_max * 2^-margin / amax", &margin);
    if (rc != MOERT_OK) return rc;
    int64_t gemm_streams = 4; /* at most 8: MOERT_FP8_CUDA_MAX_STREAMS (its header is in CUDA builds only) */
    rc = host->option_int(host, "gemm_streams", 4, 1, 8,
                          "CUDA: streams the per-expert FP8 GEMMs are spread over (1: the caller's stream only); "
                          "each takes a 32 MiB cuBLASLt workspace",
                          &gemm_streams);
    if (rc != MOERT_OK) return rc;
    *streams = (int)gemm_streams;
    rc = host->option_enum(host, "gemm", gemm_choices, GEMM_AUTO,
                           "CUDA, blockwise recipe: the GEMMs' engine: cublaslt (VEC128 / BLK128x128 matmuls per "
                           "expert), kernel (moert's wgmma kernel for every pass, the 128-block factors applied in "
                           "registers; compute capability 9.0), or auto (the faster measured per pass: on compute "
                           "capability 9.0 the kernel, but cublaslt for a wgrad that overwrites grad_weight, a step's "
                           "first micro-batch; cublaslt elsewhere)",
                           engine);
    if (rc != MOERT_OK) return rc;
    rc = host->option_bool(host, "fp8_wgrad", true,
                           "false: the weight gradients (WGRAD) from the unquantized activations and gradients (bf16 "
                           "operands on bf16 activations, fp32 accumulation; the bf16 plugin's GEMMs), as Megatron's "
                           "fp8_wgrad=False; the forward and dgrad GEMMs stay FP8",
                           fp8_wgrad);
    if (rc != MOERT_OK) return rc;
    s->recipe = (fp8_recipe)recipe;
    s->hybrid = format == 1;
    s->power_of_2 = power_of_2;
    s->amax_history_len = history_len;
    s->amax_most_recent = amax_compute == 1;
    s->margin = margin;
    return MOERT_OK;
}

/* Reads the "block_*" options into t: how moert's blockwise wgmma kernel runs ("gemm": "kernel" or "auto" on compute
 * capability 9.0). Tuning for a new GPU or an A/B of one kernel change (`moert ab --set-b precision.block_tile_n=128`);
 * the defaults are what measured fastest on H100 and H200. Read on every device and recipe, so each key is known; they
 * change nothing where the kernel does not run. */
static moert_result read_block_tuning(const moert_host *host, moert_fp8_block_tuning *t)
{
    *t = moert_fp8_block_tuning_default();
    int64_t tile_n = t->tile_n, stages = t->stages, pairs = t->pairs, cluster = t->cluster, clusters = t->clusters;
    bool pair_rows = t->pair_rows != 0;
    moert_result rc = host->option_int(host, "block_tile_n", tile_n, 128, 256,
                                       "CUDA kernel: output tile columns of the forward and dgrad GEMMs writing bf16: "
                                       "128 or 256 (a third less shared-memory and L2 traffic per FLOP)",
                                       &tile_n);
    if (rc != MOERT_OK) return rc;
    if (tile_n != 128 && tile_n != 256)
        return report(host, MOERT_ERR_CONFIG, "config error at $.precision.block_tile_n: got %lld, expected 128 or 256",
                      (long long)tile_n);
    rc = host->option_int(host, "block_stages", stages, 0, 16,
                          "CUDA kernel: at most this many stages in the operand ring (2 or more; 0: as many as fit "
                          "in shared memory)",
                          &stages);
    if (rc != MOERT_OK) return rc;
    if (stages == 1)
        return report(host, MOERT_ERR_CONFIG,
                      "config error at $.precision.block_stages: got 1, expected 0 (as many as "
                      "fit) or 2 to 16");
    rc = host->option_int(host, "block_pairs", pairs, 0, 2,
                          "CUDA kernel, forward form: 0 one k-block at a time, 1 k-blocks in pairs (the second's wgmma "
                          "run while the first is promoted), 2 pairs with the second warpgroup one block out of step",
                          &pairs);
    if (rc != MOERT_OK) return rc;
    rc = host->option_bool(host, "block_pair_rows", pair_rows,
                           "CUDA kernel, 128x256 tiles in CTA pairs: true pairs row blocks sharing the weight tile (B "
                           "multicast), false pairs column blocks sharing the activation tile (A multicast)",
                           &pair_rows);
    if (rc != MOERT_OK) return rc;
    rc = host->option_int(host, "block_cluster", cluster, 0, 2,
                          "CUDA kernel: 2 CTA pairs sharing a tile by TMA multicast, 1 single CTAs, 0 pairs where "
                          "they fit on the GPU",
                          &cluster);
    if (rc != MOERT_OK) return rc;
    rc = host->option_int(host, "block_clusters", clusters, 0, 1 << 16,
                          "CUDA kernel: at most this many resident clusters (CTAs with block_cluster 1), to measure "
                          "how the GEMMs scale with SMs; 0: as many as fit",
                          &clusters);
    if (rc != MOERT_OK) return rc;
    t->tile_n = (int)tile_n;
    t->stages = (int)stages;
    t->pairs = (int)pairs;
    t->pair_rows = pair_rows;
    t->cluster = (int)cluster;
    t->clusters = (int)clusters;
    return MOERT_OK;
}

#ifdef MOERT_HAVE_CUDA
/*
 * The CUDA path's state: checks the activation dtype (bf16 or fp32) and the sizes (cuBLASLt FP8 needs leading
 * dimensions of 16 bytes: hidden and ffn_hidden multiples of 16), then makes the handle on the layer's device
 * (quantize kernels, FP8 weight copies, the delayed recipe's histories) with its streams.
 */
static moert_result cuda_init(fp8_ctx *c)
{
    const moert_host *h = c->host;
    const moert_layer_info *l = &c->layer;
    const int id = (int)l->device.id;
    char dev[32];
    moert_arg_device_text(l->device, dev, sizeof dev);
    if (l->dtype != MOERT_BF16 && l->dtype != MOERT_F32)
        return fail(c, MOERT_ERR_UNSUPPORTED,
                    "the fp8 precision plugin on CUDA (%s) takes bf16 or fp32 activations, "
                    "not %s",
                    dev, moert_dtype_name(l->dtype));
    if (l->hidden % 16 || l->ffn_hidden % 16)
        return fail(c, MOERT_ERR_UNSUPPORTED,
                    "the fp8 precision plugin on CUDA (%s) needs hidden (%lld) and ffn_hidden "
                    "(%lld) to be multiples of 16 (cuBLASLt FP8 leading dimensions); use the bf16 plugin or the CPU",
                    dev, (long long)l->hidden, (long long)l->ffn_hidden);
    MOK(check_cuda_device_visible(c->host, id, dev));
    struct cudaDeviceProp prop;
    cudaError_t err = cudaGetDeviceProperties(&prop, id);
    if (err != cudaSuccess) {
        (void)cudaGetLastError();
        return fail(c, MOERT_ERR_CUDA, "cudaGetDeviceProperties(%d) failed: %s", id, cudaGetErrorString(err));
    }
    if (prop.major < 9)
        return fail(c, MOERT_ERR_UNSUPPORTED,
                    "the fp8 precision plugin's CUDA path needs a Hopper GPU or newer "
                    "(compute capability 9.0); %s is %s (%d.%d)",
                    dev, prop.name, prop.major, prop.minor);
    void *probe = NULL; /* a host whose alloc cannot serve the device is a CPU-only host */
    moert_result rc = h->alloc(h, l->device, 1, &probe);
    if (rc == MOERT_ERR_UNSUPPORTED)
        return fail(c, rc,
                    "the host serving this instance cannot allocate on %s (a CPU-only host): only a CPU path is "
                    "usable with it",
                    dev);
    if (rc != MOERT_OK) return rc;
    h->free(h, l->device, probe);
    rc = h->alloc_pinned(h, (size_t)l->num_local_experts * sizeof(int64_t) + 8, (void **)&c->counts_host);
    if (rc != MOERT_OK) return rc;
    int previous = -1;
    err = cudaGetDevice(&previous);
    if (err == cudaSuccess && previous != id) err = cudaSetDevice(id);
    if (err != cudaSuccess) {
        (void)cudaGetLastError();
        return fail(c, MOERT_ERR_CUDA, "cudaSetDevice(%d) failed: %s", id, cudaGetErrorString(err));
    }
    const fp8_settings *s = &c->settings;
    const moert_fp8_cuda_config cfg = {
        .recipe = (moert_fp8_cuda_recipe)s->recipe,
        .hybrid = s->hybrid,
        .power_of_2 = s->power_of_2,
        .num_experts = l->num_local_experts,
        .amax_history_len = s->amax_history_len,
        .amax_most_recent = s->amax_most_recent,
        .margin = s->margin,
    };
    rc = moert_fp8_cuda_create(h, l->device, &cfg, &c->gemm);
    if (rc == MOERT_OK) rc = moert_fp8_cuda_set_streams(c->gemm, c->gemm_streams);
    if (rc == MOERT_OK) rc = moert_fp8_cuda_set_block_tuning(c->gemm, &c->block_tuning);
    /* blockwise GEMMs on the wgmma kernel: every pass when asked; with "auto", where it measured faster than
     * cuBLASLt (forward, dgrad, a wgrad that adds to grad_weight), and a wgrad that overwrites it (a step's first
     * micro-batch) on cuBLASLt, which measured faster there (DESIGN.md, "Which engine serves which pass"); the
     * kernel's code is sm_90a */
    const bool hopper = prop.major == 9 && prop.minor == 0;
    if (rc == MOERT_OK && s->recipe == FP8_RECIPE_BLOCKWISE && c->gemm_engine == GEMM_KERNEL && !hopper)
        rc = fail(c, MOERT_ERR_UNSUPPORTED,
                  "$.precision.gemm: \"kernel\" needs a compute capability 9.0 GPU "
                  "(wgmma); %s is %s (%d.%d): use \"cublaslt\" or \"auto\"",
                  dev, prop.name, prop.major, prop.minor);
    if (rc == MOERT_OK && s->recipe == FP8_RECIPE_BLOCKWISE && c->gemm_engine == GEMM_KERNEL)
        rc = moert_fp8_cuda_set_block_kernel(c->gemm, 1);
    if (rc == MOERT_OK && s->recipe == FP8_RECIPE_BLOCKWISE && c->gemm_engine == GEMM_AUTO && hopper)
        rc = moert_fp8_cuda_set_block_kernel(c->gemm, 2);
    /* where the layer has sm_yield (the micro-batch overlap), the kernel leaves SMs to a dispatcher call */
    if (rc == MOERT_OK && s->recipe == FP8_RECIPE_BLOCKWISE && hopper && c->gemm_engine != GEMM_CUBLASLT)
        rc = moert_yield_counters_init(&c->yield, h, l);
    if (rc == MOERT_OK && s->recipe == FP8_RECIPE_BLOCKWISE) {
        char how[384];
        moert_fp8_cuda_describe_block_kernel(c->gemm, how, sizeof how);
        h->log(h, MOERT_LOG_DEBUG, "fp8 blockwise GEMMs on %s: %s", dev, how);
    }
    /* tuning the kernel where it does not run is said, not ignored in silence */
    const moert_fp8_block_tuning defaults = moert_fp8_block_tuning_default();
    const bool kernel_runs =
        s->recipe == FP8_RECIPE_BLOCKWISE && (c->gemm_engine == GEMM_KERNEL || (c->gemm_engine == GEMM_AUTO && hopper));
    if (rc == MOERT_OK && !kernel_runs && memcmp(&defaults, &c->block_tuning, sizeof defaults) != 0)
        h->log(h, MOERT_LOG_WARN,
               "$.precision.block_*: set, but the wgmma kernel does not run here (recipe %s, gemm "
               "%s, %s %d.%d): they change nothing",
               recipe_choices[s->recipe], gemm_choices[c->gemm_engine], dev, prop.major, prop.minor);
    /* every matmul of the recipe exists in this cuBLASLt (weight gradients accumulate in fp32, as the executor's;
     * with "fp8_wgrad": false they are the bf16 GEMMs', not asked) */
    if (rc == MOERT_OK)
        rc = moert_fp8_cuda_check_support(c->gemm, l->hidden, l->ffn_hidden, l->dtype, MOERT_F32, c->fp8_wgrad);
    /* unquantized weight gradients: the bf16 plugin's cuBLASLt loop, with its own workspace per stream */
    if (rc == MOERT_OK && !c->fp8_wgrad)
        rc = moert_bf16_cuda_create(h, NULL, 0, MOERT_BF16_CUDA_EXPERT_LOOP, &c->wgrad_gemm);
    if (rc == MOERT_OK && !c->fp8_wgrad) rc = moert_bf16_cuda_set_streams(c->wgrad_gemm, c->gemm_streams);
    if (previous >= 0 && previous != id) (void)cudaSetDevice(previous);
    return rc;
}
#endif

/* Creates one instance: reads the options (all of them for every recipe and device, so each key is known), then
 * for the delayed recipe on the CPU allocates the amax histories; on CUDA makes the CUDA path's state. */
static moert_result fp8_init(void **out, const moert_host *host, const moert_layer_info *layer)
{
    *out = NULL;
    moert_result rc = moert_arg_check_layer_device(host, layer->device, "the fp8 precision plugin");
    if (rc != MOERT_OK) return rc;
    fp8_settings settings;
    int streams = 4, engine = GEMM_AUTO;
    bool fp8_wgrad = true;
    rc = read_options(host, &settings, &streams, &engine, &fp8_wgrad);
    if (rc != MOERT_OK) return rc;
    moert_fp8_block_tuning block_tuning;
    rc = read_block_tuning(host, &block_tuning);
    if (rc != MOERT_OK) return rc;
    if (engine == GEMM_KERNEL && settings.recipe != FP8_RECIPE_BLOCKWISE) {
        host->set_error(host,
                        "$.precision.gemm: \"kernel\" serves the blockwise recipe only (recipe is \"%s\"); "
                        "use \"auto\" or \"cublaslt\"",
                        recipe_choices[settings.recipe]);
        return MOERT_ERR_CONFIG;
    }
    fp8_ctx *c = calloc(1, sizeof *c);
    if (!c) {
        host->set_error(host, "out of memory for the precision state");
        return MOERT_ERR_OUT_OF_MEMORY;
    }
    c->host = host;
    /* a second slot's instance (moert_layer_info.twin): the delayed recipe's histories are its slot-0 twin's */
    c->owner = MOERT_LAYER_INFO_HAS_TWIN(layer) && layer->twin ? (struct fp8_ctx *)layer->twin : c;
    moert_layer_info_copy(&c->layer, layer);
    c->settings = settings;
    c->on_cuda = layer->device.type == MOERT_DEVICE_CUDA;
    c->gemm_streams = streams;
    c->gemm_engine = engine;
    c->fp8_wgrad = fp8_wgrad;
    c->block_tuning = block_tuning;
    if (settings.recipe == FP8_RECIPE_DELAYED && !c->on_cuda &&
        !fp8_delayed_init(&c->delayed, layer->num_local_experts, settings.amax_history_len)) {
        fp8_finalize(c);
        host->set_error(host, "out of memory for the amax histories (%lld experts x 6 x %lld entries)",
                        (long long)layer->num_local_experts, (long long)settings.amax_history_len);
        return MOERT_ERR_OUT_OF_MEMORY;
    }
#ifdef MOERT_HAVE_CUDA
    if (c->on_cuda) {
        rc = cuda_init(c);
        if (rc != MOERT_OK) {
            fp8_finalize(c);
            return rc;
        }
        if (c->owner != c && c->owner->gemm && c->gemm) {
            moert_fp8_cuda_share_delayed(c->gemm, c->owner->gemm);
            moert_fp8_cuda_share_weights(c->gemm, c->owner->gemm);
        }
    }
#endif
    char dev[32];
    host->log(host, MOERT_LOG_DEBUG,
              "fp8 precision: recipe %s, format %s, power-of-2 scales %s, weight gradients %s (activations %s, %s)",
              recipe_choices[settings.recipe], settings.hybrid ? "hybrid" : "e4m3", settings.power_of_2 ? "on" : "off",
              fp8_wgrad ? "fp8" : "unquantized", moert_dtype_name(layer->dtype),
              moert_arg_device_text(layer->device, dev, sizeof dev));
    *out = c;
    return MOERT_OK;
}

/* Frees the instance. */
static void fp8_finalize(void *ctx)
{
    fp8_ctx *c = ctx;
    if (!c) return;
#ifdef MOERT_HAVE_CUDA
    if (c->gemm) moert_fp8_cuda_destroy(c->gemm);
    if (c->wgrad_gemm) moert_bf16_cuda_destroy(c->wgrad_gemm);
    if (c->counts_host) c->host->free_pinned(c->host, c->counts_host);
    moert_yield_counters_free(&c->yield, c->host, &c->layer);
#endif
    fp8_delayed_free(&c->delayed);
    fp8_scratch_free(&c->scratch);
    bf16_scratch_free(&c->wgrad_scratch);
    free(c);
}

#ifdef MOERT_HAVE_CUDA
/* The instance and stream a count fetch runs on. */
typedef struct counts_fetch {
    fp8_ctx *c;
    moert_stream stream;
} counts_fetch;

/* Counts that live only on the layer's GPU: copied down into pinned memory with a bounded wait for the stream. */
static moert_result fetch_counts(void *user, const moert_tensor *t, const int64_t **counts)
{
    counts_fetch *f = user;
    const moert_host *h = f->c->host;
    moert_result rc = h->memcpy_async(h, f->c->counts_host, moert_cpu(), t->data, t->device,
                                      (size_t)f->c->layer.num_local_experts * sizeof(int64_t), f->stream);
    if (rc == MOERT_OK) rc = h->stream_synchronize(h, f->stream);
    if (rc == MOERT_OK) *counts = f->c->counts_host;
    return rc;
}

/* WGRAD with "fp8_wgrad": false: the bf16 plugin's cuBLASLt loop on the unquantized operands (bf16 activations:
 * bf16 operands, fp32 accumulation, into fp32 or bf16 grad_weight; fp32 activations: fp32 GEMMs into fp32). */
static moert_result cuda_unquantized_wgrad(fp8_ctx *c, moert_stream stream, const moert_grouped_gemm_args *args,
                                           const fp8_gemm_shape *shape, const char *call)
{
    const moert_dtype act = c->layer.dtype, gw = args->grad_weight->dtype;
    if (act == MOERT_F32 && gw != MOERT_F32)
        return fail(c, MOERT_ERR_UNSUPPORTED,
                    "%s: with \"fp8_wgrad\": false and fp32 activations, grad_weight must be "
                    "fp32, not %s",
                    call, moert_dtype_name(gw));
    const moert_bf16_cuda_gemm gm = {.pass = MOERT_GEMM_WGRAD,
                                     .dtype = act,
                                     .num_experts = shape->num_experts,
                                     .rows_per_expert = shape->counts,
                                     .k_in = shape->k_in,
                                     .n_out = shape->n_out,
                                     .input = args->input->data,
                                     .grad_output = args->grad_output->data,
                                     .grad_weight = args->grad_weight->data,
                                     .accumulate = !moert_gemm_overwrites_grad(args),
                                     .output_fp32 = act == MOERT_BF16 && gw == MOERT_F32};
    return moert_bf16_cuda_grouped_gemm(c->wgrad_gemm, (cudaStream_t)stream, &gm);
}

/* One grouped GEMM on the layer's GPU, arguments already checked: activations in the layer's dtype (bf16 or fp32),
 * weights fp32 or bf16 (their FP8 copies are cached for the step), grad_weight fp32 or bf16 (accumulated, or
 * overwritten when args asks). */
static moert_result cuda_grouped_gemm(fp8_ctx *c, moert_stream stream, const moert_grouped_gemm_args *args,
                                      const fp8_gemm_shape *shape, const char *call)
{
    const moert_dtype act = c->layer.dtype;
    const moert_tensor *acts[2];
    const char *names[2];
    switch (args->pass) {
    case MOERT_GEMM_FORWARD:
        acts[0] = args->input, names[0] = "input", acts[1] = args->output, names[1] = "output";
        break;
    case MOERT_GEMM_DGRAD:
        acts[0] = args->grad_output, names[0] = "grad_output", acts[1] = args->grad_input, names[1] = "grad_input";
        break;
    default: acts[0] = args->input, names[0] = "input", acts[1] = args->grad_output, names[1] = "grad_output"; break;
    }
    for (int i = 0; i < 2; i++)
        if (acts[i]->dtype != act)
            return fail(c, MOERT_ERR_UNSUPPORTED,
                        "%s: %s has dtype %s; on CUDA the fp8 plugin takes the layer's %s "
                        "activations",
                        call, names[i], moert_dtype_name(acts[i]->dtype), moert_dtype_name(act));
    moert_fp8_cuda_gemm gm;
    memset(&gm, 0, sizeof gm);
    gm.which = args->which;
    gm.pass = args->pass;
    gm.act_dtype = act;
    gm.num_experts = shape->num_experts;
    gm.rows_per_expert = shape->counts;
    gm.capacity = acts[0]->shape[0]; /* the padded scratch buffers are sized once for it (blockwise) */
    gm.k_in = shape->k_in;
    gm.n_out = shape->n_out;
    gm.work_counter = moert_yield_counters_for(&c->yield, stream);
    gm.sm_yield = gm.work_counter ? MOERT_LAYER_INFO_SM_YIELD(&c->layer) : NULL;
    if (args->pass == MOERT_GEMM_WGRAD) {
        const moert_dtype gw = args->grad_weight->dtype;
        if (gw != MOERT_F32 && gw != MOERT_BF16)
            return fail(c, MOERT_ERR_UNSUPPORTED,
                        "%s: grad_weight has dtype %s; on CUDA the fp8 plugin accumulates into "
                        "fp32 or bf16",
                        call, moert_dtype_name(gw));
        if (!c->fp8_wgrad) return cuda_unquantized_wgrad(c, stream, args, shape, call);
        gm.grad_weight_dtype = gw;
        gm.input = args->input->data;
        gm.grad_output = args->grad_output->data;
        gm.grad_weight = args->grad_weight->data;
        gm.overwrite_grad_weight = moert_gemm_overwrites_grad(args);
    } else {
        const moert_dtype wd = args->weight->dtype;
        if (wd != MOERT_F32 && wd != MOERT_BF16)
            return fail(c, MOERT_ERR_UNSUPPORTED,
                        "%s: weight has dtype %s; on CUDA the fp8 plugin takes fp32 or bf16 "
                        "weights",
                        call, moert_dtype_name(wd));
        gm.weight_dtype = wd;
        gm.weight = args->weight->data;
        if (args->pass == MOERT_GEMM_FORWARD) {
            gm.input = args->input->data;
            gm.output = args->output->data;
        } else {
            gm.grad_output = args->grad_output->data;
            gm.grad_input = args->grad_input->data;
        }
    }
    return moert_fp8_cuda_grouped_gemm(c->gemm, (cudaStream_t)stream, &gm);
}
#endif

/* One grouped GEMM (FORWARD, DGRAD or WGRAD) over the local experts. */
static moert_result fp8_grouped_gemm(void *ctx, moert_stream stream, const moert_grouped_gemm_args *args)
{
    fp8_ctx *c = ctx;
    char call[64] = "grouped_gemm()";
    fp8_gemm_shape shape;
#ifdef MOERT_HAVE_CUDA
    counts_fetch fetch = {c, stream};
    moert_result rc = moert_gemm_check_args(c->host, &c->layer, args, c->on_cuda ? fetch_counts : NULL, &fetch, call,
                                            sizeof call, &shape);
    if (rc != MOERT_OK) return rc;
    if (c->on_cuda) return cuda_grouped_gemm(c, stream, args, &shape, call);
#else
    (void)stream;
    moert_result rc = moert_gemm_check_args(c->host, &c->layer, args, NULL, NULL, call, sizeof call, &shape);
    if (rc != MOERT_OK) return rc;
#endif
    if (args->pass == MOERT_GEMM_WGRAD && !c->fp8_wgrad) /* the bf16 plugin's reference for the storage dtype */
        rc = bf16_cpu_grouped_gemm(args, &shape, bf16_mode_for_dtype(c->layer.dtype), &c->wgrad_scratch);
    else
        rc = fp8_cpu_grouped_gemm(args, &shape, &c->settings, &c->owner->delayed, &c->scratch);
    if (rc != MOERT_OK) return fail(c, rc, "%s: out of memory for the GEMM's work buffers", call);
    return MOERT_OK;
}

/* After the optimizer step: the delayed recipe appends this step's amaxes to the histories and computes the
 * scales of the next step (on the CPU here, on the device on CUDA); on CUDA the FP8 weight copies are made again
 * now, on the step's stream, so the cast belongs to the optimizer step and not to the next forward. */
static moert_result fp8_end_step(void *ctx, moert_stream stream)
{
    fp8_ctx *c = ctx;
#ifdef MOERT_HAVE_CUDA
    if (c->on_cuda) return moert_fp8_cuda_end_step(c->gemm, (cudaStream_t)stream);
#endif
    (void)stream;
    if (c->settings.recipe == FP8_RECIPE_DELAYED && c->owner == c) fp8_delayed_end_step(&c->delayed, &c->settings);
    return MOERT_OK;
}

/* The one exported symbol, under the vtable's typedef name through an asm label (see precision_bf16.c). */
MOERT_PRECISION_V1_EXPORT(fp8_vtable) = {
    .header =
        {
            MOERT_PRECISION_V1_HEADER,
            .name = "fp8",
            .version = "0.1.0",
            .description = "grouped GEMMs with FP8 operands (E4M3/E5M2), current, delayed or blockwise scaling",
#ifdef MOERT_HAVE_CUDA
            .devices = MOERT_CAP_DEVICE(MOERT_DEVICE_CPU) | MOERT_CAP_DEVICE(MOERT_DEVICE_CUDA),
#else
            .devices = MOERT_CAP_DEVICE(MOERT_DEVICE_CPU),
#endif
            .dtypes = MOERT_CAP_DTYPE(MOERT_F32) | MOERT_CAP_DTYPE(MOERT_F64) | MOERT_CAP_DTYPE(MOERT_BF16) |
                      MOERT_CAP_DTYPE(MOERT_F16),
            .flags = MOERT_CAP_NEEDS_HOST_SYNC | MOERT_CAP_WGRAD_OVERWRITE,
        },
    .init = fp8_init,
    .finalize = fp8_finalize,
    .grouped_gemm = fp8_grouped_gemm,
    .end_step = fp8_end_step,
    /* GEMM operands in E4M3 (and E5M2 gradients): one operand rounded to its neighbour moves a product by one E4M3
     * ulp, at most 2^-3 = 0.125 of it; the errors of a dot product's many operands mostly cancel, so its result
     * stays within 0.125 of the tensor's largest value (against bf16 on the CPU, one layer: 2.7e-2 in the output,
     * 4.5e-2 to 6.5e-2 in the gradients). */
    .agreement_rtol = 0.125,
};
