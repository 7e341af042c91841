/* SPDX-License-Identifier: Apache-2.0 */
/* Error messages of the core: one message buffer per thread, plus the public names of result codes. */
#include "error.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "moert/moert.h"

#define MOERT_ERROR_BUFFER_SIZE MOERT_ERROR_MAX

static _Thread_local char error_buffer[MOERT_ERROR_BUFFER_SIZE];

/* Sets this thread's message and returns code, so callers can `return moert_error(...)`. */
moert_result moert_error(moert_result code, const char *fmt, ...)
{
    char text[MOERT_ERROR_BUFFER_SIZE];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap); /* via a copy: fmt's arguments may point into error_buffer */
    va_end(ap);
    memcpy(error_buffer, text, sizeof text);
    return code;
}

MOERT_API moert_result moert_set_last_error(moert_result code, const char *fmt, ...)
{
    char text[MOERT_ERROR_BUFFER_SIZE];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    memcpy(error_buffer, text, sizeof text);
    return code;
}

/* Appends text to buf (size bytes, NUL-terminated), cutting what does not fit. */
static void append_text(char *buf, size_t size, const char *text)
{
    size_t used = strlen(buf);
    size_t room = size - 1 - used;
    size_t n = strnlen(text, room);
    memcpy(buf + used, text, n);
    buf[used + n] = '\0';
}

/* Prepends "context: " to this thread's message (or sets the context alone if there is none). */
void moert_error_prefix(const char *fmt, ...)
{
    char joined[MOERT_ERROR_BUFFER_SIZE];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(joined, sizeof joined, fmt, ap);
    va_end(ap);
    if (error_buffer[0]) {
        append_text(joined, sizeof joined, ": ");
        append_text(joined, sizeof joined, error_buffer);
    }
    memcpy(error_buffer, joined, sizeof joined);
}

/* This thread's last message ("" if none). */
const char *moert_error_message(void) { return error_buffer; }

/* Forgets this thread's message. */
void moert_error_clear(void) { error_buffer[0] = '\0'; }

/* Public: the last error of a moert_ call on this thread. */
const char *moert_last_error(void) { return error_buffer; }

/* Public: the library version, e.g. "0.1.0". */
const char *moert_version(void) { return MOERT_VERSION_STRING; }

/* Public: a short fixed name for each result code. */
const char *moert_result_name(moert_result r)
{
    switch (r) {
    case MOERT_OK: return "ok";
    case MOERT_ERR_INVALID_ARGUMENT: return "invalid argument";
    case MOERT_ERR_CONFIG: return "config error";
    case MOERT_ERR_UNSUPPORTED: return "unsupported";
    case MOERT_ERR_OUT_OF_MEMORY: return "out of memory";
    case MOERT_ERR_NOT_FOUND: return "not found";
    case MOERT_ERR_ABI_MISMATCH: return "ABI mismatch";
    case MOERT_ERR_CUDA: return "CUDA error";
    case MOERT_ERR_NCCL: return "NCCL error";
    case MOERT_ERR_TIMEOUT: return "timeout";
    case MOERT_ERR_IO: return "I/O error";
    case MOERT_ERR_INTERNAL: return "internal error";
    default: return "unknown result";
    }
}
