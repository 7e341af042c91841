/* SPDX-License-Identifier: Apache-2.0 */
/*
 * CUDA kernels of the allgather dispatcher that the all-to-all dispatcher's kernels (plugins/lib/
 * dispatch_alltoall_cuda.h: the layout pass and the row gathers) do not already provide: counting this rank's
 * copies per expert, padding topk_idx to the gathered block, keeping only the local experts of the gathered routing,
 * the partial sums of the reduce-scatter (fp32, from fp32 or bf16 rows) and the reduction at the tokens' owner.
 *
 * Vocabulary (allgather_cpu.h): gathered token g = s*max_tokens + t is token t of rank s; gathered copy c = g*K + k;
 * copy_row[c] is the grouped row of copy c on this rank, -1 when its expert is elsewhere or it was dropped.
 * Everything is enqueued on `stream` without host syncs. Errors go to host->set_error with the call named.
 */
#ifndef MOERT_DISPATCH_ALLGATHER_CUDA_H
#define MOERT_DISPATCH_ALLGATHER_CUDA_H

#include <cuda_runtime.h>

#include "moert/plugin.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Largest expert count the count kernel takes (its histogram lives in shared memory). */
#define MOERT_AG_CUDA_MAX_EXPERTS 1024

/* counts[e] = kept copies of expert e in topk_idx [tokens, topk]; *bad_ids = entries outside [-1, E). Both device
 * outputs are zeroed first. */
moert_result moert_ag_cuda_count(const moert_host *host, cudaStream_t stream, const int32_t *topk_idx, int64_t tokens,
                                 int64_t topk, int64_t num_experts, int64_t *counts, unsigned long long *bad_ids);

/* out [max_tokens, topk] = topk_idx [tokens, topk] followed by -1 (dropped) for the padding tokens. */
moert_result moert_ag_cuda_pad_idx(const moert_host *host, cudaStream_t stream, const int32_t *topk_idx, int64_t tokens,
                                   int64_t max_tokens, int64_t topk, int32_t *out);

/* local_idx[c] = gathered_idx[c] - first_expert where that is a local expert (in [0, local_experts)), else -1. */
moert_result moert_ag_cuda_localize(const moert_host *host, cudaStream_t stream, const int32_t *gathered_idx,
                                    int64_t copies, int64_t first_expert, int64_t local_experts, int32_t *local_idx);

/* partial[g, :] = sum over k of grouped[copy_row[g*K + k], :] in fp32 and k order, from -0 (tokens without a local
 * copy get -0); grouped rows fp32 or bf16 [*, hidden], partial fp32 [tokens, hidden]. */
moert_result moert_ag_cuda_partial_rows(const moert_host *host, cudaStream_t stream, moert_dtype dtype, int64_t tokens,
                                        int64_t topk, int64_t hidden, const int32_t *copy_row, const void *grouped,
                                        float *partial);

/* partial[c] = grouped_probs[copy_row[c]] as fp32 (fp32 or bf16 probs), -0 where copy_row[c] < 0. */
moert_result moert_ag_cuda_partial_probs(const moert_host *host, cudaStream_t stream, moert_dtype dtype, int64_t copies,
                                         const int32_t *copy_row, const void *grouped_probs, float *partial);

/*
 * The owner's reduction of partials fp32 [world][tokens][width] into out [tokens, width] (fp32 or bf16), summed in
 * fp32 in rank order and rounded once. Rows (per_copy 0, width = hidden): a token of topk_idx [tokens, topk] without
 * kept copies gets 0 (accumulate 0) or keeps its value (accumulate 1); otherwise out = (out if accumulate, else -0)
 * plus the partials. Per copy (per_copy 1, width = topk): out[t, k] = the partials' sum, 0 for a dropped copy.
 */
moert_result moert_ag_cuda_sum_partials(const moert_host *host, cudaStream_t stream, moert_dtype dtype, int64_t world,
                                        int64_t tokens, int64_t width, int64_t topk, const float *partials,
                                        const int32_t *topk_idx, int per_copy, int accumulate, void *out);

#ifdef __cplusplus
}
#endif
#endif
