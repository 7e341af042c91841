/* SPDX-License-Identifier: Apache-2.0 */
/* Grouped expert GEMM benchmark: the bf16 precision plugin's CUDA path on the expert shapes of the presets, against
 * one dense cuBLASLt GEMM of the same total shape (same FLOPs). FORWARD, DGRAD and WGRAD; CUDA events, warm-up, the
 * variants interleaved, median of 20; random inputs. Prints a table and, given a path, writes JSON.
 *
 * Variants (S = MOERT_BENCH_STREAMS, default 4):
 *   loop          per-expert cuBLASLt loop on the caller's stream (1 stream), the same counts every iteration
 *   loop_sS       the loop spread over S streams, the same counts
 *   loop_vary     1 stream, new random counts (same total) every iteration: shows the row-bucket plan cache
 *   loop_sS_vary  S streams, new counts every iteration
 *   graph_sS      S streams with CUDA graph replay (same counts and pointers: replays after the warm-up)
 *   grouped       one cublasGemmGroupedBatchedEx call
 *   kernel        the device-count grouped GEMM kernel (device_gemm.cu, the plugin's "gemm": "kernel"): counts read on
 *                 the device, one launch; WGRAD into a bf16 gradient like the variants above
 *                 (FORWARD/DGRAD on the wgmma engine where the GPU has it)
 *   kernel_mma    FORWARD/DGRAD only: the kernel's mma.sync engine
 *   kernel_f32w   WGRAD only: the kernel accumulating into an fp32 gradient (the executor's setting; on Hopper the
 *                 wgmma engine)
 *   kernel_f32w_ow  WGRAD only: the same overwriting the fp32 gradient (a step's first micro-batch)
 *   kernel_f32w_cl4, kernel_f32w_ow_cl4  WGRAD only: as the two above in clusters of 4 CTAs on 2 x 2 tiles (on Hopper
 *                 the ping-pong schedule otherwise runs quads when adding and pairs when overwriting)
 *   kernel_f32w_coop, kernel_f32w_ow_coop  WGRAD only, Hopper: the wgmma WGRAD's cooperative schedule (128 x 256
 *                 tiles; auto takes it from 2048 rows an expert), adding and overwriting
 *   loop_sS_f32w  WGRAD only: the cuBLASLt loop on S streams accumulating into an fp32 gradient (the plugin's
 *                 "wgrad_gemm": "cublaslt")
 *   copy          WGRAD only: a device-to-device copy of the fp32 gradient (reads and writes its bytes): the traffic
 *                 floor of the WGRAD variants into fp32, see "of_floor" below
 *   dense         one GEMM of the whole [rows, k_in] x [k_in, n_out]
 * For the fp32-gradient WGRAD variants "of_floor" is max(FLOPs at the dense GEMM's rate, the gradient's traffic at the
 * copy's rate: written once when overwriting, read and written when accumulating) / their time: 1 is the floor.
 * "queries/it" is the cuBLASLt heuristic queries per measured iteration (0 once the buckets were seen). After the
 * timing, the outputs of loop_sS and graph_sS are compared bit for bit with loop's (WGRAD overwriting), and the kernel's
 * output with loop's within bf16 rounding (column "err": relative Frobenius; the run fails above 1e-2); skip with
 * MOERT_BENCH_CHECK=0.
 *
 *   gemm_bench [out.json]      environment: MOERT_BENCH_MACHINE (e.g. nvidia-h100-x1), MOERT_BENCH_GIT,
 *                              MOERT_BENCH_REPEATS (default 20), MOERT_BENCH_ONLY (substring of a preset name),
 *                              MOERT_BENCH_STREAMS (default 4), MOERT_BENCH_CHECK (default 1),
 *                              MOERT_BENCH_VARIANTS (comma-separated variant names to run, default all;
 *                              "of_floor" is given only with copy and dense among them)
 */
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "device_gemm.h"
#include "precision_bf16_cuda.h"
#include "bench_cuda_check.h"
#include "bench_host.h"
#include "bench_list.h"

/* One expert GEMM shape of a preset (per rank). */
typedef struct bench_shape {
    const char *name;
    int64_t rows, experts, k_in, n_out;
} bench_shape;

/* The presets' per-GPU expert shapes at EP4 (deepseek-v3 at 64 experts a GPU, ~512 rows each); then deepseek-v3 as
 * bench/overlap_gpu.sh runs it at EP4 (32 experts a GPU, ~1024 rows each, "e32"), and it and qwen3-30b-a3b with two
 * micro-batches' rows at once ("x2": what one WGRAD over two micro-batches would multiply). */
