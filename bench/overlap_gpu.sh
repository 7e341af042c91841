#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Micro-batch overlap on GPUs (docs/executor.md, "Micro-batch overlap"): `moert ab` of $.parallel.overlap_micro_batches
# "off" (A) against "on" (B), 4 micro-batches per step, 2 layers, EP = the GPUs used (all of them, at most 8), for
# deepseek-v3 (32 experts per GPU: A and B live at once), qwen3-30b-a3b and mixtral-8x7b (or the MODELs named), with
# the configs' own dispatcher (alltoall) or DISPATCHER, and train.optimizer "sgd"; where A and B do not fit together it
# runs again with --sequential. Then one `moert run --trace` of the "on" side of each model (4 steps), for Perfetto or
# tools/trace_plot.py.
#   usage: bench/overlap_gpu.sh BUILD_DIR OUT_DIR [DISPATCHER [MODEL...]]     (DISPATCHER "-": the configs' own)
#   environment: OVERLAP_STEPS (20 measured steps per side), OVERLAP_TIMEOUT (600 s per run), OVERLAP_PRECISION (a
#   precision section for both sides, e.g. '{"plugin":"fp8","recipe":"blockwise"}'; default: the configs'),
#   OVERLAP_B_PRECISION (a precision section for B alone, e.g. '{"plugin":"bf16","gemm_sms":108}': the overlap with
#   SMs left to the dispatcher against no overlap with all of them), OVERLAP_B_DISPATCHER (a dispatcher section for B
#   alone, e.g. '{"plugin":"deepep","num_sms":24}': the dispatcher on few SMs beside the other half's GEMMs),
#   OVERLAP_TRACE (0: no trace runs; "kernels": each trace with every CUDA kernel, `--trace-kernels`, and a trace of
#   the "off" side as well, trace-overlap-off-MODEL.json, whose kernels' mean calls the summary sets beside the on
#   side's: how much the halves slow each kernel), OVERLAP_TORCH (1: after each model's A/B the PyTorch layer of its shape,
#   bench/torch_baseline.py through torchrun, the peer in the same call; OVERLAP_MACHINE names the machine in its JSON),
#   OVERLAP_INPUT_SHIFT (train.input_shift, default 0: routing balanced from the first step, as the PyTorch peer's
#   random inputs are; the configs' 0.5 routes unevenly: rank 0 of deepseek-v3 got 1.12x the mean rows at EP4)
# Writes OUT_DIR/overlap-MODEL.{json,md,log} (moert ab's report, table and log), OUT_DIR/trace-overlap-MODEL.json and
# with OVERLAP_TORCH OUT_DIR/torch-MODEL.{json,log};
# prints the verdict lines and each trace's steady state (tools/trace_summary.py's last line). Exit status: 0 when
# every A/B ran and its outputs agree, 1 otherwise, 77 without a GPU.
set -u
if [ $# -lt 2 ]; then
    echo "usage: $0 BUILD_DIR OUT_DIR [DISPATCHER [MODEL...]]" >&2
    exit 2
fi
BUILD=$(realpath "$1")
OUT=$2
DISPATCHER=${3:--}
shift $(($# < 3 ? $# : 3))
MODELS=("$@")
[ ${#MODELS[@]} -eq 0 ] && MODELS=(deepseek-v3 qwen3-30b-a3b mixtral-8x7b)
STEPS=${OVERLAP_STEPS:-20}
LIMIT=${OVERLAP_TIMEOUT:-600}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
cd "$(dirname "$0")/.." || exit 1
export NCCL_NVLS_ENABLE=0 # NVLink multicast off (docs/gpu.md)
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
[ "${gpus:-0}" -lt 1 ] && { echo "overlap_gpu: no GPU"; exit 77; }
ranks=1
while [ $((ranks * 2)) -le "$gpus" ] && [ $((ranks * 2)) -le 8 ]; do ranks=$((ranks * 2)); done
[ -x "$BUILD/tools/moert" ] || { echo "overlap_gpu: no $BUILD/tools/moert (build with -Dcuda=enabled)" >&2; exit 1; }
status=0
echo "overlap_gpu: $gpus GPU(s), EP$ranks; $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1)"
git_rev=${MOERT_BENCH_GIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
machine=${OVERLAP_MACHINE:-$gpus GPU(s)}
if [ "${OVERLAP_TORCH:-0}" = 1 ] && ! command -v torchrun >/dev/null; then
    echo "overlap_gpu: OVERLAP_TORCH=1 needs torchrun on PATH (a Python with torch)" >&2
    exit 1
fi

common=(--set 'parallel.device="cuda"' --set "parallel.ranks=$ranks" --set model.num_layers=2
        --set train.micro_batches=4 --set 'train.optimizer="sgd"' --set train.log_every=5
        --set "train.input_shift=${OVERLAP_INPUT_SHIFT:-0}")
[ "$DISPATCHER" != - ] && common+=(--set "dispatcher={\"plugin\":\"$DISPATCHER\"}")
[ -n "${OVERLAP_PRECISION:-}" ] && common+=(--set "precision=$OVERLAP_PRECISION")

for model in "${MODELS[@]}"; do
    shape=()
    [ "$model" = deepseek-v3 ] && shape=(--set "model.num_experts=$((ranks * 32))")
    args=("configs/$model.json" "configs/$model.json" "${common[@]}" "${shape[@]}"
          --set-a 'parallel.overlap_micro_batches="off"' --set-b 'parallel.overlap_micro_batches="on"'
          --warmup 3 --steps "$STEPS")
    [ -n "${OVERLAP_B_PRECISION:-}" ] && args+=(--set-b "precision=$OVERLAP_B_PRECISION")
    [ -n "${OVERLAP_B_DISPATCHER:-}" ] && args+=(--set-b "dispatcher=$OVERLAP_B_DISPATCHER")
    log="$OUT/overlap-$model.log"
    echo "== $model: moert ab ${args[*]}"
    timeout "$LIMIT" "$BUILD/tools/moert" ab "${args[@]}" --report "$OUT/overlap-$model.json" >"$log" 2>&1
    rc=$?
    if [ $rc -ne 0 ] && grep -qE "does not fit|out of memory|--sequential" "$log"; then
        echo "overlap_gpu: A and B of $model do not fit together: again with --sequential"
        timeout "$LIMIT" "$BUILD/tools/moert" ab "${args[@]}" --sequential --report "$OUT/overlap-$model.json" >"$log" 2>&1
        rc=$?
    fi
    grep -E "^moert ab|^  |^outputs agree|^summary|^cuda graph|^timing|moert ab: " "$log"
    echo "(exit status $rc; log $log)"
    [ $rc -eq 0 ] || status=1
    grep -qE "^outputs agree: yes" "$log" || { echo "overlap_gpu: FAIL: $model's outputs do not agree"; status=1; }

    # the PyTorch peer in the same call: one layer of the same shape (deepseek-v3: 32 experts a GPU, as above)
    if [ "${OVERLAP_TORCH:-0}" = 1 ]; then
        per_rank=0
        [ "$model" = deepseek-v3 ] && per_rank=32
        timeout "$LIMIT" torchrun --nproc-per-node "$ranks" bench/torch_baseline.py --preset "$model" \
            --experts-per-rank "$per_rank" --out "$OUT/torch-$model.json" --git "$git_rev" --machine "$machine" \
            >"$OUT/torch-$model.log" 2>&1 || { echo "overlap_gpu: FAIL: the PyTorch peer of $model"; status=1; }
        grep -E "^$model " "$OUT/torch-$model.log" | head -1
    fi

    # a trace of the "on" side: slot 0's streams are "compute" and "wgrad", slot 1's "compute.1" and "wgrad.1"
    [ "${OVERLAP_TRACE:-1}" = 0 ] && continue
    kernels=()
    [ "${OVERLAP_TRACE:-1}" = kernels ] && kernels=(--trace-kernels)
    timeout "$LIMIT" "$BUILD/tools/moert" run "configs/$model.json" "${common[@]}" "${shape[@]}" --quiet \
        --set 'parallel.overlap_micro_batches="on"' ${OVERLAP_B_PRECISION:+--set "precision=$OVERLAP_B_PRECISION"} \
        ${OVERLAP_B_DISPATCHER:+--set "dispatcher=$OVERLAP_B_DISPATCHER"} \
        --steps 4 --trace "$OUT/trace-overlap-$model.json" "${kernels[@]}" \
        >"$OUT/trace-overlap-$model.log" 2>&1 || { echo "overlap_gpu: FAIL: the trace run of $model"; status=1; }
    # the figure the targets are set for: the merged halves per layer and micro-batch, every rank, steps 2-4
    [ -s "$OUT/trace-overlap-$model.json" ] &&
        echo "$model $(python3 tools/trace_summary.py "$OUT/trace-overlap-$model.json" | tail -1)"
    [ ${#kernels[@]} -eq 0 ] && continue
    # the off side's kernels, and each kernel's mean call on the on side against the off side's (rank 0)
    timeout "$LIMIT" "$BUILD/tools/moert" run "configs/$model.json" "${common[@]}" "${shape[@]}" --quiet \
        --set 'parallel.overlap_micro_batches="off"' --steps 4 --trace "$OUT/trace-overlap-off-$model.json" \
        "${kernels[@]}" >"$OUT/trace-overlap-off-$model.log" 2>&1 ||
        { echo "overlap_gpu: FAIL: the off side's trace run of $model"; status=1; }
    python3 tools/trace_summary.py "$OUT/trace-overlap-$model.json" --ranks 1 --kernels --gaps --top 20 \
        --against "$OUT/trace-overlap-off-$model.json" >"$OUT/kernels-overlap-$model.txt" 2>&1 &&
        sed -n '/^kernels, rank 0/,$p' "$OUT/kernels-overlap-$model.txt" ||
        { echo "overlap_gpu: FAIL: the kernel summary of $model"; status=1; }
done
echo "overlap_gpu: reports and traces in $OUT; exit status $status"
exit $status
