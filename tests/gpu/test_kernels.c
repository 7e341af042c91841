/* SPDX-License-Identifier: Apache-2.0 */
/* GPU test of moert's CUDA kernels against plain CPU loops in double: the grouped expert GEMMs
 * (cuBLASLt loop and grouped mode), SwiGLU x prob, the element-wise helpers, the trainer's loss and Adam, the
 * all-to-all dispatcher's layout / permute / combine / regroup kernels and the router. Awkward sizes throughout: empty experts,
 * one hot expert, rows and widths that are not multiples of 8, misaligned pointers. Outputs are poisoned
 * (NaN bytes) before each run so an unwritten element fails. Prints a table last. Exits 77 without a GPU. */
#include "test_util.h"
#include "moert/moert.h"

#ifndef MOERT_HAVE_CUDA

int main(void)
{
    printf("kernels: built without CUDA, skipped\n");
    return TEST_SKIP;
}

#else

#include <cuda_runtime_api.h>
#include <stdarg.h>
#include <stdint.h>

#include "cuda/device.h"
#include "cuda/kernels.h"
#include "cuda_ops.h" /* the trainer's loss and optimizer kernels (harness/) */
#include "dispatch_alltoall_cuda.h"
#include "error.h"
#include "precision_bf16_cuda.h"
#include "router_cuda.h"

/* ---- plumbing: checked CUDA calls, a host table for the plugins' error messages, the result table ---- */

#define CK(call)                                                                                                       \
    do {                                                                                                               \
        cudaError_t e_ = (call);                                                                                       \
        if (e_ != cudaSuccess) {                                                                                       \
            fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));              \
            exit(1);                                                                                                   \
        }                                                                                                              \
    } while (0)

/* A moert call that must succeed (plugin kernels report through the test host, core ones via moert_error). */
#define OK(call)                                                                                                       \
    do {                                                                                                               \
        moert_result r_ = (call);                                                                                      \
        if (r_ != MOERT_OK) {                                                                                          \
            fprintf(stderr, "%s:%d: %s failed (%s): %s%s\n", __FILE__, __LINE__, #call, moert_result_name(r_),         \
                    host_error, moert_error_message());                                                                \
            test_failures++;                                                                                           \
        }                                                                                                              \
    } while (0)

static char host_error[1024];

static void test_host_log(const moert_host *h, moert_log_level level, const char *fmt, ...)
{
    (void)h;
    (void)level;
    (void)fmt;
}

static void test_host_set_error(const moert_host *h, const char *fmt, ...)
{
    (void)h;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(host_error, sizeof host_error, fmt, ap);
    va_end(ap);
}

static moert_host test_host = {
    .struct_size = sizeof(moert_host), .log = test_host_log, .set_error = test_host_set_error};

typedef struct table_row {
    char what[48];
    char size[64];
    double err, tol;
    int ok;
} table_row;

static table_row table[400];
static int table_len;

/* One line of the final table; err <= tol (and not NaN) passes. */
static void record(const char *what, double err, double tol, const char *size_fmt, ...)
{
    table_row *r = &table[table_len < 400 ? table_len++ : 399];
    snprintf(r->what, sizeof r->what, "%s", what);
    va_list ap;
    va_start(ap, size_fmt);
    vsnprintf(r->size, sizeof r->size, size_fmt, ap);
    va_end(ap);
    r->err = err;
    r->tol = tol;
    r->ok = err <= tol; /* false for NaN */
    if (!r->ok) {
        fprintf(stderr, "FAIL %s %s: error %.3g > tolerance %.3g\n", r->what, r->size, err, tol);
        test_failures++;
    }
}

static uint64_t rng = 12345;
static double uniform(void) { return test_uniform(&rng); } /* [-1, 1) */

/* Device buffer filled with 0xFF bytes: NaN as fp32 and bf16, -1 as integers. */
static void *dalloc(size_t bytes)
{
    void *p = NULL;
    CK(cudaMalloc(&p, bytes ? bytes : 16));
    CK(cudaMemset(p, 0xFF, bytes ? bytes : 16));
    return p;
}

static double round_to(double v, moert_dtype t)
{
    return t == MOERT_BF16 ? moert_bf16_to_float(moert_bf16_from_float((float)v)) : (double)(float)v;
}

/* Uploads n values as dtype (fp32 or bf16) into a new device buffer with `pad` extra poisoned elements. */
static void *upload(const double *v, int64_t n, moert_dtype t, int64_t pad)
{
    size_t es = moert_dtype_size(t);
    void *h = malloc((size_t)(n + pad) * es + 1);
    moert_tensor ht = moert_tensor_1d(h, moert_cpu(), t, n + pad);
    for (int64_t i = 0; i < n; i++) moert_store(&ht, i, v[i]);
    memset((char *)h + n * es, 0xFF, (size_t)pad * es);
    void *d = dalloc((size_t)(n + pad) * es);
    CK(cudaMemcpy(d, h, (size_t)(n + pad) * es, cudaMemcpyHostToDevice));
    free(h);
    return d;
}

/* Downloads n values of dtype into doubles. */
static void download(double *out, const void *d, int64_t n, moert_dtype t)
{
    size_t es = moert_dtype_size(t);
    void *h = malloc((size_t)n * es + 1);
    CK(cudaMemcpy(h, d, (size_t)n * es, cudaMemcpyDeviceToHost));
    moert_tensor ht = moert_tensor_1d(h, moert_cpu(), t, n);
    for (int64_t i = 0; i < n; i++) out[i] = moert_load(&ht, i);
    free(h);
}

/* Random values rounded to dtype (so the CPU reference sees exactly what the GPU reads). */
static double *random_values(int64_t n, moert_dtype t, double scale)
{
    double *v = malloc((size_t)(n ? n : 1) * sizeof(double));
    for (int64_t i = 0; i < n; i++) v[i] = round_to(uniform() * scale, t);
    return v;
}

/* ||a - b|| / ||b||, NaN if a has a NaN (an unwritten element); 0 for two empty vectors. */
static double rel_error(const double *a, const double *b, int64_t n)
{
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        if (isnan(a[i])) return NAN;
        num += (a[i] - b[i]) * (a[i] - b[i]);
        den += b[i] * b[i];
    }
    if (den == 0) return sqrt(num);
    return sqrt(num / den);
}

static double tol_for(moert_dtype t) { return t == MOERT_BF16 ? 1e-2 : 1e-5; }

/* ---- grouped GEMM ---- */

typedef struct gemm_case {
    const char *name;
    int64_t experts, k_in, n_out;
    int64_t counts[8];
} gemm_case;

