/* SPDX-License-Identifier: Apache-2.0 */
/* The "fp8" precision plugin: FP8 conversions (hand-picked values, every byte, and an independent nearest-value
 * search), scales, quantization error bounds per format, blockwise tile scales, the delayed recipe's amax history,
 * and every GEMM pass of both weights per recipe: exactly equal to a naive loop over operands quantized here, and
 * within the FP8 error bound (derived from the formats) of the fp64 GEMM; WGRAD overwriting grad_weight (empty
 * experts zeroed). */
#include "test_util.h"

#include <float.h>

#include "fp8_convert.h"
#include "precision_fp8_cpu.h"

#define PLUGIN "fp8"

/* ---- conversions ---- */

static void expect_byte(float x, fp8_format f, unsigned want)
{
    unsigned got = fp8_from_float(x, f);
    if (got != want) {
        fprintf(stderr, "fp8_from_float(%.9g, %s) = 0x%02x, expected 0x%02x\n", x, fp8_format_name(f), got, want);
        test_failures++;
    }
}

/* The nearest finite value of the format with x's sign (ties: the even code), found by trying every byte. */
static unsigned nearest_by_search(float x, fp8_format f)
{
    if (isnan(x)) return 0x7f;
    unsigned best = signbit(x) ? 0x80 : 0x00;
    double best_dist = INFINITY;
    for (unsigned b = 0; b < 256; b++) {
        double v = fp8_to_float((uint8_t)b, f);
        if (!isfinite(v) || (b & 0x80) != (signbit(x) ? 0x80u : 0u)) continue;
        double d = fabs(v - (double)x);
        if (d < best_dist || (d == best_dist && (b & 1) == 0)) {
            best = b;
            best_dist = d;
        }
    }
    return best;
}

static void check_conversions(void)
{
    /* E4M3: max, saturation (464 is the tie between 448 and the NaN code: to even, 448), inf, NaN */
    expect_byte(448.0f, FP8_E4M3, 0x7e);
    expect_byte(-448.0f, FP8_E4M3, 0xfe);
    expect_byte(464.0f, FP8_E4M3, 0x7e);
    expect_byte(465.0f, FP8_E4M3, 0x7e);
    expect_byte(1e30f, FP8_E4M3, 0x7e);
    expect_byte(INFINITY, FP8_E4M3, 0x7e);
    expect_byte(-INFINITY, FP8_E4M3, 0xfe);
    expect_byte(NAN, FP8_E4M3, 0x7f);
    expect_byte(-NAN, FP8_E4M3, 0x7f);
    /* normals and ties to even: 1 + 1/16 lies between 1 (m 0) and 1.125 (m 1); 1.1875 between m 1 and m 2 */
    expect_byte(1.0f, FP8_E4M3, 0x38);
    expect_byte(1.0625f, FP8_E4M3, 0x38);
    expect_byte(1.1875f, FP8_E4M3, 0x3a);
    expect_byte(-2.0f, FP8_E4M3, 0xc0);
    expect_byte(0.0f, FP8_E4M3, 0x00);
    expect_byte(-0.0f, FP8_E4M3, 0x80);
    /* min normal 2^-6, subnormals k * 2^-9, half the smallest subnormal ties to 0 */
    expect_byte(ldexpf(1, -6), FP8_E4M3, 0x08);
    expect_byte(ldexpf(1, -9), FP8_E4M3, 0x01);
    expect_byte(ldexpf(1, -10), FP8_E4M3, 0x00);
    expect_byte(ldexpf(1.5f, -10), FP8_E4M3, 0x01);
    expect_byte(ldexpf(3, -10), FP8_E4M3, 0x02);  /* 1.5 subnormal ulps: tie, to even 2 */
    expect_byte(ldexpf(5, -10), FP8_E4M3, 0x02);  /* 2.5: tie, to even 2 */
    expect_byte(ldexpf(7, -9), FP8_E4M3, 0x07);   /* largest subnormal */
    expect_byte(ldexpf(15, -10), FP8_E4M3, 0x08); /* 7.5 ulps: tie between 0x07 and min normal 0x08 */
    /* E5M2: max 57344, 61440 is the tie with inf: saturated; inf saturated; NaN */
    expect_byte(57344.0f, FP8_E5M2, 0x7b);
    expect_byte(60000.0f, FP8_E5M2, 0x7b);
    expect_byte(61440.0f, FP8_E5M2, 0x7b);
    expect_byte(1e30f, FP8_E5M2, 0x7b);
    expect_byte(INFINITY, FP8_E5M2, 0x7b);
    expect_byte(-INFINITY, FP8_E5M2, 0xfb);
    expect_byte(NAN, FP8_E5M2, 0x7f);
    expect_byte(1.0f, FP8_E5M2, 0x3c);
    expect_byte(1.125f, FP8_E5M2, 0x3c); /* tie between 1 and 1.25: even */
    expect_byte(1.375f, FP8_E5M2, 0x3e); /* tie between 1.25 and 1.5: even */
    expect_byte(ldexpf(1, -14), FP8_E5M2, 0x04);
    expect_byte(ldexpf(1, -16), FP8_E5M2, 0x01);
    expect_byte(ldexpf(1, -17), FP8_E5M2, 0x00);
    expect_byte(ldexpf(3, -17), FP8_E5M2, 0x02);
    /* decoding */
    EXPECT(fp8_to_float(0x7e, FP8_E4M3) == 448.0f);
    EXPECT(isnan(fp8_to_float(0x7f, FP8_E4M3)) && isnan(fp8_to_float(0xff, FP8_E4M3)));
    EXPECT(fp8_to_float(0x01, FP8_E4M3) == ldexpf(1, -9));
    EXPECT(fp8_to_float(0x7b, FP8_E5M2) == 57344.0f);
    EXPECT(fp8_to_float(0x7c, FP8_E5M2) == INFINITY && fp8_to_float(0xfc, FP8_E5M2) == -INFINITY);
    EXPECT(isnan(fp8_to_float(0x7d, FP8_E5M2)) && isnan(fp8_to_float(0xfe, FP8_E5M2)));
    EXPECT(fp8_to_float(0x01, FP8_E5M2) == ldexpf(1, -16));

    for (int fi = 0; fi < 2; fi++) {
        fp8_format f = (fp8_format)fi;
        /* every byte decodes and encodes back to itself, except NaNs (-> 0x7f) and E5M2's inf (-> +-max) */
        for (unsigned b = 0; b < 256; b++) {
            float v = fp8_to_float((uint8_t)b, f);
            unsigned want = isnan(v) ? 0x7f : isinf(v) ? (b & 0x80) | 0x7b : b;
            expect_byte(v, f, want);
        }
        /* midpoints between neighbours (and one float ulp either side) and random floats of every binade from
         * 2^-24 to 2^20, against the nearest-value search */
        int bad = 0;
        for (unsigned b = 0; b < 0x7f; b++) {
            float lo = fp8_to_float((uint8_t)b, f), hi = fp8_to_float((uint8_t)(b + 1), f);
            if (!isfinite(hi)) continue;
            float mid = (float)(((double)lo + hi) / 2);
            float probes[3] = {mid, nextafterf(mid, 0), nextafterf(mid, INFINITY)};
            for (int p = 0; p < 3; p++)
                for (int s = 0; s < 2; s++) {
                    float x = s ? -probes[p] : probes[p];
                    bad += fp8_from_float(x, f) != nearest_by_search(x, f);
                }
        }
        uint64_t rng = 77 + (uint64_t)fi;
        for (int i = 0; i < 20000; i++) {
            float x = ldexpf((float)test_uniform(&rng), (int)(test_uniform(&rng) * 22) - 2);
            bad += fp8_from_float(x, f) != nearest_by_search(x, f);
        }
        if (bad) fprintf(stderr, "%s: %d conversions differ from the nearest-value search\n", fp8_format_name(f), bad);
        EXPECT_EQ_INT(bad, 0);
    }
}

