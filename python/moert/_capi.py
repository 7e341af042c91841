# SPDX-License-Identifier: Apache-2.0
"""ctypes declarations of moert's public C API (core/include/moert/{moert,layers,tensor,plugin}.h).

Only this module touches ctypes types; everything else goes through `lib()` (the loaded CDLL with typed
prototypes) and `check()` (a result code -> moert.MoertError).
"""
import ctypes
import os
import threading

# ---- enums (tensor.h, plugin.h) ----

DEVICE_CPU, DEVICE_CUDA, DEVICE_CUDA_HOST = 1, 2, 3

F32, F64, BF16, F16, F8E4M3, F8E5M2, I32, I64 = range(8)
DTYPE_COUNT = 8
DTYPE_NAMES = ["fp32", "fp64", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "int32", "int64"]

RESULT_NAMES = ["ok", "invalid argument", "config error", "unsupported", "out of memory", "not found",
                "ABI mismatch", "CUDA error", "NCCL error", "timeout", "I/O error", "internal error"]
RESULT_CODES = ["MOERT_OK", "MOERT_ERR_INVALID_ARGUMENT", "MOERT_ERR_CONFIG", "MOERT_ERR_UNSUPPORTED",
                "MOERT_ERR_OUT_OF_MEMORY", "MOERT_ERR_NOT_FOUND", "MOERT_ERR_ABI_MISMATCH", "MOERT_ERR_CUDA",
                "MOERT_ERR_NCCL", "MOERT_ERR_TIMEOUT", "MOERT_ERR_IO", "MOERT_ERR_INTERNAL"]
OK, ERR_INVALID_ARGUMENT, ERR_CONFIG, ERR_UNSUPPORTED = 0, 1, 2, 3

PARAM_ROUTER, PARAM_FC1, PARAM_FC2, PARAM_SHARED_FC1, PARAM_SHARED_FC2, PARAM_SHARED_GATE = range(6)
PARAM_NAMES = ["router_weight", "fc1", "fc2", "shared_fc1", "shared_fc2", "shared_gate"]

MAX_DIMS = 4
NCCL_ID_BYTES = 128
API_VERSION = 1  # the MOERT_API_VERSION this binding was written against

# ---- structs ----


class Device(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int32), ("id", ctypes.c_int32)]


class Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", Device), ("dtype", ctypes.c_int),
                ("ndim", ctypes.c_int32), ("shape", ctypes.c_int64 * MAX_DIMS),
                ("strides", ctypes.c_int64 * MAX_DIMS)]


class Launch(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("rank", ctypes.c_int32), ("world_size", ctypes.c_int32),
                ("device", Device), ("comm", ctypes.c_void_p), ("max_tokens", ctypes.c_int64),
                ("expert_tensor_parallel", ctypes.c_int32), ("expert_data_parallel", ctypes.c_int32),
                ("flags", ctypes.c_uint32), ("micro_batches", ctypes.c_int32)]  # API version 6


class LayersInfo(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("num_layers", ctypes.c_int32), ("rank", ctypes.c_int32),
                ("world_size", ctypes.c_int32), ("hidden", ctypes.c_int64), ("ffn_hidden", ctypes.c_int64),
                ("num_experts", ctypes.c_int64), ("topk", ctypes.c_int64), ("num_local_experts", ctypes.c_int64),
                ("first_local_expert", ctypes.c_int64), ("max_tokens", ctypes.c_int64), ("dtype", ctypes.c_int),
                ("param_dtype", ctypes.c_int), ("device", Device), ("expert_bias_dtype", ctypes.c_int),
                ("ep_rank", ctypes.c_int32), ("ep_size", ctypes.c_int32), ("etp_rank", ctypes.c_int32),
                ("etp_size", ctypes.c_int32), ("edp_rank", ctypes.c_int32), ("edp_size", ctypes.c_int32),
                ("local_ffn_hidden", ctypes.c_int64), ("stream", ctypes.c_void_p),  # stream: API version 6
                ("slots", ctypes.c_int32)]  # API version 7


class MoeStats(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("router_loss", ctypes.c_double), ("aux_loss", ctypes.c_double),
                ("z_loss", ctypes.c_double), ("dispatched_rows", ctypes.c_int64)]


class BackwardOptions(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("router_loss_scale", ctypes.c_double),
                ("accumulate", ctypes.c_bool)]


LAYER_STAGES, LAYER_BACKWARD_PARTS, LAYER_ACTIVATIONS = 8, 10, 3
LAYER_SHARED_ACTIVATIONS = 2  # the shared expert's, after the routed ones (API version 3)


