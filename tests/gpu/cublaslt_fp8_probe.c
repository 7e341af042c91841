/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Probe of cuBLASLt's blockwise FP8 matmuls on this GPU (not a test: built with CUDA only, run by hand or by
 * plugins/precision_fp8/gpu_check.sh). Part 1 asks cublasLtMatmulAlgoGetHeuristic for a grid of variants (which
 * operand carries the 128x128 blocks, FP8 types, fast accumulation, D type, workspace, D order, shapes) and prints
 * a table of which are accepted. Part 2 runs accepted TN matmuls (VEC128 x BLK128x128, BLK128x128 x VEC128,
 * VEC128 x VEC128) on random FP8 data and compares D with a double-precision reference under each scale-tensor
 * layout the fp8 plugin knows, printing the error of each (the layout cuBLASLt reads has an error ~1e-6).
 *
 *   cublaslt_fp8_probe [short]    exit 0 when it ran, 77 without an sm_90+ GPU, 1 on a CUDA/cuBLASLt error
 *
 * "short" (a few seconds; what plugins/precision_fp8/gpu_check.sh runs): only the settings the fp8 plugin uses (no
 * fast accumulation, 32 MiB workspace, column-major D) for the row counts of its padding (37 and 743 rows against
 * 48 and 752, their multiples of 16; WGRAD reductions of 144 and 752 rows), and the numbers of one shape per order.
 *
 * Conventions (as in precision_fp8_cuda.h): both operands stored row-major [X][k] (cuBLASLt: A is k x m with
 * ld k and TRANSA = T, B is k x n with ld k, TRANSB = N); D is m x n column-major. Scale factor of element
 * (x, p) of an operand with X rows and KB = ceil(k / 128) blocks:
 *   VEC128 layout 0: x + (p/128) * X          layout 1: (p/128) + x * KB
 *   BLK128x128 layout 0: kb + xb * round_up(KB, 4)   1: xb + kb * round_up(XB, 4)   2: kb + xb * KB   3: xb + kb * XB
 */
#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define WS_BYTES ((size_t)32 << 20)

/* A CUDA or cuBLASLt call of the probe's own scaffolding: a failure ends the probe. */
#define CK(call)                                                                                                       \
    do {                                                                                                               \
        cudaError_t e_ = (call);                                                                                       \
        if (e_ != cudaSuccess) {                                                                                       \
            fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));              \
            exit(1);                                                                                                   \
        }                                                                                                              \
    } while (0)
#define LT(call)                                                                                                       \
    do {                                                                                                               \
        cublasStatus_t s_ = (call);                                                                                    \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                                                             \
            fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #call, cublasLtGetStatusString(s_));         \
            exit(1);                                                                                                   \
        }                                                                                                              \
    } while (0)

enum {
    M_SCALAR = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F,
    M_VEC = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F,
    M_BLK = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
};

static int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
static int64_t rup(int64_t a, int64_t b) { return cdiv(a, b) * b; }

static const char *mode_str(int m) { return m == M_VEC ? "vec128" : m == M_BLK ? "blk128" : "scalar"; }
static const char *type_str(cudaDataType_t t)
{
    return t == CUDA_R_8F_E4M3 ? "e4m3" : t == CUDA_R_8F_E5M2 ? "e5m2" : t == CUDA_R_16BF ? "bf16" : "fp32";
}

/* One matmul variant. fast: -1 unset, 0, 1. */
typedef struct variant {
    int a_mode, b_mode;
    cudaDataType_t a_type, b_type, d_type;
    int fast, d_row_order;
    size_t ws;
    int64_t m, n, k;
} variant;

/* Device floats that every descriptor's A and B scale pointers name until part 2 sets real ones: cuBLASLt 13
 * answers CUBLAS_STATUS_INVALID_VALUE to a heuristic query for VEC128 / BLK128x128 modes without scale pointers
 * (the first probe run, which set none, saw every blockwise variant refused that way). */
static void *dummy_scales;
#define DUMMY_SCALE_BYTES ((size_t)16 << 20)

