/* SPDX-License-Identifier: Apache-2.0 */
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
 *
 * The per-expert loop, steady state (host work per expert, the loop is host-bound for small experts):
 * - Plans: the heuristic's algorithm is cached per (pass, dtypes, pointer alignments, the two fixed sizes, the row
 *   bucket of the expert's row count), chosen once for the bucket's upper end (moert_bf16_cuda_row_bucket) and used
 *   for every row count in it. cuBLASLt checks the algorithm again on every cublasLtMatmul (on the host, before
 *   anything is enqueued); if it refuses one for the actual shape, an exact-shape plan is queried, cached and used
 *   (an exact fallback, counted). So counts that change every step make no heuristic query once their buckets
 *   were seen, and the algorithm of a GEMM depends only on its key, not on the stream it runs on.
 * - Layouts: one layout object per (dtype, operand); only the attributes that differ from what it holds are
 *   written (per expert, the column count of the two row-sized operands, and only when the row count changes).
 * - No allocation, no lock: the scratch arrays live in the handle and grow only with the expert count.
 * - Streams: with S > 1 streams the caller's stream is forked with an event into S - 1 internal streams, the
 *   experts are issued largest first, each to the stream with the fewest rows so far, each stream with its own
 *   workspace slice, and the internal streams are joined back with events.
 * - Graphs (optional): a call whose counts were seen before is captured once into a CUDA graph and replayed.
 */
#include "precision_bf16_cuda.h"

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PLAN_CACHE_SLOTS  4096 /* cache of heuristic results, by shape bucket and alignment */
#define PLAN_CACHE_PROBES 8
#define GROUPED_CHUNK     256 /* experts per cublasGemmGroupedBatchedEx call (pointer kernel's by-value list) */
#define GRAPH_CACHE_SLOTS 16  /* kept count vectors (and their executable graphs), least recently used out */

#include "cublaslt_state.h"
#include "plugin_cuda_check.h"

/* What a cached heuristic answer is valid for. The row-sized dimension (n for FORWARD and DGRAD, k for WGRAD)
 * holds the row bucket, or the exact row count in an exact-fallback entry. */
typedef struct plan_key {
    int32_t pass, dtype, accumulate, output_fp32;
    int32_t align_a, align_b, align_c;
    int32_t exact;
    int64_t m, n, k;
} plan_key;

typedef struct plan_entry {
    int valid;
    plan_key key;
    cublasLtMatmulAlgo_t algo;
} plan_entry;

/* One matrix layout object and the sizes last written into it. */
typedef moert_lt_layout layout_state; /* its type is set at creation and never changed (type -1 below) */

/* A count vector seen before, and the executable graph of its call once it came a second time. */
typedef struct graph_entry {
    int valid;
    int32_t pass, dtype, accumulate, output_fp32, mode, streams;
    int64_t num_experts, k_in, n_out;
    int64_t *counts; /* [counts_cap], the first num_experts used */
    int64_t counts_cap;
    const void *ptrs[6];  /* input, weight, grad_output, output, grad_input, grad_weight of the capture */
    cudaGraphExec_t exec; /* NULL: seen once, not captured yet */
    uint64_t last_used;
} graph_entry;

struct moert_bf16_cuda {
    const moert_host *host;
    moert_bf16_cuda_mode mode;
    cublasLtHandle_t lt;
    cublasHandle_t blas; /* created on first use of the grouped mode */
    void *workspace;
    size_t workspace_bytes;
    int owns_workspace;
    int streams;                                           /* lanes of the loop; lane 0 is the caller's stream */
    cudaStream_t lane_stream[MOERT_BF16_CUDA_MAX_STREAMS]; /* [1, streams): internal, created on first need */
    cudaEvent_t join_event[MOERT_BF16_CUDA_MAX_STREAMS];   /* [1, streams): recorded on lane i, waited by lane 0 */
    cudaEvent_t fork_event;                                /* recorded on lane 0, waited by the others */
    cublasLtMatmulDesc_t desc[3];                          /* per pass: transposes set once */
    layout_state layout[2][3];                             /* [fp32, bf16][A, B, C] */
    cublasLtMatmulPreference_t pref;
    int32_t pref_align[3]; /* alignments last written into pref (A, B, C and D); 0: none */
    plan_entry *cache;
    plan_entry *last_plan; /* the previous expert's plan: a repeat key skips the hash */
    moert_bf16_cuda_stats stats;
    int64_t *offsets;    /* [scratch_len] row offset of each expert */
    int32_t *order;      /* [scratch_len] non-empty experts in issue order */
    uint64_t *sort_keys; /* [scratch_len] */
    int64_t scratch_len;
    void **grouped_ptrs;  /* device [3 * GROUPED_CHUNK]: A, B, C pointer arrays */
    int64_t *host_counts; /* for moert_bf16_cuda_run without host counts */
    int64_t host_counts_len;
    int graphs; /* CUDA graph replay on */
    cudaStream_t capture_stream;
    graph_entry graph[GRAPH_CACHE_SLOTS];
    uint64_t graph_clock;
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

/* The row count a plan is chosen for (see the header): few buckets, each a modest range of row counts. */
extern "C" int64_t moert_bf16_cuda_row_bucket(int64_t rows)
{
    if (rows <= 128) return rows <= 32 ? 32 : (rows + 31) / 32 * 32;
    if (rows <= 1024) return (rows + 127) / 128 * 128;
    for (int64_t p = 1024; p <= INT64_MAX / 4; p *= 2) {
        if (rows <= p + p / 2) return p + p / 2;
        if (rows <= 2 * p) return 2 * p;
    }
    return rows;
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
    g->streams = 1;
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
            for (int i = 0; i < 3; i++) {
                layout_state *s = &g->layout[d][i];
                CUBLAS_CHECK(host, cublasLtMatrixLayoutCreate(&s->layout, d ? CUDA_R_16BF : CUDA_R_32F, 1, 1, 1));
                s->rows = s->cols = s->ld = 1;
            }
        CUBLAS_CHECK(host, cublasLtMatmulPreferenceCreate(&g->pref));
        uint64_t ws = MOERT_BF16_CUDA_STREAM_WORKSPACE_BYTES; /* per stream: plans do not depend on the streams */
        CUBLAS_CHECK(host, cublasLtMatmulPreferenceSetAttribute(g->pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                                                sizeof ws));
        return MOERT_OK;
    }();
    if (rc != MOERT_OK) goto fail;
    *out = g;
    return MOERT_OK;
fail:
    moert_bf16_cuda_destroy(g);
    return rc;
}

