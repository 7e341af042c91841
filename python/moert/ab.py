# SPDX-License-Identifier: Apache-2.0
"""A/B comparisons from PyTorch, as `moert ab` makes them: two configs of one moert.torch.MoE layer on your own
inputs (compare_layers), or two whole training steps of your own model (compare_steps). The two sides run in turn,
ABBA (A first on odd steps, B on even ones); each step is timed with CUDA events on GPUs and time.perf_counter on
the CPU; the ratio B/A of the median step times gets a 95% percentile-bootstrap interval over the paired steps (2000
resamples, seed 20261126: the same statistics, numbers and wording as tools/ab_stats.c), and write_report() writes the
JSON report and its Markdown table with `moert ab`'s keys. See docs/python.md ("A/B from PyTorch").

    import moert.ab
    r = moert.ab.compare_layers(cfg_a, cfg_b, lambda step: torch.randn(4096, 7168, device="cuda"), steps=20)
    print(r.timing)        # timing (B/A, ABBA order, bootstrap over 20 paired steps): step B faster by 4.1% (...)
    r.write_report("ab.json")
"""
import json
import math
import os
import time

__all__ = ["compare_layers", "compare_steps", "ABResult", "Interval", "ratio_interval", "verdict_text", "noise_text",
           "step_order", "BOOTSTRAP_RESAMPLES", "BOOTSTRAP_SEED", "LEVEL"]

# as tools/cmd_ab.c: the same steps give the same interval, on every machine and in both implementations
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 20261126
LEVEL = 0.95

# The agreement tolerance the built-in precision recipes declare (moert_precision_v1.agreement_rtol in
# plugins/precision_*/; docs/abi.md has the rule); a recipe not listed gets the core's default.
DECLARED_RTOL = {"bf16": 1e-2, "fp8": 0.125}
DEFAULT_RTOL = 1e-3

_MASK64 = (1 << 64) - 1


# ---- the statistics (tools/ab_stats.c) ----

class Interval:
    """The ratio of medians B/A over `pairs` paired steps and its `level` bootstrap interval [low, high]; ratio,
    low and high are NaN when there is none (fewer than 2 pairs, or A's median is 0)."""

    def __init__(self, ratio=math.nan, low=math.nan, high=math.nan, level=LEVEL, pairs=0):
        self.ratio, self.low, self.high, self.level, self.pairs = ratio, low, high, level, pairs

    def __repr__(self):
        return "Interval(ratio=%r, low=%r, high=%r, level=%r, pairs=%r)" % (self.ratio, self.low, self.high,
                                                                          self.level, self.pairs)


def _median(v):
    v = sorted(v)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


def _next_random(state):
    """splitmix64: returns (new state, value), as next_random in tools/ab_stats.c."""
    state = (state + 0x9E3779B97F4A7C15) & _MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return state, z ^ (z >> 31)


def ratio_interval(a, b, seed=BOOTSTRAP_SEED, resamples=BOOTSTRAP_RESAMPLES, level=LEVEL):
    """median(b) / median(a) over paired values and its percentile bootstrap interval: `resamples` resamples of the
    indices (a pair kept together), drawn from `seed`. The same numbers as ab_ratio_interval in tools/ab_stats.c."""
    a, b = [float(x) for x in a], [float(x) for x in b]
    n = len(a)
    if len(b) != n:
        raise ValueError("a and b must pair up: %d and %d values" % (n, len(b)))
    out = Interval(level=level, pairs=n)
    if n < 2 or resamples < 10:
        return out
    ma, mb = _median(a), _median(b)
    if not ma > 0.0:
        return out
    ratio = mb / ma
    state = seed & _MASK64
    ratios = []
    for _ in range(resamples):
        sa, sb = [0.0] * n, [0.0] * n
        for i in range(n):
            state, r = _next_random(state)
            k = r % n
            sa[i], sb[i] = a[k], b[k]
        ra, rb = _median(sa), _median(sb)
        if ra > 0.0:
            ratios.append(rb / ra)
    kept = len(ratios)
    if kept < 10:
        return out
    ratios.sort()
    tail = 0.5 * (1.0 - level)
    lo, hi = int(math.floor(tail * (kept - 1))), int(math.ceil((1.0 - tail) * (kept - 1)))
    out.ratio, out.low, out.high = ratio, ratios[lo], ratios[hi]
    return out


