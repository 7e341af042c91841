#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Every GPU check of moert, in one go, on a GPU machine: the GPU tests (each against the CPU reference),
# then the whole layer on the GPUs against the CPU run, and 1, 2 and 4 GPUs against each other.
# Prints a table last; logs and reports go to OUT_DIR.
#   usage: tests/gpu/run.sh [BUILD_DIR] [OUT_DIR]      (a build made on a CPU machine works: -Dcuda=enabled)
set -u
BUILD=$(realpath "${1:-build}")
OUT=${2:-${OUT:-/tmp/moert-gpu}}
mkdir -p "$OUT"
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0
export MOERT_TEST_BUILD_ROOT="$BUILD" MOERT_TEST_SOURCE_ROOT="$PWD"
MOERT="$BUILD/tools/moert"
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
echo "moert GPU checks: $gpus GPU(s), build $BUILD"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1

rows=()
record() { rows+=("$(printf '%-34s %-6s %s' "$1" "$2" "$3")"); }

# 1. the GPU test binaries (exit 77: skipped)
run_test() {
  local name=$1; shift
  local start=$SECONDS
  timeout "${MOERT_GPU_TEST_TIMEOUT:-240}" stdbuf -oL -eL "$@" >"$OUT/$name.log" 2>&1
  local rc=$? status=FAIL
  [ $rc -eq 0 ] && status=PASS
  [ $rc -eq 77 ] && status=SKIP
  record "$name" "$status" "rc $rc, $((SECONDS - start)) s, log $name.log"
  [ $status = FAIL ] && tail -25 "$OUT/$name.log"
}
for t in test_gpu_layers_api test_kernels test_gpu_smoke test_gpu_router test_gpu_plugins test_gpu_memory test_fp8_convert test_gpu_deepep test_gpu_fp8 test_gpu_graph test_gpu_allgather test_gpu_hierarchical; do
  [ -x "$BUILD/tests/$t" ] && run_test "$t" "$BUILD/tests/$t"
done
# micro-batch overlap on vs off, deepep and hybridep included on 2 and 4 GPUs (about 50 runs of the trainer: a longer
# limit; a stalled run ends the test itself after MOERT_GPU_OVERLAP_RUN_TIMEOUT s, 120 by default, naming it)
[ -x "$BUILD/tests/test_gpu_overlap" ] &&
  MOERT_GPU_TEST_TIMEOUT=${MOERT_GPU_TEST_TIMEOUT:-480} run_test test_gpu_overlap "$BUILD/tests/test_gpu_overlap"
# the "hybridep" dispatcher's CUDA path against its CPU path
[ -x "$BUILD/tests/test_gpu_hybridep" ] && run_test test_gpu_hybridep "$BUILD/tests/test_gpu_hybridep"
[ -x "$BUILD/tests/test_gpu_device_gemm" ] && run_test test_gpu_device_gemm "$BUILD/tests/test_gpu_device_gemm"
[ -x "$BUILD/tests/test_gpu_fp8_block_gemm" ] && run_test test_gpu_fp8_block_gemm "$BUILD/tests/test_gpu_fp8_block_gemm"
# MoE Parallel Folding (ETP and EDP layouts on 2 or 4 GPUs; many NCCL communicators made and split: a longer limit)
[ -x "$BUILD/tests/test_gpu_folding" ] &&
  MOERT_GPU_TEST_TIMEOUT=${MOERT_GPU_TEST_TIMEOUT:-480} run_test test_gpu_folding "$BUILD/tests/test_gpu_folding"
# the kernel trace (CUPTI) of a short run on up to 2 GPUs
run_test trace_kernels tests/gpu/test_trace_kernels.sh "$BUILD" "$OUT"
if [ -x "$BUILD/tests/nccl_mp_driver" ]; then
  run_test nccl_multiprocess tests/gpu/test_nccl_multiprocess.sh "$BUILD/tests/nccl_mp_driver"
fi

# 2. the whole layer stack: the demo in fp32 for 5 steps, CPU reference vs GPUs (same global batch); and with 2
# micro-batches per step (gradient accumulation)
layer_run() { # name device ranks [options]
  local name=$1 device=$2 ranks=$3; shift 3
  local tokens=$((1024 / ranks))
  timeout "${MOERT_GPU_TEST_TIMEOUT:-240}" "$MOERT" run configs/demo-cpu.json --quiet --steps 5 \
    --set parallel.device="$device" --set parallel.ranks="$ranks" --set train.tokens_per_rank=$tokens "$@" \
    --report "$OUT/layer-$name.json" >"$OUT/layer-$name.log" 2>&1
}
layer_run cpu4 cpu 4
layer_run cpu4-m2 cpu 4 --set train.micro_batches=2
for r in 1 2 4; do
  [ "$r" -le "$gpus" ] || continue
  layer_run "cuda$r" cuda "$r"
  layer_run "cuda$r-m2" cuda "$r" --set train.micro_batches=2
done
# MoE Parallel Folding through `moert run`: half the ranks as expert data or expert tensor parallel replicas
for r in 2 4; do
  [ "$r" -le "$gpus" ] || continue
  layer_run "cuda$r-edp2" cuda "$r" --set parallel.expert_data_parallel=2
  layer_run "cuda$r-etp2" cuda "$r" --set parallel.expert_tensor_parallel=2
