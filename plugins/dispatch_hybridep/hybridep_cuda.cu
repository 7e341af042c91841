/* CUDA kernels of the "hybridep" dispatcher: fused layout + notify, TMA (or vector) dispatch, combine. */
#include "hybridep_cuda.h"

#include <cuda_bf16.h>
#include <stdint.h>
#include <time.h>

#include "../common/plugin_cuda_check.h"

#define VEC_THREADS 512       /* threads of a vector-copy communication block: 16 warps */
#define PREP_THREADS 1024     /* the prepare kernel: one block, 32 warps */
#define UNROLL 4              /* 16-byte units each lane moves per step of a vector row copy */
#define TMA_SMEM_BUDGET (200 * 1024)
#define MAX_PIPE_WARPS 8
#define MAX_STAGES 4
#define FULL 0xffffffffu

/* ---- memory-order primitives (system scope: peers' memory over NVLink) ---- */

__device__ __forceinline__ int64_t ld_acquire_sys(const int64_t *p)
{
    int64_t v;
    asm volatile("ld.acquire.sys.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void st_release_sys(int64_t *p, int64_t v)
{
    asm volatile("st.release.sys.global.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t now_ns()
{
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

/* ---- TMA bulk copies and mbarriers ---- */

__device__ __forceinline__ uint32_t smem_addr(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(uint64_t *bar)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar)) : "memory");
}

/* Global -> shared, `bytes` (a multiple of 16), completing on the stage's mbarrier (one phase per load). */
__device__ __forceinline__ void tma_load(void *dst_smem, const void *src, uint32_t bytes, uint64_t *bar)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
                 : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     smem_addr(dst_smem)),
                 "l"(src), "r"(bytes), "r"(smem_addr(bar))
                 : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t *bar, uint32_t parity)
{
    uint32_t done = 0;
    while (!done)
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                     : "=r"(done)
                     : "r"(smem_addr(bar)), "r"(parity)
                     : "memory");
}

