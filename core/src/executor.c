/* SPDX-License-Identifier: Apache-2.0 */
/* Executor: the sequence of one MoE layer's forward and backward; plugins each own one stage. */
#include "executor.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "error.h"
#include "host.h"
#ifdef MOERT_HAVE_CUDA
#include "cuda/device.h"
#endif
#include "random.h"
#include "tensor_ops.h"

const char *moert_stage_name(moert_stage s)
{
    static const char *const names[MOERT_STAGE_COUNT] = {"router", "permute", "dispatch", "fc1",
                                                         "act",    "fc2",     "combine",  "backward"};
    return (s >= 0 && s < MOERT_STAGE_COUNT) ? names[s] : "unknown";
}

const char *moert_backward_part_name(moert_backward_part p)
{
    static const char *const names[MOERT_BWD_PART_COUNT] = {"recompute",  "combine_bwd", "fc2_dgrad", "fc2_wgrad",
                                                            "act_bwd",    "fc1_dgrad",   "fc1_wgrad", "dispatch_bwd",
                                                            "router_bwd", "wgrad_wait"};
    return (p >= 0 && p < MOERT_BWD_PART_COUNT) ? names[p] : "unknown";
}

static moert_result release_saved(moert_layer *L);
static int64_t used_rows(const moert_layer *L);

double moert_layer_now_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Marks: 0 forward start, 1..7 after router, permute, dispatch, fc1, act, fc2, combine; 8 and 9 backward; then a
 * begin and an end per backward part, then per dispatcher call (dispatcher_call). */
enum {
    MARK_BACKWARD_START = MOERT_STAGE_COUNT,
    MARK_BACKWARD_END = MOERT_STAGE_COUNT + 1,
    MARK_FIRST_PART,
    MARK_FIRST_CALL = MARK_FIRST_PART + 2 * MOERT_BWD_PART_COUNT
};

/* The span names of the dispatcher's calls, by dispatcher_call; past the prefix, the call's name (call_name). */
#define DISPATCHER_SPAN_PREFIX "dispatcher."
static const char *const dispatcher_call_spans[MOERT_DISPATCHER_CALLS] = {
    DISPATCHER_SPAN_PREFIX "prepare", DISPATCHER_SPAN_PREFIX "dispatch", DISPATCHER_SPAN_PREFIX "combine",
    DISPATCHER_SPAN_PREFIX "combine_backward", DISPATCHER_SPAN_PREFIX "dispatch_backward"};
#define call_name(call) (dispatcher_call_spans[call] + sizeof DISPATCHER_SPAN_PREFIX - 1)

/* Marks the time on `stream` (a CUDA event on GPUs), and on the host's clock where the host reaches the mark. */
static moert_result mark_on(moert_layer *L, int mark, moert_stream stream)
{
    L->mark_seconds[mark] = moert_layer_now_seconds();
    if (mark == 0) L->host_marks_valid = !L->capturing; /* a forward begins */
#ifdef MOERT_HAVE_CUDA
    if (L->info.device.type == MOERT_DEVICE_CUDA) {
        if (!L->mark_events[mark]) {
            moert_result rc = moert_cuda_event_create(L->info.device.id, true, &L->mark_events[mark]);
            if (rc != MOERT_OK) return rc;
        }
        if (L->capturing) return moert_cuda_event_record_captured(L->mark_events[mark], stream);
        return moert_cuda_event_record(L->mark_events[mark], stream);
    }
#endif
    (void)stream;
    return MOERT_OK;
}

static moert_result stage_mark(moert_layer *L, int mark) { return mark_on(L, mark, L->stream); }

/* Lets the other half of a merged forward and backward issue its next stages (core/src/overlap.c). */
static void yield_point(moert_layer *L)
{
    if (L->yield) L->yield(L->yield_ctx);
}

/* The begin and end of backward part p, on the stream it runs on. */
static moert_result part_begin(moert_layer *L, moert_backward_part p, moert_stream stream)
{
    L->backward_part_ran[p] = true;
    L->backward_part_on_side[p] = stream != L->stream;
    return mark_on(L, MARK_FIRST_PART + 2 * p, stream);
}

static moert_result part_end(moert_layer *L, moert_backward_part p, moert_stream stream)
{
    return mark_on(L, MARK_FIRST_PART + 2 * p + 1, stream);
}

/* Seconds between two marks. */
static moert_result mark_interval(moert_layer *L, int from, int to, double *out)
{
#ifdef MOERT_HAVE_CUDA
    if (L->info.device.type == MOERT_DEVICE_CUDA) {
        float ms = 0.0f;
        moert_result rc = moert_cuda_event_elapsed_ms(L->mark_events[from], L->mark_events[to], &ms);
        *out = 1e-3 * ms;
        return rc;
    }
#endif
    *out = L->mark_seconds[to] - L->mark_seconds[from];
    return MOERT_OK;
}

/* Seconds from `origin`'s forward start to mark `mark` of L (both recorded in this micro-batch). */
static moert_result mark_offset(const moert_layer *L, const moert_layer *origin, int mark, double *out)
{
#ifdef MOERT_HAVE_CUDA
    if (L->info.device.type == MOERT_DEVICE_CUDA) {
        float ms = 0.0f;
        moert_result rc = moert_cuda_event_elapsed_ms(origin->mark_events[0], L->mark_events[mark], &ms);
        *out = 1e-3 * ms;
        return rc;
    }
#endif
    *out = L->mark_seconds[mark] - origin->mark_seconds[0];
    return MOERT_OK;
}

/* One host span from mark `from` to mark `to`, against origin's forward start on the host's clock. */
static moert_layer_span host_span(const moert_layer *L, const moert_layer *origin, const char *name, int from, int to)
{
    return (moert_layer_span){.name = name,
                              .stream = "host",
                              .start_s = L->mark_seconds[from] - origin->mark_seconds[0],
                              .dur_s = L->mark_seconds[to] - L->mark_seconds[from]};
}

/* The host's spans of the last forward and backward: how long the host took to issue each forward stage, backward
 * part and dispatcher call, from reaching its begin mark to reaching its end mark (its waits on the host included).
 * Returns how many it wrote (at most MOERT_LAYER_DEVICE_SPANS). */
static int host_spans(const moert_layer *L, const moert_layer *origin, moert_layer_span *out)
{
    int n = 0;
    for (int s = 0; s < MOERT_STAGE_COUNT - 1; s++)
        out[n++] = host_span(L, origin, moert_stage_name((moert_stage)s), s, s + 1);
    for (int p = 0; p < MOERT_BWD_PART_COUNT; p++)
        if (L->backward_part_ran[p])
            out[n++] = host_span(L, origin, moert_backward_part_name((moert_backward_part)p), MARK_FIRST_PART + 2 * p,
                                 MARK_FIRST_PART + 2 * p + 1);
    for (int c = 0; c < MOERT_DISPATCHER_CALLS; c++)
        if (L->dispatcher_call_ran[c])
            out[n++] =
                host_span(L, origin, dispatcher_call_spans[c], MARK_FIRST_CALL + 2 * c, MARK_FIRST_CALL + 2 * c + 1);
    return n;
}

moert_result moert_layer_spans(const moert_layer *L, const moert_layer *origin, moert_layer_span *out, int *count)
{
    moert_result rc = MOERT_OK;
    int n = 0;
    for (int s = 0; s < MOERT_STAGE_COUNT - 1; s++) {
        moert_layer_span *sp = &out[n++];
        *sp = (moert_layer_span){
            .name = moert_stage_name((moert_stage)s), .stream = "compute", .dur_s = L->stage_seconds[s]};
        MOERT_CHECK(mark_offset(L, origin, s, &sp->start_s));
    }
    for (int p = 0; p < MOERT_BWD_PART_COUNT; p++) {
        if (!L->backward_part_ran[p]) continue;
        moert_layer_span *sp = &out[n++];
        *sp = (moert_layer_span){.name = moert_backward_part_name((moert_backward_part)p),
                                 .stream = L->backward_part_on_side[p] ? "wgrad" : "compute",
                                 .dur_s = L->backward_part_seconds[p]};
        MOERT_CHECK(mark_offset(L, origin, MARK_FIRST_PART + 2 * p, &sp->start_s));
    }
    for (int c = 0; c < MOERT_DISPATCHER_CALLS; c++) {
        if (!L->dispatcher_call_ran[c]) continue;
        moert_layer_span *sp = &out[n++];
        *sp = (moert_layer_span){
            .name = dispatcher_call_spans[c], .stream = "dispatcher", .dur_s = L->dispatcher_call_seconds[c]};
        MOERT_CHECK(mark_offset(L, origin, MARK_FIRST_CALL + 2 * c, &sp->start_s));
    }
    if (L->host_marks_valid && origin->host_marks_valid) n += host_spans(L, origin, out + n);
fail:
    *count = n;
    return rc;
}

moert_result moert_layer_collect_times(moert_layer *L)
{
    moert_result rc = MOERT_OK;
#ifdef MOERT_HAVE_CUDA
    if (L->info.device.type == MOERT_DEVICE_CUDA) {
        MOERT_CHECK(moert_cuda_event_synchronize(L->mark_events[MARK_BACKWARD_END]));
        /* parts on the wgrad stream may end after the backward ($.parallel.defer_wgrad_join) */
        for (int p = 0; p < MOERT_BWD_PART_COUNT; p++)
            if (L->backward_part_ran[p] && L->backward_part_on_side[p])
                MOERT_CHECK(moert_cuda_event_synchronize(L->mark_events[MARK_FIRST_PART + 2 * p + 1]));
    }
#endif
    for (int s = 0; s < MOERT_STAGE_COUNT - 1; s++) MOERT_CHECK(mark_interval(L, s, s + 1, &L->stage_seconds[s]));
    MOERT_CHECK(mark_interval(L, MARK_BACKWARD_START, MARK_BACKWARD_END, &L->stage_seconds[MOERT_STAGE_BACKWARD]));
    for (int p = 0; p < MOERT_BWD_PART_COUNT; p++) {
        L->backward_part_seconds[p] = 0.0;
        if (L->backward_part_ran[p])
            MOERT_CHECK(
                mark_interval(L, MARK_FIRST_PART + 2 * p, MARK_FIRST_PART + 2 * p + 1, &L->backward_part_seconds[p]));
    }
    for (int c = 0; c < MOERT_DISPATCHER_CALLS; c++) {
        L->dispatcher_call_seconds[c] = 0.0;
        if (L->dispatcher_call_ran[c])
            MOERT_CHECK(
                mark_interval(L, MARK_FIRST_CALL + 2 * c, MARK_FIRST_CALL + 2 * c + 1, &L->dispatcher_call_seconds[c]));
    }
fail:
    return rc;
}

/* The capability flags of one plugin instance: what it declared through host->set_flags, else its header's. */
static uint32_t instance_flags(const moert_instance *inst)
{
    return moert_host_instance_flags(inst->host, inst->plugin->header->flags);
}

moert_result moert_layer_plugin_failed(const moert_layer *L, const moert_instance *inst, const char *fn,
                                       moert_result rc)
{
    const char *msg = moert_host_take_error(inst->host);
    return moert_error(rc, "%s \"%s\" %s failed (layer %d, rank %d): %s%s%s", moert_kind_name(inst->plugin->kind),
                       inst->plugin->header->name, fn, L->info.layer_index, L->core_host->rank, moert_result_name(rc),
                       *msg ? ": " : "", msg);
}

#define PLUGIN_CALL(inst, fn, call)                                                                                    \
    do {                                                                                                               \
        rc = (call);                                                                                                   \
        if (rc != MOERT_OK) {                                                                                          \
            rc = moert_layer_plugin_failed(L, &(inst), fn, rc);                                                        \
            goto fail;                                                                                                 \
        }                                                                                                              \
    } while (0)

#define ROUTER(L)     ((const moert_router_v1 *)(L)->router.plugin->header)
#define DISPATCHER(L) ((const moert_dispatcher_v1 *)(L)->dispatcher.plugin->header)
#define PRECISION(L)  ((const moert_precision_v1 *)(L)->precision.plugin->header)
#define MEMORY(L)     ((const moert_memory_policy_v1 *)(L)->memory.plugin->header)

/* The dispatcher's five calls that take a stream, for call_dispatcher. */
typedef enum dispatcher_call {
    CALL_PREPARE, /* on L->topk_idx into L->layout (args unused) */
    CALL_DISPATCH,
    CALL_COMBINE,
    CALL_COMBINE_BACKWARD,
    CALL_DISPATCH_BACKWARD
} dispatcher_call;

