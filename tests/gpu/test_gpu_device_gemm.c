/* SPDX-License-Identifier: Apache-2.0 */
/* GPU test of the bf16 grouped GEMM kernel that reads the counts on the device (plugins/lib/device_gemm.cu):
 * - the kernel directly against the CPU reference (plugins/lib/grouped_gemm_cpu.c, bf16 mode), with both tile widths (128 and
 *   256 output columns): FORWARD, DGRAD, WGRAD into fp32
 *   accumulating and overwriting (and into bf16), with empty experts, odd counts (1, 17, 129, ...), one hot expert,
 *   no rows at all and counts that sum past the capacity (the kernel drops the rows past it); K_in 64..256, N_out
 *   64..384 (multiples of 8, not of 128). Rows past the sum must stay as they were (their inputs are NaN: a read shows);
 *   WGRAD: an empty expert's slice zero (overwrite) or unchanged (accumulate), bit for bit. Two cases have >= 2048
 *   rows an expert, so the wgmma WGRAD runs its cooperative schedule there and its ping-pong in the others.
 * - one big case (8 experts of ~512 rows, K 7168, N 4096) against the cuBLASLt path (precision_bf16_cuda.cu) on
 *   every element and against double-precision dot products on sampled elements.
 * - CUDA graph capture: FORWARD, DGRAD and WGRAD captured once, replayed with other counts written into the same
 *   device buffer, each replay against the CPU.
 * - the fp32 -> bf16 conversion of the weight copies on each of its paths, bit for bit against the host's rounding.
 * - the wgmma engine's persistent grid capped at a few CTAs (max_sms), every pass and WGRAD schedule: bit for bit the
 *   whole grid's output.
 * - the plugin with "gemm": "kernel" on a CUDA rank's host: flags (graph-capturable, no host sync), every pass with the
 *   counts on the device only against the CPU plugin, a grouped_gemm call captured into a graph, and refusals (fp32
 *   storage, sizes not multiples of 8, a bad value).
 * Tolerances as tests/gpu/test_gpu_fp8.c: relative Frobenius 1e-3 for fp32 outputs, 4e-3 for bf16 ones (one bf16
 * rounding apart). Prints a table last. Exits 77 without a GPU (or one without bf16 tensor cores). */
#include "test_util.h"

#ifndef MOERT_HAVE_CUDA

int main(void)
{
    printf("gpu_device_gemm: built without CUDA, skipped\n");
    return TEST_SKIP;
}

#else

#include <cuda_runtime_api.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <unistd.h>

#include "cuda/device.h"
#include "cuda/pool.h"
#include "device_gemm.h"
#include "gpu_test_util.h"
#include "moert/precision.h"
#include "grouped_gemm_cpu.h"
#include "precision_bf16_cuda.h"

#define MAX_E    16
#define PAD_ROWS 5    /* rows past the counts: NaN inputs, outputs never written */
#define TOL      1e-3 /* fp32 outputs: accumulation order only */
#define TOL_BF16 4e-3 /* bf16 outputs: one bf16 rounding (2^-8) apart at most, see test_gpu_fp8.c */
#define BF16_NAN 0x7fc0

static const char *const pass_names[3] = {"forward", "dgrad", "wgrad"};

/* ---- the result table ---- */

typedef struct row {
    char what[96];
    double err, tol;
    int64_t diffs; /* values that must be bit-exact and are not (-1: not counted) */
} row;

static row table[512];
static int table_len;

/* Records one check: err <= tol and no differing values. */
static void record(const char *what, double err, double tol, int64_t diffs)
{
    if (table_len < (int)(sizeof table / sizeof table[0])) {
        row *r = &table[table_len++];
        snprintf(r->what, sizeof r->what, "%s", what);
        r->err = err;
        r->tol = tol;
        r->diffs = diffs;
    }
    if (!(err <= tol) || diffs > 0) {
        fprintf(stderr, "FAIL %s: error %.3g (tolerance %.3g), %lld differ\n", what, err, tol, (long long)diffs);
        test_failures++;
    }
}

/* ---- host and device buffers ---- */

static void *xalloc(size_t bytes)
{
    void *p = calloc(1, bytes + 64);
    if (!p) {
        fprintf(stderr, "out of host memory (%zu bytes)\n", bytes);
        exit(1);
    }
    return p;
}

static void from_device(void *host, const void *d, size_t bytes)
{
    CK(cudaDeviceSynchronize());
    if (bytes) CK(cudaMemcpy(host, d, bytes, cudaMemcpyDeviceToHost));
}

/* ||got - want|| / ||want|| over n values of dtype (NaN if got has a NaN). */
static double rel_error(const void *got, const void *want, moert_dtype dtype, int64_t n)
{
    moert_tensor g = moert_tensor_1d((void *)got, moert_cpu(), dtype, n);
    moert_tensor w = moert_tensor_1d((void *)want, moert_cpu(), dtype, n);
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        const double a = moert_load(&g, i), b = moert_load(&w, i);
        num += (a - b) * (a - b);
        den += b * b;
    }
    if (num != num) return NAN;
    if (den == 0) return num == 0 ? 0 : INFINITY;
    return sqrt(num / den);
}

/* Bytes of [from, to) that are not `byte`. */
static int64_t bytes_not(const void *p, size_t from, size_t to, unsigned char byte)
{
    int64_t bad = 0;
    for (size_t i = from; i < to; i++) bad += ((const unsigned char *)p)[i] != byte;
    return bad;
}

/* ---- one grouped GEMM problem ---- */

/* The operands of one call: bf16 activations (rows past the counts NaN), bf16 weights, an fp32 gradient with old values. */
typedef struct problem {
    int E;
    int64_t K, N, cap;             /* cap: rows of the activations */
    int64_t counts[MAX_E];         /* what the device gets */
    int64_t eff[MAX_E];            /* the rows each expert really has (counts clamped to cap) */
    int64_t total;                 /* sum of eff */
    uint16_t *input, *grad_output; /* [cap, K], [cap, N] */
    uint16_t *weight;              /* [E, K, N] */
    float *grad_weight;            /* [E, K, N] old values */
    void *d_input, *d_grad_output, *d_weight, *d_counts;
} problem;

