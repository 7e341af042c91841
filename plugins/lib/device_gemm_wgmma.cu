/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The Hopper engine of the device-count bf16 grouped GEMM (see device_gemm_wgmma.h and device_gemm.h).
 *
 * C[rows of e, N] = A[rows of e, K] @ B[e] over 128 x 256 output tiles, K in steps of 64 (one 128-byte swizzled row of
 * bf16), persistent CTAs of three warpgroups:
 *   FORWARD  A = input [rows][k_in],        B[e] = W[e] [k_in][n_out] (N contiguous: N-major, 4 TMA boxes of 64 x 64)
 *   DGRAD    A = grad_output [rows][n_out], B[e] = W[e]^T, W[e] stored [k_in][n_out] (K contiguous: one 64 x 256 box)
 * - Warp 0 computes each expert's first row and first row tile from the device counts (expert_prefix.cuh); then one
 *   thread of the producer warpgroup walks the CTA's tiles and loads each k-block's A (128 x 64) and B (256 x 64)
 *   through TMA into a ring of stages (A rows past the expert are loaded and multiplied but never stored; past the
 *   buffers TMA fills zeros; W is a 3-D tensor map, so a k-block never reaches into the next expert's weight).
 * - Two consumer warpgroups take 64 rows of the tile each: per k-block four wgmma m64n256k16 into the fp32
 *   accumulators (128 registers a thread), one k-block's group kept in flight; a stage goes back to the producer once
 *   the group that read it has completed.
 * - Epilogue: the tile goes to shared memory as bf16 in the 128-byte swizzled layout and TMA stores it (its 64-row
 *   halves that lie wholly inside the expert), or the threads copy it out row by row (an expert's last, partial
 *   tile), so rows past an expert (another expert's) are never written. TMA's store runs while the consumers go on.
 * - Order: an expert's tiles in bands of 8 row tiles, row tiles fastest: the CTAs running together share the band's
 *   A rows and read each column panel of W[e] once.
 */
#include "device_gemm_wgmma.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>

#include "mbarrier.cuh"
#include "plugin_cuda_check.h"
#include "wgmma.cuh"
#include "expert_prefix.cuh"

#define WG_BM            128
#define WG_BN            256
#define WG_BK            64 /* bf16 elements in one 128-byte row */
#define WG_STAGES        3
#define WG_THREADS       384                 /* producer warpgroup + two consumer warpgroups */
#define WG_BAND          8                   /* row tiles of an expert that run side by side */
#define WG_BOX_BYTES     8192                /* one TMA box: 64 rows of 128 bytes */
#define WG_A_BYTES       (WG_BM * WG_BK * 2) /* 16 KiB */
#define WG_B_BYTES       (WG_BN * WG_BK * 2) /* 32 KiB */
#define WG_STAGING_BYTES (WG_BM * WG_BN * 2) /* the bf16 output tile: 64 KiB */
#define WG_MAX_DEVICES   64
#define WG_UNIT_RING     8 /* the producer's work units, in shared memory, for the consumers (more than WG_STAGES) */

/* Bytes of dynamic shared memory with E experts: alignment slack, stages, output staging, barriers, the unit ring,
 * prefix arrays. */
static size_t wg_smem_bytes(int experts)
{
    return 1024 + (size_t)WG_STAGES * (WG_A_BYTES + WG_B_BYTES) + WG_STAGING_BYTES + 2 * WG_STAGES * sizeof(uint64_t) +
           WG_UNIT_RING * sizeof(int) + (size_t)(experts + 1) * (sizeof(int64_t) + sizeof(int));
}

/* What one launch needs, by value (the tensor maps must live in parameter or constant memory). */
typedef struct wg_params {
    CUtensorMap map_a; /* A [capacity][depth], boxes of 64 x 128 rows */
    CUtensorMap map_b; /* W [E][k_in][n_out], boxes of 64 x 64 (FORWARD) or 64 x 256 (DGRAD) */
    CUtensorMap map_d; /* C [capacity][out_cols], boxes of 64 x 64 rows */
    const int64_t *counts;
    __nv_bfloat16 *d;
    int32_t *work_counter; /* NULL: each CTA takes units blockIdx.x, + gridDim.x, ..; else handed out (wg_next_unit) */
    const int32_t *sm_yield; /* with work_counter: SMs to leave while it is > 0 (bf16_device_gemm_args), or NULL */
    int64_t capacity;
    int num_experts, n_tiles, k_blocks, out_cols;
} wg_params;

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WG_DEVICE 1
#endif

/* A CTA's output tile: expert e, row tile mt and column tile nt of it, its first row and how many rows it has. */
typedef struct wg_tile {
    int e, mt, nt, rows;
    int64_t row0;
} wg_tile;

/* Work unit u (the unit ranges of the experts follow their row tiles: expert e owns units tile_start[e] * n_tiles ..
 * tile_start[e + 1] * n_tiles - 1), ordered in bands of WG_BAND row tiles, row tiles fastest. */
__device__ __forceinline__ wg_tile wg_tile_at(const wg_params &p, const int64_t *row_start, const int *tile_start,
                                              int u)
{
    const int t = u / p.n_tiles;
    int lo = 0, hi = p.num_experts - 1; /* the last expert whose first row tile is <= t: it has t */
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (tile_start[mid] <= t)
            lo = mid;
        else
            hi = mid - 1;
    }
    wg_tile w;
    w.e = lo;
    const int m_tiles = tile_start[lo + 1] - tile_start[lo];
    const int local = u - tile_start[lo] * p.n_tiles, per_band = WG_BAND * p.n_tiles;
    const int band = local / per_band, rem = local % per_band;
    const int band_rows = min(WG_BAND, m_tiles - band * WG_BAND);
    w.mt = band * WG_BAND + rem % band_rows;
    w.nt = rem / band_rows;
    w.row0 = row_start[lo] + (int64_t)w.mt * WG_BM;
    w.rows = (int)min((int64_t)WG_BM, row_start[lo + 1] - w.row0);
    return w;
}

/* The CTA's next work unit after `prev` (first: none yet); `units` or more: none left. Static: blockIdx.x, then every
 * gridDim.x-th. Handed out (work_counter): the next unnumbered one, unless sm_yield asks for SMs and this CTA is among
 * the last that many (CTA 0 never yields, so every unit is taken). */
__device__ __forceinline__ int wg_next_unit(const wg_params &p, int units, int prev, bool first)
{
    if (!p.work_counter) return first ? (int)blockIdx.x : prev + (int)gridDim.x;
    if (p.sm_yield) {
        const int want = *(const volatile int32_t *)p.sm_yield;
        if (want > 0 && (int)blockIdx.x > 0 && (int)blockIdx.x >= (int)gridDim.x - want) return units;
    }
    return atomicAdd(p.work_counter, 1);
}

/* The producer thread: per tile, its unit into the ring slot the consumers read with the tile's first stage, and per
 * k-block, waits for the stage to be free, announces its bytes and starts the TMA loads of A's 128 rows and B's 256
 * columns. With no unit left it puts -1 in the ring and completes the next stage's barrier without bytes, which ends
 * the consumers; a handed-out schedule's last CTA to stop zeroes the counter for the next launch on its stream. */
template <int N_MAJOR>
__device__ __forceinline__ void wg_produce(const wg_params &p, const int64_t *row_start, const int *tile_start,
                                           int units, uint8_t *a_stages, uint8_t *b_stages, uint64_t *full,
                                           uint64_t *empty, int *unit_ring)
{
    int s = 0, u = 0;
    uint32_t phase = 0, it = 0;
    for (int t = 0;; t++) {
        u = wg_next_unit(p, units, u, t == 0);
        if (it >= WG_STAGES) mbar_wait(&empty[s], phase ^ 1);
        unit_ring[t % WG_UNIT_RING] = u < units ? u : -1;
        if (u >= units) {
            mbar_arrive(&full[s]);
            break;
        }
        const wg_tile w = wg_tile_at(p, row_start, tile_start, u);
        for (int kb = 0; kb < p.k_blocks; kb++, it++) {
            if (kb > 0 && it >= WG_STAGES) mbar_wait(&empty[s], phase ^ 1);
            mbar_arrive_expect_tx(&full[s], WG_A_BYTES + WG_B_BYTES);
            tensor_load_2d(a_stages + s * WG_A_BYTES, &p.map_a, kb * WG_BK, (int32_t)w.row0, &full[s]);
            uint8_t *b = b_stages + s * WG_B_BYTES;
            if (N_MAJOR) {
                for (int j = 0; j < WG_BN / 64; j++)
                    tensor_load_3d(b + j * WG_BOX_BYTES, &p.map_b, w.nt * WG_BN + j * 64, kb * WG_BK, w.e, &full[s]);
            } else {
                tensor_load_3d(b, &p.map_b, kb * WG_BK, w.nt * WG_BN, w.e, &full[s]);
            }
            if (++s == WG_STAGES) s = 0, phase ^= 1;
        }
    }
    if (p.work_counter && atomicAdd(p.work_counter + 1, 1) == (int)gridDim.x - 1) {
        p.work_counter[0] = 0; /* every CTA has stopped taking units */
        p.work_counter[1] = 0;
    }
}

/* Hands stage s back to the producer: one arrival per warp (the barrier counts the consumers' 8 warps). */
__device__ __forceinline__ void wg_release(uint64_t *empty, int s)
{
    __syncwarp();
    if (threadIdx.x % 32 == 0) mbar_arrive(&empty[s]);
}

/* The epilogue of consumer warpgroup c (its 64 rows of the tile): bf16 into its four swizzled boxes of the staging
 * area, then TMA stores them when all 64 rows are the expert's, else the threads copy the expert's rows out. */
__device__ __forceinline__ void wg_store(const wg_params &p, const wg_tile &w, int c, const float *acc, uint8_t *boxes)
{
    const int rows_here = w.rows - c * 64;
    if (rows_here <= 0) return;
    const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
    if (tid == 0) bulk_wait_read(); /* the last tile's TMA store has read the boxes */
    named_barrier_sync(1 + c, 128);
    const int r = warp * 16 + lane / 4, col0 = 2 * (lane % 4);
#pragma unroll
    for (int j = 0; j < WG_BN / 8; j++) {
        const int col = col0 + 8 * j, byte = (col % 64) * 2;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int row = r + 8 * h;
            __nv_bfloat162 *at = (__nv_bfloat162 *)(boxes + (col / 64) * WG_BOX_BYTES + sw128_offset(row, byte));
            *at = __floats2bfloat162_rn(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
        }
    }
    const int64_t row0 = w.row0 + c * 64;
    const int n0 = w.nt * WG_BN;
    if (rows_here >= 64) {
        fence_async_shared();
        named_barrier_sync(1 + c, 128);
        if (tid == 0) {
            for (int b = 0; b < WG_BN / 64 && n0 + b * 64 < p.out_cols; b++)
                tensor_store_2d(&p.map_d, n0 + b * 64, (int32_t)row0, boxes + b * WG_BOX_BYTES);
            bulk_commit();
        }
    } else {
        named_barrier_sync(1 + c, 128);
        for (int i = tid; i < 64 * (WG_BN / 8); i += 128) { /* 16-byte chunks: 32 per row */
            const int row = i / (WG_BN / 8), q = i % (WG_BN / 8), col = n0 + q * 8;
            if (row >= rows_here || col >= p.out_cols) continue;
            const uint4 v = *(const uint4 *)(boxes + (q / 8) * WG_BOX_BYTES + sw128_offset(row, (q % 8) * 16));
            *(uint4 *)(p.d + (row0 + row) * p.out_cols + col) = v;
        }
    }
}

/* A consumer warpgroup (c: rows c * 64 .. c * 64 + 63 of each tile). */
template <int N_MAJOR>
__device__ __forceinline__ void wg_consume(const wg_params &p, const int64_t *row_start, const int *tile_start,
                                           const uint8_t *a_stages, const uint8_t *b_stages, uint8_t *staging,
                                           uint64_t *full, uint64_t *empty, const int *unit_ring, int c)
{
    int s = 0;
    uint32_t phase = 0;
    uint8_t *boxes = staging + c * (WG_STAGING_BYTES / 2);
    for (int t = 0;; t++) {
        mbar_wait(&full[s], phase); /* the tile's first stage: its unit is in the ring (wg_produce) */
        const int u = unit_ring[t % WG_UNIT_RING];
        if (u < 0) break;
        const wg_tile w = wg_tile_at(p, row_start, tile_start, u);
        float acc[128];
        int prev = 0;
        for (int kb = 0; kb < p.k_blocks; kb++) {
            mbar_wait(&full[s], phase);
            const uint8_t *a = a_stages + s * WG_A_BYTES + c * 64 * 128;
            const uint8_t *b = b_stages + s * WG_B_BYTES;
            wgmma_fence();
#pragma unroll
            for (int k = 0; k < WG_BK / 16; k++) {
                const uint64_t da = wgmma_desc_k_sw128(a) + 2 * k;
                const uint64_t db =
                    N_MAJOR ? wgmma_desc_mn_sw128(b + k * 2048, WG_BOX_BYTES) : wgmma_desc_k_sw128(b) + 2 * k;
                wgmma_m64n256k16<0, N_MAJOR>(acc, da, db, (kb | k) != 0);
            }
            wgmma_commit();
            if (kb > 0) {
                wgmma_wait<1>(); /* the previous k-block's group is done: its stage is free */
                wg_release(empty, prev);
            }
            prev = s;
            if (++s == WG_STAGES) s = 0, phase ^= 1;
        }
        wgmma_wait<0>();
        wg_release(empty, prev);
        wg_store(p, w, c, acc, boxes);
    }
    if (threadIdx.x % 128 == 0) bulk_wait_all(); /* the boxes are read before the CTA's shared memory goes */
}

template <int N_MAJOR>
__global__ void __launch_bounds__(WG_THREADS, 1) bf16_wgmma_kernel(const __grid_constant__ wg_params p)
{
#ifdef WG_DEVICE
    extern __shared__ uint8_t smem_raw[];
    uint8_t *smem = (uint8_t *)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
    uint8_t *a_stages = smem;
    uint8_t *b_stages = a_stages + WG_STAGES * WG_A_BYTES;
    uint8_t *staging = b_stages + WG_STAGES * WG_B_BYTES;
    uint64_t *full = (uint64_t *)(staging + WG_STAGING_BYTES);
    uint64_t *empty = full + WG_STAGES;
    int *unit_ring = (int *)(empty + WG_STAGES);
    int64_t *row_start = (int64_t *)(unit_ring + WG_UNIT_RING);
    int *tile_start = (int *)(row_start + p.num_experts + 1);

    if (threadIdx.x < 32) expert_prefix(p.counts, p.num_experts, p.capacity, WG_BM, row_start, tile_start);
    if (threadIdx.x == 32) {
        for (int s = 0; s < WG_STAGES; s++) {
            mbar_init_count(&full[s], 1);
            mbar_init_count(&empty[s], 8); /* the consumers' warps */
        }
        mbar_init_fence();
    }
    __syncthreads();
    const int units = tile_start[p.num_experts] * p.n_tiles;
    const int wg = threadIdx.x / 128;
    if (wg == 0) {
        /* the consumers' increase, 256 x (232 - 168), must not exceed what this warpgroup gives back, 128 x (168 - 40) */
        warpgroup_registers_dec<40>();
        if (threadIdx.x == 0)
            wg_produce<N_MAJOR>(p, row_start, tile_start, units, a_stages, b_stages, full, empty, unit_ring);
    } else {
        warpgroup_registers_inc<232>();
        wg_consume<N_MAJOR>(p, row_start, tile_start, a_stages, b_stages, staging, full, empty, unit_ring, wg - 1);
    }
#endif
}

/* ---- WGRAD: dW[e] (+)= in[rows of e]^T @ d_out[rows of e] ----
 *
 * The output is the gradient [E][k_in][n_out] fp32 in tiles of 128 (k_in) x BN (n_out) per expert; the reduction runs
 * over the expert's rows, 64 at a time, so both operands are M/N-major in shared memory: A (128 columns of `in`, 64
 * rows: two boxes) and B (BN columns of d_out, the same rows: BN / 64 boxes), as TMA loads them. Two schedules:
 * - Ping-pong (BN 128), for experts of few rows (~512: deepseek-v3, qwen3), where writing a tile's fp32 gradient takes
 *   about as long as its MMA: each consumer warpgroup owns whole tiles (2 x m64n128 accumulators), the CTA's tiles
 *   alternating between the two, so one multiplies while the other puts its finished tile out. The main loops take
 *   turns (a named-barrier hand-off once a consumer has seen its tile's last stage arrive); besides keeping the tensor
 *   cores on one tile at a time, this keeps the shared ring's parity waits sound: a consumer never waits on a stage
 *   whose previous fill, for the other consumer, has not arrived yet.
 * - Cooperative (BN 256), for experts of many rows (mixtral), where the MMA dominates and the wider tile loads a
 *   quarter fewer operand bytes per flop: both consumers share each tile, 64 rows of k_in each (one m64n256
 *   accumulator).
 * The ping-pong runs in clusters (wgrad_cluster): of four CTAs on a 2 x 2 block of tiles of one expert where both tile
 * counts pair up, else of two on two neighbouring n_out tiles. CTAs on the same k_in tile multiply the same A, those on
 * the same n_out tile the same B: each loads half of a shared operand and TMA multicasts it into both, so a CTA reads
 * 128 KiB of operands from L2 per 128 x 128 tile and 512 rows instead of 256 KiB alone (192 KiB in a pair), while the
 * ping-pong keeps overlapping the fp32 writes; a consumer hands a stage back to every CTA that wrote into it. (The
 * cooperative schedule in clusters sharing operands, pairs along k_in sharing B and quads, was no faster at any preset
 * shape on an H100, so it runs single: bench/results/2026-11-27-wgrad-cooperative-clusters-*.)
 * The rows past an expert's last (another expert's, padding, or past the buffers) are zeroed in shared memory before
 * the expert's last k-block is multiplied. Epilogue: the ping-pong's goes through the storer thread (see
 * wgrad_storer); the cooperative consumer's 64 x 256 fp32 result goes out in its rows' two 128-column halves, each
 * through its swizzled staging area as four 32 x 64 boxes that TMA stores (overwrite) or adds (cp.reduce.async.bulk
 * add: the gradient is read and written by the memory system, not by the SM) while the consumer goes on. Both store at
 * L2's evict-first priority: the gradient is written once, the operands, read again by other tiles, stay. */

#define WGR_BM            128                /* k_in columns of a tile */
#define WGR_A_BYTES       (2 * WG_BOX_BYTES) /* 16 KiB */
#define WGR_STAGING_BYTES (4 * WG_BOX_BYTES) /* one consumer's 64 x 128 fp32 half: 32 KiB */

/* WGRAD's dynamic shared memory: alignment slack, `stages` stages of A and B (BN columns), the consumers' staging,
 * barriers, the experts' prefix arrays. */
static size_t wgrad_smem_bytes(int stages, int bn, int experts)
{
    return 1024 + (size_t)stages * (WGR_A_BYTES + bn / 64 * WG_BOX_BYTES) + 2 * WGR_STAGING_BYTES +
           (2 * stages + 4) * sizeof(uint64_t) + (size_t)(experts + 1) * (sizeof(int64_t) + sizeof(int));
}

typedef struct wg_wgrad_params {
    CUtensorMap map_in;   /* input [capacity][k_in], boxes of 64 x 64 rows */
    CUtensorMap map_dout; /* grad_output [capacity][n_out], boxes of 64 x 64 rows */
    CUtensorMap map_dw;   /* grad_weight fp32 [E][k_in][n_out], boxes of 32 x 64 rows x 1 */
    const int64_t *counts;
    int64_t capacity;
    int num_experts, m_tiles, n_tiles, k_in, n_out, accumulate;
} wg_wgrad_params;

/* A ping-pong cluster of CL CTAs takes CM x CN neighbouring tiles of one expert: CL 1 one tile, 2 two n_out tiles
 * (1 x 2), 4 a 2 x 2 block; CTA `rank` takes k_in tile rank % CM and n_out tile rank / CM of the block. The CTAs of a
 * block row multiply the same A (input columns), those of a block column the same B (grad_output columns). The
 * cooperative schedule runs single CTAs (CL 1). */
template <int CL> struct wgrad_cluster {
    static constexpr int CM = CL == 4 ? 2 : 1, CN = CL >= 2 ? 2 : 1;
};

/* WGRAD's work unit u of a cluster of CL CTAs: expert e, k_in tile mt and n_out tile nt of its gradient for CTA
 * `rank` (blocks of k_in tiles fastest). */
template <int CL>
__device__ __forceinline__ void wgrad_tile_at(const wg_wgrad_params &p, int u, int rank, int *e, int *mt, int *nt)
{
    constexpr int CM = wgrad_cluster<CL>::CM, CN = wgrad_cluster<CL>::CN;
    const int mb = p.m_tiles / CM, per = mb * (p.n_tiles / CN), r = u % per;
    *e = u / per;
    *mt = r % mb * CM + rank % CM;
    *nt = r / mb * CN + rank / CM;
}

/* The work units of a cluster of CL CTAs (m_tiles and n_tiles are multiples of CM and CN). */
template <int CL> __device__ __forceinline__ int wgrad_units(const wg_wgrad_params &p)
{
    return p.num_experts * (p.m_tiles / wgrad_cluster<CL>::CM) * (p.n_tiles / wgrad_cluster<CL>::CN);
}

/* The CTAs of the cluster (a mask of ranks) that write into CTA rank's stages: those sharing its A (its block row)
 * and its B (its block column), itself included; each gets the stage back from rank's consumers. */
template <int CL> __device__ __forceinline__ uint32_t wgrad_sharers(int rank)
{
    constexpr int CM = wgrad_cluster<CL>::CM;
    const int rm = rank % CM, rn = rank / CM;
    return (1u << rm) | (1u << (rm + CM)) | (1u << (CM * rn)) | (1u << (CM * rn + CM - 1));
}

/* The k-blocks (64 rows each) of expert e. */
__device__ __forceinline__ int wgrad_k_blocks(const int64_t *row_start, int e)
{
    return (int)((row_start[e + 1] - row_start[e] + WG_BK - 1) / WG_BK);
}

/* The producer thread: per unit and 64-row block of the expert, A's two boxes and B's BN / 64, into the ring. In a
 * cluster, an operand two CTAs share is loaded half by each and multicast to both (A's box rn to the CTAs of the
 * block row, B's box rm to those of the block column), and a stage is free once every CTA writing into it has had it
 * back from this CTA's consumers (empty counts their warps). */
template <int STAGES, int BN, int CL>
__device__ __forceinline__ void wgrad_produce(const wg_wgrad_params &p, const int64_t *row_start, int rank,
                                              uint8_t *stages, uint64_t *full, uint64_t *empty)
{
    const int stage_bytes = WGR_A_BYTES + BN / 64 * WG_BOX_BYTES, units = wgrad_units<CL>(p);
    /* the operands, which the CTAs of other tiles read again: kept in L2 over the gradient's traffic (see
     * bf16_wgmma_wgrad_demote_kernel) */
    const uint64_t policy = l2_evict_last_policy();
    int s = 0;
    uint32_t phase = 0, it = 0;
    for (int u = blockIdx.x / CL; u < units; u += gridDim.x / CL) {
        int e, mt, nt;
        wgrad_tile_at<CL>(p, u, rank, &e, &mt, &nt);
        const int k_blocks = wgrad_k_blocks(row_start, e);
        for (int kb = 0; kb < k_blocks; kb++, it++) {
            if (it >= STAGES) mbar_wait(&empty[s], phase ^ 1);
            mbar_arrive_expect_tx(&full[s], stage_bytes);
            const int32_t row = (int32_t)(row_start[e] + (int64_t)kb * WG_BK);
            uint8_t *a = stages + s * stage_bytes, *b = a + WGR_A_BYTES;
            constexpr int CM = wgrad_cluster<CL>::CM, CN = wgrad_cluster<CL>::CN;
            const int rm = rank % CM, rn = rank / CM;
            if (CN == 2) /* A's box rn, to the block row: ranks rm and rm + CM */
                tensor_load_2d_multicast_hint(a + rn * WG_BOX_BYTES, &p.map_in, mt * WGR_BM + rn * 64, row, &full[s],
                                              (uint16_t)((1u << rm) | (1u << (rm + CM))), policy);
            else
                for (int j = 0; j < 2; j++)
                    tensor_load_2d_hint(a + j * WG_BOX_BYTES, &p.map_in, mt * WGR_BM + j * 64, row, &full[s], policy);
            if (CM == 2) /* B's box rm, to the block column: ranks 2 rn and 2 rn + 1 */
                tensor_load_2d_multicast_hint(b + rm * WG_BOX_BYTES, &p.map_dout, nt * BN + rm * 64, row, &full[s],
                                              (uint16_t)(3u << (2 * rn)), policy);
            else
                for (int j = 0; j < BN / 64; j++)
                    tensor_load_2d_hint(b + j * WG_BOX_BYTES, &p.map_dout, nt * BN + j * 64, row, &full[s], policy);
            if (++s == STAGES) s = 0, phase ^= 1;
        }
    }
}

/* An expert's last, partial k-block: zeroes rows valid..63 of `boxes` boxes from `first` (whole 128-byte rows, so the
 * swizzle does not matter), then the `threads` that multiply the stage meet at named barrier `id`. */
__device__ __forceinline__ void wgrad_zero_tail(uint8_t *const *first, int boxes, int valid, uint32_t id,
                                                uint32_t threads)
{
    const int tid = threadIdx.x % 128, chunks = (64 - valid) * 8; /* 16-byte chunks per box */
    const uint4 zero = make_uint4(0, 0, 0, 0);
    for (int i = 0; i < boxes; i++)
        for (int q = tid; q < chunks; q += 128) *(uint4 *)(first[i] + valid * 128 + q * 16) = zero;
    fence_async_shared();
    named_barrier_sync(id, threads);
}

/* A consumer's 64 x 128 fp32 half (h: 64 of its accumulators, the m64n128 layout) into four swizzled 32 x 64 boxes as
 * TMA reads them, added to the values there when `add`; zeros for ZERO (h is not read). */
template <bool ZERO> __device__ __forceinline__ void wgrad_write_half(const float *h, uint8_t *boxes, bool add)
{
    const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
    const int r = warp * 16 + lane / 4, col0 = 2 * (lane % 4);
#pragma unroll
    for (int j = 0; j < 16; j++) {
        const int col = col0 + 8 * j;
        uint8_t *box = boxes + (col / 32) * WG_BOX_BYTES;
#pragma unroll
        for (int q = 0; q < 2; q++) {
            float2 *at = (float2 *)(box + sw128_offset(r + 8 * q, (col % 32) * 4));
            float2 v = ZERO ? make_float2(0.0f, 0.0f) : make_float2(h[4 * j + 2 * q], h[4 * j + 2 * q + 1]);
            if (!ZERO && add) {
                const float2 old = *at;
                v.x += old.x, v.y += old.y;
            }
            *at = v;
        }
    }
}

/* The cooperative epilogue: puts out consumer c's 64 x 256 result (acc) in two halves of 64 x 128, the half h one at
 * k_in row m0[h] and n_out column n0[h], each through four swizzled 32 x 64 boxes, stored or added by TMA. ZERO stores
 * zeros (acc is not read: a non-wgmma write of the accumulators would serialize the kernel's wgmma). */
template <bool ZERO>
__device__ __forceinline__ void wgrad_store(const wg_wgrad_params &p, int e, const int *m0, const int *n0, int c,
                                            const float *acc, uint8_t *boxes)
{
    const int tid = threadIdx.x % 128;
#pragma unroll
    for (int half = 0; half < 2; half++) {
        if (m0[half] >= p.k_in || n0[half] >= p.n_out) continue;
        if (tid == 0) bulk_wait_read(); /* the last stores have read the boxes */
        named_barrier_sync(1 + c, 128);
        wgrad_write_half<ZERO>(acc + 64 * half, boxes, false);
        fence_async_shared();
        named_barrier_sync(1 + c, 128);
        if (tid == 0) {
            const uint64_t policy = l2_evict_first_policy();
            for (int b = 0; b < 4; b++) {
                const int n = n0[half] + b * 32;
                if (n >= p.n_out) break;
                const uint8_t *box = boxes + b * WG_BOX_BYTES;
                if (p.accumulate)
                    tensor_reduce_add_3d_hint(&p.map_dw, n, m0[half], e, box, policy);
                else
                    tensor_store_3d_hint(&p.map_dw, n, m0[half], e, box, policy);
            }
            bulk_commit();
        }
    }
}

/* Hands stage s back to the producers that write into it: this CTA's, and in a cluster those of the CTAs sharing an
 * operand with it (wgrad_sharers). */
template <int CL> __device__ __forceinline__ void wgrad_release(uint64_t *empty, int s, int rank)
{
    if (CL > 1)
        mbar_arrive_warp_ranks(&empty[s], wgrad_sharers<CL>(rank));
    else
        wg_release(empty, s);
}

/* The ping-pong's epilogue. Its output halves (64 k_in rows x 128 n_out columns of a tile) are numbered in the CTA's
 * tile order over the halves that are written (wgrad_writes); half k goes through staging buffer k % 2, which both
 * consumers share: consecutive tiles are the two consumers', so a buffer's previous use is the other consumer's,
 * a whole main loop earlier, and a consumer never waits for its own stores to drain. One thread, the storer, issues
 * every TMA transfer of the staging (so one bulk group tracks them all): per half it makes the buffer ready (once its
 * previous store has been read out of it; adding, after loading the gradient's old values into it), and after the
 * consumer has written the half there (adding: the old values plus its result), stores it. */

/* Whether a half at k_in row m0 and n_out column n0 of expert e's tile is written: it lies in the gradient, and
 * the expert has rows or the gradient is overwritten (zeroed). */
__device__ __forceinline__ bool wgrad_writes(const wg_wgrad_params &p, const int64_t *row_start, int e, int m0, int n0)
{
    return m0 < p.k_in && n0 < p.n_out && (!p.accumulate || wgrad_k_blocks(row_start, e) > 0);
}

/* The boxes (32 n_out columns each) of a half at column n0 that lie in the gradient. */
__device__ __forceinline__ int wgrad_half_boxes(const wg_wgrad_params &p, int n0)
{
    return min(4, (p.n_out - n0 + 31) / 32);
}

/* The storer's store of half k (at k_in row m0, n_out column n0 of expert e), once the consumer has staged it. */
__device__ __forceinline__ void wgrad_store_half(const wg_wgrad_params &p, uint8_t *staging, uint64_t *staged, int k,
                                                 int e, int m0, int n0, uint64_t policy)
{
    const int b = k & 1;
    uint8_t *buf = staging + b * WGR_STAGING_BYTES;
    mbar_wait(&staged[b], (uint32_t)(k >> 1) & 1);
    for (int j = 0; j < wgrad_half_boxes(p, n0); j++)
        tensor_store_3d_hint(&p.map_dw, n0 + 32 * j, m0, e, buf + j * WG_BOX_BYTES, policy);
    bulk_commit();
}

/* The storer thread (warp 1 of the producer warpgroup): walks the CTA's tiles as the consumers do and moves every
 * written half through its staging buffer: ready[b] when the consumer may write buffer b, staged[b] when it has. */
template <int CL>
__device__ __forceinline__ void wgrad_storer(const wg_wgrad_params &p, const int64_t *row_start, int rank,
                                             uint8_t *staging, uint64_t *ready, uint64_t *staged)
{
    const int units = wgrad_units<CL>(p), stride = gridDim.x / CL;
    const uint64_t policy = l2_evict_first_policy();
    int k = 0, pending_e = 0, pending_m = 0, pending_n = -1; /* the half made ready and not yet stored */
    for (int u = blockIdx.x / CL; u < units; u += stride) {
        int e, mt, nt;
        wgrad_tile_at<CL>(p, u, rank, &e, &mt, &nt);
        for (int h = 0; h < 2; h++) {
            const int m0 = mt * WGR_BM + 64 * h, n0 = nt * 128;
            if (!wgrad_writes(p, row_start, e, m0, n0)) continue;
            const int b = k & 1, boxes = wgrad_half_boxes(p, n0);
            uint8_t *buf = staging + b * WGR_STAGING_BYTES;
            bulk_wait_read(); /* the buffer's last store (half k - 2: all but the pending half are issued) is read */
            if (p.accumulate) {
                mbar_arrive_expect_tx(&ready[b], (uint32_t)boxes * WG_BOX_BYTES);
                for (int j = 0; j < boxes; j++) /* read once: evict first, as the stores */
                    tensor_load_3d_hint(buf + j * WG_BOX_BYTES, &p.map_dw, n0 + 32 * j, m0, e, &ready[b], policy);
            } else {
                mbar_arrive(&ready[b]);
            }
            if (pending_n >= 0) wgrad_store_half(p, staging, staged, k - 1, pending_e, pending_m, pending_n, policy);
            pending_e = e, pending_m = m0, pending_n = n0;
            k++;
        }
    }
    if (pending_n >= 0) wgrad_store_half(p, staging, staged, k - 1, pending_e, pending_m, pending_n, policy);
    bulk_wait_all(); /* the buffers are read before the CTA's shared memory goes */
}

/* A ping-pong consumer's result (acc: two m64n128 accumulators) into its tile's written halves, numbered from *k on:
 * waits for the buffer to be ready, writes the half in the swizzled layout TMA reads (adding the old values the
 * storer loaded when adding; zeros for ZERO), and announces it. */
template <bool ZERO>
__device__ __forceinline__ void wgrad_stage(const wg_wgrad_params &p, const int64_t *row_start, int e, int mt, int nt,
                                            const float *acc, uint8_t *staging, uint64_t *ready, uint64_t *staged,
                                            int *k)
{
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int half = 0; half < 2; half++) {
        if (!wgrad_writes(p, row_start, e, mt * WGR_BM + 64 * half, nt * 128)) continue;
        const int b = *k & 1;
        uint8_t *buf = staging + b * WGR_STAGING_BYTES;
        mbar_wait(&ready[b], (uint32_t)(*k >> 1) & 1);
        wgrad_write_half<ZERO>(acc + 64 * half, buf, p.accumulate != 0);
        fence_async_shared();
        __syncwarp();
        if (lane == 0) mbar_arrive(&staged[b]);
        ++*k;
    }
}