/* Checks FORWARD, DGRAD and WGRAD (accumulate and overwrite) of one case in one dtype and mode. */
static void check_gemm_case(moert_bf16_cuda *g, const gemm_case *c, moert_dtype t, moert_bf16_cuda_mode mode)
{
    OK(moert_bf16_cuda_set_mode(g, mode));
    const char *mode_name = mode == MOERT_BF16_CUDA_GROUPED ? "grouped" : "loop";
    const int64_t E = c->experts, K = c->k_in, N = c->n_out, pad = 3;
    int64_t rows = 0, offsets[8];
    for (int64_t e = 0; e < E; e++) {
        offsets[e] = rows;
        rows += c->counts[e];
    }
    double *x = random_values(rows * K, t, 1.0), *w = random_values(E * K * N, t, 0.2);
    double *dy = random_values(rows * N, t, 1.0), *dw0 = random_values(E * K * N, t, 0.5);
    void *dx_in = upload(x, rows * K, t, pad * K), *dw = upload(w, E * K * N, t, 0);
    void *ddy = upload(dy, rows * N, t, pad * N);
    double *ref = calloc((size_t)((rows + pad) * (K > N ? K : N) + E * K * N), sizeof(double));
    double *got = calloc((size_t)((rows + pad) * (K > N ? K : N) + E * K * N), sizeof(double));
    moert_bf16_cuda_gemm gm = {.dtype = t, .num_experts = E, .rows_per_expert = c->counts, .k_in = K, .n_out = N};

    /* FORWARD into a poisoned output with pad rows that must stay poisoned */
    void *dout = dalloc((size_t)(rows + pad) * N * moert_dtype_size(t));
    gm.pass = MOERT_GEMM_FORWARD;
    gm.input = dx_in;
    gm.weight = dw;
    gm.output = dout;
    OK(moert_bf16_cuda_grouped_gemm(g, NULL, &gm));
    CK(cudaDeviceSynchronize());
    download(got, dout, (rows + pad) * N, t);
    for (int64_t e = 0; e < E; e++)
        for (int64_t r = offsets[e]; r < offsets[e] + c->counts[e]; r++)
            for (int64_t n = 0; n < N; n++) {
                double s = 0;
                for (int64_t k = 0; k < K; k++) s += x[r * K + k] * w[(e * K + k) * N + n];
                ref[r * N + n] = s;
            }
    int untouched = 1;
    for (int64_t i = rows * N; i < (rows + pad) * N; i++) untouched &= isnan(got[i]);
    record("gemm forward", rel_error(got, ref, rows * N), tol_for(t), "%s %s %s", c->name, moert_dtype_name(t),
           mode_name);
    record("gemm pad rows untouched", untouched ? 0 : 1, 0, "%s %s %s", c->name, moert_dtype_name(t), mode_name);

    /* DGRAD */
    void *ddx = dalloc((size_t)(rows + pad) * K * moert_dtype_size(t));
    gm.pass = MOERT_GEMM_DGRAD;
    gm.grad_output = ddy;
    gm.grad_input = ddx;
    OK(moert_bf16_cuda_grouped_gemm(g, NULL, &gm));
    CK(cudaDeviceSynchronize());
    download(got, ddx, rows * K, t);
    for (int64_t e = 0; e < E; e++)
        for (int64_t r = offsets[e]; r < offsets[e] + c->counts[e]; r++)
            for (int64_t k = 0; k < K; k++) {
                double s = 0;
                for (int64_t n = 0; n < N; n++) s += dy[r * N + n] * w[(e * K + k) * N + n];
                ref[r * K + k] = s;
            }
    record("gemm dgrad", rel_error(got, ref, rows * K), tol_for(t), "%s %s %s", c->name, moert_dtype_name(t),
           mode_name);

    /* WGRAD accumulating into random values, then overwriting a poisoned buffer (empty experts -> 0) */
    for (int accumulate = 1; accumulate >= 0; accumulate--) {
        void *ddw = accumulate ? upload(dw0, E * K * N, t, 0) : dalloc((size_t)(E * K * N) * moert_dtype_size(t));
        gm.pass = MOERT_GEMM_WGRAD;
        gm.grad_weight = ddw;
        gm.accumulate = accumulate;
        OK(moert_bf16_cuda_grouped_gemm(g, NULL, &gm));
        CK(cudaDeviceSynchronize());
        download(got, ddw, E * K * N, t);
        for (int64_t e = 0; e < E; e++)
            for (int64_t k = 0; k < K; k++)
                for (int64_t n = 0; n < N; n++) {
                    double s = accumulate ? dw0[(e * K + k) * N + n] : 0.0;
                    for (int64_t r = offsets[e]; r < offsets[e] + c->counts[e]; r++) s += x[r * K + k] * dy[r * N + n];
                    ref[(e * K + k) * N + n] = s;
                }
        record(accumulate ? "gemm wgrad +=" : "gemm wgrad =", rel_error(got, ref, E * K * N), tol_for(t), "%s %s %s",
               c->name, moert_dtype_name(t), mode_name);
        CK(cudaFree(ddw));
    }
    CK(cudaFree(dx_in));
    CK(cudaFree(dw));
    CK(cudaFree(ddy));
    CK(cudaFree(dout));
    CK(cudaFree(ddx));
    free(x);
    free(w);
    free(dy);
    free(dw0);
    free(ref);
    free(got);
}

static void check_gemm(void)
{
    static const gemm_case cases[] = {
        {"E5 empty+odd rows 64x48", 5, 64, 48, {0, 37, 1, 0, 90}},
        {"E4 one hot 96x40", 4, 96, 40, {0, 0, 203, 0}},
        {"E3 odd widths 44x36", 3, 44, 36, {5, 0, 17}},
        {"E6 256x512", 6, 256, 512, {300, 7, 0, 129, 64, 500}},
        {"E2 all empty", 2, 32, 32, {0, 0}},
    };
    moert_bf16_cuda *g = NULL;
    OK(moert_bf16_cuda_create(&test_host, NULL, 0, MOERT_BF16_CUDA_EXPERT_LOOP, &g));
    if (!g) return;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        for (int d = 0; d < 2; d++)
            for (int m = 0; m < 2; m++)
                check_gemm_case(g, &cases[i], d ? MOERT_F32 : MOERT_BF16,
                                m ? MOERT_BF16_CUDA_GROUPED : MOERT_BF16_CUDA_EXPERT_LOOP);
    /* a repeat of the same shapes finds every plan in the cache */
    int64_t q0, h0, q1, h1;
    check_gemm_case(g, &cases[3], MOERT_BF16, MOERT_BF16_CUDA_EXPERT_LOOP);
    moert_bf16_cuda_plan_stats(g, &q0, &h0);
    check_gemm_case(g, &cases[3], MOERT_BF16, MOERT_BF16_CUDA_EXPERT_LOOP);
    moert_bf16_cuda_plan_stats(g, &q1, &h1);
    record("gemm plan cache: new queries", (double)(q1 - q0), 0, "repeat of case 3 (%lld hits)", (long long)(h1 - h0));

    /* the ABI entry point: shape mismatch named, and counts fetched from the device when no host copy */
    int64_t counts[3] = {4, 0, 9};
    double *x = random_values(13 * 16, MOERT_F32, 1.0), *w = random_values(3 * 16 * 8, MOERT_F32, 1.0);
    void *dx = upload(x, 13 * 16, MOERT_F32, 0), *dw = upload(w, 3 * 16 * 8, MOERT_F32, 0), *dy = dalloc(13 * 8 * 4);
    void *dcounts = dalloc(sizeof counts);
    CK(cudaMemcpy(dcounts, counts, sizeof counts, cudaMemcpyHostToDevice));
    moert_device dev = {MOERT_DEVICE_CUDA, 0};
    moert_tensor tx = moert_tensor_2d(dx, dev, MOERT_F32, 13, 16), tw = moert_tensor_3d(dw, dev, MOERT_F32, 3, 16, 8);
    moert_tensor ty = moert_tensor_2d(dy, dev, MOERT_F32, 13, 8), tc = moert_tensor_1d(dcounts, dev, MOERT_I64, 3);
    moert_grouped_gemm_args a = {.struct_size = sizeof a,
                                 .which = MOERT_GEMM_FC1,
                                 .pass = MOERT_GEMM_FORWARD,
                                 .tokens_per_expert = &tc,
                                 .input = &tx,
                                 .weight = &tw,
                                 .output = &ty};
    OK(moert_bf16_cuda_run(g, NULL, &a));
    double got[13 * 8], ref[13 * 8];
    download(got, dy, 13 * 8, MOERT_F32);
    for (int r = 0; r < 13; r++) {
        int e = r < 4 ? 0 : 2;
        for (int n = 0; n < 8; n++) {
            double s = 0;
            for (int k = 0; k < 16; k++) s += x[r * 16 + k] * w[(e * 16 + k) * 8 + n];
            ref[r * 8 + n] = s;
        }
    }
    record("gemm ABI run, device counts", rel_error(got, ref, 13 * 8), 1e-5, "E3 16x8 fp32");
    moert_tensor ty_bad = moert_tensor_2d(dy, dev, MOERT_F32, 13, 7);
    a.output = &ty_bad;
    host_error[0] = '\0';
    moert_result rc = moert_bf16_cuda_run(g, NULL, &a);
    record("gemm ABI bad shape refused",
           rc == MOERT_ERR_INVALID_ARGUMENT && strstr(host_error, "FORWARD shapes disagree") ? 0 : 1, 0,
           "output [13,7]");
    CK(cudaFree(dx));
    CK(cudaFree(dw));
    CK(cudaFree(dy));
    CK(cudaFree(dcounts));
    free(x);
    free(w);
    moert_bf16_cuda_destroy(g);
}

