/* SPDX-License-Identifier: Apache-2.0 */
/* The "deepep" dispatcher's layout over plain arrays (see deepep_cpu.h). */
#include "deepep_cpu.h"

#include <stdlib.h>
#include <string.h>

/* Copies per expert and tokens per destination rank; the first bad entry's flat index, or -1. */
int64_t deepep_count(const int32_t *topk_idx, int64_t num_tokens, int64_t topk, int64_t num_experts, int world,
                     int64_t *counts, int64_t *tokens_to)
{
    const int64_t El = num_experts / world;
    memset(counts, 0, (size_t)num_experts * sizeof *counts);
    memset(tokens_to, 0, (size_t)world * sizeof *tokens_to);
    for (int64_t t = 0; t < num_tokens; t++) {
        unsigned ranks = 0; /* bit d: the token has a copy on rank d */
        for (int64_t k = 0; k < topk; k++) {
            int32_t e = topk_idx[t * topk + k];
            if (e == -1) continue;
            if (e < -1 || e >= num_experts) return t * topk + k;
            counts[e]++;
            ranks |= 1u << (e / El);
        }
        for (int d = 0; d < world; d++) tokens_to[d] += (ranks >> d) & 1u;
    }
    return -1;
}

/* Each copy's row on its expert's rank (base + its place among this rank's copies to that expert, in (t,k)
 * order), and for each rank d the number of this rank's tokens before t that go to d. */
void deepep_plan_copies(deepep_plan *plan, const int32_t *topk_idx)
{
    const int W = plan->world;
    const int64_t T = plan->num_tokens, K = plan->topk, El = plan->num_local_experts;
    int64_t *next = calloc((size_t)plan->num_experts + 1, sizeof *next);
    for (int64_t e = 0; e < plan->num_experts && next; e++) next[e] = plan->base[e];
    for (int d = 0; d < W; d++) plan->excl[(int64_t)d * (T + 1)] = 0;
    for (int64_t t = 0; t < T; t++) {
        unsigned ranks = 0;
        for (int64_t k = 0; k < K; k++) {
            int32_t e = topk_idx[t * K + k];
            plan->copy_dst[t * K + k] = (e >= 0 && next) ? next[e]++ : -1;
            if (e >= 0) ranks |= 1u << (e / El);
        }
        for (int d = 0; d < W; d++)
            plan->excl[(int64_t)d * (T + 1) + t + 1] = plan->excl[(int64_t)d * (T + 1) + t] + ((ranks >> d) & 1u);
    }
    free(next);
}