/* ---- scales and quantization ---- */

static void check_scales(void)
{
    EXPECT(fp8_scale_from_amax(2.0, 448, 0, false, 1.0f) == 224.0f);
    EXPECT(fp8_scale_from_amax(3.0, 448, 0, false, 1.0f) == 448.0f / 3.0f);
    EXPECT(fp8_scale_from_amax(3.0, 448, 0, true, 1.0f) == 128.0f); /* 149.3 truncated to 2^7 */
    EXPECT(fp8_scale_from_amax(2.0, 448, 1, false, 1.0f) == 112.0f);
    EXPECT(fp8_scale_from_amax(0.0, 448, 0, false, 1.0f) == 1.0f);
    EXPECT(fp8_scale_from_amax(INFINITY, 448, 0, false, 1.0f) == 1.0f);
    EXPECT(fp8_scale_from_amax(NAN, 448, 0, false, 5.0f) == 5.0f);
    EXPECT(fp8_scale_from_amax(1e-300, 448, 0, false, 1.0f) == FLT_MAX);
}

/* Quantizes values spread over 2^-12..2^4 per tensor and checks each against its bound: relative 2^-(m+1) where
 * the scaled value is normal, else half a subnormal step divided by the scale. */
static void check_quantize_error(void)
{
    for (int fi = 0; fi < 2; fi++)
        for (int pow2 = 0; pow2 < 2; pow2++) {
            fp8_format f = (fp8_format)fi;
            const int mbits = f == FP8_E4M3 ? 3 : 2, emin = f == FP8_E4M3 ? -6 : -14;
            enum { n = 4000 };
            static double v[n], orig[n];
            uint64_t rng = 5 + (uint64_t)(fi * 2 + pow2);
            double amax = 0;
            for (int i = 0; i < n; i++) {
                orig[i] = v[i] = (float)ldexp(test_uniform(&rng), (int)(test_uniform(&rng) * 8) - 4);
                amax = fmax(amax, fabs(orig[i]));
            }
            float scale = 0;
            double got_amax = fp8_quantize_block(v, 1, n, 1, n, f, pow2, 0.0f, &scale, NULL);
            EXPECT(got_amax == amax);
            EXPECT(scale == fp8_scale_from_amax(amax, fp8_max(f), 0, pow2, 1.0f));
            int bad = 0, normal = 0;
            double worst = 0;
            for (int i = 0; i < n; i++) {
                double scaled = fabs(orig[i]) * scale, err = fabs(v[i] - orig[i]);
                double bound =
                    scaled >= ldexp(1, emin) ? ldexp(fabs(orig[i]), -(mbits + 1)) : ldexp(1, emin - mbits - 1) / scale;
                normal += scaled >= ldexp(1, emin);
                if (scaled >= ldexp(1, emin)) worst = fmax(worst, err / fabs(orig[i]));
                bad += err > bound * (1 + 1e-12);
            }
            printf("%s, power-of-2 %d: worst relative error %.4f (bound %.4f) over %d normal values\n",
                   fp8_format_name(f), pow2, worst, ldexp(1, -(mbits + 1)), normal);
            EXPECT_EQ_INT(bad, 0);
            EXPECT(normal > n / 2);
            EXPECT(worst > ldexp(1, -(mbits + 2))); /* the rounding is real: errors come close to the bound */
        }
    /* a fixed (delayed) scale saturates what lies beyond fp8_max / scale */
    double big[3] = {10.0, -1000.0, 0.5};
    (void)fp8_quantize_block(big, 1, 3, 1, 3, FP8_E4M3, false, 4.0f, NULL, NULL);
    EXPECT(big[0] == 10.0 && big[1] == -112.0 && big[2] == 0.5);
}

/* Blockwise: 1x128 tiles of a 3 x 300 block and 128x128 tiles of a 200 x 260 block get one scale each, the
 * power-of-2 truncation of fp8_max / the tile's amax (1 for an all-zero tile); small values in their own tile keep
 * their precision. */
