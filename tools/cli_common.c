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

/* Applies one "KEY=VALUE" override to cfg. */
moert_result moert_cli_apply_set(const char *prog, moert_config *cfg, const char *assignment)
{
    const char *eq = strchr(assignment, '=');
    if (!eq || eq == assignment) {
        fprintf(stderr, "%s: --set expects KEY=VALUE (e.g. train.steps=10), got \"%s\"\n", prog, assignment);
        return MOERT_ERR_INVALID_ARGUMENT;
    }
    char key[256];
    if ((size_t)(eq - assignment) >= sizeof key) {
        fprintf(stderr, "%s: --set %s: the key is too long\n", prog, assignment);
        return MOERT_ERR_INVALID_ARGUMENT;
    }
    memcpy(key, assignment, (size_t)(eq - assignment));
    key[eq - assignment] = '\0';
    moert_result rc = moert_config_set(cfg, key, eq + 1);
    if (rc != MOERT_OK) fprintf(stderr, "%s: --set %s: %s\n", prog, assignment, moert_last_error());
    return rc;
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
    for (int i = 0; i < nsets; i++) {
        rc = moert_cli_apply_set(prog, cfg, sets[i]);
        if (rc != MOERT_OK) {
            moert_config_free(cfg);
            return rc;
        }
    }
    *out = cfg;
    return MOERT_OK;
}

/* 3 for a stalled rank, so that scripts and schedulers can tell a hang from an error. */
int moert_cli_failure_status(moert_result rc) { return rc == MOERT_ERR_TIMEOUT ? MOERT_CLI_EXIT_STALLED : 1; }
