/* SPDX-License-Identifier: Apache-2.0 */
/* Loader: finds plugin .so files by name or path, dlopens them, and checks their vtable header. */
#include "loader.h"

#include <dirent.h>
#include <dlfcn.h>
#include <signal.h>
#include <stdatomic.h>
#include <stddef.h>
#include <glob.h>
#include <link.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "config.h"
#include "env.h"
#include "error.h"
#include "host.h"

#ifndef MOERT_INSTALL_PLUGIN_DIR
#define MOERT_INSTALL_PLUGIN_DIR "/usr/local/lib/moert/plugins"
#endif

/* Plugins stay mapped once loaded (RTLD_NODELETE): a plugin with CUDA kernels that is unloaded and loaded
 * again registers its kernels a second time with the CUDA runtime, which then launches stale handles (seen
 * on H100: a hang, or a crash in __cudaGetKernel). Unloading is cheap to give up; a second load is free. */
#define PLUGIN_DLOPEN_FLAGS (RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE)

/* A function member of a vtable the core calls without checking it: the loader refuses a NULL one, by name. */
typedef struct vtable_member {
    const char *name;
    size_t offset;
} vtable_member;

#define MEMBER(type, m)                                                                                                \
    {                                                                                                                  \
#m, offsetof(type, m)                                                                                          \
    }
#define MAX_MEMBERS 8

/* What the loader knows about each kind: names, the exported symbol, the size of its v1 vtable, the members that
 * must not be NULL (every function of the v1 vtable but the router's expert_bias, which may be absent). */
typedef struct kind_info {
    moert_plugin_kind kind;
    const char *name;      /* "dispatcher" */
    const char *file_part; /* "dispatch" */
    const char *symbol;    /* "moert_dispatcher_v1" (newest first once there are several versions) */
    size_t v1_size;
    vtable_member required[MAX_MEMBERS];
} kind_info;

static const kind_info kinds[] = {
    {MOERT_KIND_ROUTER,
     "router",
     "router",
     MOERT_ROUTER_V1_SYMBOL,
     MOERT_ROUTER_V1_BASE_SIZE,
     {MEMBER(moert_router_v1, init), MEMBER(moert_router_v1, finalize), MEMBER(moert_router_v1, forward),
      MEMBER(moert_router_v1, backward), MEMBER(moert_router_v1, end_step)}},
    {MOERT_KIND_DISPATCHER,
     "dispatcher",
     "dispatch",
     MOERT_DISPATCHER_V1_SYMBOL,
     sizeof(moert_dispatcher_v1),
     {MEMBER(moert_dispatcher_v1, init), MEMBER(moert_dispatcher_v1, finalize), MEMBER(moert_dispatcher_v1, prepare),
      MEMBER(moert_dispatcher_v1, dispatch), MEMBER(moert_dispatcher_v1, combine),
      MEMBER(moert_dispatcher_v1, combine_backward), MEMBER(moert_dispatcher_v1, dispatch_backward)}},
    /* precision: the size before agreement_rtol was appended (a plugin built against that header still loads) */
    {MOERT_KIND_PRECISION,
     "precision",
     "precision",
     MOERT_PRECISION_V1_SYMBOL,
     MOERT_PRECISION_V1_BASE_SIZE,
     {MEMBER(moert_precision_v1, init), MEMBER(moert_precision_v1, finalize), MEMBER(moert_precision_v1, grouped_gemm),
      MEMBER(moert_precision_v1, end_step)}},
    {MOERT_KIND_MEMORY_POLICY,
     "memory_policy",
     "memory",
     MOERT_MEMORY_POLICY_V1_SYMBOL,
     sizeof(moert_memory_policy_v1),
     {MEMBER(moert_memory_policy_v1, init), MEMBER(moert_memory_policy_v1, finalize),
      MEMBER(moert_memory_policy_v1, decide)}},
};
#define KIND_COUNT ((int)(sizeof kinds / sizeof kinds[0]))

static const kind_info *find_kind(moert_plugin_kind kind)
{
    for (int i = 0; i < KIND_COUNT; i++)
        if (kinds[i].kind == kind) return &kinds[i];
    return NULL;
}

const char *moert_kind_name(moert_plugin_kind kind)
{
    const kind_info *k = find_kind(kind);
    return k ? k->name : "unknown";
}

const char *moert_kind_file_part(moert_plugin_kind kind)
{
    const kind_info *k = find_kind(kind);
    return k ? k->file_part : "unknown";
}

/* ---- the search path ---- */

typedef struct dir_list {
    char **dirs;
    int count, cap;
} dir_list;

