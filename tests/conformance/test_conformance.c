/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Conformance: every plugin built under MOERT_TEST_BUILD_ROOT/plugins loads through the loader, has a
 * complete header and vtable, and starts and stops with default options at world 1 and 2, side by side,
 * for each activation dtype it declares. Also run under valgrind (see tests/meson.build).
 */
#include <glob.h>
#include <pthread.h>
#include <stdint.h>

#include "error.h"
#include "test_util.h"

/* What a file name says: libmoert-<part>-<name>.so. */
static moert_plugin_kind kind_of_file(const char *file, const char **name)
{
    static const moert_plugin_kind kinds[] = {MOERT_KIND_ROUTER, MOERT_KIND_DISPATCHER, MOERT_KIND_PRECISION,
                                              MOERT_KIND_MEMORY_POLICY};
    for (int i = 0; i < 4; i++) {
        char prefix[64];
        snprintf(prefix, sizeof prefix, "libmoert-%s-", moert_kind_file_part(kinds[i]));
        if (strncmp(file, prefix, strlen(prefix)) == 0) {
            *name = file + strlen(prefix);
            return kinds[i];
        }
    }
    return (moert_plugin_kind)0;
}

static size_t vtable_size(moert_plugin_kind kind)
{
    switch (kind) {
    case MOERT_KIND_ROUTER: return MOERT_ROUTER_V1_BASE_SIZE; /* its required functions; forward_losses may be NULL */
    case MOERT_KIND_DISPATCHER: return sizeof(moert_dispatcher_v1);
    case MOERT_KIND_PRECISION: return MOERT_PRECISION_V1_BASE_SIZE; /* its functions; agreement_rtol follows */
    case MOERT_KIND_MEMORY_POLICY: return sizeof(moert_memory_policy_v1);
    default: return 0;
    }
}

/* The header: ABI, kind, names, capabilities; every member after it is a function and none is NULL. */
static void check_header(const moert_plugin *p, moert_plugin_kind kind, const char *file_name, const char *label)
{
    const moert_plugin_header *h = p->header;
    EXPECT_EQ_INT(MOERT_ABI_VERSION_MAJOR(h->abi_version), MOERT_ABI_MAJOR);
    EXPECT_EQ_INT(h->kind, kind);
    EXPECT(h->struct_size >= vtable_size(kind));
    EXPECT(h->name && h->name[0]);
    char expected_file[256];
    snprintf(expected_file, sizeof expected_file, "%s.so", h->name);
    if (strcmp(file_name, expected_file) != 0) {
        fprintf(stderr, "%s: header name \"%s\" does not match its file name\n", label, h->name);
        test_failures++;
    }
    EXPECT(h->version && h->version[0]);
    EXPECT(h->description && h->description[0]);
    EXPECT(h->devices & MOERT_CAP_DEVICE(MOERT_DEVICE_CPU)); /* every plugin has the CPU reference path */
    EXPECT(h->dtypes != 0);
    EXPECT((h->flags & ~(MOERT_CAP_GRAPH_CAPTURABLE | MOERT_CAP_NEEDS_HOST_SYNC | MOERT_CAP_WGRAD_OVERWRITE |
                         MOERT_CAP_AUTO_OVERLAP | MOERT_CAP_PREPARE_OWN_STREAM | MOERT_CAP_GATHERS_TOKENS)) == 0);
    /* dispatchers' claims */
    EXPECT(!(h->flags & (MOERT_CAP_AUTO_OVERLAP | MOERT_CAP_PREPARE_OWN_STREAM | MOERT_CAP_GATHERS_TOKENS)) ||
           kind == MOERT_KIND_DISPATCHER);
    for (size_t off = sizeof(moert_plugin_header); off < vtable_size(kind); off += sizeof(void (*)(void))) {
        void (*fn)(void);
        memcpy(&fn, (const char *)h + off, sizeof fn);
        if (!fn) {
            fprintf(stderr, "%s: vtable member at offset %zu is NULL\n", label, off);
            test_failures++;
        }
    }
    /* a precision recipe's agreement_rtol, where its header has one: 0 (not declared: the default) or in (0, 1) */
    if (kind == MOERT_KIND_PRECISION &&
        h->struct_size >= offsetof(moert_precision_v1, agreement_rtol) + sizeof(double)) {
        double rtol = ((const moert_precision_v1 *)h)->agreement_rtol;
        if (!(rtol == 0.0 || (rtol > 0.0 && rtol < 1.0))) {
            fprintf(stderr, "%s: agreement_rtol %g is neither 0 (not declared) nor in (0, 1)\n", label, rtol);
            test_failures++;
        }
    }
}

/* One instance with default options, on one rank, optionally describing its options. */
static void start_stop_one(const moert_plugin *p, moert_dtype dtype, const char *label)
{
    moert_section *sec = moert_section_create(NULL, "$.plugin");
    moert_section_set_describe(sec, true);
    moert_host_setup setup = {.who = label, .options = sec, .rank = 0, .world_size = 1, .device = moert_cpu()};
    moert_host *host = NULL;
    void *ctx = NULL;
    moert_layer_info layer = test_layer(64, 128, 8, 2, 256, 1, 0, dtype);
    EXPECT_OK(moert_host_create(&setup, &host));
    if (!host) goto exit;
    moert_result rc = moert_plugin_init(p, &ctx, host, &layer);
    if (rc != MOERT_OK) {
        fprintf(stderr, "%s (%s): init with default options failed: %s\n", label, moert_dtype_name(dtype),
                moert_error_message());
        test_failures++;
        goto exit;
    }
    EXPECT(ctx != NULL);
    EXPECT_OK(moert_section_check_unknown(sec));
    for (int i = 0; i < moert_section_option_count(sec); i++) {
        const moert_option_desc *d = moert_section_option(sec, i);
        if (!d->help[0] || !d->type[0]) {
            fprintf(stderr, "%s: option \"%s\" has no help text\n", label, d->key);
            test_failures++;
        }
    }
exit:
    if (ctx) moert_plugin_finalize(p, ctx);
    moert_host_free(host);
    moert_section_free(sec);
}

