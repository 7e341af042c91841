/* SPDX-License-Identifier: Apache-2.0 */
/* `moert ab --plot`: writes the figure's data (both sides' step times and losses, the warm-up, what B changes) as
 * JSON beside the PNG and runs tools/ab_plot.py on it with python3 and matplotlib, which draw it far better than a
 * hand-written encoder could. The data stays, so the figure can be redrawn or restyled without running again. */
#include "ab_plot.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdbool.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <jansson.h>

#include "output.h"

extern char **environ;

void moert_ab_plot_data_path(const char *png_path, char *out, size_t size)
{
    size_t len = strlen(png_path);
    if (len > 4 && !strcmp(png_path + len - 4, ".png"))
        snprintf(out, size, "%.*s.plot.json", (int)(len - 4), png_path);
    else
        snprintf(out, size, "%s.plot.json", png_path);
}

/* A JSON array of n values; a value that is not finite becomes null (JSON has no NaN). */
static json_t *series(const double *v, int64_t n)
{
    json_t *a = json_array();
    for (int64_t i = 0; i < n; i++) json_array_append_new(a, isfinite(v[i]) ? json_real(v[i]) : json_null());
    return a;
}

/* A ratio with its interval, for the distributions' panel: {"what": "B/A", "ratio", "ci_low", "ci_high", "level",
 * "pairs", "verdict"}; null numbers where there was no interval. */
static json_t *interval_json(const ab_interval *iv, const char *what)
{
    char text[160];
    ab_verdict_text(iv, text, sizeof text);
    json_t *o = json_object();
    json_object_set_new(o, "what", json_string(what));
    json_object_set_new(o, "ratio", isfinite(iv->ratio) ? json_real(iv->ratio) : json_null());
    json_object_set_new(o, "ci_low", isfinite(iv->low) ? json_real(iv->low) : json_null());
    json_object_set_new(o, "ci_high", isfinite(iv->high) ? json_real(iv->high) : json_null());
    json_object_set_new(o, "level", json_real(iv->level));
    json_object_set_new(o, "pairs", json_integer(iv->pairs));
    json_object_set_new(o, "verdict", json_string(text));
    return o;
}

static int dump_plot_data(FILE *f, void *root) { return json_dumpf(root, f, JSON_INDENT(1) | JSON_REAL_PRECISION(9)); }

/* Writes the data file (atomically, as every output). Returns 0, or -1 with err set. */
static int write_data(const char *data_path, const moert_ab_plot_data *d, char *err, size_t err_size)
{
    json_t *root = json_object(), *sides = json_array(), *differs = json_array();
    json_object_set_new(root, "format", json_string("moert ab plot data")); /* first: MOERT_AB_PLOT_DATA_MARKER */
    char title[2600] = "moert ab";
    for (int i = 0; i < d->header_count && d->header; i++) {
        const char *line = d->header[i];
        if (!strncmp(line, "differs: ", 9)) json_array_append_new(differs, json_string(line + 9));
    }
    if (d->header && d->header_count > 1)
        snprintf(title, sizeof title, "%s\n%s", d->header[0], d->header[1]);
    else if (d->header && d->header_count == 1)
        snprintf(title, sizeof title, "%s", d->header[0]);
    static const char *const tags[3] = {"A", "B", "A'"};
    const int nsides = d->nsides == 3 ? 3 : 2;
    for (int s = 0; s < nsides; s++) {
        char label[300];
        snprintf(label, sizeof label, "%s: %s", tags[s], d->label[s] ? d->label[s] : "");
        json_t *side = json_object();
        json_object_set_new(side, "label", json_string(label));
        json_object_set_new(side, "step_ms", series(d->step_ms[s], d->n));
        json_object_set_new(side, "loss", series(d->loss[s], d->n));
        json_array_append_new(sides, side);
    }
    json_object_set_new(root, "title", json_string(title));
    json_object_set_new(root, "differs", differs);
    json_object_set_new(root, "warmup", json_integer(d->warmup));
    json_object_set_new(root, "sides", sides);
    if (d->step_ratio) json_object_set_new(root, "step_ratio", interval_json(d->step_ratio, "B/A"));
    if (d->step_noise) json_object_set_new(root, "step_noise", interval_json(d->step_noise, "A'/A"));
    moert_result rc = moert_output_write(data_path, dump_plot_data, root);
    json_decref(root);
    if (rc != MOERT_OK) {
        snprintf(err, err_size, "the plot's data: %s", moert_last_error());
        return -1;
    }
    return 0;
}

