/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The "allgather" dispatcher at world 1, 2 and 4 (ranks as threads) against the "alltoall" dispatcher, whose own test
 * checks it against a reference written there: on the same routing and data, each rank runs both (each over its own
 * communicator) and compares layout, dispatch (rows and probs), combine, combine_backward and dispatch_backward.
 *
 * What must be bit for bit and why: dispatch and combine_backward move bytes, and d_topk_probs is one value per copy,
 * so all of those must be identical. y (combine) and d_x (dispatch_backward) are sums of a token's copies: the
 * alltoall dispatcher adds them in k order, the allgather dispatcher adds each rank's share first (a partial sum per
 * rank) and then the shares in rank order: a reduce-scatter. Both add in double and round once, so with fp32, bf16
 * or fp16 rows every sum here is exact in double and the results are identical bit for bit; with fp64 rows the two
 * orders may round differently in the last bits, and those are compared within 1e-14 relative.
 *
 * Also: the metrics, a second dispatch of a step (a recompute) giving the same bytes, a bad expert id on one rank
 * failing every rank's prepare(), and the bad calls at world 1 (the dispatcher harness's checks).
 */
#include <pthread.h>

#include "dispatch_test_harness.h"

#define MAX_WORLD 4

/* One comparison case; fields left 0 take the defaults of run_case (H 6, E 8, K 2, T 11). */
typedef struct cross_case {
    const char *name;
    int world;
    moert_dtype dtype;       /* rows */
    moert_dtype probs_dtype; /* topk_probs, recv_probs and their gradients */
    int64_t H, E, K, T;      /* T: rank 0's tokens; rank r has T + 3r unless same_T */
    bool same_T;
    double drop;             /* probability that a copy is dropped */
    bool hot;                /* every kept first copy goes to the last expert */
    bool avoid_rank0;        /* no copy goes to rank 0's experts (world > 1) */
    bool empty_rank0;        /* rank 0 has no tokens */
    bool no_probs;           /* dispatch without probs, dispatch_backward without prob gradients */
    bool bad_index;          /* rank 1's token 2, copy 1 names expert 99: every prepare() fails */
    uint64_t seed;
} cross_case;

/* One rank's inputs, made on the main thread. */
typedef struct rank_input {
    int64_t T;
    int32_t *idx;  /* [T*K] */
    void *probs;   /* [T*K] probs_dtype */
    void *x, *d_y, *d_x0; /* [T*H] dtype */
} rank_input;

/* The run of one case: its inputs and the two communicators. */
typedef struct cross_run {
    cross_case cs;
    rank_input in[MAX_WORLD];
    moert_comm_group *comm_alltoall, *comm_allgather;
} cross_run;

/* What one dispatcher gave on one rank. */
typedef struct dispatcher_output {
    int64_t num_recv, capacity, tokens_per_expert[64];
    void *recv_x, *recv_probs;            /* [cap + 2] rows: the 2 past capacity must stay as they were */
    void *y, *d_y_expert, *d_x, *d_topk_probs;
    void *recv_again;                     /* a second dispatch of the step */
    double metric_recv_tokens, metric_bytes_first, metric_bytes_sent; /* bytes_sent: of the first and last dispatch */
    int metric_recv_seen, metric_bytes_seen;
} dispatcher_output;

/* ---- an instance whose host collects the dispatch metrics ---- */

static void metric_sink(void *user, const char *name, double value, const char *unit)
{
    dispatcher_output *o = user;
    if (strcmp(name, "dispatch.recv_tokens") == 0 && strcmp(unit, "tokens") == 0) {
        o->metric_recv_tokens = value;
        o->metric_recv_seen++;
    }
    if (strcmp(name, "dispatch.bytes_sent") == 0 && strcmp(unit, "bytes") == 0) {
        if (!o->metric_bytes_seen) o->metric_bytes_first = value;
        o->metric_bytes_sent = value;
        o->metric_bytes_seen++;
    }
}

