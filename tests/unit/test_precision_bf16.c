/* SPDX-License-Identifier: Apache-2.0 */
/* The "bf16" precision plugin: every pass of both GEMMs against a naive triple loop written here (fp64 exact,
 * fp32 exact against an fp32-accumulating loop and close to fp64, bf16 mode exact against a bf16-rounded
 * reference), experts with no rows, untouched padding rows, WGRAD accumulation, "auto", and bad arguments. */
#include "test_util.h"

#include "error.h"

#define PLUGIN  "bf16"
#define HIDDEN  6
#define FFN     5
#define EXPERTS 3

typedef enum arith { ARITH_FP64, ARITH_FP32, ARITH_BF16 } arith;

/* What an operand becomes before it is multiplied. */
static double operand(double v, arith a)
{
    if (a == ARITH_BF16) return moert_bf16_to_float(moert_bf16_from_float((float)v));
    if (a == ARITH_FP32) return (float)v;
    return v;
}

/* v after a round trip through dtype's storage. */
static double stored(double v, moert_dtype dtype)
{
    uint64_t cell = 0;
    moert_tensor t = moert_tensor_1d(&cell, moert_cpu(), dtype, 1);
    moert_store(&t, 0, v);
    return moert_load(&t, 0);
}

/* sum_p a(p) * b(p) in the arithmetic's accumulator, p in order; also sum |a*b| in double for tolerances. */
typedef struct ref_dot {
    double value, abs_sum, exact;
} ref_dot;

/* An arena of tensors for one grouped GEMM. */
typedef struct gemm_data {
    int64_t rows, k_in, n_out;
    moert_tensor input, weight, grad_output, output, grad_input, grad_weight;
    double *grad_weight_before; /* copy of grad_weight as given */
} gemm_data;

static moert_tensor make_tensor(moert_dtype dtype, int ndim, int64_t d0, int64_t d1, int64_t d2)
{
    int64_t shape[3] = {d0, d1, d2};
    int64_t n = d0 * d1 * (ndim == 3 ? d2 : 1);
    return moert_tensor_make(calloc((size_t)n + 1, 8), moert_cpu(), dtype, ndim, shape);
}

static void fill(moert_tensor *t, uint64_t *rng, int64_t valid_rows, double beyond)
{
    int64_t row_len = moert_tensor_numel(t) / t->shape[0];
    for (int64_t i = 0; i < moert_tensor_numel(t); i++)
        moert_store(t, i, i / row_len < valid_rows ? test_uniform(rng) : beyond);
}

static void free_data(gemm_data *g)
{
    free(g->input.data);
    free(g->weight.data);
    free(g->grad_output.data);
    free(g->output.data);
    free(g->grad_input.data);
    free(g->grad_weight.data);
    free(g->grad_weight_before);
}

/* Tensors for `which`, rows = sum(counts) + 2 padding rows whose inputs are NaN (they must not be read). */
static void make_data(gemm_data *g, moert_gemm_weight which, moert_dtype act, moert_dtype wdt, const int64_t *counts,
                      uint64_t seed)
{
    uint64_t rng = seed;
    int64_t total = 0;
    for (int e = 0; e < EXPERTS; e++) total += counts[e];
    g->rows = total + 2;
    g->k_in = which == MOERT_GEMM_FC1 ? HIDDEN : FFN;
    g->n_out = which == MOERT_GEMM_FC1 ? 2 * FFN : HIDDEN;
    g->input = make_tensor(act, 2, g->rows, g->k_in, 0);
    g->grad_output = make_tensor(act, 2, g->rows, g->n_out, 0);
    g->output = make_tensor(act, 2, g->rows, g->n_out, 0);
    g->grad_input = make_tensor(act, 2, g->rows, g->k_in, 0);
    g->weight = make_tensor(wdt, 3, EXPERTS, g->k_in, g->n_out);
    g->grad_weight = make_tensor(wdt, 3, EXPERTS, g->k_in, g->n_out);
    fill(&g->input, &rng, total, NAN);
    fill(&g->grad_output, &rng, total, NAN);
    fill(&g->output, &rng, 0, 77.0); /* all rows 77: the valid ones get overwritten */
    fill(&g->grad_input, &rng, 0, -55.0);
    fill(&g->weight, &rng, EXPERTS, 0);
    fill(&g->grad_weight, &rng, EXPERTS, 0);
    int64_t nw = moert_tensor_numel(&g->grad_weight);
    g->grad_weight_before = calloc((size_t)nw, sizeof(double));
    for (int64_t i = 0; i < nw; i++) g->grad_weight_before[i] = moert_load(&g->grad_weight, i);
}

