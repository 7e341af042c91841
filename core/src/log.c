/* SPDX-License-Identifier: Apache-2.0 */
/* Core logging: lines "moert[level] who: message" on stderr, filtered by MOERT_LOG. */
#include "log.h"

#include "env.h"
#include "moert/moert.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

static const char *const level_names[] = {"error", "warn", "info", "debug"};

static moert_log_level current_level = MOERT_LOG_WARN;
/* moert_set_log_callback: where lines go instead of stderr (an embedding framework's logger) */
static moert_log_fn log_callback;
static void *log_callback_user;
static pthread_mutex_t log_callback_lock = PTHREAD_MUTEX_INITIALIZER;

MOERT_API void moert_set_log_callback(moert_log_fn fn, void *user)
{
    pthread_mutex_lock(&log_callback_lock);
    log_callback = fn;
    log_callback_user = user;
    pthread_mutex_unlock(&log_callback_lock);
}
static pthread_once_t level_once = PTHREAD_ONCE_INIT;

static void emit(moert_log_level level, const char *who, const char *text);

/* Reads MOERT_LOG once (raw: the logged read would log through here). An unknown value keeps the default (warn) and
 * says so, whatever the level. */
static void read_level_from_env(void)
{
    const char *env = moert_env_raw(MOERT_ENV_LOG);
    if (!env || !*env) return;
    for (int i = 0; i < 4; i++) {
        if (strcasecmp(env, level_names[i]) == 0) {
            current_level = (moert_log_level)i;
            return;
        }
    }
    if (strcasecmp(env, "warning") == 0) {
        current_level = MOERT_LOG_WARN;
        return;
    }
    char text[256];
    snprintf(text, sizeof text, "MOERT_LOG=%.64s: expected error, warn, info or debug; logging at warn", env);
    emit(MOERT_LOG_WARN, "core", text);
}

/* The level in force: messages above it are dropped. */
moert_log_level moert_log_level_current(void)
{
    pthread_once(&level_once, read_level_from_env);
    return current_level;
}

/* Writes one line for `who` (may be NULL) if level is enabled; one fprintf so threads do not interleave. */
/* The message as one line: formatted, trailing newlines dropped; returns its length. */
static size_t format_line(char *text, size_t size, const char *fmt, va_list ap)
{
    vsnprintf(text, size, fmt, ap);
    size_t n = strlen(text);
    while (n > 0 && text[n - 1] == '\n') text[--n] = '\0';
    return n;
}

void moert_logv(moert_log_level level, const char *who, const char *fmt, va_list ap)
{
    if (level > moert_log_level_current()) return;
    char text[2048];
    format_line(text, sizeof text, fmt, ap);
    emit(level, who, text);
}

/* Hands one line to the callback, or writes it on stderr, whatever the level in force. */
static void emit(moert_log_level level, const char *who, const char *text)
{
    const char *name = (level >= MOERT_LOG_ERROR && level <= MOERT_LOG_DEBUG) ? level_names[level] : "log";
    pthread_mutex_lock(&log_callback_lock);
    moert_log_fn fn = log_callback;
    void *user = log_callback_user;
    pthread_mutex_unlock(&log_callback_lock);
    if (fn) {
        char line[2400];
        snprintf(line, sizeof line, "%s: %s", who && *who ? who : "core", text);
        fn(user, level, line);
        return;
    }
    if (who && *who)
        fprintf(stderr, "moert[%s] %s: %s\n", name, who, text);
    else
        fprintf(stderr, "moert[%s] core: %s\n", name, text);
}

/* The start-up lines of this thread's stack init: hashes of (plugin, level, text) already written. */
#define STARTUP_SEEN_MAX 256
typedef struct startup_seen {
    bool active;
    moert_log_seen_fn seen; /* the world's set, or NULL: hash[] */
    void *scope;
    bool ranks; /* the scope holds several ranks of this process */
    int count;
    uint64_t hash[STARTUP_SEEN_MAX];
} startup_seen;
static _Thread_local startup_seen startup;

void moert_log_startup_begin(moert_log_seen_fn seen, void *scope, bool ranks)
{
    startup.active = true;
    startup.seen = seen;
    startup.scope = scope;
    startup.ranks = seen && ranks;
    startup.count = 0;
}

void moert_log_startup_end(void)
{
    startup.active = false;
    startup.seen = NULL;
    startup.scope = NULL;
    startup.ranks = false;
    startup.count = 0;
}

/* Whether this start-up line was written already; notes it if not. */
static bool startup_line_seen(uint64_t h)
{
    if (startup.seen) return startup.seen(startup.scope, h);
    for (int i = 0; i < startup.count; i++)
        if (startup.hash[i] == h) return true;
    if (startup.count < STARTUP_SEEN_MAX) startup.hash[startup.count++] = h;
    return false;
}

/* FNV-1a over n bytes, continuing from h. */
static uint64_t fnv1a(uint64_t h, const void *data, size_t n)
{
    const unsigned char *p = data;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

void moert_logv_instance(moert_log_level level, const char *who, const char *fmt, va_list ap)
{
    const moert_log_level in_force = moert_log_level_current();
    if (level > in_force) return;
    char text[2048];
    const size_t n = format_line(text, sizeof text, fmt, ap);
    if (startup.active && (level == MOERT_LOG_WARN || level == MOERT_LOG_INFO) && in_force != MOERT_LOG_DEBUG) {
        /* the plugin's kind and name: who up to its location, " (layer ..., rank ...)" */
        const char *where = who ? strstr(who, " (") : NULL;
        const size_t stem = who ? (where ? (size_t)(where - who) : strlen(who)) : 0;
        uint64_t h = fnv1a(1469598103934665603ull, who ? who : "", stem);
        h = fnv1a(h, &level, sizeof level);
        h = fnv1a(h, text, n);
        if (startup_line_seen(h)) return; /* said by another layer (or rank) already */
        snprintf(text + n, sizeof text - n, " (not repeated for other layers%s)", startup.ranks ? " or ranks" : "");
    }
    emit(level, who, text);
}

/* Core messages: who is "core". */
void moert_log(moert_log_level level, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    moert_logv(level, "core", fmt, ap);
    va_end(ap);
}
