/* SPDX-License-Identifier: Apache-2.0 */
/* Micro-batch overlap ($.parallel.overlap_micro_batches) on the visible GPUs (1, 2 and 4 ranks as available): with
 * 4 micro-batches per step, "on" (slot 1's stream, the merged halves issued in turn) against "off" for 3 Adam steps
 * and one more forward and backward, with the dispatcher alltoall, fp32 and bf16, the
 * router's expert bias on, 3 layers; and the fp8 recipe with delayed scaling (its twins share the scales and amax
 * histories on the device). The check is bit-identity of every step's loss, the output and every gradient
 * of layer 0 and 2, unless two "off" runs already differ (a kernel summing with atomics in whatever order the blocks
 * come): then on vs off may differ by 4x that noise (at least 1e-5 of the largest value) and the log says so. Exits 77
 * without a GPU. "on" with hybridep (its kernels wait on their peers') is refused naming the option, and "auto" leaves
 * it off. */
#include "test_util.h"

#ifndef MOERT_HAVE_CUDA

int main(void)
{
    printf("gpu_overlap: built without CUDA, skipped\n");
    return TEST_SKIP;
}

#else

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/device.h"
#include "runtime.h"

#define STEPS 3

typedef struct outcome {
    double loss[STEPS + 1];
    double *values; /* the output, then layer 0's and 2's gradients */
    int64_t count;
} outcome;

static const char *bf16 = "{\"plugin\": \"bf16\"}";
static const char *fp8_delayed = "{\"plugin\": \"fp8\", \"recipe\": \"delayed\", \"amax_history_len\": 4}";

static const moert_param_id params[] = {MOERT_PARAM_ROUTER, MOERT_PARAM_FC1, MOERT_PARAM_FC2};

static bool run(int ranks, const char *dispatcher, const char *dtype, const char *precision, const char *mode,
                outcome *out)
{
    char json[2048];
    snprintf(json, sizeof json,
             "{\"model\": {\"hidden\": 256, \"ffn_hidden\": 128, \"num_experts\": 8, \"topk\": 2, \"num_layers\": 3,"
             " \"dtype\": \"%s\"}, \"parallel\": {\"ranks\": %d, \"device\": \"cuda\", \"overlap_micro_batches\": "
             "\"%s\"}, \"train\": {\"tokens_per_rank\": 256, \"micro_batches\": 4, \"steps\": %d, \"seed\": 9,"
             " \"lr\": 0.001}, \"router\": {\"score_function\": \"sigmoid\", \"expert_bias\": true,"
             " \"bias_update_rate\": 0.01}, \"dispatcher\": {\"plugin\": \"%s\"}, \"precision\": %s}",
             dtype, ranks, mode, STEPS, dispatcher, precision);
    moert_config *cfg = NULL;
    moert_runtime *rt = NULL;
    bool ok = false;
    memset(out, 0, sizeof *out);
    if (moert_config_load_string(json, "gpu-overlap", &cfg) != MOERT_OK || moert_runtime_create(cfg, &rt) != MOERT_OK) {
        fprintf(stderr, "gpu_overlap: %s\n", moert_error_message());
        goto done;
    }
    const bool made = moert_runtime_overlap_set_interleave(rt, true);
    if (made != !strcmp(mode, "on")) {
        fprintf(stderr, "gpu_overlap: mode %s, but the second slot is %s\n", mode, made ? "there" : "missing");
        goto done;
    }
    moert_train_options opts = {.struct_size = sizeof opts};
    if (moert_runtime_train(rt, &opts) != MOERT_OK) goto fail;
    moert_run_summary sum;
    moert_runtime_summary(rt, &sum);
    for (int s = 0; s < STEPS && s < sum.record_count; s++) out->loss[s] = sum.records[s].loss;
    if (moert_runtime_forward_backward(rt, STEPS + 1, &out->loss[STEPS]) != MOERT_OK) goto fail;
    const int nlocal = moert_runtime_local_ranks(rt);
    int64_t n = moert_runtime_local_output_numel(rt);
    for (int l = 0; l <= 2; l += 2)
        for (size_t p = 0; p < sizeof params / sizeof params[0]; p++)
            n += moert_runtime_local_grad_numel(rt, l, params[p]);
    out->values = calloc((size_t)(n * nlocal), sizeof(double));
    if (!out->values) goto done;
    int64_t at = moert_runtime_local_output_numel(rt);
    if (moert_runtime_read_output(rt, 0, at, out->values) != MOERT_OK) goto fail;
    at *= nlocal;
    for (int l = 0; l <= 2; l += 2)
        for (size_t p = 0; p < sizeof params / sizeof params[0]; p++) {
            const int64_t k = moert_runtime_local_grad_numel(rt, l, params[p]);
            if (moert_runtime_read_grad(rt, l, params[p], 0, k, out->values + at) != MOERT_OK) goto fail;
            at += k * nlocal;
        }
    out->count = at;
    ok = true;
    goto done;
fail:
    fprintf(stderr, "gpu_overlap: %s\n", moert_error_message());
done:
    if (rt) moert_runtime_destroy(rt);
    moert_config_free(cfg);
    return ok;
}

