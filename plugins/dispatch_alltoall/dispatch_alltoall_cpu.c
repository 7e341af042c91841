/* SPDX-License-Identifier: Apache-2.0 */
/* The all-to-all dispatcher's CPU reference: Megatron's alltoall algorithm over plain arrays. */
#include "dispatch_alltoall_cpu.h"

#include <string.h>

#include "dispatch_common.h"

/* Finds an expert whose rows from all ranks exceed the padded group size. */
int64_t a2a_find_overflow(const int64_t *all_counts, int world, int64_t num_experts, int64_t group_rows,
                          int64_t *rows_out)
{
    for (int64_t e = 0; e < num_experts; e++) {
        int64_t rows = 0;
        for (int s = 0; s < world; s++) rows += all_counts[(int64_t)s * num_experts + e];
        if (rows > group_rows) {
            *rows_out = rows;
            return e;
        }
    }
    return -1;
}

/* Per-rank send/receive sizes, per-expert group sizes and starts, capacity. */
void a2a_plan_sizes(a2a_plan *plan, const int64_t *all_counts, int64_t group_rows)
{
    const int64_t E = plan->num_experts, El = plan->num_local_experts;
    const int64_t first_local = (int64_t)plan->rank * El;
    const int64_t *mine = all_counts + (int64_t)plan->rank * E;

    plan->num_send = 0;
    for (int d = 0; d < plan->world; d++) {
        int64_t rows = 0;
        for (int64_t l = 0; l < El; l++) rows += mine[(int64_t)d * El + l];
        plan->send_rows[d] = rows;
        plan->num_send += rows;
    }
    plan->num_recv = 0;
    for (int s = 0; s < plan->world; s++) {
        int64_t rows = 0;
        for (int64_t l = 0; l < El; l++) rows += all_counts[(int64_t)s * E + first_local + l];
        plan->recv_rows[s] = rows;
        plan->num_recv += rows;
    }
    plan->capacity = moert_dispatch_plan_groups(all_counts, plan->world, plan->rank, E, El, group_rows,
                                                plan->expert_rows, plan->tokens_per_expert, plan->group_start);
}

/* Counting sort of this rank's copies by expert; within an expert, copies keep (token, k) order.
 * Experts are numbered by owning rank, so the order is also [destination rank][its local expert]. */
void a2a_plan_send_order(a2a_plan *plan, const int32_t *topk_idx, const int64_t *local_counts)
{
    int64_t *next_row = plan->cursor; /* [E] next send row of each expert */
    int64_t row = 0;
    for (int64_t e = 0; e < plan->num_experts; e++) {
        next_row[e] = row;
        row += local_counts[e];
    }
    for (int64_t i = 0; i < plan->num_tokens * plan->topk; i++) {
        int32_t e = topk_idx[i];
        plan->copy_send_row[i] = e >= 0 ? next_row[e]++ : -1;
    }
}

/* Maps each staging row ([source][local expert][token]) to its grouped row ([local expert][source][token]). */
void a2a_plan_recv_order(a2a_plan *plan, const int64_t *all_counts)
{
    const int64_t E = plan->num_experts, El = plan->num_local_experts;
    const int64_t first_local = (int64_t)plan->rank * El;
    int64_t *next_row = plan->cursor; /* [El] next free row of each local expert's group */
    for (int64_t l = 0; l < El; l++) next_row[l] = plan->group_start[l];
    /* Sources arrive in rank order, so each group ends up ordered by source rank, then token. */
    int64_t staging = 0;
    for (int s = 0; s < plan->world; s++)
        for (int64_t l = 0; l < El; l++) {
            int64_t n = all_counts[(int64_t)s * E + first_local + l];
            for (int64_t j = 0; j < n; j++) plan->recv_final_row[staging++] = next_row[l]++;
        }
}

/* Copies each kept copy's token row into its send slot. */
void a2a_pack_rows(const a2a_plan *plan, const void *rows, size_t row_bytes, void *send)
{
    const char *src = rows;
    char *dst = send;
    for (int64_t t = 0; t < plan->num_tokens; t++)
        for (int64_t k = 0; k < plan->topk; k++) {
            int64_t slot = plan->copy_send_row[t * plan->topk + k];
            if (slot >= 0) memcpy(dst + (size_t)slot * row_bytes, src + (size_t)t * row_bytes, row_bytes);
        }
}

/* Zero rows after each expert's received rows, up to its (padded) group size. */
void a2a_zero_padding(const a2a_plan *plan, void *grouped, size_t row_bytes)
{
    char *dst = grouped;
    for (int64_t l = 0; l < plan->num_local_experts; l++) {
        int64_t pad = plan->tokens_per_expert[l] - plan->expert_rows[l];
        if (pad > 0)
            memset(dst + (size_t)(plan->group_start[l] + plan->expert_rows[l]) * row_bytes, 0, (size_t)pad * row_bytes);
    }
}

/* Received routing weights to their grouped rows; padding rows get weight 0. */
void a2a_scatter_probs(const a2a_plan *plan, const double *staging, void *probs_out, moert_dtype dtype)
{
    moert_tensor view = moert_dispatch_flat_view(probs_out, dtype, plan->capacity);
    for (int64_t l = 0; l < plan->num_local_experts; l++)
        for (int64_t j = plan->expert_rows[l]; j < plan->tokens_per_expert[l]; j++)
            moert_store(&view, plan->group_start[l] + j, 0.0);
    moert_dispatch_scatter_probs(plan->recv_final_row, plan->num_recv, staging, probs_out, dtype, plan->capacity);
}
