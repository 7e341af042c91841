/* SPDX-License-Identifier: Apache-2.0 */
/* The peer-visible buffer of the NVLink dispatchers ("deepep", "hybridep"), shared by their CPU and CUDA paths (plain
 * C, no CUDA types; under nvcc the inline functions are host and device functions).
 *
 * Every rank owns one buffer, offered to the group with host->exchange_peer_buffers; peers write into it.
 *   header   flags: arrived[source][channel] (written by the source when its rows of a call are in place),
 *            consumed[destination][channel] (written by a rank that has read what this rank wrote into it) and
 *            notified[source] (hybridep: the source's notify row is in place; deepep leaves it 0)
 *   notify   hybridep only: one row of notify_row_entries int64 per source rank (deepep: none, 0 bytes)
 *   slot s   the rows rank s wrote to this rank: rows_cap rows of row_stride bytes, then rows_cap metadata entries of
 *            meta_stride bytes (int32 dst[K], then double prob[K] at meta_prob_offset)
 * Each plugin's own buffer header (deepep_buffer.h, hybridep_buffer.h) says how its calls use the flags. */
#ifndef MOERT_PEER_BUFFER_H
#define MOERT_PEER_BUFFER_H

#include <stddef.h>
#include <stdint.h>

#ifdef __CUDACC__
#define PEER_BUFFER_INLINE static inline __host__ __device__
#else
#define PEER_BUFFER_INLINE static inline
#endif

#define PEER_MAX_RANKS    8
#define PEER_MAX_CHANNELS 132    /* sending blocks of a call: num_sms, at most 132 */
#define PEER_FP8_BLOCK    128    /* elements per FP8 scale (1x128 blocks) */
#define PEER_FP8_MAX      448.0f /* largest E4M3 value */

/* What a bounded wait that ran out waited for (the kind in the failure word the kernels record; each plugin's buffer
 * header adds kinds of its own after these). */
#define PEER_WAIT_ARRIVAL  1 /* waited for a peer's rows */
#define PEER_WAIT_CONSUMED 2 /* waited for a peer to read the previous call's rows */

/* The calls, as the shared call frame names them to a plugin's CUDA path (peer_dispatch.h). */
#define PEER_CALL_PREPARE           0
#define PEER_CALL_DISPATCH          1
#define PEER_CALL_COMBINE           2
#define PEER_CALL_COMBINE_BACKWARD  3
#define PEER_CALL_DISPATCH_BACKWARD 4

/* One arrival record: the writer's rows are slot rows [begin, end); seq is written last. */
typedef struct peer_flag {
    int64_t seq;
    int64_t begin;
    int64_t end;
    int64_t pad;
} peer_flag;

typedef struct peer_header {
    peer_flag arrived[PEER_MAX_RANKS][PEER_MAX_CHANNELS];
    int64_t consumed[PEER_MAX_RANKS][PEER_MAX_CHANNELS];
    int64_t notified[PEER_MAX_RANKS];
} peer_header;

/* Where things are in a rank's buffer; every rank uses the same geometry. */
typedef struct peer_geometry {
    int world;
    int64_t topk;
    int64_t rows_cap;           /* rows per slot: the largest T (deepep) or max_tokens (hybridep) of the group */
    int64_t notify_row_entries; /* int64 entries of a notify row (0: no notify area) */
    size_t row_stride;          /* bytes per row (a multiple of 16) */
    size_t meta_stride;         /* bytes per metadata entry (a multiple of 16) */
    size_t meta_prob_offset;    /* offset of double prob[K] inside an entry */
    size_t header_bytes;        /* sizeof(peer_header) rounded up to 4096 */
    size_t notify_bytes;        /* world notify rows rounded up to 4096 (0 without a notify area) */
    size_t slot_bytes;          /* rows_cap * (row_stride + meta_stride) */
} peer_geometry;

PEER_BUFFER_INLINE size_t peer_round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

/* Fills the geometry for rows of up to row_bytes bytes and notify rows of notify_row_entries int64 (0: none);
 * returns the buffer size in bytes. */
static inline size_t peer_geometry_make(peer_geometry *g, int world, int64_t topk, int64_t rows_cap, size_t row_bytes,
                                        int64_t notify_row_entries)
{
    g->world = world;
    g->topk = topk;
    g->rows_cap = rows_cap < 1 ? 1 : rows_cap;
    g->notify_row_entries = notify_row_entries;
    g->row_stride = peer_round_up(row_bytes < 16 ? 16 : row_bytes, 16);
    g->meta_prob_offset = peer_round_up((size_t)topk * sizeof(int32_t), 8);
    g->meta_stride = peer_round_up(g->meta_prob_offset + (size_t)topk * sizeof(double), 16);
    g->header_bytes = peer_round_up(sizeof(peer_header), 4096);
    g->notify_bytes = peer_round_up((size_t)world * (size_t)notify_row_entries * sizeof(int64_t), 4096);
    g->slot_bytes = (size_t)g->rows_cap * (g->row_stride + g->meta_stride);
    return g->header_bytes + g->notify_bytes + (size_t)world * g->slot_bytes;
}

/* Source s's notify row in buffer `buf`. */
PEER_BUFFER_INLINE int64_t *peer_notify_row(const peer_geometry *g, void *buf, int s)
{
    return (int64_t *)((char *)buf + g->header_bytes) + (size_t)s * (size_t)g->notify_row_entries;
}

/* Row i of slot s in buffer `buf`. */
PEER_BUFFER_INLINE char *peer_row(const peer_geometry *g, void *buf, int s, int64_t i)
{
    return (char *)buf + g->header_bytes + g->notify_bytes + (size_t)s * g->slot_bytes + (size_t)i * g->row_stride;
}

/* Metadata entry i of slot s in buffer `buf`. */
PEER_BUFFER_INLINE char *peer_meta(const peer_geometry *g, void *buf, int s, int64_t i)
{
    return (char *)buf + g->header_bytes + g->notify_bytes + (size_t)s * g->slot_bytes +
           (size_t)g->rows_cap * g->row_stride + (size_t)i * g->meta_stride;
}

/* Bytes of one FP8 row of H elements: H bytes, then H/128 fp32 scales. */
static inline size_t peer_fp8_row_bytes(int64_t hidden)
{
    return (size_t)hidden + (size_t)(hidden / PEER_FP8_BLOCK) * sizeof(float);
}

#endif