/* Adds dir (without a trailing '/') unless it is empty or already listed. */
static void dir_list_add(dir_list *l, const char *dir)
{
    size_t n = strlen(dir);
    while (n > 1 && dir[n - 1] == '/') n--;
    if (n == 0) return;
    for (int i = 0; i < l->count; i++)
        if (strlen(l->dirs[i]) == n && strncmp(l->dirs[i], dir, n) == 0) return;
    if (l->count == l->cap) {
        int cap = l->cap ? l->cap * 2 : 16;
        char **grown = realloc(l->dirs, (size_t)cap * sizeof *grown);
        if (!grown) return;
        l->dirs = grown;
        l->cap = cap;
    }
    char *copy = strndup(dir, n);
    if (copy) l->dirs[l->count++] = copy;
}

static void dir_list_free(dir_list *l)
{
    for (int i = 0; i < l->count; i++) free(l->dirs[i]);
    free(l->dirs);
    memset(l, 0, sizeof *l);
}

/* The absolute path of the file (executable or shared library) holding this function, never resolved against the
 * current directory: the main program's own name comes from /proc/self/exe (dladdr would give argv[0], which a
 * command started through PATH has without a folder); a library's from its link map, used only when absolute. */
static bool running_binary_path(char *out, size_t size)
{
    Dl_info info;
    struct link_map *map = NULL;
    char path[PATH_MAX];
    if (!dladdr1((void *)&running_binary_path, &info, (void **)&map, RTLD_DL_LINKMAP) || !map) return false;
    if (!map->l_name || !map->l_name[0]) { /* the main program */
        ssize_t n = readlink("/proc/self/exe", path, sizeof path - 1);
        if (n <= 0) return false;
        path[n] = '\0';
    } else if (map->l_name[0] == '/') {
        if (!realpath(map->l_name, path)) return false;
    } else {
        return false;
    }
    snprintf(out, size, "%s", path);
    return true;
}

/* The build tree the running code comes from: the parent of the folder holding the binary that contains this
 * function (tools/moert, tests/test_x or core/libmoert.so), when that parent has a build.ninja. An installed moert
 * therefore never looks into a build tree, whatever the current directory, and a build tree copied elsewhere still
 * works. */
static bool running_build_root(char *out, size_t size)
{
    char path[PATH_MAX];
    if (!running_binary_path(path, sizeof path)) return false;
    for (int up = 0; up < 2; up++) {
        char *slash = strrchr(path, '/');
        if (!slash || slash == path) return false;
        *slash = '\0';
    }
    char ninja[PATH_MAX + 16];
    snprintf(ninja, sizeof ninja, "%s/build.ninja", path);
    if (access(ninja, F_OK) != 0) return false;
    snprintf(out, size, "%s", path);
    return true;
}

/* When this code runs from libmoert.so (not linked into a program): the folder holding it, so that the plugins
 * installed beside it (<libdir>/moert/plugins) are found wherever the library was moved (a Python wheel, a relocated
 * prefix). */
static bool running_library_dir(char *out, size_t size)
{
    Dl_info info;
    struct link_map *map = NULL;
    char path[PATH_MAX];
    if (!dladdr1((void *)&running_library_dir, &info, (void **)&map, RTLD_DL_LINKMAP) || !map) return false;
    if (!map->l_name || map->l_name[0] != '/' || !realpath(map->l_name, path)) return false;
    char *slash = strrchr(path, '/');
    if (!slash || slash == path) return false;
    *slash = '\0';
    snprintf(out, size, "%s", path);
    return true;
}

/* MOERT_PLUGIN_PATH, then the build tree moert runs from (plugins/<each>/ and tests/fixtures/), then the folder
 * beside the libmoert.so in use, then the install dir. */
static void collect_search_dirs(dir_list *l)
{
    const char *env = moert_env_get(MOERT_ENV_PLUGIN_PATH);
    if (env && *env) {
        char *copy = strdup(env);
        char *save = NULL;
        for (char *dir = copy ? strtok_r(copy, ":", &save) : NULL; dir; dir = strtok_r(NULL, ":", &save))
            dir_list_add(l, dir);
        free(copy);
    }
    char root[PATH_MAX], pattern[PATH_MAX + 32];
    if (running_build_root(root, sizeof root)) {
        glob_t g;
        snprintf(pattern, sizeof pattern, "%s/plugins/*/", root);
        if (glob(pattern, GLOB_ONLYDIR, NULL, &g) == 0) {
            for (size_t i = 0; i < g.gl_pathc; i++) dir_list_add(l, g.gl_pathv[i]);
            globfree(&g);
        }
        /* the tests' deliberately broken plugins, for the tests' own binaries only: never in `moert plugins` */
        char binary[PATH_MAX], tests[PATH_MAX + 16];
        snprintf(tests, sizeof tests, "%s/tests/", root);
        if (running_binary_path(binary, sizeof binary) && strncmp(binary, tests, strlen(tests)) == 0) {
            snprintf(pattern, sizeof pattern, "%s/tests/fixtures", root);
            dir_list_add(l, pattern);
        }
    }
    if (running_library_dir(root, sizeof root)) {
        snprintf(pattern, sizeof pattern, "%s/moert/plugins", root);
        if (strcmp(pattern, MOERT_INSTALL_PLUGIN_DIR) != 0) dir_list_add(l, pattern);
    }
    dir_list_add(l, MOERT_INSTALL_PLUGIN_DIR);
}

