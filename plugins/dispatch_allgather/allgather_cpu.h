/* SPDX-License-Identifier: Apache-2.0 */
/* The allgather dispatcher's algorithm over plain arrays: the local permutation of the gathered copies, row and prob
 * moves, and the partial sums of the reduce-scatter (counting copies and the expert groups are
 * plugins/lib/dispatch_common.h's). dispatch_allgather.c owns the vtable, options and communication;
 * allgather_cuda.cu replaces these functions kernel by kernel. */
#ifndef MOERT_DISPATCH_ALLGATHER_CPU_H
#define MOERT_DISPATCH_ALLGATHER_CPU_H

#include <stddef.h>
#include <stdint.h>

#include "moert/tensor.h"

/*
 * One step's routing as every rank sees it after the allgather. Every rank contributes a block of max_tokens tokens
 * (its own T, then padding tokens whose copies are all dropped), so the gathered token g = s*max_tokens + t is token
 * t of rank s, and the gathered copy c = g*K + k its copy k.
 */
typedef struct ag_plan {
    int world;                  /* ranks in the expert-parallel group */
    int rank;                   /* this rank */
    int64_t num_experts;        /* E over all ranks; rank d owns experts [d*El, (d+1)*El) */
    int64_t num_local_experts;  /* El */
    int64_t topk;               /* K */
    int64_t num_tokens;         /* T of this rank's step */
    int64_t max_tokens;         /* the largest T of any rank: the block of each rank in the gathered buffers */
    int64_t *rank_tokens;       /* [world] T of each rank */
    int64_t num_recv;           /* rows for the local experts (the grouped buffers' rows) */
    int64_t *tokens_per_expert; /* [El] rows per local expert */
    int64_t *group_start;       /* [El] first grouped row of each local expert */
    int64_t *grouped_copy;      /* [num_recv] the gathered copy of each grouped row */
    int64_t *copy_row;          /* [world*max_tokens*K] grouped row of each gathered copy, -1 if not for this rank */
    int64_t *cursor;            /* [El] scratch of the planning functions */
} ag_plan;

/* Rows per local expert, group starts and num_recv from all_counts [world][E] (copies from rank s to expert e). */
void ag_plan_sizes(ag_plan *plan, const int64_t *all_counts);

/* The local permutation: copy_row and grouped_copy from the gathered topk_idx [world*max_tokens, K]. Within a local
 * expert the rows come in gathered copy order: source rank, then token, then k (Megatron's permute of the gathered
 * tokens, and the order of the alltoall dispatcher). */
void ag_plan_rows(ag_plan *plan, const int32_t *gathered_idx);

/* grouped[j] = gathered_rows[token of grouped_copy[j]] for the num_recv grouped rows; rows are row_bytes long. */
void ag_gather_rows(const ag_plan *plan, const void *gathered_rows, size_t row_bytes, void *grouped);

/* probs_out[j] = gathered_probs[grouped_copy[j]] stored in dtype. */
void ag_gather_probs(const ag_plan *plan, const double *gathered_probs, void *probs_out, moert_dtype dtype);

/* partial[g] = the sum, in double and k order, of the grouped rows of gathered token g's copies on this rank, for
 * every gathered token (-0, the additive identity, where it has none); grouped rows [num_recv, hidden] in dtype. */
void ag_partial_rows(const ag_plan *plan, const void *grouped, moert_dtype dtype, int64_t hidden, double *partial);

/* partial[c] = the grouped prob of gathered copy c where it is on this rank, else -0; grouped [num_recv] in dtype. */
void ag_partial_probs(const ag_plan *plan, const void *grouped, moert_dtype dtype, double *partial);

/*
 * The reduction at the tokens' owner: recv [world][T][hidden] holds every rank's partial rows of this rank's tokens.
 * out[t] = their sum in rank order, in double, rounded once to out's dtype; accumulate 0 overwrites (a token without
 * kept copies gets 0), 1 adds to out (a token without kept copies keeps its value). topk_idx [T,K] tells which
 * tokens have kept copies.
 */
void ag_sum_partial_rows(const ag_plan *plan, const double *recv, int64_t hidden, const int32_t *topk_idx,
                         int accumulate, void *out, moert_dtype out_dtype);

/* The same for the per-copy values recv [world][T*K]: probs_out[t,k] = their sum (0 for a dropped copy). */
void ag_sum_partial_probs(const ag_plan *plan, const double *recv, const int32_t *topk_idx, void *probs_out,
                          moert_dtype dtype);

#endif
