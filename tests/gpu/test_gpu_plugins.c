/* SPDX-License-Identifier: Apache-2.0 */
/* GPU test of the plugins' CUDA paths against their CPU paths, which are the reference:
 * - the "alltoall" dispatcher on 1, 2 and 4 GPUs (as many as there are; a thread per GPU, NCCL for device
 *   buffers, the threads communicator for the count exchange), on the same random routing for both paths:
 *   uniform, one hot expert with the last rank's experts receiving nothing, a rank with no tokens, and padded
 *   groups; every case drops some copies. Dispatch and combine_backward must match bit for bit, combine and
 *   dispatch_backward's d_x within fp32-accumulation tolerance, d_topk_probs bit for bit; a second identical
 *   step must give the same bits and make no new cudaMalloc in the pool (buffers are reused). The steps and checks
 *   are tests/common/gpu_dispatch_test_harness.c's.
 * - the "bf16" precision plugin on every GPU of the largest world: FORWARD, DGRAD, WGRAD of fc1 and fc2 with
 *   bf16 activations, fp32 weights and an fp32 gradient (the executor's setting) against the CPU in bf16 mode,
 *   and with fp32 activations against the CPU in fp32 mode; padding rows untouched; the bf16 weight copy kept
 *   until end_step(); counts given only on the device; refused configurations.
 * Prints a table last. Exits 77 without a GPU. */
#include "test_util.h"

#ifndef MOERT_HAVE_CUDA

int main(void)
{
    printf("gpu_plugins: built without CUDA, skipped\n");
    return TEST_SKIP;
}

#else

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include "gpu_dispatch_test_harness.h"
#include "moert/precision.h"

#define DISPATCHER "alltoall"
#define PRECISION  "bf16"
#define TIMEOUT_S  60.0
#define MAX_WORLD  4

/* ---- the result tables ---- */

/* Guards the precision table, written by every rank thread. */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

typedef struct precision_row {
    char what[48];
    int devices;
    double err, tol;
} precision_row;

#define WORLDS         4 /* 1, 2, 4 and 8 GPUs, as many as the machine has */
static gpu_dispatch_row dispatch_table[WORLDS * 8];
static precision_row precision_table[64];
static int precision_len;

/* Records one precision figure: the largest error over devices. */
static void precision_record(const char *what, double err, double tol)
{
    pthread_mutex_lock(&lock);
    precision_row *r = NULL;
    for (int i = 0; i < precision_len; i++)
        if (strcmp(precision_table[i].what, what) == 0) r = &precision_table[i];
    if (!r && precision_len < 64) {
        r = &precision_table[precision_len++];
        snprintf(r->what, sizeof r->what, "%s", what);
        r->err = 0;
    }
    if (r) {
        r->devices++;
        r->tol = tol;
        if (!(err <= r->err)) r->err = err; /* NaN sticks */
    }
    pthread_mutex_unlock(&lock);
    if (!(err <= tol)) gpu_test_failure("precision %s: error %.3g > tolerance %.3g", what, err, tol);
}

/* ---- the worlds ---- */

/* What each rank of a world gets. */
typedef struct world_run {
    int world;
    gpu_dispatch_row *dispatch_rows; /* the world's first dispatch_table row */
    bool run_precision;
} world_run;

/* ---- the dispatcher ---- */

/* Every case with capacity_factor 3; the last with padded groups (pad_to_capacity). */
static const gpu_dispatch_case dispatch_cases[] = {
    {"uniform bf16 H64 K2", MOERT_BF16, 64, 8, 2, 96, 0.10, 0.0, false, false, false,
     "{\"pad_to_capacity\": false, \"capacity_factor\": 3.0}"},
    {"hot fp32 H33 K4", MOERT_F32, 33, 8, 4, 80, 0.15, 0.6, true, false, false,
     "{\"pad_to_capacity\": false, \"capacity_factor\": 3.0}"},
    {"no tokens on rank 0 bf16 K3", MOERT_BF16, 48, 16, 3, 50, 0.05, 0.0, false, true, false,
     "{\"pad_to_capacity\": false, \"capacity_factor\": 3.0}"},
    {"padded bf16 H64 K2", MOERT_BF16, 64, 8, 2, 64, 0.10, 0.0, false, false, false,
     "{\"pad_to_capacity\": true, \"capacity_factor\": 3.0}"},
};
#define DISPATCH_CASES ((int)(sizeof dispatch_cases / sizeof dispatch_cases[0]))

