/* SPDX-License-Identifier: Apache-2.0 */
/* Blockwise-scaled FP8 grouped GEMM (see fp8_block_gemm.h): persistent CTAs over 128x128 output tiles (128x256 in
 * the forward form with bf16 D, see consume_wide), three warpgroups each.
 * - Producers (warp 0's lane 0: A; warp 3: B and the scale factors): load each 128-long k-block of A and B through
 *   TMA into a ring of stages (128-byte swizzled rows, as wgmma reads them), and the block's factors into the same
 *   stage.
 * - Consumers (warpgroups 1 and 2, 64 rows of the tile each): per k-block four wgmma m64n128k32 into fresh fp32
 *   partial sums, then acc += partial * sa(row) * sb(col) in registers. The partial sums alternate between two
 *   register sets: the next k-block's wgmma runs on the tensor cores while the last one is scaled and added, so the
 *   tensor cores do not wait for the promotion.
 * - Epilogue warps (warps 1 and 2, one per consumer): move D through shared memory by TMA (see epilogue_dma).
 *
 * CTAs run in clusters of two (by default) on neighbouring SMs, and share one operand tile by TMA multicast:
 * - 128x128 tiles: the pair takes column blocks 2j and 2j+1 of the same row block; each CTA loads half of the shared
 *   A tile and multicasts it to both (24 KB from L2 per k-block and tile instead of 32).
 * - Wide tiles: the pair takes row blocks 2p and 2p+1 of the same 256-column block; each CTA
 *   loads its own A and half of the shared 32 KB B tile, multicast to both (32 KB per k-block and tile instead of
 *   40; both CTAs read the expert's weights in step). A group's odd last row block pairs along N as above.
 *   fc1's forward ran 6% faster for it.
 * A group's rows (an expert's tokens) are rarely a multiple of 256, so pairing along M alone would leave a CTA
 * without rows for every expert with an odd number of row blocks. A stage is refilled only after the consumers of
 * both CTAs handed it back. A consumer whose 64 rows all lie past the group's m (an expert's
 * last, short row block) skips its wgmma, so such a tile costs half.
 *
 * The epilogue: each consumer writes its part of the tile into a set of shared-memory boxes (swizzled, as TMA
 * reads them) and goes on with the next tile at once; its epilogue warp hands the boxes to TMA, which stores them
 * into D clipped to the group's m x n. bf16 D has two sets, filled in turn; fp32 D one. When adding to D (the
 * wgrad's grad_weight), the epilogue warp loads the old values into the tile's set ahead of the consumer, so the
 * read of D overlaps the main loop. Groups whose D cannot be described by a tensor map (a base or row stride not a multiple of 16 bytes) are
 * stored from registers. */
#include "fp8_block_gemm.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <stdlib.h>
#include <string.h>

#include "../lib/mbarrier.cuh"
#include "../lib/wgmma.cuh"
#include "../lib/plugin_cuda_check.h"

#define TILE           128           /* BM = BN = BK */
#define TILE_BYTES     (TILE * TILE) /* one FP8 tile of A or B */
#define HALF_ROWS      (TILE / 2)    /* the rows of an A map's box: half a tile (each CTA of a pair loads one) */
#define THREADS        384           /* producer warpgroup + two consumer warpgroups */
#define CONSUMER_WARPS 8
#define SLOTS          16   /* tables in flight */
#define BAND           8    /* row blocks of a group that run side by side (see tile_at) */
#define OUT_BOX_BYTES  8192 /* one staged output box: 64 rows of 128 bytes */
#define MAX_OUT_SETS   2    /* staged output sets per consumer (one filled while the other is moved) */
#define MAX_CLUSTER    2
#define UNIT_RING      8 /* handed-out work units in flight between the walk's writer and its readers */

#define WIDE_N (2 * TILE) /* the wide tile's columns (see consume_wide) */

/* A stage of the ring for output tiles tile_n columns wide: the A tile, the B tile (tile_n rows), their factors and
 * two barriers. */
__host__ __device__ static inline size_t stage_bytes(int tile_n)
{
    return (size_t)TILE_BYTES + (size_t)TILE * tile_n + 2 * TILE * 4 + 2 * 8;
}
/* One staged output set: a whole tile of D. */
__host__ __device__ static inline size_t staging_bytes(int d_bf16, int tile_n)
{
    return (size_t)TILE * tile_n * (d_bf16 ? 2 : 4);
}
/* One consumer's output set: half a tile of D. */
__host__ __device__ static inline size_t set_bytes_of(int d_bf16, int tile_n)
{
    return staging_bytes(d_bf16, tile_n) / 2;
}
/* Dynamic shared memory of a ring of `stages` and `sets` staged output sets (plus alignment and the epilogue's
 * barriers). */
static inline size_t smem_bytes(int d_bf16, int tile_n, int stages, int sets)
{
    return 1024 + (size_t)stages * stage_bytes(tile_n) + (size_t)sets * staging_bytes(d_bf16, tile_n) +
           2 * 2 * MAX_OUT_SETS * 8 + UNIT_RING * (2 * 8 + 4);
}

/* A group as the kernel reads it (the host's moert_fp8_block_group with its tiles counted). */
typedef struct group_dev {
    int64_t a_row0, b_row0;
    const float *a_scale, *b_scale;
    int64_t a_scale_kb_stride, b_scale_stride;
    void *d;
    int64_t ldd;
    int32_t m, n, kb_count, tile_start, m_tiles, n_tiles, a_map, b_map, d_map; /* d_map -1: stored from registers */
} group_dev;

typedef struct kernel_args {
    const CUtensorMap *maps;
    const group_dev *groups;
    int group_count;
    int units;   /* work units: a row block and `cluster` consecutive column blocks of a group */
    int cluster; /* CTAs per cluster: 1 or 2 */
    int stages;
    int out_sets; /* staged output sets: 1 or 2 (0 without the TMA epilogue) */
    int pairs;    /* forward form's main loop: 0 one k-block at a time, 1 in pairs, 2 in pairs, the second consumer
                     warpgroup one block out of step with the first */
    int d_bf16, accumulate;
    int tile_n;              /* columns of an output tile: TILE, or WIDE_N for the wide forward form */
    int pair_rows;           /* wide form in CTA pairs: pairs of row blocks share the B tile (see tile_at) */
    int32_t *work_counter;   /* NULL: each cluster walks units blockIdx.x / cluster, + gridDim.x / cluster, ..; else
                                two int32 through which rank 0's producer of A hands them out (walk_next) */
    const int32_t *sm_yield; /* with work_counter: SMs to leave while it is > 0 (moert_fp8_block_gemm) */
} kernel_args;

struct moert_fp8_block_ctx {
    const moert_host *host;
    PFN_cuTensorMapEncodeTiled_v12000 encode;
    int sm_count;     /* SMs of the device: the persistent grid without clusters is one CTA per SM */
    int fit_clusters; /* clusters of two that fit at once (0: none) */
    int max_ctas;     /* the resident CTAs a call launches without clusters (tuning.clusters caps it) */
    int max_clusters; /* the resident clusters a call launches with them (tuning.clusters caps it) */
    int cluster;      /* 1 or 2 (tuning.cluster, or moert_fp8_block_ctx_configure) */
    int staged;       /* TMA epilogue (moert_fp8_block_ctx_configure turns it off) */
    int stages_set;   /* tuning.stages: at most this many stages; 0: as many as fit (ring_for) */
    int pairs;        /* kernel_args.pairs (tuning.pairs, default 2) */
    int tile_n;       /* the forward form's output tile columns with bf16 D: TILE or WIDE_N (tuning.tile_n) */
    int pair_rows;    /* kernel_args.pair_rows where it applies (tuning.pair_rows) */
    size_t smem_max;  /* the device's shared memory per block (opt-in) */
    size_t slot_bytes;
    void *pinned[SLOTS];
    void *table[SLOTS];
    cudaEvent_t done[SLOTS];
    int used[SLOTS];
    unsigned next;
    int *map_of; /* per matrix and role (2 i: as A, 64-row boxes; 2 i + 1: as B, whole tiles): its tensor
                         map's index in this call, -1 none yet */
    int map_of_count;
};

/* ---- device code ---- */

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FP8_BLOCK_DEVICE 1
#endif

/* d (+)= A (64 x 32, shared, desc_a) * B^T (128 x 32, shared, desc_b), both K-major; the formats A_FMT/B_FMT. */
#define WGMMA_ASM(types)                                                                                               \
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %66, 0;\n"                                                        \
                 "wgmma.mma_async.sync.aligned.m64n128k32.f32." types " {" WGMMA_REGS_64 "}, %64, %65, p, 1, 1;\n}\n"  \
                 : WGMMA_OPERANDS_64(d)                                                                                \
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate))

template <int A_FMT, int B_FMT>
__device__ __forceinline__ void wgmma_tile(float *d, uint64_t desc_a, uint64_t desc_b, int accumulate)
{
#ifdef FP8_BLOCK_DEVICE
    if (A_FMT == 0 && B_FMT == 0)
        WGMMA_ASM("e4m3.e4m3");
    else if (A_FMT == 1)
        WGMMA_ASM("e5m2.e4m3");
    else
        WGMMA_ASM("e4m3.e5m2");
#endif
}

/* Keeps the compiler from moving register reads of d across the asynchronous wgmma's completion. */
__device__ __forceinline__ void fence_registers(float *d)
{
#pragma unroll
    for (int i = 0; i < 64; i++) asm volatile("" : "+f"(d[i])::"memory");
}

/* The group whose units contain unit u, found from `group`, the group of an earlier unit of the same walk: a CTA's
 * units only grow, so this steps over the groups passed since (none or one, mostly) instead of searching all of
 * them: a binary search was a chain of dependent global loads at every tile, which the wgrad's short tiles (a few
 * k-blocks each) felt. */
