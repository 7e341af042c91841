/* SPDX-License-Identifier: Apache-2.0 */
/* Activation store: keep, drop or offload the activations a layer's forward saves for its backward. */
#include "activation_store.h"

#include <string.h>

#include "error.h"
#include "host.h"
#ifdef MOERT_HAVE_CUDA
#include "cuda/device.h"
#endif

/* A failed host service call as a core error naming what the store was doing (and the activation, if any:
 * a < MOERT_STORE_SLOTS). */
static moert_result host_failed(const moert_activation_store *S, moert_result rc, const char *what, int a)
{
    return moert_host_call_failed(S->host, rc, what, a < MOERT_STORE_SLOTS ? moert_act_store_slot_name(a) : NULL,
                                  S->layer_index);
}

#define HOST_CALL(call, what, a)                                                                                       \
    do {                                                                                                               \
        rc = (call);                                                                                                   \
        if (rc != MOERT_OK) {                                                                                          \
            rc = host_failed(S, rc, what, a);                                                                          \
            goto fail;                                                                                                 \
        }                                                                                                              \
    } while (0)

const char *moert_act_store_slot_name(int a)
{
    if (a >= 0 && a < MOERT_ACT_COUNT) return moert_activation_name((moert_activation)a);
    if (a == MOERT_STORE_SHARED_FC1_OUT) return "shared_fc1_out";
    if (a == MOERT_STORE_SHARED_ACT) return "shared_act";
    return "unknown";
}

/* The stream slot a is produced and used on. */
static moert_stream stream_of(const moert_activation_store *S, int a)
{
    return S->slot_stream[a] ? S->slot_stream[a] : S->stream;
}

void moert_act_store_set_stream(moert_activation_store *S, int a, moert_stream stream) { S->slot_stream[a] = stream; }

static void tensor_release(moert_activation_store *S, moert_tensor *t)
{
    if (t->data) S->host->free(S->host, t->device, t->data);
    t->data = NULL;
}

/* Whether the D2H copy of activation a has finished (on the CPU it was synchronous). */
static moert_result offload_done(const moert_activation_store *S, int a, bool *done)
{
    *done = true;
#ifdef MOERT_HAVE_CUDA
    if (S->device.type == MOERT_DEVICE_CUDA) return moert_cuda_event_query(S->offload_event[a], done);
#endif
    return MOERT_OK;
}

void moert_act_store_init(moert_activation_store *S, const moert_host *host, moert_stream stream, moert_device device,
                          int layer_index)
{
    memset(S, 0, sizeof *S);
    S->host = host;
    S->stream = stream;
    S->device = device;
    S->layer_index = layer_index;
}

moert_result moert_act_store_alloc(moert_activation_store *S, int a, moert_dtype dtype, int64_t rows, int64_t cols)
{
    moert_tensor *t = &S->saved[a];
    *t = moert_tensor_2d(NULL, S->device, dtype, rows, cols);
    size_t bytes = moert_tensor_bytes(t);
    moert_result rc = S->host->alloc(S->host, S->device, bytes ? bytes : 1, &t->data);
    if (rc != MOERT_OK)
        return moert_error(rc, "allocating %zu bytes for %s of layer %d: %s", bytes, moert_act_store_slot_name(a),
                           S->layer_index, moert_host_take_error((moert_host *)S->host));
    S->place[a] = MOERT_PLACE_DEVICE;
    return MOERT_OK;
}

/* Waits for the copy streams (before their buffers are freed or replaced). */
static moert_result sync_copy_streams(moert_activation_store *S)
{
    moert_result rc = MOERT_OK;
    const moert_host *h = S->host;
    if (!S->copy_streams_ready) return MOERT_OK;
    HOST_CALL(h->stream_synchronize(h, S->d2h_stream), "synchronizing the offload stream", MOERT_STORE_SLOTS);
    HOST_CALL(h->stream_synchronize(h, S->h2d_stream), "synchronizing the reload stream", MOERT_STORE_SLOTS);
fail:
    return rc;
}

