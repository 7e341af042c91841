/* SPDX-License-Identifier: Apache-2.0 */
/* The device frame of the NVLink dispatchers' kernels (deepep_cuda.cu, hybridep_cuda.cu): memory-order primitives at
 * system scope (peers' memory over NVLink), the peer buffer's header, bounded waits on its flags, read-only loads of
 * a call's inputs, and the element types and packed loads of combine's sums. Each plugin adds its own flag protocol
 * and copies (deepep: NVLink copies by warps; hybridep: TMA bulk copies). Header-only, for one .cu file each. */
#ifndef MOERT_PEER_DISPATCH_CUH
#define MOERT_PEER_DISPATCH_CUH

#include <cuda_bf16.h>
#include <stdint.h>

#include "peer_buffer.h"

/* ---- memory-order primitives (system scope: peers' memory over NVLink) ---- */

__device__ __forceinline__ int64_t ld_acquire_sys(const int64_t *p)
{
    int64_t v;
    asm volatile("ld.acquire.sys.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void st_release_sys(int64_t *p, int64_t v)
{
    asm volatile("st.release.sys.global.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

/* The global timer in ns: the clock of every bounded wait. */
__device__ __forceinline__ uint64_t now_ns()
{
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

/* ---- the peer buffer's flags ---- */

/* The header (flags) of a rank's peer buffer. */
__device__ __forceinline__ peer_header *peer_header_at(void *buf) { return (peer_header *)buf; }

/* Spins until *p >= target, at most the call's timeout (k.timeout_ns); false once k.abort_flag is raised (an earlier
 * failure of the instance) or when the time runs out, after on_stall() (the plugin records the failure and raises
 * the flag). Call: a plugin's kernel view of a call (deepep_cuda_call, hybridep_cuda_call). */
template <typename Call, typename Stall>
__device__ __forceinline__ bool peer_wait_geq(const int64_t *p, int64_t target, const Call &k, Stall on_stall)
{
    if (ld_acquire_sys(p) >= target) return true;
    const uint64_t start = now_ns();
    while (ld_acquire_sys(p) < target) {
        if (*(volatile int *)k.abort_flag) return false;
        if (now_ns() - start > (uint64_t)k.timeout_ns) {
            on_stall();
            return false;
        }
    }
    return true;
}

/* Read-only loads of the call's inputs (never written while the kernel runs): the non-coherent path, no L1 line. */
__device__ __forceinline__ int4 load_ro(const int4 *p)
{
    int4 v;
    asm("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}
__device__ __forceinline__ uint32_t load_ro(const uint32_t *p) { return __ldg(p); }
__device__ __forceinline__ unsigned short load_ro(const unsigned short *p) { return __ldg(p); }

/* ---- combine's element types and packed loads ---- */

/* Element types of combine: a load through L2 (rows peers wrote), conversions to and from fp32. */
template <typename T> struct elem;
template <> struct elem<float> {
    static __device__ __forceinline__ float load(const float *p) { return __ldcg(p); }
    static __device__ __forceinline__ float to_f(float v) { return v; }
    static __device__ __forceinline__ float from_f(float v) { return v; }
};
template <> struct elem<__nv_bfloat16> {
    static __device__ __forceinline__ __nv_bfloat16 load(const __nv_bfloat16 *p)
    {
        __nv_bfloat16_raw r;
        r.x = __ldcg((const unsigned short *)p);
        return __nv_bfloat16(r);
    }
    static __device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
    static __device__ __forceinline__ __nv_bfloat16 from_f(float v) { return __float2bfloat16_rn(v); }
};

/* N values of T as one access (16 bytes when N * sizeof(T) == 16). */
template <typename T, int N> struct alignas(sizeof(T) * N) pack {
    T v[N];
};

/* N values at p through L2: one 16-byte load when they make 16 bytes, else one load each. */
template <typename T, int N> __device__ __forceinline__ pack<T, N> load_pack(const T *p)
{
    pack<T, N> r;
    if (N * sizeof(T) == 16) {
        int4 raw = __ldcg((const int4 *)p);
        r = *(pack<T, N> *)&raw;
    } else {
#pragma unroll
        for (int j = 0; j < N; j++) r.v[j] = elem<T>::load(p + j);
    }
    return r;
}

#endif