def _percent(level):
    return int(math.floor(level * 100.0 + 0.5))


def verdict_text(iv):
    """'B faster by 4.1% (95% CI 3.2% to 5.0%)', 'B slower by ...' or 'no difference detected (95% CI -1.1% to
    +0.8%)', for a figure where lower is better; as ab_verdict_text."""
    if math.isnan(iv.ratio) or math.isnan(iv.low):
        return "not enough steps for an interval"
    pct = _percent(iv.level)
    c, lo, hi = 100.0 * (iv.ratio - 1.0), 100.0 * (iv.low - 1.0), 100.0 * (iv.high - 1.0)
    if iv.high < 1.0:
        return "B faster by %.1f%% (%d%% CI %.1f%% to %.1f%%)" % (-c, pct, -hi, -lo)
    if iv.low > 1.0:
        return "B slower by %.1f%% (%d%% CI %.1f%% to %.1f%%)" % (c, pct, lo, hi)
    return "no difference detected (%d%% CI %+.1f%% to %+.1f%%)" % (pct, lo, hi)


def noise_text(iv):
    """An A/A's interval as written beside a B/A verdict: "A'/A 95% CI -0.8% to +1.2%"; as ab_noise_text."""
    if math.isnan(iv.ratio) or math.isnan(iv.low):
        return "A'/A not enough steps"
    return "A'/A %d%% CI %+.1f%% to %+.1f%%" % (_percent(iv.level), 100.0 * (iv.low - 1.0), 100.0 * (iv.high - 1.0))


def step_order(step, nsides=2):
    """The sides of a step in the order they run (0 A, 1 B, 2 A'), as ab_step_order: ABBA for two sides, the six
    orders of three in turn."""
    if nsides == 3:
        return list(((0, 1, 2), (1, 2, 0), (2, 0, 1), (0, 2, 1), (1, 0, 2), (2, 1, 0))[(step - 1) % 6])
    first = 1 if step % 2 == 0 else 0
    return [first, 1 - first]


def _quantile(sorted_values, q):
    """Linear interpolation between the nearest ranks, as moert ab's table."""
    n = len(sorted_values)
    pos = q * (n - 1)
    i = int(math.floor(pos))
    if i >= n - 1:
        return sorted_values[n - 1]
    return sorted_values[i] + (pos - i) * (sorted_values[i + 1] - sorted_values[i])


def _spread(values):
    v = sorted(values)
    if not v:
        return {"median": 0.0, "p10": 0.0, "p90": 0.0}
    return {"median": _quantile(v, 0.5), "p10": _quantile(v, 0.1), "p90": _quantile(v, 0.9)}


def _relative_difference(a, b):
    if math.isnan(a) or math.isnan(b):
        return math.inf
    if a == b:
        return 0.0
    return abs(a - b) / max(abs(a), abs(b))


def _tensor_difference(a, b):
    """max |a - b| / max(|a|, |b|) over the elements of two tensors (inf where a NaN is met), as moert ab."""
    import torch

    a, b = a.detach().double().flatten().cpu(), b.detach().double().flatten().cpu()
    if a.shape != b.shape:
        raise ValueError("tensors of %d and %d elements cannot be compared" % (a.numel(), b.numel()))
    if a.numel() == 0:
        return 0.0
    if bool(torch.isnan(a).any()) or bool(torch.isnan(b).any()):
        return math.inf
    diff = float((a - b).abs().max())
    if diff == 0.0:
        return 0.0
    big = max(float(a.abs().max()), float(b.abs().max()))
    return diff / big if big > 0.0 else math.inf


# ---- running the sides ----

class _Timer:
    """Times one call: CUDA events around it on a GPU (the device synchronized before, so no earlier work is
    counted), time.perf_counter on the CPU. Returns (ms, the call's result)."""

    def __init__(self, cuda):
        self.cuda = cuda

    def __call__(self, fn, *args):
        if not self.cuda:
            t0 = time.perf_counter()
            out = fn(*args)
            return (time.perf_counter() - t0) * 1e3, out
        import torch

        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn(*args)
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)), out


