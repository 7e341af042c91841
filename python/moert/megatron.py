# SPDX-License-Identifier: Apache-2.0
"""moert under Megatron Core's MoELayer: a token dispatcher backend (MoertTokenDispatcher, a subclass of Megatron's
MoETokenDispatcher) that moves the tokens through moert.torch.Dispatcher, so moert's JSON config picks alltoall,
deepep or hybridep underneath, and the conversions between Megatron's and moert's formats (routing map and probs,
configs, expert weights). One line puts it into a built model:

    import moert.megatron
    moert.megatron.use_moert(model, "my-moert.json")      # every MoELayer of model now dispatches through moert

See docs/megatron.md. Megatron is imported only by what needs it (MoertTokenDispatcher, use_moert,
patch_moe_layers): the conversions below need torch alone."""
import json
import math
import os
import types

import torch

__all__ = ["routing_map_to_topk", "topk_to_routing_map", "moert_config_from_megatron", "megatron_kwargs_from_moert",
           "expert_weights_to_moert", "expert_weights_from_moert", "megatron_expert_weights", "copy_to_moert",
           "MoertDispatch", "MoertExperts", "use_moert", "patch_moe_layers"]
# and MoertTokenDispatcher, MoertGroupedMLP (they import Megatron)

# ---- routing: Megatron's [T, E] map and probs <-> moert's [T, K] indices and weights ----


def routing_map_to_topk(routing_map, probs, topk, weight_dtype=torch.float32):
    """Megatron's router output (routing_map [T, E] bool, probs [T, E]) as moert's dispatch input: topk_idx [T, K]
    int32 (each token's experts in ascending order, -1 for an empty slot: a token with fewer than K experts, e.g.
    dropped by capacity) and topk_weights [T, K] in weight_dtype, the probs at those experts (0 in empty slots).
    Differentiable in probs: the gradient of topk_weights goes back to probs at the routed positions. A token with
    more than K experts in the map keeps its K lowest (Megatron's padding for quantization makes such maps; refused
    by use_moert)."""
    if routing_map.dim() != 2 or probs.shape != routing_map.shape:
        raise ValueError("routing_map and probs: expected the same [T, E] shape, got %s and %s"
                         % (list(routing_map.shape), list(probs.shape)))
    if routing_map.dtype != torch.bool:
        raise TypeError("routing_map: expected dtype torch.bool, got %s" % routing_map.dtype)
    T, E = routing_map.shape
    if not 1 <= topk <= E:
        raise ValueError("topk: expected 1..%d, got %d" % (E, topk))
    # a stable sort of (not routed) puts each row's routed experts first, in ascending order
    key = (~routing_map).to(torch.int32)
    _, order = torch.sort(key, dim=1, stable=True)
    idx = order[:, :topk].contiguous()
    valid = routing_map.gather(1, idx)
    w = probs.gather(1, idx).to(weight_dtype)
    w = torch.where(valid, w, torch.zeros((), dtype=weight_dtype, device=w.device))
    idx = torch.where(valid, idx, torch.full((), -1, dtype=idx.dtype, device=idx.device))
    return idx.to(torch.int32).contiguous(), w.contiguous()


def topk_to_routing_map(topk_idx, topk_weights, num_experts, probs_dtype=None):
    """The inverse: moert's topk_idx [T, K] (-1: empty) and topk_weights [T, K] as Megatron's routing_map [T, E]
    bool and probs [T, E] (0 where not routed; probs_dtype, default topk_weights'). Differentiable in topk_weights."""
    if topk_idx.dim() != 2 or topk_weights.shape != topk_idx.shape:
        raise ValueError("topk_idx and topk_weights: expected the same [T, K] shape, got %s and %s"
                         % (list(topk_idx.shape), list(topk_weights.shape)))
    T = topk_idx.shape[0]
    dt = probs_dtype or topk_weights.dtype
    valid = topk_idx >= 0
    col = torch.where(valid, topk_idx.long(), torch.full((), num_experts, dtype=torch.long, device=topk_idx.device))
    routing_map = torch.zeros(T, num_experts + 1, dtype=torch.bool, device=topk_idx.device)
    routing_map.scatter_(1, col, valid)
    w = torch.where(valid, topk_weights.to(dt), torch.zeros((), dtype=dt, device=topk_weights.device))
    probs = torch.zeros(T, num_experts + 1, dtype=dt, device=topk_weights.device).scatter(1, col, w)
    return routing_map[:, :num_experts].contiguous(), probs[:, :num_experts].contiguous()


# ---- configs ----

_MOERT_DTYPE = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}
_TORCH_DTYPE = {v: k for k, v in _MOERT_DTYPE.items()}


def _get(tc, name, default=None):
    v = getattr(tc, name, default)
    return default if v is None else v


def _balancing(tc):
    """(load_balancing, aux_loss_coeff) of a Megatron config: one type (a list of one), coefficient 0 -> none."""
    kind = _get(tc, "moe_router_load_balancing_type", "aux_loss")
    coeff = _get(tc, "moe_aux_loss_coeff", 0.0)
    if isinstance(kind, (list, tuple)):
        if "sinkhorn" in kind:
            # Megatron routes by Sinkhorn only for the string "sinkhorn"; a list holding it routes by top-k
            raise ValueError("moert.megatron: moe_router_load_balancing_type %s: Megatron routes a list holding "
                             "\"sinkhorn\" by plain top-k; give \"sinkhorn\" alone for Sinkhorn routing" % list(kind))
        coeffs = list(coeff) if isinstance(coeff, (list, tuple)) else [coeff] * len(kind)
        live = [(k, c) for k, c in zip(kind, coeffs) if k not in ("none",) and (c or k == "sinkhorn")]
        if len(live) > 1:
            raise ValueError("moert.megatron: moe_router_load_balancing_type %s: moert applies one balancing loss"
                             % list(kind))
        kind, coeff = live[0] if live else ("none", 0.0)
    elif isinstance(coeff, (list, tuple)):
        coeff = coeff[0] if coeff else 0.0
    if kind in ("aux_loss", "seq_aux_loss", "global_aux_loss") and not coeff:
        return "none", 0.0
    if kind not in ("none", "aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn"):
        raise ValueError("moert.megatron: moe_router_load_balancing_type %r has no moert equivalent" % kind)
    return kind, float(coeff) if kind != "none" else 0.0


