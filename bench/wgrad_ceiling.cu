/* SPDX-License-Identifier: Apache-2.0 */
/* What a WGRAD kernel into fp32 can reach when its operands cost nothing: two consumer warpgroups on every SM, each
 * owning whole tiles of an [E][k_in][n_out] fp32 gradient, multiplying operands that sit in shared memory from the
 * start (no loads in the loop) and storing each tile from its registers. Schedules: 128 x 128 tiles (two wgmma
 * m64n128k16 a k16 step) or 64 x 256 (one m64n256k16), the consumers taking turns at the tensor cores (named barriers
 * hand them over, as the ping-pong in device_gemm_wgmma.cu does; with 1, 3 or all of a tile's wgmma groups in flight)
 * or running side by side. Modes: the MMA alone, the
 * stores alone, both. Beside them a cudaMemset of the gradient (its write rate). If "both" is near the larger of the
 * two alone, the stores hide behind the MMA; the MMA alone against a dense GEMM's rate is the schedule's ceiling.
 * Hopper (sm_90a) only.
 *
 *   wgrad_ceiling [out.json]   environment: MOERT_BENCH_MACHINE, MOERT_BENCH_GIT, MOERT_BENCH_ROWS (rows an expert,
 *                              512; gemm_bench's "dense" beside it gives the rate the MMA is held against)
 */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_cuda_check.h"
#include "mbarrier.cuh"
#include "wgmma.cuh"

enum { MODE_MMA = 1, MODE_STORE = 2 };
#define WC_SMEM (6 * 8192) /* A's two boxes and B's four */

typedef struct wc_params {
    float *dw;
    int num_experts, m_tiles, n_tiles, k_blocks, n_out, mode;
} wc_params;

/* Consumer c's tiles (the CTA's 0, 2, .. or 1, 3, ..): per tile, k_blocks of MMA on the resident operands, then the
 * fp32 result stored from the registers (two floats a thread per row and 8 columns). N: the tile's n_out columns (128:
 * 128 k_in rows, two m64n128 accumulators; 256: 64 rows, one m64n256); TURN: the consumers take turns at the MMA;
 * DEPTH: the groups kept in flight behind the last committed (0: all of the tile's). */
template <int N, bool TURN, int DEPTH>
__device__ void wc_consume(const wc_params &p, const uint8_t *a, const uint8_t *b, int c)
{
    constexpr int BM = N == 128 ? 128 : 64;
    const int units = p.num_experts * p.m_tiles * p.n_tiles;
    const int tid = threadIdx.x % 128, r = tid / 32 * 16 + tid % 32 / 4, col0 = 2 * (tid % 4);
    float acc[128];
    for (int i = 0; i < 128; i++) acc[i] = 0.0f;
    int i = 0;
    for (int u = blockIdx.x; u < units; u += gridDim.x, i++) {
        if ((i & 1) != c) continue;
        const bool hand_off = TURN && u + (int)gridDim.x < units;
        if (TURN && i > 0) named_barrier_sync(3 + c, 256);
        if (p.mode & MODE_MMA) {
            wgmma_fence();
            for (int kb = 0; kb < p.k_blocks; kb++) {
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    const uint64_t db = wgmma_desc_mn_sw128(b + k * 2048, 8192);
                    if (N == 128) {
#pragma unroll
                        for (int h = 0; h < 2; h++)
                            wgmma_m64n128k16_mn(acc + 64 * h, wgmma_desc_mn_sw128(a + h * 8192 + k * 2048, 8192), db,
                                                (kb | k) != 0);
                    } else {
                        wgmma_m64n256k16<1, 1>(acc, wgmma_desc_mn_sw128(a + k * 2048, 8192), db, (kb | k) != 0);
                    }
                }
                wgmma_commit();
                if (DEPTH == 1) wgmma_wait<1>();
                if (DEPTH == 3) wgmma_wait<3>();
            }
        }
        if (hand_off) named_barrier_arrive(4 - c, 256);
        if (p.mode & MODE_MMA) wgmma_wait<0>();
        if (!(p.mode & MODE_STORE)) continue;
        const int per_e = p.m_tiles * p.n_tiles, e = u / per_e, mt = u % per_e % p.m_tiles, nt = u % per_e / p.m_tiles;
        const int64_t k_in = (int64_t)p.m_tiles * BM;
#pragma unroll
        for (int h = 0; h < BM / 64; h++)
#pragma unroll
            for (int q = 0; q < 2; q++) {
                float *row = p.dw + ((int64_t)e * k_in + mt * BM + 64 * h + r + 8 * q) * p.n_out + nt * N;
                const float *hv = N == 128 ? acc + 64 * h : acc;
#pragma unroll
                for (int j = 0; j < N / 8; j++)
                    asm volatile("st.global.v2.f32 [%0], {%1, %2};" ::"l"(row + col0 + 8 * j), "f"(hv[4 * j + 2 * q]),
                                 "f"(hv[4 * j + 2 * q + 1])
                                 : "memory");
            }
    }
}

