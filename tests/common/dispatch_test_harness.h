/* SPDX-License-Identifier: Apache-2.0 */
/* The harness shared by the dispatcher tests (tests/unit/test_dispatch_*.c): a scenario of simulated ranks
 * (threads) with routing and data made on the main thread, a reference of what each rank must receive written
 * independently of any plugin, one rank's full round of checks (prepare, dispatch, combine, the backward calls and
 * their adjoint identities, metrics), and the world-1 fixture of the bad-call checks. A test describes its
 * dispatcher with a dispatch_test_plugin and keeps its own scenarios and plugin-specific checks. */
#ifndef MOERT_DISPATCH_TEST_HARNESS_H
#define MOERT_DISPATCH_TEST_HARNESS_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include "test_util.h"

#define DISPATCH_MAX_WORLD 4

/* A plugin call that must succeed; prints the plugin's message otherwise. */
#define EXPECT_CALL_OK(ti, call)                                                                                       \
    do {                                                                                                               \
        moert_result _r = (call);                                                                                      \
        if (_r != MOERT_OK) {                                                                                          \
            fprintf(stderr, "%s:%d: %s failed (%s): %s\n", __FILE__, __LINE__, #call, moert_result_name(_r),           \
                    moert_host_take_error((ti)->host));                                                                \
            test_failures++;                                                                                           \
        }                                                                                                              \
    } while (0)

/* A plugin call that must fail with `code` and a message containing `needle`. */
#define EXPECT_CALL_FAILS(ti, call, code, needle)                                                                      \
    do {                                                                                                               \
        moert_result _r = (call);                                                                                      \
        const char *_m = moert_host_take_error((ti)->host);                                                            \
        if (_r != (code) || !strstr(_m, (needle))) {                                                                   \
            fprintf(stderr, "%s:%d: %s gave %s \"%s\", expected %s with \"%s\"\n", __FILE__, __LINE__, #call,          \
                    moert_result_name(_r), _m, moert_result_name(code), (needle));                                     \
            test_failures++;                                                                                           \
        }                                                                                                              \
    } while (0)

typedef enum dispatch_routing {
    ROUTE_RANDOM,       /* K distinct experts per token, some copies dropped */
    ROUTE_HOT,          /* every token's first copy to the last expert, the others dropped */
    ROUTE_AVOID_RANK0,  /* no copy goes to rank 0's experts: rank 0 receives nothing */
    ROUTE_SOME_DROPPED, /* random, and every third token has all its copies dropped */
    ROUTE_CAPPED,       /* random, copies beyond ceil(T*K/E*cf) per expert and source rank dropped */
    ROUTE_BAD_INDEX,    /* rank 1's token 2, copy 1, names expert 99 */
} dispatch_routing;

/* One rank's input, made on the main thread so that every rank's reference sees all of it. */
typedef struct dispatch_rank_data {
    int64_t T;
    int32_t *idx;  /* [T*K] */
    double *probs; /* [T*K], 0 for dropped copies; normalised over the kept copies */
    void *x;       /* [T*H] in the scenario's dtype */
} dispatch_rank_data;

/* Figures a rank reports back to the main thread. */
typedef struct dispatch_rank_result {
    double combine_lhs, combine_rhs; /* <combine(a), b>, <a, combine_backward(b)> */
    double rows_lhs, rows_rhs;       /* <dispatch(x).rows, r_x>, <x, dispatch_backward(r).d_x> */
    double probs_lhs, probs_rhs;     /* <dispatch(x).probs, r_p>, <probs, dispatch_backward(r).d_probs> */
    double metric_recv_tokens, metric_bytes_sent;
    int metric_recv_seen, metric_bytes_seen;
} dispatch_rank_result;

struct dispatch_test_plugin;
struct dispatch_error_fixture;

/* One case: its shape, routing and options, and what the ranks must see. Fields left 0 take the defaults of
 * dispatch_run_scenario (E 8, H 5, K 2, T 11, capacity_factor 1, a seed from the world). */
typedef struct dispatch_scenario {
    const char *name;
    int world;
    int64_t H, E, K, T; /* T: tokens of rank 0; rank r has T + 3r unless same_T */
    bool same_T;
    moert_dtype dtype; /* rows */
    moert_dtype probs_dtype;
    dispatch_routing routing;
    double capacity_factor; /* for ROUTE_CAPPED and the padded capacity */
    bool pad;               /* alltoall's pad_to_capacity: each local expert's group padded to its capacity */
    const char *options;
    bool fp8;                     /* deepep's dispatch_dtype fp8: rows arrive quantized and dequantized */
    bool small_buffer;            /* layer max_tokens below T: the peer buffers must grow, or prepare() refuse */
    bool stall;                   /* rank 1 never dispatches: rank 0 must time out naming it */
    bool stall_prepare;           /* rank 1 never calls prepare(): rank 0's notify must time out naming it */
    const char *prepare_error;    /* expected in every rank's prepare() message, or NULL */
    const char *prepare_error_r1; /* expected on rank 1 instead, or NULL */
    uint64_t seed;
    dispatch_rank_data rank[DISPATCH_MAX_WORLD];
    dispatch_rank_result result[DISPATCH_MAX_WORLD];
    moert_comm_group *comm;
    pthread_barrier_t barrier;                 /* the stall cases: peers keep their buffers until rank 0 has failed */
    const struct dispatch_test_plugin *plugin; /* set by dispatch_run_scenario */
} dispatch_scenario;

