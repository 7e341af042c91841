/* SPDX-License-Identifier: Apache-2.0 */
/* Error messages and checked-call macros of the core. */
#ifndef MOERT_CORE_ERROR_H
#define MOERT_CORE_ERROR_H

#include "moert/plugin.h"

/* Sets this thread's last error message and returns code (so: return moert_error(...)). */
moert_result moert_error(moert_result code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Prepends context to this thread's message: "context: old message". */
void moert_error_prefix(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
const char *moert_error_message(void);
void moert_error_clear(void);

/* Calls a moert function; on failure keeps its message and jumps to fail with rc set. */
#define MOERT_CHECK(call)                                                                                              \
    do {                                                                                                               \
        rc = (call);                                                                                                   \
        if (rc != MOERT_OK) goto fail;                                                                                 \
    } while (0)

/* Checks an allocation; on NULL sets an error naming the call and jumps to fail. */
#define MOERT_CHECK_ALLOC(ptr)                                                                                         \
    do {                                                                                                               \
        if ((ptr) == NULL) {                                                                                           \
            rc = moert_error(MOERT_ERR_OUT_OF_MEMORY, "%s failed (%s:%d)", #ptr, __FILE__, __LINE__);                  \
            goto fail;                                                                                                 \
        }                                                                                                              \
    } while (0)

#endif
