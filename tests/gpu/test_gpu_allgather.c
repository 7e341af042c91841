/* SPDX-License-Identifier: Apache-2.0 */
/* GPU test of the "allgather" dispatcher's CUDA path against its CPU path, which is the reference, on 1, 2 and 4 GPUs
 * (as many as there are; a thread per GPU, NCCL for device buffers, the threads communicator for the count exchange),
 * on the same random routing for both paths: uniform, one hot expert with the last rank's experts receiving nothing,
 * a rank with no tokens, and many experts with K 8; every case drops some copies and the ranks have different T (the
 * gathered blocks are padded). Dispatch and combine_backward must match bit for bit, and d_topk_probs (one nonzero
 * term per copy); combine and dispatch_backward's d_x within fp32-accumulation tolerance (the CPU sums in double, the
 * CUDA path in fp32); a second identical step must give the same bits and make no new cudaMalloc in the pool.
 * Prints a table last. Exits 77 without a GPU. */
#include "test_util.h"

#ifndef MOERT_HAVE_CUDA

int main(void)
{
    printf("gpu_allgather: built without CUDA, skipped\n");
    return TEST_SKIP;
}

#else

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include "gpu_test_util.h"
#include "moert/dispatcher.h"

#define DISPATCHER "allgather"
#define TIMEOUT_S 60.0
#define MAX_WORLD 4
#define WORLDS 3 /* 1, 2 and 4 GPUs, as many as the machine has */

/* ---- the result table ---- */

/* Guards the table, written by every rank thread. */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

typedef struct result_row {
    int world;
    const char *name;
    int64_t recv_rows;         /* over ranks */
    int64_t layout_diffs;      /* num_recv, capacity, counts (host and device) that differ */
    int64_t dispatch_diffs;    /* bytes of recv_x and recv_probs that differ, plus touched rows past capacity */
    double combine_err;        /* max over ranks of the relative error of y */
    int64_t combine_bwd_diffs; /* bytes of d_y_expert that differ */
    double dx_err;             /* max over ranks of the relative error of d_x */
    int64_t dprobs_diffs;      /* bytes of d_topk_probs that differ */
    int64_t repeat_diffs;      /* bytes that differ between two identical steps */
    int64_t step2_mallocs;     /* cudaMalloc calls of the pool during the second step */
    double tol;                /* the tolerance of combine_err and dx_err */
    bool ran;
} result_row;

typedef struct test_case {
    const char *name;
    moert_dtype dtype;
    int64_t hidden, experts, topk, tokens; /* rank r has tokens + 5*r tokens */
    double drop;                           /* probability that a copy is dropped (-1) */
    double hot;                            /* probability that a copy goes to expert 0 */
    bool starve_last;                      /* the last rank's experts receive nothing (world > 1) */
    bool empty_first;                      /* rank 0 has no tokens */
} test_case;

static const test_case cases[] = {
    {"uniform bf16 H64 K2", MOERT_BF16, 64, 8, 2, 96, 0.10, 0.0, false, false},
    {"hot fp32 H33 K4", MOERT_F32, 33, 8, 4, 80, 0.15, 0.6, true, false},
    {"no tokens on rank 0 bf16 K3", MOERT_BF16, 48, 16, 3, 50, 0.05, 0.0, false, true},
    {"E32 K8 fp32 H128", MOERT_F32, 128, 32, 8, 200, 0.05, 0.0, false, false},
};
#define CASES ((int)(sizeof cases / sizeof cases[0]))

static result_row table[WORLDS * CASES];

/* What each rank of a world gets. */
typedef struct world_run {
    int world;
    int table_base; /* first table row of this world */
} world_run;

