/* SPDX-License-Identifier: Apache-2.0 */
/* `moert check CONFIG [--set KEY=VALUE]...`: loads the config, every plugin it names, and checks all options. */
#include <stdio.h>
#include <string.h>

#include "cli_common.h"
#include "trainer.h"

static void check_usage(FILE *f)
{
    fprintf(f, "usage: moert check CONFIG [--set KEY=VALUE]...\n"
               "  Loads CONFIG, applies the overrides, loads the four plugins it names, and starts every layer on\n"
               "  every rank, so that each plugin reads (and the core checks) its options. Prints\n"
               "  \"CONFIG: ok (...)\" or the first error; the exit status is 1 on error.\n");
}

int moert_cmd_check(int argc, char **argv)
{
    const char *path = NULL;
    const char *sets[MOERT_CLI_MAX_SETS];
    int nsets = 0;
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            check_usage(stdout);
            return 0;
        } else if (!strcmp(argv[i], "--set") && i + 1 < argc) {
            if (nsets == MOERT_CLI_MAX_SETS) {
                fprintf(stderr, "moert check: at most %d --set options\n", MOERT_CLI_MAX_SETS);
                return 2;
            }
            sets[nsets++] = argv[++i];
            if (!moert_cli_set_ok("moert check", sets[nsets - 1])) return 2;
        } else if (!strncmp(argv[i], "--set=", 6)) {
            if (nsets == MOERT_CLI_MAX_SETS) {
                fprintf(stderr, "moert check: at most %d --set options\n", MOERT_CLI_MAX_SETS);
                return 2;
            }
            sets[nsets++] = argv[i] + 6;
            if (!moert_cli_set_ok("moert check", sets[nsets - 1])) return 2;
        } else if (argv[i][0] == '-') {
            fprintf(stderr, "moert check: unknown or incomplete option \"%s\"\n", argv[i]);
            check_usage(stderr);
            return 2;
        } else if (!path) {
            path = argv[i];
        } else {
            fprintf(stderr, "moert check: one CONFIG expected, got \"%s\" too\n", argv[i]);
            return 2;
        }
    }
    if (!path) {
        check_usage(stderr);
        return 2;
    }
    moert_config *cfg = NULL;
    moert_runtime *rt = NULL;
    int status = 1;
    if (moert_cli_load_config("moert check", path, sets, nsets, &cfg) != MOERT_OK) goto exit;
    moert_result rc = moert_runtime_create(cfg, &rt);
    if (rc != MOERT_OK) {
        moert_cli_print_error("moert check", path, moert_last_error());
        status = moert_cli_failure_status(rc);
        goto exit;
    }
    static const char *const slots[4] = {"router", "dispatcher", "precision", "memory_policy"};
    char plugins[4][1600];
    int64_t layers = 0, ranks = 0;
    for (int s = 0; s < 4; s++) {
        char key[64];
        snprintf(key, sizeof key, "%s.plugin", slots[s]);
        if (moert_config_get_string(cfg, key, plugins[s], sizeof plugins[s]) != MOERT_OK) plugins[s][0] = '\0';
    }
    if (moert_config_get_int(cfg, "model.num_layers", &layers) != MOERT_OK ||
        moert_config_get_int(cfg, "parallel.ranks", &ranks) != MOERT_OK) {
        moert_cli_print_error("moert check", path, moert_last_error());
        goto exit;
    }
    printf("%s: ok (router %s, dispatcher %s, precision %s, memory_policy %s; layers %lld, ranks %lld)\n", path,
           plugins[0], plugins[1], plugins[2], plugins[3], (long long)layers, (long long)ranks);
    char line[768];
    moert_runtime_memory_line(rt, line, sizeof line);
    printf("memory (estimate, balanced routing): %s\n", line);
    status = 0;
exit:
    moert_runtime_destroy(rt);
    moert_config_free(cfg);
    return status;
}