/* Releases everything the handle created (not a caller's workspace). Waits for nothing: streams, events and
 * graphs still in use by the GPU are released by CUDA when their work completes. */
extern "C" void moert_bf16_cuda_destroy(moert_bf16_cuda *g)
{
    if (!g) return;
    for (int i = 0; i < GRAPH_CACHE_SLOTS; i++) {
        if (g->graph[i].exec) cudaGraphExecDestroy(g->graph[i].exec);
        free(g->graph[i].counts);
    }
    if (g->capture_stream) cudaStreamDestroy(g->capture_stream);
    for (int i = 1; i < MOERT_BF16_CUDA_MAX_STREAMS; i++) {
        if (g->lane_stream[i]) cudaStreamDestroy(g->lane_stream[i]);
        if (g->join_event[i]) cudaEventDestroy(g->join_event[i]);
    }
    if (g->fork_event) cudaEventDestroy(g->fork_event);
    if (g->pref) cublasLtMatmulPreferenceDestroy(g->pref);
    for (int d = 0; d < 2; d++)
        for (int i = 0; i < 3; i++)
            if (g->layout[d][i].layout) cublasLtMatrixLayoutDestroy(g->layout[d][i].layout);
    for (int p = 0; p < 3; p++)
        if (g->desc[p]) cublasLtMatmulDescDestroy(g->desc[p]);
    if (g->lt) cublasLtDestroy(g->lt);
    if (g->blas) cublasDestroy(g->blas);
    if (g->grouped_ptrs) cudaFree(g->grouped_ptrs);
    if (g->owns_workspace && g->workspace) cudaFree(g->workspace);
    free(g->host_counts);
    free(g->offsets);
    free(g->order);
    free(g->sort_keys);
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

/* Sets the SM count every pass's matmul descriptor targets (0: the whole GPU). */
extern "C" moert_result moert_bf16_cuda_set_sm_count(moert_bf16_cuda *g, int sms)
{
    const moert_host *host = g->host;
    if (sms < 0) return report(host, MOERT_ERR_INVALID_ARGUMENT, "bf16 cuda: %d SMs asked for, expected >= 0", sms);
    const int32_t target = sms;
    for (int p = 0; p < 3; p++)
        CUBLAS_CHECK(host, cublasLtMatmulDescSetAttribute(g->desc[p], CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &target,
                                                          sizeof target));
    return MOERT_OK;
}

/* Sets the loop's stream count; creates the missing internal streams and events, grows an owned workspace. */
extern "C" moert_result moert_bf16_cuda_set_streams(moert_bf16_cuda *g, int streams)
{
    const moert_host *host = g->host;
    if (streams < 1 || streams > MOERT_BF16_CUDA_MAX_STREAMS)
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "bf16 cuda: %d streams asked for, expected 1 to %d", streams,
                      MOERT_BF16_CUDA_MAX_STREAMS);
    const size_t need = (size_t)streams * MOERT_BF16_CUDA_STREAM_WORKSPACE_BYTES;
    if (g->workspace_bytes < need) {
        if (!g->owns_workspace)
            return report(
                host, MOERT_ERR_INVALID_ARGUMENT,
                "bf16 cuda: %d streams need a workspace of %zu bytes (%zu per stream), the handle was given %zu",
                streams, need, MOERT_BF16_CUDA_STREAM_WORKSPACE_BYTES, g->workspace_bytes);
        void *grown = NULL;
        cudaError_t e = cudaMalloc(&grown, need);
        if (e != cudaSuccess)
            return report(host, MOERT_ERR_OUT_OF_MEMORY, "cudaMalloc(workspace, %zu) failed: %s", need,
                          cudaGetErrorString(e));
        CUDA_CHECK(host, cudaFree(g->workspace)); /* waits for the device: a setup call, not a per-step one */
        g->workspace = grown;
        g->workspace_bytes = need;
        for (int i = 0; i < GRAPH_CACHE_SLOTS; i++) { /* kept graphs point into the old workspace */
            if (g->graph[i].exec) cudaGraphExecDestroy(g->graph[i].exec);
            g->graph[i].exec = NULL;
            g->graph[i].valid = 0;
        }
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

/* Turns graph replay on or off; the first time on, creates the capture stream. */
extern "C" moert_result moert_bf16_cuda_set_graphs(moert_bf16_cuda *g, int enabled)
{
    if (enabled && !g->capture_stream)
        CUDA_CHECK(g->host, cudaStreamCreateWithFlags(&g->capture_stream, cudaStreamNonBlocking));
    g->graphs = enabled != 0;
    return MOERT_OK;
}

extern "C" void moert_bf16_cuda_get_stats(const moert_bf16_cuda *g, moert_bf16_cuda_stats *out) { *out = g->stats; }

extern "C" void moert_bf16_cuda_plan_stats(const moert_bf16_cuda *g, int64_t *heuristic_queries, int64_t *cache_hits)
{
    if (heuristic_queries) *heuristic_queries = g->stats.heuristic_queries;
    if (cache_hits) *cache_hits = g->stats.cache_hits;
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
        p->m = N;
        p->n = rows;
        p->k = K;
        p->a = w;
        p->a_rows = N;
        p->a_cols = K;
        p->lda = N;
        p->b = (const char *)gm->input + (size_t)row_offset * K * es;
        p->b_rows = K;
        p->b_cols = rows;
        p->ldb = K;
        p->c = (char *)gm->output + (size_t)row_offset * N * ces;
        p->c_rows = N;
        p->c_cols = rows;
        p->ldc = N;
        break;
    case MOERT_GEMM_DGRAD:
        p->m = K;
        p->n = rows;
        p->k = N;
        p->a = w;
        p->a_rows = N;
        p->a_cols = K;
        p->lda = N;
        p->b = (const char *)gm->grad_output + (size_t)row_offset * N * es;
        p->b_rows = N;
        p->b_cols = rows;
        p->ldb = N;
        p->c = (char *)gm->grad_input + (size_t)row_offset * K * ces;
        p->c_rows = K;
        p->c_cols = rows;
        p->ldc = K;
        break;
    default: /* WGRAD */
        p->m = N;
        p->n = K;
        p->k = rows;
        p->a = (const char *)gm->grad_output + (size_t)row_offset * N * es;
        p->a_rows = N;
        p->a_cols = rows;
        p->lda = N;
        p->b = (const char *)gm->input + (size_t)row_offset * K * es;
        p->b_rows = K;
        p->b_cols = rows;
        p->ldb = K;
        p->c = (char *)gm->grad_weight + (size_t)e * K * N * ces;
        p->c_rows = N;
        p->c_cols = K;
        p->ldc = N;
        break;
    }
}

/* Makes a layout describe rows x cols with leading dimension ld, writing only the attributes that differ. */
static moert_result layout_fit(const moert_host *host, layout_state *s, int64_t rows, int64_t cols, int64_t ld)
{
    return moert_lt_layout_fit(host, s, -1, rows, cols, ld);
}

/* The three layouts of one call: A, B and C (= D). */
typedef struct call_layouts {
    layout_state *a, *b, *c;
} call_layouts;

/* Fits the call's layouts to problem p. */
static moert_result layouts_fit(const moert_host *host, const call_layouts *l, const expert_problem *p)
{
    moert_result rc;
    if ((rc = layout_fit(host, l->a, p->a_rows, p->a_cols, p->lda)) != MOERT_OK) return rc;
    if ((rc = layout_fit(host, l->b, p->b_rows, p->b_cols, p->ldb)) != MOERT_OK) return rc;
    return layout_fit(host, l->c, p->c_rows, p->c_cols, p->ldc);
}

/* Writes the minimum pointer alignments into the preference, the ones that changed only. */
static moert_result pref_align_set(moert_bf16_cuda *g, const plan_key *key)
{
    const int32_t want[3] = {key->align_a, key->align_b, key->align_c};
    return moert_lt_pref_align_set(g->host, g->pref, g->pref_align, want);
}

/*
 * The plan of expert e's matmul p (rows rows from row_offset): from the previous expert, the cache, or a heuristic
 * query for the bucket's upper end (exact = 0) or for the exact shape (exact = 1). May leave the layouts fit to the
 * queried shape; the caller fits them to p afterwards.
 */
static moert_result plan_get(moert_bf16_cuda *g, const moert_bf16_cuda_gemm *gm, const call_layouts *l, int64_t e,
                             int64_t row_offset, int64_t rows, const expert_problem *p, int exact, plan_entry **out)
{
    const moert_host *host = g->host;
    const int64_t queried_rows = exact ? rows : moert_bf16_cuda_row_bucket(rows);
    plan_key key;
    memset(&key, 0, sizeof key); /* the hash reads padding bytes too */
    key.pass = gm->pass;
    key.dtype = gm->dtype;
    key.accumulate = gm->pass == MOERT_GEMM_WGRAD && gm->accumulate;
    key.output_fp32 = mixed_output(gm);
    key.align_a = pointer_alignment(p->a);
    key.align_b = pointer_alignment(p->b);
    key.align_c = pointer_alignment(p->c);
    key.exact = exact;
    key.m = p->m;
    key.n = gm->pass == MOERT_GEMM_WGRAD ? p->n : queried_rows;
    key.k = gm->pass == MOERT_GEMM_WGRAD ? queried_rows : p->k;
    if (g->last_plan && g->last_plan->valid && memcmp(&g->last_plan->key, &key, sizeof key) == 0) {
        g->stats.cache_hits++;
        *out = g->last_plan;
        return MOERT_OK;
    }
    /* open addressing: look PLAN_CACHE_PROBES slots on; a miss fills the first free one (or the home slot) */
    const uint64_t home = plan_hash(&key) % PLAN_CACHE_SLOTS;
    plan_entry *slot = NULL, *free_slot = NULL;
    for (int probe = 0; probe < PLAN_CACHE_PROBES && !slot; probe++) {
        plan_entry *s = &g->cache[(home + (uint64_t)probe) % PLAN_CACHE_SLOTS];
        if (s->valid && memcmp(&s->key, &key, sizeof key) == 0)
            slot = s;
        else if (!s->valid && !free_slot)
            free_slot = s;
    }
    if (slot) {
        g->stats.cache_hits++;
        g->last_plan = slot;
        *out = slot;
        return MOERT_OK;
    }
    slot = free_slot ? free_slot : &g->cache[home];
    slot->valid = 0;
    if (g->last_plan == slot) g->last_plan = NULL;
    expert_problem q; /* the queried shape: only its sizes matter, no memory is touched */
    expert_problem_make(gm, e, row_offset, queried_rows, &q);
    moert_result rc;
    if ((rc = layouts_fit(host, l, &q)) != MOERT_OK) return rc;
    if ((rc = pref_align_set(g, &key)) != MOERT_OK) return rc;
    cublasLtMatmulHeuristicResult_t result;
    int found = 0;
    g->stats.heuristic_queries++;
    CUBLAS_CHECK(host, cublasLtMatmulAlgoGetHeuristic(g->lt, g->desc[gm->pass], l->a->layout, l->b->layout,
                                                      l->c->layout, l->c->layout, g->pref, 1, &result, &found));
    if (found < 1)
        return report(host, MOERT_ERR_UNSUPPORTED,
                      "bf16 cuda: cuBLASLt has no algorithm for %s %s%s expert %lld (m=%lld n=%lld k=%lld)",
                      pass_name(gm->pass), moert_dtype_name(gm->dtype), key.output_fp32 ? " (fp32 result)" : "",
                      (long long)e, (long long)q.m, (long long)q.n, (long long)q.k);
    slot->key = key;
    slot->algo = result.algo;
    slot->valid = 1;
    g->last_plan = slot;
    *out = slot;
    return MOERT_OK;
}

/*
 * One expert's matmul through cuBLASLt on stream with a workspace slice, with its bucket's plan; if cuBLASLt
 * refuses that plan for this exact shape, with an exact-shape plan.
 */
static moert_result lt_matmul_expert(moert_bf16_cuda *g, cudaStream_t stream, void *workspace,
                                     const moert_bf16_cuda_gemm *gm, const call_layouts *l, int64_t e,
                                     int64_t row_offset, int64_t rows)
{
    const moert_host *host = g->host;
    expert_problem p;
    expert_problem_make(gm, e, row_offset, rows, &p);
    const float alpha = 1.0f, beta = (gm->pass == MOERT_GEMM_WGRAD && gm->accumulate) ? 1.0f : 0.0f;
    cublasStatus_t st = CUBLAS_STATUS_NOT_SUPPORTED;
    for (int exact = 0; exact < 2; exact++) {
        plan_entry *plan = NULL;
        moert_result rc = plan_get(g, gm, l, e, row_offset, rows, &p, exact, &plan);
        if (rc != MOERT_OK) return rc;
        if ((rc = layouts_fit(host, l, &p)) != MOERT_OK) return rc;
        st = cublasLtMatmul(g->lt, g->desc[gm->pass], &alpha, p.a, l->a->layout, p.b, l->b->layout, &beta, p.c,
                            l->c->layout, p.c, l->c->layout, &plan->algo, workspace,
                            MOERT_BF16_CUDA_STREAM_WORKSPACE_BYTES, stream);
        if (st == CUBLAS_STATUS_SUCCESS) return MOERT_OK;
        if (exact || (st != CUBLAS_STATUS_NOT_SUPPORTED && st != CUBLAS_STATUS_INVALID_VALUE)) break;
        g->stats.exact_fallbacks++; /* the bucket's algorithm does not fit this shape: query this one */
    }
    return report(host, MOERT_ERR_CUDA, "cublasLtMatmul(%s expert %lld, m=%lld n=%lld k=%lld) failed: %s (%s:%d)",
                  pass_name(gm->pass), (long long)e, (long long)p.m, (long long)p.n, (long long)p.k,
                  cublasLtGetStatusString(st), __FILE__, __LINE__);
}

/* Descending order of packed (rows, expert) keys; ties: the lower expert first. */
static int cmp_desc_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x < y) - (x > y);
}

