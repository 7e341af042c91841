/* SPDX-License-Identifier: Apache-2.0 */
/* What the NVLink dispatchers ("deepep", "hybridep") share on the host: the part of an instance every call reads (the
 * host and layer, the rank's place in the group, the peer buffer, the step's bookkeeping), the argument checks of the
 * calls, the peer buffer's setup and release, the CPU path's calls and the CUDA path's device checks. Compiled into
 * each plugin (plugins do not link libmoert); each plugin's context holds a peer_dispatch as its first member,
 * `core`. */
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
#define PEER_DISPATCH_DTYPES                                                                                       \
    (MOERT_CAP_DTYPE(MOERT_F32) | MOERT_CAP_DTYPE(MOERT_F64) | MOERT_CAP_DTYPE(MOERT_BF16) |                     \
     MOERT_CAP_DTYPE(MOERT_F16))

/* The shared part of a dispatcher instance. */
typedef struct peer_dispatch {
    const moert_host *host;
    moert_layer_info layer;
    const char *name;           /* the plugin's name, for messages */
    int world, rank;
    bool on_cuda;
    int64_t num_sms, channels, timeout_ms;
    moert_result broken;        /* MOERT_OK, or the code of a failure after which the group's buffers are out of step */
    char broken_msg[512];

    bool prepared, dispatched;  /* prepare() succeeded; a dispatch-like call ran since */
    int64_t seq;                /* sequence number of the last call through the buffers (the host's count) */

    peer_geometry geo;
    void *buf;                  /* this rank's peer-visible buffer on the layer's device */
    size_t buf_bytes;
    void *peers[PEER_MAX_RANKS];
    int64_t recv_rows[PEER_MAX_RANKS]; /* CPU path: rows received from each rank by the last dispatch-like call */
} peer_dispatch;

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
                                        const moert_tensor *t, int ndim, int64_t rows, bool rows_at_least,
                                        int64_t cols, const char *rows_what, int need_dtype);

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
peer_cpu_link peer_dispatch_cpu_link(peer_dispatch *d, int64_t seq, int64_t *recv_meta, char *error,
                                     size_t error_size);

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
