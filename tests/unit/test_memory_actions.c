/* SPDX-License-Identifier: Apache-2.0 */
/* Memory actions and the optimizer choice, on the CPU:
 * - all 27 combinations of keep/recompute/offload over the three saved activations give the same loss, stack
 *   output and parameter gradients as keeping everything, bit for bit, over two steps of a 2-rank, 2-layer run
 *   (moert_runtime_step); the runtime's activation figures count a kept activation and not a recomputed or
 *   offloaded one;
 * - one layer driven through the executor: per-activation figures (size, bytes held, bytes each action saved),
 *   pinned buffers allocated once and reused by the next step, the prefetch hook and a deferred release give the
 *   same bits;
 * - train.optimizer "sgd": parameters after one step are p - lr * g exactly (the trainer's own optimizer); "adam"
 *   (the default) still makes Adam's first step. */
#include "runtime.h"
#include "test_util.h"

#include "layer_harness.h"
#include "optim.h"

static const char *const action_names[3] = {"keep", "recompute", "offload"};

/* ---- the runtime: 27 combinations against keep ---- */

typedef struct run_snapshot {
    double loss[2];
    double *output[2]; /* the stack's output after each step */
    double *grads[2];  /* every parameter gradient of every layer after each step, in a fixed order */
    int64_t output_numel, grad_numel;
    int64_t activation_bytes[MOERT_ACT_COUNT];
    int64_t kept_bytes;
} run_snapshot;

static const char *run_config =
    "{\"model\": {\"hidden\": 16, \"ffn_hidden\": 24, \"num_experts\": 4, \"topk\": 2, \"num_layers\": 2},"
    " \"parallel\": {\"ranks\": 2, \"device\": \"cpu\"}, \"train\": {\"tokens_per_rank\": 32, \"seed\": 4, \"lr\": "
    "0.01},"
    " \"router\": {\"score_function\": \"sigmoid\", \"expert_bias\": true, \"bias_update_rate\": 0.01},"
    " \"memory_policy\": {\"dispatched_x\": \"%s\", \"fc1_out\": \"%s\", \"swiglu_out\": \"%s\"}}";

static void free_snapshot(run_snapshot *s)
{
    for (int i = 0; i < 2; i++) {
        free(s->output[i]);
        free(s->grads[i]);
    }
    memset(s, 0, sizeof *s);
}

/* Two training steps with the given actions; every figure compared afterwards. False if the run failed. */
static bool run_actions(const int act[MOERT_ACT_COUNT], run_snapshot *s)
{
    char json[1024];
    snprintf(json, sizeof json, run_config, action_names[act[0]], action_names[act[1]], action_names[act[2]]);
    memset(s, 0, sizeof *s);
    moert_config *cfg = NULL;
    moert_runtime *rt = NULL;
    bool ok = false;
    EXPECT_OK(moert_config_load_string(json, "memory-actions", &cfg));
    if (!cfg) return false;
    EXPECT_OK(moert_runtime_create(cfg, &rt));
    if (!rt) goto exit;
    s->output_numel = moert_runtime_output_numel(rt);
    for (int p = 0; p < MOERT_PARAM_COUNT; p++)
        s->grad_numel += cfg->model.num_layers * moert_runtime_param_numel(rt, (moert_param_id)p);
    for (int step = 1; step <= 2; step++) {
        moert_step_record rec;
        moert_result rc = moert_runtime_step(rt, step, &rec);
        EXPECT_OK(rc);
        if (rc != MOERT_OK) goto exit;
        s->loss[step - 1] = rec.loss;
        double *out = s->output[step - 1] = calloc((size_t)s->output_numel, sizeof(double));
        double *g = s->grads[step - 1] = calloc((size_t)s->grad_numel, sizeof(double));
        if (!out || !g) goto exit;
        for (int64_t i = 0; i < s->output_numel; i++) EXPECT_OK(moert_runtime_output(rt, i, &out[i]));
        int64_t k = 0;
        for (int l = 0; l < cfg->model.num_layers; l++)
            for (int p = 0; p < MOERT_PARAM_COUNT; p++)
                for (int64_t i = 0; i < moert_runtime_param_numel(rt, (moert_param_id)p); i++)
                    EXPECT_OK(moert_runtime_param(rt, l, (moert_param_id)p, i, MOERT_PARAM_READ, NULL, &g[k++]));
    }
    memcpy(s->activation_bytes, rt->activation_bytes, sizeof s->activation_bytes);
    s->kept_bytes = rt->kept_bytes;
    ok = true;
exit:
    moert_runtime_destroy(rt);
    moert_config_free(cfg);
    return ok;
}

