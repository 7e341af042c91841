/* CUDA kernels of the "deepep" dispatcher: token-rank layout, fused NVLink send/receive for dispatch and combine. */
#include "deepep_cuda.h"

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>
#include <time.h>

#include "../common/plugin_cuda_check.h"

#define THREADS 512              /* threads per communication block: 16 warps */
#define WARPS (THREADS / 32)
#define SCAN_THREADS 1024        /* the token-rank layout: one block per destination rank */
#define UNROLL 4                 /* 16-byte units each lane moves per step of a row copy */
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

__device__ __forceinline__ deepep_header *header(void *buf) { return (deepep_header *)buf; }

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
    if (ld_acquire_sys(p) >= target) return true;
    const uint64_t start = now_ns();
    while (ld_acquire_sys(p) < target) {
        if (*(volatile int *)k.abort_flag) return false;
        if (now_ns() - start > (uint64_t)k.timeout_ns) {
            record_stall(k, kind, peer);
            return false;
        }
    }
    return true;
}

/* Threads d < world wait for peer d's stamp at stamps[d * stride] >= target; false (for every thread) on a stall. */
__device__ bool block_wait_all(const int64_t *stamps, int stride, int world, int64_t target, const deepep_cuda_call &k,
                               int kind)
{
    __shared__ int stalled;
    if (threadIdx.x == 0) stalled = *(volatile int *)k.abort_flag;
    __syncthreads();
    if (threadIdx.x < world && !stalled)
        if (!wait_geq(stamps + threadIdx.x * stride, target, k, kind, threadIdx.x)) stalled = 1;
    __syncthreads();
    return !stalled;
}

/* Before a send: waits until every rank has stamped, for every channel, that it read what this rank wrote into it in
 * the previous call (seq - 1). All channels, not only this block's: a dispatch-like and a combine-like call split a
 * slot's rows into channels differently (by the sender's tokens, by the receiver's), so this call's rows of channel c
 * may overlap rows a peer read in another channel of the previous call. False (for every thread) on a stall. */
__device__ bool block_wait_consumed(const deepep_cuda_call &k)
{
    __shared__ int stalled;
    const int W = k.geo.world, C = k.channels;
    const deepep_header *h = header(k.local);
    if (threadIdx.x == 0) stalled = *(volatile int *)k.abort_flag;
    __syncthreads();
    if (!stalled)
        for (int i = threadIdx.x; i < W * C; i += blockDim.x)
            if (!wait_geq(&h->consumed[i / C][i % C], k.seq - 1, k, DEEPEP_WAIT_CONSUMED, i / C)) {
                stalled = 1;
                break;
            }
    __syncthreads();
    return !stalled;
}

__device__ __forceinline__ char *slot_row(const deepep_geometry &g, void *buf, int s, int64_t i)
{
    return (char *)buf + g.header_bytes + (size_t)s * g.slot_bytes + (size_t)i * g.row_stride;
}

