/* The per-expert prefix sums the device-count grouped GEMM kernels (device_gemm.cu, device_gemm_wgmma.cu) start
 * from: each expert's first row and first row tile, from the counts read on the device. Header-only, device code. */
#ifndef MOERT_PRECISION_BF16_EXPERT_PREFIX_CUH
#define MOERT_PRECISION_BF16_EXPERT_PREFIX_CUH

#include <stdint.h>

/* The inclusive prefix sum of v over the warp's lanes (all 32 present). */
template <typename T> __device__ __forceinline__ T warp_inclusive_sum(T v)
{
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const T u = __shfl_up_sync(0xffffffffu, v, off);
        if (lane >= off) v += u;
    }
    return v;
}

/*
 * Warp 0 reads the counts (once: one global round trip per block) and fills row_start[0..E] (each expert's first row,
 * clamped to the capacity; [E] is the end of the last) and tile_start[0..E] (each expert's first row tile of
 * tile_rows rows; [E] the total). Lane l handles a run of consecutive experts; row_start parks the clamped counts in between. The caller syncs.
 */
__device__ __forceinline__ void expert_prefix(const int64_t *counts, int E, int64_t cap, int tile_rows,
                                              int64_t *row_start, int *tile_start)
{
    const int lane = threadIdx.x & 31;
    const int per = (E + 31) / 32;
    const int e0 = min(E, lane * per), e1 = min(E, e0 + per);
    int64_t sum = 0;
    for (int e = e0; e < e1; e++) {
        const int64_t c = min(max(counts[e], (int64_t)0), cap);
        row_start[e] = c;
        sum += c;
    }
    const int64_t incl = warp_inclusive_sum(sum);
    int64_t at = incl - sum; /* rows of the experts before e0, unclamped */
    int tiles = 0;           /* row tiles of this lane's experts before e */
    for (int e = e0; e < e1; e++) {
        const int64_t c = row_start[e];
        const int64_t first = min(at, cap), end = min(at + c, cap);
        row_start[e] = first;
        tile_start[e] = tiles;
        tiles += (int)((end - first + tile_rows - 1) / tile_rows);
        at += c;
    }
    const int tincl = warp_inclusive_sum(tiles);
    for (int e = e0; e < e1; e++) tile_start[e] += tincl - tiles;
    if (lane == 31) {
        row_start[E] = min(incl, cap);
        tile_start[E] = tincl;
    }
}

#endif