/* The largest difference of a and b relative to a's largest value; 0 when bit-identical. */
static double difference(const outcome *a, const outcome *b)
{
    double diff = 0.0, largest = 0.0;
    if (a->count != b->count) return INFINITY;
    for (int s = 0; s <= STEPS; s++) {
        diff = fmax(diff, fabs(a->loss[s] - b->loss[s]));
        largest = fmax(largest, fabs(a->loss[s]));
    }
    for (int64_t i = 0; i < a->count; i++) {
        diff = fmax(diff, fabs(a->values[i] - b->values[i]));
        largest = fmax(largest, fabs(a->values[i]));
    }
    if (diff == 0.0 && memcmp(a->loss, b->loss, sizeof a->loss) == 0) return 0.0;
    return largest > 0 ? (diff > 0 ? diff / largest : 1e-300) : INFINITY;
}

static void check(int ranks, const char *dispatcher, const char *dtype, const char *precision)
{
    outcome off = {0}, off2 = {0}, on = {0};
    if (!run(ranks, dispatcher, dtype, precision, "off", &off) ||
        !run(ranks, dispatcher, dtype, precision, "off", &off2) ||
        !run(ranks, dispatcher, dtype, precision, "on", &on)) {
        test_failures++;
        goto done;
    }
    const double noise = difference(&off, &off2), d = difference(&off, &on);
    if (noise == 0.0) {
        printf("gpu_overlap: %d GPU(s), %s, %s, %s: on vs off %s (losses %.9g ... %.9g)\n", ranks, dispatcher, dtype,
               precision, d == 0.0 ? "bit-identical" : "DIFFERENT", on.loss[0], on.loss[STEPS]);
        if (d != 0.0) {
            fprintf(stderr, "FAIL: %d GPU(s), %s, %s, %s: relative difference %.3g, off vs off 0\n", ranks, dispatcher,
                    dtype, precision, d);
            test_failures++;
        }
    } else {
        /* the run-to-run noise of the kernels: on vs off may differ by as much (4x, or 1e-5 of the largest value) */
        const double tolerance = fmax(1e-5, 4.0 * noise);
        printf("gpu_overlap: %d GPU(s), %s, %s, %s: off vs off differ by %.3g (atomics): on vs off %.3g, tolerance "
               "%.3g\n",
               ranks, dispatcher, dtype, precision, noise, d, tolerance);
        if (!(d <= tolerance)) test_failures++;
    }
done:
    free(off.values);
    free(off2.values);
    free(on.values);
}

/* "on" with a dispatcher whose kernels wait on their peers' is refused at creation; "auto" runs without the slot. */
static void refused_with_peer_waiting_dispatcher(int ranks)
{
    char json[1024];
    for (int auto_mode = 0; auto_mode <= 1; auto_mode++) {
        snprintf(json, sizeof json,
                 "{\"model\": {\"hidden\": 256, \"ffn_hidden\": 128, \"num_experts\": 8, \"topk\": 2, "
                 "\"num_layers\": 2, \"dtype\": \"bf16\"}, \"parallel\": {\"ranks\": %d, \"device\": \"cuda\", "
                 "\"overlap_micro_batches\": \"%s\"}, \"train\": {\"tokens_per_rank\": 256, \"micro_batches\": 4}, "
                 "\"dispatcher\": {\"plugin\": \"hybridep\"}}",
                 ranks, auto_mode ? "auto" : "on");
        moert_config *cfg = NULL;
        moert_runtime *rt = NULL;
        EXPECT_OK(moert_config_load_string(json, "gpu-overlap-refusal", &cfg));
        const moert_result rc = moert_runtime_create(cfg, &rt);
        if (auto_mode) {
            EXPECT_OK(rc);
            if (rt) EXPECT(!moert_runtime_overlap_set_interleave(rt, false));
        } else {
            EXPECT_EQ_INT(rc, MOERT_ERR_CONFIG);
            EXPECT(strstr(moert_error_message(), "$.parallel.overlap_micro_batches") &&
                   strstr(moert_error_message(), "hybridep"));
            printf("gpu_overlap: %d GPU(s), hybridep \"on\" refused: %s\n", ranks, moert_error_message());
        }
        if (rt) moert_runtime_destroy(rt);
        moert_config_free(cfg);
    }
}

int main(void)
{
    int gpus = 0;
    if (moert_cuda_device_count(&gpus) != MOERT_OK || gpus < 1) {
        printf("gpu_overlap: no GPU, skipped\n");
        return TEST_SKIP;
    }
    const int most = gpus >= 4 ? 4 : gpus >= 2 ? 2 : 1;
    for (int r = 1; r <= most; r *= 2) {
        check(r, "alltoall", "fp32", bf16);
        if (r > 1) refused_with_peer_waiting_dispatcher(r);
        check(r, "alltoall", "bf16", bf16);
        check(r, "alltoall", "bf16", fp8_delayed); /* the twins share the delayed scales and histories */
    }
    return test_finish("gpu_overlap");
}

#endif
