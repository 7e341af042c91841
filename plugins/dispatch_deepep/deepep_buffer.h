/* SPDX-License-Identifier: Apache-2.0 */
/* How the "deepep" dispatcher uses the peer buffer (../lib/peer_buffer.h: the layout it shares with "hybridep"),
 * on its CPU and CUDA paths (plain C, no CUDA types).
 *
 * Every rank owns one buffer, offered once to the group with host->exchange_peer_buffers; peers write into it.
 *   header   flags: arrived[source][channel] (written by the source when its rows are in place) and
 *            consumed[destination][channel] (written by a rank that has read what this rank wrote into it)
 *   slot s   the rows rank s wrote to this rank: rows_cap rows of row_stride bytes, then rows_cap metadata
 *            entries of meta_stride bytes (int32 dst[K], then double prob[K] at meta_prob_offset)
 *            (on CUDA a rank's own tokens never go through its own slot in dispatch: the slot holds its own combine
 *            partials instead)
 * No notify area: the counts are exchanged with host->allgather. A call (dispatch, combine, either backward) has a
 * sequence number, the same on every rank. A writer waits until its destination's consumed flag for it reaches seq-1
 * (the destination read the previous call's rows), writes its rows and metadata, then publishes {begin, end, seq} in
 * the destination's arrived flag (release). FP8 rows (dispatch_dtype "fp8") are H E4M3 bytes, then H/128 fp32 scales
 * (peer_fp8_row_bytes). */
#ifndef MOERT_DEEPEP_BUFFER_H
#define MOERT_DEEPEP_BUFFER_H

#include "peer_buffer.h"

/* The error word a CUDA kernel leaves after a bounded wait ran out: seq << 16 | kind << 8 | peer, kind one of
 * PEER_WAIT_ARRIVAL, PEER_WAIT_CONSUMED (peer_buffer.h). */

#endif