/* wgrad_stage in the CTA's tile order: consumer c stages its i-th unit only after the other has staged unit i - 1
 * (named barriers 6 and 7, as the main loops' turns). The buffers' barriers are waited by parity, so a consumer running
 * ahead (through an expert's empty tiles, which need no MMA) could otherwise pass a wait two phases early. */
template <bool ZERO>
__device__ __forceinline__ void wgrad_stage_in_turn(const wg_wgrad_params &p, const int64_t *row_start, int e, int mt,
                                                    int nt, const float *acc, uint8_t *staging, uint64_t *ready,
                                                    uint64_t *staged, int *k, int c, int i, bool next)
{
    if (i > 0) named_barrier_sync(6 + c, 256);
    wgrad_stage<ZERO>(p, row_start, e, mt, nt, acc, staging, ready, staged, k);
    if (next) named_barrier_arrive(7 - c, 256);
}

/* The written halves of expert e's tile (mt, nt): what a consumer counts for the other consumer's tiles. */
__device__ __forceinline__ int wgrad_halves(const wg_wgrad_params &p, const int64_t *row_start, int e, int mt, int nt)
{
    return (int)wgrad_writes(p, row_start, e, mt * WGR_BM, nt * 128) +
           (int)wgrad_writes(p, row_start, e, mt * WGR_BM + 64, nt * 128);
}