static const gpu_dispatch_plugin alltoall = {.name = DISPATCHER,
                                             .max_world = MAX_WORLD,
                                             .read_cpu_layout = gpu_dispatch_read_host_cpu_layout,
                                             .read_cuda_layout = gpu_dispatch_read_host_cuda_layout,
                                             .no_timeout_option = true,
                                             .count_step2_mallocs = true};

/* ---- the bf16 precision plugin ---- */

#define P_HIDDEN  64
#define P_FFN     40
#define P_EXPERTS 4
#define P_PAD     3 /* rows past the counts: must stay untouched */

/* Operands of one grouped GEMM on the host (activations in act, weights and weight gradients fp32). */
typedef struct gemm_host {
    int64_t rows, k_in, n_out;
    moert_dtype act;
    void *input, *grad_output;   /* [rows, k_in], [rows, n_out] */
    float *weight, *grad_weight; /* [E, k_in, n_out]; grad_weight's starting values */
} gemm_host;

static void gemm_host_make(gemm_host *g, moert_gemm_weight which, moert_dtype act, int64_t rows, uint64_t *rng)
{
    g->rows = rows;
    g->act = act;
    g->k_in = which == MOERT_GEMM_FC1 ? P_HIDDEN : P_FFN;
    g->n_out = which == MOERT_GEMM_FC1 ? 2 * P_FFN : P_HIDDEN;
    const size_t es = moert_dtype_size(act);
    const int64_t wn = P_EXPERTS * g->k_in * g->n_out;
    g->input = gpu_test_host_alloc((size_t)(rows * g->k_in) * es);
    g->grad_output = gpu_test_host_alloc((size_t)(rows * g->n_out) * es);
    g->weight = gpu_test_host_alloc((size_t)wn * sizeof(float));
    g->grad_weight = gpu_test_host_alloc((size_t)wn * sizeof(float));
    gpu_test_fill_random(g->input, act, rows * g->k_in, rng, 1.0);
    gpu_test_fill_random(g->grad_output, act, rows * g->n_out, rng, 1.0);
    gpu_test_fill_random(g->weight, MOERT_F32, wn, rng, 0.25);
    gpu_test_fill_random(g->grad_weight, MOERT_F32, wn, rng, 1.0);
}

static void gemm_host_free(gemm_host *g)
{
    free(g->input);
    free(g->grad_output);
    free(g->weight);
    free(g->grad_weight);
}

/* Result of one pass: the output ([rows, n_out], [rows, k_in] or [E, k_in, n_out] fp32). */
typedef struct gemm_result {
    void *data;
    size_t bytes;
    moert_dtype dtype;
    int64_t valid_elems; /* elements before the padding rows (all of them for WGRAD) */
} gemm_result;

