/* SPDX-License-Identifier: Apache-2.0 */
/* GPU test of the fp8 precision plugin's CUDA path against its CPU reference (precision_fp8_cpu.c):
 * - the CUDA handle directly, for each recipe (current, delayed, blockwise; hybrid and e4m3; power-of-2 scales on
 *   and off), both weights and every pass, with ragged experts (one with 0 rows, one with 5, one past 256):
 *   the quantized operands (FP8 bytes in the GEMM's layout, zero padding, and every scale factor 1/scale) must equal
 *   the CPU quantizer's bit for bit, and the GEMM results must be within fp32-accumulation tolerance (relative
 *   Frobenius 1e-3 on fp32, 4e-3 on bf16 outputs: see TOL_BF16) of the CPU's; padding rows untouched. Blockwise
 *   FORWARD/DGRAD activations are stored per expert at a 16-row-aligned offset: their padding rows must be zero
 *   bytes with factor 1; a call with experts of 3, 17, 0 and 41 rows checks that no expert's padded matmul spills
 *   into another's rows or past the last one's (with and without the capacity given). Two steps with end_step between them (the weights change,
 *   the delayed recipe's histories and scales must equal the CPU's bit for bit), and a weight changed without
 *   end_step must not be seen (the step's FP8 copy is kept).
 *   When a blockwise GEMM disagrees, every scale-tensor layout of the handle is tried and the one cuBLASLt reads is
 *   printed (diagnosis for a cuBLASLt version whose layout differs).
 * - the plugin through a CUDA rank's host (pool, stream), against the CPU plugin: each pass, counts on the host and
 *   on the device only; WGRAD overwriting grad_weight (an expert with no rows zeroed; no rows at all: all zero);
 *   refused configurations.
 * Prints a table last. Exits 77 without a GPU, or without one that has FP8 tensor cores (compute capability 9.0). */
#include "test_util.h"

#ifndef MOERT_HAVE_CUDA

int main(void)
{
    printf("gpu_fp8: built without CUDA, skipped\n");
    return TEST_SKIP;
}

#else

#include <cuda_runtime_api.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>

#include "cuda/device.h"
#include "cuda/pool.h"
#include "fp8_convert.h"
#include "gpu_test_util.h"
#include "moert/precision.h"
#include "precision_fp8_cpu.h"
#include "precision_fp8_cuda.h"

#define EXPERTS  4
#define PAD_ROWS 3    /* rows past the counts: never read, never written */
#define TOL      1e-3 /* fp32 outputs (dW accumulated in fp32): accumulation order only */
/* bf16 outputs: the GPU and the CPU accumulate the same FP8 products in fp32 in a different order, then both round
 * to bf16. An element whose fp32 sum lies near a bf16 rounding boundary can land one bf16 ulp apart, which is up to
 * 2^-8 = 3.9e-3 of its magnitude; so the relative Frobenius error is bounded by about 2^-8 (all elements flipped)
 * plus the fp32 order error (~1e-6). 1e-3 failed on H100 at 1.25e-3 with 0 wrong elements beyond that. */
#define TOL_BF16 4e-3

/* The tolerance of an output of dtype dt (see TOL, TOL_BF16). */
static double tol_for(moert_dtype dt) { return dt == MOERT_BF16 ? TOL_BF16 : TOL; }

/* ---- the result table ---- */

typedef struct row {
    char what[128];
    double err, tol;
    int64_t diffs; /* bytes or bits that differ (-1: not counted) */
} row;

static row table[1024];
static int table_len, table_dropped; /* rows past the table are still checked, only not printed */

/* Records one check: err <= tol and no differing bytes. */
static void record(const char *what, double err, double tol, int64_t diffs)
{
    if (table_len < (int)(sizeof table / sizeof table[0])) {
        row *r = &table[table_len++];
        snprintf(r->what, sizeof r->what, "%s", what);
        r->err = err;
        r->tol = tol;
        r->diffs = diffs;
    } else {
        table_dropped++;
    }
    if (!(err <= tol) || diffs > 0) {
        fprintf(stderr, "FAIL %s: error %.3g (tolerance %.3g), %lld differ\n", what, err, tol, (long long)diffs);
        test_failures++;
    }
}

/* ---- host data ---- */

