/* SPDX-License-Identifier: Apache-2.0 */
/* The "alltoall" dispatcher at world 1, 2 and 4 (ranks as threads): exact rows against a reference written
 * here, combine round trips, adjointness of the four calls, skewed routing, padding, bf16 bit-exact moves,
 * metrics, and the messages of bad calls. */
#include "dispatch_test_harness.h"

static const dispatch_test_plugin alltoall = {.name = "alltoall",
                                              .peer_buffers = false,
                                              .check_layout = dispatch_check_compact_layout,
                                              .fp8_round_trip = NULL,
                                              .error_capacity = 5,
                                              .combine_needs_dispatch = false,
                                              .check_after_prepare = NULL};

/* The cases in main() below. */
typedef dispatch_scenario scenario;

static void run_scenario(scenario sc) { dispatch_run_scenario(&alltoall, sc); }

/* ---- errors at world 1 (a failing rank in a larger world would leave its peers waiting) ---- */

static void test_errors(void)
{
    /* a bad option value */
    static const char *const bad_options[][2] = {{"{\"capacity_factor\": -1}", "capacity_factor"}};
    dispatch_check_errors(&alltoall, bad_options, sizeof bad_options / sizeof bad_options[0]);
}

int main(void)
{
    const int worlds[3] = {1, 2, 4};
    for (int w = 0; w < 3; w++) {
        int world = worlds[w];
        dispatch_run_common_scenarios(&alltoall, world);
        run_scenario((scenario){.name = "pad_to_capacity 1.5",
                                .world = world,
                                .dtype = MOERT_F64,
                                .probs_dtype = MOERT_F64,
                                .routing = ROUTE_CAPPED,
                                .same_T = true,
                                .T = 12,
                                .pad = true,
                                .capacity_factor = 1.5,
                                .options = "{\"pad_to_capacity\": true, \"capacity_factor\": 1.5}"});
        run_scenario((scenario){.name = "pad_to_capacity, bf16, cf 1.0",
                                .world = world,
                                .dtype = MOERT_BF16,
                                .probs_dtype = MOERT_F32,
                                .routing = ROUTE_CAPPED,
                                .same_T = true,
                                .T = 16,
                                .pad = true,
                                .capacity_factor = 1.0,
                                .options = "{\"pad_to_capacity\": true}"});
        /* every token to expert 7: 12*world rows against ceil(12*2/8) = 3 per source rank */
        char overflow[256];
        snprintf(overflow, sizeof overflow,
                 "prepare(): expert 7 (on rank %d) receives %d rows, more than its padded capacity %d = "
                 "ceil(T*K/E*capacity_factor) = 3 per source rank x world_size %d",
                 world - 1, 12 * world, 3 * world, world);
        run_scenario((scenario){.name = "pad_to_capacity overflow",
                                .world = world,
                                .dtype = MOERT_F64,
                                .probs_dtype = MOERT_F64,
                                .routing = ROUTE_HOT,
                                .same_T = true,
                                .T = 12,
                                .options = "{\"pad_to_capacity\": true}",
                                .prepare_error = overflow});
    }
    test_errors();
    return test_finish("test_dispatch_alltoall");
}
