/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The "topk" router's backward against central finite differences, in fp64, for every mode (input jitter on a fresh
 * instance per forward, so every forward draws the same noise), and force_load_balancing's straight-through gradient:
 * L = sum(G * topk_probs) + loss_scale * losses.total; d_x and d_weight from backward must match
 * (L(p + eps) - L(p - eps)) / (2 eps) for every element p of x and weight.
 */
#include "test_util.h"

#define T     6
#define H     5
#define E     8
#define MAX_K 4

typedef struct grad_mode {
    const char *name;
    const char *options;
    int64_t K;
    int64_t seq_length;
    double loss_scale;
    bool zero_upstream; /* G = 0: only the balancing/z losses drive the gradient */
    bool fresh;         /* every forward on a new instance: the noise of input jitter is that of the first forward */
} grad_mode;

static const grad_mode modes[] = {
    {"softmax post", "{}", 2, 0, 1.0, false, false},
    {"softmax post top-3", "{}", 3, 0, 1.0, false, false},
    {"softmax pre", "{\"pre_softmax\": true}", 2, 0, 1.0, false, false},
    {"sigmoid + scaling", "{\"score_function\": \"sigmoid\", \"scaling_factor\": 2.5}", 3, 0, 1.0, false, false},
    {"sigmoid top-1", "{\"score_function\": \"sigmoid\"}", 1, 0, 1.0, false, false},
    {"group top-k softmax", "{\"num_groups\": 4, \"group_topk\": 2}", 2, 0, 1.0, false, false},
    {"group top-k sigmoid + bias + scaling",
     "{\"score_function\": \"sigmoid\", \"num_groups\": 4, \"group_topk\": 2, \"scaling_factor\": 2.5, "
     "\"expert_bias\": true}",
     4, 0, 1.0, false, false},
    {"aux_loss", "{\"load_balancing\": \"aux_loss\", \"aux_loss_coeff\": 0.1}", 2, 0, 1.0, false, false},
    {"aux_loss alone", "{\"load_balancing\": \"aux_loss\", \"aux_loss_coeff\": 0.1}", 2, 0, 1.0, true, false},
    {"aux_loss sigmoid alone",
     "{\"score_function\": \"sigmoid\", \"load_balancing\": \"aux_loss\", "
     "\"aux_loss_coeff\": 0.1}",
     2, 0, 1.0, true, false},
    {"seq_aux_loss", "{\"load_balancing\": \"seq_aux_loss\", \"aux_loss_coeff\": 0.1}", 2, 3, 1.0, false, false},
    {"seq_aux_loss alone", "{\"load_balancing\": \"seq_aux_loss\", \"aux_loss_coeff\": 0.1}", 2, 2, 1.0, true, false},
    {"global_aux_loss", "{\"load_balancing\": \"global_aux_loss\", \"aux_loss_coeff\": 0.1}", 2, 0, 1.0, false, false},
    {"z_loss", "{\"z_loss_coeff\": 0.05}", 2, 0, 2.0, false, false},
    {"z_loss alone", "{\"z_loss_coeff\": 0.05}", 2, 0, 1.0, true, false},
    {"capacity probs", "{\"capacity_factor\": 0.5}", 2, 0, 1.0, false, false},
    {"capacity position pre_softmax",
     "{\"pre_softmax\": true, \"capacity_factor\": 0.5, "
     "\"drop_policy\": \"position\"}",
     2, 0, 1.0, false, false},
    {"capacity sigmoid", "{\"score_function\": \"sigmoid\", \"capacity_factor\": 0.6}", 3, 0, 1.0, false, false},
    {"sinkhorn", "{\"load_balancing\": \"sinkhorn\"}", 2, 0, 1.0, false, false},
    {"sinkhorn top-1", "{\"load_balancing\": \"sinkhorn\"}", 1, 0, 1.0, false, false},
    {"capacity padded", "{\"capacity_factor\": 0.5, \"pad_to_capacity\": true}", 2, 0, 1.0, false, false},
    {"compute_dtype fp64 + z_loss", "{\"compute_dtype\": \"fp64\", \"z_loss_coeff\": 0.05}", 2, 0, 1.0, false, false},
    {"input jitter", "{\"input_jitter_eps\": 0.1, \"seed\": 5}", 2, 0, 1.0, false, true},
    {"input jitter sigmoid + aux_loss",
     "{\"score_function\": \"sigmoid\", \"input_jitter_eps\": 0.05, "
     "\"load_balancing\": \"aux_loss\", \"aux_loss_coeff\": 0.1}",
     3, 0, 1.0, false, true},
    {"pre_softmax + aux + z + capacity",
     "{\"pre_softmax\": true, \"load_balancing\": \"aux_loss\", "
     "\"aux_loss_coeff\": 0.05, \"z_loss_coeff\": 0.01, "
     "\"capacity_factor\": 0.5}",
     2, 0, 0.5, false, false},
};

