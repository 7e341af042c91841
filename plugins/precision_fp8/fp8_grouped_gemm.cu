/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The fp8 recipes' grouped GEMM (moert_fp8_cuda_grouped_gemm): the checks, the experts' offsets, the weight's FP8
 * copy and the quantized activations (fp8_quantize.cu), then the experts' matmuls on cuBLASLt (fp8_matmul_plans.cu)
 * or one launch of moert's wgmma kernel (fp8_block_gemm.cu); and the step's end (delayed scales, weight copies).
 */
#include "precision_fp8_cuda_internal.h"

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Checks a raw GEMM description: pass, weight, dtypes, sizes (multiples of 16), pointers and alignment. */
static moert_result check_gemm(moert_fp8_cuda *g, const moert_fp8_cuda_gemm *gm)
{
    const moert_host *host = g->host;
    if (gm->pass != MOERT_GEMM_FORWARD && gm->pass != MOERT_GEMM_DGRAD && gm->pass != MOERT_GEMM_WGRAD)
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "fp8 cuda: unknown GEMM pass %d", (int)gm->pass);
    if (gm->which != MOERT_GEMM_FC1 && gm->which != MOERT_GEMM_FC2)
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "fp8 cuda: unknown weight %d", (int)gm->which);
    if (gm->num_experts != g->cfg.num_experts || (gm->num_experts > 0 && !gm->rows_per_expert))
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "fp8 cuda: %lld experts given, the handle has %lld",
                      (long long)gm->num_experts, (long long)g->cfg.num_experts);
    if (gm->act_dtype != MOERT_BF16 && gm->act_dtype != MOERT_F32)
        return report(host, MOERT_ERR_UNSUPPORTED, "fp8 cuda: activations must be bf16 or fp32, not %s",
                      moert_dtype_name(gm->act_dtype));
    if (gm->pass != MOERT_GEMM_WGRAD && gm->weight_dtype != MOERT_BF16 && gm->weight_dtype != MOERT_F32)
        return report(host, MOERT_ERR_UNSUPPORTED, "fp8 cuda: weights must be fp32 or bf16, not %s",
                      moert_dtype_name(gm->weight_dtype));
    if (gm->pass == MOERT_GEMM_WGRAD && gm->grad_weight_dtype != MOERT_BF16 && gm->grad_weight_dtype != MOERT_F32)
        return report(host, MOERT_ERR_UNSUPPORTED, "fp8 cuda: grad_weight must be fp32 or bf16, not %s",
                      moert_dtype_name(gm->grad_weight_dtype));
    if (gm->k_in <= 0 || gm->n_out <= 0 || gm->k_in % 16 || gm->n_out % 16)
        return report(host, MOERT_ERR_UNSUPPORTED,
                      "fp8 cuda: k_in %lld and n_out %lld must be positive multiples of 16 "
                      "(cuBLASLt FP8 leading dimensions)",
                      (long long)gm->k_in, (long long)gm->n_out);
    const int fwd = gm->pass == MOERT_GEMM_FORWARD, dgrad = gm->pass == MOERT_GEMM_DGRAD;
    if ((!dgrad && !gm->input) || (!fwd && !gm->grad_output) || (gm->pass != MOERT_GEMM_WGRAD && !gm->weight) ||
        (fwd && !gm->output) || (dgrad && !gm->grad_input) || (gm->pass == MOERT_GEMM_WGRAD && !gm->grad_weight))
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "fp8 cuda: the %s GEMM needs its two operands and its output",
                      fwd     ? "forward"
                      : dgrad ? "dgrad"
                              : "wgrad");
    const size_t align = gm->act_dtype == MOERT_BF16 ? 8 : 16;
    const void *acts[2] = {gm->pass == MOERT_GEMM_DGRAD ? gm->grad_output : gm->input,
                           gm->pass == MOERT_GEMM_WGRAD ? gm->grad_output : NULL};
    for (int i = 0; i < 2; i++)
        if (acts[i] && (uintptr_t)acts[i] % align)
            return report(host, MOERT_ERR_INVALID_ARGUMENT, "fp8 cuda: %s activations must be %zu-byte aligned",
                          moert_dtype_name(gm->act_dtype), align);
    if (gm->pass != MOERT_GEMM_WGRAD && (uintptr_t)gm->weight % 16)
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "fp8 cuda: the weight must be 16-byte aligned");
    for (int64_t e = 0; e < gm->num_experts; e++)
        if (gm->rows_per_expert[e] < 0 || gm->rows_per_expert[e] > INT32_MAX / 2)
            return report(host, MOERT_ERR_INVALID_ARGUMENT, "fp8 cuda: expert %lld has %lld rows", (long long)e,
                          (long long)gm->rows_per_expert[e]);
    return MOERT_OK;
}

