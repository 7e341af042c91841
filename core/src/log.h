/* SPDX-License-Identifier: Apache-2.0 */
/* Core logging; the level comes from MOERT_LOG (error, warn, info, debug; default warn). */
#ifndef MOERT_CORE_LOG_H
#define MOERT_CORE_LOG_H

#include <stdarg.h>

#include "moert/plugin.h"

void moert_log(moert_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void moert_logv(moert_log_level level, const char *who, const char *fmt, va_list ap);
moert_log_level moert_log_level_current(void);

#endif