def _layer_dtype(tc):
    pd = getattr(tc, "params_dtype", None)
    if getattr(tc, "bf16", False) or pd == torch.bfloat16:
        return "bf16"
    if getattr(tc, "fp16", False) or pd == torch.float16:
        raise ValueError("moert.megatron: fp16 layers are not supported (moert's dtypes: bf16, fp32, fp64)")
    return _MOERT_DTYPE.get(pd, "fp32")


def _interleaved_in_flight(pp, vpp, group):
    """The most forwards one model chunk holds before their backwards in Megatron's interleaved 1F1B on the first
    pipeline stage (the longest warm-up): (pp - 1) * 2 + (vpp - 1) * group warm-up forwards, virtual micro-batch k on
    chunk (k // group) % vpp forward and vpp - 1 - that backward, then one forward and one backward a step. Counted
    by walking the schedule (enough micro-batches that the count no longer grows)."""
    total = 8 * pp * vpp * group
    warmup = (pp - 1) * 2 + (vpp - 1) * group
    held = [0] * vpp
    most = 0
    for k in range(total):
        held[(k // group) % vpp] += 1
        most = max(most, max(held))
        j = k - warmup  # the backward of the steady step that runs this forward
        if j >= 0:
            held[vpp - 1 - (j // group) % vpp] -= 1
    return most


def forwards_in_flight(tc):
    """The forwards each MoE layer holds before their backwards under tc's pipeline schedule: 1F1B's warm-up on the
    first stage holds one per pipeline stage (pipeline_model_parallel_size); the interleaved schedule
    (virtual_pipeline_model_parallel_size) as many as its warm-up puts on one model chunk (twice the stages with
    Megatron's default microbatch_group_size_per_vp_stage); moert's $.parallel.forwards_in_flight for it."""
    pp = int(_get(tc, "pipeline_model_parallel_size", 1) or 1)
    vpp = int(_get(tc, "virtual_pipeline_model_parallel_size", 1) or 1)
    group = int(_get(tc, "microbatch_group_size_per_vp_stage", pp) or pp)
    n = _interleaved_in_flight(pp, vpp, group) if pp > 1 and vpp > 1 else pp
    if n > 32:
        raise ValueError("moert.megatron: pipeline_model_parallel_size %d%s holds %d forwards of a layer in flight; "
                         "moert's $.parallel.forwards_in_flight allows up to 32" % (pp, " (interleaved)" if vpp > 1
                                                                                     else "", n))
    return n


def _set_forwards_in_flight(cfg, tc):
    """Sets $.parallel.forwards_in_flight in a config dict from tc's pipeline, unless the config sets it."""
    n = forwards_in_flight(tc)
    if n > 1:
        cfg.setdefault("parallel", {}).setdefault("forwards_in_flight", n)


def _swiglu_variants(tc):
    """The SwiGLU variants of newer Megatron that moert's experts do not compute (plain silu(gate) * up, fc1's rows
    [gate; up]): what tc sets of them, for a refusal."""
    bad = []
    if _get(tc, "glu_linear_offset", 0.0):
        bad.append("glu_linear_offset %s (moert's SwiGLU has no offset)" % tc.glu_linear_offset)
    if _get(tc, "activation_func_clamp_value", None) is not None:
        bad.append("activation_func_clamp_value (moert's SwiGLU does not clamp)")
    if _get(tc, "moe_mlp_glu_interleave_size", None):
        bad.append("moe_mlp_glu_interleave_size (moert's fc1 is [gate; up], not interleaved)")
    if _get(tc, "moe_shared_expert_glu_interleave_size", None):
        bad.append("moe_shared_expert_glu_interleave_size")
    return bad


def check_supported(tc, whole_layer=False):
    """Refuses (ValueError, naming the option) what the dispatcher backend (or, with whole_layer, moert.torch.MoE in
    place of the MoELayer) cannot do for a Megatron TransformerConfig (or any object with its attribute names)."""
    bad = []
    if _get(tc, "moe_shared_expert_overlap", False):
        bad.append("moe_shared_expert_overlap (the shared expert runs inside Megatron's own dispatcher; "
                   "leave it off: MoELayer then runs the shared expert itself)")
    if _get(tc, "moe_router_padding_for_quantization", False):
        bad.append("moe_router_padding_for_quantization (it adds routed copies past top-k)")
    if _get(tc, "moe_latent_size", None):
        bad.append("moe_latent_size")
    if _get(tc, "moe_pad_expert_input_to_capacity", False) and _get(tc, "moe_expert_capacity_factor", None) is None:
        bad.append("moe_pad_expert_input_to_capacity without moe_expert_capacity_factor (the capacity pads to)")
    if _get(tc, "moe_expert_rank_capacity_factor", None) is not None:
        bad.append("moe_expert_rank_capacity_factor (a per-rank budget moert's dispatchers do not drop to)")
    if _get(tc, "overlap_moe_expert_parallel_comm", False) and not whole_layer:
        bad.append("overlap_moe_expert_parallel_comm (Megatron's overlapped schedule drives its own dispatcher's "
                   "communication; moert's layer overlaps the all-to-alls itself: moert_config_from_megatron and "
                   "$.parallel.overlap_micro_batches)")
    if _get(tc, "transformer_impl", None) == "inference_optimized":
        bad.append("transformer_impl inference_optimized (its MoELayer puts its own dispatchers back every forward)")
    for flag in ("moe_router_force_biased", "moe_enable_routing_replay"):
        if _get(tc, flag, False):
            bad.append(flag)
    if whole_layer:
        bad += _swiglu_variants(tc)
        if _get(tc, "moe_router_score_function", "softmax") not in ("softmax", "sigmoid"):
            bad.append("moe_router_score_function %s (moert's router scores by softmax or sigmoid)"
                       % tc.moe_router_score_function)
        if _get(tc, "moe_pad_expert_input_to_capacity", False):
            bad.append("moe_pad_expert_input_to_capacity (moert's MoE layer drops over capacity but does not pad; "
                       "the dispatcher backend does)")
        if not _get(tc, "gated_linear_unit", False):
            bad.append("gated_linear_unit False (moert's experts are SwiGLU)")
        act = getattr(tc, "activation_func", None)
        if act is not None and act is not torch.nn.functional.silu:
            bad.append("activation_func %s (moert's experts are SwiGLU: silu)" % getattr(act, "__name__", act))
        if _get(tc, "add_bias_linear", False):
            bad.append("add_bias_linear (moert's experts have no bias)")
        if _get(tc, "moe_router_dtype", None) == "fp64":
            bad.append("moe_router_dtype fp64")
        if _get(tc, "moe_input_jitter_eps", None):
            bad.append("moe_input_jitter_eps")
        if _get(tc, "moe_apply_probs_on_input", False):
            bad.append("moe_apply_probs_on_input")
    if bad:
        raise ValueError("moert.megatron: not supported: " + "; ".join(bad))


def _load_config(config):
    """A moert config (None, a path, a JSON string, a dict or a moert.Config) as a dict."""
    if config is None:
        return {}
    if isinstance(config, dict):
        return json.loads(json.dumps(config))
    if hasattr(config, "data") and hasattr(config, "ptr"):
        return json.loads(json.dumps(config.data))
    if isinstance(config, (str, bytes, os.PathLike)):
        s = config.decode() if isinstance(config, bytes) else config
        if isinstance(s, str) and s.lstrip().startswith("{"):
            return json.loads(s)
        with open(os.fspath(s)) as f:
            return json.load(f)
    raise TypeError("moert config: expected a path, a JSON string, a dict or a moert Config, got %s"
                    % type(config).__name__)


def moert_config_from_megatron(tc, base=None, seq_length=None):
    """A moert config (dict) for the MoE layer a Megatron TransformerConfig describes: `model` and `router` from tc
    (hidden, experts, top-k, FFN width, dtype, shared expert, score function, groups, scaling, expert bias,
    balancing, z-loss, capacity), every other section (dispatcher, precision, memory_policy, parallel, train) from
    base (a path, JSON, dict or moert.Config; e.g. a preset). Raises ValueError for what moert cannot do."""
    check_supported(tc, whole_layer=True)
    cfg = _load_config(base)
    m = cfg.setdefault("model", {})
    m["hidden"] = int(tc.hidden_size)
    m["ffn_hidden"] = int(_get(tc, "moe_ffn_hidden_size", None) or tc.ffn_hidden_size)
    m["num_experts"] = int(tc.num_moe_experts)
    m["topk"] = int(_get(tc, "moe_router_topk", 2))
    m["dtype"] = _layer_dtype(tc)
    fs = _get(tc, "moe_shared_expert_intermediate_size", None)
    m.pop("shared_expert_ffn_hidden", None)
    m.pop("shared_expert_gate", None)
    if fs:
        m["shared_expert_ffn_hidden"] = int(fs)
        if _get(tc, "moe_shared_expert_gate", False):
            m["shared_expert_gate"] = True
    r = {"plugin": (cfg.get("router") or {}).get("plugin", "topk")}
    old = cfg.get("router") or {}
    if "gemm" in old:
        r["gemm"] = old["gemm"]
    r["score_function"] = _get(tc, "moe_router_score_function", "softmax")
    if _get(tc, "moe_router_pre_softmax", False) and r["score_function"] == "softmax":  # Megatron ignores it for sigmoid
        r["pre_softmax"] = True
    if _get(tc, "moe_router_force_load_balancing", False):
        r["force_load_balancing"] = True
    if _get(tc, "moe_router_num_groups", None):
        r["num_groups"] = int(tc.moe_router_num_groups)
        r["group_topk"] = int(_get(tc, "moe_router_group_topk", 0))
    sf = _get(tc, "moe_router_topk_scaling_factor", None)
    if sf is not None and sf != 1.0:
        r["scaling_factor"] = float(sf)
    if _get(tc, "moe_router_enable_expert_bias", False):
        r["expert_bias"] = True
        r["bias_update_rate"] = float(_get(tc, "moe_router_bias_update_rate", 1e-3))
    kind, coeff = _balancing(tc)
    if kind != "none":
        r["load_balancing"] = kind
        if kind != "sinkhorn":
            r["aux_loss_coeff"] = coeff
    z = _get(tc, "moe_z_loss_coeff", None)
    if z:
        r["z_loss_coeff"] = float(z)
    cf = _get(tc, "moe_expert_capacity_factor", None)
    if cf is not None:
        r["capacity_factor"] = float(cf)
        r["drop_policy"] = _get(tc, "moe_token_drop_policy", "probs")
    cfg["router"] = r
    etp = int(_get(tc, "expert_tensor_parallel_size", 1) or 1)
    if etp > 1:  # moert's grid orders the ranks as Megatron's expert grid does: ETP fastest, then EP, then EDP
        cfg.setdefault("parallel", {})["expert_tensor_parallel"] = etp
    if kind == "seq_aux_loss" and seq_length:
        cfg.setdefault("train", {})["seq_length"] = int(seq_length)
    _set_forwards_in_flight(cfg, tc)
    return cfg


def megatron_kwargs_from_moert(config):
    """The TransformerConfig keyword arguments of the MoE layer a moert config describes (model and router
    sections): the inverse of moert_config_from_megatron, for building Megatron's layer from a moert preset. SwiGLU
    experts without bias, router probs in fp32, Megatron's alltoall dispatcher, no fused kernels (no
    TransformerEngine needed). Add the non-MoE fields (num_layers, num_attention_heads, ...) yourself."""
    cfg = _load_config(config)
    m, r = cfg.get("model", {}), cfg.get("router", {})
    dtype = m.get("dtype", "fp32")
    kw = {"hidden_size": m.get("hidden", 64), "ffn_hidden_size": m.get("ffn_hidden", 128),
          "moe_ffn_hidden_size": m.get("ffn_hidden", 128), "num_moe_experts": m.get("num_experts", 8),
          "moe_router_topk": m.get("topk", 2), "gated_linear_unit": True,
          "activation_func": torch.nn.functional.silu, "add_bias_linear": False,
          "params_dtype": _TORCH_DTYPE[dtype], "bf16": dtype == "bf16", "moe_router_dtype": "fp32",
          "moe_token_dispatcher_type": "alltoall", "moe_grouped_gemm": False, "moe_permute_fusion": False,
          "moe_router_fusion": False, "bias_activation_fusion": False,
          "moe_router_score_function": r.get("score_function", "softmax"),
          "moe_router_pre_softmax": bool(r.get("pre_softmax", False)),
          "moe_router_enable_expert_bias": bool(r.get("expert_bias", False)),
          "moe_router_bias_update_rate": float(r.get("bias_update_rate", 1e-3))}
    if m.get("shared_expert_ffn_hidden"):
        kw["moe_shared_expert_intermediate_size"] = m["shared_expert_ffn_hidden"]
        kw["moe_shared_expert_gate"] = bool(m.get("shared_expert_gate", False))
    if r.get("num_groups"):
        kw["moe_router_num_groups"] = r["num_groups"]
        kw["moe_router_group_topk"] = r.get("group_topk")
    if r.get("scaling_factor", 1.0) != 1.0:
        kw["moe_router_topk_scaling_factor"] = float(r["scaling_factor"])
    lb = r.get("load_balancing", "none")
    kw["moe_router_load_balancing_type"] = lb
    kw["moe_aux_loss_coeff"] = float(r.get("aux_loss_coeff", 0.0)) if lb not in ("none", "sinkhorn") else 0.0
    if r.get("z_loss_coeff"):
        kw["moe_z_loss_coeff"] = float(r["z_loss_coeff"])
    if r.get("capacity_factor"):
        kw["moe_expert_capacity_factor"] = float(r["capacity_factor"])
        kw["moe_token_drop_policy"] = r.get("drop_policy", "probs")
    return kw


# ---- expert weights: Megatron's Linear layout ([out, in], y = x W^T) <-> moert's [E, in, out] ----


def expert_weights_to_moert(fc1_weights, fc2_weights):
    """Megatron experts' linear_fc1 weights ([2F, H] each: rows 0..F-1 the SwiGLU gate, F..2F-1 the up
    projection) and linear_fc2 weights ([H, F] each) as moert's fc1 [E, H, 2F] and fc2 [E, F, H] (copies)."""
    fc1 = torch.stack([w.detach().t() for w in fc1_weights]).contiguous()
    fc2 = torch.stack([w.detach().t() for w in fc2_weights]).contiguous()
    return fc1, fc2


def expert_weights_from_moert(fc1, fc2):
    """The inverse: lists of Megatron linear_fc1 ([2F, H]) and linear_fc2 ([H, F]) weights (copies)."""
    return ([w.detach().t().contiguous() for w in fc1], [w.detach().t().contiguous() for w in fc2])


def megatron_expert_weights(experts, hidden_size=None):
    """This rank's expert weights of a Megatron experts module as moert's fc1 [E_local, H, 2F] and fc2
    [E_local, F, H]: SequentialMLP (local_experts[i].linear_fc1/linear_fc2), GroupedMLP (weight1 [H, E_local*2F],
    weight2 [E_local*F, H]) or TEGroupedMLP (linear_fc1.weight<i>, linear_fc2.weight<i>)."""
    if hasattr(experts, "local_experts"):
        return expert_weights_to_moert([e.linear_fc1.weight for e in experts.local_experts],
                                       [e.linear_fc2.weight for e in experts.local_experts])
    n = experts.num_local_experts
    if hasattr(experts, "weight1"):
        H = hidden_size or experts.config.hidden_size
        return (experts.weight1.detach().view(n, H, -1).clone(), experts.weight2.detach().view(n, -1, H).clone())
    if hasattr(experts, "linear_fc1") and hasattr(experts.linear_fc1, "weight0"):
        return expert_weights_to_moert([getattr(experts.linear_fc1, "weight%d" % i) for i in range(n)],
                                       [getattr(experts.linear_fc2, "weight%d" % i) for i in range(n)])
    raise TypeError("moert.megatron: unknown experts module %s (SequentialMLP, GroupedMLP or TEGroupedMLP)"
                    % type(experts).__name__)


def copy_to_moert(moe_layer, moe):
    """Copies a Megatron MoELayer's weights (router, this rank's experts, expert bias, shared expert) into a
    moert.torch.MoE of the same sizes and expert-parallel split, converting layout and dtype."""
    if moe_layer.local_expert_indices[0] != moe.first_local_expert or \
            moe_layer.num_local_experts != moe.num_local_experts:
        raise ValueError("moert.megatron: the layers hold different experts (Megatron %d..%d, moert %d..%d)"
                         % (moe_layer.local_expert_indices[0], moe_layer.local_expert_indices[-1],
                            moe.first_local_expert, moe.first_local_expert + moe.num_local_experts - 1))
    fc1, fc2 = megatron_expert_weights(moe_layer.experts, moe.hidden)
    sd = {"router_weight": moe_layer.router.weight.detach(), "fc1": fc1, "fc2": fc2}
    bias = getattr(moe_layer.router, "expert_bias", None)
    if getattr(moe, "expert_bias", None) is not None:
        sd["expert_bias"] = bias.detach() if bias is not None else torch.zeros(moe.num_experts)
    sh = getattr(moe_layer, "shared_experts", None)
    if sh is not None:
        f1, f2 = expert_weights_to_moert([sh.linear_fc1.weight], [sh.linear_fc2.weight])
        sd["shared_fc1"], sd["shared_fc2"] = f1, f2
        if getattr(sh, "gate_weight", None) is not None:
            sd["shared_gate"] = sh.gate_weight.detach().reshape(1, -1)
    own = moe.state_dict()
    missing = sorted(set(own) - set(sd))
    if missing:
        raise ValueError("moert.megatron: nothing in the Megatron layer for %s" % ", ".join(missing))
    moe.load_state_dict({k: sd[k].to(device=own[k].device, dtype=own[k].dtype) for k in own})


# ---- the dispatcher backend ----


class MoertDispatch:
    """The dispatcher backend's logic, on Megatron's six-step interface (dispatch_preprocess, token_dispatch,
    dispatch_postprocess, combine_preprocess, token_combine, combine_postprocess), over one moert.torch.Dispatcher
    per layer. Independent of Megatron: MoertTokenDispatcher adds Megatron's MoETokenDispatcher base.

    config: the Megatron TransformerConfig (hidden_size, num_moe_experts, moe_router_topk, moe_ffn_hidden_size);
    ep_group: the expert-parallel process group (None: one rank); etp_group: the expert-tensor-parallel group (None:
    one rank), as Megatron's alltoall dispatcher: after moert's dispatch over the EP group the rows are all-gathered
    over it and regrouped by local expert, so that each of its ranks runs its shard of every local expert's width on
    all of them, and before the combine the experts' partial outputs are summed and handed back (a reduce-scatter);
    moert_config: a moert config (path, JSON, dict,
    moert.Config; None: alltoall) whose dispatcher section is used, its model section set from config; max_tokens:
    the most tokens a rank dispatches in one micro-batch (default: the config's train.tokens_per_rank where given,
    else the first micro-batch's, the largest over the group)."""

    def _moert_setup(self, num_local_experts, local_expert_indices, config, ep_group, moert_config=None,
                     max_tokens=None, overrides=None, etp_group=None):
        self.num_local_experts = num_local_experts
        self.moert_etp_group = etp_group if _group_size(etp_group) > 1 else None
        self._etp = None
        self._padded_rows = None
        self.local_expert_indices = list(local_expert_indices)
        self.config = config
        self.moert_ep_group = ep_group
        self.moert_config = moert_config if moert_config is not None else {"dispatcher": {"plugin": "alltoall"}}
        self.moert_max_tokens = max_tokens
        self.moert_overrides = dict(overrides or {})
        self.moert_dispatcher = None
        self.shared_experts = None
        self.cudagraph_attrs = []
        self._handle = None

    # the moert.torch.Dispatcher, made at the first dispatch (device, dtype and token count known then)
    def _moert_dispatcher(self, x):
        d = self.moert_dispatcher
        if d is not None:
            if x.shape[0] > d.max_tokens:
                raise ValueError("moert.megatron: %d tokens in this micro-batch, more than the %d the layer's moert "
                                 "dispatcher was made for (pass max_tokens= to use_moert)" % (x.shape[0], d.max_tokens))
            return d
        import moert.torch as mt
        from moert._config import Config
        if x.dtype not in _MOERT_DTYPE:
            raise TypeError("moert.megatron: hidden states of dtype %s (moert takes bf16, fp32, fp64)" % x.dtype)
        tc = self.config
        data = _load_config(self.moert_config)
        model = data.setdefault("model", {})
        # the layer's sizes are Megatron's; the shared expert (if any) stays Megatron's MoELayer's
        model.update(hidden=int(tc.hidden_size), num_experts=int(tc.num_moe_experts), topk=int(tc.moe_router_topk),
                     ffn_hidden=int(getattr(tc, "moe_ffn_hidden_size", None) or tc.ffn_hidden_size),
                     dtype=_MOERT_DTYPE[x.dtype])
        model.pop("shared_expert_ffn_hidden", None)
        model.pop("shared_expert_gate", None)
        _set_forwards_in_flight(data, tc)  # a pipeline's warm-up holds several dispatches of the layer
        cfg = Config(data, self.moert_overrides)
        mx = max(int(self.moert_max_tokens or cfg.get("train.tokens_per_rank", 0) or 0), x.shape[0])
        g = self.moert_ep_group
        if g is not None and torch.distributed.is_initialized() and torch.distributed.get_world_size(g) > 1:
            # every rank of the group makes its dispatcher for the same largest count (the NVLink dispatchers'
            # buffers are sized by it)
            dev = x.device if torch.distributed.get_backend(g) == "nccl" else torch.device("cpu")
            t = torch.tensor([mx], dtype=torch.int64, device=dev)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=g)
            mx = int(t.item())
        d = mt.Dispatcher(cfg, g, device=x.device, max_tokens=mx)
        if d.first_local_expert != self.local_expert_indices[0] or d.num_local_experts != self.num_local_experts:
            raise RuntimeError("moert.megatron: moert's rank holds experts %d..%d, Megatron's %d..%d"
                               % (d.first_local_expert, d.first_local_expert + d.num_local_experts - 1,
                                  self.local_expert_indices[0], self.local_expert_indices[-1]))
        self.moert_dispatcher = d
        return d

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        """[S, B, H] -> [T, H]; the routing map and probs -> moert's topk_idx (kept) and topk_weights (returned)."""
        self.hidden_shape = hidden_states.shape
        x = hidden_states.reshape(-1, self.hidden_shape[-1])
        d = self._moert_dispatcher(x)
        self._probs_dtype = probs.dtype
        if _get(self.config, "moe_pad_expert_input_to_capacity", False):
            # Megatron's drop-and-pad map gives every expert its capacity of tokens, the padding ones at prob 0: moert
            # takes the routed copies alone (nonzero probs) and pads each expert itself
            routing_map = routing_map & (probs != 0)
        self._topk_idx, w = routing_map_to_topk(routing_map, probs, int(self.config.moe_router_topk), d.param_dtype)
        return x, w

    def token_dispatch(self, hidden_states, probs, *args, **kwargs):
        """moert's dispatch: each copy to its expert's rank, rows grouped by local expert."""
        d = self.moert_dispatcher
        recv_x, recv_w, tpe, handle = d.dispatch(hidden_states.contiguous(), self._topk_idx, probs.contiguous())
        self._handle, self._tokens_per_expert, self._recv_rows = handle, tpe, recv_x.shape[0]
        self._topk_idx = None
        if self.moert_etp_group is not None:
            recv_x, recv_w = self._etp_gather(recv_x, recv_w)
        return recv_x, recv_w

    def _etp_gather(self, x, w):
        """The ETP group's rows of each local expert, expert by expert (each by the group's ranks in order), from every
        rank's own (expert-grouped, zero-padded past them); their counts become the experts' tokens_per_expert."""
        g = self.moert_etp_group
        size, rank = torch.distributed.get_world_size(g), torch.distributed.get_rank(g)
        counts = _all_gather(self._tokens_per_expert.to(torch.int64), g).cpu().view(size, -1)  # [etp, local experts]
        rows = counts.sum(1)
        pad = int(rows.max())
        n = int(rows[rank])
        starts = torch.cumsum(counts, 1) - counts  # where expert e's rows start in rank r's block
        order = torch.cat([torch.zeros(0, dtype=torch.int64)] +
                          [torch.arange(int(counts[r, e])) + r * pad + int(starts[r, e])
                           for e in range(counts.shape[1]) for r in range(size)]).to(x.device)
        self._etp = (order, pad, n)
        self._tokens_per_expert = counts.sum(0).to(self._tokens_per_expert.device, self._tokens_per_expert.dtype)

        def gathered(t):  # rank r's n_r rows at r * pad of the group's, then in the experts' order
            t = t[:n]
            if pad > n:
                t = torch.cat([t, t.new_zeros(pad - n, *t.shape[1:])])
            return _EtpExchange.apply(t, g, True).index_select(0, order)
        return gathered(x), gathered(w)

    def _etp_scatter(self, y):
        """The inverse of _etp_gather for the experts' outputs: each row put back in its rank's block, the group's
        partial sums added, this rank's own rows returned."""
        order, pad, n = self._etp
        self._etp = None
        size = torch.distributed.get_world_size(self.moert_etp_group)
        blocks = y.new_zeros(size * pad, y.shape[1]).index_add(0, order, y)
        return _EtpExchange.apply(blocks, self.moert_etp_group, False)[:n]

    def dispatch_postprocess(self, hidden_states, probs):
        """Nothing to permute: moert's rows arrive grouped by local expert. Drops the zero padding past them; the
        probs go to the experts in the router's dtype, as Megatron's alltoall dispatcher gives them. With
        moe_pad_expert_input_to_capacity, each local expert's rows are padded with zeros (and zero probs) to the
        capacity times the EP and ETP sizes, as Megatron's drop-and-pad gives its experts."""
        n = int(self._tokens_per_expert.sum())
        x, tpe, p = hidden_states[:n], self._tokens_per_expert, probs[:n].to(self._probs_dtype)
        if _get(self.config, "moe_pad_expert_input_to_capacity", False):
            x, tpe, p = self._pad_to_capacity(x, tpe, p)
        return x, tpe, p

    def _pad_to_capacity(self, x, tpe, p):
        """Each expert's block of rows padded to C = capacity x EP x ETP rows; remembers where the real rows went."""
        tc = self.config
        tokens = 1
        for s in self.hidden_shape[:-1]:
            tokens *= int(s)
        topk, experts = int(tc.moe_router_topk), int(tc.num_moe_experts)
        capacity = math.ceil(tokens * topk / experts * float(tc.moe_expert_capacity_factor))
        etp = torch.distributed.get_world_size(self.moert_etp_group) if self.moert_etp_group is not None else 1
        per_expert = capacity * self.moert_dispatcher.world_size * etp
        counts = tpe.to(torch.int64).cpu()
        if counts.numel() and int(counts.max()) > per_expert:
            raise ValueError("moert.megatron: moe_pad_expert_input_to_capacity: a local expert got %d rows, more than "
                             "its %d (capacity %d x EP x ETP): every rank must drop to the same capacity (the same "
                             "token count and moe_expert_capacity_factor)" % (int(counts.max()), per_expert, capacity))
        where = torch.cat([torch.zeros(0, dtype=torch.int64)] +
                          [torch.arange(int(c)) + e * per_expert for e, c in enumerate(counts.tolist())]).to(x.device)
        self._padded_rows = where
        rows = per_expert * counts.numel()
        x = x.new_zeros(rows, x.shape[1]).index_copy(0, where, x)
        p = p.new_zeros(rows, *p.shape[1:]).index_copy(0, where, p)
        return x, torch.full_like(tpe, per_expert), p

    def combine_preprocess(self, hidden_states):
        """Back to moert's row count (zero padding) and dtype."""
        d = self.moert_dispatcher
        where, self._padded_rows = self._padded_rows, None
        if where is not None:  # the experts' real rows, without the capacity padding
            hidden_states = hidden_states.index_select(0, where)
        if self.moert_etp_group is not None:
            hidden_states = self._etp_scatter(hidden_states)
        if hidden_states.dtype != d.dtype:
            hidden_states = hidden_states.to(d.dtype)
        pad = self._recv_rows - hidden_states.shape[0]
        if pad:
            hidden_states = torch.cat([hidden_states, hidden_states.new_zeros(pad, hidden_states.shape[1])])
        return hidden_states

    def token_combine(self, hidden_states, *args, **kwargs):
        """moert's combine: each token's copies summed back on its rank."""
        h, self._handle = self._handle, None
        return self.moert_dispatcher.combine(hidden_states.contiguous(), h)

    def combine_postprocess(self, hidden_states):
        return hidden_states.view(self.hidden_shape)

    def set_shared_experts(self, shared_experts):
        raise NotImplementedError("moert.megatron: shared expert overlap (moe_shared_expert_overlap) is not supported "
                                  "with moert's dispatcher; leave it off and MoELayer runs the shared expert")


def _group_size(group):
    """Ranks of a process group (None, or torch.distributed not started: 1)."""
    if group is None or not torch.distributed.is_initialized():
        return 1
    return torch.distributed.get_world_size(group)


def _collective_device(group, like):
    """Where a collective's tensors of `group` live: the GPU under NCCL, else the CPU."""
    return like.device if torch.distributed.get_backend(group) == "nccl" else torch.device("cpu")


class _EtpExchange(torch.autograd.Function):
    """gather True: [rows, C] of each rank of the group (equal sizes) stacked in rank order, whose backward is this
    rank's slice of the group's summed gradient (a reduce-scatter); gather False: that reduce-scatter, whose backward
    is the all-gather."""

    @staticmethod
    def forward(ctx, x, group, gather):
        ctx.group, ctx.gather = group, gather
        return (_all_gather if gather else _reduce_scatter)(x, group)

    @staticmethod
    def backward(ctx, grad):
        return (_reduce_scatter if ctx.gather else _all_gather)(grad, ctx.group), None, None


def _all_gather(x, group):
    """Every rank's [rows, ...] of the group (equal sizes), stacked in rank order."""
    dev = _collective_device(group, x)
    parts = [torch.empty_like(x, device=dev) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, x.detach().contiguous().to(dev), group=group)
    return torch.cat(parts).to(x.device)


def _reduce_scatter(x, group):
    """Rank r's rows of the sum over the group of [size * rows, C] (all_reduce then the slice: gloo has no
    reduce-scatter; NCCL takes reduce_scatter_tensor)."""
    size, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    rows = x.shape[0] // size
    dev = _collective_device(group, x)
    if dev.type == "cuda" and hasattr(torch.distributed, "reduce_scatter_tensor"):
        out = torch.empty(rows, *x.shape[1:], dtype=x.dtype, device=dev)
        torch.distributed.reduce_scatter_tensor(out, x.contiguous(), group=group)
        return out
    total = x.detach().to(dev).clone()
    torch.distributed.all_reduce(total, group=group)
    return total[rank * rows:(rank + 1) * rows].to(x.device)


_CLASS = None


def _token_dispatcher_class():
    """MoertTokenDispatcher: MoertDispatch on Megatron's MoETokenDispatcher (made on first use: imports Megatron)."""
    global _CLASS
    if _CLASS is None:
        from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

        def __init__(self, num_local_experts, local_expert_indices, config, pg_collection=None, *,
                     moert_config=None, max_tokens=None, overrides=None):
            if pg_collection is None:
                from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
                pg_collection = get_default_pg_collection()
            MoETokenDispatcher.__init__(self, config=config, pg_collection=pg_collection)
            check_supported(config)
            self._moert_setup(num_local_experts, local_expert_indices, config, self.ep_group, moert_config,
                              max_tokens, overrides, etp_group=self.tp_group if self.tp_size > 1 else None)

        _CLASS = type("MoertTokenDispatcher", (MoertDispatch, MoETokenDispatcher),
                      {"__init__": __init__, "__module__": __name__,
                       "__doc__": "Megatron's MoETokenDispatcher over moert.torch.Dispatcher (see MoertDispatch)."})
    return _CLASS


# ---- moert's grouped GEMMs as Megatron's experts ----


def check_experts_supported(tc):
    """Refuses (ValueError, naming the option) what moert's experts cannot compute for a Megatron TransformerConfig:
    they are SwiGLU (gated_linear_unit, silu) without bias."""
    bad = []
    if not _get(tc, "gated_linear_unit", False):
        bad.append("gated_linear_unit False (moert's experts are SwiGLU)")
    act = getattr(tc, "activation_func", None)
    if act is not None and act is not torch.nn.functional.silu:
        bad.append("activation_func %s (moert's experts are SwiGLU: silu)" % getattr(act, "__name__", act))
    if _get(tc, "add_bias_linear", False):
        bad.append("add_bias_linear (moert's experts have no bias)")
    if _get(tc, "moe_latent_size", None):
        bad.append("moe_latent_size")
    if _get(tc, "moe_apply_probs_on_input", False) and int(_get(tc, "moe_router_topk", 1)) != 1:
        bad.append("moe_apply_probs_on_input with moe_router_topk %s (Megatron allows it with top-1 only)"
                   % tc.moe_router_topk)
    bad += _swiglu_variants(tc)
    if bad:
        raise ValueError("moert.megatron: experts: not supported: " + "; ".join(bad))


class MoertExperts(torch.nn.Module):
    """Megatron's experts interface (GroupedMLP, SequentialMLP, TEGroupedMLP) over moert's grouped GEMMs
    (moert.torch.Experts): forward(permuted_local_hidden_states [R, H], tokens_per_expert [E_local],
    permuted_probs [R]) -> (output [R, H], None), the probs multiplied after the activation as Megatron does (or, with
    moe_apply_probs_on_input, on the input, then 1). Parameters weight1 [H, E_local*2F] and weight2 [E_local*F, H]
    with GroupedMLP's names, shapes and memory layout (weight1.view(E_local, H, 2F) is moert's fc1), so GroupedMLP
    state dicts load; in moert's parameter dtype (fp32; fp64 for fp64 layers), flagged `allreduce` False under expert
    parallelism as Megatron flags its experts. The moert config (moert_config: a path, JSON, dict or moert.Config)
    gives the precision section (bf16, fp8 and their options); the sizes and dtype come from Megatron's config.
    Under expert tensor parallelism (etp_size > 1) each expert is this rank's shard of the FFN width, F / etp_size
    (fc1 its gate's and up's slices, fc2 the matching rows), as Megatron shards its experts; the outputs are partial
    sums, which the dispatcher adds over the ETP group.

    Independent of Megatron (a plain torch Module, for the CPU tests); MoertGroupedMLP adds Megatron's MegatronModule
    base and GroupedMLP's constructor, (num_local_experts, config, submodules=None, pg_collection=None)."""

    def __init__(self, num_local_experts, config, *, ep_size=1, etp_size=1, moert_config=None, device=None,
                 overrides=None):
        torch.nn.Module.__init__(self)
        self._moert_setup(num_local_experts, config, ep_size, moert_config, device, overrides, etp_size)

    def _moert_setup(self, num_local_experts, config, ep_size, moert_config, device, overrides, etp_size=1):
        import moert.torch as mt
        check_experts_supported(config)
        tc = config
        self.config = config
        self.num_local_experts = int(num_local_experts)
        self.hidden = int(tc.hidden_size)
        ffn = int(_get(tc, "moe_ffn_hidden_size", None) or tc.ffn_hidden_size)
        if etp_size < 1 or ffn % etp_size:
            raise ValueError("moert.megatron: experts: an FFN width of %d does not split over %d expert tensor "
                             "parallel ranks" % (ffn, etp_size))
        ffn //= etp_size  # this rank's shard of each expert
        data = _load_config(moert_config)
        model = data.setdefault("model", {})
        model.update(hidden=self.hidden, ffn_hidden=ffn, num_experts=self.num_local_experts, dtype=_layer_dtype(tc))
        _set_forwards_in_flight(data, tc)  # a pipeline's warm-up holds several forwards of the experts
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        # the engine holds no parameters (parameters=False) and is not a submodule: the weights are weight1/weight2
        self.__dict__["_moert_engine"] = mt.Experts(data, self.num_local_experts, device=device, overrides=overrides,
                                                     parameters=False)
        e = self._moert_engine
        n, H, F = self.num_local_experts, self.hidden, ffn
        self.weight1 = torch.nn.Parameter(torch.empty(H, n * 2 * F, dtype=e.param_dtype, device=e.device))
        self.weight2 = torch.nn.Parameter(torch.empty(n * F, H, dtype=e.param_dtype, device=e.device))
        tp = int(_get(tc, "tensor_model_parallel_size", 1) or 1)
        for w in (self.weight1, self.weight2):
            # as Megatron's experts: parameters of the expert grid (EP > 1, or ETP other than TP) are reduced over the
            # expert-data-parallel group, not all-reduced over data parallel
            setattr(w, "allreduce", not (ep_size > 1 or etp_size != tp))
        init = getattr(tc, "init_method", None)
        out_init = getattr(tc, "output_layer_init_method", None) or init
        with torch.no_grad():
            if callable(init) and _get(tc, "perform_initialization", True):
                init(self.weight1)
                out_init(self.weight2)
            else:
                self.weight1.normal_(0.0, 1.0 / H ** 0.5)
                self.weight2.normal_(0.0, 0.5 / F ** 0.5)

    @property
    def moert_experts(self):
        """The moert.torch.Experts that computes (no parameters of its own)."""
        return self._moert_engine

    def load_megatron_weights(self, experts):
        """Copies the weights of a Megatron experts module of the same sizes (SequentialMLP, GroupedMLP,
        TEGroupedMLP) into weight1 and weight2."""
        fc1, fc2 = megatron_expert_weights(experts, self.hidden)
        n, H = self.num_local_experts, self.hidden
        if fc1.shape[0] != n:
            raise ValueError("moert.megatron: %d experts in the Megatron module, %d here" % (fc1.shape[0], n))
        with torch.no_grad():
            self.weight1.view(n, H, -1).copy_(fc1)
            self.weight2.view(n, -1, H).copy_(fc2)

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        e = self._moert_engine
        x, probs = permuted_local_hidden_states, permuted_probs
        dtype = x.dtype
        if _get(self.config, "moe_apply_probs_on_input", False):
            # Megatron's order: the probs scale the input, cast back to its dtype, and count as 1 afterwards
            x = (probs.unsqueeze(-1) * x).to(dtype)
            probs = None
        if x.dtype != e.dtype:
            x = x.to(e.dtype)
        n, H = self.num_local_experts, self.hidden
        y = e.run(x.contiguous(), tokens_per_expert, probs, self.weight1.view(n, H, -1), self.weight2.view(n, -1, H))
        return y.to(dtype), None

    def backward_dw(self):
        """Megatron's delayed weight gradients: moert computes them in the backward (nothing left to do)."""


_EXPERTS_CLASS = None


def _experts_class():
    """MoertGroupedMLP: MoertExperts on Megatron's MegatronModule with GroupedMLP's constructor (imports Megatron)."""
    global _EXPERTS_CLASS
    if _EXPERTS_CLASS is None:
        from megatron.core.transformer.module import MegatronModule

        def __init__(self, num_local_experts, config, submodules=None, pg_collection=None, *, moert_config=None,
                     device=None, overrides=None, name=None):
            MegatronModule.__init__(self, config=config)  # name: newer Megatron's builders pass it; unused
            if pg_collection is None:
                from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
                pg_collection = get_default_pg_collection()
            ep = getattr(pg_collection, "ep", None)
            tp = getattr(pg_collection, "expt_tp", None)
            self._moert_setup(num_local_experts, config, ep.size() if ep is not None else 1, moert_config, device,
                              overrides, tp.size() if tp is not None else 1)

        _EXPERTS_CLASS = type("MoertGroupedMLP", (MoertExperts, MegatronModule),
                              {"__init__": __init__, "__module__": __name__,
                               "__doc__": "Megatron's experts module over moert's grouped GEMMs (see MoertExperts)."})
    return _EXPERTS_CLASS


def __getattr__(name):
    if name == "MoertTokenDispatcher":
        return _token_dispatcher_class()
    if name == "MoertGroupedMLP":
        return _experts_class()
    raise AttributeError("module %r has no attribute %r" % (__name__, name))


def _moe_layers(model):
    from megatron.core.transformer.moe.moe_layer import MoELayer
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def _experts_device(experts):
    p = next(experts.parameters(), None)
    return p.device if p is not None else None


def use_moert(model, config=None, *, max_tokens=None, overrides=None, experts=False, dispatcher=True):
    """Makes every Megatron MoELayer in model (a MoELayer itself, a block, a GPTModel, ...) dispatch its tokens
    through moert: its token_dispatcher becomes a MoertTokenDispatcher over the same expert-parallel group. config:
    a moert config (path, JSON, dict or moert.Config) whose dispatcher section picks alltoall, deepep or hybridep
    and their options (None: alltoall); its model section is taken from Megatron's config. experts=True also puts
    moert's grouped GEMMs in place of the layer's experts module (a MoertGroupedMLP with the old module's weights; the
    config's precision section picks bf16 or fp8); do it before the optimizer and the data-parallel wrapper are built,
    since the experts' parameters are new. dispatcher=False keeps Megatron's dispatcher. Returns the new dispatchers
    (with dispatcher=False, the new experts modules). Router and shared experts stay Megatron's."""
    layers = _moe_layers(model)
    if not layers:
        raise ValueError("moert.megatron.use_moert: no Megatron MoELayer in %s" % type(model).__name__)
    out = []
    for m in layers:
        if dispatcher:
            old = m.token_dispatcher
            pg = types.SimpleNamespace(ep=old.ep_group, expt_tp=old.tp_group, tp_ep=old.tp_ep_group)
            m.token_dispatcher = _token_dispatcher_class()(m.num_local_experts, m.local_expert_indices, m.config, pg,
                                                           moert_config=config, max_tokens=max_tokens,
                                                           overrides=overrides)
            out.append(m.token_dispatcher)
        if experts:
            old = m.experts
            pg = types.SimpleNamespace(ep=old.ep_group, expt_tp=getattr(old, "tp_group", None))
            new = _experts_class()(m.num_local_experts, m.config, None, pg, moert_config=config,
                                   device=_experts_device(old), overrides=overrides)
            new.load_megatron_weights(old)
            m.experts = new
            if not dispatcher:
                out.append(new)
    return out


def patch_moe_layers(config=None, *, max_tokens=None, overrides=None, experts=False, dispatcher=True):
    """For a model not built yet (e.g. in a Megatron-LM training script): every MoELayer constructed after this call
    gets moert's dispatcher, and with experts=True moert's experts (use_moert on itself). Returns a function that
    undoes the patch."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    orig = MoELayer.__init__

    def __init__(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        use_moert(self, config, max_tokens=max_tokens, overrides=overrides, experts=experts, dispatcher=dispatcher)

    MoELayer.__init__ = __init__

    def undo():
        MoELayer.__init__ = orig
    return undo
