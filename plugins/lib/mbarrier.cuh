/* Shared-memory mbarriers and TMA loads for the plugins' CUDA kernels (Hopper, sm_90): a stage of a pipeline is
 * filled by bulk or tensor copies that complete on its mbarrier, and consumers wait on the barrier's phase parity.
 * Header-only, device code. */
#ifndef MOERT_PLUGIN_MBARRIER_CUH
#define MOERT_PLUGIN_MBARRIER_CUH

#include <stdint.h>

__device__ __forceinline__ uint32_t smem_addr(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

/* A barrier whose phase completes after `count` arrivals (and the transaction bytes announced in the phase). */
__device__ __forceinline__ void mbar_init_count(uint64_t *bar, uint32_t count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_init(uint64_t *bar) { mbar_init_count(bar, 1); }

/* Makes initialised barriers visible to the async proxy (TMA) and the other threads (with a __syncthreads after). */
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

/* Waits until the phase of parity `parity` has completed. */
__device__ __forceinline__ void mbar_wait(uint64_t *bar, uint32_t parity)
{
    uint32_t done = 0;
    while (!done)
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
            : "=r"(done)
            : "r"(smem_addr(bar)), "r"(parity)
            : "memory");
}

/* One arrival (release: this thread's earlier shared-memory writes are seen by whoever waits on the phase). */
__device__ __forceinline__ void mbar_arrive(uint64_t *bar)
{
    asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

/* One arrival that also announces `bytes` of copies completing on this phase. */
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t *bar, uint32_t bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}

/* Global -> shared bulk copy of `bytes` (a multiple of 16, both addresses 16-byte aligned), completing on bar. */
__device__ __forceinline__ void bulk_load(void *dst_smem, const void *src, uint32_t bytes, uint64_t *bar)
{
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     smem_addr(dst_smem)),
                 "l"(src), "r"(bytes), "r"(smem_addr(bar))
                 : "memory");
}

/* A 2-D tile through a tensor map (its box, swizzle and out-of-bounds zero fill): column c0, row c1. */
__device__ __forceinline__ void tensor_load_2d(void *dst_smem, const void *tensor_map, int32_t c0, int32_t c1,
                                               uint64_t *bar)
{
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
            smem_addr(dst_smem)),
        "l"(tensor_map), "r"(c0), "r"(c1), "r"(smem_addr(bar))
        : "memory");
}

/* A 3-D tile through a tensor map: coordinates c0 (innermost), c1, c2. */
__device__ __forceinline__ void tensor_load_3d(void *dst_smem, const void *tensor_map, int32_t c0, int32_t c1,
                                               int32_t c2, uint64_t *bar)
{
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}],"
                 " [%5];" ::"r"(smem_addr(dst_smem)),
                 "l"(tensor_map), "r"(c0), "r"(c1), "r"(c2), "r"(smem_addr(bar))
                 : "memory");
}

/* Shared -> global bulk copy of `bytes` (a multiple of 16, both addresses 16-byte aligned), in the current bulk
 * group of this thread. */
