/* SPDX-License-Identifier: Apache-2.0 */
/* Memory actions on cuda:0 (one rank), bf16 activations:
 * - one layer driven through the executor (tests/unit/layer_harness.h) with keep, offload, recompute and mixed
 *   actions, plain, with the prefetch hook called before backward, and with a deferred release: outputs, d_x and
 *   parameter gradients bit-identical to keep over three steps; offload uses the layer's own copy streams; pinned
 *   buffers are allocated at the first step only (a second and third step make no new pinned allocation) and
 *   the pool makes no new cudaMalloc in the third step; stage times are printed (fc1 is where dispatched_x's
 *   offload is issued);
 * - the runtime (moert_runtime_step, one GPU, 2 layers): losses of three steps bit-identical to keep;
 * - the same with a shared expert (gated or not, on its own stream or on the compute stream, with and without the
 *   deferred offload start) whose saved activations are kept, recomputed or offloaded: losses bit-identical to keeping
 *   everything, and fewer bytes kept from forward to backward.
 * Exits 77 without a GPU (and in builds without CUDA). */
#include "test_util.h"

#ifndef MOERT_HAVE_CUDA

int main(void)
{
    printf("gpu_memory: built without CUDA, skipped\n");
    return TEST_SKIP;
}

#else

#include "layer_harness.h"
#include "runtime.h"

#define GH 1024
#define GF 2048
#define GE 8
#define GK 2
#define GT 8192

static const char *const action_names[3] = {"keep", "recompute", "offload"};

typedef struct gpu_result {
    void *y, *d_x, *grads[MOERT_PARAM_COUNT];
} gpu_result;

static void free_result(gpu_result *r)
{
    free(r->y);
    free(r->d_x);
    for (int p = 0; p < MOERT_PARAM_COUNT; p++) free(r->grads[p]);
    memset(r, 0, sizeof *r);
}

static void download_result(layer_harness *hz, gpu_result *r)
{
    r->y = harness_download(hz, &hz->y);
    r->d_x = harness_download(hz, &hz->d_x);
    for (int p = 0; p < MOERT_PARAM_COUNT; p++) r->grads[p] = harness_download(hz, &hz->L.params[p].grad);
}

/* Bit equality of two results of the same layer shape; names the first tensor that differs. */
static bool same_result(layer_harness *hz, const gpu_result *a, const gpu_result *b, const char **differs)
{
    static const char *const grad_names[MOERT_PARAM_COUNT] = {"router grad", "fc1 grad", "fc2 grad"};
    *differs = "a download failed";
    if (!a->y || !b->y || !a->d_x || !b->d_x) return false;
    *differs = "y";
    if (memcmp(a->y, b->y, moert_tensor_bytes(&hz->y)) != 0) return false;
    *differs = "d_x";
    if (memcmp(a->d_x, b->d_x, moert_tensor_bytes(&hz->d_x)) != 0) return false;
    for (int p = 0; p < MOERT_PARAM_COUNT; p++) {
        *differs = grad_names[p];
        if (!a->grads[p] || !b->grads[p] ||
            memcmp(a->grads[p], b->grads[p], moert_tensor_bytes(&hz->L.params[p].grad)) != 0)
            return false;
    }
    *differs = "";
    return true;
}

/* Three steps of one layer with the given actions; step 1's result goes to *out (compared with *reference
 * unless NULL). */