class LayerFigures(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("stage_ms", ctypes.c_double * LAYER_STAGES),
                ("backward_part_ms", ctypes.c_double * LAYER_BACKWARD_PARTS),
                ("saved_bytes", ctypes.c_int64 * LAYER_ACTIVATIONS), ("held_bytes", ctypes.c_int64),
                ("recompute_saved_bytes", ctypes.c_int64), ("offload_saved_bytes", ctypes.c_int64),
                ("pinned_bytes", ctypes.c_int64), ("device_peak_bytes", ctypes.c_int64),
                ("shared_saved_bytes", ctypes.c_int64 * LAYER_SHARED_ACTIVATIONS)]



ALLGATHER_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                ctypes.c_void_p, ctypes.c_size_t)
ALLREDUCE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                ctypes.c_void_p, ctypes.c_size_t)
ALLTOALLV_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                ctypes.POINTER(ctypes.c_size_t), ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                ctypes.POINTER(ctypes.c_size_t), ctypes.c_void_p, ctypes.c_size_t)
BARRIER_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
LOG_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p)


class Collectives(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("user", ctypes.c_void_p), ("allgather", ALLGATHER_FN),
                ("allreduce_sum", ALLREDUCE_FN), ("alltoallv", ALLTOALLV_FN), ("barrier", BARRIER_FN)]


# ---- errors ----


class MoertError(RuntimeError):
    """A moert C call failed: `code` is the moert_result, `code_name` its MOERT_ERR_* name, the text is
    moert_last_error() of the failing call."""

    def __init__(self, code, message, call=None):
        self.code = int(code)
        self.code_name = RESULT_CODES[self.code] if 0 <= self.code < len(RESULT_CODES) else "MOERT_ERR_%d" % code
        self.call = call
        self.message = message
        where = "%s: " % call if call and not (message or "").startswith(call.split("(")[0] + ":") else ""
        text = message or (RESULT_NAMES[self.code] if 0 <= self.code < len(RESULT_NAMES) else "error")
        super().__init__("%s%s [%s]" % (where, text, self.code_name))


# ---- finding and loading libmoert ----

_lock = threading.Lock()
_lib = None
_lib_path = None

_P = ctypes.c_void_p
_PP = ctypes.POINTER(ctypes.c_void_p)
_T = ctypes.POINTER(Tensor)
_R = ctypes.c_int

# name: (restype, argtypes)
_PROTOTYPES = {
    "moert_version": (ctypes.c_char_p, []),
    "moert_last_error": (ctypes.c_char_p, []),
    "moert_api_version": (ctypes.c_int, []),
    "moert_config_load_file": (_R, [ctypes.c_char_p, _PP]),
    "moert_config_load_string": (_R, [ctypes.c_char_p, ctypes.c_char_p, _PP]),
    "moert_config_set": (_R, [_P, ctypes.c_char_p, ctypes.c_char_p]),
    "moert_config_free": (None, [_P]),
    "moert_comm_create_threads": (_R, [ctypes.c_int, ctypes.c_double, _PP]),
    "moert_comm_create_collectives": (_R, [ctypes.c_int, ctypes.POINTER(Collectives), _PP]),
    "moert_nccl_unique_id": (_R, [ctypes.c_void_p]),
    "moert_comm_create_nccl": (_R, [ctypes.c_void_p, ctypes.c_int, ctypes.c_double, _PP]),
    "moert_comm_destroy": (None, [_P]),
    "moert_layers_create": (_R, [_P, ctypes.POINTER(Launch), _PP]),
    "moert_layers_destroy": (None, [_P]),
    "moert_layers_get_info": (_R, [_P, ctypes.POINTER(LayersInfo)]),
    "moert_layers_param_desc": (_R, [_P, ctypes.c_int, ctypes.c_int, _T]),
    "moert_layers_bind_param": (_R, [_P, ctypes.c_int, ctypes.c_int, _T, _T]),
    "moert_layers_init_params": (_R, [_P, ctypes.c_uint64, _P]),
    "moert_layers_weights_changed": (_R, [_P, _P]),
    "moert_layers_update_expert_bias": (_R, [_P, _P]),
    "moert_layers_get_expert_bias": (_R, [_P, ctypes.c_int, _T, _P]),
    "moert_layers_set_expert_bias": (_R, [_P, ctypes.c_int, _T, _P]),
    "moert_moe_forward": (_R, [_P, ctypes.c_int, _T, _T, _P, _PP, ctypes.POINTER(MoeStats)]),
    "moert_moe_backward": (_R, [_P, _P, _T, _T, ctypes.POINTER(BackwardOptions), _P]),
    "moert_moe_forward_backward": (_R, [_P, ctypes.c_int, _T, _T, _PP, ctypes.POINTER(MoeStats), _P, _T, _T,
                                        ctypes.POINTER(BackwardOptions), _P]),
    "moert_saved_tokens_per_expert": (_R, [_P, _T, _P]),
    "moert_saved_free": (None, [_P]),
    "moert_layers_figures": (_R, [_P, ctypes.c_int, ctypes.POINTER(LayerFigures)]),
    "moert_layer_stage_name": (ctypes.c_char_p, [ctypes.c_int]),
    "moert_layer_backward_part_name": (ctypes.c_char_p, [ctypes.c_int]),
    "moert_layer_activation_name": (ctypes.c_char_p, [ctypes.c_int]),
    "moert_dispatch_prepare": (_R, [_P, ctypes.c_int, _T, _P, _PP, ctypes.POINTER(ctypes.c_int64)]),
    "moert_dispatch_tokens_per_expert": (_R, [_P, _T, _P]),
    "moert_dispatch_run": (_R, [_P, _T, _T, _T, _T, _P]),
    "moert_dispatch_combine": (_R, [_P, _T, _T, _P]),
    "moert_dispatch_combine_backward": (_R, [_P, _T, _T, _P]),
    "moert_dispatch_backward": (_R, [_P, _T, _T, _T, _T, _P]),
    "moert_dispatch_free": (None, [_P]),
    "moert_experts_forward": (_R, [_P, ctypes.c_int, _T, _T, _T, _T, _P, _PP]),
    "moert_experts_backward": (_R, [_P, _P, _T, _T, _T, ctypes.POINTER(BackwardOptions), _P]),
    "moert_set_log_callback": (None, [LOG_FN, _P]),
}


