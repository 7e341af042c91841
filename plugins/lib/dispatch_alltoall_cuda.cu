/* SPDX-License-Identifier: Apache-2.0 */
/* CUDA kernels of the all-to-all dispatcher: layout, permutation, row gathers, combine, regroup maps. */
#include "dispatch_alltoall_cuda.h"

#include <cuda_bf16.h>
#include <stdarg.h>
#include <stdio.h>

#define LAYOUT_WARPS    8 /* warps per block in the layout kernels; each warp owns 32 tokens */
#define TOKENS_PER_WARP 32
#define ROW_WARPS       8 /* warps per block in the row kernels: one warp per row */
#define MAX_GRID_BLOCKS 8192

#include "plugin_cuda_check.h"

template <typename T, int N> struct alignas(sizeof(T) * N) vec_t {
    T v[N];
};

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

static bool aligned(const void *p, size_t bytes) { return ((uintptr_t)p % bytes) == 0; }

static size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

/* Exclusive prefix sum over the block of one value per thread, in thread order; *total gets the sum. */
__device__ int64_t block_exclusive_scan(int64_t x, int64_t *total)
{
    __shared__ int64_t warp_sums[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    int64_t inclusive = x;
    for (int o = 1; o < 32; o <<= 1) {
        int64_t y = __shfl_up_sync(0xffffffffu, inclusive, o);
        if (lane >= o) inclusive += y;
    }
    __syncthreads(); /* warp_sums may still be read from a previous call */
    if (lane == 31) warp_sums[warp] = inclusive;
    __syncthreads();
    if (warp == 0) {
        int64_t w = lane < warps ? warp_sums[lane] : 0;
        for (int o = 1; o < 32; o <<= 1) {
            int64_t y = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += y;
        }
        if (lane < warps) warp_sums[lane] = w; /* inclusive over warps */
    }
    __syncthreads();
    const int64_t warp_base = warp > 0 ? warp_sums[warp - 1] : 0;
    *total = warp_sums[warps - 1];
    return warp_base + inclusive - x;
}

/* ---- layout ---- */

/* Copies of each warp's 32 tokens per expert, into warp_counts[global warp][E]; flags ids outside [-1, E). */
__global__ void layout_count_kernel(const int32_t *__restrict__ idx, int64_t tokens, int topk, int num_experts,
                                    int64_t num_warps, int32_t *__restrict__ warp_counts,
                                    unsigned long long *__restrict__ bad_ids)
{
    extern __shared__ int32_t counts[]; /* [LAYOUT_WARPS][E] */
    for (int i = threadIdx.x; i < LAYOUT_WARPS * num_experts; i += blockDim.x) counts[i] = 0;
    __syncthreads();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t gw = (int64_t)blockIdx.x * LAYOUT_WARPS + warp;
    if (gw < num_warps) {
        const int64_t t0 = gw * TOKENS_PER_WARP;
        const int64_t t1 = t0 + TOKENS_PER_WARP < tokens ? t0 + TOKENS_PER_WARP : tokens;
        for (int64_t c = t0 * topk + lane; c < t1 * topk; c += 32) {
            int32_t e = idx[c];
            if (e >= 0 && e < num_experts)
                atomicAdd(&counts[warp * num_experts + e], 1);
            else if (e != -1)
                atomicAdd(bad_ids, 1ull);
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < LAYOUT_WARPS * num_experts; i += blockDim.x) {
        int64_t g = (int64_t)blockIdx.x * LAYOUT_WARPS + i / num_experts;
        if (g < num_warps) warp_counts[g * num_experts + i % num_experts] = counts[i];
    }
}

/* One block per expert: exclusive scan of its per-warp counts over warps (in place); totals[e] = the sum. */
__global__ void layout_scan_warps_kernel(int64_t num_warps, int num_experts, int32_t *__restrict__ warp_counts,
                                         int64_t *__restrict__ totals)
{
    const int e = blockIdx.x;
    int64_t carry = 0;
    for (int64_t base = 0; base < num_warps; base += blockDim.x) {
        const int64_t g = base + threadIdx.x;
        const int64_t v = g < num_warps ? warp_counts[g * num_experts + e] : 0;
        int64_t tile_total;
        const int64_t prefix = block_exclusive_scan(v, &tile_total);
        if (g < num_warps) warp_counts[g * num_experts + e] = (int32_t)(carry + prefix);
        carry += tile_total;
    }
    if (threadIdx.x == 0) totals[e] = carry;
}

/* One block: tokens_per_expert = totals, expert_offsets = their exclusive prefix sum (E+1 entries). */
__global__ void layout_scan_experts_kernel(int num_experts, const int64_t *__restrict__ totals,
                                           int64_t *__restrict__ tokens_per_expert, int64_t *__restrict__ offsets)
{
    int64_t carry = 0;
    for (int base = 0; base < num_experts; base += blockDim.x) {
        const int e = base + threadIdx.x;
        const int64_t v = e < num_experts ? totals[e] : 0;
        int64_t tile_total;
        const int64_t prefix = block_exclusive_scan(v, &tile_total);
        if (e < num_experts) {
            tokens_per_expert[e] = v;
            offsets[e] = carry + prefix;
        }
        carry += tile_total;
    }
    if (threadIdx.x == 0) offsets[num_experts] = carry;
}

/* Each warp walks its copies in order, 32 at a time, and gives each kept copy its send row. */
__global__ void layout_place_kernel(const int32_t *__restrict__ idx, int64_t tokens, int topk, int num_experts,
                                    int64_t num_warps, const int32_t *__restrict__ warp_prefix,
                                    const int64_t *__restrict__ expert_offsets, int32_t *__restrict__ row_of_copy,
                                    int32_t *__restrict__ copy_of_row)
{
    extern __shared__ int32_t next_row[]; /* [LAYOUT_WARPS][E]: the next free send row per expert, per warp */
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int i = threadIdx.x; i < LAYOUT_WARPS * num_experts; i += blockDim.x) {
        int64_t g = (int64_t)blockIdx.x * LAYOUT_WARPS + i / num_experts;
        int e = i % num_experts;
        next_row[i] = g < num_warps ? (int32_t)(expert_offsets[e] + warp_prefix[g * num_experts + e]) : 0;
    }
    __syncthreads();
    const int64_t gw = (int64_t)blockIdx.x * LAYOUT_WARPS + warp;
    if (gw >= num_warps) return;
    int32_t *mine = next_row + warp * num_experts;
    const int64_t t0 = gw * TOKENS_PER_WARP;
    const int64_t t1 = t0 + TOKENS_PER_WARP < tokens ? t0 + TOKENS_PER_WARP : tokens;
    const unsigned lanes_below = (1u << lane) - 1u;
    for (int64_t base = t0 * topk; base < t1 * topk; base += 32) {
        const int64_t c = base + lane;
        const bool valid = c < t1 * topk;
        int32_t e = valid ? idx[c] : -1;
        const bool kept = e >= 0 && e < num_experts;
        if (!kept) e = -1;
        const unsigned peers = __match_any_sync(0xffffffffu, e);
        const int rank = __popc(peers & lanes_below);
        if (kept) {
            const int32_t row = mine[e] + rank;
            row_of_copy[c] = row;
            copy_of_row[row] = (int32_t)c;
        } else if (valid) {
            row_of_copy[c] = -1;
        }
        __syncwarp();
        if (kept && rank == 0) mine[e] += __popc(peers);
        __syncwarp();
    }
}

extern "C" size_t moert_a2a_cuda_layout_scratch_bytes(int64_t tokens, int64_t num_experts)
{
    const int64_t num_warps = (tokens + TOKENS_PER_WARP - 1) / TOKENS_PER_WARP;
    return round_up((size_t)(num_warps * num_experts) * sizeof(int32_t), 256) +
           round_up((size_t)num_experts * sizeof(int64_t), 256) + 256;
}

/* Where the layout's bad-id counter sits in its scratch (after the per-warp counts and the totals). */
extern "C" const unsigned long long *moert_a2a_cuda_layout_bad_ids(const void *scratch, int64_t tokens,
                                                                   int64_t num_experts)
{
    const int64_t num_warps = (tokens + TOKENS_PER_WARP - 1) / TOKENS_PER_WARP;
    return (const unsigned long long *)((const char *)scratch +
                                        round_up((size_t)(num_warps * num_experts) * sizeof(int32_t), 256) +
                                        round_up((size_t)num_experts * 8, 256));
}

/* Layout of one step's routing: counts, offsets and the stable permutation. */
extern "C" moert_result moert_a2a_cuda_layout(const moert_host *host, cudaStream_t stream, const int32_t *topk_idx,
                                              int64_t tokens, int64_t topk, int64_t num_experts,
                                              const moert_a2a_cuda_layout_buffers *out, int64_t *counts_host)
{
    if (tokens < 0 || topk <= 0 || num_experts <= 0 || tokens * topk > INT32_MAX)
        return report(host, MOERT_ERR_INVALID_ARGUMENT,
                      "alltoall cuda layout: bad sizes (tokens %lld, topk %lld, experts %lld)", (long long)tokens,
                      (long long)topk, (long long)num_experts);
    if (num_experts > MOERT_A2A_CUDA_MAX_EXPERTS)
        return report(host, MOERT_ERR_UNSUPPORTED, "alltoall cuda layout: %lld experts, at most %d supported",
                      (long long)num_experts, MOERT_A2A_CUDA_MAX_EXPERTS);
    if (!out || !out->tokens_per_expert || !out->expert_offsets || !out->scratch ||
        (tokens > 0 && (!topk_idx || !out->row_of_copy || !out->copy_of_row)))
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "alltoall cuda layout: a device buffer is missing");

    const int E = (int)num_experts, K = (int)topk;
    const int64_t num_warps = (tokens + TOKENS_PER_WARP - 1) / TOKENS_PER_WARP;
    char *scratch = (char *)out->scratch;
    int32_t *warp_counts = (int32_t *)scratch;
    int64_t *totals = (int64_t *)(scratch + round_up((size_t)(num_warps * num_experts) * sizeof(int32_t), 256));
    unsigned long long *bad_ids = (unsigned long long *)((char *)totals + round_up((size_t)num_experts * 8, 256));
    const size_t smem = (size_t)LAYOUT_WARPS * num_experts * sizeof(int32_t);
    const int blocks = (int)((num_warps + LAYOUT_WARPS - 1) / LAYOUT_WARPS);

    CUDA_CHECK(host, cudaMemsetAsync(bad_ids, 0, sizeof *bad_ids, stream));
    if (num_warps > 0) {
        layout_count_kernel<<<blocks, LAYOUT_WARPS * 32, smem, stream>>>(topk_idx, tokens, K, E, num_warps, warp_counts,
                                                                         bad_ids);
        LAUNCH_CHECK(host, "layout_count_kernel");
    }
    layout_scan_warps_kernel<<<E, 256, 0, stream>>>(num_warps, E, warp_counts, totals);
    LAUNCH_CHECK(host, "layout_scan_warps_kernel");
    layout_scan_experts_kernel<<<1, 1024, 0, stream>>>(E, totals, out->tokens_per_expert, out->expert_offsets);
    LAUNCH_CHECK(host, "layout_scan_experts_kernel");
    if (num_warps > 0) {
        layout_place_kernel<<<blocks, LAYOUT_WARPS * 32, smem, stream>>>(
            topk_idx, tokens, K, E, num_warps, warp_counts, out->expert_offsets, out->row_of_copy, out->copy_of_row);
        LAUNCH_CHECK(host, "layout_place_kernel");
    }
    if (counts_host) {
        unsigned long long bad_host = 0;
        CUDA_CHECK(host, cudaMemcpyAsync(counts_host, out->tokens_per_expert, (size_t)num_experts * sizeof(int64_t),
                                         cudaMemcpyDeviceToHost, stream));
        CUDA_CHECK(host, cudaMemcpyAsync(&bad_host, bad_ids, sizeof bad_host, cudaMemcpyDeviceToHost, stream));
        CUDA_CHECK(host, cudaStreamSynchronize(stream));
        if (bad_host)
            return report(host, MOERT_ERR_INVALID_ARGUMENT,
                          "alltoall cuda layout: %llu expert ids of topk_idx are outside [-1, %lld)", bad_host,
                          (long long)num_experts);
    }
    return MOERT_OK;
}