static void check_layer(const int act[MOERT_ACT_COUNT], bool prefetch, bool defer, const gpu_result *reference,
                        gpu_result *out)
{
    char json[256];
    snprintf(json, sizeof json, "{\"dispatched_x\": \"%s\", \"fc1_out\": \"%s\", \"swiglu_out\": \"%s\"}",
             action_names[act[0]], action_names[act[1]], action_names[act[2]]);
    int before = test_failures;
    layer_harness hz;
    gpu_result later = {0};
    const char *differs = "";
    moert_result rc = harness_open(&hz, (moert_device){MOERT_DEVICE_CUDA, 0}, GH, GF, GE, GK, GT, MOERT_BF16, json);
    EXPECT_OK(rc);
    if (rc != MOERT_OK) goto exit;
    moert_layer *L = &hz.L;
    L->acts.defer_release = defer;
    int offloaded = 0;
    for (int a = 0; a < MOERT_ACT_COUNT; a++) offloaded += act[a] == MOERT_MEMORY_OFFLOAD;

    EXPECT_OK(harness_step(&hz, prefetch));
    download_result(&hz, out);
    if (reference && !same_result(&hz, out, reference, &differs)) {
        fprintf(stderr, "step 1: %s differs from keep\n", differs);
        test_failures++;
    }
    int64_t pinned_allocations = L->acts.pinned_allocations, pinned_bytes = L->acts.pinned_bytes;
    EXPECT_EQ_INT(pinned_allocations, offloaded);
    EXPECT_EQ_INT(L->acts.copy_streams_ready, offloaded > 0);
    if (offloaded) {
        EXPECT(L->acts.d2h_stream && L->acts.h2d_stream && L->acts.d2h_stream != L->stream &&
               L->acts.h2d_stream != L->stream && L->acts.d2h_stream != L->acts.h2d_stream);
        /* an offload whose D2H copy still runs at its reload is cancelled (kept on the device, no H2D copy) */
        EXPECT(L->acts.offload_saved_bytes + L->acts.offload_cancelled_bytes > 0);
    }

    moert_cuda_pool_stats stats2 = {0}, stats3 = {0};
    for (int step = 2; step <= 3; step++) {
        EXPECT_OK(harness_step(&hz, prefetch));
        if (step == 2) moert_cuda_pool_get_stats(hz.pool, &stats2);
        if (step == 3) moert_cuda_pool_get_stats(hz.pool, &stats3);
        download_result(&hz, &later);
        if (!same_result(&hz, &later, out, &differs)) {
            fprintf(stderr, "step %d: %s differs from step 1\n", step, differs);
            test_failures++;
        }
        free_result(&later);
        /* the pinned buffers of step 1 serve every later step */
        EXPECT_EQ_INT(L->acts.pinned_allocations, pinned_allocations);
        EXPECT_EQ_INT(L->acts.pinned_bytes, pinned_bytes);
    }
    EXPECT_EQ_INT(stats3.cuda_malloc_count, stats2.cuda_malloc_count);
    for (int a = 0; a < MOERT_ACT_COUNT; a++) EXPECT(L->acts.offload_pending[a].data == NULL);
    printf("%-70s fc1 %6.3f  act %6.3f  fc2 %6.3f  combine %6.3f  backward %6.3f ms; held %5.1f MiB, pinned %5.1f "
           "MiB in %lld buffers; pool peak %.1f MiB\n",
           json, 1e3 * L->stage_seconds[MOERT_STAGE_FC1], 1e3 * L->stage_seconds[MOERT_STAGE_ACT],
           1e3 * L->stage_seconds[MOERT_STAGE_FC2], 1e3 * L->stage_seconds[MOERT_STAGE_COMBINE],
           1e3 * L->stage_seconds[MOERT_STAGE_BACKWARD], L->acts.kept_bytes_peak / 1048576.0,
           L->acts.pinned_bytes / 1048576.0, (long long)L->acts.pinned_allocations,
           stats3.peak_bytes_in_use / 1048576.0);
exit:
    if (test_failures != before)
        fprintf(stderr, "  ... layer with %s (prefetch %d, deferred release %d)\n", json, prefetch, defer);
    harness_close(&hz);
}

