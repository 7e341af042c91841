/* SPDX-License-Identifier: Apache-2.0 */
/* Config: defaults, typed values, exact error messages, --set overrides, sections and suggestions. */
#include <float.h>
#include <stdint.h>
#include <unistd.h>

#include "error.h"
#include "memory_estimate.h"
#include "test_util.h"

/* Loads text that must be refused with exactly `message`. */
static void expect_config_error(const char *text, moert_result code, const char *message)
{
    moert_config *cfg = NULL;
    moert_result rc = moert_config_load_string(text, "t.json", &cfg);
    EXPECT_EQ_INT(rc, code);
    EXPECT(cfg == NULL);
    if (strcmp(moert_error_message(), message) != 0) {
        fprintf(stderr, "config %s\n  message:  %s\n  expected: %s\n", text, moert_error_message(), message);
        test_failures++;
    }
    moert_config_free(cfg);
}

/* An empty object gives every documented default. */
static void test_defaults(void)
{
    moert_config *cfg = NULL;
    EXPECT_OK(moert_config_load_string("{}", "configs/my-demo.json", &cfg));
    if (!cfg) return;
    EXPECT(strcmp(cfg->name, "my-demo") == 0);
    EXPECT(strcmp(cfg->source, "configs/my-demo.json") == 0);
    EXPECT_EQ_INT(cfg->model.hidden, 64);
    EXPECT_EQ_INT(cfg->model.ffn_hidden, 128);
    EXPECT_EQ_INT(cfg->model.num_experts, 8);
    EXPECT_EQ_INT(cfg->model.topk, 2);
    EXPECT_EQ_INT(cfg->model.num_layers, 2);
    EXPECT_EQ_INT(cfg->model.dtype, MOERT_F32);
    EXPECT_EQ_INT(cfg->parallel.ranks, 1);
    EXPECT_EQ_INT(cfg->parallel.device, 0);
    EXPECT_NEAR(cfg->parallel.timeout_s, 60.0, 0, 0);
    EXPECT_EQ_INT(cfg->parallel.cuda_graph, MOERT_GRAPH_AUTO);
    EXPECT_EQ_INT(cfg->parallel.overlap_micro_batches, MOERT_OVERLAP_AUTO);
    EXPECT_EQ_INT(cfg->parallel.overlap_comm_sms, 24);
    EXPECT(cfg->parallel.overlap_wgrad);
    EXPECT(cfg->parallel.defer_wgrad_join);
    EXPECT_EQ_INT(cfg->train.steps, 100);
    EXPECT_EQ_INT(cfg->train.tokens_per_rank, 256);
    EXPECT_EQ_INT(cfg->train.micro_batches, 1);
    EXPECT_EQ_INT(cfg->train.seq_length, 0);
    EXPECT_EQ_INT(cfg->train.seed, 1);
    EXPECT_EQ_INT(cfg->train.log_every, 1);
    EXPECT_NEAR(cfg->train.lr, 1e-3, 0, 0);
    EXPECT_NEAR(cfg->train.weight_decay, 0.0, 0, 0);
    EXPECT_NEAR(cfg->train.teacher_scale, 1.0, 0, 0);
    EXPECT_EQ_INT(cfg->train.optimizer, MOERT_OPTIMIZER_ADAM);
    EXPECT(strcmp(cfg->plugin[MOERT_SLOT_ROUTER], "topk") == 0);
    EXPECT(strcmp(cfg->plugin[MOERT_SLOT_DISPATCHER], "alltoall") == 0);
    EXPECT(strcmp(cfg->plugin[MOERT_SLOT_PRECISION], "bf16") == 0);
    EXPECT(strcmp(cfg->plugin[MOERT_SLOT_MEMORY_POLICY], "default") == 0);
    moert_config_free(cfg);
}

