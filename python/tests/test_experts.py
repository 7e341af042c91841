# SPDX-License-Identifier: Apache-2.0
"""moert.torch.Experts (moert_experts_forward / _backward) on the CPU against a pure-PyTorch reference of the same
arithmetic (rows grouped by local expert, fc1, SwiGLU times the prob, fc2), written here: outputs and every gradient
(x, probs, fc1, fc2) in fp64 and fp32, experts without rows, padding rows past the counts, no probs, zero rows,
inference, the one-forward-in-flight rule, and weights changed in place between forwards."""
import unittest

import torch
import torch.nn.functional as F

from common import Case, moert


def reference(x, tokens_per_expert, probs, fc1, fc2):
    """Each expert's rows in turn: (silu(x fc1_gate) * (x fc1_up) * prob) fc2; rows past the counts give 0."""
    Fh = fc2.shape[1]
    outs, start = [], 0
    for e, n in enumerate(tokens_per_expert.tolist()):
        xe = x[start:start + n]
        h = xe.to(fc1.dtype) @ fc1[e]
        p = probs[start:start + n] if probs is not None else torch.ones(n, dtype=fc1.dtype)
        a = F.silu(h[:, :Fh]) * h[:, Fh:] * p[:, None]
        outs.append((a.to(x.dtype).to(fc2.dtype) @ fc2[e]).to(x.dtype))
        start += n
    outs.append(x.new_zeros(x.shape[0] - start, x.shape[1]))
    return torch.cat(outs)


def make(dtype="fp64", E=4, H=12, Fh=10, seed=3):
    cfg = {"model": {"hidden": H, "ffn_hidden": Fh, "num_experts": E, "topk": 2, "dtype": dtype},
           "precision": {"plugin": "bf16", "mode": "auto"}, "parallel": {"device": "cpu"}}
    m = moert.torch.Experts(cfg, init_seed=seed)
    return m


def rows(m, counts, pad, seed=5):
    g = torch.Generator().manual_seed(seed)
    R = sum(counts) + pad
    x = torch.randn(R, m.hidden, generator=g, dtype=torch.float64).to(m.dtype)
    probs = (0.5 + 0.5 * torch.rand(R, generator=g, dtype=torch.float64)).to(m.param_dtype)
    gy = torch.randn(R, m.hidden, generator=g, dtype=torch.float64).to(m.dtype)
    return x, torch.tensor(counts, dtype=torch.int64), probs, gy


