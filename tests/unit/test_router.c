/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The "topk" router plugin, forward values against hand-worked cases: every score function and mode,
 * the balancing losses, capacity and padding, input jitter, forced balance, the compute dtype, the expert-bias
 * update over two ranks, global_aux_loss over two ranks, and option errors. The router weight is the identity (H = E), so x is the logits and every case can be
 * written down directly.
 */
#include "test_util.h"

#include "error.h"

#define MAX_T 16
#define MAX_E 8
#define MAX_K 4

typedef struct router_case {
    test_instance ti;
    const moert_router_v1 *vt;
    int64_t E, K;
} router_case;

typedef struct route_out {
    int32_t idx[MAX_T * MAX_K];
    double probs[MAX_T * MAX_K];
    int64_t tokens_per_expert[MAX_E];
    moert_router_losses losses;
    char error[512];
} route_out;

/* Opens the router with JSON options for E experts, top-K, H = E; rank/world/comm for multi-rank cases. */
static moert_result open_router(router_case *c, const char *options, int64_t E, int64_t K, moert_comm_group *comm,
                                int rank, int world)
{
    memset(c, 0, sizeof *c);
    c->E = E;
    c->K = K;
    moert_layer_info layer = test_layer(E, 4, E, K, MAX_T, world, rank, MOERT_F64);
    moert_result rc = test_instance_open(&c->ti, MOERT_KIND_ROUTER, "topk", options, &layer, comm, rank, world);
    if (rc == MOERT_OK) c->vt = (const moert_router_v1 *)c->ti.plugin.header;
    return rc;
}

/* One forward with x = logits [T,E] and the identity weight; probs stored as `probs_dtype`. */
/* MOERT_ROUTER_FORWARD_* bits of the next route() calls (0: training forwards) */
static uint32_t route_flags;

static moert_result route(router_case *c, const double *logits, int64_t T, int64_t seq_length, moert_dtype probs_dtype,
                          route_out *out)
{
    int64_t E = c->E, K = c->K;
    double x[MAX_T * MAX_E], w[MAX_E * MAX_E];
    float x32[MAX_T * MAX_E], w32[MAX_E * MAX_E], probs32[MAX_T * MAX_K];
    memset(out, 0, sizeof *out);
    memcpy(x, logits, (size_t)(T * E) * sizeof(double));
    for (int64_t i = 0; i < E; i++)
        for (int64_t j = 0; j < E; j++) w[i * E + j] = i == j ? 1.0 : 0.0;
    for (int64_t i = 0; i < T * E; i++) x32[i] = (float)x[i];
    for (int64_t i = 0; i < E * E; i++) w32[i] = (float)w[i];
    bool f32 = probs_dtype == MOERT_F32;
    moert_tensor tx = moert_tensor_2d(f32 ? (void *)x32 : (void *)x, moert_cpu(), probs_dtype, T, E);
    moert_tensor tw = moert_tensor_2d(f32 ? (void *)w32 : (void *)w, moert_cpu(), probs_dtype, E, E);
    moert_tensor tidx = moert_tensor_2d(out->idx, moert_cpu(), MOERT_I32, T, K);
    moert_tensor tprobs = moert_tensor_2d(f32 ? (void *)probs32 : (void *)out->probs, moert_cpu(), probs_dtype, T, K);
    moert_tensor ttpe = moert_tensor_1d(out->tokens_per_expert, moert_cpu(), MOERT_I64, E);
    moert_router_forward_args args = {.struct_size = sizeof args,
                                      .x = &tx,
                                      .weight = &tw,
                                      .topk_idx = &tidx,
                                      .topk_probs = &tprobs,
                                      .tokens_per_expert = &ttpe,
                                      .losses = &out->losses,
                                      .seq_length = seq_length,
                                      .flags = route_flags};
    moert_result rc = c->vt->forward(c->ti.ctx, NULL, &args);
    if (rc != MOERT_OK) snprintf(out->error, sizeof out->error, "%s", moert_host_take_error(c->ti.host));
    if (f32)
        for (int64_t i = 0; i < T * K; i++) out->probs[i] = probs32[i];
    return rc;
}

static double sigmoid(double v) { return 1.0 / (1.0 + exp(-v)); }

/* Checks idx and probs of a route against the expected ones. */
static void expect_route(const char *what, const route_out *out, const int32_t *idx, const double *probs, int64_t n,
                         double tol)
{
    for (int64_t i = 0; i < n; i++) {
        if (out->idx[i] != idx[i]) {
            fprintf(stderr, "%s: idx[%lld] = %d, expected %d\n", what, (long long)i, out->idx[i], idx[i]);
            test_failures++;
        }
        if (!(fabs(out->probs[i] - probs[i]) <= tol * (1.0 + fabs(probs[i])))) {
            fprintf(stderr, "%s: probs[%lld] = %.12g, expected %.12g\n", what, (long long)i, out->probs[i], probs[i]);
            test_failures++;
        }
    }
}

static void expect_counts(const char *what, const route_out *out, const int64_t *counts, int64_t E)
{
    for (int64_t e = 0; e < E; e++) {
        if (out->tokens_per_expert[e] != counts[e]) {
            fprintf(stderr, "%s: tokens_per_expert[%lld] = %lld, expected %lld\n", what, (long long)e,
                    (long long)out->tokens_per_expert[e], (long long)counts[e]);
            test_failures++;
        }
    }
}

/* The logits of the softmax cases: row 1 has a tie between experts 0 and 1 (the lower index wins). */
static const double softmax_logits[2 * 4] = {1, 3, 2, 0, 0.5, 0.5, -1, 2};

static void test_softmax_post(moert_dtype dtype)
{
    router_case c;
    route_out out;
    EXPECT_OK(open_router(&c, "{}", 4, 2, NULL, 0, 1));
    if (!c.vt) return;
    EXPECT_OK(route(&c, softmax_logits, 2, 0, dtype, &out));
    /* softmax over the two selected logits: [3,2] and [2,0.5] */
    int32_t idx[] = {1, 2, 3, 0};
    double probs[] = {1 / (1 + exp(-1.0)), exp(-1.0) / (1 + exp(-1.0)), 1 / (1 + exp(-1.5)),
                      exp(-1.5) / (1 + exp(-1.5))};
    expect_route(dtype == MOERT_F32 ? "softmax post fp32" : "softmax post", &out, idx, probs, 4,
                 dtype == MOERT_F32 ? 1e-6 : 1e-14);
    int64_t counts[] = {1, 1, 1, 1};
    expect_counts("softmax post", &out, counts, 4);
    EXPECT_NEAR(out.losses.total, 0.0, 0, 0);
    EXPECT(c.vt->expert_bias(c.ti.ctx) == NULL);
    test_instance_close(&c.ti);
}

static void test_softmax_pre(void)
{
    router_case c;
    route_out out;
    EXPECT_OK(open_router(&c, "{\"pre_softmax\": true}", 4, 2, NULL, 0, 1));
    if (!c.vt) return;
    EXPECT_OK(route(&c, softmax_logits, 2, 0, MOERT_F64, &out));
    double z0 = exp(1) + exp(3) + exp(2) + exp(0), z1 = 2 * exp(0.5) + exp(-1) + exp(2);
    int32_t idx[] = {1, 2, 3, 0};
    double probs[] = {exp(3) / z0, exp(2) / z0, exp(2) / z1, exp(0.5) / z1};
    expect_route("softmax pre", &out, idx, probs, 4, 1e-14);
    test_instance_close(&c.ti);
}

