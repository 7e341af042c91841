/* SPDX-License-Identifier: Apache-2.0 */
/* The hierarchical dispatcher's CPU algorithm over plain arrays (see hier_plan.h for the orders). */
#include "hier_plan.h"

#include <stdbool.h>
#include <string.h>

#include "dispatch_common.h"

/* The node owning expert e. */
static int node_of_expert(const hier_plan *p, int64_t e)
{
    return (int)(e / (p->num_local_experts * p->ranks_per_node));
}

/* Kept copies of rank s for the experts of rank d, from all_counts [world][E]. */
static int64_t copies_to_rank(const hier_plan *p, const int64_t *all_counts, int s, int d)
{
    const int64_t El = p->num_local_experts;
    const int64_t *row = all_counts + (int64_t)s * p->num_experts + (int64_t)d * El;
    int64_t n = 0;
    for (int64_t l = 0; l < El; l++) n += row[l];
    return n;
}

int64_t hier_count(const hier_plan *p, const int32_t *topk_idx, int64_t num_tokens, int64_t *counts,
                   int64_t *node_tokens)
{
    const int64_t K = p->topk, E = p->num_experts;
    memset(counts, 0, (size_t)E * sizeof *counts);
    memset(node_tokens, 0, (size_t)p->num_nodes * sizeof *node_tokens);
    for (int64_t t = 0; t < num_tokens; t++) {
        /* a token counts once per node, however many of its copies go there */
        for (int64_t k = 0; k < K; k++) {
            int32_t e = topk_idx[t * K + k];
            if (e == -1) continue;
            if (e < -1 || e >= E) return t * K + k;
            counts[e]++;
            int m = node_of_expert(p, e);
            bool seen = false;
            for (int64_t j = 0; j < k && !seen; j++) {
                int32_t f = topk_idx[t * K + j];
                seen = f >= 0 && node_of_expert(p, f) == m;
            }
            if (!seen) node_tokens[m]++;
        }
    }
    return -1;
}

void hier_plan_sizes(hier_plan *p, const int64_t *all_counts, const int64_t *all_node_tokens)
{
    const int R = p->ranks_per_node, N = p->num_nodes;
    const int64_t E = p->num_experts, El = p->num_local_experts;
    p->num_node_send = p->num_node_recv = p->num_node_send_copies = p->num_node_recv_copies = 0;
    for (int m = 0; m < N; m++) {
        const int peer = m * R + p->local; /* the rank with this rank's local index in node m */
        p->node_send_tokens[m] = all_node_tokens[(int64_t)p->rank * N + m];
        p->node_recv_tokens[m] = all_node_tokens[(int64_t)peer * N + p->node];
        int64_t sent = 0, received = 0;
        for (int l = 0; l < R; l++) {
            sent += copies_to_rank(p, all_counts, p->rank, m * R + l);
            received += copies_to_rank(p, all_counts, peer, p->node * R + l);
        }
        p->node_send_copies[m] = sent;
        p->node_recv_copies[m] = received;
        p->num_node_send += p->node_send_tokens[m];
        p->num_node_recv += p->node_recv_tokens[m];
        p->num_node_send_copies += sent;
        p->num_node_recv_copies += received;
    }
    /* phase 2: this rank forwards what the ranks (n', local) sent to the experts of (node, l'), and receives what
     * each forwarder (node, l'') got from the ranks (n', l'') for this rank's experts */
    p->num_local_send = 0;
    for (int l = 0; l < R; l++) {
        int64_t out = 0, in = 0;
        for (int n = 0; n < N; n++) {
            out += copies_to_rank(p, all_counts, n * R + p->local, p->node * R + l);
            in += copies_to_rank(p, all_counts, n * R + l, p->rank);
        }
        p->local_send_rows[l] = out;
        p->local_recv_rows[l] = in;
        p->num_local_send += out;
    }
    p->num_recv =
        moert_dispatch_plan_groups(all_counts, p->world, p->rank, E, El, 0, NULL, p->tokens_per_expert, p->group_start);
    p->capacity = p->num_recv;
}

