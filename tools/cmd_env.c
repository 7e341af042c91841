/* SPDX-License-Identifier: Apache-2.0 */
/* `moert env`: the environment variables moert reads (moert_env_table_entry), their values here and defaults, and
 * any MOERT_* variable set here that moert does not read (a retired knob says what replaced it). */
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli_common.h"

extern char **environ;

static void env_usage(FILE *f)
{
    fprintf(f, "usage: moert env\n"
               "  Lists the environment variables moert reads, with their value in this environment (or that they are\n"
               "  unset and what holds then), their type and what they do; then the variables of launchers and NCCL\n"
               "  that moert reads, and the MOERT_* variables set here that it does not read. Everything else that\n"
               "  changes how moert runs is a config key or a plugin option ('moert plugins --options').\n");
}

/* Whether name (of length len, from environ) is one of the table's. */
static int is_registered(const char *name, size_t len)
{
    const int count = moert_env_table_size(MOERT_ENV_TABLE_READ);
    for (int i = 0; i < count; i++) {
        moert_env_entry var;
        if (moert_env_table_entry(MOERT_ENV_TABLE_READ, i, &var) != MOERT_OK) continue;
        if (strlen(var.name) == len && strncmp(var.name, name, len) == 0) return 1;
    }
    return 0;
}

/* What replaced a retired variable, or NULL when name is not one. */
static const char *retired_instead(const char *name)
{
    const int count = moert_env_table_size(MOERT_ENV_TABLE_RETIRED);
    for (int i = 0; i < count; i++) {
        moert_env_entry var;
        if (moert_env_table_entry(MOERT_ENV_TABLE_RETIRED, i, &var) == MOERT_OK && strcmp(var.name, name) == 0)
            return var.help;
    }
    return NULL;
}

/* Whether value reads as the table's type says, where the type is one the table uses for checkable values: a choice
 * ("error|warn|info|debug") or a range ("integer 1..65535"); any other type (a list of folders) takes any value. */
static bool value_fits(const char *type, const char *value)
{
    long long low = 0, high = 0;
    if (sscanf(type, "integer %lld..%lld", &low, &high) == 2) {
        char *end = NULL;
        errno = 0;
        const long long v = strtoll(value, &end, 10);
        return end != value && *end == '\0' && errno == 0 && v >= low && v <= high;
    }
    if (strchr(type, ' ') || !strchr(type, '|')) return true;
    const size_t n = strlen(value);
    for (const char *c = type; *c;) {
        const char *bar = strchr(c, '|');
        const size_t len = bar ? (size_t)(bar - c) : strlen(c);
        if (len == n && strncmp(c, value, n) == 0) return true;
        c += len + (bar ? 1 : 0);
    }
    return false;
}

int moert_cmd_env(int argc, char **argv)
{
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            env_usage(stdout);
            return 0;
        }
        fprintf(stderr, "moert env: unknown argument \"%s\"\n", argv[i]);
        env_usage(stderr);
        return 2;
    }
    int count = moert_env_table_size(MOERT_ENV_TABLE_READ);
    printf("moert reads:\n");
    for (int i = 0; i < count; i++) {
        moert_env_entry var;
        if (moert_env_table_entry(MOERT_ENV_TABLE_READ, i, &var) != MOERT_OK) continue;
        const char *value = getenv(var.name);
        char shown[512];
        if (value)
            snprintf(shown, sizeof shown, "=%s%s", value,
                     value_fits(var.type, value) ? "" : "   (not a valid value: see the type below)");
        else
            snprintf(shown, sizeof shown, " unset (default: %s)", var.default_text);
        printf("  %s%s\n      %s; %s\n", var.name, shown, var.type, var.help);
    }
    count = moert_env_table_size(MOERT_ENV_TABLE_FOREIGN);
    printf("and, from launchers and NCCL:\n");
    for (int i = 0; i < count; i++) {
        moert_env_entry var;
        if (moert_env_table_entry(MOERT_ENV_TABLE_FOREIGN, i, &var) != MOERT_OK) continue;
        const char *value = getenv(var.name);
        printf("  %s%s%s\n      %s\n", var.name, value ? "=" : " unset", value ? value : "", var.help);
    }
    int unread = 0;
    for (char **e = environ; e && *e; e++) {
        if (strncmp(*e, "MOERT_", 6) != 0) continue;
        const char *eq = strchr(*e, '=');
        const size_t len = eq ? (size_t)(eq - *e) : strlen(*e);
        if (is_registered(*e, len)) continue;
        char name[256];
        snprintf(name, sizeof name, "%.*s", (int)(len < sizeof name ? len : sizeof name - 1), *e);
        if (!unread++) printf("set here, not read by moert:\n");
        const char *instead = retired_instead(name);
        if (instead)
            printf("  %s: no longer read; use %s\n", name, instead);
        else
            printf("  %s\n", name);
    }
    return 0;
}
