/* SPDX-License-Identifier: Apache-2.0 */
/* CUDA kernels of the "deepep" dispatcher: token-rank layout, the NVLink phase of dispatch and combine (every block
 * sends), and the local kernels around it (expansion, reduction, final sum) over every SM. */
#include "deepep_cuda.h"

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "../lib/peer_dispatch.cuh"
#include "../lib/plugin_cuda_check.h"

/* Launch shapes. The NVLink phase's may be set with -D at build time: bench/deepep_tuning.sh builds and times
 * variants. The defaults are that sweep's best on H200 x4 (bench/results/2026-11-22-deepep-tuning-*): the bf16
 * dispatch at 16 warps with 8 units in flight per lane, the FP8 dispatch at 32 warps with one 512-value step. */
#ifndef SEND_THREADS
#define SEND_THREADS 512 /* threads per block of the dispatch's NVLink phase: warps moving one row at a time */
#endif
#ifndef SEND_UNROLL
#define SEND_UNROLL 8 /* 16-byte units each lane has in flight in the dispatch's row copy */
#endif
#ifndef FP8_SEND_THREADS
#define FP8_SEND_THREADS 1024 /* the FP8 dispatch's */
#endif
#ifndef FP8_UNROLL
#define FP8_UNROLL 1 /* 512-value steps each lane has in flight when quantizing (32 bytes each) */
#endif
#ifndef COMBINE_SEND_THREADS
#define COMBINE_SEND_THREADS 1024 /* the combine's NVLink phase */
#endif
#ifndef COMBINE_UNROLL
#define COMBINE_UNROLL 4
#endif
#define LOCAL_THREADS       512 /* threads per block of the local kernels: 16 warps */
#define LOCAL_WARPS         (LOCAL_THREADS / 32)
#define LOCAL_BLOCKS_PER_SM 2
#define SCAN_THREADS        1024 /* the token-rank layout: one block per destination rank */
#define UNROLL              4    /* 16-byte units each lane has in flight in a local row copy */
#define FULL                0xffffffffu

/* A store into a peer's buffer (over NVLink). PEER_STORE_NO_ALLOCATE (a -D tuning knob) adds the L1::no_allocate
 * hint to 16-byte stores. */
template <typename V> __device__ __forceinline__ void store_peer(V *p, const V &v) { *p = v; }
#ifdef PEER_STORE_NO_ALLOCATE
template <> __device__ __forceinline__ void store_peer<int4>(int4 *p, const int4 &v)
{
    asm volatile("st.global.L1::no_allocate.v4.s32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
                 "r"(v.w)
                 : "memory");
}
#endif

/* Records the first stall of the instance and raises its abort flag. */
__device__ void record_stall(const deepep_cuda_call &k, int kind, int peer)
{
    unsigned long long word = ((unsigned long long)k.seq << 16) | ((unsigned long long)kind << 8) | (unsigned)peer;
    atomicCAS(k.error_word, 0ull, word);
    atomicExch(k.abort_flag, 1);
    __threadfence_system();
}

/* Spins until *p >= target, at most the call's timeout; false after a stall (this one or an earlier one). */
__device__ bool wait_geq(const int64_t *p, int64_t target, const deepep_cuda_call &k, int kind, int peer)
{
    return peer_wait_geq(p, target, k, [&] { record_stall(k, kind, peer); });
}

/* Waits, with the whole block, for the flags selected by `arrivals`: this call's arrival of every channel from every
 * other rank (in this rank's header), or, before a send, every rank's stamp for every channel that it read what this
 * rank wrote into it in the previous call (seq - 1). All channels, not only one: the channels of a dispatch-like and
 * a combine-like call split a slot's rows differently, so this call's rows of a channel may overlap rows a peer read
 * in another channel of the previous one. Peers are waited for one after the other from rank + 1 on, so a stall names
 * the first late peer in that order (the same one every run). False (for every thread) on a stall, or when the
 * instance is aborted. */
__device__ bool block_wait(const deepep_cuda_call &k, bool arrivals)
{
    __shared__ int stalled;
    const int W = k.geo.world, C = k.channels;
    peer_header *h = peer_header_at(k.local);
    const uint64_t started = k.wait_stats && blockIdx.x == 0 && threadIdx.x == 0 ? now_ns() : 0;
    if (threadIdx.x == 0) stalled = *(volatile int *)k.abort_flag;
    __syncthreads();
    for (int j = arrivals ? 1 : 0; j < W; j++) {
        const int s = (k.rank + j) % W;
        if (!stalled)
            for (int c = threadIdx.x; c < C; c += blockDim.x) {
                const bool ok = arrivals ? wait_geq(&h->arrived[s][c].seq, k.seq, k, PEER_WAIT_ARRIVAL, s)
                                         : wait_geq(&h->consumed[s][c], k.seq - 1, k, PEER_WAIT_CONSUMED, s);
                if (!ok) {
                    stalled = 1;
                    break;
                }
            }
        __syncthreads();
    }
    if (started) { /* option peer_wait_stats: block 0's wait, per call kind */
        unsigned long long *words = k.wait_stats + DEEPEP_STAT_WORDS * k.call_id;
        atomicAdd(&words[arrivals ? DEEPEP_STAT_ARRIVAL_NS : DEEPEP_STAT_RELEASE_NS],
                  (unsigned long long)(now_ns() - started));
        if (arrivals) atomicAdd(&words[DEEPEP_STAT_CALLS], 1ull);
    }
    return !stalled;
}