/* Rows, offsets and padded offsets (rows rounded up to align) of each expert; the non-empty experts in g->active. */
static void expert_offsets(moert_fp8_cuda *g, const int64_t *counts, int64_t align)
{
    int64_t row = 0, prow = 0;
    g->active_count = 0;
    for (int64_t e = 0; e < g->cfg.num_experts; e++) {
        g->row0[e] = row;
        g->prow0[e] = prow;
        g->rows16[e] = round_up(counts[e], align);
        row += counts[e];
        prow += g->rows16[e];
        if (counts[e] > 0) g->active[g->active_count++] = (int32_t)e;
    }
}

/*
 * BLK_ORDER_WEIGHT_B's outputs back to the caller's layout: matrix i is stored column-major [rows x cols] with
 * leading dimension t.dst_ld[i] at element src_row0[i] of src, and goes row-major [rows][cols] to element
 * dst_off[i] of dst. 32x32 tiles through shared memory; grid (tiles of the largest matrix, matrices); T is the
 * element's bits (2 or 4 bytes).
 */
template <typename T>
__global__ void untranspose_kernel(const mat_table t, const T *__restrict__ src, int64_t cols, T *__restrict__ dst)
{
    __shared__ T tile[32][33];
    const int i = blockIdx.y;
    const int64_t rows = t.rows[i], ld = t.dst_ld[i];
    const int64_t rtiles = (rows + 31) / 32, ctiles = (cols + 31) / 32;
    if ((int64_t)blockIdx.x >= rtiles * ctiles) return;
    const int64_t r0 = ((int64_t)blockIdx.x % rtiles) * 32, c0 = ((int64_t)blockIdx.x / rtiles) * 32;
    const T *s = src + t.src_row0[i];
    T *d = dst + t.dst_off[i];
    for (int j = threadIdx.y; j < 32; j += blockDim.y) {
        const int64_t c = c0 + j, r = r0 + threadIdx.x;
        if (c < cols && r < rows) tile[j][threadIdx.x] = s[c * ld + r];
    }
    __syncthreads();
    for (int j = threadIdx.y; j < 32; j += blockDim.y) {
        const int64_t r = r0 + j, c = c0 + threadIdx.x;
        if (c < cols && r < rows) d[r * cols + c] = tile[threadIdx.x][j];
    }
}

/* BLK_ORDER_WEIGHT_B: the experts' transposed outputs in dscratch ([cols][rows16] each) into dst [rows][cols]. */
static moert_result untranspose(moert_fp8_cuda *g, cudaStream_t stream, const moert_fp8_cuda_gemm *gm, int64_t cols,
                                void *dst)
{
    const size_t es = moert_dtype_size(gm->act_dtype);
    for (int64_t first = 0; first < g->active_count; first += TABLE_MAX) {
        const int64_t count = g->active_count - first < TABLE_MAX ? g->active_count - first : TABLE_MAX;
        mat_table t;
        memset(&t, 0, sizeof t);
        t.count = (int32_t)count;
        int64_t tiles = 0;
        for (int64_t j = 0; j < count; j++) {
            const int64_t e = g->active[first + j];
            t.expert[j] = (int32_t)e;
            t.rows[j] = (int32_t)gm->rows_per_expert[e];
            t.dst_ld[j] = (int32_t)g->rows16[e];
            t.src_row0[j] = g->prow0[e] * cols;
            t.dst_off[j] = g->row0[e] * cols;
            const int64_t n = ceil_div(gm->rows_per_expert[e], 32) * ceil_div(cols, 32);
            if (n > tiles) tiles = n;
        }
        const dim3 grid((unsigned)tiles, (unsigned)count), block(32, 8);
        if (es == 2)
            untranspose_kernel<uint16_t>
                <<<grid, block, 0, stream>>>(t, (const uint16_t *)g->dscratch.p, cols, (uint16_t *)dst);
        else
            untranspose_kernel<uint32_t>
                <<<grid, block, 0, stream>>>(t, (const uint32_t *)g->dscratch.p, cols, (uint32_t *)dst);
        LAUNCH_CHECK(g->host, "untranspose_kernel");
    }
    return MOERT_OK;
}

