/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The harness of the dispatcher tests that check a dispatcher against the "alltoall" dispatcher (whose own test checks
 * it against a reference): tests/unit/test_dispatch_allgather.c and test_dispatch_hierarchical.c. A case's routing
 * and data are made on the main thread; on each rank (a thread) both dispatchers run prepare, dispatch, combine,
 * combine_backward and dispatch_backward on the same inputs, each over its own communicator, and the outputs are
 * compared: the moves bit for bit, the sums as the test says. A test describes its dispatcher with a cross_plugin and
 * adds its own checks of a rank (the figures it reports).
 */
#ifndef MOERT_DISPATCH_CROSS_HARNESS_H
#define MOERT_DISPATCH_CROSS_HARNESS_H

#include <stdbool.h>
#include <stdint.h>

#include "test_util.h"

#define CROSS_MAX_WORLD 8

/* One comparison case; fields left 0 take the defaults of cross_run_case (H 6, E 8, K 2, T 11). */
typedef struct cross_case {
    const char *name;
    int world;
    int ranks_per_node;      /* nodes of this many ranks (hierarchical; 0: not used) */
    moert_dtype dtype;       /* rows */
    moert_dtype probs_dtype; /* topk_probs, recv_probs and their gradients */
    int64_t H, E, K, T;      /* T: rank 0's tokens; rank r has T + 3r unless same_T */
    bool same_T;
    double drop;       /* probability that a copy is dropped */
    bool hot;          /* every kept first copy goes to the last expert */
    bool avoid_rank0;  /* no copy goes to rank 0's experts (world > 1) */
    bool one_per_node; /* every token has at most one copy per node of ranks_per_node ranks */
    bool empty_rank0;  /* rank 0 has no tokens */
    bool no_probs;     /* dispatch without probs, dispatch_backward without prob gradients */
    bool bad_index;    /* rank 1's token 2, copy 1 names expert 99: every prepare() fails */
    uint64_t seed;
    const char *options; /* of the dispatcher under test (JSON; NULL: none) */
} cross_case;

/* One rank's inputs, made on the main thread. */
typedef struct cross_input {
    int64_t T;
    int32_t *idx;         /* [T*K] */
    void *probs;          /* [T*K] probs_dtype */
    void *x, *d_y, *d_x0; /* [T*H] dtype */
} cross_input;

/* The run of one case: its inputs and the two communicators. */
typedef struct cross_run {
    cross_case cs;
    cross_input in[CROSS_MAX_WORLD];
    moert_comm_group *comm_alltoall, *comm_other;
    const struct cross_plugin *plugin;
} cross_run;

/* The figures one dispatcher reported on one rank: the last value of each (bytes_sent: also the first), and how many
 * times some were reported. */
typedef struct cross_metrics {
    double recv_tokens, bytes_first, bytes_sent, dispatch_inter, dispatch_intra, combine_inter, combine_intra,
        routing_inter;
    int seen_recv, seen_bytes, seen_dispatch_inter, seen_combine_inter, seen_routing;
} cross_metrics;

/* What one dispatcher gave on one rank. */
typedef struct cross_output {
    int64_t num_recv, capacity, tokens_per_expert[64];
    void *recv_x, *recv_probs; /* [cap + 2] rows: the 2 past capacity must stay as they were */
    void *y, *d_y_expert, *d_x, *d_topk_probs;
    void *recv_again; /* a second dispatch of the step (second_dispatch), else NULL */
    cross_metrics m;
} cross_output;

/* What the harness needs to know of the dispatcher under test. */
typedef struct cross_plugin {
    const char *name;
    /* Dispatch twice in a step (a recompute, without probs): the second must give the same rows. */
    bool second_dispatch;
    /* Values of a sum (y or d_x, [T, H] of rank r) that differ from the alltoall dispatcher's. */
    int64_t (*sums_differ)(const cross_case *cs, const cross_input *in, const void *got, const void *want);
    /* The test's own checks of rank r after the comparison, or NULL. */
    void (*check_rank)(const cross_run *run, int r, const cross_output *out, const cross_output *alltoall);
} cross_plugin;

/* Values of dtype that differ: bit for bit (tol 0), or beyond tol relative to 1 + |want|. */
int64_t cross_values_differ(const void *got, const void *want, moert_dtype dtype, int64_t n, double tol);

/* The node of expert e in the case's layout (nodes of ranks_per_node ranks). */
int cross_node_of(const cross_case *cs, int64_t e);

/* Runs a case on its world of threads (defaults filled in) and returns whether every check passed. */
bool cross_run_case(const cross_plugin *plugin, cross_case cs);

#endif
