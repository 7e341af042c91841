/* SPDX-License-Identifier: Apache-2.0 */
/* Kernel trace through CUPTI's activity API (CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: kernels keep running
 * concurrently while recorded). libcupti is opened with dlopen, so neither the build nor a run without
 * --trace-kernels needs it. */
#include "kernel_trace.h"

#include "harness.h"

#include <ctype.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifdef MOERT_HAVE_CUPTI
#include <cupti.h>
#include <dlfcn.h>
#include <pthread.h>
#endif

/* Skips one identifier "<length><chars>" at *p; returns its start and length, or NULL past the end. */
static const char *read_source_name(const char **p, size_t *len)
{
    char *end = NULL;
    unsigned long n = strtoul(*p, &end, 10);
    if (end == *p || n == 0 || strlen(end) < n) return NULL;
    *len = n;
    *p = end + n;
    return end;
}

/* Skips a template argument list "I ... E" at *p (which points at 'I'); false where the name ends first. */
static bool skip_template_args(const char **p)
{
    int depth = 0;
    const char *s = *p;
    while (*s) {
        if (isdigit((unsigned char)*s)) {
            size_t len = 0;
            if (!read_source_name(&s, &len)) return false;
            continue;
        }
        if (*s == 'S' || *s == 'T') { /* substitutions and template parameters: "St", "S_", "S0_", "T_", "T1_" */
            s++;
            if (islower((unsigned char)*s)) {
                s++;
                continue;
            }
            while (*s && *s != '_') s++;
            if (*s) s++;
            continue;
        }
        if (strchr("INLXJ", *s)) depth++;
        if (*s == 'E' && --depth == 0) {
            *p = s + 1;
            return true;
        }
        s++;
    }
    return false;
}

void moert_kernel_short_name(const char *name, char *out, size_t size)
{
    if (size == 0) return;
    const char *last = NULL;
    size_t last_len = 0;
    if (name && name[0] == '_' && name[1] == 'Z') {
        const char *p = name + 2;
        if (*p == 'N') { /* nested: N [CV-qualifiers] components E; the function is the last component */
            p++;
            while (*p == 'r' || *p == 'V' || *p == 'K') p++;
            while (*p && *p != 'E') {
                size_t len = 0;
                const char *id = NULL;
                if (isdigit((unsigned char)*p)) {
                    id = read_source_name(&p, &len);
                    if (!id) break;
                    last = id;
                    last_len = len;
                } else if (*p == 'I') {
                    if (!skip_template_args(&p)) break;
                } else if (*p == 'S' && islower((unsigned char)p[1])) {
                    p += 2;
                } else {
                    break; /* something this short reader does not know: keep what it has */
                }
            }
        } else if (isdigit((unsigned char)*p)) {
            last = read_source_name(&p, &last_len);
        }
    }
    if (!last) {
        snprintf(out, size, "%s", name ? name : "?");
        return;
    }
    snprintf(out, size, "%.*s", (int)last_len, last);
}

#ifndef MOERT_HAVE_CUPTI

moert_result moert_kernel_trace_start(moert_kernel_trace **out)
{
    *out = NULL;
    return moert_set_last_error(MOERT_ERR_UNSUPPORTED,
                                "--trace-kernels needs CUPTI: this build has no CUDA, or its CUDA toolkit had no "
                                "cupti.h (build with -Dcuda=enabled and CUPTI installed)");
}

moert_result moert_kernel_trace_stop(moert_kernel_trace *kt, const moert_kernel_record **records, int64_t *count)
{
    *records = NULL;
    *count = 0;
    return moert_set_last_error(MOERT_ERR_UNSUPPORTED, "no kernel trace runs");
}

void moert_kernel_trace_destroy(moert_kernel_trace *kt) { (void)kt; }

moert_kernel_trace_stats moert_kernel_trace_stats_of(const moert_kernel_trace *kt)
{
    (void)kt;
    return (moert_kernel_trace_stats){0};
}

#else

