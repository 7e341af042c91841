/*
 * Grouped expert GEMMs on CUDA through cuBLASLt (one matmul per non-empty expert) or cuBLAS's
 * cublasGemmGroupedBatchedEx (one call for all experts). cuBLASLt 13.1 has no grouped batch mode in its
 * headers (only strided and pointer-array batches of one shape), so the grouped variant goes through cuBLAS.
 *
 * Row-major to column-major: a row-major X[r, c] is a column-major X^T[c, r] with ld = c, so the row-major
 * C = A @ B is computed as the column-major C^T = B^T @ A^T, i.e. cuBLAS's "A" is our right operand.
 *   FORWARD  out[R,N]  = in[R,K] @ W[K,N]      -> m=N, n=R, k=K: A=W   [N,K] ld N op N, B=in   [K,R] ld K op N
 *   DGRAD    din[R,K]  = dout[R,N] @ W[K,N]^T  -> m=K, n=R, k=N: A=W   [N,K] ld N op T, B=dout [N,R] ld N op N
 *   WGRAD    dW[K,N]  += in[R,K]^T @ dout[R,N] -> m=N, n=K, k=R: A=dout[N,R] ld N op N, B=in   [K,R] ld K op T
 * (shapes here are the column-major [rows, cols] of the stored buffers).
 */
#include "precision_bf16_cuda.h"

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PLAN_CACHE_SLOTS 4096     /* cache of heuristic results, by shape and alignment */
#define PLAN_CACHE_PROBES 8
#define GROUPED_CHUNK 256         /* experts per cublasGemmGroupedBatchedEx call (pointer kernel's by-value list) */

