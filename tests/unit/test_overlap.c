/* SPDX-License-Identifier: Apache-2.0 */
/* Micro-batch overlap ($.parallel.overlap_micro_batches): the step with micro-batch i+1's forward merged with
 * micro-batch i's backward gives the losses, every gradient and the parameters after Adam steps of the sequential
 * schedule bit for bit, with threads as ranks (EP2, EP4), 2 and 3 layers, 2 to 4 micro-batches, fp64 and fp32, the
 * router's expert bias, z-loss, global aux loss and input jitter (state carried from forward to forward, shared by
 * the two slots), and recomputed or offloaded activations, the dispatchers alltoall, deepep and hybridep (whose
 * transfers wait on their peers'); each with the merged halves run one after the other (the CPU's way) and issued
 * stage by stage in turn (CUDA's way), also with the backward's expert GEMMs issued before the forward's routing
 * ($.parallel.overlap_dgrad_first) or after its routing and before its prepare ($.parallel.overlap_prepare_after_dgrads). Also: "auto" keeps it off on the CPU, "off" makes no second slot. */
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runtime.h"
#include "test_util.h"

typedef struct scenario {
    int ranks, layers, micro;
    const char *dtype;
    const char *router;
    const char *memory;
    const char *precision;  /* NULL: bf16 */
    const char *dispatcher; /* NULL: alltoall */
    bool dgrad_first; /* $.parallel.overlap_dgrad_first (the turns of the merged halves issued in another order) */
    bool prepare_after_dgrads; /* $.parallel.overlap_prepare_after_dgrads (another order again) */
} scenario;

static const char *config_text =
    "{\"model\": {\"hidden\": 16, \"ffn_hidden\": 12, \"num_experts\": 8, \"topk\": 2, \"num_layers\": %d,"
    " \"dtype\": \"%s\"},"
    " \"parallel\": {\"ranks\": %d, \"overlap_micro_batches\": \"%s\", \"overlap_dgrad_first\": %s,"
    " \"overlap_prepare_after_dgrads\": %s},"
    " \"train\": {\"tokens_per_rank\": 12, \"micro_batches\": %d, \"seed\": 5, \"lr\": 0.003, \"steps\": 2},"
    " \"router\": %s, \"memory_policy\": %s, \"precision\": %s, \"dispatcher\": {\"plugin\": \"%s\"}}";

static moert_runtime *make(const scenario *sc, const char *mode, moert_config **cfg)
{
    char json[2048];
    snprintf(json, sizeof json, config_text, sc->layers, sc->dtype, sc->ranks, mode, sc->dgrad_first ? "true" : "false",
             sc->prepare_after_dgrads ? "true" : "false", sc->micro, sc->router, sc->memory,
             sc->precision ? sc->precision : "{\"plugin\": \"bf16\"}", sc->dispatcher ? sc->dispatcher : "alltoall");
    moert_runtime *rt = NULL;
    *cfg = NULL;
    EXPECT_OK(moert_config_load_string(json, "overlap-test", cfg));
    if (*cfg) EXPECT_OK(moert_runtime_create(*cfg, &rt));
    return rt;
}

/* Every parameter's value and gradient of a and b, element by element; the count of those that differ. */
static int64_t param_mismatches(moert_runtime *a, moert_runtime *b, int layers)
{
    int64_t bad = 0;
    for (int l = 0; l < layers; l++)
        for (int p = 0; p < MOERT_PARAM_COUNT; p++) {
            const int64_t n = moert_runtime_param_numel(a, (moert_param_id)p);
            for (int64_t i = 0; i < n; i++) {
                double va = 0, ga = 0, vb = 0, gb = 0;
                if (moert_runtime_param(a, l, (moert_param_id)p, i, MOERT_PARAM_READ, &va, &ga) != MOERT_OK ||
                    moert_runtime_param(b, l, (moert_param_id)p, i, MOERT_PARAM_READ, &vb, &gb) != MOERT_OK)
                    return -1;
                if (memcmp(&va, &vb, sizeof va) || memcmp(&ga, &gb, sizeof ga)) bad++;
            }
        }
    return bad;
}