static void test_scaling(void)
{
    router_case c;
    route_out out;
    EXPECT_OK(open_router(&c, "{\"scaling_factor\": 2.5}", 4, 2, NULL, 0, 1));
    if (!c.vt) return;
    EXPECT_OK(route(&c, softmax_logits, 2, 0, MOERT_F64, &out));
    int32_t idx[] = {1, 2, 3, 0};
    double probs[] = {2.5 / (1 + exp(-1.0)), 2.5 * exp(-1.0) / (1 + exp(-1.0)), 2.5 / (1 + exp(-1.5)),
                      2.5 * exp(-1.5) / (1 + exp(-1.5))};
    expect_route("scaling softmax", &out, idx, probs, 4, 1e-14);
    test_instance_close(&c.ti);

    /* sigmoid, top-1: no normalisation, only the scale */
    EXPECT_OK(open_router(&c, "{\"score_function\": \"sigmoid\", \"scaling_factor\": 2.5}", 4, 1, NULL, 0, 1));
    if (!c.vt) return;
    EXPECT_OK(route(&c, softmax_logits, 2, 0, MOERT_F64, &out));
    int32_t idx1[] = {1, 3};
    double probs1[] = {2.5 * sigmoid(3), 2.5 * sigmoid(2)};
    expect_route("scaling sigmoid top-1", &out, idx1, probs1, 2, 1e-14);
    test_instance_close(&c.ti);
}

/* Sigmoid with the expert bias: the bias, moved by end_step, changes the selection but not the probs. */
static void test_sigmoid_bias(void)
{
    router_case c;
    route_out out;
    EXPECT_OK(open_router(&c, "{\"score_function\": \"sigmoid\", \"expert_bias\": true, \"bias_update_rate\": 0.5}", 4,
                          2, NULL, 0, 1));
    if (!c.vt) return;
    const moert_tensor *bias = c.vt->expert_bias(c.ti.ctx);
    EXPECT(bias != NULL);
    if (!bias) return;
    EXPECT_EQ_INT(bias->shape[0], 4);
    for (int e = 0; e < 4; e++) EXPECT_NEAR(moert_load(bias, e), 0.0, 0, 0);

    double l1[] = {2, 1, 0, -1, 2, 1, -1, 0};
    EXPECT_OK(route(&c, l1, 2, 0, MOERT_F64, &out));
    double s = sigmoid(2) + sigmoid(1);
    int32_t idx1[] = {0, 1, 0, 1};
    double probs1[] = {sigmoid(2) / s, sigmoid(1) / s, sigmoid(2) / s, sigmoid(1) / s};
    expect_route("sigmoid", &out, idx1, probs1, 4, 1e-14);
    /* an inference forward (an evaluation between steps) is not counted: its tokens, all to experts 2 and 3, would
     * turn the update below around */
    double l_eval[] = {-1, 0, 2, 1, -1, 0, 2, 1, -1, 0, 2, 1};
    route_flags = MOERT_ROUTER_FORWARD_INFERENCE;
    EXPECT_OK(route(&c, l_eval, 3, 0, MOERT_F64, &out));
    route_flags = 0;
    int64_t eval_counts[] = {0, 0, 3, 3};
    expect_counts("sigmoid inference", &out, eval_counts, 4);

    /* counts [2,2,0,0], mean 1: bias -= 0.5 for experts 0,1 and += 0.5 for experts 2,3 */
    EXPECT_OK(c.vt->end_step(c.ti.ctx, NULL));
    double expect_bias[] = {-0.5, -0.5, 0.5, 0.5};
    for (int e = 0; e < 4; e++) EXPECT_NEAR(moert_load(bias, e), expect_bias[e], 1e-15, 0);

    /* without the bias this token would pick experts 0 and 1; with it, 2 and 3; probs stay unbiased */
    double l2[] = {0.3, 0.2, 0.1, -3};
    EXPECT_OK(route(&c, l2, 1, 0, MOERT_F64, &out));
    double s2 = sigmoid(0.1) + sigmoid(-3);
    int32_t idx2[] = {2, 3};
    double probs2[] = {sigmoid(0.1) / s2, sigmoid(-3) / s2};
    expect_route("sigmoid with bias", &out, idx2, probs2, 2, 1e-14);

    /* counts [0,0,1,1] -> mean 0.5: experts 0,1 gain, 2,3 lose */
    EXPECT_OK(c.vt->end_step(c.ti.ctx, NULL));
    for (int e = 0; e < 4; e++) EXPECT_NEAR(moert_load(bias, e), 0.0, 1e-15, 0);
    test_instance_close(&c.ti);
}

/* Group-limited top-k: 4 groups of 2 experts, 2 groups per token, top-4; the group score is the sum of
 * the best 2 (= topk/group_topk) scores of a group. */
static void test_group_topk(void)
{
    router_case c;
    route_out out;
    EXPECT_OK(open_router(&c, "{\"num_groups\": 4, \"group_topk\": 2}", 8, 4, NULL, 0, 1));
    if (!c.vt) return;
    /* group sums: g0 = 0, g1 = 6, g2 = -2, g3 = 0 -> g1 and (tie g0/g3) g0: experts 0..3 only.
     * Plain top-4 would be experts 0, 4, 2, 3. */
    double l[] = {5, -5, 3, 3, 4, -6, 0, 0};
    EXPECT_OK(route(&c, l, 1, 0, MOERT_F64, &out));
    double z = exp(5) + exp(3) + exp(3) + exp(-5);
    int32_t idx[] = {0, 2, 3, 1};
    double probs[] = {exp(5) / z, exp(3) / z, exp(3) / z, exp(-5) / z};
    expect_route("group top-k", &out, idx, probs, 4, 1e-14);
    test_instance_close(&c.ti);

    /* sigmoid + groups + scaling, DeepSeek-V3 style: 4 groups of 2, 2 groups, top-4; group scores (sums of
     * sigmoids) g0 .850, g1 1.401, g2 .768, g3 1.0 -> experts 2,3,6,7. Plain top-4 would be 0, 4, 2, 3. */
    EXPECT_OK(open_router(&c,
                          "{\"score_function\": \"sigmoid\", \"num_groups\": 4, \"group_topk\": 2, "
                          "\"scaling_factor\": 2.5}",
                          8, 4, NULL, 0, 1));
    if (!c.vt) return;
    double l2[] = {1, -2, 0.9, 0.8, 0.95, -3, 0, 0};
    EXPECT_OK(route(&c, l2, 1, 0, MOERT_F64, &out));
    double s = sigmoid(0.9) + sigmoid(0.8) + sigmoid(0) + sigmoid(0);
    int32_t idx2[] = {2, 3, 6, 7};
    double probs2[] = {2.5 * sigmoid(0.9) / s, 2.5 * sigmoid(0.8) / s, 2.5 * 0.5 / s, 2.5 * 0.5 / s};
    expect_route("group top-k sigmoid", &out, idx2, probs2, 4, 1e-14);
    test_instance_close(&c.ti);
}

/* Expected switch aux loss, written out: coeff*E/(K*T*T) * sum_e (sum_t P[t,e]) * count_e. */
static double expected_aux(const double *P, const double *counts, int64_t T, int64_t E, int64_t K, double coeff)
{
    double acc = 0;
    for (int64_t e = 0; e < E; e++) {
        double pe = 0;
        for (int64_t t = 0; t < T; t++) pe += P[t * E + e];
        acc += pe * counts[e];
    }
    return coeff * (double)E / ((double)K * (double)T * (double)T) * acc;
}