/* Formats a message and hands it to the host (plugins never print). Returns code. */
static moert_result report(const moert_host *host, moert_result code, const char *fmt, ...)
{
    char text[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    if (host && host->set_error) host->set_error(host, "%s", text);
    return code;
}

/* Checked CUDA runtime call: on failure reports the call, the CUDA message and the line, and returns. */
#define CUDA_CHECK(host, call)                                                                               \
    do {                                                                                                     \
        cudaError_t err_ = (call);                                                                           \
        if (err_ != cudaSuccess)                                                                             \
            return report((host), MOERT_ERR_CUDA, "%s failed: %s (%s:%d)", #call, cudaGetErrorString(err_),  \
                          __FILE__, __LINE__);                                                               \
    } while (0)

/* Checked cuBLASLt / cuBLAS call. */
#define CUBLAS_CHECK(host, call)                                                                             \
    do {                                                                                                     \
        cublasStatus_t st_ = (call);                                                                         \
        if (st_ != CUBLAS_STATUS_SUCCESS)                                                                    \
            return report((host), MOERT_ERR_CUDA, "%s failed: %s (%s:%d)", #call, cublasLtGetStatusString(st_), \
                          __FILE__, __LINE__);                                                               \
    } while (0)

/* What a cached heuristic answer is valid for. */
typedef struct plan_key {
    int32_t pass, dtype, accumulate, output_fp32;
    int32_t align_a, align_b, align_c;
    int64_t m, n, k;
} plan_key;

typedef struct plan_entry {
    int valid;
    plan_key key;
    cublasLtMatmulAlgo_t algo;
} plan_entry;

struct moert_bf16_cuda {
    const moert_host *host;
    moert_bf16_cuda_mode mode;
    cublasLtHandle_t lt;
    cublasHandle_t blas; /* created on first use of the grouped mode */
    void *workspace;
    size_t workspace_bytes;
    int owns_workspace;
    cublasLtMatmulDesc_t desc[3];            /* per pass: transposes set once */
    cublasLtMatrixLayout_t layout[2][3];     /* [fp32, bf16][A, B, C]: dims set per expert */
    cublasLtMatmulPreference_t pref;
    plan_entry *cache;
    int64_t heuristic_queries, cache_hits;
    void **grouped_ptrs;                     /* device [3 * GROUPED_CHUNK]: A, B, C pointer arrays */
    int64_t *host_counts;                    /* for moert_bf16_cuda_run without host counts */
    int64_t host_counts_len;
};

static const char *pass_name(moert_gemm_pass p)
{
    switch (p) {
    case MOERT_GEMM_FORWARD: return "FORWARD";
    case MOERT_GEMM_DGRAD: return "DGRAD";
    case MOERT_GEMM_WGRAD: return "WGRAD";
    default: return "unknown pass";
    }
}

/* Largest power of two (<= 256) that divides the address: what cuBLASLt may assume about a pointer. */
static int32_t pointer_alignment(const void *p)
{
    uintptr_t a = (uintptr_t)p;
    int32_t align = 256;
    while (align > 1 && (a % (uintptr_t)align) != 0) align /= 2;
    return align;
}

static uint64_t plan_hash(const plan_key *k)
{
    uint64_t h = 1469598103934665603ull;
    const unsigned char *b = (const unsigned char *)k;
    for (size_t i = 0; i < sizeof *k; i++) h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

/* Creates the handle: cuBLASLt handle, descriptors, layouts, preference, plan cache, workspace. */
extern "C" moert_result moert_bf16_cuda_create(const moert_host *host, void *workspace, size_t workspace_bytes,
                                               moert_bf16_cuda_mode mode, moert_bf16_cuda **out)
{
    *out = NULL;
    if (workspace && workspace_bytes < MOERT_BF16_CUDA_WORKSPACE_BYTES)
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "bf16 cuda: workspace of %zu bytes is below the %zu needed",
                      workspace_bytes, MOERT_BF16_CUDA_WORKSPACE_BYTES);
    moert_bf16_cuda *g = (moert_bf16_cuda *)calloc(1, sizeof *g);
    if (!g) return report(host, MOERT_ERR_OUT_OF_MEMORY, "bf16 cuda: out of host memory for the handle");
    g->host = host;
    g->mode = mode;
    g->cache = (plan_entry *)calloc(PLAN_CACHE_SLOTS, sizeof *g->cache);
    moert_result rc = MOERT_OK;
    if (!g->cache) {
        rc = report(host, MOERT_ERR_OUT_OF_MEMORY, "bf16 cuda: out of host memory for the plan cache");
        goto fail;
    }
    if (workspace) {
        g->workspace = workspace;
        g->workspace_bytes = workspace_bytes;
    } else {
        cudaError_t e = cudaMalloc(&g->workspace, MOERT_BF16_CUDA_WORKSPACE_BYTES);
        if (e != cudaSuccess) {
            g->workspace = NULL;
            rc = report(host, MOERT_ERR_OUT_OF_MEMORY, "cudaMalloc(workspace, %zu) failed: %s",
                        MOERT_BF16_CUDA_WORKSPACE_BYTES, cudaGetErrorString(e));
            goto fail;
        }
        g->workspace_bytes = MOERT_BF16_CUDA_WORKSPACE_BYTES;
        g->owns_workspace = 1;
    }
    rc = [&]() -> moert_result {
        CUBLAS_CHECK(host, cublasLtCreate(&g->lt));
        for (int p = 0; p < 3; p++) {
            CUBLAS_CHECK(host, cublasLtMatmulDescCreate(&g->desc[p], CUBLAS_COMPUTE_32F, CUDA_R_32F));
            cublasOperation_t ta = (p == MOERT_GEMM_DGRAD) ? CUBLAS_OP_T : CUBLAS_OP_N;
            cublasOperation_t tb = (p == MOERT_GEMM_WGRAD) ? CUBLAS_OP_T : CUBLAS_OP_N;
            CUBLAS_CHECK(host, cublasLtMatmulDescSetAttribute(g->desc[p], CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
            CUBLAS_CHECK(host, cublasLtMatmulDescSetAttribute(g->desc[p], CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
        }
        for (int d = 0; d < 2; d++)
            for (int i = 0; i < 3; i++)
                CUBLAS_CHECK(host, cublasLtMatrixLayoutCreate(&g->layout[d][i], d ? CUDA_R_16BF : CUDA_R_32F, 1, 1, 1));
        CUBLAS_CHECK(host, cublasLtMatmulPreferenceCreate(&g->pref));
        uint64_t ws = g->workspace_bytes;
        CUBLAS_CHECK(host, cublasLtMatmulPreferenceSetAttribute(g->pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                                &ws, sizeof ws));
        return MOERT_OK;
    }();
    if (rc != MOERT_OK) goto fail;
    *out = g;
    return MOERT_OK;
fail:
    moert_bf16_cuda_destroy(g);
    return rc;
}

/* Releases everything the handle created (not a caller's workspace). Waits for nothing. */
extern "C" void moert_bf16_cuda_destroy(moert_bf16_cuda *g)
{
    if (!g) return;
    if (g->pref) cublasLtMatmulPreferenceDestroy(g->pref);
    for (int d = 0; d < 2; d++)
        for (int i = 0; i < 3; i++)
            if (g->layout[d][i]) cublasLtMatrixLayoutDestroy(g->layout[d][i]);
    for (int p = 0; p < 3; p++)
        if (g->desc[p]) cublasLtMatmulDescDestroy(g->desc[p]);
    if (g->lt) cublasLtDestroy(g->lt);
    if (g->blas) cublasDestroy(g->blas);
    if (g->grouped_ptrs) cudaFree(g->grouped_ptrs);
    if (g->owns_workspace && g->workspace) cudaFree(g->workspace);
    free(g->host_counts);
    free(g->cache);
    free(g);
}

/* Chooses between the per-expert loop and the grouped call for later GEMMs. */
extern "C" moert_result moert_bf16_cuda_set_mode(moert_bf16_cuda *g, moert_bf16_cuda_mode mode)
{
    if (mode != MOERT_BF16_CUDA_EXPERT_LOOP && mode != MOERT_BF16_CUDA_GROUPED)
        return report(g->host, MOERT_ERR_INVALID_ARGUMENT, "bf16 cuda: unknown GEMM mode %d", (int)mode);
    g->mode = mode;
    return MOERT_OK;
}

extern "C" void moert_bf16_cuda_plan_stats(const moert_bf16_cuda *g, int64_t *heuristic_queries, int64_t *cache_hits)
{
    if (heuristic_queries) *heuristic_queries = g->heuristic_queries;
    if (cache_hits) *cache_hits = g->cache_hits;
}

/* Whether the result is fp32 while the operands are bf16. */
static int mixed_output(const moert_bf16_cuda_gemm *gm) { return gm->dtype == MOERT_BF16 && gm->output_fp32; }

/* Bytes per element of the result (output, grad_input or grad_weight). */
static size_t output_elem_size(const moert_bf16_cuda_gemm *gm)
{
    return mixed_output(gm) ? sizeof(float) : moert_dtype_size(gm->dtype);
}

/* Column-major description of one expert's GEMM (see the table at the top). */
typedef struct expert_problem {
    int64_t m, n, k;
    int64_t a_rows, a_cols, lda, b_rows, b_cols, ldb, c_rows, c_cols, ldc;
    const void *a, *b;
    void *c;
} expert_problem;

/* Fills the column-major problem of expert e whose rows start at row_offset. */
static void expert_problem_make(const moert_bf16_cuda_gemm *gm, int64_t e, int64_t row_offset, int64_t rows,
                                expert_problem *p)
{
    const size_t es = moert_dtype_size(gm->dtype);
    const size_t ces = output_elem_size(gm); /* the result's element size */
    const int64_t K = gm->k_in, N = gm->n_out;
    const char *w = (const char *)gm->weight + (size_t)e * (size_t)K * (size_t)N * es;
    switch (gm->pass) {
    case MOERT_GEMM_FORWARD:
        p->m = N; p->n = rows; p->k = K;
        p->a = w; p->a_rows = N; p->a_cols = K; p->lda = N;
        p->b = (const char *)gm->input + (size_t)row_offset * K * es; p->b_rows = K; p->b_cols = rows; p->ldb = K;
        p->c = (char *)gm->output + (size_t)row_offset * N * ces; p->c_rows = N; p->c_cols = rows; p->ldc = N;
        break;
    case MOERT_GEMM_DGRAD:
        p->m = K; p->n = rows; p->k = N;
        p->a = w; p->a_rows = N; p->a_cols = K; p->lda = N;
        p->b = (const char *)gm->grad_output + (size_t)row_offset * N * es; p->b_rows = N; p->b_cols = rows; p->ldb = N;
        p->c = (char *)gm->grad_input + (size_t)row_offset * K * ces; p->c_rows = K; p->c_cols = rows; p->ldc = K;
        break;
    default: /* WGRAD */
        p->m = N; p->n = K; p->k = rows;
        p->a = (const char *)gm->grad_output + (size_t)row_offset * N * es; p->a_rows = N; p->a_cols = rows; p->lda = N;
        p->b = (const char *)gm->input + (size_t)row_offset * K * es; p->b_rows = K; p->b_cols = rows; p->ldb = K;
        p->c = (char *)gm->grad_weight + (size_t)e * K * N * ces; p->c_rows = N; p->c_cols = K; p->ldc = N;
        break;
    }
}

/* Sets one layout's rows, columns and leading dimension. */
static moert_result layout_set(const moert_host *host, cublasLtMatrixLayout_t l, int64_t rows, int64_t cols, int64_t ld)
{
    uint64_t r = (uint64_t)rows, c = (uint64_t)cols;
    CUBLAS_CHECK(host, cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_ROWS, &r, sizeof r));
    CUBLAS_CHECK(host, cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_COLS, &c, sizeof c));
    CUBLAS_CHECK(host, cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_LD, &ld, sizeof ld));
    return MOERT_OK;
}

/* One expert's matmul through cuBLASLt, with the heuristic answer cached per shape and alignment. */
static moert_result lt_matmul_expert(moert_bf16_cuda *g, cudaStream_t stream, const moert_bf16_cuda_gemm *gm,
                                     int64_t e, const expert_problem *p)
{
    const moert_host *host = g->host;
    const int d = gm->dtype == MOERT_BF16 ? 1 : 0;
    const int out_fp32 = mixed_output(gm);
    cublasLtMatrixLayout_t la = g->layout[d][0], lb = g->layout[d][1], lc = g->layout[out_fp32 ? 0 : d][2];
    moert_result rc;
    if ((rc = layout_set(host, la, p->a_rows, p->a_cols, p->lda)) != MOERT_OK) return rc;
    if ((rc = layout_set(host, lb, p->b_rows, p->b_cols, p->ldb)) != MOERT_OK) return rc;
    if ((rc = layout_set(host, lc, p->c_rows, p->c_cols, p->ldc)) != MOERT_OK) return rc;

    const int accumulate = gm->pass == MOERT_GEMM_WGRAD && gm->accumulate;
    plan_key key;
    memset(&key, 0, sizeof key); /* the hash reads padding bytes too */
    key.pass = gm->pass;
    key.dtype = gm->dtype;
    key.accumulate = accumulate;
    key.output_fp32 = out_fp32;
    key.align_a = pointer_alignment(p->a);
    key.align_b = pointer_alignment(p->b);
    key.align_c = pointer_alignment(p->c);
    key.m = p->m;
    key.n = p->n;
    key.k = p->k;
    /* open addressing: look PLAN_CACHE_PROBES slots on; a miss fills the first free one (or the home slot) */
    const uint64_t home = plan_hash(&key) % PLAN_CACHE_SLOTS;
    plan_entry *slot = NULL, *free_slot = NULL;
    for (int probe = 0; probe < PLAN_CACHE_PROBES && !slot; probe++) {
        plan_entry *s = &g->cache[(home + (uint64_t)probe) % PLAN_CACHE_SLOTS];
        if (s->valid && memcmp(&s->key, &key, sizeof key) == 0) slot = s;
        else if (!s->valid && !free_slot) free_slot = s;
    }
    if (slot) {
        g->cache_hits++;
    } else {
        slot = free_slot ? free_slot : &g->cache[home];
        uint32_t aa = (uint32_t)key.align_a, ab = (uint32_t)key.align_b, ac = (uint32_t)key.align_c;
        CUBLAS_CHECK(host, cublasLtMatmulPreferenceSetAttribute(g->pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &aa, sizeof aa));
        CUBLAS_CHECK(host, cublasLtMatmulPreferenceSetAttribute(g->pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ab, sizeof ab));
        CUBLAS_CHECK(host, cublasLtMatmulPreferenceSetAttribute(g->pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &ac, sizeof ac));
        CUBLAS_CHECK(host, cublasLtMatmulPreferenceSetAttribute(g->pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &ac, sizeof ac));
        cublasLtMatmulHeuristicResult_t result;
        int found = 0;
        g->heuristic_queries++;
        CUBLAS_CHECK(host, cublasLtMatmulAlgoGetHeuristic(g->lt, g->desc[gm->pass], la, lb, lc, lc, g->pref, 1, &result, &found));
        if (found < 1)
            return report(host, MOERT_ERR_UNSUPPORTED,
                          "bf16 cuda: cuBLASLt has no algorithm for %s %s%s expert %lld (m=%lld n=%lld k=%lld)",
                          pass_name(gm->pass), moert_dtype_name(gm->dtype), out_fp32 ? " (fp32 result)" : "",
                          (long long)e, (long long)p->m,
                          (long long)p->n, (long long)p->k);
        slot->valid = 1;
        slot->key = key;
        slot->algo = result.algo;
    }
    const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    CUBLAS_CHECK(host, cublasLtMatmul(g->lt, g->desc[gm->pass], &alpha, p->a, la, p->b, lb, &beta, p->c, lc, p->c, lc,
                                      &slot->algo, g->workspace, g->workspace_bytes, stream));
    return MOERT_OK;
}

/* The A, B, C pointers of up to GROUPED_CHUNK experts, passed by value to a one-block kernel. */
typedef struct grouped_pointer_list {
    const char *a_base, *b_base;
    char *c_base;
    int64_t a_expert_stride, a_row_stride; /* bytes per expert, bytes per row */
    int64_t b_expert_stride, b_row_stride;
    int64_t c_expert_stride, c_row_stride;
    int32_t count;
    int32_t expert[GROUPED_CHUNK];
    int64_t row_offset[GROUPED_CHUNK];
} grouped_pointer_list;

/* Writes the device pointer arrays cublasGemmGroupedBatchedEx reads (no host-to-device copy needed). */
__global__ void grouped_pointers_kernel(const grouped_pointer_list list, void **out)
{
    for (int i = threadIdx.x; i < list.count; i += blockDim.x) {
        int64_t e = list.expert[i], r = list.row_offset[i];
        out[i] = (void *)(list.a_base + e * list.a_expert_stride + r * list.a_row_stride);
        out[GROUPED_CHUNK + i] = (void *)(list.b_base + e * list.b_expert_stride + r * list.b_row_stride);
        out[2 * GROUPED_CHUNK + i] = (void *)(list.c_base + e * list.c_expert_stride + r * list.c_row_stride);
    }
}

/* The non-empty experts through cublasGemmGroupedBatchedEx_64, GROUPED_CHUNK at a time. */
static moert_result grouped_gemm_cublas(moert_bf16_cuda *g, cudaStream_t stream, const moert_bf16_cuda_gemm *gm,
                                        const int64_t *row_offsets)
{
    const moert_host *host = g->host;
    if (!g->blas) {
        CUBLAS_CHECK(host, cublasCreate(&g->blas));
        CUBLAS_CHECK(host, cublasSetMathMode(g->blas, CUBLAS_DEFAULT_MATH)); /* no TF32 for fp32 */
    }
    if (!g->grouped_ptrs) CUDA_CHECK(host, cudaMalloc((void **)&g->grouped_ptrs, 3 * GROUPED_CHUNK * sizeof(void *)));
    CUBLAS_CHECK(host, cublasSetStream(g->blas, stream));
    CUBLAS_CHECK(host, cublasSetWorkspace(g->blas, g->workspace, g->workspace_bytes));

    const int64_t es = (int64_t)moert_dtype_size(gm->dtype);
    const int64_t K = gm->k_in, N = gm->n_out, KN = K * N * es;
    grouped_pointer_list list;
    memset(&list, 0, sizeof list);
    cublasOperation_t ta = (gm->pass == MOERT_GEMM_DGRAD) ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasOperation_t tb = (gm->pass == MOERT_GEMM_WGRAD) ? CUBLAS_OP_T : CUBLAS_OP_N;
    switch (gm->pass) {
    case MOERT_GEMM_FORWARD:
        list.a_base = (const char *)gm->weight; list.a_expert_stride = KN;
        list.b_base = (const char *)gm->input; list.b_row_stride = K * es;
        list.c_base = (char *)gm->output; list.c_row_stride = N * es;
        break;
    case MOERT_GEMM_DGRAD:
        list.a_base = (const char *)gm->weight; list.a_expert_stride = KN;
        list.b_base = (const char *)gm->grad_output; list.b_row_stride = N * es;
        list.c_base = (char *)gm->grad_input; list.c_row_stride = K * es;
        break;
    default:
        list.a_base = (const char *)gm->grad_output; list.a_row_stride = N * es;
        list.b_base = (const char *)gm->input; list.b_row_stride = K * es;
        list.c_base = (char *)gm->grad_weight; list.c_expert_stride = KN;
        break;
    }
    cublasOperation_t tas[GROUPED_CHUNK], tbs[GROUPED_CHUNK];
    int64_t ms[GROUPED_CHUNK], ns[GROUPED_CHUNK], ks[GROUPED_CHUNK], ldas[GROUPED_CHUNK], ldbs[GROUPED_CHUNK],
        ldcs[GROUPED_CHUNK], sizes[GROUPED_CHUNK];
    float alphas[GROUPED_CHUNK], betas[GROUPED_CHUNK];
    const float beta = (gm->pass == MOERT_GEMM_WGRAD && gm->accumulate) ? 1.0f : 0.0f;
    const cudaDataType_t t = gm->dtype == MOERT_BF16 ? CUDA_R_16BF : CUDA_R_32F;

    int64_t e = 0;
    while (e < gm->num_experts) {
        list.count = 0;
        for (; e < gm->num_experts && list.count < GROUPED_CHUNK; e++) {
            int64_t rows = gm->rows_per_expert[e];
            if (rows == 0) continue;
            expert_problem p;
            expert_problem_make(gm, e, row_offsets[e], rows, &p);
            int i = list.count++;
            list.expert[i] = (int32_t)e;
            list.row_offset[i] = row_offsets[e];
            tas[i] = ta; tbs[i] = tb;
            ms[i] = p.m; ns[i] = p.n; ks[i] = p.k;
            ldas[i] = p.lda; ldbs[i] = p.ldb; ldcs[i] = p.ldc;
            sizes[i] = 1;
            alphas[i] = 1.0f; betas[i] = beta;
        }
        if (list.count == 0) break;
        grouped_pointers_kernel<<<1, 256, 0, stream>>>(list, g->grouped_ptrs);
        CUDA_CHECK(host, cudaGetLastError());
        void **ptrs = g->grouped_ptrs;
        CUBLAS_CHECK(host, cublasGemmGroupedBatchedEx_64(g->blas, tas, tbs, ms, ns, ks, alphas,
                                                         (const void *const *)ptrs, t, ldas,
                                                         (const void *const *)(ptrs + GROUPED_CHUNK), t, ldbs, betas,
                                                         ptrs + 2 * GROUPED_CHUNK, t, ldcs, list.count, sizes,
                                                         CUBLAS_COMPUTE_32F));
    }
    return MOERT_OK;
}

/* Validates the raw description, then runs the per-expert loop or the grouped call. */
extern "C" moert_result moert_bf16_cuda_grouped_gemm(moert_bf16_cuda *g, cudaStream_t stream,
                                                     const moert_bf16_cuda_gemm *gm)
{
    const moert_host *host = g->host;
    if (gm->dtype != MOERT_BF16 && gm->dtype != MOERT_F32)
        return report(host, MOERT_ERR_UNSUPPORTED, "bf16 cuda: storage dtype %s is not supported (bf16, fp32)",
                      moert_dtype_name(gm->dtype));
    if (gm->pass != MOERT_GEMM_FORWARD && gm->pass != MOERT_GEMM_DGRAD && gm->pass != MOERT_GEMM_WGRAD)
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "bf16 cuda: unknown GEMM pass %d", (int)gm->pass);
    if (gm->num_experts < 0 || gm->k_in <= 0 || gm->n_out <= 0 || (gm->num_experts > 0 && !gm->rows_per_expert))
        return report(host, MOERT_ERR_INVALID_ARGUMENT,
                      "bf16 cuda: bad GEMM sizes (experts %lld, k_in %lld, n_out %lld, rows %s)",
                      (long long)gm->num_experts, (long long)gm->k_in, (long long)gm->n_out,
                      gm->rows_per_expert ? "given" : "NULL");
    const void *need1 = gm->pass == MOERT_GEMM_DGRAD ? gm->grad_output : gm->input;
    const void *need2 = gm->pass == MOERT_GEMM_WGRAD ? gm->grad_output : gm->weight;
    const void *dst = gm->pass == MOERT_GEMM_FORWARD ? gm->output
                      : gm->pass == MOERT_GEMM_DGRAD ? (const void *)gm->grad_input
                                                     : (const void *)gm->grad_weight;
    if (!need1 || !need2 || !dst)
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "bf16 cuda: %s needs its two operands and its output",
                      pass_name(gm->pass));

    /* Row offsets of each expert (host prefix sum), small: E_local entries. */
    int64_t stack_offsets[512];
    int64_t *offsets = gm->num_experts <= 512 ? stack_offsets : (int64_t *)malloc((size_t)gm->num_experts * sizeof(int64_t));
    if (!offsets) return report(host, MOERT_ERR_OUT_OF_MEMORY, "bf16 cuda: out of host memory for row offsets");
    int64_t total = 0;
    moert_result rc = MOERT_OK;
    for (int64_t e = 0; e < gm->num_experts; e++) {
        if (gm->rows_per_expert[e] < 0) {
            rc = report(host, MOERT_ERR_INVALID_ARGUMENT, "bf16 cuda: expert %lld has %lld rows", (long long)e,
                        (long long)gm->rows_per_expert[e]);
            goto exit;
        }
        offsets[e] = total;
        total += gm->rows_per_expert[e];
    }

    /* WGRAD overwriting the gradient of an expert with no rows: the product is zero. */
    if (gm->pass == MOERT_GEMM_WGRAD && !gm->accumulate) {
        const size_t slice = (size_t)gm->k_in * (size_t)gm->n_out * output_elem_size(gm);
        for (int64_t e = 0; e < gm->num_experts; e++) {
            if (gm->rows_per_expert[e] != 0) continue;
            cudaError_t err = cudaMemsetAsync((char *)gm->grad_weight + (size_t)e * slice, 0, slice, stream);
            if (err != cudaSuccess) {
                rc = report(host, MOERT_ERR_CUDA, "cudaMemsetAsync(grad_weight of expert %lld) failed: %s",
                            (long long)e, cudaGetErrorString(err));
                goto exit;
            }
        }
    }

    /* cublasGemmGroupedBatchedEx is not documented for a bf16 x bf16 -> fp32 result: such GEMMs take the loop */
    if (g->mode == MOERT_BF16_CUDA_GROUPED && !mixed_output(gm)) {
        rc = grouped_gemm_cublas(g, stream, gm, offsets);
    } else {
        for (int64_t e = 0; e < gm->num_experts && rc == MOERT_OK; e++) {
            if (gm->rows_per_expert[e] == 0) continue;
            expert_problem p;
            expert_problem_make(gm, e, offsets[e], gm->rows_per_expert[e], &p);
            rc = lt_matmul_expert(g, stream, gm, e, &p);
        }
    }
exit:
    if (offsets != stack_offsets) free(offsets);
    return rc;
}

