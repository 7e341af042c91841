# SPDX-License-Identifier: Apache-2.0
"""PEP 517 build backend of the moert Python package (pyproject.toml: backend-path = ["python/packaging"]).

`pip install .` from a checkout runs meson (setup + compile, in a temporary build directory unless the config
setting `builddir` names one) and writes a wheel holding
    moert/*.py                          the package (python/moert)
    moert/_lib/libmoert.so              the C library (ctypes loads it by path)
    moert/_lib/moert/plugins/*.so       every built plugin (next to the library as in <libdir>/moert/plugins)
The wheel is tagged py3-none-<platform>: the binding is ctypes, so it serves any Python 3 of that platform.
Config settings: `setup-args` (extra `meson setup` arguments, e.g. "-Dcuda=disabled"; also MOERT_MESON_ARGS),
`builddir`, and `compile=false` (package that build directory as it is, without running meson compile in it). meson and ninja come from PATH, else from PyPI (get_requires_for_build_wheel asks for them).
"""
import base64
import csv
import glob
import hashlib
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NAME = "moert"


def _version():
    with open(os.path.join(ROOT, "meson.build")) as f:
        m = re.search(r"version\s*:\s*'([^']+)'", f.read())
    return m.group(1) if m else "0.0.0"


def _metadata():
    v = _version()
    readme = os.path.join(ROOT, "docs", "python.md")
    desc = open(readme).read() if os.path.exists(readme) else ""
    return ("Metadata-Version: 2.1\nName: %s\nVersion: %s\n"
            "Summary: Mixture-of-Experts layers from moert's C runtime (plugins: router, dispatcher, precision, "
            "memory policy) for PyTorch\nLicense: Apache-2.0\nRequires-Python: >=3.8\n"
            "Provides-Extra: torch\nRequires-Dist: torch>=1.13; extra == \"torch\"\n"
            "Description-Content-Type: text/markdown\n\n%s" % (NAME, v, desc))


def _setting(config_settings, key):
    v = (config_settings or {}).get(key)
    if isinstance(v, list):
        v = " ".join(v)
    return v


def get_requires_for_build_wheel(config_settings=None):
    reqs = []
    if shutil.which("meson") is None:
        reqs.append("meson>=1.0")
    if shutil.which("ninja") is None:
        reqs.append("ninja")
    return reqs


get_requires_for_build_sdist = lambda config_settings=None: []  # noqa: E731


_MESON = None


def _meson_command():
    """meson as found on PATH (or PyPI's in the build environment), with an environment it runs in: pip's build
    isolation puts a PYTHONPATH in front that hides the system's site-packages, where Debian's meson lives."""
    global _MESON
    if _MESON is None:
        exe = shutil.which("meson")
        cmd = [exe] if exe else [sys.executable, "-m", "mesonbuild.mesonmain"]
        clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME")}
        for env in (dict(os.environ), clean):
            try:
                subprocess.check_output(cmd + ["--version"], env=env, stderr=subprocess.STDOUT)
                _MESON = (cmd, env)
                break
            except (OSError, subprocess.CalledProcessError):
                continue
        else:
            raise RuntimeError("moert build: meson does not run (install meson >= 1.0 and ninja)")
    return _MESON


def _meson(*args):
    cmd, env = _meson_command()
    print("moert build: " + " ".join(cmd + list(args)), flush=True)
    subprocess.check_call(cmd + list(args), env=env)


def _distinfo_files(version, tag):
    return {"METADATA": _metadata().encode(),
            "WHEEL": ("Wheel-Version: 1.0\nGenerator: moert_build\nRoot-Is-Purelib: false\nTag: %s\n" % tag).encode()}


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    version = _version()
    distinfo = "%s-%s.dist-info" % (NAME, version)
    d = os.path.join(metadata_directory, distinfo)
    os.makedirs(d, exist_ok=True)
    for name, data in _distinfo_files(version, "py3-none-" + _platform_tag()).items():
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)
    return distinfo