done
# a process per GPU, launched by torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); NCCL's id
# goes over MOERT_BOOTSTRAP_PORT because torchrun's own store holds MASTER_PORT
if command -v torchrun >/dev/null 2>&1 && [ "$gpus" -ge 4 ]; then
  MOERT_BOOTSTRAP_PORT=${MOERT_BOOTSTRAP_PORT:-29613} timeout "${MOERT_GPU_TEST_TIMEOUT:-240}" \
    torchrun --nproc-per-node 4 --no-python "$MOERT" run configs/demo-cpu.json --quiet --steps 5 \
    --set parallel.device=cuda --set parallel.ranks=4 --set train.tokens_per_rank=256 \
    --report "$OUT/layer-proc4.json" >"$OUT/layer-proc4.log" 2>&1
fi
compare=$(python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
def losses(name):
    p = os.path.join(out, "layer-%s.json" % name)
    return [s["loss"] for s in json.load(open(p))["steps"]] if os.path.exists(p) else None
for name in ("cuda1", "cuda2", "cuda4", "proc4", "cuda1-m2", "cuda2-m2", "cuda4-m2", "cuda2-edp2", "cuda2-etp2",
             "cuda4-edp2", "cuda4-etp2"):
    ref = losses("cpu4-m2" if name.endswith("-m2") else "cpu4")
    got = losses(name)
    if got is None:
        log = os.path.join(out, "layer-%s.log" % name)
        if os.path.exists(log):
            print("%s FAIL %s" % (name, open(log).read().strip().splitlines()[-1][:160]))
        continue
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref)) if ref else float("nan")
    ok = ref is not None and len(got) == len(ref) and worst <= 2e-3
    print("%s %s losses of 5 steps vs CPU reference: worst relative difference %.2e" % (name, "PASS" if ok else "FAIL", worst))
PY
)
while read -r name status rest; do
  [ -n "$name" ] && record "layer fp32 $name vs cpu" "$status" "$rest"
done <<<"$compare"

# 3. the backward's wgrad overlap (a second stream) against the wgrads in line: `moert ab` on the GPUs, bf16, each
# dispatcher; the losses must be the same bit for bit (only the order of independent work changes)
ab_ranks=$(( gpus >= 4 ? 4 : gpus ))
for disp in alltoall deepep hybridep; do
  [ "$gpus" -ge 1 ] || break
  name="overlap_wgrad $disp ${ab_ranks}gpu"
  timeout "${MOERT_GPU_TEST_TIMEOUT:-240}" "$MOERT" ab configs/demo-cpu.json configs/demo-cpu.json --quiet \
    --warmup 1 --steps 4 --set parallel.device=cuda --set parallel.ranks="$ab_ranks" --set 'model.dtype="bf16"' \
    --set "dispatcher.plugin=\"$disp\"" --set router.z_loss_coeff=0 --set-a parallel.overlap_wgrad=false \
    --report "$OUT/ab-overlap-$disp.json" >"$OUT/ab-overlap-$disp.log" 2>&1
  rc=$?
  if [ $rc -eq 0 ] && grep -q '^outputs agree: yes (max relative loss difference 0.0e+00 over 5 steps, identical' \
      "$OUT/ab-overlap-$disp.log"; then
    record "$name" PASS "losses identical over 5 steps; $(grep '^backward (ms)' "$OUT/ab-overlap-$disp.log" | tr -s ' ')"
  else
    record "$name" FAIL "rc $rc, log ab-overlap-$disp.log"
    tail -15 "$OUT/ab-overlap-$disp.log"
  fi
done
# the shared expert on its own stream gives the same losses as on the compute stream (a gated shared expert, bf16)
if [ "$gpus" -ge 1 ]; then
  ab_ranks=$([ "$gpus" -ge 2 ] && echo 2 || echo 1)
  timeout "${MOERT_GPU_TEST_TIMEOUT:-240}" "$MOERT" ab configs/demo-cpu.json configs/demo-cpu.json --quiet \
    --warmup 1 --steps 4 --set parallel.device=cuda --set parallel.ranks="$ab_ranks" --set 'model.dtype="bf16"' \
    --set model.shared_expert_ffn_hidden=96 --set model.shared_expert_gate=true --set router.z_loss_coeff=0 \
    --set-a parallel.shared_expert_overlap=false --report "$OUT/ab-shared-overlap.json" >"$OUT/ab-shared-overlap.log" 2>&1
  rc=$?
  if [ $rc -eq 0 ] && grep -q '^outputs agree: yes (max relative loss difference 0.0e+00 over 5 steps, identical' \
      "$OUT/ab-shared-overlap.log"; then
    record "shared_expert_overlap ${ab_ranks}gpu" PASS "losses identical over 5 steps"
  else
    record "shared_expert_overlap ${ab_ranks}gpu" FAIL "rc $rc, log ab-shared-overlap.log"
    tail -15 "$OUT/ab-shared-overlap.log"
  fi
fi

echo
echo "== moert GPU checks =="
printf '%s\n' "${rows[@]}"
! printf '%s\n' "${rows[@]}" | grep -q ' FAIL '