static void check_all_combinations(void)
{
    run_snapshot keep;
    const int keep_all[MOERT_ACT_COUNT] = {0, 0, 0};
    if (!run_actions(keep_all, &keep)) {
        test_failures++;
        free_snapshot(&keep);
        return;
    }
    /* sizes: [cap, H], [cap, 2F], [cap, F] in fp32, summed over layers */
    EXPECT(keep.activation_bytes[MOERT_ACT_SWIGLU_OUT] > 0);
    EXPECT_EQ_INT(keep.activation_bytes[MOERT_ACT_FC1_OUT], 2 * keep.activation_bytes[MOERT_ACT_SWIGLU_OUT]);
    EXPECT_EQ_INT(keep.activation_bytes[MOERT_ACT_DISPATCHED_X] * 24, keep.activation_bytes[MOERT_ACT_SWIGLU_OUT] * 16);
    EXPECT_EQ_INT(keep.kept_bytes, keep.activation_bytes[0] + keep.activation_bytes[1] + keep.activation_bytes[2]);
    int combos = 0, identical = 0;
    for (int c = 1; c < 27; c++) {
        int act[MOERT_ACT_COUNT] = {c % 3, (c / 3) % 3, c / 9};
        run_snapshot s;
        if (!run_actions(act, &s)) {
            fprintf(stderr, "actions %s/%s/%s: the run failed\n", action_names[act[0]], action_names[act[1]],
                    action_names[act[2]]);
            test_failures++;
            free_snapshot(&s);
            continue;
        }
        int before = test_failures;
        for (int step = 0; step < 2; step++) {
            EXPECT(memcmp(&s.loss[step], &keep.loss[step], sizeof(double)) == 0);
            EXPECT(memcmp(s.output[step], keep.output[step], sizeof(double) * (size_t)s.output_numel) == 0);
            EXPECT(memcmp(s.grads[step], keep.grads[step], sizeof(double) * (size_t)s.grad_numel) == 0);
        }
        int64_t kept = 0;
        for (int a = 0; a < MOERT_ACT_COUNT; a++) {
            EXPECT_EQ_INT(s.activation_bytes[a], keep.activation_bytes[a]);
            if (act[a] == MOERT_MEMORY_KEEP) kept += keep.activation_bytes[a];
        }
        EXPECT_EQ_INT(s.kept_bytes, kept);
        if (test_failures != before)
            fprintf(stderr, "  ... with dispatched_x %s, fc1_out %s, swiglu_out %s\n", action_names[act[0]],
                    action_names[act[1]], action_names[act[2]]);
        else
            identical++;
        combos++;
        free_snapshot(&s);
    }
    printf("runtime: %d of %d combinations bit-identical to keep over 2 steps (loss %.6f, %lld activation bytes "
           "kept with keep)\n",
           identical, combos, keep.loss[0], (long long)keep.kept_bytes);
    free_snapshot(&keep);
}

/* ---- one layer: figures, pinned buffers, prefetch and deferred release ---- */

#define LH 32
#define LF 48
#define LE 4
#define LK 2
#define LT 64