/* WGRAD overwriting grad_weight: the gradient of an expert with no rows is zero, written on stream. */
static moert_result zero_empty_experts(moert_fp8_cuda *g, cudaStream_t stream, const moert_fp8_cuda_gemm *gm)
{
    const size_t slice = (size_t)gm->k_in * (size_t)gm->n_out * moert_dtype_size(gm->grad_weight_dtype);
    for (int64_t e = 0; e < gm->num_experts; e++) {
        if (gm->rows_per_expert[e] != 0) continue;
        cudaError_t err = cudaMemsetAsync((char *)gm->grad_weight + (size_t)e * slice, 0, slice, stream);
        if (err != cudaSuccess) {
            (void)cudaGetLastError();
            return report(g->host, MOERT_ERR_CUDA, "cudaMemsetAsync(grad_weight of expert %lld) failed: %s",
                          (long long)e, cudaGetErrorString(err));
        }
    }
    return MOERT_OK;
}

/*
 * The blockwise recipe's grouped GEMM on the wgmma kernel, from the operands quantized as for cuBLASLt (the same
 * bytes and factors; see the layouts at the top of precision_fp8_cuda.h), one group per non-empty expert:
 *   FORWARD/DGRAD: A = the activation rows at their padded offsets (1x128 factors at x + kb * rows16), B = the
 *     weight copy of the pass ([E][cols][reduction], 128x128 factors), D = the caller's rows (masked: no scratch).
 *   WGRAD: A = input^T [K][rows16], B = grad_output^T [N][rows16] (1x128 factors on both), D = grad_weight[e].
 */