/* ---- row kernels ---- */

/* dst[r] = src[index[r] / divisor] (zeros for a negative index); one warp per row, VEC elements per access. */
template <typename T, int VEC>
__global__ void gather_rows_kernel(int64_t rows, int64_t hidden, const int32_t *__restrict__ index, int32_t divisor,
                                   const int64_t *__restrict__ rows_limit, const T *__restrict__ src,
                                   T *__restrict__ dst)
{
    const int lane = threadIdx.x & 31;
    int64_t n = rows;
    if (rows_limit && *rows_limit < n) n = *rows_limit;
    const int64_t warps_total = (int64_t)gridDim.x * ROW_WARPS;
    for (int64_t r = (int64_t)blockIdx.x * ROW_WARPS + (threadIdx.x >> 5); r < n; r += warps_total) {
        const int32_t i = index[r];
        T *d = dst + r * hidden;
        if (i < 0) {
            vec_t<T, VEC> zero;
#pragma unroll
            for (int k = 0; k < VEC; k++) zero.v[k] = T(0);
            for (int64_t j = (int64_t)lane * VEC; j < hidden; j += 32 * VEC)
                *reinterpret_cast<vec_t<T, VEC> *>(d + j) = zero;
        } else {
            const T *s = src + (int64_t)(i / divisor) * hidden;
            for (int64_t j = (int64_t)lane * VEC; j < hidden; j += 32 * VEC)
                *reinterpret_cast<vec_t<T, VEC> *>(d + j) = *reinterpret_cast<const vec_t<T, VEC> *>(s + j);
        }
    }
}

