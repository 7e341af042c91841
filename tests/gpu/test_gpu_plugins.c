/* SPDX-License-Identifier: Apache-2.0 */
/* GPU test of the plugins' CUDA paths against their CPU paths, which are the reference:
 * - the "alltoall" dispatcher on 1, 2 and 4 GPUs (as many as there are; a thread per GPU, NCCL for device
 *   buffers, the threads communicator for the count exchange), on the same random routing for both paths:
 *   uniform, one hot expert with the last rank's experts receiving nothing, a rank with no tokens, and padded
 *   groups; every case drops some copies. Dispatch and combine_backward must match bit for bit, combine and
 *   dispatch_backward's d_x within fp32-accumulation tolerance, d_topk_probs bit for bit; a second identical
 *   step must give the same bits and make no new cudaMalloc in the pool (buffers are reused).
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

#include "gpu_test_util.h"
#include "moert/dispatcher.h"
#include "moert/precision.h"

#define DISPATCHER "alltoall"
#define PRECISION "bf16"
#define TIMEOUT_S 60.0
#define MAX_WORLD 4

/* ---- the result tables ---- */

/* Guards the tables, written by every rank thread. */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

typedef struct dispatch_row {
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
} dispatch_row;

typedef struct precision_row {
    char what[48];
    int devices;
    double err, tol;
} precision_row;

#define WORLDS 4 /* 1, 2, 4 and 8 GPUs, as many as the machine has */
static dispatch_row dispatch_table[WORLDS * 8];
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
    int table_base;             /* first dispatch_table row of this world */
    bool run_precision;
} world_run;

/* ---- the dispatcher ---- */

typedef struct dispatch_case {
    const char *name;
    moert_dtype dtype;
    int64_t hidden, experts, topk, tokens; /* rank r has tokens + 5*r tokens */
    double drop;                           /* probability that a copy is dropped (-1) */
    double hot;                            /* probability that a copy goes to expert 0 */
    bool starve_last;                      /* the last rank's experts receive nothing (world > 1) */
    bool empty_first;                      /* rank 0 has no tokens */
    bool pad;                              /* pad_to_capacity, capacity_factor 3 */
} dispatch_case;

static const dispatch_case dispatch_cases[] = {
    {"uniform bf16 H64 K2", MOERT_BF16, 64, 8, 2, 96, 0.10, 0.0, false, false, false},
    {"hot fp32 H33 K4", MOERT_F32, 33, 8, 4, 80, 0.15, 0.6, true, false, false},
    {"no tokens on rank 0 bf16 K3", MOERT_BF16, 48, 16, 3, 50, 0.05, 0.0, false, true, false},
    {"padded bf16 H64 K2", MOERT_BF16, 64, 8, 2, 64, 0.10, 0.0, false, false, true},
};
#define DISPATCH_CASES ((int)(sizeof dispatch_cases / sizeof dispatch_cases[0]))

/* topk_idx [T,K]: distinct experts per token, some dropped, optionally one hot expert and a starved rank. */
static void make_routing(const dispatch_case *cs, int world, int64_t tokens, uint64_t *rng, int32_t *idx)
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
typedef struct dispatch_data {
    int64_t T, H, K, cap, num_recv;
    size_t es;                       /* bytes per row element */
    int32_t *idx;                    /* [T,K] */
    void *x, *y_expert, *d_y, *d_recv_x, *d_x0; /* dtype */
    float *probs, *d_recv_probs;     /* [T,K], [cap] */
    int64_t tokens_per_expert[64];   /* CPU layout */
    /* CPU results */
    void *recv_x, *y, *d_y_expert, *d_x;
    float *recv_probs, *d_topk_probs;
} dispatch_data;

/* What one CUDA step produced, downloaded. */
typedef struct dispatch_got {
    int64_t num_recv, capacity, tokens_per_expert_host[64], tokens_per_expert_dev[64];
    void *recv_x, *y, *d_y_expert, *d_x;  /* recv_x with 2 rows past capacity */
    float *recv_probs, *d_topk_probs;
} dispatch_got;

