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

/* The message of the last failed moert_ call on this thread ("" if none), at most MOERT_ERROR_MAX bytes with its NUL
 * (room for a plugin not found along a long search path: every path tried is named). */
MOERT_API const char *moert_last_error(void);
#define MOERT_ERROR_MAX 16384

/* ---- configuration ---- */

typedef struct moert_config moert_config;

/* Parses a JSON config; errors name the file, line and column, or the JSON path of a bad value. */
MOERT_API moert_result moert_config_load_file(const char *path, moert_config **out);
MOERT_API moert_result moert_config_load_string(const char *json_text, const char *source_name, moert_config **out);
/* Replaces one value, e.g. ("train.steps", "10"); the value is JSON text. For command-line overrides. */
MOERT_API moert_result moert_config_set(moert_config *cfg, const char *dotted_key, const char *json_value);
/* Replaces n values in order and checks the config once (API version 11), so that keys which must agree (the expert
 * layout and $.parallel.ranks) change together; one at a time the first would be refused half-set. On error the config
 * is left as it was. */
MOERT_API moert_result moert_config_set_many(moert_config *cfg, int n, const char *const *dotted_keys,
                                             const char *const *json_values);
MOERT_API void moert_config_free(moert_config *cfg);

/* Sets the message moert_last_error() returns on this thread, and returns code: for code around moert (a trainer, a
 * collectives table, a framework's glue) that reports its own failures through the same channel as moert's. */
