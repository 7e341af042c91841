/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The "hierarchical" dispatcher at world 1, 2, 4 and 8 (ranks as threads) in nodes of every size that divides the
 * world, against the "alltoall" dispatcher (whose own test checks it against a reference written there): on the same
 * routing and data each rank runs both, each over its own communicator, and compares layout, dispatch (rows and
 * probs), combine, combine_backward and dispatch_backward.
 *
 * What must be bit for bit and why: dispatch and combine_backward move bytes, and d_topk_probs is one value per copy,
 * so those are identical. y (combine) and d_x (dispatch_backward) are sums of a token's copies: the alltoall
 * dispatcher adds them in k order in double and rounds once; the hierarchical one adds the copies that went to one
 * node first (in double), rounds that partial to the row dtype (it is the one row per token and node that crosses
 * back, as on a real link), and adds the nodes' partials in double at the token's rank. Where a token has at most one
 * copy on every node, each partial is a copy's row as it is and the results are identical bit for bit for fp32, bf16
 * and fp16 rows (their sums are exact in double); fp64 rows may round differently in the last bits (another order:
 * within 1e-14 relative). Where a token has several copies on one node, the partial's rounding shows: within a few
 * units in the last place of the row dtype (fp32 1e-6, fp16 4e-3, bf16 3e-2 relative to 1 + |value|).
 *
 * The figures: bytes between nodes and inside nodes of dispatch and combine, and the routing ids of prepare(), each
 * against the count worked out here from the routing; the bytes that cross between nodes are compared with what the
 * alltoall dispatcher sends between the same nodes (a row and a prob per copy): never more, and fewer whenever a
 * token has two or more copies on one remote node.
 *
 * Also: ranks_per_node that does not divide the world (refused at init, naming the divisors), a bad expert id on one
 * rank failing every rank's prepare(), and the bad calls at world 1 (the dispatcher harness's checks). The runs and
 * the comparison with the alltoall dispatcher are tests/common/dispatch_cross_harness.c's.
 */
#include <pthread.h>

#include "dispatch_cross_harness.h"
#include "dispatch_test_harness.h"

/* ---- the comparison ---- */

/* Whether token t of a rank has two or more kept copies on one node (its partial sum is rounded on the way). */
static bool token_shares_node(const cross_case *cs, const int32_t *idx, int64_t t)
{
    for (int64_t k = 0; k < cs->K; k++)
        for (int64_t j = 0; j < k; j++) {
            int32_t a = idx[t * cs->K + j], b = idx[t * cs->K + k];
            if (a >= 0 && b >= 0 && cross_node_of(cs, a) == cross_node_of(cs, b)) return true;
        }
    return false;
}

/* Rows of a sum (y or d_x) that differ: bit for bit where the token has at most one copy per node and the rows are
 * not fp64, else within the tolerance the top of the file explains. */
static int64_t sums_differ(const cross_case *cs, const cross_input *in, const void *got, const void *want)
{
    const size_t es = moert_dtype_size(cs->dtype);
    const double rounded_tol = cs->dtype == MOERT_F64   ? 1e-14
                               : cs->dtype == MOERT_F32 ? 1e-6
                               : cs->dtype == MOERT_F16 ? 4e-3
                                                        : 3e-2;
    int64_t bad = 0;
    for (int64_t t = 0; t < in->T; t++) {
        bool rounded = token_shares_node(cs, in->idx, t);
        double tol = rounded ? rounded_tol : cs->dtype == MOERT_F64 ? 1e-14 : 0;
        bad += cross_values_differ((const char *)got + (size_t)(t * cs->H) * es,
                                   (const char *)want + (size_t)(t * cs->H) * es, cs->dtype, cs->H, tol);
    }
    return bad;
}

/* ---- the figures, worked out from every rank's routing ---- */

typedef struct expected_bytes {
    double dispatch_inter, dispatch_intra, combine_inter, combine_intra, routing_inter;
    double alltoall_inter; /* what the alltoall dispatcher sends between the same nodes: a row and a prob per copy */
    bool several_on_remote_node; /* some token of this rank has two or more copies on one remote node */
} expected_bytes;

/* The figures of rank r: every copy (t, k) of source s = (n, l) to expert e owned by q = (m, l') crosses between
 * nodes once per (token, m) when m != n, with its prob, to the forwarder f = (m, l); inside node m it goes from f to
 * q when l' != l. Combine sends the same rows back (one row per token and node between nodes). */