/* Makes `waiter` wait for the work queued on `s` so far, through event e (CUDA: the overlap's fences around a
 * dispatcher call). */
static moert_result fence(const moert_layer *L, moert_event e, moert_stream s, moert_stream waiter, const char *what,
                          const char *fn)
{
#ifdef MOERT_HAVE_CUDA
    moert_result rc = moert_cuda_event_record(e, s);
    if (rc == MOERT_OK) rc = moert_cuda_stream_wait_event(waiter, e);
    if (rc != MOERT_OK)
        moert_error_prefix("micro-batch overlap: %s the dispatcher's %s (layer %d, rank %d)", what, fn,
                           L->info.layer_index, L->core_host->rank);
    return rc;
#else
    (void)L;
    (void)e;
    (void)s;
    (void)waiter;
    (void)what;
    (void)fn;
    return MOERT_OK;
#endif
}

/* Sets the SM-yield word on stream s, the dispatcher call's ($.parallel.overlap_comm_sms, CUDA): to the SMs the call
 * needs before it (on), so that the other slot's persistent GEMMs leave them free, and back to 0 after it. */
static moert_result sm_yield_set(const moert_layer *L, const moert_comm_stream *comm, moert_stream s, bool on,
                                 const char *fn)
{
#ifdef MOERT_HAVE_CUDA
    const int from = on ? MOERT_SM_YIELD_SMS : MOERT_SM_YIELD_ZERO;
    moert_result rc = moert_cuda_write_word_async(&comm->sm_yield[MOERT_SM_YIELD_WORD], on ? comm->sm_yield_sms : 0,
                                                  &comm->sm_yield[from], s);
    if (rc != MOERT_OK)
        moert_error_prefix("micro-batch overlap: %s the GEMMs' SM yield %s the dispatcher's %s (layer %d, rank %d)",
                           on ? "setting" : "clearing", on ? "before" : "after", fn, L->info.layer_index,
                           L->core_host->rank);
    return rc;
#else
    (void)L;
    (void)comm;
    (void)s;
    (void)on;
    (void)fn;
    return MOERT_OK;
#endif
}

/* Calls the dispatcher. Its stream is the layer's compute stream, or with micro-batch overlap on GPUs (L->comm) the
 * rank's one communication stream, fenced with the compute stream on both sides: the call sees the slot's work so far
 * and the slot's later work sees the call's, and the instance allocates on the communication stream meanwhile (its
 * buffers are used there). Every dispatcher call of both slots then runs in the order the host issued them, which is
 * the same on every rank, so kernels that spin until their peers' arrive (deepep, hybridep) cannot end up waiting on
 * each other from two streams while a GEMM holds the rest of the GPU. Not while capturing a CUDA graph: the pool keeps
 * only the compute stream's blocks for the graphs, so the calls stay there. With the SM-yield words (comm->sm_yield)
 * the call is bracketed on the communication stream by setting the word the GEMMs read to $.parallel.overlap_comm_sms
 * and back to 0, the latter after a failed call too, so the GEMMs never stay yielding. With
 * $.parallel.overlap_prepare_own_stream (the default) a dispatcher whose header declares MOERT_CAP_PREPARE_OWN_STREAM
 * (its prepare() exchanges the counts through the host, with no peer-waiting kernel or collective on its stream) gets
 * prepare() on the slot's compute stream instead, bracketed by the SM-yield words there: its counting kernels and its
 * host wait then follow only the slot's own work, not the other slot's all-to-all queued before it on the
 * communication stream (the dispatch after it, on the communication stream, is fenced after the compute stream's work
 * as every call is). */
static moert_result call_dispatcher(moert_layer *L, dispatcher_call call, const void *args)
{
    const moert_dispatcher_v1 *d = DISPATCHER(L);
    void *ctx = L->dispatcher.ctx;
    const moert_comm_stream *yield = L->capturing || !L->comm || !L->comm->sm_yield ? NULL : L->comm;
    const moert_comm_stream *comm = L->capturing ? NULL : L->comm;
    if (call == CALL_PREPARE && L->overlap_prepare_own_stream && (d->header.flags & MOERT_CAP_PREPARE_OWN_STREAM))
        comm = NULL;
    const moert_stream s = comm ? comm->stream : L->stream;
    moert_stream before = NULL;
    moert_result rc = MOERT_OK, rc_leave = MOERT_OK;
    if (comm) {
        MOERT_CHECK(fence(L, comm->enter, L->stream, s, "ordering the communication stream before", call_name(call)));
        before = moert_host_use_stream(L->dispatcher.host, s);
    }
    if (yield) MOERT_CHECK(sm_yield_set(L, yield, s, true, call_name(call)));
    L->dispatcher_call_ran[call] = false;
    MOERT_CHECK(mark_on(L, MARK_FIRST_CALL + 2 * call, s)); /* the call's own span, on its stream */
    switch (call) {
    case CALL_PREPARE: rc = d->prepare(ctx, s, &L->topk_idx, &L->layout); break;
    case CALL_DISPATCH: rc = d->dispatch(ctx, s, args); break;
    case CALL_COMBINE: rc = d->combine(ctx, s, args); break;
    case CALL_COMBINE_BACKWARD: rc = d->combine_backward(ctx, s, args); break;
    case CALL_DISPATCH_BACKWARD: rc = d->dispatch_backward(ctx, s, args); break;
    }
    if (rc == MOERT_OK && (rc_leave = mark_on(L, MARK_FIRST_CALL + 2 * call + 1, s)) == MOERT_OK)
        L->dispatcher_call_ran[call] = true;
    /* after a failure too: the GEMMs get their SMs back, and the compute stream stays ordered after whatever the call
     * queued (the plugin's message is kept in its host until taken below) */
    if (yield) {
        moert_result rc_yield = sm_yield_set(L, yield, s, false, call_name(call));
        if (rc_leave == MOERT_OK) rc_leave = rc_yield;
    }
    if (comm) {
        moert_host_use_stream(L->dispatcher.host, before);
        moert_result rc_fence =
            fence(L, comm->leave, s, L->stream, "ordering the compute stream after", call_name(call));
        if (rc_leave == MOERT_OK) rc_leave = rc_fence;
    }
    if (rc != MOERT_OK) return moert_layer_plugin_failed(L, &L->dispatcher, call_name(call), rc);
    rc = rc_leave;
fail:
    return rc;
}

/* A zeroed tensor on the layer's device. */
static moert_result tensor_alloc(moert_layer *L, moert_tensor *t, moert_dtype dtype, int ndim, int64_t d0, int64_t d1,
                                 int64_t d2)
{
    int64_t shape[3] = {d0, d1, d2};
    *t = moert_tensor_make(NULL, L->info.device, dtype, ndim, shape);
    size_t bytes = moert_tensor_bytes(t);
    void *p = NULL;
    moert_result rc = L->core_host->alloc(L->core_host, L->info.device, bytes ? bytes : 1, &p);
    if (rc != MOERT_OK)
        return moert_error(rc, "allocating %zu bytes for layer %d: %s", bytes, L->info.layer_index,
                           moert_host_take_error((moert_host *)L->core_host));
    t->data = p;
    return MOERT_OK;
}

static void tensor_release(moert_layer *L, moert_tensor *t)
{
    if (t->data) L->core_host->free(L->core_host, t->device, t->data);
    t->data = NULL;
}

/* Shapes of the parameters ([E,H], [El,H,2F], [El,F,H], the shared expert's [1,H,2Fs], [1,Fs,H], [1,H]; an absent
 * one has a 0 extent; F is the rank's shard of the experts' width, F/ETP), their initial standard deviations (of the
 * whole experts, the same for any split). */
static void param_shapes(const moert_layer_info *in, int etp_size, int64_t shared_ffn, bool gate,
                         int64_t shapes[MOERT_PARAM_COUNT][3], int ndims[MOERT_PARAM_COUNT],
                         double stds[MOERT_PARAM_COUNT])
{
    const int64_t s[MOERT_PARAM_COUNT][3] = {{in->num_experts, in->hidden, 0},
                                             {in->num_local_experts, in->hidden, 2 * in->ffn_hidden},
                                             {in->num_local_experts, in->ffn_hidden, in->hidden},
                                             {1, in->hidden, 2 * shared_ffn},
                                             {1, shared_ffn, in->hidden},
                                             {1, gate ? in->hidden : 0, 0}};
    memcpy(shapes, s, sizeof s);
    ndims[0] = 2;
    ndims[1] = ndims[2] = 3;
    ndims[3] = ndims[4] = 3;
    ndims[5] = 2;
    stds[0] = 1.0 / sqrt((double)in->hidden);
    stds[1] = 1.0 / sqrt((double)in->hidden);
    /* the whole width: F/ETP times ETP (etp_size 0 in a layer made without a stack: 1) */
    stds[2] = 0.5 / sqrt((double)(in->ffn_hidden * (etp_size > 1 ? etp_size : 1)));
    stds[3] = 1.0 / sqrt((double)in->hidden);
    stds[4] = shared_ffn > 0 ? 0.5 / sqrt((double)shared_ffn) : 0.0;
    stds[5] = 1.0 / sqrt((double)in->hidden);
}

bool moert_layer_has_param(const moert_layer *L, moert_param_id which)
{
    if (which == MOERT_PARAM_SHARED_FC1 || which == MOERT_PARAM_SHARED_FC2) return L->shared_ffn > 0;
    if (which == MOERT_PARAM_SHARED_GATE) return L->shared_ffn > 0 && L->shared_gate;
    return which >= 0 && which < MOERT_PARAM_COUNT;
}

moert_tensor moert_layer_param_desc(const moert_layer *L, moert_param_id which)
{
    int64_t shapes[MOERT_PARAM_COUNT][3];
    int ndims[MOERT_PARAM_COUNT];
    double stds[MOERT_PARAM_COUNT];
    param_shapes(&L->info, L->etp_size, L->shared_ffn, L->shared_gate, shapes, ndims, stds);
    return moert_tensor_make(NULL, L->info.device, L->param_dtype, ndims[which], shapes[which]);
}

/* Fills `n` elements at `at` (of `value`'s dtype and device) with the elements [first, first + n) of the generator's
 * stream: a contiguous run of a global tensor. */
static moert_result fill_run(moert_layer *L, const moert_tensor *value, int64_t at, int64_t n, uint64_t seed,
                             uint64_t stream, int64_t first, double std)
{
    moert_tensor run = moert_tensor_1d((char *)value->data + (size_t)at * moert_dtype_size(value->dtype), value->device,
                                       value->dtype, n);
    return moert_fill_normal_on(L->stream, &run, seed, stream, (uint64_t)first, std);
}

/* ETP > 1: the rank's shard of the global expert weights, element for element the values the unsplit experts have.
 * fc1 [El, H, 2F/ETP] holds, per row, the gate columns [j F/ETP, (j+1) F/ETP) of the global [.., 2F] row, then the
 * up columns of the same range (j the ETP rank); fc2 [El, F/ETP, H] the rows of that range. */
static moert_result fill_expert_shard(moert_layer *L, int p, uint64_t seed, uint64_t stream, double std)
{
    moert_result rc = MOERT_OK;
    const moert_layer_info *in = &L->info;
    const moert_tensor *value = &L->params[p].value;
    const int64_t fl = in->ffn_hidden, f = fl * L->etp_size, h = in->hidden, j = L->etp_rank;
    for (int64_t e = 0; e < in->num_local_experts; e++) {
        const int64_t global_e = in->first_local_expert + e;
        if (p == MOERT_PARAM_FC2) {
            MOERT_CHECK(fill_run(L, value, e * fl * h, fl * h, seed, stream, (global_e * f + j * fl) * h, std));
            continue;
        }
        for (int64_t row = 0; row < h; row++) {
            const int64_t local_row = (e * h + row) * 2 * fl, global_row = (global_e * h + row) * 2 * f;
            MOERT_CHECK(fill_run(L, value, local_row, fl, seed, stream, global_row + j * fl, std));
            MOERT_CHECK(fill_run(L, value, local_row + fl, fl, seed, stream, global_row + f + j * fl, std));
        }
    }
fail:
    return rc;
}

