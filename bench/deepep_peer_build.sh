#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds DeepEP (the tarball of bench/deepep_peer_src.sh) intranode-only, without NVSHMEM, against the GPU machine's
# PyTorch, for sm_90; run on a 1-GPU machine (the build needs no GPU, the import check at the end does). Writes
#   OUT/deepep-build.tgz   what importing deep_ep needs: the deep_ep package and its extension deep_ep_cpp*.so
#                          (strip --strip-debug), and deepep_build_info.txt; unpack it into a folder and put that
#                          folder on PYTHONPATH (bench/deepep_peer_gpu.sh does)
#   OUT/deepep-build.txt   commit, torch, nvcc, python and gcc versions, build seconds, sizes, sha256 of the .tgz
#   OUT/deepep-build.log   the whole build's output
# How the build is kept off NVSHMEM, without editing DeepEP's source: DeepEP v1's setup.py compiles with
# -DDISABLE_NVSHMEM and leaves out the internode kernels when neither NVSHMEM_DIR is set nor the Python module
# nvidia.nvshmem is found; the GPU machine has the nvidia-nvshmem-cu13 wheel, so setup.py runs under a small driver
# that hides that module from it. The driver also adds the device-link step (nvcc -dlink) that setup.py only adds
# with NVSHMEM: its objects are compiled with -rdc=true, and without a device link the extension does not load
# (undefined __cudaRegisterLinkedBinary_* symbols). Every step is checked; a failure names the step and exits 1.
#   usage: bench/deepep_peer_build.sh SRC_TGZ OUT
#   environment: PYTHON (/opt/torch/.venv/bin/python3), MAX_JOBS (16), DEEPEP_ARCH_LIST (TORCH_CUDA_ARCH_LIST, 9.0),
#                DEEPEP_BUILD_TIMEOUT (seconds for the compile step, 480: the whole script stays under 10 minutes)
set -uo pipefail
SRC_TGZ=$(realpath "${1:?usage: bench/deepep_peer_build.sh SRC_TGZ OUT}")
OUT=$(mkdir -p "${2:?usage: bench/deepep_peer_build.sh SRC_TGZ OUT}" && realpath "$2")
export PATH=/opt/torch/.venv/bin:$PATH
PYTHON=${PYTHON:-/opt/torch/.venv/bin/python3}
# sm_90 whatever the machine's environment says (DEEPEP_ARCH_LIST to change it)
export MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${DEEPEP_ARCH_LIST:-9.0}
[ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ] && export CUDA_HOME=/usr/local/cuda
[ -n "${CUDA_HOME:-}" ] && export PATH=$CUDA_HOME/bin:$PATH
unset NVSHMEM_DIR DISABLE_SM90_FEATURES TOPK_IDX_BITS
LOG=$OUT/deepep-build.log
WORK=$(mktemp -d /tmp/deepep-build.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
: >"$LOG"
step_name=
step() { step_name=$1; echo "== $1" | tee -a "$LOG"; }
fail() {
  echo "deepep_peer_build.sh: FAILED at step '$step_name': $*" | tee -a "$LOG" >&2
  echo "--- last lines of $LOG:" >&2
  tail -n 40 "$LOG" >&2
  exit 1
}

step unpack
tar -xzf "$SRC_TGZ" -C "$WORK" >>"$LOG" 2>&1 || fail "cannot unpack $SRC_TGZ"
SRC=$WORK/DeepEP
[ -f "$SRC/setup.py" ] || fail "$SRC_TGZ holds no DeepEP/setup.py"
commit=$(cat "$SRC/DEEPEP_COMMIT" 2>/dev/null || echo unknown)
echo "DeepEP commit $commit" | tee -a "$LOG"
[ -f "$SRC/deep_ep/buffer.py" ] && [ -f "$SRC/csrc/deep_ep.cpp" ] && grep -q DISABLE_NVSHMEM "$SRC/setup.py" ||
  fail "this DeepEP has no v1 intranode-only build (deep_ep/buffer.py, csrc/deep_ep.cpp, DISABLE_NVSHMEM in" \
    "setup.py);" \
    "DeepEP 2.x always links NVSHMEM: take the tarball of bench/deepep_peer_src.sh without REF"

step toolchain
[ -x "$PYTHON" ] || fail "no python at $PYTHON"
torch_version=$("$PYTHON" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)' 2>>"$LOG") ||
  fail "$PYTHON cannot import torch"
nvcc_version=$(nvcc --version 2>>"$LOG" | grep -o 'release [0-9.]*, V[0-9.]*' | head -1) ||
  fail "no nvcc on PATH (CUDA_HOME=${CUDA_HOME:-unset})"
[ -n "$nvcc_version" ] || fail "nvcc --version printed no release"
command -v ninja >/dev/null || fail "no ninja on PATH (torch's extension build needs it)"
py_include=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
[ -f "$py_include/Python.h" ] || fail "no Python.h in $py_include: a CPython extension cannot be built here"
"$PYTHON" -c 'import setuptools' 2>>"$LOG" || fail "$PYTHON has no setuptools"
gcc_version=$(gcc -dumpfullversion 2>/dev/null || echo unknown)
python_version=$("$PYTHON" -c 'import platform; print(platform.python_version())')
echo "torch $torch_version; nvcc $nvcc_version; gcc $gcc_version; python $python_version; arch $TORCH_CUDA_ARCH_LIST;" \
  "MAX_JOBS $MAX_JOBS" | tee -a "$LOG"

step compile
# The driver: hides nvidia.nvshmem from setup.py, adds the device link, refuses a build with NVSHMEM, runs setup.py.
cat >"$WORK/drive_setup.py" <<'PY'
"""Runs DeepEP's setup.py (arguments: setup.py's own) with nvidia.nvshmem hidden, the device link added, and a build
that would take NVSHMEM anyway refused."""
import importlib.abc
import os
import runpy
import sys

import torch.utils.cpp_extension as ext  # torch first: hiding the module must not change how torch itself loads


class HideNvshmem(importlib.abc.MetaPathFinder):
    """Answers 'not installed' for nvidia.nvshmem, so DeepEP's setup.py takes its build without NVSHMEM."""

    def find_spec(self, name, path=None, target=None):
        if name == "nvidia.nvshmem" or name.startswith("nvidia.nvshmem."):
            raise ModuleNotFoundError("%s hidden for an intranode-only build" % name, name=name)
        return None


for loaded in [m for m in sys.modules if m == "nvidia.nvshmem" or m.startswith("nvidia.nvshmem.")]:
    del sys.modules[loaded]
sys.meta_path.insert(0, HideNvshmem())
cuda_extension = ext.CUDAExtension


def intranode_extension(name, sources, *args, **kwargs):
    flags = kwargs.setdefault("extra_compile_args", {})
    if "-DDISABLE_NVSHMEM" not in flags.get("cxx", []):
        sys.exit("drive_setup.py: DeepEP's setup.py found NVSHMEM (no -DDISABLE_NVSHMEM in %s); refusing" % flags)
    if any("internode" in s or "nvshmem" in s for s in sources):
        sys.exit("drive_setup.py: internode (NVSHMEM) sources in the build: %s" % sources)
    if "-rdc=true" in flags.get("nvcc", []) and "nvcc_dlink" not in flags:
        flags["nvcc_dlink"] = ["-dlink"]  # relocatable device code needs its device link
        devrt = os.path.join(ext.CUDA_HOME or "/usr/local/cuda", "lib64")
        if os.path.exists(os.path.join(devrt, "libcudadevrt.a")):
            kwargs["extra_link_args"] = list(kwargs.get("extra_link_args", [])) + ["-L" + devrt, "-lcudadevrt"]
    print("drive_setup.py: %s from %s, flags %s, link %s" % (name, sources, flags, kwargs.get("extra_link_args")),
          flush=True)
    return cuda_extension(name, sources, *args, **kwargs)


ext.CUDAExtension = intranode_extension
sys.argv = ["setup.py"] + sys.argv[1:]
sys.path.insert(0, os.getcwd())
runpy.run_path("setup.py", run_name="__main__")
PY
t0=$(date +%s)
(cd "$SRC" && timeout -k 5 "${DEEPEP_BUILD_TIMEOUT:-480}" "$PYTHON" "$WORK/drive_setup.py" build) >>"$LOG" 2>&1 ||
  fail "setup.py build failed or ran out of time (rc $?)"
build_s=$(($(date +%s) - t0))
echo "built in $build_s s" | tee -a "$LOG"

step collect
STAGE=$WORK/stage
mkdir -p "$STAGE"
lib=$(ls -d "$SRC"/build/lib.*/ 2>/dev/null | head -1)
[ -n "$lib" ] || fail "no build/lib.* folder after the build"
so=$(ls "$lib"/deep_ep_cpp*.so 2>/dev/null | head -1)
[ -n "$so" ] || fail "no deep_ep_cpp*.so in $lib"
[ -f "$lib/deep_ep/__init__.py" ] || fail "no deep_ep package in $lib"
cp -r "$lib/deep_ep" "$STAGE/" && cp "$so" "$STAGE/" || fail "copying the build"
find "$STAGE" -name __pycache__ -prune -exec rm -rf {} + 2>/dev/null
so=$STAGE/$(basename "$so")
so_bytes_before=$(stat -c %s "$so")
strip --strip-debug "$so" || fail "strip --strip-debug $so"
so_bytes=$(stat -c %s "$so")

step check-linkage
needed=$(readelf -d "$so" | grep NEEDED | sed 's/.*\[\(.*\)\]/\1/' | tr '\n' ' ')
echo "NEEDED: $needed" | tee -a "$LOG"
grep -qi nvshmem <<<"$needed" && fail "the extension links NVSHMEM: $needed"
nm -D --undefined-only "$so" | grep -i nvshmem && fail "the extension wants NVSHMEM symbols"
nm -D --undefined-only "$so" | grep -q __cudaRegisterLinkedBinary &&
  fail "the extension has unresolved __cudaRegisterLinkedBinary symbols (no device link)"

step import
# deep_ep_cpp needs torch's libraries, which importing torch (deep_ep/__init__.py does it first) loads
PYTHONPATH=$STAGE "$PYTHON" - >>"$LOG" 2>&1 <<'PY' || fail "import deep_ep from the build failed"
import deep_ep
import torch

assert deep_ep.Buffer.is_sm90_compiled(), "built without SM90 features"
cfg = deep_ep.Buffer.get_dispatch_config(4)
print("deep_ep imports from", deep_ep.__file__, "; topk_idx_t", deep_ep.topk_idx_t, "; nvl bytes at EP4",
      cfg.get_nvl_buffer_size_hint(7168 * 2, 4), "; GPUs", torch.cuda.device_count())
PY
tail -1 "$LOG"

step pack
cat >"$STAGE/deepep_build_info.txt" <<EOF
deepep_commit: $commit
torch: $torch_version
nvcc: $nvcc_version
gcc: $gcc_version
python: $python_version
torch_cuda_arch_list: $TORCH_CUDA_ARCH_LIST
nvshmem: none (-DDISABLE_NVSHMEM; intranode kernels only)
build_seconds: $build_s
EOF
tar --sort=name --owner=0 --group=0 --numeric-owner -C "$STAGE" -cf - . | gzip -n -6 >"$OUT/deepep-build.tgz" ||
  fail "writing $OUT/deepep-build.tgz"
tgz_bytes=$(stat -c %s "$OUT/deepep-build.tgz")
[ "$tgz_bytes" -lt $((16 * 1024 * 1024)) ] ||
  fail "deepep-build.tgz is $tgz_bytes bytes: over the 16 MiB that one file from the device machine may take back"
{
  cat "$STAGE/deepep_build_info.txt"
  cat <<EOF
max_jobs: $MAX_JOBS
device_link: added (nvcc -dlink)
extension: $(basename "$so"), $so_bytes bytes stripped ($so_bytes_before before strip --strip-debug)
needed: $needed
tgz_bytes: $tgz_bytes
tgz_sha256: $(sha256sum "$OUT/deepep-build.tgz" | cut -d' ' -f1)
date: $(date -u +%Y-%m-%dT%H:%M:%SZ)
machine: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
EOF
} >"$OUT/deepep-build.txt"
cat "$OUT/deepep-build.txt"
echo "deepep_peer_build.sh: OK, $OUT/deepep-build.tgz"
