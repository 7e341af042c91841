/* SPDX-License-Identifier: Apache-2.0 */
/* CUDA kernels of the "hybridep" dispatcher: fused layout + notify; normal mode: an NVLink phase of `channels` sending
 * blocks (TMA or vector copies) and local kernels over every SM; low-latency mode: one kernel per call. */
#include "hybridep_cuda.h"

#include <cuda_bf16.h>
#include <stdint.h>

#include "../lib/mbarrier.cuh"
#include "../lib/peer_dispatch.cuh"
#include "../lib/plugin_cuda_check.h"

#define SEND_THREADS        1024 /* a vector-copy NVLink-phase block: 32 warps, one row each at a time */
#define LOCAL_THREADS       512  /* a block of the local kernels (and of the low-latency kernels): 16 warps */
#define LOCAL_WARPS         (LOCAL_THREADS / 32)
#define LOCAL_BLOCKS_PER_SM 2
#define PREP_THREADS        1024 /* the prepare kernel: one block, 32 warps */
#define UNROLL              4    /* 16-byte units each lane has in flight in a vector row copy */
#define TMA_SMEM_BUDGET     (200 * 1024)
#define MAX_PIPE_WARPS      16
#define MAX_STAGES          4
#define FULL                0xffffffffu

/* ---- TMA bulk copies and mbarriers ---- */

/* Global -> shared, `bytes` (a multiple of 16), completing on the stage's mbarrier (one phase per load). */
__device__ __forceinline__ void tma_load(void *dst_smem, const void *src, uint32_t bytes, uint64_t *bar)
{
    mbar_arrive_expect_tx(bar, bytes);
    bulk_load(dst_smem, src, bytes, bar);
}

__device__ __forceinline__ void fence_proxy_async()
{
    asm volatile("fence.proxy.async.global;" ::: "memory");
    fence_async_shared();
}

/* ---- failures and bounded waits ---- */

/* ---- call numbers on the device ----
 * The sequence number of the running call (and, in low-latency mode, its epoch: the low-latency calls so far, this one
 * included) live in device memory: thread 0 of every block reads them when its kernel starts (begin_call), the last
 * kernel of a call advances them when it ends (end_call). So a CUDA graph that captured a step numbers its calls on at
 * every replay, as eager calls do: a host counter passed to the kernels would repeat the captured values. */
__shared__ int64_t call_seq_sh, call_epoch_sh;

__device__ __forceinline__ int64_t cur_seq() { return call_seq_sh; }
__device__ __forceinline__ int64_t cur_epoch() { return call_epoch_sh; }

/* Every kernel of a call, first thing, with the whole block. */
__device__ __forceinline__ void begin_call(const hybridep_cuda_call &k)
{
    if (threadIdx.x == 0) {
        call_seq_sh = *(volatile int64_t *)k.seq_dev + 1;
        call_epoch_sh = *(volatile int64_t *)k.ll_calls + 1;
    }
    __syncthreads();
}

/* One thread of the last kernel of a call, once every block of it has read the numbers: the call is done. */
__device__ __forceinline__ void end_call(const hybridep_cuda_call &k)
{
    *(volatile int64_t *)k.seq_dev = cur_seq();
    if (k.low_latency && k.call != PEER_CALL_PREPARE) *(volatile int64_t *)k.ll_calls = cur_epoch();
}

/* Records the first failure of the instance (device word and its pinned host mirror) and raises the abort flag. */
__device__ void record_failure(const hybridep_cuda_call &k, int kind, int peer)
{
    const unsigned long long word = ((unsigned long long)cur_seq() << 20) | ((unsigned long long)k.call << 16) |
                                    ((unsigned long long)kind << 8) | (unsigned)peer;
    if (atomicCAS(k.error_word, 0ull, word) == 0ull) {
        *(volatile unsigned long long *)k.host_word = word;
        __threadfence_system();
    }
    atomicExch(k.abort_flag, 1);
    __threadfence_system();
}

/* Spins until *p >= target, at most the call's timeout; false after a failure (this one or an earlier one). */
__device__ bool wait_geq(const int64_t *p, int64_t target, const hybridep_cuda_call &k, int kind, int peer)
{
    return peer_wait_geq(p, target, k, [&] { record_failure(k, kind, peer); });
}

/* What block_wait waits for. */
enum wait_what {
    WAIT_CONSUMED,      /* every rank's stamp that it read what this rank wrote into it in the previous call */
    WAIT_ARRIVED_OTHERS /* this call's arrival flag of every channel from every other rank (normal mode) */
};

/* Waits with the whole block; peers one after the other from rank + 1 on (this rank last), so a stall names the first
 * late peer in that order. False (for every thread) on a failure, or when the instance is aborted. */
__device__ bool block_wait(const hybridep_cuda_call &k, wait_what what)
{
    __shared__ int stalled;
    const int W = k.geo.world, C = k.channels;
    peer_header *h = peer_header_at(k.local);
    if (threadIdx.x == 0) stalled = *(volatile int *)k.abort_flag;
    __syncthreads();
    for (int j = 1; j <= W; j++) {
        const int s = (k.rank + j) % W;
        if (what == WAIT_ARRIVED_OTHERS && s == k.rank) continue;
        if (!stalled) {
            if (what == WAIT_CONSUMED) {
                if (threadIdx.x == 0 && !wait_geq(&h->consumed[s][0], cur_seq() - 1, k, PEER_WAIT_CONSUMED, s))
                    stalled = 1;
            } else {
                for (int c = threadIdx.x; c < C; c += blockDim.x)
                    if (!wait_geq(&h->arrived[s][c].seq, cur_seq(), k, PEER_WAIT_ARRIVAL, s)) {
                        stalled = 1;
                        break;
                    }
            }
        }
        __syncthreads();
    }
    return !stalled;
}

/* After a sending block's rows are written (and their stores complete): publishes this call's arrival of channel c in
 * every other rank's header (and in this rank's own when `self`), release after a system fence. */
__device__ void block_publish(const hybridep_cuda_call &k, int c, bool self)
{
    __threadfence_system();
    __syncthreads();
    const int d = threadIdx.x;
    if (d < k.geo.world && (self || d != k.rank))
        st_release_sys(&peer_header_at(k.peers[d])->arrived[k.rank][c].seq, cur_seq());
}

/* The end of every block of a consuming kernel (the last kernel of a call): the last block to finish ends the call
 * (end_call) and stamps, in every rank's header, that this rank has read what the rank wrote into it in this call
 * (skipped after a failure). */
__device__ void block_finish(const hybridep_cuda_call &k)
{
    __shared__ int last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        const unsigned before = atomicAdd(k.done_blocks, 1u);
        last = before == gridDim.x - 1;
        if (last) {
            atomicExch(k.done_blocks, 0u);
            end_call(k);
        }
    }
    __syncthreads();
    if (!last || *(volatile int *)k.abort_flag) return;
    __threadfence();
    if (threadIdx.x < k.geo.world)
        st_release_sys(&peer_header_at(k.peers[threadIdx.x])->consumed[k.rank][0], cur_seq());
}

