#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# How one MoE layer's cost grows with the tokens per rank and the expert-parallel size, in one call: the deepseek-v3
# and qwen3-30b-a3b layers (one layer, bf16, the preset's default stack, SGD, a thread per GPU) at TOKENS tokens per
# rank and EP 1, 2 and 4, each GPU holding the preset's EP4 share of experts (model.num_experts = EP x E/4: one GPU
# cannot hold deepseek-v3's 256 experts with fp32 master weights), so the rows show what the tokens and the
# all-to-all over more GPUs add to the same per-GPU work. EP1 and EP2 runs share the GPUs (CUDA_VISIBLE_DEVICES), EP1
# four at a time, EP2 two.
# Layer time: the median over the measured steps of rank 0's stage sum (forward and backward of the layer).
# Writes OUT/scaling.json (command, machine: the GPUs' nvidia-smi name, date, git revision, one row per run) and
# OUT/scaling.png (matplotlib, when present), prints a table. Exit status 1 when a run failed.
#   usage: bench/scaling_gpu.sh BUILD_DIR OUT_DIR [TOKENS...]      (default 512 2048 8192 16384)
set -u
BUILD=$(realpath "${1:?usage: bench/scaling_gpu.sh BUILD_DIR OUT_DIR [TOKENS...]}")
OUT=$(mkdir -p "${2:?usage: bench/scaling_gpu.sh BUILD_DIR OUT_DIR [TOKENS...]}" && realpath "$2")
shift 2
TOKENS=("$@")
[ ${#TOKENS[@]} -gt 0 ] || TOKENS=(512 2048 8192 16384)
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0
MOERT="$BUILD/tools/moert"
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
[ "${gpus:-0}" -ge 1 ] || { echo "scaling_gpu.sh: no GPU" >&2; exit 77; }
[ -x "$MOERT" ] || { echo "scaling_gpu.sh: $MOERT is not built" >&2; exit 2; }
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
git=${MOERT_BENCH_GIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
echo "layer scaling: $gpus x $card, git $git, tokens ${TOKENS[*]}"
rm -f "$OUT/runs.jsonl"

# run PRESET LOCAL_EXPERTS EP TOKENS DEVICES: one `moert run` on the GPUs DEVICES (comma-separated)
run() {
  local preset=$1 local_experts=$2 ep=$3 tokens=$4 devices=$5
  local name="$preset-ep$ep-t$tokens"
  CUDA_VISIBLE_DEVICES=$devices timeout 300 "$MOERT" run "configs/$preset.json" --quiet --steps 8 \
    --set parallel.device='"cuda"' --set parallel.ranks="$ep" --set model.num_layers=1 \
    --set model.num_experts=$((ep * local_experts)) --set train.tokens_per_rank="$tokens" \
    --set 'train.optimizer="sgd"' --report "$OUT/$name.json" >"$OUT/$name.log" 2>&1
  echo "$name $? $preset $ep $tokens" >>"$OUT/done.txt"
}

rm -f "$OUT/done.txt"
for pe in deepseek-v3:64 qwen3-30b-a3b:32; do
  preset=${pe%%:*} local=${pe##*:}
  for ep in 1 2 4; do
    [ "$ep" -le "$gpus" ] || continue
    slots=$((gpus / ep))
    i=0
    for t in "${TOKENS[@]}"; do
      first=$(((i % slots) * ep))
      devices=$(seq -s, "$first" $((first + ep - 1)))
      run "$preset" "$local" "$ep" "$t" "$devices" &
      i=$((i + 1))
      [ $((i % slots)) -eq 0 ] && wait
    done
    wait
  done
done

python3 - "$OUT" "$card" "$gpus" "$git" "bench/scaling_gpu.sh $*" <<'PY'
import datetime, json, os, statistics, sys
out, card, gpus, git, command = sys.argv[1:6]
stages = ["router", "permute", "dispatch", "fc1", "act", "fc2", "combine", "backward"]
rows, failed = [], 0
for line in open(os.path.join(out, "done.txt")):
    name, rc, preset, ep, tokens = line.split()
    row = {"name": name, "preset": preset, "ep": int(ep), "tokens_per_rank": int(tokens), "rc": int(rc)}
    try:
        rep = json.load(open(os.path.join(out, name + ".json")))
        steps = rep["steps"][2:] or rep["steps"]
        row["layer_fwd_bwd_ms"] = statistics.median(sum(s["stage_ms_rank0"][k] for k in stages) for s in steps)
        row["stage_ms"] = {k: statistics.median(s["stage_ms_rank0"][k] for s in steps) for k in stages}
    except (OSError, KeyError, ValueError) as e:
        row["error"] = str(e)
    failed += row["rc"] != 0 or "layer_fwd_bwd_ms" not in row
    rows.append(row)
rows.sort(key=lambda r: (r["preset"], r["ep"], r["tokens_per_rank"]))
doc = {"command": command, "machine": "%s x %s" % (gpus, card), "gpus": int(gpus), "git": git,
       "date": datetime.date.today().isoformat(),
       "what": "one MoE layer (bf16, the preset's default stack, SGD, a thread per GPU, E/4 experts per GPU) through "
               "moert run, 8 steps: layer_fwd_bwd_ms is the median over steps 3-8 of rank 0's stage sum",
       "runs": rows}
json.dump(doc, open(os.path.join(out, "scaling.json"), "w"), indent=1)
print("%-16s %4s %8s %12s" % ("preset", "EP", "tokens", "layer ms"))
for r in rows:
    print("%-16s %4d %8d %12s" % (r["preset"], r["ep"], r["tokens_per_rank"],
                                  "%.2f" % r["layer_fwd_bwd_ms"] if "layer_fwd_bwd_ms" in r else "failed"))
try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, preset in zip(axes, ["deepseek-v3", "qwen3-30b-a3b"]):
        for ep in (1, 2, 4):
            pts = [(r["tokens_per_rank"], r["layer_fwd_bwd_ms"]) for r in rows
                   if r["preset"] == preset and r["ep"] == ep and "layer_fwd_bwd_ms" in r]
            if pts:
                ax.plot(*zip(*pts), marker="o", label="EP%d" % ep)
        ax.set_xscale("log", base=2)
        ax.set_title("%s layer (E/4 experts per GPU)" % preset)
        ax.set_xlabel("tokens per rank")
        ax.set_ylabel("forward+backward ms")
        ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "scaling.png"), dpi=100)
except ImportError:
    pass
sys.exit(1 if failed else 0)
PY
