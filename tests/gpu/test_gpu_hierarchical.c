/* SPDX-License-Identifier: Apache-2.0 */
/* GPU test of the "hierarchical" dispatcher's CUDA path against its CPU path, which is the reference, on 1, 2 and 4
 * GPUs (as many as there are; a thread per GPU, NCCL for device buffers, the threads communicator for the counts and
 * the routing that prepare() exchanges) in nodes of every size dividing the world (2 GPUs: 2 nodes of 1 and 1 node
 * of 2; 4 GPUs: 4 x 1, 2 x 2, 1 x 4), on the same random routing for both paths: uniform, one hot expert, a rank
 * without tokens, and many experts with K 8 (many tokens with several copies on one node). Dispatch and
 * combine_backward must match bit for bit, and d_topk_probs (one value per copy); combine and dispatch_backward's d_x
 * within fp32-accumulation tolerance (both round each node's partial to the row dtype; the CPU sums in double, the
 * CUDA path in fp32); a second identical step must give the same bits and make no new cudaMalloc in the pool.
 * Prints a table last. Exits 77 without a GPU. */
#include "test_util.h"

#ifndef MOERT_HAVE_CUDA

int main(void)
{
    printf("gpu_hierarchical: built without CUDA, skipped\n");
    return TEST_SKIP;
}

#else

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include "gpu_test_util.h"
#include "moert/dispatcher.h"

#define DISPATCHER "hierarchical"
#define TIMEOUT_S  60.0
#define MAX_WORLD  4
#define MAX_ROWS   16 /* table rows per case: (world, ranks_per_node) pairs */

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

typedef struct result_row {
    int world, ranks_per_node;
    const char *name;
    int64_t recv_rows, layout_diffs, dispatch_diffs, combine_bwd_diffs, dprobs_diffs, repeat_diffs, step2_mallocs;
    double combine_err, dx_err, tol, inter_bytes, intra_bytes;
    bool ran;
} result_row;

typedef struct test_case {
    const char *name;
    moert_dtype dtype;
    int64_t hidden, experts, topk, tokens; /* rank r has tokens + 5*r tokens */
    double drop, hot;                      /* probability that a copy is dropped / goes to expert 0 */
    bool empty_first;                      /* rank 0 has no tokens */
} test_case;

static const test_case cases[] = {
    {"uniform bf16 H64 K2", MOERT_BF16, 64, 8, 2, 96, 0.10, 0.0, false},
    {"hot fp32 H33 K4", MOERT_F32, 33, 8, 4, 80, 0.15, 0.6, false},
    {"no tokens on rank 0 bf16 K3", MOERT_BF16, 48, 16, 3, 50, 0.05, 0.0, true},
    {"E32 K8 fp32 H128", MOERT_F32, 128, 32, 8, 200, 0.05, 0.0, false},
};
#define CASES      ((int)(sizeof cases / sizeof cases[0]))

static result_row table[MAX_ROWS * CASES];
static int table_rows;

/* What each rank of a world gets. */
typedef struct world_run {
    int world, ranks_per_node;
    int table_base;
} world_run;

/* topk_idx [T,K]: distinct experts per token, some dropped, optionally one hot expert. */
static void make_routing(const test_case *cs, int64_t tokens, uint64_t *rng, int32_t *idx)
{
    const int64_t E = cs->experts, K = cs->topk;
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t k = 0; k < K; k++) {
            int32_t e = -1;
            if ((test_uniform(rng) + 1) / 2 >= cs->drop) {
                for (int attempt = 0; attempt < 32 && e < 0; attempt++) {
                    int32_t pick = (test_uniform(rng) + 1) / 2 < cs->hot
                                       ? 0
                                       : (int32_t)((test_uniform(rng) + 1) / 2 * (double)E) % (int32_t)E;
                    bool used = false;
                    for (int64_t j = 0; j < k; j++) used = used || idx[t * K + j] == pick;
                    if (!used) e = pick;
                }
            }
            idx[t * K + k] = e;
        }
}