static void softmax_rows(const double *l, int64_t T, int64_t E, double *P)
{
    for (int64_t t = 0; t < T; t++) {
        double z = 0;
        for (int64_t e = 0; e < E; e++) z += exp(l[t * E + e]);
        for (int64_t e = 0; e < E; e++) P[t * E + e] = exp(l[t * E + e]) / z;
    }
}

/* Three tokens, 4 experts, top-2; plain top-2 picks {1,2}, {3,0}, {0,1}: counts [2,2,1,1]. */
static const double aux_logits[3 * 4] = {1, 3, 2, 0, 0.5, 0.4, -1, 2, 1.5, 1.2, 0.3, -0.2};

static void test_aux_loss(void)
{
    router_case c;
    route_out out;
    double P[12], counts[] = {2, 2, 1, 1};
    EXPECT_OK(open_router(&c, "{\"load_balancing\": \"aux_loss\", \"aux_loss_coeff\": 0.01}", 4, 2, NULL, 0, 1));
    if (!c.vt) return;
    EXPECT_OK(route(&c, aux_logits, 3, 0, MOERT_F64, &out));
    softmax_rows(aux_logits, 3, 4, P);
    double want = expected_aux(P, counts, 3, 4, 2, 0.01);
    EXPECT_NEAR(out.losses.aux_loss, want, 0, 1e-13);
    EXPECT_NEAR(out.losses.z_loss, 0.0, 0, 0);
    EXPECT_NEAR(out.losses.total, want, 0, 1e-13);
    /* a perfectly balanced router has aux loss = coeff; this one is a little above */
    EXPECT(want > 0.01 && want < 0.02);
    test_instance_close(&c.ti);

    /* sigmoid: P is the sigmoid normalised over all experts */
    EXPECT_OK(open_router(&c,
                          "{\"score_function\": \"sigmoid\", \"load_balancing\": \"aux_loss\", "
                          "\"aux_loss_coeff\": 0.01}",
                          4, 2, NULL, 0, 1));
    if (!c.vt) return;
    EXPECT_OK(route(&c, aux_logits, 3, 0, MOERT_F64, &out));
    for (int t = 0; t < 3; t++) {
        double s = 0;
        for (int e = 0; e < 4; e++) s += sigmoid(aux_logits[t * 4 + e]);
        for (int e = 0; e < 4; e++) P[t * 4 + e] = sigmoid(aux_logits[t * 4 + e]) / s;
    }
    EXPECT_NEAR(out.losses.aux_loss, expected_aux(P, counts, 3, 4, 2, 0.01), 0, 1e-13);
    test_instance_close(&c.ti);
}

static void test_seq_aux_loss(void)
{
    router_case c;
    route_out out;
    /* 4 tokens in 2 sequences of 2; plain top-2: {1,2},{3,0} | {0,1},{0,2} */
    double l[] = {1, 3, 2, 0, 0.5, 0.4, -1, 2, 1.5, 1.2, 0.3, -0.2, 2, -1, 1, 0};
    double P[16];
    softmax_rows(l, 4, 4, P);
    double counts[2][4] = {{1, 1, 1, 1}, {2, 1, 1, 0}};
    double coeff = 0.1;
    /* coeff * E/(K*S*S) / B * sum_b sum_e P_b,e * count_b,e with S = 2, B = 2 */
    double acc = 0;
    for (int b = 0; b < 2; b++)
        for (int e = 0; e < 4; e++) acc += (P[(2 * b) * 4 + e] + P[(2 * b + 1) * 4 + e]) * counts[b][e];
    double want = coeff * 4.0 / (2.0 * 2.0 * 2.0) / 2.0 * acc;

    EXPECT_OK(open_router(&c, "{\"load_balancing\": \"seq_aux_loss\", \"aux_loss_coeff\": 0.1}", 4, 2, NULL, 0, 1));
    if (!c.vt) return;
    EXPECT_OK(route(&c, l, 4, 2, MOERT_F64, &out));
    EXPECT_NEAR(out.losses.aux_loss, want, 0, 1e-13);
    EXPECT_NEAR(out.losses.total, want, 0, 1e-13);

    EXPECT(fabs(want - coeff) > 1e-3); /* unbalanced, so the value depends on P */

    /* seq_length 0 (one sequence) is the plain aux loss: counts [3,2,2,1] */
    EXPECT_OK(route(&c, l, 4, 0, MOERT_F64, &out));
    double all_counts[] = {3, 2, 2, 1};
    EXPECT_NEAR(out.losses.aux_loss, expected_aux(P, all_counts, 4, 4, 2, coeff), 0, 1e-13);

    /* a seq_length that does not divide the tokens */
    EXPECT_EQ_INT(route(&c, l, 4, 3, MOERT_F64, &out), MOERT_ERR_INVALID_ARGUMENT);
    if (!strstr(out.error, "seq_length 3 does not divide the 4 tokens")) {
        fprintf(stderr, "seq_length error: \"%s\"\n", out.error);
        test_failures++;
    }
    test_instance_close(&c.ti);
}

static void test_z_loss(void)
{
    router_case c;
    route_out out;
    EXPECT_OK(open_router(&c, "{\"z_loss_coeff\": 0.001, \"load_balancing\": \"aux_loss\", \"aux_loss_coeff\": 0.01}",
                          4, 2, NULL, 0, 1));
    if (!c.vt) return;
    EXPECT_OK(route(&c, aux_logits, 3, 0, MOERT_F64, &out));
    double acc = 0;
    for (int t = 0; t < 3; t++) {
        double z = 0;
        for (int e = 0; e < 4; e++) z += exp(aux_logits[t * 4 + e]);
        acc += log(z) * log(z);
    }
    double want_z = 0.001 * acc / 3.0;
    double P[12], counts[] = {2, 2, 1, 1};
    softmax_rows(aux_logits, 3, 4, P);
    double want_aux = expected_aux(P, counts, 3, 4, 2, 0.01);
    EXPECT_NEAR(out.losses.z_loss, want_z, 0, 1e-13);
    EXPECT_NEAR(out.losses.aux_loss, want_aux, 0, 1e-13);
    EXPECT_NEAR(out.losses.total, want_z + want_aux, 0, 1e-13);
    test_instance_close(&c.ti);
}

/* Megatron's sinkhorn, written independently for the test. */
static void sinkhorn_reference(const double *l, int T, int E, double *out)
{
    double d0[MAX_T], d1[MAX_E], old[MAX_E];
    for (int t = 0; t < T; t++) d0[t] = 1;
    for (int e = 0; e < E; e++) d1[e] = old[e] = 1;
    for (int it = 0; it < 100000; it++) {
        for (int t = 0; t < T; t++) {
            double s = 0;
            for (int e = 0; e < E; e++) s += d1[e] * exp(l[t * E + e]);
            d0[t] = 1.0 / T / (s + 1e-8);
        }
        double err = 0;
        for (int e = 0; e < E; e++) {
            double s = 0;
            for (int t = 0; t < T; t++) s += d0[t] * exp(l[t * E + e]);
            d1[e] = 1.0 / E / (s + 1e-8);
            err += fabs(d1[e] - old[e]);
            old[e] = d1[e];
        }
        if (err / E <= 1e-4) break;
    }
    for (int t = 0; t < T; t++)
        for (int e = 0; e < E; e++) out[t * E + e] = d1[e] * exp(l[t * E + e]) * d0[t];
}

/* MOERT_ROUTER_FORWARD_DEFER_LOSSES: the forward leaves losses unwritten, forward_losses gives the values a plain
 * forward returns; it refuses a call with no deferring forward before it. */