__device__ __forceinline__ int next_group(const group_dev *groups, int count, int group, int u)
{
    while (group + 1 < count && __ldg(&groups[group + 1].tile_start) <= u) group++;
    return group;
}

/* D's values of one thread (rows row and row + 8, columns col + 8 j and + 1, j < NJ), stored or added, masked to
 * the group's m x n. Adding loads every old value first (into old, 4 NJ floats free after the main loop), then
 * stores: loads and stores interleaved would wait on each other (they may alias, as far as the compiler knows). */
template <int NJ>
__device__ __forceinline__ void store_tile(const group_dev &g, int row, int col, float *acc, float *old, int d_bf16,
                                           int accumulate)
{
    const bool row0_ok = row < g.m, row1_ok = row + 8 < g.m;
    const int64_t base0 = (int64_t)row * g.ldd, base1 = (int64_t)(row + 8) * g.ldd;
    if (accumulate) {
#pragma unroll
        for (int j = 0; j < NJ; j++) {
            const bool col_ok = col + 8 * j < g.n;
            float2 a = make_float2(0.f, 0.f), b = make_float2(0.f, 0.f);
            if (d_bf16) {
                const __nv_bfloat162 *p = (const __nv_bfloat162 *)g.d;
                if (col_ok && row0_ok) a = __bfloat1622float2(p[(base0 + col + 8 * j) / 2]);
                if (col_ok && row1_ok) b = __bfloat1622float2(p[(base1 + col + 8 * j) / 2]);
            } else {
                const float2 *p = (const float2 *)g.d;
                if (col_ok && row0_ok) a = p[(base0 + col + 8 * j) / 2];
                if (col_ok && row1_ok) b = p[(base1 + col + 8 * j) / 2];
            }
            old[4 * j + 0] = a.x, old[4 * j + 1] = a.y, old[4 * j + 2] = b.x, old[4 * j + 3] = b.y;
        }
#pragma unroll
        for (int i = 0; i < 4 * NJ; i++) acc[i] += old[i];
    }
#pragma unroll
    for (int j = 0; j < NJ; j++) {
        if (col + 8 * j >= g.n) continue;
        if (d_bf16) {
            __nv_bfloat162 *p = (__nv_bfloat162 *)g.d;
            if (row0_ok) p[(base0 + col + 8 * j) / 2] = __floats2bfloat162_rn(acc[4 * j + 0], acc[4 * j + 1]);
            if (row1_ok) p[(base1 + col + 8 * j) / 2] = __floats2bfloat162_rn(acc[4 * j + 2], acc[4 * j + 3]);
        } else {
            float2 *p = (float2 *)g.d;
            if (row0_ok) p[(base0 + col + 8 * j) / 2] = make_float2(acc[4 * j + 0], acc[4 * j + 1]);
            if (row1_ok) p[(base1 + col + 8 * j) / 2] = make_float2(acc[4 * j + 2], acc[4 * j + 3]);
        }
    }
}

/* The tile a CTA of rank `rank` in its cluster takes in work unit u: its group, row block and column block. A unit
 * is one row block and `cluster` consecutive column blocks of a group (a column block past the group's last is
 * dead: its CTA only helps load A). Within a group, units go in bands of BAND row blocks, row blocks fastest: the
 * CTAs running at once share the band's A rows and walk the group's B. `group` is the walk's cursor (next_group):
 * 0 before its first unit, then the last unit's group. */
typedef struct tile_pos {
    int group, m_tile, n_tile;
    bool b_shared; /* the pair's CTAs take row blocks 2p and 2p + 1 of one column block: each loads half of B and
                      multicasts it, and loads its own A */
} tile_pos;

__device__ __forceinline__ tile_pos tile_at(const kernel_args &args, int u, int rank, int &group)
{
    tile_pos p;
    group = next_group(args.groups, args.group_count, group, u);
    p.group = group;
    const group_dev &g = args.groups[p.group];
    const int local = u - g.tile_start;
    p.b_shared = false;
    if (args.pair_rows) { /* pairs of row blocks first (bands of BAND rows), then an odd last row block as usual */
        const int row_pairs = g.m_tiles / 2, paired = row_pairs * g.n_tiles;
        if (local < paired) {
            const int band = local / (BAND / 2 * g.n_tiles), rem = local % (BAND / 2 * g.n_tiles);
            const int band_pairs = min(BAND / 2, row_pairs - band * (BAND / 2));
            p.m_tile = 2 * (band * (BAND / 2) + rem % band_pairs) + rank;
            p.n_tile = rem / band_pairs;
            p.b_shared = true;
        } else {
            p.m_tile = g.m_tiles - 1;
            p.n_tile = (local - paired) * 2 + rank;
        }
        return p;
    }
    const int n_units = (g.n_tiles + args.cluster - 1) / args.cluster;
    const int band = local / (BAND * n_units), rem = local % (BAND * n_units);
    const int band_rows = min(BAND, g.m_tiles - band * BAND);
    p.m_tile = band * BAND + rem % band_rows;
    p.n_tile = (rem / band_rows) * args.cluster + rank;
    return p;
}

/* The kernel's shared memory (dynamic, 1 KB aligned): the stage ring's A and B tiles, the consumers' output sets, the
 * factors, the ring's and the epilogue's barriers, and the handed-out walk's unit ring (its barriers and slots). */
typedef struct kernel_smem {
    uint8_t *a_tiles, *b_tiles, *out_boxes;
    float *a_factors, *b_factors;
    uint64_t *full, *empty, *d_ready, *d_staged, *unit_full, *unit_empty;
    int *unit_slot;
} kernel_smem;

__device__ __forceinline__ kernel_smem kernel_smem_of(const kernel_args &args)
{
    extern __shared__ uint8_t smem_raw[];
    /* aligned to 1 KB by an offset into smem_raw (not through an integer), so the compiler keeps knowing that the
     * pointers below are shared memory and reads the factors with shared-memory loads */
    uint8_t *smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
    const int stages = args.stages;
    kernel_smem m;
    m.a_tiles = smem;
    m.b_tiles = m.a_tiles + stages * TILE_BYTES;
    m.out_boxes = m.b_tiles + (size_t)stages * TILE * args.tile_n; /* [2 consumers][out_sets][half a tile of D] */
    m.a_factors = (float *)(m.out_boxes + args.out_sets * staging_bytes(args.d_bf16, args.tile_n)); /* [stages][128] */
    m.b_factors = m.a_factors + stages * TILE; /* [stages][128] (per block: [0] only) */
    m.full = (uint64_t *)(m.b_factors + stages * TILE);
    m.empty = m.full + stages;
    m.d_ready = m.empty + stages;                /* [2 consumers][MAX_OUT_SETS]: the set may be written */
    m.d_staged = m.d_ready + 2 * MAX_OUT_SETS;   /* [2 consumers][MAX_OUT_SETS]: the set holds the tile */
    m.unit_full = m.d_staged + 2 * MAX_OUT_SETS; /* [UNIT_RING]: the slot holds the walk's next unit */
    m.unit_empty = m.unit_full + UNIT_RING;      /* [UNIT_RING], in rank 0: every reader of the cluster has read it */
    m.unit_slot = (int *)(m.unit_empty + UNIT_RING);
    return m;
}

/* Who walks: produce_a (the handed-out walk's writer in rank 0, a reader elsewhere), one other thread (an epilogue
 * warp's), or a whole warp (produce_b, each consumer warp). */
enum walk_role { WALK_PRODUCE_A, WALK_THREAD, WALK_WARP };
/* The readers' arrivals on a unit slot's unit_empty: per CTA the consumers' 8 warps, produce_b's warp and the two
 * epilogue threads, and produce_a in every CTA but rank 0. */
#define UNIT_READERS (CONSUMER_WARPS + 1 + 2)

/* A CTA's walk over its work units, with the group cursor tile_at keeps. Every role of the cluster walks the same
 * units in the same order. Static (no work_counter): units blockIdx.x / cluster, then every gridDim.x / cluster-th
 * (next: the next one). Handed out: the t-th unit (next: t) is in unit slot t % UNIT_RING, which rank 0's producer of
 * A fills in every CTA of the cluster (walk_next). Kept to four registers: the consumers have none to spare. */
typedef struct tile_walk {
    int next, group;
    uint32_t ring; /* handed out: the unit ring's shared address (unit_full, then unit_empty, then the slots) */
    int how;       /* handed out: WALK_WRITES (rank 0's producer of A), or WALK_WARP_READS where one lane of a warp
                      reports its warp's read */
} tile_walk;

#define WALK_WRITES     1
#define WALK_WARP_READS 2

__device__ __forceinline__ tile_walk walk_begin(const kernel_args &args, int rank, int role)
{
    tile_walk w = {(int)(blockIdx.x / args.cluster), 0, 0u, 0};
    if (args.work_counter) {
        w.next = 0;
        w.ring = smem_addr(kernel_smem_of(args).unit_full);
        w.how = role == WALK_PRODUCE_A && rank == 0 ? WALK_WRITES : role == WALK_WARP ? WALK_WARP_READS : 0;
    }
    return w;
}

/* The handed-out walk's next unit for the cluster, taken by rank 0's producer of A: the next unnumbered one, or none
 * (-1) once they are all taken or while sm_yield asks for SMs and this cluster is among the last that cover them
 * (cluster 0 never yields, so every unit is taken). The last cluster to stop zeroes the counter pair for the next
 * launch on its stream. */
__device__ __forceinline__ int walk_take_unit(const kernel_args &args)
{
    const int clusters = (int)gridDim.x / args.cluster, me = (int)blockIdx.x / args.cluster;
    int u = args.units;
    const int want = args.sm_yield ? *(const volatile int32_t *)args.sm_yield : 0;
    if (!(want > 0 && me > 0 && me >= clusters - (want + args.cluster - 1) / args.cluster))
        u = atomicAdd(args.work_counter, 1);
    if (u >= args.units && atomicAdd(args.work_counter + 1, 1) == clusters - 1) {
        args.work_counter[0] = 0; /* every cluster has stopped taking units */
        args.work_counter[1] = 0;
    }
    return u < args.units ? u : -1;
}