def _build(builddir, config_settings):
    extra = shlex.split(_setting(config_settings, "setup-args") or os.environ.get("MOERT_MESON_ARGS", ""))
    if not os.path.exists(os.path.join(builddir, "build.ninja")):
        _meson("setup", builddir, ROOT, "--buildtype=release", "-Db_ndebug=true", *extra)
    elif extra:
        _meson("configure", builddir, *extra)
    if _setting(config_settings, "compile") != "false":
        _meson("compile", "-C", builddir)
    lib = os.path.join(builddir, "core", "libmoert.so")
    plugins = sorted(p for p in glob.glob(os.path.join(builddir, "plugins", "*", "libmoert-*.so")))
    if not os.path.exists(lib) or not plugins:
        raise RuntimeError("moert build: no libmoert.so or plugins under %s" % builddir)
    return os.path.realpath(lib), plugins


def _files(builddir, config_settings):
    """(path in the wheel, source file) of every file of the package."""
    lib, plugins = _build(builddir, config_settings)
    out = []
    pkg = os.path.join(ROOT, "python", NAME)
    for dirpath, _, names in os.walk(pkg):
        if "__pycache__" in dirpath or os.path.basename(dirpath) == "_lib":
            continue
        for n in sorted(names):
            if n.endswith(".py"):
                src = os.path.join(dirpath, n)
                out.append((os.path.relpath(src, os.path.join(ROOT, "python")).replace(os.sep, "/"), src))
    out.append((NAME + "/_lib/libmoert.so", lib))
    for p in plugins:
        out.append((NAME + "/_lib/moert/plugins/" + os.path.basename(p), p))
    return out


def _record_hash(data):
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _platform_tag():
    return re.sub(r"[^A-Za-z0-9]", "_", sysconfig.get_platform())


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    version = _version()
    tag = "py3-none-" + _platform_tag()
    wheel_name = "%s-%s-%s.whl" % (NAME, version, tag)
    distinfo = "%s-%s.dist-info" % (NAME, version)
    builddir = _setting(config_settings, "builddir")
    tmp = None
    if not builddir:
        tmp = tempfile.mkdtemp(prefix="moert-wheel-build-")
        builddir = tmp
    try:
        files = _files(os.path.abspath(builddir), config_settings)
        records = []
        path = os.path.join(wheel_directory, wheel_name)
        with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
            def add(arcname, data, mode=0o644):
                zi = zipfile.ZipInfo(arcname, date_time=(2020, 1, 1, 0, 0, 0))
                zi.external_attr = (0o100000 | mode) << 16
                zi.compress_type = zipfile.ZIP_DEFLATED
                z.writestr(zi, data)
                records.append((arcname, _record_hash(data), str(len(data))))
            for arc, src in files:
                with open(src, "rb") as f:
                    add(arc, f.read(), 0o755 if arc.endswith(".so") else 0o644)
            for name, data in _distinfo_files(version, tag).items():
                add(distinfo + "/" + name, data)
            lic = os.path.join(ROOT, "LICENSE")
            if os.path.exists(lic):
                with open(lic, "rb") as f:
                    add(distinfo + "/LICENSE", f.read())
            buf = io.StringIO()
            w = csv.writer(buf, lineterminator="\n")
            for r in records:
                w.writerow(r)
            w.writerow((distinfo + "/RECORD", "", ""))
            z.writestr(zipfile.ZipInfo(distinfo + "/RECORD", date_time=(2020, 1, 1, 0, 0, 0)), buf.getvalue())
        return wheel_name
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def build_sdist(sdist_directory, config_settings=None):
    """The tracked files of the checkout (git ls-files), else every file but build trees and .git."""
    version = _version()
    base = "%s-%s" % (NAME, version)
    try:
        names = subprocess.check_output(["git", "-C", ROOT, "ls-files", "-z"]).decode().split("\0")
        names = [n for n in names if n and os.path.isfile(os.path.join(ROOT, n))]
    except (OSError, subprocess.CalledProcessError):
        names = []
        for dirpath, dirs, fs in os.walk(ROOT):
            dirs[:] = [d for d in dirs if d != ".git" and not os.path.exists(os.path.join(dirpath, d, "build.ninja"))]
            names += [os.path.relpath(os.path.join(dirpath, f), ROOT) for f in fs]
    path = os.path.join(sdist_directory, base + ".tar.gz")
    with tarfile.open(path, "w:gz", format=tarfile.PAX_FORMAT) as t:
        for n in sorted(names):
            t.add(os.path.join(ROOT, n), arcname=base + "/" + n, recursive=False)
        data = _metadata().encode()
        ti = tarfile.TarInfo(base + "/PKG-INFO")
        ti.size = len(data)
        t.addfile(ti, io.BytesIO(data))
    return base + ".tar.gz"
