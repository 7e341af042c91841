/* SPDX-License-Identifier: Apache-2.0 */
/*
 * bf16 grouped GEMM with the per-expert row counts read on the device (see device_gemm.h).
 *
 * Every GEMM here is C[M,N] = A[M,K] @ B[K,N] over 128 x BN output tiles (BN 128 or 256), K in steps of 64:
 *   FORWARD  M = expert rows, N = n_out, K = k_in:  A = input       [rows][k_in]  (K contiguous)
 *                                                   B = W[e]        [k_in][n_out] (N contiguous)
 *   DGRAD    M = expert rows, N = k_in, K = n_out:  A = grad_output [rows][n_out] (K contiguous)
 *                                                   B = W[e]^T      stored [k_in][n_out] (K contiguous)
 *   WGRAD    M = k_in, N = n_out, K = expert rows:  A = input^T     stored [rows][k_in] (M contiguous)
 *                                                   B = grad_output [rows][n_out] (N contiguous)
 * A block of 8 warps (2 x 4, each 64 x BN/4 of the tile) multiplies with mma.sync m16n8k16 (bf16 in, fp32
 * accumulators). Two tile shapes: 128 x 128 with a 3-stage pipeline and two blocks per SM (64 x 32 per warp), and
 * 128 x 256 with 4 stages and one block per SM (64 x 64 per warp: half the shared-memory reads per multiply); the
 * wider one is used where a FORWARD/DGRAD output has at least 1024 columns, the narrower for WGRAD (its main loop covers
 * one expert's rows only, so two blocks per SM overlap one's prologue/epilogue with the other's multiplies);
 * bf16_device_gemm_args.tile_n overrides.
 * Operand tiles go global -> shared through a cp.async pipeline (16-byte chunks; chunks past the matrix or
 * the expert's rows are zero-filled with src-size 0) and shared -> registers with ldmatrix (.trans where the stored
 * layout is the transpose of the fragment's). Shared tiles are stored row by row with the 16-byte chunk index XORed
 * with (row & 7), so the eight rows one ldmatrix phase reads hit eight different bank groups.
 *
 * Scheduling (nothing read on the host): warp 0 of every block reads the counts and writes, in shared memory, each
 * expert's first row (clamped to the capacity) and, for FORWARD/DGRAD, its first row tile. FORWARD/DGRAD: the grid is
 * (capacity/128 + E) row tiles x N/BN tiles, the N tile varying fastest (the blocks of one row tile, which share its A
 * rows, run together; the few row tiles of an expert that run together read each W[e] column panel once); a block
 * finds its expert by binary search and blocks past the last row tile exit. WGRAD: E x (k_in/128) x (n_out/BN)
 * blocks, expert-major (an expert's rows stay in L2 while its tiles run), each reducing over its expert's rows.
 */
#include "device_gemm.h"

#include <cuda_bf16.h>
#include <limits.h>
#include <stdint.h>

#include "plugin_cuda_check.h"
#include "device_gemm_wgmma.h"
#include "expert_prefix.cuh"

#define BM           128  /* tile rows (M) */
#define BK           64   /* reduction step (K) */
#define THREADS      256  /* 8 warps */
#define A_TILE_ELEMS 8192 /* bf16 elements of the A tile: 128 x 64 */

enum { PASS_FORWARD = 0, PASS_DGRAD = 1, PASS_WGRAD = 2 };

/* What one launch needs (by value). */
typedef struct gemm_params {
    const __nv_bfloat16 *a; /* FORWARD: input; DGRAD: grad_output; WGRAD: input */
    const __nv_bfloat16 *b; /* FORWARD, DGRAD: weight; WGRAD: grad_output */
    void *c;                /* output, grad_input or grad_weight */
    const int64_t *counts;
    int64_t capacity;
    int64_t k_in, n_out;
    int num_experts;
    int tiles_m;    /* WGRAD: k_in tiles */
    int tiles_n;    /* N tiles (of BN columns) */
    int accumulate; /* WGRAD */
} gemm_params;