static void test_deferred_losses(void)
{
    router_case c;
    route_out plain, deferred;
    EXPECT_OK(open_router(&c, "{\"z_loss_coeff\": 0.001, \"load_balancing\": \"aux_loss\", \"aux_loss_coeff\": 0.01}",
                          4, 2, NULL, 0, 1));
    if (!c.vt) return;
    EXPECT(c.vt->header.struct_size >= offsetof(moert_router_v1, forward_losses) + sizeof c.vt->forward_losses);
    EXPECT(c.vt->forward_losses != NULL);
    EXPECT_OK(route(&c, aux_logits, 3, 0, MOERT_F64, &plain));
    moert_router_losses taken = {0};
    EXPECT_EQ_INT(c.vt->forward_losses(c.ti.ctx, &taken), MOERT_ERR_INVALID_ARGUMENT);
    const char *why = moert_host_take_error(c.ti.host);
    if (!strstr(why, "did not defer its losses")) {
        fprintf(stderr, "deferred losses: error \"%s\" lacks \"did not defer its losses\"\n", why);
        test_failures++;
    }
    route_flags = MOERT_ROUTER_FORWARD_DEFER_LOSSES;
    EXPECT_OK(route(&c, aux_logits, 3, 0, MOERT_F64, &deferred));
    route_flags = 0;
    EXPECT_NEAR(deferred.losses.total, 0.0, 0, 0); /* left as route() zeroed it */
    EXPECT_NEAR(deferred.losses.aux_loss, 0.0, 0, 0);
    EXPECT_OK(c.vt->forward_losses(c.ti.ctx, &taken));
    EXPECT(plain.losses.aux_loss > 0.0 && plain.losses.z_loss > 0.0);
    EXPECT_NEAR(taken.aux_loss, plain.losses.aux_loss, 0, 0);
    EXPECT_NEAR(taken.z_loss, plain.losses.z_loss, 0, 0);
    EXPECT_NEAR(taken.total, plain.losses.total, 0, 0);
    expect_route("deferred losses", &deferred, plain.idx, plain.probs, 3 * 2, 0);
    /* taken once */
    EXPECT_EQ_INT(c.vt->forward_losses(c.ti.ctx, &taken), MOERT_ERR_INVALID_ARGUMENT);
    moert_host_take_error(c.ti.host);
    test_instance_close(&c.ti);
}

static void test_sinkhorn(void)
{
    router_case c;
    route_out out;
    /* top-1, 2 tokens, 2 experts: both prefer expert 0, but the balanced matrix is
     * [[a, 1/2-a], [1/2-a, a]] with a = sqrt(e)/(2(1+sqrt(e))) ~ 0.311, so token 1 goes to expert 1.
     * Top-1 probs are the sigmoid of the selected logit. */
    EXPECT_OK(open_router(&c, "{\"load_balancing\": \"sinkhorn\"}", 2, 1, NULL, 0, 1));
    if (!c.vt) return;
    double l[] = {2, 0, 1, 0};
    EXPECT_OK(route(&c, l, 2, 0, MOERT_F64, &out));
    int32_t idx[] = {0, 1};
    double probs[] = {sigmoid(2), sigmoid(0)};
    expect_route("sinkhorn top-1", &out, idx, probs, 2, 1e-14);
    int64_t counts[] = {1, 1};
    expect_counts("sinkhorn top-1", &out, counts, 2);
    test_instance_close(&c.ti);

    /* top-2 of 4 experts, every token prefers experts 0 and 1; probs: softmax over all experts, not renormalised */
    EXPECT_OK(open_router(&c, "{\"load_balancing\": \"sinkhorn\"}", 4, 2, NULL, 0, 1));
    if (!c.vt) return;
    double l2[] = {3, 2.5, 0, 0.2, 2.8, 2.6, 0.3, 0.1, 3.1, 2.4, 0.5, 0.4, 2.9, 2.7, 0.2, 0.6};
    double sk[16], P[16];
    sinkhorn_reference(l2, 4, 4, sk);
    softmax_rows(l2, 4, 4, P);
    EXPECT_OK(route(&c, l2, 4, 0, MOERT_F64, &out));
    int differs = 0;
    for (int t = 0; t < 4; t++) {
        /* the reference's top-2 of the balanced scores */
        int a = 0;
        for (int e = 1; e < 4; e++)
            if (sk[t * 4 + e] > sk[t * 4 + a]) a = e;
        int b = a == 0 ? 1 : 0;
        for (int e = 0; e < 4; e++)
            if (e != a && sk[t * 4 + e] > sk[t * 4 + b]) b = e;
        EXPECT_EQ_INT(out.idx[t * 2], a);
        EXPECT_EQ_INT(out.idx[t * 2 + 1], b);
        EXPECT_NEAR(out.probs[t * 2], P[t * 4 + a], 0, 1e-13);
        EXPECT_NEAR(out.probs[t * 2 + 1], P[t * 4 + b], 0, 1e-13);
        if (!((a == 0 && b == 1) || (a == 1 && b == 0))) differs++;
    }
    EXPECT(differs > 0); /* plain top-2 is {0,1} for every token */
    test_instance_close(&c.ti);
}

/* Capacity: 4 tokens, 2 experts, top-1, factor 1 -> cap = ceil(4*1/2) = 2; all four tokens choose expert 0. */
static void test_capacity(void)
{
    router_case c;
    route_out out;
    double l[] = {3, 0, 1, 0, 2, 0, 0.5, 0};
    /* pre-softmax probs differ per token: sigmoid(l0 - l1) */
    double p[] = {sigmoid(3), sigmoid(1), sigmoid(2), sigmoid(0.5)};

    EXPECT_OK(open_router(&c, "{\"pre_softmax\": true, \"capacity_factor\": 1.0}", 2, 1, NULL, 0, 1));
    if (!c.vt) return;
    EXPECT_OK(route(&c, l, 4, 0, MOERT_F64, &out));
    int32_t idx[] = {0, -1, 0, -1}; /* the two highest probs: tokens 0 and 2 */
    double probs[] = {p[0], 0, p[2], 0};
    expect_route("capacity probs", &out, idx, probs, 4, 1e-14);
    int64_t counts[] = {2, 0};
    expect_counts("capacity probs", &out, counts, 2);
    test_instance_close(&c.ti);

    EXPECT_OK(open_router(&c, "{\"pre_softmax\": true, \"capacity_factor\": 1.0, \"drop_policy\": \"position\"}", 2, 1,
                          NULL, 0, 1));
    if (!c.vt) return;
    EXPECT_OK(route(&c, l, 4, 0, MOERT_F64, &out));
    int32_t idx2[] = {0, 0, -1, -1}; /* the earliest two */
    double probs2[] = {p[0], p[1], 0, 0};
    expect_route("capacity position", &out, idx2, probs2, 4, 1e-14);
    expect_counts("capacity position", &out, counts, 2);
    test_instance_close(&c.ti);

    /* top-2 of 4 experts, factor 0.5 -> cap = ceil(3*2/4*0.5) = 1; post-softmax probs of the kept copies
     * stay those of the full top-2 (dropped copies only become 0) */
    EXPECT_OK(open_router(&c, "{\"capacity_factor\": 0.5}", 4, 2, NULL, 0, 1));
    if (!c.vt) return;
    EXPECT_OK(route(&c, aux_logits, 3, 0, MOERT_F64, &out));
    /* selections {1,2}, {3,0}, {0,1}; expert 1: token 0 (p=.731) and token 2 (p=.426) -> keep token 0;
     * expert 0: token 1 (p=.182) and token 2 (p=.574) -> keep token 2; experts 2 and 3 have one copy each */
    double a = 1 / (1 + exp(-1.0)), b = 1 / (1 + exp(-1.5)), d = 1 / (1 + exp(-0.3));
    int32_t idx3[] = {1, 2, 3, -1, 0, -1};
    double probs3[] = {a, 1 - a, b, 0, d, 0};
    expect_route("capacity top-2", &out, idx3, probs3, 6, 1e-14);
    int64_t counts3[] = {1, 1, 1, 1};
    expect_counts("capacity top-2", &out, counts3, 4);
    test_instance_close(&c.ti);

    /* fewer copies (T*K = 2) than experts: cap = ceil(2*1/4 * 2) = 1; both tokens pick expert 1 and the
     * one with the higher prob (token 1) stays */
    EXPECT_OK(open_router(&c, "{\"pre_softmax\": true, \"capacity_factor\": 2.0}", 4, 1, NULL, 0, 1));
    if (!c.vt) return;
    double l4[] = {0, 1, 0, 0, 0, 2, 0, 0};
    EXPECT_OK(route(&c, l4, 2, 0, MOERT_F64, &out));
    int32_t idx4[] = {-1, 1};
    double probs4[] = {0, exp(2) / (exp(2) + 3)};
    expect_route("capacity, few copies", &out, idx4, probs4, 2, 1e-14);
    int64_t counts4[] = {0, 1, 0, 0};
    expect_counts("capacity, few copies", &out, counts4, 4);
    test_instance_close(&c.ti);
}