/* One step's host data: inputs, and the outputs of one path. */
typedef struct step_data {
    int64_t T, H, K, cap, num_recv, tokens_per_expert[64], tokens_per_expert_dev[64];
    size_t es;
    int32_t *idx;
    void *x, *y_expert, *d_y, *d_recv_x, *d_x0;
    float *probs, *d_recv_probs;
    void *recv_x, *y, *d_y_expert, *d_x; /* outputs; recv_x with 2 rows past capacity */
    float *recv_probs, *d_topk_probs;
    double inter_bytes, intra_bytes; /* dispatch.bytes_internode / _intranode of the last dispatch */
} step_data;

static void outputs_alloc(step_data *o, const step_data *d)
{
    const size_t rowb = (size_t)d->H * d->es;
    o->recv_x = gpu_test_host_alloc((size_t)(d->cap + 2) * rowb);
    o->recv_probs = gpu_test_host_alloc((size_t)d->cap * sizeof(float));
    o->y = gpu_test_host_alloc((size_t)d->T * rowb);
    o->d_y_expert = gpu_test_host_alloc((size_t)d->cap * rowb);
    o->d_x = gpu_test_host_alloc((size_t)d->T * rowb);
    o->d_topk_probs = gpu_test_host_alloc((size_t)(d->T * d->K) * sizeof(float));
}

static void outputs_free(step_data *o)
{
    free(o->recv_x);
    free(o->recv_probs);
    free(o->y);
    free(o->d_y_expert);
    free(o->d_x);
    free(o->d_topk_probs);
}

/* The four calls after prepare() on tensors at dev (host pointers on the CPU, device pointers on the GPU). */
static bool run_calls(test_instance *ti, moert_stream stream, moert_device dev, moert_dtype dt, const step_data *d,
                      void *x, void *probs, void *recv_x, void *recv_probs, void *y_expert, void *y, void *d_y,
                      void *d_y_expert, void *d_recv_x, void *d_recv_probs, void *d_x, void *d_topk_probs,
                      const char *where)
{
    const moert_dispatcher_v1 *vt = (const moert_dispatcher_v1 *)ti->plugin.header;
    const int64_t T = d->T, H = d->H, K = d->K, cap = d->cap;
    moert_tensor xt = moert_tensor_2d(x, dev, dt, T, H), pt = moert_tensor_2d(probs, dev, MOERT_F32, T, K);
    moert_tensor rx = moert_tensor_2d(recv_x, dev, dt, cap, H), rp = moert_tensor_1d(recv_probs, dev, MOERT_F32, cap);
    moert_dispatch_args da = {.struct_size = sizeof da, .x = &xt, .topk_probs = &pt, .recv_x = &rx, .recv_probs = &rp};
    moert_tensor ye = moert_tensor_2d(y_expert, dev, dt, cap, H), yt = moert_tensor_2d(y, dev, dt, T, H);
    moert_combine_args ca = {.struct_size = sizeof ca, .y_expert = &ye, .y = &yt};
    moert_tensor dy = moert_tensor_2d(d_y, dev, dt, T, H), dye = moert_tensor_2d(d_y_expert, dev, dt, cap, H);
    moert_combine_backward_args cb = {.struct_size = sizeof cb, .d_y = &dy, .d_y_expert = &dye};
    moert_tensor drx = moert_tensor_2d(d_recv_x, dev, dt, cap, H);
    moert_tensor drp = moert_tensor_1d(d_recv_probs, dev, MOERT_F32, cap);
    moert_tensor dx = moert_tensor_2d(d_x, dev, dt, T, H), dtp = moert_tensor_2d(d_topk_probs, dev, MOERT_F32, T, K);
    moert_dispatch_backward_args db = {
        .struct_size = sizeof db, .d_recv_x = &drx, .d_recv_probs = &drp, .d_x = &dx, .d_topk_probs = &dtp};
    return CALL(ti, vt->dispatch(ti->ctx, stream, &da), where) && CALL(ti, vt->combine(ti->ctx, stream, &ca), where) &&
           CALL(ti, vt->combine_backward(ti->ctx, stream, &cb), where) &&
           CALL(ti, vt->dispatch_backward(ti->ctx, stream, &db), where);
}

