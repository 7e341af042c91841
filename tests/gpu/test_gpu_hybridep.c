/* SPDX-License-Identifier: Apache-2.0 */
/* GPU test of the "hybridep" dispatcher's CUDA path (TMA bulk copies or vector copies into the peers' buffers, no host
 * sync in a step) against its CPU path, the reference, on 1, 2, 4 and 8 GPUs (as many as there are; a thread per GPU).
 * Same routing and data on both paths: uniform, one hot expert with the last rank's experts receiving nothing, a rank
 * with no tokens, tokens with every copy dropped, an fp32 row of odd length (vector fallback, in low-latency and in
 * normal mode), low-latency mode, vector copies, and the deepseek-v3 shape (H 7168, K 8, E 256) at 8 and 16 SMs and
 * in low-latency mode with 8 blocks. dispatch (the received rows, the
 * CPU's num_recv of them), combine_backward, the device counts and d_topk_probs must match bit for bit; combine and
 * dispatch_backward's d_x within fp32-accumulation tolerance; rows past the received ones untouched; a second
 * identical step gives the same bits. With two GPUs or more: a rank that dispatches alone, and a rank with a bad expert
 * id; both are reported, naming the rank, by the first call after the failing kernel finished (no host sync in a
 * step: the kernels leave a status word in mapped pinned memory). The low-latency tuning options (ll_threads, ll_piece,
 * ll_flag, ll_fence) have cases of their own. CUDA graphs: the instance declares itself graph-capturable; every rank
 * captures prepare + the four calls on its stream (one graph each), replays it 3 times with a new routing written
 * into the same topk_idx buffer before each replay, eager calls of the same instance in between; every output of a
 * replay must match the eager calls' bit for bit and the CPU path as above (low-latency and normal mode). Every case
 * runs with timeout_ms 5000. Progress goes to stdout line by line. Prints a table last. Exits 77 without a GPU. */
#include "test_util.h"

#ifndef MOERT_HAVE_CUDA

int main(void)
{
    printf("gpu_hybridep: built without CUDA, skipped\n");
    return TEST_SKIP;
}

#else

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <time.h>

#include "gpu_dispatch_test_harness.h"

#define DISPATCHER "hybridep"
#define TIMEOUT_S  20.0 /* the rank threads' communicators */
#define MAX_WORLD  8

/* ---- cases ---- */