/* A WGRAD consumer warpgroup c. Ping-pong: the CTA's units 0, 2, 4, .. (c = 0) or 1, 3, 5, .. (c = 1), walking the
 * other's units only to follow the ring. Cooperative: every unit, k_in rows c * 64 .. c * 64 + 63 of it. */
template <int STAGES, bool PINGPONG, int CL>
__device__ __forceinline__ void wgrad_consume(const wg_wgrad_params &p, const int64_t *row_start, int rank,
                                              uint8_t *stages, uint8_t *staging, uint64_t *full, uint64_t *empty,
                                              uint64_t *ready, uint64_t *staged, int c)
{
    constexpr int BN = PINGPONG ? 128 : 256;
    const int stage_bytes = WGR_A_BYTES + BN / 64 * WG_BOX_BYTES, units = wgrad_units<CL>(p);
    const int stride = gridDim.x / CL;
    int s = 0;
    uint32_t phase = 0;
    uint8_t *boxes = staging + c * WGR_STAGING_BYTES;
    int i = 0, half = 0; /* half: the ping-pong's next written half (wgrad_storer) */
    for (int u = blockIdx.x / CL; u < units; u += stride, i++) {
        int e, mt, nt;
        wgrad_tile_at<CL>(p, u, rank, &e, &mt, &nt);
        const int k_blocks = wgrad_k_blocks(row_start, e);
        if (PINGPONG && (i & 1) != c) { /* the other consumer's unit: skip its stages */
            const int next = s + k_blocks;
            phase ^= (uint32_t)(next / STAGES) & 1;
            s = next % STAGES;
            half += wgrad_halves(p, row_start, e, mt, nt);
            continue;
        }
        const int64_t rows = row_start[e + 1] - row_start[e];
        const bool hand_off = PINGPONG && u + stride < units; /* the other consumer has the CTA's next unit */
        /* the cooperative consumer's two halves: its 64 rows of k_in, the tile's two 128-column halves */
        const int m0[2] = {mt * WGR_BM + c * 64, mt * WGR_BM + c * 64}, n0[2] = {nt * BN, nt * BN + 128};
        if (PINGPONG && i > 0) named_barrier_sync(3 + c, 256); /* our turn: the other has seen its stages arrive */
        float acc[128];
        if (k_blocks == 0) { /* no rows: the gradient is unchanged, or zero when overwritten */
            if (hand_off) named_barrier_arrive(4 - c, 256);
            if (PINGPONG)
                wgrad_stage_in_turn<true>(p, row_start, e, mt, nt, acc, staging, ready, staged, &half, c, i, hand_off);
            else if (!p.accumulate)
                wgrad_store<true>(p, e, m0, n0, c, acc, boxes);
            continue;
        }
        int prev = 0;
        for (int kb = 0; kb < k_blocks; kb++) {
            mbar_wait(&full[s], phase);
            uint8_t *a = stages + s * stage_bytes, *b = a + WGR_A_BYTES;
            const int valid = (int)min((int64_t)WG_BK, rows - (int64_t)kb * WG_BK);
            if (valid < WG_BK) {
                if (PINGPONG) { /* the whole stage is this consumer's */
                    uint8_t *const all[4] = {a, a + WG_BOX_BYTES, b, b + WG_BOX_BYTES};
                    wgrad_zero_tail(all, 4, valid, 1 + c, 128);
                } else { /* its A box and half of B's, then both consumers meet */
                    uint8_t *const mine[3] = {a + c * WG_BOX_BYTES, b + 2 * c * WG_BOX_BYTES,
                                              b + (2 * c + 1) * WG_BOX_BYTES};
                    wgrad_zero_tail(mine, 3, valid, 5, 256);
                }
            }
            wgmma_fence();
#pragma unroll
            for (int k = 0; k < WG_BK / 16; k++) {
                const uint64_t db = wgmma_desc_mn_sw128(b + k * 2048, WG_BOX_BYTES);
                if (PINGPONG) {
#pragma unroll
                    for (int h = 0; h < 2; h++)
                        wgmma_m64n128k16_mn(acc + 64 * h,
                                            wgmma_desc_mn_sw128(a + h * WG_BOX_BYTES + k * 2048, WG_BOX_BYTES), db,
                                            (kb | k) != 0);
                } else {
                    wgmma_m64n256k16<1, 1>(acc, wgmma_desc_mn_sw128(a + c * WG_BOX_BYTES + k * 2048, WG_BOX_BYTES), db,
                                           (kb | k) != 0);
                }
            }
            wgmma_commit();
            if (kb > 0) {
                wgmma_wait<1>();
                wgrad_release<CL>(empty, prev, rank);
            }
            prev = s;
            if (++s == STAGES) s = 0, phase ^= 1;
        }
        if (hand_off) named_barrier_arrive(4 - c, 256); /* the other's turn */
        wgmma_wait<0>();
        wgrad_release<CL>(empty, prev, rank);
        if (PINGPONG)
            wgrad_stage_in_turn<false>(p, row_start, e, mt, nt, acc, staging, ready, staged, &half, c, i, hand_off);
        else
            wgrad_store<false>(p, e, m0, n0, c, acc, boxes);
    }
    if (!PINGPONG && threadIdx.x % 128 == 0) bulk_wait_all();
}