__device__ __forceinline__ void bulk_store(void *dst, const void *src_smem, uint32_t bytes)
{
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(smem_addr(src_smem)),
                 "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
/* This thread's bulk stores so far have read their shared memory (it may be written again). */
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
/* This thread's bulk stores so far are complete (written). */
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
/* Orders this thread's generic-proxy shared-memory writes before later async-proxy (bulk copy) reads of them. */
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

/* ---- clusters (thread block clusters of CTAs on neighbouring SMs) ---- */

/* Every thread of every CTA of the cluster arrives, then waits for all (release/acquire: shared-memory writes and
 * barrier arrivals made before are seen after). */
__device__ __forceinline__ void cluster_sync()
{
    asm volatile("barrier.cluster.arrive.release;\n barrier.cluster.wait.acquire;" ::: "memory");
}

/* One arrival on the barrier at the same shared-memory offset in CTA `rank` of the cluster. Default (CTA-scope
 * release) semantics: a cluster-scope release would wait for this thread's outstanding memory operations, which
 * costs the consumer a stall per k-block; handing back a stage needs no ordering beyond the wgmma reads it waited
 * for. */
__device__ __forceinline__ void mbar_arrive_cluster(uint64_t *bar, uint32_t rank)
{
    asm volatile("{\n .reg .b32 remote;\n mapa.shared::cluster.u32 remote, %0, %1;\n"
                 " mbarrier.arrive.shared::cluster.b64 _, [remote];\n}" ::"r"(smem_addr(bar)),
                 "r"(rank)
                 : "memory");
}

/* One arrival per warp, from its lane 0, on bar here and (with to_peer) on the barrier at the same offset in CTA
 * `rank` of the cluster. Every lane executes it: the arrivals are predicated, not branched around, so ptxas sees no
 * divergent path while wgmma are in flight. */
__device__ __forceinline__ void mbar_arrive_warp(uint64_t *bar, bool to_peer, uint32_t rank)
{
    __syncwarp();
    const uint32_t lane0 = (threadIdx.x % 32) == 0, peer = lane0 && to_peer;
    asm volatile("{\n .reg .pred p, q;\n .reg .b32 remote;\n setp.ne.b32 p, %1, 0;\n setp.ne.b32 q, %2, 0;\n"
                 " @p mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];\n"
                 " mapa.shared::cluster.u32 remote, %0, %3;\n"
                 " @q mbarrier.arrive.shared::cluster.b64 _, [remote];\n}" ::"r"(smem_addr(bar)),
                 "r"(lane0), "r"(peer), "r"(rank)
                 : "memory");
}

/* One arrival per warp on the barrier at bar's offset in every CTA of the cluster named in `ranks` (a mask of up to 32
 * ranks, this CTA's own included where set): lane r arrives at CTA r's (CTA-scope release, as mbar_arrive_cluster).
 * Every lane executes it (predicated, as mbar_arrive_warp). */
__device__ __forceinline__ void mbar_arrive_warp_ranks(uint64_t *bar, uint32_t ranks)
{
    __syncwarp();
    const uint32_t lane = threadIdx.x % 32, mine = (ranks >> lane) & 1u, target = mine ? lane : 0;
    asm volatile("{\n .reg .pred p;\n .reg .b32 remote;\n setp.ne.b32 p, %1, 0;\n"
                 " mapa.shared::cluster.u32 remote, %0, %2;\n"
                 " @p mbarrier.arrive.shared::cluster.b64 _, [remote];\n}" ::"r"(smem_addr(bar)),
                 "r"(mine), "r"(target)
                 : "memory");
}

/* As tensor_load_2d, but the tile lands at the same offset (and completes on the barrier at the same offset) in
 * every CTA of the cluster named by cta_mask. */
__device__ __forceinline__ void tensor_load_2d_multicast(void *dst_smem, const void *tensor_map, int32_t c0, int32_t c1,
                                                         uint64_t *bar, uint16_t cta_mask)
{
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
                 " [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(smem_addr(dst_smem)),
                 "l"(tensor_map), "r"(c0), "r"(c1), "r"(smem_addr(bar)), "h"(cta_mask)
                 : "memory");
}

/* Shared -> global through a tensor map: the box at column c0, row c1 (clipped to the tensor), in the current bulk
 * group of this thread. */
__device__ __forceinline__ void tensor_store_2d(const void *tensor_map, int32_t c0, int32_t c1, const void *src_smem)
{
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];" ::"l"(tensor_map),
                 "r"(c0), "r"(c1), "r"(smem_addr(src_smem))
                 : "memory");
}

/* Shared -> global through a 3-D tensor map: the box at c0 (innermost), c1, c2 (clipped to the tensor), in the current
 * bulk group of this thread. */
__device__ __forceinline__ void tensor_store_3d(const void *tensor_map, int32_t c0, int32_t c1, int32_t c2,
                                                const void *src_smem)
{
    asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%1, %2, %3}], [%4];" ::"l"(tensor_map),
                 "r"(c0), "r"(c1), "r"(c2), "r"(smem_addr(src_smem))
                 : "memory");
}

/* An L2 eviction policy for the cache_hint forms below: the lines they touch go first when L2 needs room (a stream
 * written once, so that the data read again stays). */
__device__ __forceinline__ uint64_t l2_evict_first_policy()
{
    uint64_t policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    return policy;
}

/* An L2 eviction policy whose lines stay while others can go: tiles read again by many CTAs. */
__device__ __forceinline__ uint64_t l2_evict_last_policy()
{
    uint64_t policy;
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
    return policy;
}