/* A release reduction at system scope: *p += v (a peer's arrival count). */
__device__ __forceinline__ void red_release_sys(int64_t *p, int64_t v)
{
    asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

/* ---- low-latency flags: one arrival flag per source rank, waits per warp ---- */

/* The end of a low-latency kernel's sending half, every block, once its rows are written. The fence first: every
 * thread before the block barrier (ll_fence THREAD), or after it only the threads that go on to publish (BLOCK: the
 * barrier orders the block's writes before their system-scope fence). Then the flag. LAST_BLOCK (ll_flag): the block
 * counts itself in sent_blocks; the last block resets the counter and publishes this call's arrival in
 * arrived[rank][0] of every other rank (and of this rank when `self`): one flag per source, so a reader polls W flags,
 * not W * channels. Every block counts, even after a failure (the counter must return to 0). PER_BLOCK: every block
 * adds 1 to arrived[rank][1].seq of every destination (a release reduction: no counter, no last block). Nothing is
 * published once the instance is aborted. */
__device__ void ll_publish(const hybridep_cuda_call &k, bool self)
{
    __shared__ int last;
    const int d = threadIdx.x;
    const bool per_block = k.ll_flag == HYBRIDEP_LL_FLAG_PER_BLOCK;
    /* per-block counts go to this rank too, in every call, so every source's count reaches epoch * blocks */
    const bool dest = d < k.geo.world && (self || per_block || d != k.rank);
    if (k.ll_fence == HYBRIDEP_LL_FENCE_THREAD) __threadfence_system();
    __syncthreads();
    if (per_block) {
        if (!dest || *(volatile int *)k.abort_flag) return;
        if (k.ll_fence == HYBRIDEP_LL_FENCE_BLOCK) __threadfence_system();
        red_release_sys(&peer_header_at(k.peers[d])->arrived[k.rank][1].seq, 1);
        return;
    }
    if (threadIdx.x == 0) {
        if (k.ll_fence == HYBRIDEP_LL_FENCE_BLOCK) __threadfence_system();
        const unsigned before = atomicAdd(k.sent_blocks, 1u);
        last = before == gridDim.x - 1;
        if (last) {
            atomicExch(k.sent_blocks, 0u);
            __threadfence_system();
        }
    }
    __syncthreads();
    if (!last || *(volatile int *)k.abort_flag) return;
    if (dest) st_release_sys(&peer_header_at(k.peers[d])->arrived[k.rank][0].seq, cur_seq());
}

/* One warp waits (lane s polls rank s, acquire) until every rank of `mask` has published this call's arrival
 * (`arrival`) or stamped that it read the previous call (else). No block barrier: every warp waits only before the
 * work that needs it. A wait that runs out names the first late rank from rank + 1 on (this rank last), whichever
 * lane ran out first, so a stall always names the same peer. False on every lane after a failure or an abort. */
__device__ bool warp_wait(const hybridep_cuda_call &k, unsigned mask, bool arrival)
{
    const int lane = threadIdx.x & 31, W = k.geo.world;
    const peer_header *h = peer_header_at(k.local);
    const bool count = arrival && k.ll_flag == HYBRIDEP_LL_FLAG_PER_BLOCK; /* a running count of sending blocks */
    const int64_t target = count ? cur_epoch() * (int64_t)gridDim.x : arrival ? cur_seq() : cur_seq() - 1;
    const int64_t *f = nullptr;
    if (lane < W && ((mask >> lane) & 1u))
        f = count ? &h->arrived[lane][1].seq : arrival ? &h->arrived[lane][0].seq : &h->consumed[lane][0];
    bool late = false, aborted = false;
    if (f && ld_acquire_sys(f) < target) {
        const uint64_t start = now_ns();
        while (ld_acquire_sys(f) < target) {
            if (*(volatile int *)k.abort_flag) {
                aborted = true;
                break;
            }
            if (now_ns() - start > (uint64_t)k.timeout_ns) {
                late = true;
                break;
            }
        }
    }
    const unsigned late_lanes = __ballot_sync(FULL, late);
    const bool any_aborted = __any_sync(FULL, aborted);
    if (late_lanes) {
        /* every rank of the mask still short of the target, then the first of them in rank + 1, ... order */
        const unsigned short_lanes = __ballot_sync(FULL, f && ld_acquire_sys(f) < target) | late_lanes;
        if (lane == 0)
            for (int j = 1; j <= W; j++) {
                const int s = (k.rank + j) % W;
                if ((short_lanes >> s) & 1u) {
                    record_failure(k, arrival ? PEER_WAIT_ARRIVAL : PEER_WAIT_CONSUMED, s);
                    break;
                }
            }
    }
    __syncwarp();
    return !late_lanes && !any_aborted;
}

/* Every rank (all) or every other rank (others): a warp_wait mask. */
__device__ __forceinline__ unsigned ranks_mask(const hybridep_cuda_call &k, bool others)
{
    const unsigned all = (1u << k.geo.world) - 1u;
    return others ? all & ~(1u << k.rank) : all;
}

/* Staging row of the combine partial of row i received from rank s (s != rank; normal mode). */
__device__ __forceinline__ char *staged_row(const hybridep_cuda_call &k, int s, int64_t i)
{
    const int j = s < k.rank ? s : s - 1;
    return (char *)k.staging + ((size_t)j * (size_t)k.geo.rows_cap + (size_t)i) * k.geo.row_stride;
}

/* Item g of a list of received rows (sources in rank order, `skip_self` leaves this rank out): its source rank and
 * row; false past the end. */
__device__ __forceinline__ bool received_item(const hybridep_cuda_call &k, int64_t g, bool skip_self, int *s,
                                              int64_t *i)
{
    for (int r = 0; r < k.geo.world; r++) {
        if (skip_self && r == k.rank) continue;
        const int64_t n = k.recv_tokens[r];
        if (g < n) {
            *s = r;
            *i = g;
            return true;
        }
        g -= n;
    }
    return false;
}

/* Rows received from every rank (or every other rank). */
__device__ __forceinline__ int64_t received_total(const hybridep_cuda_call &k, bool skip_self)
{
    int64_t n = 0;
    for (int r = 0; r < k.geo.world; r++)
        if (!skip_self || r != k.rank) n += k.recv_tokens[r];
    return n;
}

/* ---- prepare: layout + notify, one block ---- */

/* Shared memory: cnt [32 warps][E] int32 (per-warp copies per expert, then the warp's start), counts [E] int32,
 * tcnt [32][W] int32 (per-warp tokens per rank, then starts), tokens_to [W]; after the layout, cnt holds the notify
 * rows [W][E] of every source. */
__global__ void __launch_bounds__(PREP_THREADS) prepare_kernel(hybridep_cuda_call k, const int32_t *__restrict__ idx_in)
{
    extern __shared__ int32_t sm[];
    __shared__ int stalled, bad_total;
    const int W = k.geo.world, me = k.rank, K = (int)k.topk, C = k.channels;
    const int E = (int)k.num_experts, El = (int)k.local_experts;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t T = k.tokens, R = k.geo.rows_cap;
    int32_t *cnt = sm, *counts = sm + 32 * E, *tcnt = counts + E, *tokens_to = tcnt + 32 * PEER_MAX_RANKS;
    if (*(volatile int *)k.abort_flag) return;
    begin_call(k);
    for (int i = threadIdx.x; i < 32 * E; i += blockDim.x) cnt[i] = 0;
    for (int i = threadIdx.x; i < 32 * PEER_MAX_RANKS; i += blockDim.x) tcnt[i] = 0;
    if (threadIdx.x == 0) stalled = bad_total = 0;
    __syncthreads();

    /* pass 1: each warp counts its tokens' copies per expert and its tokens per rank */
    const int64_t tw0 = T * warp / 32, tw1 = T * (warp + 1) / 32;
    int bad = 0;
    for (int64_t c = tw0 * K + lane; c < tw1 * K; c += 32) {
        const int32_t e = idx_in[c];
        k.topk_idx[c] = e;
        if (e >= 0 && e < E)
            atomicAdd(&cnt[warp * E + e], 1);
        else if (e != -1)
            bad++;
    }
    if (bad) atomicAdd(&bad_total, bad);
    for (int64_t t0 = tw0; t0 < tw1; t0 += 32) {
        const int64_t t = t0 + lane;
        unsigned ranks = 0;
        if (t < tw1)
            for (int j = 0; j < K; j++) {
                const int32_t e = idx_in[t * K + j];
                if (e >= 0 && e < E) ranks |= 1u << (e / El);
            }
        for (int d = 0; d < W; d++) {
            const unsigned b = __ballot_sync(FULL, (ranks >> d) & 1u);
            if (lane == 0) tcnt[warp * PEER_MAX_RANKS + d] += __popc(b);
        }
    }
    __syncthreads();
    /* each warp's start per expert and per rank */
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int run = 0;
        for (int w = 0; w < 32; w++) {
            const int v = cnt[w * E + e];
            cnt[w * E + e] = run;
            run += v;
        }
        counts[e] = run;
    }
    if (threadIdx.x < W) {
        const int d = threadIdx.x;
        int run = 0;
        for (int w = 0; w < 32; w++) {
            const int v = tcnt[w * PEER_MAX_RANKS + d];
            tcnt[w * PEER_MAX_RANKS + d] = run;
            run += v;
        }
        tokens_to[d] = run;
        k.excl[(int64_t)d * (R + 1) + T] = run;
    }
    __syncthreads();
    /* pass 2: each copy's place among this rank's copies to its expert, in (t, k) order; each token's place per rank */
    const unsigned lower = (1u << lane) - 1u;
    for (int64_t c0 = tw0 * K; c0 < tw1 * K; c0 += 32) {
        const int64_t c = c0 + lane;
        const int32_t e = c < tw1 * K ? idx_in[c] : -1;
        const bool valid = e >= 0 && e < E;
        const unsigned same = __match_any_sync(FULL, valid ? e : -2 - lane);
        const int start = valid ? cnt[warp * E + e] : 0;
        __syncwarp();
        if (valid) {
            k.copy_index[c] = start + __popc(same & lower);
            if ((same >> lane) == 1u) cnt[warp * E + e] = start + __popc(same); /* the group's last lane */
        } else if (c < tw1 * K) {
            k.copy_index[c] = -1;
        }
        __syncwarp();
    }
    for (int64_t t0 = tw0; t0 < tw1; t0 += 32) {
        const int64_t t = t0 + lane;
        unsigned ranks = 0;
        if (t < tw1)
            for (int j = 0; j < K; j++) {
                const int32_t e = idx_in[t * K + j];
                if (e >= 0 && e < E) ranks |= 1u << (e / El);
            }
        for (int d = 0; d < W; d++) {
            const unsigned b = __ballot_sync(FULL, (ranks >> d) & 1u);
            const int start = tcnt[warp * PEER_MAX_RANKS + d];
            if (t < tw1) k.excl[(int64_t)d * (R + 1) + t] = start + __popc(b & lower);
            __syncwarp();
            if (lane == 0) tcnt[warp * PEER_MAX_RANKS + d] = start + __popc(b);
            __syncwarp();
        }
    }
    __syncthreads();

    /* notify: wait until every rank has read what this rank wrote in the previous call, write this rank's row into
     * every rank's buffer, publish it; wait for every rank's row */
    const int n = E + HYBRIDEP_NOTIFY_EXTRA;
    if (threadIdx.x < W)
        if (!wait_geq(&peer_header_at(k.local)->consumed[threadIdx.x][0], cur_seq() - 1, k, PEER_WAIT_CONSUMED,
                      threadIdx.x))
            stalled = 1;
    __syncthreads();
    if (stalled) goto done;
    for (int i = threadIdx.x; i < W * n; i += blockDim.x) {
        const int d = i / n, j = i % n;
        int64_t v = j < E ? counts[j] : 0;
        if (j == E + HYBRIDEP_NOTIFY_STATUS) v = bad_total;
        if (j == E + HYBRIDEP_NOTIFY_CHANNELS) v = C;
        if (j == E + HYBRIDEP_NOTIFY_TOKENS) v = T;
        const int to = j - E - HYBRIDEP_NOTIFY_TOKENS_TO; /* tokens per destination rank */
        if (to >= 0) v = to < W ? tokens_to[to] : 0;
        *(volatile int64_t *)&peer_notify_row(&k.geo, k.peers[d], me)[j] = v;
    }
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x < W) st_release_sys(&peer_header_at(k.peers[threadIdx.x])->notified[me], cur_seq());
    if (threadIdx.x < W)
        if (!wait_geq(&peer_header_at(k.local)->notified[threadIdx.x], cur_seq(), k, HYBRIDEP_WAIT_NOTIFY, threadIdx.x))
            stalled = 1;
    __syncthreads();
    if (stalled) goto done;
    for (int i = threadIdx.x; i < W * E; i += blockDim.x) /* cnt now holds every source's counts, [W][E] */
        cnt[i] = (int32_t)__ldcg(&peer_notify_row(&k.geo, k.local, i / E)[i % E]);
    if (threadIdx.x < W) {
        const int s = threadIdx.x;
        const int64_t *row = peer_notify_row(&k.geo, k.local, s);
        if (__ldcg(&row[E + HYBRIDEP_NOTIFY_STATUS]) != 0) record_failure(k, HYBRIDEP_BAD_IDS, s);
        if (__ldcg(&row[E + HYBRIDEP_NOTIFY_CHANNELS]) != C) record_failure(k, HYBRIDEP_CHANNELS, s);
        k.recv_tokens[s] = __ldcg(&row[E + HYBRIDEP_NOTIFY_TOKENS_TO + me]);
    }
    __syncthreads();
    /* the plan: rows per local expert, and where this rank's copies to each expert start on its rank */
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        const int d = e / El, l = e % El;
        int64_t start = 0, before = 0;
        for (int l2 = 0; l2 < l; l2++)
            for (int s = 0; s < W; s++) start += cnt[s * E + d * El + l2];
        for (int s = 0; s < me; s++) before += cnt[s * E + e];
        k.base[e] = start + before;
    }
    for (int l = threadIdx.x; l < El; l += blockDim.x) {
        int64_t rows = 0;
        for (int s = 0; s < W; s++) rows += cnt[s * E + me * El + l];
        k.tokens_per_expert[l] = rows;
    }
    __syncthreads();
    /* the rows are read: release them */
    if (threadIdx.x < W) st_release_sys(&peer_header_at(k.peers[threadIdx.x])->consumed[me][0], cur_seq());
