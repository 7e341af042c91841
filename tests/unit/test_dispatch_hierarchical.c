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
 * rank failing every rank's prepare(), and the bad calls at world 1 (the dispatcher harness's checks).
 */
#include <pthread.h>

#include "dispatch_test_harness.h"

#define MAX_WORLD 8

/* One comparison case; fields left 0 take the defaults of run_case (H 6, E 8, K 2, T 11). */
typedef struct cross_case {
    const char *name;
    int world, ranks_per_node;
    moert_dtype dtype;       /* rows */
    moert_dtype probs_dtype; /* topk_probs, recv_probs and their gradients */
    int64_t H, E, K, T;      /* T: rank 0's tokens; rank r has T + 3r unless same_T */
    bool same_T;
    double drop;       /* probability that a copy is dropped */
    bool one_per_node; /* every token has at most one copy per node (the sums bit for bit) */
    bool empty_rank0;  /* rank 0 has no tokens */
    bool no_probs;     /* dispatch without probs, dispatch_backward without prob gradients */
    bool bad_index;    /* rank 1's token 2, copy 1 names expert 99: every prepare() fails */
    uint64_t seed;
} cross_case;

/* One rank's inputs, made on the main thread. */
typedef struct rank_input {
    int64_t T;
    int32_t *idx;         /* [T*K] */
    void *probs;          /* [T*K] probs_dtype */
    void *x, *d_y, *d_x0; /* [T*H] dtype */
} rank_input;

/* The run of one case: its inputs and the two communicators. */
typedef struct cross_run {
    cross_case cs;
    rank_input in[MAX_WORLD];
    moert_comm_group *comm_alltoall, *comm_hier;
} cross_run;

/* The metrics one dispatcher reported on one rank (the last value of each). */
typedef struct metrics {
    double recv_tokens, bytes_sent, dispatch_inter, dispatch_intra, combine_inter, combine_intra, routing_inter;
    int seen_dispatch_inter, seen_combine_inter, seen_routing;
} metrics;

/* What one dispatcher gave on one rank. */
typedef struct dispatcher_output {
    int64_t num_recv, capacity, tokens_per_expert[64];
    void *recv_x, *recv_probs; /* [cap + 2] rows: the 2 past capacity must stay as they were */
    void *y, *d_y_expert, *d_x, *d_topk_probs;
    metrics m;
} dispatcher_output;

/* ---- an instance whose host collects the metrics ---- */

static void metric_sink(void *user, const char *name, double value, const char *unit)
{
    metrics *m = user;
    if (strcmp(unit, "bytes") == 0 && strcmp(name, "dispatch.bytes_internode") == 0) {
        m->dispatch_inter = value;
        m->seen_dispatch_inter++;
    }
    if (strcmp(name, "dispatch.bytes_intranode") == 0) m->dispatch_intra = value;
    if (strcmp(name, "dispatch.bytes_sent") == 0) m->bytes_sent = value;
    if (strcmp(name, "combine.bytes_internode") == 0) {
        m->combine_inter = value;
        m->seen_combine_inter++;
    }
    if (strcmp(name, "combine.bytes_intranode") == 0) m->combine_intra = value;
    if (strcmp(name, "dispatch.recv_tokens") == 0) m->recv_tokens = value;
    if (strcmp(name, "prepare.routing_bytes_internode") == 0) {
        m->routing_inter = value;
        m->seen_routing++;
    }
}

/* Loads dispatcher `name` with `options` (JSON) and starts an instance whose metrics go to `m`. */
static moert_result open_dispatcher(test_instance *ti, const char *name, const char *options,
                                    const moert_layer_info *layer, moert_comm_group *comm, int rank, int world,
                                    metrics *m)
{
    memset(ti, 0, sizeof *ti);
    moert_result rc = moert_plugin_load(MOERT_KIND_DISPATCHER, name, &ti->plugin);
    if (rc != MOERT_OK) return rc;
    json_error_t err;
    ti->options = json_loads(options, 0, &err);
    if (!ti->options) return MOERT_ERR_CONFIG;
    ti->section = moert_section_create(ti->options, "$.dispatcher");
    moert_section_allow(ti->section, "plugin");
    moert_host_setup setup = {.who = name,
                              .options = ti->section,
                              .comm = world > 1 ? comm : NULL,
                              .rank = rank,
                              .world_size = world,
                              .device = layer->device,
                              .metric = metric_sink,
                              .metric_user = m};
    rc = moert_host_create(&setup, &ti->host);
    if (rc != MOERT_OK) return rc;
    rc = moert_plugin_init(&ti->plugin, &ti->ctx, ti->host, layer);
    if (rc != MOERT_OK) return rc;
    return moert_section_check_unknown(ti->section);
}