__device__ __forceinline__ char *slot_meta(const deepep_geometry &g, void *buf, int s, int64_t i)
{
    return (char *)buf + g.header_bytes + (size_t)s * g.slot_bytes + (size_t)g.rows_cap * g.row_stride +
           (size_t)i * g.meta_stride;
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

/* ---- row units ---- */

template <typename V> __device__ __forceinline__ V load_cg(const V *p) { return __ldcg(p); }

/* ---- dispatch ---- */

/* The send half of a dispatch-like call, channel c: this rank's tokens [t0, t1), each written once into every rank
 * holding one of its experts (row, then its copies' rows and probs as metadata), then the arrival flags. */
template <typename V, bool FP8>
__device__ void dispatch_send(const deepep_cuda_call &k, int c, const void *x, const float *probs, int64_t units)
{
    const int W = k.geo.world, me = k.rank, K = (int)k.topk;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t T = k.tokens, H = k.hidden, El = k.local_experts;
    const int64_t t0 = T * c / k.channels, t1 = T * (c + 1) / k.channels;
    if (!block_wait_consumed(k)) return;
    for (int64_t t = t0 + warp; t < t1; t += WARPS) {
        int32_t e = lane < K ? k.topk_idx[t * K + lane] : -1;
        int dr = -1, dst = -1;
        float p = 0.0f;
        if (e >= 0) {
            dr = (int)(e / El);
            dst = (int)(k.base[e] + k.row_of_copy[t * K + lane] - k.expert_offsets[e]);
            if (probs) p = probs[t * K + lane];
        }
        const unsigned ranks = __reduce_or_sync(FULL, dr >= 0 ? 1u << dr : 0u);
        char *rows[DEEPEP_MAX_RANKS];
#pragma unroll
        for (int d = 0; d < DEEPEP_MAX_RANKS; d++) {
            rows[d] = nullptr;
            if (d < W && ((ranks >> d) & 1u)) {
                const int64_t pos = k.excl[(int64_t)d * (T + 1) + t];
                rows[d] = slot_row(k.geo, k.peers[d], me, pos);
                char *meta = slot_meta(k.geo, k.peers[d], me, pos);
                if (lane < K) {
                    ((int32_t *)meta)[lane] = dr == d ? dst : -1;
                    ((double *)(meta + k.geo.meta_prob_offset))[lane] = dr == d ? (double)p : 0.0;
                }
            }
        }
        if (!FP8) {
            const V *src = (const V *)x + t * units;
            for (int64_t u0 = 0; u0 < units; u0 += 32 * UNROLL) {
                V v[UNROLL];
#pragma unroll
                for (int j = 0; j < UNROLL; j++) {
                    const int64_t u = u0 + j * 32 + lane;
                    if (u < units) v[j] = __ldg(src + u);
                }
#pragma unroll
                for (int d = 0; d < DEEPEP_MAX_RANKS; d++)
                    if (rows[d])
#pragma unroll
                        for (int j = 0; j < UNROLL; j++) {
                            const int64_t u = u0 + j * 32 + lane;
                            if (u < units) ((V *)rows[d])[u] = v[j];
                        }
            }
        } else {
            /* 256 values per step: lanes 0-15 one 1x128 block, lanes 16-31 the next; 8 values per lane */
            const __nv_bfloat16 *src = (const __nv_bfloat16 *)x + t * H;
            for (int64_t e0 = 0; e0 < H; e0 += 256) {
                const int64_t at = e0 + lane * 8;
                const bool valid = at < H;
                int4 raw = make_int4(0, 0, 0, 0);
                if (valid) raw = __ldg((const int4 *)(src + at));
                const __nv_bfloat16 *b = (const __nv_bfloat16 *)&raw;
                float f[8], amax = 0.0f;
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    f[j] = __bfloat162float(b[j]);
                    amax = fmaxf(amax, fabsf(f[j]));
                }
#pragma unroll
                for (int o = 8; o >= 1; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(FULL, amax, o));
                const float scale = (amax > 0.0f && isfinite(amax)) ? __fdiv_rn(DEEPEP_FP8_MAX, amax) : 1.0f;
                const float inv = __fdiv_rn(1.0f, scale);
                uint2 q;
                unsigned char *qb = (unsigned char *)&q;
#pragma unroll
                for (int j = 0; j < 8; j++)
                    qb[j] = (unsigned char)__nv_cvt_float_to_fp8(__fmul_rn(f[j], scale), __NV_SATFINITE, __NV_E4M3);
                if (valid) {
#pragma unroll
                    for (int d = 0; d < DEEPEP_MAX_RANKS; d++)
                        if (rows[d]) {
                            *(uint2 *)(rows[d] + at) = q;
                            if ((lane & 15) == 0) ((float *)(rows[d] + H))[at / DEEPEP_FP8_BLOCK] = inv;
                        }
                }
            }
        }
    }
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x < W) {
        const int d = threadIdx.x;
        deepep_flag *f = &header(k.peers[d])->arrived[me][c];
        *(volatile int64_t *)&f->begin = k.excl[(int64_t)d * (T + 1) + t0];
        *(volatile int64_t *)&f->end = k.excl[(int64_t)d * (T + 1) + t1];
        __threadfence_system();
        st_release_sys(&f->seq, k.seq);
    }
}

/* The receive half, channel c: from every rank, its channel-c rows in this rank's slot for it, each expanded into
 * the rows of its copies (out) with their probs, the metadata saved for combine; then the release stamps. */
