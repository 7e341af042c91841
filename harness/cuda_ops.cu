/* SPDX-License-Identifier: Apache-2.0 */
/* The trainer's CUDA work: its loss and optimizer kernels (the same arithmetic as the core's element-wise kernels
 * were, so a run's losses stay the same bits) and thin runtime calls. */
#include "cuda_ops.h"

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <math.h>

#define BLOCK_THREADS      256
#define MAX_GRID_BLOCKS    4096
#define SUM_SQUARES_BLOCKS 1024 /* fixed, so the reduction tree does not depend on the GPU */
#define SUM_SQUARES_BYTES  ((size_t)(SUM_SQUARES_BLOCKS * sizeof(float)))

/* A failed CUDA call's message, naming it. */
static moert_result cuda_failed(const char *what, cudaError_t err)
{
    (void)cudaGetLastError();
    return moert_set_last_error(MOERT_ERR_CUDA, "%s failed: %s", what, cudaGetErrorString(err));
}

#define CUDA_CALL(call)                                                                                                \
    do {                                                                                                               \
        cudaError_t err_ = (call);                                                                                     \
        if (err_ != cudaSuccess) return cuda_failed(#call, err_);                                                      \
    } while (0)

#define LAUNCH_CHECK(name)                                                                                             \
    do {                                                                                                               \
        cudaError_t err_ = cudaGetLastError();                                                                         \
        if (err_ != cudaSuccess) return cuda_failed(name "<<<>>>", err_);                                              \
    } while (0)

extern "C" moert_result trainer_cuda_device_count(int *count)
{
    *count = 0;
    cudaError_t err = cudaGetDeviceCount(count);
    if (err != cudaSuccess) {
        *count = 0;
        return cuda_failed("cudaGetDeviceCount", err);
    }
    return MOERT_OK;
}

extern "C" moert_result trainer_cuda_device_name(int device, char *buf, size_t size)
{
    cudaDeviceProp prop;
    CUDA_CALL(cudaGetDeviceProperties(&prop, device));
    snprintf(buf, size, "%s", prop.name);
    return MOERT_OK;
}

extern "C" moert_result trainer_cuda_set_device(int device)
{
    CUDA_CALL(cudaSetDevice(device));
    return MOERT_OK;
}

/* Where the device sees p: its device pointer when it is memory of the current device (*on_device true) or pinned host
 * memory (false); NULL for pageable host memory, another device's memory, or an unknown pointer. */
static void *device_view(const void *p, int device, bool *on_device)
{
    struct cudaPointerAttributes a;
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    *on_device = a.type == cudaMemoryTypeDevice;
    if (a.type == cudaMemoryTypeDevice && a.device == device) return a.devicePointer;
    if (a.type == cudaMemoryTypeHost) return a.devicePointer;
    return NULL;
}

/* Copies between device memory and pinned host memory of at most this many bytes go through a kernel instead of the
 * copy engine, as the core's do: a copy engine serves the copies of all streams in the order they were issued, so a
 * small copy the step waits on (the loss) would otherwise queue behind an offload's hundreds of MB. */
#define SMALL_COPY_BYTES (256u << 10)

static __global__ void copy_bytes_kernel(size_t n, unsigned char *__restrict__ dst,
                                         const unsigned char *__restrict__ src)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        dst[i] = src[i];
}

extern "C" moert_result trainer_cuda_copy(void *dst, const void *src, size_t bytes, moert_stream s)
{
    if (bytes == 0) return MOERT_OK;
    if (bytes <= SMALL_COPY_BYTES) {
        int device = -1;
        bool dst_dev = false, src_dev = false;
        CUDA_CALL(cudaGetDevice(&device));
        void *d = device_view(dst, device, &dst_dev);
        const void *v = device_view(src, device, &src_dev);
        if (d && v && dst_dev != src_dev) {
            const int blocks = (int)((bytes + BLOCK_THREADS - 1) / BLOCK_THREADS);
            copy_bytes_kernel<<<blocks, BLOCK_THREADS, 0, (cudaStream_t)s>>>(bytes, (unsigned char *)d,
                                                                             (const unsigned char *)v);
            cudaError_t err = cudaGetLastError();
            if (err != cudaSuccess) return cuda_failed("copy_bytes_kernel<<<>>>", err);
            return MOERT_OK;
        }
    }
    CUDA_CALL(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, (cudaStream_t)s));
    return MOERT_OK;
}