/* ---- inputs ---- */

static void fill_random(void *buf, moert_dtype dtype, int64_t n, uint64_t *rng)
{
    moert_tensor t = moert_tensor_1d(buf, moert_cpu(), dtype, n);
    for (int64_t i = 0; i < n; i++) moert_store(&t, i, test_uniform(rng));
}

static int64_t rank_tokens(const cross_case *cs, int r)
{
    if (cs->empty_rank0 && r == 0) return 0;
    return cs->same_T ? cs->T : cs->T + 3 * r;
}

/* The node of expert e in the case's layout. */
static int node_of(const cross_case *cs, int64_t e)
{
    const int64_t El = cs->E / cs->world;
    return (int)(e / (El * cs->ranks_per_node));
}

/* topk_idx of one rank: K distinct experts per token (with one_per_node: on distinct nodes), some dropped. */
static void make_routing(const cross_case *cs, int r, int32_t *idx, int64_t T, uint64_t *rng)
{
    const int64_t K = cs->K, E = cs->E;
    for (int64_t t = 0; t < T; t++) {
        int32_t *row = idx + t * K;
        for (int64_t k = 0; k < K; k++) {
            bool fresh;
            do {
                row[k] = (int32_t)((int64_t)((test_uniform(rng) + 1.0) * 0.5 * (double)E) % E);
                fresh = true;
                for (int64_t j = 0; j < k; j++)
                    fresh =
                        fresh && row[j] != row[k] && (!cs->one_per_node || node_of(cs, row[j]) != node_of(cs, row[k]));
            } while (!fresh);
        }
        for (int64_t k = 0; k < K; k++)
            if ((test_uniform(rng) + 1.0) * 0.5 < cs->drop) row[k] = -1;
    }
    if (cs->bad_index && r == 1 && T > 2) idx[2 * K + 1] = 99;
}

static void make_inputs(cross_run *run)
{
    cross_case *cs = &run->cs;
    uint64_t rng = cs->seed;
    for (int r = 0; r < cs->world; r++) {
        rank_input *in = &run->in[r];
        in->T = rank_tokens(cs, r);
        const int64_t n = in->T * cs->H, copies = in->T * cs->K;
        in->idx = calloc((size_t)copies + 1, sizeof(int32_t));
        in->probs = calloc((size_t)copies + 1, 8);
        in->x = calloc((size_t)n + 1, 8);
        in->d_y = calloc((size_t)n + 1, 8);
        in->d_x0 = calloc((size_t)n + 1, 8);
        make_routing(cs, r, in->idx, in->T, &rng);
        fill_random(in->probs, cs->probs_dtype, copies, &rng);
        fill_random(in->x, cs->dtype, n, &rng);
        fill_random(in->d_y, cs->dtype, n, &rng);
        fill_random(in->d_x0, cs->dtype, n, &rng);
        if (n >= 2 && cs->dtype != MOERT_F64) { /* a -0 must cross unchanged */
            moert_tensor x = moert_tensor_1d(in->x, moert_cpu(), cs->dtype, n);
            moert_store(&x, 1, -0.0);
        }
    }
}

static void free_inputs(cross_run *run)
{
    for (int r = 0; r < run->cs.world; r++) {
        free(run->in[r].idx);
        free(run->in[r].probs);
        free(run->in[r].x);
        free(run->in[r].d_y);
        free(run->in[r].d_x0);
    }
}

/* ---- one dispatcher's step on one rank ---- */

/* Inputs that depend on the capacity, made once per rank so both dispatchers get the same. */
typedef struct capacity_inputs {
    void *y_expert, *d_recv_x, *d_recv_probs;
} capacity_inputs;