/* One output element of a pass, the naive way: the sum over p of its two operands, in `a`'s accumulator. */
static ref_dot reference_element(const gemm_data *g, moert_gemm_pass pass, arith a, int64_t e, int64_t row0, int64_t m,
                                 int64_t i, int64_t j)
{
    ref_dot d = {0, 0, 0};
    float acc_f = 0.0f;
    double acc_d = 0.0;
    const int64_t K = g->k_in, N = g->n_out;
    int64_t len = pass == MOERT_GEMM_FORWARD ? K : pass == MOERT_GEMM_DGRAD ? N : m;
    for (int64_t p = 0; p < len; p++) {
        double x, y;
        if (pass == MOERT_GEMM_FORWARD) { /* out[i,j] = sum_k in[i,k] W[k,j] */
            x = moert_load(&g->input, (row0 + i) * K + p);
            y = moert_load(&g->weight, e * K * N + p * N + j);
        } else if (pass == MOERT_GEMM_DGRAD) { /* gin[i,j] = sum_n gout[i,n] W[j,n] */
            x = moert_load(&g->grad_output, (row0 + i) * N + p);
            y = moert_load(&g->weight, e * K * N + j * N + p);
        } else { /* gW[i,j] = sum_r in[r,i] gout[r,j] */
            x = moert_load(&g->input, (row0 + p) * K + i);
            y = moert_load(&g->grad_output, (row0 + p) * N + j);
        }
        double xo = operand(x, a), yo = operand(y, a);
        if (a == ARITH_FP64)
            acc_d += xo * yo;
        else
            acc_f += (float)xo * (float)yo;
        d.abs_sum += fabs(x * y);
        d.exact += x * y;
    }
    d.value = a == ARITH_FP64 ? acc_d : acc_f;
    return d;
}

static int mismatches = 0; /* elements reported so far (keeps the output short) */

/* Compares one element: exactly against the naive loop in the same arithmetic (after storing it in
 * the output's dtype), and within tol * sum|terms| of the exact (fp64) value. */
static void compare(const char *what, double got, double want, double exact, double abs_sum, double tol)
{
    bool ok = got == want && fabs(got - exact) <= tol * abs_sum + 1e-300;
    if (!ok) {
        test_failures++;
        if (mismatches++ < 10)
            fprintf(stderr, "%s: got %.17g, naive loop %.17g, fp64 %.17g (tol %.3g)\n", what, got, want, exact,
                    tol * abs_sum);
    }
}

/*
 * Runs one pass through the plugin (mode option `mode`, layer dtype `act`) and checks it against the naive
 * loop in arithmetic `a`. Output rows past sum(counts) and experts without rows must stay as they were.
 */