static void check_tiles(void)
{
    enum { r1 = 3, c1 = 300, r2 = 200, c2 = 260 };
    static double a[r1 * c1], a0[r1 * c1], w[r2 * c2];
    static uint8_t bytes[r1 * c1];
    uint64_t rng = 11;
    for (int i = 0; i < r1; i++)
        for (int j = 0; j < c1; j++) /* tile (i, jt) has magnitude 2^(3 i - 4 jt) ; row 2's last tile is zero */
            a[i * c1 + j] = a0[i * c1 + j] =
                i == 2 && j >= 256 ? 0.0 : ldexp(test_uniform(&rng), 3 * i - 4 * (j / 128));
    float scales[9] = {0};
    (void)fp8_quantize_block(a, r1, c1, 1, FP8_BLOCK, FP8_E4M3, true, 0.0f, scales, bytes);
    int bad = 0;
    for (int i = 0; i < r1; i++)
        for (int t = 0; t < 3; t++) {
            double amax = 0;
            for (int j = t * 128; j < c1 && j < (t + 1) * 128; j++) amax = fmax(amax, fabs(a0[i * c1 + j]));
            float want = amax > 0 ? ldexpf(1.0f, (int)floor(log2(448.0 / amax))) : 1.0f;
            if (scales[i * 3 + t] != want) {
                fprintf(stderr, "tile (%d, %d): scale %g, expected %g\n", i, t, scales[i * 3 + t], want);
                bad++;
            }
            for (int j = t * 128; j < c1 && j < (t + 1) * 128; j++) {
                bad += a[i * c1 + j] != (double)fp8_to_float(bytes[i * c1 + j], FP8_E4M3) / scales[i * 3 + t];
                if (fabs(a0[i * c1 + j]) * want >= ldexp(1, -6))
                    bad += fabs(a[i * c1 + j] - a0[i * c1 + j]) > ldexp(fabs(a0[i * c1 + j]), -4);
            }
        }
    EXPECT_EQ_INT(bad, 0);
    for (int i = 0; i < r2 * c2; i++) w[i] = (i / c2 < 128 && i % c2 < 128) ? 1000.0 : test_uniform(&rng);
    float wscales[6] = {0};
    (void)fp8_quantize_block(w, r2, c2, FP8_BLOCK, FP8_BLOCK, FP8_E4M3, true, 0.0f, wscales, NULL);
    EXPECT(wscales[0] == 0.25f);                              /* 448 / 1000 -> 2^-2 */
    for (int t = 1; t < 6; t++) EXPECT(wscales[t] == 256.0f); /* amax just below 1: 448 / amax -> 2^8 */
}

/* The delayed recipe's history, through fp8_cpu_grouped_gemm (FC1 forward, one expert): the input slot's scale
 * is 1 until the first end_step, then fp8_max * 2^-margin / (max over the last amax_history_len amaxes, or the most
 * recent); a slot not used in a step and a NaN amax keep the old scale. */
static void check_delayed(void)
{
    const int64_t H = 4, F = 3, rows = 2;
    const double amaxes[6] = {2.0, 8.0, 1.0, 0.5, 0.5, NAN};
    const float want_max[6] = {224.0f, 56.0f, 56.0f, 56.0f, 448.0f, 448.0f};      /* history length 3 */
    const float want_recent[6] = {112.0f, 28.0f, 224.0f, 448.0f, 448.0f, 448.0f}; /* margin 1 */
    for (int variant = 0; variant < 2; variant++) {
        fp8_settings s = {.recipe = FP8_RECIPE_DELAYED,
                          .hybrid = true,
                          .power_of_2 = false,
                          .amax_history_len = 3,
                          .amax_most_recent = variant == 1,
                          .margin = variant == 1 ? 1 : 0};
        fp8_delayed_state d;
        EXPECT(fp8_delayed_init(&d, 1, 3));
        fp8_scratch scratch = {0};
        double in[2 * 4], wt[4 * 2 * 3], out[2 * 2 * 3]; /* [rows, H], [H, 2F], [rows, 2F] */
        moert_tensor input = moert_tensor_2d(in, moert_cpu(), MOERT_F64, rows, H);
        moert_tensor weight = moert_tensor_3d(wt, moert_cpu(), MOERT_F64, 1, H, 2 * F);
        moert_tensor output = moert_tensor_2d(out, moert_cpu(), MOERT_F64, rows, 2 * F);
        for (int i = 0; i < 24; i++) wt[i] = 0.25;
        const int64_t counts[1] = {rows};
        fp8_gemm_shape shape = {1, H, 2 * F, counts};
        moert_grouped_gemm_args args = {.struct_size = sizeof args,
                                        .which = MOERT_GEMM_FC1,
                                        .pass = MOERT_GEMM_FORWARD,
                                        .tokens_per_expert_host = counts,
                                        .input = &input,
                                        .weight = &weight,
                                        .output = &output};
        fp8_amax_slot *slot = fp8_delayed_slot(&d, MOERT_GEMM_FC1, FP8_OPERAND_INPUT, 0);
        EXPECT(slot->scale == 1.0f);
        for (int step = 0; step < 6; step++) {
            for (int i = 0; i < 8; i++) in[i] = amaxes[step] * (i == 5 ? -1.0 : 0.125);
            EXPECT_OK(fp8_cpu_grouped_gemm(&args, &shape, &s, &d, &scratch));
            fp8_delayed_end_step(&d, &s);
            const float want = variant ? want_recent[step] : want_max[step];
            if (slot->scale != want) {
                fprintf(stderr, "delayed (%s): after step %d scale %g, expected %g\n",
                        variant ? "most_recent, margin 1" : "max", step, slot->scale, want);
                test_failures++;
            }
        }
        fp8_delayed_end_step(&d, &s); /* a step without GEMMs changes nothing */
        EXPECT(slot->scale == (variant ? want_recent[5] : want_max[5]));
        EXPECT(fp8_delayed_slot(&d, MOERT_GEMM_FC2, FP8_OPERAND_INPUT, 0)->scale == 1.0f);
        fp8_scratch_free(&scratch);
        fp8_delayed_free(&d);
    }
}

/* ---- GEMMs through the plugin ---- */

#define G_HIDDEN  136 /* > 128: blockwise tiles cross a boundary along K */
#define G_FFN     72
#define G_EXPERTS 2

typedef struct recipe_case {
    const char *options;
    fp8_recipe recipe;
    bool hybrid, power_of_2;
} recipe_case;

/* The operands of one expert's GEMM in GEMM orientation, quantized here: A [m, kk] (1 x 128 tiles along kk when
 * blockwise) and B [kk, n] (128 x 128 for a weight, 128 x 1 along kk for a gradient), each with per-element error
 * bounds u * |x| + (half a subnormal step) / scale. */