typedef struct layer_result {
    void *y, *d_x, *grads[MOERT_PARAM_COUNT];
} layer_result;

static void free_result(layer_result *r)
{
    free(r->y);
    free(r->d_x);
    for (int p = 0; p < MOERT_PARAM_COUNT; p++) free(r->grads[p]);
    memset(r, 0, sizeof *r);
}

static void download_result(layer_harness *hz, layer_result *r)
{
    r->y = harness_download(hz, &hz->y);
    r->d_x = harness_download(hz, &hz->d_x);
    for (int p = 0; p < MOERT_PARAM_COUNT; p++) r->grads[p] = harness_download(hz, &hz->L.params[p].grad);
}

/* Bit equality of two results of the same layer. */
static bool same_result(layer_harness *hz, const layer_result *a, const layer_result *b)
{
    if (!a->y || !b->y || !a->d_x || !b->d_x) return false;
    bool same = memcmp(a->y, b->y, moert_tensor_bytes(&hz->y)) == 0 &&
                memcmp(a->d_x, b->d_x, moert_tensor_bytes(&hz->d_x)) == 0;
    for (int p = 0; p < MOERT_PARAM_COUNT; p++)
        same = same && a->grads[p] && b->grads[p] &&
               memcmp(a->grads[p], b->grads[p], moert_tensor_bytes(&hz->L.params[p].grad)) == 0;
    return same;
}

