/* SPDX-License-Identifier: Apache-2.0 */
/* CUDA kernels of the core's executor: SwiGLU x prob (forward, backward) and element-wise helpers. */
#include "kernels.h"

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <math.h>
#include <nccl.h>

extern "C" {
#include "cuda_check.h" /* moert_cuda_fail: the core's message for a failed CUDA call */
#include "error.h"
#include "random.h"
}

#define BLOCK_THREADS   256
#define MAX_GRID_BLOCKS 4096

/* Checks the launch just made; the message names the kernel, e.g. "swiglu_forward_kernel<<<>>> failed: ...". */
#define LAUNCH_CHECK(name)                                                                                             \
    do {                                                                                                               \
        cudaError_t err_ = cudaGetLastError();                                                                         \
        if (err_ != cudaSuccess) return moert_cuda_fail(name "<<<>>>", err_, __FILE__, __LINE__);                      \
    } while (0)

/* ---- element access ---- */

template <typename T, int N> struct alignas(sizeof(T) * N) vec_t {
    T v[N];
};

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(double x) { return (float)x; }
__device__ __forceinline__ double to_f64(float x) { return x; }
__device__ __forceinline__ double to_f64(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ double to_f64(double x) { return x; }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ double from_f32<double>(float x) { return x; }

template <typename T> __device__ __forceinline__ T from_f64(double x);
template <> __device__ __forceinline__ float from_f64<float>(double x) { return (float)x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f64<__nv_bfloat16>(double x) { return __double2bfloat16(x); }
template <> __device__ __forceinline__ double from_f64<double>(double x) { return x; }
template <> __device__ __forceinline__ int32_t from_f64<int32_t>(double x) { return (int32_t)x; }
template <> __device__ __forceinline__ int64_t from_f64<int64_t>(double x) { return (int64_t)x; }

template <typename T, int N> __device__ __forceinline__ vec_t<T, N> load_vec(const T *p)
{
    return *reinterpret_cast<const vec_t<T, N> *>(p);
}

template <typename T, int N> __device__ __forceinline__ void store_vec(T *p, const vec_t<T, N> &v)
{
    *reinterpret_cast<vec_t<T, N> *>(p) = v;
}

static bool aligned(const void *p, size_t bytes) { return ((uintptr_t)p % bytes) == 0; }

static int grid_for(int64_t work_items)
{
    int64_t blocks = (work_items + BLOCK_THREADS - 1) / BLOCK_THREADS;
    if (blocks < 1) blocks = 1;
    return (int)(blocks < MAX_GRID_BLOCKS ? blocks : MAX_GRID_BLOCKS);
}

/* Sum over the block, in a fixed order (warp shuffles, then warp 0); every thread gets the total. */
template <typename A> __device__ A block_sum(A x)
{
    __shared__ A warp_sums[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    __syncthreads(); /* warp_sums may still be read from a previous call */
    if (lane == 0) warp_sums[warp] = x;
    __syncthreads();
    const int warps = (blockDim.x + 31) >> 5;
    A total = lane < warps ? warp_sums[lane] : (A)0;
    for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
    return total;
}

/* ---- SwiGLU x prob ---- */

__device__ __forceinline__ float sigmoidf_(float a) { return 1.0f / (1.0f + expf(-a)); }

/* One block per row (grid-stride over rows), VEC elements per thread access. */
template <typename T, int VEC>
__global__ void swiglu_forward_kernel(int64_t rows, int64_t ffn, const T *__restrict__ in,
                                      const float *__restrict__ prob, T *__restrict__ out)
{
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const float p = prob ? prob[r] : 1.0f;
        const T *a_row = in + r * 2 * ffn;
        const T *g_row = a_row + ffn;
        T *o_row = out + r * ffn;
        for (int64_t j = (int64_t)threadIdx.x * VEC; j < ffn; j += (int64_t)blockDim.x * VEC) {
            vec_t<T, VEC> a = load_vec<T, VEC>(a_row + j), g = load_vec<T, VEC>(g_row + j), o;
#pragma unroll
            for (int i = 0; i < VEC; i++) {
                float av = to_f32(a.v[i]), gv = to_f32(g.v[i]);
                o.v[i] = from_f32<T>(av * sigmoidf_(av) * gv * p);
            }
            store_vec<T, VEC>(o_row + j, o);
        }
    }
}

template <typename T, int VEC>
__global__ void swiglu_backward_kernel(int64_t rows, int64_t ffn, const T *__restrict__ in,
                                       const float *__restrict__ prob, const T *__restrict__ d_out,
                                       T *__restrict__ d_in, float *__restrict__ d_prob)
{
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const float p = prob ? prob[r] : 1.0f;
        const T *a_row = in + r * 2 * ffn;
        const T *g_row = a_row + ffn;
        const T *do_row = d_out + r * ffn;
        T *da_row = d_in + r * 2 * ffn;
        T *dg_row = da_row + ffn;
        float prob_grad = 0.0f;
        for (int64_t j = (int64_t)threadIdx.x * VEC; j < ffn; j += (int64_t)blockDim.x * VEC) {
            vec_t<T, VEC> a = load_vec<T, VEC>(a_row + j), g = load_vec<T, VEC>(g_row + j);
            vec_t<T, VEC> dout = load_vec<T, VEC>(do_row + j), da, dg;
#pragma unroll
            for (int i = 0; i < VEC; i++) {
                float av = to_f32(a.v[i]), gv = to_f32(g.v[i]), dv = to_f32(dout.v[i]);
                float s = sigmoidf_(av), silu = av * s;
                float dsilu = s * (1.0f + av * (1.0f - s));
                float go = dv * p;
                da.v[i] = from_f32<T>(go * gv * dsilu);
                dg.v[i] = from_f32<T>(go * silu);
                prob_grad += dv * silu * gv;
            }
            store_vec<T, VEC>(da_row + j, da);
            store_vec<T, VEC>(dg_row + j, dg);
        }
        if (d_prob) {
            float total = block_sum<float>(prob_grad);
            if (threadIdx.x == 0) d_prob[r] = total;
        }
    }
}

/* Grid size for one-block-per-row kernels. */
static int row_grid(int64_t rows) { return (int)(rows < 65535 ? rows : 65535); }

template <typename T>
static moert_result swiglu_forward_typed(cudaStream_t s, int64_t rows, int64_t ffn, const void *in, const float *prob,
                                         void *out)
{
    constexpr int VEC = 16 / sizeof(T);
    const bool vec_ok = ffn % VEC == 0 && aligned(in, 16) && aligned(out, 16);
    if (vec_ok)
        swiglu_forward_kernel<T, VEC><<<row_grid(rows), 128, 0, s>>>(rows, ffn, (const T *)in, prob, (T *)out);
    else
        swiglu_forward_kernel<T, 1><<<row_grid(rows), 128, 0, s>>>(rows, ffn, (const T *)in, prob, (T *)out);
    LAUNCH_CHECK("swiglu_forward_kernel");
    return MOERT_OK;
}

template <typename T>
static moert_result swiglu_backward_typed(cudaStream_t s, int64_t rows, int64_t ffn, const void *in, const float *prob,
                                          const void *d_out, void *d_in, float *d_prob)
{
    constexpr int VEC = 16 / sizeof(T);
    const bool vec_ok = ffn % VEC == 0 && aligned(in, 16) && aligned(d_out, 16) && aligned(d_in, 16);
    if (vec_ok)
        swiglu_backward_kernel<T, VEC>
            <<<row_grid(rows), 128, 0, s>>>(rows, ffn, (const T *)in, prob, (const T *)d_out, (T *)d_in, d_prob);
    else
        swiglu_backward_kernel<T, 1>
            <<<row_grid(rows), 128, 0, s>>>(rows, ffn, (const T *)in, prob, (const T *)d_out, (T *)d_in, d_prob);
    LAUNCH_CHECK("swiglu_backward_kernel");
    return MOERT_OK;
}

/* SwiGLU x prob forward: see kernels.h. */
extern "C" moert_result moert_cuda_swiglu_forward(cudaStream_t stream, moert_dtype dtype, int64_t rows, int64_t ffn,
                                                  const void *in, const float *prob, void *out)
{
    if (rows < 0 || ffn <= 0)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "swiglu forward: bad sizes rows %lld ffn %lld", (long long)rows,
                           (long long)ffn);
    if (rows == 0) return MOERT_OK;
    switch (dtype) {
    case MOERT_F32: return swiglu_forward_typed<float>(stream, rows, ffn, in, prob, out);
    case MOERT_BF16: return swiglu_forward_typed<__nv_bfloat16>(stream, rows, ffn, in, prob, out);
    default:
        return moert_error(MOERT_ERR_UNSUPPORTED, "swiglu forward on CUDA: dtype %s is not supported (fp32, bf16)",
                           moert_dtype_name(dtype));
    }
}

