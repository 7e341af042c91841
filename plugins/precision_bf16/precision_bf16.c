/* SPDX-License-Identifier: Apache-2.0 */
/* The "bf16" precision plugin: the experts' grouped GEMMs with bf16 operands and fp32 accumulation
 * (or plain fp32 / fp64). This file: vtable, options, argument checks and the CUDA path's state (bf16 weight
 * copies, the cuBLASLt handle); the CPU math is in plugins/lib/grouped_gemm_cpu.c, the CUDA GEMMs in
 * plugins/lib/precision_bf16_cuda.cu (cuBLASLt) and device_gemm.cu (counts read on the device: option "gemm": "kernel", graph-capturable, and under
 * "auto" the Hopper engine's FORWARD and DGRAD). */
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moert/precision.h"
#include "../lib/grouped_gemm_args.h"
#include "../lib/grouped_gemm_cpu.h"
#include "../lib/plugin_report.h"
#include "../lib/sm_yield_counters.h"
#include "../lib/tensor_args.h"
#ifdef MOERT_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "../lib/plugin_cuda_check.h"

#include "../lib/device_gemm.h"
#include "../lib/device_gemm_wgmma.h"
#include "../lib/precision_bf16_cuda.h"
#endif

#ifdef MOERT_HAVE_CUDA
/* A bf16 copy of one fp32 expert weight: made on first use, remade by end_step() after each optimizer step. */
typedef struct bf16_weight_copy {
    void *data; /* bf16 [E_local, K_in, N_out] on the layer's device */
    size_t bytes;
    const void *source; /* the fp32 weight it was made from; NULL when stale */
    int64_t numel;      /* elements converted from source */
} bf16_weight_copy;
#endif

typedef struct bf16_ctx {
    const moert_host *host;
    moert_layer_info layer;
    bf16_mode mode;
    bf16_scratch scratch;
    bool on_cuda;       /* the layer is on a CUDA device: the CUDA path serves it */
    int gemm_streams;   /* option: streams of the CUDA per-expert loop (1: the caller's only) */
    int gemm_sms;       /* option: SMs the CUDA GEMMs may take (0: all) */
    int wgrad_sms;      /* option: SMs the WGRAD kernel may take (0: as gemm_sms) */
    bool gemm_graphs;   /* option: CUDA graph replay of repeated count vectors */
    int gemm_engine;    /* option "gemm": GEMM_AUTO, GEMM_CUBLASLT or GEMM_KERNEL */
    int wgrad_engine;   /* option "wgrad_gemm": GEMM_AUTO (as "gemm"), GEMM_CUBLASLT or GEMM_KERNEL */
    int wgrad_schedule; /* option "wgrad_schedule": by wgrad_schedules, as device_gemm.h's BF16_WGMMA_WGRAD_* */
#ifdef MOERT_HAVE_CUDA
    bool use_kernel;                 /* the CUDA path runs device_gemm for every pass ("kernel" on a CUDA layer) */
    bool wgmma_fwd_dgrad;            /* "auto" on Hopper: FORWARD/DGRAD with device counts on device_gemm's wgmma
                                         engine */
    int64_t *zero_counts;            /* [E_local] zeros: what the argument checks see when counts are device-only */
    moert_bf16_cuda *gemm;           /* cuBLASLt handle, created on the layer's device (not in kernel mode) */
    void *workspace;                 /* its workspace, from the host's pool */
    bf16_weight_copy weight_copy[2]; /* by moert_gemm_weight (FC1, FC2) */
    /* another slot's instance (moert_layer_info.twin): the slot-0 instance whose weight copies it reads while they are
     * of the weight it is given, so the slots of a layer hold one copy (else itself) */
    const struct bf16_ctx *owner;
    int64_t *counts_host;       /* [E_local] pinned: device counts copied down when no host copy is given */
    moert_yield_counters yield; /* the layer's sm_yield: a device_gemm work counter pair per stream (or none) */
#endif
} bf16_ctx;

static const char *const mode_choices[] = {"auto", "bf16", "fp32", "fp64", NULL};
static const char *const gemm_choices[] = {"auto", "cublaslt", "kernel", NULL};
enum { GEMM_AUTO = 0, GEMM_CUBLASLT = 1, GEMM_KERNEL = 2 };       /* by gemm_choices */
static const char *const mode_names[] = {"bf16", "fp32", "fp64"}; /* by bf16_mode */
static const char *const wgrad_schedules[] = {"auto", "pingpong", "cooperative", NULL};

/* Sets the instance's error message and returns code, so checks can `return fail(...)`. */
#define fail(c, ...) report((c)->host, __VA_ARGS__)