moert_result moert_layer_fill_params(moert_layer *L, uint64_t seed)
{
    moert_result rc = MOERT_OK;
    const moert_layer_info *in = &L->info;
    int64_t shapes[MOERT_PARAM_COUNT][3];
    int ndims[MOERT_PARAM_COUNT];
    double stds[MOERT_PARAM_COUNT];
    param_shapes(in, L->etp_size, L->shared_ffn, L->shared_gate, shapes, ndims, stds);
    for (int p = 0; p < MOERT_PARAM_COUNT; p++) {
        if (!moert_layer_has_param(L, (moert_param_id)p)) continue;
        /* routed experts' weights start at the first local expert's global offset (ETP shards pick their columns out
         * of the global tensor); the router's and the shared expert's are the same on every rank */
        bool routed = p == MOERT_PARAM_FC1 || p == MOERT_PARAM_FC2;
        uint64_t first = routed ? (uint64_t)(in->first_local_expert * shapes[p][1] * shapes[p][2]) : 0;
        uint64_t stream = p < MOERT_PARAM_SHARED_FC1
                              ? MOERT_STREAM_PARAM + 4 * (uint64_t)in->layer_index + (uint64_t)p
                              : MOERT_STREAM_SHARED_PARAM + 4 * (uint64_t)in->layer_index + (uint64_t)(p - 3);
        if (routed && L->etp_size > 1)
            MOERT_CHECK(fill_expert_shard(L, p, seed, stream, stds[p]));
        else
            MOERT_CHECK(moert_fill_normal_on(L->stream, &L->params[p].value, seed, stream, first, stds[p]));
    }
fail:
    return rc;
}

moert_result moert_layer_init_params(moert_layer *L, uint64_t seed)
{
    moert_result rc = MOERT_OK;
    for (int p = 0; p < MOERT_PARAM_COUNT; p++) {
        moert_param *pr = &L->params[p];
        moert_tensor d = moert_layer_param_desc(L, (moert_param_id)p);
        if (!moert_layer_has_param(L, (moert_param_id)p)) {
            pr->value = pr->grad = d; /* empty: data NULL */
            continue;
        }
        MOERT_CHECK(tensor_alloc(L, &pr->value, d.dtype, d.ndim, d.shape[0], d.shape[1], d.ndim > 2 ? d.shape[2] : 0));
        MOERT_CHECK(tensor_alloc(L, &pr->grad, d.dtype, d.ndim, d.shape[0], d.shape[1], d.ndim > 2 ? d.shape[2] : 0));
    }
    MOERT_CHECK(moert_layer_fill_params(L, seed));
fail:
    return rc;
}

/* A failed host service call as a core error naming what the executor was doing (and the activation, if any:
 * a < MOERT_ACT_COUNT). */
static moert_result host_failed(const moert_layer *L, moert_result rc, const char *what, moert_activation a)
{
    return moert_host_call_failed(L->core_host, rc, what, a < MOERT_ACT_COUNT ? moert_activation_name(a) : NULL,
                                  L->info.layer_index);
}

#define HOST_CALL(call, what, a)                                                                                       \
    do {                                                                                                               \
        rc = (call);                                                                                                   \
        if (rc != MOERT_OK) {                                                                                          \
            rc = host_failed(L, rc, what, a);                                                                          \
            goto fail;                                                                                                 \
        }                                                                                                              \
    } while (0)

/* ---- expert tensor parallelism (ETP > 1; docs/parallel.md) ----
 *
 * The ETP ranks of a group hold the same experts, each a shard of their FFN width, and each has its own dispatched
 * rows. The experts compute on every ETP rank's rows: after the dispatch they are gathered over the group and grouped
 * by local expert (each expert's rows in ETP rank order); fc2's partial outputs, and in the backward the partial row
 * and prob gradients, are summed back over the group onto the rank that dispatched each row. The exchanges go through
 * the group's services (L->etp_host): host memory over its view on the CPU, NCCL on the layer's stream on GPUs; the
 * counts are exchanged on the host. */

static bool etp_on(const moert_layer *L) { return L->etp_size > 1; }

/* Rows the experts compute on: the dispatcher's capacity, or with ETP every ETP rank's rows. */
static int64_t expert_rows(const moert_layer *L) { return etp_on(L) ? L->expert_rows : L->layout.capacity; }

/* Rows of ETP rank j's dispatcher. */
static int64_t etp_rows_of(const moert_layer *L, int j)
{
    int64_t rows = 0;
    for (int64_t e = 0; e < L->info.num_local_experts; e++) rows += L->etp_counts[j * L->info.num_local_experts + e];
    return rows;
}

/* A call of the ETP group's services as a core error naming what the executor was doing. */
#define ETP_CALL(call, what)                                                                                           \
    do {                                                                                                               \
        rc = (call);                                                                                                   \
        if (rc != MOERT_OK) {                                                                                          \
            rc = moert_host_call_failed(L->etp_host, rc, what, NULL, L->info.layer_index);                             \
            goto fail;                                                                                                 \
        }                                                                                                              \
    } while (0)

/* The dispatcher's rows per local expert on the host (copied from the device when it gives them only there). */
static moert_result etp_local_counts(moert_layer *L, int64_t *out)
{
    moert_result rc = MOERT_OK;
    const moert_host *h = L->core_host;
    const size_t bytes = (size_t)L->info.num_local_experts * sizeof(int64_t);
    if (L->layout.tokens_per_expert_host) {
        memcpy(out, L->layout.tokens_per_expert_host, bytes);
        return MOERT_OK;
    }
    HOST_CALL(h->memcpy_async(h, out, moert_cpu(), L->layout.tokens_per_expert.data, L->layout.tokens_per_expert.device,
                              bytes, L->stream),
              "copying the rows per expert to the host", MOERT_ACT_COUNT);
    HOST_CALL(h->stream_synchronize(h, L->stream), "copying the rows per expert to the host", MOERT_ACT_COUNT);
fail:
    return rc;
}

/* After prepare: every ETP rank's rows per local expert (an allgather over the group), their sums and the blocks'
 * offsets in both orders; on GPUs the sums go to the device too, for the grouped GEMMs. */
static moert_result etp_gather_counts(moert_layer *L)
{
    moert_result rc = MOERT_OK;
    const int n = L->etp_size;
    const int64_t el = L->info.num_local_experts;
    const moert_host *h = L->core_host;
    const bool device = L->info.device.type != MOERT_DEVICE_CPU;
    int64_t *mine = NULL;
    if (!L->etp_counts) {
        L->etp_counts = calloc((size_t)(n * el), sizeof *L->etp_counts);
        L->etp_rank_major = calloc((size_t)(n * el), sizeof *L->etp_rank_major);
        L->etp_expert_major = calloc((size_t)(n * el), sizeof *L->etp_expert_major);
        L->expert_counts_host = calloc((size_t)el, sizeof *L->expert_counts_host);
        MOERT_CHECK_ALLOC(L->etp_counts);
        MOERT_CHECK_ALLOC(L->etp_rank_major);
        MOERT_CHECK_ALLOC(L->etp_expert_major);
        MOERT_CHECK_ALLOC(L->expert_counts_host);
    }
    if (device && !L->expert_counts.data) MOERT_CHECK(tensor_alloc(L, &L->expert_counts, MOERT_I64, 1, el, 0, 0));
    mine = malloc((size_t)el * sizeof *mine);
    MOERT_CHECK_ALLOC(mine);
    MOERT_CHECK(etp_local_counts(L, mine));
    ETP_CALL(L->etp_host->allgather(L->etp_host, mine, L->etp_counts, (size_t)el * sizeof(int64_t), moert_cpu(), NULL),
             "gathering the rows per expert over the expert-tensor-parallel group");
    int64_t at = 0;
    for (int j = 0; j < n; j++)
        for (int64_t e = 0; e < el; e++) {
            L->etp_rank_major[j * el + e] = at;
            at += L->etp_counts[j * el + e];
        }
    at = 0;
    for (int64_t e = 0; e < el; e++) {
        L->expert_counts_host[e] = 0;
        for (int j = 0; j < n; j++) {
            L->etp_expert_major[j * el + e] = at;
            at += L->etp_counts[j * el + e];
            L->expert_counts_host[e] += L->etp_counts[j * el + e];
        }
    }
    L->expert_rows = at;
    if (device) /* from pageable memory: the host buffer may change once the call returns */
        HOST_CALL(h->memcpy_async(h, L->expert_counts.data, L->info.device, L->expert_counts_host, moert_cpu(),
                                  (size_t)el * sizeof(int64_t), L->stream),
                  "copying the experts' rows per expert to the device", MOERT_ACT_COUNT);
    else
        L->expert_counts = moert_tensor_1d(L->expert_counts_host, L->info.device, MOERT_I64, el);
fail:
    free(mine);
    return rc;
}

/* The bytes of one row of a [rows, cols] or [rows] tensor. */
static size_t row_bytes_of(const moert_tensor *t)
{
    return (t->ndim > 1 ? (size_t)t->shape[1] : 1) * moert_dtype_size(t->dtype);
}

/* Copies `rows` rows of `rb` bytes on the layer's device, in stream order. */
static moert_result etp_copy_rows(moert_layer *L, void *dst, const void *src, int64_t rows, size_t rb)
{
    moert_result rc = MOERT_OK;
    const moert_host *h = L->core_host;
    if (rows <= 0) return MOERT_OK;
    HOST_CALL(h->memcpy_async(h, dst, L->info.device, src, L->info.device, (size_t)rows * rb, L->stream),
              "regrouping the expert-tensor-parallel rows", MOERT_ACT_COUNT);
fail:
    return rc;
}

/* gathered (the experts' rows, grouped by local expert) from every ETP rank's `local` (its dispatcher's rows): each
 * rank sends its rows to every rank of the group, and the blocks are put in expert order. */
static moert_result etp_gather_rows(moert_layer *L, const moert_tensor *local, moert_tensor *gathered)
{
    moert_result rc = MOERT_OK;
    const int n = L->etp_size, me = L->etp_rank;
    const int64_t el = L->info.num_local_experts;
    const size_t rb = row_bytes_of(local);
    moert_tensor staging = {0};
    size_t *sizes = calloc(4 * (size_t)n, sizeof *sizes);
    MOERT_CHECK_ALLOC(sizes);
    MOERT_CHECK(tensor_alloc(L, &staging, local->dtype, 1,
                             L->expert_rows * (int64_t)(rb / moert_dtype_size(local->dtype)), 0, 0));
    size_t *sb = sizes, *so = sizes + n, *recv_b = sizes + 2 * n, *ro = sizes + 3 * n;
    for (int j = 0; j < n; j++) {
        sb[j] = (size_t)etp_rows_of(L, me) * rb;
        so[j] = 0;
        recv_b[j] = (size_t)etp_rows_of(L, j) * rb;
        ro[j] = (size_t)L->etp_rank_major[j * el] * rb;
    }
    ETP_CALL(
        L->etp_host->alltoallv(L->etp_host, local->data, sb, so, staging.data, recv_b, ro, L->info.device, L->stream),
        "gathering the rows over the expert-tensor-parallel group");
    for (int j = 0; j < n; j++)
        for (int64_t e = 0; e < el; e++) {
            const int64_t b = j * el + e;
            MOERT_CHECK(etp_copy_rows(L, (char *)gathered->data + (size_t)L->etp_expert_major[b] * rb,
                                      (char *)staging.data + (size_t)L->etp_rank_major[b] * rb, L->etp_counts[b], rb));
        }
fail:
    tensor_release(L, &staging);
    free(sizes);
    return rc;
}

/* local = the sum of the n parts of `count` elements laid one after the other in `parts`, in part order: in double on
 * the CPU, by element-wise adds on GPUs. */
static moert_result etp_sum_parts(moert_layer *L, const void *parts, int n, int64_t count, moert_dtype dtype,
                                  moert_tensor *local)
{
    moert_result rc = MOERT_OK;
    if (count == 0) return MOERT_OK;
    const size_t bytes = (size_t)count * moert_dtype_size(dtype);
    moert_tensor out = moert_tensor_1d(local->data, local->device, dtype, count);
    if (L->info.device.type == MOERT_DEVICE_CPU) {
        const moert_tensor all = moert_tensor_1d((void *)parts, moert_cpu(), dtype, n * count);
        for (int64_t i = 0; i < count; i++) {
            double sum = 0.0;
            for (int j = 0; j < n; j++) sum += moert_load(&all, j * count + i);
            moert_store(&out, i, sum);
        }
        return MOERT_OK;
    }
    for (int j = 0; j < n; j++) {
        const moert_tensor part = moert_tensor_1d((char *)parts + (size_t)j * bytes, local->device, dtype, count);
        if (j == 0)
            MOERT_CHECK(moert_copy(L->stream, &part, &out));
        else
            MOERT_CHECK(moert_add(L->stream, &out, &part, &out));
    }
fail:
    return rc;
}

