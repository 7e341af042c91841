/* SPDX-License-Identifier: Apache-2.0 */
/* moert_runtime_step, the one-step function `moert ab` drives: N calls train exactly as moert_runtime_train
 * for N steps, and the step leaves its output and parameter gradients in place, equal to those of
 * moert_runtime_forward_backward on a fresh runtime. */
#include "runtime.h"
#include "test_util.h"

static const char *config_json =
    "{\"model\": {\"hidden\": 16, \"ffn_hidden\": 24, \"num_experts\": 4, \"topk\": 2, \"num_layers\": 2},"
    " \"parallel\": {\"ranks\": 2}, \"train\": {\"tokens_per_rank\": 32, \"seed\": 5, \"lr\": 0.01},"
    " \"router\": {\"score_function\": \"sigmoid\", \"expert_bias\": true, \"bias_update_rate\": 0.05}}";

static moert_runtime *create(moert_config **cfg)
{
    moert_runtime *rt = NULL;
    EXPECT_OK(moert_config_load_string(config_json, "ab-test", cfg));
    if (*cfg) EXPECT_OK(moert_runtime_create(*cfg, &rt));
    return rt;
}

/* Every parameter value (or gradient) of both runtimes, bit for bit; returns how many differ. */
static int64_t count_param_differences(moert_runtime *a, moert_runtime *b, bool gradients)
{
    int64_t differ = 0;
    for (int l = 0; l < a->cfg->model.num_layers; l++)
        for (int p = 0; p < MOERT_PARAM_COUNT; p++)
            for (int64_t i = 0; i < moert_runtime_param_numel(a, (moert_param_id)p); i++) {
                double va = 0, ga = 0, vb = 0, gb = 0;
                EXPECT_OK(moert_runtime_param(a, l, (moert_param_id)p, i, MOERT_PARAM_READ, &va, &ga));
                EXPECT_OK(moert_runtime_param(b, l, (moert_param_id)p, i, MOERT_PARAM_READ, &vb, &gb));
                if (gradients ? ga != gb : va != vb) differ++;
            }
    return differ;
}

int main(void)
{
    const int steps = 4;
    moert_config *c_train = NULL, *c_step = NULL, *c_fb = NULL, *c_one = NULL;
    moert_runtime *trained = create(&c_train), *stepped = create(&c_step);
    moert_runtime *fb = create(&c_fb), *one = create(&c_one);
    if (!trained || !stepped || !fb || !one) {
        test_failures++;
        goto done;
    }

    /* N steps one by one == moert_runtime_train for N steps */
    moert_train_options opts = {.struct_size = sizeof opts, .progress = NULL, .steps = steps};
    EXPECT_OK(moert_runtime_train(trained, &opts));
    EXPECT_EQ_INT(trained->record_count, steps);
    for (int s = 1; s <= steps && trained->record_count == steps; s++) {
        moert_step_record rec;
        memset(&rec, 0xff, sizeof rec);
        EXPECT_OK(moert_runtime_step(stepped, s, &rec));
        const moert_step_record *want = &trained->records[s - 1];
        EXPECT_EQ_INT(rec.step, s);
        EXPECT(rec.loss == want->loss);
        EXPECT(rec.mse == want->mse);
        EXPECT(rec.router_loss == want->router_loss);
        EXPECT(rec.imbalance == want->imbalance);
        EXPECT(rec.seconds > 0.0);
        EXPECT(rec.stage_seconds[MOERT_LAYER_STAGES - 1] /* the backward */ > 0.0);
    }
    EXPECT_EQ_INT(stepped->record_count, 0); /* the runtime's own records are moert_runtime_train's */
    EXPECT_EQ_INT(count_param_differences(trained, stepped, false), 0);
    EXPECT_EQ_INT(count_param_differences(trained, stepped, true), 0);
    EXPECT(stepped->kept_bytes > 0);
    EXPECT_EQ_INT(stepped->kept_bytes, trained->kept_bytes);
    for (int a = 0; a < MOERT_ACT_COUNT; a++) EXPECT_EQ_INT(stepped->activation_bytes[a], trained->activation_bytes[a]);
    EXPECT_EQ_INT(stepped->device_peak_bytes, 0);
    printf("%d steps one by one match moert_runtime_train: loss %.6f -> %.6f\n", steps, trained->records[0].loss,
           trained->records[steps - 1].loss);

    /* after one step, its output and gradients are those of forward_backward, values are updated */
    double fb_loss = 0;
    moert_step_record first;
    EXPECT_OK(moert_runtime_forward_backward(fb, 1, &fb_loss));
    EXPECT_OK(moert_runtime_step(one, 1, &first));
    EXPECT(first.loss == fb_loss);
    EXPECT_EQ_INT(count_param_differences(fb, one, true), 0);
    int64_t values_moved = count_param_differences(fb, one, false);
    EXPECT(values_moved > 0);
    int64_t n_out = moert_runtime_output_numel(one), out_differ = 0, out_nonzero = 0;
    EXPECT_EQ_INT(n_out, 2 * 32 * 16);
    for (int64_t i = 0; i < n_out; i++) {
        double a = 0, b = 0;
        EXPECT_OK(moert_runtime_output(fb, i, &a));
        EXPECT_OK(moert_runtime_output(one, i, &b));
        if (a != b) out_differ++;
        if (a != 0.0) out_nonzero++;
    }
    EXPECT_EQ_INT(out_differ, 0);
    EXPECT(out_nonzero > n_out / 2);

    /* bad arguments */
    EXPECT_EQ_INT(moert_runtime_step(one, 0, NULL), MOERT_ERR_INVALID_ARGUMENT);
    EXPECT(strcmp(moert_error_message(), "moert_runtime_step: step 0, expected >= 1") == 0);
    double v = 0;
    EXPECT_EQ_INT(moert_runtime_output(one, n_out, &v), MOERT_ERR_INVALID_ARGUMENT);
    EXPECT(strcmp(moert_error_message(), "output element 1024 does not exist") == 0);
    EXPECT_OK(moert_runtime_step(one, 2, NULL)); /* the record is optional */

done:
    moert_runtime_destroy(trained);
    moert_runtime_destroy(stepped);
    moert_runtime_destroy(fb);
    moert_runtime_destroy(one);
    moert_config_free(c_train);
    moert_config_free(c_step);
    moert_config_free(c_fb);
    moert_config_free(c_one);
    return test_finish("ab");
}