/* The CPU path: the reference, and the capacity-sized inputs. */
static bool run_cpu(test_instance *ti, const test_case *cs, int world, step_data *d, uint64_t *rng, const char *where)
{
    const moert_dispatcher_v1 *vt = (const moert_dispatcher_v1 *)ti->plugin.header;
    moert_tensor idx = moert_tensor_2d(d->idx, moert_cpu(), MOERT_I32, d->T, d->K);
    moert_dispatch_layout layout = {.struct_size = sizeof layout};
    if (!CALL(ti, vt->prepare(ti->ctx, NULL, &idx, &layout), where)) return false;
    d->cap = layout.capacity;
    d->num_recv = layout.num_recv;
    for (int64_t l = 0; l < cs->experts / world; l++) d->tokens_per_expert[l] = layout.tokens_per_expert_host[l];
    d->y_expert = gpu_test_host_alloc((size_t)(d->cap * d->H) * d->es);
    d->d_recv_x = gpu_test_host_alloc((size_t)(d->cap * d->H) * d->es);
    d->d_recv_probs = gpu_test_host_alloc((size_t)d->cap * sizeof(float));
    gpu_test_fill_random(d->y_expert, cs->dtype, d->cap * d->H, rng, 1.0);
    gpu_test_fill_random(d->d_recv_x, cs->dtype, d->cap * d->H, rng, 1.0);
    gpu_test_fill_random(d->d_recv_probs, MOERT_F32, d->cap, rng, 1.0);
    outputs_alloc(d, d);
    memcpy(d->d_x, d->d_x0, (size_t)(d->T * d->H) * d->es);
    return run_calls(ti, NULL, moert_cpu(), cs->dtype, d, d->x, d->probs, d->recv_x, d->recv_probs, d->y_expert, d->y,
                     d->d_y, d->d_y_expert, d->d_recv_x, d->d_recv_probs, d->d_x, d->d_topk_probs, where);
}

/* Device copies of the inputs, made once per case. */
typedef struct device_inputs {
    void *idx, *x, *probs, *y_expert, *d_y, *d_recv_x, *d_recv_probs;
} device_inputs;

/* One CUDA step with poisoned outputs, downloaded into g. */
static bool run_cuda_step(const gpu_test_rank_env *env, test_instance *ti, const test_case *cs, const step_data *d,
                          const device_inputs *in, step_data *g, const char *where)
{
    const moert_dispatcher_v1 *vt = (const moert_dispatcher_v1 *)ti->plugin.header;
    const moert_device gpu = gpu_test_rank_device(env);
    const cudaStream_t s = env->stream;
    const int64_t T = d->T, K = d->K, cap = d->cap, El = cs->experts / env->world;
    const size_t row = (size_t)d->H * d->es;
    moert_tensor idx = moert_tensor_2d(in->idx, gpu, MOERT_I32, T, K);
    moert_dispatch_layout layout = {.struct_size = sizeof layout};
    if (!CALL(ti, vt->prepare(ti->ctx, (moert_stream)s, &idx, &layout), where)) return false;
    g->num_recv = layout.num_recv;
    g->cap = layout.capacity;
    if (layout.capacity != cap || layout.tokens_per_expert.device.type != MOERT_DEVICE_CUDA ||
        !layout.tokens_per_expert_host) {
        gpu_test_failure("%s: CUDA layout: capacity %lld (CPU %lld), counts on device type %d, host counts %s", where,
                         (long long)layout.capacity, (long long)cap, (int)layout.tokens_per_expert.device.type,
                         layout.tokens_per_expert_host ? "given" : "NULL");
        return false;
    }
    for (int64_t l = 0; l < El; l++) g->tokens_per_expert[l] = layout.tokens_per_expert_host[l];
    gpu_test_download(s, g->tokens_per_expert_dev, layout.tokens_per_expert.data, (size_t)El * sizeof(int64_t));
    void *recv_x = gpu_test_device_poisoned(s, (size_t)(cap + 2) * row);
    void *recv_probs = gpu_test_device_poisoned(s, (size_t)cap * sizeof(float));
    void *y = gpu_test_device_poisoned(s, (size_t)T * row);
    void *d_y_expert = gpu_test_device_poisoned(s, (size_t)cap * row);
    void *d_x = gpu_test_device_copy(s, d->d_x0, (size_t)T * row);
    void *d_topk_probs = gpu_test_device_poisoned(s, (size_t)(T * K) * sizeof(float));
    bool ok = run_calls(ti, (moert_stream)s, gpu, cs->dtype, d, in->x, in->probs, recv_x, recv_probs, in->y_expert, y,
                        in->d_y, d_y_expert, in->d_recv_x, in->d_recv_probs, d_x, d_topk_probs, where);
    if (ok) {
        gpu_test_download(s, g->recv_x, recv_x, (size_t)(cap + 2) * row);
        gpu_test_download(s, g->recv_probs, recv_probs, (size_t)cap * sizeof(float));
        gpu_test_download(s, g->y, y, (size_t)T * row);
        gpu_test_download(s, g->d_y_expert, d_y_expert, (size_t)cap * row);
        gpu_test_download(s, g->d_x, d_x, (size_t)T * row);
        gpu_test_download(s, g->d_topk_probs, d_topk_probs, (size_t)(T * K) * sizeof(float));
    }
    CK(cudaStreamSynchronize(s));
    void *bufs[] = {recv_x, recv_probs, y, d_y_expert, d_x, d_topk_probs};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) CK(cudaFree(bufs[i]));
    return ok;
}

