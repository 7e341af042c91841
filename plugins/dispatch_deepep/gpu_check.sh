#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The "deepep" dispatcher's GPU checks and figures in one go, on a GPU machine (4 GPUs for all of it):
#   1. tests/test_gpu_deepep: the CUDA path against the CPU path on 1, 2, 4 GPUs, and a stalled peer
#   2. bench/dispatch_bench: deepep dispatch bf16 / fp8 and combine at 8, 12, 16, 24 and all SMs, each as the whole
#      call and as its NVLink phase alone ("nvlink"), against alltoall (JSON)
#   3. moert ab: the deepseek-v3 layer, forward+backward, alltoall (A) against deepep (B) in the same process
# usage: plugins/dispatch_deepep/gpu_check.sh BUILD_DIR OUT_DIR      (BUILD_DIR made with -Dcuda=enabled)
# It never builds. Each step has its own time limit (75 + 130 + 90 s, killed 3 s after), so the script ends within 5 minutes
# even if a step hangs; the test and the bench print progress line by line, so a killed step's log shows where it was.
# The steps it shares with plugins/dispatch_hybridep/gpu_check.sh are in plugins/lib/gpu_check_dispatch.sh.
set -u
. "$(dirname "$0")/../lib/gpu_check_dispatch.sh"
gpu_check_begin deepep /tmp/moert-deepep "$@"

gpu_check_test deepep 75

gpu_check_bench dispatch_bench 130
if grep -q '^dispatch_bench: EP' "$OUT/dispatch_bench.log"; then sed -n '/^dispatch_bench: EP/,$p' "$OUT/dispatch_bench.log"
else tail -15 "$OUT/dispatch_bench.log"; fi

if [ "$gpus" -ge 4 ]; then
  start=$SECONDS
  timeout -k 3 90 "$BUILD/tools/moert" ab configs/deepseek-v3.json configs/deepseek-v3.json --set-b dispatcher.plugin=deepep \
    --warmup 2 --steps 6 --quiet --report "$OUT/ab-deepseek-v3-alltoall-vs-deepep.json" >"$OUT/ab.log" 2>&1
  rc=$?
  echo "== moert ab deepseek-v3 alltoall (A) vs deepep (B): rc $rc, $((SECONDS - start)) s"
  tail -30 "$OUT/ab.log"
  [ $rc -ne 0 ] && status=1
fi
exit $status