static void ref_quantize(double *x, double *err, int64_t rows, int64_t cols, int64_t tr, int64_t tc, fp8_format f,
                         bool pow2)
{
    const int mbits = f == FP8_E4M3 ? 3 : 2, emin = f == FP8_E4M3 ? -6 : -14;
    for (int64_t r0 = 0; r0 < rows; r0 += tr)
        for (int64_t c0 = 0; c0 < cols; c0 += tc) {
            double amax = 0;
            for (int64_t i = r0; i < rows && i < r0 + tr; i++)
                for (int64_t j = c0; j < cols && j < c0 + tc; j++)
                    amax = fmax(amax, fabs((double)(float)x[i * cols + j]));
            float scale = fp8_scale_from_amax(amax, fp8_max(f), 0, pow2, 1.0f); /* delayed's first step: also 1 */
            for (int64_t i = r0; i < rows && i < r0 + tr; i++)
                for (int64_t j = c0; j < cols && j < c0 + tc; j++) {
                    double v = x[i * cols + j];
                    err[i * cols + j] = ldexp(fabs(v), -(mbits + 1)) + ldexp(1, emin - mbits - 1) / scale;
                    x[i * cols + j] =
                        (double)fp8_to_float(fp8_from_float((float)v * scale, f), f) * (double)(1.0f / scale);
                }
        }
}

static moert_tensor make_f32(int ndim, int64_t d0, int64_t d1, int64_t d2, uint64_t *rng, double fill_value)
{
    int64_t shape[3] = {d0, d1, d2};
    int64_t n = d0 * d1 * (ndim == 3 ? d2 : 1);
    moert_tensor t = moert_tensor_make(calloc((size_t)n + 1, sizeof(float)), moert_cpu(), MOERT_F32, ndim, shape);
    for (int64_t i = 0; i < n; i++) moert_store(&t, i, rng ? test_uniform(rng) : fill_value);
    return t;
}

/* One pass of one weight under one recipe: plugin output == naive loop over operands quantized here (after fp32
 * storage), and |output - fp64 GEMM| <= sum_p (e_a |b| + |a| e_b + e_a e_b) + the fp32 storage rounding. */
