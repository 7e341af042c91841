/* SPDX-License-Identifier: Apache-2.0 */
/* Expert parallelism changes nothing: 1, 2 and 4 ranks give the same loss, gradients and training curve. */
#include "runtime.h"
#include "test_util.h"

#define GLOBAL_TOKENS 32

static const char *config_fmt =
    "{\"model\": {\"hidden\": 8, \"ffn_hidden\": 6, \"num_experts\": 8, \"topk\": 2, \"num_layers\": 2, \"dtype\": "
    "\"fp64\"},"
    " \"parallel\": {\"ranks\": %d}, \"train\": {\"tokens_per_rank\": %d, \"seed\": 11, \"lr\": 0.01},"
    " \"router\": {\"score_function\": \"%s\", \"expert_bias\": %s, \"z_loss_coeff\": 0.001},"
    " \"precision\": {\"mode\": \"fp64\"}}";

typedef struct outcome {
    double loss;
    double *grads; /* every parameter of every layer, global order */
    double curve[6];
} outcome;

static int64_t total_params(moert_runtime *rt, int layers)
{
    int64_t n = 0;
    for (int p = 0; p < MOERT_PARAM_COUNT; p++) n += moert_runtime_param_numel(rt, (moert_param_id)p);
    return n * layers;
}

static void run(int ranks, const char *score, const char *bias, outcome *out)
{
    char json[1024];
    snprintf(json, sizeof json, config_fmt, ranks, GLOBAL_TOKENS / ranks, score, bias);
    moert_config *cfg = NULL;
    moert_runtime *rt = NULL;
    EXPECT_OK(moert_config_load_string(json, "ep-test", &cfg));
    EXPECT_OK(moert_runtime_create(cfg, &rt));
    if (!rt) goto exit;
    EXPECT_OK(moert_runtime_forward_backward(rt, 1, &out->loss));
    out->grads = calloc((size_t)total_params(rt, 2), sizeof(double));
    int64_t k = 0;
    for (int l = 0; l < 2; l++)
        for (int p = 0; p < MOERT_PARAM_COUNT; p++)
            for (int64_t i = 0; i < moert_runtime_param_numel(rt, (moert_param_id)p); i++)
                moert_runtime_param(rt, l, (moert_param_id)p, i, MOERT_PARAM_READ, NULL, &out->grads[k++]);
    moert_train_options opts = {.struct_size = sizeof opts, .progress = NULL, .steps = 6};
    EXPECT_OK(moert_runtime_train(rt, &opts));
    for (int s = 0; s < 6 && s < rt->record_count; s++) out->curve[s] = rt->records[s].loss;
exit:
    moert_runtime_destroy(rt);
    moert_config_free(cfg);
}

static void compare(const char *score, const char *bias)
{
    outcome o[3] = {{0}};
    int ranks[3] = {1, 2, 4};
    for (int i = 0; i < 3; i++) run(ranks[i], score, bias, &o[i]);
    int64_t n = (int64_t)(3 * 8 * 8 * 6 + 8 * 8) * 2; /* fc1 + fc2 + router, two layers */
    for (int i = 1; i < 3; i++) {
        if (!o[0].grads || !o[i].grads) {
            test_failures++;
            continue;
        }
        EXPECT_NEAR(o[i].loss, o[0].loss, 1e-13, 1e-11);
        int bad = 0;
        for (int64_t j = 0; j < n; j++)
            if (!(fabs(o[i].grads[j] - o[0].grads[j]) <= 1e-13 + 1e-9 * fabs(o[0].grads[j]))) bad++;
        if (bad) {
            fprintf(stderr, "%s/%s: %d of %lld gradients differ between 1 and %d ranks\n", score, bias, bad,
                    (long long)n, ranks[i]);
            test_failures++;
        }
        for (int s = 0; s < 6; s++) EXPECT_NEAR(o[i].curve[s], o[0].curve[s], 1e-12, 1e-9);
    }
    printf("%s, expert_bias %s: loss %.12f at 1, 2 and 4 ranks; after 6 steps %.12f\n", score, bias, o[0].loss,
           o[0].curve[5]);
    for (int i = 0; i < 3; i++) free(o[i].grads);
}

int main(void)
{
    compare("softmax", "false");
    compare("sigmoid", "true");
    return test_finish("expert_parallel");
}
