/* SPDX-License-Identifier: Apache-2.0 */
/* Micro-batch overlap: slot 1 of every layer and the merged forward and backward (overlap.h). */
#include "overlap.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "error.h"
#include "host.h"
#ifdef MOERT_HAVE_CUDA
#include "cuda/device.h"
#include "cuda/pool.h"
#endif

static moert_result host_error(const moert_host *h, moert_result rc, const char *what)
{
    return moert_error(rc, "micro-batch overlap: %s: %s", what, moert_host_take_error((moert_host *)h));
}

#ifdef MOERT_HAVE_CUDA
/* The communication stream and each slot's fence events (overlap.h), on `device`, with the rank's SM-yield words
 * (NULL: none) and the SMs they leave. */
static moert_result comm_stream_create(moert_overlap *o, int device, int32_t *sm_yield, int32_t sms)
{
    moert_result rc = MOERT_OK;
    /* high priority: a dispatcher's kernels take SMs first as they free up, as on the compute streams */
    MOERT_CHECK(moert_cuda_stream_create_high_priority(device, &o->comm[0].stream));
    for (int slot = 0; slot < o->slots; slot++) {
        o->comm[slot].stream = o->comm[0].stream;
        MOERT_CHECK(moert_cuda_event_create(device, false, &o->comm[slot].enter));
        MOERT_CHECK(moert_cuda_event_create(device, false, &o->comm[slot].leave));
        /* one word: every slot's calls are in order on the one stream */
        o->comm[slot].sm_yield = sm_yield;
        o->comm[slot].sm_yield_sms = sms;
    }
fail:
    if (rc != MOERT_OK) moert_error_prefix("micro-batch overlap: creating the communication stream");
    return rc;
}
#endif

/* The twin of slot `slot` (1 ..): its stack, and on CUDA its stream and events. Collective. */
static moert_result twin_init(moert_overlap *o, int slot, const moert_stack_setup *setup)
{
    moert_result rc = MOERT_OK;
    moert_stack_setup twin = *setup;
    twin.twin_of = o->primary;
    twin.slot = slot;
    o->slots = slot + 1; /* finalize takes down what this began */
#ifdef MOERT_HAVE_CUDA
    if (setup->device.type == MOERT_DEVICE_CUDA) {
        const moert_host *h = o->primary->core_host;
        /* as high a priority as the rank's compute stream: the micro-batches' work is equal */
        MOERT_CHECK(moert_cuda_stream_create_high_priority(setup->device.id, &o->streams[slot - 1]));
        if ((rc = h->event_create(h, &o->fork_events[slot - 1])) != MOERT_OK ||
            (rc = h->event_create(h, &o->join_events[slot - 1])) != MOERT_OK) {
            rc = host_error(h, rc, "creating its events");
            goto fail;
        }
        twin.stream = o->streams[slot - 1];
    }
#endif
    MOERT_CHECK(moert_stack_init(&o->twins[slot - 1], &twin));
fail:
    return rc;
}

moert_result moert_overlap_init(moert_overlap *o, moert_stack *primary, const moert_stack_setup *setup, int slots,
                                bool merge)
{
    moert_result rc = MOERT_OK;
    memset(o, 0, sizeof *o);
    o->primary = primary;
    o->slots = 1;
    if (slots < 2 || slots > MOERT_OVERLAP_MAX_SLOTS)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "micro-batch slots: %d, expected 2 .. %d", slots,
                           MOERT_OVERLAP_MAX_SLOTS);
    o->merge = merge;
#ifdef MOERT_HAVE_CUDA
    if (setup->device.type == MOERT_DEVICE_CUDA) {
        o->pool = setup->pool;
        o->interleave = true;
    }
#endif
    for (int slot = 1; slot < slots; slot++) MOERT_CHECK(twin_init(o, slot, setup));
