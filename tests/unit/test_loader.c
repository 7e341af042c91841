/* SPDX-License-Identifier: Apache-2.0 */
/* Loader: name resolution along the search path, exact refusal messages, init failures, scanning. */
#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>

#include "error.h"
#include "test_util.h"

static char build_root[1024];

/* The path of a fixture in the build tree. */
static void fixture_path(const char *name, char *buf, size_t size)
{
    snprintf(buf, size, "%s/tests/fixtures/libmoert-router-fixture-%s.so", build_root, name);
}

/* Loading spec as a router must fail with code and exactly `message`. */
static void expect_load_error(const char *spec, moert_result code, const char *message)
{
    moert_plugin p;
    moert_result rc = moert_plugin_load(MOERT_KIND_ROUTER, spec, &p);
    EXPECT_EQ_INT(rc, code);
    EXPECT(p.dl == NULL);
    if (strcmp(moert_error_message(), message) != 0) {
        fprintf(stderr, "load %s\n  message:  %s\n  expected: %s\n", spec, moert_error_message(), message);
        test_failures++;
    }
    if (rc == MOERT_OK) moert_plugin_unload(&p);
}

static void test_names(void)
{
    EXPECT(strcmp(moert_kind_name(MOERT_KIND_ROUTER), "router") == 0);
    EXPECT(strcmp(moert_kind_name(MOERT_KIND_DISPATCHER), "dispatcher") == 0);
    EXPECT(strcmp(moert_kind_name(MOERT_KIND_PRECISION), "precision") == 0);
    EXPECT(strcmp(moert_kind_name(MOERT_KIND_MEMORY_POLICY), "memory_policy") == 0);
    EXPECT(strcmp(moert_kind_file_part(MOERT_KIND_ROUTER), "router") == 0);
    EXPECT(strcmp(moert_kind_file_part(MOERT_KIND_DISPATCHER), "dispatch") == 0);
    EXPECT(strcmp(moert_kind_file_part(MOERT_KIND_PRECISION), "precision") == 0);
    EXPECT(strcmp(moert_kind_file_part(MOERT_KIND_MEMORY_POLICY), "memory") == 0);
}

/* The four built plugins load by name from the build tree, with the kind each declares. */
static void test_builtin_plugins(void)
{
    const struct {
        moert_plugin_kind kind;
        const char *name, *dir, *file;
    } builtins[] = {
        {MOERT_KIND_ROUTER, "topk", "router", "libmoert-router-topk.so"},
        {MOERT_KIND_DISPATCHER, "alltoall", "dispatch_alltoall", "libmoert-dispatch-alltoall.so"},
        {MOERT_KIND_PRECISION, "bf16", "precision_bf16", "libmoert-precision-bf16.so"},
        {MOERT_KIND_MEMORY_POLICY, "default", "memory_policy", "libmoert-memory-default.so"},
    };
    for (int i = 0; i < 4; i++) {
        moert_plugin p;
        EXPECT_OK(moert_plugin_load(builtins[i].kind, builtins[i].name, &p));
        if (!p.dl) continue;
        char expected[2048];
        snprintf(expected, sizeof expected, "%s/plugins/%s/%s", build_root, builtins[i].dir, builtins[i].file);
        if (strcmp(p.path, expected) != 0) {
            fprintf(stderr, "loaded %s, expected %s\n", p.path, expected);
            test_failures++;
        }
        EXPECT_EQ_INT(p.kind, builtins[i].kind);
        EXPECT_EQ_INT(p.header->kind, builtins[i].kind);
        EXPECT(strcmp(p.header->name, builtins[i].name) == 0);
        moert_plugin_unload(&p);
        EXPECT(p.dl == NULL && p.header == NULL);
    }
    /* the same file named by its path */
    char path[2048];
    snprintf(path, sizeof path, "%s/plugins/router/libmoert-router-topk.so", build_root);
    moert_plugin p;
    EXPECT_OK(moert_plugin_load(MOERT_KIND_ROUTER, path, &p));
    if (p.dl) EXPECT(strcmp(p.header->name, "topk") == 0);
    moert_plugin_unload(&p);
    /* a router is not a dispatcher */
    char message[4096];
    EXPECT_EQ_INT(moert_plugin_load(MOERT_KIND_DISPATCHER, path, &p), MOERT_ERR_ABI_MISMATCH);
    snprintf(message, sizeof message, "dispatcher plugin \"%s\" is a router plugin, expected a dispatcher", path);
    EXPECT(strcmp(moert_error_message(), message) == 0);
}