enum { KERNEL_TRACE_BUFFER_BYTES = 1 << 20, KERNEL_TRACE_SPARE_BUFFERS = 64, KERNEL_TRACE_NAME_MAX = 160 };

/* The CUPTI functions used, looked up in the library opened. */
typedef struct cupti_api {
    CUptiResult (*get_version)(uint32_t *);
    CUptiResult (*get_result_string)(CUptiResult, const char **);
    CUptiResult (*register_callbacks)(CUpti_BuffersCallbackRequestFunc, CUpti_BuffersCallbackCompleteFunc);
    CUptiResult (*enable)(CUpti_ActivityKind);
    CUptiResult (*disable)(CUpti_ActivityKind);
    CUptiResult (*flush_all)(uint32_t);
    CUptiResult (*next_record)(uint8_t *, size_t, CUpti_Activity **);
    CUptiResult (*dropped)(CUcontext, uint32_t, size_t *);
    CUptiResult (*timestamp)(uint64_t *);
    CUptiResult (*set_attribute)(CUpti_ActivityAttribute, size_t *, void *);
} cupti_api;

/* A kernel as CUPTI gave it, before its times are put on the host clock. */
typedef struct raw_kernel {
    const char *cupti_name;
    int device;
    uint32_t stream;
    int32_t grid;
    uint64_t start_ns, end_ns;
} raw_kernel;

/* A name seen, and the trace's own copies of it. */
typedef struct kernel_name {
    const char *cupti_name;
    char *name, *short_name;
} kernel_name;

struct moert_kernel_trace {
    cupti_api api;
    pthread_mutex_t lock; /* CUPTI delivers buffers on its own thread */
    raw_kernel *raw;
    int64_t count, capacity;
    size_t dropped;
    bool out_of_memory;
    int64_t buffers;   /* handed back by CUPTI */
    double callback_s; /* host time in the buffer callbacks */
    /* the two clocks read together at start and stop, to place CUPTI's times on the host's */
    double host_start_s, host_stop_s;
    uint64_t cupti_start_ns, cupti_stop_ns;
    kernel_name *names;
    int64_t name_count, name_capacity;
    moert_kernel_record *records;
};

/* The library stays loaded once opened (CUPTI does not support being unloaded), and a process traces once at a
 * time: the callbacks reach the trace through this. */
static void *cupti_library;
static moert_kernel_trace *active_trace;
static pthread_mutex_t active_lock = PTHREAD_MUTEX_INITIALIZER;
/* Buffers CUPTI handed back, kept for its next requests: its pages are then already mapped (guarded by active_lock). */
static uint8_t *spare_buffers[KERNEL_TRACE_SPARE_BUFFERS];
static int spare_count;

/* Calls a CUPTI function; on failure sets an error naming the call and CUPTI's message and jumps to fail. */
#define CUPTI_CHECK(kt, call)                                                                                          \
    do {                                                                                                               \
        CUptiResult status_ = (call);                                                                                  \
        if (status_ != CUPTI_SUCCESS) {                                                                                \
            const char *why_ = NULL;                                                                                   \
            if ((kt)->api.get_result_string) (kt)->api.get_result_string(status_, &why_);                              \
            rc = moert_set_last_error(MOERT_ERR_CUDA, "%s failed: %s (CUPTI error %d)", #call,                         \
                                      why_ ? why_ : "unknown", (int)status_);                                          \
            goto fail;                                                                                                 \
        }                                                                                                              \
    } while (0)

static void CUPTIAPI buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records)
{
    const double t0 = harness_seconds();
    pthread_mutex_lock(&active_lock);
    *buffer = spare_count > 0 ? spare_buffers[--spare_count] : NULL;
    moert_kernel_trace *kt = active_trace;
    pthread_mutex_unlock(&active_lock);
    if (!*buffer) *buffer = aligned_alloc(8, KERNEL_TRACE_BUFFER_BYTES);
    *size = *buffer ? KERNEL_TRACE_BUFFER_BYTES : 0;
    *max_records = 0;
    if (kt) {
        pthread_mutex_lock(&kt->lock);
        kt->callback_s += harness_seconds() - t0;
        pthread_mutex_unlock(&kt->lock);
    }
}