done: /* the call is done, failed or not (every thread has read the numbers at begin_call) */
    if (threadIdx.x == 0) end_call(k);
}

/* ---- dispatch ---- */

/* The copies of token t: lane k < K gets its expert's rank (-1 dropped), its final row there and its prob; returns
 * the set of ranks holding one (this rank included). */
__device__ __forceinline__ unsigned token_copies(const hybridep_cuda_call &k, int64_t t, int lane, int *dr, int *dst,
                                                 float *p, const float *probs)
{
    const int K = (int)k.topk;
    *dr = -1;
    *dst = -1;
    *p = 0.0f;
    if (lane < K) {
        const int ci = k.copy_index[t * K + lane];
        if (ci >= 0) {
            const int e = k.topk_idx[t * K + lane];
            *dr = (int)(e / k.local_experts);
            *dst = (int)(k.base[e] + ci);
            if (probs) *p = probs[t * K + lane];
        }
    }
    return __reduce_or_sync(FULL, *dr >= 0 ? 1u << *dr : 0u);
}

/* Token t's slot rows on every other rank of `ranks` (nullptr elsewhere); with `meta`, its metadata written there
 * (its copies' rows and probs on that rank, -1 elsewhere). */
__device__ __forceinline__ void token_rows(const hybridep_cuda_call &k, int64_t t, unsigned ranks, int lane, int dr,
                                           int dst, float p, bool meta, char **rows)
{
    const int64_t R = k.geo.rows_cap;
#pragma unroll
    for (int d = 0; d < PEER_MAX_RANKS; d++) {
        rows[d] = nullptr;
        if (d < k.geo.world && d != k.rank && ((ranks >> d) & 1u)) {
            const int64_t pos = k.excl[(int64_t)d * (R + 1) + t];
            rows[d] = peer_row(&k.geo, k.peers[d], k.rank, pos);
            if (meta && lane < (int)k.topk) {
                char *m = peer_meta(&k.geo, k.peers[d], k.rank, pos);
                ((int32_t *)m)[lane] = dr == d ? dst : -1;
                ((double *)(m + k.geo.meta_prob_offset))[lane] = dr == d ? (double)p : 0.0;
            }
        }
    }
}

