/* `moert plugins [--options]`: the plugins found along the search path, and each plugin's options. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli_common.h"
#include "config.h"
#include "error.h"
#include "host.h"
#include "loader.h"

static void plugins_usage(FILE *f)
{
    fprintf(f,
            "usage: moert plugins [--options]\n"
            "  Lists every plugin file found along the search path (MOERT_PLUGIN_PATH, the build tree, the\n"
            "  install dir): kind, name, version, devices, dtypes, flags and path. A name found twice is\n"
            "  loaded from the first place; the later ones are marked shadowed.\n"
            "  --options   also start each plugin once with a default layer (H=64 F=128 E=8 K=2 T=256, one rank,\n"
            "              CPU) and list the options it reads: key, type, default, range, help.\n");
}

/* "cpu,cuda" from capability bits. */
static void device_names(uint32_t bits, char *buf, size_t size)
{
    static const struct { int type; const char *name; } devices[] = {
        {MOERT_DEVICE_CPU, "cpu"}, {MOERT_DEVICE_CUDA, "cuda"}, {MOERT_DEVICE_CUDA_HOST, "cuda_host"}};
    buf[0] = '\0';
    for (size_t i = 0; i < sizeof devices / sizeof devices[0]; i++) {
        if (!(bits & MOERT_CAP_DEVICE(devices[i].type))) continue;
        size_t used = strlen(buf);
        snprintf(buf + used, size - used, "%s%s", used ? "," : "", devices[i].name);
    }
    if (!buf[0]) snprintf(buf, size, "-");
}

/* "fp32,bf16" from capability bits. */
static void dtype_names(uint32_t bits, char *buf, size_t size)
{
    buf[0] = '\0';
    for (int t = 0; t < MOERT_DTYPE_COUNT; t++) {
        if (!(bits & MOERT_CAP_DTYPE(t))) continue;
        size_t used = strlen(buf);
        snprintf(buf + used, size - used, "%s%s", used ? "," : "", moert_dtype_name((moert_dtype)t));
    }
    if (!buf[0]) snprintf(buf, size, "-");
}

/* "graph,host_sync" from the flag bits. */
static void flag_names(uint32_t bits, char *buf, size_t size)
{
    snprintf(buf, size, "%s%s%s", (bits & MOERT_CAP_GRAPH_CAPTURABLE) ? "graph" : "",
             (bits & MOERT_CAP_GRAPH_CAPTURABLE) && (bits & MOERT_CAP_NEEDS_HOST_SYNC) ? "," : "",
             (bits & MOERT_CAP_NEEDS_HOST_SYNC) ? "host_sync" : "");
    if (!buf[0]) snprintf(buf, size, "-");
}

/* The config key of a kind's section, for option paths. */
static const char *section_key(moert_plugin_kind kind)
{
    for (int s = 0; s < MOERT_SLOT_COUNT; s++)
        if (moert_slot_kind((moert_slot)s) == kind) return moert_slot_key((moert_slot)s);
    return "plugin";
}

/* One plugin file that loaded. */
typedef struct plugin_row {
    char kind[16], name[64], version[24], devices[64], dtypes[128], flags[32], path[1024];
    bool shadowed;
    char *options_text; /* --options: what print_options wrote */
} plugin_row;

typedef struct listing {
    bool options;
    plugin_row *rows;
    int row_count, row_cap;
    char *problems;     /* files that did not load, printed after the table */
    size_t problems_len;
} listing;

/* True if a plugin of this kind and name is listed already (the loader would take that one). */
static bool seen_before(const listing *l, const char *kind, const char *name)
{
    for (int i = 0; i < l->row_count; i++)
        if (strcmp(l->rows[i].kind, kind) == 0 && strcmp(l->rows[i].name, name) == 0) return true;
    return false;
}

/* Starts the plugin once in describe mode and writes the options it read to f. */
static void print_options(FILE *f, const moert_plugin *p)
{
    char path[64];
    snprintf(path, sizeof path, "$.%s", section_key(p->kind));
    moert_section *sec = moert_section_create(NULL, path);
    moert_host *host = NULL;
    void *ctx = NULL;
    if (!sec) return;
    moert_section_set_describe(sec, true);
    char who[256];
    snprintf(who, sizeof who, "%s[%s] describe", moert_kind_name(p->kind), p->header->name);
    moert_host_setup setup = {.who = who, .options = sec, .comm = NULL, .rank = 0, .world_size = 1,
                              .device = moert_cpu()};
    moert_layer_info layer = {.struct_size = sizeof layer, .layer_index = 0, .num_layers = 1, .hidden = 64,
                              .ffn_hidden = 128, .num_experts = 8, .topk = 2, .num_local_experts = 8,
                              .first_local_expert = 0, .max_tokens = 256, .dtype = MOERT_F32, .device = moert_cpu()};
    moert_result rc = moert_host_create(&setup, &host);
    if (rc == MOERT_OK) rc = moert_plugin_init(p, &ctx, host, &layer);
    int count = moert_section_option_count(sec);
    if (count == 0 && rc == MOERT_OK) fprintf(f, "  (no options)\n");
    if (count > 0) fprintf(f, "  %-22s %-7s %-12s %-24s %s\n", "OPTION", "TYPE", "DEFAULT", "RANGE", "HELP");
    for (int i = 0; i < count; i++) {
        const moert_option_desc *d = moert_section_option(sec, i);
        fprintf(f, "  %-22s %-7s %-12s %-24s %s\n", d->key, d->type, d->def[0] ? d->def : "\"\"",
                d->range[0] ? d->range : "-", d->help);
    }
    if (rc != MOERT_OK) fprintf(f, "  (init failed with the default options: %s)\n", moert_last_error());
    if (ctx) moert_plugin_finalize(p, ctx);
    moert_host_free(host);
    moert_section_free(sec);
}