/* Every key read into its typed field; plugin sections keep their own keys unchecked. */
static void test_values(void)
{
    const char *text =
        "{\"name\": \"big\", \"description\": \"d\",\n"
        " \"model\": {\"hidden\": 32, \"ffn_hidden\": 48, \"num_experts\": 16, \"topk\": 4, \"num_layers\": 3,"
        " \"dtype\": \"bf16\"},\n"
        " \"parallel\": {\"ranks\": 4, \"device\": \"cuda\", \"timeout_s\": 2.5, \"cuda_graph\": \"on\"},\n"
        " \"train\": {\"steps\": 0, \"tokens_per_rank\": 64, \"micro_batches\": 3, \"seq_length\": 16, \"seed\": 7, "
        "\"log_every\": 5,"
        " \"lr\": 0.01, \"weight_decay\": 0.1, \"teacher_scale\": 2, \"optimizer\": \"sgd\"},\n"
        " \"router\": {\"plugin\": \"/opt/x/libmoert-router-mine.so\", \"anything\": [1, 2]},\n"
        " \"dispatcher\": {\"plugin\": \"deepep\"}, \"precision\": {}, \"memory_policy\": {\"plugin\": \"lean\"}}";
    moert_config *cfg = NULL;
    EXPECT_OK(moert_config_load_string(text, "t.json", &cfg));
    if (!cfg) return;
    EXPECT(strcmp(cfg->name, "big") == 0);
    EXPECT_EQ_INT(cfg->model.hidden, 32);
    EXPECT_EQ_INT(cfg->model.ffn_hidden, 48);
    EXPECT_EQ_INT(cfg->model.num_experts, 16);
    EXPECT_EQ_INT(cfg->model.topk, 4);
    EXPECT_EQ_INT(cfg->model.num_layers, 3);
    EXPECT_EQ_INT(cfg->model.dtype, MOERT_BF16);
    EXPECT_EQ_INT(cfg->parallel.ranks, 4);
    EXPECT_EQ_INT(cfg->parallel.device, 2);
    EXPECT_NEAR(cfg->parallel.timeout_s, 2.5, 0, 0);
    EXPECT_EQ_INT(cfg->parallel.cuda_graph, MOERT_GRAPH_ON);
    EXPECT_EQ_INT(cfg->train.steps, 0);
    EXPECT_EQ_INT(cfg->train.tokens_per_rank, 64);
    EXPECT_EQ_INT(cfg->train.micro_batches, 3);
    EXPECT_EQ_INT(cfg->train.seq_length, 16);
    EXPECT_EQ_INT(cfg->train.seed, 7);
    EXPECT_EQ_INT(cfg->train.log_every, 5);
    EXPECT_NEAR(cfg->train.lr, 0.01, 0, 0);
    EXPECT_NEAR(cfg->train.weight_decay, 0.1, 0, 0);
    EXPECT_NEAR(cfg->train.teacher_scale, 2.0, 0, 0);
    EXPECT_EQ_INT(cfg->train.optimizer, MOERT_OPTIMIZER_SGD);
    EXPECT(strcmp(cfg->plugin[MOERT_SLOT_ROUTER], "/opt/x/libmoert-router-mine.so") == 0);
    EXPECT(strcmp(cfg->plugin[MOERT_SLOT_DISPATCHER], "deepep") == 0);
    EXPECT(strcmp(cfg->plugin[MOERT_SLOT_PRECISION], "bf16") == 0);
    EXPECT(strcmp(cfg->plugin[MOERT_SLOT_MEMORY_POLICY], "lean") == 0);
    /* overlap_micro_batches "auto" is on where it was measured faster: CUDA, EP > 1, a dispatcher whose header says
     * MOERT_CAP_AUTO_OVERLAP (deepep), ffn_hidden / ETP at most MOERT_OVERLAP_AUTO_MAX_FFN; "on" turns it on on any
     * device, "off" never */
    const uint32_t few = MOERT_CAP_AUTO_OVERLAP | MOERT_CAP_NEEDS_HOST_SYNC;
    EXPECT_EQ_INT(cfg->parallel.overlap_micro_batches, MOERT_OVERLAP_AUTO);
    EXPECT(moert_overlap_enabled(cfg, MOERT_DEVICE_CUDA, 4, 1, 4, few));
    EXPECT(!moert_overlap_enabled(cfg, MOERT_DEVICE_CPU, 4, 1, 4, few));
    EXPECT(!moert_overlap_enabled(cfg, MOERT_DEVICE_CUDA, 1, 1, 4, few));
    /* a caller that does not say it runs several micro-batches a step (0: unknown, or 1) gets no second slot */
    EXPECT(!moert_overlap_enabled(cfg, MOERT_DEVICE_CUDA, 4, 1, 0, few));
    EXPECT(!moert_overlap_enabled(cfg, MOERT_DEVICE_CUDA, 4, 1, 1, few));
    cfg->model.ffn_hidden = MOERT_OVERLAP_AUTO_MAX_FFN;
    EXPECT(moert_overlap_enabled(cfg, MOERT_DEVICE_CUDA, 2, 1, 4, few));
    cfg->model.ffn_hidden = 2 * MOERT_OVERLAP_AUTO_MAX_FFN; /* wide experts: off, unless ETP splits them */
    EXPECT(!moert_overlap_enabled(cfg, MOERT_DEVICE_CUDA, 2, 1, 4, few));
    EXPECT(moert_overlap_enabled(cfg, MOERT_DEVICE_CUDA, 2, 2, 4, few));
    /* a dispatcher without the flag (alltoall, hybridep, a vendor's that does not declare it): off */
    EXPECT(!moert_overlap_enabled(cfg, MOERT_DEVICE_CUDA, 2, 2, 4, MOERT_CAP_NEEDS_HOST_SYNC));
    cfg->parallel.overlap_micro_batches = MOERT_OVERLAP_ON;
    EXPECT(moert_overlap_enabled(cfg, MOERT_DEVICE_CPU, 1, 1, 4, 0));
    EXPECT(moert_overlap_enabled(cfg, MOERT_DEVICE_CPU, 1, 1, 0, 0));  /* "on" with micro-batches unknown: on */
    EXPECT(!moert_overlap_enabled(cfg, MOERT_DEVICE_CPU, 1, 1, 1, 0)); /* one a step: a second slot would never run */
    cfg->parallel.overlap_micro_batches = MOERT_OVERLAP_OFF;
    cfg->model.ffn_hidden = 48;
    EXPECT(!moert_overlap_enabled(cfg, MOERT_DEVICE_CUDA, 4, 1, 4, few));
    moert_config_free(cfg);

    EXPECT_OK(moert_config_load_string("{\"model\": {\"dtype\": \"fp64\"}, \"parallel\": {\"device\": \"cpu\"}}",
                                       "t.json", &cfg));
    if (cfg) {
        EXPECT_EQ_INT(cfg->model.dtype, MOERT_F64);
        EXPECT_EQ_INT(cfg->parallel.device, 1);
    }
    moert_config_free(cfg);
}