/* One warp: units [u0, u1) of src (read-only input, or a slot row through L2) to every non-null row of dst; UNROLL
 * units per lane in flight. Loop bounds are the same on every lane. */
template <typename V, bool RO, int N_DST>
__device__ __forceinline__ void warp_copy(const V *src, int64_t u0, int64_t u1, char *const *dst)
{
    const int lane = threadIdx.x & 31;
    for (int64_t b = u0; b < u1; b += 32 * UNROLL) {
        V v[UNROLL];
#pragma unroll
        for (int j = 0; j < UNROLL; j++) {
            const int64_t u = b + j * 32 + lane;
            if (u < u1) v[j] = RO ? load_ro(src + u) : __ldcg(src + u);
        }
#pragma unroll
        for (int d = 0; d < N_DST; d++)
            if (dst[d])
#pragma unroll
                for (int j = 0; j < UNROLL; j++) {
                    const int64_t u = b + j * 32 + lane;
                    if (u < u1) ((V *)dst[d])[u] = v[j];
                }
    }
}

/* One warp: units [u0, u1) of src to the rows of out named by the lanes in `copies` (each lane's dst). */
template <typename V, bool RO>
__device__ __forceinline__ void warp_expand(const V *src, int64_t u0, int64_t u1, unsigned copies, int dst, void *out,
                                            size_t out_row)
{
    const int lane = threadIdx.x & 31;
    for (int64_t b = u0; b < u1; b += 32 * UNROLL) {
        V v[UNROLL];
#pragma unroll
        for (int j = 0; j < UNROLL; j++) {
            const int64_t u = b + j * 32 + lane;
            if (u < u1) v[j] = RO ? load_ro(src + u) : __ldcg(src + u);
        }
        for (unsigned m = copies; m; m &= m - 1) {
            const int r = __shfl_sync(FULL, dst, __ffs(m) - 1);
            V *o = (V *)((char *)out + (size_t)r * out_row);
#pragma unroll
            for (int j = 0; j < UNROLL; j++) {
                const int64_t u = b + j * 32 + lane;
                if (u < u1) o[u] = v[j];
            }
        }
    }
}

/* The per-warp TMA pipeline of an NVLink-phase block: S stages of `stride` bytes and their mbarriers; g counts the
 * rows loaded so far (stage g % S, phase (g / S) & 1). */
struct pipe {
    char *stages;
    uint64_t *bars;
    int S;
    uint32_t bytes, stride, g;
};

/* Carves the block's shared memory into one pipeline per warp and initialises the mbarriers (whole block). */
__device__ __forceinline__ void pipe_init(pipe &p, char *smem, int stages, uint32_t bytes, uint32_t stride)
{
    const int warp = threadIdx.x >> 5, P = blockDim.x >> 5;
    p.S = stages;
    p.bytes = bytes;
    p.stride = stride;
    p.g = 0;
    p.stages = smem + (size_t)warp * stages * stride;
    p.bars = (uint64_t *)(smem + (size_t)P * stages * stride) + warp * MAX_STAGES;
    if ((threadIdx.x & 31) == 0)
        for (int s = 0; s < stages; s++) mbar_init(p.bars + s);
    mbar_init_fence();
    __syncthreads();
}

__device__ __forceinline__ void pipe_load(pipe &p, uint32_t gi, const void *src)
{
    const int st = gi % p.S;
    tma_load(p.stages + (size_t)st * p.stride, src, p.bytes, p.bars + st);
}

/* Waits for load gi; returns its stage. */
__device__ __forceinline__ char *pipe_wait(pipe &p, uint32_t gi)
{
    const int st = gi % p.S;
    mbar_wait(p.bars + st, (gi / p.S) & 1u);
    return p.stages + (size_t)st * p.stride;
}

/*
 * The NVLink phase's row loop, shared by dispatch and combine: warp w of the block takes items first = g0 + w,
 * g0 + w + P, ... below g1; job.src(k, g) is item g's source row (any lane; valid memory for every g < g1),
 * job.rows(k, g, lane, dst) writes its metadata and fills dst[PEER_MAX_RANKS] with its destination rows (nullptr:
 * none; the same on every lane). TMA: lane 0 loads rows S - 1 ahead into the warp's stages and bulk-stores each to
 * its destinations, one bulk group per row, reusing a stage once the stores that read it are done reading. Vector:
 * the warp moves 16-byte units, UNROLL per lane in flight. Ends with every store complete.
 */
template <typename V, bool TMA, bool RO, typename Job>
__device__ void nvlink_rows(const hybridep_cuda_call &k, const Job &job, int64_t g0, int64_t g1, int64_t units,
                            pipe &pp)
{
    const int P = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t first = g0 + warp, n = first < g1 ? (g1 - first + P - 1) / P : 0;
    if (TMA && lane == 0)
        for (int64_t i = 0; i < n && i < pp.S - 1; i++) pipe_load(pp, pp.g + (uint32_t)i, job.src(k, first + i * P));
    for (int64_t j = 0; j < n; j++) {
        const int64_t g = first + j * P;
        char *rows[PEER_MAX_RANKS];
        job.rows(k, g, lane, rows);
        if (TMA) {
            if (lane == 0) {
                if (j + pp.S - 1 < n) {
                    bulk_wait_read();
                    pipe_load(pp, pp.g + (uint32_t)(j + pp.S - 1), job.src(k, first + (j + pp.S - 1) * P));
                }
                const char *stage = pipe_wait(pp, pp.g + (uint32_t)j);
#pragma unroll
                for (int d = 0; d < PEER_MAX_RANKS; d++)
                    if (rows[d]) bulk_store(rows[d], stage, pp.bytes);
                bulk_commit();
            }
            __syncwarp();
        } else {
            bool any = false;
#pragma unroll
            for (int d = 0; d < PEER_MAX_RANKS; d++) any = any || rows[d];
            if (any) warp_copy<V, RO, PEER_MAX_RANKS>((const V *)job.src(k, g), 0, units, rows);
        }
    }
    if (TMA) {
        if (lane == 0) bulk_wait_all();
        pp.g += (uint32_t)n;
        __syncwarp();
        fence_proxy_async();
    }
}

/* A dispatch-like call's NVLink-phase job: item g is token g of this rank, its row of x once to every other rank
 * holding one of its copies, with the metadata. */
struct dispatch_job {
    const char *x;
    const float *probs;
    size_t row_bytes;
    __device__ const void *src(const hybridep_cuda_call &, int64_t t) const { return x + (size_t)t * row_bytes; }
    __device__ void rows(const hybridep_cuda_call &k, int64_t t, int lane, char **dst) const
    {
        int dr, d;
        float p;
        const unsigned ranks = token_copies(k, t, lane, &dr, &d, &p, probs);
        token_rows(k, t, ranks, lane, dr, d, p, true, dst);
    }
};

/* The NVLink phase of a dispatch-like call, block c: this rank's tokens [T*c/C, T*(c+1)/C), each written once into
 * every other rank holding one of its experts; then the block's arrival flag there. */
template <typename V, bool TMA>
__global__ void __launch_bounds__(SEND_THREADS)
    dispatch_send_kernel(hybridep_cuda_call k, const void *x, const float *probs, int64_t units, int stages)
{
    extern __shared__ __align__(128) char stage_mem[];
    const int c = blockIdx.x;
    const int64_t T = k.tokens;
    pipe pp;
    if (TMA) pipe_init(pp, stage_mem, stages, (uint32_t)(units * sizeof(V)), (uint32_t)k.geo.row_stride);
    begin_call(k);
    if (!block_wait(k, WAIT_CONSUMED)) return;
    const dispatch_job job = {(const char *)x, probs, (size_t)units * sizeof(V)};
    nvlink_rows<V, TMA, true>(k, job, T * c / k.channels, T * (c + 1) / k.channels, units, pp);
    block_publish(k, c, false);
}