/* The pipeline depth of a tile width: 3 stages of 32 KiB (two blocks per SM) or 4 of 48 KiB (one block). */
#define STAGES_OF(bn) ((bn) == 128 ? 3 : 4)

/* Bytes of dynamic shared memory of one launch with E experts: the pipeline, then the prefix arrays. */
static size_t smem_bytes(int bn, int experts)
{
    return (size_t)STAGES_OF(bn) * (A_TILE_ELEMS + BK * bn) * sizeof(__nv_bfloat16) +
           (size_t)(experts + 1) * (sizeof(int64_t) + sizeof(int));
}

/* ---- PTX wrappers ---- */

__device__ __forceinline__ uint32_t smem_addr(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

/* 16-byte global -> shared copy; src_bytes 0 writes zeros and reads nothing. */
__device__ __forceinline__ void cp_async16(uint32_t dst, const void *src, int src_bytes)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t *r, uint32_t addr)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t *r, uint32_t addr)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

/* d += a @ b for one m16n8k16 bf16 fragment, fp32 accumulators. */
__device__ __forceinline__ void mma_bf16(float *d, const uint32_t *a, const uint32_t *b)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

/* ---- shared-memory tiles ---- */

/* Element offset of (row, 16-byte chunk) in a tile of CPR chunks per row (CPR 8 or 16), chunk swizzled by row. */
template <int CPR> __device__ __forceinline__ int tile_offset(int row, int chunk)
{
    return row * (CPR * 8) + ((chunk ^ (row & 7)) << 3);
}

/*
 * Issues the cp.async copies of one operand tile (ROWS x CPR chunks, ROWS * CPR / 256 per thread): tile (row, chunk)
 * comes from g + row * ld + chunk * 8 when row < rows_valid and chunk * 8 < cols_valid, else zeros (safe: any
 * readable address, read 0 bytes from).
 */
template <int ROWS, int CPR>
__device__ __forceinline__ void load_tile(__nv_bfloat16 *s, const __nv_bfloat16 *g, int64_t ld, int64_t rows_valid,
                                          int64_t cols_valid, const __nv_bfloat16 *safe, int tid)
{
    const int rv = (int)min(rows_valid, (int64_t)ROWS); /* 32-bit compares below */
    const int cv = (int)min(cols_valid, (int64_t)(CPR * 8));
#pragma unroll
    for (int j = 0; j < ROWS * CPR / THREADS; j++) {
        const int i = tid + j * THREADS;
        const int row = i / CPR, chunk = i % CPR;
        const bool ok = row < rv && chunk * 8 < cv;
        const __nv_bfloat16 *src = ok ? g + (int64_t)row * ld + chunk * 8 : safe;
        cp_async16(smem_addr(s + tile_offset<CPR>(row, chunk)), src, ok ? 16 : 0);
    }
}

/* ---- the kernel ---- */

