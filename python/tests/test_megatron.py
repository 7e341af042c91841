# SPDX-License-Identifier: Apache-2.0
"""moert.megatron without Megatron installed: what the Megatron backend adds on top of moert.torch, tested on its
own. The routing conversions (Megatron's [T, E] routing map and probs <-> moert's [T, K] indices and weights) against
a loop reference, gradients included; the config mappings both ways on the presets (and moert's own parser accepting
them) and the refusals; the expert weight layouts through copy_to_moert into moert.torch.MoE against Megatron's
SwiGLU MLP math; and MoertDispatch, the dispatcher backend's six steps in the order Megatron's MoELayer calls them,
over a real moert.torch.Dispatcher with SequentialMLP-style experts, against the dense MoE on 1 and 2 CPU processes
(gloo). Megatron's own MoELayer against the backend is bench/megatron_bench.py (GPUs; docs/megatron.md)."""
import json
import math
import os
import types
import unittest

import torch
import torch.nn.functional as F

from common import ROOT, Case, assert_close, moert, run_distributed
import moert.megatron as mm


def random_routing(T, E, K, seed, drop=0.0, dtype=torch.float64):
    """A Megatron-style router output: logits -> top-K -> softmax over the K (post-softmax), routing_map [T, E] bool
    and probs [T, E] (0 off the map); copies dropped with probability `drop` (capacity: map False, prob 0, the kept
    probs unchanged). Returns logits (requires grad), routing_map, probs."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    top, idx = torch.topk(logits, K, dim=1)
    p = torch.softmax(top, dim=1)
    routing_map = torch.zeros(T, E, dtype=torch.bool).scatter(1, idx, True)
    probs = torch.zeros(T, E, dtype=dtype).scatter(1, idx, p)
    if drop:
        keep = torch.rand(T, E, generator=g) >= drop
        routing_map = routing_map & keep
        probs = probs * routing_map
    return logits, routing_map, probs


class RoutingConversion(Case):
    def reference(self, routing_map, probs, K):
        T = routing_map.shape[0]
        idx = torch.full((T, K), -1, dtype=torch.int32)
        w = torch.zeros(T, K, dtype=torch.float64)
        for t in range(T):
            es = [e for e in range(routing_map.shape[1]) if routing_map[t, e]][:K]
            for k, e in enumerate(es):
                idx[t, k] = e
                w[t, k] = probs[t, e].item()
        return idx, w

    def test_to_topk_matches_loop(self):
        for T, E, K, drop in ((17, 8, 2, 0.0), (33, 16, 4, 0.3), (5, 4, 4, 0.5), (9, 6, 1, 0.0), (0, 4, 2, 0.0)):
            _, rm, pr = random_routing(T, E, K, seed=T + E, drop=drop)
            idx, w = mm.routing_map_to_topk(rm, pr, K, torch.float64)
            ridx, rw = self.reference(rm, pr, K)
            self.assertEqual(idx.dtype, torch.int32)
            self.assertTrue(torch.equal(idx, ridx), "T=%d E=%d K=%d drop=%g" % (T, E, K, drop))
            self.assertTrue(torch.equal(w, rw))
            self.assertTrue(idx.is_contiguous() and w.is_contiguous())

    def test_weight_dtype(self):
        _, rm, pr = random_routing(12, 8, 2, seed=3, dtype=torch.bfloat16)
        idx, w = mm.routing_map_to_topk(rm, pr, 2)
        self.assertEqual(w.dtype, torch.float32)
        ridx, rw = self.reference(rm, pr.double(), 2)
        self.assertTrue(torch.equal(w.double(), rw))  # bf16 -> fp32 is exact

    def test_gradient_reaches_probs(self):
        logits, rm, pr = random_routing(20, 8, 3, seed=5, drop=0.2)
        gw = torch.randn(20, 3, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
        idx, w = mm.routing_map_to_topk(rm, pr, 3, torch.float64)
        got, = torch.autograd.grad((w * gw).sum(), logits, retain_graph=True)
        ridx, _ = self.reference(rm, pr.detach(), 3)
        loss = sum(pr[t, ridx[t, k]] * gw[t, k] for t in range(20) for k in range(3) if ridx[t, k] >= 0)
        want, = torch.autograd.grad(loss, logits)
        self.close(got, want, 1e-12, "d logits")

    def test_round_trip(self):
        for drop in (0.0, 0.4):
            _, rm, pr = random_routing(25, 16, 4, seed=11, drop=drop)
            idx, w = mm.routing_map_to_topk(rm, pr, 4, torch.float64)
            rm2, pr2 = mm.topk_to_routing_map(idx, w, 16)
            self.assertTrue(torch.equal(rm2, rm))
            self.assertTrue(torch.equal(pr2, pr.detach()))

    def test_bad_input(self):
        _, rm, pr = random_routing(4, 8, 2, seed=1)
        with self.assertRaisesRegex(ValueError, "same"):
            mm.routing_map_to_topk(rm, pr[:, :4], 2)
        with self.assertRaisesRegex(TypeError, "bool"):
            mm.routing_map_to_topk(rm.int(), pr, 2)
        with self.assertRaisesRegex(ValueError, "topk"):
            mm.routing_map_to_topk(rm, pr, 9)


# Megatron's TransformerConfig defaults for what the mapping reads (megatron-core 0.16.1)
MEGATRON_DEFAULTS = dict(moe_ffn_hidden_size=None, moe_router_topk=2, bf16=False, fp16=False,
                         params_dtype=torch.float32, moe_shared_expert_intermediate_size=None,
                         moe_shared_expert_gate=False, moe_shared_expert_overlap=False,
                         moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None,
                         moe_router_score_function="softmax", moe_router_pre_softmax=False,
                         moe_router_num_groups=None, moe_router_group_topk=None, moe_router_topk_scaling_factor=None,
                         moe_router_enable_expert_bias=False, moe_router_bias_update_rate=1e-3,
                         moe_expert_capacity_factor=None, moe_token_drop_policy="probs",
                         moe_pad_expert_input_to_capacity=False, moe_router_padding_for_quantization=False,
                         moe_latent_size=None, expert_tensor_parallel_size=1, gated_linear_unit=False,
                         activation_func=F.gelu, add_bias_linear=True, moe_router_dtype=None,
                         moe_input_jitter_eps=None, moe_apply_probs_on_input=False)


def megatron_config(**kw):
    d = dict(MEGATRON_DEFAULTS)
    d.update(kw)
    return types.SimpleNamespace(**d)


PRESETS = ("deepseek-v3", "deepseek-v3-shared", "qwen3-30b-a3b", "qwen3-235b-a22b", "mixtral-8x7b",
           "mixtral-8x22b", "qwen2-57b-a14b")


class ConfigMapping(Case):
    def load(self, name):
        with open(os.path.join(ROOT, "configs", name + ".json")) as f:
            return json.load(f)

    def test_presets_round_trip(self):
        for name in PRESETS:
            cfg = self.load(name)
            kw = mm.megatron_kwargs_from_moert(cfg)
            tc = megatron_config(num_layers=1, **kw)
            back = mm.moert_config_from_megatron(tc, base=cfg)
            want_model = {k: v for k, v in cfg["model"].items()}
            self.assertEqual(back["model"], want_model, name)
            want_router = {k: v for k, v in cfg["router"].items() if not (k == "load_balancing" and v == "none")}
            self.assertEqual(back["router"], want_router, name)
            for sec in ("dispatcher", "precision", "memory_policy", "train", "parallel"):
                self.assertEqual(back.get(sec), cfg.get(sec), name + " " + sec)
            moert.Config(back)  # moert's parser takes it

    def test_from_megatron(self):
        tc = megatron_config(hidden_size=64, ffn_hidden_size=256, moe_ffn_hidden_size=32, num_moe_experts=16,
                             moe_router_topk=4, bf16=True, params_dtype=torch.bfloat16, gated_linear_unit=True,
                             activation_func=F.silu, add_bias_linear=False, moe_router_score_function="sigmoid",
                             moe_router_num_groups=4, moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5,
                             moe_router_enable_expert_bias=True, moe_router_load_balancing_type="seq_aux_loss",
                             moe_aux_loss_coeff=1e-4, moe_z_loss_coeff=1e-3, moe_expert_capacity_factor=1.25,
                             moe_token_drop_policy="position", moe_shared_expert_intermediate_size=48,
                             moe_shared_expert_gate=True)
        cfg = mm.moert_config_from_megatron(tc, base={"dispatcher": {"plugin": "deepep", "num_sms": 24}},
                                            seq_length=128)
        self.assertEqual(cfg["model"], {"hidden": 64, "ffn_hidden": 32, "num_experts": 16, "topk": 4,
                                        "dtype": "bf16", "shared_expert_ffn_hidden": 48, "shared_expert_gate": True})
        self.assertEqual(cfg["router"], {"plugin": "topk", "score_function": "sigmoid", "num_groups": 4,
                                         "group_topk": 2, "scaling_factor": 2.5, "expert_bias": True,
                                         "bias_update_rate": 1e-3, "load_balancing": "seq_aux_loss",
                                         "aux_loss_coeff": 1e-4, "z_loss_coeff": 1e-3, "capacity_factor": 1.25,
                                         "drop_policy": "position"})
        self.assertEqual(cfg["dispatcher"], {"plugin": "deepep", "num_sms": 24})
        self.assertEqual(cfg["train"], {"seq_length": 128})
        # Megatron's default: aux_loss with coefficient 0 does nothing; a list of one type is that type
        tc2 = megatron_config(hidden_size=8, ffn_hidden_size=8, num_moe_experts=4, gated_linear_unit=True,
                              activation_func=F.silu, add_bias_linear=False)
        self.assertNotIn("load_balancing", mm.moert_config_from_megatron(tc2)["router"])
        tc2.moe_router_load_balancing_type, tc2.moe_aux_loss_coeff = ["aux_loss"], [0.02]
        r = mm.moert_config_from_megatron(tc2)["router"]
        self.assertEqual((r["load_balancing"], r["aux_loss_coeff"]), ("aux_loss", 0.02))
        self.assertEqual(mm.moert_config_from_megatron(tc2)["model"]["dtype"], "fp32")

    def test_pipeline_forwards_in_flight(self):
        ok = dict(hidden_size=8, ffn_hidden_size=8, num_moe_experts=4, gated_linear_unit=True,
                  activation_func=F.silu, add_bias_linear=False)
        self.assertNotIn("parallel", mm.moert_config_from_megatron(megatron_config(**ok)))
        # 1F1B's first stage holds one forward per pipeline stage, the interleaved schedule up to twice that
        tc = megatron_config(pipeline_model_parallel_size=4, **ok)
        self.assertEqual(mm.moert_config_from_megatron(tc)["parallel"], {"forwards_in_flight": 4})
        tc.virtual_pipeline_model_parallel_size = 2
        self.assertEqual(mm.forwards_in_flight(tc), 8)
        # a larger micro-batch group puts more of the warm-up on one chunk (Megatron's schedule, walked)
        tc.microbatch_group_size_per_vp_stage = 8
        self.assertEqual(mm.forwards_in_flight(tc), 15)
        tc.microbatch_group_size_per_vp_stage = None
        # the config's own value stays
        base = {"parallel": {"forwards_in_flight": 2}}
        self.assertEqual(mm.moert_config_from_megatron(tc, base=base)["parallel"]["forwards_in_flight"], 2)
        tc.pipeline_model_parallel_size = 17
        with self.assertRaises(ValueError) as cm:
            mm.moert_config_from_megatron(tc)
        self.assertIn("forwards_in_flight allows up to 32", str(cm.exception))
        moert.Config(mm.moert_config_from_megatron(megatron_config(pipeline_model_parallel_size=4, **ok)))

    def test_refusals(self):
        ok = dict(hidden_size=8, ffn_hidden_size=8, num_moe_experts=4, gated_linear_unit=True,
                  activation_func=F.silu, add_bias_linear=False)
        for bad, what in ((dict(moe_shared_expert_overlap=True), "moe_shared_expert_overlap"),
                          (dict(moe_pad_expert_input_to_capacity=True), "moe_pad_expert_input_to_capacity"),
                          (dict(moe_router_padding_for_quantization=True), "padding_for_quantization"),
                          (dict(gated_linear_unit=False), "gated_linear_unit"),
                          (dict(activation_func=F.gelu), "activation_func gelu"),
                          (dict(add_bias_linear=True), "add_bias_linear"),
                          (dict(fp16=True, params_dtype=torch.float16), "fp16"),
                          (dict(moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"],
                                moe_aux_loss_coeff=[1e-3, 1e-4]), "one balancing loss")):
            kw = dict(ok)
            kw.update(bad)
            with self.assertRaisesRegex(ValueError, what):
                mm.moert_config_from_megatron(megatron_config(**kw))
        # the dispatcher backend alone does not care about the experts' form
        mm.check_supported(megatron_config(**dict(ok, gated_linear_unit=False, add_bias_linear=True)))
        # drop-and-pad: the backend pads to the capacity, which needs a capacity factor
        mm.check_supported(megatron_config(**dict(ok, moe_pad_expert_input_to_capacity=True,
                                                  moe_expert_capacity_factor=1.0)))
        with self.assertRaisesRegex(ValueError, "without moe_expert_capacity_factor"):
            mm.check_supported(megatron_config(**dict(ok, moe_pad_expert_input_to_capacity=True)))
        # expert tensor parallelism: the backend gathers over the ETP group; the config folds the experts' width
        mm.check_supported(megatron_config(**dict(ok, expert_tensor_parallel_size=2)))
        folded = mm.moert_config_from_megatron(megatron_config(**dict(ok, expert_tensor_parallel_size=2)),
                                               base={"parallel": {"ranks": 4}})
        self.assertEqual(folded["parallel"], {"ranks": 4, "expert_tensor_parallel": 2})
        self.assertNotIn("parallel", mm.moert_config_from_megatron(megatron_config(**ok)))
        with self.assertRaisesRegex(ValueError, "moe_shared_expert_overlap"):
            mm.check_supported(megatron_config(**dict(ok, moe_shared_expert_overlap=True)))
        # what newer Megatron has that moert does not do: refused by name, never dropped
        for bad, what in ((dict(moe_expert_rank_capacity_factor=1.0), "moe_expert_rank_capacity_factor"),
                          (dict(overlap_moe_expert_parallel_comm=True), "overlap_moe_expert_parallel_comm"),
                          (dict(transformer_impl="inference_optimized"), "inference_optimized"),
                          (dict(moe_router_force_biased=True), "moe_router_force_biased"),
                          (dict(moe_enable_routing_replay=True), "moe_enable_routing_replay")):
            with self.assertRaisesRegex(ValueError, what):
                mm.check_supported(megatron_config(**dict(ok, **bad)))
        for bad, what in ((dict(glu_linear_offset=1.0), "glu_linear_offset"),
                          (dict(activation_func_clamp_value=7.0), "activation_func_clamp_value"),
                          (dict(moe_mlp_glu_interleave_size=32), "moe_mlp_glu_interleave_size"),
                          (dict(moe_router_score_function="sqrtsoftplus"), "moe_router_score_function sqrtsoftplus"),
                          (dict(moe_router_load_balancing_type=["sinkhorn"]), "routes a list holding")):
            with self.assertRaisesRegex(ValueError, what):
                mm.moert_config_from_megatron(megatron_config(**dict(ok, **bad)))
        with self.assertRaisesRegex(ValueError, "glu_linear_offset"):
            mm.check_experts_supported(megatron_config(**dict(ok, glu_linear_offset=1.0)))
        # the whole layer overlaps the all-to-alls itself: the flag is no refusal there
        mm.moert_config_from_megatron(megatron_config(**dict(ok, overlap_moe_expert_parallel_comm=True)))
        # Megatron ignores pre-softmax for sigmoid; force_load_balancing maps to the router's
        r = mm.moert_config_from_megatron(megatron_config(**dict(ok, moe_router_score_function="sigmoid",
                                                                 moe_router_pre_softmax=True,
                                                                 moe_router_force_load_balancing=True)))["router"]
        self.assertNotIn("pre_softmax", r)
        self.assertTrue(r["force_load_balancing"])


# ---- Megatron-shaped modules in plain torch (the layouts and math of megatron-core's local spec) ----


def megatron_mlp(x, w1, w2, prob=None):
    """Megatron's MLP with gated_linear_unit and silu: linear_fc1 (weight [2F, H]) -> chunk -> silu(gate) * up
    (x per-token scale) -> linear_fc2 (weight [H, F])."""
    h = x @ w1.t()
    gate, up = torch.chunk(h, 2, dim=-1)
    a = F.silu(gate) * up
    if prob is not None:
        a = (a * prob.unsqueeze(-1)).to(a.dtype)
    return a @ w2.t()


def expert_weights(E, H, Fh, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    w1 = [(torch.randn(2 * Fh, H, generator=g, dtype=torch.float64) / H ** 0.5).to(dtype) for _ in range(E)]
    w2 = [(torch.randn(H, Fh, generator=g, dtype=torch.float64) / Fh ** 0.5).to(dtype) for _ in range(E)]
    return w1, w2


class SequentialExperts(torch.nn.Module):
    """SequentialMLP's forward: the rows of each local expert (split by tokens_per_expert) through its MLP, the
    per-row probs applied after the activation."""

    def __init__(self, w1, w2):
        super().__init__()
        self.w1 = torch.nn.ParameterList([torch.nn.Parameter(w.clone()) for w in w1])
        self.w2 = torch.nn.ParameterList([torch.nn.Parameter(w.clone()) for w in w2])

    def forward(self, x, tokens_per_expert, probs):
        counts = tokens_per_expert.tolist()
        outs = [megatron_mlp(xi, self.w1[i], self.w2[i], pi)
                for i, (xi, pi) in enumerate(zip(torch.split(x, counts), torch.split(probs, counts)))]
        return torch.cat(outs) if outs else x.new_zeros(0, self.w2[0].shape[0])


class WeightLayout(Case):
    def test_layout_both_ways(self):
        w1, w2 = expert_weights(3, 8, 5, seed=2)
        fc1, fc2 = mm.expert_weights_to_moert(w1, w2)
        self.assertEqual((tuple(fc1.shape), tuple(fc2.shape)), ((3, 8, 10), (3, 5, 8)))
        x = torch.randn(7, 8, dtype=torch.float64)
        for e in range(3):
            # moert's layout: fc1 columns 0..F-1 the gate, F..2F-1 the up projection; y = (silu(x g) * x u) fc2
            h = x @ fc1[e]
            want = (F.silu(h[:, :5]) * h[:, 5:]) @ fc2[e]
            self.close(megatron_mlp(x, w1[e], w2[e]), want, 1e-14, "expert %d" % e)
        b1, b2 = mm.expert_weights_from_moert(fc1, fc2)
        self.assertTrue(all(torch.equal(a, b) for a, b in zip(b1 + b2, w1 + w2)))
        # GroupedMLP keeps weight1 [H, E*2F] and weight2 [E*F, H], viewed per expert as moert's layout
        grouped = types.SimpleNamespace(num_local_experts=3, config=types.SimpleNamespace(hidden_size=8),
                                        weight1=fc1.reshape(8, 30), weight2=fc2.reshape(15, 8))
        g1, g2 = mm.megatron_expert_weights(grouped)
        self.assertTrue(torch.equal(g1, fc1) and torch.equal(g2, fc2))
        seq = types.SimpleNamespace(local_experts=[types.SimpleNamespace(
            linear_fc1=types.SimpleNamespace(weight=a), linear_fc2=types.SimpleNamespace(weight=b))
            for a, b in zip(w1, w2)])
        s1, s2 = mm.megatron_expert_weights(seq)
        self.assertTrue(torch.equal(s1, fc1) and torch.equal(s2, fc2))
        with self.assertRaisesRegex(TypeError, "unknown experts"):
            mm.megatron_expert_weights(types.SimpleNamespace(num_local_experts=1))

    def test_copy_to_moert(self):
        """A Megatron-shaped layer (router.weight [E, H], SequentialMLP experts, a gated shared expert) copied into
        moert.torch.MoE (fp64 on the CPU) gives Megatron's output: post-softmax top-k routing, experts, shared
        expert scaled by sigmoid(x . gate)."""
        E, H, Fh, K, Fs, T = 8, 16, 12, 2, 20, 30
        w1, w2 = expert_weights(E, H, Fh, seed=4)
        s1, s2 = expert_weights(1, H, Fs, seed=6)
        g = torch.Generator().manual_seed(8)
        router = torch.randn(E, H, generator=g, dtype=torch.float64) / H ** 0.5
        gate = torch.randn(1, H, generator=g, dtype=torch.float64) / H ** 0.5
        ns = types.SimpleNamespace
        layer = ns(local_expert_indices=list(range(E)), num_local_experts=E, router=ns(weight=router, expert_bias=None),
                   experts=ns(local_experts=[ns(linear_fc1=ns(weight=a), linear_fc2=ns(weight=b))
                                             for a, b in zip(w1, w2)]),
                   shared_experts=ns(linear_fc1=ns(weight=s1[0]), linear_fc2=ns(weight=s2[0]), gate_weight=gate))
        tc = megatron_config(hidden_size=H, ffn_hidden_size=Fh, num_moe_experts=E, moe_router_topk=K,
                             params_dtype=torch.float64, gated_linear_unit=True, activation_func=F.silu,
                             add_bias_linear=False, moe_shared_expert_intermediate_size=Fs,
                             moe_shared_expert_gate=True, moe_router_load_balancing_type="none")
        cfg = mm.moert_config_from_megatron(tc, base={"train": {"tokens_per_rank": T},
                                                      "parallel": {"device": "cpu"}})
        moe = moert.torch.MoE(cfg)
        mm.copy_to_moert(layer, moe)
        x = torch.randn(T, H, generator=g, dtype=torch.float64)
        with torch.no_grad():
            y, _ = moe(x)
        logits = x @ router.t()
        top, idx = torch.topk(logits, K, dim=1)
        p = torch.softmax(top, dim=1)
        want = torch.zeros(T, H, dtype=torch.float64)
        for t in range(T):
            for k in range(K):
                e = idx[t, k].item()
                want[t] += p[t, k] * megatron_mlp(x[t:t + 1], w1[e], w2[e])[0]
        want += torch.sigmoid(x @ gate.t()) * megatron_mlp(x, s1[0], s2[0])
        self.close(y, want, 1e-12, "moert.torch.MoE with Megatron's weights")
        wrong = types.SimpleNamespace(**dict(vars(layer), local_expert_indices=[4, 5, 6, 7], num_local_experts=4))
        with self.assertRaisesRegex(ValueError, "different experts"):
            mm.copy_to_moert(wrong, moe)


# ---- the dispatcher backend's six steps over a real moert.torch.Dispatcher ----


def layer_forward(d, experts, hidden, routing_map, probs):
    """What Megatron's MoELayer.forward does around its token dispatcher (route done by the caller):
    preprocess -> dispatch -> routed_experts_compute (dispatch_postprocess, experts, combine_preprocess) -> combine ->
    postprocess."""
    h, p = d.dispatch_preprocess(hidden, routing_map, probs)
    h, p = d.token_dispatch(h, p)
    h, tpe, p = d.dispatch_postprocess(h, p)
    out = experts(h, tpe, p)
    if isinstance(out, tuple):  # Megatron's experts modules return (output, bias)
        out, bias = out
        assert bias is None
    out = d.combine_preprocess(out)
    out = d.token_combine(out)
    return d.combine_postprocess(out)


def dense_reference(x, routing_map, probs, w1, w2):
    """y[t] = sum over the experts e routed for t of probs[t, e] * MLP_e(x[t])."""
    y = torch.zeros_like(x)
    for e in range(routing_map.shape[1]):
        t = routing_map[:, e].nonzero(as_tuple=True)[0]
        if t.numel():
            y = y.index_add(0, t, megatron_mlp(x[t], w1[e], w2[e], probs[t, e]))
    return y


def rank_data(rank, T, S, E, K, H, dtype, drop):
    """Rank r's micro-batch: hidden [S, T/S, H], the router output, the output gradient (from seeds: every rank can
    make every rank's)."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(S, T // S, H, generator=g, dtype=torch.float64).to(dtype)
    gy = torch.randn(S, T // S, H, generator=g, dtype=torch.float64).to(dtype)
    logits, rm, pr = random_routing(T, E, K, seed=200 + rank, drop=drop, dtype=dtype)
    return x, gy, logits, rm, pr


def moert_experts_of(n, H, Fh, dtype, w1, w2, ep_size=1, etp_size=1, **tc_fields):
    """A MoertExperts (the experts adapter without Megatron) of n experts with Megatron-layout weights w1, w2 (with
    etp_size > 1: this rank's shards of experts of width Fh)."""
    tc = types.SimpleNamespace(hidden_size=H, moe_ffn_hidden_size=Fh, ffn_hidden_size=4 * Fh, gated_linear_unit=True,
                               activation_func=F.silu, add_bias_linear=False, params_dtype=dtype, **tc_fields)
    mx = mm.MoertExperts(n, tc, ep_size=ep_size, etp_size=etp_size, moert_config={"parallel": {"device": "cpu"}},
                         device="cpu")
    fc1, fc2 = mm.expert_weights_to_moert(w1, w2)
    with torch.no_grad():
        mx.weight1.view(n, H, -1).copy_(fc1)
        mx.weight2.view(n, -1, H).copy_(fc2)
    return mx


def etp_shard(w1, w2, j, etp):
    """Megatron's ETP shard j of an expert: fc1's rows of the gate's and the up's j-th slices, fc2's columns."""
    F2 = w1.shape[0] // 2
    Fl = F2 // etp
    return (torch.cat([w1[j * Fl:(j + 1) * Fl], w1[F2 + j * Fl:F2 + (j + 1) * Fl]]),
            w2[:, j * Fl:(j + 1) * Fl])


class PaddedExperts(torch.nn.Module):
    """The experts behind Megatron's drop-and-pad: asserts every local expert gets `rows` rows, then runs `inner`."""

    def __init__(self, inner, rows):
        super().__init__()
        self.inner, self.rows = inner, rows

    def forward(self, x, tokens_per_expert, probs):
        assert tokens_per_expert.tolist() == [self.rows] * len(tokens_per_expert), tokens_per_expert.tolist()
        assert x.shape[0] == self.rows * len(tokens_per_expert)
        return self.inner(x, tokens_per_expert, probs)


def check_backend(tc, rank, world, group, dtype, tol, drop, tokens=(24, 16), step_count=2, max_tokens=None,
                  moert_experts=False, etp=1, etp_group=None, pad_factor=None):
    """world ranks as ETP x EP (rank = etp index + etp * ep index, Megatron's expert grid): group is the rank's EP
    group, etp_group its ETP group; the experts are SequentialMLPs of the rank's ETP shard of each local expert."""
    E, K, H, Fh = 8, 3, 16, 12
    cfg = types.SimpleNamespace(hidden_size=H, num_moe_experts=E, moe_router_topk=K, moe_ffn_hidden_size=Fh,
                                ffn_hidden_size=4 * Fh)
    if pad_factor:  # Megatron's drop-and-pad: the experts get capacity x EP x ETP rows each, zeros past the real ones
        cfg.moe_pad_expert_input_to_capacity, cfg.moe_expert_capacity_factor = True, pad_factor
    ep, j = rank // etp, rank % etp
    n = E // (world // etp)
    local = list(range(ep * n, (ep + 1) * n))
    d = mm.MoertDispatch()
    d._moert_setup(n, local, cfg, group, {"dispatcher": {"plugin": "alltoall"}, "parallel": {"device": "cpu"}},
                   max_tokens=max_tokens, etp_group=etp_group)
    w1, w2 = expert_weights(E, H, Fh, seed=3, dtype=dtype)
    shards = [etp_shard(w1[e], w2[e], j, etp) for e in local]
    experts = SequentialExperts([s[0] for s in shards], [s[1] for s in shards])
    if moert_experts:  # moert's grouped GEMMs in the SequentialMLP's place: the same math, the same reference
        experts = moert_experts_of(n, H, Fh, dtype, [s[0] for s in shards], [s[1] for s in shards],
                                   ep_size=world // etp, etp_size=etp)
    for step in range(step_count):
        Ts = [tokens[(r + step) % len(tokens)] for r in range(world)]
        data = [rank_data(10 * step + r, Ts[r], 4, E, K, H, dtype, drop) for r in range(world)]
        x, gy, logits, rm, pr = data[rank]
        xr = x.clone().requires_grad_()
        for p in experts.parameters():
            p.grad = None
        run = experts
        if pad_factor:
            capacity = math.ceil(Ts[rank] * K / E * pad_factor)
            run = PaddedExperts(experts, capacity * (world // etp) * etp)
        y = layer_forward(d, run, xr, rm, pr)
        tc.assertEqual(tuple(y.shape), tuple(x.shape))
        (y * gy).sum().backward()
        what = "rank %d/%d %s step %d" % (rank, world, dtype, step)
        # the reference: every rank's tokens through the dense MoE (the local experts' gradients sum them all)
        rw1 = [w.clone().requires_grad_() for w in w1]
        rw2 = [w.clone().requires_grad_() for w in w2]
        outs = []
        for r, (xq, gq, lq, rmq, prq) in enumerate(rank_data(10 * step + r, Ts[r], 4, E, K, H, dtype, drop)
                                                   for r in range(world)):
            xq = xq.clone().requires_grad_()
            yq = dense_reference(xq.reshape(-1, H), rmq, prq, rw1, rw2)
            (yq * gq.reshape(-1, H)).sum().backward()
            outs.append((yq, xq.grad, lq.grad))
        assert_close(tc, y.reshape(-1, H), outs[rank][0], tol, what + " y")
        assert_close(tc, xr.grad, outs[rank][1], tol, what + " dx")
        assert_close(tc, logits.grad, outs[rank][2], tol, what + " d router logits (through the probs)")
        for i, e in enumerate(local):
            if moert_experts:
                g1 = experts.weight1.grad.view(n, H, -1)[i].t()
                g2 = experts.weight2.grad.view(n, -1, H)[i].t()
            else:
                g1, g2 = experts.w1[i].grad, experts.w2[i].grad
            want1, want2 = etp_shard(rw1[e].grad, rw2[e].grad, j, etp)
            assert_close(tc, g1, want1, tol, what + " fc1 of expert %d" % e)
            assert_close(tc, g2, want2, tol, what + " fc2 of expert %d" % e)
    return d


class _Checks(unittest.TestCase):
    """Assertions inside a worker process (not a test of its own)."""


def backend_worker(rank, world, dtype_name, drop, moert_experts=False):
    import torch.distributed as dist
    dtype = {"fp64": torch.float64, "fp32": torch.float32}[dtype_name]
    d = check_backend(_Checks(), rank, world, dist.group.WORLD, dtype, 1e-12 if dtype == torch.float64 else 2e-5,
                      drop, moert_experts=moert_experts)
    assert d.moert_dispatcher.world_size == world
    # the dispatcher was made for the largest first micro-batch of the group: 24 tokens
    assert d.moert_dispatcher.max_tokens == 24, d.moert_dispatcher.max_tokens


def pad_backend_worker(rank, world, dtype_name, drop):
    """Drop-and-pad over two ranks: the experts get capacity x 2 rows each."""
    import torch.distributed as dist
    dtype = {"fp64": torch.float64, "fp32": torch.float32}[dtype_name]
    check_backend(_Checks(), rank, world, dist.group.WORLD, dtype, 1e-12 if dtype == torch.float64 else 2e-5, drop,
                  tokens=(24, 24), pad_factor=4.0)


def etp_backend_worker(rank, world, etp, dtype_name, drop, moert_experts=False, pad_factor=None):
    """The backend under Megatron's expert tensor parallelism: world = ETP x EP ranks, each ETP group all-gathering
    its rows after moert's dispatch over the EP group."""
    import torch.distributed as dist
    dtype = {"fp64": torch.float64, "fp32": torch.float32}[dtype_name]
    ep_groups = [dist.new_group([j + etp * e for e in range(world // etp)]) for j in range(etp)]
    etp_groups = [dist.new_group([j + etp * e for j in range(etp)]) for e in range(world // etp)]
    # max_tokens: each EP group's ranks start with the same of the two token counts, and later take the other
    d = check_backend(_Checks(), rank, world, ep_groups[rank % etp], dtype,
                      1e-12 if dtype == torch.float64 else 2e-5, drop, max_tokens=24, moert_experts=moert_experts,
                      etp=etp, etp_group=etp_groups[rank // etp], pad_factor=pad_factor)
    assert d.moert_dispatcher.world_size == world // etp
    assert d.moert_etp_group is etp_groups[rank // etp]


class DispatcherBackend(Case):
    def test_one_rank(self):
        for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 2e-5)):
            for drop in (0.0, 0.25):
                check_backend(self, 0, 1, None, dtype, tol, drop, tokens=(24, 16, 12), step_count=3)

    def test_bf16_probs_go_back_in_their_dtype(self):
        E, K, H = 4, 2, 8
        cfg = types.SimpleNamespace(hidden_size=H, num_moe_experts=E, moe_router_topk=K, moe_ffn_hidden_size=8)
        d = mm.MoertDispatch()
        d._moert_setup(E, list(range(E)), cfg, None, {"parallel": {"device": "cpu"}})
        _, rm, pr = random_routing(8, E, K, seed=2, dtype=torch.bfloat16)
        x = torch.randn(8, 1, H, dtype=torch.float32)  # fp32 hidden states, bf16 router probs
        h, p = d.dispatch_preprocess(x, rm, pr)
        self.assertEqual(p.dtype, torch.float32)
        h, p = d.token_dispatch(h, p)
        h, tpe, p = d.dispatch_postprocess(h, p)
        self.assertEqual(p.dtype, torch.bfloat16)
        self.assertEqual(int(tpe.sum()), 16)
        y = d.combine_postprocess(d.token_combine(d.combine_preprocess(h * p.float()[:, None])))
        self.assertEqual(tuple(y.shape), (8, 1, H))
        self.close(y.reshape(8, H), x.reshape(8, H) * (pr.float().sum(1, keepdim=True)), 1e-6, "sum of probs x")

    def test_pipeline_parallel(self):
        """pipeline_model_parallel_size 3: the backend holds three micro-batches' dispatches (the config's
        forwards_in_flight from the TransformerConfig); their backwards in another order give each micro-batch's
        combine and its gradients for x and the router probs of one dispatch after the other."""
        E, K, H = 4, 2, 8

        def backend(pp):
            cfg = types.SimpleNamespace(hidden_size=H, num_moe_experts=E, moe_router_topk=K, moe_ffn_hidden_size=8,
                                        pipeline_model_parallel_size=pp)
            d = mm.MoertDispatch()
            d._moert_setup(E, list(range(E)), cfg, None, {"parallel": {"device": "cpu"}})
            return d

        def forward(d, i):
            logits, rm, pr = random_routing(12 - i, E, K, seed=40 + i)  # the first the largest
            x = torch.randn(12 - i, 1, H, dtype=torch.float64, generator=torch.Generator().manual_seed(50 + i))
            x.requires_grad_()
            h, p = d.dispatch_preprocess(x, rm, pr)
            h, p = d.token_dispatch(h, p)
            h, tpe, p = d.dispatch_postprocess(h, p)
            scale = torch.arange(1, h.shape[0] + 1, dtype=h.dtype)[:, None]  # a per-row "expert"
            y = d.combine_postprocess(d.token_combine(d.combine_preprocess(h * scale * p[:, None])))
            return x, logits, y

        seq, pipe = backend(1), backend(3)
        want = []
        for i in range(3):
            x, logits, y = forward(seq, i)
            (y * y).sum().backward()
            want.append((y.detach(), x.grad, logits.grad))
        runs = [forward(pipe, i) for i in range(3)]
        self.assertEqual(pipe.moert_dispatcher._layers.slots, 3)
        for i in (2, 0, 1):
            (runs[i][2] * runs[i][2]).sum().backward()
        for i in range(3):
            self.assertTrue(torch.equal(runs[i][2].detach(), want[i][0]), "y of micro-batch %d" % i)
            self.assertTrue(torch.equal(runs[i][0].grad, want[i][1]), "dx of micro-batch %d" % i)
            self.assertTrue(torch.equal(runs[i][1].grad, want[i][2]), "d logits of micro-batch %d" % i)

    def test_preset_as_moert_config(self):
        """A preset with a gated shared expert as the backend's config: its model section is Megatron's (the shared
        expert stays Megatron's MoELayer's), its dispatcher section used."""
        cfg = types.SimpleNamespace(hidden_size=8, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=8)
        d = mm.MoertDispatch()
        d._moert_setup(4, list(range(4)), cfg, None, os.path.join(ROOT, "configs", "qwen2-57b-a14b.json"),
                       overrides={"parallel.device": "cpu"})
        _, rm, pr = random_routing(8, 4, 2, seed=2)
        h, p = d.dispatch_preprocess(torch.randn(8, 1, 8, dtype=torch.float64), rm, pr)
        disp = d.moert_dispatcher
        with open(os.path.join(ROOT, "configs", "qwen2-57b-a14b.json")) as f:
            tokens = json.load(f)["train"]["tokens_per_rank"]  # max_tokens: the preset's
        self.assertEqual((disp.hidden, disp.num_experts, disp.topk, disp.dtype, disp.max_tokens),
                         (8, 4, 2, torch.float64, tokens))

    def test_more_tokens_than_made_for(self):
        E, K, H = 4, 2, 8
        cfg = types.SimpleNamespace(hidden_size=H, num_moe_experts=E, moe_router_topk=K, moe_ffn_hidden_size=8)
        d = mm.MoertDispatch()
        d._moert_setup(E, list(range(E)), cfg, None, {"parallel": {"device": "cpu"}}, max_tokens=10)
        _, rm, pr = random_routing(10, E, K, seed=2)
        d.dispatch_preprocess(torch.randn(10, 1, H, dtype=torch.float64), rm, pr)
        self.assertEqual(d.moert_dispatcher.max_tokens, 10)
        _, rm, pr = random_routing(12, E, K, seed=2)
        with self.assertRaisesRegex(ValueError, "max_tokens="):
            d.dispatch_preprocess(torch.randn(12, 1, H, dtype=torch.float64), rm, pr)
        with self.assertRaisesRegex(NotImplementedError, "shared expert overlap"):
            d.set_shared_experts(object())

    def test_two_ranks(self):
        run_distributed(2, backend_worker, "fp64", 0.2)
        run_distributed(2, backend_worker, "fp32", 0.0)

    def test_expert_tensor_parallel(self):
        """ETP2 x EP2 on 4 processes and ETP2 x EP1 on 2: each rank's output, input and router gradients equal the
        dense MoE's, each expert shard's weight gradients that shard of the dense ones (every rank's tokens)."""
        run_distributed(4, etp_backend_worker, 2, "fp64", 0.2)
        run_distributed(2, etp_backend_worker, 2, "fp32", 0.0)
        run_distributed(4, etp_backend_worker, 2, "fp64", 0.2, True)  # moert's experts, each a width shard

    def test_pad_to_capacity(self):
        """moe_pad_expert_input_to_capacity: every local expert gets capacity x EP x ETP rows (zeros and zero probs
        past its own), the outputs and gradients still the dense MoE's; on one rank, two, and ETP2 x EP2 (same token
        count on every rank, as Megatron's drop-and-pad assumes); more rows than the capacity is an error."""
        for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 2e-5)):
            check_backend(self, 0, 1, None, dtype, tol, 0.25, tokens=(24, 16, 12), step_count=3, pad_factor=2.0)
        run_distributed(2, pad_backend_worker, "fp64", 0.2)
        run_distributed(4, etp_backend_worker, 2, "fp64", 0.2, False, 4.0)
        E, K, H = 4, 2, 8
        cfg = types.SimpleNamespace(hidden_size=H, num_moe_experts=E, moe_router_topk=K, moe_ffn_hidden_size=8,
                                    moe_pad_expert_input_to_capacity=True, moe_expert_capacity_factor=0.25)
        d = mm.MoertDispatch()
        d._moert_setup(E, list(range(E)), cfg, None, {"parallel": {"device": "cpu"}})
        _, rm, pr = random_routing(16, E, K, seed=2)  # 8 copies an expert on average, capacity 2: not dropped to it
        h, p = d.token_dispatch(*d.dispatch_preprocess(torch.randn(16, 1, H, dtype=torch.float64), rm, pr))
        with self.assertRaisesRegex(ValueError, "more than its 2 \\(capacity 2"):
            d.dispatch_postprocess(h, p)
        # Megatron's drop-and-pad map also marks padding copies (prob 0) so that every expert has its capacity: they
        # are not routed copies (they sat at lower expert ids than the routed ones, which were lost)
        cfg.moe_expert_capacity_factor = 4.0
        d = mm.MoertDispatch()
        d._moert_setup(E, list(range(E)), cfg, None, {"parallel": {"device": "cpu"}})
        x = torch.randn(16, 1, H, dtype=torch.float64)
        _, rm, pr = random_routing(16, E, K, seed=3)
        padded = rm | (torch.arange(E).unsqueeze(0) < 2)  # experts 0 and 1 get every token, at prob 0 where unrouted
        self.assertTrue(bool((padded & ~rm).any()))
        want = d.dispatch_postprocess(*d.token_dispatch(*d.dispatch_preprocess(x, rm, pr.detach())))
        got = d.dispatch_postprocess(*d.token_dispatch(*d.dispatch_preprocess(x, padded, pr.detach())))
        for a, b in zip(want, got):
            if isinstance(a, torch.Tensor):
                self.assertTrue(torch.equal(a, b))

    def test_moert_experts(self):
        """The dispatcher backend with moert's experts (MoertExperts) in the SequentialMLP's place: the dense MoE's
        outputs and gradients, on one rank and on two."""
        for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 2e-5)):
            check_backend(self, 0, 1, None, dtype, tol, 0.25, tokens=(24, 16), step_count=2, moert_experts=True)
        run_distributed(2, backend_worker, "fp64", 0.2, True)


# ---- moert's grouped GEMMs as Megatron's experts, without Megatron ----


class ExpertsAdapter(Case):
    def test_against_sequential_mlp(self):
        """MoertExperts against SequentialMLP's math (each expert's rows through Megatron's SwiGLU MLP, the prob
        after the activation): output, dx, d probs and every expert's weight gradients; an expert without rows."""
        n, H, Fh = 4, 16, 12
        for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 2e-5)):
            w1, w2 = expert_weights(n, H, Fh, seed=8, dtype=dtype)
            seq = SequentialExperts(w1, w2)
            mx = moert_experts_of(n, H, Fh, dtype, w1, w2)
            self.assertEqual((tuple(mx.weight1.shape), tuple(mx.weight2.shape)), ((H, n * 2 * Fh), (n * Fh, H)))
            self.assertEqual(mx.weight1.dtype, dtype)
            self.assertTrue(mx.weight1.allreduce and mx.weight2.allreduce)  # one rank: not expert-parallel
            self.assertEqual(sorted(n for n, _ in mx.named_parameters()), ["weight1", "weight2"])
            g = torch.Generator().manual_seed(4)
            tpe = torch.tensor([5, 0, 7, 3])
            x = torch.randn(15, H, generator=g, dtype=torch.float64).to(dtype)
            probs = torch.rand(15, generator=g, dtype=torch.float64).to(dtype)
            gy = torch.randn(15, H, generator=g, dtype=torch.float64).to(dtype)
            xs, ps = x.clone().requires_grad_(), probs.clone().requires_grad_()
            xm, pm = x.clone().requires_grad_(), probs.clone().requires_grad_()
            ys = seq(xs, tpe, ps)
            ym, bias = mx(xm, tpe, pm)
            self.assertIsNone(bias)
            (ys * gy).sum().backward()
            (ym * gy).sum().backward()
            what = "%s" % dtype
            self.close(ym, ys, tol, what + " y")
            self.close(xm.grad, xs.grad, tol, what + " dx")
            self.close(pm.grad, ps.grad, tol, what + " d probs")
            for i in range(n):
                self.close(mx.weight1.grad.view(n, H, -1)[i].t(), seq.w1[i].grad if seq.w1[i].grad is not None
                           else torch.zeros_like(seq.w1[i]), tol, what + " fc1 %d" % i)
                self.close(mx.weight2.grad.view(n, -1, H)[i].t(), seq.w2[i].grad if seq.w2[i].grad is not None
                           else torch.zeros_like(seq.w2[i]), tol, what + " fc2 %d" % i)
            mx.backward_dw()  # Megatron's delayed wgrad hook: nothing to do

    def test_pipeline_parallel(self):
        """pipeline_model_parallel_size 3: three micro-batches' forwards in flight, their backwards in another order,
        give each micro-batch's y and dx and the accumulated weight gradients of one after the other."""
        n, H, Fh = 3, 8, 6
        w1, w2 = expert_weights(n, H, Fh, seed=11)
        seq = moert_experts_of(n, H, Fh, torch.float64, w1, w2)
        pipe = moert_experts_of(n, H, Fh, torch.float64, w1, w2, pipeline_model_parallel_size=3)
        self.assertEqual(pipe._moert_engine._layers.slots, 3)
        g = torch.Generator().manual_seed(6)
        tpe = torch.tensor([4, 1, 5])
        data = [(torch.randn(10, H, generator=g, dtype=torch.float64), torch.rand(10, generator=g,
                 dtype=torch.float64), torch.randn(10, H, generator=g, dtype=torch.float64)) for _ in range(3)]

        def forward(m, i):
            x = data[i][0].clone().requires_grad_()
            return x, m(x, tpe, data[i][1])[0]

        want = []
        for i in range(3):
            x, y = forward(seq, i)
            (y * data[i][2]).sum().backward()
            want.append((y.detach(), x.grad))
        runs = [forward(pipe, i) for i in range(3)]
        for i in (2, 0, 1):
            (runs[i][1] * data[i][2]).sum().backward()
        for i in range(3):
            self.assertTrue(torch.equal(runs[i][1].detach(), want[i][0]), "y of micro-batch %d" % i)
            self.assertTrue(torch.equal(runs[i][0].grad, want[i][1]), "dx of micro-batch %d" % i)
        self.close(pipe.weight1.grad, seq.weight1.grad, 1e-13, "weight1 grad")
        self.close(pipe.weight2.grad, seq.weight2.grad, 1e-13, "weight2 grad")

    def test_apply_probs_on_input(self):
        """moe_apply_probs_on_input (top-1): the probs scale the input, cast to its dtype, and count as 1 after."""
        n, H, Fh = 2, 8, 6
        w1, w2 = expert_weights(n, H, Fh, seed=9)
        mx = moert_experts_of(n, H, Fh, torch.float64, w1, w2, moe_apply_probs_on_input=True, moe_router_topk=1)
        g = torch.Generator().manual_seed(2)
        x = torch.randn(7, H, generator=g, dtype=torch.float64)
        probs = torch.rand(7, generator=g, dtype=torch.float64)
        tpe = torch.tensor([3, 4])
        y, _ = mx(x, tpe, probs)
        xs = probs[:, None] * x
        want = torch.cat([megatron_mlp(xs[:3], w1[0], w2[0]), megatron_mlp(xs[3:], w1[1], w2[1])])
        self.close(y, want, 1e-12, "probs on the input")

    def test_weights_from_megatron_modules(self):
        """load_megatron_weights takes a GroupedMLP's weight1/weight2 (the same memory layout) or a SequentialMLP's
        linear layers; a GroupedMLP state dict loads by name; an in-place update shows in the next forward."""
        n, H, Fh = 3, 8, 5
        w1, w2 = expert_weights(n, H, Fh, seed=10)
        fc1, fc2 = mm.expert_weights_to_moert(w1, w2)
        grouped = types.SimpleNamespace(num_local_experts=n, config=types.SimpleNamespace(hidden_size=H),
                                        weight1=fc1.reshape(H, -1), weight2=fc2.reshape(-1, H))
        mx = moert_experts_of(n, H, Fh, torch.float64, *expert_weights(n, H, Fh, seed=11))
        mx.load_megatron_weights(grouped)
        self.assertTrue(torch.equal(mx.weight1, fc1.reshape(H, -1)) and torch.equal(mx.weight2, fc2.reshape(-1, H)))
        other = moert_experts_of(n, H, Fh, torch.float64, *expert_weights(n, H, Fh, seed=12))
        other.load_state_dict({"weight1": grouped.weight1, "weight2": grouped.weight2})
        x = torch.randn(6, H, dtype=torch.float64)
        tpe, probs = torch.tensor([2, 2, 2]), torch.ones(6, dtype=torch.float64)
        self.close(other(x, tpe, probs)[0], mx(x, tpe, probs)[0], 0.0, "loaded by name")
        with torch.no_grad():
            mx.weight2.mul_(3.0)
        self.close(mx(x, tpe, probs)[0], 3 * other(x, tpe, probs)[0], 1e-14, "after an in-place update")
        with self.assertRaisesRegex(ValueError, "2 experts in the Megatron module, 3 here"):
            mx.load_megatron_weights(types.SimpleNamespace(num_local_experts=2, config=grouped.config,
                                                           weight1=fc1[:2].reshape(H, -1),
                                                           weight2=fc2[:2].reshape(-1, H)))

    def test_refusals(self):
        base = dict(hidden_size=8, moe_ffn_hidden_size=4, ffn_hidden_size=4, gated_linear_unit=True,
                    activation_func=F.silu, add_bias_linear=False, moe_router_topk=2)
        for change, needle in (({"gated_linear_unit": False}, "gated_linear_unit False"),
                               ({"activation_func": F.gelu}, "activation_func gelu"),
                               ({"add_bias_linear": True}, "add_bias_linear"),
                               ({"moe_apply_probs_on_input": True}, "moe_apply_probs_on_input with moe_router_topk 2")):
            tc = types.SimpleNamespace(**dict(base, **change))
            with self.assertRaisesRegex(ValueError, needle):
                mm.MoertExperts(2, tc, moert_config={"parallel": {"device": "cpu"}}, device="cpu")
        mm.check_experts_supported(types.SimpleNamespace(**base))
        # an FFN width that does not split over the ETP ranks
        with self.assertRaisesRegex(ValueError, "FFN width of 4 does not split over 3"):
            mm.MoertExperts(2, types.SimpleNamespace(**base), etp_size=3, moert_config={"parallel": {"device": "cpu"}},
                            device="cpu")

    def test_expert_parallel_flag(self):
        mx = moert_experts_of(2, 8, 4, torch.float64, *expert_weights(2, 8, 4, seed=1), ep_size=2)
        self.assertFalse(mx.weight1.allreduce or mx.weight2.allreduce)
        w1, w2 = expert_weights(2, 8, 4, seed=1)
        shards = [etp_shard(a, b, 1, 2) for a, b in zip(w1, w2)]
        mx = moert_experts_of(2, 8, 4, torch.float64, [s[0] for s in shards], [s[1] for s in shards], etp_size=2)
        self.assertEqual((tuple(mx.weight1.shape), tuple(mx.weight2.shape)), ((8, 2 * 2 * 2), (2 * 2, 8)))
        self.assertFalse(mx.weight1.allreduce or mx.weight2.allreduce)
        # as newer Megatron: ETP other than TP makes them expert-grid parameters too (TP 2, ETP 1, EP 1)
        mx = moert_experts_of(2, 8, 4, torch.float64, *expert_weights(2, 8, 4, seed=1), tensor_model_parallel_size=2)
        self.assertFalse(mx.weight1.allreduce or mx.weight2.allreduce)


class MegatronParts(Case):
    def test_megatron_only_where_needed(self):
        """The conversions and MoertDispatch import without Megatron; MoertTokenDispatcher needs it (an ImportError
        naming it without, a MoETokenDispatcher subclass with)."""
        try:
            from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher
        except ImportError:
            MoETokenDispatcher = None
        if MoETokenDispatcher is None:
            with self.assertRaisesRegex(ImportError, "megatron"):
                mm.MoertTokenDispatcher  # noqa: B018
            with self.assertRaisesRegex(ImportError, "megatron"):
                mm.MoertGroupedMLP  # noqa: B018
        else:
            self.assertTrue(issubclass(mm.MoertTokenDispatcher, MoETokenDispatcher))
            self.assertTrue(issubclass(mm.MoertTokenDispatcher, mm.MoertDispatch))
            self.assertTrue(issubclass(mm.MoertGroupedMLP, mm.MoertExperts))
        with self.assertRaises(AttributeError):
            mm.NoSuchThing  # noqa: B018


if __name__ == "__main__":
    unittest.main()
