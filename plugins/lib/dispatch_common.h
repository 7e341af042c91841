/* SPDX-License-Identifier: Apache-2.0 */
/*
 * What the host-collective dispatchers (alltoall, allgather, hierarchical) share on the host side, so each plugin
 * keeps only its own algorithm: device buffers grown on demand, the metric and copy plumbing, the argument checks of
 * prepare() and of the four calls after it (their messages are part of the tests), prepare()'s count exchange, an
 * alltoallv of rows between a group of peers, and the CPU planning helpers over plain arrays (counting copies,
 * expert groups, moving rows and probs by an index map, summing a token's rows). Compiled into each plugin
 * (plugins do not link libmoert); plain C, used by the CPU and CUDA paths alike.
 */
#ifndef MOERT_PLUGIN_DISPATCH_COMMON_H
#define MOERT_PLUGIN_DISPATCH_COMMON_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "moert/dispatcher.h"

/* ---- the vtable header ---- */

/* The devices and dtypes of the host-collective dispatchers' headers: the CPU, and CUDA in a CUDA build; every float
 * dtype of rows. */
#ifdef MOERT_HAVE_CUDA
#define MOERT_DISPATCH_DEVICES (MOERT_CAP_DEVICE(MOERT_DEVICE_CPU) | MOERT_CAP_DEVICE(MOERT_DEVICE_CUDA))
#else
#define MOERT_DISPATCH_DEVICES MOERT_CAP_DEVICE(MOERT_DEVICE_CPU)
#endif
#define MOERT_DISPATCH_DTYPES                                                                                          \
    (MOERT_CAP_DTYPE(MOERT_F32) | MOERT_CAP_DTYPE(MOERT_F64) | MOERT_CAP_DTYPE(MOERT_BF16) | MOERT_CAP_DTYPE(MOERT_F16))

/* ---- buffers ---- */

/* A buffer grown on demand and reused across steps (on the layer's device, or in host memory). */
typedef struct moert_dispatch_buffer {
    void *data;
    size_t bytes;
} moert_dispatch_buffer;

/* Makes buf at least `bytes` long on `dev` through the host (contents not kept; at least 64 bytes, so the
 * communicator never gets a NULL pointer; grown by half again for the next steps' routing). */
moert_result moert_dispatch_buffer_reserve(const moert_host *host, moert_device dev, moert_dispatch_buffer *buf,
                                           size_t bytes);

/* moert_dispatch_buffer_reserve for the first device buffer of a CUDA path's init: a host that cannot allocate on
 * the device (a CPU-only host) is refused with a message saying so. */
moert_result moert_dispatch_buffer_reserve_first(const moert_host *host, moert_device dev, moert_dispatch_buffer *buf,
                                                 size_t bytes);

/* Gives buf's memory on `dev` back to the host. */
void moert_dispatch_buffer_release(const moert_host *host, moert_device dev, moert_dispatch_buffer *buf);

/* Grows a pinned host array to `bytes` the same way (contents not kept; the caller has waited for copies out of
 * it). *have is its size. */
moert_result moert_dispatch_pinned_reserve(const moert_host *host, void **ptr, size_t *have, size_t bytes);

/* ---- host plumbing ---- */

/* Reports a figure for this step's report, if the host is new enough to take it. */
void moert_dispatch_metric(const moert_host *host, const char *name, double value, const char *unit);

/* Copies `bytes` on `dev` (stream-ordered on CUDA, at once on the CPU). */
moert_result moert_dispatch_copy(const moert_host *host, moert_device dev, moert_stream stream, void *dst,
                                 const void *src, size_t bytes);

/* The per-rank sizes and offsets of an alltoallv, [world] each. */
typedef struct moert_dispatch_alltoallv {
    size_t *send_bytes, *send_offsets, *recv_bytes, *recv_offsets;
} moert_dispatch_alltoallv;

/* Allocates (zeroed) and frees the arrays of v for `world` ranks; alloc returns false when out of memory (free
 * then frees what was allocated). */
bool moert_dispatch_alltoallv_alloc(moert_dispatch_alltoallv *v, int world);
void moert_dispatch_alltoallv_free(moert_dispatch_alltoallv *v);

/*
 * Moves rows between this rank and `peers` peers, peer i being rank first_peer + i * peer_stride: send_rows[i] rows
 * of row_bytes from `send` (packed in peer order) to peer i, recv_rows[i] rows from peer i into `recv` (packed in
 * peer order). An alltoallv over the world with zero sizes to the ranks that are not peers; with one peer (this
 * rank) a copy, no collective. On CUDA, device buffers, queued on stream.
 */
moert_result moert_dispatch_exchange_rows(const moert_host *host, moert_device dev, moert_stream stream,
                                          moert_dispatch_alltoallv *v, int world, int peers, int first_peer,
                                          int peer_stride, const void *send, const int64_t *send_rows, void *recv,
                                          const int64_t *recv_rows, size_t row_bytes);

/* Bytes of rows[i] * row_bytes to the peers i other than `self`. */
double moert_dispatch_bytes_to_peers(const int64_t *rows, int peers, int self, double row_bytes);

/* ---- argument checks (messages go to host->set_error) ---- */

/* What the checks of the calls after prepare() know of the step. */
typedef struct moert_dispatch_step_shape {
    bool prepared;                /* prepare() succeeded since init */
    moert_device device;          /* the layer's */
    int64_t tokens, topk, hidden; /* T of the step, K, H */
    int64_t capacity;             /* rows of the grouped buffers */
} moert_dispatch_step_shape;

/* The checks of each call after prepare(): prepare() succeeded, args is there and big enough, its tensors have the
 * step's shapes (and probs come in pairs). */