/* The same for narrow rows (hidden < 32, e.g. the prob vectors): one thread per row. */
template <typename T>
__global__ void gather_narrow_rows_kernel(int64_t rows, int64_t hidden, const int32_t *__restrict__ index,
                                          int32_t divisor, const int64_t *__restrict__ rows_limit,
                                          const T *__restrict__ src, T *__restrict__ dst)
{
    int64_t n = rows;
    if (rows_limit && *rows_limit < n) n = *rows_limit;
    for (int64_t r = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; r < n; r += (int64_t)gridDim.x * blockDim.x) {
        const int32_t i = index[r];
        for (int64_t j = 0; j < hidden; j++)
            dst[r * hidden + j] = i < 0 ? T(0) : src[(int64_t)(i / divisor) * hidden + j];
    }
}

template <typename T>
static moert_result gather_rows_typed(const moert_host *host, cudaStream_t s, int64_t rows, int64_t hidden,
                                      const int32_t *index, int32_t divisor, const int64_t *limit, const void *src,
                                      void *dst)
{
    constexpr int VEC = 16 / sizeof(T);
    if (hidden < 32) {
        int64_t blocks = (rows + 255) / 256;
        gather_narrow_rows_kernel<T><<<(int)(blocks < MAX_GRID_BLOCKS ? blocks : MAX_GRID_BLOCKS), 256, 0, s>>>(
            rows, hidden, index, divisor, limit, (const T *)src, (T *)dst);
        LAUNCH_CHECK(host, "gather_narrow_rows_kernel");
        return MOERT_OK;
    }
    int64_t blocks = (rows + ROW_WARPS - 1) / ROW_WARPS;
    const int grid = (int)(blocks < MAX_GRID_BLOCKS ? blocks : MAX_GRID_BLOCKS);
    if (hidden % VEC == 0 && aligned(src, 16) && aligned(dst, 16))
        gather_rows_kernel<T, VEC>
            <<<grid, ROW_WARPS * 32, 0, s>>>(rows, hidden, index, divisor, limit, (const T *)src, (T *)dst);
    else
        gather_rows_kernel<T, 1>
            <<<grid, ROW_WARPS * 32, 0, s>>>(rows, hidden, index, divisor, limit, (const T *)src, (T *)dst);
    LAUNCH_CHECK(host, "gather_rows_kernel");
    return MOERT_OK;
}

