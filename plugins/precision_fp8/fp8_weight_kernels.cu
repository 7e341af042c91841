/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The fp8 recipes' weight and delayed-scaling kernels, each with its launcher (precision_fp8_cuda_internal.h):
 *   tile_scales_kernel     128x128 tile scales of the weights, written in both weight layouts
 *   weight_layouts_kernel  both FP8 layouts of a weight in one read (and its 128x128 tile scales, blockwise)
 *   note_kernel / end_step_kernel   the delayed recipe's step amax and history, on the device
 *   fill_kernel            a float array set to one value (the delayed recipe's first scales)
 * The numbers are precision_fp8_cpu.c's (see fp8_quant_kernels.cu).
 */
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "fp8_quant_device.cuh"

/*
 * Tile (kb, nb) of expert e's weight, every thread of the block calling with its part m of the tile's amax (bits of
 * |x|): the tile's scale, returned to every thread, stored into tile_scale (row-major [KB][NB] per expert), and its
 * 1/scale into inv_fwd (operand [N][K]: x = n) and inv_dgrad (operand [K][N]: x = k) where given.
 */
__device__ float tile_scale_of_block(uint32_t m, int64_t e, int64_t kb, int64_t nb, int64_t KB, int64_t NB,
                                     float fp8max, int pow2, int layout, float *tile_scale, int64_t tile_stride,
                                     float *inv_fwd, float *inv_dgrad, int64_t blk_stride)
{
    __shared__ uint32_t tile_max;
    __shared__ float tile_sc;
    if (threadIdx.x == 0) tile_max = 0;
    __syncthreads();
    block_max_to(m, &tile_max);
    __syncthreads();
    if (threadIdx.x == 0) {
        const float sc = scale_from_amax(__uint_as_float(tile_max), fp8max, 0, pow2, 1.0f);
        const float inv = __fdiv_rn(1.0f, sc);
        tile_scale[e * tile_stride + kb * NB + nb] = sc;
        if (inv_fwd) inv_fwd[e * blk_stride + blk_index(layout, nb, kb, NB, KB)] = inv;
        if (inv_dgrad) inv_dgrad[e * blk_stride + blk_index(layout, kb, nb, KB, NB)] = inv;
        tile_sc = sc;
    }
    __syncthreads();
    return tile_sc;
}

/*
 * Both FP8 layouts of weight [E][K][N] in one read, a 128x128 tile per block (grid (NB, KB, E), 256 threads): dgrad
 * [K][N] as stored and fwd [N][K] (each expert's transpose), with the per-tensor scale (scale[4 * e]) or, when
 * tile_scale is given, the tile's own scale computed here as tile_scales_kernel does (and written with its 1/scale
 * into inv_fwd / inv_dgrad). A thread holds 16 consecutive rows of 4 columns: it writes each row's 4 bytes into dgrad
 * and, transposed in registers, each column's 16 bytes into fwd. K and N are multiples of 16.
 */
template <typename T>
__global__ void __launch_bounds__(256)
    weight_layouts_kernel(const T *__restrict__ w, int64_t K, int64_t N, const float *scale, float fp8max, int pow2,
                          int layout, float *tile_scale, int64_t tile_stride, float *inv_fwd, float *inv_dgrad,
                          int64_t blk_stride, uint8_t *__restrict__ fwd, uint8_t *__restrict__ dgrad)
{
    const int64_t nb = blockIdx.x, kb = blockIdx.y, e = blockIdx.z, NB = gridDim.x, KB = gridDim.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t n0 = nb * TILE + lane * 4, k0 = kb * TILE + warp * 16;
    const T *base = w + e * K * N;
    float v[16][4];
    uint32_t m = 0;
#pragma unroll
    for (int j = 0; j < 16; j++) {
#pragma unroll
        for (int c = 0; c < 4; c++) v[j][c] = 0.0f;
        if (k0 + j < K && n0 < N) load4(base + (k0 + j) * N + n0, v[j]);
#pragma unroll
        for (int c = 0; c < 4; c++) m = max(m, abs_bits(v[j][c]));
    }
    const float sc = tile_scale ? tile_scale_of_block(m, e, kb, nb, KB, NB, fp8max, pow2, layout, tile_scale,
                                                      tile_stride, inv_fwd, inv_dgrad, blk_stride)
                                : scale[4 * e];
    uint32_t rows[16]; /* row j's 4 bytes, column c in byte c */
#pragma unroll
    for (int j = 0; j < 16; j++) {
        rows[j] = 0;
#pragma unroll
        for (int c = 0; c < 4; c++) rows[j] |= (uint32_t)to_fp8(v[j][c], sc, 0) << (8 * c);
    }
    if (n0 < N)
#pragma unroll
        for (int j = 0; j < 16; j++)
            if (k0 + j < K) *(uint32_t *)(dgrad + e * K * N + (k0 + j) * N + n0) = rows[j];
    if (k0 < K)
#pragma unroll
        for (int c = 0; c < 4; c++) {
            if (n0 + c >= N) break;
            uint32_t col[4]; /* column c's bytes of rows 4q .. 4q + 3 */
#pragma unroll
            for (int q = 0; q < 4; q++)
                col[q] = ((rows[4 * q] >> (8 * c)) & 0xffu) | (((rows[4 * q + 1] >> (8 * c)) & 0xffu) << 8) |
                         (((rows[4 * q + 2] >> (8 * c)) & 0xffu) << 16) |
                         (((rows[4 * q + 3] >> (8 * c)) & 0xffu) << 24);
            *(uint4 *)(fwd + e * K * N + (n0 + c) * K + k0) = make_uint4(col[0], col[1], col[2], col[3]);
        }
}

/*
 * 128x128 tile scales of weight [E][K][N]: scale into tile_scale[e][kb][nb] (row-major, tile_stride floats per
 * expert); 1/scale into inv_fwd (operand [N][K]: x = n) and inv_dgrad (operand [K][N]: x = k), blk_stride floats
 * per expert each. Grid (NB, KB, E), 256 threads.
 */
template <typename T>
__global__ void tile_scales_kernel(const T *__restrict__ w, int64_t K, int64_t N, float fp8max, int pow2, int layout,
                                   float *tile_scale, int64_t tile_stride, float *inv_fwd, float *inv_dgrad,
                                   int64_t blk_stride)
{
    const int64_t nb = blockIdx.x, kb = blockIdx.y, e = blockIdx.z;
    const int64_t NB = gridDim.x, KB = gridDim.y;
    const T *base = w + e * K * N;
    const int col = threadIdx.x & 127, half = threadIdx.x >> 7;
    const int64_t c = nb * TILE + col;
    uint32_t m = 0;
    if (c < N)
        for (int64_t r = kb * TILE + half; r < K && r < (kb + 1) * TILE; r += 2)
            m = max(m, abs_bits(load_f(base + r * N + c)));
    tile_scale_of_block(m, e, kb, nb, KB, NB, fp8max, pow2, layout, tile_scale, tile_stride, inv_fwd, inv_dgrad,
                        blk_stride);
}

/* Delayed recipe: a cached weight's amax counts for the experts this GEMM uses (slot = max(slot, amax)). */
__global__ void note_kernel(const mat_table t, const uint32_t *amax_bits, uint32_t *slot_amax, int *slot_seen)
{
    const int i = threadIdx.x;
    if (i >= t.count) return;
    const int e = t.expert[i];
    atomicMax(&slot_amax[e], amax_bits[e]);
    slot_seen[e] = 1;
}

/* Delayed recipe, after the optimizer step: fp8_delayed_end_step (precision_fp8_cpu.c) for every slot. */
__global__ void end_step_kernel(int64_t slots, int64_t experts, int64_t len, float *history, int32_t *next,
                                int32_t *filled, float *scale, uint32_t *step_amax, int *seen, int most_recent,
                                int margin, int pow2, int hybrid)
{
    const int64_t s = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= slots || !seen[s]) return;
    float *h = history + s * len;
    const int32_t newest = next[s];
    h[newest] = __uint_as_float(step_amax[s]);
    next[s] = (int32_t)((newest + 1) % len);
    if (filled[s] < len) filled[s]++;
    uint32_t m = abs_bits(h[newest]);
    if (!most_recent)
        for (int32_t j = 0; j < filled[s]; j++) m = max(m, abs_bits(h[j]));
    const int operand = (int)((s / experts) % 3);
    const float fp8max = hybrid && operand == OP_GRAD ? E5M2_MAX : E4M3_MAX;
    scale[s] = scale_from_amax(__uint_as_float(m), fp8max, margin, pow2, scale[s]);
    seen[s] = 0;
    step_amax[s] = 0;
}