static void compare(const scenario *sc, bool interleave)
{
    moert_config *ca = NULL, *cb = NULL;
    moert_runtime *seq = make(sc, "off", &ca), *ovl = make(sc, "on", &cb);
    char what[512];
    snprintf(what, sizeof what, "EP%d, %d layers, %d micro-batches, %s, router %s, memory %s, precision %s, %s, %s%s",
             sc->ranks, sc->layers, sc->micro, sc->dtype, sc->router, sc->memory,
             sc->precision ? sc->precision : "bf16", sc->dispatcher ? sc->dispatcher : "alltoall",
             interleave ? "interleaved" : "in order", sc->dgrad_first ? ", dgrad first" : "");
    if (!seq || !ovl) {
        test_failures++;
        goto done;
    }
    EXPECT(!moert_runtime_overlap_set_interleave(seq, interleave));
    EXPECT(moert_runtime_overlap_set_interleave(ovl, interleave));
    /* two Adam steps (the expert bias moves at the end of each), then one more forward and backward */
    moert_train_options opts = {.struct_size = sizeof opts};
    EXPECT_OK(moert_runtime_train(seq, &opts));
    EXPECT_OK(moert_runtime_train(ovl, &opts));
    moert_run_summary a, b;
    moert_runtime_summary(seq, &a);
    moert_runtime_summary(ovl, &b);
    EXPECT_EQ_INT(a.record_count, b.record_count);
    for (int64_t s = 0; s < a.record_count && s < b.record_count; s++) {
        if (memcmp(&a.records[s].loss, &b.records[s].loss, sizeof(double)) ||
            memcmp(&a.records[s].router_loss, &b.records[s].router_loss, sizeof(double))) {
            fprintf(stderr, "FAIL %s: step %lld loss %.17g / %.17g, router %.17g / %.17g\n", what, (long long)s,
                    a.records[s].loss, b.records[s].loss, a.records[s].router_loss, b.records[s].router_loss);
            test_failures++;
        }
    }
    double la = 0, lb = 0;
    EXPECT_OK(moert_runtime_forward_backward(seq, 3, &la));
    EXPECT_OK(moert_runtime_forward_backward(ovl, 3, &lb));
    if (memcmp(&la, &lb, sizeof la)) {
        fprintf(stderr, "FAIL %s: loss %.17g / %.17g\n", what, la, lb);
        test_failures++;
    }
    /* the stack's output of the last micro-batch, on every rank */
    const int64_t n = moert_runtime_local_output_numel(seq) * moert_runtime_local_ranks(seq);
    double *ya = calloc((size_t)n, sizeof(double)), *yb = calloc((size_t)n, sizeof(double));
    EXPECT_OK(moert_runtime_read_output(seq, 0, moert_runtime_local_output_numel(seq), ya));
    EXPECT_OK(moert_runtime_read_output(ovl, 0, moert_runtime_local_output_numel(ovl), yb));
    if (memcmp(ya, yb, (size_t)n * sizeof(double))) {
        fprintf(stderr, "FAIL %s: the outputs differ\n", what);
        test_failures++;
    }
    free(ya);
    free(yb);
    const int64_t bad = param_mismatches(seq, ovl, sc->layers);
    if (bad != 0) {
        fprintf(stderr, "FAIL %s: %lld parameter values or gradients differ\n", what, (long long)bad);
        test_failures++;
    }
done:
    if (seq) moert_runtime_destroy(seq);
    if (ovl) moert_runtime_destroy(ovl);
    moert_config_free(ca);
    moert_config_free(cb);
}

static const char *bias_router = "{\"score_function\": \"sigmoid\", \"expert_bias\": true, \"bias_update_rate\": 0.05,"
                                 " \"z_loss_coeff\": 0.01}";
static const char *global_router = "{\"load_balancing\": \"global_aux_loss\", \"aux_loss_coeff\": 0.01,"
                                   " \"input_jitter_eps\": 0.1}";
static const char *keep = "{}";
static const char *recompute = "{\"dispatched_x\": \"recompute\", \"fc1_out\": \"recompute\","
                               " \"swiglu_out\": \"keep\"}";
