# SPDX-License-Identifier: Apache-2.0
"""moert.ab: a planted 5% slowdown is found with an interval that contains it; two identical configs of a layer agree
bit for bit and write a well-formed report (JSON with moert ab's keys, and its Markdown table); the statistics equal
tools/ab_stats.c's on the same synthetic timings (the C driver tests/unit/ab_stats_driver.c run from the build tree,
else the fixture it wrote, python/tests/ab_stats_fixture.json, which the build's ab_stats_fixture test keeps current)."""
import json
import math
import os
import random
import subprocess
import tempfile
import time
import unittest

import torch

from common import Case, config, moert  # noqa: F401  (common sets up the library)
import moert.ab  # noqa: E402

_HERE = os.path.dirname(os.path.abspath(__file__))


def c_statistics():
    """The C implementation's cases: the driver's output where the build has it, else the fixture."""
    build = os.environ.get("MOERT_TEST_BUILD_DIR")
    driver = os.path.join(build, "tests", "ab_stats_driver") if build else None
    if driver and os.access(driver, os.X_OK):
        out = subprocess.run([driver], check=True, stdout=subprocess.PIPE).stdout
        return json.loads(out), "the C driver " + driver
    with open(os.path.join(_HERE, "ab_stats_fixture.json"), encoding="utf-8") as f:
        return json.load(f), "the fixture"


class Statistics(Case):
    def test_same_as_c(self):
        data, source = c_statistics()
        if os.environ.get("MOERT_TEST_BUILD_DIR"):  # a build tree (run_tests.sh, CI) has the driver: compare with it
            self.assertNotEqual(source, "the fixture", "no tests/ab_stats_driver in the build tree")
            with open(os.path.join(_HERE, "ab_stats_fixture.json"), encoding="utf-8") as f:
                self.assertEqual(data, json.load(f), "the fixture is not what the C driver prints now")
        self.assertGreaterEqual(len(data["cases"]), 5)
        for i, case in enumerate(data["cases"]):
            iv = moert.ab.ratio_interval(case["a"], case["b"], case["seed"], case["resamples"], case["level"])
            if case["rc"] != 0:
                self.assertTrue(math.isnan(iv.ratio), "case %d" % i)
            else:
                # the same arithmetic in the same order: equal to the last bit
                self.assertEqual((iv.ratio, iv.low, iv.high), (case["ratio"], case["ci_low"], case["ci_high"]),
                                 "case %d against %s" % (i, source))
            self.assertEqual(moert.ab.verdict_text(iv), case["verdict"], "case %d" % i)
            self.assertEqual(moert.ab.noise_text(iv), case["noise"], "case %d" % i)
        for n, orders in data["orders"].items():
            self.assertEqual([moert.ab.step_order(s, int(n)) for s in range(1, len(orders) + 1)], orders)
        # the planted +5% case is found as such
        first = data["cases"][0]
        self.assertTrue(first["ci_low"] <= 1.05 <= first["ci_high"] and first["ci_low"] > 1.0, first)


class PlantedSlowdown(Case):
    def test_found_with_its_interval(self):
        # B sleeps 5% longer than A, each with its own 3% jitter per step (the noise a reviewer sees), seeded: the
        # planned durations alone give B/A 1.054 with a 95% interval of 1.035 to 1.070, so the machine's own delays
        # (a sleep overshoots by ~0.1 ms of its 8) leave the planted 1.05 well inside
        rng = random.Random(2)
        jitter = [[1.0 + 0.03 * rng.gauss(0.0, 1.0) for _ in range(40)] for _side in range(2)]

        def sleeper(side, scale):
            def step(s):
                time.sleep(0.008 * scale * jitter[side][s])
                return 1.0
            return step

        r = moert.ab.compare_steps(sleeper(0, 1.0), sleeper(1, 1.05), steps=30, warmup=2, device="cpu")
        iv = r.interval
        self.assertEqual(iv.pairs, 30)
        self.assertTrue(iv.low <= 1.05 <= iv.high, (iv, r.timing))
        self.assertGreater(iv.low, 1.0, r.timing)
        self.assertTrue(r.timing.startswith("timing (B/A, ABBA order, bootstrap over 30 paired steps): step B slower by"),
                        r.timing)
        self.assertEqual(len(r.a_ms), 32)
        self.assertTrue(r.verdict.startswith("outputs agree: yes (max relative loss difference 0.0e+00 over 32 steps, "
                                             "identical;"), r.verdict)