#ifdef MOERT_HAVE_CUDA
    /* under the overlap every slot's dispatcher calls go to the communication stream */
    if (merge && setup->device.type == MOERT_DEVICE_CUDA) {
        MOERT_CHECK(
            comm_stream_create(o, setup->device.id, setup->sm_yield, (int32_t)setup->cfg->parallel.overlap_comm_sms));
        for (int l = 0; l < primary->num_layers; l++) {
            primary->layers[l].comm = &o->comm[0];
            for (int slot = 1; slot < o->slots; slot++) o->twins[slot - 1].layers[l].comm = &o->comm[slot];
        }
    }
#endif
fail:
    return rc;
}

#ifdef MOERT_HAVE_CUDA
/* Waits for a stream's work, then destroys it; blocks the pool has cached as freed on it are reused only through
 * their events from now on (a new stream may get the same handle). */
static void stream_release(moert_overlap *o, moert_stream s)
{
    if (!s) return;
    if (moert_cuda_stream_synchronize(s) != MOERT_OK) moert_error_clear();
    if (o->pool) moert_cuda_pool_forget_stream(o->pool, s);
    moert_cuda_stream_destroy(s);
}
#endif

static void helper_stop(struct moert_overlap_helper *hp);

void moert_overlap_finalize(moert_overlap *o)
{
    if (!o->primary) return;
    const moert_host *h = o->primary->core_host;
    helper_stop(o->helper);
    o->helper = NULL;
#ifdef MOERT_HAVE_CUDA
    /* the dispatchers' last work is done before any of their instances goes (slot 0's after this) */
    if (o->comm[0].stream && moert_cuda_stream_synchronize(o->comm[0].stream) != MOERT_OK) moert_error_clear();
#endif
    for (int l = 0; o->primary->layers && l < o->primary->num_layers; l++) o->primary->layers[l].comm = NULL;
    for (int slot = 1; slot < o->slots; slot++) {
        moert_stack *T = &o->twins[slot - 1];
        /* the parameters are slot 0's: the twin's layers only borrowed them */
        for (int l = 0; T->layers && l < T->num_layers; l++) memset(T->layers[l].params, 0, sizeof T->layers[l].params);
        moert_stack_finalize(T);
        if (o->fork_events[slot - 1]) h->event_destroy(h, o->fork_events[slot - 1]);
        if (o->join_events[slot - 1]) h->event_destroy(h, o->join_events[slot - 1]);
#ifdef MOERT_HAVE_CUDA
        stream_release(o, o->streams[slot - 1]);
#endif
    }
#ifdef MOERT_HAVE_CUDA
    stream_release(o, o->comm[0].stream);
    for (int slot = 0; slot < MOERT_OVERLAP_MAX_SLOTS; slot++) {
        if (o->comm[slot].enter) moert_cuda_event_destroy(o->comm[slot].enter);
        if (o->comm[slot].leave) moert_cuda_event_destroy(o->comm[slot].leave);
    }
#endif
    memset(o, 0, sizeof *o);
}

moert_layer *moert_overlap_layer(moert_overlap *o, int l, int slot)
{
    moert_layer *P = &o->primary->layers[l];
    if (slot == 0 || slot >= o->slots) return P;
    moert_layer *T = &o->twins[slot - 1].layers[l];
    memcpy(T->params, P->params, sizeof T->params);
    T->params_borrowed = true;
    T->no_residual = P->no_residual;
    memcpy(T->grad_unwritten, P->grad_unwritten, sizeof T->grad_unwritten);
    memcpy(T->shared_grad_unwritten, P->shared_grad_unwritten, sizeof T->shared_grad_unwritten);
    return T;
}

/* After a backward on another slot than 0: its WGRADs' lazy zeroing state is slot 0's again. */
static void sync_back(moert_overlap *o, int l, int slot)
{
    if (slot == 0 || slot >= o->slots) return;
    moert_layer *P = &o->primary->layers[l], *T = &o->twins[slot - 1].layers[l];
    memcpy(P->grad_unwritten, T->grad_unwritten, sizeof P->grad_unwritten);
    memcpy(P->shared_grad_unwritten, T->shared_grad_unwritten, sizeof P->shared_grad_unwritten);
}

