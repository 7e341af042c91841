# SPDX-License-Identifier: Apache-2.0
"""PyTorch modules over moert's embedding API (moert/layers.h): MoE (a whole MoE feed-forward layer) and
Dispatcher (DeepEP-shaped dispatch and combine alone). Tensors pass zero-copy by data_ptr; work goes on torch's
current CUDA stream on GPUs. See docs/python.md."""
import ctypes
import functools
import weakref

import torch
from torch import nn

from . import _capi, _dist
from ._capi import MoertError
from ._config import Config

__all__ = ["MoE", "Dispatcher", "DispatchHandle", "Experts", "MoertError", "attach_optimizer", "moe_modules",
           "after_optimizer_step", "expert_parameter_names"]

_DTYPES = {torch.float32: _capi.F32, torch.float64: _capi.F64, torch.bfloat16: _capi.BF16,
           torch.float16: _capi.F16, torch.int32: _capi.I32, torch.int64: _capi.I64}
_TORCH_DTYPES = {v: k for k, v in _DTYPES.items()}


def _torch_dtype(code):
    if code not in _TORCH_DTYPES:
        raise MoertError(_capi.ERR_UNSUPPORTED, "moert dtype %s has no torch dtype here" % code)
    return _TORCH_DTYPES[code]


def _torch_device(dev):
    if dev.type == _capi.DEVICE_CUDA:
        return torch.device("cuda", dev.id)
    return torch.device("cpu")


def _moert_device(device):
    d = _capi.Device()
    if device.type == "cuda":
        d.type, d.id = _capi.DEVICE_CUDA, device.index if device.index is not None else torch.cuda.current_device()
    elif device.type == "cpu":
        d.type, d.id = _capi.DEVICE_CPU, 0
    else:
        raise ValueError("moert: device %s is not supported (cpu or cuda)" % device)
    return d


def _stream(device):
    """torch's current CUDA stream of device (a cudaStream_t), None (NULL) on the CPU."""
    if device.type == "cuda":
        return ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)
    return None


def _check_tensor(t, name, shape=None, dtype=None, device=None, ndim=None):
    """Checks a tensor argument; raises TypeError/ValueError naming it. shape entries None match anything."""
    if not isinstance(t, torch.Tensor):
        raise TypeError("%s: expected a torch.Tensor, got %s" % (name, type(t).__name__))
    if dtype is not None and t.dtype != dtype:
        raise TypeError("%s: expected dtype %s, got %s" % (name, dtype, t.dtype))
    if device is not None and t.device != device:
        raise ValueError("%s: expected a tensor on %s, got one on %s" % (name, device, t.device))
    if ndim is not None and t.dim() != ndim:
        raise ValueError("%s: expected %d dimensions, got shape %s" % (name, ndim, tuple(t.shape)))
    if shape is not None:
        if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError("%s: expected shape %s, got %s" % (name, want, list(t.shape)))
    if not t.is_contiguous():
        raise ValueError("%s: expected a contiguous tensor (strides %s for shape %s); call .contiguous()"
                         % (name, t.stride(), tuple(t.shape)))
    if t.dim() > _capi.MAX_DIMS:
        raise ValueError("%s: at most %d dimensions, got %d" % (name, _capi.MAX_DIMS, t.dim()))
    if t.dtype not in _DTYPES:
        raise TypeError("%s: dtype %s is not one moert takes" % (name, t.dtype))
    return t


def _desc(t):
    """A moert_tensor over t (zero-copy; t must be contiguous, checked before)."""
    d = _capi.Tensor()
    d.data = t.data_ptr() if t.numel() else (t.data_ptr() or None)
    d.device = _moert_device(t.device)
    d.dtype = _DTYPES[t.dtype]
    d.ndim = t.dim()
    for i in range(t.dim()):
        d.shape[i] = t.shape[i]
        d.strides[i] = t.stride(i)
    return d


def _ref(t):
    return ctypes.byref(_desc(t))