/* topk_idx [T,K]: distinct experts per token, some dropped, optionally one hot expert and a starved rank. */
static void make_routing(const test_case *cs, int world, int64_t tokens, uint64_t *rng, int32_t *idx)
{
    const int64_t E = cs->experts, K = cs->topk, El = E / world;
    const int64_t allowed = cs->starve_last && world > 1 ? E - El : E;
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t k = 0; k < K; k++) {
            int32_t e = -1;
            if ((test_uniform(rng) + 1) / 2 >= cs->drop) {
                for (int attempt = 0; attempt < 32 && e < 0; attempt++) {
                    int32_t pick = (test_uniform(rng) + 1) / 2 < cs->hot
                                       ? 0
                                       : (int32_t)((test_uniform(rng) + 1) / 2 * (double)allowed) % (int32_t)allowed;
                    bool used = false;
                    for (int64_t j = 0; j < k; j++) used = used || idx[t * K + j] == pick;
                    if (!used) e = pick;
                }
            }
            idx[t * K + k] = e;
        }
}

/* Host inputs and CPU outputs of one case on one rank. */
typedef struct case_data {
    int64_t T, H, K, cap, num_recv;
    size_t es;                                  /* bytes per row element */
    int32_t *idx;                               /* [T,K] */
    void *x, *y_expert, *d_y, *d_recv_x, *d_x0; /* dtype */
    float *probs, *d_recv_probs;                /* [T,K], [cap] */
    int64_t tokens_per_expert[64];              /* CPU layout */
    /* CPU results */
    void *recv_x, *y, *d_y_expert, *d_x;
    float *recv_probs, *d_topk_probs;
} case_data;

/* What one CUDA step produced, downloaded. */
typedef struct step_output {
    int64_t num_recv, capacity, tokens_per_expert_host[64], tokens_per_expert_dev[64];
    void *recv_x, *y, *d_y_expert, *d_x; /* recv_x with 2 rows past capacity */
    float *recv_probs, *d_topk_probs;
} step_output;

/* The CPU path: the reference results. */
static bool run_cpu(test_instance *ti, const moert_dispatcher_v1 *vt, const test_case *cs, case_data *d, uint64_t *rng,
                    const char *where)
{
    const moert_device cpu = moert_cpu();
    const moert_dtype dt = cs->dtype;
    moert_tensor idx = moert_tensor_2d(d->idx, cpu, MOERT_I32, d->T, d->K);
    moert_dispatch_layout layout = {.struct_size = sizeof layout};
    if (!CALL(ti, vt->prepare(ti->ctx, NULL, &idx, &layout), where)) return false;
    d->cap = layout.capacity;
    d->num_recv = layout.num_recv;
    for (int64_t l = 0; l < cs->experts / ti->host->world_size; l++)
        d->tokens_per_expert[l] = layout.tokens_per_expert_host[l];

    d->y_expert = gpu_test_host_alloc((size_t)(d->cap * d->H) * d->es);
    d->d_recv_x = gpu_test_host_alloc((size_t)(d->cap * d->H) * d->es);
    d->d_recv_probs = gpu_test_host_alloc((size_t)d->cap * sizeof(float));
    gpu_test_fill_random(d->y_expert, dt, d->cap * d->H, rng, 1.0);
    gpu_test_fill_random(d->d_recv_x, dt, d->cap * d->H, rng, 1.0);
    gpu_test_fill_random(d->d_recv_probs, MOERT_F32, d->cap, rng, 1.0);

    d->recv_x = gpu_test_host_alloc((size_t)(d->cap * d->H) * d->es);
    d->recv_probs = gpu_test_host_alloc((size_t)d->cap * sizeof(float));
    d->y = gpu_test_host_alloc((size_t)(d->T * d->H) * d->es);
    d->d_y_expert = gpu_test_host_alloc((size_t)(d->cap * d->H) * d->es);
    d->d_x = gpu_test_host_alloc((size_t)(d->T * d->H) * d->es);
    memcpy(d->d_x, d->d_x0, (size_t)(d->T * d->H) * d->es);
    d->d_topk_probs = gpu_test_host_alloc((size_t)(d->T * d->K) * sizeof(float));

    moert_tensor x = moert_tensor_2d(d->x, cpu, dt, d->T, d->H);
    moert_tensor probs = moert_tensor_2d(d->probs, cpu, MOERT_F32, d->T, d->K);
    moert_tensor recv_x = moert_tensor_2d(d->recv_x, cpu, dt, d->cap, d->H);
    moert_tensor recv_probs = moert_tensor_1d(d->recv_probs, cpu, MOERT_F32, d->cap);
    moert_dispatch_args da = {.struct_size = sizeof da, .x = &x, .topk_probs = &probs, .recv_x = &recv_x,
                              .recv_probs = &recv_probs};
    moert_tensor ye = moert_tensor_2d(d->y_expert, cpu, dt, d->cap, d->H);
    moert_tensor y = moert_tensor_2d(d->y, cpu, dt, d->T, d->H);
    moert_combine_args ca = {.struct_size = sizeof ca, .y_expert = &ye, .y = &y};
    moert_tensor dy = moert_tensor_2d(d->d_y, cpu, dt, d->T, d->H);
    moert_tensor dye = moert_tensor_2d(d->d_y_expert, cpu, dt, d->cap, d->H);
    moert_combine_backward_args cb = {.struct_size = sizeof cb, .d_y = &dy, .d_y_expert = &dye};
    moert_tensor drx = moert_tensor_2d(d->d_recv_x, cpu, dt, d->cap, d->H);
    moert_tensor drp = moert_tensor_1d(d->d_recv_probs, cpu, MOERT_F32, d->cap);
    moert_tensor dx = moert_tensor_2d(d->d_x, cpu, dt, d->T, d->H);
    moert_tensor dtp = moert_tensor_2d(d->d_topk_probs, cpu, MOERT_F32, d->T, d->K);
    moert_dispatch_backward_args db = {.struct_size = sizeof db, .d_recv_x = &drx, .d_recv_probs = &drp, .d_x = &dx,
                                       .d_topk_probs = &dtp};
    return CALL(ti, vt->dispatch(ti->ctx, NULL, &da), where) && CALL(ti, vt->combine(ti->ctx, NULL, &ca), where) &&
           CALL(ti, vt->combine_backward(ti->ctx, NULL, &cb), where) &&
           CALL(ti, vt->dispatch_backward(ti->ctx, NULL, &db), where);
}

