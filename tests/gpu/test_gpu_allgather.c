/* SPDX-License-Identifier: Apache-2.0 */
/* GPU test of the "allgather" dispatcher's CUDA path against its CPU path, which is the reference, on 1, 2 and 4 GPUs
 * (as many as there are; a thread per GPU, NCCL for device buffers, the threads communicator for the count exchange),
 * on the same random routing for both paths: uniform, one hot expert with the last rank's experts receiving nothing,
 * a rank with no tokens, and many experts with K 8; every case drops some copies and the ranks have different T (the
 * gathered blocks are padded). Dispatch and combine_backward must match bit for bit, and d_topk_probs (one nonzero
 * term per copy); combine and dispatch_backward's d_x within fp32-accumulation tolerance (the CPU sums in double, the
 * CUDA path in fp32); a second identical step must give the same bits and make no new cudaMalloc in the pool. The
 * steps and checks are tests/common/gpu_dispatch_test_harness.c's. Prints a table last. Exits 77 without a GPU. */
#include "test_util.h"

#ifndef MOERT_HAVE_CUDA

int main(void)
{
    printf("gpu_allgather: built without CUDA, skipped\n");
    return TEST_SKIP;
}

#else

#include "gpu_dispatch_test_harness.h"

#define DISPATCHER "allgather"
#define TIMEOUT_S  60.0
#define MAX_WORLD  4
#define WORLDS     3 /* 1, 2 and 4 GPUs, as many as the machine has */

static const gpu_dispatch_case cases[] = {
    {"uniform bf16 H64 K2", MOERT_BF16, 64, 8, 2, 96, 0.10, 0.0, false, false, false, "{}"},
    {"hot fp32 H33 K4", MOERT_F32, 33, 8, 4, 80, 0.15, 0.6, true, false, false, "{}"},
    {"no tokens on rank 0 bf16 K3", MOERT_BF16, 48, 16, 3, 50, 0.05, 0.0, false, true, false, "{}"},
    {"E32 K8 fp32 H128", MOERT_F32, 128, 32, 8, 200, 0.05, 0.0, false, false, false, "{}"},
};
#define CASES      ((int)(sizeof cases / sizeof cases[0]))

static gpu_dispatch_row table[WORLDS * CASES];

static const gpu_dispatch_plugin allgather = {.name = DISPATCHER,
                                              .max_world = MAX_WORLD,
                                              .read_cpu_layout = gpu_dispatch_read_host_cpu_layout,
                                              .read_cuda_layout = gpu_dispatch_read_host_cuda_layout,
                                              .no_timeout_option = true,
                                              .count_step2_mallocs = true};

/* One rank of a world: every case (user: the world's first table row). */
static void rank_main(const gpu_test_rank_env *env, void *user)
{
    gpu_dispatch_row *rows = user;
    for (int ci = 0; ci < CASES; ci++) gpu_dispatch_run_case(&allgather, env, &cases[ci], ci, &rows[ci]);
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
        /* the CPU sums in double and rounds once; CUDA sums in fp32 (bf16: within one rounding) */
        gpu_dispatch_rows_init(&table[i * CASES], worlds[i], cases, CASES);
        gpu_test_run_world(worlds[i], TIMEOUT_S, rank_main, &table[i * CASES]);
    }
    gpu_dispatch_print_rows(&allgather, table, WORLDS * CASES);
    moert_plugin_unload(&keep);
    return test_finish("gpu_allgather");
}

#endif
