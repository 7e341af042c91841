/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The fp8 recipes' cuBLASLt matmuls: one per non-empty expert, with a descriptor per type and scale-mode pair, the
 * layouts refitted in place, and plans cached per shape bucket (an exact-shape plan when cuBLASLt refuses the
 * bucket's); the availability checks a layer runs at init (moert_fp8_cuda_check_support), and the lanes (streams)
 * the experts' matmuls are spread over.
 */
#include "precision_fp8_cuda_internal.h"

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Largest power of two (<= 256) dividing the address. */
static int32_t pointer_alignment(const void *p)
{
    uintptr_t a = (uintptr_t)p;
    int32_t align = 256;
    while (align > 1 && (a % (uintptr_t)align) != 0) align /= 2;
    return align;
}

/* The row count a plan is chosen for: few buckets, as in the bf16 path. */
static int64_t row_bucket(int64_t rows)
{
    if (rows <= 128) return rows <= 32 ? 32 : round_up(rows, 32);
    if (rows <= 1024) return round_up(rows, 128);
    for (int64_t p = 1024; p <= INT64_MAX / 4; p *= 2) {
        if (rows <= p + p / 2) return p + p / 2;
        if (rows <= 2 * p) return 2 * p;
    }
    return rows;
}

/* The matmul descriptor for p's types and scale modes (TN, fp32 compute, no fast accumulation), made once. */
static moert_result desc_get(moert_fp8_cuda *g, const expert_mm *p, cublasLtMatmulDesc_t *out)
{
    const moert_host *host = g->host;
    for (int i = 0; i < g->desc_count; i++) {
        const desc_entry *d = &g->descs[i];
        if (d->a_type == (int32_t)p->a_type && d->b_type == (int32_t)p->b_type && d->a_mode == p->a_mode &&
            d->b_mode == p->b_mode) {
            *out = d->desc;
            return MOERT_OK;
        }
    }
    if (g->desc_count == MAX_DESCS) return report(host, MOERT_ERR_INTERNAL, "fp8 cuda: too many matmul descriptors");
    desc_entry *d = &g->descs[g->desc_count];
    CUBLAS_CHECK(host, cublasLtMatmulDescCreate(&d->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    g->desc_count++;
    d->a_type = (int32_t)p->a_type;
    d->b_type = (int32_t)p->b_type;
    d->a_mode = p->a_mode;
    d->b_mode = p->b_mode;
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    const int8_t fast = 0;
    CUBLAS_CHECK(host, cublasLtMatmulDescSetAttribute(d->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    CUBLAS_CHECK(host, cublasLtMatmulDescSetAttribute(d->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    CUBLAS_CHECK(host, cublasLtMatmulDescSetAttribute(d->desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof fast));
    CUBLAS_CHECK(
        host, cublasLtMatmulDescSetAttribute(d->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &d->a_mode, sizeof d->a_mode));
    CUBLAS_CHECK(
        host, cublasLtMatmulDescSetAttribute(d->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &d->b_mode, sizeof d->b_mode));
    *out = d->desc;
    return MOERT_OK;
}

/* The expert's row count in p (its m, n or k). */
static int64_t expert_rows(const expert_mm *p)
{
    return p->row_dim == ROW_K ? p->k : p->row_dim == ROW_M ? p->m : p->n;
}

/* Makes a layout describe type, rows x cols, ld, writing only what differs. */
static moert_result layout_fit(const moert_host *host, layout_state *s, cudaDataType_t type, int64_t rows, int64_t cols,
                               int64_t ld)
{
    return moert_lt_layout_fit(host, s, (int32_t)type, rows, cols, ld);
}

/* Fits the three layouts to p with the expert's row dimension set to rows (the bucket, or the real count). */
static moert_result layouts_fit(moert_fp8_cuda *g, const expert_mm *p, int64_t rows)
{
    const moert_host *host = g->host;
    int64_t m = p->m, n = p->n, k = p->k, lda = p->lda, ldb = p->ldb, ldd = p->ldd;
    if (p->row_dim == ROW_K)
        k = lda = ldb = rows;
    else if (p->row_dim == ROW_M)
        m = rows, ldd = round_up(rows, 16);
    else
        n = rows;
    MOK(layout_fit(host, &g->layout[0], p->a_type, k, m, lda));
    MOK(layout_fit(host, &g->layout[1], p->b_type, k, n, ldb));
    return layout_fit(host, &g->layout[2], p->d_type, m, n, ldd);
}

/* Writes the minimum pointer alignments into the preference, the ones that changed only. */
static moert_result pref_align_set(moert_fp8_cuda *g, const plan_key *key)
{
    const int32_t want[3] = {key->align_a, key->align_b, key->align_d};
    return moert_lt_pref_align_set(g->host, g->pref, g->pref_align, want);
}

/* FNV-1a over a plan key. */
static uint64_t plan_hash(const plan_key *k)
{
    uint64_t h = 1469598103934665603ull;
    const unsigned char *b = (const unsigned char *)k;
    for (size_t i = 0; i < sizeof *k; i++) h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

/* Names for messages. */
static const char *type_name(cudaDataType_t t)
{
    switch (t) {
    case CUDA_R_8F_E4M3: return "e4m3";
    case CUDA_R_8F_E5M2: return "e5m2";
    case CUDA_R_16BF: return "bf16";
    case CUDA_R_32F: return "fp32";
    default: return "?";
    }
}

static const char *mode_name(int32_t m)
{
    return m == CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F   ? "scalar"
           : m == CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F ? "vec128"
                                                          : "blk128x128";
}

/* The plan of p for the bucket of its rows (exact = 0) or its exact shape; leaves the layouts fit to the query. */
static moert_result plan_get(moert_fp8_cuda *g, cublasLtMatmulDesc_t desc, const expert_mm *p, int64_t rows, int exact,
                             plan_entry **out)
{
    const moert_host *host = g->host;
    const int64_t queried = exact ? rows : row_bucket(rows);
    plan_key key;
    memset(&key, 0, sizeof key);
    key.a_type = (int32_t)p->a_type;
    key.b_type = (int32_t)p->b_type;
    key.d_type = (int32_t)p->d_type;
    key.a_mode = p->a_mode;
    key.b_mode = p->b_mode;
    key.beta1 = p->beta1;
    key.exact = exact;
    key.align_a = pointer_alignment(p->a);
    key.align_b = pointer_alignment(p->b);
    key.align_d = pointer_alignment(p->d);
    key.m = p->row_dim == ROW_M ? queried : p->m;
    key.n = p->row_dim == ROW_N ? queried : p->n;
    key.k = p->row_dim == ROW_K ? queried : p->k;
    const uint64_t home = plan_hash(&key) % PLAN_SLOTS;
    plan_entry *free_slot = NULL;
    for (int probe = 0; probe < PLAN_PROBES; probe++) {
        plan_entry *s = &g->plans[(home + (uint64_t)probe) % PLAN_SLOTS];
        if (s->valid && memcmp(&s->key, &key, sizeof key) == 0) {
            g->stats.cache_hits++;
            *out = s;
            return MOERT_OK;
        }
        if (!s->valid && !free_slot) free_slot = s;
    }
    plan_entry *slot = free_slot ? free_slot : &g->plans[home];
    slot->valid = 0;
    MOK(layouts_fit(g, p, queried));
    MOK(pref_align_set(g, &key));
    cublasLtMatmulHeuristicResult_t result;
    int found = 0;
    g->stats.heuristic_queries++;
    cublasStatus_t st =
        cublasLtMatmulAlgoGetHeuristic(g->lt, desc, g->layout[0].layout, g->layout[1].layout, g->layout[2].layout,
                                       g->layout[2].layout, g->pref, 1, &result, &found);
    if ((st != CUBLAS_STATUS_SUCCESS || found < 1) && !exact)
        return MOERT_ERR_UNSUPPORTED; /* the caller tries the
                                                                                              exact shape */
    if (st != CUBLAS_STATUS_SUCCESS || found < 1)
        return report(
            host, MOERT_ERR_UNSUPPORTED,
            "fp8 cuda: cuBLASLt has no FP8 matmul for expert %lld: A %s (%s scales) x B %s (%s scales) -> %s%s, "
            "m=%lld n=%lld k=%lld (%s)",
            (long long)p->expert, type_name(p->a_type), mode_name(p->a_mode), type_name(p->b_type),
            mode_name(p->b_mode), type_name(p->d_type), p->beta1 ? " accumulated" : "", (long long)key.m,
            (long long)key.n, (long long)key.k,
            st != CUBLAS_STATUS_SUCCESS ? cublasLtGetStatusString(st) : "no algorithm found");
    slot->key = key;
    slot->algo = result.algo;
    slot->valid = 1;
    *out = slot;
    return MOERT_OK;
}

/* One expert's matmul on stream with a workspace slice: the bucket's plan, else an exact-shape plan. */
static moert_result matmul_expert(moert_fp8_cuda *g, cudaStream_t stream, void *workspace, const expert_mm *p)
{
    const moert_host *host = g->host;
    cublasLtMatmulDesc_t desc = NULL;
    MOK(desc_get(g, p, &desc));
    CUBLAS_CHECK(host, cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &p->a_scale,
                                                      sizeof p->a_scale));
    CUBLAS_CHECK(host, cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &p->b_scale,
                                                      sizeof p->b_scale));
    const int64_t rows = expert_rows(p);
    const float alpha = 1.0f, beta = p->beta1 ? 1.0f : 0.0f;
    cublasStatus_t st = CUBLAS_STATUS_NOT_SUPPORTED;
    for (int exact = 0; exact < 2; exact++) {
        plan_entry *plan = NULL;
        moert_result rc = plan_get(g, desc, p, rows, exact, &plan);
        if (rc != MOERT_OK) {
            if (!exact) { /* no plan for the bucket's shape: try the exact one */
                g->stats.exact_fallbacks++;
                continue;
            }
            return rc;
        }
        MOK(layouts_fit(g, p, rows));
        st = cublasLtMatmul(g->lt, desc, &alpha, p->a, g->layout[0].layout, p->b, g->layout[1].layout, &beta, p->d,
                            g->layout[2].layout, p->d, g->layout[2].layout, &plan->algo, workspace,
                            MOERT_FP8_CUDA_STREAM_WORKSPACE_BYTES, stream);
        if (st == CUBLAS_STATUS_SUCCESS) {
            g->stats.matmuls++;
            return MOERT_OK;
        }
        if (exact || (st != CUBLAS_STATUS_NOT_SUPPORTED && st != CUBLAS_STATUS_INVALID_VALUE)) break;
        g->stats.exact_fallbacks++;
    }
    return report(host, MOERT_ERR_CUDA,
                  "cublasLtMatmul(fp8 expert %lld: %s x %s -> %s, m=%lld n=%lld k=%lld) failed: %s",
                  (long long)p->expert, type_name(p->a_type), type_name(p->b_type), type_name(p->d_type),
                  (long long)p->m, (long long)p->n, (long long)p->k, cublasLtGetStatusString(st));
}

/* Makes lanes 1 .. lanes-1 wait for the caller's stream. */
static moert_result lanes_fork(moert_fp8_cuda *g, cudaStream_t stream, int lanes)
{
    CUDA_CHECK(g->host, cudaEventRecord(g->fork_event, stream));
    for (int i = 1; i < lanes; i++) CUDA_CHECK(g->host, cudaStreamWaitEvent(g->lane_stream[i], g->fork_event, 0));
    return MOERT_OK;
}

/* Makes the caller's stream wait for lanes 1 .. lanes-1 (host NULL: keep an earlier error). */
static moert_result lanes_join(moert_fp8_cuda *g, const moert_host *host, cudaStream_t stream, int lanes)
{
    moert_result rc = MOERT_OK;
    for (int i = 1; i < lanes; i++) {
        cudaError_t err = cudaEventRecord(g->join_event[i], g->lane_stream[i]);
        if (err == cudaSuccess) err = cudaStreamWaitEvent(stream, g->join_event[i], 0);
        if (err != cudaSuccess && rc == MOERT_OK)
            rc = report(host, MOERT_ERR_CUDA, "joining internal stream %d back failed: %s", i, cudaGetErrorString(err));
    }
    return rc;
}

/* Whether cuBLASLt offers a matmul for p (the heuristic, for its shape as given; pointers aligned to 256). The
 * scale pointers name the workspace: cuBLASLt 13 answers a query for the block modes without scale pointers with
 * INVALID_VALUE (every matmul_expert sets the real ones). */
static moert_result matmul_available(moert_fp8_cuda *g, const expert_mm *p, int *found)
{
    cublasLtMatmulDesc_t desc = NULL;
    MOK(desc_get(g, p, &desc));
    const void *dummy = g->workspace.p;
    CUBLAS_CHECK(g->host,
                 cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &dummy, sizeof dummy));
    CUBLAS_CHECK(g->host,
                 cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &dummy, sizeof dummy));
    MOK(layouts_fit(g, p, expert_rows(p)));
    plan_key key;
    memset(&key, 0, sizeof key);
    key.align_a = key.align_b = key.align_d = 256;
    MOK(pref_align_set(g, &key));
    cublasLtMatmulHeuristicResult_t result;
    *found = 0;
    g->stats.heuristic_queries++;
    const cublasStatus_t st =
        cublasLtMatmulAlgoGetHeuristic(g->lt, desc, g->layout[0].layout, g->layout[1].layout, g->layout[2].layout,
                                       g->layout[2].layout, g->pref, 1, &result, found);
    if (st != CUBLAS_STATUS_SUCCESS) *found = 0;
    return MOERT_OK;
}

/* The matmul of one expert of `rows` rows for a pass, with null pointers (for availability checks). */
static void matmul_shape(const moert_fp8_cuda *g, moert_gemm_pass pass, int64_t K, int64_t N, moert_dtype act,
                         moert_dtype grad_weight, int64_t rows, expert_mm *p)
{
    const int blk = is_blockwise(g), grad_fmt = operand_format(g, OP_GRAD);
    const int32_t scalar = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F, vec = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    const int32_t blk2d = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    memset(p, 0, sizeof *p);
    if (pass == MOERT_GEMM_WGRAD) {
        p->a_type = fp8_type(grad_fmt);
        p->b_type = CUDA_R_8F_E4M3;
        p->d_type = grad_weight == MOERT_BF16 ? CUDA_R_16BF : CUDA_R_32F;
        p->a_mode = p->b_mode = blk ? vec : scalar;
        p->beta1 = 1;
        p->row_dim = ROW_K;
        p->m = N, p->n = K, p->k = rows, p->lda = rows, p->ldb = rows, p->ldd = N;
        return;
    }
    const int fwd = pass == MOERT_GEMM_FORWARD;
    if (blk && g->blk_order == BLK_ORDER_WEIGHT_B) {
        p->a_type = fp8_type(fwd ? 0 : grad_fmt);
        p->b_type = CUDA_R_8F_E4M3;
        p->d_type = act == MOERT_BF16 ? CUDA_R_16BF : CUDA_R_32F;
        p->a_mode = vec;
        p->b_mode = blk2d;
        p->row_dim = ROW_M;
        p->m = rows, p->n = fwd ? N : K, p->k = fwd ? K : N;
        p->lda = p->ldb = p->k, p->ldd = round_up(rows, 16);
        return;
    }
    p->a_type = CUDA_R_8F_E4M3;
    p->b_type = fp8_type(fwd ? 0 : grad_fmt);
    p->d_type = act == MOERT_BF16 ? CUDA_R_16BF : CUDA_R_32F;
    p->a_mode = blk ? blk2d : scalar;
    p->b_mode = blk ? vec : scalar;
    p->m = fwd ? N : K, p->n = rows, p->k = fwd ? K : N;
    p->lda = p->ldb = p->k, p->ldd = p->m;
}

static const char *const pass_label[3] = {"forward", "dgrad", "wgrad"};

/*
 * Blockwise: which operand carries the weight in FORWARD/DGRAD (see BLK_ORDER_*), asked once with the heuristic
 * for a forward GEMM of K x N and 512 rows: the weight as A if cuBLASLt has that, else as B (kept even when
 * refused too, so the caller's error names the last order tried).
 */
moert_result fp8_cuda_choose_blk_order(moert_fp8_cuda *g, int64_t K, int64_t N, moert_dtype act)
{
    if (!is_blockwise(g) || g->blk_order != BLK_ORDER_UNKNOWN) return MOERT_OK;
    for (int order = BLK_ORDER_WEIGHT_A; order <= BLK_ORDER_WEIGHT_B; order++) {
        g->blk_order = order;
        expert_mm p;
        matmul_shape(g, MOERT_GEMM_FORWARD, K, N, act, MOERT_F32, 512, &p);
        int found = 0;
        MOK(matmul_available(g, &p, &found));
        if (found) break;
    }
    return MOERT_OK;
}

extern "C" moert_result moert_fp8_cuda_check_support(moert_fp8_cuda *g, int64_t hidden, int64_t ffn_hidden,
                                                     moert_dtype act_dtype, moert_dtype grad_weight_dtype,
                                                     int fp8_wgrad)
{
    static const int64_t rows = 512;
    /* the blockwise kernel takes every shape the plugin accepts: only the passes on cuBLASLt are asked */
    if (!kernel_serves(g, MOERT_GEMM_FORWARD, 0)) MOK(fp8_cuda_choose_blk_order(g, hidden, 2 * ffn_hidden, act_dtype));
    for (int w = 0; w < 2; w++)
        for (int pass = 0; pass < 3; pass++) {
            if (kernel_serves(g, (moert_gemm_pass)pass, 1)) continue; /* overwriting: cuBLASLt's case, if any */
            if (pass == MOERT_GEMM_WGRAD && !fp8_wgrad) continue;     /* the bf16 GEMMs make the weight gradients */
            const int64_t K = w == 0 ? hidden : ffn_hidden, N = w == 0 ? 2 * ffn_hidden : hidden;
            expert_mm p;
            matmul_shape(g, (moert_gemm_pass)pass, K, N, act_dtype, grad_weight_dtype, rows, &p);
            int found = 0;
            MOK(matmul_available(g, &p, &found));
            if (!found)
                return report(g->host, MOERT_ERR_UNSUPPORTED,
                              "cuBLASLt on this GPU has no FP8 matmul for the fc%d %s GEMM of this recipe: A %s (%s "
                              "scales) x B %s (%s scales) -> %s%s, m=%lld n=%lld k=%lld%s%s",
                              w + 1, pass_label[pass], type_name(p.a_type), mode_name(p.a_mode), type_name(p.b_type),
                              mode_name(p.b_mode), type_name(p.d_type), p.beta1 ? " accumulated" : "", (long long)p.m,
                              (long long)p.n, (long long)p.k,
                              is_blockwise(g) && pass != MOERT_GEMM_WGRAD
                                  ? " (the weight's 128x128 blocks tried as A and as B)"
                                  : "",
                              g->cfg.hybrid ? " (try \"format\": \"e4m3\")" : "");
        }
    return MOERT_OK;
}

/*
 * WGRAD's row padding: 16 (the FP8 leading dimension), or for the blockwise recipe 128 when cuBLASLt has no
 * VEC128 x VEC128 matmul whose reduction ends inside a 128-block (asked once, with the heuristic, for k = 144).
 */
moert_result fp8_cuda_wgrad_row_align(moert_fp8_cuda *g, const moert_fp8_cuda_gemm *gm, int64_t *align)
{
    *align = MOERT_FP8_CUDA_ROW_ALIGN;
    if (!is_blockwise(g) || kernel_serves(g, MOERT_GEMM_WGRAD, gm->overwrite_grad_weight))
        return MOERT_OK; /* the kernel takes a reduction that ends inside a block */
    if (g->wgrad_align) {
        *align = g->wgrad_align;
        return MOERT_OK;
    }
    expert_mm p;
    matmul_shape(g, MOERT_GEMM_WGRAD, gm->k_in, gm->n_out, gm->act_dtype, gm->grad_weight_dtype, 144, &p);
    int found = 0;
    MOK(matmul_available(g, &p, &found));
    g->wgrad_align = found > 0 ? MOERT_FP8_CUDA_ROW_ALIGN : 128;
    *align = g->wgrad_align;
    return MOERT_OK;
}

/* Issues the experts' matmuls over the lanes: largest first, each to the lane with the fewest rows. */
moert_result fp8_cuda_run_matmuls(moert_fp8_cuda *g, cudaStream_t stream, expert_mm *mms, int64_t count,
                                  const int64_t *counts)
{
    if (count == 0) return MOERT_OK;
    const int lanes = g->streams < count ? g->streams : (int)count;
    if (lanes > 1) MOK(lanes_fork(g, stream, lanes));
    int64_t load[MOERT_FP8_CUDA_MAX_STREAMS] = {0};
    moert_result rc = MOERT_OK;
    for (int64_t i = 0; i < count && rc == MOERT_OK; i++) {
        int lane = 0;
        for (int s = 1; s < lanes; s++)
            if (load[s] < load[lane]) lane = s;
        load[lane] += counts[mms[i].expert];
        void *ws = (char *)g->workspace.p + (size_t)lane * MOERT_FP8_CUDA_STREAM_WORKSPACE_BYTES;
        cudaStream_t s = lane ? g->lane_stream[lane] : stream;
        rc = matmul_expert(g, s, ws, &mms[i]);
        if (rc == MOERT_OK && mms[i].copy_bytes) { /* the real rows of a padded D, on the same lane */
            const cudaError_t err =
                cudaMemcpyAsync(mms[i].copy_to, mms[i].d, mms[i].copy_bytes, cudaMemcpyDeviceToDevice, s);
            if (err != cudaSuccess)
                rc = report(g->host, MOERT_ERR_CUDA, "cudaMemcpyAsync (fp8 expert %lld's output rows) failed: %s",
                            (long long)mms[i].expert, cudaGetErrorString(err));
        }
    }
    if (lanes > 1) {
        moert_result join = lanes_join(g, rc == MOERT_OK ? g->host : NULL, stream, lanes);
        if (rc == MOERT_OK) rc = join;
    }
    return rc;
}

/* Orders the matmuls by rows, largest first (ties: lower expert first); insertion sort, few experts. */
void fp8_cuda_sort_by_rows(expert_mm *mms, int64_t count, const int64_t *counts)
{
    for (int64_t i = 1; i < count; i++) {
        expert_mm x = mms[i];
        int64_t j = i - 1;
        while (j >= 0 && (counts[mms[j].expert] < counts[x.expert] ||
                          (counts[mms[j].expert] == counts[x.expert] && mms[j].expert > x.expert))) {
            mms[j + 1] = mms[j];
            j--;
        }
        mms[j + 1] = x;
    }
}