#ifdef MOERT_HAVE_CUDA
/* Where the layer has sm_yield (the micro-batch overlap, moert/plugin.h), the wgmma FORWARD/DGRAD hand their units out
 * through a counter pair per stream and leave the SMs a dispatcher call asks for; called with the layer's device
 * current. */
static moert_result yield_init(bf16_ctx *c) { return moert_yield_counters_init(&c->yield, c->host, &c->layer); }
#endif

static void bf16_finalize(void *ctx);

#ifdef MOERT_HAVE_CUDA
/*
 * The kernel mode's state ("gemm": "kernel"): bf16 storage and sizes the kernel takes, the kernels prepared on the
 * layer's device, both bf16 weight copies allocated now (so no step allocates), the zero counts the argument checks
 * see when the counts live only on the device, and the instance's flags: graph-capturable, WGRAD overwrite.
 */
static moert_result kernel_init(bf16_ctx *c, const char *dev)
{
    const moert_host *h = c->host;
    const int64_t E = c->layer.num_local_experts, H = c->layer.hidden, F = c->layer.ffn_hidden;
    if (c->mode != BF16_MODE_BF16 || c->layer.dtype != MOERT_BF16)
        return fail(c, MOERT_ERR_UNSUPPORTED,
                    "$.precision.gemm: \"kernel\" needs bf16 storage (model.dtype bf16 and "
                    "mode \"auto\" or \"bf16\"); the layer on %s has %s activations and mode %s: use \"cublaslt\"",
                    dev, moert_dtype_name(c->layer.dtype), mode_names[c->mode]);
    if (H % 8 || F % 8)
        return fail(c, MOERT_ERR_UNSUPPORTED,
                    "$.precision.gemm: \"kernel\" needs hidden and ffn_hidden multiples of 8 "
                    "(16-byte rows), got hidden %lld, ffn_hidden %lld: use \"cublaslt\"",
                    (long long)H, (long long)F);
    if (E < 1 || E > BF16_DEVICE_GEMM_MAX_EXPERTS)
        return fail(c, MOERT_ERR_UNSUPPORTED,
                    "$.precision.gemm: \"kernel\" takes 1 to %d local experts, the layer has "
                    "%lld: use \"cublaslt\"",
                    BF16_DEVICE_GEMM_MAX_EXPERTS, (long long)E);
    c->zero_counts = calloc((size_t)E, sizeof(int64_t));
    if (!c->zero_counts) return fail(c, MOERT_ERR_OUT_OF_MEMORY, "out of memory for the precision state");
    const int64_t numel[2] = {E * H * 2 * F, E * F * H}; /* FC1, FC2 */
    /* another slot reads slot 0's copies (weight_copy_get); it makes its own only for a weight slot 0 has not seen */
    for (int w = 0; c->owner == c && w < 2; w++) {
        const size_t bytes = (size_t)numel[w] * sizeof(uint16_t);
        moert_result rc = h->alloc(h, c->layer.device, bytes, &c->weight_copy[w].data);
        if (rc == MOERT_ERR_UNSUPPORTED)
            return fail(c, rc,
                        "the host serving this instance cannot allocate on %s (a CPU-only host): only a CPU path "
                        "is usable with it",
                        dev);
        if (rc != MOERT_OK) return rc;
        c->weight_copy[w].bytes = bytes;
    }
    const int id = (int)c->layer.device.id;
    int previous = -1;
    cudaError_t err = cudaGetDevice(&previous);
    if (err == cudaSuccess && previous != id) err = cudaSetDevice(id);
    if (err != cudaSuccess) {
        (void)cudaGetLastError();
        return fail(c, MOERT_ERR_CUDA, "cudaSetDevice(%d) failed: %s", id, cudaGetErrorString(err));
    }
    moert_result rc = bf16_device_gemm_prepare(h);
    if (rc == MOERT_OK) rc = yield_init(c);
    if (previous >= 0 && previous != id) (void)cudaSetDevice(previous);
    if (rc != MOERT_OK) return rc;
    c->use_kernel = true;
    if (h->struct_size >= offsetof(moert_host, set_flags) + sizeof h->set_flags && h->set_flags)
        h->set_flags(h, MOERT_CAP_GRAPH_CAPTURABLE | MOERT_CAP_WGRAD_OVERWRITE);
    else
        h->log(h, MOERT_LOG_WARN,
               "bf16 precision: \"gemm\": \"kernel\" is graph-capturable, but this host (ABI "
               "older than 1.1) cannot take the instance's flags");
    return MOERT_OK;
}

/*
 * The CUDA path's state: checks the mode against the activation dtype (bf16 GEMMs on bf16 activations, fp32
 * GEMMs on fp32 ones), then makes the cuBLASLt handle on the layer's device with a workspace from the host
 * (one slice per stream of the per-expert loop), its internal streams and, if asked, graph replay.
 */