/* SwiGLU x prob backward: see kernels.h. */
extern "C" moert_result moert_cuda_swiglu_backward(cudaStream_t stream, moert_dtype dtype, int64_t rows, int64_t ffn,
                                                   const void *in, const float *prob, const void *d_out, void *d_in,
                                                   float *d_prob)
{
    if (rows < 0 || ffn <= 0)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "swiglu backward: bad sizes rows %lld ffn %lld", (long long)rows,
                           (long long)ffn);
    if (rows == 0) return MOERT_OK;
    switch (dtype) {
    case MOERT_F32: return swiglu_backward_typed<float>(stream, rows, ffn, in, prob, d_out, d_in, d_prob);
    case MOERT_BF16: return swiglu_backward_typed<__nv_bfloat16>(stream, rows, ffn, in, prob, d_out, d_in, d_prob);
    default:
        return moert_error(MOERT_ERR_UNSUPPORTED, "swiglu backward on CUDA: dtype %s is not supported (fp32, bf16)",
                           moert_dtype_name(dtype));
    }
}

/* ---- fill ---- */

/* ---- small copies ---- */

template <typename V> __global__ void copy_kernel(size_t n, V *__restrict__ dst, const V *__restrict__ src)
{
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        dst[i] = src[i];
}

extern "C" moert_result moert_cuda_copy_kernel(cudaStream_t stream, void *dst, const void *src, size_t bytes)
{
    if (bytes == 0) return MOERT_OK;
    const bool vec = ((uintptr_t)dst % 16 == 0) && ((uintptr_t)src % 16 == 0) && bytes % 16 == 0;
    const size_t n = vec ? bytes / 16 : bytes;
    size_t blocks = (n + BLOCK_THREADS - 1) / BLOCK_THREADS;
    if (blocks > 64) blocks = 64;
    if (vec)
        copy_kernel<uint4><<<(unsigned)blocks, BLOCK_THREADS, 0, stream>>>(n, (uint4 *)dst, (const uint4 *)src);
    else
        copy_kernel<unsigned char>
            <<<(unsigned)blocks, BLOCK_THREADS, 0, stream>>>(n, (unsigned char *)dst, (const unsigned char *)src);
    LAUNCH_CHECK("copy_kernel");
    return MOERT_OK;
}