/* Device copies of the inputs, made once per case. */
typedef struct device_inputs {
    void *idx, *x, *probs, *y_expert, *d_y, *d_recv_x, *d_recv_probs;
} device_inputs;

/* One CUDA step (prepare, dispatch, combine, combine_backward, dispatch_backward) with poisoned outputs. */
static bool run_cuda_step(const gpu_test_rank_env *env, test_instance *ti, const moert_dispatcher_v1 *vt,
                          const test_case *cs, const case_data *d, const device_inputs *in, step_output *got)
{
    const moert_device gpu = gpu_test_rank_device(env);
    const moert_dtype dt = cs->dtype;
    const cudaStream_t s = env->stream;
    const int64_t T = d->T, H = d->H, K = d->K, cap = d->cap, El = cs->experts / env->world;
    const size_t row = (size_t)H * d->es;
    moert_stream stream = (moert_stream)s;
    moert_tensor idx = moert_tensor_2d(in->idx, gpu, MOERT_I32, T, K);
    moert_dispatch_layout layout = {.struct_size = sizeof layout};
    if (!CALL(ti, vt->prepare(ti->ctx, stream, &idx, &layout), env->where)) return false;
    got->num_recv = layout.num_recv;
    got->capacity = layout.capacity;
    if (layout.capacity != cap || layout.tokens_per_expert.device.type != MOERT_DEVICE_CUDA ||
        layout.tokens_per_expert.device.id != env->rank || !layout.tokens_per_expert_host) {
        gpu_test_failure("%s %s: CUDA layout: capacity %lld (CPU %lld), counts on device type %d id %d, host counts %s",
                         env->where, cs->name, (long long)layout.capacity, (long long)cap,
                         (int)layout.tokens_per_expert.device.type, (int)layout.tokens_per_expert.device.id,
                         layout.tokens_per_expert_host ? "given" : "NULL");
        return false;
    }
    for (int64_t l = 0; l < El; l++) got->tokens_per_expert_host[l] = layout.tokens_per_expert_host[l];
    gpu_test_download(s, got->tokens_per_expert_dev, layout.tokens_per_expert.data, (size_t)El * sizeof(int64_t));

    void *recv_x = gpu_test_device_poisoned(s, (size_t)(cap + 2) * row);
    void *recv_probs = gpu_test_device_poisoned(s, (size_t)cap * sizeof(float));
    void *y = gpu_test_device_poisoned(s, (size_t)T * row);
    void *d_y_expert = gpu_test_device_poisoned(s, (size_t)cap * row);
    void *d_x = gpu_test_device_copy(s, d->d_x0, (size_t)T * row);
    void *d_topk_probs = gpu_test_device_poisoned(s, (size_t)(T * K) * sizeof(float));

    moert_tensor x = moert_tensor_2d(in->x, gpu, dt, T, H), probs = moert_tensor_2d(in->probs, gpu, MOERT_F32, T, K);
    moert_tensor rx = moert_tensor_2d(recv_x, gpu, dt, cap + 2, H), rp = moert_tensor_1d(recv_probs, gpu, MOERT_F32, cap);
    moert_dispatch_args da = {.struct_size = sizeof da, .x = &x, .topk_probs = &probs, .recv_x = &rx, .recv_probs = &rp};
    moert_tensor ye = moert_tensor_2d(in->y_expert, gpu, dt, cap, H), yt = moert_tensor_2d(y, gpu, dt, T, H);
    moert_combine_args ca = {.struct_size = sizeof ca, .y_expert = &ye, .y = &yt};
    moert_tensor dy = moert_tensor_2d(in->d_y, gpu, dt, T, H), dye = moert_tensor_2d(d_y_expert, gpu, dt, cap, H);
    moert_combine_backward_args cb = {.struct_size = sizeof cb, .d_y = &dy, .d_y_expert = &dye};
    moert_tensor drx = moert_tensor_2d(in->d_recv_x, gpu, dt, cap, H);
    moert_tensor drp = moert_tensor_1d(in->d_recv_probs, gpu, MOERT_F32, cap);
    moert_tensor dx = moert_tensor_2d(d_x, gpu, dt, T, H), dtp = moert_tensor_2d(d_topk_probs, gpu, MOERT_F32, T, K);
    moert_dispatch_backward_args db = {.struct_size = sizeof db, .d_recv_x = &drx, .d_recv_probs = &drp, .d_x = &dx,
                                       .d_topk_probs = &dtp};
    bool ok = CALL(ti, vt->dispatch(ti->ctx, stream, &da), env->where) &&
              CALL(ti, vt->combine(ti->ctx, stream, &ca), env->where) &&
              CALL(ti, vt->combine_backward(ti->ctx, stream, &cb), env->where) &&
              CALL(ti, vt->dispatch_backward(ti->ctx, stream, &db), env->where);
    if (ok) {
        gpu_test_download(s, got->recv_x, recv_x, (size_t)(cap + 2) * row);
        gpu_test_download(s, got->recv_probs, recv_probs, (size_t)cap * sizeof(float));
        gpu_test_download(s, got->y, y, (size_t)T * row);
        gpu_test_download(s, got->d_y_expert, d_y_expert, (size_t)cap * row);
        gpu_test_download(s, got->d_x, d_x, (size_t)T * row);
        gpu_test_download(s, got->d_topk_probs, d_topk_probs, (size_t)(T * K) * sizeof(float));
    }
    CK(cudaStreamSynchronize(s));
    void *bufs[] = {recv_x, recv_probs, y, d_y_expert, d_x, d_topk_probs};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) CK(cudaFree(bufs[i]));
    return ok;
}

