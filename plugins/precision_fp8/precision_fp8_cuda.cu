/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The fp8 precision recipes on CUDA (see precision_fp8_cuda.h for layouts and scale tensors).
 *
 * Quantization follows precision_fp8_cpu.c number for number: an element is read as fp32 (bf16 widens exactly),
 * a tile's amax is the largest |x| (NaN sticks: amaxes are compared as the bits of |x|, where every NaN is above
 * inf), the scale is fp8_scale_from_amax's formula (double quotient rounded to fp32, FLT_MAX on overflow,
 * truncated to a power of two when asked), q = fp8(fp32(x * scale)) with CUDA's saturating conversion, and the
 * factor cuBLASLt multiplies by is 1/scale in fp32.
 *
 * Kernels, all on the caller's stream:
 *   amax_kernel            largest |x| of each matrix (an expert's rows, or an expert's weight)
 *   scales_kernel          per-tensor scales from amaxes (current) or from the delayed slots
 *   cast_rows_kernel       per-tensor or 128x128-tile scales, FP8 bytes in the source's layout
 *   block_rows_kernel      1x128 tiles along a row: amax, scale, cast (a warp per row, a half-warp per tile)
 *   block_rows_wide_kernel the same for bf16 rows of 16-byte aligned length: 1024 columns of a row in flight per warp
 *   cast_transpose_kernel  128x64 tiles through shared memory into [cols][rows] per matrix; per-tensor,
 *                          128x128-tile or 128x1 (along the rows, computed here) scales
 *   tile_scales_kernel     128x128 tile scales of the weights, written in both weight layouts
 *   weight_layouts_kernel  both FP8 layouts of a weight in one read (and its 128x128 tile scales, blockwise)
 *   note_kernel / end_step_kernel   the delayed recipe's step amax and history, on the device
 */
#include "precision_fp8_cuda.h"

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <float.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../lib/plugin_cuda_check.h"
#include "fp8_block_gemm.h"

#define TILE 128              /* block edge of the blockwise recipe */
#define TABLE_MAX 64          /* matrices per kernel launch (the table goes by value) */
#define PLAN_SLOTS 2048
#define PLAN_PROBES 8
#define MAX_DESCS 16
#define E4M3_MAX 448.0f
#define E5M2_MAX 57344.0f

/* Checked cuBLASLt call. */
#define CUBLAS_CHECK(host, call)                                                                             \
    do {                                                                                                     \
        cublasStatus_t st_ = (call);                                                                         \
        if (st_ != CUBLAS_STATUS_SUCCESS)                                                                    \
            return report((host), MOERT_ERR_CUDA, "%s failed: %s (%s:%d)", #call, cublasLtGetStatusString(st_), \
                          __FILE__, __LINE__);                                                               \
    } while (0)

enum { OP_INPUT = 0, OP_WEIGHT = 1, OP_GRAD = 2 };
enum { SCALE_TENSOR = 0, SCALE_ALONG_ROWS = 1, SCALE_TILE2D = 2 };
/* Blockwise FORWARD/DGRAD operand order. WEIGHT_A: A = weight (BLK128x128), B = activation (VEC128), D as the
 * caller's output. WEIGHT_B: A = activation (VEC128), B = weight (BLK128x128), D = the output transposed (written to
 * a scratch buffer, then transposed back); the only order NVIDIA's sample uses, and cuBLAS 13.0 on H100 refused
 * WEIGHT_A. Chosen once per handle by asking the heuristic (WEIGHT_A first: no transpose). */
enum { BLK_ORDER_UNKNOWN = -1, BLK_ORDER_WEIGHT_A = 0, BLK_ORDER_WEIGHT_B = 1 };
/* Which of an expert matmul's m, n, k is the expert's row count. */
enum { ROW_N = 0, ROW_K = 1, ROW_M = 2 };

/* Integer helpers for sizes. */
static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
static int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

/* ---- device helpers ---- */

/* The matrices one launch works on (by value): matrix i is `rows` rows of the source starting at row src_row0,
 * written at byte dst_off (with leading dimension dst_ld where transposed; for block_rows_kernel dst_ld is the
 * padded row count); its scale factors start at scale_off. */
struct mat_table {
    int32_t count;
    int32_t expert[TABLE_MAX];
    int32_t rows[TABLE_MAX];
    int32_t dst_ld[TABLE_MAX];
    int32_t tile_start[TABLE_MAX + 1]; /* cast_transpose_kernel: first tile of each matrix */
    int64_t src_row0[TABLE_MAX];
    int64_t dst_off[TABLE_MAX];
    int64_t scale_off[TABLE_MAX];
    int64_t row_start[TABLE_MAX + 1];  /* block_rows_kernel: first padded row of each matrix in the launch */
};

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
__device__ float scale_from_amax(float amax, float fp8max, int margin, int pow2, float fallback)
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
    const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(__fmul_rn(a, scale), __fmul_rn(b, scale)), __NV_SATFINITE, f);
    const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(__fmul_rn(c, scale), __fmul_rn(d, scale)), __NV_SATFINITE, f);
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

/* Floats one expert's BLK128x128 factors take (any layout), rounded up to 4 (16-byte aligned slices). */
static int64_t blk_floats(int64_t XB, int64_t KB) { return round_up(round_up(XB, 4) * round_up(KB, 4), 4); }

/* Largest of the block's values, into *out by atomicMax (out may be NULL). */
__device__ void block_max_to(uint32_t v, uint32_t *out)
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

/* amax_bits[expert] = max(.., |x| over matrix i); grid (chunks, matrices). */
template <typename T>
__global__ void amax_kernel(const mat_table t, const T *__restrict__ src, int64_t cols, uint32_t *amax_bits)
{
    const int i = blockIdx.y;
    const int64_t n = (int64_t)t.rows[i] * cols;
    const T *s = src + t.src_row0[i] * cols;
    uint32_t m = 0;
    for (int64_t q = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * 4; q < n; q += (int64_t)gridDim.x * blockDim.x * 4) {
        float v[4];
        load4(s + q, v);
        for (int k = 0; k < 4; k++) m = max(m, abs_bits(v[k]));
    }
    block_max_to(m, &amax_bits[t.expert[i]]);
}

/* Per-tensor scales of n experts: from amaxes (slot_scale NULL) or copied from the delayed slots. Stride 4. */
__global__ void scales_kernel(int64_t n, const uint32_t *amax_bits, const float *slot_scale, float fp8max, int pow2,
                              float *scale, float *scale_inv)
{
    const int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= n) return;
    const float s = slot_scale ? slot_scale[e] : scale_from_amax(__uint_as_float(amax_bits[e]), fp8max, 0, pow2, 1.0f);
    scale[4 * e] = s;
    scale_inv[4 * e] = __fdiv_rn(1.0f, s);
}

/*
 * FP8 bytes of each matrix in the source's own layout, with per-tensor scales (scale[4 * expert]) or 128x128 tile
 * scales (tile_scale: per expert tile_stride floats, row-major [rows/128][cb]); record: amax of the values into
 * record_amax[expert] and record_seen[expert] = 1 (the delayed recipe). Grid (chunks, matrices).
 */
template <typename T>
__global__ void cast_rows_kernel(const mat_table t, const T *__restrict__ src, int64_t cols, uint8_t *__restrict__ dst,
                                 int fmt, const float *scale, const float *tile_scale, int64_t tile_stride, int64_t cb,
                                 uint32_t *record_amax, int *record_seen)
{
    const int i = blockIdx.y, e = t.expert[i];
    const int64_t n = (int64_t)t.rows[i] * cols;
    const T *s = src + t.src_row0[i] * cols;
    uint8_t *d = dst + t.dst_off[i];
    float sc = tile_scale ? 0.0f : scale[4 * e];
    uint32_t m = 0;
    for (int64_t q = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * 4; q < n; q += (int64_t)gridDim.x * blockDim.x * 4) {
        float v[4];
        load4(s + q, v);
        if (tile_scale) sc = tile_scale[e * tile_stride + (q / cols / TILE) * cb + (q % cols) / TILE];
        uint32_t packed = 0;
        for (int k = 0; k < 4; k++) {
            m = max(m, abs_bits(v[k]));
            packed |= (uint32_t)to_fp8(v[k], sc, fmt) << (8 * k);
        }
        *(uint32_t *)(d + q) = packed;
    }
    if (record_amax) {
        block_max_to(m, &record_amax[e]);
        if (threadIdx.x == 0) record_seen[e] = 1;
    }
}

/* The matrix of the table holding `key` in a sorted per-matrix start array. */
__device__ __forceinline__ int find_matrix(const int64_t *start, int count, int64_t key)
{
    int lo = 0, hi = count - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (start[mid] <= key) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* The largest of v over the 16 lanes of this lane's half-warp. */
__device__ __forceinline__ uint32_t half_warp_max(uint32_t v)
{
#pragma unroll
    for (int offset = 8; offset > 0; offset >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

/* Quantizes this lane's 8 values of a 1x128 tile whose 16 lanes form this half-warp: the tile's amax over the
 * half-warp, its scale (returned) and the 8 bytes (packed, the first value lowest). */
__device__ __forceinline__ float block_tile_quantize(const float v[8], int fmt, float fp8max, int pow2, uint2 *packed)
{
    uint32_t m = 0;
#pragma unroll
    for (int k = 0; k < 8; k++) m = max(m, abs_bits(v[k]));
    m = half_warp_max(m);
    const float scale = scale_from_amax(__uint_as_float(m), fp8max, 0, pow2, 1.0f);
    *packed = make_uint2(to_fp8x4(v[0], v[1], v[2], v[3], scale, fmt), to_fp8x4(v[4], v[5], v[6], v[7], scale, fmt));
    return scale;
}

/* block_tile_quantize, then the bytes (two groups of 4 at c and c + 4, each stored when inside the row: 4-byte
 * stores, for rows whose length is only a multiple of 4) and, from the half-warp's first lane, the factor. */
__device__ __forceinline__ void block_tile_store(const float v[8], bool in0, bool in1, uint8_t *out, int fmt,
                                                 float fp8max, int pow2, float *factor, bool writes_factor)
{
    uint2 packed;
    const float scale = block_tile_quantize(v, fmt, fp8max, pow2, &packed);
    if (in0) *(uint32_t *)out = packed.x;
    if (in1) *(uint32_t *)(out + 4) = packed.y;
    if (writes_factor) *factor = __fdiv_rn(1.0f, scale);
}

/* The padded row a warp of the row quantizers takes (one per warp, counted over the launch): its matrix, its row r
 * there, whether it is a real row (else padding), where its bytes and factors go, and the row's 128-column blocks.
 * false past the launch's padded rows. */
typedef struct padded_row {
    int matrix;
    int64_t r, kb_count;
    bool real;
    uint8_t *out;
    float *factors;
} padded_row;

template <typename T>
__device__ __forceinline__ bool padded_row_of(const mat_table &t, const T *src, int64_t cols, uint8_t *dst,
                                              float *scale_inv, padded_row *p, const T **row)
{
    const int64_t pr = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (pr >= t.row_start[t.count]) return false;
    const int i = find_matrix(t.row_start, t.count, pr);
    p->matrix = i;
    p->r = pr - t.row_start[i];
    p->kb_count = (cols + TILE - 1) / TILE;
    p->real = p->r < t.rows[i];
    p->out = dst + t.dst_off[i] + p->r * cols;
    p->factors = scale_inv + t.scale_off[i];
    *row = src + (t.src_row0[i] + p->r) * cols;
    return true;
}

/*
 * 1x128 tiles along each row (blockwise activations and gradients in FORWARD and DGRAD): a warp per padded row,
 * 512 columns per step (8 values per lane in each of two 256-column halves, a half-warp per 128-column tile, both
 * halves' loads issued first). Matrix i covers the launch's padded rows row_start[i] .. row_start[i + 1] - 1
 * (dst_ld[i] rows, a multiple of 16 as cuBLASLt's VEC128 operand needs): its rows[i] real rows first (source rows
 * from src_row0[i]), then padding rows, which get zero bytes and the factor 1 (a tile of zeros has no amax: scale
 * 1). Bytes at dst_off[i] + row * cols, factors at scale_off[i] + vec_index(row, block, dst_ld[i], blocks per row).
 */
template <typename T>
__global__ void __launch_bounds__(256)
    block_rows_kernel(const mat_table t, const T *__restrict__ src, int64_t cols, uint8_t *__restrict__ dst, int fmt,
                      float fp8max, int pow2, int layout, float *scale_inv)
{
    const int lane = threadIdx.x & 31;
    padded_row p;
    const T *row;
    if (!padded_row_of(t, src, cols, dst, scale_inv, &p, &row)) return; /* whole warps leave together */
    for (int64_t base = 0; base < cols; base += 512) {
        float v[2][8];
        bool in[2][2];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int64_t c = base + h * 256 + lane * 8;
            in[h][0] = c < cols, in[h][1] = c + 4 < cols; /* cols is a multiple of 4 */
#pragma unroll
            for (int k = 0; k < 8; k++) v[h][k] = 0.f;
            if (p.real && in[h][0]) load4(row + c, v[h]);
            if (p.real && in[h][1]) load4(row + c + 4, v[h] + 4);
        }
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int64_t c = base + h * 256 + lane * 8, kb = c / TILE;
            if (base + h * 256 >= cols) break; /* the whole warp: no tile of this half */
            block_tile_store(v[h], in[h][0], in[h][1], p.out + c, fmt, fp8max, pow2,
                             p.factors + vec_index(layout, p.r, kb, t.dst_ld[p.matrix], p.kb_count),
                             (lane & 15) == 0 && kb < p.kb_count);
        }
    }
}

/*
 * block_rows_kernel for bf16 rows whose length is a multiple of 8 and whose base is 16-byte aligned (the layer's
 * activations): the same bytes and factors, with more of each row in flight. A warp per padded row, 1024 columns per
 * step: four 256-column quarters, one 16-byte load (8 values) per lane in each, all four issued before any is
 * quantized, then a half-warp per 128-column tile and one 8-byte store per lane. On H200 the deepseek-v3 fc1 input
 * (32844 x 7168) takes 245 us against block_rows_kernel's 300 (61% of DRAM bandwidth against 48%); eight quarters in
 * flight were slower (258 us: 76 registers, fewer warps). See DESIGN.md, "The quantizers".
 */
__global__ void __launch_bounds__(256)
    block_rows_wide_kernel(const mat_table t, const __nv_bfloat16 *__restrict__ src, int64_t cols,
                           uint8_t *__restrict__ dst, int fmt, float fp8max, int pow2, int layout, float *scale_inv)
{
    const int lane = threadIdx.x & 31;
    padded_row p;
    const __nv_bfloat16 *row;
    if (!padded_row_of(t, src, cols, dst, scale_inv, &p, &row)) return; /* whole warps leave together */
    for (int64_t base = 0; base < cols; base += 1024) {
        uint4 raw[4];
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const int64_t c = base + q * 256 + lane * 8;
            raw[q] = make_uint4(0u, 0u, 0u, 0u);
            if (p.real && c < cols) raw[q] = *(const uint4 *)(row + c);
        }
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const int64_t c = base + q * 256 + lane * 8, kb = c / TILE;
            if (base + q * 256 >= cols) break; /* the whole warp: no tile of this quarter */
            float v[8];
            const uint32_t w[4] = {raw[q].x, raw[q].y, raw[q].z, raw[q].w};
#pragma unroll
            for (int k = 0; k < 4; k++) { /* a bf16 is the top half of its fp32 */
                v[2 * k] = __uint_as_float(w[k] << 16);
                v[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
            }
            uint2 packed;
            const float scale = block_tile_quantize(v, fmt, fp8max, pow2, &packed);
            if (c < cols) *(uint2 *)(p.out + c) = packed; /* rows of a multiple of 8: 8-byte aligned */
            if ((lane & 15) == 0 && kb < p.kb_count)
                p.factors[vec_index(layout, p.r, kb, t.dst_ld[p.matrix], p.kb_count)] = __fdiv_rn(1.0f, scale);
        }
    }
}