/* The adjoint of etp_gather_rows for partial sums: `local`'s rows (this rank's dispatched rows) get the sum, over the
 * ETP ranks in rank order, of their rows in each rank's `gathered` (partial fc2 outputs, or partial gradients). */
static moert_result etp_reduce_scatter_rows(moert_layer *L, const moert_tensor *gathered, moert_tensor *local)
{
    moert_result rc = MOERT_OK;
    const int n = L->etp_size, me = L->etp_rank;
    const int64_t el = L->info.num_local_experts, mine = etp_rows_of(L, me);
    const size_t rb = row_bytes_of(gathered);
    const int64_t cols = (int64_t)(rb / moert_dtype_size(gathered->dtype));
    moert_tensor send = {0}, recv = {0};
    size_t *sizes = calloc(4 * (size_t)n, sizeof *sizes);
    MOERT_CHECK_ALLOC(sizes);
    MOERT_CHECK(tensor_alloc(L, &send, gathered->dtype, 1, L->expert_rows * cols, 0, 0));
    MOERT_CHECK(tensor_alloc(L, &recv, gathered->dtype, 1, n * mine * cols, 0, 0));
    for (int j = 0; j < n; j++) /* ranks one after the other, each rank's rows in its own order */
        for (int64_t e = 0; e < el; e++) {
            const int64_t b = j * el + e;
            MOERT_CHECK(etp_copy_rows(L, (char *)send.data + (size_t)L->etp_rank_major[b] * rb,
                                      (const char *)gathered->data + (size_t)L->etp_expert_major[b] * rb,
                                      L->etp_counts[b], rb));
        }
    size_t *sb = sizes, *so = sizes + n, *recv_b = sizes + 2 * n, *ro = sizes + 3 * n;
    for (int j = 0; j < n; j++) {
        sb[j] = (size_t)etp_rows_of(L, j) * rb;
        so[j] = (size_t)L->etp_rank_major[j * el] * rb;
        recv_b[j] = (size_t)mine * rb;
        ro[j] = (size_t)(j * mine) * rb;
    }
    ETP_CALL(L->etp_host->alltoallv(L->etp_host, send.data, sb, so, recv.data, recv_b, ro, L->info.device, L->stream),
             "summing the partial rows over the expert-tensor-parallel group");
    MOERT_CHECK(etp_sum_parts(L, recv.data, n, mine * cols, gathered->dtype, local));
fail:
    tensor_release(L, &send);
    tensor_release(L, &recv);
    free(sizes);
    return rc;
}

/* Frees what the last forward saved, stream-ordered after the copies still using it. */
moert_result moert_layer_release_saved(moert_layer *L) { return release_saved(L); }

static moert_result release_saved(moert_layer *L)
{
    moert_result rc = MOERT_OK;
    const moert_host *h = L->core_host;
    tensor_release(L, &L->topk_idx);
    tensor_release(L, &L->topk_probs);
    tensor_release(L, &L->tokens_per_expert);
    tensor_release(L, &L->recv_probs);
    if (L->shared_stream)
        HOST_CALL(h->stream_wait_event(h, L->stream, L->shared_join_event), "joining the shared expert's stream",
                  MOERT_ACT_COUNT);
    tensor_release(L, &L->shared_out);
    tensor_release(L, &L->shared_dx);
    tensor_release(L, &L->shared_dprob);
    tensor_release(L, &L->shared_rows);
    tensor_release(L, &L->shared_prob);
    tensor_release(L, &L->experts_counts);
    L->experts_only = false;
    MOERT_CHECK(moert_act_store_release(&L->acts));
fail:
    return rc;
}

void moert_layer_free(moert_layer *L)
{
    const moert_host *h = L->core_host;
    if (release_saved(L) != MOERT_OK) moert_error_clear();
    /* its copies in flight read or write buffers it frees: it waits for them first */
    moert_act_store_free(&L->acts);
#ifdef MOERT_HAVE_CUDA
    for (int m = 0; m < MOERT_LAYER_MARKS; m++)
        if (L->mark_events[m]) moert_cuda_event_destroy(L->mark_events[m]);
#endif
    if (L->wgrad_stream) { /* another slot's layer shares slot 0's stream: its own events only */
        if (h->stream_synchronize(h, L->wgrad_stream) != MOERT_OK) (void)moert_host_take_error((moert_host *)h);
        h->event_destroy(h, L->wgrad_fork_event);
        h->event_destroy(h, L->wgrad_join_event);
        if (!L->wgrad_owner) h->stream_destroy(h, L->wgrad_stream);
        L->wgrad_stream = NULL;
        L->wgrad_fork_event = L->wgrad_join_event = NULL;
    }
    memset(L->mark_events, 0, sizeof L->mark_events);
    if (L->shared_stream) {
        if (h->stream_synchronize(h, L->shared_stream) != MOERT_OK) (void)moert_host_take_error((moert_host *)h);
        h->event_destroy(h, L->shared_fork_event);
        h->event_destroy(h, L->shared_join_event);
        h->stream_destroy(h, L->shared_stream);
        L->shared_stream = NULL;
        L->shared_fork_event = L->shared_join_event = NULL;
    }
    if (L->info.device.type != MOERT_DEVICE_CPU) tensor_release(L, &L->expert_counts); /* the device copy (ETP) */
    free(L->etp_counts);
    free(L->etp_rank_major);
    free(L->etp_expert_major);
    free(L->expert_counts_host);
    free(L->experts_counts_host_buf);
    L->experts_counts_host_buf = NULL;
    L->etp_counts = L->etp_rank_major = L->etp_expert_major = L->expert_counts_host = NULL;
    for (int p = 0; p < MOERT_PARAM_COUNT; p++) {
        if (!L->params_borrowed) tensor_release(L, &L->params[p].value);
        if (!L->params_borrowed) tensor_release(L, &L->params[p].grad);
    }
}

/* The expert weights' gradients are written by the precision plugin's first WGRAD when it can overwrite. */
static bool lazy_wgrad_zero(const moert_layer *L)
{
    return (instance_flags(&L->precision) & MOERT_CAP_WGRAD_OVERWRITE) != 0;
}

bool moert_layer_graph_capturable(const moert_layer *L, char *why, size_t why_size)
{
    const moert_instance *inst[4] = {&L->router, &L->dispatcher, &L->precision, &L->memory};
    if (L->info.device.type != MOERT_DEVICE_CUDA) {
        snprintf(why, why_size, "the layer runs on the CPU");
        return false;
    }
    for (int i = 0; i < 4; i++) {
        if (instance_flags(inst[i]) & MOERT_CAP_GRAPH_CAPTURABLE) continue;
        snprintf(why, why_size, "%s \"%s\" is not graph-capturable%s", moert_kind_name(inst[i]->plugin->kind),
                 inst[i]->plugin->header->name,
                 instance_flags(inst[i]) & MOERT_CAP_NEEDS_HOST_SYNC ? " (it synchronises the host)" : "");
        return false;
    }
    if (etp_on(L)) {
        snprintf(why, why_size, "expert tensor parallelism exchanges the rows per expert on the host");
        return false;
    }
    for (int a = 0; a < MOERT_STORE_SLOTS; a++) {
        if (L->acts.action[a] == MOERT_MEMORY_KEEP) continue;
        snprintf(why, why_size, "the memory policy offloads or recomputes %s", moert_act_store_slot_name(a));
        return false;
    }
    return true;
}

moert_result moert_layer_zero_grad(moert_layer *L, bool allow_lazy)
{
    moert_result rc = MOERT_OK;
    const bool lazy = allow_lazy && lazy_wgrad_zero(L);
    const bool shared_lazy =
        allow_lazy && L->shared_precision.ctx &&
        (moert_host_instance_flags(L->shared_precision.host, L->shared_precision.plugin->header->flags) &
         MOERT_CAP_WGRAD_OVERWRITE);
    for (int p = 0; p < MOERT_PARAM_COUNT; p++) {
        if (!moert_layer_has_param(L, (moert_param_id)p)) continue;
        const bool expert = p == MOERT_PARAM_FC1 || p == MOERT_PARAM_FC2;
        const bool shared = p == MOERT_PARAM_SHARED_FC1 || p == MOERT_PARAM_SHARED_FC2;
        if (expert) L->grad_unwritten[p == MOERT_PARAM_FC1 ? MOERT_GEMM_FC1 : MOERT_GEMM_FC2] = lazy;
        if (shared)
            L->shared_grad_unwritten[p == MOERT_PARAM_SHARED_FC1 ? MOERT_GEMM_FC1 : MOERT_GEMM_FC2] = shared_lazy;
        if ((lazy && expert) || (shared_lazy && shared)) continue;
        MOERT_CHECK(moert_zero(L->stream, &L->params[p].grad));
    }
fail:
    return rc;
}

void moert_layer_mark_grads_written(moert_layer *L)
{
    L->grad_unwritten[MOERT_GEMM_FC1] = L->grad_unwritten[MOERT_GEMM_FC2] = false;
}

/* Zeroes the expert weight gradients no WGRAD has written since zero_grad (a backward always runs both WGRADs;
 * this keeps the gradients right if one did not). */
static moert_result zero_unwritten_grads(moert_layer *L)
{
    moert_result rc = MOERT_OK;
    for (int w = 0; w < 2; w++) {
        if (L->grad_unwritten[w]) {
            MOERT_CHECK(
                moert_zero(L->stream, &L->params[w == MOERT_GEMM_FC1 ? MOERT_PARAM_FC1 : MOERT_PARAM_FC2].grad));
            L->grad_unwritten[w] = false;
        }
        if (L->shared_grad_unwritten[w]) {
            MOERT_CHECK(moert_zero(
                L->stream, &L->params[w == MOERT_GEMM_FC1 ? MOERT_PARAM_SHARED_FC1 : MOERT_PARAM_SHARED_FC2].grad));
            L->shared_grad_unwritten[w] = false;
        }
    }
fail:
    return rc;
}

/* Rows the grouped GEMMs cover: the sum of tokens_per_expert (padding included). */
int64_t moert_layer_used_rows(const moert_layer *L) { return used_rows(L); }

static int64_t used_rows(const moert_layer *L)
{
    if (L->etp_size > 1) return L->expert_rows;
    if (!L->layout.tokens_per_expert_host) return L->layout.capacity;
    int64_t rows = 0;
    for (int64_t e = 0; e < L->info.num_local_experts; e++) rows += L->layout.tokens_per_expert_host[e];
    return rows;
}

/* One grouped GEMM pass of the routed experts (shared false) or of the shared expert (one group of every token). */
static moert_result gemm_of(moert_layer *L, bool shared, moert_stream stream, moert_gemm_weight which,
                            moert_gemm_pass pass, const moert_tensor *input, const moert_tensor *grad_output,
                            moert_tensor *output, moert_tensor *grad_input)
{
    moert_result rc = MOERT_OK;
    moert_instance *inst = shared ? &L->shared_precision : &L->precision;
    bool *unwritten = shared ? L->shared_grad_unwritten : L->grad_unwritten;
    moert_param *w = &L->params[shared ? (which == MOERT_GEMM_FC1 ? MOERT_PARAM_SHARED_FC1 : MOERT_PARAM_SHARED_FC2)
                                       : (which == MOERT_GEMM_FC1 ? MOERT_PARAM_FC1 : MOERT_PARAM_FC2)];
    moert_grouped_gemm_args a = {.struct_size = sizeof a,
                                 .which = which,
                                 .pass = pass,
                                 .tokens_per_expert = shared            ? &L->shared_rows
                                                      : L->experts_only ? &L->experts_counts
                                                      : etp_on(L)       ? &L->expert_counts
                                                                        : &L->layout.tokens_per_expert,
                                 .tokens_per_expert_host = shared            ? &L->shared_rows_host
                                                           : L->experts_only ? L->experts_counts_host
                                                           : etp_on(L)       ? L->expert_counts_host
                                                                             : L->layout.tokens_per_expert_host,
                                 .input = input,
                                 .weight = &w->value,
                                 .grad_output = grad_output,
                                 .output = output,
                                 .grad_input = grad_input,
                                 .grad_weight = &w->grad,
                                 .overwrite_grad_weight = pass == MOERT_GEMM_WGRAD && unwritten[which]};
    static const char *const names[3] = {"grouped_gemm(forward)", "grouped_gemm(dgrad)", "grouped_gemm(wgrad)"};
    static const char *const shared_names[3] = {"grouped_gemm(shared expert, forward)",
                                                "grouped_gemm(shared expert, dgrad)",
                                                "grouped_gemm(shared expert, wgrad)"};
    PLUGIN_CALL(*inst, shared ? shared_names[pass] : names[pass],
                ((const moert_precision_v1 *)inst->plugin->header)->grouped_gemm(inst->ctx, stream, &a));
    if (pass == MOERT_GEMM_WGRAD) unwritten[which] = false;
fail:
    return rc;
}

