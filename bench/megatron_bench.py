#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Megatron Core's own MoELayer (local spec: SequentialMLP experts, no TransformerEngine) with its own alltoall token
dispatcher against the same layer with moert's dispatcher backend (moert.megatron.use_moert; alltoall, deepep,
hybridep), the same layer with moert's dispatcher and moert's grouped GEMMs as its experts (use_moert(...,
experts=True): a MoertGroupedMLP with the SequentialMLP's weights), and against moert.torch.MoE with the layer's
weights copied in: outputs, input gradients, router and expert weight gradients (and the aux loss) agree within bf16
tolerance; forward+backward times of all of them in the same call. Shapes: moert's presets (configs/), each GPU holding as many experts as at EP4 unless --experts says
otherwise (as bench/torch_moe_bench.py).

GPU machine (a CUDA build of moert, megatron-core wheels in .whl/ when Megatron is not importable):
    torchrun --nproc-per-node 1 bench/megatron_bench.py --build build-gpu --out megatron-ep1.json
    torchrun --nproc-per-node 2 bench/megatron_bench.py --build build-gpu --out megatron-ep2.json
Without an importable megatron.core the script installs the wheel from --wheels (default .whl/) with
`pip install --no-deps --no-index --target .whl/site-cpXY` and imports it from there. Prints a PASS/FAIL table,
writes the JSON result to --out (rank 0), exits 1 if any check failed.
"""

import argparse
import contextlib
import fcntl
import glob
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "python"))
import moert  # noqa: E402
import moert.megatron as mm  # noqa: E402
import moert.torch  # noqa: E402

MEGATRON_VERSION = "0.16.1"
PRESETS = "deepseek-v3,qwen3-30b-a3b,mixtral-8x7b"
# bf16 tolerances: of the largest reference value (max), and the relative L2 norm of the difference (l2)
TOL = {"dispatcher": {"max": 2e-2, "l2": 1e-2}, "experts": {"max": 2e-2, "l2": 1e-2},
       "moe": {"max": 5e-2, "l2": 2e-2}}
# moert.torch.MoE routes on its own (fp32 logits): a token whose top-k has a near-tie may pick another expert than
# Megatron's router. Such rows are counted (a row of y off by more than 10% of its norm) and allowed up to this share.
MAX_FLIPPED_ROWS = 2e-3


# ---- Megatron from the wheel ----


def ensure_megatron(wheels):
    """Imports megatron.core; if it is not importable, installs the wheel from `wheels` into wheels/site-cpXY with
    `pip install --no-deps --no-index` (no network, no dependencies: Megatron Core needs torch, numpy and
    packaging; a packaging wheel there is added when the one here is older than Megatron wants), or, without pip,
    unpacks the wheel there. Under a file lock, so that the ranks torchrun starts install it once. Returns where
    Megatron came from."""
    try:
        import megatron.core  # noqa: F401
        return "preinstalled"
    except ImportError:
        pass
    wheels = os.path.abspath(wheels)
    tag = "cp%d%d" % sys.version_info[:2]
    target = os.path.join(wheels, "site-" + tag)
    try:
        import packaging.version as pv
        old_packaging = pv.Version(importlib.import_module("packaging").__version__) < pv.Version("24.2")
    except ImportError:
        old_packaging = True
    extra = glob.glob(os.path.join(wheels, "packaging-*.whl")) if old_packaging else []
    with open(os.path.join(wheels, ".install.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isdir(os.path.join(target, "megatron", "core")):
            cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--find-links", wheels,
                   "--target", target, "megatron-core==" + MEGATRON_VERSION] + (["packaging"] if extra else [])
            print("installing Megatron Core:", " ".join(cmd), flush=True)
            if subprocess.run(cmd).returncode != 0:
                import zipfile
                whl = glob.glob(os.path.join(wheels, "megatron_core-%s-%s-*.whl" % (MEGATRON_VERSION, tag)))
                if not whl:
                    raise SystemExit("megatron_bench: no megatron_core-%s wheel for %s in %s"
                                     % (MEGATRON_VERSION, tag, wheels))
                print("pip failed: unpacking", whl[0], "and", extra, "into", target, flush=True)
                for w in whl[:1] + extra[:1]:
                    with zipfile.ZipFile(w) as z:
                        z.extractall(target)
        fcntl.flock(lock, fcntl.LOCK_UN)
    sys.path.insert(0, target)
    importlib.invalidate_caches()
    if extra:  # the newer packaging from target
        for name in [n for n in sys.modules if n == "packaging" or n.startswith("packaging.")]:
            del sys.modules[name]
    import megatron.core  # noqa: F401
    return target


def megatron_workarounds():
    """Megatron Core 0.16.1 without TransformerEngine: moe_utils.RouterGatingLinearFunction tests
    `te_general_gemm is not None` but the name is only defined when TE imports (NameError). Defining it as None
    gives Megatron's own torch.mm fallback, its intended path without TE. Returns what was done."""
    import megatron.core.transformer.moe.moe_utils as mu
    done = []
    if not hasattr(mu, "te_general_gemm"):
        mu.te_general_gemm = None
        done.append("moe_utils.te_general_gemm = None (Megatron 0.16.1 without TransformerEngine)")
    return done


# ---- one preset ----


def preset_config(name, world, experts, shrink):
    with open(os.path.join(ROOT, "configs", name + ".json")) as f:
        cfg = json.load(f)
    m = cfg["model"]
    m["num_experts"] = experts or max(world, world * m["num_experts"] // 4)
    m["num_layers"] = 1
    m["hidden"] //= shrink
    m["ffn_hidden"] //= shrink
    r = cfg.get("router", {})
    if r.get("num_groups") and m["num_experts"] % r["num_groups"]:
        r.pop("num_groups")
        r.pop("group_topk", None)
    cfg["train"]["tokens_per_rank"] //= shrink
    cfg["parallel"] = {"ranks": world}
    return cfg


def transformer_config(cfg, world, use_cpu_init=False):
    from megatron.core.transformer.transformer_config import TransformerConfig
    kw = mm.megatron_kwargs_from_moert(cfg)
    kw.update(num_layers=1, num_attention_heads=8, expert_model_parallel_size=world, tensor_model_parallel_size=1,
              use_cpu_initialization=use_cpu_init, sequence_parallel=False)
    return TransformerConfig(**kw)


def build_layer(tc, device, ep_group):
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.spec_utils import build_module
    spec = get_moe_module_spec(use_te=False, num_experts=tc.num_moe_experts, moe_grouped_gemm=False)
    layer = build_module(spec, config=tc).to(device)
    layer.set_layer_number(1)  # the router then tracks its aux loss (compared with moert's)
    # the router's weights are replicated over the group: the same values on every rank
    with torch.no_grad():
        for t in [layer.router.weight] + ([layer.router.expert_bias] if layer.router.expert_bias is not None else []):
            if dist.get_world_size(ep_group) > 1:
                dist.broadcast(t.data, src=dist.get_global_rank(ep_group, 0), group=ep_group)
    return layer


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    def __init__(self, device):
        self.device = device

    @contextlib.contextmanager
    def __call__(self, out):
        if self.device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            yield
            b.record()
            torch.cuda.synchronize(self.device)
            out.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            yield
            out.append((time.perf_counter() - t0) * 1e3)


def megatron_step(layer, x, gy, collect=False):
    """One forward+backward of Megatron's layer; with collect, y and the gradients (x, router, experts fc1/fc2 in
    moert's layout) and the aux loss Megatron tracked (times its coefficient, as moert reports it)."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker
    clear_aux_losses_tracker()
    layer.zero_grad(set_to_none=True)
    xr = x.clone().requires_grad_()
    y, bias = layer(xr)
    assert bias is None, "the experts returned a bias"
    y.backward(gy)
    if not collect:
        return None
    if hasattr(layer.experts, "local_experts"):  # Megatron's SequentialMLP
        ex = layer.experts.local_experts
        fc1, fc2 = mm.expert_weights_to_moert([e.linear_fc1.weight.grad for e in ex],
                                              [e.linear_fc2.weight.grad for e in ex])
    else:  # moert's experts (MoertGroupedMLP): GroupedMLP's weight1/weight2, moert's layout per expert
        ex, H = layer.experts, y.shape[-1]
        fc1 = ex.weight1.grad.view(ex.num_local_experts, H, -1)
        fc2 = ex.weight2.grad.view(ex.num_local_experts, -1, H)
    tr = get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
    coeff = layer.config.moe_aux_loss_coeff
    aux = float(tr["values"][0]) * coeff if tr is not None and coeff else None
    H = y.shape[-1]
    out = {"y": y.detach().reshape(-1, H), "dx": xr.grad.reshape(-1, H),
           "router_grad": layer.router.weight.grad.clone(), "fc1_grad": fc1, "fc2_grad": fc2, "aux": aux}
    sh = layer.shared_experts
    if sh is not None:
        out["shared_fc1_grad"], out["shared_fc2_grad"] = mm.expert_weights_to_moert([sh.linear_fc1.weight.grad],
                                                                                   [sh.linear_fc2.weight.grad])
        if sh.gate_weight is not None:
            out["shared_gate_grad"] = sh.gate_weight.grad.clone()
    return out


def moe_step(moe, x, gy, collect=False):
    """One forward+backward of moert.torch.MoE (loss: y . gy + the router loss, as Megatron's aux loss enters its
    backward with scale 1)."""
    for p in moe.parameters():
        p.grad = None
    xr = x.reshape(-1, x.shape[-1]).clone().requires_grad_()
    y, loss = moe(xr)
    torch.autograd.backward([y, loss], [gy.reshape(-1, gy.shape[-1]), torch.ones_like(loss)])
    if not collect:
        return None
    out = {"y": y.detach(), "dx": xr.grad, "router_grad": moe.router_weight.grad, "fc1_grad": moe.fc1.grad,
           "fc2_grad": moe.fc2.grad, "aux": moe.last_stats["aux_loss"] or None}
    for n in ("shared_fc1", "shared_fc2", "shared_gate"):
        if hasattr(moe, n):
            out[n + "_grad"] = getattr(moe, n).grad
    return out


def errors(got, want):
    """Per tensor: max error over the largest reference value, and the relative L2 norm of the difference."""
    out = {}
    for k in [k for k in want if k.endswith("_grad") or k in ("y", "dx")]:
        a, b = got[k].double(), want[k].double()
        scale = max(b.abs().max().item(), 1e-30)
        out[k] = {"max": (a - b).abs().max().item() / scale,
                  "l2": ((a - b).norm() / max(b.norm().item(), 1e-30)).item()}
    out["flipped_rows"] = int(flipped_rows(got, want).sum().item())
    if got.get("aux") is not None and want.get("aux") is not None and want["aux"] != 0:
        out["aux"] = {"max": abs(got["aux"] - want["aux"]) / abs(want["aux"]), "l2": 0.0}
    return out


def flipped_rows(got, want):
    """Rows of y whose relative error says the token went to other experts (a routing near-tie), as a bool mask."""
    a, b = got["y"].double(), want["y"].double()
    return (a - b).norm(dim=1) / b.norm(dim=1).clamp(min=1e-30) > 0.1


def verdict(err, kind, tokens):
    tol = TOL[kind]
    bad = []
    for k, e in err.items():
        if k == "flipped_rows":
            continue
        if e["l2"] > tol["l2"] or e["max"] > tol["max"]:
            bad.append(k)
    if err["flipped_rows"] > (MAX_FLIPPED_ROWS * tokens if kind == "moe" else 0):
        bad.append("flipped_rows")
    return bad


def all_ok(ok, device):
    t = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def max_over_ranks(v, device):
    t = torch.tensor([v], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def gather_errors(err, device):
    """Each error figure, the largest over the ranks."""
    out = {}
    for k, e in err.items():
        if isinstance(e, dict):
            out[k] = {kk: max_over_ranks(v, device) for kk, v in e.items()}
        else:
            out[k] = int(max_over_ranks(e, device))
    return out


def run_preset(name, a, world, rank, device, ep_group, dispatchers):
    cfg = preset_config(name, world, a.experts, a.shrink)
    tokens = cfg["train"]["tokens_per_rank"]
    H = cfg["model"]["hidden"]
    tc = transformer_config(cfg, world, use_cpu_init=device.type != "cuda")
    layer = build_layer(tc, device, ep_group)
    dtype = tc.params_dtype
    g = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(tokens, 1, H, generator=g).to(device=device, dtype=dtype)
    gy = (torch.randn(tokens, 1, H, generator=g) * 0.1).to(device=device, dtype=dtype)
    timer = Timer(device)
    rows = []
    shape = {"preset": name, "world": world, "experts": tc.num_moe_experts, "topk": tc.moe_router_topk,
             "hidden": H, "ffn_hidden": tc.moe_ffn_hidden_size, "tokens_per_rank": tokens, "dtype": str(dtype)}

    def timed(fn):
        ms = []
        for i in range(a.warmup + a.iters):
            dist.barrier()
            if i < a.warmup:
                fn()
                continue
            with timer(ms):
                fn()
        return max_over_ranks(statistics.median(ms), device) if ms else None

    # Megatron's own dispatcher
    own = layer.token_dispatcher
    ref = megatron_step(layer, x, gy, collect=True)
    ms = timed(lambda: megatron_step(layer, x, gy))
    rows.append(dict(shape, variant="megatron (alltoall)", ms=ms, status="ref", errors={}))
    sync(device)

    # the same layer with moert's dispatcher backend
    for d in dispatchers:
        row = dict(shape, variant="megatron + moert %s" % d)
        try:
            mcfg = json.loads(json.dumps(cfg))
            mcfg["dispatcher"] = {"plugin": d}
            layer.token_dispatcher = own
            mm.use_moert(layer, mcfg, max_tokens=tokens)
            got = megatron_step(layer, x, gy, collect=True)
            err = errors(got, ref)
            del got
            bad = verdict(err, "dispatcher", tokens)
            row["ms"] = timed(lambda: megatron_step(layer, x, gy))
            row["errors"] = gather_errors(err, device)
            ok = all_ok(not bad, device)
            row["status"] = "PASS" if ok else "FAIL"
            row["failed"] = bad
        except Exception as e:  # noqa: BLE001 - reported in the table
            traceback.print_exc()
            row.update(status="FAIL", error="%s: %s" % (type(e).__name__, e))
        layer.token_dispatcher = own
        rows.append(row)
        sync(device)

    # the same layer with moert's dispatcher backend and moert's grouped GEMMs as its experts
    own_experts = layer.experts
    for d in (dispatchers if a.experts_all_dispatchers else dispatchers[:1]):
        row = dict(shape, variant="megatron + moert %s + experts" % d)
        try:
            mcfg = json.loads(json.dumps(cfg))
            mcfg["dispatcher"] = {"plugin": d}
            mcfg["precision"] = {"plugin": a.experts_precision}
            layer.token_dispatcher, layer.experts = own, own_experts
            mm.use_moert(layer, mcfg, max_tokens=tokens, experts=True)
            got = megatron_step(layer, x, gy, collect=True)
            err = errors(got, ref)
            del got
            bad = verdict(err, "experts", tokens)
            row["ms"] = timed(lambda: megatron_step(layer, x, gy))
            row["errors"] = gather_errors(err, device)
            ok = all_ok(not bad, device)
            row["status"] = "PASS" if ok else "FAIL"
            row["failed"] = bad
        except Exception as e:  # noqa: BLE001 - reported in the table
            traceback.print_exc()
            row.update(status="FAIL", error="%s: %s" % (type(e).__name__, e))
        layer.token_dispatcher, layer.experts = own, own_experts
        rows.append(row)
        sync(device)

    # moert.torch.MoE with the layer's weights
    layer.zero_grad(set_to_none=True)
    for d in (dispatchers if a.moe_all_dispatchers else dispatchers[:1]):
        row = dict(shape, variant="moert.torch.MoE %s" % d)
        moe = None
        try:
            base = json.loads(json.dumps(cfg))
            base["dispatcher"] = {"plugin": d}
            mcfg = mm.moert_config_from_megatron(tc, base=base)
            mcfg["parallel"] = {"device": device.type}
            moe = moert.torch.MoE(mcfg, ep_group, device=device, max_tokens=tokens)
            mm.copy_to_moert(layer, moe)
            got = moe_step(moe, x, gy, collect=True)
            err = errors(got, ref)
            flipped = flipped_rows(got, ref)
            del got
            # every rank reruns when any rank has such a token: the steps are collective
            if max_over_ranks(float(flipped.any().item()), device) > 0:
                # tokens the two fp32 routers send to different experts (near-ties) move their whole contribution:
                # compare again with their output gradient zeroed, so every gradient is held to the strict bounds
                # by the tokens both route alike; the flipped rows' own y is left out of the comparison
                gy_kept = gy.clone()
                gy_kept.reshape(-1, H)[flipped] = 0
                want = megatron_step(layer, x, gy_kept, collect=True)
                got = moe_step(moe, x, gy_kept, collect=True)
                got["y"], want["y"] = got["y"][~flipped], want["y"][~flipped]
                masked = errors(got, want)
                masked["flipped_rows"] = err["flipped_rows"]
                err = masked
                del got, want
            bad = verdict(err, "moe", tokens)
            row["ms"] = timed(lambda: moe_step(moe, x, gy))
            row["errors"] = gather_errors(err, device)
            ok = all_ok(not bad, device)
            row["status"] = "PASS" if ok else "FAIL"
            row["failed"] = bad
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            row.update(status="FAIL", error="%s: %s" % (type(e).__name__, e))
        moe = None
        rows.append(row)
        sync(device)
    layer = ref = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def table(rows):
    lines = ["%-15s %2s %5s %-34s %9s %6s  %s" % ("preset", "EP", "E", "variant", "fwd+bwd", "", "largest errors")]
    for r in rows:
        e = r.get("errors") or {}
        worst = ", ".join("%s %.1e/%.1e" % (k, v["max"], v["l2"]) for k, v in e.items() if isinstance(v, dict))
        if "flipped_rows" in e and e["flipped_rows"]:
            worst += ", flipped rows %d" % e["flipped_rows"]
        if r.get("error"):
            worst = r["error"][:200]
        ms = "%7.2f ms" % r["ms"] if r.get("ms") is not None else "       - "
        lines.append("%-15s %2d %5d %-34s %9s %6s  %s" % (r["preset"], r["world"], r["experts"], r["variant"], ms,
                                                          r["status"], worst))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", required=True, help="a meson build directory of moert (its libmoert.so and plugins)")
    ap.add_argument("--out", required=True, help="the JSON result (written by rank 0)")
    ap.add_argument("--presets", default=PRESETS)
    ap.add_argument("--dispatchers", default="", help="moert dispatchers to try (default: alltoall on one GPU; "
                    "alltoall,deepep,hybridep on more)")
    ap.add_argument("--moe-all-dispatchers", action="store_true",
                    help="moert.torch.MoE with every dispatcher (default: the first only)")
    ap.add_argument("--experts", type=int, default=0, help="experts over all ranks (default: world * E / 4)")
    ap.add_argument("--experts-all-dispatchers", action="store_true",
                    help="megatron + moert dispatcher + moert experts with every dispatcher (default: the first only)")
    ap.add_argument("--experts-precision", default="bf16",
                    help="the precision plugin of moert's experts in that variant (bf16; fp8 is held to bf16's "
                         "tolerances, so expect FAIL rows that measure its error)")
    ap.add_argument("--shrink", type=int, default=1, help="divide H, F and T by this (quick runs)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--wheels", default=os.path.join(ROOT, ".whl"), help="where the megatron-core wheels are")
    a = ap.parse_args()
    return run(a)


def run(a, device=None, backend=None):
    if "RANK" not in os.environ:  # plain `python bench/megatron_bench.py`: one rank
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29517"))
    installed = ensure_megatron(a.wheels)
    import megatron.core as megatron_core
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    workarounds = megatron_workarounds()
    if device is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group(backend or ("nccl" if device.type == "cuda" else "gloo"))
    rank, world = dist.get_rank(), dist.get_world_size()
    moert.load_library(a.build)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                             expert_model_parallel_size=world)
    torch.manual_seed(1234)
    if device.type == "cuda":
        model_parallel_cuda_manual_seed(1234)
    ep_group = parallel_state.get_expert_model_parallel_group()
    dispatchers = [d for d in (a.dispatchers or ("alltoall" if world == 1 else "alltoall,deepep,hybridep"))
                   .split(",") if d]
    rows = []
    for name in [p for p in a.presets.split(",") if p]:
        got = run_preset(name, a, world, rank, device, ep_group, dispatchers)
        rows.extend(got)
        if rank == 0:
            print(table(got), flush=True)
    passed = all(r["status"] in ("PASS", "ref") for r in rows)
    if rank == 0:
        print("\n" + table(rows))
        print("\nmegatron_bench: %s (%d checks, %d failed)" % (
            "PASS" if passed else "FAIL", sum(r["status"] != "ref" for r in rows),
            sum(r["status"] == "FAIL" for r in rows)), flush=True)
        res = {"name": "megatron_bench", "passed": passed, "world": world,
               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "megatron_core": getattr(megatron_core, "__version__", "?"),
               "megatron_from": installed, "megatron_workarounds": workarounds,
               "libmoert": moert.library_path(), "moert": moert.version(), "tolerances": TOL,
               "max_flipped_rows": MAX_FLIPPED_ROWS, "iters": a.iters, "warmup": a.warmup, "shrink": a.shrink,
               "rows": rows}
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
        print("wrote", a.out, flush=True)
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return passed


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