/* Item g of a dispatch-like call's expansion (received rows of every other rank, then this rank's own tokens): lane
 * k < K gets its copy's row in out (-1: none) and prob; returns the source row (nullptr: no copy here) and sets s, i
 * (the slot and row whose metadata combine keeps). */
template <typename V>
__device__ __forceinline__ const V *expand_item(const hybridep_cuda_call &k, int64_t g, int64_t staged, const void *x,
                                                const float *probs, size_t row_bytes, int lane, int *s, int64_t *i,
                                                int *dst, float *p, bool want_probs)
{
    const int me = k.rank, K = (int)k.topk;
    *dst = -1;
    *p = 0.0f;
    if (g < staged) {
        received_item(k, g, true, s, i);
        const char *meta = peer_meta(&k.geo, k.local, *s, *i);
        if (lane < K) {
            *dst = __ldcg((const int32_t *)meta + lane);
            if (*dst >= 0 && want_probs) *p = (float)__ldcg((const double *)(meta + k.geo.meta_prob_offset) + lane);
        }
        return (const V *)peer_row(&k.geo, k.local, *s, *i);
    }
    const int64_t t = g - staged, T = k.tokens;
    const int32_t *ex = k.excl + (int64_t)me * (k.geo.rows_cap + 1);
    *s = me;
    *i = ex[t];
    if (ex[t + 1] == *i) return nullptr; /* no copy of token t here; the same on every lane */
    if (lane < K) {
        const int ci = k.copy_index[t * K + lane];
        const int e = k.topk_idx[t * K + lane];
        if (ci >= 0 && e / k.local_experts == me) {
            *dst = (int)(k.base[e] + ci);
            if (probs) *p = probs[t * K + lane];
        }
    }
    (void)T;
    return (const V *)((const char *)x + (size_t)t * row_bytes);
}

/* The local half of a dispatch-like call, over every SM: waits for every other rank's rows of this call, then one warp
 * per item: a row of this rank's slot for rank s, or one of this rank's own tokens (straight from x), written into the
 * rows of its copies (the fused permutation) with their probs; the copies' rows are saved for combine; the last
 * block releases the slots. */
template <typename V>
__global__ void __launch_bounds__(LOCAL_THREADS)
    dispatch_expand_kernel(hybridep_cuda_call k, const void *x, const float *probs, void *out, float *out_probs,
                           int64_t units)
{
    const int K = (int)k.topk, lane = threadIdx.x & 31;
    const size_t row_bytes = (size_t)units * sizeof(V);
    begin_call(k);
    if (block_wait(k, WAIT_ARRIVED_OTHERS)) {
        const int64_t staged = received_total(k, true), items = staged + k.tokens;
        const int64_t step = (int64_t)gridDim.x * LOCAL_WARPS;
        for (int64_t g = (int64_t)blockIdx.x * LOCAL_WARPS + (threadIdx.x >> 5); g < items; g += step) {
            int s, dst;
            int64_t i;
            float p;
            const V *row = expand_item<V>(k, g, staged, x, probs, row_bytes, lane, &s, &i, &dst, &p, out_probs);
            if (!row) continue;
            if (lane < K) {
                k.recv_meta[((int64_t)s * k.geo.rows_cap + i) * K + lane] = dst;
                if (dst >= 0 && out_probs) out_probs[dst] = p;
            }
            const unsigned copies = __ballot_sync(FULL, dst >= 0);
            if (s == k.rank)
                warp_expand<V, true>(row, 0, units, copies, dst, out, row_bytes);
            else
                warp_expand<V, false>(row, 0, units, copies, dst, out, row_bytes);
        }
    }
    block_finish(k);
}

/* One warp, a (row, piece) item of a low-latency expansion: row g of the expansion list (expand_item's), units
 * [u0, u1) written into the rows of its copies; the copies' rows (for combine) and probs with piece 0. */
template <typename V>
__device__ __forceinline__ void ll_expand_piece(const hybridep_cuda_call &k, int64_t g, int64_t staged, int64_t u0,
                                                int64_t u1, const void *x, const float *probs, void *out,
                                                float *out_probs, size_t row_bytes, int lane)
{
    int s, dst;
    int64_t i;
    float p;
    const V *row = expand_item<V>(k, g, staged, x, probs, row_bytes, lane, &s, &i, &dst, &p, out_probs);
    if (!row) return; /* the same on every lane */
    if (u0 == 0 && lane < (int)k.topk) {
        k.recv_meta[((int64_t)s * k.geo.rows_cap + i) * k.topk + lane] = dst;
        if (dst >= 0 && out_probs) out_probs[dst] = p;
    }
    const unsigned copies = __ballot_sync(FULL, dst >= 0);
    if (s == k.rank)
        warp_expand<V, true>(row, u0, u1, copies, dst, out, row_bytes);
    else
        warp_expand<V, false>(row, u0, u1, copies, dst, out, row_bytes);
}

/* Low-latency dispatch, one kernel over `channels` resident blocks of THREADS threads (ll_threads). (1) Every warp of
 * the grid takes items of one list: first (token, piece) sends, a piece of k.piece units of the token's row (ll_piece)
 * written into every other rank holding one of
 * its copies (the metadata with piece 0; before its first send a warp waits for every rank's release of the previous
 * call), then (own token, piece) items of the expansion, this rank's own tokens straight from x into their rows of
 * out while the sends are in flight; then the grid's one arrival flag per destination (ll_publish). (2) Every warp
 * with work waits for every other rank's flag, then (received row, piece) items of the expansion; the last block
 * releases the slots. */
template <typename V, int THREADS>
__global__ void __launch_bounds__(THREADS, 1)
    ll_dispatch_kernel(hybridep_cuda_call k, const void *x, const float *probs, void *out, float *out_probs,
                       int64_t units)
{
    constexpr int WARPS = THREADS / 32;
    const int lane = threadIdx.x & 31;
    const size_t row_bytes = (size_t)units * sizeof(V);
    const int64_t piece = k.piece, pieces = (units + piece - 1) / piece, T = k.tokens;
    const int64_t gw = (int64_t)blockIdx.x * WARPS + (threadIdx.x >> 5), step = (int64_t)gridDim.x * WARPS;
    begin_call(k);
    const int64_t staged = received_total(k, true), sends = T * pieces;
    bool ok = !*(volatile int *)k.abort_flag, released = false;
    for (int64_t g = gw; ok && g < 2 * sends; g += step) {
        if (g >= sends) { /* this rank's own token: expanded here while the sends fly */
            const int64_t h = g - sends, u0 = h % pieces * piece, u1 = u0 + piece < units ? u0 + piece : units;
            ll_expand_piece<V>(k, staged + h / pieces, staged, u0, u1, x, probs, out, out_probs, row_bytes, lane);
            continue;
        }
        const int64_t t = g / pieces, u0 = g % pieces * piece, u1 = u0 + piece < units ? u0 + piece : units;
        int dr, d;
        float p;
        const unsigned ranks = token_copies(k, t, lane, &dr, &d, &p, probs) & ~(1u << k.rank);
        if (!ranks) continue; /* the same on every lane */
        if (!released) {      /* before a warp's first send: every rank has read the previous call */
            released = warp_wait(k, ranks_mask(k, false), false);
            if (!released) {
                ok = false;
                break;
            }
        }
        char *rows[PEER_MAX_RANKS];
        token_rows(k, t, ranks, lane, dr, d, p, u0 == 0, rows);
        warp_copy<V, true, PEER_MAX_RANKS>((const V *)((const char *)x + (size_t)t * row_bytes), u0, u1, rows);
    }
    ll_publish(k, false);
    if (ok && staged > 0 && gw < staged * pieces && warp_wait(k, ranks_mask(k, true), true))
        for (int64_t g = gw; g < staged * pieces; g += step) {
            const int64_t u0 = g % pieces * piece, u1 = u0 + piece < units ? u0 + piece : units;
            ll_expand_piece<V>(k, g / pieces, staged, u0, u1, x, probs, out, out_probs, row_bytes, lane);
        }
    block_finish(k);
}