/* The CPU path: the reference results. */
static bool dispatch_cpu(test_instance *ti, const moert_dispatcher_v1 *vt, const dispatch_case *cs, dispatch_data *d,
                         uint64_t *rng, const char *where)
{
    const moert_device cpu = moert_cpu();
    const moert_dtype dt = cs->dtype;
    moert_tensor idx = moert_tensor_2d(d->idx, cpu, MOERT_I32, d->T, d->K);
    moert_dispatch_layout layout = {.struct_size = sizeof layout};
    if (!CALL(ti, vt->prepare(ti->ctx, NULL, &idx, &layout), where)) return false;
    d->cap = layout.capacity;
    d->num_recv = layout.num_recv;
    for (int64_t l = 0; l < cs->experts / ti->host->world_size; l++) d->tokens_per_expert[l] = layout.tokens_per_expert_host[l];

    /* inputs that depend on the capacity (padding rows of y_expert and d_recv_x hold values too: not read) */
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

    moert_tensor x = moert_tensor_2d(d->x, cpu, dt, d->T, d->H), probs = moert_tensor_2d(d->probs, cpu, MOERT_F32, d->T, d->K);
    moert_tensor recv_x = moert_tensor_2d(d->recv_x, cpu, dt, d->cap, d->H);
    moert_tensor recv_probs = moert_tensor_1d(d->recv_probs, cpu, MOERT_F32, d->cap);
    moert_dispatch_args da = {.struct_size = sizeof da, .x = &x, .topk_probs = &probs, .recv_x = &recv_x,
                              .recv_probs = &recv_probs};
    moert_tensor ye = moert_tensor_2d(d->y_expert, cpu, dt, d->cap, d->H), y = moert_tensor_2d(d->y, cpu, dt, d->T, d->H);
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
typedef struct dispatch_device_inputs {
    void *idx, *x, *probs, *y_expert, *d_y, *d_recv_x, *d_recv_probs;
} dispatch_device_inputs;

/* One CUDA step (prepare, dispatch, combine, combine_backward, dispatch_backward) with poisoned outputs. */
static bool dispatch_cuda_step(const gpu_test_rank_env *env, test_instance *ti, const moert_dispatcher_v1 *vt,
                               const dispatch_case *cs, const dispatch_data *d, const dispatch_device_inputs *in,
                               dispatch_got *got)
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
    CK(cudaFree(recv_x));
    CK(cudaFree(recv_probs));
    CK(cudaFree(y));
    CK(cudaFree(d_y_expert));
    CK(cudaFree(d_x));
    CK(cudaFree(d_topk_probs));
    return ok;
}

/* Compares one CUDA step with the CPU reference, into the case's table row (under the lock). */
static void dispatch_compare(const gpu_test_rank_env *env, const dispatch_case *cs, const dispatch_data *d,
                             const dispatch_got *g, dispatch_row *row)
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

static void got_alloc(dispatch_got *g, const dispatch_data *d)
{
    const size_t rowb = (size_t)d->H * d->es;
    g->recv_x = gpu_test_host_alloc((size_t)(d->cap + 2) * rowb);
    g->recv_probs = gpu_test_host_alloc((size_t)d->cap * sizeof(float));
    g->y = gpu_test_host_alloc((size_t)d->T * rowb);
    g->d_y_expert = gpu_test_host_alloc((size_t)d->cap * rowb);
    g->d_x = gpu_test_host_alloc((size_t)d->T * rowb);
    g->d_topk_probs = gpu_test_host_alloc((size_t)(d->T * d->K) * sizeof(float));
}

static void got_free(dispatch_got *g)
{
    free(g->recv_x);
    free(g->recv_probs);
    free(g->y);
    free(g->d_y_expert);
    free(g->d_x);
    free(g->d_topk_probs);
}

/* Bytes that differ between two CUDA steps' outputs. */
static int64_t got_differ(const dispatch_got *a, const dispatch_got *b, const dispatch_data *d)
{
    const size_t rowb = (size_t)d->H * d->es;
    return gpu_test_bytes_differ(a->recv_x, b->recv_x, (size_t)d->cap * rowb) +
           gpu_test_bytes_differ(a->recv_probs, b->recv_probs, (size_t)d->cap * sizeof(float)) +
           gpu_test_bytes_differ(a->y, b->y, (size_t)d->T * rowb) +
           gpu_test_bytes_differ(a->d_y_expert, b->d_y_expert, (size_t)d->cap * rowb) +
           gpu_test_bytes_differ(a->d_x, b->d_x, (size_t)d->T * rowb) +
           gpu_test_bytes_differ(a->d_topk_probs, b->d_topk_probs, (size_t)(d->T * d->K) * sizeof(float));
}