static const gpu_dispatch_case cases[] = {
    {"uniform bf16 H256 K4 E16", MOERT_BF16, 256, 16, 4, 300, 0.10, 0.0, false, false, false, "{}"},
    {"hot, last rank starved, fp32 H33", MOERT_F32, 33, 8, 4, 80, 0.15, 0.6, true, false, false, "{}"},
    {"no tokens on rank 0 bf16 K3", MOERT_BF16, 48, 16, 3, 50, 0.05, 0.0, false, true, false, "{\"num_sms\": 8}"},
    {"dropped tokens bf16 H64 K2 (tma)", MOERT_BF16, 64, 8, 2, 120, 0.0, 0.0, false, false, true,
     "{\"num_sms\": 6, \"low_latency\": \"off\"}"},
    {"low-latency bf16 H512 K8 E32", MOERT_BF16, 512, 32, 8, 100, 0.05, 0.1, false, false, true,
     "{\"low_latency\": \"on\"}"},
    {"vector copies bf16 H512 K6 E32", MOERT_BF16, 512, 32, 6, 200, 0.05, 0.1, false, false, false,
     "{\"copy\": \"vector\", \"low_latency\": \"off\"}"},
    {"deepseek shape bf16 16 SMs", MOERT_BF16, 7168, 256, 8, 256, 0.0, 0.0, false, false, false,
     "{\"num_sms\": 16, \"low_latency\": \"off\"}"},
    {"deepseek shape bf16 8 SMs, hot", MOERT_BF16, 7168, 256, 8, 256, 0.0, 0.3, false, false, false,
     "{\"num_sms\": 8, \"low_latency\": \"off\"}"},
    {"fp32 H33 normal mode 3 SMs, starved", MOERT_F32, 33, 8, 4, 80, 0.15, 0.6, true, false, true,
     "{\"num_sms\": 3, \"low_latency\": \"off\"}"},
    {"deepseek shape low-latency 8 blocks", MOERT_BF16, 7168, 256, 8, 128, 0.02, 0.0, false, false, false,
     "{\"num_sms\": 8, \"low_latency\": \"on\"}"},
    {"ll 1024 threads, per-block flag", MOERT_BF16, 7168, 256, 8, 128, 0.02, 0.1, false, false, true,
     "{\"low_latency\": \"on\", \"ll_threads\": 1024, \"ll_flag\": \"per_block\", \"ll_fence\": \"block\"}"},
    {"ll 2 KB pieces, block fence", MOERT_BF16, 7168, 256, 8, 100, 0.05, 0.0, false, false, false,
     "{\"low_latency\": \"on\", \"ll_piece\": 2048, \"ll_fence\": \"block\", \"num_sms\": 16}"},
    {"ll fp32 H33 512-B pieces, per-block", MOERT_F32, 33, 8, 4, 80, 0.15, 0.6, true, false, true,
     "{\"low_latency\": \"on\", \"ll_piece\": 512, \"ll_flag\": \"per_block\", \"ll_threads\": 1024}"},
    {"ll thread fence (before the default)", MOERT_BF16, 7168, 256, 8, 128, 0.02, 0.1, false, false, true,
     "{\"low_latency\": \"on\", \"ll_fence\": \"thread\"}"},
};
#define CASES      ((int)(sizeof cases / sizeof cases[0]))

#define WORLDS      4 /* 1, 2, 4 and 8 GPUs, as many as the machine has */
static gpu_dispatch_row table[WORLDS * CASES];
static gpu_dispatch_row graph_case_rows[WORLDS * 4]; /* the graph cases against the CPU (GRAPH_CASES, defined below) */
static gpu_dispatch_stall_row stall_table[WORLDS];

/* What each rank of a world gets: the world's rows in the tables. */
typedef struct world_run {
    int world, index;
} world_run;

/* The CPU path's layout: the received rows first (num_recv of them), the counts on the CPU (no host copy). */
static void read_cpu_layout(const moert_dispatch_layout *layout, int64_t local_experts, gpu_dispatch_step *d)
{
    d->nrecv = layout->num_recv;
    for (int64_t l = 0; l < local_experts; l++)
        d->tokens_per_expert[l] = ((const int64_t *)layout->tokens_per_expert.data)[l];
}

/* The CUDA path's layout: the counts on the device only, and num_recv unknown (no host sync). */
static void read_cuda_layout(const gpu_test_rank_env *env, const gpu_dispatch_case *cs,
                             const moert_dispatch_layout *layout, const int64_t *device_counts, gpu_dispatch_step *o)
{
    const int64_t El = cs->experts / env->world;
    for (int64_t l = 0; l < El; l++) o->tokens_per_expert[l] = device_counts[l];
    if (layout->tokens_per_expert_host != NULL || layout->num_recv != -1)
        gpu_test_failure("%s %s: CUDA layout has a host count array or num_recv %lld (expected NULL and -1: no host "
                         "sync)",
                         env->where, cs->name, (long long)layout->num_recv);
}

static const gpu_dispatch_plugin hybridep = {.name = DISPATCHER,
                                             .max_world = MAX_WORLD,
                                             .read_cpu_layout = read_cpu_layout,
                                             .read_cuda_layout = read_cuda_layout};

/* A stalled peer: every rank prepares; only rank 0 dispatches (timeout_ms 300); every rank waits for its stream (the
 * kernels end within the timeout), then rank 0's next call must fail with MOERT_ERR_TIMEOUT naming rank 1; the others
 * prepare again (their notify waits for rank 0 in vain), wait, and their next call names rank 0. Then a bad expert id
 * on rank 1 in a fresh instance: after the stream is done, every rank's next call reports rank 1's bad ids. */
