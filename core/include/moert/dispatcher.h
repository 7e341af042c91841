/* SPDX-License-Identifier: Apache-2.0 */
/* Token dispatcher plugin ABI v1: moves token copies to the ranks owning their experts and back. */
#ifndef MOERT_DISPATCHER_H
#define MOERT_DISPATCHER_H

#include "moert/plugin.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What prepare() learned about one step's routing; valid until the next prepare(). */
typedef struct moert_dispatch_layout {
    uint32_t struct_size;
    int64_t num_recv;                      /* rows this rank receives: token copies for its local experts; -1 when the
                                     dispatcher does not sync (tokens_per_expert_host NULL: the count is on the device) */
    int64_t capacity;                      /* rows the receive buffers must hold (>= num_recv; worst case when the
                                     dispatcher avoids host syncs) */
    moert_tensor tokens_per_expert;        /* [E_local] int64 rows per local expert, on the layer device */
    const int64_t *tokens_per_expert_host; /* the same on the host, or NULL if the dispatcher does not sync */
} moert_dispatch_layout;

typedef struct moert_dispatch_args {
    uint32_t struct_size;
    const moert_tensor *x;          /* [T,H] this rank's tokens */
    const moert_tensor *topk_probs; /* [T,K] routing weights (from the router) */
    moert_tensor *recv_x;           /* out [capacity,H] rows grouped by local expert, in expert order */
    moert_tensor *recv_probs;       /* out [capacity] fp32/fp64: the routing weight of each received row */
} moert_dispatch_args;

/* combine: y[t] = sum over the K copies of token t of y_expert[row of that copy]; y is overwritten. */
typedef struct moert_combine_args {
    uint32_t struct_size;
    const moert_tensor *y_expert; /* [capacity,H] expert outputs, rows as dispatched */
    moert_tensor *y;              /* out [T,H] */
} moert_combine_args;

/* Adjoint of combine: each received row gets the gradient of its token. */
typedef struct moert_combine_backward_args {
    uint32_t struct_size;
    const moert_tensor *d_y;  /* [T,H] */
    moert_tensor *d_y_expert; /* out [capacity,H] */
} moert_combine_backward_args;

/* Adjoint of dispatch: row gradients summed back into their tokens, prob gradients to their slots. */
typedef struct moert_dispatch_backward_args {
    uint32_t struct_size;
    const moert_tensor *d_recv_x;     /* [capacity,H] */
    const moert_tensor *d_recv_probs; /* [capacity] */
    moert_tensor *d_x;                /* [T,H] accumulated into (+=) */
    moert_tensor *d_topk_probs;       /* [T,K] overwritten; 0 for dropped copies */
} moert_dispatch_backward_args;

typedef struct moert_dispatcher_v1 {
    moert_plugin_header header; /* kind MOERT_KIND_DISPATCHER */
    moert_result (*init)(void **ctx, const moert_host *host, const moert_layer_info *layer);
    void (*finalize)(void *ctx);
    /* Layout and count exchange for this step's routing (topk_idx [T,K] int32, -1 = dropped copy). */
    moert_result (*prepare)(void *ctx, moert_stream stream, const moert_tensor *topk_idx,
                            moert_dispatch_layout *layout);
    moert_result (*dispatch)(void *ctx, moert_stream stream, const moert_dispatch_args *args);
    moert_result (*combine)(void *ctx, moert_stream stream, const moert_combine_args *args);
    moert_result (*combine_backward)(void *ctx, moert_stream stream, const moert_combine_backward_args *args);
    moert_result (*dispatch_backward)(void *ctx, moert_stream stream, const moert_dispatch_backward_args *args);
} moert_dispatcher_v1;

#define MOERT_DISPATCHER_V1_SYMBOL "moert_dispatcher_v1"
/* The header fields of a dispatcher vtable, and its one exported definition (the symbol gets its name through an asm label:
 * C cannot name an object like its type):
 *   MOERT_DISPATCHER_V1_EXPORT(my_vtable) = {.header = {MOERT_DISPATCHER_V1_HEADER, .name = "x", ...}, .init = ..., ...}; */
#define MOERT_DISPATCHER_V1_HEADER MOERT_PLUGIN_HEADER(moert_dispatcher_v1, MOERT_KIND_DISPATCHER)
#define MOERT_DISPATCHER_V1_EXPORT(var)                                                                                \
    MOERT_PLUGIN_EXPORT const moert_dispatcher_v1 var __asm__(MOERT_DISPATCHER_V1_SYMBOL)

#ifdef __cplusplus
}
#endif
#endif