/* p[i] = v for i < n. */
__global__ void fill_kernel(float *p, int64_t n, float v)
{
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] = v;
}

/* ---- launchers (precision_fp8_cuda_internal.h) ---- */

void fp8_launch_weight_layouts_kernel(dim3 grid, dim3 block, cudaStream_t stream, int bf16, const void *w, int64_t K,
                                      int64_t N, const float *scale, float fp8max, int pow2, int layout,
                                      float *tile_scale, int64_t tile_stride, float *inv_fwd, float *inv_dgrad,
                                      int64_t blk_stride, uint8_t *fwd, uint8_t *dgrad)
{
    if (bf16)
        weight_layouts_kernel<<<grid, block, 0, stream>>>((const __nv_bfloat16 *)w, K, N, scale, fp8max, pow2, layout,
                                                          tile_scale, tile_stride, inv_fwd, inv_dgrad, blk_stride, fwd,
                                                          dgrad);
    else
        weight_layouts_kernel<<<grid, block, 0, stream>>>((const float *)w, K, N, scale, fp8max, pow2, layout,
                                                          tile_scale, tile_stride, inv_fwd, inv_dgrad, blk_stride, fwd,
                                                          dgrad);
}

void fp8_launch_tile_scales_kernel(dim3 grid, dim3 block, cudaStream_t stream, int bf16, const void *w, int64_t K,
                                   int64_t N, float fp8max, int pow2, int layout, float *tile_scale,
                                   int64_t tile_stride, float *inv_fwd, float *inv_dgrad, int64_t blk_stride)
{
    if (bf16)
        tile_scales_kernel<<<grid, block, 0, stream>>>((const __nv_bfloat16 *)w, K, N, fp8max, pow2, layout, tile_scale,
                                                       tile_stride, inv_fwd, inv_dgrad, blk_stride);
    else
        tile_scales_kernel<<<grid, block, 0, stream>>>((const float *)w, K, N, fp8max, pow2, layout, tile_scale,
                                                       tile_stride, inv_fwd, inv_dgrad, blk_stride);
}

void fp8_launch_note_kernel(dim3 grid, dim3 block, cudaStream_t stream, const mat_table &t, const uint32_t *amax_bits,
                            uint32_t *slot_amax, int *slot_seen)
{
    note_kernel<<<grid, block, 0, stream>>>(t, amax_bits, slot_amax, slot_seen);
}

void fp8_launch_end_step_kernel(dim3 grid, dim3 block, cudaStream_t stream, int64_t slots, int64_t experts, int64_t len,
                                float *history, int32_t *next, int32_t *filled, float *scale, uint32_t *step_amax,
                                int *seen, int most_recent, int margin, int pow2, int hybrid)
{
    end_step_kernel<<<grid, block, 0, stream>>>(slots, experts, len, history, next, filled, scale, step_amax, seen,
                                                most_recent, margin, pow2, hybrid);
}

void fp8_launch_fill_kernel(dim3 grid, dim3 block, cudaStream_t stream, float *p, int64_t n, float v)
{
    fill_kernel<<<grid, block, 0, stream>>>(p, n, v);
}
