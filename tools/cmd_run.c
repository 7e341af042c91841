/* SPDX-License-Identifier: Apache-2.0 */
/* `moert run CONFIG`: trains the configured MoE layer stack and prints a line per step. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli_common.h"
#include "moert/moert.h"
#include "output.h"
#include "trainer.h"

static void run_usage(FILE *f)
{
    fprintf(f, "usage: moert run CONFIG [options]\n"
               "  Trains the MoE layer stack CONFIG describes on its synthetic task (regression onto a fixed\n"
               "  random teacher), on the CPU with ranks as threads, or on the GPUs when the config asks.\n"
               "options:\n"
               "  --steps N         override train.steps\n"
               "  --set KEY=JSON    override any config value, e.g. --set model.num_layers=4 (repeatable)\n"
               "  --report FILE     write every figure of the run as JSON\n"
               "  --trace FILE      write a Chrome trace (Perfetto, chrome://tracing) of every rank's stage\n"
               "                    spans on its streams, and the host's time issuing them, over the run (a\n"
               "                    process per GPU: rank N > 0 writes FILE.rankN)\n"
               "  --trace-kernels   with --trace, every CUDA kernel too, on a row per CUDA stream (CUPTI,\n"
               "                    opened at run time; GPU runs)\n"
               "  --quiet           no progress lines\n");
}

int moert_cmd_run(int argc, char **argv)
{
    const char *config_path = NULL, *report_path = NULL, *trace_path = NULL;
    long long steps = 0;
    int quiet = 0, status = 1;
    bool trace_kernels = false;
    const char *sets[MOERT_CLI_MAX_SETS];
    int nsets = 0;
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            run_usage(stdout);
            return 0;
        } else if (!strcmp(argv[i], "--steps") && i + 1 < argc) {
            char *end = NULL;
            errno = 0;
            steps = strtoll(argv[++i], &end, 10);
            if (!end || end == argv[i] || *end || errno == ERANGE || steps <= 0 || steps > MOERT_CLI_MAX_STEPS) {
                fprintf(stderr, "moert run: --steps expects an integer from 1 to %d, got \"%s\"\n", MOERT_CLI_MAX_STEPS,
                        argv[i]);
                return 2;
            }
        } else if (!strcmp(argv[i], "--report") && i + 1 < argc) {
            report_path = argv[++i];
        } else if (!strcmp(argv[i], "--trace") && i + 1 < argc) {
            trace_path = argv[++i];
        } else if (!strcmp(argv[i], "--trace-kernels")) {
            trace_kernels = true;
        } else if (!strcmp(argv[i], "--set") && i + 1 < argc) {
            if (nsets == MOERT_CLI_MAX_SETS) {
                fprintf(stderr, "moert run: at most %d --set options\n", MOERT_CLI_MAX_SETS);
                return 2;
            }
            sets[nsets++] = argv[++i];
            if (!moert_cli_set_ok("moert run", sets[nsets - 1])) return 2;
        } else if (!strcmp(argv[i], "--quiet")) {
            quiet = 1;
        } else if (argv[i][0] == '-') {
            fprintf(stderr, "moert run: unknown or incomplete option \"%s\"\n", argv[i]);
            run_usage(stderr);
            return 2;
        } else if (!config_path) {
            config_path = argv[i];
        } else {
            fprintf(stderr, "moert run: one CONFIG expected, got \"%s\" too\n", argv[i]);
            return 2;
        }
    }
    if (!config_path) {
        run_usage(stderr);
        return 2;
    }
    if (trace_kernels && !trace_path) {
        fprintf(stderr, "moert run: --trace-kernels adds CUDA kernels to a trace: it needs --trace FILE\n");
        return 2;
    }

    moert_config *cfg = NULL;
    moert_runtime *rt = NULL;
    /* the report's path is checked before anything runs: never the config, never a link, a writable folder */
    if ((report_path && moert_output_check("--report", report_path, &config_path, 1) != MOERT_OK) ||
        (trace_path && moert_output_check("--trace", trace_path, &config_path, 1) != MOERT_OK)) {
        fprintf(stderr, "moert run: %s\n", moert_last_error());
        goto exit;
    }
    if (report_path && trace_path && moert_output_same_file(report_path, trace_path)) {
        fprintf(stderr, "moert run: --report and --trace name the same file \"%s\"\n", trace_path);
        goto exit;
    }
    if (moert_cli_load_config("moert run", config_path, sets, nsets, &cfg) != MOERT_OK) goto exit;
    moert_result rc = moert_runtime_create(cfg, &rt);
    if (rc != MOERT_OK) {
        fprintf(stderr, "moert run: %s\n", moert_last_error());
        status = moert_cli_failure_status(rc);
        goto exit;
    }
    /* a process per GPU: rank 0's process prints and writes the report */
    int root = moert_runtime_rank(rt) == 0;
    moert_train_options opts = {.struct_size = sizeof opts,
                                .progress = quiet || !root ? NULL : stdout,
                                .steps = steps,
                                .trace_path = trace_path,
                                .trace_kernels = trace_kernels};
    rc = moert_runtime_train(rt, &opts);
    if (rc != MOERT_OK) {
        fprintf(stderr, "moert run: %s\n", moert_last_error());
        status = moert_cli_failure_status(rc);
        goto exit;
    }
    if (report_path && root) {
        if (moert_runtime_write_report(rt, report_path) != MOERT_OK) {
            fprintf(stderr, "moert run: %s\n", moert_last_error());
            goto exit;
        }
        if (!quiet) printf("report written to %s\n", report_path);
    }
    if (trace_path && root && !quiet) printf("trace written to %s (open it in https://ui.perfetto.dev)\n", trace_path);
    status = 0;
exit:
    moert_runtime_destroy(rt);
    moert_config_free(cfg);
    return status;
}