/* Shared -> global (a peer's buffer over NVLink, or local memory), in the current bulk group. */
__device__ __forceinline__ void tma_store(void *dst, const void *src_smem, uint32_t bytes)
{
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(smem_addr(src_smem)),
                 "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void tma_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
/* The stores issued so far have read their shared memory (the stage can be loaded again). */
__device__ __forceinline__ void tma_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
/* The stores issued so far are complete (written). */
__device__ __forceinline__ void tma_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
__device__ __forceinline__ void fence_proxy_async()
{
    asm volatile("fence.proxy.async.global;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

/* ---- failures and bounded waits ---- */

__device__ __forceinline__ hybridep_header *header(void *buf) { return (hybridep_header *)buf; }

/* Records the first failure of the instance (device word and its pinned host mirror) and raises the abort flag. */
__device__ void record_failure(const hybridep_cuda_call &k, int kind, int peer)
{
    const unsigned long long word =
        ((unsigned long long)k.seq << 16) | ((unsigned long long)kind << 8) | (unsigned)peer;
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
    if (ld_acquire_sys(p) >= target) return true;
    const uint64_t start = now_ns();
    while (ld_acquire_sys(p) < target) {
        if (*(volatile int *)k.abort_flag) return false;
        if (now_ns() - start > (uint64_t)k.timeout_ns) {
            record_failure(k, kind, peer);
            return false;
        }
    }
    return true;
}

/* Before writing into the peers: every rank has stamped, in every channel, that it read what this rank wrote into it
 * in the previous call (seq - 1). False (for every thread) on a failure. */
__device__ bool block_wait_consumed(const hybridep_cuda_call &k)
{
    __shared__ int stalled;
    const int W = k.geo.world, C = k.channels;
    const hybridep_header *h = header(k.local);
    if (threadIdx.x == 0) stalled = *(volatile int *)k.abort_flag;
    __syncthreads();
    if (!stalled)
        for (int i = threadIdx.x; i < W * C; i += blockDim.x)
            if (!wait_geq(&h->consumed[i / C][i % C], k.seq - 1, k, HYBRIDEP_WAIT_CONSUMED, i / C)) {
                stalled = 1;
                break;
            }
    __syncthreads();
    return !stalled;
}

__device__ __forceinline__ char *slot_row(const hybridep_geometry &g, void *buf, int s, int64_t i)
{
    return (char *)buf + g.header_bytes + g.notify_bytes + (size_t)s * g.slot_bytes + (size_t)i * g.row_stride;
}

__device__ __forceinline__ char *slot_meta(const hybridep_geometry &g, void *buf, int s, int64_t i)
{
    return (char *)buf + g.header_bytes + g.notify_bytes + (size_t)s * g.slot_bytes +
           (size_t)g.rows_cap * g.row_stride + (size_t)i * g.meta_stride;
}

__device__ __forceinline__ int64_t *notify_row(const hybridep_geometry &g, void *buf, int s)
{
    return (int64_t *)((char *)buf + g.header_bytes) + (size_t)s * (size_t)(g.num_experts + HYBRIDEP_NOTIFY_EXTRA);
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
    int32_t *cnt = sm, *counts = sm + 32 * E, *tcnt = counts + E, *tokens_to = tcnt + 32 * HYBRIDEP_MAX_RANKS;
    if (*(volatile int *)k.abort_flag) return;
    for (int i = threadIdx.x; i < 32 * E; i += blockDim.x) cnt[i] = 0;
    for (int i = threadIdx.x; i < 32 * HYBRIDEP_MAX_RANKS; i += blockDim.x) tcnt[i] = 0;
    if (threadIdx.x == 0) stalled = bad_total = 0;
    __syncthreads();

    /* pass 1: each warp counts its tokens' copies per expert and its tokens per rank */
    const int64_t tw0 = T * warp / 32, tw1 = T * (warp + 1) / 32;
    int bad = 0;
    for (int64_t c = tw0 * K + lane; c < tw1 * K; c += 32) {
        const int32_t e = idx_in[c];
        k.topk_idx[c] = e;
        if (e >= 0 && e < E) atomicAdd(&cnt[warp * E + e], 1);
        else if (e != -1) bad++;
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
            if (lane == 0) tcnt[warp * HYBRIDEP_MAX_RANKS + d] += __popc(b);
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
            const int v = tcnt[w * HYBRIDEP_MAX_RANKS + d];
            tcnt[w * HYBRIDEP_MAX_RANKS + d] = run;
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
            const int start = tcnt[warp * HYBRIDEP_MAX_RANKS + d];
            if (t < tw1) k.excl[(int64_t)d * (R + 1) + t] = start + __popc(b & lower);
            __syncwarp();
            if (lane == 0) tcnt[warp * HYBRIDEP_MAX_RANKS + d] = start + __popc(b);
            __syncwarp();
        }
    }
    __syncthreads();

    /* notify: wait until every rank has read what this rank wrote in the previous call, write this rank's row into
     * every rank's buffer, publish it; wait for every rank's row */
    const int n = E + HYBRIDEP_NOTIFY_EXTRA;
    for (int i = threadIdx.x; i < W * C && !stalled; i += blockDim.x)
        if (!wait_geq(&header(k.local)->consumed[i / C][i % C], k.seq - 1, k, HYBRIDEP_WAIT_CONSUMED, i / C))
            stalled = 1;
    __syncthreads();
    if (stalled) return;
    for (int i = threadIdx.x; i < W * n; i += blockDim.x) {
        const int d = i / n, j = i % n;
        int64_t v = j < E ? counts[j] : 0;
        if (j == E + HYBRIDEP_NOTIFY_STATUS) v = bad_total;
        if (j == E + HYBRIDEP_NOTIFY_CHANNELS) v = C;
        if (j == E + HYBRIDEP_NOTIFY_TOKENS) v = T;
        *(volatile int64_t *)&notify_row(k.geo, k.peers[d], me)[j] = v;
    }
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x < W) st_release_sys(&header(k.peers[threadIdx.x])->notified[me], k.seq);
    if (threadIdx.x < W)
        if (!wait_geq(&header(k.local)->notified[threadIdx.x], k.seq, k, HYBRIDEP_WAIT_NOTIFY, threadIdx.x))
            stalled = 1;
    __syncthreads();
    if (stalled) return;
    int32_t *all = cnt; /* [W][E] */
    for (int i = threadIdx.x; i < W * E; i += blockDim.x)
        all[i] = (int32_t)__ldcg(&notify_row(k.geo, k.local, i / E)[i % E]);
    if (threadIdx.x < W) {
        const int s = threadIdx.x;
        const int64_t *row = notify_row(k.geo, k.local, s);
        if (__ldcg(&row[E + HYBRIDEP_NOTIFY_STATUS]) != 0) record_failure(k, HYBRIDEP_BAD_IDS, s);
        if (__ldcg(&row[E + HYBRIDEP_NOTIFY_CHANNELS]) != C) record_failure(k, HYBRIDEP_CHANNELS, s);
    }
    __syncthreads();
    /* the plan: rows per local expert, and where this rank's copies to each expert start on its rank */
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        const int d = e / El, l = e % El;
        int64_t start = 0, before = 0;
        for (int l2 = 0; l2 < l; l2++)
            for (int s = 0; s < W; s++) start += all[s * E + d * El + l2];
        for (int s = 0; s < me; s++) before += all[s * E + e];
        k.base[e] = start + before;
    }
    for (int l = threadIdx.x; l < El; l += blockDim.x) {
        int64_t rows = 0;
        for (int s = 0; s < W; s++) rows += all[s * E + me * El + l];
        k.tokens_per_expert[l] = rows;
    }
    __syncthreads();
    /* the rows are read: release them (every channel, as a dispatch-like call's readers do) */
    for (int i = threadIdx.x; i < W * C; i += blockDim.x)
        st_release_sys(&header(k.peers[i / C])->consumed[me][i % C], k.seq);
}

