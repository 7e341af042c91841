#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""DeepEP's intranode dispatch and combine (the public deepseek-ai/DeepEP, built by bench/deepep_peer_build.sh,
through its Python API only), with the token permutation by local expert that a Megatron Core layer runs after
DeepEP's dispatch, timed on every GPU of one host: the peer side of bench/deepep_peer_gpu.sh.

One process per GPU (torchrun), NCCL. Default shape: DeepSeek-V3's layer, 4096 tokens per rank, hidden 7168, top-8
of 256 experts over the EP ranks; routing uniform: each token's top-k is a uniformly random set of distinct experts
(the k largest of iid uniform scores, seeded per rank), weights random positive, x random bf16 (never zeros).
DeepEP runs with Buffer.set_num_sms(SMS) and its recommended configs for the rank count (what Megatron's
`fused_a2a` does), its buffer sized by their hints, async_finish off (its kernels on its stream, the current stream
waiting for them).

What is timed (CUDA events on the current stream, bracketing the Python calls as a layer makes them):
  layout                       Buffer.get_dispatch_layout
  dispatch                     Buffer.dispatch with the layout and the top-k (notify, the host's wait for the
                               receive counts, the copy): what a Megatron step runs after its layout
  dispatch_cached              Buffer.dispatch reusing the handle (the copy kernel alone: DeepEP's own tests'
                               figure; no top-k moves)
  permute                      Megatron's permute of the received tokens without TransformerEngine: the
                               [tokens, local experts] routing map and probs from the received top-k (-1: not
                               here), then the map's columns flattened and sorted (stable) to list each local
                               expert's tokens in token order, the rows gathered in that order, the probs with them
  permute_floor                the row gather alone with those indices: a lower bound of any permute (TE's fused one)
  dispatch_cached+permute      the two back to back in one bracket  <- the figure moert's whole call is held to
  layout+dispatch+permute      a Megatron step's dispatch side in one bracket
  combine                      Buffer.combine (bf16, no weights: Megatron applies the probs in the experts)
  unpermute                    Megatron's unpermute without probs: expert rows scatter-added back to the received
                               tokens (bf16)
  unpermute+combine            the two back to back in one bracket
  FP8: dispatch, dispatch_cached, permute (E4M3 rows and their 1x128 fp32 scales gathered alike),
       dispatch_cached+permute, layout+dispatch+permute; x cast per token and 128-wide block (scale = amax / 448)
Each: WARMUP untimed then ITERS timed calls, every call after a device sync and a barrier of all ranks. Per item:
each rank's median, the largest of those, and the median over calls of the slowest rank's time (the method of
moert's bench/dispatch_bench and bench/hybridep_bench: the figure compared).

Checks before timing (exit 1 when one fails): the received counts per local expert equal the routing map's; the
permuted rows of each local expert are exactly its tokens; combine(unpermute(permute(recv_x))) equals K * x (each
token's K experts are distinct, so its K copies come back summed); FP8's received rows, dequantized, match the bf16
ones in the same order.

  torchrun --nproc-per-node N bench/deepep_peer.py [--tokens 4096 --hidden 7168 --topk 8 --experts 256 --sms 24
      --warmup 5 --iters 50 --seed 1234 --out FILE --machine NAME --git REV]
  python3 bench/deepep_peer.py --selftest      (no GPU, no DeepEP: the permute/unpermute against a plain loop)
Needs deep_ep on PYTHONPATH (bench/deepep_peer_build.sh's tarball, unpacked). Rank 0 prints a table, then writes
the JSON to --out, or prints it when --out is not given.
"""
import argparse
import datetime
import json
import os
import statistics
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank (4096)")
    p.add_argument("--hidden", type=int, default=7168, help="hidden size (7168)")
    p.add_argument("--topk", type=int, default=8, help="experts per token (8)")
    p.add_argument("--experts", type=int, default=256, help="experts over all ranks (256)")
    p.add_argument("--sms", type=int, default=24, help="DeepEP's SMs, Buffer.set_num_sms (24; even)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--nvl-chunk-dispatch", type=int, default=None,
                   help="DeepEP dispatch config's NVL send chunk (default: Buffer.get_dispatch_config's)")
    p.add_argument("--nvl-chunk-combine", type=int, default=None,
                   help="DeepEP combine config's NVL send chunk (default: Buffer.get_combine_config's)")
    p.add_argument("--no-fp8", action="store_true", help="skip the FP8 dispatch")
    p.add_argument("--out", default=None, help="JSON file (rank 0); default: rank 0's stdout, after the table")
    p.add_argument("--machine", default=os.environ.get("MOERT_BENCH_MACHINE", "unknown"))
    p.add_argument("--git", default=os.environ.get("MOERT_BENCH_GIT", "unknown"))
    p.add_argument("--selftest", action="store_true", help="check the permute/unpermute on the CPU and exit")
    return p.parse_args(argv)


# ---- the Megatron-side token permutation, plain torch (no TransformerEngine) ----

def routing_map_from_topk(torch, recv_idx, recv_w, local_experts):
    """[n, k] local expert ids (-1: an expert of another rank) and their weights -> [n, local_experts] bool map and
    fp32 probs, as Megatron's DeepEP manager builds them after the dispatch."""
    n = recv_idx.shape[0]
    here = recv_idx >= 0
    rows = torch.arange(n, device=recv_idx.device).unsqueeze(1).expand_as(recv_idx)[here]
    cols = recv_idx[here]
    rmap = torch.zeros((n, local_experts), dtype=torch.bool, device=recv_idx.device)
    rmap[rows, cols] = True
    probs = torch.zeros((n, local_experts), dtype=torch.float32, device=recv_idx.device)
    probs[rows, cols] = recv_w[here].float()
    return rmap, probs


def expert_order(torch, rmap, num_out):
    """Megatron's argsort permute: the map's columns (experts) flattened one after another; a stable descending sort
    of the flags puts each expert's tokens first, in expert then token order. Returns the flat positions taken (for
    the probs) and the source token of each output row."""
    flat = rmap.t().contiguous().view(-1)
    taken = flat.argsort(descending=True, stable=True)[:num_out]
    return taken, taken % rmap.shape[0]


def gather_rows(torch, x, src):
    """x's rows in src order; x is a bf16 tensor or an (E4M3 rows, fp32 scales) pair."""
    if isinstance(x, tuple):
        q, scales = x
        return q.view(torch.uint8).index_select(0, src).view(q.dtype), scales.index_select(0, src)
    return x.index_select(0, src)


def megatron_permute(torch, recv_x, recv_idx, recv_w, local_experts, num_out):
    """The whole permute after DeepEP's dispatch: map, order, rows, probs. Returns (rows, probs, src)."""
    rmap, probs = routing_map_from_topk(torch, recv_idx, recv_w, local_experts)
    taken, src = expert_order(torch, rmap, num_out)
    rows = gather_rows(torch, recv_x, src)
    return rows, probs.t().contiguous().view(-1)[taken], src


def megatron_unpermute(torch, expert_rows, src, num_tokens):
    """Megatron's unpermute without probs: each expert row added back onto its received token."""
    out = torch.zeros((num_tokens, expert_rows.shape[1]), dtype=expert_rows.dtype, device=expert_rows.device)
    out.scatter_add_(0, src.unsqueeze(1).expand(-1, expert_rows.shape[1]), expert_rows)
    return out


def fp8_blocks(torch, x):
    """x [t, h] -> (E4M3 [t, h], fp32 scales [t, h/128]) with x ~= rows * scale per 128-wide block."""
    t, h = x.shape
    blocks = x.float().view(t, h // 128, 128)
    scales = blocks.abs().amax(dim=2).clamp(min=1e-4) / 448.0
    return (blocks / scales.unsqueeze(2)).to(torch.float8_e4m3fn).view(t, h), scales


def fp8_back(torch, q, scales):
    t, h = q.shape
    return (q.float().view(t, h // 128, 128) * scales.unsqueeze(2)).view(t, h)


def selftest():
    """The permute and unpermute above against a plain loop, on the CPU (any torch with argsort(stable=True))."""
    import torch
    g = torch.Generator().manual_seed(7)
    n, k, el, h = 37, 4, 6, 8
    idx = torch.randint(-1, el, (n, k), generator=g)
    for t in range(n):  # distinct local experts per token, -1 allowed repeatedly
        seen = set()
        for j in range(k):
            if int(idx[t, j]) in seen:
                idx[t, j] = -1
            seen.add(int(idx[t, j]))
    w = torch.rand((n, k), generator=g)
    x = torch.randn((n, h), generator=g)
    num_out = int((idx >= 0).sum())
    rows, probs, src = megatron_permute(torch, x, idx, w, el, num_out)
    want_src, want_p = [], []
    for e in range(el):
        for t in range(n):
            for j in range(k):
                if int(idx[t, j]) == e:
                    want_src.append(t)
                    want_p.append(float(w[t, j]))
    assert src.tolist() == want_src, (src.tolist(), want_src)
    assert torch.allclose(probs, torch.tensor(want_p)), "probs out of order"
    assert torch.equal(rows, x[want_src]), "rows out of order"
    back = megatron_unpermute(torch, rows, src, n)
    want = torch.stack([x[t] * int(((idx[t] >= 0)).sum()) for t in range(n)])
    assert torch.allclose(back, want, atol=1e-5), "unpermute"
    if hasattr(torch, "float8_e4m3fn"):
        q, s = fp8_blocks(torch, torch.randn((5, 256), generator=g))
        qr, sr = gather_rows(torch, (q, s), torch.tensor([3, 0, 3]))
        assert torch.equal(qr.view(torch.uint8), q.view(torch.uint8)[[3, 0, 3]]) and torch.equal(sr, s[[3, 0, 3]])
    print("deepep_peer.py selftest: permute / unpermute / fp8 gather agree with the plain loop (%d rows)" % num_out)
    return 0


# ---- the run on GPUs ----

def main(args):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast on shared hosts
    import torch
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=dev)
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    try:
        import deep_ep
    except ImportError as e:
        sys.exit("deepep_peer.py: cannot import deep_ep (%s): put the unpacked deepep-build.tgz of "
                 "bench/deepep_peer_build.sh on PYTHONPATH" % e)
    T, H, K, E = args.tokens, args.hidden, args.topk, args.experts
    if E % world or H % 128 or args.sms % 2:
        sys.exit("deepep_peer.py: experts %% ranks, hidden %% 128 and sms %% 2 must be 0 (E %d, ranks %d, H %d, sms %d)"
                 % (E, world, H, args.sms))
    El = E // world
    say = print if rank == 0 else (lambda *a, **k: None)

    # routing and inputs, seeded per rank
    gen = torch.Generator(device=dev)
    gen.manual_seed(args.seed + 7919 * rank)
    topk_idx = torch.rand((T, E), generator=gen, device=dev).topk(K, dim=1).indices
    topk_idx = topk_idx.to(getattr(deep_ep, "topk_idx_t", torch.int64))
    topk_w = torch.rand((T, K), generator=gen, device=dev) + 0.05
    topk_w = topk_w / topk_w.sum(dim=1, keepdim=True)
    x = torch.randn((T, H), generator=gen, device=dev, dtype=torch.bfloat16)
    x_fp8 = None if args.no_fp8 else fp8_blocks(torch, x)

    # DeepEP's buffer, as Megatron sizes it
    Buffer = deep_ep.Buffer
    Buffer.set_num_sms(args.sms)
    dcfg = Buffer.get_dispatch_config(world) if args.nvl_chunk_dispatch is None else \
        deep_ep.Config(args.sms, args.nvl_chunk_dispatch, 256)
    ccfg = Buffer.get_combine_config(world) if args.nvl_chunk_combine is None else \
        deep_ep.Config(args.sms, args.nvl_chunk_combine, 256)
    nvl_bytes = max(c.get_nvl_buffer_size_hint(H * 2, world) for c in (dcfg, ccfg))
    buf = Buffer(group, nvl_bytes, 0, low_latency_mode=False, explicitly_destroy=True)
    say("deepep_peer.py: EP%d on %s, T %d, H %d, top-%d of %d, %d SMs, NVL buffer %.0f MB, deep_ep from %s"
        % (world, torch.cuda.get_device_name(dev), T, H, K, E, args.sms, nvl_bytes / 1e6, deep_ep.__file__))

    def layout():
        n_rank, _, n_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, E)
        return n_rank, n_expert, in_rank

    lay = layout()

    def dispatch(xin, lay=lay):
        n_rank, n_expert, in_rank = lay
        return buf.dispatch(xin, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank, num_tokens_per_expert=n_expert,
                            topk_idx=topk_idx, topk_weights=topk_w, config=dcfg)

    recv_x, recv_idx, recv_w, counts, handle, _ = dispatch(x)
    num_out = int(sum(counts))

    def dispatch_cached(xin):
        return buf.dispatch(xin, handle=handle, config=dcfg)[0]

    def permute(rx):
        return megatron_permute(torch, rx, recv_idx, recv_w, El, num_out)

    # checks
    checks, failed = {}, []
    rmap, _ = routing_map_from_topk(torch, recv_idx, recv_w, El)
    per_expert = rmap.sum(dim=0).tolist()
    checks["counts_match_routing_map"] = per_expert == list(counts) and len(counts) == El
    rows, _, src = permute(recv_x)
    expert_of_row = torch.repeat_interleave(torch.arange(El, device=dev), torch.tensor(counts, device=dev))
    hit = (recv_idx[src] == expert_of_row.unsqueeze(1).to(recv_idx.dtype)).any(dim=1)
    checks["permuted_rows_hold_their_expert"] = bool(hit.all()) and int(rows.shape[0]) == num_out
    back, _, _ = buf.combine(megatron_unpermute(torch, rows, src, recv_x.shape[0]), handle=handle, config=ccfg)
    want = x.float() * K
    err = float((back.float() - want).norm() / want.norm())
    checks["combine_unpermute_permute_rel_error_vs_K_x"] = err
    if err > 2e-2:
        failed.append("combine(unpermute(permute(recv_x))) is %.3g from K * x" % err)
    if x_fp8 is not None:
        rq = dispatch(x_fp8)[0]
        ferr = float((fp8_back(torch, *rq) - recv_x.float()).norm() / recv_x.float().norm())
        checks["fp8_recv_rel_error_vs_bf16_recv"] = ferr
        if ferr > 0.1:
            failed.append("FP8 received rows are %.3g from the bf16 ones" % ferr)
    for name in ("counts_match_routing_map", "permuted_rows_hold_their_expert"):
        if not checks[name]:
            failed.append(name)
    any_failed = torch.tensor([len(failed)], device=dev)
    dist.all_reduce(any_failed)
    if int(any_failed):
        print("rank %d: checks failed: %s" % (rank, failed or "on another rank"), file=sys.stderr, flush=True)
        sys.exit(1)
    say("checks passed: %s" % json.dumps(checks))

    # sizes per rank (gathered)
    others = [r for r in range(world) if r != rank]
    tokens_out = int(lay[2][:, others].sum()) if others else 0
    sizes = torch.tensor([recv_x.shape[0], num_out, tokens_out], device=dev, dtype=torch.int64)
    all_sizes = [torch.zeros_like(sizes) for _ in range(world)]
    dist.all_gather(all_sizes, sizes)
    all_sizes = [s.tolist() for s in all_sizes]

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def timed(fn):
        ts = []
        for i in range(args.warmup + args.iters):
            torch.cuda.synchronize()
            dist.barrier(device_ids=[local_rank])
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            end.synchronize()
            if i >= args.warmup:
                ts.append(start.elapsed_time(end) * 1e3)
        mine = torch.tensor(ts, device=dev, dtype=torch.float64)
        every = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)
        every = [e.tolist() for e in every]
        per_rank = [statistics.median(e) for e in every]
        slowest = [max(e[i] for e in every) for i in range(args.iters)]
        return {"median_of_slowest_rank_us": statistics.median(slowest), "max_rank_median_us": max(per_rank),
                "rank_median_us": per_rank, "min_of_slowest_us": min(slowest)}

    items = []  # (name, fn, dtype, bytes per rank max or None)
    row_b = H * 2
    fp8_row_b = H + (H // 128) * 4
    out_max = max(s[2] for s in all_sizes)
    unperm_in = rows  # the expert rows (identity experts) for unpermute and combine

    items.append(("layout", layout, "-", None))
    items.append(("dispatch", lambda: dispatch(x), "bf16", out_max * row_b))
    items.append(("dispatch_cached", lambda: dispatch_cached(x), "bf16", out_max * row_b))
    items.append(("permute", lambda: permute(recv_x), "bf16", None))
    items.append(("permute_floor", lambda: gather_rows(torch, recv_x, src), "bf16", None))
    items.append(("dispatch_cached+permute", lambda: permute(dispatch_cached(x)), "bf16", out_max * row_b))

    def megatron_dispatch_side(xin):
        cur = layout()
        r = dispatch(xin, cur)
        return megatron_permute(torch, r[0], r[1], r[2], El, int(sum(r[3])))

    items.append(("layout+dispatch+permute", lambda: megatron_dispatch_side(x), "bf16", out_max * row_b))
    items.append(("combine", lambda: buf.combine(recv_x, handle=handle, config=ccfg), "bf16", out_max * row_b))
    items.append(("unpermute", lambda: megatron_unpermute(torch, unperm_in, src, recv_x.shape[0]), "bf16", None))
    items.append(("unpermute+combine",
                  lambda: buf.combine(megatron_unpermute(torch, unperm_in, src, recv_x.shape[0]), handle=handle,
                                      config=ccfg), "bf16", out_max * row_b))
    if x_fp8 is not None:
        recv_fp8 = dispatch_cached(x_fp8)
        items.append(("dispatch", lambda: dispatch(x_fp8), "fp8", out_max * fp8_row_b))
        items.append(("dispatch_cached", lambda: dispatch_cached(x_fp8), "fp8", out_max * fp8_row_b))
        items.append(("permute", lambda: permute(recv_fp8), "fp8", None))
        items.append(("permute_floor", lambda: gather_rows(torch, recv_fp8, src), "fp8", None))
        items.append(("dispatch_cached+permute", lambda: permute(dispatch_cached(x_fp8)), "fp8",
                      out_max * fp8_row_b))
        items.append(("layout+dispatch+permute", lambda: megatron_dispatch_side(x_fp8), "fp8", out_max * fp8_row_b))

    results = []
    t0 = time.time()
    for name, fn, dtype, nbytes in items:
        r = timed(fn)
        row = {"name": "deepep %s %s" % (name, dtype) if dtype != "-" else "deepep %s" % name,
               "item": name, "dtype": dtype, "value": round(r["median_of_slowest_rank_us"], 2), "unit": "us"}
        row.update({k: (round(v, 2) if isinstance(v, float) else [round(u, 2) for u in v]) for k, v in r.items()})
        if nbytes:
            row["bytes_out_max_rank"] = nbytes
            row["gbs"] = round(nbytes / (r["median_of_slowest_rank_us"] * 1e3), 1)
        results.append(row)
        say("  %-32s %10.1f us  (slowest rank's median %.1f)%s" % (
            row["name"], row["value"], row["max_rank_median_us"], "  %.1f GB/s" % row["gbs"] if nbytes else ""))
    say("timed %d items in %.1f s" % (len(items), time.time() - t0))

    if rank == 0:
        try:
            nccl_version = ".".join(map(str, torch.cuda.nccl.version()))
        except (AttributeError, RuntimeError, TypeError):
            nccl_version = "unknown"
        doc = {
            "what": "DeepEP intranode dispatch/combine (public source, no NVSHMEM) with Megatron's permute "
                    "(plain torch, no TransformerEngine) after it; see bench/deepep_peer.py's docstring",
            "command": "torchrun --nproc-per-node %d bench/deepep_peer.py %s" % (world, " ".join(sys.argv[1:])),
            "machine": args.machine, "gpus": world, "device": torch.cuda.get_device_name(dev), "git": args.git,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "torch": torch.__version__, "nccl": nccl_version,
            "deep_ep_path": os.path.dirname(deep_ep.__file__),
            "shape": {"tokens_per_rank": T, "hidden": H, "topk": K, "experts": E, "local_experts": El,
                      "routing": "uniform (top-k of iid uniform scores, seed %d + 7919 * rank)" % args.seed},
            "deepep_config": {"num_sms": args.sms, "nvl_buffer_bytes": nvl_bytes,
                              "dispatch": "Buffer.get_dispatch_config(%d)" % world if args.nvl_chunk_dispatch is None
                              else "Config(%d, %d, 256)" % (args.sms, args.nvl_chunk_dispatch),
                              "combine": "Buffer.get_combine_config(%d)" % world if args.nvl_chunk_combine is None
                              else "Config(%d, %d, 256)" % (args.sms, args.nvl_chunk_combine)},
            "timing": "CUDA events on the current stream around each call, after a device sync and a barrier of all "
                      "ranks; %d warm-up, %d timed; value: the median over calls of the slowest rank's time"
                      % (args.warmup, args.iters),
            "per_rank": {"recv_tokens": [s[0] for s in all_sizes], "permuted_rows": [s[1] for s in all_sizes],
                         "tokens_sent_to_other_ranks": [s[2] for s in all_sizes]},
            "check": checks,
            "results": results,
        }
        text = json.dumps(doc, indent=1)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
            print("wrote %s" % args.out)
        else:
            print(text)
    buf.destroy()
    dist.barrier(device_ids=[local_rank])
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    a = parse_args()
    sys.exit(selftest() if a.selftest else main(a))