static void problem_make(problem *p, int E, int64_t K, int64_t N, const int64_t *counts, int64_t cap, uint64_t seed)
{
    memset(p, 0, sizeof *p);
    p->E = E, p->K = K, p->N = N;
    int64_t sum = 0;
    for (int e = 0; e < E; e++) sum += p->counts[e] = counts[e];
    p->cap = cap > 0 ? cap : sum + PAD_ROWS;
    int64_t at = 0;
    for (int e = 0; e < E; e++) {
        const int64_t first = at < p->cap ? at : p->cap, end = at + counts[e] < p->cap ? at + counts[e] : p->cap;
        p->eff[e] = end - first;
        p->total += p->eff[e];
        at += counts[e];
    }
    uint64_t rng = seed;
    p->input = xalloc((size_t)(p->cap * K) * 2);
    p->grad_output = xalloc((size_t)(p->cap * N) * 2);
    p->weight = xalloc((size_t)(E * K * N) * 2);
    p->grad_weight = xalloc((size_t)(E * K * N) * 4);
    for (int64_t i = 0; i < p->cap * K; i++)
        p->input[i] = i < p->total * K ? moert_bf16_from_float((float)test_uniform(&rng)) : BF16_NAN;
    for (int64_t i = 0; i < p->cap * N; i++)
        p->grad_output[i] = i < p->total * N ? moert_bf16_from_float((float)test_uniform(&rng)) : BF16_NAN;
    for (int64_t i = 0; i < E * K * N; i++) {
        p->weight[i] = moert_bf16_from_float((float)(0.1 * test_uniform(&rng)));
        p->grad_weight[i] = (float)test_uniform(&rng);
    }
    p->d_input = gpu_upload_new(p->input, (size_t)(p->cap * K) * 2);
    p->d_grad_output = gpu_upload_new(p->grad_output, (size_t)(p->cap * N) * 2);
    p->d_weight = gpu_upload_new(p->weight, (size_t)(E * K * N) * 2);
    p->d_counts = gpu_upload_new(p->counts, (size_t)E * 8);
}

static void problem_free(problem *p)
{
    free(p->input), free(p->grad_output), free(p->weight), free(p->grad_weight);
    CK(cudaFree(p->d_input));
    CK(cudaFree(p->d_grad_output));
    CK(cudaFree(p->d_weight));
    CK(cudaFree(p->d_counts));
}

/* Elements and dtype of a pass's result. */
static int64_t out_elems(const problem *p, int pass, bool bf16_grad, moert_dtype *dt)
{
    *dt = pass == MOERT_GEMM_WGRAD && !bf16_grad ? MOERT_F32 : MOERT_BF16;
    return pass == MOERT_GEMM_FORWARD ? p->cap * p->N : pass == MOERT_GEMM_DGRAD ? p->cap * p->K : p->E * p->K * p->N;
}

/* The starting content of a pass's result buffer: 0xFF bytes for FORWARD/DGRAD (rows past the sum must keep them),
 * the old gradient for WGRAD (fp32, or rounded to bf16). */
static void *out_initial(const problem *p, int pass, bool bf16_grad)
{
    moert_dtype dt;
    const int64_t n = out_elems(p, pass, bf16_grad, &dt);
    void *out = xalloc((size_t)n * moert_dtype_size(dt));
    if (pass != MOERT_GEMM_WGRAD) {
        memset(out, 0xFF, (size_t)n * 2);
    } else if (bf16_grad) {
        for (int64_t i = 0; i < n; i++) ((uint16_t *)out)[i] = moert_bf16_from_float(p->grad_weight[i]);
    } else {
        memcpy(out, p->grad_weight, (size_t)n * 4);
    }
    return out;
}

/* The CPU reference of one pass (bf16 mode; counts as the kernel sees them after clamping). */
static void *cpu_pass(const problem *p, int pass, bool overwrite, bool bf16_grad)
{
    const int64_t K = p->K, N = p->N;
    moert_tensor tin = moert_tensor_2d(p->input, moert_cpu(), MOERT_BF16, p->cap, K);
    moert_tensor tgo = moert_tensor_2d(p->grad_output, moert_cpu(), MOERT_BF16, p->cap, N);
    moert_tensor tw = moert_tensor_3d(p->weight, moert_cpu(), MOERT_BF16, p->E, K, N);
    void *out = out_initial(p, pass, bf16_grad);
    moert_tensor tout = moert_tensor_2d(out, moert_cpu(), MOERT_BF16, p->cap, pass == MOERT_GEMM_FORWARD ? N : K);
    moert_tensor tgw = moert_tensor_3d(out, moert_cpu(), bf16_grad ? MOERT_BF16 : MOERT_F32, p->E, K, N);
    moert_grouped_gemm_args a = {.struct_size = sizeof a,
                                 .which = MOERT_GEMM_FC1,
                                 .pass = (moert_gemm_pass)pass,
                                 .tokens_per_expert_host = p->eff,
                                 .input = &tin,
                                 .weight = &tw,
                                 .grad_output = &tgo,
                                 .output = &tout,
                                 .grad_input = &tout,
                                 .grad_weight = &tgw,
                                 .overwrite_grad_weight = overwrite};
    const bf16_gemm_shape shape = {p->E, K, N, p->eff};
    bf16_scratch scratch = {0};
    if (bf16_cpu_grouped_gemm(&a, &shape, BF16_MODE_BF16, &scratch) != MOERT_OK) {
        fprintf(stderr, "cpu reference: out of memory\n");
        exit(1);
    }
    bf16_scratch_free(&scratch);
    return out;
}

/* The output tile width and engine the kernel calls of the test ask for (0: the kernel picks), and the cluster and
 * schedule of the wgmma WGRAD (0: as it picks; clusters of 4, 2, 1 where the tiles allow). */
static int tile_n, engine, cluster, schedule;

/* The kernel's arguments for one pass into device buffer d_out. */
static bf16_device_gemm_args kernel_args(const problem *p, int pass, void *d_out, bool overwrite, bool bf16_grad)
{
    bf16_device_gemm_args a;
    memset(&a, 0, sizeof a);
    a.pass = (moert_gemm_pass)pass;
    a.num_experts = p->E;
    a.counts_device = p->d_counts;
    a.capacity = p->cap;
    a.k_in = p->K;
    a.n_out = p->N;
    a.input = p->d_input;
    a.weight = p->d_weight;
    a.grad_output = p->d_grad_output;
    a.output = d_out;
    a.grad_input = d_out;
    a.grad_weight = d_out;
    a.grad_weight_bf16 = bf16_grad;
    a.accumulate = !overwrite;
    a.tile_n = tile_n;
    a.engine = engine;
    a.wgrad_cluster = cluster;
    a.wgrad_schedule = schedule;
    return a;
}

/*
 * Compares a pass's GPU result with the CPU's: the rows of the sum (or every gradient) within tolerance, and bit for
 * bit what must not change: rows past the sum (0xFF bytes), an empty expert's gradient (zeros when overwriting, the
 * old values when accumulating).
 */
static void compare(const char *what, const problem *p, int pass, bool overwrite, bool bf16_grad, const void *got,
                    const void *want)
{
    moert_dtype dt;
    const int64_t n = out_elems(p, pass, bf16_grad, &dt);
    const size_t es = moert_dtype_size(dt);
    int64_t diffs = 0;
    double err;
    if (pass == MOERT_GEMM_WGRAD) {
        err = rel_error(got, want, dt, n);
        const int64_t slice = p->K * p->N;
        for (int e = 0; e < p->E; e++) {
            if (p->eff[e]) continue;
            const unsigned char *g = (const unsigned char *)got + (size_t)(e * slice) * es;
            const unsigned char *w = (const unsigned char *)want + (size_t)(e * slice) * es;
            if (overwrite)
                diffs += bytes_not(g, 0, (size_t)slice * es, 0);
            else
                diffs += memcmp(g, w, (size_t)slice * es) != 0 ? 1 : 0;
        }
    } else {
        const int64_t cols = pass == MOERT_GEMM_FORWARD ? p->N : p->K;
        err = rel_error(got, want, dt, p->total * cols);
        diffs += bytes_not(got, (size_t)(p->total * cols) * 2, (size_t)n * 2, 0xFF);
    }
    record(what, err, dt == MOERT_BF16 ? TOL_BF16 : TOL, diffs);
}