/* Compares one CUDA step with the CPU reference, into the case's table row (under the lock). */
static void compare_step(const gpu_test_rank_env *env, const test_case *cs, const case_data *d, const step_output *g,
                         result_row *row)
{
    const int64_t El = cs->experts / env->world;
    const size_t rowb = (size_t)d->H * d->es;
    int64_t layout_diffs = (g->num_recv != d->num_recv) + (g->capacity != d->cap);
    for (int64_t l = 0; l < El; l++)
        layout_diffs += (g->tokens_per_expert_host[l] != d->tokens_per_expert[l]) +
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
        gpu_test_failure("%s %s: layout %lld diffs, dispatch %lld bytes differ, combine error %.3g, combine_backward "
                         "%lld bytes differ, d_x error %.3g, d_topk_probs %lld bytes differ (tolerance %.3g)",
                         env->where, cs->name, (long long)layout_diffs, (long long)dispatch_diffs, combine_err,
                         (long long)cb_diffs, dx_err, (long long)dp_diffs, row->tol);
}

static void output_alloc(step_output *g, const case_data *d)
{
    const size_t rowb = (size_t)d->H * d->es;
    g->recv_x = gpu_test_host_alloc((size_t)(d->cap + 2) * rowb);
    g->recv_probs = gpu_test_host_alloc((size_t)d->cap * sizeof(float));
    g->y = gpu_test_host_alloc((size_t)d->T * rowb);
    g->d_y_expert = gpu_test_host_alloc((size_t)d->cap * rowb);
    g->d_x = gpu_test_host_alloc((size_t)d->T * rowb);
    g->d_topk_probs = gpu_test_host_alloc((size_t)(d->T * d->K) * sizeof(float));
}

