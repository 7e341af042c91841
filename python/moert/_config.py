# SPDX-License-Identifier: Apache-2.0
"""A moert config on the Python side: the C moert_config (what moert reads) and a dict mirror (what the
Python side reads: the pure-PyTorch reference's router options). Plugin names are left to moert's own search,
which finds the plugins a wheel bundles beside its libmoert.so (<libdir>/moert/plugins)."""
import copy
import ctypes
import json
import os

from . import _capi


def _json_value(value):
    return value if isinstance(value, str) and _is_json(value) else json.dumps(value)


def _is_json(text):
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def _set_dotted(d, key, value):
    """d[a][b].. = value for key "a.b..", making the missing sections; a section that is there but not an object is
    left as it is (moert's check then names its JSON path) instead of being replaced by one."""
    parts = key.split(".")
    for p in parts[:-1]:
        if p not in d:
            d[p] = {}
        if not isinstance(d[p], dict):
            return
        d = d[p]
    d[parts[-1]] = value


def _no_duplicate_keys(pairs):
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError("duplicate key")  # moert's own parser then names it, with its line and column
    return dict(pairs)


class Config:
    """A config from a path, a JSON string, a dict or another Config, with optional overrides
    ({"model.num_layers": 1, ...}, applied with moert_config_set in order)."""

    def __init__(self, config, overrides=None):
        lib = _capi.lib()
        self._ptr = ctypes.c_void_p()
        merged = False  # the overrides are in the text moert loads (else they are set one by one after it)
        if isinstance(config, Config):
            self.data = copy.deepcopy(config.data)
            text, source, merged = self._with_overrides(overrides), config.source, True
        elif isinstance(config, dict):
            self.data = copy.deepcopy(config)
            text, source, merged = self._with_overrides(overrides), "<dict>", True
        elif isinstance(config, (str, bytes, os.PathLike)):
            s = config.decode() if isinstance(config, bytes) else config
            if isinstance(s, str) and s.lstrip().startswith("{"):
                try:
                    self.data = json.loads(s)
                    text, merged = self._with_overrides(overrides), True
                except ValueError:
                    text = s  # moert's parser says where the text is broken
                source = "<string>"
            else:
                path = os.fspath(s)
                if not os.path.exists(path):
                    raise FileNotFoundError("moert config: no such file: %s" % path)
                source, text = path, None
                if overrides:
                    # the overrides merged into the file's values and checked together, as for a dict (one at a time
                    # a pair that must agree, such as the expert layout and $.parallel.ranks, would be refused
                    # half-set)
                    try:
                        with open(path) as f:
                            self.data = json.load(f, object_pairs_hook=_no_duplicate_keys)
                        if isinstance(self.data, dict):
                            text, merged = self._with_overrides(overrides), True
                    except ValueError:
                        pass  # moert's parser says where the file is broken
                if text is None:
                    # moert reads the file itself, so its errors name the file, line and column
                    _capi.check(lib.moert_config_load_file(path.encode(), ctypes.byref(self._ptr)),
                                "moert_config_load_file")
                    with open(path) as f:
                        self.data = json.load(f)
        else:
            raise TypeError("moert config: expected a path, a JSON string, a dict or a moert Config, got %s"
                            % type(config).__name__)
        if text is not None:
            _capi.check(lib.moert_config_load_string(text.encode(), source.encode(), ctypes.byref(self._ptr)),
                        "moert_config_load_string")
        self.source = source
        for key, value in ({} if merged else overrides or {}).items():
            self.set(key, value)

    def _with_overrides(self, overrides):
        """The JSON text of self.data with the overrides already in it: moert checks the config as a whole when it
        loads it, so keys that must agree (the expert layout and $.parallel.ranks) are set together."""
        for key, value in (overrides or {}).items():
            _set_dotted(self.data, key, json.loads(_json_value(value)))
        return json.dumps(self.data)

    def set(self, key, value):
        """moert_config_set(key, value): value is a Python value (JSON-encoded here) or JSON text."""
        jv = _json_value(value)
        _capi.check(_capi.lib().moert_config_set(self._ptr, key.encode(), jv.encode()), "moert_config_set(%s)" % key)
        _set_dotted(self.data, key, json.loads(jv))

    def get(self, dotted, default=None):
        d = self.data
        for p in dotted.split("."):
            if not isinstance(d, dict) or p not in d:
                return default
            d = d[p]
        return d

    @property
    def ptr(self):
        return self._ptr

    def __del__(self):
        p = getattr(self, "_ptr", None)
        if p and _capi._lib is not None:
            _capi._lib.moert_config_free(p)
            self._ptr = ctypes.c_void_p()
