/* SPDX-License-Identifier: Apache-2.0 */
/* What every module of moert's trainer harness shares: its checked-call macros. The harness is a client of libmoert
 * like any training framework: its public-only modules include moert/moert.h and the harness's own headers, never a
 * header under core/src (tests/cli/test_tool_includes.sh). Errors go through moert_set_last_error, so a caller reads
 * the harness's failures and the library's alike with moert_last_error(). */
#ifndef MOERT_HARNESS_H
#define MOERT_HARNESS_H

#include <time.h>

#include "moert/moert.h"

/* The host's monotonic clock in seconds: the run's clock, on which the trace places stage spans and kernels alike. */
static inline double harness_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Calls a function returning moert_result; on failure keeps its message and jumps to fail with rc set. */
#define HARNESS_CHECK(call)                                                                                            \
    do {                                                                                                               \
        rc = (call);                                                                                                   \
        if (rc != MOERT_OK) goto fail;                                                                                 \
    } while (0)

/* Checks an allocation; on NULL sets an error naming the call and jumps to fail. */
#define HARNESS_CHECK_ALLOC(ptr)                                                                                       \
    do {                                                                                                               \
        if ((ptr) == NULL) {                                                                                           \
            rc = moert_set_last_error(MOERT_ERR_OUT_OF_MEMORY, "%s failed (%s:%d)", #ptr, __FILE__, __LINE__);         \
            goto fail;                                                                                                 \
        }                                                                                                              \
    } while (0)

#endif
