/* SPDX-License-Identifier: Apache-2.0 */
/* Shared by the `moert` subcommands: loading a config with --set overrides. */
#include "cli_common.h"

#include <string.h>

/* Prints "PROG: PATH: message", leaving out PATH where the message starts with it already. */
void moert_cli_print_error(const char *prog, const char *path, const char *message)
{
    if (path && strncmp(message, path, strlen(path)) != 0)
        fprintf(stderr, "%s: %s: %s\n", prog, path, message);
    else
        fprintf(stderr, "%s: %s\n", prog, message);
}

/* Splits one "KEY=VALUE" override into key (a buffer of MOERT_CLI_MAX_KEY) and *value; prints why not. */
static moert_result split_set(const char *prog, const char *assignment, char *key, const char **value)
{
    const char *eq = strchr(assignment, '=');
    if (!eq || eq == assignment) {
        fprintf(stderr, "%s: --set expects KEY=VALUE (e.g. train.steps=10), got \"%s\"\n", prog, assignment);
        return MOERT_ERR_INVALID_ARGUMENT;
    }
    if ((size_t)(eq - assignment) >= MOERT_CLI_MAX_KEY) {
        fprintf(stderr, "%s: --set %s: the key is too long\n", prog, assignment);
        return MOERT_ERR_INVALID_ARGUMENT;
    }
    memcpy(key, assignment, (size_t)(eq - assignment));
    key[eq - assignment] = '\0';
    *value = eq + 1;
    return MOERT_OK;
}

bool moert_cli_set_ok(const char *prog, const char *assignment)
{
    char key[MOERT_CLI_MAX_KEY];
    const char *value = NULL;
    return split_set(prog, assignment, key, &value) == MOERT_OK;
}

/* Applies the overrides in order, each checked as it comes (so that a bad one is named); where one is refused as a
 * config error, it and those after it are tried together, for keys that must change together (--set
 * parallel.ranks=8 --set parallel.expert_parallel=8), and the first refusal is reported if that fails too. */
static moert_result apply_sets(const char *prog, moert_config *cfg, const char *const *sets, int nsets)
{
    char keys[MOERT_CLI_MAX_SETS][MOERT_CLI_MAX_KEY];
    const char *key_ptrs[MOERT_CLI_MAX_SETS], *values[MOERT_CLI_MAX_SETS];
    if (nsets > MOERT_CLI_MAX_SETS) {
        fprintf(stderr, "%s: at most %d --set options\n", prog, MOERT_CLI_MAX_SETS);
        return MOERT_ERR_INVALID_ARGUMENT;
    }
    for (int i = 0; i < nsets; i++) {
        moert_result rc = split_set(prog, sets[i], keys[i], &values[i]);
        if (rc != MOERT_OK) return rc;
        key_ptrs[i] = keys[i];
    }
    for (int i = 0; i < nsets; i++) {
        moert_result rc = moert_config_set(cfg, key_ptrs[i], values[i]);
        if (rc == MOERT_OK) continue;
        char first[MOERT_ERROR_MAX];
        snprintf(first, sizeof first, "%s", moert_last_error());
        if (rc == MOERT_ERR_CONFIG && i + 1 < nsets &&
            moert_config_set_many(cfg, nsets - i, key_ptrs + i, values + i) == MOERT_OK)
            return MOERT_OK;
        fprintf(stderr, "%s: --set %s: %s\n", prog, sets[i], first);
        return rc;
    }
    return MOERT_OK;
}

/* Loads a config file and applies the overrides in order. */
moert_result moert_cli_load_config(const char *prog, const char *path, const char *const *sets, int nsets,
                                   moert_config **out)
{
    moert_config *cfg = NULL;
    *out = NULL;
    moert_result rc = moert_config_load_file(path, &cfg);
    if (rc != MOERT_OK) {
        moert_cli_print_error(prog, path, moert_last_error());
        return rc;
    }
    rc = apply_sets(prog, cfg, sets, nsets);
    if (rc != MOERT_OK) {
        moert_config_free(cfg);
        return rc;
    }
    *out = cfg;
    return MOERT_OK;
}

/* 3 for a stalled rank, so that scripts and schedulers can tell a hang from an error. */
int moert_cli_failure_status(moert_result rc) { return rc == MOERT_ERR_TIMEOUT ? MOERT_CLI_EXIT_STALLED : 1; }
