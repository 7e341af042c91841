#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Times `moert run` on the layer presets (forward+backward, per stage) and records the figures.

Runs each preset with --report, takes the median over the steps after warm-up of the layer's
forward+backward time (the sum of its stages, timed with CUDA events on rank 0) and of each stage, puts the
peer's figures beside them when a torch_baseline.py JSON of the same run is given, and writes one JSON in
bench/results/ format plus a Markdown table.

  python3 bench/layer_bench.py --moert build/tools/moert --machine nvidia-h200-x4 --git REV \\
      --peer OUT/torch.json --out bench/results/DATE-layer-MACHINE.json [--preset deepseek-v3 ...]
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

PRESETS = ["deepseek-v3", "qwen3-30b-a3b", "qwen3-235b-a22b", "mixtral-8x7b"]
STAGES = ["router", "permute", "dispatch", "fc1", "act", "fc2", "combine", "backward"]
TARGET_MS = {"deepseek-v3": 20.0, "qwen3-30b-a3b": 7.0, "mixtral-8x7b": 28.0}  # the layer's targets (table column)


def run_preset(args, preset, workdir):
    report = os.path.join(workdir, "moert-%s.json" % preset)
    cmd = [args.moert, "run", "configs/%s.json" % preset, "--quiet", "--steps", str(args.steps),
           "--set", "parallel.device=cuda", "--report", report] + sum((["--set", s] for s in args.set), [])
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return None, " ".join(cmd), (proc.stderr or proc.stdout).strip()[-400:]
    rep = json.load(open(report))
    steps = rep["steps"][args.warmup:] or rep["steps"]
    stage = {s: statistics.median(st["stage_ms_rank0"][s] for st in steps) for s in STAGES}
    layer = statistics.median(sum(st["stage_ms_rank0"][s] for s in STAGES) for st in steps)
    parts = {}
    for name in steps[0].get("backward_parts_ms_rank0", {}):
        v = statistics.median(st["backward_parts_ms_rank0"][name] for st in steps)
        if v > 0:
            parts[name] = v
    step = statistics.median(st["step_ms"] for st in steps)
    return {"layer_ms": layer, "step_ms": step, "stages": stage, "parts": parts, "report": rep,
            "seconds": time.time() - start}, \
        " ".join(cmd), None


def peer_figures(path):
    if not path or not os.path.exists(path):
        return {}
    out = {}
    for r in json.load(open(path)).get("results", []):
        out[r["name"]] = r
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--moert", default="build/tools/moert")
    p.add_argument("--preset", action="append", help="one preset (repeatable); default: all four")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the medians")
    p.add_argument("--set", action="append", default=[], help="extra --set KEY=VALUE for every run")
    p.add_argument("--machine", default="nvidia-h200-x4")
    p.add_argument("--git", default="unknown")
    p.add_argument("--peer", help="torch_baseline.py JSON from the same machine and call")
    p.add_argument("--out", required=True, help="results JSON; a .md table is written beside it")
    args = p.parse_args()

    workdir = os.path.dirname(os.path.abspath(args.out)) or "."
    peer = peer_figures(args.peer)
    results, rows = [], []
    for preset in args.preset or PRESETS:
        got, cmd, err = run_preset(args, preset, workdir)
        if got is None:
            print("%s: moert run failed: %s" % (preset, err), file=sys.stderr)
            results.append({"name": "%s/error" % preset, "value": err, "unit": "", "config": {"command": cmd}})
            rows.append("| %s | failed | | | | | |" % preset)
            continue
        rep = got["report"]
        m = rep["model"]
        tokens = rep["tokens_per_rank"]
        flops = 18.0 * tokens * m["topk"] * m["hidden"] * m["ffn_hidden"]
        conf = {"command": cmd, "tokens_per_rank": tokens, "ranks": rep["ranks"], "device": rep["device"],
                "plugins": {pl["kind"]: pl["name"] for pl in rep["plugins"]}, "model": m,
                "median_over_steps": "%d..%d" % (args.warmup + 1, args.steps)}
        results.append({"name": "%s/layer_fwd_bwd_time" % preset, "value": got["layer_ms"], "unit": "ms", "config": conf})
        results.append({"name": "%s/layer_fwd_bwd_tflops" % preset, "value": flops / got["layer_ms"] * 1e-9,
                        "unit": "TFLOP/s per GPU", "config": {"flops": "18*T*K*H*F"}})
        results.append({"name": "%s/step_time" % preset, "value": got["step_ms"], "unit": "ms",
                        "config": {"what": "wall time of a training step incl. optimizer, rank 0"}})
        for s, v in got["stages"].items():
            results.append({"name": "%s/stage_%s_time" % (preset, s), "value": v, "unit": "ms", "config": {}})
        for s, v in got["parts"].items():
            results.append({"name": "%s/backward_%s_time" % (preset, s), "value": v, "unit": "ms",
                            "config": {"what": "a part of the backward stage (docs/executor.md, Backward overlap)"}})
        peer_ms = peer.get("%s/layer_fwd_bwd_time" % preset, {}).get("value")
        ratio = peer_ms / got["layer_ms"] if peer_ms else None
        if ratio:
            results.append({"name": "%s/speedup_vs_torch" % preset, "value": ratio, "unit": "x",
                            "config": {"peer_ms_same_call": peer_ms}})
        rows.append("| %s | %.2f | %s | %s | %s | %s | %s |" % (
            preset, got["layer_ms"], "%.2f" % peer_ms if peer_ms else "-", "%.2fx" % ratio if ratio else "-",
            "%.1f" % TARGET_MS[preset] if preset in TARGET_MS else "-",
            " ".join("%s %.2f" % (s, v) for s, v in got["stages"].items()),
            " ".join("%s %.2f" % (s, v) for s, v in got["parts"].items())))

    doc = {"command": " ".join(sys.argv), "machine": args.machine, "gpus": 4, "git": args.git,
           "date": datetime.date.today().isoformat(), "results": results,
           "peer_file": os.path.basename(args.peer) if args.peer else None}
    json.dump(doc, open(args.out, "w"), indent=1)
    table = ["| preset | moert fwd+bwd ms | torch ms (same call) | speed-up | target ms | stages (ms) | backward parts (ms) |",
             "|---|---|---|---|---|---|---|"] + rows
    open(os.path.splitext(args.out)[0] + ".md", "w").write("\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
