/* SPDX-License-Identifier: Apache-2.0 */
/*
 * An out-of-tree router plugin with a CUDA kernel, built against an installed moert with its headers and nvcc:
 * "stride" sends copy j of token t to expert (t * stride + j) mod E, each with weight 1/K. Like the CPU example
 * (examples/vendor_plugin) it learns nothing, but it routes where the layer lives: a loop on the CPU, and on a GPU
 * a kernel on the stream moert hands it (stride_kernel.cu), with no host sync, so the plugin declares itself
 * capturable in a CUDA graph. This file is plain C11; the kernel and its C entry points are in stride_kernel.cu.
 *
 * Build:  make                      (pkg-config --cflags moert, nvcc)
 * Use:    {"router": {"plugin": "/path/to/libmoert-router-stride.so", "stride": 3}}
 */
#include <stdlib.h>
#include <string.h>

#include <moert/router.h>

#include "stride_kernel.h"

typedef struct stride_ctx {
    const moert_host *host;
    moert_device device; /* where the layer's tensors live */
    int64_t num_experts, topk, hidden;
    int64_t stride;
} stride_ctx;

/* Reads the option, checks the device, and on a GPU makes it the rank thread's current device. */
static moert_result stride_init(void **ctx, const moert_host *host, const moert_layer_info *layer)
{
    int64_t stride = 1;
    moert_result rc = host->option_int(host, "stride", 1, 1, 1 << 20,
                                       "token t's copy j goes to expert (t * stride + j) mod E", &stride);
    if (rc != MOERT_OK) return rc; /* the host has set the message */
    if (layer->device.type == MOERT_DEVICE_CUDA) {
        int err = stride_cuda_use_device((int)layer->device.id);
        if (err) {
            host->set_error(host, "stride: cuda:%d cannot be used: %s", (int)layer->device.id,
                            stride_cuda_error_text(err));
            return MOERT_ERR_UNSUPPORTED;
        }
    } else if (layer->device.type != MOERT_DEVICE_CPU) {
        host->set_error(host, "stride: the layer's device (type %d) is neither the CPU nor a CUDA GPU",
                        (int)layer->device.type);
        return MOERT_ERR_UNSUPPORTED;
    }
    stride_ctx *c = calloc(1, sizeof *c);
    if (!c) {
        host->set_error(host, "stride: out of memory");
        return MOERT_ERR_OUT_OF_MEMORY;
    }
    c->host = host;
    c->device = layer->device;
    c->num_experts = layer->num_experts;
    c->topk = layer->topk;
    c->hidden = layer->hidden;
    c->stride = stride;
    *ctx = c;
    return MOERT_OK;
}

static void stride_finalize(void *ctx) { free(ctx); }

/* True if t has the given rank, dims and dtype (dtype < 0: fp32 or fp64), is contiguous and lives on device. */
static bool shaped(const moert_tensor *t, int ndim, int64_t d0, int64_t d1, int dtype, moert_device device)
{
    if (!t || !t->data || t->ndim != ndim || t->shape[0] != d0) return false;
    if (ndim == 2 && t->shape[1] != d1) return false;
    if (dtype >= 0 && t->dtype != (moert_dtype)dtype) return false;
    if (dtype < 0 && t->dtype != MOERT_F32 && t->dtype != MOERT_F64) return false;
    return t->device.type == device.type && t->device.id == device.id && moert_tensor_is_contiguous(t);
}

/* Checks the outputs' shapes and device, then routes on the CPU or enqueues the kernel on stream. */
static moert_result stride_forward(void *ctx, moert_stream stream, const moert_router_forward_args *args)
{
    stride_ctx *c = ctx;
    const moert_tensor *x = args->x;
    const int64_t T = x ? x->shape[0] : -1, K = c->topk, E = c->num_experts;
    if (!x || x->ndim != 2 || x->shape[1] != c->hidden || !shaped(args->topk_idx, 2, T, K, MOERT_I32, c->device) ||
        !shaped(args->topk_probs, 2, T, K, -1, c->device) ||
        !shaped(args->tokens_per_expert, 1, E, 0, MOERT_I64, c->device) || !args->losses) {
        c->host->set_error(c->host,
                           "stride forward: expected x [T,%lld], topk_idx [T,%lld] int32, topk_probs [T,%lld] "
                           "fp32 or fp64 and tokens_per_expert [%lld] int64 on the layer's device",
                           (long long)c->hidden, (long long)K, (long long)K, (long long)E);
        return MOERT_ERR_INVALID_ARGUMENT;
    }
    memset(args->losses, 0, sizeof *args->losses); /* host memory on every device */
    if (c->device.type == MOERT_DEVICE_CUDA) {
        int err = stride_route_cuda(stream, T, K, E, c->stride, args->topk_idx->data, args->topk_probs->data,
                                    args->topk_probs->dtype == MOERT_F64, args->tokens_per_expert->data);
        if (err) {
            c->host->set_error(c->host, "stride forward on cuda:%d: %s", (int)c->device.id,
                               stride_cuda_error_text(err));
            return MOERT_ERR_CUDA;
        }
        return MOERT_OK;
    }
    int32_t *idx = args->topk_idx->data;
    int64_t *counts = args->tokens_per_expert->data;
    memset(counts, 0, (size_t)E * sizeof *counts);
    for (int64_t t = 0; t < T; t++)
        for (int64_t j = 0; j < K; j++) {
            const int64_t e = (t * c->stride + j) % E;
            idx[t * K + j] = (int32_t)e;
            moert_store(args->topk_probs, t * K + j, 1.0 / (double)K);
            counts[e]++;
        }
    return MOERT_OK;
}

/* The routing depends on neither x nor the weight: both gradients are zero, so nothing is added. */
static moert_result stride_backward(void *ctx, moert_stream stream, const moert_router_backward_args *args)
{
    return MOERT_OK;
}

static moert_result stride_end_step(void *ctx, moert_stream stream) { return MOERT_OK; }

static const moert_tensor *stride_expert_bias(void *ctx) { return NULL; }

/* The one exported symbol, named by an asm label (moert_router_v1 is also the type's name). */
MOERT_ROUTER_V1_EXPORT(stride_vtable) = {
    .header = {MOERT_ROUTER_V1_HEADER, .name = "stride", .version = "1.0.0",
               .description =
                   "example vendor router with a CUDA kernel: copy j of token t to expert (t*stride+j) mod E",
               .devices = MOERT_CAP_DEVICE(MOERT_DEVICE_CPU) | MOERT_CAP_DEVICE(MOERT_DEVICE_CUDA),
               .dtypes = MOERT_CAP_DTYPE(MOERT_F32) | MOERT_CAP_DTYPE(MOERT_F64) | MOERT_CAP_DTYPE(MOERT_BF16),
               .flags = MOERT_CAP_GRAPH_CAPTURABLE},
    .init = stride_init,
    .finalize = stride_finalize,
    .forward = stride_forward,
    .backward = stride_backward,
    .end_step = stride_end_step,
    .expert_bias = stride_expert_bias,
};