/* Slot `slot`'s stream (1 ..) waits for slot 0's work so far (CUDA). */
static moert_result fork_twin(moert_overlap *o, int slot)
{
    moert_result rc = MOERT_OK;
    const moert_host *h = o->primary->core_host;
    if (slot == 0 || !o->streams[slot - 1]) return MOERT_OK;
    if ((rc = h->event_record(h, o->fork_events[slot - 1], o->primary->layers[0].stream)) != MOERT_OK ||
        (rc = h->stream_wait_event(h, o->streams[slot - 1], o->fork_events[slot - 1])) != MOERT_OK)
        return host_error(h, rc, "forking a slot's stream");
    return MOERT_OK;
}

/* Slot 0's stream waits for slot `slot`'s work (CUDA). */
static moert_result join_twin(moert_overlap *o, int slot)
{
    moert_result rc = MOERT_OK;
    const moert_host *h = o->primary->core_host;
    if (slot == 0 || !o->streams[slot - 1]) return MOERT_OK;
    if ((rc = h->event_record(h, o->join_events[slot - 1], o->streams[slot - 1])) != MOERT_OK ||
        (rc = h->stream_wait_event(h, o->primary->layers[0].stream, o->join_events[slot - 1])) != MOERT_OK)
        return host_error(h, rc, "joining a slot's stream");
    return MOERT_OK;
}

void moert_overlap_sync_back(moert_overlap *o, int l, int slot) { sync_back(o, l, slot); }

moert_result moert_overlap_fork(moert_overlap *o, int slot)
{
    return slot > 0 && slot < o->slots ? fork_twin(o, slot) : MOERT_OK;
}

moert_result moert_overlap_join(moert_overlap *o, int slot)
{
    return slot > 0 && slot < o->slots ? join_twin(o, slot) : MOERT_OK;
}

moert_result moert_overlap_precision_end_step(moert_overlap *o)
{
    moert_result rc = MOERT_OK;
    for (int slot = 1; slot < o->slots && rc == MOERT_OK; slot++) {
        MOERT_CHECK(fork_twin(o, slot));
        for (int l = 0; l < o->twins[slot - 1].num_layers && rc == MOERT_OK; l++) {
            moert_layer *T = &o->twins[slot - 1].layers[l];
            const moert_precision_v1 *p = (const moert_precision_v1 *)T->precision.plugin->header;
            if ((rc = p->end_step(T->precision.ctx, T->stream)) != MOERT_OK)
                rc = moert_layer_plugin_failed(T, &T->precision, "end_step", rc);
        }
        const moert_result rc_join = join_twin(o, slot);
        if (rc == MOERT_OK) rc = rc_join;
    }
fail:
    return rc;
}

static moert_result check_slot(const moert_overlap *o, int l, int slot)
{
    if (l < 0 || l >= o->primary->num_layers)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "micro-batch overlap: layer %d, expected 0 .. %d", l,
                           o->primary->num_layers - 1);
    if (slot < 0 || slot >= o->slots)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "micro-batch slots: slot %d, expected 0 .. %d", slot,
                           o->slots - 1);
    return MOERT_OK;
}

moert_result moert_overlap_forward(moert_overlap *o, int l, int slot, const moert_tensor *x, moert_tensor *y)
{
    moert_result rc = MOERT_OK, rc_join = MOERT_OK;
    MOERT_CHECK(check_slot(o, l, slot));
    MOERT_CHECK(fork_twin(o, slot));
    rc = moert_layer_forward(moert_overlap_layer(o, l, slot), x, y);
    rc_join = join_twin(o, slot);
    if (rc == MOERT_OK) rc = rc_join;
fail:
    return rc;
}

/* Slot `slot`'s layer l, without moert_overlap_layer's binding of slot 0's parameters. */
static moert_layer *slot_layer(moert_overlap *o, int l, int slot)
{
    return slot == 0 ? &o->primary->layers[l] : &o->twins[slot - 1].layers[l];
}

