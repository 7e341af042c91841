/* Hopper warpgroup MMA (wgmma) helpers for the plugins' CUDA kernels (sm_90a): shared-memory matrix descriptors for
 * tiles that TMA wrote with 128-byte swizzle, and the fence / commit / wait instructions around wgmma.mma_async.
 * Header-only, device code. */
#ifndef MOERT_PLUGIN_WGMMA_CUH
#define MOERT_PLUGIN_WGMMA_CUH

#include <stdint.h>

#include "mbarrier.cuh"

/* A K-major operand tile with 128-byte rows, 128-byte swizzle (as TMA writes it): 8-row groups 1024 bytes apart.
 * Advancing the start address by 32 bytes (+2 in the descriptor) moves to the next 32 bytes of K. */
__device__ __forceinline__ uint64_t wgmma_desc_k_sw128(const void *tile)
{
    const uint64_t addr = smem_addr(tile);
    return ((addr & 0x3ffff) >> 4) | (1ull << 16) | ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}

/* An MN-major operand tile stored as TMA writes boxes of 128 bytes of M (or N) by K rows with 128-byte swizzle:
 * within a box, K rows of 128 bytes, 8-row groups 1024 bytes apart (the stride byte offset); successive 128-byte
 * slices of M/N are whole boxes, chunk_bytes apart (the leading byte offset). Advancing the start address by
 * 16 rows (2048 bytes) moves to the next k16 slice. */
__device__ __forceinline__ uint64_t wgmma_desc_mn_sw128(const void *tile, uint32_t chunk_bytes)
{
    const uint64_t addr = smem_addr(tile);
    return ((addr & 0x3ffff) >> 4) | ((uint64_t)((chunk_bytes >> 4) & 0x3fff) << 16) |
           ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}

/* Orders earlier register writes of the accumulators before the next wgmma reads them. */
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
/* Closes the group of wgmma issued since the last commit. */
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
/* Waits until at most N committed groups are still running. */
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }

/* Gives back registers to the CTA (the producer warpgroup) or takes them (the consumers); every warp of the
 * warpgroup executes it. What the consumers take must not exceed what the producer gives back, or the increase
 * waits forever. */
template <int REGS>
__device__ __forceinline__ void warpgroup_registers_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(REGS)); }
template <int REGS>
__device__ __forceinline__ void warpgroup_registers_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(REGS)); }

#endif
