/* SPDX-License-Identifier: Apache-2.0 */
/* The fp8 precision recipes' CPU reference. Each expert's GEMM loads its two operands into dense double
 * blocks (transposed where the pass needs it, so the reduction always runs along A's rows and B's columns),
 * quantizes each block to FP8 per the recipe and replaces it by its dequantized values, multiplies in double
 * with an i-p-j loop and stores once to the output's dtype. */
#include "precision_fp8_cpu.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>

fp8_format fp8_operand_format(const fp8_settings *s, fp8_operand operand)
{
    return s->hybrid && operand == FP8_OPERAND_GRAD ? FP8_E5M2 : FP8_E4M3;
}

float fp8_scale_from_amax(double amax, double fp8_max_value, int64_t margin, bool power_of_2, float fallback)
{
    if (!(amax > 0.0) || isinf(amax)) return fallback; /* 0, negative, NaN, inf */
    /* amax as the fp32 it would be on a GPU; a double quotient of two floats rounds to float like fp32 division */
    const double amax_f = amax <= FLT_MAX ? (double)(float)amax : amax;
    double s = ldexp(fp8_max_value / amax_f, (int)-margin);
    float scale = s > FLT_MAX ? FLT_MAX : (float)s;
    if (!(scale > 0.0f)) scale = FLT_TRUE_MIN; /* amax so large the scale underflows: keep it usable */
    if (power_of_2) {
        int exponent;
        (void)frexpf(scale, &exponent); /* scale = m * 2^exponent, m in [0.5, 1): keep 2^(exponent-1) */
        scale = ldexpf(1.0f, exponent - 1);
    }
    return scale;
}

double fp8_quantize_block(double *v, int64_t rows, int64_t cols, int64_t tile_rows, int64_t tile_cols,
                          fp8_format format, bool power_of_2, float fixed_scale, float *scales, uint8_t *bytes)
{
    const double max_value = fp8_max(format);
    const int64_t tiles_across = (cols + tile_cols - 1) / tile_cols;
    double block_amax = 0.0;
    for (int64_t r0 = 0; r0 < rows; r0 += tile_rows) {
        const int64_t r1 = r0 + tile_rows < rows ? r0 + tile_rows : rows;
        for (int64_t c0 = 0; c0 < cols; c0 += tile_cols) {
            const int64_t c1 = c0 + tile_cols < cols ? c0 + tile_cols : cols;
            double amax = 0.0;
            for (int64_t i = r0; i < r1; i++)
                for (int64_t j = c0; j < c1; j++) {
                    const double a = fabs((double)(float)v[i * cols + j]);
                    if (isnan(a) || a > amax) amax = isnan(amax) ? amax : a;
                }
            const float scale =
                fixed_scale > 0.0f ? fixed_scale : fp8_scale_from_amax(amax, max_value, 0, power_of_2, 1.0f);
            const float scale_inv = 1.0f / scale;
            if (scales) scales[(r0 / tile_rows) * tiles_across + c0 / tile_cols] = scale;
            for (int64_t i = r0; i < r1; i++)
                for (int64_t j = c0; j < c1; j++) {
                    const uint8_t q = fp8_from_float((float)v[i * cols + j] * scale, format);
                    if (bytes) bytes[i * cols + j] = q;
                    v[i * cols + j] = (double)fp8_to_float(q, format) * (double)scale_inv;
                }
            if (isnan(amax) || amax > block_amax) block_amax = isnan(block_amax) ? block_amax : amax;
        }
    }
    return block_amax;
}

bool fp8_delayed_init(fp8_delayed_state *d, int64_t num_experts, int64_t history_len)
{
    const int64_t n = 2 * 3 * num_experts;
    d->num_experts = num_experts;
    d->history_len = history_len;
    d->slots = calloc((size_t)(n > 0 ? n : 1), sizeof *d->slots);
    d->history_store = calloc((size_t)(n > 0 ? n * history_len : 1), sizeof *d->history_store);
    if (!d->slots || !d->history_store) {
        fp8_delayed_free(d);
        return false;
    }
    for (int64_t i = 0; i < n; i++) {
        d->slots[i].scale = 1.0f;
        d->slots[i].history = d->history_store + i * history_len;
    }
    return true;
}

void fp8_delayed_free(fp8_delayed_state *d)
{
    free(d->slots);
    free(d->history_store);
    d->slots = NULL;
    d->history_store = NULL;
}

fp8_amax_slot *fp8_delayed_slot(fp8_delayed_state *d, moert_gemm_weight which, fp8_operand operand, int64_t expert)
{
    return &d->slots[((int64_t)which * 3 + (int64_t)operand) * d->num_experts + expert];
}

void fp8_delayed_end_step(fp8_delayed_state *d, const fp8_settings *s)
{
    for (int which = 0; which < 2; which++)
        for (int operand = 0; operand < 3; operand++)
            for (int64_t e = 0; e < d->num_experts; e++) {
                fp8_amax_slot *slot = fp8_delayed_slot(d, (moert_gemm_weight)which, (fp8_operand)operand, e);
                if (!slot->seen) continue;
                slot->history[slot->next] = slot->step_amax;
                const int64_t newest = slot->next;
                slot->next = (slot->next + 1) % d->history_len;
                if (slot->filled < d->history_len) slot->filled++;
                double amax = slot->history[newest];
                if (!s->amax_most_recent) /* max over the history; a NaN entry makes it NaN (scale kept) */
                    for (int64_t i = 0; i < slot->filled; i++) {
                        const double h = slot->history[i];
                        if (isnan(h) || h > amax) amax = isnan(amax) ? amax : h;
                    }
                const double max_value = fp8_max(fp8_operand_format(s, (fp8_operand)operand));
                slot->scale = fp8_scale_from_amax(amax, max_value, s->margin, s->power_of_2, slot->scale);
                slot->seen = false;
                slot->step_amax = 0.0;
            }
}

