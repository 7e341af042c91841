/* SPDX-License-Identifier: Apache-2.0 */
/* Communicator of the expert-parallel group. This file: ranks as threads of one process sharing memory. */
#ifndef MOERT_CORE_COMM_H
#define MOERT_CORE_COMM_H

#include <stdbool.h>
#include <stddef.h>

#include "moert/moert.h"

typedef struct moert_comm_group moert_comm_group; /* shared by all ranks */

/* A group of `world` ranks; a collective waits at most timeout_s for every rank to arrive. */
moert_result moert_comm_group_create(int world, double timeout_s, moert_comm_group **out);
/* One rank's group whose collectives are the caller's (moert_collectives); the table is copied. */
moert_result moert_comm_group_create_table(int world, const moert_collectives *table, moert_comm_group **out);
void moert_comm_group_free(moert_comm_group *g);
int moert_comm_group_size(const moert_comm_group *g);
/* The world's start-up log lines (moert_log_startup_begin's seen function; group is a moert_comm_group): whether a line
 * of this hash was written already by one of the world's ranks, noting it if not. Shared by the ranks of one group and
 * gone with it, so a later world in the same process writes its own. */
#define MOERT_COMM_LOG_FOLD_MAX 256
bool moert_comm_log_seen(void *group, uint64_t hash);
/* The ranks of g's world that run in this process: its size for ranks as threads, 1 over the caller's collectives. */
int moert_comm_group_local_ranks(const moert_comm_group *g);

/* One rank's view of a subgroup of `parent` (the world): `members` lists the subgroup's ranks in the parent, in
 * subgroup rank order, and must hold parent_rank. A view belongs to that rank alone (every member makes its own); free it with
 * moert_comm_group_free before the parent. Its collectives take the rank's index in `members` and are carried out over
 * the parent's collectives, so every rank of the parent calls each collective of its own subgroup at the same point
 * of the program (the subgroups partition the parent, as the expert groups of a layer do): non-members exchange no
 * data with each other. Peer pointers are not offered on a view. */
moert_result moert_comm_subgroup_create(moert_comm_group *parent, int parent_rank, const int *members, int count,
                                        moert_comm_group **out);
/* Whether g is a view of a subgroup (moert_comm_subgroup_create), and the size of the world it is part of. */
bool moert_comm_group_is_subgroup(const moert_comm_group *g);
int moert_comm_group_world_size(const moert_comm_group *g);

/* Collectives, called by the thread acting as `rank` (each rank calls in the same order). Host memory.
 * `what` names the operation in timeout messages. */
moert_result moert_comm_barrier(moert_comm_group *g, int rank, const char *what);
moert_result moert_comm_allgather(moert_comm_group *g, int rank, const void *send, void *recv, size_t bytes);
moert_result moert_comm_allreduce_sum(moert_comm_group *g, int rank, void *buf, size_t count, moert_dtype dtype);
moert_result moert_comm_alltoallv(moert_comm_group *g, int rank, const void *send, const size_t *send_bytes,
                                  const size_t *send_offsets, void *recv, const size_t *recv_bytes,
                                  const size_t *recv_offsets);
moert_result moert_comm_exchange_pointers(moert_comm_group *g, int rank, void *local, void **peers);
/* Marks the group failed (a rank hit an error): peers waiting in a collective return at once. */
void moert_comm_abort(moert_comm_group *g, int rank, const char *why);

#endif
