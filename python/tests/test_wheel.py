# SPDX-License-Identifier: Apache-2.0
"""The wheel `pip install .` makes: built by the package's PEP 517 backend from this build directory, unpacked
into an empty folder and imported from there by a fresh interpreter with no moert variable set, it finds its
bundled libmoert.so and, beside it, the plugins the config names (moert's own search, no path rewriting), and
its MoE equals the pure-PyTorch reference."""
import json
import os
import subprocess
import sys
import tempfile
import unittest
import zipfile

import common

sys.path.insert(0, os.path.join(common.ROOT, "python", "packaging"))
import moert_build  # noqa: E402

# Run by the unpacked package: every plugin the config names (the deepep dispatcher among them) must be found
# beside the bundled library.
_CHILD = r"""
import json, sys, torch
import moert, moert.torch, moert.reference
assert moert.library_path().startswith(sys.argv[1]), moert.library_path()
cfg = json.loads(sys.argv[2])
torch.manual_seed(0)
moe = moert.torch.MoE(cfg, device="cpu", max_tokens=32)
x = torch.randn(32, cfg["model"]["hidden"], dtype=torch.float64, requires_grad=True)
y, loss = moe(x)
ref = moert.reference.MoE(cfg)
with torch.no_grad():
    for n in ("router_weight", "fc1", "fc2"):
        getattr(ref, n).copy_(getattr(moe, n))
y_ref, loss_ref = ref(x)
err = max((y - y_ref).abs().max().item(), abs(loss.item() - loss_ref.item()))
assert err < 1e-10, err
print("ok", moert.library_path(), err)
"""


class WheelTest(unittest.TestCase):
    def test_unpacked_wheel_finds_its_plugins(self):
        build = os.environ.get("MOERT_TEST_BUILD_DIR")
        if not build:
            self.fail("MOERT_TEST_BUILD_DIR is not set (run python/run_tests.sh BUILD_DIR)")
        with tempfile.TemporaryDirectory() as tmp:
            wheels, site = os.path.join(tmp, "wheels"), os.path.join(tmp, "site")
            os.makedirs(wheels)
            name = moert_build.build_wheel(wheels, {"builddir": build, "compile": "false"})
            with zipfile.ZipFile(os.path.join(wheels, name)) as z:
                names = z.namelist()
                z.extractall(site)
            self.assertIn("moert/_lib/libmoert.so", names)
            self.assertIn("moert/_lib/moert/plugins/libmoert-dispatch-deepep.so", names)
            for n in names:  # zipfile drops the mode bits
                if n.endswith(".so"):
                    os.chmod(os.path.join(site, n), 0o755)
            cfg = common.config(dtype="fp64", tokens=32)
            cfg["dispatcher"] = {"plugin": "deepep"}
            cfg["router"] = {"plugin": "topk", "score_function": "sigmoid", "load_balancing": "aux_loss",
                             "aux_loss_coeff": 0.01}
            env = {k: v for k, v in os.environ.items() if not k.startswith("MOERT_")}
            env["PYTHONPATH"] = site
            out = subprocess.run([sys.executable, "-c", _CHILD, os.path.join(site, "moert", "_lib"), json.dumps(cfg)],
                                 cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
            self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
            self.assertIn("ok", out.stdout)


if __name__ == "__main__":
    unittest.main()