static void keep_kernel(moert_kernel_trace *kt, const CUpti_ActivityKernel10 *k)
{
    if (kt->count == kt->capacity) {
        int64_t capacity = kt->capacity ? 2 * kt->capacity : 4096;
        raw_kernel *grown = realloc(kt->raw, (size_t)capacity * sizeof *grown);
        if (!grown) {
            kt->out_of_memory = true;
            return;
        }
        kt->raw = grown;
        kt->capacity = capacity;
    }
    int64_t grid = (int64_t)k->gridX * k->gridY * k->gridZ;
    kt->raw[kt->count++] = (raw_kernel){.cupti_name = k->name,
                                        .device = (int)k->deviceId,
                                        .stream = k->streamId,
                                        .grid = grid > INT32_MAX ? INT32_MAX : (int32_t)grid,
                                        .start_ns = k->start,
                                        .end_ns = k->end};
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t size, size_t valid)
{
    const double t0 = harness_seconds();
    pthread_mutex_lock(&active_lock);
    moert_kernel_trace *kt = active_trace;
    if (kt) {
        pthread_mutex_lock(&kt->lock);
        CUpti_Activity *record = NULL;
        while (valid > 0 && kt->api.next_record(buffer, valid, &record) == CUPTI_SUCCESS) {
            if (record->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || record->kind == CUPTI_ACTIVITY_KIND_KERNEL)
                keep_kernel(kt, (const CUpti_ActivityKernel10 *)record);
        }
        size_t dropped = 0;
        if (kt->api.dropped && kt->api.dropped(ctx, stream, &dropped) == CUPTI_SUCCESS) kt->dropped += dropped;
        kt->buffers++;
        kt->callback_s += harness_seconds() - t0;
        pthread_mutex_unlock(&kt->lock);
    }
    if (spare_count < KERNEL_TRACE_SPARE_BUFFERS && size == KERNEL_TRACE_BUFFER_BYTES)
        spare_buffers[spare_count++] = buffer;
    else
        free(buffer);
    pthread_mutex_unlock(&active_lock);
}

/* Opens libcupti: the soname of moert's CUDA major first (the loader's path: LD_LIBRARY_PATH, ldconfig), then the
 * CUDA toolkit's usual places. The error lists every path tried. */
static moert_result open_cupti(void)
{
    if (cupti_library) return MOERT_OK;
    char soname[32];
    snprintf(soname, sizeof soname, "libcupti.so.%d", CUPTI_API_VERSION / 10000);
    char tried[2048] = "";
    size_t used = 0;
    const char *homes[] = {getenv("CUDA_HOME"), getenv("CUDA_PATH"), "/usr/local/cuda"};
    const char *subdirs[] = {"extras/CUPTI/lib64", "lib64", "targets/x86_64-linux/lib"};
    char path[1024];
    for (int i = -1; i < 3 * 3 && !cupti_library; i++) {
        if (i < 0) {
            snprintf(path, sizeof path, "%s", soname);
        } else {
            const char *home = homes[i / 3];
            if (!home || !*home) continue;
            snprintf(path, sizeof path, "%s/%s/%s", home, subdirs[i % 3], soname);
        }
        cupti_library = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (!cupti_library && used < sizeof tried)
            used += (size_t)snprintf(tried + used, sizeof tried - used, "%s%s", used ? ", " : "", path);
    }
    if (!cupti_library)
        return moert_set_last_error(MOERT_ERR_NOT_FOUND,
                                    "--trace-kernels: libcupti not found; tried %s (install the CUDA toolkit's "
                                    "CUPTI, or put its folder on LD_LIBRARY_PATH)",
                                    tried);
    return MOERT_OK;
}