/* ---- combine ---- */

/* One warp, packs [p0, p1) of a row: o = (accumulate ? o : -0) + src[0] + ... + src[n-1], in that order in fp32 per
 * element (the CPU's order), rounded to T; n == 0 without accumulate writes zeros of the empty sum's sign (`zero`:
 * +0, a token without copies, as the CPU path; else -0). Loop bounds are the same on every lane; each lane has two
 * packs per source row in flight. */
template <typename T, int N>
__device__ __forceinline__ void warp_sum(const T *const *src, int n, int64_t p0, int64_t p1, T *o, bool accumulate,
                                         bool zero)
{
    const int lane = threadIdx.x & 31;
    for (int64_t q0 = p0; q0 < p1; q0 += 64) {
        const int64_t q[2] = {q0 + lane, q0 + 32 + lane};
        float acc[2][N];
#pragma unroll
        for (int u = 0; u < 2; u++) {
#pragma unroll
            for (int e = 0; e < N; e++) acc[u][e] = zero ? 0.0f : -0.0f;
            if (accumulate && q[u] < p1) {
                const pack<T, N> v = load_pack<T, N>(o + q[u] * N);
#pragma unroll
                for (int e = 0; e < N; e++) acc[u][e] = elem<T>::to_f(v.v[e]);
            }
        }
        int j = 0;
        for (; j + 1 < n; j += 2) {
            pack<T, N> va[2], vb[2];
#pragma unroll
            for (int u = 0; u < 2; u++)
                if (q[u] < p1) {
                    va[u] = load_pack<T, N>(src[j] + q[u] * N);
                    vb[u] = load_pack<T, N>(src[j + 1] + q[u] * N);
                }
#pragma unroll
            for (int u = 0; u < 2; u++)
                if (q[u] < p1)
#pragma unroll
                    for (int e = 0; e < N; e++) {
                        acc[u][e] = __fadd_rn(acc[u][e], elem<T>::to_f(va[u].v[e]));
                        acc[u][e] = __fadd_rn(acc[u][e], elem<T>::to_f(vb[u].v[e]));
                    }
        }
        if (j < n) {
            pack<T, N> va[2];
#pragma unroll
            for (int u = 0; u < 2; u++)
                if (q[u] < p1) va[u] = load_pack<T, N>(src[j] + q[u] * N);
#pragma unroll
            for (int u = 0; u < 2; u++)
                if (q[u] < p1)
#pragma unroll
                    for (int e = 0; e < N; e++) acc[u][e] = __fadd_rn(acc[u][e], elem<T>::to_f(va[u].v[e]));
        }
#pragma unroll
        for (int u = 0; u < 2; u++)
            if (q[u] < p1) {
                pack<T, N> w;
#pragma unroll
                for (int e = 0; e < N; e++) w.v[e] = elem<T>::from_f(acc[u][e]);
                *(pack<T, N> *)(o + q[u] * N) = w;
            }
    }
}

/* A received row's copies (row i of rank s in the last dispatch-like call): their rows of `rows` into the warp's src
 * list in k order; lane k < K gets its copy's row (-1: dropped). Returns the count. */
template <typename T>
__device__ __forceinline__ int row_copies(const hybridep_cuda_call &k, int s, int64_t i, const T *rows, int lane,
                                          const T **src, int *dst)
{
    const int K = (int)k.topk;
    *dst = lane < K ? k.recv_meta[((int64_t)s * k.geo.rows_cap + i) * K + lane] : -1;
    const unsigned copies = __ballot_sync(FULL, *dst >= 0);
    if (*dst >= 0) src[__popc(copies & ((1u << lane) - 1u))] = rows + (int64_t)*dst * k.hidden;
    __syncwarp();
    return __popc(copies);
}

/* The prob gradients of a received row's copies (lane k < K, its row dst) into a metadata entry. */
__device__ __forceinline__ void write_prob_grads(const hybridep_cuda_call &k, char *meta, int lane, int dst,
                                                 const float *row_probs)
{
    if (lane < (int)k.topk) ((double *)(meta + k.geo.meta_prob_offset))[lane] = dst >= 0 ? (double)row_probs[dst] : 0.0;
}

/* Token t's partials (one per rank holding a copy, in rank order) into the warp's src list; returns the count. */
template <typename T>
__device__ __forceinline__ int token_partials(const hybridep_cuda_call &k, int64_t t, int lane, const T **src)
{
    const int64_t R = k.geo.rows_cap;
    int64_t pos = -1;
    if (lane < k.geo.world) {
        const int32_t *ex = k.excl + (int64_t)lane * (R + 1);
        if (ex[t + 1] > ex[t]) pos = ex[t];
    }
    const unsigned ranks = __ballot_sync(FULL, pos >= 0);
    if (pos >= 0) src[__popc(ranks & ((1u << lane) - 1u))] = (const T *)peer_row(&k.geo, k.local, lane, pos);
    __syncwarp();
    return __popc(ranks);
}

/* Token t's prob gradients (lane k < K) from the metadata its copies' ranks sent back. */
__device__ __forceinline__ void token_prob_grads(const hybridep_cuda_call &k, int64_t t, int lane, float *out_probs)
{
    const int K = (int)k.topk;
    const int64_t R = k.geo.rows_cap;
    if (lane >= K) return;
    float v = 0.0f;
    if (k.copy_index[t * K + lane] >= 0) {
        const int d = (int)(k.topk_idx[t * K + lane] / k.local_experts);
        const int64_t p = k.excl[(int64_t)d * (R + 1) + t];
        v = (float)__ldcg((const double *)(peer_meta(&k.geo, k.local, d, p) + k.geo.meta_prob_offset) + lane);
    }
    out_probs[t * K + lane] = v;
}

/* The first local half of a combine-like call, over every SM: one warp per row received in the last dispatch-like
 * call (every source, this rank's own tokens included): its copies summed in fp32 in k order, rounded to the rows'
 * dtype, into this rank's own slot (own tokens, with the prob gradients) or the staging area (the NVLink phase sends
 * those). */
template <typename T, int N>
__global__ void __launch_bounds__(LOCAL_THREADS)
    combine_reduce_kernel(hybridep_cuda_call k, const T *rows, const float *row_probs)
{
    __shared__ const T *src[LOCAL_WARPS][32];
    if (*(volatile int *)k.abort_flag) return; /* no block-wide barrier below */
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t packs = k.hidden / N, items = received_total(k, false);
    const int64_t step = (int64_t)gridDim.x * LOCAL_WARPS;
    for (int64_t g = (int64_t)blockIdx.x * LOCAL_WARPS + warp; g < items; g += step) {
        int s, dst;
        int64_t i;
        received_item(k, g, false, &s, &i);
        const int n = row_copies<T>(k, s, i, rows, lane, src[warp], &dst);
        T *o;
        if (s == k.rank) {
            o = (T *)peer_row(&k.geo, k.local, s, i);
            if (row_probs) write_prob_grads(k, peer_meta(&k.geo, k.local, s, i), lane, dst, row_probs);
        } else {
            o = (T *)staged_row(k, s, i);
        }
        warp_sum<T, N>(src[warp], n, 0, packs, o, false, false);
        __syncwarp();
    }
}

/* A combine-like call's NVLink-phase job: item g is row g / (W-1) of the (g % (W-1))-th other rank (interleaved, so
 * every block sends to every rank), its staged partial into that rank's slot for this rank, at the row the token had
 * in dispatch, with the prob gradients. */