/* The directories searched, ':'-joined. */
MOERT_API void moert_plugin_search_path(char *buf, size_t size)
{
    dir_list l = {0};
    collect_search_dirs(&l);
    if (size) buf[0] = '\0';
    for (int i = 0; i < l.count; i++) {
        size_t used = strlen(buf);
        if (used + 1 >= size) break;
        snprintf(buf + used, size - used, "%s%s", i ? ":" : "", l.dirs[i]);
    }
    dir_list_free(&l);
}

/* ---- loading and checking one file ---- */

/* Finds the vtable of kind in an open library; on failure explains what the file is instead. */
static moert_result find_vtable(void *dl, const kind_info *want, const char *where, const moert_plugin_header **out)
{
    *out = dlsym(dl, want->symbol);
    if (*out) return MOERT_OK;
    for (int i = 0; i < KIND_COUNT; i++) {
        if (&kinds[i] == want) continue;
        if (dlsym(dl, kinds[i].symbol))
            return moert_error(MOERT_ERR_ABI_MISMATCH, "%s is a %s plugin, expected a %s", where, kinds[i].name,
                               want->name);
    }
    return moert_error(MOERT_ERR_NOT_FOUND, "%s exports no %s symbol: not a %s plugin for ABI %d.x", where,
                       want->symbol, want->name, MOERT_ABI_MAJOR);
}

/* The init and finalize members, which every vtable has right after its header. */
typedef struct vtable_prefix {
    moert_plugin_header header;
    moert_result (*init)(void **ctx, const moert_host *host, const moert_layer_info *layer);
    void (*finalize)(void *ctx);
} vtable_prefix;

/* Checks ABI major, kind and size of a vtable header. */
static moert_result check_header(const moert_plugin_header *h, const kind_info *want, const char *where)
{
    uint32_t major = MOERT_ABI_VERSION_MAJOR(h->abi_version), minor = MOERT_ABI_VERSION_MINOR(h->abi_version);
    if (major != MOERT_ABI_MAJOR)
        return moert_error(MOERT_ERR_ABI_MISMATCH, "%s was built for ABI %u.%u, this moert supports ABI %d.x", where,
                           major, minor, MOERT_ABI_MAJOR);
    if (h->kind != (uint32_t)want->kind) {
        const kind_info *actual = find_kind((moert_plugin_kind)h->kind);
        if (actual)
            return moert_error(MOERT_ERR_ABI_MISMATCH, "%s is a %s plugin, expected a %s", where, actual->name,
                               want->name);
        return moert_error(MOERT_ERR_ABI_MISMATCH, "%s has unknown kind %u in its header, expected a %s (%d)", where,
                           h->kind, want->name, (int)want->kind);
    }
    if (h->struct_size < want->v1_size)
        return moert_error(MOERT_ERR_ABI_MISMATCH,
                           "%s has a %u-byte vtable, smaller than the %zu bytes of %s (ABI %d.%d)", where,
                           h->struct_size, want->v1_size, want->symbol, MOERT_ABI_MAJOR, MOERT_ABI_MINOR);
    if (!h->name || !h->name[0]) return moert_error(MOERT_ERR_ABI_MISMATCH, "%s has no name in its header", where);
    /* a NULL member would crash the first call to it, at a step, far from here */
    for (int i = 0; i < MAX_MEMBERS && want->required[i].name; i++) {
        void (*fn)(void);
        memcpy(&fn, (const char *)h + want->required[i].offset, sizeof fn);
        if (!fn) return moert_error(MOERT_ERR_ABI_MISMATCH, "%s has no %s function", where, want->required[i].name);
    }
    return MOERT_OK;
}

/* dlopens path and checks it as a plugin of kind; `label` names it in messages, followed by the path
 * unless the label shows it already. */