/* After an NVLink-phase block's rows are written: publishes this call's arrival of channel blockIdx.x in every other
 * rank's header (release, after a system fence). */
__device__ void block_publish(const deepep_cuda_call &k)
{
    __threadfence_system();
    __syncthreads();
    const int d = threadIdx.x;
    if (d < k.geo.world && d != k.rank) {
        peer_flag *f = &peer_header_at(k.peers[d])->arrived[k.rank][blockIdx.x];
        st_release_sys(&f->seq, k.seq);
    }
}

/* The end of every block of a consuming kernel: the last block to finish stamps, in every rank's header and for every
 * channel, that this rank has read what the rank wrote into it in this call (skipped after a stall). */
__device__ void block_finish(const deepep_cuda_call &k)
{
    __shared__ int last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        const unsigned before = atomicAdd(k.done_blocks, 1u);
        last = before == gridDim.x - 1;
        if (last) atomicExch(k.done_blocks, 0u);
    }
    __syncthreads();
    if (!last || *(volatile int *)k.abort_flag) return;
    __threadfence();
    const int W = k.geo.world, C = k.channels;
    for (int i = threadIdx.x; i < W * C; i += blockDim.x)
        st_release_sys(&peer_header_at(k.peers[i / C])->consumed[k.rank][i % C], k.seq);
}

/* Staging row and metadata entry j of a combine call. */
__device__ __forceinline__ char *staged_row(const deepep_cuda_call &k, int64_t j)
{
    return (char *)k.staging + (size_t)j * k.geo.row_stride;
}

__device__ __forceinline__ char *staged_meta(const deepep_cuda_call &k, int64_t j)
{
    return (char *)k.staging + (size_t)k.staging_rows * k.geo.row_stride + (size_t)j * k.geo.meta_stride;
}

/* Item g of a local kernel's list of received rows (sources in rank order, `skip_self` leaves this rank out):
 * its source rank and row, false past the end. */
__device__ __forceinline__ bool received_item(const deepep_cuda_call &k, int64_t g, bool skip_self, int *s, int64_t *i)
{
    for (int r = 0; r < k.geo.world; r++) {
        if (skip_self && r == k.rank) continue;
        if (g < k.recv_tokens[r]) {
            *s = r;
            *i = g;
            return true;
        }
        g -= k.recv_tokens[r];
    }
    return false;
}

/* The kernel a bench asking for the NVLink phase alone runs after it: waits for the peers' rows, releases them. */
__global__ void __launch_bounds__(LOCAL_THREADS) release_kernel(deepep_cuda_call k)
{
    block_wait(k, true);
    block_finish(k);
}

/* ---- layout: tokens per destination rank ---- */