struct combine_job {
    const float *row_probs;
    __device__ void item(const hybridep_cuda_call &k, int64_t g, int *s, int64_t *i) const
    {
        const int j = (int)(g % (k.geo.world - 1));
        *s = j < k.rank ? j : j + 1;
        *i = g / (k.geo.world - 1);
    }
    __device__ const void *src(const hybridep_cuda_call &k, int64_t g) const
    {
        int s;
        int64_t i;
        item(k, g, &s, &i);
        return staged_row(k, s, i);
    }
    __device__ void rows(const hybridep_cuda_call &k, int64_t g, int lane, char **dst) const
    {
        int s;
        int64_t i;
        item(k, g, &s, &i);
#pragma unroll
        for (int d = 0; d < PEER_MAX_RANKS; d++) dst[d] = nullptr;
        if (i >= k.recv_tokens[s]) return;
        dst[0] = peer_row(&k.geo, k.peers[s], k.rank, i);
        if (row_probs) {
            const int K = (int)k.topk;
            const int d = lane < K ? k.recv_meta[((int64_t)s * k.geo.rows_cap + i) * K + lane] : -1;
            write_prob_grads(k, peer_meta(&k.geo, k.peers[s], k.rank, i), lane, d, row_probs);
        }
    }
};

/* The NVLink phase of a combine-like call, block c: its share of the staged partials, then its arrival flag in every
 * other rank. Rows move as whole 16-byte units (slot and staging rows are padded to row_stride). */
template <bool TMA>
__global__ void __launch_bounds__(SEND_THREADS)
    combine_send_kernel(hybridep_cuda_call k, const float *row_probs, int64_t units, int stages)
{
    extern __shared__ __align__(128) char stage_mem[];
    const int W = k.geo.world, c = blockIdx.x;
    pipe pp;
    if (TMA) pipe_init(pp, stage_mem, stages, (uint32_t)(units * 16), (uint32_t)k.geo.row_stride);
    const combine_job job = {row_probs};
    int64_t longest = 0;
    for (int r = 0; r < W; r++)
        if (r != k.rank && k.recv_tokens[r] > longest) longest = k.recv_tokens[r];
    begin_call(k);
    if (!block_wait(k, WAIT_CONSUMED)) return;
    const int64_t items = longest * (W - 1);
    nvlink_rows<int4, TMA, false>(k, job, items * c / k.channels, items * (c + 1) / k.channels, units, pp);
    block_publish(k, c, false);
}

/* The second local half, over every SM: waits for every other rank's partials of this call, then one warp per token
 * of this rank: its partials summed in rank order (fp32, from -0 or from out's value) into out (0 / untouched without a
 * kept copy), prob gradients to their (t, k) slots; the last block releases the slots. */
