#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# GPU check of the bf16 plugin's device-count grouped GEMM kernel ("gemm": "kernel", and its wgmma engine that
# "gemm": "auto" runs every pass on), one command (run from the repository root on one sm_90 GPU):
#
#   plugins/precision_bf16/gpu_check.sh BUILD [OUT]    (BUILD made with -Dcuda=enabled, e.g. on a CPU machine; OUT
#                                                       defaults to $OUT or /tmp/bf16-kernel-gpu-check)
#
# It never builds; each step runs under its own timeout with line-buffered output:
#   test_gpu_device_gemm  (~10 s)  both engines against the CPU reference (every pass, ragged and empty experts),
#                                  cuBLASLt on a big case, a CUDA graph replay with new device counts, the plugin
#   gemm_bench deepseek   (~40 s)  deepseek-v3 EP4 fc1/fc2: kernel (wgmma), kernel_mma vs the cuBLASLt loop and a dense GEMM (TFLOP/s,
#                                  vs dense), fails if the kernel's output is off the loop's by more than 1e-2; WGRAD
#                                  into fp32 (kernel_f32w adding, kernel_f32w_ow overwriting, loop_s4_f32w) against
#                                  its floor (column "of floor")
#   gemm_bench qwen3-30b, mixtral (~30 s each)  the same on the qwen3-30b-a3b (32 experts of ~512 rows) and
#                                  mixtral-8x7b (2 experts of ~8192 rows) shapes
#   ab_wgrad_<preset>     (~60 s each)  `moert ab` of one layer at the preset's per-GPU EP4 shape on this GPU (E/4
#                                  experts): "wgrad_gemm": "cublaslt" (A) against the default (B: "wgrad_gemm": "kernel")
# Logs, the bench JSONs and a summary go into OUT. Exit status: the first failing step's (0: all passed).
set -u
B=${1:-${BUILD:-build}}
export MOERT_TEST_BUILD_ROOT=${MOERT_TEST_BUILD_ROOT:-$B} MOERT_TEST_SOURCE_ROOT=${MOERT_TEST_SOURCE_ROOT:-$PWD}
# the plugin the test opens, found without the rest of the build tree: it needs only BUILD/tests/test_gpu_device_gemm,
# BUILD/bench/gemm_bench and BUILD/plugins/precision_bf16/libmoert-precision-bf16.so
export MOERT_PLUGIN_PATH=${MOERT_PLUGIN_PATH:-$(realpath "$B")/plugins/precision_bf16}
OUT=${2:-${OUT:-/tmp/bf16-kernel-gpu-check}}
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
step test_gpu_device_gemm 100 "$B/tests/test_gpu_device_gemm"
step gemm_bench_deepseek 100 env MOERT_BENCH_MACHINE="$machine" MOERT_BENCH_GIT="$git_rev" MOERT_BENCH_ONLY=deepseek \
    MOERT_BENCH_REPEATS=10 "$B/bench/gemm_bench" "$OUT/gemm_bench_deepseek.json"
step gemm_bench_qwen3 60 env MOERT_BENCH_MACHINE="$machine" MOERT_BENCH_GIT="$git_rev" MOERT_BENCH_ONLY=qwen3-30b \
    MOERT_BENCH_REPEATS=10 "$B/bench/gemm_bench" "$OUT/gemm_bench_qwen3.json"
step gemm_bench_mixtral 90 env MOERT_BENCH_MACHINE="$machine" MOERT_BENCH_GIT="$git_rev" MOERT_BENCH_ONLY=mixtral \
    MOERT_BENCH_REPEATS=10 "$B/bench/gemm_bench" "$OUT/gemm_bench_mixtral.json"
# the layer: one preset at its per-GPU EP4 shape, wgrad on cuBLASLt (A) against the kernel (B)
for pe in deepseek-v3:64 qwen3-30b-a3b:32 mixtral-8x7b:2; do
    preset=${pe%%:*} experts=${pe##*:}
    step "ab_wgrad_$preset" 240 env -u MOERT_PLUGIN_PATH "$B/tools/moert" ab "configs/$preset.json" \
        "configs/$preset.json" --set 'parallel.device="cuda"' --set parallel.ranks=1 --set model.num_layers=1 \
        --set "model.num_experts=$experts" --set 'train.optimizer="sgd"' --warmup 3 --steps 12 \
        --set-a 'precision={"plugin":"bf16","wgrad_gemm":"cublaslt"}' --set-b 'precision={"plugin":"bf16","wgrad_gemm":"kernel"}' \
        --report "$OUT/ab_wgrad_$preset.json"
done
{
    echo "== test_gpu_device_gemm"
    grep -E "FAIL|failed|passed|skipped|error" "$OUT/test_gpu_device_gemm.log" | head -25
    tail -n 45 "$OUT/test_gpu_device_gemm.log" | grep -E "  (ok|FAIL)$" | head -45
    for b in deepseek qwen3 mixtral; do
        echo "== gemm_bench $b"
        grep -E "^device|^shape| (loop|loop_s4|graph_s4|kernel|kernel_f32w|kernel_f32w_ow|kernel_f32w_cl4|kernel_f32w_ow_cl4|loop_s4_f32w|copy|dense) |FAIL|WARNING" \
            "$OUT/gemm_bench_$b.log" | head -60
    done
    for p in deepseek-v3 qwen3-30b-a3b mixtral-8x7b; do
        echo "== ab_wgrad_$p"
        grep -E "^figure|^step|^fc|^backward|^outputs agree|^moert ab: " "$OUT/ab_wgrad_$p.log" | head -20
    done
} | tee -a "$OUT/summary.txt"
echo "total $(( $(date +%s) - start )) s; logs in $OUT"
exit $rc
