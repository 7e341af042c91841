/* SPDX-License-Identifier: Apache-2.0 */
/*
 * CUDA path of the fp8 precision recipes: quantize kernels (amax, scale, cast, transpose) and the experts'
 * grouped GEMMs through cuBLASLt FP8 matmuls (one per non-empty expert), with the same numbers as the CPU
 * reference (precision_fp8_cpu.c): the same scales (fp32, same formula), the same FP8 bytes, so a GEMM differs
 * from the CPU's only by the order of its fp32 accumulation.
 *
 * Layouts (row-major, rows grouped by expert, as in moert/precision.h):
 *   input [rows, K], grad_output [rows, N], weight [E, K, N], output [rows, N], grad_input [rows, K],
 *   grad_weight [E, K, N] (accumulated into, or overwritten when asked). K = k_in, N = n_out.
 * cuBLASLt FP8 on Hopper takes only "TN": both operands contiguous along the reduction. In cuBLAS's column-major
 * terms every expert's GEMM is D[m x n] = A^T B with A stored [m][k] and B stored [n][k] (row-major), so:
 *   FORWARD  out  = in @ W:      A = W^T as [N][K] (a transposed FP8 copy), B = in [rows][K]   m=N n=rows k=K
 *   DGRAD    din  = dout @ W^T:  A = W   as [K][N] (an FP8 copy as stored), B = dout [rows][N] m=K n=rows k=N
 *   WGRAD    dW  += in^T @ dout: A = dout^T [N][rows16], B = in^T [K][rows16]                 m=N n=K k=rows16
 * where rows16 is the expert's row count rounded up to 16 (FP8 leading dimensions are multiples of 16 bytes; for
 * the blockwise recipe to 128 if this cuBLASLt has no matmul whose reduction ends inside a 128-block); the
 * padding is zeros, which add nothing. Blockwise FORWARD/DGRAD: cuBLASLt 13 refuses a VEC128 operand whose row
 * count is not a multiple of 16, so each expert's quantized activation rows sit at a 16-row-aligned offset (prow0,
 * zero rows up to rows16, their factors 1) and the matmul runs with rows16 rows; D goes through the same padding
 * (a scratch buffer, the expert's real rows copied out after its matmul; experts whose count is a multiple of 16
 * write the caller's output directly). They may also run with the operands swapped (A = the activation
 * rows with VEC128 scales, B = the weight copy with BLK128x128 scales, D transposed through a scratch buffer) when
 * cuBLASLt has no matmul with the 128x128 blocks on A (chosen once per handle; same bytes and scales either way;
 * moert_fp8_cuda_last_operands still reports the weight as `a`). The FP8 weight copies are made once per step (first use after end_step, or
 * at end_step itself) and reused by every GEMM of the step.
 *
 * Scales. Per-tensor recipes (current, delayed): one scale per operand and expert (cuBLASLt SCALAR_32F with the
 * dequantization factor 1/scale). Blockwise: weights in 128x128 tiles (BLK128x128_32F), activations and gradients
 * in 1x128 tiles along the reduction (VEC128_32F). Scale tensors hold 1/scale (what cuBLASLt multiplies by); for an
 * operand stored [X][k] (X the non-reduced size) the factor of element (x, p) is at:
 *   VEC128:     x + (p / 128) * X                           (see moert_fp8_cuda_scale_layout for the variants)
 *   BLK128x128: (p / 128) + (x / 128) * round_up(ceil(k / 128), 4)
 *
 * One handle serves one caller stream at a time. Quantization runs on the caller's stream; the per-expert
 * matmuls are spread over the handle's streams (forked from and joined back into the caller's stream).
 * Nothing here synchronises the host.
 */
#ifndef MOERT_PRECISION_FP8_CUDA_H
#define MOERT_PRECISION_FP8_CUDA_H

#include <cuda_runtime.h>

#include "moert/precision.h"
#include "fp8_block_tuning.h"