/* ---- SwiGLU x prob ---- */

static double silu(double a) { return a / (1.0 + exp(-a)); }

static void check_swiglu_case(moert_dtype t, int64_t rows, int64_t F, int with_prob, int misalign)
{
    const int64_t off = misalign ? 1 : 0; /* one element in: breaks 16-byte alignment, takes the scalar path */
    double *in = random_values(rows * 2 * F + off, t, 2.0), *dout = random_values(rows * F + off, t, 1.0);
    double *prob = malloc((size_t)(rows + 1) * sizeof(double));
    for (int64_t r = 0; r < rows; r++) prob[r] = (double)(float)(0.55 + 0.45 * uniform());
    const size_t es = moert_dtype_size(t);
    void *d_in = upload(in, rows * 2 * F + off, t, 0), *d_dout = upload(dout, rows * F + off, t, 0);
    void *d_prob = with_prob ? upload(prob, rows, MOERT_F32, 0) : NULL;
    void *d_out = dalloc((size_t)(rows * F + off) * es), *d_din = dalloc((size_t)(rows * 2 * F + off) * es);
    void *d_dprob = dalloc((size_t)(rows + 1) * 4);
    const char *in_p = (const char *)d_in + off * es, *dout_p = (const char *)d_dout + off * es;
    OK(moert_cuda_swiglu_forward(NULL, t, rows, F, in_p, d_prob, (char *)d_out + off * es));
    OK(moert_cuda_swiglu_backward(NULL, t, rows, F, in_p, d_prob, dout_p, (char *)d_din + off * es, d_dprob));
    CK(cudaDeviceSynchronize());
    const int64_t n_out = rows * F, n_in = rows * 2 * F;
    double *got = malloc((size_t)(n_in + off + rows + 1) * sizeof(double));
    double *ref = malloc((size_t)(n_in + rows + 1) * sizeof(double));
    double *ref_dprob = calloc((size_t)(rows + 1), sizeof(double));
    const double *x = in + off, *dy = dout + off;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < F; j++) {
            double p = with_prob ? prob[r] : 1.0;
            ref[r * F + j] = silu(x[r * 2 * F + j]) * x[r * 2 * F + F + j] * p;
        }
    download(got, d_out, n_out + off, t);
    record("swiglu forward", rel_error(got + off, ref, n_out), tol_for(t), "%s rows %lld F %lld%s%s",
           moert_dtype_name(t), (long long)rows, (long long)F, with_prob ? "" : " no prob",
           misalign ? " misaligned" : "");
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < F; j++) {
            double p = with_prob ? prob[r] : 1.0, a = x[r * 2 * F + j], gg = x[r * 2 * F + F + j], d = dy[r * F + j];
            double s = 1.0 / (1.0 + exp(-a));
            ref[r * 2 * F + j] = d * p * gg * s * (1.0 + a * (1.0 - s));
            ref[r * 2 * F + F + j] = d * p * silu(a);
            ref_dprob[r] += d * silu(a) * gg;
        }
    download(got, d_din, n_in + off, t);
    record("swiglu backward d_in", rel_error(got + off, ref, n_in), tol_for(t), "%s rows %lld F %lld%s%s",
           moert_dtype_name(t), (long long)rows, (long long)F, with_prob ? "" : " no prob",
           misalign ? " misaligned" : "");
    download(got, d_dprob, rows, MOERT_F32);
    record("swiglu backward d_prob", rel_error(got, ref_dprob, rows), 1e-4, "%s rows %lld F %lld", moert_dtype_name(t),
           (long long)rows, (long long)F);
    CK(cudaFree(d_in));
    CK(cudaFree(d_dout));
    if (d_prob) CK(cudaFree(d_prob));
    CK(cudaFree(d_out));
    CK(cudaFree(d_din));
    CK(cudaFree(d_dprob));
    free(in);
    free(dout);
    free(prob);
    free(got);
    free(ref);
    free(ref_dprob);
}

static void check_swiglu(void)
{
    const int64_t sizes[][2] = {{1, 8}, {7, 13}, {129, 768}, {33, 1000}, {5, 2048}};
    for (int d = 0; d < 2; d++) {
        moert_dtype t = d ? MOERT_F32 : MOERT_BF16;
        for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
            check_swiglu_case(t, sizes[i][0], sizes[i][1], 1, 0);
        check_swiglu_case(t, 9, 64, 0, 0);
        check_swiglu_case(t, 9, 64, 1, 1);
    }
    OK(moert_cuda_swiglu_forward(NULL, MOERT_BF16, 0, 64, NULL, NULL, NULL)); /* zero rows: nothing to do */
}

/* ---- element-wise helpers ---- */

/* moert_cuda_memcpy_async between device and pinned host memory: small copies go through a kernel (no copy
 * engine), larger ones through cudaMemcpyAsync; both must move exactly the bytes asked, at any alignment. */
static void check_small_copies(void)
{
    const size_t sizes[] = {1, 15, 16, 4099, 65536, 256u << 10, (256u << 10) + 16};
    const size_t cap = (256u << 10) + 64;
    unsigned char *host = NULL, *pattern = malloc(cap), *back = malloc(cap);
    unsigned char *dev = dalloc(cap);
    CK(cudaMallocHost((void **)&host, cap));
    for (size_t i = 0; i < cap; i++) pattern[i] = (unsigned char)(i * 131 + 7);
    for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++)
        for (size_t off = 0; off < 2; off++) {
            const size_t n = sizes[si];
            /* device -> pinned host */
            CK(cudaMemcpy(dev, pattern, cap, cudaMemcpyHostToDevice));
            memset(host, 0xA5, cap);
            OK(moert_cuda_memcpy_async(host + off, dev + off, n, NULL));
            CK(cudaDeviceSynchronize());
            double bad = 0;
            for (size_t i = 0; i < cap; i++) bad += host[i] != (i >= off && i < off + n ? pattern[i] : 0xA5);
            record("memcpy_async D2H pinned", bad, 0, "%zu bytes at offset %zu", n, off);
            /* pinned host -> device */
            memcpy(host, pattern, cap);
            CK(cudaMemset(dev, 0x5A, cap));
            OK(moert_cuda_memcpy_async(dev + off, host + off, n, NULL));
            CK(cudaDeviceSynchronize());
            CK(cudaMemcpy(back, dev, cap, cudaMemcpyDeviceToHost));
            bad = 0;
            for (size_t i = 0; i < cap; i++) bad += back[i] != (i >= off && i < off + n ? pattern[i] : 0x5A);
            record("memcpy_async H2D pinned", bad, 0, "%zu bytes at offset %zu", n, off);
        }
    CK(cudaFreeHost(host));
    CK(cudaFree(dev));
    free(pattern);
    free(back);
}