/* Exclusive prefix sum over the block (one value per thread, thread order); *total gets the sum. */
__device__ int64_t scan_block(int64_t x, int64_t *total)
{
    __shared__ int64_t sums[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    int64_t inc = x;
    for (int o = 1; o < 32; o <<= 1) {
        int64_t y = __shfl_up_sync(FULL, inc, o);
        if (lane >= o) inc += y;
    }
    __syncthreads();
    if (lane == 31) sums[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        int64_t w = lane < warps ? sums[lane] : 0;
        for (int o = 1; o < 32; o <<= 1) {
            int64_t y = __shfl_up_sync(FULL, w, o);
            if (lane >= o) w += y;
        }
        if (lane < warps) sums[lane] = w;
    }
    __syncthreads();
    *total = sums[warps - 1];
    return (warp ? sums[warp - 1] : 0) + inc - x;
}

/* Block d: excl[d][t] for every t, and tokens_to[d]. */
__global__ void token_ranks_kernel(const int32_t *__restrict__ idx, int64_t tokens, int topk, int64_t local_experts,
                                   int64_t num_experts, int32_t *__restrict__ excl, int64_t *__restrict__ tokens_to)
{
    const int d = blockIdx.x;
    int32_t *row = excl + (int64_t)d * (tokens + 1);
    int64_t carry = 0;
    for (int64_t base = 0; base < tokens; base += blockDim.x) {
        const int64_t t = base + threadIdx.x;
        int64_t has = 0;
        if (t < tokens)
            for (int k = 0; k < topk; k++) {
                int32_t e = idx[t * topk + k];
                if (e >= 0 && e < num_experts && e / local_experts == d) has = 1;
            }
        int64_t total;
        const int64_t before = scan_block(has, &total);
        if (t < tokens) row[t] = (int32_t)(carry + before);
        carry += total;
    }
    if (threadIdx.x == 0) {
        row[tokens] = (int32_t)carry;
        tokens_to[d] = carry;
    }
}

/* ---- dispatch ---- */

/* FP8 of 16 bf16 values per lane, 8 lanes a 1x128 block: amax over the block (shuffles: every lane of the warp must
 * call this), scale = 448 / amax (1 when amax is 0 or not finite), q = e4m3(v * scale); returns 1 / scale. The same
 * float operations as peer_fp8_quantize_block() on the CPU. */
__device__ __forceinline__ float quantize16(const int4 raw[2], int4 *q)
{
    const __nv_bfloat16 *b = (const __nv_bfloat16 *)raw;
    float f[16], amax = 0.0f;
#pragma unroll
    for (int j = 0; j < 16; j++) {
        f[j] = __bfloat162float(b[j]);
        amax = fmaxf(amax, fabsf(f[j]));
    }
#pragma unroll
    for (int o = 4; o >= 1; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(FULL, amax, o));
    const float scale = (amax > 0.0f && isfinite(amax)) ? __fdiv_rn(PEER_FP8_MAX, amax) : 1.0f;
    unsigned char *qb = (unsigned char *)q;
#pragma unroll
    for (int j = 0; j < 16; j++)
        qb[j] = (unsigned char)__nv_cvt_float_to_fp8(__fmul_rn(f[j], scale), __NV_SATFINITE, __NV_E4M3);
    return __fdiv_rn(1.0f, scale);
}

/* bf16(float(q) * inv) of 16 E4M3 values into two 16-byte units. */
__device__ __forceinline__ void dequantize16(int4 q, float inv, int4 out[2])
{
    const unsigned char *qb = (const unsigned char *)&q;
    __nv_bfloat16 *ob = (__nv_bfloat16 *)out;
#pragma unroll
    for (int j = 0; j < 16; j++) {
        __half_raw hr = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)qb[j], __NV_E4M3);
        ob[j] = __float2bfloat16_rn(__fmul_rn(__half2float(__half(hr)), inv));
    }
}

/* The NVLink phase of a dispatch-like call, block c: this rank's tokens [T*c/C, T*(c+1)/C), one warp per token, each
 * written once into every other rank holding one of its experts (metadata: its copies' rows there and their probs;
 * the row as it is, or E4M3 with 1x128 scales), then the block's arrival flag in every other rank. */
template <typename V, bool FP8>
__global__ void __launch_bounds__(FP8 ? FP8_SEND_THREADS : SEND_THREADS)
    dispatch_send_kernel(deepep_cuda_call k, const void *x, const float *probs, int64_t units)
{
    const int W = k.geo.world, me = k.rank, K = (int)k.topk, c = blockIdx.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    const int64_t T = k.tokens, H = k.hidden, El = k.local_experts;
    const int64_t t0 = T * c / k.channels, t1 = T * (c + 1) / k.channels;
    if (!block_wait(k, false)) return;
    for (int64_t t = t0 + warp; t < t1; t += warps) {
        const int32_t e = lane < K ? k.topk_idx[t * K + lane] : -1;
        int dr = -1, dst = -1;
        float p = 0.0f;
        if (e >= 0) {
            dr = (int)(e / El);
            dst = (int)(k.base[e] + k.row_of_copy[t * K + lane] - k.expert_offsets[e]);
            if (probs) p = probs[t * K + lane];
        }
        const unsigned ranks = __reduce_or_sync(FULL, (dr >= 0 && dr != me) ? 1u << dr : 0u);
        if (!ranks) continue; /* the same on every lane */
        char *rows[PEER_MAX_RANKS];
#pragma unroll
        for (int d = 0; d < PEER_MAX_RANKS; d++) {
            rows[d] = nullptr;
            if (d < W && ((ranks >> d) & 1u)) {
                const int64_t pos = k.excl[(int64_t)d * (T + 1) + t];
                rows[d] = peer_row(&k.geo, k.peers[d], me, pos);
                char *meta = peer_meta(&k.geo, k.peers[d], me, pos);
                if (lane < K) {
                    ((int32_t *)meta)[lane] = dr == d ? dst : -1;
                    ((double *)(meta + k.geo.meta_prob_offset))[lane] = dr == d ? (double)p : 0.0;
                }
            }
        }
        if (!FP8) {
            const V *src = (const V *)x + t * units;
            for (int64_t u0 = 0; u0 < units; u0 += 32 * SEND_UNROLL) {
                V v[SEND_UNROLL];
#pragma unroll
                for (int j = 0; j < SEND_UNROLL; j++) {
                    const int64_t u = u0 + j * 32 + lane;
                    if (u < units) v[j] = load_ro(src + u);
                }
#pragma unroll
                for (int d = 0; d < PEER_MAX_RANKS; d++)
                    if (rows[d])
#pragma unroll
                        for (int j = 0; j < SEND_UNROLL; j++) {
                            const int64_t u = u0 + j * 32 + lane;
                            if (u < units) store_peer((V *)rows[d] + u, v[j]);
                        }
            }
        } else {
            /* 512 values per step and FP8_UNROLL steps in flight: lane l takes values [16 l, 16 l + 16) of a step */
            const int4 *src = (const int4 *)((const __nv_bfloat16 *)x + t * H);
            for (int64_t e0 = 0; e0 < H; e0 += 512 * FP8_UNROLL) {
                int4 raw[FP8_UNROLL][2];
#pragma unroll
                for (int j = 0; j < FP8_UNROLL; j++) {
                    const int64_t at = e0 + j * 512 + lane * 16;
                    raw[j][0] = raw[j][1] = make_int4(0, 0, 0, 0);
                    if (at < H) {
                        raw[j][0] = load_ro(src + at / 8);
                        raw[j][1] = load_ro(src + at / 8 + 1);
                    }
                }
#pragma unroll
                for (int j = 0; j < FP8_UNROLL; j++) {
                    const int64_t at = e0 + j * 512 + lane * 16;
                    int4 q;
                    const float inv = quantize16(raw[j], &q); /* every lane: shuffles inside */
                    if (at < H)
#pragma unroll
                        for (int d = 0; d < PEER_MAX_RANKS; d++)
                            if (rows[d]) {
                                *(int4 *)(rows[d] + at) = q;
                                if ((lane & 7) == 0) ((float *)(rows[d] + H))[at / PEER_FP8_BLOCK] = inv;
                            }
                }
            }
        }
    }
    block_publish(k);
}

