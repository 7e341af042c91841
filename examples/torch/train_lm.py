#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""A small byte-level Transformer language model whose feed-forward layers are moert MoE layers, trained on the
license texts every Debian system ships (/usr/share/common-licenses).

    python3 examples/torch/train_lm.py                       # CPU, one process
    python3 examples/torch/train_lm.py --moe torch           # the same model with a pure-PyTorch MoE (A/B)
    torchrun --nproc_per_node=4 examples/torch/train_lm.py   # 4 ranks: experts split over them (GPUs with NCCL
                                                             # when present, else CPU processes with gloo)
    python3 examples/torch/train_lm.py --nproc 4             # 4 CPU processes (gloo) started by the script

Attention, norms and embeddings are PyTorch's; each block's feed-forward is moert.torch.MoE (or
moert.reference.MoE with --moe torch: the same parameters, the same math in torch ops), so from the same initial
weights both give the same loss curve. With R ranks the experts are split over them (expert parallelism) and
the data too (each rank trains on its slice of the global batch); every other parameter, the router weight
included, is replicated and its gradient summed over ranks.
"""
import argparse
import copy
import glob
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

_HERE = os.path.dirname(os.path.abspath(__file__))
_PY = os.path.join(os.path.dirname(os.path.dirname(_HERE)), "python")
try:
    import moert
except ImportError:  # running from a checkout: the package's sources are in python/
    sys.path.insert(0, _PY)
    import moert
import moert.reference  # noqa: E402
import moert.torch  # noqa: E402

TEXT_GLOBS = ["/usr/share/common-licenses/*"]


def load_text(globs=None):
    """The bytes of every file matching globs (sorted, concatenated): real English text."""
    data = bytearray()
    for g in globs or TEXT_GLOBS:
        for path in sorted(glob.glob(g)):
            if os.path.isfile(path):
                with open(path, "rb") as f:
                    data += f.read()
    if len(data) < 10000:
        raise SystemExit("train_lm: no text found under %s" % (globs or TEXT_GLOBS))
    return torch.frombuffer(data, dtype=torch.uint8).long()


def moe_config(args, tokens_per_rank):
    """The MoE layers' config: a dict (--config FILE replaces it; --set KEY=VALUE edits it)."""
    if args.config:
        with open(args.config) as f:
            cfg = json.load(f)
    else:
        cfg = {
            "name": "train_lm",
            "model": {"hidden": args.d_model, "ffn_hidden": args.ffn_hidden, "num_experts": args.experts,
                      "topk": args.topk, "dtype": args.dtype},
            "router": {"plugin": "topk", "score_function": "sigmoid", "expert_bias": True, "bias_update_rate": 1e-3,
                       "load_balancing": "aux_loss", "aux_loss_coeff": 1e-2, "z_loss_coeff": 1e-4},
            "dispatcher": {"plugin": "alltoall"},
            "precision": {"plugin": "bf16", "mode": "auto"},
            "memory_policy": {"plugin": "default"},
        }
    cfg.setdefault("train", {})["tokens_per_rank"] = tokens_per_rank
    for kv in args.set or []:
        key, _, value = kv.partition("=")
        try:
            value = json.loads(value)
        except ValueError:
            pass
        d = cfg
        parts = key.split(".")
        for p in parts[:-1]:
            d = d.setdefault(p, {})
        d[parts[-1]] = value
    return cfg


class Block(nn.Module):
    def __init__(self, d_model, heads, moe, dtype):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model, dtype=dtype)
        self.attn = nn.MultiheadAttention(d_model, heads, batch_first=True, dtype=dtype)
        self.ln2 = nn.LayerNorm(d_model, dtype=dtype)
        self.moe = moe

    def forward(self, x, mask):
        h = self.ln1(x)
        a, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False)
        x = x + a
        B, S, D = x.shape
        y, router_loss = self.moe(self.ln2(x).reshape(B * S, D))
        return x + y.view(B, S, D), router_loss