static moert_result block_gemm(moert_fp8_cuda *g, cudaStream_t stream, const moert_fp8_cuda_gemm *gm,
                               const weight_cache *wc)
{
    const int64_t K = gm->k_in, N = gm->n_out, n_active = g->active_count;
    const int wgrad = gm->pass == MOERT_GEMM_WGRAD, fwd = gm->pass == MOERT_GEMM_FORWARD;
    const int grad_fmt = operand_format(g, OP_GRAD);
    const int matrix_count = wgrad ? (int)(2 * n_active) : 2;
    moert_fp8_block_matrix *mx = (moert_fp8_block_matrix *)calloc((size_t)matrix_count, sizeof *mx);
    moert_fp8_block_group *gr = (moert_fp8_block_group *)calloc((size_t)n_active, sizeof *gr);
    if (!mx || !gr) {
        free(mx);
        free(gr);
        return report(g->host, MOERT_ERR_OUT_OF_MEMORY, "fp8 cuda: out of host memory for %lld groups",
                      (long long)n_active);
    }
    moert_fp8_block_gemm call;
    memset(&call, 0, sizeof call);
    call.matrices = mx;
    call.matrix_count = matrix_count;
    call.groups = gr;
    call.group_count = (int)n_active;
    call.sm_yield = gm->sm_yield;
    call.work_counter = gm->work_counter;
    if (!wgrad) {
        const int64_t kk = fwd ? K : N, cols = fwd ? N : K; /* the reduction, the output's columns */
        const int64_t last = g->active[n_active - 1];
        const size_t act_es = moert_dtype_size(gm->act_dtype);
        char *dst = (char *)(fwd ? gm->output : gm->grad_input);
        const float *winv = (const float *)(fwd ? wc->inv_fwd.p : wc->inv_dgrad.p);
        mx[0] = (moert_fp8_block_matrix){g->act_b.p, g->prow0[last] + g->rows16[last], kk, kk};
        mx[1] = (moert_fp8_block_matrix){fwd ? wc->fwd.p : wc->dgrad.p, gm->num_experts * cols, kk, kk};
        call.a_format = fwd ? 0 : grad_fmt;
        call.b_format = 0;
        call.d_bf16 = gm->act_dtype == MOERT_BF16;
        for (int64_t j = 0; j < n_active; j++) {
            const int64_t e = g->active[j];
            gr[j] = (moert_fp8_block_group){0,
                                            1,
                                            g->prow0[e],
                                            e * cols,
                                            gm->rows_per_expert[e],
                                            cols,
                                            kk,
                                            (const float *)g->b_blk.p + g->b_soff[e],
                                            g->rows16[e],
                                            winv + e * wc->blk_stride,
                                            round_up(ceil_div(kk, 128), 4),
                                            dst + (size_t)(g->row0[e] * cols) * act_es,
                                            cols};
        }
    } else {
        const size_t gw_es = moert_dtype_size(gm->grad_weight_dtype);
        call.a_format = 0;
        call.b_format = grad_fmt;
        call.b_per_row = 1;
        call.d_bf16 = gm->grad_weight_dtype == MOERT_BF16;
        call.accumulate = !gm->overwrite_grad_weight;
        for (int64_t j = 0; j < n_active; j++) {
            const int64_t e = g->active[j], r16 = g->rows16[e];
            mx[2 * j] = (moert_fp8_block_matrix){(const uint8_t *)g->act_b.p + (size_t)g->prow0[e] * K, K, r16, r16};
            mx[2 * j + 1] =
                (moert_fp8_block_matrix){(const uint8_t *)g->act_a.p + (size_t)g->prow0[e] * N, N, r16, r16};
            gr[j] = (moert_fp8_block_group){(int)(2 * j),
                                            (int)(2 * j + 1),
                                            0,
                                            0,
                                            K,
                                            N,
                                            r16,
                                            (const float *)g->b_blk.p + g->b_soff[e],
                                            K,
                                            (const float *)g->a_blk.p + g->a_soff[e],
                                            N,
                                            (char *)gm->grad_weight + (size_t)(e * K * N) * gw_es,
                                            N};
        }
    }
    const moert_result rc = moert_fp8_block_gemm_run(g->block, stream, &call);
    free(mx);
    free(gr);
    return rc;
}

