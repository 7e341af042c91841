/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The "allgather" dispatcher at world 1, 2 and 4 (ranks as threads) against the "alltoall" dispatcher, whose own test
 * checks it against a reference written there: on the same routing and data, each rank runs both (each over its own
 * communicator) and compares layout, dispatch (rows and probs), combine, combine_backward and dispatch_backward.
 *
 * What must be bit for bit and why: dispatch and combine_backward move bytes, and d_topk_probs is one value per copy,
 * so all of those must be identical. y (combine) and d_x (dispatch_backward) are sums of a token's copies: the
 * alltoall dispatcher adds them in k order, the allgather dispatcher adds each rank's share first (a partial sum per
 * rank) and then the shares in rank order: a reduce-scatter. Both add in double and round once, so with fp32, bf16
 * or fp16 rows every sum here is exact in double and the results are identical bit for bit; with fp64 rows the two
 * orders may round differently in the last bits, and those are compared within 1e-14 relative.
 *
 * Also: the metrics, a second dispatch of a step (a recompute) giving the same bytes, a bad expert id on one rank
 * failing every rank's prepare(), and the bad calls at world 1 (the dispatcher harness's checks). The runs and the
 * comparison are tests/common/dispatch_cross_harness.c's.
 */
#include "dispatch_cross_harness.h"
#include "dispatch_test_harness.h"

/* The sums: exact in double for fp32, bf16 and fp16 rows; fp64 rows may round differently (see the top). */
static int64_t sums_differ(const cross_case *cs, const cross_input *in, const void *got, const void *want)
{
    return cross_values_differ(got, want, cs->dtype, in->T * cs->H, cs->dtype == MOERT_F64 ? 1e-14 : 0);
}

/* The largest T of the case, for the bytes_sent figure. */
static int64_t largest_T(const cross_run *run)
{
    int64_t m = 0;
    for (int r = 0; r < run->cs.world; r++) m = run->in[r].T > m ? run->in[r].T : m;
    return m;
}

/* The metrics: the rows received, and the bytes sent by each dispatch: this rank's block of the largest T tokens
 * (rows, K probs as double unless there are none, K routing indices) to each other rank. */
static void check_metrics(const cross_run *run, int r, const cross_output *ag, const cross_output *a2a)
{
    const cross_case *cs = &run->cs;
    const double row_bytes = (double)cs->H * (double)moert_dtype_size(cs->dtype);
    const double peers_tokens = (double)(cs->world - 1) * (double)largest_T(run);
    (void)r, (void)a2a;
    EXPECT_EQ_INT(ag->m.seen_recv, 1);
    EXPECT_EQ_INT(ag->m.recv_tokens, ag->num_recv);
    EXPECT_EQ_INT(ag->m.seen_bytes, 2);
    EXPECT_NEAR(ag->m.bytes_first, peers_tokens * (row_bytes + (double)cs->K * ((cs->no_probs ? 0 : 8) + 4)), 0, 0);
    EXPECT_NEAR(ag->m.bytes_sent, peers_tokens * (row_bytes + 4.0 * (double)cs->K), 0, 0); /* no probs */
}

static const cross_plugin allgather_cross = {
    .name = "allgather", .second_dispatch = true, .sums_differ = sums_differ, .check_rank = check_metrics};

static void run_case(cross_case cs)
{
    if (!cs.seed) cs.seed = 4321 + (uint64_t)cs.world;
    bool ok = cross_run_case(&allgather_cross, cs);
    fprintf(stderr, "%-44s world %d: %s\n", cs.name, cs.world, ok ? "ok" : "FAILED");
}

/* ---- bad calls at world 1: the dispatcher harness's checks ---- */

static const dispatch_test_plugin allgather = {.name = "allgather",
                                               .peer_buffers = false,
                                               .check_layout = dispatch_check_compact_layout,
                                               .fp8_round_trip = NULL,
                                               .error_capacity = 5,
                                               .combine_needs_dispatch = false,
                                               .check_after_prepare = NULL};

int main(void)
{
    const int worlds[3] = {1, 2, 4};
    for (int w = 0; w < 3; w++) {
        const int W = worlds[w];
        run_case((cross_case){
            .name = "random fp64", .world = W, .dtype = MOERT_F64, .probs_dtype = MOERT_F64, .drop = 0.15});
        run_case((cross_case){.name = "random fp32, fp32 probs",
                              .world = W,
                              .dtype = MOERT_F32,
                              .probs_dtype = MOERT_F32,
                              .drop = 0.15,
                              .K = 4,
                              .H = 9,
                              .seed = 77});
        run_case((cross_case){.name = "random bf16 (bit-exact)",
                              .world = W,
                              .dtype = MOERT_BF16,
                              .probs_dtype = MOERT_F32,
                              .drop = 0.1,
                              .H = 8,
                              .E = 16,
                              .K = 3});
        run_case((cross_case){.name = "random fp16",
                              .world = W,
                              .dtype = MOERT_F16,
                              .probs_dtype = MOERT_F64,
                              .drop = 0.1,
                              .same_T = true});
        run_case((cross_case){.name = "hot expert, fp32",
                              .world = W,
                              .dtype = MOERT_F32,
                              .probs_dtype = MOERT_F64,
                              .hot = true,
                              .T = 20});
        run_case((cross_case){.name = "most copies dropped, fp32",
                              .world = W,
                              .dtype = MOERT_F32,
                              .probs_dtype = MOERT_F32,
                              .drop = 0.8});
        run_case((cross_case){.name = "no probs, bf16",
                              .world = W,
                              .dtype = MOERT_BF16,
                              .probs_dtype = MOERT_F32,
                              .drop = 0.1,
                              .no_probs = true});
        run_case((cross_case){.name = "K=1, E=4, fp32",
                              .world = W,
                              .dtype = MOERT_F32,
                              .probs_dtype = MOERT_F32,
                              .E = 4,
                              .K = 1,
                              .seed = 99});
        if (W == 1) continue;
        run_case((cross_case){.name = "rank 0 has no tokens, fp32",
                              .world = W,
                              .dtype = MOERT_F32,
                              .probs_dtype = MOERT_F32,
                              .drop = 0.1,
                              .empty_rank0 = true});
        run_case((cross_case){.name = "rank 0 receives nothing, fp64",
                              .world = W,
                              .dtype = MOERT_F64,
                              .probs_dtype = MOERT_F64,
                              .drop = 0.1,
                              .avoid_rank0 = true});
        run_case((cross_case){.name = "bad expert id on rank 1",
                              .world = W,
                              .dtype = MOERT_F64,
                              .probs_dtype = MOERT_F64,
                              .bad_index = true});
    }
    static const char *const no_bad_options[1][2] = {{"", ""}};
    dispatch_check_errors(&allgather, no_bad_options, 0);
    return test_finish("test_dispatch_allgather");
}