/* ---- dispatch ---- */

/* The copies of token t: lane k < K gets its expert's rank (-1 dropped) and its final row there; returns the set of
 * ranks. */
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

/* Writes token t's metadata (its copies' rows and probs on rank d, -1 elsewhere) into d's slot for this rank. */
__device__ __forceinline__ void write_meta(const hybridep_cuda_call &k, int d, int64_t pos, int lane, int dr, int dst,
                                           float p)
{
    char *meta = slot_meta(k.geo, k.peers[d], k.rank, pos);
    if (lane < (int)k.topk) {
        ((int32_t *)meta)[lane] = dr == d ? dst : -1;
        ((double *)(meta + k.geo.meta_prob_offset))[lane] = dr == d ? (double)p : 0.0;
    }
}

/* The per-warp TMA pipeline state: S stages of row_stride bytes and their mbarriers; g counts the rows loaded. */
struct pipe {
    char *stages;
    uint64_t *bars;
    int S;
    uint32_t bytes, stride, g;
};

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

/* Send half, channel c: this rank's tokens [t0, t1), warp w takes t0 + w, t0 + w + P, ...; each token's row goes once
 * to every rank holding one of its experts (slot row excl[d][t]), with its metadata; then the arrival flags. */
template <typename V, bool TMA>
__device__ void dispatch_send(const hybridep_cuda_call &k, int c, const void *x, const float *probs, int64_t units,
                              pipe &pp)
{
    const int W = k.geo.world, me = k.rank, P = blockDim.x >> 5;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t T = k.tokens, R = k.geo.rows_cap;
    const size_t row_bytes = (size_t)units * sizeof(V);
    const int64_t t0 = T * c / k.channels, t1 = T * (c + 1) / k.channels;
    if (!block_wait_consumed(k)) return;
    const int64_t first = t0 + warp, n = first < t1 ? (t1 - first + P - 1) / P : 0;
    if (TMA && lane == 0)
        for (int64_t i = 0; i < n && i < pp.S - 1; i++) pipe_load(pp, pp.g + (uint32_t)i, (const char *)x + (first + i * P) * row_bytes);
    for (int64_t j = 0; j < n; j++) {
        const int64_t t = first + j * P;
        int dr, dst;
        float p;
        const unsigned ranks = token_copies(k, t, lane, &dr, &dst, &p, probs);
        char *rows[HYBRIDEP_MAX_RANKS];
#pragma unroll
        for (int d = 0; d < HYBRIDEP_MAX_RANKS; d++) {
            rows[d] = nullptr;
            if (d < W && ((ranks >> d) & 1u)) {
                const int64_t pos = k.excl[(int64_t)d * (R + 1) + t];
                rows[d] = slot_row(k.geo, k.peers[d], me, pos);
                write_meta(k, d, pos, lane, dr, dst, p);
            }
        }
        if (TMA) {
            if (lane == 0) {
                if (j + pp.S - 1 < n) {
                    tma_wait_read();
                    pipe_load(pp, pp.g + (uint32_t)(j + pp.S - 1), (const char *)x + (first + (j + pp.S - 1) * P) * row_bytes);
                }
                const char *stage = pipe_wait(pp, pp.g + (uint32_t)j);
#pragma unroll
                for (int d = 0; d < HYBRIDEP_MAX_RANKS; d++)
                    if (rows[d]) tma_store(rows[d], stage, (uint32_t)row_bytes);
                tma_commit();
            }
            __syncwarp();
        } else {
            const V *src = (const V *)x + t * units;
            for (int64_t u0 = 0; u0 < units; u0 += 32 * UNROLL) {
                V v[UNROLL];
#pragma unroll
                for (int q = 0; q < UNROLL; q++) {
                    const int64_t u = u0 + q * 32 + lane;
                    if (u < units) v[q] = __ldg(src + u);
                }
#pragma unroll
                for (int d = 0; d < HYBRIDEP_MAX_RANKS; d++)
                    if (rows[d])
#pragma unroll
                        for (int q = 0; q < UNROLL; q++) {
                            const int64_t u = u0 + q * 32 + lane;
                            if (u < units) ((V *)rows[d])[u] = v[q];
                        }
            }
        }
    }
    if (TMA) {
        if (lane == 0) tma_wait_all();
        pp.g += (uint32_t)n;
        __syncwarp();
        fence_proxy_async();
    }
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x < W) {
        const int d = threadIdx.x;
        hybridep_flag *f = &header(k.peers[d])->arrived[me][c];
        *(volatile int64_t *)&f->begin = k.excl[(int64_t)d * (R + 1) + t0];
        *(volatile int64_t *)&f->end = k.excl[(int64_t)d * (R + 1) + t1];
        __threadfence_system();
        st_release_sys(&f->seq, k.seq);
    }
}

