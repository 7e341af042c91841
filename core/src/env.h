/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The environment variables the library reads, declared once (env.c): name, type, default and help, so that
 * `moert env`, the log and docs/config.md all say the same. Everything else that changes how moert runs is a config
 * key or a plugin option, per instance and checked; the environment is kept for what must be known before a config
 * is read (where plugins are, how much to log) or comes from a launcher.
 */
#ifndef MOERT_CORE_ENV_H
#define MOERT_CORE_ENV_H

typedef enum moert_env_id {
    MOERT_ENV_LOG = 0,        /* log level */
    MOERT_ENV_PLUGIN_PATH,    /* directories searched for plugins first */
    MOERT_ENV_BOOTSTRAP_PORT, /* process per GPU: the TCP port of the NCCL id's bootstrap */
    MOERT_ENV_COUNT
} moert_env_id;

typedef struct moert_env_var {
    const char *name;
    const char *type;         /* how the value reads, e.g. "error|warn|info|debug" */
    const char *default_text; /* what holds when it is unset */
    const char *help;         /* one line */
} moert_env_var;

/* A variable moert reads that belongs to someone else (a launcher, NCCL), for `moert env` and the docs. */
typedef struct moert_env_foreign {
    const char *name;
    const char *help;
} moert_env_foreign;

/* A MOERT_* variable that earlier versions read, and what replaced it: set, it is warned about, never ignored
 * silently. */
typedef struct moert_env_retired {
    const char *name;
    const char *instead;
} moert_env_retired;

/* The tables; *count gets their length. */
const moert_env_var *moert_env_vars(int *count);
const moert_env_foreign *moert_env_foreign_vars(int *count);
const moert_env_retired *moert_env_retired_vars(int *count);

/* The variable's value, or NULL when unset. The first call of the process logs (info) every variable of the table
 * that is set, and warns about each retired one that is set. */
const char *moert_env_get(moert_env_id id);

/* The value without logging: for the logger itself, which the log lines above need. */
const char *moert_env_raw(moert_env_id id);

/* The retired entry for name, or NULL. */
const moert_env_retired *moert_env_find_retired(const char *name);

#endif