/* Copies one row of `units` V units (src, 16-byte units read through L2 or read-only) into the rows of the copies
 * in `copies` (lane bits; each lane's dst a row of out). Loop bounds the same on every lane. */
template <typename V, bool RO>
__device__ __forceinline__ void expand_row(const V *src, int64_t units, unsigned copies, int32_t dst, void *out,
                                           size_t out_row)
{
    const int lane = threadIdx.x & 31;
    for (int64_t u0 = 0; u0 < units; u0 += 32 * UNROLL) {
        V v[UNROLL];
#pragma unroll
        for (int j = 0; j < UNROLL; j++) {
            const int64_t u = u0 + j * 32 + lane;
            if (u < units) v[j] = RO ? load_ro(src + u) : __ldcg(src + u);
        }
        for (unsigned m = copies; m; m &= m - 1) {
            const int r = __shfl_sync(FULL, dst, __ffs(m) - 1);
            V *o = (V *)((char *)out + (size_t)r * out_row);
#pragma unroll
            for (int j = 0; j < UNROLL; j++) {
                const int64_t u = u0 + j * 32 + lane;
                if (u < units) o[u] = v[j];
            }
        }
    }
}

/* The local half of a dispatch-like call, over every SM: waits for every other rank's rows of this call, then one
 * warp per item: a row in this rank's slot for rank s (its copies' rows and probs from the metadata; FP8 dequantized)
 * or one of this rank's own tokens (its copies computed as the sender does, the row straight from x; FP8 quantized
 * and dequantized in registers). The copies' rows are saved for combine; the last block releases the slots. */
