/* Hopper warpgroup MMA (wgmma) helpers for the plugins' CUDA kernels (sm_90a): shared-memory matrix descriptors for
 * tiles that TMA wrote with 128-byte swizzle, and the fence / commit / wait instructions around wgmma.mma_async.
 * Header-only, device code. */
#ifndef MOERT_PLUGIN_WGMMA_CUH
#define MOERT_PLUGIN_WGMMA_CUH

#include <stdint.h>

#include "mbarrier.cuh"

/* The accumulator operands of an inline-asm wgmma: %0 .. %63 (m64n128, fp32) and %0 .. %127 (m64n256), bound to
 * float d[64] / d[128] read and written. The descriptors and flags follow as %64 / %128 on. */
#define WGMMA_REGS_64                                                                                                  \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                           \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                                 \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                                 \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define WGMMA_REGS_128                                                                                                 \
    WGMMA_REGS_64 ", "                                                                                                 \
                  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "                   \
                  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "                   \
                  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "       \
                  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define WGMMA_OPERANDS_64(d)                                                                                           \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),        \
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),         \
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),        \
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]),        \
        "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]),        \
        "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),        \
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),        \
        "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define WGMMA_OPERANDS_128(d)                                                                                          \
    WGMMA_OPERANDS_64(d), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]),   \
        "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]),        \
        "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]),        \
        "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]),        \
        "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]),     \
        "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]),              \
        "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]),              \
        "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]),              \
        "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])

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
    return ((addr & 0x3ffff) >> 4) | ((uint64_t)((chunk_bytes >> 4) & 0x3fff) << 16) | ((uint64_t)(1024 >> 4) << 32) |
           (1ull << 62);
}

/* Byte offset of byte `byte` (0..127) of row `row` in a box of 128-byte rows laid out with TMA's 128-byte swizzle:
 * the 16-byte chunks of a row are permuted by row & 7. */
__device__ __forceinline__ int sw128_offset(int row, int byte)
{
    return row * 128 + ((((byte >> 4) ^ (row & 7))) << 4) + (byte & 15);
}

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WGMMA_DEVICE 1 /* the wgmma instructions exist (sm_90a); elsewhere the calls below compile to nothing */
#endif

/* d (+)= A (64 x 16, desc_a: M-major when M_MAJOR, else K-major) * B (16 x 256, desc_b: N-major when N_MAJOR, else
 * K-major); accumulate 0 ignores d's old values. */
template <int M_MAJOR, int N_MAJOR>
__device__ __forceinline__ void wgmma_m64n256k16(float *d, uint64_t desc_a, uint64_t desc_b, int accumulate)
{
#ifdef WGMMA_DEVICE
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %130, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" WGMMA_REGS_128
                 "}, %128, %129, p, 1, 1, %131, %132;\n}\n"
                 : WGMMA_OPERANDS_128(d)
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(M_MAJOR), "n"(N_MAJOR));
#endif
}

/* d (+)= A (64 x 16, M-major) * B (16 x 128, N-major); accumulate 0 ignores d's old values. */
__device__ __forceinline__ void wgmma_m64n128k16_mn(float *d, uint64_t desc_a, uint64_t desc_b, int accumulate)
{
#ifdef WGMMA_DEVICE
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" WGMMA_REGS_64
                 "}, %64, %65, p, 1, 1, 1, 1;\n}\n"
                 : WGMMA_OPERANDS_64(d)
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate));
#endif
}

/* Orders earlier register writes of the accumulators before the next wgmma reads them. */
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
/* Closes the group of wgmma issued since the last commit. */
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
/* Waits until at most N committed groups are still running. */
template <int N> __device__ __forceinline__ void wgmma_wait()
{
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

/* Gives back registers to the CTA (the producer warpgroup) or takes them (the consumers); every warp of the
 * warpgroup executes it. What the consumers take must not exceed what the producer gives back, or the increase
 * waits forever. */
template <int REGS> __device__ __forceinline__ void warpgroup_registers_dec()
{
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(REGS));
}
template <int REGS> __device__ __forceinline__ void warpgroup_registers_inc()
{
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(REGS));
}

#endif