/* Records one row per plugin file; files that did not load are kept for the end. */
static void visit(void *user, const moert_plugin *p, const char *path, moert_result rc, const char *error)
{
    listing *l = user;
    if (rc != MOERT_OK) {
        char line[4096];
        int n = snprintf(line, sizeof line, "  %s\n", error);
        if (n < 0) return;
        if ((size_t)n >= sizeof line) n = (int)sizeof line - 1;
        char *grown = realloc(l->problems, l->problems_len + (size_t)n + 1);
        if (!grown) return;
        l->problems = grown;
        memcpy(l->problems + l->problems_len, line, (size_t)n);
        l->problems_len += (size_t)n;
        l->problems[l->problems_len] = '\0';
        return;
    }
    if (l->row_count == l->row_cap) {
        int cap = l->row_cap ? 2 * l->row_cap : 16;
        plugin_row *grown = realloc(l->rows, (size_t)cap * sizeof *grown);
        if (!grown) return;
        l->rows = grown;
        l->row_cap = cap;
    }
    plugin_row *row = &l->rows[l->row_count];
    memset(row, 0, sizeof *row);
    const moert_plugin_header *h = p->header;
    snprintf(row->kind, sizeof row->kind, "%s", moert_kind_name(p->kind));
    snprintf(row->name, sizeof row->name, "%s", h->name);
    snprintf(row->version, sizeof row->version, "%s", h->version ? h->version : "-");
    device_names(h->devices, row->devices, sizeof row->devices);
    dtype_names(h->dtypes, row->dtypes, sizeof row->dtypes);
    flag_names(h->flags, row->flags, sizeof row->flags);
    snprintf(row->path, sizeof row->path, "%s", path);
    row->shadowed = seen_before(l, row->kind, row->name);
    if (l->options) {
        size_t size = 0;
        FILE *f = open_memstream(&row->options_text, &size);
        if (f) {
            fprintf(f, "%s %s (%s)%s\n", row->kind, row->name, row->path, row->shadowed ? " (shadowed)" : "");
            if (h->description && h->description[0]) fprintf(f, "  %s\n", h->description);
            print_options(f, p);
            fclose(f);
        }
    }
    l->row_count++;
}

/* Width of the widest value of a column (and its title). */
#define COLUMN_WIDTH(l, field, title)                                                                        \
    ({                                                                                                       \
        int _w = (int)strlen(title);                                                                         \
        for (int _i = 0; _i < (l)->row_count; _i++)                                                          \
            if ((int)strlen((l)->rows[_i].field) > _w) _w = (int)strlen((l)->rows[_i].field);                \
        _w;                                                                                                  \
    })

/* The table, with columns as wide as their widest value. */
static void print_table(const listing *l)
{
    int wk = COLUMN_WIDTH(l, kind, "KIND"), wn = COLUMN_WIDTH(l, name, "NAME");
    int wv = COLUMN_WIDTH(l, version, "VERSION"), wd = COLUMN_WIDTH(l, devices, "DEVICES");
    int wt = COLUMN_WIDTH(l, dtypes, "DTYPES"), wf = COLUMN_WIDTH(l, flags, "FLAGS");
    printf("%-*s  %-*s  %-*s  %-*s  %-*s  %-*s  %s\n", wk, "KIND", wn, "NAME", wv, "VERSION", wd, "DEVICES", wt,
           "DTYPES", wf, "FLAGS", "PATH");
    for (int i = 0; i < l->row_count; i++) {
        const plugin_row *r = &l->rows[i];
        printf("%-*s  %-*s  %-*s  %-*s  %-*s  %-*s  %s%s\n", wk, r->kind, wn, r->name, wv, r->version, wd, r->devices,
               wt, r->dtypes, wf, r->flags, r->path, r->shadowed ? " (shadowed)" : "");
    }
}

int moert_cmd_plugins(int argc, char **argv)
{
    listing l = {0};
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            plugins_usage(stdout);
            return 0;
        } else if (!strcmp(argv[i], "--options")) {
            l.options = true;
        } else {
            fprintf(stderr, "moert plugins: unknown argument \"%s\"\n", argv[i]);
            plugins_usage(stderr);
            return 2;
        }
    }
    int seen = moert_plugin_scan(visit, &l);
    print_table(&l);
    if (l.problems) printf("\nfiles that did not load:\n%s", l.problems);
    if (seen == 0) {
        char dirs[8192];
        moert_plugin_search_path(dirs, sizeof dirs);
        printf("no plugin files found; searched %s\n", dirs);
    }
    if (l.options) {
        for (int i = 0; i < l.row_count; i++)
            if (l.rows[i].options_text) printf("\n%s", l.rows[i].options_text);
        printf("\noptions go in the plugin's section of a config, e.g. {\"router\": {\"plugin\": \"topk\", "
               "\"OPTION\": VALUE}}\n");
    }
    for (int i = 0; i < l.row_count; i++) free(l.rows[i].options_text);
    free(l.rows);
    free(l.problems);
    return 0;
}