# appended to the API after its first version: used where present
_OPTIONAL = {"moert_layers_figures", "moert_layer_stage_name", "moert_layer_backward_part_name",
             "moert_layer_activation_name", "moert_experts_forward", "moert_experts_backward",
             "moert_moe_forward_backward"}


def package_lib_dir():
    """The folder of the libmoert.so bundled by `pip install .` (None when not bundled)."""
    d = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_lib")
    return d if os.path.exists(os.path.join(d, "libmoert.so")) else None


def _candidates():
    """Where libmoert.so is looked for without load_library(): the copy `pip install .` bundled; else (development
    only) MOERT_TORCH_LIBRARY, a libmoert.so or a meson build directory."""
    d = package_lib_dir()
    if d:
        yield os.path.join(d, "libmoert.so")
    env = os.environ.get("MOERT_TORCH_LIBRARY")
    if env:
        env = os.path.abspath(env)
        yield os.path.join(env, "core", "libmoert.so") if os.path.isdir(env) else env


def load_library(path=None):
    """Loads libmoert (once per process). `path` is a libmoert.so or a meson build directory; without it
    the bundled library is used (see _candidates for development checkouts). Returns the path loaded."""
    global _lib, _lib_path
    with _lock:
        if path is not None:
            path = os.path.abspath(path)
            if os.path.isdir(path):
                path = os.path.join(path, "core", "libmoert.so")
            if _lib is not None:
                if os.path.realpath(path) != os.path.realpath(_lib_path):
                    raise RuntimeError("moert: libmoert is already loaded from %s; cannot load %s too"
                                       % (_lib_path, path))
                return _lib_path
            cands = [path]
        else:
            if _lib is not None:
                return _lib_path
            cands = list(_candidates())
        tried = []
        for p in cands:
            if not os.path.exists(p):
                tried.append("%s (no such file)" % p)
                continue
            try:
                lib = ctypes.CDLL(p, mode=ctypes.RTLD_LOCAL)
            except OSError as e:
                tried.append("%s (%s)" % (p, e))
                continue
            missing = []
            for name, (res, args) in _PROTOTYPES.items():
                fn = getattr(lib, name, None)
                if fn is None:
                    if name not in _OPTIONAL:
                        missing.append(name)
                    continue
                fn.restype = res
                fn.argtypes = args
            if missing:
                tried.append("%s (does not export %s: an older libmoert without the embedding API)"
                             % (p, ", ".join(missing[:4]) + (" ..." if len(missing) > 4 else "")))
                continue
            _lib, _lib_path = lib, p
            return p
        raise ImportError("moert: cannot load libmoert.so: tried " + ("; ".join(tried) if tried else "nothing")
                          + " (pip install the package; in a development tree call moert.load_library(BUILD_DIR) "
                          "or set MOERT_TORCH_LIBRARY=BUILD_DIR)")


def lib():
    if _lib is None:
        load_library()
    return _lib


def library_path():
    lib()
    return _lib_path


def last_error():
    m = lib().moert_last_error()
    return m.decode("utf-8", "replace") if m else ""


def check(rc, call):
    if rc != OK:
        raise MoertError(rc, last_error(), call)
    return rc