class LM(nn.Module):
    """Byte-level Transformer LM: embeddings, blocks of (attention, MoE feed-forward), a final norm and head."""

    def __init__(self, make_moe, layers, d_model, heads, seq, dtype):
        super().__init__()
        self.tok = nn.Embedding(256, d_model, dtype=dtype)
        self.pos = nn.Embedding(seq, d_model, dtype=dtype)
        self.blocks = nn.ModuleList([Block(d_model, heads, make_moe(i), dtype) for i in range(layers)])
        self.ln_f = nn.LayerNorm(d_model, dtype=dtype)
        self.head = nn.Linear(d_model, 256, bias=False, dtype=dtype)
        self.register_buffer("mask", torch.triu(torch.full((seq, seq), float("-inf"), dtype=dtype), 1),
                             persistent=False)

    def forward(self, idx):
        B, S = idx.shape
        x = self.tok(idx) + self.pos(torch.arange(S, device=idx.device))
        router_loss = x.new_zeros(())
        for b in self.blocks:
            x, rl = b(x, self.mask[:S, :S])
            router_loss = router_loss + rl.to(x.dtype)
        return self.head(self.ln_f(x)), router_loss


def expert_parameters(model):
    """The parameters each rank owns alone (moert's local experts): their gradients are not summed over ranks."""
    out = set()
    for m in moert.torch.moe_modules(model):
        out.add(id(m.fc1))
        out.add(id(m.fc2))
    return out


def build(args, device, process_group=None, rank=0, world=1):
    """The model (args.moe: 'moert' or 'torch') from args.seed: moert's modules hold this rank's experts."""
    dtype = {"fp32": torch.float32, "fp64": torch.float64}[args.dtype]
    cfg = moe_config(args, args.batch * args.seq)
    torch.manual_seed(args.seed)
    if args.moe == "moert":
        def make(i):
            return moert.torch.MoE(cfg, process_group, device=device, init_seed=args.seed * 1000 + i)
    else:
        def make(i):
            with torch.random.fork_rng(devices=[]):  # draw nothing from the stream the other layers draw from
                return moert.reference.MoE(cfg, device=device, process_group=process_group)
    model = LM(make, args.layers, args.d_model, args.heads, args.seq, dtype).to(device)
    if args.moe == "torch":
        # the same initial expert weights as moert's modules (moert_layers_init_params: the same for any split;
        # with several ranks each holds its experts' slice, gathered here)
        for i, b in enumerate(model.blocks):
            init = moert.torch.MoE(cfg, process_group, device=device, init_seed=args.seed * 1000 + i)
            with torch.no_grad():
                b.moe.router_weight.copy_(init.router_weight)
                for n in ("fc1", "fc2"):
                    part = getattr(init, n).detach().contiguous()
                    if world > 1:
                        parts = [torch.empty_like(part) for _ in range(world)]
                        dist.all_gather(parts, part, group=process_group)
                        part = torch.cat(parts)
                    getattr(b.moe, n).copy_(part)
            del init
    return model


def batches(data, args, step, rank, world, device):
    """The global batch of step (args.batch sequences per rank), this rank's slice: inputs and next-byte targets."""
    g = torch.Generator().manual_seed(args.seed * 100003 + step)
    starts = torch.randint(0, len(data) - args.seq - 1, (args.batch * world,), generator=g)[rank * args.batch:
                                                                                             (rank + 1) * args.batch]
    seqs = torch.stack([data[s:s + args.seq + 1] for s in starts.tolist()])
    return seqs[:, :-1].to(device), seqs[:, 1:].to(device)


