/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The "topk" router's backward against central finite differences, in fp64, for every mode:
 * L = sum(G * topk_probs) + loss_scale * losses.total; d_x and d_weight from backward must match
 * (L(p + eps) - L(p - eps)) / (2 eps) for every element p of x and weight.
 */
#include "test_util.h"

#define T 6
#define H 5
#define E 8
#define MAX_K 4

typedef struct grad_mode {
    const char *name;
    const char *options;
    int64_t K;
    int64_t seq_length;
    double loss_scale;
    bool zero_upstream; /* G = 0: only the balancing/z losses drive the gradient */
} grad_mode;

static const grad_mode modes[] = {
    {"softmax post", "{}", 2, 0, 1.0, false},
    {"softmax post top-3", "{}", 3, 0, 1.0, false},
    {"softmax pre", "{\"pre_softmax\": true}", 2, 0, 1.0, false},
    {"sigmoid + scaling", "{\"score_function\": \"sigmoid\", \"scaling_factor\": 2.5}", 3, 0, 1.0, false},
    {"sigmoid top-1", "{\"score_function\": \"sigmoid\"}", 1, 0, 1.0, false},
    {"group top-k softmax", "{\"num_groups\": 4, \"group_topk\": 2}", 2, 0, 1.0, false},
    {"group top-k sigmoid + bias + scaling",
     "{\"score_function\": \"sigmoid\", \"num_groups\": 4, \"group_topk\": 2, \"scaling_factor\": 2.5, "
     "\"expert_bias\": true}", 4, 0, 1.0, false},
    {"aux_loss", "{\"load_balancing\": \"aux_loss\", \"aux_loss_coeff\": 0.1}", 2, 0, 1.0, false},
    {"aux_loss alone", "{\"load_balancing\": \"aux_loss\", \"aux_loss_coeff\": 0.1}", 2, 0, 1.0, true},
    {"aux_loss sigmoid alone", "{\"score_function\": \"sigmoid\", \"load_balancing\": \"aux_loss\", "
                               "\"aux_loss_coeff\": 0.1}", 2, 0, 1.0, true},
    {"seq_aux_loss", "{\"load_balancing\": \"seq_aux_loss\", \"aux_loss_coeff\": 0.1}", 2, 3, 1.0, false},
    {"seq_aux_loss alone", "{\"load_balancing\": \"seq_aux_loss\", \"aux_loss_coeff\": 0.1}", 2, 2, 1.0, true},
    {"global_aux_loss", "{\"load_balancing\": \"global_aux_loss\", \"aux_loss_coeff\": 0.1}", 2, 0, 1.0, false},
    {"z_loss", "{\"z_loss_coeff\": 0.05}", 2, 0, 2.0, false},
    {"z_loss alone", "{\"z_loss_coeff\": 0.05}", 2, 0, 1.0, true},
    {"capacity probs", "{\"capacity_factor\": 0.5}", 2, 0, 1.0, false},
    {"capacity position pre_softmax", "{\"pre_softmax\": true, \"capacity_factor\": 0.5, "
                                      "\"drop_policy\": \"position\"}", 2, 0, 1.0, false},
    {"capacity sigmoid", "{\"score_function\": \"sigmoid\", \"capacity_factor\": 0.6}", 3, 0, 1.0, false},
    {"sinkhorn", "{\"load_balancing\": \"sinkhorn\"}", 2, 0, 1.0, false},
    {"sinkhorn top-1", "{\"load_balancing\": \"sinkhorn\"}", 1, 0, 1.0, false},
    {"pre_softmax + aux + z + capacity", "{\"pre_softmax\": true, \"load_balancing\": \"aux_loss\", "
                                         "\"aux_loss_coeff\": 0.05, \"z_loss_coeff\": 0.01, "
                                         "\"capacity_factor\": 0.5}", 2, 0, 0.5, false},
};

typedef struct grad_state {
    test_instance ti;
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

/* One forward on the current x and w; returns L, or NAN on failure. */
static double forward_loss(grad_state *s)
{
    moert_tensor tx = moert_tensor_2d(s->x, moert_cpu(), MOERT_F64, T, H);
    moert_tensor tw = moert_tensor_2d(s->w, moert_cpu(), MOERT_F64, E, H);
    moert_tensor tidx = moert_tensor_2d(s->idx, moert_cpu(), MOERT_I32, T, s->K);
    moert_tensor tprobs = moert_tensor_2d(s->probs, moert_cpu(), MOERT_F64, T, s->K);
    moert_tensor ttpe = moert_tensor_1d(s->tpe, moert_cpu(), MOERT_I64, E);
    moert_router_forward_args args = {
        .struct_size = sizeof args, .x = &tx, .weight = &tw, .topk_idx = &tidx, .topk_probs = &tprobs,
        .tokens_per_expert = &ttpe, .losses = &s->losses, .seq_length = s->seq_length};
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
                    fprintf(stderr, "%s: token %d has a near-tie between experts %d and %d; pick another seed\n",
                            name, t, a, b);
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
    moert_layer_info layer = test_layer(H, 4, E, m->K, T, 1, 0, MOERT_F64);
    moert_result rc = test_instance_open(&s.ti, MOERT_KIND_ROUTER, "topk", m->options, &layer, NULL, 0, 1);
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
    moert_router_backward_args bargs = {.struct_size = sizeof bargs, .x = &tx, .weight = &tw, .d_topk_probs = &tdp,
                                        .loss_scale = m->loss_scale, .d_x = &tdx, .d_weight = &tdw};
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

int main(void)
{
    int n = (int)(sizeof modes / sizeof modes[0]);
    for (int i = 0; i < n; i++) check_mode(&modes[i], 23); /* a seed whose logits have no gap below 0.04 */
    return test_finish("test_router_grad");
}
