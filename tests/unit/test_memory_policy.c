/* SPDX-License-Identifier: Apache-2.0 */
/* The "default" memory policy: options parsed, decide() answers what was configured, bad values refused. */
#include "test_util.h"

#include "error.h"

#define PLUGIN "default"

/* Opens the policy with `options` and checks decide() for the three activations. */
static void check_actions(const char *options, moert_memory_action dispatched_x, moert_memory_action fc1_out,
                          moert_memory_action swiglu_out)
{
    moert_layer_info layer = test_layer(8, 16, 4, 2, 32, 1, 0, MOERT_F32);
    test_instance ti;
    moert_result rc = test_instance_open(&ti, MOERT_KIND_MEMORY_POLICY, PLUGIN, options, &layer, NULL, 0, 1);
    if (rc != MOERT_OK) {
        fprintf(stderr, "%s: open failed: %s\n", options, moert_error_message());
        test_failures++;
        test_instance_close(&ti);
        return;
    }
    const moert_memory_policy_v1 *vt = (const moert_memory_policy_v1 *)ti.plugin.header;
    const moert_memory_action want[MOERT_ACT_COUNT] = {dispatched_x, fc1_out, swiglu_out};
    for (int a = 0; a < MOERT_ACT_COUNT; a++) {
        moert_activation_info info = {.struct_size = sizeof info,
                                      .layer_index = 0,
                                      .activation = (moert_activation)a,
                                      .bytes = 4096,
                                      .device = moert_cpu()};
        moert_memory_action got = (moert_memory_action)-1;
        EXPECT_EQ_INT(vt->decide(ti.ctx, &info, &got), MOERT_OK);
        if (got != want[a])
            fprintf(stderr, "%s: %s -> %d, expected %d\n", options, moert_activation_name((moert_activation)a),
                    (int)got, (int)want[a]);
        EXPECT_EQ_INT(got, want[a]);
    }
    /* an activation outside the enum is refused with a message */
    moert_activation_info bad = {.struct_size = sizeof bad, .activation = (moert_activation)3};
    moert_memory_action got = MOERT_MEMORY_KEEP;
    EXPECT_EQ_INT(vt->decide(ti.ctx, &bad, &got), MOERT_ERR_INVALID_ARGUMENT);
    EXPECT(strstr(moert_host_take_error(ti.host), "decide(): activation is 3, expected 0 (dispatched_x)") != NULL);
    EXPECT_EQ_INT(vt->decide(ti.ctx, NULL, &got), MOERT_ERR_INVALID_ARGUMENT);
    EXPECT(strstr(moert_host_take_error(ti.host), "decide(): info is NULL") != NULL);
    test_instance_close(&ti);
}

/* The shared expert's activations (asked as fc1_out and swiglu_out with MOERT_ACTIVATION_SHARED_EXPERT): their own
 * options, or the routed answer ("same", the default); an info of the size before the flag reads as routed. */
static void check_shared(const char *options, moert_memory_action shared_fc1_out, moert_memory_action shared_act,
                         moert_memory_action routed_fc1_out)
{
    moert_layer_info layer = test_layer(8, 16, 4, 2, 32, 1, 0, MOERT_F32);
    test_instance ti;
    if (test_instance_open(&ti, MOERT_KIND_MEMORY_POLICY, PLUGIN, options, &layer, NULL, 0, 1) != MOERT_OK) {
        fprintf(stderr, "%s: open failed: %s\n", options, moert_error_message());
        test_failures++;
        test_instance_close(&ti);
        return;
    }
    const moert_memory_policy_v1 *vt = (const moert_memory_policy_v1 *)ti.plugin.header;
    moert_activation_info info = {.struct_size = sizeof info,
                                  .activation = MOERT_ACT_FC1_OUT,
                                  .bytes = 4096,
                                  .device = moert_cpu(),
                                  .flags = MOERT_ACTIVATION_SHARED_EXPERT};
    moert_memory_action got = (moert_memory_action)-1;
    EXPECT_EQ_INT(vt->decide(ti.ctx, &info, &got), MOERT_OK);
    EXPECT_EQ_INT(got, shared_fc1_out);
    info.activation = MOERT_ACT_SWIGLU_OUT;
    EXPECT_EQ_INT(vt->decide(ti.ctx, &info, &got), MOERT_OK);
    EXPECT_EQ_INT(got, shared_act);
    info.activation = MOERT_ACT_FC1_OUT;
    info.struct_size = (uint32_t)offsetof(moert_activation_info, flags); /* an older host: no flags */
    EXPECT_EQ_INT(vt->decide(ti.ctx, &info, &got), MOERT_OK);
    EXPECT_EQ_INT(got, routed_fc1_out);
    test_instance_close(&ti);
}

/* A config that must be refused with MOERT_ERR_CONFIG and a message containing every needle. */
static void check_refused(const char *options, const char *const *needles)
{
    moert_layer_info layer = test_layer(8, 16, 4, 2, 32, 1, 0, MOERT_F32);
    test_instance ti;
    moert_result rc = test_instance_open(&ti, MOERT_KIND_MEMORY_POLICY, PLUGIN, options, &layer, NULL, 0, 1);
    if (rc != MOERT_ERR_CONFIG) {
        fprintf(stderr, "%s: open gave %s, expected a config error\n", options, moert_result_name(rc));
        test_failures++;
    }
    for (int i = 0; needles[i]; i++) EXPECT_ERROR_CONTAINS(needles[i]);
    test_instance_close(&ti);
}

