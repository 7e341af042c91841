/* SPDX-License-Identifier: Apache-2.0 */
/* Kernel trace: every CUDA kernel this process runs, with its device, stream, start and end on the GPU, recorded by
 * CUPTI's activity API for `moert run --trace FILE --trace-kernels`. The stage spans say what each stream was asked
 * to do; the kernels say what the GPU ran when, so a user sees which kernels of the two micro-batch slots (and the
 * dispatcher's) share the GPU. libcupti is opened at run time, not linked: builds and runs without it are unchanged.
 * One trace at a time per process (CUPTI's buffer callbacks carry no context). */
#ifndef MOERT_HARNESS_KERNEL_TRACE_H
#define MOERT_HARNESS_KERNEL_TRACE_H

#include <stdint.h>

#include "moert/moert.h"

/* One kernel as it ran: times on the host's monotonic clock (the stage spans' clock), in seconds. */
typedef struct moert_kernel_record {
    const char *name;       /* CUPTI's name (mangled for C++ kernels), owned by the trace */
    const char *short_name; /* the function's own name, without namespaces, templates or parameters */
    int device;             /* CUDA ordinal */
    uint32_t stream;        /* CUPTI's stream id, unique within the process */
    int32_t grid;           /* blocks launched (x * y * z) */
    double start_s, end_s;
} moert_kernel_record;

typedef struct moert_kernel_trace moert_kernel_trace;

/* What recording cost: the buffers CUPTI filled and handed back, and the host time spent in its buffer callbacks. */
typedef struct moert_kernel_trace_stats {
    int64_t kernels, buffers;
    double callback_s;
} moert_kernel_trace_stats;

/* Opens libcupti (the paths tried are named if none loads; its major version must be the one moert was built with)
 * and starts recording every kernel of every device of this process. */
moert_result moert_kernel_trace_start(moert_kernel_trace **out);
/* Stops recording once the GPUs have finished (the caller synchronizes first), and hands out the kernels in the
 * order CUPTI delivered them; they stay valid until moert_kernel_trace_destroy. Fails if CUPTI dropped records. */
moert_result moert_kernel_trace_stop(moert_kernel_trace *kt, const moert_kernel_record **records, int64_t *count);
/* The figures of a stopped trace. */
moert_kernel_trace_stats moert_kernel_trace_stats_of(const moert_kernel_trace *kt);
void moert_kernel_trace_destroy(moert_kernel_trace *kt);

/* The function's own name within a CUPTI kernel name ("_ZN3moe4gemmIfEEvPf" -> "gemm", "nccl_x" -> itself), written
 * to out (at most size bytes, NUL-terminated); a plain C name is copied as is. */
void moert_kernel_short_name(const char *name, char *out, size_t size);

#endif
