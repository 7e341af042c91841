/* SPDX-License-Identifier: Apache-2.0 */
/* FP8 expert GEMM benchmark: the fp8 precision plugin's CUDA path (blockwise and current scaling) against the bf16
 * plugin's cuBLASLt loop on the deepseek-v3 expert shapes of one EP4 rank (64 local experts, H=7168, F=2048; rows
 * per expert from a random top-8 routing of T=4096 tokens per rank over 256 experts: 4 x 4096 tokens, each to 8
 * distinct experts, counted for rank 0's experts 0..63, ~512 rows each, arbitrary counts), FORWARD, DGRAD and WGRAD;
 * with dense GEMMs of the same total shape (bf16 and FP8 blockwise, one expert of all rows) as ceilings measured in
 * the same call. Last, per shape and over both: the blockwise recipe's fwd+dgrad+wgrad TFLOP/s and its speed-up over
 * the bf16 grouped GEMM in the same run (the target is 1.4x), against the faster bf16 engine of each pass: bf16 (the
 * plugin's cuBLASLt loop) or bf16_wgmma (its device-count kernel on the wgmma engine, what "gemm": "auto" runs for
 * FORWARD and DGRAD on Hopper), and against the cuBLASLt loop alone. The blockwise variants run on moert's wgmma
 * kernel (fp8_block_gemm.cu); fp8_blockwise_cublaslt is the same recipe on cuBLASLt's VEC128 / BLK128x128 matmuls.
 * A last line gives the speed-up over FORWARD and DGRAD alone (the GEMMs without the wgrad, whose fp32 grad_weight
 * traffic caps it), with and without the activation quantization.
 *
 * Times are CUDA events around one grouped GEMM call, median of MOERT_BENCH_REPEATS after 3 warm-up calls, the
 * variants interleaved. The FP8 times include the quantization of the activations (amax, scale, cast, and the
 * transposes WGRAD needs); the FP8 weight copies are cached (made once per step, at end_step) and their making is
 * timed on its own ("weight quantization"), as is the activation quantization alone ("quant" column: the same call
 * with the matmuls left out). Activations bf16, weights fp32 (the executor's setting), grad_weight fp32; the bf16
 * variant gets bf16 weights (its plugin's cached copy) holding the same values (the fp32 weights are bf16-exact).
 * WGRAD also has "first micro-batch" variants (bf16_first, fp8_blockwise_first): overwrite_grad_weight, beta 0 (their
 * vs bf16 is against bf16_first). The relative error of each FP8 variant against bf16 on the same inputs and weights
 * (the grouped bf16 GEMM, or for the dense FP8 ceiling the dense bf16 one; WGRAD both overwriting; first 4M values)
 * is measured in a separate call after the timed ones: it is the FP8 error (a few percent with E4M3), and the bench
 * fails (exit 1, after the table and JSON) when any is above MAX_REL_ERR or not a number.
 *
 *   fp8_gemm_bench [out.json]    environment: MOERT_BENCH_MACHINE, MOERT_BENCH_GIT, MOERT_BENCH_REPEATS (10),
 *                                MOERT_BENCH_STREAMS (4), MOERT_BENCH_ONLY (substring of a shape name),
 *                                MOERT_BENCH_VARIANTS (comma-separated variant names: only those; for tuning runs),
 *                                MOERT_BENCH_PASSES (comma-separated fwd, dgrad, wgrad: only those; no totals then),
 *                                MOERT_BENCH_TOKENS (tokens per rank of the routing, 4096: other K for the wgrad),
 *                                MOERT_BENCH_BLOCK (how the wgmma kernel runs: comma-separated KEY=VALUE of the fp8
 *                                plugin's block_* options without the prefix, e.g. "tile_n=128,pair_rows=0")
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
#include "fp8_block_gemm.h"
#include "precision_bf16_cuda.h"
#include "precision_fp8_cuda.h"
#include "bench_cuda_check.h"
#include "bench_host.h"
#include "bench_list.h"

typedef struct bench_shape {
    const char *name;
    moert_gemm_weight which;
    int64_t experts, k_in, n_out; /* rows: from the routing */
} bench_shape;

static const bench_shape shapes[] = {
    {"deepseek-v3 fc1", MOERT_GEMM_FC1, 64, 7168, 4096},
    {"deepseek-v3 fc2", MOERT_GEMM_FC2, 64, 2048, 7168},
};

/* The routing the row counts come from: deepseek-v3 at EP4 (tokens per rank, ranks, experts, top-k). */
#define ROUTE_TOKENS 4096
static int route_tokens = ROUTE_TOKENS; /* MOERT_BENCH_TOKENS */
#define ROUTE_RANKS      4
#define ROUTE_EXPERTS    256
#define ROUTE_TOPK       8
#define BLOCKWISE_TARGET 1.4 /* the speed-up over bf16 the blockwise recipe aims at (fwd+dgrad+wgrad) */
#define MAX_REL_ERR      0.2 /* an FP8 variant further than this from bf16 computes something else: the bench fails */
#define ERR_VALUES       ((int64_t)4 << 20) /* outputs compared against bf16 */

