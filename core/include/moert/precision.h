/* SPDX-License-Identifier: Apache-2.0 */
/* Precision recipe plugin ABI v1: the experts' grouped GEMMs (forward, dgrad, wgrad) in some number format. */
#ifndef MOERT_PRECISION_H
#define MOERT_PRECISION_H

#include "moert/plugin.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Which expert weight a GEMM uses, so a recipe can keep per-weight state (e.g. cached FP8 copies). */
typedef enum moert_gemm_weight {
    MOERT_GEMM_FC1 = 0, /* [E_local, H, 2F] */
    MOERT_GEMM_FC2 = 1  /* [E_local, F, H] */
} moert_gemm_weight;

typedef enum moert_gemm_pass {
    MOERT_GEMM_FORWARD = 0, /* output[rows of e]      = input[rows of e] @ weight[e]         */
    MOERT_GEMM_DGRAD = 1,   /* grad_input[rows of e]  = grad_output[rows of e] @ weight[e]^T */
    MOERT_GEMM_WGRAD = 2    /* grad_weight[e]        += input[rows of e]^T @ grad_output[rows of e] */
} moert_gemm_pass;

/*
 * One grouped GEMM over the local experts. Rows of the activations are grouped by expert:
 * expert e owns tokens_per_expert[e] consecutive rows, starting after the rows of experts < e.
 * Rows past the sum (padding up to capacity) are left untouched.
 */
typedef struct moert_grouped_gemm_args {
    uint32_t struct_size;
    moert_gemm_weight which;
    moert_gemm_pass pass;
    const moert_tensor *tokens_per_expert; /* [E_local] int64, on the layer device */
    const int64_t *tokens_per_expert_host; /* the same on the host, or NULL */
    const moert_tensor *input;             /* [rows, K_in]   FORWARD, WGRAD */
    const moert_tensor *weight;            /* [E_local, K_in, N_out] FORWARD, DGRAD */
    const moert_tensor *grad_output;       /* [rows, N_out]  DGRAD, WGRAD */
    moert_tensor *output;                  /* [rows, N_out]  FORWARD (overwritten) */
    moert_tensor *grad_input;              /* [rows, K_in]   DGRAD (overwritten) */
    moert_tensor *grad_weight;             /* [E_local, K_in, N_out] WGRAD (accumulated into) */
    /* Appended (read only when struct_size covers it, and passed nonzero only to a plugin whose header flags
     * carry MOERT_CAP_WGRAD_OVERWRITE): WGRAD writes grad_weight[e] = input^T @ grad_output instead of adding,
     * every local expert's slice, zeros for an expert with no rows. The executor asks for it on the first WGRAD
     * after zero_grad, so the gradients need no zero fill and the GEMM reads no zeros. */
    int32_t overwrite_grad_weight;
} moert_grouped_gemm_args;

typedef struct moert_precision_v1 {
    moert_plugin_header header; /* kind MOERT_KIND_PRECISION */
    moert_result (*init)(void **ctx, const moert_host *host, const moert_layer_info *layer);
    void (*finalize)(void *ctx);
    moert_result (*grouped_gemm)(void *ctx, moert_stream stream, const moert_grouped_gemm_args *args);
    /* Once per optimizer step, after the weights changed: drop caches derived from them. */
    moert_result (*end_step)(void *ctx, moert_stream stream);
    /* Appended (read only when header.struct_size covers it; a plugin built against the older header, or one that
     * leaves it 0, gets MOERT_PRECISION_DEFAULT_AGREEMENT_RTOL): the relative tolerance by which two runs of this recipe, or one of
     * them against a run of another recipe, may differ in the stack's outputs and parameter gradients, measured as
     * max |a - b| / max(|a|, |b|) over a tensor. `moert ab` checks agreement against the looser of A's and B's
     * (docs/abi.md has the rule of thumb). */
    double agreement_rtol;
} moert_precision_v1;

/* The size of moert_precision_v1 before agreement_rtol was appended: the smallest vtable the loader accepts. */
#define MOERT_PRECISION_V1_BASE_SIZE offsetof(moert_precision_v1, agreement_rtol)
/* The tolerance of a recipe that declares none. */
#define MOERT_PRECISION_DEFAULT_AGREEMENT_RTOL 1e-3

#define MOERT_PRECISION_V1_SYMBOL "moert_precision_v1"
/* The header fields of a precision vtable, and its one exported definition (the symbol gets its name through an asm label:
 * C cannot name an object like its type):
 *   MOERT_PRECISION_V1_EXPORT(my_vtable) = {.header = {MOERT_PRECISION_V1_HEADER, .name = "x", ...}, .init = ..., ...}; */
#define MOERT_PRECISION_V1_HEADER MOERT_PLUGIN_HEADER(moert_precision_v1, MOERT_KIND_PRECISION)
#define MOERT_PRECISION_V1_EXPORT(var)                                                                                 \
    MOERT_PLUGIN_EXPORT const moert_precision_v1 var __asm__(MOERT_PRECISION_V1_SYMBOL)

#ifdef __cplusplus
}
#endif
#endif