/* prepare, dispatch, combine, combine_backward, dispatch_backward; the outputs into `out`. */
static bool run_dispatcher(test_instance *ti, const cross_case *cs, const rank_input *in, int64_t expect_cap,
                           const capacity_inputs *ci, dispatcher_output *out)
{
    const moert_dispatcher_v1 *vt = (const moert_dispatcher_v1 *)ti->plugin.header;
    const moert_device cpu = moert_cpu();
    const int64_t T = in->T, H = cs->H, K = cs->K, El = cs->E / cs->world;
    const size_t es = moert_dtype_size(cs->dtype), ps = moert_dtype_size(cs->probs_dtype);
    moert_tensor idx = moert_tensor_2d(in->idx, cpu, MOERT_I32, T, K);
    moert_dispatch_layout layout = {.struct_size = sizeof layout};
    EXPECT_CALL_OK(ti, vt->prepare(ti->ctx, NULL, &idx, &layout));
    out->num_recv = layout.num_recv;
    out->capacity = layout.capacity;
    for (int64_t l = 0; l < El && layout.tokens_per_expert_host; l++)
        out->tokens_per_expert[l] = layout.tokens_per_expert_host[l];
    if (layout.capacity != expect_cap) {
        fprintf(stderr, "%s: capacity %lld, expected %lld\n", cs->name, (long long)layout.capacity,
                (long long)expect_cap);
        test_failures++;
        return false;
    }
    const int64_t cap = expect_cap;
    out->recv_x = malloc((size_t)(cap + 2) * H * es);
    out->recv_probs = malloc((size_t)(cap + 2) * ps);
    memset(out->recv_x, 0x5a, (size_t)(cap + 2) * H * es);
    memset(out->recv_probs, 0x5a, (size_t)(cap + 2) * ps);
    moert_tensor x = moert_tensor_2d(in->x, cpu, cs->dtype, T, H);
    moert_tensor probs = moert_tensor_2d(in->probs, cpu, cs->probs_dtype, T, K);
    moert_tensor rx = moert_tensor_2d(out->recv_x, cpu, cs->dtype, cap + 2, H);
    moert_tensor rp = moert_tensor_1d(out->recv_probs, cpu, cs->probs_dtype, cap + 2);
    moert_dispatch_args da = {.struct_size = sizeof da,
                              .x = &x,
                              .topk_probs = cs->no_probs ? NULL : &probs,
                              .recv_x = &rx,
                              .recv_probs = cs->no_probs ? NULL : &rp};
    EXPECT_CALL_OK(ti, vt->dispatch(ti->ctx, NULL, &da));

    out->y = malloc((size_t)(T * H + 1) * es);
    memset(out->y, 0x5a, (size_t)(T * H + 1) * es); /* overwritten */
    moert_tensor ye = moert_tensor_2d(ci->y_expert, cpu, cs->dtype, cap, H);
    moert_tensor y = moert_tensor_2d(out->y, cpu, cs->dtype, T, H);
    moert_combine_args ca = {.struct_size = sizeof ca, .y_expert = &ye, .y = &y};
    EXPECT_CALL_OK(ti, vt->combine(ti->ctx, NULL, &ca));

    out->d_y_expert = malloc((size_t)(cap * H + 1) * es);
    memset(out->d_y_expert, 0x5a, (size_t)(cap * H + 1) * es);
    moert_tensor dy = moert_tensor_2d(in->d_y, cpu, cs->dtype, T, H);
    moert_tensor dye = moert_tensor_2d(out->d_y_expert, cpu, cs->dtype, cap, H);
    moert_combine_backward_args cb = {.struct_size = sizeof cb, .d_y = &dy, .d_y_expert = &dye};
    EXPECT_CALL_OK(ti, vt->combine_backward(ti->ctx, NULL, &cb));

    out->d_x = malloc((size_t)(T * H + 1) * es);
    memcpy(out->d_x, in->d_x0, (size_t)(T * H) * es); /* accumulated into */
    out->d_topk_probs = malloc((size_t)(T * K + 1) * ps);
    memset(out->d_topk_probs, 0x5a, (size_t)(T * K + 1) * ps); /* overwritten */
    moert_tensor drx = moert_tensor_2d(ci->d_recv_x, cpu, cs->dtype, cap, H);
    moert_tensor drp = moert_tensor_1d(ci->d_recv_probs, cpu, cs->probs_dtype, cap);
    moert_tensor dx = moert_tensor_2d(out->d_x, cpu, cs->dtype, T, H);
    moert_tensor dtp = moert_tensor_2d(out->d_topk_probs, cpu, cs->probs_dtype, T, K);
    moert_dispatch_backward_args db = {.struct_size = sizeof db,
                                       .d_recv_x = &drx,
                                       .d_recv_probs = cs->no_probs ? NULL : &drp,
                                       .d_x = &dx,
                                       .d_topk_probs = cs->no_probs ? NULL : &dtp};
    EXPECT_CALL_OK(ti, vt->dispatch_backward(ti->ctx, NULL, &db));
    return true;
}

