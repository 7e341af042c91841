# SPDX-License-Identifier: Apache-2.0
"""moert.torch.MoE at one rank against the pure-PyTorch reference (moert.reference), fp32 and fp64: outputs,
router losses, gradients (x, router weight, fc1, fc2, through the router loss too), the expert bias, the state_dict,
bad input, the forwards in flight (one by default, a pipeline stage's several with $.parallel.forwards_in_flight)."""
import unittest

import torch

from common import (PRE_SOFTMAX, SIGMOID_BIAS, TOL, Case, config, full_weights, inputs, load_weights, moert)


def forward_backward(moe, x, gy, loss_scale):
    x = x.clone().requires_grad_()
    y, rl = moe(x)
    ((y * gy).sum() + loss_scale * rl).backward()
    return y.detach(), rl.detach(), x.grad


class MoEAgainstReference(Case):
    def check(self, dtype, router, tokens=40, loss_scale=0.7, steps=1):
        cfg = config(dtype=dtype, router=router, tokens=tokens)
        tol = TOL[dtype]
        w = full_weights(cfg)
        m = moert.torch.MoE(cfg)
        ref = moert.reference.MoE(cfg)
        load_weights(m, w)
        load_weights(ref, w)
        for step in range(steps):
            x, gy = inputs(cfg, tokens, seed=11 + step)
            for p in list(m.parameters()) + list(ref.parameters()):
                p.grad = None
            y, rl, dx = forward_backward(m, x, gy, loss_scale)
            y_r, rl_r, dx_r = forward_backward(ref, x, gy, loss_scale)
            what = "%s %s step %d" % (dtype, router.get("score_function"), step)
            self.close(y, y_r, tol, what + " y")
            self.close(rl, rl_r, tol, what + " router loss")
            self.close(dx, dx_r, tol, what + " dx")
            for n in ("router_weight", "fc1", "fc2"):
                self.close(getattr(m, n).grad, getattr(ref, n).grad, tol, what + " grad " + n)
            self.assertEqual(m.last_tokens_per_expert.tolist(), ref.last_tokens_per_expert.tolist())
            m.update_expert_bias()
            ref.update_expert_bias()
            if ref.expert_bias is not None:
                self.close(m.expert_bias, ref.expert_bias, 1e-6, what + " expert bias")
        return m, ref

    def test_softmax_aux_z_fp32(self):
        self.check("fp32", config()["router"])

    def test_softmax_aux_z_fp64(self):
        self.check("fp64", config()["router"])

    def test_sigmoid_expert_bias_fp32(self):
        m, ref = self.check("fp32", SIGMOID_BIAS, steps=3)
        self.assertGreater(ref.expert_bias.abs().max().item(), 0.0)

    def test_sigmoid_expert_bias_fp64(self):
        self.check("fp64", SIGMOID_BIAS, steps=3)

    def test_pre_softmax_scaling_fp64(self):
        self.check("fp64", PRE_SOFTMAX, loss_scale=0.0)

    def test_topk1_seq_aux_fp64(self):
        r = {"plugin": "topk", "score_function": "sigmoid", "load_balancing": "seq_aux_loss", "aux_loss_coeff": 0.2}
        cfg = config(dtype="fp64", router=r, topk=1)
        cfg["train"]["seq_length"] = 10
        m = moert.torch.MoE(cfg)
        ref = moert.reference.MoE(cfg)
        w = full_weights(cfg)
        load_weights(m, w)
        load_weights(ref, w)
        x, gy = inputs(cfg, 40)
        y, rl, dx = forward_backward(m, x, gy, 1.3)
        y_r, rl_r, dx_r = forward_backward(ref, x, gy, 1.3)
        self.close(y, y_r, 1e-12, "y")
        self.close(rl, rl_r, 1e-12, "router loss")
        self.close(dx, dx_r, 1e-12, "dx")
        self.close(m.router_weight.grad, ref.router_weight.grad, 1e-12, "router grad")

    def check_shared(self, dtype, gate):
        cfg = config(dtype=dtype)
        cfg["model"].update(shared_expert_ffn_hidden=12, shared_expert_gate=gate)
        m = moert.torch.MoE(cfg)
        names = ["router_weight", "fc1", "fc2", "shared_fc1", "shared_fc2"] + (["shared_gate"] if gate else [])
        self.assertEqual([n for n, _ in m.named_parameters()], names)
        self.assertEqual(tuple(m.shared_fc1.shape), (1, 16, 24))
        torch.manual_seed(4)
        ref = moert.reference.MoE(cfg)
        m.load_state_dict(ref.state_dict())
        x, gy = inputs(cfg, 40)
        y, rl, dx = forward_backward(m, x, gy, 0.3)
        y_r, rl_r, dx_r = forward_backward(ref, x, gy, 0.3)
        tol = TOL[dtype]
        self.close(y, y_r, tol, "y with a shared expert")
        self.close(dx, dx_r, tol, "dx with a shared expert")
        for n in names:
            self.close(getattr(m, n).grad, getattr(ref, n).grad, tol, "grad " + n)

    def test_shared_expert_gate_fp64(self):
        self.check_shared("fp64", True)

    def test_shared_expert_fp32(self):
        self.check_shared("fp32", False)

    def test_figures(self):
        cfg = config(dtype="fp32")
        m = moert.torch.MoE(cfg)
        x, gy = inputs(cfg, 40)
        forward_backward(m, x, gy, 1.0)
        f = m.figures()
        self.assertIn("router", f["stage_ms"])
        self.assertIn("fc1_out", f["saved_bytes"])
        self.assertGreater(f["saved_bytes"]["fc1_out"], 0)
        self.assertEqual(f["saved_bytes"]["shared_act"], 0)  # no shared expert

    def test_grads_accumulate_over_micro_batches(self):
        cfg = config(dtype="fp64")
        m = moert.torch.MoE(cfg)
        ref = moert.reference.MoE(cfg)
        load_weights(ref, (m.router_weight.detach(), m.fc1.detach(), m.fc2.detach()))
        for mb in range(2):
            x, gy = inputs(cfg, 30, seed=20 + mb)
            forward_backward(m, x, gy, 0.5)
            forward_backward(ref, x, gy, 0.5)
        for n in ("router_weight", "fc1", "fc2"):
            self.close(getattr(m, n).grad, getattr(ref, n).grad, 1e-12, "accumulated grad " + n)

    def test_inference_and_router_loss_only(self):
        cfg = config(dtype="fp64")
        m = moert.torch.MoE(cfg)
        ref = moert.reference.MoE(cfg)
        load_weights(ref, (m.router_weight.detach(), m.fc1.detach(), m.fc2.detach()))
        x, _ = inputs(cfg, 20)
        with torch.no_grad():
            y, rl = m(x)
            y_r, rl_r = ref(x)
        self.assertIsNone(y.grad_fn)
        self.close(y, y_r, 1e-12, "no-grad y")
        # only the router loss enters the loss: dy is zero
        y, rl = m(x)
        rl.backward()
        _, rl_r = ref(x)
        rl_r.backward()
        self.close(m.router_weight.grad, ref.router_weight.grad, 1e-12, "router grad from router loss alone")
        self.assertEqual(m.fc1.grad.abs().max().item(), 0.0)

    def test_state_dict_round_trip(self):
        cfg = config(dtype="fp32", router=SIGMOID_BIAS)
        a = moert.torch.MoE(cfg, init_seed=3)
        x, gy = inputs(cfg, 40)
        for _ in range(3):
            forward_backward(a, x, gy, 1.0)
            a.update_expert_bias()
        sd = a.state_dict()
        self.assertEqual(sorted(sd), ["expert_bias", "fc1", "fc2", "router_weight"])
        self.assertGreater(sd["expert_bias"].abs().max().item(), 0.0)
        b = moert.torch.MoE(cfg, init_seed=9)
        b.load_state_dict(sd)
        with torch.no_grad():
            ya, _ = a(x)
            yb, _ = b(x)
        self.assertTrue(torch.equal(ya, yb))
        self.assertTrue(torch.equal(b.state_dict()["expert_bias"], sd["expert_bias"]))
        # the reference loads the same state_dict
        ref = moert.reference.MoE(cfg)
        ref.load_state_dict(sd)
        with torch.no_grad():
            yr, _ = ref(x)
        self.close(ya, yr, TOL["fp32"], "reference from the state_dict")

    def test_init_follows_the_seed(self):
        """The same seed gives the same values, another seed others (that they are the same for any split over ranks
        is tests/unit/test_layers_api.c's, on moert_layers_init_params)."""
        cfg = config(dtype="fp64")
        a = moert.torch.MoE(cfg, init_seed=5)
        b = moert.torch.MoE(cfg, init_seed=5)
        c = moert.torch.MoE(cfg, init_seed=6)
        for n in ("router_weight", "fc1", "fc2"):
            self.assertTrue(torch.equal(getattr(a, n), getattr(b, n)), n)
            self.assertFalse(torch.equal(getattr(a, n), getattr(c, n)), n)
        self.assertEqual(tuple(a.fc1.shape), (8, 16, 48))
        self.assertEqual(tuple(a.fc2.shape), (8, 24, 16))
        self.assertEqual(tuple(a.router_weight.shape), (8, 16))

    def test_evaluation_does_not_move_the_expert_bias(self):
        """Forwards under torch.no_grad() (an evaluation between steps) are not counted for the expert bias, in moert
        as in the reference (and Megatron): the update after a training forward and an evaluation is the update
        after the training forward alone."""
        cfg = config(dtype="fp64", router=SIGMOID_BIAS)
        x, gy = inputs(cfg, 40)
        x_eval, _ = inputs(cfg, 40, seed=99)
        want = moert.torch.MoE(cfg, init_seed=4)
        forward_backward(want, x, gy, 1.0)
        want.update_expert_bias()
        self.assertGreater(want.expert_bias.abs().max().item(), 0.0)
        got = moert.torch.MoE(cfg, init_seed=4)
        ref = moert.reference.MoE(cfg)
        load_weights(ref, (got.router_weight.detach(), got.fc1.detach(), got.fc2.detach()))
        for m in (got, ref):
            forward_backward(m, x, gy, 1.0)
            with torch.no_grad():
                for _ in range(3):
                    m(x_eval)
            m.update_expert_bias()
        self.assertTrue(torch.equal(got.expert_bias, want.expert_bias))
        self.assertTrue(torch.equal(ref.expert_bias.to(got.expert_bias.dtype), want.expert_bias))
        # an evaluation alone moves nothing
        fresh = moert.torch.MoE(cfg, init_seed=4)
        with torch.no_grad():
            fresh(x_eval)
        fresh.update_expert_bias()
        self.assertEqual(fresh.expert_bias.abs().max().item(), 0.0)

    def test_not_copied(self):
        import copy
        import io
        import pickle
        m = moert.torch.MoE(config())
        for copier in (copy.deepcopy, pickle.dumps, lambda m: torch.save(m, io.BytesIO())):
            with self.assertRaises(TypeError) as cm:
                copier(m)
            self.assertIn("moert.torch.MoE cannot be copied", str(cm.exception))
            self.assertIn("state_dict", str(cm.exception))
        torch.save(m.state_dict(), io.BytesIO())  # the documented way

    def test_optimizer_hook_beside_a_scheduler(self):
        """attach_optimizer after an LR scheduler was made: the scheduler does not warn that optimizer.step() was
        overridden (torch < 2.0 wraps the step), and the step still updates the bias."""
        import warnings
        cfg = config(dtype="fp32", router=SIGMOID_BIAS)
        m = moert.torch.MoE(cfg)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
        h = moert.torch.attach_optimizer(opt, m)
        x, gy = inputs(cfg, 40)
        before = m.expert_bias.clone()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            forward_backward(m, x, gy, 1.0)
            opt.step()
            sched.step()
        self.assertEqual([str(w.message) for w in caught if "overridden" in str(w.message)], [])
        self.assertFalse(torch.equal(before, m.expert_bias))
        h.remove()

    def test_expert_parameter_names(self):
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), moert.torch.MoE(config()))
        self.assertEqual(moert.torch.expert_parameter_names(model), ["1.fc1", "1.fc2"])
        self.assertEqual(len(moert.torch.moe_modules(model)), 1)

    def test_optimizer_hook(self):
        cfg = config(dtype="fp32", router=SIGMOID_BIAS)
        model = torch.nn.Sequential()
        model.add_module("moe", moert.torch.MoE(cfg))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        h = moert.torch.attach_optimizer(opt, model)
        x, gy = inputs(cfg, 40)
        before = model.moe.expert_bias.clone()
        forward_backward(model.moe, x, gy, 1.0)
        opt.step()
        self.assertFalse(torch.equal(before, model.moe.expert_bias))  # update_expert_bias ran
        h.remove()