/* Slot 0's stream waits for every WGRAD a merged call's backward left running, of every layer and slot, so that the
 * gradients are whole on it after a plain backward. */
static moert_result join_deferred_wgrads(moert_overlap *o)
{
    moert_result rc = MOERT_OK;
    const moert_stream stream = o->primary->layers[0].stream;
    for (int l = 0; l < o->primary->num_layers && rc == MOERT_OK; l++)
        for (int slot = 0; slot < o->slots && rc == MOERT_OK; slot++)
            rc = moert_layer_join_wgrads(slot_layer(o, l, slot), stream);
    return rc;
}

moert_result moert_overlap_wait_wgrads(moert_overlap *o, int l)
{
    moert_result rc = MOERT_OK;
    for (int slot = 0; slot < o->slots && rc == MOERT_OK; slot++) {
        moert_layer *L = slot_layer(o, l, slot);
        if (!L->wgrad_pending) continue;
#ifdef MOERT_HAVE_CUDA
        rc = moert_cuda_event_synchronize(L->wgrad_join_event);
#endif
        if (rc == MOERT_OK) L->wgrad_pending = false;
    }
    return rc;
}

moert_result moert_overlap_backward(moert_overlap *o, int l, int slot, const moert_tensor *d_y, moert_tensor *d_x,
                                    double loss_scale)
{
    moert_result rc = MOERT_OK, rc_join = MOERT_OK;
    MOERT_CHECK(check_slot(o, l, slot));
    MOERT_CHECK(fork_twin(o, slot));
    rc = moert_layer_backward(moert_overlap_layer(o, l, slot), d_y, d_x, loss_scale);
    sync_back(o, l, slot);
    rc_join = join_twin(o, slot);
    if (rc == MOERT_OK) rc = rc_join;
    rc_join = join_deferred_wgrads(o);
    if (rc == MOERT_OK) rc = rc_join;
fail:
    return rc;
}

/* ---- the two halves of a merged call, issued in turn ----
 *
 * The backward runs on the calling thread and the forward on a helper thread, one at a time: each runs until its
 * layer reaches a yield point (executor.c, between stages) and hands the turn to the other, so the host issues their
 * stages alternately, in the same order on every rank (their collectives meet). A half that has finished no longer
 * takes the turn. */

typedef struct turns {
    pthread_mutex_t lock;
    pthread_cond_t changed;
    _Atomic int turn; /* 0: the backward, 1: the forward; written under lock, read while spinning */
    bool done[2];
    /* how long a half that handed over the turn polls for it before it sleeps: on CUDA the GPU may idle while the
     * other thread wakes from a sleep (tens of microseconds, the kernel trace's gaps before a stage of the other half) */
    double spin_s;
} turns;

typedef struct half {
    turns *t;
    int me;
    moert_layer *L;
    const moert_tensor *in;
    moert_tensor *out;
    double loss_scale;
    moert_result rc;
    char error[1024];
} half;

/* Returns once the turn is `me`'s: polls for up to t->spin_s, then sleeps on the condition. */
static void await_turn(turns *t, int me)
{
    if (t->spin_s > 0.0) {
        const double until = moert_layer_now_seconds() + t->spin_s;
        for (unsigned i = 0;; i++) {
            if (atomic_load_explicit(&t->turn, memory_order_acquire) == me) return;
            if (i % 64 == 63 && moert_layer_now_seconds() > until) break;
        }
    }
    pthread_mutex_lock(&t->lock);
    while (atomic_load(&t->turn) != me) pthread_cond_wait(&t->changed, &t->lock);
    pthread_mutex_unlock(&t->lock);
}

