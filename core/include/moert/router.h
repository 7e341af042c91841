/* SPDX-License-Identifier: Apache-2.0 */
/* Router plugin ABI v1 (1.2 appended forward_losses): scores, top-k selection, balancing losses, and their backward. */
#ifndef MOERT_ROUTER_H
#define MOERT_ROUTER_H

#include "moert/plugin.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Balancing losses of one forward, on the host, already multiplied by their coefficients. */
typedef struct moert_router_losses {
    double total;    /* what enters the training loss: the sum of the enabled terms below */
    double aux_loss; /* aux_loss, seq_aux_loss or global_aux_loss, whichever is enabled */
    double z_loss;
} moert_router_losses;

typedef struct moert_router_forward_args {
    uint32_t struct_size;
    const moert_tensor *x;           /* [T,H] activations */
    const moert_tensor *weight;      /* [E,H] router weight, fp32 or fp64 */
    moert_tensor *topk_idx;          /* out [T,K] int32 expert ids; -1 where a copy was dropped (capacity) */
    moert_tensor *topk_probs;        /* out [T,K] routing weights (0 where dropped), dtype of weight */
    moert_tensor *tokens_per_expert; /* out [E] int64: copies kept per expert from this rank's tokens */
    moert_router_losses *losses;     /* out, host */
    int64_t seq_length;              /* tokens per sequence, for seq_aux_loss (0: one sequence) */
    /* appended: MOERT_ROUTER_FORWARD_* bits (a caller built before it passes a shorter struct: 0, training) */
    uint32_t flags;
} moert_router_forward_args;

/* An inference forward: no backward follows and training-only noise (input jitter) is off. */
#define MOERT_ROUTER_FORWARD_INFERENCE (1u << 0)
/* ABI 1.2, given only to a router whose vtable has forward_losses: the forward may leave *losses unwritten and not
 * wait on the host for them (their values are on the device until the stream gets there); the caller calls
 * forward_losses once its stream has passed the forward's work. So the host issues the next work (the dispatcher's
 * prepare) while the routing still runs, instead of waiting in every forward. */
#define MOERT_ROUTER_FORWARD_DEFER_LOSSES (1u << 1)

typedef struct moert_router_backward_args {
    uint32_t struct_size;
    const moert_tensor *x;            /* [T,H] as given to forward */
    const moert_tensor *weight;       /* [E,H] as given to forward */
    const moert_tensor *d_topk_probs; /* [T,K] gradient of the loss with respect to topk_probs */
    double loss_scale;                /* gradient of the training loss with respect to losses.total (1) */
    moert_tensor *d_x;                /* [T,H] accumulated into (+=) */
    moert_tensor *d_weight;           /* [E,H] accumulated into (+=) */
} moert_router_backward_args;

typedef struct moert_router_v1 {
    moert_plugin_header header; /* kind MOERT_KIND_ROUTER */
    /* Creates one instance for one layer on one rank; reads its options through host. */
    moert_result (*init)(void **ctx, const moert_host *host, const moert_layer_info *layer);
    void (*finalize)(void *ctx);
    /* Routes T tokens; keeps what backward needs in ctx (one forward in flight per instance). */
    moert_result (*forward)(void *ctx, moert_stream stream, const moert_router_forward_args *args);
    /* Gradients of the last forward: through the probs and the balancing losses. */
    moert_result (*backward)(void *ctx, moert_stream stream, const moert_router_backward_args *args);
    /* Once per optimizer step, after backward: e.g. the aux-loss-free expert-bias update. */
    moert_result (*end_step)(void *ctx, moert_stream stream);
    /* The expert bias ([E], fp32 or fp64) or NULL where the router keeps none; for reports and tests. */
    const moert_tensor *(*expert_bias)(void *ctx);
    /* appended (ABI 1.2; read only where header.struct_size covers it, NULL allowed): the losses of the last forward,
     * which got MOERT_ROUTER_FORWARD_DEFER_LOSSES, into *losses, and their figures reported; called once the stream
     * has passed that forward's work (the caller waits for it first), before the next forward. */
    moert_result (*forward_losses)(void *ctx, moert_router_losses *losses);
} moert_router_v1;

/* The smallest router vtable the core accepts: the v1 vtable before forward_losses was appended. */
#define MOERT_ROUTER_V1_BASE_SIZE offsetof(moert_router_v1, forward_losses)

/* The symbol a router plugin exports. */
#define MOERT_ROUTER_V1_SYMBOL "moert_router_v1"
/* The header fields of a router vtable, and its one exported definition (the symbol gets its name through an asm label:
 * C cannot name an object like its type):
 *   MOERT_ROUTER_V1_EXPORT(my_vtable) = {.header = {MOERT_ROUTER_V1_HEADER, .name = "x", ...}, .init = ..., ...}; */
#define MOERT_ROUTER_V1_HEADER      MOERT_PLUGIN_HEADER(moert_router_v1, MOERT_KIND_ROUTER)
#define MOERT_ROUTER_V1_EXPORT(var) MOERT_PLUGIN_EXPORT const moert_router_v1 var __asm__(MOERT_ROUTER_V1_SYMBOL)

#ifdef __cplusplus
}
#endif
#endif