template <typename T> __global__ void fill_kernel(int64_t n, double value, T *x)
{
    const T v = from_f64<T>(value);
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        x[i] = v;
}

template <typename T> static moert_result fill_typed(cudaStream_t s, int64_t n, double value, void *x)
{
    fill_kernel<T><<<grid_for(n), BLOCK_THREADS, 0, s>>>(n, value, (T *)x);
    LAUNCH_CHECK("fill_kernel");
    return MOERT_OK;
}

/* Fills n elements with value. */
extern "C" moert_result moert_cuda_fill(cudaStream_t stream, moert_dtype dtype, int64_t n, double value, void *x)
{
    if (n < 0) return moert_error(MOERT_ERR_INVALID_ARGUMENT, "fill: negative count %lld", (long long)n);
    if (n == 0) return MOERT_OK;
    switch (dtype) {
    case MOERT_F32: return fill_typed<float>(stream, n, value, x);
    case MOERT_BF16: return fill_typed<__nv_bfloat16>(stream, n, value, x);
    case MOERT_F64: return fill_typed<double>(stream, n, value, x);
    case MOERT_I32: return fill_typed<int32_t>(stream, n, value, x);
    case MOERT_I64: return fill_typed<int64_t>(stream, n, value, x);
    default:
        return moert_error(MOERT_ERR_UNSUPPORTED, "fill on CUDA: dtype %s is not supported", moert_dtype_name(dtype));
    }
}