/* The walk's next tile into tp; false once the walk is done. Handed out, the writer waits until every reader of the
 * cluster has read the slot's last unit (unit_empty, in rank 0), then stores the unit into the slot of each CTA and
 * arrives on its unit_full (cluster-scope release); a reader waits on its own unit_full (cluster-scope acquire),
 * reads the slot and arrives on rank 0's unit_empty: once per thread, or per warp for WALK_WARP_READS. */
__device__ __forceinline__ bool walk_next(const kernel_args &args, int rank, tile_walk &w, tile_pos &tp)
{
    int u;
    if (!args.work_counter) {
        if (w.next >= args.units) return false;
        u = w.next;
        w.next += gridDim.x / args.cluster;
    } else {
#ifdef FP8_BLOCK_DEVICE
        const int slot = w.next % UNIT_RING;
        const uint32_t parity = (uint32_t)(w.next / UNIT_RING) & 1;
        const uint32_t full = w.ring + 8 * slot, empty = w.ring + 8 * (UNIT_RING + slot),
                       cell = w.ring + 16 * UNIT_RING + 4 * slot;
        if (w.how == WALK_WRITES) {
            if (w.next >= UNIT_RING) {
                uint32_t done = 0;
                while (!done)
                    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                                 " selp.u32 %0, 1, 0, p;\n}"
                                 : "=r"(done)
                                 : "r"(empty), "r"(parity ^ 1)
                                 : "memory");
            }
            u = walk_take_unit(args);
            for (int r = 0; r < args.cluster; r++)
                asm volatile("{\n .reg .b32 c, b;\n mapa.shared::cluster.u32 c, %0, %2;\n"
                             " mapa.shared::cluster.u32 b, %1, %2;\n st.shared::cluster.u32 [c], %3;\n"
                             " mbarrier.arrive.release.cluster.shared::cluster.b64 _, [b];\n}" ::"r"(cell),
                             "r"(full), "r"(r), "r"(u)
                             : "memory");
        } else {
            uint32_t done = 0;
            while (!done)
                asm volatile(
                    "{\n .reg .pred p;\n mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
                    " selp.u32 %0, 1, 0, p;\n}"
                    : "=r"(done)
                    : "r"(full), "r"(parity)
                    : "memory");
            asm volatile("ld.shared.u32 %0, [%1];" : "=r"(u) : "r"(cell) : "memory");
            if (w.how == WALK_WARP_READS) __syncwarp();
            if (w.how != WALK_WARP_READS || threadIdx.x % 32 == 0)
                asm volatile("{\n .reg .b32 b;\n mapa.shared::cluster.u32 b, %0, 0;\n"
                             " mbarrier.arrive.release.cluster.shared::cluster.b64 _, [b];\n}" ::"r"(empty)
                             : "memory");
        }
        w.next++;
        if (u < 0) return false;
#else
        return false;
#endif
    }
    tp = tile_at(args, u, rank, w.group);
    return true;
}

/* The boxes of consumer warpgroup c's 64 x tile_n part of tile tp that lie inside D (count; first column x0, row y0);
 * 0 for a dead tile. */
__device__ __forceinline__ int out_box_count(const kernel_args &args, const group_dev &g, const tile_pos &tp, int c,
                                             int *x0, int *y0)
{
    const int box_cols = args.d_bf16 ? 64 : 32;
    *x0 = tp.n_tile * args.tile_n, *y0 = tp.m_tile * TILE + c * 64;
    if (*y0 >= g.m || *x0 >= g.n) return 0;
    const int left = (g.n - *x0 + box_cols - 1) / box_cols;
    return left < args.tile_n / box_cols ? left : args.tile_n / box_cols;
}

/* A tile whose stores the epilogue warp has still to issue, once its consumer has staged it. */
typedef struct pending_tile {
    int x0, y0, count, map; /* map -1: none */
} pending_tile;

/* Waits until the consumer has written tile p into output set `set`, then hands the set's boxes to TMA. */
__device__ __forceinline__ void store_staged(const kernel_args &args, pending_tile &p, uint8_t *boxes, int set,
                                             uint64_t *d_staged, uint32_t &staged_phase)
{
    const int box_cols = args.d_bf16 ? 64 : 32;
    const size_t set_bytes = set_bytes_of(args.d_bf16, args.tile_n);
    mbar_wait(&d_staged[set], (staged_phase >> set) & 1);
    staged_phase ^= 1u << set;
    for (int b = 0; b < p.count; b++)
        tensor_store_2d(args.maps + p.map, p.x0 + b * box_cols, p.y0, boxes + set * set_bytes + b * OUT_BOX_BYTES);
    bulk_commit();
    p.map = -1;
}

/* The epilogue warp of consumer warpgroup c (one thread): walks the CTA's tiles in the consumer's order and, for
 * each tile whose part c the TMA epilogue stores, makes an output set ready for the consumer (loading D's old values
 * into it when adding: d_ready completes when they land; else once TMA has read the set's last tile out of it),
 * then, once the consumer has written the tile there (d_staged), stores it into D by TMA. With two sets the next
 * tile's set is made ready before this tile is waited for, so its old values load while this tile computes; with
 * one (fp32 D, whose second set would cost half the stage ring) only after this tile's store has left it. */
__device__ __forceinline__ void epilogue_dma(const kernel_args &args, int rank, int c, uint8_t *boxes,
                                             uint64_t *d_ready, uint64_t *d_staged)
{
    const int box_cols = args.d_bf16 ? 64 : 32;
    const size_t set_bytes = set_bytes_of(args.d_bf16, args.tile_n);
    pending_tile pending = {0, 0, 0, -1};
    int set = 0;
    uint32_t staged_phase = 0; /* bit per set */
    tile_walk walk = walk_begin(args, rank, WALK_THREAD);
    tile_pos tp;
    while (walk_next(args, rank, walk, tp)) {
        const group_dev &g = args.groups[tp.group];
        int x0, y0;
        const int count = g.d_map >= 0 ? out_box_count(args, g, tp, c, &x0, &y0) : 0;
        if (count == 0) continue;
        if (args.out_sets == 1 && pending.map >= 0) store_staged(args, pending, boxes, set, d_staged, staged_phase);
        const int next = pending.map >= 0 ? set ^ 1 : set; /* the set this tile goes into */
        uint8_t *next_boxes = boxes + next * set_bytes;
        bulk_wait_read(); /* the set's last tile has left it */
        if (args.accumulate) {
            mbar_arrive_expect_tx(&d_ready[next], (uint32_t)count * OUT_BOX_BYTES);
            for (int b = 0; b < count; b++)
                tensor_load_2d(next_boxes + b * OUT_BOX_BYTES, args.maps + g.d_map, x0 + b * box_cols, y0,
                               &d_ready[next]);
        } else {
            mbar_arrive(&d_ready[next]);
        }
        if (pending.map >= 0) store_staged(args, pending, boxes, set, d_staged, staged_phase); /* in `set` */
        set = next;
        pending.x0 = x0, pending.y0 = y0, pending.count = count, pending.map = g.d_map;
    }
    if (pending.map >= 0) store_staged(args, pending, boxes, set, d_staged, staged_phase);
    bulk_wait_all(); /* the boxes are read before the CTA's memory goes */
}

/* Consumer warpgroup c's part of a tile into its output set (64 rows of 128 bytes per box, 16-byte chunks swizzled
 * by row as TMA's 128-byte swizzle lays them out), added to the old values the epilogue warp loaded there when
 * accumulating; then the warps announce the set to the epilogue warp. One instance per D type and mode, picked once
 * per tile by stage_tile: testing both at every value, the unrolled loop branched 64 times a tile and stalled on
 * instruction fetch, and the wgrad form (a few k-blocks a tile) spent a quarter of its consumers' time here
 * (profiled). */
template <int D_BF16, int ACCUMULATE, int NJ>
__device__ __forceinline__ void stage_tile_as(const float *acc, uint8_t *boxes, uint64_t *d_ready, uint32_t ready_phase,
                                              uint64_t *d_staged)
{
    constexpr int box_cols = D_BF16 ? 64 : 32, bytes = D_BF16 ? 2 : 4;
    const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
    const int r = warp * 16 + lane / 4, col0 = 2 * (lane % 4);
    mbar_wait(d_ready, ready_phase);
#pragma unroll
    for (int j = 0; j < NJ; j++) {
        const int col = col0 + 8 * j;
        uint8_t *box = boxes + (col / box_cols) * OUT_BOX_BYTES;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            uint8_t *at = box + sw128_offset(r + 8 * h, (col % box_cols) * bytes);
            float2 v = make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
            if (D_BF16) {
                if (ACCUMULATE) {
                    const float2 old = __bfloat1622float2(*(const __nv_bfloat162 *)at);
                    v.x += old.x, v.y += old.y;
                }
                *(__nv_bfloat162 *)at = __floats2bfloat162_rn(v.x, v.y);
            } else {
                if (ACCUMULATE) {
                    const float2 old = *(const float2 *)at;
                    v.x += old.x, v.y += old.y;
                }
                *(float2 *)at = v;
            }
        }
    }
    fence_async_shared();
    __syncwarp();
    if (lane == 0) mbar_arrive(d_staged);
}

