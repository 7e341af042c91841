/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The fp8 precision recipes on CUDA (see precision_fp8_cuda.h for layouts and scale tensors): the handle. It holds
 * the settings, the device buffers (grown as the GEMMs need them, from the host's pool where it has one), the
 * cuBLASLt handle and the matmul lanes, and the delayed recipe's device state. The other parts of the path, and
 * what they share, are listed in precision_fp8_cuda_internal.h.
 */
#include "precision_fp8_cuda_internal.h"

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Device memory from the host's pool when it has one for this device, else cudaMalloc. */
static moert_result dev_alloc(moert_fp8_cuda *g, size_t bytes, void **out)
{
    const moert_host *h = g->host;
    *out = NULL;
    if (h && h->alloc && h->free) return h->alloc(h, g->device, bytes ? bytes : 1, out);
    cudaError_t err = cudaMalloc(out, bytes ? bytes : 1);
    if (err != cudaSuccess) {
        *out = NULL;
        return report(h, MOERT_ERR_OUT_OF_MEMORY, "fp8 cuda: cudaMalloc(%zu) failed: %s", bytes,
                      cudaGetErrorString(err));
    }
    return MOERT_OK;
}

/* Gives back memory from dev_alloc. */
static void dev_free(moert_fp8_cuda *g, void *p)
{
    if (!p) return;
    const moert_host *h = g->host;
    if (h && h->alloc && h->free)
        h->free(h, g->device, p);
    else
        cudaFree(p);
}

/* Grows b to at least bytes; slack: a quarter more, so activations whose counts vary do not regrow every step
 * (weights, whose size does not change, take none). */
moert_result fp8_cuda_buf_grow(moert_fp8_cuda *g, dev_buf *b, size_t bytes, int slack)
{
    if (b->cap >= bytes && b->p) return MOERT_OK;
    size_t want = slack ? bytes + bytes / 4 + 256 : bytes + 256;
    void *p = NULL;
    MOK(dev_alloc(g, want, &p));
    dev_free(g, b->p);
    b->p = p;
    b->cap = want;
    return MOERT_OK;
}

/* fp8_cuda_buf_grow with slack. */
moert_result fp8_cuda_buf_reserve(moert_fp8_cuda *g, dev_buf *b, size_t bytes)
{
    return fp8_cuda_buf_grow(g, b, bytes, 1);
}

/* An activation buffer: grown once to the worst case when that is known (worst >= bytes: the caller's row
 * capacity, see moert_fp8_cuda_gemm.capacity), else to bytes with slack. */
moert_result fp8_cuda_buf_reserve_worst(moert_fp8_cuda *g, dev_buf *b, size_t bytes, size_t worst)
{
    if (worst >= bytes) return fp8_cuda_buf_grow(g, b, worst, 0);
    return fp8_cuda_buf_reserve(g, b, bytes);
}

/* Frees a growing buffer. */
static void buf_release(moert_fp8_cuda *g, dev_buf *b)
{
    dev_free(g, b->p);
    b->p = NULL;
    b->cap = 0;
}

/* Frees everything the handle holds (see the header). */
extern "C" void moert_fp8_cuda_destroy(moert_fp8_cuda *g)
{
    if (!g) return;
    for (int i = 1; i < MOERT_FP8_CUDA_MAX_STREAMS; i++) {
        if (g->lane_stream[i]) cudaStreamDestroy(g->lane_stream[i]);
        if (g->join_event[i]) cudaEventDestroy(g->join_event[i]);
    }
    if (g->fork_event) cudaEventDestroy(g->fork_event);
    moert_fp8_block_ctx_destroy(g->block);
    for (int i = 0; i < g->desc_count; i++) cublasLtMatmulDescDestroy(g->descs[i].desc);
    for (int i = 0; i < 3; i++)
        if (g->layout[i].layout) cublasLtMatrixLayoutDestroy(g->layout[i].layout);
    if (g->pref) cublasLtMatmulPreferenceDestroy(g->pref);
    if (g->lt) cublasLtDestroy(g->lt);
    dev_buf *bufs[] = {&g->workspace, &g->act_a,   &g->act_b, &g->a_scale, &g->a_inv,      &g->b_scale,
                       &g->b_inv,     &g->a_blk,   &g->b_blk, &g->amax,    &g->slot_scale, &g->slot_amax,
                       &g->slot_seen, &g->history, &g->next,  &g->filled,  &g->dscratch};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) buf_release(g, bufs[i]);
    for (int w = 0; w < 2; w++) {
        weight_cache *c = &g->weights[w];
        dev_buf *wb[] = {&c->fwd, &c->dgrad, &c->scale, &c->inv, &c->amax, &c->tile_scale, &c->inv_fwd, &c->inv_dgrad};
        for (size_t i = 0; i < sizeof wb / sizeof wb[0]; i++) buf_release(g, wb[i]);
    }
    free(g->row0);
    free(g->rows16);
    free(g->prow0);
    free(g->a_off);
    free(g->b_off);
    free(g->a_soff);
    free(g->b_soff);
    free(g->active);
    free(g->plans);
    free(g);
}