/* Records the fork event on the caller's stream and makes lanes 1 .. lanes-1 wait for it. */
static moert_result lanes_fork(moert_bf16_cuda *g, cudaStream_t stream, int lanes)
{
    CUDA_CHECK(g->host, cudaEventRecord(g->fork_event, stream));
    for (int i = 1; i < lanes; i++) CUDA_CHECK(g->host, cudaStreamWaitEvent(g->lane_stream[i], g->fork_event, 0));
    return MOERT_OK;
}

/* Makes the caller's stream wait for lanes 1 .. lanes-1. host: where an error goes (NULL: keep an earlier one). */
static moert_result lanes_join(moert_bf16_cuda *g, const moert_host *host, cudaStream_t stream, int lanes)
{
    moert_result rc = MOERT_OK;
    for (int i = 1; i < lanes; i++) {
        cudaError_t err = cudaEventRecord(g->join_event[i], g->lane_stream[i]);
        if (err == cudaSuccess) err = cudaStreamWaitEvent(stream, g->join_event[i], 0);
        if (err != cudaSuccess && rc == MOERT_OK)
            rc = report(host, MOERT_ERR_CUDA, "joining internal stream %d back failed: %s (%s:%d)", i,
                        cudaGetErrorString(err), __FILE__, __LINE__);
    }
    return rc;
}

