/* The "hybridep" dispatcher's peer-visible buffer, shared by its CPU and CUDA paths (plain C, no CUDA types).
 *
 * Every rank owns one buffer, offered once to the group at init with host->exchange_peer_buffers; peers write into it.
 *   header   flags: arrived[source][channel] (the source's rows of this call are in place), consumed[dest][channel]
 *            (a rank has read what this rank wrote into it; the CUDA path and the CPU path use channel 0 only: a
 *            reader stamps once its whole call is read), notified[source] (the source's notify row is in place)
 *   notify   one row per source rank: its copies per expert [E], then its status, channel count, token count and
 *            tokens per destination rank [HYBRIDEP_MAX_RANKS]
 *   slot s   the token rows rank s wrote to this rank: rows_cap rows of row_stride bytes, then rows_cap metadata
 *            entries of meta_stride bytes (int32 dst[K], then double prob[K] at meta_prob_offset)
 * Every call through the buffers (prepare's notify, dispatch, combine, both backwards) has a sequence number, the same
 * on every rank. A writer waits until its destination's consumed stamp for it reaches seq-1, writes, then publishes
 * with a release store of seq in arrived[writer][channel] (one flag per sending block in CUDA normal mode; channel 0
 * only in low-latency mode, written by the kernel's last sending block); the reader waits for seq in every channel it
 * uses (acquire), reads, then stamps consumed. */
#ifndef MOERT_HYBRIDEP_BUFFER_H
#define MOERT_HYBRIDEP_BUFFER_H

#include <stddef.h>
#include <stdint.h>

#define HYBRIDEP_MAX_RANKS 8
#define HYBRIDEP_MAX_CHANNELS 132 /* sending blocks of a call: num_sms, at most 132 */
#define HYBRIDEP_FP8_BLOCK 128   /* elements per FP8 scale (1x128 blocks) */
#define HYBRIDEP_FP8_MAX 448.0f  /* largest E4M3 value */

/* Entries of a notify row after the E counts. */
#define HYBRIDEP_NOTIFY_STATUS 0   /* 0, or the number of bad expert ids the source found */
#define HYBRIDEP_NOTIFY_CHANNELS 1 /* the source's channel count (every rank must use the same) */
#define HYBRIDEP_NOTIFY_TOKENS 2   /* the source's T of this step */
#define HYBRIDEP_NOTIFY_TOKENS_TO 3 /* [HYBRIDEP_MAX_RANKS]: the source's tokens with a copy on rank d */
#define HYBRIDEP_NOTIFY_EXTRA (3 + HYBRIDEP_MAX_RANKS)

/* One arrival record: the writer's rows are slot rows [begin, end); seq is written last. */
typedef struct hybridep_flag {
    int64_t seq;
    int64_t begin;
    int64_t end;
    int64_t pad;
} hybridep_flag;

typedef struct hybridep_header {
    hybridep_flag arrived[HYBRIDEP_MAX_RANKS][HYBRIDEP_MAX_CHANNELS];
    int64_t consumed[HYBRIDEP_MAX_RANKS][HYBRIDEP_MAX_CHANNELS];
    int64_t notified[HYBRIDEP_MAX_RANKS];
} hybridep_header;

/* Where things are in a rank's buffer; every rank uses the same geometry. */
typedef struct hybridep_geometry {
    int world;
    int64_t topk;
    int64_t num_experts;
    int64_t rows_cap;        /* rows per slot: the largest max_tokens of the group */
    size_t row_stride;       /* bytes per row (a multiple of 16) */
    size_t meta_stride;      /* bytes per metadata entry (a multiple of 16) */
    size_t meta_prob_offset; /* offset of double prob[K] inside an entry */
    size_t header_bytes;     /* sizeof(hybridep_header) rounded up to 4096 */
    size_t notify_bytes;     /* world notify rows of E + HYBRIDEP_NOTIFY_EXTRA int64, rounded up to 4096 */
    size_t slot_bytes;       /* rows_cap * (row_stride + meta_stride) */
} hybridep_geometry;

static inline size_t hybridep_round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