template <typename V, bool FP8>
__device__ void dispatch_recv(const deepep_cuda_call &k, int c, void *out, float *out_probs, int64_t units)
{
    const int W = k.geo.world, me = k.rank, K = (int)k.topk;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t H = k.hidden, rows_cap = k.geo.rows_cap;
    const size_t out_row = FP8 ? (size_t)H * 2 : (size_t)units * sizeof(V);
    __shared__ int64_t range[2];
    __shared__ int stalled;
    for (int j = 0; j < W; j++) {
        const int s = (me + j) % W;
        if (threadIdx.x == 0) {
            deepep_flag *f = &header(k.local)->arrived[s][c];
            stalled = !wait_geq(&f->seq, k.seq, k, DEEPEP_WAIT_ARRIVAL, s);
            range[0] = *(volatile int64_t *)&f->begin;
            range[1] = *(volatile int64_t *)&f->end;
            if (!stalled) {
                k.recv_range[((int64_t)s * k.channels + c) * 2] = range[0];
                k.recv_range[((int64_t)s * k.channels + c) * 2 + 1] = range[1];
            }
        }
        __syncthreads();
        if (stalled) return;
        for (int64_t i = range[0] + warp; i < range[1]; i += WARPS) {
            const char *meta = slot_meta(k.geo, k.local, s, i);
            int32_t dst = -1;
            if (lane < K) {
                dst = __ldcg((const int32_t *)meta + lane);
                k.recv_meta[((int64_t)s * rows_cap + i) * K + lane] = dst;
                if (dst >= 0 && out_probs) out_probs[dst] = (float)__ldcg((const double *)(meta + k.geo.meta_prob_offset) + lane);
            }
            const unsigned copies = __ballot_sync(FULL, dst >= 0);
            const char *row = slot_row(k.geo, k.local, s, i);
            if (!FP8) {
                for (int64_t u0 = 0; u0 < units; u0 += 32 * UNROLL) {
                    V v[UNROLL];
#pragma unroll
                    for (int j2 = 0; j2 < UNROLL; j2++) {
                        const int64_t u = u0 + j2 * 32 + lane;
                        if (u < units) v[j2] = load_cg((const V *)row + u);
                    }
                    for (unsigned m = copies; m; m &= m - 1) {
                        const int r = __shfl_sync(FULL, dst, __ffs(m) - 1);
                        V *o = (V *)((char *)out + (size_t)r * out_row);
#pragma unroll
                        for (int j2 = 0; j2 < UNROLL; j2++) {
                            const int64_t u = u0 + j2 * 32 + lane;
                            if (u < units) o[u] = v[j2];
                        }
                    }
                }
            } else {
                for (int64_t e0 = 0; e0 < H; e0 += 256) {
                    const int64_t at = e0 + lane * 8;
                    const bool valid = at < H;
                    int4 outv = make_int4(0, 0, 0, 0);
                    if (valid) {
                        const uint2 q = __ldcg((const uint2 *)(row + at));
                        const float inv = __ldcg((const float *)(row + H) + at / DEEPEP_FP8_BLOCK);
                        const unsigned char *qb = (const unsigned char *)&q;
                        __nv_bfloat16 *ob = (__nv_bfloat16 *)&outv;
#pragma unroll
                        for (int j2 = 0; j2 < 8; j2++) {
                            __half_raw hr = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)qb[j2], __NV_E4M3);
                            ob[j2] = __float2bfloat16_rn(__fmul_rn(__half2float(__half(hr)), inv));
                        }
                    }
                    for (unsigned m = copies; m; m &= m - 1) {
                        const int r = __shfl_sync(FULL, dst, __ffs(m) - 1);
                        if (valid) *(int4 *)((char *)out + (size_t)r * out_row + at * 2) = outv;
                    }
                }
            }
        }
        __syncthreads();
        if (threadIdx.x == 0) st_release_sys(&header(k.peers[s])->consumed[me][c], k.seq);
    }
}

template <typename V, bool FP8>
__global__ void __launch_bounds__(THREADS) dispatch_kernel(deepep_cuda_call k, const void *x, const float *probs,
                                                           void *out, float *out_probs, int64_t units)
{
    if (*(volatile int *)k.abort_flag) return;
    if ((int)blockIdx.x < k.channels) dispatch_send<V, FP8>(k, blockIdx.x, x, probs, units);
    else dispatch_recv<V, FP8>(k, blockIdx.x - k.channels, out, out_probs, units);
}

/* ---- combine ---- */

template <typename T> struct elem;
template <> struct elem<float> {
    static __device__ __forceinline__ float load(const float *p) { return __ldcg(p); }
    static __device__ __forceinline__ float to_f(float v) { return v; }
    static __device__ __forceinline__ float from_f(float v) { return v; }
};
template <> struct elem<__nv_bfloat16> {
    static __device__ __forceinline__ __nv_bfloat16 load(const __nv_bfloat16 *p)
    {
        __nv_bfloat16_raw r;
        r.x = __ldcg((const unsigned short *)p);
        return __nv_bfloat16(r);
    }
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
        for (int j = 0; j < N; j++) r.v[j] = elem<T>::load(p + j);
    }
    return r;
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