def _resolve_device(device, cfg):
    if device is not None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device
    want = cfg.get("parallel.device", "auto")
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _Layers:
    """One moert_layers of this rank (num_layers 1) with its config and communicator; destroyed after the last
    module, saved forward or dispatch referring to it."""

    def __init__(self, config, process_group, device, max_tokens, overrides):
        ov = {"model.num_layers": 1}
        # the config describes this group's layers: its size is the group's (the layout keys are checked against it)
        ov["parallel.ranks"] = _dist.group_rank_world(process_group)[1]
        ov.update(overrides or {})
        self.config = Config(config, ov)
        self.device = _resolve_device(device, self.config)
        self.process_group = process_group
        timeout_s = float(self.config.get("parallel.timeout_s", 60.0))
        self.comm = _dist.communicator(process_group, self.device, timeout_s)
        self.comm.users += 1
        rank, world = self.comm.rank, self.comm.world
        launch = _capi.Launch()
        launch.struct_size = ctypes.sizeof(_capi.Launch)
        launch.rank, launch.world_size = rank, world
        launch.device = _moert_device(self.device)
        launch.comm = self.comm.ptr if world > 1 else None
        if max_tokens is not None and (isinstance(max_tokens, bool) or int(max_tokens) != max_tokens or max_tokens < 0):
            raise ValueError("max_tokens: expected a whole number of tokens (0 or None: $.train.tokens_per_rank), "
                             "got %r" % (max_tokens,))
        launch.max_tokens = int(max_tokens or 0)
        # the MoE layers' own grid over the group (parallel folding, docs/parallel.md): from the config's keys
        launch.expert_tensor_parallel = int(self.config.get("parallel.expert_tensor_parallel", 1))
        launch.expert_data_parallel = int(self.config.get("parallel.expert_data_parallel", 1))
        self.ptr = ctypes.c_void_p()
        lib = _capi.lib()
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                rc = lib.moert_layers_create(self.config.ptr, ctypes.byref(launch), ctypes.byref(self.ptr))
        else:
            rc = lib.moert_layers_create(self.config.ptr, ctypes.byref(launch), ctypes.byref(self.ptr))
        _capi.check(rc, "moert_layers_create")
        info = _capi.LayersInfo()
        info.struct_size = ctypes.sizeof(_capi.LayersInfo)
        _capi.check(lib.moert_layers_get_info(self.ptr, ctypes.byref(info)), "moert_layers_get_info")
        self.info = info
        self.dtype = _torch_dtype(info.dtype)
        self.param_dtype = _torch_dtype(info.param_dtype)
        # the forwards (or dispatches) in flight, oldest first: as many as the layer has slots
        # ($.parallel.forwards_in_flight; API version 7 reports them)
        self.slots = max(1, int(info.slots)) if _capi.lib().moert_api_version() >= 7 else 1
        self.in_flight = []

    def make_room(self, who, training=True):
        """Before a forward or dispatch: with every slot holding one, a training call frees the oldest (its backward
        then raises); an inference call (no backward follows) frees the oldest inference one (a dispatch never
        combined), and raises where every slot holds a training one, so that an evaluation pass never discards a
        training forward whose backward is still to come."""
        self.in_flight = [r for r in self.in_flight if r() is not None]
        if not training and len(self.in_flight) >= self.slots:
            spare = [r for r in self.in_flight if not getattr(r(), "training", True)]
            if spare:
                self.in_flight.remove(spare[0])
                h = spare[0]()
                if h is not None:
                    h._release(superseded=True)
                return
            n = len(self.in_flight)
            raise RuntimeError(
                "%s: an inference call (no backward follows: torch.no_grad() or nothing requires grad) needs a free "
                "slot, and this layer holds %d training call%s whose backward has not run yet (%d in flight per "
                "layer, $.parallel.forwards_in_flight): run %s backward first, or raise $.parallel.forwards_in_flight"
                % (who, n, "" if n == 1 else "s", self.slots, "its" if n == 1 else "their"))
        while len(self.in_flight) >= self.slots:
            h = self.in_flight.pop(0)()
            if h is not None:
                h._release(superseded=True)

    def hold(self, h):
        self.in_flight.append(weakref.ref(h))

    def drop(self, h):
        self.in_flight = [r for r in self.in_flight if r() is not None and r() is not h]

    def superseded_text(self, what):
        return ("%s before this backward (moert keeps %d micro-batch%s in flight per layer, "
                "$.parallel.forwards_in_flight: run each forward's backward before more forwards of that layer, or "
                "raise it to the forwards your schedule holds)" % (what, self.slots, "es" if self.slots > 1 else ""))

    def param_desc(self, which, optional=False):
        d = _capi.Tensor()
        rc = _capi.lib().moert_layers_param_desc(self.ptr, 0, which, ctypes.byref(d))
        if optional and rc == _capi.ERR_UNSUPPORTED:
            return None
        _capi.check(rc, "moert_layers_param_desc(%s)" % _capi.PARAM_NAMES[which])
        return [d.shape[i] for i in range(d.ndim)], _torch_dtype(d.dtype)

    def __del__(self):
        p = getattr(self, "ptr", None)
        if p and _capi._lib is not None:
            if self.device.type == "cuda":
                try:
                    torch.cuda.synchronize(self.device)
                except Exception:  # noqa: BLE001 - interpreter shutdown
                    pass
            _capi._lib.moert_layers_destroy(p)  # frees any saved forward or dispatch still outstanding
            self.ptr = ctypes.c_void_p()
            comm = getattr(self, "comm", None)
            if comm is not None:
                comm.release()


class _Saved:
    """A forward's moert_saved (consumed by its backward, freed if it never comes)."""

    def __init__(self, layers, who):
        self.layers = layers
        self.who = who  # the module's name for messages: "moert.torch.MoE", "moert.torch.Experts"
        self.ptr = ctypes.c_void_p()
        self.superseded = False

    def take(self):
        if not self.layers.ptr:
            raise RuntimeError("%s: the layer was destroyed before this backward" % self.who)
        if self.superseded:
            raise RuntimeError("%s: this forward's saved activations were released because the layer " % self.who
                               + self.layers.superseded_text("ran more forwards"))
        if not self.ptr:
            raise RuntimeError("%s: backward through the same forward twice (its saved activations are consumed by "
                               "the first; for two losses, backward their sum once, or pass retain_graph=True and "
                               "run a second forward)" % self.who)
        p, self.ptr = self.ptr, ctypes.c_void_p()
        self.layers.drop(self)
        return p

    def _release(self, superseded=False):
        if self.ptr and self.layers.ptr and _capi._lib is not None:
            _capi._lib.moert_saved_free(self.ptr)
        self.ptr = ctypes.c_void_p()
        self.superseded = self.superseded or superseded

    def __del__(self):
        self._release()


class _CModule(nn.Module):
    """A module over moert's C layer, which is neither copied nor pickled: say so plainly (a copy would share, then
    free twice, the C layer)."""

    def _not_copied(self):
        name = "moert.torch." + type(self).__name__
        return TypeError("%s cannot be copied or pickled (copy.deepcopy, pickle, torch.save of the module): it holds "
                         "moert's C layer. Save its state_dict() instead, and for a copy (an EMA, say) build a new "
                         "%s from the same config and load_state_dict() into it" % (name, name))

    def __getstate__(self):
        raise self._not_copied()

    def __deepcopy__(self, memo):
        raise self._not_copied()


class _MoEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, module, x, *params):
        saved = _Saved(module._layers, "moert.torch.MoE")
        # moert binds while no forward is in flight: the gradient buffers this forward's backward overwrites
        grads = tuple(torch.empty_like(p) for p in params)
        y, loss = module._run_forward(x, params, saved, grads)
        ctx.module = module
        ctx.saved = saved
        ctx.grads = grads
        ctx.save_for_backward(x, *params)
        return y, loss

    @staticmethod
    def backward(ctx, dy, dloss):
        module = ctx.module
        x = ctx.saved_tensors[0]
        saved_ptr = ctx.saved.take()  # a second backward through this forward raises there
        grads, ctx.grads = ctx.grads, None
        try:  # this forward's gradient buffers: with several forwards in flight a later one bound its own since
            module._bind(grads=grads)
        except BaseException:
            _capi.lib().moert_saved_free(saved_ptr)
            raise
        # moert_moe_backward consumes saved whatever it returns
        dx = module._run_backward(saved_ptr, x, dy, dloss)
        needs = ctx.needs_input_grad
        return (None, dx if needs[1] else None) + tuple(g if n else None for g, n in zip(grads, needs[2:]))