static void check_gemm(const recipe_case *rc, moert_gemm_weight which, moert_gemm_pass pass, double *worst_ratio)
{
    const int64_t counts[G_EXPERTS] = {130, 3};
    const int64_t total = 133, rows = total + 2;
    const int64_t K = which == MOERT_GEMM_FC1 ? G_HIDDEN : G_FFN, N = which == MOERT_GEMM_FC1 ? 2 * G_FFN : G_HIDDEN;
    moert_layer_info layer = test_layer(G_HIDDEN, G_FFN, G_EXPERTS, 2, 256, 1, 0, MOERT_F32);
    test_instance ti;
    if (test_instance_open(&ti, MOERT_KIND_PRECISION, PLUGIN, rc->options, &layer, NULL, 0, 1) != MOERT_OK) {
        fprintf(stderr, "%s: open failed: %s\n", rc->options, moert_error_message());
        test_failures++;
        test_instance_close(&ti);
        return;
    }
    uint64_t rng = 300 + (uint64_t)(which * 3 + pass);
    moert_tensor input = make_f32(2, rows, K, 0, &rng, 0), grad_output = make_f32(2, rows, N, 0, &rng, 0);
    moert_tensor weight = make_f32(3, G_EXPERTS, K, N, &rng, 0), grad_weight = make_f32(3, G_EXPERTS, K, N, &rng, 0);
    moert_tensor output = make_f32(2, rows, N, 0, NULL, 77), grad_input = make_f32(2, rows, K, 0, NULL, -55);
    for (int64_t i = total * K; i < rows * K; i++) moert_store(&input, i, NAN); /* padding: never read */
    for (int64_t i = total * N; i < rows * N; i++) moert_store(&grad_output, i, NAN);
    double *gw_before = malloc((size_t)(G_EXPERTS * K * N) * sizeof(double));
    for (int64_t i = 0; i < G_EXPERTS * K * N; i++) gw_before[i] = moert_load(&grad_weight, i);
    moert_grouped_gemm_args args = {.struct_size = sizeof args,
                                    .which = which,
                                    .pass = pass,
                                    .tokens_per_expert_host = counts,
                                    .input = &input,
                                    .weight = &weight,
                                    .grad_output = &grad_output,
                                    .output = &output,
                                    .grad_input = &grad_input,
                                    .grad_weight = &grad_weight};
    EXPECT_OK(((const moert_precision_v1 *)ti.plugin.header)->grouped_gemm(ti.ctx, NULL, &args));
    const char *err = moert_host_take_error(ti.host);
    if (err && *err) fprintf(stderr, "%s: %s\n", rc->options, err);

    const fp8_format fa = pass == MOERT_GEMM_DGRAD && rc->hybrid ? FP8_E5M2 : FP8_E4M3;
    const fp8_format fb = pass == MOERT_GEMM_WGRAD && rc->hybrid ? FP8_E5M2 : FP8_E4M3;
    int bad = 0, exact_bad = 0;
    int64_t row0 = 0;
    for (int64_t e = 0; e < G_EXPERTS; e++) {
        const int64_t m = counts[e];
        /* GEMM orientation: FORWARD A = in [m,K], B = W [K,N]; DGRAD A = gout [m,N], B = W^T [N,K];
         * WGRAD A = in^T [K,m], B = gout [m,N] */
        const int64_t am = pass == MOERT_GEMM_WGRAD ? K : m, kk = pass == MOERT_GEMM_FORWARD ? K
                                                                  : pass == MOERT_GEMM_DGRAD ? N
                                                                                             : m;
        const int64_t bn = pass == MOERT_GEMM_FORWARD ? N : pass == MOERT_GEMM_DGRAD ? K : N;
        double *a = malloc((size_t)(am * kk) * 8), *b = malloc((size_t)(kk * bn) * 8);
        double *qa = malloc((size_t)(am * kk) * 8), *qb = malloc((size_t)(kk * bn) * 8);
        double *ea = malloc((size_t)(am * kk) * 8), *eb = malloc((size_t)(kk * bn) * 8);
        for (int64_t i = 0; i < am; i++)
            for (int64_t p = 0; p < kk; p++)
                a[i * kk + p] = pass == MOERT_GEMM_FORWARD ? moert_load(&input, (row0 + i) * K + p)
                                : pass == MOERT_GEMM_DGRAD ? moert_load(&grad_output, (row0 + i) * N + p)
                                                           : moert_load(&input, (row0 + p) * K + i);
        for (int64_t p = 0; p < kk; p++)
            for (int64_t j = 0; j < bn; j++)
                b[p * bn + j] = pass == MOERT_GEMM_FORWARD ? moert_load(&weight, e * K * N + p * N + j)
                                : pass == MOERT_GEMM_DGRAD ? moert_load(&weight, e * K * N + j * N + p)
                                                           : moert_load(&grad_output, (row0 + p) * N + j);
        memcpy(qa, a, (size_t)(am * kk) * 8);
        memcpy(qb, b, (size_t)(kk * bn) * 8);
        const bool blockwise = rc->recipe == FP8_RECIPE_BLOCKWISE;
        ref_quantize(qa, ea, am, kk, blockwise ? 1 : am, blockwise ? FP8_BLOCK : kk, fa, rc->power_of_2);
        if (rc->recipe == FP8_RECIPE_DELAYED) { /* first step: every scale is 1 */
            for (int64_t i = 0; i < am * kk; i++) {
                const int mb = fa == FP8_E4M3 ? 3 : 2, en = fa == FP8_E4M3 ? -6 : -14;
                qa[i] = fp8_to_float(fp8_from_float((float)a[i], fa), fa);
                ea[i] = ldexp(fabs(a[i]), -(mb + 1)) + ldexp(1, en - mb - 1);
            }
            for (int64_t i = 0; i < kk * bn; i++) {
                const int mb = fb == FP8_E4M3 ? 3 : 2, en = fb == FP8_E4M3 ? -6 : -14;
                qb[i] = fp8_to_float(fp8_from_float((float)b[i], fb), fb);
                eb[i] = ldexp(fabs(b[i]), -(mb + 1)) + ldexp(1, en - mb - 1);
            }
        } else {
            const bool b_weight = pass != MOERT_GEMM_WGRAD;
            ref_quantize(qb, eb, kk, bn, blockwise ? FP8_BLOCK : kk, blockwise ? (b_weight ? FP8_BLOCK : 1) : bn, fb,
                         rc->power_of_2);
        }
        for (int64_t i = 0; i < am; i++)
            for (int64_t j = 0; j < bn; j++) {
                double q = 0, exact = 0, bound = 0;
                for (int64_t p = 0; p < kk; p++) {
                    q += qa[i * kk + p] * qb[p * bn + j];
                    exact += a[i * kk + p] * b[p * bn + j];
                    bound += ea[i * kk + p] * fabs(b[p * bn + j]) + fabs(a[i * kk + p]) * eb[p * bn + j] +
                             ea[i * kk + p] * eb[p * bn + j];
                }
                double got, want;
                if (pass == MOERT_GEMM_WGRAD) {
                    const int64_t at = e * K * N + i * N + j;
                    got = moert_load(&grad_weight, at);
                    want = (float)(gw_before[at] + q);
                    exact += gw_before[at];
                } else {
                    got = moert_load(pass == MOERT_GEMM_FORWARD ? &output : &grad_input, (row0 + i) * bn + j);
                    want = (float)q;
                }
                bound += ldexp(fabs(exact), -23) + 1e-300;
                exact_bad += got != want;
                bad += fabs(got - exact) > bound;
                *worst_ratio = fmax(*worst_ratio, fabs(got - exact) / bound);
            }
        free(a), free(b), free(qa), free(qb), free(ea), free(eb);
        row0 += m;
    }
    int touched = 0; /* padding rows of the overwritten outputs */
    if (pass == MOERT_GEMM_FORWARD)
        for (int64_t i = total * N; i < rows * N; i++) touched += moert_load(&output, i) != 77;
    if (pass == MOERT_GEMM_DGRAD)
        for (int64_t i = total * K; i < rows * K; i++) touched += moert_load(&grad_input, i) != -55;
    if (bad || exact_bad || touched)
        fprintf(stderr,
                "%s, %s, pass %d: %d outside the FP8 bound, %d differ from the quantized naive loop, "
                "%d padding written\n",
                rc->options, which == MOERT_GEMM_FC1 ? "fc1" : "fc2", (int)pass, bad, exact_bad, touched);
    EXPECT_EQ_INT(bad, 0);
    EXPECT_EQ_INT(exact_bad, 0);
    EXPECT_EQ_INT(touched, 0);
    free(input.data), free(grad_output.data), free(weight.data), free(grad_weight.data), free(output.data);
    free(grad_input.data), free(gw_before);
    test_instance_close(&ti);
}

static void check_gemms(void)
{
    static const recipe_case cases[] = {
        {"{}", FP8_RECIPE_CURRENT, true, false},
        {"{\"recipe\": \"current\", \"format\": \"e4m3\", \"power_of_2_scales\": true}", FP8_RECIPE_CURRENT, false,
         true},
        {"{\"recipe\": \"delayed\"}", FP8_RECIPE_DELAYED, true, false},
        {"{\"recipe\": \"blockwise\"}", FP8_RECIPE_BLOCKWISE, false, true}, /* defaults: e4m3, power-of-2 scales */
        {"{\"recipe\": \"blockwise\", \"format\": \"hybrid\"}", FP8_RECIPE_BLOCKWISE, true, true},
        {"{\"recipe\": \"blockwise\", \"format\": \"e4m3\", \"power_of_2_scales\": false}", FP8_RECIPE_BLOCKWISE, false,
         false},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        double worst = 0;
        for (int which = 0; which < 2; which++)
            for (int pass = 0; pass < 3; pass++)
                check_gemm(&cases[c], (moert_gemm_weight)which, (moert_gemm_pass)pass, &worst);
        printf("gemm %s: worst |fp8 - fp64| / bound = %.3f\n", cases[c].options, worst);
        EXPECT(worst > 0.01); /* the operands really were quantized */
    }
}

/* ---- WGRAD overwriting grad_weight ---- */