def _as_loss(value):
    if value is None:
        return None
    return float(value.detach()) if hasattr(value, "detach") else float(value)


def _split_result(result):
    """A step's result: None, a loss (number or 0-dim tensor), or (loss, {name: tensor}) with tensors to compare
    after the first step."""
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict):
        return _as_loss(result[0]), result[1]
    return _as_loss(result), None


def _run(prepare, run, steps, warmup, cuda, after=None):
    """Runs both sides in ABBA order: prepare(step) (untimed, shared) then run[side](prepared, step) timed, then
    after(side) untimed when given. Returns per side the step times (ms), the losses and the first step's tensors."""
    timer = _Timer(cuda)
    ms, losses, first = [[], []], [[], []], [None, None]
    for step in range(1, warmup + steps + 1):
        prepared = prepare(step) if prepare else None
        for side in step_order(step, 2):
            t, result = timer(run[side], prepared, step)
            if after:
                after(side)
            loss, tensors = _split_result(result)
            ms[side].append(t)
            losses[side].append(loss)
            if step == 1:
                first[side] = tensors
    return ms, losses, first


class ABResult:
    """What a comparison found: per side the step times (ms) and losses of every step (warm-up first), the
    interval of B/A's median step time, the agreement, and the printed lines (`verdict`, `summary`, `timing`, as
    `moert ab` prints them). write_report(path) writes the JSON report and FILE.md."""

    def __init__(self, kind, names, header, ms, losses, first, warmup, steps, rtol, rtol_source, device, seed,
                 figures=None):
        self.kind, self.names, self.header = kind, names, header
        # moert's own figures beside the step ({name: (A's per step, B's per step)}, e.g. "layer" and each stage,
        # as `moert ab` reports them; compare_layers reads them from the layers)
        self.figures = figures or {}
        self.figure_intervals = {name: ratio_interval(fa[warmup:], fb[warmup:], BOOTSTRAP_SEED, BOOTSTRAP_RESAMPLES,
                                                      LEVEL) for name, (fa, fb) in self.figures.items()}
        self.a_ms, self.b_ms = ms
        self.a_losses, self.b_losses = losses
        self.warmup, self.steps = warmup, steps
        self.device, self.seed = device, seed
        self.interval = ratio_interval(self.a_ms[warmup:], self.b_ms[warmup:], BOOTSTRAP_SEED, BOOTSTRAP_RESAMPLES,
                                       LEVEL)
        self.a_spread, self.b_spread = _spread(self.a_ms[warmup:]), _spread(self.b_ms[warmup:])
        self.agreement = self._agreement(first, rtol, rtol_source)
        self.verdict = self._verdict()
        self.summary = self._summary()
        self.timing = "timing (B/A, ABBA order, bootstrap over %d paired steps): step %s" % (
            self.interval.pairs, verdict_text(self.interval))
        if "layer" in self.figure_intervals:
            self.timing += "; layer fwd+bwd %s" % verdict_text(self.figure_intervals["layer"])

    @property
    def ratio(self):
        """B's median step time over A's."""
        a = self.a_spread["median"]
        return self.b_spread["median"] / a if a > 0 else math.nan

    def _agreement(self, first, rtol, rtol_source):
        ag = {"rtol": rtol, "rtol_source": rtol_source, "losses_identical": True, "loss_max_relative_difference": 0.0,
              "loss_worst_step": None}
        compared = 0
        for i, (la, lb) in enumerate(zip(self.a_losses, self.b_losses)):
            if la is None or lb is None:
                continue
            compared += 1
            d = _relative_difference(la, lb)
            if d > ag["loss_max_relative_difference"]:
                ag["loss_max_relative_difference"], ag["loss_worst_step"] = d, i + 1
            if la != lb:
                ag["losses_identical"] = False
        ag["losses_compared"] = compared
        fs = {"compared": False}
        if first[0] is not None and first[1] is not None:
            fs = {"compared": True, "output_max_relative_difference": 0.0, "gradient_max_relative_difference": 0.0,
                  "gradient_worst": None}
            for name in first[0]:
                if name not in first[1]:
                    continue
                d = _tensor_difference(first[0][name], first[1][name])
                if name == "output":
                    fs["output_max_relative_difference"] = d
                elif d > fs["gradient_max_relative_difference"]:
                    fs["gradient_max_relative_difference"], fs["gradient_worst"] = d, name
        ag["first_step"] = fs
        ag["agree"] = ag["loss_max_relative_difference"] <= rtol and (
            not fs["compared"] or (fs["output_max_relative_difference"] <= rtol
                                   and fs["gradient_max_relative_difference"] <= rtol))
        return ag

    def _verdict(self):
        ag, fs = self.agreement, self.agreement["first_step"]
        if fs["compared"]:
            worst = " (%s)" % fs["gradient_worst"] if fs["gradient_worst"] else ""
            first = "first step: output %.1e, gradients %.1e%s" % (fs["output_max_relative_difference"],
                                                                  fs["gradient_max_relative_difference"], worst)
        else:
            first = "first step's output and gradients not compared (the steps returned none)"
        where = " (step %d)" % ag["loss_worst_step"] if ag["loss_max_relative_difference"] > 0 else ""
        return "outputs agree: %s (max relative loss difference %.1e%s over %d steps%s; %s; rtol %g%s)" % (
            "yes" if ag["agree"] else "no", ag["loss_max_relative_difference"], where, ag["losses_compared"],
            ", identical" if ag["losses_identical"] else "", first, ag["rtol"], self._rtol_suffix())

    def _rtol_suffix(self):
        src = self.agreement["rtol_source"]
        return (", " if src.startswith("the looser") else " ") + src

    def _summary(self):
        r = self.ratio
        faster = ""
        if math.isfinite(r) and r != 1.0:
            faster = " (B %.1f%% %s)" % (abs(1.0 - r) * 100.0, "faster" if r < 1.0 else "slower")
        return "summary: B/A step time %.3fx%s; outputs %s" % (r, faster,
                                                               "agree" if self.agreement["agree"] else "differ")

    def _steps_json(self, ms, losses):
        return [{"step": i + 1, "loss": _finite(losses[i]), "step_ms": _finite(ms[i]), "warmup": i < self.warmup}
                for i in range(len(ms))]

    def report(self):
        """The JSON report as a dict, with `moert ab`'s keys where they apply."""
        iv = self.interval
        figures = {}
        for name, fiv in [("step", iv)] + list(self.figure_intervals.items()):
            if not math.isnan(fiv.ratio):
                figures[name] = {"ratio": _finite(fiv.ratio), "ci_low": _finite(fiv.low),
                                 "ci_high": _finite(fiv.high), "pairs": fiv.pairs, "verdict": verdict_text(fiv)}
        sides = {}
        for i, (key, name, ms, losses, spread) in enumerate((("a", self.names[0], self.a_ms, self.a_losses,
                                                              self.a_spread),
                                                             ("b", self.names[1], self.b_ms, self.b_losses,
                                                              self.b_spread))):
            side_ms = {"step": {k: _finite(v) for k, v in spread.items()}}
            for fname, pair in self.figures.items():
                side_ms[fname] = {k: _finite(v) for k, v in _spread(pair[i][self.warmup:]).items()}
            steps_json = self._steps_json(ms, losses)
            for j, st in enumerate(steps_json):
                for fname, pair in self.figures.items():
                    st[fname + "_ms"] = _finite(pair[i][j])
            sides[key] = {"name": name, "ms": side_ms, "completed_steps": len(ms), "steps": steps_json}
        ag = json.loads(json.dumps(self.agreement, default=str))
        for k in ("loss_max_relative_difference",):
            ag[k] = _finite(ag[k])
        fs = ag["first_step"]
        for k in ("output_max_relative_difference", "gradient_max_relative_difference"):
            if k in fs:
                fs[k] = _finite(fs[k])
        ag.pop("losses_compared", None)
        return {"tool": "moert.ab.%s" % self.kind, "device": self.device, "seed": self.seed,
                "warmup_steps": self.warmup, "measured_steps": self.steps, "header": self.header,
                "a": sides["a"], "b": sides["b"], "b_over_a": {"step": _finite(self.ratio)},
                "b_over_a_intervals": {"order": "ABBA", "level": LEVEL, "resamples": BOOTSTRAP_RESAMPLES,
                                       "seed": BOOTSTRAP_SEED, "figures": figures},
                "agreement": ag, "verdict": self.verdict, "summary": self.summary, "timing": self.timing,
                "complete": True, "failure": None}

    def markdown(self):
        """The Markdown table, as `moert ab --report` writes it beside the JSON."""
        def cell(s):
            return "%.3f [%.3f-%.3f]" % (s["median"], s["p10"], s["p90"])
        a = self.a_spread["median"]
        lines = ["# moert ab", ""] + ["- %s" % h for h in self.header]
        lines += ["", "| figure | A median [p10-p90] | B median [p10-p90] | B/A |", "|---|---:|---:|---:|",
                  "| step (ms) | %s | %s | %s |" % (cell(self.a_spread), cell(self.b_spread),
                                                   "%.3f" % (self.b_spread["median"] / a) if a > 0 else "-")]
        for name, (fa, fb) in self.figures.items():
            sa, sb = _spread(fa[self.warmup:]), _spread(fb[self.warmup:])
            ratio = "%.3f" % (sb["median"] / sa["median"]) if sa["median"] > 0 else "-"
            lines.append("| %s (ms) | %s | %s | %s |" % (name, cell(sa), cell(sb), ratio))
        lines += ["", self.verdict, "", self.summary, "", "| figure | B/A | 95% CI | verdict |", "|---|---:|---|---|"]
        for name, fiv in [("step", self.interval)] + list(self.figure_intervals.items()):
            if not (math.isnan(fiv.ratio) or math.isnan(fiv.low)):
                lines.append("| %s | %.3f | %.3f-%.3f | %s |"
                             % (name, fiv.ratio, fiv.low, fiv.high, verdict_text(fiv)))
        return "\n".join(lines) + "\n"

    def write_report(self, path):
        """Writes the JSON report to path and the Markdown table beside it (FILE.json -> FILE.md, else path + .md),
        each to a temporary file renamed into place."""
        md = path[:-5] + ".md" if path.endswith(".json") else path + ".md"
        _write_atomically(path, json.dumps(self.report(), indent=1) + "\n")
        _write_atomically(md, self.markdown())
        return md

    def __str__(self):
        return "\n".join([self.verdict, self.summary, self.timing])