/* One dispatcher case on one rank: CPU once, CUDA twice, compared. Every rank runs the same sequence of
 * collectives, even after a failed check (a failed call may leave peers waiting until the timeout). */
static void run_dispatch_case(const gpu_test_rank_env *env, int ci, dispatch_row *row)
{
    const dispatch_case *cs = &dispatch_cases[ci];
    const int W = env->world, rank = env->rank;
    dispatch_data d;
    memset(&d, 0, sizeof d);
    d.T = cs->empty_first && rank == 0 ? 0 : cs->tokens + 5 * rank;
    d.H = cs->hidden;
    d.K = cs->topk;
    d.es = moert_dtype_size(cs->dtype);
    moert_layer_info layer = test_layer(d.H, 8, cs->experts, d.K, d.T + 5 * MAX_WORLD, W, rank, cs->dtype);
    moert_layer_info gpu_layer = layer;
    gpu_layer.device = gpu_test_rank_device(env);
    char options[96];
    snprintf(options, sizeof options, "{\"pad_to_capacity\": %s, \"capacity_factor\": 3.0}", cs->pad ? "true" : "false");
    char where[96];
    snprintf(where, sizeof where, "%s %s", env->where, cs->name);

    test_instance cpu, gpu;
    moert_result rc = test_instance_open(&cpu, MOERT_KIND_DISPATCHER, DISPATCHER, options, &layer, env->comm, rank, W);
    if (rc != MOERT_OK) gpu_test_failure("%s: CPU dispatcher: %s", where, moert_error_message());
    moert_result rc2 = test_instance_open_cuda(&gpu, MOERT_KIND_DISPATCHER, DISPATCHER, options, &gpu_layer, env->comm,
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

    bool ok = dispatch_cpu(&cpu, vt, cs, &d, &rng, where);
    if (ok) {
        const cudaStream_t s = env->stream;
        const size_t rowb = (size_t)d.H * d.es;
        dispatch_device_inputs in = {
            .idx = gpu_test_device_copy(s, d.idx, (size_t)(d.T * d.K) * sizeof(int32_t)),
            .x = gpu_test_device_copy(s, d.x, (size_t)d.T * rowb),
            .probs = gpu_test_device_copy(s, d.probs, (size_t)(d.T * d.K) * sizeof(float)),
            .y_expert = gpu_test_device_copy(s, d.y_expert, (size_t)d.cap * rowb),
            .d_y = gpu_test_device_copy(s, d.d_y, (size_t)d.T * rowb),
            .d_recv_x = gpu_test_device_copy(s, d.d_recv_x, (size_t)d.cap * rowb),
            .d_recv_probs = gpu_test_device_copy(s, d.d_recv_probs, (size_t)d.cap * sizeof(float))};
        dispatch_got g1, g2;
        memset(&g1, 0, sizeof g1);
        memset(&g2, 0, sizeof g2);
        got_alloc(&g1, &d);
        got_alloc(&g2, &d);
        moert_cuda_pool_stats before, after;
        bool ok1 = dispatch_cuda_step(env, &gpu, vt, cs, &d, &in, &g1);
        if (ok1) dispatch_compare(env, cs, &d, &g1, row);
        moert_cuda_pool_get_stats(env->pool, &before);
        bool ok2 = ok1 && dispatch_cuda_step(env, &gpu, vt, cs, &d, &in, &g2);
        moert_cuda_pool_get_stats(env->pool, &after);
        if (ok2) {
            dispatch_compare(env, cs, &d, &g2, row);
            int64_t repeat = got_differ(&g1, &g2, &d);
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
        got_free(&g1);
        got_free(&g2);
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

/* ---- the bf16 precision plugin ---- */

#define P_HIDDEN 64
#define P_FFN 40
#define P_EXPERTS 4
#define P_PAD 3 /* rows past the counts: must stay untouched */

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
    if (pass == MOERT_GEMM_WGRAD) result = on_gpu ? gpu_test_device_copy(s, g->grad_weight, w_b) : out->data;
    else result = on_gpu ? gpu_test_device_poisoned(s, out->bytes) : out->data;
    if (pass == MOERT_GEMM_WGRAD && !on_gpu) memcpy(out->data, g->grad_weight, w_b);
    if (pass != MOERT_GEMM_WGRAD && !on_gpu) memset(out->data, 0xFF, out->bytes);

    moert_tensor tin = moert_tensor_2d(input, dev, g->act, rows, K), tgo = moert_tensor_2d(grad_output, dev, g->act, rows, N);
    moert_tensor tw = moert_tensor_3d(weight, dev, MOERT_F32, P_EXPERTS, K, N);
    moert_tensor tcounts = moert_tensor_1d(counts_dev, dev, MOERT_I64, P_EXPERTS);
    moert_tensor tout = moert_tensor_2d(result, dev, g->act, rows, N), tgi = moert_tensor_2d(result, dev, g->act, rows, K);
    moert_tensor tgw = moert_tensor_3d(result, dev, MOERT_F32, P_EXPERTS, K, N);
    moert_grouped_gemm_args a = {.struct_size = sizeof a, .which = which, .pass = pass, .tokens_per_expert = &tcounts,
                                 .tokens_per_expert_host = host_counts ? counts : NULL};
    switch (pass) {
    case MOERT_GEMM_FORWARD: a.input = &tin; a.weight = &tw; a.output = &tout; break;
    case MOERT_GEMM_DGRAD: a.grad_output = &tgo; a.weight = &tw; a.grad_input = &tgi; break;
    default: a.input = &tin; a.grad_output = &tgo; a.grad_weight = &tgw; break;
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
    if (test_instance_open(&cpu, MOERT_KIND_PRECISION, PRECISION, bf16 ? "{\"mode\": \"bf16\"}" : "{\"mode\": \"fp32\"}",
                           &layer, NULL, 0, 1) != MOERT_OK ||
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
            bool ok = gemm_run(&cpu, env, false, (moert_gemm_weight)w, (moert_gemm_pass)pass, &g, counts, true, NULL, &rc) &&
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
    moert_layer_info gpu_layer = test_layer(P_HIDDEN, P_FFN, P_EXPERTS * env->world, 2, 256, env->world, env->rank,
                                            MOERT_BF16);
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
    for (int ci = 0; ci < DISPATCH_CASES; ci++) run_dispatch_case(env, ci, &dispatch_table[w->table_base + ci]);
    if (w->run_precision) run_precision(env);
}

/* ---- the table ---- */

static void print_tables(void)
{
    printf("\nalltoall dispatcher, CUDA vs CPU (diffs: bytes that differ; err: relative Frobenius error)\n");
    printf("%-5s  %-28s  %6s  %6s  %8s  %9s  %8s  %9s  %7s  %6s  %6s  %s\n", "world", "case", "recv", "layout",
           "dispatch", "combine", "comb_bwd", "d_x", "d_probs", "repeat", "malloc", "ok");
    for (int i = 0; i < (int)(sizeof dispatch_table / sizeof dispatch_table[0]); i++) {
        const dispatch_row *r = &dispatch_table[i];
        if (!r->ran) continue;
        bool ok = !r->layout_diffs && !r->dispatch_diffs && !r->combine_bwd_diffs && !r->dprobs_diffs &&
                  !r->repeat_diffs && !r->step2_mallocs && r->combine_err <= r->tol && r->dx_err <= r->tol;
        printf("%-5d  %-28s  %6lld  %6lld  %8lld  %9.2e  %8lld  %9.2e  %7lld  %6lld  %6lld  %s\n", r->world, r->name,
               (long long)r->recv_rows, (long long)r->layout_diffs, (long long)r->dispatch_diffs, r->combine_err,
               (long long)r->combine_bwd_diffs, r->dx_err, (long long)r->dprobs_diffs, (long long)r->repeat_diffs,
               (long long)r->step2_mallocs, ok ? "ok" : "FAIL");
    }
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
        world_run w = {.world = worlds[i], .table_base = i * DISPATCH_CASES, .run_precision = worlds[i] == largest};
        for (int ci = 0; ci < DISPATCH_CASES; ci++) {
            dispatch_row *r = &dispatch_table[w.table_base + ci];
            r->world = worlds[i];
            r->name = dispatch_cases[ci].name;
            r->tol = dispatch_cases[ci].dtype == MOERT_BF16 ? 1e-2 : 2e-6;
            r->ran = true;
        }
        gpu_test_run_world(w.world, TIMEOUT_S, rank_main, &w);
    }
    print_tables();
    moert_plugin_unload(&keep_dispatcher);
    moert_plugin_unload(&keep_precision);
    return test_finish("gpu_plugins");
}

#endif