/*
 * The per-expert cuBLASLt loop over the non-empty experts. One stream: in expert order on the caller's stream.
 * More: largest expert first, each to the lane with the fewest rows so far (round robin for equal experts).
 */
static moert_result lt_loop(moert_bf16_cuda *g, cudaStream_t stream, const moert_bf16_cuda_gemm *gm,
                            const int64_t *offsets)
{
    const int d = gm->dtype == MOERT_BF16 ? 1 : 0;
    const call_layouts l = {&g->layout[d][0], &g->layout[d][1], &g->layout[mixed_output(gm) ? 0 : d][2]};
    int32_t active = 0;
    for (int64_t e = 0; e < gm->num_experts; e++)
        if (gm->rows_per_expert[e] > 0) g->order[active++] = (int32_t)e;
    if (active == 0) return MOERT_OK;
    const int lanes = g->streams < active ? g->streams : (int)active;
    if (lanes > 1) {
        for (int32_t i = 0; i < active; i++) {
            const int32_t e = g->order[i];
            g->sort_keys[i] = ((uint64_t)gm->rows_per_expert[e] << 24) | (uint64_t)(0xFFFFFF - e);
        }
        qsort(g->sort_keys, (size_t)active, sizeof *g->sort_keys, cmp_desc_u64);
        for (int32_t i = 0; i < active; i++) g->order[i] = 0xFFFFFF - (int32_t)(g->sort_keys[i] & 0xFFFFFF);
        moert_result rc = lanes_fork(g, stream, lanes);
        if (rc != MOERT_OK) return rc;
    }
    int64_t load[MOERT_BF16_CUDA_MAX_STREAMS] = {0};
    moert_result rc = MOERT_OK;
    for (int32_t i = 0; i < active && rc == MOERT_OK; i++) {
        const int32_t e = g->order[i];
        int lane = 0;
        for (int s = 1; s < lanes; s++)
            if (load[s] < load[lane]) lane = s;
        load[lane] += gm->rows_per_expert[e];
        void *ws = (char *)g->workspace + (size_t)lane * MOERT_BF16_CUDA_STREAM_WORKSPACE_BYTES;
        rc = lt_matmul_expert(g, lane ? g->lane_stream[lane] : stream, ws, gm, &l, e, offsets[e],
                              gm->rows_per_expert[e]);
    }
    if (lanes > 1) {
        moert_result join = lanes_join(g, rc == MOERT_OK ? g->host : NULL, stream, lanes);
        if (rc == MOERT_OK) rc = join;
    }
    return rc;
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
        list.a_base = (const char *)gm->weight;
        list.a_expert_stride = KN;
        list.b_base = (const char *)gm->input;
        list.b_row_stride = K * es;
        list.c_base = (char *)gm->output;
        list.c_row_stride = N * es;
        break;
    case MOERT_GEMM_DGRAD:
        list.a_base = (const char *)gm->weight;
        list.a_expert_stride = KN;
        list.b_base = (const char *)gm->grad_output;
        list.b_row_stride = N * es;
        list.c_base = (char *)gm->grad_input;
        list.c_row_stride = K * es;
        break;
    default:
        list.a_base = (const char *)gm->grad_output;
        list.a_row_stride = N * es;
        list.b_base = (const char *)gm->input;
        list.b_row_stride = K * es;
        list.c_base = (char *)gm->grad_weight;
        list.c_expert_stride = KN;
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
            tas[i] = ta;
            tbs[i] = tb;
            ms[i] = p.m;
            ns[i] = p.n;
            ks[i] = p.k;
            ldas[i] = p.lda;
            ldbs[i] = p.ldb;
            ldcs[i] = p.ldc;
            sizes[i] = 1;
            alphas[i] = 1.0f;
            betas[i] = beta;
        }
        if (list.count == 0) break;
        grouped_pointers_kernel<<<1, 256, 0, stream>>>(list, g->grouped_ptrs);
        CUDA_CHECK(host, cudaGetLastError());
        void **ptrs = g->grouped_ptrs;
        CUBLAS_CHECK(host, cublasGemmGroupedBatchedEx_64(
                               g->blas, tas, tbs, ms, ns, ks, alphas, (const void *const *)ptrs, t, ldas,
                               (const void *const *)(ptrs + GROUPED_CHUNK), t, ldbs, betas, ptrs + 2 * GROUPED_CHUNK, t,
                               ldcs, list.count, sizes, CUBLAS_COMPUTE_32F));
    }
    return MOERT_OK;
}