/* Receive half, channel c: from every rank, its channel-c rows in this rank's slot for it; warp w takes rows
 * begin + w, begin + w + P, ...; each row is written into the rows of its copies in out (already grouped by expert)
 * with their probs, the metadata saved for combine; then the release stamps. */
template <typename V, bool TMA>
__device__ void dispatch_recv(const hybridep_cuda_call &k, int c, void *out, float *out_probs, int64_t units, pipe &pp)
{
    const int W = k.geo.world, me = k.rank, K = (int)k.topk, P = blockDim.x >> 5;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t rows_cap = k.geo.rows_cap;
    const size_t row_bytes = (size_t)units * sizeof(V);
    __shared__ int64_t range[2];
    __shared__ int stalled;
    for (int js = 0; js < W; js++) {
        const int s = (me + js) % W;
        if (threadIdx.x == 0) {
            hybridep_flag *f = &header(k.local)->arrived[s][c];
            stalled = !wait_geq(&f->seq, k.seq, k, HYBRIDEP_WAIT_ARRIVAL, s);
            range[0] = *(volatile int64_t *)&f->begin;
            range[1] = *(volatile int64_t *)&f->end;
            if (!stalled) {
                k.recv_range[((int64_t)s * k.channels + c) * 2] = range[0];
                k.recv_range[((int64_t)s * k.channels + c) * 2 + 1] = range[1];
            }
        }
        __syncthreads();
        if (stalled) break;
        if (TMA) fence_proxy_async();
        const int64_t first = range[0] + warp, n = first < range[1] ? (range[1] - first + P - 1) / P : 0;
        if (TMA && lane == 0) {
            tma_wait_read(); /* the stages may still be read by stores of the previous rank's rows */
            for (int64_t i = 0; i < n && i < pp.S - 1; i++)
                pipe_load(pp, pp.g + (uint32_t)i, slot_row(k.geo, k.local, s, first + i * P));
        }
        for (int64_t j = 0; j < n; j++) {
            const int64_t i = first + j * P;
            const char *meta = slot_meta(k.geo, k.local, s, i);
            int32_t dst = -1;
            if (lane < K) {
                dst = __ldcg((const int32_t *)meta + lane);
                k.recv_meta[((int64_t)s * rows_cap + i) * K + lane] = dst;
                if (dst >= 0 && out_probs)
                    out_probs[dst] = (float)__ldcg((const double *)(meta + k.geo.meta_prob_offset) + lane);
            }
            const unsigned copies = __ballot_sync(FULL, dst >= 0);
            if (TMA) {
                int targets[32];
                int nt = 0;
                for (unsigned m = copies; m; m &= m - 1) targets[nt++] = __shfl_sync(FULL, dst, __ffs(m) - 1);
                if (lane == 0) {
                    if (j + pp.S - 1 < n) {
                        tma_wait_read();
                        pipe_load(pp, pp.g + (uint32_t)(j + pp.S - 1), slot_row(k.geo, k.local, s, first + (j + pp.S - 1) * P));
                    }
                    const char *stage = pipe_wait(pp, pp.g + (uint32_t)j);
                    for (int q = 0; q < nt; q++) tma_store((char *)out + (size_t)targets[q] * row_bytes, stage, (uint32_t)row_bytes);
                    tma_commit();
                }
                __syncwarp();
            } else {
                const V *row = (const V *)slot_row(k.geo, k.local, s, i);
                for (int64_t u0 = 0; u0 < units; u0 += 32 * UNROLL) {
                    V v[UNROLL];
#pragma unroll
                    for (int q = 0; q < UNROLL; q++) {
                        const int64_t u = u0 + q * 32 + lane;
                        if (u < units) v[q] = __ldcg(row + u);
                    }
                    for (unsigned m = copies; m; m &= m - 1) {
                        const int r = __shfl_sync(FULL, dst, __ffs(m) - 1);
                        V *o = (V *)((char *)out + (size_t)r * row_bytes);
#pragma unroll
                        for (int q = 0; q < UNROLL; q++) {
                            const int64_t u = u0 + q * 32 + lane;
                            if (u < units) o[u] = v[q];
                        }
                    }
                }
            }
        }
        if (TMA) pp.g += (uint32_t)n;
        __syncthreads(); /* every row of s is read (loaded into shared memory, or into registers) */
        if (threadIdx.x == 0) st_release_sys(&header(k.peers[s])->consumed[me][c], k.seq);
    }
    if (TMA && lane == 0) tma_wait_all();
}