void hier_plan_send(hier_plan *p, const int32_t *topk_idx)
{
    const int N = p->num_nodes;
    const int64_t T = p->num_tokens, K = p->topk;
    int64_t *next_row = p->cursor;      /* [N] next phase-1 row of each node's block */
    int64_t *next_slot = p->cursor + N; /* [N] next prob slot of each node's block */
    int64_t row = 0, slot = 0;
    for (int m = 0; m < N; m++) {
        next_row[m] = row;
        next_slot[m] = slot;
        row += p->node_send_tokens[m];
        slot += p->node_send_copies[m];
    }
    for (int64_t t = 0; t < T; t++) {
        for (int m = 0; m < N; m++) p->token_node_row[t * N + m] = -1;
        for (int64_t k = 0; k < K; k++) {
            int32_t e = topk_idx[t * K + k];
            if (e < 0) {
                p->copy_node_slot[t * K + k] = -1;
                continue;
            }
            int m = node_of_expert(p, e);
            if (p->token_node_row[t * N + m] < 0) {
                p->token_node_row[t * N + m] = next_row[m];
                p->node_row_token[next_row[m]++] = t;
            }
            p->copy_node_slot[t * K + k] = next_slot[m]++;
        }
    }
}

void hier_pack_routing(const hier_plan *p, const int32_t *topk_idx, int32_t *send)
{
    const int N = p->num_nodes;
    const int64_t K = p->topk;
    for (int64_t t = 0; t < p->num_tokens; t++)
        for (int m = 0; m < N; m++) {
            int64_t row = p->token_node_row[t * N + m];
            if (row < 0) continue;
            for (int64_t k = 0; k < K; k++) {
                int32_t e = topk_idx[t * K + k];
                send[row * K + k] = e >= 0 && node_of_expert(p, e) == m ? e : -1;
            }
        }
}

void hier_plan_forward(hier_plan *p, const int64_t *all_counts)
{
    const int R = p->ranks_per_node, N = p->num_nodes;
    const int64_t E = p->num_experts, El = p->num_local_experts, K = p->topk;

    /* forwarder: bucket (l', n', el) starts, in that order; bucket sizes from the count matrix */
    int64_t *next = p->cursor; /* [R][N][El] = E entries */
    int64_t row = 0;
    for (int l = 0; l < R; l++)
        for (int n = 0; n < N; n++)
            for (int64_t el = 0; el < El; el++) {
                next[((int64_t)l * N + n) * El + el] = row;
                row += all_counts[(int64_t)(n * R + p->local) * E + (int64_t)(p->node * R + l) * El + el];
            }
    int64_t j = 0; /* received tokens come in source-node order */
    for (int n = 0; n < N; n++)
        for (int64_t end = j + p->node_recv_tokens[n]; j < end; j++)
            for (int64_t k = 0; k < K; k++) {
                int32_t e = p->fwd_idx[j * K + k];
                if (e < 0) {
                    p->fwd_copy_row[j * K + k] = -1;
                    continue;
                }
                int64_t owner = e / El;
                int l = (int)(owner % R);
                p->fwd_copy_row[j * K + k] = next[((int64_t)l * N + n) * El + e % El]++;
            }

    /* receiver: each (local expert, source rank) block starts after the blocks of the lower source ranks */
    int64_t *start = p->cursor; /* [El][world] = E entries; the forwarder's cursor is no longer needed */
    const int64_t first_local = (int64_t)p->rank * El;
    for (int64_t el = 0; el < El; el++) {
        int64_t at = p->group_start[el];
        for (int s = 0; s < p->world; s++) {
            start[el * p->world + s] = at;
            at += all_counts[(int64_t)s * E + first_local + el];
        }
    }
    int64_t i = 0;
    for (int l = 0; l < R; l++)
        for (int n = 0; n < N; n++) {
            const int s = n * R + l;
            for (int64_t el = 0; el < El; el++) {
                int64_t c = all_counts[(int64_t)s * E + first_local + el];
                for (int64_t q = 0; q < c; q++) p->recv_final_row[i++] = start[el * p->world + s]++;
            }
        }
}

/* ---- dispatch-like moves ---- */

void hier_pack_node_rows(const hier_plan *p, const void *rows, size_t row_bytes, void *send)
{
    const char *src = rows;
    char *dst = send;
    for (int64_t r = 0; r < p->num_node_send; r++)
        memcpy(dst + (size_t)r * row_bytes, src + (size_t)p->node_row_token[r] * row_bytes, row_bytes);
}