/* Grows the handle's per-expert scratch arrays to hold experts entries (no allocation in the steady state). */
static moert_result scratch_reserve(moert_bf16_cuda *g, int64_t experts)
{
    if (g->scratch_len >= experts) return MOERT_OK;
    int64_t *offsets = (int64_t *)realloc(g->offsets, (size_t)experts * sizeof *offsets);
    if (offsets) g->offsets = offsets;
    int32_t *order = (int32_t *)realloc(g->order, (size_t)experts * sizeof *order);
    if (order) g->order = order;
    uint64_t *keys = (uint64_t *)realloc(g->sort_keys, (size_t)experts * sizeof *keys);
    if (keys) g->sort_keys = keys;
    if (!offsets || !order || !keys)
        return report(g->host, MOERT_ERR_OUT_OF_MEMORY, "bf16 cuda: out of host memory for %lld experts' offsets",
                      (long long)experts);
    g->scratch_len = experts;
    return MOERT_OK;
}

/* Everything one grouped GEMM enqueues on stream: the zeroed slices of empty experts (WGRAD without
 * accumulate), then the grouped call or the per-expert loop. */
static moert_result enqueue_gemm(moert_bf16_cuda *g, cudaStream_t stream, const moert_bf16_cuda_gemm *gm,
                                 const int64_t *offsets)
{
    const moert_host *host = g->host;
    /* WGRAD overwriting the gradient of an expert with no rows: the product is zero. */
    if (gm->pass == MOERT_GEMM_WGRAD && !gm->accumulate) {
        const size_t slice = (size_t)gm->k_in * (size_t)gm->n_out * output_elem_size(gm);
        for (int64_t e = 0; e < gm->num_experts; e++) {
            if (gm->rows_per_expert[e] != 0) continue;
            cudaError_t err = cudaMemsetAsync((char *)gm->grad_weight + (size_t)e * slice, 0, slice, stream);
            if (err != cudaSuccess)
                return report(host, MOERT_ERR_CUDA, "cudaMemsetAsync(grad_weight of expert %lld) failed: %s",
                              (long long)e, cudaGetErrorString(err));
        }
    }
    /* cublasGemmGroupedBatchedEx is not documented for a bf16 x bf16 -> fp32 result: such GEMMs take the loop */
    if (g->mode == MOERT_BF16_CUDA_GROUPED && !mixed_output(gm)) return grouped_gemm_cublas(g, stream, gm, offsets);
    return lt_loop(g, stream, gm, offsets);
}