static const bench_shape shapes[] = {
    {"deepseek-v3 fc1", 32768, 64, 7168, 4096},       {"deepseek-v3 fc2", 32768, 64, 2048, 7168},
    {"qwen3-30b-a3b fc1", 16384, 32, 2048, 1536},     {"qwen3-30b-a3b fc2", 16384, 32, 768, 2048},
    {"mixtral-8x7b fc1", 16384, 2, 4096, 28672},      {"mixtral-8x7b fc2", 16384, 2, 14336, 4096},
    {"deepseek-v3 e32 fc1", 32768, 32, 7168, 4096},   {"deepseek-v3 e32 fc2", 32768, 32, 2048, 7168},
    {"deepseek-v3 e32x2 fc1", 65536, 32, 7168, 4096}, {"deepseek-v3 e32x2 fc2", 65536, 32, 2048, 7168},
    {"qwen3-30b-a3b x2 fc1", 32768, 32, 2048, 1536},  {"qwen3-30b-a3b x2 fc2", 32768, 32, 768, 2048},
};

/* One way of running the grouped GEMM. */
typedef struct bench_variant {
    char name[24];
    int streams; /* moert_bf16_cuda_set_streams */
    int vary;    /* new random counts every iteration */
    int graphs;  /* moert_bf16_cuda_set_graphs */
    int grouped; /* MOERT_BF16_CUDA_GROUPED */
    int dense;   /* one expert with all rows */
    int kernel; /* 1: bf16_device_gemm (bf16 gradient), 2: the same into an fp32 gradient, 3: its mma.sync engine, 4: as
                   2, overwriting */
    int wgrad_only; /* 1: WGRAD only, -1: FORWARD and DGRAD only */
    int f32w;       /* the cuBLASLt variants: WGRAD into the fp32 gradient */
    int copy;       /* a device copy of the fp32 gradient instead of a GEMM */
    int cluster;    /* kernel 2, 4: the wgmma WGRAD's cluster (0: as it picks) */
    int schedule;   /* kernel 2, 4: the wgmma WGRAD's schedule (BF16_WGMMA_WGRAD_*) */
} bench_variant;

#define MAX_VARIANTS 20
#define MAX_EXPERTS  256

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

/* splitmix64 -> [0, 1) */
static double rnd(void)
{
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (double)(z >> 11) / 9007199254740992.0;
}

/* bf16 from float, round to nearest even (no NaN inputs here). */
static uint16_t to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* A device buffer of n bf16 values uniform in [-1, 1): a random 8M-element block, tiled. */
static void *random_bf16(int64_t n)
{
    const int64_t block = (int64_t)8 << 20;
    static uint16_t *host_block;
    if (!host_block) {
        host_block = malloc((size_t)block * 2);
        for (int64_t i = 0; i < block; i++) host_block[i] = to_bf16((float)(2 * rnd() - 1));
    }
    void *d = NULL;
    CK(cudaMalloc(&d, (size_t)n * 2));
    /* a different start in the block per buffer, so buffers differ */
    int64_t start = (int64_t)(rnd() * (double)(block / 2));
    for (int64_t at = 0; at < n; at += block - start) {
        int64_t len = n - at < block - start ? n - at : block - start;
        CK(cudaMemcpy((char *)d + at * 2, host_block + start, (size_t)len * 2, cudaMemcpyHostToDevice));
    }
    return d;
}

/* Rows per expert: random weights in [0.5, 1.5), scaled to the total (an imbalanced but full spread). */
static void spread_rows(int64_t rows, int64_t experts, int64_t *counts)
{
    double w[MAX_EXPERTS], sum = 0;
    for (int64_t e = 0; e < experts; e++) sum += (w[e] = 0.5 + rnd());
    int64_t given = 0;
    for (int64_t e = 0; e < experts; e++) {
        counts[e] = (int64_t)floor(rows * w[e] / sum);
        given += counts[e];
    }
    for (int64_t e = 0; given < rows; e = (e + 1) % experts, given++) counts[e]++;
}

static int cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* ||got - want|| / ||want|| over n bf16 values. */
static double rel_error_bf16(const uint16_t *got, const uint16_t *want, int64_t n)
{
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t ug = (uint32_t)got[i] << 16, uw = (uint32_t)want[i] << 16;
        float g, w;
        memcpy(&g, &ug, 4);
        memcpy(&w, &uw, 4);
        num += ((double)g - w) * ((double)g - w);
        den += (double)w * w;
    }
    return den > 0 ? sqrt(num / den) : (num == 0 ? 0 : INFINITY);
}