/* ---- normal random fill: the counter-based generator of random.h, one element per thread ---- */

template <typename T>
__global__ void fill_normal_kernel(int64_t n, uint64_t seed, uint64_t stream, uint64_t first, double std, T *x)
{
    const int64_t step = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += step)
        x[i] = (T)(std * moert_normal_at(seed, stream, first + (uint64_t)i));
}

/* x[i] = std * normal(seed, stream, first + i): the same numbers as moert_fill_normal on the CPU. */
extern "C" moert_result moert_cuda_fill_normal(cudaStream_t s, moert_dtype dtype, int64_t n, uint64_t seed,
                                               uint64_t stream, uint64_t first, double std, void *x)
{
    if (n < 0) return moert_error(MOERT_ERR_INVALID_ARGUMENT, "fill_normal: negative count %lld", (long long)n);
    if (n == 0) return MOERT_OK;
    switch (dtype) {
    case MOERT_F32:
        fill_normal_kernel<float><<<grid_for(n), BLOCK_THREADS, 0, s>>>(n, seed, stream, first, std, (float *)x);
        break;
    case MOERT_F64:
        fill_normal_kernel<double><<<grid_for(n), BLOCK_THREADS, 0, s>>>(n, seed, stream, first, std, (double *)x);
        break;
    default:
        return moert_error(MOERT_ERR_UNSUPPORTED, "fill_normal on CUDA: dtype %s is not supported (fp32, fp64)",
                           moert_dtype_name(dtype));
    }
    LAUNCH_CHECK("fill_normal_kernel");
    return MOERT_OK;
}

/* ---- axpby and convert: element-wise over two arrays, VEC elements per access, scalar tail ---- */

template <typename TX, typename TY, int VEC>
__global__ void axpby_kernel(int64_t n, double a, const TX *__restrict__ x, double b, TY *__restrict__ y)
{
    /* fp64 arithmetic only when an operand is fp64 */
    constexpr bool wide = sizeof(TX) == 8 || sizeof(TY) == 8;
    const int64_t nvec = n / VEC;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < nvec; i += stride) {
        vec_t<TX, VEC> xv = load_vec<TX, VEC>(x + i * VEC);
        vec_t<TY, VEC> yv;
        if (b != 0.0) yv = load_vec<TY, VEC>(y + i * VEC);
#pragma unroll
        for (int k = 0; k < VEC; k++) {
            if constexpr (wide) {
                double r = a * to_f64(xv.v[k]) + (b != 0.0 ? b * to_f64(yv.v[k]) : 0.0);
                yv.v[k] = from_f64<TY>(r);
            } else {
                float r = (float)a * to_f32(xv.v[k]) + (b != 0.0 ? (float)b * to_f32(yv.v[k]) : 0.0f);
                yv.v[k] = from_f32<TY>(r);
            }
        }
        store_vec<TY, VEC>(y + i * VEC, yv);
    }
    for (int64_t i = nvec * VEC + blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += stride) {
        if constexpr (wide)
            y[i] = from_f64<TY>(a * to_f64(x[i]) + (b != 0.0 ? b * to_f64(y[i]) : 0.0));
        else
            y[i] = from_f32<TY>((float)a * to_f32(x[i]) + (b != 0.0 ? (float)b * to_f32(y[i]) : 0.0f));
    }
}