/* Bad values: the message names the JSON path, the value and what was expected. */
static void test_errors(void)
{
    expect_config_error("{\"model\": {\"hidden\": 64,}}", MOERT_ERR_CONFIG,
                        "t.json:1:25: invalid JSON: string or '}' expected near '}'");
    expect_config_error("{\n  \"model\": {\n    \"hidden\" 64\n  }\n}", MOERT_ERR_CONFIG,
                        "t.json:3:15: invalid JSON: ':' expected near '64'");
    expect_config_error("{\"a\": 1, \"a\": 2}", MOERT_ERR_CONFIG,
                        "t.json:1:12: invalid JSON: duplicate object key near '\"a\"'");
    expect_config_error("[1, 2]", MOERT_ERR_CONFIG, "config error at $: got [1,2], expected an object");
    expect_config_error("{\"model\": {\"hiden\": 32}}", MOERT_ERR_CONFIG,
                        "config error at $.model.hiden: unknown key (did you mean \"hidden\"?)");
    expect_config_error("{\"modle\": {}}", MOERT_ERR_CONFIG,
                        "config error at $.modle: unknown key (did you mean \"model\"?)");
    expect_config_error(
        "{\"train\": {\"learning_rate\": 0.1}}", MOERT_ERR_CONFIG,
        "config error at $.train.learning_rate: unknown key (known keys: steps, tokens_per_rank, "
        "micro_batches, seq_length, seed, log_every, lr, weight_decay, teacher_scale, input_shift, data, optimizer)");
    expect_config_error("{\"train\": {\"micro_batches\": 0}}", MOERT_ERR_CONFIG,
                        "config error at $.train.micro_batches: got 0, expected an integer in [1, 65536]");
    expect_config_error("{\"train\": {\"micro_batches\": \"4\"}}", MOERT_ERR_CONFIG,
                        "config error at $.train.micro_batches: got \"4\", expected an integer in [1, 65536]");
    expect_config_error(
        "{\"train\": {\"optimizer\": \"adamw\"}}", MOERT_ERR_CONFIG,
        "config error at $.train.optimizer: got \"adamw\", expected one of adam|sgd (did you mean \"adam\"?)");
    expect_config_error("{\"model\": {\"hidden\": \"64\"}}", MOERT_ERR_CONFIG,
                        "config error at $.model.hidden: got \"64\", expected an integer in [1, 65536]");
    expect_config_error("{\"model\": {\"hidden\": 64.5}}", MOERT_ERR_CONFIG,
                        "config error at $.model.hidden: got 64.5, expected an integer in [1, 65536]");
    expect_config_error("{\"model\": {\"hidden\": 0}}", MOERT_ERR_CONFIG,
                        "config error at $.model.hidden: got 0, expected an integer in [1, 65536]");
    /* size keys have upper bounds, and the largest per-rank buffers are computed with overflow checks */
    expect_config_error(
        "{\"model\": {\"ffn_hidden\": 2305843009213693953}}", MOERT_ERR_CONFIG,
        "config error at $.model.ffn_hidden: got 2305843009213693953, expected an integer in [1, 262144]");
    expect_config_error("{\"model\": {\"num_experts\": 268435456}}", MOERT_ERR_CONFIG,
                        "config error at $.model.num_experts: got 268435456, expected an integer in [1, 16384]");
    expect_config_error("{\"train\": {\"tokens_per_rank\": 16777217}}", MOERT_ERR_CONFIG,
                        "config error at $.train.tokens_per_rank: got 16777217, expected an integer in [1, 16777216]");
    expect_config_error(
        "{\"model\": {\"hidden\": 65536, \"ffn_hidden\": 262144, \"num_experts\": 16384}}", MOERT_ERR_CONFIG,
        "config error at $.model.ffn_hidden: the fc1 weights of a rank (experts per rank x hidden x 2 x "
        "ffn_hidden) would take 4096.0 TiB, more than the 16 TiB any device holds; shrink the sizes");
    expect_config_error(
        "{\"model\": {\"ffn_hidden\": 262144, \"num_experts\": 16384, \"topk\": 16384},"
        " \"train\": {\"tokens_per_rank\": 16777216}, \"parallel\": {\"ranks\": 64}}",
        MOERT_ERR_CONFIG,
        "config error at $.train.tokens_per_rank: the rows dispatched to a rank (ranks x tokens_per_rank "
        "x topk rows of max(hidden, 2 x ffn_hidden) values) would take more than 8388608.0 TiB, more "
        "than the 16 TiB any device holds; shrink the sizes");
    expect_config_error("{\"model\": {\"topk\": 9}}", MOERT_ERR_CONFIG,
                        "config error at $.model.topk: got 9, expected an integer in [1, 8]");
    expect_config_error("{\"model\": {\"num_experts\": 4, \"topk\": 5}}", MOERT_ERR_CONFIG,
                        "config error at $.model.topk: got 5, expected an integer in [1, 4]");
    expect_config_error("{\"model\": {\"num_layers\": 1025}}", MOERT_ERR_CONFIG,
                        "config error at $.model.num_layers: got 1025, expected an integer in [1, 1024]");
    expect_config_error("{\"model\": {\"dtype\": \"fp16\"}}", MOERT_ERR_CONFIG,
                        "config error at $.model.dtype: got \"fp16\", expected one of fp32|bf16|fp64");
    expect_config_error("{\"model\": 5}", MOERT_ERR_CONFIG, "config error at $.model: got 5, expected an object");
    expect_config_error("{\"parallel\": {\"ranks\": 3}}", MOERT_ERR_CONFIG,
                        "config error at $.parallel.ranks: got 3, expected a divisor of $.model.num_experts (8): "
                        "every rank holds the same number of experts");
    expect_config_error("{\"parallel\": {\"ranks\": 65}}", MOERT_ERR_CONFIG,
                        "config error at $.parallel.ranks: got 65, expected an integer in [1, 64]");
    expect_config_error("{\"parallel\": {\"device\": \"gpu\"}}", MOERT_ERR_CONFIG,
                        "config error at $.parallel.device: got \"gpu\", expected one of auto|cpu|cuda");
    expect_config_error("{\"parallel\": {\"cuda_graph\": true}}", MOERT_ERR_CONFIG,
                        "config error at $.parallel.cuda_graph: got true, expected one of auto|off|on");
    expect_config_error("{\"parallel\": {\"overlap_micro_batches\": true}}", MOERT_ERR_CONFIG,
                        "config error at $.parallel.overlap_micro_batches: got true, expected one of auto|off|on");
    expect_config_error("{\"parallel\": {\"overlap_micro_batches\": \"yes\"}}", MOERT_ERR_CONFIG,
                        "config error at $.parallel.overlap_micro_batches: got \"yes\", expected one of auto|off|on");
    expect_config_error("{\"parallel\": {\"defer_wgrad_join\": \"yes\"}}", MOERT_ERR_CONFIG,
                        "config error at $.parallel.defer_wgrad_join: got \"yes\", expected true or false");
    expect_config_error("{\"parallel\": {\"timeout_s\": 0}}", MOERT_ERR_CONFIG,
                        "config error at $.parallel.timeout_s: got 0, expected a number > 0");
    /* deadlines are computed from it: at most a day (1e19 s used to wrap the deadline and spin for ever) */
    expect_config_error("{\"parallel\": {\"timeout_s\": 1e19}}", MOERT_ERR_CONFIG,
                        "config error at $.parallel.timeout_s: got 1e19, expected a number > 0 and <= 86400 (a day)");
    expect_config_error("{\"parallel\": {\"timeout_s\": 86401}}", MOERT_ERR_CONFIG,
                        "config error at $.parallel.timeout_s: got 86401, expected a number > 0 and <= 86400 (a day)");
    expect_config_error("{\"train\": {\"lr\": \"fast\"}}", MOERT_ERR_CONFIG,
                        "config error at $.train.lr: got \"fast\", expected a number > 0");
    expect_config_error("{\"train\": {\"steps\": -1}}", MOERT_ERR_CONFIG,
                        "config error at $.train.steps: got -1, expected an integer in [0, 100000000]");
    expect_config_error("{\"train\": {\"weight_decay\": -0.5}}", MOERT_ERR_CONFIG,
                        "config error at $.train.weight_decay: got -0.5, expected a number >= 0");
    expect_config_error("{\"train\": {\"log_every\": true}}", MOERT_ERR_CONFIG,
                        "config error at $.train.log_every: got true, expected an integer >= 1");
    expect_config_error("{\"name\": 3}", MOERT_ERR_CONFIG, "config error at $.name: got 3, expected a string");
    expect_config_error("{\"router\": \"topk\"}", MOERT_ERR_CONFIG,
                        "config error at $.router: got \"topk\", expected an object like {\"plugin\": \"topk\"}");
    expect_config_error("{\"dispatcher\": {\"plugin\": 5}}", MOERT_ERR_CONFIG,
                        "config error at $.dispatcher.plugin: got 5, expected a plugin name or a path to a .so");
    expect_config_error("{\"precision\": {\"plugin\": \"\"}}", MOERT_ERR_CONFIG,
                        "config error at $.precision.plugin: got \"\", expected a plugin name or a path to a .so");
}