static expected_bytes work_out_bytes(const cross_run *run, int r)
{
    const cross_case *cs = &run->cs;
    const int R = cs->ranks_per_node;
    const int64_t K = cs->K, El = cs->E / cs->world;
    const double row = (double)cs->H * (double)moert_dtype_size(cs->dtype), prob = cs->no_probs ? 0 : 8;
    expected_bytes b;
    memset(&b, 0, sizeof b);
    for (int s = 0; s < cs->world; s++) {
        const cross_input *in = &run->in[s];
        const int sn = s / R, sl = s % R;
        for (int64_t t = 0; t < in->T; t++) {
            int copies_on_node[CROSS_MAX_WORLD] = {0};
            for (int64_t k = 0; k < K; k++) {
                int32_t e = in->idx[t * K + k];
                if (e < 0) continue;
                const int q = (int)(e / El), m = q / R, ql = q % R;
                copies_on_node[m]++;
                if (s == r && m != sn) {
                    b.dispatch_inter += prob;
                    b.alltoall_inter += row + prob;
                }
                const int f = m * R + sl; /* the forwarder */
                if (f == r && ql != sl) b.dispatch_intra += row + prob;
                if (q == r && ql != sl) b.combine_intra += row;
            }
            for (int m = 0; m < cs->world / R; m++) {
                if (!copies_on_node[m] || m == sn) continue;
                if (s == r) {
                    b.dispatch_inter += row;
                    b.routing_inter += (double)K * 4;
                    if (copies_on_node[m] >= 2) b.several_on_remote_node = true;
                }
                if (m * R + sl == r) b.combine_inter += row; /* the forwarder sends the partial back */
            }
        }
    }
    return b;
}

static void check_metrics(const cross_case *cs, int r, const cross_output *hi, const expected_bytes *b)
{
    EXPECT_EQ_INT(hi->m.seen_dispatch_inter, 1);
    EXPECT_EQ_INT(hi->m.seen_combine_inter, 1);
    EXPECT_EQ_INT(hi->m.seen_routing, 1);
    EXPECT_NEAR(hi->m.recv_tokens, (double)hi->num_recv, 0, 0);
    EXPECT_NEAR(hi->m.dispatch_inter, b->dispatch_inter, 0, 0);
    EXPECT_NEAR(hi->m.dispatch_intra, b->dispatch_intra, 0, 0);
    EXPECT_NEAR(hi->m.bytes_sent, b->dispatch_inter + b->dispatch_intra, 0, 0);
    EXPECT_NEAR(hi->m.combine_inter, b->combine_inter, 0, 0);
    EXPECT_NEAR(hi->m.combine_intra, b->combine_intra, 0, 0);
    EXPECT_NEAR(hi->m.routing_inter, b->routing_inter, 0, 0);
    /* never more between nodes than the alltoall dispatcher; fewer when a token has several copies on a remote node */
    if (!(hi->m.dispatch_inter <= b->alltoall_inter) ||
        (b->several_on_remote_node && !(hi->m.dispatch_inter < b->alltoall_inter))) {
        fprintf(stderr, "%s rank %d: %.0f bytes between nodes, the alltoall dispatcher sends %.0f\n", cs->name, r,
                hi->m.dispatch_inter, b->alltoall_inter);
        test_failures++;
    }
}

/* Totals over the ranks of a case, for its line. */
static pthread_mutex_t totals_lock = PTHREAD_MUTEX_INITIALIZER;
static double total_hier_inter, total_a2a_inter;

/* The test's own checks of rank r: a routing with one copy per node has no rounded partial, and the figures. */
static void check_rank(const cross_run *run, int r, const cross_output *hi, const cross_output *a2a)
{
    const cross_case *cs = &run->cs;
    const cross_input *in = &run->in[r];
    (void)a2a;
    int64_t shared = 0;
    for (int64_t t = 0; t < in->T; t++) shared += token_shares_node(cs, in->idx, t);
    if (cs->one_per_node && shared) {
        fprintf(stderr, "%s: the routing put two copies of a token on one node\n", cs->name);
        test_failures++;
    }
    expected_bytes b = work_out_bytes(run, r);
    check_metrics(cs, r, hi, &b);
    pthread_mutex_lock(&totals_lock);
    total_hier_inter += hi->m.dispatch_inter;
    total_a2a_inter += b.alltoall_inter;
    pthread_mutex_unlock(&totals_lock);
}

static const cross_plugin hierarchical_cross = {
    .name = "hierarchical", .second_dispatch = false, .sums_differ = sums_differ, .check_rank = check_rank};

static void run_case(cross_case cs)
{
    if (!cs.ranks_per_node) cs.ranks_per_node = cs.world;
    if (!cs.seed) cs.seed = 4321 + (uint64_t)cs.world * 7 + (uint64_t)cs.ranks_per_node;
    char options[96];
    snprintf(options, sizeof options, "{\"ranks_per_node\": %d}", cs.ranks_per_node);
    cs.options = options;
    total_hier_inter = total_a2a_inter = 0;
    bool ok = cross_run_case(&hierarchical_cross, cs);
    fprintf(stderr, "%-40s world %d, %d per node: %s (dispatch bytes between nodes %.0f, alltoall %.0f)\n", cs.name,
            cs.world, cs.ranks_per_node, ok ? "ok" : "FAILED", total_hier_inter, total_a2a_inter);
}

