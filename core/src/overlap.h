/* SPDX-License-Identifier: Apache-2.0 */
/* Slots of every layer ($.parallel.forwards_in_flight, at least two under $.parallel.overlap_micro_batches), so that
 * several micro-batches' forwards can be in flight, and the merged call that runs the forward of one micro-batch and
 * the backward of another together (docs/executor.md, "Micro-batch overlap"). */
#ifndef MOERT_CORE_OVERLAP_H
#define MOERT_CORE_OVERLAP_H

#include "config.h"
#include "stack.h"

/* Slots per layer at most: slot 0 is the rank's stack, each other one a twin ($.parallel.forwards_in_flight). */
#define MOERT_OVERLAP_MAX_SLOTS MOERT_MAX_FORWARDS_IN_FLIGHT

typedef struct moert_overlap {
    moert_stack *primary; /* slot 0: the rank's stack (borrowed) */
    /* slots 1 .. slots - 1: the same plugins again, their instances twins of slot 0's */
    moert_stack twins[MOERT_OVERLAP_MAX_SLOTS - 1];
    int slots;  /* slots made (1: slot 0 alone) */
    bool merge; /* the micro-batch overlap: merged calls run their halves side by side (CUDA) */
    /* CUDA: each twin's compute stream (NULL on the CPU), forked from and joined into slot 0's at every call */
    moert_stream streams[MOERT_OVERLAP_MAX_SLOTS - 1];
    moert_event fork_events[MOERT_OVERLAP_MAX_SLOTS - 1], join_events[MOERT_OVERLAP_MAX_SLOTS - 1];
    bool interleave; /* issue the two halves of a merged call stage by stage (CUDA) */
    /* CUDA, with the overlap: the rank's one communication stream, on which every dispatcher call of every slot is
     * issued in the order the host issues them (the same on every rank), with each slot's events fencing it with the
     * slot's stream; every layer of slot s points at comm[s] (moert_layer.comm) */
    moert_comm_stream comm[MOERT_OVERLAP_MAX_SLOTS];
    struct moert_cuda_pool *pool; /* CUDA: the rank's pool (blocks freed on the streams above are forgotten) */
    /* the thread that issues the forward half of interleaved merged calls: made at the first such call and kept, so
     * that no call pays for a new thread's start, CUDA device and libraries' per-thread setup */
    struct moert_overlap_helper *helper;
} moert_overlap;

/* Makes slots 1 .. slots - 1 of every layer of `primary` (made from `setup`): one more instance of each plugin per
 * layer and slot, its own core services and, on CUDA, its own compute stream; parameters and gradients stay slot 0's.
 * With `merge` (the micro-batch overlap, slots >= 2) every slot's dispatcher calls run on one communication stream
 * (CUDA). Collective. */
moert_result moert_overlap_init(moert_overlap *o, moert_stack *primary, const moert_stack_setup *setup, int slots,
                                bool merge);
void moert_overlap_finalize(moert_overlap *o);

/* Layer l of `slot` (0: the primary's). Another slot's layer takes slot 0's parameters, gradients and the state of
 * their lazy zeroing before it runs. */
moert_layer *moert_overlap_layer(moert_overlap *o, int l, int slot);

/* Slot `slot`'s stream waits for slot 0's work so far, and slot 0's for slot `slot`'s (CUDA; nothing for slot 0 or on
 * the CPU): around a call on one slot's instances made outside moert_overlap_forward / _backward. */
moert_result moert_overlap_fork(moert_overlap *o, int slot);
moert_result moert_overlap_join(moert_overlap *o, int slot);
/* After such a call's backward on slot `slot` of layer l: the lazy zeroing state of the gradients is slot 0's again. */
void moert_overlap_sync_back(moert_overlap *o, int l, int slot);
/* Waits on the host for the WGRADs of layer l that merged calls left running ($.parallel.defer_wgrad_join), of every
 * slot: before a gradient they write is rebound, and so may be freed. */
moert_result moert_overlap_wait_wgrads(moert_overlap *o, int l);

/* The forward or the backward of layer l on one slot (moert_layer_forward / _backward); on CUDA another slot's stream
 * forks from slot 0's before and slot 0's joins it after, so the work is ordered as if it ran on slot 0's stream. */
moert_result moert_overlap_forward(moert_overlap *o, int l, int slot, const moert_tensor *x, moert_tensor *y);
moert_result moert_overlap_backward(moert_overlap *o, int l, int slot, const moert_tensor *d_y, moert_tensor *d_x,
                                    double loss_scale);

/* After slot 0's precision instances' end_step (the weights changed): every other slot's, on its stream once slot 0's
 * work so far is done (an FP8 recipe makes its weight copies again there, and its delayed scales are slot 0's). */
moert_result moert_overlap_precision_end_step(moert_overlap *o);

/* The forward of layer fl on slot fslot and the backward of layer bl on slot bslot (fslot != bslot when fl == bl)
 * together. On the CPU the forward runs, then the backward. On CUDA each runs on its slot's stream, both forked from
 * and joined into slot 0's, and their stages are issued in turn (backward combine / forward routing, backward dgrads /
 * forward dispatch, backward dispatch / forward experts, backward wgrads / forward combine), so each one's
 * all-to-all runs while the other computes. Results are those of the forward, then the backward. */
moert_result moert_overlap_forward_backward(moert_overlap *o, int fl, int fslot, const moert_tensor *x, moert_tensor *y,
                                            int bl, int bslot, const moert_tensor *d_y, moert_tensor *d_x,
                                            double loss_scale);

#endif