/* Checks that t is a contiguous CUDA tensor of dtype with ndim dimensions; names it in the message. */
static moert_result check_tensor(const moert_host *host, const moert_tensor *t, const char *name, moert_dtype dtype,
                                 int ndim)
{
    if (!t || !t->data)
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "bf16 cuda: %s is missing", name);
    if (t->device.type != MOERT_DEVICE_CUDA)
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "bf16 cuda: %s is not on a CUDA device (device type %d)",
                      name, (int)t->device.type);
    if (t->dtype != dtype)
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "bf16 cuda: %s is %s, expected %s", name,
                      moert_dtype_name(t->dtype), moert_dtype_name(dtype));
    if (t->ndim != ndim)
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "bf16 cuda: %s has %d dimensions, expected %d", name,
                      (int)t->ndim, ndim);
    if (!moert_tensor_is_contiguous(t))
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "bf16 cuda: %s is not contiguous", name);
    return MOERT_OK;
}

/* The precision ABI's grouped_gemm on CUDA tensors. */
extern "C" moert_result moert_bf16_cuda_run(moert_bf16_cuda *g, cudaStream_t stream, const moert_grouped_gemm_args *args)
{
    const moert_host *host = g->host;
    moert_result rc;
    const moert_tensor *w_like = args->pass == MOERT_GEMM_WGRAD ? args->grad_weight : args->weight;
    const moert_tensor *rows_like = args->pass == MOERT_GEMM_DGRAD ? args->grad_output : args->input;
    if (!w_like || !rows_like || !args->tokens_per_expert)
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "bf16 cuda: %s is missing a weight, activation or counts",
                      pass_name(args->pass));
    const moert_dtype dtype = rows_like->dtype;
    const char *w_name = args->pass == MOERT_GEMM_WGRAD ? "grad_weight" : "weight";
    if ((rc = check_tensor(host, w_like, w_name, dtype, 3)) != MOERT_OK) return rc;
    const int64_t experts = w_like->shape[0], K = w_like->shape[1], N = w_like->shape[2];

    moert_bf16_cuda_gemm gm;
    memset(&gm, 0, sizeof gm);
    gm.pass = args->pass;
    gm.dtype = dtype;
    gm.num_experts = experts;
    gm.k_in = K;
    gm.n_out = N;
    gm.accumulate = 1;
    int64_t rows = -1;
    switch (args->pass) {
    case MOERT_GEMM_FORWARD:
        if ((rc = check_tensor(host, args->input, "input", dtype, 2)) != MOERT_OK) return rc;
        if ((rc = check_tensor(host, args->output, "output", dtype, 2)) != MOERT_OK) return rc;
        if (args->input->shape[1] != K || args->output->shape[1] != N || args->output->shape[0] != args->input->shape[0])
            return report(host, MOERT_ERR_INVALID_ARGUMENT,
                          "bf16 cuda: FORWARD shapes disagree: input [%lld,%lld], weight [%lld,%lld,%lld], output [%lld,%lld]",
                          (long long)args->input->shape[0], (long long)args->input->shape[1], (long long)experts,
                          (long long)K, (long long)N, (long long)args->output->shape[0], (long long)args->output->shape[1]);
        rows = args->input->shape[0];
        gm.input = args->input->data; gm.weight = args->weight->data; gm.output = args->output->data;
        break;
    case MOERT_GEMM_DGRAD:
        if ((rc = check_tensor(host, args->grad_output, "grad_output", dtype, 2)) != MOERT_OK) return rc;
        if ((rc = check_tensor(host, args->grad_input, "grad_input", dtype, 2)) != MOERT_OK) return rc;
        if (args->grad_output->shape[1] != N || args->grad_input->shape[1] != K ||
            args->grad_input->shape[0] != args->grad_output->shape[0])
            return report(host, MOERT_ERR_INVALID_ARGUMENT,
                          "bf16 cuda: DGRAD shapes disagree: grad_output [%lld,%lld], weight [%lld,%lld,%lld], grad_input [%lld,%lld]",
                          (long long)args->grad_output->shape[0], (long long)args->grad_output->shape[1],
                          (long long)experts, (long long)K, (long long)N, (long long)args->grad_input->shape[0],
                          (long long)args->grad_input->shape[1]);
        rows = args->grad_output->shape[0];
        gm.grad_output = args->grad_output->data; gm.weight = args->weight->data; gm.grad_input = args->grad_input->data;
        break;
    case MOERT_GEMM_WGRAD:
        if ((rc = check_tensor(host, args->input, "input", dtype, 2)) != MOERT_OK) return rc;
        if ((rc = check_tensor(host, args->grad_output, "grad_output", dtype, 2)) != MOERT_OK) return rc;
        if (args->input->shape[1] != K || args->grad_output->shape[1] != N ||
            args->input->shape[0] != args->grad_output->shape[0])
            return report(host, MOERT_ERR_INVALID_ARGUMENT,
                          "bf16 cuda: WGRAD shapes disagree: input [%lld,%lld], grad_output [%lld,%lld], grad_weight [%lld,%lld,%lld]",
                          (long long)args->input->shape[0], (long long)args->input->shape[1],
                          (long long)args->grad_output->shape[0], (long long)args->grad_output->shape[1],
                          (long long)experts, (long long)K, (long long)N);
        rows = args->input->shape[0];
        gm.input = args->input->data; gm.grad_output = args->grad_output->data; gm.grad_weight = args->grad_weight->data;
        break;
    default:
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "bf16 cuda: unknown GEMM pass %d", (int)args->pass);
    }
    if (args->pass != MOERT_GEMM_WGRAD && (rc = check_tensor(host, args->weight, "weight", dtype, 3)) != MOERT_OK)
        return rc;
    const moert_tensor *tpe = args->tokens_per_expert;
    if (tpe->dtype != MOERT_I64 || moert_tensor_numel(tpe) != experts)
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "bf16 cuda: tokens_per_expert must be int64 [%lld], got %s [%lld]",
                      (long long)experts, moert_dtype_name(tpe->dtype), (long long)moert_tensor_numel(tpe));

    const int64_t *counts = args->tokens_per_expert_host;
    if (!counts) { /* no host copy: fetch one (a host sync, documented in the header) */
        if (g->host_counts_len < experts) {
            int64_t *grown = (int64_t *)realloc(g->host_counts, (size_t)experts * sizeof(int64_t));
            if (!grown) return report(host, MOERT_ERR_OUT_OF_MEMORY, "bf16 cuda: out of host memory for counts");
            g->host_counts = grown;
            g->host_counts_len = experts;
        }
        if (tpe->device.type == MOERT_DEVICE_CUDA) {
            CUDA_CHECK(host, cudaMemcpyAsync(g->host_counts, tpe->data, (size_t)experts * sizeof(int64_t),
                                             cudaMemcpyDeviceToHost, stream));
            CUDA_CHECK(host, cudaStreamSynchronize(stream));
        } else {
            memcpy(g->host_counts, tpe->data, (size_t)experts * sizeof(int64_t));
        }
        counts = g->host_counts;
    }
    int64_t total = 0;
    for (int64_t e = 0; e < experts; e++) total += counts[e];
    if (total > rows)
        return report(host, MOERT_ERR_INVALID_ARGUMENT,
                      "bf16 cuda: tokens_per_expert sums to %lld rows but the activations have %lld",
                      (long long)total, (long long)rows);
    gm.rows_per_expert = counts;
    return moert_bf16_cuda_grouped_gemm(g, stream, &gm);
}