template <typename V, bool TMA>
__global__ void dispatch_kernel(hybridep_cuda_call k, const void *x, const float *probs, void *out, float *out_probs,
                                int64_t units, int stages)
{
    extern __shared__ __align__(128) char stage_mem[];
    if (*(volatile int *)k.abort_flag) return;
    pipe pp;
    pp.S = stages;
    pp.bytes = (uint32_t)(units * sizeof(V));
    pp.stride = (uint32_t)k.geo.row_stride;
    pp.g = 0;
    if (TMA) {
        const int warp = threadIdx.x >> 5, P = blockDim.x >> 5;
        pp.stages = stage_mem + (size_t)warp * stages * pp.stride;
        pp.bars = (uint64_t *)(stage_mem + (size_t)P * stages * pp.stride) + warp * MAX_STAGES;
        if ((threadIdx.x & 31) == 0)
            for (int s = 0; s < stages; s++) mbar_init(pp.bars + s);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        __syncthreads();
    }
    if ((int)blockIdx.x < k.channels) dispatch_send<V, TMA>(k, blockIdx.x, x, probs, units, pp);
    else dispatch_recv<V, TMA>(k, blockIdx.x - k.channels, out, out_probs, units, pp);
}

/* ---- combine ---- */

template <typename T> struct elem;
template <> struct elem<float> {
    static __device__ __forceinline__ float to_f(float v) { return v; }
    static __device__ __forceinline__ float from_f(float v) { return v; }
};
template <> struct elem<__nv_bfloat16> {
    static __device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
    static __device__ __forceinline__ __nv_bfloat16 from_f(float v) { return __float2bfloat16_rn(v); }
};

/* N values of T as one access (16 bytes when N * sizeof(T) == 16). */
template <typename T, int N> struct alignas(sizeof(T) * N) pack {
    T v[N];
};

template <typename T, int N> __device__ __forceinline__ pack<T, N> load_pack(const T *p)
{
    pack<T, N> r;
    if (N * sizeof(T) == 16) {
        int4 raw = __ldcg((const int4 *)p);
        r = *(pack<T, N> *)&raw;
    } else {
#pragma unroll
        for (int j = 0; j < N; j++) r.v[j] = p[j];
    }
    return r;
}

/* One warp: o = (accumulate ? o : -0) + src[0] + ... + src[n-1], in that order in fp32 per element (the CPU's order),
 * rounded to T. Loop bounds are the same on every lane; each lane has two packs per source row in flight. */