static void *xalloc(size_t bytes)
{
    void *p = calloc(1, bytes + 64);
    if (!p) {
        fprintf(stderr, "out of host memory\n");
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

/* The operands of one layer's GEMMs (bf16 activations, fp32 weights and weight gradients). */
typedef struct gemm_data {
    int64_t K, N, rows, total;
    uint16_t *input, *grad_output; /* bf16 [rows, K], [rows, N] */
    float *weight, *grad_weight;   /* [E, K, N] */
} gemm_data;

/* Random data; expert e's rows are scaled by 2^(e-1) and one row gets an outlier so tiles have different scales. */
static void data_make(gemm_data *d, int64_t K, int64_t N, const int64_t *counts, uint64_t *rng)
{
    d->K = K, d->N = N, d->total = 0;
    for (int e = 0; e < EXPERTS; e++) d->total += counts[e];
    d->rows = d->total + PAD_ROWS;
    d->input = xalloc((size_t)(d->rows * K) * 2);
    d->grad_output = xalloc((size_t)(d->rows * N) * 2);
    d->weight = xalloc((size_t)(EXPERTS * K * N) * 4);
    d->grad_weight = xalloc((size_t)(EXPERTS * K * N) * 4);
    int64_t row = 0;
    for (int e = 0; e < EXPERTS; e++)
        for (int64_t r = 0; r < counts[e]; r++, row++) {
            const double s = ldexp(1.0, e - 1) * (r == 2 ? 40.0 : 1.0);
            for (int64_t k = 0; k < K; k++)
                d->input[row * K + k] = moert_bf16_from_float((float)(s * test_uniform(rng)));
            for (int64_t n = 0; n < N; n++)
                d->grad_output[row * N + n] = moert_bf16_from_float((float)(1e-3 * s * test_uniform(rng)));
        }
    for (int64_t i = d->total * K; i < d->rows * K; i++) d->input[i] = 0x7fc0; /* padding: NaN, never read */
    for (int64_t i = d->total * N; i < d->rows * N; i++) d->grad_output[i] = 0x7fc0;
    for (int64_t i = 0; i < EXPERTS * K * N; i++) {
        d->weight[i] = (float)(0.05 * test_uniform(rng) * (i % 977 == 0 ? 30.0 : 1.0));
        d->grad_weight[i] = (float)test_uniform(rng);
    }
}

static void data_free(gemm_data *d) { free(d->input), free(d->grad_output), free(d->weight), free(d->grad_weight); }

/* ---- the CPU side ---- */

/* One pass on the CPU reference with the same inputs; returns the output ([rows, N], [rows, K] bf16, or
 * [E, K, N] fp32 after accumulating into a copy of grad_weight). */
static void *cpu_pass(const gemm_data *d, moert_gemm_weight which, moert_gemm_pass pass, const int64_t *counts,
                      const fp8_settings *s, fp8_delayed_state *delayed, fp8_scratch *scratch)
{
    const int64_t K = d->K, N = d->N;
    moert_tensor tin = moert_tensor_2d(d->input, moert_cpu(), MOERT_BF16, d->rows, K);
    moert_tensor tgo = moert_tensor_2d(d->grad_output, moert_cpu(), MOERT_BF16, d->rows, N);
    moert_tensor tw = moert_tensor_3d(d->weight, moert_cpu(), MOERT_F32, EXPERTS, K, N);
    void *out = NULL;
    moert_tensor tout;
    if (pass == MOERT_GEMM_WGRAD) {
        out = xalloc((size_t)(EXPERTS * K * N) * 4);
        memcpy(out, d->grad_weight, (size_t)(EXPERTS * K * N) * 4);
        tout = moert_tensor_3d(out, moert_cpu(), MOERT_F32, EXPERTS, K, N);
    } else {
        const int64_t cols = pass == MOERT_GEMM_FORWARD ? N : K;
        out = xalloc((size_t)(d->rows * cols) * 2);
        memset(out, 0xFF, (size_t)(d->rows * cols) * 2);
        tout = moert_tensor_2d(out, moert_cpu(), MOERT_BF16, d->rows, cols);
    }
    moert_grouped_gemm_args a = {.struct_size = sizeof a,
                                 .which = which,
                                 .pass = pass,
                                 .tokens_per_expert_host = counts,
                                 .input = &tin,
                                 .weight = &tw,
                                 .grad_output = &tgo,
                                 .output = &tout,
                                 .grad_input = &tout,
                                 .grad_weight = &tout};
    const fp8_gemm_shape shape = {EXPERTS, K, N, counts};
    if (fp8_cpu_grouped_gemm(&a, &shape, s, delayed, scratch) != MOERT_OK) {
        fprintf(stderr, "cpu reference: out of memory\n");
        exit(1);
    }
    return out;
}

/* ---- scale-tensor layouts (as precision_fp8_cuda.h documents them) ---- */

static int64_t vec_at(int layout, int64_t x, int64_t kb, int64_t X, int64_t KB)
{
    return layout == MOERT_FP8_VEC128_X_MAJOR ? x + kb * X : kb + x * KB;
}

static int64_t blk_at(int layout, int64_t xb, int64_t kb, int64_t XB, int64_t KB)
{
    switch (layout) {
    case MOERT_FP8_BLK_K_MAJOR_PAD4: return kb + xb * ((KB + 3) / 4 * 4);
    case MOERT_FP8_BLK_X_MAJOR_PAD4: return xb + kb * ((XB + 3) / 4 * 4);
    case MOERT_FP8_BLK_K_MAJOR: return kb + xb * KB;
    default: return xb + kb * XB;
    }
}

/* ---- one recipe on the handle ---- */

typedef struct recipe_case {
    const char *name;
    fp8_recipe recipe;
    bool hybrid, power_of_2;
    int64_t hidden, ffn;
    int64_t counts[EXPERTS]; /* rows per expert in one call */
    bool capacity_unknown;   /* the handle is not told the rows' capacity (its buffers grow from the counts) */
    bool kernel;             /* blockwise GEMMs on the wgmma kernel (moert_fp8_cuda_set_block_kernel), not cuBLASLt */
} recipe_case;

/* Whether gpu_pass tells the handle the rows' capacity (moert_fp8_cuda_gemm.capacity). */
static bool pass_capacity = true;

/* Which operand of a pass: its source block S (what the CPU quantizes, [s_rows][s_cols] row-major), how the GPU
 * stores it, and its tiles. */
typedef struct operand_view {
    fp8_operand role;
    bool weight;     /* S = weight[e] [K][N] */
    bool transposed; /* GPU stores S^T ([s_cols][ld]) */
    bool rows_tiles; /* blockwise tiles of 128 rows x 1 column (WGRAD activations); else 1 x 128 */
} operand_view;

static void pass_operands(moert_gemm_pass pass, operand_view *a, operand_view *b)
{
    switch (pass) {
    case MOERT_GEMM_FORWARD:
        *a = (operand_view){FP8_OPERAND_WEIGHT, true, true, false};
        *b = (operand_view){FP8_OPERAND_INPUT, false, false, false};
        break;
    case MOERT_GEMM_DGRAD:
        *a = (operand_view){FP8_OPERAND_WEIGHT, true, false, false};
        *b = (operand_view){FP8_OPERAND_GRAD, false, false, false};
        break;
    default:
        *a = (operand_view){FP8_OPERAND_GRAD, false, true, true};
        *b = (operand_view){FP8_OPERAND_INPUT, false, true, true};
        break;
    }
}

/*
 * Compares one quantized operand of the last GEMM (every active expert) with the CPU quantizer: FP8 bytes (and the
 * zero padding of WGRAD's rows) and the scale factors, bit for bit. Adds the differing bytes / factors to *bytes_bad
 * and *scales_bad.
 */
static void compare_operand(const gemm_data *d, const int64_t *counts, const recipe_case *rc, const fp8_settings *s,
                            fp8_delayed_state *delayed, moert_gemm_weight which, const operand_view *v,
                            const uint8_t *dev_bytes, const float *dev_inv, const int64_t *offsets,
                            const int64_t *scale_offsets, const int64_t *rows16, int64_t *bytes_bad,
                            int64_t *scales_bad)
{
    const int64_t K = d->K, N = d->N;
    const fp8_format f = fp8_operand_format(s, v->role);
    const bool blockwise = rc->recipe == FP8_RECIPE_BLOCKWISE;
    /* blockwise FORWARD/DGRAD activations: [rows16][sc] per expert, zero rows after the real ones (factor 1) */
    const bool padded = blockwise && !v->weight && !v->transposed;
    int64_t row0 = 0;
    for (int e = 0; e < EXPERTS; e++) {
        const int64_t m = counts[e];
        if (m == 0) continue;
        const int64_t sr = v->weight ? K : m, sc = v->weight ? N : (v->role == FP8_OPERAND_GRAD ? N : K);
        double *blk = xalloc((size_t)(sr * sc) * 8);
        for (int64_t i = 0; i < sr; i++)
            for (int64_t j = 0; j < sc; j++)
                blk[i * sc + j] =
                    v->weight ? d->weight[(int64_t)e * K * N + i * N + j]
                              : moert_bf16_to_float(v->role == FP8_OPERAND_GRAD ? d->grad_output[(row0 + i) * N + j]
                                                                                : d->input[(row0 + i) * K + j]);
        int64_t tr = sr, tc = sc;
        if (blockwise) {
            tr = v->weight ? FP8_BLOCK : v->rows_tiles ? FP8_BLOCK : 1;
            tc = v->weight ? FP8_BLOCK : v->rows_tiles ? 1 : FP8_BLOCK;
        }
        const int64_t TR = (sr + tr - 1) / tr, TC = (sc + tc - 1) / tc;
        float *scales = xalloc((size_t)(TR * TC) * 4);
        uint8_t *bytes = xalloc((size_t)(sr * sc));
        const float fixed =
            rc->recipe == FP8_RECIPE_DELAYED ? fp8_delayed_slot(delayed, which, v->role, e)->scale : 0.0f;
        (void)fp8_quantize_block(blk, sr, sc, tr, tc, f, s->power_of_2, fixed, scales, bytes);
        /* bytes: the GPU's [sr][sc] ([rows16][sc] when padded) or [sc][ld] */
        const int64_t ld = v->transposed ? (v->weight ? sr : rows16[e]) : sc;
        const int64_t xr = padded ? rows16[e] : sr; /* rows of the stored operand */
        if (padded && (xr % 16 || xr < sr || xr - sr >= 16)) {
            fprintf(stderr, "expert %d: %lld rows padded to %lld, expected the next multiple of 16\n", e, (long long)sr,
                    (long long)xr);
            (*bytes_bad)++;
            free(blk), free(scales), free(bytes);
            row0 += m;
            continue;
        }
        const int64_t span = v->transposed ? sc * ld : xr * sc;
        uint8_t *got = xalloc((size_t)span);
        from_device(got, dev_bytes + offsets[e], (size_t)span);
        for (int64_t i = 0; i < sr; i++)
            for (int64_t j = 0; j < sc; j++)
                *bytes_bad += got[v->transposed ? j * ld + i : i * sc + j] != bytes[i * sc + j];
        if (v->transposed)
            for (int64_t j = 0; j < sc; j++)
                for (int64_t i = sr; i < ld; i++) *bytes_bad += got[j * ld + i] != 0;
        for (int64_t i = sr * sc; i < xr * sc && padded; i++) *bytes_bad += got[i] != 0;
        /* scale factors: where the GPU keeps tile (ti, tj)'s 1/scale */
        int64_t *at = xalloc((size_t)(TR * TC) * 8), most = 0;
        for (int64_t ti = 0; ti < TR; ti++)
            for (int64_t tj = 0; tj < TC; tj++) {
                int64_t idx = 0;
                if (blockwise && v->weight)
                    idx = v->transposed ? blk_at(MOERT_FP8_BLK_K_MAJOR_PAD4, tj, ti, TC, TR)
                                        : blk_at(MOERT_FP8_BLK_K_MAJOR_PAD4, ti, tj, TR, TC);
                else if (blockwise && v->rows_tiles)
                    idx = vec_at(MOERT_FP8_VEC128_X_MAJOR, tj, ti, sc, (rows16[e] + 127) / 128);
                else if (blockwise)
                    idx = vec_at(MOERT_FP8_VEC128_X_MAJOR, ti, tj, xr, TC);
                at[ti * TC + tj] = idx;
                if (idx + 1 > most) most = idx + 1;
            }
        if (padded && xr * TC > most) most = xr * TC;
        float *inv = xalloc((size_t)most * 4);
        from_device(inv, dev_inv + scale_offsets[e], (size_t)most * 4);
        for (int64_t t = 0; t < TR * TC; t++) {
            const float want = 1.0f / scales[t];
            *scales_bad += memcmp(&inv[at[t]], &want, 4) != 0;
        }
        for (int64_t i = sr; i < xr && padded; i++) /* padding rows: factor 1 (any finite value would do; 1 is ours) */
            for (int64_t tj = 0; tj < TC; tj++)
                *scales_bad += inv[vec_at(MOERT_FP8_VEC128_X_MAJOR, i, tj, xr, TC)] != 1.0f;
        free(blk), free(scales), free(bytes), free(got), free(at), free(inv);
        row0 += m;
    }
}

/* Device copies of a gemm_data. */
typedef struct gemm_dev {
    void *input, *grad_output, *weight;
} gemm_dev;

static void dev_make(gemm_dev *g, const gemm_data *d)
{
    g->input = gpu_upload_new(d->input, (size_t)(d->rows * d->K) * 2);
    g->grad_output = gpu_upload_new(d->grad_output, (size_t)(d->rows * d->N) * 2);
    g->weight = gpu_upload_new(d->weight, (size_t)(EXPERTS * d->K * d->N) * 4);
}

static void dev_free(gemm_dev *g)
{
    CK(cudaFree(g->input));
    CK(cudaFree(g->grad_output));
    CK(cudaFree(g->weight));
}

/* One pass on the handle; returns the output on the host (as cpu_pass does) or NULL on failure. */
static void *gpu_pass(moert_fp8_cuda *h, cudaStream_t stream, const gemm_data *d, const gemm_dev *dv,
                      moert_gemm_weight which, moert_gemm_pass pass, const int64_t *counts, int64_t *padding_bad)
{
    const int64_t K = d->K, N = d->N;
    const size_t wbytes = (size_t)(EXPERTS * K * N) * 4;
    const int64_t cols = pass == MOERT_GEMM_FORWARD ? N : K;
    const size_t obytes = pass == MOERT_GEMM_WGRAD ? wbytes : (size_t)(d->rows * cols) * 2;
    void *dst = pass == MOERT_GEMM_WGRAD ? gpu_upload_new(d->grad_weight, wbytes) : gpu_filled_new(obytes, 0xFF);
    moert_fp8_cuda_gemm gm = {.which = which,
                              .pass = pass,
                              .act_dtype = MOERT_BF16,
                              .weight_dtype = MOERT_F32,
                              .grad_weight_dtype = MOERT_F32,
                              .num_experts = EXPERTS,
                              .rows_per_expert = counts,
                              .capacity = pass_capacity ? d->rows : 0,
                              .k_in = K,
                              .n_out = N,
                              .input = dv->input,
                              .weight = dv->weight,
                              .grad_output = dv->grad_output,
                              .output = dst,
                              .grad_input = dst,
                              .grad_weight = dst};
    void *out = NULL;
    if (moert_fp8_cuda_grouped_gemm(h, stream, &gm) != MOERT_OK) {
        fprintf(stderr, "fp8 cuda grouped_gemm (fc%d, pass %d) failed: %s\n", which + 1, (int)pass, gpu_test_error);
        test_failures++;
    } else {
        out = xalloc(obytes);
        from_device(out, dst, obytes);
        if (pass != MOERT_GEMM_WGRAD) {
            const unsigned char *p = (const unsigned char *)out + (size_t)(d->total * cols) * 2;
            for (size_t i = 0; i < (size_t)(PAD_ROWS * cols) * 2; i++) *padding_bad += p[i] != 0xFF;
        }
    }
    CK(cudaFree(dst));
    return out;
}

/* Elements of a pass's output (before the padding rows) and their dtype. */
static int64_t out_elems(const gemm_data *d, moert_gemm_pass pass, moert_dtype *dtype)
{
    *dtype = pass == MOERT_GEMM_WGRAD ? MOERT_F32 : MOERT_BF16;
    return pass == MOERT_GEMM_FORWARD ? d->total * d->N
           : pass == MOERT_GEMM_DGRAD ? d->total * d->K
                                      : EXPERTS * d->K * d->N;
}

static const char *const pass_names[3] = {"fwd", "dgrad", "wgrad"};

/*
 * A blockwise GEMM disagreed: run it again with each scale layout the handle knows and say which one (if any)
 * cuBLASLt agrees with.
 */
static void diagnose_layout(const recipe_case *rc, const moert_fp8_cuda_config *cfg, cudaStream_t stream,
                            const gemm_data *d, const gemm_dev *dv, moert_gemm_weight which, moert_gemm_pass pass,
                            const int64_t *counts, const void *want)
{
    moert_dtype dt;
    const int64_t n = out_elems(d, pass, &dt);
    for (int vec = 0; vec < 2; vec++)
        for (int blk = 0; blk < 4; blk++) {
            moert_fp8_cuda *h = NULL;
            if (moert_fp8_cuda_create(&gpu_test_host, (moert_device){MOERT_DEVICE_CUDA, 0}, cfg, &h) != MOERT_OK)
                return;
            moert_fp8_cuda_set_scale_layout(h, (moert_fp8_cuda_vec_layout)vec, (moert_fp8_cuda_blk_layout)blk);
            int64_t pad = 0;
            void *got = gpu_pass(h, stream, d, dv, which, pass, counts, &pad);
            if (got) {
                const double err = rel_error(got, want, dt, n);
                printf("  diagnosis %s fc%d %s: vec layout %d, blk layout %d: error %.3g%s\n", rc->name, which + 1,
                       pass_names[pass], vec, blk, err, err <= tol_for(dt) ? "  <- cuBLASLt reads this layout" : "");
                free(got);
            }
            moert_fp8_cuda_destroy(h);
        }
}

/* The delayed recipe's scales on the GPU against the CPU's, bit for bit (every slot). */
static int64_t delayed_scales_differ(moert_fp8_cuda *h, cudaStream_t stream, fp8_delayed_state *delayed)
{
    int64_t bad = 0;
    for (int w = 0; w < 2; w++)
        for (int op = 0; op < 3; op++)
            for (int e = 0; e < EXPERTS; e++) {
                float got = 0;
                if (moert_fp8_cuda_delayed_scale(h, stream, (moert_gemm_weight)w, op, e, &got) != MOERT_OK) return -1;
                const float want = fp8_delayed_slot(delayed, (moert_gemm_weight)w, (fp8_operand)op, e)->scale;
                bad += memcmp(&got, &want, 4) != 0;
            }
    return bad;
}

static void run_case(const recipe_case *rc, cudaStream_t stream)
{
    const int64_t *counts = rc->counts;
    pass_capacity = !rc->capacity_unknown;
    const fp8_settings s = {rc->recipe, rc->hybrid, rc->power_of_2, 4, false, 1};
    const moert_fp8_cuda_config cfg = {(moert_fp8_cuda_recipe)rc->recipe, rc->hybrid, rc->power_of_2, EXPERTS, 4, 0, 1};
    fp8_delayed_state delayed;
    memset(&delayed, 0, sizeof delayed);
    if (!fp8_delayed_init(&delayed, EXPERTS, 4)) exit(1);
    fp8_scratch scratch;
    memset(&scratch, 0, sizeof scratch);
    moert_fp8_cuda *h = NULL;
    if (moert_fp8_cuda_create(&gpu_test_host, (moert_device){MOERT_DEVICE_CUDA, 0}, &cfg, &h) != MOERT_OK ||
        moert_fp8_cuda_set_streams(h, 3) != MOERT_OK ||
        (rc->kernel && moert_fp8_cuda_set_block_kernel(h, 1) != MOERT_OK)) {
        fprintf(stderr, "%s: creating the handle: %s\n", rc->name, gpu_test_error);
        test_failures++;
        moert_fp8_cuda_destroy(h);
        fp8_delayed_free(&delayed);
        return;
    }
    {
        char what[128];
        snprintf(what, sizeof what, "%s: cuBLASLt has every matmul", rc->name);
        const moert_result r = moert_fp8_cuda_check_support(h, rc->hidden, rc->ffn, MOERT_BF16, MOERT_F32, 1);
        if (r != MOERT_OK) printf("%s: %s\n", rc->name, gpu_test_error);
        record(what, r == MOERT_OK ? 0 : 1, 0, 0);
    }
    uint64_t rng = 1234;
    gemm_data data[2];
    gemm_dev dev[2];
    for (int w = 0; w < 2; w++) {
        const int64_t K = w == 0 ? rc->hidden : rc->ffn, N = w == 0 ? 2 * rc->ffn : rc->hidden;
        data_make(&data[w], K, N, counts, &rng);
        dev_make(&dev[w], &data[w]);
    }
    bool diagnosed = false;
    for (int step = 0; step < 2; step++) {
        for (int w = 0; w < 2; w++)
            for (int p = 0; p < 3; p++) {
                const moert_gemm_weight which = (moert_gemm_weight)w;
                const moert_gemm_pass pass = (moert_gemm_pass)p;
                const gemm_data *d = &data[w];
                int64_t padding_bad = 0, bytes_bad = 0, scales_bad = 0;
                void *got = gpu_pass(h, stream, d, &dev[w], which, pass, counts, &padding_bad);
                /* the quantized operands, before the CPU pass records its amaxes (the delayed recipe) */
                if (got) {
                    moert_fp8_cuda_operands ops;
                    moert_fp8_cuda_last_operands(h, &ops);
                    operand_view va, vb;
                    pass_operands(pass, &va, &vb);
                    compare_operand(d, counts, rc, &s, &delayed, which, &va, ops.a, ops.a_scale_inv, ops.a_offset,
                                    ops.a_scale_offset, ops.rows16, &bytes_bad, &scales_bad);
                    compare_operand(d, counts, rc, &s, &delayed, which, &vb, ops.b, ops.b_scale_inv, ops.b_offset,
                                    ops.b_scale_offset, ops.rows16, &bytes_bad, &scales_bad);
                }
                void *want = cpu_pass(d, which, pass, counts, &s, &delayed, &scratch);
                char what[128];
                snprintf(what, sizeof what, "%s step %d fc%d %s: fp8 bytes", rc->name, step + 1, w + 1, pass_names[p]);
                record(what, got ? 0 : INFINITY, 0, bytes_bad);
                snprintf(what, sizeof what, "%s step %d fc%d %s: scale factors", rc->name, step + 1, w + 1,
                         pass_names[p]);
                record(what, got ? 0 : INFINITY, 0, scales_bad);
                moert_dtype dt;
                const int64_t n = out_elems(d, pass, &dt);
                const double err = got ? rel_error(got, want, dt, n) : INFINITY;
                snprintf(what, sizeof what, "%s step %d fc%d %s: vs CPU%s", rc->name, step + 1, w + 1, pass_names[p],
                         pass == MOERT_GEMM_WGRAD ? " (fp32 dW +=)" : "");
                record(what, err, tol_for(dt), padding_bad);
                if (got && !(err <= tol_for(dt)) && rc->recipe == FP8_RECIPE_BLOCKWISE && !diagnosed &&
                    bytes_bad == 0 && scales_bad == 0) {
                    diagnose_layout(rc, &cfg, stream, d, &dev[w], which, pass, counts, want);
                    diagnosed = true;
                }
                free(got);
                free(want);
            }
        /* a weight changed in place within the step is not seen: the step's FP8 copy stays */
        if (step == 1) {
            const gemm_data *d = &data[0];
            int64_t pad = 0;
            void *before = gpu_pass(h, stream, d, &dev[0], MOERT_GEMM_FC1, MOERT_GEMM_FORWARD, counts, &pad);
            float *bumped = xalloc((size_t)(EXPERTS * d->K * d->N) * 4);
            for (int64_t i = 0; i < EXPERTS * d->K * d->N; i++) bumped[i] = d->weight[i] * 1.5f;
            gpu_upload(dev[0].weight, bumped, (size_t)(EXPERTS * d->K * d->N) * 4);
            void *after = gpu_pass(h, stream, d, &dev[0], MOERT_GEMM_FC1, MOERT_GEMM_FORWARD, counts, &pad);
            int64_t differ = before && after ? 0 : -1;
            if (before && after)
                for (int64_t i = 0; i < d->total * d->N; i++)
                    differ += ((uint16_t *)before)[i] != ((uint16_t *)after)[i];
            char what[128];
            snprintf(what, sizeof what, "%s: weight changed within a step unseen", rc->name);
            record(what, differ < 0 ? INFINITY : 0, 0, differ);
            gpu_upload(dev[0].weight, d->weight, (size_t)(EXPERTS * d->K * d->N) * 4);
            free(before), free(after), free(bumped);
        }
        /* the optimizer step: the weights change, end_step on both sides */
        for (int w = 0; w < 2; w++) {
            gemm_data *d = &data[w];
            for (int64_t i = 0; i < EXPERTS * d->K * d->N; i++) d->weight[i] = d->weight[i] * 0.75f + 0.01f;
            gpu_upload(dev[w].weight, d->weight, (size_t)(EXPERTS * d->K * d->N) * 4);
        }
        if (rc->recipe == FP8_RECIPE_DELAYED) fp8_delayed_end_step(&delayed, &s);
        if (moert_fp8_cuda_end_step(h, stream) != MOERT_OK) {
            fprintf(stderr, "%s: end_step failed: %s\n", rc->name, gpu_test_error);
            test_failures++;
        }
        if (rc->recipe == FP8_RECIPE_DELAYED) {
            char what[128];
            snprintf(what, sizeof what, "%s: delayed scales after step %d", rc->name, step + 1);
            const int64_t bad = delayed_scales_differ(h, stream, &delayed);
            record(what, bad < 0 ? INFINITY : 0, 0, bad < 0 ? 0 : bad);
        }
    }
    moert_fp8_cuda_stats st;
    moert_fp8_cuda_get_stats(h, &st);
    printf("%s: %lld matmuls, %lld heuristic queries, %lld plan cache hits, %lld exact-shape fallbacks, %lld weight "
           "quantizations\n",
           rc->name, (long long)st.matmuls, (long long)st.heuristic_queries, (long long)st.cache_hits,
           (long long)st.exact_fallbacks, (long long)st.weight_quantizations);
    for (int w = 0; w < 2; w++) {
        dev_free(&dev[w]);
        data_free(&data[w]);
    }
    moert_fp8_cuda_destroy(h);
    fp8_delayed_free(&delayed);
    fp8_scratch_free(&scratch);
}

/* ---- the plugin through a CUDA rank's host ---- */

/* One pass through the plugin instance (CPU tensors or device copies); the output on the host. overwrite: a WGRAD
 * that asks to overwrite grad_weight (which holds the data's old values). */
static void *plugin_pass(test_instance *ti, bool on_gpu, cudaStream_t stream, const gemm_data *d, void *dev_weight,
                         moert_gemm_weight which, moert_gemm_pass pass, const int64_t *counts, bool host_counts,
                         bool overwrite)
{
    const moert_precision_v1 *vt = (const moert_precision_v1 *)ti->plugin.header;
    const moert_device dev = on_gpu ? (moert_device){MOERT_DEVICE_CUDA, 0} : moert_cpu();
    const int64_t K = d->K, N = d->N;
    const size_t in_b = (size_t)(d->rows * K) * 2, go_b = (size_t)(d->rows * N) * 2,
                 w_b = (size_t)(EXPERTS * K * N) * 4;
    const int64_t cols = pass == MOERT_GEMM_FORWARD ? N : K;
    const size_t out_b = pass == MOERT_GEMM_WGRAD ? w_b : (size_t)(d->rows * cols) * 2;
    void *out = xalloc(out_b);
    if (pass == MOERT_GEMM_WGRAD)
        memcpy(out, d->grad_weight, w_b);
    else
        memset(out, 0xFF, out_b);
    void *input = on_gpu ? gpu_upload_new(d->input, in_b) : d->input;
    void *grad_output = on_gpu ? gpu_upload_new(d->grad_output, go_b) : d->grad_output;
    void *weight = on_gpu ? dev_weight : d->weight; /* on the GPU kept by the caller, as the executor keeps it */
    void *counts_dev = on_gpu ? gpu_upload_new(counts, EXPERTS * 8) : (void *)counts;
    void *result = on_gpu ? gpu_upload_new(out, out_b) : out;
    moert_tensor tin = moert_tensor_2d(input, dev, MOERT_BF16, d->rows, K);
    moert_tensor tgo = moert_tensor_2d(grad_output, dev, MOERT_BF16, d->rows, N);
    moert_tensor tw = moert_tensor_3d(weight, dev, MOERT_F32, EXPERTS, K, N);
    moert_tensor tc = moert_tensor_1d(counts_dev, dev, MOERT_I64, EXPERTS);
    moert_tensor tout = moert_tensor_2d(result, dev, MOERT_BF16, d->rows, cols);
    moert_tensor tgw = moert_tensor_3d(result, dev, MOERT_F32, EXPERTS, K, N);
    moert_grouped_gemm_args a = {.struct_size = sizeof a,
                                 .which = which,
                                 .pass = pass,
                                 .tokens_per_expert = &tc,
                                 .tokens_per_expert_host = host_counts ? counts : NULL,
                                 .overwrite_grad_weight = overwrite};
    switch (pass) {
    case MOERT_GEMM_FORWARD: a.input = &tin, a.weight = &tw, a.output = &tout; break;
    case MOERT_GEMM_DGRAD: a.grad_output = &tgo, a.weight = &tw, a.grad_input = &tout; break;
    default: a.input = &tin, a.grad_output = &tgo, a.grad_weight = &tgw; break;
    }
    moert_result r = vt->grouped_gemm(ti->ctx, on_gpu ? (moert_stream)stream : NULL, &a);
    if (r != MOERT_OK) {
        fprintf(stderr, "plugin grouped_gemm (%s, fc%d %s) failed: %s\n", on_gpu ? "cuda" : "cpu", which + 1,
                pass_names[pass], moert_host_take_error(ti->host));
        test_failures++;
        free(out);
        out = NULL;
    }
    if (on_gpu) {
        CK(cudaStreamSynchronize(stream));
        if (out) from_device(out, result, out_b);
        CK(cudaFree(input));
        CK(cudaFree(grad_output));
        CK(cudaFree(counts_dev));
        CK(cudaFree(result));
    }
    return out;
}

/*
 * WGRAD overwriting grad_weight (the first micro-batch; the plugin declares MOERT_CAP_WGRAD_OVERWRITE) into a
 * gradient holding old values: CUDA against the CPU plugin, the expert with no rows zeroed (diffs: its nonzero
 * values); then with no rows at all (counts on the device only): every value zero.
 */
static void check_plugin_overwrite(test_instance *cpu, test_instance *gpu, cudaStream_t stream, const gemm_data *d,
                                   const int64_t *counts, void *dev_weight, moert_gemm_weight w, const char *options)
{
    static const int64_t none[EXPERTS] = {0, 0, 0, 0};
    const int64_t n = EXPERTS * d->K * d->N, slice = d->K * d->N;
    char what[128];
    EXPECT(gpu->plugin.header->flags & MOERT_CAP_WGRAD_OVERWRITE);
    void *want = plugin_pass(cpu, false, stream, d, NULL, w, MOERT_GEMM_WGRAD, counts, true, true);
    void *got = plugin_pass(gpu, true, stream, d, dev_weight, w, MOERT_GEMM_WGRAD, counts, true, true);
    int64_t stale = 0;
    for (int e = 0; e < EXPERTS; e++)
        if (counts[e] == 0 && got)
            for (int64_t i = e * slice; i < (e + 1) * slice; i++) stale += ((const float *)got)[i] != 0.0f;
    snprintf(what, sizeof what, "plugin %s fc%d wgrad overwrite", options, w + 1);
    record(what, got && want ? rel_error(got, want, MOERT_F32, n) : INFINITY, TOL, stale);
    free(got), free(want);
    got = plugin_pass(gpu, true, stream, d, dev_weight, w, MOERT_GEMM_WGRAD, none, false, true);
    stale = got ? 0 : n;
    for (int64_t i = 0; got && i < n; i++) stale += ((const float *)got)[i] != 0.0f;
    snprintf(what, sizeof what, "plugin %s fc%d wgrad overwrite, no rows", options, w + 1);
    record(what, 0, 0, stale);
    free(got);
}

static void run_plugin(const char *options, moert_cuda_pool *pool, cudaStream_t stream)
{
    const int64_t H = 256, F = 128;
    moert_layer_info layer = test_layer(H, F, EXPERTS, 2, 512, 1, 0, MOERT_BF16);
    moert_layer_info gpu_layer = layer;
    gpu_layer.device = (moert_device){MOERT_DEVICE_CUDA, 0};
    test_instance cpu, gpu;
    memset(&cpu, 0, sizeof cpu);
    memset(&gpu, 0, sizeof gpu);
    if (test_instance_open(&cpu, MOERT_KIND_PRECISION, "fp8", options, &layer, NULL, 0, 1) != MOERT_OK ||
        test_instance_open_cuda(&gpu, MOERT_KIND_PRECISION, "fp8", options, &gpu_layer, NULL, 0, 1, pool, NULL,
                                (moert_stream)stream) != MOERT_OK) {
        fprintf(stderr, "%s: opening the plugin: %s\n", options, moert_error_message());
        test_failures++;
        test_instance_close(&cpu);
        test_instance_close(&gpu);
        return;
    }
    const int64_t counts[EXPERTS] = {90, 0, 37, 5};
    uint64_t rng = 99;
    gemm_data data[2];
    void *weights[2];
    for (int w = 0; w < 2; w++) {
        data_make(&data[w], w == 0 ? H : F, w == 0 ? 2 * F : H, counts, &rng);
        weights[w] = gpu_upload_new(data[w].weight, (size_t)(EXPERTS * data[w].K * data[w].N) * 4);
    }
    for (int step = 0; step < 2; step++) {
        for (int w = 0; w < 2; w++) {
            const gemm_data *d = &data[w];
            for (int p = 0; p < 3; p++) {
                const bool host_counts = !(step == 1 && p == 0); /* step 2's forward: counts on the device only */
                void *want = plugin_pass(&cpu, false, stream, d, NULL, (moert_gemm_weight)w, (moert_gemm_pass)p, counts,
                                         true, false);
                void *got = plugin_pass(&gpu, true, stream, d, weights[w], (moert_gemm_weight)w, (moert_gemm_pass)p,
                                        counts, host_counts, false);
                moert_dtype dt;
                const int64_t n = out_elems(d, (moert_gemm_pass)p, &dt);
                int64_t padding_bad = 0;
                if (got && p != MOERT_GEMM_WGRAD) {
                    const int64_t cols = p == MOERT_GEMM_FORWARD ? d->N : d->K;
                    const unsigned char *q = (const unsigned char *)got + (size_t)(d->total * cols) * 2;
                    for (size_t i = 0; i < (size_t)(PAD_ROWS * cols) * 2; i++) padding_bad += q[i] != 0xFF;
                }
                char what[128];
                snprintf(what, sizeof what, "plugin %s step %d fc%d %s%s", options, step + 1, w + 1, pass_names[p],
                         host_counts ? "" : " (device counts)");
                record(what, got && want ? rel_error(got, want, dt, n) : INFINITY, tol_for(dt), padding_bad);
                free(got);
                free(want);
            }
            if (step == 0)
                check_plugin_overwrite(&cpu, &gpu, stream, d, counts, weights[w], (moert_gemm_weight)w, options);
        }
        /* the optimizer step: new values in the same weight buffers (and new activations), then end_step */
        for (int w = 0; w < 2; w++) {
            data_free(&data[w]);
            data_make(&data[w], w == 0 ? H : F, w == 0 ? 2 * F : H, counts, &rng);
            gpu_upload(weights[w], data[w].weight, (size_t)(EXPERTS * data[w].K * data[w].N) * 4);
        }
        const moert_precision_v1 *vc = (const moert_precision_v1 *)cpu.plugin.header;
        const moert_precision_v1 *vg = (const moert_precision_v1 *)gpu.plugin.header;
        if (vc->end_step(cpu.ctx, NULL) != MOERT_OK || vg->end_step(gpu.ctx, (moert_stream)stream) != MOERT_OK) {
            fprintf(stderr, "%s: end_step failed: %s\n", options, moert_host_take_error(gpu.host));
            test_failures++;
        }
    }
    CK(cudaStreamSynchronize(stream));
    for (int w = 0; w < 2; w++) {
        data_free(&data[w]);
        CK(cudaFree(weights[w]));
    }
    test_instance_close(&cpu);
    test_instance_close(&gpu);
}

/* Configurations the CUDA path refuses at init, with a message naming why. */
static void run_refusals(moert_cuda_pool *pool, cudaStream_t stream)
{
    struct {
        int64_t hidden, ffn;
        moert_dtype dtype;
        const char *needle;
    } cases[] = {{256, 128, MOERT_F16, "takes bf16 or fp32 activations"}, {200, 128, MOERT_BF16, "multiples of 16"}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        moert_layer_info layer = test_layer(cases[i].hidden, cases[i].ffn, EXPERTS, 2, 64, 1, 0, cases[i].dtype);
        layer.device = (moert_device){MOERT_DEVICE_CUDA, 0};
        test_instance ti;
        memset(&ti, 0, sizeof ti);
        const moert_result r = test_instance_open_cuda(&ti, MOERT_KIND_PRECISION, "fp8", "{}", &layer, NULL, 0, 1, pool,
                                                       NULL, (moert_stream)stream);
        const char *msg = moert_error_message();
        const bool ok = r == MOERT_ERR_UNSUPPORTED && strstr(msg, cases[i].needle) && strstr(msg, "cuda:0");
        char what[128];
        snprintf(what, sizeof what, "refused: %s, hidden %lld", moert_dtype_name(cases[i].dtype),
                 (long long)cases[i].hidden);
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
        printf("gpu_fp8: no GPU (%s), skipped\n", err != cudaSuccess ? cudaGetErrorString(err) : "0 devices");
        return TEST_SKIP;
    }
    struct cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    if (prop.major < 9) {
        printf("gpu_fp8: %s (compute capability %d.%d) has no FP8 tensor cores, skipped\n", prop.name, prop.major,
               prop.minor);
        return TEST_SKIP;
    }
    printf("gpu_fp8: %s\n", prop.name);
    CK(cudaSetDevice(0));
    cudaStream_t raw_stream;
    CK(cudaStreamCreateWithFlags(&raw_stream, cudaStreamNonBlocking));
    /* experts of 0, 37, 5 and 300 rows; the odd-count cases put 3, 17, 0 and 41 rows in one call (each padded to 16
     * on the GPU: an expert's padded rows must not spill into the next one's, nor the last one's past the rows) */
    static const recipe_case cases[] = {
        {"current hybrid", FP8_RECIPE_CURRENT, true, false, 256, 128, {0, 37, 5, 300}, false, false},
        {"current e4m3 pow2", FP8_RECIPE_CURRENT, false, true, 256, 128, {0, 37, 5, 300}, false, false},
        {"delayed hybrid", FP8_RECIPE_DELAYED, true, false, 256, 128, {0, 37, 5, 300}, false, false},
        {"blockwise hybrid pow2", FP8_RECIPE_BLOCKWISE, true, true, 256, 128, {0, 37, 5, 300}, false, false},
        {"blockwise e4m3", FP8_RECIPE_BLOCKWISE, false, false, 256, 128, {0, 37, 5, 300}, false, false},
        {"blockwise ragged F=192", FP8_RECIPE_BLOCKWISE, false, true, 384, 192, {0, 37, 5, 300}, false, false},
        {"blockwise 3,17,0,41", FP8_RECIPE_BLOCKWISE, false, true, 256, 128, {3, 17, 0, 41}, false, false},
        /* sizes that are not multiples of 64: the transposing quantizer's last column tile is partial */
        {"blockwise H=272 F=208", FP8_RECIPE_BLOCKWISE, true, false, 272, 208, {0, 37, 5, 300}, false, false},
        {"current hybrid H=272 F=208", FP8_RECIPE_CURRENT, true, false, 272, 208, {0, 37, 5, 300}, false, false},
        {"blockwise hybrid 3,17,0,41 nocap", FP8_RECIPE_BLOCKWISE, true, false, 256, 128, {3, 17, 0, 41}, true, false},
        {"blockwise e4m3 kernel", FP8_RECIPE_BLOCKWISE, false, false, 256, 128, {0, 37, 5, 300}, false, true},
        {"blockwise hybrid pow2 kernel", FP8_RECIPE_BLOCKWISE, true, true, 256, 128, {0, 37, 5, 300}, false, true},
        {"blockwise ragged F=192 kernel", FP8_RECIPE_BLOCKWISE, false, true, 384, 192, {0, 37, 5, 300}, false, true},
        {"blockwise hybrid 3,17,0,41 nocap kernel",
         FP8_RECIPE_BLOCKWISE,
         true,
         false,
         256,
         128,
         {3, 17, 0, 41},
         true,
         true},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) run_case(&cases[i], raw_stream);
    CK(cudaStreamDestroy(raw_stream));

    /* through the plugin, on a CUDA rank's host */
    moert_plugin keep;
    memset(&keep, 0, sizeof keep);
    EXPECT_OK(moert_plugin_load(MOERT_KIND_PRECISION, "fp8", &keep));
    moert_cuda_pool *pool = NULL;
    moert_stream stream = NULL;
    if (moert_cuda_set_device(0) != MOERT_OK || moert_cuda_pool_create(0, &pool) != MOERT_OK ||
        moert_cuda_stream_create(0, &stream) != MOERT_OK) {
        fprintf(stderr, "setting up cuda:0: %s\n", moert_error_message());
        test_failures++;
    } else {
        run_plugin("{\"recipe\": \"current\"}", pool, (cudaStream_t)stream);
        run_plugin("{\"recipe\": \"delayed\", \"amax_history_len\": 3}", pool, (cudaStream_t)stream);
        /* "auto": the kernel for forward and dgrad, cuBLASLt for wgrad (on compute capability 9.0) */
        run_plugin("{\"recipe\": \"blockwise\", \"gemm_streams\": 2}", pool, (cudaStream_t)stream);
        run_plugin("{\"recipe\": \"blockwise\", \"gemm\": \"cublaslt\"}", pool, (cudaStream_t)stream);
        run_plugin("{\"recipe\": \"blockwise\", \"gemm\": \"kernel\"}", pool, (cudaStream_t)stream);
        /* unquantized weight gradients (the bf16 plugin's cuBLASLt loop) against the CPU's (its reference): an FP8
         * WGRAD would miss by the FP8 error, far above the tolerance */
        run_plugin("{\"recipe\": \"blockwise\", \"gemm\": \"kernel\", \"fp8_wgrad\": false}", pool,
                   (cudaStream_t)stream);
        run_refusals(pool, (cudaStream_t)stream);
    }
    if (stream) moert_cuda_stream_synchronize(stream);
    if (pool) moert_cuda_pool_destroy(pool);
    if (stream) moert_cuda_stream_destroy(stream);
    moert_plugin_unload(&keep);

    printf("\nfp8 precision, CUDA vs CPU reference (diffs: bytes or values that differ; err: relative Frobenius)\n");
    printf("%-66s  %9s  %9s  %6s  %s\n", "check", "error", "tolerance", "diffs", "ok");
    for (int i = 0; i < table_len; i++) {
        const row *r = &table[i];
        printf("%-66s  %9.2e  %9.2e  %6lld  %s\n", r->what, r->err, r->tol, (long long)r->diffs,
               r->err <= r->tol && r->diffs <= 0 ? "ok" : "FAIL");
    }
    if (table_dropped)
        printf("(%d more checks not printed, the table being full; a failing one is reported above)\n", table_dropped);
    return test_finish("gpu_fp8");
}

#endif
