/* SPDX-License-Identifier: Apache-2.0 */
/* Shared by the `moert` subcommands: loading a config with --set overrides, and the subcommand entry points. */
#ifndef MOERT_CLI_COMMON_H
#define MOERT_CLI_COMMON_H

#include <stdbool.h>
#include <stdio.h>

#include "moert/moert.h"

/* The most --set options one command line takes. */
#define MOERT_CLI_MAX_SETS 64
#define MOERT_CLI_MAX_KEY  256 /* the longest KEY of a --set KEY=VALUE */
/* The most --steps (and --warmup) a command takes: $.train.steps' bound (core/src/config.h, MOERT_MAX_STEPS); the
 * trainer keeps a record for every step. */
#define MOERT_CLI_MAX_STEPS 100000000

/* Loads path, then applies each "KEY=VALUE" of sets in order (VALUE is JSON; text that is not JSON is taken
 * as a string). On error prints "PROG: message" to stderr and returns the code; *out is NULL then. */
moert_result moert_cli_load_config(const char *prog, const char *path, const char *const *sets, int nsets,
                                   moert_config **out);

/* Whether assignment is a well-formed "KEY=VALUE" (checked while the command line is read, so that a malformed one is
 * a usage error, exit status 2); prints why not. */
bool moert_cli_set_ok(const char *prog, const char *assignment);

/* Prints "PROG: PATH: message" to stderr, leaving out PATH where the message starts with it (JSON syntax errors). */
void moert_cli_print_error(const char *prog, const char *path, const char *message);

/* The exit status of a command whose work failed with rc: MOERT_CLI_EXIT_STALLED when a rank stalled (a collective
 * timed out, $.parallel.timeout_s), else 1. */
#define MOERT_CLI_EXIT_STALLED 3
int moert_cli_failure_status(moert_result rc);

/* Subcommands: argv holds the arguments after the subcommand's name; each returns the exit status
 * (0 ok, 1 the work failed, 2 a usage error, 3 a rank stalled). */
int moert_cmd_run(int argc, char **argv);     /* tools/cmd_run.c */
int moert_cmd_ab(int argc, char **argv);      /* tools/cmd_ab.c */
int moert_cmd_env(int argc, char **argv);     /* tools/cmd_env.c */
int moert_cmd_check(int argc, char **argv);   /* tools/cmd_check.c */
int moert_cmd_plugins(int argc, char **argv); /* tools/cmd_plugins.c */
int moert_cmd_config(int argc, char **argv);  /* tools/cmd_config.c */

#endif
