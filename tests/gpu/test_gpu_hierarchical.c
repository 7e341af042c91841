/* SPDX-License-Identifier: Apache-2.0 */
/* GPU test of the "hierarchical" dispatcher's CUDA path against its CPU path, which is the reference, on 1, 2 and 4
 * GPUs (as many as there are; a thread per GPU, NCCL for device buffers, the threads communicator for the counts and
 * the routing that prepare() exchanges) in nodes of every size dividing the world (2 GPUs: 2 nodes of 1 and 1 node
 * of 2; 4 GPUs: 4 x 1, 2 x 2, 1 x 4), on the same random routing for both paths: uniform, one hot expert, a rank
 * without tokens, and many experts with K 8 (many tokens with several copies on one node). Dispatch and
 * combine_backward must match bit for bit, and d_topk_probs (one value per copy); combine and dispatch_backward's d_x
 * within fp32-accumulation tolerance (both round each node's partial to the row dtype; the CPU sums in double, the
 * CUDA path in fp32); a second identical step must give the same bits and make no new cudaMalloc in the pool. The
 * steps and checks are tests/common/gpu_dispatch_test_harness.c's; the table shows the dispatch bytes between and
 * inside nodes (all ranks). Prints a table last. Exits 77 without a GPU. */
#include "test_util.h"

#ifndef MOERT_HAVE_CUDA

int main(void)
{
    printf("gpu_hierarchical: built without CUDA, skipped\n");
    return TEST_SKIP;
}

#else

#include <stdio.h>

#include "gpu_dispatch_test_harness.h"

#define DISPATCHER "hierarchical"
#define TIMEOUT_S  60.0
#define MAX_WORLD  4
#define MAX_RUNS   16 /* (world, ranks_per_node) pairs */

static const gpu_dispatch_case cases[] = {
    {"uniform bf16 H64 K2", MOERT_BF16, 64, 8, 2, 96, 0.10, 0.0, false, false, false, "{}"},
    {"hot fp32 H33 K4", MOERT_F32, 33, 8, 4, 80, 0.15, 0.6, false, false, false, "{}"},
    {"no tokens on rank 0 bf16 K3", MOERT_BF16, 48, 16, 3, 50, 0.05, 0.0, false, true, false, "{}"},
    {"E32 K8 fp32 H128", MOERT_F32, 128, 32, 8, 200, 0.05, 0.0, false, false, false, "{}"},
};
#define CASES      ((int)(sizeof cases / sizeof cases[0]))

/* One (world, ranks_per_node) run: the cases with its option and its name, and their table rows. */
typedef struct node_run {
    gpu_dispatch_case cases[CASES];
    char names[CASES][64];
    char options[48];
} node_run;

static node_run runs[MAX_RUNS];
static gpu_dispatch_row table[MAX_RUNS * CASES];

static const gpu_dispatch_plugin hierarchical = {
    .name = DISPATCHER,
    .max_world = MAX_WORLD,
    .read_cpu_layout = gpu_dispatch_read_host_cpu_layout,
    .read_cuda_layout = gpu_dispatch_read_host_cuda_layout,
    .no_timeout_option = true,
    .count_step2_mallocs = true,
    .figures = {"dispatch.bytes_internode", "dispatch.bytes_intranode"},
    .figure_labels = {"inter", "intra"},
};

/* What each rank of a world gets: the run's cases and their first table row. */
typedef struct world_run {
    const node_run *run;
    gpu_dispatch_row *rows;
} world_run;

/* One rank of a world: every case in nodes of the run's size. */
static void rank_main(const gpu_test_rank_env *env, void *user)
{
    const world_run *w = user;
    for (int ci = 0; ci < CASES; ci++) gpu_dispatch_run_case(&hierarchical, env, &w->run->cases[ci], ci, &w->rows[ci]);
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
    int used = 0;
    for (int i = 0; i < 3; i++) {
        if (worlds[i] > gpus) continue;
        for (int R = 1; R <= worlds[i]; R++) {
            if (worlds[i] % R || used >= MAX_RUNS) continue;
            node_run *run = &runs[used];
            snprintf(run->options, sizeof run->options, "{\"ranks_per_node\": %d}", R);
            for (int ci = 0; ci < CASES; ci++) {
                run->cases[ci] = cases[ci];
                snprintf(run->names[ci], sizeof run->names[ci], "%s, %d per node", cases[ci].name, R);
                run->cases[ci].name = run->names[ci];
                run->cases[ci].options = run->options;
            }
            /* the CPU sums in double, CUDA in fp32; both round each node's partial to the row dtype */
            world_run w = {.run = run, .rows = &table[used * CASES]};
            gpu_dispatch_rows_init(w.rows, worlds[i], run->cases, CASES);
            used++;
            gpu_test_run_world(worlds[i], TIMEOUT_S, rank_main, &w);
        }
    }
    gpu_dispatch_print_rows(&hierarchical, table, used * CASES);
    moert_plugin_unload(&keep);
    return test_finish("gpu_hierarchical");
}

#endif