/* Loads dispatcher `name` and starts an instance with default options whose metrics go to `out`. */
static moert_result open_dispatcher(test_instance *ti, const char *name, const moert_layer_info *layer,
                                    moert_comm_group *comm, int rank, int world, dispatcher_output *out)
{
    memset(ti, 0, sizeof *ti);
    moert_result rc = moert_plugin_load(MOERT_KIND_DISPATCHER, name, &ti->plugin);
    if (rc != MOERT_OK) return rc;
    ti->options = json_object();
    ti->section = moert_section_create(ti->options, "$.dispatcher");
    moert_section_allow(ti->section, "plugin");
    moert_host_setup setup = {.who = name, .options = ti->section, .comm = world > 1 ? comm : NULL, .rank = rank,
                              .world_size = world, .device = layer->device, .metric = metric_sink,
                              .metric_user = out};
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

/* topk_idx of one rank: K distinct experts per token, some dropped, as the case says. */
static void make_routing(const cross_case *cs, int r, int32_t *idx, int64_t T, uint64_t *rng)
{
    const int64_t K = cs->K, E = cs->E, El = E / cs->world;
    const int64_t first = cs->avoid_rank0 && cs->world > 1 ? El : 0;
    for (int64_t t = 0; t < T; t++) {
        int32_t *row = idx + t * K;
        for (int64_t k = 0; k < K; k++) {
            bool fresh;
            do {
                row[k] = (int32_t)(first + (int64_t)((test_uniform(rng) + 1.0) * 0.5 * (double)(E - first)));
                fresh = true;
                for (int64_t j = 0; j < k; j++) fresh = fresh && row[j] != row[k];
            } while (!fresh);
        }
        if (cs->hot) { /* the first copy to the last expert, the others dropped */
            row[0] = (int32_t)(E - 1);
            for (int64_t k = 1; k < K; k++) row[k] = -1;
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

/* Inputs that depend on the capacity, made once per rank from its own seed so both dispatchers get the same. */
typedef struct capacity_inputs {
    void *y_expert, *d_recv_x, *d_recv_probs;
} capacity_inputs;

/* prepare, dispatch (twice), combine, combine_backward, dispatch_backward; the outputs into `out`. Returns whether
 * prepare() succeeded (the later calls must then succeed too). */
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
    out->recv_again = malloc((size_t)(cap + 2) * H * es);
    out->recv_probs = malloc((size_t)(cap + 2) * ps);
    memset(out->recv_x, 0x5a, (size_t)(cap + 2) * H * es);
    memset(out->recv_again, 0x5a, (size_t)(cap + 2) * H * es);
    memset(out->recv_probs, 0x5a, (size_t)(cap + 2) * ps);
    moert_tensor x = moert_tensor_2d(in->x, cpu, cs->dtype, T, H);
    moert_tensor probs = moert_tensor_2d(in->probs, cpu, cs->probs_dtype, T, K);
    moert_tensor rx = moert_tensor_2d(out->recv_x, cpu, cs->dtype, cap + 2, H);
    moert_tensor rp = moert_tensor_1d(out->recv_probs, cpu, cs->probs_dtype, cap + 2);
    moert_dispatch_args da = {.struct_size = sizeof da, .x = &x, .topk_probs = cs->no_probs ? NULL : &probs,
                              .recv_x = &rx, .recv_probs = cs->no_probs ? NULL : &rp};
    EXPECT_CALL_OK(ti, vt->dispatch(ti->ctx, NULL, &da));
    moert_tensor rx2 = moert_tensor_2d(out->recv_again, cpu, cs->dtype, cap + 2, H);
    moert_dispatch_args da2 = {.struct_size = sizeof da2, .x = &x, .recv_x = &rx2};
    EXPECT_CALL_OK(ti, vt->dispatch(ti->ctx, NULL, &da2));

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
    moert_dispatch_backward_args db = {.struct_size = sizeof db, .d_recv_x = &drx,
                                       .d_recv_probs = cs->no_probs ? NULL : &drp, .d_x = &dx,
                                       .d_topk_probs = cs->no_probs ? NULL : &dtp};
    EXPECT_CALL_OK(ti, vt->dispatch_backward(ti->ctx, NULL, &db));
    return true;
}

static void free_output(dispatcher_output *o)
{
    free(o->recv_x);
    free(o->recv_again);
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

/* Counts a failure naming the case, rank and what differs, when `bad` is not 0. */
static void expect_same(const cross_case *cs, int r, const char *what, int64_t bad)
{
    if (!bad) return;
    fprintf(stderr, "%s world %d rank %d: %s: %lld values differ from the alltoall dispatcher's\n", cs->name,
            cs->world, r, what, (long long)bad);
    test_failures++;
}

static void compare(const cross_case *cs, int r, const rank_input *in, const dispatcher_output *ag,
                    const dispatcher_output *a2a)
{
    const int64_t T = in->T, H = cs->H, K = cs->K, El = cs->E / cs->world, cap = a2a->capacity;
    /* the sums: exact in double for fp32, bf16 and fp16 rows; fp64 rows may round differently (see the top) */
    const double sum_tol = cs->dtype == MOERT_F64 ? 1e-14 : 0;
    EXPECT_EQ_INT(ag->num_recv, a2a->num_recv);
    for (int64_t l = 0; l < El; l++) EXPECT_EQ_INT(ag->tokens_per_expert[l], a2a->tokens_per_expert[l]);
    expect_same(cs, r, "recv_x", values_differ(ag->recv_x, a2a->recv_x, cs->dtype, (cap + 2) * H, 0));
    expect_same(cs, r, "recv_x of a second dispatch",
                values_differ(ag->recv_again, a2a->recv_x, cs->dtype, cap * H, 0));
    if (!cs->no_probs)
        expect_same(cs, r, "recv_probs", values_differ(ag->recv_probs, a2a->recv_probs, cs->probs_dtype, cap + 2, 0));
    expect_same(cs, r, "y (combine)", values_differ(ag->y, a2a->y, cs->dtype, T * H, sum_tol));
    expect_same(cs, r, "d_y_expert (combine_backward)",
                values_differ(ag->d_y_expert, a2a->d_y_expert, cs->dtype, cap * H, 0));
    expect_same(cs, r, "d_x (dispatch_backward)", values_differ(ag->d_x, a2a->d_x, cs->dtype, T * H, sum_tol));
    if (!cs->no_probs)
        expect_same(cs, r, "d_topk_probs (dispatch_backward)",
                    values_differ(ag->d_topk_probs, a2a->d_topk_probs, cs->probs_dtype, T * K, 0));
}

/* The metrics: the rows received, and the bytes sent by each dispatch: this rank's block of the largest T tokens
 * (rows, K probs as double unless there are none, K routing indices) to each other rank. */
static void check_metrics(const cross_case *cs, const dispatcher_output *ag, int64_t largest_T)
{
    const double row_bytes = (double)cs->H * (double)moert_dtype_size(cs->dtype);
    const double peers_tokens = (double)(cs->world - 1) * (double)largest_T;
    EXPECT_EQ_INT(ag->metric_recv_seen, 1);
    EXPECT_EQ_INT(ag->metric_recv_tokens, ag->num_recv);
    EXPECT_EQ_INT(ag->metric_bytes_seen, 2);
    EXPECT_NEAR(ag->metric_bytes_first, peers_tokens * (row_bytes + (double)cs->K * ((cs->no_probs ? 0 : 8) + 4)), 0,
                0);
    EXPECT_NEAR(ag->metric_bytes_sent, peers_tokens * (row_bytes + 4.0 * (double)cs->K), 0, 0); /* no probs */
}

/* The largest T of the case, for the bytes_sent figure. */
static int64_t largest_T(const cross_run *run)
{
    int64_t m = 0;
    for (int r = 0; r < run->cs.world; r++) m = run->in[r].T > m ? run->in[r].T : m;
    return m;
}

/* One rank: both dispatchers on the same inputs, compared. */
static void run_rank(int r, void *user)
{
    cross_run *run = user;
    const cross_case *cs = &run->cs;
    const rank_input *in = &run->in[r];
    const int64_t H = cs->H;
    moert_layer_info layer = test_layer(H, 16, cs->E, cs->K, in->T, cs->world, r, cs->dtype);
    dispatcher_output a2a, ag;
    memset(&a2a, 0, sizeof a2a);
    memset(&ag, 0, sizeof ag);
    test_instance ti_a2a, ti_ag;
    moert_result rc_a2a = open_dispatcher(&ti_a2a, "alltoall", &layer, run->comm_alltoall, r, cs->world, &a2a);
    moert_result rc_ag = open_dispatcher(&ti_ag, "allgather", &layer, run->comm_allgather, r, cs->world, &ag);
    if (rc_a2a != MOERT_OK || rc_ag != MOERT_OK) {
        fprintf(stderr, "%s rank %d: open failed: %s\n", cs->name, r, moert_error_message());
        test_failures++;
        goto exit;
    }

    if (cs->bad_index) { /* every rank's prepare() fails: rank 1 naming the entry, the others naming rank 1 */
        const moert_dispatcher_v1 *vt = (const moert_dispatcher_v1 *)ti_ag.plugin.header;
        moert_tensor idx = moert_tensor_2d(in->idx, moert_cpu(), MOERT_I32, in->T, cs->K);
        moert_dispatch_layout layout = {.struct_size = sizeof layout};
        const char *needle = r == 1 ? "prepare(): topk_idx[2][1] is 99, expected an expert id in [0, 8) or -1 (dropped)"
                                    : "prepare(): rank 1 failed its prepare() (see its error)";
        EXPECT_CALL_FAILS(&ti_ag, vt->prepare(ti_ag.ctx, NULL, &idx, &layout), MOERT_ERR_INVALID_ARGUMENT, needle);
        goto exit;
    }

    /* the capacity comes from the alltoall dispatcher's prepare(); the allgather dispatcher must give the same */
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

    a2a.metric_recv_seen = a2a.metric_bytes_seen = 0;
    bool ok_a2a = run_dispatcher(&ti_a2a, cs, in, cap, &ci, &a2a);
    bool ok_ag = run_dispatcher(&ti_ag, cs, in, cap, &ci, &ag);
    if (ok_a2a && ok_ag) {
        compare(cs, r, in, &ag, &a2a);
        check_metrics(cs, &ag, largest_T(run));
    }
    free(ci.y_expert);
    free(ci.d_recv_x);
    free(ci.d_recv_probs);
exit:
    free_output(&a2a);
    free_output(&ag);
    test_instance_close(&ti_a2a);
    test_instance_close(&ti_ag);
}

static void run_case(cross_case cs)
{
    int failures_before = test_failures;
    if (!cs.H) cs.H = 6;
    if (!cs.E) cs.E = 8;
    if (!cs.K) cs.K = 2;
    if (!cs.T) cs.T = 11;
    if (!cs.seed) cs.seed = 4321 + (uint64_t)cs.world;
    cross_run run;
    memset(&run, 0, sizeof run);
    run.cs = cs;
    make_inputs(&run);
    if (cs.world > 1 && (moert_comm_group_create(cs.world, 30.0, &run.comm_alltoall) != MOERT_OK ||
                         moert_comm_group_create(cs.world, 30.0, &run.comm_allgather) != MOERT_OK)) {
        fprintf(stderr, "%s: comm group: %s\n", cs.name, moert_error_message());
        test_failures++;
    } else {
        test_run_ranks(cs.world, run_rank, &run);
    }
    if (run.comm_alltoall) moert_comm_group_free(run.comm_alltoall);
    if (run.comm_allgather) moert_comm_group_free(run.comm_allgather);
    free_inputs(&run);
    fprintf(stderr, "%-44s world %d: %s\n", cs.name, cs.world, test_failures == failures_before ? "ok" : "FAILED");
}

/* ---- bad calls at world 1: the dispatcher harness's checks ---- */

static const dispatch_test_plugin allgather = {.name = "allgather",
                                               .peer_buffers = false,
                                               .check_layout = dispatch_check_compact_layout,
                                               .fp8_round_trip = NULL,
                                               .error_capacity = 5,
                                               .combine_needs_dispatch = false,
                                               .check_after_prepare = NULL};

int main(void)
{
    const int worlds[3] = {1, 2, 4};
    for (int w = 0; w < 3; w++) {
        const int W = worlds[w];
        run_case((cross_case){.name = "random fp64", .world = W, .dtype = MOERT_F64, .probs_dtype = MOERT_F64,
                              .drop = 0.15});
        run_case((cross_case){.name = "random fp32, fp32 probs", .world = W, .dtype = MOERT_F32,
                              .probs_dtype = MOERT_F32, .drop = 0.15, .K = 4, .H = 9, .seed = 77});
        run_case((cross_case){.name = "random bf16 (bit-exact)", .world = W, .dtype = MOERT_BF16,
                              .probs_dtype = MOERT_F32, .drop = 0.1, .H = 8, .E = 16, .K = 3});
        run_case((cross_case){.name = "random fp16", .world = W, .dtype = MOERT_F16, .probs_dtype = MOERT_F64,
                              .drop = 0.1, .same_T = true});
        run_case((cross_case){.name = "hot expert, fp32", .world = W, .dtype = MOERT_F32, .probs_dtype = MOERT_F64,
                              .hot = true, .T = 20});
        run_case((cross_case){.name = "most copies dropped, fp32", .world = W, .dtype = MOERT_F32,
                              .probs_dtype = MOERT_F32, .drop = 0.8});
        run_case((cross_case){.name = "no probs, bf16", .world = W, .dtype = MOERT_BF16, .probs_dtype = MOERT_F32,
                              .drop = 0.1, .no_probs = true});
        run_case((cross_case){.name = "K=1, E=4, fp32", .world = W, .dtype = MOERT_F32, .probs_dtype = MOERT_F32,
                              .E = 4, .K = 1, .seed = 99});
        if (W == 1) continue;
        run_case((cross_case){.name = "rank 0 has no tokens, fp32", .world = W, .dtype = MOERT_F32,
                              .probs_dtype = MOERT_F32, .drop = 0.1, .empty_rank0 = true});
        run_case((cross_case){.name = "rank 0 receives nothing, fp64", .world = W, .dtype = MOERT_F64,
                              .probs_dtype = MOERT_F64, .drop = 0.1, .avoid_rank0 = true});
        run_case((cross_case){.name = "bad expert id on rank 1", .world = W, .dtype = MOERT_F64,
                              .probs_dtype = MOERT_F64, .bad_index = true});
    }
    static const char *const no_bad_options[1][2] = {{"", ""}};
    dispatch_check_errors(&allgather, no_bad_options, 0);
    return test_finish("test_dispatch_allgather");
}