static moert_result run_gemm_on(moert_layer *L, moert_stream stream, moert_gemm_weight which, moert_gemm_pass pass,
                                const moert_tensor *input, const moert_tensor *grad_output, moert_tensor *output,
                                moert_tensor *grad_input)
{
    return gemm_of(L, false, stream, which, pass, input, grad_output, output, grad_input);
}

static moert_result run_gemm(moert_layer *L, moert_gemm_weight which, moert_gemm_pass pass, const moert_tensor *input,
                             const moert_tensor *grad_output, moert_tensor *output, moert_tensor *grad_input)
{
    return run_gemm_on(L, L->stream, which, pass, input, grad_output, output, grad_input);
}

/* The dispatch into the experts' rows (dispatched_x and recv_probs). With ETP the dispatcher's rows go to buffers of
 * this rank, and every ETP rank's rows are gathered from them, grouped by local expert. */
static moert_result run_dispatch(moert_layer *L)
{
    moert_result rc = MOERT_OK;
    moert_tensor *recv_x = moert_act_store_tensor(&L->acts, MOERT_ACT_DISPATCHED_X);
    moert_tensor local_x = {0}, local_probs = {0};
    moert_dispatch_args d = {.struct_size = sizeof d,
                             .x = &L->x,
                             .topk_probs = &L->topk_probs,
                             .recv_x = recv_x,
                             .recv_probs = &L->recv_probs};
    if (etp_on(L)) {
        MOERT_CHECK(tensor_alloc(L, &local_x, L->info.dtype, 2, L->layout.capacity, L->info.hidden, 0));
        MOERT_CHECK(tensor_alloc(L, &local_probs, L->param_dtype, 1, L->layout.capacity, 0, 0));
        d.recv_x = &local_x;
        d.recv_probs = &local_probs;
    }
    MOERT_CHECK(call_dispatcher(L, CALL_DISPATCH, &d));
    if (etp_on(L)) {
        MOERT_CHECK(etp_gather_rows(L, &local_x, recv_x));
        MOERT_CHECK(etp_gather_rows(L, &local_probs, &L->recv_probs));
    }
fail:
    tensor_release(L, &local_x);
    tensor_release(L, &local_probs);
    return rc;
}

static moert_result run_fc1(moert_layer *L)
{
    return run_gemm(L, MOERT_GEMM_FC1, MOERT_GEMM_FORWARD, moert_act_store_tensor(&L->acts, MOERT_ACT_DISPATCHED_X),
                    NULL, moert_act_store_tensor(&L->acts, MOERT_ACT_FC1_OUT), NULL);
}

static moert_result run_act(moert_layer *L)
{
    return moert_swiglu_forward(L->stream, moert_act_store_tensor(&L->acts, MOERT_ACT_FC1_OUT), &L->recv_probs,
                                used_rows(L), moert_act_store_tensor(&L->acts, MOERT_ACT_SWIGLU_OUT));
}

/* Allocates saved activation a for this step's rows. */
static moert_result alloc_activation(moert_layer *L, moert_activation a)
{
    int64_t cols[MOERT_ACT_COUNT] = {L->info.hidden, 2 * L->info.ffn_hidden, L->info.ffn_hidden};
    return moert_act_store_alloc(&L->acts, a, L->info.dtype, expert_rows(L), cols[a]);
}

/* Right after activation a (a store slot) is produced: asks the memory policy what to do with it and hands the answer
 * to the activation store (which starts an offload's copy at once). The shared expert's fc1 and SwiGLU outputs are
 * asked about as fc1_out and swiglu_out, flagged MOERT_ACTIVATION_SHARED_EXPERT: a policy that does not read the flag
 * treats them as the routed experts' (docs/executor.md, "Shared expert"). */
static moert_result decide_action(moert_layer *L, int a)
{
    moert_result rc = MOERT_OK;
    moert_memory_action action = MOERT_MEMORY_KEEP;
    const bool shared = a >= MOERT_ACT_COUNT;
    moert_activation asked = !shared                           ? (moert_activation)a
                             : a == MOERT_STORE_SHARED_FC1_OUT ? MOERT_ACT_FC1_OUT
                                                               : MOERT_ACT_SWIGLU_OUT;
    moert_activation_info info = {.struct_size = sizeof info,
                                  .layer_index = L->info.layer_index,
                                  .activation = asked,
                                  .bytes = (int64_t)moert_tensor_bytes(moert_act_store_tensor(&L->acts, a)),
                                  .device = L->info.device,
                                  .flags = shared ? MOERT_ACTIVATION_SHARED_EXPERT : 0u};
    PLUGIN_CALL(L->memory, "decide", MEMORY(L)->decide(L->memory.ctx, &info, &action));
    if (action != MOERT_MEMORY_KEEP && action != MOERT_MEMORY_RECOMPUTE && action != MOERT_MEMORY_OFFLOAD) {
        rc = moert_error(MOERT_ERR_INVALID_ARGUMENT, "memory policy \"%s\" answered action %d for %s",
                         L->memory.plugin->header->name, (int)action, moert_act_store_slot_name(a));
        goto fail;
    }
    MOERT_CHECK(moert_act_store_put(&L->acts, a, action));
fail:
    return rc;
}

/* Makes activation a usable on the compute stream for backward: waits for its reload, or recomputes it (its input,
 * the activation before it, first). */
static moert_result materialize(moert_layer *L, moert_activation a)
{
    moert_result rc = MOERT_OK;
    bool dropped = false;
    MOERT_CHECK(moert_act_store_get(&L->acts, a, &dropped));
    if (!dropped) return MOERT_OK;
    if (a > MOERT_ACT_DISPATCHED_X) MOERT_CHECK(materialize(L, (moert_activation)(a - 1)));
    MOERT_CHECK(alloc_activation(L, a));
    switch (a) {
    case MOERT_ACT_DISPATCHED_X: MOERT_CHECK(run_dispatch(L)); break;
    case MOERT_ACT_FC1_OUT: MOERT_CHECK(run_fc1(L)); break;
    case MOERT_ACT_SWIGLU_OUT: MOERT_CHECK(run_act(L)); break;
    default: break;
    }
fail:
    return rc;
}

/* A second stream of the layer and its fork and join events (overlap_wgrad, the shared expert's), made at the first use
 * through the core host; nothing on the CPU, where every call is synchronous. */
static moert_result ensure_side_stream(moert_layer *L, moert_stream *stream, moert_event *fork_event,
                                       moert_event *join_event, const char *what)
{
    moert_result rc = MOERT_OK;
    const moert_host *h = L->core_host;
    if (*stream || !L->stream) return MOERT_OK;
    moert_stream s = NULL;
    moert_event fork = NULL, join = NULL;
    HOST_CALL(h->stream_create(h, &s), what, MOERT_ACT_COUNT);
    HOST_CALL(h->event_create(h, &fork), what, MOERT_ACT_COUNT);
    HOST_CALL(h->event_create(h, &join), what, MOERT_ACT_COUNT);
    *stream = s;
    *fork_event = fork;
    *join_event = join;
    return MOERT_OK;
fail:
    if (fork) h->event_destroy(h, fork);
    if (join) h->event_destroy(h, join);
    if (s) h->stream_destroy(h, s);
    return rc;
}

static moert_result ensure_shared_stream(moert_layer *L)
{
    if (!L->shared_overlap) return MOERT_OK;
    return ensure_side_stream(L, &L->shared_stream, &L->shared_fork_event, &L->shared_join_event,
                              "creating the shared expert's stream and events");
}

/* Where the shared expert's work goes: its own stream, forked from the compute stream here (the core's and its
 * precision instance's allocations ordered on it meanwhile), or the compute stream itself. */
static moert_result shared_begin(moert_layer *L, moert_stream *stream)
{
    moert_result rc = MOERT_OK;
    const moert_host *h = L->core_host;
    *stream = L->stream;
    MOERT_CHECK(ensure_shared_stream(L));
    if (!L->shared_stream) return MOERT_OK;
    HOST_CALL(h->event_record(h, L->shared_fork_event, L->stream), "forking the shared expert's stream",
              MOERT_ACT_COUNT);
    HOST_CALL(h->stream_wait_event(h, L->shared_stream, L->shared_fork_event), "forking the shared expert's stream",
              MOERT_ACT_COUNT);
    *stream = L->shared_stream;
    moert_host_use_stream((moert_host *)L->core_host, L->shared_stream);
    moert_host_use_stream(L->shared_precision.host, L->shared_stream);
fail:
    return rc;
}

/* Back to the compute stream for allocations; the join event marks the end of the shared expert's work. */
static moert_result shared_end(moert_layer *L)
{
    moert_result rc = MOERT_OK;
    const moert_host *h = L->core_host;
    if (!L->shared_stream) return MOERT_OK;
    moert_host_use_stream((moert_host *)L->core_host, L->stream);
    moert_host_use_stream(L->shared_precision.host, L->stream);
    HOST_CALL(h->event_record(h, L->shared_join_event, L->shared_stream), "joining the shared expert's stream",
              MOERT_ACT_COUNT);
fail:
    return rc;
}

/* The compute stream waits for the shared expert's work (nothing to wait for without its own stream). */
static moert_result shared_join(moert_layer *L)
{
    moert_result rc = MOERT_OK;
    const moert_host *h = L->core_host;
    if (!L->shared_stream) return MOERT_OK;
    HOST_CALL(h->stream_wait_event(h, L->stream, L->shared_join_event), "joining the shared expert's stream",
              MOERT_ACT_COUNT);
fail:
    return rc;
}

/* The shared expert's fc1 output (from the layer input x) or its SwiGLU output (from the fc1 output and the prob) into
 * a new buffer of its store slot, on stream s: the forward, and the recomputation of a dropped one in backward. */
static moert_result shared_compute(moert_layer *L, int a, const moert_tensor *x, moert_stream s)
{
    moert_result rc = MOERT_OK;
    const int64_t t = L->shared_rows_host;
    moert_tensor *fc1_out = moert_act_store_tensor(&L->acts, MOERT_STORE_SHARED_FC1_OUT);
    if (a == MOERT_STORE_SHARED_FC1_OUT) {
        MOERT_CHECK(moert_act_store_alloc(&L->acts, a, L->info.dtype, t, 2 * L->shared_ffn));
        MOERT_CHECK(gemm_of(L, true, s, MOERT_GEMM_FC1, MOERT_GEMM_FORWARD, x, NULL, fc1_out, NULL));
    } else {
        MOERT_CHECK(moert_act_store_alloc(&L->acts, a, L->info.dtype, t, L->shared_ffn));
        MOERT_CHECK(moert_swiglu_forward(s, fc1_out, &L->shared_prob, t, moert_act_store_tensor(&L->acts, a)));
    }
fail:
    return rc;
}

/* Makes a shared expert's slot usable on its stream s in backward: waits for its reload, or recomputes it (the SwiGLU
 * output from the fc1 output, which is then made usable first). */
static moert_result shared_materialize(moert_layer *L, int a, moert_stream s)
{
    moert_result rc = MOERT_OK;
    bool dropped = false;
    MOERT_CHECK(moert_act_store_get(&L->acts, a, &dropped));
    if (!dropped) return MOERT_OK;
    if (a == MOERT_STORE_SHARED_ACT) MOERT_CHECK(shared_materialize(L, MOERT_STORE_SHARED_FC1_OUT, s));
    MOERT_CHECK(shared_compute(L, a, &L->x, s));
fail:
    return rc;
}

/* The shared expert's forward, issued on its stream: shared_out = fc2(swiglu(fc1(x)) * prob) over every token, prob
 * 1 or sigmoid(x . gate). Its fc1 and SwiGLU outputs go to the activation store as the memory policy answers (their
 * copies ordered after this stream). shared_forward_finish adds the output to y. */
