/* SPDX-License-Identifier: Apache-2.0 */
/* How the "hybridep" dispatcher uses the peer buffer (../lib/peer_buffer.h: the layout it shares with "deepep"), on
 * its CPU and CUDA paths (plain C, no CUDA types).
 *
 * Every rank owns one buffer, offered once to the group at init with host->exchange_peer_buffers; peers write into it.
 *   header   flags: arrived[source][channel] (the source's rows of this call are in place), consumed[dest][channel]
 *            (a rank has read what this rank wrote into it; the CUDA path and the CPU path use channel 0 only: a
 *            reader stamps once its whole call is read), notified[source] (the source's notify row is in place)
 *   notify   one row per source rank: its copies per expert [E], then its status, channel count, token count and
 *            tokens per destination rank [PEER_MAX_RANKS]
 *   slot s   the token rows rank s wrote to this rank: rows_cap rows of row_stride bytes, then rows_cap metadata
 *            entries of meta_stride bytes (int32 dst[K], then double prob[K] at meta_prob_offset)
 * Every call through the buffers (prepare's notify, dispatch, combine, both backwards) has a sequence number, the same
 * on every rank. A writer waits until its destination's consumed stamp for it reaches seq-1, writes, then publishes
 * with a release store of seq in arrived[writer][channel] (one flag per sending block in CUDA normal mode; channel 0
 * only in low-latency mode, written by the kernel's last sending block); the reader waits for seq in every channel it
 * uses (acquire), reads, then stamps consumed. */
#ifndef MOERT_HYBRIDEP_BUFFER_H
#define MOERT_HYBRIDEP_BUFFER_H

#include "peer_buffer.h"

/* Entries of a notify row after the E counts. */
#define HYBRIDEP_NOTIFY_STATUS    0 /* 0, or the number of bad expert ids the source found */
#define HYBRIDEP_NOTIFY_CHANNELS  1 /* the source's channel count (every rank must use the same) */
#define HYBRIDEP_NOTIFY_TOKENS    2 /* the source's T of this step */
#define HYBRIDEP_NOTIFY_TOKENS_TO 3 /* [PEER_MAX_RANKS]: the source's tokens with a copy on rank d */
#define HYBRIDEP_NOTIFY_EXTRA     (3 + PEER_MAX_RANKS)

/* The calls, as a CUDA failure word names them. */
/* CUDA low-latency mode: how a source publishes that its rows of a call are in place (ll_flag), and who fences first
 * (ll_fence). LAST_BLOCK: every block counts itself in a device counter, the last one stores seq in arrived[src][0] of
 * every destination. PER_BLOCK: every block adds 1 (release reduction) to arrived[src][1].seq of every destination, a
 * running count the reader waits to reach epoch * blocks (epoch: low-latency calls so far, alike on every rank). */
#define HYBRIDEP_LL_FLAG_LAST_BLOCK 0
#define HYBRIDEP_LL_FLAG_PER_BLOCK  1
#define HYBRIDEP_LL_FENCE_THREAD    0 /* every thread fences (system scope) before the block barrier */
#define HYBRIDEP_LL_FENCE_BLOCK     1 /* after the block barrier, only the threads that publish fence */

/* The status word a CUDA kernel leaves after a failure: seq << 20 | call << 16 | kind << 8 | peer; call one of
 * PEER_CALL_*, kind PEER_WAIT_ARRIVAL, PEER_WAIT_CONSUMED (peer_buffer.h) or one of these. */
#define HYBRIDEP_WAIT_NOTIFY 3 /* waited for a peer's notify row */
#define HYBRIDEP_BAD_IDS     4 /* a rank's topk_idx had ids outside [-1, E) (treated as dropped) */
#define HYBRIDEP_CHANNELS    5 /* a rank uses another channel count */
#define HYBRIDEP_TOO_MANY    6 /* a rank has more tokens than the buffers' rows_cap */

#endif
