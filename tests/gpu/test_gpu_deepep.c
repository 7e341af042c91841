/* SPDX-License-Identifier: Apache-2.0 */
/* GPU test of the "deepep" dispatcher's CUDA path (NVLink writes into the peers' buffers) against its CPU path, the
 * reference, on 1, 2 and 4 GPUs (as many as there are; a thread per GPU). Same routing and data on both paths:
 * uniform, one hot expert with the last rank's experts receiving nothing, a rank with no tokens, tokens with every
 * copy dropped, FP8 dispatch, an fp32 row of odd length, and the deepseek-v3 shape (H 7168, K 8, E 256) at 8 and 24
 * SMs, and once with the option peer_wait_stats (each CUDA instance must log its kernels' peer waits at finalize, two
 * calls of each kind). dispatch, combine_backward and d_topk_probs must match bit for bit; combine and dispatch_backward's d_x
 * within fp32-accumulation tolerance (the bytes that differ are shown; the paths sum in the same order); rows past
 * the capacity untouched; a second identical step gives the same bits. With two GPUs or more, a rank that never
 * dispatches makes rank 0's next prepare() fail with MOERT_ERR_TIMEOUT naming it, within timeout_ms.
 * Every case runs with timeout_ms 5000 (a stalled peer fails the case within seconds, never hangs the test) and the
 * rank threads' communicators give up after 20 s. Progress goes to stdout line by line (world, case, step), so a
 * hang or crash shows where it was. Prints a table last. Exits 77 without a GPU. */
#include "test_util.h"

#ifndef MOERT_HAVE_CUDA

int main(void)
{
    printf("gpu_deepep: built without CUDA, skipped\n");
    return TEST_SKIP;
}

#else

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#include "gpu_dispatch_test_harness.h"

#define DISPATCHER "deepep"
#define TIMEOUT_S  20.0 /* the rank threads' communicators */
#define MAX_WORLD  4

/* ---- cases ---- */

static const gpu_dispatch_case cases[] = {
    {"uniform bf16 H256 K4 E16", MOERT_BF16, 256, 16, 4, 300, 0.10, 0.0, false, false, false, "{}"},
    {"hot, last rank starved, fp32 H33", MOERT_F32, 33, 8, 4, 80, 0.15, 0.6, true, false, false, "{}"},
    {"no tokens on rank 0 bf16 K3", MOERT_BF16, 48, 16, 3, 50, 0.05, 0.0, false, true, false, "{\"num_sms\": 8}"},
    {"dropped tokens bf16 H64 K2", MOERT_BF16, 64, 8, 2, 120, 0.0, 0.0, false, false, true, "{\"num_sms\": 6}"},
    {"fp8 bf16 H512 K8 E32", MOERT_BF16, 512, 32, 8, 200, 0.05, 0.1, false, false, true,
     "{\"dispatch_dtype\": \"fp8\"}"},
    {"deepseek shape bf16 24 SMs", MOERT_BF16, 7168, 256, 8, 256, 0.0, 0.0, false, false, false, "{\"num_sms\": 24}"},
    {"deepseek shape fp8 8 SMs", MOERT_BF16, 7168, 256, 8, 256, 0.0, 0.05, false, false, false,
     "{\"num_sms\": 8, \"dispatch_dtype\": \"fp8\"}"},
    {"uniform bf16 peer_wait_stats", MOERT_BF16, 256, 16, 4, 300, 0.10, 0.0, false, false, false,
     "{\"peer_wait_stats\": true}"},
};
#define CASES      ((int)(sizeof cases / sizeof cases[0]))

#define WORLDS 4 /* 1, 2, 4 and 8 GPUs, as many as the machine has */
static gpu_dispatch_row table[WORLDS * CASES];
static gpu_dispatch_stall_row stall_table[WORLDS];

/* ---- the peer_wait_stats log lines (MOERT_LOG=info, through the log callback) ---- */

static pthread_mutex_t stats_lock = PTHREAD_MUTEX_INITIALIZER;
static int stats_lines, stats_bad;

/* Counts the instances' peer-wait lines and checks each names two calls of every kind; passes warnings and errors
 * on to stderr and drops the other info lines. */
