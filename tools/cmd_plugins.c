/* SPDX-License-Identifier: Apache-2.0 */
/* `moert plugins [--options]`: the plugins found along the search path, and each plugin's options. */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cli_common.h"

static void plugins_usage(FILE *f)
{
    fprintf(f, "usage: moert plugins [--options]\n"
               "  Lists every plugin file found along the search path (MOERT_PLUGIN_PATH, the build tree, the\n"
               "  install dir): kind, name, version, devices, dtypes, flags and path. A name found twice is\n"
               "  loaded from the first place; the later ones are marked shadowed.\n"
               "  --options   also start each plugin once with a default layer (H=64 F=128 E=8 K=2 T=256, one rank,\n"
               "              CPU) and list the options it reads: key, type, default, range, help.\n"
               "  Each file is loaded (and started) in a child process: one that crashes, exits or hangs is reported\n"
               "  and the others are listed.\n");
}

/* "cpu,cuda" from capability bits. */
static void device_names(uint32_t bits, char *buf, size_t size)
{
    static const struct {
        int type;
        const char *name;
    } devices[] = {{MOERT_DEVICE_CPU, "cpu"}, {MOERT_DEVICE_CUDA, "cuda"}, {MOERT_DEVICE_CUDA_HOST, "cuda_host"}};
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

/* "graph,host_sync,..." from the flag bits. */
static void flag_names(uint32_t bits, char *buf, size_t size)
{
    static const struct {
        uint32_t bit;
        const char *name;
    } names[] = {{MOERT_CAP_GRAPH_CAPTURABLE, "graph"},
                 {MOERT_CAP_NEEDS_HOST_SYNC, "host_sync"},
                 {MOERT_CAP_WGRAD_OVERWRITE, "wgrad_overwrite"},
                 {MOERT_CAP_AUTO_OVERLAP, "auto_overlap"},
                 {MOERT_CAP_PREPARE_OWN_STREAM, "prepare_own_stream"},
                 {MOERT_CAP_GATHERS_TOKENS, "gathers_tokens"}};
    buf[0] = 0;
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        if (!(bits & names[i].bit)) continue;
        size_t used = strlen(buf);
        snprintf(buf + used, size - used, "%s%s", used ? "," : "", names[i].name);
    }
    if (!buf[0]) snprintf(buf, size, "-");
}

/* One plugin file that loaded. */
typedef struct plugin_row {
    char kind[16], name[64], version[24], devices[64], dtypes[128], flags[64], path[1024];
    bool shadowed;
    char *options_text; /* --options: what print_options wrote */
} plugin_row;

typedef struct listing {
    bool options;
    plugin_row *rows;
    int row_count, row_cap;
    char *problems; /* files that did not load, printed after the table */
    size_t problems_len;
} listing;

/* True if a plugin of this kind and name is listed already (the loader would take that one). */
static bool seen_before(const listing *l, const char *kind, const char *name)
{
    for (int i = 0; i < l->row_count; i++)
        if (strcmp(l->rows[i].kind, kind) == 0 && strcmp(l->rows[i].name, name) == 0) return true;
    return false;
}

/* Where print_options writes each option, and how many it wrote. */
typedef struct option_sink {
    FILE *f;
    int count;
} option_sink;

static void print_option(void *user, const moert_plugin_option *d)
{
    option_sink *sink = user;
    if (sink->count++ == 0)
        fprintf(sink->f, "  %-22s %-7s %-12s %-24s %s\n", "OPTION", "TYPE", "DEFAULT", "RANGE", "HELP");
    fprintf(sink->f, "  %-22s %-7s %-12s %-24s %s\n", d->key, d->type, d->default_text[0] ? d->default_text : "\"\"",
            d->range[0] ? d->range : "-", d->help);
}

/* Starts the plugin once with its default options and writes the options it read to f. */
static void print_options(FILE *f, moert_plugin_kind kind, const char *path)
{
    option_sink sink = {f, 0};
    moert_result rc = moert_plugin_list_options(kind, path, print_option, &sink);
    if (sink.count == 0 && rc == MOERT_OK) fprintf(f, "  (no options)\n");
    if (rc != MOERT_OK) fprintf(f, "  (init failed with the default options: %s)\n", moert_last_error());
}