/* Fills the geometry for rows of up to row_bytes bytes; returns the buffer size in bytes. */
static inline size_t hybridep_geometry_make(hybridep_geometry *g, int world, int64_t topk, int64_t num_experts,
                                            int64_t rows_cap, size_t row_bytes)
{
    g->world = world;
    g->topk = topk;
    g->num_experts = num_experts;
    g->rows_cap = rows_cap < 1 ? 1 : rows_cap;
    g->row_stride = hybridep_round_up(row_bytes < 16 ? 16 : row_bytes, 16);
    g->meta_prob_offset = hybridep_round_up((size_t)topk * sizeof(int32_t), 8);
    g->meta_stride = hybridep_round_up(g->meta_prob_offset + (size_t)topk * sizeof(double), 16);
    g->header_bytes = hybridep_round_up(sizeof(hybridep_header), 4096);
    g->notify_bytes =
        hybridep_round_up((size_t)world * (size_t)(num_experts + HYBRIDEP_NOTIFY_EXTRA) * sizeof(int64_t), 4096);
    g->slot_bytes = (size_t)g->rows_cap * (g->row_stride + g->meta_stride);
    return g->header_bytes + g->notify_bytes + (size_t)world * g->slot_bytes;
}

/* Source s's notify row in buffer `buf`: E counts, then HYBRIDEP_NOTIFY_EXTRA entries. */
static inline int64_t *hybridep_notify_row(const hybridep_geometry *g, void *buf, int s)
{
    return (int64_t *)((char *)buf + g->header_bytes) + (size_t)s * (size_t)(g->num_experts + HYBRIDEP_NOTIFY_EXTRA);
}

/* Row i of slot s in buffer `buf`. */
static inline char *hybridep_row(const hybridep_geometry *g, void *buf, int s, int64_t i)
{
    return (char *)buf + g->header_bytes + g->notify_bytes + (size_t)s * g->slot_bytes + (size_t)i * g->row_stride;
}

/* Metadata entry i of slot s in buffer `buf`. */
static inline char *hybridep_meta(const hybridep_geometry *g, void *buf, int s, int64_t i)
{
    return (char *)buf + g->header_bytes + g->notify_bytes + (size_t)s * g->slot_bytes +
           (size_t)g->rows_cap * g->row_stride + (size_t)i * g->meta_stride;
}

/* Bytes of one FP8 row of H elements: H bytes, then H/128 fp32 scales. */
static inline size_t hybridep_fp8_row_bytes(int64_t hidden)
{
    return (size_t)hidden + (size_t)(hidden / HYBRIDEP_FP8_BLOCK) * sizeof(float);
}

/* The calls, as a CUDA failure word names them. */
#define HYBRIDEP_CALL_PREPARE 0
#define HYBRIDEP_CALL_DISPATCH 1
#define HYBRIDEP_CALL_COMBINE 2
#define HYBRIDEP_CALL_COMBINE_BACKWARD 3
#define HYBRIDEP_CALL_DISPATCH_BACKWARD 4

/* CUDA low-latency mode: how a source publishes that its rows of a call are in place (ll_flag), and who fences first
 * (ll_fence). LAST_BLOCK: every block counts itself in a device counter, the last one stores seq in arrived[src][0] of
 * every destination. PER_BLOCK: every block adds 1 (release reduction) to arrived[src][1].seq of every destination, a
 * running count the reader waits to reach epoch * blocks (epoch: low-latency calls so far, alike on every rank). */
#define HYBRIDEP_LL_FLAG_LAST_BLOCK 0
#define HYBRIDEP_LL_FLAG_PER_BLOCK 1
#define HYBRIDEP_LL_FENCE_THREAD 0 /* every thread fences (system scope) before the block barrier */
#define HYBRIDEP_LL_FENCE_BLOCK 1  /* after the block barrier, only the threads that publish fence */

/* The status word a CUDA kernel leaves after a failure: seq << 20 | call << 16 | kind << 8 | peer. */
#define HYBRIDEP_WAIT_ARRIVAL 1  /* waited for a peer's rows */
#define HYBRIDEP_WAIT_CONSUMED 2 /* waited for a peer to read the previous call's rows */
#define HYBRIDEP_WAIT_NOTIFY 3   /* waited for a peer's notify row */
#define HYBRIDEP_BAD_IDS 4       /* a rank's topk_idx had ids outside [-1, E) (treated as dropped) */
#define HYBRIDEP_CHANNELS 5      /* a rank uses another channel count */
#define HYBRIDEP_TOO_MANY 6      /* a rank has more tokens than the buffers' rows_cap */

#endif