/*
 * Matrix i ([rows][C], from source row src_row0) into [C][dst_ld] at dst_off: 128 x CT_COLS tiles through shared
 * memory (read in 16-byte chunks where C allows it); rows from `rows` to dst_ld are zeros. Scales: SCALE_TENSOR
 * (scale[4 * expert]), SCALE_TILE2D (tile_scale as in cast_rows_kernel), or SCALE_ALONG_ROWS: 128x1 tiles (128 rows
 * of one column, the rows counted from the matrix's first), scale computed here, factor at scale_off[i] +
 * vec_index(column, row block, C, ceil(dst_ld / 128)). record as in cast_rows_kernel. One block per tile, 256
 * threads.
 */
#define CT_COLS 64 /* columns of a cast_transpose_kernel tile */

/* Where element (row, col) of a cast_transpose_kernel tile lies in shared memory: rows of CT_COLS values, their
 * 16-byte chunks permuted by the row's 16-row group (chunk ^ group), so that the 8 threads reading 16 rows each of one
 * column (the output loop) hit 8 different banks, and a row's chunks still fill one 128-byte line (the loads). */
template <typename T>
__device__ __forceinline__ int tile_at(int row, int col)
{
    constexpr int VEC = 16 / sizeof(T);
    return row * CT_COLS + (((col / VEC) ^ ((row / 16) & 7)) * VEC) + col % VEC;
}
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(float v) { return v; }

/* VEC consecutive elements widened to fp32 (16 bytes, 16-byte aligned). */
__device__ __forceinline__ void load16(const __nv_bfloat16 *p, float *v)
{
    load4(p, v);
    load4(p + 4, v + 4);
}
__device__ __forceinline__ void load16(const float *p, float *v) { load4(p, v); }

/* Two neighbouring values of a row (the first at an even column), widened to fp32: one shared-memory read. */
__device__ __forceinline__ void load_pair(const __nv_bfloat16 *p, float *a, float *b)
{
    const __nv_bfloat162 v = *(const __nv_bfloat162 *)p;
    *a = __low2float(v);
    *b = __high2float(v);
}
__device__ __forceinline__ void load_pair(const float *p, float *a, float *b)
{
    const float2 v = *(const float2 *)p;
    *a = v.x;
    *b = v.y;
}

template <typename T>
__global__ void __launch_bounds__(256)
    cast_transpose_kernel(const mat_table t, const T *__restrict__ src, int64_t C, uint8_t *__restrict__ dst, int fmt,
                          int mode, const float *scale, const float *tile_scale, int64_t tile_stride, int64_t cb_count,
                          float fp8max, int pow2, int layout, float *scale_inv, uint32_t *record_amax, int *record_seen)
{
    constexpr int VEC = 16 / sizeof(T), CPR = CT_COLS / VEC; /* elements per chunk, chunks per tile row */
    constexpr int ROWS_PER_PASS = 256 / CPR;                   /* chunked loads: rows a pass of the block covers */
    __shared__ __align__(16) T tile[TILE * CT_COLS];           /* the source values as they are, swizzled: tile_at */
    __shared__ uint32_t part_max[8][CT_COLS];                  /* a column's amax over one warp's (or part's) rows */
    __shared__ float col_scale[CT_COLS];
    int lo = 0, hi = t.count - 1; /* the matrix holding this tile */
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (t.tile_start[mid] <= (int32_t)blockIdx.x) lo = mid;
        else hi = mid - 1;
    }
    const int i = lo, e = t.expert[i], tid = threadIdx.x, lane = tid % 32;
    const int64_t rows = t.rows[i], ld = t.dst_ld[i];
    const int64_t CT = (C + CT_COLS - 1) / CT_COLS, local = blockIdx.x - t.tile_start[i];
    const int64_t rb = local / CT, cb = local % CT;
    const T *s = src + t.src_row0[i] * C;
    int parts = 8;
    if (C % VEC == 0 && ((uintptr_t)src & 15) == 0) { /* rows start on 16 bytes: one 16-byte chunk per load */
        const int q = tid % CPR; /* this thread's chunk of every row it loads: columns q * VEC .. + VEC - 1 */
        const int64_t c = cb * CT_COLS + q * VEC;
        uint4 raw[TILE / ROWS_PER_PASS];
#pragma unroll
        for (int j = 0; j < TILE / ROWS_PER_PASS; j++) { /* every load issued before the first is used */
            const int64_t r = rb * TILE + tid / CPR + j * ROWS_PER_PASS;
            raw[j] = r < rows && c < C ? *(const uint4 *)(s + r * C + c) : make_uint4(0, 0, 0, 0);
        }
        uint32_t m[VEC];
#pragma unroll
        for (int k = 0; k < VEC; k++) m[k] = 0;
#pragma unroll
        for (int j = 0; j < TILE / ROWS_PER_PASS; j++) {
            const int rr = tid / CPR + j * ROWS_PER_PASS;
            *(uint4 *)&tile[tile_at<T>(rr, q * VEC)] = raw[j];
            const T *v = (const T *)&raw[j];
#pragma unroll
            for (int k = 0; k < VEC; k++) m[k] = max(m[k], abs_bits(to_float(v[k])));
        }
        /* over the warp's lanes holding the same chunk (lane, lane + CPR, ...), then one row of part_max per warp */
#pragma unroll
        for (int k = 0; k < VEC; k++)
            for (int offset = CPR; offset < 32; offset *= 2)
                m[k] = max(m[k], __shfl_xor_sync(0xffffffffu, m[k], offset));
        if (lane < CPR)
#pragma unroll
            for (int k = 0; k < VEC; k++) part_max[tid / 32][q * VEC + k] = m[k];
    } else { /* one value at a time; each thread keeps one column (tid % 64) over a quarter of the rows */
        uint32_t m = 0;
        for (int idx = tid; idx < TILE * CT_COLS; idx += 256) {
            const int rr = idx / CT_COLS, cc = idx % CT_COLS;
            const int64_t r = rb * TILE + rr, c = cb * CT_COLS + cc;
            const T v = r < rows && c < C ? s[r * C + c] : T(0.0f);
            tile[tile_at<T>(rr, cc)] = v;
            m = max(m, abs_bits(to_float(v)));
        }
        part_max[tid / CT_COLS][tid % CT_COLS] = m;
        parts = 256 / CT_COLS;
    }
    __syncthreads();
    if (tid < CT_COLS) {
        uint32_t m = 0;
        for (int p = 0; p < parts; p++) m = max(m, part_max[p][tid]);
        const int64_t c = cb * CT_COLS + tid;
        if (mode == SCALE_ALONG_ROWS) {
            const float sc = scale_from_amax(__uint_as_float(m), fp8max, 0, pow2, 1.0f);
            col_scale[tid] = sc;
            if (c < C) scale_inv[t.scale_off[i] + vec_index(layout, c, rb, C, (ld + TILE - 1) / TILE)] = __fdiv_rn(1.0f, sc);
        }
        if (record_amax) { /* one atomic per warp of the 64 columns */
            m = __reduce_max_sync(0xffffffffu, m);
            if (tid % 32 == 0) {
                atomicMax(&record_amax[e], m);
                record_seen[e] = 1;
            }
        }
    }
    __syncthreads();
    /* Per thread and step, 16 consecutive output bytes (rows) of two neighbouring columns: one shared-memory read per
     * row gives both columns' values (the swizzle keeps them in one chunk), and 8 threads write a column's 128 rows. */
    for (int idx = tid; idx < (CT_COLS / 2) * (TILE / 16); idx += 256) {
        const int cc = 2 * (idx / (TILE / 16)), g = idx % (TILE / 16);
        const int64_t c = cb * CT_COLS + cc, r0 = rb * TILE + g * 16;
        if (c >= C || r0 >= ld) continue;
        float sc[2];
#pragma unroll
        for (int h = 0; h < 2; h++)
            sc[h] = c + h >= C ? 1.0f : mode == SCALE_TENSOR ? scale[4 * e] : mode == SCALE_ALONG_ROWS ? col_scale[cc + h]
                    : tile_scale[e * tile_stride + (r0 / TILE) * cb_count + (c + h) / TILE];
        uint32_t w[2][4]; /* [column][4 rows] */
#pragma unroll
        for (int q = 0; q < 4; q++) { /* 4 rows at a time: fewer values live */
            float v[2][4];
#pragma unroll
            for (int k = 0; k < 4; k++) load_pair(&tile[tile_at<T>(g * 16 + 4 * q + k, cc)], &v[0][k], &v[1][k]);
#pragma unroll
            for (int h = 0; h < 2; h++) w[h][q] = to_fp8x4(v[h][0], v[h][1], v[h][2], v[h][3], sc[h], fmt);
        }
#pragma unroll
        for (int h = 0; h < 2 && c + h < C; h++) {
            uint8_t *out = dst + t.dst_off[i] + (c + h) * ld + r0;
            if (r0 + 16 <= ld) {
                *(uint4 *)out = make_uint4(w[h][0], w[h][1], w[h][2], w[h][3]);
            } else { /* ld is a multiple of 16, so this does not happen; kept for safety */
                for (int q = 0; q < 4 && r0 + q * 4 < ld; q++) *(uint32_t *)(out + q * 4) = w[h][q];
            }
        }
    }
}

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
                         (((rows[4 * q + 2] >> (8 * c)) & 0xffu) << 16) | (((rows[4 * q + 3] >> (8 * c)) & 0xffu) << 24);
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
        for (int64_t r = kb * TILE + half; r < K && r < (kb + 1) * TILE; r += 2) m = max(m, abs_bits(load_f(base + r * N + c)));
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

/* ---- the handle ---- */

/* A device buffer that grows. */
typedef struct dev_buf {
    void *p;
    size_t cap;
} dev_buf;

/* The FP8 copies of one weight and their scales. */
typedef struct weight_cache {
    const void *source;  /* the weight they were made from; NULL: none */
    moert_dtype dtype;
    int64_t k, n;
    int scales_valid, fwd_valid, dgrad_valid;
    dev_buf fwd, dgrad;  /* [E][N][K] and [E][K][N] bytes */
    dev_buf scale, inv; /* per-tensor: [4E] each */
    dev_buf amax;       /* [E] bits */
    dev_buf tile_scale, inv_fwd, inv_dgrad; /* blockwise */
    int64_t tile_stride, blk_stride;
} weight_cache;

typedef struct plan_key {
    int32_t a_type, b_type, d_type, a_mode, b_mode, beta1, exact, pad;
    int32_t align_a, align_b, align_d, pad2;
    int64_t m, n, k;
} plan_key;

typedef struct plan_entry {
    int valid;
    plan_key key;
    cublasLtMatmulAlgo_t algo;
} plan_entry;

typedef struct desc_entry {
    int32_t a_type, b_type, a_mode, b_mode;
    cublasLtMatmulDesc_t desc;
} desc_entry;

typedef struct layout_state {
    cublasLtMatrixLayout_t layout;
    int32_t type;
    int64_t rows, cols, ld;
} layout_state;

struct moert_fp8_cuda {
    const moert_host *host;
    moert_device device;
    moert_fp8_cuda_config cfg;
    int vec_layout, blk_layout;
    int quantize_only; /* benchmarks: no matmuls */
    moert_fp8_block_tuning block_tuning; /* how the wgmma kernel runs (moert_fp8_cuda_set_block_tuning) */
    int64_t wgrad_align; /* blockwise WGRAD: rows padded to 16 or 128 (0: not asked yet) */
    int64_t worst_rows;  /* the current GEMM's most padded rows (capacity + (align - 1) * E); 0: capacity unknown */
    int blk_order;       /* blockwise FORWARD/DGRAD: BLK_ORDER_* (see choose_blk_order) */
    moert_fp8_block_ctx *block; /* blockwise GEMMs on the wgmma kernel (fp8_block_gemm.cu); NULL: cuBLASLt */
    int block_wgrad;            /* with block: the kernel serves every WGRAD (set_block_kernel 1); 0: the
                                   accumulating ones only, those overwriting grad_weight go to cuBLASLt (2) */
    cublasLtHandle_t lt;
    cublasLtMatmulPreference_t pref;
    int32_t pref_align[3];
    desc_entry descs[MAX_DESCS];
    int desc_count;
    layout_state layout[3]; /* A, B, C=D */
    plan_entry *plans;
    moert_fp8_cuda_stats stats;
    int streams;
    dev_buf workspace;
    cudaStream_t lane_stream[MOERT_FP8_CUDA_MAX_STREAMS];
    cudaEvent_t join_event[MOERT_FP8_CUDA_MAX_STREAMS];
    cudaEvent_t fork_event;
    /* activation operands of the current GEMM */
    dev_buf act_a, act_b;                 /* FP8 bytes */
    dev_buf a_scale, a_inv, b_scale, b_inv; /* per-tensor [4E] */
    dev_buf a_blk, b_blk;                 /* blockwise factors */
    dev_buf amax;                         /* [E] bits, current recipe */
    dev_buf dscratch;                     /* BLK_ORDER_WEIGHT_B: the experts' outputs, transposed */
    weight_cache weights[2];
    /* delayed recipe (slots [which][operand][expert]) */
    dev_buf slot_scale, slot_amax, slot_seen, history, next, filled;
    /* host scratch, [E] each */
    int64_t *row0, *rows16, *prow0, *a_off, *b_off, *a_soff, *b_soff;
    int32_t *active; /* non-empty experts */
    int64_t active_count;
    /* what the last GEMM used */
    moert_fp8_cuda_operands last;
};

/* Device memory from the host's pool when it has one for this device, else cudaMalloc. */
static moert_result dev_alloc(moert_fp8_cuda *g, size_t bytes, void **out)
{
    const moert_host *h = g->host;
    *out = NULL;
    if (h && h->alloc && h->free) return h->alloc(h, g->device, bytes ? bytes : 1, out);
    cudaError_t err = cudaMalloc(out, bytes ? bytes : 1);
    if (err != cudaSuccess) {
        *out = NULL;
        return report(h, MOERT_ERR_OUT_OF_MEMORY, "fp8 cuda: cudaMalloc(%zu) failed: %s", bytes, cudaGetErrorString(err));
    }
    return MOERT_OK;
}

