#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The stall bound ($.parallel.timeout_s) holds for the whole process: a rank that stalls (the fixture-misbehave memory
# policy sleeping in a step, for 30 s or for ever) ends `moert run` within timeout_s and the grace, with a message
# naming the stalled rank and where its peers waited, and exit status 3. Each run is bounded by `timeout 60` so that
# a hang fails the test instead of hanging it.
# Usage: test_stall.sh PATH/TO/moert
set -u
moert="$(cd "$(dirname "$1")" && pwd)/$(basename "$1")" # absolute: some checks run from other folders
# the tests' fixture plugins: the build tree's moert does not search them by itself
export MOERT_PLUGIN_PATH="$(cd "$(dirname "$moert")/.." && pwd)/tests/fixtures"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
. "$(dirname "$0")/cli_lib.sh"

cat >"$tmp/c.json" <<JSON
{"model": {"hidden": 16, "ffn_hidden": 32, "num_experts": 4, "topk": 2, "num_layers": 1},
 "parallel": {"ranks": 4, "device": "cpu", "timeout_s": 2}, "train": {"steps": 3, "tokens_per_rank": 32},
 "memory_policy": {"plugin": "fixture-misbehave", "stall_rank": 2, "stall_after": 3}}
JSON

# stall NAME STALL_S: runs 3 steps with rank 2 stalling in step 2; checks time, status and message
stall() {
    local name="$1" seconds="$2"
    local t0 t1
    t0=$(date +%s%N)
    timeout 60 "$moert" run "$tmp/c.json" --quiet --set memory_policy.stall_s="$seconds" >"$tmp/$name.out" 2>"$tmp/$name.err"
    local got=$?
    t1=$(date +%s%N)
    local ms=$(((t1 - t0) / 1000000))
    [ "$got" = 3 ] || fail "$name: exit status $got, expected 3 (a stalled rank)"
    # timeout_s 2 + grace 2 s, and room for a slow machine: well below the stall
    [ "$ms" -lt 12000 ] || fail "$name: the run took $ms ms, expected about 4000 (timeout 2 s + grace 2 s)"
    grep -qE "^moert run: rank [013]: .* failed \(layer 0, rank [013]\): timeout: [a-z_]+: rank 2 did not arrive within 2\.0 s; rank 2 still running 2\.0 s later and abandoned \(stalled\)$" "$tmp/$name.err" ||
        { fail "$name: unexpected message"; sed 's/^/  | /' "$tmp/$name.err" >&2; }
}
stall stall_30s 30
stall stall_forever -1

# a rank that fails (rank 0) while another stalls (rank 2): the failure is the cause and gives the status (1, not
# the stall's 3), and the message names both
timeout 60 "$moert" run "$tmp/c.json" --quiet --set memory_policy.stall_s=30 --set memory_policy.fail_rank=0 \
    --set memory_policy.fail_after=3 >"$tmp/fail_and_stall.out" 2>"$tmp/fail_and_stall.err"
got=$?
[ "$got" = 1 ] || fail "fail_and_stall: exit status $got, expected 1 (rank 0's failure)"
grep -qE "^moert run: rank 0: .*fixture-misbehave: failing as asked after 3 calls.*; rank 2 still running [0-9.]+ s later and abandoned \(stalled\)$" "$tmp/fail_and_stall.err" ||
    { fail "fail_and_stall: unexpected message"; sed 's/^/  | /' "$tmp/fail_and_stall.err" >&2; }

if [ "$failures" -ne 0 ]; then
    echo "test_stall: $failures check(s) failed" >&2
    exit 1
fi
echo "test_stall: all checks passed"
