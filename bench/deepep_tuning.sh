#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Sweeps the launch shape of the "deepep" dispatcher's NVLink phase (threads per block, 16-byte units in flight per
# lane, the FP8 dispatch's, a store hint): each variant is the plugin built with -D flags, timed by dispatch_bench's
# NVLink-phase rows at 24 and 12 SMs (and checked there bit for bit against alltoall).
#   bench/deepep_tuning.sh build GPU_BUILD_DIR VARIANTS_DIR      on the build machine (nvcc; no GPU needed): one
#                                                               VARIANTS_DIR/<name>/libmoert-dispatch-deepep.so each
#   bench/deepep_tuning.sh run GPU_BUILD_DIR VARIANTS_DIR OUT    on a 4-GPU machine: dispatch_bench per variant
#                                                               (MOERT_PLUGIN_PATH=VARIANTS_DIR/<name>), a table
#   bench/deepep_tuning.sh repeat GPU_BUILD_DIR N OUT           the build's own plugin, N runs, median of the medians
# Variants: "name:-DFLAG=V -DFLAG2=V ...", see VARIANTS below; "base" is the source's defaults, "old" the
# defaults before the first sweep (bench/results/2026-11-22-deepep-tuning-sweep-nvidia-h200-x4.txt lists
# the variants it timed).
set -u
VARIANTS=(
  "base:"
  "old:-DSEND_THREADS=1024 -DSEND_UNROLL=4 -DFP8_SEND_THREADS=512 -DFP8_UNROLL=2"
  "noalloc:-DPEER_STORE_NO_ALLOCATE"
  "t768u8:-DSEND_THREADS=768"
  "t512u6:-DSEND_UNROLL=6"
)
mode=${1:-}
BUILD=$(realpath "${2:-build}")
VDIR=$(realpath -m "${3:-deepep-variants}")
target=plugins/dispatch_deepep/libmoert-dispatch-deepep.so

if [ "$mode" = build ]; then
  mkdir -p "$VDIR"
  ninja -C "$BUILD" "$target" >/dev/null || exit 1
  cmds=$(ninja -C "$BUILD" -t commands "$target")
  nvcc_cmd=$(grep '^nvcc .*deepep_cuda\.cu' <<<"$cmds")
  link_cmd=$(tail -1 <<<"$cmds")
  obj=plugins/dispatch_deepep/libdispatch_deepep_cuda.a.p/deepep_cuda.cu.o
  lib=plugins/dispatch_deepep/libdispatch_deepep_cuda.a
  for v in "${VARIANTS[@]}"; do
    name=${v%%:*} flags=${v#*:}
    mkdir -p "$VDIR/$name"
    echo "building $name ($flags)"
    (cd "$BUILD" &&
      eval "${nvcc_cmd/ -o $obj / $flags -o $VDIR/$name/deepep_cuda.cu.o }" &&
      rm -f "$VDIR/$name/deepep_cuda.a" && gcc-ar csrD "$VDIR/$name/deepep_cuda.a" "$VDIR/$name/deepep_cuda.cu.o" &&
      l=${link_cmd/-o $target /-o $VDIR/$name/libmoert-dispatch-deepep.so } && eval "${l/ $lib / $VDIR/$name/deepep_cuda.a }" &&
      strip --strip-debug "$VDIR/$name/libmoert-dispatch-deepep.so" &&
      rm -f "$VDIR/$name/deepep_cuda.cu.o" "$VDIR/$name/deepep_cuda.a") || exit 1
  done
  exit 0
fi

if [ "$mode" = run ]; then
  OUT=${4:-/tmp/deepep-tuning}
  mkdir -p "$OUT"
  export NCCL_NVLS_ENABLE=0 MOERT_BENCH_PHASES=nvlink MOERT_BENCH_SMS=${MOERT_BENCH_SMS:-24,12}
  export MOERT_BENCH_REPEATS=${MOERT_BENCH_REPEATS:-50}
  for v in "${VARIANTS[@]}"; do
    name=${v%%:*}
    [ -f "$VDIR/$name/libmoert-dispatch-deepep.so" ] || { echo "$name: not built"; continue; }
    MOERT_PLUGIN_PATH="$VDIR/$name" MOERT_BENCH_MACHINE=${MOERT_BENCH_MACHINE:-unknown} \
      timeout -k 3 60 "$BUILD/bench/dispatch_bench" "$OUT/tuning-$name.json" >"$OUT/tuning-$name.log" 2>&1
    echo "== $name (${v#*:}): rc $?"
    grep -E '^check:|nvlink' "$OUT/tuning-$name.log" | grep -v '^{' | sed 's/^/   /'
  done
  exit 0
fi
if [ "$mode" = repeat ]; then
  # bench/deepep_tuning.sh repeat GPU_BUILD_DIR N OUT: the build's own plugin, N runs of the NVLink-phase rows,
  # each row's median over the runs' medians (the figure to quote: one run's median moves by about +-5 us)
  N=${3:-5}
  OUT=${4:-/tmp/deepep-repeat}
  mkdir -p "$OUT"
  export NCCL_NVLS_ENABLE=0 MOERT_BENCH_PHASES=nvlink MOERT_BENCH_SMS=${MOERT_BENCH_SMS:-24,12}
  export MOERT_BENCH_REPEATS=${MOERT_BENCH_REPEATS:-50}
  for i in $(seq 1 "$N"); do
    MOERT_BENCH_MACHINE=${MOERT_BENCH_MACHINE:-unknown} timeout -k 3 60 "$BUILD/bench/dispatch_bench" \
      "$OUT/repeat-$i.json" >"$OUT/repeat-$i.log" 2>&1
    echo "run $i: rc $?"
  done
  python3 - "$OUT" "$N" <<'PY'
import json, statistics, sys
out, n = sys.argv[1], int(sys.argv[2])
rows = {}
for i in range(1, n + 1):
    try:
        r = json.load(open("%s/repeat-%d.json" % (out, i)))
    except (OSError, ValueError):
        continue
    for v in r.get("results", []):
        if v.get("unit") == "us":
            rows.setdefault(v["name"], []).append(v["value"])
print("%-40s %8s  %s" % ("variant", "median", "each run's median (us)"))
for name, vals in rows.items():
    print("%-40s %8.1f  %s" % (name, statistics.median(vals), " ".join("%.1f" % x for x in vals)))
PY
  exit 0
fi
echo "usage: $0 build|run GPU_BUILD_DIR VARIANTS_DIR [OUT]  |  $0 repeat GPU_BUILD_DIR N OUT" >&2
exit 2