template <int PASS, bool OUT_F32, int BN>
__global__ void __launch_bounds__(THREADS, BN == 128 ? 2 : 1) grouped_gemm_kernel(const gemm_params p)
{
    constexpr int STAGES = STAGES_OF(BN);
    constexpr int B_TILE_ELEMS = BK * BN;
    constexpr int NI = BN / 32; /* 8-column fragments per warp (the warp's BN/4 columns) */
    extern __shared__ __align__(128) unsigned char smem[];
    __nv_bfloat16 *sa = (__nv_bfloat16 *)smem;
    __nv_bfloat16 *sb = sa + STAGES * A_TILE_ELEMS;
    int64_t *row_start = (int64_t *)(sb + STAGES * B_TILE_ELEMS);
    int *tile_start = (int *)(row_start + p.num_experts + 1);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int E = p.num_experts;

    if (warp == 0) expert_prefix(p.counts, p.num_experts, p.capacity, BM, row_start, tile_start);
    __syncthreads();

    /* This block's tile: expert e, rows [r0, r0 + rows_valid) of the activations (FORWARD/DGRAD) or reduction rows
     * [r0, r0 + red) (WGRAD), output columns from n0 (and WGRAD output rows from m0). */
    int e;
    int64_t r0, rows_valid = 0, m0 = 0, red;
    const int n_tile = (int)(blockIdx.x % (unsigned)p.tiles_n);
    const int64_t n0 = (int64_t)n_tile * BN;
    if (PASS == PASS_WGRAD) {
        const int per_expert = p.tiles_m * p.tiles_n;
        e = (int)(blockIdx.x / (unsigned)per_expert);
        m0 = (int64_t)((int)(blockIdx.x % (unsigned)per_expert) / p.tiles_n) * BM;
        r0 = row_start[e];
        red = row_start[e + 1] - r0;
        if (red == 0 && p.accumulate) return; /* adds nothing */
    } else {
        const int mt = (int)(blockIdx.x / (unsigned)p.tiles_n);
        if (mt >= tile_start[E]) return; /* past the last row tile: the grid is sized for the worst case */
        int lo = 0, hi = E - 1;          /* the last expert whose first tile is <= mt (it has tiles) */
        while (lo < hi) {
            const int mid = (lo + hi + 1) >> 1;
            if (tile_start[mid] <= mt)
                lo = mid;
            else
                hi = mid - 1;
        }
        e = lo;
        r0 = row_start[e] + (int64_t)(mt - tile_start[e]) * BM;
        rows_valid = row_start[e + 1] - r0;
        red = PASS == PASS_FORWARD ? p.k_in : p.n_out;
    }
    const int64_t K = p.k_in, N = p.n_out;
    const int64_t wslice = (int64_t)e * K * N; /* expert e's weight (or grad_weight) */

    /* Issues the copies of reduction step kt into stage st. */
    auto load_stage = [&](int st, int kt) {
        const int64_t k0 = (int64_t)kt * BK;
        __nv_bfloat16 *ta = sa + st * A_TILE_ELEMS, *tb = sb + st * B_TILE_ELEMS;
        if (PASS == PASS_FORWARD) {
            load_tile<BM, 8>(ta, p.a + r0 * K + k0, K, rows_valid, K - k0, p.a, tid);           /* [m][k] */
            load_tile<BK, BN / 8>(tb, p.b + wslice + k0 * N + n0, N, K - k0, N - n0, p.b, tid); /* [k][n] */
        } else if (PASS == PASS_DGRAD) {
            load_tile<BM, 8>(ta, p.a + r0 * N + k0, N, rows_valid, N - k0, p.a, tid);      /* [m][k] */
            load_tile<BN, 8>(tb, p.b + wslice + n0 * N + k0, N, K - n0, N - k0, p.b, tid); /* [n][k] */
        } else {
            load_tile<BK, BM / 8>(ta, p.a + (r0 + k0) * K + m0, K, red - k0, K - m0, p.a, tid); /* [k][m] */
            load_tile<BK, BN / 8>(tb, p.b + (r0 + k0) * N + n0, N, red - k0, N - n0, p.b, tid); /* [k][n] */
        }
    };

    float acc[4][NI][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < NI; j++)
#pragma unroll
            for (int k = 0; k < 4; k++) acc[i][j][k] = 0.0f;

    const int wm = (warp >> 2) * 64, wn = (warp & 3) * (BN / 4);
    const int ktiles = (int)((red + BK - 1) / BK);
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < ktiles) load_stage(s, s);
        cp_async_commit();
    }
    for (int kt = 0; kt < ktiles; kt++) {
        cp_async_wait<STAGES - 2>();
        __syncthreads(); /* step kt landed for every thread; step kt - 1's stage is free */
        if (kt + STAGES - 1 < ktiles) load_stage((kt + STAGES - 1) % STAGES, kt + STAGES - 1);
        cp_async_commit();
        const __nv_bfloat16 *ta = sa + (kt % STAGES) * A_TILE_ELEMS, *tb = sb + (kt % STAGES) * B_TILE_ELEMS;
#pragma unroll
        for (int kk = 0; kk < BK / 16; kk++) {
            uint32_t af[4][4], bfr[NI][2];
#pragma unroll
            for (int mi = 0; mi < 4; mi++) {
                const int mb = wm + mi * 16;
                if (PASS == PASS_WGRAD) { /* stored [k][m]: transpose */
                    const int row = kk * 16 + (lane & 7) + ((lane >> 4) << 3);
                    const int chunk = (mb >> 3) + ((lane >> 3) & 1);
                    ldmatrix_x4_trans(af[mi], smem_addr(ta + tile_offset<16>(row, chunk)));
                } else { /* stored [m][k] */
                    const int row = mb + (lane & 15);
                    const int chunk = kk * 2 + (lane >> 4);
                    ldmatrix_x4(af[mi], smem_addr(ta + tile_offset<8>(row, chunk)));
                }
            }
#pragma unroll
            for (int pr = 0; pr < NI / 2; pr++) {
                const int nb = wn + pr * 16;
                uint32_t r[4];
                if (PASS == PASS_DGRAD) { /* stored [n][k] */
                    const int row = nb + (lane & 7) + ((lane >> 4) << 3);
                    const int chunk = kk * 2 + ((lane >> 3) & 1);
                    ldmatrix_x4(r, smem_addr(tb + tile_offset<8>(row, chunk)));
                } else { /* stored [k][n]: transpose */
                    const int row = kk * 16 + (lane & 15);
                    const int chunk = (nb >> 3) + (lane >> 4);
                    ldmatrix_x4_trans(r, smem_addr(tb + tile_offset<BN / 8>(row, chunk)));
                }
                bfr[2 * pr][0] = r[0];
                bfr[2 * pr][1] = r[1];
                bfr[2 * pr + 1][0] = r[2];
                bfr[2 * pr + 1][1] = r[3];
            }
#pragma unroll
            for (int mi = 0; mi < 4; mi++)
#pragma unroll
                for (int ni = 0; ni < NI; ni++) mma_bf16(acc[mi][ni], af[mi], bfr[ni]);
        }
    }
    cp_async_wait<0>();

    /* Epilogue: thread (g, t) of the warp holds rows g and g + 8, columns 2t and 2t + 1 of every 16 x 8 fragment. */
    const int g = lane >> 2, t = lane & 3;
    if (PASS == PASS_WGRAD) {
        /* Accumulating: every old value is loaded (and added) before the first store. Interleaved load-add-store
         * would serialise: the compiler cannot prove the stores miss the later loads, so each of the 64 loads of a
         * thread would wait for a DRAM round trip in turn (that made WGRAD 8x slower than FORWARD). */
        if (p.accumulate) {
#pragma unroll
            for (int mi = 0; mi < 4; mi++)
#pragma unroll
                for (int half = 0; half < 2; half++) {
                    const int64_t m = m0 + wm + mi * 16 + g + half * 8;
                    if (m >= K) continue;
#pragma unroll
                    for (int ni = 0; ni < NI; ni++) {
                        const int64_t n = n0 + wn + ni * 8 + 2 * t;
                        if (n >= N) continue;
                        const int64_t at = wslice + m * N + n;
                        float2 old;
                        if (OUT_F32)
                            old = __ldcs((const float2 *)((const float *)p.c + at));
                        else
                            old = __bfloat1622float2(*(const __nv_bfloat162 *)((const __nv_bfloat16 *)p.c + at));
                        acc[mi][ni][2 * half] += old.x;
                        acc[mi][ni][2 * half + 1] += old.y;
                    }
                }
        }
#pragma unroll
        for (int mi = 0; mi < 4; mi++)
#pragma unroll
            for (int half = 0; half < 2; half++) {
                const int64_t m = m0 + wm + mi * 16 + g + half * 8;
                if (m >= K) continue;
#pragma unroll
                for (int ni = 0; ni < NI; ni++) {
                    const int64_t n = n0 + wn + ni * 8 + 2 * t;
                    if (n >= N) continue;
                    const int64_t at = wslice + m * N + n;
                    const float v0 = acc[mi][ni][2 * half], v1 = acc[mi][ni][2 * half + 1];
                    if (OUT_F32)
                        __stcs((float2 *)((float *)p.c + at), make_float2(v0, v1));
                    else
                        *(__nv_bfloat162 *)((__nv_bfloat16 *)p.c + at) = __floats2bfloat162_rn(v0, v1);
                }
            }
    } else {
        const int64_t ldc = PASS == PASS_FORWARD ? N : K; /* output columns */
#pragma unroll
        for (int mi = 0; mi < 4; mi++)
#pragma unroll
            for (int half = 0; half < 2; half++) {
                const int row = wm + mi * 16 + g + half * 8;
                if (row >= rows_valid) continue;
#pragma unroll
                for (int ni = 0; ni < NI; ni++) {
                    const int64_t n = n0 + wn + ni * 8 + 2 * t;
                    if (n >= ldc) continue;
                    __nv_bfloat162 *dst = (__nv_bfloat162 *)((__nv_bfloat16 *)p.c + (r0 + row) * ldc + n);
                    *dst = __floats2bfloat162_rn(acc[mi][ni][2 * half], acc[mi][ni][2 * half + 1]);
                }
            }
    }
}