def train(args, model=None, data=None, device=None, process_group=None, log=print, state=None):
    """Trains args.steps steps; returns a dict with the per-step losses (global means) and the figures."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    device = device or torch.device("cpu")
    data = load_text() if data is None else data
    model = model or build(args, device, process_group, rank, world)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    if state is not None:
        model.load_state_dict(state["model"])
        # torch 2.x's load_state_dict keeps the given moment tensors (1.13 copied them): copy, so the state given
        # stays as it was
        opt.load_state_dict(copy.deepcopy(state["optimizer"]))
    hook = moert.torch.attach_optimizer(opt, model) if args.moe == "moert" else None
    own = expert_parameters(model)
    moes = [b.moe for b in model.blocks]
    first = state["step"] if state is not None else 0
    losses, times, tokens = [], [], 0
    for step in range(first, first + args.steps):
        t0 = time.perf_counter()
        inp, tgt = batches(data, args, step, rank, world, device)
        logits, router_loss = model(inp)
        ce = F.cross_entropy(logits.reshape(-1, 256).float(), tgt.reshape(-1))
        loss = ce + router_loss.to(ce.dtype)
        opt.zero_grad(set_to_none=True)
        (loss / world).backward()
        if world > 1:
            for p in model.parameters():
                if p.grad is not None and id(p) not in own:
                    dist.all_reduce(p.grad)  # replicated parameters: this rank's share of the global gradient
        opt.step()  # moert modules: weights_changed() and update_expert_bias() through the optimizer hook
        if args.moe == "torch":
            for m in moes:
                m.update_expert_bias()
        figs = torch.stack([loss.detach().double(), ce.detach().double()])
        counts = torch.stack([m.last_tokens_per_expert.to(device) for m in moes]).double()
        if world > 1:
            dist.all_reduce(figs)
            figs /= world
            dist.all_reduce(counts)
        dt = time.perf_counter() - t0
        load = (counts.max(1).values / counts.mean(1)).mean().item()
        losses.append(figs[0].item())
        times.append(dt)
        tokens += inp.numel() * world
        if rank == 0 and (step % args.log_every == 0 or step == first + args.steps - 1):
            log("step %d/%d  loss %.6f (ce %.6f, router %.2e)  bits/byte %.3f  load max/mean %.3f  %.1f ms  %.0f tok/s"
                % (step + 1, first + args.steps, figs[0].item(), figs[1].item(), (figs[0] - figs[1]).item(),
                   figs[1].item() / math.log(2), load, dt * 1e3, inp.numel() * world / dt))
    if hook is not None:
        hook.remove()
    out = {"losses": losses, "step_ms": [t * 1e3 for t in times], "tokens": tokens, "model": model,
           "optimizer": opt, "step": first + args.steps}
    if rank == 0 and losses:
        med = sorted(times)[len(times) // 2]
        log("summary: %s MoE, %d rank(s) on %s, %d layers x %d experts (top-%d), %d steps, loss %.4f -> %.4f, "
            "median step %.1f ms, %.0f tokens/s" % (args.moe, world, device, args.layers, args.experts, args.topk,
                                                    len(losses), losses[0], losses[-1], med * 1e3,
                                                    tokens / sum(times)))
    return out


def parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--moe", choices=["moert", "torch"], default="moert", help="the feed-forward layers' MoE")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn-hidden", type=int, default=128)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--seq", type=int, default=64, help="bytes per sequence")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--dtype", choices=["fp32", "fp64"], default="fp32")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: GPUs when launched by torchrun on a machine with them, else the CPU")
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--config", help="a moert config for the MoE layers (model sizes must match)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="edit the MoE config (repeatable)")
    p.add_argument("--library", help="libmoert.so or a meson build dir (development trees)")
    p.add_argument("--save", help="write the model and optimizer state here at the end")
    p.add_argument("--load", help="start from a state written by --save")
    p.add_argument("--nproc", type=int, default=1,
                   help="CPU processes (gloo) started here, as torchrun --nproc_per_node would (its stand-in where "
                        "torchrun is unusable, e.g. Debian 12's torch 1.13 with Python 3.11)")
    return p


def _spawned(rank, args, init_file):
    """One of --nproc CPU processes (gloo): the environment torchrun would give it."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(args.nproc)})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=args.nproc)
    run(args)


def main(argv=None):
    args = parser().parse_args(argv)
    if args.nproc > 1:
        import tempfile
        import torch.multiprocessing as mp
        with tempfile.TemporaryDirectory() as d:
            mp.spawn(_spawned, args=(args, os.path.join(d, "init")), nprocs=args.nproc)
        return
    run(args)


def run(args):
    if args.library:
        moert.load_library(args.library)
    device = torch.device("cpu")
    launched = "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1
    use_cuda = args.device == "cuda" or (args.device == "auto" and launched and torch.cuda.is_available())
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if launched and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    state = torch.load(args.load, map_location=device) if args.load else None
    out = train(args, device=device, state=state)
    if args.save and (not dist.is_initialized() or dist.get_rank() == 0):
        torch.save({"model": out["model"].state_dict(), "optimizer": out["optimizer"].state_dict(),
                    "step": out["step"]}, args.save)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
