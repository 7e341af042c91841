# SPDX-License-Identifier: Apache-2.0
"""A pure-PyTorch MoE layer (torch ops only) computing what moert's layer computes, for tests and A/B runs.

It follows docs/executor.md and docs/plugins/router.md (the CPU reference path):
  router   logits = x @ Wr^T in double; softmax (post: over the K selected; pre_softmax: over all E) or sigmoid
           (normalised over the K selected when K > 1, the expert bias moving only the selection), times
           scaling_factor; probs rounded to the parameter dtype. Losses: aux_loss / seq_aux_loss
           (coeff * E / (K * S^2 * B) * sum_b sum_e (sum_{t in b} P[t,e]) f_{b,e}, f a plain top-K over P) and
           z_loss (coeff * mean_t logsumexp(logits_t)^2).
  experts  fc1_out = x_e @ fc1[e] ([H, 2F]); act = silu(gate) * up * prob with gate the first F columns and up the
           last F (computed in double, stored in the activation dtype); y_e = act @ fc2[e]; y[t] = sum of its copies.
Not covered: group-limited top-k, sinkhorn, capacity (token dropping), global_aux_loss.
"""
import json
import os

import torch
import torch.nn.functional as F
from torch import nn

_DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16}


def load_config_dict(config):
    """A config (path, JSON string, dict or moert.Config) as a dict."""
    if isinstance(config, dict):
        return config
    if hasattr(config, "data") and isinstance(config.data, dict):
        return config.data
    s = os.fspath(config)
    if s.lstrip().startswith("{"):
        return json.loads(s)
    with open(s) as f:
        return json.load(f)


def model_sizes(cfg):
    m = cfg.get("model", {})
    return dict(hidden=m.get("hidden", 64), ffn_hidden=m.get("ffn_hidden", 128), num_experts=m.get("num_experts", 8),
                topk=m.get("topk", 2), dtype=_DTYPES[m.get("dtype", "fp32")],
                shared_ffn=m.get("shared_expert_ffn_hidden", 0), shared_gate=m.get("shared_expert_gate", False))


def router_options(cfg):
    r = dict(cfg.get("router", {}))
    name = r.pop("plugin", "topk")
    if os.path.basename(str(name)) not in ("topk", "libmoert-router-topk.so"):
        raise NotImplementedError("reference router: only the topk router (got %r)" % name)
    o = dict(score_function="softmax", pre_softmax=False, num_groups=0, group_topk=0, scaling_factor=1.0,
             expert_bias=False, bias_update_rate=1e-3, load_balancing="none", aux_loss_coeff=0.0, z_loss_coeff=0.0,
             capacity_factor=0.0, drop_policy="probs", gemm="auto")
    for k, v in r.items():
        if k not in o:
            raise NotImplementedError("reference router: option %r" % k)
        o[k] = v
    if o["num_groups"] or o["capacity_factor"] or o["load_balancing"] in ("sinkhorn", "global_aux_loss"):
        raise NotImplementedError("reference router: group top-k, capacity, sinkhorn and global_aux_loss are not "
                                  "implemented")
    o["seq_length"] = cfg.get("train", {}).get("seq_length", 0)
    return o