template <typename T, int N>
__device__ __forceinline__ void warp_sum_rows(const T *const *src, int n, int64_t packs, T *o, bool accumulate)
{
    const int lane = threadIdx.x & 31;
    for (int64_t q0 = 0; q0 < packs; q0 += 64) {
        const int64_t q[2] = {q0 + lane, q0 + 32 + lane};
        float acc[2][N];
#pragma unroll
        for (int u = 0; u < 2; u++) {
#pragma unroll
            for (int e = 0; e < N; e++) acc[u][e] = -0.0f;
            if (accumulate && q[u] < packs) {
                const pack<T, N> v = load_pack<T, N>(o + q[u] * N);
#pragma unroll
                for (int e = 0; e < N; e++) acc[u][e] = elem<T>::to_f(v.v[e]);
            }
        }
        for (int j = 0; j < n; j++) {
            pack<T, N> v[2];
#pragma unroll
            for (int u = 0; u < 2; u++)
                if (q[u] < packs) v[u] = load_pack<T, N>(src[j] + q[u] * N);
#pragma unroll
            for (int u = 0; u < 2; u++)
                if (q[u] < packs)
#pragma unroll
                    for (int e = 0; e < N; e++) acc[u][e] = __fadd_rn(acc[u][e], elem<T>::to_f(v[u].v[e]));
        }
#pragma unroll
        for (int u = 0; u < 2; u++)
            if (q[u] < packs) {
                pack<T, N> w;
#pragma unroll
                for (int e = 0; e < N; e++) w.v[e] = elem<T>::from_f(acc[u][e]);
                *(pack<T, N> *)(o + q[u] * N) = w;
            }
    }
}

/* Send half of a combine-like call, channel c: for every rank s, the rows received from it in channel c; each row's
 * copies summed (k order) and written back into s's slot for this rank at the same row, prob gradients alongside. */
template <typename T, int N>
__device__ void combine_send(const hybridep_cuda_call &k, int c, const T *rows, const float *row_probs)
{
    __shared__ const T *src[VEC_THREADS / 32][32];
    const int W = k.geo.world, me = k.rank, K = (int)k.topk, P = blockDim.x >> 5;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t H = k.hidden, rows_cap = k.geo.rows_cap, packs = H / N;
    if (!block_wait_consumed(k)) return;
    for (int js = 0; js < W; js++) {
        const int s = (me + 1 + js) % W;
        const int64_t begin = k.recv_range[((int64_t)s * k.channels + c) * 2];
        const int64_t end = k.recv_range[((int64_t)s * k.channels + c) * 2 + 1];
        for (int64_t i = begin + warp; i < end; i += P) {
            const int32_t dst = lane < K ? k.recv_meta[((int64_t)s * rows_cap + i) * K + lane] : -1;
            const unsigned copies = __ballot_sync(FULL, dst >= 0);
            const int n = __popc(copies);
            if (dst >= 0) src[warp][__popc(copies & ((1u << lane) - 1u))] = rows + (int64_t)dst * H;
            char *meta = slot_meta(k.geo, k.peers[s], me, i);
            if (lane < K)
                ((double *)(meta + k.geo.meta_prob_offset))[lane] =
                    (row_probs && dst >= 0) ? (double)row_probs[dst] : 0.0;
            __syncwarp();
            warp_sum_rows<T, N>(src[warp], n, packs, (T *)slot_row(k.geo, k.peers[s], me, i), false);
            __syncwarp();
        }
        __threadfence_system();
        __syncthreads();
        if (threadIdx.x == 0) {
            hybridep_flag *f = &header(k.peers[s])->arrived[me][c];
            *(volatile int64_t *)&f->begin = begin;
            *(volatile int64_t *)&f->end = end;
            __threadfence_system();
            st_release_sys(&f->seq, k.seq);
        }
    }
}

/* Receive half, channel c: this rank's tokens [t0, t1), each the sum in rank order of the partials its expert ranks
 * wrote into this buffer, straight into out[t] (the unpermutation); prob gradients to their (t, k) slots. */
