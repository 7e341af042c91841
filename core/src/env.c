/* SPDX-License-Identifier: Apache-2.0 */
/* The environment variables the library reads (see env.h): the one table of them, and the reads that log. */
#include "env.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "error.h"
#include "log.h"
#include "moert/moert.h"

extern char **environ;

static const moert_env_var env_vars[MOERT_ENV_COUNT] = {
    [MOERT_ENV_LOG] = {"MOERT_LOG", "error|warn|info|debug", "warn",
                       "the least severe log lines written to stderr (or to moert_set_log_callback's function)"},
    [MOERT_ENV_PLUGIN_PATH] = {"MOERT_PLUGIN_PATH", "directories separated by ':'", "none",
                               "searched for plugins named in a config, before the build tree and the install "
                               "directory"},
    [MOERT_ENV_BOOTSTRAP_PORT] = {"MOERT_BOOTSTRAP_PORT", "integer 1..65535", "MASTER_PORT",
                                  "one process per GPU: the TCP port on MASTER_ADDR where rank 0 hands out the NCCL "
                                  "id (when MASTER_PORT is taken, e.g. by torch.distributed's own store)"},
};

static const moert_env_foreign foreign_vars[] = {
    {"WORLD_SIZE", "one process per GPU (torchrun): the number of ranks"},
    {"RANK", "one process per GPU (torchrun): this process's rank"},
    {"LOCAL_RANK", "one process per GPU (torchrun): the GPU of this process on its host"},
    {"MASTER_ADDR", "one process per GPU (torchrun): the host of rank 0"},
    {"MASTER_PORT", "one process per GPU (torchrun): rank 0's port, and the default of MOERT_BOOTSTRAP_PORT"},
    {"NCCL_NVLS_ENABLE", "NCCL's NVLink multicast (NVLS): when unset, moert sets it to 0 before its first NCCL "
                         "communicator, so NCCL never uses multicast unless asked; a value you set is kept (warned "
                         "about unless 0)"},
};

static const moert_env_retired retired_vars[] = {
    {"MOERT_FP8_BLOCK_TILE_N", "the fp8 precision option \"block_tile_n\""},
    {"MOERT_FP8_BLOCK_STAGES", "the fp8 precision option \"block_stages\""},
    {"MOERT_FP8_BLOCK_PAIRS", "the fp8 precision option \"block_pairs\""},
    {"MOERT_FP8_BLOCK_PAIR_ROWS", "the fp8 precision option \"block_pair_rows\""},
    {"MOERT_FP8_BLOCK_CLUSTER", "the fp8 precision option \"block_cluster\""},
    {"MOERT_FP8_BLOCK_CLUSTERS", "the fp8 precision option \"block_clusters\""},
    {"MOERT_FP8_BLOCK_EPILOGUE", "nothing (removed: the TMA epilogue always runs)"},
    {"MOERT_FP8_BLOCK_SETS", "nothing (removed: the output sets follow the tile)"},
    {"MOERT_FP8_ROW_QUANTIZER", "nothing (removed: the wide row quantizer runs wherever rows allow it)"},
    {"MOERT_OFFLOAD_DEFER_START", "the config key $.parallel.offload_defer_start"},
    {"MOERT_SMALL_COPY_KERNEL", "nothing (removed: small device-host copies always go through a kernel)"},
};

const moert_env_var *moert_env_vars(int *count)
{
    *count = MOERT_ENV_COUNT;
    return env_vars;
}

const moert_env_foreign *moert_env_foreign_vars(int *count)
{
    *count = (int)(sizeof foreign_vars / sizeof foreign_vars[0]);
    return foreign_vars;
}

const moert_env_retired *moert_env_retired_vars(int *count)
{
    *count = (int)(sizeof retired_vars / sizeof retired_vars[0]);
    return retired_vars;
}

const moert_env_retired *moert_env_find_retired(const char *name)
{
    for (size_t i = 0; i < sizeof retired_vars / sizeof retired_vars[0]; i++)
        if (strcmp(retired_vars[i].name, name) == 0) return &retired_vars[i];
    return NULL;
}

const char *moert_env_raw(moert_env_id id)
{
    if ((int)id < 0 || id >= MOERT_ENV_COUNT) return NULL;
    return getenv(env_vars[id].name);
}

static pthread_once_t noted_once = PTHREAD_ONCE_INIT;

/* Once per process: a line for each variable of the table that is set (so a run's log says what its environment
 * changed), and a warning for each retired one (set, it would otherwise do nothing without a word). */
static void note_environment(void)
{
    for (int i = 0; i < MOERT_ENV_COUNT; i++) {
        const char *value = getenv(env_vars[i].name);
        if (value) moert_log(MOERT_LOG_INFO, "environment: %s=%s", env_vars[i].name, value);
    }
    for (char **e = environ; e && *e; e++) {
        if (strncmp(*e, "MOERT_", 6) != 0) continue;
        const char *eq = strchr(*e, '=');
        size_t len = eq ? (size_t)(eq - *e) : strlen(*e);
        for (size_t i = 0; i < sizeof retired_vars / sizeof retired_vars[0]; i++)
            if (strlen(retired_vars[i].name) == len && strncmp(*e, retired_vars[i].name, len) == 0)
                moert_log(MOERT_LOG_WARN, "environment: %s is set but no longer read; use %s", retired_vars[i].name,
                          retired_vars[i].instead);
    }
}

const char *moert_env_get(moert_env_id id)
{
    pthread_once(&noted_once, note_environment);
    return moert_env_raw(id);
}

MOERT_API int moert_env_table_size(moert_env_table table)
{
    int count = 0;
    switch (table) {
    case MOERT_ENV_TABLE_READ: moert_env_vars(&count); break;
    case MOERT_ENV_TABLE_FOREIGN: moert_env_foreign_vars(&count); break;
    case MOERT_ENV_TABLE_RETIRED: moert_env_retired_vars(&count); break;
    default: break;
    }
    return count;
}

MOERT_API moert_result moert_env_table_entry(moert_env_table table, int index, moert_env_entry *out)
{
    if (!out || index < 0 || index >= moert_env_table_size(table))
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "moert_env_table_entry: no entry %d in table %d", index,
                           (int)table);
    int count = 0;
    memset(out, 0, sizeof *out);
    if (table == MOERT_ENV_TABLE_READ) {
        const moert_env_var *v = &moert_env_vars(&count)[index];
        *out = (moert_env_entry){.name = v->name, .type = v->type, .default_text = v->default_text, .help = v->help};
    } else if (table == MOERT_ENV_TABLE_FOREIGN) {
        const moert_env_foreign *v = &moert_env_foreign_vars(&count)[index];
        *out = (moert_env_entry){.name = v->name, .help = v->help};
    } else {
        const moert_env_retired *v = &moert_env_retired_vars(&count)[index];
        *out = (moert_env_entry){.name = v->name, .help = v->instead};
    }
    return MOERT_OK;
}