template <typename V, bool FP8>
__global__ void __launch_bounds__(LOCAL_THREADS)
    dispatch_expand_kernel(deepep_cuda_call k, const void *x, const float *probs, void *out, float *out_probs,
                           int64_t units)
{
    const int me = k.rank, K = (int)k.topk;
    const int lane = threadIdx.x & 31;
    const int64_t T = k.tokens, H = k.hidden, El = k.local_experts, rows_cap = k.geo.rows_cap;
    const size_t out_row = FP8 ? (size_t)H * 2 : (size_t)units * sizeof(V);
    if (block_wait(k, true)) {
        const int64_t staged = k.staging_rows; /* rows from other ranks (the combine staging has one per row) */
        const int64_t items = staged + T;
        const int64_t step = (int64_t)gridDim.x * LOCAL_WARPS;
        for (int64_t g = (int64_t)blockIdx.x * LOCAL_WARPS + (threadIdx.x >> 5); g < items; g += step) {
            int s = me;
            int64_t i = 0;
            int32_t dst = -1;
            float p = 0.0f;
            const char *row = nullptr;
            if (g < staged) {
                received_item(k, g, true, &s, &i);
                const char *meta = peer_meta(&k.geo, k.local, s, i);
                if (lane < K) {
                    dst = __ldcg((const int32_t *)meta + lane);
                    if (dst >= 0 && out_probs)
                        p = (float)__ldcg((const double *)(meta + k.geo.meta_prob_offset) + lane);
                }
                row = peer_row(&k.geo, k.local, s, i);
            } else {
                const int64_t t = g - staged;
                const int32_t *ex = k.excl + (int64_t)me * (T + 1);
                i = ex[t];
                if (ex[t + 1] == i) continue; /* no copy of token t here; the same on every lane */
                const int32_t e = lane < K ? k.topk_idx[t * K + lane] : -1;
                if (e >= 0 && e / El == me) {
                    dst = (int32_t)(k.base[e] + k.row_of_copy[t * K + lane] - k.expert_offsets[e]);
                    if (probs) p = probs[t * K + lane];
                }
                row = (const char *)x + (size_t)t * (FP8 ? (size_t)H * 2 : (size_t)units * sizeof(V));
            }
            if (lane < K) {
                k.recv_meta[((int64_t)s * rows_cap + i) * K + lane] = dst;
                if (dst >= 0 && out_probs) out_probs[dst] = p;
            }
            const unsigned copies = __ballot_sync(FULL, dst >= 0);
            if (!FP8) {
                if (s == me)
                    expand_row<V, true>((const V *)row, units, copies, dst, out, out_row);
                else
                    expand_row<V, false>((const V *)row, units, copies, dst, out, out_row);
            } else {
                for (int64_t e0 = 0; e0 < H; e0 += 512) {
                    const int64_t at = e0 + lane * 16;
                    int4 q = make_int4(0, 0, 0, 0), o[2];
                    float inv = 1.0f;
                    if (s == me) {
                        int4 raw[2] = {make_int4(0, 0, 0, 0), make_int4(0, 0, 0, 0)};
                        if (at < H) {
                            raw[0] = load_ro((const int4 *)row + at / 8);
                            raw[1] = load_ro((const int4 *)row + at / 8 + 1);
                        }
                        inv = quantize16(raw, &q); /* every lane: shuffles inside */
                    } else if (at < H) {
                        q = __ldcg((const int4 *)(row + at));
                        inv = __ldcg((const float *)(row + H) + at / PEER_FP8_BLOCK);
                    }
                    dequantize16(q, inv, o);
                    for (unsigned m = copies; m; m &= m - 1) {
                        const int r = __shfl_sync(FULL, dst, __ffs(m) - 1);
                        if (at < H) {
                            int4 *w = (int4 *)((char *)out + (size_t)r * out_row + at * 2);
                            w[0] = o[0];
                            w[1] = o[1];
                        }
                    }
                }
            }
        }
    }
    block_finish(k);
}

template <typename T, int N> __device__ __forceinline__ void store_pack(T *p, const float *acc)
{
    pack<T, N> w;
#pragma unroll
    for (int n = 0; n < N; n++) w.v[n] = elem<T>::from_f(acc[n]);
    *(pack<T, N> *)p = w;
}

/* One warp: o = (accumulate ? o : -0) + src[0] + src[1] + ... + src[n-1] (n >= 1 rows of packs * N values), summed
 * in that order in fp32 per element. Loop bounds are the same on every lane (no divergent shuffles); each lane keeps
 * 2 * SUM_UNROLL packs in flight (two source rows at a time): 4 x 16 bytes for bf16 rows (8 values a pack, more would
 * spill at 128 registers), 8 x 16 bytes for fp32 rows. */
template <typename T, int N>
__device__ __forceinline__ void warp_sum_rows(const T *const *src, int n, int64_t packs, T *o, bool accumulate)
{
    constexpr int SUM_UNROLL = N >= 8 ? 2 : 4;
    const int lane = threadIdx.x & 31;
    for (int64_t q0 = 0; q0 < packs; q0 += 32 * SUM_UNROLL) {
        float acc[SUM_UNROLL][N];
#pragma unroll
        for (int u = 0; u < SUM_UNROLL; u++) {
            const int64_t q = q0 + u * 32 + lane;
            if (accumulate && q < packs) {
                const pack<T, N> v = load_pack<T, N>(o + q * N);
#pragma unroll
                for (int e = 0; e < N; e++) acc[u][e] = elem<T>::to_f(v.v[e]);
            } else {
#pragma unroll
                for (int e = 0; e < N; e++) acc[u][e] = -0.0f;
            }
        }
        int j = 0;
        for (; j + 1 < n; j += 2) {
            const T *a = src[j], *b = src[j + 1];
            pack<T, N> va[SUM_UNROLL], vb[SUM_UNROLL];
#pragma unroll
            for (int u = 0; u < SUM_UNROLL; u++) {
                const int64_t q = q0 + u * 32 + lane;
                if (q < packs) {
                    va[u] = load_pack<T, N>(a + q * N);
                    vb[u] = load_pack<T, N>(b + q * N);
                }
            }
#pragma unroll
            for (int u = 0; u < SUM_UNROLL; u++)
                if (q0 + u * 32 + lane < packs)
#pragma unroll
                    for (int e = 0; e < N; e++) {
                        acc[u][e] = __fadd_rn(acc[u][e], elem<T>::to_f(va[u].v[e]));
                        acc[u][e] = __fadd_rn(acc[u][e], elem<T>::to_f(vb[u].v[e]));
                    }
        }
        if (j < n) {
            const T *a = src[j];
            pack<T, N> va[SUM_UNROLL];
#pragma unroll
            for (int u = 0; u < SUM_UNROLL; u++) {
                const int64_t q = q0 + u * 32 + lane;
                if (q < packs) va[u] = load_pack<T, N>(a + q * N);
            }
#pragma unroll
            for (int u = 0; u < SUM_UNROLL; u++)
                if (q0 + u * 32 + lane < packs)
#pragma unroll
                    for (int e = 0; e < N; e++) acc[u][e] = __fadd_rn(acc[u][e], elem<T>::to_f(va[u].v[e]));
        }
#pragma unroll
        for (int u = 0; u < SUM_UNROLL; u++) {
            const int64_t q = q0 + u * 32 + lane;
            if (q < packs) store_pack<T, N>(o + q * N, acc[u]);
        }
    }
}

