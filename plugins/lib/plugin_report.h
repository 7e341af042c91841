/* SPDX-License-Identifier: Apache-2.0 */
/* How a plugin reports an error: it never prints, it hands the message to its host (host->set_error) and returns
 * a result code, so checks can `return report(host, code, ...)`. Header-only, C and CUDA alike (plugins do not link
 * libmoert); each plugin's `fail(ctx, ...)` is this with its instance's host. */
#ifndef MOERT_PLUGIN_REPORT_H
#define MOERT_PLUGIN_REPORT_H

#include <stdarg.h>
#include <stdio.h>

#include "moert/plugin.h"

/* Formats a message and hands it to the host. Returns code. */
static inline moert_result report(const moert_host *host, moert_result code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static inline moert_result report(const moert_host *host, moert_result code, const char *fmt, ...)
{
    char text[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    if (host && host->set_error) host->set_error(host, "%s", text);
    return code;
}

/* A checked call of a GPU library whose calls return a status of type `type`, `ok` on success: on failure it reports
 * the call's text, the library's message for the status (`describe`) and the line, and returns MOERT_ERR_CUDA. The
 * CUDA and cuBLAS checks (CUDA_CHECK in plugin_cuda_check.h, CUBLAS_CHECK in cublaslt_state.h) are this with their
 * types, each in its own header so that a CUDA-only file does not include cublasLt.h. */
#define REPORT_STATUS_CHECK(host, type, ok, describe, call, text)                                                      \
    do {                                                                                                               \
        type st_ = (call);                                                                                             \
        if (st_ != (ok))                                                                                               \
            return report((host), MOERT_ERR_CUDA, "%s failed: %s (%s:%d)", text, describe(st_), __FILE__, __LINE__);   \
    } while (0)

#endif
