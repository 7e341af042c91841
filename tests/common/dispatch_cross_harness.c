/* SPDX-License-Identifier: Apache-2.0 */
/* The harness of the dispatcher tests against the "alltoall" dispatcher (see dispatch_cross_harness.h). */
#include "dispatch_cross_harness.h"

#include <pthread.h>

#include "dispatch_test_harness.h"

/* ---- an instance whose host collects the figures ---- */

static void metric_sink(void *user, const char *name, double value, const char *unit)
{
    cross_metrics *m = user;
    const bool bytes = strcmp(unit, "bytes") == 0;
    if (strcmp(name, "dispatch.recv_tokens") == 0 && strcmp(unit, "tokens") == 0) {
        m->recv_tokens = value;
        m->seen_recv++;
    }
    if (strcmp(name, "dispatch.bytes_sent") == 0 && bytes) {
        if (!m->seen_bytes) m->bytes_first = value;
        m->bytes_sent = value;
        m->seen_bytes++;
    }
    if (strcmp(name, "dispatch.bytes_internode") == 0 && bytes) {
        m->dispatch_inter = value;
        m->seen_dispatch_inter++;
    }
    if (strcmp(name, "dispatch.bytes_intranode") == 0 && bytes) m->dispatch_intra = value;
    if (strcmp(name, "combine.bytes_internode") == 0 && bytes) {
        m->combine_inter = value;
        m->seen_combine_inter++;
    }
    if (strcmp(name, "combine.bytes_intranode") == 0 && bytes) m->combine_intra = value;
    if (strcmp(name, "prepare.routing_bytes_internode") == 0 && bytes) {
        m->routing_inter = value;
        m->seen_routing++;
    }
}