/* The send half of a combine-like call, channel c: for every rank s, the rows received from it in channel c; each
 * row's copies summed in fp32 (k order) and written back into s's slot for this rank, prob gradients alongside.
 * One warp per row; the copies' rows go through a per-warp list in shared memory (no shuffles inside the row loop). */
template <typename T, int N>
__device__ void combine_send(const deepep_cuda_call &k, int c, const T *rows, const float *row_probs)
{
    __shared__ const T *src[WARPS][32];
    const int W = k.geo.world, me = k.rank, K = (int)k.topk;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t H = k.hidden, rows_cap = k.geo.rows_cap, packs = H / N;
    if (!block_wait_consumed(k)) return;
    for (int j = 0; j < W; j++) {
        const int s = (me + 1 + j) % W;
        const int64_t begin = k.recv_range[((int64_t)s * k.channels + c) * 2];
        const int64_t end = k.recv_range[((int64_t)s * k.channels + c) * 2 + 1];
        for (int64_t i = begin + warp; i < end; i += WARPS) {
            const int32_t dst = lane < K ? k.recv_meta[((int64_t)s * rows_cap + i) * K + lane] : -1;
            const unsigned copies = __ballot_sync(FULL, dst >= 0);
            const int n = __popc(copies);
            if (dst >= 0) src[warp][__popc(copies & ((1u << lane) - 1u))] = rows + (int64_t)dst * H;
            char *meta = slot_meta(k.geo, k.peers[s], me, i);
            if (lane < K)
                ((double *)(meta + k.geo.meta_prob_offset))[lane] =
                    (row_probs && dst >= 0) ? (double)row_probs[dst] : 0.0;
            __syncwarp();
            T *o = (T *)slot_row(k.geo, k.peers[s], me, i);
            if (n > 0) {
                warp_sum_rows<T, N>(src[warp], n, packs, o, false);
            } else { /* a received row always has a copy here; kept for safety: -0, the empty sum */
                float z[N];
#pragma unroll
                for (int e = 0; e < N; e++) z[e] = -0.0f;
                for (int64_t q = lane; q < packs; q += 32) store_pack<T, N>(o + q * N, z);
            }
            __syncwarp();
        }
        __threadfence_system();
        __syncthreads();
        if (threadIdx.x == 0) {
            deepep_flag *f = &header(k.peers[s])->arrived[me][c];
            *(volatile int64_t *)&f->begin = begin;
            *(volatile int64_t *)&f->end = end;
            __threadfence_system();
            st_release_sys(&f->seq, k.seq);
        }
    }
}

/* The receive half, channel c: this rank's tokens [t0, t1), each the sum in rank order of the partials its expert
 * ranks wrote into this buffer (fp32), into out; prob gradients to their (t, k) slots; then the release stamps. */
