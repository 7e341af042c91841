/* SPDX-License-Identifier: Apache-2.0 */
/* Training with the fp8 precision plugin (each recipe) against bf16: the criterion "stays within 1% of the bf16
 * loss curve", checked on the curve smoothed over windows of WINDOW steps past a short warm-up (single
 * steps jitter: plain fp32 GEMMs already land 0.9% from bf16 on some step); the curves are printed.
 * MOERT_FP8_TRAINING_STEPS (default 80, up to 2000) runs longer curves, e.g. the 300-step ones recorded in
 * bench/results/. */
#include "runtime.h"
#include "test_util.h"

#include <stdlib.h>

#define DEFAULT_STEPS 80
#define MAX_STEPS     2000
#define WARMUP        5
#define TOLERANCE     0.01
#define WINDOW        10

static const char *base =
    "{\"model\": {\"hidden\": 32, \"ffn_hidden\": 48, \"num_experts\": 8, \"topk\": 2, \"num_layers\": 2,"
    " \"dtype\": \"fp32\"},"
    " \"parallel\": {\"ranks\": 2}, \"train\": {\"tokens_per_rank\": 128, \"seed\": 2, \"lr\": 0.003},"
    " \"router\": {\"score_function\": \"sigmoid\"},"
    " \"precision\": %s}";

static int STEPS = DEFAULT_STEPS;

/* Trains STEPS steps with the given precision section; NULL (and a failure counted) if anything fails. */
static moert_runtime *train(const char *precision, moert_config **cfg)
{
    char json[1024];
    snprintf(json, sizeof json, base, precision);
    moert_runtime *rt = NULL;
    EXPECT_OK(moert_config_load_string(json, "fp8-training-test", cfg));
    if (!*cfg) return NULL;
    EXPECT_OK(moert_runtime_create(*cfg, &rt));
    if (!rt) return NULL;
    moert_train_options opts = {.struct_size = sizeof opts, .progress = NULL, .steps = STEPS};
    EXPECT_OK(moert_runtime_train(rt, &opts));
    if (rt->record_count != STEPS) {
        fprintf(stderr, "%s: %lld steps recorded, expected %d\n", precision, (long long)rt->record_count, STEPS);
        test_failures++;
        moert_runtime_destroy(rt);
        return NULL;
    }
    return rt;
}

int main(void)
{
    static const char *const precisions[] = {
        "{\"plugin\": \"bf16\", \"mode\": \"bf16\"}",     "{\"plugin\": \"fp8\", \"recipe\": \"current\"}",
        "{\"plugin\": \"fp8\", \"recipe\": \"delayed\"}", "{\"plugin\": \"fp8\", \"recipe\": \"blockwise\"}",
        "{\"plugin\": \"bf16\", \"mode\": \"fp32\"}", /* the noise floor: fp32 against bf16, printed only */
    };
    static const char *const names[] = {"bf16", "current", "delayed", "blockwise", "fp32"};
    enum { runs = 5, fp8_runs = 4 };
    const char *steps_env = getenv("MOERT_FP8_TRAINING_STEPS");
    if (steps_env) {
        STEPS = atoi(steps_env);
        if (STEPS < 2 * WINDOW || STEPS > MAX_STEPS) {
            fprintf(stderr, "MOERT_FP8_TRAINING_STEPS=%s: expected %d to %d steps\n", steps_env, 2 * WINDOW, MAX_STEPS);
            return 1;
        }
    }
    moert_config *cfg[runs] = {NULL};
    moert_runtime *rt[runs] = {NULL};
    for (int r = 0; r < runs; r++) rt[r] = train(precisions[r], &cfg[r]);
    if (rt[0]) {
        printf("step %10s", names[0]);
        for (int r = 1; r < runs; r++) printf(" %10s %7s", names[r], "rel");
        printf("\n");
        double worst[runs] = {0};
        for (int s = 0; s < STEPS; s++) {
            const double ref = rt[0]->records[s].loss;
            printf("%4d %10.6f", s, ref);
            for (int r = 1; r < runs; r++) {
                if (!rt[r]) continue;
                const double rel = (rt[r]->records[s].loss - ref) / ref;
                printf(" %10.6f %+7.4f", rt[r]->records[s].loss, rel);
                if (s >= WARMUP) worst[r] = fmax(worst[r], fabs(rel));
            }
            printf("\n");
        }
        printf("loss %.5f -> %.5f (bf16)\n", rt[0]->records[0].loss, rt[0]->records[STEPS - 1].loss);
        /* the smoothed curve: mean loss of each window of WINDOW steps from WARMUP on */
        double worst_window[runs] = {0};
        for (int w = WARMUP; w < STEPS; w += WINDOW) {
            int end = w + WINDOW < STEPS ? w + WINDOW : STEPS;
            double ref = 0;
            for (int s = w; s < end; s++) ref += rt[0]->records[s].loss;
            for (int r = 1; r < runs; r++) {
                if (!rt[r]) continue;
                double got = 0;
                for (int s = w; s < end; s++) got += rt[r]->records[s].loss;
                worst_window[r] = fmax(worst_window[r], fabs(got / ref - 1.0));
            }
        }
        EXPECT(rt[0]->records[STEPS - 1].loss < 0.5 * rt[0]->records[0].loss); /* it really trains */
        for (int r = 1; r < runs; r++) {
            if (!rt[r]) continue;
            if (r >= fp8_runs) { /* not a criterion: how far plain fp32 GEMMs drift from bf16 on this metric */
                printf("%s (reference only): largest |loss / bf16 loss - 1| over %d-step windows %.4f, single steps "
                       "%.4f\n",
                       names[r], WINDOW, worst_window[r], worst[r]);
                continue;
            }
            printf("%s: largest |loss / bf16 loss - 1| over %d-step windows from step %d: %.4f (tolerance %.2f); "
                   "single steps %.4f\n",
                   names[r], WINDOW, WARMUP, worst_window[r], TOLERANCE, worst[r]);
            EXPECT(worst_window[r] <= TOLERANCE);
            EXPECT(worst[r] > 0); /* fp8 arithmetic really differs from bf16 */
        }
    }
    for (int r = 0; r < runs; r++) {
        moert_runtime_destroy(rt[r]);
        moert_config_free(cfg[r]);
    }
    return test_finish("fp8_training");
}