enum {
    V_BF16,
    V_FP8_BLOCK,
    V_FP8_CURRENT,
    V_DENSE_BF16,
    V_DENSE_FP8,
    V_BF16_FIRST,
    V_FP8_BLOCK_FIRST,
    V_FP8_BLOCK_CUBLASLT,
    V_BF16_WGMMA,
    V_COUNT
};
static const char *const variant_names[V_COUNT] = {"bf16",
                                                   "fp8_blockwise",
                                                   "fp8_current",
                                                   "dense_bf16",
                                                   "dense_fp8_blockwise",
                                                   "bf16_first",
                                                   "fp8_blockwise_first",
                                                   "fp8_blockwise_cublaslt",
                                                   "bf16_wgmma"};

/* Whether variant v runs in pass: the "first micro-batch" ones (overwrite_grad_weight) in WGRAD only, the wgmma
 * engine in FORWARD and DGRAD only. */
static int variant_applies(int v, int pass)
{
    if (v == V_BF16_WGMMA) return pass != MOERT_GEMM_WGRAD;
    return pass == MOERT_GEMM_WGRAD || (v != V_BF16_FIRST && v != V_FP8_BLOCK_FIRST);
}

/* MOERT_BENCH_BLOCK ("tile_n=128,stages=3,...": the fp8 plugin's block_* options without their prefix) into t;
 * exits with status 2 naming a key or value it does not know, so a tuning run never measures the defaults by
 * mistake. */