/* Row gather by an index map (permute, regroup, adjoint of combine). */
extern "C" moert_result moert_a2a_cuda_gather_rows(const moert_host *host, cudaStream_t stream, moert_dtype dtype,
                                                   int64_t rows, int64_t hidden, const int32_t *index,
                                                   int32_t index_divisor, const int64_t *rows_limit, const void *src,
                                                   void *dst)
{
    if (rows < 0 || hidden <= 0 || index_divisor <= 0)
        return report(host, MOERT_ERR_INVALID_ARGUMENT,
                      "alltoall cuda gather: bad sizes (rows %lld, hidden %lld, divisor %d)", (long long)rows,
                      (long long)hidden, (int)index_divisor);
    if (rows == 0) return MOERT_OK;
    if (!index || !src || !dst)
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "alltoall cuda gather: index, src and dst are required");
    /* a gather only moves bits: bf16 rows travel as 2-byte integers */
    switch (dtype) {
    case MOERT_F32:
        return gather_rows_typed<float>(host, stream, rows, hidden, index, index_divisor, rows_limit, src, dst);
    case MOERT_BF16:
        return gather_rows_typed<uint16_t>(host, stream, rows, hidden, index, index_divisor, rows_limit, src, dst);
    default:
        return report(host, MOERT_ERR_UNSUPPORTED, "alltoall cuda gather: dtype %s is not supported (fp32, bf16)",
                      moert_dtype_name(dtype));
    }
}