static moert_result open_checked(const kind_info *want, const char *label, const char *path, moert_plugin *out)
{
    moert_result rc;
    const moert_plugin_header *h = NULL;
    char where[3200];
    if (strstr(label, path))
        snprintf(where, sizeof where, "%s", label);
    else
        snprintf(where, sizeof where, "%s (%s)", label, path);
    void *dl = dlopen(path, PLUGIN_DLOPEN_FLAGS);
    if (!dl) {
        const char *why = dlerror();
        return moert_error(MOERT_ERR_NOT_FOUND, "cannot load %s: %s", where, why ? why : "dlopen failed");
    }
    MOERT_CHECK(find_vtable(dl, want, where, &h));
    MOERT_CHECK(check_header(h, want, where));
    memset(out, 0, sizeof *out);
    out->dl = dl;
    out->header = h;
    out->kind = want->kind;
    snprintf(out->path, sizeof out->path, "%s", path);
    return MOERT_OK;
fail:
    dlclose(dl);
    return rc;
}

/* Appends text to a message under construction, cutting what does not fit. */
static void append(char *buf, size_t size, const char *text)
{
    size_t used = strlen(buf);
    if (used + 1 >= size) return;
    snprintf(buf + used, size - used, "%s", text);
}

/* Loads a plugin by name (along the search path) or by path (a spec with '/'). */
/* The names of the plugins of one kind ("libmoert-<file_part>-<name>.so") along the search path, ", "-joined, each once:
 * what a misspelt name is told it could have been. */
static void known_names(const dir_list *dirs, const char *file_part, char *out, size_t size)
{
    char prefix[64];
    snprintf(prefix, sizeof prefix, "libmoert-%s-", file_part);
    size_t plen = strlen(prefix);
    out[0] = '\0';
    for (int i = 0; i < dirs->count; i++) {
        DIR *d = opendir(dirs->dirs[i]);
        if (!d) continue;
        for (struct dirent *e = readdir(d); e; e = readdir(d)) {
            size_t n = strlen(e->d_name);
            if (n <= plen + 3 || strncmp(e->d_name, prefix, plen) || strcmp(e->d_name + n - 3, ".so")) continue;
            char name[256];
            snprintf(name, sizeof name, "%.*s", (int)(n - plen - 3), e->d_name + plen);
            if (strstr(name, "fixture")) continue; /* the tests' deliberately broken plugins */
            char quoted[260];
            snprintf(quoted, sizeof quoted, "\"%s\"", name);
            if (strstr(out, quoted)) continue;
            if (out[0]) append(out, size, ", ");
            append(out, size, quoted);
        }
        closedir(d);
    }
}

moert_result moert_plugin_load(moert_plugin_kind kind, const char *spec, moert_plugin *out)
{
    const kind_info *want = find_kind(kind);
    memset(out, 0, sizeof *out);
    if (!want) return moert_error(MOERT_ERR_INVALID_ARGUMENT, "moert_plugin_load: unknown plugin kind %d", (int)kind);
    if (!spec || !spec[0])
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "no %s plugin named (empty name)", want->name);
    char label[1100];
    snprintf(label, sizeof label, "%s plugin \"%s\"", want->name, spec);

    if (strchr(spec, '/')) {
        if (access(spec, F_OK) != 0)
            return moert_error(MOERT_ERR_NOT_FOUND, "no %s plugin \"%s\": tried %s (no such file)", want->name, spec,
                               spec);
        return open_checked(want, label, spec, out);
    }

    char file[600];
    snprintf(file, sizeof file, "libmoert-%s-%s.so", want->file_part, spec);
    dir_list dirs = {0};
    collect_search_dirs(&dirs);
    /* every path tried, in order, as far as the error message holds them; past that they are counted, so a long
     * MOERT_PLUGIN_PATH never ends the message mid-path */
    char tried[10240] = "";
    int untold = 0;
    moert_result rc = MOERT_ERR_NOT_FOUND;
    bool found = false;
    for (int i = 0; i < dirs.count && !found; i++) {
        char path[2048], entry[2600];
        snprintf(path, sizeof path, "%s/%s", dirs.dirs[i], file);
        snprintf(entry, sizeof entry, "%s%s", tried[0] ? ", " : "", path);
        if (access(path, F_OK) == 0) {
            void *probe = dlopen(path, PLUGIN_DLOPEN_FLAGS);
            if (!probe) { /* a file that exists but does not load: say why, and go on searching */
                const char *why = dlerror();
                append(entry, sizeof entry, " (exists but failed to load: ");
                append(entry, sizeof entry, why ? why : "dlopen failed");
                append(entry, sizeof entry, ")");
            } else {
                dlclose(probe);
                found = true;
                rc = open_checked(want, label, path, out);
                break;
            }
        }
        if (untold == 0 && strlen(tried) + strlen(entry) + 64 < sizeof tried)
            append(tried, sizeof tried, entry);
        else
            untold++;
    }
    if (untold > 0) {
        char more[64];
        snprintf(more, sizeof more, " and %d more folder%s", untold, untold == 1 ? "" : "s");
        append(tried, sizeof tried, more);
    }
    char known[1024] = "";
    if (!found) known_names(&dirs, want->file_part, known, sizeof known);
    dir_list_free(&dirs);
    if (!found)
        return moert_error(MOERT_ERR_NOT_FOUND,
                           "no %s plugin \"%s\": tried %s (set MOERT_PLUGIN_PATH or give a path to the .so)%s%s%s%s",
                           want->name, spec, tried[0] ? tried : "no directories", known[0] ? "; " : "",
                           known[0] ? want->name : "", known[0] ? " plugins found: " : "", known);
    return rc;
}

