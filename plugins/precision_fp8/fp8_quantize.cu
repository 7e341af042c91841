/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The host side of the fp8 recipes' quantization: the kernel tables of the active experts, the activation operands
 * of a GEMM (per-tensor, 1x128 rows, or transposed for WGRAD), and the FP8 weight cache (both layouts of each
 * weight and their scales, made once per step and reused by every GEMM of the step). The kernels are in
 * fp8_quant_kernels.cu and fp8_weight_kernels.cu.
 */
#include "precision_fp8_cuda_internal.h"

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Floats one expert's BLK128x128 factors take (any layout), rounded up to 4 (16-byte aligned slices). */
static int64_t blk_floats(int64_t XB, int64_t KB) { return round_up(round_up(XB, 4) * round_up(KB, 4), 4); }

/* What table_fill needs to know about an activation operand. */
typedef struct table_spec {
    int64_t cols;             /* source columns */
    int transposed;           /* destination [cols][rows16] at prow0 * cols */
    int padded;               /* destination [rows16][cols] at prow0 * cols (blockwise FORWARD/DGRAD) */
    const int64_t *scale_off; /* per expert, or NULL (0) */
} table_spec;

/* Fills a kernel table with active experts first .. first+count-1 (rows come from table_rows); *tiles gets the
 * tiles of cast_transpose_kernel when transposed; row_start the padded rows of block_rows_kernel. */
static void table_fill(const moert_fp8_cuda *g, int64_t first, int64_t count, const table_spec *spec, mat_table *t,
                       int64_t *tiles)
{
    memset(t, 0, sizeof *t);
    t->count = (int32_t)count;
    int64_t tile = 0, padded_rows = 0;
    const int64_t CT = ceil_div(spec->cols, CT_COLS);
    for (int64_t j = 0; j < count; j++) {
        const int32_t e = g->active[first + j];
        t->expert[j] = e;
        t->src_row0[j] = g->row0[e];
        t->scale_off[j] = spec->scale_off ? spec->scale_off[e] : 0;
        t->row_start[j] = padded_rows;
        padded_rows += g->rows16[e];
        if (spec->padded) {
            t->dst_ld[j] = (int32_t)g->rows16[e];
            t->dst_off[j] = g->prow0[e] * spec->cols;
        } else if (spec->transposed) {
            t->dst_ld[j] = (int32_t)g->rows16[e];
            t->dst_off[j] = g->prow0[e] * spec->cols;
            t->tile_start[j] = (int32_t)tile;
            tile += ceil_div(g->rows16[e], TILE) * CT;
        } else {
            t->dst_ld[j] = (int32_t)spec->cols;
            t->dst_off[j] = g->row0[e] * spec->cols;
        }
    }
    t->tile_start[count] = (int32_t)tile;
    t->row_start[count] = padded_rows;
    *tiles = tile;
}

/* Sets rows (the count of the active expert) into a table filled by table_fill: the caller passes counts. */
static void table_rows(const int64_t *counts, mat_table *t)
{
    for (int32_t j = 0; j < t->count; j++) t->rows[j] = (int32_t)counts[t->expert[j]];
}

/* Blocks per matrix of the element-wise kernels: enough for the largest matrix of the table, at most 64. */
static unsigned grid_chunks(const mat_table *t, int64_t cols)
{
    int64_t most = 0;
    for (int32_t j = 0; j < t->count; j++)
        if (t->rows[j] > most) most = t->rows[j];
    const int64_t chunks = ceil_div(most * cols, 256 * 4 * 8);
    return (unsigned)(chunks < 1 ? 1 : chunks > 64 ? 64 : chunks);
}

/* Whether block_rows_wide_kernel takes these rows: bf16, 16-byte aligned rows. */
template <typename T> static bool rows_wide_ok(const moert_fp8_cuda *g, const T *src, int64_t cols)
{
    (void)g;
    return sizeof(T) == 2 && cols % 8 == 0 && (uintptr_t)src % 16 == 0;
}