/* One row rank r must receive: copy k of token `token` of rank `source`. */
typedef struct dispatch_ref_row {
    int source;
    int64_t token, k;
} dispatch_ref_row;

/* What rank r must receive, in order, independent of the plugin. */
typedef struct dispatch_reference {
    int64_t expert_rows[64]; /* rows per local expert */
    int64_t group_rows[64];  /* rows per local expert in the buffers (padded) */
    int64_t group_start[64];
    int64_t num_recv, capacity;
    dispatch_ref_row *rows; /* [num_recv]: for each local expert, each source rank, tokens in order */
} dispatch_reference;

/* What the harness needs to know of the dispatcher under test. */
typedef struct dispatch_test_plugin {
    const char *name; /* the plugin's name, as "dispatcher": {"plugin": ...} gives it */
    /* Rows written into the peers' buffers (deepep, hybridep): a second dispatch of a step must give the same
     * bytes, and bytes_sent counts a row and a metadata entry per token and other rank holding one of its experts.
     * Otherwise (alltoall) one dispatch, and bytes_sent is exactly a row and a prob per copy sent to another rank. */
    bool peer_buffers;
    /* Checks the layout prepare() gave past num_recv (capacity, tokens_per_expert) against the reference and
     * returns the capacity to size the receive buffers with. */
    int64_t (*check_layout)(const dispatch_scenario *sc, int r, const moert_dispatch_layout *layout,
                            const dispatch_reference *ref);
    /* For scenarios with fp8: what a bf16 source row of H values must arrive as; NULL without an fp8 dispatch. */
    void (*fp8_round_trip)(const uint16_t *src, int64_t H, uint16_t *out);
    /* ---- the bad calls at world 1 (dispatch_check_errors) ---- */
    int64_t error_capacity;      /* the capacity prepare() gives there (5 rows received) */
    bool combine_needs_dispatch; /* combine() before this step's dispatch() is refused */
    /* Plugin-specific checks right after the first successful prepare() there, or NULL. */
    void (*check_after_prepare)(struct dispatch_error_fixture *f);
} dispatch_test_plugin;

/* check_layout for plugins whose groups are compact (or padded as the reference says) with a host copy of the
 * counts: capacity is the reference's, tokens_per_expert_host is tokens_per_expert's data. */
int64_t dispatch_check_compact_layout(const dispatch_scenario *sc, int r, const moert_dispatch_layout *layout,
                                      const dispatch_reference *ref);

/* Runs a scenario on its world of threads (every rank's checks) and checks the global adjoint identities; prints
 * a line with the scenario's name and whether it passed. */
void dispatch_run_scenario(const dispatch_test_plugin *plugin, dispatch_scenario sc);

/* The scenarios every dispatcher passes, at one world: random rows in fp64, fp32 (fp32 probabilities) and bf16
 * (bit-exact), a hot expert, tokens with every copy dropped, one expert per rank (K 1, E 4); above world 1 also a
 * rank without tokens, a rank that receives nothing and a bad expert id on rank 1 (its prepare() fails, naming the
 * index). A plugin's test adds its own scenarios after these. */
void dispatch_run_common_scenarios(const dispatch_test_plugin *plugin, int world);

/* ---- bad calls at world 1 (a failing rank in a larger world would leave its peers waiting) ---- */

/* What dispatch_check_errors works on (and a plugin's check_after_prepare gets): one instance at world 1 (H 4, E 4,
 * K 2, T 3, fp64, no options) with tensors for its calls. Its tensors and args point into it. */
typedef struct dispatch_error_fixture {
    const dispatch_test_plugin *plugin;
    moert_layer_info layer;
    test_instance ti;
    dispatch_rank_result metrics;
    const moert_dispatcher_v1 *vt;
    int64_t capacity; /* what prepare() gives for idx: rows of recv_x and recv_probs */
    double x[12], probs[6], recv_x[24], recv_probs[6], y[12];
    int32_t idx[6];                /* {0, 1, 2, -1, 3, 0}: 5 rows received */
    moert_tensor xt, pt, rxt, rpt; /* x [3, 4], probs [3, 2], recv_x [capacity, 4], recv_probs [capacity] */
    moert_tensor it, yt;           /* idx [3, 2], y [3, 4] */
    moert_dispatch_args da;        /* x, probs, recv_x, recv_probs */
    moert_combine_args ca;         /* recv_x as y_expert, y */
    moert_dispatch_layout layout;
} dispatch_error_fixture;

/* The bad calls at world 1, in order: dispatch() before prepare(); bad topk_idx (out of range, below -1, wrong
 * shape, wrong dtype) and a short layout struct refused by prepare(), then a good prepare() (5 rows received) and
 * the plugin's check_after_prepare; combine() before dispatch() (where combine_needs_dispatch); bad recv_x (too few
 * rows, wrong dtype), x of the wrong shape, recv_probs without topk_probs and x on a GPU refused by dispatch(), then a
 * good dispatch(); an int32 y_expert refused by combine() (then a good combine(), where combine_needs_dispatch).
 * Then each of `count` option texts, bad_options[i][0], refused at init with a message naming bad_options[i][1];
 * and init() refusing a layer on a GPU (a CPU path only) and E not divisible by the world. */
void dispatch_check_errors(const dispatch_test_plugin *plugin, const char *const bad_options[][2], size_t count);

#endif