/* Gives back memory from dev_alloc. */
static void dev_free(moert_fp8_cuda *g, void *p)
{
    if (!p) return;
    const moert_host *h = g->host;
    if (h && h->alloc && h->free) h->free(h, g->device, p);
    else cudaFree(p);
}

/* Grows b to at least bytes; slack: a quarter more, so activations whose counts vary do not regrow every step
 * (weights, whose size does not change, take none). */
static moert_result buf_grow(moert_fp8_cuda *g, dev_buf *b, size_t bytes, int slack)
{
    if (b->cap >= bytes && b->p) return MOERT_OK;
    size_t want = slack ? bytes + bytes / 4 + 256 : bytes + 256;
    void *p = NULL;
    MOK(dev_alloc(g, want, &p));
    dev_free(g, b->p);
    b->p = p;
    b->cap = want;
    return MOERT_OK;
}

/* buf_grow with slack. */
static moert_result buf_reserve(moert_fp8_cuda *g, dev_buf *b, size_t bytes) { return buf_grow(g, b, bytes, 1); }

/* An activation buffer: grown once to the worst case when that is known (worst >= bytes: the caller's row
 * capacity, see moert_fp8_cuda_gemm.capacity), else to bytes with slack. */
static moert_result buf_reserve_worst(moert_fp8_cuda *g, dev_buf *b, size_t bytes, size_t worst)
{
    if (worst >= bytes) return buf_grow(g, b, worst, 0);
    return buf_reserve(g, b, bytes);
}

/* Frees a growing buffer. */
static void buf_release(moert_fp8_cuda *g, dev_buf *b)
{
    dev_free(g, b->p);
    b->p = NULL;
    b->cap = 0;
}

/* Frees everything the handle holds (see the header). */
extern "C" void moert_fp8_cuda_destroy(moert_fp8_cuda *g)
{
    if (!g) return;
    for (int i = 1; i < MOERT_FP8_CUDA_MAX_STREAMS; i++) {
        if (g->lane_stream[i]) cudaStreamDestroy(g->lane_stream[i]);
        if (g->join_event[i]) cudaEventDestroy(g->join_event[i]);
    }
    if (g->fork_event) cudaEventDestroy(g->fork_event);
    moert_fp8_block_ctx_destroy(g->block);
    for (int i = 0; i < g->desc_count; i++) cublasLtMatmulDescDestroy(g->descs[i].desc);
    for (int i = 0; i < 3; i++)
        if (g->layout[i].layout) cublasLtMatrixLayoutDestroy(g->layout[i].layout);
    if (g->pref) cublasLtMatmulPreferenceDestroy(g->pref);
    if (g->lt) cublasLtDestroy(g->lt);
    dev_buf *bufs[] = {&g->workspace, &g->act_a, &g->act_b, &g->a_scale, &g->a_inv, &g->b_scale, &g->b_inv,
                       &g->a_blk, &g->b_blk, &g->amax, &g->slot_scale, &g->slot_amax, &g->slot_seen, &g->history,
                       &g->next, &g->filled, &g->dscratch};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) buf_release(g, bufs[i]);
    for (int w = 0; w < 2; w++) {
        weight_cache *c = &g->weights[w];
        dev_buf *wb[] = {&c->fwd, &c->dgrad, &c->scale, &c->inv, &c->amax, &c->tile_scale, &c->inv_fwd, &c->inv_dgrad};
        for (size_t i = 0; i < sizeof wb / sizeof wb[0]; i++) buf_release(g, wb[i]);
    }
    free(g->row0);
    free(g->rows16);
    free(g->prow0);
    free(g->a_off);
    free(g->b_off);
    free(g->a_soff);
    free(g->b_soff);
    free(g->active);
    free(g->plans);
    free(g);
}

/* cuBLASLt handle, preference, layout objects. */
static moert_result lt_setup(moert_fp8_cuda *g)
{
    const moert_host *host = g->host;
    CUBLAS_CHECK(host, cublasLtCreate(&g->lt));
    CUBLAS_CHECK(host, cublasLtMatmulPreferenceCreate(&g->pref));
    uint64_t ws = MOERT_FP8_CUDA_STREAM_WORKSPACE_BYTES;
    CUBLAS_CHECK(host, cublasLtMatmulPreferenceSetAttribute(g->pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                                            sizeof ws));
    for (int i = 0; i < 3; i++) {
        CUBLAS_CHECK(host, cublasLtMatrixLayoutCreate(&g->layout[i].layout, i < 2 ? CUDA_R_8F_E4M3 : CUDA_R_16BF, 16,
                                                      16, 16));
        g->layout[i].type = i < 2 ? CUDA_R_8F_E4M3 : CUDA_R_16BF;
        g->layout[i].rows = g->layout[i].cols = g->layout[i].ld = 16;
    }
    return MOERT_OK;
}

/* The delayed recipe's device state: scales 1, empty histories. */
static moert_result delayed_setup(moert_fp8_cuda *g)
{
    const int64_t slots = 6 * g->cfg.num_experts, len = g->cfg.amax_history_len;
    MOK(buf_reserve(g, &g->slot_scale, (size_t)slots * 4));
    MOK(buf_reserve(g, &g->slot_amax, (size_t)slots * 4));
    MOK(buf_reserve(g, &g->slot_seen, (size_t)slots * 4));
    MOK(buf_reserve(g, &g->history, (size_t)(slots * len) * 4));
    MOK(buf_reserve(g, &g->next, (size_t)slots * 4));
    MOK(buf_reserve(g, &g->filled, (size_t)slots * 4));
    const moert_host *host = g->host;
    CUDA_CHECK(host, cudaDeviceSynchronize()); /* init only: pool blocks may have been used on another stream */
    CUDA_CHECK(host, cudaMemset(g->slot_amax.p, 0, (size_t)slots * 4));
    CUDA_CHECK(host, cudaMemset(g->slot_seen.p, 0, (size_t)slots * 4));
    CUDA_CHECK(host, cudaMemset(g->history.p, 0, (size_t)(slots * len) * 4));
    CUDA_CHECK(host, cudaMemset(g->next.p, 0, (size_t)slots * 4));
    CUDA_CHECK(host, cudaMemset(g->filled.p, 0, (size_t)slots * 4));
    fill_kernel<<<(unsigned)ceil_div(slots, 256), 256>>>((float *)g->slot_scale.p, slots, 1.0f);
    LAUNCH_CHECK(host, "fill_kernel");
    CUDA_CHECK(host, cudaDeviceSynchronize()); /* init only: the legacy stream's work before any step */
    return MOERT_OK;
}

/* Creates the handle: host tables, cuBLASLt, workspace, the delayed recipe's state (see the header). */
extern "C" moert_result moert_fp8_cuda_create(const moert_host *host, moert_device device,
                                              const moert_fp8_cuda_config *cfg, moert_fp8_cuda **out)
{
    *out = NULL;
    if (cfg->num_experts < 0 || cfg->num_experts > 0xFFFFFF || cfg->recipe < MOERT_FP8_CUDA_CURRENT ||
        cfg->recipe > MOERT_FP8_CUDA_BLOCKWISE || cfg->amax_history_len < 1)
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "fp8 cuda: bad configuration (experts %lld, recipe %d, "
                      "history %lld)", (long long)cfg->num_experts, (int)cfg->recipe, (long long)cfg->amax_history_len);
    moert_fp8_cuda *g = (moert_fp8_cuda *)calloc(1, sizeof *g);
    if (!g) return report(host, MOERT_ERR_OUT_OF_MEMORY, "fp8 cuda: out of host memory for the handle");
    g->host = host;
    g->block_tuning = moert_fp8_block_tuning_default();
    g->device = device;
    g->cfg = *cfg;
    g->streams = 1;
    g->blk_order = BLK_ORDER_UNKNOWN;
    const size_t E = (size_t)(cfg->num_experts > 0 ? cfg->num_experts : 1);
    g->plans = (plan_entry *)calloc(PLAN_SLOTS, sizeof *g->plans);
    g->row0 = (int64_t *)calloc(E, 8);
    g->rows16 = (int64_t *)calloc(E, 8);
    g->prow0 = (int64_t *)calloc(E, 8);
    g->a_off = (int64_t *)calloc(E, 8);
    g->b_off = (int64_t *)calloc(E, 8);
    g->a_soff = (int64_t *)calloc(E, 8);
    g->b_soff = (int64_t *)calloc(E, 8);
    g->active = (int32_t *)calloc(E, 4);
    moert_result rc = MOERT_OK;
    if (!g->plans || !g->row0 || !g->rows16 || !g->prow0 || !g->a_off || !g->b_off || !g->a_soff || !g->b_soff ||
        !g->active) {
        rc = report(host, MOERT_ERR_OUT_OF_MEMORY, "fp8 cuda: out of host memory for %zu experts' tables", E);
        goto fail;
    }
    if ((rc = lt_setup(g)) != MOERT_OK) goto fail;
    if ((rc = buf_reserve(g, &g->workspace, MOERT_FP8_CUDA_STREAM_WORKSPACE_BYTES)) != MOERT_OK) goto fail;
    if (cfg->recipe == MOERT_FP8_CUDA_DELAYED && (rc = delayed_setup(g)) != MOERT_OK) goto fail;
    *out = g;
    return MOERT_OK;
fail:
    moert_fp8_cuda_destroy(g);
    return rc;
}

/* Whether the blockwise recipe's GEMMs of pass run on the wgmma kernel (else on cuBLASLt); overwrite: a WGRAD that
 * overwrites grad_weight. */
static int kernel_serves(const moert_fp8_cuda *g, moert_gemm_pass pass, int overwrite)
{
    return g->block && (pass != MOERT_GEMM_WGRAD || g->block_wgrad || !overwrite);
}

/* The blockwise recipe's GEMMs on the wgmma kernel: every pass (on 1), all but the WGRADs that overwrite grad_weight
 * (2), none (0). */
extern "C" moert_result moert_fp8_cuda_set_block_kernel(moert_fp8_cuda *g, int on)
{
    if (on < 0 || on > 2)
        return report(g->host, MOERT_ERR_INVALID_ARGUMENT, "fp8 cuda: block kernel setting %d (0, 1 or 2)", on);
    if (!on) {
        moert_fp8_block_ctx_destroy(g->block);
        g->block = NULL;
        return MOERT_OK;
    }
    if (g->cfg.recipe != MOERT_FP8_CUDA_BLOCKWISE)
        return report(g->host, MOERT_ERR_UNSUPPORTED, "the FP8 GEMM kernel serves the blockwise recipe only");
    if (g->vec_layout != MOERT_FP8_VEC128_X_MAJOR || g->blk_layout != MOERT_FP8_BLK_K_MAJOR_PAD4)
        return report(g->host, MOERT_ERR_UNSUPPORTED, "the FP8 GEMM kernel reads the default scale layouts only");
    g->block_wgrad = on == 1;
    if (g->block) return MOERT_OK;
    moert_result rc = moert_fp8_block_ctx_create(g->host, &g->block);
    if (rc == MOERT_OK) rc = moert_fp8_block_ctx_tune(g->block, &g->block_tuning);
    if (rc != MOERT_OK) {
        moert_fp8_block_ctx_destroy(g->block);
        g->block = NULL;
    }
    return rc;
}

/* How the wgmma kernel runs: kept for a kernel context made later, applied at once to one that exists. */
extern "C" moert_result moert_fp8_cuda_set_block_tuning(moert_fp8_cuda *g, const moert_fp8_block_tuning *tuning)
{
    if (g->block) MOK(moert_fp8_block_ctx_tune(g->block, tuning));
    g->block_tuning = *tuning;
    return MOERT_OK;
}

/* The wgmma kernel's configuration in words (moert_fp8_block_ctx_describe); "cuBLASLt" when it serves no pass. */
extern "C" void moert_fp8_cuda_describe_block_kernel(const moert_fp8_cuda *g, char *buf, size_t size)
{
    if (g->block)
        moert_fp8_block_ctx_describe(g->block, buf, size);
    else
        snprintf(buf, size, "cuBLASLt");
}

/* Sets the matmul lanes; creates the missing streams and events, grows the workspace. */
extern "C" moert_result moert_fp8_cuda_set_streams(moert_fp8_cuda *g, int streams)
{
    const moert_host *host = g->host;
    if (streams < 1 || streams > MOERT_FP8_CUDA_MAX_STREAMS)
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "fp8 cuda: %d streams asked for, expected 1 to %d", streams,
                      MOERT_FP8_CUDA_MAX_STREAMS);
    const size_t need = (size_t)streams * MOERT_FP8_CUDA_STREAM_WORKSPACE_BYTES;
    if (g->workspace.cap < need) {
        CUDA_CHECK(host, cudaDeviceSynchronize()); /* a setup call: the old workspace may be in use */
        MOK(buf_reserve(g, &g->workspace, need));
    }
    if (streams > 1 && !g->fork_event) CUDA_CHECK(host, cudaEventCreateWithFlags(&g->fork_event, cudaEventDisableTiming));
    for (int i = 1; i < streams; i++) {
        if (!g->lane_stream[i]) CUDA_CHECK(host, cudaStreamCreateWithFlags(&g->lane_stream[i], cudaStreamNonBlocking));
        if (!g->join_event[i]) CUDA_CHECK(host, cudaEventCreateWithFlags(&g->join_event[i], cudaEventDisableTiming));
    }
    g->streams = streams;
    return MOERT_OK;
}

/* Forgets the FP8 weight copies (see the header). */
extern "C" void moert_fp8_cuda_drop_weights(moert_fp8_cuda *g)
{
    for (int w = 0; w < 2; w++) {
        weight_cache *c = &g->weights[w];
        c->source = NULL;
        c->scales_valid = c->fwd_valid = c->dgrad_valid = 0;
    }
}

/* Chooses the block-scale layouts (see the header). */
extern "C" void moert_fp8_cuda_set_scale_layout(moert_fp8_cuda *g, moert_fp8_cuda_vec_layout vec,
                                                moert_fp8_cuda_blk_layout blk)
{
    if (g->block && (vec != MOERT_FP8_VEC128_X_MAJOR || blk != MOERT_FP8_BLK_K_MAJOR_PAD4))
        (void)moert_fp8_cuda_set_block_kernel(g, 0); /* the kernel reads the default layouts only: cuBLASLt then */
    g->vec_layout = (int)vec;
    g->blk_layout = (int)blk;
    moert_fp8_cuda_drop_weights(g);
}

/* Benchmarks: quantize without matmuls (see the header). */
extern "C" void moert_fp8_cuda_set_quantize_only(moert_fp8_cuda *g, int enabled) { g->quantize_only = enabled != 0; }

/* Counters (see the header). */
extern "C" void moert_fp8_cuda_get_stats(const moert_fp8_cuda *g, moert_fp8_cuda_stats *out) { *out = g->stats; }