void hier_pack_node_probs(const hier_plan *p, const void *probs, moert_dtype dtype, double *send)
{
    moert_dispatch_pack_probs(p->copy_node_slot, p->num_tokens * p->topk, probs, dtype, send);
}

void hier_pack_local_rows(const hier_plan *p, const void *fwd_rows, size_t row_bytes, void *send)
{
    const char *src = fwd_rows;
    char *dst = send;
    for (int64_t c = 0; c < p->num_node_recv * p->topk; c++) {
        int64_t r = p->fwd_copy_row[c];
        if (r >= 0) memcpy(dst + (size_t)r * row_bytes, src + (size_t)(c / p->topk) * row_bytes, row_bytes);
    }
}

void hier_pack_local_probs(const hier_plan *p, const double *fwd_probs, double *send)
{
    int64_t slot = 0; /* the received probs come in (token, k) order of the copies on this node */
    for (int64_t c = 0; c < p->num_node_recv * p->topk; c++)
        if (p->fwd_copy_row[c] >= 0) send[p->fwd_copy_row[c]] = fwd_probs[slot++];
}

void hier_scatter_rows(const hier_plan *p, const void *staging, size_t row_bytes, void *grouped)
{
    moert_dispatch_scatter_rows(p->recv_final_row, p->num_recv, staging, row_bytes, grouped);
}

void hier_gather_rows(const hier_plan *p, const void *grouped, size_t row_bytes, void *staging)
{
    moert_dispatch_gather_rows(p->recv_final_row, p->num_recv, grouped, row_bytes, staging);
}

void hier_scatter_probs(const hier_plan *p, const double *staging, void *probs_out, moert_dtype dtype)
{
    moert_dispatch_scatter_probs(p->recv_final_row, p->num_recv, staging, probs_out, dtype, p->capacity);
}

void hier_gather_probs(const hier_plan *p, const void *probs, moert_dtype dtype, double *staging)
{
    moert_dispatch_gather_probs(p->recv_final_row, p->num_recv, probs, dtype, p->capacity, staging);
}

/* ---- combine-like moves ---- */

void hier_partial_rows(const hier_plan *p, const void *local_rows, moert_dtype dtype, int64_t hidden, void *partial,
                       double *acc)
{
    const int64_t K = p->topk;
    moert_tensor rows = moert_dispatch_flat_view(local_rows, dtype, p->num_local_send * hidden);
    moert_tensor out = moert_dispatch_flat_view(partial, dtype, p->num_node_recv * hidden);
    for (int64_t j = 0; j < p->num_node_recv; j++) {
        /* -0 is the additive identity: one copy's row (a -0 included) crosses back bit for bit */
        for (int64_t h = 0; h < hidden; h++) acc[h] = -0.0;
        for (int64_t k = 0; k < K; k++) {
            int64_t r = p->fwd_copy_row[j * K + k];
            if (r < 0) continue;
            for (int64_t h = 0; h < hidden; h++) acc[h] += moert_load(&rows, r * hidden + h);
        }
        for (int64_t h = 0; h < hidden; h++) moert_store(&out, j * hidden + h, acc[h]);
    }
}

void hier_unpack_local_probs(const hier_plan *p, const double *local_probs, double *fwd_probs)
{
    int64_t slot = 0;
    for (int64_t c = 0; c < p->num_node_recv * p->topk; c++)
        if (p->fwd_copy_row[c] >= 0) fwd_probs[slot++] = local_probs[p->fwd_copy_row[c]];
}

void hier_sum_nodes(const hier_plan *p, const void *node_rows, moert_dtype rows_dtype, int64_t hidden, int accumulate,
                    void *out, moert_dtype out_dtype, double *acc)
{
    moert_dispatch_sum_rows(p->token_node_row, p->num_tokens, p->num_nodes, node_rows, rows_dtype, p->num_node_send,
                            hidden, accumulate, out, out_dtype, acc);
}

void hier_unpack_probs(const hier_plan *p, const double *node_probs, void *probs_out, moert_dtype dtype)
{
    moert_dispatch_unpack_probs(p->copy_node_slot, p->num_tokens * p->topk, node_probs, probs_out, dtype);
}
