/* SPDX-License-Identifier: Apache-2.0 */
/* Gradients of the whole layer stack (router with its losses, dispatch, experts, combine, the shared expert) against central
 * finite differences, in fp64, over 2 ranks. */
#include "runtime.h"
#include "test_util.h"

#include "error.h"

static const char *const configs[] = {
    /* softmax top-k with aux loss and z-loss, capacity with drops */
    "{\"model\": {\"hidden\": 8, \"ffn_hidden\": 6, \"num_experts\": 4, \"topk\": 2, \"num_layers\": 2, \"dtype\": "
    "\"fp64\"},"
    " \"parallel\": {\"ranks\": 2}, \"train\": {\"tokens_per_rank\": 6, \"seed\": 3},"
    " \"router\": {\"score_function\": \"softmax\", \"load_balancing\": \"aux_loss\", \"aux_loss_coeff\": 0.05,"
    "              \"z_loss_coeff\": 0.01, \"capacity_factor\": 1.0},"
    " \"precision\": {\"mode\": \"fp64\"}}",
    /* sigmoid with groups, scaling and expert bias; pre-softmax is covered by the router's own test */
    "{\"model\": {\"hidden\": 8, \"ffn_hidden\": 4, \"num_experts\": 8, \"topk\": 4, \"num_layers\": 2, \"dtype\": "
    "\"fp64\"},"
    " \"parallel\": {\"ranks\": 2}, \"train\": {\"tokens_per_rank\": 5, \"seed\": 5},"
    " \"router\": {\"score_function\": \"sigmoid\", \"num_groups\": 4, \"group_topk\": 2, \"scaling_factor\": 2.5,"
    "              \"expert_bias\": true, \"load_balancing\": \"seq_aux_loss\", \"aux_loss_coeff\": 0.02},"
    " \"precision\": {\"mode\": \"fp64\"}}",
    /* one rank, softmax with pre-softmax scores, padding to capacity in the dispatcher */
    "{\"model\": {\"hidden\": 6, \"ffn_hidden\": 5, \"num_experts\": 4, \"topk\": 2, \"num_layers\": 1, \"dtype\": "
    "\"fp64\"},"
    " \"parallel\": {\"ranks\": 1}, \"train\": {\"tokens_per_rank\": 7, \"seed\": 9},"
    " \"router\": {\"score_function\": \"softmax\", \"pre_softmax\": true, \"z_loss_coeff\": 0.01},"
    " \"dispatcher\": {\"pad_to_capacity\": true, \"capacity_factor\": 2.0},"
    " \"precision\": {\"mode\": \"fp64\"}}",
    /* a shared expert with its sigmoid gate beside the routed experts, over 2 ranks (its gradients summed) */
    "{\"model\": {\"hidden\": 8, \"ffn_hidden\": 4, \"num_experts\": 4, \"topk\": 2, \"num_layers\": 2, \"dtype\": "
    "\"fp64\","
    "            \"shared_expert_ffn_hidden\": 6, \"shared_expert_gate\": true},"
    " \"parallel\": {\"ranks\": 2}, \"train\": {\"tokens_per_rank\": 5, \"seed\": 4},"
    " \"router\": {\"score_function\": \"softmax\", \"load_balancing\": \"aux_loss\", \"aux_loss_coeff\": 0.05},"
    " \"precision\": {\"mode\": \"fp64\"}}",
};

static void check_config(const char *json, int which)
{
    moert_config *cfg = NULL;
    moert_runtime *rt = NULL;
    EXPECT_OK(moert_config_load_string(json, "grad-test", &cfg));
    if (!cfg) return;
    EXPECT_OK(moert_runtime_create(cfg, &rt));
    if (!rt) goto exit;
    double loss = 0.0;
    EXPECT_OK(moert_runtime_forward_backward(rt, 1, &loss));
    EXPECT(loss > 0.0);
    int checked = 0, worst_p = -1;
    double worst = 0.0;
    for (int layer = 0; layer < cfg->model.num_layers; layer++) {
        for (int p = 0; p < MOERT_PARAM_COUNT; p++) {
            int64_t n = moert_runtime_param_numel(rt, (moert_param_id)p);
            if (n == 0) continue; /* a shared-expert parameter of a config without one */
            /* a spread of indices over every expert */
            int samples = 12;
            int64_t idx[12];
            double grad[12], value[12];
            for (int s = 0; s < samples; s++) {
                idx[s] = (int64_t)((s * 7919 + layer * 31 + p * 17) % n);
                EXPECT_OK(
                    moert_runtime_param(rt, layer, (moert_param_id)p, idx[s], MOERT_PARAM_READ, &value[s], &grad[s]));
            }
            for (int s = 0; s < samples; s++) {
                const double eps = 1e-6;
                double v = value[s] + eps, lp = 0, lm = 0;
                moert_runtime_param(rt, layer, (moert_param_id)p, idx[s], MOERT_PARAM_WRITE, &v, NULL);
                EXPECT_OK(moert_runtime_forward_backward(rt, 1, &lp));
                v = value[s] - eps;
                moert_runtime_param(rt, layer, (moert_param_id)p, idx[s], MOERT_PARAM_WRITE, &v, NULL);
                EXPECT_OK(moert_runtime_forward_backward(rt, 1, &lm));
                moert_runtime_param(rt, layer, (moert_param_id)p, idx[s], MOERT_PARAM_WRITE, &value[s], NULL);
                double fd = (lp - lm) / (2 * eps);
                double err = fabs(fd - grad[s]) / (1e-7 + fabs(fd));
                if (err > worst) {
                    worst = err;
                    worst_p = p;
                }
                if (!(fabs(fd - grad[s]) <= 1e-8 + 1e-5 * fabs(fd))) {
                    fprintf(stderr, "config %d layer %d param %d[%lld]: backward %.10g, finite difference %.10g\n",
                            which, layer, p, (long long)idx[s], grad[s], fd);
                    test_failures++;
                }
                checked++;
            }
        }
    }
    printf("config %d: %d gradients checked, worst relative error %.2e (param %d)\n", which, checked, worst, worst_p);
exit:
    moert_runtime_destroy(rt);
    moert_config_free(cfg);
}

int main(void)
{
    for (int i = 0; i < (int)(sizeof configs / sizeof configs[0]); i++) check_config(configs[i], i);
    return test_finish("layer_grad");
}