static void collect_log(void *user, moert_log_level level, const char *line)
{
    (void)user;
    if (strstr(line, "peer waits of layer")) {
        static const char *const want[] = {" dispatch x2: rows ", " combine x2: rows ", " combine_backward x2: rows ",
                                           " dispatch_backward x2: rows "};
        bool ok = true;
        for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) ok = ok && strstr(line, want[i]) != NULL;
        pthread_mutex_lock(&stats_lock);
        stats_lines++;
        if (!ok) {
            stats_bad++;
            fprintf(stderr, "peer_wait_stats: unexpected line: %s\n", line);
        }
        pthread_mutex_unlock(&stats_lock);
    } else if (level <= MOERT_LOG_WARN) {
        fprintf(stderr, "%s\n", line);
    }
}

/* What each rank of a world gets: the world's rows in the tables. */
typedef struct world_run {
    int world, index;
} world_run;

/* The CPU path's layout: compact groups (capacity rows, all of them data) and a host copy of the counts. */
static void read_cpu_layout(const moert_dispatch_layout *layout, int64_t local_experts, gpu_dispatch_step *d)
{
    d->nrecv = layout->capacity;
    for (int64_t l = 0; l < local_experts; l++) d->tokens_per_expert[l] = layout->tokens_per_expert_host[l];
}

/* The CUDA path's layout: a host copy of the counts too, which must equal the device's (a difference shows in the
 * count compared with the CPU's). */
static void read_cuda_layout(const gpu_test_rank_env *env, const gpu_dispatch_case *cs,
                             const moert_dispatch_layout *layout, const int64_t *device_counts, gpu_dispatch_step *o)
{
    const int64_t El = cs->experts / env->world;
    for (int64_t l = 0; l < El; l++)
        o->tokens_per_expert[l] =
            layout->tokens_per_expert_host[l] + 1000 * (device_counts[l] != layout->tokens_per_expert_host[l]);
}

static const gpu_dispatch_plugin deepep = {.name = DISPATCHER,
                                           .max_world = MAX_WORLD,
                                           .read_cpu_layout = read_cpu_layout,
                                           .read_cuda_layout = read_cuda_layout};

/* A stalled peer: every rank prepares; only rank 0 dispatches (timeout_ms 300); then every rank prepares again and
 * rank 0's prepare() must fail with MOERT_ERR_TIMEOUT naming rank 1, the others with rank 0's failure. */
static void run_stall(const gpu_test_rank_env *env, gpu_dispatch_stall_row *row)
{
    const int W = env->world, rank = env->rank;
    const int64_t T = 64, H = 128, K = 2, E = 8;
    moert_layer_info layer = test_layer(H, 8, E, K, T, W, rank, MOERT_BF16);
    layer.device = gpu_test_rank_device(env);
    test_instance ti;
    if (test_instance_open_cuda(&ti, MOERT_KIND_DISPATCHER, DISPATCHER, "{\"timeout_ms\": 300}", &layer, env->comm,
                                rank, W, env->pool, env->nccl, (moert_stream)env->stream) != MOERT_OK) {
        gpu_test_failure("%s stall: open: %s", env->where, moert_error_message());
        test_instance_close(&ti);
        return;
    }
    if (rank == 0) gpu_test_progress("world %d, stall: rank 0 dispatches alone", W);
    const moert_dispatcher_v1 *vt = (const moert_dispatcher_v1 *)ti.plugin.header;
    const cudaStream_t s = env->stream;
    int32_t idx_h[64 * 2];
    for (int64_t i = 0; i < T * K; i++) idx_h[i] = (int32_t)((i * 3 + rank) % E);
    void *idx = gpu_test_device_copy(s, idx_h, sizeof idx_h), *x = gpu_test_device_poisoned(s, (size_t)(T * H) * 2);
    void *recv = gpu_test_device_poisoned(s, (size_t)(T * K * W) * H * 2);
    moert_tensor it = moert_tensor_2d(idx, gpu_test_rank_device(env), MOERT_I32, T, K);
    moert_dispatch_layout layout = {.struct_size = sizeof layout};
    if (CALL(&ti, vt->prepare(ti.ctx, (moert_stream)s, &it, &layout), env->where)) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        if (rank == 0) {
            moert_tensor xt = moert_tensor_2d(x, gpu_test_rank_device(env), MOERT_BF16, T, H);
            moert_tensor rt = moert_tensor_2d(recv, gpu_test_rank_device(env), MOERT_BF16, layout.capacity, H);
            moert_dispatch_args da = {.struct_size = sizeof da, .x = &xt, .recv_x = &rt};
            CALL(&ti, vt->dispatch(ti.ctx, (moert_stream)s, &da), env->where); /* enqueued: fails later */
        }
        moert_result rc = vt->prepare(ti.ctx, (moert_stream)s, &it, &layout);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        const char *msg = moert_host_take_error(ti.host);
        bool ok = rank == 0 ? rc == MOERT_ERR_TIMEOUT && strstr(msg, "rank 1 did not deliver its rows within 300 ms")
                            : rc != MOERT_OK && strstr(msg, "rank 0 failed its prepare()");
        if (!ok) gpu_test_failure("%s stall: prepare gave %s \"%s\"", env->where, moert_result_name(rc), msg);
        if (rank == 0) {
            row->ran = true;
            row->ok = ok;
            row->seconds = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
            snprintf(row->message, sizeof row->message, "%s", msg);
        }
    }
    CK(cudaStreamSynchronize(s));
    CK(cudaFree(idx));
    CK(cudaFree(x));
    CK(cudaFree(recv));
    test_instance_close(&ti);
}