__device__ __forceinline__ void stage_tile(const kernel_args &args, const float *acc, uint8_t *boxes, uint64_t *d_ready,
                                           uint32_t ready_phase, uint64_t *d_staged)
{
    if (args.d_bf16) {
        if (args.accumulate)
            stage_tile_as<1, 1, 16>(acc, boxes, d_ready, ready_phase, d_staged);
        else
            stage_tile_as<1, 0, 16>(acc, boxes, d_ready, ready_phase, d_staged);
    } else {
        if (args.accumulate)
            stage_tile_as<0, 1, 16>(acc, boxes, d_ready, ready_phase, d_staged);
        else
            stage_tile_as<0, 0, 16>(acc, boxes, d_ready, ready_phase, d_staged);
    }
}

/* The producer is two warps, so that one k-block's loads are issued well within the time its wgmma take: one warp
 * issuing both tiles' TMA loads and the factor copies was the kernel's bound (about 1000 cycles a k-block, measured
 * with Nsight Compute's source counters; a TMA issue alone costs some 15 instructions of uniform-register moves).
 *
 * produce_a (warp 0, lane 0 alone): per tile and k-block, waits until the stage is free in every CTA of the cluster,
 * announces A's bytes on the stage's full barrier and loads A: its half, multicast to the pair (without a cluster,
 * both halves). */
__device__ __forceinline__ void produce_a(const kernel_args &args, uint8_t *a_tiles, uint64_t *full, uint64_t *empty,
                                          int rank)
{
    const int cluster = args.cluster, stages = args.stages;
    int s = 0;
    uint32_t phase = 0, it = 0; /* k-blocks loaded so far (all tiles) */
    tile_walk walk = walk_begin(args, rank, WALK_PRODUCE_A);
    tile_pos tp;
    while (walk_next(args, rank, walk, tp)) {
        const group_dev &g = args.groups[tp.group];
        const CUtensorMap *map = args.maps + g.a_map;
        const int row = (int)(g.a_row0 + (int64_t)tp.m_tile * TILE);
        const int kb_count = g.kb_count;
        for (int kb = 0; kb < kb_count; kb++, it++) {
            if (it >= (uint32_t)stages) mbar_wait(&empty[s], phase ^ 1);
            uint8_t *stage = a_tiles + s * TILE_BYTES;
            mbar_arrive_expect_tx(&full[s], TILE_BYTES);
            if (cluster == 2 && !tp.b_shared) {
                tensor_load_2d_multicast(stage + rank * HALF_ROWS * TILE, map, kb * TILE, row + rank * HALF_ROWS,
                                         &full[s], (uint16_t)0x3);
            } else {
                tensor_load_2d(stage, map, kb * TILE, row, &full[s]);
                tensor_load_2d(stage + HALF_ROWS * TILE, map, kb * TILE, row + HALF_ROWS, &full[s]);
            }
            if (++s == stages) s = 0, phase ^= 1;
        }
    }
}

/* produce_b (warp 3): per tile and k-block, waits for the same free stage; lane 0 announces B's bytes and loads the
 * B tile (one 128-row box; nothing for a dead column block), and every lane copies its share of the block's scale
 * factors by cp.async (rows, or columns, lane + 32 i: coalesced; zeros past the group, so the warp never waits for
 * a global load) and arrives on the full barrier when they land. The group's fields are read once per tile: inside
 * the loop the copies' memory clobbers would reload them every k-block. */
template <int B_PER_ROW, int TILE_N>
__device__ __forceinline__ void produce_b(const kernel_args &args, uint8_t *b_tiles, float *a_factors, float *b_factors,
                                          uint64_t *full, uint64_t *empty, int rank)
{
    constexpr int b_blocks = TILE_N / TILE; /* 128x128 factor blocks across a tile (per-block form) */
    const int lane = threadIdx.x % 32, stages = args.stages;
    int s = 0;
    uint32_t phase = 0, it = 0;
    tile_walk walk = walk_begin(args, rank, WALK_WARP);
    tile_pos tp;
    while (walk_next(args, rank, walk, tp)) {
        const group_dev &g = args.groups[tp.group];
        const bool live = tp.n_tile < g.n_tiles;
        const CUtensorMap *map = args.maps + g.b_map;
        const int row = (int)(g.b_row0 + (int64_t)tp.n_tile * TILE_N);
        const int rows_left = g.m - tp.m_tile * TILE - lane, cols_left = g.n - tp.n_tile * TILE_N - lane;
        const int64_t a_stride = g.a_scale_kb_stride, b_stride = g.b_scale_stride;
        const float *sa = g.a_scale + tp.m_tile * TILE + lane;
        /* per block: lane l < b_blocks copies the factor of the tile's l-th column block (zero past the group) */
        const int b_block = tp.n_tile * b_blocks + lane;
        const bool b_block_ok = live && lane < b_blocks && b_block * TILE < g.n;
        const float *sb = B_PER_ROW ? g.b_scale + tp.n_tile * TILE + lane
                                    : g.b_scale + (int64_t)(b_block_ok ? b_block : 0) * b_stride;
        const int kb_count = g.kb_count;
        for (int kb = 0; kb < kb_count; kb++, it++) {
            if (it >= (uint32_t)stages) mbar_wait(&empty[s], phase ^ 1);
            if (lane == 0) {
                uint8_t *stage = b_tiles + (size_t)s * TILE * TILE_N;
                mbar_arrive_expect_tx(&full[s], live ? TILE * TILE_N : 0);
                if (tp.b_shared) /* its half of the pair's B tile, to both */
                    tensor_load_2d_multicast(stage + rank * TILE_BYTES, map, kb * TILE, row + rank * TILE, &full[s],
                                             (uint16_t)0x3);
                else if (live)
                    for (int b = 0; b < TILE_N / TILE; b++)
                        tensor_load_2d(stage + b * TILE_BYTES, map, kb * TILE, row + b * TILE, &full[s]);
            }
            float *a_dst = a_factors + s * TILE + lane, *b_dst = b_factors + s * TILE + lane;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                async_copy4(a_dst + 32 * i, sa + 32 * i, 32 * i < rows_left);
                if (B_PER_ROW) async_copy4(b_dst + 32 * i, sb + 32 * i, 32 * i < cols_left);
            }
            if (!B_PER_ROW && lane < b_blocks) async_copy4(b_dst, sb + kb, b_block_ok);
            async_copy_arrive(&full[s]);
            sa += a_stride;
            if (B_PER_ROW) sb += b_stride;
            if (++s == stages) s = 0, phase ^= 1;
        }
    }
}

/* The consumers' position in the stage ring. */
typedef struct ring_pos {
    int s;
    uint32_t phase;
} ring_pos;

__device__ __forceinline__ void ring_next(ring_pos &r, int stages)
{
    if (++r.s == stages) r.s = 0, r.phase ^= 1;
}

/* Hands stage s back to the producers of the cluster (one arrival per consumer warp, in each CTA). */
__device__ __forceinline__ void release_stage(uint64_t *empty, int s, int cluster, int rank)
{
    mbar_arrive_warp(&empty[s], cluster == 2, (uint32_t)(cluster == 2 ? rank ^ 1 : rank)); /* a CTA that exists */
}

/* Hands back the next `count` stages unread as they fill (a tile with no rows or columns of D for this consumer). */
__device__ __forceinline__ void pass_stages(int count, ring_pos &r, int stages, uint64_t *full, uint64_t *empty,
                                            int cluster, int rank)
{
    for (int kb = 0; kb < count; kb++) {
        mbar_wait(&full[r.s], r.phase);
        release_stage(empty, r.s, cluster, rank);
        ring_next(r, stages);
    }
}

/* A k-block's row factors for this thread (rows r0 and r0 + 8) and, in the forward form, its column block's factor:
 * read from the stage when its wgmma are issued, so the loads land while they run. */
typedef struct block_factors {
    float sa0, sa1, sb;
} block_factors;

/* Waits for the next stage, reads this thread's factors and starts the stage's four wgmma into part (one commit
 * group); returns the stage. */
template <int A_FMT, int B_FMT, int B_PER_ROW>
__device__ __forceinline__ int issue_block(float *part, block_factors &f, ring_pos &r, int stages, uint64_t *full,
                                           const uint8_t *a_tiles, const uint8_t *b_tiles, const float *a_factors,
                                           const float *b_factors, int c, int r0)
{
    const int s = r.s;
    mbar_wait(&full[s], r.phase);
    f.sa0 = a_factors[s * TILE + r0];
    f.sa1 = a_factors[s * TILE + r0 + 8];
    f.sb = B_PER_ROW ? 1.f : b_factors[s * TILE];
    const uint64_t da = wgmma_desc_k_sw128(a_tiles + s * TILE_BYTES + c * 64 * TILE);
    const uint64_t db = wgmma_desc_k_sw128(b_tiles + s * TILE_BYTES);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < TILE / 32; k++) wgmma_tile<A_FMT, B_FMT>(part, da + 2 * k, db + 2 * k, k > 0);
    wgmma_commit();
    ring_next(r, stages);
    return s;
}

/* acc += part * sa(row) * sb(col) with the block's factors f (and, per row of B, stage s's column factors; columns
 * col0 + 8 j, + 1). */
template <int B_PER_ROW>
__device__ __forceinline__ void promote(float *acc, float *part, const block_factors &f, const float *b_factors, int s,
                                        int col0)
{
    fence_registers(part);
    if (B_PER_ROW) {
#pragma unroll
        for (int j = 0; j < 16; j++) {
            const float2 sb = *(const float2 *)&b_factors[s * TILE + 8 * j + col0];
            acc[4 * j + 0] += part[4 * j + 0] * (f.sa0 * sb.x);
            acc[4 * j + 1] += part[4 * j + 1] * (f.sa0 * sb.y);
            acc[4 * j + 2] += part[4 * j + 2] * (f.sa1 * sb.x);
            acc[4 * j + 3] += part[4 * j + 3] * (f.sa1 * sb.y);
        }
    } else {
        const float s0 = f.sa0 * f.sb, s1 = f.sa1 * f.sb;
#pragma unroll
        for (int j = 0; j < 16; j++) {
            acc[4 * j + 0] += part[4 * j + 0] * s0;
            acc[4 * j + 1] += part[4 * j + 1] * s0;
            acc[4 * j + 2] += part[4 * j + 2] * s1;
            acc[4 * j + 3] += part[4 * j + 3] * s1;
        }
    }
}

