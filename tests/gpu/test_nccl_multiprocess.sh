#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Multi-process NCCL test: launches ranks of nccl_mp_driver the way torchrun does (RANK, WORLD_SIZE, LOCAL_RANK,
# MASTER_ADDR, MASTER_PORT), checks the environment errors, the bootstrap timeouts (a missing rank 0, a missing
# rank 1), then two real ranks exchanging CUDA IPC peer buffers and doing an alltoallv. Exits 77 without 2 GPUs.
# Usage: test_nccl_multiprocess.sh PATH/TO/nccl_mp_driver
set -u
driver="$1"
failures=0
workdir="$(mktemp -d)"
trap 'rm -rf "$workdir"' EXIT

fail() { echo "FAIL: $*" >&2; failures=$((failures + 1)); }

# expect_error NAME WANTED_TEXT -- command...: the command must exit non-zero and print WANTED_TEXT on stderr.
expect_error() {
    local name="$1" wanted="$2"
    shift 3
    if "$@" >"$workdir/out" 2>"$workdir/err"; then
        fail "$name: exited 0"
    elif ! grep -qF -- "$wanted" "$workdir/err"; then
        fail "$name: stderr lacks '$wanted': $(cat "$workdir/err")"
    fi
}

# Environment errors name the variable (no GPU needed for these).
expect_error "no RANK" "environment variable RANK is not set" -- \
    env -u RANK WORLD_SIZE=2 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 "$driver"
expect_error "bad WORLD_SIZE" "environment variable WORLD_SIZE='two' is not an integer" -- \
    env RANK=0 WORLD_SIZE=two LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 "$driver"
expect_error "RANK too big" "environment variable RANK=2 is out of range for WORLD_SIZE=2" -- \
    env RANK=2 WORLD_SIZE=2 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 "$driver"
expect_error "no MASTER_ADDR" "environment variable MASTER_ADDR is not set" -- \
    env -u MASTER_ADDR RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 MASTER_PORT=29500 "$driver"
expect_error "bad MASTER_PORT" "environment variable MASTER_PORT=70000 is out of range [1, 65535]" -- \
    env RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=70000 "$driver"

gpus="$("$driver" --count)" || { echo "FAIL: $driver --count"; exit 1; }
if [ "${gpus:-0}" -lt 2 ]; then
    echo "nccl_multiprocess: environment checks done ($failures failure(s)); $gpus GPU(s), need 2: skipped"
    [ "$failures" -eq 0 ] && exit 77 || exit 1
fi

common=(WORLD_SIZE=2 MASTER_ADDR=127.0.0.1)

# A rank 1 whose rank 0 never comes gives up in time, naming the address.
port="$("$driver" --free-port)"
start=$SECONDS
expect_error "no rank 0" "could not reach rank 0 at 127.0.0.1:$port in time" -- \
    env "${common[@]}" RANK=1 LOCAL_RANK=1 MASTER_PORT="$port" "$driver" --timeout 3
[ $((SECONDS - start)) -le 30 ] || fail "no rank 0: took $((SECONDS - start)) s with a 3 s timeout"

# A rank 0 whose rank 1 never comes gives up in time, naming the missing rank.
port="$("$driver" --free-port)"
start=$SECONDS
expect_error "no rank 1" "rank(s) 1 did not fetch the NCCL id from rank 0 (port $port) in time" -- \
    env "${common[@]}" RANK=0 LOCAL_RANK=0 MASTER_PORT="$port" "$driver" --timeout 3
[ $((SECONDS - start)) -le 30 ] || fail "no rank 1: took $((SECONDS - start)) s with a 3 s timeout"

# Two real ranks; MOERT_BOOTSTRAP_PORT moves the id server off MASTER_PORT (as under torchrun).
port="$("$driver" --free-port)"
pids=()
for rank in 0 1; do
    env "${common[@]}" RANK=$rank LOCAL_RANK=$rank MASTER_PORT=1 MOERT_BOOTSTRAP_PORT="$port" \
        "$driver" --timeout 60 >"$workdir/rank$rank.out" 2>&1 &
    pids+=($!)
done
for rank in 0 1; do
    if ! wait "${pids[$rank]}"; then
        fail "rank $rank: $(cat "$workdir/rank$rank.out")"
    else
        cat "$workdir/rank$rank.out"
    fi
done

if [ "$failures" -ne 0 ]; then
    echo "nccl_multiprocess: $failures failure(s)"
    exit 1
fi
echo "nccl_multiprocess: all checks passed"