/* Compares one CUDA step with the CPU reference, into the case's table row. */
static void compare_step(const gpu_test_rank_env *env, const test_case *cs, const step_data *d, const step_data *g,
                         result_row *row, const char *where)
{
    const int64_t El = cs->experts / env->world;
    const size_t rowb = (size_t)d->H * d->es;
    int64_t layout_diffs = (g->num_recv != d->num_recv) + (g->cap != d->cap);
    for (int64_t l = 0; l < El; l++)
        layout_diffs += (g->tokens_per_expert[l] != d->tokens_per_expert[l]) +
                        (g->tokens_per_expert_dev[l] != d->tokens_per_expert[l]);
    int64_t dispatch_diffs = gpu_test_bytes_differ(g->recv_x, d->recv_x, (size_t)d->cap * rowb) +
                             gpu_test_bytes_differ(g->recv_probs, d->recv_probs, (size_t)d->cap * sizeof(float)) +
                             !gpu_test_all_poison((const char *)g->recv_x + (size_t)d->cap * rowb, 2 * rowb);
    double combine_err = gpu_test_rel_error(g->y, d->y, cs->dtype, d->T * d->H);
    int64_t cb_diffs = gpu_test_bytes_differ(g->d_y_expert, d->d_y_expert, (size_t)d->cap * rowb);
    double dx_err = gpu_test_rel_error(g->d_x, d->d_x, cs->dtype, d->T * d->H);
    int64_t dp_diffs = gpu_test_bytes_differ(g->d_topk_probs, d->d_topk_probs, (size_t)(d->T * d->K) * sizeof(float));
    pthread_mutex_lock(&lock);
    row->layout_diffs += layout_diffs;
    row->dispatch_diffs += dispatch_diffs;
    if (!(combine_err <= row->combine_err)) row->combine_err = combine_err;
    row->combine_bwd_diffs += cb_diffs;
    if (!(dx_err <= row->dx_err)) row->dx_err = dx_err;
    row->dprobs_diffs += dp_diffs;
    pthread_mutex_unlock(&lock);
    if (layout_diffs || dispatch_diffs || cb_diffs || dp_diffs || !(combine_err <= row->tol) || !(dx_err <= row->tol))
        gpu_test_failure("%s: layout %lld diffs, dispatch %lld bytes differ, combine error %.3g, combine_backward %lld "
                         "bytes differ, d_x error %.3g, d_topk_probs %lld bytes differ (tolerance %.3g)",
                         where, (long long)layout_diffs, (long long)dispatch_diffs, combine_err, (long long)cb_diffs,
                         dx_err, (long long)dp_diffs, row->tol);
}

