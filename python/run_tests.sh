#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# Runs the Python package's tests (python/tests, unittest) against the libmoert.so and plugins of a meson build dir.
#
#   python/run_tests.sh BUILD_DIR [unittest args, e.g. test_moe or -k Dispatcher]
#
# PYTHON picks the interpreter (default: /usr/bin/python3 when present, else python3); it needs torch (Debian:
# apt-get install python3-torch) and nothing else. Without torch the script exits 77 (skipped, for meson test),
# or 1 when MOERT_REQUIRE_TORCH=1 (CI). Nothing is installed; the package is imported from python/.
set -eu
if [ $# -lt 1 ]; then
    echo "usage: $0 BUILD_DIR [unittest args]" >&2
    exit 2
fi
build=$(cd "$1" && pwd)
shift
here=$(cd "$(dirname "$0")" && pwd)
if [ ! -f "$build/core/libmoert.so" ]; then
    echo "run_tests.sh: no $build/core/libmoert.so (build it: meson compile -C $build)" >&2
    exit 1
fi
if [ -z "${PYTHON:-}" ]; then
    if [ -x /usr/bin/python3 ]; then PYTHON=/usr/bin/python3; else PYTHON=python3; fi
fi
if ! "$PYTHON" -c 'import torch, torch.distributed' 2>/dev/null; then
    echo "run_tests.sh: $PYTHON cannot import torch (Debian: apt-get install python3-torch)" >&2
    [ "${MOERT_REQUIRE_TORCH:-0}" = 1 ] && exit 1
    exit 77
fi
export MOERT_TEST_BUILD_DIR="$build"
# the CPU threads of the processes the tests start share the machine's cores
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
cd "$here/tests"
"$PYTHON" -c 'import sys, torch; print("python %s, torch %s, libmoert from %s" % (sys.version.split()[0], torch.__version__, sys.argv[1]))' "$build"
if [ $# -gt 0 ]; then
    exec "$PYTHON" -m unittest -v "$@"
fi
exec "$PYTHON" -m unittest discover -v -s . -p 'test_*.py'