template <typename TX, typename TY>
static moert_result axpby_typed(cudaStream_t s, int64_t n, double a, const void *x, double b, void *y)
{
    constexpr int VEC = 16 / (sizeof(TX) > sizeof(TY) ? sizeof(TX) : sizeof(TY));
    if (aligned(x, VEC * sizeof(TX)) && aligned(y, VEC * sizeof(TY)))
        axpby_kernel<TX, TY, VEC><<<grid_for(n / VEC + 1), BLOCK_THREADS, 0, s>>>(n, a, (const TX *)x, b, (TY *)y);
    else
        axpby_kernel<TX, TY, 1><<<grid_for(n), BLOCK_THREADS, 0, s>>>(n, a, (const TX *)x, b, (TY *)y);
    LAUNCH_CHECK("axpby_kernel");
    return MOERT_OK;
}

template <typename TX>
static moert_result axpby_y(cudaStream_t s, int64_t n, double a, const void *x, double b, moert_dtype yt, void *y)
{
    switch (yt) {
    case MOERT_F32: return axpby_typed<TX, float>(s, n, a, x, b, y);
    case MOERT_BF16: return axpby_typed<TX, __nv_bfloat16>(s, n, a, x, b, y);
    case MOERT_F64: return axpby_typed<TX, double>(s, n, a, x, b, y);
    default:
        return moert_error(MOERT_ERR_UNSUPPORTED, "axpby on CUDA: y dtype %s is not supported (fp32, bf16, fp64)",
                           moert_dtype_name(yt));
    }
}

/* y = a x + b y. */
extern "C" moert_result moert_cuda_axpby(cudaStream_t stream, int64_t n, double a, moert_dtype x_dtype, const void *x,
                                         double b, moert_dtype y_dtype, void *y)
{
    if (n < 0) return moert_error(MOERT_ERR_INVALID_ARGUMENT, "axpby: negative count %lld", (long long)n);
    if (n == 0) return MOERT_OK;
    switch (x_dtype) {
    case MOERT_F32: return axpby_y<float>(stream, n, a, x, b, y_dtype, y);
    case MOERT_BF16: return axpby_y<__nv_bfloat16>(stream, n, a, x, b, y_dtype, y);
    case MOERT_F64: return axpby_y<double>(stream, n, a, x, b, y_dtype, y);
    default:
        return moert_error(MOERT_ERR_UNSUPPORTED, "axpby on CUDA: x dtype %s is not supported (fp32, bf16, fp64)",
                           moert_dtype_name(x_dtype));
    }
}

/* y += a x. */
extern "C" moert_result moert_cuda_axpy(cudaStream_t stream, int64_t n, double a, moert_dtype x_dtype, const void *x,
                                        moert_dtype y_dtype, void *y)
{
    return moert_cuda_axpby(stream, n, a, x_dtype, x, 1.0, y_dtype, y);
}

/* dst = src converted: axpby with a = 1, b = 0 (b = 0 never reads dst). */
extern "C" moert_result moert_cuda_convert(cudaStream_t stream, int64_t n, moert_dtype src_dtype, const void *src,
                                           moert_dtype dst_dtype, void *dst)
{
    return moert_cuda_axpby(stream, n, 1.0, src_dtype, src, 0.0, dst_dtype, dst);
}

/* ---- the shared expert's gate: prob[t] = sigmoid(x[t] . g), and its backward ---- */

/* One block per token: the dot product in fp32, a block-wide sum in a fixed order. */
template <typename T>
__global__ void gate_forward_kernel(int64_t tokens, int64_t hidden, const T *x, const float *gate, float *prob)
{
    for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
        float acc = 0.f;
        for (int64_t h = threadIdx.x; h < hidden; h += blockDim.x) acc += to_f32(x[t * hidden + h]) * gate[h];
        acc = block_sum<float>(acc);
        if (threadIdx.x == 0) prob[t] = 1.f / (1.f + expf(-acc));
    }
}

