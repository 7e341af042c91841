/* SPDX-License-Identifier: Apache-2.0 */
/* The L2 read ceiling: every SM reads a buffer that fits in L2 again and again (ld.global.cg: cached in L2, not in
 * L1), and the same over a buffer far bigger than L2 (DRAM). The denominator of a kernel's L2 traffic, as Nsight
 * Compute's lts__t_bytes counts it (bench/results: the WGRAD kernel's). CUDA events, median of 20 after warm-up.
 *
 *   l2_ceiling [out.json]      environment: MOERT_BENCH_MACHINE, MOERT_BENCH_GIT
 */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_cuda_check.h"
#include "bench_record.h"

/* Reads n 16-byte words `reps` times over, four loads in flight a thread; the xor keeps the loads alive. */
__global__ void read_words(const uint4 *buf, size_t n, int reps, uint4 *sink)
{
    uint32_t acc = 0;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (int r = 0; r < reps; r++) {
        size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
        for (; i + 3 * stride < n; i += 4 * stride) {
            const uint4 a = __ldcg(buf + i), b = __ldcg(buf + i + stride), c = __ldcg(buf + i + 2 * stride),
                        d = __ldcg(buf + i + 3 * stride);
            acc ^= a.x ^ b.y ^ c.z ^ d.w;
        }
        for (; i < n; i += stride) acc ^= __ldcg(buf + i).x;
    }
    if (acc == 0x9e3779b9u) sink[0] = make_uint4(acc, acc, acc, acc);
}

static int cmp_float(const void *a, const void *b)
{
    const float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* Median TB/s of reading `bytes` `reps` times over with blocks_per_sm blocks of 512 threads on every SM. */
static double read_rate(const uint4 *buf, size_t bytes, int reps, int sms, int blocks_per_sm, uint4 *sink)
{
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    float ms[20];
    for (int it = -3; it < 20; it++) {
        CK(cudaEventRecord(e0));
        read_words<<<sms * blocks_per_sm, 512>>>(buf, bytes / 16, reps, sink);
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        if (it >= 0) CK(cudaEventElapsedTime(&ms[it], e0, e1));
    }
    CK(cudaGetLastError());
    qsort(ms, 20, sizeof ms[0], cmp_float);
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    const double median = 0.5 * (ms[9] + ms[10]);
    return (double)bytes * reps / (median * 1e-3) / 1e12;
}

int main(int argc, char **argv)
{
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        fprintf(stderr, "l2_ceiling: no CUDA device\n");
        return 77;
    }
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    const size_t big = (size_t)4 << 30;
    uint4 *buf = NULL, *sink = NULL;
    CK(cudaMalloc((void **)&buf, big));
    CK(cudaMemset(buf, 1, big));
    CK(cudaMalloc((void **)&sink, sizeof(uint4)));
    struct {
        const char *name;
        size_t bytes;
        int reps;
    } runs[] = {{"l2 read 8 MiB", (size_t)8 << 20, 200},
                {"l2 read 16 MiB", (size_t)16 << 20, 100},
                {"l2 read 32 MiB", (size_t)32 << 20, 50},
                {"dram read 4 GiB", big, 1}};
    const int nruns = (int)(sizeof runs / sizeof runs[0]);
    double best[4];
    int best_blocks[4];
    printf("device: %s, %d SMs, L2 %d MiB; median of 20\n", prop.name, prop.multiProcessorCount,
           prop.l2CacheSize >> 20);
    for (int r = 0; r < nruns; r++) {
        best[r] = 0, best_blocks[r] = 0;
        for (int blocks = 1; blocks <= 4; blocks *= 2) { /* blocks of 512 threads per SM */
            const double tbps = read_rate(buf, runs[r].bytes, runs[r].reps, prop.multiProcessorCount, blocks, sink);
            if (tbps > best[r]) best[r] = tbps, best_blocks[r] = blocks;
        }
        printf("%-18s %7.2f TB/s (%d blocks of 512 threads per SM)\n", runs[r].name, best[r], best_blocks[r]);
    }
    if (argc > 1) {
        FILE *f = bench_record_open(argv[1], "build-gpu/bench/l2_ceiling OUT.json", prop.name);
        if (!f) return 1;
        fprintf(f, " \"results\": [\n");
        for (int r = 0; r < nruns; r++)
            fprintf(f,
                    "  {\"name\": \"%s\", \"value\": %.3f, \"unit\": \"TB/s\", \"config\": {\"bytes\": %zu, "
                    "\"reps\": %d, \"blocks_per_sm\": %d, \"threads\": 512}}%s\n",
                    runs[r].name, best[r], runs[r].bytes, runs[r].reps, best_blocks[r], r + 1 < nruns ? "," : "");
        fprintf(f, " ]\n}\n");
        fclose(f);
    }
    CK(cudaFree(buf));
    CK(cudaFree(sink));
    return 0;
}