static void check_pass(const char *mode, moert_dtype act, moert_dtype wdt, arith a, moert_gemm_weight which,
                       moert_gemm_pass pass, const int64_t *counts, uint64_t seed, bool overwrite)
{
    char label[160], options[64];
    snprintf(label, sizeof label, "mode %s, %s activations, %s weights, %s, pass %d%s", mode, moert_dtype_name(act),
             moert_dtype_name(wdt), which == MOERT_GEMM_FC1 ? "fc1" : "fc2", (int)pass,
             overwrite ? ", first WGRAD overwrites" : "");
    snprintf(options, sizeof options, "{\"mode\": \"%s\"}", mode);
    moert_layer_info layer = test_layer(HIDDEN, FFN, EXPERTS, 2, 16, 1, 0, act);
    test_instance ti;
    if (test_instance_open(&ti, MOERT_KIND_PRECISION, PLUGIN, options, &layer, NULL, 0, 1) != MOERT_OK) {
        fprintf(stderr, "%s: open failed: %s\n", label, moert_error_message());
        test_failures++;
        test_instance_close(&ti);
        return;
    }
    const moert_precision_v1 *vt = (const moert_precision_v1 *)ti.plugin.header;
    gemm_data g;
    make_data(&g, which, act, wdt, counts, seed);
    moert_tensor tpe = moert_tensor_1d((void *)counts, moert_cpu(), MOERT_I64, EXPERTS);
    moert_grouped_gemm_args args = {.struct_size = sizeof args,
                                    .which = which,
                                    .pass = pass,
                                    .tokens_per_expert = &tpe,
                                    .tokens_per_expert_host = NULL,
                                    .input = &g.input,
                                    .weight = &g.weight,
                                    .grad_output = &g.grad_output,
                                    .output = &g.output,
                                    .grad_input = &g.grad_input,
                                    .grad_weight = &g.grad_weight,
                                    .overwrite_grad_weight = overwrite};
    EXPECT(!overwrite || (ti.plugin.header->flags & MOERT_CAP_WGRAD_OVERWRITE));
    moert_result rc = vt->grouped_gemm(ti.ctx, NULL, &args);
    args.overwrite_grad_weight = 0;
    if (rc != MOERT_OK) {
        fprintf(stderr, "%s: grouped_gemm failed: %s\n", label, moert_host_take_error(ti.host));
        test_failures++;
    }
    /* WGRAD twice: the second call accumulates onto the first (which overwrote grad_weight when asked, zeros for an
     * expert without rows: as if the gradient had been zeroed before) */
    int repeats = pass == MOERT_GEMM_WGRAD ? 2 : 1;
    if (pass == MOERT_GEMM_WGRAD) EXPECT_OK(vt->grouped_gemm(ti.ctx, NULL, &args));

    /* tolerance of the result against fp64: the operands' rounding plus the output's storage */
    double tol = a == ARITH_FP64 ? 1e-15 : a == ARITH_FP32 ? 1e-6 : 1.6e-2;
    if (act == MOERT_BF16 || (pass == MOERT_GEMM_WGRAD && wdt == MOERT_BF16)) tol += 8e-3;
    const int64_t K = g.k_in, N = g.n_out;
    const moert_tensor *out = pass == MOERT_GEMM_FORWARD ? &g.output
                              : pass == MOERT_GEMM_DGRAD ? &g.grad_input
                                                         : &g.grad_weight;
    const int64_t cols = pass == MOERT_GEMM_DGRAD ? K : N;
    int64_t row0 = 0;
    for (int64_t e = 0; e < EXPERTS; e++) {
        const int64_t m = counts[e];
        if (pass == MOERT_GEMM_WGRAD) {
            for (int64_t i = 0; i < K; i++)
                for (int64_t j = 0; j < N; j++) {
                    int64_t at = e * K * N + i * N + j;
                    double before = overwrite ? 0.0 : g.grad_weight_before[at], want = before, exact = before;
                    ref_dot d = {0, 0, 0};
                    if (m > 0) {
                        d = reference_element(&g, pass, a, e, row0, m, i, j);
                        for (int r = 0; r < repeats; r++) { /* added in double, rounded once to wdt */
                            want = stored(want + d.value, wdt);
                            exact += d.exact;
                        }
                    }
                    compare(label, moert_load(out, at), want, exact, repeats * d.abs_sum + fabs(before), tol);
                }
        } else {
            for (int64_t i = 0; i < m; i++)
                for (int64_t j = 0; j < cols; j++) {
                    ref_dot d = reference_element(&g, pass, a, e, row0, m, i, j);
                    compare(label, moert_load(out, (row0 + i) * cols + j), stored(d.value, act), d.exact, d.abs_sum,
                            tol);
                }
        }
        row0 += m;
    }
    if (pass != MOERT_GEMM_WGRAD) { /* padding rows untouched */
        double sentinel = stored(pass == MOERT_GEMM_FORWARD ? 77.0 : -55.0, act);
        int touched = 0;
        for (int64_t i = row0 * cols; i < g.rows * cols; i++) touched += moert_load(out, i) != sentinel;
        if (touched) fprintf(stderr, "%s: %d padding elements written\n", label, touched);
        EXPECT_EQ_INT(touched, 0);
    }
    free_data(&g);
    test_instance_close(&ti);
}

/* Every pass of both GEMMs in one mode. */
static void check_mode(const char *mode, moert_dtype act, moert_dtype wdt, arith a)
{
    static const int64_t counts_sets[3][EXPERTS] = {{4, 0, 7}, {0, 0, 0}, {1, 9, 0}};
    for (int which = 0; which < 2; which++)
        for (int pass = 0; pass < 3; pass++)
            for (int s = 0; s < 3; s++)
                for (int overwrite = 0; overwrite <= (pass == MOERT_GEMM_WGRAD); overwrite++)
                    check_pass(mode, act, wdt, a, (moert_gemm_weight)which, (moert_gemm_pass)pass, counts_sets[s],
                               1000 + (uint64_t)(which * 10 + pass * 3 + s), overwrite);
}