/* Bytes that differ between two CUDA steps' outputs. */
static int64_t outputs_differ(const step_data *a, const step_data *b, const step_data *d)
{
    const size_t rowb = (size_t)d->H * d->es;
    return gpu_test_bytes_differ(a->recv_x, b->recv_x, (size_t)d->cap * rowb) +
           gpu_test_bytes_differ(a->recv_probs, b->recv_probs, (size_t)d->cap * sizeof(float)) +
           gpu_test_bytes_differ(a->y, b->y, (size_t)d->T * rowb) +
           gpu_test_bytes_differ(a->d_y_expert, b->d_y_expert, (size_t)d->cap * rowb) +
           gpu_test_bytes_differ(a->d_x, b->d_x, (size_t)d->T * rowb) +
           gpu_test_bytes_differ(a->d_topk_probs, b->d_topk_probs, (size_t)(d->T * d->K) * sizeof(float));
}

/* The dispatch byte figures of the CUDA instance (its host's metric sink). */
static void metric_sink(void *user, const char *name, double value, const char *unit)
{
    step_data *g = user;
    (void)unit;
    if (strcmp(name, "dispatch.bytes_internode") == 0) g->inter_bytes = value;
    if (strcmp(name, "dispatch.bytes_intranode") == 0) g->intra_bytes = value;
}

/* test_instance_open_cuda with the metric sink above (figures into g). */
static moert_result open_cuda_instance(test_instance *ti, const char *options, const moert_layer_info *layer,
                                       const gpu_test_rank_env *env, step_data *g)
{
    memset(ti, 0, sizeof *ti);
    moert_result rc = moert_plugin_load(MOERT_KIND_DISPATCHER, DISPATCHER, &ti->plugin);
    if (rc != MOERT_OK) return rc;
    json_error_t jerr;
    ti->options = json_loads(options, 0, &jerr);
    if (!ti->options) return moert_error(MOERT_ERR_CONFIG, "test options: %s", jerr.text);
    ti->section = moert_section_create(ti->options, "$.test");
    moert_section_allow(ti->section, "plugin");
    moert_host_setup setup = {.who = DISPATCHER,
                              .options = ti->section,
                              .comm = env->comm,
                              .rank = env->rank,
                              .world_size = env->world,
                              .device = layer->device,
                              .metric = metric_sink,
                              .metric_user = g,
                              .cuda_pool = env->pool,
                              .nccl = env->nccl,
                              .stream = (moert_stream)env->stream};
    rc = moert_host_create(&setup, &ti->host);
    if (rc == MOERT_OK) rc = moert_plugin_init(&ti->plugin, &ti->ctx, ti->host, layer);
    if (rc == MOERT_OK) rc = moert_section_check_unknown(ti->section);
    return rc;
}