/* Runs one pass on the kernel, its persistent grid at most max_sms CTAs (0: one per SM), into a fresh device copy of
 * the initial result; returns the result on the host. */
static void *gpu_pass_capped(const problem *p, int pass, bool overwrite, bool bf16_grad, int max_sms,
                             cudaStream_t stream)
{
    moert_dtype dt;
    const int64_t n = out_elems(p, pass, bf16_grad, &dt);
    const size_t bytes = (size_t)n * moert_dtype_size(dt);
    void *out = out_initial(p, pass, bf16_grad);
    void *d_out = gpu_upload_new(out, bytes);
    bf16_device_gemm_args a = kernel_args(p, pass, d_out, overwrite, bf16_grad);
    a.max_sms = max_sms;
    if (bf16_device_gemm(&gpu_test_host, stream, &a) != MOERT_OK) {
        fprintf(stderr, "bf16_device_gemm %s (at most %d CTAs) failed: %s\n", pass_names[pass], max_sms,
                gpu_test_error);
        test_failures++;
    }
    CK(cudaStreamSynchronize(stream));
    from_device(out, d_out, bytes);
    CK(cudaFree(d_out));
    return out;
}

static void *gpu_pass(const problem *p, int pass, bool overwrite, bool bf16_grad, cudaStream_t stream)
{
    return gpu_pass_capped(p, pass, overwrite, bf16_grad, 0, stream);
}

/* ---- the kernel against the CPU ---- */

typedef struct small_case {
    const char *name;
    int E;
    int64_t K, N;
    int64_t counts[MAX_E];
    int64_t cap; /* 0: the sum + PAD_ROWS */
} small_case;

/* The engine and tile width of the calls, as the table shows them. */
static const char *engine_label(void)
{
    static const char *const pingpong[] = {"wgmma", "wgmma cl1", "wgmma cl2", "wgmma", "wgmma cl4"};
    if (engine == BF16_DEVICE_GEMM_ENGINE_WGMMA)
        return schedule == BF16_WGMMA_WGRAD_COOPERATIVE ? "wgmma coop" : pingpong[cluster];
    return tile_n == 128 ? "n128" : tile_n == 256 ? "n256" : "auto";
}

static void run_small(const small_case *sc, cudaStream_t stream, uint64_t seed)
{
    problem p;
    problem_make(&p, sc->E, sc->K, sc->N, sc->counts, sc->cap, seed);
    /* pass, overwrite, bf16 gradient */
    static const int runs[][3] = {{0, 0, 0}, {1, 0, 0}, {2, 0, 0}, {2, 1, 0}, {2, 0, 1}};
    for (size_t i = 0; i < sizeof runs / sizeof runs[0]; i++) {
        const int pass = runs[i][0];
        const bool overwrite = runs[i][1], bf16_grad = runs[i][2];
        void *want = cpu_pass(&p, pass, overwrite, bf16_grad);
        void *got = gpu_pass(&p, pass, overwrite, bf16_grad, stream);
        char what[80];
        snprintf(what, sizeof what, "%s %s %s%s%s", engine_label(), sc->name, pass_names[pass],
                 pass == 2 ? (overwrite ? " overwrite" : " accumulate") : "", bf16_grad ? " bf16" : "");
        compare(what, &p, pass, overwrite, bf16_grad, got, want);
        free(got), free(want);
    }
    problem_free(&p);
}

/* ---- the big case: against cuBLASLt, and sampled elements against double dot products ---- */

/* One output element of a pass in double, from the bf16 operands (expert e, its first row r0). */
static double dot(const problem *p, int pass, int e, int64_t r0, int64_t i, int64_t j)
{
    const int64_t K = p->K, N = p->N;
    const uint16_t *w = p->weight + (size_t)e * K * N;
    double s = 0;
    if (pass == MOERT_GEMM_FORWARD) /* out[i][j] = sum_k in[i][k] W[k][j] */
        for (int64_t k = 0; k < K; k++)
            s += (double)moert_bf16_to_float(p->input[i * K + k]) * moert_bf16_to_float(w[k * N + j]);
    else if (pass == MOERT_GEMM_DGRAD) /* din[i][j] = sum_n dout[i][n] W[j][n] */
        for (int64_t n = 0; n < N; n++)
            s += (double)moert_bf16_to_float(p->grad_output[i * N + n]) * moert_bf16_to_float(w[j * N + n]);
    else /* dW[e][i][j] = sum_r in[r][i] dout[r][j] */
        for (int64_t r = r0; r < r0 + p->eff[e]; r++)
            s += (double)moert_bf16_to_float(p->input[r * K + i]) * moert_bf16_to_float(p->grad_output[r * N + j]);
    return s;
}

