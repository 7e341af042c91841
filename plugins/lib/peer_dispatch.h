/* SPDX-License-Identifier: Apache-2.0 */
/* The frame of the NVLink dispatchers ("deepep", "hybridep") on the host: the part of an instance every call reads
 * (the host and layer, the rank's place in the group, the peer buffer, the step's bookkeeping), the argument checks,
 * the peer buffer's setup and release, prepare()'s shared steps, and the calls after prepare() (dispatch, combine and
 * their adjoints) with the CPU path's send/receive; a plugin adds its options, its layout pass and count exchange in
 * prepare(), and its CUDA kernels as a peer_dispatch_cuda backend. Compiled into each plugin (plugins do not link
 * libmoert); each plugin's context holds a peer_dispatch as its first member, `core`, so the calls' ctx is one. */
#ifndef MOERT_PEER_DISPATCH_H
#define MOERT_PEER_DISPATCH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "moert/dispatcher.h"
#include "peer_buffer.h"
#include "peer_dispatch_cpu.h"
#include "plugin_report.h"

/* The devices and dtypes both plugins declare in their vtable headers. */
#ifdef MOERT_HAVE_CUDA
#define PEER_DISPATCH_DEVICES (MOERT_CAP_DEVICE(MOERT_DEVICE_CPU) | MOERT_CAP_DEVICE(MOERT_DEVICE_CUDA))
#else
#define PEER_DISPATCH_DEVICES MOERT_CAP_DEVICE(MOERT_DEVICE_CPU)
#endif
#define PEER_DISPATCH_DTYPES                                                                                           \
    (MOERT_CAP_DTYPE(MOERT_F32) | MOERT_CAP_DTYPE(MOERT_F64) | MOERT_CAP_DTYPE(MOERT_BF16) | MOERT_CAP_DTYPE(MOERT_F16))

typedef struct peer_dispatch peer_dispatch;

/* A plugin's CUDA path, as the shared calls run it (after the argument and dtype checks): its kernels moving the rows
 * of one call. call_id is PEER_CALL_* (peer_buffer.h). */
typedef struct peer_dispatch_cuda {
    /* A failure an earlier call's kernels reported, read without a sync, checked first by every call (NULL: none; the
     * plugin reads it in prepare()). */
    moert_result (*check_status)(peer_dispatch *d);
    /* A dispatch-like call (dispatch, combine_backward); fp8: E4M3 rows with 1x128 scales on the wire. */
    moert_result (*dispatch_like)(peer_dispatch *d, moert_stream stream, const char *call, int call_id, bool fp8,
                                  const moert_tensor *x, const moert_tensor *probs, moert_tensor *out,
                                  moert_tensor *out_probs);
    /* A combine-like call (combine, dispatch_backward); accumulate: added into out. */
    moert_result (*combine_like)(peer_dispatch *d, moert_stream stream, const char *call, int call_id,
                                 const moert_tensor *rows, const moert_tensor *row_probs, moert_tensor *out,
                                 bool accumulate, moert_tensor *out_probs);
} peer_dispatch_cuda;

/* The shared part of a dispatcher instance. */
struct peer_dispatch {
    const moert_host *host;
    moert_layer_info layer;
    const char *name; /* the plugin's name, for messages */
    int world, rank;
    bool on_cuda;
    int64_t num_sms, channels, timeout_ms;
    moert_result broken; /* MOERT_OK, or the code of a failure after which the group's buffers are out of step */
    char broken_msg[512];

    bool prepared, dispatched; /* prepare() succeeded; a dispatch-like call ran since */
    int64_t seq;               /* sequence number of the last call through the buffers (the host's count) */

    peer_geometry geo;
    void *buf; /* this rank's peer-visible buffer on the layer's device */
    size_t buf_bytes;
    void *peers[PEER_MAX_RANKS];
    int64_t recv_rows[PEER_MAX_RANKS]; /* CPU path: rows received from each rank by the last dispatch-like call */

    bool fp8;                       /* forward dispatch() sends E4M3 rows with 1x128 scales (deepep's dispatch_dtype) */
    const peer_dispatch_cuda *cuda; /* the plugin's CUDA path (set at init on CUDA) */
    /* this step, set by the plugin's prepare() */
    int64_t step_tokens;         /* T */
    int64_t step_rows;           /* rows a tensor of received rows must hold: num_recv, or the worst-case capacity */
    const int64_t *step_sent_to; /* [world] this rank's tokens per destination on the host; NULL: not known there */
    peer_cpu_route route;        /* CPU path: this step's routing on this rank */
    int64_t *recv_meta;          /* CPU path: [world][rows_cap][K], saved by dispatch-like calls */
};

/*
 * The start of init: the layer checks every dispatcher makes (moert_arg_check_dispatch_layer, at most PEER_MAX_RANKS
 * ranks), then a zeroed context of ctx_size bytes whose first member is a peer_dispatch, filled in for `name`.
 * Errors go to host->set_error; *ctx stays NULL.
 */