/* One WGRAD through the plugin into grad_weight; overwrite asks for overwrite_grad_weight. */
static moert_result wgrad_call(test_instance *ti, moert_gemm_weight which, const int64_t *counts, moert_tensor *input,
                               moert_tensor *grad_output, moert_tensor *grad_weight, int overwrite)
{
    moert_grouped_gemm_args args = {.struct_size = sizeof args,
                                    .which = which,
                                    .pass = MOERT_GEMM_WGRAD,
                                    .tokens_per_expert_host = counts,
                                    .input = input,
                                    .grad_output = grad_output,
                                    .grad_weight = grad_weight,
                                    .overwrite_grad_weight = overwrite};
    return ((const moert_precision_v1 *)ti->plugin.header)->grouped_gemm(ti->ctx, NULL, &args);
}

/* Elements of a and b (n each) that differ. */
static int64_t count_differing(const moert_tensor *a, const moert_tensor *b, int64_t n)
{
    int64_t differ = 0;
    for (int64_t i = 0; i < n; i++) differ += moert_load(a, i) != moert_load(b, i);
    return differ;
}

/*
 * overwrite_grad_weight (the first micro-batch's WGRAD): on a gradient full of old values, the result equals the
 * accumulating WGRAD onto zeros, experts with no rows are zeroed; a following accumulating WGRAD adds onto it;
 * without overwrite every expert adds onto its old values (an empty one keeps them).
 */
static void check_overwrite(const char *options)
{
    static const int64_t count_sets[3][3] = {{130, 0, 3}, {0, 0, 0}, {0, 17, 0}};
    moert_layer_info layer = test_layer(G_HIDDEN, G_FFN, 3, 2, 256, 1, 0, MOERT_F32);
    test_instance ti;
    if (test_instance_open(&ti, MOERT_KIND_PRECISION, PLUGIN, options, &layer, NULL, 0, 1) != MOERT_OK) {
        fprintf(stderr, "overwrite %s: open failed: %s\n", options, moert_error_message());
        test_failures++;
        test_instance_close(&ti);
        return;
    }
    EXPECT(ti.plugin.header->flags & MOERT_CAP_WGRAD_OVERWRITE);
    for (int which = 0; which < 2; which++)
        for (int s = 0; s < 3; s++) {
            const int64_t *counts = count_sets[s];
            const int64_t K = which == 0 ? G_HIDDEN : G_FFN, N = which == 0 ? 2 * G_FFN : G_HIDDEN, rows = 150;
            const int64_t n = 3 * K * N;
            uint64_t rng = 700 + (uint64_t)(which * 3 + s);
            moert_tensor input = make_f32(2, rows, K, 0, &rng, 0), grad_output = make_f32(2, rows, N, 0, &rng, 0);
            moert_tensor old = make_f32(3, 3, K, N, &rng, 0); /* stale values the overwrite must not keep */
            moert_tensor over = make_f32(3, 3, K, N, NULL, 0), zero = make_f32(3, 3, K, N, NULL, 0);
            moert_tensor kept = make_f32(3, 3, K, N, NULL, 0);
            for (int64_t i = 0; i < n; i++) {
                const double v = moert_load(&old, i);
                moert_store(&over, i, v), moert_store(&kept, i, v);
            }
            const moert_gemm_weight w = (moert_gemm_weight)which;
            EXPECT_OK(wgrad_call(&ti, w, counts, &input, &grad_output, &over, 1));
            EXPECT_OK(wgrad_call(&ti, w, counts, &input, &grad_output, &zero, 0));
            const int64_t differ = count_differing(&over, &zero, n);
            int64_t nonzero_empty = 0, rows_nonzero = 0;
            for (int64_t e = 0; e < 3; e++)
                for (int64_t i = e * K * N; i < (e + 1) * K * N; i++) {
                    if (counts[e] == 0)
                        nonzero_empty += moert_load(&over, i) != 0.0;
                    else
                        rows_nonzero += moert_load(&over, i) != 0.0;
                }
            /* the next micro-batch accumulates onto the overwritten gradient, as onto the zeroed one */
            EXPECT_OK(wgrad_call(&ti, w, counts, &input, &grad_output, &over, 0));
            EXPECT_OK(wgrad_call(&ti, w, counts, &input, &grad_output, &zero, 0));
            const int64_t differ2 = count_differing(&over, &zero, n);
            /* overwrite 0: added onto the old values */
            EXPECT_OK(wgrad_call(&ti, w, counts, &input, &grad_output, &kept, 0));
            int64_t empty_changed = 0, added = 0;
            for (int64_t e = 0; e < 3; e++)
                for (int64_t i = e * K * N; i < (e + 1) * K * N; i++) {
                    if (counts[e] == 0)
                        empty_changed += moert_load(&kept, i) != moert_load(&old, i);
                    else
                        added += moert_load(&kept, i) != moert_load(&old, i);
                }
            const int64_t with_rows = (counts[0] != 0) + (counts[1] != 0) + (counts[2] != 0);
            if (differ || nonzero_empty || differ2 || empty_changed)
                fprintf(stderr,
                        "overwrite %s, fc%d, counts {%lld, %lld, %lld}: %lld differ from the WGRAD onto zeros, "
                        "%lld not zeroed in empty experts, %lld differ after accumulating, %lld old values of empty "
                        "experts changed without overwrite\n",
                        options, which + 1, (long long)counts[0], (long long)counts[1], (long long)counts[2],
                        (long long)differ, (long long)nonzero_empty, (long long)differ2, (long long)empty_changed);
            EXPECT(differ == 0);
            EXPECT(nonzero_empty == 0);
            EXPECT(differ2 == 0);
            EXPECT(empty_changed == 0);
            /* the GEMM did write something where there were rows (not a test that passes on zeros) */
            EXPECT(rows_nonzero > with_rows * K * N / 2 || with_rows == 0);
            EXPECT(added > with_rows * K * N / 2 || with_rows == 0);
            free(input.data), free(grad_output.data), free(old.data), free(over.data), free(zero.data);
            free(kept.data);
        }
    test_instance_close(&ti);
}

/* ---- "fp8_wgrad": false ---- */

/* One grouped GEMM of pass through plugin instance ti; the result's values (output, grad_input or grad_weight) as an
 * fp64 tensor on the host (free its data). */