/* Runs one pass on the CPU (device NULL) or the GPU with the same inputs; weight_override replaces the weight. */
static bool gemm_run(test_instance *ti, const gpu_test_rank_env *env, bool on_gpu, moert_gemm_weight which,
                     moert_gemm_pass pass, const gemm_host *g, const int64_t *counts, bool host_counts,
                     const void *device_weight, gemm_result *out)
{
    const moert_precision_v1 *vt = (const moert_precision_v1 *)ti->plugin.header;
    const moert_device dev = on_gpu ? gpu_test_rank_device(env) : moert_cpu();
    const cudaStream_t s = on_gpu ? env->stream : NULL;
    const size_t es = moert_dtype_size(g->act);
    const int64_t rows = g->rows, K = g->k_in, N = g->n_out, wn = P_EXPERTS * K * N;
    int64_t used = 0;
    for (int e = 0; e < P_EXPERTS; e++) used += counts[e];
    const size_t in_b = (size_t)(rows * K) * es, go_b = (size_t)(rows * N) * es, w_b = (size_t)wn * sizeof(float);
    void *input = on_gpu ? gpu_test_device_copy(s, g->input, in_b) : g->input;
    void *grad_output = on_gpu ? gpu_test_device_copy(s, g->grad_output, go_b) : g->grad_output;
    void *weight = device_weight ? (void *)device_weight : on_gpu ? gpu_test_device_copy(s, g->weight, w_b) : g->weight;
    void *counts_dev = on_gpu ? gpu_test_device_copy(s, counts, P_EXPERTS * sizeof(int64_t)) : (void *)counts;

    out->dtype = pass == MOERT_GEMM_WGRAD ? MOERT_F32 : g->act;
    out->bytes = pass == MOERT_GEMM_FORWARD ? go_b : pass == MOERT_GEMM_DGRAD ? in_b : w_b;
    out->valid_elems = pass == MOERT_GEMM_FORWARD ? used * N : pass == MOERT_GEMM_DGRAD ? used * K : wn;
    out->data = gpu_test_host_alloc(out->bytes);
    void *result = NULL;
    if (pass == MOERT_GEMM_WGRAD)
        result = on_gpu ? gpu_test_device_copy(s, g->grad_weight, w_b) : out->data;
    else
        result = on_gpu ? gpu_test_device_poisoned(s, out->bytes) : out->data;
    if (pass == MOERT_GEMM_WGRAD && !on_gpu) memcpy(out->data, g->grad_weight, w_b);
    if (pass != MOERT_GEMM_WGRAD && !on_gpu) memset(out->data, 0xFF, out->bytes);

    moert_tensor tin = moert_tensor_2d(input, dev, g->act, rows, K),
                 tgo = moert_tensor_2d(grad_output, dev, g->act, rows, N);
    moert_tensor tw = moert_tensor_3d(weight, dev, MOERT_F32, P_EXPERTS, K, N);
    moert_tensor tcounts = moert_tensor_1d(counts_dev, dev, MOERT_I64, P_EXPERTS);
    moert_tensor tout = moert_tensor_2d(result, dev, g->act, rows, N),
                 tgi = moert_tensor_2d(result, dev, g->act, rows, K);
    moert_tensor tgw = moert_tensor_3d(result, dev, MOERT_F32, P_EXPERTS, K, N);
    moert_grouped_gemm_args a = {.struct_size = sizeof a,
                                 .which = which,
                                 .pass = pass,
                                 .tokens_per_expert = &tcounts,
                                 .tokens_per_expert_host = host_counts ? counts : NULL};
    switch (pass) {
    case MOERT_GEMM_FORWARD:
        a.input = &tin;
        a.weight = &tw;
        a.output = &tout;
        break;
    case MOERT_GEMM_DGRAD:
        a.grad_output = &tgo;
        a.weight = &tw;
        a.grad_input = &tgi;
        break;
    default:
        a.input = &tin;
        a.grad_output = &tgo;
        a.grad_weight = &tgw;
        break;
    }
    bool ok = CALL(ti, vt->grouped_gemm(ti->ctx, (moert_stream)s, &a), env->where);
    if (on_gpu) {
        if (ok) gpu_test_download(s, out->data, result, out->bytes);
        CK(cudaStreamSynchronize(s));
        CK(cudaFree(input));
        CK(cudaFree(grad_output));
        if (!device_weight) CK(cudaFree(weight));
        CK(cudaFree(counts_dev));
        CK(cudaFree(result));
    }
    return ok;
}

/* GPU against CPU for one pass; also checks that the GPU left the padding rows as they were (poisoned). */
static void gemm_compare(const char *label, const gemm_result *gpu, const gemm_result *cpu, double tol)
{
    double err = gpu_test_rel_error(gpu->data, cpu->data, gpu->dtype, gpu->valid_elems);
    const size_t es = moert_dtype_size(gpu->dtype);
    if (!gpu_test_all_poison((const char *)gpu->data + (size_t)gpu->valid_elems * es,
                             gpu->bytes - (size_t)gpu->valid_elems * es))
        err = INFINITY; /* a padding row was written */
    precision_record(label, err, tol);
}