class BadInput(Case):
    @classmethod
    def setUpClass(cls):
        cls.cfg = config(dtype="fp32", tokens=16)
        cls.m = moert.torch.MoE(cls.cfg)

    def raises(self, exc, arg, *a):
        with self.assertRaises(exc) as cm:
            self.m(*a)
        self.assertIn(arg, str(cm.exception))
        return str(cm.exception)

    def test_dtype(self):
        self.raises(TypeError, "x", torch.randn(4, 16, dtype=torch.float64))

    def test_shape(self):
        self.raises(ValueError, "no tokens", torch.randn(0, 16))
        self.raises(ValueError, "x", torch.randn(4, 15))
        self.raises(ValueError, "x", torch.randn(4, 16, 1))
        self.raises(ValueError, "max_tokens", torch.randn(17, 16))

    def test_non_contiguous(self):
        self.raises(ValueError, "contiguous", torch.randn(16, 8).t())

    def test_not_a_tensor(self):
        self.raises(TypeError, "x", [[0.0] * 16])

    def test_device(self):
        if not torch.cuda.is_available():
            self.raises(ValueError, "x", torch.randn(4, 16, device="meta"))
        else:
            self.raises(ValueError, "x", torch.randn(4, 16, device="cuda"))

    def test_bad_param_dtype(self):
        m = moert.torch.MoE(self.cfg)
        with torch.no_grad():
            m.fc1.data = m.fc1.data.double()
        with self.assertRaises(TypeError) as cm:
            m(torch.randn(4, 16))
        self.assertIn("fc1", str(cm.exception))

    def test_config_errors(self):
        with self.assertRaises(moert.MoertError) as cm:
            moert.torch.MoE(config(topk=9))
        self.assertEqual(cm.exception.code_name, "MOERT_ERR_CONFIG")
        self.assertIn("$.model.topk", str(cm.exception))
        with self.assertRaises(moert.MoertError) as cm:
            moert.torch.MoE({"model": {"hiden": 3}})
        self.assertIn("did you mean", str(cm.exception))

    def test_backward_after_another_forward(self):
        m = moert.torch.MoE(self.cfg)
        x = torch.randn(8, 16, requires_grad=True)
        y1, _ = m(x)
        y2, _ = m(x)
        y2.sum().backward()
        with self.assertRaises(RuntimeError) as cm:
            y1.sum().backward()
        self.assertIn("1 micro-batch in flight per layer, $.parallel.forwards_in_flight", str(cm.exception))

    def test_backward_twice(self):
        """Two backward calls through one forward (the router loss, then the task loss): a clear RuntimeError."""
        m = moert.torch.MoE(self.cfg)
        x = torch.randn(8, 16, requires_grad=True)
        y, rl = m(x)
        rl.backward(retain_graph=True)
        with self.assertRaises(RuntimeError) as cm:
            y.sum().backward()
        self.assertIn("moert.torch.MoE: backward through the same forward twice", str(cm.exception))

    def test_inference_keeps_a_training_forward(self):
        """An inference forward while the layer's one slot holds a training forward raises, naming the way out,
        instead of discarding the training forward; that forward's backward then runs as if nothing happened."""
        cfg = config(dtype="fp64")
        m = moert.torch.MoE(cfg)
        ref = moert.torch.MoE(cfg)
        x, gy = inputs(cfg, 12)
        xa = x.clone().requires_grad_()
        y, rl = m(xa)
        with self.assertRaises(RuntimeError) as cm:
            with torch.no_grad():
                m(x)
        self.assertIn("inference call", str(cm.exception))
        self.assertIn("$.parallel.forwards_in_flight", str(cm.exception))
        ((y * gy).sum() + rl).backward()
        y_r, _, dx_r = forward_backward(ref, x, gy, 1.0)
        self.assertTrue(torch.equal(y.detach(), y_r))
        self.assertTrue(torch.equal(xa.grad, dx_r))
        with torch.no_grad():  # with the slot free again it runs
            self.assertTrue(torch.equal(m(x)[0], y_r))
        # with a second slot the evaluation fits beside the training forward
        two = moert.torch.MoE(cfg, overrides={"parallel.forwards_in_flight": 2})
        y2, rl2 = two(x.clone().requires_grad_())
        with torch.no_grad():
            self.assertTrue(torch.equal(two(x)[0], y_r))
        (y2.sum() + rl2).backward()

    def test_refused_conversion_leaves_the_module(self):
        """.double() on an fp32 layer is refused and the parameters stay fp32: the module still runs."""
        m = moert.torch.MoE(self.cfg)
        x = torch.randn(4, 16)
        with torch.no_grad():
            want, _ = m(x)
        with self.assertRaises(TypeError) as cm:
            m.double()
        self.assertIn("router_weight", str(cm.exception))
        self.assertEqual({p.dtype for p in m.parameters()}, {torch.float32})
        with torch.no_grad():
            self.assertTrue(torch.equal(m(x)[0], want))

    def test_pipeline_order(self):
        """$.parallel.forwards_in_flight 3: a pipeline stage's order (three forwards, then backwards and one more
        forward interleaved) gives the outputs, input gradients and accumulated gradients of one forward and backward
        after the other, bit for bit; a fourth forward in flight releases the oldest, whose backward then raises."""
        cfg = config(dtype="fp64")
        seq = moert.torch.MoE(cfg)
        pipe = moert.torch.MoE(cfg, overrides={"parallel.forwards_in_flight": 3})
        load_weights(pipe, (seq.router_weight.detach(), seq.fc1.detach(), seq.fc2.detach()))
        self.assertEqual(pipe._layers.slots, 3)
        data = [inputs(cfg, 20 + 3 * i, seed=40 + i) for i in range(4)]

        def forward(m, i):
            x = data[i][0].clone().requires_grad_()
            y, rl = m(x)
            return x, y, ((y * data[i][1]).sum() + 0.5 * rl)

        def backward(run):
            run[2].backward()
            return run[1].detach(), run[0].grad

        want = [backward(forward(seq, i)) for i in range(4)]
        runs = [forward(pipe, i) for i in range(3)]
        got = [backward(runs[0])]
        runs.append(forward(pipe, 3))
        got += [backward(runs[i]) for i in range(1, 4)]
        for i in range(4):
            self.assertTrue(torch.equal(got[i][0], want[i][0]), "y of micro-batch %d" % i)
            self.assertTrue(torch.equal(got[i][1], want[i][1]), "dx of micro-batch %d" % i)
        for n in ("router_weight", "fc1", "fc2"):
            self.assertTrue(torch.equal(getattr(pipe, n).grad, getattr(seq, n).grad), "accumulated grad " + n)
        # a fourth forward while three are in flight: the oldest is released
        runs = [forward(pipe, i) for i in range(4)]
        for i in (3, 2, 1):
            runs[i][2].backward()
        with self.assertRaises(RuntimeError) as cm:
            runs[0][2].backward()
        self.assertIn("3 micro-batches in flight per layer", str(cm.exception))


