/* SPDX-License-Identifier: Apache-2.0 */
/* The "hybridep" dispatcher's CPU path at world 1, 2 and 4 (ranks as threads, counts and rows written into each
 * other's peer buffers, no collective in a step): exact rows against a reference written here (the "alltoall"
 * dispatcher's order), the worst-case capacity with rows past the received ones left untouched (and never read by
 * combine), combine round trips, adjointness of the four calls, skewed routing (one hot expert, a rank receiving
 * nothing, tokens with every copy dropped), low-latency mode, a stalled peer named in the error (in dispatch and in
 * prepare's notify), and the messages of bad calls and options. */
#include "dispatch_test_harness.h"

/* The worst case: the largest T of the group from every rank, each token on min(K, El) local experts; the counts
 * stay on the CPU where the layout pass left them, with no host copy. Receive buffers take the whole capacity. */
static int64_t check_worst_case_layout(const dispatch_scenario *sc, int r, const moert_dispatch_layout *layout,
                                       const dispatch_reference *ref)
{
    (void)r;
    const int64_t K = sc->K, El = sc->E / sc->world;
    int64_t max_T = 0;
    for (int s = 0; s < sc->world; s++) max_T = sc->rank[s].T > max_T ? sc->rank[s].T : max_T;
    EXPECT_EQ_INT(layout->capacity, (max_T > 0 ? max_T : 1) * sc->world * (K < El ? K : El));
    EXPECT(layout->capacity >= ref->num_recv);
    EXPECT(layout->tokens_per_expert.dtype == MOERT_I64 && layout->tokens_per_expert.ndim == 1 &&
           layout->tokens_per_expert.shape[0] == El && layout->tokens_per_expert.device.type == MOERT_DEVICE_CPU);
    EXPECT(layout->tokens_per_expert_host == NULL); /* no host copy: the counts stay where the layout pass left them */
    for (int64_t l = 0; l < El; l++)
        EXPECT_EQ_INT(((const int64_t *)layout->tokens_per_expert.data)[l], ref->group_rows[l]);
    return layout->capacity;
}

/* The worst-case capacity 3*1*2 = 6 at world 1, and more tokens than the buffers were sized for refused. */
static void check_after_prepare(dispatch_error_fixture *f)
{
    EXPECT_EQ_INT(f->layout.capacity, 6);
    int32_t many[8] = {0, 1, 0, 1, 0, 1, 0, 1};
    moert_tensor it_many = moert_tensor_2d(many, moert_cpu(), MOERT_I32, 4, 2);
    moert_dispatch_layout layout2 = {.struct_size = sizeof layout2};
    EXPECT_CALL_FAILS(&f->ti, f->vt->prepare(f->ti.ctx, NULL, &it_many, &layout2), MOERT_ERR_INVALID_ARGUMENT,
                      "prepare(): topk_idx has 4 tokens, more than the 3 rows the buffers were sized for at init");
    EXPECT_CALL_OK(&f->ti, f->vt->prepare(f->ti.ctx, NULL, &f->it, &f->layout));
}

static const dispatch_test_plugin hybridep = {.name = "hybridep",
                                              .peer_buffers = true,
                                              .check_layout = check_worst_case_layout,
                                              .fp8_round_trip = NULL,
                                              .error_capacity = 6, /* 3*1*2 */
                                              .combine_needs_dispatch = true,
                                              .check_after_prepare = check_after_prepare};

/* The cases in main() below. */
typedef dispatch_scenario scenario;

static void run_scenario(scenario sc) { dispatch_run_scenario(&hybridep, sc); }

/* ---- errors at world 1 (a failing rank in a larger world would leave its peers waiting) ---- */

static void test_errors(void)
{
    /* bad option values */
    static const char *const bad_options[][2] = {{"{\"num_sms\": -1}", "num_sms"},
                                                 {"{\"num_sms\": 133}", "num_sms"},
                                                 {"{\"bench_nvlink_only\": 2}", "bench_nvlink_only"},
                                                 {"{\"timeout_ms\": 0}", "timeout_ms"},
                                                 {"{\"low_latency\": \"maybe\"}", "low_latency"},
                                                 {"{\"copy\": \"dma\"}", "copy"},
                                                 {"{\"low_latency_tokens\": 0}", "low_latency_tokens"}};
    dispatch_check_errors(&hybridep, bad_options, sizeof bad_options / sizeof bad_options[0]);
}

int main(void)
{
    const int worlds[3] = {1, 2, 4};
    for (int w = 0; w < 3; w++) {
        int world = worlds[w];
        dispatch_run_common_scenarios(&hybridep, world);
        run_scenario((scenario){.name = "capped routing, K=4, E=16",
                                .world = world,
                                .dtype = MOERT_F64,
                                .probs_dtype = MOERT_F64,
                                .routing = ROUTE_CAPPED,
                                .same_T = true,
                                .T = 24,
                                .K = 4,
                                .E = 16,
                                .capacity_factor = 1.5});
        run_scenario((scenario){.name = "low-latency mode on, bf16 H=64",
                                .world = world,
                                .dtype = MOERT_BF16,
                                .probs_dtype = MOERT_F32,
                                .routing = ROUTE_RANDOM,
                                .H = 64,
                                .K = 3,
                                .options = "{\"low_latency\": \"on\", \"num_sms\": 4}"});
        run_scenario((scenario){.name = "T above max_tokens refused",
                                .world = world,
                                .dtype = MOERT_F32,
                                .probs_dtype = MOERT_F32,
                                .routing = ROUTE_RANDOM,
                                .T = 20,
                                .small_buffer = true,
                                .prepare_error = "rows the buffers were sized for at init"});
        if (world > 1) {
            run_scenario((scenario){.name = "rank 1 skips prepare: notify names it",
                                    .world = world,
                                    .dtype = MOERT_F64,
                                    .probs_dtype = MOERT_F64,
                                    .routing = ROUTE_RANDOM,
                                    .stall_prepare = true,
                                    .options = "{\"timeout_ms\": 200}"});
            run_scenario((scenario){.name = "rank 1 stalls: timeout names it",
                                    .world = world,
                                    .dtype = MOERT_F64,
                                    .probs_dtype = MOERT_F64,
                                    .routing = ROUTE_RANDOM,
                                    .stall = true,
                                    .options = "{\"timeout_ms\": 200}"});
        }
    }
    test_errors();
    return test_finish("test_dispatch_hybridep");
}