/* ---- fp32 -> bf16 conversion (e.g. the bf16 copy of fp32 weights) ---- */

#define CONVERT_THREADS 256
#define CONVERT_MAX_BLOCKS 4096

/* Four elements per thread and step: one 16-byte load, one 8-byte store. */
__global__ void round_to_bf16_vec4_kernel(int64_t quads, const float4 *__restrict__ src,
                                          __nv_bfloat162 *__restrict__ dst)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < quads; i += (int64_t)gridDim.x * blockDim.x) {
        const float4 v = src[i];
        dst[2 * i] = __floats2bfloat162_rn(v.x, v.y);
        dst[2 * i + 1] = __floats2bfloat162_rn(v.z, v.w);
    }
}

/* One element per thread and step, any alignment. */
__global__ void round_to_bf16_kernel(int64_t n, const float *__restrict__ src, __nv_bfloat16 *__restrict__ dst)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        dst[i] = __float2bfloat16_rn(src[i]);
}

/* fp32 -> bf16, round to nearest even. */
extern "C" moert_result moert_bf16_cuda_round_to_bf16(const moert_host *host, cudaStream_t stream, int64_t n,
                                                      const float *src, void *dst)
{
    if (n < 0) return report(host, MOERT_ERR_INVALID_ARGUMENT, "bf16 cuda: round_to_bf16 of %lld elements", (long long)n);
    if (n == 0) return MOERT_OK;
    if (!src || !dst) return report(host, MOERT_ERR_INVALID_ARGUMENT, "bf16 cuda: round_to_bf16 needs src and dst");
    const bool vec = n % 4 == 0 && (uintptr_t)src % 16 == 0 && (uintptr_t)dst % 8 == 0;
    const int64_t work = vec ? n / 4 : n;
    int64_t blocks = (work + CONVERT_THREADS - 1) / CONVERT_THREADS;
    if (blocks > CONVERT_MAX_BLOCKS) blocks = CONVERT_MAX_BLOCKS;
    if (vec)
        round_to_bf16_vec4_kernel<<<(int)blocks, CONVERT_THREADS, 0, stream>>>(work, (const float4 *)src,
                                                                              (__nv_bfloat162 *)dst);
    else
        round_to_bf16_kernel<<<(int)blocks, CONVERT_THREADS, 0, stream>>>(n, src, (__nv_bfloat16 *)dst);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess)
        return report(host, MOERT_ERR_CUDA, "launch of %s failed: %s (%s:%d)",
                      vec ? "round_to_bf16_vec4_kernel" : "round_to_bf16_kernel", cudaGetErrorString(err), __FILE__,
                      __LINE__);
    return MOERT_OK;
}