/* The operands are loaded at L2's evict-last priority, so that the gradient's fp32 traffic (evict first) does not push
 * them out while other tiles still read them. Lines at that priority outlive the kernel; so this kernel, launched
 * after it on its stream, hands the operands' last rows, as many as the L2 holds (the walk goes expert by expert and
 * each tile reads its expert's rows in order, so those are the lines loaded last), back to the normal priority, so
 * that they do not crowd out the kernels after it. (Done by each WGRAD CTA as it ended, it cost an H200 3-5% on
 * overwriting: the rows were demoted while other CTAs still read them.) */
__global__ void __launch_bounds__(256)
    bf16_wgmma_wgrad_demote_kernel(const int64_t *counts, int num_experts, int64_t capacity, const uint8_t *in,
                                   const uint8_t *dout, int64_t k_in, int64_t n_out, int64_t l2_bytes)
{
    __shared__ int64_t end_row;
    if (threadIdx.x < 32) { /* the rows the experts hold, clamped as expert_prefix does */
        int64_t sum = 0;
        for (int e = threadIdx.x; e < num_experts; e += 32) sum += min(max(counts[e], (int64_t)0), capacity);
        sum = warp_inclusive_sum(sum);
        if (threadIdx.x == 31) end_row = min(sum, capacity);
    }
    __syncthreads();
    const int64_t end = end_row, r0 = end - min(end, l2_bytes / (2 * (k_in + n_out))), rows = end - r0;
    const int64_t in_lines = (rows * k_in * 2 + 127) / 128, lines = in_lines + (rows * n_out * 2 + 127) / 128;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < lines; i += (int64_t)gridDim.x * blockDim.x) {
        const uint8_t *at = i < in_lines ? in + r0 * k_in * 2 + i * 128 : dout + r0 * n_out * 2 + (i - in_lines) * 128;
        asm volatile("applypriority.global.L2::evict_normal [%0], 128;" ::"l"(at) : "memory");
    }
}

