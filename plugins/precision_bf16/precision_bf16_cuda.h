/*
 * CUDA path of the bf16 precision recipe: the experts' grouped GEMMs through cuBLASLt.
 *
 * Layouts (all row-major, contiguous, rows grouped by expert as in moert/precision.h):
 *   input       [rows, k_in]             FORWARD, WGRAD
 *   weight      [E_local, k_in, n_out]   FORWARD, DGRAD
 *   grad_output [rows, n_out]            DGRAD, WGRAD
 *   output      [rows, n_out]            FORWARD: out[rows of e] = in[rows of e] @ W[e]         (overwritten)
 *   grad_input  [rows, k_in]             DGRAD:   d_in[rows of e] = d_out[rows of e] @ W[e]^T   (overwritten)
 *   grad_weight [E_local, k_in, n_out]   WGRAD:   dW[e] (+)= in[rows of e]^T @ d_out[rows of e]
 * Storage bf16 (fp32 accumulation, CUBLAS_COMPUTE_32F) or fp32 (plain fp32 arithmetic, no TF32); with
 * output_fp32, bf16 operands and an fp32 result (e.g. WGRAD accumulating into fp32 master gradients).
 * Expert e owns rows_per_expert[e] consecutive rows; rows past the sum are not touched.
 *
 * One handle serves one stream at a time (the workspace and the grouped-mode pointer arrays are reused in
 * stream order). Nothing here synchronises the host, except moert_bf16_cuda_run() when the device counts
 * have no host copy (it then copies them down and waits, as its comment says).
 */
#ifndef MOERT_PRECISION_BF16_CUDA_H
#define MOERT_PRECISION_BF16_CUDA_H

#include <cuda_runtime.h>

#include "moert/precision.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Bytes of cuBLASLt workspace the handle uses; a caller-provided workspace must be at least this big. */
#define MOERT_BF16_CUDA_WORKSPACE_BYTES ((size_t)32 << 20)

typedef enum moert_bf16_cuda_mode {
    MOERT_BF16_CUDA_EXPERT_LOOP = 0, /* one cuBLASLt matmul per non-empty expert, on the caller's stream */
    MOERT_BF16_CUDA_GROUPED = 1      /* one cublasGemmGroupedBatchedEx call over the non-empty experts */
} moert_bf16_cuda_mode;

typedef struct moert_bf16_cuda moert_bf16_cuda;

/*
 * Creates a handle on the current device. workspace: device memory of at least
 * MOERT_BF16_CUDA_WORKSPACE_BYTES, owned by the caller, or NULL to allocate it once here.
 * host: where error messages go (host->set_error); borrowed, must outlive the handle; may be NULL.
 */
moert_result moert_bf16_cuda_create(const moert_host *host, void *workspace, size_t workspace_bytes,
                                    moert_bf16_cuda_mode mode, moert_bf16_cuda **out);
void moert_bf16_cuda_destroy(moert_bf16_cuda *g);
moert_result moert_bf16_cuda_set_mode(moert_bf16_cuda *g, moert_bf16_cuda_mode mode);

/* One grouped GEMM described by raw device pointers (see the layouts above). */
typedef struct moert_bf16_cuda_gemm {
    moert_gemm_pass pass;
    moert_dtype dtype;               /* MOERT_BF16 or MOERT_F32, for every operand */
    int64_t num_experts;             /* E_local */
    const int64_t *rows_per_expert;  /* [E_local] on the host */
    int64_t k_in, n_out;
    const void *input;               /* FORWARD, WGRAD */
    const void *weight;              /* FORWARD, DGRAD */
    const void *grad_output;         /* DGRAD, WGRAD */
    void *output;                    /* FORWARD */
    void *grad_input;                /* DGRAD */
    void *grad_weight;               /* WGRAD */
    int accumulate;                  /* WGRAD: 1 adds into grad_weight (beta 1), 0 overwrites it */
    int output_fp32;                 /* with dtype MOERT_BF16: the result (output, grad_input or grad_weight) is
                                        fp32 (cuBLASLt's C and D in fp32, still CUBLAS_COMPUTE_32F); always the
                                        per-expert cuBLASLt loop, whatever the mode. Ignored for MOERT_F32. */
} moert_bf16_cuda_gemm;

/* Enqueues the grouped GEMM on stream. An expert with no rows is skipped (WGRAD without accumulate zeroes
 * its grad_weight slice). */
moert_result moert_bf16_cuda_grouped_gemm(moert_bf16_cuda *g, cudaStream_t stream, const moert_bf16_cuda_gemm *gemm);

/*
 * The same from the precision ABI's arguments (WGRAD accumulates, as the ABI says). Checks dtypes, shapes,
 * devices and contiguity. When args->tokens_per_expert_host is NULL the device counts are copied to the
 * host and the stream is synchronised (a host sync).
 */
moert_result moert_bf16_cuda_run(moert_bf16_cuda *g, cudaStream_t stream, const moert_grouped_gemm_args *args);

/*
 * dst[i] = src[i] rounded to bf16 (round to nearest even), i < n: fp32 -> bf16, e.g. a bf16 copy of fp32
 * weights. Enqueued on stream; errors go to host->set_error (host may be NULL).
 */
moert_result moert_bf16_cuda_round_to_bf16(const moert_host *host, cudaStream_t stream, int64_t n, const float *src,
                                           void *dst);

/* How many cuBLASLt heuristic queries ran and how many GEMMs found a cached plan, for tests and reports. */
void moert_bf16_cuda_plan_stats(const moert_bf16_cuda *g, int64_t *heuristic_queries, int64_t *cache_hits);

#ifdef __cplusplus
}
#endif
#endif