/* Runs one layer with the given actions (two steps) and checks its figures; fills *out with step 1's result. */
static void check_layer(const int act[MOERT_ACT_COUNT], bool prefetch, bool defer, const layer_result *reference,
                        layer_result *out)
{
    char json[256];
    snprintf(json, sizeof json, "{\"dispatched_x\": \"%s\", \"fc1_out\": \"%s\", \"swiglu_out\": \"%s\"}",
             action_names[act[0]], action_names[act[1]], action_names[act[2]]);
    layer_harness hz;
    int before = test_failures;
    moert_result rc = harness_open(&hz, moert_cpu(), LH, LF, LE, LK, LT, MOERT_F32, json);
    EXPECT_OK(rc);
    if (rc != MOERT_OK) goto exit;
    moert_layer *L = &hz.L;
    L->acts.defer_release = defer;
    L->acts.defer_start = defer;

    EXPECT_OK(moert_layer_zero_grad(L, true));
    EXPECT_OK(moert_layer_forward(L, &hz.x, &hz.y));
    int offloaded = 0;
    for (int a = 0; a < MOERT_ACT_COUNT; a++) {
        offloaded += act[a] == MOERT_MEMORY_OFFLOAD;
        /* deferred: the device copy waits for moert_layer_release_offloaded */
        EXPECT((L->acts.offload_pending[a].data != NULL) == (defer && act[a] == MOERT_MEMORY_OFFLOAD));
        EXPECT((L->acts.saved[a].data != NULL) == (act[a] == MOERT_MEMORY_KEEP));
    }
    if (defer) {
        /* deferred start: the copies wait for moert_layer_start_offloads (or a release, which issues them first) */
        for (int a = 0; a < MOERT_ACT_COUNT; a++)
            EXPECT_EQ_INT(L->acts.offload_queued[a], act[a] == MOERT_MEMORY_OFFLOAD);
        if (act[0] != MOERT_MEMORY_KEEP) EXPECT_OK(moert_act_store_start_offloads(&L->acts));
        for (int a = 0; a < MOERT_ACT_COUNT && act[0] != MOERT_MEMORY_KEEP; a++) EXPECT(!L->acts.offload_queued[a]);
        EXPECT_OK(moert_act_store_release_offloaded(&L->acts));
        for (int a = 0; a < MOERT_ACT_COUNT; a++) EXPECT(!L->acts.offload_queued[a]);
        for (int a = 0; a < MOERT_ACT_COUNT; a++) EXPECT(L->acts.offload_pending[a].data == NULL);
    }
    if (prefetch) {
        EXPECT_OK(moert_act_store_prefetch(&L->acts));
        for (int a = 0; a < MOERT_ACT_COUNT; a++)
            EXPECT_EQ_INT(L->acts.place[a], act[a] == MOERT_MEMORY_OFFLOAD     ? MOERT_PLACE_LOADING
                                            : act[a] == MOERT_MEMORY_RECOMPUTE ? MOERT_PLACE_DROPPED
                                                                               : MOERT_PLACE_DEVICE);
        EXPECT_OK(moert_act_store_prefetch(&L->acts)); /* idempotent */
    }
    EXPECT_OK(moert_layer_backward(L, &hz.d_y, &hz.d_x, 1.0));
    download_result(&hz, out);

    /* figures: world 1 without drops receives every copy, T*K rows */
    EXPECT_EQ_INT(L->layout.capacity, LT * LK);
    const int64_t cols[MOERT_ACT_COUNT] = {LH, 2 * LF, LF};
    int64_t kept = 0, recomputed = 0, moved = 0;
    for (int a = 0; a < MOERT_ACT_COUNT; a++) {
        int64_t bytes = LT * LK * cols[a] * 4;
        EXPECT_EQ_INT(L->acts.saved_bytes[a], bytes);
        EXPECT_EQ_INT(L->acts.action[a], act[a]);
        EXPECT_EQ_INT(L->acts.held_bytes[a], act[a] == MOERT_MEMORY_KEEP ? bytes : 0);
        if (act[a] == MOERT_MEMORY_KEEP) kept += bytes;
        if (act[a] == MOERT_MEMORY_RECOMPUTE) recomputed += bytes;
        if (act[a] == MOERT_MEMORY_OFFLOAD) {
            moved += bytes;
            EXPECT(L->acts.pinned_capacity[a] >= (size_t)bytes);
        } else {
            EXPECT(L->acts.pinned[a] == NULL);
        }
    }
    EXPECT_EQ_INT(L->acts.kept_bytes_peak, kept);
    EXPECT_EQ_INT(L->acts.recompute_saved_bytes, recomputed);
    EXPECT_EQ_INT(L->acts.offload_saved_bytes, moved);
    EXPECT_EQ_INT(L->acts.pinned_allocations, offloaded);
    EXPECT(L->acts.pinned_bytes >= moved);
    EXPECT_EQ_INT(L->acts.copy_streams_ready, offloaded > 0);
    if (reference) EXPECT(same_result(&hz, out, reference));

    /* a second step: the same bits, no new pinned buffer */
    int64_t pinned_bytes = L->acts.pinned_bytes;
    EXPECT_OK(harness_step(&hz, prefetch));
    layer_result second = {0};
    download_result(&hz, &second);
    EXPECT(same_result(&hz, &second, out));
    EXPECT_EQ_INT(L->acts.pinned_allocations, offloaded);
    EXPECT_EQ_INT(L->acts.pinned_bytes, pinned_bytes);
    free_result(&second);
exit:
    if (test_failures != before)
        fprintf(stderr, "  ... layer with %s (prefetch %d, deferred release %d)\n", json, prefetch, defer);
    harness_close(&hz);
}