/* The last GEMM's quantized operands, for tests (see the header). */
extern "C" void moert_fp8_cuda_last_operands(const moert_fp8_cuda *g, moert_fp8_cuda_operands *out) { *out = g->last; }

/* ---- quantization ---- */

/* Whether the recipe is blockwise. */
static int is_blockwise(const moert_fp8_cuda *g) { return g->cfg.recipe == MOERT_FP8_CUDA_BLOCKWISE; }

/* The format of an operand: E5M2 for grad_output under hybrid, else E4M3 (0 E4M3, 1 E5M2). */
static int operand_format(const moert_fp8_cuda *g, int operand) { return g->cfg.hybrid && operand == OP_GRAD; }
/* The largest finite value of a format. */
static float format_max(int fmt) { return fmt ? E5M2_MAX : E4M3_MAX; }

/* Slot index of (which, operand, expert 0): slots are [which][operand][expert]. */
static int64_t slot_base(const moert_fp8_cuda *g, int which, int operand)
{
    return ((int64_t)which * 3 + operand) * g->cfg.num_experts;
}

/* What table_fill needs to know about an activation operand. */
typedef struct table_spec {
    int64_t cols;           /* source columns */
    int transposed;         /* destination [cols][rows16] at prow0 * cols */
    int padded;             /* destination [rows16][cols] at prow0 * cols (blockwise FORWARD/DGRAD) */
    const int64_t *scale_off; /* per expert, or NULL (0) */
} table_spec;

/* Fills a kernel table with active experts first .. first+count-1 (rows come from table_rows); *tiles gets the
 * tiles of cast_transpose_kernel when transposed; row_start the padded rows of block_rows_kernel. */
static void table_fill(const moert_fp8_cuda *g, int64_t first, int64_t count, const table_spec *spec, mat_table *t,
                       int64_t *tiles)
{
    memset(t, 0, sizeof *t);
    t->count = (int32_t)count;
    int64_t tile = 0, padded_rows = 0;
    const int64_t CT = ceil_div(spec->cols, CT_COLS);
    for (int64_t j = 0; j < count; j++) {
        const int32_t e = g->active[first + j];
        t->expert[j] = e;
        t->src_row0[j] = g->row0[e];
        t->scale_off[j] = spec->scale_off ? spec->scale_off[e] : 0;
        t->row_start[j] = padded_rows;
        padded_rows += g->rows16[e];
        if (spec->padded) {
            t->dst_ld[j] = (int32_t)g->rows16[e];
            t->dst_off[j] = g->prow0[e] * spec->cols;
        } else if (spec->transposed) {
            t->dst_ld[j] = (int32_t)g->rows16[e];
            t->dst_off[j] = g->prow0[e] * spec->cols;
            t->tile_start[j] = (int32_t)tile;
            tile += ceil_div(g->rows16[e], TILE) * CT;
        } else {
            t->dst_ld[j] = (int32_t)spec->cols;
            t->dst_off[j] = g->row0[e] * spec->cols;
        }
    }
    t->tile_start[count] = (int32_t)tile;
    t->row_start[count] = padded_rows;
    *tiles = tile;
}

/* Sets rows (the count of the active expert) into a table filled by table_fill: the caller passes counts. */
static void table_rows(const int64_t *counts, mat_table *t)
{
    for (int32_t j = 0; j < t->count; j++) t->rows[j] = (int32_t)counts[t->expert[j]];
}

/* Blocks per matrix of the element-wise kernels: enough for the largest matrix of the table, at most 64. */
static unsigned grid_chunks(const mat_table *t, int64_t cols)
{
    int64_t most = 0;
    for (int32_t j = 0; j < t->count; j++)
        if (t->rows[j] > most) most = t->rows[j];
    const int64_t chunks = ceil_div(most * cols, 256 * 4 * 8);
    return (unsigned)(chunks < 1 ? 1 : chunks > 64 ? 64 : chunks);
}

/* Which per-tensor scale arrays an activation operand uses. */
typedef struct act_target {
    dev_buf *bytes, *scale, *inv, *blk;
    int64_t *soff; /* host: per-expert float offsets of block factors */
} act_target;

/*
 * Quantizes an activation operand (input or grad_output, [rows, cols] in act dtype) for the active experts into
 * target: in its own layout (transposed = 0; FORWARD, DGRAD; the blockwise recipe puts each expert's rows at its
 * padded offset prow0, zero rows up to rows16) or as [cols][rows16] per expert (WGRAD).
 */
/* Whether block_rows_wide_kernel takes these rows: bf16, 16-byte aligned rows. */
template <typename T>
static bool rows_wide_ok(const moert_fp8_cuda *g, const T *src, int64_t cols)
{
    (void)g;
    return sizeof(T) == 2 && cols % 8 == 0 && (uintptr_t)src % 16 == 0;
}

template <typename T>
static moert_result quantize_activation_t(moert_fp8_cuda *g, cudaStream_t stream, const moert_fp8_cuda_gemm *gm,
                                          const T *src, int64_t cols, int operand, int transposed, act_target *tg)
{
    const moert_host *host = g->host;
    const int fmt = operand_format(g, operand);
    const float fmax = format_max(fmt);
    const int64_t E = g->cfg.num_experts;
    const int padded = !transposed && is_blockwise(g);
    const int64_t last = g->active[g->active_count - 1];
    const int64_t stored_rows = transposed || padded ? g->prow0[last] + g->rows16[last]
                                                     : g->row0[last] + gm->rows_per_expert[last];
    MOK(buf_reserve_worst(g, tg->bytes, (size_t)(stored_rows * cols), (size_t)(g->worst_rows * cols)));
    MOK(buf_reserve(g, tg->scale, (size_t)(4 * E) * 4));
    MOK(buf_reserve(g, tg->inv, (size_t)(4 * E) * 4));
    /* blockwise factor offsets, 16-byte aligned per expert */
    int64_t blk_total = 0;
    for (int64_t e = 0; e < E; e++) {
        tg->soff[e] = blk_total;
        const int64_t r = gm->rows_per_expert[e];
        if (r == 0 || !is_blockwise(g)) continue;
        blk_total += transposed ? round_up(cols * ceil_div(g->rows16[e], TILE), 4)
                                : round_up(g->rows16[e] * ceil_div(cols, TILE), 4);
    }
    if (is_blockwise(g)) {
        const int64_t worst = g->worst_rows == 0 ? 0 : transposed ? cols * (ceil_div(g->worst_rows, TILE) + E) + 4 * E
                                                                  : g->worst_rows * ceil_div(cols, TILE) + 4 * E;
        MOK(buf_reserve_worst(g, tg->blk, (size_t)(blk_total > 0 ? blk_total : 1) * 4, (size_t)worst * 4));
    }

    const int delayed = g->cfg.recipe == MOERT_FP8_CUDA_DELAYED;
    uint32_t *rec_amax = NULL;
    int *rec_seen = NULL;
    if (delayed) {
        const int64_t base = slot_base(g, gm->which, operand);
        rec_amax = (uint32_t *)g->slot_amax.p + base;
        rec_seen = (int *)g->slot_seen.p + base;
        scales_kernel<<<(unsigned)ceil_div(E, 128), 128, 0, stream>>>(E, NULL, (const float *)g->slot_scale.p + base,
                                                                        fmax, 0, (float *)tg->scale->p,
                                                                        (float *)tg->inv->p);
        LAUNCH_CHECK(host, "scales_kernel");
    }
    const table_spec spec = {cols, transposed, padded, tg->soff};
    if (g->cfg.recipe == MOERT_FP8_CUDA_CURRENT) { /* every expert's amax first, then the scales */
        CUDA_CHECK(host, cudaMemsetAsync(g->amax.p, 0, (size_t)E * 4, stream));
        for (int64_t first = 0; first < g->active_count; first += TABLE_MAX) {
            const int64_t count = g->active_count - first < TABLE_MAX ? g->active_count - first : TABLE_MAX;
            mat_table t;
            int64_t tiles = 0;
            table_fill(g, first, count, &spec, &t, &tiles);
            table_rows(gm->rows_per_expert, &t);
            amax_kernel<T><<<dim3(grid_chunks(&t, cols), (unsigned)t.count), 256, 0, stream>>>(t, src, cols,
                                                                                              (uint32_t *)g->amax.p);
            LAUNCH_CHECK(host, "amax_kernel");
        }
        scales_kernel<<<(unsigned)ceil_div(E, 128), 128, 0, stream>>>(E, (const uint32_t *)g->amax.p, NULL, fmax,
                                                                        g->cfg.power_of_2, (float *)tg->scale->p,
                                                                        (float *)tg->inv->p);
        LAUNCH_CHECK(host, "scales_kernel");
    }
    for (int64_t first = 0; first < g->active_count; first += TABLE_MAX) {
        const int64_t count = g->active_count - first < TABLE_MAX ? g->active_count - first : TABLE_MAX;
        mat_table t;
        int64_t tiles = 0;
        table_fill(g, first, count, &spec, &t, &tiles);
        table_rows(gm->rows_per_expert, &t);
        if (!transposed && !is_blockwise(g)) {
            cast_rows_kernel<T><<<dim3(grid_chunks(&t, cols), (unsigned)t.count), 256, 0, stream>>>(
                t, src, cols, (uint8_t *)tg->bytes->p, fmt, (const float *)tg->scale->p, NULL, 0, 0, rec_amax, rec_seen);
            LAUNCH_CHECK(host, "cast_rows_kernel");
        } else if (!transposed) {
            const int64_t warps = t.row_start[t.count]; /* one per padded row */
            const unsigned blocks = (unsigned)ceil_div(warps * 32, 256);
            if (rows_wide_ok(g, src, cols)) {
                block_rows_wide_kernel<<<blocks, 256, 0, stream>>>(t, (const __nv_bfloat16 *)src, cols,
                                                                   (uint8_t *)tg->bytes->p, fmt, fmax,
                                                                   g->cfg.power_of_2, g->vec_layout, (float *)tg->blk->p);
                LAUNCH_CHECK(host, "block_rows_wide_kernel");
            } else {
                block_rows_kernel<T><<<blocks, 256, 0, stream>>>(t, src, cols, (uint8_t *)tg->bytes->p, fmt, fmax,
                                                                 g->cfg.power_of_2, g->vec_layout, (float *)tg->blk->p);
                LAUNCH_CHECK(host, "block_rows_kernel");
            }
        } else if (tiles > 0) {
            const int mode = is_blockwise(g) ? SCALE_ALONG_ROWS : SCALE_TENSOR;
            cast_transpose_kernel<T><<<(unsigned)tiles, 256, 0, stream>>>(
                t, src, cols, (uint8_t *)tg->bytes->p, fmt, mode, (const float *)tg->scale->p, NULL, 0, 0, fmax,
                g->cfg.power_of_2, g->vec_layout, is_blockwise(g) ? (float *)tg->blk->p : NULL, rec_amax, rec_seen);
            LAUNCH_CHECK(host, "cast_transpose_kernel");
        }
    }
    return MOERT_OK;
}

/* quantize_activation_t for the activation dtype (bf16 or fp32). */
static moert_result quantize_activation(moert_fp8_cuda *g, cudaStream_t stream, const moert_fp8_cuda_gemm *gm,
                                        const void *src, int64_t cols, int operand, int transposed, act_target *tg)
{
    if (gm->act_dtype == MOERT_BF16)
        return quantize_activation_t<__nv_bfloat16>(g, stream, gm, (const __nv_bfloat16 *)src, cols, operand,
                                                    transposed, tg);
    return quantize_activation_t<float>(g, stream, gm, (const float *)src, cols, operand, transposed, tg);
}

/* A table of all E experts' weights ([K][N] each) for the weight kernels; experts first .. first+count. */
static void weight_table(int64_t first, int64_t count, int64_t K, int64_t N, int transposed, mat_table *t,
                         int64_t *tiles)
{
    memset(t, 0, sizeof *t);
    t->count = (int32_t)count;
    const int64_t CT = ceil_div(N, CT_COLS);
    int64_t tile = 0;
    for (int64_t j = 0; j < count; j++) {
        const int64_t e = first + j;
        t->expert[j] = (int32_t)e;
        t->rows[j] = (int32_t)K;
        t->src_row0[j] = e * K;
        t->dst_off[j] = e * K * N;
        t->dst_ld[j] = (int32_t)(transposed ? K : N);
        t->tile_start[j] = (int32_t)tile;
        tile += ceil_div(K, TILE) * CT;
    }
    t->tile_start[count] = (int32_t)tile;
    *tiles = tile;
}

/* The blockwise recipe's buffers of a cached weight's 128x128 tile scales and their factors in both layouts. */
static moert_result tile_scale_buffers(moert_fp8_cuda *g, weight_cache *c)
{
    const int64_t E = g->cfg.num_experts, KB = ceil_div(c->k, TILE), NB = ceil_div(c->n, TILE);
    c->tile_stride = round_up(KB * NB, 4);
    c->blk_stride = blk_floats(NB > KB ? NB : KB, NB > KB ? NB : KB);
    MOK(buf_reserve(g, &c->tile_scale, (size_t)(E * c->tile_stride) * 4));
    MOK(buf_reserve(g, &c->inv_fwd, (size_t)(E * c->blk_stride) * 4));
    return buf_reserve(g, &c->inv_dgrad, (size_t)(E * c->blk_stride) * 4);
}

/* The scales of a cached weight (per-tensor, or 128x128 tiles) and, for the delayed recipe, its amaxes. */
template <typename T>
static moert_result weight_scales_t(moert_fp8_cuda *g, cudaStream_t stream, int which, weight_cache *c, const T *w)
{
    const moert_host *host = g->host;
    const int64_t E = g->cfg.num_experts, K = c->k, N = c->n;
    const float fmax = E4M3_MAX;
    if (is_blockwise(g)) {
        const int64_t KB = ceil_div(K, TILE), NB = ceil_div(N, TILE);
        MOK(tile_scale_buffers(g, c));
        if (E > 0) {
            tile_scales_kernel<T><<<dim3((unsigned)NB, (unsigned)KB, (unsigned)E), 256, 0, stream>>>(
                w, K, N, fmax, g->cfg.power_of_2, g->blk_layout, (float *)c->tile_scale.p, c->tile_stride,
                (float *)c->inv_fwd.p, (float *)c->inv_dgrad.p, c->blk_stride);
            LAUNCH_CHECK(host, "tile_scales_kernel");
        }
        return MOERT_OK;
    }
    MOK(buf_reserve(g, &c->scale, (size_t)(4 * E) * 4));
    MOK(buf_reserve(g, &c->inv, (size_t)(4 * E) * 4));
    MOK(buf_reserve(g, &c->amax, (size_t)E * 4));
    CUDA_CHECK(host, cudaMemsetAsync(c->amax.p, 0, (size_t)E * 4, stream));
    for (int64_t first = 0; first < E; first += TABLE_MAX) {
        const int64_t count = E - first < TABLE_MAX ? E - first : TABLE_MAX;
        mat_table t;
        int64_t tiles;
        weight_table(first, count, K, N, 0, &t, &tiles);
        amax_kernel<T><<<dim3(grid_chunks(&t, N), (unsigned)count), 256, 0, stream>>>(t, w, N, (uint32_t *)c->amax.p);
        LAUNCH_CHECK(host, "amax_kernel");
    }
    const float *slot = g->cfg.recipe == MOERT_FP8_CUDA_DELAYED
                            ? (const float *)g->slot_scale.p + slot_base(g, which, OP_WEIGHT) : NULL;
    if (E > 0) {
        scales_kernel<<<(unsigned)ceil_div(E, 128), 128, 0, stream>>>(E, (const uint32_t *)c->amax.p, slot, fmax,
                                                                        g->cfg.power_of_2, (float *)c->scale.p,
                                                                        (float *)c->inv.p);
        LAUNCH_CHECK(host, "scales_kernel");
    }
    return MOERT_OK;
}