/*
 * Quantizes an activation operand (input or grad_output, [rows, cols] in act dtype) for the active experts into
 * target: in its own layout (transposed = 0; FORWARD, DGRAD; the blockwise recipe puts each expert's rows at its
 * padded offset prow0, zero rows up to rows16) or as [cols][rows16] per expert (WGRAD).
 */
template <typename T>
static moert_result quantize_activation_t(moert_fp8_cuda *g, cudaStream_t stream, const moert_fp8_cuda_gemm *gm,
                                          const T *src, int64_t cols, int operand, int transposed, act_target *tg)
{
    const moert_host *host = g->host;
    const int fmt = operand_format(g, operand);
    const float fmax = format_max(fmt);
    const int64_t E = g->cfg.num_experts;
    const int padded = !transposed && is_blockwise(g);
    const int64_t last = g->active[g->active_count - 1];
    const int64_t stored_rows =
        transposed || padded ? g->prow0[last] + g->rows16[last] : g->row0[last] + gm->rows_per_expert[last];
    MOK(fp8_cuda_buf_reserve_worst(g, tg->bytes, (size_t)(stored_rows * cols), (size_t)(g->worst_rows * cols)));
    MOK(fp8_cuda_buf_reserve(g, tg->scale, (size_t)(4 * E) * 4));
    MOK(fp8_cuda_buf_reserve(g, tg->inv, (size_t)(4 * E) * 4));
    /* blockwise factor offsets, 16-byte aligned per expert */
    int64_t blk_total = 0;
    for (int64_t e = 0; e < E; e++) {
        tg->soff[e] = blk_total;
        const int64_t r = gm->rows_per_expert[e];
        if (r == 0 || !is_blockwise(g)) continue;
        blk_total += transposed ? round_up(cols * ceil_div(g->rows16[e], TILE), 4)
                                : round_up(g->rows16[e] * ceil_div(cols, TILE), 4);
    }
    if (is_blockwise(g)) {
        const int64_t worst = g->worst_rows == 0 ? 0
                              : transposed       ? cols * (ceil_div(g->worst_rows, TILE) + E) + 4 * E
                                                 : g->worst_rows * ceil_div(cols, TILE) + 4 * E;
        MOK(fp8_cuda_buf_reserve_worst(g, tg->blk, (size_t)(blk_total > 0 ? blk_total : 1) * 4, (size_t)worst * 4));
    }

    const int delayed = g->cfg.recipe == MOERT_FP8_CUDA_DELAYED;
    uint32_t *rec_amax = NULL;
    int *rec_seen = NULL;
    if (delayed) {
        const int64_t base = slot_base(g, gm->which, operand);
        rec_amax = (uint32_t *)g->delayed_owner->slot_amax.p + base;
        rec_seen = (int *)g->delayed_owner->slot_seen.p + base;
        fp8_launch_scales_kernel((unsigned)ceil_div(E, 128), 128, stream, E, NULL,
                                 (const float *)g->delayed_owner->slot_scale.p + base, fmax, 0, (float *)tg->scale->p,
                                 (float *)tg->inv->p);
        LAUNCH_CHECK(host, "scales_kernel");
    }
    const table_spec spec = {cols, transposed, padded, tg->soff};
    if (g->cfg.recipe == MOERT_FP8_CUDA_CURRENT) { /* every expert's amax first, then the scales */
        CUDA_CHECK(host, cudaMemsetAsync(g->amax.p, 0, (size_t)E * 4, stream));
        for (int64_t first = 0; first < g->active_count; first += TABLE_MAX) {
            const int64_t count = g->active_count - first < TABLE_MAX ? g->active_count - first : TABLE_MAX;
            mat_table t;
            int64_t tiles = 0;
            table_fill(g, first, count, &spec, &t, &tiles);
            table_rows(gm->rows_per_expert, &t);
            fp8_launch_amax_kernel(dim3(grid_chunks(&t, cols), (unsigned)t.count), 256, stream, sizeof(T) == 2, t, src,
                                   cols, (uint32_t *)g->amax.p);
            LAUNCH_CHECK(host, "amax_kernel");
        }
        fp8_launch_scales_kernel((unsigned)ceil_div(E, 128), 128, stream, E, (const uint32_t *)g->amax.p, NULL, fmax,
                                 g->cfg.power_of_2, (float *)tg->scale->p, (float *)tg->inv->p);
        LAUNCH_CHECK(host, "scales_kernel");
    }
    for (int64_t first = 0; first < g->active_count; first += TABLE_MAX) {
        const int64_t count = g->active_count - first < TABLE_MAX ? g->active_count - first : TABLE_MAX;
        mat_table t;
        int64_t tiles = 0;
        table_fill(g, first, count, &spec, &t, &tiles);
        table_rows(gm->rows_per_expert, &t);
        if (!transposed && !is_blockwise(g)) {
            fp8_launch_cast_rows_kernel(dim3(grid_chunks(&t, cols), (unsigned)t.count), 256, stream, sizeof(T) == 2, t,
                                        src, cols, (uint8_t *)tg->bytes->p, fmt, (const float *)tg->scale->p, NULL, 0,
                                        0, rec_amax, rec_seen);
            LAUNCH_CHECK(host, "cast_rows_kernel");
        } else if (!transposed) {
            const int64_t warps = t.row_start[t.count]; /* one per padded row */
            const unsigned blocks = (unsigned)ceil_div(warps * 32, 256);
            if (rows_wide_ok(g, src, cols)) {
                fp8_launch_block_rows_wide_kernel(blocks, 256, stream, t, (const __nv_bfloat16 *)src, cols,
                                                  (uint8_t *)tg->bytes->p, fmt, fmax, g->cfg.power_of_2, g->vec_layout,
                                                  (float *)tg->blk->p);
                LAUNCH_CHECK(host, "block_rows_wide_kernel");
            } else {
                fp8_launch_block_rows_kernel(blocks, 256, stream, sizeof(T) == 2, t, src, cols, (uint8_t *)tg->bytes->p,
                                             fmt, fmax, g->cfg.power_of_2, g->vec_layout, (float *)tg->blk->p);
                LAUNCH_CHECK(host, "block_rows_kernel");
            }
        } else if (tiles > 0) {
            const int mode = is_blockwise(g) ? SCALE_ALONG_ROWS : SCALE_TENSOR;
            fp8_launch_cast_transpose_kernel((unsigned)tiles, 256, stream, sizeof(T) == 2, t, src, cols,
                                             (uint8_t *)tg->bytes->p, fmt, mode, (const float *)tg->scale->p, NULL, 0,
                                             0, fmax, g->cfg.power_of_2, g->vec_layout,
                                             is_blockwise(g) ? (float *)tg->blk->p : NULL, rec_amax, rec_seen);
            LAUNCH_CHECK(host, "cast_transpose_kernel");
        }
    }
    return MOERT_OK;
}