template <typename T, int N>
__device__ void combine_recv(const hybridep_cuda_call &k, int c, T *out, bool accumulate, float *out_probs)
{
    __shared__ const T *src[VEC_THREADS / 32][HYBRIDEP_MAX_RANKS];
    __shared__ int stalled;
    const int W = k.geo.world, me = k.rank, K = (int)k.topk, P = blockDim.x >> 5;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t T_ = k.tokens, H = k.hidden, El = k.local_experts, packs = H / N, R = k.geo.rows_cap;
    const int64_t t0 = T_ * c / k.channels, t1 = T_ * (c + 1) / k.channels;
    if (threadIdx.x == 0) stalled = 0;
    __syncthreads();
    if (threadIdx.x < W)
        if (!wait_geq(&header(k.local)->arrived[threadIdx.x][c].seq, k.seq, k, HYBRIDEP_WAIT_ARRIVAL, threadIdx.x))
            stalled = 1;
    __syncthreads();
    if (stalled) return;
    for (int64_t t = t0 + warp; t < t1; t += P) {
        int64_t pos = -1;
        if (lane < W) {
            const int32_t *ex = k.excl + (int64_t)lane * (R + 1);
            if (ex[t + 1] > ex[t]) pos = ex[t];
        }
        const unsigned ranks = __ballot_sync(FULL, pos >= 0);
        const int n = __popc(ranks);
        if (pos >= 0) src[warp][__popc(ranks & ((1u << lane) - 1u))] = (const T *)slot_row(k.geo, k.local, lane, pos);
        __syncwarp();
        T *o = out + t * H;
        if (n > 0 || !accumulate) warp_sum_rows<T, N>(src[warp], n, packs, o, accumulate);
        if (n == 0 && !accumulate) /* no kept copy: +0, as the CPU path */
            for (int64_t q = lane; q < packs; q += 32) {
                pack<T, N> z;
#pragma unroll
                for (int e = 0; e < N; e++) z.v[e] = elem<T>::from_f(0.0f);
                *(pack<T, N> *)(o + q * N) = z;
            }
        if (out_probs && lane < K) {
            float v = 0.0f;
            if (k.copy_index[t * K + lane] >= 0) {
                const int d = (int)(k.topk_idx[t * K + lane] / El);
                const int64_t p = k.excl[(int64_t)d * (R + 1) + t];
                v = (float)__ldcg((const double *)(slot_meta(k.geo, k.local, d, p) + k.geo.meta_prob_offset) + lane);
            }
            out_probs[t * K + lane] = v;
        }
        __syncwarp();
    }
    __syncthreads();
    if (threadIdx.x < W) st_release_sys(&header(k.peers[threadIdx.x])->consumed[me][c], k.seq);
}

template <typename T, int N>
__global__ void __launch_bounds__(VEC_THREADS) combine_kernel(hybridep_cuda_call k, const T *rows,
                                                              const float *row_probs, T *out, bool accumulate,
                                                              float *out_probs)
{
    if (*(volatile int *)k.abort_flag) return;
    if ((int)blockIdx.x < k.channels) combine_send<T, N>(k, blockIdx.x, rows, row_probs);
    else combine_recv<T, N>(k, blockIdx.x - k.channels, out, accumulate, out_probs);
}

/* ---- host side ---- */

static bool aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

extern "C" moert_result hybridep_cuda_zero(const moert_host *host, void *ptr, size_t bytes)
{
    CUDA_CHECK(host, cudaMemsetAsync(ptr, 0, bytes, 0));
    CUDA_CHECK(host, cudaStreamSynchronize(0));
    return MOERT_OK;
}

extern "C" moert_result hybridep_cuda_mapped(const moert_host *host, void *pinned, void **device_ptr)
{
    CUDA_CHECK(host, cudaHostGetDevicePointer(device_ptr, pinned, 0));
    return MOERT_OK;
}

extern "C" moert_result hybridep_cuda_sm_count(const moert_host *host, int device, int *sms)
{
    CUDA_CHECK(host, cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, device));
    return MOERT_OK;
}

extern "C" int hybridep_cuda_wait_released(void *local, int world, int channels, int64_t seq, int64_t timeout_ms)
{
    int64_t stamps[HYBRIDEP_MAX_RANKS][HYBRIDEP_MAX_CHANNELS];
    const hybridep_header *h = (const hybridep_header *)local;
    struct timespec t0, now;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        int late = -1;
        if (cudaMemcpy(stamps, h->consumed, sizeof stamps, cudaMemcpyDeviceToHost) != cudaSuccess) {
            (void)cudaGetLastError();
            return 0;
        }
        for (int d = 0; d < world && late < 0; d++)
            for (int c = 0; c < channels; c++)
                if (stamps[d][c] < seq) {
                    late = d;
                    break;
                }
        if (late < 0) return -1;
        clock_gettime(CLOCK_MONOTONIC, &now);
        double ms = (double)(now.tv_sec - t0.tv_sec) * 1e3 + (double)(now.tv_nsec - t0.tv_nsec) * 1e-6;
        if (ms > (double)timeout_ms) return late;
        struct timespec pause = {0, 200000};
        nanosleep(&pause, NULL);
    }
}