/* One FP8 layout of a cached weight: fwd ([N][K] per expert) or dgrad ([K][N], as stored). */
template <typename T>
static moert_result weight_cast_t(moert_fp8_cuda *g, cudaStream_t stream, weight_cache *c, const T *w, int fwd)
{
    const moert_host *host = g->host;
    const int64_t E = g->cfg.num_experts, K = c->k, N = c->n;
    dev_buf *dst = fwd ? &c->fwd : &c->dgrad;
    MOK(buf_grow(g, dst, (size_t)(E * K * N), 0));
    const int blk = is_blockwise(g);
    const int64_t NB = ceil_div(N, TILE);
    for (int64_t first = 0; first < E; first += TABLE_MAX) {
        const int64_t count = E - first < TABLE_MAX ? E - first : TABLE_MAX;
        mat_table t;
        int64_t tiles;
        weight_table(first, count, K, N, fwd, &t, &tiles);
        if (fwd) {
            cast_transpose_kernel<T><<<(unsigned)tiles, 256, 0, stream>>>(
                t, w, N, (uint8_t *)dst->p, 0, blk ? SCALE_TILE2D : SCALE_TENSOR, (const float *)c->scale.p,
                (const float *)c->tile_scale.p, c->tile_stride, NB, E4M3_MAX, g->cfg.power_of_2, g->vec_layout, NULL,
                NULL, NULL);
            LAUNCH_CHECK(host, "cast_transpose_kernel (weight)");
        } else {
            cast_rows_kernel<T><<<dim3(grid_chunks(&t, N), (unsigned)count), 256, 0, stream>>>(
                t, w, N, (uint8_t *)dst->p, 0, (const float *)c->scale.p, blk ? (const float *)c->tile_scale.p : NULL,
                c->tile_stride, NB, NULL, NULL);
            LAUNCH_CHECK(host, "cast_rows_kernel (weight)");
        }
    }
    g->stats.weight_quantizations++;
    return MOERT_OK;
}

/* Both FP8 layouts of a cached weight in one pass (weight_layouts_kernel); blockwise: its tile scales too. */
template <typename T>
static moert_result weight_both_t(moert_fp8_cuda *g, cudaStream_t stream, weight_cache *c, const T *w)
{
    const int64_t E = g->cfg.num_experts, K = c->k, N = c->n;
    const int blk = is_blockwise(g);
    if (blk) MOK(tile_scale_buffers(g, c));
    MOK(buf_grow(g, &c->fwd, (size_t)(E * K * N), 0));
    MOK(buf_grow(g, &c->dgrad, (size_t)(E * K * N), 0));
    if (E > 0) {
        weight_layouts_kernel<T><<<dim3((unsigned)ceil_div(N, TILE), (unsigned)ceil_div(K, TILE), (unsigned)E), 256, 0,
                                   stream>>>(
            w, K, N, blk ? NULL : (const float *)c->scale.p, E4M3_MAX, g->cfg.power_of_2, g->blk_layout,
            blk ? (float *)c->tile_scale.p : NULL, c->tile_stride, blk ? (float *)c->inv_fwd.p : NULL,
            blk ? (float *)c->inv_dgrad.p : NULL, c->blk_stride, (uint8_t *)c->fwd.p, (uint8_t *)c->dgrad.p);
        LAUNCH_CHECK(g->host, "weight_layouts_kernel");
    }
    g->stats.weight_quantizations += 2;
    return MOERT_OK;
}

/* Makes the scales and the asked layouts of cache c from its source. Both layouts at once (end_step) take one read
 * of the weight; blockwise, the tile scales come out of the same pass (per-tensor scales are made first). */
static moert_result weight_make(moert_fp8_cuda *g, cudaStream_t stream, int which, weight_cache *c, int fwd, int dgrad)
{
    const int both = fwd && dgrad && !c->fwd_valid && !c->dgrad_valid;
    if (!c->scales_valid && !(both && is_blockwise(g))) {
        if (c->dtype == MOERT_BF16) MOK(weight_scales_t<__nv_bfloat16>(g, stream, which, c, (const __nv_bfloat16 *)c->source));
        else MOK(weight_scales_t<float>(g, stream, which, c, (const float *)c->source));
        c->scales_valid = 1;
    }
    if (both) {
        if (c->dtype == MOERT_BF16) MOK(weight_both_t<__nv_bfloat16>(g, stream, c, (const __nv_bfloat16 *)c->source));
        else MOK(weight_both_t<float>(g, stream, c, (const float *)c->source));
        c->scales_valid = c->fwd_valid = c->dgrad_valid = 1;
        return MOERT_OK;
    }
    if (fwd && !c->fwd_valid) {
        if (c->dtype == MOERT_BF16) MOK(weight_cast_t<__nv_bfloat16>(g, stream, c, (const __nv_bfloat16 *)c->source, 1));
        else MOK(weight_cast_t<float>(g, stream, c, (const float *)c->source, 1));
        c->fwd_valid = 1;
    }
    if (dgrad && !c->dgrad_valid) {
        if (c->dtype == MOERT_BF16) MOK(weight_cast_t<__nv_bfloat16>(g, stream, c, (const __nv_bfloat16 *)c->source, 0));
        else MOK(weight_cast_t<float>(g, stream, c, (const float *)c->source, 0));
        c->dgrad_valid = 1;
    }
    return MOERT_OK;
}

/* The FP8 copy of gm's weight in the layout its pass needs: kept while the weight pointer and shape stay (until
 * end_step), else made now. */
static moert_result weight_get(moert_fp8_cuda *g, cudaStream_t stream, const moert_fp8_cuda_gemm *gm,
                               weight_cache **out)
{
    weight_cache *c = &g->weights[gm->which];
    if (c->source != gm->weight || c->dtype != gm->weight_dtype || c->k != gm->k_in || c->n != gm->n_out) {
        c->source = gm->weight;
        c->dtype = gm->weight_dtype;
        c->k = gm->k_in;
        c->n = gm->n_out;
        c->scales_valid = c->fwd_valid = c->dgrad_valid = 0;
    }
    const int fwd = gm->pass == MOERT_GEMM_FORWARD;
    moert_result rc = weight_make(g, stream, gm->which, c, fwd, !fwd);
    if (rc != MOERT_OK) {
        c->source = NULL;
        return rc;
    }
    *out = c;
    return MOERT_OK;
}

/*
 * BLK_ORDER_WEIGHT_B's outputs back to the caller's layout: matrix i is stored column-major [rows x cols] with
 * leading dimension t.dst_ld[i] at element src_row0[i] of src, and goes row-major [rows][cols] to element
 * dst_off[i] of dst. 32x32 tiles through shared memory; grid (tiles of the largest matrix, matrices); T is the
 * element's bits (2 or 4 bytes).
 */
template <typename T>
__global__ void untranspose_kernel(const mat_table t, const T *__restrict__ src, int64_t cols, T *__restrict__ dst)
{
    __shared__ T tile[32][33];
    const int i = blockIdx.y;
    const int64_t rows = t.rows[i], ld = t.dst_ld[i];
    const int64_t rtiles = (rows + 31) / 32, ctiles = (cols + 31) / 32;
    if ((int64_t)blockIdx.x >= rtiles * ctiles) return;
    const int64_t r0 = ((int64_t)blockIdx.x % rtiles) * 32, c0 = ((int64_t)blockIdx.x / rtiles) * 32;
    const T *s = src + t.src_row0[i];
    T *d = dst + t.dst_off[i];
    for (int j = threadIdx.y; j < 32; j += blockDim.y) {
        const int64_t c = c0 + j, r = r0 + threadIdx.x;
        if (c < cols && r < rows) tile[j][threadIdx.x] = s[c * ld + r];
    }
    __syncthreads();
    for (int j = threadIdx.y; j < 32; j += blockDim.y) {
        const int64_t r = r0 + j, c = c0 + threadIdx.x;
        if (c < cols && r < rows) d[r * cols + c] = tile[threadIdx.x][j];
    }
}

/* ---- cuBLASLt matmuls ---- */

/* Largest power of two (<= 256) dividing the address. */
static int32_t pointer_alignment(const void *p)
{
    uintptr_t a = (uintptr_t)p;
    int32_t align = 256;
    while (align > 1 && (a % (uintptr_t)align) != 0) align /= 2;
    return align;
}

/* The row count a plan is chosen for: few buckets, as in the bf16 path. */
static int64_t row_bucket(int64_t rows)
{
    if (rows <= 128) return rows <= 32 ? 32 : round_up(rows, 32);
    if (rows <= 1024) return round_up(rows, 128);
    for (int64_t p = 1024; p <= INT64_MAX / 4; p *= 2) {
        if (rows <= p + p / 2) return p + p / 2;
        if (rows <= 2 * p) return 2 * p;
    }
    return rows;
}

/* One expert's matmul, column-major: D[m x n] (+)= A^T B with A [k x m] (ld lda), B [k x n] (ld ldb). */
typedef struct expert_mm {
    cudaDataType_t a_type, b_type, d_type;
    int32_t a_mode, b_mode; /* cublasLtMatmulMatrixScale_t */
    int beta1;
    int row_dim;            /* ROW_N (FORWARD/DGRAD), ROW_K (WGRAD), ROW_M (BLK_ORDER_WEIGHT_B) */
    int64_t m, n, k, lda, ldb, ldd; /* ROW_M: ldd is round_up(m, 16) */
    const void *a, *b;
    void *d;
    const float *a_scale, *b_scale;
    int64_t expert;
    void *copy_to;     /* blockwise, weight as A: D went to a padded scratch; its first copy_bytes go here after */
    size_t copy_bytes;
} expert_mm;