/* quantize_activation_t for the activation dtype (bf16 or fp32). */
moert_result fp8_cuda_quantize_activation(moert_fp8_cuda *g, cudaStream_t stream, const moert_fp8_cuda_gemm *gm,
                                          const void *src, int64_t cols, int operand, int transposed, act_target *tg)
{
    if (gm->act_dtype == MOERT_BF16)
        return quantize_activation_t<__nv_bfloat16>(g, stream, gm, (const __nv_bfloat16 *)src, cols, operand,
                                                    transposed, tg);
    return quantize_activation_t<float>(g, stream, gm, (const float *)src, cols, operand, transposed, tg);
}

/* A table of all E experts' weights ([K][N] each) for the weight kernels; experts first .. first+count. */
static void weight_table(int64_t first, int64_t count, int64_t K, int64_t N, int transposed, mat_table *t,
                         int64_t *tiles)
{
    memset(t, 0, sizeof *t);
    t->count = (int32_t)count;
    const int64_t CT = ceil_div(N, CT_COLS);
    int64_t tile = 0;
    for (int64_t j = 0; j < count; j++) {
        const int64_t e = first + j;
        t->expert[j] = (int32_t)e;
        t->rows[j] = (int32_t)K;
        t->src_row0[j] = e * K;
        t->dst_off[j] = e * K * N;
        t->dst_ld[j] = (int32_t)(transposed ? K : N);
        t->tile_start[j] = (int32_t)tile;
        tile += ceil_div(K, TILE) * CT;
    }
    t->tile_start[count] = (int32_t)tile;
    *tiles = tile;
}