/* Loads dispatcher `name` with `options` and starts an instance whose figures go to m. */
static moert_result open_dispatcher(test_instance *ti, const char *name, const char *options,
                                    const moert_layer_info *layer, moert_comm_group *comm, int rank, int world,
                                    cross_metrics *m)
{
    return test_instance_open_metrics(ti, MOERT_KIND_DISPATCHER, name, options ? options : "{}", layer,
                                      world > 1 ? comm : NULL, rank, world, NULL, NULL, NULL, metric_sink, m);
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

int cross_node_of(const cross_case *cs, int64_t e)
{
    const int64_t El = cs->E / cs->world;
    return (int)(e / (El * cs->ranks_per_node));
}

/* topk_idx of one rank: K distinct experts per token (with one_per_node: on distinct nodes), some dropped, as the
 * case says. */
static void make_routing(const cross_case *cs, int r, int32_t *idx, int64_t T, uint64_t *rng)
{
    const int64_t K = cs->K, E = cs->E, El = E / cs->world;
    const int64_t first = cs->avoid_rank0 && cs->world > 1 ? El : 0;
    for (int64_t t = 0; t < T; t++) {
        int32_t *row = idx + t * K;
        for (int64_t k = 0; k < K; k++) {
            bool fresh;
            do {
                row[k] =
                    (int32_t)(first + (int64_t)((test_uniform(rng) + 1.0) * 0.5 * (double)(E - first)) % (E - first));
                fresh = true;
                for (int64_t j = 0; j < k; j++)
                    fresh = fresh && row[j] != row[k] &&
                            (!cs->one_per_node || cross_node_of(cs, row[j]) != cross_node_of(cs, row[k]));
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
        cross_input *in = &run->in[r];
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

/* prepare, dispatch (twice with second_dispatch), combine, combine_backward, dispatch_backward; the outputs into
 * `out`. Returns whether prepare() gave the expected capacity (the later calls must then succeed too). */
static bool run_dispatcher(test_instance *ti, const cross_case *cs, const cross_input *in, int64_t expect_cap,
                           const capacity_inputs *ci, bool second_dispatch, cross_output *out)
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
    if (second_dispatch) {
        out->recv_again = malloc((size_t)(cap + 2) * H * es);
        memset(out->recv_again, 0x5a, (size_t)(cap + 2) * H * es);
        moert_tensor rx2 = moert_tensor_2d(out->recv_again, cpu, cs->dtype, cap + 2, H);
        moert_dispatch_args da2 = {.struct_size = sizeof da2, .x = &x, .recv_x = &rx2};
        EXPECT_CALL_OK(ti, vt->dispatch(ti->ctx, NULL, &da2));
    }

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

static void free_output(cross_output *o)
{
    void *p[] = {o->recv_x, o->recv_again, o->recv_probs, o->y, o->d_y_expert, o->d_x, o->d_topk_probs};
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++) free(p[i]);
}

/* ---- the comparison ---- */

int64_t cross_values_differ(const void *got, const void *want, moert_dtype dtype, int64_t n, double tol)
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
    if (cs->ranks_per_node)
        fprintf(stderr,
                "%s world %d ranks_per_node %d rank %d: %s: %lld values differ from the alltoall dispatcher's\n",
                cs->name, cs->world, cs->ranks_per_node, r, what, (long long)bad);
    else
        fprintf(stderr, "%s world %d rank %d: %s: %lld values differ from the alltoall dispatcher's\n", cs->name,
                cs->world, r, what, (long long)bad);
    test_failures++;
}

/* Rank r's outputs against the alltoall dispatcher's: the moves bit for bit, the sums as the plugin says. */
static void compare(const cross_plugin *p, const cross_case *cs, int r, const cross_input *in, const cross_output *o,
                    const cross_output *a2a)
{
    const int64_t T = in->T, H = cs->H, K = cs->K, El = cs->E / cs->world, cap = a2a->capacity;
    EXPECT_EQ_INT(o->num_recv, a2a->num_recv);
    for (int64_t l = 0; l < El; l++) EXPECT_EQ_INT(o->tokens_per_expert[l], a2a->tokens_per_expert[l]);
    expect_same(cs, r, "recv_x", cross_values_differ(o->recv_x, a2a->recv_x, cs->dtype, (cap + 2) * H, 0));
    if (o->recv_again)
        expect_same(cs, r, "recv_x of a second dispatch",
                    cross_values_differ(o->recv_again, a2a->recv_x, cs->dtype, cap * H, 0));
    if (!cs->no_probs)
        expect_same(cs, r, "recv_probs",
                    cross_values_differ(o->recv_probs, a2a->recv_probs, cs->probs_dtype, cap + 2, 0));
    expect_same(cs, r, "y (combine)", p->sums_differ(cs, in, o->y, a2a->y));
    expect_same(cs, r, "d_y_expert (combine_backward)",
                cross_values_differ(o->d_y_expert, a2a->d_y_expert, cs->dtype, cap * H, 0));
    expect_same(cs, r, "d_x (dispatch_backward)", p->sums_differ(cs, in, o->d_x, a2a->d_x));
    if (!cs->no_probs)
        expect_same(cs, r, "d_topk_probs (dispatch_backward)",
                    cross_values_differ(o->d_topk_probs, a2a->d_topk_probs, cs->probs_dtype, T * K, 0));
}

/* One rank: both dispatchers on the same inputs, compared. */
static void run_rank(int r, void *user)
{
    cross_run *run = user;
    const cross_plugin *p = run->plugin;
    const cross_case *cs = &run->cs;
    const cross_input *in = &run->in[r];
    const int64_t H = cs->H;
    moert_layer_info layer = test_layer(H, 16, cs->E, cs->K, in->T, cs->world, r, cs->dtype);
    cross_output a2a, other;
    memset(&a2a, 0, sizeof a2a);
    memset(&other, 0, sizeof other);
    test_instance ti_a2a, ti;
    moert_result rc_a2a = open_dispatcher(&ti_a2a, "alltoall", "{}", &layer, run->comm_alltoall, r, cs->world, &a2a.m);
    moert_result rc = open_dispatcher(&ti, p->name, cs->options, &layer, run->comm_other, r, cs->world, &other.m);
    if (rc_a2a != MOERT_OK || rc != MOERT_OK) {
        fprintf(stderr, "%s rank %d: open failed: %s %s\n", cs->name, r, moert_error_message(),
                ti.host ? moert_host_take_error(ti.host) : "");
        test_failures++;
        goto exit;
    }

    if (cs->bad_index) { /* every rank's prepare() fails: rank 1 naming the entry, the others naming rank 1 */
        const moert_dispatcher_v1 *vt = (const moert_dispatcher_v1 *)ti.plugin.header;
        moert_tensor idx = moert_tensor_2d(in->idx, moert_cpu(), MOERT_I32, in->T, cs->K);
        moert_dispatch_layout layout = {.struct_size = sizeof layout};
        const char *needle = r == 1 ? "prepare(): topk_idx[2][1] is 99, expected an expert id in [0, 8) or -1 (dropped)"
                                    : "prepare(): rank 1 failed its prepare() (see its error)";
        EXPECT_CALL_FAILS(&ti, vt->prepare(ti.ctx, NULL, &idx, &layout), MOERT_ERR_INVALID_ARGUMENT, needle);
        goto exit;
    }

    /* the capacity comes from the alltoall dispatcher's prepare(); the dispatcher under test must give the same */
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

    bool ok_a2a = run_dispatcher(&ti_a2a, cs, in, cap, &ci, false, &a2a);
    bool ok = run_dispatcher(&ti, cs, in, cap, &ci, p->second_dispatch, &other);
    if (ok_a2a && ok) {
        compare(p, cs, r, in, &other, &a2a);
        if (p->check_rank) p->check_rank(run, r, &other, &a2a);
    }
    free(ci.y_expert);
    free(ci.d_recv_x);
    free(ci.d_recv_probs);
exit:
    free_output(&a2a);
    free_output(&other);
    test_instance_close(&ti_a2a);
    test_instance_close(&ti);
}

bool cross_run_case(const cross_plugin *plugin, cross_case cs)
{
    int failures_before = test_failures;
    if (!cs.H) cs.H = 6;
    if (!cs.E) cs.E = 8;
    if (!cs.K) cs.K = 2;
    if (!cs.T) cs.T = 11;
    cross_run run;
    memset(&run, 0, sizeof run);
    run.cs = cs;
    run.plugin = plugin;
    make_inputs(&run);
    if (cs.world > 1 && (moert_comm_group_create(cs.world, 30.0, &run.comm_alltoall) != MOERT_OK ||
                         moert_comm_group_create(cs.world, 30.0, &run.comm_other) != MOERT_OK)) {
        fprintf(stderr, "%s: comm group: %s\n", cs.name, moert_error_message());
        test_failures++;
    } else {
        test_run_ranks(cs.world, run_rank, &run);
    }
    if (run.comm_alltoall) moert_comm_group_free(run.comm_alltoall);
    if (run.comm_other) moert_comm_group_free(run.comm_other);
    free_inputs(&run);
    return test_failures == failures_before;
}