/* One rank of a world: every case, then the stalled peer. */
static void rank_main(const gpu_test_rank_env *env, void *user)
{
    world_run *w = user;
    for (int ci = 0; ci < CASES; ci++)
        gpu_dispatch_run_case(&deepep, env, &cases[ci], ci, &table[w->index * CASES + ci]);
    if (w->world > 1) run_stall(env, &stall_table[w->index]);
}

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0); /* progress lines show where a hang or crash was */
    setenv("MOERT_LOG", "info", 1);   /* the peer_wait_stats case's lines; collect_log drops the other info lines */
    moert_set_log_callback(collect_log, NULL);
    int gpus = gpu_test_device_count("gpu_deepep");
    if (gpus == 0) return TEST_SKIP;
    moert_plugin keep;
    memset(&keep, 0, sizeof keep);
    EXPECT_OK(moert_plugin_load(MOERT_KIND_DISPATCHER, DISPATCHER, &keep));
    if (test_failures) return test_finish("gpu_deepep");
    const int worlds[WORLDS] = {1, 2, 4, 8};
    for (int i = 0; i < WORLDS; i++) {
        if (worlds[i] > gpus) continue;
        world_run w = {.world = worlds[i], .index = i};
        gpu_dispatch_rows_init(&table[i * CASES], worlds[i], cases, CASES);
        stall_table[i].world = worlds[i];
        stats_lines = stats_bad = 0;
        gpu_test_run_world(w.world, TIMEOUT_S, rank_main, &w);
        /* the peer_wait_stats case: one line per rank's CUDA instance, each with two calls of every kind */
        printf("peer_wait_stats, world %d: %d line(s), %d unexpected\n", worlds[i], stats_lines, stats_bad);
        if (stats_lines != worlds[i] || stats_bad)
            gpu_test_failure("world %d: peer_wait_stats logged %d line(s) (%d unexpected), expected %d", worlds[i],
                             stats_lines, stats_bad, worlds[i]);
    }
    gpu_dispatch_print_rows(&deepep, table, WORLDS * CASES);
    for (int i = 0; i < WORLDS; i++)
        if (stall_table[i].ran)
            printf("stall, world %d: %s after %.2f s: %s\n", stall_table[i].world, stall_table[i].ok ? "ok" : "FAIL",
                   stall_table[i].seconds, stall_table[i].message);
    moert_plugin_unload(&keep);
    moert_set_log_callback(NULL, NULL);
    return test_finish("gpu_deepep");
}

#endif
