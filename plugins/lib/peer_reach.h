/* SPDX-License-Identifier: Apache-2.0 */
/* Whether every rank of an NVLink dispatcher ("deepep", "hybridep") can reach every other rank's memory by peer access,
 * and the message that refuses a group where some cannot. The check over a reachability matrix is a pure function
 * (tested on the CPU); peer_dispatch.c fills the matrix on CUDA at init (host names, PCI bus ids,
 * cudaDeviceCanAccessPeer) and allgathers it, so every rank refuses with the same message. */
#ifndef MOERT_PEER_REACH_H
#define MOERT_PEER_REACH_H

#include <stddef.h>

/*
 * reach [world][world]: reach[a*world + b] nonzero when rank a can read and write rank b's device memory (the diagonal
 * is not read). where: a label per rank for the message (e.g. "node-a cuda:1"), or NULL. Returns the number of ordered
 * pairs (a, b), a != b, that cannot reach; when there are any, msg gets the refusal of `dispatcher`, naming each rank
 * and the ranks it cannot reach, and the dispatchers that work without peer access (cut to size with "...").
 */
int peer_reach_unreachable(int world, const unsigned char *reach, const char *const *where, const char *dispatcher,
                           char *msg, size_t size);

#endif
