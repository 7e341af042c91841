/* SPDX-License-Identifier: Apache-2.0 */
/* The bf16 precision recipe's CPU reference. Each expert's GEMM converts its operands once into a dense
 * float (or double) block, then multiplies with an i-p-j loop whose inner loop runs along contiguous rows
 * (it vectorises; the sum over p still runs in order, like a naive triple loop). */
#include "grouped_gemm_cpu.h"

#include <stdbool.h>
#include <stdlib.h>

/* Grows one scratch block to hold at least `elems` 8-byte elements. */
static bool scratch_reserve(double **block, size_t *have, size_t elems)
{
    if (elems == 0) elems = 1;
    if (*have >= elems) return true;
    double *grown = realloc(*block, elems * sizeof(double));
    if (!grown) return false;
    *block = grown;
    *have = elems;
    return true;
}

bf16_mode bf16_mode_for_dtype(moert_dtype dtype)
{
    return dtype == MOERT_BF16 ? BF16_MODE_BF16 : dtype == MOERT_F64 ? BF16_MODE_FP64 : BF16_MODE_FP32;
}

bool bf16_scratch_reserve(bf16_scratch *scratch, size_t a_elems, size_t b_elems, size_t c_elems)
{
    return scratch_reserve(&scratch->a, &scratch->a_elems, a_elems) &&
           scratch_reserve(&scratch->b, &scratch->b_elems, b_elems) &&
           scratch_reserve(&scratch->c, &scratch->c_elems, c_elems);
}

void bf16_scratch_free(bf16_scratch *scratch)
{
    free(scratch->a);
    free(scratch->b);
    free(scratch->c);
    scratch->a = scratch->b = scratch->c = NULL;
    scratch->a_elems = scratch->b_elems = scratch->c_elems = 0;
}

/* Rounds v to the nearest bf16 value (through fp32, as a cast of an fp32 tensor would). */
static float round_to_bf16(double v) { return moert_bf16_to_float(moert_bf16_from_float((float)v)); }

/*
 * Copies rows [first, first+rows) x cols of a row-major tensor (flat offset `base`) into dst as float,
 * rounded to bf16 when asked; transposed (dst[j*rows+i]) when asked.
 */
static void load_block_float(const moert_tensor *t, int64_t base, int64_t rows, int64_t cols, bool transpose,
                             bool to_bf16, float *dst)
{
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < cols; j++) {
            double v = moert_load(t, base + i * cols + j);
            float f = to_bf16 ? round_to_bf16(v) : (float)v;
            dst[transpose ? j * rows + i : i * cols + j] = f;
        }
}

void cpu_load_block_double(const moert_tensor *t, int64_t base, int64_t rows, int64_t cols, bool transpose, double *dst)
{
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < cols; j++)
            dst[transpose ? j * rows + i : i * cols + j] = moert_load(t, base + i * cols + j);
}

/* c[m,n] = a[m,kk] @ b[kk,n] with fp32 accumulation, summing over kk in order. */
static void matmul_float(const float *restrict a, const float *restrict b, int64_t m, int64_t kk, int64_t n,
                         float *restrict c)
{
    for (int64_t i = 0; i < m; i++) {
        float *restrict ci = c + i * n;
        for (int64_t j = 0; j < n; j++) ci[j] = 0.0f;
        for (int64_t p = 0; p < kk; p++) {
            const float av = a[i * kk + p];
            const float *restrict bp = b + p * n;
            for (int64_t j = 0; j < n; j++) ci[j] += av * bp[j];
        }
    }
}

void cpu_matmul_double(const double *restrict a, const double *restrict b, int64_t m, int64_t kk, int64_t n,
                       double *restrict c)
{
    for (int64_t i = 0; i < m; i++) {
        double *restrict ci = c + i * n;
        for (int64_t j = 0; j < n; j++) ci[j] = 0.0;
        for (int64_t p = 0; p < kk; p++) {
            const double av = a[i * kk + p];
            const double *restrict bp = b + p * n;
            for (int64_t j = 0; j < n; j++) ci[j] += av * bp[j];
        }
    }
}

