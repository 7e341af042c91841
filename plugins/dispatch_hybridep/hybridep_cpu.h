/* SPDX-License-Identifier: Apache-2.0 */
/* The "hybridep" dispatcher's layout over plain arrays: the layout pass, the notify through the peers' buffers (no
 * collective: each rank writes its counts into every peer's buffer) and the per-copy rows of the plan. The plan's sizes
 * and the CPU path's send/receive are shared with "deepep" (../lib/peer_dispatch_cpu.h); the CUDA path
 * (hybridep_cuda.cu) runs the same algorithm; this is its reference. */
#ifndef MOERT_HYBRIDEP_CPU_H
#define MOERT_HYBRIDEP_CPU_H

#include <stdint.h>

#include "hybridep_buffer.h"
#include "peer_dispatch_cpu.h"

/* One step's routing, as every rank sees it after the notify. */
typedef struct hybridep_plan {
    int world, rank;
    int64_t num_experts, num_local_experts, topk;
    int64_t num_tokens;         /* T of this rank */
    int64_t num_recv;           /* rows this rank receives (token copies for its local experts) */
    int64_t *counts;            /* [E] this rank's copies per expert */
    int64_t *tokens_to;         /* [world] this rank's tokens with at least one copy on rank d */
    int64_t *all_counts;        /* [world][E] copies from rank s to expert e (from the notify rows) */
    int64_t *tokens_per_expert; /* [El] rows per local expert */
    int64_t *base;              /* [E] first row, on expert e's rank, of this rank's copies to e */
    int64_t *copy_index;        /* [T*K] place of copy (t,k) among this rank's copies to its expert, -1 dropped */
    int64_t *copy_dst;          /* [T*K] row of copy (t,k) on its expert's rank (base + copy_index), -1 dropped */
    int64_t *excl;              /* [world][T+1] tokens before t with a copy on rank d */
} hybridep_plan;

/* The layout pass: counts, tokens_to, copy_index and excl of the plan from topk_idx (T = plan->num_tokens).
 * Returns the flat index of the first entry outside [-1, E), or -1 when all are valid (bad entries count as dropped). */
int64_t hybridep_layout(hybridep_plan *plan, const int32_t *topk_idx);

/* After the plan's sizes (base): each copy's row on its expert's rank into copy_dst. */
void hybridep_plan_copies(hybridep_plan *plan, const int32_t *topk_idx);

/* The notify: writes `row` (E counts + HYBRIDEP_NOTIFY_EXTRA entries: the geometry's notify_row_entries) into every
 * rank's buffer, waits for every rank's row and copies them into rows ([world][E + extra]). Returns 0, or 1 + the rank
 * that stalled. */
int hybridep_cpu_notify(const peer_cpu_link *link, const int64_t *row, int64_t *rows);

#endif