/* The kernel's arguments for one GEMM of the bench (the same buffers as the cuBLASLt variants). */
static bf16_device_gemm_args kernel_args(const moert_bf16_cuda_gemm *gm, const int64_t *d_counts, int64_t rows,
                                         void *grad_weight, int f32_gradient, int engine)
{
    bf16_device_gemm_args a;
    memset(&a, 0, sizeof a);
    a.pass = gm->pass;
    a.num_experts = gm->num_experts;
    a.counts_device = d_counts;
    a.capacity = rows;
    a.k_in = gm->k_in;
    a.n_out = gm->n_out;
    a.input = gm->input;
    a.weight = gm->weight;
    a.grad_output = gm->grad_output;
    a.output = gm->output;
    a.grad_input = gm->grad_input;
    a.grad_weight = grad_weight;
    a.grad_weight_bf16 = !f32_gradient;
    a.accumulate = gm->accumulate;
    a.engine = engine;
    return a;
}

/* Whether variant v runs on pass `pass` (wgrad_only: 1 WGRAD only, -1 FORWARD/DGRAD only). */
/* The kernel variants into an fp32 gradient, and those of them overwriting it. */
static int kernel_f32(const bench_variant *v) { return v->kernel == 2 || v->kernel == 4; }
static int kernel_overwrites(const bench_variant *v) { return v->kernel == 4; }

/* MOERT_BENCH_VARIANTS: the variants to run, comma-separated (unset: all). */
static const char *variant_filter;

static int runs_on(const bench_variant *v, int pass)
{
    if (!bench_list_names(variant_filter, v->name)) return 0;
    return v->wgrad_only == 0 || (v->wgrad_only > 0) == (pass == MOERT_GEMM_WGRAD);
}

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

typedef struct bench_result {
    char shape[48], pass[8], variant[24];
    double median_ms, tflops, ratio_to_dense, host_ms, queries_per_iter;
    double of_floor; /* fp32-gradient WGRAD: the floor's time / this time; -1: not one of them */
    int same_bits;   /* -1: not checked; 0/1: output equal bit for bit to the 1-stream loop's */
    double rel_err;  /* kernel: relative Frobenius difference to the loop's output; -1: not checked */
} bench_result;

static bench_result results[6 * 3 * MAX_VARIANTS];
static int result_count;

/* Sets the handle up for variant v. */
static void configure(moert_bf16_cuda *g, const bench_variant *v)
{
    MOK(moert_bf16_cuda_set_mode(g, v->grouped ? MOERT_BF16_CUDA_GROUPED : MOERT_BF16_CUDA_EXPERT_LOOP));
    MOK(moert_bf16_cuda_set_streams(g, v->streams));
    MOK(moert_bf16_cuda_set_graphs(g, v->graphs));
}

/* Runs gm with variant v (WGRAD overwriting) `calls` times and copies the result to host. */
static void result_of(moert_bf16_cuda *g, cudaStream_t stream, const bench_variant *v, moert_bf16_cuda_gemm gm,
                      int calls, void *host, size_t bytes)
{
    configure(g, v);
    gm.accumulate = 0;
    for (int i = 0; i < calls; i++) MOK(moert_bf16_cuda_grouped_gemm(g, stream, &gm));
    CK(cudaStreamSynchronize(stream));
    const void *dst = gm.pass == MOERT_GEMM_FORWARD ? gm.output
                      : gm.pass == MOERT_GEMM_DGRAD ? (const void *)gm.grad_input
                                                    : (const void *)gm.grad_weight;
    CK(cudaMemcpy(host, dst, bytes, cudaMemcpyDeviceToHost));
}

/* The cuBLASLt loop's WGRAD overwriting an fp32 gradient (variant loop), on the host: the reference of the kernel's. */
static float *wgrad_f32_reference(moert_bf16_cuda *g, cudaStream_t stream, const bench_variant *loop,
                                  moert_bf16_cuda_gemm gm, void *dw32, size_t elems)
{
    float *ref = malloc(elems * 4);
    if (!ref) {
        fprintf(stderr, "gemm_bench: out of host memory for the fp32 gradient check (%zu bytes)\n", elems * 4);
        exit(1);
    }
    configure(g, loop);
    gm.accumulate = 0;
    gm.grad_weight = dw32, gm.output_fp32 = 1;
    MOK(moert_bf16_cuda_grouped_gemm(g, stream, &gm));
    CK(cudaStreamSynchronize(stream));
    CK(cudaMemcpy(ref, dw32, elems * 4, cudaMemcpyDeviceToHost));
    return ref;
}

