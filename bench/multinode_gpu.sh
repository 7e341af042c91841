#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Two virtual nodes on one GPU host (docs/multinode.md): the "alltoall" and "hierarchical" dispatchers at EP = every
# GPU of the machine (an even number, at least 2), the GPUs split into 2 nodes of EP/2, against the CPU reference.
#
# For each dispatcher:
#   1. correctness: configs/demo-cpu.json for 5 steps on the CPU (ranks as threads: the reference) and on the GPUs
#      (a thread per GPU, one process); the losses must agree within 2e-3 relative (fp32), as tests/gpu/run.sh checks;
#   2. timing, one process per GPU, each process told its virtual node through NCCL_HOSTID (the launcher's
#      environment, per process: NCCL then takes ranks of the other "node" for another host and carries their
#      traffic over its network transport (sockets on the loopback interface by default), and the ranks of one node
#      over NVLink). One Qwen3-30B-A3B layer (bf16, 128 experts, top-8, 8192 tokens per rank), 12 steps; the report's
#      median step and stage times. The NCCL log of rank 0 (NCCL_DEBUG=INFO, INIT and NET) is kept, and the transport
#      lines it shows are printed: they say whether the peers of the other node really went over NET.
# The hierarchical dispatcher gets "ranks_per_node": EP/2 in both; alltoall ignores the nodes (its traffic between the
# virtual nodes is every copy's row).
#
#   usage: bench/multinode_gpu.sh BUILD_DIR OUT_DIR
#   environment: MULTINODE_NET=socket (default: NCCL_IB_DISABLE=1, NCCL_SOCKET_IFNAME=lo) or ib (leave IB on);
#                MULTINODE_STEPS (12), MULTINODE_TOKENS (8192), MULTINODE_PORT (29631: the NCCL id's TCP port)
# Writes OUT_DIR/<dispatcher>-{cpu,cuda,proc}.{json,log}, OUT_DIR/multinode.json (the figures) and prints a table last.
# Exit status: 0 when every run passed, 1 otherwise, 77 without an even number of at least 2 GPUs.
set -u
if [ $# -ne 2 ]; then
    echo "usage: $0 BUILD_DIR OUT_DIR" >&2
    exit 2
fi
BUILD=$(realpath "$1")
OUT=$2
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
cd "$(dirname "$0")/.." || exit 1
export NCCL_NVLS_ENABLE=0 # NVLink multicast off (docs/gpu.md)
MOERT="$BUILD/tools/moert"
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [ "${gpus:-0}" -lt 2 ] || [ $((gpus % 2)) -ne 0 ]; then
    echo "multinode_gpu: $gpus GPU(s); two virtual nodes need an even number, at least 2"
    exit 77
fi
EP=$gpus
R=$((EP / 2))
STEPS=${MULTINODE_STEPS:-12}
TOKENS=${MULTINODE_TOKENS:-8192}
PORT=${MULTINODE_PORT:-29631}
echo "multinode_gpu: $EP GPUs as 2 virtual nodes of $R, build $BUILD, git $(git rev-parse --short HEAD 2>/dev/null)"
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1

status=0
rows=()
record() { rows+=("$(printf '%-13s %-34s %-5s %s' "$1" "$2" "$3" "$4")"); }

# The dispatcher's --set arguments.
dispatcher_args() {
    if [ "$1" = hierarchical ]; then
        echo "--set dispatcher.plugin=\"hierarchical\" --set dispatcher.ranks_per_node=$R"
    else
        echo "--set dispatcher.plugin=\"alltoall\""
    fi
}

# Worst relative loss difference of report $1 against report $2, or "missing".
loss_diff() {
    python3 - "$1" "$2" <<'PY'
import json, os, sys
got, ref = sys.argv[1], sys.argv[2]
if not (os.path.exists(got) and os.path.exists(ref)):
    print("missing"); sys.exit()
a = [s["loss"] for s in json.load(open(got))["steps"]]
b = [s["loss"] for s in json.load(open(ref))["steps"]]
print("%.3e" % max(abs(x - y) / abs(y) for x, y in zip(a, b)) if len(a) == len(b) and b else "mismatch")
PY
}

# One process per GPU, rank r in virtual node r / R (NCCL_HOSTID), moert's own launch variables.
run_processes() { # name dispatcher
    local name=$1 disp=$2 pids=() r
    local net_env=(NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo)
    [ "${MULTINODE_NET:-socket}" = ib ] && net_env=()
    for ((r = 0; r < EP; r++)); do
        local debug=()
        [ $r -eq 0 ] && debug=(NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET NCCL_DEBUG_FILE="$OUT/$name-nccl.log")
        # shellcheck disable=SC2046
        env RANK=$r WORLD_SIZE=$EP LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 MASTER_PORT=$PORT \
            NCCL_HOSTID="moert-vnode-$((r / R))" "${net_env[@]}" "${debug[@]}" \
            timeout 300 "$MOERT" run configs/qwen3-30b-a3b.json --quiet --steps "$STEPS" \
            --set parallel.device=cuda --set parallel.ranks=$EP --set model.num_experts=$((EP * 32)) \
            --set train.tokens_per_rank="$TOKENS" $(dispatcher_args "$disp") \
            --report "$OUT/$name.json" >"$OUT/$name-rank$r.log" 2>&1 &
        pids+=($!)
    done
    local rc=0 p
    for p in "${pids[@]}"; do wait "$p" || rc=1; done
    PORT=$((PORT + 1))
    return $rc
}

for disp in alltoall hierarchical; do
    # 1. the layer stack on the CPU (the reference) and on the GPUs (threads), same config and batch
    # shellcheck disable=SC2046
    timeout 300 "$MOERT" run configs/demo-cpu.json --quiet --steps 5 --set parallel.device=cpu \
        --set parallel.ranks=$EP --set train.tokens_per_rank=$((1024 / EP)) $(dispatcher_args "$disp") \
        --report "$OUT/$disp-cpu.json" >"$OUT/$disp-cpu.log" 2>&1
    # shellcheck disable=SC2046
    timeout 300 "$MOERT" run configs/demo-cpu.json --quiet --steps 5 --set parallel.device=cuda \
        --set parallel.ranks=$EP --set train.tokens_per_rank=$((1024 / EP)) $(dispatcher_args "$disp") \
        --report "$OUT/$disp-cuda.json" >"$OUT/$disp-cuda.log" 2>&1
    diff=$(loss_diff "$OUT/$disp-cuda.json" "$OUT/$disp-cpu.json")
    if python3 -c "import sys; sys.exit(0 if float('$diff') <= 2e-3 else 1)" 2>/dev/null; then
        record "$disp" "demo fp32, GPUs vs CPU reference" PASS "worst relative loss difference $diff over 5 steps"
    else
        record "$disp" "demo fp32, GPUs vs CPU reference" FAIL "$diff (logs $disp-cpu.log, $disp-cuda.log)"
        status=1
    fi

    # 2. timing: a process per GPU, two virtual nodes
    if run_processes "$disp-proc" "$disp"; then
        transports=$(grep -Eo 'via (NET/[A-Za-z0-9_]+|P2P/[A-Za-z0-9_/]+|SHM[A-Za-z0-9_/]*)' "$OUT/$disp-proc-nccl.log" \
                         2>/dev/null | sort | uniq -c | tr -s ' ' | paste -sd ',' -)
        record "$disp" "qwen3 layer, 2 virtual nodes" PASS "transports seen by rank 0: ${transports:-none logged}"
    else
        record "$disp" "qwen3 layer, 2 virtual nodes" FAIL "logs $disp-proc-rank*.log"
        tail -5 "$OUT/$disp-proc-rank0.log"
        status=1
    fi
done

# the figures: median step and stage times of the timed runs, with the command and the machine
python3 - "$OUT" "$EP" "$R" "$STEPS" "$TOKENS" "${MULTINODE_NET:-socket}" <<'PY'
import datetime, json, os, subprocess, sys
out, ep, r, steps, tokens, net = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6]
git = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                     text=True).stdout.splitlines()
results, table = [], []
for disp in ("alltoall", "hierarchical"):
    path = os.path.join(out, "%s-proc.json" % disp)
    if not os.path.exists(path):
        continue
    med = json.load(open(path)).get("median_ms", {})
    for stage, ms in sorted(med.items()):
        results.append({"name": "%s %s" % (disp, stage), "value": ms, "unit": "ms",
                        "config": {"dispatcher": disp, "ep": ep, "nodes": 2, "ranks_per_node": r,
                                   "tokens_per_rank": int(tokens), "net": net}})
    table.append((disp, med.get("step"), {k: v for k, v in med.items() if "dispatch" in k or "combine" in k}))
doc = {"command": "bench/multinode_gpu.sh BUILD OUT", "machine": "%d x %s" % (ep, gpu[0] if gpu else "?"),
       "gpus": ep, "git": git, "date": datetime.date.today().isoformat(), "steps": int(steps), "results": results}
json.dump(doc, open(os.path.join(out, "multinode.json"), "w"), indent=1)
print("\nmedian ms per step, one process per GPU, 2 virtual nodes of %d (network transport: %s)" % (r, net))
for disp, step, stages in table:
    parts = ", ".join("%s %.2f" % (k, v) for k, v in sorted(stages.items()))
    print("  %-13s step %s  %s" % (disp, "%.2f" % step if step is not None else "-", parts))
PY

echo
echo "== multinode_gpu: $EP GPUs, 2 virtual nodes =="
printf '%s\n' "${rows[@]}"
exit $status