template <int STAGES, bool PINGPONG, int CL>
__global__ void __launch_bounds__(WG_THREADS, 1) bf16_wgmma_wgrad_kernel(const __grid_constant__ wg_wgrad_params p)
{
#ifdef WG_DEVICE
    constexpr int BN = PINGPONG ? 128 : 256;
    extern __shared__ uint8_t smem_raw[];
    uint8_t *smem = (uint8_t *)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
    uint8_t *stages = smem;
    uint8_t *staging = stages + STAGES * (WGR_A_BYTES + BN / 64 * WG_BOX_BYTES);
    uint64_t *full = (uint64_t *)(staging + 2 * WGR_STAGING_BYTES);
    uint64_t *empty = full + STAGES;
    uint64_t *ready = empty + STAGES, *staged = ready + 2; /* the ping-pong's staging buffers (wgrad_storer) */
    int64_t *row_start = (int64_t *)(staged + 2);
    int *tile_start = (int *)(row_start + p.num_experts + 1);

    if (threadIdx.x < 32) expert_prefix(p.counts, p.num_experts, p.capacity, WG_BK, row_start, tile_start);
    if (threadIdx.x == 32) {
        for (int s = 0; s < STAGES; s++) {
            mbar_init_count(&full[s], 1);
            /* the warps that multiply a stage, in each CTA writing into it */
            mbar_init_count(&empty[s], (PINGPONG ? 4 : 8) * (CL > 1 ? __popc(wgrad_sharers<CL>(0)) : 1));
        }
        for (int b = 0; b < 2; b++) {
            mbar_init_count(&ready[b], 1);  /* the storer */
            mbar_init_count(&staged[b], 4); /* the consumer's warps */
        }
        mbar_init_fence();
    }
    if (CL > 1)
        cluster_sync(); /* the peer's barriers exist before anything is multicast or arrives there */
    else
        __syncthreads();
    const int wg = threadIdx.x / 128, rank = (int)(blockIdx.x % CL);
    if (wg == 0) {
        warpgroup_registers_dec<40>();
        if (threadIdx.x == 0) wgrad_produce<STAGES, BN, CL>(p, row_start, rank, stages, full, empty);
        if (PINGPONG && threadIdx.x == 32) wgrad_storer<CL>(p, row_start, rank, staging, ready, staged);
    } else {
        warpgroup_registers_inc<232>();
        wgrad_consume<STAGES, PINGPONG, CL>(p, row_start, rank, stages, staging, full, empty, ready, staged, wg - 1);
    }
    if (CL > 1) cluster_sync(); /* no CTA leaves while its peer may still multicast or arrive into it */
#endif
}