static moert_tensor pass_values(test_instance *ti, moert_gemm_weight which, moert_gemm_pass pass, const int64_t *counts,
                                moert_tensor *input, moert_tensor *weight, moert_tensor *grad_output,
                                const moert_tensor *grad_weight_start, int overwrite)
{
    const int64_t rows = input->shape[0], K = input->shape[1], N = grad_output->shape[1];
    moert_tensor output = make_f32(2, rows, N, 0, NULL, 0), grad_input = make_f32(2, rows, K, 0, NULL, 0);
    moert_tensor grad_weight = make_f32(3, G_EXPERTS, K, N, NULL, 0);
    for (int64_t i = 0; i < G_EXPERTS * K * N; i++) moert_store(&grad_weight, i, moert_load(grad_weight_start, i));
    moert_grouped_gemm_args args = {.struct_size = sizeof args,
                                    .which = which,
                                    .pass = pass,
                                    .tokens_per_expert_host = counts,
                                    .input = input,
                                    .weight = weight,
                                    .grad_output = grad_output,
                                    .output = &output,
                                    .grad_input = &grad_input,
                                    .grad_weight = &grad_weight,
                                    .overwrite_grad_weight = overwrite};
    EXPECT_OK(((const moert_precision_v1 *)ti->plugin.header)->grouped_gemm(ti->ctx, NULL, &args));
    const moert_tensor *result = pass == MOERT_GEMM_FORWARD ? &output
                                 : pass == MOERT_GEMM_DGRAD ? &grad_input
                                                            : &grad_weight;
    const int64_t n = moert_tensor_numel(result);
    moert_tensor v = moert_tensor_1d(malloc((size_t)n * sizeof(double)), moert_cpu(), MOERT_F64, n);
    for (int64_t i = 0; i < n; i++) moert_store(&v, i, moert_load(result, i));
    free(output.data), free(grad_input.data), free(grad_weight.data);
    return v;
}

/*
 * "fp8_wgrad": false: WGRAD (accumulating and overwriting) equals the bf16 plugin's, value for value, and differs
 * from the FP8 WGRAD; FORWARD and DGRAD equal the default FP8 recipe's, value for value, and differ from bf16's.
 */
static void check_unquantized_wgrad(const char *fp8_options, const char *unquantized_options)
{
    const int64_t counts[G_EXPERTS] = {130, 3};
    const int64_t rows = 133;
    moert_layer_info layer = test_layer(G_HIDDEN, G_FFN, G_EXPERTS, 2, 256, 1, 0, MOERT_F32);
    test_instance fp8, unq, bf16;
    EXPECT_OK(test_instance_open(&fp8, MOERT_KIND_PRECISION, PLUGIN, fp8_options, &layer, NULL, 0, 1));
    EXPECT_OK(test_instance_open(&unq, MOERT_KIND_PRECISION, PLUGIN, unquantized_options, &layer, NULL, 0, 1));
    EXPECT_OK(test_instance_open(&bf16, MOERT_KIND_PRECISION, "bf16", "{}", &layer, NULL, 0, 1));
    for (int which = 0; which < 2 && fp8.ctx && unq.ctx && bf16.ctx; which++) {
        const int64_t K = which == MOERT_GEMM_FC1 ? G_HIDDEN : G_FFN;
        const int64_t N = which == MOERT_GEMM_FC1 ? 2 * G_FFN : G_HIDDEN;
        uint64_t rng = 900 + (uint64_t)which;
        moert_tensor input = make_f32(2, rows, K, 0, &rng, 0), grad_output = make_f32(2, rows, N, 0, &rng, 0);
        moert_tensor weight = make_f32(3, G_EXPERTS, K, N, &rng, 0), start = make_f32(3, G_EXPERTS, K, N, &rng, 0);
        for (int pass = 0; pass < 3; pass++)
            for (int overwrite = 0; overwrite <= (pass == MOERT_GEMM_WGRAD); overwrite++) {
                const moert_tensor v_fp8 = pass_values(&fp8, (moert_gemm_weight)which, (moert_gemm_pass)pass, counts,
                                                       &input, &weight, &grad_output, &start, overwrite);
                const moert_tensor v_unq = pass_values(&unq, (moert_gemm_weight)which, (moert_gemm_pass)pass, counts,
                                                       &input, &weight, &grad_output, &start, overwrite);
                const moert_tensor v_bf16 = pass_values(&bf16, (moert_gemm_weight)which, (moert_gemm_pass)pass, counts,
                                                        &input, &weight, &grad_output, &start, overwrite);
                const int64_t n = moert_tensor_numel(&v_unq);
                const int64_t vs_fp8 = count_differing(&v_unq, &v_fp8, n),
                              vs_bf16 = count_differing(&v_unq, &v_bf16, n);
                if (pass == MOERT_GEMM_WGRAD) {
                    EXPECT_EQ_INT(vs_bf16, 0);
                    EXPECT(vs_fp8 > n / 2);
                } else {
                    EXPECT_EQ_INT(vs_fp8, 0);
                    EXPECT(vs_bf16 > n / 2);
                }
                free(v_fp8.data), free(v_unq.data), free(v_bf16.data);
            }
        free(input.data), free(grad_output.data), free(weight.data), free(start.data);
    }
    test_instance_close(&fp8);
    test_instance_close(&unq);
    test_instance_close(&bf16);
}

/* ---- errors ---- */