void fp8_scratch_free(fp8_scratch *scratch) { bf16_scratch_free(scratch); }

/*
 * Quantizes one operand block of expert e in place per the recipe. The block is rows x cols with the GEMM's
 * reduction along `reduce_along_rows` ? rows : cols. Per-tensor recipes use one tile (the whole block; the
 * delayed recipe with the slot's scale, then records the block's amax); blockwise uses 128x128 tiles for
 * weights and 1x128 tiles along the reduction for activations and gradients.
 */
static void quantize_operand(double *block, int64_t rows, int64_t cols, bool reduce_along_rows, fp8_operand operand,
                             moert_gemm_weight which, int64_t e, const fp8_settings *s, fp8_delayed_state *delayed)
{
    const fp8_format format = fp8_operand_format(s, operand);
    switch (s->recipe) {
    case FP8_RECIPE_CURRENT:
        (void)fp8_quantize_block(block, rows, cols, rows, cols, format, s->power_of_2, 0.0f, NULL, NULL);
        break;
    case FP8_RECIPE_DELAYED: {
        fp8_amax_slot *slot = fp8_delayed_slot(delayed, which, operand, e);
        const double amax =
            fp8_quantize_block(block, rows, cols, rows, cols, format, s->power_of_2, slot->scale, NULL, NULL);
        if (!slot->seen || isnan(amax) || amax > slot->step_amax) slot->step_amax = amax;
        slot->seen = true;
        break;
    }
    case FP8_RECIPE_BLOCKWISE:
        if (operand == FP8_OPERAND_WEIGHT)
            (void)fp8_quantize_block(block, rows, cols, FP8_BLOCK, FP8_BLOCK, format, s->power_of_2, 0.0f, NULL, NULL);
        else if (reduce_along_rows)
            (void)fp8_quantize_block(block, rows, cols, FP8_BLOCK, 1, format, s->power_of_2, 0.0f, NULL, NULL);
        else
            (void)fp8_quantize_block(block, rows, cols, 1, FP8_BLOCK, format, s->power_of_2, 0.0f, NULL, NULL);
        break;
    }
}

/* Writes (or, for WGRAD, adds in double) the m x n block c to tensor t at flat offset base. */
static void store_block(moert_tensor *t, int64_t base, int64_t m, int64_t n, const double *c, bool accumulate)
{
    for (int64_t i = 0; i < m * n; i++) {
        double v = c[i];
        if (accumulate) v += moert_load(t, base + i);
        moert_store(t, base + i, v);
    }
}

moert_result fp8_cpu_grouped_gemm(const moert_grouped_gemm_args *args, const fp8_gemm_shape *shape,
                                  const fp8_settings *s, fp8_delayed_state *delayed, fp8_scratch *scratch)
{
    const int64_t K = shape->k_in, N = shape->n_out;
    const moert_gemm_weight which = args->which;
    const bool overwrite = moert_gemm_overwrites_grad(args) != 0; /* WGRAD: write grad_weight, not add to it */
    int64_t first = 0;
    for (int64_t e = 0; e < shape->num_experts; e++) {
        const int64_t m = shape->counts[e];
        const int64_t row0 = first;
        first += m;
        const int64_t w_base = e * K * N;
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
        double *a = scratch->a, *b = scratch->b, *c = scratch->c;

        switch (args->pass) {
        case MOERT_GEMM_FORWARD: /* output = input @ W */
            cpu_load_block_double(args->input, row0 * K, m, K, false, a);
            cpu_load_block_double(args->weight, w_base, K, N, false, b);
            quantize_operand(a, m, K, false, FP8_OPERAND_INPUT, which, e, s, delayed);
            quantize_operand(b, K, N, true, FP8_OPERAND_WEIGHT, which, e, s, delayed);
            cpu_matmul_double(a, b, m, K, N, c);
            store_block(args->output, row0 * N, m, N, c, false);
            break;
        case MOERT_GEMM_DGRAD: /* grad_input = grad_output @ W^T */
            cpu_load_block_double(args->grad_output, row0 * N, m, N, false, a);
            cpu_load_block_double(args->weight, w_base, K, N, true, b);
            quantize_operand(a, m, N, false, FP8_OPERAND_GRAD, which, e, s, delayed);
            quantize_operand(b, N, K, true, FP8_OPERAND_WEIGHT, which, e, s, delayed);
            cpu_matmul_double(a, b, m, N, K, c);
            store_block(args->grad_input, row0 * K, m, K, c, false);
            break;
        case MOERT_GEMM_WGRAD: /* grad_weight += input^T @ grad_output (= when overwriting) */
            cpu_load_block_double(args->input, row0 * K, m, K, true, a);
            cpu_load_block_double(args->grad_output, row0 * N, m, N, false, b);
            quantize_operand(a, K, m, false, FP8_OPERAND_INPUT, which, e, s, delayed);
            quantize_operand(b, m, N, true, FP8_OPERAND_GRAD, which, e, s, delayed);
            cpu_matmul_double(a, b, K, m, N, c);
            store_block(args->grad_weight, w_base, K, N, c, !overwrite);
            break;
        }
    }
    return MOERT_OK;
}
