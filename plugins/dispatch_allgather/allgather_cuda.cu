/* SPDX-License-Identifier: Apache-2.0 */
/* CUDA kernels of the allgather dispatcher: counts, padded and localized routing, partial sums and their reduction. */
#include "allgather_cuda.h"

#include <cuda_bf16.h>
#include <stdint.h>

#include "plugin_cuda_check.h"

#define THREADS         256  /* threads per block of the element-wise kernels */
#define ROW_WARPS       8    /* warps per block of the row kernel: one warp per token */
#define MAX_GRID_BLOCKS 8192 /* grid-stride loops beyond this */

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

template <typename T, int N> struct alignas(sizeof(T) * N) vec_t {
    T v[N];
};

/* Blocks for n items of `per_block` each, capped (the kernels loop grid-stride). */
static int grid_for(int64_t n, int64_t per_block)
{
    int64_t blocks = (n + per_block - 1) / per_block;
    if (blocks < 1) blocks = 1;
    return (int)(blocks < MAX_GRID_BLOCKS ? blocks : MAX_GRID_BLOCKS);
}

static bool aligned(const void *p, size_t bytes) { return ((uintptr_t)p % bytes) == 0; }

/* ---- routing ---- */

/* A block-local histogram of the kept copies per expert, added into the global counts; ids outside [-1, E) counted. */
__global__ void count_kernel(const int32_t *__restrict__ idx, int64_t n, int num_experts,
                             unsigned long long *__restrict__ counts, unsigned long long *__restrict__ bad_ids)
{
    extern __shared__ unsigned int hist[]; /* [E] */
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x) hist[e] = 0;
    __syncthreads();
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int32_t e = idx[i];
        if (e >= 0 && e < num_experts)
            atomicAdd(&hist[e], 1u);
        else if (e != -1)
            atomicAdd(bad_ids, 1ull);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x)
        if (hist[e]) atomicAdd(&counts[e], (unsigned long long)hist[e]);
}

extern "C" moert_result moert_ag_cuda_count(const moert_host *host, cudaStream_t stream, const int32_t *topk_idx,
                                            int64_t tokens, int64_t topk, int64_t num_experts, int64_t *counts,
                                            unsigned long long *bad_ids)
{
    if (tokens < 0 || topk <= 0 || num_experts <= 0 || num_experts > MOERT_AG_CUDA_MAX_EXPERTS)
        return report(host, MOERT_ERR_INVALID_ARGUMENT,
                      "allgather cuda count: bad sizes (tokens %lld, topk %lld, experts %lld; at most %d experts)",
                      (long long)tokens, (long long)topk, (long long)num_experts, MOERT_AG_CUDA_MAX_EXPERTS);
    CUDA_CHECK(host, cudaMemsetAsync(counts, 0, (size_t)num_experts * sizeof(int64_t), stream));
    CUDA_CHECK(host, cudaMemsetAsync(bad_ids, 0, sizeof *bad_ids, stream));
    const int64_t n = tokens * topk;
    if (n == 0) return MOERT_OK;
    count_kernel<<<grid_for(n, THREADS * 8), THREADS, (size_t)num_experts * sizeof(unsigned int), stream>>>(
        topk_idx, n, (int)num_experts, (unsigned long long *)counts, bad_ids);
    LAUNCH_CHECK(host, "allgather count_kernel");
    return MOERT_OK;
}

extern "C" moert_result moert_ag_cuda_pad_idx(const moert_host *host, cudaStream_t stream, const int32_t *topk_idx,
                                              int64_t tokens, int64_t max_tokens, int64_t topk, int32_t *out)
{
    if (tokens < 0 || tokens > max_tokens || topk <= 0)
        return report(host, MOERT_ERR_INVALID_ARGUMENT,
                      "allgather cuda pad: bad sizes (tokens %lld of %lld, topk %lld)", (long long)tokens,
                      (long long)max_tokens, (long long)topk);
    const size_t own = (size_t)(tokens * topk) * sizeof(int32_t);
    const size_t pad = (size_t)((max_tokens - tokens) * topk) * sizeof(int32_t);
    if (own) CUDA_CHECK(host, cudaMemcpyAsync(out, topk_idx, own, cudaMemcpyDeviceToDevice, stream));
    if (pad) CUDA_CHECK(host, cudaMemsetAsync((char *)out + own, 0xff, pad, stream)); /* every int32 -1 */
    return MOERT_OK;
}

__global__ void localize_kernel(const int32_t *__restrict__ gathered, int64_t n, int32_t first, int32_t local_experts,
                                int32_t *__restrict__ local_idx)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int32_t l = gathered[i] - first;
        local_idx[i] = gathered[i] >= 0 && l >= 0 && l < local_experts ? l : -1;
    }
}

