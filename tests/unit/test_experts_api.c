/* SPDX-License-Identifier: Apache-2.0 */
/* The experts alone through the embedding API (moert_experts_forward / _backward) on the CPU, public calls only:
 * - fp64: the output against a naive reference of fc1, SwiGLU times the prob and fc2 per local expert, with experts
 *   that get no rows and padding rows past the counts (zero in y and dx);
 * - the backward against finite differences of sum(y * r): dx, d_probs, fc1 and fc2 gradients; probs NULL is a prob
 *   of 1; accumulate adds, overwrite writes;
 * - zero rows: a forward and backward with nothing to compute write zero gradients;
 * - fp32 through the bf16 precision plugin: the reference to fp32 rounding;
 * - misuse is refused with a message naming it (counts summing past the rows, an unbound weight, a moert_moe_forward
 *   handle given to moert_experts_backward and the reverse, a second forward in flight). */
#include <math.h>
#include <string.h>

#include "moert/moert.h"
#include "test_util.h"

#define H 12
#define F 10
#define E 4

static const char *const config_fmt =
    "{\"model\": {\"hidden\": 12, \"ffn_hidden\": 10, \"num_experts\": 4, \"topk\": 2, \"num_layers\": 2,"
    " \"dtype\": \"%s\"}, \"parallel\": {\"ranks\": 1, \"device\": \"cpu\"}, \"train\": {\"tokens_per_rank\": 16}}";

static double uniform(uint64_t *s)
{
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(*s >> 11) / 9007199254740992.0 * 2.0 - 1.0;
}

/* Layers of the given dtype with layer `l`'s fc1 and fc2 bound to w1 [E, H, 2F], w2 [E, F, H] and their gradients
 * (fp32 parameters are fp32, fp64 ones fp64: void pointers of param dtype). */
static moert_layers *open_layers(const char *dtype, int l, void *w1, void *g1, void *w2, void *g2)
{
    char json[1024];
    snprintf(json, sizeof json, config_fmt, dtype);
    moert_config *cfg = NULL;
    EXPECT_OK(moert_config_load_string(json, "experts-api", &cfg));
    moert_layers *m = NULL;
    moert_launch launch = {.struct_size = sizeof launch, .rank = 0, .world_size = 1, .device = moert_cpu()};
    EXPECT_OK(moert_layers_create(cfg, &launch, &m));
    moert_config_free(cfg);
    if (!m) return NULL;
    moert_tensor d1, d2;
    EXPECT_OK(moert_layers_param_desc(m, l, MOERT_PARAM_FC1, &d1));
    EXPECT_OK(moert_layers_param_desc(m, l, MOERT_PARAM_FC2, &d2));
    moert_tensor v1 = d1, gr1 = d1, v2 = d2, gr2 = d2;
    v1.data = w1, gr1.data = g1, v2.data = w2, gr2.data = g2;
    EXPECT_OK(moert_layers_bind_param(m, l, MOERT_PARAM_FC1, &v1, &gr1));
    EXPECT_OK(moert_layers_bind_param(m, l, MOERT_PARAM_FC2, &v2, &gr2));
    return m;
}

/* The naive reference in double: y[r] for the rows of each expert in turn, 0 past the counts. */
static void reference(const double *x, const int64_t *counts, int64_t rows, const double *probs, const double *w1,
                      const double *w2, double *y)
{
    memset(y, 0, (size_t)(rows * H) * sizeof(double));
    int64_t r = 0;
    for (int e = 0; e < E; e++)
        for (int64_t k = 0; k < counts[e]; k++, r++) {
            double act[F];
            for (int j = 0; j < F; j++) {
                double a = 0, g = 0;
                for (int i = 0; i < H; i++) {
                    a += x[r * H + i] * w1[((int64_t)e * H + i) * 2 * F + j];
                    g += x[r * H + i] * w1[((int64_t)e * H + i) * 2 * F + F + j];
                }
                act[j] = a / (1.0 + exp(-a)) * g * (probs ? probs[r] : 1.0);
            }
            for (int o = 0; o < H; o++) {
                double s = 0;
                for (int j = 0; j < F; j++) s += act[j] * w2[((int64_t)e * F + j) * H + o];
                y[r * H + o] = s;
            }
        }
}

static moert_tensor t2(double *p, int64_t a, int64_t b) { return moert_tensor_2d(p, moert_cpu(), MOERT_F64, a, b); }

