/* SPDX-License-Identifier: Apache-2.0 */
/* GPU test of the blockwise FP8 grouped GEMM kernel (plugins/precision_fp8/fp8_block_gemm.cu) against a
 * double-precision reference computed here from the same FP8 bytes and factors (fp8_convert.c decodes them):
 * - forward/dgrad form: groups of 37, 300, 0, 129 and 16 rows sharing one A matrix at 16-row aligned offsets, B
 *   the experts' weights stacked, n 192 and k 320 (a partial output tile and a partial k-block), 128x128 B factors,
 *   bf16 and fp32 outputs; rows and columns outside each group's m x n must keep their poison.
 * - wgrad form: each group its own A and B matrices (k 48, 272, 128: a reduction shorter than one block, a partial
 *   block), 1x128 factors on both operands, fp32 D accumulated onto stale values, and overwritten.
 * - every format pair the recipes use (E4M3 x E4M3, E5M2 x E4M3, E4M3 x E5M2).
 * - the deepseek-v3 fc1 forward shape (8 groups of 500..520 rows, k 7168, n 4096) on 4096 sampled outputs.
 * - refusals: two E5M2 operands, an odd n, a group naming a missing matrix, a cluster size of 3.
 * - k-block counts of 1, 2, 3, 4 and 56 (the forward form's main loop takes blocks in pairs, then a last odd one),
 *   groups of 64 rows or fewer (the second consumer skips its wgmma) and an odd number of column blocks (the
 *   second CTA of a pair has no columns and only loads its half of A).
 * - all of it eight times: CTA pairs sharing an operand by TMA multicast (neighbouring column blocks sharing A;
 *   with wide tiles, neighbouring row blocks sharing B, and a group's odd last row block along N) or single CTAs, each
 *   with the TMA epilogue (D's row stride a multiple of 16 bytes; "odd ldd" cases are stored from registers even
 *   then) and the register one, each with the forward form's bf16 D in 128 x 256 tiles (n 128, 192, 384, 640: a
 *   wide tile with one live column block or a partial second one; an odd number of wide tiles) and in 128 x 128.
 * - refusal of an output tile width other than 128 or 256.
 * - every case again with the work units handed out (moert_fp8_block_gemm.sm_yield and work_counter, the micro-batch
 *   overlap's way of leaving SMs to a dispatcher), the word in turn 0, 24 and past the grid (every cluster but the
 *   first stops at once), twice on one counter pair: D the same bit for bit as the static schedule's.
 * Per output the error bound is 5e-4 of the sum of |terms| plus, for bf16, one bf16 rounding: Hopper's FP8 tensor
 * cores sum a k-block's products with about 14 bits (the reason the recipe promotes every 128 to fp32 registers);
 * the first H100 run measured up to 1.6e-4. A wrong factor, row or column is off by the order of the terms.
 * Exits 77 without a compute capability 9.0 GPU. */
#include "test_util.h"

#ifndef MOERT_HAVE_CUDA

int main(void)
{
    printf("gpu_fp8_block_gemm: built without CUDA, skipped\n");
    return TEST_SKIP;
}

#else

#include <stdint.h>

#include "fp8_block_gemm.h"
#include "fp8_convert.h"
#include "gpu_test_util.h"

#define MAXG   8
#define POISON 12345.0f

/* The handed-out schedule's device words: [0] sm_yield, [1..2] the work counter pair (zero between launches). */
static int32_t *yield_words;
static int yield_turn; /* which word the next case's handed-out runs set: 0, 24, past the grid */

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static double uniform(void)
{
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (double)(rng >> 11) / 9007199254740992.0;
}

/* Random FP8 bytes of a format (values of magnitude up to ~4, no NaN). */
static void fill_fp8(uint8_t *p, int64_t n, int fmt)
{
    for (int64_t i = 0; i < n; i++) p[i] = fp8_from_float((float)((uniform() * 2 - 1) * 4), (fp8_format)fmt);
}

/* Factors 2^e * (1 + u/2), e in -3..3, as a recipe's dequantization factors would be (not all powers of two). */
static void fill_factors(float *p, int64_t n)
{
    for (int64_t i = 0; i < n; i++) p[i] = ldexpf((float)(1 + uniform() / 2), (int)(uniform() * 7) - 3);
}