extern "C" moert_result trainer_cuda_sync(moert_stream s)
{
    CUDA_CALL(cudaStreamSynchronize((cudaStream_t)s));
    return MOERT_OK;
}

extern "C" moert_result trainer_cuda_zero(void *ptr, size_t bytes, moert_stream s)
{
    if (bytes == 0) return MOERT_OK;
    CUDA_CALL(cudaMemsetAsync(ptr, 0, bytes, (cudaStream_t)s));
    return MOERT_OK;
}

/* The kernels and their helpers have internal linkage: the core's kernels of the same names are linked beside them. */
namespace {

/* ---- element access ---- */

template <typename T, int N> struct alignas(sizeof(T) * N) vec_t {
    T v[N];
};

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ double to_f64(float x) { return x; }
__device__ __forceinline__ double to_f64(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ double to_f64(double x) { return x; }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

template <typename T> __device__ __forceinline__ T from_f64(double x);
template <> __device__ __forceinline__ float from_f64<float>(double x) { return (float)x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f64<__nv_bfloat16>(double x) { return __double2bfloat16(x); }
template <> __device__ __forceinline__ double from_f64<double>(double x) { return x; }

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

/* ---- axpby: element-wise over two arrays, VEC elements per access, scalar tail ---- */

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
        return moert_set_last_error(MOERT_ERR_UNSUPPORTED,
                                    "axpby on CUDA: y dtype %s is not supported (fp32, bf16, fp64)",
                                    moert_dtype_name(yt));
    }
}

} // namespace

extern "C" moert_result trainer_cuda_axpby(moert_stream stream, int64_t n, double a, moert_dtype x_dtype, const void *x,
                                           double b, moert_dtype y_dtype, void *y)
{
    cudaStream_t s = (cudaStream_t)stream;
    if (n < 0) return moert_set_last_error(MOERT_ERR_INVALID_ARGUMENT, "axpby: negative count %lld", (long long)n);
    if (n == 0) return MOERT_OK;
    switch (x_dtype) {
    case MOERT_F32: return axpby_y<float>(s, n, a, x, b, y_dtype, y);
    case MOERT_BF16: return axpby_y<__nv_bfloat16>(s, n, a, x, b, y_dtype, y);
    case MOERT_F64: return axpby_y<double>(s, n, a, x, b, y_dtype, y);
    default:
        return moert_set_last_error(MOERT_ERR_UNSUPPORTED,
                                    "axpby on CUDA: x dtype %s is not supported (fp32, bf16, fp64)",
                                    moert_dtype_name(x_dtype));
    }
}

namespace {

/* ---- the squared error: a fixed grid of per-block partials, then one block over the partials ---- */

template <typename T>
__global__ void sum_squares_partial_kernel(int64_t n, const T *__restrict__ x, const T *__restrict__ y,
                                           float *__restrict__ partials)
{
    float acc = 0.0f;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        float d = to_f32(x[i]) - (y ? to_f32(y[i]) : 0.0f);
        acc += d * d;
    }
    float total = block_sum<float>(acc);
    if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

__global__ void sum_partials_kernel(int count, const float *__restrict__ partials, float *__restrict__ result)
{
    float acc = 0.0f;
    for (int i = threadIdx.x; i < count; i += blockDim.x) acc += partials[i];
    float total = block_sum<float>(acc);
    if (threadIdx.x == 0) *result = total;
}

} // namespace