/* The script: beside the running binary (a build tree, where meson copies it into tools/), else where an installed
 * moert's script is (<bindir>/../share/moert). Returns 0 with out set, or -1 with err naming both places. */
static int find_script(char *out, size_t size, char *err, size_t err_size)
{
    char exe[PATH_MAX], beside[PATH_MAX + 32] = "?", installed[PATH_MAX + 32] = "?";
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    char *slash = n > 0 ? (exe[n] = '\0', strrchr(exe, '/')) : NULL;
    if (slash) {
        *slash = '\0';
        snprintf(beside, sizeof beside, "%s/ab_plot.py", exe);
        snprintf(installed, sizeof installed, "%s/../share/moert/ab_plot.py", exe);
        const char *candidates[] = {beside, installed};
        for (int i = 0; i < 2; i++) {
            char resolved[PATH_MAX];
            if (access(candidates[i], R_OK) != 0 || !realpath(candidates[i], resolved)) continue;
            snprintf(out, size, "%s", resolved);
            return 0;
        }
    }
    snprintf(err, err_size, "--plot: the drawing script ab_plot.py is neither beside moert (%s) nor installed (%s)",
             beside, installed);
    return -1;
}

/* Runs argv[0] with argv, stderr to /dev/null when quiet. Returns the exit status, -1 where the program was not found
 * (ENOENT), -2 on another failure (err set). */
static int run(char *const argv[], bool quiet, char *err, size_t err_size)
{
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    if (quiet) posix_spawn_file_actions_addopen(&actions, 2, "/dev/null", O_WRONLY, 0);
    pid_t pid;
    int rc = posix_spawnp(&pid, argv[0], &actions, NULL, argv, environ);
    posix_spawn_file_actions_destroy(&actions);
    if (rc == ENOENT) return -1;
    if (rc != 0) {
        snprintf(err, err_size, "--plot: cannot start %s: %s", argv[0], strerror(rc));
        return -2;
    }
    int status = 0;
    while (waitpid(pid, &status, 0) < 0)
        if (errno != EINTR) {
            snprintf(err, err_size, "--plot: waiting for %s: %s", argv[0], strerror(errno));
            return -2;
        }
    if (WIFEXITED(status)) return WEXITSTATUS(status);
    snprintf(err, err_size, "--plot: %s ended by signal %d", argv[0], WTERMSIG(status));
    return -2;
}

int moert_ab_plot_png(const char *path, const moert_ab_plot_data *data, char *err, size_t err_size)
{
    char data_path[PATH_MAX + 16], script[PATH_MAX + 16];
    moert_ab_plot_data_path(path, data_path, sizeof data_path);
    if (write_data(data_path, data, err, err_size) != 0) return -1;
    if (find_script(script, sizeof script, err, err_size) != 0) return -1;
    /* the first python3 that imports matplotlib: the one on PATH, else the system's (a virtualenv or pyenv in front
     * of a system that has the python3-matplotlib package) */
    static const char *const pythons[] = {"python3", "/usr/bin/python3"};
    bool found = false;
    for (size_t i = 0; i < sizeof pythons / sizeof pythons[0]; i++) {
        char *probe[] = {(char *)pythons[i], "-c", "import matplotlib", NULL};
        int rc = run(probe, true, err, err_size);
        if (rc == -2) return -1;
        if (rc == -1) continue; /* no such interpreter */
        found = true;
        if (rc != 0) continue; /* no matplotlib there */
        char *argv[] = {(char *)pythons[i], script, data_path, (char *)path, NULL};
        rc = run(argv, false, err, err_size);
        if (rc == 0) return 0;
        if (rc > 0)
            snprintf(err, err_size, "--plot: %s %s failed (exit status %d); the data is in %s", pythons[i], script, rc,
                     data_path);
        return -1;
    }
    if (!found)
        snprintf(err, err_size,
                 "--plot needs python3 with matplotlib, and no python3 was found (PATH, /usr/bin); the "
                 "data is in %s",
                 data_path);
    else
        snprintf(err, err_size,
                 "--plot needs the Python module matplotlib (Debian/Ubuntu: apt-get install python3-matplotlib); "
                 "the data is in %s: draw it later with python3 %s %s %s",
                 data_path, script, data_path, path);
    return -1;
}