static void check_errors(void)
{
    moert_layer_info layer = test_layer(6, 5, 3, 2, 16, 1, 0, MOERT_F32);
    test_instance ti;
    EXPECT_OK(test_instance_open(&ti, MOERT_KIND_PRECISION, PLUGIN, "{}", &layer, NULL, 0, 1));
    if (ti.ctx) {
        const int64_t counts[3] = {4, 0, 7};
        uint64_t rng = 1;
        moert_tensor input = make_f32(2, 13, 6, 0, &rng, 0), weight = make_f32(3, 3, 6, 10, &rng, 0);
        moert_tensor output = make_f32(2, 13, 9, 0, NULL, 0);
        moert_grouped_gemm_args a = {.struct_size = sizeof a,
                                     .which = MOERT_GEMM_FC1,
                                     .pass = MOERT_GEMM_FORWARD,
                                     .tokens_per_expert_host = counts,
                                     .input = &input,
                                     .weight = &weight,
                                     .output = &output};
        const moert_precision_v1 *vt = (const moert_precision_v1 *)ti.plugin.header;
        EXPECT_EQ_INT(vt->grouped_gemm(ti.ctx, NULL, &a), MOERT_ERR_INVALID_ARGUMENT);
        const char *m = moert_host_take_error(ti.host);
        EXPECT(strstr(m, "grouped_gemm(fc1, forward): output has shape [13, 9], expected [13, 10] (rows of input, "
                         "2*ffn_hidden)") != NULL);
        a.pass = MOERT_GEMM_WGRAD;
        EXPECT_EQ_INT(vt->grouped_gemm(ti.ctx, NULL, &a), MOERT_ERR_INVALID_ARGUMENT);
        EXPECT(strstr(moert_host_take_error(ti.host), "grouped_gemm(fc1, wgrad): grad_output is NULL") != NULL);
        free(input.data), free(weight.data), free(output.data);
    }
    test_instance_close(&ti);
    EXPECT_EQ_INT(test_instance_open(&ti, MOERT_KIND_PRECISION, PLUGIN, "{\"recipe\": \"mxfp8\"}", &layer, NULL, 0, 1),
                  MOERT_ERR_CONFIG);
    EXPECT_ERROR_CONTAINS("recipe");
    EXPECT_ERROR_CONTAINS("blockwise");
    test_instance_close(&ti);
    EXPECT_EQ_INT(
        test_instance_open(&ti, MOERT_KIND_PRECISION, PLUGIN, "{\"amax_history_len\": 0}", &layer, NULL, 0, 1),
        MOERT_ERR_CONFIG);
    EXPECT_ERROR_CONTAINS("amax_history_len");
    test_instance_close(&ti);
    /* the wgmma kernel serves the blockwise recipe only; a bad engine names the key and the choices */
    EXPECT_EQ_INT(test_instance_open(&ti, MOERT_KIND_PRECISION, PLUGIN,
                                     "{\"recipe\": \"current\", \"gemm\": \"kernel\"}", &layer, NULL, 0, 1),
                  MOERT_ERR_CONFIG);
    EXPECT_ERROR_CONTAINS("$.precision.gemm: \"kernel\" serves the blockwise recipe only (recipe is \"current\")");
    test_instance_close(&ti);
    EXPECT_EQ_INT(test_instance_open(&ti, MOERT_KIND_PRECISION, PLUGIN, "{\"gemm\": \"cutlass\"}", &layer, NULL, 0, 1),
                  MOERT_ERR_CONFIG);
    EXPECT_ERROR_CONTAINS("gemm");
    EXPECT_ERROR_CONTAINS("cublaslt");
    test_instance_close(&ti);
    EXPECT_OK(test_instance_open(&ti, MOERT_KIND_PRECISION, PLUGIN, "{\"recipe\": \"blockwise\", \"gemm\": \"kernel\"}",
                                 &layer, NULL, 0, 1)); /* on the CPU the engine is not used */
    test_instance_close(&ti);
    EXPECT_EQ_INT(test_instance_open(&ti, MOERT_KIND_PRECISION, PLUGIN, "{\"fp8_wgrad\": \"no\"}", &layer, NULL, 0, 1),
                  MOERT_ERR_CONFIG);
    EXPECT_ERROR_CONTAINS("fp8_wgrad");
    test_instance_close(&ti);
    /* the wgmma kernel's tuning options: checked on every device, each bad value named with its path */
    EXPECT_OK(test_instance_open(&ti, MOERT_KIND_PRECISION, PLUGIN,
                                 "{\"recipe\": \"blockwise\", \"block_tile_n\": 128, \"block_stages\": 3, "
                                 "\"block_pairs\": 1, \"block_pair_rows\": false, \"block_cluster\": 1, "
                                 "\"block_clusters\": 33}",
                                 &layer, NULL, 0, 1));
    test_instance_close(&ti);
    EXPECT_EQ_INT(test_instance_open(&ti, MOERT_KIND_PRECISION, PLUGIN, "{\"block_tile_n\": 192}", &layer, NULL, 0, 1),
                  MOERT_ERR_CONFIG);
    EXPECT_ERROR_CONTAINS("config error at $.precision.block_tile_n: got 192, expected 128 or 256");
    test_instance_close(&ti);
    EXPECT_EQ_INT(test_instance_open(&ti, MOERT_KIND_PRECISION, PLUGIN, "{\"block_stages\": 1}", &layer, NULL, 0, 1),
                  MOERT_ERR_CONFIG);
    EXPECT_ERROR_CONTAINS("$.precision.block_stages: got 1");
    test_instance_close(&ti);
    EXPECT_EQ_INT(test_instance_open(&ti, MOERT_KIND_PRECISION, PLUGIN, "{\"block_pairs\": 3}", &layer, NULL, 0, 1),
                  MOERT_ERR_CONFIG);
    EXPECT_ERROR_CONTAINS("block_pairs");
    test_instance_close(&ti);
    EXPECT_EQ_INT(test_instance_open(&ti, MOERT_KIND_PRECISION, PLUGIN, "{\"block_cluster\": 4}", &layer, NULL, 0, 1),
                  MOERT_ERR_CONFIG);
    EXPECT_ERROR_CONTAINS("block_cluster");
    test_instance_close(&ti);
    layer.device.type = MOERT_DEVICE_CUDA; /* the FP8 GEMMs on CUDA are not written yet */
    moert_result r = test_instance_open(&ti, MOERT_KIND_PRECISION, PLUGIN, "{}", &layer, NULL, 0, 1);
    EXPECT_EQ_INT(r, MOERT_ERR_UNSUPPORTED);
    EXPECT_ERROR_CONTAINS("cuda:0");
    test_instance_close(&ti);
    /* a layer on a device the plugin has no path for names the device (and, without CUDA, the build) */
    test_expect_device_refused(MOERT_KIND_PRECISION, PLUGIN, &layer, "the fp8 precision plugin");
}

int main(void)
{
    check_conversions();
    check_scales();
    check_quantize_error();
    check_tiles();
    check_delayed();
    check_gemms();
    check_overwrite("{}");
    check_overwrite("{\"recipe\": \"delayed\"}");
    check_overwrite("{\"recipe\": \"blockwise\"}");
    check_unquantized_wgrad("{\"recipe\": \"blockwise\"}", "{\"recipe\": \"blockwise\", \"fp8_wgrad\": false}");
    check_unquantized_wgrad("{}", "{\"fp8_wgrad\": false}");
    check_errors();
    return test_finish("test_precision_fp8");
}