/* bf16 mode must really round its operands: on fp32 data it differs from fp32 mode. */
static void check_bf16_rounds(void)
{
    const int64_t counts[EXPERTS] = {5, 3, 4};
    double diff_max = 0, scale = 0;
    moert_layer_info layer = test_layer(HIDDEN, FFN, EXPERTS, 2, 16, 1, 0, MOERT_F32);
    test_instance bf, f32;
    EXPECT_OK(test_instance_open(&bf, MOERT_KIND_PRECISION, PLUGIN, "{\"mode\": \"bf16\"}", &layer, NULL, 0, 1));
    EXPECT_OK(test_instance_open(&f32, MOERT_KIND_PRECISION, PLUGIN, "{\"mode\": \"fp32\"}", &layer, NULL, 0, 1));
    if (bf.ctx && f32.ctx) {
        gemm_data g;
        make_data(&g, MOERT_GEMM_FC1, MOERT_F32, MOERT_F32, counts, 5);
        moert_tensor out2 = make_tensor(MOERT_F32, 2, g.rows, g.n_out, 0);
        moert_tensor tpe = moert_tensor_1d((void *)counts, moert_cpu(), MOERT_I64, EXPERTS);
        moert_grouped_gemm_args args = {.struct_size = sizeof args,
                                        .which = MOERT_GEMM_FC1,
                                        .pass = MOERT_GEMM_FORWARD,
                                        .tokens_per_expert = &tpe,
                                        .tokens_per_expert_host = counts, /* the host copy serves as well */
                                        .input = &g.input,
                                        .weight = &g.weight,
                                        .output = &g.output};
        EXPECT_OK(((const moert_precision_v1 *)bf.plugin.header)->grouped_gemm(bf.ctx, NULL, &args));
        args.output = &out2;
        args.tokens_per_expert = NULL;
        EXPECT_OK(((const moert_precision_v1 *)f32.plugin.header)->grouped_gemm(f32.ctx, NULL, &args));
        for (int64_t i = 0; i < 12 * g.n_out; i++) {
            diff_max = fmax(diff_max, fabs(moert_load(&g.output, i) - moert_load(&out2, i)));
            scale = fmax(scale, fabs(moert_load(&out2, i)));
        }
        EXPECT(diff_max > 1e-4 * scale); /* bf16 keeps 8 significant bits: the results differ visibly */
        EXPECT(diff_max < 3e-2 * scale);
        free(out2.data);
        free_data(&g);
    }
    test_instance_close(&bf);
    test_instance_close(&f32);
}

/* A call that must fail with `code` and a message containing `needle`. */
static void expect_gemm_error(test_instance *ti, moert_grouped_gemm_args *args, moert_result code, const char *needle)
{
    moert_result rc = ((const moert_precision_v1 *)ti->plugin.header)->grouped_gemm(ti->ctx, NULL, args);
    const char *m = moert_host_take_error(ti->host);
    if (rc != code || !strstr(m, needle)) {
        fprintf(stderr, "gemm error: got %s \"%s\", expected %s with \"%s\"\n", moert_result_name(rc), m,
                moert_result_name(code), needle);
        test_failures++;
    }
}