static moert_result cuda_init(bf16_ctx *c, int choice)
{
    const moert_host *h = c->host;
    const int id = (int)c->layer.device.id;
    const moert_dtype act = c->layer.dtype;
    char dev[32];
    moert_arg_device_text(c->layer.device, dev, sizeof dev);
    if (c->mode == BF16_MODE_FP64 || act == MOERT_F64)
        return fail(c, MOERT_ERR_UNSUPPORTED,
                    "the bf16 precision plugin has no fp64 GEMMs on CUDA (layer on %s, "
                    "activations %s, mode \"%s\"): use model.dtype bf16 or fp32, or run on the CPU",
                    dev, moert_dtype_name(act), mode_choices[choice]);
    if (act != MOERT_BF16 && act != MOERT_F32)
        return fail(c, MOERT_ERR_UNSUPPORTED,
                    "the bf16 precision plugin on CUDA (%s) takes bf16 or fp32 activations, "
                    "not %s",
                    dev, moert_dtype_name(act));
    const moert_dtype want = c->mode == BF16_MODE_BF16 ? MOERT_BF16 : MOERT_F32;
    if (act != want)
        return fail(c, MOERT_ERR_UNSUPPORTED,
                    "option \"mode\": \"%s\" with %s activations is not supported on CUDA "
                    "(%s): bf16 GEMMs need bf16 activations and fp32 GEMMs fp32 ones; use \"auto\"",
                    mode_choices[choice], moert_dtype_name(act), dev);
    MOK(check_cuda_device_visible(c->host, id, dev));
    if (c->gemm_engine == GEMM_KERNEL) return kernel_init(c, dev);
    const size_t workspace_bytes = (size_t)c->gemm_streams * MOERT_BF16_CUDA_STREAM_WORKSPACE_BYTES;
    moert_result rc = h->alloc(h, c->layer.device, workspace_bytes, &c->workspace);
    if (rc == MOERT_ERR_UNSUPPORTED)
        return fail(c, rc,
                    "the host serving this instance cannot allocate on %s (a CPU-only host): only a CPU path is "
                    "usable with it",
                    dev);
    if (rc != MOERT_OK) return rc;
    rc = h->alloc_pinned(h, (size_t)c->layer.num_local_experts * sizeof(int64_t), (void **)&c->counts_host);
    if (rc != MOERT_OK) return rc;
    int previous = -1;
    cudaError_t err = cudaGetDevice(&previous);
    if (err == cudaSuccess && previous != id) err = cudaSetDevice(id);
    if (err != cudaSuccess) {
        (void)cudaGetLastError();
        return fail(c, MOERT_ERR_CUDA, "cudaSetDevice(%d) failed: %s", id, cudaGetErrorString(err));
    }
    rc = moert_bf16_cuda_create(h, c->workspace, workspace_bytes, MOERT_BF16_CUDA_EXPERT_LOOP, &c->gemm);
    if (rc == MOERT_OK) rc = moert_bf16_cuda_set_streams(c->gemm, c->gemm_streams);
    if (rc == MOERT_OK && c->gemm_sms > 0) rc = moert_bf16_cuda_set_sm_count(c->gemm, c->gemm_sms);
    if (rc == MOERT_OK && c->gemm_graphs) rc = moert_bf16_cuda_set_graphs(c->gemm, 1);
    /* "auto": FORWARD and DGRAD on the wgmma engine where the GPU has it and the sizes suit it, WGRAD on cuBLASLt (at
     * the presets' shapes the loop on 4 streams beats the kernel: docs/plugins/precision_bf16.md); "wgrad_gemm":
     * "kernel": WGRAD on device_gemm whatever the GPU */
    const int64_t E = c->layer.num_local_experts, H = c->layer.hidden, F = c->layer.ffn_hidden;
    const bool sizes_suit =
        c->mode == BF16_MODE_BF16 && H % 8 == 0 && F % 8 == 0 && E >= 1 && E <= BF16_DEVICE_GEMM_MAX_EXPERTS;
    if (rc == MOERT_OK && c->wgrad_engine == GEMM_KERNEL && !sizes_suit)
        rc = fail(c, MOERT_ERR_UNSUPPORTED,
                  "$.precision.wgrad_gemm: \"kernel\" needs bf16 storage, hidden and ffn_hidden multiples of 8 and "
                  "1 to %d local experts",
                  BF16_DEVICE_GEMM_MAX_EXPERTS);
    if (rc == MOERT_OK && sizes_suit && (c->gemm_engine == GEMM_AUTO || c->wgrad_engine == GEMM_KERNEL)) {
        c->zero_counts = calloc((size_t)E, sizeof(int64_t));
        if (!c->zero_counts) rc = fail(c, MOERT_ERR_OUT_OF_MEMORY, "out of memory for the precision state");
        if (rc == MOERT_OK) rc = bf16_device_gemm_prepare(h);
        c->wgmma_fwd_dgrad = rc == MOERT_OK && bf16_wgmma_available() != 0 && c->gemm_engine == GEMM_AUTO;
        if (rc == MOERT_OK && c->wgmma_fwd_dgrad) rc = yield_init(c);
    }
    if (previous >= 0 && previous != id) (void)cudaSetDevice(previous);
    return rc;
}
#endif