/* As tensor_load_2d, with an L2 eviction policy. */
__device__ __forceinline__ void tensor_load_2d_hint(void *dst_smem, const void *tensor_map, int32_t c0, int32_t c1,
                                                    uint64_t *bar, uint64_t policy)
{
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, "
        "{%2, %3}], [%4], %5;" ::"r"(smem_addr(dst_smem)),
        "l"(tensor_map), "r"(c0), "r"(c1), "r"(smem_addr(bar)), "l"(policy)
        : "memory");
}

/* As tensor_load_2d_multicast, with an L2 eviction policy. */
__device__ __forceinline__ void tensor_load_2d_multicast_hint(void *dst_smem, const void *tensor_map, int32_t c0,
                                                              int32_t c1, uint64_t *bar, uint16_t cta_mask,
                                                              uint64_t policy)
{
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
                 ".L2::cache_hint [%0], [%1, {%2, %3}], [%4], %5, %6;" ::"r"(smem_addr(dst_smem)),
                 "l"(tensor_map), "r"(c0), "r"(c1), "r"(smem_addr(bar)), "h"(cta_mask), "l"(policy)
                 : "memory");
}

/* As tensor_load_3d, with an L2 eviction policy. */
__device__ __forceinline__ void tensor_load_3d_hint(void *dst_smem, const void *tensor_map, int32_t c0, int32_t c1,
                                                    int32_t c2, uint64_t *bar, uint64_t policy)
{
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, "
        "{%2, %3, %4}], [%5], %6;" ::"r"(smem_addr(dst_smem)),
        "l"(tensor_map), "r"(c0), "r"(c1), "r"(c2), "r"(smem_addr(bar)), "l"(policy)
        : "memory");
}

/* As tensor_store_3d, with an L2 eviction policy (l2_evict_first_policy). */
__device__ __forceinline__ void tensor_store_3d_hint(const void *tensor_map, int32_t c0, int32_t c1, int32_t c2,
                                                     const void *src_smem, uint64_t policy)
{
    asm volatile(
        "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group.L2::cache_hint [%0, {%1, %2, %3}], [%4], %5;" ::"l"(
            tensor_map),
        "r"(c0), "r"(c1), "r"(c2), "r"(smem_addr(src_smem)), "l"(policy)
        : "memory");
}

/* As tensor_reduce_add_3d, with an L2 eviction policy (l2_evict_first_policy). */
__device__ __forceinline__ void tensor_reduce_add_3d_hint(const void *tensor_map, int32_t c0, int32_t c1, int32_t c2,
                                                          const void *src_smem, uint64_t policy)
{
    asm volatile("cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group.L2::cache_hint [%0, {%1, %2, "
                 "%3}], [%4], %5;" ::"l"(tensor_map),
                 "r"(c0), "r"(c1), "r"(c2), "r"(smem_addr(src_smem)), "l"(policy)
                 : "memory");
}

/* As tensor_store_3d, but adds the box into global memory (the addition is done by the memory system, element by
 * element: an fp32 tensor map adds in fp32). */
__device__ __forceinline__ void tensor_reduce_add_3d(const void *tensor_map, int32_t c0, int32_t c1, int32_t c2,
                                                     const void *src_smem)
{
    asm volatile(
        "cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2, %3}], [%4];" ::"l"(
            tensor_map),
        "r"(c0), "r"(c1), "r"(c2), "r"(smem_addr(src_smem))
        : "memory");
}

/* Global -> shared copy of 4 bytes through cp.async (no register round trip: the thread does not wait for the
 * load); with valid 0 it writes zeros and reads nothing (src need not point anywhere then). */
__device__ __forceinline__ void async_copy4(void *dst_smem, const void *src, bool valid)
{
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(smem_addr(dst_smem)), "l"(src), "r"(valid ? 4 : 0)
                 : "memory");
}

/* An arrival on bar once this thread's cp.async copies so far have landed; it counts toward the barrier's expected
 * arrivals (noinc), so count it in mbar_init_count. */
__device__ __forceinline__ void async_copy_arrive(uint64_t *bar)
{
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_addr(bar)) : "memory");
}

/* Named barrier `id` (1..15; 0 is __syncthreads) for `threads` threads (a multiple of 32). */
__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t threads)
{
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

/* Arrives at named barrier `id` without waiting: with `threads` counting both sides, the threads that bar.sync on it
 * go on once the arriving ones have arrived (a one-way hand-off between warpgroups). */
__device__ __forceinline__ void named_barrier_arrive(uint32_t id, uint32_t threads)
{
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

#endif
