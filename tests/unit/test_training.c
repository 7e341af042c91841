/* SPDX-License-Identifier: Apache-2.0 */
/* The main job trains: the loss falls, expert-bias balancing evens the load, and the memory policies
 * (recompute, offload) give bit-identical results to keeping everything. */
#include <string.h>

#include "runtime.h"
#include "test_util.h"

static const char *base =
    "{\"model\": {\"hidden\": 32, \"ffn_hidden\": 48, \"num_experts\": 8, \"topk\": 2, \"num_layers\": 2},"
    " \"parallel\": {\"ranks\": 2}, \"train\": {\"tokens_per_rank\": 128, \"seed\": 2, \"lr\": 0.003},"
    " \"router\": {\"score_function\": \"sigmoid\", \"expert_bias\": %s, \"bias_update_rate\": 0.01},"
    " \"memory_policy\": {\"dispatched_x\": \"%s\", \"fc1_out\": \"%s\", \"swiglu_out\": \"%s\"}}";

static moert_runtime *train(const char *bias, const char *a, const char *b, const char *c, int steps,
                            moert_config **cfg_out)
{
    char json[1024];
    snprintf(json, sizeof json, base, bias, a, b, c);
    moert_runtime *rt = NULL;
    EXPECT_OK(moert_config_load_string(json, "training-test", cfg_out));
    if (!*cfg_out) return NULL;
    EXPECT_OK(moert_runtime_create(*cfg_out, &rt));
    if (!rt) return NULL;
    moert_train_options opts = {.struct_size = sizeof opts, .progress = NULL, .steps = steps};
    EXPECT_OK(moert_runtime_train(rt, &opts));
    return rt;
}

static double mean_imbalance(const moert_runtime *rt, int from, int to)
{
    double s = 0;
    for (int i = from; i < to; i++) s += rt->records[i].imbalance;
    return s / (to - from);
}

int main(void)
{
    moert_config *c1 = NULL, *c2 = NULL, *c3 = NULL;
    const int steps = 80;
    moert_runtime *with_bias = train("true", "keep", "keep", "keep", steps, &c1);
    moert_runtime *no_bias = train("false", "keep", "keep", "keep", steps, &c2);
    if (with_bias && no_bias && with_bias->record_count == steps && no_bias->record_count == steps) {
        double first = with_bias->records[0].loss, last = with_bias->records[steps - 1].loss;
        printf("loss %.5f -> %.5f; load max/mean over the last 20 steps: %.3f with bias, %.3f without\n", first, last,
               mean_imbalance(with_bias, steps - 20, steps), mean_imbalance(no_bias, steps - 20, steps));
        EXPECT(last < 0.5 * first);
        EXPECT(mean_imbalance(with_bias, steps - 20, steps) < mean_imbalance(no_bias, steps - 20, steps));
        EXPECT(mean_imbalance(with_bias, steps - 20, steps) < mean_imbalance(with_bias, 0, 5));
        /* the bias moved, and against the load: the most loaded expert's bias went down */
        EXPECT(with_bias->final_bias != NULL);
    } else {
        test_failures++;
    }

    /* recompute and offload change memory, never values */
    moert_runtime *policy = train("true", "offload", "recompute", "recompute", 5, &c3);
    moert_runtime *keep = with_bias;
    moert_config *c4 = NULL;
    moert_runtime *keep5 = train("true", "keep", "keep", "keep", 5, &c4);
    (void)keep;
    if (policy && keep5) {
        for (int s = 0; s < 5; s++) EXPECT(policy->records[s].loss == keep5->records[s].loss);
        EXPECT(policy->kept_bytes < keep5->kept_bytes);
        printf("activations kept forward->backward: %lld bytes with keep, %lld with offload/recompute\n",
               (long long)keep5->kept_bytes, (long long)policy->kept_bytes);
    } else {
        test_failures++;
    }
    /* train.input_shift: centred inputs (0) route more evenly at the start than the default shift (0.5) */
    double first_imbalance[2] = {0, 0};
    for (int i = 0; i < 2; i++) {
        char json[512];
        snprintf(json, sizeof json,
                 "{\"model\": {\"hidden\": 32, \"ffn_hidden\": 16, \"num_experts\": 16, \"topk\": 2},"
                 " \"train\": {\"tokens_per_rank\": 2048, \"seed\": 5, \"input_shift\": %s}}",
                 i == 0 ? "0" : "0.5");
        moert_config *cfg = NULL;
        moert_runtime *rt = NULL;
        EXPECT_OK(moert_config_load_string(json, "input-shift-test", &cfg));
        if (cfg) EXPECT_OK(moert_runtime_create(cfg, &rt));
        moert_train_options opts = {.struct_size = sizeof opts, .progress = NULL, .steps = 1};
        if (rt) EXPECT_OK(moert_runtime_train(rt, &opts));
        if (rt && rt->record_count == 1) first_imbalance[i] = rt->records[0].imbalance;
        moert_runtime_destroy(rt);
        moert_config_free(cfg);
    }
    printf("first-step load max/mean: %.3f with input_shift 0, %.3f with 0.5\n", first_imbalance[0],
           first_imbalance[1]);
    EXPECT(first_imbalance[0] > 0 && first_imbalance[0] < first_imbalance[1]);

    /* $.parallel.cuda_graph on the CPU: "auto" runs eagerly and says why; "on" fails naming the key, when the runtime
     * is made (so moert check says it too), not at the first step */
    for (int mode = 0; mode < 2; mode++) {
        char json[512];
        snprintf(json, sizeof json,
                 "{\"model\": {\"hidden\": 16, \"ffn_hidden\": 16, \"num_experts\": 4, \"topk\": 2},"
                 " \"parallel\": {\"device\": \"cpu\", \"cuda_graph\": \"%s\"}, \"train\": {\"tokens_per_rank\": 32}}",
                 mode == 0 ? "auto" : "on");
        moert_config *cfg = NULL;
        moert_runtime *rt = NULL;
        EXPECT_OK(moert_config_load_string(json, "graph-mode-test", &cfg));
        moert_result made = cfg ? moert_runtime_create(cfg, &rt) : MOERT_ERR_INTERNAL;
        moert_train_options opts = {.struct_size = sizeof opts, .progress = NULL, .steps = 3};
        if (mode == 0) {
            EXPECT_OK(made);
            if (rt) {
                EXPECT_OK(moert_runtime_train(rt, &opts));
                char line[512];
                moert_runtime_graph_summary(rt, line, sizeof line);
                EXPECT_EQ_INT(rt->graph_captured_step, 0);
                EXPECT(strcmp(line, "not used: the ranks run on the CPU") == 0);
            }
        } else {
            EXPECT_EQ_INT(made, MOERT_ERR_CONFIG);
            EXPECT(rt == NULL);
            EXPECT(strstr(moert_error_message(), "config error at $.parallel.cuda_graph: \"on\" needs a layer step "
                                                 "that can be captured in a CUDA graph, but the ranks run on the CPU"));
        }
        moert_runtime_destroy(rt);
        moert_config_free(cfg);
    }

    moert_runtime_destroy(with_bias);
    moert_runtime_destroy(no_bias);
    moert_runtime_destroy(policy);
    moert_runtime_destroy(keep5);
    moert_config_free(c1);
    moert_config_free(c2);
    moert_config_free(c3);
    moert_config_free(c4);
    return test_finish("training");
}