/* Creates one instance: reads the options ("mode", resolving "auto" from the layer's activation dtype, and the
 * CUDA path's "gemm_streams" and "gemm_graphs", read on every device so the keys are known; unused on the CPU). */
static moert_result bf16_init(void **out, const moert_host *host, const moert_layer_info *layer)
{
    *out = NULL;
    moert_result rc = moert_arg_check_layer_device(host, layer->device, "the bf16 precision plugin");
    if (rc != MOERT_OK) return rc;
    int choice = 0;
    rc = host->option_enum(host, "mode", mode_choices, 0,
                           "GEMM arithmetic: bf16 operands with fp32 accumulation, fp32 or fp64; "
                           "auto follows the activation dtype",
                           &choice);
    if (rc != MOERT_OK) return rc;
    int64_t gemm_streams = 4; /* at most 8: MOERT_BF16_CUDA_MAX_STREAMS (its header is in CUDA builds only) */
    rc = host->option_int(host, "gemm_streams", 4, 1, 8,
                          "CUDA: streams the per-expert GEMMs are spread over (1: the caller's stream only); "
                          "each takes a 32 MiB cuBLASLt workspace",
                          &gemm_streams);
    if (rc != MOERT_OK) return rc;
    int64_t gemm_sms = 0;
    rc = host->option_int(host, "gemm_sms", 0, 0, 4096,
                          "CUDA: the SMs the grouped GEMMs may take (0: all); fewer leave SMs free for kernels running "
                          "beside them on another stream, such as a dispatcher's under the micro-batch overlap",
                          &gemm_sms);
    if (rc != MOERT_OK) return rc;
    int64_t wgrad_sms = 0;
    rc = host->option_int(host, "wgrad_sms", 0, 0, 4096,
                          "CUDA, weight gradients on the kernel: the SMs its persistent grid may take (0: as "
                          "gemm_sms); fewer leave SMs to the other half's GEMMs and the dispatcher under the "
                          "micro-batch overlap, where the weight gradients fill the gaps",
                          &wgrad_sms);
    if (rc != MOERT_OK) return rc;
    bool gemm_graphs = false;
    rc = host->option_bool(host, "gemm_graphs", false,
                           "CUDA: replay a grouped GEMM from a CUDA graph when its count vector repeats "
                           "(benchmarks, repeated batches)",
                           &gemm_graphs);
    if (rc != MOERT_OK) return rc;
    int gemm_choice = 0;
    rc = host->option_enum(host, "gemm", gemm_choices, 0,
                           "CUDA: the grouped GEMMs' engine: cublaslt (per-expert loop, host counts), kernel (bf16 "
                           "only: reads the counts on the device, no host sync, graph-capturable), or auto (bf16 on "
                           "Hopper: forward and dgrad on moert's wgmma kernel, wgrad on cuBLASLt; else cublaslt)",
                           &gemm_choice);
    if (rc != MOERT_OK) return rc;
    int wgrad_choice = 0;
    rc = host->option_enum(host, "wgrad_gemm", gemm_choices, 0,
                           "CUDA: the engine of the weight-gradient GEMMs alone: auto (as \"gemm\": cuBLASLt under "
                           "auto), cublaslt, or kernel (moert's grouped kernel: counts read on the device, wgmma on "
                           "Hopper into fp32 gradients)",
                           &wgrad_choice);
    if (rc != MOERT_OK) return rc;
    int wgrad_schedule = 0;
    rc = host->option_enum(host, "wgrad_schedule", wgrad_schedules, 0,
                           "CUDA, Hopper, weight gradients on the kernel: the wgmma kernel's schedule, auto (pingpong "
                           "below 2048 rows an expert on average, else cooperative), pingpong (128 x 128 tiles, one "
                           "per consumer warpgroup, one multiplying while the other writes) or cooperative (128 x 256 "
                           "tiles, both consumer warpgroups on each)",
                           &wgrad_schedule);
    if (rc != MOERT_OK) return rc;
    if (gemm_choice == GEMM_KERNEL && wgrad_choice == GEMM_CUBLASLT) {
        host->set_error(host, "config error at $.precision.wgrad_gemm: \"cublaslt\" needs \"gemm\" \"auto\" or "
                              "\"cublaslt\"; \"gemm\": \"kernel\" runs without cuBLASLt");
        return MOERT_ERR_CONFIG;
    }
    bf16_ctx *c = calloc(1, sizeof *c);
    if (!c) {
        host->set_error(host, "out of memory for the precision state");
        return MOERT_ERR_OUT_OF_MEMORY;
    }
    c->host = host;
    moert_layer_info_copy(&c->layer, layer);
    c->mode = choice == 0 ? bf16_mode_for_dtype(layer->dtype) : (bf16_mode)(choice - 1); /* 0: auto */
    c->on_cuda = layer->device.type == MOERT_DEVICE_CUDA;
    c->gemm_streams = (int)gemm_streams;
    c->gemm_sms = (int)gemm_sms;
    c->wgrad_sms = (int)wgrad_sms;
    c->gemm_graphs = gemm_graphs;
    c->gemm_engine = gemm_choice;
    c->wgrad_engine = wgrad_choice;
    c->wgrad_schedule = wgrad_schedule;
#ifdef MOERT_HAVE_CUDA
    c->owner = MOERT_LAYER_INFO_HAS_TWIN(layer) && layer->twin ? (const bf16_ctx *)layer->twin : c;
    if (c->on_cuda) {
        rc = cuda_init(c, choice);
        if (rc != MOERT_OK) {
            bf16_finalize(c);
            return rc;
        }
    }
#endif
    char dev[32];
    host->log(host, MOERT_LOG_DEBUG, "bf16 precision: mode %s (option \"%s\", activations %s, %s, gemm %s)",
              mode_names[c->mode], mode_choices[choice], moert_dtype_name(layer->dtype),
              moert_arg_device_text(layer->device, dev, sizeof dev), gemm_choices[gemm_choice]);
    *out = c;
    return MOERT_OK;
}