static moert_result shared_forward_issue(moert_layer *L, const moert_tensor *x)
{
    moert_result rc = MOERT_OK, rc_end = MOERT_OK;
    const moert_layer_info *in = &L->info;
    const int64_t t = x->shape[0];
    moert_stream s = NULL;
    MOERT_CHECK(shared_begin(L, &s));
    moert_act_store_set_stream(&L->acts, MOERT_STORE_SHARED_FC1_OUT, L->shared_stream);
    moert_act_store_set_stream(&L->acts, MOERT_STORE_SHARED_ACT, L->shared_stream);
    /* one group of t rows, its count on the host and on the device (written by a kernel: graph-capturable) */
    L->shared_rows_host = t;
    MOERT_CHECK(tensor_alloc(L, &L->shared_rows, MOERT_I64, 1, 1, 0, 0));
    MOERT_CHECK(moert_fill(s, &L->shared_rows, (double)t));
    MOERT_CHECK(shared_compute(L, MOERT_STORE_SHARED_FC1_OUT, x, s));
    MOERT_CHECK(decide_action(L, MOERT_STORE_SHARED_FC1_OUT));
    MOERT_CHECK(tensor_alloc(L, &L->shared_prob, L->param_dtype, 1, t, 0, 0));
    if (L->shared_gate)
        MOERT_CHECK(moert_gate_forward(s, x, &L->params[MOERT_PARAM_SHARED_GATE].value, &L->shared_prob));
    else
        MOERT_CHECK(moert_fill(s, &L->shared_prob, 1.0));
    MOERT_CHECK(shared_compute(L, MOERT_STORE_SHARED_ACT, x, s));
    MOERT_CHECK(decide_action(L, MOERT_STORE_SHARED_ACT));
    moert_act_store_after_last_use(&L->acts, MOERT_STORE_SHARED_FC1_OUT);
    MOERT_CHECK(tensor_alloc(L, &L->shared_out, in->dtype, 2, t, in->hidden, 0));
    MOERT_CHECK(gemm_of(L, true, s, MOERT_GEMM_FC2, MOERT_GEMM_FORWARD,
                        moert_act_store_tensor(&L->acts, MOERT_STORE_SHARED_ACT), NULL, &L->shared_out, NULL));
    moert_act_store_after_last_use(&L->acts, MOERT_STORE_SHARED_ACT);
fail:
    rc_end = shared_end(L);
    return rc != MOERT_OK ? rc : rc_end;
}

/* y += the shared expert's output, on the compute stream once its stream is done. */
static moert_result shared_forward_finish(moert_layer *L, moert_tensor *y)
{
    moert_result rc = MOERT_OK;
    MOERT_CHECK(shared_join(L));
    MOERT_CHECK(moert_add(L->stream, y, &L->shared_out, y));
    tensor_release(L, &L->shared_out);
fail:
    return rc;
}

/* The shared expert's backward from d_y, issued on its stream: its weight gradients, and shared_dx (its share of d_x)
 * and shared_dprob for shared_backward_finish. Its saved activations are reloaded or recomputed on that stream just
 * before their first use. */
static moert_result shared_backward_issue(moert_layer *L, const moert_tensor *d_y)
{
    moert_result rc = MOERT_OK, rc_end = MOERT_OK;
    const moert_layer_info *in = &L->info;
    const int64_t t = d_y->shape[0];
    moert_tensor d_act = {0}, d_fc1 = {0};
    moert_stream s = NULL;
    MOERT_CHECK(shared_begin(L, &s));
    MOERT_CHECK(tensor_alloc(L, &d_act, in->dtype, 2, t, L->shared_ffn, 0));
    MOERT_CHECK(gemm_of(L, true, s, MOERT_GEMM_FC2, MOERT_GEMM_DGRAD, NULL, d_y, NULL, &d_act));
    MOERT_CHECK(shared_materialize(L, MOERT_STORE_SHARED_ACT, s));
    MOERT_CHECK(gemm_of(L, true, s, MOERT_GEMM_FC2, MOERT_GEMM_WGRAD,
                        moert_act_store_tensor(&L->acts, MOERT_STORE_SHARED_ACT), d_y, NULL, NULL));
    moert_act_store_done(&L->acts, MOERT_STORE_SHARED_ACT);
    MOERT_CHECK(tensor_alloc(L, &d_fc1, in->dtype, 2, t, 2 * L->shared_ffn, 0));
    MOERT_CHECK(tensor_alloc(L, &L->shared_dprob, L->param_dtype, 1, t, 0, 0));
    MOERT_CHECK(shared_materialize(L, MOERT_STORE_SHARED_FC1_OUT, s));
    MOERT_CHECK(moert_swiglu_backward(s, &d_act, moert_act_store_tensor(&L->acts, MOERT_STORE_SHARED_FC1_OUT),
                                      &L->shared_prob, t, &d_fc1, &L->shared_dprob));
    tensor_release(L, &d_act);
    moert_act_store_done(&L->acts, MOERT_STORE_SHARED_FC1_OUT);
    MOERT_CHECK(tensor_alloc(L, &L->shared_dx, in->dtype, 2, t, in->hidden, 0));
    MOERT_CHECK(gemm_of(L, true, s, MOERT_GEMM_FC1, MOERT_GEMM_DGRAD, NULL, &d_fc1, NULL, &L->shared_dx));
    MOERT_CHECK(gemm_of(L, true, s, MOERT_GEMM_FC1, MOERT_GEMM_WGRAD, &L->x, &d_fc1, NULL, NULL));
fail:
    tensor_release(L, &d_act);
    tensor_release(L, &d_fc1);
    rc_end = shared_end(L);
    return rc != MOERT_OK ? rc : rc_end;
}

/* d_x += the shared expert's share (and the gate's), on the compute stream once the shared stream is done. */
static moert_result shared_backward_finish(moert_layer *L, moert_tensor *d_x)
{
    moert_result rc = MOERT_OK;
    MOERT_CHECK(shared_join(L));
    MOERT_CHECK(moert_add(L->stream, d_x, &L->shared_dx, d_x));
    if (L->shared_gate)
        MOERT_CHECK(moert_gate_backward(L->stream, &L->x, &L->params[MOERT_PARAM_SHARED_GATE].value, &L->shared_prob,
                                        &L->shared_dprob, d_x, &L->params[MOERT_PARAM_SHARED_GATE].grad));
    tensor_release(L, &L->shared_dx);
    tensor_release(L, &L->shared_dprob);
    tensor_release(L, &L->shared_prob);
fail:
    return rc;
}

/* The router's forward_losses, where its vtable has it (ABI 1.2); NULL else. */
static moert_result (*router_forward_losses(const moert_layer *L))(void *, moert_router_losses *)
{
    const moert_router_v1 *r = ROUTER(L);
    const size_t end = offsetof(moert_router_v1, forward_losses) + sizeof r->forward_losses;
    return r->header.struct_size >= end ? r->forward_losses : NULL;
}

/* The losses of a forward whose router deferred them, once its stream has passed the routing (on CUDA the routing's
 * end mark; by the forward's end the dispatcher's prepare has waited for it on the host already, so this costs no
 * wait in practice). */
static moert_result collect_router_losses(moert_layer *L)
{
    moert_result rc = MOERT_OK;
#ifdef MOERT_HAVE_CUDA
    if (L->info.device.type == MOERT_DEVICE_CUDA)
        MOERT_CHECK(moert_cuda_event_synchronize(L->mark_events[1 + MOERT_STAGE_ROUTER]));
#endif
    PLUGIN_CALL(L->router, "forward_losses", router_forward_losses(L)(L->router.ctx, &L->losses));
fail:
    return rc;
}

moert_result moert_layer_forward(moert_layer *L, const moert_tensor *x, moert_tensor *y)
{
    moert_result rc = MOERT_OK;
    const moert_layer_info *in = &L->info;
    int64_t t = x->shape[0];
    moert_tensor y_expert = {0}, moe_out = {0};
    MOERT_CHECK(release_saved(L));
    L->x = *x;
    moert_act_store_begin_forward(&L->acts);
    MOERT_CHECK(stage_mark(L, 0));
    memset(L->dispatcher_call_ran, 0, sizeof L->dispatcher_call_ran);
    MOERT_CHECK(tensor_alloc(L, &L->topk_idx, MOERT_I32, 2, t, in->topk, 0));
    MOERT_CHECK(tensor_alloc(L, &L->topk_probs, L->param_dtype, 2, t, in->topk, 0));
    MOERT_CHECK(tensor_alloc(L, &L->tokens_per_expert, MOERT_I64, 1, in->num_experts, 0, 0));
    memset(&L->losses, 0, sizeof L->losses);
    /* not while capturing a CUDA graph: the wait for the losses would be captured */
    const bool defer_losses = router_forward_losses(L) != NULL && !L->capturing;
    moert_router_forward_args ra = {.struct_size = sizeof ra,
                                    .x = x,
                                    .weight = &L->params[MOERT_PARAM_ROUTER].value,
                                    .topk_idx = &L->topk_idx,
                                    .topk_probs = &L->topk_probs,
                                    .tokens_per_expert = &L->tokens_per_expert,
                                    .losses = &L->losses,
                                    .seq_length = L->seq_length,
                                    .flags = (L->inference ? MOERT_ROUTER_FORWARD_INFERENCE : 0u) |
                                             (defer_losses ? MOERT_ROUTER_FORWARD_DEFER_LOSSES : 0u)};
    /* the shared expert needs only x: on its own stream it runs beside the routing, dispatch and experts */
    if (L->shared_ffn > 0) MOERT_CHECK(shared_forward_issue(L, x));
    PLUGIN_CALL(L->router, "forward", ROUTER(L)->forward(L->router.ctx, L->stream, &ra));
    MOERT_CHECK(stage_mark(L, 1 + MOERT_STAGE_ROUTER));
    /* the other half's expert GEMMs before the prepare's host wait, which then shares its turn with the dispatch */
    if (L->overlap_prepare_after_dgrads) yield_point(L);

    memset(&L->layout, 0, sizeof L->layout);
    L->layout.struct_size = sizeof L->layout;
    MOERT_CHECK(call_dispatcher(L, CALL_PREPARE, NULL));
    if (etp_on(L)) MOERT_CHECK(etp_gather_counts(L));
    MOERT_CHECK(stage_mark(L, 1 + MOERT_STAGE_PERMUTE));
    if (!L->overlap_prepare_after_dgrads) yield_point(L);

    MOERT_CHECK(alloc_activation(L, MOERT_ACT_DISPATCHED_X));
    MOERT_CHECK(tensor_alloc(L, &L->recv_probs, L->param_dtype, 1, expert_rows(L), 0, 0));
    MOERT_CHECK(run_dispatch(L));
    MOERT_CHECK(decide_action(L, MOERT_ACT_DISPATCHED_X));
    MOERT_CHECK(stage_mark(L, 1 + MOERT_STAGE_DISPATCH));
    yield_point(L);

    MOERT_CHECK(alloc_activation(L, MOERT_ACT_FC1_OUT));
    MOERT_CHECK(run_fc1(L));
    MOERT_CHECK(decide_action(L, MOERT_ACT_FC1_OUT));
    moert_act_store_after_last_use(&L->acts, MOERT_ACT_DISPATCHED_X);
    MOERT_CHECK(stage_mark(L, 1 + MOERT_STAGE_FC1));

    MOERT_CHECK(alloc_activation(L, MOERT_ACT_SWIGLU_OUT));
    MOERT_CHECK(run_act(L));
    MOERT_CHECK(decide_action(L, MOERT_ACT_SWIGLU_OUT));
    moert_act_store_after_last_use(&L->acts, MOERT_ACT_FC1_OUT);
    MOERT_CHECK(stage_mark(L, 1 + MOERT_STAGE_ACT));

    MOERT_CHECK(tensor_alloc(L, &y_expert, in->dtype, 2, expert_rows(L), in->hidden, 0));
    MOERT_CHECK(run_gemm(L, MOERT_GEMM_FC2, MOERT_GEMM_FORWARD, moert_act_store_tensor(&L->acts, MOERT_ACT_SWIGLU_OUT),
                         NULL, &y_expert, NULL));
    moert_act_store_after_last_use(&L->acts, MOERT_ACT_SWIGLU_OUT);
    if (etp_on(L)) { /* each ETP rank's fc2 output is a partial sum: summed back onto the rows this rank dispatched */
        moert_tensor partial = y_expert;
        rc = tensor_alloc(L, &y_expert, in->dtype, 2, L->layout.capacity, in->hidden, 0);
        if (rc == MOERT_OK) rc = etp_reduce_scatter_rows(L, &partial, &y_expert);
        tensor_release(L, &partial);
        if (rc != MOERT_OK) goto fail;
    }
    MOERT_CHECK(stage_mark(L, 1 + MOERT_STAGE_FC2));
    yield_point(L);

    if (!L->no_residual) MOERT_CHECK(tensor_alloc(L, &moe_out, in->dtype, 2, t, in->hidden, 0));
    moert_combine_args ca = {.struct_size = sizeof ca, .y_expert = &y_expert, .y = L->no_residual ? y : &moe_out};
    MOERT_CHECK(call_dispatcher(L, CALL_COMBINE, &ca));
    if (!L->no_residual) MOERT_CHECK(moert_add(L->stream, x, &moe_out, y));
    if (L->shared_ffn > 0) MOERT_CHECK(shared_forward_finish(L, y));
    /* the compute stream waits here for D2H copies still running, unless the caller frees them later (counted in
     * the combine stage) */
    MOERT_CHECK(moert_act_store_end_forward(&L->acts));
    MOERT_CHECK(stage_mark(L, 1 + MOERT_STAGE_COMBINE));
    if (defer_losses) MOERT_CHECK(collect_router_losses(L));
fail:
    tensor_release(L, &y_expert);
    tensor_release(L, &moe_out);
    return rc;
}

