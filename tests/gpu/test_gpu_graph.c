/* SPDX-License-Identifier: Apache-2.0 */
/* CUDA graphs ($.parallel.cuda_graph) on the visible GPUs (up to 4):
 * - the pool's reservation: blocks handed out or freed inside it stay out of the free lists until the release;
 * - the runtime with a capturable stack (router without a loss, dispatcher hybridep, precision bf16 with
 *   "gemm": "kernel"), 2 layers, fresh data every step: captured at step 2 and replayed after; every step's loss
 *   equals the eager run's ("off"); in normal and low-latency hybridep; and with 3 micro-batches per step (a
 *   step's first micro-batch and the later ones are two pairs of graphs; the micro-batch overlap off, as it runs
 *   without graphs);
 * - "on" with a dispatcher that syncs the host (alltoall) fails naming it; "auto" runs it eagerly and says why.
 * Exits 77 without a GPU (and in builds without CUDA). */
#include "test_util.h"

#ifndef MOERT_HAVE_CUDA

int main(void)
{
    printf("gpu_graph: built without CUDA, skipped\n");
    return TEST_SKIP;
}

#else

#include <math.h>
#include <string.h>

#include "cuda/device.h"
#include "cuda/pool.h"
#include "runtime.h"

/* ---- the pool's reservation ---- */

static void check_reservation(void)
{
    moert_cuda_pool *pool = NULL;
    moert_stream s = NULL, other = NULL;
    void *a = NULL, *x = NULL, *y = NULL, *z = NULL, *w = NULL;
    EXPECT_OK(moert_cuda_pool_create(0, &pool));
    EXPECT_OK(moert_cuda_stream_create(0, &s));
    EXPECT_OK(moert_cuda_stream_create(0, &other));
    if (!pool || !s || !other) goto exit;
    EXPECT_OK(moert_cuda_pool_alloc(pool, 1 << 20, s, &a));
    EXPECT_OK(moert_cuda_pool_free(pool, a, s));
    EXPECT_OK(moert_cuda_pool_reserve_begin(pool, s));
    EXPECT_EQ_INT(moert_cuda_pool_reserve_begin(pool, s), MOERT_ERR_INVALID_ARGUMENT); /* one at a time */
    EXPECT_OK(moert_cuda_pool_alloc(pool, 1 << 20, s, &x)); /* the cached block, now reserved */
    EXPECT(x == a);
    EXPECT_EQ_INT(moert_cuda_pool_reserved_bytes(pool), 1 << 20);
    EXPECT_OK(moert_cuda_pool_free(pool, x, s));
    EXPECT_OK(moert_cuda_pool_alloc(pool, 1 << 20, s, &y)); /* reused within the reservation */
    EXPECT(y == x);
    EXPECT_OK(moert_cuda_pool_free(pool, y, s));
    EXPECT_OK(moert_cuda_pool_alloc(pool, 1 << 20, other, &w)); /* another stream never gets a reserved block */
    EXPECT(w != x);
    EXPECT_OK(moert_cuda_pool_free(pool, w, other));
    moert_cuda_pool_reserve_end(pool);
    EXPECT_OK(moert_cuda_pool_alloc(pool, 1 << 20, s, &z)); /* after the end, the reserved block stays the graph's */
    EXPECT(z != x);                                         /* (z may be w, whose free has completed) */
    EXPECT_OK(moert_cuda_pool_free(pool, z, s));
    /* a later capture resumes the reservation: its freed blocks serve it again; another stream's may not */
    EXPECT_EQ_INT(moert_cuda_pool_reserve_resume(pool, other), MOERT_ERR_INVALID_ARGUMENT);
    EXPECT_OK(moert_cuda_pool_reserve_resume(pool, s));
    void *v = NULL;
    EXPECT_OK(moert_cuda_pool_alloc(pool, 1 << 20, s, &v));
    EXPECT(v == x);
    EXPECT_OK(moert_cuda_pool_free(pool, v, s));
    moert_cuda_pool_reserve_end(pool);
    EXPECT_OK(moert_cuda_pool_reserve_release(pool));
    EXPECT_EQ_INT(moert_cuda_pool_reserved_bytes(pool), 0);
    moert_cuda_pool_stats st;
    moert_cuda_pool_get_stats(pool, &st);
    EXPECT_EQ_INT(st.live_blocks, 0);
    EXPECT_EQ_INT(st.cached_blocks, z == w ? 2 : 3);   /* a (= x), w and z, all back */
    EXPECT_OK(moert_cuda_pool_reserve_begin(pool, s)); /* a new reservation may open after the release */
    EXPECT_OK(moert_cuda_pool_reserve_release(pool));
exit:
    if (s) moert_cuda_stream_synchronize(s);
    if (other) moert_cuda_stream_synchronize(other);
    moert_cuda_pool_destroy(pool);
    if (s) moert_cuda_stream_destroy(s);
    if (other) moert_cuda_stream_destroy(other);
}

/* ---- the runtime ---- */

/* the micro-batch overlap runs without graphs: off (as "auto" leaves it) */
static const char *graph_config =
    "{\"model\": {\"hidden\": 512, \"ffn_hidden\": 256, \"num_experts\": 16, \"topk\": 4, \"num_layers\": 2,"
    " \"dtype\": \"bf16\"}, \"parallel\": {\"ranks\": %d, \"device\": \"cuda\", \"cuda_graph\": \"%s\","
    " \"overlap_micro_batches\": \"off\"},"
    " \"train\": {\"tokens_per_rank\": %d, \"micro_batches\": %d, \"seed\": 11, \"lr\": 0.001},"
    " \"router\": {\"score_function\": \"sigmoid\", \"expert_bias\": true, \"bias_update_rate\": 0.01},"
    " \"dispatcher\": {\"plugin\": \"%s\"%s}, \"precision\": {\"plugin\": \"bf16\", \"gemm\": \"kernel\"}}";