/* Frees the instance: the cuBLASLt handle, weight copies and buffers (back to the host's pool, stream-ordered). */
static void bf16_finalize(void *ctx)
{
    bf16_ctx *c = ctx;
    if (!c) return;
#ifdef MOERT_HAVE_CUDA
    const moert_host *h = c->host;
    if (c->gemm) moert_bf16_cuda_destroy(c->gemm);
    for (int w = 0; w < 2; w++)
        if (c->weight_copy[w].data) h->free(h, c->layer.device, c->weight_copy[w].data);
    if (c->workspace) h->free(h, c->layer.device, c->workspace);
    if (c->counts_host) h->free_pinned(h, c->counts_host);
    moert_yield_counters_free(&c->yield, h, &c->layer);
    free(c->zero_counts);
#endif
    bf16_scratch_free(&c->scratch);
    free(c);
}

#ifdef MOERT_HAVE_CUDA
/*
 * The bf16 copy of weight `which`, made from the fp32 `weight` on first use after end_step() (or when another
 * weight tensor comes), by a conversion kernel on `stream`; later GEMMs of the step reuse it.
 */
static moert_result weight_copy_get(bf16_ctx *c, moert_stream stream, moert_gemm_weight which,
                                    const moert_tensor *weight, const void **out)
{
    const moert_host *h = c->host;
    bf16_weight_copy *wc = &c->weight_copy[which];
    const int64_t n = moert_tensor_numel(weight);
    const size_t bytes = (size_t)n * sizeof(uint16_t);
    /* another slot: slot 0's copy, made or remade (end_step) on slot 0's stream, which every call of this slot's
     * stream follows (the core forks it from slot 0's); slot 0 remakes it only for another weight pointer, which the
     * core does not accept while a forward of the layer is in flight, so not while this slot's calls run */
    const bf16_weight_copy *shared = c->owner != c ? &c->owner->weight_copy[which] : NULL;
    if (shared && shared->source == weight->data && shared->bytes >= bytes) {
        *out = shared->data;
        return MOERT_OK;
    }
    if (wc->source == weight->data && wc->bytes >= bytes) {
        *out = wc->data;
        return MOERT_OK;
    }
    wc->source = NULL;
    if (wc->bytes < bytes) {
        if (wc->data) h->free(h, c->layer.device, wc->data);
        wc->data = NULL;
        wc->bytes = 0;
        moert_result rc = h->alloc(h, c->layer.device, bytes, &wc->data);
        if (rc != MOERT_OK) return rc;
        wc->bytes = bytes;
    }
    moert_result rc = moert_bf16_cuda_round_to_bf16(h, (cudaStream_t)stream, n, weight->data, wc->data);
    if (rc != MOERT_OK) return rc;
    wc->source = weight->data;
    wc->numel = n;
    *out = wc->data;
    return MOERT_OK;
}

/*
 * One grouped GEMM on the layer's GPU, arguments already checked. bf16 mode: bf16 activations, the weight's
 * bf16 copy (or a bf16 weight as it is), an fp32 grad_weight accumulated with fp32 C/D (or a bf16 one);
 * fp32 mode: everything fp32.
 */
