/* SPDX-License-Identifier: Apache-2.0 */
/* The `moert` command: run, check, plugins, ab and config subcommands. */
#include <stdio.h>
#include <string.h>

#include "cli_common.h"

static void usage(FILE *f)
{
    fprintf(f, "usage: moert COMMAND [ARGS]\n"
               "commands:\n"
               "  run CONFIG [--set KEY=VALUE]...     train the MoE layer stack CONFIG describes\n"
               "  check CONFIG [--set KEY=VALUE]...   load CONFIG and every plugin it names, check all options\n"
               "  plugins [--options]                 list the plugins found (and each plugin's options)\n"
               "  env                                 the environment variables moert reads, and their values here\n"
               "  ab CONFIG_A CONFIG_B [...]          compare two configs\n"
               "  config --from-megatron FLAGS...     a config from Megatron-LM's MoE flags, on stdout\n"
               "options:\n"
               "  --help, -h       this text ('moert COMMAND --help' for a command's own)\n"
               "  --version        the version of moert and of its plugin ABI\n"
               "exit status:\n"
               "  0 done, 1 the work failed, 2 a usage error, 3 a rank stalled ($.parallel.timeout_s)\n"
               "environment:\n"
               "  MOERT_PLUGIN_PATH   ':'-separated directories searched for plugins before the built-in ones\n"
               "  MOERT_LOG           error, warn (default), info or debug\n");
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    const char *command = argv[1];
    /* a plugin whose init crashes or exits is named on stderr before the process goes */
    moert_plugin_guard_crashes();
    if (!strcmp(command, "--help") || !strcmp(command, "-h") || !strcmp(command, "help")) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(command, "--version") || !strcmp(command, "-V")) {
        printf("moert %s (plugin ABI %d.%d)\n", moert_version(), MOERT_ABI_MAJOR, MOERT_ABI_MINOR);
        return 0;
    }
    if (!strcmp(command, "run")) return moert_cmd_run(argc - 2, argv + 2);
    if (!strcmp(command, "check")) return moert_cmd_check(argc - 2, argv + 2);
    if (!strcmp(command, "plugins")) return moert_cmd_plugins(argc - 2, argv + 2);
    if (!strcmp(command, "env")) return moert_cmd_env(argc - 2, argv + 2);
    if (!strcmp(command, "ab")) return moert_cmd_ab(argc - 2, argv + 2);
    if (!strcmp(command, "config")) return moert_cmd_config(argc - 2, argv + 2);
    fprintf(stderr, "moert: unknown command \"%s\"\n", command);
    usage(stderr);
    return 2;
}