/* sum(y * r) of the experts' forward (no saving), the finite differences' loss. */
static double loss_of(moert_layers *m, int l, double *x, moert_tensor *counts, double *probs, int64_t rows,
                      const double *r)
{
    double y[32 * H];
    moert_tensor tx = t2(x, rows, H), ty = t2(y, rows, H);
    moert_tensor tp = moert_tensor_1d(probs, moert_cpu(), MOERT_F64, rows);
    EXPECT_OK(moert_experts_forward(m, l, &tx, counts, probs ? &tp : NULL, &ty, NULL, NULL));
    double loss = 0;
    for (int64_t i = 0; i < rows * H; i++) loss += y[i] * r[i];
    return loss;
}

static void test_fp64(void)
{
    static double w1[E * H * 2 * F], w2[E * F * H], g1[E * H * 2 * F], g2[E * F * H];
    uint64_t seed = 17;
    for (int i = 0; i < E * H * 2 * F; i++) w1[i] = 0.4 * uniform(&seed);
    for (int i = 0; i < E * F * H; i++) w2[i] = 0.4 * uniform(&seed);
    moert_layers *m = open_layers("fp64", 1, w1, g1, w2, g2);
    if (!m) return;
    /* expert 2 gets no rows; 3 padding rows after the 11 counted */
    int64_t counts[E] = {4, 5, 0, 2};
    const int64_t rows = 14;
    double x[14 * H], probs[14], r[14 * H], y[14 * H], want[14 * H], dx[14 * H], dp[14];
    for (int i = 0; i < rows * H; i++) x[i] = uniform(&seed), r[i] = uniform(&seed);
    for (int i = 0; i < rows; i++) probs[i] = 0.5 + 0.5 * uniform(&seed);
    moert_tensor tc = moert_tensor_1d(counts, moert_cpu(), MOERT_I64, E);
    moert_tensor tx = t2(x, rows, H), ty = t2(y, rows, H), tr = t2(r, rows, H), tdx = t2(dx, rows, H);
    moert_tensor tp = moert_tensor_1d(probs, moert_cpu(), MOERT_F64, rows);
    moert_tensor tdp = moert_tensor_1d(dp, moert_cpu(), MOERT_F64, rows);
    memset(y, 0x7f, sizeof y); /* padding rows must be written */
    moert_saved *s = NULL;
    EXPECT_OK(moert_experts_forward(m, 1, &tx, &tc, &tp, &ty, NULL, &s));
    reference(x, counts, rows, probs, w1, w2, want);
    for (int i = 0; i < rows * H; i++) EXPECT_NEAR(y[i], want[i], 1e-13, 1e-12);
    for (int i = 11 * H; i < rows * H; i++) EXPECT(y[i] == 0.0);

    memset(dx, 0x7f, sizeof dx);
    moert_backward_options overwrite = {.struct_size = sizeof overwrite, .router_loss_scale = 1.0, .accumulate = false};
    EXPECT_OK(moert_experts_backward(m, s, &tr, &tdx, &tdp, &overwrite, NULL));
    for (int i = 11 * H; i < rows * H; i++) EXPECT(dx[i] == 0.0);
    for (int i = 11; i < rows; i++) EXPECT(dp[i] == 0.0);
    for (int i = 0; i < H * 2 * F; i++) EXPECT(g1[2 * H * 2 * F + i] == 0.0); /* expert 2 */

    const double eps = 1e-6;
    uint64_t pick = 5;
    for (int n = 0; n < 8; n++) {
        int i = (int)((uniform(&pick) + 1.0) * 0.5 * 11 * H) % (11 * H);
        double keep = x[i];
        x[i] = keep + eps;
        double up = loss_of(m, 1, x, &tc, probs, rows, r);
        x[i] = keep - eps;
        double down = loss_of(m, 1, x, &tc, probs, rows, r);
        x[i] = keep;
        EXPECT_NEAR(dx[i], (up - down) / (2 * eps), 1e-8, 1e-6);
    }
    for (int i = 0; i < 11; i++) {
        double keep = probs[i];
        probs[i] = keep + eps;
        double up = loss_of(m, 1, x, &tc, probs, rows, r);
        probs[i] = keep - eps;
        double down = loss_of(m, 1, x, &tc, probs, rows, r);
        probs[i] = keep;
        EXPECT_NEAR(dp[i], (up - down) / (2 * eps), 1e-8, 1e-6);
    }
    double *ws[2] = {w1, w2}, *gs[2] = {g1, g2};
    const int numel[2] = {E * H * 2 * F, E * F * H};
    for (int w = 0; w < 2; w++)
        for (int n = 0; n < 10; n++) {
            int i = (int)((uniform(&pick) + 1.0) * 0.5 * numel[w]) % numel[w];
            double keep = ws[w][i];
            ws[w][i] = keep + eps;
            double up = loss_of(m, 1, x, &tc, probs, rows, r);
            ws[w][i] = keep - eps;
            double down = loss_of(m, 1, x, &tc, probs, rows, r);
            ws[w][i] = keep;
            EXPECT_NEAR(gs[w][i], (up - down) / (2 * eps), 1e-8, 1e-6);
        }

    /* accumulate: the same micro-batch again doubles the gradients */
    double g1_once = g1[7], g2_once = g2[9];
    moert_backward_options add = {.struct_size = sizeof add, .router_loss_scale = 1.0, .accumulate = true};
    EXPECT_OK(moert_experts_forward(m, 1, &tx, &tc, &tp, &ty, NULL, &s));
    EXPECT_OK(moert_experts_backward(m, s, &tr, &tdx, NULL, &add, NULL));
    EXPECT_NEAR(g1[7], 2 * g1_once, 1e-15, 1e-13);
    EXPECT_NEAR(g2[9], 2 * g2_once, 1e-15, 1e-13);

    /* probs NULL: a prob of 1 */
    double ones[14];
    for (int i = 0; i < rows; i++) ones[i] = 1.0;
    EXPECT_OK(moert_experts_forward(m, 1, &tx, &tc, NULL, &ty, NULL, NULL));
    reference(x, counts, rows, ones, w1, w2, want);
    for (int i = 0; i < rows * H; i++) EXPECT_NEAR(y[i], want[i], 1e-13, 1e-12);

    /* zero rows: nothing computed, the gradients written as zeros */
    int64_t none[E] = {0, 0, 0, 0};
    moert_tensor tnone = moert_tensor_1d(none, moert_cpu(), MOERT_I64, E);
    moert_tensor empty_x = t2(NULL, 0, H), empty_y = t2(NULL, 0, H), empty_dy = t2(NULL, 0, H),
                 empty_dx = t2(NULL, 0, H);
    EXPECT_OK(moert_experts_forward(m, 1, &empty_x, &tnone, NULL, &empty_y, NULL, &s));
    EXPECT_OK(moert_experts_backward(m, s, &empty_dy, &empty_dx, NULL, &overwrite, NULL));
    double gmax = 0;
    for (int i = 0; i < E * H * 2 * F; i++) gmax = fmax(gmax, fabs(g1[i]));
    for (int i = 0; i < E * F * H; i++) gmax = fmax(gmax, fabs(g2[i]));
    EXPECT(gmax == 0.0);

    /* misuse */
    int64_t too_many[E] = {4, 5, 3, 3};
    moert_tensor tmany = moert_tensor_1d(too_many, moert_cpu(), MOERT_I64, E);
    EXPECT(moert_experts_forward(m, 1, &tx, &tmany, &tp, &ty, NULL, NULL) == MOERT_ERR_INVALID_ARGUMENT);
    EXPECT_ERROR_CONTAINS("tokens_per_expert sums to 15, more than the 14 rows");
    /* counts whose sum overflows int64, and more rows than any device holds: refused, never wrapped */
    int64_t huge_counts[E] = {INT64_MAX, INT64_MAX, 2, 0};
    moert_tensor thuge = moert_tensor_1d(huge_counts, moert_cpu(), MOERT_I64, E);
    EXPECT(moert_experts_forward(m, 1, &tx, &thuge, &tp, &ty, NULL, NULL) == MOERT_ERR_INVALID_ARGUMENT);
    EXPECT_ERROR_CONTAINS("tokens_per_expert[1] is 9223372036854775807: the counts sum past any number of rows");
    moert_tensor huge_x = tx, huge_y = ty;
    huge_x.shape[0] = huge_y.shape[0] = (int64_t)1 << 62;
    EXPECT(moert_experts_forward(m, 1, &huge_x, &tc, NULL, &huge_y, NULL, NULL) == MOERT_ERR_INVALID_ARGUMENT);
    EXPECT_ERROR_CONTAINS("x_rows has 4611686018427387904 rows, more than any device holds");
    EXPECT(moert_experts_forward(m, 0, &tx, &tc, &tp, &ty, NULL, NULL) == MOERT_ERR_INVALID_ARGUMENT);
    EXPECT_ERROR_CONTAINS("layer 0's fc1 is not bound");
    moert_tensor short_probs = moert_tensor_1d(probs, moert_cpu(), MOERT_F64, rows - 1);
    EXPECT(moert_experts_forward(m, 1, &tx, &tc, &short_probs, &ty, NULL, NULL) == MOERT_ERR_INVALID_ARGUMENT);
    EXPECT_ERROR_CONTAINS("probs has size 13 in dimension 0, expected 14");
    EXPECT_OK(moert_experts_forward(m, 1, &tx, &tc, &tp, &ty, NULL, &s));
    moert_saved *again = NULL;
    EXPECT(moert_experts_forward(m, 1, &tx, &tc, &tp, &ty, NULL, &again) == MOERT_ERR_INVALID_ARGUMENT);
    EXPECT_ERROR_CONTAINS("1 micro-batch in flight per layer; $.parallel.forwards_in_flight allows up to 32");
    EXPECT(moert_moe_backward(m, s, &tr, &tdx, NULL, NULL) == MOERT_ERR_INVALID_ARGUMENT);
    EXPECT_ERROR_CONTAINS("run moert_experts_backward");
    moert_tensor wrong_rows = t2(dx, rows - 1, H);
    EXPECT(moert_experts_backward(m, s, &tr, &wrong_rows, NULL, NULL, NULL) == MOERT_ERR_INVALID_ARGUMENT);
    EXPECT_ERROR_CONTAINS("dx_rows has size 13 in dimension 0, expected 14");
    moert_saved_free(s);
    moert_layers_destroy(m);
}

