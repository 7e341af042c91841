# SPDX-License-Identifier: Apache-2.0
"""moert.torch.Dispatcher (DeepEP-shaped dispatch and combine) at one rank against plain torch ops: the rows each
local expert receives, tokens_per_expert, combine, and the gradients of x and topk_weights through both autograd
Functions; dropped copies (-1), int64 indices, bad input."""
import unittest

import torch

from common import TORCH_DTYPE, Case, config, moert


def routing(T, E, K, seed, drop=0.0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    if drop:
        idx[torch.rand(T, K, generator=g) < drop] = -1
    w = torch.rand(T, K, generator=g, dtype=torch.float64)
    return idx, w


def expert_scale(E):
    return torch.linspace(0.5, 2.0, E, dtype=torch.float64)


def reference(x, idx, w, first, n):
    """What the rank owning experts first..first+n-1 receives (rows per local expert, as sets) and the combined
    output of rows scaled by an expert's scale and the copy's weight."""
    groups = []
    for e in range(first, first + n):
        t, k = (idx == e).nonzero(as_tuple=True)
        groups.append((x[t], w[t, k]))
    return groups


def combined_reference(x, idx, w, E):
    s = expert_scale(E).to(x.dtype)
    keep = idx >= 0
    sc = torch.where(keep, s[idx.clamp(min=0).long()], torch.zeros((), dtype=x.dtype)) * w.to(x.dtype)
    return (x[:, None, :] * sc[:, :, None]).sum(1)


def run_experts(recv_x, recv_w, tpe, first, E):
    """Each local expert multiplies its rows by its scale and the rows' weights (the rows past the groups are
    padding: untouched)."""
    s = expert_scale(E).to(recv_x.dtype)
    scale = torch.zeros(recv_x.shape[0], dtype=recv_x.dtype)
    pos = 0
    for el, n in enumerate(tpe.tolist()):
        scale[pos:pos + n] = s[first + el]
        pos += n
    return recv_x * (scale * recv_w.to(recv_x.dtype))[:, None]


def sort_rows(rows, extra):
    key = rows.double() @ torch.linspace(1, 2, rows.shape[1], dtype=torch.float64)
    order = torch.argsort(key)
    return rows[order], extra[order]


def check_dispatch(tc, disp, x, idx, w, gy, x_full, idx_full, w_full, tol, what):
    """One dispatch + experts + combine + backward on this rank; compares with the reference on the full batch."""
    E = disp.num_experts
    xr = x.clone().requires_grad_()
    wr = w.to(disp.param_dtype).clone().requires_grad_()
    recv_x, recv_w, tpe, handle = disp.dispatch(xr, idx, wr)
    tc.assertEqual(tpe.dtype, torch.int64)
    groups = reference(x_full, idx_full, w_full, disp.first_local_expert, disp.num_local_experts)
    tc.assertEqual(tpe.tolist(), [g[0].shape[0] for g in groups], what + " tokens_per_expert")
    tc.assertGreaterEqual(recv_x.shape[0], sum(tpe.tolist()))
    pos = 0
    for el, (rows, ws) in enumerate(groups):
        n = rows.shape[0]
        got, got_w = sort_rows(recv_x[pos:pos + n].detach(), recv_w[pos:pos + n].detach())
        want, want_w = sort_rows(rows, ws)
        tc.assertTrue(torch.equal(got, want.to(got.dtype)), "%s rows of local expert %d" % (what, el))
        tc.close(got_w, want_w, tol, "%s weights of local expert %d" % (what, el))
        pos += n
    ye = run_experts(recv_x, recv_w, tpe, disp.first_local_expert, E)
    y = disp.combine(ye, handle)
    (y * gy).sum().backward()
    return y.detach(), xr.grad, wr.grad


class DispatcherOneRank(Case):
    def run_case(self, dtype, drop=0.0, int64=False):
        cfg = config(dtype=dtype, tokens=40)
        disp = moert.torch.Dispatcher(cfg)
        dt = TORCH_DTYPE[dtype]
        g = torch.Generator().manual_seed(3)
        T, H, E, K = 40, 16, 8, 2
        x = torch.randn(T, H, generator=g, dtype=torch.float64).to(dt)
        gy = torch.randn(T, H, generator=g, dtype=torch.float64).to(dt)
        idx, w = routing(T, E, K, 5, drop)
        tol = 1e-6 if dtype == "fp32" else 1e-13
        y, dx, dw = check_dispatch(self, disp, x, idx.long() if int64 else idx, w, gy, x, idx, w, tol, dtype)
        # reference through autograd
        xr = x.clone().requires_grad_()
        wr = w.to(disp.param_dtype).clone().requires_grad_()
        yr = combined_reference(xr, idx, wr, E)
        (yr * gy).sum().backward()
        self.close(y, yr, tol, "combine")
        self.close(dx, xr.grad, tol, "dx")
        self.close(dw, wr.grad, tol, "d topk_weights")
        if drop:
            self.assertTrue(torch.all(dw[idx < 0] == 0))

    def test_fp32(self):
        self.run_case("fp32")

    def test_fp64_dropped_copies_int64_idx(self):
        self.run_case("fp64", drop=0.3, int64=True)

    def test_inference_and_repeat(self):
        cfg = config(dtype="fp64", tokens=40)
        disp = moert.torch.Dispatcher(cfg)
        x = torch.randn(40, 16, dtype=torch.float64)
        idx, w = routing(40, 8, 2, 9)
        for _ in range(3):
            with torch.no_grad():
                rx, rw, tpe, h = disp.dispatch(x, idx, w)
                y = disp.combine(run_experts(rx, rw, tpe, 0, 8), h)
            self.close(y, combined_reference(x, idx, w, 8), 1e-13, "no-grad combine")

    def test_pipeline_order(self):
        """$.parallel.forwards_in_flight 3: three dispatches in flight, their backwards in the order they come, give
        each the combine and gradients of the reference; a fourth releases the oldest, whose backward then raises."""
        cfg = config(dtype="fp64", tokens=40)
        disp = moert.torch.Dispatcher(cfg, overrides={"parallel.forwards_in_flight": 3})
        runs = []
        for i in range(4):
            x = torch.randn(40, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(60 + i))
            idx, w = routing(40, 8, 2, 70 + i)
            xr, wr = x.clone().requires_grad_(), w.to(disp.param_dtype).clone().requires_grad_()
            rx, rw, tpe, h = disp.dispatch(xr, idx, wr)
            y = disp.combine(run_experts(rx, rw, tpe, 0, 8), h)
            runs.append((x, idx, w, xr, wr, y))
        with self.assertRaises(RuntimeError) as cm:  # the fourth dispatch released the first
            runs[0][5].sum().backward()
        self.assertIn("3 micro-batches in flight per layer", str(cm.exception))
        for x, idx, w, xr, wr, y in reversed(runs[1:]):
            y.sum().backward()
            xw, ww = x.clone().requires_grad_(), w.to(disp.param_dtype).clone().requires_grad_()
            yw = combined_reference(xw, idx, ww, 8)
            yw.sum().backward()
            self.close(y, yw, 1e-13, "combine")
            self.close(xr.grad, xw.grad, 1e-13, "dx")
            self.close(wr.grad, ww.grad, 1e-13, "d topk_weights")

    def test_bad_input(self):
        cfg = config(dtype="fp32", tokens=40)
        disp = moert.torch.Dispatcher(cfg)
        x = torch.randn(10, 16)
        idx, w = routing(10, 8, 2, 1)
        w = w.float()
        cases = [((x.double(), idx, w), TypeError, "x"),
                 ((x, idx.float(), w), TypeError, "topk_idx"),
                 ((x, idx[:, :1].contiguous(), w), ValueError, "topk_idx"),
                 ((x, idx, w.double()), TypeError, "topk_weights"),
                 ((x, idx, w.t().contiguous().t()), ValueError, "topk_weights"),
                 ((x[:, :8], idx, w), ValueError, "x"),
                 ((torch.randn(16, 10).t(), idx, w), ValueError, "x")]
        for args, exc, name in cases:
            with self.assertRaises(exc) as cm:
                disp.dispatch(*args)
            self.assertIn(name, str(cm.exception))
        # an expert id out of range is moert's error
        bad = idx.clone()
        bad[0, 0] = 8
        with self.assertRaises(moert.MoertError) as cm:
            disp.dispatch(x, bad, w)
        self.assertEqual(cm.exception.code_name, "MOERT_ERR_INVALID_ARGUMENT")
        rx, rw, tpe, h = disp.dispatch(x, idx, w)
        with self.assertRaises(ValueError) as cm:
            disp.combine(rx[:-1], h)
        self.assertIn("y", str(cm.exception))


if __name__ == "__main__":
    unittest.main()
