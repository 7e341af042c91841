/* SPDX-License-Identifier: Apache-2.0 */
/* Activation store: where each activation a layer's forward saves for its backward lives in between. The memory
 * policy's answer decides: kept on the device, dropped (the executor recomputes it in backward), or offloaded to pinned
 * host memory over the store's own copy streams and brought back before its first backward use. The store owns the
 * device buffers of the saved activations, the pinned buffers, the copy streams and their events, and the memory
 * figures of the last forward (docs/executor.md, "Memory").
 *
 * Order of calls for one activation a in one step:
 *   forward:  alloc(a) -> the producer writes tensor(a) -> put(a, action) -> its consumers -> after_last_use(a)
 *   between:  start_offloads / release_finished (the caller's layer boundaries), prefetch (one layer ahead)
 *   backward: get(a) (waits for its reload; says when it was dropped: the caller then allocs and recomputes it) ->
 *             its uses -> done(a)
 * On the CPU every copy is synchronous and the stream and event handles are NULL. */
#ifndef MOERT_CORE_ACTIVATION_STORE_H
#define MOERT_CORE_ACTIVATION_STORE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "moert/memory_policy.h"
#include "moert/moert.h"

/* The store's slots: the memory policy's activations (moert_activation), then the shared expert's two. The policy is
 * asked about those as fc1_out and swiglu_out with MOERT_ACTIVATION_SHARED_EXPERT in its info's flags, and they are
 * produced and used on the shared expert's stream (moert_act_store_set_stream). Every `int a` below is a slot. */
enum {
    MOERT_STORE_SHARED_FC1_OUT = MOERT_ACT_COUNT, /* the shared expert's fc1 output [T, 2Fs] */
    MOERT_STORE_SHARED_ACT,                       /* its SwiGLU output times the gate [T, Fs] */
    MOERT_STORE_SLOTS
};

/* Names of the slots: moert_activation_name's, then "shared_fc1_out", "shared_act"; "unknown" out of range. */
const char *moert_act_store_slot_name(int a);

/* Where a saved activation is between its forward and its backward. */
typedef enum moert_act_place {
    MOERT_PLACE_DEVICE = 0,  /* saved[a] holds it (valid in the compute stream's order) */
    MOERT_PLACE_DROPPED = 1, /* recompute: freed after its last forward use, recomputed in backward */
    MOERT_PLACE_HOST = 2,    /* offload: in pinned[a] (the D2H copy may still be running) */
    MOERT_PLACE_LOADING = 3  /* offload: the H2D copy into saved[a] is issued; wait for reload_event[a] before use */
} moert_act_place;

typedef struct moert_activation_store {
    const moert_host *host; /* the rank's core services: allocation, streams, events, copies */
    moert_stream stream;    /* the compute stream the activations are produced and used on */
    moert_device device;
    int layer_index; /* for messages */
    /* false (default): the device copies of offloaded activations are freed at end_forward; true: the caller frees
     * them later (release_offloaded, release_finished), so the D2H copies overlap more compute. */
    bool defer_release;
    /* false (default): an offload's D2H copy is issued as soon as the activation is put; true: it is queued (ordered
     * after the producing work already) and issued by start_offloads, which the caller calls once the next layer's
     * forward has been issued. A GPU's copy engine runs the copies of all streams in the order they were issued, so
     * a copy issued at production would hold the next layer's dispatcher count copy (a host sync) behind hundreds of
     * MB; issued after that sync, it runs behind the next layer's compute. */
    bool defer_start;

    moert_tensor saved[MOERT_STORE_SLOTS];         /* on the device (data NULL when not there) */
    moert_memory_action action[MOERT_STORE_SLOTS]; /* the memory policy's answer in the last forward */
    moert_act_place place[MOERT_STORE_SLOTS];
    /* the stream each slot is produced and used on when it is not `stream` (the shared expert's own stream); NULL:
     * `stream`. Copies are ordered after it and uses wait on it. */
    moert_stream slot_stream[MOERT_STORE_SLOTS];

    /* offload: pinned host buffers kept across steps and grown only; two copy streams and their events, created at
     * the first offload */
    void *pinned[MOERT_STORE_SLOTS];
    size_t pinned_capacity[MOERT_STORE_SLOTS];
    moert_tensor offload_pending[MOERT_STORE_SLOTS]; /* device copies the D2H stream may still read; freed by
                                                        release */
    bool offload_queued[MOERT_STORE_SLOTS];          /* D2H copy ordered but not issued yet (defer_start) */
    bool copy_streams_ready;
    moert_stream d2h_stream, h2d_stream;
    moert_event compute_event;                    /* recorded on `stream` for a copy stream to wait on */
    moert_event offload_event[MOERT_STORE_SLOTS]; /* the D2H copy of activation a is done */
    moert_event reload_event[MOERT_STORE_SLOTS];  /* the H2D copy of activation a is done */

    /* figures of the last forward (bytes; "held" = on the device from the end of forward to backward) */
    int64_t saved_bytes[MOERT_STORE_SLOTS]; /* size of each activation saved for backward */
    int64_t held_bytes[MOERT_STORE_SLOTS];  /* saved_bytes[a] when kept, 0 when recomputed or offloaded */
    int64_t kept_bytes_peak;                /* sum of held_bytes: activation bytes held from forward to backward */
    int64_t recompute_saved_bytes;          /* bytes not held because recomputed (sum over those activations) */
    int64_t offload_saved_bytes;            /* bytes not held because offloaded to pinned host memory */
    int64_t offload_cancelled_bytes;        /* offloads whose D2H copy was still running at reload: kept */
    /* since the store was made */
    int64_t pinned_bytes;       /* pinned host memory held by the offload buffers */
    int64_t pinned_allocations; /* alloc_pinned calls (the first offload of each activation, and
                                                    when a step's activation outgrows its buffer) */
} moert_activation_store;