/* The whole layer's handle is not an experts one. */
static void test_moe_handle(void)
{
    static double w[6][E * H * 2 * F];
    moert_layers *m = open_layers("fp64", 0, w[0], w[1], w[2], w[3]);
    if (!m) return;
    moert_tensor d;
    EXPECT_OK(moert_layers_param_desc(m, 0, MOERT_PARAM_ROUTER, &d));
    moert_tensor v = d, g = d;
    v.data = w[4], g.data = w[5];
    EXPECT_OK(moert_layers_bind_param(m, 0, MOERT_PARAM_ROUTER, &v, &g));
    /* layer 1: the whole layer is not bound, but layer 0 is */
    double x[8 * H], y[8 * H];
    uint64_t seed = 3;
    for (int i = 0; i < 8 * H; i++) x[i] = uniform(&seed), w[0][i] = 0.1 * uniform(&seed);
    moert_tensor tx = t2(x, 8, H), ty = t2(y, 8, H);
    moert_saved *s = NULL;
    EXPECT_OK(moert_moe_forward(m, 0, &tx, &ty, NULL, &s, NULL));
    EXPECT(moert_experts_backward(m, s, &ty, &tx, NULL, NULL, NULL) == MOERT_ERR_INVALID_ARGUMENT);
    EXPECT_ERROR_CONTAINS("run moert_moe_backward");
    moert_saved_free(s);
    moert_layers_destroy(m);
}