/* The six operand pointers of a call, in graph_entry's order. */
static void gemm_pointers(const moert_bf16_cuda_gemm *gm, const void *ptrs[6])
{
    ptrs[0] = gm->input;
    ptrs[1] = gm->weight;
    ptrs[2] = gm->grad_output;
    ptrs[3] = gm->output;
    ptrs[4] = gm->grad_input;
    ptrs[5] = gm->grad_weight;
}

/* Whether a kept entry is for this call's work (all but the pointers). */
static int graph_entry_matches(const moert_bf16_cuda *g, const graph_entry *ge, const moert_bf16_cuda_gemm *gm)
{
    if (!ge->valid || ge->pass != (int32_t)gm->pass || ge->dtype != (int32_t)gm->dtype ||
        ge->accumulate != (gm->pass == MOERT_GEMM_WGRAD && gm->accumulate) || ge->output_fp32 != mixed_output(gm) ||
        ge->mode != (int32_t)g->mode || ge->streams != g->streams || ge->num_experts != gm->num_experts ||
        ge->k_in != gm->k_in || ge->n_out != gm->n_out)
        return 0;
    return gm->num_experts == 0 ||
           memcmp(ge->counts, gm->rows_per_expert, (size_t)gm->num_experts * sizeof(int64_t)) == 0;
}

/* Takes a free entry, or the least recently used one (its graph destroyed), and makes it this call's key. */
static moert_result graph_entry_claim(moert_bf16_cuda *g, const moert_bf16_cuda_gemm *gm, graph_entry **out)
{
    graph_entry *ge = &g->graph[0];
    for (int i = 0; i < GRAPH_CACHE_SLOTS; i++) {
        if (!g->graph[i].valid) {
            ge = &g->graph[i];
            break;
        }
        if (g->graph[i].last_used < ge->last_used) ge = &g->graph[i];
    }
    if (ge->exec) cudaGraphExecDestroy(ge->exec); /* an in-flight launch finishes first */
    ge->exec = NULL;
    ge->valid = 0;
    if (ge->counts_cap < gm->num_experts) {
        int64_t *grown = (int64_t *)realloc(ge->counts, (size_t)gm->num_experts * sizeof(int64_t));
        if (!grown) return report(g->host, MOERT_ERR_OUT_OF_MEMORY, "bf16 cuda: out of host memory for a graph key");
        ge->counts = grown;
        ge->counts_cap = gm->num_experts;
    }
    if (gm->num_experts > 0) memcpy(ge->counts, gm->rows_per_expert, (size_t)gm->num_experts * sizeof(int64_t));
    ge->pass = (int32_t)gm->pass;
    ge->dtype = (int32_t)gm->dtype;
    ge->accumulate = gm->pass == MOERT_GEMM_WGRAD && gm->accumulate;
    ge->output_fp32 = mixed_output(gm);
    ge->mode = (int32_t)g->mode;
    ge->streams = g->streams;
    ge->num_experts = gm->num_experts;
    ge->k_in = gm->k_in;
    ge->n_out = gm->n_out;
    gemm_pointers(gm, ge->ptrs);
    ge->valid = 1;
    *out = ge;
    return MOERT_OK;
}