void moert_plugin_unload(moert_plugin *p)
{
    if (!p) return;
    if (p->dl) dlclose(p->dl);
    memset(p, 0, sizeof *p);
}

/* ---- attributing a crash or an exit inside a plugin's init or finalize ---- */

/* The message printed if the plugin call running on this thread crashes or exits, built before the call (a signal
 * handler can only write it); empty outside plugin calls. */
static _Thread_local char current_call[1600];
static struct sigaction previous_action[NSIG];
static const int guarded_signals[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT};

static void exit_handler(void);
static atomic_bool guard_installed; /* moert_plugin_guard_crashes ran: plugin calls register exit_handler */

/* Notes the plugin call starting on this thread, for the crash and exit reports. */
static void call_begin(const moert_plugin *p, const char *call, const moert_host *host, const moert_layer_info *layer)
{
    /* With the guard on, each thread registers exit_handler at its first plugin call: exit handlers run once each,
     * last-registered first, on whichever exiting thread takes them, so rank threads calling exit() together each
     * run one, ahead of what libraries registered since start-up (the CUDA runtime's teardown, for one), and end
     * the process before anything is torn down under the others. */
    static _Thread_local bool exit_registered = false;
    if (atomic_load(&guard_installed) && !exit_registered) exit_registered = atexit(exit_handler) == 0;
    char where[64] = "";
    if (layer && host) snprintf(where, sizeof where, " (layer %d, rank %d)", (int)layer->layer_index, (int)host->rank);
    snprintf(current_call, sizeof current_call, "moert: %s plugin \"%s\" (%s) %%s in %s%s", moert_kind_name(p->kind),
             p->header->name, p->path, call, where);
}

static void call_end(void) { current_call[0] = '\0'; }

/* Set once the first crash or exit message is out: a thread that lost the race to write it waits for it before it
 * ends the process, or the process could end while the winner is still building its line. */
static atomic_bool message_written;

/* Writes the current call's message with `what` in place of its %s, in one write so that two threads crashing
 * together do not mix their lines, and only for the first crash or exit of the process (async-signal-safe). Returns
 * whether this thread wrote it. */
static bool write_call_message(const char *what)
{
    static atomic_flag reported = ATOMIC_FLAG_INIT;
    char line[sizeof current_call + 128];
    const char *m = current_call, *hole = strstr(m, "%s");
    if (!hole || atomic_flag_test_and_set(&reported)) return false;
    size_t n = 0, part = (size_t)(hole - m);
    memcpy(line + n, m, part);
    n += part;
    part = strlen(what);
    if (part > 120) part = 120;
    memcpy(line + n, what, part);
    n += part;
    part = strlen(hole + 2);
    memcpy(line + n, hole + 2, part);
    n += part;
    line[n++] = '\n';
    ssize_t ignored = write(2, line, n);
    (void)ignored;
    atomic_store(&message_written, true);
    return true;
}

/* Waits up to about a second for another thread's message to be written (async-signal-safe). */
static void wait_for_message(void)
{
    const struct timespec tick = {0, 1000000};
    for (int i = 0; i < 1000 && !atomic_load(&message_written); i++) nanosleep(&tick, NULL);
}