class MoE(_CModule):
    """A moert MoE feed-forward layer: forward(x [T, H]) -> (y [T, H], router_loss (0-dim)); y = MoE(x) without the
    residual. Parameters (this rank's): router_weight [E, H] (replicated over the expert-parallel group: reduce
    its gradient over ranks like any replicated parameter), fc1 [E_local, H, 2F] (gate and up halves of SwiGLU),
    fc2 [E_local, F, H]; fp32, fp64 when model.dtype is fp64. The expert bias (aux-loss-free balancing) is the
    buffer `expert_bias` of the state_dict.

    config: a path, a JSON string, a dict or a moert.Config; model.num_layers is set to 1 (one module per
    Transformer block). process_group: the expert-parallel group (default: torch.distributed's default group when
    initialized, else one rank). device: default from $.parallel.device ("auto": the current CUDA device when
    torch has one). max_tokens: the most tokens per forward on this rank (default $.train.tokens_per_rank).
    overrides: {dotted key: value} applied to the config. init_seed: moert's initial values (moert_layers_init_params:
    the same for any split over ranks); None keeps torch's zeros for the caller to fill.

    Parallel folding (docs/parallel.md; CPU ranks and GPUs): $.parallel.expert_tensor_parallel (ETP) and
    $.parallel.expert_data_parallel (EDP) lay the MoE layer's own ETP x EP x EDP grid over the process group, in
    Megatron's order (rank = etp + ETP * (ep + EP * edp)). Each rank then holds num_local_experts = E/EP experts, each
    a shard of local_ffn_hidden = F/ETP columns of fc1's gate and up halves ([E_local, H, 2F/ETP], the shard's gate
    then its up) and rows of fc2 ([E_local, F/ETP, H]). The caller sums the expert gradients over the EDP group
    (expert_data_parallel_ranks()) and the router's and shared expert's over the whole group, as without folding."""

    def __init__(self, config, process_group=None, *, device=None, max_tokens=None, overrides=None, init_seed=1):
        super().__init__()
        self._layers = _Layers(config, process_group, device, max_tokens, overrides)
        L = self._layers
        info = L.info
        self.hidden, self.ffn_hidden = info.hidden, info.ffn_hidden
        self.num_experts, self.topk = info.num_experts, info.topk
        self.num_local_experts, self.first_local_expert = info.num_local_experts, info.first_local_expert
        self.rank, self.world_size = info.rank, info.world_size
        self.ep_rank, self.ep_size = info.ep_rank, info.ep_size
        self.etp_rank, self.etp_size = info.etp_rank, info.etp_size
        self.edp_rank, self.edp_size = info.edp_rank, info.edp_size
        self.local_ffn_hidden = info.local_ffn_hidden
        self.max_tokens = info.max_tokens
        self.dtype = L.dtype
        self.param_dtype = L.param_dtype
        self.device = L.device
        self.process_group = process_group
        # router_weight, fc1, fc2, and the shared expert's where the config has one (param_desc answers
        # MOERT_ERR_UNSUPPORTED for a parameter the layer has not)
        self._param_ids = []
        for which in range(len(_capi.PARAM_NAMES)):
            desc = L.param_desc(which, optional=which > _capi.PARAM_FC2)
            if desc is None:
                continue
            shape, dt = desc
            self._param_ids.append(which)
            self.register_parameter(_capi.PARAM_NAMES[which],
                                    nn.Parameter(torch.zeros(shape, dtype=dt, device=self.device)))
        self._bound = None
        self._placeholder_grads = None
        self._bind()
        if init_seed is not None:
            self.reset_parameters(init_seed)
        # the router's expert bias, if it keeps one: a buffer in the dtype the router keeps it in (the CPU router
        # keeps fp64, its CUDA path fp32), so a state_dict round trip loses nothing
        found = None
        info = _capi.LayersInfo(struct_size=ctypes.sizeof(_capi.LayersInfo))
        _capi.check(_capi.lib().moert_layers_get_info(L.ptr, ctypes.byref(info)), "moert_layers_get_info")
        if info.expert_bias_dtype != _capi.DTYPE_COUNT:
            found = torch.zeros(self.num_experts, dtype=_torch_dtype(info.expert_bias_dtype), device=self.device)
            _capi.check(_capi.lib().moert_layers_get_expert_bias(L.ptr, 0, _ref(found), _stream(self.device)),
                        "moert_layers_get_expert_bias")
        if found is not None:
            self.register_buffer("expert_bias", found)
        else:
            self.expert_bias = None
        self.last_stats = None
        self.last_tokens_per_expert = None

    def expert_data_parallel_ranks(self):
        """The ranks of the group (by their rank in it) that hold the same experts as this one: its EDP group, over
        which the expert gradients (fc1, fc2) are summed. [rank] without expert data parallelism."""
        etp, ep = self.etp_size, self.ep_size
        base = self.etp_rank + etp * self.ep_rank
        return [base + etp * ep * d for d in range(self.edp_size)]

    # ---- parameters ----

    def _params(self):
        return tuple(getattr(self, _capi.PARAM_NAMES[w]) for w in self._param_ids)

    def _bind(self, values=None, grads=None):
        """Binds the value (and gradient) tensors moert reads. A training forward binds fresh gradient buffers (its
        backward overwrites them; autograd accumulates them into .grad); other calls rebind only when a value was
        reallocated, with placeholder gradient buffers (moert writes gradients only in backward)."""
        values = values if values is not None else tuple(p.detach() for p in self._params())
        ptrs = tuple(v.data_ptr() for v in values)
        if grads is None and self._bound == ptrs:
            return
        lib = _capi.lib()
        checked_grads = []
        for i, v in enumerate(values):
            which = self._param_ids[i]
            name = _capi.PARAM_NAMES[which]
            shape, dt = self._layers.param_desc(which)
            _check_tensor(v, name, shape=shape, dtype=dt, device=self.device)
            g = grads[i] if grads is not None else torch.empty_like(v)
            _check_tensor(g, name + ".grad", shape=shape, dtype=dt, device=self.device)
            checked_grads.append(g)
        self._bound = None
        for which, v, g in zip(self._param_ids, values, checked_grads):
            _capi.check(lib.moert_layers_bind_param(self._layers.ptr, 0, which, _ref(v), _ref(g)),
                        "moert_layers_bind_param(%s)" % _capi.PARAM_NAMES[which])
        # placeholders stay alive while bound; fresh backward buffers belong to autograd
        self._placeholder_grads = tuple(checked_grads) if grads is None else None
        self._bound = ptrs

    def _apply(self, fn, *args, **kwargs):
        # .to() / .cuda() / .double() would move the tensors moert holds: rebind, or refuse a device or dtype moert
        # was not created on (through the bind's checks), leaving the module as it was
        if getattr(self, "_layers", None) is None or getattr(self, "_bound", None) is None:
            return super()._apply(fn, *args, **kwargs)
        params = {n: (p, p.data, p.grad) for n, p in self._parameters.items() if p is not None}
        buffers = dict(self._buffers)
        out = super()._apply(fn, *args, **kwargs)
        try:
            self._bind()
        except BaseException:
            for n, (p, data, grad) in params.items():  # torch converts in place or makes new Parameters
                p.data, p.grad = data, grad
                self._parameters[n] = p
            self._buffers.update(buffers)
            self._bind()
            raise
        return out

    def reset_parameters(self, seed=1):
        """moert's initial values (normal, std 1/sqrt(H) for the router and fc1, 0.5/sqrt(F) for fc2, from seed;
        the same values for any split over ranks)."""
        self._bind()
        with torch.no_grad():
            _capi.check(_capi.lib().moert_layers_init_params(self._layers.ptr, int(seed), _stream(self.device)),
                        "moert_layers_init_params")

    def weights_changed(self):
        """Call once per optimizer step, after it changed the weights (attach_optimizer does it)."""
        self._bind()
        _capi.check(_capi.lib().moert_layers_weights_changed(self._layers.ptr, _stream(self.device)),
                    "moert_layers_weights_changed")

    def update_expert_bias(self):
        """The router's once-per-step update (collective over the group), after the step's last backward."""
        _capi.check(_capi.lib().moert_layers_update_expert_bias(self._layers.ptr, _stream(self.device)),
                    "moert_layers_update_expert_bias")
        self._pull_expert_bias()

    def _pull_expert_bias(self):
        if self.expert_bias is not None:
            _capi.check(_capi.lib().moert_layers_get_expert_bias(self._layers.ptr, 0, _ref(self.expert_bias),
                                                                 _stream(self.device)),
                        "moert_layers_get_expert_bias")

    def _push_expert_bias(self):
        if self.expert_bias is not None:
            b = _check_tensor(self.expert_bias, "expert_bias", shape=[self.num_experts], device=self.device)
            _capi.check(_capi.lib().moert_layers_set_expert_bias(self._layers.ptr, 0, _ref(b), _stream(self.device)),
                        "moert_layers_set_expert_bias")

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        self._pull_expert_bias()
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._bind()
        self._push_expert_bias()
        self.weights_changed()

    # ---- forward and backward ----

    def forward(self, x):
        _check_tensor(x, "x", shape=[None, self.hidden], dtype=self.dtype, device=self.device)
        if x.shape[0] == 0:
            raise ValueError("x: no tokens (moert's layer takes 1 to max_tokens %d a forward)" % self.max_tokens)
        if x.shape[0] > self.max_tokens:
            raise ValueError("x: %d tokens, more than this layer's max_tokens %d (pass max_tokens= to MoE, or set "
                             "train.tokens_per_rank)" % (x.shape[0], self.max_tokens))
        params = self._params()
        if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)):
            return _MoEFunction.apply(self, x, *params)
        with torch.no_grad():
            return self._run_forward(x, tuple(p.detach() for p in params), None)

    def _run_forward(self, x, values, saved, grads=None):
        L = self._layers
        L.make_room("moert.torch.MoE", training=saved is not None)
        self._bind(values, grads)
        y = torch.empty_like(x)
        stats = _capi.MoeStats()
        stats.struct_size = ctypes.sizeof(_capi.MoeStats)
        sp = ctypes.byref(saved.ptr) if saved is not None else None
        _capi.check(_capi.lib().moert_moe_forward(L.ptr, 0, _ref(x), _ref(y), _stream(self.device), sp,
                                                  ctypes.byref(stats)), "moert_moe_forward")
        if saved is not None:
            L.hold(saved)
            tpe = torch.empty(self.num_experts, dtype=torch.int64, device=self.device)  # overwritten by the copy
            _capi.check(_capi.lib().moert_saved_tokens_per_expert(saved.ptr, _ref(tpe), _stream(self.device)),
                        "moert_saved_tokens_per_expert")
            self.last_tokens_per_expert = tpe
        self.last_stats = {"router_loss": stats.router_loss, "aux_loss": stats.aux_loss, "z_loss": stats.z_loss,
                           "dispatched_rows": stats.dispatched_rows}
        # a fill kernel with the value as its argument: torch.tensor(value, device=cuda) would copy from pageable
        # memory, which waits for the stream (the forward's tail) before the caller can queue more work
        loss = torch.full((), stats.router_loss, dtype=self.param_dtype, device=self.device)
        return y, loss

    def _run_backward(self, saved_ptr, x, dy, dloss):
        try:
            if dy is None:
                dy = torch.zeros_like(x)
            else:
                dy = dy.contiguous()
                _check_tensor(dy, "grad of y", shape=list(x.shape), dtype=self.dtype, device=self.device)
            scale = 0.0 if dloss is None else float(dloss)
            dx = torch.empty_like(x)
        except BaseException:
            _capi.lib().moert_saved_free(saved_ptr)
            raise
        opts = _capi.BackwardOptions()
        opts.struct_size = ctypes.sizeof(_capi.BackwardOptions)
        opts.router_loss_scale = scale
        opts.accumulate = False
        _capi.check(_capi.lib().moert_moe_backward(self._layers.ptr, saved_ptr, _ref(dy), _ref(dx),
                                                   ctypes.byref(opts), _stream(self.device)), "moert_moe_backward")
        return dx

    def figures(self):
        """The last forward's and backward's figures (moert_layers_figures): stage and backward-part times in ms,
        bytes saved per activation (the shared expert's too, as shared_fc1_out and shared_act), the bytes held,
        recomputed and offloaded, pinned bytes and the device pool's peak."""
        f = _capi.LayerFigures()
        f.struct_size = ctypes.sizeof(_capi.LayerFigures)
        lib = _capi.lib()
        _capi.check(lib.moert_layers_figures(self._layers.ptr, 0, ctypes.byref(f)), "moert_layers_figures")
        name = lambda fn, i: (fn(i) or b"?").decode()  # noqa: E731
        return {"stage_ms": {name(lib.moert_layer_stage_name, i): f.stage_ms[i] for i in range(_capi.LAYER_STAGES)},
                "backward_part_ms": {name(lib.moert_layer_backward_part_name, i): f.backward_part_ms[i]
                                     for i in range(_capi.LAYER_BACKWARD_PARTS)},
                "saved_bytes": dict([(name(lib.moert_layer_activation_name, i), f.saved_bytes[i])
                                     for i in range(_capi.LAYER_ACTIVATIONS)] +
                                    [(name(lib.moert_layer_activation_name, _capi.LAYER_ACTIVATIONS + i),
                                      f.shared_saved_bytes[i]) for i in range(_capi.LAYER_SHARED_ACTIVATIONS)]),
                "held_bytes": f.held_bytes, "recompute_saved_bytes": f.recompute_saved_bytes,
                "offload_saved_bytes": f.offload_saved_bytes, "pinned_bytes": f.pinned_bytes,
                "device_peak_bytes": f.device_peak_bytes}

    def extra_repr(self):
        return ("hidden=%d, ffn_hidden=%d, num_experts=%d, topk=%d, local_experts=%d..%d, rank=%d/%d, dtype=%s, "
                "device=%s" % (self.hidden, self.ffn_hidden, self.num_experts, self.topk, self.first_local_expert,
                               self.first_local_expert + self.num_local_experts - 1, self.rank, self.world_size,
                               self.dtype, self.device))