/* The blockwise recipe's buffers of a cached weight's 128x128 tile scales and their factors in both layouts. */
static moert_result tile_scale_buffers(moert_fp8_cuda *g, weight_cache *c)
{
    const int64_t E = g->cfg.num_experts, KB = ceil_div(c->k, TILE), NB = ceil_div(c->n, TILE);
    c->tile_stride = round_up(KB * NB, 4);
    c->blk_stride = blk_floats(NB > KB ? NB : KB, NB > KB ? NB : KB);
    MOK(fp8_cuda_buf_reserve(g, &c->tile_scale, (size_t)(E * c->tile_stride) * 4));
    MOK(fp8_cuda_buf_reserve(g, &c->inv_fwd, (size_t)(E * c->blk_stride) * 4));
    return fp8_cuda_buf_reserve(g, &c->inv_dgrad, (size_t)(E * c->blk_stride) * 4);
}

/* The scales of a cached weight (per-tensor, or 128x128 tiles) and, for the delayed recipe, its amaxes. */
template <typename T>
static moert_result weight_scales_t(moert_fp8_cuda *g, cudaStream_t stream, int which, weight_cache *c, const T *w)
{
    const moert_host *host = g->host;
    const int64_t E = g->cfg.num_experts, K = c->k, N = c->n;
    const float fmax = E4M3_MAX;
    if (is_blockwise(g)) {
        const int64_t KB = ceil_div(K, TILE), NB = ceil_div(N, TILE);
        MOK(tile_scale_buffers(g, c));
        if (E > 0) {
            fp8_launch_tile_scales_kernel(dim3((unsigned)NB, (unsigned)KB, (unsigned)E), 256, stream, sizeof(T) == 2, w,
                                          K, N, fmax, g->cfg.power_of_2, g->blk_layout, (float *)c->tile_scale.p,
                                          c->tile_stride, (float *)c->inv_fwd.p, (float *)c->inv_dgrad.p,
                                          c->blk_stride);
            LAUNCH_CHECK(host, "tile_scales_kernel");
        }
        return MOERT_OK;
    }
    MOK(fp8_cuda_buf_reserve(g, &c->scale, (size_t)(4 * E) * 4));
    MOK(fp8_cuda_buf_reserve(g, &c->inv, (size_t)(4 * E) * 4));
    MOK(fp8_cuda_buf_reserve(g, &c->amax, (size_t)E * 4));
    CUDA_CHECK(host, cudaMemsetAsync(c->amax.p, 0, (size_t)E * 4, stream));
    for (int64_t first = 0; first < E; first += TABLE_MAX) {
        const int64_t count = E - first < TABLE_MAX ? E - first : TABLE_MAX;
        mat_table t;
        int64_t tiles;
        weight_table(first, count, K, N, 0, &t, &tiles);
        fp8_launch_amax_kernel(dim3(grid_chunks(&t, N), (unsigned)count), 256, stream, sizeof(T) == 2, t, w, N,
                               (uint32_t *)c->amax.p);
        LAUNCH_CHECK(host, "amax_kernel");
    }
    const float *slot = g->cfg.recipe == MOERT_FP8_CUDA_DELAYED
                            ? (const float *)g->delayed_owner->slot_scale.p + slot_base(g, which, OP_WEIGHT)
                            : NULL;
    if (E > 0) {
        fp8_launch_scales_kernel((unsigned)ceil_div(E, 128), 128, stream, E, (const uint32_t *)c->amax.p, slot, fmax,
                                 g->cfg.power_of_2, (float *)c->scale.p, (float *)c->inv.p);
        LAUNCH_CHECK(host, "scales_kernel");
    }
    return MOERT_OK;
}