typedef struct grad_state {
    test_instance ti;
    const grad_mode *mode;
    moert_layer_info layer;
    const moert_router_v1 *vt;
    int64_t K;
    int64_t seq_length;
    double loss_scale;
    double x[T * H], w[E * H], G[T * MAX_K];
    int32_t idx[T * MAX_K];
    double probs[T * MAX_K];
    int64_t tpe[E];
    moert_router_losses losses;
} grad_state;

/* A new instance in place of the current one (mode->fresh): its noise starts again at the first forward. */
static bool reopen(grad_state *s)
{
    test_instance_close(&s->ti);
    if (test_instance_open(&s->ti, MOERT_KIND_ROUTER, "topk", s->mode->options, &s->layer, NULL, 0, 1) != MOERT_OK) {
        fprintf(stderr, "%s: reopen failed: %s\n", s->mode->name, moert_error_message());
        return false;
    }
    s->vt = (const moert_router_v1 *)s->ti.plugin.header;
    return true;
}

/* One forward on the current x and w; returns L, or NAN on failure. */
static double forward_loss(grad_state *s)
{
    if (s->mode->fresh && !reopen(s)) return NAN;
    moert_tensor tx = moert_tensor_2d(s->x, moert_cpu(), MOERT_F64, T, H);
    moert_tensor tw = moert_tensor_2d(s->w, moert_cpu(), MOERT_F64, E, H);
    moert_tensor tidx = moert_tensor_2d(s->idx, moert_cpu(), MOERT_I32, T, s->K);
    moert_tensor tprobs = moert_tensor_2d(s->probs, moert_cpu(), MOERT_F64, T, s->K);
    moert_tensor ttpe = moert_tensor_1d(s->tpe, moert_cpu(), MOERT_I64, E);
    moert_router_forward_args args = {.struct_size = sizeof args,
                                      .x = &tx,
                                      .weight = &tw,
                                      .topk_idx = &tidx,
                                      .topk_probs = &tprobs,
                                      .tokens_per_expert = &ttpe,
                                      .losses = &s->losses,
                                      .seq_length = s->seq_length};
    if (s->vt->forward(s->ti.ctx, NULL, &args) != MOERT_OK) {
        fprintf(stderr, "forward failed: %s\n", moert_host_take_error(s->ti.host));
        return NAN;
    }
    double L = s->loss_scale * s->losses.total;
    for (int64_t i = 0; i < T * s->K; i++) L += s->G[i] * s->probs[i];
    return L;
}

/* Fails the test when two experts of a token have logits closer than `gap` (a near-tie could flip the
 * selection under the perturbation and make the finite differences meaningless). */
static void check_no_near_ties(const grad_state *s, double gap, const char *name)
{
    for (int t = 0; t < T; t++) {
        double l[E];
        for (int e = 0; e < E; e++) {
            l[e] = 0;
            for (int h = 0; h < H; h++) l[e] += s->x[t * H + h] * s->w[e * H + h];
        }
        for (int a = 0; a < E; a++)
            for (int b = a + 1; b < E; b++)
                if (fabs(l[a] - l[b]) < gap) {
                    fprintf(stderr, "%s: token %d has a near-tie between experts %d and %d; pick another seed\n", name,
                            t, a, b);
                    test_failures++;
                }
    }
}

