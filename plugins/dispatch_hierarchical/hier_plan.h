/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The hierarchical dispatcher's algorithm over plain arrays: counting, the two-phase layout, the row and prob moves
 * and the reductions. dispatch_hierarchical.c owns the vtable, options, checks and communication; its CUDA path
 * turns the maps planned here into index arrays for the row kernels of plugins/lib.
 *
 * Vocabulary. Ranks form nodes of R ranks: rank = node * R + local. Rank d owns experts [d*El, (d+1)*El), so node m
 * owns [m*R*El, (m+1)*R*El). Token t of rank (n, l) crosses to every node m holding one of its kept copies once, to
 * the "forwarder" (m, l), the rank with its own local index there (phase 1, between nodes; for m == n the forwarder
 * is the rank itself). The forwarder sends one row per copy to the ranks of its node owning the experts (phase 2,
 * inside the node). Combine runs the other way: the forwarder sums the copies of each token it forwarded (a partial
 * sum per node, rounded to the row dtype) and one row per token and node crosses back, where the token's rank adds
 * the nodes' partials.
 *
 * Orders (all of them follow from the [world][E] count matrix and the routing, so no positions travel):
 *   phase-1 send rows:     [node m][token t]           (token t's row, once per node holding a kept copy)
 *   phase-1 send probs:    [node m][token t][k]        (one prob per kept copy on node m)
 *   phase-1 receive:       [source node n'][token]     (from the ranks (n', local))
 *   phase-2 send rows:     [destination local l'][source node n'][its local expert][token][k]
 *   phase-2 receive:       [forwarder local l''][source node n'][local expert][token][k]
 *   grouped (the ABI's):   [local expert][source rank][token][k], as the alltoall dispatcher
 */
#ifndef MOERT_DISPATCH_HIERARCHICAL_PLAN_H
#define MOERT_DISPATCH_HIERARCHICAL_PLAN_H

#include <stddef.h>
#include <stdint.h>

#include "moert/tensor.h"

/* One step's routing as this rank sees it. Arrays are owned by the plugin (sizes in the comments). */
typedef struct hier_plan {
    int world, rank;
    int ranks_per_node, num_nodes; /* R, N = world / R */
    int node, local;               /* rank = node * R + local */
    int64_t num_experts;           /* E */
    int64_t num_local_experts;     /* El */
    int64_t topk;                  /* K */
    int64_t num_tokens;            /* T of this rank's step */

    /* phase 1, between nodes: this rank and the rank (m, local) of every node m */
    int64_t *node_send_tokens; /* [N] this rank's tokens with a kept copy on node m */
    int64_t *node_recv_tokens; /* [N] tokens received from (m, local) */
    int64_t *node_send_copies; /* [N] this rank's kept copies on node m (its probs go along) */
    int64_t *node_recv_copies; /* [N] copies received from (m, local) */
    int64_t num_node_send, num_node_recv, num_node_send_copies, num_node_recv_copies;
    int64_t *token_node_row; /* [T*N] phase-1 send row of token t for node m, -1 if none */
    int64_t *node_row_token; /* [T*N] token of each phase-1 send row (num_node_send used) */
    int64_t *copy_node_slot; /* [T*K] phase-1 prob slot of copy (t,k), -1 if dropped */

    /* phase 2, inside this node: what this rank forwards */
    int32_t *fwd_idx;         /* [num_node_recv*K] experts of the received tokens' copies on this node, else -1 */
    int64_t *fwd_copy_row;    /* [num_node_recv*K] phase-2 send row of each received copy, -1 if none */
    int64_t *local_send_rows; /* [R] rows to (node, l') */
    int64_t *local_recv_rows; /* [R] rows from (node, l'') */
    int64_t num_local_send;   /* = num_node_recv_copies */

    /* what this rank receives for its experts */
    int64_t num_recv, capacity; /* capacity = num_recv (compact groups) */
    int64_t *tokens_per_expert; /* [El] */
    int64_t *group_start;       /* [El] */
    int64_t *recv_final_row;    /* [num_recv] grouped row of each phase-2 received row */
    int64_t *cursor;            /* [E + 2N] scratch of the planning functions */
} hier_plan;

/* Counts kept copies per expert into counts[E] and tokens with a kept copy per node into node_tokens[N] (both zeroed
 * first), from topk_idx [T,K] (-1 = dropped). Returns the flat index of the first entry outside [-1, E), or -1. */
int64_t hier_count(const hier_plan *plan, const int32_t *topk_idx, int64_t num_tokens, int64_t *counts,
                   int64_t *node_tokens);

/* Phase sizes, per-expert groups and capacity from all_counts [world][E] (copies from rank s to expert e) and
 * all_node_tokens [world][N] (tokens of rank s with a copy on node m). */
void hier_plan_sizes(hier_plan *plan, const int64_t *all_counts, const int64_t *all_node_tokens);

/* token_node_row, node_row_token and copy_node_slot from this rank's topk_idx [T,K] (hier_plan_sizes first). */
void hier_plan_send(hier_plan *plan, const int32_t *topk_idx);

/* The routing that travels in phase 1 (prepare): for every phase-1 send row, the token's K expert ids with those
 * not on the destination node set to -1. send: int32 [num_node_send][K]. */
void hier_pack_routing(const hier_plan *plan, const int32_t *topk_idx, int32_t *send);

/* fwd_copy_row from the received routing fwd_idx, and recv_final_row: the phase-2 layouts, from all_counts. */
void hier_plan_forward(hier_plan *plan, const int64_t *all_counts);

/* ---- dispatch-like moves ---- */

/* send[r] = rows[node_row_token[r]] for the phase-1 send rows. */
void hier_pack_node_rows(const hier_plan *plan, const void *rows, size_t row_bytes, void *send);
/* send[copy_node_slot[i]] = probs[i] (as double) for the kept copies. */
void hier_pack_node_probs(const hier_plan *plan, const void *probs, moert_dtype dtype, double *send);
/* At the forwarder: send[fwd_copy_row[j*K+k]] = fwd_rows[j] for every received copy on this node. */
void hier_pack_local_rows(const hier_plan *plan, const void *fwd_rows, size_t row_bytes, void *send);
/* At the forwarder: the received probs (phase-1 order) to their phase-2 rows. */
void hier_pack_local_probs(const hier_plan *plan, const double *fwd_probs, double *send);
/* grouped[recv_final_row[i]] = staging[i], and its inverse. */
void hier_scatter_rows(const hier_plan *plan, const void *staging, size_t row_bytes, void *grouped);
void hier_gather_rows(const hier_plan *plan, const void *grouped, size_t row_bytes, void *staging);
/* The same for the probs: stored in dtype / read as double from dtype. */
void hier_scatter_probs(const hier_plan *plan, const double *staging, void *probs_out, moert_dtype dtype);
void hier_gather_probs(const hier_plan *plan, const void *probs, moert_dtype dtype, double *staging);

/* ---- combine-like moves ---- */

/*
 * At the forwarder: partial[j] = the sum, in double and k order from -0, of the phase-2 rows of received token j's
 * copies (local_rows in phase-2 send order), rounded once to dtype: the one row per token that crosses back.
 * acc: hidden doubles of scratch.
 */
void hier_partial_rows(const hier_plan *plan, const void *local_rows, moert_dtype dtype, int64_t hidden, void *partial,
                       double *acc);
/* At the forwarder: the prob gradients of the phase-2 rows back to phase-1 order (the inverse of pack_local_probs). */
void hier_unpack_local_probs(const hier_plan *plan, const double *local_probs, double *fwd_probs);
/*
 * At the token's rank: out[t] (= or +=) the sum over the nodes, in node order and double, of the partial rows that
 * came back (node_rows in phase-1 send order, rows_dtype), rounded once to out_dtype. A token without kept copies
 * gets 0 (or keeps its value when accumulating).
 */
void hier_sum_nodes(const hier_plan *plan, const void *node_rows, moert_dtype rows_dtype, int64_t hidden,
                    int accumulate, void *out, moert_dtype out_dtype, double *acc);
/* probs_out[t,k] = node_probs[copy_node_slot[t*K+k]], 0 for dropped copies; stored in dtype. */
void hier_unpack_probs(const hier_plan *plan, const double *node_probs, void *probs_out, moert_dtype dtype);

#endif