static void check_errors(void)
{
    const int64_t counts[EXPERTS] = {4, 0, 7};
    moert_layer_info layer = test_layer(HIDDEN, FFN, EXPERTS, 2, 16, 1, 0, MOERT_F32);
    test_instance ti;
    EXPECT_OK(test_instance_open(&ti, MOERT_KIND_PRECISION, PLUGIN, "{}", &layer, NULL, 0, 1));
    if (!ti.ctx) return;
    gemm_data g;
    make_data(&g, MOERT_GEMM_FC1, MOERT_F32, MOERT_F32, counts, 9); /* rows 13 */
    moert_tensor tpe = moert_tensor_1d((void *)counts, moert_cpu(), MOERT_I64, EXPERTS);
    moert_grouped_gemm_args base = {.struct_size = sizeof base,
                                    .which = MOERT_GEMM_FC1,
                                    .pass = MOERT_GEMM_FORWARD,
                                    .tokens_per_expert = &tpe,
                                    .input = &g.input,
                                    .weight = &g.weight,
                                    .grad_output = &g.grad_output,
                                    .output = &g.output,
                                    .grad_input = &g.grad_input,
                                    .grad_weight = &g.grad_weight};
    moert_grouped_gemm_args a = base;

    moert_tensor out_bad = g.output;
    out_bad.shape[1] = 9;
    out_bad.strides[0] = 9;
    a.output = &out_bad;
    expect_gemm_error(&ti, &a, MOERT_ERR_INVALID_ARGUMENT,
                      "grouped_gemm(fc1, forward): output has shape [13, 9], expected [13, 10] "
                      "(rows of input, 2*ffn_hidden)");
    a = base;
    a.which = MOERT_GEMM_FC2; /* fc1's tensors given as fc2's */
    expect_gemm_error(&ti, &a, MOERT_ERR_INVALID_ARGUMENT,
                      "grouped_gemm(fc2, forward): input has shape [13, 6], expected [13, 5] (rows of input, "
                      "ffn_hidden)");
    a = base;
    moert_tensor w_bad = moert_tensor_3d(g.weight.data, moert_cpu(), MOERT_F32, EXPERTS, FFN, 2 * FFN);
    a.weight = &w_bad;
    expect_gemm_error(&ti, &a, MOERT_ERR_INVALID_ARGUMENT,
                      "grouped_gemm(fc1, forward): weight has shape [3, 5, 10], expected [3, 6, 10] "
                      "(num_local_experts, hidden, 2*ffn_hidden)");
    a = base;
    a.pass = MOERT_GEMM_DGRAD;
    moert_tensor gi_bad = moert_tensor_2d(g.grad_input.data, moert_cpu(), MOERT_F32, 12, HIDDEN);
    a.grad_input = &gi_bad;
    expect_gemm_error(&ti, &a, MOERT_ERR_INVALID_ARGUMENT,
                      "grouped_gemm(fc1, dgrad): grad_input has shape [12, 6], expected [13, 6] "
                      "(rows of grad_output, hidden)");
    a = base;
    a.pass = MOERT_GEMM_WGRAD;
    a.grad_weight = NULL;
    expect_gemm_error(&ti, &a, MOERT_ERR_INVALID_ARGUMENT, "grouped_gemm(fc1, wgrad): grad_weight is NULL");
    a = base;
    const int64_t too_many[EXPERTS] = {4, 3, 7};
    a.tokens_per_expert_host = too_many;
    expect_gemm_error(&ti, &a, MOERT_ERR_INVALID_ARGUMENT,
                      "grouped_gemm(fc1, forward): tokens_per_expert sums to 14 rows but input has only 13");
    const int64_t negative[EXPERTS] = {4, -1, 7};
    a.tokens_per_expert_host = negative;
    expect_gemm_error(&ti, &a, MOERT_ERR_INVALID_ARGUMENT, "tokens_per_expert[1] is -1, expected >= 0");
    a = base;
    moert_tensor tpe_short = moert_tensor_1d((void *)counts, moert_cpu(), MOERT_I64, 2);
    a.tokens_per_expert = &tpe_short;
    expect_gemm_error(&ti, &a, MOERT_ERR_INVALID_ARGUMENT,
                      "tokens_per_expert is int64 [2], expected int64 [3] (num_local_experts)");
    a.tokens_per_expert = NULL;
    expect_gemm_error(&ti, &a, MOERT_ERR_INVALID_ARGUMENT,
                      "tokens_per_expert and tokens_per_expert_host are both NULL");
    a = base;
    moert_tensor in_i32 = g.input;
    in_i32.dtype = MOERT_I32;
    a.input = &in_i32;
    expect_gemm_error(&ti, &a, MOERT_ERR_UNSUPPORTED, "input has dtype int32, expected fp32, fp64, bf16 or fp16");
    a = base;
    a.struct_size = 8;
    expect_gemm_error(&ti, &a, MOERT_ERR_INVALID_ARGUMENT, "args.struct_size is 8");
    a = base;
    a.pass = (moert_gemm_pass)7;
    expect_gemm_error(&ti, &a, MOERT_ERR_INVALID_ARGUMENT, "pass is 7, expected forward (0), dgrad (1) or wgrad (2)");
    free_data(&g);
    test_instance_close(&ti);

    /* a bad option value names the key and the choices */
    EXPECT_EQ_INT(test_instance_open(&ti, MOERT_KIND_PRECISION, PLUGIN, "{\"mode\": \"fp16\"}", &layer, NULL, 0, 1),
                  MOERT_ERR_CONFIG);
    EXPECT_ERROR_CONTAINS("mode");
    EXPECT_ERROR_CONTAINS("bf16");
    test_instance_close(&ti);
    EXPECT_EQ_INT(
        test_instance_open(&ti, MOERT_KIND_PRECISION, PLUGIN, "{\"wgrad_gemm\": \"fast\"}", &layer, NULL, 0, 1),
        MOERT_ERR_CONFIG);
    EXPECT_ERROR_CONTAINS("wgrad_gemm");
    EXPECT_ERROR_CONTAINS("kernel");
    test_instance_close(&ti);
    /* the kernel mode makes no cuBLASLt handle: WGRAD cannot be asked of cuBLASLt there */
    EXPECT_EQ_INT(test_instance_open(&ti, MOERT_KIND_PRECISION, PLUGIN,
                                     "{\"gemm\": \"kernel\", \"wgrad_gemm\": \"cublaslt\"}", &layer, NULL, 0, 1),
                  MOERT_ERR_CONFIG);
    EXPECT_ERROR_CONTAINS("config error at $.precision.wgrad_gemm");
    test_instance_close(&ti);
    /* accepted choices open on the CPU, where they change nothing */
    EXPECT_EQ_INT(test_instance_open(&ti, MOERT_KIND_PRECISION, PLUGIN,
                                     "{\"gemm\": \"cublaslt\", \"wgrad_gemm\": \"kernel\"}", &layer, NULL, 0, 1),
                  MOERT_OK);
    test_instance_close(&ti);
    /* gemm_sms and wgrad_sms: an SM count, 0 (all) or more; a negative or mistyped one names the key */
    static const char *const bad_sms[] = {"{\"gemm_sms\": -1}",  "{\"gemm_sms\": \"108\"}",  "{\"gemm_sms\": 1.5}",
                                          "{\"wgrad_sms\": -1}", "{\"wgrad_sms\": \"108\"}", "{\"wgrad_sms\": 4097}"};
    for (size_t i = 0; i < sizeof bad_sms / sizeof bad_sms[0]; i++) {
        EXPECT_EQ_INT(test_instance_open(&ti, MOERT_KIND_PRECISION, PLUGIN, bad_sms[i], &layer, NULL, 0, 1),
                      MOERT_ERR_CONFIG);
        EXPECT_ERROR_CONTAINS(i < 3 ? "gemm_sms" : "wgrad_sms");
        test_instance_close(&ti);
    }
    EXPECT_EQ_INT(test_instance_open(&ti, MOERT_KIND_PRECISION, PLUGIN, "{\"gemm_sms\": 108, \"wgrad_sms\": 100}",
                                     &layer, NULL, 0, 1),
                  MOERT_OK);
    test_instance_close(&ti);
    /* a layer on a device the plugin has no path for names the device (and, without CUDA, the build) */
    test_expect_device_refused(MOERT_KIND_PRECISION, PLUGIN, &layer, "the bf16 precision plugin");
}

int main(void)
{
    check_mode("fp64", MOERT_F64, MOERT_F64, ARITH_FP64);
    check_mode("auto", MOERT_F64, MOERT_F64, ARITH_FP64);
    check_mode("fp32", MOERT_F32, MOERT_F32, ARITH_FP32);
    check_mode("auto", MOERT_F32, MOERT_F32, ARITH_FP32);
    check_mode("bf16", MOERT_BF16, MOERT_F32, ARITH_BF16); /* bf16 activations, fp32 master weights */
    check_mode("auto", MOERT_BF16, MOERT_BF16, ARITH_BF16);
    check_mode("bf16", MOERT_F32, MOERT_F32, ARITH_BF16); /* fp32 data, bf16 arithmetic: operands rounded */
    check_mode("bf16", MOERT_F64, MOERT_F64, ARITH_BF16);
    check_mode("fp64", MOERT_BF16, MOERT_F32, ARITH_FP64); /* bf16 storage, fp64 arithmetic */
    check_bf16_rounds();
    check_errors();
    return test_finish("test_precision_bf16");
}
