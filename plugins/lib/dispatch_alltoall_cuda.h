/* SPDX-License-Identifier: Apache-2.0 */
/*
 * CUDA kernels of the all-to-all dispatcher: routing layout (counts and a stable permutation by expert),
 * row gathers (permute, regroup, and the adjoint of combine) and the per-token sum of copies (combine, and
 * the adjoint of permute), plus the maps that regroup received chunks from [source rank][local expert] to
 * [local expert][source rank] order.
 *
 * Vocabulary: token t has K copies; copy c = t*K + k goes to expert topk_idx[c] (-1: dropped). Sorting
 * the kept copies by expert, stable in copy order (so in token order within an expert), gives the send
 * order: row r of the send buffer holds copy copy_of_row[r]; copy c sits in row row_of_copy[c]. Experts of
 * rank q are q*E_local .. (q+1)*E_local-1, so the send order is also grouped by destination rank.
 *
 * Everything is enqueued on the given stream without host syncs, except moert_a2a_cuda_layout() when
 * asked for the counts on the host. Errors go to host->set_error (host may be NULL) with the call named.
 * Row data: fp32 or bf16 (fp32 also serves the [T*K] prob vectors, as rows of width 1); rows are
 * contiguous with `hidden` elements; 16-byte vector accesses when hidden and the pointers allow.
 */
#ifndef MOERT_DISPATCH_ALLTOALL_CUDA_H
#define MOERT_DISPATCH_ALLTOALL_CUDA_H

#include <cuda_runtime.h>

#include "moert/plugin.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Largest expert count the layout kernels take (their per-warp counters live in shared memory). */
#define MOERT_A2A_CUDA_MAX_EXPERTS 1024
/* Largest world_size * local_experts the regroup maps take. */
#define MOERT_A2A_CUDA_MAX_CHUNKS 2048

/* Device outputs of the layout pass; the caller allocates them. */
typedef struct moert_a2a_cuda_layout_buffers {
    int64_t *tokens_per_expert; /* [E] kept copies per expert */
    int64_t *expert_offsets;    /* [E+1] exclusive prefix sum of tokens_per_expert; [E] is the kept total */
    int32_t *row_of_copy;       /* [T*K] send row of each copy, -1 for a dropped one */
    int32_t *copy_of_row;       /* [T*K] copy in each send row; rows from expert_offsets[E] on are untouched */
    void *scratch;              /* moert_a2a_cuda_layout_scratch_bytes(T, E) bytes */
} moert_a2a_cuda_layout_buffers;

/* Device scratch bytes the layout of `tokens` tokens over `num_experts` experts needs. */
size_t moert_a2a_cuda_layout_scratch_bytes(int64_t tokens, int64_t num_experts);

/*
 * Counts copies per expert and computes the stable permutation (four small kernels, a device-side scan).
 * An expert id outside [-1, E) is treated as dropped and flagged; when counts_host is not NULL the counts
 * ([E] int64) are copied to it, the stream is synchronised (the one host sync here), and a flagged id is
 * reported as MOERT_ERR_INVALID_ARGUMENT.
 */
moert_result moert_a2a_cuda_layout(const moert_host *host, cudaStream_t stream, const int32_t *topk_idx, int64_t tokens,
                                   int64_t topk, int64_t num_experts, const moert_a2a_cuda_layout_buffers *out,
                                   int64_t *counts_host);

/*
 * The device counter (one unsigned long long) of expert ids outside [-1, E) that moert_a2a_cuda_layout()
 * leaves in its scratch, so a caller can copy it down with the counts (counts_host NULL) and wait its own way.
 */
const unsigned long long *moert_a2a_cuda_layout_bad_ids(const void *scratch, int64_t tokens, int64_t num_experts);

/*
 * dst[r, :] = src[index[r] / index_divisor, :] for r < rows (and r < *rows_limit when rows_limit, a device
 * int64, is given); a negative index writes zeros. Uses:
 *   permute (dispatch):         index = copy_of_row, divisor K, src = x [T,H]       -> send rows
 *   recv probs:                 index = copy_of_row, divisor 1, src = probs [T*K], hidden 1 (fp32)
 *   adjoint of combine:         index = copy_of_row, divisor K, src = d_y [T,H]     -> d_rows
 *   d_topk_probs (adjoint):     index = row_of_copy, divisor 1, src = d_row_probs, hidden 1, rows T*K
 *   regroup / its inverse:      index = a map from moert_a2a_cuda_regroup_maps, divisor 1
 */
moert_result moert_a2a_cuda_gather_rows(const moert_host *host, cudaStream_t stream, moert_dtype dtype, int64_t rows,
                                        int64_t hidden, const int32_t *index, int32_t index_divisor,
                                        const int64_t *rows_limit, const void *src, void *dst);

/*
 * out[t, :] (+)= sum over k of rows[row_of_copy[t*K + k], :], summed in fp32 in k order (deterministic);
 * dropped copies (-1) add nothing. accumulate 0 overwrites out, 1 adds to it. Uses: combine (y from the
 * expert outputs, overwrite) and the adjoint of permute (d_x += the row gradients of each token's copies).
 */
moert_result moert_a2a_cuda_combine_rows(const moert_host *host, cudaStream_t stream, moert_dtype dtype, int64_t tokens,
                                         int64_t topk, int64_t hidden, const int32_t *row_of_copy, const void *rows,
                                         void *out, int accumulate);

/*
 * out[i] = inner[outer[i]] for i < n, -1 where outer[i] is negative: two row maps made one, so that two gathers (or a
 * gather and a combine) become one pass over the rows. Uses: a dispatch on one rank, where the exchange moves nothing.
 */
moert_result moert_a2a_cuda_compose_maps(const moert_host *host, cudaStream_t stream, int64_t n, const int32_t *outer,
                                         const int32_t *inner, int32_t *out);

/*
 * Maps between the received order, chunks [source rank s][local expert e] of counts[s*E_local + e] rows
 * (counts: device int64 [world][E_local]), and the expert order, chunks [e][s]:
 *   expert_major_src[j] = received row that goes to row j of the expert-ordered buffer (regroup: gather)
 *   rank_major_dst[i]   = expert-ordered row of received row i (inverse: gather back before sending)
 * Either map may be NULL. rows_capacity bounds both maps (rows past the total are untouched, a total above
 * the capacity is cut). Optional device outputs: tokens_per_local_expert [E_local] int64, total_rows (int64).
 */
moert_result moert_a2a_cuda_regroup_maps(const moert_host *host, cudaStream_t stream, int64_t world,
                                         int64_t local_experts, const int64_t *counts, int64_t rows_capacity,
                                         int32_t *expert_major_src, int32_t *rank_major_dst,
                                         int64_t *tokens_per_local_expert, int64_t *total_rows);

#ifdef __cplusplus
}
#endif
#endif
