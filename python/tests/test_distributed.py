# SPDX-License-Identifier: Apache-2.0
"""moert.torch.MoE and Dispatcher on 2 and 4 CPU processes (torch.multiprocessing, gloo): moert's collectives go
through the process group (a moert_collectives table). Each rank's output and gradients equal the pure-PyTorch
reference's on the whole batch (every rank's tokens, every expert); the router weight's gradient summed over
ranks, the expert bias after updates from every rank's counts. Also a sub-group as the expert-parallel group."""
import unittest

import torch
import torch.distributed as dist

from common import (SIGMOID_BIAS, TOL, TORCH_DTYPE, assert_close, config, full_weights, inputs, load_weights, moert,
                    run_distributed)
from test_dispatcher import check_dispatch, combined_reference, routing


class _Checks(unittest.TestCase):
    """Assertions inside a worker process (not a test of its own)."""

    def close(self, got, want, tol, what):
        assert_close(self, got, want, tol, what)


def _TC():
    return _Checks()


def moe_worker(rank, world, dtype, router, steps, use_subgroup, shared=0):
    tc = _TC()
    cfg = config(dtype=dtype, router=router, tokens=24)
    SHARED = ("shared_fc1", "shared_fc2", "shared_gate")
    if shared:
        cfg["model"].update(shared_expert_ffn_hidden=shared, shared_expert_gate=True)
    tol = TOL[dtype]
    pg = None
    if use_subgroup:
        # two expert-parallel groups of world/2 ranks: {0, 2, ..}, {1, 3, ..}
        groups = [dist.new_group([r for r in range(world) if r % 2 == p]) for p in range(2)]
        pg = groups[rank % 2]
    m = moert.torch.MoE(cfg, pg)
    ep_rank, ep_world = (dist.get_rank(pg), dist.get_world_size(pg))
    tc.assertEqual((m.rank, m.world_size), (ep_rank, ep_world))
    tc.assertEqual(m.num_local_experts, 8 // ep_world)
    w = full_weights(cfg)
    load_weights(m, w)
    torch.manual_seed(5)  # the shared expert's weights: the same on every rank
    refs = [moert.reference.MoE(cfg) for _ in range(ep_world)]  # one per rank of the group: its tokens' losses
    for r in refs:
        load_weights(r, w)
        for n in SHARED:
            if hasattr(refs[0], n):
                with torch.no_grad():
                    getattr(r, n).copy_(getattr(refs[0], n))
                    getattr(m, n).copy_(getattr(refs[0], n))
        if r.expert_bias is not None:
            r.expert_bias = refs[0].expert_bias  # one bias, shared
    for step in range(steps):
        xs = [inputs(cfg, 24 - 3 * r, seed=100 * step + 10 * r + (rank % 2 if use_subgroup else 0))
              for r in range(ep_world)]
        x, gy = xs[ep_rank]
        xg = x.clone().requires_grad_()
        for p in m.parameters():
            p.grad = None
        y, rl = m(xg)
        ((y * gy).sum() + 0.5 * rl).backward()
        # the reference: each rank's tokens through its own copy (router losses are per rank), summed objective
        for r in refs:
            for p in r.parameters():
                p.grad = None
        outs = []
        for r, (xr, gr) in zip(refs, xs):
            xr = xr.clone().requires_grad_()
            yr, rlr = r(xr)
            ((yr * gr).sum() + 0.5 * rlr).backward()
            outs.append((yr, rlr, xr.grad))
        what = "rank %d/%d %s step %d" % (ep_rank, ep_world, dtype, step)
        tc.close(y, outs[ep_rank][0], tol, what + " y")
        tc.close(rl, outs[ep_rank][1], tol, what + " router loss")
        tc.close(xg.grad, outs[ep_rank][2], tol, what + " dx")
        gr = m.router_weight.grad.clone()
        dist.all_reduce(gr, group=pg)
        tc.close(gr, sum(r.router_weight.grad for r in refs), tol, what + " router grad summed over ranks")
        for n in SHARED:
            if hasattr(m, n):
                g = getattr(m, n).grad.clone()
                dist.all_reduce(g, group=pg)
                tc.close(g, sum(getattr(r, n).grad for r in refs), tol, what + " %s grad summed over ranks" % n)
        first, n = m.first_local_expert, m.num_local_experts
        for name in ("fc1", "fc2"):
            want = sum(getattr(r, name).grad for r in refs)[first:first + n]
            tc.close(getattr(m, name).grad, want, tol, what + " grad " + name)
        m.update_expert_bias()
        if refs[0].expert_bias is not None:
            counts = sum(r._counts for r in refs)
            for r in refs:
                r._counts.zero_()
            refs[0]._counts.copy_(counts)
            refs[0].update_expert_bias(reduce=False)  # counts already summed over the group's ranks
            tc.close(m.expert_bias, refs[0].expert_bias, 1e-9, what + " expert bias")


def dispatch_worker(rank, world, dtype, drop):
    tc = _TC()
    cfg = config(dtype=dtype, tokens=30)
    disp = moert.torch.Dispatcher(cfg)
    dt = TORCH_DTYPE[dtype]
    T, H, E, K = 30, 16, 8, 2
    xs, idxs, ws, gys = [], [], [], []
    for r in range(world):
        g = torch.Generator().manual_seed(40 + r)
        Tr = T - 2 * r
        xs.append(torch.randn(Tr, H, generator=g, dtype=torch.float64).to(dt))
        gys.append(torch.randn(Tr, H, generator=g, dtype=torch.float64).to(dt))
        i, w = routing(Tr, E, K, 70 + r, drop)
        idxs.append(i)
        ws.append(w)
    x_all, idx_all, w_all = torch.cat(xs), torch.cat(idxs), torch.cat(ws)
    tol = 1e-6 if dtype == "fp32" else 1e-13
    for rep in range(2):
        y, dx, dw = check_dispatch(tc, disp, xs[rank], idxs[rank], ws[rank], gys[rank], x_all, idx_all, w_all, tol,
                                   "rank %d/%d %s" % (rank, world, dtype))
        xr = xs[rank].clone().requires_grad_()
        wr = ws[rank].to(disp.param_dtype).clone().requires_grad_()
        yr = combined_reference(xr, idxs[rank], wr, E)
        (yr * gys[rank]).sum().backward()
        tc.close(y, yr, tol, "combine")
        tc.close(dx, xr.grad, tol, "dx")
        tc.close(dw, wr.grad, tol, "d topk_weights")


class Distributed(unittest.TestCase):
    def test_moe_2_ranks_fp32(self):
        run_distributed(2, moe_worker, "fp32", config()["router"], 2, False)

    def test_moe_2_ranks_fp64_shared_expert(self):
        run_distributed(2, moe_worker, "fp64", config()["router"], 1, False, 12)

    def test_moe_4_ranks_fp64_expert_bias(self):
        run_distributed(4, moe_worker, "fp64", SIGMOID_BIAS, 3, False)

    def test_moe_4_ranks_fp32_subgroups_of_2(self):
        run_distributed(4, moe_worker, "fp32", SIGMOID_BIAS, 2, True)

    def test_dispatcher_2_ranks_fp64(self):
        run_distributed(2, dispatch_worker, "fp64", 0.2)

    def test_dispatcher_4_ranks_fp32(self):
        run_distributed(4, dispatch_worker, "fp32", 0.0)


if __name__ == "__main__":
    unittest.main()
