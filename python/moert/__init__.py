# SPDX-License-Identifier: Apache-2.0
"""moert: Mixture-of-Experts layers from a C runtime whose parts are plugins, for PyTorch.

    import moert.torch
    moe = moert.torch.MoE("configs/demo-cpu.json")
    y, router_loss = moe(x)            # x [T, H]; y = MoE(x), no residual

See docs/python.md. The C library is loaded on first use: the copy bundled by `pip install .`, or one named with
moert.load_library(path) (a libmoert.so or a meson build directory; for development trees).
"""
from ._capi import MoertError, load_library, library_path  # noqa: F401
from ._config import Config  # noqa: F401

__version__ = "0.1.0"

__all__ = ["MoertError", "Config", "load_library", "library_path", "version", "__version__"]


def version():
    """The C library's version string (moert_version())."""
    from . import _capi
    v = _capi.lib().moert_version()
    return v.decode() if v else ""