/* ---- host side ---- */

static const char *pass_text(moert_gemm_pass p)
{
    return p == MOERT_GEMM_FORWARD ? "FORWARD" : p == MOERT_GEMM_DGRAD ? "DGRAD" : "WGRAD";
}

/* Raises the dynamic shared-memory limit of the kernels of one tile width to what BF16_DEVICE_GEMM_MAX_EXPERTS needs. */
template <int BN> static moert_result prepare_width(const moert_host *host)
{
    const int bytes = (int)smem_bytes(BN, BF16_DEVICE_GEMM_MAX_EXPERTS);
    CUDA_CHECK(host, cudaFuncSetAttribute(grouped_gemm_kernel<PASS_FORWARD, false, BN>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    CUDA_CHECK(host, cudaFuncSetAttribute(grouped_gemm_kernel<PASS_DGRAD, false, BN>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    CUDA_CHECK(host, cudaFuncSetAttribute(grouped_gemm_kernel<PASS_WGRAD, true, BN>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    CUDA_CHECK(host, cudaFuncSetAttribute(grouped_gemm_kernel<PASS_WGRAD, false, BN>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    return MOERT_OK;
}

extern "C" moert_result bf16_device_gemm_prepare(const moert_host *host)
{
    MOK(prepare_width<128>(host));
    MOK(prepare_width<256>(host));
    return bf16_wgmma_prepare(host);
}

/* Launches the kernel of a pass and tile width. */
template <int BN>
static void launch(const bf16_device_gemm_args *a, const gemm_params &p, unsigned blocks, cudaStream_t stream)
{
    const size_t smem = smem_bytes(BN, p.num_experts);
    switch (a->pass) {
    case MOERT_GEMM_FORWARD: grouped_gemm_kernel<PASS_FORWARD, false, BN><<<blocks, THREADS, smem, stream>>>(p); break;
    case MOERT_GEMM_DGRAD: grouped_gemm_kernel<PASS_DGRAD, false, BN><<<blocks, THREADS, smem, stream>>>(p); break;
    default:
        if (a->grad_weight_bf16)
            grouped_gemm_kernel<PASS_WGRAD, false, BN><<<blocks, THREADS, smem, stream>>>(p);
        else
            grouped_gemm_kernel<PASS_WGRAD, true, BN><<<blocks, THREADS, smem, stream>>>(p);
        break;
    }
}

/* Whether p is non-NULL and 16-byte aligned. */
static bool aligned16(const void *p) { return p && ((uintptr_t)p & 15u) == 0; }

extern "C" moert_result bf16_device_gemm(const moert_host *host, cudaStream_t stream, const bf16_device_gemm_args *a)
{
    if (!a) return report(host, MOERT_ERR_INVALID_ARGUMENT, "bf16 device gemm: args is NULL");
    if (a->pass != MOERT_GEMM_FORWARD && a->pass != MOERT_GEMM_DGRAD && a->pass != MOERT_GEMM_WGRAD)
        return report(host, MOERT_ERR_INVALID_ARGUMENT,
                      "bf16 device gemm: pass is %d, expected FORWARD (0), DGRAD (1) "
                      "or WGRAD (2)",
                      (int)a->pass);
    const char *pass = pass_text(a->pass);
    if (a->num_experts < 1 || a->num_experts > BF16_DEVICE_GEMM_MAX_EXPERTS)
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "bf16 device gemm %s: %lld local experts, expected 1 to %d",
                      pass, (long long)a->num_experts, BF16_DEVICE_GEMM_MAX_EXPERTS);
    if (!a->counts_device)
        return report(host, MOERT_ERR_INVALID_ARGUMENT,
                      "bf16 device gemm %s: counts_device is NULL (int64 [%lld] on "
                      "the device expected)",
                      pass, (long long)a->num_experts);
    if (a->k_in <= 0 || a->n_out <= 0 || a->k_in % 8 || a->n_out % 8)
        return report(host, MOERT_ERR_INVALID_ARGUMENT,
                      "bf16 device gemm %s: k_in %lld and n_out %lld must be positive "
                      "multiples of 8 (16-byte rows)",
                      pass, (long long)a->k_in, (long long)a->n_out);
    if (a->capacity < 0)
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "bf16 device gemm %s: capacity %lld rows, expected >= 0", pass,
                      (long long)a->capacity);
    if (a->tile_n != 0 && a->tile_n != 128 && a->tile_n != 256)
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "bf16 device gemm %s: tile_n %d, expected 0 (auto), 128 or 256",
                      pass, a->tile_n);
    if (a->engine < BF16_DEVICE_GEMM_ENGINE_AUTO || a->engine > BF16_DEVICE_GEMM_ENGINE_WGMMA)
        return report(host, MOERT_ERR_INVALID_ARGUMENT,
                      "bf16 device gemm %s: engine %d, expected 0 (auto), 1 (mma.sync) "
                      "or 2 (wgmma)",
                      pass, a->engine);
    if (a->wgrad_schedule < BF16_WGMMA_WGRAD_AUTO || a->wgrad_schedule > BF16_WGMMA_WGRAD_COOPERATIVE)
        return report(host, MOERT_ERR_INVALID_ARGUMENT,
                      "bf16 device gemm %s: wgrad_schedule %d, expected 0 (auto), 1 (ping-pong) or 2 (cooperative)",
                      pass, a->wgrad_schedule);
    if (a->sm_yield && !a->work_counter)
        return report(host, MOERT_ERR_INVALID_ARGUMENT,
                      "bf16 device gemm %s: sm_yield needs work_counter (two device int32, zero, for the stream)",
                      pass);
    const void *ops[2], *dst;
    const char *names[3];
    switch (a->pass) {
    case MOERT_GEMM_FORWARD:
        ops[0] = a->input, ops[1] = a->weight, dst = a->output;
        names[0] = "input", names[1] = "weight", names[2] = "output";
        break;
    case MOERT_GEMM_DGRAD:
        ops[0] = a->grad_output, ops[1] = a->weight, dst = a->grad_input;
        names[0] = "grad_output", names[1] = "weight", names[2] = "grad_input";
        break;
    default:
        ops[0] = a->input, ops[1] = a->grad_output, dst = a->grad_weight;
        names[0] = "input", names[1] = "grad_output", names[2] = "grad_weight";
        break;
    }
    const void *ptrs[3] = {ops[0], ops[1], dst};
    for (int i = 0; i < 3; i++)
        if (!aligned16(ptrs[i]))
            return report(host, MOERT_ERR_INVALID_ARGUMENT,
                          "bf16 device gemm %s: %s is %s, expected a 16-byte aligned "
                          "device pointer",
                          pass, names[i], ptrs[i] ? "misaligned" : "NULL");

    const bool wgmma_pass = a->pass != MOERT_GEMM_WGRAD || !a->grad_weight_bf16; /* WGRAD: into fp32 only */
    if (wgmma_pass && a->engine != BF16_DEVICE_GEMM_ENGINE_MMA &&
        (a->engine == BF16_DEVICE_GEMM_ENGINE_WGMMA || bf16_wgmma_available())) {
        if (a->pass == MOERT_GEMM_WGRAD) return bf16_wgmma_gemm(host, stream, a);
        if (a->capacity == 0) return MOERT_OK; /* no rows at all */
        if (((a->capacity + BM - 1) / BM + a->num_experts) *
                ((a->pass == MOERT_GEMM_DGRAD ? a->k_in : a->n_out) + 255) / 256 >
            INT_MAX)
            return report(host, MOERT_ERR_INVALID_ARGUMENT,
                          "bf16 device gemm %s: capacity %lld, k_in %lld, n_out %lld "
                          "make more than 2^31 tiles",
                          pass, (long long)a->capacity, (long long)a->k_in, (long long)a->n_out);
        return bf16_wgmma_gemm(host, stream, a);
    }

    gemm_params p;
    p.a = (const __nv_bfloat16 *)ops[0];
    p.b = (const __nv_bfloat16 *)ops[1];
    p.c = (void *)dst;
    p.counts = a->counts_device;
    p.capacity = a->capacity;
    p.k_in = a->k_in;
    p.n_out = a->n_out;
    p.num_experts = (int)a->num_experts;
    p.accumulate = a->accumulate != 0;
    const int64_t out_cols = a->pass == MOERT_GEMM_DGRAD ? a->k_in : a->n_out;
    /* WGRAD reduces over one expert's rows only (a few hundred: a short main loop) and writes a large fp32 gradient:
     * the 128-wide tile with two blocks per SM lets one block's prologue and epilogue overlap the other's multiplies. */
    const int bn = a->tile_n ? a->tile_n : a->pass != MOERT_GEMM_WGRAD && out_cols >= 1024 ? 256 : 128;
    const int64_t tiles_n = (out_cols + bn - 1) / bn, tiles_m = (a->k_in + BM - 1) / BM;
    int64_t blocks;
    if (a->pass == MOERT_GEMM_WGRAD) {
        blocks = a->num_experts * tiles_m * tiles_n;
    } else {
        if (a->capacity == 0) return MOERT_OK; /* no rows at all */
        blocks = ((a->capacity + BM - 1) / BM + a->num_experts) * tiles_n;
    }
    if (blocks > INT_MAX || tiles_m * tiles_n > INT_MAX)
        return report(host, MOERT_ERR_INVALID_ARGUMENT,
                      "bf16 device gemm %s: %lld blocks (capacity %lld, k_in %lld, "
                      "n_out %lld, %lld experts) exceed the grid limit",
                      pass, (long long)blocks, (long long)a->capacity, (long long)a->k_in, (long long)a->n_out,
                      (long long)a->num_experts);
    p.tiles_m = (int)tiles_m;
    p.tiles_n = (int)tiles_n;
    if (bn == 128)
        launch<128>(a, p, (unsigned)blocks, stream);
    else
        launch<256>(a, p, (unsigned)blocks, stream);
    LAUNCH_CHECK(host, "grouped_gemm_kernel");
    return MOERT_OK;
}