/* A fatal signal: name the plugin call it came from, then let the previous handler (or the default) take it. */
static void crash_handler(int sig)
{
    if (current_call[0]) {
        const char *what = sig == SIGSEGV  ? "crashed (SIGSEGV, invalid memory access)"
                           : sig == SIGBUS ? "crashed (SIGBUS)"
                           : sig == SIGILL ? "crashed (SIGILL)"
                           : sig == SIGFPE ? "crashed (SIGFPE, arithmetic error)"
                                           : "aborted the process (SIGABRT)";
        if (!write_call_message(what)) wait_for_message();
        current_call[0] = '\0';
    }
    /* the faulting instruction runs again, or abort() raises again, into the previous disposition */
    sigaction(sig, &previous_action[sig], NULL);
}

/* exit() called inside a plugin call: say which plugin, and make the status a failure. */
static void exit_handler(void)
{
    if (!current_call[0]) return;
    if (!write_call_message("called exit() (a plugin must return an error instead)")) wait_for_message();
    fflush(stdout);
    _exit(1);
}

MOERT_API void moert_plugin_guard_crashes(void)
{
    if (atomic_exchange(&guard_installed, true)) return;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = crash_handler;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_NODEFER;
    for (size_t i = 0; i < sizeof guarded_signals / sizeof guarded_signals[0]; i++)
        sigaction(guarded_signals[i], &sa, &previous_action[guarded_signals[i]]);
}

/* The layer a plugin instance is started for must have sizes inside the config's bounds (config.h), whoever built
 * it (the runtime from a config, or a caller of the embedding API): plugins size their buffers from these, and the
 * bounds keep every such product from wrapping. */
static moert_result check_layer_sizes(const moert_plugin *p, const moert_layer_info *l, int world)
{
    struct {
        const char *name;
        int64_t value, min, max;
    } sizes[] = {
        {"hidden", l->hidden, 1, MOERT_MAX_HIDDEN},
        {"ffn_hidden", l->ffn_hidden, 1, MOERT_MAX_FFN_HIDDEN},
        {"num_experts", l->num_experts, 1, MOERT_MAX_EXPERTS},
        {"topk", l->topk, 1, l->num_experts},
        {"num_local_experts", l->num_local_experts, 1, l->num_experts},
        {"max_tokens", l->max_tokens, 0, MOERT_MAX_TOKENS_PER_RANK},
    };
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
        if (sizes[i].value < sizes[i].min || sizes[i].value > sizes[i].max)
            return moert_error(MOERT_ERR_INVALID_ARGUMENT,
                               "%s plugin \"%s\": layer %d has %s %lld, expected %lld .. %lld",
                               moert_kind_name(p->kind), p->header->name, (int)l->layer_index, sizes[i].name,
                               (long long)sizes[i].value, (long long)sizes[i].min, (long long)sizes[i].max);
    /* the largest buffers: a rank's fc1 weights, and every routed row of the group arriving at one rank */
    int64_t fc1 = 0, rows = 0, row_bytes = 0;
    int64_t widest = 2 * l->ffn_hidden > l->hidden ? 2 * l->ffn_hidden : l->hidden;
    bool wraps = __builtin_mul_overflow(l->num_local_experts * l->hidden, 2 * l->ffn_hidden * 8, &fc1) ||
                 __builtin_mul_overflow((int64_t)(world > 0 ? world : 1) * l->max_tokens, l->topk, &rows) ||
                 __builtin_mul_overflow(rows, widest * 8, &row_bytes);
    if (wraps || fc1 > MOERT_MAX_BUFFER_BYTES || row_bytes > MOERT_MAX_BUFFER_BYTES)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT,
                           "%s plugin \"%s\": layer %d's buffers (fc1 weights, or world x max_tokens x topk rows) "
                           "would exceed %lld TiB",
                           moert_kind_name(p->kind), p->header->name, (int)l->layer_index,
                           (long long)(MOERT_MAX_BUFFER_BYTES >> 40));
    return MOERT_OK;
}

/* Calls the plugin's init; a failure comes back with the plugin's message, prefixed with its kind and name. */
moert_result moert_plugin_init(const moert_plugin *p, void **ctx, moert_host *host, const moert_layer_info *layer)
{
    *ctx = NULL;
    if (!p || !p->header) return moert_error(MOERT_ERR_INVALID_ARGUMENT, "moert_plugin_init: the plugin is not loaded");
    const vtable_prefix *v = (const vtable_prefix *)p->header;
    if (layer) {
        moert_result sized = check_layer_sizes(p, layer, host ? host->world_size : 1);
        if (sized != MOERT_OK) return sized;
    }
    moert_host_take_error(host); /* forget anything set before */
    call_begin(p, "init", host, layer);
    moert_result rc = v->init(ctx, host, layer);
    call_end();
    if (rc == MOERT_OK) return MOERT_OK;
    const char *msg = moert_host_take_error(host);
    *ctx = NULL;
    if (msg[0]) return moert_error(rc, "%s plugin \"%s\": %s", moert_kind_name(p->kind), p->header->name, msg);
    return moert_error(rc, "%s plugin \"%s\": init failed (%s) without a message", moert_kind_name(p->kind),
                       p->header->name, moert_result_name(rc));
}