def route(x, weight, opts, topk, expert_bias=None):
    """(topk_idx [T,K] int64, probs [T,K] double, aux_loss, z_loss) as moert's topk router computes them."""
    logits = x.double() @ weight.double().t()
    T, E = logits.shape
    K = topk
    if opts["score_function"] == "softmax" and not opts["pre_softmax"]:
        idx = torch.topk(logits.detach(), K, dim=-1).indices
        probs = torch.softmax(logits.gather(1, idx), dim=-1)
    elif opts["score_function"] == "softmax":
        s = torch.softmax(logits, dim=-1)
        idx = torch.topk(s.detach(), K, dim=-1).indices
        probs = s.gather(1, idx)
    else:
        s = torch.sigmoid(logits)
        sel = s.detach() + (expert_bias.double() if expert_bias is not None else 0.0)
        idx = torch.topk(sel, K, dim=-1).indices
        probs = s.gather(1, idx)
        if K > 1:
            probs = probs / (probs.sum(-1, keepdim=True) + 1e-20)
    probs = probs * opts["scaling_factor"]
    zero = logits.new_zeros(())
    aux = zero
    if opts["load_balancing"] in ("aux_loss", "seq_aux_loss") and opts["aux_loss_coeff"] > 0 and T > 0:
        if opts["score_function"] == "softmax":
            P = torch.softmax(logits, dim=-1)
        else:
            sg = torch.sigmoid(logits)
            P = sg / (sg.sum(-1, keepdim=True) + 1e-20)
        S = T
        if opts["load_balancing"] == "seq_aux_loss" and opts["seq_length"]:
            S = opts["seq_length"]
        B = T // S
        top = torch.topk(P.detach(), K, dim=-1).indices
        f = torch.zeros(B, E, dtype=torch.float64, device=x.device)
        f.view(-1).index_add_(0, (torch.arange(T, device=x.device) // S).repeat_interleave(K) * E + top.reshape(-1),
                              torch.ones(T * K, dtype=torch.float64, device=x.device))
        A = opts["aux_loss_coeff"] * E / (K * S * S * B)
        aux = A * (P.view(B, S, E).sum(1) * f).sum()
    z = zero
    if opts["z_loss_coeff"] > 0 and T > 0:
        z = opts["z_loss_coeff"] * (torch.logsumexp(logits, dim=-1) ** 2).mean()
    return idx, probs, aux, z


def experts(x, idx, probs, fc1, fc2, first_expert=0):
    """sum over each token's copies routed to experts first_expert .. first_expert + len(fc1) - 1 of
    (silu(x fc1_gate) * (x fc1_up) * prob) fc2. probs in the parameter dtype."""
    y = torch.zeros_like(x)
    Fh = fc2.shape[1]
    for el in range(fc1.shape[0]):
        tok, k = (idx == first_expert + el).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        h = (x[tok].to(fc1.dtype) @ fc1[el]).to(x.dtype)
        p = probs[tok, k]
        a = (F.silu(h[:, :Fh].double()) * h[:, Fh:].double() * p.double()[:, None]).to(x.dtype)
        out = (a.to(fc2.dtype) @ fc2[el]).to(x.dtype)
        y = y.index_add(0, tok, out)
    return y


def shared_expert(x, fc1, fc2, gate=None):
    """The shared expert ([1, H, 2Fs], [1, Fs, H]) over every token: fc2(silu(x fc1_gate) * (x fc1_up) * g), g = 1
    or sigmoid(x . gate) (computed in double, rounded to the parameter dtype, as the routing probs)."""
    T = x.shape[0]
    if gate is not None:
        g = torch.sigmoid(x.double() @ gate.double().reshape(-1)).to(fc1.dtype)
    else:
        g = torch.ones(T, dtype=fc1.dtype, device=x.device)
    idx = torch.zeros(T, 1, dtype=torch.int64, device=x.device)
    return experts(x, idx, g[:, None], fc1, fc2)


def moe(x, router_weight, fc1, fc2, opts, topk, expert_bias=None, shared=None):
    """(y, router_loss, tokens_per_expert [E]) of one MoE layer on one rank's tokens holding every expert; shared:
    (fc1_s, fc2_s, gate or None) of a shared expert."""
    idx, probs, aux, z = route(x, router_weight, opts, topk, expert_bias)
    probs = probs.to(router_weight.dtype)
    y = experts(x, idx, probs, fc1, fc2)
    if shared is not None:
        y = y + shared_expert(x, *shared)
    E = router_weight.shape[0]
    counts = torch.bincount(idx.reshape(-1), minlength=E)
    return y, (aux + z).to(router_weight.dtype), counts


class MoE(nn.Module):
    """The pure-PyTorch twin of moert.torch.MoE at one rank: the same parameters (router_weight [E, H],
    fc1 [E, H, 2F], fc2 [E, F, H]), buffer (expert_bias, kept in fp64 as moert's CPU router keeps it) and
    forward(x) -> (y, router_loss). A replicated module (every rank holds every expert): under data parallelism
    pass process_group to update_expert_bias so the counts are summed over ranks as moert does."""

    def __init__(self, config, device=None, process_group=None):
        super().__init__()
        cfg = load_config_dict(config)
        s = model_sizes(cfg)
        self.hidden, self.ffn_hidden, self.num_experts, self.topk = (s["hidden"], s["ffn_hidden"], s["num_experts"],
                                                                     s["topk"])
        self.dtype = s["dtype"]
        self.param_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        self.opts = router_options(cfg)
        self.process_group = process_group
        E, H, Fh = self.num_experts, self.hidden, self.ffn_hidden
        pd = dict(dtype=self.param_dtype, device=device)
        self.router_weight = nn.Parameter(torch.randn(E, H, **pd) / H ** 0.5)
        self.fc1 = nn.Parameter(torch.randn(E, H, 2 * Fh, **pd) / H ** 0.5)
        self.fc2 = nn.Parameter(torch.randn(E, Fh, H, **pd) * (0.5 / Fh ** 0.5))
        Fs = s["shared_ffn"]
        self.shared_ffn = Fs
        if Fs:
            self.shared_fc1 = nn.Parameter(torch.randn(1, H, 2 * Fs, **pd) / H ** 0.5)
            self.shared_fc2 = nn.Parameter(torch.randn(1, Fs, H, **pd) * (0.5 / Fs ** 0.5))
            if s["shared_gate"]:
                self.shared_gate = nn.Parameter(torch.randn(1, H, **pd) / H ** 0.5)
        if self.opts["expert_bias"]:
            self.register_buffer("expert_bias", torch.zeros(E, dtype=torch.float64, device=device))
        else:
            self.expert_bias = None
        self._counts = torch.zeros(E, dtype=torch.int64, device=device)
        self.last_tokens_per_expert = None

    def forward(self, x):
        shared = None
        if self.shared_ffn:
            shared = (self.shared_fc1, self.shared_fc2, getattr(self, "shared_gate", None))
        y, loss, counts = moe(x, self.router_weight, self.fc1, self.fc2, self.opts, self.topk, self.expert_bias, shared)
        if torch.is_grad_enabled():  # an evaluation forward does not move the expert bias (as Megatron)
            self._counts += counts
        self.last_tokens_per_expert = counts
        return y, loss

    def weights_changed(self):
        pass

    @torch.no_grad()
    def update_expert_bias(self, reduce=True):
        """bias += bias_update_rate * sign(mean - count) from the copies counted since the last update; the counts
        are summed over process_group (the default group when torch.distributed is initialized) unless reduce is
        False."""
        if self.expert_bias is not None:
            c = self._counts.clone()
            if reduce and torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.all_reduce(c, group=self.process_group)
            c = c.double()
            self.expert_bias += self.opts["bias_update_rate"] * torch.sign(c.mean() - c)
        self._counts.zero_()