static moert_result find_symbols(cupti_api *api)
{
    struct {
        void **slot;
        const char *name;
    } wanted[] = {{(void **)&api->get_version, "cuptiGetVersion"},
                  {(void **)&api->get_result_string, "cuptiGetResultString"},
                  {(void **)&api->register_callbacks, "cuptiActivityRegisterCallbacks"},
                  {(void **)&api->enable, "cuptiActivityEnable"},
                  {(void **)&api->disable, "cuptiActivityDisable"},
                  {(void **)&api->flush_all, "cuptiActivityFlushAll"},
                  {(void **)&api->next_record, "cuptiActivityGetNextRecord"},
                  {(void **)&api->dropped, "cuptiActivityGetNumDroppedRecords"},
                  {(void **)&api->timestamp, "cuptiGetTimestamp"},
                  {(void **)&api->set_attribute, "cuptiActivitySetAttribute"}};
    for (size_t i = 0; i < sizeof wanted / sizeof wanted[0]; i++) {
        *wanted[i].slot = dlsym(cupti_library, wanted[i].name);
        if (!*wanted[i].slot)
            return moert_set_last_error(MOERT_ERR_NOT_FOUND, "--trace-kernels: libcupti has no %s", wanted[i].name);
    }
    return MOERT_OK;
}

moert_result moert_kernel_trace_start(moert_kernel_trace **out)
{
    moert_result rc = MOERT_OK;
    *out = NULL;
    moert_kernel_trace *kt = calloc(1, sizeof *kt);
    if (!kt) return moert_set_last_error(MOERT_ERR_OUT_OF_MEMORY, "the kernel trace");
    pthread_mutex_init(&kt->lock, NULL);
    HARNESS_CHECK(open_cupti());
    HARNESS_CHECK(find_symbols(&kt->api));
    uint32_t version = 0;
    CUPTI_CHECK(kt, kt->api.get_version(&version));
    /* the records are read as this header's structs: the library's major must be the header's */
    if (version / 10000 != CUPTI_API_VERSION / 10000) {
        rc = moert_set_last_error(MOERT_ERR_ABI_MISMATCH,
                                  "--trace-kernels: libcupti has API version %u, moert was built with CUPTI %d "
                                  "(the major versions must match)",
                                  version, CUPTI_API_VERSION);
        goto fail;
    }
    pthread_mutex_lock(&active_lock);
    if (active_trace) {
        pthread_mutex_unlock(&active_lock);
        rc = moert_set_last_error(MOERT_ERR_INVALID_ARGUMENT, "a kernel trace already runs in this process");
        goto fail;
    }
    active_trace = kt;
    pthread_mutex_unlock(&active_lock);
    /* the kernels' records in page-locked host memory rather than on the device: CUPTI need not copy them back */
    uint8_t host_pinned = 1;
    size_t pinned_size = sizeof host_pinned;
    CUPTI_CHECK(kt,
                kt->api.set_attribute(CUPTI_ACTIVITY_ATTR_MEM_ALLOCATION_TYPE_HOST_PINNED, &pinned_size, &host_pinned));
    CUPTI_CHECK(kt, kt->api.register_callbacks(buffer_requested, buffer_completed));
    CUPTI_CHECK(kt, kt->api.enable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL));
    CUPTI_CHECK(kt, kt->api.timestamp(&kt->cupti_start_ns));
    kt->host_start_s = harness_seconds();
    *out = kt;
    return MOERT_OK;
fail:
    moert_kernel_trace_destroy(kt);
    return rc;
}

/* The trace's copies of a CUPTI name, made once per kernel. */
static const kernel_name *intern_name(moert_kernel_trace *kt, const char *cupti_name)
{
    for (int64_t i = 0; i < kt->name_count; i++)
        if (kt->names[i].cupti_name == cupti_name) return &kt->names[i];
    if (kt->name_count == kt->name_capacity) {
        int64_t capacity = kt->name_capacity ? 2 * kt->name_capacity : 64;
        kernel_name *grown = realloc(kt->names, (size_t)capacity * sizeof *grown);
        if (!grown) return NULL;
        kt->names = grown;
        kt->name_capacity = capacity;
    }
    char short_name[KERNEL_TRACE_NAME_MAX];
    moert_kernel_short_name(cupti_name, short_name, sizeof short_name);
    kernel_name n = {
        .cupti_name = cupti_name, .name = strdup(cupti_name ? cupti_name : "?"), .short_name = strdup(short_name)};
    if (!n.name || !n.short_name) {
        free(n.name);
        free(n.short_name);
        return NULL;
    }
    kt->names[kt->name_count] = n;
    return &kt->names[kt->name_count++];
}

