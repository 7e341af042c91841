/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The router plugin's CUDA path (see router_gpu.h and docs/plugins/router.md, "CUDA path").
 *
 * The linear layer in fp32 through cuBLASLt (CUBLAS_COMPUTE_32F: plain fp32, no TF32). A bf16 x is first
 * widened to fp32 by a small kernel (exact), because cuBLASLt has no bf16 x fp32 operand pair; the logits
 * are then those of fp32 arithmetic on the exact inputs, like the CPU reference's up to fp32 rounding.
 * Row-major to column-major: a row-major X[r,c] is a column-major [c,r] with ld c, so (m, n, k below are
 * cuBLASLt's column-major sizes):
 *   LOGITS  logits[T,E]  = x[T,H] @ W[E,H]^T      m=E n=T k=H  A=W  [H,E] ld H op T, B=x        [H,T] ld H op N
 *   DGRAD   dx[T,H]     (+)= d_logits[T,E] @ W     m=H n=T k=E  A=W  [H,E] ld H op N, B=d_logits [E,T] ld E op N
 *   WGRAD   dW[E,H]      += d_logits^T @ x         m=H n=E k=T  A=x  [H,T] ld H op N, B=d_logits [E,T] ld E op T
 * The heuristic's algorithm is cached per GEMM for its last shape and pointer alignments, so steady-state
 * steps (the same T) query no heuristics.
 *
 * Option "gemm" bf16x3 (auto's choice for bf16 activations): the same three products on bf16 tensor cores with fp32
 * accumulation, the fp32 operand split into three bf16 terms (hi + mid + lo hold its 24 significant bits; x is bf16
 * already, so no product loses anything):
 *   LOGITS  one GEMM on W's three planes stacked [3E,H] (m=3E): three partial logits per token, summed in plane order
 *   WGRAD   one GEMM on d_logits' planes [T,3E] (n=3E): three partial dW, summed into d_weight
 *   DGRAD   one GEMM along K = 3E on the pairs (W_hi, d_hi), (W_mid, d_hi), (W_hi, d_mid) (what is left out is ~2^-16
 *           of d_x, which is stored in bf16) into the fp32 scratch, then added to d_x. Not into the bf16 d_x in the
 *           GEMM's epilogue: the algorithm cuBLASLt picks for a bf16 output may reduce its split-K partials in bf16
 *           (d_x 0.3-1.5% off the CPU reference in tests/gpu/test_gpu_router.c, against 0.02% through the scratch)
 */
#include "router_gpu.h"

#include <cublasLt.h>
#include <cuda_runtime.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "router_cuda.h"

#define GEMM_WORKSPACE_BYTES ((size_t)4 << 20)

/* True when the host table is new enough to have `member` and it is set. */
#define HOST_HAS(h, member)                                                                                            \
    ((h)->struct_size >= offsetof(moert_host, member) + sizeof((h)->member) && (h)->member != NULL)

/* The fp32 GEMMs, the same three with bf16 operands (bf16x3, GEMM_X3 past the fp32 one) and in fp64 (compute_dtype
 * fp64, GEMM_F64 past the fp32 one). */
typedef enum gemm_kind {
    GEMM_LOGITS = 0,
    GEMM_DGRAD = 1,
    GEMM_WGRAD = 2,
    GEMM_LOGITS_X3 = 3,
    GEMM_DGRAD_X3 = 4,
    GEMM_WGRAD_X3 = 5,
    GEMM_LOGITS_F64 = 6,
    GEMM_DGRAD_F64 = 7,
    GEMM_WGRAD_F64 = 8,
    GEMM_KINDS = 9
} gemm_kind;
#define GEMM_X3   3
#define GEMM_F64  6
#define X3_PLANES 3

/* One GEMM's descriptors and the algorithm chosen for its last shape. */
typedef struct gemm_plan {
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t a, b, c;
    cublasLtMatmulAlgo_t algo;
    bool ready;
    int64_t m, n, k;
    uint32_t align_a, align_b, align_c;
    int64_t ldb;
    int beta_one;
} gemm_plan;

struct router_gpu {
    const moert_host *host;
    router_gpu_config cfg;
    moert_device device;
    int64_t hidden, num_experts, topk;
    int world_size;
    bool aux_on; /* an aux / seq-aux / global-aux loss with a coefficient > 0 */
    bool z_on;
    bool f64;      /* compute_dtype fp64: fp64 GEMMs, logits and kernels */
    bool jitter;   /* input_jitter_eps > 0 */
    bool capacity; /* capacity_factor > 0 */
    bool sinkhorn; /* load_balancing sinkhorn */

    cublasLtHandle_t lt;
    cublasLtMatmulPreference_t pref;
    gemm_plan plans[GEMM_KINDS];
    void *workspace;

    /* per-token buffers, sized for buffer_tokens tokens */
    int64_t buffer_tokens;
    void *logits;     /* [T,E] fp32 (fp64 with f64), kept for backward */
    void *d_logits;   /* [T,E] as logits */
    int32_t *sel_idx; /* [T,K] the selection, kept for backward */
    float *x32;       /* [T,H] x widened to fp32 (bf16 x), or the fp32 d_x product before it is added */
    /* bf16x3 (option "gemm"): W's planes [3E,H] (split by each forward, kept for backward), d_logits' planes [T,3E]
     * (per-token buffers) and the fp32 partial products [max(T*3E, 3E*H)] */
    bool x3;
    uint16_t *w_planes, *dl_planes;
    uint16_t *w_pairs, *dl_pairs; /* DGRAD's K-stacked planes: W (hi, mid, hi) [3E,H], d_logits (hi, hi, mid) [T,3E] */
    float *partial;
    int64_t x3_tokens;
    int64_t x32_tokens;
    const void *x32_source; /* the x whose fp32 copy x32 holds now; NULL when it holds something else */

    /* balancing losses */
    int64_t *aux_counts; /* [aux_slots + 1]: top-K counts per sequence and expert, then T */
    double *aux_f;       /* [aux_slots] f of the loss, kept for backward */
    int64_t aux_slots;
    double *aux_scale;      /* [1] A of the loss, kept for backward */
    double *loss_workspace; /* [MOERT_ROUTER_CUDA_LOSS_WORKSPACE_DOUBLES] */
    double *loss_out;       /* [2] aux value, sum of lse^2 */
    double *global_sum;     /* [E] global_aux_loss: all-reduced counts summed since the last end_step */
    int64_t global_forwards;
    double *loss_host;    /* pinned [2] */
    int64_t *counts_host; /* pinned [E] */

    /* aux-loss-free balancing */
    float *bias;          /* [E] */
    int64_t *bias_counts; /* [E] copies kept per expert since the last end_step, this rank */
    moert_tensor bias_tensor;

    /* the x the GEMMs multiply when it is not x itself: jittered (fp32, or fp64 with f64) or widened to fp64, and with
     * f64 the weight in fp64 and the fp64 products of the backward before they are added to d_x and d_weight */
    void *xc;
    int64_t xc_tokens;
    double *w64, *dw64, *dx64;
    int64_t dx64_tokens;

    /* capacity: the ids after dropping [T,K] (kept for backward), the copies kept [E], the kernel's lists [T*E] */
    int32_t *kept_idx;
    int64_t *kept_counts;
    int32_t *cap_scratch;
    int64_t cap_tokens;
    int64_t *kept_host; /* pinned [E] */

    /* the instance owning the step state (global_sum, global_forwards, bias, bias_counts): itself or its twin */
    struct router_gpu *owner;

    /* sinkhorn: exp(logits) [T*E] fp64, d0 [T], d1 [E], the rounds taken */
    double *sk_c, *sk_d0, *sk_d1;
    int *sk_iters;
    int64_t sk_tokens;

    /* the last forward, for backward */
    bool fwd_aux;
    int64_t loss_tokens; /* T of the last forward, whose losses finish_losses reads */
    int64_t fwd_aux_seq;
    double fwd_jitter_eps; /* the last forward's jitter (0 for an inference forward): its backward draws the same */
};

/* Sets the instance's message, prefixed with the plugin and device, and returns code. */
static moert_result gpu_fail(const router_gpu *g, moert_result code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static moert_result gpu_fail(const router_gpu *g, moert_result code, const char *fmt, ...)
{
    char text[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    g->host->set_error(g->host, "router '%s' on cuda:%d: %s", g->cfg.name, (int)g->device.id, text);
    return code;
}

/* Checked CUDA runtime call inside a function returning moert_result. */
#define GPU_CUDA(g, call)                                                                                              \
    do {                                                                                                               \
        cudaError_t e_ = (call);                                                                                       \
        if (e_ != cudaSuccess) {                                                                                       \
            (void)cudaGetLastError();                                                                                  \
            return gpu_fail((g), e_ == cudaErrorMemoryAllocation ? MOERT_ERR_OUT_OF_MEMORY : MOERT_ERR_CUDA,           \
                            "%s failed: %s (%s:%d)", #call, cudaGetErrorString(e_), __FILE__, __LINE__);               \
        }                                                                                                              \
    } while (0)

/* Checked cuBLASLt call. */
#define GPU_CUBLAS(g, call)                                                                                            \
    do {                                                                                                               \
        cublasStatus_t s_ = (call);                                                                                    \
        if (s_ != CUBLAS_STATUS_SUCCESS)                                                                               \
            return gpu_fail((g), s_ == CUBLAS_STATUS_ALLOC_FAILED ? MOERT_ERR_OUT_OF_MEMORY : MOERT_ERR_CUDA,          \
                            "%s failed: %s (%s:%d)", #call, cublasLtGetStatusString(s_), __FILE__, __LINE__);          \
    } while (0)

/* A call returning moert_result whose message is already set. */
#define GPU_TRY(call)                                                                                                  \
    do {                                                                                                               \
        moert_result r_ = (call);                                                                                      \
        if (r_ != MOERT_OK) return r_;                                                                                 \
    } while (0)

/* Reports a metric when the host has the service. */
static void report_metric(const router_gpu *g, const char *name, double value, const char *unit)
{
    if (HOST_HAS(g->host, metric)) g->host->metric(g->host, name, value, unit);
}

/* ---- device memory (the host's pool, stream-ordered on the rank's stream) ---- */

static moert_result device_alloc(router_gpu *g, size_t bytes, void **out)
{
    *out = NULL;
    return g->host->alloc(g->host, g->device, bytes ? bytes : 1, out);
}

static void device_free(router_gpu *g, void *ptr)
{
    if (ptr) g->host->free(g->host, g->device, ptr);
}

/* Makes the per-token buffers (logits, d_logits, selection) hold T tokens (grows only). */
static moert_result ensure_token_buffers(router_gpu *g, int64_t T)
{
    if (g->logits && T <= g->buffer_tokens) return MOERT_OK;
    int64_t n = T > 0 ? T : 1;
    int64_t E = g->num_experts, K = g->topk;
    device_free(g, g->logits);
    device_free(g, g->d_logits);
    device_free(g, g->sel_idx);
    g->logits = g->d_logits = NULL;
    g->sel_idx = NULL;
    g->buffer_tokens = 0;
    const size_t scalar = g->f64 ? sizeof(double) : sizeof(float);
    GPU_TRY(device_alloc(g, (size_t)(n * E) * scalar, (void **)&g->logits));
    GPU_TRY(device_alloc(g, (size_t)(n * E) * scalar, (void **)&g->d_logits));
    GPU_TRY(device_alloc(g, (size_t)(n * K) * sizeof(int32_t), (void **)&g->sel_idx));
    g->buffer_tokens = n;
    return MOERT_OK;
}

/* Makes the fp32 [T,H] scratch hold T tokens (grows only; allocated on first need: bf16 x or bf16 d_x). */
static moert_result ensure_x32(router_gpu *g, int64_t T)
{
    if (g->x32 && T <= g->x32_tokens) return MOERT_OK;
    int64_t n = T > 0 ? T : 1;
    device_free(g, g->x32);
    g->x32 = NULL;
    g->x32_tokens = 0;
    g->x32_source = NULL;
    GPU_TRY(device_alloc(g, (size_t)(n * g->hidden) * sizeof(float), (void **)&g->x32));
    g->x32_tokens = n;
    return MOERT_OK;
}

/* bf16x3: W's planes (once), and d_logits' planes and the partial products for T tokens (grow only). */
static moert_result ensure_x3_buffers(router_gpu *g, int64_t T)
{
    const int64_t E = g->num_experts, H = g->hidden, n = T > 0 ? T : 1;
    if (!g->w_planes) GPU_TRY(device_alloc(g, (size_t)(X3_PLANES * E * H) * sizeof(uint16_t), (void **)&g->w_planes));
    if (!g->w_pairs) GPU_TRY(device_alloc(g, (size_t)(X3_PLANES * E * H) * sizeof(uint16_t), (void **)&g->w_pairs));
    if (g->dl_planes && n <= g->x3_tokens) return MOERT_OK;
    device_free(g, g->dl_planes);
    device_free(g, g->dl_pairs);
    device_free(g, g->partial);
    g->dl_planes = g->dl_pairs = NULL;
    g->partial = NULL;
    g->x3_tokens = 0;
    const int64_t partial = X3_PLANES * E * (n > H ? n : H);
    GPU_TRY(device_alloc(g, (size_t)(X3_PLANES * E * n) * sizeof(uint16_t), (void **)&g->dl_planes));
    GPU_TRY(device_alloc(g, (size_t)(X3_PLANES * E * n) * sizeof(uint16_t), (void **)&g->dl_pairs));
    GPU_TRY(device_alloc(g, (size_t)partial * sizeof(float), (void **)&g->partial));
    g->x3_tokens = n;
    return MOERT_OK;
}

/* Makes the compute-type x buffer (and with f64 the fp64 d_x product) hold T tokens (grows only). */
static moert_result ensure_xc(router_gpu *g, int64_t T)
{
    const int64_t n = T > 0 ? T : 1, H = g->hidden;
    const size_t scalar = g->f64 ? sizeof(double) : sizeof(float);
    if (!g->xc || n > g->xc_tokens) {
        device_free(g, g->xc);
        g->xc = NULL;
        g->xc_tokens = 0;
        GPU_TRY(device_alloc(g, (size_t)(n * H) * scalar, &g->xc));
        g->xc_tokens = n;
    }
    if (g->f64 && (!g->dx64 || n > g->dx64_tokens)) {
        device_free(g, g->dx64);
        g->dx64 = NULL;
        g->dx64_tokens = 0;
        GPU_TRY(device_alloc(g, (size_t)(n * H) * sizeof(double), (void **)&g->dx64));
        g->dx64_tokens = n;
    }
    return MOERT_OK;
}

/* Makes the capacity buffers hold T tokens (grows only). */
static moert_result ensure_capacity_buffers(router_gpu *g, int64_t T)
{
    const int64_t n = T > 0 ? T : 1, E = g->num_experts, K = g->topk;
    if (g->kept_idx && n <= g->cap_tokens) return MOERT_OK;
    device_free(g, g->kept_idx);
    device_free(g, g->cap_scratch);
    g->kept_idx = NULL;
    g->cap_scratch = NULL;
    g->cap_tokens = 0;
    GPU_TRY(device_alloc(g, (size_t)(n * K) * sizeof(int32_t), (void **)&g->kept_idx));
    GPU_TRY(device_alloc(g, (size_t)(n * E) * sizeof(int32_t), (void **)&g->cap_scratch));
    g->cap_tokens = n;
    return MOERT_OK;
}

/* Makes the sinkhorn buffers hold T tokens (grows only). */
static moert_result ensure_sinkhorn_buffers(router_gpu *g, int64_t T)
{
    const int64_t n = T > 0 ? T : 1, E = g->num_experts;
    if (g->sk_c && n <= g->sk_tokens) return MOERT_OK;
    device_free(g, g->sk_c);
    device_free(g, g->sk_d0);
    g->sk_c = g->sk_d0 = NULL;
    g->sk_tokens = 0;
    GPU_TRY(device_alloc(g, (size_t)MOERT_ROUTER_CUDA_SINKHORN_WORKSPACE_DOUBLES(n, E) * sizeof(double),
                         (void **)&g->sk_c));
    GPU_TRY(device_alloc(g, (size_t)n * sizeof(double), (void **)&g->sk_d0));
    g->sk_tokens = n;
    return MOERT_OK;
}

/* Makes the balancing-loss buffers hold `slots` (sequences x experts) counts (grows only). */
static moert_result ensure_aux_buffers(router_gpu *g, int64_t slots)
{
    if (g->aux_counts && slots <= g->aux_slots) return MOERT_OK;
    device_free(g, g->aux_counts);
    device_free(g, g->aux_f);
    g->aux_counts = NULL;
    g->aux_f = NULL;
    g->aux_slots = 0;
    GPU_TRY(device_alloc(g, (size_t)(slots + 1) * sizeof(int64_t), (void **)&g->aux_counts));
    GPU_TRY(device_alloc(g, (size_t)slots * sizeof(double), (void **)&g->aux_f));
    g->aux_slots = slots;
    return MOERT_OK;
}

/* ---- cuBLASLt ---- */

/* Largest power of two (<= 256) dividing the address: what cuBLASLt may assume about a pointer. */
static uint32_t pointer_alignment(const void *p)
{
    uintptr_t a = (uintptr_t)p;
    uint32_t align = 256;
    while (align > 1 && (a % align) != 0) align /= 2;
    return align;
}

/* Sets one layout's rows, columns and leading dimension (column-major; ld 0: rows). */
static moert_result layout_set(router_gpu *g, cublasLtMatrixLayout_t l, int64_t rows, int64_t cols, int64_t ld_or_0)
{
    uint64_t r = (uint64_t)rows, c = (uint64_t)cols;
    int64_t ld = ld_or_0 > 0 ? ld_or_0 : rows;
    GPU_CUBLAS(g, cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_ROWS, &r, sizeof r));
    GPU_CUBLAS(g, cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_COLS, &c, sizeof c));
    GPU_CUBLAS(g, cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_LD, &ld, sizeof ld));
    return MOERT_OK;
}

/* The stored (column-major) sizes of a GEMM's operands from its m, n, k (see the table at the top). */
static void gemm_operand_sizes(gemm_kind kind, int64_t m, int64_t n, int64_t k, int64_t sizes[3][2])
{
    switch (kind % GEMM_X3) {
    case GEMM_LOGITS: /* A = W [k=H, m=E] op T; B = x [H, n=T] */
        sizes[0][0] = k;
        sizes[0][1] = m;
        sizes[1][0] = k;
        sizes[1][1] = n;
        break;
    case GEMM_DGRAD: /* A = W [m=H, k=E]; B = d_logits [E, n=T] */
        sizes[0][0] = m;
        sizes[0][1] = k;
        sizes[1][0] = k;
        sizes[1][1] = n;
        break;
    default: /* WGRAD: A = x [m=H, k=T]; B = d_logits [n=E, T] op T */
        sizes[0][0] = m;
        sizes[0][1] = k;
        sizes[1][0] = n;
        sizes[1][1] = k;
        break;
    }
    sizes[2][0] = m;
    sizes[2][1] = n;
}

static const char *gemm_name(gemm_kind kind)
{
    static const char *const names[GEMM_KINDS] = {
        "logits = x W^T",        "d_x = d_logits W",        "d_W += d_logits^T x",
        "bf16x3 logits = x W^T", "bf16x3 d_x = d_logits W", "bf16x3 d_W += d_logits^T x",
        "fp64 logits = x W^T",   "fp64 d_x = d_logits W",   "fp64 d_W = d_logits^T x"};
    return names[kind];
}

/* C (+)= op(A) op(B) with fp32 accumulation on stream (fp32 operands, or bf16 for the X3 kinds; B's leading dimension
 * ldb, 0: its rows); the algorithm is looked up again only when the shape changes. */
static moert_result gemm_run_ld(router_gpu *g, cudaStream_t stream, gemm_kind kind, int64_t m, int64_t n, int64_t k,
                                const void *A, const void *B, int64_t ldb, void *C, int beta_one)
{
    gemm_plan *p = &g->plans[kind];
    uint32_t aa = pointer_alignment(A), ab = pointer_alignment(B), ac = pointer_alignment(C);
    if (!p->ready || p->m != m || p->n != n || p->k != k || p->align_a != aa || p->align_b != ab || p->align_c != ac ||
        p->beta_one != beta_one || p->ldb != ldb) {
        int64_t sizes[3][2];
        gemm_operand_sizes(kind, m, n, k, sizes);
        p->ready = false;
        GPU_TRY(layout_set(g, p->a, sizes[0][0], sizes[0][1], 0));
        GPU_TRY(layout_set(g, p->b, sizes[1][0], sizes[1][1], ldb));
        GPU_TRY(layout_set(g, p->c, sizes[2][0], sizes[2][1], 0));
        GPU_CUBLAS(g, cublasLtMatmulPreferenceSetAttribute(g->pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &aa,
                                                           sizeof aa));
        GPU_CUBLAS(g, cublasLtMatmulPreferenceSetAttribute(g->pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ab,
                                                           sizeof ab));
        GPU_CUBLAS(g, cublasLtMatmulPreferenceSetAttribute(g->pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &ac,
                                                           sizeof ac));
        GPU_CUBLAS(g, cublasLtMatmulPreferenceSetAttribute(g->pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &ac,
                                                           sizeof ac));
        cublasLtMatmulHeuristicResult_t result;
        int found = 0;
        memset(&result, 0, sizeof result);
        GPU_CUBLAS(g,
                   cublasLtMatmulAlgoGetHeuristic(g->lt, p->desc, p->a, p->b, p->c, p->c, g->pref, 1, &result, &found));
        if (found < 1)
            return gpu_fail(g, MOERT_ERR_UNSUPPORTED, "cuBLASLt has no algorithm for %s (m=%lld n=%lld k=%lld)",
                            gemm_name(kind), (long long)m, (long long)n, (long long)k);
        p->algo = result.algo;
        p->m = m;
        p->n = n;
        p->k = k;
        p->align_a = aa;
        p->align_b = ab;
        p->align_c = ac;
        p->beta_one = beta_one;
        p->ldb = ldb;
        p->ready = true;
    }
    const float alpha = 1.0f, beta = beta_one ? 1.0f : 0.0f;
    const double alpha64 = 1.0, beta64 = beta_one ? 1.0 : 0.0;
    const bool f64 = kind >= GEMM_F64;
    GPU_CUBLAS(g, cublasLtMatmul(g->lt, p->desc, f64 ? (const void *)&alpha64 : (const void *)&alpha, A, p->a, B, p->b,
                                 f64 ? (const void *)&beta64 : (const void *)&beta, C, p->c, C, p->c, &p->algo,
                                 g->workspace, GEMM_WORKSPACE_BYTES, stream));
    return MOERT_OK;
}

static moert_result gemm_run(router_gpu *g, cudaStream_t stream, gemm_kind kind, int64_t m, int64_t n, int64_t k,
                             const float *A, const float *B, float *C, int beta_one)
{
    return gemm_run_ld(g, stream, kind, m, n, k, A, B, 0, C, beta_one);
}

/* The handle, the preference (workspace size) and each GEMM's descriptor and layouts. */
static moert_result gemm_setup(router_gpu *g)
{
    GPU_CUBLAS(g, cublasLtCreate(&g->lt));
    GPU_CUBLAS(g, cublasLtMatmulPreferenceCreate(&g->pref));
    uint64_t ws = GEMM_WORKSPACE_BYTES;
    GPU_CUBLAS(g,
               cublasLtMatmulPreferenceSetAttribute(g->pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
    for (int kind = 0; kind < GEMM_KINDS; kind++) {
        gemm_plan *p = &g->plans[kind];
        cublasOperation_t ta = kind % GEMM_X3 == GEMM_LOGITS ? CUBLAS_OP_T : CUBLAS_OP_N;
        cublasOperation_t tb = kind % GEMM_X3 == GEMM_WGRAD ? CUBLAS_OP_T : CUBLAS_OP_N;
        const bool f64 = kind >= GEMM_F64;
        cudaDataType_t operands = f64 ? CUDA_R_64F : kind >= GEMM_X3 ? CUDA_R_16BF : CUDA_R_32F;
        cudaDataType_t result = f64 ? CUDA_R_64F : CUDA_R_32F;
        GPU_CUBLAS(g, cublasLtMatmulDescCreate(&p->desc, f64 ? CUBLAS_COMPUTE_64F : CUBLAS_COMPUTE_32F, result));
        GPU_CUBLAS(g, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
        GPU_CUBLAS(g, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
        GPU_CUBLAS(g, cublasLtMatrixLayoutCreate(&p->a, operands, 1, 1, 1));
        GPU_CUBLAS(g, cublasLtMatrixLayoutCreate(&p->b, operands, 1, 1, 1));
        GPU_CUBLAS(g, cublasLtMatrixLayoutCreate(&p->c, result, 1, 1, 1));
    }
    return MOERT_OK;
}

/* ---- create and destroy ---- */

/* The first option the CUDA path cannot serve yet, written into `why`, or false when all can run. */
static bool cpu_only_option(const router_gpu_config *cfg, const moert_layer_info *layer, char *why, size_t size)
{
    const router_params *p = &cfg->params;
    if (layer->num_experts > MOERT_ROUTER_CUDA_MAX_EXPERTS) {
        snprintf(why, size, "num_experts %lld is more than the CUDA kernels' %d (the CPU path has no limit)",
                 (long long)layer->num_experts, MOERT_ROUTER_CUDA_MAX_EXPERTS);
    } else if (layer->topk > MOERT_ROUTER_CUDA_MAX_TOPK) {
        snprintf(why, size, "topk %lld is more than the CUDA kernels' %d (the CPU path has no limit)",
                 (long long)layer->topk, MOERT_ROUTER_CUDA_MAX_TOPK);
    } else if (p->num_groups > MOERT_ROUTER_CUDA_MAX_GROUPS) {
        snprintf(why, size, "option num_groups %lld is more than the CUDA kernels' %d (the CPU path has no limit)",
                 (long long)p->num_groups, MOERT_ROUTER_CUDA_MAX_GROUPS);
    } else if (p->capacity_factor > 0.0 && layer->max_tokens * layer->topk > INT32_MAX) {
        snprintf(why, size, "capacity_factor with max_tokens x topk = %lld copies is more than the CUDA kernels' %d",
                 (long long)(layer->max_tokens * layer->topk), INT32_MAX);
    } else if (layer->max_tokens > INT32_MAX) {
        snprintf(why, size, "max_tokens %lld is more than the CUDA kernels' %d", (long long)layer->max_tokens,
                 INT32_MAX);
    } else {
        return false;
    }
    return true;
}

/* Everything create allocates, in an order destroy can unwind from any point. */
static moert_result create_state(router_gpu *g, const moert_layer_info *layer)
{
    const moert_host *h = g->host;
    int64_t E = g->num_experts;
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess || count <= g->device.id) {
        (void)cudaGetLastError();
        char reason[160];
        if (err != cudaSuccess)
            snprintf(reason, sizeof reason, "no usable CUDA device (%s)", cudaGetErrorString(err));
        else
            snprintf(reason, sizeof reason, "%d CUDA device(s) visible", count);
        h->set_error(h, "router '%s': device cuda:%d is not supported here: %s", g->cfg.name, (int)g->device.id,
                     reason);
        return MOERT_ERR_UNSUPPORTED;
    }
    GPU_CUDA(g, cudaSetDevice(g->device.id));
    moert_result rc = device_alloc(g, GEMM_WORKSPACE_BYTES, &g->workspace);
    if (rc == MOERT_ERR_UNSUPPORTED) {
        h->set_error(h,
                     "router '%s': device cuda:%d is not supported by this host (its alloc service has no CUDA "
                     "memory: a CUDA rank's host needs the rank's memory pool)",
                     g->cfg.name, (int)g->device.id);
        return rc;
    }
    if (rc != MOERT_OK) return rc;
    GPU_TRY(gemm_setup(g));
    GPU_TRY(device_alloc(g, sizeof(double), (void **)&g->aux_scale));
    GPU_TRY(device_alloc(g, MOERT_ROUTER_CUDA_LOSS_WORKSPACE_DOUBLES * sizeof(double), (void **)&g->loss_workspace));
    GPU_TRY(device_alloc(g, 2 * sizeof(double), (void **)&g->loss_out));
    GPU_TRY(device_alloc(g, (size_t)E * sizeof(double), (void **)&g->global_sum));
    GPU_TRY(device_alloc(g, (size_t)E * sizeof(float), (void **)&g->bias));
    GPU_TRY(device_alloc(g, (size_t)E * sizeof(int64_t), (void **)&g->bias_counts));
    if (!HOST_HAS(h, alloc_pinned) || !HOST_HAS(h, free_pinned))
        return gpu_fail(g, MOERT_ERR_UNSUPPORTED, "the host has no pinned memory service");
    GPU_TRY(h->alloc_pinned(h, 2 * sizeof(double), (void **)&g->loss_host));
    GPU_TRY(h->alloc_pinned(h, (size_t)E * sizeof(int64_t), (void **)&g->counts_host));
    if (g->capacity) {
        GPU_TRY(device_alloc(g, (size_t)E * sizeof(int64_t), (void **)&g->kept_counts));
        GPU_TRY(h->alloc_pinned(h, (size_t)E * sizeof(int64_t), (void **)&g->kept_host));
        if (layer->max_tokens > 0) GPU_TRY(ensure_capacity_buffers(g, layer->max_tokens));
    }
    if (g->sinkhorn) {
        GPU_TRY(device_alloc(g, (size_t)E * sizeof(double), (void **)&g->sk_d1));
        GPU_TRY(device_alloc(g, sizeof(int), (void **)&g->sk_iters));
        if (layer->max_tokens > 0) GPU_TRY(ensure_sinkhorn_buffers(g, layer->max_tokens));
    }
    if (g->f64) {
        GPU_TRY(device_alloc(g, (size_t)(E * g->hidden) * sizeof(double), (void **)&g->w64));
        GPU_TRY(device_alloc(g, (size_t)(E * g->hidden) * sizeof(double), (void **)&g->dw64));
    }
    if ((g->f64 || g->jitter) && layer->max_tokens > 0) GPU_TRY(ensure_xc(g, layer->max_tokens));
    /* The state that starts at zero. init has no stream: wait for the device (so no earlier user of these pool
     * blocks has work pending on any stream), zero them on the legacy stream and wait for that. Once, here;
     * nothing in a step waits like this. */
    GPU_CUDA(g, cudaDeviceSynchronize());
    GPU_CUDA(g, cudaMemsetAsync(g->global_sum, 0, (size_t)E * sizeof(double), 0));
    GPU_CUDA(g, cudaMemsetAsync(g->bias, 0, (size_t)E * sizeof(float), 0));
    GPU_CUDA(g, cudaMemsetAsync(g->bias_counts, 0, (size_t)E * sizeof(int64_t), 0));
    GPU_CUDA(g, cudaStreamSynchronize(0));
    if (layer->max_tokens > 0) GPU_TRY(ensure_token_buffers(g, layer->max_tokens));
    g->bias_tensor = moert_tensor_1d(g->bias, g->device, MOERT_F32, E);
    return MOERT_OK;
}

moert_result router_gpu_create(const moert_host *host, const moert_layer_info *layer, const router_gpu_config *cfg,
                               router_gpu **out)
{
    *out = NULL;
    char why[256];
    if (cpu_only_option(cfg, layer, why, sizeof why)) {
        host->set_error(host, "router '%s' on cuda:%d: %s (the CPU path has it: place the layer on the CPU)", cfg->name,
                        (int)layer->device.id, why);
        return MOERT_ERR_UNSUPPORTED;
    }
    router_gpu *g = calloc(1, sizeof *g);
    if (!g) {
        host->set_error(host, "router '%s': out of memory", cfg->name);
        return MOERT_ERR_OUT_OF_MEMORY;
    }
    g->host = host;
    g->cfg = *cfg;
    g->owner = cfg->twin ? cfg->twin : g;
    g->device = layer->device;
    g->hidden = layer->hidden;
    g->num_experts = layer->num_experts;
    g->topk = layer->topk;
    g->world_size = host->world_size;
    router_balancing b = cfg->params.balancing;
    g->aux_on =
        (b == ROUTER_BALANCE_AUX_LOSS || b == ROUTER_BALANCE_SEQ_AUX_LOSS || b == ROUTER_BALANCE_GLOBAL_AUX_LOSS) &&
        cfg->aux_loss_coeff > 0.0;
    g->z_on = cfg->z_loss_coeff > 0.0;
    g->f64 = cfg->compute_dtype == ROUTER_COMPUTE_FP64;
    g->jitter = cfg->jitter_eps > 0.0;
    g->capacity = cfg->params.capacity_factor > 0.0;
    g->sinkhorn = b == ROUTER_BALANCE_SINKHORN;
    /* auto takes bf16x3 for bf16 activations unless they are jittered (no longer bf16) or the GEMMs are fp64 */
    g->x3 = cfg->gemm == ROUTER_GEMM_BF16X3 ||
            (cfg->gemm == ROUTER_GEMM_AUTO && layer->dtype == MOERT_BF16 && !g->jitter && !g->f64);
    if (g->x3 && layer->dtype != MOERT_BF16) {
        host->set_error(host,
                        "router '%s' on cuda:%d: option gemm: \"bf16x3\" needs bf16 activations (the layer has "
                        "%s); use \"fp32\" or \"auto\"",
                        cfg->name, (int)layer->device.id, moert_dtype_name(layer->dtype));
        free(g);
        return MOERT_ERR_UNSUPPORTED;
    }
    /* without a loss no value comes back to the host: no sync, and no allocation once the buffers have grown to the
     * step's tokens, so the executor may capture the layer in a CUDA graph */
    if (offsetof(moert_host, set_flags) + sizeof host->set_flags <= host->struct_size)
        host->set_flags(host, g->aux_on || g->z_on ? MOERT_CAP_NEEDS_HOST_SYNC : MOERT_CAP_GRAPH_CAPTURABLE);
    moert_result rc = create_state(g, layer);
    if (rc != MOERT_OK) {
        router_gpu_destroy(g);
        return rc;
    }
    *out = g;
    return MOERT_OK;
}

void router_gpu_destroy(router_gpu *g)
{
    if (!g) return;
    const moert_host *h = g->host;
    for (int kind = 0; kind < GEMM_KINDS; kind++) {
        gemm_plan *p = &g->plans[kind];
        if (p->a) cublasLtMatrixLayoutDestroy(p->a);
        if (p->b) cublasLtMatrixLayoutDestroy(p->b);
        if (p->c) cublasLtMatrixLayoutDestroy(p->c);
        if (p->desc) cublasLtMatmulDescDestroy(p->desc);
    }
    if (g->pref) cublasLtMatmulPreferenceDestroy(g->pref);
    if (g->lt) cublasLtDestroy(g->lt);
    void *device_buffers[] = {g->workspace,  g->logits,  g->d_logits,    g->sel_idx,     g->x32,
                              g->aux_counts, g->aux_f,   g->aux_scale,   g->loss_out,    g->loss_workspace,
                              g->global_sum, g->bias,    g->bias_counts, g->w_planes,    g->dl_planes,
                              g->partial,    g->w_pairs, g->dl_pairs,    g->xc,          g->w64,
                              g->dw64,       g->dx64,    g->kept_idx,    g->kept_counts, g->cap_scratch,
                              g->sk_c,       g->sk_d0,   g->sk_d1,       g->sk_iters};
    for (size_t i = 0; i < sizeof device_buffers / sizeof device_buffers[0]; i++) device_free(g, device_buffers[i]);
    if (g->loss_host) h->free_pinned(h, g->loss_host);
    if (g->counts_host) h->free_pinned(h, g->counts_host);
    if (g->kept_host) h->free_pinned(h, g->kept_host);
    free(g);
}

/* ---- forward ---- */

/* The kernel parameters of the router's selection and probs. */
static moert_router_cuda_params route_params(const router_gpu *g, int64_t T)
{
    const router_params *p = &g->cfg.params;
    moert_router_cuda_params rp;
    memset(&rp, 0, sizeof rp);
    rp.tokens = T;
    rp.num_experts = g->num_experts;
    rp.topk = g->topk;
    rp.score = p->score_function == ROUTER_SCORE_SIGMOID ? MOERT_ROUTER_CUDA_SIGMOID
               : p->pre_softmax                          ? MOERT_ROUTER_CUDA_SOFTMAX_PRE
                                                         : MOERT_ROUTER_CUDA_SOFTMAX_POST;
    rp.num_groups = p->num_groups;
    rp.group_topk = p->group_topk;
    /* as the CPU reference: sigmoid probs are normalised over the K selected (K > 1), pre-softmax ones not */
    rp.normalize = p->score_function == ROUTER_SCORE_SIGMOID ? 1 : 0;
    rp.scaling_factor = p->scaling_factor;
    if (g->sinkhorn) {
        /* the selection comes from the balanced scores; the probs are Megatron's sinkhorn activation: softmax over
         * all experts for K > 1, the sigmoid of the selected logit for K = 1, neither renormalised */
        rp.score = g->topk > 1 ? MOERT_ROUTER_CUDA_SOFTMAX_PRE : MOERT_ROUTER_CUDA_SIGMOID;
        rp.normalize = 0;
        rp.num_groups = 0;
        rp.group_topk = 0;
    }
    return rp;
}

/* The loss kernels' sizes for T tokens in sequences of S. */
static moert_router_cuda_loss_params loss_params(const router_gpu *g, int64_t T, int64_t S)
{
    moert_router_cuda_loss_params lp;
    memset(&lp, 0, sizeof lp);
    lp.tokens = T;
    lp.num_experts = g->num_experts;
    lp.topk = g->topk;
    lp.seq_length = S > 0 ? S : 1;
    lp.sigmoid = g->cfg.params.score_function == ROUTER_SCORE_SIGMOID;
    lp.logits_f64 = g->f64;
    return lp;
}

/* A float tensor's dtype is one of the two the CUDA path takes (fp32, or also bf16). */
static moert_result check_dtype(router_gpu *g, const char *call, const char *name, const moert_tensor *t, bool bf16_too)
{
    if (t->dtype == MOERT_F32 || (bf16_too && t->dtype == MOERT_BF16)) return MOERT_OK;
    return gpu_fail(g, MOERT_ERR_UNSUPPORTED, "%s: %s is %s; the CUDA path takes %s", call, name,
                    moert_dtype_name(t->dtype), bf16_too ? "fp32 or bf16" : "fp32");
}

/* The fp32 x for the GEMMs: x itself, or its widened copy in x32. Forward always converts (the caller may
 * reuse x's memory from step to step); backward reuses the forward's copy when x32 still holds it. */
static moert_result x_as_f32(router_gpu *g, cudaStream_t stream, const moert_tensor *x, int64_t T, bool convert,
                             const float **out)
{
    if (x->dtype == MOERT_F32) {
        *out = (const float *)x->data;
        return MOERT_OK;
    }
    GPU_TRY(ensure_x32(g, T));
    if (convert || g->x32_source != x->data) {
        GPU_TRY(moert_router_cuda_to_f32(g->host, stream, x->dtype, T * g->hidden, x->data, g->x32));
        g->x32_source = x->data;
    }
    *out = g->x32;
    return MOERT_OK;
}

/* The balancing loss's counts, f and A of this forward (on the device); sets fwd_aux. */
static moert_result forward_aux(router_gpu *g, cudaStream_t stream, int64_t T, int64_t seq_length)
{
    int64_t E = g->num_experts, K = g->topk;
    router_balancing b = g->cfg.params.balancing;
    int64_t S = T;
    if (b == ROUTER_BALANCE_SEQ_AUX_LOSS && seq_length > 0) S = seq_length;
    if (b == ROUTER_BALANCE_GLOBAL_AUX_LOSS) {
        /* f: counts all-reduced over ranks, averaged over the forwards since the last end_step; collective,
         * so every rank takes part even without tokens */
        moert_router_cuda_loss_params lp = loss_params(g, T, T);
        GPU_TRY(ensure_aux_buffers(g, E));
        GPU_TRY(moert_router_cuda_aux_counts(g->host, stream, &lp, g->logits, g->aux_counts));
        if (g->world_size > 1)
            GPU_TRY(g->host->allreduce_sum(g->host, g->aux_counts, (size_t)(E + 1), MOERT_I64, g->device, stream));
        g->owner->global_forwards++;
        GPU_TRY(moert_router_cuda_aux_finish(g->host, stream, E, g->aux_counts, g->owner->global_sum,
                                             (double)g->owner->global_forwards,
                                             g->cfg.aux_loss_coeff * (double)E / (double)K, g->aux_f, g->aux_scale));
    } else if (T > 0) {
        int64_t B = T / S;
        double A = g->cfg.aux_loss_coeff * (double)E / ((double)K * (double)S * (double)S * (double)B);
        moert_router_cuda_loss_params lp = loss_params(g, T, S);
        GPU_TRY(ensure_aux_buffers(g, B * E));
        GPU_TRY(moert_router_cuda_aux_counts(g->host, stream, &lp, g->logits, g->aux_counts));
        GPU_TRY(
            moert_router_cuda_aux_finish(g->host, stream, B * E, g->aux_counts, NULL, 0.0, A, g->aux_f, g->aux_scale));
    }
    if (T > 0) {
        g->fwd_aux = true;
        g->fwd_aux_seq = S;
    }
    return MOERT_OK;
}

/* The host's figures of the last forward, whose loss values and kept counts are in the pinned buffers by now:
 * losses (0 where off) and the step report's metrics. */
static void finish_losses(router_gpu *g, moert_router_losses *losses)
{
    const int64_t E = g->num_experts, K = g->topk, T = g->loss_tokens;
    const bool z = g->z_on && T > 0;
    losses->aux_loss = g->fwd_aux ? g->loss_host[0] : 0.0;
    losses->z_loss = z ? g->cfg.z_loss_coeff * g->loss_host[1] / (double)T : 0.0;
    losses->total = losses->aux_loss + losses->z_loss;
    if (g->fwd_aux || z) {
        int64_t max_count = 0, total = 0;
        for (int64_t e = 0; e < E; e++) {
            if (g->counts_host[e] > max_count) max_count = g->counts_host[e];
            total += g->counts_host[e];
        }
        if (T > 0) report_metric(g, "router.max_load_ratio", (double)max_count / ((double)(T * K) / (double)E), "");
        if (g->capacity) report_metric(g, "router.dropped_copies", (double)(T * K - total), "tokens");
    }
    if (g->fwd_aux) report_metric(g, "router.aux_loss", losses->aux_loss, "");
    if (g->z_on) report_metric(g, "router.z_loss", losses->z_loss, "");
}

/* The loss values and the kept counts of T tokens to the pinned buffers; unless deferred, waits for them and fills
 * losses. */
static moert_result forward_losses(router_gpu *g, cudaStream_t stream, int64_t T, const moert_tensor *counts,
                                   moert_router_losses *losses, bool defer)
{
    int64_t E = g->num_experts;
    const moert_host *h = g->host;
    bool z = g->z_on && T > 0;
    g->loss_tokens = T;
    if (g->fwd_aux || z) {
        moert_router_cuda_loss_params lp = loss_params(g, T, g->fwd_aux ? g->fwd_aux_seq : T);
        GPU_TRY(moert_router_cuda_loss_values(h, stream, &lp, g->logits, g->fwd_aux ? g->aux_f : NULL, g->aux_scale,
                                              z ? 1 : 0, g->loss_workspace, g->loss_out));
        moert_device pinned = {MOERT_DEVICE_CUDA_HOST, 0};
        GPU_TRY(h->memcpy_async(h, g->loss_host, pinned, g->loss_out, g->device, 2 * sizeof(double), stream));
        /* the copies really routed: with capacity (and padding) the kept counts, not tokens_per_expert */
        const void *kept = g->capacity && T > 0 ? (const void *)g->kept_counts : counts->data;
        GPU_TRY(h->memcpy_async(h, g->counts_host, pinned, kept, g->device, (size_t)E * sizeof(int64_t), stream));
        if (defer) return MOERT_OK;
        GPU_TRY(h->stream_synchronize(h, stream));
    }
    if (!defer) finish_losses(g, losses);
    return MOERT_OK;
}

moert_result router_gpu_forward_losses(router_gpu *g, moert_router_losses *losses)
{
    finish_losses(g, losses);
    return MOERT_OK;
}

/* The noise of forward number `call` (jitter factors or random logits) of the stream `key`. */
static moert_router_cuda_noise noise_of(uint64_t key, uint64_t call, double eps)
{
    moert_router_cuda_noise n = {key, call, eps};
    return n;
}

/* The logits of the compute dtype: fp64 GEMM on x and W widened (x jittered); fp32 GEMM on the jittered x; else the
 * fp32 or bf16x3 GEMM of x as it is. */
static moert_result forward_logits(router_gpu *g, cudaStream_t stream, const moert_router_forward_args *a, int64_t T,
                                   uint64_t call)
{
    const moert_host *h = g->host;
    const int64_t H = g->hidden, E = g->num_experts;
    const moert_router_cuda_noise jitter = noise_of(g->cfg.jitter_key, call, g->fwd_jitter_eps);
    if (g->f64 || g->jitter) {
        GPU_TRY(ensure_xc(g, T));
        GPU_TRY(moert_router_cuda_convert(h, stream, a->x->dtype, T, H, a->x->data, g->jitter ? &jitter : NULL, g->xc,
                                          g->f64));
        if (g->f64) {
            GPU_TRY(moert_router_cuda_convert(h, stream, MOERT_F32, E, H, a->weight->data, NULL, g->w64, 1));
            GPU_TRY(gemm_run_ld(g, stream, GEMM_LOGITS_F64, E, T, H, g->w64, g->xc, 0, g->logits, 0));
        } else {
            GPU_TRY(gemm_run(g, stream, GEMM_LOGITS, E, T, H, (const float *)a->weight->data, g->xc, g->logits, 0));
        }
    } else if (g->x3) {
        GPU_TRY(ensure_x3_buffers(g, T));
        static const int terms[3] = {0, 1, 2};
        GPU_TRY(moert_router_cuda_split_bf16(h, stream, 1, E * H, terms, (const float *)a->weight->data, g->w_planes));
        GPU_TRY(gemm_run_ld(g, stream, GEMM_LOGITS_X3, X3_PLANES * E, T, H, g->w_planes, a->x->data, 0, g->partial, 0));
        GPU_TRY(moert_router_cuda_sum_planes(h, stream, T, E, X3_PLANES, 0, g->partial, g->logits));
    } else {
        const float *x32 = NULL;
        GPU_TRY(x_as_f32(g, stream, a->x, T, true, &x32));
        GPU_TRY(gemm_run(g, stream, GEMM_LOGITS, E, T, H, (const float *)a->weight->data, x32, g->logits, 0));
    }
    /* force_load_balancing: the routing sees random logits; backward passes their gradient straight through */
    if (g->cfg.force_balance) {
        const moert_router_cuda_noise random = noise_of(g->cfg.random_logits_key, call, 0.0);
        GPU_TRY(moert_router_cuda_random_logits(h, stream, T, E, &random, g->logits, g->f64));
    }
    return MOERT_OK;
}

/* Selection, probs and counts of T tokens: sinkhorn's balanced scores, the route, capacity. topk_idx gets the ids
 * kept; the selection (sel_idx) and the kept ids (kept_idx) stay for backward. */
static moert_result forward_route(router_gpu *g, cudaStream_t stream, const moert_router_forward_args *a, int64_t T)
{
    const moert_host *h = g->host;
    const int64_t E = g->num_experts, K = g->topk;
    moert_router_cuda_params rp = route_params(g, T);
    moert_router_cuda_route_ext ext;
    memset(&ext, 0, sizeof ext);
    ext.logits_f64 = g->f64;
    if (g->sinkhorn && T > 0) {
        GPU_TRY(ensure_sinkhorn_buffers(g, T));
        GPU_TRY(moert_router_cuda_sinkhorn(h, stream, T, E, g->logits, g->f64, ROUTER_SINKHORN_TOLERANCE,
                                           ROUTER_SINKHORN_MAX_ROUNDS, g->sk_c, g->sk_d0, g->sk_d1, g->sk_iters));
        ext.sinkhorn_d0 = g->sk_d0;
        ext.sinkhorn_d1 = g->sk_d1;
    }
    int64_t *tpe = a->tokens_per_expert->data;
    float *probs = (float *)a->topk_probs->data;
    GPU_TRY(moert_router_cuda_forward_ext(
        h, stream, &rp, &ext, g->logits, g->cfg.use_expert_bias ? g->owner->bias : NULL, g->sel_idx, probs, tpe, NULL));
    if (T == 0) return MOERT_OK;
    const int32_t *out = g->sel_idx;
    if (g->capacity) {
        const router_params *p = &g->cfg.params;
        GPU_TRY(ensure_capacity_buffers(g, T));
        GPU_CUDA(g, cudaMemcpyAsync(g->kept_idx, g->sel_idx, (size_t)(T * K) * sizeof(int32_t),
                                    cudaMemcpyDeviceToDevice, stream));
        GPU_TRY(moert_router_cuda_capacity(h, stream, T, K, E, router_cpu_capacity(T, K, E, p->capacity_factor),
                                           p->drop_policy == ROUTER_DROP_POSITION ? 1 : 0, p->pad_to_capacity ? 1 : 0,
                                           g->sel_idx, g->kept_idx, probs, g->kept_counts, tpe, g->cap_scratch));
        out = g->kept_idx;
    }
    GPU_CUDA(g, cudaMemcpyAsync(a->topk_idx->data, out, (size_t)(T * K) * sizeof(int32_t), cudaMemcpyDeviceToDevice,
                                stream));
    return MOERT_OK;
}

moert_result router_gpu_forward(router_gpu *g, moert_stream s, const moert_router_forward_args *a, int64_t seq_length,
                                uint64_t call, double jitter_eps, bool defer_losses, bool count_for_bias)
{
    cudaStream_t stream = (cudaStream_t)s;
    const moert_host *h = g->host;
    int64_t T = a->x->shape[0], E = g->num_experts;
    int64_t *tpe = a->tokens_per_expert->data;
    g->fwd_aux = false;
    g->fwd_jitter_eps = jitter_eps;
    GPU_TRY(check_dtype(g, "forward", "x", a->x, true));
    GPU_TRY(check_dtype(g, "forward", "weight", a->weight, false));
    GPU_TRY(check_dtype(g, "forward", "topk_probs", a->topk_probs, false));
    if (g->cfg.params.balancing == ROUTER_BALANCE_SEQ_AUX_LOSS && g->aux_on && seq_length > 0 && T % seq_length != 0) {
        h->set_error(h,
                     "router '%s' forward: seq_aux_loss needs whole sequences: seq_length %lld does not divide the "
                     "%lld tokens",
                     g->cfg.name, (long long)seq_length, (long long)T);
        return MOERT_ERR_INVALID_ARGUMENT;
    }
    if (T > INT32_MAX)
        return gpu_fail(g, MOERT_ERR_UNSUPPORTED, "forward: %lld tokens (at most %d)", (long long)T, INT32_MAX);
    GPU_TRY(ensure_token_buffers(g, T));

    /* logits in the compute dtype (jittered x, random logits), then the selection, probs and counts */
    if (T > 0) GPU_TRY(forward_logits(g, stream, a, T, call));
    GPU_TRY(forward_route(g, stream, a, T));
    /* the bias follows the copies really kept by training forwards, never the padding nor an inference forward's */
    if (g->cfg.use_expert_bias && count_for_bias)
        GPU_TRY(moert_router_cuda_add_counts(h, stream, E, g->capacity && T > 0 ? g->kept_counts : tpe,
                                             g->owner->bias_counts));

    /* losses */
    if (g->aux_on) GPU_TRY(forward_aux(g, stream, T, seq_length));
    return forward_losses(g, stream, T, a->tokens_per_expert, a->losses, defer_losses);
}

/* ---- backward ---- */

/* bf16x3's backward from d_logits: d_logits split into planes; d_weight += the three partial dW; d_x += W_hi d_hi +
 * W_mid d_hi + W_hi d_mid in one GEMM along K = 3E into the fp32 scratch, then added (W has not changed since forward). */
static moert_result backward_x3(router_gpu *g, cudaStream_t stream, const moert_router_backward_args *a, int64_t T)
{
    const moert_host *h = g->host;
    const int64_t H = g->hidden, E = g->num_experts;
    static const int terms[3] = {0, 1, 2}, w_pair_terms[3] = {0, 1, 0}, dl_pair_terms[3] = {0, 0, 1};
    if (a->d_x->dtype != MOERT_BF16)
        return gpu_fail(g, MOERT_ERR_UNSUPPORTED, "backward: d_x is %s; gemm bf16x3 takes a bf16 d_x",
                        moert_dtype_name(a->d_x->dtype));
    GPU_TRY(ensure_x3_buffers(g, T));
    GPU_TRY(ensure_x32(g, T));
    g->x32_source = NULL; /* x32 becomes the d_x scratch */
    GPU_TRY(moert_router_cuda_split_bf16(h, stream, T, E, terms, g->d_logits, g->dl_planes));
    GPU_TRY(gemm_run_ld(g, stream, GEMM_WGRAD_X3, H, X3_PLANES * E, T, a->x->data, g->dl_planes, 0, g->partial, 0));
    GPU_TRY(moert_router_cuda_sum_planes(h, stream, 1, E * H, X3_PLANES, 1, g->partial, (float *)a->d_weight->data));
    GPU_TRY(
        moert_router_cuda_split_bf16(h, stream, 1, E * H, w_pair_terms, (const float *)a->weight->data, g->w_pairs));
    GPU_TRY(moert_router_cuda_split_bf16(h, stream, T, E, dl_pair_terms, g->d_logits, g->dl_pairs));
    GPU_TRY(gemm_run_ld(g, stream, GEMM_DGRAD_X3, H, T, X3_PLANES * E, g->w_pairs, g->dl_pairs, 0, g->x32, 0));
    GPU_TRY(moert_router_cuda_accumulate(h, stream, MOERT_BF16, T * H, g->x32, a->d_x->data));
    return MOERT_OK;
}

/* The linear layer's backward in fp64 (compute_dtype fp64), or in fp32 on the jittered x: x and W converted again as
 * the forward did (same noise), the products into scratch, then added to d_weight and (times the noise) to d_x. */
static moert_result backward_converted(router_gpu *g, cudaStream_t stream, const moert_router_backward_args *a,
                                       int64_t T, uint64_t call)
{
    const moert_host *h = g->host;
    const int64_t H = g->hidden, E = g->num_experts;
    const moert_router_cuda_noise jitter = noise_of(g->cfg.jitter_key, call, g->fwd_jitter_eps);
    const moert_router_cuda_noise *noise = g->jitter ? &jitter : NULL;
    GPU_TRY(ensure_xc(g, T));
    GPU_TRY(moert_router_cuda_convert(h, stream, a->x->dtype, T, H, a->x->data, noise, g->xc, g->f64));
    if (g->f64) {
        GPU_TRY(moert_router_cuda_convert(h, stream, MOERT_F32, E, H, a->weight->data, NULL, g->w64, 1));
        GPU_TRY(gemm_run_ld(g, stream, GEMM_WGRAD_F64, H, E, T, g->xc, g->d_logits, 0, g->dw64, 0));
        GPU_TRY(moert_router_cuda_accumulate_ext(h, stream, MOERT_F32, E, H, g->dw64, 1, NULL, a->d_weight->data));
        GPU_TRY(gemm_run_ld(g, stream, GEMM_DGRAD_F64, H, T, E, g->w64, g->d_logits, 0, g->dx64, 0));
        GPU_TRY(moert_router_cuda_accumulate_ext(h, stream, a->d_x->dtype, T, H, g->dx64, 1, noise, a->d_x->data));
        return MOERT_OK;
    }
    GPU_TRY(gemm_run(g, stream, GEMM_WGRAD, H, E, T, g->xc, g->d_logits, (float *)a->d_weight->data, 1));
    GPU_TRY(ensure_x32(g, T));
    g->x32_source = NULL; /* the d_x product goes there */
    GPU_TRY(gemm_run(g, stream, GEMM_DGRAD, H, T, E, (const float *)a->weight->data, g->d_logits, g->x32, 0));
    GPU_TRY(moert_router_cuda_accumulate_ext(h, stream, a->d_x->dtype, T, H, g->x32, 0, noise, a->d_x->data));
    return MOERT_OK;
}

moert_result router_gpu_backward(router_gpu *g, moert_stream s, const moert_router_backward_args *a, int64_t T,
                                 uint64_t call)
{
    cudaStream_t stream = (cudaStream_t)s;
    const moert_host *h = g->host;
    int64_t H = g->hidden, E = g->num_experts;
    GPU_TRY(check_dtype(g, "backward", "x", a->x, true));
    GPU_TRY(check_dtype(g, "backward", "weight", a->weight, false));
    GPU_TRY(check_dtype(g, "backward", "d_topk_probs", a->d_topk_probs, false));
    GPU_TRY(check_dtype(g, "backward", "d_x", a->d_x, true));
    GPU_TRY(check_dtype(g, "backward", "d_weight", a->d_weight, false));
    if (T == 0) return MOERT_OK;

    /* d_logits: through the probs (overwrites; copies dropped by capacity get none), then the losses (adds), times
     * loss_scale; with force_load_balancing these are the random logits' gradients, handed on unchanged */
    moert_router_cuda_params rp = route_params(g, T);
    moert_router_cuda_route_ext ext;
    memset(&ext, 0, sizeof ext);
    ext.logits_f64 = g->f64;
    ext.kept_idx = g->capacity ? g->kept_idx : NULL;
    GPU_TRY(moert_router_cuda_backward_ext(h, stream, &rp, &ext, g->logits, g->sel_idx,
                                           (const float *)a->d_topk_probs->data, g->d_logits, 0));
    double z_grad = g->z_on ? a->loss_scale * 2.0 * g->cfg.z_loss_coeff / (double)T : 0.0;
    if (g->fwd_aux || z_grad != 0.0) {
        moert_router_cuda_loss_params lp = loss_params(g, T, g->fwd_aux ? g->fwd_aux_seq : T);
        GPU_TRY(moert_router_cuda_loss_backward(h, stream, &lp, g->logits, g->fwd_aux ? g->aux_f : NULL, g->aux_scale,
                                                a->loss_scale, z_grad, g->d_logits));
    }

    if (g->f64 || g->jitter) return backward_converted(g, stream, a, T, call);
    if (g->x3) return backward_x3(g, stream, a, T);

    /* d_weight += d_logits^T x (fp32, beta 1) */
    const float *x32 = NULL;
    GPU_TRY(x_as_f32(g, stream, a->x, T, false, &x32));
    GPU_TRY(gemm_run(g, stream, GEMM_WGRAD, H, E, T, x32, g->d_logits, (float *)a->d_weight->data, 1));

    /* d_x += d_logits W: straight into an fp32 d_x; through the fp32 scratch and an add for bf16 */
    const float *w = (const float *)a->weight->data;
    if (a->d_x->dtype == MOERT_F32) {
        GPU_TRY(gemm_run(g, stream, GEMM_DGRAD, H, T, E, w, g->d_logits, (float *)a->d_x->data, 1));
    } else {
        GPU_TRY(ensure_x32(g, T));
        g->x32_source = NULL; /* overwritten below (after the WGRAD above has read it: stream order) */
        GPU_TRY(gemm_run(g, stream, GEMM_DGRAD, H, T, E, w, g->d_logits, g->x32, 0));
        GPU_TRY(moert_router_cuda_accumulate(h, stream, a->d_x->dtype, T * H, g->x32, a->d_x->data));
    }
    return MOERT_OK;
}

/* ---- end_step and the bias ---- */

moert_result router_gpu_end_step(router_gpu *g, moert_stream s)
{
    cudaStream_t stream = (cudaStream_t)s;
    const moert_host *h = g->host;
    int64_t E = g->num_experts;
    if (g->owner != g) return MOERT_OK; /* a twin: the slot-0 instance owns the step state */
    if (g->cfg.use_expert_bias) {
        if (g->world_size > 1) GPU_TRY(h->allreduce_sum(h, g->bias_counts, (size_t)E, MOERT_I64, g->device, stream));
        GPU_TRY(moert_router_cuda_bias_update(h, stream, E, g->bias_counts, g->cfg.bias_update_rate, g->bias));
    }
    GPU_CUDA(g, cudaMemsetAsync(g->global_sum, 0, (size_t)E * sizeof(double), stream));
    g->global_forwards = 0;
    return MOERT_OK;
}

const moert_tensor *router_gpu_expert_bias(router_gpu *g)
{
    return g->cfg.use_expert_bias ? &g->owner->bias_tensor : NULL;
}
