/* SPDX-License-Identifier: Apache-2.0 */
/* The trainer's loss and optimizer (harness/optim.c): the squared error against the task's targets, Adam and SGD on
 * one parameter tensor. The CPU code is the reference; on GPUs the kernels of harness/cuda_ops.cu. Errors are set
 * with moert_set_last_error. */
#ifndef MOERT_HARNESS_OPTIM_H
#define MOERT_HARNESS_OPTIM_H

#include "moert/moert.h"

/* Sum of (pred - target)^2 (in double on the CPU, fp32 on CUDA), and grad = scale * 2 * (pred - target) (grad may be
 * NULL). workspace: TRAINER_LOSS_WORKSPACE_BYTES on the tensors' device (unused on the CPU); pinned_result: a pinned
 * float the CUDA sum comes back through. Waits for the sum. */
#define TRAINER_LOSS_WORKSPACE_BYTES 8192
moert_result trainer_squared_error(moert_stream s, const moert_tensor *pred, const moert_tensor *target, double scale,
                                   void *workspace, float *pinned_result, double *sum, moert_tensor *grad);

/* Adam (beta 0.9 / 0.999, eps 1e-8, decoupled weight decay) on one parameter tensor; step counts from 1; m and v
 * zeroed before the first step. */
typedef struct trainer_adam {
    double lr, beta1, beta2, eps, weight_decay;
    int64_t step;
} trainer_adam;
moert_result trainer_adam_update(moert_stream s, const trainer_adam *opt, moert_tensor *param, const moert_tensor *grad,
                                 moert_tensor *m, moert_tensor *v);

/* Plain SGD with weight decay: param -= lr * (grad + weight_decay * param), in double on the CPU (so with weight_decay
 * 0 the result is exactly param - lr * grad, rounded to the storage dtype once) and as one fused axpby in fp32 (fp64
 * for fp64 tensors) on CUDA. */
typedef struct trainer_sgd {
    double lr, weight_decay;
} trainer_sgd;
moert_result trainer_sgd_update(moert_stream s, const trainer_sgd *opt, moert_tensor *param, const moert_tensor *grad);

#endif