/* d_x[t, h] += d_logit[t] * g[h], with d_logit = d_prob * p * (1 - p). */
template <typename T>
__global__ void gate_backward_x_kernel(int64_t tokens, int64_t hidden, const float *gate, const float *prob,
                                       const float *d_prob, T *d_x)
{
    const int64_t n = tokens * hidden;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t t = i / hidden, h = i % hidden;
        const float p = prob[t], d_logit = d_prob[t] * p * (1.f - p);
        d_x[i] = from_f32<T>(to_f32(d_x[i]) + d_logit * gate[h]);
    }
}

/* d_g[h] += sum over tokens of d_logit[t] * x[t, h]: a thread per column, tokens in order. */
template <typename T>
__global__ void gate_backward_g_kernel(int64_t tokens, int64_t hidden, const T *x, const float *prob,
                                       const float *d_prob, float *d_gate)
{
    for (int64_t h = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; h < hidden; h += (int64_t)gridDim.x * blockDim.x) {
        float acc = 0.f;
        for (int64_t t = 0; t < tokens; t++) {
            const float p = prob[t];
            acc += d_prob[t] * p * (1.f - p) * to_f32(x[t * hidden + h]);
        }
        d_gate[h] += acc;
    }
}

extern "C" moert_result moert_cuda_gate_forward(cudaStream_t stream, moert_dtype dtype, int64_t tokens, int64_t hidden,
                                                const void *x, const float *gate, float *prob)
{
    if (tokens == 0) return MOERT_OK;
    int blocks = (int)(tokens < MAX_GRID_BLOCKS ? tokens : MAX_GRID_BLOCKS);
    switch (dtype) {
    case MOERT_F32:
        gate_forward_kernel<float><<<blocks, BLOCK_THREADS, 0, stream>>>(tokens, hidden, (const float *)x, gate, prob);
        break;
    case MOERT_BF16:
        gate_forward_kernel<__nv_bfloat16>
            <<<blocks, BLOCK_THREADS, 0, stream>>>(tokens, hidden, (const __nv_bfloat16 *)x, gate, prob);
        break;
    default:
        return moert_error(MOERT_ERR_UNSUPPORTED, "shared expert gate on CUDA: dtype %s is not supported (fp32, bf16)",
                           moert_dtype_name(dtype));
    }
    LAUNCH_CHECK("gate_forward_kernel");
    return MOERT_OK;
}

extern "C" moert_result moert_cuda_gate_backward(cudaStream_t stream, moert_dtype dtype, int64_t tokens, int64_t hidden,
                                                 const void *x, const float *gate, const float *prob,
                                                 const float *d_prob, void *d_x, float *d_gate)
{
    if (tokens == 0) return MOERT_OK;
    switch (dtype) {
    case MOERT_F32:
        gate_backward_x_kernel<float>
            <<<grid_for(tokens * hidden), BLOCK_THREADS, 0, stream>>>(tokens, hidden, gate, prob, d_prob, (float *)d_x);
        LAUNCH_CHECK("gate_backward_x_kernel");
        gate_backward_g_kernel<float>
            <<<grid_for(hidden), BLOCK_THREADS, 0, stream>>>(tokens, hidden, (const float *)x, prob, d_prob, d_gate);
        break;
    case MOERT_BF16:
        gate_backward_x_kernel<__nv_bfloat16><<<grid_for(tokens * hidden), BLOCK_THREADS, 0, stream>>>(
            tokens, hidden, gate, prob, d_prob, (__nv_bfloat16 *)d_x);
        LAUNCH_CHECK("gate_backward_x_kernel");
        gate_backward_g_kernel<__nv_bfloat16><<<grid_for(hidden), BLOCK_THREADS, 0, stream>>>(
            tokens, hidden, (const __nv_bfloat16 *)x, prob, d_prob, d_gate);
        break;
    default:
        return moert_error(MOERT_ERR_UNSUPPORTED, "shared expert gate on CUDA: dtype %s is not supported (fp32, bf16)",
                           moert_dtype_name(dtype));
    }
    LAUNCH_CHECK("gate_backward_g_kernel");
    return MOERT_OK;
}