/* The matmul descriptor for p's types and scale modes (TN, fp32 compute, no fast accumulation), made once. */
static moert_result desc_get(moert_fp8_cuda *g, const expert_mm *p, cublasLtMatmulDesc_t *out)
{
    const moert_host *host = g->host;
    for (int i = 0; i < g->desc_count; i++) {
        const desc_entry *d = &g->descs[i];
        if (d->a_type == (int32_t)p->a_type && d->b_type == (int32_t)p->b_type && d->a_mode == p->a_mode &&
            d->b_mode == p->b_mode) {
            *out = d->desc;
            return MOERT_OK;
        }
    }
    if (g->desc_count == MAX_DESCS) return report(host, MOERT_ERR_INTERNAL, "fp8 cuda: too many matmul descriptors");
    desc_entry *d = &g->descs[g->desc_count];
    CUBLAS_CHECK(host, cublasLtMatmulDescCreate(&d->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    g->desc_count++;
    d->a_type = (int32_t)p->a_type;
    d->b_type = (int32_t)p->b_type;
    d->a_mode = p->a_mode;
    d->b_mode = p->b_mode;
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    const int8_t fast = 0;
    CUBLAS_CHECK(host, cublasLtMatmulDescSetAttribute(d->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    CUBLAS_CHECK(host, cublasLtMatmulDescSetAttribute(d->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    CUBLAS_CHECK(host, cublasLtMatmulDescSetAttribute(d->desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof fast));
    CUBLAS_CHECK(host, cublasLtMatmulDescSetAttribute(d->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &d->a_mode,
                                                      sizeof d->a_mode));
    CUBLAS_CHECK(host, cublasLtMatmulDescSetAttribute(d->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &d->b_mode,
                                                      sizeof d->b_mode));
    *out = d->desc;
    return MOERT_OK;
}

/* The expert's row count in p (its m, n or k). */
static int64_t expert_rows(const expert_mm *p) { return p->row_dim == ROW_K ? p->k : p->row_dim == ROW_M ? p->m : p->n; }

/* Makes a layout describe type, rows x cols, ld, writing only what differs. */
static moert_result layout_fit(const moert_host *host, layout_state *s, cudaDataType_t type, int64_t rows, int64_t cols,
                               int64_t ld)
{
    if (s->type != (int32_t)type) {
        int32_t v = (int32_t)type;
        CUBLAS_CHECK(host, cublasLtMatrixLayoutSetAttribute(s->layout, CUBLASLT_MATRIX_LAYOUT_TYPE, &v, sizeof v));
        s->type = v;
    }
    if (s->rows != rows) {
        uint64_t v = (uint64_t)rows;
        CUBLAS_CHECK(host, cublasLtMatrixLayoutSetAttribute(s->layout, CUBLASLT_MATRIX_LAYOUT_ROWS, &v, sizeof v));
        s->rows = rows;
    }
    if (s->cols != cols) {
        uint64_t v = (uint64_t)cols;
        CUBLAS_CHECK(host, cublasLtMatrixLayoutSetAttribute(s->layout, CUBLASLT_MATRIX_LAYOUT_COLS, &v, sizeof v));
        s->cols = cols;
    }
    if (s->ld != ld) {
        CUBLAS_CHECK(host, cublasLtMatrixLayoutSetAttribute(s->layout, CUBLASLT_MATRIX_LAYOUT_LD, &ld, sizeof ld));
        s->ld = ld;
    }
    return MOERT_OK;
}

/* Fits the three layouts to p with the expert's row dimension set to rows (the bucket, or the real count). */
static moert_result layouts_fit(moert_fp8_cuda *g, const expert_mm *p, int64_t rows)
{
    const moert_host *host = g->host;
    int64_t m = p->m, n = p->n, k = p->k, lda = p->lda, ldb = p->ldb, ldd = p->ldd;
    if (p->row_dim == ROW_K) k = lda = ldb = rows;
    else if (p->row_dim == ROW_M) m = rows, ldd = round_up(rows, 16);
    else n = rows;
    MOK(layout_fit(host, &g->layout[0], p->a_type, k, m, lda));
    MOK(layout_fit(host, &g->layout[1], p->b_type, k, n, ldb));
    return layout_fit(host, &g->layout[2], p->d_type, m, n, ldd);
}

/* Writes the minimum pointer alignments into the preference, the ones that changed only. */
static moert_result pref_align_set(moert_fp8_cuda *g, const plan_key *key)
{
    const moert_host *host = g->host;
    const int32_t want[3] = {key->align_a, key->align_b, key->align_d};
    static const cublasLtMatmulPreferenceAttributes_t attr[3] = {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                                                 CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                                                 CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES};
    for (int i = 0; i < 3; i++) {
        if (g->pref_align[i] == want[i]) continue;
        g->pref_align[i] = 0;
        uint32_t v = (uint32_t)want[i];
        CUBLAS_CHECK(host, cublasLtMatmulPreferenceSetAttribute(g->pref, attr[i], &v, sizeof v));
        if (i == 2)
            CUBLAS_CHECK(host, cublasLtMatmulPreferenceSetAttribute(g->pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                                                    &v, sizeof v));
        g->pref_align[i] = want[i];
    }
    return MOERT_OK;
}

/* FNV-1a over a plan key. */
static uint64_t plan_hash(const plan_key *k)
{
    uint64_t h = 1469598103934665603ull;
    const unsigned char *b = (const unsigned char *)k;
    for (size_t i = 0; i < sizeof *k; i++) h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

/* Names for messages. */
static const char *type_name(cudaDataType_t t)
{
    switch (t) {
    case CUDA_R_8F_E4M3: return "e4m3";
    case CUDA_R_8F_E5M2: return "e5m2";
    case CUDA_R_16BF: return "bf16";
    case CUDA_R_32F: return "fp32";
    default: return "?";
    }
}

static const char *mode_name(int32_t m)
{
    return m == CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F ? "scalar" : m == CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F
                                                                          ? "vec128" : "blk128x128";
}

/* The plan of p for the bucket of its rows (exact = 0) or its exact shape; leaves the layouts fit to the query. */
static moert_result plan_get(moert_fp8_cuda *g, cublasLtMatmulDesc_t desc, const expert_mm *p, int64_t rows, int exact,
                             plan_entry **out)
{
    const moert_host *host = g->host;
    const int64_t queried = exact ? rows : row_bucket(rows);
    plan_key key;
    memset(&key, 0, sizeof key);
    key.a_type = (int32_t)p->a_type;
    key.b_type = (int32_t)p->b_type;
    key.d_type = (int32_t)p->d_type;
    key.a_mode = p->a_mode;
    key.b_mode = p->b_mode;
    key.beta1 = p->beta1;
    key.exact = exact;
    key.align_a = pointer_alignment(p->a);
    key.align_b = pointer_alignment(p->b);
    key.align_d = pointer_alignment(p->d);
    key.m = p->row_dim == ROW_M ? queried : p->m;
    key.n = p->row_dim == ROW_N ? queried : p->n;
    key.k = p->row_dim == ROW_K ? queried : p->k;
    const uint64_t home = plan_hash(&key) % PLAN_SLOTS;
    plan_entry *free_slot = NULL;
    for (int probe = 0; probe < PLAN_PROBES; probe++) {
        plan_entry *s = &g->plans[(home + (uint64_t)probe) % PLAN_SLOTS];
        if (s->valid && memcmp(&s->key, &key, sizeof key) == 0) {
            g->stats.cache_hits++;
            *out = s;
            return MOERT_OK;
        }
        if (!s->valid && !free_slot) free_slot = s;
    }
    plan_entry *slot = free_slot ? free_slot : &g->plans[home];
    slot->valid = 0;
    MOK(layouts_fit(g, p, queried));
    MOK(pref_align_set(g, &key));
    cublasLtMatmulHeuristicResult_t result;
    int found = 0;
    g->stats.heuristic_queries++;
    cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(g->lt, desc, g->layout[0].layout, g->layout[1].layout,
                                                       g->layout[2].layout, g->layout[2].layout, g->pref, 1, &result,
                                                       &found);
    if ((st != CUBLAS_STATUS_SUCCESS || found < 1) && !exact) return MOERT_ERR_UNSUPPORTED; /* the caller tries the
                                                                                              exact shape */
    if (st != CUBLAS_STATUS_SUCCESS || found < 1)
        return report(host, MOERT_ERR_UNSUPPORTED,
                      "fp8 cuda: cuBLASLt has no FP8 matmul for expert %lld: A %s (%s scales) x B %s (%s scales) -> %s%s, "
                      "m=%lld n=%lld k=%lld (%s)", (long long)p->expert, type_name(p->a_type), mode_name(p->a_mode),
                      type_name(p->b_type), mode_name(p->b_mode), type_name(p->d_type), p->beta1 ? " accumulated" : "",
                      (long long)key.m, (long long)key.n, (long long)key.k,
                      st != CUBLAS_STATUS_SUCCESS ? cublasLtGetStatusString(st) : "no algorithm found");
    slot->key = key;
    slot->algo = result.algo;
    slot->valid = 1;
    *out = slot;
    return MOERT_OK;
}

/* One expert's matmul on stream with a workspace slice: the bucket's plan, else an exact-shape plan. */
static moert_result matmul_expert(moert_fp8_cuda *g, cudaStream_t stream, void *workspace, const expert_mm *p)
{
    const moert_host *host = g->host;
    cublasLtMatmulDesc_t desc = NULL;
    MOK(desc_get(g, p, &desc));
    CUBLAS_CHECK(host, cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &p->a_scale,
                                                      sizeof p->a_scale));
    CUBLAS_CHECK(host, cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &p->b_scale,
                                                      sizeof p->b_scale));
    const int64_t rows = expert_rows(p);
    const float alpha = 1.0f, beta = p->beta1 ? 1.0f : 0.0f;
    cublasStatus_t st = CUBLAS_STATUS_NOT_SUPPORTED;
    for (int exact = 0; exact < 2; exact++) {
        plan_entry *plan = NULL;
        moert_result rc = plan_get(g, desc, p, rows, exact, &plan);
        if (rc != MOERT_OK) {
            if (!exact) { /* no plan for the bucket's shape: try the exact one */
                g->stats.exact_fallbacks++;
                continue;
            }
            return rc;
        }
        MOK(layouts_fit(g, p, rows));
        st = cublasLtMatmul(g->lt, desc, &alpha, p->a, g->layout[0].layout, p->b, g->layout[1].layout, &beta, p->d,
                            g->layout[2].layout, p->d, g->layout[2].layout, &plan->algo, workspace,
                            MOERT_FP8_CUDA_STREAM_WORKSPACE_BYTES, stream);
        if (st == CUBLAS_STATUS_SUCCESS) {
            g->stats.matmuls++;
            return MOERT_OK;
        }
        if (exact || (st != CUBLAS_STATUS_NOT_SUPPORTED && st != CUBLAS_STATUS_INVALID_VALUE)) break;
        g->stats.exact_fallbacks++;
    }
    return report(host, MOERT_ERR_CUDA, "cublasLtMatmul(fp8 expert %lld: %s x %s -> %s, m=%lld n=%lld k=%lld) failed: %s",
                  (long long)p->expert, type_name(p->a_type), type_name(p->b_type), type_name(p->d_type),
                  (long long)p->m, (long long)p->n, (long long)p->k, cublasLtGetStatusString(st));
}

/* Makes lanes 1 .. lanes-1 wait for the caller's stream. */
static moert_result lanes_fork(moert_fp8_cuda *g, cudaStream_t stream, int lanes)
{
    CUDA_CHECK(g->host, cudaEventRecord(g->fork_event, stream));
    for (int i = 1; i < lanes; i++) CUDA_CHECK(g->host, cudaStreamWaitEvent(g->lane_stream[i], g->fork_event, 0));
    return MOERT_OK;
}

/* Makes the caller's stream wait for lanes 1 .. lanes-1 (host NULL: keep an earlier error). */
static moert_result lanes_join(moert_fp8_cuda *g, const moert_host *host, cudaStream_t stream, int lanes)
{
    moert_result rc = MOERT_OK;
    for (int i = 1; i < lanes; i++) {
        cudaError_t err = cudaEventRecord(g->join_event[i], g->lane_stream[i]);
        if (err == cudaSuccess) err = cudaStreamWaitEvent(stream, g->join_event[i], 0);
        if (err != cudaSuccess && rc == MOERT_OK)
            rc = report(host, MOERT_ERR_CUDA, "joining internal stream %d back failed: %s", i, cudaGetErrorString(err));
    }
    return rc;
}

/* cuBLASLt's type of an FP8 format. */
static cudaDataType_t fp8_type(int fmt) { return fmt ? CUDA_R_8F_E5M2 : CUDA_R_8F_E4M3; }

/* ---- the grouped GEMM ---- */

/* Checks a raw GEMM description: pass, weight, dtypes, sizes (multiples of 16), pointers and alignment. */
static moert_result check_gemm(moert_fp8_cuda *g, const moert_fp8_cuda_gemm *gm)
{
    const moert_host *host = g->host;
    if (gm->pass != MOERT_GEMM_FORWARD && gm->pass != MOERT_GEMM_DGRAD && gm->pass != MOERT_GEMM_WGRAD)
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "fp8 cuda: unknown GEMM pass %d", (int)gm->pass);
    if (gm->which != MOERT_GEMM_FC1 && gm->which != MOERT_GEMM_FC2)
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "fp8 cuda: unknown weight %d", (int)gm->which);
    if (gm->num_experts != g->cfg.num_experts || (gm->num_experts > 0 && !gm->rows_per_expert))
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "fp8 cuda: %lld experts given, the handle has %lld",
                      (long long)gm->num_experts, (long long)g->cfg.num_experts);
    if (gm->act_dtype != MOERT_BF16 && gm->act_dtype != MOERT_F32)
        return report(host, MOERT_ERR_UNSUPPORTED, "fp8 cuda: activations must be bf16 or fp32, not %s",
                      moert_dtype_name(gm->act_dtype));
    if (gm->pass != MOERT_GEMM_WGRAD && gm->weight_dtype != MOERT_BF16 && gm->weight_dtype != MOERT_F32)
        return report(host, MOERT_ERR_UNSUPPORTED, "fp8 cuda: weights must be fp32 or bf16, not %s",
                      moert_dtype_name(gm->weight_dtype));
    if (gm->pass == MOERT_GEMM_WGRAD && gm->grad_weight_dtype != MOERT_BF16 && gm->grad_weight_dtype != MOERT_F32)
        return report(host, MOERT_ERR_UNSUPPORTED, "fp8 cuda: grad_weight must be fp32 or bf16, not %s",
                      moert_dtype_name(gm->grad_weight_dtype));
    if (gm->k_in <= 0 || gm->n_out <= 0 || gm->k_in % 16 || gm->n_out % 16)
        return report(host, MOERT_ERR_UNSUPPORTED, "fp8 cuda: k_in %lld and n_out %lld must be positive multiples of 16 "
                      "(cuBLASLt FP8 leading dimensions)", (long long)gm->k_in, (long long)gm->n_out);
    const int fwd = gm->pass == MOERT_GEMM_FORWARD, dgrad = gm->pass == MOERT_GEMM_DGRAD;
    if ((!dgrad && !gm->input) || (!fwd && !gm->grad_output) || (gm->pass != MOERT_GEMM_WGRAD && !gm->weight) ||
        (fwd && !gm->output) || (dgrad && !gm->grad_input) || (gm->pass == MOERT_GEMM_WGRAD && !gm->grad_weight))
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "fp8 cuda: the %s GEMM needs its two operands and its output",
                      fwd ? "forward" : dgrad ? "dgrad" : "wgrad");
    const size_t align = gm->act_dtype == MOERT_BF16 ? 8 : 16;
    const void *acts[2] = {gm->pass == MOERT_GEMM_DGRAD ? gm->grad_output : gm->input,
                           gm->pass == MOERT_GEMM_WGRAD ? gm->grad_output : NULL};
    for (int i = 0; i < 2; i++)
        if (acts[i] && (uintptr_t)acts[i] % align)
            return report(host, MOERT_ERR_INVALID_ARGUMENT, "fp8 cuda: %s activations must be %zu-byte aligned",
                          moert_dtype_name(gm->act_dtype), align);
    if (gm->pass != MOERT_GEMM_WGRAD && (uintptr_t)gm->weight % 16)
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "fp8 cuda: the weight must be 16-byte aligned");
    for (int64_t e = 0; e < gm->num_experts; e++)
        if (gm->rows_per_expert[e] < 0 || gm->rows_per_expert[e] > INT32_MAX / 2)
            return report(host, MOERT_ERR_INVALID_ARGUMENT, "fp8 cuda: expert %lld has %lld rows", (long long)e,
                          (long long)gm->rows_per_expert[e]);
    return MOERT_OK;
}

/* Rows, offsets and padded offsets (rows rounded up to align) of each expert; the non-empty experts in g->active. */
static void expert_offsets(moert_fp8_cuda *g, const int64_t *counts, int64_t align)
{
    int64_t row = 0, prow = 0;
    g->active_count = 0;
    for (int64_t e = 0; e < g->cfg.num_experts; e++) {
        g->row0[e] = row;
        g->prow0[e] = prow;
        g->rows16[e] = round_up(counts[e], align);
        row += counts[e];
        prow += g->rows16[e];
        if (counts[e] > 0) g->active[g->active_count++] = (int32_t)e;
    }
}

/* Whether cuBLASLt offers a matmul for p (the heuristic, for its shape as given; pointers aligned to 256). The
 * scale pointers name the workspace: cuBLASLt 13 answers a query for the block modes without scale pointers with
 * INVALID_VALUE (every matmul_expert sets the real ones). */
static moert_result matmul_available(moert_fp8_cuda *g, const expert_mm *p, int *found)
{
    cublasLtMatmulDesc_t desc = NULL;
    MOK(desc_get(g, p, &desc));
    const void *dummy = g->workspace.p;
    CUBLAS_CHECK(g->host, cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &dummy,
                                                         sizeof dummy));
    CUBLAS_CHECK(g->host, cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &dummy,
                                                         sizeof dummy));
    MOK(layouts_fit(g, p, expert_rows(p)));
    plan_key key;
    memset(&key, 0, sizeof key);
    key.align_a = key.align_b = key.align_d = 256;
    MOK(pref_align_set(g, &key));
    cublasLtMatmulHeuristicResult_t result;
    *found = 0;
    g->stats.heuristic_queries++;
    const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(g->lt, desc, g->layout[0].layout, g->layout[1].layout,
                                                             g->layout[2].layout, g->layout[2].layout, g->pref, 1,
                                                             &result, found);
    if (st != CUBLAS_STATUS_SUCCESS) *found = 0;
    return MOERT_OK;
}