#ifdef __cplusplus
extern "C" {
#endif

#define MOERT_FP8_CUDA_STREAM_WORKSPACE_BYTES ((size_t)32 << 20) /* cuBLASLt workspace per stream */
#define MOERT_FP8_CUDA_MAX_STREAMS            8
#define MOERT_FP8_CUDA_ROW_ALIGN                                                                                       \
    16 /* rows per expert padded to this: WGRAD (FP8 leading dimension; or 128) and the
                                       blockwise FORWARD/DGRAD activations (cuBLASLt's VEC128 operand) */

/* The recipe (the same numbers as fp8_recipe in precision_fp8_cpu.h). */
typedef enum moert_fp8_cuda_recipe {
    MOERT_FP8_CUDA_CURRENT = 0,
    MOERT_FP8_CUDA_DELAYED = 1,
    MOERT_FP8_CUDA_BLOCKWISE = 2
} moert_fp8_cuda_recipe;

typedef struct moert_fp8_cuda_config {
    moert_fp8_cuda_recipe recipe;
    int hybrid;               /* gradients (grad_output) in E5M2, the rest E4M3; 0: all E4M3 */
    int power_of_2;           /* scales truncated to a power of two */
    int64_t num_experts;      /* E_local */
    int64_t amax_history_len; /* delayed */
    int amax_most_recent;     /* delayed: newest history entry instead of the max */
    int64_t margin;           /* delayed */
} moert_fp8_cuda_config;

typedef struct moert_fp8_cuda moert_fp8_cuda;

/*
 * Creates a handle on the current device. host: error messages (set_error) and, when it has alloc/free for
 * `device`, the device memory (the core's pool, stream-ordered on the rank's stream); otherwise cudaMalloc.
 * Borrowed; must outlive the handle; may be NULL. Delayed recipe: the amax histories live on the device, every
 * scale starts at 1.
 */
moert_result moert_fp8_cuda_create(const moert_host *host, moert_device device, const moert_fp8_cuda_config *cfg,
                                   moert_fp8_cuda **out);
void moert_fp8_cuda_destroy(moert_fp8_cuda *g);
/* A second slot's handle (moert_layer_info.twin): the delayed recipe's scales, step amaxes and histories are then
 * owner's, so both slots record into and scale from the same ones; end_step updates them on owner only. */
void moert_fp8_cuda_share_delayed(moert_fp8_cuda *g, moert_fp8_cuda *owner);
/* A second slot's handle: FORWARD and DGRAD read owner's FP8 weight copies while they are of the weight given and
 * have the layout the pass needs (made or remade on owner's stream, which the core orders before this slot's
 * calls), so the slots of a layer hold one set; else this handle makes its own. */
void moert_fp8_cuda_share_weights(moert_fp8_cuda *g, moert_fp8_cuda *owner);

/*
 * Asks cuBLASLt (its heuristic, no GPU work) for every matmul the recipe needs on a layer of these sizes (fc1 and
 * fc2; forward, dgrad, and with fp8_wgrad the wgrad into grad_weight_dtype: 0 when the plugin's "fp8_wgrad" is false
 * and the weight gradients come from the bf16 GEMMs). MOERT_ERR_UNSUPPORTED with a message naming the first one
 * missing (types, scale modes, sizes), so a layer is refused at init rather than in its first step.
 */
moert_result moert_fp8_cuda_check_support(moert_fp8_cuda *g, int64_t hidden, int64_t ffn_hidden, moert_dtype act_dtype,
                                          moert_dtype grad_weight_dtype, int fp8_wgrad);

/*
 * The blockwise recipe's GEMMs on moert's own wgmma kernel (fp8_block_gemm.h: FP8 MMA, the 1x128 and 128x128
 * factors applied in registers per 128-long k-block; one launch per grouped GEMM, no padding copies): every pass
 * when on is 1; when 2 (the plugin's "auto") every pass but the WGRADs that overwrite grad_weight (a step's first
 * micro-batch), which run on cuBLASLt; none when 0 (cuBLASLt's VEC128 / BLK128x128 matmuls, the default of a new
 * handle). MOERT_ERR_UNSUPPORTED for another
 * recipe, a GPU other than compute capability 9.0, or non-default scale layouts. The quantized operands are the same
 * either way; WGRAD's rows are padded to 16 (the kernel takes a reduction that ends inside a block).
 */
moert_result moert_fp8_cuda_set_block_kernel(moert_fp8_cuda *g, int on);

/* How the wgmma kernel runs (fp8_block_tuning.h; the plugin's "block_*" options): kept for the kernel's context when
 * set_block_kernel makes it, applied at once when it exists. An error from moert_fp8_block_ctx_tune leaves it as it
 * was. */
moert_result moert_fp8_cuda_set_block_tuning(moert_fp8_cuda *g, const moert_fp8_block_tuning *tuning);

/* A line saying how the wgmma kernel runs (moert_fp8_block_ctx_describe), or "cuBLASLt" when it serves no pass. */
void moert_fp8_cuda_describe_block_kernel(const moert_fp8_cuda *g, char *buf, size_t size);

/* Streams the per-expert matmuls are spread over (1: the caller's only; at most MOERT_FP8_CUDA_MAX_STREAMS). */
moert_result moert_fp8_cuda_set_streams(moert_fp8_cuda *g, int streams);

/* One grouped GEMM by raw device pointers (see the layouts above). */
typedef struct moert_fp8_cuda_gemm {
    moert_gemm_weight which; /* FC1 or FC2: whose FP8 weight copy and delayed slots */
    moert_gemm_pass pass;
    moert_dtype act_dtype;          /* bf16 or fp32: input, grad_output, output, grad_input */
    moert_dtype weight_dtype;       /* fp32 or bf16 */
    moert_dtype grad_weight_dtype;  /* fp32 or bf16 (WGRAD) */
    int64_t num_experts;            /* the handle's */
    const int64_t *rows_per_expert; /* [num_experts] on the host */
    int64_t capacity;               /* rows of the activation tensors (an upper bound of the counts' sum), so the
                                        padded scratch buffers are sized once for the worst case; 0: unknown
                                        (sized from the counts, grown with slack when they grow) */
    int64_t k_in, n_out;
    const void *input, *weight, *grad_output;
    void *output, *grad_input, *grad_weight;
    int overwrite_grad_weight; /* WGRAD: 1 writes grad_weight (beta 0; experts with no rows zeroed), 0 adds */
    const int32_t *sm_yield;   /* the blockwise wgmma kernel: leave SMs to a dispatcher (moert_fp8_block_gemm), */
    int32_t *work_counter;     /* through this counter pair of the stream; NULL: keep every SM */
} moert_fp8_cuda_gemm;

/* Enqueues the grouped GEMM on stream (WGRAD accumulates unless overwrite_grad_weight). Experts with no rows are
 * skipped (or, overwriting, their gradient zeroed). */
moert_result moert_fp8_cuda_grouped_gemm(moert_fp8_cuda *g, cudaStream_t stream, const moert_fp8_cuda_gemm *gm);

/*
 * After the optimizer step: the delayed recipe appends each slot's step amax to its history and sets the next
 * scales (on the device, as fp8_delayed_end_step does on the CPU); then the FP8 weight copies are made again from
 * the (updated) weights they were made from, on stream.
 */
moert_result moert_fp8_cuda_end_step(moert_fp8_cuda *g, cudaStream_t stream);

/* Forgets the FP8 weight copies (the next GEMM makes them from its weight). */
void moert_fp8_cuda_drop_weights(moert_fp8_cuda *g);

/*
 * Where cuBLASLt reads block scales (the blockwise recipe). The default is VEC128_X_MAJOR and BLK_K_MAJOR_PAD4
 * (as PyTorch's _scaled_mm lays them out for cuBLASLt); the others exist so a GPU test can tell which layout a
 * cuBLASLt version reads when results disagree. Changing it drops the FP8 weight copies.
 */
typedef enum moert_fp8_cuda_vec_layout {
    MOERT_FP8_VEC128_X_MAJOR = 0, /* x + kb * X */
    MOERT_FP8_VEC128_K_MAJOR = 1  /* kb + x * KB */
} moert_fp8_cuda_vec_layout;
typedef enum moert_fp8_cuda_blk_layout {
    MOERT_FP8_BLK_K_MAJOR_PAD4 = 0, /* kb + xb * round_up(KB, 4) */
    MOERT_FP8_BLK_X_MAJOR_PAD4 = 1, /* xb + kb * round_up(XB, 4) */
    MOERT_FP8_BLK_K_MAJOR = 2,      /* kb + xb * KB */
    MOERT_FP8_BLK_X_MAJOR = 3       /* xb + kb * XB */
} moert_fp8_cuda_blk_layout;
void moert_fp8_cuda_set_scale_layout(moert_fp8_cuda *g, moert_fp8_cuda_vec_layout vec, moert_fp8_cuda_blk_layout blk);

/*
 * The quantized operands of the last grouped GEMM (device pointers into the handle's buffers, valid until the
 * next call), for tests: A and B bytes and their scale factors (1/scale: one float per expert at [4 * e] for the
 * per-tensor recipes; the block layouts above for blockwise), and per expert where each starts:
 *   a_offset[e], b_offset[e]: byte offset of expert e's operand; a_scale_offset[e], b_scale_offset[e]: float
 *   offset of its scale factors; rows16[e]: the padded row count (WGRAD: a 16 or 128 multiple; FORWARD/DGRAD: a 16
 *   multiple, used by the blockwise recipe, whose activation operand is [rows16][k] with VEC128 factors at
 *   x + kb * rows16). Arrays have num_experts entries (host).
 * Also the per-tensor quantization scales (not inverted) at [4 * e] of a_scale / b_scale (NULL for blockwise).
 */
typedef struct moert_fp8_cuda_operands {
    const uint8_t *a, *b;
    const float *a_scale_inv, *b_scale_inv;
    const float *a_scale, *b_scale;
    const int64_t *a_offset, *b_offset, *a_scale_offset, *b_scale_offset, *rows16;
    int a_format, b_format; /* 0 E4M3, 1 E5M2 */
} moert_fp8_cuda_operands;
void moert_fp8_cuda_last_operands(const moert_fp8_cuda *g, moert_fp8_cuda_operands *out);

/* The delayed recipe's scale of slot (which, operand 0 input / 1 weight / 2 grad_output, expert), copied to the
 * host with a stream sync (tests). */
moert_result moert_fp8_cuda_delayed_scale(moert_fp8_cuda *g, cudaStream_t stream, moert_gemm_weight which, int operand,
                                          int64_t expert, float *out);

/* Benchmarks: 1 makes grouped GEMMs quantize their operands (and weights) but issue no matmul, so the quantization
 * can be timed alone; 0 (the default) runs everything. */
void moert_fp8_cuda_set_quantize_only(moert_fp8_cuda *g, int enabled);

/* Counters since creation, for tests and reports. */
typedef struct moert_fp8_cuda_stats {
    int64_t heuristic_queries;    /* cublasLtMatmulAlgoGetHeuristic calls */
    int64_t cache_hits;           /* expert matmuls that found their plan cached */
    int64_t exact_fallbacks;      /* bucket plans cuBLASLt refused for the actual shape */
    int64_t weight_quantizations; /* FP8 weight copies made (each of the two layouts counts once) */
    int64_t matmuls;              /* expert matmuls enqueued */
} moert_fp8_cuda_stats;
void moert_fp8_cuda_get_stats(const moert_fp8_cuda *g, moert_fp8_cuda_stats *out);

#ifdef __cplusplus
}
#endif
#endif
