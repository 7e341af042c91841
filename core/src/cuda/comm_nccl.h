/* SPDX-License-Identifier: Apache-2.0 */
/* NCCL communicator of the expert-parallel group: the operations of core/src/comm.h on device buffers,
 * queued on a given stream.
 *
 * Two ways to create one rank's communicator:
 *  (a) one process, a thread per GPU: moert_nccl_group_create once (it makes the ncclUniqueId), then each
 *      rank thread calls moert_nccl_comm_init_thread with its rank and device;
 *  (b) one process per GPU (torchrun/srun style): moert_dist_env_read, then moert_nccl_comm_init_env; rank 0
 *      serves the ncclUniqueId to the others over TCP at MASTER_ADDR:MASTER_PORT (or MOERT_BOOTSTRAP_PORT).
 *
 * Communicators are nonblocking (ncclConfig_t.blocking = 0): every NCCL call is polled with
 * ncclCommGetAsyncError and bounded by the timeout, and so are init, the bootstrap, barriers, peer-buffer
 * exchanges and moert_nccl_stream_wait; on a timeout the communicator is aborted (ncclCommAbort) and every
 * later call fails at once. Collectives themselves are only queued on the caller's stream: a stalled peer
 * shows where the caller waits for that stream, which should be moert_nccl_stream_wait.
 *
 * NCCL_NVLS_ENABLE is set to 0 before the first init when unset (no NVLink multicast).
 */
#ifndef MOERT_CORE_CUDA_COMM_NCCL_H
#define MOERT_CORE_CUDA_COMM_NCCL_H

#include <stddef.h>

#include "moert/moert.h"

/* The oldest libnccl accepted at run time (nonblocking init and ncclCommGetAsyncError polling). */
#define MOERT_NCCL_MIN_VERSION_CODE 21800
/* A timeout of 0 or less means this many seconds. */
#define MOERT_NCCL_DEFAULT_TIMEOUT_S 60.0

typedef struct moert_nccl_group moert_nccl_group; /* thread-per-GPU mode: shared by the rank threads */
typedef struct moert_nccl_comm moert_nccl_comm;   /* one rank */

typedef enum moert_nccl_mode {
    MOERT_NCCL_THREADS = 1,  /* ranks are threads of this process: peer buffers through peer access */
    MOERT_NCCL_PROCESSES = 2 /* a process per rank: peer buffers through CUDA IPC handles */
} moert_nccl_mode;

/* ---- (a) one process, a thread per GPU ---- */

/* Makes the group's ncclUniqueId; the ranks then join from their own threads. */
moert_result moert_nccl_group_create(int world, double timeout_s, moert_nccl_group **out);
/* After every rank's communicator is freed. */
void moert_nccl_group_free(moert_nccl_group *g);
/* Called by the thread acting as `rank`: makes `device` current for this thread and joins the group. */
moert_result moert_nccl_comm_init_thread(moert_nccl_group *g, int rank, int device, moert_nccl_comm **out);

/* ---- (b) a process per GPU ---- */

/* The launcher's environment: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (all required),
 * and MOERT_BOOTSTRAP_PORT (optional: the port rank 0 serves the id on instead of MASTER_PORT). */
typedef struct moert_dist_env {
    int rank, world_size, local_rank;
    char master_addr[256];
    int master_port;
    int bootstrap_port; /* MOERT_BOOTSTRAP_PORT, else master_port */
} moert_dist_env;

/* Reads and checks the variables; MOERT_ERR_CONFIG naming a missing or malformed one. */
moert_result moert_dist_env_read(moert_dist_env *out);
/* Joins the group described by env on `device` (-1: env->local_rank). */
moert_result moert_nccl_comm_init_env(const moert_dist_env *env, int device, double timeout_s, moert_nccl_comm **out);

/* ---- (c) a process per GPU, the unique id distributed by the caller (the embedding API) ---- */

/* Makes an NCCL unique id (bytes must be sizeof(ncclUniqueId), 128). */
moert_result moert_nccl_unique_id_make(unsigned char *id, size_t bytes);
/* Joins the group of `world` ranks that id names, as `rank`, on `device`; the same mode as (b). */
moert_result moert_nccl_comm_init_id(const unsigned char *id, size_t id_bytes, int rank, int world, int device,
                                     double timeout_s, moert_nccl_comm **out);

/* ---- subgroups (either mode) ---- */

/* The communicator of the ranks of `parent` that pass the same color (ncclCommSplit), ranked by key (ties: by parent
 * rank). Collective over parent: every rank calls it, in the same order as its other splits; a color of -1 leaves the
 * rank out (*out NULL). The new communicator has the parent's mode, device and timeout, and in thread mode its group,
 * so an abort of either is seen by both; free it (moert_nccl_comm_free) before the parent. */
moert_result moert_nccl_comm_split(moert_nccl_comm *parent, int color, int key, moert_nccl_comm **out);

/* ---- either mode ---- */

/* Flushes and destroys the communicator (bounded; aborted if peers do not finish), closes IPC mappings. */
void moert_nccl_comm_free(moert_nccl_comm *c);
int moert_nccl_comm_rank(const moert_nccl_comm *c);
int moert_nccl_comm_size(const moert_nccl_comm *c);
int moert_nccl_comm_device(const moert_nccl_comm *c);
moert_nccl_mode moert_nccl_comm_mode(const moert_nccl_comm *c);

/* Collectives on device memory, queued on stream s (every rank calls them in the same order). */
moert_result moert_nccl_allgather(moert_nccl_comm *c, const void *send, void *recv, size_t bytes_per_rank,
                                  moert_stream s);
/* In place. dtype: fp32, fp64, int64 (also bf16, fp16, int32). */
moert_result moert_nccl_allreduce_sum(moert_nccl_comm *c, void *buf, size_t count, moert_dtype dtype, moert_stream s);
/* Sends send_bytes[r] bytes at send + send_offsets[r] to rank r and receives recv_bytes[r] at
 * recv + recv_offsets[r] from r (arrays of world entries on the host; zero sizes are skipped). */
moert_result moert_nccl_alltoallv(moert_nccl_comm *c, const void *send, const size_t *send_bytes,
                                  const size_t *send_offsets, void *recv, const size_t *recv_bytes,
                                  const size_t *recv_offsets, moert_stream s);
/* Returns when every rank has arrived (bounded by the timeout; `what` names it in the message). */
moert_result moert_nccl_barrier(moert_nccl_comm *c, const char *what);
/* Waits for the work queued on s (bounded by the timeout; `what` names it in the message). */
moert_result moert_nccl_stream_wait(moert_nccl_comm *c, moert_stream s, const char *what);
/* Each rank offers `local` (bytes long, on its device); peers[r] gets a pointer this rank's device can
 * read and write rank r's buffer through (peers[rank] = local). Threads: raw pointers with peer access
 * enabled; processes: CUDA IPC mappings, kept open until moert_nccl_comm_free. Collective and blocking. */
moert_result moert_nccl_exchange_peer_buffers(moert_nccl_comm *c, void *local, size_t bytes, void **peers);
/* Aborts the communicator; in thread mode the other ranks' waits then fail at once too. */
void moert_nccl_comm_abort(moert_nccl_comm *c, const char *why);

#endif