static void output_free(step_output *g)
{
    free(g->recv_x);
    free(g->recv_probs);
    free(g->y);
    free(g->d_y_expert);
    free(g->d_x);
    free(g->d_topk_probs);
}

/* Bytes that differ between two CUDA steps' outputs. */
static int64_t outputs_differ(const step_output *a, const step_output *b, const case_data *d)
{
    const size_t rowb = (size_t)d->H * d->es;
    return gpu_test_bytes_differ(a->recv_x, b->recv_x, (size_t)d->cap * rowb) +
           gpu_test_bytes_differ(a->recv_probs, b->recv_probs, (size_t)d->cap * sizeof(float)) +
           gpu_test_bytes_differ(a->y, b->y, (size_t)d->T * rowb) +
           gpu_test_bytes_differ(a->d_y_expert, b->d_y_expert, (size_t)d->cap * rowb) +
           gpu_test_bytes_differ(a->d_x, b->d_x, (size_t)d->T * rowb) +
           gpu_test_bytes_differ(a->d_topk_probs, b->d_topk_probs, (size_t)(d->T * d->K) * sizeof(float));
}

/* One case on one rank: CPU once, CUDA twice, compared. Every rank runs the same sequence of collectives, even
 * after a failed check (a failed call may leave peers waiting until the timeout). */