template <int N, bool TURN, int DEPTH>
__global__ void __launch_bounds__(384, 1) wc_kernel(const __grid_constant__ wc_params p)
{
#ifdef WGMMA_DEVICE
    extern __shared__ uint8_t smem_raw[];
    uint8_t *smem = (uint8_t *)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
    /* A (two 64-column boxes) and B (up to four), 64 rows each: small bf16 values, their content immaterial */
    for (int i = threadIdx.x; i < WC_SMEM / 4; i += blockDim.x) ((uint32_t *)smem)[i] = 0x3c003c00u;
    fence_async_shared();
    __syncthreads();
    const int wg = threadIdx.x / 128;
    if (wg == 0) {
        warpgroup_registers_dec<40>();
    } else {
        warpgroup_registers_inc<232>();
        wc_consume<N, TURN, DEPTH>(p, smem, smem + 2 * 8192, wg - 1);
    }
#endif
}

static int cmp_float(const void *x, const void *y)
{
    const float a = *(const float *)x, b = *(const float *)y;
    return (a > b) - (a < b);
}

/* The schedules: the tile, whether the consumers take turns, and the wgmma groups a consumer keeps in flight behind
 * the one it has just committed (1, as device_gemm_wgmma.cu's consumers, which then hand that stage back; 3; or all of
 * a tile's, 0, waiting only at its end). */
#define WC_SCHEDULES 6
static const struct {
    const char *name;
    int wide;
    void (*kernel)(wc_params);
} wc_schedules[WC_SCHEDULES] = {
    {"128x128 turns", 0, wc_kernel<128, true, 1>},    {"128x128 turns w3", 0, wc_kernel<128, true, 3>},
    {"128x128 turns w*", 0, wc_kernel<128, true, 0>}, {"64x256 turns", 1, wc_kernel<256, true, 1>},
    {"128x128 side", 0, wc_kernel<128, false, 1>},    {"64x256 side", 1, wc_kernel<256, false, 1>}};

/* Median ms of `reps` runs of mode (0: cudaMemset of the gradient) after two warm-up runs. */
static float median_ms(const wc_params *p, int sched, int mode, size_t bytes, int sms, int reps)
{
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    float t[32];
    wc_params q = *p;
    q.mode = mode;
    for (int i = -2; i < reps; i++) {
        CK(cudaEventRecord(e0, 0));
        if (mode == 0)
            CK(cudaMemsetAsync(p->dw, 0, bytes, 0));
        else
            wc_schedules[sched].kernel<<<sms, 384, 1024 + WC_SMEM>>>(q);
        CK(cudaGetLastError());
        CK(cudaEventRecord(e1, 0));
        CK(cudaEventSynchronize(e1));
        if (i >= 0) CK(cudaEventElapsedTime(&t[i], e0, e1));
    }
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    qsort(t, (size_t)reps, sizeof t[0], cmp_float);
    return t[reps / 2];
}

