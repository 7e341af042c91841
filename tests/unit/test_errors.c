/* SPDX-License-Identifier: Apache-2.0 */
/* What a user sees for each kind of mistake, through the public API (config load + runtime create). */
#include <stdint.h>

#include "test_util.h"
#include "trainer.h"

static char build_root[1024];

/* Loads text and creates the runtime; the first step that fails must fail with code and exactly message. */
static void expect_failure(const char *text, moert_result code, const char *message)
{
    moert_config *cfg = NULL;
    moert_runtime *rt = NULL;
    moert_result rc = moert_config_load_string(text, "t.json", &cfg);
    if (rc == MOERT_OK) rc = moert_runtime_create(cfg, &rt);
    EXPECT_EQ_INT(rc, code);
    if (strcmp(moert_last_error(), message) != 0) {
        fprintf(stderr, "config %s\n  message:  %s\n  expected: %s\n", text, moert_last_error(), message);
        test_failures++;
    }
    moert_runtime_destroy(rt);
    moert_config_free(cfg);
}

/* The same, for messages that end with `tail` (multi-rank runs add which rank saw the error). */
static void expect_failure_ending(const char *text, moert_result code, const char *tail)
{
    moert_config *cfg = NULL;
    moert_runtime *rt = NULL;
    moert_result rc = moert_config_load_string(text, "t.json", &cfg);
    if (rc == MOERT_OK) rc = moert_runtime_create(cfg, &rt);
    EXPECT_EQ_INT(rc, code);
    const char *m = moert_last_error();
    size_t n = strlen(m), t = strlen(tail);
    if (n < t || strcmp(m + n - t, tail) != 0) {
        fprintf(stderr, "config %s\n  message:  %s\n  expected to end with: %s\n", text, m, tail);
        test_failures++;
    }
    moert_runtime_destroy(rt);
    moert_config_free(cfg);
}

static void test_config_mistakes(void)
{
    expect_failure("{\"model\": {\"hidden\": 64,}}", MOERT_ERR_CONFIG,
                   "t.json:1:25: invalid JSON: string or '}' expected near '}'");
    expect_failure("{\"train\": {\"steps\": \"ten\"}}", MOERT_ERR_CONFIG,
                   "config error at $.train.steps: got \"ten\", expected an integer in [0, 100000000]");
    expect_failure("{\"model\": {\"topk\": 9}}", MOERT_ERR_CONFIG,
                   "config error at $.model.topk: got 9, expected an integer in [1, 8]");
    expect_failure("{\"parallel\": {\"rank\": 2}}", MOERT_ERR_CONFIG,
                   "config error at $.parallel.rank: unknown key (did you mean \"ranks\"?)");
    expect_failure("{\"parallel\": {\"ranks\": 3}}", MOERT_ERR_CONFIG,
                   "config error at $.parallel.ranks: got 3, expected a divisor of $.model.num_experts (8): every "
                   "rank holds the same number of experts");
}