/* The matmul of one expert of `rows` rows for a pass, with null pointers (for availability checks). */
static void matmul_shape(const moert_fp8_cuda *g, moert_gemm_pass pass, int64_t K, int64_t N, moert_dtype act,
                         moert_dtype grad_weight, int64_t rows, expert_mm *p)
{
    const int blk = is_blockwise(g), grad_fmt = operand_format(g, OP_GRAD);
    const int32_t scalar = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F, vec = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    const int32_t blk2d = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    memset(p, 0, sizeof *p);
    if (pass == MOERT_GEMM_WGRAD) {
        p->a_type = fp8_type(grad_fmt);
        p->b_type = CUDA_R_8F_E4M3;
        p->d_type = grad_weight == MOERT_BF16 ? CUDA_R_16BF : CUDA_R_32F;
        p->a_mode = p->b_mode = blk ? vec : scalar;
        p->beta1 = 1;
        p->row_dim = ROW_K;
        p->m = N, p->n = K, p->k = rows, p->lda = rows, p->ldb = rows, p->ldd = N;
        return;
    }
    const int fwd = pass == MOERT_GEMM_FORWARD;
    if (blk && g->blk_order == BLK_ORDER_WEIGHT_B) {
        p->a_type = fp8_type(fwd ? 0 : grad_fmt);
        p->b_type = CUDA_R_8F_E4M3;
        p->d_type = act == MOERT_BF16 ? CUDA_R_16BF : CUDA_R_32F;
        p->a_mode = vec;
        p->b_mode = blk2d;
        p->row_dim = ROW_M;
        p->m = rows, p->n = fwd ? N : K, p->k = fwd ? K : N;
        p->lda = p->ldb = p->k, p->ldd = round_up(rows, 16);
        return;
    }
    p->a_type = CUDA_R_8F_E4M3;
    p->b_type = fp8_type(fwd ? 0 : grad_fmt);
    p->d_type = act == MOERT_BF16 ? CUDA_R_16BF : CUDA_R_32F;
    p->a_mode = blk ? blk2d : scalar;
    p->b_mode = blk ? vec : scalar;
    p->m = fwd ? N : K, p->n = rows, p->k = fwd ? K : N;
    p->lda = p->ldb = p->k, p->ldd = p->m;
}

static const char *const pass_label[3] = {"forward", "dgrad", "wgrad"};

/*
 * Blockwise: which operand carries the weight in FORWARD/DGRAD (see BLK_ORDER_*), asked once with the heuristic
 * for a forward GEMM of K x N and 512 rows: the weight as A if cuBLASLt has that, else as B (kept even when
 * refused too, so the caller's error names the last order tried).
 */
static moert_result choose_blk_order(moert_fp8_cuda *g, int64_t K, int64_t N, moert_dtype act)
{
    if (!is_blockwise(g) || g->blk_order != BLK_ORDER_UNKNOWN) return MOERT_OK;
    for (int order = BLK_ORDER_WEIGHT_A; order <= BLK_ORDER_WEIGHT_B; order++) {
        g->blk_order = order;
        expert_mm p;
        matmul_shape(g, MOERT_GEMM_FORWARD, K, N, act, MOERT_F32, 512, &p);
        int found = 0;
        MOK(matmul_available(g, &p, &found));
        if (found) break;
    }
    return MOERT_OK;
}

extern "C" moert_result moert_fp8_cuda_check_support(moert_fp8_cuda *g, int64_t hidden, int64_t ffn_hidden,
                                                     moert_dtype act_dtype, moert_dtype grad_weight_dtype,
                                                     int fp8_wgrad)
{
    static const int64_t rows = 512;
    /* the blockwise kernel takes every shape the plugin accepts: only the passes on cuBLASLt are asked */
    if (!kernel_serves(g, MOERT_GEMM_FORWARD, 0)) MOK(choose_blk_order(g, hidden, 2 * ffn_hidden, act_dtype));
    for (int w = 0; w < 2; w++)
        for (int pass = 0; pass < 3; pass++) {
            if (kernel_serves(g, (moert_gemm_pass)pass, 1)) continue; /* overwriting: cuBLASLt's case, if any */
            if (pass == MOERT_GEMM_WGRAD && !fp8_wgrad) continue;    /* the bf16 GEMMs make the weight gradients */
            const int64_t K = w == 0 ? hidden : ffn_hidden, N = w == 0 ? 2 * ffn_hidden : hidden;
            expert_mm p;
            matmul_shape(g, (moert_gemm_pass)pass, K, N, act_dtype, grad_weight_dtype, rows, &p);
            int found = 0;
            MOK(matmul_available(g, &p, &found));
            if (!found)
                return report(g->host, MOERT_ERR_UNSUPPORTED,
                              "cuBLASLt on this GPU has no FP8 matmul for the fc%d %s GEMM of this recipe: A %s (%s "
                              "scales) x B %s (%s scales) -> %s%s, m=%lld n=%lld k=%lld%s%s", w + 1, pass_label[pass],
                              type_name(p.a_type), mode_name(p.a_mode), type_name(p.b_type), mode_name(p.b_mode),
                              type_name(p.d_type), p.beta1 ? " accumulated" : "", (long long)p.m, (long long)p.n,
                              (long long)p.k, is_blockwise(g) && pass != MOERT_GEMM_WGRAD
                                  ? " (the weight's 128x128 blocks tried as A and as B)" : "",
                              g->cfg.hybrid ? " (try \"format\": \"e4m3\")" : "");
        }
    return MOERT_OK;
}

/*
 * WGRAD's row padding: 16 (the FP8 leading dimension), or for the blockwise recipe 128 when cuBLASLt has no
 * VEC128 x VEC128 matmul whose reduction ends inside a 128-block (asked once, with the heuristic, for k = 144).
 */
static moert_result wgrad_row_align(moert_fp8_cuda *g, const moert_fp8_cuda_gemm *gm, int64_t *align)
{
    *align = MOERT_FP8_CUDA_ROW_ALIGN;
    if (!is_blockwise(g) || kernel_serves(g, MOERT_GEMM_WGRAD, gm->overwrite_grad_weight))
        return MOERT_OK; /* the kernel takes a reduction that ends inside a block */
    if (g->wgrad_align) {
        *align = g->wgrad_align;
        return MOERT_OK;
    }
    expert_mm p;
    matmul_shape(g, MOERT_GEMM_WGRAD, gm->k_in, gm->n_out, gm->act_dtype, gm->grad_weight_dtype, 144, &p);
    int found = 0;
    MOK(matmul_available(g, &p, &found));
    g->wgrad_align = found > 0 ? MOERT_FP8_CUDA_ROW_ALIGN : 128;
    *align = g->wgrad_align;
    return MOERT_OK;
}

/* Delayed recipe: the cached weight's amaxes count for the experts of this GEMM. */
static moert_result note_weight(moert_fp8_cuda *g, cudaStream_t stream, int which, const weight_cache *c)
{
    const int64_t base = slot_base(g, which, OP_WEIGHT);
    for (int64_t first = 0; first < g->active_count; first += TABLE_MAX) {
        const int64_t count = g->active_count - first < TABLE_MAX ? g->active_count - first : TABLE_MAX;
        mat_table t;
        memset(&t, 0, sizeof t);
        t.count = (int32_t)count;
        for (int64_t j = 0; j < count; j++) t.expert[j] = g->active[first + j];
        note_kernel<<<1, TABLE_MAX, 0, stream>>>(t, (const uint32_t *)c->amax.p, (uint32_t *)g->slot_amax.p + base,
                                                 (int *)g->slot_seen.p + base);
        LAUNCH_CHECK(g->host, "note_kernel");
    }
    return MOERT_OK;
}

/* Issues the experts' matmuls over the lanes: largest first, each to the lane with the fewest rows. */
static moert_result run_matmuls(moert_fp8_cuda *g, cudaStream_t stream, expert_mm *mms, int64_t count,
                                const int64_t *counts)
{
    if (count == 0) return MOERT_OK;
    const int lanes = g->streams < count ? g->streams : (int)count;
    if (lanes > 1) MOK(lanes_fork(g, stream, lanes));
    int64_t load[MOERT_FP8_CUDA_MAX_STREAMS] = {0};
    moert_result rc = MOERT_OK;
    for (int64_t i = 0; i < count && rc == MOERT_OK; i++) {
        int lane = 0;
        for (int s = 1; s < lanes; s++)
            if (load[s] < load[lane]) lane = s;
        load[lane] += counts[mms[i].expert];
        void *ws = (char *)g->workspace.p + (size_t)lane * MOERT_FP8_CUDA_STREAM_WORKSPACE_BYTES;
        cudaStream_t s = lane ? g->lane_stream[lane] : stream;
        rc = matmul_expert(g, s, ws, &mms[i]);
        if (rc == MOERT_OK && mms[i].copy_bytes) { /* the real rows of a padded D, on the same lane */
            const cudaError_t err = cudaMemcpyAsync(mms[i].copy_to, mms[i].d, mms[i].copy_bytes,
                                                    cudaMemcpyDeviceToDevice, s);
            if (err != cudaSuccess)
                rc = report(g->host, MOERT_ERR_CUDA, "cudaMemcpyAsync (fp8 expert %lld's output rows) failed: %s",
                            (long long)mms[i].expert, cudaGetErrorString(err));
        }
    }
    if (lanes > 1) {
        moert_result join = lanes_join(g, rc == MOERT_OK ? g->host : NULL, stream, lanes);
        if (rc == MOERT_OK) rc = join;
    }
    return rc;
}

/* Orders the matmuls by rows, largest first (ties: lower expert first); insertion sort, few experts. */
static void sort_by_rows(expert_mm *mms, int64_t count, const int64_t *counts)
{
    for (int64_t i = 1; i < count; i++) {
        expert_mm x = mms[i];
        int64_t j = i - 1;
        while (j >= 0 && (counts[mms[j].expert] < counts[x.expert] ||
                          (counts[mms[j].expert] == counts[x.expert] && mms[j].expert > x.expert))) {
            mms[j + 1] = mms[j];
            j--;
        }
        mms[j + 1] = x;
    }
}

/* BLK_ORDER_WEIGHT_B: the experts' transposed outputs in dscratch ([cols][rows16] each) into dst [rows][cols]. */
static moert_result untranspose(moert_fp8_cuda *g, cudaStream_t stream, const moert_fp8_cuda_gemm *gm, int64_t cols,
                                void *dst)
{
    const size_t es = moert_dtype_size(gm->act_dtype);
    for (int64_t first = 0; first < g->active_count; first += TABLE_MAX) {
        const int64_t count = g->active_count - first < TABLE_MAX ? g->active_count - first : TABLE_MAX;
        mat_table t;
        memset(&t, 0, sizeof t);
        t.count = (int32_t)count;
        int64_t tiles = 0;
        for (int64_t j = 0; j < count; j++) {
            const int64_t e = g->active[first + j];
            t.expert[j] = (int32_t)e;
            t.rows[j] = (int32_t)gm->rows_per_expert[e];
            t.dst_ld[j] = (int32_t)g->rows16[e];
            t.src_row0[j] = g->prow0[e] * cols;
            t.dst_off[j] = g->row0[e] * cols;
            const int64_t n = ceil_div(gm->rows_per_expert[e], 32) * ceil_div(cols, 32);
            if (n > tiles) tiles = n;
        }
        const dim3 grid((unsigned)tiles, (unsigned)count), block(32, 8);
        if (es == 2)
            untranspose_kernel<uint16_t><<<grid, block, 0, stream>>>(t, (const uint16_t *)g->dscratch.p, cols,
                                                                      (uint16_t *)dst);
        else
            untranspose_kernel<uint32_t><<<grid, block, 0, stream>>>(t, (const uint32_t *)g->dscratch.p, cols,
                                                                      (uint32_t *)dst);
        LAUNCH_CHECK(g->host, "untranspose_kernel");
    }
    return MOERT_OK;
}

/* WGRAD overwriting grad_weight: the gradient of an expert with no rows is zero, written on stream. */
static moert_result zero_empty_experts(moert_fp8_cuda *g, cudaStream_t stream, const moert_fp8_cuda_gemm *gm)
{
    const size_t slice = (size_t)gm->k_in * (size_t)gm->n_out * moert_dtype_size(gm->grad_weight_dtype);
    for (int64_t e = 0; e < gm->num_experts; e++) {
        if (gm->rows_per_expert[e] != 0) continue;
        cudaError_t err = cudaMemsetAsync((char *)gm->grad_weight + (size_t)e * slice, 0, slice, stream);
        if (err != cudaSuccess) {
            (void)cudaGetLastError();
            return report(g->host, MOERT_ERR_CUDA, "cudaMemsetAsync(grad_weight of expert %lld) failed: %s",
                          (long long)e, cudaGetErrorString(err));
        }
    }
    return MOERT_OK;
}

/*
 * The blockwise recipe's grouped GEMM on the wgmma kernel, from the operands quantized as for cuBLASLt (the same
 * bytes and factors; see the layouts at the top of precision_fp8_cuda.h), one group per non-empty expert:
 *   FORWARD/DGRAD: A = the activation rows at their padded offsets (1x128 factors at x + kb * rows16), B = the
 *     weight copy of the pass ([E][cols][reduction], 128x128 factors), D = the caller's rows (masked: no scratch).
 *   WGRAD: A = input^T [K][rows16], B = grad_output^T [N][rows16] (1x128 factors on both), D = grad_weight[e].
 */
static moert_result block_gemm(moert_fp8_cuda *g, cudaStream_t stream, const moert_fp8_cuda_gemm *gm,
                               const weight_cache *wc)
{
    const int64_t K = gm->k_in, N = gm->n_out, n_active = g->active_count;
    const int wgrad = gm->pass == MOERT_GEMM_WGRAD, fwd = gm->pass == MOERT_GEMM_FORWARD;
    const int grad_fmt = operand_format(g, OP_GRAD);
    const int matrix_count = wgrad ? (int)(2 * n_active) : 2;
    moert_fp8_block_matrix *mx = (moert_fp8_block_matrix *)calloc((size_t)matrix_count, sizeof *mx);
    moert_fp8_block_group *gr = (moert_fp8_block_group *)calloc((size_t)n_active, sizeof *gr);
    if (!mx || !gr) {
        free(mx);
        free(gr);
        return report(g->host, MOERT_ERR_OUT_OF_MEMORY, "fp8 cuda: out of host memory for %lld groups",
                      (long long)n_active);
    }
    moert_fp8_block_gemm call;
    memset(&call, 0, sizeof call);
    call.matrices = mx;
    call.matrix_count = matrix_count;
    call.groups = gr;
    call.group_count = (int)n_active;
    if (!wgrad) {
        const int64_t kk = fwd ? K : N, cols = fwd ? N : K; /* the reduction, the output's columns */
        const int64_t last = g->active[n_active - 1];
        const size_t act_es = moert_dtype_size(gm->act_dtype);
        char *dst = (char *)(fwd ? gm->output : gm->grad_input);
        const float *winv = (const float *)(fwd ? wc->inv_fwd.p : wc->inv_dgrad.p);
        mx[0] = (moert_fp8_block_matrix){g->act_b.p, g->prow0[last] + g->rows16[last], kk, kk};
        mx[1] = (moert_fp8_block_matrix){fwd ? wc->fwd.p : wc->dgrad.p, gm->num_experts * cols, kk, kk};
        call.a_format = fwd ? 0 : grad_fmt;
        call.b_format = 0;
        call.d_bf16 = gm->act_dtype == MOERT_BF16;
        for (int64_t j = 0; j < n_active; j++) {
            const int64_t e = g->active[j];
            gr[j] = (moert_fp8_block_group){0, 1, g->prow0[e], e * cols, gm->rows_per_expert[e], cols, kk,
                                            (const float *)g->b_blk.p + g->b_soff[e], g->rows16[e],
                                            winv + e * wc->blk_stride, round_up(ceil_div(kk, 128), 4),
                                            dst + (size_t)(g->row0[e] * cols) * act_es, cols};
        }
    } else {
        const size_t gw_es = moert_dtype_size(gm->grad_weight_dtype);
        call.a_format = 0;
        call.b_format = grad_fmt;
        call.b_per_row = 1;
        call.d_bf16 = gm->grad_weight_dtype == MOERT_BF16;
        call.accumulate = !gm->overwrite_grad_weight;
        for (int64_t j = 0; j < n_active; j++) {
            const int64_t e = g->active[j], r16 = g->rows16[e];
            mx[2 * j] = (moert_fp8_block_matrix){(const uint8_t *)g->act_b.p + (size_t)g->prow0[e] * K, K, r16, r16};
            mx[2 * j + 1] = (moert_fp8_block_matrix){(const uint8_t *)g->act_a.p + (size_t)g->prow0[e] * N, N, r16, r16};
            gr[j] = (moert_fp8_block_group){(int)(2 * j), (int)(2 * j + 1), 0, 0, K, N, r16,
                                            (const float *)g->b_blk.p + g->b_soff[e], K,
                                            (const float *)g->a_blk.p + g->a_soff[e], N,
                                            (char *)gm->grad_weight + (size_t)(e * K * N) * gw_es, N};
        }
    }
    const moert_result rc = moert_fp8_block_gemm_run(g->block, stream, &call);
    free(mx);
    free(gr);
    return rc;
}

