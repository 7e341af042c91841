/* SPDX-License-Identifier: Apache-2.0 */
/*
 * CUDA kernels of the "hybridep" dispatcher (hybridep_buffer.h describes the buffer and the flag protocol).
 *
 * prepare: one kernel of one block does the layout (copies per expert, each copy's place among this rank's copies to
 * its expert, each token's position per destination rank) and the notify (its counts written into every peer's
 * buffer, theirs waited for), then each copy's destination row base and the tokens each rank sends here: no host sync.
 * Normal mode, each call split like deepep's: an NVLink phase of `channels` blocks, every one sending (dispatch: each
 * token once per destination rank into its row of this rank's slot there; combine: one partial row per (token, rank)),
 * with TMA bulk copies (global -> shared with an mbarrier, shared -> the peer) or 16-byte vector copies; and local
 * kernels over every SM around it (dispatch: the expansion into expert-grouped rows; combine: the reduction of each
 * token's copies before, the sum of the partials after). Low-latency mode: one kernel per call over every SM (send,
 * flags, then expansion or final sum in the same kernel; rows split into 1 KB pieces so every warp has work).
 * Every wait is bounded by the call's timeout: a wait that runs out records (seq << 16 | kind << 8 | peer) in the
 * status words (device, and mapped pinned host memory the host reads without a sync), raises abort_flag (later
 * kernels of the instance return at once) and ends.
 */
#ifndef MOERT_HYBRIDEP_CUDA_H
#define MOERT_HYBRIDEP_CUDA_H

#include <cuda_runtime.h>

#include "hybridep_buffer.h"
#include "moert/plugin.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The kernels' view of one call. */
typedef struct hybridep_cuda_call {
    peer_geometry geo;
    void *local;                 /* this rank's buffer */
    void *peers[PEER_MAX_RANKS]; /* every rank's buffer, as this device reaches it */
    int rank, channels;          /* blocks of the NVLink phase (every one sends), or of a low-latency kernel */
    int sms;                     /* SMs of the device: the local kernels use all of them */
    int tma;                     /* 1: TMA bulk copies in the NVLink phase, 0: vector copies */
    int low_latency;             /* 1: one kernel per call (channels <= sms, every block resident) */
    int call;                    /* PEER_CALL_*: which call this is (named in a failure word) */
    int ll_threads;              /* low-latency: threads per block (512 or 1024) */
    int ll_flag;                 /* low-latency: HYBRIDEP_LL_FLAG_* (how a source publishes its arrival) */
    int ll_fence;                /* low-latency: HYBRIDEP_LL_FENCE_* (who fences before the arrival flag) */
    int64_t piece;               /* low-latency: 16-byte units (or packs) per row piece, a multiple of 32 */
    int64_t timeout_ns;
    int64_t tokens, topk, hidden, num_experts, local_experts;
    int32_t *topk_idx;              /* [rows_cap*K] this step's routing, kept by prepare */
    int32_t *copy_index;            /* [rows_cap*K] place of each copy among this rank's copies to its expert */
    int32_t *excl;                  /* [world][rows_cap+1] tokens before t with a copy on rank d */
    int64_t *base;                  /* [E] first row, on expert e's rank, of this rank's copies to e */
    int64_t *tokens_per_expert;     /* [El] rows per local expert (the layout's device counts) */
    int64_t *recv_tokens;           /* [world] tokens rank s sends to this rank in this step (from the notify) */
    int32_t *recv_meta;             /* [world][rows_cap][K] rows of each received copy (dispatch-like calls save) */
    void *staging;                  /* normal mode: [(world-1)*rows_cap] rows of row_stride, combine partials */
    unsigned *done_blocks;          /* blocks of a consuming kernel that finished (the last one resets it) */
    unsigned *sent_blocks;          /* low-latency: blocks whose sends are complete (the last one flags, resets) */
    int64_t *seq_dev;               /* device: sequence number of the last call (kernels number their calls) */
    int64_t *ll_calls;              /* device: low-latency calls so far (the per-block flag's epoch) */
    unsigned long long *error_word; /* device: the first failure */
    int *abort_flag;                /* device: set with the error word */
    unsigned long long *host_word;  /* mapped pinned host memory: the same word, read by the host without a sync */
} hybridep_cuda_call;

/* The device address of pinned host memory (mapped: the kernels write the status word there). */
moert_result hybridep_cuda_mapped(const moert_host *host, void *pinned, void **device_ptr);

/* Sets the kernels' shared-memory limits (init: no such call in a step, so a step can be captured in a graph). */
moert_result hybridep_cuda_setup(const moert_host *host);

/* prepare: layout of topk_idx ([T,K] int32, T = call->tokens) and notify; fills the call's arrays. */
moert_result hybridep_cuda_prepare(const moert_host *host, cudaStream_t stream, const hybridep_cuda_call *call,
                                   const int32_t *topk_idx);

/* A dispatch-like call: rows of x (bf16 or fp32, [T,H]) once to every other rank holding one of their experts, written
 * there (and here, for this rank's own copies, straight from x) into each copy's row of out with their probs (fp32,
 * may be NULL). */
moert_result hybridep_cuda_dispatch(const moert_host *host, cudaStream_t stream, const hybridep_cuda_call *call,
                                    moert_dtype dtype, const void *x, const float *probs, void *out, float *out_probs);

/* A combine-like call: partial sums (fp32 in k order, rounded to dtype) of each received token's copies in rows back
 * to the token's rank, summed there in rank order (fp32) into out ([T,H]; overwrite, 0 without copies; accumulate:
 * added, untouched without copies); row_probs to out_probs ([T,K]) if not NULL. */
moert_result hybridep_cuda_combine(const moert_host *host, cudaStream_t stream, const hybridep_cuda_call *call,
                                   moert_dtype dtype, const void *rows, const float *row_probs, void *out,
                                   bool accumulate, float *out_probs);

#ifdef __cplusplus
}
#endif
#endif
