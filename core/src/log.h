/* SPDX-License-Identifier: Apache-2.0 */
/* Core logging; the level comes from MOERT_LOG (error, warn, info, debug; default warn). */
#ifndef MOERT_CORE_LOG_H
#define MOERT_CORE_LOG_H

#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>

#include "moert/plugin.h"

void moert_log(moert_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void moert_logv(moert_log_level level, const char *who, const char *fmt, va_list ap);

/* One rank's layers starting on this thread (moert_stack_init): between begin and end, a warning or info line that a
 * plugin of the same kind and name already wrote with the same text (another layer's instance, or another rank's of
 * the same world) is not written again, so 61 layers on 8 ranks say a start-up warning once, not 488 times. The first
 * carries a note saying so. seen(scope, hash) answers whether a line was written already and notes it (the world's
 * set, moert_comm_log_seen); NULL: a set of this thread's own (this rank's layers). Not at MOERT_LOG=debug, where
 * every line is written. */
typedef bool (*moert_log_seen_fn)(void *scope, uint64_t hash);
/* ranks: the scope holds several ranks of this process (threads), which the note then names */
void moert_log_startup_begin(moert_log_seen_fn seen, void *scope, bool ranks);
void moert_log_startup_end(void);
/* moert_logv for a plugin instance's host (who: "router \"topk\" (layer 3, rank 0)"): repeats folded as above. */
void moert_logv_instance(moert_log_level level, const char *who, const char *fmt, va_list ap);
moert_log_level moert_log_level_current(void);

#endif
