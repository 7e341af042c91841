#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The layer info's flags reach every plugin instance: with $.parallel.overlap_micro_batches "on" both slots' instances
# see MOERT_LAYER_OVERLAPPED, with "off" (and "auto" on the CPU) none does. The fixture-misbehave memory policy fails
# its init, naming the layer, when the flag is not as its option "expect_overlapped" says. The layer info's sm_yield
# (the SM-yield word of $.parallel.overlap_comm_sms) is CUDA's alone: NULL on the CPU, the overlap on or off
# (option "expect_sm_yield").
# Usage: test_layer_flags.sh PATH/TO/moert
set -u
moert="$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"
# the tests' fixture plugins: the build tree's moert does not search them by itself
export MOERT_PLUGIN_PATH="$(cd "$(dirname "$moert")/.." && pwd)/tests/fixtures"
. "$(dirname "$0")/cli_lib.sh"
cli_scratch

# two layers, two ranks, two micro-batches a step: the overlap has both slots to make
cat >"$tmp/c.json" <<JSON
{"memory_policy": {"plugin": "fixture-misbehave"}, "parallel": {"ranks": 2, "device": "cpu"},
 "model": {"hidden": 16, "ffn_hidden": 32, "num_experts": 4, "topk": 2, "num_layers": 2},
 "train": {"steps": 2, "tokens_per_rank": 32, "micro_batches": 2}}
JSON

# flags NAME MODE EXPECT STATUS: a run with overlap_micro_batches MODE and the fixture expecting EXPECT
flags() {
    run "$1" "$4" run c.json --quiet --set "parallel.overlap_micro_batches=\"$2\"" \
        --set "memory_policy.expect_overlapped=\"$3\""
}
flags on_yes on yes 0
flags off_no off no 0
flags auto_cpu_no auto no 0
# the check can fail: a mismatch ends the run at the fixture's init, naming it and the layer
flags on_no on no 1
expect_match on_no err 'fixture-misbehave: layer 0 is overlapped \(layer info flags 0x1\), expected no'
flags off_yes off yes 1
expect_match off_yes err 'fixture-misbehave: layer 0 is not overlapped \(layer info flags 0x0\), expected yes'

# yield_word NAME MODE EXPECT STATUS: the same for the layer info's sm_yield
yield_word() {
    run "$1" "$4" run c.json --quiet --set "parallel.overlap_micro_batches=\"$2\"" \
        --set "memory_policy.expect_sm_yield=\"$3\"" --set parallel.overlap_comm_sms=24
}
yield_word yield_on_no on no 0
yield_word yield_off_no off no 0
yield_word yield_on_yes on yes 1
expect_match yield_on_yes err 'fixture-misbehave: layer 0 has no sm_yield in its layer info, expected yes'

if [ "$failures" -ne 0 ]; then
    echo "test_layer_flags: $failures check(s) failed" >&2
    exit 1
fi
echo "test_layer_flags: all checks passed"