/* out[t] (+)= sum_k rows[row_of_copy[t*K+k]] in fp32; one warp per token. */
template <typename T, int VEC>
__global__ void combine_rows_kernel(int64_t tokens, int topk, int64_t hidden, const int32_t *__restrict__ row_of_copy,
                                    const T *__restrict__ rows, T *__restrict__ out, int accumulate)
{
    const int lane = threadIdx.x & 31;
    const int64_t warps_total = (int64_t)gridDim.x * ROW_WARPS;
    for (int64_t t = (int64_t)blockIdx.x * ROW_WARPS + (threadIdx.x >> 5); t < tokens; t += warps_total) {
        const int32_t *my_rows = row_of_copy + t * topk;
        T *o = out + t * hidden;
        for (int64_t j = (int64_t)lane * VEC; j < hidden; j += 32 * VEC) {
            float acc[VEC];
            if (accumulate) {
                vec_t<T, VEC> cur = *reinterpret_cast<const vec_t<T, VEC> *>(o + j);
#pragma unroll
                for (int i = 0; i < VEC; i++) acc[i] = to_f32(cur.v[i]);
            } else {
#pragma unroll
                for (int i = 0; i < VEC; i++) acc[i] = 0.0f;
            }
#pragma unroll 4
            for (int k = 0; k < topk; k++) { /* unrolled: several copies' loads in flight */
                const int32_t r = my_rows[k];
                if (r < 0) continue;
                vec_t<T, VEC> x = *reinterpret_cast<const vec_t<T, VEC> *>(rows + (int64_t)r * hidden + j);
#pragma unroll
                for (int i = 0; i < VEC; i++) acc[i] += to_f32(x.v[i]);
            }
            vec_t<T, VEC> res;
#pragma unroll
            for (int i = 0; i < VEC; i++) res.v[i] = from_f32<T>(acc[i]);
            *reinterpret_cast<vec_t<T, VEC> *>(o + j) = res;
        }
    }
}

template <typename T>
static moert_result combine_rows_typed(const moert_host *host, cudaStream_t s, int64_t tokens, int topk, int64_t hidden,
                                       const int32_t *row_of_copy, const void *rows, void *out, int accumulate)
{
    constexpr int VEC = 16 / sizeof(T);
    int64_t blocks = (tokens + ROW_WARPS - 1) / ROW_WARPS;
    const int grid = (int)(blocks < MAX_GRID_BLOCKS ? blocks : MAX_GRID_BLOCKS);
    if (hidden % VEC == 0 && aligned(rows, 16) && aligned(out, 16))
        combine_rows_kernel<T, VEC>
            <<<grid, ROW_WARPS * 32, 0, s>>>(tokens, topk, hidden, row_of_copy, (const T *)rows, (T *)out, accumulate);
    else
        combine_rows_kernel<T, 1>
            <<<grid, ROW_WARPS * 32, 0, s>>>(tokens, topk, hidden, row_of_copy, (const T *)rows, (T *)out, accumulate);
    LAUNCH_CHECK(host, "combine_rows_kernel");
    return MOERT_OK;
}