/* Every case at one world and node size. */
static void run_cases(int W, int R)
{
    run_case((cross_case){.name = "random fp64",
                          .world = W,
                          .ranks_per_node = R,
                          .dtype = MOERT_F64,
                          .probs_dtype = MOERT_F64,
                          .drop = 0.15});
    run_case((cross_case){.name = "random fp32, K 4, fp32 probs",
                          .world = W,
                          .ranks_per_node = R,
                          .dtype = MOERT_F32,
                          .probs_dtype = MOERT_F32,
                          .drop = 0.15,
                          .K = 4,
                          .H = 9,
                          .E = 16,
                          .seed = 77});
    run_case((cross_case){.name = "random bf16, K 3",
                          .world = W,
                          .ranks_per_node = R,
                          .dtype = MOERT_BF16,
                          .probs_dtype = MOERT_F32,
                          .drop = 0.1,
                          .H = 8,
                          .E = 16,
                          .K = 3});
    run_case((cross_case){.name = "random fp16",
                          .world = W,
                          .ranks_per_node = R,
                          .dtype = MOERT_F16,
                          .probs_dtype = MOERT_F64,
                          .drop = 0.1,
                          .same_T = true});
    run_case((cross_case){.name = "one copy per node, fp32 (bit-exact)",
                          .world = W,
                          .ranks_per_node = R,
                          .dtype = MOERT_F32,
                          .probs_dtype = MOERT_F32,
                          .one_per_node = true,
                          .K = W / R < 3 ? W / R : 3,
                          .E = 16});
    run_case((cross_case){.name = "most copies dropped, bf16, no probs",
                          .world = W,
                          .ranks_per_node = R,
                          .dtype = MOERT_BF16,
                          .probs_dtype = MOERT_F32,
                          .drop = 0.8,
                          .no_probs = true});
    if (W == 1) return;
    run_case((cross_case){.name = "rank 0 has no tokens, fp32",
                          .world = W,
                          .ranks_per_node = R,
                          .dtype = MOERT_F32,
                          .probs_dtype = MOERT_F32,
                          .drop = 0.1,
                          .empty_rank0 = true});
    run_case((cross_case){.name = "bad expert id on rank 1",
                          .world = W,
                          .ranks_per_node = R,
                          .dtype = MOERT_F64,
                          .probs_dtype = MOERT_F64,
                          .bad_index = true});
}

/* ranks_per_node that does not divide the world is refused at init on every rank, naming the divisors. */
static void refuse_uneven_nodes(int rank, void *user)
{
    moert_comm_group *comm = user;
    moert_layer_info layer = test_layer(4, 8, 8, 2, 5, 4, rank, MOERT_F32);
    test_instance ti;
    moert_result rc = test_instance_open(&ti, MOERT_KIND_DISPATCHER, "hierarchical", "{\"ranks_per_node\": 3}", &layer,
                                         comm, rank, 4);
    const char *msg = moert_error_message(); /* init's message, prefixed by the loader */
    if (rc != MOERT_ERR_CONFIG ||
        !strstr(
            msg,
            "config error at $.dispatcher.ranks_per_node: 3 does not divide the expert-parallel world of 4 ranks") ||
        !strstr(msg, "expected one of 1, 2, 4")) {
        fprintf(stderr, "ranks_per_node 3 at world 4 gave %s: %s\n", moert_result_name(rc), msg);
        test_failures++;
    }
    test_instance_close(&ti);
}

static const dispatch_test_plugin hierarchical = {.name = "hierarchical",
                                                  .peer_buffers = false,
                                                  .check_layout = dispatch_check_compact_layout,
                                                  .fp8_round_trip = NULL,
                                                  .error_capacity = 5,
                                                  .combine_needs_dispatch = false,
                                                  .check_after_prepare = NULL};

int main(void)
{
    const int worlds[4] = {1, 2, 4, 8};
    for (int w = 0; w < 4; w++)
        for (int R = 1; R <= worlds[w]; R++)
            if (worlds[w] % R == 0) run_cases(worlds[w], R);
    moert_comm_group *comm = NULL;
    EXPECT_OK(moert_comm_group_create(4, 30.0, &comm));
    if (comm) test_run_ranks(4, refuse_uneven_nodes, comm);
    if (comm) moert_comm_group_free(comm);
    fprintf(stderr, "%-40s world 4: done\n", "ranks_per_node 3 refused");
    static const char *const bad_options[][2] = {{"{\"ranks_per_node\": 0}", "ranks_per_node"},
                                                 {"{\"ranks_per_node\": 2}", "does not divide"}};
    dispatch_check_errors(&hierarchical, bad_options, sizeof bad_options / sizeof bad_options[0]);
    return test_finish("test_dispatch_hierarchical");
}