static void free_output(dispatcher_output *o)
{
    free(o->recv_x);
    free(o->recv_probs);
    free(o->y);
    free(o->d_y_expert);
    free(o->d_x);
    free(o->d_topk_probs);
}

/* ---- the comparison ---- */

/* Values of dtype that differ: bit for bit (tol 0), or beyond tol relative to 1 + |want|. */
static int64_t values_differ(const void *got, const void *want, moert_dtype dtype, int64_t n, double tol)
{
    if (tol == 0) {
        const size_t es = moert_dtype_size(dtype);
        int64_t bad = 0;
        for (int64_t i = 0; i < n; i++)
            bad += memcmp((const char *)got + (size_t)i * es, (const char *)want + (size_t)i * es, es) != 0;
        return bad;
    }
    moert_tensor g = moert_tensor_1d((void *)got, moert_cpu(), dtype, n);
    moert_tensor w = moert_tensor_1d((void *)want, moert_cpu(), dtype, n);
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        double a = moert_load(&g, i), b = moert_load(&w, i);
        bad += !(fabs(a - b) <= tol * (1.0 + fabs(b)));
    }
    return bad;
}

/* Whether token t of a rank has two or more kept copies on one node (its partial sum is rounded on the way). */
static bool token_shares_node(const cross_case *cs, const int32_t *idx, int64_t t)
{
    for (int64_t k = 0; k < cs->K; k++)
        for (int64_t j = 0; j < k; j++) {
            int32_t a = idx[t * cs->K + j], b = idx[t * cs->K + k];
            if (a >= 0 && b >= 0 && node_of(cs, a) == node_of(cs, b)) return true;
        }
    return false;
}

/* Rows of a sum (y or d_x) that differ: bit for bit where the token has at most one copy per node and the rows are
 * not fp64, else within the tolerance the top of the file explains. *shared counts the tokens of the second kind. */
static int64_t sums_differ(const cross_case *cs, const rank_input *in, const void *got, const void *want,
                           int64_t *shared)
{
    const size_t es = moert_dtype_size(cs->dtype);
    const double rounded_tol = cs->dtype == MOERT_F64   ? 1e-14
                               : cs->dtype == MOERT_F32 ? 1e-6
                               : cs->dtype == MOERT_F16 ? 4e-3
                                                        : 3e-2;
    int64_t bad = 0;
    for (int64_t t = 0; t < in->T; t++) {
        bool rounded = token_shares_node(cs, in->idx, t);
        *shared += rounded;
        double tol = rounded ? rounded_tol : cs->dtype == MOERT_F64 ? 1e-14 : 0;
        bad += values_differ((const char *)got + (size_t)(t * cs->H) * es,
                             (const char *)want + (size_t)(t * cs->H) * es, cs->dtype, cs->H, tol);
    }
    return bad;
}

/* Counts a failure naming the case, rank and what differs, when `bad` is not 0. */
static void expect_same(const cross_case *cs, int r, const char *what, int64_t bad)
{
    if (!bad) return;
    fprintf(stderr, "%s world %d ranks_per_node %d rank %d: %s: %lld values differ from the alltoall dispatcher's\n",
            cs->name, cs->world, cs->ranks_per_node, r, what, (long long)bad);
    test_failures++;
}

