/* SPDX-License-Identifier: Apache-2.0 */
/*
 * CUDA kernels of the "deepep" dispatcher: the token-rank layout pass, and each call as an NVLink phase of `channels`
 * blocks (every block sends) between local kernels over every SM (deepep_buffer.h describes the buffer and the flags).
 *
 *   dispatch: send (channels blocks: each token once into every other rank holding one of its experts, FP8 quantized
 *             on the way), then expand (every SM: waits for the peers' rows, copies/dequantizes them into the rows of
 *             their copies, and this rank's own tokens straight from x; the last block releases the slots).
 *   combine:  reduce (every SM: each received token's copies summed in fp32, one partial per (token, rank), the
 *             own rank's into its own slot, the others' into a local staging area), then send (channels blocks: the
 *             staged partials into the token's rank), then final (every SM: each token's partials summed in rank
 *             order; the last block releases the slots).
 * Every wait is bounded by the call's timeout: a wait that runs out records (seq << 16 | kind << 8 | peer) in
 * error_word, raises abort_flag (later kernels of the instance return at once) and the kernel ends; the host reads
 * the word at its next sync (prepare()). Everything is enqueued on the given stream; errors go to host->set_error.
 */
#ifndef MOERT_DEEPEP_CUDA_H
#define MOERT_DEEPEP_CUDA_H

#include <cuda_runtime.h>

#include "deepep_buffer.h"
#include "moert/plugin.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The kernels' view of one call: the buffers, this step's layout, and where received metadata is saved. */
typedef struct deepep_cuda_call {
    peer_geometry geo;
    void *local;                 /* this rank's buffer */
    void *peers[PEER_MAX_RANKS]; /* every rank's buffer, as this device reaches it */
    int rank, channels;          /* channels: blocks of the NVLink phase */
    int sms;                     /* SMs of the device: grid of the local kernels is 2 * sms */
    bool nvlink_only;            /* bench aid: run only the NVLink phase (rows cross, arrive, are released) */
    int64_t seq, timeout_ns;
    int64_t tokens, topk, hidden, local_experts;
    const int32_t *topk_idx;       /* [T,K] */
    const int32_t *excl;           /* [world][T+1]: tokens before t with a copy on rank d */
    const int32_t *row_of_copy;    /* [T*K] the alltoall layout's stable order by expert */
    const int64_t *expert_offsets; /* [E+1] its per-expert starts */
    const int64_t *base;           /* [E] first row, on expert e's rank, of this rank's copies to e */
    int32_t *recv_meta;            /* [world][rows_cap][K] rows of each received copy (dispatch-like calls save) */
    int64_t recv_tokens[PEER_MAX_RANKS]; /* tokens of rank s with a copy here (rows in this rank's slot s) */
    int64_t staged_off[PEER_MAX_RANKS];  /* combine: first staging row of source s (s != rank) */
    void *staging;                       /* combine: staged partials, rows of geo.row_stride, then metadata entries */
    int64_t staging_rows;                /* rows of the staging area (sum of recv_tokens[s], s != rank) */
    unsigned long long *error_word;      /* device: the first stall */
    int *abort_flag;                     /* device: set with the error word */
    unsigned *done_blocks;               /* device: blocks of a local kernel that finished (the last one releases) */
    int call_id;                         /* PEER_CALL_* of this call */
    unsigned long long *wait_stats;      /* device, option peer_wait_stats (else NULL): per PEER_CALL_*, DEEPEP_STAT_*
                                          * words that block 0 of each kernel adds its peer waits into */
} deepep_cuda_call;

/* The words per call kind of deepep_cuda_call.wait_stats: ns block 0 of the local kernel (expansion, final sum) spun
 * until every peer's rows of the call had arrived; ns block 0 of the NVLink phase spun until every peer had released
 * the buffer from the previous call; the calls. */
enum { DEEPEP_STAT_ARRIVAL_NS = 0, DEEPEP_STAT_RELEASE_NS = 1, DEEPEP_STAT_CALLS = 2, DEEPEP_STAT_WORDS = 3 };

/* Copies `words` 64-bit words of wait_stats to the host once the device is idle (at finalize). */
moert_result deepep_cuda_read_stats(const moert_host *host, const unsigned long long *device_words,
                                    unsigned long long *out, int words);

/* Bytes of the combine staging area for `rows` rows of this geometry. */
size_t deepep_cuda_staging_bytes(const peer_geometry *geo, int64_t rows);

/* The layout pass per destination rank: excl[d][t] (int32 [world][T+1]) tokens before t with a copy on rank d,
 * tokens_to[d] (int64 [world]) the total. Ids outside [0, E) count as dropped (the expert layout flags them). */
moert_result deepep_cuda_token_ranks(const moert_host *host, cudaStream_t stream, const int32_t *topk_idx,
                                     int64_t tokens, int64_t topk, int64_t local_experts, int64_t num_experts,
                                     int world, int32_t *excl, int64_t *tokens_to);

/* A dispatch-like call: rows of x (dtype bf16 or fp32, [T,H]) to every rank holding one of their experts, expanded
 * there into out ([num_recv,H]) with their probs (fp32, may be NULL); fp8: E4M3 with 1x128 fp32 scales on the
 * wire (bf16 rows, H % 128 == 0), dequantized into out (this rank's own tokens are quantized and dequantized in
 * registers, the same bits). */
moert_result deepep_cuda_dispatch(const moert_host *host, cudaStream_t stream, const deepep_cuda_call *call,
                                  moert_dtype dtype, bool fp8, const void *x, const float *probs, void *out,
                                  float *out_probs);

/* A combine-like call: partial sums (fp32 in k order, rounded to dtype) of each received token's copies in rows
 * ([num_recv,H]) back to the token's rank, summed there in rank order (fp32) into out ([T,H]; overwrite, 0 without
 * copies; accumulate: added, untouched without copies); row_probs ([num_recv]) to out_probs ([T,K]) if not NULL. */
moert_result deepep_cuda_combine(const moert_host *host, cudaStream_t stream, const deepep_cuda_call *call,
                                 moert_dtype dtype, const void *rows, const float *row_probs, void *out,
                                 bool accumulate, float *out_probs);

#ifdef __cplusplus
}
#endif
#endif