def expert_parameter_names(model):
    """The names (model.named_parameters()) of the parameters each rank holds alone: the moert modules' fc1 and fc2.
    Their gradients are complete on their rank; keep them out of data-parallel gradient reduction, e.g.
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, expert_parameter_names(model))."""
    ids = {id(p) for m in moe_modules(model) for p in (m.fc1, m.fc2)}
    return [n for n, p in model.named_parameters() if id(p) in ids]


def moe_modules(model):
    """The moert MoE modules of a model."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def after_optimizer_step(model):
    """What each moert MoE module needs once per optimizer step: weights_changed() and update_expert_bias()."""
    for m in moe_modules(model):
        m.weights_changed()
        m.update_expert_bias()


def attach_optimizer(optimizer, model):
    """Calls after_optimizer_step(model) after every optimizer.step(): through register_step_post_hook where
    torch has it (2.0+), else by wrapping optimizer.step. Returns a handle with .remove()."""
    if hasattr(optimizer, "register_step_post_hook"):
        return optimizer.register_step_post_hook(lambda opt, args, kwargs: after_optimizer_step(model))
    step = optimizer.step

    # functools.wraps keeps what an LR scheduler marked on the step it wrapped (_with_counter): without it the
    # scheduler warns that optimizer.step() was overridden after it was made
    @functools.wraps(step)
    def stepped(*args, **kwargs):
        out = step(*args, **kwargs)
        after_optimizer_step(model)
        return out

    optimizer.step = stepped

    class _Handle:
        def remove(self):
            optimizer.step = step
    return _Handle()


# ---- the dispatcher alone ----


class DispatchHandle:
    """What a dispatch keeps until its combine and backward: the moert_dispatch, freed after its backward (or when
    the handle goes away)."""

    def __init__(self, dispatcher, num_tokens):
        self.dispatcher = dispatcher
        self.layers = dispatcher._layers
        self.ptr = ctypes.c_void_p()
        self.num_tokens = num_tokens
        self.recv_rows = 0
        self.superseded = False
        self.training = False

    def get(self):
        if self.superseded:
            raise RuntimeError("moert.torch.Dispatcher: this dispatch was released because the layer "
                               + self.layers.superseded_text("dispatched again"))
        if not self.ptr:
            raise RuntimeError("moert.torch.Dispatcher: this dispatch is finished (its backward ran, or it was "
                               "combined without autograd)")
        return self.ptr

    def _release(self, superseded=False, finalizing=False):
        if self.ptr and self.layers.ptr and _capi._lib is not None:
            _capi._lib.moert_dispatch_free(self.ptr)
        self.ptr = ctypes.c_void_p()
        self.superseded = self.superseded or superseded
        if not finalizing:  # the layers' list holds weak references: a dead one is skipped anyway
            self.layers.drop(self)

    def __del__(self):
        self._release(finalizing=True)


class _DispatchFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, handle):
        ctx.handle = handle
        ctx.save_for_backward(x)
        return handle.dispatcher._run_dispatch(handle, x, topk_weights)

    @staticmethod
    def backward(ctx, d_recv_x, d_recv_weights):
        h = ctx.handle
        x, = ctx.saved_tensors
        disp = h.dispatcher
        if d_recv_x is None:
            d_recv_x = torch.zeros(h.recv_rows, disp.hidden, dtype=disp.dtype, device=disp.device)
        if d_recv_weights is None:
            d_recv_weights = torch.zeros(h.recv_rows, dtype=disp.param_dtype, device=disp.device)
        d_recv_x = _check_tensor(d_recv_x.contiguous(), "grad of recv_x", shape=[h.recv_rows, disp.hidden],
                                 dtype=disp.dtype, device=disp.device)
        d_recv_weights = _check_tensor(d_recv_weights.contiguous(), "grad of recv_weights", shape=[h.recv_rows],
                                       dtype=disp.param_dtype, device=disp.device)
        dx = torch.empty_like(x)
        dw = torch.empty(h.num_tokens, disp.topk, dtype=disp.param_dtype, device=disp.device)
        try:
            _capi.check(_capi.lib().moert_dispatch_backward(h.get(), _ref(d_recv_x), _ref(d_recv_weights), _ref(dx),
                                                            _ref(dw), _stream(disp.device)), "moert_dispatch_backward")
        finally:
            h._release()
        return dx, dw, None


class _CombineFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_expert, handle):
        ctx.handle = handle
        return handle.dispatcher._run_combine(handle, y_expert)

    @staticmethod
    def backward(ctx, dy):
        h = ctx.handle
        disp = h.dispatcher
        dy = _check_tensor(dy.contiguous(), "grad of y", shape=[h.num_tokens, disp.hidden], dtype=disp.dtype,
                           device=disp.device)
        dye = torch.empty(h.recv_rows, disp.hidden, dtype=disp.dtype, device=disp.device)
        _capi.check(_capi.lib().moert_dispatch_combine_backward(h.get(), _ref(dy), _ref(dye), _stream(disp.device)),
                    "moert_dispatch_combine_backward")
        return dye, None


class Dispatcher(_CModule):
    """DeepEP-shaped token dispatch over moert's dispatcher plugin (the config's "dispatcher" section).

        recv_x, recv_weights, tokens_per_expert, handle = disp.dispatch(x, topk_idx, topk_weights)
        y_expert = experts(recv_x) * recv_weights[:, None]   # rows grouped by local expert
        y = disp.combine(y_expert, handle)                   # [T, H]: each token's copies summed

    x [T, H] in the config's model.dtype; topk_idx [T, K] int32 or int64 expert ids over all experts (-1: a
    dropped copy); topk_weights [T, K] in the parameter dtype (fp32; fp64 for fp64 models). recv_x [R, H] and
    recv_weights [R] hold the copies this rank's experts receive, grouped by local expert (tokens_per_expert, a
    CPU int64 tensor [E_local], gives the group sizes; rows past their sum are zero padding). Both calls are
    autograd Functions. One dispatch is in flight per Dispatcher: dispatch again after the last one's backward."""

    def __init__(self, config, process_group=None, *, device=None, max_tokens=None, overrides=None):
        super().__init__()
        self._layers = _Layers(config, process_group, device, max_tokens, overrides)
        info = self._layers.info
        self.hidden, self.num_experts, self.topk = info.hidden, info.num_experts, info.topk
        self.num_local_experts, self.first_local_expert = info.num_local_experts, info.first_local_expert
        self.rank, self.world_size = info.rank, info.world_size
        self.max_tokens = info.max_tokens
        self.dtype, self.param_dtype, self.device = self._layers.dtype, self._layers.param_dtype, self._layers.device
        self.process_group = process_group

    def dispatch(self, x, topk_idx, topk_weights):
        _check_tensor(x, "x", shape=[None, self.hidden], dtype=self.dtype, device=self.device)
        T = x.shape[0]
        if T > self.max_tokens:
            raise ValueError("x: %d tokens, more than this dispatcher's max_tokens %d" % (T, self.max_tokens))
        if not isinstance(topk_idx, torch.Tensor):
            raise TypeError("topk_idx: expected a torch.Tensor, got %s" % type(topk_idx).__name__)
        if topk_idx.dtype not in (torch.int32, torch.int64):
            raise TypeError("topk_idx: expected dtype torch.int32 or torch.int64, got %s" % topk_idx.dtype)
        _check_tensor(topk_idx, "topk_idx", shape=[T, self.topk], device=self.device)
        _check_tensor(topk_weights, "topk_weights", shape=[T, self.topk], dtype=self.param_dtype, device=self.device)
        idx = topk_idx.to(torch.int32) if topk_idx.dtype != torch.int32 else topk_idx
        if torch.is_grad_enabled() and (x.requires_grad or topk_weights.requires_grad):
            handle = self._prepare(idx, T, training=True)
            recv_x, recv_w = _DispatchFunction.apply(x, topk_weights, handle)
        else:
            handle = self._prepare(idx, T, training=False)
            with torch.no_grad():
                recv_x, recv_w = self._run_dispatch(handle, x, topk_weights)
        return recv_x, recv_w, handle.tokens_per_expert, handle

    def _prepare(self, idx, T, training):
        L = self._layers
        L.make_room("moert.torch.Dispatcher", training=training)
        h = DispatchHandle(self, T)
        h.training = training
        rows = ctypes.c_int64()
        _capi.check(_capi.lib().moert_dispatch_prepare(L.ptr, 0, _ref(idx), _stream(self.device), ctypes.byref(h.ptr),
                                                       ctypes.byref(rows)), "moert_dispatch_prepare")
        L.hold(h)
        h.recv_rows = rows.value
        h.idx = idx  # kept alive: moert may read it until the dispatch is freed
        tpe = torch.zeros(self.num_local_experts, dtype=torch.int64, device=self.device)
        _capi.check(_capi.lib().moert_dispatch_tokens_per_expert(h.ptr, _ref(tpe), _stream(self.device)),
                    "moert_dispatch_tokens_per_expert")
        h.tokens_per_expert = tpe.cpu()
        return h

    def _run_dispatch(self, h, x, topk_weights):
        recv_x = torch.zeros(h.recv_rows, self.hidden, dtype=self.dtype, device=self.device)
        recv_w = torch.zeros(h.recv_rows, dtype=self.param_dtype, device=self.device)
        h.x = x
        _capi.check(_capi.lib().moert_dispatch_run(h.get(), _ref(x), _ref(topk_weights), _ref(recv_x), _ref(recv_w),
                                                   _stream(self.device)), "moert_dispatch_run")
        return recv_x, recv_w

    def combine(self, y_expert, handle):
        if not isinstance(handle, DispatchHandle) or handle.dispatcher is not self:
            raise TypeError("handle: expected the DispatchHandle of this Dispatcher's dispatch")
        _check_tensor(y_expert, "y", shape=[handle.recv_rows, self.hidden], dtype=self.dtype, device=self.device)
        if torch.is_grad_enabled() and y_expert.requires_grad:
            return _CombineFunction.apply(y_expert, handle)
        with torch.no_grad():
            y = self._run_combine(handle, y_expert)
        if not handle.training:
            handle._release()
        return y

    def _run_combine(self, h, y_expert):
        y = torch.empty(h.num_tokens, self.hidden, dtype=self.dtype, device=self.device)
        _capi.check(_capi.lib().moert_dispatch_combine(h.get(), _ref(y_expert), _ref(y), _stream(self.device)),
                    "moert_dispatch_combine")
        return y

    def extra_repr(self):
        return ("hidden=%d, num_experts=%d, topk=%d, local_experts=%d..%d, rank=%d/%d, dtype=%s, device=%s"
                % (self.hidden, self.num_experts, self.topk, self.first_local_expert,
                   self.first_local_expert + self.num_local_experts - 1, self.rank, self.world_size, self.dtype,
                   self.device))