moert_result peer_dispatch_create(const moert_host *host, const moert_layer_info *layer, const char *name,
                                  size_t ctx_size, void **ctx);

/* Sets the message and returns code (report() with the instance's host). */
#define peer_dispatch_fail(d, ...) report((d)->host, __VA_ARGS__)

/* Reports a metric to the host, where its ABI has the member. */
void peer_dispatch_metric(const peer_dispatch *d, const char *name, double value, const char *unit);

/* Reads the timeout_ms option (the bound of every wait for a peer) into d. */
moert_result peer_dispatch_read_timeout(peer_dispatch *d);

/* The largest max_tokens of the group (at least 1): allgathered, so every rank sizes its slots alike (collective). */
moert_result peer_dispatch_group_max_tokens(peer_dispatch *d, int64_t *rows_cap);

/* Marks the instance broken (the ranks' sequence numbers no longer agree); every later call fails with code. */
moert_result peer_dispatch_mark_broken(peer_dispatch *d, moert_result code, const char *call, const char *why);

/* The shared checks (tensor_args.h) of one tensor argument, for this instance's host and layer device. */
moert_result peer_dispatch_check_tensor(const peer_dispatch *d, const char *call, const char *name,
                                        const moert_tensor *t, int ndim, int64_t rows, bool rows_at_least, int64_t cols,
                                        const char *rows_what, int need_dtype);

/* prepare()'s layout argument: present and large enough. */
moert_result peer_dispatch_check_layout(const peer_dispatch *d, const moert_dispatch_layout *layout);

/* prepare()'s topk_idx: int32 [T, topk] on the layer's device. */
moert_result peer_dispatch_check_topk_idx(const peer_dispatch *d, const moert_tensor *topk_idx);

/* The arguments of each call after prepare(): the instance is not broken and prepared (combine-like calls: a
 * dispatch-like call ran), args present and large enough, every tensor's shape for T tokens and at least recv_rows
 * received rows. */
moert_result peer_dispatch_check_dispatch(const peer_dispatch *d, const moert_dispatch_args *args, int64_t tokens,
                                          int64_t recv_rows);
moert_result peer_dispatch_check_combine(const peer_dispatch *d, const moert_combine_args *args, int64_t tokens,
                                         int64_t recv_rows);
moert_result peer_dispatch_check_combine_backward(const peer_dispatch *d, const moert_combine_backward_args *args,
                                                  int64_t tokens, int64_t recv_rows);
moert_result peer_dispatch_check_dispatch_backward(const peer_dispatch *d, const moert_dispatch_backward_args *args,
                                                   int64_t tokens, int64_t recv_rows);

/* ---- prepare() ---- */

/* The start of prepare(): the step's calls refused until it succeeds; the instance's earlier failure, else the layout
 * argument's check (a plugin whose ranks exchange counts still takes part in the exchange after a local failure). */
moert_result peer_dispatch_prepare_begin(peer_dispatch *d, const moert_dispatch_layout *layout);

/* prepare()'s error for entry `bad` (t * topk + k) of topk_idx, an id outside [0, E) and not -1. */
moert_result peer_dispatch_bad_expert(const peer_dispatch *d, const moert_tensor *topk_idx, int64_t bad);

/* Rank s's part of prepare()'s count exchange: its prepare() succeeded (status 0) and it sends with this rank's
 * channel count; otherwise this step's error, naming rank s. */
moert_result peer_dispatch_check_peer_prepare(const peer_dispatch *d, int s, int64_t status, int64_t channels);

/*
 * The end of a successful prepare(): this step's sizes for the calls (T tokens; rows: what the received-row tensors
 * must hold; sent_to: this rank's tokens per destination on the host, or NULL) and the layout handed to the core
 * (num_recv, -1 when not known on the host; counts: tokens per local expert on the layer's device, counts_host the
 * same on the host or NULL). The metric dispatch.recv_tokens when num_recv is known.
 */
void peer_dispatch_prepare_done(peer_dispatch *d, moert_dispatch_layout *layout, int64_t tokens, int64_t num_recv,
                                int64_t rows, void *counts, int64_t *counts_host, const int64_t *sent_to);

/* ---- the calls after prepare() ---- */

/* A failure the CUDA path's kernels reported in an earlier call (peer_dispatch_cuda.check_status). */
moert_result peer_dispatch_check_status(peer_dispatch *d);

/* The dispatcher's calls (vtable members; ctx is the plugin's context, whose first member is its peer_dispatch): the
 * shared checks, then the CPU path's send/receive or the plugin's CUDA path. dispatch() sends d->fp8 rows and reports
 * dispatch.bytes_sent when the step's sent_to is known. */
moert_result peer_dispatch_run_dispatch(void *ctx, moert_stream stream, const moert_dispatch_args *args);
moert_result peer_dispatch_run_combine(void *ctx, moert_stream stream, const moert_combine_args *args);
moert_result peer_dispatch_run_combine_backward(void *ctx, moert_stream stream,
                                                const moert_combine_backward_args *args);
