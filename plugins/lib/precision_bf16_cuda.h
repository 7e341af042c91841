/* SPDX-License-Identifier: Apache-2.0 */
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
 * One handle serves one caller stream at a time (the workspace, the internal streams and the grouped-mode pointer
 * arrays are reused in that stream's order). With more than one stream (moert_bf16_cuda_set_streams) the per-expert
 * loop forks the caller's stream into internal streams with events and joins them back before returning, so to the
 * caller every call is still one piece of work on its stream. Nothing here synchronises the host, except
 * moert_bf16_cuda_run() when the device counts have no host copy (it then copies them down and waits).
 */
#ifndef MOERT_PRECISION_BF16_CUDA_H
#define MOERT_PRECISION_BF16_CUDA_H

#include <cuda_runtime.h>

#include "moert/precision.h"

#ifdef __cplusplus
extern "C" {
#endif

/* cuBLASLt workspace per stream: every plan is chosen for (and every matmul given) this much. 32 MiB is what
 * cuBLAS recommends on Hopper. */
#define MOERT_BF16_CUDA_STREAM_WORKSPACE_BYTES ((size_t)32 << 20)
/* The smallest workspace a caller may hand to moert_bf16_cuda_create (one stream); S streams need S times this. */
#define MOERT_BF16_CUDA_WORKSPACE_BYTES MOERT_BF16_CUDA_STREAM_WORKSPACE_BYTES
/* Most streams the per-expert loop may use (the caller's own and MAX - 1 internal ones). */
#define MOERT_BF16_CUDA_MAX_STREAMS 8

typedef enum moert_bf16_cuda_mode {
    MOERT_BF16_CUDA_EXPERT_LOOP = 0, /* one cuBLASLt matmul per non-empty expert (spread over the handle's streams) */
    MOERT_BF16_CUDA_GROUPED = 1      /* one cublasGemmGroupedBatchedEx call over the non-empty experts */
} moert_bf16_cuda_mode;

typedef struct moert_bf16_cuda moert_bf16_cuda;

/*
 * Creates a handle on the current device, with one stream (the caller's). workspace: device memory of at least
 * MOERT_BF16_CUDA_WORKSPACE_BYTES, owned by the caller, or NULL to allocate it here (and grow it when more streams
 * are asked for). host: where error messages go (host->set_error); borrowed, must outlive the handle; may be NULL.
 */
moert_result moert_bf16_cuda_create(const moert_host *host, void *workspace, size_t workspace_bytes,
                                    moert_bf16_cuda_mode mode, moert_bf16_cuda **out);
void moert_bf16_cuda_destroy(moert_bf16_cuda *g);
moert_result moert_bf16_cuda_set_mode(moert_bf16_cuda *g, moert_bf16_cuda_mode mode);

/*
 * How many streams the per-expert loop spreads the experts over: 1 (the caller's stream only) to
 * MOERT_BF16_CUDA_MAX_STREAMS. Internal streams and events are created on the current device on first need and kept;
 * each stream gets its own MOERT_BF16_CUDA_STREAM_WORKSPACE_BYTES slice of the workspace, so a caller's workspace
 * must hold streams slices (else MOERT_ERR_INVALID_ARGUMENT); an owned one is grown. Results do not depend on it:
 * every expert runs the same algorithm whichever stream it lands on.
 */
moert_result moert_bf16_cuda_set_streams(moert_bf16_cuda *g, int streams);

/*
 * The SMs each cuBLASLt GEMM is planned for (CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET): 0, the default, all of the GPU's;
 * fewer leave SMs free for kernels on another stream. Call before the first GEMM (plans are kept per shape).
 */
moert_result moert_bf16_cuda_set_sm_count(moert_bf16_cuda *g, int sms);

/*
 * CUDA graph replay of whole grouped GEMMs (0 off, the default; 1 on). When on, each call is captured into a graph
 * keyed by (pass, dtypes, sizes, mode, streams, the count vector); a later call with the same key and the same
 * pointers replays it with one cudaGraphLaunch, with the same key and other pointers it is captured again and the
 * kept executable updated with cudaGraphExecUpdate. Pays off only when the same counts repeat (benchmarks, a
 * repeated batch); with counts that change every step it costs a capture and an instantiation per call. Calls on a
 * stream that is itself being captured are enqueued directly. Creates a capture stream on the current device.
 */
moert_result moert_bf16_cuda_set_graphs(moert_bf16_cuda *g, int enabled);

/* One grouped GEMM described by raw device pointers (see the layouts above). */
typedef struct moert_bf16_cuda_gemm {
    moert_gemm_pass pass;
    moert_dtype dtype;              /* MOERT_BF16 or MOERT_F32, for every operand */
    int64_t num_experts;            /* E_local */
    const int64_t *rows_per_expert; /* [E_local] on the host */
    int64_t k_in, n_out;
    const void *input;       /* FORWARD, WGRAD */
    const void *weight;      /* FORWARD, DGRAD */
    const void *grad_output; /* DGRAD, WGRAD */
    void *output;            /* FORWARD */
    void *grad_input;        /* DGRAD */
    void *grad_weight;       /* WGRAD */
    int accumulate;          /* WGRAD: 1 adds into grad_weight (beta 1), 0 overwrites it */
    int output_fp32;         /* with dtype MOERT_BF16: the result (output, grad_input or grad_weight) is
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

/* The row bucket a plan is chosen for: rows up to 128 round up to a multiple of 32, up to 1024 to a multiple of
 * 128, above that to the next 2^j or 1.5 * 2^j. Exposed for tests and the docs. */
int64_t moert_bf16_cuda_row_bucket(int64_t rows);

/* Counters since the handle was created, for tests and reports. */
typedef struct moert_bf16_cuda_stats {
    int64_t heuristic_queries;    /* cublasLtMatmulAlgoGetHeuristic calls (bucket plans and exact fallbacks) */
    int64_t cache_hits;           /* expert matmuls that found their plan cached */
    int64_t exact_fallbacks;      /* expert matmuls whose bucket plan cuBLASLt refused for the actual shape */
    int64_t graph_replays;        /* calls replayed from a kept graph as it was */
    int64_t graph_updates;        /* calls recaptured and applied with cudaGraphExecUpdate (new pointers) */
    int64_t graph_instantiations; /* calls that instantiated a new executable graph */
} moert_bf16_cuda_stats;
void moert_bf16_cuda_get_stats(const moert_bf16_cuda *g, moert_bf16_cuda_stats *out);

/* How many cuBLASLt heuristic queries ran and how many GEMMs found a cached plan (two of the stats above). */
void moert_bf16_cuda_plan_stats(const moert_bf16_cuda *g, int64_t *heuristic_queries, int64_t *cache_hits);

#ifdef __cplusplus
}
#endif
#endif