/* One grouped GEMM: the weight's cached FP8 copy, the activations quantized, one matmul per non-empty expert. */
extern "C" moert_result moert_fp8_cuda_grouped_gemm(moert_fp8_cuda *g, cudaStream_t stream,
                                                    const moert_fp8_cuda_gemm *gm)
{
    MOK(check_gemm(g, gm));
    const moert_host *host = g->host;
    const int64_t K = gm->k_in, N = gm->n_out, E = gm->num_experts;
    int64_t align = MOERT_FP8_CUDA_ROW_ALIGN;
    if (gm->pass == MOERT_GEMM_WGRAD) MOK(fp8_cuda_wgrad_row_align(g, gm, &align));
    expert_offsets(g, gm->rows_per_expert, align);
    g->worst_rows = gm->capacity > 0 ? gm->capacity + (align - 1) * E : 0;
    memset(&g->last, 0, sizeof g->last);
    const int overwrite = gm->pass == MOERT_GEMM_WGRAD && gm->overwrite_grad_weight;
    if (overwrite) MOK(zero_empty_experts(g, stream, gm));
    if (g->active_count == 0) return MOERT_OK; /* nothing to compute; WGRAD would add zero (or has zeroed) */
    if (g->amax.cap < (size_t)E * 4) MOK(fp8_cuda_buf_reserve(g, &g->amax, (size_t)E * 4));
    const int blk = is_blockwise(g);
    const int delayed = g->cfg.recipe == MOERT_FP8_CUDA_DELAYED;
    const int32_t scalar = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
    const int32_t vec = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F, blk2d = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    const cudaDataType_t act_type = gm->act_dtype == MOERT_BF16 ? CUDA_R_16BF : CUDA_R_32F;
    const size_t act_es = moert_dtype_size(gm->act_dtype);
    expert_mm *mms = (expert_mm *)calloc((size_t)g->active_count, sizeof *mms);
    if (!mms)
        return report(host, MOERT_ERR_OUT_OF_MEMORY, "fp8 cuda: out of host memory for %lld matmuls",
                      (long long)g->active_count);
    moert_result rc = MOERT_OK;
    act_target ta = {&g->act_a, &g->a_scale, &g->a_inv, &g->a_blk, g->a_soff};
    act_target tb = {&g->act_b, &g->b_scale, &g->b_inv, &g->b_blk, g->b_soff};
    weight_cache *wc = NULL;
    int swapped = 0; /* BLK_ORDER_WEIGHT_B */
    const int grad_fmt = operand_format(g, OP_GRAD);
    if (gm->pass == MOERT_GEMM_FORWARD || gm->pass == MOERT_GEMM_DGRAD) {
        const int fwd = gm->pass == MOERT_GEMM_FORWARD;
        const int64_t kk = fwd ? K : N, mm = fwd ? N : K; /* the reduction, the output's columns */
        if ((rc = fp8_cuda_weight_get(g, stream, gm, &wc)) != MOERT_OK) goto done;
        if ((rc = fp8_cuda_quantize_activation(g, stream, gm, fwd ? gm->input : gm->grad_output, kk,
                                               fwd ? OP_INPUT : OP_GRAD, 0, &tb)) != MOERT_OK)
            goto done;
        if (delayed && (rc = fp8_cuda_note_weight(g, stream, gm->which, wc)) != MOERT_OK) goto done;
        const uint8_t *wbytes = (const uint8_t *)(fwd ? wc->fwd.p : wc->dgrad.p);
        const float *winv = blk ? (const float *)(fwd ? wc->inv_fwd.p : wc->inv_dgrad.p) : (const float *)wc->inv.p;
        const int64_t wstride = blk ? wc->blk_stride : 4;
        char *dst = (char *)(fwd ? gm->output : gm->grad_input);
        const int on_lt = blk && !kernel_serves(g, gm->pass, 0); /* cuBLASLt's blockwise matmuls */
        if (on_lt && (rc = fp8_cuda_choose_blk_order(g, K, N, gm->act_dtype)) != MOERT_OK) goto done;
        swapped = on_lt && g->blk_order == BLK_ORDER_WEIGHT_B;
        if (on_lt) { /* D goes through the same 16-row padding as the activation rows */
            const int64_t last = g->active[g->active_count - 1];
            if ((rc = fp8_cuda_buf_reserve_worst(g, &g->dscratch,
                                                 (size_t)((g->prow0[last] + g->rows16[last]) * mm) * act_es,
                                                 (size_t)(g->worst_rows * mm) * act_es)) != MOERT_OK)
                goto done;
        }
        for (int64_t j = 0; j < g->active_count; j++) {
            const int64_t e = g->active[j];
            const int64_t rows = gm->rows_per_expert[e];
            expert_mm *p = &mms[j];
            p->expert = e;
            g->a_off[e] = e * K * N;
            g->a_soff[e] = e * wstride;
            g->b_off[e] = (blk ? g->prow0[e] : g->row0[e]) * kk; /* blockwise: at the padded offset */
            if (swapped) { /* A = activation (VEC128), B = weight (BLK128x128), D transposed into dscratch */
                p->a_type = fp8_type(fwd ? 0 : grad_fmt);
                p->b_type = CUDA_R_8F_E4M3;
                p->d_type = act_type;
                p->a_mode = vec;
                p->b_mode = blk2d;
                p->row_dim = ROW_M;
                p->m = g->rows16[e];
                p->n = mm;
                p->k = kk;
                p->lda = kk;
                p->ldb = kk;
                p->ldd = g->rows16[e];
                p->a = (const uint8_t *)g->act_b.p + (size_t)g->b_off[e];
                p->b = wbytes + (size_t)e * K * N;
                p->d = (char *)g->dscratch.p + (size_t)(g->prow0[e] * mm) * act_es;
                p->a_scale = (const float *)g->b_blk.p + g->b_soff[e];
                p->b_scale = winv + e * wstride;
                continue;
            }
            p->a_type = CUDA_R_8F_E4M3;
            p->b_type = fp8_type(fwd ? 0 : grad_fmt);
            p->d_type = act_type;
            p->a_mode = blk ? blk2d : scalar;
            p->b_mode = blk ? vec : scalar;
            p->m = mm;
            p->n = blk ? g->rows16[e] : rows;
            p->k = kk;
            p->lda = kk;
            p->ldb = kk;
            p->ldd = mm;
            p->a = wbytes + (size_t)e * K * N;
            p->b = (const uint8_t *)g->act_b.p + (size_t)g->b_off[e];
            p->d = dst + (size_t)g->row0[e] * mm * act_es;
            if (blk && g->rows16[e] != rows) { /* the padded rows would spill into the next expert's */
                p->d = (char *)g->dscratch.p + (size_t)(g->prow0[e] * mm) * act_es;
                p->copy_to = dst + (size_t)g->row0[e] * mm * act_es;
                p->copy_bytes = (size_t)(rows * mm) * act_es;
            }
            p->a_scale = winv + e * wstride;
            p->b_scale = blk ? (const float *)g->b_blk.p + g->b_soff[e] : (const float *)g->b_inv.p + 4 * e;
        }
        g->last.a = wbytes;
        g->last.a_scale_inv = winv;
        g->last.a_scale = blk ? NULL : (const float *)wc->scale.p;
        g->last.a_format = 0;
        g->last.b_format = fwd ? 0 : grad_fmt;
    } else { /* WGRAD */
        if ((rc = fp8_cuda_quantize_activation(g, stream, gm, gm->grad_output, N, OP_GRAD, 1, &ta)) != MOERT_OK)
            goto done;
        if ((rc = fp8_cuda_quantize_activation(g, stream, gm, gm->input, K, OP_INPUT, 1, &tb)) != MOERT_OK) goto done;
        const cudaDataType_t gw_type = gm->grad_weight_dtype == MOERT_BF16 ? CUDA_R_16BF : CUDA_R_32F;
        const size_t gw_es = moert_dtype_size(gm->grad_weight_dtype);
        for (int64_t j = 0; j < g->active_count; j++) {
            const int64_t e = g->active[j];
            expert_mm *p = &mms[j];
            p->expert = e;
            p->a_type = fp8_type(grad_fmt);
            p->b_type = CUDA_R_8F_E4M3;
            p->d_type = gw_type;
            p->a_mode = blk ? vec : scalar;
            p->b_mode = blk ? vec : scalar;
            p->beta1 = !overwrite; /* overwrite: beta 0, the expert's gradient written, not added to */
            p->row_dim = ROW_K;
            p->m = N;
            p->n = K;
            p->k = g->rows16[e];
            p->lda = g->rows16[e];
            p->ldb = g->rows16[e];
            p->ldd = N;
            p->a = (const uint8_t *)g->act_a.p + (size_t)g->prow0[e] * N;
            p->b = (const uint8_t *)g->act_b.p + (size_t)g->prow0[e] * K;
            p->d = (char *)gm->grad_weight + (size_t)e * K * N * gw_es;
            p->a_scale = blk ? (const float *)g->a_blk.p + g->a_soff[e] : (const float *)g->a_inv.p + 4 * e;
            p->b_scale = blk ? (const float *)g->b_blk.p + g->b_soff[e] : (const float *)g->b_inv.p + 4 * e;
            g->a_off[e] = g->prow0[e] * N;
            g->b_off[e] = g->prow0[e] * K;
        }
        g->last.a = (const uint8_t *)g->act_a.p;
        g->last.a_scale_inv = blk ? (const float *)g->a_blk.p : (const float *)g->a_inv.p;
        g->last.a_scale = blk ? NULL : (const float *)g->a_scale.p;
        g->last.a_format = grad_fmt;
        g->last.b_format = 0;
    }
    g->last.b = (const uint8_t *)g->act_b.p;
    g->last.b_scale_inv = blk ? (const float *)g->b_blk.p : (const float *)g->b_inv.p;
    g->last.b_scale = blk ? NULL : (const float *)g->b_scale.p;
    g->last.a_offset = g->a_off;
    g->last.b_offset = g->b_off;
    g->last.a_scale_offset = g->a_soff;
    g->last.b_scale_offset = g->b_soff;
    g->last.rows16 = g->rows16;
    if (!blk && gm->pass != MOERT_GEMM_WGRAD)
        for (int64_t e = 0; e < E; e++) g->a_soff[e] = 4 * e;
    if (!blk)
        for (int64_t e = 0; e < E; e++) {
            g->b_soff[e] = 4 * e;
            if (gm->pass == MOERT_GEMM_WGRAD) g->a_soff[e] = 4 * e;
        }
    if (blk && kernel_serves(g, gm->pass, gm->overwrite_grad_weight)) {
        if (!g->quantize_only) rc = block_gemm(g, stream, gm, wc);
        goto done;
    }
    fp8_cuda_sort_by_rows(mms, g->active_count, gm->rows_per_expert);
    if (!g->quantize_only) rc = fp8_cuda_run_matmuls(g, stream, mms, g->active_count, gm->rows_per_expert);
    if (rc == MOERT_OK && swapped && !g->quantize_only)
        rc = untranspose(g, stream, gm, gm->pass == MOERT_GEMM_FORWARD ? N : K,
                         gm->pass == MOERT_GEMM_FORWARD ? gm->output : gm->grad_input);
done:
    free(mms);
    return rc;
}