/* One k-block on its own: wait for the stage, wgmma into part, wait for them, promote into acc, hand the stage back. */
template <int A_FMT, int B_FMT, int B_PER_ROW>
__device__ __forceinline__ void single_block(float *acc, float *part, ring_pos &r, int stages, uint64_t *full,
                                             uint64_t *empty, const uint8_t *a_tiles, const uint8_t *b_tiles,
                                             const float *a_factors, const float *b_factors, int c, int r0, int col0,
                                             int cluster, int rank)
{
    block_factors f;
    const int s =
        issue_block<A_FMT, B_FMT, B_PER_ROW>(part, f, r, stages, full, a_tiles, b_tiles, a_factors, b_factors, c, r0);
    wgmma_wait<0>();
    promote<B_PER_ROW>(acc, part, f, b_factors, s, col0);
    release_stage(empty, s, cluster, rank);
}

/* A consumer thread's place in its warpgroup's accumulators: rows r0 and r0 + 8 of the tile, columns col0 + 8 j and
 * + 1 (j < 16 per 128 columns). */
typedef struct consumer_lane {
    int r0, col0;
} consumer_lane;

__device__ __forceinline__ consumer_lane consumer_lane_of(int c)
{
    const int warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
    consumer_lane l = {c * 64 + warp * 16 + lane / 4, 2 * (lane % 4)};
    return l;
}

/* Whether consumer warpgroup c has nothing of tile tp to compute: a dead column block, or its 64 rows all past the
 * group's m (an expert's short last row block). It then hands the tile's stages back unread (pass_stages). */
__device__ __forceinline__ bool consumer_idle(const group_dev &g, const tile_pos &tp, int c)
{
    return tp.n_tile >= g.n_tiles || tp.m_tile * TILE + c * 64 >= g.m;
}

/* Consumer warpgroup C (see consumer): per tile, the k-blocks' wgmma into part0 / part1 in turn, one block ahead of
 * the promotion into acc, then the epilogue (staged for the epilogue warp, or stored from registers). */
template <int A_FMT, int B_FMT, int B_PER_ROW, int C>
__device__ __forceinline__ void
consume(const kernel_args &args, int rank, const uint8_t *a_tiles, const uint8_t *b_tiles, const float *a_factors,
        const float *b_factors, uint64_t *full, uint64_t *empty, uint8_t *boxes, uint64_t *d_ready, uint64_t *d_staged)
{
    const int stages = args.stages, cluster = args.cluster, c = C;
    const consumer_lane at = consumer_lane_of(c);
    const int r0 = at.r0, col0 = at.col0;
    const size_t set_bytes = set_bytes_of(args.d_bf16, args.tile_n);
    ring_pos ring = {0, 0};
    int set = 0;
    uint32_t ready_phase = 0; /* bit per set */
    tile_walk walk = walk_begin(args, rank, WALK_WARP);
    tile_pos tp;
    while (walk_next(args, rank, walk, tp)) {
        const group_dev &g = args.groups[tp.group];
        const int kb_count = g.kb_count;
        if (consumer_idle(g, tp, c)) {
            pass_stages(kb_count, ring, stages, full, empty, cluster, rank);
            continue;
        }
        float acc[64], part0[64], part1[64];
#pragma unroll
        for (int i = 0; i < 64; i++) acc[i] = 0.f;
        /* k-blocks in pairs: the second block's wgmma runs while the first is promoted. (Nothing may be in flight
         * across a branch ptxas cannot prove warpgroup-uniform, such as a loop's test on kb_count, or it serializes
         * every wgmma; so the pair is issued together and drained before the loop goes on.) The per-row form (the
         * wgrad's, bound by D's memory traffic) runs one block at a time: its promotion needs more registers. */
        int kb = 0;
        if (!B_PER_ROW && args.pairs == 2 && c == 1 && kb_count > 2) { /* the second warpgroup one block out of step */
            single_block<A_FMT, B_FMT, B_PER_ROW>(acc, part0, ring, stages, full, empty, a_tiles, b_tiles, a_factors,
                                                  b_factors, c, r0, col0, cluster, rank);
            kb = 1;
        }
        if (!B_PER_ROW && args.pairs) {
            for (; kb + 1 < kb_count; kb += 2) {
                block_factors f0, f1;
                const int s0 = issue_block<A_FMT, B_FMT, B_PER_ROW>(part0, f0, ring, stages, full, a_tiles, b_tiles,
                                                                    a_factors, b_factors, c, r0);
                const int s1 = issue_block<A_FMT, B_FMT, B_PER_ROW>(part1, f1, ring, stages, full, a_tiles, b_tiles,
                                                                    a_factors, b_factors, c, r0);
                wgmma_wait<1>();
                promote<B_PER_ROW>(acc, part0, f0, b_factors, s0, col0);
                release_stage(empty, s0, cluster, rank);
                wgmma_wait<0>();
                promote<B_PER_ROW>(acc, part1, f1, b_factors, s1, col0);
                release_stage(empty, s1, cluster, rank);
            }
        }
        for (; kb < kb_count; kb++)
            single_block<A_FMT, B_FMT, B_PER_ROW>(acc, part0, ring, stages, full, empty, a_tiles, b_tiles, a_factors,
                                                  b_factors, c, r0, col0, cluster, rank);
        if (g.d_map >= 0) {
            stage_tile(args, acc, boxes + set * set_bytes, &d_ready[set], (ready_phase >> set) & 1, &d_staged[set]);
            ready_phase ^= 1u << set;
            set ^= args.out_sets - 1;
        } else {
            store_tile<16>(g, tp.m_tile * TILE + r0, tp.n_tile * TILE + col0, acc, part0, args.d_bf16, args.accumulate);
        }
    }
}

/* Consumer warpgroup C (see consumer) in the wide forward form (tiles of 128 x WIDE_N, bf16 D written, 128x128 B
 * factors): per k-block, the left and then the right 128 columns of its 64 rows go through the tensor cores into one
 * set of partial sums and are promoted into acc[0..63] and acc[64..127]. Per k-block the SM takes in 48 KB for 8.4 MFLOP
 * (the 128 x 128 tile: 32 KB for 4.2), and each warpgroup reads the stage's A rows twice and B once. The partial
 * sums are not double-buffered (acc and part already hold 192 registers): while one warpgroup promotes, the
 * other's wgmma keep the tensor cores busy. The stage is handed back once the right half's wgmma are done. */
template <int A_FMT, int B_FMT, int C>
__device__ __forceinline__ void consume_wide(const kernel_args &args, int rank, const uint8_t *a_tiles,
                                             const uint8_t *b_tiles, const float *a_factors, const float *b_factors,
                                             uint64_t *full, uint64_t *empty, uint8_t *boxes, uint64_t *d_ready,
                                             uint64_t *d_staged)
{
    const int stages = args.stages, cluster = args.cluster, c = C;
    const consumer_lane at = consumer_lane_of(c); /* columns col0 + 8 j, j < 32 */
    const int r0 = at.r0, col0 = at.col0;
    const size_t set_bytes = set_bytes_of(1, WIDE_N);
    ring_pos ring = {0, 0};
    int set = 0;
    uint32_t ready_phase = 0; /* bit per set */
    tile_walk walk = walk_begin(args, rank, WALK_WARP);
    tile_pos tp;
    while (walk_next(args, rank, walk, tp)) {
        const group_dev &g = args.groups[tp.group];
        const int kb_count = g.kb_count;
        if (consumer_idle(g, tp, c)) {
            pass_stages(kb_count, ring, stages, full, empty, cluster, rank);
            continue;
        }
        float acc[128], part[64];
#pragma unroll
        for (int i = 0; i < 128; i++) acc[i] = 0.f;
        for (int kb = 0; kb < kb_count; kb++) {
            const int s = ring.s;
            mbar_wait(&full[s], ring.phase);
            const float sa0 = a_factors[s * TILE + r0], sa1 = a_factors[s * TILE + r0 + 8];
            const float sb_left = b_factors[s * TILE], sb_right = b_factors[s * TILE + 1];
            const uint64_t da = wgmma_desc_k_sw128(a_tiles + s * TILE_BYTES + c * 64 * TILE);
            const uint64_t db = wgmma_desc_k_sw128(b_tiles + (size_t)s * TILE * WIDE_N);
#pragma unroll
            for (int h = 0; h < 2; h++) {
                wgmma_fence();
#pragma unroll
                for (int k = 0; k < TILE / 32; k++)
                    wgmma_tile<A_FMT, B_FMT>(part, da + 2 * k, db + h * (TILE_BYTES >> 4) + 2 * k, k > 0);
                wgmma_commit();
                wgmma_wait<0>();
                if (h == 1) release_stage(empty, s, cluster, rank);
                fence_registers(part);
                const float sb = h ? sb_right : sb_left, s0 = sa0 * sb, s1 = sa1 * sb;
#pragma unroll
                for (int j = 0; j < 16; j++) {
                    acc[64 * h + 4 * j + 0] += part[4 * j + 0] * s0;
                    acc[64 * h + 4 * j + 1] += part[4 * j + 1] * s0;
                    acc[64 * h + 4 * j + 2] += part[4 * j + 2] * s1;
                    acc[64 * h + 4 * j + 3] += part[4 * j + 3] * s1;
                }
            }
            ring_next(ring, stages);
        }
        if (g.d_map >= 0) {
            stage_tile_as<1, 0, 32>(acc, boxes + set * set_bytes, &d_ready[set], (ready_phase >> set) & 1,
                                    &d_staged[set]);
            ready_phase ^= 1u << set;
            set ^= args.out_sets - 1;
        } else {
            store_tile<32>(g, tp.m_tile * TILE + r0, tp.n_tile * WIDE_N + col0, acc, NULL, 1, 0);
        }
    }
}