class ExpertsModule(Case):
    def check(self, dtype, tol, counts, pad, with_probs=True):
        m = make(dtype)
        self.assertEqual(tuple(m.fc1.shape), (4, 12, 20))
        self.assertEqual(tuple(m.fc2.shape), (4, 10, 12))
        x, tpe, probs, gy = rows(m, counts, pad)
        xm = x.clone().requires_grad_()
        pm = probs.clone().requires_grad_() if with_probs else None
        y = m(xm, tpe, pm)
        (y * gy).sum().backward()
        xr = x.clone().requires_grad_()
        pr = probs.clone().requires_grad_() if with_probs else None
        f1 = m.fc1.detach().clone().requires_grad_()
        f2 = m.fc2.detach().clone().requires_grad_()
        yr = reference(xr, tpe, pr, f1, f2)
        (yr * gy).sum().backward()
        what = "%s counts %s pad %d probs %s" % (dtype, counts, pad, with_probs)
        self.close(y, yr, tol, what + " y")
        self.close(xm.grad, xr.grad, tol, what + " dx")
        self.close(m.fc1.grad, f1.grad, tol, what + " fc1 grad")
        self.close(m.fc2.grad, f2.grad, tol, what + " fc2 grad")
        if with_probs:
            self.close(pm.grad, pr.grad, tol, what + " d probs")
        n = sum(counts)
        self.assertTrue(torch.equal(y[n:], torch.zeros_like(y[n:])), what + ": padding rows of y are 0")
        self.assertTrue(torch.equal(xm.grad[n:], torch.zeros_like(xm.grad[n:])), what + ": padding rows of dx are 0")

    def test_fp64(self):
        for counts, pad in (([5, 3, 0, 6], 0), ([0, 7, 2, 1], 3), ([4, 4, 4, 4], 1)):
            self.check("fp64", 1e-12, counts, pad)
        self.check("fp64", 1e-12, [3, 0, 2, 5], 2, with_probs=False)

    def test_fp32(self):
        self.check("fp32", 2e-5, [6, 2, 5, 0], 2)

    def test_zero_rows(self):
        m = make()
        x = torch.zeros(0, m.hidden, dtype=m.dtype, requires_grad=True)
        y = m(x, torch.zeros(4, dtype=torch.int64), torch.zeros(0, dtype=m.param_dtype))
        self.assertEqual(tuple(y.shape), (0, m.hidden))
        y.sum().backward()
        self.assertTrue(torch.equal(m.fc1.grad, torch.zeros_like(m.fc1)))
        self.assertTrue(torch.equal(m.fc2.grad, torch.zeros_like(m.fc2)))

    def test_inference_and_accumulation(self):
        m = make()
        x, tpe, probs, gy = rows(m, [2, 3, 4, 1], 0)
        with torch.no_grad():
            y0 = m(x, tpe, probs)
        self.close(y0, reference(x, tpe, probs, m.fc1.detach(), m.fc2.detach()), 1e-12, "no_grad")
        for _ in range(2):  # autograd accumulates two micro-batches' gradients into .grad
            (m(x, tpe, probs) * gy).sum().backward()
        g1 = m.fc1.grad.clone()
        m.fc1.grad = None
        (m(x, tpe, probs) * gy).sum().backward()
        self.close(g1, 2 * m.fc1.grad, 1e-12, "two backwards")

    def test_weights_changed_in_place(self):
        m = make()
        x, tpe, probs, _ = rows(m, [2, 3, 4, 1], 1)
        with torch.no_grad():
            m(x, tpe, probs)
            m.fc2.mul_(2.0)  # an optimizer step: in place
            y = m(x, tpe, probs)
        self.close(y, reference(x, tpe, probs, m.fc1, m.fc2), 1e-12, "after an in-place update")

    def test_one_forward_in_flight(self):
        m = make()
        x, tpe, probs, gy = rows(m, [2, 3, 4, 1], 0)
        xa = x.clone().requires_grad_()
        ya = m(xa, tpe, probs)
        yb = m(x.clone().requires_grad_(), tpe, probs)  # supersedes the first forward
        with self.assertRaisesRegex(RuntimeError, "ran more forwards"):
            (ya * gy).sum().backward()
        (yb * gy).sum().backward()

    def test_pipeline_order(self):
        """$.parallel.forwards_in_flight 3: three forwards, then the backwards with one more forward between, give
        each micro-batch's y and dx and the accumulated weight gradients of one after the other, bit for bit."""
        seq = make()
        pipe = moert.torch.Experts({"model": {"hidden": 12, "ffn_hidden": 10, "num_experts": 4, "topk": 2,
                                              "dtype": "fp64"},
                                    "precision": {"plugin": "bf16", "mode": "auto"},
                                    "parallel": {"device": "cpu", "forwards_in_flight": 3}}, init_seed=3)
        data = [rows(seq, [2 + i, 3, 4 - i, 1], i, seed=30 + i) for i in range(4)]

        def forward(m, i):
            x, tpe, probs, gy = data[i]
            xa = x.clone().requires_grad_()
            return xa, m(xa, tpe, probs), gy

        def backward(run):
            (run[1] * run[2]).sum().backward()
            return run[1].detach(), run[0].grad

        want = [backward(forward(seq, i)) for i in range(4)]
        runs = [forward(pipe, i) for i in range(3)]
        got = [backward(runs[0])]
        runs.append(forward(pipe, 3))
        got += [backward(runs[i]) for i in (3, 1, 2)]
        got = got[:1] + [got[2], got[3], got[1]]  # back in micro-batch order
        for i in range(4):
            self.assertTrue(torch.equal(got[i][0], want[i][0]), "y of micro-batch %d" % i)
            self.assertTrue(torch.equal(got[i][1], want[i][1]), "dx of micro-batch %d" % i)
        for n in ("fc1", "fc2"):  # summed in another order: equal to rounding
            self.close(getattr(pipe, n).grad, getattr(seq, n).grad, 1e-13, "accumulated grad " + n)

    def test_bad_input(self):
        m = make()
        x, tpe, probs, _ = rows(m, [2, 3, 4, 1], 0)
        with self.assertRaisesRegex(ValueError, "tokens_per_expert: expected shape \\[4\\]"):
            m(x, tpe[:3], probs)
        with self.assertRaisesRegex(moert.torch.MoertError, "tokens_per_expert sums to 12, more than the 10 rows"):
            m(x, torch.tensor([2, 3, 4, 3]), probs)
        with self.assertRaisesRegex(ValueError, "probs: expected shape \\[10\\]"):
            m(x, tpe, probs[:9])
        bare = moert.torch.Experts({"model": {"hidden": 12, "ffn_hidden": 10, "num_experts": 4, "dtype": "fp64"},
                                    "parallel": {"device": "cpu"}}, 2, parameters=False)
        self.assertEqual(bare.num_local_experts, 2)
        self.assertEqual(list(bare.parameters()), [])
        with self.assertRaisesRegex(RuntimeError, "parameters=False"):
            bare(x, tpe[:2], probs)


if __name__ == "__main__":
    unittest.main()