void moert_plugin_finalize(const moert_plugin *p, void *ctx)
{
    if (!p || !p->header) return;
    const vtable_prefix *v = (const vtable_prefix *)p->header;
    call_begin(p, "finalize", NULL, NULL);
    v->finalize(ctx);
    call_end();
}

/* The kind a file name libmoert-<part>-<name>.so says it has, or 0. */
static moert_plugin_kind kind_from_file_name(const char *file)
{
    for (int i = 0; i < KIND_COUNT; i++) {
        char prefix[64];
        snprintf(prefix, sizeof prefix, "libmoert-%s-", kinds[i].file_part);
        if (strncmp(file, prefix, strlen(prefix)) == 0) return kinds[i].kind;
    }
    return (moert_plugin_kind)0;
}

/* Sorts file names so listings are stable. */
static int compare_names(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* Lists every libmoert-*.so along the search path (each directory once, names sorted), without loading it. */
MOERT_API int moert_plugin_list_files(moert_plugin_file_fn fn, void *user)
{
    dir_list dirs = {0};
    collect_search_dirs(&dirs);
    int seen = 0;
    for (int i = 0; i < dirs.count; i++) {
        DIR *d = opendir(dirs.dirs[i]);
        if (!d) continue;
        dir_list files = {0}; /* file names, sorted below */
        struct dirent *e;
        while ((e = readdir(d)) != NULL) {
            size_t n = strlen(e->d_name);
            if (strncmp(e->d_name, "libmoert-", 9) == 0 && n > 3 && strcmp(e->d_name + n - 3, ".so") == 0)
                dir_list_add(&files, e->d_name);
        }
        closedir(d);
        if (files.count > 1) qsort(files.dirs, (size_t)files.count, sizeof files.dirs[0], compare_names);
        for (int f = 0; f < files.count; f++) {
            char path[2048];
            snprintf(path, sizeof path, "%s/%s", dirs.dirs[i], files.dirs[f]);
            seen++;
            fn(user, path, kind_from_file_name(files.dirs[f]));
        }
        dir_list_free(&files);
    }
    dir_list_free(&dirs);
    return seen;
}

/* Opens one listed file as the kind its name says, labelled by its path. */
moert_result moert_plugin_open_file(moert_plugin_kind kind, const char *path, moert_plugin *out)
{
    memset(out, 0, sizeof *out);
    if (!find_kind(kind))
        return moert_error(MOERT_ERR_NOT_FOUND,
                           "%s: the name does not say a kind (libmoert-router|dispatch|"
                           "precision|memory-<name>.so)",
                           path);
    char label[2100];
    snprintf(label, sizeof label, "%s plugin %s", moert_kind_name(kind), path);
    return open_checked(find_kind(kind), label, path, out);
}

typedef struct scan_call {
    moert_plugin_visit_fn fn;
    void *user;
} scan_call;

/* One listed file: loaded, checked, handed to the visitor, unloaded. */
static void scan_one(void *user, const char *path, moert_plugin_kind kind)
{
    scan_call *c = user;
    moert_plugin p;
    moert_result rc = moert_plugin_open_file(kind, path, &p);
    if (rc == MOERT_OK) {
        c->fn(c->user, &p, path, rc, "");
        moert_plugin_unload(&p);
    } else {
        c->fn(c->user, NULL, path, rc, moert_error_message());
    }
}

/* Visits every libmoert-*.so along the search path (each directory once), loaded and checked in this process. */
int moert_plugin_scan(moert_plugin_visit_fn fn, void *user)
{
    scan_call c = {fn, user};
    return moert_plugin_list_files(scan_one, &c);
}

/* The size of moert_plugin_description before API version 6 (up to flags). */
#define DESCRIPTION_V5_SIZE offsetof(moert_plugin_description, agreement_rtol)

moert_result moert_plugin_description_of(const moert_plugin *p, moert_plugin_description *out)
{
    const size_t size = out->struct_size >= sizeof *out ? sizeof *out : DESCRIPTION_V5_SIZE;
    if (out->struct_size < DESCRIPTION_V5_SIZE)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "moert_plugin_describe: out->struct_size %u, expected %zu",
                           out->struct_size, sizeof *out);
    const moert_plugin_header *h = p->header;
    moert_plugin_description d;
    memset(&d, 0, sizeof d);
    d.struct_size = (uint32_t)size;
    d.kind = p->kind;
    d.kind_name = moert_kind_name(p->kind);
    snprintf(d.name, sizeof d.name, "%s", h->name);
    snprintf(d.version, sizeof d.version, "%s", h->version ? h->version : "");
    snprintf(d.description, sizeof d.description, "%s", h->description ? h->description : "");
    snprintf(d.path, sizeof d.path, "%s", p->path);
    d.devices = h->devices;
    d.dtypes = h->dtypes;
    d.flags = h->flags;
    const size_t rtol_end = offsetof(moert_precision_v1, agreement_rtol) + sizeof(double);
    if (h->kind == MOERT_KIND_PRECISION && h->struct_size >= rtol_end)
        d.agreement_rtol = ((const moert_precision_v1 *)h)->agreement_rtol;
    memcpy(out, &d, size);
    return MOERT_OK;
}

