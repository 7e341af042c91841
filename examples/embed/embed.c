/* SPDX-License-Identifier: Apache-2.0 */
/* Embedding moert in a C program: a 2-layer MoE stack of one rank on the CPU, run forward and backward on buffers
 * this program owns, checked against a naive reference written here from the formulas (softmax top-k router,
 * SwiGLU experts weighted by their routing probability, copies summed back into their token).
 *
 * Build against an installed moert:  PKG_CONFIG_PATH=PREFIX/lib/.../pkgconfig make && ./embed
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <moert/moert.h>

enum { T = 20, H = 12, F = 10, E = 6, K = 2, LAYERS = 2 };

static const char *config =
    "{\"model\": {\"hidden\": 12, \"ffn_hidden\": 10, \"num_experts\": 6, \"topk\": 2, \"num_layers\": 2,"
    " \"dtype\": \"fp64\"}, \"train\": {\"tokens_per_rank\": 20}, \"router\": {\"score_function\": \"softmax\"}}";

#define CHECK(call)                                                                                                    \
    do {                                                                                                               \
        moert_result r_ = (call);                                                                                      \
        if (r_ != MOERT_OK) {                                                                                          \
            fprintf(stderr, "embed: %s failed: %s: %s\n", #call, moert_result_name(r_), moert_last_error());           \
            exit(1);                                                                                                   \
        }                                                                                                              \
    } while (0)

/* The layer's parameters, owned here: router [E,H], fc1 [E,H,2F], fc2 [E,F,H], and their gradients. */
typedef struct params {
    double router[E * H], fc1[E * H * 2 * F], fc2[E * F * H];
    double d_router[E * H], d_fc1[E * H * 2 * F], d_fc2[E * F * H];
} params;

static double silu(double a) { return a / (1.0 + exp(-a)); }

/* y = MoE(x) by the formulas: idx = top-K logits, probs = softmax over those K logits, then for each copy
 * y[t] += fc2_e^T (silu(gate) * up * prob), [gate | up] = fc1_e^T x[t]. */
static void reference_forward(const params *p, const double *x, double *y)
{
    memset(y, 0, sizeof(double) * T * H);
    for (int t = 0; t < T; t++) {
        double logit[E];
        for (int e = 0; e < E; e++) {
            logit[e] = 0;
            for (int h = 0; h < H; h++) logit[e] += x[t * H + h] * p->router[e * H + h];
        }
        int idx[K];
        for (int k = 0; k < K; k++) { /* the largest logits, the lower index on a tie */
            idx[k] = -1;
            for (int e = 0; e < E; e++) {
                int taken = 0;
                for (int j = 0; j < k; j++) taken |= idx[j] == e;
                if (!taken && (idx[k] < 0 || logit[e] > logit[idx[k]])) idx[k] = e;
            }
        }
        double norm = 0, prob[K];
        for (int k = 0; k < K; k++) norm += exp(logit[idx[k]] - logit[idx[0]]);
        for (int k = 0; k < K; k++) prob[k] = exp(logit[idx[k]] - logit[idx[0]]) / norm;
        for (int k = 0; k < K; k++) {
            int e = idx[k];
            double act[F];
            for (int f = 0; f < F; f++) {
                double gate = 0, up = 0;
                for (int h = 0; h < H; h++) {
                    gate += x[t * H + h] * p->fc1[(e * H + h) * 2 * F + f];
                    up += x[t * H + h] * p->fc1[(e * H + h) * 2 * F + F + f];
                }
                act[f] = silu(gate) * up * prob[k];
            }
            for (int h = 0; h < H; h++)
                for (int f = 0; f < F; f++) y[t * H + h] += act[f] * p->fc2[(e * F + f) * H + h];
        }
    }
}

static double loss_of(const params *p, const double *x, const double *r)
{
    double h1[T * H], y[T * H], loss = 0;
    reference_forward(&p[0], x, h1);
    reference_forward(&p[1], h1, y);
    for (int i = 0; i < T * H; i++) loss += y[i] * r[i];
    return loss;
}