/* The D2H and H2D streams and their events, created at the first offload. */
static moert_result ensure_copy_streams(moert_activation_store *S)
{
    moert_result rc = MOERT_OK;
    const moert_host *h = S->host;
    if (S->copy_streams_ready) return MOERT_OK;
    /* created one by one; on failure the ones made so far are destroyed */
    moert_stream d2h = NULL, h2d = NULL;
    moert_event compute = NULL, offload[MOERT_STORE_SLOTS] = {NULL}, reload[MOERT_STORE_SLOTS] = {NULL};
    HOST_CALL(h->stream_create(h, &d2h), "creating the offload stream", MOERT_STORE_SLOTS);
    HOST_CALL(h->stream_create(h, &h2d), "creating the reload stream", MOERT_STORE_SLOTS);
    HOST_CALL(h->event_create(h, &compute), "creating the offload events", MOERT_STORE_SLOTS);
    for (int a = 0; a < MOERT_STORE_SLOTS; a++) {
        HOST_CALL(h->event_create(h, &offload[a]), "creating the offload events", MOERT_STORE_SLOTS);
        HOST_CALL(h->event_create(h, &reload[a]), "creating the offload events", MOERT_STORE_SLOTS);
    }
    S->d2h_stream = d2h;
    S->h2d_stream = h2d;
    S->compute_event = compute;
    for (int a = 0; a < MOERT_STORE_SLOTS; a++) {
        S->offload_event[a] = offload[a];
        S->reload_event[a] = reload[a];
    }
    S->copy_streams_ready = true;
    return MOERT_OK;
fail:
    for (int a = 0; a < MOERT_STORE_SLOTS; a++) {
        if (offload[a]) h->event_destroy(h, offload[a]);
        if (reload[a]) h->event_destroy(h, reload[a]);
    }
    if (compute) h->event_destroy(h, compute);
    if (d2h) h->stream_destroy(h, d2h);
    if (h2d) h->stream_destroy(h, h2d);
    return rc;
}

/* Makes copy_stream wait for everything queued on `after` (the compute stream, or a slot's own stream) so far. */
static moert_result order_after(moert_activation_store *S, moert_stream copy_stream, moert_stream after, int a)
{
    moert_result rc = MOERT_OK;
    const moert_host *h = S->host;
    /* a wait takes the event's latest record at the time of the call, so one event serves every such order */
    HOST_CALL(h->event_record(h, S->compute_event, after), "ordering the copy of", a);
    HOST_CALL(h->stream_wait_event(h, copy_stream, S->compute_event), "ordering the copy of", a);
fail:
    return rc;
}

/* Pinned host room for `bytes` of activation a: kept across steps, grown (by an eighth more than asked, so a step
 * whose capacity grows a little does not allocate again) only when a step needs more. */
static moert_result reserve_pinned(moert_activation_store *S, int a, size_t bytes)
{
    moert_result rc = MOERT_OK;
    const moert_host *h = S->host;
    if (bytes <= S->pinned_capacity[a]) return MOERT_OK;
    if (S->pinned[a]) {
        MOERT_CHECK(sync_copy_streams(S)); /* the old buffer may still be in a copy */
        h->free_pinned(h, S->pinned[a]);
        S->pinned_bytes -= (int64_t)S->pinned_capacity[a];
        S->pinned[a] = NULL;
        S->pinned_capacity[a] = 0;
    }
    size_t want = bytes + bytes / 8;
    want = (want + 4095) / 4096 * 4096;
    HOST_CALL(h->alloc_pinned(h, want, &S->pinned[a]), "allocating pinned host memory for", a);
    S->pinned_capacity[a] = want;
    S->pinned_bytes += (int64_t)want;
    S->pinned_allocations++;
fail:
    return rc;
}

void moert_act_store_begin_forward(moert_activation_store *S)
{
    memset(S->saved_bytes, 0, sizeof S->saved_bytes);
    memset(S->held_bytes, 0, sizeof S->held_bytes);
    S->kept_bytes_peak = S->recompute_saved_bytes = S->offload_saved_bytes = S->offload_cancelled_bytes = 0;
}

/* Offload: the D2H stream is ordered after the compute stream's work so far (the activation's production), and the
 * copy into the pinned buffer is issued on it at once, or, under defer_start, queued for start_offloads. Either way
 * it overlaps the compute that follows. */
moert_result moert_act_store_put(moert_activation_store *S, int a, moert_memory_action action)
{
    moert_result rc = MOERT_OK;
    S->saved_bytes[a] = (int64_t)moert_tensor_bytes(&S->saved[a]);
    S->action[a] = action;
    switch (action) {
    case MOERT_MEMORY_KEEP:
    case MOERT_MEMORY_RECOMPUTE: break;
    case MOERT_MEMORY_OFFLOAD:
        MOERT_CHECK(ensure_copy_streams(S));
        MOERT_CHECK(reserve_pinned(S, a, moert_tensor_bytes(&S->saved[a])));
        MOERT_CHECK(order_after(S, S->d2h_stream, stream_of(S, a), a)); /* after the stream that produced it */
        S->offload_queued[a] = true;
        if (!S->defer_start) MOERT_CHECK(moert_act_store_start_offloads(S));
        break;
    default:
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "unknown memory action %d for %s", (int)action,
                           moert_act_store_slot_name(a));
    }