/* ---- host ---- */

static PFN_cuTensorMapEncodeTiled_v12000 encode_fn;
static signed char ready[WG_MAX_DEVICES]; /* per device: 1 prepared, -1 not usable, 0 not asked */
static int sm_count[WG_MAX_DEVICES];      /* per prepared device: the persistent grid */
static int smem_optin[WG_MAX_DEVICES];    /* per prepared device: the most dynamic shared memory a block may take */
static int l2_size[WG_MAX_DEVICES];       /* per prepared device: its L2 in bytes */
/* per prepared device: clusters of 2 and of 4 CTAs of the WGRAD ping-pong that fit at once */
static int wgrad_clusters[WG_MAX_DEVICES][2];

/* A launch of `grid` CTAs of WG_THREADS in clusters of `cl` with `smem` bytes of dynamic shared memory; attr holds the
 * cluster attribute cfg points to. */
static void cluster_launch(cudaLaunchConfig_t *cfg, cudaLaunchAttribute *attr, int64_t grid, int cl, size_t smem,
                           cudaStream_t stream)
{
    *cfg = cudaLaunchConfig_t{};
    *attr = cudaLaunchAttribute{};
    attr->id = cudaLaunchAttributeClusterDimension;
    attr->val.clusterDim.x = (unsigned)cl, attr->val.clusterDim.y = 1, attr->val.clusterDim.z = 1;
    cfg->gridDim = dim3((unsigned)grid);
    cfg->blockDim = dim3(WG_THREADS);
    cfg->dynamicSmemBytes = smem;
    cfg->stream = stream;
    cfg->attrs = attr;
    cfg->numAttrs = 1;
}