extern "C" moert_result hybridep_cuda_prepare(const moert_host *host, cudaStream_t stream,
                                              const hybridep_cuda_call *call, const int32_t *topk_idx)
{
    const size_t smem = (size_t)(33 * call->num_experts + 33 * HYBRIDEP_MAX_RANKS) * sizeof(int32_t);
    CUDA_CHECK(host, cudaFuncSetAttribute(prepare_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    prepare_kernel<<<1, PREP_THREADS, smem, stream>>>(*call, topk_idx);
    LAUNCH_CHECK(host, "hybridep prepare_kernel");
    return MOERT_OK;
}

/* Pipeline warps and stages per block for rows of row_stride bytes: the most rows in flight within the shared-memory
 * budget, two stages per warp where they fit. False when a row does not fit at all. */
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

template <typename V, bool TMA>
static moert_result launch_dispatch(const moert_host *host, cudaStream_t stream, const hybridep_cuda_call *call,
                                    const void *x, const float *probs, void *out, float *out_probs, int64_t units)
{
    const int blocks = 2 * call->channels;
    int warps = VEC_THREADS / 32, stages = 0;
    size_t smem = 0;
    if (TMA) {
        tma_shape(call->geo.row_stride, &warps, &stages);
        smem = (size_t)warps * stages * call->geo.row_stride + (size_t)warps * MAX_STAGES * sizeof(uint64_t);
        CUDA_CHECK(host, cudaFuncSetAttribute(dispatch_kernel<V, TMA>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              (int)smem));
    }
    dispatch_kernel<V, TMA><<<blocks, warps * 32, smem, stream>>>(*call, x, probs, out, out_probs, units, stages);
    LAUNCH_CHECK(host, TMA ? "hybridep dispatch_kernel (tma)" : "hybridep dispatch_kernel (vector)");
    return MOERT_OK;
}

extern "C" moert_result hybridep_cuda_dispatch(const moert_host *host, cudaStream_t stream,
                                               const hybridep_cuda_call *call, moert_dtype dtype, const void *x,
                                               const float *probs, void *out, float *out_probs)
{
    const size_t row_bytes = (size_t)call->hidden * moert_dtype_size(dtype);
    int warps, stages;
    const bool vec16 = row_bytes % 16 == 0 && aligned16(x) && aligned16(out);
    if (vec16 && call->tma && tma_shape(call->geo.row_stride, &warps, &stages))
        return launch_dispatch<int4, true>(host, stream, call, x, probs, out, out_probs, (int64_t)(row_bytes / 16));
    if (vec16) return launch_dispatch<int4, false>(host, stream, call, x, probs, out, out_probs, (int64_t)(row_bytes / 16));
    if (dtype == MOERT_F32)
        return launch_dispatch<uint32_t, false>(host, stream, call, x, probs, out, out_probs, call->hidden);
    return launch_dispatch<unsigned short, false>(host, stream, call, x, probs, out, out_probs, call->hidden);
}

extern "C" moert_result hybridep_cuda_combine(const moert_host *host, cudaStream_t stream,
                                              const hybridep_cuda_call *call, moert_dtype dtype, const void *rows,
                                              const float *row_probs, void *out, bool accumulate, float *out_probs)
{
    const int blocks = 2 * call->channels;
    const int64_t H = call->hidden;
    const bool vec = aligned16(rows) && aligned16(out);
    if (dtype == MOERT_BF16) {
        if (vec && H % 8 == 0)
            combine_kernel<__nv_bfloat16, 8><<<blocks, VEC_THREADS, 0, stream>>>(
                *call, (const __nv_bfloat16 *)rows, row_probs, (__nv_bfloat16 *)out, accumulate, out_probs);
        else
            combine_kernel<__nv_bfloat16, 1><<<blocks, VEC_THREADS, 0, stream>>>(
                *call, (const __nv_bfloat16 *)rows, row_probs, (__nv_bfloat16 *)out, accumulate, out_probs);
    } else if (dtype == MOERT_F32) {
        if (vec && H % 4 == 0)
            combine_kernel<float, 4><<<blocks, VEC_THREADS, 0, stream>>>(*call, (const float *)rows, row_probs,
                                                                         (float *)out, accumulate, out_probs);
        else
            combine_kernel<float, 1><<<blocks, VEC_THREADS, 0, stream>>>(*call, (const float *)rows, row_probs,
                                                                         (float *)out, accumulate, out_probs);
    } else {
        return report(host, MOERT_ERR_UNSUPPORTED, "hybridep combine on CUDA: rows of dtype %s (bf16 or fp32 only)",
                      moert_dtype_name(dtype));
    }
    LAUNCH_CHECK(host, "hybridep combine_kernel");
    return MOERT_OK;
}
