/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The router plugin's CUDA path (built only with CUDA): the instance's device buffers, the router's linear
 * layer through cuBLASLt (fp32), and the sequence of router_cuda.cu kernels for forward, backward, the
 * balancing losses and the expert-bias update. router.c reads the options, checks the tensors' devices,
 * shapes and contiguity, and calls these when the layer lives on a CUDA device.
 *
 * Everything is queued on the stream given (the rank's stream, which the host's allocations are ordered on);
 * the one host sync is the copy of the loss values when a balancing loss or the z-loss is on.
 */
#ifndef MOERT_ROUTER_GPU_H
#define MOERT_ROUTER_GPU_H

#include <stdbool.h>
#include <stdint.h>

#include "moert/router.h"
#include "router_cpu.h"

typedef struct router_gpu router_gpu;

/* The linear layer's arithmetic (option "gemm"): fp32 GEMMs, or bf16x3: the fp32 operand (W; d_logits in backward)
 * split into three bf16 terms, bf16 tensor-core GEMMs with fp32 accumulation (x is bf16 already). */
typedef enum router_gpu_gemm { ROUTER_GEMM_AUTO = 0, ROUTER_GEMM_FP32 = 1, ROUTER_GEMM_BF16X3 = 2 } router_gpu_gemm;

/* What the CUDA path needs of the instance's options (validated by router.c). */
typedef struct router_gpu_config {
    const char *name; /* the plugin's name, for messages */
    router_params params;
    bool use_expert_bias;
    double bias_update_rate;
    double aux_loss_coeff;
    double z_loss_coeff;
    router_gpu_gemm gemm;
    router_compute_dtype compute_dtype;
    double jitter_eps; /* input jitter (0: off) with its router_noise key */
    uint64_t jitter_key;
    bool force_balance; /* force_load_balancing with the key of its random logits */
    uint64_t random_logits_key;
    /* the slot-0 instance's state whose bias, bias counts and global counts this one uses (NULL: its own) */
    struct router_gpu *twin;
} router_gpu_config;

/* Creates the CUDA state on layer->device: refuses (MOERT_ERR_UNSUPPORTED, naming the option) what runs on
 * the CPU path only, allocates the buffers for layer->max_tokens tokens and the cuBLASLt handle. */
moert_result router_gpu_create(const moert_host *host, const moert_layer_info *layer, const router_gpu_config *cfg,
                               router_gpu **out);
void router_gpu_destroy(router_gpu *g);

/* Forward of T = x->shape[0] tokens; tensors already checked for device, shape and contiguity (not dtype). The input
 * jitter of this forward is jitter_eps (0 for an inference forward, which then multiplies x by exactly 1). With
 * defer_losses the loss values and counts are copied to the host without waiting, and a->losses is left unwritten:
 * router_gpu_forward_losses reads them once the stream has passed the forward. count_for_bias: the kept copies go
 * into the expert bias's counts (training forwards; not an inference forward's). */
moert_result router_gpu_forward(router_gpu *g, moert_stream stream, const moert_router_forward_args *a,
                                int64_t seq_length, uint64_t call, double jitter_eps, bool defer_losses,
                                bool count_for_bias);
/* The losses of the last forward, which deferred them, and their figures reported (its stream has passed it). */
moert_result router_gpu_forward_losses(router_gpu *g, moert_router_losses *losses);
/* Backward of the last forward (of T tokens, noise call `call`); tensors checked as for forward. */
moert_result router_gpu_backward(router_gpu *g, moert_stream stream, const moert_router_backward_args *a, int64_t T,
                                 uint64_t call);
/* The expert-bias update (collective when expert_bias is on) and the global_aux_loss restart. */
moert_result router_gpu_end_step(router_gpu *g, moert_stream stream);
/* The device fp32 [E] bias, or NULL without expert_bias. */
const moert_tensor *router_gpu_expert_bias(router_gpu *g);

#endif