MOERT_API moert_result moert_set_last_error(moert_result code, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* ---- reading a config: its values after defaults and overrides ---- */

/* The value at dotted_key as compact JSON text: "model.hidden" -> 64, "model.dtype" -> "fp32", "router" -> the whole
 * section. The core's own keys ($.name, $.model, $.parallel, $.train and each plugin section's "plugin") read as moert
 * resolved them: defaults filled in, a relative plugin path made absolute. A plugin's own options read as written;
 * MOERT_ERR_NOT_FOUND where the config leaves them to their default (`moert plugins --options` lists those).
 * MOERT_ERR_INVALID_ARGUMENT when buf (size bytes) is too small. */
MOERT_API moert_result moert_config_get_json(const moert_config *cfg, const char *dotted_key, char *buf, size_t size);
/* The same for one number, boolean (0 or 1 as an integer) or string value; a value of another type is
 * MOERT_ERR_CONFIG. */
MOERT_API moert_result moert_config_get_int(const moert_config *cfg, const char *dotted_key, int64_t *out);
MOERT_API moert_result moert_config_get_double(const moert_config *cfg, const char *dotted_key, double *out);
MOERT_API moert_result moert_config_get_string(const moert_config *cfg, const char *dotted_key, char *buf, size_t size);
/* The file the config was read from, or the source name given to moert_config_load_string. */
MOERT_API const char *moert_config_source(const moert_config *cfg);

/* ---- plugins: what is installed, and what each reads ---- */

/* Calls fn for every plugin file (libmoert-KIND-NAME.so) along the search path (MOERT_PLUGIN_PATH, the build tree,
 * the install dir), in search order, without loading it: its path and the kind its name says (0 when it says none).
 * Returns the number of files. */
typedef void (*moert_plugin_file_fn)(void *user, const char *path, moert_plugin_kind kind);
MOERT_API int moert_plugin_list_files(moert_plugin_file_fn fn, void *user);
/* The directories searched, in order, ':'-joined. */
MOERT_API void moert_plugin_search_path(char *buf, size_t size);

/* What a plugin file's header declares. */
typedef struct moert_plugin_description {
    uint32_t struct_size; /* sizeof(moert_plugin_description) */
    moert_plugin_kind kind;
    const char *kind_name; /* "router", "dispatcher", "precision", "memory_policy" (static storage) */
    char name[64], version[24], description[512], path[1024];
    uint32_t devices, dtypes, flags; /* the header's capability bits (MOERT_CAP_*) */
    /* API version 6: a precision plugin's agreement_rtol (moert_precision_v1), 0 where it declares none or is of
     * another kind. */
    double agreement_rtol;
} moert_plugin_description;
/* Loads the file as a plugin of kind, checks its ABI, copies what its header declares, and unloads it; the plugin is
 * not started. Errors as for a config naming it (MOERT_ERR_ABI_MISMATCH, ...). */
MOERT_API moert_result moert_plugin_describe(moert_plugin_kind kind, const char *path, moert_plugin_description *out);

/* One option a plugin reads from its config section; the strings live until the callback returns. */
typedef struct moert_plugin_option {
    const char *key, *type; /* type: "int", "float", "bool", "string" or "enum" */
    const char *default_text, *range, *help;
} moert_plugin_option;
typedef void (*moert_plugin_option_fn)(void *user, const moert_plugin_option *option);
/* Starts the plugin file once with all-default options on a default layer (H=64 F=128 E=8 K=2, 256 tokens, one
 * rank, the CPU), calls fn for every option it read, in order, and finalizes it. Returns the start's result: the
 * options read before a failing start are reported too. The plugin runs in this process; start an untrusted one in a
 * child process. */
MOERT_API moert_result moert_plugin_list_options(moert_plugin_kind kind, const char *path, moert_plugin_option_fn fn,
                                                 void *user);

/* For programs: when a plugin's init or finalize crashes (SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT) or calls exit(),
 * prints to stderr which plugin, which call, layer and rank (then the signal takes its course; an exit becomes status
 * 1). Installs signal handlers once; after it, each thread registers an exit handler at its first plugin call.
 * Libraries embedding moert need not call it. */
MOERT_API void moert_plugin_guard_crashes(void);

/* API version 6: the plugins a moert_layers loaded, as moert_plugin_describe gives them (path: the file loaded). */
MOERT_API moert_result moert_layers_plugin(const moert_layers *layers, moert_plugin_kind kind,
                                           moert_plugin_description *out);

/* ---- memory ---- */

/* API version 6: what cfg needs in memory per rank on `world` ranks of device type `device` (MOERT_DEVICE_CPU or
 * MOERT_DEVICE_CUDA), estimated without starting a plugin (docs/config.md, "Memory estimate"): one line into buf (by
 * category, the total and the memory it is measured against; MOERT_ERR_INVALID_ARGUMENT, buf untouched, when it does not
 * hold the line: 512 bytes always do). Returns MOERT_ERR_OUT_OF_MEMORY, the estimate in the message, when it does not
 * fit (more than 90% of the CPU's memory, or one GPU's). */
MOERT_API moert_result moert_config_memory_estimate(const moert_config *cfg, int world, moert_device_type device,
                                                    char *buf, size_t size);

/* ---- the environment variables moert reads ---- */

typedef enum moert_env_table {
    MOERT_ENV_TABLE_READ = 0,    /* moert's own variables (MOERT_LOG, MOERT_PLUGIN_PATH, ...) */
    MOERT_ENV_TABLE_FOREIGN = 1, /* launchers' and NCCL's that moert reads (RANK, WORLD_SIZE, ...) */
    MOERT_ENV_TABLE_RETIRED = 2  /* MOERT_* variables earlier versions read: set, they are warned about */
} moert_env_table;
typedef struct moert_env_entry {
    const char *name;
    const char *type;         /* READ: how the value reads, e.g. "error|warn|info|debug"; NULL in the other tables */
    const char *default_text; /* READ: what holds when it is unset; NULL in the other tables */
    const char *help;         /* READ and FOREIGN: one line; RETIRED: what replaced it */
} moert_env_entry;
/* The number of entries of a table, and entry `index` of it (static strings). */
MOERT_API int moert_env_table_size(moert_env_table table);
MOERT_API moert_result moert_env_table_entry(moert_env_table table, int index, moert_env_entry *out);

#ifdef __cplusplus
}
#endif
#endif