fail:
    return rc;
}

/* Each queued copy reads the device buffer: saved[a] until its last forward use, offload_pending[a] after it. */
moert_result moert_act_store_start_offloads(moert_activation_store *S)
{
    moert_result rc = MOERT_OK;
    const moert_host *h = S->host;
    for (int a = 0; a < MOERT_STORE_SLOTS; a++) {
        if (!S->offload_queued[a]) continue;
        const moert_tensor *t = S->offload_pending[a].data ? &S->offload_pending[a] : &S->saved[a];
        HOST_CALL(
            h->memcpy_async(h, S->pinned[a], moert_cpu(), t->data, t->device, moert_tensor_bytes(t), S->d2h_stream),
            "offloading", a);
        HOST_CALL(h->event_record(h, S->offload_event[a], S->d2h_stream), "offloading", a);
        S->offload_queued[a] = false;
    }
fail:
    return rc;
}

void moert_act_store_after_last_use(moert_activation_store *S, int a)
{
    switch (S->action[a]) {
    case MOERT_MEMORY_RECOMPUTE:
        tensor_release(S, &S->saved[a]);
        S->place[a] = MOERT_PLACE_DROPPED;
        S->recompute_saved_bytes += S->saved_bytes[a];
        break;
    case MOERT_MEMORY_OFFLOAD:
        S->offload_pending[a] = S->saved[a];
        S->saved[a].data = NULL;
        S->place[a] = MOERT_PLACE_HOST;
        S->offload_saved_bytes += S->saved_bytes[a];
        break;
    default:
        S->place[a] = MOERT_PLACE_DEVICE;
        S->held_bytes[a] = S->saved_bytes[a];
        break;
    }
}

moert_result moert_act_store_end_forward(moert_activation_store *S)
{
    for (int a = 0; a < MOERT_STORE_SLOTS; a++) S->kept_bytes_peak += S->held_bytes[a];
    return S->defer_release ? MOERT_OK : moert_act_store_release_offloaded(S);
}

moert_result moert_act_store_release_offloaded(moert_activation_store *S)
{
    moert_result rc = MOERT_OK;
    const moert_host *h = S->host;
    MOERT_CHECK(moert_act_store_start_offloads(S)); /* a buffer is never freed before its copy */
    for (int a = 0; a < MOERT_STORE_SLOTS; a++) {
        if (!S->offload_pending[a].data) continue;
        /* the pool hands a block freed on the compute stream to the next compute-stream request at once: the
         * compute stream must first wait for the D2H copy still reading it */
        HOST_CALL(h->stream_wait_event(h, S->stream, S->offload_event[a]), "waiting for the offload copy of", a);
        if (stream_of(S, a) != S->stream) /* a shared expert's slot may be freed on its own stream */
            HOST_CALL(h->stream_wait_event(h, stream_of(S, a), S->offload_event[a]), "waiting for the offload copy of",
                      a);
        tensor_release(S, &S->offload_pending[a]);
    }
fail:
    return rc;
}

moert_result moert_act_store_release_finished(moert_activation_store *S)
{
    for (int a = 0; a < MOERT_STORE_SLOTS; a++) {
        if (!S->offload_pending[a].data || S->offload_queued[a]) continue;
        bool done = true;
        moert_result rc = offload_done(S, a, &done);
        if (rc != MOERT_OK) return rc;
        if (done) tensor_release(S, &S->offload_pending[a]);
    }
    return MOERT_OK;
}

/* Issues the H2D copy of offloaded activation a into a new device buffer, after the compute stream's work so far (the
 * pool may hand out a block that work still uses) and after its D2H copy. When the D2H copy has not finished yet, its
 * device buffer was never freed: that buffer is used as it is (the offload is cancelled and counted as kept), so
 * neither stream waits for a copy that could not hide behind the forward. */