/* The first local half of a combine-like call, over every SM: one warp per row received in the last dispatch-like
 * call (every source, this rank's own tokens included): its copies' rows summed in fp32 in k order, rounded to the
 * rows' dtype, into this rank's own slot (own tokens) or the staging area (the NVLink phase sends those), with the
 * copies' prob gradients in the metadata entry when asked. */
template <typename T, int N>
__global__ void __launch_bounds__(LOCAL_THREADS)
    combine_reduce_kernel(deepep_cuda_call k, const T *rows, const float *row_probs)
{
    __shared__ const T *src[LOCAL_WARPS][32];
    if (*(volatile int *)k.abort_flag) return; /* no block-wide barrier below: a per-thread return is fine */
    const int me = k.rank, K = (int)k.topk;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t H = k.hidden, rows_cap = k.geo.rows_cap, packs = H / N;
    int64_t items = 0;
    for (int r = 0; r < k.geo.world; r++) items += k.recv_tokens[r];
    const int64_t step = (int64_t)gridDim.x * LOCAL_WARPS;
    for (int64_t g = (int64_t)blockIdx.x * LOCAL_WARPS + warp; g < items; g += step) {
        int s = 0;
        int64_t i = 0;
        received_item(k, g, false, &s, &i);
        const int32_t dst = lane < K ? k.recv_meta[((int64_t)s * rows_cap + i) * K + lane] : -1;
        const unsigned copies = __ballot_sync(FULL, dst >= 0);
        const int n = __popc(copies);
        if (dst >= 0) src[warp][__popc(copies & ((1u << lane) - 1u))] = rows + (int64_t)dst * H;
        char *o, *meta;
        if (s == me) {
            o = peer_row(&k.geo, k.local, me, i);
            meta = peer_meta(&k.geo, k.local, me, i);
        } else {
            const int64_t j = k.staged_off[s] + i;
            o = staged_row(k, j);
            meta = staged_meta(k, j);
        }
        if (row_probs && lane < K)
            ((double *)(meta + k.geo.meta_prob_offset))[lane] = dst >= 0 ? (double)row_probs[dst] : 0.0;
        __syncwarp();
        if (n > 0) {
            warp_sum_rows<T, N>(src[warp], n, packs, (T *)o, false);
        } else { /* a received row always has a copy here; kept for safety: -0, the empty sum */
            float z[N];
#pragma unroll
            for (int e = 0; e < N; e++) z[e] = -0.0f;
            for (int64_t q = lane; q < packs; q += 32) store_pack<T, N>((T *)o + q * N, z);
        }
        __syncwarp();
    }
}

/* The NVLink phase of a combine-like call, block c: its share of the staged partials, interleaved over the other
 * ranks (item g: row g / (W-1) of the (g % (W-1))-th other rank), one warp per row, each written into the token's
 * rank (this rank's slot there, the row the token had in dispatch), with the prob gradients when asked; then the
 * block's arrival flag in every other rank. Rows move as whole 16-byte units (slots and staging rows are padded). */
