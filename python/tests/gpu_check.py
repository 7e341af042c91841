# SPDX-License-Identifier: Apache-2.0
"""The package on CUDA (a GPU machine, a build with CUDA): MoE and Dispatcher against the pure-PyTorch reference on
one GPU, with 2 GPUs a process each over NCCL (the id broadcast through the process group), and the LM example
on a GPU. Not part of the CPU suite (run_tests.sh): python3 python/tests/gpu_check.py BUILD_DIR."""
import os
import sys
import tempfile

if len(sys.argv) > 1:
    os.environ["MOERT_TEST_BUILD_DIR"] = os.path.abspath(sys.argv[1])
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from common import (SIGMOID_BIAS, assert_close, config, full_weights, inputs, load_weights, moert)  # noqa: E402
import test_dispatcher as td  # noqa: E402


class TC:
    def __init__(self):
        import unittest
        self.t = unittest.TestCase()

    def close(self, got, want, tol, what):
        assert_close(self.t, got.cpu(), want.cpu(), tol, what)
        print("  ok", what, flush=True)

    def __getattr__(self, n):
        return getattr(self.t, n)


def moe_check(dev, pg=None, rank=0, world=1, router=None, dtype="fp32", tol=1e-4, shared=0):
    tc = TC()
    cfg = config(dtype=dtype, router=router, tokens=64)
    cfg["parallel"] = {"device": "cuda"}
    if shared:
        cfg["model"].update(shared_expert_ffn_hidden=shared, shared_expert_gate=True)
    m = moert.torch.MoE(cfg, pg, device=dev)
    w = full_weights(cfg)
    load_weights(m, [t.to(dev) for t in w])
    torch.manual_seed(5)
    refs = [moert.reference.MoE(cfg, device=dev) for _ in range(world)]
    for r in refs:
        load_weights(r, [t.to(dev) for t in w])
        for n in ("shared_fc1", "shared_fc2", "shared_gate"):
            if hasattr(r, n):
                with torch.no_grad():
                    getattr(r, n).copy_(getattr(refs[0], n))
                    getattr(m, n).copy_(getattr(refs[0], n))
    for step in range(2):
        xs = [tuple(t.to(dev) for t in inputs(cfg, 64 - 8 * r, seed=100 * step + r)) for r in range(world)]
        x, gy = xs[rank]
        xg = x.clone().requires_grad_()
        for p in m.parameters():
            p.grad = None
        y, rl = m(xg)
        ((y * gy).sum() + 0.5 * rl).backward()
        outs = []
        for r, (xr, gr) in zip(refs, xs):
            for p in r.parameters():
                p.grad = None
            xr = xr.clone().requires_grad_()
            yr, rlr = r(xr)
            ((yr * gr).sum() + 0.5 * rlr).backward()
            outs.append((yr, rlr, xr.grad))
        what = "cuda rank %d/%d %s step %d" % (rank, world, dtype, step)
        torch.cuda.synchronize()
        tc.close(y, outs[rank][0], tol, what + " y")
        tc.close(rl, outs[rank][1], tol, what + " router loss")
        tc.close(xg.grad, outs[rank][2], tol, what + " dx")
        gr = m.router_weight.grad.clone()
        if world > 1:
            dist.all_reduce(gr, group=pg)
        tc.close(gr, sum(r.router_weight.grad for r in refs), tol, what + " router grad")
        f, n = m.first_local_expert, m.num_local_experts
        for name in ("fc1", "fc2"):
            tc.close(getattr(m, name).grad, sum(getattr(r, name).grad for r in refs)[f:f + n], tol, what + " " + name)