/* Adds a line to the report of files that did not load or start. */
static void add_problem(listing *l, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void add_problem(listing *l, const char *fmt, ...)
{
    char line[4096];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line - 1, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if ((size_t)n >= sizeof line - 1) n = (int)sizeof line - 2;
    line[n++] = '\n';
    line[n] = '\0';
    char *grown = realloc(l->problems, l->problems_len + (size_t)n + 1);
    if (!grown) return;
    l->problems = grown;
    memcpy(l->problems + l->problems_len, line, (size_t)n + 1);
    l->problems_len += (size_t)n;
}

/* A row from what a plugin's header declares. */
static void fill_row(plugin_row *row, const moert_plugin_description *d, const char *path)
{
    memset(row, 0, sizeof *row);
    snprintf(row->kind, sizeof row->kind, "%s", d->kind_name);
    snprintf(row->name, sizeof row->name, "%s", d->name);
    snprintf(row->version, sizeof row->version, "%s", d->version[0] ? d->version : "-");
    device_names(d->devices, row->devices, sizeof row->devices);
    dtype_names(d->dtypes, row->dtypes, sizeof row->dtypes);
    flag_names(d->flags, row->flags, sizeof row->flags);
    snprintf(row->path, sizeof row->path, "%s", path);
}

/* ---- probing a file in a child process ----
 * The child writes tagged records to a pipe: 'L' (loading), 'E' + code + message (it did not load), 'R' + the row,
 * 'I' (starting it), 'O' + the options text, 'D' (done). The parent reads them; a child that dies early leaves the
 * last stage it reached. */

#define PROBE_SECONDS 60 /* a plugin that takes longer to load and start is reported as hanging */

static void put_all(int fd, const void *buf, size_t n)
{
    const char *p = buf;
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w <= 0) _exit(3);
        p += w;
        n -= (size_t)w;
    }
}

static void put_text(int fd, char tag, const char *text)
{
    uint32_t n = (uint32_t)strlen(text);
    put_all(fd, &tag, 1);
    put_all(fd, &n, sizeof n);
    put_all(fd, text, n);
}

/* The child: load the file, describe it, start it (--options); never returns. */
static void probe_child(int fd, const char *path, moert_plugin_kind kind, bool options)
{
    alarm(PROBE_SECONDS);
    /* what the plugin or the crash report would print goes nowhere: the parent reports the outcome */
    int null_fd = open("/dev/null", O_WRONLY);
    if (null_fd >= 0) {
        dup2(null_fd, 1);
        dup2(null_fd, 2);
        close(null_fd);
    }
    put_all(fd, "L", 1);
    moert_plugin_description p = {.struct_size = sizeof p};
    moert_result rc = moert_plugin_describe(kind, path, &p);
    if (rc != MOERT_OK) {
        int32_t code = rc;
        put_all(fd, "E", 1);
        put_all(fd, &code, sizeof code);
        put_text(fd, 'm', moert_last_error());
        _exit(0);
    }
    plugin_row row;
    fill_row(&row, &p, path);
    put_all(fd, "R", 1);
    put_all(fd, &row, sizeof row);
    if (options) {
        put_all(fd, "I", 1);
        char *text = NULL;
        size_t size = 0;
        FILE *f = open_memstream(&text, &size);
        if (f) {
            if (p.description[0]) fprintf(f, "  %s\n", p.description);
            print_options(f, kind, path);
            fclose(f);
            put_text(fd, 'O', text ? text : "");
        }
    }
    put_all(fd, "D", 1);
    _exit(0);
}

/* Reads the pipe to its end into a buffer. */
static char *read_all(int fd, size_t *len)
{
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
    for (;;) {
        if (!buf) return NULL;
        if (n == cap) {
            char *grown = realloc(buf, cap * 2);
            if (!grown) break;
            buf = grown;
            cap *= 2;
        }
        ssize_t r = read(fd, buf + n, cap - n);
        if (r > 0)
            n += (size_t)r;
        else if (r == 0 || errno != EINTR)
            break;
    }
    *len = n;
    return buf;
}

/* Takes `n` bytes at *at of buf[len]; false when the record was cut short (the child died writing it). */
static bool take(const char *buf, size_t len, size_t *at, void *out, size_t n)
{
    if (*at + n > len) return false;
    memcpy(out, buf + *at, n);
    *at += n;
    return true;
}

