/* SPDX-License-Identifier: Apache-2.0 */
/* moert: a runtime for Mixture-of-Experts layers whose parts are plugins. The one header users include. */
#ifndef MOERT_H
#define MOERT_H

#include <stdio.h>

#include "moert/dispatcher.h"
#include "moert/layers.h"
#include "moert/memory_policy.h"
#include "moert/plugin.h"
#include "moert/precision.h"
#include "moert/router.h"
#include "moert/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

#define MOERT_VERSION_STRING "0.1.0"

MOERT_API const char *moert_version(void);

/* The message of the last failed moert_ call on this thread ("" if none). */
MOERT_API const char *moert_last_error(void);

/* ---- configuration ---- */

typedef struct moert_config moert_config;

/* Parses a JSON config; errors name the file, line and column, or the JSON path of a bad value. */
MOERT_API moert_result moert_config_load_file(const char *path, moert_config **out);
MOERT_API moert_result moert_config_load_string(const char *json_text, const char *source_name, moert_config **out);
/* Replaces one value, e.g. ("train.steps", "10"); the value is JSON text. For command-line overrides. */
MOERT_API moert_result moert_config_set(moert_config *cfg, const char *dotted_key, const char *json_value);
MOERT_API void moert_config_free(moert_config *cfg);

/* ---- runtime: the configured MoE layer stack on every rank ---- */

typedef struct moert_runtime moert_runtime;

/* Loads every plugin, checks all options, and initialises one instance per layer and rank. */
MOERT_API moert_result moert_runtime_create(const moert_config *cfg, moert_runtime **out);
MOERT_API void moert_runtime_destroy(moert_runtime *rt);

typedef struct moert_train_options {
    uint32_t struct_size;
    FILE *progress;   /* a line per step goes here; NULL for quiet */
    int64_t steps;    /* 0: the config's train.steps */
    /* appended: a Chrome trace (JSON; Perfetto, chrome://tracing) of the stage spans of every rank's streams over the
     * run, or NULL. With ranks as threads one file holds every rank; with a process per GPU rank N (N > 0) writes
     * trace_path.rankN. */
    const char *trace_path;
} moert_train_options;

/* The first rank this process runs: 0 when one process runs every rank as a thread; RANK when a launcher
 * (torchrun, srun) started a process per GPU. Rank 0's process prints progress and writes reports. */
MOERT_API int moert_runtime_rank(const moert_runtime *rt);

/* Trains the layer stack on the config's synthetic task. */
MOERT_API moert_result moert_runtime_train(moert_runtime *rt, const moert_train_options *opts);
/* Writes every figure of the last run as JSON. */
MOERT_API moert_result moert_runtime_write_report(const moert_runtime *rt, const char *path);

#ifdef __cplusplus
}
#endif
#endif