/* The three passes of both GEMMs, GPU (auto mode) against CPU (the same arithmetic's mode). */
static void precision_passes(const gpu_test_rank_env *env, moert_dtype act, const int64_t *counts, uint64_t *rng)
{
    const bool bf16 = act == MOERT_BF16;
    const double tol = bf16 ? 1e-2 : 1e-5, wgrad_tol = 1e-5;
    moert_layer_info layer = test_layer(P_HIDDEN, P_FFN, P_EXPERTS * env->world, 2, 256, env->world, env->rank, act);
    layer.num_local_experts = P_EXPERTS;
    layer.first_local_expert = P_EXPERTS * env->rank;
    moert_layer_info gpu_layer = layer;
    gpu_layer.device = gpu_test_rank_device(env);
    test_instance cpu, gpu;
    if (test_instance_open(&cpu, MOERT_KIND_PRECISION, PRECISION,
                           bf16 ? "{\"mode\": \"bf16\"}" : "{\"mode\": \"fp32\"}", &layer, NULL, 0, 1) != MOERT_OK ||
        test_instance_open_cuda(&gpu, MOERT_KIND_PRECISION, PRECISION, "{}", &gpu_layer, NULL, 0, 1, env->pool, NULL,
                                (moert_stream)env->stream) != MOERT_OK) {
        gpu_test_failure("%s: opening the precision plugin: %s", env->where, moert_error_message());
        test_instance_close(&cpu);
        test_instance_close(&gpu);
        return;
    }
    int64_t rows = P_PAD;
    for (int e = 0; e < P_EXPERTS; e++) rows += counts[e];
    static const char *const pass_names[3] = {"forward", "dgrad", "wgrad"};
    for (int w = 0; w < 2; w++) {
        gemm_host g;
        gemm_host_make(&g, (moert_gemm_weight)w, act, rows, rng);
        for (int pass = 0; pass < 3; pass++) {
            gemm_result rg = {0}, rc = {0};
            bool ok =
                gemm_run(&cpu, env, false, (moert_gemm_weight)w, (moert_gemm_pass)pass, &g, counts, true, NULL, &rc) &&
                gemm_run(&gpu, env, true, (moert_gemm_weight)w, (moert_gemm_pass)pass, &g, counts, true, NULL, &rg);
            char label[48];
            snprintf(label, sizeof label, "%s fc%d %s%s", bf16 ? "bf16" : "fp32", w + 1, pass_names[pass],
                     pass == MOERT_GEMM_WGRAD ? " (fp32 dW +=)" : "");
            if (ok) gemm_compare(label, &rg, &rc, pass == MOERT_GEMM_WGRAD ? wgrad_tol : tol);
            free(rg.data);
            free(rc.data);
        }
        /* the step's weights change between steps: end_step() lets the next GEMM see them */
        CALL(&gpu, ((const moert_precision_v1 *)gpu.plugin.header)->end_step(gpu.ctx, (moert_stream)env->stream),
             env->where);
        gemm_host_free(&g);
    }
    test_instance_close(&cpu);
    test_instance_close(&gpu);
}

/*
 * The bf16 weight copy: made on first use, kept while the weight pointer is the same until end_step()
 * (a weight changed in place without end_step() is not seen: the copy of this step is used), then remade.
 * Also the counts given only on the device (the plugin copies them down).
 */
