/* SPDX-License-Identifier: Apache-2.0 */
/* Trace: stage spans of each rank's streams as a Chrome trace. */
#include "trace.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "output.h"

moert_result moert_trace_add(moert_trace *t, const moert_trace_span *span)
{
    if (t->count == t->capacity) {
        int64_t capacity = t->capacity ? 2 * t->capacity : 256;
        moert_trace_span *grown = realloc(t->spans, (size_t)capacity * sizeof *grown);
        if (!grown)
            return moert_set_last_error(MOERT_ERR_OUT_OF_MEMORY, "growing the trace to %lld spans",
                                        (long long)capacity);
        t->spans = grown;
        t->capacity = capacity;
    }
    t->spans[t->count++] = *span;
    return MOERT_OK;
}

void moert_trace_clear(moert_trace *t)
{
    free(t->spans);
    memset(t, 0, sizeof *t);
}

enum { TRACE_MAX_STREAMS = 16, TRACE_MAX_CUDA_STREAMS = 64, TRACE_KERNEL_TID = 100 };

/* The thread id of a stream within its rank's process: the order streams are first seen in. */
static int stream_tid(const char **seen, int *nseen, const char *stream)
{
    for (int i = 0; i < *nseen; i++)
        if (!strcmp(seen[i], stream)) return i;
    if (*nseen < TRACE_MAX_STREAMS) seen[(*nseen)++] = stream;
    return *nseen - 1;
}

/* The thread id of a CUDA stream's kernels: after the stage spans' streams, in the order first seen. */
static int cuda_stream_tid(uint32_t *seen, int *nseen, uint32_t stream)
{
    for (int i = 0; i < *nseen; i++)
        if (seen[i] == stream) return TRACE_KERNEL_TID + i;
    if (*nseen < TRACE_MAX_CUDA_STREAMS) seen[(*nseen)++] = stream;
    return TRACE_KERNEL_TID + *nseen - 1;
}

/* A metadata event naming a process (a rank) or a thread (a stream). */
static json_t *name_event(const char *kind, int pid, int tid, const char *name)
{
    return json_pack("{s:s, s:s, s:i, s:i, s:{s:s}}", "name", kind, "ph", "M", "pid", pid, "tid", tid, "args", "name",
                     name);
}

static int dump_json(FILE *f, void *root) { return json_dumpf(root, f, JSON_COMPACT | JSON_REAL_PRECISION(10)); }

moert_result moert_trace_write(const moert_trace *traces, int count, const char *label, const char *note,
                               const char *path)
{
    moert_result rc = MOERT_OK;
    json_t *root = json_object(), *events = json_array();
    if (!root || !events) {
        json_decref(root);
        json_decref(events);
        return moert_set_last_error(MOERT_ERR_OUT_OF_MEMORY, "building the trace");
    }
    json_object_set_new(root, "traceEvents", events);
    json_object_set_new(root, "displayTimeUnit", json_string("ms"));
    json_object_set_new(root, "otherData", json_pack("{s:s}", "run", label ? label : "moert"));
    if (note) json_object_set_new(json_object_get(root, "otherData"), "note", json_string(note));
    for (int r = 0; r < count; r++) {
        const char *streams[TRACE_MAX_STREAMS];
        uint32_t cuda_streams[TRACE_MAX_CUDA_STREAMS];
        int nstreams = 0, ncuda = 0;
        const moert_trace *t = &traces[r];
        if (t->count == 0) continue;
        char rank_name[32];
        snprintf(rank_name, sizeof rank_name, "rank %d", t->spans[0].rank);
        json_array_append_new(events, name_event("process_name", t->spans[0].rank, 0, rank_name));
        for (int64_t i = 0; i < t->count; i++) {
            const moert_trace_span *s = &t->spans[i];
            json_t *e = NULL;
            if (s->layer < 0) { /* a kernel */
                const int before = ncuda;
                const int tid = cuda_stream_tid(cuda_streams, &ncuda, s->cuda_stream);
                if (ncuda > before) {
                    char thread[48];
                    snprintf(thread, sizeof thread, "kernels, CUDA stream %u", s->cuda_stream);
                    json_array_append_new(events, name_event("thread_name", s->rank, tid, thread));
                }
                e = json_pack("{s:s, s:s, s:s, s:i, s:i, s:f, s:f, s:{s:s, s:i, s:I}}", "name", s->name, "cat",
                              "kernel", "ph", "X", "pid", s->rank, "tid", tid, "ts", s->start_us, "dur",
                              s->dur_us > 0.0 ? s->dur_us : 0.0, "args", "kernel", s->kernel ? s->kernel : s->name,
                              "grid", (int)s->grid, "cuda_stream", (json_int_t)s->cuda_stream);
            } else { /* a stage or backward part */
                int before = nstreams;
                int tid = stream_tid(streams, &nstreams, s->stream);
                if (nstreams > before)
                    json_array_append_new(events, name_event("thread_name", s->rank, tid, s->stream));
                char name[96];
                snprintf(name, sizeof name, "L%d %s", s->layer, s->name);
                e = json_pack("{s:s, s:s, s:s, s:i, s:i, s:f, s:f, s:{s:i, s:I, s:I}}", "name", name, "cat", s->stream,
                              "ph", "X", "pid", s->rank, "tid", tid, "ts", s->start_us, "dur",
                              s->dur_us > 0.0 ? s->dur_us : 0.0, "args", "layer", s->layer, "step", (json_int_t)s->step,
                              "micro_batch", (json_int_t)s->micro);
            }
            if (!e || json_array_append_new(events, e) != 0) {
                rc = moert_set_last_error(MOERT_ERR_OUT_OF_MEMORY, "building the trace");
                goto exit;
            }
        }
    }
    rc = moert_output_write(path, dump_json, root);
exit:
    json_decref(root);
    return rc;
}