/* WGRAD into an fp32 gradient on the kernel as variant v runs it (its cluster and schedule), overwriting, or adding
 * into zeros, against ref (wgrad_f32_reference): relative Frobenius. got: host scratch of elems floats. */
static double wgrad_f32_error(const bench_variant *v, cudaStream_t stream, const float *ref, float *got,
                              const moert_bf16_cuda_gemm *gm, const int64_t *d_counts, int64_t rows, void *dw32,
                              size_t elems)
{
    const int add = !kernel_overwrites(v);
    CK(cudaMemset(dw32, add ? 0 : 0x7f, elems * 4)); /* anything the kernel fails to write shows */
    bf16_device_gemm_args ka = kernel_args(gm, d_counts, rows, dw32, 1, BF16_DEVICE_GEMM_ENGINE_AUTO);
    ka.accumulate = add;
    ka.wgrad_cluster = v->cluster;
    ka.wgrad_schedule = v->schedule;
    MOK(bf16_device_gemm(&bench_host, stream, &ka));
    CK(cudaStreamSynchronize(stream));
    CK(cudaMemcpy(got, dw32, elems * 4, cudaMemcpyDeviceToHost));
    double num = 0, den = 0;
    for (size_t i = 0; i < elems; i++) {
        num += ((double)got[i] - ref[i]) * ((double)got[i] - ref[i]);
        den += (double)ref[i] * ref[i];
    }
    return den > 0 ? sqrt(num / den) : (num == 0 ? 0 : INFINITY);
}