static void compare(const cross_case *cs, int r, const rank_input *in, const dispatcher_output *hi,
                    const dispatcher_output *a2a)
{
    const int64_t T = in->T, H = cs->H, K = cs->K, El = cs->E / cs->world, cap = a2a->capacity;
    EXPECT_EQ_INT(hi->num_recv, a2a->num_recv);
    for (int64_t l = 0; l < El; l++) EXPECT_EQ_INT(hi->tokens_per_expert[l], a2a->tokens_per_expert[l]);
    expect_same(cs, r, "recv_x", values_differ(hi->recv_x, a2a->recv_x, cs->dtype, (cap + 2) * H, 0));
    if (!cs->no_probs)
        expect_same(cs, r, "recv_probs", values_differ(hi->recv_probs, a2a->recv_probs, cs->probs_dtype, cap + 2, 0));
    int64_t shared = 0;
    expect_same(cs, r, "y (combine)", sums_differ(cs, in, hi->y, a2a->y, &shared));
    expect_same(cs, r, "d_y_expert (combine_backward)",
                values_differ(hi->d_y_expert, a2a->d_y_expert, cs->dtype, cap * H, 0));
    expect_same(cs, r, "d_x (dispatch_backward)", sums_differ(cs, in, hi->d_x, a2a->d_x, &shared));
    if (!cs->no_probs)
        expect_same(cs, r, "d_topk_probs (dispatch_backward)",
                    values_differ(hi->d_topk_probs, a2a->d_topk_probs, cs->probs_dtype, T * K, 0));
    if (cs->one_per_node && shared) {
        fprintf(stderr, "%s: the routing put two copies of a token on one node\n", cs->name);
        test_failures++;
    }
    (void)T;
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
        const rank_input *in = &run->in[s];
        const int sn = s / R, sl = s % R;
        for (int64_t t = 0; t < in->T; t++) {
            int copies_on_node[MAX_WORLD] = {0};
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

static void check_metrics(const cross_case *cs, int r, const dispatcher_output *hi, const expected_bytes *b)
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

/* One rank: both dispatchers on the same inputs, compared. */
static void run_rank(int r, void *user)
{
    cross_run *run = user;
    const cross_case *cs = &run->cs;
    const rank_input *in = &run->in[r];
    const int64_t H = cs->H;
    moert_layer_info layer = test_layer(H, 16, cs->E, cs->K, in->T, cs->world, r, cs->dtype);
    dispatcher_output a2a, hi;
    memset(&a2a, 0, sizeof a2a);
    memset(&hi, 0, sizeof hi);
    char options[96];
    snprintf(options, sizeof options, "{\"ranks_per_node\": %d}", cs->ranks_per_node);
    test_instance ti_a2a, ti_hi;
    moert_result rc_a2a = open_dispatcher(&ti_a2a, "alltoall", "{}", &layer, run->comm_alltoall, r, cs->world, &a2a.m);
    moert_result rc_hi = open_dispatcher(&ti_hi, "hierarchical", options, &layer, run->comm_hier, r, cs->world, &hi.m);
    if (rc_a2a != MOERT_OK || rc_hi != MOERT_OK) {
        fprintf(stderr, "%s rank %d: open failed: %s %s\n", cs->name, r, moert_error_message(),
                ti_hi.host ? moert_host_take_error(ti_hi.host) : "");
        test_failures++;
        goto exit;
    }

    if (cs->bad_index) { /* every rank's prepare() fails: rank 1 naming the entry, the others naming rank 1 */
        const moert_dispatcher_v1 *vt = (const moert_dispatcher_v1 *)ti_hi.plugin.header;
        moert_tensor idx = moert_tensor_2d(in->idx, moert_cpu(), MOERT_I32, in->T, cs->K);
        moert_dispatch_layout layout = {.struct_size = sizeof layout};
        const char *needle = r == 1 ? "prepare(): topk_idx[2][1] is 99, expected an expert id in [0, 8) or -1 (dropped)"
                                    : "prepare(): rank 1 failed its prepare() (see its error)";
        EXPECT_CALL_FAILS(&ti_hi, vt->prepare(ti_hi.ctx, NULL, &idx, &layout), MOERT_ERR_INVALID_ARGUMENT, needle);
        goto exit;
    }

    const moert_dispatcher_v1 *vt_a2a = (const moert_dispatcher_v1 *)ti_a2a.plugin.header;
    moert_tensor idx = moert_tensor_2d(in->idx, moert_cpu(), MOERT_I32, in->T, cs->K);
    moert_dispatch_layout probe = {.struct_size = sizeof probe};
    EXPECT_CALL_OK(&ti_a2a, vt_a2a->prepare(ti_a2a.ctx, NULL, &idx, &probe));
    const int64_t cap = probe.capacity;
    uint64_t rng = cs->seed * 977 + (uint64_t)r + 1;
    const size_t es = moert_dtype_size(cs->dtype), ps = moert_dtype_size(cs->probs_dtype);
    capacity_inputs ci = {.y_expert = calloc((size_t)(cap * H + 1), es),
                          .d_recv_x = calloc((size_t)(cap * H + 1), es),
                          .d_recv_probs = calloc((size_t)cap + 1, ps)};
    fill_random(ci.y_expert, cs->dtype, cap * H, &rng);
    fill_random(ci.d_recv_x, cs->dtype, cap * H, &rng);
    fill_random(ci.d_recv_probs, cs->probs_dtype, cap, &rng);

    bool ok_a2a = run_dispatcher(&ti_a2a, cs, in, cap, &ci, &a2a);
    bool ok_hi = run_dispatcher(&ti_hi, cs, in, cap, &ci, &hi);
    if (ok_a2a && ok_hi) {
        compare(cs, r, in, &hi, &a2a);
        expected_bytes b = work_out_bytes(run, r);
        check_metrics(cs, r, &hi, &b);
        pthread_mutex_lock(&totals_lock);
        total_hier_inter += hi.m.dispatch_inter;
        total_a2a_inter += b.alltoall_inter;
        pthread_mutex_unlock(&totals_lock);
    }
    free(ci.y_expert);
    free(ci.d_recv_x);
    free(ci.d_recv_probs);
exit:
    free_output(&a2a);
    free_output(&hi);
    test_instance_close(&ti_a2a);
    test_instance_close(&ti_hi);
}

static void run_case(cross_case cs)
{
    int failures_before = test_failures;
    if (!cs.H) cs.H = 6;
    if (!cs.E) cs.E = 8;
    if (!cs.K) cs.K = 2;
    if (!cs.T) cs.T = 11;
    if (!cs.ranks_per_node) cs.ranks_per_node = cs.world;
    if (!cs.seed) cs.seed = 4321 + (uint64_t)cs.world * 7 + (uint64_t)cs.ranks_per_node;
    cross_run run;
    memset(&run, 0, sizeof run);
    run.cs = cs;
    total_hier_inter = total_a2a_inter = 0;
    make_inputs(&run);
    if (cs.world > 1 && (moert_comm_group_create(cs.world, 30.0, &run.comm_alltoall) != MOERT_OK ||
                         moert_comm_group_create(cs.world, 30.0, &run.comm_hier) != MOERT_OK)) {
        fprintf(stderr, "%s: comm group: %s\n", cs.name, moert_error_message());
        test_failures++;
    } else {
        test_run_ranks(cs.world, run_rank, &run);
    }
    if (run.comm_alltoall) moert_comm_group_free(run.comm_alltoall);
    if (run.comm_hier) moert_comm_group_free(run.comm_hier);
    free_inputs(&run);
    fprintf(stderr, "%-40s world %d, %d per node: %s (dispatch bytes between nodes %.0f, alltoall %.0f)\n", cs.name,
            cs.world, cs.ranks_per_node, test_failures == failures_before ? "ok" : "FAILED", total_hier_inter,
            total_a2a_inter);
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
    metrics m;
    memset(&m, 0, sizeof m);
    test_instance ti;
    moert_result rc = open_dispatcher(&ti, "hierarchical", "{\"ranks_per_node\": 3}", &layer, comm, rank, 4, &m);
    const char *msg = moert_error_message(); /* init's message, prefixed by the loader */
    if (rc != MOERT_ERR_CONFIG ||
        !strstr(msg, "ranks_per_node 3 does not divide the expert-parallel world of 4 ranks") ||
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