def dispatcher_check(dev):
    tc = TC()
    cfg = config(dtype="fp32", tokens=40)
    disp = moert.torch.Dispatcher(cfg, device=dev)
    x = torch.randn(40, 16)
    gy = torch.randn(40, 16)
    idx, w = td.routing(40, 8, 2, 5, 0.2)
    xr = x.to(dev).requires_grad_()
    wr = w.float().to(dev).requires_grad_()
    rx, rw, tpe, h = disp.dispatch(xr, idx.to(dev), wr)
    ye = td.run_experts(rx.cpu(), rw.cpu(), tpe, 0, 8).to(dev)
    # run_experts on the CPU loses the graph: redo it on the device with the same scales
    s = td.expert_scale(8).float()
    scale = torch.cat([torch.full((n,), s[e].item()) for e, n in enumerate(tpe.tolist())] +
                      [torch.zeros(rx.shape[0] - int(tpe.sum()))]).to(dev)
    ye = rx * (scale * rw)[:, None]
    y = disp.combine(ye, h)
    (y * gy.to(dev)).sum().backward()
    x2 = x.clone().double().requires_grad_()
    w2 = w.clone().requires_grad_()
    yr = td.combined_reference(x2, idx, w2, 8)
    (yr * gy.double()).sum().backward()
    tc.close(y, yr, 1e-5, "cuda dispatcher combine")
    tc.close(xr.grad, x2.grad, 1e-5, "cuda dispatcher dx")
    tc.close(wr.grad, w2.grad, 1e-5, "cuda dispatcher d topk_weights")


def nccl_worker(rank, world, init_file):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="file://" + init_file, rank=rank, world_size=world)
    try:
        moe_check(torch.device("cuda", rank), None, rank, world)
        moe_check(torch.device("cuda", rank), None, rank, world, router=SIGMOID_BIAS)
        moe_check(torch.device("cuda", rank), None, rank, world, shared=24)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def pipeline_check(dev, dispatcher="alltoall"):
    """$.parallel.forwards_in_flight 3 on a GPU: three forwards, then the backwards with one more forward between,
    against one forward and backward after the other (every slot's own stream and plugin instances)."""
    tc = TC()
    cfg = config(dtype="fp32", tokens=64)
    cfg["parallel"] = {"device": "cuda"}
    cfg["dispatcher"] = {"plugin": dispatcher}
    seq = moert.torch.MoE(cfg, device=dev)
    pipe = moert.torch.MoE(cfg, device=dev, overrides={"parallel.forwards_in_flight": 3})
    w = full_weights(cfg)
    load_weights(seq, [t.to(dev) for t in w])
    load_weights(pipe, [t.to(dev) for t in w])
    data = [tuple(t.to(dev) for t in inputs(cfg, 64 - 4 * i, seed=300 + i)) for i in range(4)]

    def forward(m, i):
        x = data[i][0].clone().requires_grad_()
        y, rl = m(x)
        return x, y, (y * data[i][1]).sum() + 0.5 * rl

    want = []
    for i in range(4):
        x, y, loss = forward(seq, i)
        loss.backward()
        want.append((y.detach(), x.grad))
    runs = [forward(pipe, i) for i in range(3)]
    runs[0][2].backward()
    runs.append(forward(pipe, 3))
    for i in (1, 3, 2):
        runs[i][2].backward()
    torch.cuda.synchronize()
    for i in range(4):
        what = "cuda pipeline order (%s) micro-batch %d" % (dispatcher, i)
        tc.close(runs[i][1].detach(), want[i][0], 1e-5, what + " y")
        tc.close(runs[i][0].grad, want[i][1], 1e-5, what + " dx")
    for n in ("router_weight", "fc1", "fc2"):
        tc.close(getattr(pipe, n).grad, getattr(seq, n).grad, 1e-5, "cuda pipeline order accumulated " + n)


def main():
    print("torch", torch.__version__, "libmoert", moert.library_path(), "gpus", torch.cuda.device_count(), flush=True)
    dev = torch.device("cuda", 0)
    moe_check(dev)
    moe_check(dev, router=SIGMOID_BIAS)
    moe_check(dev, shared=24)
    dispatcher_check(dev)
    pipeline_check(dev)
    # bad device
    m = moert.torch.MoE(config(), device=dev)
    try:
        m(torch.randn(4, 16))
        raise SystemExit("a CPU x on a CUDA module was accepted")
    except ValueError as e:
        print("  ok refused:", e)
    if torch.cuda.device_count() >= 2:
        import torch.multiprocessing as mp
        with tempfile.TemporaryDirectory() as d:
            mp.spawn(nccl_worker, args=(2, os.path.join(d, "init")), nprocs=2)
        print("NCCL 2 GPUs: ok", flush=True)
    print("gpu_check: all passed", flush=True)


if __name__ == "__main__":
    main()