template <typename T, int N>
__global__ void __launch_bounds__(LOCAL_THREADS)
    combine_final_kernel(hybridep_cuda_call k, T *out, bool accumulate, float *out_probs)
{
    __shared__ const T *src[LOCAL_WARPS][PEER_MAX_RANKS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t H = k.hidden, packs = H / N;
    begin_call(k);
    if (block_wait(k, WAIT_ARRIVED_OTHERS)) {
        const int64_t step = (int64_t)gridDim.x * LOCAL_WARPS;
        for (int64_t t = (int64_t)blockIdx.x * LOCAL_WARPS + warp; t < k.tokens; t += step) {
            const int n = token_partials<T>(k, t, lane, src[warp]);
            if (n > 0 || !accumulate) warp_sum<T, N>(src[warp], n, 0, packs, out + t * H, accumulate, n == 0);
            if (out_probs) token_prob_grads(k, t, lane, out_probs);
            __syncwarp();
        }
    }
    block_finish(k);
}

/* Low-latency combine, one kernel over `channels` resident blocks of THREADS threads: (1) (received row, piece)
 * items: the piece of the row's partial (its copies summed in k order) written straight into its rank's slot for this rank (this rank's own
 * slot for its own tokens), the prob gradients with piece 0 (before its first item a warp waits for every rank's
 * release of the previous call); the grid's one arrival flag per rank, this one included (ll_publish); (2) every warp
 * with work waits for every rank's flag, then (token, piece) items of the final sum; the last block releases the
 * slots. */
template <typename T, int N, int THREADS>
__global__ void __launch_bounds__(THREADS, 1)
    ll_combine_kernel(hybridep_cuda_call k, const T *rows, const float *row_probs, T *out, bool accumulate,
                      float *out_probs)
{
    constexpr int WARPS = THREADS / 32;
    __shared__ const T *src[WARPS][32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t H = k.hidden, packs = H / N, piece = k.piece, pieces = (packs + piece - 1) / piece;
    const int64_t gw = (int64_t)blockIdx.x * WARPS + warp, step = (int64_t)gridDim.x * WARPS;
    begin_call(k);
    const int64_t items = received_total(k, false) * pieces;
    bool ok = !*(volatile int *)k.abort_flag;
    if (ok && gw < items) ok = warp_wait(k, ranks_mask(k, false), false);
    for (int64_t g = gw; ok && g < items; g += step) {
        const int64_t p0 = g % pieces * piece, p1 = p0 + piece < packs ? p0 + piece : packs;
        int s, dst;
        int64_t i;
        received_item(k, g / pieces, false, &s, &i);
        const int n = row_copies<T>(k, s, i, rows, lane, src[warp], &dst);
        if (p0 == 0 && row_probs) write_prob_grads(k, peer_meta(&k.geo, k.peers[s], k.rank, i), lane, dst, row_probs);
        warp_sum<T, N>(src[warp], n, p0, p1, (T *)peer_row(&k.geo, k.peers[s], k.rank, i), false, false);
        __syncwarp();
    }
    ll_publish(k, true);
    if (ok && gw < k.tokens * pieces && warp_wait(k, ranks_mask(k, false), true))
        for (int64_t g = gw; g < k.tokens * pieces; g += step) {
            const int64_t t = g / pieces, p0 = g % pieces * piece, p1 = p0 + piece < packs ? p0 + piece : packs;
            const int n = token_partials<T>(k, t, lane, src[warp]);
            if (n > 0 || !accumulate) warp_sum<T, N>(src[warp], n, p0, p1, out + t * H, accumulate, n == 0);
            if (p0 == 0 && out_probs) token_prob_grads(k, t, lane, out_probs);
            __syncwarp();
        }
    block_finish(k);
}

/* ---- host side ---- */

static bool aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

extern "C" moert_result hybridep_cuda_mapped(const moert_host *host, void *pinned, void **device_ptr)
{
    CUDA_CHECK(host, cudaHostGetDevicePointer(device_ptr, pinned, 0));
    return MOERT_OK;
}

/* Shared memory of the prepare kernel. */
static size_t prepare_smem(const hybridep_cuda_call *call)
{
    return (size_t)(33 * call->num_experts + 33 * PEER_MAX_RANKS) * sizeof(int32_t);
}

extern "C" moert_result hybridep_cuda_prepare(const moert_host *host, cudaStream_t stream,
                                              const hybridep_cuda_call *call, const int32_t *topk_idx)
{
    prepare_kernel<<<1, PREP_THREADS, prepare_smem(call), stream>>>(*call, topk_idx);
    LAUNCH_CHECK(host, "hybridep prepare_kernel");
    return MOERT_OK;
}

/* Pipeline warps and stages per NVLink-phase block for rows of row_stride bytes: the most rows in flight within the
 * shared-memory budget, two stages per warp where they fit. False when a row does not fit at all. */
static bool tma_shape(size_t row_stride, int *warps, int *stages)
{
    int p = (int)(TMA_SMEM_BUDGET / (2 * row_stride));
    if (p > MAX_PIPE_WARPS) p = MAX_PIPE_WARPS;
    if (p < 1) p = 1;
    int s = (int)(TMA_SMEM_BUDGET / ((size_t)p * row_stride));
    if (s > MAX_STAGES) s = MAX_STAGES;
    *warps = p;
    *stages = s;
    return s >= 1;
}

/* Threads, stages and shared memory of a TMA NVLink-phase kernel (its limit is set once, in hybridep_cuda_setup). */
static void tma_launch_shape(size_t row_stride, int *threads, int *stages, size_t *smem)
{
    int warps;
    tma_shape(row_stride, &warps, stages);
    *threads = warps * 32;
    *smem = (size_t)warps * *stages * row_stride + (size_t)warps * MAX_STAGES * sizeof(uint64_t);
}

extern "C" moert_result hybridep_cuda_setup(const moert_host *host)
{
    /* the largest any instance of the process needs (E <= 1024; a TMA block within its budget), so an instance never
     * lowers another's limit */
    const cudaFuncAttribute a = cudaFuncAttributeMaxDynamicSharedMemorySize;
    const int prep = (33 * 1024 + 33 * PEER_MAX_RANKS) * (int)sizeof(int32_t);
    const int tma = TMA_SMEM_BUDGET + MAX_PIPE_WARPS * MAX_STAGES * (int)sizeof(uint64_t);
    CUDA_CHECK(host, cudaFuncSetAttribute(prepare_kernel, a, prep));
    CUDA_CHECK(host, cudaFuncSetAttribute(dispatch_send_kernel<int4, true>, a, tma));
    CUDA_CHECK(host, cudaFuncSetAttribute(combine_send_kernel<true>, a, tma));
    return MOERT_OK;
}

/* The kernels of a dispatch-like call with row unit V: low-latency, one kernel; else the NVLink phase (TMA when asked
 * and possible) and the expansion over every SM. */
template <typename V>
static moert_result launch_dispatch(const moert_host *host, cudaStream_t stream, const hybridep_cuda_call *call,
                                    bool tma, const void *x, const float *probs, void *out, float *out_probs,
                                    int64_t units)
{
    if (call->low_latency) {
        if (call->ll_threads == 1024)
            ll_dispatch_kernel<V, 1024><<<call->channels, 1024, 0, stream>>>(*call, x, probs, out, out_probs, units);
        else
            ll_dispatch_kernel<V, LOCAL_THREADS>
                <<<call->channels, LOCAL_THREADS, 0, stream>>>(*call, x, probs, out, out_probs, units);
        LAUNCH_CHECK(host, "hybridep ll_dispatch_kernel");
        return MOERT_OK;
    }
    if (tma) {
        int threads, stages;
        size_t smem;
        tma_launch_shape(call->geo.row_stride, &threads, &stages, &smem);
        dispatch_send_kernel<V, true><<<call->channels, threads, smem, stream>>>(*call, x, probs, units, stages);
    } else {
        dispatch_send_kernel<V, false><<<call->channels, SEND_THREADS, 0, stream>>>(*call, x, probs, units, 0);
    }
    LAUNCH_CHECK(host, tma ? "hybridep dispatch_send_kernel (tma)" : "hybridep dispatch_send_kernel (vector)");
    dispatch_expand_kernel<V>
        <<<call->sms * LOCAL_BLOCKS_PER_SM, LOCAL_THREADS, 0, stream>>>(*call, x, probs, out, out_probs, units);
    LAUNCH_CHECK(host, "hybridep dispatch_expand_kernel");
    return MOERT_OK;
}

extern "C" moert_result hybridep_cuda_dispatch(const moert_host *host, cudaStream_t stream,
                                               const hybridep_cuda_call *call, moert_dtype dtype, const void *x,
                                               const float *probs, void *out, float *out_probs)
{
    const size_t row_bytes = (size_t)call->hidden * moert_dtype_size(dtype);
    int warps, stages;
    if (row_bytes % 16 == 0 && aligned16(x) && aligned16(out)) {
        const bool tma = call->tma && tma_shape(call->geo.row_stride, &warps, &stages);
        return launch_dispatch<int4>(host, stream, call, tma, x, probs, out, out_probs, (int64_t)(row_bytes / 16));
    }
    if (dtype == MOERT_F32)
        return launch_dispatch<uint32_t>(host, stream, call, false, x, probs, out, out_probs, call->hidden);
    return launch_dispatch<unsigned short>(host, stream, call, false, x, probs, out, out_probs, call->hidden);
}

/* The kernels of a combine-like call with element T in packs of N: low-latency, one kernel; else the reduction, the
 * NVLink phase, the final sum. */
template <typename T, int N>
static moert_result launch_combine(const moert_host *host, cudaStream_t stream, const hybridep_cuda_call *call,
                                   const void *rows, const float *row_probs, void *out, bool accumulate,
                                   float *out_probs)
{
    if (call->low_latency) {
        if (call->ll_threads == 1024)
            ll_combine_kernel<T, N, 1024><<<call->channels, 1024, 0, stream>>>(*call, (const T *)rows, row_probs,
                                                                               (T *)out, accumulate, out_probs);
        else
            ll_combine_kernel<T, N, LOCAL_THREADS><<<call->channels, LOCAL_THREADS, 0, stream>>>(
                *call, (const T *)rows, row_probs, (T *)out, accumulate, out_probs);
        LAUNCH_CHECK(host, "hybridep ll_combine_kernel");
        return MOERT_OK;
    }
    const int local_blocks = call->sms * LOCAL_BLOCKS_PER_SM;
    const int64_t units = (int64_t)((call->hidden * (int64_t)sizeof(T) + 15) / 16);
    combine_reduce_kernel<T, N><<<local_blocks, LOCAL_THREADS, 0, stream>>>(*call, (const T *)rows, row_probs);
    LAUNCH_CHECK(host, "hybridep combine_reduce_kernel");
    int warps, stages;
    if (call->tma && tma_shape(call->geo.row_stride, &warps, &stages)) {
        int threads;
        size_t smem;
        tma_launch_shape(call->geo.row_stride, &threads, &stages, &smem);
        combine_send_kernel<true><<<call->channels, threads, smem, stream>>>(*call, row_probs, units, stages);
    } else {
        combine_send_kernel<false><<<call->channels, SEND_THREADS, 0, stream>>>(*call, row_probs, units, 0);
    }
    LAUNCH_CHECK(host, "hybridep combine_send_kernel");
    combine_final_kernel<T, N><<<local_blocks, LOCAL_THREADS, 0, stream>>>(*call, (T *)out, accumulate, out_probs);
    LAUNCH_CHECK(host, "hybridep combine_final_kernel");
    return MOERT_OK;
}

extern "C" moert_result hybridep_cuda_combine(const moert_host *host, cudaStream_t stream,
                                              const hybridep_cuda_call *call, moert_dtype dtype, const void *rows,
                                              const float *row_probs, void *out, bool accumulate, float *out_probs)
{
    const int64_t H = call->hidden;
    const bool vec = aligned16(rows) && aligned16(out);
    if (dtype == MOERT_BF16) {
        if (vec && H % 8 == 0)
            return launch_combine<__nv_bfloat16, 8>(host, stream, call, rows, row_probs, out, accumulate, out_probs);
        return launch_combine<__nv_bfloat16, 1>(host, stream, call, rows, row_probs, out, accumulate, out_probs);
    }
    if (dtype == MOERT_F32) {
        if (vec && H % 4 == 0)
            return launch_combine<float, 4>(host, stream, call, rows, row_probs, out, accumulate, out_probs);
        return launch_combine<float, 1>(host, stream, call, rows, row_probs, out, accumulate, out_probs);
    }
    return report(host, MOERT_ERR_UNSUPPORTED, "hybridep combine on CUDA: rows of dtype %s (bf16 or fp32 only)",
                  moert_dtype_name(dtype));
}