static void check_layer_figures(void)
{
    layer_result keep = {0};
    const int keep_all[MOERT_ACT_COUNT] = {0, 0, 0};
    check_layer(keep_all, false, false, NULL, &keep);
    const int cases[][MOERT_ACT_COUNT] = {{2, 2, 2}, {1, 1, 1}, {2, 1, 0}, {1, 2, 2}, {0, 2, 1}, {2, 0, 2}};
    int n = 0;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        for (int variant = 0; variant < 3; variant++) {
            layer_result r = {0};
            check_layer(cases[i], variant == 1, variant == 2, &keep, &r);
            free_result(&r);
            n++;
        }
    printf("layer: %d action sets (plain, with prefetch, with deferred start and release) checked against keep\n", n);

    /* an offload whose deferred copy was never issued when its reload comes is cancelled: the device buffer is
     * used as it is, counted as kept, and the results stay the same bits */
    layer_harness hz;
    if (harness_open(&hz, moert_cpu(), LH, LF, LE, LK, LT, MOERT_F32, "{\"dispatched_x\": \"offload\"}") == MOERT_OK) {
        moert_layer *L = &hz.L;
        L->acts.defer_release = L->acts.defer_start = true;
        EXPECT_OK(moert_layer_zero_grad(L, true));
        EXPECT_OK(moert_layer_forward(L, &hz.x, &hz.y));
        EXPECT(L->acts.offload_queued[MOERT_ACT_DISPATCHED_X]);
        EXPECT_OK(moert_act_store_prefetch(&L->acts));
        EXPECT(!L->acts.offload_queued[MOERT_ACT_DISPATCHED_X]);
        EXPECT_EQ_INT(L->acts.place[MOERT_ACT_DISPATCHED_X], MOERT_PLACE_DEVICE);
        EXPECT_EQ_INT(L->acts.offload_cancelled_bytes, L->acts.saved_bytes[MOERT_ACT_DISPATCHED_X]);
        EXPECT_EQ_INT(L->acts.offload_saved_bytes, 0);
        EXPECT_OK(moert_layer_backward(L, &hz.d_y, &hz.d_x, 1.0));
        layer_result r = {0};
        download_result(&hz, &r);
        EXPECT(same_result(&hz, &r, &keep));
        free_result(&r);
        harness_close(&hz);
    } else {
        EXPECT(!"harness_open");
    }
    printf("layer: an offload never issued before its reload is cancelled, same bits\n");
    free_result(&keep);
}

/* ---- optimizers ---- */

static const char *optimizer_config =
    "{\"model\": {\"hidden\": 16, \"ffn_hidden\": 24, \"num_experts\": 4, \"topk\": 2, \"num_layers\": 2},"
    " \"parallel\": {\"ranks\": 2, \"device\": \"cpu\"},"
    " \"train\": {\"tokens_per_rank\": 32, \"seed\": 5, \"lr\": 0.02, \"weight_decay\": %s%s}}";

/* One step through the runtime; checks every parameter against the optimizer's formula from its value before
 * the step and the step's gradient (left in place by moert_runtime_step). */