static moert_result cuda_grouped_gemm(bf16_ctx *c, moert_stream stream, const moert_grouped_gemm_args *args,
                                      const bf16_gemm_shape *shape, const char *call)
{
    const moert_dtype act = c->mode == BF16_MODE_BF16 ? MOERT_BF16 : MOERT_F32;
    const moert_tensor *acts[2];
    const char *act_names[2];
    switch (args->pass) {
    case MOERT_GEMM_FORWARD:
        acts[0] = args->input;
        act_names[0] = "input";
        acts[1] = args->output;
        act_names[1] = "output";
        break;
    case MOERT_GEMM_DGRAD:
        acts[0] = args->grad_output;
        act_names[0] = "grad_output";
        acts[1] = args->grad_input;
        act_names[1] = "grad_input";
        break;
    default:
        acts[0] = args->input;
        act_names[0] = "input";
        acts[1] = args->grad_output;
        act_names[1] = "grad_output";
        break;
    }
    for (int i = 0; i < 2; i++)
        if (acts[i]->dtype != act)
            return fail(c, MOERT_ERR_UNSUPPORTED, "%s: %s has dtype %s; on CUDA, mode %s takes %s activations", call,
                        act_names[i], moert_dtype_name(acts[i]->dtype), mode_names[c->mode], moert_dtype_name(act));

    moert_bf16_cuda_gemm gm;
    memset(&gm, 0, sizeof gm);
    gm.pass = args->pass;
    gm.dtype = act;
    gm.num_experts = shape->num_experts;
    gm.rows_per_expert = shape->counts;
    gm.k_in = shape->k_in;
    gm.n_out = shape->n_out;
    gm.accumulate = !moert_gemm_overwrites_grad(args);
    if (args->pass == MOERT_GEMM_WGRAD) {
        const moert_dtype gw = args->grad_weight->dtype;
        if (gw != act && !(act == MOERT_BF16 && gw == MOERT_F32))
            return fail(c, MOERT_ERR_UNSUPPORTED,
                        "%s: grad_weight has dtype %s; on CUDA, mode %s accumulates into "
                        "%s%s",
                        call, moert_dtype_name(gw), mode_names[c->mode], moert_dtype_name(act),
                        act == MOERT_BF16 ? " or fp32" : "");
        gm.output_fp32 = gw != act;
        gm.input = args->input->data;
        gm.grad_output = args->grad_output->data;
        gm.grad_weight = args->grad_weight->data;
    } else {
        const moert_dtype wd = args->weight->dtype;
        if (wd == act) {
            gm.weight = args->weight->data;
        } else if (act == MOERT_BF16 && wd == MOERT_F32) {
            moert_result rc = weight_copy_get(c, stream, args->which, args->weight, &gm.weight);
            if (rc != MOERT_OK) return rc;
        } else {
            return fail(c, MOERT_ERR_UNSUPPORTED, "%s: weight has dtype %s; on CUDA, mode %s takes %s%s weights", call,
                        moert_dtype_name(wd), mode_names[c->mode], moert_dtype_name(act),
                        act == MOERT_BF16 ? " or fp32" : "");
        }
        if (args->pass == MOERT_GEMM_FORWARD) {
            gm.input = args->input->data;
            gm.output = args->output->data;
        } else {
            gm.grad_output = args->grad_output->data;
            gm.grad_input = args->grad_input->data;
        }
    }
    return moert_bf16_cuda_grouped_gemm(c->gemm, (cudaStream_t)stream, &gm);
}
#endif

#ifdef MOERT_HAVE_CUDA
/*
 * One grouped GEMM through device_gemm (kernel mode), arguments already checked: bf16 activations, the weight's bf16
 * copy (or a bf16 weight as it is), an fp32 or bf16 grad_weight. The counts are the device tensor, read by the
 * kernel only; nothing here waits for the device or allocates.
 */