/* Files: syntax errors name file:line:column; a missing file is an I/O error. */
static void test_files(void)
{
    char dir[] = "/tmp/moert-test-config-XXXXXX";
    EXPECT(mkdtemp(dir) != NULL);
    char path[256];
    snprintf(path, sizeof path, "%s/broken.json", dir);
    FILE *f = fopen(path, "w");
    EXPECT(f != NULL);
    if (!f) return;
    fputs("{\n  \"train\": {\"steps\": 5},\n  \"model\": {\"hidden\": }\n}\n", f);
    fclose(f);
    moert_config *cfg = NULL;
    EXPECT_EQ_INT(moert_config_load_file(path, &cfg), MOERT_ERR_CONFIG);
    char expected[512];
    snprintf(expected, sizeof expected, "%s:3:23: invalid JSON: unexpected token near '}'", path);
    if (strcmp(moert_last_error(), expected) != 0) {
        fprintf(stderr, "message %s\nexpected %s\n", moert_last_error(), expected);
        test_failures++;
    }
    f = fopen(path, "w");
    fputs("{\"train\": {\"steps\": 5}}\n", f);
    fclose(f);
    EXPECT_OK(moert_config_load_file(path, &cfg));
    if (cfg) {
        EXPECT(strcmp(cfg->name, "broken") == 0);
        EXPECT_EQ_INT(cfg->train.steps, 5);
    }
    moert_config_free(cfg);
    unlink(path);
    rmdir(dir);

    snprintf(path, sizeof path, "%s/none.json", dir);
    EXPECT_EQ_INT(moert_config_load_file(path, &cfg), MOERT_ERR_IO);
    snprintf(expected, sizeof expected, "%s: cannot open config: No such file or directory", path);
    EXPECT(strcmp(moert_last_error(), expected) == 0);
}