/* ---- padding, input jitter, forced balance, compute dtype ---- */

/* pad_to_capacity: the same routing as dropping, and every expert reports `cap` rows; the bias still follows the
 * copies really kept. */
static void test_pad_to_capacity(void)
{
    router_case c;
    route_out out;
    double l[] = {3, 0, 1, 0, 2, 0, 0.5, 0};
    double p[] = {sigmoid(3), sigmoid(1), sigmoid(2), sigmoid(0.5)};
    EXPECT_OK(open_router(&c, "{\"pre_softmax\": true, \"capacity_factor\": 1.0, \"pad_to_capacity\": true}", 2, 1,
                          NULL, 0, 1));
    if (!c.vt) return;
    EXPECT_OK(route(&c, l, 4, 0, MOERT_F64, &out));
    int32_t idx[] = {0, -1, 0, -1};
    double probs[] = {p[0], 0, p[2], 0};
    expect_route("pad probs", &out, idx, probs, 4, 1e-14);
    int64_t counts[] = {2, 2}; /* cap = 2 each: expert 1 holds two zero-weight padding rows */
    expect_counts("pad probs", &out, counts, 2);
    test_instance_close(&c.ti);

    /* position policy, top-2 of 4, factor 1.5: cap = ceil(3*2/4*1.5) = 3 for every expert */
    EXPECT_OK(open_router(&c, "{\"capacity_factor\": 1.5, \"drop_policy\": \"position\", \"pad_to_capacity\": true}", 4,
                          2, NULL, 0, 1));
    if (!c.vt) return;
    EXPECT_OK(route(&c, aux_logits, 3, 0, MOERT_F64, &out));
    int64_t counts2[] = {3, 3, 3, 3};
    expect_counts("pad position", &out, counts2, 4);
    for (int i = 0; i < 6; i++) EXPECT(out.idx[i] >= 0); /* nothing over capacity */
    test_instance_close(&c.ti);

    /* sigmoid + expert bias: 4 tokens all pick expert 0 (cap 2: two dropped); the bias moves by the kept copies
     * [2, 0], mean 1 -> [-rate, +rate], not by the padded [2, 2] (which would not move it) */
    EXPECT_OK(open_router(&c,
                          "{\"score_function\": \"sigmoid\", \"expert_bias\": true, \"bias_update_rate\": 0.1, "
                          "\"capacity_factor\": 1.0, \"pad_to_capacity\": true}",
                          2, 1, NULL, 0, 1));
    if (!c.vt) return;
    EXPECT_OK(route(&c, l, 4, 0, MOERT_F64, &out));
    expect_counts("pad bias", &out, counts, 2);
    EXPECT_OK(c.vt->end_step(c.ti.ctx, NULL));
    const moert_tensor *bias = c.vt->expert_bias(c.ti.ctx);
    EXPECT(bias != NULL);
    if (bias) {
        EXPECT_NEAR(moert_load(bias, 0), -0.1, 1e-15, 0);
        EXPECT_NEAR(moert_load(bias, 1), 0.1, 1e-15, 0);
    }
    test_instance_close(&c.ti);
}

/* The noise of docs/plugins/router.md ("Input jitter"), written out again independently of the plugin's header:
 * splitmix64's finaliser chained over (seed, layer, rank, purpose), then over (call, row, column). */
