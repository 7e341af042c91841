/* SPDX-License-Identifier: Apache-2.0 */
/* The host table the standalone GPU benchmarks hand to plugin code (gemm_bench, fp8_gemm_bench, router_bench): messages
 * only (no memory services: plugin code falls back to cudaMalloc), the last error kept in bench_host_error; and
 * MOK(call), a moert_result call a benchmark cannot go on without, which prints the call and that message and exits 1
 * when it fails. Header-only: each benchmark is one translation unit. */
#ifndef MOERT_BENCH_HOST_H
#define MOERT_BENCH_HOST_H

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "moert/plugin.h"

static char bench_host_error[2048];

static void bench_host_log(const moert_host *h, moert_log_level level, const char *fmt, ...)
{
    (void)h, (void)level, (void)fmt;
}

static void bench_host_set_error(const moert_host *h, const char *fmt, ...)
{
    (void)h;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(bench_host_error, sizeof bench_host_error, fmt, ap);
    va_end(ap);
}

static moert_host bench_host = {
    .struct_size = sizeof(moert_host), .log = bench_host_log, .set_error = bench_host_set_error};

#define MOK(call)                                                                                                      \
    do {                                                                                                               \
        moert_result r_ = (call);                                                                                      \
        if (r_ != MOERT_OK) {                                                                                          \
            fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #call, bench_host_error);                    \
            exit(1);                                                                                                   \
        }                                                                                                              \
    } while (0)

#endif