static void run_big(cudaStream_t stream)
{
    const int E = 8;
    const int64_t K = 7168, N = 4096;
    const int64_t counts[8] = {512, 509, 517, 0, 640, 383, 1, 512};
    problem p;
    problem_make(&p, E, K, N, counts, 0, 4242);
    moert_bf16_cuda *lt = NULL;
    if (moert_bf16_cuda_create(&gpu_test_host, NULL, 0, MOERT_BF16_CUDA_EXPERT_LOOP, &lt) != MOERT_OK) {
        fprintf(stderr, "cuBLASLt handle: %s\n", gpu_test_error);
        test_failures++;
        problem_free(&p);
        return;
    }
    int64_t first[8];
    for (int e = 0, at = 0; e < E; e++) first[e] = at, at += (int)p.eff[e]; /* a few thousand rows */
    uint64_t rng = 77;
    for (int pass = 0; pass < 3; pass++) {
        moert_dtype dt;
        const int64_t n = out_elems(&p, pass, false, &dt);
        const size_t bytes = (size_t)n * moert_dtype_size(dt);
        void *got = gpu_pass(&p, pass, true, false, stream);
        /* cuBLASLt on the same operands (WGRAD overwriting an fp32 gradient) */
        void *want = out_initial(&p, pass, false);
        void *d_ref = gpu_upload_new(want, bytes);
        moert_bf16_cuda_gemm gm = {.pass = (moert_gemm_pass)pass,
                                   .dtype = MOERT_BF16,
                                   .num_experts = E,
                                   .rows_per_expert = p.eff,
                                   .k_in = K,
                                   .n_out = N,
                                   .input = p.d_input,
                                   .weight = p.d_weight,
                                   .grad_output = p.d_grad_output,
                                   .output = d_ref,
                                   .grad_input = d_ref,
                                   .grad_weight = d_ref,
                                   .accumulate = 0,
                                   .output_fp32 = pass == MOERT_GEMM_WGRAD};
        if (moert_bf16_cuda_grouped_gemm(lt, stream, &gm) != MOERT_OK) {
            fprintf(stderr, "cuBLASLt %s: %s\n", pass_names[pass], gpu_test_error);
            test_failures++;
        }
        CK(cudaStreamSynchronize(stream));
        from_device(want, d_ref, bytes);
        CK(cudaFree(d_ref));
        char what[80];
        snprintf(what, sizeof what, "big 8x[~512] K7168 N4096 %s vs cuBLASLt", pass_names[pass]);
        compare(what, &p, pass, true, false, got, want);
        if (pass == MOERT_GEMM_WGRAD) { /* the cooperative schedule (auto takes the ping-pong at ~512 rows) */
            schedule = BF16_WGMMA_WGRAD_COOPERATIVE;
            void *coop = gpu_pass(&p, pass, true, false, stream);
            schedule = 0;
            compare("big 8x[~512] K7168 N4096 wgrad coop vs cuBLASLt", &p, pass, true, false, coop, want);
            free(coop);
        }
        /* sampled elements against double dot products */
        double num = 0, den = 0;
        for (int s = 0; s < 256; s++) {
            int e;
            do e = (int)((test_uniform(&rng) + 1) * 0.5 * E) % E;
            while (p.eff[e] == 0);
            int64_t i, j;
            double v;
            if (pass == MOERT_GEMM_WGRAD) {
                i = (int64_t)((test_uniform(&rng) + 1) * 0.5 * K) % K;
                j = (int64_t)((test_uniform(&rng) + 1) * 0.5 * N) % N;
                v = ((const float *)got)[(size_t)e * K * N + i * N + j];
            } else {
                const int64_t cols = pass == MOERT_GEMM_FORWARD ? N : K;
                i = first[e] + (int64_t)((test_uniform(&rng) + 1) * 0.5 * p.eff[e]) % p.eff[e];
                j = (int64_t)((test_uniform(&rng) + 1) * 0.5 * cols) % cols;
                v = moert_bf16_to_float(((const uint16_t *)got)[i * cols + j]);
            }
            const double ref = dot(&p, pass, e, first[e], i, j);
            num += (v - ref) * (v - ref);
            den += ref * ref;
        }
        snprintf(what, sizeof what, "big %s, 256 sampled elements vs double", pass_names[pass]);
        record(what, den > 0 ? sqrt(num / den) : INFINITY, dt == MOERT_BF16 ? TOL_BF16 : TOL, 0);
        free(got), free(want);
    }
    moert_bf16_cuda_destroy(lt);
    problem_free(&p);
}

/* ---- handing units out (work_counter) and leaving SMs (sm_yield) ---- */

/* FORWARD and DGRAD with the units handed out through a counter and sm_yield at 0 (every CTA works), at 100 (all but
 * the first 32 CTAs of an H100's 132 stop at once), at the whole grid (only CTA 0 works), and set to 100 and back to 0 by copies on
 * another stream while the GEMM runs (CTAs stop, the others go on): bit for bit the static schedule's output,
 * twice in a row on one counter pair, which each launch leaves zero. */
static void run_yield(cudaStream_t stream)
{
    const int E = 8;
    const int64_t K = 1024, N = 2048;
    const int64_t counts[8] = {512, 509, 517, 0, 640, 383, 1, 512};
    problem p;
    problem_make(&p, E, K, N, counts, 0, 31);
    int32_t *d_yield = NULL, *d_counter = NULL;
    CK(cudaMalloc((void **)&d_yield, sizeof(int32_t)));
    CK(cudaMalloc((void **)&d_counter, 2 * sizeof(int32_t)));
    CK(cudaMemset(d_counter, 0, 2 * sizeof(int32_t)));
    cudaStream_t side = NULL;
    CK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
    int32_t *h_words = NULL; /* pinned: 100 and 0, copied into the word while the GEMM runs */
    CK(cudaMallocHost((void **)&h_words, 2 * sizeof(int32_t)));
    h_words[0] = 100;
    h_words[1] = 0;
    for (int pass = 0; pass < 2; pass++) {
        moert_dtype dt;
        const size_t bytes = (size_t)out_elems(&p, pass, false, &dt) * 2;
        void *want = gpu_pass(&p, pass, true, false, stream);
        static const int32_t yields[] = {0, 100, 1 << 20, -1}; /* -1: 100, then 0, while it runs */
        for (size_t y = 0; y < sizeof yields / sizeof yields[0]; y++) {
            const bool toggled = yields[y] < 0;
            const int32_t word = toggled ? 0 : yields[y];
            CK(cudaMemcpy(d_yield, &word, sizeof(int32_t), cudaMemcpyHostToDevice));
            int64_t diffs = 0;
            for (int rep = 0; rep < 2; rep++) {
                void *d_out = NULL;
                CK(cudaMalloc(&d_out, bytes));
                CK(cudaMemset(d_out, 0xFF, bytes));
                bf16_device_gemm_args a = kernel_args(&p, pass, d_out, true, false);
                a.engine = BF16_DEVICE_GEMM_ENGINE_WGMMA;
                a.sm_yield = d_yield;
                a.work_counter = d_counter;
                if (bf16_device_gemm(&gpu_test_host, stream, &a) != MOERT_OK) {
                    fprintf(stderr, "bf16_device_gemm with sm_yield: %s\n", gpu_test_error);
                    test_failures++;
                }
                if (toggled) {
                    CK(cudaMemcpyAsync(d_yield, &h_words[0], sizeof(int32_t), cudaMemcpyHostToDevice, side));
                    usleep(30);
                    CK(cudaMemcpyAsync(d_yield, &h_words[1], sizeof(int32_t), cudaMemcpyHostToDevice, side));
                    CK(cudaStreamSynchronize(side));
                }
                CK(cudaStreamSynchronize(stream));
                void *got = xalloc(bytes);
                from_device(got, d_out, bytes);
                CK(cudaFree(d_out));
                diffs += memcmp(got, want, bytes) != 0;
                free(got);
                int32_t counter[2];
                CK(cudaMemcpy(counter, d_counter, sizeof counter, cudaMemcpyDeviceToHost));
                for (int w = 0; w < 2; w++) diffs += counter[w] != 0;
            }
            char what[96];
            if (toggled)
                snprintf(what, sizeof what,
                         "units handed out, sm_yield 100 then 0 meanwhile, %s: as the static schedule",
                         pass_names[pass]);
            else
                snprintf(what, sizeof what, "units handed out, sm_yield %d, %s: as the static schedule", (int)yields[y],
                         pass_names[pass]);
            record(what, 0, 0, diffs);
        }
        free(want);
    }
    /* sm_yield without a counter is refused */
    bf16_device_gemm_args a = kernel_args(&p, 0, p.d_grad_output, true, false);
    a.sm_yield = d_yield;
    gpu_test_error[0] = 0;
    const bool refused = bf16_device_gemm(&gpu_test_host, stream, &a) == MOERT_ERR_INVALID_ARGUMENT &&
                         strstr(gpu_test_error, "work_counter");
    record("refused: sm_yield without work_counter", refused ? 0 : 1, 0, 0);
    CK(cudaFree(d_yield));
    CK(cudaFree(d_counter));
    CK(cudaFreeHost(h_words));
    CK(cudaStreamDestroy(side));
    problem_free(&p);
}