static void run_stall(const gpu_test_rank_env *env, gpu_dispatch_stall_row *row)
{
    const int W = env->world, rank = env->rank;
    const int64_t T = 64, H = 128, K = 2, E = 8;
    moert_layer_info layer = test_layer(H, 8, E, K, T, W, rank, MOERT_BF16);
    layer.device = gpu_test_rank_device(env);
    const cudaStream_t s = env->stream;
    int32_t idx_h[64 * 2];
    for (int64_t i = 0; i < T * K; i++) idx_h[i] = (int32_t)((i * 3 + rank) % E);
    void *idx = gpu_test_device_copy(s, idx_h, sizeof idx_h), *x = gpu_test_device_poisoned(s, (size_t)(T * H) * 2);
    void *recv = gpu_test_device_poisoned(s, (size_t)(T * K * W) * H * 2);
    moert_tensor it = moert_tensor_2d(idx, gpu_test_rank_device(env), MOERT_I32, T, K);
    moert_dispatch_layout layout = {.struct_size = sizeof layout};
    for (int round = 0; round < 2; round++) {
        test_instance ti;
        if (test_instance_open_cuda(&ti, MOERT_KIND_DISPATCHER, DISPATCHER, "{\"timeout_ms\": 300}", &layer, env->comm,
                                    rank, W, env->pool, env->nccl, (moert_stream)env->stream) != MOERT_OK) {
            gpu_test_failure("%s stall: open: %s", env->where, moert_error_message());
            test_instance_close(&ti);
            break;
        }
        const moert_dispatcher_v1 *vt = (const moert_dispatcher_v1 *)ti.plugin.header;
        moert_tensor xt = moert_tensor_2d(x, gpu_test_rank_device(env), MOERT_BF16, T, H);
        moert_tensor rt = moert_tensor_2d(recv, gpu_test_rank_device(env), MOERT_BF16, T * K * W, H);
        moert_dispatch_args da = {.struct_size = sizeof da, .x = &xt, .recv_x = &rt};
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        moert_result rc = MOERT_OK;
        const char *msg = "";
        bool ok = false;
        if (round == 0) {
            if (rank == 0) gpu_test_progress("world %d, stall: rank 0 dispatches alone", W);
            if (CALL(&ti, vt->prepare(ti.ctx, (moert_stream)s, &it, &layout), env->where)) {
                if (rank == 0)
                    CALL(&ti, vt->dispatch(ti.ctx, (moert_stream)s, &da), env->where); /* fails later */
                else
                    CALL(&ti, vt->prepare(ti.ctx, (moert_stream)s, &it, &layout), env->where); /* notify: in vain */
                CK(cudaStreamSynchronize(s)); /* bounded: the kernels give up after timeout_ms */
                rc = vt->prepare(ti.ctx, (moert_stream)s, &it, &layout);
                msg = moert_host_take_error(ti.host);
                ok = rank == 0 ? rc == MOERT_ERR_TIMEOUT && strstr(msg, "rank 1 did not deliver its rows within 300 ms")
                               : rc == MOERT_ERR_TIMEOUT && strstr(msg, "rank 0 did not send its counts within 300 ms");
            }
        } else {
            if (rank == 0) gpu_test_progress("world %d, bad expert id on rank 1", W);
            int32_t bad_h[64 * 2];
            memcpy(bad_h, idx_h, sizeof bad_h);
            if (rank == 1) bad_h[5] = 99;
            void *bad = gpu_test_device_copy(s, bad_h, sizeof bad_h);
            moert_tensor bt = moert_tensor_2d(bad, gpu_test_rank_device(env), MOERT_I32, T, K);
            if (CALL(&ti, vt->prepare(ti.ctx, (moert_stream)s, &bt, &layout), env->where)) {
                CK(cudaStreamSynchronize(s));
                rc = vt->dispatch(ti.ctx, (moert_stream)s, &da);
                msg = moert_host_take_error(ti.host);
                ok = rc == MOERT_ERR_INVALID_ARGUMENT && strstr(msg, "rank 1's topk_idx had expert ids outside [0, 8)");
            }
            CK(cudaStreamSynchronize(s));
            CK(cudaFree(bad));
        }
        clock_gettime(CLOCK_MONOTONIC, &t1);
        if (!ok)
            gpu_test_failure("%s %s: gave %s \"%s\"", env->where, round ? "bad ids" : "stall", moert_result_name(rc),
                             msg);
        if (rank == 0 && round == 0) {
            row->ran = true;
            row->ok = ok;
            row->seconds = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
            snprintf(row->message, sizeof row->message, "%s", msg);
        }
        if (rank == 0 && round == 1) row->ok = row->ok && ok;
        CK(cudaStreamSynchronize(s));
        test_instance_close(&ti);
    }
    CK(cudaFree(idx));
    CK(cudaFree(x));
    CK(cudaFree(recv));
}