class Configs(Case):
    def test_path_string_dict_and_overrides(self):
        import json
        import os
        from common import ROOT
        path = os.path.join(ROOT, "configs", "demo-cpu.json")
        a = moert.torch.MoE(path, max_tokens=32, device="cpu")
        with open(path) as f:
            text = f.read()
        b = moert.torch.MoE(text, max_tokens=32, device="cpu")
        c = moert.torch.MoE(json.loads(text), max_tokens=32, overrides={"router.z_loss_coeff": 0.5}, device="cpu")
        d = moert.torch.MoE(moert.Config(path, {"model.hidden": 32}), max_tokens=32, device="cpu")
        for m in (a, b, c):
            self.assertEqual((m.hidden, m.num_experts, m.world_size, m.max_tokens), (64, 8, 1, 32))
        self.assertEqual(d.hidden, 32)
        self.assertIsNotNone(a.expert_bias)  # demo-cpu: sigmoid with expert bias
        x = torch.randn(32, 64)
        with torch.no_grad():
            ya, la = a(x)
            yc, lc = c(x)
        self.assertTrue(torch.equal(ya, yc))  # the same init, whatever the z-loss
        self.assertGreater(lc.item(), la.item())

    def test_errors(self):
        with self.assertRaises(FileNotFoundError):
            moert.torch.MoE("/nonexistent/moe.json")
        with self.assertRaises(moert.MoertError) as cm:
            moert.torch.MoE('{"model": {"hidden": 8,}}')
        self.assertEqual(cm.exception.code_name, "MOERT_ERR_CONFIG")
        with self.assertRaises(moert.MoertError) as cm:
            moert.torch.MoE({"dispatcher": {"plugin": "nosuch"}}, device="cpu")
        self.assertEqual(cm.exception.code_name, "MOERT_ERR_NOT_FOUND")
        self.assertIn("nosuch", str(cm.exception))
        with self.assertRaises(TypeError):
            moert.torch.MoE(3)
        self.assertTrue(moert.version())
        # a section that is not an object is refused, naming it, not replaced by the defaults
        for bad in ({"model": None}, {"model": "big"}, {"parallel": 3}):
            with self.assertRaises(moert.MoertError) as cm:
                moert.torch.MoE(bad, device="cpu")
            self.assertIn("$." + next(iter(bad)), str(cm.exception))
        with self.assertRaises(ValueError) as cm:
            moert.torch.MoE(config(), max_tokens=8.5)
        self.assertIn("max_tokens", str(cm.exception))

    def test_file_overrides_checked_together(self):
        """Overrides of a config file are merged and checked as a whole, as for a dict: a pair that must agree (the
        expert layout against $.parallel.ranks) is not refused half-set."""
        import json
        import os
        import tempfile
        cfg = config(dtype="fp64")
        cfg["parallel"].update(ranks=2, expert_tensor_parallel=2)
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(cfg, f)
        ov = {"parallel.expert_tensor_parallel": 1}
        a = moert.torch.MoE(cfg, overrides=ov)
        b = moert.torch.MoE(f.name, overrides=ov)
        x, _ = inputs(cfg, 8)
        with torch.no_grad():
            self.assertTrue(torch.equal(a(x)[0], b(x)[0]))
        # a broken file still gets moert's own message, with its line
        with open(f.name, "w") as g:
            g.write('{"model": {"hidden": 8,,}}')
        with self.assertRaises(moert.MoertError) as cm:
            moert.torch.MoE(f.name, overrides=ov)
        self.assertIn(f.name + ":1:24: invalid JSON", str(cm.exception))
        os.unlink(f.name)


if __name__ == "__main__":
    unittest.main()
