/* The "hybridep" dispatcher's algorithm over plain arrays: the layout pass, the notify through the peers' buffers
 * (no collective: each rank writes its counts into every peer's buffer), the plan, and the CPU path's send/receive
 * through the buffers with bounded waits on their flags. The CUDA path (hybridep_cuda.cu) runs the same algorithm;
 * this is its reference. */
#ifndef MOERT_HYBRIDEP_CPU_H
#define MOERT_HYBRIDEP_CPU_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "hybridep_buffer.h"
#include "moert/tensor.h"

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
    int64_t *excl;              /* [world][T+1] tokens before t with a copy on rank d */
} hybridep_plan;

/* The layout pass: counts, tokens_to, copy_index and excl of the plan from topk_idx (T = plan->num_tokens).
 * Returns the flat index of the first entry outside [-1, E), or -1 when all are valid (bad entries count as dropped). */
int64_t hybridep_layout(hybridep_plan *plan, const int32_t *topk_idx);

/* After the notify (all_counts filled): num_recv, tokens_per_expert and base. Rows of local expert l are ordered by
 * source rank, then token, then k (the order of the "alltoall" dispatcher). */
void hybridep_plan_sizes(hybridep_plan *plan);

/* What a CPU call needs to talk to its peers. */
typedef struct hybridep_cpu_link {
    const hybridep_geometry *geo;
    void *local;            /* this rank's buffer */
    void *const *peers;     /* [world] every rank's buffer */
    int64_t seq;            /* this call's sequence number (>= 1) */
    int64_t timeout_ms;     /* bound of every wait */
    int64_t *recv_meta;     /* [world][rows_cap][K] saved by dispatch-like calls: rows of each received copy */
    int64_t *recv_rows;     /* [world] rows received from each rank by the last dispatch-like call */
    char *error;            /* the message of a stall */
    size_t error_size;
} hybridep_cpu_link;

/* The notify: writes `row` (E counts + HYBRIDEP_NOTIFY_EXTRA entries) into every rank's buffer, waits for every
 * rank's row and copies them into rows ([world][E + extra]). Returns 0, or 1 + the rank that stalled. */
int hybridep_cpu_notify(const hybridep_cpu_link *link, const int64_t *row, int64_t *rows);

/*
 * A dispatch-like call: every token row of x (dtype x_dtype, [T,H]) goes once to each rank holding one of its
 * experts, with its copies' rows and probs; the receiver writes the row into every copy's row of out (same dtype)
 * and the prob into out_probs. probs/out_probs may be NULL (combine_backward).
 * Returns 0, or 1 + the rank that stalled (link->error says which wait).
 */
int hybridep_cpu_dispatch(const hybridep_cpu_link *link, const hybridep_plan *plan, int64_t hidden,
                          const int32_t *topk_idx, const void *x, moert_dtype x_dtype, const void *probs,
                          moert_dtype probs_dtype, void *out, void *out_probs, moert_dtype out_probs_dtype);

/*
 * A combine-like call: the expert rank sums, for each token row it received from rank s, the rows of that token's
 * copies in rows (rows_dtype), in k order (fp32, fp64 for fp64 rows), rounds the partial to rows_dtype and sends it
 * back; the token's rank sums its partials in rank order into out[t] (overwrite, 0 for a token without kept copies;
 * accumulate: added to out's value, untouched without copies). row_probs / out_probs ([T,K], 0 for dropped copies)
 * carry the prob gradients back when not NULL. Returns as hybridep_cpu_dispatch.
 */
int hybridep_cpu_combine(const hybridep_cpu_link *link, const hybridep_plan *plan, int64_t hidden,
                         const int32_t *topk_idx, const void *rows, moert_dtype rows_dtype, const void *row_probs,
                         moert_dtype row_probs_dtype, void *out, moert_dtype out_dtype, bool accumulate,
                         void *out_probs, moert_dtype out_probs_dtype);

/* Before a buffer is freed: waits (at most timeout_ms) until every rank has released what this rank wrote into it in
 * call seq. Returns -1 when done, else the rank that did not. */
int hybridep_cpu_wait_released(void *local, int world, int64_t seq, int64_t timeout_ms);

#endif
