# SPDX-License-Identifier: Apache-2.0
"""examples/torch/train_lm.py: the byte-level Transformer LM trains 20 steps with moert MoE feed-forward layers and
with the pure-PyTorch MoE from the same initial weights; the loss curves agree within 1e-5 relative (fp32). A
state_dict round trip (model and optimizer, the expert bias included) restores the same losses."""
import copy
import importlib.util
import os
import unittest

from common import ROOT

_spec = importlib.util.spec_from_file_location("train_lm", os.path.join(ROOT, "examples", "torch", "train_lm.py"))
train_lm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_lm)


def args(**kw):
    a = train_lm.parser().parse_args([])
    a.log_every = 5
    for k, v in kw.items():
        setattr(a, k, v)
    return a


class LanguageModel(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.data = train_lm.load_text()
        cls.lines = []

    def log(self, line):
        self.lines.append(line)

    def test_moert_equals_pure_pytorch(self):
        a = train_lm.train(args(steps=20), data=self.data, log=self.log)
        b = train_lm.train(args(steps=20, moe="torch"), data=self.data, log=self.log)
        self.assertEqual(len(a["losses"]), 20)
        self.assertLess(a["losses"][-1], a["losses"][0] - 1.0, "the model learns")
        for step, (x, y) in enumerate(zip(a["losses"], b["losses"])):
            self.assertLessEqual(abs(x - y), 1e-5 * abs(y), "step %d: moert %.9g, torch %.9g" % (step + 1, x, y))
        self.assertTrue(any(line.startswith("summary:") for line in self.lines))

    def test_state_dict_round_trip(self):
        first = train_lm.train(args(steps=8), data=self.data, log=self.log)
        state = copy.deepcopy({"model": first["model"].state_dict(), "optimizer": first["optimizer"].state_dict(),
                               "step": first["step"]})  # a checkpoint: not the live tensors
        self.assertIn("blocks.0.moe.expert_bias", state["model"])
        self.assertGreater(state["model"]["blocks.0.moe.expert_bias"].abs().max().item(), 0)
        cont = train_lm.train(args(steps=6), model=first["model"], data=self.data, log=self.log,
                              state=state)
        other = train_lm.build(args(seed=2), train_lm.torch.device("cpu"))  # another seed's weights...
        fresh = train_lm.train(args(steps=6), model=other, data=self.data, log=self.log, state=state)  # replaced
        self.assertEqual(cont["losses"], fresh["losses"])
        # and the pure-PyTorch model from the same state gives the same curve
        ref = train_lm.train(args(steps=6, moe="torch"), data=self.data, log=self.log, state=state)
        for x, y in zip(cont["losses"], ref["losses"]):
            self.assertLessEqual(abs(x - y), 1e-5 * abs(y))



def _two_ranks(rank, world, steps, out_dir):
    import json as _json
    res = {}
    for moe in ("moert", "torch"):
        res[moe] = train_lm.train(args(steps=steps, moe=moe), log=lambda line: None)["losses"]
    if rank == 0:
        with open(os.path.join(out_dir, "losses.json"), "w") as f:
            _json.dump(res, f)


class LanguageModelTwoRanks(unittest.TestCase):
    def test_expert_parallel_equals_data_parallel(self):
        """2 CPU processes: moert's experts split over the ranks (expert parallel) against the pure-PyTorch MoE
        replicated (data parallel), from the same initial weights and data."""
        import json
        import tempfile
        from common import run_distributed
        with tempfile.TemporaryDirectory() as d:
            run_distributed(2, _two_ranks, 10, d)
            with open(os.path.join(d, "losses.json")) as f:
                res = json.load(f)
        self.assertEqual(len(res["moert"]), 10)
        for step, (x, y) in enumerate(zip(res["moert"], res["torch"])):
            self.assertLessEqual(abs(x - y), 1e-5 * abs(y), "step %d: moert %.9g, torch %.9g" % (step + 1, x, y))


if __name__ == "__main__":
    unittest.main()