static void precision_cache(const gpu_test_rank_env *env, const int64_t *counts, uint64_t *rng)
{
    moert_layer_info gpu_layer =
        test_layer(P_HIDDEN, P_FFN, P_EXPERTS * env->world, 2, 256, env->world, env->rank, MOERT_BF16);
    gpu_layer.num_local_experts = P_EXPERTS;
    gpu_layer.first_local_expert = P_EXPERTS * env->rank;
    moert_layer_info cpu_layer = gpu_layer;
    cpu_layer.device = moert_cpu();
    gpu_layer.device = gpu_test_rank_device(env);
    test_instance cpu, gpu;
    if (test_instance_open(&cpu, MOERT_KIND_PRECISION, PRECISION, "{\"mode\": \"bf16\"}", &cpu_layer, NULL, 0, 1) !=
            MOERT_OK ||
        test_instance_open_cuda(&gpu, MOERT_KIND_PRECISION, PRECISION, "{}", &gpu_layer, NULL, 0, 1, env->pool, NULL,
                                (moert_stream)env->stream) != MOERT_OK) {
        gpu_test_failure("%s: opening the precision plugin: %s", env->where, moert_error_message());
        test_instance_close(&cpu);
        test_instance_close(&gpu);
        return;
    }
    const moert_precision_v1 *vt = (const moert_precision_v1 *)gpu.plugin.header;
    int64_t rows = P_PAD;
    for (int e = 0; e < P_EXPERTS; e++) rows += counts[e];
    gemm_host a, b;
    gemm_host_make(&a, MOERT_GEMM_FC1, MOERT_BF16, rows, rng);
    gemm_host_make(&b, MOERT_GEMM_FC1, MOERT_BF16, rows, rng);
    memcpy(b.input, a.input, (size_t)(rows * a.k_in) * sizeof(uint16_t)); /* only the weights differ */
    const size_t w_b = (size_t)(P_EXPERTS * a.k_in * a.n_out) * sizeof(float);
    void *weight = gpu_test_device_copy(env->stream, a.weight, w_b);

    gemm_result first = {0}, stale = {0}, fresh = {0}, ref_b = {0}, device_counts = {0}, ref_a = {0};
    bool ok = gemm_run(&gpu, env, true, MOERT_GEMM_FC1, MOERT_GEMM_FORWARD, &a, counts, true, weight, &first);
    /* the weights change in place; without end_step() this step's bf16 copy is still used */
    CK(cudaMemcpyAsync(weight, b.weight, w_b, cudaMemcpyHostToDevice, env->stream));
    ok = ok && gemm_run(&gpu, env, true, MOERT_GEMM_FC1, MOERT_GEMM_FORWARD, &a, counts, true, weight, &stale);
    ok = ok && CALL(&gpu, vt->end_step(gpu.ctx, (moert_stream)env->stream), env->where);
    ok = ok && gemm_run(&gpu, env, true, MOERT_GEMM_FC1, MOERT_GEMM_FORWARD, &b, counts, true, weight, &fresh);
    ok = ok && gemm_run(&cpu, env, false, MOERT_GEMM_FC1, MOERT_GEMM_FORWARD, &b, counts, true, NULL, &ref_b);
    ok = ok && gemm_run(&cpu, env, false, MOERT_GEMM_FC1, MOERT_GEMM_FORWARD, &a, counts, true, NULL, &ref_a);
    /* counts only on the device: the same GEMM, the same bits */
    ok = ok && gemm_run(&gpu, env, true, MOERT_GEMM_FC1, MOERT_GEMM_FORWARD, &b, counts, false, weight, &device_counts);
    if (ok) {
        precision_record("bf16 cache: same step, weights changed",
                         (double)gpu_test_bytes_differ(stale.data, first.data, first.bytes), 0);
        gemm_compare("bf16 cache: first use vs CPU", &first, &ref_a, 1e-2);
        gemm_compare("bf16 cache: after end_step vs CPU", &fresh, &ref_b, 1e-2);
        precision_record("bf16 counts on the device only",
                         (double)gpu_test_bytes_differ(device_counts.data, fresh.data, fresh.bytes), 0);
    }
    gemm_result *all[] = {&first, &stale, &fresh, &ref_b, &device_counts, &ref_a};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) free(all[i]->data);
    CK(cudaStreamSynchronize(env->stream));
    CK(cudaFree(weight));
    gemm_host_free(&a);
    gemm_host_free(&b);
    test_instance_close(&cpu);
    test_instance_close(&gpu);
}

/* Configurations the CUDA path refuses at init, with a message naming why. */
static void precision_refusals(const gpu_test_rank_env *env)
{
    struct {
        moert_dtype dtype;
        const char *options, *needle;
    } cases[] = {{MOERT_F64, "{}", "no fp64 GEMMs on CUDA"},
                 {MOERT_F32, "{\"mode\": \"bf16\"}", "option \"mode\": \"bf16\" with fp32 activations"},
                 {MOERT_BF16, "{\"mode\": \"fp64\"}", "no fp64 GEMMs on CUDA"}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        moert_layer_info layer = test_layer(P_HIDDEN, P_FFN, P_EXPERTS, 2, 256, 1, 0, cases[i].dtype);
        layer.device = gpu_test_rank_device(env);
        test_instance ti;
        moert_result rc = test_instance_open_cuda(&ti, MOERT_KIND_PRECISION, PRECISION, cases[i].options, &layer, NULL,
                                                  0, 1, env->pool, NULL, (moert_stream)env->stream);
        const char *msg = moert_error_message();
        bool ok = rc == MOERT_ERR_UNSUPPORTED && strstr(msg, cases[i].needle) != NULL && ti.ctx == NULL;
        char label[48];
        snprintf(label, sizeof label, "refused: %s mode %s", moert_dtype_name(cases[i].dtype),
                 strstr(cases[i].options, "mode") ? (strstr(cases[i].options, "bf16") ? "bf16" : "fp64") : "auto");
        precision_record(label, ok ? 0 : 1, 0);
        if (!ok) gpu_test_failure("%s: %s: got %s \"%s\"", env->where, label, moert_result_name(rc), msg);
        test_instance_close(&ti);
    }
}

