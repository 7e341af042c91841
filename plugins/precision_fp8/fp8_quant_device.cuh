/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Device helpers of the fp8 quantization kernels (fp8_quant_kernels.cu, fp8_weight_kernels.cu): loads widened to
 * fp32, amaxes as bits, fp8_scale_from_amax's formula, the saturating casts and the block-scale layouts. They follow
 * precision_fp8_cpu.c number for number, so the GPU's bytes and scales equal the CPU reference's.
 */
#ifndef MOERT_FP8_QUANT_DEVICE_CUH
#define MOERT_FP8_QUANT_DEVICE_CUH

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <float.h>
#include <stdint.h>

#include "precision_fp8_cuda_internal.h"

/* One element widened to fp32 (exact for bf16). */
__device__ __forceinline__ float load_f(const __nv_bfloat16 *p) { return __bfloat162float(*p); }
__device__ __forceinline__ float load_f(const float *p) { return *p; }

/* Four consecutive elements (8- or 16-byte aligned). */
__device__ __forceinline__ void load4(const __nv_bfloat16 *p, float v[4])
{
    const uint2 u = *(const uint2 *)p;
    const __nv_bfloat162 lo = *(const __nv_bfloat162 *)&u.x, hi = *(const __nv_bfloat162 *)&u.y;
    v[0] = __low2float(lo);
    v[1] = __high2float(lo);
    v[2] = __low2float(hi);
    v[3] = __high2float(hi);
}
__device__ __forceinline__ void load4(const float *p, float v[4])
{
    const float4 u = *(const float4 *)p;
    v[0] = u.x;
    v[1] = u.y;
    v[2] = u.z;
    v[3] = u.w;
}

/* |x| as bits: ordered like |x| for numbers, and every NaN above inf (so a NaN amax sticks). */
__device__ __forceinline__ uint32_t abs_bits(float x) { return __float_as_uint(x) & 0x7fffffffu; }

/* fp8_scale_from_amax (precision_fp8_cpu.c), the same operations. */
static __device__ float scale_from_amax(float amax, float fp8max, int margin, int pow2, float fallback)
{
    if (!(amax > 0.0f) || isinf(amax)) return fallback;
    const double s = ldexp(__ddiv_rn((double)fp8max, (double)amax), -margin);
    float scale = s > (double)FLT_MAX ? FLT_MAX : __double2float_rn(s);
    if (!(scale > 0.0f)) scale = __uint_as_float(1u); /* FLT_TRUE_MIN */
    if (pow2) {
        int exponent;
        (void)frexpf(scale, &exponent);
        scale = ldexpf(1.0f, exponent - 1);
    }
    return scale;
}

/* q = fp8(fp32(x * scale)), saturating (CUDA's __NV_SATFINITE), E4M3 (fmt 0) or E5M2 (fmt 1). */
__device__ __forceinline__ uint8_t to_fp8(float x, float scale, int fmt)
{
    return (uint8_t)__nv_cvt_float_to_fp8(__fmul_rn(x, scale), __NV_SATFINITE, fmt ? __NV_E5M2 : __NV_E4M3);
}

/* to_fp8 of four values, packed a first (lowest byte): two paired conversions (cvt ... e4m3x2), the same bytes. */
__device__ __forceinline__ uint32_t to_fp8x4(float a, float b, float c, float d, float scale, int fmt)
{
    const __nv_fp8_interpretation_t f = fmt ? __NV_E5M2 : __NV_E4M3;
    const uint32_t lo =
        __nv_cvt_float2_to_fp8x2(make_float2(__fmul_rn(a, scale), __fmul_rn(b, scale)), __NV_SATFINITE, f);
    const uint32_t hi =
        __nv_cvt_float2_to_fp8x2(make_float2(__fmul_rn(c, scale), __fmul_rn(d, scale)), __NV_SATFINITE, f);
    return lo | hi << 16;
}

/* Index of the VEC128 factor of element (x, block kb) of an operand [X][k] with KB blocks along k. */
__host__ __device__ __forceinline__ int64_t vec_index(int layout, int64_t x, int64_t kb, int64_t X, int64_t KB)
{
    return layout == MOERT_FP8_VEC128_X_MAJOR ? x + kb * X : kb + x * KB;
}

/* Index of the BLK128x128 factor of tile (xb, kb) with XB x KB tiles. */
__host__ __device__ __forceinline__ int64_t blk_index(int layout, int64_t xb, int64_t kb, int64_t XB, int64_t KB)
{
    switch (layout) {
    case MOERT_FP8_BLK_K_MAJOR_PAD4: return kb + xb * ((KB + 3) / 4 * 4);
    case MOERT_FP8_BLK_X_MAJOR_PAD4: return xb + kb * ((XB + 3) / 4 * 4);
    case MOERT_FP8_BLK_K_MAJOR: return kb + xb * KB;
    default: return xb + kb * XB;
    }
}

/* Largest of the block's values, into *out by atomicMax (out may be NULL). */
static __device__ void block_max_to(uint32_t v, uint32_t *out)
{
    __shared__ uint32_t warp_max[32];
    v = __reduce_max_sync(0xffffffffu, v);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) warp_max[warp] = v;
    __syncthreads();
    if (warp == 0) {
        const int warps = (blockDim.x + 31) >> 5;
        uint32_t m = lane < warps ? warp_max[lane] : 0u;
        m = __reduce_max_sync(0xffffffffu, m);
        if (lane == 0 && out) atomicMax(out, m);
    }
}

#endif
