# SPDX-License-Identifier: Apache-2.0
# The steps the NVLink dispatchers' GPU check scripts share (plugins/dispatch_deepep/gpu_check.sh,
# plugins/dispatch_hybridep/gpu_check.sh): sourced by them, not run. Each step runs under its own time limit (killed 3 s
# after) with its log in OUT, prints a "== NAME: rc RC, S s" line and what its log says, and sets status=1 when it
# failed.

# gpu_check_begin NAME DEFAULT_OUT [BUILD_DIR [OUT_DIR]]: BUILD and OUT (made), the repository root as the working
# directory, the test environment, gpus (how many nvidia-smi lists) and status=0; prints the first line.
gpu_check_begin() {
  BUILD=$(realpath "${3:-build}")
  OUT=${4:-${OUT:-$2}}
  mkdir -p "$OUT"
  cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
  export NCCL_NVLS_ENABLE=0 MOERT_TEST_BUILD_ROOT="$BUILD" MOERT_TEST_SOURCE_ROOT="$PWD"
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  echo "$1 GPU checks: $gpus GPU(s), build $BUILD"
  status=0
}

# gpu_check_test NAME LIMIT [WRAPPER...]: tests/test_gpu_NAME (its CUDA path against its CPU path) within LIMIT
# seconds, run through WRAPPER (e.g. stdbuf -oL -eL) when given; prints the log from the test's summary line on, and
# on a failure the log's lines that are not per-world progress and its last three.
gpu_check_test() {
  local name=$1 limit=$2
  shift 2
  local log="$OUT/test_gpu_$name.log" start=$SECONDS
  timeout -k 3 "$limit" "$@" "$BUILD/tests/test_gpu_$name" >"$log" 2>&1
  local rc=$?
  echo "== test_gpu_$name: rc $rc, $((SECONDS - start)) s"
  sed -n "/^$name dispatcher, CUDA vs CPU/,\$p" "$log"
  if [ $rc -ne 0 ]; then
    status=1
    grep -v '^ *$' "$log" | grep -v '^world .*: \(open\|CPU reference\|CUDA step\|compare\|done\)' | head -30
    tail -3 "$log"
  fi
}

# gpu_check_bench NAME LIMIT [WRAPPER...]: bench/NAME OUT/NAME.json within LIMIT seconds (log OUT/NAME.log), the JSON
# naming the machine (MOERT_BENCH_MACHINE, default nvidia-h200-xGPUS) and the commit (MOERT_BENCH_GIT, default git's
# HEAD); sets bench_rc and prints the rc line (the caller prints what it wants of the log).
gpu_check_bench() {
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  MOERT_BENCH_MACHINE=${MOERT_BENCH_MACHINE:-nvidia-h200-x$gpus} \
    MOERT_BENCH_GIT=${MOERT_BENCH_GIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)} \
    timeout -k 3 "$limit" "$@" "$BUILD/bench/$name" "$OUT/$name.json" >"$OUT/$name.log" 2>&1
  bench_rc=$?
  echo "== $name: rc $bench_rc, $((SECONDS - start)) s"
  [ $bench_rc -ne 0 ] && status=1
  return 0
}