/* --set: replaces a value, creates objects on the way, and keeps the config as it was on error. */
static void test_set(void)
{
    moert_config *cfg = NULL;
    EXPECT_OK(moert_config_load_string("{\"train\": {\"steps\": 100}}", "t.json", &cfg));
    if (!cfg) return;
    EXPECT_OK(moert_config_set(cfg, "train.steps", "10"));
    EXPECT_EQ_INT(cfg->train.steps, 10);
    EXPECT_OK(moert_config_set(cfg, "model.num_experts", "16"));
    EXPECT_EQ_INT(cfg->model.num_experts, 16);
    EXPECT_OK(moert_config_set(cfg, "router.capacity_factor", "1.5"));
    json_t *cf = json_object_get(json_object_get(cfg->root, "router"), "capacity_factor");
    EXPECT(json_is_real(cf) && json_real_value(cf) == 1.5);
    EXPECT_OK(moert_config_set(cfg, "dispatcher.plugin", "deepep")); /* not JSON: taken as a string */
    EXPECT(strcmp(cfg->plugin[MOERT_SLOT_DISPATCHER], "deepep") == 0);
    EXPECT_OK(moert_config_set(cfg, "precision.plugin", "\"fp8\""));
    EXPECT(strcmp(cfg->plugin[MOERT_SLOT_PRECISION], "fp8") == 0);

    EXPECT_EQ_INT(moert_config_set(cfg, "model.topk", "17"), MOERT_ERR_CONFIG);
    EXPECT(strcmp(moert_error_message(), "config error at $.model.topk: got 17, expected an integer in [1, 16]") == 0);
    EXPECT_EQ_INT(cfg->model.topk, 2);
    EXPECT(json_object_get(json_object_get(cfg->root, "model"), "topk") == NULL);
    EXPECT_EQ_INT(moert_config_set(cfg, "train.stepz", "3"), MOERT_ERR_CONFIG);
    EXPECT(strcmp(moert_error_message(), "config error at $.train.stepz: unknown key (did you mean \"steps\"?)") == 0);
    EXPECT_EQ_INT(cfg->train.steps, 10);
    EXPECT_EQ_INT(moert_config_set(cfg, "train.steps.inner", "3"), MOERT_ERR_CONFIG);
    EXPECT(strcmp(moert_error_message(),
                  "config error at $.train.steps: cannot set train.steps.inner: got 10, expected an object") == 0);
    EXPECT_EQ_INT(moert_config_set(cfg, "train..steps", "3"), MOERT_ERR_INVALID_ARGUMENT);
    EXPECT(strcmp(moert_error_message(), "config --set: key \"train..steps\" has an empty part") == 0);
    EXPECT_EQ_INT(cfg->train.steps, 10);
    moert_config_free(cfg);

    /* moert_config_set_many: keys that must agree change together, where one at a time is refused half-set; a
     * refused list leaves the config as it was */
    cfg = NULL;
    EXPECT_OK(moert_config_load_string("{\"model\": {\"num_experts\": 8}, \"parallel\": {\"ranks\": 4, "
                                       "\"expert_parallel\": 4}}",
                                       "t.json", &cfg));
    if (!cfg) return;
    EXPECT_EQ_INT(moert_config_set(cfg, "parallel.ranks", "8"), MOERT_ERR_CONFIG);
    const char *keys[] = {"parallel.ranks", "parallel.expert_parallel", "train.steps"};
    const char *values[] = {"8", "8", "7"};
    EXPECT_OK(moert_config_set_many(cfg, 3, keys, values));
    EXPECT_EQ_INT(cfg->parallel.ranks, 8);
    EXPECT_EQ_INT(cfg->parallel.expert_parallel, 8);
    EXPECT_EQ_INT(cfg->train.steps, 7);
    const char *bad_values[] = {"2", "3", "9"};
    EXPECT_EQ_INT(moert_config_set_many(cfg, 3, keys, bad_values), MOERT_ERR_CONFIG);
    EXPECT_EQ_INT(cfg->parallel.ranks, 8);
    EXPECT_EQ_INT(cfg->train.steps, 7);
    EXPECT_EQ_INT(moert_config_set_many(cfg, 1, keys, NULL), MOERT_ERR_INVALID_ARGUMENT);
    EXPECT_OK(moert_config_set_many(cfg, 0, NULL, NULL));
    moert_config_free(cfg);
}

