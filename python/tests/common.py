# SPDX-License-Identifier: Apache-2.0
"""What the Python tests share: finding the package and libmoert, configs, the pure-PyTorch reference's inputs,
and running a function on N CPU processes (gloo)."""
import os
import sys
import tempfile
import unittest

_HERE = os.path.dirname(os.path.abspath(__file__))
_PY = os.path.dirname(_HERE)
ROOT = os.path.dirname(_PY)
if _PY not in sys.path:
    sys.path.insert(0, _PY)

import torch  # noqa: E402

import moert  # noqa: E402
import moert.reference  # noqa: E402
import moert.torch  # noqa: E402


def setup_library():
    """libmoert from MOERT_TEST_BUILD_DIR (python/run_tests.sh sets it), else the package's own search."""
    build = os.environ.get("MOERT_TEST_BUILD_DIR")
    if build:
        moert.load_library(build)
    return moert.library_path()


setup_library()
torch.set_num_threads(1)


def config(dtype="fp32", hidden=16, ffn=24, experts=8, topk=2, tokens=48, router=None, **sections):
    cfg = {"model": {"hidden": hidden, "ffn_hidden": ffn, "num_experts": experts, "topk": topk, "dtype": dtype},
           "train": {"tokens_per_rank": tokens},
           "router": router or {"plugin": "topk", "score_function": "softmax", "load_balancing": "aux_loss",
                                "aux_loss_coeff": 0.1, "z_loss_coeff": 0.01},
           "dispatcher": {"plugin": "alltoall"}, "precision": {"plugin": "bf16", "mode": "auto"},
           "parallel": {"device": "cpu"}}  # the CPU suite stays on the CPU on GPU machines too
    cfg.update(sections)
    return cfg


SIGMOID_BIAS = {"plugin": "topk", "score_function": "sigmoid", "expert_bias": True, "bias_update_rate": 0.05,
                "z_loss_coeff": 0.001}
PRE_SOFTMAX = {"plugin": "topk", "score_function": "softmax", "pre_softmax": True, "scaling_factor": 1.5}

TORCH_DTYPE = {"fp32": torch.float32, "fp64": torch.float64}
# relative tolerance of a comparison against the reference (of the largest magnitude)
TOL = {"fp32": 2e-5, "fp64": 1e-12}


def full_weights(cfg, seed=7):
    """Every expert's weights (the reference's), from seed: router [E, H], fc1 [E, H, 2F], fc2 [E, F, H]."""
    m = cfg["model"]
    E, H, F = m["num_experts"], m["hidden"], m["ffn_hidden"]
    pdt = torch.float64 if m["dtype"] == "fp64" else torch.float32
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, H, generator=g, dtype=torch.float64).to(pdt) / H ** 0.5,
            torch.randn(E, H, 2 * F, generator=g, dtype=torch.float64).to(pdt) / H ** 0.5,
            torch.randn(E, F, H, generator=g, dtype=torch.float64).to(pdt) * (0.5 / F ** 0.5))


def inputs(cfg, tokens, seed=11):
    m = cfg["model"]
    g = torch.Generator().manual_seed(seed)
    dt = TORCH_DTYPE[m["dtype"]]
    x = torch.randn(tokens, m["hidden"], generator=g, dtype=torch.float64).to(dt)
    gy = torch.randn(tokens, m["hidden"], generator=g, dtype=torch.float64).to(dt)
    return x, gy


def load_weights(moe, weights):
    """Copies this rank's slice of the full weights into a moert.torch.MoE (or a reference MoE)."""
    r, f1, f2 = weights
    first = getattr(moe, "first_local_expert", 0)
    n = moe.fc1.shape[0]
    with torch.no_grad():
        moe.router_weight.copy_(r)
        moe.fc1.copy_(f1[first:first + n])
        moe.fc2.copy_(f2[first:first + n])
    if hasattr(moe, "weights_changed"):
        moe.weights_changed()


def assert_close(tc, got, want, tol, what):
    got, want = got.detach().double(), want.detach().double()
    tc.assertEqual(tuple(got.shape), tuple(want.shape), what)
    scale = max(want.abs().max().item() if want.numel() else 0.0, 1e-30)
    err = (got - want).abs().max().item() if want.numel() else 0.0
    tc.assertLessEqual(err, tol * scale, "%s: max error %.3g, %.3g of the largest value %.3g (tolerance %.1g)"
                       % (what, err, err / scale, scale, tol))


def _worker(rank, world, init_file, fn, args):
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world)
    done = False
    try:
        fn(rank, world, *args)
        done = True
    finally:
        # a failed rank leaves at once: its exception ends the others (spawn stops them) rather than this barrier
        # waiting for peers that wait in a collective for it
        if done:
            dist.barrier()
        dist.destroy_process_group()


def run_distributed(world, fn, *args):
    """Runs fn(rank, world, *args) on `world` CPU processes with a gloo default group; an exception in any of
    them fails the caller (torch.multiprocessing.spawn re-raises it)."""
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(world, os.path.join(d, "init"), fn, args), nprocs=world, join=True)


class Case(unittest.TestCase):
    def close(self, got, want, tol, what):
        assert_close(self, got, want, tol, what)
