/* SPDX-License-Identifier: Apache-2.0 */
/* Trace: the stage spans of every rank's streams over a run, written as a Chrome trace (JSON, opened by Perfetto or
 * chrome://tracing), so a user sees what runs where and what overlaps (`moert run --trace FILE`, docs/executor.md). */
#ifndef MOERT_HARNESS_TRACE_H
#define MOERT_HARNESS_TRACE_H

#include <stdint.h>

#include "moert/moert.h"

/* One span: what ran, on which rank and stream, from when (microseconds since the run started) and how long. A stage
 * span names its layer (>= 0); a kernel span (`--trace-kernels`) has layer -1, the kernel's short name, its full
 * name in `kernel` and its CUDA stream in `cuda_stream`. */
typedef struct moert_trace_span {
    const char *name;   /* a stage or backward part name (static storage), or a kernel's short name */
    const char *stream; /* "compute", "wgrad", ... (static storage); NULL for a kernel */
    int rank;
    int layer;
    int64_t step, micro;
    double start_us, dur_us;
    const char *kernel;   /* a kernel's full name, as CUPTI gave it */
    uint32_t cuda_stream; /* a kernel's stream (CUPTI's id) */
    int32_t grid;         /* a kernel's blocks */
} moert_trace_span;

/* The spans one rank recorded; each rank appends to its own, so ranks as threads need no lock. */
typedef struct moert_trace {
    moert_trace_span *spans;
    int64_t count, capacity;
} moert_trace;

moert_result moert_trace_add(moert_trace *t, const moert_trace_span *span);
void moert_trace_clear(moert_trace *t);

/* Writes the spans of `count` ranks' traces to `path` (atomically), as Chrome trace "complete" events: one process
 * per rank, one thread per stream (the stage spans' streams first, then each CUDA stream's kernels). `label` names the run in the trace's metadata, `note` (or NULL) adds a line to it. */
moert_result moert_trace_write(const moert_trace *traces, int count, const char *label, const char *note,
                               const char *path);

#endif