/* Captures the call's work on the capture stream into *graph. */
static moert_result graph_capture(moert_bf16_cuda *g, const moert_bf16_cuda_gemm *gm, const int64_t *offsets,
                                  cudaGraph_t *graph)
{
    *graph = NULL;
    CUDA_CHECK(g->host, cudaStreamBeginCapture(g->capture_stream, cudaStreamCaptureModeThreadLocal));
    moert_result rc = enqueue_gemm(g, g->capture_stream, gm, offsets);
    cudaError_t err = cudaStreamEndCapture(g->capture_stream, graph); /* always ended, even after an error */
    if (rc != MOERT_OK || err != cudaSuccess) {
        if (*graph) cudaGraphDestroy(*graph);
        *graph = NULL;
        (void)cudaGetLastError();
        if (rc == MOERT_OK)
            rc = report(g->host, MOERT_ERR_CUDA, "cudaStreamEndCapture failed: %s (%s:%d)", cudaGetErrorString(err),
                        __FILE__, __LINE__);
    }
    return rc;
}

/*
 * The call through the graph cache: a count vector seen for the first time is remembered and enqueued directly
 * (which also warms the plan cache); seen again, it is captured and instantiated; with the same pointers as its
 * capture it is replayed; with other pointers it is captured again and the executable updated in place.
 */
static moert_result graph_run(moert_bf16_cuda *g, cudaStream_t stream, const moert_bf16_cuda_gemm *gm,
                              const int64_t *offsets)
{
    const moert_host *host = g->host;
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
        (void)cudaGetLastError();
        return enqueue_gemm(g, stream, gm, offsets);
    }
    if (status != cudaStreamCaptureStatusNone) return enqueue_gemm(g, stream, gm, offsets); /* the caller captures */
    const void *ptrs[6];
    gemm_pointers(gm, ptrs);
    graph_entry *ge = NULL;
    for (int i = 0; i < GRAPH_CACHE_SLOTS && !ge; i++)
        if (graph_entry_matches(g, &g->graph[i], gm)) ge = &g->graph[i];
    const uint64_t now = ++g->graph_clock;
    if (!ge) {
        moert_result rc = graph_entry_claim(g, gm, &ge);
        if (rc != MOERT_OK) return rc;
        ge->last_used = now;
        return enqueue_gemm(g, stream, gm, offsets);
    }
    ge->last_used = now;
    if (ge->exec && memcmp(ge->ptrs, ptrs, sizeof ptrs) == 0) {
        CUDA_CHECK(host, cudaGraphLaunch(ge->exec, stream));
        g->stats.graph_replays++;
        return MOERT_OK;
    }
    cudaGraph_t graph = NULL;
    moert_result rc = graph_capture(g, gm, offsets, &graph);
    if (rc != MOERT_OK) return rc;
    if (ge->exec) {
        cudaGraphExecUpdateResultInfo info;
        if (cudaGraphExecUpdate(ge->exec, graph, &info) == cudaSuccess) {
            g->stats.graph_updates++;
        } else { /* the topology changed (e.g. an exact fallback): a new executable */
            (void)cudaGetLastError();
            cudaGraphExecDestroy(ge->exec);
            ge->exec = NULL;
        }
    }
    if (!ge->exec) {
        cudaError_t err = cudaGraphInstantiate(&ge->exec, graph, 0);
        if (err != cudaSuccess) {
            ge->exec = NULL;
            ge->valid = 0;
            cudaGraphDestroy(graph);
            return report(host, MOERT_ERR_CUDA, "cudaGraphInstantiate failed: %s (%s:%d)", cudaGetErrorString(err),
                          __FILE__, __LINE__);
        }
        g->stats.graph_instantiations++;
    }
    cudaGraphDestroy(graph);
    memcpy(ge->ptrs, ptrs, sizeof ptrs);
    CUDA_CHECK(host, cudaGraphLaunch(ge->exec, stream));
    return MOERT_OK;
}

/* Validates the raw description, then runs the per-expert loop or the grouped call (through a graph when on). */
extern "C" moert_result moert_bf16_cuda_grouped_gemm(moert_bf16_cuda *g, cudaStream_t stream,
                                                     const moert_bf16_cuda_gemm *gm)
{
    const moert_host *host = g->host;
    if (gm->dtype != MOERT_BF16 && gm->dtype != MOERT_F32)
        return report(host, MOERT_ERR_UNSUPPORTED, "bf16 cuda: storage dtype %s is not supported (bf16, fp32)",
                      moert_dtype_name(gm->dtype));
    if (gm->pass != MOERT_GEMM_FORWARD && gm->pass != MOERT_GEMM_DGRAD && gm->pass != MOERT_GEMM_WGRAD)
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "bf16 cuda: unknown GEMM pass %d", (int)gm->pass);
    if (gm->num_experts < 0 || gm->num_experts > 0xFFFFFF || gm->k_in <= 0 || gm->n_out <= 0 ||
        (gm->num_experts > 0 && !gm->rows_per_expert))
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
    moert_result rc = scratch_reserve(g, gm->num_experts);
    if (rc != MOERT_OK) return rc;

    /* Row offsets of each expert (host prefix sum). */
    int64_t total = 0;
    for (int64_t e = 0; e < gm->num_experts; e++) {
        if (gm->rows_per_expert[e] < 0)
            return report(host, MOERT_ERR_INVALID_ARGUMENT, "bf16 cuda: expert %lld has %lld rows", (long long)e,
                          (long long)gm->rows_per_expert[e]);
        g->offsets[e] = total;
        total += gm->rows_per_expert[e];
    }
    if (g->graphs) return graph_run(g, stream, gm, g->offsets);
    return enqueue_gemm(g, stream, gm, g->offsets);
}