class IdenticalLayers(Case):
    def test_agree_and_report(self):
        cfg = config(tokens=32)
        gen = torch.Generator().manual_seed(3)
        xs = [torch.randn(32, 16, generator=gen) for _ in range(8)]
        r = moert.ab.compare_layers(cfg, cfg, lambda step: xs[step - 1], steps=5, warmup=1, device="cpu")
        ag = r.agreement
        self.assertTrue(ag["agree"] and ag["losses_identical"], r.verdict)
        self.assertEqual(r.a_losses, r.b_losses)
        fs = ag["first_step"]
        self.assertTrue(fs["compared"])
        self.assertEqual((fs["output_max_relative_difference"], fs["gradient_max_relative_difference"]), (0.0, 0.0))
        self.assertEqual(r.verdict, "outputs agree: yes (max relative loss difference 0.0e+00 over 6 steps, identical; "
                         "first step: output 0.0e+00, gradients 0.0e+00; rtol 0.01 declared by precision bf16)")
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "ab.json")
            md = r.write_report(path)
            self.assertEqual(md, os.path.join(tmp, "ab.md"))
            with open(path, encoding="utf-8") as f:
                rep = json.load(f)
            with open(md, encoding="utf-8") as f:
                table = f.read()
        for key in ("device", "seed", "warmup_steps", "measured_steps", "header", "a", "b", "b_over_a",
                    "b_over_a_intervals", "agreement", "verdict", "summary", "timing", "complete"):
            self.assertIn(key, rep)
        # moert's own figures beside the step, named as `moert ab` names them: the layer and every stage
        figs = rep["b_over_a_intervals"]["figures"]
        for name in ("step", "layer", "router", "dispatch", "fc1", "combine", "backward"):
            self.assertIn(name, figs)
            self.assertIn(name, rep["a"]["ms"])
        self.assertIn("; layer fwd+bwd ", r.timing)
        self.assertIn("| layer (ms) |", table)
        for side in ("a", "b"):  # the layer is the sum of its stages, step by step
            for st in rep[side]["steps"]:
                stages = sum(st[n + "_ms"] for n in ("router", "permute", "dispatch", "fc1", "act", "fc2", "combine",
                                                     "backward"))
                self.assertAlmostEqual(st["layer_ms"], stages, places=9)
        self.assertEqual((rep["warmup_steps"], rep["measured_steps"], rep["seed"]), (1, 5, 1))
        for side in ("a", "b"):
            st = rep[side]["steps"]
            self.assertEqual([s["warmup"] for s in st], [True] + [False] * 5)
            self.assertTrue(all(s["step_ms"] > 0 and s["loss"] > 0 for s in st))
            ms = rep[side]["ms"]["step"]
            self.assertTrue(ms["p10"] <= ms["median"] <= ms["p90"])
        iv = rep["b_over_a_intervals"]
        self.assertEqual((iv["order"], iv["level"], iv["resamples"], iv["seed"]), ("ABBA", 0.95, 2000, 20261126))
        step = iv["figures"]["step"]
        self.assertTrue(step["ci_low"] <= step["ratio"] <= step["ci_high"] and step["pairs"] == 5, step)
        self.assertAlmostEqual(step["ratio"], rep["b"]["ms"]["step"]["median"] / rep["a"]["ms"]["step"]["median"])
        self.assertEqual(rep["agreement"]["rtol"], 0.01)
        self.assertEqual(rep["verdict"], r.verdict)
        self.assertTrue(table.startswith("# moert ab\n"), table)
        self.assertIn("| figure | A median [p10-p90] | B median [p10-p90] | B/A |", table)
        self.assertIn("| figure | B/A | 95% CI | verdict |", table)
        self.assertIn(r.verdict, table)

    def test_different_recipes_and_refusals(self):
        cfg = config(tokens=32)
        fp8 = dict(cfg, precision={"plugin": "fp8"})
        gen = torch.Generator().manual_seed(4)
        x = torch.randn(32, 16, generator=gen)
        r = moert.ab.compare_layers(cfg, fp8, lambda step: x, steps=2, warmup=0, device="cpu")
        self.assertEqual(r.agreement["rtol"], 0.125)
        self.assertIn("rtol 0.125, the looser of A's precision bf16 (0.01) and B's fp8 (0.125))", r.verdict)
        self.assertIn("differs: precision: A ", "\n".join(r.header))
        self.assertGreater(r.agreement["first_step"]["gradient_max_relative_difference"], 0.0)
        with self.assertRaisesRegex(ValueError, "not an A/B: hidden is 16 in A and 32 in B"):
            moert.ab.compare_layers(cfg, config(hidden=32, tokens=32), lambda step: x, steps=1, warmup=0)


if __name__ == "__main__":
    unittest.main()
