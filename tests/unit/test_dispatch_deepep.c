/* SPDX-License-Identifier: Apache-2.0 */
/* The "deepep" dispatcher's CPU path at world 1, 2 and 4 (ranks as threads, rows written into each other's peer
 * buffers): exact rows against a reference written here (the "alltoall" dispatcher's order), combine round trips,
 * adjointness of the four calls, skewed routing (one hot expert, a rank receiving nothing, tokens with every copy
 * dropped), FP8 dispatch against a quantize-dequantize written here, a buffer grown in prepare(), a stalled peer
 * named in the error, and the messages of bad calls and options. */
#include "dispatch_test_harness.h"
#include "fp8_convert.h"

/* ---- FP8: what a row must look like after the trip, computed here ---- */

/* A bf16 row after E4M3 quantization with one fp32 scale per 128 values (448 / the block's largest magnitude) and
 * dequantization: bf16(e4m3(v * scale) * (1 / scale)). */
static void fp8_round_trip(const uint16_t *src, int64_t H, uint16_t *out)
{
    for (int64_t b = 0; b < H; b += 128) {
        float amax = 0.0f;
        for (int64_t i = 0; i < 128; i++) amax = fmaxf(amax, fabsf(moert_bf16_to_float(src[b + i])));
        const float scale = (amax > 0.0f && isfinite(amax)) ? 448.0f / amax : 1.0f;
        const float inv = 1.0f / scale;
        for (int64_t i = 0; i < 128; i++) {
            uint8_t q = fp8_from_float(moert_bf16_to_float(src[b + i]) * scale, FP8_E4M3);
            out[b + i] = moert_bf16_from_float(fp8_to_float(q, FP8_E4M3) * inv);
        }
    }
}

static const dispatch_test_plugin deepep = {.name = "deepep",
                                            .peer_buffers = true,
                                            .check_layout = dispatch_check_compact_layout,
                                            .fp8_round_trip = fp8_round_trip,
                                            .error_capacity = 5,
                                            .combine_needs_dispatch = true,
                                            .check_after_prepare = NULL};

/* The cases in main() below. */
typedef dispatch_scenario scenario;

static void run_scenario(scenario sc) { dispatch_run_scenario(&deepep, sc); }

/* ---- errors at world 1 (a failing rank in a larger world would leave its peers waiting) ---- */

static void test_errors(void)
{
    /* bad option values */
    static const char *const bad_options[][2] = {{"{\"num_sms\": -1}", "num_sms"},
                                                 {"{\"num_sms\": 133}", "num_sms"},
                                                 {"{\"bench_nvlink_only\": 2}", "bench_nvlink_only"},
                                                 {"{\"peer_wait_stats\": \"yes\"}", "peer_wait_stats"},
                                                 {"{\"timeout_ms\": 0}", "timeout_ms"},
                                                 {"{\"dispatch_dtype\": \"fp9\"}", "dispatch_dtype"},
                                                 {"{\"dispatch_dtype\": \"fp8\"}", "needs hidden divisible by 128"}};
    dispatch_check_errors(&deepep, bad_options, sizeof bad_options / sizeof bad_options[0]);
}

int main(void)
{
    const int worlds[3] = {1, 2, 4};
    for (int w = 0; w < 3; w++) {
        int world = worlds[w];
        dispatch_run_common_scenarios(&deepep, world);
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
        run_scenario((scenario){.name = "fp8 dispatch, bf16, H=256",
                                .world = world,
                                .dtype = MOERT_BF16,
                                .probs_dtype = MOERT_F32,
                                .routing = ROUTE_RANDOM,
                                .H = 256,
                                .K = 3,
                                .fp8 = true,
                                .options = "{\"dispatch_dtype\": \"fp8\"}"});
        run_scenario((scenario){.name = "buffer grown in prepare()",
                                .world = world,
                                .dtype = MOERT_F32,
                                .probs_dtype = MOERT_F32,
                                .routing = ROUTE_RANDOM,
                                .T = 20,
                                .small_buffer = true});
        if (world > 1) {
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
    return test_finish("test_dispatch_deepep");
}