def _finite(v):
    return v if isinstance(v, (int, float)) and math.isfinite(v) else None


def _write_atomically(path, text):
    tmp = "%s.%d.tmp" % (path, os.getpid())
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def _resolve_rtol(rtol, precisions):
    """--rtol's rule: the given tolerance, else the looser of what the two sides' precision recipes declare."""
    if rtol is not None:
        return float(rtol), "from rtol="
    ra, rb = (DECLARED_RTOL.get(p, DEFAULT_RTOL) for p in precisions)
    if precisions[0] == precisions[1]:
        return ra, "declared by precision %s" % precisions[0]
    return max(ra, rb), "the looser of A's precision %s (%g) and B's %s (%g)" % (precisions[0], ra, precisions[1], rb)


def compare_steps(step_a, step_b, *, steps=20, warmup=3, rtol=None, device=None, names=("A", "B")):
    """Times two training steps of your own, ABBA. step_a(step) and step_b(step) (step counts from 1; warm-up steps
    first, not measured) run one whole step each and return None, the loss (a number or 0-dim tensor), or (loss,
    {name: tensor}) with tensors to compare after the first step ("output" is the output, every other name a
    gradient). Both see the same step numbers: draw the same data from them. device: "cuda" times with CUDA events
    (the device synchronized around each step), "cpu" with time.perf_counter; default cuda where torch has
    initialized CUDA. rtol: the agreement's tolerance (default: bf16's, 1e-2)."""
    if steps < 1 or warmup < 0:
        raise ValueError("steps >= 1 and warmup >= 0 expected, got %d and %d" % (steps, warmup))
    cuda = _use_cuda(device)
    ms, losses, first = _run(None, (lambda _p, s: step_a(s), lambda _p, s: step_b(s)), steps, warmup, cuda)
    tol, source = (float(rtol), "from rtol=") if rtol is not None else (DECLARED_RTOL["bf16"],
                                                                         "by default (bf16's declared)")
    header = ["A %s vs B %s (moert.ab.compare_steps)" % names, "on %s" % ("cuda" if cuda else "cpu"),
              "%d warm-up step%s, then %d measured step%s, interleaved ABBA: A first on odd steps, B on even ones"
              % (warmup, "" if warmup == 1 else "s", steps, "" if steps == 1 else "s")]
    return ABResult("compare_steps", list(names), header, ms, losses, first, warmup, steps, tol, source,
                    "cuda" if cuda else "cpu", None)