/* FP8 on the CPU path: the delayed recipe's amax histories are carried from step to step (the slots share them) */
static const char *fp8_delayed = "{\"plugin\": \"fp8\", \"recipe\": \"delayed\", \"amax_history_len\": 4}";
static const char *fp8_current = "{\"plugin\": \"fp8\", \"recipe\": \"current\"}";
static const char *offload = "{\"dispatched_x\": \"offload\", \"fc1_out\": \"keep\", \"swiglu_out\": \"offload\"}";

/* "auto" on the CPU and "off" make no second slot; "on" with one micro-batch runs the sequential step. */
static void test_modes(void)
{
    scenario sc = {2, 2, 2, "fp64", bias_router, keep, NULL, NULL, false, false};
    moert_config *c = NULL;
    moert_runtime *rt = make(&sc, "auto", &c);
    if (rt) EXPECT(!moert_runtime_overlap_set_interleave(rt, false));
    if (rt) moert_runtime_destroy(rt);
    moert_config_free(c);
    sc.micro = 1;
    rt = make(&sc, "on", &c);
    if (rt) EXPECT(!moert_runtime_overlap_set_interleave(rt, false));
    double loss = 0;
    if (rt) EXPECT_OK(moert_runtime_forward_backward(rt, 1, &loss));
    if (rt) moert_runtime_destroy(rt);
    moert_config_free(c);
}

int main(void)
{
    const scenario scenarios[] = {
        {2, 2, 2, "fp64", bias_router, keep, NULL, NULL, false, false},
        {2, 3, 3, "fp64", global_router, keep, NULL, NULL, false, false},
        {4, 2, 4, "fp64", bias_router, keep, NULL, NULL, false, false},
        {4, 3, 3, "fp32", bias_router, keep, NULL, NULL, false, false},
        {2, 3, 4, "fp32", global_router, keep, NULL, NULL, false, false},
        {2, 2, 3, "fp64", bias_router, recompute, NULL, NULL, false, false},
        {2, 3, 2, "fp32", bias_router, offload, NULL, NULL, false, false},
        {4, 3, 4, "fp64", global_router, offload, NULL, NULL, false, false},
        {4, 2, 3, "fp32", bias_router, recompute, NULL, NULL, false, false},
        {2, 2, 3, "fp32", bias_router, keep, fp8_delayed, NULL, false, false},
        {2, 3, 2, "fp32", global_router, recompute, fp8_current, NULL, false, false},
        /* dispatchers whose transfers wait on their peers' (on GPUs their calls of both slots share one stream) */
        {2, 2, 3, "fp32", bias_router, keep, NULL, "deepep", false, false},
        {4, 3, 3, "fp64", global_router, recompute, NULL, "deepep", false, false},
        {2, 3, 3, "fp32", bias_router, offload, NULL, "hybridep", false, false},
        {4, 2, 4, "fp64", bias_router, keep, NULL, "hybridep", false, false},
        /* the backward's expert GEMMs issued before the forward's routing ($.parallel.overlap_dgrad_first) */
        {2, 2, 3, "fp32", bias_router, keep, NULL, "deepep", true, false},
        {4, 3, 4, "fp64", global_router, recompute, NULL, "alltoall", true, false},
        {4, 2, 3, "fp32", bias_router, offload, NULL, "hybridep", true, false},
        /* the backward's expert GEMMs issued after the forward's routing, before its prepare
         * ($.parallel.overlap_prepare_after_dgrads), alone and with the above */
        {2, 3, 3, "fp32", bias_router, keep, NULL, "deepep", false, true},
        {4, 2, 4, "fp64", global_router, recompute, NULL, "alltoall", false, true},
        {2, 2, 3, "fp64", bias_router, offload, NULL, "hybridep", true, true},
    };
    for (size_t i = 0; i < sizeof scenarios / sizeof scenarios[0]; i++) {
        compare(&scenarios[i], false);
        compare(&scenarios[i], true);
    }
    test_modes();
    return test_finish("overlap");
}