static moert_result start_reload(moert_activation_store *S, int a)
{
    moert_result rc = MOERT_OK;
    const moert_host *h = S->host;
    if (S->offload_pending[a].data) {
        bool done = false; /* a copy never issued is not done (and is dropped below) */
        if (!S->offload_queued[a]) MOERT_CHECK(offload_done(S, a, &done));
        if (!done) {
            S->saved[a] = S->offload_pending[a];
            S->offload_pending[a].data = NULL;
            S->offload_queued[a] = false;
            S->place[a] = MOERT_PLACE_DEVICE;
            S->offload_saved_bytes -= S->saved_bytes[a];
            S->kept_bytes_peak += S->saved_bytes[a];
            S->offload_cancelled_bytes += S->saved_bytes[a];
            return MOERT_OK;
        }
    }
    MOERT_CHECK(moert_act_store_release_offloaded(S));
    /* the same shape as when it was saved: saved_bytes[a] over the pinned copy */
    moert_tensor *t = &S->saved[a];
    MOERT_CHECK(moert_act_store_alloc(S, a, t->dtype, t->shape[0], t->shape[1]));
    MOERT_CHECK(order_after(S, S->h2d_stream, S->stream, a));
    if (stream_of(S, a) != S->stream) MOERT_CHECK(order_after(S, S->h2d_stream, stream_of(S, a), a));
    HOST_CALL(h->stream_wait_event(h, S->h2d_stream, S->offload_event[a]), "reloading", a);
    HOST_CALL(h->memcpy_async(h, t->data, t->device, S->pinned[a], moert_cpu(), moert_tensor_bytes(t), S->h2d_stream),
              "reloading", a);
    HOST_CALL(h->event_record(h, S->reload_event[a], S->h2d_stream), "reloading", a);
    S->place[a] = MOERT_PLACE_LOADING;
fail:
    return rc;
}

moert_result moert_act_store_prefetch(moert_activation_store *S)
{
    moert_result rc = MOERT_OK;
    for (int a = 0; a < MOERT_STORE_SLOTS; a++)
        if (S->place[a] == MOERT_PLACE_HOST) MOERT_CHECK(start_reload(S, a));
fail:
    return rc;
}

moert_result moert_act_store_get(moert_activation_store *S, int a, bool *dropped)
{
    moert_result rc = MOERT_OK;
    const moert_host *h = S->host;
    *dropped = false;
    switch (S->place[a]) {
    case MOERT_PLACE_DEVICE: return MOERT_OK;
    case MOERT_PLACE_DROPPED: *dropped = true; return MOERT_OK;
    case MOERT_PLACE_HOST:
        MOERT_CHECK(start_reload(S, a));
        if (S->place[a] == MOERT_PLACE_DEVICE) return MOERT_OK; /* the offload was cancelled */
        /* fall through */
    case MOERT_PLACE_LOADING:
        HOST_CALL(h->stream_wait_event(h, stream_of(S, a), S->reload_event[a]), "waiting for the reload of", a);
        S->place[a] = MOERT_PLACE_DEVICE;
        return MOERT_OK;
    }
fail:
    return rc;
}

void moert_act_store_done(moert_activation_store *S, int a) { tensor_release(S, &S->saved[a]); }

moert_result moert_act_store_release(moert_activation_store *S)
{
    moert_result rc = MOERT_OK;
    const moert_host *h = S->host;
    MOERT_CHECK(moert_act_store_release_offloaded(S));
    for (int a = 0; a < MOERT_STORE_SLOTS; a++) {
        if (S->place[a] == MOERT_PLACE_LOADING)
            HOST_CALL(h->stream_wait_event(h, S->stream, S->reload_event[a]), "waiting for the reload copy of", a);
        tensor_release(S, &S->saved[a]);
        S->place[a] = MOERT_PLACE_DEVICE;
    }
fail:
    return rc;
}

void moert_act_store_free(moert_activation_store *S)
{
    const moert_host *h = S->host;
    if (!h) return; /* never initialised */
    /* copies in flight read or write buffers freed below */
    if (sync_copy_streams(S) != MOERT_OK) moert_error_clear();
    if (moert_act_store_release(S) != MOERT_OK) moert_error_clear();
    for (int a = 0; a < MOERT_STORE_SLOTS; a++) {
        if (S->pinned[a]) h->free_pinned(h, S->pinned[a]);
        S->pinned[a] = NULL;
        S->pinned_capacity[a] = 0;
    }
    S->pinned_bytes = 0;
    if (S->copy_streams_ready) {
        for (int a = 0; a < MOERT_STORE_SLOTS; a++) {
            h->event_destroy(h, S->offload_event[a]);
            h->event_destroy(h, S->reload_event[a]);
        }
        h->event_destroy(h, S->compute_event);
        h->stream_destroy(h, S->d2h_stream);
        h->stream_destroy(h, S->h2d_stream);
        S->copy_streams_ready = false;
    }
}