/* ---- a persistent grid of fewer CTAs (max_sms: "gemm_sms", "wgrad_sms") ---- */

/* Every pass on the wgmma engine with its grid capped at 5 and at 24 CTAs (an odd count, not a whole number of the
 * WGRAD's clusters, and the dispatcher's usual share), the WGRAD on each schedule and cluster size: bit for bit the
 * output of the whole grid, since a tile is computed the same whichever CTA takes it. */
static void run_grid_caps(cudaStream_t stream)
{
    const int E = 6;
    const int64_t K = 512, N = 768;
    const int64_t counts[6] = {512, 0, 333, 129, 700, 64};
    problem p;
    problem_make(&p, E, K, N, counts, 0, 47);
    /* pass, overwrite, WGRAD cluster, WGRAD schedule */
    static const int runs[][4] = {{0, 1, 0, 0}, {1, 1, 0, 0}, {2, 1, 0, 0}, {2, 0, 0, 0},
                                  {2, 0, 4, 0}, {2, 1, 2, 0}, {2, 0, 1, 0}, {2, 1, 0, BF16_WGMMA_WGRAD_COOPERATIVE}};
    for (size_t r = 0; r < sizeof runs / sizeof runs[0]; r++) {
        const int pass = runs[r][0];
        const bool overwrite = runs[r][1];
        engine = BF16_DEVICE_GEMM_ENGINE_WGMMA, cluster = runs[r][2], schedule = runs[r][3];
        moert_dtype dt;
        const size_t bytes = (size_t)out_elems(&p, pass, false, &dt) * moert_dtype_size(dt);
        void *want = gpu_pass(&p, pass, overwrite, false, stream);
        static const int caps[] = {5, 24};
        for (size_t c = 0; c < sizeof caps / sizeof caps[0]; c++) {
            void *out = gpu_pass_capped(&p, pass, overwrite, false, caps[c], stream);
            char what[96];
            snprintf(what, sizeof what, "%s grid of %d CTAs, %s%s: as the whole grid", engine_label(), caps[c],
                     pass_names[pass], pass == 2 ? (overwrite ? " overwrite" : " accumulate") : "");
            record(what, 0, 0, memcmp(out, want, bytes) != 0);
            free(out);
        }
        free(want);
    }
    engine = BF16_DEVICE_GEMM_ENGINE_AUTO, cluster = 0, schedule = 0;
    problem_free(&p);
}

/* ---- fp32 -> bf16 (the bf16 copy of fp32 weights) ---- */

/* moert_bf16_cuda_round_to_bf16 on each of its paths (four elements a thread or one: by the count and the pointers'
 * alignment) against the host's round-to-nearest-even, bit for bit: random bit patterns, exact ties, values
 * rounding to infinity, subnormals; NaN stays NaN (its payload is not compared). */
static void run_round_to_bf16(cudaStream_t stream)
{
    const int64_t max_n = 4100;
    float *src = xalloc((size_t)max_n * sizeof(float));
    uint64_t rng = 77;
    for (int64_t i = 0; i < max_n; i++) {
        uint32_t bits = (uint32_t)(test_uniform(&rng) * 4294967296.0);
        if (i % 7 == 0) bits = (bits & 0xffff0000u) | 0x8000u; /* an exact tie */
        if (i % 11 == 0) bits &= 0x807fffffu;                  /* subnormal */
        if (i == 5) bits = 0x7f7fffffu;                        /* rounds to infinity */
        if (i == 6) bits = 0x7fc00001u;                        /* NaN */
        memcpy(&src[i], &bits, 4);
    }
    float *d_src = NULL;
    uint16_t *d_dst = NULL;
    CK(cudaMalloc((void **)&d_src, (size_t)max_n * sizeof(float)));
    CK(cudaMalloc((void **)&d_dst, (size_t)(max_n + 8) * sizeof(uint16_t)));
    CK(cudaMemcpy(d_src, src, (size_t)max_n * sizeof(float), cudaMemcpyHostToDevice));
    /* n and the destination's offset in elements: 4 per thread (n % 4 == 0, aligned), 1 (a destination 2 bytes off,
     * or odd n) */
    static const struct {
        int64_t n, dst_offset;
        const char *path;
    } cases[] = {{4096, 0, "4 a thread"},
                 {4100, 0, "4 a thread"},
                 {4096, 1, "1 a thread, dst 2 bytes off"},
                 {4099, 0, "1 a thread"}};
    uint16_t *got = xalloc((size_t)max_n * sizeof(uint16_t));
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const int64_t n = cases[c].n;
        uint16_t *dst = d_dst + cases[c].dst_offset;
        if (moert_bf16_cuda_round_to_bf16(&gpu_test_host, stream, n, d_src, dst) != MOERT_OK) {
            fprintf(stderr, "round_to_bf16: %s\n", gpu_test_error);
            test_failures++;
        }
        CK(cudaStreamSynchronize(stream));
        CK(cudaMemcpy(got, dst, (size_t)n * sizeof(uint16_t), cudaMemcpyDeviceToHost));
        int64_t diffs = 0;
        for (int64_t i = 0; i < n; i++) {
            const uint16_t want = moert_bf16_from_float(src[i]);
            const bool want_nan = (want & 0x7fffu) > 0x7f80u, got_nan = (got[i] & 0x7fffu) > 0x7f80u;
            diffs += want_nan ? !got_nan : got[i] != want;
        }
        char what[96];
        snprintf(what, sizeof what, "round_to_bf16 %lld values, %s: as the host's", (long long)n, cases[c].path);
        record(what, 0, 0, diffs);
    }
    free(got);
    free(src);
    CK(cudaFree(d_src));
    CK(cudaFree(d_dst));
}

/* ---- CUDA graph capture: the three passes captured once, replayed with other counts ---- */

