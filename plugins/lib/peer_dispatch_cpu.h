/* SPDX-License-Identifier: Apache-2.0 */
/* The CPU path the NVLink dispatchers ("deepep", "hybridep") share, over plain arrays: the plan's sizes after the count
 * exchange, and the calls' send/receive through the peers' buffers (peer_buffer.h) with bounded waits on their flags.
 * Each plugin makes its routing (layout pass, count exchange) its own way; the send/receive is the reference of both
 * plugins' CUDA paths. Compiled into each plugin. */
#ifndef MOERT_PEER_DISPATCH_CPU_H
#define MOERT_PEER_DISPATCH_CPU_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "moert/tensor.h"
#include "peer_buffer.h"

/*
 * After the count exchange (all_counts [world][E]: copies from rank s to expert e): rows per local expert of this rank
 * into tokens_per_expert [El], the first row of each local expert's group into group_start [El] (when not NULL), and
 * base [E]: the first row, on expert e's rank, of this rank's copies to e. Rows of local expert l are ordered by source
 * rank, then token, then k (the order of the "alltoall" dispatcher). Returns the rows this rank receives.
 */
int64_t peer_plan_sizes(int world, int rank, int64_t num_experts, int64_t num_local_experts, const int64_t *all_counts,
                        int64_t *tokens_per_expert, int64_t *group_start, int64_t *base);

/* What a CPU call needs to talk to its peers. */
typedef struct peer_cpu_link {
    const peer_geometry *geo;
    void *local;        /* this rank's buffer */
    void *const *peers; /* [world] every rank's buffer */
    int rank;           /* this rank */
    int64_t seq;        /* this call's sequence number (>= 1) */
    int64_t timeout_ms; /* bound of every wait */
    int64_t *recv_meta; /* [world][rows_cap][K] saved by dispatch-like calls: rows of each received copy */
    int64_t *recv_rows; /* [world] rows received from each rank by the last dispatch-like call */
    char *error;        /* the message of a stall */
    size_t error_size;
} peer_cpu_link;

/* One step's routing on this rank, as the CPU calls read it. */
typedef struct peer_cpu_route {
    int64_t num_tokens; /* T of this rank */
    int64_t topk, num_local_experts;
    int64_t num_recv;         /* rows this rank receives */
    const int32_t *topk_idx;  /* [T*K] the step's expert ids (-1: dropped) */
    const int64_t *copy_dst;  /* [T*K] row of copy (t,k) on its expert's rank, -1 if dropped */
    const int64_t *excl;      /* [world][T+1] tokens before t with a copy on rank d */
    const int64_t *tokens_to; /* [world] tokens with at least one copy on rank d */
} peer_cpu_route;

/* Waits until *p >= target (acquire), at most timeout_ms. */
bool peer_cpu_wait_at_least(const int64_t *p, int64_t target, int64_t timeout_ms);

/* Waits for every rank to have read what this rank wrote into it in the previous call. 0, or 1 + the rank that did
 * not (link->error says so). */
int peer_cpu_wait_all_consumed(const peer_cpu_link *link);

/* Tells rank s that this rank has read what s wrote in this call. */
void peer_cpu_release(const peer_cpu_link *link, int s);

/* Before a buffer is freed: waits (at most timeout_ms) until every rank has released what this rank wrote into it in
 * call seq, its last write into this buffer. Returns -1 when done, else the rank that did not. */
int peer_cpu_wait_released(void *local, int world, int64_t seq, int64_t timeout_ms);

/* FP8 quantization of one 1x128 block (deepep's CUDA kernels do the same float math): q[i] = e4m3(v[i] * scale) with
 * scale = 448 / amax (1 when amax is 0 or not finite); returns 1 / scale, the factor the receiver multiplies by. */
float peer_fp8_quantize_block(const float *v, uint8_t *q);

/*
 * A dispatch-like call: every token row of x (dtype x_dtype, [T,H]) goes once to each rank holding one of its
 * experts, with its copies' rows and probs; the receiver writes the row into every copy's row of out ([num_recv,H],
 * out_dtype == x_dtype unless fp8) and the prob into out_probs. probs/out_probs may be NULL (combine_backward).
 * fp8: the row travels as E4M3 with one scale per 128 elements and is dequantized into out.
 * Returns 0, 1 + the rank that stalled (link->error says which wait), or -1 out of host memory (link->error).
 */
int peer_cpu_dispatch(const peer_cpu_link *link, const peer_cpu_route *route, int64_t hidden, bool fp8, const void *x,
                      moert_dtype x_dtype, const void *probs, moert_dtype probs_dtype, void *out, moert_dtype out_dtype,
                      void *out_probs, moert_dtype out_probs_dtype);

/*
 * A combine-like call: the expert rank sums, for each token row it received from rank s, the rows of that token's
 * copies in rows ([num_recv,H], rows_dtype), in k order (fp32, fp64 for fp64 rows), rounds the partial to rows_dtype
 * and sends it back; the token's rank sums its partials in rank order into out[t] (overwrite, 0 for a token without
 * kept copies; accumulate: added to out's value, untouched without copies). row_probs ([num_recv]) / out_probs
 * ([T,K], 0 for dropped copies) carry the prob gradients back when not NULL. Returns as peer_cpu_dispatch.
 */
int peer_cpu_combine(const peer_cpu_link *link, const peer_cpu_route *route, int64_t hidden, const void *rows,
                     moert_dtype rows_dtype, const void *row_probs, moert_dtype row_probs_dtype, void *out,
                     moert_dtype out_dtype, bool accumulate, void *out_probs, moert_dtype out_probs_dtype);

#endif