/* One FP8 layout of a cached weight: fwd ([N][K] per expert) or dgrad ([K][N], as stored). */
template <typename T>
static moert_result weight_cast_t(moert_fp8_cuda *g, cudaStream_t stream, weight_cache *c, const T *w, int fwd)
{
    const moert_host *host = g->host;
    const int64_t E = g->cfg.num_experts, K = c->k, N = c->n;
    dev_buf *dst = fwd ? &c->fwd : &c->dgrad;
    MOK(fp8_cuda_buf_grow(g, dst, (size_t)(E * K * N), 0));
    const int blk = is_blockwise(g);
    const int64_t NB = ceil_div(N, TILE);
    for (int64_t first = 0; first < E; first += TABLE_MAX) {
        const int64_t count = E - first < TABLE_MAX ? E - first : TABLE_MAX;
        mat_table t;
        int64_t tiles;
        weight_table(first, count, K, N, fwd, &t, &tiles);
        if (fwd) {
            fp8_launch_cast_transpose_kernel((unsigned)tiles, 256, stream, sizeof(T) == 2, t, w, N, (uint8_t *)dst->p,
                                             0, blk ? SCALE_TILE2D : SCALE_TENSOR, (const float *)c->scale.p,
                                             (const float *)c->tile_scale.p, c->tile_stride, NB, E4M3_MAX,
                                             g->cfg.power_of_2, g->vec_layout, NULL, NULL, NULL);
            LAUNCH_CHECK(host, "cast_transpose_kernel (weight)");
        } else {
            fp8_launch_cast_rows_kernel(dim3(grid_chunks(&t, N), (unsigned)count), 256, stream, sizeof(T) == 2, t, w, N,
                                        (uint8_t *)dst->p, 0, (const float *)c->scale.p,
                                        blk ? (const float *)c->tile_scale.p : NULL, c->tile_stride, NB, NULL, NULL);
            LAUNCH_CHECK(host, "cast_rows_kernel (weight)");
        }
    }
    g->stats.weight_quantizations++;
    return MOERT_OK;
}

/* Both FP8 layouts of a cached weight in one pass (weight_layouts_kernel); blockwise: its tile scales too. */
template <typename T>
static moert_result weight_both_t(moert_fp8_cuda *g, cudaStream_t stream, weight_cache *c, const T *w)
{
    const int64_t E = g->cfg.num_experts, K = c->k, N = c->n;
    const int blk = is_blockwise(g);
    if (blk) MOK(tile_scale_buffers(g, c));
    MOK(fp8_cuda_buf_grow(g, &c->fwd, (size_t)(E * K * N), 0));
    MOK(fp8_cuda_buf_grow(g, &c->dgrad, (size_t)(E * K * N), 0));
    if (E > 0) {
        fp8_launch_weight_layouts_kernel(
            dim3((unsigned)ceil_div(N, TILE), (unsigned)ceil_div(K, TILE), (unsigned)E), 256, stream, sizeof(T) == 2, w,
            K, N, blk ? NULL : (const float *)c->scale.p, E4M3_MAX, g->cfg.power_of_2, g->blk_layout,
            blk ? (float *)c->tile_scale.p : NULL, c->tile_stride, blk ? (float *)c->inv_fwd.p : NULL,
            blk ? (float *)c->inv_dgrad.p : NULL, c->blk_stride, (uint8_t *)c->fwd.p, (uint8_t *)c->dgrad.p);
        LAUNCH_CHECK(g->host, "weight_layouts_kernel");
    }
    g->stats.weight_quantizations += 2;
    return MOERT_OK;
}

/* Makes the scales and the asked layouts of cache c from its source. Both layouts at once (end_step) take one read
 * of the weight; blockwise, the tile scales come out of the same pass (per-tensor scales are made first). */