__global__ void __launch_bounds__(COMBINE_SEND_THREADS)
    combine_send_kernel(deepep_cuda_call k, int64_t units, bool with_probs)
{
    const int W = k.geo.world, me = k.rank, K = (int)k.topk, c = blockIdx.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    int others[PEER_MAX_RANKS], n_others = 0;
    int64_t longest = 0;
    for (int r = 0; r < W; r++)
        if (r != me) {
            others[n_others++] = r;
            if (k.recv_tokens[r] > longest) longest = k.recv_tokens[r];
        }
    const int64_t items = longest * n_others;
    const int64_t g0 = items * c / k.channels, g1 = items * (c + 1) / k.channels;
    if (!block_wait(k, false)) return;
    for (int64_t g = g0 + warp; g < g1; g += warps) {
        const int s = others[g % n_others];
        const int64_t i = g / n_others;
        if (i >= k.recv_tokens[s]) continue;
        const int64_t j = k.staged_off[s] + i;
        const int4 *from = (const int4 *)staged_row(k, j);
        int4 *to = (int4 *)peer_row(&k.geo, k.peers[s], me, i);
        for (int64_t u0 = 0; u0 < units; u0 += 32 * COMBINE_UNROLL) {
            int4 v[COMBINE_UNROLL];
#pragma unroll
            for (int q = 0; q < COMBINE_UNROLL; q++) {
                const int64_t u = u0 + q * 32 + lane;
                if (u < units) v[q] = load_ro(from + u);
            }
#pragma unroll
            for (int q = 0; q < COMBINE_UNROLL; q++) {
                const int64_t u = u0 + q * 32 + lane;
                if (u < units) store_peer(to + u, v[q]);
            }
        }
        if (with_probs && lane < K) {
            const double *pf = (const double *)(staged_meta(k, j) + k.geo.meta_prob_offset);
            ((double *)(peer_meta(&k.geo, k.peers[s], me, i) + k.geo.meta_prob_offset))[lane] = __ldg(pf + lane);
        }
    }
    block_publish(k);
}

/* The second local half, over every SM: waits for every other rank's partials of this call, then one warp per token of
 * this rank: its partials summed in rank order (fp32, from -0 or from out's value) into out (0 / untouched without a
 * kept copy), prob gradients to their (t, k) slots; the last block releases the slots. */
template <typename T, int N>
__global__ void __launch_bounds__(LOCAL_THREADS)
    combine_final_kernel(deepep_cuda_call k, T *out, bool accumulate, float *out_probs)
{
    __shared__ const T *src[LOCAL_WARPS][PEER_MAX_RANKS];
    const int W = k.geo.world, K = (int)k.topk;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t T_ = k.tokens, H = k.hidden, El = k.local_experts, packs = H / N;
    if (block_wait(k, true)) {
        const int64_t step = (int64_t)gridDim.x * LOCAL_WARPS;
        for (int64_t t = (int64_t)blockIdx.x * LOCAL_WARPS + warp; t < T_; t += step) {
            int64_t pos = -1;
            if (lane < W) {
                const int32_t *ex = k.excl + (int64_t)lane * (T_ + 1);
                if (ex[t + 1] > ex[t]) pos = ex[t];
            }
            const unsigned ranks = __ballot_sync(FULL, pos >= 0);
            const int n = __popc(ranks);
            if (pos >= 0)
                src[warp][__popc(ranks & ((1u << lane) - 1u))] = (const T *)peer_row(&k.geo, k.local, lane, pos);
            __syncwarp();
            T *o = out + t * H;
            if (n > 0) {
                warp_sum_rows<T, N>(src[warp], n, packs, o, accumulate);
            } else if (!accumulate) { /* no kept copy: 0 (+0, as the CPU path) */
                float z[N];
#pragma unroll
                for (int e = 0; e < N; e++) z[e] = 0.0f;
                for (int64_t q = lane; q < packs; q += 32) store_pack<T, N>(o + q * N, z);
            }
            if (out_probs && lane < K) {
                const int32_t e = k.topk_idx[t * K + lane];
                float v = 0.0f;
                if (e >= 0) {
                    const int d = (int)(e / El);
                    const int64_t p = k.excl[(int64_t)d * (T_ + 1) + t];
                    v = (float)__ldcg((const double *)(peer_meta(&k.geo, k.local, d, p) + k.geo.meta_prob_offset) +
                                      lane);
                }
                out_probs[t * K + lane] = v;
            }
            __syncwarp();
        }
    }
    block_finish(k);
}

/* ---- host side ---- */

extern "C" moert_result deepep_cuda_read_stats(const moert_host *host, const unsigned long long *device_words,
                                               unsigned long long *out, int words)
{
    CUDA_CHECK(host, cudaDeviceSynchronize());
    CUDA_CHECK(host, cudaMemcpy(out, device_words, (size_t)words * sizeof *out, cudaMemcpyDeviceToHost));
    return MOERT_OK;
}

static bool aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

extern "C" size_t deepep_cuda_staging_bytes(const peer_geometry *geo, int64_t rows)
{
    return (size_t)(rows < 1 ? 1 : rows) * (geo->row_stride + geo->meta_stride);
}

extern "C" moert_result deepep_cuda_token_ranks(const moert_host *host, cudaStream_t stream, const int32_t *topk_idx,
                                                int64_t tokens, int64_t topk, int64_t local_experts,
                                                int64_t num_experts, int world, int32_t *excl, int64_t *tokens_to)
{
    token_ranks_kernel<<<world, SCAN_THREADS, 0, stream>>>(topk_idx, tokens, (int)topk, local_experts, num_experts,
                                                           excl, tokens_to);
    LAUNCH_CHECK(host, "deepep token_ranks_kernel");
    return MOERT_OK;
}