static void test_plugin_mistakes(void)
{
    /* a name found nowhere: every path tried */
    char dirs[8192], message[16384], text[4096];
    moert_plugin_search_path(dirs, sizeof dirs);
    snprintf(message, sizeof message, "config error at $.router.plugin: no router plugin \"nope\": tried ");
    char *save = NULL;
    bool first = true;
    for (char *d = strtok_r(dirs, ":", &save); d; d = strtok_r(NULL, ":", &save)) {
        size_t used = strlen(message);
        snprintf(message + used, sizeof message - used, "%s%s/libmoert-router-nope.so", first ? "" : ", ", d);
        first = false;
    }
    size_t used = strlen(message);
    snprintf(message + used, sizeof message - used,
             " (set MOERT_PLUGIN_PATH or give a path to the .so); router plugins found: \"topk\"");
    expect_failure("{\"router\": {\"plugin\": \"nope\"}}", MOERT_ERR_NOT_FOUND, message);

    /* a router named as the dispatcher, and a dispatcher in a router's file */
    char topk[2048];
    snprintf(topk, sizeof topk, "%s/plugins/router/libmoert-router-topk.so", build_root);
    snprintf(text, sizeof text, "{\"dispatcher\": {\"plugin\": \"%s\"}}", topk);
    snprintf(message, sizeof message,
             "config error at $.dispatcher.plugin: dispatcher plugin \"%s\" is a router plugin, expected a "
             "dispatcher",
             topk);
    expect_failure(text, MOERT_ERR_ABI_MISMATCH, message);
    snprintf(message, sizeof message,
             "config error at $.router.plugin: router plugin \"fixture-wrong-kind\" "
             "(%s/tests/fixtures/libmoert-router-fixture-wrong-kind.so) is a dispatcher plugin, expected a router",
             build_root);
    expect_failure("{\"router\": {\"plugin\": \"fixture-wrong-kind\"}}", MOERT_ERR_ABI_MISMATCH, message);

    /* built for another ABI */
    snprintf(message, sizeof message,
             "config error at $.router.plugin: router plugin \"fixture-bad-abi\" "
             "(%s/tests/fixtures/libmoert-router-fixture-bad-abi.so) was built for ABI 2.0, this moert supports "
             "ABI 1.x",
             build_root);
    expect_failure("{\"router\": {\"plugin\": \"fixture-bad-abi\"}}", MOERT_ERR_ABI_MISMATCH, message);

    /* init refuses: the plugin's own message, with its name */
    expect_failure("{\"router\": {\"plugin\": \"fixture-init-fails\", \"reason\": \"no GPU today\"}}", MOERT_ERR_CONFIG,
                   "router plugin \"fixture-init-fails\": fixture refuses to start: no GPU today");

    /* a plugin option misspelt: the core reports it with the nearest option the plugin read */
    expect_failure("{\"router\": {\"plugin\": \"fixture-init-fails\", \"fail\": false, \"reasn\": \"x\"}}",
                   MOERT_ERR_CONFIG, "config error at $.router.reasn: unknown key (did you mean \"reason\"?)");
    expect_failure("{\"router\": {\"plugin\": \"topk\", \"capacity_facter\": 1.5}}", MOERT_ERR_CONFIG,
                   "config error at $.router.capacity_facter: unknown key (did you mean \"capacity_factor\"?)");
    expect_failure("{\"dispatcher\": {\"plugin\": \"alltoall\", \"bogus\": 1}}", MOERT_ERR_CONFIG,
                   "config error at $.dispatcher.bogus: unknown key (known keys: plugin, pad_to_capacity, "
                   "capacity_factor)");
    /* a plugin option of the wrong type or out of range */
    expect_failure("{\"router\": {\"plugin\": \"topk\", \"score_function\": \"tanh\"}}", MOERT_ERR_CONFIG,
                   "router plugin \"topk\": config error at $.router.score_function: got \"tanh\", expected one of "
                   "softmax|sigmoid");
    expect_failure("{\"memory_policy\": {\"plugin\": \"default\", \"fc1_out\": 3}}", MOERT_ERR_CONFIG,
                   "memory_policy plugin \"default\": config error at $.memory_policy.fc1_out: got 3, expected one "
                   "of keep|recompute|offload");
    /* with several ranks the message is the same, said by the rank that saw it */
    expect_failure_ending("{\"parallel\": {\"ranks\": 2}, \"router\": {\"plugin\": \"topk\", \"capacity_facter\": 1}}",
                          MOERT_ERR_CONFIG,
                          "config error at $.router.capacity_facter: unknown key (did you mean \"capacity_factor\"?)");
}

/* A good config starts, and errors do not stick to later calls. */
static void test_good_config(void)
{
    moert_config *cfg = NULL;
    moert_runtime *rt = NULL;
    EXPECT_OK(
        moert_config_load_string("{\"parallel\": {\"ranks\": 2}, \"model\": {\"num_layers\": 1}}", "t.json", &cfg));
    if (cfg) EXPECT_OK(moert_runtime_create(cfg, &rt));
    moert_runtime_destroy(rt);
    moert_config_free(cfg);
}

int main(void)
{
    const char *root = getenv("MOERT_TEST_BUILD_ROOT");
    if (!root) {
        fprintf(stderr, "test_errors: MOERT_TEST_BUILD_ROOT is not set (run it with meson test)\n");
        return 1;
    }
    snprintf(build_root, sizeof build_root, "%s", root);
    setenv("MOERT_PLUGIN_PATH", "", 1);
    test_config_mistakes();
    test_plugin_mistakes();
    test_good_config();
    return test_finish("test_errors");
}
