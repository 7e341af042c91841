/* SPDX-License-Identifier: Apache-2.0 */
/* Communicator of the expert-parallel group. This file: ranks as threads of one process sharing memory. */
#ifndef MOERT_CORE_COMM_H
#define MOERT_CORE_COMM_H

#include <stddef.h>

#include "moert/moert.h"

typedef struct moert_comm_group moert_comm_group; /* shared by all ranks */

/* A group of `world` ranks; a collective waits at most timeout_s for every rank to arrive. */
moert_result moert_comm_group_create(int world, double timeout_s, moert_comm_group **out);
/* One rank's group whose collectives are the caller's (moert_collectives); the table is copied. */
moert_result moert_comm_group_create_table(int world, const moert_collectives *table, moert_comm_group **out);
void moert_comm_group_free(moert_comm_group *g);
int moert_comm_group_size(const moert_comm_group *g);

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