#define GRAPH_STEPS 5

/* Losses of GRAPH_STEPS steps; false (and the error printed) when the run failed. */
static bool run_losses(int ranks, int tokens, int micro, const char *mode, const char *dispatcher,
                       const char *dispatcher_opts, double *losses, int64_t *captured_step, int64_t *replays,
                       moert_result *rc_out)
{
    char json[2048];
    snprintf(json, sizeof json, graph_config, ranks, mode, tokens, micro, dispatcher, dispatcher_opts);
    moert_config *cfg = NULL;
    moert_runtime *rt = NULL;
    bool ok = false;
    *rc_out = moert_config_load_string(json, "gpu-graph", &cfg);
    if (*rc_out != MOERT_OK) goto exit;
    *rc_out = moert_runtime_create(cfg, &rt);
    if (*rc_out != MOERT_OK) goto exit;
    for (int s = 1; s <= GRAPH_STEPS; s++) {
        moert_step_record rec;
        *rc_out = moert_runtime_step(rt, s, &rec);
        if (*rc_out != MOERT_OK) goto exit;
        losses[s - 1] = rec.loss;
    }
    *captured_step = rt->graph_captured_step;
    *replays = rt->graph_replays;
    char line[512];
    moert_runtime_graph_summary(rt, line, sizeof line);
    printf("  %s, %s%s, T %d x %d micro-batch(es), %d rank(s): cuda graph %s\n", mode, dispatcher, dispatcher_opts,
           tokens, micro, ranks, line);
    ok = true;
exit:
    moert_runtime_destroy(rt);
    moert_config_free(cfg);
    return ok;
}

/* With micro > 1 a step's first micro-batch (its WGRADs overwrite the gradients) and the later ones (they add) are
 * captured apart: the later ones' in step 1 (after its first micro-batch ran eagerly), the first's in step 2. */
static void check_runtime(int ranks, int tokens, int micro, const char *dispatcher_opts)
{
    double eager[GRAPH_STEPS], graph[GRAPH_STEPS];
    int64_t captured = -1, replays = -1;
    moert_result rc;
    if (!run_losses(ranks, tokens, micro, "off", "hybridep", dispatcher_opts, eager, &captured, &replays, &rc)) {
        fprintf(stderr, "eager run failed: %s\n", moert_error_message());
        test_failures++;
        return;
    }
    EXPECT_EQ_INT(captured, 0);
    if (!run_losses(ranks, tokens, micro, "on", "hybridep", dispatcher_opts, graph, &captured, &replays, &rc)) {
        fprintf(stderr, "graph run failed: %s\n", moert_error_message());
        test_failures++;
        return;
    }
    EXPECT_EQ_INT(captured, 2);
    EXPECT_EQ_INT(replays, GRAPH_STEPS * micro - 1 - (micro > 1 ? 2 : 1)); /* all but the eager pass and captures */
    int identical = 0;
    double worst = 0.0;
    for (int s = 0; s < GRAPH_STEPS; s++) {
        identical += memcmp(&eager[s], &graph[s], sizeof(double)) == 0;
        double d = fabs(graph[s] - eager[s]) / fmax(fabs(eager[s]), 1e-30);
        if (d > worst) worst = d;
    }
    printf("  losses %.6f -> %.6f: %d of %d steps bit-identical to eager, worst relative difference %.2e\n", eager[0],
           eager[GRAPH_STEPS - 1], identical, GRAPH_STEPS, worst);
    EXPECT(worst <= 1e-6);
    EXPECT(eager[GRAPH_STEPS - 1] < eager[0]); /* it trains: replays use the updated weights and the new batches */
}

static void check_refusals(int ranks)
{
    double losses[GRAPH_STEPS];
    int64_t captured = -1, replays = -1;
    moert_result rc;
    EXPECT(!run_losses(ranks, 256, 1, "on", "alltoall", "", losses, &captured, &replays, &rc));
    EXPECT_EQ_INT(rc, MOERT_ERR_CONFIG);
    EXPECT(strstr(moert_error_message(), "$.parallel.cuda_graph") &&
           strstr(moert_error_message(), "dispatcher \"alltoall\" is not graph-capturable"));
    printf("  refused: %s\n", moert_error_message());
    EXPECT(run_losses(ranks, 256, 1, "auto", "alltoall", "", losses, &captured, &replays, &rc));
    EXPECT_EQ_INT(captured, 0);
}

int main(void)
{
    int gpus = 0;
    if (moert_cuda_device_count(&gpus) != MOERT_OK || gpus < 1) {
        printf("gpu_graph: no GPU, skipped\n");
        return TEST_SKIP;
    }
    check_reservation();
    int ranks = gpus >= 4 ? 4 : gpus >= 2 ? 2 : 1;
    for (int r = 1; r <= ranks; r *= 2) {
        check_runtime(r, 512, 1, ", \"low_latency\": \"off\"");
        check_runtime(r, 64, 1, ", \"low_latency\": \"on\"");
        check_runtime(r, 256, 3, ", \"low_latency\": \"off\"");
    }
    check_refusals(ranks);
    return test_finish("gpu_graph");
}

#endif