static uint64_t ref_mix(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double ref_uniform(uint64_t seed, uint64_t purpose, uint64_t call, uint64_t row, uint64_t col)
{
    uint64_t key = ref_mix(ref_mix(ref_mix(ref_mix(seed) ^ 0 /* layer */) ^ 0 /* rank */) ^ purpose);
    return (double)(ref_mix(ref_mix(ref_mix(key ^ call) ^ row) ^ col) >> 11) / 9007199254740992.0;
}

static double ref_normal(uint64_t seed, uint64_t call, uint64_t row, uint64_t col)
{
    double u1 = 1.0 - ref_uniform(seed, 2, call, row, 2 * col), u2 = ref_uniform(seed, 2, call, row, 2 * col + 1);
    return sqrt(-2.0 * log(u1)) * cos(2.0 * 3.14159265358979323846 * u2);
}

/* Input jitter: with the identity weight the logits are x times the noise; sigmoid top-1 probs show them. */
static void test_input_jitter(void)
{
    router_case c;
    route_out out;
    const double eps = 0.2;
    double x[] = {1.0, 0.5, -0.25, 2.0, -1.0, 0.75, 0.1, -0.3};
    EXPECT_OK(
        open_router(&c, "{\"score_function\": \"sigmoid\", \"input_jitter_eps\": 0.2, \"seed\": 7}", 4, 1, NULL, 0, 1));
    if (!c.vt) return;
    for (uint64_t call = 0; call < 3; call++) {
        EXPECT_OK(route(&c, x, 2, 0, MOERT_F64, &out));
        int moved = 0;
        for (int t = 0; t < 2; t++) {
            double j[4];
            int best = 0;
            for (int e = 0; e < 4; e++) {
                double n = 1.0 - eps + 2.0 * eps * ref_uniform(7, 1, call, (uint64_t)t, (uint64_t)e);
                EXPECT(n >= 1.0 - eps && n < 1.0 + eps);
                j[e] = x[t * 4 + e] * n;
                if (j[e] > j[best]) best = e;
                if (fabs(n - 1.0) > 1e-3) moved++;
            }
            EXPECT_EQ_INT(out.idx[t], best);
            EXPECT_NEAR(out.probs[t], sigmoid(j[best]), 0, 1e-14);
        }
        EXPECT(moved > 0);
    }
    test_instance_close(&c.ti);
    /* another seed draws other noise */
    EXPECT_OK(
        open_router(&c, "{\"score_function\": \"sigmoid\", \"input_jitter_eps\": 0.2, \"seed\": 8}", 4, 1, NULL, 0, 1));
    if (!c.vt) return;
    EXPECT_OK(route(&c, x, 2, 0, MOERT_F64, &out));
    double n7 = 1.0 - eps + 2.0 * eps * ref_uniform(7, 1, 0, 0, out.idx[0]);
    EXPECT(fabs(out.probs[0] - sigmoid(x[out.idx[0]] * n7)) > 1e-9);
    test_instance_close(&c.ti);
}

/* An inference forward (MOERT_ROUTER_FORWARD_INFERENCE) draws no jitter: it routes like a router without it, and the
 * training forward after it still jitters. */
static void test_jitter_off_in_inference(void)
{
    router_case jit, plain;
    route_out oj, op;
    double x[] = {1.0, 0.5, -0.25, 2.0, -1.0, 0.75, 0.1, -0.3};
    EXPECT_OK(open_router(&jit, "{\"score_function\": \"sigmoid\", \"input_jitter_eps\": 0.2, \"seed\": 7}", 4, 1, NULL,
                          0, 1));
    EXPECT_OK(open_router(&plain, "{\"score_function\": \"sigmoid\"}", 4, 1, NULL, 0, 1));
    if (!jit.vt || !plain.vt) return;
    route_flags = MOERT_ROUTER_FORWARD_INFERENCE;
    EXPECT_OK(route(&jit, x, 2, 0, MOERT_F64, &oj));
    route_flags = 0;
    EXPECT_OK(route(&plain, x, 2, 0, MOERT_F64, &op));
    for (int t = 0; t < 2; t++) {
        EXPECT_EQ_INT(oj.idx[t], op.idx[t]);
        EXPECT(oj.probs[t] == op.probs[t]);
    }
    EXPECT_OK(route(&jit, x, 2, 0, MOERT_F64, &oj)); /* training again: jittered */
    EXPECT(oj.probs[0] != op.probs[0] || oj.probs[1] != op.probs[1]);
    test_instance_close(&jit.ti);
    test_instance_close(&plain.ti);
}

/* force_load_balancing: the routing sees standard normal logits, whatever x is. */
static void test_force_load_balancing(void)
{
    router_case a, b;
    route_out oa, ob;
    double x1[3 * 4] = {5, -5, 0, 0, 9, 0, 0, 0, 0, 0, 0, 7};
    double x2[3 * 4] = {0};
    EXPECT_OK(open_router(&a, "{\"force_load_balancing\": true, \"seed\": 3}", 4, 2, NULL, 0, 1));
    EXPECT_OK(open_router(&b, "{\"force_load_balancing\": true, \"seed\": 3}", 4, 2, NULL, 0, 1));
    if (!a.vt || !b.vt) return;
    EXPECT_OK(route(&a, x1, 3, 0, MOERT_F64, &oa));
    EXPECT_OK(route(&b, x2, 3, 0, MOERT_F64, &ob));
    for (int t = 0; t < 3; t++) {
        double r[4];
        for (int e = 0; e < 4; e++) r[e] = ref_normal(3, 0, (uint64_t)t, (uint64_t)e);
        int i0 = 0;
        for (int e = 1; e < 4; e++)
            if (r[e] > r[i0]) i0 = e;
        int i1 = i0 == 0 ? 1 : 0;
        for (int e = 0; e < 4; e++)
            if (e != i0 && r[e] > r[i1]) i1 = e;
        int32_t idx[2] = {i0, i1};
        double z = exp(r[i0]) + exp(r[i1]);
        double probs[2] = {exp(r[i0]) / z, exp(r[i1]) / z};
        for (int k = 0; k < 2; k++) {
            EXPECT_EQ_INT(oa.idx[t * 2 + k], idx[k]);
            EXPECT_EQ_INT(ob.idx[t * 2 + k], idx[k]);
            EXPECT_NEAR(oa.probs[t * 2 + k], probs[k], 0, 1e-13);
            EXPECT_NEAR(ob.probs[t * 2 + k], probs[k], 0, 1e-13);
        }
    }
    test_instance_close(&a.ti);
    test_instance_close(&b.ti);

    /* balanced on average: 4000 tokens, 8 experts, top-2: each expert within 6 sigma of 1000 copies, however
     * skewed x is (every token prefers expert 0 by a wide margin) */
    enum { BT = 4000, BE = 8, BK = 2 };
    static double bx[BT * BE], bw[BE * BE], bprobs[BT * BK];
    static int32_t bidx[BT * BK];
    int64_t btpe[BE];
    for (int i = 0; i < BT * BE; i++) bx[i] = i % BE == 0 ? 10.0 : 0.0;
    for (int i = 0; i < BE * BE; i++) bw[i] = i / BE == i % BE ? 1.0 : 0.0;
    test_instance ti;
    moert_layer_info layer = test_layer(BE, 4, BE, BK, BT, 1, 0, MOERT_F64);
    EXPECT_OK(
        test_instance_open(&ti, MOERT_KIND_ROUTER, "topk", "{\"force_load_balancing\": true}", &layer, NULL, 0, 1));
    if (!ti.ctx) return;
    const moert_router_v1 *vt = (const moert_router_v1 *)ti.plugin.header;
    moert_router_losses losses;
    moert_tensor tx = moert_tensor_2d(bx, moert_cpu(), MOERT_F64, BT, BE);
    moert_tensor tw = moert_tensor_2d(bw, moert_cpu(), MOERT_F64, BE, BE);
    moert_tensor tidx = moert_tensor_2d(bidx, moert_cpu(), MOERT_I32, BT, BK);
    moert_tensor tprobs = moert_tensor_2d(bprobs, moert_cpu(), MOERT_F64, BT, BK);
    moert_tensor ttpe = moert_tensor_1d(btpe, moert_cpu(), MOERT_I64, BE);
    moert_router_forward_args args = {.struct_size = sizeof args,
                                      .x = &tx,
                                      .weight = &tw,
                                      .topk_idx = &tidx,
                                      .topk_probs = &tprobs,
                                      .tokens_per_expert = &ttpe,
                                      .losses = &losses};
    EXPECT_OK(vt->forward(ti.ctx, NULL, &args));
    double mean = (double)(BT * BK) / BE, sd = sqrt(mean * (1.0 - 1.0 / BE));
    for (int e = 0; e < BE; e++)
        if (fabs((double)btpe[e] - mean) > 6.0 * sd) {
            fprintf(stderr, "forced balance: expert %d got %lld copies, mean %.0f\n", e, (long long)btpe[e], mean);
            test_failures++;
        }
    test_instance_close(&ti);
}

/* compute_dtype: fp32 rounds the logits and scores to fp32 (a near tie becomes a tie: the lower index wins),
 * fp64 and auto keep the CPU reference's doubles. */
static void test_compute_dtype(void)
{
    router_case c;
    route_out out;
    double l[] = {1.0, 1.0 + 1e-9, 0.0, -1.0};
    const char *opts[] = {"{\"compute_dtype\": \"fp32\"}", "{\"compute_dtype\": \"fp64\"}", "{}"};
    for (int i = 0; i < 3; i++) {
        EXPECT_OK(open_router(&c, opts[i], 4, 1, NULL, 0, 1));
        if (!c.vt) return;
        EXPECT_OK(route(&c, l, 1, 0, MOERT_F64, &out));
        EXPECT_EQ_INT(out.idx[0], i == 0 ? 0 : 1);
        EXPECT_NEAR(out.probs[0], 1.0, 0, 0); /* post-softmax top-1 */
        test_instance_close(&c.ti);
    }
    /* pre-softmax probs in fp32: the fp32 rounding of the fp32 logits' softmax */
    double l2[] = {0.1, 0.7, 1.0 / 3.0, -0.2};
    EXPECT_OK(open_router(&c, "{\"compute_dtype\": \"fp32\", \"pre_softmax\": true}", 4, 2, NULL, 0, 1));
    if (!c.vt) return;
    EXPECT_OK(route(&c, l2, 1, 0, MOERT_F64, &out));
    double lf[4], P[4];
    for (int e = 0; e < 4; e++) lf[e] = (float)l2[e];
    softmax_rows(lf, 1, 4, P);
    EXPECT_EQ_INT(out.idx[0], 1);
    EXPECT_EQ_INT(out.idx[1], 2);
    for (int k = 0; k < 2; k++) EXPECT(out.probs[k] == (double)(float)out.probs[k]); /* fp32 values */
    EXPECT_NEAR(out.probs[0], (double)(float)P[1], 1e-15, 0);
    EXPECT_NEAR(out.probs[1], (double)(float)P[2], 1e-15, 0);
    EXPECT(fabs(out.probs[0] - P[1]) > 0.0); /* and not the fp64 ones */
    test_instance_close(&c.ti);
}

/* ---- two ranks ---- */

typedef struct two_rank_state {
    moert_comm_group *comm;
    double bias[2][MAX_E];
    double aux[2][3]; /* aux loss of three forwards per rank */
    int ok[2];
} two_rank_state;

/* Expert bias over two ranks: each rank runs two forwards; end_step all-reduces the counts. */
static void bias_rank(int rank, void *user)
{
    two_rank_state *s = user;
    router_case c;
    if (open_router(&c, "{\"score_function\": \"sigmoid\", \"expert_bias\": true, \"bias_update_rate\": 0.1}", 4, 1,
                    s->comm, rank, 2) != MOERT_OK)
        return;
    route_out out;
    /* rank 0: [2,0,0,0] then [0,1,1,0]; rank 1: [0,0,0,2] then [0,0,1,1]. Total [2,1,2,3], mean 2. */
    double r0a[] = {1, 0, 0, 0, 1, 0, 0, 0}, r0b[] = {0, 1, 0, 0, 0, 0, 1, 0};
    double r1a[] = {0, 0, 0, 1, 0, 0, 0, 1}, r1b[] = {0, 0, 1, 0, 0, 0, 0, 1};
    int ok = route(&c, rank == 0 ? r0a : r1a, 2, 0, MOERT_F64, &out) == MOERT_OK;
    ok = ok && route(&c, rank == 0 ? r0b : r1b, 2, 0, MOERT_F64, &out) == MOERT_OK;
    ok = ok && c.vt->end_step(c.ti.ctx, NULL) == MOERT_OK;
    const moert_tensor *bias = c.vt->expert_bias(c.ti.ctx);
    for (int e = 0; e < 4 && bias; e++) s->bias[rank][e] = moert_load(bias, e);
    s->ok[rank] = ok && bias;
    test_instance_close(&c.ti);
}

static void test_bias_two_ranks(void)
{
    two_rank_state s;
    memset(&s, 0, sizeof s);
    EXPECT_OK(moert_comm_group_create(2, 10.0, &s.comm));
    if (!s.comm) return;
    test_run_ranks(2, bias_rank, &s);
    EXPECT(s.ok[0] && s.ok[1]);
    /* sign(mean - count) = [0, +1, 0, -1]; rank 0's own counts alone would give [-1, 0, 0, +1] */
    double want[] = {0.0, 0.1, 0.0, -0.1};
    for (int r = 0; r < 2; r++)
        for (int e = 0; e < 4; e++) EXPECT_NEAR(s.bias[r][e], want[e], 1e-15, 0);
    moert_comm_group_free(s.comm);
}

/* global_aux_loss over two ranks with 2 and 3 tokens; two forwards, end_step, a third forward. */
static const double global_logits[2][3][3 * 4] = {
    {{1, 3, 2, 0, 0.5, 0.4, -1, 2}, {2, 1, 0, -1, 1, 2, 0, -1}, {0, 0.1, 2, 1, 3, 0, 0.2, 1}},
    {{1.5, 1.2, 0.3, -0.2, -1, 0, 2, 1, 0, 1, 0.5, 3},
     {1, 0, 2, 3, 0.3, 0.2, 1, 2, 2, 3, 1, 0},
     {1, 2, 0, 0, 0, 1, 2, 0, 0, 0, 1, 2}}};
static const int64_t global_tokens[2] = {2, 3};

static void global_rank(int rank, void *user)
{
    two_rank_state *s = user;
    router_case c;
    if (open_router(&c, "{\"load_balancing\": \"global_aux_loss\", \"aux_loss_coeff\": 0.1}", 4, 2, s->comm, rank, 2) !=
        MOERT_OK)
        return;
    route_out out;
    int ok = 1;
    for (int f = 0; f < 3 && ok; f++) {
        if (f == 2) ok = c.vt->end_step(c.ti.ctx, NULL) == MOERT_OK;
        ok = ok && route(&c, global_logits[rank][f], global_tokens[rank], 0, MOERT_F64, &out) == MOERT_OK;
        s->aux[rank][f] = out.losses.aux_loss;
        if (ok && out.losses.total != out.losses.aux_loss) ok = 0;
    }
    s->ok[rank] = ok;
    test_instance_close(&c.ti);
}

static void test_global_aux_two_ranks(void)
{
    two_rank_state s;
    memset(&s, 0, sizeof s);
    EXPECT_OK(moert_comm_group_create(2, 10.0, &s.comm));
    if (!s.comm) return;
    test_run_ranks(2, global_rank, &s);
    EXPECT(s.ok[0] && s.ok[1]);
    /* plain top-2 counts of each forward, over both ranks, worked out by hand:
     * forward 0: rank 0 {1,2},{3,0}; rank 1 {0,1},{2,3},{3,1} -> [2,3,2,3]
     * forward 1: rank 0 {0,1},{1,0}; rank 1 {3,2},{3,2},{1,0} -> [3,3,2,2]
     * forward 2 (after end_step): rank 0 {2,3},{0,3}; rank 1 {1,0},{2,1},{3,2} -> [2,2,3,3] */
    double counts[3][4] = {{2, 3, 2, 3}, {3, 3, 2, 2}, {2, 2, 3, 3}};
    double f[3][4];
    for (int e = 0; e < 4; e++) {
        f[0][e] = counts[0][e];
        f[1][e] = (counts[0][e] + counts[1][e]) / 2.0; /* averaged over the forwards of the step */
        f[2][e] = counts[2][e];                        /* end_step started a new accumulation */
    }
    for (int r = 0; r < 2; r++) {
        for (int fw = 0; fw < 3; fw++) {
            double P[12];
            softmax_rows(global_logits[r][fw], global_tokens[r], 4, P);
            double acc = 0;
            for (int e = 0; e < 4; e++) {
                double pe = 0;
                for (int t = 0; t < global_tokens[r]; t++) pe += P[t * 4 + e];
                acc += pe * f[fw][e];
            }
            double want = 0.1 * 4.0 / (2.0 * 5.0 * 5.0) * acc; /* 5 tokens over both ranks */
            EXPECT_NEAR(s.aux[r][fw], want, 0, 1e-13);
        }
    }
    moert_comm_group_free(s.comm);
}

/* ---- errors ---- */

/* init must fail with `code` and a message containing `needle`. */
static void expect_init_error(const char *options, int64_t E, int64_t K, moert_result code, const char *needle)
{
    router_case c;
    moert_result rc = open_router(&c, options, E, K, NULL, 0, 1);
    if (rc != code) {
        fprintf(stderr, "options %s: result %d, expected %d (%s)\n", options, (int)rc, (int)code,
                moert_error_message());
        test_failures++;
    } else if (!strstr(moert_error_message(), needle)) {
        fprintf(stderr, "options %s: message \"%s\" lacks \"%s\"\n", options, moert_error_message(), needle);
        test_failures++;
    }
    test_instance_close(&c.ti);
}

static void test_option_errors(void)
{
    expect_init_error("{\"num_groups\": 3, \"group_topk\": 1}", 8, 2, MOERT_ERR_CONFIG,
                      "num_groups: 3 does not divide the 8 experts");
    expect_init_error("{\"num_groups\": 4, \"group_topk\": 3}", 8, 4, MOERT_ERR_CONFIG,
                      "group_topk: 3 does not divide topk 4");
    expect_init_error("{\"num_groups\": 4}", 8, 4, MOERT_ERR_CONFIG, "$.router.num_groups and $.router.group_topk");
    expect_init_error("{\"num_groups\": 2, \"group_topk\": 3}", 8, 3, MOERT_ERR_CONFIG,
                      "group_topk: 3 is more than num_groups 2");
    expect_init_error("{\"num_groups\": 4, \"group_topk\": 1}", 8, 4, MOERT_ERR_CONFIG,
                      "topk/group_topk = 4 is more than the 2 experts of a group");
    expect_init_error("{\"score_function\": \"sigmoid\", \"pre_softmax\": true}", 4, 2, MOERT_ERR_CONFIG,
                      "pre_softmax");
    expect_init_error("{\"expert_bias\": true}", 4, 2, MOERT_ERR_CONFIG, "expert_bias: needs score_function sigmoid");
    expect_init_error("{\"aux_loss_coeff\": 0.01}", 4, 2, MOERT_ERR_CONFIG, "aux_loss_coeff");
    expect_init_error("{\"load_balancing\": \"sinkhorn\", \"scaling_factor\": 2.0}", 4, 2, MOERT_ERR_CONFIG,
                      "sinkhorn does not combine with scaling_factor");
    expect_init_error("{\"load_balancing\": \"sinkhorn\", \"score_function\": \"sigmoid\"}", 4, 2, MOERT_ERR_CONFIG,
                      "sinkhorn does not combine with score_function sigmoid");
    expect_init_error("{\"score_function\": \"tanh\"}", 4, 2, MOERT_ERR_CONFIG, "score_function");
    expect_init_error("{\"capacity_factor\": -1}", 4, 2, MOERT_ERR_CONFIG, "capacity_factor");
    expect_init_error("{\"drop_policy\": \"random\"}", 4, 2, MOERT_ERR_CONFIG, "drop_policy");
    expect_init_error("{\"capacity_factr\": 1.0}", 4, 2, MOERT_ERR_CONFIG, "capacity_factor");
    expect_init_error("{\"pad_to_capacity\": true}", 4, 2, MOERT_ERR_CONFIG,
                      "pad_to_capacity: needs capacity_factor > 0");
    expect_init_error("{\"input_jitter_eps\": -0.1}", 4, 2, MOERT_ERR_CONFIG, "input_jitter_eps");
    expect_init_error("{\"input_jitter_eps\": 1.5}", 4, 2, MOERT_ERR_CONFIG, "input_jitter_eps");
    expect_init_error("{\"input_jitter_eps\": 0.01, \"gemm\": \"bf16x3\"}", 4, 2, MOERT_ERR_CONFIG,
                      "input_jitter_eps 0.01 multiplies them by fp32 noise");
    expect_init_error("{\"compute_dtype\": \"fp64\", \"gemm\": \"fp32\"}", 4, 2, MOERT_ERR_CONFIG,
                      "compute_dtype fp64 computes the logits in fp64");
    expect_init_error("{\"compute_dtype\": \"bf16\"}", 4, 2, MOERT_ERR_CONFIG, "compute_dtype");
    expect_init_error("{\"force_load_balancing\": 1}", 4, 2, MOERT_ERR_CONFIG, "force_load_balancing");
    expect_init_error("{\"seed\": -1}", 4, 2, MOERT_ERR_CONFIG, "seed");

    /* a CUDA layer: not served yet, and the message names the device (init called directly, with the host of
     * a CPU instance, so the plugin's own check answers) */
    router_case c;
    EXPECT_OK(open_router(&c, "{}", 4, 2, NULL, 0, 1));
    if (!c.vt) return;
    moert_layer_info layer = test_layer(4, 4, 4, 2, 4, 1, 0, MOERT_F64);
    layer.device.type = MOERT_DEVICE_CUDA;
    void *cuda_ctx = NULL;
    EXPECT_EQ_INT(c.vt->init(&cuda_ctx, c.ti.host, &layer), MOERT_ERR_UNSUPPORTED);
    EXPECT(cuda_ctx == NULL);
    const char *msg = moert_host_take_error(c.ti.host);
    if (!strstr(msg, "device cuda:0 is not supported")) {
        fprintf(stderr, "device error: \"%s\"\n", msg);
        test_failures++;
    }
    test_instance_close(&c.ti);

    /* a forward with a wrongly shaped output */
    EXPECT_OK(open_router(&c, "{}", 4, 2, NULL, 0, 1));
    if (!c.vt) return;
    double x[8] = {0}, w[16] = {0}, probs[8];
    int32_t idx[6];
    int64_t tpe[4];
    moert_router_losses losses;
    moert_tensor tx = moert_tensor_2d(x, moert_cpu(), MOERT_F64, 2, 4);
    moert_tensor tw = moert_tensor_2d(w, moert_cpu(), MOERT_F64, 4, 4);
    moert_tensor tidx = moert_tensor_2d(idx, moert_cpu(), MOERT_I32, 2, 3);
    moert_tensor tprobs = moert_tensor_2d(probs, moert_cpu(), MOERT_F64, 2, 2);
    moert_tensor ttpe = moert_tensor_1d(tpe, moert_cpu(), MOERT_I64, 4);
    moert_router_forward_args args = {.struct_size = sizeof args,
                                      .x = &tx,
                                      .weight = &tw,
                                      .topk_idx = &tidx,
                                      .topk_probs = &tprobs,
                                      .tokens_per_expert = &ttpe,
                                      .losses = &losses,
                                      .seq_length = 0};
    EXPECT_EQ_INT(c.vt->forward(c.ti.ctx, NULL, &args), MOERT_ERR_INVALID_ARGUMENT);
    msg = moert_host_take_error(c.ti.host);
    if (!strstr(msg, "topk_idx must be [2, 2] int32, got [2, 3] int32")) {
        fprintf(stderr, "shape error: \"%s\"\n", msg);
        test_failures++;
    }
    /* backward before any successful forward */
    moert_router_backward_args bargs = {.struct_size = sizeof bargs,
                                        .x = &tx,
                                        .weight = &tw,
                                        .d_topk_probs = &tprobs,
                                        .loss_scale = 1.0,
                                        .d_x = &tx,
                                        .d_weight = &tw};
    EXPECT_EQ_INT(c.vt->backward(c.ti.ctx, NULL, &bargs), MOERT_ERR_INVALID_ARGUMENT);
    msg = moert_host_take_error(c.ti.host);
    EXPECT(strstr(msg, "no forward") != NULL);
    test_instance_close(&c.ti);
}

int main(void)
{
    test_softmax_post(MOERT_F64);
    test_softmax_post(MOERT_F32);
    test_softmax_pre();
    test_scaling();
    test_sigmoid_bias();
    test_group_topk();
    test_aux_loss();
    test_seq_aux_loss();
    test_z_loss();
    test_deferred_losses();
    test_sinkhorn();
    test_capacity();
    test_pad_to_capacity();
    test_input_jitter();
    test_jitter_off_in_inference();
    test_force_load_balancing();
    test_compute_dtype();
    test_bias_two_ranks();
    test_global_aux_two_ranks();
    test_option_errors();
    return test_finish("test_router");
}