static void yield_turn(void *ctx)
{
    half *hf = ctx;
    turns *t = hf->t;
    pthread_mutex_lock(&t->lock);
    const bool other_done = t->done[1 - hf->me];
    if (!other_done) {
        atomic_store(&t->turn, 1 - hf->me);
        pthread_cond_broadcast(&t->changed);
    }
    pthread_mutex_unlock(&t->lock);
    if (!other_done) await_turn(t, hf->me);
}

static void finish_turn(half *hf)
{
    turns *t = hf->t;
    pthread_mutex_lock(&t->lock);
    t->done[hf->me] = true;
    atomic_store(&t->turn, 1 - hf->me);
    pthread_cond_broadcast(&t->changed);
    pthread_mutex_unlock(&t->lock);
}

/* The thread that issues the forward halves (moert_overlap.helper): it waits for a half, runs it, and says so. One
 * thread for the rank's whole run, so that a merged call does not pay for a thread's start, its CUDA device and the
 * libraries' per-thread setup (cuBLASLt's on its first GEMM) before its forward can issue its first stage. */
typedef struct moert_overlap_helper {
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t changed;
    half *job; /* the half to run; NULL once it has run */
    bool stop;
    int device; /* the CUDA device current on the thread; -1: none set yet */
} moert_overlap_helper;

static void run_forward_half(moert_overlap_helper *hp, half *hf)
{
    await_turn(hf->t, hf->me);
#ifdef MOERT_HAVE_CUDA
    const moert_device dev = hf->L->info.device;
    if (dev.type == MOERT_DEVICE_CUDA && dev.id != hp->device) {
        hf->rc = moert_cuda_set_device(dev.id);
        hp->device = hf->rc == MOERT_OK ? dev.id : -1;
    }
#endif
    if (hf->rc == MOERT_OK) hf->rc = moert_layer_forward(hf->L, hf->in, hf->out);
    if (hf->rc != MOERT_OK) snprintf(hf->error, sizeof hf->error, "%s", moert_error_message());
    finish_turn(hf);
}

static void *helper_main(void *arg)
{
    moert_overlap_helper *hp = arg;
    pthread_mutex_lock(&hp->lock);
    for (;;) {
        while (!hp->job && !hp->stop) pthread_cond_wait(&hp->changed, &hp->lock);
        if (!hp->job) break; /* stopped */
        half *hf = hp->job;
        pthread_mutex_unlock(&hp->lock);
        run_forward_half(hp, hf);
        pthread_mutex_lock(&hp->lock);
        hp->job = NULL;
        pthread_cond_broadcast(&hp->changed);
    }
    pthread_mutex_unlock(&hp->lock);
    return NULL;
}

/* The overlap's helper thread, started at its first use; NULL where no thread could be made. */
static moert_overlap_helper *helper_of(moert_overlap *o)
{
    if (o->helper) return o->helper;
    moert_overlap_helper *hp = calloc(1, sizeof *hp);
    if (!hp) return NULL;
    hp->device = -1;
    pthread_mutex_init(&hp->lock, NULL);
    pthread_cond_init(&hp->changed, NULL);
    if (pthread_create(&hp->thread, NULL, helper_main, hp) != 0) {
        pthread_mutex_destroy(&hp->lock);
        pthread_cond_destroy(&hp->changed);
        free(hp);
        return NULL;
    }
    o->helper = hp;
    return hp;
}

/* Hands the helper a half to run. */
static void helper_post(moert_overlap_helper *hp, half *hf)
{
    pthread_mutex_lock(&hp->lock);
    hp->job = hf;
    pthread_cond_broadcast(&hp->changed);
    pthread_mutex_unlock(&hp->lock);
}

/* Waits until the helper has run the half it was handed. */
static void helper_wait(moert_overlap_helper *hp)
{
    pthread_mutex_lock(&hp->lock);
    while (hp->job) pthread_cond_wait(&hp->changed, &hp->lock);
    pthread_mutex_unlock(&hp->lock);
}

