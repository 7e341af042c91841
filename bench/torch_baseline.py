#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Peer baseline: a plain PyTorch expert-parallel MoE layer, forward + backward, bf16.

This is the measurement moert is compared against: the layer written the way a user writes it
today with stock PyTorch (fp32 router, argsort permute, NCCL all_to_all_single with uneven splits,
torch._grouped_mm experts, SwiGLU with the routing prob multiplied in fp32, plain-sum combine).
In the same launch it also measures the ceilings: dense bf16 GEMMs of the expert shapes,
torch._grouped_mm alone with the routed counts, and a raw all-to-all of the dispatch volume.

Launch (one process per GPU):
    torchrun --nproc-per-node 4 bench/torch_baseline.py --preset all --out FILE.json
Check the logic on a CPU (gloo, shapes divided by --shrink):
    torchrun --nproc-per-node 4 bench/torch_baseline.py --cpu --shrink 16 --iters 3 --warmup 1
"""

import argparse
import datetime
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time

# NVLink multicast (NVLS) can take shared GPUs down: keep it off whatever the caller set.
os.environ["NCCL_NVLS_ENABLE"] = "0"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# One MoE layer per preset (moe-reference.md); T is tokens per rank.
PRESETS = {
    "deepseek-v3": dict(H=7168, F=2048, E=256, K=8, T=4096, score="sigmoid",
                        groups=8, groups_kept=4, scale=2.5),
    "qwen3-30b-a3b": dict(H=2048, F=768, E=128, K=8, T=8192, score="softmax",
                          groups=1, groups_kept=1, scale=1.0),
    "qwen3-235b-a22b": dict(H=4096, F=1536, E=128, K=8, T=8192, score="softmax",
                            groups=1, groups_kept=1, scale=1.0),
    "mixtral-8x7b": dict(H=4096, F=14336, E=8, K=2, T=8192, score="softmax",
                         groups=1, groups_kept=1, scale=1.0),
}

# Shapes of the built-in correctness check (same E, K and routing as the preset, small H, F, T).
CHECK_H, CHECK_F, CHECK_T = 256, 128, 128
CHECK_TOLERANCE = 3e-2  # relative L2 error, bf16 layer against an fp32 reference

GROUPED_MM_IMPL = "torch._grouped_mm"  # set by probe_grouped_mm(); "per-expert loop" when missing/broken


def fail(message):
    """Print a clear error naming the rank and leave the process without touching a collective."""
    rank = os.environ.get("RANK", "0")
    print(f"torch_baseline.py (rank {rank}): error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


class Ctx:
    """What every function needs to know about this process: rank, world, device, clock."""

    def __init__(self, rank, world, device, use_cuda):
        self.rank = rank
        self.world = world
        self.device = device
        self.use_cuda = use_cuda

    def now(self):
        """A time stamp on the current stream (CUDA event) or the host clock on the CPU."""
        if self.use_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def ms(self, start, end):
        """Milliseconds between two stamps from now(); call sync() first."""
        if self.use_cuda:
            return start.elapsed_time(end)
        return (end - start) * 1e3

    def sync(self):
        """Wait for the device."""
        if self.use_cuda:
            torch.cuda.synchronize()

    def sync_all(self):
        """Wait for the device, then for every rank: the barrier between timed iterations."""
        self.sync()
        dist.barrier()
        self.sync()

    def reduce(self, values, op):
        """One all_reduce of a list of floats (op: "max", "min" or "mean")."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        reduce_op = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "mean": dist.ReduceOp.SUM}[op]
        dist.all_reduce(t, op=reduce_op)
        if op == "mean":
            t /= self.world
        return t.tolist()


class AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits along dim 0; its backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, tensor, out_splits, in_splits):
        ctx.out_splits, ctx.in_splits = out_splits, in_splits
        return all_to_all(tensor, out_splits, in_splits)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all(grad, ctx.in_splits, ctx.out_splits), None, None


def all_to_all(tensor, out_splits, in_splits):
    """Plain (no autograd) uneven all_to_all_single of the rows of tensor."""
    tensor = tensor.contiguous()
    out = tensor.new_empty((sum(out_splits),) + tuple(tensor.shape[1:]))
    dist.all_to_all_single(out, tensor, out_splits, in_splits)
    return out