/* One case on one rank: CPU once, CUDA twice, compared. Every rank runs the same sequence of collectives. */
static void run_case(const gpu_test_rank_env *env, const world_run *w, int ci, result_row *row)
{
    const test_case *cs = &cases[ci];
    const int W = env->world, rank = env->rank;
    step_data d;
    memset(&d, 0, sizeof d);
    d.T = cs->empty_first && rank == 0 ? 0 : cs->tokens + 5 * rank;
    d.H = cs->hidden;
    d.K = cs->topk;
    d.es = moert_dtype_size(cs->dtype);
    moert_layer_info layer = test_layer(d.H, 8, cs->experts, d.K, d.T + 5 * MAX_WORLD, W, rank, cs->dtype);
    moert_layer_info gpu_layer = layer;
    gpu_layer.device = gpu_test_rank_device(env);
    char where[128], options[64];
    snprintf(where, sizeof where, "%s, %d per node, %s", env->where, w->ranks_per_node, cs->name);
    snprintf(options, sizeof options, "{\"ranks_per_node\": %d}", w->ranks_per_node);

    step_data g1, g2;
    memset(&g1, 0, sizeof g1);
    memset(&g2, 0, sizeof g2);
    test_instance cpu, gpu;
    moert_result rc = test_instance_open(&cpu, MOERT_KIND_DISPATCHER, DISPATCHER, options, &layer, env->comm, rank, W);
    if (rc != MOERT_OK) gpu_test_failure("%s: CPU dispatcher: %s", where, moert_error_message());
    moert_result rc2 = open_cuda_instance(&gpu, options, &gpu_layer, env, &g2);
    if (rc2 != MOERT_OK) gpu_test_failure("%s: CUDA dispatcher: %s", where, moert_error_message());
    if (rc != MOERT_OK || rc2 != MOERT_OK) {
        test_instance_close(&cpu);
        test_instance_close(&gpu);
        return;
    }

    uint64_t rng = 0x9e3779b97f4a7c15ull * (uint64_t)(ci + 1) + 1000003ull * (uint64_t)(rank + 1);
    d.idx = gpu_test_host_alloc((size_t)(d.T * d.K) * sizeof(int32_t));
    make_routing(cs, d.T, &rng, d.idx);
    d.x = gpu_test_host_alloc((size_t)(d.T * d.H) * d.es);
    d.d_y = gpu_test_host_alloc((size_t)(d.T * d.H) * d.es);
    d.d_x0 = gpu_test_host_alloc((size_t)(d.T * d.H) * d.es);
    d.probs = gpu_test_host_alloc((size_t)(d.T * d.K) * sizeof(float));
    gpu_test_fill_random(d.x, cs->dtype, d.T * d.H, &rng, 1.0);
    gpu_test_fill_random(d.d_y, cs->dtype, d.T * d.H, &rng, 1.0);
    gpu_test_fill_random(d.d_x0, cs->dtype, d.T * d.H, &rng, 1.0);
    for (int64_t i = 0; i < d.T * d.K; i++) d.probs[i] = (float)((test_uniform(&rng) + 1) / 2);

    if (run_cpu(&cpu, cs, W, &d, &rng, where)) {
        const cudaStream_t s = env->stream;
        const size_t rowb = (size_t)d.H * d.es;
        device_inputs in = {.idx = gpu_test_device_copy(s, d.idx, (size_t)(d.T * d.K) * sizeof(int32_t)),
                            .x = gpu_test_device_copy(s, d.x, (size_t)d.T * rowb),
                            .probs = gpu_test_device_copy(s, d.probs, (size_t)(d.T * d.K) * sizeof(float)),
                            .y_expert = gpu_test_device_copy(s, d.y_expert, (size_t)d.cap * rowb),
                            .d_y = gpu_test_device_copy(s, d.d_y, (size_t)d.T * rowb),
                            .d_recv_x = gpu_test_device_copy(s, d.d_recv_x, (size_t)d.cap * rowb),
                            .d_recv_probs = gpu_test_device_copy(s, d.d_recv_probs, (size_t)d.cap * sizeof(float))};
        g1.T = g2.T = d.T;
        g1.H = g2.H = d.H;
        g1.K = g2.K = d.K;
        g1.es = g2.es = d.es;
        outputs_alloc(&g1, &d);
        outputs_alloc(&g2, &d);
        moert_cuda_pool_stats before, after;
        bool ok1 = run_cuda_step(env, &gpu, cs, &d, &in, &g1, where);
        if (ok1) compare_step(env, cs, &d, &g1, row, where);
        moert_cuda_pool_get_stats(env->pool, &before);
        bool ok2 = ok1 && run_cuda_step(env, &gpu, cs, &d, &in, &g2, where);
        moert_cuda_pool_get_stats(env->pool, &after);
        if (ok2) {
            compare_step(env, cs, &d, &g2, row, where);
            int64_t repeat = outputs_differ(&g1, &g2, &d);
            int64_t mallocs = (int64_t)(after.cuda_malloc_count - before.cuda_malloc_count);
            pthread_mutex_lock(&lock);
            row->repeat_diffs += repeat;
            row->step2_mallocs += mallocs;
            row->recv_rows += d.num_recv;
            row->inter_bytes += g2.inter_bytes;
            row->intra_bytes += g2.intra_bytes;
            pthread_mutex_unlock(&lock);
            if (repeat || mallocs)
                gpu_test_failure("%s: the second step differs in %lld bytes and made %lld cudaMalloc calls", where,
                                 (long long)repeat, (long long)mallocs);
        }
        outputs_free(&g1);
        outputs_free(&g2);
        void *bufs[] = {in.idx, in.x, in.probs, in.y_expert, in.d_y, in.d_recv_x, in.d_recv_probs};
        CK(cudaStreamSynchronize(s));
        for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) CK(cudaFree(bufs[i]));
    }
    void *host_bufs[] = {d.idx, d.x, d.y_expert, d.d_y, d.d_recv_x, d.d_x0, d.probs, d.d_recv_probs};
    for (size_t i = 0; i < sizeof host_bufs / sizeof host_bufs[0]; i++) free(host_bufs[i]);
    outputs_free(&d);
    test_instance_close(&cpu);
    test_instance_close(&gpu);
}