/* Consumer warpgroup C (rows C * 64 .. C * 64 + 63 of each tile) in the kernel's form, with its output sets and
 * epilogue barriers. C is a template parameter rather than a value computed from threadIdx, so that ptxas knows it is
 * the same in the whole warp and computes the stages' wgmma descriptors in uniform registers. From threadIdx, every
 * descriptor went through R2UR moves and 64-bit adds (some 70 instructions between a stage's arrival and its first
 * wgmma, 270 per k-block in the wide form instead of 201), and every pass ran 3-6% slower (DESIGN.md). */
template <int A_FMT, int B_FMT, int B_PER_ROW, int WIDE, int C>
__device__ __forceinline__ void consumer(const kernel_args &args, int rank, const uint8_t *a_tiles,
                                         const uint8_t *b_tiles, const float *a_factors, const float *b_factors,
                                         uint64_t *full, uint64_t *empty, uint8_t *out_boxes, size_t consumer_boxes,
                                         uint64_t *d_ready, uint64_t *d_staged)
{
    uint8_t *boxes = out_boxes + C * consumer_boxes;
    uint64_t *ready = d_ready + C * MAX_OUT_SETS, *staged = d_staged + C * MAX_OUT_SETS;
    if constexpr (WIDE)
        consume_wide<A_FMT, B_FMT, C>(args, rank, a_tiles, b_tiles, a_factors, b_factors, full, empty, boxes, ready,
                                      staged);
    else
        consume<A_FMT, B_FMT, B_PER_ROW, C>(args, rank, a_tiles, b_tiles, a_factors, b_factors, full, empty, boxes,
                                            ready, staged);
}

/* Persistent: each cluster takes work units blockIdx.x / cluster, + gridDim.x / cluster, ..., or as they are handed
 * out (kernel_args.work_counter, walk_next); the stage ring runs
 * on across tiles, so the producer loads the next tile's first k-blocks while the consumers finish this one. */
template <int A_FMT, int B_FMT, int B_PER_ROW, int WIDE>
__global__ void __launch_bounds__(THREADS, 1) fp8_block_gemm_kernel(const kernel_args args)
{
#ifdef FP8_BLOCK_DEVICE
    constexpr int tile_n = WIDE ? WIDE_N : TILE;
    const kernel_smem m = kernel_smem_of(args);
    const int stages = args.stages, cluster = args.cluster;
    uint8_t *a_tiles = m.a_tiles, *b_tiles = m.b_tiles, *out_boxes = m.out_boxes;
    float *a_factors = m.a_factors, *b_factors = m.b_factors;
    uint64_t *full = m.full, *empty = m.empty, *d_ready = m.d_ready, *d_staged = m.d_staged;
    const int rank = (int)(blockIdx.x % cluster);

    if (threadIdx.x == 0) {
        for (int s = 0; s < stages; s++) {
            mbar_init_count(&full[s], 32 + 2); /* produce_b's lanes' factor copies; A's and B's TMA bytes */
            mbar_init_count(&empty[s], CONSUMER_WARPS * cluster);
        }
        for (int i = 0; i < 2 * MAX_OUT_SETS; i++) {
            mbar_init(&d_ready[i]);
            mbar_init_count(&d_staged[i], 4); /* the consumer's warps */
        }
        for (int i = 0; i < UNIT_RING; i++) { /* the handed-out walk (walk_next) */
            mbar_init(&m.unit_full[i]);
            mbar_init_count(&m.unit_empty[i], UNIT_READERS * cluster + cluster - 1);
        }
        mbar_init_fence();
    }
    if (cluster > 1)
        cluster_sync(); /* the peer's barriers exist before anything is multicast or arrives there */
    else
        __syncthreads();

    const int wg = threadIdx.x / 128, warp = threadIdx.x / 32;
    const size_t consumer_boxes = args.out_sets * set_bytes_of(args.d_bf16, tile_n);
    if (wg == 0) {
        /* registers move between warpgroups of the CTA: the consumers' increase (256 x (224 - 168)) must not exceed
         * what the producer's warpgroup gives back (128 x (168 - 56)), or setmaxnreg.inc waits forever */
        warpgroup_registers_dec<56>();
        if (warp == 0 && threadIdx.x % 32 == 0) produce_a(args, a_tiles, full, empty, rank);
        if (warp == 3) produce_b<B_PER_ROW, tile_n>(args, b_tiles, a_factors, b_factors, full, empty, rank);
        if ((warp == 1 || warp == 2) && threadIdx.x % 32 == 0) {
            const int c = warp - 1;
            epilogue_dma(args, rank, c, out_boxes + c * consumer_boxes, d_ready + c * MAX_OUT_SETS,
                         d_staged + c * MAX_OUT_SETS);
        }
    } else {
        warpgroup_registers_inc<224>();
        if (wg == 1)
            consumer<A_FMT, B_FMT, B_PER_ROW, WIDE, 0>(args, rank, a_tiles, b_tiles, a_factors, b_factors, full, empty,
                                                       out_boxes, consumer_boxes, d_ready, d_staged);
        else
            consumer<A_FMT, B_FMT, B_PER_ROW, WIDE, 1>(args, rank, a_tiles, b_tiles, a_factors, b_factors, full, empty,
                                                       out_boxes, consumer_boxes, d_ready, d_staged);
    }
    if (cluster > 1) cluster_sync(); /* no CTA leaves while its peer may still arrive on its barriers */
#endif
}

/* ---- host ---- */

typedef void (*kernel_fn)(const kernel_args);

/* The kernel instance for the formats, the B factor layout and the tile width (wide: the forward form only); NULL
 * for two E5M2 operands. */
static kernel_fn kernel_for(int a_format, int b_format, int b_per_row, int wide)
{
    if (wide && !b_per_row) {
        if (a_format == 0 && b_format == 0) return fp8_block_gemm_kernel<0, 0, 0, 1>;
        if (a_format == 1 && b_format == 0) return fp8_block_gemm_kernel<1, 0, 0, 1>;
        if (a_format == 0 && b_format == 1) return fp8_block_gemm_kernel<0, 1, 0, 1>;
        return NULL;
    }
    if (a_format == 0 && b_format == 0)
        return b_per_row ? fp8_block_gemm_kernel<0, 0, 1, 0> : fp8_block_gemm_kernel<0, 0, 0, 0>;
    if (a_format == 1 && b_format == 0)
        return b_per_row ? fp8_block_gemm_kernel<1, 0, 1, 0> : fp8_block_gemm_kernel<1, 0, 0, 0>;
    if (a_format == 0 && b_format == 1)
        return b_per_row ? fp8_block_gemm_kernel<0, 1, 1, 0> : fp8_block_gemm_kernel<0, 1, 0, 0>;
    return NULL;
}

/* The ring's depth and the staged output sets of a call with tiles tile_n columns wide: two bf16 sets of 128 x 128
 * (64 KB, the next tile's set ready while this one is stored), one of 128 x WIDE_N (64 KB) or one fp32 set (64 KB),
 * and as many stages as then fit (four of 32 KB, three of 48 KB), at most tuning.stages; without the TMA epilogue no
 * sets. */
static void ring_for(const moert_fp8_block_ctx *ctx, int d_bf16, int tile_n, int *stages, int *sets)
{
    *sets = !ctx->staged ? 0 : d_bf16 && tile_n == TILE ? 2 : 1;
    *stages = ctx->stages_set ? ctx->stages_set : 16;
    while (*stages > 2 && smem_bytes(d_bf16, tile_n, *stages, *sets) > ctx->smem_max) (*stages)--;
    if (smem_bytes(d_bf16, tile_n, *stages, *sets) > ctx->smem_max) *sets = 1;
}

/* The output tile's columns of a call: WIDE_N for the forward form writing bf16 D where the context allows it (the
 * wide consumer keeps 128 accumulators a thread, with no room for fp32 D's staging or old values to add). */
static int tile_n_for(const moert_fp8_block_ctx *ctx, const moert_fp8_block_gemm *gm)
{
    return ctx->tile_n == WIDE_N && !gm->b_per_row && gm->d_bf16 && !gm->accumulate ? WIDE_N : TILE;
}