static moert_result ensure_wgrad_stream(moert_layer *L)
{
    moert_layer *owner = L->wgrad_owner;
    if (!owner)
        return ensure_side_stream(L, &L->wgrad_stream, &L->wgrad_fork_event, &L->wgrad_join_event,
                                  "creating the wgrad stream and its events");
    /* another slot: slot 0's stream, events of its own */
    moert_result rc = MOERT_OK;
    const moert_host *h = L->core_host;
    MOERT_CHECK(ensure_side_stream(owner, &owner->wgrad_stream, &owner->wgrad_fork_event, &owner->wgrad_join_event,
                                   "creating the wgrad stream and its events"));
    if (L->wgrad_stream || !owner->wgrad_stream) return MOERT_OK;
    moert_event fork = NULL, join = NULL;
    HOST_CALL(h->event_create(h, &fork), "creating the wgrad stream's events", MOERT_ACT_COUNT);
    if ((rc = h->event_create(h, &join)) != MOERT_OK) {
        h->event_destroy(h, fork);
        HOST_CALL(rc, "creating the wgrad stream's events", MOERT_ACT_COUNT);
    }
    L->wgrad_fork_event = fork;
    L->wgrad_join_event = join;
    L->wgrad_stream = owner->wgrad_stream;
fail:
    return rc;
}

static moert_result wgrad_on(moert_layer *L, moert_stream stream, moert_backward_part p, moert_gemm_weight which,
                             const moert_tensor *input, const moert_tensor *grad_output)
{
    moert_result rc = MOERT_OK;
    moert_stream before = moert_host_use_stream(L->precision.host, stream);
    MOERT_CHECK(part_begin(L, p, stream));
    MOERT_CHECK(run_gemm_on(L, stream, which, MOERT_GEMM_WGRAD, input, grad_output, NULL, NULL));
    MOERT_CHECK(part_end(L, p, stream));
fail:
    moert_host_use_stream(L->precision.host, before);
    return rc;
}

/* The backward, in the forward's reverse: combine_backward, fc2 dgrad, SwiGLU backward, fc1 dgrad, dispatch_backward,
 * the router's backward. Each wgrad runs after its dgrad, or, with overlap_wgrad, both on the wgrad stream forked after
 * the fc1 dgrad, beside dispatch_backward and the router (docs/executor.md, "Backward overlap"). The tensors the
 * wgrads read are freed after the join. */
moert_result moert_layer_backward(moert_layer *L, const moert_tensor *d_y, moert_tensor *d_x, double loss_scale)
{
    moert_result rc = MOERT_OK;
    const moert_host *h = L->core_host;
    const moert_layer_info *in = &L->info;
    int64_t t = d_y->shape[0], cap = L->layout.capacity, rows = expert_rows(L);
    moert_tensor d_y_expert = {0}, d_act = {0}, d_fc1 = {0}, d_recv_probs = {0}, d_recv_x = {0}, d_probs = {0};
    moert_tensor local_d_recv_x = {0}, local_d_recv_probs = {0}; /* ETP: the sums of the partials, this rank's rows */
    bool forked = false;
    MOERT_CHECK(stage_mark(L, MARK_BACKWARD_START));
    memset(L->backward_part_ran, 0, sizeof L->backward_part_ran);
    if (L->overlap_wgrad) MOERT_CHECK(ensure_wgrad_stream(L));
    const bool overlap = L->overlap_wgrad;
    moert_stream side = L->wgrad_stream; /* NULL on the CPU: the wgrads run in order after dispatch_backward */

    /* reloads not yet issued by a prefetch start now (their buffers allocated on the compute stream, the shared
     * expert's too); each is waited for just before its first use below, or on the shared expert's stream */
    MOERT_CHECK(moert_act_store_prefetch(&L->acts));
    /* the shared expert's backward needs only d_y: on its own stream it runs beside the routed experts' */
    if (L->shared_ffn > 0) MOERT_CHECK(shared_backward_issue(L, d_y));
    /* recomputation first, in forward order, as every rank does (dispatching again is a collective) */
    for (int a = 0; a < MOERT_ACT_COUNT; a++) {
        if (!moert_act_store_dropped(&L->acts, (moert_activation)a)) continue;
        if (!L->backward_part_ran[MOERT_BWD_RECOMPUTE]) MOERT_CHECK(part_begin(L, MOERT_BWD_RECOMPUTE, L->stream));
        MOERT_CHECK(materialize(L, (moert_activation)a));
    }
    if (L->backward_part_ran[MOERT_BWD_RECOMPUTE]) MOERT_CHECK(part_end(L, MOERT_BWD_RECOMPUTE, L->stream));

    MOERT_CHECK(part_begin(L, MOERT_BWD_COMBINE, L->stream));
    MOERT_CHECK(tensor_alloc(L, &d_y_expert, in->dtype, 2, cap, in->hidden, 0));
    moert_combine_backward_args cb = {.struct_size = sizeof cb, .d_y = d_y, .d_y_expert = &d_y_expert};
    MOERT_CHECK(call_dispatcher(L, CALL_COMBINE_BACKWARD, &cb));
    if (etp_on(L)) { /* every ETP rank's output gradients, on the experts' rows */
        moert_tensor local = d_y_expert;
        rc = tensor_alloc(L, &d_y_expert, in->dtype, 2, rows, in->hidden, 0);
        if (rc == MOERT_OK) rc = etp_gather_rows(L, &local, &d_y_expert);
        tensor_release(L, &local);
        if (rc != MOERT_OK) goto fail;
    }
    MOERT_CHECK(part_end(L, MOERT_BWD_COMBINE, L->stream));
    if (!(L->in_merged_call && L->overlap_dgrad_first)) yield_point(L);

    MOERT_CHECK(part_begin(L, MOERT_BWD_FC2_DGRAD, L->stream));
    MOERT_CHECK(tensor_alloc(L, &d_act, in->dtype, 2, rows, in->ffn_hidden, 0));
    MOERT_CHECK(run_gemm(L, MOERT_GEMM_FC2, MOERT_GEMM_DGRAD, NULL, &d_y_expert, NULL, &d_act));
    MOERT_CHECK(materialize(L, MOERT_ACT_SWIGLU_OUT));
    MOERT_CHECK(part_end(L, MOERT_BWD_FC2_DGRAD, L->stream));
    if (!overlap) {
        MOERT_CHECK(wgrad_on(L, L->stream, MOERT_BWD_FC2_WGRAD, MOERT_GEMM_FC2,
                             moert_act_store_tensor(&L->acts, MOERT_ACT_SWIGLU_OUT), &d_y_expert));
        tensor_release(L, &d_y_expert);
        moert_act_store_done(&L->acts, MOERT_ACT_SWIGLU_OUT);
    }

    MOERT_CHECK(part_begin(L, MOERT_BWD_ACT, L->stream));
    MOERT_CHECK(tensor_alloc(L, &d_fc1, in->dtype, 2, rows, 2 * in->ffn_hidden, 0));
    MOERT_CHECK(tensor_alloc(L, &d_recv_probs, L->param_dtype, 1, rows, 0, 0));
    MOERT_CHECK(materialize(L, MOERT_ACT_FC1_OUT));
    MOERT_CHECK(moert_swiglu_backward(L->stream, &d_act, moert_act_store_tensor(&L->acts, MOERT_ACT_FC1_OUT),
                                      &L->recv_probs, used_rows(L), &d_fc1, &d_recv_probs));
    tensor_release(L, &d_act);
    moert_act_store_done(&L->acts, MOERT_ACT_FC1_OUT);
    MOERT_CHECK(part_end(L, MOERT_BWD_ACT, L->stream));

    MOERT_CHECK(part_begin(L, MOERT_BWD_FC1_DGRAD, L->stream));
    MOERT_CHECK(tensor_alloc(L, &d_recv_x, in->dtype, 2, rows, in->hidden, 0));
    MOERT_CHECK(run_gemm(L, MOERT_GEMM_FC1, MOERT_GEMM_DGRAD, NULL, &d_fc1, NULL, &d_recv_x));
    MOERT_CHECK(materialize(L, MOERT_ACT_DISPATCHED_X));
    MOERT_CHECK(part_end(L, MOERT_BWD_FC1_DGRAD, L->stream));
    if (!overlap) {
        MOERT_CHECK(wgrad_on(L, L->stream, MOERT_BWD_FC1_WGRAD, MOERT_GEMM_FC1,
                             moert_act_store_tensor(&L->acts, MOERT_ACT_DISPATCHED_X), &d_fc1));
        tensor_release(L, &d_fc1);
        moert_act_store_done(&L->acts, MOERT_ACT_DISPATCHED_X);
    } else if (side) {
        /* the wgrads are queued first, so a dispatcher that waits on the host cannot hold them back; the compute
         * stream has the higher priority, so the dispatcher's kernels still take SMs first as they free up */
        HOST_CALL(h->event_record(h, L->wgrad_fork_event, L->stream), "forking the wgrad stream", MOERT_ACT_COUNT);
        HOST_CALL(h->stream_wait_event(h, side, L->wgrad_fork_event), "forking the wgrad stream", MOERT_ACT_COUNT);
        forked = true;
        MOERT_CHECK(wgrad_on(L, side, MOERT_BWD_FC2_WGRAD, MOERT_GEMM_FC2,
                             moert_act_store_tensor(&L->acts, MOERT_ACT_SWIGLU_OUT), &d_y_expert));
        MOERT_CHECK(wgrad_on(L, side, MOERT_BWD_FC1_WGRAD, MOERT_GEMM_FC1,
                             moert_act_store_tensor(&L->acts, MOERT_ACT_DISPATCHED_X), &d_fc1));
        HOST_CALL(h->event_record(h, L->wgrad_join_event, side), "joining the wgrad stream", MOERT_ACT_COUNT);
    }
    yield_point(L);

    MOERT_CHECK(part_begin(L, MOERT_BWD_DISPATCH, L->stream));
    /* the residual passes d_y straight through; the MoE branch adds to it */
    if (L->no_residual)
        MOERT_CHECK(moert_zero(L->stream, d_x));
    else
        MOERT_CHECK(moert_copy(L->stream, d_y, d_x));
    MOERT_CHECK(tensor_alloc(L, &d_probs, L->param_dtype, 2, t, in->topk, 0));
    moert_dispatch_backward_args db = {.struct_size = sizeof db,
                                       .d_recv_x = &d_recv_x,
                                       .d_recv_probs = &d_recv_probs,
                                       .d_x = d_x,
                                       .d_topk_probs = &d_probs};
    if (etp_on(L)) { /* each ETP rank's row and prob gradients are partial sums over its shard of the width */
        MOERT_CHECK(tensor_alloc(L, &local_d_recv_x, in->dtype, 2, cap, in->hidden, 0));
        MOERT_CHECK(tensor_alloc(L, &local_d_recv_probs, L->param_dtype, 1, cap, 0, 0));
        MOERT_CHECK(etp_reduce_scatter_rows(L, &d_recv_x, &local_d_recv_x));
        MOERT_CHECK(etp_reduce_scatter_rows(L, &d_recv_probs, &local_d_recv_probs));
        db.d_recv_x = &local_d_recv_x;
        db.d_recv_probs = &local_d_recv_probs;
    }
    MOERT_CHECK(call_dispatcher(L, CALL_DISPATCH_BACKWARD, &db));
    MOERT_CHECK(part_end(L, MOERT_BWD_DISPATCH, L->stream));

    MOERT_CHECK(part_begin(L, MOERT_BWD_ROUTER, L->stream));
    moert_router_backward_args rb = {.struct_size = sizeof rb,
                                     .x = &L->x,
                                     .weight = &L->params[MOERT_PARAM_ROUTER].value,
                                     .d_topk_probs = &d_probs,
                                     .loss_scale = loss_scale,
                                     .d_x = d_x,
                                     .d_weight = &L->params[MOERT_PARAM_ROUTER].grad};
    PLUGIN_CALL(L->router, "backward", ROUTER(L)->backward(L->router.ctx, L->stream, &rb));
    MOERT_CHECK(part_end(L, MOERT_BWD_ROUTER, L->stream));
    yield_point(L);

    /* in a merged call with defer_wgrad_join the compute stream goes on: the wgrads' inputs go back to the pool
     * below on the wgrad stream, their last user, and whoever reads the gradients first waits for wgrad_join_event
     * (moert_layer_join_wgrads) */
    const bool defer = overlap && side && L->defer_wgrad_join && L->in_merged_call;
    if (defer) {
        moert_host_use_stream((moert_host *)L->core_host, side);
        forked = false;
        L->wgrad_pending = true;
    } else if (overlap && side) {
        MOERT_CHECK(part_begin(L, MOERT_BWD_WGRAD_WAIT, L->stream));
        forked = false;
        HOST_CALL(h->stream_wait_event(h, L->stream, L->wgrad_join_event), "joining the wgrad stream", MOERT_ACT_COUNT);
        MOERT_CHECK(part_end(L, MOERT_BWD_WGRAD_WAIT, L->stream));
    } else if (overlap) { /* the CPU: the same work where a GPU joins its second stream */
        MOERT_CHECK(wgrad_on(L, NULL, MOERT_BWD_FC2_WGRAD, MOERT_GEMM_FC2,
                             moert_act_store_tensor(&L->acts, MOERT_ACT_SWIGLU_OUT), &d_y_expert));
        MOERT_CHECK(wgrad_on(L, NULL, MOERT_BWD_FC1_WGRAD, MOERT_GEMM_FC1,
                             moert_act_store_tensor(&L->acts, MOERT_ACT_DISPATCHED_X), &d_fc1));
    }
    if (overlap) {
        tensor_release(L, &d_y_expert);
        moert_act_store_done(&L->acts, MOERT_ACT_SWIGLU_OUT);
        tensor_release(L, &d_fc1);
        moert_act_store_done(&L->acts, MOERT_ACT_DISPATCHED_X);
    }
    if (defer) moert_host_use_stream((moert_host *)L->core_host, L->stream);
    if (L->shared_ffn > 0) MOERT_CHECK(shared_backward_finish(L, d_x));
    MOERT_CHECK(zero_unwritten_grads(L));
    MOERT_CHECK(stage_mark(L, MARK_BACKWARD_END));
fail:
    /* on failure after the fork, the compute stream still joins the wgrad stream before the tensors go back */
    if (forked && (h->event_record(h, L->wgrad_join_event, side) != MOERT_OK ||
                   h->stream_wait_event(h, L->stream, L->wgrad_join_event) != MOERT_OK))
        (void)moert_host_take_error((moert_host *)h);
    tensor_release(L, &d_y_expert);
    tensor_release(L, &d_act);
    tensor_release(L, &d_fc1);
    tensor_release(L, &d_recv_probs);
    tensor_release(L, &d_recv_x);
    tensor_release(L, &d_probs);
    tensor_release(L, &local_d_recv_x);
    tensor_release(L, &local_d_recv_probs);
    return rc;
}