/* ---- CUDA graphs ---- */

static const gpu_dispatch_case graph_cases[] = {
    {"graph: low-latency bf16 H512 K8 E32", MOERT_BF16, 512, 32, 8, 100, 0.05, 0.1, false, false, true,
     "{\"low_latency\": \"on\"}"},
    {"graph: ll per-block flag, 1024 threads", MOERT_BF16, 512, 32, 8, 100, 0.05, 0.1, false, false, true,
     "{\"low_latency\": \"on\", \"ll_flag\": \"per_block\", \"ll_fence\": \"block\", \"ll_threads\": 1024}"},
    {"graph: normal mode (tma) bf16 H512 K6", MOERT_BF16, 512, 32, 6, 200, 0.05, 0.1, false, false, false,
     "{\"low_latency\": \"off\", \"num_sms\": 4}"},
    {"graph: normal mode fp32 H33 (vector)", MOERT_F32, 33, 8, 4, 80, 0.15, 0.6, true, false, true,
     "{\"low_latency\": \"off\", \"num_sms\": 3}"},
};
#define GRAPH_CASES ((int)(sizeof graph_cases / sizeof graph_cases[0]))
#define REPLAYS     3

typedef struct graph_row {
    int world;
    const char *name;
    bool ran, capturable, captured;
    int64_t replays, recv_rows, vs_eager_diffs; /* bytes where a replay differs from the eager calls */
} graph_row;
static graph_row graph_table[WORLDS * GRAPH_CASES];

/* One graph case on one rank: captures prepare + the four calls once (d_x reset and recv_x poisoned first, inside the
 * graph), then REPLAYS times: a new routing into the same topk_idx buffer, replay, an eager step of the same instance
 * with the same routing, and the CPU reference; replay against eager bit for bit, both against the CPU (compare). */
