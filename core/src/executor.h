/* Executor: one MoE layer on one rank, forward and backward, calling each plugin for its stage. */
#ifndef MOERT_CORE_EXECUTOR_H
#define MOERT_CORE_EXECUTOR_H

#include "loader.h"
#include "moert/moert.h"

/* The stages timed in every step; their names are in moert_stage_name(). */
typedef enum moert_stage {
    MOERT_STAGE_ROUTER = 0,
    MOERT_STAGE_PERMUTE, /* dispatcher.prepare: layout and count exchange */
    MOERT_STAGE_DISPATCH,
    MOERT_STAGE_FC1,
    MOERT_STAGE_ACT,
    MOERT_STAGE_FC2,
    MOERT_STAGE_COMBINE,
    MOERT_STAGE_BACKWARD,
    MOERT_STAGE_COUNT
} moert_stage;

const char *moert_stage_name(moert_stage s);

/* One plugin instance of a layer: vtable, context and its host table. */
typedef struct moert_instance {
    const moert_plugin *plugin;
    void *ctx;
    moert_host *host;
} moert_instance;

/* A parameter with its gradient and Adam moments, on the layer's device. */
typedef struct moert_param {
    moert_tensor value, grad, m, v;
} moert_param;

typedef enum moert_param_id { MOERT_PARAM_ROUTER = 0, MOERT_PARAM_FC1 = 1, MOERT_PARAM_FC2 = 2, MOERT_PARAM_COUNT } moert_param_id;

typedef struct moert_layer {
    moert_layer_info info;
    const moert_host *core_host;      /* the rank's own services: allocation, streams */
    moert_stream stream;
    moert_instance router, dispatcher, precision, memory;
    moert_param params[MOERT_PARAM_COUNT]; /* router [E,H], fc1 [El,H,2F], fc2 [El,F,H] */
    moert_dtype param_dtype;          /* fp32, or fp64 in fp64 mode */
    int64_t seq_length;               /* tokens per sequence (batch-major), 0 = one sequence */

    /* saved by forward for backward */
    moert_tensor x;                   /* borrowed: the layer input */
    moert_tensor topk_idx, topk_probs, tokens_per_expert;
    moert_dispatch_layout layout;
    moert_tensor recv_probs;
    moert_tensor saved[MOERT_ACT_COUNT];         /* recv_x, fc1_out, swiglu_out (data NULL when dropped) */
    void *offloaded[MOERT_ACT_COUNT];             /* pinned copies of offloaded activations */
    moert_memory_action action[MOERT_ACT_COUNT];
    moert_router_losses losses;

    /* figures of the last step: stage boundaries are marked with the wall clock on the CPU and with CUDA
     * events on GPUs (read by moert_layer_collect_times once the step's work is done) */
    double mark_seconds[MOERT_STAGE_COUNT + 2];
    moert_event mark_events[MOERT_STAGE_COUNT + 2];
    double stage_seconds[MOERT_STAGE_COUNT];
    int64_t saved_bytes[MOERT_ACT_COUNT];        /* size of each saved activation in the last forward */
    int64_t kept_bytes_peak;                     /* activation bytes held from forward to backward */
} moert_layer;

/* Allocates the parameters (values from the seed, the same for any rank split) and their state. */
moert_result moert_layer_init_params(moert_layer *L, uint64_t seed);
void moert_layer_free(moert_layer *L);

/* y = x + MoE(x); x must stay valid until backward. */
moert_result moert_layer_forward(moert_layer *L, const moert_tensor *x, moert_tensor *y);
/* From d_y computes d_x (overwritten) and adds parameter gradients; router losses enter with loss_scale. */
moert_result moert_layer_backward(moert_layer *L, const moert_tensor *d_y, moert_tensor *d_x, double loss_scale);
/* Fills stage_seconds from the last forward and backward (waits for their work on GPUs). */
moert_result moert_layer_collect_times(moert_layer *L);
/* Zeroes the parameter gradients. */
moert_result moert_layer_zero_grad(moert_layer *L);

#endif