static void run_case(const gpu_test_rank_env *env, int ci, result_row *row)
{
    const test_case *cs = &cases[ci];
    const int W = env->world, rank = env->rank;
    case_data d;
    memset(&d, 0, sizeof d);
    d.T = cs->empty_first && rank == 0 ? 0 : cs->tokens + 5 * rank;
    d.H = cs->hidden;
    d.K = cs->topk;
    d.es = moert_dtype_size(cs->dtype);
    moert_layer_info layer = test_layer(d.H, 8, cs->experts, d.K, d.T + 5 * MAX_WORLD, W, rank, cs->dtype);
    moert_layer_info gpu_layer = layer;
    gpu_layer.device = gpu_test_rank_device(env);
    char where[96];
    snprintf(where, sizeof where, "%s %s", env->where, cs->name);

    test_instance cpu, gpu;
    moert_result rc = test_instance_open(&cpu, MOERT_KIND_DISPATCHER, DISPATCHER, "{}", &layer, env->comm, rank, W);
    if (rc != MOERT_OK) gpu_test_failure("%s: CPU dispatcher: %s", where, moert_error_message());
    moert_result rc2 = test_instance_open_cuda(&gpu, MOERT_KIND_DISPATCHER, DISPATCHER, "{}", &gpu_layer, env->comm,
                                               rank, W, env->pool, env->nccl, (moert_stream)env->stream);
    if (rc2 != MOERT_OK)
        gpu_test_failure("%s: CUDA dispatcher: %s %s", where, moert_error_message(),
                         gpu.host ? moert_host_take_error(gpu.host) : "");
    if (rc != MOERT_OK || rc2 != MOERT_OK) {
        test_instance_close(&cpu);
        test_instance_close(&gpu);
        return;
    }
    const moert_dispatcher_v1 *vt = (const moert_dispatcher_v1 *)cpu.plugin.header;

    uint64_t rng = 0x9e3779b97f4a7c15ull * (uint64_t)(ci + 1) + 1000003ull * (uint64_t)(rank + 1);
    d.idx = gpu_test_host_alloc((size_t)(d.T * d.K) * sizeof(int32_t));
    make_routing(cs, W, d.T, &rng, d.idx);
    d.x = gpu_test_host_alloc((size_t)(d.T * d.H) * d.es);
    d.d_y = gpu_test_host_alloc((size_t)(d.T * d.H) * d.es);
    d.d_x0 = gpu_test_host_alloc((size_t)(d.T * d.H) * d.es);
    d.probs = gpu_test_host_alloc((size_t)(d.T * d.K) * sizeof(float));
    gpu_test_fill_random(d.x, cs->dtype, d.T * d.H, &rng, 1.0);
    gpu_test_fill_random(d.d_y, cs->dtype, d.T * d.H, &rng, 1.0);
    gpu_test_fill_random(d.d_x0, cs->dtype, d.T * d.H, &rng, 1.0);
    for (int64_t i = 0; i < d.T * d.K; i++) d.probs[i] = (float)((test_uniform(&rng) + 1) / 2);

    if (run_cpu(&cpu, vt, cs, &d, &rng, where)) {
        const cudaStream_t s = env->stream;
        const size_t rowb = (size_t)d.H * d.es;
        device_inputs in = {.idx = gpu_test_device_copy(s, d.idx, (size_t)(d.T * d.K) * sizeof(int32_t)),
                            .x = gpu_test_device_copy(s, d.x, (size_t)d.T * rowb),
                            .probs = gpu_test_device_copy(s, d.probs, (size_t)(d.T * d.K) * sizeof(float)),
                            .y_expert = gpu_test_device_copy(s, d.y_expert, (size_t)d.cap * rowb),
                            .d_y = gpu_test_device_copy(s, d.d_y, (size_t)d.T * rowb),
                            .d_recv_x = gpu_test_device_copy(s, d.d_recv_x, (size_t)d.cap * rowb),
                            .d_recv_probs = gpu_test_device_copy(s, d.d_recv_probs, (size_t)d.cap * sizeof(float))};
        step_output g1, g2;
        memset(&g1, 0, sizeof g1);
        memset(&g2, 0, sizeof g2);
        output_alloc(&g1, &d);
        output_alloc(&g2, &d);
        moert_cuda_pool_stats before, after;
        bool ok1 = run_cuda_step(env, &gpu, vt, cs, &d, &in, &g1);
        if (ok1) compare_step(env, cs, &d, &g1, row);
        moert_cuda_pool_get_stats(env->pool, &before);
        bool ok2 = ok1 && run_cuda_step(env, &gpu, vt, cs, &d, &in, &g2);
        moert_cuda_pool_get_stats(env->pool, &after);
        if (ok2) {
            compare_step(env, cs, &d, &g2, row);
            int64_t repeat = outputs_differ(&g1, &g2, &d);
            int64_t mallocs = (int64_t)(after.cuda_malloc_count - before.cuda_malloc_count);
            pthread_mutex_lock(&lock);
            row->repeat_diffs += repeat;
            row->step2_mallocs += mallocs;
            row->recv_rows += d.num_recv;
            pthread_mutex_unlock(&lock);
            if (repeat || mallocs)
                gpu_test_failure("%s: the second step differs in %lld bytes and made %lld cudaMalloc calls", where,
                                 (long long)repeat, (long long)mallocs);
        }
        output_free(&g1);
        output_free(&g2);
        void *bufs[] = {in.idx, in.x, in.probs, in.y_expert, in.d_y, in.d_recv_x, in.d_recv_probs};
        CK(cudaStreamSynchronize(s));
        for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) CK(cudaFree(bufs[i]));
    }
    void *host_bufs[] = {d.idx, d.x, d.y_expert, d.d_y, d.d_recv_x, d.d_x0, d.probs, d.d_recv_probs,
                         d.recv_x, d.y, d.d_y_expert, d.d_x, d.recv_probs, d.d_topk_probs};
    for (size_t i = 0; i < sizeof host_bufs / sizeof host_bufs[0]; i++) free(host_bufs[i]);
    test_instance_close(&cpu);
    test_instance_close(&gpu);
}

