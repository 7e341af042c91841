/* The "deepep" dispatcher's peer-visible buffer, shared by its CPU and CUDA paths (plain C, no CUDA types).
 *
 * Every rank owns one buffer, offered once to the group with host->exchange_peer_buffers; peers write into it.
 *   header   flags: arrived[source][channel] (written by the source when its rows are in place) and
 *            consumed[destination][channel] (written by a rank that has read what this rank wrote into it)
 *   slot s   the rows rank s wrote to this rank: rows_cap rows of row_stride bytes, then rows_cap metadata
 *            entries of meta_stride bytes (int32 dst[K], then double prob[K] at meta_prob_offset)
 *            (on CUDA a rank's own tokens never go through its own slot in dispatch: the slot holds its own combine
 *            partials instead)
 * A call (dispatch, combine, either backward) has a sequence number, the same on every rank. A writer waits until
 * its destination's consumed flag for it reaches seq-1 (the destination read the previous call's rows), writes
 * its rows and metadata, then publishes {begin, end, seq} in the destination's arrived flag (release). */
#ifndef MOERT_DEEPEP_BUFFER_H
#define MOERT_DEEPEP_BUFFER_H

#include <stddef.h>
#include <stdint.h>

#define DEEPEP_MAX_RANKS 8
#define DEEPEP_MAX_CHANNELS 132 /* blocks of the NVLink phase: num_sms, at most 132 */
#define DEEPEP_FP8_BLOCK 128   /* elements per FP8 scale (1x128 blocks) */
#define DEEPEP_FP8_MAX 448.0f  /* largest E4M3 value */

/* One arrival record: the writer's rows are slot rows [begin, end); seq is written last. */
typedef struct deepep_flag {
    int64_t seq;
    int64_t begin;
    int64_t end;
    int64_t pad;
} deepep_flag;

typedef struct deepep_header {
    deepep_flag arrived[DEEPEP_MAX_RANKS][DEEPEP_MAX_CHANNELS];
    int64_t consumed[DEEPEP_MAX_RANKS][DEEPEP_MAX_CHANNELS];
} deepep_header;

/* Where things are in a rank's buffer; every rank uses the same geometry. */
typedef struct deepep_geometry {
    int world;
    int64_t topk;
    int64_t rows_cap;       /* rows per slot: the largest T of any rank */
    size_t row_stride;      /* bytes per row (a multiple of 16) */
    size_t meta_stride;     /* bytes per metadata entry (a multiple of 16) */
    size_t meta_prob_offset;/* offset of double prob[K] inside an entry */
    size_t header_bytes;    /* sizeof(deepep_header) rounded up to 4096 */
    size_t slot_bytes;      /* rows_cap * (row_stride + meta_stride) */
} deepep_geometry;

static inline size_t deepep_round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

/* Fills the geometry for rows of up to row_bytes bytes; returns the buffer size in bytes. */
static inline size_t deepep_geometry_make(deepep_geometry *g, int world, int64_t topk, int64_t rows_cap,
                                          size_t row_bytes)
{
    g->world = world;
    g->topk = topk;
    g->rows_cap = rows_cap < 1 ? 1 : rows_cap;
    g->row_stride = deepep_round_up(row_bytes < 16 ? 16 : row_bytes, 16);
    g->meta_prob_offset = deepep_round_up((size_t)topk * sizeof(int32_t), 8);
    g->meta_stride = deepep_round_up(g->meta_prob_offset + (size_t)topk * sizeof(double), 16);
    g->header_bytes = deepep_round_up(sizeof(deepep_header), 4096);
    g->slot_bytes = (size_t)g->rows_cap * (g->row_stride + g->meta_stride);
    return g->header_bytes + (size_t)world * g->slot_bytes;
}

/* Row i of slot s in buffer `buf`. */
static inline char *deepep_row(const deepep_geometry *g, void *buf, int s, int64_t i)
{
    return (char *)buf + g->header_bytes + (size_t)s * g->slot_bytes + (size_t)i * g->row_stride;
}

/* Metadata entry i of slot s in buffer `buf`. */
static inline char *deepep_meta(const deepep_geometry *g, void *buf, int s, int64_t i)
{
    return (char *)buf + g->header_bytes + (size_t)s * g->slot_bytes + (size_t)g->rows_cap * g->row_stride +
           (size_t)i * g->meta_stride;
}

/* Bytes of one FP8 row of H elements: H bytes, then H/128 fp32 scales. */
static inline size_t deepep_fp8_row_bytes(int64_t hidden)
{
    return (size_t)hidden + (size_t)(hidden / DEEPEP_FP8_BLOCK) * sizeof(float);
}

/* The error word a CUDA kernel leaves after a bounded wait ran out: seq << 16 | kind << 8 | peer. */
#define DEEPEP_WAIT_ARRIVAL 1  /* waited for a peer's rows */
#define DEEPEP_WAIT_CONSUMED 2 /* waited for a peer to read the previous call's rows */

#endif