/* Sections: typed accessors, allowed keys, describe mode, concise error text. */
static void test_sections(void)
{
    json_error_t jerr;
    json_t *obj = json_loads("{\"plugin\": \"x\", \"count\": 3, \"scale\": 2, \"on\": false, \"mode\": \"b\","
                             " \"label\": \"hi\"}",
                             0, &jerr);
    moert_section *sec = moert_section_create(obj, "$.router");
    moert_section_allow(sec, "plugin");
    moert_section_set_describe(sec, true);
    static const char *const modes[] = {"a", "b", "c", NULL};
    int64_t count = 0, missing = 0;
    double scale = 0;
    bool on = true;
    int mode = -1;
    const char *label = NULL, *other = NULL;
    EXPECT_OK(moert_section_int(sec, "count", 1, 0, 10, "how many", &count));
    EXPECT_OK(moert_section_int(sec, "missing", 42, INT64_MIN, INT64_MAX, "absent", &missing));
    EXPECT_OK(moert_section_float(sec, "scale", 1.0, 0.5, 4.0, "a factor", &scale));
    EXPECT_OK(moert_section_bool(sec, "on", true, "switch", &on));
    EXPECT_OK(moert_section_enum(sec, "mode", modes, 0, "which", &mode));
    EXPECT_OK(moert_section_string(sec, "label", "none", "a label", &label));
    EXPECT_OK(moert_section_string(sec, "other", "dflt", "another", &other));
    EXPECT_EQ_INT(count, 3);
    EXPECT_EQ_INT(missing, 42);
    EXPECT_NEAR(scale, 2.0, 0, 0);
    EXPECT(!on);
    EXPECT_EQ_INT(mode, 1);
    EXPECT(label && strcmp(label, "hi") == 0);
    EXPECT(other && strcmp(other, "dflt") == 0);
    EXPECT_OK(moert_section_check_unknown(sec));

    EXPECT_EQ_INT(moert_section_option_count(sec), 7);
    const moert_option_desc *d = moert_section_option(sec, 0);
    EXPECT(d && strcmp(d->key, "count") == 0 && strcmp(d->type, "int") == 0 && strcmp(d->def, "1") == 0 &&
           strcmp(d->range, "[0, 10]") == 0 && strcmp(d->help, "how many") == 0);
    d = moert_section_option(sec, 1);
    EXPECT(d && strcmp(d->range, "any") == 0 && strcmp(d->def, "42") == 0);
    d = moert_section_option(sec, 2);
    EXPECT(d && strcmp(d->type, "float") == 0 && strcmp(d->range, "[0.5, 4]") == 0 && strcmp(d->def, "1") == 0);
    d = moert_section_option(sec, 3);
    EXPECT(d && strcmp(d->type, "bool") == 0 && strcmp(d->def, "true") == 0);
    d = moert_section_option(sec, 4);
    EXPECT(d && strcmp(d->type, "enum") == 0 && strcmp(d->range, "a|b|c") == 0 && strcmp(d->def, "a") == 0);
    EXPECT(moert_section_option(sec, 7) == NULL);

    /* a second read of the same key is not a second option */
    EXPECT_OK(moert_section_int(sec, "count", 1, 0, 10, "how many", &count));
    EXPECT_EQ_INT(moert_section_option_count(sec), 7);

    EXPECT_EQ_INT(moert_section_int(sec, "count", 1, 5, 10, "how many", &count), MOERT_ERR_CONFIG);
    EXPECT(strcmp(moert_error_message(), "config error at $.router.count: got 3, expected an integer in [5, 10]") == 0);
    EXPECT_EQ_INT(moert_section_float(sec, "scale", 1.0, 3.0, 4.0, "", &scale), MOERT_ERR_CONFIG);
    EXPECT(strcmp(moert_error_message(), "config error at $.router.scale: got 2, expected a number in [3, 4]") == 0);
    EXPECT_EQ_INT(moert_section_bool(sec, "count", false, "", &on), MOERT_ERR_CONFIG);
    EXPECT(strcmp(moert_error_message(), "config error at $.router.count: got 3, expected true or false") == 0);
    moert_section_free(sec);

    /* a key nobody read */
    sec = moert_section_create(obj, "$.router");
    moert_section_allow(sec, "plugin");
    EXPECT_OK(moert_section_int(sec, "counts", 1, 0, 10, "", &count));
    EXPECT_OK(moert_section_float(sec, "scale", 1, 0, 10, "", &scale));
    EXPECT_EQ_INT(moert_section_check_unknown(sec), MOERT_ERR_CONFIG);
    EXPECT(strcmp(moert_error_message(), "config error at $.router.count: unknown key (did you mean \"counts\"?)") ==
           0);
    moert_section_free(sec);

    sec = moert_section_create(obj, "$.x");
    EXPECT_EQ_INT(moert_section_check_unknown(sec), MOERT_ERR_CONFIG);
    EXPECT(strcmp(moert_error_message(), "config error at $.x.plugin: unknown key (this section takes no keys)") == 0);
    moert_section_free(sec);

    /* no object: every option takes its default and nothing is unknown */
    sec = moert_section_create(NULL, "$.router");
    EXPECT_OK(moert_section_int(sec, "count", 5, 0, 10, "", &count));
    EXPECT_EQ_INT(count, 5);
    EXPECT_OK(moert_section_check_unknown(sec));
    EXPECT_EQ_INT(moert_section_option_count(sec), 0); /* not in describe mode */
    moert_section_free(sec);
    json_decref(obj);
}

/* Suggestions: Levenshtein distance within max(2, len/3). */
static void test_nearest(void)
{
    const char *const known[] = {"hidden", "ffn_hidden", "num_experts", "topk", "capacity_factor"};
    EXPECT(strcmp(moert_nearest_name("hiden", known, 5), "hidden") == 0);
    EXPECT(strcmp(moert_nearest_name("top_k", known, 5), "topk") == 0);
    EXPECT(moert_nearest_name("experts", known, 5) == NULL); /* 4 edits from num_experts; limit max(2, 7/3) = 2 */
    EXPECT(strcmp(moert_nearest_name("capacityfactr", known, 5), "capacity_factor") == 0); /* 2 edits */
    EXPECT(moert_nearest_name("cpcityfactr", known, 5) == NULL); /* 4 edits; limit max(2, 11/3) = 3 */
    EXPECT(strcmp(moert_nearest_name("capcityfactr", known, 5), "capacity_factor") == 0); /* 3 edits; limit 4 */
    EXPECT(moert_nearest_name("zzz", known, 5) == NULL);
    EXPECT(moert_nearest_name("hidden", known, 0) == NULL);
    EXPECT(strcmp(moert_nearest_name("ffn_hiden", known, 5), "ffn_hidden") == 0);
}

/* Slot names and kinds. */
static void test_slots(void)
{
    EXPECT(strcmp(moert_slot_key(MOERT_SLOT_ROUTER), "router") == 0);
    EXPECT(strcmp(moert_slot_key(MOERT_SLOT_DISPATCHER), "dispatcher") == 0);
    EXPECT(strcmp(moert_slot_key(MOERT_SLOT_PRECISION), "precision") == 0);
    EXPECT(strcmp(moert_slot_key(MOERT_SLOT_MEMORY_POLICY), "memory_policy") == 0);
    EXPECT_EQ_INT(moert_slot_kind(MOERT_SLOT_ROUTER), MOERT_KIND_ROUTER);
    EXPECT_EQ_INT(moert_slot_kind(MOERT_SLOT_DISPATCHER), MOERT_KIND_DISPATCHER);
    EXPECT_EQ_INT(moert_slot_kind(MOERT_SLOT_PRECISION), MOERT_KIND_PRECISION);
    EXPECT_EQ_INT(moert_slot_kind(MOERT_SLOT_MEMORY_POLICY), MOERT_KIND_MEMORY_POLICY);
}