MOERT_API moert_result moert_plugin_describe(moert_plugin_kind kind, const char *path, moert_plugin_description *out)
{
    if (!path || !out) return moert_error(MOERT_ERR_INVALID_ARGUMENT, "moert_plugin_describe: path or out is NULL");
    if (out->struct_size < DESCRIPTION_V5_SIZE)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "moert_plugin_describe: out->struct_size %u, expected %zu",
                           out->struct_size, sizeof *out);
    moert_plugin p;
    moert_result rc = moert_plugin_open_file(kind, path, &p);
    if (rc != MOERT_OK) return rc;
    rc = moert_plugin_description_of(&p, out);
    /* the path as given */
    if (rc == MOERT_OK) snprintf(out->path, sizeof out->path, "%s", path);
    moert_plugin_unload(&p);
    return rc;
}

/* The config key of a kind's section, for the options' JSON paths. */
static const char *section_key_of(moert_plugin_kind kind)
{
    for (int s = 0; s < MOERT_SLOT_COUNT; s++)
        if (moert_slot_kind((moert_slot)s) == kind) return moert_slot_key((moert_slot)s);
    return "plugin";
}

MOERT_API moert_result moert_plugin_list_options(moert_plugin_kind kind, const char *path, moert_plugin_option_fn fn,
                                                 void *user)
{
    if (!path || !fn) return moert_error(MOERT_ERR_INVALID_ARGUMENT, "moert_plugin_list_options: path or fn is NULL");
    moert_plugin p;
    moert_result rc = moert_plugin_open_file(kind, path, &p);
    if (rc != MOERT_OK) return rc;
    char json_path[64], who[256];
    snprintf(json_path, sizeof json_path, "$.%s", section_key_of(p.kind));
    snprintf(who, sizeof who, "%s[%s] describe", moert_kind_name(p.kind), p.header->name);
    moert_section *sec = moert_section_create(NULL, json_path);
    moert_host *host = NULL;
    void *ctx = NULL;
    if (!sec) {
        moert_plugin_unload(&p);
        return moert_error(MOERT_ERR_OUT_OF_MEMORY, "moert_plugin_list_options: out of memory");
    }
    /* describe mode: every option the plugin reads is recorded with its type, default, range and help */
    moert_section_set_describe(sec, true);
    moert_host_setup setup = {
        .who = who, .options = sec, .comm = NULL, .rank = 0, .world_size = 1, .device = moert_cpu()};
    moert_layer_info layer = {.struct_size = sizeof layer,
                              .layer_index = 0,
                              .num_layers = 1,
                              .hidden = 64,
                              .ffn_hidden = 128,
                              .num_experts = 8,
                              .topk = 2,
                              .num_local_experts = 8,
                              .first_local_expert = 0,
                              .max_tokens = 256,
                              .dtype = MOERT_F32,
                              .device = moert_cpu()};
    rc = moert_host_create(&setup, &host);
    if (rc == MOERT_OK) rc = moert_plugin_init(&p, &ctx, host, &layer);
    char saved[2048] = "";
    if (rc != MOERT_OK) snprintf(saved, sizeof saved, "%s", moert_error_message());
    for (int i = 0; i < moert_section_option_count(sec); i++) {
        const moert_option_desc *d = moert_section_option(sec, i);
        moert_plugin_option option = {
            .key = d->key, .type = d->type, .default_text = d->def, .range = d->range, .help = d->help};
        fn(user, &option);
    }
    if (ctx) moert_plugin_finalize(&p, ctx);
    moert_host_free(host);
    moert_section_free(sec);
    moert_plugin_unload(&p);
    if (rc != MOERT_OK) moert_error(rc, "%s", saved);
    return rc;
}