/* After the optimizer step: delayed histories and scales, then the FP8 weight copies made again. */
extern "C" moert_result moert_fp8_cuda_end_step(moert_fp8_cuda *g, cudaStream_t stream)
{
    const moert_host *host = g->host;
    if (g->cfg.recipe == MOERT_FP8_CUDA_DELAYED && g->cfg.num_experts > 0 && g->delayed_owner == g) {
        const int64_t slots = 6 * g->cfg.num_experts;
        fp8_launch_end_step_kernel((unsigned)ceil_div(slots, 128), 128, stream, slots, g->cfg.num_experts,
                                   g->cfg.amax_history_len, (float *)g->history.p, (int32_t *)g->next.p,
                                   (int32_t *)g->filled.p, (float *)g->slot_scale.p, (uint32_t *)g->slot_amax.p,
                                   (int *)g->slot_seen.p, g->cfg.amax_most_recent, (int)g->cfg.margin,
                                   g->cfg.power_of_2, g->cfg.hybrid);
        LAUNCH_CHECK(host, "end_step_kernel");
    }
    for (int w = 0; w < 2; w++) { /* the weights changed: their FP8 copies are made again now */
        weight_cache *c = &g->weights[w];
        if (!c->source) continue;
        const int fwd = c->fwd_valid, dgrad = c->dgrad_valid;
        c->scales_valid = c->fwd_valid = c->dgrad_valid = 0;
        moert_result rc = fp8_cuda_weight_make(g, stream, w, c, fwd, dgrad);
        if (rc != MOERT_OK) {
            c->source = NULL;
            return rc;
        }
    }
    return MOERT_OK;
}

/* One delayed slot's scale, for tests (a stream sync). */
extern "C" moert_result moert_fp8_cuda_delayed_scale(moert_fp8_cuda *g, cudaStream_t stream, moert_gemm_weight which,
                                                     int operand, int64_t expert, float *out)
{
    const moert_host *host = g->host;
    if (g->cfg.recipe != MOERT_FP8_CUDA_DELAYED || operand < 0 || operand > 2 || expert < 0 ||
        expert >= g->cfg.num_experts)
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "fp8 cuda: no delayed slot (%d, %d, %lld)", (int)which, operand,
                      (long long)expert);
    const float *src = (const float *)g->delayed_owner->slot_scale.p + slot_base(g, which, operand) + expert;
    CUDA_CHECK(host, cudaMemcpyAsync(out, src, sizeof *out, cudaMemcpyDeviceToHost, stream));
    CUDA_CHECK(host, cudaStreamSynchronize(stream));
    return MOERT_OK;
}