static void run_graph_case(const gpu_test_rank_env *env, const gpu_dispatch_case *cs, gpu_dispatch_row *row,
                           graph_row *grow)
{
    const int W = env->world, rank = env->rank;
    const moert_device gpu_dev = gpu_test_rank_device(env);
    const cudaStream_t s = env->stream;
    gpu_dispatch_step d;
    memset(&d, 0, sizeof d);
    d.T = cs->tokens + 5 * rank;
    d.H = cs->hidden;
    d.K = cs->topk;
    d.es = moert_dtype_size(cs->dtype);
    const int64_t T = d.T, H = d.H, K = d.K, El = cs->experts / W;
    const size_t rowb = (size_t)H * d.es;
    moert_layer_info layer = test_layer(H, 8, cs->experts, K, cs->tokens + 5 * MAX_WORLD, W, rank, cs->dtype);
    moert_layer_info gpu_layer = layer;
    gpu_layer.device = gpu_dev;
    char where[128], options[200];
    snprintf(where, sizeof where, "%s %s", env->where, cs->name);
    snprintf(options, sizeof options, "{\"timeout_ms\": " GPU_DISPATCH_CASE_TIMEOUT ", %s", cs->options + 1);
    if (rank == 0) gpu_test_progress("world %d, case \"%s\" %s: open", W, cs->name, options);
    test_instance cpu, gpu;
    moert_result rc = test_instance_open(&cpu, MOERT_KIND_DISPATCHER, DISPATCHER, options, &layer, env->comm, rank, W);
    if (rc != MOERT_OK) gpu_test_failure("%s: CPU dispatcher: %s", where, moert_error_message());
    moert_result rc2 = test_instance_open_cuda(&gpu, MOERT_KIND_DISPATCHER, DISPATCHER, options, &gpu_layer, env->comm,
                                               rank, W, env->pool, env->nccl, (moert_stream)s);
    if (rc2 != MOERT_OK) gpu_test_failure("%s: CUDA dispatcher: %s", where, moert_error_message());
    if (rc != MOERT_OK || rc2 != MOERT_OK) {
        test_instance_close(&cpu);
        test_instance_close(&gpu);
        return;
    }
    const moert_dispatcher_v1 *vt = (const moert_dispatcher_v1 *)gpu.plugin.header;
    const bool capturable = (moert_host_instance_flags(gpu.host, vt->header.flags) & MOERT_CAP_GRAPH_CAPTURABLE) != 0;
    if (!capturable) gpu_test_failure("%s: the CUDA instance does not declare MOERT_CAP_GRAPH_CAPTURABLE", where);

    /* fixed inputs; the routing changes per replay */
    uint64_t rng = 0xabcdef12345ull + 1000003ull * (uint64_t)(rank + 1);
    d.cap = layer.max_tokens * W * (K < El ? K : El);
    d.idx = gpu_test_host_alloc((size_t)(T * K) * sizeof(int32_t));
    d.x = gpu_test_host_alloc((size_t)T * rowb);
    d.d_y = gpu_test_host_alloc((size_t)T * rowb);
    d.d_x0 = gpu_test_host_alloc((size_t)T * rowb);
    d.probs = gpu_test_host_alloc((size_t)(T * K) * sizeof(float));
    d.y_expert = gpu_test_host_alloc((size_t)d.cap * rowb);
    d.d_recv_x = gpu_test_host_alloc((size_t)d.cap * rowb);
    d.d_recv_probs = gpu_test_host_alloc((size_t)d.cap * sizeof(float));
    gpu_test_fill_random(d.x, cs->dtype, T * H, &rng, 1.0);
    gpu_test_fill_random(d.d_y, cs->dtype, T * H, &rng, 1.0);
    gpu_test_fill_random(d.d_x0, cs->dtype, T * H, &rng, 1.0);
    for (int64_t i = 0; i < T * K; i++) d.probs[i] = (float)((test_uniform(&rng) + 1) / 2);
    gpu_test_fill_random(d.y_expert, cs->dtype, d.cap * H, &rng, 1.0);
    gpu_test_fill_random(d.d_recv_x, cs->dtype, d.cap * H, &rng, 1.0);
    gpu_test_fill_random(d.d_recv_probs, MOERT_F32, d.cap, &rng, 1.0);
    gpu_dispatch_outputs_alloc(&d, &d);
    gpu_dispatch_make_routing(cs, W, T, &rng, d.idx);
    void *in[7] = {gpu_test_device_copy(s, d.idx, (size_t)(T * K) * 4),
                   gpu_test_device_copy(s, d.x, (size_t)T * rowb),
                   gpu_test_device_copy(s, d.probs, (size_t)(T * K) * 4),
                   gpu_test_device_copy(s, d.y_expert, (size_t)d.cap * rowb),
                   gpu_test_device_copy(s, d.d_y, (size_t)T * rowb),
                   gpu_test_device_copy(s, d.d_recv_x, (size_t)d.cap * rowb),
                   gpu_test_device_copy(s, d.d_recv_probs, (size_t)d.cap * 4)};
    void *d_x0 = gpu_test_device_copy(s, d.d_x0, (size_t)T * rowb);
    void *recv_x = gpu_test_device_poisoned(s, (size_t)(d.cap + 2) * rowb),
         *recv_probs = gpu_test_device_poisoned(s, (size_t)d.cap * 4);
    void *y = gpu_test_device_poisoned(s, (size_t)T * rowb),
         *d_y_expert = gpu_test_device_poisoned(s, (size_t)d.cap * rowb);
    void *d_x = gpu_test_device_poisoned(s, (size_t)T * rowb),
         *d_topk_probs = gpu_test_device_poisoned(s, (size_t)(T * K) * 4);
    CK(cudaStreamSynchronize(s));

    /* capture: the resets, prepare and the four calls */
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    moert_dispatch_layout layout = {.struct_size = sizeof layout};
    if (rank == 0) gpu_test_progress("world %d, case \"%s\": capture", W, cs->name);
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    CK(cudaMemsetAsync(recv_x, 0xFF, (size_t)(d.cap + 2) * rowb, s));
    CK(cudaMemcpyAsync(d_x, d_x0, (size_t)T * rowb, cudaMemcpyDeviceToDevice, s));
    moert_tensor it = moert_tensor_2d(in[0], gpu_dev, MOERT_I32, T, K);
    bool ok = CALL(&gpu, vt->prepare(gpu.ctx, (moert_stream)s, &it, &layout), where) &&
              gpu_dispatch_run_calls(&gpu, (moert_stream)s, gpu_dev, cs->dtype, &d, in[1], in[2], recv_x, recv_probs,
                                     in[3], y, in[4], d_y_expert, in[5], in[6], d_x, d_topk_probs, where);
    cudaError_t end = cudaStreamEndCapture(s, &graph);
    if (end != cudaSuccess) gpu_test_failure("%s: cudaStreamEndCapture: %s", where, cudaGetErrorString(end));
    if (ok && end == cudaSuccess) {
        cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
        if (inst != cudaSuccess) gpu_test_failure("%s: cudaGraphInstantiate: %s", where, cudaGetErrorString(inst));
        ok = inst == cudaSuccess;
    }
    ok = ok && end == cudaSuccess;
    if (!ok) gpu_test_failure("%s: the capture failed; replays skipped (the ranks still run the eager steps)", where);
    const int64_t *counts_dev = layout.tokens_per_expert.data;
    pthread_mutex_lock(&gpu_dispatch_table_lock);
    grow->capturable = capturable;
    grow->captured = grow->captured || ok; /* any rank */
    pthread_mutex_unlock(&gpu_dispatch_table_lock);

    gpu_dispatch_step g = d, e = d;
    gpu_dispatch_outputs_alloc(&g, &d);
    gpu_dispatch_outputs_alloc(&e, &d);
    const moert_dispatcher_v1 *cvt = (const moert_dispatcher_v1 *)cpu.plugin.header;
    for (int r = 0; r < REPLAYS; r++) {
        if (r > 0) { /* a new routing in the same buffer */
            gpu_dispatch_make_routing(cs, W, T, &rng, d.idx);
            CK(cudaMemcpyAsync(in[0], d.idx, (size_t)(T * K) * 4, cudaMemcpyHostToDevice, s));
        }
        if (rank == 0) gpu_test_progress("world %d, case \"%s\": replay %d", W, cs->name, r + 1);
        if (ok) {
            CK(cudaGraphLaunch(exec, s));
            int64_t dev_counts[256] = {0};
            gpu_test_download(s, dev_counts, counts_dev, (size_t)El * sizeof(int64_t));
            for (int64_t l = 0; l < El; l++) g.tokens_per_expert[l] = dev_counts[l];
            gpu_test_download(s, g.recv_x, recv_x, (size_t)(d.cap + 2) * rowb);
            gpu_test_download(s, g.recv_probs, recv_probs, (size_t)d.cap * 4);
            gpu_test_download(s, g.y, y, (size_t)T * rowb);
            gpu_test_download(s, g.d_y_expert, d_y_expert, (size_t)d.cap * rowb);
            gpu_test_download(s, g.d_x, d_x, (size_t)T * rowb);
            gpu_test_download(s, g.d_topk_probs, d_topk_probs, (size_t)(T * K) * 4);
        }
        /* an eager step of the same instance (its calls numbered after the replay's) and the CPU reference */
        bool eok = gpu_dispatch_cuda_step(&hybridep, env, &gpu, cs, &d, in, &e);
        moert_tensor idx = moert_tensor_2d(d.idx, moert_cpu(), MOERT_I32, T, K);
        moert_dispatch_layout cl = {.struct_size = sizeof cl};
        bool cok = CALL(&cpu, cvt->prepare(cpu.ctx, NULL, &idx, &cl), where);
        if (cok) {
            read_cpu_layout(&cl, El, &d);
            memset(d.recv_x, 0xFF, (size_t)(d.cap + 2) * rowb);
            memcpy(d.d_x, d.d_x0, (size_t)T * rowb);
            cok = gpu_dispatch_run_calls(&cpu, NULL, moert_cpu(), cs->dtype, &d, d.x, d.probs, d.recv_x, d.recv_probs,
                                         d.y_expert, d.y, d.d_y, d.d_y_expert, d.d_recv_x, d.d_recv_probs, d.d_x,
                                         d.d_topk_probs, where);
        }
        if (!cok || !eok) continue;
        gpu_dispatch_compare(env, cs, &d, &e, row);
        if (!ok) continue;
        gpu_dispatch_compare(env, cs, &d, &g, row);
        int64_t diff = gpu_test_bytes_differ(g.recv_x, e.recv_x, (size_t)(d.cap + 2) * rowb) +
                       gpu_test_bytes_differ(g.recv_probs, e.recv_probs, (size_t)d.nrecv * 4) +
                       gpu_test_bytes_differ(g.y, e.y, (size_t)T * rowb) +
                       gpu_test_bytes_differ(g.d_y_expert, e.d_y_expert, (size_t)d.nrecv * rowb) +
                       gpu_test_bytes_differ(g.d_x, e.d_x, (size_t)T * rowb) +
                       gpu_test_bytes_differ(g.d_topk_probs, e.d_topk_probs, (size_t)(T * K) * 4);
        for (int64_t l = 0; l < El; l++) diff += g.tokens_per_expert[l] != e.tokens_per_expert[l];
        pthread_mutex_lock(&gpu_dispatch_table_lock);
        grow->replays += rank == 0;
        grow->recv_rows += d.nrecv;
        grow->vs_eager_diffs += diff;
        row->recv_rows += d.nrecv;
        pthread_mutex_unlock(&gpu_dispatch_table_lock);
        if (diff)
            gpu_test_failure("%s: replay %d differs from the eager calls in %lld bytes", where, r + 1, (long long)diff);
    }
    CK(cudaStreamSynchronize(s));
    if (exec) CK(cudaGraphExecDestroy(exec));
    if (graph) CK(cudaGraphDestroy(graph));
    void *bufs[] = {d_x0, recv_x, recv_probs, y, d_y_expert, d_x, d_topk_probs};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) CK(cudaFree(bufs[i]));
    for (int i = 0; i < 7; i++) CK(cudaFree(in[i]));
    gpu_dispatch_outputs_free(&g);
    gpu_dispatch_outputs_free(&e);
    gpu_dispatch_outputs_free(&d);
    void *hb[] = {d.idx, d.x, d.d_y, d.d_x0, d.probs, d.y_expert, d.d_recv_x, d.d_recv_probs};
    for (size_t i = 0; i < sizeof hb / sizeof hb[0]; i++) free(hb[i]);
    test_instance_close(&cpu);
    test_instance_close(&gpu);
    if (rank == 0) gpu_test_progress("world %d, case \"%s\": done", W, cs->name);
}