# ---- the experts alone ----


class _ExpertsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, module, x, tokens_per_expert, probs, fc1, fc2):
        saved = _Saved(module._layers, "moert.torch.Experts")
        # fresh gradient buffers, bound before the forward: its backward overwrites them for autograd
        grads = (torch.empty_like(fc1), torch.empty_like(fc2))
        y = module._run_forward(x, tokens_per_expert, probs, (fc1, fc2), saved, grads)
        ctx.module, ctx.saved, ctx.grads = module, saved, grads
        ctx.has_probs = probs is not None
        # moert reads x again in the backward (fc1's weight gradient); the weights are bound again with this
        # forward's gradient buffers before it
        ctx.save_for_backward(x, fc1, fc2)
        return y

    @staticmethod
    def backward(ctx, dy):
        module = ctx.module
        x, fc1, fc2 = ctx.saved_tensors
        saved_ptr = ctx.saved.take()  # a second backward through this forward raises there
        grads, ctx.grads = ctx.grads, None
        try:  # with several forwards in flight a later one bound its own gradient buffers since
            module._bind_weights((fc1.detach(), fc2.detach()), grads)
        except BaseException:
            _capi.lib().moert_saved_free(saved_ptr)
            raise
        needs = ctx.needs_input_grad
        dx, dprobs = module._run_backward(saved_ptr, x, dy, ctx.has_probs and needs[3])
        return (None, dx if needs[1] else None, None, dprobs, grads[0] if needs[4] else None,
                grads[1] if needs[5] else None)