/* Per-token sum of its copies' rows (combine, adjoint of permute). */
extern "C" moert_result moert_a2a_cuda_combine_rows(const moert_host *host, cudaStream_t stream, moert_dtype dtype,
                                                    int64_t tokens, int64_t topk, int64_t hidden,
                                                    const int32_t *row_of_copy, const void *rows, void *out,
                                                    int accumulate)
{
    if (tokens < 0 || topk <= 0 || hidden <= 0)
        return report(host, MOERT_ERR_INVALID_ARGUMENT,
                      "alltoall cuda combine: bad sizes (tokens %lld, topk %lld, hidden %lld)", (long long)tokens,
                      (long long)topk, (long long)hidden);
    if (tokens == 0) return MOERT_OK;
    if (!row_of_copy || !rows || !out)
        return report(host, MOERT_ERR_INVALID_ARGUMENT,
                      "alltoall cuda combine: row_of_copy, rows and out are required");
    switch (dtype) {
    case MOERT_F32:
        return combine_rows_typed<float>(host, stream, tokens, (int)topk, hidden, row_of_copy, rows, out, accumulate);
    case MOERT_BF16:
        return combine_rows_typed<__nv_bfloat16>(host, stream, tokens, (int)topk, hidden, row_of_copy, rows, out,
                                                 accumulate);
    default:
        return report(host, MOERT_ERR_UNSUPPORTED, "alltoall cuda combine: dtype %s is not supported (fp32, bf16)",
                      moert_dtype_name(dtype));
    }
}

/* ---- composed maps ---- */

__global__ void compose_maps_kernel(int64_t n, const int32_t *__restrict__ outer, const int32_t *__restrict__ inner,
                                    int32_t *__restrict__ out)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int32_t o = outer[i];
        out[i] = o < 0 ? -1 : inner[o];
    }
}

extern "C" moert_result moert_a2a_cuda_compose_maps(const moert_host *host, cudaStream_t stream, int64_t n,
                                                    const int32_t *outer, const int32_t *inner, int32_t *out)
{
    if (n < 0) return report(host, MOERT_ERR_INVALID_ARGUMENT, "alltoall cuda compose: %lld rows", (long long)n);
    if (n == 0) return MOERT_OK;
    if (!outer || !inner || !out)
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "alltoall cuda compose: outer, inner and out are required");
    const int64_t blocks = (n + 255) / 256;
    compose_maps_kernel<<<(int)(blocks < MAX_GRID_BLOCKS ? blocks : MAX_GRID_BLOCKS), 256, 0, stream>>>(n, outer, inner,
                                                                                                        out);
    LAUNCH_CHECK(host, "compose_maps_kernel");
    return MOERT_OK;
}

/* ---- regroup maps ---- */

#define REGROUP_THREADS 512

/* Exclusive prefix sums of n values (n <= MOERT_A2A_CUDA_MAX_CHUNKS) read through value(i), into out[0..n]. */
template <typename F> __device__ void block_scan_array(int n, F value, int64_t *out)
{
    const int per_thread = (n + REGROUP_THREADS - 1) / REGROUP_THREADS;
    const int first = threadIdx.x * per_thread;
    int64_t local = 0;
    for (int i = first; i < first + per_thread && i < n; i++) local += value(i);
    int64_t total;
    int64_t run = block_exclusive_scan(local, &total);
    for (int i = first; i < first + per_thread && i < n; i++) {
        out[i] = run;
        run += value(i);
    }
    if (threadIdx.x == 0) out[n] = total;
    __syncthreads();
}