/* Error helpers, result names and the version. */
static void test_error_module(void)
{
    EXPECT_EQ_INT(moert_error(MOERT_ERR_IO, "disk %d", 3), MOERT_ERR_IO);
    EXPECT(strcmp(moert_last_error(), "disk 3") == 0);
    moert_error_prefix("while %s", "saving");
    EXPECT(strcmp(moert_error_message(), "while saving: disk 3") == 0);
    moert_error(MOERT_ERR_IO, "%s and more", moert_error_message()); /* its own message as an argument */
    EXPECT(strcmp(moert_error_message(), "while saving: disk 3 and more") == 0);
    moert_error_clear();
    EXPECT(strcmp(moert_error_message(), "") == 0);
    moert_error_prefix("context");
    EXPECT(strcmp(moert_error_message(), "context") == 0);
    EXPECT(strcmp(moert_result_name(MOERT_OK), "ok") == 0);
    EXPECT(strcmp(moert_result_name(MOERT_ERR_TIMEOUT), "timeout") == 0);
    EXPECT(strcmp(moert_result_name(MOERT_ERR_ABI_MISMATCH), "ABI mismatch") == 0);
    EXPECT(strcmp(moert_result_name((moert_result)99), "unknown result") == 0);
    for (int r = 0; r < MOERT_RESULT_COUNT; r++)
        EXPECT(strcmp(moert_result_name((moert_result)r), "unknown result") != 0);
    EXPECT(strcmp(moert_version(), MOERT_VERSION_STRING) == 0);
    static char big[MOERT_ERROR_MAX + 2000];
    memset(big, 'x', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    moert_error(MOERT_ERR_IO, "%s", big); /* cut to the MOERT_ERROR_MAX buffer, still terminated */
    EXPECT_EQ_INT(strlen(moert_error_message()), MOERT_ERROR_MAX - 1);
    moert_error_prefix("p");
    EXPECT_EQ_INT(strlen(moert_error_message()), MOERT_ERROR_MAX - 1);
    EXPECT(strncmp(moert_error_message(), "p: xxx", 6) == 0);
}

/* The getters and loaders: NULL arguments refused, a real read as an integer only where it is a whole number. */
static void test_getters(void)
{
    moert_config *cfg = NULL;
    EXPECT_EQ_INT(moert_config_load_string("{}", "t.json", NULL), MOERT_ERR_INVALID_ARGUMENT);
    EXPECT_EQ_INT(moert_config_load_file("x.json", NULL), MOERT_ERR_INVALID_ARGUMENT);
    EXPECT_EQ_INT(moert_config_load_file(NULL, &cfg), MOERT_ERR_INVALID_ARGUMENT);
    EXPECT_ERROR_CONTAINS("moert_config_load_file: path or out is NULL");
    EXPECT_OK(moert_config_load_string(
        "{\"train\": {\"lr\": 0.003, \"seed\": 7}, \"router\": {\"big\": 1e300, \"two\": 2.0}}", "t.json", &cfg));
    if (!cfg) return;
    int64_t v = -1;
    double d = 0.0;
    EXPECT_EQ_INT(moert_config_get_int(cfg, "train.seed", NULL), MOERT_ERR_INVALID_ARGUMENT);
    EXPECT_EQ_INT(moert_config_get_double(cfg, "train.lr", NULL), MOERT_ERR_INVALID_ARGUMENT);
    EXPECT_EQ_INT(moert_config_get_int(cfg, "train.lr", &v), MOERT_ERR_CONFIG);
    EXPECT_ERROR_CONTAINS("t.json: $.train.lr is 0.0030000000000000001, not an integer");
    EXPECT_EQ_INT(v, -1); /* left as it was */
    EXPECT_EQ_INT(moert_config_get_int(cfg, "router.big", &v), MOERT_ERR_CONFIG);
    EXPECT_OK(moert_config_get_int(cfg, "router.two", &v));
    EXPECT_EQ_INT(v, 2);
    EXPECT_OK(moert_config_get_double(cfg, "train.lr", &d));
    EXPECT(d == 0.003);
    moert_config_free(cfg);
}

/* $.parallel.overlap_comm_sms: 24 by default (deepep's SMs under the overlap), 0 .. 1024, read back resolved. */
static void test_overlap_comm_sms(void)
{
    moert_config *cfg = NULL;
    int64_t v = -1;
    EXPECT_OK(moert_config_load_string("{}", "t.json", &cfg));
    if (cfg) {
        EXPECT_EQ_INT(cfg->parallel.overlap_comm_sms, MOERT_OVERLAP_COMM_SMS_DEFAULT);
        EXPECT_OK(moert_config_get_int(cfg, "parallel.overlap_comm_sms", &v));
        EXPECT_EQ_INT(v, 24);
    }
    moert_config_free(cfg);
    cfg = NULL;
    EXPECT_OK(moert_config_load_string("{\"parallel\": {\"overlap_comm_sms\": 16}}", "t.json", &cfg));
    if (cfg) {
        EXPECT_EQ_INT(cfg->parallel.overlap_comm_sms, 16);
        EXPECT_OK(moert_config_get_int(cfg, "parallel.overlap_comm_sms", &v));
        EXPECT_EQ_INT(v, 16);
    }
    moert_config_free(cfg);
    cfg = NULL;
    /* 0: the GEMMs keep every SM; the bound 1024 is accepted */
    EXPECT_OK(moert_config_load_string("{\"parallel\": {\"overlap_comm_sms\": 0}}", "t.json", &cfg));
    if (cfg) EXPECT_EQ_INT(cfg->parallel.overlap_comm_sms, 0);
    moert_config_free(cfg);
    cfg = NULL;
    EXPECT_OK(moert_config_load_string("{\"parallel\": {\"overlap_comm_sms\": 1024}}", "t.json", &cfg));
    if (cfg) EXPECT_EQ_INT(cfg->parallel.overlap_comm_sms, 1024);
    moert_config_free(cfg);
    expect_config_error("{\"parallel\": {\"overlap_comm_sms\": 1025}}", MOERT_ERR_CONFIG,
                        "config error at $.parallel.overlap_comm_sms: got 1025, expected an integer in [0, 1024]");
    expect_config_error("{\"parallel\": {\"overlap_comm_sms\": -1}}", MOERT_ERR_CONFIG,
                        "config error at $.parallel.overlap_comm_sms: got -1, expected an integer in [0, 1024]");
    expect_config_error("{\"parallel\": {\"overlap_comm_sms\": \"24\"}}", MOERT_ERR_CONFIG,
                        "config error at $.parallel.overlap_comm_sms: got \"24\", expected an integer in [0, 1024]");
    expect_config_error("{\"parallel\": {\"overlap_comm_sms\": 2.5}}", MOERT_ERR_CONFIG,
                        "config error at $.parallel.overlap_comm_sms: got 2.5, expected an integer in [0, 1024]");
}

/* $.parallel.forwards_in_flight: 1 .. 32, a mistyped or out-of-range value names the key; the memory estimate counts
 * the activations, dispatcher buffers and workspace once per slot. */
static void test_forwards_in_flight(void)
{
    moert_config *cfg = NULL;
    EXPECT_OK(moert_config_load_string("{\"parallel\": {\"device\": \"cpu\"}}", "t.json", &cfg));
    if (!cfg) return;
    EXPECT_EQ_INT(cfg->parallel.forwards_in_flight, 1);
    moert_memory_estimate one, three;
    moert_memory_estimate_config(cfg, 2, MOERT_DEVICE_CPU, &one);
    cfg->parallel.forwards_in_flight = 3;
    moert_memory_estimate_config(cfg, 2, MOERT_DEVICE_CPU, &three);
    EXPECT_NEAR(three.activations, 3 * one.activations, 0, 1e-12);
    EXPECT_NEAR(three.dispatcher, 3 * one.dispatcher, 0, 1e-12);
    EXPECT_NEAR(three.parameters, one.parameters, 0, 0); /* shared by the slots */
    moert_config_free(cfg);
    static const char *const bad[] = {"{\"parallel\": {\"forwards_in_flight\": 0}}",
                                      "{\"parallel\": {\"forwards_in_flight\": 33}}",
                                      "{\"parallel\": {\"forwards_in_flight\": \"2\"}}"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        cfg = NULL;
        EXPECT_EQ_INT(moert_config_load_string(bad[i], "t.json", &cfg), MOERT_ERR_CONFIG);
        EXPECT_ERROR_CONTAINS("$.parallel.forwards_in_flight");
        moert_config_free(cfg);
    }
}

/* The memory estimate of a dispatcher that gathers every rank's tokens (MOERT_CAP_GATHERS_TOKENS: allgather): its
 * [EP x T, H] rows in the activation dtype and two partial sums in scratch precision (fp64 on the CPU) per layer where
 * they outweigh the routed rows counted for alltoall; with a top-k as large as the group, the routed rows. */
static void test_gathering_dispatcher_estimate(void)
{
    const char *const text[2][2] = {{"{\"parallel\": {\"device\": \"cpu\"}, \"model\": {\"topk\": 2}}",
                                     "{\"parallel\": {\"device\": \"cpu\"}, \"model\": {\"topk\": 2}, \"dispatcher\": "
                                     "{\"plugin\": \"allgather\"}}"},
                                    {"{\"parallel\": {\"device\": \"cpu\"}, \"model\": {\"topk\": 6}}",
                                     "{\"parallel\": {\"device\": \"cpu\"}, \"model\": {\"topk\": 6}, \"dispatcher\": "
                                     "{\"plugin\": \"allgather\"}}"}};
    for (int k = 0; k < 2; k++) {
        moert_config *a2a = NULL, *ag = NULL;
        EXPECT_OK(moert_config_load_string(text[k][0], "t.json", &a2a));
        EXPECT_OK(moert_config_load_string(text[k][1], "t.json", &ag));
        if (!a2a || !ag) {
            moert_config_free(a2a);
            moert_config_free(ag);
            return;
        }
        const int world = 4;
        moert_memory_estimate e_a2a, e_ag;
        moert_memory_estimate_config(a2a, world, MOERT_DEVICE_CPU, &e_a2a);
        moert_memory_estimate_config(ag, world, MOERT_DEVICE_CPU, &e_ag);
        const moert_model_config *m = &ag->model;
        const double t = (double)ag->train.tokens_per_rank, h = (double)m->hidden, layers = (double)m->num_layers;
        const double routed = layers * 2.0 * t * (double)m->topk * h * 8.0;
        const double gathered = layers * world * t * h * ((double)moert_dtype_size(m->dtype) + 16.0);
        EXPECT_NEAR(e_a2a.dispatcher, routed, 0, 1e-12);
        EXPECT_NEAR(e_ag.dispatcher, gathered > routed ? gathered : routed, 0, 1e-12);
        if (k == 0) EXPECT(e_ag.dispatcher > e_a2a.dispatcher);               /* top-2 of 4 ranks: the gathered rows */
        if (k == 1) EXPECT_NEAR(e_ag.dispatcher, e_a2a.dispatcher, 0, 1e-12); /* top-6: the routed rows */
        EXPECT_NEAR(e_ag.activations, e_a2a.activations, 0, 1e-12);
        moert_config_free(a2a);
        moert_config_free(ag);
    }
}

int main(void)
{
    test_defaults();
    test_forwards_in_flight();
    test_gathering_dispatcher_estimate();
    test_values();
    test_errors();
    test_getters();
    test_overlap_comm_sms();
    test_files();
    test_set();
    test_sections();
    test_nearest();
    test_slots();
    test_error_module();
    return test_finish("test_config");
}
