/* SPDX-License-Identifier: Apache-2.0 */
/* Argument checks shared by the precision plugins: one grouped GEMM's tensors, shapes and row counts. Compiled
 * into each plugin (plugins do not link libmoert). */
#ifndef MOERT_PLUGIN_GROUPED_GEMM_ARGS_H
#define MOERT_PLUGIN_GROUPED_GEMM_ARGS_H

#include <stddef.h>
#include <stdint.h>

#include "moert/precision.h"

/* The shape of one grouped GEMM, once checked: expert e owns counts[e] consecutive rows. */
typedef struct moert_gemm_shape {
    int64_t num_experts; /* E_local */
    int64_t k_in;        /* columns of input / grad_input, rows of each weight */
    int64_t n_out;       /* columns of output / grad_output and of each weight */
    const int64_t *counts;
} moert_gemm_shape;

/* Brings tokens_per_expert from the layer's CUDA device to the host (a plugin's device path; one host sync). */
typedef moert_result (*moert_gemm_fetch_counts)(void *user, const moert_tensor *tokens_per_expert,
                                                const int64_t **counts);

/*
 * Checks every argument of one grouped GEMM for `layer` and fills its shape; `call` gets "grouped_gemm(fc1,
 * forward)" for messages. fetch (NULL where the plugin has no device path) reads counts that live only on the
 * layer's CUDA device. Errors go to host->set_error with the result code returned.
 */
moert_result moert_gemm_check_args(const moert_host *host, const moert_layer_info *layer,
                                   const moert_grouped_gemm_args *args, moert_gemm_fetch_counts fetch, void *user,
                                   char *call, size_t call_size, moert_gemm_shape *shape);

/* Whether a WGRAD is asked to overwrite grad_weight (the appended field, read only when struct_size covers it). */
static inline int moert_gemm_overwrites_grad(const moert_grouped_gemm_args *args)
{
    return args->pass == MOERT_GEMM_WGRAD &&
           args->struct_size >= offsetof(moert_grouped_gemm_args, overwrite_grad_weight) + sizeof(int32_t) &&
           args->overwrite_grad_weight != 0;
}

/* "[12, 64]" for messages (a device's text: moert_arg_device_text, tensor_args.h). */
const char *moert_gemm_dims_text(int ndim, const int64_t *shape, char *buf, size_t size);

#endif
