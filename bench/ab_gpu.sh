#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# `moert ab` on GPUs, a reviewer's A/B (docs/ab.md): one DeepSeek-V3 MoE layer at EP = the GPUs used (1 or 2), 64
# experts per GPU (model.num_experts = GPUs x 64, num_layers 1), 4096 tokens per rank.
#   (a) an A/A: configs/deepseek-v3.json against itself. Its timing interval is the machine's noise floor, and the
#       first step's output and every parameter gradient are read back from the GPUs and compared: they must be
#       identical (this is the GPU path of the agreement check; the script fails otherwise);
#   (b) an A/B: dispatcher alltoall (A) against deepep (B) on the same shape, with --aa (A', a second copy of A,
#       interleaved with both): each B/A interval is printed with the A'/A one beside it; outputs and gradients are
#       compared within the bf16 recipe's declared tolerance.
# Both use train.optimizer "sgd": three runtimes of 64 DeepSeek-V3 experts per GPU must live at once, and Adam's two
# moment buffers would add 21 GiB to each (moert check: 30.6 GiB per rank and runtime with sgd). Where (b) does not
# fit three times (an 80 GB card), it is run again with 32 experts per GPU, said so.
#   usage: bench/ab_gpu.sh BUILD_DIR OUT_DIR
# Writes OUT_DIR/ab-gpu-{aa,alltoall-deepep}.{json,md,log}; prints the verdict lines. Exit status: 0 when both ran and
# the A/A's first step compared identical on the GPUs, 1 otherwise, 77 without a GPU.
set -u
if [ $# -ne 2 ]; then
    echo "usage: $0 BUILD_DIR OUT_DIR" >&2
    exit 2
fi
BUILD=$(realpath "$1")
OUT=$2
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
cd "$(dirname "$0")/.." || exit 1
export NCCL_NVLS_ENABLE=0 # NVLink multicast off (docs/gpu.md)
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
[ "${gpus:-0}" -lt 1 ] && { echo "ab_gpu: no GPU"; exit 77; }
ranks=$((gpus >= 2 ? 2 : 1))
[ -x "$BUILD/tools/moert" ] || { echo "ab_gpu: no $BUILD/tools/moert (build with -Dcuda=enabled)" >&2; exit 1; }
status=0

shape() { # EXPERTS_PER_GPU: sets SHAPE, the --set options of the shape
    SHAPE=(--set 'parallel.device="cuda"' --set "parallel.ranks=$ranks" --set "model.num_experts=$((ranks * $1))"
           --set model.num_layers=1 --set 'train.optimizer="sgd"' --set train.log_every=5)
}

# run_ab NAME ARGS...: moert ab with the report in OUT; prints the header and verdict lines, keeps the log
run_ab() {
    local name=$1
    shift
    echo "== $name: moert ab $*"
    timeout 600 "$BUILD/tools/moert" ab "$@" --report "$OUT/ab-gpu-$name.json" >"$OUT/ab-gpu-$name.log" 2>&1
    local rc=$?
    grep -E "^moert ab|^  |^outputs agree|^A' \(a second|^summary|^cuda graph|^timing|moert ab: " "$OUT/ab-gpu-$name.log"
    echo "(exit status $rc; log $OUT/ab-gpu-$name.log)"
    return $rc
}

echo "ab_gpu: $gpus GPU(s), EP$ranks; $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1)"

# (a) A/A: identical outputs and gradients, read back from every GPU
shape 64
run_ab aa configs/deepseek-v3.json configs/deepseek-v3.json "${SHAPE[@]}" --warmup 3 --steps 20 || status=1
if ! grep -qE '^outputs agree: yes \(max relative loss difference 0\.0e\+00 over [0-9]+ steps, identical; first step: output 0\.0e\+00, gradients 0\.0e\+00;' "$OUT/ab-gpu-aa.log"; then
    echo "ab_gpu: FAIL: the A/A's losses, first-step output and gradients are not identical on the GPUs"
    status=1
fi

# (b) alltoall against deepep, with the A/A beside it
ab_args=(configs/deepseek-v3.json configs/deepseek-v3.json --set-b 'dispatcher={"plugin":"deepep"}' --aa
         --warmup 3 --steps 20)
if ! run_ab alltoall-deepep "${ab_args[@]}" "${SHAPE[@]}"; then
    if grep -qE "does not fit|out of memory|--sequential" "$OUT/ab-gpu-alltoall-deepep.log"; then
        echo "ab_gpu: three runtimes of 64 experts per GPU do not fit on this card: again with 32 experts per GPU"
        shape 32
        run_ab alltoall-deepep "${ab_args[@]}" "${SHAPE[@]}" || status=1
    else
        status=1
    fi
fi
grep -qE "^outputs agree: .*first step: output [0-9.]+e[-+][0-9]+, gradients" "$OUT/ab-gpu-alltoall-deepep.log" ||
    { echo "ab_gpu: FAIL: the A/B's first step was not compared"; status=1; }
grep -qE "^A' \(a second copy of A\) agrees with A: yes .*identical; first step: output 0\.0e\+00, gradients 0\.0e\+00;" \
    "$OUT/ab-gpu-alltoall-deepep.log" || { echo "ab_gpu: FAIL: A' differs from A"; status=1; }
echo "ab_gpu: reports in $OUT; exit status $status"
exit $status