moert_result peer_dispatch_run_dispatch_backward(void *ctx, moert_stream stream,
                                                 const moert_dispatch_backward_args *args);

/* The message of a bounded wait that ran out (the kind of a kernel's failure word: PEER_WAIT_ARRIVAL or
 * PEER_WAIT_CONSUMED), naming the late peer; false for another kind (a plugin's own). */
bool peer_dispatch_wait_text(const peer_dispatch *d, int kind, int peer, char *why, size_t size);

/* A failed allocation on the layer's device: explained when the host cannot allocate on CUDA at all. */
moert_result peer_dispatch_alloc_failed(const peer_dispatch *d, moert_result rc);

/*
 * Collective: allocates this rank's buffer for rows_cap rows of row_bytes per source and notify rows of
 * notify_row_entries int64 (0: none), zeroes its flags on CUDA, and exchanges the pointers with every rank. The
 * sequence numbers restart at 0. The buffer must have been released before.
 */
moert_result peer_dispatch_buffer_setup(peer_dispatch *d, int64_t rows_cap, size_t row_bytes,
                                        int64_t notify_row_entries);

/*
 * Frees this rank's buffer once every peer has stopped writing into it: every rank's release stamp of the last call
 * (the last thing a peer writes here) in the first `channels` channels. The last call's number is d->seq, or on CUDA
 * the one at device_seq when not NULL (where kernels number their calls). A peer that does not release within
 * timeout_ms is logged and the buffer freed anyway.
 */
void peer_dispatch_buffer_release(peer_dispatch *d, int channels, const int64_t *device_seq);

/* The CPU path's link for call number seq (recv_meta: the plugin's [world][rows_cap][K] array). */
peer_cpu_link peer_dispatch_cpu_link(peer_dispatch *d, int64_t seq, int64_t *recv_meta, char *error, size_t error_size);

/* A dispatch-like call on the CPU (dispatch, combine_backward) as call number seq; a stall breaks the instance. */
moert_result peer_dispatch_cpu_dispatch(peer_dispatch *d, const char *call, int64_t seq, int64_t *recv_meta,
                                        const peer_cpu_route *route, bool fp8, const moert_tensor *x,
                                        const moert_tensor *probs, moert_tensor *out, moert_tensor *out_probs);

/* A combine-like call on the CPU (combine, dispatch_backward) as call number seq; a stall breaks the instance. */
moert_result peer_dispatch_cpu_combine(peer_dispatch *d, const char *call, int64_t seq, int64_t *recv_meta,
                                       const peer_cpu_route *route, const moert_tensor *rows,
                                       const moert_tensor *row_probs, moert_tensor *out, bool accumulate,
                                       moert_tensor *out_probs);

/* Bytes this rank writes into other ranks' buffers in a dispatch-like call (rows of row_bytes and their metadata;
 * tokens_to [world]: this rank's tokens per destination), reported as the metric dispatch.bytes_sent. */
void peer_dispatch_report_sent(const peer_dispatch *d, const int64_t *tokens_to, size_t row_bytes);

/* A dispatch-like call's tensors on CUDA: rows of the layer's dtype, probs fp32 (NULL tensors pass). */
moert_result peer_dispatch_cuda_dispatch_dtypes(const peer_dispatch *d, const char *call, const moert_tensor *x,
                                                const moert_tensor *probs, const moert_tensor *out_probs);

/* A combine-like call's tensors on CUDA: rows and out of the layer's dtype, probs fp32 (NULL tensors pass). */
moert_result peer_dispatch_cuda_combine_dtypes(const peer_dispatch *d, const char *call, const moert_tensor *rows,
                                               const moert_tensor *out, const moert_tensor *row_probs,
                                               const moert_tensor *out_probs);

#ifdef MOERT_HAVE_CUDA
/* The CUDA path's first checks at init: the layer's device is visible to this process, at most max_experts experts,
 * topk <= 32, bf16 or fp32 rows. */
moert_result peer_dispatch_cuda_check_layer(const peer_dispatch *d, int64_t max_experts);

/* Collective, at init, before the peer buffers are exchanged: every rank's device must be reachable by peer access
 * from every other rank's (same host, cudaDeviceCanAccessPeer between the devices); otherwise every rank refuses with
 * MOERT_ERR_UNSUPPORTED and one message naming the ranks that cannot reach each other and the dispatchers that can
 * serve such a group (peer_reach.h). A peer's device hidden from this process (CUDA_VISIBLE_DEVICES) cannot be asked
 * about and counts as reachable (CUDA IPC may still map it). */
moert_result peer_dispatch_cuda_check_reach(peer_dispatch *d);

/* SMs of the layer's device. */
moert_result peer_dispatch_cuda_sm_count(const peer_dispatch *d, int *sms);

/* Zeroes `bytes` at a device pointer and waits for it (init and buffer setup only). */
moert_result peer_dispatch_cuda_zero(const moert_host *host, void *ptr, size_t bytes);
#endif

#endif