/* One grouped GEMM: the weight's cached FP8 copy, the activations quantized, one matmul per non-empty expert. */
extern "C" moert_result moert_fp8_cuda_grouped_gemm(moert_fp8_cuda *g, cudaStream_t stream,
                                                    const moert_fp8_cuda_gemm *gm)
{
    MOK(check_gemm(g, gm));
    const moert_host *host = g->host;
    const int64_t K = gm->k_in, N = gm->n_out, E = gm->num_experts;
    int64_t align = MOERT_FP8_CUDA_ROW_ALIGN;
    if (gm->pass == MOERT_GEMM_WGRAD) MOK(wgrad_row_align(g, gm, &align));
    expert_offsets(g, gm->rows_per_expert, align);
    g->worst_rows = gm->capacity > 0 ? gm->capacity + (align - 1) * E : 0;
    memset(&g->last, 0, sizeof g->last);
    const int overwrite = gm->pass == MOERT_GEMM_WGRAD && gm->overwrite_grad_weight;
    if (overwrite) MOK(zero_empty_experts(g, stream, gm));
    if (g->active_count == 0) return MOERT_OK; /* nothing to compute; WGRAD would add zero (or has zeroed) */
    if (g->amax.cap < (size_t)E * 4) MOK(buf_reserve(g, &g->amax, (size_t)E * 4));
    const int blk = is_blockwise(g);
    const int delayed = g->cfg.recipe == MOERT_FP8_CUDA_DELAYED;
    const int32_t scalar = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
    const int32_t vec = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F, blk2d = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    const cudaDataType_t act_type = gm->act_dtype == MOERT_BF16 ? CUDA_R_16BF : CUDA_R_32F;
    const size_t act_es = moert_dtype_size(gm->act_dtype);
    expert_mm *mms = (expert_mm *)calloc((size_t)g->active_count, sizeof *mms);
    if (!mms) return report(host, MOERT_ERR_OUT_OF_MEMORY, "fp8 cuda: out of host memory for %lld matmuls",
                            (long long)g->active_count);
    moert_result rc = MOERT_OK;
    act_target ta = {&g->act_a, &g->a_scale, &g->a_inv, &g->a_blk, g->a_soff};
    act_target tb = {&g->act_b, &g->b_scale, &g->b_inv, &g->b_blk, g->b_soff};
    weight_cache *wc = NULL;
    int swapped = 0; /* BLK_ORDER_WEIGHT_B */
    const int grad_fmt = operand_format(g, OP_GRAD);
    if (gm->pass == MOERT_GEMM_FORWARD || gm->pass == MOERT_GEMM_DGRAD) {
        const int fwd = gm->pass == MOERT_GEMM_FORWARD;
        const int64_t kk = fwd ? K : N, mm = fwd ? N : K; /* the reduction, the output's columns */
        if ((rc = weight_get(g, stream, gm, &wc)) != MOERT_OK) goto done;
        if ((rc = quantize_activation(g, stream, gm, fwd ? gm->input : gm->grad_output, kk, fwd ? OP_INPUT : OP_GRAD, 0,
                                      &tb)) != MOERT_OK)
            goto done;
        if (delayed && (rc = note_weight(g, stream, gm->which, wc)) != MOERT_OK) goto done;
        const uint8_t *wbytes = (const uint8_t *)(fwd ? wc->fwd.p : wc->dgrad.p);
        const float *winv = blk ? (const float *)(fwd ? wc->inv_fwd.p : wc->inv_dgrad.p) : (const float *)wc->inv.p;
        const int64_t wstride = blk ? wc->blk_stride : 4;
        char *dst = (char *)(fwd ? gm->output : gm->grad_input);
        const int on_lt = blk && !kernel_serves(g, gm->pass, 0); /* cuBLASLt's blockwise matmuls */
        if (on_lt && (rc = choose_blk_order(g, K, N, gm->act_dtype)) != MOERT_OK) goto done;
        swapped = on_lt && g->blk_order == BLK_ORDER_WEIGHT_B;
        if (on_lt) { /* D goes through the same 16-row padding as the activation rows */
            const int64_t last = g->active[g->active_count - 1];
            if ((rc = buf_reserve_worst(g, &g->dscratch, (size_t)((g->prow0[last] + g->rows16[last]) * mm) * act_es,
                                        (size_t)(g->worst_rows * mm) * act_es)) != MOERT_OK)
                goto done;
        }
        for (int64_t j = 0; j < g->active_count; j++) {
            const int64_t e = g->active[j];
            const int64_t rows = gm->rows_per_expert[e];
            expert_mm *p = &mms[j];
            p->expert = e;
            g->a_off[e] = e * K * N;
            g->a_soff[e] = e * wstride;
            g->b_off[e] = (blk ? g->prow0[e] : g->row0[e]) * kk; /* blockwise: at the padded offset */
            if (swapped) { /* A = activation (VEC128), B = weight (BLK128x128), D transposed into dscratch */
                p->a_type = fp8_type(fwd ? 0 : grad_fmt);
                p->b_type = CUDA_R_8F_E4M3;
                p->d_type = act_type;
                p->a_mode = vec;
                p->b_mode = blk2d;
                p->row_dim = ROW_M;
                p->m = g->rows16[e];
                p->n = mm;
                p->k = kk;
                p->lda = kk;
                p->ldb = kk;
                p->ldd = g->rows16[e];
                p->a = (const uint8_t *)g->act_b.p + (size_t)g->b_off[e];
                p->b = wbytes + (size_t)e * K * N;
                p->d = (char *)g->dscratch.p + (size_t)(g->prow0[e] * mm) * act_es;
                p->a_scale = (const float *)g->b_blk.p + g->b_soff[e];
                p->b_scale = winv + e * wstride;
                continue;
            }
            p->a_type = CUDA_R_8F_E4M3;
            p->b_type = fp8_type(fwd ? 0 : grad_fmt);
            p->d_type = act_type;
            p->a_mode = blk ? blk2d : scalar;
            p->b_mode = blk ? vec : scalar;
            p->m = mm;
            p->n = blk ? g->rows16[e] : rows;
            p->k = kk;
            p->lda = kk;
            p->ldb = kk;
            p->ldd = mm;
            p->a = wbytes + (size_t)e * K * N;
            p->b = (const uint8_t *)g->act_b.p + (size_t)g->b_off[e];
            p->d = dst + (size_t)g->row0[e] * mm * act_es;
            if (blk && g->rows16[e] != rows) { /* the padded rows would spill into the next expert's */
                p->d = (char *)g->dscratch.p + (size_t)(g->prow0[e] * mm) * act_es;
                p->copy_to = dst + (size_t)g->row0[e] * mm * act_es;
                p->copy_bytes = (size_t)(rows * mm) * act_es;
            }
            p->a_scale = winv + e * wstride;
            p->b_scale = blk ? (const float *)g->b_blk.p + g->b_soff[e] : (const float *)g->b_inv.p + 4 * e;
        }
        g->last.a = wbytes;
        g->last.a_scale_inv = winv;
        g->last.a_scale = blk ? NULL : (const float *)wc->scale.p;
        g->last.a_format = 0;
        g->last.b_format = fwd ? 0 : grad_fmt;
    } else { /* WGRAD */
        if ((rc = quantize_activation(g, stream, gm, gm->grad_output, N, OP_GRAD, 1, &ta)) != MOERT_OK) goto done;
        if ((rc = quantize_activation(g, stream, gm, gm->input, K, OP_INPUT, 1, &tb)) != MOERT_OK) goto done;
        const cudaDataType_t gw_type = gm->grad_weight_dtype == MOERT_BF16 ? CUDA_R_16BF : CUDA_R_32F;
        const size_t gw_es = moert_dtype_size(gm->grad_weight_dtype);
        for (int64_t j = 0; j < g->active_count; j++) {
            const int64_t e = g->active[j];
            expert_mm *p = &mms[j];
            p->expert = e;
            p->a_type = fp8_type(grad_fmt);
            p->b_type = CUDA_R_8F_E4M3;
            p->d_type = gw_type;
            p->a_mode = blk ? vec : scalar;
            p->b_mode = blk ? vec : scalar;
            p->beta1 = !overwrite; /* overwrite: beta 0, the expert's gradient written, not added to */
            p->row_dim = ROW_K;
            p->m = N;
            p->n = K;
            p->k = g->rows16[e];
            p->lda = g->rows16[e];
            p->ldb = g->rows16[e];
            p->ldd = N;
            p->a = (const uint8_t *)g->act_a.p + (size_t)g->prow0[e] * N;
            p->b = (const uint8_t *)g->act_b.p + (size_t)g->prow0[e] * K;
            p->d = (char *)gm->grad_weight + (size_t)e * K * N * gw_es;
            p->a_scale = blk ? (const float *)g->a_blk.p + g->a_soff[e] : (const float *)g->a_inv.p + 4 * e;
            p->b_scale = blk ? (const float *)g->b_blk.p + g->b_soff[e] : (const float *)g->b_inv.p + 4 * e;
            g->a_off[e] = g->prow0[e] * N;
            g->b_off[e] = g->prow0[e] * K;
        }
        g->last.a = (const uint8_t *)g->act_a.p;
        g->last.a_scale_inv = blk ? (const float *)g->a_blk.p : (const float *)g->a_inv.p;
        g->last.a_scale = blk ? NULL : (const float *)g->a_scale.p;
        g->last.a_format = grad_fmt;
        g->last.b_format = 0;
    }
    g->last.b = (const uint8_t *)g->act_b.p;
    g->last.b_scale_inv = blk ? (const float *)g->b_blk.p : (const float *)g->b_inv.p;
    g->last.b_scale = blk ? NULL : (const float *)g->b_scale.p;
    g->last.a_offset = g->a_off;
    g->last.b_offset = g->b_off;
    g->last.a_scale_offset = g->a_soff;
    g->last.b_scale_offset = g->b_soff;
    g->last.rows16 = g->rows16;
    if (!blk && gm->pass != MOERT_GEMM_WGRAD)
        for (int64_t e = 0; e < E; e++) g->a_soff[e] = 4 * e;
    if (!blk)
        for (int64_t e = 0; e < E; e++) {
            g->b_soff[e] = 4 * e;
            if (gm->pass == MOERT_GEMM_WGRAD) g->a_soff[e] = 4 * e;
        }
    if (blk && kernel_serves(g, gm->pass, gm->overwrite_grad_weight)) {
        if (!g->quantize_only) rc = block_gemm(g, stream, gm, wc);
        goto done;
    }
    sort_by_rows(mms, g->active_count, gm->rows_per_expert);
    if (!g->quantize_only) rc = run_matmuls(g, stream, mms, g->active_count, gm->rows_per_expert);
    if (rc == MOERT_OK && swapped && !g->quantize_only)
        rc = untranspose(g, stream, gm, gm->pass == MOERT_GEMM_FORWARD ? N : K,
                         gm->pass == MOERT_GEMM_FORWARD ? gm->output : gm->grad_input);
done:
    free(mms);
    return rc;
}

/* After the optimizer step: delayed histories and scales, then the FP8 weight copies made again. */
extern "C" moert_result moert_fp8_cuda_end_step(moert_fp8_cuda *g, cudaStream_t stream)
{
    const moert_host *host = g->host;
    if (g->cfg.recipe == MOERT_FP8_CUDA_DELAYED && g->cfg.num_experts > 0) {
        const int64_t slots = 6 * g->cfg.num_experts;
        end_step_kernel<<<(unsigned)ceil_div(slots, 128), 128, 0, stream>>>(
            slots, g->cfg.num_experts, g->cfg.amax_history_len, (float *)g->history.p, (int32_t *)g->next.p,
            (int32_t *)g->filled.p, (float *)g->slot_scale.p, (uint32_t *)g->slot_amax.p, (int *)g->slot_seen.p,
            g->cfg.amax_most_recent, (int)g->cfg.margin, g->cfg.power_of_2, g->cfg.hybrid);
        LAUNCH_CHECK(host, "end_step_kernel");
    }
    for (int w = 0; w < 2; w++) { /* the weights changed: their FP8 copies are made again now */
        weight_cache *c = &g->weights[w];
        if (!c->source) continue;
        const int fwd = c->fwd_valid, dgrad = c->dgrad_valid;
        c->scales_valid = c->fwd_valid = c->dgrad_valid = 0;
        moert_result rc = weight_make(g, stream, w, c, fwd, dgrad);
        if (rc != MOERT_OK) {
            c->source = NULL;
            return rc;
        }
    }
    return MOERT_OK;
}

/* One delayed slot's scale, for tests (a stream sync). */
extern "C" moert_result moert_fp8_cuda_delayed_scale(moert_fp8_cuda *g, cudaStream_t stream, moert_gemm_weight which,
                                                     int operand, int64_t expert, float *out)
{
    const moert_host *host = g->host;
    if (g->cfg.recipe != MOERT_FP8_CUDA_DELAYED || operand < 0 || operand > 2 || expert < 0 ||
        expert >= g->cfg.num_experts)
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "fp8 cuda: no delayed slot (%d, %d, %lld)", (int)which, operand,
                      (long long)expert);
    const float *src = (const float *)g->slot_scale.p + slot_base(g, which, operand) + expert;
    CUDA_CHECK(host, cudaMemcpyAsync(out, src, sizeof *out, cudaMemcpyDeviceToHost, stream));
    CUDA_CHECK(host, cudaStreamSynchronize(stream));
    return MOERT_OK;
}