/* Every block computes both offset tables in shared memory, then maps rows grid-stride. */
__global__ void regroup_maps_kernel(int world, int local_experts, const int64_t *__restrict__ counts,
                                    int64_t rows_capacity, int32_t *__restrict__ expert_major_src,
                                    int32_t *__restrict__ rank_major_dst, int64_t *__restrict__ tokens_per_local_expert,
                                    int64_t *__restrict__ total_rows)
{
    __shared__ int64_t rank_major_off[MOERT_A2A_CUDA_MAX_CHUNKS + 1];   /* chunk s*EL+e */
    __shared__ int64_t expert_major_off[MOERT_A2A_CUDA_MAX_CHUNKS + 1]; /* chunk e*W+s */
    const int n = world * local_experts;
    block_scan_array(
        n, [&](int i) { return counts[i]; }, rank_major_off);
    block_scan_array(
        n, [&](int i) { return counts[(i % world) * local_experts + i / world]; }, expert_major_off);
    const int64_t total = rank_major_off[n];
    if (blockIdx.x == 0) {
        if (total_rows && threadIdx.x == 0) *total_rows = total;
        if (tokens_per_local_expert)
            for (int e = threadIdx.x; e < local_experts; e += blockDim.x)
                tokens_per_local_expert[e] = expert_major_off[(e + 1) * world] - expert_major_off[e * world];
    }
    const int64_t limit = total < rows_capacity ? total : rows_capacity;
    for (int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; j < limit; j += (int64_t)gridDim.x * blockDim.x) {
        /* the last chunk starting at or before j: non-empty, and it holds j */
        int lo = 0, hi = n - 1;
        while (lo < hi) {
            int mid = (lo + hi + 1) / 2;
            if (rank_major_off[mid] <= j)
                lo = mid;
            else
                hi = mid - 1;
        }
        const int s = lo / local_experts, e = lo % local_experts;
        const int64_t dst = expert_major_off[e * world + s] + (j - rank_major_off[lo]);
        if (rank_major_dst) rank_major_dst[j] = (int32_t)dst;
        if (expert_major_src && dst < rows_capacity) expert_major_src[dst] = (int32_t)j;
    }
}

/* Maps between [source rank][local expert] and [local expert][source rank] row orders. */
extern "C" moert_result moert_a2a_cuda_regroup_maps(const moert_host *host, cudaStream_t stream, int64_t world,
                                                    int64_t local_experts, const int64_t *counts, int64_t rows_capacity,
                                                    int32_t *expert_major_src, int32_t *rank_major_dst,
                                                    int64_t *tokens_per_local_expert, int64_t *total_rows)
{
    if (world <= 0 || local_experts <= 0 || rows_capacity < 0 || rows_capacity > INT32_MAX)
        return report(host, MOERT_ERR_INVALID_ARGUMENT,
                      "alltoall cuda regroup: bad sizes (world %lld, local experts %lld, capacity %lld)",
                      (long long)world, (long long)local_experts, (long long)rows_capacity);
    if (world * local_experts > MOERT_A2A_CUDA_MAX_CHUNKS)
        return report(host, MOERT_ERR_UNSUPPORTED,
                      "alltoall cuda regroup: %lld ranks x %lld local experts exceeds %d chunks", (long long)world,
                      (long long)local_experts, MOERT_A2A_CUDA_MAX_CHUNKS);
    if (!counts) return report(host, MOERT_ERR_INVALID_ARGUMENT, "alltoall cuda regroup: counts are required");
    int64_t blocks = (rows_capacity + REGROUP_THREADS - 1) / REGROUP_THREADS;
    if (blocks < 1) blocks = 1;
    if (blocks > 264) blocks = 264; /* each block rescans the counts: keep the grid about two waves */
    regroup_maps_kernel<<<(int)blocks, REGROUP_THREADS, 0, stream>>>((int)world, (int)local_experts, counts,
                                                                     rows_capacity, expert_major_src, rank_major_dst,
                                                                     tokens_per_local_expert, total_rows);
    LAUNCH_CHECK(host, "regroup_maps_kernel");
    return MOERT_OK;
}