/* Each fixture breaks one rule; the message names both sides. */
static void test_refusals(void)
{
    char path[1536], message[4096];
    fixture_path("bad-abi", path, sizeof path);
    snprintf(message, sizeof message,
             "router plugin \"fixture-bad-abi\" (%s) was built for ABI 2.0, this moert supports ABI 1.x", path);
    expect_load_error("fixture-bad-abi", MOERT_ERR_ABI_MISMATCH, message);

    fixture_path("wrong-kind", path, sizeof path);
    snprintf(message, sizeof message,
             "router plugin \"fixture-wrong-kind\" (%s) is a dispatcher plugin, expected a router", path);
    expect_load_error("fixture-wrong-kind", MOERT_ERR_ABI_MISMATCH, message);

    fixture_path("no-symbol", path, sizeof path);
    snprintf(message, sizeof message,
             "router plugin \"fixture-no-symbol\" (%s) exports no moert_router_v1 symbol: not a router plugin for "
             "ABI 1.x",
             path);
    expect_load_error("fixture-no-symbol", MOERT_ERR_NOT_FOUND, message);

    fixture_path("small-struct", path, sizeof path);
    snprintf(message, sizeof message,
             "router plugin \"fixture-small-struct\" (%s) has a %zu-byte vtable, smaller than the %zu bytes of "
             "moert_router_v1 (ABI 1.2)",
             path, sizeof(moert_plugin_header) + 2 * sizeof(void *), (size_t)MOERT_ROUTER_V1_BASE_SIZE);
    expect_load_error("fixture-small-struct", MOERT_ERR_ABI_MISMATCH, message);

    /* a NULL member the core calls is refused by name, not met as a crash at the first step */
    fixture_path("null-member", path, sizeof path);
    snprintf(message, sizeof message, "router plugin \"fixture-null-member\" (%s) has no backward function", path);
    expect_load_error("fixture-null-member", MOERT_ERR_ABI_MISMATCH, message);

    /* by path, the path is said once */
    fixture_path("bad-abi", path, sizeof path);
    snprintf(message, sizeof message, "router plugin \"%s\" was built for ABI 2.0, this moert supports ABI 1.x", path);
    expect_load_error(path, MOERT_ERR_ABI_MISMATCH, message);

    expect_load_error("/nonexistent/libmoert-router-x.so", MOERT_ERR_NOT_FOUND,
                      "no router plugin \"/nonexistent/libmoert-router-x.so\": tried /nonexistent/libmoert-router-x.so "
                      "(no such file)");
    expect_load_error("", MOERT_ERR_INVALID_ARGUMENT, "no router plugin named (empty name)");
}

