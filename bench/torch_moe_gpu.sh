#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The PyTorch package's speed on a GPU machine, in one call, for the deepseek-v3, qwen3-30b-a3b and mixtral-8x7b
# layers at the per-GPU shape of EP4 (E/4 experts per GPU) over every GPU of the host:
#   - moert.torch.MoE inside a torch step (bench/torch_moe_bench.py: torch events around forward+backward, and
#     moert's stage sum of the same passes);
#   - the plain PyTorch expert-parallel layer (bench/torch_baseline.py), the peer;
#   - moert's own harness (`moert run`, one layer, the median of the stage sums of steps 3-12).
# Prints one table; the raw figures go to OUT_DIR (torch.jsonl, baseline-*.json, harness-*.json, summary.json).
#   usage: bench/torch_moe_gpu.sh BUILD_DIR OUT_DIR [MACHINE_KIND] [DISPATCHER]
set -u
BUILD=$(realpath "${1:-build}")
OUT=$(mkdir -p "${2:-/tmp/moert-torch-bench}" && realpath "${2:-/tmp/moert-torch-bench}")
MACHINE=${3:-unknown}
DISPATCHER=${4:-alltoall}
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
[ "$gpus" -ge 1 ] || { echo "torch_moe_gpu.sh: no GPU" >&2; exit 77; }
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "moert.torch vs harness vs plain PyTorch: EP$gpus on $gpus x $card, $DISPATCHER, git $(git rev-parse --short HEAD 2>/dev/null)"
launch() { timeout 500 torchrun --standalone --nproc-per-node "$gpus" "$@"; }

for preset in deepseek-v3 qwen3-30b-a3b mixtral-8x7b; do
  E=$(python3 -c "import json; print(json.load(open('configs/$preset.json'))['model']['num_experts'])")
  per_rank=$((E / 4))
  launch bench/torch_moe_bench.py --build "$BUILD" --preset "$preset" --dispatcher "$DISPATCHER" \
    --out "$OUT/torch.jsonl" >"$OUT/torch-$preset.log" 2>&1 || { echo "$preset: torch bench failed"; tail -20 "$OUT/torch-$preset.log"; }
  launch bench/torch_baseline.py --preset "$preset" --experts-per-rank "$per_rank" --machine "$MACHINE" \
    --out "$OUT/baseline-$preset.json" >"$OUT/baseline-$preset.log" 2>&1 || { echo "$preset: baseline failed"; tail -20 "$OUT/baseline-$preset.log"; }
  timeout 300 "$BUILD/tools/moert" run "configs/$preset.json" --quiet --steps 12 --set parallel.ranks="$gpus" \
    --set parallel.device='"cuda"' --set model.num_layers=1 --set model.num_experts=$((gpus * per_rank)) \
    --set dispatcher.plugin="\"$DISPATCHER\"" --report "$OUT/harness-$preset.json" >"$OUT/harness-$preset.log" 2>&1 \
    || { echo "$preset: harness failed"; tail -20 "$OUT/harness-$preset.log"; }
done

python3 - "$OUT" "$MACHINE" "$card" "$gpus" "$DISPATCHER" <<'PY'
import json, os, statistics, sys
out, machine, card, gpus, dispatcher = sys.argv[1:6]
torch_rows = {}
if os.path.exists(os.path.join(out, "torch.jsonl")):
    for line in open(os.path.join(out, "torch.jsonl")):
        r = json.loads(line)
        torch_rows[r["preset"]] = r
summary = []
print("%-15s %10s %10s %10s %10s %9s %9s" % ("preset", "torch ms", "stages ms", "harness", "plain pt", "t/harness",
                                          "pt/torch"))
for preset in ("deepseek-v3", "qwen3-30b-a3b", "mixtral-8x7b"):
    t = torch_rows.get(preset, {})
    try:
        steps = json.load(open(os.path.join(out, "harness-%s.json" % preset)))["steps"][2:]
        harness = statistics.median(sum(s["stage_ms_rank0"].values()) for s in steps)
    except (OSError, KeyError, ValueError, statistics.StatisticsError):
        harness = None
    plain = None
    try:
        b = json.load(open(os.path.join(out, "baseline-%s.json" % preset)))
        for r in b.get("results", []):
            if r.get("name") == preset + "/layer_fwd_bwd_time":
                plain = r["value"]
    except (OSError, ValueError):
        pass
    row = {"preset": preset, "torch_ms": t.get("value"), "torch_forward_ms": t.get("forward_ms"),
           "moert_stage_sum_ms": t.get("moert_stage_sum_ms"), "harness_ms": harness, "plain_pytorch_ms": plain,
           "torch_over_harness": (t["value"] / harness) if t.get("value") and harness else None,
           "plain_over_torch": (plain / t["value"]) if t.get("value") and plain else None}
    summary.append(row)
    f = lambda v, p="%10.3f": (p % v) if v is not None else "%10s" % "-"  # noqa: E731
    print("%-15s %s %s %s %s %s %s" % (preset, f(row["torch_ms"]), f(row["moert_stage_sum_ms"]), f(harness), f(plain),
                                      f(row["torch_over_harness"], "%9.3f"), f(row["plain_over_torch"], "%9.3f")))
json.dump({"machine": machine, "card": card, "gpus": int(gpus), "dispatcher": dispatcher, "rows": summary},
          open(os.path.join(out, "summary.json"), "w"), indent=1)
PY