extern "C" moert_result moert_fp8_block_ctx_create(const moert_host *host, moert_fp8_block_ctx **out)
{
    *out = NULL;
    int dev = 0, major = 0, minor = 0;
    CUDA_CHECK(host, cudaGetDevice(&dev));
    CUDA_CHECK(host, cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    CUDA_CHECK(host, cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
    if (major != 9 || minor != 0)
        return report(host, MOERT_ERR_UNSUPPORTED,
                      "the blockwise FP8 GEMM kernel needs a compute capability 9.0 GPU (wgmma); cuda:%d is %d.%d", dev,
                      major, minor);
    void *fn = NULL;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    CUDA_CHECK(host, cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
    if (!fn || found != cudaDriverEntryPointSuccess)
        return report(host, MOERT_ERR_UNSUPPORTED,
                      "the CUDA driver has no cuTensorMapEncodeTiled (needs 12.0 or newer)");
    int smem_optin = 0;
    CUDA_CHECK(host, cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    const size_t smem_max = (size_t)smem_optin;
    for (int a = 0; a < 2; a++)
        for (int b = 0; b < 2; b++)
            for (int per_row = 0; per_row < 2; per_row++)
                for (int wide = 0; wide < 2; wide++) {
                    kernel_fn k = kernel_for(a, b, per_row, wide);
                    if (k)
                        CUDA_CHECK(host,
                                   cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem_max));
                }
    int sm_count = 0, max_clusters = 0;
    CUDA_CHECK(host, cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, dev));
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr = {};
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = MAX_CLUSTER, attr.val.clusterDim.y = 1, attr.val.clusterDim.z = 1;
    cfg.gridDim = dim3((unsigned)(sm_count / MAX_CLUSTER * MAX_CLUSTER));
    cfg.blockDim = dim3(THREADS);
    cfg.dynamicSmemBytes = smem_max;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    CUDA_CHECK(host, cudaOccupancyMaxActiveClusters(&max_clusters, kernel_for(0, 0, 0, 0), &cfg));
    moert_fp8_block_ctx *ctx = (moert_fp8_block_ctx *)calloc(1, sizeof *ctx);
    if (!ctx) return report(host, MOERT_ERR_OUT_OF_MEMORY, "fp8 block gemm: out of host memory");
    ctx->host = host;
    ctx->encode = (PFN_cuTensorMapEncodeTiled_v12000)fn;
    ctx->sm_count = sm_count > 0 ? sm_count : 1;
    ctx->fit_clusters = max_clusters < sm_count / MAX_CLUSTER ? max_clusters : sm_count / MAX_CLUSTER;
    if (ctx->fit_clusters < 0) ctx->fit_clusters = 0;
    ctx->staged = 1;
    ctx->smem_max = smem_max;
    const moert_fp8_block_tuning defaults = moert_fp8_block_tuning_default();
    (void)moert_fp8_block_ctx_tune(ctx, &defaults); /* in range by construction */
    for (int i = 0; i < SLOTS; i++) {
        cudaError_t err = cudaEventCreateWithFlags(&ctx->done[i], cudaEventDisableTiming);
        if (err != cudaSuccess) {
            moert_fp8_block_ctx_destroy(ctx);
            return report(host, MOERT_ERR_CUDA, "cudaEventCreateWithFlags failed: %s", cudaGetErrorString(err));
        }
    }
    *out = ctx;
    return MOERT_OK;
}

extern "C" moert_result moert_fp8_block_ctx_configure(moert_fp8_block_ctx *ctx, int cluster, int staged_epilogue)
{
    if (cluster != 1 && cluster != 2)
        return report(ctx->host, MOERT_ERR_INVALID_ARGUMENT, "fp8 block gemm: cluster size %d (1 or 2)", cluster);
    if (cluster == 2 && ctx->fit_clusters < 1)
        return report(ctx->host, MOERT_ERR_UNSUPPORTED, "fp8 block gemm: no cluster of two CTAs fits on this GPU");
    ctx->cluster = cluster;
    ctx->staged = staged_epilogue != 0;
    return MOERT_OK;
}

extern "C" moert_result moert_fp8_block_ctx_tune(moert_fp8_block_ctx *ctx, const moert_fp8_block_tuning *t)
{
    const moert_host *host = ctx->host;
    if (t->tile_n != TILE && t->tile_n != WIDE_N)
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "fp8 block gemm: output tile of %d columns (%d or %d)",
                      t->tile_n, TILE, WIDE_N);
    if (t->stages != 0 && (t->stages < 2 || t->stages > 16))
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "fp8 block gemm: %d stages (2 to 16, or 0: as many as fit)",
                      t->stages);
    if (t->pairs < 0 || t->pairs > 2)
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "fp8 block gemm: pairs mode %d (0, 1 or 2)", t->pairs);
    if (t->cluster < 0 || t->cluster > 2)
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "fp8 block gemm: cluster size %d (1 or 2; 0: 2 where it fits)",
                      t->cluster);
    if (t->cluster == 2 && ctx->fit_clusters < 1)
        return report(host, MOERT_ERR_UNSUPPORTED,
                      "fp8 block gemm: no cluster of two CTAs fits on this GPU "
                      "($.precision.block_cluster 2; 0 takes pairs only where they fit)");
    if (t->clusters < 0)
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "fp8 block gemm: %d resident clusters", t->clusters);
    ctx->tile_n = t->tile_n;
    ctx->stages_set = t->stages;
    ctx->pairs = t->pairs;
    ctx->pair_rows = t->pair_rows != 0;
    ctx->cluster = t->cluster ? t->cluster : ctx->fit_clusters > 0 ? MAX_CLUSTER : 1;
    /* a cap above what fits is no cap: the grid never exceeds what is resident at once */
    ctx->max_clusters = t->clusters > 0 && t->clusters < ctx->fit_clusters ? t->clusters : ctx->fit_clusters;
    ctx->max_ctas = t->clusters > 0 && t->clusters < ctx->sm_count ? t->clusters : ctx->sm_count;
    return MOERT_OK;
}

extern "C" moert_result moert_fp8_block_ctx_set_tile_n(moert_fp8_block_ctx *ctx, int tile_n)
{
    if (tile_n != TILE && tile_n != WIDE_N)
        return report(ctx->host, MOERT_ERR_INVALID_ARGUMENT, "fp8 block gemm: output tile of %d columns (%d or %d)",
                      tile_n, TILE, WIDE_N);
    ctx->tile_n = tile_n;
    return MOERT_OK;
}

extern "C" void moert_fp8_block_ctx_describe(const moert_fp8_block_ctx *ctx, char *buf, size_t size)
{
    int stages16, sets16, stages32, sets32, stages_wide, sets_wide;
    ring_for(ctx, 1, TILE, &stages16, &sets16);
    ring_for(ctx, 0, TILE, &stages32, &sets32);
    ring_for(ctx, 1, WIDE_N, &stages_wide, &sets_wide);
    char ring[160];
    if (ctx->tile_n == WIDE_N)
        snprintf(ring, sizeof ring,
                 "forward form with bf16 D in 128x%d tiles (%d stages + %d output set), else 128x128 tiles (%d stages "
                 "+ %d output sets with bf16 D, %d + %d with fp32 D)",
                 WIDE_N, stages_wide, sets_wide, stages16, sets16, stages32, sets32);
    else
        snprintf(ring, sizeof ring, "128x128 tiles, %d stages + %d output sets (bf16 D), %d + %d (fp32 D)", stages16,
                 sets16, stages32, sets32);
    if (ctx->cluster > 1)
        snprintf(buf, size, "%d clusters of 2 CTAs (%s multicast), %s epilogue, %s", ctx->max_clusters,
                 ctx->pair_rows && ctx->tile_n == WIDE_N ? "B (wide tiles) or A" : "A",
                 ctx->staged ? "TMA" : "register", ring);
    else
        snprintf(buf, size, "%d CTAs, no clusters, %s epilogue, %s", ctx->max_ctas, ctx->staged ? "TMA" : "register",
                 ring);
}

static void slots_free(moert_fp8_block_ctx *ctx)
{
    for (int i = 0; i < SLOTS; i++) {
        if (ctx->used[i]) (void)cudaEventSynchronize(ctx->done[i]);
        if (ctx->pinned[i]) (void)cudaFreeHost(ctx->pinned[i]);
        if (ctx->table[i]) (void)cudaFree(ctx->table[i]);
        ctx->pinned[i] = ctx->table[i] = NULL;
        ctx->used[i] = 0;
    }
    ctx->slot_bytes = 0;
}

extern "C" void moert_fp8_block_ctx_destroy(moert_fp8_block_ctx *ctx)
{
    if (!ctx) return;
    slots_free(ctx);
    for (int i = 0; i < SLOTS; i++)
        if (ctx->done[i]) (void)cudaEventDestroy(ctx->done[i]);
    free(ctx->map_of);
    free(ctx);
}

/* Makes every slot hold `bytes` (all slots are waited for and made again when they grow; rare). */
static moert_result slots_reserve(moert_fp8_block_ctx *ctx, size_t bytes)
{
    if (bytes <= ctx->slot_bytes) return MOERT_OK;
    const size_t want = bytes + bytes / 2 + 4096;
    slots_free(ctx);
    for (int i = 0; i < SLOTS; i++) {
        CUDA_CHECK(ctx->host, cudaMallocHost(&ctx->pinned[i], want));
        CUDA_CHECK(ctx->host, cudaMalloc(&ctx->table[i], want));
    }
    ctx->slot_bytes = want;
    return MOERT_OK;
}

/* The tensor map of one FP8 matrix: boxes of 128 columns by box_rows rows, 128-byte swizzle, zeros outside. */
static moert_result encode_map(moert_fp8_block_ctx *ctx, const moert_fp8_block_matrix *mx, int index, int box_rows,
                               CUtensorMap *map)
{
    const moert_host *host = ctx->host;
    if (!mx->base || mx->rows <= 0 || mx->cols <= 0 || mx->ld < mx->cols || mx->ld % 16 || (uintptr_t)mx->base % 16)
        return report(host, MOERT_ERR_INVALID_ARGUMENT,
                      "fp8 block gemm: matrix %d (%p, %lld x %lld, ld %lld) needs a 16-byte aligned base and a row "
                      "stride >= cols and a multiple of 16",
                      index, mx->base, (long long)mx->rows, (long long)mx->cols, (long long)mx->ld);
    const cuuint64_t dims[2] = {(cuuint64_t)mx->cols, (cuuint64_t)mx->rows};
    const cuuint64_t strides[1] = {(cuuint64_t)mx->ld};
    const cuuint32_t box[2] = {TILE, (cuuint32_t)box_rows};
    const cuuint32_t elem[2] = {1, 1};
    CUresult r = ctx->encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, (void *)mx->base, dims, strides, box, elem,
                             CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS)
        return report(host, MOERT_ERR_CUDA, "cuTensorMapEncodeTiled(matrix %d, %lld x %lld, ld %lld) failed: error %d",
                      index, (long long)mx->rows, (long long)mx->cols, (long long)mx->ld, (int)r);
    return MOERT_OK;
}

