#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# `moert run --trace FILE --trace-kernels` on the GPUs (up to 2, ranks as threads, micro-batch overlap on): every rank
# has its own kernels, on its own rows, within the run, every step's window holds kernels (their clock is the stage
# spans'), and tools/trace_summary.py --kernels sums them up.
#   usage: tests/gpu/test_trace_kernels.sh BUILD_DIR OUT_DIR        exit 0 pass, 1 fail, 77 no GPU
set -u
BUILD=$(realpath "$1")
OUT=$2
mkdir -p "$OUT"
cd "$(dirname "$0")/../.." || exit 1
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
[ "${gpus:-0}" -ge 1 ] || { echo "test_trace_kernels: no GPU"; exit 77; }
ranks=$((gpus >= 2 ? 2 : 1))
"$BUILD/tools/moert" run configs/demo-cpu.json --quiet --steps 3 --set parallel.device=cuda \
    --set parallel.ranks=$ranks --set 'model.dtype="bf16"' --set train.micro_batches=3 \
    --set 'parallel.overlap_micro_batches="on"' --trace "$OUT/trace-kernels.json" --trace-kernels ||
    { echo "test_trace_kernels: FAIL: moert run exited $?"; exit 1; }
python3 - "$OUT/trace-kernels.json" "$ranks" <<'PY' || exit 1
import collections, json, sys
d, ranks = json.load(open(sys.argv[1])), int(sys.argv[2])
names = {(e["pid"], e["tid"]): e["args"]["name"] for e in d["traceEvents"] if e.get("name") == "thread_name"}
stages = [e for e in d["traceEvents"] if e.get("ph") == "X" and e.get("cat") != "kernel"]
kernels = [e for e in d["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "kernel"]
end = max(e["ts"] + e["dur"] for e in stages)
per_rank = collections.Counter(e["pid"] for e in kernels)
assert sorted(per_rank) == list(range(ranks)), per_rank
for e in kernels:
    assert names[(e["pid"], e["tid"])].startswith("kernels, CUDA stream "), e
    assert e["dur"] >= 0 and e["args"]["grid"] > 0 and e["args"]["kernel"], e
    assert -1e3 <= e["ts"] <= end + 1e6, (e, end)
first = collections.defaultdict(lambda: float("inf"))
for e in stages:
    first[(e["pid"], e["args"]["step"])] = min(first[(e["pid"], e["args"]["step"])], e["ts"])
for (rank, step), t in sorted(first.items()):
    nxt = first.get((rank, step + 1), end)
    inside = [e for e in kernels if e["pid"] == rank and t - 500.0 <= e["ts"] < nxt]
    assert len(inside) >= 20, (rank, step, len(inside))
print("test_trace_kernels: %d kernels over %d rank(s), %s" % (len(kernels), ranks, dict(per_rank)))
PY
python3 tools/trace_summary.py "$OUT/trace-kernels.json" --kernels --top 5 >"$OUT/trace-kernels.txt" ||
    { echo "test_trace_kernels: FAIL: trace_summary --kernels"; exit 1; }
grep -q "^kernels, rank 0" "$OUT/trace-kernels.txt" || { echo "test_trace_kernels: FAIL: no kernel summary"; exit 1; }
echo "test_trace_kernels: PASS"
