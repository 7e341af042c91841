/* The "deepep" dispatcher's algorithm over plain arrays: the layout pass, the plan after the count exchange
 * (notify), and the CPU path's send/receive through the peers' buffers with bounded waits on their flags.
 * The CUDA path (deepep_cuda.cu) runs the same algorithm with channels of tokens; this is its reference. */
#ifndef MOERT_DEEPEP_CPU_H
#define MOERT_DEEPEP_CPU_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "deepep_buffer.h"
#include "moert/tensor.h"

/* One step's routing, as every rank sees it after the count exchange. */
typedef struct deepep_plan {
    int world, rank;
    int64_t num_experts, num_local_experts, topk;
    int64_t num_tokens;         /* T of this rank */
    int64_t num_recv;           /* rows this rank receives (token copies for its local experts) */
    int64_t *all_counts;        /* [world][E] copies from rank s to expert e */
    int64_t *tokens_to;         /* [world][world] tokens of rank s with at least one copy on rank d (s*world+d) */
    int64_t *tokens_per_expert; /* [El] rows per local expert */
    int64_t *group_start;       /* [El] first row of each local expert's group */
    int64_t *base;              /* [E] first row, on expert e's rank, of this rank's copies to e */
    int64_t *copy_dst;          /* [T*K] row of copy (t,k) on its expert's rank, -1 if dropped (CPU path) */
    int64_t *excl;              /* [world][T+1] tokens before t with a copy on rank d (CPU path) */
} deepep_plan;

/* The layout pass: copies per expert into counts[E] and tokens per destination rank into tokens_to[world]
 * (a token with several experts on one rank counts once). Returns the flat index of the first entry outside
 * [-1, E), or -1 when all are valid. */
int64_t deepep_count(const int32_t *topk_idx, int64_t num_tokens, int64_t topk, int64_t num_experts, int world,
                     int64_t *counts, int64_t *tokens_to);

/* After the exchange (all_counts filled): num_recv, tokens_per_expert, group_start and base. Rows of local
 * expert l are ordered by source rank, then token, then k (the order of the "alltoall" dispatcher). */
void deepep_plan_sizes(deepep_plan *plan);

/* The CPU path's per-copy rows (copy_dst) and per-rank token positions (excl) from topk_idx. */
void deepep_plan_copies(deepep_plan *plan, const int32_t *topk_idx);

/* What a CPU call needs to talk to its peers. */
typedef struct deepep_cpu_link {
    const deepep_geometry *geo;
    void *local;            /* this rank's buffer */
    void *const *peers;     /* [world] every rank's buffer */
    int64_t seq;            /* this call's sequence number (>= 1) */
    int64_t timeout_ms;     /* bound of every wait */
    int64_t *recv_meta;     /* [world][rows_cap][K] saved by dispatch-like calls: rows of each received copy */
    int64_t *recv_rows;     /* [world] rows received from each rank by the last dispatch-like call */
    char *error;            /* the message of a stall */
    size_t error_size;
} deepep_cpu_link;

/* FP8 quantization of one 1x128 block (the CUDA kernels do the same float math): q[i] = e4m3(v[i] * scale) with
 * scale = 448 / amax (1 when amax is 0 or not finite); returns 1 / scale, the factor the receiver multiplies by. */
float deepep_fp8_quantize_block(const float *v, uint8_t *q);

/*
 * A dispatch-like call: every token row of x (dtype x_dtype, [T,H]) goes once to each rank holding one of its
 * experts, with its copies' rows and probs; the receiver writes the row into every copy's row of out ([num_recv,H],
 * out_dtype == x_dtype unless fp8) and the prob into out_probs. probs/out_probs may be NULL (combine_backward).
 * fp8: the row travels as E4M3 with one scale per 128 elements and is dequantized into out.
 * Returns 0, or 1 + the rank that stalled (link->error says which wait).
 */
int deepep_cpu_dispatch(const deepep_cpu_link *link, const deepep_plan *plan, int64_t hidden, bool fp8,
                        const int32_t *topk_idx, const void *x, moert_dtype x_dtype, const void *probs, moert_dtype probs_dtype, void *out,
                        moert_dtype out_dtype, void *out_probs, moert_dtype out_probs_dtype);

/*
 * A combine-like call: the expert rank sums, for each token row it received from rank s, the rows of that token's
 * copies in rows ([num_recv,H], rows_dtype), in k order (fp32, fp64 for fp64 rows), rounds the partial to rows_dtype
 * and sends it back; the token's rank sums its partials in rank order into out[t] (overwrite, 0 for a token without
 * kept copies; accumulate: added to out's value, untouched without copies). row_probs ([num_recv]) / out_probs
 * ([T,K], 0 for dropped copies) carry the prob gradients back when not NULL. Returns as deepep_cpu_dispatch.
 */
int deepep_cpu_combine(const deepep_cpu_link *link, const deepep_plan *plan, int64_t hidden, const int32_t *topk_idx,
                       const void *rows, moert_dtype rows_dtype, const void *row_probs, moert_dtype row_probs_dtype,
                       void *out, moert_dtype out_dtype, bool accumulate, void *out_probs, moert_dtype out_probs_dtype);

/* Before a buffer is freed: waits (at most timeout_ms) until every rank has released what this rank wrote into it in
 * call seq, its last write into this buffer. Returns -1 when done, else the rank that did not. */
int deepep_cpu_wait_released(void *local, int world, int64_t seq, int64_t timeout_ms);

#endif