/* The two kernels of a dispatch-like call with row unit V: the NVLink phase, then the expansion (or, for a bench
 * asking for the NVLink phase alone, the release). */
template <typename V, bool FP8>
static moert_result launch_dispatch(const moert_host *host, cudaStream_t stream, const deepep_cuda_call *call,
                                    const void *x, const float *probs, void *out, float *out_probs, int64_t units)
{
    dispatch_send_kernel<V, FP8>
        <<<call->channels, FP8 ? FP8_SEND_THREADS : SEND_THREADS, 0, stream>>>(*call, x, probs, units);
    LAUNCH_CHECK(host, "deepep dispatch_send_kernel");
    if (call->nvlink_only) {
        release_kernel<<<1, LOCAL_THREADS, 0, stream>>>(*call);
        LAUNCH_CHECK(host, "deepep release_kernel");
        return MOERT_OK;
    }
    dispatch_expand_kernel<V, FP8>
        <<<call->sms * LOCAL_BLOCKS_PER_SM, LOCAL_THREADS, 0, stream>>>(*call, x, probs, out, out_probs, units);
    LAUNCH_CHECK(host, "deepep dispatch_expand_kernel");
    return MOERT_OK;
}

extern "C" moert_result deepep_cuda_dispatch(const moert_host *host, cudaStream_t stream, const deepep_cuda_call *call,
                                             moert_dtype dtype, bool fp8, const void *x, const float *probs, void *out,
                                             float *out_probs)
{
    const size_t row_bytes = (size_t)call->hidden * moert_dtype_size(dtype);
    if (fp8) {
        if (dtype != MOERT_BF16 || call->hidden % PEER_FP8_BLOCK != 0 || !aligned16(x) || !aligned16(out))
            return report(host, MOERT_ERR_UNSUPPORTED,
                          "deepep fp8 dispatch: needs bf16 rows, hidden %% 128 == 0 and "
                          "16-byte aligned tensors (dtype %s, hidden %lld)",
                          moert_dtype_name(dtype), (long long)call->hidden);
        return launch_dispatch<int4, true>(host, stream, call, x, probs, out, out_probs, 0);
    }
    if (row_bytes % 16 == 0 && aligned16(x) && aligned16(out))
        return launch_dispatch<int4, false>(host, stream, call, x, probs, out, out_probs, (int64_t)(row_bytes / 16));
    if (dtype == MOERT_F32)
        return launch_dispatch<unsigned, false>(host, stream, call, x, probs, out, out_probs, call->hidden);
    return launch_dispatch<unsigned short, false>(host, stream, call, x, probs, out, out_probs, call->hidden);
}

/* The three kernels of a combine-like call with element T in packs of N: the reduction, the NVLink phase, the final
 * sum (or, for a bench asking for the NVLink phase alone, only the NVLink phase and the release). */
template <typename T, int N>
static moert_result launch_combine(const moert_host *host, cudaStream_t stream, const deepep_cuda_call *call,
                                   const void *rows, const float *row_probs, void *out, bool accumulate,
                                   float *out_probs)
{
    const int local_blocks = call->sms * LOCAL_BLOCKS_PER_SM;
    const int64_t units = (int64_t)((call->hidden * (int64_t)sizeof(T) + 15) / 16);
    if (!call->nvlink_only) {
        combine_reduce_kernel<T, N><<<local_blocks, LOCAL_THREADS, 0, stream>>>(*call, (const T *)rows, row_probs);
        LAUNCH_CHECK(host, "deepep combine_reduce_kernel");
    }
    combine_send_kernel<<<call->channels, COMBINE_SEND_THREADS, 0, stream>>>(*call, units, row_probs != NULL);
    LAUNCH_CHECK(host, "deepep combine_send_kernel");
    if (call->nvlink_only) {
        release_kernel<<<1, LOCAL_THREADS, 0, stream>>>(*call);
        LAUNCH_CHECK(host, "deepep release_kernel");
        return MOERT_OK;
    }
    combine_final_kernel<T, N><<<local_blocks, LOCAL_THREADS, 0, stream>>>(*call, (T *)out, accumulate, out_probs);
    LAUNCH_CHECK(host, "deepep combine_final_kernel");
    return MOERT_OK;
}

extern "C" moert_result deepep_cuda_combine(const moert_host *host, cudaStream_t stream, const deepep_cuda_call *call,
                                            moert_dtype dtype, const void *rows, const float *row_probs, void *out,
                                            bool accumulate, float *out_probs)
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
    return report(host, MOERT_ERR_UNSUPPORTED, "deepep combine on CUDA: rows of dtype %s (bf16 or fp32 only)",
                  moert_dtype_name(dtype));
}