static void block_tuning_from_env(moert_fp8_block_tuning *t)
{
    *t = moert_fp8_block_tuning_default();
    const char *spec = getenv("MOERT_BENCH_BLOCK");
    if (!spec || !*spec) return;
    static const char *const keys[] = {"tile_n", "stages", "pairs", "pair_rows", "cluster", "clusters"};
    int *const fields[] = {&t->tile_n, &t->stages, &t->pairs, &t->pair_rows, &t->cluster, &t->clusters};
    char copy[512];
    snprintf(copy, sizeof copy, "%s", spec);
    char *save = NULL;
    for (char *item = strtok_r(copy, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
        char *eq = strchr(item, '='), *end = NULL;
        long value = eq ? strtol(eq + 1, &end, 10) : 0;
        int found = -1;
        if (eq) {
            *eq = '\0';
            for (int i = 0; i < 6; i++)
                if (!strcmp(item, keys[i])) found = i;
        }
        if (found < 0 || !end || end == eq + 1 || *end) {
            fprintf(stderr,
                    "fp8_gemm_bench: MOERT_BENCH_BLOCK: \"%s\" is not KEY=INTEGER with KEY one of tile_n, "
                    "stages, pairs, pair_rows, cluster, clusters\n",
                    item);
            exit(2);
        }
        *fields[found] = (int)value;
    }
}

/* Whether MOERT_BENCH_VARIANTS (comma-separated names; unset: all) names variant v (quick tuning runs). */
static int variant_selected(int v) { return bench_list_names(getenv("MOERT_BENCH_VARIANTS"), variant_names[v]); }

static int variant_is_fp8(int v)
{
    return v == V_FP8_BLOCK || v == V_FP8_CURRENT || v == V_DENSE_FP8 || v == V_FP8_BLOCK_FIRST ||
           v == V_FP8_BLOCK_CUBLASLT;
}

/* The bf16 variant an FP8 variant's output is compared with (the same GEMMs in bf16). */
static int variant_reference(int v)
{
    return v == V_DENSE_FP8 ? V_DENSE_BF16 : v == V_FP8_BLOCK_FIRST ? V_BF16_FIRST : V_BF16;
}
#define MAX_EXPERTS 256
#define MAX_SKIPPED 64
#define MAX_RESULTS 128

/* Variants the plugin refused, with its message (printed, and listed in the JSON). */
static char skipped[MAX_SKIPPED][512];
static int skipped_count;

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static double rnd(void)
{
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (double)(z >> 11) / 9007199254740992.0;
}

static uint16_t to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static float from_bf16(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* A device buffer of n values (bf16 or fp32) uniform in [-scale, scale): a random 8M-element block, tiled from a
 * random start (buffers differ). fp32 values are bf16-exact, so a bf16 copy holds the same weights. */
static void *random_device(int64_t n, int fp32, double scale)
{
    const int64_t block = (int64_t)8 << 20;
    const size_t es = fp32 ? 4 : 2;
    void *host = malloc((size_t)block * es);
    if (!host) exit(1);
    for (int64_t i = 0; i < block; i++) {
        const float v = (float)(scale * (2 * rnd() - 1));
        if (fp32)
            ((float *)host)[i] = from_bf16(to_bf16(v));
        else
            ((uint16_t *)host)[i] = to_bf16(v);
    }
    void *d = NULL;
    CK(cudaMalloc(&d, (size_t)n * es + 256));
    const int64_t start = (int64_t)(rnd() * (double)(block / 2));
    for (int64_t at = 0; at < n; at += block - start) {
        const int64_t len = n - at < block - start ? n - at : block - start;
        CK(cudaMemcpy((char *)d + at * es, (char *)host + start * es, (size_t)len * es, cudaMemcpyHostToDevice));
    }
    free(host);
    return d;
}

/* Rows of rank 0's `experts` local experts under a uniform random top-k routing of every rank's tokens (each token
 * to ROUTE_TOPK distinct experts of ROUTE_EXPERTS); returns their sum. */
static int64_t route_rows(int64_t experts, int64_t *counts)
{
    for (int64_t e = 0; e < experts; e++) counts[e] = 0;
    int64_t total = 0;
    for (int64_t t = 0; t < (int64_t)route_tokens * ROUTE_RANKS; t++) {
        int chosen[ROUTE_TOPK];
        for (int k = 0; k < ROUTE_TOPK; k++) {
            int e, again;
            do {
                e = (int)(rnd() * ROUTE_EXPERTS);
                again = 0;
                for (int j = 0; j < k; j++) again |= chosen[j] == e;
            } while (again);
            chosen[k] = e;
            if (e < experts) counts[e]++, total++;
        }
    }
    return total;
}

static int cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

static double median(float *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_float);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

typedef struct bench_result {
    const char *shape, *pass, *variant;
    double ms, tflops, vs_bf16, quant_ms, rel_err;
    int64_t rows, experts, k_in, n_out;
} bench_result;

static bench_result results[MAX_RESULTS];
static int result_count;
/* blockwise vs bf16 over fwd+dgrad+wgrad: [shape][0 blockwise, 1 bf16 (the faster engine per pass), 2 bf16 cuBLASLt
 * loop, 3 blockwise less its activation quantization] summed ms, and the FLOPs of the three */
static double sum_ms[2][4], sum_flops[2];
static double fwd_dgrad_ms[4]; /* the same over both shapes' FORWARD and DGRAD only (the GEMMs without the wgrad) */
static double weight_quant_ms[2][2]; /* [shape][blockwise, current]: both FP8 layouts of one weight */

/* Adds one pass's medians to a total (sum_ms's four columns); NaN (refused) stays NaN. */
static void add_pass(double total[4], const double *med, double quant_ms)
{
    total[0] += med[V_FP8_BLOCK];
    total[1] += isnan(med[V_BF16_WGMMA]) || med[V_BF16] < med[V_BF16_WGMMA] ? med[V_BF16] : med[V_BF16_WGMMA];
    total[2] += med[V_BF16];
    total[3] += med[V_FP8_BLOCK] - quant_ms;
}

/* Relative Frobenius error of the first n values (bf16, or fp32 when fp32) of a against b (device buffers); NaN
 * when b is all zero (nothing was compared) or a holds a NaN. */
static double rel_err(const void *a, const void *b, int64_t n, int fp32)
{
    const size_t es = fp32 ? 4 : 2;
    void *ha = malloc((size_t)n * es), *hb = malloc((size_t)n * es);
    if (!ha || !hb) exit(1);
    CK(cudaMemcpy(ha, a, (size_t)n * es, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hb, b, (size_t)n * es, cudaMemcpyDeviceToHost));
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        const double x = fp32 ? ((float *)ha)[i] : from_bf16(((uint16_t *)ha)[i]);
        const double y = fp32 ? ((float *)hb)[i] : from_bf16(((uint16_t *)hb)[i]);
        num += (x - y) * (x - y);
        den += y * y;
    }
    free(ha), free(hb);
    return den > 0 ? sqrt(num / den) : NAN;
}

/* One shape's operands and handles: what a variant's grouped GEMM is called with. */
typedef struct shape_run {
    const bench_shape *s;
    int64_t K, N, E, R, streams;
    const int64_t *counts, *dense_counts;
    const int64_t *counts_device; /* counts on the GPU, for bf16_wgmma */
    void *x, *dy, *w32, *w16;
    void **y, **dx;
    moert_bf16_cuda *bf16;
    moert_fp8_cuda **fp8; /* blockwise (kernel), current, dense blockwise (kernel), blockwise on cuBLASLt */
} shape_run;

/* Enqueues variant var's grouped GEMM of pass on stream: output into y[var] / dx[var] / grad_weight (WGRAD:
 * accumulated, or overwritten by the _first variants and when overwrite is set). quant_only: the FP8 quantization
 * alone. Returns the plugin's result (its message in bench_host_error). */
static moert_result launch(const shape_run *r, cudaStream_t stream, int var, int pass, void *grad_weight, int overwrite,
                           int quant_only)
{
    const int dense = var == V_DENSE_BF16 || var == V_DENSE_FP8;
    overwrite = pass == MOERT_GEMM_WGRAD && (overwrite || var == V_BF16_FIRST || var == V_FP8_BLOCK_FIRST);
    if (var == V_BF16_WGMMA) {
        const bf16_device_gemm_args a = {.pass = (moert_gemm_pass)pass,
                                         .num_experts = r->E,
                                         .counts_device = r->counts_device,
                                         .capacity = r->R,
                                         .k_in = r->K,
                                         .n_out = r->N,
                                         .input = r->x,
                                         .weight = r->w16,
                                         .grad_output = r->dy,
                                         .output = r->y[var],
                                         .grad_input = r->dx[var],
                                         .engine = BF16_DEVICE_GEMM_ENGINE_WGMMA};
        return bf16_device_gemm(&bench_host, stream, &a);
    }
    if (!variant_is_fp8(var)) {
        moert_bf16_cuda_gemm gm = {.pass = (moert_gemm_pass)pass,
                                   .dtype = MOERT_BF16,
                                   .num_experts = dense ? 1 : r->E,
                                   .rows_per_expert = dense ? r->dense_counts : r->counts,
                                   .k_in = r->K,
                                   .n_out = r->N,
                                   .input = r->x,
                                   .weight = r->w16,
                                   .grad_output = r->dy,
                                   .output = r->y[var],
                                   .grad_input = r->dx[var],
                                   .grad_weight = grad_weight,
                                   .accumulate = !overwrite,
                                   .output_fp32 = pass == MOERT_GEMM_WGRAD};
        moert_result rc = moert_bf16_cuda_set_streams(r->bf16, dense ? 1 : (int)r->streams);
        return rc != MOERT_OK ? rc : moert_bf16_cuda_grouped_gemm(r->bf16, stream, &gm);
    }
    moert_fp8_cuda *h = r->fp8[var == V_FP8_CURRENT ? 1 : var == V_DENSE_FP8 ? 2 : var == V_FP8_BLOCK_CUBLASLT ? 3 : 0];
    moert_fp8_cuda_gemm gm = {.which = r->s->which,
                              .pass = (moert_gemm_pass)pass,
                              .act_dtype = MOERT_BF16,
                              .weight_dtype = MOERT_F32,
                              .grad_weight_dtype = MOERT_F32,
                              .num_experts = dense ? 1 : r->E,
                              .rows_per_expert = dense ? r->dense_counts : r->counts,
                              .capacity = r->R,
                              .k_in = r->K,
                              .n_out = r->N,
                              .input = r->x,
                              .weight = r->w32,
                              .grad_output = r->dy,
                              .output = r->y[var],
                              .grad_input = r->dx[var],
                              .grad_weight = grad_weight,
                              .overwrite_grad_weight = overwrite};
    moert_fp8_cuda_set_quantize_only(h, quant_only);
    const moert_result rc = moert_fp8_cuda_grouped_gemm(h, stream, &gm);
    moert_fp8_cuda_set_quantize_only(h, 0);
    return rc;
}

/* FP8 variant v's error against its bf16 reference: both run again on the same inputs and weights (WGRAD both
 * overwriting: dw_ref for bf16, dw for FP8), the first ERR_VALUES outputs compared. */
static double measure_error(const shape_run *r, cudaStream_t stream, int v, int pass, void *dw, void *dw_ref)
{
    const int ref = variant_reference(v);
    MOK(launch(r, stream, ref, pass, dw_ref, 1, 0));
    MOK(launch(r, stream, v, pass, dw, 1, 0));
    CK(cudaStreamSynchronize(stream));
    const int64_t rows = v == V_DENSE_FP8 ? r->dense_counts[0] : r->R;
    int64_t n = pass == MOERT_GEMM_FORWARD ? rows * r->N : pass == MOERT_GEMM_DGRAD ? rows * r->K : r->K * r->N;
    n = n < ERR_VALUES ? n : ERR_VALUES;
    if (pass == MOERT_GEMM_WGRAD) return rel_err(dw, dw_ref, n, 1);
    return pass == MOERT_GEMM_FORWARD ? rel_err(r->y[v], r->y[ref], n, 0) : rel_err(r->dx[v], r->dx[ref], n, 0);
}

int main(int argc, char **argv)
{
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        fprintf(stderr, "fp8_gemm_bench: no CUDA device\n");
        return 77;
    }
    struct cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    if (prop.major < 9) {
        fprintf(stderr, "fp8_gemm_bench: %s has no FP8 tensor cores (compute capability %d.%d)\n", prop.name,
                prop.major, prop.minor);
        return 77;
    }
    const char *out_path = argc > 1 ? argv[1] : NULL;
    const char *only = getenv("MOERT_BENCH_ONLY");
    int repeats = getenv("MOERT_BENCH_REPEATS") ? atoi(getenv("MOERT_BENCH_REPEATS")) : 10;
    if (repeats < 1) repeats = 1;
    const int tokens = getenv("MOERT_BENCH_TOKENS") ? atoi(getenv("MOERT_BENCH_TOKENS")) : 0;
    if (tokens > 0) route_tokens = tokens;
    int streams = getenv("MOERT_BENCH_STREAMS") ? atoi(getenv("MOERT_BENCH_STREAMS")) : 4;
    if (streams < 1 || streams > MOERT_FP8_CUDA_MAX_STREAMS) streams = 4;
    const int warmup = 3;
    cudaStream_t stream;
    CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cudaEvent_t ev0, ev1;
    CK(cudaEventCreate(&ev0));
    CK(cudaEventCreate(&ev1));
    printf("device: %s, %d SMs; median of %d after %d warm-up calls; %d streams\n", prop.name, prop.multiProcessorCount,
           repeats, warmup, streams);
    /* how the blockwise kernel runs (MOERT_BENCH_BLOCK sets it, for A/B runs) */
    moert_fp8_block_tuning block_tuning;
    block_tuning_from_env(&block_tuning);
    char block_kernel_mode[384] = "unavailable";
    moert_fp8_block_ctx *probe = NULL;
    if (moert_fp8_block_ctx_create(&bench_host, &probe) == MOERT_OK) {
        MOK(moert_fp8_block_ctx_tune(probe, &block_tuning));
        moert_fp8_block_ctx_describe(probe, block_kernel_mode, sizeof block_kernel_mode);
        moert_fp8_block_ctx_destroy(probe);
    }
    printf("blockwise kernel: %s\n", block_kernel_mode);
    static const char *const pass_names[3] = {"fwd", "dgrad", "wgrad"};

    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const bench_shape *s = &shapes[si];
        if (only && !strstr(s->name, only)) continue;
        const int64_t K = s->k_in, N = s->n_out, E = s->experts;
        int64_t counts[MAX_EXPERTS];
        const uint64_t keep_rng = rng_state;
        rng_state = 0x5eed0f0e7a11ull; /* the same routing for every shape */
        const int64_t R = route_rows(E, counts);
        rng_state = keep_rng;
        /* the dense ceilings take the rows down to a multiple of 16 (< 0.05% fewer FLOPs than counted), so the
         * blockwise one needs no padded output copy */
        int64_t dense_counts[1] = {R - R % 16}, least = R, most = 0, aligned = 0;
        for (int64_t e = 0; e < E; e++) {
            least = counts[e] < least ? counts[e] : least;
            most = counts[e] > most ? counts[e] : most;
            aligned += counts[e] % 16 == 0;
        }
        printf("%s: %lld rows over %lld experts (%lld to %lld each, %lld a multiple of 16), K %lld, N %lld\n", s->name,
               (long long)R, (long long)E, (long long)least, (long long)most, (long long)aligned, (long long)K,
               (long long)N);
        void *x = random_device(R * K, 0, 1.0), *dy = random_device(R * N, 0, 1.0);
        void *w32 = random_device(E * K * N, 1, 0.05), *w16 = NULL; /* w16: the same (bf16-exact) values */
        CK(cudaMalloc(&w16, (size_t)(E * K * N) * 2 + 256));
        MOK(moert_bf16_cuda_round_to_bf16(&bench_host, stream, E * K * N, w32, w16));
        void *y[V_COUNT] = {0}, *dx[V_COUNT] = {0}, *dw = NULL, *dw_ref = NULL;
        for (int v = 0; v < V_COUNT; v++) {
            CK(cudaMalloc(&y[v], (size_t)(R * N) * 2));
            CK(cudaMalloc(&dx[v], (size_t)(R * K) * 2));
        }
        CK(cudaMalloc(&dw, (size_t)(E * K * N) * 4));
        CK(cudaMemset(dw, 0, (size_t)(E * K * N) * 4));
        CK(cudaMalloc(&dw_ref, (size_t)(E * K * N) * 4));
        CK(cudaMemset(dw_ref, 0, (size_t)(E * K * N) * 4));

        moert_bf16_cuda *bf16 = NULL;
        MOK(moert_bf16_cuda_create(&bench_host, NULL, 0, MOERT_BF16_CUDA_EXPERT_LOOP, &bf16));
        MOK(bf16_device_gemm_prepare(&bench_host)); /* bf16_wgmma's kernels */
        MOK(moert_bf16_cuda_set_streams(bf16, streams));
        int64_t *counts_device = NULL;
        CK(cudaMalloc((void **)&counts_device, (size_t)E * sizeof(int64_t)));
        CK(cudaMemcpy(counts_device, counts, (size_t)E * sizeof(int64_t), cudaMemcpyHostToDevice));
        /* blockwise on moert's wgmma kernel ("gemm": "kernel"), current, dense blockwise (kernel), blockwise on
         * cuBLASLt (the plugin's default) */
        moert_fp8_cuda *fp8[4] = {NULL, NULL, NULL, NULL};
        const moert_device dev0 = {MOERT_DEVICE_CUDA, 0};
        for (int i = 0; i < 4; i++) {
            const moert_fp8_cuda_config cfg = {i == 1 ? MOERT_FP8_CUDA_CURRENT : MOERT_FP8_CUDA_BLOCKWISE,
                                               i == 1, /* current: hybrid (E5M2 gradients); blockwise: E4M3 */
                                               i != 1,
                                               i == 2 ? 1 : E,
                                               1,
                                               0,
                                               0};
            MOK(moert_fp8_cuda_create(&bench_host, dev0, &cfg, &fp8[i]));
            MOK(moert_fp8_cuda_set_streams(fp8[i], i == 2 ? 1 : streams));
            MOK(moert_fp8_cuda_set_block_tuning(fp8[i], &block_tuning));
            if (i == 0 || i == 2) MOK(moert_fp8_cuda_set_block_kernel(fp8[i], 1));
        }
        const shape_run run = {s, K,  N,   E,   R, streams, counts, dense_counts, counts_device,
                               x, dy, w32, w16, y, dx,      bf16,   fp8};
        const double flops = 2.0 * (double)R * (double)K * (double)N;
        for (int pass = 0; pass < 3; pass++) {
            if (!bench_list_names(getenv("MOERT_BENCH_PASSES"), pass_names[pass])) { /* left out: no totals */
                for (int i = 0; i < 4; i++) {
                    if (si < 2) sum_ms[si][i] = NAN;
                    if (pass != MOERT_GEMM_WGRAD) fwd_dgrad_ms[i] = NAN;
                }
                continue;
            }
            float *times[V_COUNT], *qtimes[2];
            for (int v = 0; v < V_COUNT; v++) times[v] = malloc((size_t)repeats * sizeof(float));
            for (int q = 0; q < 2; q++) qtimes[q] = malloc((size_t)repeats * sizeof(float));
            int refused[V_COUNT] = {0}; /* variants whose GEMM the plugin refused (skipped, not measured) */
            for (int it = -warmup; it < repeats; it++)
                for (int v = 0; v < V_COUNT + 2; v++) { /* the variants, then the two quantization-only runs */
                    const int quant_only = v >= V_COUNT;
                    const int var = quant_only ? (v == V_COUNT ? V_FP8_BLOCK : V_FP8_CURRENT) : v;
                    if (!quant_only && (refused[var] || !variant_applies(var, pass) || !variant_selected(var)))
                        continue;
                    CK(cudaEventRecord(ev0, stream));
                    const moert_result grc = launch(&run, stream, var, pass, dw, 0, quant_only);
                    if (grc != MOERT_OK && (variant_is_fp8(var) || var == V_BF16_WGMMA) && !quant_only) {
                        /* refused (e.g. no cuBLASLt matmul, no wgmma engine) */
                        printf("skipped: %s %s %s: %s\n", s->name, pass_names[pass], variant_names[var],
                               bench_host_error);
                        if (skipped_count < MAX_SKIPPED)
                            snprintf(skipped[skipped_count++], sizeof skipped[0], "%s %s %s: %.400s", s->name,
                                     pass_names[pass], variant_names[var], bench_host_error);
                        refused[var] = 1;
                        CK(cudaStreamSynchronize(stream));
                        continue;
                    }
                    MOK(grc);
                    CK(cudaEventRecord(ev1, stream));
                    CK(cudaEventSynchronize(ev1));
                    float ms = 0;
                    CK(cudaEventElapsedTime(&ms, ev0, ev1));
                    if (it >= 0) {
                        if (quant_only)
                            qtimes[v - V_COUNT][it] = ms;
                        else
                            times[v][it] = ms;
                    }
                }
            double med[V_COUNT], qmed[2];
            for (int v = 0; v < V_COUNT; v++)
                med[v] =
                    refused[v] || !variant_applies(v, pass) || !variant_selected(v) ? NAN : median(times[v], repeats);
            for (int q = 0; q < 2; q++) qmed[q] = median(qtimes[q], repeats);
            if (si < 2) {
                add_pass(sum_ms[si], med, qmed[0]);
                if (pass != MOERT_GEMM_WGRAD) add_pass(fwd_dgrad_ms, med, qmed[0]);
                sum_flops[si] += flops;
            }
            for (int v = 0; v < V_COUNT; v++) {
                if (!variant_applies(v, pass) || !variant_selected(v) || result_count == MAX_RESULTS) {
                    free(times[v]);
                    continue;
                }
                bench_result *r = &results[result_count++];
                r->shape = s->name, r->pass = pass_names[pass], r->variant = variant_names[v];
                r->ms = med[v];
                r->tflops = flops / (med[v] * 1e-3) / 1e12;
                r->vs_bf16 = med[v == V_FP8_BLOCK_FIRST || v == V_BF16_FIRST ? V_BF16_FIRST : V_BF16] / med[v];
                r->quant_ms = v == V_FP8_BLOCK ? qmed[0] : v == V_FP8_CURRENT ? qmed[1] : NAN;
                r->rel_err = !refused[v] && variant_is_fp8(v) ? measure_error(&run, stream, v, pass, dw, dw_ref) : NAN;
                r->rows = R, r->experts = v == V_DENSE_BF16 || v == V_DENSE_FP8 ? 1 : E, r->k_in = K, r->n_out = N;
                free(times[v]);
            }
            for (int q = 0; q < 2; q++) free(qtimes[q]);
        }
        /* weight quantization: end_step makes both FP8 layouts of the weight again (after fwd and dgrad used them) */
        for (int i = 0; i < 2; i++) {
            float total = 0;
            for (int it = 0; it < 3; it++) {
                CK(cudaEventRecord(ev0, stream));
                MOK(moert_fp8_cuda_end_step(fp8[i], stream));
                CK(cudaEventRecord(ev1, stream));
                CK(cudaEventSynchronize(ev1));
                float ms = 0;
                CK(cudaEventElapsedTime(&ms, ev0, ev1));
                if (it > 0) total += ms;
            }
            weight_quant_ms[si][i] = total / 2;
        }
        moert_fp8_cuda_stats st;
        moert_fp8_cuda_get_stats(fp8[3], &st);
        printf("%s fp8 blockwise on cuBLASLt: %lld matmuls, %lld heuristic queries, %lld cache hits, %lld exact "
               "fallbacks\n",
               s->name, (long long)st.matmuls, (long long)st.heuristic_queries, (long long)st.cache_hits,
               (long long)st.exact_fallbacks);
        for (int i = 0; i < 4; i++) moert_fp8_cuda_destroy(fp8[i]);
        moert_bf16_cuda_destroy(bf16);
        for (int v = 0; v < V_COUNT; v++) {
            CK(cudaFree(y[v]));
            CK(cudaFree(dx[v]));
        }
        CK(cudaFree(x));
        CK(cudaFree(dy));
        CK(cudaFree(w32));
        CK(cudaFree(w16));
        CK(cudaFree(dw));
        CK(cudaFree(dw_ref));
        CK(cudaFree(counts_device));
    }

    printf("\n%-16s %-6s %-20s %9s %9s %8s %9s %9s\n", "shape", "pass", "variant", "ms", "TFLOP/s", "vs bf16",
           "quant ms", "err/bf16");
    for (int i = 0; i < result_count; i++) {
        const bench_result *r = &results[i];
        if (isnan(r->ms)) {
            printf("%-16s %-6s %-20s   skipped (refused, see above)\n", r->shape, r->pass, r->variant);
            continue;
        }
        printf("%-16s %-6s %-20s %9.3f %9.1f %7.2fx %9.3f %9.4f\n", r->shape, r->pass, r->variant, r->ms, r->tflops,
               r->vs_bf16, r->quant_ms, r->rel_err);
    }
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
        if (!only || strstr(shapes[si].name, only))
            printf("%s weight quantization (both FP8 layouts, once per step): blockwise %.3f ms, current %.3f ms\n",
                   shapes[si].name, weight_quant_ms[si][0], weight_quant_ms[si][1]);
    /* the blockwise recipe over fwd+dgrad+wgrad, per shape and both shapes together, against bf16 */
    double all_ms[4] = {0, 0, 0, 0}, all_flops = 0;
    printf("\n");
    for (size_t si = 0; si < 2; si++) {
        if (only && !strstr(shapes[si].name, only)) continue;
        for (int i = 0; i < 4; i++) all_ms[i] += sum_ms[si][i];
        all_flops += sum_flops[si];
        printf("fp8 blockwise %s fwd+dgrad+wgrad: %.3f ms (%.3f without the activation quantization), %.1f TFLOP/s; "
               "bf16 %.3f ms (cuBLASLt loop %.3f), %.1f TFLOP/s; %.2fx bf16, %.2fx the loop\n",
               shapes[si].name, sum_ms[si][0], sum_ms[si][3], sum_flops[si] / (sum_ms[si][0] * 1e-3) / 1e12,
               sum_ms[si][1], sum_ms[si][2], sum_flops[si] / (sum_ms[si][1] * 1e-3) / 1e12,
               sum_ms[si][1] / sum_ms[si][0], sum_ms[si][2] / sum_ms[si][0]);
    }
    const double all_ratio = all_ms[1] / all_ms[0];
    const double gemm_ratio = all_ms[1] / all_ms[3];
    printf("fp8 blockwise fc1+fc2 fwd+dgrad+wgrad: %.1f TFLOP/s, %.2fx bf16 (%.1f TFLOP/s; %.2fx the cuBLASLt loop; "
           "GEMMs alone %.2fx): target %.1fx %s for the GEMMs alone, %s with the activation quantization\n",
           all_flops / (all_ms[0] * 1e-3) / 1e12, all_ratio, all_flops / (all_ms[1] * 1e-3) / 1e12,
           all_ms[2] / all_ms[0], gemm_ratio, BLOCKWISE_TARGET,
           isnan(gemm_ratio)                ? "not measured (refused, or passes left out)"
           : gemm_ratio >= BLOCKWISE_TARGET ? "met"
                                            : "NOT met",
           isnan(all_ratio)                ? "not measured"
           : all_ratio >= BLOCKWISE_TARGET ? "met"
                                           : "not met");
    const char *shapes_run = only ? only : "fc1+fc2";
    printf("fp8 blockwise %s fwd+dgrad (no wgrad): %.2fx bf16, GEMMs alone %.2fx\n", shapes_run,
           fwd_dgrad_ms[1] / fwd_dgrad_ms[0], fwd_dgrad_ms[1] / fwd_dgrad_ms[3]);

    if (out_path) {
        FILE *f = fopen(out_path, "w");
        if (!f) {
            fprintf(stderr, "fp8_gemm_bench: cannot write %s\n", out_path);
            return 1;
        }
        time_t t = time(NULL);
        char date[32];
        strftime(date, sizeof date, "%Y-%m-%d", gmtime(&t));
        const char *machine = getenv("MOERT_BENCH_MACHINE"), *git = getenv("MOERT_BENCH_GIT");
        fprintf(f, "{\n  \"command\": \"%s %s\",\n", argv[0], out_path);
        fprintf(f, "  \"machine\": \"%s\",\n  \"gpus\": 1,\n  \"device\": \"%s\",\n", machine ? machine : "unknown",
                prop.name);
        fprintf(f, "  \"git\": \"%s\",\n  \"date\": \"%s\",\n  \"repeats\": %d,\n  \"streams\": %d,\n",
                git ? git : "unknown", date, repeats, streams);
        fprintf(f, "  \"block_kernel\": \"%s\",\n", block_kernel_mode);
        fprintf(f, "  \"note\": \"bf16 activations; fp8 variants take fp32 weights (FP8 copies cached per step) and "
                   "include the activation quantization (quant_ms: that alone); bf16 takes bf16 weights; wgrad "
                   "accumulates into fp32 (*_first: overwrites it, the first micro-batch; their vs_bf16 is against "
                   "bf16_first); vs_bf16 > 1 is faster than the bf16 grouped GEMM; rel_err_vs_bf16: first 4M outputs "
                   "against bf16 on the same inputs and weights (dense fp8 against dense bf16; wgrad both "
                   "overwriting), the bench fails above 0.2; dense_* = one GEMM of the same total shape; bf16_wgmma: "
                   "the bf16 device-count kernel on its wgmma engine (fwd, dgrad); the fwd+dgrad+wgrad totals take "
                   "the faster bf16 per pass\",\n");
        fprintf(f, "  \"skipped\": [");
        for (int i = 0; i < skipped_count; i++) {
            fputs(i ? ", \"" : "\"", f);
            for (const char *c = skipped[i]; *c; c++) /* a JSON string: no quotes, backslashes or controls */
                fputc(*c == '"' || *c == '\\' || (unsigned char)*c < 0x20 ? '\'' : *c, f);
            fputc('"', f);
        }
        fprintf(f, "],\n");
        fprintf(f, "  \"results\": [");
        const char *sep = "\n";
        for (int i = 0; i < result_count; i++) {
            const bench_result *r = &results[i];
            if (isnan(r->ms)) continue;                                 /* refused: listed under "skipped" */
            char quant[32] = "null", err[32] = "null", vs[32] = "null"; /* NaN (not run) is null in JSON */
            if (!isnan(r->quant_ms)) snprintf(quant, sizeof quant, "%.5f", r->quant_ms);
            if (!isnan(r->vs_bf16)) snprintf(vs, sizeof vs, "%.4f", r->vs_bf16);
            if (!isnan(r->rel_err)) snprintf(err, sizeof err, "%.6f", r->rel_err);
            fprintf(
                f,
                "%s    {\"name\": \"fp8 gemm %s %s %s\", \"value\": %.4f, \"unit\": \"TFLOP/s\", \"median_ms\": %.5f, "
                "\"vs_bf16\": %s, \"quant_ms\": %s, \"rel_err_vs_bf16\": %s, "
                "\"config\": {\"rows\": %lld, \"experts\": %lld, \"k_in\": %lld, \"n_out\": %lld, \"pass\": \"%s\", "
                "\"variant\": \"%s\"}}",
                sep, r->shape, r->pass, r->variant, r->tflops, r->ms, vs, quant, err, (long long)r->rows,
                (long long)r->experts, (long long)r->k_in, (long long)r->n_out, r->pass, r->variant);
            sep = ",\n";
        }
        for (size_t si = 0; si < 3; si++) { /* blockwise fwd+dgrad+wgrad: each shape, then both */
            if (si < 2 && only && !strstr(shapes[si].name, only)) continue;
            const double ms = si < 2 ? sum_ms[si][0] : all_ms[0], bf = si < 2 ? sum_ms[si][1] : all_ms[1];
            const double loop = si < 2 ? sum_ms[si][2] : all_ms[2], gemm = si < 2 ? sum_ms[si][3] : all_ms[3];
            const double fl = si < 2 ? sum_flops[si] : all_flops;
            if (isnan(ms) || isnan(bf) || isnan(loop) || !(ms > 0)) continue; /* refused, or not run */
            fprintf(f,
                    "%s    {\"name\": \"fp8 gemm %s fwd+dgrad+wgrad fp8_blockwise\", \"value\": %.4f, "
                    "\"unit\": \"TFLOP/s\", \"sum_of_median_ms\": %.5f, \"vs_bf16\": %.4f, \"bf16_tflops\": %.4f, "
                    "\"vs_bf16_cublaslt_loop\": %.4f, \"gemm_alone_ms\": %.5f, \"gemm_alone_vs_bf16\": %.4f, "
                    "\"target_vs_bf16\": %.2f, \"config\": {\"routing\": \"uniform top-%d of %d, %d tokens x %d "
                    "ranks, rank 0's %lld experts\"}}",
                    sep, si < 2 ? shapes[si].name : "deepseek-v3 fc1+fc2", fl / (ms * 1e-3) / 1e12, ms, bf / ms,
                    fl / (bf * 1e-3) / 1e12, loop / ms, gemm, bf / gemm, BLOCKWISE_TARGET, ROUTE_TOPK, ROUTE_EXPERTS,
                    route_tokens, ROUTE_RANKS, (long long)shapes[0].experts);
            sep = ",\n";
        }
        if (fwd_dgrad_ms[0] > 0 && !isnan(fwd_dgrad_ms[1])) { /* refused or not run: no row */
            fprintf(f,
                    "%s    {\"name\": \"fp8 gemm fwd+dgrad fp8_blockwise\", \"value\": %.4f, \"unit\": \"x bf16\", "
                    "\"sum_of_median_ms\": %.5f, \"bf16_ms\": %.5f, \"gemm_alone_ms\": %.5f, "
                    "\"gemm_alone_vs_bf16\": %.4f, \"config\": {\"shapes\": \"%s\"}}",
                    sep, fwd_dgrad_ms[1] / fwd_dgrad_ms[0], fwd_dgrad_ms[0], fwd_dgrad_ms[1], fwd_dgrad_ms[3],
                    fwd_dgrad_ms[1] / fwd_dgrad_ms[3], shapes_run);
            sep = ",\n";
        }
        for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
            if (only && !strstr(shapes[si].name, only)) continue;
            for (int i = 0; i < 2; i++) {
                fprintf(f,
                        "%s    {\"name\": \"fp8 weight quantization %s %s\", \"value\": %.5f, \"unit\": \"ms\", "
                        "\"config\": {\"experts\": %lld, \"k_in\": %lld, \"n_out\": %lld, \"layouts\": 2}}",
                        sep, shapes[si].name, i ? "current" : "blockwise", weight_quant_ms[si][i],
                        (long long)shapes[si].experts, (long long)shapes[si].k_in, (long long)shapes[si].n_out);
                sep = ",\n";
            }
        }
        fprintf(f, "\n  ]\n}\n");
        fclose(f);
        printf("wrote %s\n", out_path);
    }
    /* an FP8 variant that is not within MAX_REL_ERR of bf16 computes something else: fail */
    int bad = 0;
    for (int i = 0; i < result_count; i++) {
        const bench_result *r = &results[i];
        if (isnan(r->ms) || !strstr(r->variant, "fp8")) continue;
        if (!(r->rel_err <= MAX_REL_ERR)) {
            fprintf(stderr,
                    "fp8_gemm_bench: FAIL: %s %s %s: relative error against bf16 %.4g, above %.2f (or not "
                    "measured): the FP8 GEMM does not compute what bf16 does\n",
                    r->shape, r->pass, r->variant, r->rel_err, MAX_REL_ERR);
            bad++;
        }
    }
    if (bad) return 1;
    printf("every FP8 variant within %.2f of bf16 (relative Frobenius error)\n", MAX_REL_ERR);
    return 0;
}