def grouped_mm(a, w_t, offs, counts):
    """Rows of a grouped by local expert times w_t[e] ([E_local, in, out]); offs = int32 cumsum."""
    if GROUPED_MM_IMPL == "torch._grouped_mm":
        return torch._grouped_mm(a, w_t, offs=offs)
    parts = torch.split(a, counts)
    return torch.cat([part @ w_t[e] for e, part in enumerate(parts)])


def probe_grouped_mm(device):
    """Check torch._grouped_mm exists and gives right values and grads for our layout; else loop."""
    if not hasattr(torch, "_grouped_mm"):
        return "per-expert loop", "torch._grouped_mm is missing in this PyTorch"
    try:
        gen = torch.Generator(device=device).manual_seed(7)
        counts = [5, 0, 17, 3, 8]
        rows, hidden, out2 = sum(counts), 64, 96
        a = torch.randn(rows, hidden, generator=gen, device=device, dtype=torch.bfloat16)
        w = torch.randn(len(counts), out2, hidden, generator=gen, device=device, dtype=torch.bfloat16)
        up = torch.randn(rows, out2 // 2, generator=gen, device=device, dtype=torch.float32)
        offs = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
        a.requires_grad_(True)
        w.requires_grad_(True)
        g1, g2 = torch._grouped_mm(a, w.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
        (F.silu(g1.float()) * g2.float() * up).sum().backward()
        ar = a.detach().float().requires_grad_(True)
        wr = w.detach().float().requires_grad_(True)
        r = torch.cat([p @ wr[e].t() for e, p in enumerate(torch.split(ar, counts))])
        r1, r2 = r.chunk(2, dim=-1)
        (F.silu(r1) * r2 * up).sum().backward()
        errs = [rel_err(a.grad, ar.grad), rel_err(w.grad, wr.grad)]
        if max(errs) > CHECK_TOLERANCE:
            return "per-expert loop", f"torch._grouped_mm gave wrong gradients here (rel err {max(errs):.3g})"
    except Exception as exc:  # any failure means: measure the loop instead, and say so
        return "per-expert loop", f"torch._grouped_mm failed here: {type(exc).__name__}: {exc}"
    return "torch._grouped_mm", ""


def route(logits, cfg, expert_bias):
    """Top-k routing in fp32: expert ids [T, K] and their probs [T, K] (moe-reference.md)."""
    E, K = cfg["E"], cfg["K"]
    if cfg["score"] == "sigmoid":
        scores = torch.sigmoid(logits)
        choice = scores.detach() + expert_bias  # the bias changes which experts are picked only
        if cfg["groups"] > 1:
            T, G = logits.shape[0], cfg["groups"]
            group_score = choice.view(T, G, E // G).topk(K // cfg["groups_kept"], dim=-1).values.sum(-1)
            kept = group_score.topk(cfg["groups_kept"], dim=-1).indices
            mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, kept, True)
            mask = mask.unsqueeze(-1).expand(T, G, E // G).reshape(T, E)
            choice = choice.masked_fill(~mask, float("-inf"))
        idx = choice.topk(K, dim=-1).indices
        probs = scores.gather(1, idx)
        probs = probs / (probs.sum(-1, keepdim=True) + 1e-20)
        probs = probs * cfg["scale"]
    else:
        top_logits, idx = logits.topk(K, dim=-1)
        probs = torch.softmax(top_logits, dim=-1)
    return idx, probs


class Layer:
    """The parameters of one EP MoE layer on this rank: router (replicated) and E/world experts."""

    def __init__(self, cfg, ctx, seed):
        H, F_, E = cfg["H"], cfg["F"], cfg["E"]
        self.cfg = cfg
        self.local_experts = E // ctx.world
        dev, bf16 = ctx.device, torch.bfloat16
        shared = torch.Generator(device=dev).manual_seed(seed)  # same on every rank
        own = torch.Generator(device=dev).manual_seed(seed + 1 + ctx.rank)
        self.router_w = torch.randn(E, H, generator=shared, device=dev, dtype=bf16) * (1 / math.sqrt(H))
        self.expert_bias = torch.randn(E, generator=shared, device=dev, dtype=torch.float32) * 0.01
        # Weights stored like nn.Linear ([out, in]); fc1 holds gate and up stacked: [E_local, 2F, H].
        self.w1 = torch.randn(self.local_experts, 2 * F_, H, generator=own, device=dev, dtype=bf16)
        self.w1 *= 1 / math.sqrt(H)
        self.w2 = torch.randn(self.local_experts, H, F_, generator=own, device=dev, dtype=bf16)
        self.w2 *= 1 / math.sqrt(F_)
        for p in self.params():
            p.requires_grad_(True)

    def params(self):
        """The trained tensors."""
        return [self.router_w, self.w1, self.w2]


def moe_forward(layer, x, ctx, mark=None, keep=None):
    """Forward of the EP MoE layer for this rank's tokens x [T, H]; returns y [T, H] (bf16).

    mark(name) is called at the end of each stage (for the breakdown); keep, a dict, receives the
    grouped expert inputs for the grouped-GEMM micro-benchmark."""
    cfg, world, EL = layer.cfg, ctx.world, layer.local_experts
    E, K = cfg["E"], cfg["K"]
    T = x.shape[0]
    stage = mark if mark is not None else (lambda name: None)

    # Router: fp32 logits, top-k.
    logits = x.float() @ layer.router_w.float().t()
    idx, probs = route(logits, cfg, layer.expert_bias)
    stage("router")

    # Permute: token copies sorted by global expert id (experts of rank r are contiguous).
    flat_expert = idx.reshape(-1)
    order = torch.argsort(flat_expert, stable=True)
    token_of = order // K
    x_perm = x.index_select(0, token_of)
    p_perm = probs.reshape(-1).index_select(0, order)
    counts = torch.bincount(flat_expert, minlength=E)
    stage("permute")

    # Counts: every rank learns how many rows it receives from each source per local expert.
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts)
    both = torch.stack([counts, recv_counts]).cpu()  # host sync, as the alltoall dispatcher does
    send_splits = both[0].view(world, EL).sum(1).tolist()
    recv_matrix = both[1].view(world, EL)  # [source rank, local expert]
    recv_splits = recv_matrix.sum(1).tolist()
    tokens_per_expert = recv_matrix.sum(0).tolist()
    rows = sum(recv_splits)
    stage("counts")

    # Dispatch: tokens and their probs to the ranks owning their experts.
    h = AllToAll.apply(x_perm, recv_splits, send_splits)
    hp = AllToAll.apply(p_perm, recv_splits, send_splits)
    stage("dispatch_a2a")

    # Regroup: received chunks are [source][local expert]; the GEMM wants [local expert][source].
    chunk_expert = torch.arange(world * EL, device=x.device) % EL
    row_expert = torch.repeat_interleave(chunk_expert, recv_counts, output_size=rows)
    regroup = torch.argsort(row_expert, stable=True)
    h = h.index_select(0, regroup)
    hp = hp.index_select(0, regroup)
    offs = recv_counts.view(world, EL).sum(0).cumsum(0).to(torch.int32)
    stage("regroup")

    # Experts: fc1, SwiGLU with the prob multiply in fp32, fc2.
    h1 = grouped_mm(h, layer.w1.transpose(-2, -1), offs, tokens_per_expert)
    stage("fc1")
    gate, up = h1.chunk(2, dim=-1)
    act = (F.silu(gate.float()) * up.float() * hp.unsqueeze(-1)).to(torch.bfloat16)
    stage("act")
    h2 = grouped_mm(act, layer.w2.transpose(-2, -1), offs, tokens_per_expert)
    stage("fc2")
    if keep is not None:
        keep.update(h=h, act=act, offs=offs, counts=tokens_per_expert)

    # Back to [source][local expert] order, back to the source ranks, sum the K copies per token.
    inverse = torch.empty_like(regroup)
    inverse[regroup] = torch.arange(rows, device=x.device)
    h2 = h2.index_select(0, inverse)
    stage("unregroup")
    y_perm = AllToAll.apply(h2, send_splits, recv_splits)
    stage("combine_a2a")
    y = torch.zeros(T, cfg["H"], device=x.device, dtype=y_perm.dtype).index_add(0, token_of, y_perm)
    stage("unpermute")
    return y


def reference_forward_backward(layer, x, dy, ctx):
    """fp32 single-rank reference with all experts gathered; returns y and grads (summed over ranks)."""
    cfg, EL = layer.cfg, layer.local_experts
    gathered = []
    for w in (layer.w1, layer.w2):
        parts = [torch.empty_like(w, dtype=torch.float32) for _ in range(ctx.world)]
        dist.all_gather(parts, w.detach().float().contiguous())
        gathered.append(torch.cat(parts).requires_grad_(True))
    w1, w2 = gathered
    xr = x.detach().float().requires_grad_(True)
    wr = layer.router_w.detach().float().requires_grad_(True)
    idx, probs = route(xr @ wr.t(), cfg, layer.expert_bias)
    y = torch.zeros(x.shape[0], cfg["H"], device=x.device, dtype=torch.float32)
    for e in torch.unique(idx).tolist():
        tok, slot = (idx == e).nonzero(as_tuple=True)
        gate, up = (xr[tok] @ w1[e].t()).chunk(2, dim=-1)
        act = F.silu(gate) * up * probs[tok, slot].unsqueeze(-1)
        y = y.index_add(0, tok, act @ w2[e].t())
    y.backward(dy.float())
    for g in (w1.grad, w2.grad):
        dist.all_reduce(g)  # the experts' gradients come from every rank's tokens
    lo, hi = ctx.rank * EL, (ctx.rank + 1) * EL
    return y.detach(), xr.grad, wr.grad, w1.grad[lo:hi], w2.grad[lo:hi]


def rel_err(got, want):
    """Relative L2 error of got against want."""
    got, want = got.float(), want.float()
    return (torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want).clamp_min(1e-30)).item()


def check_layer(cfg, ctx, seed):
    """Run the bf16 EP layer at small H, F, T against the fp32 reference; max relative error."""
    small = dict(cfg, H=CHECK_H, F=CHECK_F, T=CHECK_T)
    layer = Layer(small, ctx, seed)
    gen = torch.Generator(device=ctx.device).manual_seed(seed + 1000 + ctx.rank)
    x = torch.randn(CHECK_T, CHECK_H, generator=gen, device=ctx.device, dtype=torch.bfloat16)
    dy = torch.randn(CHECK_T, CHECK_H, generator=gen, device=ctx.device, dtype=torch.bfloat16)
    x.requires_grad_(True)
    y = moe_forward(layer, x, ctx)
    y.backward(dy)
    want = reference_forward_backward(layer, x, dy, ctx)
    got = (y, x.grad, layer.router_w.grad, layer.w1.grad, layer.w2.grad)
    errs = [rel_err(g, w) for g, w in zip(got, want)]
    return ctx.reduce([max(errs)] + errs, "max")


def median_ms(ctx, fn, warmup, iters, before=None):
    """Median time of fn over iters runs after warmup runs, with a barrier before each run."""
    times = []
    for i in range(warmup + iters):
        if before is not None:
            before()
        ctx.sync_all()
        start = ctx.now()
        fn()
        end = ctx.now()
        ctx.sync()
        if i >= warmup:
            times.append(ctx.ms(start, end))
    return statistics.median(times)


def stage_breakdown(layer, x, dy, ctx, warmup, iters):
    """Median per stage of the layer (ms) from events between stages, one run at a time."""
    per_stage = {}
    for i in range(warmup + iters):
        clear_grads(layer, x)
        ctx.sync_all()
        stamps = [("start", ctx.now())]
        y = moe_forward(layer, x, ctx, mark=lambda name: stamps.append((name, ctx.now())))
        y.backward(dy)
        stamps.append(("backward", ctx.now()))
        ctx.sync()
        if i >= warmup:
            for (_, a), (name, b) in zip(stamps, stamps[1:]):
                per_stage.setdefault(name, []).append(ctx.ms(a, b))
    return {name: statistics.median(v) for name, v in per_stage.items()}


def clear_grads(layer, x):
    """Drop the gradients of the last iteration (outside the timed region)."""
    for t in layer.params() + [x]:
        t.grad = None


def rand_bf16(gen, ctx, *shape):
    """Random bf16 tensor (normal, never all zero) on this rank's device."""
    return torch.randn(*shape, generator=gen, device=ctx.device, dtype=torch.bfloat16)


def run_preset(name, cfg, ctx, args):
    """All measurements of one preset; returns (result dicts, summary row for the table)."""
    H, F_, E, K, T, W = cfg["H"], cfg["F"], cfg["E"], cfg["K"], cfg["T"], ctx.world
    config = dict(preset=name, H=H, F=F_, E=E, K=K, tokens_per_rank=T, ep=W, dtype="bf16",
                  router=cfg["score"], router_dtype="fp32", grouped_mm=GROUPED_MM_IMPL,
                  shared_expert="not included", aux_loss="none")
    results = []

    def add(metric, value, unit, **extra):
        results.append(dict(name=f"{name}/{metric}", value=value, unit=unit, config=dict(config, **extra)))

    # Correctness first, small and cheap: a wrong layer is not worth timing silently.
    check = check_layer(cfg, ctx, seed=11)
    check_ok = check[0] <= CHECK_TOLERANCE
    add("check_max_rel_err", check[0], "relative L2", tolerance=CHECK_TOLERANCE,
        check_shape=dict(H=CHECK_H, F=CHECK_F, T=CHECK_T), passed=check_ok,
        rel_err_y=check[1], rel_err_dx=check[2], rel_err_drouter=check[3],
        rel_err_dw1=check[4], rel_err_dw2=check[5])

    layer = Layer(cfg, ctx, seed=21)
    gen = torch.Generator(device=ctx.device).manual_seed(31 + ctx.rank)
    x = rand_bf16(gen, ctx, T, H).requires_grad_(True)
    dy = rand_bf16(gen, ctx, T, H)

    # The layer, forward + backward.
    def step():
        moe_forward(layer, x, ctx).backward(dy)

    layer_ms = ctx.reduce([median_ms(ctx, step, args.warmup, args.iters,
                                     before=lambda: clear_grads(layer, x))], "max")[0]
    layer_flops = 18.0 * T * K * H * F_  # expert GEMMs, forward + backward, per rank
    layer_tflops = layer_flops / (layer_ms * 1e-3) / 1e12
    add("layer_fwd_bwd_time", layer_ms, "ms", timing="max over ranks of median of "
        f"{args.iters} after {args.warmup} warm-up")
    add("layer_fwd_bwd_tflops", layer_tflops, "TFLOP/s per GPU",
        flops="18*T*K*H*F per rank (expert GEMMs only)")

    # (d) Stage breakdown.
    stages = stage_breakdown(layer, x, dy, ctx, warmup=2, iters=max(args.iters // 2, 3))
    names = list(stages)
    stage_max = ctx.reduce([stages[n] for n in names], "max")
    for n, v in zip(names, stage_max):
        add(f"stage_{n}_time", v, "ms", timing="max over ranks of median per stage")
    clear_grads(layer, x)

    # (b) torch._grouped_mm alone with the routed counts this rank received.
    keep = {}
    with torch.no_grad():
        moe_forward(layer, x, ctx, keep=keep)
        w1_t, w2_t = layer.w1.transpose(-2, -1), layer.w2.transpose(-2, -1)
        rows = keep["h"].shape[0]
        fc1_ms = median_ms(ctx, lambda: grouped_mm(keep["h"], w1_t, keep["offs"], keep["counts"]),
                           args.warmup, args.iters)
        fc2_ms = median_ms(ctx, lambda: grouped_mm(keep["act"], w2_t, keep["offs"], keep["counts"]),
                           args.warmup, args.iters)
    gmm1 = 2.0 * rows * H * 2 * F_ / (fc1_ms * 1e-3) / 1e12
    gmm2 = 2.0 * rows * F_ * H / (fc2_ms * 1e-3) / 1e12
    max_per_expert = max(keep["counts"])
    gmm_mean = ctx.reduce([gmm1, gmm2, rows], "mean")
    gmm_min = ctx.reduce([gmm1, gmm2, -rows, -max_per_expert], "min")
    imbalance = -gmm_min[3] / (W * T * K / E)  # busiest expert over the mean tokens per expert
    add("grouped_mm_fc1_tflops", gmm_mean[0], "TFLOP/s per GPU", min_over_ranks=gmm_min[0],
        impl=GROUPED_MM_IMPL, rows_mean=gmm_mean[2], rows_max=-gmm_min[2], expert_load_max_over_mean=imbalance)
    add("grouped_mm_fc2_tflops", gmm_mean[1], "TFLOP/s per GPU", min_over_ranks=gmm_min[1],
        impl=GROUPED_MM_IMPL, rows_mean=gmm_mean[2], rows_max=-gmm_min[2], expert_load_max_over_mean=imbalance)
    del keep

    # (a) Dense GEMMs of the same per-rank shapes: the ceiling for the grouped GEMM.
    with torch.no_grad():
        a1, b1 = rand_bf16(gen, ctx, T * K, H), rand_bf16(gen, ctx, 2 * F_, H)
        dense1_ms = ctx.reduce([median_ms(ctx, lambda: torch.matmul(a1, b1.t()), args.warmup, args.iters)],
                               "max")[0]
        del a1, b1
        a2, b2 = rand_bf16(gen, ctx, T * K, F_), rand_bf16(gen, ctx, H, F_)
        dense2_ms = ctx.reduce([median_ms(ctx, lambda: torch.matmul(a2, b2.t()), args.warmup, args.iters)],
                               "max")[0]
        del a2, b2
    dense1 = 2.0 * T * K * H * 2 * F_ / (dense1_ms * 1e-3) / 1e12
    dense2 = 2.0 * T * K * F_ * H / (dense2_ms * 1e-3) / 1e12
    add("dense_fc1_tflops", dense1, "TFLOP/s per GPU", shape=f"[{T * K},{H}] x [{H},{2 * F_}]")
    add("dense_fc2_tflops", dense2, "TFLOP/s per GPU", shape=f"[{T * K},{F_}] x [{F_},{H}]")
    add("layer_vs_dense_fc1", layer_tflops / dense1, "ratio")

    # (c) Raw all-to-all of the dispatch volume (T*K*H bf16 per rank, even splits).
    send = rand_bf16(gen, ctx, T * K, H)
    recv = torch.empty_like(send)
    a2a_ms = ctx.reduce([median_ms(ctx, lambda: dist.all_to_all_single(recv, send),
                                   args.warmup, args.iters)], "max")[0]
    a2a_bytes = send.numel() * send.element_size()
    algbw = a2a_bytes / (a2a_ms * 1e-3) / 1e9
    add("a2a_algbw", algbw, "GB/s", bytes_per_rank=a2a_bytes, time_ms=a2a_ms,
        busbw=algbw * (W - 1) / W)
    del send, recv

    row = dict(preset=name, layer_ms=layer_ms, layer_tflops=layer_tflops, gmm1=gmm_mean[0],
               gmm2=gmm_mean[1], dense1=dense1, dense2=dense2, algbw=algbw,
               check=("ok" if check_ok else "FAILED") + f" {check[0]:.1e}",
               stages=dict(zip(names, stage_max)))
    del layer, x, dy
    return results, row


def git_revision(args):
    """The git revision of the checkout (with -dirty when it has changes), or "unknown"."""
    if args.git:
        return args.git
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                             text=True, timeout=10)
        if rev.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10)
        return rev.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def nccl_version():
    """NCCL version PyTorch was built with, as text."""
    try:
        v = torch.cuda.nccl.version()
        return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:  # the version is only informative
        return "unknown"


def print_row(row):
    """One line of the table on rank 0, and the stage breakdown below it."""
    print(f"{row['preset']:<16} {row['layer_ms']:9.2f} {row['layer_tflops']:9.1f} {row['gmm1']:9.1f} "
          f"{row['gmm2']:9.1f} {row['dense1']:9.1f} {row['dense2']:9.1f} {row['algbw']:9.1f}  {row['check']}")
    print("    stages ms: " + ", ".join(f"{n} {v:.2f}" for n, v in row["stages"].items()), flush=True)


def parse_args():
    """Command line."""
    p = argparse.ArgumentParser(description="Plain PyTorch EP MoE layer baseline (run under torchrun).")
    p.add_argument("--preset", default="all", help="one of %s, or all" % ", ".join(PRESETS))
    p.add_argument("--out", default=None, help="JSON results file (written by rank 0)")
    p.add_argument("--machine", default="nvidia-h200-x4", help="machine kind recorded in the JSON")
    p.add_argument("--git", default=None, help="git revision to record (default: git rev-parse HEAD)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--cpu", action="store_true", help="gloo on CPU, to check the logic without GPUs")
    p.add_argument("--experts-per-rank", type=int, default=0,
                   help="experts per rank (default: the preset's E over all ranks), e.g. EP4's per-GPU shape on 2 GPUs")
    p.add_argument("--shrink", type=int, default=1,
                   help="divide H, F and T by this (for --cpu checks; results are not comparable)")
    args = p.parse_args()
    if args.preset != "all" and args.preset not in PRESETS:
        p.error(f"unknown preset {args.preset!r}; expected one of {', '.join(PRESETS)} or all")
    if args.shrink < 1 or args.warmup < 0 or args.iters < 1:
        p.error("--shrink and --iters must be >= 1, --warmup >= 0")
    return args


def main():
    """Set up the process group, run the presets, print the table, write the JSON."""
    global GROUPED_MM_IMPL
    args = parse_args()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # lets a lone `python3 torch_baseline.py` run
    os.environ.setdefault("MASTER_PORT", "29533")

    if args.cpu:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=300))
    else:
        if not torch.cuda.is_available():
            fail("no CUDA device is usable (torch.cuda.is_available() is False); "
                 "use --cpu to check the logic with gloo")
        visible = torch.cuda.device_count()
        if visible < local_world:
            fail(f"{local_world} processes per node were launched (--nproc-per-node) but only {visible} "
                 f"GPU(s) are visible; launch with --nproc-per-node {visible} or on a machine with "
                 f"{local_world} GPUs")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device,
                                timeout=datetime.timedelta(seconds=180))
    ctx = Ctx(rank, world, device, use_cuda=not args.cpu)

    names = list(PRESETS) if args.preset == "all" else [args.preset]
    presets = {}
    for n in names:
        cfg = dict(PRESETS[n])
        for key in ("H", "F", "T"):
            cfg[key] = max(cfg[key] // args.shrink // 8 * 8, 8)  # keep rows 16-byte aligned
        if args.experts_per_rank:  # e.g. EP4's per-GPU shape on 2 GPUs
            cfg["E"] = args.experts_per_rank * world
        if cfg["E"] % world != 0 or (cfg["T"] * cfg["K"]) % world != 0:
            fail(f"preset {n}: E={cfg['E']} experts and T*K={cfg['T'] * cfg['K']} must divide by "
                 f"the {world} ranks")
        presets[n] = cfg

    GROUPED_MM_IMPL, why = probe_grouped_mm(device)
    if rank == 0:
        dev_name = torch.cuda.get_device_name(device) if ctx.use_cuda else "cpu"
        print(f"torch {torch.__version__}, {world} ranks on {dev_name}, expert GEMMs: {GROUPED_MM_IMPL}"
              + (f" ({why})" if why else ""), flush=True)
        if args.shrink > 1:
            print(f"note: shapes divided by {args.shrink} (--shrink): not the preset sizes", flush=True)
        print(f"{'preset':<16} {'layer ms':>9} {'TF/s/GPU':>9} {'gmm1 TF':>9} {'gmm2 TF':>9} "
              f"{'dense1 TF':>9} {'dense2 TF':>9} {'a2a GB/s':>9}  check", flush=True)

    all_results, rows = [], []
    for n in names:
        results, row = run_preset(n, presets[n], ctx, args)
        all_results += results
        rows.append(row)
        if rank == 0:
            print_row(row)
        gc.collect()
        if ctx.use_cuda:
            torch.cuda.empty_cache()

    if rank == 0:
        print("layer = fwd+bwd ms (max over ranks of medians) and 18*T*K*H*F / time; gmm = torch._grouped_mm "
              "alone, routed counts (mean over ranks); dense = torch.matmul of the per-rank fc1/fc2 shape; "
              "a2a = all_to_all_single of T*K*H bf16 per rank, algbw", flush=True)
        if not all(r["check"].startswith("ok") for r in rows):
            print("WARNING: a correctness check FAILED: the timings above are of a wrong layer", flush=True)
        report = dict(
            command=f"torchrun --nproc-per-node {local_world} " + " ".join(sys.argv),
            machine=args.machine, gpus=world, git=git_revision(args),
            date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            torch=torch.__version__, cuda=torch.version.cuda,
            device=torch.cuda.get_device_name(device) if ctx.use_cuda else "cpu",
            nccl=nccl_version() if ctx.use_cuda else None,
            grouped_mm=GROUPED_MM_IMPL, grouped_mm_note=why, shrink=args.shrink,
            nccl_nvls_enable=os.environ["NCCL_NVLS_ENABLE"], results=all_results)
        if args.out:
            out_dir = os.path.dirname(os.path.abspath(args.out))
            os.makedirs(out_dir, exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
                f.write("\n")
            print(f"wrote {args.out}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