int main(int argc, char **argv)
{
    struct cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    if (prop.major != 9) {
        fprintf(stderr, "wgrad_ceiling: needs a compute capability 9.0 GPU (found %d.%d)\n", prop.major, prop.minor);
        return 77;
    }
    const int rows = getenv("MOERT_BENCH_ROWS") ? atoi(getenv("MOERT_BENCH_ROWS")) : 512;
    if (rows < 64 || rows % 64) {
        fprintf(stderr, "wgrad_ceiling: MOERT_BENCH_ROWS %d, expected a positive multiple of 64\n", rows);
        return 2;
    }
    for (int k = 0; k < WC_SCHEDULES; k++)
        CK(cudaFuncSetAttribute(wc_schedules[k].kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 1024 + WC_SMEM));
    /* the deepseek-v3 and qwen3-30b-a3b WGRAD shapes of one EP4 rank */
    static const struct {
        const char *name;
        int experts, k_in, n_out;
    } shapes[] = {{"deepseek-v3 fc1", 64, 7168, 4096},
                  {"deepseek-v3 fc2", 64, 2048, 7168},
                  {"qwen3-30b-a3b fc1", 32, 2048, 1536},
                  {"qwen3-30b-a3b fc2", 32, 768, 2048}};
    const char *machine = getenv("MOERT_BENCH_MACHINE"), *git = getenv("MOERT_BENCH_GIT");
    FILE *out = argc > 1 ? fopen(argv[1], "w") : NULL;
    if (argc > 1 && !out) {
        fprintf(stderr, "wgrad_ceiling: cannot write %s\n", argv[1]);
        return 1;
    }
    if (out)
        fprintf(out,
                "{\"machine\": \"%s\", \"git\": \"%s\", \"device\": \"%s\", \"rows_per_expert\": %d, \"results\": [",
                machine ? machine : "", git ? git : "", prop.name, rows);
    printf("%s, %d SMs, %d rows an expert\n%-18s %-16s %9s %9s %9s %9s %8s\n", prop.name, prop.multiProcessorCount,
           rows, "shape", "schedule", "mma ms", "store ms", "both ms", "memset ms", "overlap");
    int first = 1;
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        const size_t bytes = (size_t)shapes[s].experts * shapes[s].k_in * shapes[s].n_out * sizeof(float);
        float *dw = NULL;
        CK(cudaMalloc((void **)&dw, bytes));
        for (int sched = 0; sched < WC_SCHEDULES; sched++) {
            const int wide = wc_schedules[sched].wide;
            wc_params p;
            memset(&p, 0, sizeof p);
            p.dw = dw;
            p.num_experts = shapes[s].experts;
            p.m_tiles = shapes[s].k_in / (wide ? 64 : 128);
            p.n_tiles = shapes[s].n_out / (wide ? 256 : 128);
            p.k_blocks = rows / 64;
            p.n_out = shapes[s].n_out;
            const int sms = prop.multiProcessorCount;
            const float mma = median_ms(&p, sched, MODE_MMA, bytes, sms, 10);
            const float store = median_ms(&p, sched, MODE_STORE, bytes, sms, 10);
            const float both = median_ms(&p, sched, MODE_MMA | MODE_STORE, bytes, sms, 10);
            const float memset_ms = median_ms(&p, sched, 0, bytes, sms, 10);
            /* 1: both take the larger of the two alone (full overlap); 0: their sum */
            const double larger = mma > store ? mma : store, overlap = (mma + store - both) / (mma + store - larger);
            printf("%-18s %-16s %9.3f %9.3f %9.3f %9.3f %8.2f\n", shapes[s].name, wc_schedules[sched].name, mma, store,
                   both, memset_ms, overlap);
            if (out)
                fprintf(out,
                        "%s\n {\"shape\": \"%s\", \"schedule\": \"%s\", \"mma_ms\": %.4f, \"store_ms\": %.4f, "
                        "\"both_ms\": %.4f, \"memset_ms\": %.4f, \"overlap\": %.3f}",
                        first ? "" : ",", shapes[s].name, wc_schedules[sched].name, mma, store, both, memset_ms,
                        overlap);
            first = 0;
        }
        CK(cudaFree(dw));
    }
    if (out) {
        fprintf(out, "\n]}\n");
        fclose(out);
    }
    return 0;
}