def _use_cuda(device):
    import torch

    if device is None:
        return torch.cuda.is_available() and torch.cuda.is_initialized()
    return torch.device(device).type == "cuda"


def compare_layers(config_a, config_b, x_fn, *, steps=20, warmup=3, rtol=None, device=None, max_tokens=None,
                   overrides=None, init_seed=1, process_group=None):
    """Times one moert.torch.MoE layer built from config_a against one built from config_b, on your inputs:
    x_fn(step) -> x [T, H] (the model's dtype, on the layer's device; called once per step, untimed, and given to
    both sides). A step is the layer's forward and backward of loss = mean(y^2) + router_loss, without an optimizer
    step (both layers keep init_seed's weights, so the same x gives comparable losses). The two layers must be the
    same model (hidden, ffn_hidden, num_experts, topk, dtype, device). After the first step the outputs and every
    parameter gradient are compared; rtol default: the looser of what the two precision recipes declare."""
    from .torch import MoE

    layers = [MoE(c, process_group, device=device, max_tokens=max_tokens, overrides=overrides, init_seed=init_seed)
              for c in (config_a, config_b)]
    a, b = layers
    for key in ("hidden", "ffn_hidden", "num_experts", "topk", "dtype", "device"):
        if getattr(a, key) != getattr(b, key):
            raise ValueError("not an A/B: %s is %s in A and %s in B" % (key, getattr(a, key), getattr(b, key)))
    precisions = [m._layers.config.get("precision.plugin", "bf16") for m in layers]

    def prepare(step):
        return x_fn(step).detach()

    # moert's own figures of each step's forward and backward: every stage and their sum, "layer", named as moert ab
    # names them
    figs = ({}, {})

    def record(side):
        stages = layers[side].figures()["stage_ms"]
        for name, value in list(stages.items()) + [("layer", sum(stages.values()))]:
            figs[side].setdefault(name, []).append(value)

    def runner(moe):
        def run(x, step):
            moe.zero_grad(set_to_none=True)
            y, router_loss = moe(x)
            loss = y.float().square().mean() + router_loss
            loss.backward()
            if step != 1:
                return loss
            tensors = {"output": y.detach().clone()}
            for name, p in moe.named_parameters():
                if p.grad is not None:
                    tensors[name] = p.grad.detach().clone()
            return loss, tensors
        return run

    cuda = a.device.type == "cuda"
    ms, losses, first = _run(prepare, (runner(a), runner(b)), steps, warmup, cuda, after=record)
    order = ["layer"] + [n for n in figs[0] if n != "layer"]
    figures = {n: (figs[0][n], figs[1][n]) for n in order if n in figs[1]}
    tol, source = _resolve_rtol(rtol, precisions)
    sections = []
    for key in ("router", "dispatcher", "precision", "memory_policy"):
        sa, sb = (m._layers.config.get(key) for m in layers)
        if sa != sb:
            sections.append("differs: %s: A %s, B %s" % (key, json.dumps(sa, sort_keys=True),
                                                          json.dumps(sb, sort_keys=True)))
    names = [m._layers.config.get("name", "A" if m is a else "B") for m in layers]
    header = ["A \"%s\" vs B \"%s\" (moert.ab.compare_layers)" % tuple(names),
              "on %s; one layer, H=%d F=%d E=%d K=%d, rank %d of %d, %s" % (a.device, a.hidden, a.ffn_hidden,
                                                                          a.num_experts, a.topk, a.rank, a.world_size,
                                                                          str(a.dtype).replace("torch.", ""))]
    header += sections
    header.append("%d warm-up step%s, then %d measured step%s, interleaved ABBA: A first on odd steps, B on even ones"
                  % (warmup, "" if warmup == 1 else "s", steps, "" if steps == 1 else "s"))
    return ABResult("compare_layers", names, header, ms, losses, first, warmup, steps, tol, source, str(a.device),
                    init_seed, figures)