/* Descriptor and layouts of v (caller destroys). */
static void make_desc(const variant *v, cublasLtMatmulDesc_t *desc, cublasLtMatrixLayout_t lay[3])
{
    LT(cublasLtMatmulDescCreate(desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    LT(cublasLtMatmulDescSetAttribute(*desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    LT(cublasLtMatmulDescSetAttribute(*desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    if (v->fast >= 0) {
        const int8_t f = (int8_t)v->fast;
        LT(cublasLtMatmulDescSetAttribute(*desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &f, sizeof f));
    }
    const int32_t am = v->a_mode, bm = v->b_mode;
    LT(cublasLtMatmulDescSetAttribute(*desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &am, sizeof am));
    LT(cublasLtMatmulDescSetAttribute(*desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &bm, sizeof bm));
    LT(cublasLtMatmulDescSetAttribute(*desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &dummy_scales, sizeof dummy_scales));
    LT(cublasLtMatmulDescSetAttribute(*desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &dummy_scales, sizeof dummy_scales));
    LT(cublasLtMatrixLayoutCreate(&lay[0], v->a_type, (uint64_t)v->k, (uint64_t)v->m, v->k));
    LT(cublasLtMatrixLayoutCreate(&lay[1], v->b_type, (uint64_t)v->k, (uint64_t)v->n, v->k));
    const int64_t ldd = v->d_row_order ? v->n : rup(v->m, 16);
    LT(cublasLtMatrixLayoutCreate(&lay[2], v->d_type, (uint64_t)v->m, (uint64_t)v->n, ldd));
    if (v->d_row_order) {
        const int32_t order = CUBLASLT_ORDER_ROW;
        LT(cublasLtMatrixLayoutSetAttribute(lay[2], CUBLASLT_MATRIX_LAYOUT_ORDER, &order, sizeof order));
    }
}

/* Whether the heuristic offers an algorithm for v (and the status it returned); *algo gets the first. */
static int accepted(cublasLtHandle_t lt, const variant *v, cublasStatus_t *status, cublasLtMatmulAlgo_t *algo)
{
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t lay[3];
    make_desc(v, &desc, lay);
    cublasLtMatmulPreference_t pref;
    LT(cublasLtMatmulPreferenceCreate(&pref));
    const uint64_t ws = v->ws;
    LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
    cublasLtMatmulHeuristicResult_t res;
    memset(&res, 0, sizeof res);
    int found = 0;
    *status = cublasLtMatmulAlgoGetHeuristic(lt, desc, lay[0], lay[1], lay[2], lay[2], pref, 1, &res, &found);
    if (algo && found > 0) *algo = res.algo;
    cublasLtMatmulPreferenceDestroy(pref);
    for (int i = 0; i < 3; i++) cublasLtMatrixLayoutDestroy(lay[i]);
    cublasLtMatmulDescDestroy(desc);
    return *status == CUBLAS_STATUS_SUCCESS && found > 0;
}

/* ---- part 2: numbers ---- */

/* Value of an E4M3 byte (never NaN here) or an E5M2 byte. */
static double fp8_value(uint8_t b, int e5m2)
{
    const int sign = b >> 7;
    int e, mnt;
    double v;
    if (e5m2) {
        e = (b >> 2) & 31, mnt = b & 3;
        v = e ? ldexp(1.0 + mnt / 4.0, e - 15) : ldexp(mnt / 4.0, -14);
    } else {
        e = (b >> 3) & 15, mnt = b & 7;
        v = e ? ldexp(1.0 + mnt / 8.0, e - 7) : ldexp(mnt / 8.0, -6);
    }
    return sign ? -v : v;
}

/* A random finite FP8 byte of moderate magnitude (|x| in about [2^-3, 2^3]). */
static uint8_t random_fp8(int e5m2)
{
    const int sign = rand() & 1, mnt = rand() & (e5m2 ? 3 : 7);
    const int e = (e5m2 ? 15 : 7) - 3 + rand() % 7;
    return (uint8_t)((sign << 7) | (e5m2 ? (e << 2) | mnt : (e << 3) | mnt));
}

/* Scale factor of element (x, p) of an operand under a layout (see the header comment). */
static double factor(const float *s, int mode, int layout, int64_t x, int64_t p, int64_t X, int64_t k)
{
    const int64_t KB = cdiv(k, 128), XB = cdiv(X, 128), kb = p / 128, xb = x / 128;
    if (mode == M_VEC) return s[layout == 0 ? x + kb * X : kb + x * KB];
    switch (layout) {
    case 0: return s[kb + xb * rup(KB, 4)];
    case 1: return s[xb + kb * rup(XB, 4)];
    case 2: return s[kb + xb * KB];
    default: return s[xb + kb * XB];
    }
}

/* Runs variant v (fp32 or bf16 D, column-major) on random data and prints its error under each layout pair. */
static void run_numbers(cublasLtHandle_t lt, const variant *v, cudaStream_t stream)
{
    const int64_t m = v->m, n = v->n, k = v->k;
    const int a5 = v->a_type == CUDA_R_8F_E5M2, b5 = v->b_type == CUDA_R_8F_E5M2;
    uint8_t *ha = malloc((size_t)(m * k)), *hb = malloc((size_t)(n * k));
    const int64_t sa_n = rup(m, 512) * rup(cdiv(k, 128), 4), sb_n = rup(n, 512) * rup(cdiv(k, 128), 4);
    float *sa = malloc((size_t)sa_n * 4), *sb = malloc((size_t)sb_n * 4);
    for (int64_t i = 0; i < m * k; i++) ha[i] = random_fp8(a5);
    for (int64_t i = 0; i < n * k; i++) hb[i] = random_fp8(b5);
    for (int64_t i = 0; i < sa_n; i++) sa[i] = ldexpf(1.0f + (float)(rand() % 64) / 64.0f, rand() % 7 - 3);
    for (int64_t i = 0; i < sb_n; i++) sb[i] = ldexpf(1.0f + (float)(rand() % 64) / 64.0f, rand() % 7 - 3);
    void *da, *db, *dsa, *dsb, *dd, *ws;
    const int64_t ldd = rup(m, 16);
    const size_t des = v->d_type == CUDA_R_32F ? 4 : 2;
    CK(cudaMalloc(&da, (size_t)(m * k)));
    CK(cudaMalloc(&db, (size_t)(n * k)));
    CK(cudaMalloc(&dsa, (size_t)sa_n * 4));
    CK(cudaMalloc(&dsb, (size_t)sb_n * 4));
    CK(cudaMalloc(&dd, (size_t)(ldd * n) * des));
    CK(cudaMalloc(&ws, WS_BYTES));
    CK(cudaMemcpy(da, ha, (size_t)(m * k), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(db, hb, (size_t)(n * k), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dsa, sa, (size_t)sa_n * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dsb, sb, (size_t)sb_n * 4, cudaMemcpyHostToDevice));
    CK(cudaMemset(dd, 0, (size_t)(ldd * n) * des));
    cublasStatus_t st;
    cublasLtMatmulAlgo_t algo;
    if (!accepted(lt, v, &st, &algo)) {
        printf("  numbers: not accepted\n");
        goto out;
    }
    {
        cublasLtMatmulDesc_t desc;
        cublasLtMatrixLayout_t lay[3];
        make_desc(v, &desc, lay);
        LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &dsa, sizeof dsa));
        LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &dsb, sizeof dsb));
        const float alpha = 1.0f, beta = 0.0f;
        LT(cublasLtMatmul(lt, desc, &alpha, da, lay[0], db, lay[1], &beta, dd, lay[2], dd, lay[2], &algo, ws, WS_BYTES,
                          stream));
        CK(cudaStreamSynchronize(stream));
        for (int i = 0; i < 3; i++) cublasLtMatrixLayoutDestroy(lay[i]);
        cublasLtMatmulDescDestroy(desc);
    }
    {
        void *hd = malloc((size_t)(ldd * n) * des);
        CK(cudaMemcpy(hd, dd, (size_t)(ldd * n) * des, cudaMemcpyDeviceToHost));
        const int la_count = v->a_mode == M_VEC ? 2 : 4, lb_count = v->b_mode == M_VEC ? 2 : 4;
        double *va = malloc((size_t)(m * k) * sizeof(double)), *vb = malloc((size_t)(n * k) * sizeof(double));
        for (int64_t i = 0; i < m * k; i++) va[i] = fp8_value(ha[i], a5);
        for (int64_t i = 0; i < n * k; i++) vb[i] = fp8_value(hb[i], b5);
        double best = INFINITY;
        int best_la = -1, best_lb = -1;
        for (int la = 0; la < la_count; la++)
            for (int lb = 0; lb < lb_count; lb++) {
                double num = 0, den = 0;
                for (int64_t j = 0; j < n; j++)
                    for (int64_t i = 0; i < m; i++) {
                        double ref = 0;
                        for (int64_t p = 0; p < k; p++)
                            ref += va[i * k + p] * factor(sa, v->a_mode, la, i, p, m, k) * vb[j * k + p] *
                                   factor(sb, v->b_mode, lb, j, p, n, k);
                        double got;
                        if (des == 4) {
                            got = ((const float *)hd)[j * ldd + i];
                        } else {
                            const uint32_t bits = (uint32_t)((const uint16_t *)hd)[j * ldd + i] << 16;
                            float f;
                            memcpy(&f, &bits, 4);
                            got = f;
                        }
                        num += (got - ref) * (got - ref);
                        den += ref * ref;
                    }
                const double err = sqrt(num / (den > 0 ? den : 1));
                printf("  numbers: A layout %d, B layout %d: relative error %.3g\n", la, lb, err);
                if (err < best) best = err, best_la = la, best_lb = lb;
            }
        printf("  numbers: best A layout %d, B layout %d (error %.3g)%s\n", best_la, best_lb, best,
               best < (des == 4 ? 1e-5 : 5e-3) ? "" : "  <- no layout matches");
        free(hd), free(va), free(vb);
    }
out:
    cudaFree(da), cudaFree(db), cudaFree(dsa), cudaFree(dsb), cudaFree(dd), cudaFree(ws);
    free(ha), free(hb), free(sa), free(sb);
}

int main(int argc, char **argv)
{
    const int short_run = argc > 1 && strcmp(argv[1], "short") == 0;
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        printf("cublaslt_fp8_probe: no CUDA device, skipped\n");
        return 77;
    }
    struct cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("device: %s (sm_%d%d), cuBLASLt %zu, CUDA runtime %zu\n", prop.name, prop.major, prop.minor,
           cublasLtGetVersion(), cublasLtGetCudartVersion());
    if (prop.major < 9) {
        printf("cublaslt_fp8_probe: no FP8 tensor cores, skipped\n");
        return 77;
    }
    cublasLtHandle_t lt;
    LT(cublasLtCreate(&lt));
    CK(cudaMalloc(&dummy_scales, DUMMY_SCALE_BYTES));
    CK(cudaMemset(dummy_scales, 0, DUMMY_SCALE_BYTES));
    cudaStream_t stream;
    CK(cudaStreamCreate(&stream));

    /* part 1: the heuristic over a grid. Orders: the "weight" (X = wdim rows) and the "activation" (X = rows). */
    static const struct {
        int a_mode, b_mode;
        const char *name;
    } orders[] = {
        {M_BLK, M_VEC, "A=weight blk128x128, B=act vec128"},
        {M_VEC, M_BLK, "A=act vec128, B=weight blk128x128"},
        {M_VEC, M_VEC, "A vec128, B vec128"},
        {M_SCALAR, M_SCALAR, "A scalar, B scalar"},
    };
    static const int64_t shapes[][3] = {{256, 512, 256},   {256, 37, 256},  {4096, 743, 7168},
                                        {7168, 512, 2048}, {256, 144, 256}, {4096, 768, 7168}};
    /* short: the plugin's padded shapes ({weight rows, activation rows, k}); for A vec128 x B vec128 (WGRAD) the
     * activation rows are the reduction k (the last two) */
    static const int64_t short_shapes[][3] = {{256, 37, 256},    {256, 48, 256},    {4096, 743, 7168},
                                              {4096, 752, 7168}, {7168, 2048, 144}, {7168, 2048, 752}};
    const int shape_count = 6; /* either list */
    int total[4] = {0}, ok[4] = {0};
    printf("\n%-36s %-10s %-5s %-5s %-4s %-5s %-4s %6s %6s %6s  %s\n", "order", "types", "D", "fast", "ws", "Dord", "",
           "m", "n", "k", "result");
    for (int o = 0; o < 4; o++)
        for (int t = 0; t < 2; t++) /* activation e4m3 / e5m2 */
            for (int s = 0; s < shape_count; s++)
                for (int wdims = 0; wdims < 2; wdims++) /* weight rows as given, or swapped with the rows */
                    for (int dt = 0; dt < 2; dt++)
                        for (int fast = -1; fast <= 1; fast++)
                            for (int ws = 0; ws < 2; ws++)
                                for (int dro = 0; dro < 2; dro++) {
                                    /* keep the grid readable: vary one of fast / ws / D order at a time */
                                    if ((fast != 0) + (ws != 1) + (dro != 0) > 1) continue;
                                    /* short: the plugin's settings, its shapes (k for WGRAD only), no scalar order */
                                    if (short_run &&
                                        (fast != 0 || ws != 1 || dro != 0 || wdims || o == 3 || (o == 2) != (s >= 4)))
                                        continue;
                                    variant v;
                                    memset(&v, 0, sizeof v);
                                    v.a_mode = orders[o].a_mode, v.b_mode = orders[o].b_mode;
                                    const int act_is_a = o == 1;
                                    const cudaDataType_t act = t ? CUDA_R_8F_E5M2 : CUDA_R_8F_E4M3;
                                    v.a_type = act_is_a ? act : CUDA_R_8F_E4M3;
                                    v.b_type = act_is_a ? CUDA_R_8F_E4M3 : act;
                                    v.d_type = dt ? CUDA_R_32F : CUDA_R_16BF;
                                    v.fast = fast, v.ws = ws ? WS_BYTES : 0, v.d_row_order = dro;
                                    const int64_t(*sh)[3] = short_run ? short_shapes : shapes;
                                    const int64_t wdim = sh[s][0], rows = sh[s][1];
                                    if (wdims && wdim == rows) continue;
                                    /* weight side: wdim; activation side: rows (wdims: the other way round) */
                                    const int64_t w_x = wdims ? rows : wdim, a_x = wdims ? wdim : rows;
                                    v.m = act_is_a ? a_x : w_x, v.n = act_is_a ? w_x : a_x, v.k = sh[s][2];
                                    cublasStatus_t st;
                                    const int acc = accepted(lt, &v, &st, NULL);
                                    total[o]++, ok[o] += acc;
                                    char types[16];
                                    snprintf(types, sizeof types, "%sx%s", type_str(v.a_type), type_str(v.b_type));
                                    printf("%-36s %-10s %-5s %-5s %-4s %-5s %-4s %6lld %6lld %6lld  %s%s%s\n",
                                           orders[o].name, types, type_str(v.d_type),
                                           fast < 0 ? "unset"
                                           : fast   ? "1"
                                                    : "0",
                                           ws ? "32M" : "0", dro ? "row" : "col", "", (long long)v.m, (long long)v.n,
                                           (long long)v.k, acc ? "ACCEPTED" : "refused",
                                           st != CUBLAS_STATUS_SUCCESS ? " status " : "",
                                           st != CUBLAS_STATUS_SUCCESS ? cublasLtGetStatusString(st) : "");
                                }
    printf("\nsummary:\n");
    for (int o = 0; o < 4; o++) printf("  %-36s %d of %d variants accepted\n", orders[o].name, ok[o], total[o]);

    /* part 2: numbers of one variant per order (default settings: fast accumulation 0, 32 MiB workspace) */
    static const int64_t num_shapes[][3] = {{256, 384, 384}, {144, 256, 384}};
    for (int o = 0; o < 3; o++)
        for (int s = short_run ? 1 : 0; s < 2; s++)
            for (int dt = short_run ? 1 : 0; dt < 2; dt++) {
                variant v;
                memset(&v, 0, sizeof v);
                v.a_mode = orders[o].a_mode, v.b_mode = orders[o].b_mode;
                v.a_type = CUDA_R_8F_E4M3, v.b_type = CUDA_R_8F_E4M3;
                v.d_type = dt ? CUDA_R_32F : CUDA_R_16BF;
                v.fast = 0, v.ws = WS_BYTES;
                v.m = num_shapes[s][0], v.n = num_shapes[s][1], v.k = num_shapes[s][2];
                printf("\nnumbers: %s, %s x %s -> %s, m=%lld n=%lld k=%lld\n", orders[o].name, mode_str(v.a_mode),
                       mode_str(v.b_mode), type_str(v.d_type), (long long)v.m, (long long)v.n, (long long)v.k);
                run_numbers(lt, &v, stream);
            }
    cudaStreamDestroy(stream);
    cublasLtDestroy(lt);
    return 0;
}