static void run_graph(cudaStream_t stream)
{
    const int E = 4;
    const int64_t K = 128, N = 192, cap = 320;
    const int64_t counts_a[4] = {17, 0, 129, 100}, counts_b[4] = {0, 250, 1, 33};
    problem p;
    problem_make(&p, E, K, N, counts_a, cap, 9);
    /* the inputs hold data in every row so that both count vectors find numbers (rows past each sum are not read) */
    uint64_t rng = 10;
    for (int64_t i = 0; i < cap * K; i++) p.input[i] = moert_bf16_from_float((float)test_uniform(&rng));
    for (int64_t i = 0; i < cap * N; i++) p.grad_output[i] = moert_bf16_from_float((float)test_uniform(&rng));
    CK(cudaMemcpy(p.d_input, p.input, (size_t)(cap * K) * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(p.d_grad_output, p.grad_output, (size_t)(cap * N) * 2, cudaMemcpyHostToDevice));
    void *d_out[3];
    size_t bytes[3];
    for (int pass = 0; pass < 3; pass++) {
        moert_dtype dt;
        bytes[pass] = (size_t)out_elems(&p, pass, false, &dt) * moert_dtype_size(dt);
        CK(cudaMalloc(&d_out[pass], bytes[pass]));
    }
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    CK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    bool ok = true;
    for (int pass = 0; pass < 3 && ok; pass++) {
        const bf16_device_gemm_args a = kernel_args(&p, pass, d_out[pass], pass == MOERT_GEMM_WGRAD, false);
        ok = bf16_device_gemm(&gpu_test_host, stream, &a) == MOERT_OK;
        if (!ok) fprintf(stderr, "captured %s: %s\n", pass_names[pass], gpu_test_error);
    }
    const cudaError_t end = cudaStreamEndCapture(stream, &graph);
    record("graph: the three passes captured", ok && end == cudaSuccess ? 0 : 1, 0, 0);
    if (!ok || end != cudaSuccess) {
        fprintf(stderr, "cudaStreamEndCapture: %s\n", cudaGetErrorString(end));
        (void)cudaGetLastError();
    } else {
        CK(cudaGraphInstantiate(&exec, graph, 0));
        for (int replay = 0; replay < 2; replay++) {
            const int64_t *counts = replay == 0 ? counts_a : counts_b;
            memcpy(p.counts, counts, sizeof counts_a);
            p.total = 0;
            for (int e = 0; e < E; e++) p.total += p.eff[e] = counts[e];
            CK(cudaMemcpy(p.d_counts, counts, sizeof counts_a, cudaMemcpyHostToDevice));
            for (int pass = 0; pass < 3; pass++) {
                void *init = out_initial(&p, pass, false);
                CK(cudaMemcpy(d_out[pass], init, bytes[pass], cudaMemcpyHostToDevice));
                free(init);
            }
            CK(cudaDeviceSynchronize()); /* the uploads above landed (see gpu_upload) */
            CK(cudaGraphLaunch(exec, stream));
            CK(cudaStreamSynchronize(stream));
            for (int pass = 0; pass < 3; pass++) {
                void *got = xalloc(bytes[pass]);
                from_device(got, d_out[pass], bytes[pass]);
                void *want = cpu_pass(&p, pass, pass == MOERT_GEMM_WGRAD, false);
                char what[80];
                snprintf(what, sizeof what, "graph replay %d (counts %s) %s", replay + 1,
                         replay == 0 ? "17,0,129,100" : "0,250,1,33", pass_names[pass]);
                compare(what, &p, pass, pass == MOERT_GEMM_WGRAD, false, got, want);
                free(got), free(want);
            }
        }
        CK(cudaGraphExecDestroy(exec));
        CK(cudaGraphDestroy(graph));
    }
    for (int pass = 0; pass < 3; pass++) CK(cudaFree(d_out[pass]));
    problem_free(&p);
}

/* Arguments the kernel refuses, each with a message naming what was expected. */
static void run_bad_args(cudaStream_t stream)
{
    problem p;
    const int64_t counts[2] = {3, 4};
    problem_make(&p, 2, 64, 64, counts, 0, 5);
    struct {
        const char *what, *needle;
        int64_t K, N, E;
        int misalign, tile, schedule;
    } cases[] = {{"k_in 60", "multiples of 8", 60, 64, 2, 0, 0, 0},
                 {"n_out 100", "multiples of 8", 64, 100, 2, 0, 0, 0},
                 {"0 experts", "local experts", 64, 64, 0, 0, 0, 0},
                 {"misaligned input", "16-byte aligned", 64, 64, 2, 1, 0, 0},
                 {"tile_n 64", "tile_n", 64, 64, 2, 0, 64, 0},
                 {"wgrad_schedule 3", "wgrad_schedule 3, expected", 64, 64, 2, 0, 0, 3}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        bf16_device_gemm_args a = kernel_args(&p, MOERT_GEMM_FORWARD, p.d_grad_output, false, false);
        a.k_in = cases[i].K, a.n_out = cases[i].N, a.num_experts = cases[i].E;
        if (cases[i].misalign) a.input = (const char *)p.d_input + 2;
        a.tile_n = cases[i].tile;
        a.wgrad_schedule = cases[i].schedule;
        gpu_test_error[0] = 0;
        const moert_result r = bf16_device_gemm(&gpu_test_host, stream, &a);
        const bool ok = r == MOERT_ERR_INVALID_ARGUMENT && strstr(gpu_test_error, cases[i].needle);
        char what[80];
        snprintf(what, sizeof what, "refused: %s", cases[i].what);
        record(what, ok ? 0 : 1, 0, 0);
        if (!ok) fprintf(stderr, "%s: got %s \"%s\"\n", what, moert_result_name(r), gpu_test_error);
    }
    problem_free(&p);
}

/* ---- the plugin with "gemm": "kernel" on a CUDA rank's host ---- */

#define PE 4 /* experts of the plugin cases */

/* One plugin call (CPU tensors, or device copies with the counts on the device only); the result on the host.
 * Weights fp32 (the executor's parameters); WGRAD into fp32 gradients holding old values. capture: the call is made
 * inside a CUDA graph capture of the stream, and the graph launched. */
static void *plugin_pass(test_instance *ti, bool on_gpu, cudaStream_t stream, const problem *p, const float *weight,
                         void *dev_weight, moert_gemm_weight which, int pass, bool overwrite, bool capture)
{
    const moert_precision_v1 *vt = (const moert_precision_v1 *)ti->plugin.header;
    const moert_device dev = on_gpu ? (moert_device){MOERT_DEVICE_CUDA, 0} : moert_cpu();
    const int64_t K = p->K, N = p->N;
    const size_t w_b = (size_t)(PE * K * N) * 4;
    const int64_t cols = pass == MOERT_GEMM_FORWARD ? N : K;
    const size_t out_b = pass == MOERT_GEMM_WGRAD ? w_b : (size_t)(p->cap * cols) * 2;
    void *out = xalloc(out_b);
    if (pass == MOERT_GEMM_WGRAD)
        memcpy(out, p->grad_weight, w_b);
    else
        memset(out, 0xFF, out_b);
    void *input = on_gpu ? p->d_input : p->input;
    void *grad_output = on_gpu ? p->d_grad_output : p->grad_output;
    void *w = on_gpu ? dev_weight : (void *)weight;
    void *counts = on_gpu ? p->d_counts : (void *)p->counts;
    void *result = on_gpu ? gpu_upload_new(out, out_b) : out;
    moert_tensor tin = moert_tensor_2d(input, dev, MOERT_BF16, p->cap, K);
    moert_tensor tgo = moert_tensor_2d(grad_output, dev, MOERT_BF16, p->cap, N);
    moert_tensor tw = moert_tensor_3d(w, dev, MOERT_F32, PE, K, N);
    moert_tensor tc = moert_tensor_1d(counts, dev, MOERT_I64, PE);
    moert_tensor tout = moert_tensor_2d(result, dev, MOERT_BF16, p->cap, cols);
    moert_tensor tgw = moert_tensor_3d(result, dev, MOERT_F32, PE, K, N);
    moert_grouped_gemm_args a = {.struct_size = sizeof a,
                                 .which = which,
                                 .pass = (moert_gemm_pass)pass,
                                 .tokens_per_expert = &tc,
                                 .tokens_per_expert_host = on_gpu ? NULL : p->counts,
                                 .overwrite_grad_weight = overwrite};
    switch (pass) {
    case MOERT_GEMM_FORWARD: a.input = &tin, a.weight = &tw, a.output = &tout; break;
    case MOERT_GEMM_DGRAD: a.grad_output = &tgo, a.weight = &tw, a.grad_input = &tout; break;
    default: a.input = &tin, a.grad_output = &tgo, a.grad_weight = &tgw; break;
    }
    cudaGraph_t graph = NULL;
    if (capture) CK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    moert_result r = vt->grouped_gemm(ti->ctx, on_gpu ? (moert_stream)stream : NULL, &a);
    if (capture) {
        const cudaError_t end = cudaStreamEndCapture(stream, &graph);
        if (r == MOERT_OK && end != cudaSuccess) {
            fprintf(stderr, "plugin call under capture: cudaStreamEndCapture: %s\n", cudaGetErrorString(end));
            (void)cudaGetLastError();
            r = MOERT_ERR_CUDA;
        }
    }
    if (r != MOERT_OK) {
        fprintf(stderr, "plugin grouped_gemm (%s, fc%d %s%s) failed: %s\n", on_gpu ? "cuda" : "cpu", which + 1,
                pass_names[pass], capture ? ", captured" : "", moert_host_take_error(ti->host));
        test_failures++;
        free(out);
        out = NULL;
    } else if (capture) {
        cudaGraphExec_t exec = NULL;
        CK(cudaGraphInstantiate(&exec, graph, 0));
        CK(cudaGraphLaunch(exec, stream));
        CK(cudaStreamSynchronize(stream));
        CK(cudaGraphExecDestroy(exec));
    }
    if (graph) CK(cudaGraphDestroy(graph));
    if (on_gpu) {
        CK(cudaStreamSynchronize(stream));
        if (out) from_device(out, result, out_b);
        CK(cudaFree(result));
    }
    return out;
}

static void run_plugin(moert_cuda_pool *pool, cudaStream_t stream)
{
    const int64_t H = 256, F = 192;
    moert_layer_info layer = test_layer(H, F, PE, 2, 512, 1, 0, MOERT_BF16);
    moert_layer_info gpu_layer = layer;
    gpu_layer.device = (moert_device){MOERT_DEVICE_CUDA, 0};
    test_instance cpu, gpu;
    memset(&cpu, 0, sizeof cpu);
    memset(&gpu, 0, sizeof gpu);
    if (test_instance_open(&cpu, MOERT_KIND_PRECISION, "bf16", "{}", &layer, NULL, 0, 1) != MOERT_OK ||
        test_instance_open_cuda(&gpu, MOERT_KIND_PRECISION, "bf16", "{\"gemm\": \"kernel\"}", &gpu_layer, NULL, 0, 1,
                                pool, NULL, (moert_stream)stream) != MOERT_OK) {
        fprintf(stderr, "opening the plugin: %s\n", moert_error_message());
        test_failures++;
        test_instance_close(&cpu);
        test_instance_close(&gpu);
        return;
    }
    const uint32_t flags = moert_host_instance_flags(gpu.host, gpu.plugin.header->flags);
    record("plugin kernel: flags capturable, overwrite, no host sync",
           (flags & MOERT_CAP_GRAPH_CAPTURABLE) && (flags & MOERT_CAP_WGRAD_OVERWRITE) &&
                   !(flags & MOERT_CAP_NEEDS_HOST_SYNC)
               ? 0
               : 1,
           0, 0);
    const int64_t counts[PE] = {90, 0, 37, 129};
    for (int w = 0; w < 2; w++) {
        const int64_t K = w == 0 ? H : F, N = w == 0 ? 2 * F : H;
        problem p;
        problem_make(&p, PE, K, N, counts, 0, 31 + (uint64_t)w);
        float *weight = xalloc((size_t)(PE * K * N) * 4);
        uint64_t rng = 55 + (uint64_t)w;
        for (int64_t i = 0; i < PE * K * N; i++) weight[i] = (float)(0.05 * test_uniform(&rng));
        void *d_weight = gpu_upload_new(weight, (size_t)(PE * K * N) * 4);
        /* pass, overwrite, captured */
        static const int runs[][3] = {{0, 0, 0}, {1, 0, 0}, {2, 0, 0}, {2, 1, 0}, {0, 0, 1}, {2, 1, 1}};
        for (size_t i = 0; i < sizeof runs / sizeof runs[0]; i++) {
            const int pass = runs[i][0];
            const bool overwrite = runs[i][1], capture = runs[i][2];
            void *want =
                plugin_pass(&cpu, false, stream, &p, weight, NULL, (moert_gemm_weight)w, pass, overwrite, false);
            void *got =
                plugin_pass(&gpu, true, stream, &p, weight, d_weight, (moert_gemm_weight)w, pass, overwrite, capture);
            char what[80];
            snprintf(what, sizeof what, "plugin kernel fc%d %s%s%s (device counts)", w + 1, pass_names[pass],
                     pass == 2 ? (overwrite ? " overwrite" : " accumulate") : "", capture ? " captured" : "");
            if (got && want)
                compare(what, &p, pass, overwrite, false, got, want);
            else
                record(what, INFINITY, 0, 0);
            free(got), free(want);
        }
        free(weight);
        CK(cudaFree(d_weight));
        problem_free(&p);
    }
    test_instance_close(&cpu);
    test_instance_close(&gpu);
}

/* Configurations "gemm": "kernel" refuses at init, with a message naming the option and why. */
static void run_refusals(moert_cuda_pool *pool, cudaStream_t stream)
{
    struct {
        int64_t hidden, ffn;
        moert_dtype dtype;
        const char *options;
        moert_result code;
        const char *needle, *path; /* the option's path: the plugin names $.precision, the test's host $.test */
    } cases[] = {
        {256, 128, MOERT_F32, "{\"gemm\": \"kernel\"}", MOERT_ERR_UNSUPPORTED, "needs bf16 storage",
         "$.precision.gemm"},
        {260, 128, MOERT_BF16, "{\"gemm\": \"kernel\"}", MOERT_ERR_UNSUPPORTED, "multiples of 8", "$.precision.gemm"},
        {256, 128, MOERT_BF16, "{\"gemm\": \"fast\"}", MOERT_ERR_CONFIG, "kernel", "$.test.gemm"}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        moert_layer_info layer = test_layer(cases[i].hidden, cases[i].ffn, PE, 2, 64, 1, 0, cases[i].dtype);
        layer.device = (moert_device){MOERT_DEVICE_CUDA, 0};
        test_instance ti;
        memset(&ti, 0, sizeof ti);
        const moert_result r = test_instance_open_cuda(&ti, MOERT_KIND_PRECISION, "bf16", cases[i].options, &layer,
                                                       NULL, 0, 1, pool, NULL, (moert_stream)stream);
        const char *msg = moert_error_message();
        const bool ok = r == cases[i].code && strstr(msg, cases[i].needle) && strstr(msg, cases[i].path);
        char what[80];
        snprintf(what, sizeof what, "plugin refused: %s, %s, hidden %lld", cases[i].options,
                 moert_dtype_name(cases[i].dtype), (long long)cases[i].hidden);
        record(what, ok ? 0 : 1, 0, 0);
        if (!ok) fprintf(stderr, "%s: got %s \"%s\"\n", what, moert_result_name(r), msg);
        test_instance_close(&ti);
    }
}

int main(void)
{
    int gpus = 0;
    cudaError_t err = cudaGetDeviceCount(&gpus);
    if (err != cudaSuccess || gpus == 0) {
        printf("gpu_device_gemm: no GPU (%s), skipped\n", err != cudaSuccess ? cudaGetErrorString(err) : "0 devices");
        return TEST_SKIP;
    }
    struct cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    if (prop.major < 9) { /* the kernels are built for sm_90 */
        printf("gpu_device_gemm: %s (compute capability %d.%d) is not sm_90, skipped\n", prop.name, prop.major,
               prop.minor);
        return TEST_SKIP;
    }
    printf("gpu_device_gemm: %s\n", prop.name);
    CK(cudaSetDevice(0));
    cudaStream_t raw_stream;
    CK(cudaStreamCreateWithFlags(&raw_stream, cudaStreamNonBlocking));
    if (bf16_device_gemm_prepare(&gpu_test_host) != MOERT_OK) {
        fprintf(stderr, "bf16_device_gemm_prepare: %s\n", gpu_test_error);
        return 1;
    }
    static const small_case cases[] = {
        {"E4 K64 N64 0,1,17,129", 4, 64, 64, {0, 1, 17, 129}, 0},
        {"E5 K136 N384 129,0,0,3,64", 5, 136, 384, {129, 0, 0, 3, 64}, 0},
        {"E3 K256 N200 1,255,31", 3, 256, 200, {1, 255, 31}, 0},
        {"E8 K128 N96 hot expert 600", 8, 128, 96, {0, 0, 0, 600, 0, 0, 0, 0}, 0},
        {"E4 K72 N136 no rows", 4, 72, 136, {0, 0, 0, 0}, 0},
        {"E3 K64 N72 past capacity 200,100,7 cap 250", 3, 64, 72, {200, 100, 7}, 250},
        {"E16 K192 N64 odd", 16, 192, 64, {1, 3, 0, 5, 7, 9, 11, 13, 15, 17, 0, 19, 21, 23, 127, 129}, 0},
        /* the wgmma WGRAD's clusters: k_in and n_out tiles of 128 pairing up both ways (2 x 2; above, K136 N200 and
         * K256 N200 too), n_out tiles only (K72 N136 above, K320 N520 neither) */
        {"E5 K136 N256 129,0,0,3,64", 5, 136, 256, {129, 0, 0, 3, 64}, 0},
        {"E3 K320 N520 1,700,31", 3, 320, 520, {1, 700, 31}, 0},
        {"E4 K256 N512 0,1,300,77", 4, 256, 512, {0, 1, 300, 77}, 0},
        /* >= 2048 rows an expert on average: the wgmma WGRAD's cooperative schedule (fewer: its ping-pong) */
        {"E2 K136 N200 many rows 3000,1500", 2, 136, 200, {3000, 1500}, 0},
        {"E2 K64 N264 many rows 4100,0", 2, 64, 264, {4100, 0}, 0},
    };
    /* every case on mma.sync with both tile widths, and on the wgmma engine where the GPU has it (sm_90): its WGRAD
     * as it picks, in clusters of 4 and of 2 where the tiles allow, and single; then each case's WGRAD on the
     * cooperative schedule (auto takes it only from 2048 rows an expert) */
    enum { MMA = BF16_DEVICE_GEMM_ENGINE_MMA, WGMMA = BF16_DEVICE_GEMM_ENGINE_WGMMA };
    enum { COOP = BF16_WGMMA_WGRAD_COOPERATIVE };
    static const int configs[][4] = {{128, MMA, 0, 0}, {256, MMA, 0, 0}, {0, WGMMA, 0, 0},   {0, WGMMA, 4, 0},
                                     {0, WGMMA, 2, 0}, {0, WGMMA, 1, 0}, {0, WGMMA, 0, COOP}};
    const bool hopper = prop.major == 9 && prop.minor == 0;
    for (size_t c = 0; c < sizeof configs / sizeof configs[0]; c++) {
        tile_n = configs[c][0], engine = configs[c][1], cluster = configs[c][2], schedule = configs[c][3];
        if (engine == BF16_DEVICE_GEMM_ENGINE_WGMMA && !hopper) continue;
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) run_small(&cases[i], raw_stream, 100 + i);
    }
    tile_n = 0, engine = BF16_DEVICE_GEMM_ENGINE_AUTO, cluster = 0, schedule = 0;
    run_bad_args(raw_stream);
    run_graph(raw_stream);
    run_round_to_bf16(raw_stream);
    if (hopper) run_yield(raw_stream);
    if (hopper) run_grid_caps(raw_stream);
    run_big(raw_stream);
    CK(cudaStreamDestroy(raw_stream));

    /* through the plugin, on a CUDA rank's host */
    moert_plugin keep;
    memset(&keep, 0, sizeof keep);
    EXPECT_OK(moert_plugin_load(MOERT_KIND_PRECISION, "bf16", &keep));
    moert_cuda_pool *pool = NULL;
    moert_stream stream = NULL;
    if (moert_cuda_set_device(0) != MOERT_OK || moert_cuda_pool_create(0, &pool) != MOERT_OK ||
        moert_cuda_stream_create(0, &stream) != MOERT_OK) {
        fprintf(stderr, "setting up cuda:0: %s\n", moert_error_message());
        test_failures++;
    } else {
        run_plugin(pool, (cudaStream_t)stream);
        run_refusals(pool, (cudaStream_t)stream);
    }
    if (stream) moert_cuda_stream_synchronize(stream);
    if (pool) moert_cuda_pool_destroy(pool);
    if (stream) moert_cuda_stream_destroy(stream);
    moert_plugin_unload(&keep);

    printf("\nbf16 device-count grouped GEMM kernel vs references (err: relative Frobenius; diffs: values that must be "
           "bit-exact)\n");
    printf("%-70s  %9s  %9s  %6s  %s\n", "check", "error", "tolerance", "diffs", "ok");
    for (int i = 0; i < table_len; i++) {
        const row *r = &table[i];
        printf("%-70s  %9.2e  %9.2e  %6lld  %s\n", r->what, r->err, r->tol, (long long)r->diffs,
               r->err <= r->tol && r->diffs <= 0 ? "ok" : "FAIL");
    }
    return test_finish("gpu_device_gemm");
}

#endif