static moert_result kernel_grouped_gemm(bf16_ctx *c, moert_stream stream, const moert_grouped_gemm_args *args,
                                        const bf16_gemm_shape *shape, const char *call)
{
    char a_dev[32], b_dev[32];
    const moert_tensor *tpe = args->tokens_per_expert;
    if (!tpe || !tpe->data || tpe->device.type != MOERT_DEVICE_CUDA || tpe->device.id != c->layer.device.id)
        return fail(c, MOERT_ERR_UNSUPPORTED,
                    "%s: \"gemm\": \"kernel\" reads the counts on the device: "
                    "tokens_per_expert must be int64 [%lld] on %s, it is %s",
                    call, (long long)shape->num_experts, moert_arg_device_text(c->layer.device, a_dev, sizeof a_dev),
                    !tpe || !tpe->data ? "missing" : moert_arg_device_text(tpe->device, b_dev, sizeof b_dev));
    const moert_tensor *acts[2];
    const char *act_names[2];
    switch (args->pass) {
    case MOERT_GEMM_FORWARD:
        acts[0] = args->input, act_names[0] = "input";
        acts[1] = args->output, act_names[1] = "output";
        break;
    case MOERT_GEMM_DGRAD:
        acts[0] = args->grad_output, act_names[0] = "grad_output";
        acts[1] = args->grad_input, act_names[1] = "grad_input";
        break;
    default:
        acts[0] = args->input, act_names[0] = "input";
        acts[1] = args->grad_output, act_names[1] = "grad_output";
        break;
    }
    for (int i = 0; i < 2; i++)
        if (acts[i]->dtype != MOERT_BF16)
            return fail(c, MOERT_ERR_UNSUPPORTED, "%s: %s has dtype %s; \"gemm\": \"kernel\" takes bf16 activations",
                        call, act_names[i], moert_dtype_name(acts[i]->dtype));
    bf16_device_gemm_args ka;
    memset(&ka, 0, sizeof ka);
    ka.pass = args->pass;
    ka.num_experts = shape->num_experts;
    ka.counts_device = tpe->data;
    ka.capacity = acts[0]->shape[0];
    ka.k_in = shape->k_in;
    ka.n_out = shape->n_out;
    ka.max_sms = c->gemm_sms;
    if (args->pass == MOERT_GEMM_WGRAD) {
        const moert_dtype gw = args->grad_weight->dtype;
        if (gw != MOERT_F32 && gw != MOERT_BF16)
            return fail(c, MOERT_ERR_UNSUPPORTED,
                        "%s: grad_weight has dtype %s; \"gemm\": \"kernel\" accumulates "
                        "into fp32 or bf16",
                        call, moert_dtype_name(gw));
        ka.input = args->input->data;
        ka.grad_output = args->grad_output->data;
        ka.grad_weight = args->grad_weight->data;
        ka.grad_weight_bf16 = gw == MOERT_BF16;
        ka.accumulate = !moert_gemm_overwrites_grad(args);
        ka.wgrad_schedule = c->wgrad_schedule;
        if (c->wgrad_sms > 0) ka.max_sms = c->wgrad_sms;
    } else {
        const moert_dtype wd = args->weight->dtype;
        if (wd == MOERT_BF16) {
            ka.weight = args->weight->data;
        } else if (wd == MOERT_F32) {
            moert_result rc = weight_copy_get(c, stream, args->which, args->weight, &ka.weight);
            if (rc != MOERT_OK) return rc;
        } else {
            return fail(c, MOERT_ERR_UNSUPPORTED,
                        "%s: weight has dtype %s; \"gemm\": \"kernel\" takes bf16 or fp32 "
                        "weights",
                        call, moert_dtype_name(wd));
        }
        if (args->pass == MOERT_GEMM_FORWARD) {
            ka.input = args->input->data;
            ka.output = args->output->data;
        } else {
            ka.grad_output = args->grad_output->data;
            ka.grad_input = args->grad_input->data;
        }
        ka.work_counter = moert_yield_counters_for(&c->yield, stream);
        if (ka.work_counter) ka.sm_yield = MOERT_LAYER_INFO_SM_YIELD(&c->layer);
    }
    return bf16_device_gemm(c->host, (cudaStream_t)stream, &ka);
}
#endif

/* One grouped GEMM (FORWARD, DGRAD or WGRAD) over the local experts. */
#ifdef MOERT_HAVE_CUDA
/* The instance and stream a count fetch runs on. */
typedef struct counts_fetch {
    bf16_ctx *c;
    moert_stream stream;
    bool on_device; /* device_gemm serves the call: it reads the counts itself */
} counts_fetch;

/* Whether this call runs on device_gemm outside kernel mode: FORWARD or DGRAD on the wgmma engine ("auto" on Hopper),
 * WGRAD into an fp32 gradient ("wgrad_gemm": "kernel"), with the counts on the layer's GPU. */
static bool wgmma_serves(const bf16_ctx *c, const moert_grouped_gemm_args *args)
{
    const moert_tensor *tpe = args->tokens_per_expert;
    const bool pass_on_kernel = args->pass == MOERT_GEMM_WGRAD ? c->wgrad_engine == GEMM_KERNEL && args->grad_weight &&
                                                                     args->grad_weight->dtype == MOERT_F32
                                                               : c->wgmma_fwd_dgrad;
    return pass_on_kernel && tpe && tpe->data && tpe->device.type == MOERT_DEVICE_CUDA &&
           tpe->device.id == c->layer.device.id && tpe->dtype == MOERT_I64;
}