moert_result moert_dispatch_check_dispatch(const moert_host *host, const moert_dispatch_step_shape *s,
                                           const moert_dispatch_args *args);
moert_result moert_dispatch_check_combine(const moert_host *host, const moert_dispatch_step_shape *s,
                                          const moert_combine_args *args);
moert_result moert_dispatch_check_combine_backward(const moert_host *host, const moert_dispatch_step_shape *s,
                                                   const moert_combine_backward_args *args);
moert_result moert_dispatch_check_dispatch_backward(const moert_host *host, const moert_dispatch_step_shape *s,
                                                    const moert_dispatch_backward_args *args);

/* prepare()'s layout argument: present and big enough. */
moert_result moert_dispatch_check_layout(const moert_host *host, const moert_dispatch_layout *layout);

/* prepare()'s topk_idx: int32 [T, topk] on `dev`, contiguous; sets *num_tokens to T. */
moert_result moert_dispatch_check_topk_idx(const moert_host *host, moert_device dev, const moert_tensor *topk_idx,
                                           int64_t topk, int64_t *num_tokens);

/* The refusal of a topk_idx whose flat entry `bad` is not an expert id in [0, E) nor -1. */
moert_result moert_dispatch_bad_expert(const moert_host *host, const int32_t *topk_idx, int64_t bad, int64_t topk,
                                       int64_t num_experts);

/* The same where only the device's count of such entries is known (the CUDA paths). */
moert_result moert_dispatch_bad_expert_count(const moert_host *host, unsigned long long bad, int64_t num_experts);

/* The CUDA paths' kernels move fp32 and bf16 data; both tensors of a pair must share the dtype (rows move as
 * bits). */
moert_result moert_dispatch_check_cuda_dtypes(const moert_host *host, const char *call, const char *name_a,
                                              const moert_tensor *a, const char *name_b, const moert_tensor *b);

/*
 * prepare()'s count exchange: every rank's row of row_len int64 (its counts, then a failure flag last) into
 * gathered [world][row_len], over host memory. Every rank takes part even when its own input was bad (local_rc),
 * so all ranks fail together instead of waiting for each other: returns the collective's failure, else local_rc,
 * else a refusal naming the first rank that failed.
 */
moert_result moert_dispatch_exchange_counts(const moert_host *host, int world, const int64_t *row, int64_t *gathered,
                                            int64_t row_len, moert_result local_rc);

/* ---- CPU planning over plain arrays ---- */

/* A flat view of n elements of dtype at data, so moert_load/moert_store can read and write it. */
moert_tensor moert_dispatch_flat_view(const void *data, moert_dtype dtype, int64_t n);

/* Counts kept copies per expert from topk_idx [T,K] (-1 = dropped) into counts[E] (zeroed first).
 * Returns the flat index of the first entry outside [-1, E), or -1 when all are valid. */
int64_t moert_dispatch_count_copies(const int32_t *topk_idx, int64_t num_tokens, int64_t topk, int64_t num_experts,
                                    int64_t *counts);

/*
 * The local experts' groups from all_counts [world][E] (copies from rank s to expert e): rows[l] received per local
 * expert l of `rank` (El of them; NULL: not wanted), tokens_per_expert[l] its group's rows (group_rows when > 0,
 * padding, else rows[l]) and group_start[l] its first grouped row. Returns the grouped rows in all.
 */
int64_t moert_dispatch_plan_groups(const int64_t *all_counts, int world, int rank, int64_t num_experts,
                                   int64_t num_local_experts, int64_t group_rows, int64_t *rows,
                                   int64_t *tokens_per_expert, int64_t *group_start);

/* grouped[dest[i]] = staging[i] for n rows of row_bytes, and its inverse. */
void moert_dispatch_scatter_rows(const int64_t *dest, int64_t n, const void *staging, size_t row_bytes, void *grouped);
void moert_dispatch_gather_rows(const int64_t *dest, int64_t n, const void *grouped, size_t row_bytes, void *staging);

/* The same for probs: out[dest[i]] = staging[i] stored in dtype, and staging[i] = probs[dest[i]] read as double
 * (out and probs: `size` values). */
void moert_dispatch_scatter_probs(const int64_t *dest, int64_t n, const double *staging, void *out, moert_dtype dtype,
                                  int64_t size);
void moert_dispatch_gather_probs(const int64_t *dest, int64_t n, const void *probs, moert_dtype dtype, int64_t size,
                                 double *staging);

/* send[slot[i]] = probs[i] as double for the n copies whose slot is >= 0 (the rest dropped). */
void moert_dispatch_pack_probs(const int64_t *slot, int64_t n, const void *probs, moert_dtype dtype, double *send);

/* out[i] = src[slot[i]] stored in dtype for n copies, 0 where slot[i] < 0 (a dropped copy). */
void moert_dispatch_unpack_probs(const int64_t *slot, int64_t n, const double *src, void *out, moert_dtype dtype);

/*
 * out[t] (= or +=) the sum, in double and j order, of rows[row_of[t*per_token + j]] over j < per_token where that is
 * >= 0, rounded once to out_dtype. rows: num_rows rows of hidden values in rows_dtype; out: [tokens, hidden]; acc:
 * hidden doubles of scratch. A token without rows gets 0 (or keeps its value when accumulating).
 */
void moert_dispatch_sum_rows(const int64_t *row_of, int64_t tokens, int64_t per_token, const void *rows,
                             moert_dtype rows_dtype, int64_t num_rows, int64_t hidden, int accumulate, void *out,
                             moert_dtype out_dtype, double *acc);

#endif