/* A text record: its length, then its bytes, returned NUL-terminated (malloc'ed). */
static char *take_text(const char *buf, size_t len, size_t *at)
{
    char tag;
    uint32_t n;
    if (!take(buf, len, at, &tag, 1) || !take(buf, len, at, &n, sizeof n) || *at + n > len) return NULL;
    char *text = malloc((size_t)n + 1);
    if (!text) return NULL;
    memcpy(text, buf + *at, n);
    text[n] = '\0';
    *at += n;
    return text;
}

/* Loads (and with --options starts) one file in a child process and records its row, or what went wrong. */
static void probe_file(void *user, const char *path, moert_plugin_kind kind)
{
    listing *l = user;
    int fds[2];
    if (pipe(fds) != 0) {
        add_problem(l, "  %s: cannot probe it: pipe: %s", path, strerror(errno));
        return;
    }
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid < 0) {
        add_problem(l, "  %s: cannot probe it: fork: %s", path, strerror(errno));
        close(fds[0]);
        close(fds[1]);
        return;
    }
    if (pid == 0) {
        close(fds[0]);
        probe_child(fds[1], path, kind, l->options);
    }
    close(fds[1]);
    size_t len = 0, at = 0;
    char *buf = read_all(fds[0], &len);
    close(fds[0]);
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
    char stage = 0; /* the last stage the child reported */
    bool done = false;
    plugin_row row;
    bool have_row = false;
    char *options_text = NULL;
    while (buf && at < len && !done) {
        char tag = buf[at++];
        if (tag == 'L' || tag == 'I') {
            stage = tag;
        } else if (tag == 'E') {
            int32_t code;
            char *msg = take(buf, len, &at, &code, sizeof code) ? take_text(buf, len, &at) : NULL;
            if (msg) add_problem(l, "  %s", msg);
            free(msg);
            done = msg != NULL;
            stage = done ? 0 : stage;
        } else if (tag == 'R') {
            have_row = take(buf, len, &at, &row, sizeof row);
        } else if (tag == 'O') {
            at--;
            options_text = take_text(buf, len, &at);
        } else if (tag == 'D') {
            done = true;
        } else {
            break;
        }
    }
    free(buf);
    if (!done || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        char how[128];
        if (WIFSIGNALED(status) && WTERMSIG(status) == SIGALRM)
            snprintf(how, sizeof how, "did not finish within %d s", PROBE_SECONDS);
        else if (WIFSIGNALED(status))
            snprintf(how, sizeof how, "crashed (signal %d, %s)", WTERMSIG(status), strsignal(WTERMSIG(status)));
        else
            snprintf(how, sizeof how, "exited with status %d", WEXITSTATUS(status));
        add_problem(l, "  %s: %s while %s", path, how,
                    stage == 'I' ? "starting it with the default options (--options)" : "loading it");
    }
    if (have_row) {
        if (l->row_count == l->row_cap) {
            int cap = l->row_cap ? 2 * l->row_cap : 16;
            plugin_row *grown = realloc(l->rows, (size_t)cap * sizeof *grown);
            if (!grown) {
                free(options_text);
                return;
            }
            l->rows = grown;
            l->row_cap = cap;
        }
        plugin_row *r = &l->rows[l->row_count];
        *r = row;
        r->options_text = NULL;
        r->shadowed = seen_before(l, r->kind, r->name);
        if (l->options) {
            size_t size = 0;
            FILE *f = open_memstream(&r->options_text, &size);
            if (f) {
                fprintf(f, "%s %s (%s)%s\n", r->kind, r->name, r->path, r->shadowed ? " (shadowed)" : "");
                if (options_text) fputs(options_text, f);
                if (!done) fprintf(f, "  (the plugin did not finish starting: see \"files that did not load\")\n");
                fclose(f);
            }
        }
        l->row_count++;
    }
    free(options_text);
}

/* Width of the widest value of a column (and its title). */
#define COLUMN_WIDTH(l, field, title)                                                                                  \
    ({                                                                                                                 \
        int _w = (int)strlen(title);                                                                                   \
        for (int _i = 0; _i < (l)->row_count; _i++)                                                                    \
            if ((int)strlen((l)->rows[_i].field) > _w) _w = (int)strlen((l)->rows[_i].field);                          \
        _w;                                                                                                            \
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
    int seen = moert_plugin_list_files(probe_file, &l);
    print_table(&l);
    if (l.problems) printf("\nfiles that did not load or start:\n%s", l.problems);
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