static void rank_main(const gpu_test_rank_env *env, void *user)
{
    world_run *w = user;
    for (int ci = 0; ci < CASES; ci++) {
        gpu_test_progress("%s, %d per node: %s", env->where, w->ranks_per_node, cases[ci].name);
        run_case(env, w, ci, &table[w->table_base + ci]);
    }
}

static void print_table(void)
{
    printf("\nhierarchical dispatcher, CUDA vs CPU (diffs: bytes that differ; err: relative Frobenius error; "
           "inter/intra: dispatch bytes between / inside nodes, all ranks)\n");
    printf("%-5s %-4s %-28s %6s %6s %8s %9s %8s %9s %7s %6s %6s %10s %10s %s\n", "world", "R", "case", "recv", "layout",
           "dispatch", "combine", "comb_bwd", "d_x", "d_probs", "repeat", "malloc", "inter", "intra", "ok");
    for (int i = 0; i < table_rows * CASES; i++) {
        const result_row *r = &table[i];
        if (!r->ran) continue;
        bool ok = !r->layout_diffs && !r->dispatch_diffs && !r->combine_bwd_diffs && !r->dprobs_diffs &&
                  !r->repeat_diffs && !r->step2_mallocs && r->combine_err <= r->tol && r->dx_err <= r->tol;
        printf("%-5d %-4d %-28s %6lld %6lld %8lld %9.2e %8lld %9.2e %7lld %6lld %6lld %10.0f %10.0f %s\n", r->world,
               r->ranks_per_node, r->name, (long long)r->recv_rows, (long long)r->layout_diffs,
               (long long)r->dispatch_diffs, r->combine_err, (long long)r->combine_bwd_diffs, r->dx_err,
               (long long)r->dprobs_diffs, (long long)r->repeat_diffs, (long long)r->step2_mallocs, r->inter_bytes,
               r->intra_bytes, ok ? "ok" : "FAIL");
    }
}

int main(void)
{
    int gpus = gpu_test_device_count("gpu_hierarchical");
    if (gpus == 0) return TEST_SKIP;
    moert_plugin keep; /* keep the plugin (and the CUDA libraries it pulls in) loaded while instances come and go */
    memset(&keep, 0, sizeof keep);
    EXPECT_OK(moert_plugin_load(MOERT_KIND_DISPATCHER, DISPATCHER, &keep));
    if (test_failures) return test_finish("gpu_hierarchical");

    const int worlds[3] = {1, 2, 4};
    for (int i = 0; i < 3; i++) {
        if (worlds[i] > gpus) continue;
        for (int R = 1; R <= worlds[i]; R++) {
            if (worlds[i] % R || table_rows >= MAX_ROWS) continue;
            world_run w = {.world = worlds[i], .ranks_per_node = R, .table_base = table_rows * CASES};
            for (int ci = 0; ci < CASES; ci++) {
                result_row *r = &table[w.table_base + ci];
                r->world = worlds[i];
                r->ranks_per_node = R;
                r->name = cases[ci].name;
                /* the CPU sums in double, CUDA in fp32; both round each node's partial to the row dtype */
                r->tol = cases[ci].dtype == MOERT_BF16 ? 1e-2 : 2e-6;
                r->ran = true;
            }
            table_rows++;
            gpu_test_run_world(w.world, TIMEOUT_S, rank_main, &w);
        }
    }
    print_table();
    moert_plugin_unload(&keep);
    return test_finish("gpu_hierarchical");
}

#endif