/* Not found: every path tried is listed, in search order, and MOERT_PLUGIN_PATH comes first. */
static void test_not_found(void)
{
    setenv("MOERT_PLUGIN_PATH", "/nonexistent/a:/nonexistent/b/:", 1);
    char dirs[8192];
    moert_plugin_search_path(dirs, sizeof dirs);
    EXPECT(strncmp(dirs, "/nonexistent/a:/nonexistent/b:", 30) == 0);
    char expected_dirs[4096];
    snprintf(expected_dirs, sizeof expected_dirs, ":%s/tests/fixtures:", build_root);
    EXPECT(strstr(dirs, expected_dirs) != NULL);
    snprintf(expected_dirs, sizeof expected_dirs, ":%s/plugins/router:", build_root);
    EXPECT(strstr(dirs, expected_dirs) != NULL);

    /* the expected message, built from the search path */
    char message[16384] = "no router plugin \"nope\": tried ";
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
    expect_load_error("nope", MOERT_ERR_NOT_FOUND, message);
    EXPECT(strstr(moert_error_message(), "/nonexistent/a/libmoert-router-nope.so, "
                                         "/nonexistent/b/libmoert-router-nope.so, ") != NULL);

    /* a search path longer than the message holds: the paths that fit, whole, then how many more, and the hint */
    static char many[300 * 80];
    many[0] = '\0';
    for (int i = 0; i < 300; i++) {
        size_t at = strlen(many);
        snprintf(many + at, sizeof many - at, "%s/nonexistent/a-folder-name-long-enough-to-fill-the-message-%03d",
                 i ? ":" : "", i);
    }
    setenv("MOERT_PLUGIN_PATH", many, 1);
    moert_plugin q;
    EXPECT_EQ_INT(moert_plugin_load(MOERT_KIND_ROUTER, "nope", &q), MOERT_ERR_NOT_FOUND);
    const char *msg = moert_error_message();
    EXPECT(strstr(msg, "fill-the-message-000/libmoert-router-nope.so, /nonexistent/") != NULL);
    const char *more = strstr(msg, "/libmoert-router-nope.so and ");
    EXPECT(more != NULL);
    int untold = 0;
    if (more) EXPECT(sscanf(more, "/libmoert-router-nope.so and %d more folders (set MOERT_PLUGIN_PATH", &untold) == 1);
    EXPECT(untold > 0 && untold < 300 + 20);
    EXPECT_ERROR_CONTAINS("(set MOERT_PLUGIN_PATH or give a path to the .so); router plugins found: \"topk\"");

    /* a file that exists but does not load is reported with dlopen's reason, and the search goes on */
    char dir[] = "/tmp/moert-test-loader-XXXXXX";
    EXPECT(mkdtemp(dir) != NULL);
    char junk[256];
    snprintf(junk, sizeof junk, "%s/libmoert-router-topk.so", dir);
    FILE *f = fopen(junk, "w");
    if (f) {
        fputs("not an ELF file\n", f);
        fclose(f);
    }
    setenv("MOERT_PLUGIN_PATH", dir, 1);
    moert_plugin p;
    EXPECT_OK(moert_plugin_load(MOERT_KIND_ROUTER, "topk", &p)); /* found further on, in the build tree */
    moert_plugin_unload(&p);
    EXPECT_EQ_INT(moert_plugin_load(MOERT_KIND_ROUTER, "nope2", &p), MOERT_ERR_NOT_FOUND);
    unlink(junk);
    snprintf(junk, sizeof junk, "%s/libmoert-router-nope2.so", dir);
    f = fopen(junk, "w");
    if (f) {
        fputs("not an ELF file\n", f);
        fclose(f);
    }
    EXPECT_EQ_INT(moert_plugin_load(MOERT_KIND_ROUTER, "nope2", &p), MOERT_ERR_NOT_FOUND);
    char needle[600];
    snprintf(needle, sizeof needle, "no router plugin \"nope2\": tried %s (exists but failed to load: %s: ", junk,
             junk);
    EXPECT_ERROR_CONTAINS(needle);
    unlink(junk);

    /* MOERT_PLUGIN_PATH shadows the build tree */
    char fixture[1536];
    fixture_path("init-fails", fixture, sizeof fixture);
    snprintf(junk, sizeof junk, "%s/libmoert-router-topk.so", dir);
    EXPECT(symlink(fixture, junk) == 0);
    EXPECT_OK(moert_plugin_load(MOERT_KIND_ROUTER, "topk", &p));
    if (p.dl) {
        EXPECT(strcmp(p.header->name, "fixture-init-fails") == 0);
        EXPECT(strcmp(p.path, junk) == 0);
    }
    moert_plugin_unload(&p);
    unlink(junk);
    rmdir(dir);
    setenv("MOERT_PLUGIN_PATH", "", 1);
}

