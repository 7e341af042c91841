# SPDX-License-Identifier: Apache-2.0
"""moert.torch.MoE under parallel folding (docs/parallel.md) on 4 CPU processes (gloo): the MoE layer's own
ETP x EP x EDP grid over the group from $.parallel.expert_tensor_parallel / expert_data_parallel. Each rank's output and
input gradient equal the pure-PyTorch reference's on its own tokens with every expert; the expert gradients summed over
the EDP group equal that shard of the reference's summed over every rank; the router's summed over every rank."""
import unittest

import torch
import torch.distributed as dist

from common import assert_close, config, full_weights, inputs, moert, run_distributed


class _Checks(unittest.TestCase):
    def close(self, got, want, tol, what):
        assert_close(self, got, want, tol, what)


def shard_of(weights, m):
    """This rank's fc1 and fc2: its experts, and of each its ETP shard (fc1 as the shard's gate then its up)."""
    _, f1, f2 = weights
    first, n, Fl, j = m.first_local_expert, m.num_local_experts, m.local_ffn_hidden, m.etp_rank
    F = f2.shape[1]
    gate = f1[first:first + n, :, j * Fl:(j + 1) * Fl]
    up = f1[first:first + n, :, F + j * Fl:F + (j + 1) * Fl]
    return torch.cat([gate, up], dim=2), f2[first:first + n, j * Fl:(j + 1) * Fl, :]


def folding_worker(rank, world, etp, edp):
    tc = _Checks()
    cfg = config(dtype="fp64", tokens=24)
    cfg["parallel"].update(expert_tensor_parallel=etp, expert_data_parallel=edp)
    m = moert.torch.MoE(cfg)
    ep = world // (etp * edp)
    tc.assertEqual((m.etp_size, m.ep_size, m.edp_size), (etp, ep, edp))
    tc.assertEqual(rank, m.etp_rank + etp * (m.ep_rank + ep * m.edp_rank))  # Megatron's expert rank order
    tc.assertEqual((m.num_local_experts, m.local_ffn_hidden), (8 // ep, 24 // etp))
    w = full_weights(cfg)
    fc1, fc2 = shard_of(w, m)
    with torch.no_grad():
        m.router_weight.copy_(w[0])
        m.fc1.copy_(fc1)
        m.fc2.copy_(fc2)
    m.weights_changed()
    # every rank makes every EDP group, in the same order (new_group is collective)
    groups = {}
    for r in range(world):
        members = tuple(sorted(m_r for m_r in range(world) if m_r % (etp * ep) == r % (etp * ep)))
        if members not in groups:
            groups[members] = dist.new_group(list(members))
    edp_group = groups[tuple(m.expert_data_parallel_ranks())]
    refs, outs = [], []
    for r in range(world):
        ref = moert.reference.MoE(cfg)
        with torch.no_grad():
            ref.router_weight.copy_(w[0])
            ref.fc1.copy_(w[1])
            ref.fc2.copy_(w[2])
        x, gy = inputs(cfg, 24 - 2 * r, seed=31 + r)
        xr = x.clone().requires_grad_()
        y, rl = ref(xr)
        ((y * gy).sum() + 0.5 * rl).backward()
        refs.append(ref)
        outs.append((x, gy, y, rl, xr.grad))
    x, gy, y_ref, rl_ref, dx_ref = outs[rank]
    xg = x.clone().requires_grad_()
    y, rl = m(xg)
    ((y * gy).sum() + 0.5 * rl).backward()
    what = "rank %d, ETP%d x EP%d x EDP%d" % (rank, etp, ep, edp)
    tol = 1e-12
    tc.close(y, y_ref, tol, what + " y")
    tc.close(rl, rl_ref, tol, what + " router loss")
    tc.close(xg.grad, dx_ref, tol, what + " dx")
    g = m.router_weight.grad.clone()
    dist.all_reduce(g)
    tc.close(g, sum(r.router_weight.grad for r in refs), tol, what + " router grad over every rank")
    want1, want2 = shard_of((None, sum(r.fc1.grad for r in refs), sum(r.fc2.grad for r in refs)), m)
    g1, g2 = m.fc1.grad.clone(), m.fc2.grad.clone()
    dist.all_reduce(g1, group=edp_group)
    dist.all_reduce(g2, group=edp_group)
    tc.close(g1, want1, tol, what + " fc1 grad over the EDP group")
    tc.close(g2, want2, tol, what + " fc2 grad over the EDP group")


class Folding(unittest.TestCase):
    def test_etp2_ep2(self):
        run_distributed(4, folding_worker, 2, 1)

    def test_ep2_edp2(self):
        run_distributed(4, folding_worker, 1, 2)

    def test_etp2_edp2(self):
        run_distributed(4, folding_worker, 2, 2)

    def test_etp4(self):
        run_distributed(4, folding_worker, 4, 1)


if __name__ == "__main__":
    unittest.main()