template <typename T, int N>
__device__ void combine_recv(const deepep_cuda_call &k, int c, T *out, bool accumulate, float *out_probs)
{
    __shared__ const T *src[WARPS][DEEPEP_MAX_RANKS];
    const int W = k.geo.world, me = k.rank, K = (int)k.topk;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t T_ = k.tokens, H = k.hidden, El = k.local_experts, packs = H / N;
    const int64_t t0 = T_ * c / k.channels, t1 = T_ * (c + 1) / k.channels;
    if (!block_wait_all(&header(k.local)->arrived[0][c].seq, DEEPEP_MAX_CHANNELS * 4, W, k.seq, k,
                        DEEPEP_WAIT_ARRIVAL))
        return;
    for (int64_t t = t0 + warp; t < t1; t += WARPS) {
        int64_t pos = -1;
        if (lane < W) {
            const int32_t *ex = k.excl + (int64_t)lane * (T_ + 1);
            if (ex[t + 1] > ex[t]) pos = ex[t];
        }
        const unsigned ranks = __ballot_sync(FULL, pos >= 0);
        const int n = __popc(ranks);
        if (pos >= 0) src[warp][__popc(ranks & ((1u << lane) - 1u))] = (const T *)slot_row(k.geo, k.local, lane, pos);
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
__global__ void __launch_bounds__(THREADS) combine_kernel(deepep_cuda_call k, const T *rows, const float *row_probs,
                                                          T *out, bool accumulate, float *out_probs)
{
    if (*(volatile int *)k.abort_flag) return;
    if ((int)blockIdx.x < k.channels) combine_send<T, N>(k, blockIdx.x, rows, row_probs);
    else combine_recv<T, N>(k, blockIdx.x - k.channels, out, accumulate, out_probs);
}

/* ---- host side ---- */

static bool aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

extern "C" moert_result deepep_cuda_zero(const moert_host *host, void *ptr, size_t bytes)
{
    CUDA_CHECK(host, cudaMemsetAsync(ptr, 0, bytes, 0));
    CUDA_CHECK(host, cudaStreamSynchronize(0));
    return MOERT_OK;
}

extern "C" int deepep_cuda_wait_released(void *local, int world, int channels, int64_t seq, int64_t timeout_ms)
{
    int64_t stamps[DEEPEP_MAX_RANKS][DEEPEP_MAX_CHANNELS];
    const deepep_header *h = (const deepep_header *)local;
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

extern "C" moert_result deepep_cuda_token_ranks(const moert_host *host, cudaStream_t stream, const int32_t *topk_idx,
                                                int64_t tokens, int64_t topk, int64_t local_experts,
                                                int64_t num_experts, int world, int32_t *excl, int64_t *tokens_to)
{
    token_ranks_kernel<<<world, SCAN_THREADS, 0, stream>>>(topk_idx, tokens, (int)topk, local_experts, num_experts,
                                                           excl, tokens_to);
    LAUNCH_CHECK(host, "deepep token_ranks_kernel");
    return MOERT_OK;
}

extern "C" moert_result deepep_cuda_dispatch(const moert_host *host, cudaStream_t stream, const deepep_cuda_call *call,
                                             moert_dtype dtype, bool fp8, const void *x, const float *probs, void *out,
                                             float *out_probs)
{
    const int blocks = 2 * call->channels;
    const size_t row_bytes = (size_t)call->hidden * moert_dtype_size(dtype);
    if (fp8) {
        if (dtype != MOERT_BF16 || call->hidden % DEEPEP_FP8_BLOCK != 0 || !aligned16(x) || !aligned16(out))
            return report(host, MOERT_ERR_UNSUPPORTED, "deepep fp8 dispatch: needs bf16 rows, hidden %% 128 == 0 and "
                          "16-byte aligned tensors (dtype %s, hidden %lld)", moert_dtype_name(dtype),
                          (long long)call->hidden);
        dispatch_kernel<int4, true><<<blocks, THREADS, 0, stream>>>(*call, x, probs, out, out_probs, 0);
    } else if (row_bytes % 16 == 0 && aligned16(x) && aligned16(out)) {
        dispatch_kernel<int4, false><<<blocks, THREADS, 0, stream>>>(*call, x, probs, out, out_probs,
                                                                     (int64_t)(row_bytes / 16));
    } else if (dtype == MOERT_F32) {
        dispatch_kernel<uint32_t, false><<<blocks, THREADS, 0, stream>>>(*call, x, probs, out, out_probs,
                                                                         call->hidden);
    } else {
        dispatch_kernel<unsigned short, false><<<blocks, THREADS, 0, stream>>>(*call, x, probs, out, out_probs,
                                                                               call->hidden);
    }
    LAUNCH_CHECK(host, "deepep dispatch_kernel");
    return MOERT_OK;
}

extern "C" moert_result deepep_cuda_combine(const moert_host *host, cudaStream_t stream, const deepep_cuda_call *call,
                                            moert_dtype dtype, const void *rows, const float *row_probs, void *out,
                                            bool accumulate, float *out_probs)
{
    const int blocks = 2 * call->channels;
    const int64_t H = call->hidden;
    const bool vec = aligned16(rows) && aligned16(out);
    if (dtype == MOERT_BF16) {
        if (vec && H % 8 == 0)
            combine_kernel<__nv_bfloat16, 8><<<blocks, THREADS, 0, stream>>>(
                *call, (const __nv_bfloat16 *)rows, row_probs, (__nv_bfloat16 *)out, accumulate, out_probs);
        else
            combine_kernel<__nv_bfloat16, 1><<<blocks, THREADS, 0, stream>>>(
                *call, (const __nv_bfloat16 *)rows, row_probs, (__nv_bfloat16 *)out, accumulate, out_probs);
    } else if (dtype == MOERT_F32) {
        if (vec && H % 4 == 0)
            combine_kernel<float, 4><<<blocks, THREADS, 0, stream>>>(*call, (const float *)rows, row_probs,
                                                                     (float *)out, accumulate, out_probs);
        else
            combine_kernel<float, 1><<<blocks, THREADS, 0, stream>>>(*call, (const float *)rows, row_probs,
                                                                     (float *)out, accumulate, out_probs);
    } else {
        return report(host, MOERT_ERR_UNSUPPORTED, "deepep combine on CUDA: rows of dtype %s (bf16 or fp32 only)",
                      moert_dtype_name(dtype));
    }
    LAUNCH_CHECK(host, "deepep combine_kernel");
    return MOERT_OK;
}