/* The ping-pong WGRAD kernel of `stages` stages, in clusters of `cl` CTAs. */
static void (*wgrad_pingpong(int stages, int cl))(wg_wgrad_params)
{
    if (cl == 4) return stages == 5 ? bf16_wgmma_wgrad_kernel<5, true, 4> : bf16_wgmma_wgrad_kernel<4, true, 4>;
    if (cl == 2) return stages == 5 ? bf16_wgmma_wgrad_kernel<5, true, 2> : bf16_wgmma_wgrad_kernel<4, true, 2>;
    return stages == 5 ? bf16_wgmma_wgrad_kernel<5, true, 1> : bf16_wgmma_wgrad_kernel<4, true, 1>;
}

extern "C" moert_result bf16_wgmma_prepare(const moert_host *host)
{
    int dev = 0, major = 0, minor = 0;
    CUDA_CHECK(host, cudaGetDevice(&dev));
    if (dev < 0 || dev >= WG_MAX_DEVICES) return MOERT_OK; /* beyond the table: the mma.sync engine */
    CUDA_CHECK(host, cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    CUDA_CHECK(host, cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
    ready[dev] = -1;
    if (major != 9 || minor != 0) return MOERT_OK;
    if (!encode_fn) {
        void *fn = NULL;
        cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) !=
                cudaSuccess ||
            !fn || found != cudaDriverEntryPointSuccess) {
            (void)cudaGetLastError();
            return MOERT_OK;
        }
        encode_fn = (PFN_cuTensorMapEncodeTiled_v12000)fn;
    }
    const int bytes = (int)wg_smem_bytes(BF16_DEVICE_GEMM_MAX_EXPERTS);
    CUDA_CHECK(host, cudaFuncSetAttribute(bf16_wgmma_kernel<0>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    CUDA_CHECK(host, cudaFuncSetAttribute(bf16_wgmma_kernel<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    CUDA_CHECK(host, cudaDeviceGetAttribute(&smem_optin[dev], cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    CUDA_CHECK(host,
               cudaFuncSetAttribute(bf16_wgmma_wgrad_kernel<3, false, 1>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    (int)wgrad_smem_bytes(3, 256, BF16_DEVICE_GEMM_MAX_EXPERTS)));
    for (int cl = 1; cl <= 4; cl *= 2) {
        CUDA_CHECK(host, cudaFuncSetAttribute(wgrad_pingpong(4, cl), cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              (int)wgrad_smem_bytes(4, 128, BF16_DEVICE_GEMM_MAX_EXPERTS)));
        CUDA_CHECK(host, cudaFuncSetAttribute(wgrad_pingpong(5, cl), cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              smem_optin[dev]));
    }
    CUDA_CHECK(host, cudaDeviceGetAttribute(&sm_count[dev], cudaDevAttrMultiProcessorCount, dev));
    CUDA_CHECK(host, cudaDeviceGetAttribute(&l2_size[dev], cudaDevAttrL2CacheSize, dev));
    /* the clusters that fit at once (a GPC whose SM count is not a multiple of the cluster leaves SMs out) */
    for (int i = 0; i < 2; i++) {
        const int cl = 2 << i;
        cudaLaunchConfig_t cfg;
        cudaLaunchAttribute attr;
        cluster_launch(&cfg, &attr, sm_count[dev] / cl * cl, cl, (size_t)smem_optin[dev], 0);
        int fit = 0;
        CUDA_CHECK(host, cudaOccupancyMaxActiveClusters(&fit, wgrad_pingpong(5, cl), &cfg));
        wgrad_clusters[dev][i] = fit < sm_count[dev] / cl ? fit : sm_count[dev] / cl;
    }
    ready[dev] = 1;
    return MOERT_OK;
}

/* The current device if bf16_wgmma_prepare found the kernels usable on it, else -1. */
static int prepared_device(void)
{
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= WG_MAX_DEVICES) return -1;
    return ready[dev] == 1 ? dev : -1;
}

extern "C" int bf16_wgmma_available(void) { return prepared_device() >= 0; }

/* The CTAs of a persistent grid on device dev: one per SM, or max_sms where the caller leaves the rest free. */
static int64_t persistent_sms(const bf16_device_gemm_args *a, int dev)
{
    return a->max_sms > 0 && a->max_sms < sm_count[dev] ? a->max_sms : sm_count[dev];
}

/* Encodes a tensor map of `rank` dims (innermost first) and element type `type` with 128-byte swizzle; names `what`
 * on failure. */
static moert_result encode_map(const moert_host *host, CUtensorMap *map, CUtensorMapDataType type, const char *what,
                               const void *base, int rank, const uint64_t *dims, const uint64_t *strides,
                               const uint32_t *box)
{
    const cuuint32_t elem[3] = {1, 1, 1};
    CUresult r =
        encode_fn(map, type, (cuuint32_t)rank, (void *)base, (const cuuint64_t *)dims, (const cuuint64_t *)strides,
                  (const cuuint32_t *)box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                  CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS)
        return report(host, MOERT_ERR_CUDA, "bf16 wgmma gemm: cuTensorMapEncodeTiled(%s, %llu x %llu) failed: error %d",
                      what, (unsigned long long)dims[rank - 1], (unsigned long long)dims[0], (int)r);
    return MOERT_OK;
}

/* A bf16 tensor map (encode_map). */
static moert_result encode_bf16_map(const moert_host *host, CUtensorMap *map, const char *what, const void *base,
                                    int rank, const uint64_t *dims, const uint64_t *strides, const uint32_t *box)
{
    return encode_map(host, map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, what, base, rank, dims, strides, box);
}

/* WGRAD into an fp32 gradient, arguments checked by bf16_device_gemm. */
static moert_result wgmma_wgrad(const moert_host *host, cudaStream_t stream, const bf16_device_gemm_args *a, int dev)
{
    const size_t grad_bytes = (size_t)(a->num_experts * a->k_in * a->n_out) * sizeof(float);
    if (a->capacity == 0) { /* no rows at all: the gradient is unchanged, or zero */
        if (!a->accumulate) CUDA_CHECK(host, cudaMemsetAsync(a->grad_weight, 0, grad_bytes, stream));
        return MOERT_OK;
    }
    wg_wgrad_params p;
    memset(&p, 0, sizeof p);
    const uint32_t act_box[2] = {64, WG_BK};
    const uint64_t in_dims[2] = {(uint64_t)a->k_in, (uint64_t)a->capacity}, in_strides[1] = {(uint64_t)a->k_in * 2};
    MOK(encode_bf16_map(host, &p.map_in, "input", a->input, 2, in_dims, in_strides, act_box));
    const uint64_t dout_dims[2] = {(uint64_t)a->n_out, (uint64_t)a->capacity};
    const uint64_t dout_strides[1] = {(uint64_t)a->n_out * 2};
    MOK(encode_bf16_map(host, &p.map_dout, "grad_output", a->grad_output, 2, dout_dims, dout_strides, act_box));
    const uint64_t dw_dims[3] = {(uint64_t)a->n_out, (uint64_t)a->k_in, (uint64_t)a->num_experts};
    const uint64_t dw_strides[2] = {(uint64_t)a->n_out * 4, (uint64_t)(a->k_in * a->n_out) * 4};
    const uint32_t dw_box[3] = {32, 64, 1};
    MOK(encode_map(host, &p.map_dw, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, "grad_weight", a->grad_weight, 3, dw_dims,
                   dw_strides, dw_box));
    p.counts = a->counts_device;
    p.capacity = a->capacity;
    p.num_experts = (int)a->num_experts;
    /* the ping-pong where an expert has few rows on average (its fp32 writes take as long as its MMA) */
    const bool pingpong = a->wgrad_schedule == BF16_WGMMA_WGRAD_AUTO
                              ? a->capacity < (int64_t)BF16_WGMMA_PINGPONG_ROWS * a->num_experts
                              : a->wgrad_schedule == BF16_WGMMA_WGRAD_PINGPONG;
    const int bn = pingpong ? 128 : 256;
    p.m_tiles = (int)((a->k_in + WGR_BM - 1) / WGR_BM);
    p.n_tiles = (int)((a->n_out + bn - 1) / bn);
    p.k_in = (int)a->k_in;
    p.n_out = (int)a->n_out;
    p.accumulate = a->accumulate != 0;
    const int64_t units = a->num_experts * p.m_tiles * p.n_tiles;
    if (units > INT_MAX)
        return report(host, MOERT_ERR_INVALID_ARGUMENT,
                      "bf16 device gemm WGRAD: %lld experts of %lld x %lld make more than 2^31 tiles",
                      (long long)a->num_experts, (long long)a->k_in, (long long)a->n_out);
    const int64_t sms = persistent_sms(a, dev);
    /* the ping-pong in clusters of 4 (2 x 2 tiles, both tile counts even) or 2 (n_out tiles even), as many as fit in
     * the SMs granted; the cooperative schedule in single CTAs (in clusters sharing operands it was no faster on an
     * H100, though they read up to 30% fewer bytes from L2) */
    int64_t fit4 = sms / 4 < wgrad_clusters[dev][1] ? sms / 4 : wgrad_clusters[dev][1];
    int64_t fit2 = sms / 2 < wgrad_clusters[dev][0] ? sms / 2 : wgrad_clusters[dev][0];
    if (!pingpong || p.n_tiles % 2 || p.m_tiles % 2) fit4 = 0;
    if (!pingpong || p.n_tiles % 2) fit2 = 0;
    int cl = a->wgrad_cluster == 4 && fit4 > 0 ? 4 : a->wgrad_cluster >= 2 && fit2 > 0 ? 2 : 1;
    /* auto: adding, quads (a third fewer L2 reads: on an H100 faster on every preset shape though only 30 quads fit
     * against 66 pairs); overwriting, quads only where they keep as many SMs busy as pairs (on an H100 pairs were
     * faster on every preset shape); else pairs, else single CTAs */
    if (a->wgrad_cluster == 0) cl = fit4 > 0 && (p.accumulate || fit4 * 4 >= fit2 * 2) ? 4 : fit2 > 0 ? 2 : 1;
    const int64_t fit = cl == 4 ? fit4 : cl == 2 ? fit2 : sms;
    const int64_t cl_units = units / cl;
    /* the ping-pong takes five stages where the experts' prefix arrays leave room (up to ~160 experts), else four; the
     * cooperative schedule three */
    const int stages = !pingpong ? 3 : wgrad_smem_bytes(5, 128, p.num_experts) <= (size_t)smem_optin[dev] ? 5 : 4;
    cudaLaunchConfig_t cfg;
    cudaLaunchAttribute attr;
    cluster_launch(&cfg, &attr, (cl_units < fit ? cl_units : fit) * cl, cl, wgrad_smem_bytes(stages, bn, p.num_experts),
                   stream);
    CUDA_CHECK(host, cudaLaunchKernelEx(
                         &cfg, pingpong ? wgrad_pingpong(stages, cl) : bf16_wgmma_wgrad_kernel<3, false, 1>, p));
    bf16_wgmma_wgrad_demote_kernel<<<(unsigned)sms, 256, 0, stream>>>(
        a->counts_device, p.num_experts, a->capacity, (const uint8_t *)a->input, (const uint8_t *)a->grad_output,
        a->k_in, a->n_out, l2_size[dev]);
    LAUNCH_CHECK(host, "bf16_wgmma_wgrad_demote_kernel");
    return MOERT_OK;
}

extern "C" moert_result bf16_wgmma_gemm(const moert_host *host, cudaStream_t stream, const bf16_device_gemm_args *a)
{
    const int dev = prepared_device();
    if (dev < 0)
        return report(host, MOERT_ERR_UNSUPPORTED,
                      "bf16 device gemm: the wgmma engine needs a compute capability 9.0 GPU "
                      "prepared with bf16_device_gemm_prepare");
    if (a->pass == MOERT_GEMM_WGRAD) return wgmma_wgrad(host, stream, a, dev);
    const int dgrad = a->pass == MOERT_GEMM_DGRAD;
    const int64_t out_cols = dgrad ? a->k_in : a->n_out, depth = dgrad ? a->n_out : a->k_in;
    wg_params p;
    memset(&p, 0, sizeof p);
    const uint64_t a_dims[2] = {(uint64_t)depth, (uint64_t)a->capacity}, a_strides[1] = {(uint64_t)depth * 2};
    const uint32_t a_box[2] = {WG_BK, WG_BM};
    MOK(encode_bf16_map(host, &p.map_a, dgrad ? "grad_output" : "input", dgrad ? a->grad_output : a->input, 2, a_dims,
                        a_strides, a_box));
    const uint64_t b_dims[3] = {(uint64_t)a->n_out, (uint64_t)a->k_in, (uint64_t)a->num_experts};
    const uint64_t b_strides[2] = {(uint64_t)a->n_out * 2, (uint64_t)(a->k_in * a->n_out) * 2};
    const uint32_t b_box_n[3] = {64, WG_BK, 1}, b_box_k[3] = {WG_BK, WG_BN, 1};
    MOK(encode_bf16_map(host, &p.map_b, "weight", a->weight, 3, b_dims, b_strides, dgrad ? b_box_k : b_box_n));
    const uint64_t d_dims[2] = {(uint64_t)out_cols, (uint64_t)a->capacity}, d_strides[1] = {(uint64_t)out_cols * 2};
    const uint32_t d_box[2] = {64, 64};
    void *d = dgrad ? a->grad_input : a->output;
    MOK(encode_bf16_map(host, &p.map_d, dgrad ? "grad_input" : "output", d, 2, d_dims, d_strides, d_box));
    p.counts = a->counts_device;
    p.d = (__nv_bfloat16 *)d;
    p.work_counter = a->sm_yield ? a->work_counter : NULL;
    p.sm_yield = a->sm_yield;
    p.capacity = a->capacity;
    p.num_experts = (int)a->num_experts;
    p.n_tiles = (int)((out_cols + WG_BN - 1) / WG_BN);
    p.k_blocks = (int)((depth + WG_BK - 1) / WG_BK);
    p.out_cols = (int)out_cols;

    const int64_t sms = persistent_sms(a, dev);
    const int64_t bound = ((a->capacity + WG_BM - 1) / WG_BM + a->num_experts) * p.n_tiles; /* units at most */
    const unsigned grid = (unsigned)(bound < sms ? bound : sms);
    const size_t smem = wg_smem_bytes(p.num_experts);
    if (dgrad)
        bf16_wgmma_kernel<0><<<grid, WG_THREADS, smem, stream>>>(p);
    else
        bf16_wgmma_kernel<1><<<grid, WG_THREADS, smem, stream>>>(p);
    LAUNCH_CHECK(host, "bf16_wgmma_kernel");
    return MOERT_OK;
}