/* fp32 activations through the bf16 precision plugin: the reference within bf16-free fp32 rounding (the CPU path of
 * "bf16" in "auto" mode computes fp32 activations in fp32). */
static void test_fp32(void)
{
    static float w1[E * H * 2 * F], w2[E * F * H], g1[E * H * 2 * F], g2[E * F * H];
    static double w1d[E * H * 2 * F], w2d[E * F * H];
    uint64_t seed = 23;
    for (int i = 0; i < E * H * 2 * F; i++) w1d[i] = w1[i] = (float)(0.4 * uniform(&seed));
    for (int i = 0; i < E * F * H; i++) w2d[i] = w2[i] = (float)(0.4 * uniform(&seed));
    moert_layers *m = open_layers("fp32", 0, w1, g1, w2, g2);
    if (!m) return;
    int64_t counts[E] = {3, 0, 6, 4};
    const int64_t rows = 13;
    float x[13 * H], y[13 * H], probs[13];
    double xd[13 * H], pd[13], want[13 * H];
    for (int i = 0; i < rows * H; i++) xd[i] = x[i] = (float)uniform(&seed);
    for (int i = 0; i < rows; i++) pd[i] = probs[i] = (float)(0.5 + 0.5 * uniform(&seed));
    moert_tensor tc = moert_tensor_1d(counts, moert_cpu(), MOERT_I64, E);
    moert_tensor tx = moert_tensor_2d(x, moert_cpu(), MOERT_F32, rows, H);
    moert_tensor ty = moert_tensor_2d(y, moert_cpu(), MOERT_F32, rows, H);
    moert_tensor tp = moert_tensor_1d(probs, moert_cpu(), MOERT_F32, rows);
    EXPECT_OK(moert_experts_forward(m, 0, &tx, &tc, &tp, &ty, NULL, NULL));
    reference(xd, counts, rows, pd, w1d, w2d, want);
    double ymax = 0;
    for (int i = 0; i < rows * H; i++) ymax = fmax(ymax, fabs(want[i]));
    for (int i = 0; i < rows * H; i++) EXPECT_NEAR(y[i], want[i], 1e-5 * ymax, 0);
    moert_layers_destroy(m);
}

int main(void)
{
    EXPECT(moert_api_version() >= 4);
    test_fp64();
    test_moe_handle();
    test_fp32();
    return test_finish("experts_api");
}
