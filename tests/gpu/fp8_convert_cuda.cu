/* SPDX-License-Identifier: Apache-2.0 */
/* CUDA's own FP8 conversions of every bf16 bit pattern, for tests/gpu/test_fp8_convert.c. */
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

__global__ void convert_all_bf16(uint8_t *e4m3, uint8_t *e5m2)
{
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= 65536) return;
    __nv_bfloat16_raw raw;
    raw.x = (unsigned short)i;
    e4m3[i] = __nv_cvt_bfloat16raw_to_fp8(raw, __NV_SATFINITE, __NV_E4M3);
    e5m2[i] = __nv_cvt_bfloat16raw_to_fp8(raw, __NV_SATFINITE, __NV_E5M2);
}

/* Fills e4m3[65536] and e5m2[65536] (host arrays) with CUDA's conversions; returns a cudaError_t value. */
extern "C" int moert_test_cuda_fp8_of_all_bf16(uint8_t *e4m3, uint8_t *e5m2)
{
    uint8_t *d = NULL;
    cudaError_t err = cudaMalloc(&d, 2 * 65536);
    if (err != cudaSuccess) return (int)err;
    convert_all_bf16<<<256, 256>>>(d, d + 65536);
    err = cudaGetLastError();
    if (err == cudaSuccess) err = cudaMemcpy(e4m3, d, 65536, cudaMemcpyDeviceToHost);
    if (err == cudaSuccess) err = cudaMemcpy(e5m2, d + 65536, 65536, cudaMemcpyDeviceToHost);
    cudaFree(d);
    return (int)err;
}