static void check_runtime_optimizer(const char *optimizer, double weight_decay)
{
    char json[1024], wd[32], opt[64] = "";
    snprintf(wd, sizeof wd, "%g", weight_decay);
    if (optimizer) snprintf(opt, sizeof opt, ", \"optimizer\": \"%s\"", optimizer);
    snprintf(json, sizeof json, optimizer_config, wd, opt);
    bool sgd = optimizer && strcmp(optimizer, "sgd") == 0;
    moert_config *cfg = NULL;
    moert_runtime *rt = NULL;
    double *before = NULL;
    EXPECT_OK(moert_config_load_string(json, "optimizer", &cfg));
    if (!cfg) return;
    EXPECT_OK(moert_runtime_create(cfg, &rt));
    if (!rt) goto exit;
    int64_t total = 0;
    for (int p = 0; p < MOERT_PARAM_COUNT; p++) total += cfg->model.num_layers * moert_runtime_param_numel(rt, p);
    before = calloc((size_t)total, sizeof(double));
    if (!before) goto exit;
    int64_t k = 0;
    for (int l = 0; l < cfg->model.num_layers; l++)
        for (int p = 0; p < MOERT_PARAM_COUNT; p++)
            for (int64_t i = 0; i < moert_runtime_param_numel(rt, p); i++)
                EXPECT_OK(moert_runtime_param(rt, l, p, i, MOERT_PARAM_READ, &before[k++], NULL));
    EXPECT_OK(moert_runtime_step(rt, 1, NULL));
    const double lr = 0.02;
    int64_t exact = 0, moved = 0, checked = 0, bad = 0;
    double worst = 0.0;
    k = 0;
    for (int l = 0; l < cfg->model.num_layers; l++)
        for (int p = 0; p < MOERT_PARAM_COUNT; p++)
            for (int64_t i = 0; i < moert_runtime_param_numel(rt, p); i++, k++) {
                double after = 0, g = 0, p0 = before[k];
                EXPECT_OK(moert_runtime_param(rt, l, p, i, MOERT_PARAM_READ, &after, &g));
                double expected;
                if (sgd)
                    expected = p0 - lr * (g + weight_decay * p0);
                else /* Adam's first step: m^ = g, v^ = g^2 */
                    expected = p0 - lr * (g / (fabs(g) + 1e-8) + weight_decay * p0);
                double stored = (double)(float)expected;
                if (after == stored) exact++;
                if (after != p0) moved++;
                double err = fabs(after - expected);
                if (err > worst) worst = err;
                /* sgd: the same double formula, rounded once to fp32; Adam: within a few fp32 roundings */
                bool good = sgd && weight_decay == 0.0 ? after == stored : err <= 1e-6 * (1.0 + fabs(p0));
                if (!good && bad++ < 5)
                    fprintf(stderr, "%s: layer %d param %d[%lld]: %.9g, expected %.9g from %.9g and gradient %.9g\n",
                            optimizer ? optimizer : "adam", l, p, (long long)i, after, expected, p0, g);
                checked++;
            }
    printf("optimizer %s (weight decay %g): %lld parameters, %lld moved, %lld exactly p - lr*update in fp32, "
           "worst error %.2e\n",
           optimizer ? optimizer : "(default adam)", weight_decay, (long long)checked, (long long)moved,
           (long long)exact, worst);
    EXPECT_EQ_INT(bad, 0);
    EXPECT(moved > checked / 2);
    if (sgd && weight_decay == 0.0) EXPECT_EQ_INT(exact, checked);
exit:
    free(before);
    moert_runtime_destroy(rt);
    moert_config_free(cfg);
}

/* The trainer's SGD (harness/optim.c) on a layer's parameter after a backward: p - lr * g exactly in fp32. */
static void check_layer_sgd(void)
{
    layer_harness hz;
    moert_result rc = harness_open(&hz, moert_cpu(), LH, LF, LE, LK, LT, MOERT_F32, "{}");
    EXPECT_OK(rc);
    if (rc == MOERT_OK) {
        moert_layer *L = &hz.L;
        EXPECT_OK(harness_step(&hz, false));
        moert_param *fc1 = &L->params[MOERT_PARAM_FC1];
        int64_t n = moert_tensor_numel(&fc1->value);
        float *p0 = harness_download(&hz, &fc1->value);
        float *g = harness_download(&hz, &fc1->grad);
        const trainer_sgd sgd = {.lr = 0.05, .weight_decay = 0.0};
        EXPECT_OK(trainer_sgd_update(hz.stream, &sgd, &fc1->value, &fc1->grad));
        float *p1 = harness_download(&hz, &fc1->value);
        int64_t same = 0;
        for (int64_t i = 0; p0 && g && p1 && i < n; i++) same += p1[i] == (float)((double)p0[i] - 0.05 * (double)g[i]);
        EXPECT_EQ_INT(same, n);
        free(p0);
        free(g);
        free(p1);
    }
    harness_close(&hz);
}

int main(void)
{
    check_all_combinations();
    check_layer_figures();
    check_runtime_optimizer("sgd", 0.0);
    check_runtime_optimizer("sgd", 0.1);
    check_runtime_optimizer(NULL, 0.0);
    check_runtime_optimizer("adam", 0.1);
    check_layer_sgd();
    return test_finish("memory_actions");
}