static void run_precision(const gpu_test_rank_env *env)
{
    uint64_t rng = 777 + (uint64_t)env->rank;
    /* an empty expert, a small one, a hot one; rotated by rank */
    const int64_t base[P_EXPERTS] = {0, 37, 5, 90};
    int64_t counts[P_EXPERTS];
    for (int e = 0; e < P_EXPERTS; e++) counts[e] = base[(e + env->rank) % P_EXPERTS];
    precision_passes(env, MOERT_BF16, counts, &rng);
    precision_passes(env, MOERT_F32, counts, &rng);
    precision_cache(env, counts, &rng);
    precision_refusals(env);
}

/* ---- ranks ---- */

/* One rank of a world: every dispatcher case, then the precision plugin where the world is the largest. */
static void rank_main(const gpu_test_rank_env *env, void *user)
{
    world_run *w = user;
    for (int ci = 0; ci < DISPATCH_CASES; ci++)
        gpu_dispatch_run_case(&alltoall, env, &dispatch_cases[ci], ci, &w->dispatch_rows[ci]);
    if (w->run_precision) run_precision(env);
}

/* ---- the table ---- */

static void print_tables(void)
{
    gpu_dispatch_print_rows(&alltoall, dispatch_table, (int)(sizeof dispatch_table / sizeof dispatch_table[0]));
    printf("\nbf16 precision, CUDA vs CPU (largest error over devices)\n");
    printf("%-40s  %7s  %9s  %9s  %s\n", "check", "devices", "error", "tolerance", "ok");
    for (int i = 0; i < precision_len; i++) {
        const precision_row *r = &precision_table[i];
        printf("%-40s  %7d  %9.2e  %9.2e  %s\n", r->what, r->devices, r->err, r->tol, r->err <= r->tol ? "ok" : "FAIL");
    }
}

int main(void)
{
    int gpus = gpu_test_device_count("gpu_plugins");
    if (gpus == 0) return TEST_SKIP;
    /* keep both plugins (and the CUDA libraries they pull in) loaded while instances come and go */
    moert_plugin keep_dispatcher, keep_precision;
    memset(&keep_dispatcher, 0, sizeof keep_dispatcher);
    memset(&keep_precision, 0, sizeof keep_precision);
    EXPECT_OK(moert_plugin_load(MOERT_KIND_DISPATCHER, DISPATCHER, &keep_dispatcher));
    EXPECT_OK(moert_plugin_load(MOERT_KIND_PRECISION, PRECISION, &keep_precision));
    if (test_failures) return test_finish("gpu_plugins");

    const int worlds[WORLDS] = {1, 2, 4, 8};
    int largest = 1;
    for (int i = 0; i < WORLDS; i++)
        if (worlds[i] <= gpus) largest = worlds[i];
    for (int i = 0; i < WORLDS; i++) {
        if (worlds[i] > gpus) continue;
        world_run w = {.world = worlds[i],
                       .dispatch_rows = &dispatch_table[i * DISPATCH_CASES],
                       .run_precision = worlds[i] == largest};
        gpu_dispatch_rows_init(w.dispatch_rows, worlds[i], dispatch_cases, DISPATCH_CASES);
        gpu_test_run_world(w.world, TIMEOUT_S, rank_main, &w);
    }
    print_tables();
    moert_plugin_unload(&keep_dispatcher);
    moert_plugin_unload(&keep_precision);
    return test_finish("gpu_plugins");
}

#endif