static void check_mode(const grad_mode *m, uint64_t seed)
{
    static grad_state s;
    memset(&s, 0, sizeof s);
    s.K = m->K;
    s.seq_length = m->seq_length;
    s.loss_scale = m->loss_scale;
    s.mode = m;
    s.layer = test_layer(H, 4, E, m->K, T, 1, 0, MOERT_F64);
    moert_result rc = test_instance_open(&s.ti, MOERT_KIND_ROUTER, "topk", m->options, &s.layer, NULL, 0, 1);
    if (rc != MOERT_OK) {
        fprintf(stderr, "%s: open failed: %s\n", m->name, moert_error_message());
        test_failures++;
        test_instance_close(&s.ti);
        return;
    }
    s.vt = (const moert_router_v1 *)s.ti.plugin.header;

    uint64_t rng = seed;
    for (int i = 0; i < T * H; i++) s.x[i] = test_uniform(&rng);
    for (int i = 0; i < E * H; i++) s.w[i] = test_uniform(&rng);
    for (int i = 0; i < T * m->K; i++) s.G[i] = m->zero_upstream ? 0.0 : test_uniform(&rng);
    check_no_near_ties(&s, 1e-3, m->name);

    double L0 = forward_loss(&s);
    EXPECT(!isnan(L0));
    int32_t base_idx[T * MAX_K];
    memcpy(base_idx, s.idx, sizeof base_idx);
    int dropped = 0;
    for (int i = 0; i < T * m->K; i++) dropped += base_idx[i] < 0;
    if (strstr(m->options, "capacity_factor") && dropped == 0) {
        fprintf(stderr, "%s: no copy was dropped, the capacity path is not exercised\n", m->name);
        test_failures++;
    }

    /* analytic gradients, accumulated onto a non-zero start to check the += contract */
    double dx[T * H], dw[E * H], dG[T * MAX_K];
    for (int i = 0; i < T * H; i++) dx[i] = 0.25;
    for (int i = 0; i < E * H; i++) dw[i] = -0.5;
    memcpy(dG, s.G, sizeof dG);
    moert_tensor tx = moert_tensor_2d(s.x, moert_cpu(), MOERT_F64, T, H);
    moert_tensor tw = moert_tensor_2d(s.w, moert_cpu(), MOERT_F64, E, H);
    moert_tensor tdp = moert_tensor_2d(dG, moert_cpu(), MOERT_F64, T, m->K);
    moert_tensor tdx = moert_tensor_2d(dx, moert_cpu(), MOERT_F64, T, H);
    moert_tensor tdw = moert_tensor_2d(dw, moert_cpu(), MOERT_F64, E, H);
    moert_router_backward_args bargs = {.struct_size = sizeof bargs,
                                        .x = &tx,
                                        .weight = &tw,
                                        .d_topk_probs = &tdp,
                                        .loss_scale = m->loss_scale,
                                        .d_x = &tdx,
                                        .d_weight = &tdw};
    rc = s.vt->backward(s.ti.ctx, NULL, &bargs);
    if (rc != MOERT_OK) {
        fprintf(stderr, "%s: backward failed: %s\n", m->name, moert_host_take_error(s.ti.host));
        test_failures++;
        test_instance_close(&s.ti);
        return;
    }
    for (int i = 0; i < T * H; i++) dx[i] -= 0.25;
    for (int i = 0; i < E * H; i++) dw[i] += 0.5;

    /* central differences over every element of x and weight */
    const double eps = 1e-6;
    int bad = 0, flipped = 0;
    double max_grad = 0.0;
    for (int which = 0; which < 2; which++) {
        double *p = which == 0 ? s.x : s.w;
        double *an = which == 0 ? dx : dw;
        int n = which == 0 ? T * H : E * H;
        for (int i = 0; i < n; i++) {
            double orig = p[i];
            p[i] = orig + eps;
            double Lp = forward_loss(&s);
            if (memcmp(base_idx, s.idx, sizeof(int32_t) * (size_t)(T * m->K)) != 0) flipped++;
            p[i] = orig - eps;
            double Lm = forward_loss(&s);
            if (memcmp(base_idx, s.idx, sizeof(int32_t) * (size_t)(T * m->K)) != 0) flipped++;
            p[i] = orig;
            double fd = (Lp - Lm) / (2 * eps);
            if (fabs(an[i]) > max_grad) max_grad = fabs(an[i]);
            if (!(fabs(an[i] - fd) <= 1e-8 + 1e-6 * fabs(fd))) {
                if (bad < 5)
                    fprintf(stderr, "%s: d_%s[%d] = %.12g, finite difference %.12g\n", m->name,
                            which == 0 ? "x" : "weight", i, an[i], fd);
                bad++;
            }
        }
    }
    if (flipped) {
        fprintf(stderr, "%s: the selection changed under the perturbation %d times; pick another seed\n", m->name,
                flipped);
        test_failures++;
    }
    if (bad) {
        fprintf(stderr, "%s: %d gradient element(s) off\n", m->name, bad);
        test_failures++;
    }
    if (max_grad < 1e-3) {
        fprintf(stderr, "%s: gradients are all ~0 (max %g): the check proves nothing\n", m->name, max_grad);
        test_failures++;
    }
    test_instance_close(&s.ti);
}

