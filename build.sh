#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# One command from a fresh Debian/Ubuntu machine: installs what is missing, configures, builds, then
#   ./build.sh run    runs the main job (configs/demo-cpu.json: on the CPU, or on the GPUs where 4 answer)
#   ./build.sh test   runs the test suites (meson test)
#   ./build.sh install PREFIX   installs headers, libmoert, its plugins, moert.pc and the moert command under PREFIX
#   ./build.sh        only builds
set -euo pipefail
cd "$(dirname "$0")"
BUILD_DIR=${MOERT_BUILD_DIR:-build}

need=()
command -v meson >/dev/null || need+=(meson)
command -v ninja >/dev/null || need+=(ninja-build)
command -v pkg-config >/dev/null || need+=(pkg-config)
command -v cc >/dev/null || need+=(gcc libc6-dev)
pkg-config --exists jansson 2>/dev/null || need+=(libjansson-dev)
command -v valgrind >/dev/null || need+=(valgrind)
command -v make >/dev/null || need+=(make)
# the tests include the PyTorch package's (python/tests): Debian's torch for the system python3
if [ "${1:-build}" = test ]; then
  # the test suite's own needs: the PyTorch package's tests, the plots of moert ab and of a trace, the format check
  /usr/bin/python3 -c 'import torch' 2>/dev/null || need+=(python3-torch)
  /usr/bin/python3 -c 'import matplotlib' 2>/dev/null || need+=(python3-matplotlib)
  command -v clang-format >/dev/null || need+=(clang-format)
fi
if [ ${#need[@]} -gt 0 ]; then
  echo "build.sh: installing ${need[*]}"
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${need[@]}"
fi

if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  setup_args=()
  # Meson before 1.4 asks nvcc for no dependency files, so a changed header would rebuild no .cu: CUDA goes through
  # tools/nvcc-depfile, which writes them (docs/gpu.md)
  if command -v nvcc >/dev/null && [ "$(printf '%s\n' "$(meson --version)" 1.4 | sort -V | head -1)" != 1.4 ]; then
    mkdir -p "$BUILD_DIR"
    printf "[binaries]\ncuda = '%s/tools/nvcc-depfile'\n" "$PWD" > "$BUILD_DIR/nvcc-depfile.ini"
    setup_args+=(--native-file "$BUILD_DIR/nvcc-depfile.ini")
  fi
  meson setup "$BUILD_DIR" "${setup_args[@]}"
fi
# install: the prefix goes into the build (meson setup would keep an existing build's prefix without a word)
if [ "${1:-build}" = install ]; then
  [ $# -ge 2 ] || { echo "usage: ./build.sh install PREFIX" >&2; exit 2; }
  meson configure "$BUILD_DIR" --prefix="$(mkdir -p "$2" && cd "$2" && pwd)"
fi
meson compile -C "$BUILD_DIR"

case "${1:-build}" in
  run)
    shift
    # parallel.device "auto": the GPUs when this build has CUDA and enough of them answer, else the CPU
    exec "$BUILD_DIR/tools/moert" run configs/demo-cpu.json --report "$BUILD_DIR/report.json" "$@"
    ;;
  test)
    shift
    exec meson test -C "$BUILD_DIR" --print-errorlogs "$@"
    ;;
  install)
    exec meson install -C "$BUILD_DIR" --no-rebuild
    ;;
  build) ;;
  *) echo "usage: ./build.sh [run|test|install PREFIX|build]" >&2; exit 2 ;;
esac