/* Two instances of one plugin alive at once (A/B in one process). */
static void side_by_side(const moert_plugin *p, const char *label)
{
    test_instance a, b;
    moert_layer_info layer = test_layer(64, 128, 8, 2, 256, 1, 0, MOERT_F32);
    char spec[1100];
    snprintf(spec, sizeof spec, "%s", p->path);
    EXPECT_OK(test_instance_open(&a, p->kind, spec, "{}", &layer, NULL, 0, 1));
    EXPECT_OK(test_instance_open(&b, p->kind, spec, "{}", &layer, NULL, 0, 1));
    EXPECT(a.ctx != NULL && b.ctx != NULL && a.ctx != b.ctx);
    test_instance_close(&b);
    test_instance_close(&a);
}

typedef struct world_run {
    const moert_plugin *plugin;
    moert_comm_group *group;
    moert_result rc[2];
    char message[2][1024];
} world_run;

/* Rank threads of a world of 2: each starts and stops its own instance. */
static void world_rank(int rank, void *user)
{
    world_run *run = user;
    moert_section *sec = moert_section_create(NULL, "$.plugin");
    moert_host_setup setup = {
        .who = "conformance", .options = sec, .comm = run->group, .rank = rank, .world_size = 2, .device = moert_cpu()};
    moert_host *host = NULL;
    void *ctx = NULL;
    moert_layer_info layer = test_layer(64, 128, 8, 2, 256, 2, rank, MOERT_F32);
    run->rc[rank] = moert_host_create(&setup, &host);
    if (run->rc[rank] == MOERT_OK) run->rc[rank] = moert_plugin_init(run->plugin, &ctx, host, &layer);
    if (run->rc[rank] != MOERT_OK) {
        snprintf(run->message[rank], sizeof run->message[rank], "%s", moert_error_message());
        moert_comm_abort(run->group, rank, "init failed"); /* do not leave the peer waiting */
    }
    if (ctx) moert_plugin_finalize(run->plugin, ctx);
    moert_host_free(host);
    moert_section_free(sec);
}

static void world_of_two(const moert_plugin *p, const char *label)
{
    world_run run = {.plugin = p};
    EXPECT_OK(moert_comm_group_create(2, 30.0, &run.group));
    test_run_ranks(2, world_rank, &run);
    for (int r = 0; r < 2; r++) {
        if (run.rc[r] != MOERT_OK) {
            fprintf(stderr, "%s: init at world 2, rank %d failed: %s\n", label, r, run.message[r]);
            test_failures++;
        }
    }
    moert_comm_group_free(run.group);
}

/* Checks one plugin file; prints its line. */
static void check_file(const char *path)
{
    const char *slash = strrchr(path, '/');
    const char *file = slash ? slash + 1 : path;
    const char *name = NULL;
    moert_plugin_kind kind = kind_of_file(file, &name);
    if (!kind) {
        fprintf(stderr, "%s: the file name does not say a kind (libmoert-<router|dispatch|precision|memory>-NAME.so)\n",
                path);
        test_failures++;
        return;
    }
    moert_plugin p;
    if (moert_plugin_load(kind, path, &p) != MOERT_OK) {
        fprintf(stderr, "%s: %s\n", path, moert_error_message());
        test_failures++;
        return;
    }
    char label[256];
    snprintf(label, sizeof label, "%s %s", moert_kind_name(kind), p.header->name);
    int before = test_failures;
    check_header(&p, kind, name, label);
    static const moert_dtype dtypes[] = {MOERT_F32, MOERT_BF16, MOERT_F64};
    for (int d = 0; d < 3; d++)
        if (p.header->dtypes & MOERT_CAP_DTYPE(dtypes[d])) start_stop_one(&p, dtypes[d], label);
    side_by_side(&p, label);
    world_of_two(&p, label);
    printf("%-40s %s\n", label, test_failures == before ? "ok" : "FAILED");
    moert_plugin_unload(&p);
}

/* moert-conformance PLUGIN.so...: the files given (an out-of-tree plugin: installed with moert); without arguments,
 * every plugin built under MOERT_TEST_BUILD_ROOT/plugins (meson test). */
int main(int argc, char **argv)
{
    setenv("MOERT_LOG", "error", 0);
    if (argc > 1) {
        if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
            printf("usage: moert-conformance PLUGIN.so...\n  checks each plugin's header and vtable, and that it "
                   "starts and stops with default options at world 1 and 2, side by side (docs/writing-a-plugin.md)\n");
            return 0;
        }
        for (int i = 1; i < argc; i++) check_file(argv[i]);
        return test_finish("moert-conformance");
    }
    const char *root = getenv("MOERT_TEST_BUILD_ROOT");
    if (!root) {
        fprintf(stderr, "test_conformance: give plugin files (moert-conformance PLUGIN.so...), or run it with meson "
                        "test (MOERT_TEST_BUILD_ROOT)\n");
        return 1;
    }
    char pattern[1200];
    snprintf(pattern, sizeof pattern, "%s/plugins/*/libmoert-*.so", root);
    glob_t g;
    int found = glob(pattern, 0, NULL, &g) == 0 ? (int)g.gl_pathc : 0;
    EXPECT(found >= 4);
    for (int i = 0; i < found; i++) check_file(g.gl_pathv[i]);
    if (found) globfree(&g);
    return test_finish("test_conformance");
}