/* `stream` waits for the WGRADs a deferred backward of L left running (nothing when none is pending). */
moert_result moert_layer_join_wgrads(moert_layer *L, moert_stream stream)
{
    moert_result rc = MOERT_OK;
    const moert_host *h = L->core_host;
    if (!L->wgrad_pending) return MOERT_OK;
    HOST_CALL(h->stream_wait_event(h, stream, L->wgrad_join_event), "joining the wgrad stream", MOERT_ACT_COUNT);
    L->wgrad_pending = false;
fail:
    return rc;
}

/* ---- the routed experts alone (the embedding API's moert_experts_forward / _backward) ---- */

/* Takes the caller's rows per local expert for the grouped GEMMs: a copy on the device, and on the host when the
 * caller's are in host memory (then checked against the rows, and whether rows are left over as padding). */
static moert_result experts_set_counts(moert_layer *L, const moert_tensor *counts, int64_t rows)
{
    moert_result rc = MOERT_OK;
    const moert_host *h = L->core_host;
    const int64_t el = L->info.num_local_experts;
    MOERT_CHECK(tensor_alloc(L, &L->experts_counts, MOERT_I64, 1, el, 0, 0));
    HOST_CALL(h->memcpy_async(h, L->experts_counts.data, L->experts_counts.device, counts->data, counts->device,
                              (size_t)el * sizeof(int64_t), L->stream),
              "copying tokens_per_expert", MOERT_ACT_COUNT);
    L->experts_counts_host = NULL;
    L->experts_padded = true; /* counts on the device: the sum is not known here */
    if (counts->device.type != MOERT_DEVICE_CPU && counts->device.type != MOERT_DEVICE_CUDA_HOST) return MOERT_OK;
    if (!L->experts_counts_host_buf) {
        L->experts_counts_host_buf = calloc((size_t)el, sizeof(int64_t));
        if (!L->experts_counts_host_buf) return moert_error(MOERT_ERR_OUT_OF_MEMORY, "tokens_per_expert copy");
    }
    memcpy(L->experts_counts_host_buf, counts->data, (size_t)el * sizeof(int64_t));
    int64_t sum = 0;
    for (int64_t e = 0; e < el; e++) {
        const int64_t count = L->experts_counts_host_buf[e];
        if (count < 0)
            return moert_error(MOERT_ERR_INVALID_ARGUMENT, "tokens_per_expert[%lld] is %lld, expected >= 0",
                               (long long)e, (long long)count);
        if (count > INT64_MAX - sum) /* before adding: the sum never overflows */
            return moert_error(MOERT_ERR_INVALID_ARGUMENT,
                               "tokens_per_expert[%lld] is %lld: the counts sum past any number of rows", (long long)e,
                               (long long)count);
        sum += count;
    }
    if (sum > rows)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "tokens_per_expert sums to %lld, more than the %lld rows",
                           (long long)sum, (long long)rows);
    L->experts_counts_host = L->experts_counts_host_buf;
    L->experts_padded = sum < rows;
fail:
    return rc;
}

/* The same GEMMs, SwiGLU and prob multiply as moert_layer_forward's experts, on the caller's rows. Padding rows (past
 * the counts) are zeroed where a GEMM does not write them, so nothing uninitialised reaches an output. */
moert_result moert_layer_experts_forward(moert_layer *L, const moert_tensor *x, const moert_tensor *counts,
                                         const moert_tensor *probs, moert_tensor *y)
{
    moert_result rc = MOERT_OK;
    const moert_layer_info *in = &L->info;
    const int64_t rows = x->shape[0];
    MOERT_CHECK(release_saved(L));
    L->x = *x;
    L->experts_only = true;
    moert_act_store_begin_forward(&L->acts);
    MOERT_CHECK(experts_set_counts(L, counts, rows));
    /* the probs are copied (the caller may reuse theirs at once); none: 1, the caller applied them */
    MOERT_CHECK(tensor_alloc(L, &L->recv_probs, L->param_dtype, 1, rows, 0, 0));
    if (probs)
        MOERT_CHECK(moert_copy(L->stream, probs, &L->recv_probs));
    else
        MOERT_CHECK(moert_fill(L->stream, &L->recv_probs, 1.0));

    moert_tensor *fc1_out = moert_act_store_tensor(&L->acts, MOERT_ACT_FC1_OUT);
    moert_tensor *act = moert_act_store_tensor(&L->acts, MOERT_ACT_SWIGLU_OUT);
    MOERT_CHECK(moert_act_store_alloc(&L->acts, MOERT_ACT_FC1_OUT, in->dtype, rows, 2 * in->ffn_hidden));
    if (L->experts_padded) MOERT_CHECK(moert_zero(L->stream, fc1_out));
    MOERT_CHECK(run_gemm(L, MOERT_GEMM_FC1, MOERT_GEMM_FORWARD, x, NULL, fc1_out, NULL));
    MOERT_CHECK(moert_act_store_put(&L->acts, MOERT_ACT_FC1_OUT, MOERT_MEMORY_KEEP));
    MOERT_CHECK(moert_act_store_alloc(&L->acts, MOERT_ACT_SWIGLU_OUT, in->dtype, rows, in->ffn_hidden));
    MOERT_CHECK(moert_swiglu_forward(L->stream, fc1_out, &L->recv_probs, rows, act));
    MOERT_CHECK(moert_act_store_put(&L->acts, MOERT_ACT_SWIGLU_OUT, MOERT_MEMORY_KEEP));
    moert_act_store_after_last_use(&L->acts, MOERT_ACT_FC1_OUT);
    if (L->experts_padded) MOERT_CHECK(moert_zero(L->stream, y));
    MOERT_CHECK(run_gemm(L, MOERT_GEMM_FC2, MOERT_GEMM_FORWARD, act, NULL, y, NULL));
    moert_act_store_after_last_use(&L->acts, MOERT_ACT_SWIGLU_OUT);
    MOERT_CHECK(moert_act_store_end_forward(&L->acts));
fail:
    return rc;
}

moert_result moert_layer_experts_backward(moert_layer *L, const moert_tensor *d_y, moert_tensor *d_x,
                                          moert_tensor *d_probs, bool overwrite)
{
    moert_result rc = MOERT_OK;
    const moert_layer_info *in = &L->info;
    const int64_t rows = d_y->shape[0];
    moert_tensor d_act = {0}, d_fc1 = {0}, d_recv_probs = {0};
    if (!L->experts_only)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "layer %d: no experts forward to run the backward of",
                           in->layer_index);
    if (overwrite) { /* the first WGRAD of each weight writes its gradient, or it is zeroed now */
        const bool lazy = lazy_wgrad_zero(L);
        for (int w = 0; w < 2; w++) {
            L->grad_unwritten[w] = lazy;
            if (!lazy)
                MOERT_CHECK(
                    moert_zero(L->stream, &L->params[w == MOERT_GEMM_FC1 ? MOERT_PARAM_FC1 : MOERT_PARAM_FC2].grad));
        }
    }
    moert_tensor *fc1_out = moert_act_store_tensor(&L->acts, MOERT_ACT_FC1_OUT);
    moert_tensor *act = moert_act_store_tensor(&L->acts, MOERT_ACT_SWIGLU_OUT);
    MOERT_CHECK(tensor_alloc(L, &d_act, in->dtype, 2, rows, in->ffn_hidden, 0));
    if (L->experts_padded) MOERT_CHECK(moert_zero(L->stream, &d_act));
    MOERT_CHECK(run_gemm(L, MOERT_GEMM_FC2, MOERT_GEMM_DGRAD, NULL, d_y, NULL, &d_act));
    MOERT_CHECK(run_gemm(L, MOERT_GEMM_FC2, MOERT_GEMM_WGRAD, act, d_y, NULL, NULL));
    moert_act_store_done(&L->acts, MOERT_ACT_SWIGLU_OUT);
    MOERT_CHECK(tensor_alloc(L, &d_fc1, in->dtype, 2, rows, 2 * in->ffn_hidden, 0));
    MOERT_CHECK(tensor_alloc(L, &d_recv_probs, L->param_dtype, 1, rows, 0, 0));
    MOERT_CHECK(moert_swiglu_backward(L->stream, &d_act, fc1_out, &L->recv_probs, rows, &d_fc1, &d_recv_probs));
    moert_act_store_done(&L->acts, MOERT_ACT_FC1_OUT);
    if (L->experts_padded) MOERT_CHECK(moert_zero(L->stream, d_x));
    MOERT_CHECK(run_gemm(L, MOERT_GEMM_FC1, MOERT_GEMM_DGRAD, NULL, &d_fc1, NULL, d_x));
    MOERT_CHECK(run_gemm(L, MOERT_GEMM_FC1, MOERT_GEMM_WGRAD, &L->x, &d_fc1, NULL, NULL));
    if (d_probs) MOERT_CHECK(moert_copy(L->stream, &d_recv_probs, d_probs));
    MOERT_CHECK(zero_unwritten_grads(L));
    MOERT_CHECK(release_saved(L));
fail:
    tensor_release(L, &d_act);
    tensor_release(L, &d_fc1);
    tensor_release(L, &d_recv_probs);
    return rc;
}