int main(void)
{
    moert_config *cfg = NULL;
    moert_layers *layers = NULL;
    CHECK(moert_config_load_string(config, "embed-example", &cfg));
    moert_launch launch = {.struct_size = sizeof launch, .rank = 0, .world_size = 1, .device = moert_cpu()};
    CHECK(moert_layers_create(cfg, &launch, &layers));
    moert_config_free(cfg);

    /* the parameters are this program's memory, bound into moert, initialised by moert */
    static params p[LAYERS];
    for (int l = 0; l < LAYERS; l++) {
        double *value[3] = {p[l].router, p[l].fc1, p[l].fc2}, *grad[3] = {p[l].d_router, p[l].d_fc1, p[l].d_fc2};
        for (int w = MOERT_PARAM_ROUTER; w <= MOERT_PARAM_FC2; w++) { /* no shared expert here */
            moert_tensor v, g;
            CHECK(moert_layers_param_desc(layers, l, (moert_param_id)w, &v));
            g = v;
            v.data = value[w];
            g.data = grad[w];
            CHECK(moert_layers_bind_param(layers, l, (moert_param_id)w, &v, &g));
        }
    }
    CHECK(moert_layers_init_params(layers, 42, NULL));

    double x[T * H], r[T * H], h1[T * H], y[T * H], dh1[T * H], dx[T * H], want[T * H];
    unsigned s = 1;
    for (int i = 0; i < T * H; i++) {
        s = s * 1103515245u + 12345u;
        x[i] = (double)(s >> 8) / 16777216.0 - 0.5;
        s = s * 1103515245u + 12345u;
        r[i] = (double)(s >> 8) / 16777216.0 - 0.5;
    }
    moert_tensor tx = moert_tensor_2d(x, moert_cpu(), MOERT_F64, T, H), th1 = tx, ty = tx, tr = tx, tdh1 = tx, tdx = tx;
    th1.data = h1, ty.data = y, tr.data = r, tdh1.data = dh1, tdx.data = dx;

    /* forward through both layers, keeping what the backward needs; then the backward from d(loss)/dy = r */
    moert_saved *saved[LAYERS];
    CHECK(moert_moe_forward(layers, 0, &tx, &th1, NULL, &saved[0], NULL));
    CHECK(moert_moe_forward(layers, 1, &th1, &ty, NULL, &saved[1], NULL));
    moert_backward_options opts = {.struct_size = sizeof opts, .router_loss_scale = 1.0, .accumulate = false};
    CHECK(moert_moe_backward(layers, saved[1], &tr, &tdh1, &opts, NULL));
    CHECK(moert_moe_backward(layers, saved[0], &tdh1, &tdx, &opts, NULL));

    /* the output against the reference */
    double worst_y = 0;
    reference_forward(&p[0], x, h1);
    reference_forward(&p[1], h1, want);
    for (int i = 0; i < T * H; i++) worst_y = fmax(worst_y, fabs(y[i] - want[i]));
    /* gradients against central differences of the reference loss */
    double worst_g = 0, eps = 1e-6;
    double *probe[4] = {&x[5], &p[0].fc1[77], &p[1].fc2[31], &p[0].router[9]};
    double grad[4] = {dx[5], p[0].d_fc1[77], p[1].d_fc2[31], p[0].d_router[9]};
    for (int i = 0; i < 4; i++) {
        double keep = *probe[i];
        *probe[i] = keep + eps;
        double up = loss_of(p, x, r);
        *probe[i] = keep - eps;
        double down = loss_of(p, x, r);
        *probe[i] = keep;
        double fd = (up - down) / (2 * eps);
        worst_g = fmax(worst_g, fabs(grad[i] - fd) / (1e-6 + fabs(fd)));
    }
    moert_layers_destroy(layers);
    printf("embed: %d layers, %d tokens: |y - reference| <= %.2e, gradients within %.2e of finite differences\n",
           LAYERS, T, worst_y, worst_g);
    if (worst_y > 1e-12 || worst_g > 1e-5) {
        fprintf(stderr, "embed: FAILED\n");
        return 1;
    }
    printf("embed: ok\n");
    return 0;
}