extern "C" moert_result moert_ag_cuda_localize(const moert_host *host, cudaStream_t stream, const int32_t *gathered_idx,
                                               int64_t copies, int64_t first_expert, int64_t local_experts,
                                               int32_t *local_idx)
{
    if (copies < 0 || first_expert < 0 || local_experts <= 0 || first_expert + local_experts > INT32_MAX)
        return report(host, MOERT_ERR_INVALID_ARGUMENT,
                      "allgather cuda localize: bad sizes (copies %lld, experts %lld+%lld)", (long long)copies,
                      (long long)first_expert, (long long)local_experts);
    if (copies == 0) return MOERT_OK;
    localize_kernel<<<grid_for(copies, THREADS), THREADS, 0, stream>>>(gathered_idx, copies, (int32_t)first_expert,
                                                                       (int32_t)local_experts, local_idx);
    LAUNCH_CHECK(host, "allgather localize_kernel");
    return MOERT_OK;
}

/* ---- partial sums ---- */

/* VEC fp32 values to dst: 16-byte stores where VEC allows (dst then 16-byte aligned), else one by one. */
template <int VEC> __device__ __forceinline__ void store_f32(float *dst, const float *v)
{
    if constexpr (VEC % 4 == 0) {
#pragma unroll
        for (int i = 0; i < VEC; i += 4)
            *reinterpret_cast<float4 *>(dst + i) = make_float4(v[i], v[i + 1], v[i + 2], v[i + 3]);
    } else {
#pragma unroll
        for (int i = 0; i < VEC; i++) dst[i] = v[i];
    }
}

/* partial[g] = sum over k of grouped[copy_row[g*K+k]] in fp32, from -0; one warp per token, VEC values per access. */
template <typename T, int VEC>
__global__ void partial_rows_kernel(int64_t tokens, int topk, int64_t hidden, const int32_t *__restrict__ copy_row,
                                    const T *__restrict__ grouped, float *__restrict__ partial)
{
    const int lane = threadIdx.x & 31;
    const int64_t warps_total = (int64_t)gridDim.x * ROW_WARPS;
    for (int64_t g = (int64_t)blockIdx.x * ROW_WARPS + (threadIdx.x >> 5); g < tokens; g += warps_total) {
        const int32_t *rows = copy_row + g * topk;
        float *out = partial + g * hidden;
        for (int64_t j = (int64_t)lane * VEC; j < hidden; j += 32 * VEC) {
            float acc[VEC];
#pragma unroll
            for (int i = 0; i < VEC; i++) acc[i] = -0.0f; /* the additive identity: a single -0 stays -0 */
            for (int k = 0; k < topk; k++) {
                const int32_t r = rows[k];
                if (r < 0) continue;
                const vec_t<T, VEC> x = *reinterpret_cast<const vec_t<T, VEC> *>(grouped + (int64_t)r * hidden + j);
#pragma unroll
                for (int i = 0; i < VEC; i++) acc[i] += to_f32(x.v[i]);
            }
            store_f32<VEC>(out + j, acc);
        }
    }
}

template <typename T>
static moert_result partial_rows_typed(const moert_host *host, cudaStream_t s, int64_t tokens, int topk, int64_t hidden,
                                       const int32_t *copy_row, const void *grouped, float *partial)
{
    constexpr int VEC = 16 / sizeof(T); /* 4 fp32 or 8 bf16: 16-byte loads, one or two 16-byte stores */
    const int grid = grid_for(tokens, ROW_WARPS);
    if (hidden % VEC == 0 && aligned(grouped, 16) && aligned(partial, 16))
        partial_rows_kernel<T, VEC>
            <<<grid, ROW_WARPS * 32, 0, s>>>(tokens, topk, hidden, copy_row, (const T *)grouped, partial);
    else
        partial_rows_kernel<T, 1>
            <<<grid, ROW_WARPS * 32, 0, s>>>(tokens, topk, hidden, copy_row, (const T *)grouped, partial);
    LAUNCH_CHECK(host, "allgather partial_rows_kernel");
    return MOERT_OK;
}

extern "C" moert_result moert_ag_cuda_partial_rows(const moert_host *host, cudaStream_t stream, moert_dtype dtype,
                                                   int64_t tokens, int64_t topk, int64_t hidden,
                                                   const int32_t *copy_row, const void *grouped, float *partial)
{
    if (tokens < 0 || topk <= 0 || hidden <= 0)
        return report(host, MOERT_ERR_INVALID_ARGUMENT,
                      "allgather cuda partial rows: bad sizes (tokens %lld, topk %lld, "
                      "hidden %lld)",
                      (long long)tokens, (long long)topk, (long long)hidden);
    if (tokens == 0) return MOERT_OK;
    switch (dtype) {
    case MOERT_F32:
        return partial_rows_typed<float>(host, stream, tokens, (int)topk, hidden, copy_row, grouped, partial);
    case MOERT_BF16:
        return partial_rows_typed<__nv_bfloat16>(host, stream, tokens, (int)topk, hidden, copy_row, grouped, partial);
    default:
        return report(host, MOERT_ERR_UNSUPPORTED, "allgather cuda partial rows: dtype %s (fp32 or bf16 on CUDA)",
                      moert_dtype_name(dtype));
    }
}