/* An empty store for one layer on `stream` (NULL on the CPU); nothing is allocated until the first alloc. */
void moert_act_store_init(moert_activation_store *S, const moert_host *host, moert_stream stream, moert_device device,
                          int layer_index);
/* Frees everything: the saved activations (after the copies still using them), pinned buffers, streams, events. */
void moert_act_store_free(moert_activation_store *S);

/* Slot a is produced and used on `stream` from now on (NULL: the store's compute stream): the shared expert's slots,
 * when it runs on its own stream. */
void moert_act_store_set_stream(moert_activation_store *S, int a, moert_stream stream);

/* The device buffer of activation a (data NULL when it is not on the device). */
static inline moert_tensor *moert_act_store_tensor(moert_activation_store *S, int a) { return &S->saved[a]; }

/* A new device buffer of rows x cols for activation a (forward, or its recomputation in backward). */
moert_result moert_act_store_alloc(moert_activation_store *S, int a, moert_dtype dtype, int64_t rows, int64_t cols);

/* Start of a forward: resets the figures of the last one. */
void moert_act_store_begin_forward(moert_activation_store *S);
/* Right after activation a is produced: records the policy's action and, for an offload, starts (or queues) its
 * copy to pinned memory. */
moert_result moert_act_store_put(moert_activation_store *S, int a, moert_memory_action action);
/* After activation a's last forward use, carries the action out: keep leaves it in place, recompute frees it, offload
 * hands the device buffer over to be freed behind its copy. */
void moert_act_store_after_last_use(moert_activation_store *S, int a);
/* End of a forward: sums the held bytes, and frees the offloaded device copies unless defer_release (the compute
 * stream then waits for D2H copies still running). */
moert_result moert_act_store_end_forward(moert_activation_store *S);

/* Issues the D2H copies queued under defer_start (nothing to do otherwise). */
moert_result moert_act_store_start_offloads(moert_activation_store *S);
/* Frees only the offloaded activations whose D2H copy has already finished, without making any stream wait: called
 * at each layer boundary, so a slow copy delays the free, not the compute. */
moert_result moert_act_store_release_finished(moert_activation_store *S);
/* Frees the device copies of offloaded activations, stream-ordered after their D2H copies (the compute stream waits
 * for the copy, then the block goes back to the pool). */
moert_result moert_act_store_release_offloaded(moert_activation_store *S);

/* Issues the copies back to the device of the offloaded activations on the H2D stream, ordered after the compute
 * stream's work so far; get waits for each just before its first use. Idempotent. Called one layer ahead, the copies
 * overlap that layer's backward. */
moert_result moert_act_store_prefetch(moert_activation_store *S);
/* Makes activation a usable on its stream for backward: waits for its reload (issuing it if prefetch has not; call
 * prefetch first where the caller's allocations are ordered on another stream). *dropped is set when the policy
 * dropped it: the caller allocs and recomputes it. */
moert_result moert_act_store_get(moert_activation_store *S, int a, bool *dropped);
/* Whether activation a was dropped in the last forward and not recomputed yet. */
static inline bool moert_act_store_dropped(const moert_activation_store *S, int a)
{
    return S->place[a] == MOERT_PLACE_DROPPED;
}
/* After activation a's last backward use: its device buffer goes back to the pool. */
void moert_act_store_done(moert_activation_store *S, int a);
/* Drops every saved activation (a new forward, or an abandoned backward), after the copies still using them. */
moert_result moert_act_store_release(moert_activation_store *S);

#endif
