/* SPDX-License-Identifier: Apache-2.0 */
/* The "hybridep" dispatcher's layout and notify over plain arrays (see hybridep_cpu.h). */
#include "hybridep_cpu.h"

#include <stdio.h>
#include <string.h>

/* Counts, token positions per destination rank and each copy's place among this rank's copies to its expert, in one
 * pass over topk_idx. */
int64_t hybridep_layout(hybridep_plan *plan, const int32_t *topk_idx)
{
    const int W = plan->world;
    const int64_t T = plan->num_tokens, K = plan->topk, E = plan->num_experts, El = plan->num_local_experts;
    int64_t bad = -1;
    memset(plan->counts, 0, (size_t)E * sizeof(int64_t));
    memset(plan->tokens_to, 0, (size_t)W * sizeof(int64_t));
    for (int d = 0; d < W; d++) plan->excl[(int64_t)d * (T + 1)] = 0;
    for (int64_t t = 0; t < T; t++) {
        unsigned ranks = 0; /* bit d: the token has a copy on rank d */
        for (int64_t k = 0; k < K; k++) {
            const int32_t e = topk_idx[t * K + k];
            if (e < -1 || e >= E) {
                if (bad < 0) bad = t * K + k;
                plan->copy_index[t * K + k] = -1;
                continue;
            }
            if (e == -1) {
                plan->copy_index[t * K + k] = -1;
                continue;
            }
            plan->copy_index[t * K + k] = plan->counts[e]++;
            ranks |= 1u << (e / El);
        }
        for (int d = 0; d < W; d++) {
            const int64_t has = (ranks >> d) & 1u;
            plan->tokens_to[d] += has;
            plan->excl[(int64_t)d * (T + 1) + t + 1] = plan->excl[(int64_t)d * (T + 1) + t] + has;
        }
    }
    return bad;
}

/* Each copy's final row: its expert's base plus its place among this rank's copies to that expert. */
void hybridep_plan_copies(hybridep_plan *plan, const int32_t *topk_idx)
{
    const int64_t copies = plan->num_tokens * plan->topk;
    for (int64_t c = 0; c < copies; c++)
        plan->copy_dst[c] = plan->copy_index[c] >= 0 ? plan->base[topk_idx[c]] + plan->copy_index[c] : -1;
}

/* Every rank's row into every buffer, then every rank's row out of this one (the slot released after each). */
int hybridep_cpu_notify(const peer_cpu_link *link, const int64_t *row, int64_t *rows)
{
    const peer_geometry *g = link->geo;
    const int W = g->world, me = link->rank;
    const size_t row_bytes = (size_t)g->notify_row_entries * sizeof(int64_t);
    int stalled = peer_cpu_wait_all_consumed(link);
    if (stalled) return stalled;
    for (int d = 0; d < W; d++) {
        memcpy(peer_notify_row(g, link->peers[d], me), row, row_bytes);
        __atomic_store_n(&((peer_header *)link->peers[d])->notified[me], link->seq, __ATOMIC_RELEASE);
    }
    for (int s = 0; s < W; s++) {
        if (!peer_cpu_wait_at_least(&((peer_header *)link->local)->notified[s], link->seq, link->timeout_ms)) {
            snprintf(link->error, link->error_size, "rank %d did not send its counts within %lld ms (timeout_ms)", s,
                     (long long)link->timeout_ms);
            return s + 1;
        }
        memcpy((char *)rows + (size_t)s * row_bytes, peer_notify_row(g, link->local, s), row_bytes);
        peer_cpu_release(link, s);
    }
    return 0;
}