static float bf16_to_float(uint16_t b)
{
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static uint16_t float_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

/* A host-side case: matrices and groups with host copies of everything, D poisoned. */
typedef struct matrix_h {
    uint8_t *bytes;
    int64_t rows, cols, ld;
    int fmt;
    void *dev;
} matrix_h;

typedef struct case_spec {
    const char *name;
    int a_fmt, b_fmt, b_per_row, d_bf16, accumulate;
    int groups;
    int64_t m[MAXG], n, k;
    int shared;  /* 1: forward form (one A of stacked rows, one B of stacked weights); 0: wgrad form */
    int samples; /* 0: every output; else this many random outputs per group */
    int odd_ldd; /* 1: D's row stride is not a multiple of 16 bytes (no tensor map: stored from registers) */
} case_spec;

/* The reference value of D[r][c] of group g and the sum of its terms' magnitudes. */
static void reference(const matrix_h *a, int64_t arow, const matrix_h *b, int64_t brow, int64_t k, const float *sa,
                      int64_t sa_stride, const float *sb, int64_t sb_stride, int per_row, int64_t r, int64_t c,
                      double *value, double *mag)
{
    double v = 0, m = 0;
    for (int64_t kb = 0; kb * 128 < k; kb++) {
        const double f = (double)sa[r + kb * sa_stride] *
                         (double)(per_row ? sb[c + kb * sb_stride] : sb[kb + (c / 128) * sb_stride]);
        double block = 0, bmag = 0;
        for (int64_t p = kb * 128; p < k && p < (kb + 1) * 128; p++) {
            const double x = fp8_to_float(a->bytes[(arow + r) * a->ld + p], (fp8_format)a->fmt);
            const double y = fp8_to_float(b->bytes[(brow + c) * b->ld + p], (fp8_format)b->fmt);
            block += x * y;
            bmag += fabs(x * y);
        }
        v += f * block;
        m += fabs(f) * bmag;
    }
    *value = v;
    *mag = m;
}

/* D's n values to the device, into *dev (allocated when NULL): as bf16 for d_bf16, d then rounded to what went. */
static void d_upload(float *d, int64_t n, int d_bf16, void **dev)
{
    const size_t bytes = (size_t)n * (d_bf16 ? 2 : 4);
    if (!*dev) CK(cudaMalloc(dev, bytes));
    if (!d_bf16) {
        CK(cudaMemcpy(*dev, d, bytes, cudaMemcpyHostToDevice));
        return;
    }
    uint16_t *h16 = (uint16_t *)calloc((size_t)n, 2);
    for (int64_t i = 0; i < n; i++) {
        h16[i] = float_to_bf16(d[i]);
        d[i] = bf16_to_float(h16[i]);
    }
    CK(cudaMemcpy(*dev, h16, bytes, cudaMemcpyHostToDevice));
    free(h16);
}

static void run_case(moert_fp8_block_ctx *ctx, const case_spec *cs)
{
    const int G = cs->groups;
    const int64_t K = cs->k, N = cs->n;
    matrix_h mats[2 * MAXG];
    int nmats = 0;
    int64_t arow[MAXG], brow[MAXG];
    int amat[MAXG], bmat[MAXG];
    if (cs->shared) {
        int64_t rows = 0;
        for (int g = 0; g < G; g++) {
            arow[g] = rows;
            rows += (cs->m[g] + 15) / 16 * 16;
            brow[g] = g * N;
            amat[g] = 0;
            bmat[g] = 1;
        }
        mats[0] = (matrix_h){NULL, rows > 0 ? rows : 16, K, K, cs->a_fmt, NULL};
        mats[1] = (matrix_h){NULL, G * N, K, K, cs->b_fmt, NULL};
        nmats = 2;
    } else {
        for (int g = 0; g < G; g++) {
            const int64_t ld = (K + 15) / 16 * 16;
            mats[nmats] = (matrix_h){NULL, cs->m[g] > 0 ? cs->m[g] : 1, K, ld, cs->a_fmt, NULL};
            mats[nmats + 1] = (matrix_h){NULL, N, K, ld, cs->b_fmt, NULL};
            amat[g] = nmats;
            bmat[g] = nmats + 1;
            arow[g] = brow[g] = 0;
            nmats += 2;
        }
    }
    moert_fp8_block_matrix dm[2 * MAXG];
    for (int i = 0; i < nmats; i++) {
        const size_t bytes = (size_t)(mats[i].rows * mats[i].ld);
        mats[i].bytes = (uint8_t *)calloc(bytes, 1);
        fill_fp8(mats[i].bytes, (int64_t)bytes, mats[i].fmt);
        mats[i].dev = gpu_upload_new(mats[i].bytes, bytes);
        dm[i] = (moert_fp8_block_matrix){mats[i].dev, mats[i].rows, mats[i].cols, mats[i].ld};
    }
    const int64_t KB = (K + 127) / 128, NB = (N + 127) / 128;
    float *sa[MAXG], *sb[MAXG], *d[MAXG];
    void *sa_dev[MAXG], *sb_dev[MAXG], *d_dev[MAXG];
    int64_t sa_stride[MAXG], sb_stride[MAXG];
    const int64_t ldd = N + (cs->odd_ldd ? 6 : 8); /* columns past n keep their poison */
    moert_fp8_block_group groups[MAXG];
    for (int g = 0; g < G; g++) {
        const int64_t m = cs->m[g];
        sa_stride[g] = m + 3;
        const int64_t na = sa_stride[g] * KB;
        sb_stride[g] = cs->b_per_row ? N + 5 : (KB + 3) / 4 * 4;
        const int64_t nb = cs->b_per_row ? sb_stride[g] * KB : sb_stride[g] * NB;
        sa[g] = (float *)calloc((size_t)na + 1, 4);
        sb[g] = (float *)calloc((size_t)nb + 1, 4);
        fill_factors(sa[g], na);
        fill_factors(sb[g], nb);
        sa_dev[g] = gpu_upload_new(sa[g], (size_t)na * 4 + 4);
        sb_dev[g] = gpu_upload_new(sb[g], (size_t)nb * 4 + 4);
        const int64_t drows = m + 2; /* rows past m keep their poison */
        d[g] = (float *)calloc((size_t)(drows * ldd), 4);
        for (int64_t i = 0; i < drows * ldd; i++) d[g][i] = cs->accumulate ? (float)(uniform() * 2 - 1) : POISON;
        d_dev[g] = NULL;
        d_upload(d[g], drows * ldd, cs->d_bf16, &d_dev[g]);
        groups[g] = (moert_fp8_block_group){amat[g],
                                            bmat[g],
                                            arow[g],
                                            brow[g],
                                            m,
                                            N,
                                            K,
                                            (const float *)sa_dev[g],
                                            sa_stride[g],
                                            (const float *)sb_dev[g],
                                            sb_stride[g],
                                            d_dev[g],
                                            ldd};
    }
    moert_fp8_block_gemm gm = {cs->a_fmt, cs->b_fmt, cs->b_per_row, cs->d_bf16, cs->accumulate, dm, nmats,
                               groups,    G,         NULL,          NULL};
    cudaStream_t stream;
    CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    const moert_result rc = moert_fp8_block_gemm_run(ctx, stream, &gm);
    if (rc != MOERT_OK) {
        fprintf(stderr, "FAIL %s: run failed: %s\n", cs->name, gpu_test_error);
        test_failures++;
    }
    CK(cudaStreamSynchronize(stream));
    CK(cudaGetLastError());
    /* the handed-out schedule from the same D: the same bits (twice, so the counter pair's reset is used) */
    const size_t d_es = cs->d_bf16 ? 2 : 4;
    void *static_d[MAXG];
    int64_t mismatched = 0;
    for (int g = 0; g < G; g++) {
        const size_t bytes = (size_t)((cs->m[g] + 2) * ldd) * d_es;
        static_d[g] = malloc(bytes);
        CK(cudaMemcpy(static_d[g], d_dev[g], bytes, cudaMemcpyDeviceToHost));
    }
    static const int32_t words[3] = {0, 24, 1 << 20};
    const int32_t word = words[yield_turn++ % 3];
    CK(cudaMemcpy(yield_words, &word, sizeof word, cudaMemcpyHostToDevice));
    for (int run = 0; run < 2 && rc == MOERT_OK; run++) {
        for (int g = 0; g < G; g++) d_upload(d[g], (cs->m[g] + 2) * ldd, cs->d_bf16, &d_dev[g]);
        moert_fp8_block_gemm handed = gm;
        handed.sm_yield = yield_words;
        handed.work_counter = yield_words + 1;
        if (moert_fp8_block_gemm_run(ctx, stream, &handed) != MOERT_OK) {
            fprintf(stderr, "FAIL %s: handed-out run failed: %s\n", cs->name, gpu_test_error);
            test_failures++;
        }
        CK(cudaStreamSynchronize(stream));
        CK(cudaGetLastError());
        for (int g = 0; g < G; g++) {
            const size_t bytes = (size_t)((cs->m[g] + 2) * ldd) * d_es;
            uint8_t *again = (uint8_t *)malloc(bytes);
            CK(cudaMemcpy(again, d_dev[g], bytes, cudaMemcpyDeviceToHost));
            mismatched += memcmp(again, static_d[g], bytes) != 0;
            free(again);
        }
    }
    int32_t counters[2] = {-1, -1};
    CK(cudaMemcpy(counters, yield_words + 1, sizeof counters, cudaMemcpyDeviceToHost));
    if (mismatched || counters[0] || counters[1]) {
        fprintf(stderr,
                "FAIL %s: handed out (sm_yield %d): %lld groups differ from the static schedule, counters %d %d\n",
                cs->name, word, (long long)mismatched, counters[0], counters[1]);
        test_failures++;
    }
    for (int g = 0; g < G; g++) free(static_d[g]);
    double worst = 0;
    int64_t bad = 0, poisoned = 0, checked = 0;
    for (int g = 0; g < G; g++) {
        const int64_t m = cs->m[g], drows = m + 2;
        float *got = (float *)calloc((size_t)(drows * ldd), 4);
        if (cs->d_bf16) {
            uint16_t *h16 = (uint16_t *)calloc((size_t)(drows * ldd), 2);
            CK(cudaMemcpy(h16, d_dev[g], (size_t)(drows * ldd) * 2, cudaMemcpyDeviceToHost));
            for (int64_t i = 0; i < drows * ldd; i++) got[i] = bf16_to_float(h16[i]);
            free(h16);
        } else {
            CK(cudaMemcpy(got, d_dev[g], (size_t)(drows * ldd) * 4, cudaMemcpyDeviceToHost));
        }
        for (int64_t r = 0; r < drows; r++)
            for (int64_t c = N; c < ldd; c++) poisoned += got[r * ldd + c] != d[g][r * ldd + c];
        for (int64_t r = m; r < drows; r++)
            for (int64_t c = 0; c < N; c++) poisoned += got[r * ldd + c] != d[g][r * ldd + c];
        const int64_t total = m * N;
        const int64_t count = cs->samples && cs->samples < total ? cs->samples : total;
        for (int64_t s = 0; s < count; s++) {
            const int64_t idx = count == total ? s : (int64_t)(uniform() * (double)total) % total;
            const int64_t r = idx / N, c = idx % N;
            double v, mag;
            reference(&mats[amat[g]], arow[g], &mats[bmat[g]], brow[g], K, sa[g], sa_stride[g], sb[g], sb_stride[g],
                      cs->b_per_row, r, c, &v, &mag);
            if (cs->accumulate) v += d[g][r * ldd + c];
            const double tol = 5e-4 * mag + 1e-6 + (cs->d_bf16 ? fabs(v) * 0x1p-8 : 0);
            const double err = fabs((double)got[r * ldd + c] - v);
            if (err / (tol > 0 ? tol : 1) > worst) worst = err / tol;
            if (!(err <= tol)) {
                if (bad < 5)
                    fprintf(stderr, "  %s group %d D[%lld][%lld] = %.8g, expected %.8g (terms %.3g)\n", cs->name, g,
                            (long long)r, (long long)c, got[r * ldd + c], v, mag);
                bad++;
            }
            checked++;
        }
        free(got);
    }
    printf("%-44s %9lld checked  worst err/tol %8.3g  %lld wrong  %lld poison changed  handed out (yield %d) %s\n",
           cs->name, (long long)checked, worst, (long long)bad, (long long)poisoned, word,
           mismatched ? "DIFFERS" : "same bits");
    if (bad || poisoned || rc != MOERT_OK) test_failures++;
    for (int g = 0; g < G; g++) {
        free(sa[g]);
        free(sb[g]);
        free(d[g]);
        CK(cudaFree(sa_dev[g]));
        CK(cudaFree(sb_dev[g]));
        CK(cudaFree(d_dev[g]));
    }
    for (int i = 0; i < nmats; i++) {
        free(mats[i].bytes);
        CK(cudaFree(mats[i].dev));
    }
    CK(cudaStreamDestroy(stream));
}

/* Refusals: the call returns an error naming the problem and launches nothing. */
static void check_refusals(moert_fp8_block_ctx *ctx)
{
    const int failures_before = test_failures;
    void *buf = NULL;
    CK(cudaMalloc(&buf, 1 << 16));
    moert_fp8_block_matrix mx = {buf, 128, 128, 128};
    moert_fp8_block_group g = {0, 0, 0, 0, 16, 16, 128, (const float *)buf, 16, (const float *)buf, 1, buf, 16};
    moert_fp8_block_gemm gm = {1, 1, 0, 0, 0, &mx, 1, &g, 1, NULL, NULL};
    EXPECT(moert_fp8_block_gemm_run(ctx, 0, &gm) == MOERT_ERR_INVALID_ARGUMENT);
    EXPECT(strstr(gpu_test_error, "two E5M2") != NULL);
    gm.a_format = gm.b_format = 0;
    g.n = 15;
    EXPECT(moert_fp8_block_gemm_run(ctx, 0, &gm) == MOERT_ERR_INVALID_ARGUMENT);
    EXPECT(strstr(gpu_test_error, "odd n") != NULL);
    g.n = 16;
    g.b_matrix = 3;
    EXPECT(moert_fp8_block_gemm_run(ctx, 0, &gm) == MOERT_ERR_INVALID_ARGUMENT);
    EXPECT(strstr(gpu_test_error, "names matrices 0 and 3 of 1") != NULL);
    printf("%-44s %s\n", "refusals", test_failures > failures_before ? "FAIL" : "ok");
    CK(cudaDeviceSynchronize());
    CK(cudaFree(buf));
}

int main(void)
{
    int count = 0, major = 0, minor = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count < 1) {
        printf("gpu_fp8_block_gemm: no GPU, skipped\n");
        return TEST_SKIP;
    }
    CK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
    CK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0));
    if (major != 9 || minor != 0) {
        printf("gpu_fp8_block_gemm: GPU of compute capability %d.%d (needs 9.0), skipped\n", major, minor);
        return TEST_SKIP;
    }
    CK(cudaMalloc((void **)&yield_words, 3 * sizeof(int32_t)));
    CK(cudaMemset(yield_words, 0, 3 * sizeof(int32_t)));
    moert_fp8_block_ctx *ctx = NULL;
    if (moert_fp8_block_ctx_create(&gpu_test_host, &ctx) != MOERT_OK) {
        fprintf(stderr, "FAIL: context: %s\n", gpu_test_error);
        return 1;
    }
    const case_spec cases[] = {
        {"forward form, e4m3 x e4m3, bf16 D", 0, 0, 0, 1, 0, 5, {37, 300, 0, 129, 16}, 192, 320, 1, 0, 0},
        {"forward form, e4m3 x e4m3, bf16 D, odd ldd", 0, 0, 0, 1, 0, 5, {37, 300, 0, 129, 16}, 192, 320, 1, 0, 1},
        {"forward form, e4m3 x e4m3, fp32 D", 0, 0, 0, 0, 0, 5, {37, 300, 0, 129, 16}, 192, 320, 1, 0, 0},
        {"dgrad form, e5m2 x e4m3, bf16 D", 1, 0, 0, 1, 0, 3, {200, 5, 131}, 256, 384, 1, 0, 0},
        {"forward form, 4 k-blocks, 3 column blocks, bf16 D", 0, 0, 0, 1, 0, 4, {130, 64, 1, 260}, 384, 512, 1, 0, 0},
        {"forward form, 5 column blocks, bf16 D", 0, 0, 0, 1, 0, 3, {64, 200, 129}, 640, 256, 1, 0, 0},
        {"forward form, one column block, bf16 D", 1, 0, 0, 1, 0, 2, {100, 30}, 128, 384, 1, 0, 0},
        {"forward form, 2 k-blocks, fp32 D added", 0, 0, 0, 0, 1, 2, {192, 65}, 256, 256, 1, 0, 0},
        {"forward form, e4m3 x e5m2, fp32 D added", 0, 1, 0, 0, 1, 2, {64, 129}, 144, 272, 1, 0, 0},
        {"wgrad form, per-row B, fp32 D added", 0, 0, 1, 0, 1, 3, {192, 70, 130}, 160, 272, 0, 0, 0},
        {"wgrad form, per-row B, fp32 D added, odd ldd", 0, 0, 1, 0, 1, 3, {192, 70, 130}, 160, 272, 0, 0, 1},
        {"wgrad form, per-row B, k 48, fp32 D written", 0, 1, 1, 0, 0, 2, {128, 256}, 128, 48, 0, 0, 0},
        {"wgrad form, e5m2 x e4m3, k 128, bf16 D added", 1, 0, 1, 1, 1, 2, {96, 300}, 200, 128, 0, 0, 0},
        {"deepseek-v3 fc1 forward shape (sampled)",
         0,
         0,
         0,
         1,
         0,
         8,
         {512, 500, 520, 511, 513, 508, 517, 512},
         4096,
         7168,
         1,
         512,
         0},
    };
    /* every case on each way the kernel can run: A multicast in CTA pairs or not, TMA or register epilogue, the
     * forward form's bf16 D in 128 x 256 or 128 x 128 tiles */
    const int modes[][3] = {{2, 1, 256}, {1, 1, 256}, {2, 0, 256}, {1, 0, 256},
                            {2, 1, 128}, {1, 1, 128}, {2, 0, 128}, {1, 0, 128}};
    for (size_t mi = 0; mi < sizeof modes / sizeof modes[0]; mi++) {
        if (moert_fp8_block_ctx_configure(ctx, modes[mi][0], modes[mi][1]) != MOERT_OK ||
            moert_fp8_block_ctx_set_tile_n(ctx, modes[mi][2]) != MOERT_OK) {
            fprintf(stderr, "FAIL: configure %d/%d/%d: %s\n", modes[mi][0], modes[mi][1], modes[mi][2], gpu_test_error);
            test_failures++;
            continue;
        }
        char mode[320];
        moert_fp8_block_ctx_describe(ctx, mode, sizeof mode);
        printf("-- %s\n", mode);
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
            if (cases[i].samples == 0 || mi % 4 == 0) run_case(ctx, &cases[i]); /* the large shape per tile width */
    }
    EXPECT(moert_fp8_block_ctx_set_tile_n(ctx, 192) == MOERT_ERR_INVALID_ARGUMENT);
    EXPECT(strstr(gpu_test_error, "192 columns") != NULL);
    EXPECT(moert_fp8_block_ctx_configure(ctx, 3, 1) == MOERT_ERR_INVALID_ARGUMENT);
    EXPECT(strstr(gpu_test_error, "cluster size 3") != NULL);
    EXPECT(moert_fp8_block_ctx_configure(ctx, 2, 1) == MOERT_OK);
    check_refusals(ctx);
    moert_fp8_block_ctx_destroy(ctx);
    CK(cudaFree(yield_words));
    printf("gpu_fp8_block_gemm: %s\n", test_failures ? "FAIL" : "PASS");
    return test_failures ? 1 : 0;
}

#endif
