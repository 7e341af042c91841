#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""moert.torch.MoE inside a torch training step: one layer's forward + backward, timed like bench/torch_baseline.py
times the plain PyTorch expert-parallel layer, so the two can run in the same call and be compared; and beside it
moert's own figure of the same passes (the sum of its stage times, what `moert run` reports for the layer), so the
cost of the torch integration is read off one process.

Launch (one process per GPU; the preset's experts are divided so that each GPU holds as many as at EP4 unless
--experts says otherwise):
    torchrun --nproc-per-node 2 bench/torch_moe_bench.py --build build --preset deepseek-v3 --out FILE.json
Check the logic on a CPU (gloo, shapes divided by --shrink):
    torchrun --nproc-per-node 2 bench/torch_moe_bench.py --build build --cpu --shrink 16 --iters 3 --warmup 1
"""

import argparse
import json
import os
import statistics
import sys
import time

os.environ["NCCL_NVLS_ENABLE"] = "0"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
import moert  # noqa: E402
import moert.torch  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", required=True, help="a meson build directory (its libmoert.so and plugins)")
    ap.add_argument("--preset", default="deepseek-v3", help="configs/PRESET.json")
    ap.add_argument("--experts", type=int, default=0, help="experts over all ranks (default: world * E / 4)")
    ap.add_argument("--dispatcher", default="", help="override $.dispatcher.plugin")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--cpu", action="store_true", help="gloo on the CPU (logic check)")
    ap.add_argument("--shrink", type=int, default=1, help="divide H, F and T by this (logic check)")
    ap.add_argument("--out", default="", help="append a JSON line with the result (rank 0)")
    a = ap.parse_args()

    backend = "gloo" if a.cpu else "nccl"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu") if a.cpu else torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if not a.cpu:
        torch.cuda.set_device(device)
    moert.load_library(a.build)

    cfg = json.load(open(os.path.join(HERE, "..", "configs", a.preset + ".json")))
    m = cfg["model"]
    experts = a.experts or max(world, world * m["num_experts"] // 4)
    m["num_experts"] = experts
    m["num_layers"] = 1
    m["hidden"] //= a.shrink
    m["ffn_hidden"] //= a.shrink
    if m.get("shared_expert_ffn_hidden"):
        m["shared_expert_ffn_hidden"] //= a.shrink
    if a.cpu:
        m["dtype"] = "fp32"
    tokens = cfg["train"]["tokens_per_rank"] // a.shrink
    cfg["train"]["tokens_per_rank"] = tokens
    cfg["parallel"] = {"ranks": world}
    if a.dispatcher:
        cfg["dispatcher"] = {"plugin": a.dispatcher}
    moe = moert.torch.MoE(cfg, device=device, max_tokens=tokens)
    dtype = torch.float32 if a.cpu else torch.bfloat16
    gen = torch.Generator(device="cpu").manual_seed(1234 + rank)
    x = (torch.randn(tokens, m["hidden"], generator=gen) * 0.5).to(device=device, dtype=dtype).requires_grad_(True)
    dy = (torch.randn(tokens, m["hidden"], generator=gen) * 0.5).to(device=device, dtype=dtype)

    times, stage_sums, fwd_times = [], [], []
    for i in range(a.warmup + a.iters):
        dist.barrier()
        if a.cpu:
            t0 = time.perf_counter()
            y, router_loss = moe(x)
            fwd = (time.perf_counter() - t0) * 1e3
            torch.autograd.backward([y, router_loss], [dy, torch.ones_like(router_loss)])
            ms = (time.perf_counter() - t0) * 1e3
        else:
            start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            start.record()
            y, router_loss = moe(x)
            mid.record()
            torch.autograd.backward([y, router_loss], [dy, torch.ones_like(router_loss)])
            end.record()
            torch.cuda.synchronize()
            ms, fwd = start.elapsed_time(end), start.elapsed_time(mid)
            del y, router_loss
        # moert's own figure of the same forward and backward: the sum of its stage times, what `moert run`
        # reports as the layer's time
        stage_sum = sum(moe.figures()["stage_ms"].values())
        x.grad = None
        for p in moe.parameters():
            p.grad = None
        if i >= a.warmup:
            times.append(ms)
            stage_sums.append(stage_sum)
            fwd_times.append(fwd)
    # the slowest rank's medians are the layer's
    t = torch.tensor([statistics.median(times), statistics.median(stage_sums), statistics.median(fwd_times)],
                     dtype=torch.float64, device=device if not a.cpu else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if rank == 0:
        layer, stages, fwd = (float(v) for v in t.tolist())
        res = {"name": "moert_torch_moe_fwd_bwd", "preset": a.preset, "value": round(layer, 3), "unit": "ms",
               "forward_ms": round(fwd, 3), "moert_stage_sum_ms": round(stages, 3),
               "torch_over_stage_sum": round(layer / stages, 4) if stages > 0 else None,
               "world": world, "experts": experts, "tokens_per_rank": tokens,
               "dispatcher": cfg.get("dispatcher", {}).get("plugin", "alltoall"),
               "device": "cpu" if a.cpu else torch.cuda.get_device_name(device), "torch": torch.__version__}
        print(json.dumps(res), flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps(res) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