/* One rank of a world: every case. */
static void rank_main(const gpu_test_rank_env *env, void *user)
{
    world_run *w = user;
    for (int ci = 0; ci < CASES; ci++) {
        gpu_test_progress("%s: %s", env->where, cases[ci].name);
        run_case(env, ci, &table[w->table_base + ci]);
    }
}

static void print_table(void)
{
    printf("\nallgather dispatcher, CUDA vs CPU (diffs: bytes that differ; err: relative Frobenius error)\n");
    printf("%-5s  %-28s  %6s  %6s  %8s  %9s  %8s  %9s  %7s  %6s  %6s  %s\n", "world", "case", "recv", "layout",
           "dispatch", "combine", "comb_bwd", "d_x", "d_probs", "repeat", "malloc", "ok");
    for (int i = 0; i < WORLDS * CASES; i++) {
        const result_row *r = &table[i];
        if (!r->ran) continue;
        bool ok = !r->layout_diffs && !r->dispatch_diffs && !r->combine_bwd_diffs && !r->dprobs_diffs &&
                  !r->repeat_diffs && !r->step2_mallocs && r->combine_err <= r->tol && r->dx_err <= r->tol;
        printf("%-5d  %-28s  %6lld  %6lld  %8lld  %9.2e  %8lld  %9.2e  %7lld  %6lld  %6lld  %s\n", r->world, r->name,
               (long long)r->recv_rows, (long long)r->layout_diffs, (long long)r->dispatch_diffs, r->combine_err,
               (long long)r->combine_bwd_diffs, r->dx_err, (long long)r->dprobs_diffs, (long long)r->repeat_diffs,
               (long long)r->step2_mallocs, ok ? "ok" : "FAIL");
    }
}

int main(void)
{
    int gpus = gpu_test_device_count("gpu_allgather");
    if (gpus == 0) return TEST_SKIP;
    /* keep the plugin (and the CUDA libraries it pulls in) loaded while instances come and go */
    moert_plugin keep;
    memset(&keep, 0, sizeof keep);
    EXPECT_OK(moert_plugin_load(MOERT_KIND_DISPATCHER, DISPATCHER, &keep));
    if (test_failures) return test_finish("gpu_allgather");

    const int worlds[WORLDS] = {1, 2, 4};
    for (int i = 0; i < WORLDS; i++) {
        if (worlds[i] > gpus) continue;
        world_run w = {.world = worlds[i], .table_base = i * CASES};
        for (int ci = 0; ci < CASES; ci++) {
            result_row *r = &table[w.table_base + ci];
            r->world = worlds[i];
            r->name = cases[ci].name;
            /* the CPU sums in double and rounds once; CUDA sums in fp32 (bf16: within one rounding) */
            r->tol = cases[ci].dtype == MOERT_BF16 ? 1e-2 : 2e-6;
            r->ran = true;
        }
        gpu_test_run_world(w.world, TIMEOUT_S, rank_main, &w);
    }
    print_table();
    moert_plugin_unload(&keep);
    return test_finish("gpu_allgather");
}

#endif
