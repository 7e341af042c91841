/* SPDX-License-Identifier: Apache-2.0 */
/* The "deepep" dispatcher's layout over plain arrays: the layout pass before the count exchange (notify) and the CPU
 * path's per-copy rows after it. The plan's sizes and the CPU path's send/receive are shared with "hybridep"
 * (../lib/peer_dispatch_cpu.h); the CUDA path (deepep_cuda.cu) runs the same algorithm with channels of tokens. */
#ifndef MOERT_DEEPEP_CPU_H
#define MOERT_DEEPEP_CPU_H

#include <stdint.h>

/* One step's routing, as every rank sees it after the count exchange. */
typedef struct deepep_plan {
    int world, rank;
    int64_t num_experts, num_local_experts, topk;
    int64_t num_tokens;         /* T of this rank */
    int64_t num_recv;           /* rows this rank receives (token copies for its local experts) */
    int64_t *all_counts;        /* [world][E] copies from rank s to expert e */
    int64_t *tokens_to;         /* [world][world] tokens of rank s with at least one copy on rank d (s*world+d) */
    int64_t *tokens_per_expert; /* [El] rows per local expert */
    int64_t *group_start;       /* [El] first row of each local expert's group */
    int64_t *base;              /* [E] first row, on expert e's rank, of this rank's copies to e */
    int64_t *copy_dst;          /* [T*K] row of copy (t,k) on its expert's rank, -1 if dropped (CPU path) */
    int64_t *excl;              /* [world][T+1] tokens before t with a copy on rank d (CPU path) */
} deepep_plan;

/* The layout pass: copies per expert into counts[E] and tokens per destination rank into tokens_to[world]
 * (a token with several experts on one rank counts once). Returns the flat index of the first entry outside
 * [-1, E), or -1 when all are valid. */
int64_t deepep_count(const int32_t *topk_idx, int64_t num_tokens, int64_t topk, int64_t num_experts, int world,
                     int64_t *counts, int64_t *tokens_to);

/* The CPU path's per-copy rows (copy_dst) and per-rank token positions (excl) from topk_idx, after the plan's sizes
 * (base). */
void deepep_plan_copies(deepep_plan *plan, const int32_t *topk_idx);

#endif