/* Checks that t is a contiguous CUDA tensor of dtype with ndim dimensions; names it in the message. */
static moert_result check_tensor(const moert_host *host, const moert_tensor *t, const char *name, moert_dtype dtype,
                                 int ndim)
{
    if (!t || !t->data) return report(host, MOERT_ERR_INVALID_ARGUMENT, "bf16 cuda: %s is missing", name);
    if (t->device.type != MOERT_DEVICE_CUDA)
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "bf16 cuda: %s is not on a CUDA device (device type %d)", name,
                      (int)t->device.type);
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
extern "C" moert_result moert_bf16_cuda_run(moert_bf16_cuda *g, cudaStream_t stream,
                                            const moert_grouped_gemm_args *args)
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
        if (args->input->shape[1] != K || args->output->shape[1] != N ||
            args->output->shape[0] != args->input->shape[0])
            return report(
                host, MOERT_ERR_INVALID_ARGUMENT,
                "bf16 cuda: FORWARD shapes disagree: input [%lld,%lld], weight [%lld,%lld,%lld], output [%lld,%lld]",
                (long long)args->input->shape[0], (long long)args->input->shape[1], (long long)experts, (long long)K,
                (long long)N, (long long)args->output->shape[0], (long long)args->output->shape[1]);
        rows = args->input->shape[0];
        gm.input = args->input->data;
        gm.weight = args->weight->data;
        gm.output = args->output->data;
        break;
    case MOERT_GEMM_DGRAD:
        if ((rc = check_tensor(host, args->grad_output, "grad_output", dtype, 2)) != MOERT_OK) return rc;
        if ((rc = check_tensor(host, args->grad_input, "grad_input", dtype, 2)) != MOERT_OK) return rc;
        if (args->grad_output->shape[1] != N || args->grad_input->shape[1] != K ||
            args->grad_input->shape[0] != args->grad_output->shape[0])
            return report(host, MOERT_ERR_INVALID_ARGUMENT,
                          "bf16 cuda: DGRAD shapes disagree: grad_output [%lld,%lld], weight [%lld,%lld,%lld], "
                          "grad_input [%lld,%lld]",
                          (long long)args->grad_output->shape[0], (long long)args->grad_output->shape[1],
                          (long long)experts, (long long)K, (long long)N, (long long)args->grad_input->shape[0],
                          (long long)args->grad_input->shape[1]);
        rows = args->grad_output->shape[0];
        gm.grad_output = args->grad_output->data;
        gm.weight = args->weight->data;
        gm.grad_input = args->grad_input->data;
        break;
    case MOERT_GEMM_WGRAD:
        if ((rc = check_tensor(host, args->input, "input", dtype, 2)) != MOERT_OK) return rc;
        if ((rc = check_tensor(host, args->grad_output, "grad_output", dtype, 2)) != MOERT_OK) return rc;
        if (args->input->shape[1] != K || args->grad_output->shape[1] != N ||
            args->input->shape[0] != args->grad_output->shape[0])
            return report(host, MOERT_ERR_INVALID_ARGUMENT,
                          "bf16 cuda: WGRAD shapes disagree: input [%lld,%lld], grad_output [%lld,%lld], grad_weight "
                          "[%lld,%lld,%lld]",
                          (long long)args->input->shape[0], (long long)args->input->shape[1],
                          (long long)args->grad_output->shape[0], (long long)args->grad_output->shape[1],
                          (long long)experts, (long long)K, (long long)N);
        rows = args->input->shape[0];
        gm.input = args->input->data;
        gm.grad_output = args->grad_output->data;
        gm.grad_weight = args->grad_weight->data;
        break;
    default: return report(host, MOERT_ERR_INVALID_ARGUMENT, "bf16 cuda: unknown GEMM pass %d", (int)args->pass);
    }
    if (args->pass != MOERT_GEMM_WGRAD && (rc = check_tensor(host, args->weight, "weight", dtype, 3)) != MOERT_OK)
        return rc;
    const moert_tensor *tpe = args->tokens_per_expert;
    if (tpe->dtype != MOERT_I64 || moert_tensor_numel(tpe) != experts)
        return report(host, MOERT_ERR_INVALID_ARGUMENT,
                      "bf16 cuda: tokens_per_expert must be int64 [%lld], got %s [%lld]", (long long)experts,
                      moert_dtype_name(tpe->dtype), (long long)moert_tensor_numel(tpe));

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
                      "bf16 cuda: tokens_per_expert sums to %lld rows but the activations have %lld", (long long)total,
                      (long long)rows);
    gm.rows_per_expert = counts;
    return moert_bf16_cuda_grouped_gemm(g, stream, &gm);
}

/* ---- fp32 -> bf16 conversion (e.g. the bf16 copy of fp32 weights) ---- */

#define CONVERT_THREADS    256
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
    if (n < 0)
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "bf16 cuda: round_to_bf16 of %lld elements", (long long)n);
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
