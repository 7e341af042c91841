#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# GPU check of the fp8 plugin's CUDA path, one command (run from the repository root on one sm_90 GPU):
#
#   plugins/precision_fp8/gpu_check.sh BUILD [OUT]     (BUILD made with -Dcuda=enabled, e.g. on a CPU machine; OUT
#                                                       defaults to $OUT or /tmp/fp8-gpu-check)
#
# It never builds (GPU machines may lack the build's dependencies); it runs each step under its own timeout with
# line-buffered output:
#   cublaslt_fp8_probe short   (~5 s)  which blockwise matmuls cuBLASLt accepts at the padded row counts
#   test_gpu_fp8               (~20 s) CUDA vs CPU reference, every recipe and pass, odd per-expert counts, WGRAD
#                                      overwriting grad_weight (empty experts zeroed)
#   test_gpu_fp8_block_gemm    (~110 s) the blockwise wgmma kernel against a double-precision sum of its FP8 operands
#   fp8_gemm_bench             (~50 s) deepseek-v3 EP4 shapes; blockwise fwd+dgrad+wgrad vs bf16 (target 1.4x); fails
#                                      when an FP8 variant's error against bf16 is above 0.2
# Logs, the bench's JSON and a summary go into OUT. Exit status: the first failing step's (0: all passed).
set -u
B=${1:-${BUILD:-build}}
export MOERT_TEST_BUILD_ROOT=${MOERT_TEST_BUILD_ROOT:-$B} MOERT_TEST_SOURCE_ROOT=${MOERT_TEST_SOURCE_ROOT:-$PWD}
OUT=${2:-${OUT:-/tmp/fp8-gpu-check}}
mkdir -p "$OUT"
start=$(date +%s)
nvidia-smi -L > "$OUT/device.txt" 2>&1
machine=${MOERT_BENCH_MACHINE:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr ' ' '-')}
git_rev=${MOERT_BENCH_GIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
rc=0
# step NAME SECONDS COMMAND...: runs it under a timeout, log into OUT/NAME.log, notes the first failure
step() {
    name=$1 limit=$2
    shift 2
    t0=$(date +%s)
    timeout "$limit" stdbuf -oL -eL "$@" > "$OUT/$name.log" 2>&1
    r=$?
    echo "$name rc=$r ($(( $(date +%s) - t0 )) s, limit $limit s)" | tee -a "$OUT/summary.txt"
    [ $rc -eq 0 ] && rc=$r
}
: > "$OUT/summary.txt"
step cublaslt_fp8_probe 30 "$B/tests/cublaslt_fp8_probe" short
step test_gpu_fp8 60 "$B/tests/test_gpu_fp8"
step test_gpu_fp8_block_gemm 240 "$B/tests/test_gpu_fp8_block_gemm"
step fp8_gemm_bench 150 env MOERT_BENCH_MACHINE="$machine" MOERT_BENCH_GIT="$git_rev" \
    "$B/bench/fp8_gemm_bench" "$OUT/fp8_gemm_bench.json"
{
    echo "== probe"
    grep -E "summary|variants accepted|best A layout" "$OUT/cublaslt_fp8_probe.log" | head -12
    echo "== test_gpu_fp8"
    grep -E "FAIL|failed|passed|skipped" "$OUT/test_gpu_fp8.log" | head -25
    echo "== fp8_gemm_bench"
    grep -E "^shape|^deepseek|^fp8 blockwise|skipped:|FAIL|within" "$OUT/fp8_gemm_bench.log" | head -60
} | tee -a "$OUT/summary.txt"
echo "total $(( $(date +%s) - start )) s; logs in $OUT"
exit $rc
