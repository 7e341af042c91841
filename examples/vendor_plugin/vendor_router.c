/* SPDX-License-Identifier: Apache-2.0 */
/*
 * An out-of-tree router plugin, built against an installed moert with nothing but its headers:
 * "roundrobin" sends token t to experts (t*K + j + offset) mod E, j = 0..K-1, each with weight 1/K.
 * It learns nothing (its gradients are zero), which makes it a baseline for a perfectly balanced router.
 *
 * Build:  make                      (uses pkg-config --cflags moert)
 * Use:    {"router": {"plugin": "/path/to/libmoert-router-roundrobin.so", "offset": 1}}
 *    or:  MOERT_PLUGIN_PATH=/path/to {"router": {"plugin": "roundrobin"}}
 */
#include <stdlib.h>
#include <string.h>

#include <moert/router.h>

typedef struct roundrobin_ctx {
    const moert_host *host;
    int64_t num_experts, topk, hidden;
    int64_t offset;
} roundrobin_ctx;

/* Reads the options and keeps the layer's sizes. */
static moert_result roundrobin_init(void **ctx, const moert_host *host, const moert_layer_info *layer)
{
    int64_t offset = 0;
    moert_result rc =
        host->option_int(host, "offset", 0, 0, 1 << 20, "added to every expert id before the modulo", &offset);
    if (rc != MOERT_OK) return rc; /* the host has set the message */
    if (layer->device.type != MOERT_DEVICE_CPU) {
        host->set_error(host, "roundrobin: only the CPU is supported (device type %d)", (int)layer->device.type);
        return MOERT_ERR_UNSUPPORTED;
    }
    roundrobin_ctx *c = calloc(1, sizeof *c);
    if (!c) {
        host->set_error(host, "roundrobin: out of memory");
        return MOERT_ERR_OUT_OF_MEMORY;
    }
    c->host = host;
    c->num_experts = layer->num_experts;
    c->topk = layer->topk;
    c->hidden = layer->hidden;
    c->offset = offset;
    host->log(host, MOERT_LOG_DEBUG, "roundrobin: E=%lld K=%lld offset=%lld", (long long)c->num_experts,
              (long long)c->topk, (long long)offset);
    *ctx = c;
    return MOERT_OK;
}

static void roundrobin_finalize(void *ctx) { free(ctx); }

/* True if t is a host tensor of the given rank, dims and dtype (dtype < 0: any float dtype). */
static bool shaped(const moert_tensor *t, int ndim, int64_t d0, int64_t d1, int dtype)
{
    if (!t || !t->data || t->ndim != ndim || t->shape[0] != d0) return false;
    if (ndim == 2 && t->shape[1] != d1) return false;
    if (dtype >= 0 && t->dtype != (moert_dtype)dtype) return false;
    return t->device.type == MOERT_DEVICE_CPU && moert_tensor_is_contiguous(t);
}

/* Token t's K experts are consecutive (mod E), so every expert gets the same share of the batch. */
static moert_result roundrobin_forward(void *ctx, moert_stream stream, const moert_router_forward_args *args)
{
    roundrobin_ctx *c = ctx;
    const moert_tensor *x = args->x;
    int64_t T = x ? x->shape[0] : -1, K = c->topk, E = c->num_experts;
    if (!x || x->ndim != 2 || x->shape[1] != c->hidden || !shaped(args->topk_idx, 2, T, K, MOERT_I32) ||
        !shaped(args->topk_probs, 2, T, K, -1) || !shaped(args->tokens_per_expert, 1, E, 0, MOERT_I64) ||
        !args->losses) {
        c->host->set_error(c->host,
                           "roundrobin forward: expected x [T,%lld], topk_idx [T,%lld] int32, topk_probs "
                           "[T,%lld] and tokens_per_expert [%lld] int64 on the CPU",
                           (long long)c->hidden, (long long)K, (long long)K, (long long)E);
        return MOERT_ERR_INVALID_ARGUMENT;
    }
    int32_t *idx = args->topk_idx->data;
    int64_t *counts = args->tokens_per_expert->data;
    memset(counts, 0, (size_t)E * sizeof *counts);
    for (int64_t t = 0; t < T; t++) {
        for (int64_t j = 0; j < K; j++) {
            int64_t e = (t * K + j + c->offset) % E;
            idx[t * K + j] = (int32_t)e;
            moert_store(args->topk_probs, t * K + j, 1.0 / (double)K);
            counts[e]++;
        }
    }
    memset(args->losses, 0, sizeof *args->losses);
    return MOERT_OK;
}

/* The routing does not depend on x or the weight: both gradients are zero, so nothing is added. */
static moert_result roundrobin_backward(void *ctx, moert_stream stream, const moert_router_backward_args *args)
{
    return MOERT_OK;
}

static moert_result roundrobin_end_step(void *ctx, moert_stream stream) { return MOERT_OK; }

static const moert_tensor *roundrobin_expert_bias(void *ctx) { return NULL; }

/* The one exported symbol. The variable needs its own C name (moert_router_v1 is the type's name), so
 * the asm label gives the symbol its ABI name. */
MOERT_ROUTER_V1_EXPORT(roundrobin_vtable) = {
    .header = {MOERT_ROUTER_V1_HEADER, .name = "roundrobin", .version = "1.0.0",
               .description = "example vendor router: token t to experts (t*K+j+offset) mod E, weights 1/K",
               .devices = MOERT_CAP_DEVICE(MOERT_DEVICE_CPU),
               .dtypes = MOERT_CAP_DTYPE(MOERT_F32) | MOERT_CAP_DTYPE(MOERT_F64) | MOERT_CAP_DTYPE(MOERT_BF16),
               .flags = 0},
    .init = roundrobin_init,
    .finalize = roundrobin_finalize,
    .forward = roundrobin_forward,
    .backward = roundrobin_backward,
    .end_step = roundrobin_end_step,
    .expert_bias = roundrobin_expert_bias,
};
