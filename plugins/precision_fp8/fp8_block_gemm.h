/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Blockwise-scaled FP8 grouped GEMM on Hopper tensor cores (wgmma, TMA), for the fp8 plugin's blockwise recipe: the
 * FP8 products of each 128-long block of the reduction are summed in fp32 by the tensor cores, then multiplied by
 * the block's two scale factors and added into fp32 accumulators in registers (as DeepSeek-V3's recipe prescribes),
 * so one kernel takes 1x128 activation factors and 128x128 weight factors that cuBLASLt's VEC128 / BLK128x128
 * kernels ran no faster than bf16.
 *
 * Every group g computes, for r < m, c < n:
 *   D[r][c] (+)= sum over k-blocks kb of  sa(r, kb) * sb(c, kb) * sum_{p in kb} A[a_row0 + r][p] * B[b_row0 + c][p]
 * with A and B FP8 matrices stored row-major, contiguous along the reduction ("TN", both K-major), and
 *   sa(r, kb) = a_scale[r + kb * a_scale_kb_stride]                          (1x128 factors, one per row and block)
 *   sb(c, kb) = b_scale[kb + (c / 128) * b_scale_stride]   (b_per_row 0: 128x128 factors; c counted from the
 *                                                           group's first column, which starts a block)
 *             = b_scale[c + kb * b_scale_stride]           (b_per_row 1: 1x128 factors, one per row of B)
 * The reduction runs over columns 0..k-1 of A and B; columns past a matrix's width read as zero (TMA fill), so k
 * need not be a multiple of 128. Rows of A or B past the group's m / n may be read (a tile is 128 x 128, or 128 x 256 in the forward form with bf16 D) but never
 * reach D. Requirements: compute capability 9.0 (sm_90a code), FP8 matrices 16-byte aligned with row strides a
 * multiple of 16 bytes.
 */
#ifndef MOERT_FP8_BLOCK_GEMM_H
#define MOERT_FP8_BLOCK_GEMM_H

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "moert/plugin.h"
#include "fp8_block_tuning.h"

#ifdef __cplusplus
extern "C" {
#endif

#define MOERT_FP8_BLOCK 128 /* the scale block along the reduction, and the weight factors' block of columns */

/* One FP8 matrix the groups read from: [rows][cols] bytes, `ld` bytes from one row to the next. */
typedef struct moert_fp8_block_matrix {
    const void *base;
    int64_t rows, cols, ld;
} moert_fp8_block_matrix;

typedef struct moert_fp8_block_group {
    int a_matrix, b_matrix; /* indices into the call's matrices */
    int64_t a_row0, b_row0; /* the group's first row of A and of B in them */
    int64_t m, n, k;        /* D is m x n; the reduction is k long */
    const float *a_scale;   /* device */
    int64_t a_scale_kb_stride;
    const float *b_scale; /* device */
    int64_t b_scale_stride;
    void *d; /* device, D[r][c] at d + r * ldd + c elements */
    int64_t ldd;
} moert_fp8_block_group;

typedef struct moert_fp8_block_gemm {
    int a_format, b_format; /* 0 E4M3, 1 E5M2 (not both E5M2) */
    int b_per_row;          /* B's factors per row (1x128) instead of per 128x128 block */
    int d_bf16;             /* D in bf16 (else fp32) */
    int accumulate;         /* D += product (else D = product) */
    const moert_fp8_block_matrix *matrices;
    int matrix_count;
    const moert_fp8_block_group *groups;
    int group_count;
    /* Leaving SMs to a dispatcher (moert_layer_info's sm_yield, the micro-batch overlap): with both set, rank 0 of each
     * cluster takes the work units one at a time from work_counter (two device int32, zero before the first launch on
     * the stream; the launch's last cluster zeroes them again) and hands them to its cluster, and while *sm_yield is
     * N > 0 the clusters covering the grid's last N SMs (never the first) take no more. A tile is computed the same
     * whichever cluster takes it: the output is the same bit for bit. NULL: each cluster takes every grid-th unit. */
    const int32_t *sm_yield;
    int32_t *work_counter;
} moert_fp8_block_gemm;

typedef struct moert_fp8_block_ctx moert_fp8_block_ctx;

/* A context on the current device: the tensor-map encoder and a ring of pinned/device slots for the tables each
 * call uploads. host: error messages; borrowed, may be NULL. MOERT_ERR_UNSUPPORTED on a device below 9.0. */
moert_result moert_fp8_block_ctx_create(const moert_host *host, moert_fp8_block_ctx **out);
void moert_fp8_block_ctx_destroy(moert_fp8_block_ctx *ctx);

/* Sets how the kernel runs (fp8_block_tuning.h; a new context runs moert_fp8_block_tuning_default(), with single
 * CTAs where no pair fits):
 *   tile_n: the output tile of the forward form (b_per_row 0) when it writes bf16 D without adding: 128 x 128 or
 *           128 x 256 (half the shared-memory and L2 traffic per FLOP for B, three stages of the ring instead of
 *           four). Other calls always run 128 x 128 tiles.
 *   cluster 2: CTA pairs share an operand tile through TMA multicast: neighbouring column blocks share A (128x128
 *           tiles, and a group's odd last row block), neighbouring row blocks share B (128x256 tiles; pair_rows 0
 *           pairs those along N too); 1: every CTA loads its own; 0: 2 where a pair fits, else 1.
 *   stages, pairs, clusters: the ring's depth cap, the forward form's main loop, the resident clusters' cap.
 * MOERT_ERR_INVALID_ARGUMENT for a value out of range, MOERT_ERR_UNSUPPORTED for cluster 2 where no pair fits; the
 * context is unchanged then. */
moert_result moert_fp8_block_ctx_tune(moert_fp8_block_ctx *ctx, const moert_fp8_block_tuning *tuning);

/* The cluster size as in tuning.cluster, and the epilogue (tests): staged_epilogue 1: D is stored or added by TMA
 * from shared memory (the default); 0: from registers, no output sets. MOERT_ERR_INVALID_ARGUMENT for another
 * cluster size, MOERT_ERR_UNSUPPORTED for 2 where no pair fits. */
moert_result moert_fp8_block_ctx_configure(moert_fp8_block_ctx *ctx, int cluster, int staged_epilogue);

/* tuning.tile_n alone (tests): 128 or 256, else MOERT_ERR_INVALID_ARGUMENT. */
moert_result moert_fp8_block_ctx_set_tile_n(moert_fp8_block_ctx *ctx, int tile_n);

/* A line naming the configuration above and the stage ring, for reports ("66 clusters of 2 CTAs (A multicast), TMA
 * epilogue, 4 stages + 2 output sets (bf16 D), 4 + 1 (fp32 D)"). */
void moert_fp8_block_ctx_describe(const moert_fp8_block_ctx *ctx, char *buf, size_t size);

/* Enqueues the grouped GEMM on stream (no host sync, except to reuse a table slot a call from 16 calls ago still
 * has in flight). Groups with m, n or k of 0 are skipped (D untouched even when not accumulating). */
moert_result moert_fp8_block_gemm_run(moert_fp8_block_ctx *ctx, cudaStream_t stream, const moert_fp8_block_gemm *gm);

#ifdef __cplusplus
}
#endif
#endif