/* offload_last_layer false: the last layer of a stack keeps what the others offload; recompute is untouched. */
static void check_last_layer(const char *options, bool offload_last)
{
    for (int index = 0; index < 3; index++) {
        moert_layer_info layer = test_layer(8, 16, 4, 2, 32, 1, 0, MOERT_F32);
        layer.layer_index = index;
        layer.num_layers = 3;
        test_instance ti;
        if (test_instance_open(&ti, MOERT_KIND_MEMORY_POLICY, PLUGIN, options, &layer, NULL, 0, 1) != MOERT_OK) {
            fprintf(stderr, "%s: open failed: %s\n", options, moert_error_message());
            test_failures++;
            test_instance_close(&ti);
            return;
        }
        const moert_memory_policy_v1 *vt = (const moert_memory_policy_v1 *)ti.plugin.header;
        moert_activation_info info = {.struct_size = sizeof info,
                                      .layer_index = index,
                                      .activation = MOERT_ACT_DISPATCHED_X,
                                      .bytes = 4096,
                                      .device = moert_cpu()};
        moert_memory_action got = (moert_memory_action)-1;
        EXPECT_EQ_INT(vt->decide(ti.ctx, &info, &got), MOERT_OK);
        EXPECT_EQ_INT(got, (index == 2 && !offload_last) ? MOERT_MEMORY_KEEP : MOERT_MEMORY_OFFLOAD);
        info.activation = MOERT_ACT_FC1_OUT;
        EXPECT_EQ_INT(vt->decide(ti.ctx, &info, &got), MOERT_OK);
        EXPECT_EQ_INT(got, MOERT_MEMORY_RECOMPUTE);
        test_instance_close(&ti);
    }
}

int main(void)
{
    check_actions("{}", MOERT_MEMORY_KEEP, MOERT_MEMORY_KEEP, MOERT_MEMORY_KEEP);
    check_actions("{\"fc1_out\": \"recompute\"}", MOERT_MEMORY_KEEP, MOERT_MEMORY_RECOMPUTE, MOERT_MEMORY_KEEP);
    check_actions("{\"dispatched_x\": \"offload\", \"fc1_out\": \"keep\", \"swiglu_out\": \"recompute\"}",
                  MOERT_MEMORY_OFFLOAD, MOERT_MEMORY_KEEP, MOERT_MEMORY_RECOMPUTE);
    check_actions("{\"plugin\": \"default\", \"swiglu_out\": \"offload\"}", MOERT_MEMORY_KEEP, MOERT_MEMORY_KEEP,
                  MOERT_MEMORY_OFFLOAD);

    check_shared("{}", MOERT_MEMORY_KEEP, MOERT_MEMORY_KEEP, MOERT_MEMORY_KEEP);
    check_shared("{\"fc1_out\": \"offload\", \"swiglu_out\": \"recompute\"}", MOERT_MEMORY_OFFLOAD,
                 MOERT_MEMORY_RECOMPUTE, MOERT_MEMORY_OFFLOAD);
    check_shared("{\"fc1_out\": \"offload\", \"shared_fc1_out\": \"recompute\", \"shared_act\": \"offload\"}",
                 MOERT_MEMORY_RECOMPUTE, MOERT_MEMORY_OFFLOAD, MOERT_MEMORY_OFFLOAD);
    check_shared("{\"shared_fc1_out\": \"keep\", \"fc1_out\": \"recompute\", \"shared_act\": \"same\"}",
                 MOERT_MEMORY_KEEP, MOERT_MEMORY_KEEP, MOERT_MEMORY_RECOMPUTE);
    const char *const bad_shared[] = {"shared_act", "keep", "recompute", "offload", "same", NULL};
    check_refused("{\"shared_act\": \"drop\"}", bad_shared);

    check_last_layer("{\"dispatched_x\": \"offload\", \"fc1_out\": \"recompute\"}", true);
    check_last_layer("{\"dispatched_x\": \"offload\", \"fc1_out\": \"recompute\", \"offload_last_layer\": true}", true);
    check_last_layer("{\"dispatched_x\": \"offload\", \"fc1_out\": \"recompute\", \"offload_last_layer\": false}",
                     false);
    const char *const bad_bool[] = {"offload_last_layer", NULL};
    check_refused("{\"offload_last_layer\": \"no\"}", bad_bool);

    const char *const bad_value[] = {"fc1_out", "discard", "keep", "recompute", "offload", NULL};
    check_refused("{\"fc1_out\": \"discard\"}", bad_value);
    const char *const bad_type[] = {"swiglu_out", NULL};
    check_refused("{\"swiglu_out\": 1}", bad_type);
    const char *const unknown_key[] = {"fc1_output", "fc1_out", NULL}; /* the core names the nearest key */
    check_refused("{\"fc1_output\": \"keep\"}", unknown_key);
    return test_finish("test_memory_policy");
}