moert_result moert_kernel_trace_stop(moert_kernel_trace *kt, const moert_kernel_record **records, int64_t *count)
{
    moert_result rc = MOERT_OK;
    *records = NULL;
    *count = 0;
    CUPTI_CHECK(kt, kt->api.flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED));
    CUPTI_CHECK(kt, kt->api.disable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL));
    CUPTI_CHECK(kt, kt->api.timestamp(&kt->cupti_stop_ns));
    kt->host_stop_s = harness_seconds();
    pthread_mutex_lock(&active_lock);
    active_trace = NULL;
    pthread_mutex_unlock(&active_lock);
    if (kt->dropped > 0) {
        rc = moert_set_last_error(MOERT_ERR_OUT_OF_MEMORY,
                                  "--trace-kernels: CUPTI dropped %zu kernel records (a shorter run, --steps N, "
                                  "records fewer)",
                                  kt->dropped);
        goto fail;
    }
    if (kt->out_of_memory) {
        rc = moert_set_last_error(MOERT_ERR_OUT_OF_MEMORY, "--trace-kernels: keeping %lld kernel records",
                                  (long long)kt->capacity);
        goto fail;
    }
    kt->records = calloc((size_t)(kt->count ? kt->count : 1), sizeof *kt->records);
    HARNESS_CHECK_ALLOC(kt->records);
    /* CUPTI's clock against the host's, read together at start and stop: linear between the two readings */
    const double cupti_span_s = 1e-9 * (double)(kt->cupti_stop_ns - kt->cupti_start_ns);
    const double rate = cupti_span_s > 0.0 ? (kt->host_stop_s - kt->host_start_s) / cupti_span_s : 1.0;
    for (int64_t i = 0; i < kt->count; i++) {
        const raw_kernel *k = &kt->raw[i];
        const kernel_name *n = intern_name(kt, k->cupti_name);
        HARNESS_CHECK_ALLOC(n);
        const double start = 1e-9 * ((double)k->start_ns - (double)kt->cupti_start_ns);
        const double end = 1e-9 * ((double)k->end_ns - (double)kt->cupti_start_ns);
        kt->records[i] = (moert_kernel_record){.name = n->name,
                                               .short_name = n->short_name,
                                               .device = k->device,
                                               .stream = k->stream,
                                               .grid = k->grid,
                                               .start_s = kt->host_start_s + rate * start,
                                               .end_s = kt->host_start_s + rate * end};
    }
    *records = kt->records;
    *count = kt->count;
fail:
    return rc;
}

moert_kernel_trace_stats moert_kernel_trace_stats_of(const moert_kernel_trace *kt)
{
    return (moert_kernel_trace_stats){.kernels = kt->count, .buffers = kt->buffers, .callback_s = kt->callback_s};
}

void moert_kernel_trace_destroy(moert_kernel_trace *kt)
{
    if (!kt) return;
    pthread_mutex_lock(&active_lock);
    if (active_trace == kt) { /* stopped by an error: recording ends here */
        active_trace = NULL;
        pthread_mutex_unlock(&active_lock);
        kt->api.disable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
        kt->api.flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    } else {
        pthread_mutex_unlock(&active_lock);
    }
    for (int64_t i = 0; i < kt->name_count; i++) {
        free(kt->names[i].name);
        free(kt->names[i].short_name);
    }
    free(kt->names);
    free(kt->raw);
    free(kt->records);
    pthread_mutex_destroy(&kt->lock);
    free(kt);
}

#endif
