#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The "hybridep" dispatcher's GPU checks and figures in one go, on a GPU machine (4 GPUs for the acceptance figures):
#   1. tests/test_gpu_hybridep: the CUDA path against the CPU path on 1/2/4/8 GPUs, a stalled peer, bad ids, the
#      low-latency tuning options, and CUDA-graph capture + replays (low-latency and normal mode)
#   2. bench/hybridep_bench: with MOERT_BENCH_ONLY=ll (the default here) the low-latency lines only: the launch floor,
#      T 1..256 on every SM, the block-count sweep, and the tuning variants beside the default at T 1/32/128/256;
#      MOERT_BENCH_ONLY=all: also dispatch/combine at 8, 12, 16 SMs (T 4096) with deepep at 24 SMs
# usage: plugins/dispatch_hybridep/gpu_check.sh BUILD_DIR OUT_DIR      (BUILD_DIR made with -Dcuda=enabled; no rebuild)
# Each step has its own time limit (130 + 80 s, killed 3 s after), so the script ends within 3.6 minutes even if a
# step hangs; both print progress line by line, so a killed step's log shows where it was.
# The steps it shares with plugins/dispatch_deepep/gpu_check.sh are in plugins/lib/gpu_check_dispatch.sh.
set -u
. "$(dirname "$0")/../lib/gpu_check_dispatch.sh"
gpu_check_begin hybridep /tmp/moert-hybridep "$@"

gpu_check_test hybridep 130 stdbuf -oL -eL

bench_only=${MOERT_BENCH_ONLY:-ll}
[ "$bench_only" = all ] && bench_only=
MOERT_BENCH_ONLY=$bench_only gpu_check_bench hybridep_bench "$([ -n "$bench_only" ] && echo 80 || echo 150)" stdbuf -oL -eL
grep -v "^variant " "$OUT/hybridep_bench.log" | tail -75
exit $status
