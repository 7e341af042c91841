/* SPDX-License-Identifier: Apache-2.0 */
/* The all-to-all dispatcher's algorithm over plain arrays: sizes, send order, regrouping, padding. The moves and
 * reductions by the plan's maps (copy_send_row, recv_final_row) are plugins/lib/dispatch_common.h's, shared with the
 * other host-collective dispatchers. dispatch_alltoall.c owns the vtable, options and communication; this part is
 * what a CUDA path replaces kernel by kernel. */
#ifndef MOERT_DISPATCH_ALLTOALL_CPU_H
#define MOERT_DISPATCH_ALLTOALL_CPU_H

#include <stddef.h>
#include <stdint.h>

#include "moert/tensor.h"

/* Where every kept token copy of one step goes and where every received row lands. */
typedef struct a2a_plan {
    int world;                  /* ranks in the expert-parallel group */
    int rank;                   /* this rank */
    int64_t num_experts;        /* E over all ranks; rank d owns experts [d*El, (d+1)*El) */
    int64_t num_local_experts;  /* El */
    int64_t num_tokens;         /* T of this rank's step */
    int64_t topk;               /* K */
    int64_t num_send;           /* kept copies of this rank's tokens (rows sent, to itself included) */
    int64_t num_recv;           /* rows received for the local experts */
    int64_t capacity;           /* rows of the grouped buffers: num_recv, or the padded size */
    int64_t *send_rows;         /* [world] rows sent to each rank */
    int64_t *recv_rows;         /* [world] rows received from each rank */
    int64_t *expert_rows;       /* [El] rows received per local expert (before padding) */
    int64_t *tokens_per_expert; /* [El] rows per local expert in the grouped buffers (padded when padding) */
    int64_t *group_start;       /* [El] first grouped row of each local expert */
    int64_t *copy_send_row;     /* [T*K] row of copy (t,k) in the send buffer, -1 for a dropped copy */
    int64_t *recv_final_row;    /* [num_recv] grouped row of each received (staging) row */
    int64_t *cursor;            /* [E] scratch of the planning functions */
} a2a_plan;

/* The first expert receiving more than group_rows rows, from all_counts [world][E]; -1 if none. */
int64_t a2a_find_overflow(const int64_t *all_counts, int world, int64_t num_experts, int64_t group_rows,
                          int64_t *rows_out);

/* Fills the plan's per-rank and per-expert sizes from all_counts [world][E] (copies from rank s to expert e).
 * group_rows > 0 pads every local expert's group to that many rows; 0 keeps groups compact. */
void a2a_plan_sizes(a2a_plan *plan, const int64_t *all_counts, int64_t group_rows);

/* Fills copy_send_row: copies sorted by destination expert, stable in (token, k) order.
 * local_counts [E] are this rank's copies per expert. */
void a2a_plan_send_order(a2a_plan *plan, const int32_t *topk_idx, const int64_t *local_counts);

/* Fills recv_final_row: received rows arrive as [source rank][local expert][token order] and go to
 * [local expert][source rank][token order], each expert's group starting at group_start. */
void a2a_plan_recv_order(a2a_plan *plan, const int64_t *all_counts);

/* send[copy_send_row[t*K+k]] = rows[t] for every kept copy; rows are row_bytes long. */
void a2a_pack_rows(const a2a_plan *plan, const void *rows, size_t row_bytes, void *send);

/* Zeroes the padding rows of every expert group (rows past expert_rows within tokens_per_expert). */
void a2a_zero_padding(const a2a_plan *plan, void *grouped, size_t row_bytes);

/* probs_out[recv_final_row[i]] = staging[i] stored in dtype; padding entries set to 0. */
void a2a_scatter_probs(const a2a_plan *plan, const double *staging, void *probs_out, moert_dtype dtype);

#endif