moert_result fp8_cuda_weight_make(moert_fp8_cuda *g, cudaStream_t stream, int which, weight_cache *c, int fwd,
                                  int dgrad)
{
    const int both = fwd && dgrad && !c->fwd_valid && !c->dgrad_valid;
    if (!c->scales_valid && !(both && is_blockwise(g))) {
        if (c->dtype == MOERT_BF16)
            MOK(weight_scales_t<__nv_bfloat16>(g, stream, which, c, (const __nv_bfloat16 *)c->source));
        else
            MOK(weight_scales_t<float>(g, stream, which, c, (const float *)c->source));
        c->scales_valid = 1;
    }
    if (both) {
        if (c->dtype == MOERT_BF16)
            MOK(weight_both_t<__nv_bfloat16>(g, stream, c, (const __nv_bfloat16 *)c->source));
        else
            MOK(weight_both_t<float>(g, stream, c, (const float *)c->source));
        c->scales_valid = c->fwd_valid = c->dgrad_valid = 1;
        return MOERT_OK;
    }
    if (fwd && !c->fwd_valid) {
        if (c->dtype == MOERT_BF16)
            MOK(weight_cast_t<__nv_bfloat16>(g, stream, c, (const __nv_bfloat16 *)c->source, 1));
        else
            MOK(weight_cast_t<float>(g, stream, c, (const float *)c->source, 1));
        c->fwd_valid = 1;
    }
    if (dgrad && !c->dgrad_valid) {
        if (c->dtype == MOERT_BF16)
            MOK(weight_cast_t<__nv_bfloat16>(g, stream, c, (const __nv_bfloat16 *)c->source, 0));
        else
            MOK(weight_cast_t<float>(g, stream, c, (const float *)c->source, 0));
        c->dgrad_valid = 1;
    }
    return MOERT_OK;
}

/* The FP8 copy of gm's weight in the layout its pass needs: kept while the weight pointer and shape stay (until
 * end_step), else made now. */
moert_result fp8_cuda_weight_get(moert_fp8_cuda *g, cudaStream_t stream, const moert_fp8_cuda_gemm *gm,
                                 weight_cache **out)
{
    const int fwd = gm->pass == MOERT_GEMM_FORWARD;
    /* another slot: its slot-0 twin's copies where they hold this weight in this pass's layout (slot 0 makes or remakes
     * them only in its own calls and at end_step, on its stream, which every call of this slot's follows; in a merged
     * call the other half is slot 0's forward or backward, which touches the other layout or finds this one made) */
    weight_cache *shared = g->weight_owner != g ? &g->weight_owner->weights[gm->which] : NULL;
    if (shared && shared->source == gm->weight && shared->dtype == gm->weight_dtype && shared->k == gm->k_in &&
        shared->n == gm->n_out && shared->scales_valid && (fwd ? shared->fwd_valid : shared->dgrad_valid)) {
        *out = shared;
        return MOERT_OK;
    }
    weight_cache *c = &g->weights[gm->which];
    if (c->source != gm->weight || c->dtype != gm->weight_dtype || c->k != gm->k_in || c->n != gm->n_out) {
        c->source = gm->weight;
        c->dtype = gm->weight_dtype;
        c->k = gm->k_in;
        c->n = gm->n_out;
        c->scales_valid = c->fwd_valid = c->dgrad_valid = 0;
    }
    moert_result rc = fp8_cuda_weight_make(g, stream, gm->which, c, fwd, !fwd);
    if (rc != MOERT_OK) {
        c->source = NULL;
        return rc;
    }
    *out = c;
    return MOERT_OK;
}

/* Delayed recipe: the cached weight's amaxes count for the experts of this GEMM. */
moert_result fp8_cuda_note_weight(moert_fp8_cuda *g, cudaStream_t stream, int which, const weight_cache *c)
{
    const int64_t base = slot_base(g, which, OP_WEIGHT);
    for (int64_t first = 0; first < g->active_count; first += TABLE_MAX) {
        const int64_t count = g->active_count - first < TABLE_MAX ? g->active_count - first : TABLE_MAX;
        mat_table t;
        memset(&t, 0, sizeof t);
        t.count = (int32_t)count;
        for (int64_t j = 0; j < count; j++) t.expert[j] = g->active[first + j];
        fp8_launch_note_kernel(1, TABLE_MAX, stream, t, (const uint32_t *)c->amax.p,
                               (uint32_t *)g->delayed_owner->slot_amax.p + base,
                               (int *)g->delayed_owner->slot_seen.p + base);
        LAUNCH_CHECK(g->host, "note_kernel");
    }
    return MOERT_OK;
}