static void check_elementwise(void)
{
    const int64_t n = 100003; /* odd: vector body plus scalar tail */
    for (int dx = 0; dx < 2; dx++)
        for (int dy = 0; dy < 2; dy++)
            for (int mis = 0; mis < 2; mis++) {
                moert_dtype tx = dx ? MOERT_F32 : MOERT_BF16, ty = dy ? MOERT_F32 : MOERT_BF16;
                double *x = random_values(n + 1, tx, 1.0), *y = random_values(n + 1, ty, 1.0);
                void *d_x = upload(x, n + 1, tx, 0), *d_y = upload(y, n + 1, ty, 0);
                const int64_t o = mis;
                OK(moert_cuda_axpby(NULL, n, 0.75, tx, (char *)d_x + o * moert_dtype_size(tx), -1.5, ty,
                                    (char *)d_y + o * moert_dtype_size(ty)));
                double *got = malloc((size_t)(n + 1) * sizeof(double)), *ref = malloc((size_t)n * sizeof(double));
                download(got, d_y, n + 1, ty);
                for (int64_t i = 0; i < n; i++) ref[i] = 0.75 * x[i + o] - 1.5 * y[i + o];
                record("axpby", rel_error(got + o, ref, n), tol_for(ty) / 2, "x %s y %s n %lld%s", moert_dtype_name(tx),
                       moert_dtype_name(ty), (long long)n, mis ? " misaligned" : "");
                /* convert (b = 0: y's old NaN-free or not, it is not read) */
                CK(cudaMemset(d_y, 0xFF, (size_t)(n + 1) * moert_dtype_size(ty)));
                OK(moert_cuda_convert(NULL, n, tx, d_x, ty, d_y));
                download(got, d_y, n, ty);
                for (int64_t i = 0; i < n; i++) ref[i] = x[i];
                record("convert", rel_error(got, ref, n), tol_for(ty) / 2, "%s -> %s", moert_dtype_name(tx),
                       moert_dtype_name(ty));
                CK(cudaFree(d_x));
                CK(cudaFree(d_y));
                free(x);
                free(y);
                free(got);
                free(ref);
            }

    /* fill */
    const moert_dtype fill_types[] = {MOERT_F32, MOERT_BF16, MOERT_F64, MOERT_I32, MOERT_I64};
    for (size_t i = 0; i < 5; i++) {
        void *d = dalloc((size_t)(n + 1) * 8);
        OK(moert_cuda_fill(NULL, fill_types[i], n, 3.0, d));
        double *got = malloc((size_t)(n + 1) * sizeof(double));
        download(got, d, n + 1, fill_types[i]);
        int64_t bad = 0;
        for (int64_t k = 0; k < n; k++) bad += got[k] != 3.0;
        bad += got[n] == 3.0; /* one past the end untouched */
        record("fill", (double)bad, 0, "%s n %lld", moert_dtype_name(fill_types[i]), (long long)n);
        CK(cudaFree(d));
        free(got);
    }

    /* parameter initialisation: the GPU's normal fill against the CPU's (same counter-based generator) */
    for (int d64 = 0; d64 < 2; d64++) {
        moert_dtype t = d64 ? MOERT_F64 : MOERT_F32;
        const int64_t count = 1000003;
        void *d = dalloc((size_t)count * 8);
        OK(moert_cuda_fill_normal(NULL, t, count, 42, 17, 123456789, 0.02, d));
        double *got = malloc((size_t)count * sizeof(double));
        download(got, d, count, t);
        double worst = 0;
        for (int64_t k = 0; k < count; k++) {
            double want = 0.02 * moert_random_normal(42, 17, 123456789 + (uint64_t)k);
            if (!d64) want = (double)(float)want;
            double e = fabs(got[k] - want) / fmax(fabs(want), 1e-30);
            if (e > worst) worst = e;
        }
        record("fill_normal vs CPU", worst, d64 ? 1e-13 : 1.2e-7, "%s n %lld", moert_dtype_name(t), (long long)count);
        CK(cudaFree(d));
        free(got);
    }

    /* the trainer's squared error (harness/cuda_ops.cu): value, and the same bits on a second run */
    const int64_t sizes[] = {1, 1000, 3000017};
    void *ws = dalloc(8192); /* TRAINER_LOSS_WORKSPACE_BYTES */
    for (size_t si = 0; si < 3; si++)
        for (int d = 0; d < 2; d++) {
            moert_dtype t = d ? MOERT_F32 : MOERT_BF16;
            int64_t m = sizes[si];
            double *x = random_values(m, t, 1.0), *y = random_values(m, t, 1.0);
            void *d_x = upload(x, m, t, 0), *d_y = upload(y, m, t, 0);
            double sum[2];
            OK(trainer_cuda_squared_error(NULL, t, m, d_x, d_y, 1.0, t, NULL, ws, NULL, &sum[0]));
            OK(trainer_cuda_squared_error(NULL, t, m, d_x, d_y, 1.0, t, NULL, ws, NULL, &sum[1]));
            float res[2] = {(float)sum[0], (float)sum[1]};
            double ref = 0;
            for (int64_t i = 0; i < m; i++) ref += (x[i] - y[i]) * (x[i] - y[i]);
            record("sum_squares (x-y)^2", fabs(res[0] - ref) / ref, 1e-5, "%s n %lld", moert_dtype_name(t),
                   (long long)m);
            record("sum_squares deterministic", memcmp(&res[0], &res[1], sizeof(float)) ? 1 : 0, 0, "%s n %lld",
                   moert_dtype_name(t), (long long)m);
            OK(trainer_cuda_squared_error(NULL, t, m, d_x, NULL, 1.0, t, NULL, ws, NULL, &sum[0]));
            res[0] = (float)sum[0];
            ref = 0;
            for (int64_t i = 0; i < m; i++) ref += x[i] * x[i];
            record("sum_squares x^2", fabs(res[0] - ref) / ref, 1e-5, "%s n %lld", moert_dtype_name(t), (long long)m);
            CK(cudaFree(d_x));
            CK(cudaFree(d_y));
            free(x);
            free(y);
        }
    CK(cudaFree(ws));

    /* the trainer's Adam: three steps against the formula in double */
    const int64_t np = 4099;
    const struct {
        double lr, beta1, beta2, eps, weight_decay, grad_scale;
    } cfg = {.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.1, .grad_scale = 1.0};
    for (int d = 0; d < 2; d++) {
        moert_dtype gt = d ? MOERT_F32 : MOERT_BF16;
        double *p = random_values(np, MOERT_F32, 1.0), *mref = calloc((size_t)np, sizeof(double));
        double *vref = calloc((size_t)np, sizeof(double)), *zeros = calloc((size_t)np, sizeof(double));
        void *d_p = upload(p, np, MOERT_F32, 0), *d_m = upload(zeros, np, MOERT_F32, 0);
        void *d_v = upload(zeros, np, MOERT_F32, 0);
        for (int step = 1; step <= 3; step++) {
            double *gr = random_values(np, gt, 1.0);
            void *d_g = upload(gr, np, gt, 0);
            OK(trainer_cuda_adam(NULL, np, step, cfg.lr, cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay, d_p, gt, d_g,
                                 d_m, d_v));
            for (int64_t i = 0; i < np; i++) {
                double g = gr[i] * cfg.grad_scale;
                mref[i] = cfg.beta1 * mref[i] + (1 - cfg.beta1) * g;
                vref[i] = cfg.beta2 * vref[i] + (1 - cfg.beta2) * g * g;
                double mh = mref[i] / (1 - pow(cfg.beta1, step)), vh = vref[i] / (1 - pow(cfg.beta2, step));
                p[i] = p[i] * (1 - cfg.lr * cfg.weight_decay) - cfg.lr * mh / (sqrt(vh) + cfg.eps);
            }
            CK(cudaFree(d_g));
            free(gr);
        }
        double *got = malloc((size_t)np * sizeof(double));
        download(got, d_p, np, MOERT_F32);
        record("adam params after 3 steps", rel_error(got, p, np), 1e-5, "grad %s n %lld", moert_dtype_name(gt),
               (long long)np);
        download(got, d_v, np, MOERT_F32);
        record("adam second moment", rel_error(got, vref, np), 1e-5, "grad %s n %lld", moert_dtype_name(gt),
               (long long)np);
        CK(cudaFree(d_p));
        CK(cudaFree(d_m));
        CK(cudaFree(d_v));
        free(p);
        free(mref);
        free(vref);
        free(zeros);
        free(got);
    }
}

/* ---- all-to-all dispatcher kernels ---- */

