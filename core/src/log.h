/* SPDX-License-Identifier: Apache-2.0 */
/* Core logging; the level comes from MOERT_LOG (error, warn, info, debug; default warn). */
#ifndef MOERT_CORE_LOG_H
#define MOERT_CORE_LOG_H

#include <stdarg.h>

#include "moert/plugin.h"

void moert_log(moert_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void moert_logv(moert_log_level level, const char *who, const char *fmt, va_list ap);

/* One rank's layers starting on this thread (moert_stack_init): between begin and end, a warning or info line that a
 * plugin of the same kind and name already wrote with the same text on this thread (another layer's instance) is not
 * written again, so a model of 61 layers says a start-up warning once per rank, not 61 times. The first carries a note
 * saying so. Not at MOERT_LOG=debug, where every line is written. */
void moert_log_startup_begin(void);
void moert_log_startup_end(void);
/* moert_logv for a plugin instance's host (who: "router \"topk\" (layer 3, rank 0)"): repeats folded as above. */
void moert_logv_instance(moert_log_level level, const char *who, const char *fmt, va_list ap);
moert_log_level moert_log_level_current(void);

#endif