/* One rank of a world: every case, the graph cases, then the stalled peer and the bad ids. */
static void rank_main(const gpu_test_rank_env *env, void *user)
{
    world_run *w = user;
    for (int ci = 0; ci < CASES; ci++)
        gpu_dispatch_run_case(&hybridep, env, &cases[ci], ci, &table[w->index * CASES + ci]);
    for (int gi = 0; gi < GRAPH_CASES; gi++)
        run_graph_case(env, &graph_cases[gi], &graph_case_rows[w->index * GRAPH_CASES + gi],
                       &graph_table[w->index * GRAPH_CASES + gi]);
    if (w->world > 1) run_stall(env, &stall_table[w->index]);
}

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0); /* progress lines show where a hang or crash was */
    int gpus = gpu_test_device_count("gpu_hybridep");
    if (gpus == 0) return TEST_SKIP;
    moert_plugin keep;
    memset(&keep, 0, sizeof keep);
    EXPECT_OK(moert_plugin_load(MOERT_KIND_DISPATCHER, DISPATCHER, &keep));
    if (test_failures) return test_finish("gpu_hybridep");
    const int worlds[WORLDS] = {1, 2, 4, 8};
    for (int i = 0; i < WORLDS; i++) {
        if (worlds[i] > gpus) continue;
        world_run w = {.world = worlds[i], .index = i};
        gpu_dispatch_rows_init(&table[i * CASES], worlds[i], cases, CASES);
        gpu_dispatch_rows_init(&graph_case_rows[i * GRAPH_CASES], worlds[i], graph_cases, GRAPH_CASES);
        for (int gi = 0; gi < GRAPH_CASES; gi++) {
            graph_table[i * GRAPH_CASES + gi].world = worlds[i];
            graph_table[i * GRAPH_CASES + gi].name = graph_cases[gi].name;
            graph_table[i * GRAPH_CASES + gi].ran = true;
        }
        stall_table[i].world = worlds[i];
        gpu_test_run_world(w.world, TIMEOUT_S, rank_main, &w);
    }
    gpu_dispatch_print_rows(&hybridep, table, WORLDS * CASES);
    for (int i = 0; i < WORLDS * GRAPH_CASES; i++) {
        const gpu_dispatch_row *r = &graph_case_rows[i];
        const graph_row *gr = &graph_table[i];
        if (!r->ran) continue;
        bool ok = !r->layout_diffs && !r->dispatch_diffs && !r->cb_diffs && !r->dprobs_diffs &&
                  r->combine_err <= r->tol && r->dx_err <= r->tol && gr->capturable && gr->captured &&
                  gr->replays == REPLAYS && !gr->vs_eager_diffs;
        printf("%-5d  %-34s  %7lld  %6lld  %8lld  %9.2e  %7lld  %8lld  %9.2e  %7lld  %7lld  %6s  %s  (capturable %s, "
               "%lld replays, %lld bytes differ from eager)\n",
               r->world, r->name, (long long)r->recv_rows, (long long)r->layout_diffs, (long long)r->dispatch_diffs,
               r->combine_err, (long long)r->combine_bytes, (long long)r->cb_diffs, r->dx_err, (long long)r->dx_bytes,
               (long long)r->dprobs_diffs, "-", ok ? "ok" : "FAIL", gr->capturable ? "yes" : "no",
               (long long)gr->replays, (long long)gr->vs_eager_diffs);
    }
    for (int i = 0; i < WORLDS; i++)
        if (stall_table[i].ran)
            printf("stall and bad ids, world %d: %s after %.2f s: %s\n", stall_table[i].world,
                   stall_table[i].ok ? "ok" : "FAIL", stall_table[i].seconds, stall_table[i].message);
    moert_plugin_unload(&keep);
    return test_finish("gpu_hybridep");
}

#endif