int main(int argc, char **argv)
{
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        fprintf(stderr, "gemm_bench: no CUDA device\n");
        return 77;
    }
    const char *out_path = argc > 1 ? argv[1] : NULL;
    const char *only = getenv("MOERT_BENCH_ONLY");
    variant_filter = getenv("MOERT_BENCH_VARIANTS");
    int repeats = getenv("MOERT_BENCH_REPEATS") ? atoi(getenv("MOERT_BENCH_REPEATS")) : 20;
    if (repeats < 1) repeats = 1;
    int streams = getenv("MOERT_BENCH_STREAMS") ? atoi(getenv("MOERT_BENCH_STREAMS")) : 4;
    if (streams < 1 || streams > MOERT_BF16_CUDA_MAX_STREAMS) streams = 4;
    const int check = getenv("MOERT_BENCH_CHECK") ? atoi(getenv("MOERT_BENCH_CHECK")) != 0 : 1;
    const int warmup = 3;

    bench_variant variants[MAX_VARIANTS];
    int nv = 0;
    variants[nv++] = (bench_variant){"loop", 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
    bench_variant v_streams = {"", streams, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},
                  v_streams_vary = {"", streams, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0};
    bench_variant v_graph = {"", streams, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0};
    snprintf(v_streams.name, sizeof v_streams.name, "loop_s%d", streams);
    snprintf(v_streams_vary.name, sizeof v_streams_vary.name, "loop_s%d_vary", streams);
    snprintf(v_graph.name, sizeof v_graph.name, "graph_s%d", streams);
    const int i_streams = nv;
    variants[nv++] = v_streams;
    variants[nv++] = (bench_variant){"loop_vary", 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0};
    variants[nv++] = v_streams_vary;
    const int i_graph = nv;
    variants[nv++] = v_graph;
    variants[nv++] = (bench_variant){"grouped", 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0};
    const int i_kernel = nv;
    variants[nv++] = (bench_variant){"kernel", 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0};
    variants[nv++] = (bench_variant){"kernel_mma", 1, 0, 0, 0, 0, 3, -1, 0, 0, 0, 0};
    variants[nv++] = (bench_variant){"kernel_f32w", 1, 0, 0, 0, 0, 2, 1, 0, 0, 0, 0};
    variants[nv++] = (bench_variant){"kernel_f32w_ow", 1, 0, 0, 0, 0, 4, 1, 0, 0, 0, 0};
    variants[nv++] = (bench_variant){"kernel_f32w_cl4", 1, 0, 0, 0, 0, 2, 1, 0, 0, 4, 0};
    variants[nv++] = (bench_variant){"kernel_f32w_ow_cl4", 1, 0, 0, 0, 0, 4, 1, 0, 0, 4, 0};
    variants[nv++] = (bench_variant){"kernel_f32w_coop", 1, 0, 0, 0, 0, 2, 1, 0, 0, 0, BF16_WGMMA_WGRAD_COOPERATIVE};
    variants[nv++] = (bench_variant){"kernel_f32w_ow_coop", 1, 0, 0, 0, 0, 4, 1, 0, 0, 0, BF16_WGMMA_WGRAD_COOPERATIVE};
    bench_variant v_streams_f32w = {"", streams, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0};
    snprintf(v_streams_f32w.name, sizeof v_streams_f32w.name, "loop_s%d_f32w", streams);
    const int i_f32w_loop = nv;
    variants[nv++] = v_streams_f32w;
    const int i_copy = nv;
    variants[nv++] = (bench_variant){"copy", 1, 0, 0, 0, 0, 0, 1, 0, 1, 0, 0};
    const int i_dense = nv;
    variants[nv++] = (bench_variant){"dense", 1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0};

    struct cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    cudaStream_t stream;
    CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    moert_bf16_cuda *g = NULL;
    MOK(moert_bf16_cuda_create(&bench_host, NULL, 0, MOERT_BF16_CUDA_EXPERT_LOOP, &g));
    MOK(bf16_device_gemm_prepare(&bench_host));
    cudaEvent_t ev0, ev1;
    CK(cudaEventCreate(&ev0));
    CK(cudaEventCreate(&ev1));
    static const char *const pass_names[3] = {"fwd", "dgrad", "wgrad"};

    printf("device: %s, %d SMs; bf16 storage, fp32 accumulation; median of %d after %d warm-up runs; %d streams\n",
           prop.name, prop.multiProcessorCount, repeats, warmup, streams);
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const bench_shape *s = &shapes[si];
        if (only && !strstr(s->name, only)) continue;
        const int64_t K = s->k_in, N = s->n_out, R = s->rows, E = s->experts;
        int64_t counts[MAX_EXPERTS], dense_counts[1] = {R};
        int64_t *vary_counts = malloc((size_t)(warmup + repeats) * MAX_EXPERTS * sizeof(int64_t));
        spread_rows(R, E, counts);
        for (int it = 0; it < warmup + repeats; it++) spread_rows(R, E, vary_counts + (size_t)it * MAX_EXPERTS);
        void *x = random_bf16(R * K), *w = random_bf16(E * K * N), *dy = random_bf16(R * N);
        void *y = NULL, *dx = NULL, *dw = NULL;
        CK(cudaMalloc(&y, (size_t)(R * N) * 2));
        CK(cudaMalloc(&dx, (size_t)(R * K) * 2));
        CK(cudaMalloc(&dw, (size_t)(E * K * N) * 2));
        CK(cudaMemset(dw, 0, (size_t)(E * K * N) * 2));
        void *dw32 = NULL, *dw32_copy = NULL, *d_counts = NULL; /* fp32 gradient, a copy's target, device counts */
        CK(cudaMalloc(&dw32, (size_t)(E * K * N) * 4));
        CK(cudaMemset(dw32, 0, (size_t)(E * K * N) * 4));
        CK(cudaMalloc(&dw32_copy, (size_t)(E * K * N) * 4));
        CK(cudaMalloc(&d_counts, (size_t)E * sizeof(int64_t)));
        CK(cudaMemcpy(d_counts, counts, (size_t)E * sizeof(int64_t), cudaMemcpyHostToDevice));
        const double flops = 2.0 * (double)R * (double)K * (double)N;
        for (int pass = 0; pass < 3; pass++) {
            float *times[MAX_VARIANTS];
            double host_total[MAX_VARIANTS] = {0};
            int64_t queries[MAX_VARIANTS] = {0};
            for (int v = 0; v < nv; v++) times[v] = malloc((size_t)repeats * sizeof(float));
            moert_bf16_cuda_gemm gm = {.pass = (moert_gemm_pass)pass,
                                       .dtype = MOERT_BF16,
                                       .k_in = K,
                                       .n_out = N,
                                       .input = x,
                                       .weight = w,
                                       .grad_output = dy,
                                       .output = y,
                                       .grad_input = dx,
                                       .grad_weight = dw,
                                       .accumulate = 1};
            for (int it = -warmup; it < repeats; it++)
                for (int v = 0; v < nv; v++) { /* interleaved */
                    const bench_variant *var = &variants[v];
                    if (!runs_on(var, pass)) continue;
                    gm.num_experts = var->dense ? 1 : E;
                    gm.rows_per_expert = var->dense  ? dense_counts
                                         : var->vary ? vary_counts + (size_t)(it + warmup) * MAX_EXPERTS
                                                     : counts;
                    configure(g, var);
                    int64_t q0 = 0, q1 = 0;
                    moert_bf16_cuda_plan_stats(g, &q0, NULL);
                    CK(cudaEventRecord(ev0, stream));
                    double h0 = now_ms();
                    if (var->copy) {
                        CK(cudaMemcpyAsync(dw32_copy, dw32, (size_t)(E * K * N) * 4, cudaMemcpyDeviceToDevice, stream));
                    } else if (var->kernel) {
                        const int f32 = kernel_f32(var);
                        bf16_device_gemm_args ka =
                            kernel_args(&gm, d_counts, R, f32 ? dw32 : dw, f32,
                                        var->kernel == 3 ? BF16_DEVICE_GEMM_ENGINE_MMA : BF16_DEVICE_GEMM_ENGINE_AUTO);
                        if (kernel_overwrites(var)) ka.accumulate = 0;
                        ka.wgrad_cluster = var->cluster;
                        ka.wgrad_schedule = var->schedule;
                        MOK(bf16_device_gemm(&bench_host, stream, &ka));
                    } else {
                        moert_bf16_cuda_gemm gv = gm;
                        if (var->f32w) gv.grad_weight = dw32, gv.output_fp32 = 1;
                        MOK(moert_bf16_cuda_grouped_gemm(g, stream, &gv));
                    }
                    double h1 = now_ms();
                    CK(cudaEventRecord(ev1, stream));
                    CK(cudaEventSynchronize(ev1));
                    moert_bf16_cuda_plan_stats(g, &q1, NULL);
                    float ms = 0;
                    CK(cudaEventElapsedTime(&ms, ev0, ev1));
                    if (it >= 0) {
                        times[v][it] = ms;
                        host_total[v] += h1 - h0;
                        queries[v] += q1 - q0;
                    }
                }
            double median[MAX_VARIANTS];
            for (int v = 0; v < nv; v++) {
                median[v] = 0;
                if (!runs_on(&variants[v], pass)) continue;
                qsort(times[v], (size_t)repeats, sizeof(float), cmp_float);
                median[v] =
                    repeats % 2 ? times[v][repeats / 2] : 0.5 * (times[v][repeats / 2 - 1] + times[v][repeats / 2]);
            }

            /* bit-for-bit: the S-stream loop and the graph replay against the 1-stream loop */
            int same_streams = -1, same_graph = -1;
            double kernel_err = -1, f32w_err[MAX_VARIANTS];
            for (int v = 0; v < nv; v++) f32w_err[v] = -1;
            if (check) {
                const int64_t elems = pass == 0 ? R * N : pass == 1 ? R * K : E * K * N;
                const size_t bytes = (size_t)elems * 2;
                void *ref = malloc(bytes), *got = malloc(bytes);
                if (!ref || !got) {
                    fprintf(stderr, "gemm_bench: out of host memory for the bit check (%zu bytes)\n", bytes);
                    return 1;
                }
                gm.num_experts = E;
                gm.rows_per_expert = counts;
                result_of(g, stream, &variants[0], gm, 1, ref, bytes);
                result_of(g, stream, &variants[i_streams], gm, 1, got, bytes);
                same_streams = memcmp(ref, got, bytes) == 0;
                memset(got, 0, bytes);
                result_of(g, stream, &variants[i_graph], gm, 3, got, bytes); /* seen, captured, replayed */
                same_graph = memcmp(ref, got, bytes) == 0;
                /* the kernel (bf16 gradient, overwriting) against the 1-stream loop, within bf16 rounding */
                gm.accumulate = 0;
                const bf16_device_gemm_args ka = kernel_args(&gm, d_counts, R, dw, 0, BF16_DEVICE_GEMM_ENGINE_AUTO);
                MOK(bf16_device_gemm(&bench_host, stream, &ka));
                CK(cudaStreamSynchronize(stream));
                CK(cudaMemcpy(got, pass == 0 ? y : pass == 1 ? dx : dw, bytes, cudaMemcpyDeviceToHost));
                gm.accumulate = 1;
                kernel_err = rel_error_bf16(got, ref, elems);
                free(ref);
                free(got);
                if (pass == MOERT_GEMM_WGRAD) {
                    const size_t dw_elems = (size_t)(E * K * N);
                    float *ref32 = wgrad_f32_reference(g, stream, &variants[i_f32w_loop], gm, dw32, dw_elems);
                    float *got32 = malloc(dw_elems * 4);
                    if (!got32) {
                        fprintf(stderr, "gemm_bench: out of host memory for the fp32 gradient check\n");
                        return 1;
                    }
                    for (int v = 0; v < nv; v++)
                        if (kernel_f32(&variants[v]))
                            f32w_err[v] =
                                wgrad_f32_error(&variants[v], stream, ref32, got32, &gm, d_counts, R, dw32, dw_elems);
                    free(ref32);
                    free(got32);
                }
            }

            for (int v = 0; v < nv; v++) {
                if (!runs_on(&variants[v], pass)) {
                    free(times[v]);
                    continue;
                }
                bench_result *r = &results[result_count++];
                snprintf(r->shape, sizeof r->shape, "%s", s->name);
                snprintf(r->pass, sizeof r->pass, "%s", pass_names[pass]);
                snprintf(r->variant, sizeof r->variant, "%.23s", variants[v].name);
                r->median_ms = median[v];
                r->tflops = flops / (median[v] * 1e-3) / 1e12;
                r->ratio_to_dense = median[i_dense] / median[v]; /* > 1: faster than the dense GEMM */
                r->host_ms = host_total[v] / repeats;
                r->queries_per_iter = (double)queries[v] / repeats;
                r->same_bits = v == i_streams ? same_streams : v == i_graph ? same_graph : -1;
                r->rel_err = v == i_kernel ? kernel_err : f32w_err[v];
                /* the floor of the fp32-gradient WGRAD variants: the copy moves the gradient's bytes twice */
                const int f32_wgrad = pass == MOERT_GEMM_WGRAD && (kernel_f32(&variants[v]) || variants[v].f32w);
                const double traffic_ms = median[i_copy] * (kernel_overwrites(&variants[v]) ? 0.5 : 1.0);
                const double mma_ms = median[i_dense];
                /* -1 as well where MOERT_BENCH_VARIANTS left copy or dense out */
                r->of_floor = f32_wgrad && traffic_ms > 0 && mma_ms > 0
                                  ? (mma_ms > traffic_ms ? mma_ms : traffic_ms) / median[v]
                                  : -1;
                free(times[v]);
            }
        }
        free(vary_counts);
        CK(cudaFree(x));
        CK(cudaFree(w));
        CK(cudaFree(dy));
        CK(cudaFree(y));
        CK(cudaFree(dx));
        CK(cudaFree(dw));
        CK(cudaFree(dw32));
        CK(cudaFree(dw32_copy));
        CK(cudaFree(d_counts));
    }
    moert_bf16_cuda_stats stats;
    moert_bf16_cuda_get_stats(g, &stats);
    moert_bf16_cuda_destroy(g);

    printf("\n%-20s %-6s %-15s %10s %10s %10s %10s %10s %6s %9s %8s\n", "shape", "pass", "variant", "median ms",
           "TFLOP/s", "vs dense", "enqueue ms", "queries/it", "bits", "err", "of floor");
    for (int i = 0; i < result_count; i++) {
        const bench_result *r = &results[i];
        char err[16] = "";
        char floor_text[16] = "";
        if (r->rel_err >= 0) snprintf(err, sizeof err, "%.2e", r->rel_err);
        if (r->of_floor >= 0) snprintf(floor_text, sizeof floor_text, "%.2f", r->of_floor);
        printf("%-20s %-6s %-15s %10.3f %10.1f %9.2fx %10.3f %10.2f %6s %9s %8s\n", r->shape, r->pass, r->variant,
               r->median_ms, r->tflops, r->ratio_to_dense, r->host_ms, r->queries_per_iter,
               r->same_bits < 0 ? ""
               : r->same_bits   ? "same"
                                : "DIFF",
               err, floor_text);
    }
    printf("cuBLASLt heuristic queries %lld, plan cache hits %lld, exact-shape fallbacks %lld; graphs: %lld replays, "
           "%lld updates, %lld instantiations\n",
           (long long)stats.heuristic_queries, (long long)stats.cache_hits, (long long)stats.exact_fallbacks,
           (long long)stats.graph_replays, (long long)stats.graph_updates, (long long)stats.graph_instantiations);
    int differ = 0;
    for (int i = 0; i < result_count; i++) differ |= results[i].same_bits == 0;
    if (differ) printf("WARNING: some outputs differ bit for bit from the 1-stream loop (column bits)\n");
    int kernel_bad = 0;
    for (int i = 0; i < result_count; i++)
        kernel_bad |= results[i].rel_err > 1e-2 || results[i].rel_err != results[i].rel_err;
    if (kernel_bad) printf("FAIL: the kernel's output differs from the loop's by more than 1e-2 (column err)\n");

    if (out_path) {
        FILE *f = fopen(out_path, "w");
        if (!f) {
            fprintf(stderr, "gemm_bench: cannot write %s\n", out_path);
            return 1;
        }
        time_t t = time(NULL);
        char date[32];
        strftime(date, sizeof date, "%Y-%m-%d", gmtime(&t));
        const char *machine = getenv("MOERT_BENCH_MACHINE"), *git = getenv("MOERT_BENCH_GIT");
        fprintf(f, "{\n  \"command\": \"%s%s%s\",\n", argv[0], out_path ? " " : "", out_path);
        fprintf(f, "  \"machine\": \"%s\",\n  \"gpus\": 1,\n  \"device\": \"%s\",\n", machine ? machine : "unknown",
                prop.name);
        fprintf(f, "  \"git\": \"%s\",\n  \"date\": \"%s\",\n  \"repeats\": %d,\n", git ? git : "unknown", date,
                repeats);
        fprintf(
            f,
            "  \"note\": \"bf16 storage, fp32 accumulation; rows spread over experts with weights 0.5..1.5 "
            "(_vary: new counts, same total, every iteration); loop_sN: N streams; graph_sN: CUDA graph replay; "
            "dense = one cuBLASLt GEMM of the same total shape; ratio_to_dense > 1 is faster; "
            "queries_per_iter: cuBLASLt heuristic queries per measured iteration; same_bits: output equal bit "
            "for bit to the 1-stream loop's (null: not checked); kernel: device-count grouped GEMM kernel (bf16 dW), "
            "kernel_mma: its mma.sync engine (fwd/dgrad; kernel runs wgmma there on sm_90); kernel_f32w: the kernel "
            "accumulating into fp32 dW (wgrad only), kernel_f32w_ow: overwriting it, loop_sN_f32w: the cuBLASLt loop "
            "accumulating into fp32 dW, copy: a device copy of the fp32 dW; of_floor (fp32 wgrad): max(flops at the "
            "dense rate, dW traffic at the copy rate) / time; rel_err: kernel vs loop output, "
            "relative Frobenius\",\n");
        fprintf(f, "  \"results\": [\n");
        for (int i = 0; i < result_count; i++) {
            const bench_result *r = &results[i];
            const bench_shape *s = NULL;
            char err_json[24] = "null", floor_json[24] = "null";
            if (r->rel_err >= 0) snprintf(err_json, sizeof err_json, "%.3e", r->rel_err);
            if (r->of_floor >= 0) snprintf(floor_json, sizeof floor_json, "%.4f", r->of_floor);
            for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++)
                if (!strcmp(shapes[k].name, r->shape)) s = &shapes[k];
            fprintf(
                f,
                "    {\"name\": \"gemm %s %s %s\", \"value\": %.4f, \"unit\": \"TFLOP/s\", \"median_ms\": %.5f, "
                "\"ratio_to_dense\": %.4f, \"enqueue_ms\": %.5f, \"queries_per_iter\": %.3f, \"same_bits\": %s, "
                "\"rel_err\": %s, \"of_floor\": %s, "
                "\"config\": {\"rows\": %lld, \"experts\": %lld, \"k_in\": %lld, \"n_out\": %lld, \"pass\": \"%s\", "
                "\"variant\": \"%s\"}}%s\n",
                r->shape, r->pass, r->variant, r->tflops, r->median_ms, r->ratio_to_dense, r->host_ms,
                r->queries_per_iter,
                r->same_bits < 0 ? "null"
                : r->same_bits   ? "true"
                                 : "false",
                err_json, floor_json, (long long)s->rows, (long long)s->experts, (long long)s->k_in,
                (long long)s->n_out, r->pass, r->variant, i + 1 < result_count ? "," : "");
        }
        fprintf(f, "  ]\n}\n");
        fclose(f);
        printf("wrote %s\n", out_path);
    }
    return kernel_bad ? 1 : 0;
}