static void check_layers(void)
{
    gpu_result keep = {0};
    const int keep_all[MOERT_ACT_COUNT] = {0, 0, 0};
    check_layer(keep_all, false, false, NULL, &keep);
    const int cases[][MOERT_ACT_COUNT] = {{2, 2, 2}, {1, 1, 1}, {2, 1, 1}, {1, 2, 0}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        for (int variant = 0; variant < 3; variant++) {
            /* the deferred release and the prefetch only matter when something is offloaded */
            if (variant > 0 && cases[i][0] != 2 && cases[i][1] != 2 && cases[i][2] != 2) continue;
            gpu_result r = {0};
            check_layer(cases[i], variant == 1, variant == 2, &keep, &r);
            free_result(&r);
        }
    free_result(&keep);
}

/* ---- the runtime on one GPU ---- */

static const char *run_config =
    "{\"model\": {\"hidden\": 512, \"ffn_hidden\": 1024, \"num_experts\": 8, \"topk\": 2, \"num_layers\": 2,"
    " \"dtype\": \"bf16\"}, \"parallel\": {\"ranks\": 1, \"device\": \"cuda\"},"
    " \"train\": {\"tokens_per_rank\": 4096, \"seed\": 3, \"lr\": 0.001, \"data\": \"repeat\"},"
    " \"router\": {\"score_function\": \"sigmoid\", \"expert_bias\": true},"
    " \"memory_policy\": {\"dispatched_x\": \"%s\", \"fc1_out\": \"%s\", \"swiglu_out\": \"%s\"}}";

#define RUN_STEPS 3

/* Losses of RUN_STEPS steps with the given actions; false if the run failed. */
static bool run_losses(const int act[MOERT_ACT_COUNT], double *losses, int64_t *kept)
{
    char json[1024];
    snprintf(json, sizeof json, run_config, action_names[act[0]], action_names[act[1]], action_names[act[2]]);
    moert_config *cfg = NULL;
    moert_runtime *rt = NULL;
    bool ok = false;
    EXPECT_OK(moert_config_load_string(json, "gpu-memory", &cfg));
    if (!cfg) return false;
    EXPECT_OK(moert_runtime_create(cfg, &rt));
    if (!rt) goto exit;
    for (int s = 1; s <= RUN_STEPS; s++) {
        moert_step_record rec;
        moert_result rc = moert_runtime_step(rt, s, &rec);
        EXPECT_OK(rc);
        if (rc != MOERT_OK) goto exit;
        losses[s - 1] = rec.loss;
    }
    *kept = rt->kept_bytes;
    ok = true;
exit:
    moert_runtime_destroy(rt);
    moert_config_free(cfg);
    return ok;
}

static void check_runtime(void)
{
    double keep[RUN_STEPS], other[RUN_STEPS];
    int64_t keep_kept = 0, kept = 0;
    const int keep_all[MOERT_ACT_COUNT] = {0, 0, 0};
    if (!run_losses(keep_all, keep, &keep_kept)) {
        test_failures++;
        return;
    }
    const int cases[][MOERT_ACT_COUNT] = {{2, 2, 2}, {1, 1, 1}, {2, 1, 1}, {2, 2, 1}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        if (!run_losses(cases[i], other, &kept)) {
            test_failures++;
            continue;
        }
        int same = 0;
        for (int s = 0; s < RUN_STEPS; s++) same += memcmp(&keep[s], &other[s], sizeof(double)) == 0;
        printf("runtime %s/%s/%s: %d of %d losses bit-identical to keep (%.6f, %.6f, %.6f); kept %lld of %lld bytes\n",
               action_names[cases[i][0]], action_names[cases[i][1]], action_names[cases[i][2]], same, RUN_STEPS,
               other[0], other[1], other[2], (long long)kept, (long long)keep_kept);
        EXPECT_EQ_INT(same, RUN_STEPS);
        EXPECT(kept < keep_kept);
    }
}

/* ---- the shared expert's activations, through the runtime on one GPU ---- */

static const char *shared_config =
    "{\"model\": {\"hidden\": 512, \"ffn_hidden\": 1024, \"num_experts\": 8, \"topk\": 2, \"num_layers\": 2,"
    " \"dtype\": \"bf16\", \"shared_expert_ffn_hidden\": 768, \"shared_expert_gate\": %s},"
    " \"parallel\": {\"ranks\": 1, \"device\": \"cuda\", \"shared_expert_overlap\": %s, \"offload_defer_start\": %s},"
    " \"train\": {\"tokens_per_rank\": 4096, \"seed\": 3, \"lr\": 0.001, \"data\": \"repeat\"},"
    " \"router\": {\"score_function\": \"sigmoid\", \"expert_bias\": true},"
    " \"memory_policy\": {\"dispatched_x\": \"%s\", \"shared_fc1_out\": \"%s\", \"shared_act\": \"%s\"}}";

/* Losses of RUN_STEPS steps with a shared expert and the given actions (dispatched_x, shared_fc1_out, shared_act). */
static bool run_shared_losses(bool gate, bool overlap, bool defer, const int act[3], double *losses, int64_t *kept)
{
    char json[1536];
    snprintf(json, sizeof json, shared_config, gate ? "true" : "false", overlap ? "true" : "false",
             defer ? "true" : "false", action_names[act[0]], action_names[act[1]], action_names[act[2]]);
    moert_config *cfg = NULL;
    moert_runtime *rt = NULL;
    bool ok = false;
    EXPECT_OK(moert_config_load_string(json, "gpu-memory-shared", &cfg));
    if (!cfg) return false;
    EXPECT_OK(moert_runtime_create(cfg, &rt));
    if (!rt) goto exit;
    for (int s = 1; s <= RUN_STEPS; s++) {
        moert_step_record rec;
        moert_result rc = moert_runtime_step(rt, s, &rec);
        EXPECT_OK(rc);
        if (rc != MOERT_OK) goto exit;
        losses[s - 1] = rec.loss;
    }
    *kept = rt->kept_bytes;
    ok = true;
exit:
    moert_runtime_destroy(rt);
    moert_config_free(cfg);
    return ok;
}

static void check_shared_expert(void)
{
    const int cases[][3] = {{0, 2, 2}, {0, 1, 1}, {0, 2, 1}, {0, 1, 2}, {2, 2, 2}, {1, 2, 0}};
    for (int g = 0; g < 2; g++)
        for (int o = 0; o < 2; o++)
            for (int d = 0; d < 2; d++) {
                if (d && !o) continue; /* the deferred start is checked with the shared expert's own stream */
                double keep[RUN_STEPS], other[RUN_STEPS];
                int64_t keep_kept = 0, kept = 0;
                const int keep_all[3] = {0, 0, 0};
                if (!run_shared_losses(g, o, d, keep_all, keep, &keep_kept)) {
                    test_failures++;
                    continue;
                }
                for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
                    if (!run_shared_losses(g, o, d, cases[i], other, &kept)) {
                        test_failures++;
                        continue;
                    }
                    int same = 0;
                    for (int s = 0; s < RUN_STEPS; s++) same += memcmp(&keep[s], &other[s], sizeof(double)) == 0;
                    printf("shared expert (gate %d, overlap %d, deferred start %d) %s/%s/%s: %d of %d losses "
                           "bit-identical to keep; kept %lld of %lld bytes\n",
                           g, o, d, action_names[cases[i][0]], action_names[cases[i][1]], action_names[cases[i][2]],
                           same, RUN_STEPS, (long long)kept, (long long)keep_kept);
                    EXPECT_EQ_INT(same, RUN_STEPS);
                    /* an offload whose copy still runs at its reload is cancelled and counted as kept */
                    bool recomputes = cases[i][0] == 1 || cases[i][1] == 1 || cases[i][2] == 1;
                    EXPECT(recomputes ? kept < keep_kept : kept <= keep_kept);
                }
            }
}

int main(void)
{
    int gpus = 0;
    if (moert_cuda_device_count(&gpus) != MOERT_OK || gpus < 1) {
        printf("gpu_memory: no GPU, skipped\n");
        return TEST_SKIP;
    }
    check_layers();
    check_runtime();
    check_shared_expert();
    return test_finish("gpu_memory");
}

#endif