static void helper_stop(moert_overlap_helper *hp)
{
    if (!hp) return;
    pthread_mutex_lock(&hp->lock);
    hp->stop = true;
    pthread_cond_broadcast(&hp->changed);
    pthread_mutex_unlock(&hp->lock);
    pthread_join(hp->thread, NULL);
    pthread_mutex_destroy(&hp->lock);
    pthread_cond_destroy(&hp->changed);
    free(hp);
}

static moert_result run_interleaved(moert_overlap *o, moert_layer *F, const moert_tensor *x, moert_tensor *y,
                                    moert_layer *B, const moert_tensor *d_y, moert_tensor *d_x, double loss_scale)
{
    moert_overlap_helper *hp = helper_of(o);
    if (!hp) { /* no thread: one after the other */
        moert_result rc = moert_layer_forward(F, x, y);
        return rc != MOERT_OK ? rc : moert_layer_backward(B, d_y, d_x, loss_scale);
    }
    /* CUDA: poll for the turn for up to 1 ms (a stage's issue takes about that; a core per rank polls meanwhile); the
     * CPU path polls briefly only, its ranks' threads share the cores */
    turns t = {.turn = 0, .spin_s = F->info.device.type == MOERT_DEVICE_CUDA ? 1e-3 : 2e-6};
    half fwd = {.t = &t, .me = 1, .L = F, .in = x, .out = y};
    half bwd = {.t = &t, .me = 0, .L = B, .in = d_y, .out = d_x, .loss_scale = loss_scale};
    pthread_mutex_init(&t.lock, NULL);
    pthread_cond_init(&t.changed, NULL);
    F->yield = B->yield = yield_turn;
    F->yield_ctx = &fwd;
    B->yield_ctx = &bwd;
    helper_post(hp, &fwd);
    bwd.rc = moert_layer_backward(B, d_y, d_x, loss_scale);
    if (bwd.rc != MOERT_OK) snprintf(bwd.error, sizeof bwd.error, "%s", moert_error_message());
    finish_turn(&bwd);
    helper_wait(hp);
    F->yield = B->yield = NULL;
    F->yield_ctx = B->yield_ctx = NULL;
    pthread_mutex_destroy(&t.lock);
    pthread_cond_destroy(&t.changed);
    if (fwd.rc != MOERT_OK) return moert_error(fwd.rc, "%s", fwd.error);
    if (bwd.rc != MOERT_OK) return moert_error(bwd.rc, "%s", bwd.error);
    return MOERT_OK;
}

moert_result moert_overlap_forward_backward(moert_overlap *o, int fl, int fslot, const moert_tensor *x, moert_tensor *y,
                                            int bl, int bslot, const moert_tensor *d_y, moert_tensor *d_x,
                                            double loss_scale)
{
    moert_result rc = MOERT_OK, rc_join = MOERT_OK;
    MOERT_CHECK(check_slot(o, fl, fslot));
    MOERT_CHECK(check_slot(o, bl, bslot));
    if (fl == bl && fslot == bslot)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT,
                           "micro-batch overlap: the forward and the backward of layer %d on the same slot %d", fl,
                           fslot);
    MOERT_CHECK(fork_twin(o, fslot));
    if (bslot != fslot) MOERT_CHECK(fork_twin(o, bslot));
    moert_layer *F = moert_overlap_layer(o, fl, fslot), *B = moert_overlap_layer(o, bl, bslot);
    B->in_merged_call = true;
    if (o->interleave && o->merge && fslot != bslot) {
        rc = run_interleaved(o, F, x, y, B, d_y, d_x, loss_scale);
    } else {
        rc = moert_layer_forward(F, x, y);
        if (rc == MOERT_OK) rc = moert_layer_backward(B, d_y, d_x, loss_scale);
    }
    B->in_merged_call = false;
    sync_back(o, bl, bslot);
    rc_join = join_twin(o, fslot);
    if (bslot != fslot) {
        const moert_result rc_b = join_twin(o, bslot);
        if (rc_join == MOERT_OK) rc_join = rc_b;
    }
    if (rc == MOERT_OK) rc = rc_join;
fail:
    return rc;
}