/* cuBLASLt handle, preference, layout objects. */
static moert_result lt_setup(moert_fp8_cuda *g)
{
    const moert_host *host = g->host;
    CUBLAS_CHECK(host, cublasLtCreate(&g->lt));
    CUBLAS_CHECK(host, cublasLtMatmulPreferenceCreate(&g->pref));
    uint64_t ws = MOERT_FP8_CUDA_STREAM_WORKSPACE_BYTES;
    CUBLAS_CHECK(
        host, cublasLtMatmulPreferenceSetAttribute(g->pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
    for (int i = 0; i < 3; i++) {
        CUBLAS_CHECK(
            host, cublasLtMatrixLayoutCreate(&g->layout[i].layout, i < 2 ? CUDA_R_8F_E4M3 : CUDA_R_16BF, 16, 16, 16));
        g->layout[i].type = i < 2 ? CUDA_R_8F_E4M3 : CUDA_R_16BF;
        g->layout[i].rows = g->layout[i].cols = g->layout[i].ld = 16;
    }
    return MOERT_OK;
}

/* The delayed recipe's device state: scales 1, empty histories. */
static moert_result delayed_setup(moert_fp8_cuda *g)
{
    const int64_t slots = 6 * g->cfg.num_experts, len = g->cfg.amax_history_len;
    MOK(fp8_cuda_buf_reserve(g, &g->slot_scale, (size_t)slots * 4));
    MOK(fp8_cuda_buf_reserve(g, &g->slot_amax, (size_t)slots * 4));
    MOK(fp8_cuda_buf_reserve(g, &g->slot_seen, (size_t)slots * 4));
    MOK(fp8_cuda_buf_reserve(g, &g->history, (size_t)(slots * len) * 4));
    MOK(fp8_cuda_buf_reserve(g, &g->next, (size_t)slots * 4));
    MOK(fp8_cuda_buf_reserve(g, &g->filled, (size_t)slots * 4));
    const moert_host *host = g->host;
    CUDA_CHECK(host, cudaDeviceSynchronize()); /* init only: pool blocks may have been used on another stream */
    CUDA_CHECK(host, cudaMemset(g->slot_amax.p, 0, (size_t)slots * 4));
    CUDA_CHECK(host, cudaMemset(g->slot_seen.p, 0, (size_t)slots * 4));
    CUDA_CHECK(host, cudaMemset(g->history.p, 0, (size_t)(slots * len) * 4));
    CUDA_CHECK(host, cudaMemset(g->next.p, 0, (size_t)slots * 4));
    CUDA_CHECK(host, cudaMemset(g->filled.p, 0, (size_t)slots * 4));
    fp8_launch_fill_kernel((unsigned)ceil_div(slots, 256), 256, 0, (float *)g->slot_scale.p, slots, 1.0f);
    LAUNCH_CHECK(host, "fill_kernel");
    CUDA_CHECK(host, cudaDeviceSynchronize()); /* init only: the legacy stream's work before any step */
    return MOERT_OK;
}

/* Creates the handle: host tables, cuBLASLt, workspace, the delayed recipe's state (see the header). */
extern "C" moert_result moert_fp8_cuda_create(const moert_host *host, moert_device device,
                                              const moert_fp8_cuda_config *cfg, moert_fp8_cuda **out)
{
    *out = NULL;
    if (cfg->num_experts < 0 || cfg->num_experts > 0xFFFFFF || cfg->recipe < MOERT_FP8_CUDA_CURRENT ||
        cfg->recipe > MOERT_FP8_CUDA_BLOCKWISE || cfg->amax_history_len < 1)
        return report(host, MOERT_ERR_INVALID_ARGUMENT,
                      "fp8 cuda: bad configuration (experts %lld, recipe %d, "
                      "history %lld)",
                      (long long)cfg->num_experts, (int)cfg->recipe, (long long)cfg->amax_history_len);
    moert_fp8_cuda *g = (moert_fp8_cuda *)calloc(1, sizeof *g);
    if (!g) return report(host, MOERT_ERR_OUT_OF_MEMORY, "fp8 cuda: out of host memory for the handle");
    g->host = host;
    g->delayed_owner = g;
    g->weight_owner = g;
    g->block_tuning = moert_fp8_block_tuning_default();
    g->device = device;
    g->cfg = *cfg;
    g->streams = 1;
    g->blk_order = BLK_ORDER_UNKNOWN;
    const size_t E = (size_t)(cfg->num_experts > 0 ? cfg->num_experts : 1);
    g->plans = (plan_entry *)calloc(PLAN_SLOTS, sizeof *g->plans);
    g->row0 = (int64_t *)calloc(E, 8);
    g->rows16 = (int64_t *)calloc(E, 8);
    g->prow0 = (int64_t *)calloc(E, 8);
    g->a_off = (int64_t *)calloc(E, 8);
    g->b_off = (int64_t *)calloc(E, 8);
    g->a_soff = (int64_t *)calloc(E, 8);
    g->b_soff = (int64_t *)calloc(E, 8);
    g->active = (int32_t *)calloc(E, 4);
    moert_result rc = MOERT_OK;
    if (!g->plans || !g->row0 || !g->rows16 || !g->prow0 || !g->a_off || !g->b_off || !g->a_soff || !g->b_soff ||
        !g->active) {
        rc = report(host, MOERT_ERR_OUT_OF_MEMORY, "fp8 cuda: out of host memory for %zu experts' tables", E);
        goto fail;
    }
    if ((rc = lt_setup(g)) != MOERT_OK) goto fail;
    if ((rc = fp8_cuda_buf_reserve(g, &g->workspace, MOERT_FP8_CUDA_STREAM_WORKSPACE_BYTES)) != MOERT_OK) goto fail;
    if (cfg->recipe == MOERT_FP8_CUDA_DELAYED && (rc = delayed_setup(g)) != MOERT_OK) goto fail;
    *out = g;
    return MOERT_OK;
fail:
    moert_fp8_cuda_destroy(g);
    return rc;
}

/* The blockwise recipe's GEMMs on the wgmma kernel: every pass (on 1), all but the WGRADs that overwrite grad_weight
 * (2), none (0). */
extern "C" moert_result moert_fp8_cuda_set_block_kernel(moert_fp8_cuda *g, int on)
{
    if (on < 0 || on > 2)
        return report(g->host, MOERT_ERR_INVALID_ARGUMENT, "fp8 cuda: block kernel setting %d (0, 1 or 2)", on);
    if (!on) {
        moert_fp8_block_ctx_destroy(g->block);
        g->block = NULL;
        return MOERT_OK;
    }
    if (g->cfg.recipe != MOERT_FP8_CUDA_BLOCKWISE)
        return report(g->host, MOERT_ERR_UNSUPPORTED, "the FP8 GEMM kernel serves the blockwise recipe only");
    if (g->vec_layout != MOERT_FP8_VEC128_X_MAJOR || g->blk_layout != MOERT_FP8_BLK_K_MAJOR_PAD4)
        return report(g->host, MOERT_ERR_UNSUPPORTED, "the FP8 GEMM kernel reads the default scale layouts only");
    g->block_wgrad = on == 1;
    if (g->block) return MOERT_OK;
    moert_result rc = moert_fp8_block_ctx_create(g->host, &g->block);
    if (rc == MOERT_OK) rc = moert_fp8_block_ctx_tune(g->block, &g->block_tuning);
    if (rc != MOERT_OK) {
        moert_fp8_block_ctx_destroy(g->block);
        g->block = NULL;
    }
    return rc;
}

/* How the wgmma kernel runs: kept for a kernel context made later, applied at once to one that exists. */
extern "C" moert_result moert_fp8_cuda_set_block_tuning(moert_fp8_cuda *g, const moert_fp8_block_tuning *tuning)
{
    if (g->block) MOK(moert_fp8_block_ctx_tune(g->block, tuning));
    g->block_tuning = *tuning;
    return MOERT_OK;
}

/* The wgmma kernel's configuration in words (moert_fp8_block_ctx_describe); "cuBLASLt" when it serves no pass. */
extern "C" void moert_fp8_cuda_describe_block_kernel(const moert_fp8_cuda *g, char *buf, size_t size)
{
    if (g->block)
        moert_fp8_block_ctx_describe(g->block, buf, size);
    else
        snprintf(buf, size, "cuBLASLt");
}

/* Sets the matmul lanes; creates the missing streams and events, grows the workspace. */
extern "C" moert_result moert_fp8_cuda_set_streams(moert_fp8_cuda *g, int streams)
{
    const moert_host *host = g->host;
    if (streams < 1 || streams > MOERT_FP8_CUDA_MAX_STREAMS)
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "fp8 cuda: %d streams asked for, expected 1 to %d", streams,
                      MOERT_FP8_CUDA_MAX_STREAMS);
    const size_t need = (size_t)streams * MOERT_FP8_CUDA_STREAM_WORKSPACE_BYTES;
    if (g->workspace.cap < need) {
        CUDA_CHECK(host, cudaDeviceSynchronize()); /* a setup call: the old workspace may be in use */
        MOK(fp8_cuda_buf_reserve(g, &g->workspace, need));
    }
    if (streams > 1 && !g->fork_event)
        CUDA_CHECK(host, cudaEventCreateWithFlags(&g->fork_event, cudaEventDisableTiming));
    for (int i = 1; i < streams; i++) {
        if (!g->lane_stream[i]) CUDA_CHECK(host, cudaStreamCreateWithFlags(&g->lane_stream[i], cudaStreamNonBlocking));
        if (!g->join_event[i]) CUDA_CHECK(host, cudaEventCreateWithFlags(&g->join_event[i], cudaEventDisableTiming));
    }
    g->streams = streams;
    return MOERT_OK;
}

/* Forgets the FP8 weight copies (see the header). */
extern "C" void moert_fp8_cuda_drop_weights(moert_fp8_cuda *g)
{
    for (int w = 0; w < 2; w++) {
        weight_cache *c = &g->weights[w];
        c->source = NULL;
        c->scales_valid = c->fwd_valid = c->dgrad_valid = 0;
    }
}

/* Chooses the block-scale layouts (see the header). */
extern "C" void moert_fp8_cuda_set_scale_layout(moert_fp8_cuda *g, moert_fp8_cuda_vec_layout vec,
                                                moert_fp8_cuda_blk_layout blk)
{
    if (g->block && (vec != MOERT_FP8_VEC128_X_MAJOR || blk != MOERT_FP8_BLK_K_MAJOR_PAD4))
        (void)moert_fp8_cuda_set_block_kernel(g, 0); /* the kernel reads the default layouts only: cuBLASLt then */
    g->vec_layout = (int)vec;
    g->blk_layout = (int)blk;
    moert_fp8_cuda_drop_weights(g);
}

/* Benchmarks: quantize without matmuls (see the header). */
extern "C" void moert_fp8_cuda_set_quantize_only(moert_fp8_cuda *g, int enabled) { g->quantize_only = enabled != 0; }

/* Counters (see the header). */
extern "C" void moert_fp8_cuda_get_stats(const moert_fp8_cuda *g, moert_fp8_cuda_stats *out) { *out = g->stats; }

/* The last GEMM's quantized operands, for tests (see the header). */
extern "C" void moert_fp8_cuda_last_operands(const moert_fp8_cuda *g, moert_fp8_cuda_operands *out) { *out = g->last; }

extern "C" void moert_fp8_cuda_share_delayed(moert_fp8_cuda *g, moert_fp8_cuda *owner)
{
    g->delayed_owner = owner ? owner : g;
}

extern "C" void moert_fp8_cuda_share_weights(moert_fp8_cuda *g, moert_fp8_cuda *owner)
{
    g->weight_owner = owner ? owner : g;
}