/* The tensor map of a group's D for the staged epilogue (boxes of 64 rows by 128 bytes, 128-byte swizzle, m x n
 * exactly, so TMA clips partial tiles). 0 where TMA cannot address D (base or row stride not a multiple of 16
 * bytes): that group is stored from registers. */
static int encode_d_map(moert_fp8_block_ctx *ctx, const moert_fp8_block_group *g, int d_bf16, CUtensorMap *map)
{
    const size_t es = d_bf16 ? 2 : 4;
    if ((uintptr_t)g->d % 16 || (g->ldd * (int64_t)es) % 16) return 0;
    const cuuint64_t dims[2] = {(cuuint64_t)g->n, (cuuint64_t)g->m};
    const cuuint64_t strides[1] = {(cuuint64_t)(g->ldd * (int64_t)es)};
    const cuuint32_t box[2] = {(cuuint32_t)(128 / es), 64};
    const cuuint32_t elem[2] = {1, 1};
    return ctx->encode(map, d_bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, g->d, dims,
                       strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                       CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

static int64_t ceil_div64(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* Checks one group against the call and fills its kernel form (tile_start and the maps set by the caller). */
static moert_result group_fill(const moert_host *host, const moert_fp8_block_gemm *gm, int i, int tile_n,
                               group_dev *out)
{
    const moert_fp8_block_group *g = &gm->groups[i];
    if (g->a_matrix < 0 || g->a_matrix >= gm->matrix_count || g->b_matrix < 0 || g->b_matrix >= gm->matrix_count)
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "fp8 block gemm: group %d names matrices %d and %d of %d", i,
                      g->a_matrix, g->b_matrix, gm->matrix_count);
    const moert_fp8_block_matrix *a = &gm->matrices[g->a_matrix], *b = &gm->matrices[g->b_matrix];
    if (g->a_row0 < 0 || g->b_row0 < 0 || g->a_row0 >= a->rows || g->b_row0 >= b->rows || g->k > a->cols ||
        g->k > b->cols || g->n % 2 || g->ldd < g->n || g->ldd % 2 || !g->d || !g->a_scale || !g->b_scale ||
        g->m > INT32_MAX || g->n > INT32_MAX || g->a_row0 + g->m > INT32_MAX || g->b_row0 + g->n > INT32_MAX)
        return report(host, MOERT_ERR_INVALID_ARGUMENT,
                      "fp8 block gemm: group %d (m %lld, n %lld, k %lld, rows from %lld / %lld, ldd %lld) does not fit "
                      "its matrices (%lld x %lld, %lld x %lld) or has an odd n / ldd or a NULL pointer",
                      i, (long long)g->m, (long long)g->n, (long long)g->k, (long long)g->a_row0, (long long)g->b_row0,
                      (long long)g->ldd, (long long)a->rows, (long long)a->cols, (long long)b->rows,
                      (long long)b->cols);
    out->a_row0 = g->a_row0;
    out->b_row0 = g->b_row0;
    out->a_scale = g->a_scale;
    out->b_scale = g->b_scale;
    out->a_scale_kb_stride = g->a_scale_kb_stride;
    out->b_scale_stride = g->b_scale_stride;
    out->d = g->d;
    out->ldd = g->ldd;
    out->m = (int32_t)g->m;
    out->n = (int32_t)g->n;
    out->kb_count = (int32_t)ceil_div64(g->k, TILE);
    out->m_tiles = (int32_t)ceil_div64(g->m, TILE);
    out->n_tiles = (int32_t)ceil_div64(g->n, tile_n);
    out->d_map = -1;
    return MOERT_OK;
}

/* The index of matrix `index`'s tensor map as an A operand (64-row boxes, half a tile: a CTA of a pair loads one) or
 * as B (128-row boxes: a 128x128 tile, or half of a wide one), encoded into maps[*count] on first use. */
static moert_result matrix_map(moert_fp8_block_ctx *ctx, const moert_fp8_block_gemm *gm, int index, int as_b,
                               CUtensorMap *maps, int *count, int32_t *out)
{
    int *slot = &ctx->map_of[2 * index + as_b];
    if (*slot < 0) {
        MOK(encode_map(ctx, &gm->matrices[index], index, as_b ? TILE : HALF_ROWS, &maps[*count]));
        *slot = (*count)++;
    }
    *out = *slot;
    return MOERT_OK;
}

extern "C" moert_result moert_fp8_block_gemm_run(moert_fp8_block_ctx *ctx, cudaStream_t stream,
                                                 const moert_fp8_block_gemm *gm)
{
    const moert_host *host = ctx->host;
    const int tile_n = tile_n_for(ctx, gm);
    kernel_fn kernel = kernel_for(gm->a_format, gm->b_format, gm->b_per_row != 0, tile_n == WIDE_N);
    if (!kernel || gm->matrix_count < 1 || gm->group_count < 0 || !gm->matrices || (gm->group_count && !gm->groups))
        return report(host, MOERT_ERR_INVALID_ARGUMENT,
                      "fp8 block gemm: formats %d x %d (two E5M2 operands are not supported), %d matrices, %d groups",
                      gm->a_format, gm->b_format, gm->matrix_count, gm->group_count);
    /* maps: at most two per matrix (as A, as B) and one per group, then the groups */
    const size_t max_maps = 2 * (size_t)gm->matrix_count + (size_t)gm->group_count;
    const size_t maps_bytes = max_maps * sizeof(CUtensorMap);
    const size_t bytes = maps_bytes + (size_t)gm->group_count * sizeof(group_dev);
    MOK(slots_reserve(ctx, bytes));
    if (ctx->map_of_count < 2 * gm->matrix_count) {
        int *grown = (int *)realloc(ctx->map_of, (size_t)gm->matrix_count * 2 * sizeof(int));
        if (!grown) return report(host, MOERT_ERR_OUT_OF_MEMORY, "fp8 block gemm: out of host memory");
        ctx->map_of = grown;
        ctx->map_of_count = 2 * gm->matrix_count;
    }
    for (int i = 0; i < 2 * gm->matrix_count; i++) ctx->map_of[i] = -1;
    const unsigned slot = ctx->next % SLOTS;
    if (ctx->used[slot]) CUDA_CHECK(host, cudaEventSynchronize(ctx->done[slot]));
    CUtensorMap *maps = (CUtensorMap *)ctx->pinned[slot];
    group_dev *groups = (group_dev *)((char *)ctx->pinned[slot] + maps_bytes);
    const int cluster = ctx->cluster;
    const int pair_rows = ctx->pair_rows && cluster == 2 && tile_n == WIDE_N;
    int count = 0, map_count = 0;
    int64_t units = 0;
    for (int i = 0; i < gm->group_count; i++) {
        const moert_fp8_block_group *g = &gm->groups[i];
        if (g->m <= 0 || g->n <= 0 || g->k <= 0) continue;
        group_dev *gd = &groups[count];
        MOK(group_fill(host, gm, i, tile_n, gd));
        MOK(matrix_map(ctx, gm, g->a_matrix, 0, maps, &map_count, &gd->a_map));
        MOK(matrix_map(ctx, gm, g->b_matrix, 1, maps, &map_count, &gd->b_map));
        if (ctx->staged && encode_d_map(ctx, g, gm->d_bf16 != 0, &maps[map_count])) gd->d_map = map_count++;
        gd->tile_start = (int32_t)units;
        if (pair_rows)
            units += (int64_t)(gd->m_tiles / 2) * gd->n_tiles + (gd->m_tiles % 2 ? ceil_div64(gd->n_tiles, 2) : 0);
        else
            units += (int64_t)gd->m_tiles * ceil_div64(gd->n_tiles, cluster);
        count++;
    }
    if (count == 0) return MOERT_OK;
    if (units > INT32_MAX)
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "fp8 block gemm: %lld work units (at most %d)",
                      (long long)units, INT32_MAX);
    /* the groups follow the maps actually encoded */
    group_dev *packed = (group_dev *)((char *)ctx->pinned[slot] + (size_t)map_count * sizeof(CUtensorMap));
    memmove(packed, groups, (size_t)count * sizeof(group_dev));
    const size_t used = (size_t)map_count * sizeof(CUtensorMap) + (size_t)count * sizeof(group_dev);
    CUDA_CHECK(host, cudaMemcpyAsync(ctx->table[slot], ctx->pinned[slot], used, cudaMemcpyHostToDevice, stream));
    kernel_args args;
    args.maps = (const CUtensorMap *)ctx->table[slot];
    args.groups = (const group_dev *)((char *)ctx->table[slot] + (size_t)map_count * sizeof(CUtensorMap));
    args.group_count = count;
    args.units = (int)units;
    args.cluster = cluster;
    args.d_bf16 = gm->d_bf16 != 0;
    args.accumulate = gm->accumulate != 0;
    args.tile_n = tile_n;
    args.pair_rows = pair_rows;
    args.work_counter = gm->sm_yield ? gm->work_counter : NULL;
    args.sm_yield = args.work_counter ? gm->sm_yield : NULL;
    ring_for(ctx, args.d_bf16, tile_n, &args.stages, &args.out_sets);
    args.pairs = ctx->pairs;
    const int64_t resident = cluster > 1 ? ctx->max_clusters : ctx->max_ctas;
    const int64_t grid = (units < resident ? units : resident) * cluster;
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr = {};
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = (unsigned)cluster, attr.val.clusterDim.y = 1, attr.val.clusterDim.z = 1;
    cfg.gridDim = dim3((unsigned)grid);
    cfg.blockDim = dim3(THREADS);
    cfg.dynamicSmemBytes = smem_bytes(args.d_bf16, tile_n, args.stages, args.out_sets);
    cfg.stream = stream;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    CUDA_CHECK(host, cudaLaunchKernelEx(&cfg, kernel, args));
    CUDA_CHECK(host, cudaEventRecord(ctx->done[slot], stream));
    ctx->used[slot] = 1;
    ctx->next++;
    return MOERT_OK;
}