extern "C" moert_result trainer_cuda_squared_error(moert_stream stream, moert_dtype dtype, int64_t n, const void *pred,
                                                   const void *target, double scale, moert_dtype grad_dtype, void *grad,
                                                   void *workspace, float *pinned_result, double *sum)
{
    cudaStream_t s = (cudaStream_t)stream;
    if (n < 0)
        return moert_set_last_error(MOERT_ERR_INVALID_ARGUMENT, "squared_error: negative count %lld", (long long)n);
    float *partials = (float *)workspace;
    float *dev_result = (float *)((char *)workspace + SUM_SQUARES_BYTES);
    switch (dtype) {
    case MOERT_F32:
        sum_squares_partial_kernel<float>
            <<<SUM_SQUARES_BLOCKS, BLOCK_THREADS, 0, s>>>(n, (const float *)pred, (const float *)target, partials);
        break;
    case MOERT_BF16:
        sum_squares_partial_kernel<__nv_bfloat16><<<SUM_SQUARES_BLOCKS, BLOCK_THREADS, 0, s>>>(
            n, (const __nv_bfloat16 *)pred, (const __nv_bfloat16 *)target, partials);
        break;
    default:
        return moert_set_last_error(MOERT_ERR_UNSUPPORTED,
                                    "squared_error on CUDA: dtype %s is not supported (fp32, bf16)",
                                    moert_dtype_name(dtype));
    }
    LAUNCH_CHECK("sum_squares_partial_kernel");
    sum_partials_kernel<<<1, BLOCK_THREADS, 0, s>>>(SUM_SQUARES_BLOCKS, partials, dev_result);
    LAUNCH_CHECK("sum_partials_kernel");
    float stack_result = 0.0f, *result = pinned_result ? pinned_result : &stack_result;
    moert_result copied = trainer_cuda_copy(result, dev_result, sizeof *result, stream);
    if (copied != MOERT_OK) return copied;
    CUDA_CALL(cudaStreamSynchronize(s));
    *sum = *result;
    if (grad) {
        moert_result rc = trainer_cuda_axpby(stream, n, 2.0 * scale, dtype, pred, 0.0, grad_dtype, grad);
        if (rc == MOERT_OK) rc = trainer_cuda_axpby(stream, n, -2.0 * scale, dtype, target, 1.0, grad_dtype, grad);
        if (rc != MOERT_OK) return rc;
    }
    return MOERT_OK;
}

namespace {

/* ---- Adam ---- */

template <typename TG>
__global__ void adam_kernel(int64_t n, float lr, float beta1, float one_minus_beta1, float beta2, float one_minus_beta2,
                            float eps, float decay_factor, float grad_scale, float inv_bc1, float inv_sqrt_bc2,
                            float *__restrict__ param, const TG *__restrict__ grad, float *__restrict__ m,
                            float *__restrict__ v)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        float g = to_f32(grad[i]) * grad_scale;
        /* 1 - beta comes from the host in double: 1.0f - 0.999f is off by 5e-5 relative */
        float mi = beta1 * m[i] + one_minus_beta1 * g;
        float vi = beta2 * v[i] + one_minus_beta2 * g * g;
        m[i] = mi;
        v[i] = vi;
        /* m_hat / (sqrt(v_hat) + eps), with v_hat = v / bc2: sqrt(v_hat) = sqrt(v) / sqrt(bc2) */
        float update = (mi * inv_bc1) / (sqrtf(vi) * inv_sqrt_bc2 + eps);
        param[i] = param[i] * decay_factor - lr * update;
    }
}

} // namespace

extern "C" moert_result trainer_cuda_adam(moert_stream stream, int64_t n, int64_t step, double lr, double beta1,
                                          double beta2, double eps, double weight_decay, float *param,
                                          moert_dtype grad_dtype, const void *grad, float *m, float *v)
{
    cudaStream_t s = (cudaStream_t)stream;
    if (n < 0 || step < 1)
        return moert_set_last_error(MOERT_ERR_INVALID_ARGUMENT, "adam: bad arguments (n %lld, step %lld)", (long long)n,
                                    (long long)step);
    if (n == 0) return MOERT_OK;
    const double bc1 = 1.0 - pow(beta1, (double)step);
    const double bc2 = 1.0 - pow(beta2, (double)step);
    const float inv_bc1 = (float)(1.0 / bc1), inv_sqrt_bc2 = (float)(1.0 / sqrt(bc2));
    const float decay = (float)(1.0 - lr * weight_decay);
    const float scale = 1.0f;
    switch (grad_dtype) {
    case MOERT_F32:
        adam_kernel<float><<<grid_for(n), BLOCK_THREADS, 0, s>>>(
            n, (float)lr, (float)beta1, (float)(1.0 - beta1), (float)beta2, (float)(1.0 - beta2), (float)eps, decay,
            scale, inv_bc1, inv_sqrt_bc2, param, (const float *)grad, m, v);
        break;
    case MOERT_BF16:
        adam_kernel<__nv_bfloat16><<<grid_for(n), BLOCK_THREADS, 0, s>>>(
            n, (float)lr, (float)beta1, (float)(1.0 - beta1), (float)beta2, (float)(1.0 - beta2), (float)eps, decay,
            scale, inv_bc1, inv_sqrt_bc2, param, (const __nv_bfloat16 *)grad, m, v);
        break;
    default:
        return moert_set_last_error(MOERT_ERR_UNSUPPORTED,
                                    "adam on CUDA: gradient dtype %s is not supported (fp32, bf16)",
                                    moert_dtype_name(grad_dtype));
    }
    LAUNCH_CHECK("adam_kernel");
    return MOERT_OK;
}