/* Counts that live only on the layer's GPU: copied down into pinned memory with a bounded wait for the stream. When
 * device_gemm serves the call nothing is copied: the checks see zeros (the kernel reads the counts and clamps them to
 * the rows). */
static moert_result fetch_counts(void *user, const moert_tensor *t, const int64_t **counts)
{
    counts_fetch *f = user;
    if (f->on_device) {
        *counts = f->c->zero_counts;
        return MOERT_OK;
    }
    const moert_host *h = f->c->host;
    moert_result rc = h->memcpy_async(h, f->c->counts_host, moert_cpu(), t->data, t->device,
                                      (size_t)f->c->layer.num_local_experts * sizeof(int64_t), f->stream);
    if (rc == MOERT_OK) rc = h->stream_synchronize(h, f->stream);
    if (rc == MOERT_OK) *counts = f->c->counts_host;
    return rc;
}
#endif

static moert_result bf16_grouped_gemm(void *ctx, moert_stream stream, const moert_grouped_gemm_args *args)
{
    bf16_ctx *c = ctx;
    char call[64] = "grouped_gemm()";
    bf16_gemm_shape shape;
#ifdef MOERT_HAVE_CUDA
    const bool on_wgmma = wgmma_serves(c, args);
    counts_fetch fetch = {c, stream, c->use_kernel || on_wgmma};
    moert_result rc = moert_gemm_check_args(c->host, &c->layer, args, fetch_counts, &fetch, call, sizeof call, &shape);
#else
    moert_result rc = moert_gemm_check_args(c->host, &c->layer, args, NULL, NULL, call, sizeof call, &shape);
#endif
    if (rc != MOERT_OK) return rc;
#ifdef MOERT_HAVE_CUDA
    if (c->use_kernel || on_wgmma) return kernel_grouped_gemm(c, stream, args, &shape, call);
    if (c->on_cuda) return cuda_grouped_gemm(c, stream, args, &shape, call);
#endif
    rc = bf16_cpu_grouped_gemm(args, &shape, c->mode, &c->scratch);
    if (rc != MOERT_OK) return fail(c, rc, "%s: out of memory for the GEMM's work buffers", call);
    return MOERT_OK;
}

/* The weights changed (the optimizer has just run): the CUDA path remakes its bf16 weight copies now, on the
 * step's stream, so the cast belongs to the optimizer step and not to the next forward's fc1 (as in Megatron,
 * where the optimizer writes the bf16 parameters). The CPU path caches nothing. */
static moert_result bf16_end_step(void *ctx, moert_stream stream)
{
    bf16_ctx *c = ctx;
#ifdef MOERT_HAVE_CUDA
    for (int w = 0; w < 2; w++) {
        bf16_weight_copy *wc = &c->weight_copy[w];
        if (!wc->source || !wc->data) continue;
        moert_result rc = moert_bf16_cuda_round_to_bf16(c->host, (cudaStream_t)stream, wc->numel, wc->source, wc->data);
        if (rc != MOERT_OK) {
            wc->source = NULL; /* remade on first use instead */
            return rc;
        }
    }
#else
    (void)c;
    (void)stream;
#endif
    return MOERT_OK;
}

/* The one exported symbol. Its name equals the vtable's typedef name, which C does not allow for an object in the
 * same scope, so the object gets a private C name and its linker name through an asm label. */
MOERT_PRECISION_V1_EXPORT(bf16_vtable) = {
    .header =
        {
            MOERT_PRECISION_V1_HEADER,
            .name = "bf16",
            .version = "0.1.0",
            .description = "grouped GEMMs with bf16 operands and fp32 accumulation (or fp32, fp64)",
#ifdef MOERT_HAVE_CUDA
            .devices = MOERT_CAP_DEVICE(MOERT_DEVICE_CPU) | MOERT_CAP_DEVICE(MOERT_DEVICE_CUDA),
#else
            .devices = MOERT_CAP_DEVICE(MOERT_DEVICE_CPU),
#endif
            .dtypes = MOERT_CAP_DTYPE(MOERT_F32) | MOERT_CAP_DTYPE(MOERT_F64) | MOERT_CAP_DTYPE(MOERT_BF16) |
                      MOERT_CAP_DTYPE(MOERT_F16),
            .flags = MOERT_CAP_NEEDS_HOST_SYNC | MOERT_CAP_WGRAD_OVERWRITE,
        },
    .init = bf16_init,
    .finalize = bf16_finalize,
    .grouped_gemm = bf16_grouped_gemm,
    .end_step = bf16_end_step,
    /* One bf16 rounding that goes the other way (a sum taken in another order, a GEMM tiled otherwise) moves a value
     * by one ulp, at most 2^-7 = 7.8e-3 of it and so of the tensor's largest value; 1e-2 allows that and no more. */
    .agreement_rtol = 1e-2,
};
