#!/bin/sh
# GPU check of the fp8 plugin's CUDA path (run from the repository root on an sm_90 machine, < 3 minutes):
# builds build-fp8b-gpu if needed, then the cuBLASLt probe, test_gpu_fp8 and fp8_gemm_bench, each under a
# timeout, logs and JSON into ${OUT:-/tmp/fp8-gpu-check}. Exit status: the first failing program's.
set -u
OUT=${OUT:-/tmp/fp8-gpu-check}
B=${BUILD:-build-fp8b-gpu}
mkdir -p "$OUT"
[ -f "$B/build.ninja" ] || meson setup "$B" -Dcuda=enabled > "$OUT/setup.log" 2>&1
ninja -C "$B" -j16 tests/cublaslt_fp8_probe tests/test_gpu_fp8 bench/fp8_gemm_bench > "$OUT/build.log" 2>&1 \
    || { tail -30 "$OUT/build.log"; exit 1; }
nvidia-smi -L > "$OUT/device.txt" 2>&1
rc=0
timeout 40 stdbuf -oL "$B/tests/cublaslt_fp8_probe" > "$OUT/cublaslt_fp8_probe.log" 2>&1; r=$?
echo "cublaslt_fp8_probe rc=$r"; [ $rc -eq 0 ] && rc=$r
timeout 60 stdbuf -oL "$B/tests/test_gpu_fp8" > "$OUT/test_gpu_fp8.log" 2>&1; r=$?
echo "test_gpu_fp8 rc=$r"; [ $rc -eq 0 ] && rc=$r
MOERT_BENCH_MACHINE=nvidia-h100-x1 timeout 70 stdbuf -oL "$B/bench/fp8_gemm_bench" "$OUT/fp8_gemm_bench.json" \
    > "$OUT/fp8_gemm_bench.log" 2>&1; r=$?
echo "fp8_gemm_bench rc=$r"; [ $rc -eq 0 ] && rc=$r
grep -E "summary|accepted$|best A layout" "$OUT/cublaslt_fp8_probe.log" | head -20
grep -E "FAIL|failed" "$OUT/test_gpu_fp8.log" | head -20
tail -30 "$OUT/fp8_gemm_bench.log"
exit $rc