/* init: success with options, and a refusal whose message comes back prefixed with the plugin name. */
static void test_init(void)
{
    moert_layer_info layer = test_layer(64, 128, 8, 2, 256, 1, 0, MOERT_F32);
    test_instance ti;
    EXPECT_EQ_INT(test_instance_open(&ti, MOERT_KIND_ROUTER, "fixture-init-fails", "{\"reason\": \"no GPU today\"}",
                                     &layer, NULL, 0, 1),
                  MOERT_ERR_CONFIG);
    EXPECT(strcmp(moert_error_message(),
                  "router plugin \"fixture-init-fails\": fixture refuses to start: no GPU today") == 0);
    EXPECT(ti.ctx == NULL);
    test_instance_close(&ti);

    /* an option of the wrong type: the host's message */
    EXPECT_EQ_INT(test_instance_open(&ti, MOERT_KIND_ROUTER, "fixture-init-fails", "{\"fail\": 1}", &layer, NULL, 0, 1),
                  MOERT_ERR_CONFIG);
    EXPECT(strcmp(moert_error_message(),
                  "router plugin \"fixture-init-fails\": config error at $.test.fail: got 1, expected true or false") ==
           0);
    test_instance_close(&ti);

    /* it starts with fail=false; then a misspelt option is reported by the core */
    EXPECT_OK(
        test_instance_open(&ti, MOERT_KIND_ROUTER, "fixture-init-fails", "{\"fail\": false}", &layer, NULL, 0, 1));
    EXPECT(ti.ctx != NULL);
    test_instance_close(&ti);
    EXPECT_EQ_INT(test_instance_open(&ti, MOERT_KIND_ROUTER, "fixture-init-fails",
                                     "{\"fail\": false, \"reasn\": \"x\"}", &layer, NULL, 0, 1),
                  MOERT_ERR_CONFIG);
    EXPECT(strcmp(moert_error_message(), "config error at $.test.reasn: unknown key (did you mean \"reason\"?)") == 0);
    test_instance_close(&ti);

    /* a layer whose sizes would wrap the plugin's buffer sizes never reaches its init, whoever built the layer */
    moert_layer_info huge = test_layer((int64_t)1 << 61, 128, 8, 2, 256, 1, 0, MOERT_F32);
    EXPECT_EQ_INT(test_instance_open(&ti, MOERT_KIND_ROUTER, "topk", "{}", &huge, NULL, 0, 1),
                  MOERT_ERR_INVALID_ARGUMENT);
    EXPECT(strcmp(moert_error_message(),
                  "router plugin \"topk\": layer 0 has hidden 2305843009213693952, expected 1 .. 65536") == 0);
    test_instance_close(&ti);
    moert_layer_info wide = test_layer(65536, 262144, 16384, 16384, 16777216, 1, 0, MOERT_F32);
    EXPECT_EQ_INT(test_instance_open(&ti, MOERT_KIND_ROUTER, "topk", "{}", &wide, NULL, 0, 1),
                  MOERT_ERR_INVALID_ARGUMENT);
    EXPECT(strcmp(moert_error_message(),
                  "router plugin \"topk\": layer 0's buffers (fc1 weights, or world x max_tokens x "
                  "topk rows) would exceed 16 TiB") == 0);
    test_instance_close(&ti);
}

typedef struct scan_result {
    int loaded, failed;
    bool saw_topk, saw_bad_abi, saw_no_kind;
} scan_result;

static void visit(void *user, const moert_plugin *p, const char *path, moert_result rc, const char *error)
{
    scan_result *s = user;
    if (rc == MOERT_OK) {
        s->loaded++;
        EXPECT(p != NULL && p->header != NULL && strcmp(p->path, path) == 0);
        if (p && strcmp(p->header->name, "topk") == 0) s->saw_topk = true;
        EXPECT(error != NULL && error[0] == '\0');
    } else {
        s->failed++;
        EXPECT(p == NULL);
        if (strstr(path, "fixture-bad-abi")) {
            s->saw_bad_abi = true;
            EXPECT(strstr(error, "was built for ABI 2.0, this moert supports ABI 1.x") != NULL);
        }
        if (strstr(path, "libmoert-thing.so")) {
            s->saw_no_kind = true;
            EXPECT(strstr(error, "the name does not say a kind") != NULL);
        }
    }
}

/* scan visits every libmoert-*.so once per directory, loaded or with its error. */
static void test_scan(void)
{
    char dir[] = "/tmp/moert-test-scan-XXXXXX";
    EXPECT(mkdtemp(dir) != NULL);
    char odd[256];
    snprintf(odd, sizeof odd, "%s/libmoert-thing.so", dir);
    FILE *f = fopen(odd, "w");
    if (f) fclose(f);
    char env[600];
    snprintf(env, sizeof env, "%s:%s", dir, dir); /* listed twice, scanned once */
    setenv("MOERT_PLUGIN_PATH", env, 1);
    scan_result s = {0};
    int seen = moert_plugin_scan(visit, &s);
    EXPECT_EQ_INT(seen, s.loaded + s.failed);
    EXPECT(s.loaded >= 5); /* the 4 built plugins and the init-fails fixture */
    EXPECT(s.failed >= 5); /* 4 broken fixtures and the odd file */
    EXPECT(s.saw_topk && s.saw_bad_abi && s.saw_no_kind);
    unlink(odd);
    rmdir(dir);
    setenv("MOERT_PLUGIN_PATH", "", 1);
}

int main(void)
{
    const char *root = getenv("MOERT_TEST_BUILD_ROOT");
    if (!root) {
        fprintf(stderr, "test_loader: MOERT_TEST_BUILD_ROOT is not set (run it with meson test)\n");
        return 1;
    }
    snprintf(build_root, sizeof build_root, "%s", root);
    setenv("MOERT_PLUGIN_PATH", "", 1);
    test_names();
    test_builtin_plugins();
    test_refusals();
    test_not_found();
    test_init();
    test_scan();
    return test_finish("test_loader");
}