template <typename T>
__global__ void partial_probs_kernel(int64_t copies, const int32_t *__restrict__ copy_row, const T *__restrict__ probs,
                                     float *__restrict__ partial)
{
    for (int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; c < copies; c += (int64_t)gridDim.x * blockDim.x) {
        const int32_t r = copy_row[c];
        partial[c] = r >= 0 ? to_f32(probs[r]) : -0.0f;
    }
}

extern "C" moert_result moert_ag_cuda_partial_probs(const moert_host *host, cudaStream_t stream, moert_dtype dtype,
                                                    int64_t copies, const int32_t *copy_row, const void *grouped_probs,
                                                    float *partial)
{
    if (copies < 0)
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "allgather cuda partial probs: %lld copies", (long long)copies);
    if (copies == 0) return MOERT_OK;
    const int grid = grid_for(copies, THREADS);
    switch (dtype) {
    case MOERT_F32:
        partial_probs_kernel<float>
            <<<grid, THREADS, 0, stream>>>(copies, copy_row, (const float *)grouped_probs, partial);
        break;
    case MOERT_BF16:
        partial_probs_kernel<__nv_bfloat16>
            <<<grid, THREADS, 0, stream>>>(copies, copy_row, (const __nv_bfloat16 *)grouped_probs, partial);
        break;
    default:
        return report(host, MOERT_ERR_UNSUPPORTED, "allgather cuda partial probs: dtype %s (fp32 or bf16 on CUDA)",
                      moert_dtype_name(dtype));
    }
    LAUNCH_CHECK(host, "allgather partial_probs_kernel");
    return MOERT_OK;
}

/* ---- the owner's reduction ---- */

/* out[t, j] from the world's partials [s][t][j], element by element (coalesced over j); see the header. */
template <typename T>
__global__ void sum_partials_kernel(int world, int64_t tokens, int64_t width, int topk,
                                    const float *__restrict__ partials, const int32_t *__restrict__ idx, int per_copy,
                                    int accumulate, T *__restrict__ out)
{
    const int64_t n = tokens * width;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t t = i / width;
        bool kept = false;
        if (per_copy)
            kept = idx[i] >= 0;
        else
            for (int k = 0; k < topk && !kept; k++) kept = idx[t * topk + k] >= 0;
        if (!kept) {
            if (!accumulate) out[i] = from_f32<T>(0.0f);
            continue;
        }
        float acc = accumulate ? to_f32(out[i]) : -0.0f;
        for (int s = 0; s < world; s++) acc += partials[(int64_t)s * n + i];
        out[i] = from_f32<T>(acc);
    }
}

extern "C" moert_result moert_ag_cuda_sum_partials(const moert_host *host, cudaStream_t stream, moert_dtype dtype,
                                                   int64_t world, int64_t tokens, int64_t width, int64_t topk,
                                                   const float *partials, const int32_t *topk_idx, int per_copy,
                                                   int accumulate, void *out)
{
    if (world <= 0 || tokens < 0 || width <= 0 || topk <= 0 || (per_copy && width != topk))
        return report(host, MOERT_ERR_INVALID_ARGUMENT,
                      "allgather cuda sum: bad sizes (world %lld, tokens %lld, width "
                      "%lld, topk %lld)",
                      (long long)world, (long long)tokens, (long long)width, (long long)topk);
    const int64_t n = tokens * width;
    if (n == 0) return MOERT_OK;
    const int grid = grid_for(n, THREADS);
    switch (dtype) {
    case MOERT_F32:
        sum_partials_kernel<float><<<grid, THREADS, 0, stream>>>((int)world, tokens, width, (int)topk, partials,
                                                                 topk_idx, per_copy, accumulate, (float *)out);
        break;
    case MOERT_BF16:
        sum_partials_kernel<__nv_bfloat16><<<grid, THREADS, 0, stream>>>(
            (int)world, tokens, width, (int)topk, partials, topk_idx, per_copy, accumulate, (__nv_bfloat16 *)out);
        break;
    default:
        return report(host, MOERT_ERR_UNSUPPORTED, "allgather cuda sum: dtype %s (fp32 or bf16 on CUDA)",
                      moert_dtype_name(dtype));
    }
    LAUNCH_CHECK(host, "allgather sum_partials_kernel");
    return MOERT_OK;
}