/* Random routing: K distinct experts per token, a drop probability, a share of tokens sent to `hot`. */
static int32_t *random_routing(int64_t T, int64_t K, int64_t E, double drop, int64_t hot, double hot_share)
{
    int32_t *idx = malloc((size_t)(T * K + 1) * sizeof(int32_t));
    for (int64_t t = 0; t < T; t++)
        for (int64_t k = 0; k < K; k++) {
            int32_t e;
            int fresh;
            do {
                if (k == 0 && hot >= 0 && (uniform() + 1) / 2 < hot_share)
                    e = (int32_t)hot;
                else
                    e = (int32_t)((uint64_t)((uniform() + 1) / 2 * (double)E) % (uint64_t)E);
                fresh = 1;
                for (int64_t j = 0; j < k; j++) fresh &= idx[t * K + j] != e;
            } while (!fresh);
            idx[t * K + k] = e;
        }
    for (int64_t c = 0; c < T * K; c++)
        if ((uniform() + 1) / 2 < drop) idx[c] = -1;
    return idx;
}

static void check_layout_case(int64_t T, int64_t K, int64_t E, double drop, int64_t hot)
{
    int32_t *idx = random_routing(T, K, E, drop, hot, 0.7);
    void *d_idx = dalloc((size_t)(T * K + 1) * 4);
    if (T) CK(cudaMemcpy(d_idx, idx, (size_t)(T * K) * 4, cudaMemcpyHostToDevice));
    moert_a2a_cuda_layout_buffers L = {.tokens_per_expert = dalloc((size_t)E * 8),
                                       .expert_offsets = dalloc((size_t)(E + 1) * 8),
                                       .row_of_copy = dalloc((size_t)(T * K + 1) * 4),
                                       .copy_of_row = dalloc((size_t)(T * K + 1) * 4),
                                       .scratch = dalloc(moert_a2a_cuda_layout_scratch_bytes(T, E))};
    int64_t *counts_host = malloc((size_t)E * 8);
    OK(moert_a2a_cuda_layout(&test_host, NULL, d_idx, T, K, E, &L, counts_host));

    /* CPU: counts, offsets, stable sort by expert in copy order */
    int64_t *counts = calloc((size_t)E, 8), *offsets = calloc((size_t)E + 1, 8);
    for (int64_t c = 0; c < T * K; c++)
        if (idx[c] >= 0) counts[idx[c]]++;
    for (int64_t e = 0; e < E; e++) offsets[e + 1] = offsets[e] + counts[e];
    int32_t *row_of_copy = malloc((size_t)(T * K + 1) * 4), *copy_of_row = malloc((size_t)(T * K + 1) * 4);
    int64_t *next = malloc((size_t)E * 8);
    memcpy(next, offsets, (size_t)E * 8);
    for (int64_t c = 0; c < T * K; c++) {
        row_of_copy[c] = idx[c] >= 0 ? (int32_t)next[idx[c]]++ : -1;
        if (idx[c] >= 0) copy_of_row[row_of_copy[c]] = (int32_t)c;
    }
    const int64_t kept = offsets[E];
    int64_t *g_counts = malloc((size_t)E * 8), *g_offsets = malloc((size_t)(E + 1) * 8);
    int32_t *g_roc = malloc((size_t)(T * K + 1) * 4), *g_cor = malloc((size_t)(T * K + 1) * 4);
    CK(cudaMemcpy(g_counts, L.tokens_per_expert, (size_t)E * 8, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(g_offsets, L.expert_offsets, (size_t)(E + 1) * 8, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(g_roc, L.row_of_copy, (size_t)(T * K + 1) * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(g_cor, L.copy_of_row, (size_t)(T * K + 1) * 4, cudaMemcpyDeviceToHost));
    int64_t bad = 0;
    for (int64_t e = 0; e < E; e++) bad += (g_counts[e] != counts[e]) + (counts_host[e] != counts[e]);
    for (int64_t e = 0; e <= E; e++) bad += g_offsets[e] != offsets[e];
    for (int64_t c = 0; c < T * K; c++) bad += g_roc[c] != row_of_copy[c];
    for (int64_t r = 0; r < kept; r++) bad += g_cor[r] != copy_of_row[r];
    bad += kept < T * K && g_cor[kept] != -1; /* rows past the kept total untouched (poison -1) */
    record("a2a layout (exact)", (double)bad, 0, "T %lld K %lld E %lld drop %.2f%s", (long long)T, (long long)K,
           (long long)E, drop, hot >= 0 ? " hot" : "");

    /* permute / combine and their adjoints, bf16 and fp32, vector and scalar widths */
    const int64_t widths[] = {72, 13};
    for (int wi = 0; wi < 2; wi++)
        for (int d = 0; d < 2 && T > 0; d++) {
            moert_dtype t = d ? MOERT_F32 : MOERT_BF16;
            const int64_t H = widths[wi];
            double *x = random_values(T * H, t, 1.0);
            void *d_x = upload(x, T * H, t, 0), *d_rows = dalloc((size_t)(T * K + 1) * H * moert_dtype_size(t));
            OK(moert_a2a_cuda_gather_rows(&test_host, NULL, t, kept, H, L.copy_of_row, (int32_t)K, NULL, d_x, d_rows));
            double *got = malloc((size_t)(T * K + 1) * H * sizeof(double));
            download(got, d_rows, (kept + (kept < T * K)) * H, t);
            int64_t mism = 0;
            for (int64_t r = 0; r < kept; r++)
                for (int64_t j = 0; j < H; j++) mism += got[r * H + j] != x[(copy_of_row[r] / K) * H + j];
            if (kept < T * K) mism += !isnan(got[kept * H]); /* the row after stays poisoned */
            record("a2a permute (exact)", (double)mism, 0, "%s T %lld H %lld", moert_dtype_name(t), (long long)T,
                   (long long)H);

            /* combine: y[t] = sum of its kept copies' rows; rows = random expert outputs */
            double *ye = random_values(kept * H, t, 1.0);
            void *d_ye = upload(ye, kept * H, t, 0), *d_y = dalloc((size_t)T * H * moert_dtype_size(t));
            OK(moert_a2a_cuda_combine_rows(&test_host, NULL, t, T, K, H, L.row_of_copy, d_ye, d_y, 0));
            double *ref = calloc((size_t)(T * H), sizeof(double));
            for (int64_t tok = 0; tok < T; tok++)
                for (int64_t k = 0; k < K; k++) {
                    int32_t r = row_of_copy[tok * K + k];
                    if (r < 0) continue;
                    for (int64_t j = 0; j < H; j++) ref[tok * H + j] += ye[r * H + j];
                }
            download(got, d_y, T * H, t);
            record("a2a combine", rel_error(got, ref, T * H), tol_for(t), "%s T %lld H %lld", moert_dtype_name(t),
                   (long long)T, (long long)H);
            /* adjoint of permute: d_x += per-token sums (accumulate onto x) */
            OK(moert_a2a_cuda_combine_rows(&test_host, NULL, t, T, K, H, L.row_of_copy, d_ye, d_x, 1));
            for (int64_t i = 0; i < T * H; i++) ref[i] += x[i];
            download(got, d_x, T * H, t);
            record("a2a permute adjoint (+=)", rel_error(got, ref, T * H), tol_for(t), "%s T %lld H %lld",
                   moert_dtype_name(t), (long long)T, (long long)H);
            CK(cudaFree(d_x));
            CK(cudaFree(d_rows));
            CK(cudaFree(d_ye));
            CK(cudaFree(d_y));
            free(x);
            free(ye);
            free(ref);
            free(got);
        }

    /* probs travel as fp32 rows of width 1: recv probs and the d_topk_probs adjoint (0 for dropped copies) */
    if (T > 0) {
        double *probs = random_values(T * K, MOERT_F32, 1.0);
        void *d_probs = upload(probs, T * K, MOERT_F32, 0), *d_recv = dalloc((size_t)(T * K + 1) * 4);
        void *d_back = dalloc((size_t)(T * K) * 4);
        void *d_limit = dalloc(8);
        CK(cudaMemcpy(d_limit, &offsets[E], 8, cudaMemcpyHostToDevice));
        /* rows bounded on the device (no host count): launch for T*K, stop at the kept total */
        OK(moert_a2a_cuda_gather_rows(&test_host, NULL, MOERT_F32, T * K, 1, L.copy_of_row, 1, d_limit, d_probs,
                                      d_recv));
        OK(moert_a2a_cuda_gather_rows(&test_host, NULL, MOERT_F32, T * K, 1, L.row_of_copy, 1, NULL, d_recv, d_back));
        double *got = malloc((size_t)(T * K + 1) * sizeof(double));
        download(got, d_recv, T * K, MOERT_F32);
        int64_t mism = 0;
        for (int64_t r = 0; r < kept; r++) mism += got[r] != probs[copy_of_row[r]];
        for (int64_t r = kept; r < T * K; r++) mism += !isnan(got[r]);
        download(got, d_back, T * K, MOERT_F32);
        for (int64_t c = 0; c < T * K; c++) mism += got[c] != (idx[c] >= 0 ? probs[c] : 0.0);
        record("a2a probs gather + adjoint", (double)mism, 0, "T %lld K %lld", (long long)T, (long long)K);
        CK(cudaFree(d_probs));
        CK(cudaFree(d_recv));
        CK(cudaFree(d_back));
        CK(cudaFree(d_limit));
        free(probs);
        free(got);
    }

    CK(cudaFree(d_idx));
    CK(cudaFree(L.tokens_per_expert));
    CK(cudaFree(L.expert_offsets));
    CK(cudaFree(L.row_of_copy));
    CK(cudaFree(L.copy_of_row));
    CK(cudaFree(L.scratch));
    free(idx);
    free(counts_host);
    free(counts);
    free(offsets);
    free(row_of_copy);
    free(copy_of_row);
    free(next);
    free(g_counts);
    free(g_offsets);
    free(g_roc);
    free(g_cor);
}

static void check_regroup_case(int64_t W, int64_t EL)
{
    int64_t *counts = malloc((size_t)(W * EL) * 8);
    int64_t total = 0;
    for (int64_t i = 0; i < W * EL; i++) {
        counts[i] = (uniform() > 0.3) ? (int64_t)((uniform() + 1) * 40) : 0;
        total += counts[i];
    }
    void *d_counts = dalloc((size_t)(W * EL) * 8);
    CK(cudaMemcpy(d_counts, counts, (size_t)(W * EL) * 8, cudaMemcpyHostToDevice));
    const int64_t cap = total + 5;
    int32_t *d_em = dalloc((size_t)cap * 4), *d_rm = dalloc((size_t)cap * 4);
    int64_t *d_tple = dalloc((size_t)EL * 8), *d_total = dalloc(8);
    OK(moert_a2a_cuda_regroup_maps(&test_host, NULL, W, EL, d_counts, cap, d_em, d_rm, d_tple, d_total));
    /* CPU maps */
    int32_t *em = malloc((size_t)cap * 4), *rm = malloc((size_t)cap * 4);
    int64_t *tple = calloc((size_t)EL, 8), dst = 0;
    for (int64_t e = 0; e < EL; e++)
        for (int64_t s = 0; s < W; s++) {
            int64_t src = 0;
            for (int64_t i = 0; i < s * EL + e; i++) src += counts[i];
            for (int64_t i = 0; i < counts[s * EL + e]; i++, dst++) {
                em[dst] = (int32_t)(src + i);
                rm[src + i] = (int32_t)dst;
            }
            tple[e] += counts[s * EL + e];
        }
    int32_t *g_em = malloc((size_t)cap * 4), *g_rm = malloc((size_t)cap * 4);
    int64_t *g_tple = malloc((size_t)EL * 8), g_total = -1;
    CK(cudaMemcpy(g_em, d_em, (size_t)cap * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(g_rm, d_rm, (size_t)cap * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(g_tple, d_tple, (size_t)EL * 8, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(&g_total, d_total, 8, cudaMemcpyDeviceToHost));
    int64_t bad = g_total != total;
    for (int64_t i = 0; i < total; i++) bad += (g_em[i] != em[i]) + (g_rm[i] != rm[i]);
    for (int64_t i = total; i < cap; i++) bad += (g_em[i] != -1) + (g_rm[i] != -1);
    for (int64_t e = 0; e < EL; e++) bad += g_tple[e] != tple[e];
    record("a2a regroup maps (exact)", (double)bad, 0, "world %lld local experts %lld rows %lld", (long long)W,
           (long long)EL, (long long)total);
    /* data round trip: regroup then inverse gives back the received rows (bf16, H 40) */
    if (total > 0) {
        const int64_t H = 40;
        double *x = random_values(total * H, MOERT_BF16, 1.0);
        void *d_x = upload(x, total * H, MOERT_BF16, 0), *d_g = dalloc((size_t)total * H * 2);
        void *d_back = dalloc((size_t)total * H * 2);
        OK(moert_a2a_cuda_gather_rows(&test_host, NULL, MOERT_BF16, total, H, d_em, 1, NULL, d_x, d_g));
        OK(moert_a2a_cuda_gather_rows(&test_host, NULL, MOERT_BF16, total, H, d_rm, 1, NULL, d_g, d_back));
        double *got = malloc((size_t)(total * H) * sizeof(double));
        download(got, d_g, total * H, MOERT_BF16);
        int64_t mism = 0;
        for (int64_t r = 0; r < total; r++)
            for (int64_t j = 0; j < H; j++) mism += got[r * H + j] != x[em[r] * H + j];
        download(got, d_back, total * H, MOERT_BF16);
        for (int64_t i = 0; i < total * H; i++) mism += got[i] != x[i];
        record("a2a regroup + inverse (exact)", (double)mism, 0, "world %lld local experts %lld", (long long)W,
               (long long)EL);
        CK(cudaFree(d_x));
        CK(cudaFree(d_g));
        CK(cudaFree(d_back));
        free(x);
        free(got);
    }
    CK(cudaFree(d_counts));
    CK(cudaFree(d_em));
    CK(cudaFree(d_rm));
    CK(cudaFree(d_tple));
    CK(cudaFree(d_total));
    free(counts);
    free(em);
    free(rm);
    free(tple);
    free(g_em);
    free(g_rm);
    free(g_tple);
}

static void check_dispatch(void)
{
    check_layout_case(1000, 4, 64, 0.1, 5);    /* one hot expert, drops, T not a multiple of 32 */
    check_layout_case(77, 2, 8, 0.0, -1);      /* mixtral-like */
    check_layout_case(4096, 8, 256, 0.02, -1); /* deepseek-like */
    check_layout_case(33, 3, 1000, 0.3, -1);   /* many experts, most empty */
    check_layout_case(0, 2, 8, 0.0, -1);       /* no tokens */
    check_regroup_case(4, 3);
    check_regroup_case(8, 32);
    check_regroup_case(1, 1);

    /* an expert id out of range is reported when the counts come to the host */
    int32_t idx[4] = {0, 9, 1, -1};
    void *d_idx = dalloc(sizeof idx);
    CK(cudaMemcpy(d_idx, idx, sizeof idx, cudaMemcpyHostToDevice));
    moert_a2a_cuda_layout_buffers L = {.tokens_per_expert = dalloc(4 * 8),
                                       .expert_offsets = dalloc(5 * 8),
                                       .row_of_copy = dalloc(16),
                                       .copy_of_row = dalloc(16),
                                       .scratch = dalloc(moert_a2a_cuda_layout_scratch_bytes(2, 4))};
    int64_t counts[4];
    host_error[0] = '\0';
    moert_result rc = moert_a2a_cuda_layout(&test_host, NULL, d_idx, 2, 2, 4, &L, counts);
    record("a2a bad expert id reported",
           rc == MOERT_ERR_INVALID_ARGUMENT && strstr(host_error, "1 expert ids of topk_idx are outside [-1, 4)") ? 0
                                                                                                                  : 1,
           0, "id 9 of 4 experts");
    CK(cudaFree(d_idx));
    CK(cudaFree(L.tokens_per_expert));
    CK(cudaFree(L.expert_offsets));
    CK(cudaFree(L.row_of_copy));
    CK(cudaFree(L.copy_of_row));
    CK(cudaFree(L.scratch));
}

/* ---- router ---- */

/* CPU router for one token in double: selection, probs. Returns probs in out_probs, ids in out_idx. */
static void router_cpu_token(const moert_router_cuda_params *p, const double *l, const double *bias, int32_t *out_idx,
                             double *out_probs, double *scores)
{
    const int64_t E = p->num_experts, K = p->topk;
    double s[256], sel[256];
    if (p->score == MOERT_ROUTER_CUDA_SIGMOID) {
        for (int64_t e = 0; e < E; e++) s[e] = 1.0 / (1.0 + exp(-l[e]));
    } else {
        double m = -INFINITY, sum = 0;
        for (int64_t e = 0; e < E; e++) m = fmax(m, l[e]);
        for (int64_t e = 0; e < E; e++) sum += (s[e] = exp(l[e] - m));
        for (int64_t e = 0; e < E; e++) s[e] /= sum;
    }
    for (int64_t e = 0; e < E; e++) {
        sel[e] = p->score == MOERT_ROUTER_CUDA_SOFTMAX_POST ? l[e] : s[e] + (bias ? bias[e] : 0.0);
        if (scores) scores[e] = s[e];
    }
    int allowed[256];
    for (int64_t e = 0; e < E; e++) allowed[e] = 1;
    if (p->num_groups > 1) {
        const int64_t G = p->num_groups, gs = E / G, m = K / p->group_topk;
        double gscore[32];
        for (int64_t g = 0; g < G; g++) {
            int taken[256] = {0};
            gscore[g] = 0;
            for (int64_t r = 0; r < m; r++) {
                int64_t best = -1;
                for (int64_t i = 0; i < gs; i++)
                    if (!taken[i] && (best < 0 || sel[g * gs + i] > sel[g * gs + best])) best = i;
                taken[best] = 1;
                gscore[g] += sel[g * gs + best];
            }
        }
        int kept[32] = {0};
        for (int64_t r = 0; r < p->group_topk; r++) {
            int64_t best = -1;
            for (int64_t g = 0; g < G; g++)
                if (!kept[g] && (best < 0 || gscore[g] > gscore[best])) best = g;
            kept[best] = 1;
        }
        for (int64_t e = 0; e < E; e++) allowed[e] = kept[e / gs];
    }
    double q[8], sum = 0;
    for (int64_t k = 0; k < K; k++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++)
            if (allowed[e] && (best < 0 || sel[e] > sel[best])) best = e;
        allowed[best] = 0;
        out_idx[k] = (int32_t)best;
        q[k] = p->score == MOERT_ROUTER_CUDA_SOFTMAX_POST ? l[best] : s[best];
    }
    if (p->score == MOERT_ROUTER_CUDA_SOFTMAX_POST) {
        double m = q[0];
        for (int64_t k = 0; k < K; k++) sum += (out_probs[k] = exp(q[k] - m));
        for (int64_t k = 0; k < K; k++) out_probs[k] /= sum;
    } else {
        for (int64_t k = 0; k < K; k++) sum += (out_probs[k] = q[k]);
        if (p->normalize && K > 1)
            for (int64_t k = 0; k < K; k++) out_probs[k] /= (sum + 1e-20);
    }
    const double scale = p->scaling_factor != 0 ? p->scaling_factor : 1.0;
    for (int64_t k = 0; k < K; k++) out_probs[k] *= scale;
}

/* Probs of a fixed selection as a function of the logits (for finite differences of the backward). */
static void router_cpu_probs_fixed(const moert_router_cuda_params *p, const double *l, const int32_t *idx,
                                   double *probs)
{
    const int64_t E = p->num_experts, K = p->topk;
    double q[8], sum = 0;
    if (p->score == MOERT_ROUTER_CUDA_SOFTMAX_PRE) {
        double m = -INFINITY, z = 0;
        for (int64_t e = 0; e < E; e++) m = fmax(m, l[e]);
        for (int64_t e = 0; e < E; e++) z += exp(l[e] - m);
        for (int64_t k = 0; k < K; k++) q[k] = exp(l[idx[k]] - m) / z;
    } else if (p->score == MOERT_ROUTER_CUDA_SIGMOID) {
        for (int64_t k = 0; k < K; k++) q[k] = 1.0 / (1.0 + exp(-l[idx[k]]));
    } else {
        double m = l[idx[0]];
        for (int64_t k = 0; k < K; k++) sum += (q[k] = exp(l[idx[k]] - m));
        for (int64_t k = 0; k < K; k++) q[k] /= sum;
        sum = 0;
    }
    for (int64_t k = 0; k < K; k++) sum += (probs[k] = q[k]);
    if (p->score != MOERT_ROUTER_CUDA_SOFTMAX_POST && p->normalize && K > 1)
        for (int64_t k = 0; k < K; k++) probs[k] /= (sum + 1e-20);
    const double scale = p->scaling_factor != 0 ? p->scaling_factor : 1.0;
    for (int64_t k = 0; k < K; k++) probs[k] *= scale;
}

/* ties: logits drawn from {-1, -0, +0, 0.5, 1}, so most top-k picks tie with another expert and go to the lower index
 * (-0 and +0 compare equal); else spread out. Against a CPU route in double. */
static void check_router_case(const char *name, moert_router_cuda_params p, int with_bias, int ties)
{
    const int64_t T = p.tokens, E = p.num_experts, K = p.topk;
    /* logits: a random permutation of evenly spaced values per token, so no two are near each other */
    double *l = malloc((size_t)(T * E) * sizeof(double));
    static const double tie_values[5] = {-1.0, -0.0, 0.0, 0.5, 1.0};
    for (int64_t t = 0; t < T && ties; t++)
        for (int64_t e = 0; e < E; e++) l[t * E + e] = tie_values[(int)((uniform() + 1) / 2 * 5.0) % 5];
    for (int64_t t = 0; t < T && !ties; t++) {
        for (int64_t e = 0; e < E; e++) l[t * E + e] = (double)e;
        for (int64_t e = E - 1; e > 0; e--) {
            int64_t j = (int64_t)((uniform() + 1) / 2 * (double)(e + 1)) % (e + 1);
            double tmp = l[t * E + e];
            l[t * E + e] = l[t * E + j];
            l[t * E + j] = tmp;
        }
        for (int64_t e = 0; e < E; e++) l[t * E + e] = (double)(float)((l[t * E + e] - E / 2.0) * 3.0 / E);
    }
    double bias[256] = {0};
    for (int64_t e = 0; e < E; e++) bias[e] = with_bias ? (double)(float)(0.01 * uniform()) : 0.0;
    void *d_l = upload(l, T * E, MOERT_F32, 0), *d_bias = upload(bias, E, MOERT_F32, 0);
    int32_t *d_idx = dalloc((size_t)(T * K) * 4);
    float *d_probs = dalloc((size_t)(T * K) * 4), *d_scores = dalloc((size_t)(T * E) * 4);
    int64_t *d_counts = dalloc((size_t)E * 8);
    OK(moert_router_cuda_forward(&test_host, NULL, &p, d_l, with_bias ? d_bias : NULL, d_idx, d_probs, d_counts,
                                 d_scores));
    int32_t *g_idx = malloc((size_t)(T * K) * 4), *r_idx = malloc((size_t)(T * K) * 4);
    int64_t *g_counts = malloc((size_t)E * 8), *r_counts = calloc((size_t)E, 8);
    double *g_probs = malloc((size_t)(T * K) * sizeof(double)), *r_probs = malloc((size_t)(T * K) * sizeof(double));
    double *g_scores = malloc((size_t)(T * E) * sizeof(double)), *r_scores = malloc((size_t)(T * E) * sizeof(double));
    CK(cudaMemcpy(g_idx, d_idx, (size_t)(T * K) * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(g_counts, d_counts, (size_t)E * 8, cudaMemcpyDeviceToHost));
    download(g_probs, d_probs, T * K, MOERT_F32);
    download(g_scores, d_scores, T * E, MOERT_F32);
    for (int64_t t = 0; t < T; t++) {
        router_cpu_token(&p, l + t * E, with_bias ? bias : NULL, r_idx + t * K, r_probs + t * K, r_scores + t * E);
        for (int64_t k = 0; k < K; k++) r_counts[r_idx[t * K + k]]++;
    }
    int64_t mism = 0;
    for (int64_t i = 0; i < T * K; i++) mism += g_idx[i] != r_idx[i];
    for (int64_t e = 0; e < E; e++) mism += g_counts[e] != r_counts[e];
    record("router top-k ids + counts", (double)mism, 0, "%s T %lld E %lld K %lld", name, (long long)T, (long long)E,
           (long long)K);
    record("router probs", rel_error(g_probs, r_probs, T * K), 1e-5, "%s", name);
    record("router scores", rel_error(g_scores, r_scores, T * E), 1e-5, "%s", name);

    /* backward: d_logits against central differences of the CPU probs with the selection held */
    double *dp = random_values(T * K, MOERT_F32, 1.0);
    void *d_dp = upload(dp, T * K, MOERT_F32, 0);
    float *d_dl = dalloc((size_t)(T * E) * 4);
    OK(moert_router_cuda_backward(&test_host, NULL, &p, d_l, d_idx, d_dp, d_dl, 0));
    double *g_dl = malloc((size_t)(T * E) * sizeof(double)), *r_dl = malloc((size_t)(T * E) * sizeof(double));
    download(g_dl, d_dl, T * E, MOERT_F32);
    const double h = 1e-5;
    for (int64_t t = 0; t < T; t++) {
        double lt[256], pp[8], pm[8];
        memcpy(lt, l + t * E, (size_t)E * sizeof(double));
        for (int64_t e = 0; e < E; e++) {
            double keep = lt[e];
            lt[e] = keep + h;
            router_cpu_probs_fixed(&p, lt, r_idx + t * K, pp);
            lt[e] = keep - h;
            router_cpu_probs_fixed(&p, lt, r_idx + t * K, pm);
            lt[e] = keep;
            double g = 0;
            for (int64_t k = 0; k < K; k++) g += dp[t * K + k] * (pp[k] - pm[k]) / (2 * h);
            r_dl[t * E + e] = g;
        }
    }
    record("router backward d_logits", rel_error(g_dl, r_dl, T * E), 1e-4, "%s", name);
    /* accumulate: a second backward adds the same again */
    OK(moert_router_cuda_backward(&test_host, NULL, &p, d_l, d_idx, d_dp, d_dl, 1));
    download(g_dl, d_dl, T * E, MOERT_F32);
    for (int64_t i = 0; i < T * E; i++) r_dl[i] *= 2;
    record("router backward accumulate", rel_error(g_dl, r_dl, T * E), 1e-4, "%s", name);

    CK(cudaFree(d_l));
    CK(cudaFree(d_bias));
    CK(cudaFree(d_idx));
    CK(cudaFree(d_probs));
    CK(cudaFree(d_scores));
    CK(cudaFree(d_counts));
    CK(cudaFree(d_dp));
    CK(cudaFree(d_dl));
    free(l);
    free(g_idx);
    free(r_idx);
    free(g_counts);
    free(r_counts);
    free(g_probs);
    free(r_probs);
    free(g_scores);
    free(r_scores);
    free(dp);
    free(g_dl);
    free(r_dl);
}

static void check_router(void)
{
    moert_router_cuda_params mixtral = {
        .tokens = 77, .num_experts = 8, .topk = 2, .score = MOERT_ROUTER_CUDA_SOFTMAX_POST};
    check_router_case("softmax post E8 K2", mixtral, 0, 0);
    moert_router_cuda_params qwen = {
        .tokens = 300, .num_experts = 128, .topk = 8, .score = MOERT_ROUTER_CUDA_SOFTMAX_POST};
    check_router_case("softmax post E128 K8", qwen, 0, 0);
    moert_router_cuda_params pre = {.tokens = 65, .num_experts = 40, .topk = 3, .score = MOERT_ROUTER_CUDA_SOFTMAX_PRE};
    check_router_case("softmax pre E40 K3", pre, 0, 0);
    pre.normalize = 1;
    pre.scaling_factor = 1.5;
    check_router_case("softmax pre norm x1.5 E40 K3", pre, 0, 0);
    moert_router_cuda_params dsv3 = {.tokens = 129,
                                     .num_experts = 256,
                                     .topk = 8,
                                     .score = MOERT_ROUTER_CUDA_SIGMOID,
                                     .num_groups = 8,
                                     .group_topk = 4,
                                     .normalize = 1,
                                     .scaling_factor = 2.5};
    check_router_case("sigmoid+bias G8/4 x2.5 E256 K8", dsv3, 1, 0);
    moert_router_cuda_params sig = {.tokens = 50, .num_experts = 33, .topk = 1, .score = MOERT_ROUTER_CUDA_SIGMOID};
    check_router_case("sigmoid E33 K1", sig, 0, 0);
    moert_router_cuda_params grp = {.tokens = 70,
                                    .num_experts = 96,
                                    .topk = 6,
                                    .score = MOERT_ROUTER_CUDA_SOFTMAX_POST,
                                    .num_groups = 12,
                                    .group_topk = 3};
    check_router_case("softmax post G12/3 E96 K6", grp, 0, 0);
    /* ties, at every slot count of the kernels (E <= 32, 64, 128, 256) */
    check_router_case("ties softmax post E128 K8", qwen, 0, 1);
    check_router_case("ties softmax pre norm E40 K3", pre, 0, 1);
    check_router_case("ties sigmoid E33 K1", sig, 0, 1);
    check_router_case("ties softmax post E8 K2", mixtral, 0, 1);
    check_router_case("ties softmax post G12/3 E96 K6", grp, 0, 1);
    /* grouped with sums of tied logits, exact in fp32 and fp64 alike (sums of sigmoids may tie in one and not the
     * other) */
    dsv3.score = MOERT_ROUTER_CUDA_SOFTMAX_POST;
    check_router_case("ties softmax post G8/4 E256 K8", dsv3, 0, 1);

    moert_router_cuda_params bad = {.tokens = 4, .num_experts = 300, .topk = 2};
    host_error[0] = '\0';
    moert_result rc = moert_router_cuda_forward(&test_host, NULL, &bad, NULL, NULL, NULL, NULL, NULL, NULL);
    record("router limits refused", rc == MOERT_ERR_UNSUPPORTED && strstr(host_error, "300 experts") ? 0 : 1, 0,
           "E 300");
}

int main(void)
{
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        printf("kernels: no CUDA device, skipped\n");
        return TEST_SKIP;
    }
    CK(cudaSetDevice(0));
    check_gemm();
    check_swiglu();
    check_elementwise();
    check_small_copies();
    check_dispatch();
    check_router();
    CK(cudaDeviceSynchronize());

    printf("\n%-30s %-44s %10s %10s  %s\n", "check", "case", "error", "tolerance", "result");
    for (int i = 0; i < table_len; i++)
        printf("%-30s %-44s %10.3g %10.3g  %s\n", table[i].what, table[i].size, table[i].err, table[i].tol,
               table[i].ok ? "ok" : "FAIL");
    return test_finish("kernels");
}

#endif
