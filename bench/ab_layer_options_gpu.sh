#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Two layer options as `moert ab` A/Bs on GPUs, at EP = the GPUs used (1 or 2), 64 experts per GPU, 4096 tokens per
# rank, one layer, bf16:
#   (a) the shared expert on its own stream or not: deepseek-v3-shared, parallel.shared_expert_overlap false (A) vs
#       true (B): losses must be identical (the overlap only reorders independent work);
#   (b) the allgather dispatcher against alltoall on deepseek-v3: the same routing, outputs within the recipe's
#       tolerance, and what the all-gather of every token costs.
#   usage: bench/ab_layer_options_gpu.sh BUILD_DIR OUT_DIR
# Writes OUT_DIR/ab-{shared-overlap,alltoall-allgather}.{json,md,log}; prints each A/B's last lines.
set -u
[ $# -eq 2 ] || { echo "usage: $0 BUILD_DIR OUT_DIR" >&2; exit 2; }
BUILD=$(realpath "$1")
mkdir -p "$2"
OUT=$(realpath "$2")
cd "$(dirname "$0")/.." || exit 1
export NCCL_NVLS_ENABLE=0
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
[ "${gpus:-0}" -lt 1 ] && { echo "ab_layer_options_gpu: no GPU"; exit 77; }
ranks=$((gpus >= 2 ? 2 : 1))
common=(--set "parallel.ranks=$ranks" --set 'parallel.device="cuda"' --set "model.num_experts=$((64 * ranks))"
        --set model.num_layers=1 --set 'train.optimizer="sgd"' --warmup 3 --steps 20 --quiet)
status=0
ab() { # name config [options]
  local name=$1 config=$2
  shift 2
  timeout 280 "$BUILD/tools/moert" ab "$config" "$config" "${common[@]}" "$@" --report "$OUT/ab-$name.json" \
    >"$OUT/ab-$name.log" 2>&1
  local rc=$?
  echo "== $name (EP$ranks): rc $rc"
  tail -4 "$OUT/ab-$name.log"
  [ $rc -eq 0 ] || status=1
}
ab shared-overlap configs/deepseek-v3-shared.json --set-a parallel.shared_expert_overlap=false \
  --set-b parallel.shared_expert_overlap=true
ab alltoall-allgather configs/deepseek-v3.json --set-a 'dispatcher.plugin="alltoall"' \
  --set-b 'dispatcher.plugin="allgather"'
exit $status