/* Writes (or, for WGRAD, adds) the m x n block c to tensor t at flat offset base, in the mode's precision. */
static void store_block(moert_tensor *t, int64_t base, int64_t m, int64_t n, const void *c, bf16_mode mode,
                        bool accumulate)
{
    const float *cf = c;
    const double *cd = c;
    for (int64_t i = 0; i < m * n; i++) {
        double v;
        v = mode == BF16_MODE_FP64 ? cd[i] : (double)cf[i];
        /* WGRAD adds in double, then rounds once to the gradient's dtype (for fp32 storage this is the
         * fp32 sum a beta = 1 GEMM makes; fp64 storage keeps its precision) */
        if (accumulate) v += moert_load(t, base + i);
        moert_store(t, base + i, v);
    }
}

/* Runs one pass over all experts; each expert's operands are converted, multiplied and stored. */
moert_result bf16_cpu_grouped_gemm(const moert_grouped_gemm_args *args, const bf16_gemm_shape *shape, bf16_mode mode,
                                   bf16_scratch *scratch)
{
    const int64_t K = shape->k_in, N = shape->n_out;
    const bool wide = mode == BF16_MODE_FP64;
    const bool to_bf16 = mode == BF16_MODE_BF16;
    int64_t first = 0;
    for (int64_t e = 0; e < shape->num_experts; e++) {
        const int64_t m = shape->counts[e];
        const int64_t row0 = first;
        first += m;
        const int64_t w_base = e * K * N;
        const bool overwrite = moert_gemm_overwrites_grad(args) != 0;
        if (m == 0) { /* nothing to compute; WGRAD would add zero, or overwrite with zeros */
            if (overwrite)
                for (int64_t i = 0; i < K * N; i++) moert_store(args->grad_weight, w_base + i, 0.0);
            continue;
        }
        /* a: [m,K] (FORWARD), [m,N] (DGRAD), [K,m] (WGRAD); b: [K,N], [N,K], [m,N]; c: [m,N], [m,K], [K,N]. */
        size_t a_elems = (size_t)(m * (args->pass == MOERT_GEMM_DGRAD ? N : K));
        size_t b_elems = (size_t)(args->pass == MOERT_GEMM_WGRAD ? m * N : K * N);
        size_t c_elems =
            (size_t)(args->pass == MOERT_GEMM_WGRAD ? K * N : m * (args->pass == MOERT_GEMM_DGRAD ? K : N));
        if (!bf16_scratch_reserve(scratch, a_elems, b_elems, c_elems)) return MOERT_ERR_OUT_OF_MEMORY;
        float *af = (float *)scratch->a, *bf = (float *)scratch->b, *cf = (float *)scratch->c;
        double *ad = scratch->a, *bd = scratch->b, *cd = scratch->c;

        switch (args->pass) {
        case MOERT_GEMM_FORWARD: /* output = input @ W */
            if (wide) {
                cpu_load_block_double(args->input, row0 * K, m, K, false, ad);
                cpu_load_block_double(args->weight, w_base, K, N, false, bd);
                cpu_matmul_double(ad, bd, m, K, N, cd);
            } else {
                load_block_float(args->input, row0 * K, m, K, false, to_bf16, af);
                load_block_float(args->weight, w_base, K, N, false, to_bf16, bf);
                matmul_float(af, bf, m, K, N, cf);
            }
            store_block(args->output, row0 * N, m, N, scratch->c, mode, false);
            break;
        case MOERT_GEMM_DGRAD: /* grad_input = grad_output @ W^T */
            if (wide) {
                cpu_load_block_double(args->grad_output, row0 * N, m, N, false, ad);
                cpu_load_block_double(args->weight, w_base, K, N, true, bd);
                cpu_matmul_double(ad, bd, m, N, K, cd);
            } else {
                load_block_float(args->grad_output, row0 * N, m, N, false, to_bf16, af);
                load_block_float(args->weight, w_base, K, N, true, to_bf16, bf);
                matmul_float(af, bf, m, N, K, cf);
            }
            store_block(args->grad_input, row0 * K, m, K, scratch->c, mode, false);
            break;
        case MOERT_GEMM_WGRAD: /* grad_weight += input^T @ grad_output */
            if (wide) {
                cpu_load_block_double(args->input, row0 * K, m, K, true, ad);
                cpu_load_block_double(args->grad_output, row0 * N, m, N, false, bd);
                cpu_matmul_double(ad, bd, K, m, N, cd);
            } else {
                load_block_float(args->input, row0 * K, m, K, true, to_bf16, af);
                load_block_float(args->grad_output, row0 * N, m, N, false, to_bf16, bf);
                matmul_float(af, bf, K, m, N, cf);
            }
            store_block(args->grad_weight, w_base, K, N, scratch->c, mode, !overwrite);
            break;
        }
    }
    return MOERT_OK;
}