/* The random logits of force_load_balancing as docs/plugins/router.md defines them (seed, layer 0, rank 0, purpose 2;
 * Box-Muller on two uniforms), written out here independently of the plugin. */
static uint64_t ref_mix(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double ref_normal(uint64_t seed, uint64_t call, uint64_t row, uint64_t col)
{
    uint64_t key = ref_mix(ref_mix(ref_mix(ref_mix(seed) ^ 0) ^ 0) ^ 2);
    double u[2];
    for (int i = 0; i < 2; i++)
        u[i] =
            (double)(ref_mix(ref_mix(ref_mix(key ^ call) ^ row) ^ (2 * col + (uint64_t)i)) >> 11) / 9007199254740992.0;
    return sqrt(-2.0 * log(1.0 - u[0])) * cos(2.0 * 3.14159265358979323846 * u[1]);
}

/* force_load_balancing's straight-through gradient: the routing sees random logits R, and backward hands their
 * gradient dR to the real logits: d_x = dR . W, d_weight = dR^T . x. dR is that of a plain router whose logits are R
 * (x = R, weight the identity), whose own gradient the modes above check by finite differences. */
static void check_force_balance_gradient(void)
{
    enum { FT = 5, FE = 6, FK = 2 };
    double R[FT * FE], x[FT * FE], w[FE * FE], ident[FE * FE], G[FT * FK], probs[2][FT * FK];
    double dx[2][FT * FE], dw[2][FE * FE];
    int32_t idx[2][FT * FK];
    int64_t tpe[FE];
    moert_router_losses losses[2];
    uint64_t rng = 99;
    for (int i = 0; i < FT * FE; i++) {
        x[i] = test_uniform(&rng);
        R[i] = ref_normal(11, 0, (uint64_t)(i / FE), (uint64_t)(i % FE));
    }
    for (int i = 0; i < FE * FE; i++) {
        w[i] = test_uniform(&rng);
        ident[i] = i / FE == i % FE ? 1.0 : 0.0;
    }
    for (int i = 0; i < FT * FK; i++) G[i] = test_uniform(&rng);
    const char *opts[2] = {"{\"force_load_balancing\": true, \"seed\": 11, \"z_loss_coeff\": 0.05}",
                           "{\"z_loss_coeff\": 0.05}"};
    for (int side = 0; side < 2; side++) {
        test_instance ti;
        moert_layer_info layer = test_layer(FE, 4, FE, FK, FT, 1, 0, MOERT_F64);
        if (test_instance_open(&ti, MOERT_KIND_ROUTER, "topk", opts[side], &layer, NULL, 0, 1) != MOERT_OK) {
            fprintf(stderr, "force balance: open failed: %s\n", moert_error_message());
            test_failures++;
            return;
        }
        const moert_router_v1 *vt = (const moert_router_v1 *)ti.plugin.header;
        double *xs = side == 0 ? x : R, *ws = side == 0 ? w : ident;
        moert_tensor tx = moert_tensor_2d(xs, moert_cpu(), MOERT_F64, FT, FE);
        moert_tensor tw = moert_tensor_2d(ws, moert_cpu(), MOERT_F64, FE, FE);
        moert_tensor tidx = moert_tensor_2d(idx[side], moert_cpu(), MOERT_I32, FT, FK);
        moert_tensor tprobs = moert_tensor_2d(probs[side], moert_cpu(), MOERT_F64, FT, FK);
        moert_tensor ttpe = moert_tensor_1d(tpe, moert_cpu(), MOERT_I64, FE);
        moert_router_forward_args fa = {.struct_size = sizeof fa,
                                        .x = &tx,
                                        .weight = &tw,
                                        .topk_idx = &tidx,
                                        .topk_probs = &tprobs,
                                        .tokens_per_expert = &ttpe,
                                        .losses = &losses[side]};
        EXPECT_OK(vt->forward(ti.ctx, NULL, &fa));
        memset(dx[side], 0, sizeof dx[side]);
        memset(dw[side], 0, sizeof dw[side]);
        moert_tensor tdp = moert_tensor_2d(G, moert_cpu(), MOERT_F64, FT, FK);
        moert_tensor tdx = moert_tensor_2d(dx[side], moert_cpu(), MOERT_F64, FT, FE);
        moert_tensor tdw = moert_tensor_2d(dw[side], moert_cpu(), MOERT_F64, FE, FE);
        moert_router_backward_args ba = {.struct_size = sizeof ba,
                                         .x = &tx,
                                         .weight = &tw,
                                         .d_topk_probs = &tdp,
                                         .loss_scale = 1.0,
                                         .d_x = &tdx,
                                         .d_weight = &tdw};
        EXPECT_OK(vt->backward(ti.ctx, NULL, &ba));
        test_instance_close(&ti);
    }
    /* the same routing and z-loss as the plain router on R */
    for (int i = 0; i < FT * FK; i++) {
        EXPECT_EQ_INT(idx[0][i], idx[1][i]);
        EXPECT_NEAR(probs[0][i], probs[1][i], 1e-14, 0);
    }
    EXPECT_NEAR(losses[0].z_loss, losses[1].z_loss, 0, 1e-13);
    /* dR = d_x of the plain router (weight the identity); then d_x = dR . W and d_weight = dR^T . x */
    const double *dR = dx[1];
    double max_grad = 0.0;
    for (int t = 0; t < FT; t++)
        for (int h = 0; h < FE; h++) {
            double want = 0.0;
            for (int e = 0; e < FE; e++) want += dR[t * FE + e] * w[e * FE + h];
            EXPECT_NEAR(dx[0][t * FE + h], want, 1e-13, 1e-12);
            if (fabs(want) > max_grad) max_grad = fabs(want);
        }
    for (int e = 0; e < FE; e++)
        for (int h = 0; h < FE; h++) {
            double want = 0.0;
            for (int t = 0; t < FT; t++) want += dR[t * FE + e] * x[t * FE + h];
            EXPECT_NEAR(dw[0][e * FE + h], want, 1e-13, 1e-12);
        }
    EXPECT(max_grad > 1e-3);
}

int main(void)
{
    int n = (int)(sizeof modes / sizeof modes[0]);
    for (int i = 0; i < n; i++) check_mode(&modes[i], 23); /* a seed whose logits have no gap below 0.04 */
    check_force_balance_gradient();
    return test_finish("test_router_grad");
}
