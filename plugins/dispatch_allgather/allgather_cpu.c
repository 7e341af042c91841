/* SPDX-License-Identifier: Apache-2.0 */
/* The allgather dispatcher's CPU reference: Megatron's allgather algorithm over plain arrays. */
#include "allgather_cpu.h"

#include <string.h>

#include "dispatch_common.h"

/* Whether token t of topk_idx [T,K] has at least one kept copy. */
static int has_kept_copy(const int32_t *topk_idx, int64_t t, int64_t topk)
{
    for (int64_t k = 0; k < topk; k++)
        if (topk_idx[t * topk + k] >= 0) return 1;
    return 0;
}

void ag_plan_sizes(ag_plan *plan, const int64_t *all_counts)
{
    plan->num_recv =
        moert_dispatch_plan_groups(all_counts, plan->world, plan->rank, plan->num_experts, plan->num_local_experts, 0,
                                   NULL, plan->tokens_per_expert, plan->group_start);
}

/* One pass over the gathered copies in order, each local one taking the next free row of its expert's group. */
void ag_plan_rows(ag_plan *plan, const int32_t *gathered_idx)
{
    const int64_t El = plan->num_local_experts, first_local = (int64_t)plan->rank * El;
    const int64_t copies = (int64_t)plan->world * plan->max_tokens * plan->topk;
    for (int64_t l = 0; l < El; l++) plan->cursor[l] = plan->group_start[l];
    for (int64_t c = 0; c < copies; c++) {
        const int64_t l = (int64_t)gathered_idx[c] - first_local;
        if (gathered_idx[c] < 0 || l < 0 || l >= El) {
            plan->copy_row[c] = -1;
            continue;
        }
        const int64_t row = plan->cursor[l]++;
        plan->copy_row[c] = row;
        plan->grouped_copy[row] = c;
    }
}

void ag_gather_rows(const ag_plan *plan, const void *gathered_rows, size_t row_bytes, void *grouped)
{
    const char *src = gathered_rows;
    char *dst = grouped;
    for (int64_t j = 0; j < plan->num_recv; j++) {
        const int64_t token = plan->grouped_copy[j] / plan->topk;
        memcpy(dst + (size_t)j * row_bytes, src + (size_t)token * row_bytes, row_bytes);
    }
}

void ag_gather_probs(const ag_plan *plan, const double *gathered_probs, void *probs_out, moert_dtype dtype)
{
    moert_tensor view = moert_dispatch_flat_view(probs_out, dtype, plan->num_recv);
    for (int64_t j = 0; j < plan->num_recv; j++) moert_store(&view, j, gathered_probs[plan->grouped_copy[j]]);
}

void ag_partial_rows(const ag_plan *plan, const void *grouped, moert_dtype dtype, int64_t hidden, double *partial)
{
    const int64_t K = plan->topk, tokens = (int64_t)plan->world * plan->max_tokens;
    moert_tensor rows = moert_dispatch_flat_view(grouped, dtype, plan->num_recv * hidden);
    for (int64_t g = 0; g < tokens; g++) {
        double *acc = partial + g * hidden;
        /* -0 is the additive identity (+0 would turn a single -0 row into +0): one copy's row stays bit-exact */
        for (int64_t h = 0; h < hidden; h++) acc[h] = -0.0;
        for (int64_t k = 0; k < K; k++) {
            const int64_t row = plan->copy_row[g * K + k];
            if (row < 0) continue;
            for (int64_t h = 0; h < hidden; h++) acc[h] += moert_load(&rows, row * hidden + h);
        }
    }
}

void ag_partial_probs(const ag_plan *plan, const void *grouped, moert_dtype dtype, double *partial)
{
    const int64_t copies = (int64_t)plan->world * plan->max_tokens * plan->topk;
    moert_tensor probs = moert_dispatch_flat_view(grouped, dtype, plan->num_recv);
    for (int64_t c = 0; c < copies; c++) {
        const int64_t row = plan->copy_row[c];
        partial[c] = row >= 0 ? moert_load(&probs, row) : -0.0;
    }
}

void ag_sum_partial_rows(const ag_plan *plan, const double *recv, int64_t hidden, const int32_t *topk_idx,
                         int accumulate, void *out, moert_dtype out_dtype)
{
    const int64_t T = plan->num_tokens;
    moert_tensor y = moert_dispatch_flat_view(out, out_dtype, T * hidden);
    for (int64_t t = 0; t < T; t++) {
        const int kept = has_kept_copy(topk_idx, t, plan->topk);
        if (accumulate && !kept) continue; /* d_x of a token without kept copies stays as it was */
        for (int64_t h = 0; h < hidden; h++) {
            double acc = accumulate ? moert_load(&y, t * hidden + h) : -0.0;
            for (int s = 0; s < plan->world; s++) acc += recv[((int64_t)s * T + t) * hidden + h];
            moert_store(&y, t * hidden + h, kept ? acc : 0.0);
        }
    }
}

void ag_sum_partial_probs(const ag_plan *plan, const double *recv, const int32_t *topk_idx, void *probs_out,
                          moert_dtype dtype)
{
    const int64_t n = plan->num_tokens * plan->topk;
    moert_tensor view = moert_dispatch_flat_view(probs_out, dtype, n);
    for (int64_t i = 0; i < n; i++) {
        double acc = -0.0;
        for (int s = 0; s < plan->world; s++) acc += recv[(int64_t)s * n + i];
        moert_store(&view, i, topk_idx[i] >= 0 ? acc : 0.0);
    }
}