class Experts(_CModule):
    """moert's routed experts alone, on rows already dispatched and grouped by local expert (Megatron's GroupedMLP
    contract): forward(x [R, H], tokens_per_expert [E_local] int64, probs [R] or None) -> y [R, H], where each row r
    of expert e gets fc2_e(silu(a) * g * probs[r]) with [a | g] = x[r] fc1_e, through the config's precision plugin
    (bf16, fp8). Rows past the sum of tokens_per_expert (on the CPU or the device) are padding and come out 0. The
    prob is multiplied in fp32 after the activation, before the cast to x's dtype, as Megatron's experts do; probs
    None: 1. An autograd Function: gradients for x, probs, fc1 and fc2.

    Parameters fc1 [E_local, H, 2F] (gate and up halves of SwiGLU) and fc2 [E_local, F, H], in the parameter dtype
    (fp32; fp64 for fp64 models). config: a moert config (path, JSON, dict or moert.Config) of which the model's
    hidden, ffn_hidden and dtype and the precision section are used; num_local_experts: the experts this module holds
    (default $.model.num_experts). No communication: the experts of one rank. parameters=False: no fc1/fc2 of its own
    (the caller passes its weights to run(), as moert.megatron's experts module does). Forwards in flight per
    module: $.parallel.forwards_in_flight (1 by default: each forward's backward runs before the next forward; a
    pipeline schedule's warm-up holds more), each backward writing its own forward's gradient buffers. A forward after the weights changed (a new tensor,
    or an in-place update such as an optimizer step: torch's version counter) tells the precision plugin first, so
    its cached weight copies (bf16 or fp8 on GPUs) are made again."""

    def __init__(self, config, num_local_experts=None, *, device=None, overrides=None, init_seed=1, parameters=True):
        super().__init__()
        lib = _capi.lib()
        if not hasattr(lib, "moert_experts_forward"):
            raise MoertError(_capi.ERR_UNSUPPORTED, "moert.torch.Experts: this libmoert (%s) has no "
                             "moert_experts_forward (API version 4)" % _capi.library_path())
        base = Config(config, overrides)
        model = base.get("model", {}) or {}
        n = int(num_local_experts if num_local_experts is not None else model.get("num_experts", 8))
        # a layer of this rank's experts alone: no routing, no dispatch, no shared expert
        data = {"model": {"hidden": model.get("hidden", 64), "ffn_hidden": model.get("ffn_hidden", 128),
                          "num_experts": n, "topk": 1, "num_layers": 1, "dtype": model.get("dtype", "fp32")},
                "precision": base.get("precision", {}) or {},
                "parallel": {"device": base.get("parallel.device", "auto"),
                             "forwards_in_flight": base.get("parallel.forwards_in_flight", 1) or 1},
                "train": {"tokens_per_rank": 1}}
        self._layers = _Layers(data, _dist.ALONE, device, 1, None)
        info = self._layers.info
        self.hidden, self.ffn_hidden, self.num_local_experts = info.hidden, info.ffn_hidden, info.num_local_experts
        self.dtype, self.param_dtype, self.device = self._layers.dtype, self._layers.param_dtype, self._layers.device
        self.fc1_shape = self._layers.param_desc(_capi.PARAM_FC1)[0]
        self.fc2_shape = self._layers.param_desc(_capi.PARAM_FC2)[0]
        self._placeholder_grads = None
        self._weights_seen = None
        if parameters:
            self.fc1 = nn.Parameter(torch.zeros(self.fc1_shape, dtype=self.param_dtype, device=self.device))
            self.fc2 = nn.Parameter(torch.zeros(self.fc2_shape, dtype=self.param_dtype, device=self.device))
            if init_seed is not None:
                self.reset_parameters(init_seed)
        else:
            self.fc1 = self.fc2 = None

    def reset_parameters(self, seed=1):
        """Initial values: normal, std 1/sqrt(H) for fc1 and 0.5/sqrt(F) for fc2, from torch's generator seeded with
        seed."""
        g = torch.Generator().manual_seed(int(seed))
        with torch.no_grad():
            self.fc1.copy_(torch.randn(self.fc1_shape, generator=g, dtype=torch.float64) / self.hidden ** 0.5)
            self.fc2.copy_(torch.randn(self.fc2_shape, generator=g, dtype=torch.float64) * 0.5 / self.ffn_hidden ** 0.5)

    def weights_changed(self):
        """Call once per optimizer step (FP8 weight copies are made again)."""
        _capi.check(_capi.lib().moert_layers_weights_changed(self._layers.ptr, _stream(self.device)),
                    "moert_layers_weights_changed")

    def forward(self, x, tokens_per_expert, probs=None):
        if self.fc1 is None:
            raise RuntimeError("moert.torch.Experts: made with parameters=False: call run(x, tokens_per_expert, probs, "
                               "fc1, fc2)")
        return self.run(x, tokens_per_expert, probs, self.fc1, self.fc2)

    def run(self, x, tokens_per_expert, probs, fc1, fc2):
        """forward() with the weights given: fc1 [E_local, H, 2F] and fc2 [E_local, F, H] (contiguous, the parameter
        dtype and device; views of the caller's parameters, which get the gradients)."""
        _check_tensor(x, "x", shape=[None, self.hidden], dtype=self.dtype, device=self.device)
        if not isinstance(tokens_per_expert, torch.Tensor):
            raise TypeError("tokens_per_expert: expected a torch.Tensor, got %s" % type(tokens_per_expert).__name__)
        tpe = tokens_per_expert.to(torch.int64).contiguous()
        if tpe.device.type != "cpu":
            tpe = tpe.to(self.device)
        _check_tensor(tpe, "tokens_per_expert", shape=[self.num_local_experts])
        if probs is not None:
            if not isinstance(probs, torch.Tensor):
                raise TypeError("probs: expected a torch.Tensor or None, got %s" % type(probs).__name__)
            if probs.dim() == 2 and probs.shape[1] == 1:
                probs = probs.reshape(-1)
            probs = probs.to(self.param_dtype).contiguous()
            _check_tensor(probs, "probs", shape=[x.shape[0]], device=self.device)
        _check_tensor(fc1, "fc1", shape=self.fc1_shape, dtype=self.param_dtype, device=self.device)
        _check_tensor(fc2, "fc2", shape=self.fc2_shape, dtype=self.param_dtype, device=self.device)
        seen = (fc1.data_ptr(), fc1._version, fc2.data_ptr(), fc2._version)
        if self._weights_seen is not None and seen != self._weights_seen:
            self.weights_changed()
        self._weights_seen = seen
        if torch.is_grad_enabled() and (x.requires_grad or fc1.requires_grad or fc2.requires_grad or
                                        (probs is not None and probs.requires_grad)):
            return _ExpertsFunction.apply(self, x, tpe, probs, fc1, fc2)
        with torch.no_grad():
            if self._placeholder_grads is None:  # bound, never written: no backward follows
                self._placeholder_grads = (torch.empty_like(fc1), torch.empty_like(fc2))
            return self._run_forward(x, tpe, probs, (fc1.detach(), fc2.detach()), None, self._placeholder_grads)

    def _run_forward(self, x, tpe, probs, weights, saved, grads):
        L = self._layers
        L.make_room("moert.torch.Experts", training=saved is not None)
        lib = _capi.lib()
        self._bind_weights(weights, grads)
        y = torch.empty_like(x)
        sp = ctypes.byref(saved.ptr) if saved is not None else None
        _capi.check(lib.moert_experts_forward(L.ptr, 0, _ref(x), _ref(tpe), _ref(probs) if probs is not None else None,
                                              _ref(y), _stream(self.device), sp), "moert_experts_forward")
        if saved is not None:
            L.hold(saved)
        return y

    def _bind_weights(self, weights, grads):
        for which, v, g in ((_capi.PARAM_FC1, weights[0], grads[0]), (_capi.PARAM_FC2, weights[1], grads[1])):
            _capi.check(_capi.lib().moert_layers_bind_param(self._layers.ptr, 0, which, _ref(v), _ref(g)),
                        "moert_layers_bind_param(%s)" % _capi.PARAM_NAMES[which])

    def _run_backward(self, saved_ptr, x, dy, want_dprobs):
        try:
            # an empty gradient may come expanded (stride 0), which moert does not call contiguous
            dy = torch.zeros_like(x) if dy is None or dy.numel() == 0 else dy.contiguous()
            _check_tensor(dy, "grad of y", shape=list(x.shape), dtype=self.dtype, device=self.device)
            dx = torch.empty_like(x)
            dp = torch.empty(x.shape[0], dtype=self.param_dtype, device=self.device) if want_dprobs else None
        except BaseException:
            _capi.lib().moert_saved_free(saved_ptr)
            raise
        opts = _capi.BackwardOptions()
        opts.struct_size = ctypes.sizeof(_capi.BackwardOptions)
        opts.router_loss_scale = 0.0
        opts.accumulate = False
        _capi.check(_capi.lib().moert_experts_backward(self._layers.ptr, saved_ptr, _ref(dy), _ref(dx),
                                                       _ref(dp) if dp is not None else None, ctypes.byref(opts),
                                                       _stream(self.device)), "moert_experts_backward")
        return dx, dp

    def extra_repr(self):
        return "hidden=%d, ffn_hidden=%d, local_experts=%d, dtype=%s, device=%s" % (
            self.hidden, self.ffn_hidden, self.num_local_experts, self.dtype, self.device)
