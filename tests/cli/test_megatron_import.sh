#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# `moert config --from-megatron`: each preset's Megatron flags (tests/fixtures/megatron/*.args) give the shipped preset
# (deepseek-v3.args, with the shared expert: configs/deepseek-v3-shared.json; deepseek-v3-routed.args: deepseek-v3.json)
# (model, router, dispatcher, precision, memory policy, EP size); flags moert cannot map are refused by name; FP8,
# flex dispatchers and recompute map onto their moert keys, and --overlap-moe-expert-parallel-comm onto the micro-batch
# overlap with every dispatcher, the flex ones included.
# Usage: test_megatron_import.sh PATH/TO/moert
set -u
moert="$1"
src="${MOERT_TEST_SOURCE_ROOT:-$(cd "$(dirname "$0")/../.." && pwd)}"
fx="$src/tests/fixtures/megatron"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
. "$(dirname "$0")/cli_lib.sh"

# same_layer GOT.json PRESET.json: the sections that describe the layer are equal
same_layer() {
    python3 - "$1" "$2" <<'PY'
import json, sys
got, want = (json.load(open(p)) for p in sys.argv[1:3])
bad = [k for k in ("model", "router", "dispatcher", "precision", "memory_policy") if got.get(k) != want.get(k)]
if got["parallel"]["ranks"] != want["parallel"]["ranks"]: bad.append("parallel.ranks")
for k in bad: print("  %s: got %s, preset %s" % (k, got.get(k), want.get(k)))
sys.exit(1 if bad else 0)
PY
}

for preset in qwen3-30b-a3b qwen3-235b-a22b mixtral-8x7b deepseek-v3-routed deepseek-v3; do
    cfg="$src/configs/${preset%-routed}.json"
    [ "$preset" = deepseek-v3 ] && cfg="$src/configs/deepseek-v3-shared.json"
    if "$moert" config --from-megatron --args-file "$fx/$preset.args" >"$tmp/$preset.json" 2>"$tmp/$preset.err"; then
        same_layer "$tmp/$preset.json" "$cfg" || fail "$preset: the imported config differs from $cfg"
    else
        fail "$preset: import failed: $(cat "$tmp/$preset.err")"
    fi
done

# expect_refused NAME MESSAGE FLAGS...: the import fails and says MESSAGE
expect_refused() {
    local name="$1" message="$2"
    shift 2
    if "$moert" config --from-megatron "$@" >/dev/null 2>"$tmp/$name.err"; then fail "$name: accepted"; return; fi
    grep -qF -- "$message" "$tmp/$name.err" || fail "$name: message lacks \"$message\": $(cat "$tmp/$name.err")"
}
"$moert" config --from-megatron --args-file "$fx/deepseek-v3.args" --moe-shared-expert-overlap >"$tmp/overlap.json" ||
    fail "--moe-shared-expert-overlap refused"
grep -q '"shared_expert_overlap": true' "$tmp/overlap.json" || fail "--moe-shared-expert-overlap not mapped"
"$moert" config --from-megatron --args-file "$fx/deepseek-v3.args" --overlap-moe-expert-parallel-comm \
    --delay-wgrad-compute >"$tmp/ep-overlap.json" || fail "--overlap-moe-expert-parallel-comm refused"
grep -q '"overlap_micro_batches": "on"' "$tmp/ep-overlap.json" || fail "--overlap-moe-expert-parallel-comm not mapped"
grep -q '"overlap_wgrad": true' "$tmp/ep-overlap.json" || fail "--delay-wgrad-compute not mapped"
base=(--num-experts 8 --hidden-size 64 --moe-ffn-hidden-size 32 --moe-token-dispatcher-type alltoall)
expect_refused unknown_moe "--moe-foo: an MoE flag moert does not know how to map" "${base[@]}" --moe-foo 1
expect_refused unknown "--bar: not a flag moert knows" "${base[@]}" --bar
expect_refused pad "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor" "${base[@]}" \
    --moe-pad-expert-input-to-capacity
expect_refused pad_deepep "moert's deepep dispatcher does not pad" "${base[@]}" --moe-expert-capacity-factor 1.5 \
    --moe-pad-expert-input-to-capacity --moe-enable-deepep
expect_refused router_dtype "--moe-router-dtype: \"bf16\" is not one of Megatron's values" "${base[@]}" \
    --moe-router-dtype bf16
# the micro-batch overlap runs with every dispatcher, the flex ones (deepep, hybridep) included
for backend in deepep hybridep; do
    "$moert" config --from-megatron --num-experts 8 --hidden-size 64 --moe-ffn-hidden-size 32 \
        --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend "$backend" --overlap-moe-expert-parallel-comm \
        >"$tmp/overlap-$backend.json" 2>&1 ||
        fail "--overlap-moe-expert-parallel-comm with $backend refused: $(cat "$tmp/overlap-$backend.json")"
    python3 - "$tmp/overlap-$backend.json" "$backend" <<'PY' || fail "--overlap-moe-expert-parallel-comm with $backend"
import json, sys
c = json.load(open(sys.argv[1]))
assert c["dispatcher"] == {"plugin": sys.argv[2]}, c["dispatcher"]
assert c["parallel"]["overlap_micro_batches"] == "on", c["parallel"]
PY
done
# the flex backends' SM counts: the flag of the backend that runs becomes its num_sms, the other's is ignored (as
# Megatron does)
"$moert" config --from-megatron --num-experts 8 --hidden-size 64 --moe-ffn-hidden-size 32 \
    --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend deepep --moe-deepep-num-sms 20 \
    --moe-hybridep-num-sms 32 >"$tmp/sms-deepep.json" 2>&1 || fail "deepep num_sms import: $(cat "$tmp/sms-deepep.json")"
"$moert" config --from-megatron --num-experts 8 --hidden-size 64 --moe-ffn-hidden-size 32 \
    --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep --moe-deepep-num-sms 20 \
    --moe-hybridep-num-sms 32 >"$tmp/sms-hybridep.json" 2>&1 || fail "hybridep num_sms import: $(cat "$tmp/sms-hybridep.json")"
"$moert" config --from-megatron --num-experts 8 --hidden-size 64 --moe-ffn-hidden-size 32 \
    --moe-token-dispatcher-type alltoall --moe-deepep-num-sms 20 >"$tmp/sms-alltoall.json" 2>&1 ||
    fail "alltoall with --moe-deepep-num-sms: $(cat "$tmp/sms-alltoall.json")"
python3 - "$tmp/sms-deepep.json" "$tmp/sms-hybridep.json" "$tmp/sms-alltoall.json" <<'PY' || fail "num_sms mapping"
import json, sys
d, h, a = (json.load(open(p)) for p in sys.argv[1:4])
assert d["dispatcher"] == {"plugin": "deepep", "num_sms": 20}, d["dispatcher"]
assert h["dispatcher"] == {"plugin": "hybridep", "num_sms": 32}, h["dispatcher"]
assert a["dispatcher"] == {"plugin": "alltoall"}, a["dispatcher"]
# the GEMMs leave the running backend's SMs to its calls under the overlap; alltoall keeps the default
assert d["parallel"]["overlap_comm_sms"] == 20 and h["parallel"]["overlap_comm_sms"] == 32, (d["parallel"], h["parallel"])
assert "overlap_comm_sms" not in a.get("parallel", {}), a.get("parallel")
PY
"$moert" config --from-megatron --num-experts 8 --hidden-size 64 --moe-ffn-hidden-size 32 \
    --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep >"$tmp/sms-hybridep-default.json" 2>&1 ||
    fail "hybridep import: $(cat "$tmp/sms-hybridep-default.json")"
python3 -c 'import json, sys; p = json.load(open(sys.argv[1]))["parallel"]; assert p["overlap_comm_sms"] == 16, p' \
    "$tmp/sms-hybridep-default.json" || fail "hybridep's default SMs not left to it under the overlap"
expect_refused deepep_sms_zero "--moe-deepep-num-sms: \"0\" is not an integer in range" "${base[@]}" \
    --moe-deepep-num-sms 0
# pipeline parallelism: the forwards a layer holds in flight (one per stage, twice that interleaved), bounded
"$moert" config --from-megatron "${base[@]}" --pipeline-model-parallel-size 4 >"$tmp/pp.json" 2>&1 ||
    fail "pipeline import: $(cat "$tmp/pp.json")"
"$moert" config --from-megatron "${base[@]}" --pipeline-model-parallel-size 4 \
    --num-layers-per-virtual-pipeline-stage 2 >"$tmp/vpp.json" 2>&1 || fail "interleaved import: $(cat "$tmp/vpp.json")"
python3 - "$tmp/pp.json" "$tmp/vpp.json" <<'PY' || fail "pipeline mapping"
import json, sys
pp, vpp = (json.load(open(p))["parallel"]["forwards_in_flight"] for p in sys.argv[1:3])
assert (pp, vpp) == (4, 8), (pp, vpp)
PY
expect_refused pipeline_too_deep "holds 40 forwards of a layer in flight; moert's \$.parallel.forwards_in_flight allows up to 32" \
    "${base[@]}" --pipeline-model-parallel-size 20 --virtual-pipeline-model-parallel-size 2
# the router's Megatron options: jitter, fp64 compute, forced balancing, capacity with padding
"$moert" config --from-megatron "${base[@]}" --moe-input-jitter-eps 0.01 --moe-router-dtype fp64 \
    --moe-router-force-load-balancing --moe-expert-capacity-factor 1.5 --moe-token-drop-policy position \
    --moe-pad-expert-input-to-capacity >"$tmp/router.json" 2>&1 || fail "router options import: $(cat "$tmp/router.json")"
python3 - "$tmp/router.json" <<'PY' || fail "router options mapping"
import json, sys
c = json.load(open(sys.argv[1]))
r, d = c["router"], c["dispatcher"]
assert r["input_jitter_eps"] == 0.01 and r["compute_dtype"] == "fp64" and r["force_load_balancing"] is True, r
assert r["capacity_factor"] == 1.5 and r["drop_policy"] == "position" and r["pad_to_capacity"] is True, r
assert d == {"plugin": "alltoall", "pad_to_capacity": True, "capacity_factor": 1.5}, d
PY
"$moert" check "$tmp/router.json" >"$tmp/router.check" 2>&1 || fail "imported router options refused: $(cat "$tmp/router.check")"
# expert tensor parallelism: EP x ETP ranks (parallel folding)
"$moert" config --from-megatron "${base[@]}" --expert-model-parallel-size 2 --expert-tensor-parallel-size 2 \
    >"$tmp/etp.json" 2>&1 || fail "ETP import: $(cat "$tmp/etp.json")"
python3 - "$tmp/etp.json" <<'PY' || fail "ETP mapping"
import json, sys
p = json.load(open(sys.argv[1]))["parallel"]
assert p["ranks"] == 4 and p["expert_parallel"] == 2 and p["expert_tensor_parallel"] == 2, p
PY
"$moert" check "$tmp/etp.json" >"$tmp/etp.check" 2>&1 || fail "imported ETP layout refused: $(cat "$tmp/etp.check")"
# Megatron's default dispatcher, allgather, when the flag is left out
"$moert" config --from-megatron --num-experts 8 --hidden-size 64 --moe-ffn-hidden-size 32 >"$tmp/allgather.json" 2>&1 ||
    fail "default dispatcher import: $(cat "$tmp/allgather.json")"
grep -q '"plugin": "allgather"' "$tmp/allgather.json" || fail "Megatron's default dispatcher not mapped to allgather"
expect_refused missing "--hidden-size is required" --num-experts 8 --moe-ffn-hidden-size 32
expect_refused badint "--num-experts: \"eight\" is not a positive integer" --num-experts eight
expect_refused badenum "--moe-router-score-function: \"relu\" is not one of Megatron's values" "${base[@]}" \
    --moe-router-score-function relu
expect_refused novalue "--moe-router-topk needs a value" "${base[@]}" --moe-router-topk
# a flag that takes a value never swallows the next flag as it (the flag would be dropped); a negative number is a value
expect_refused value_is_flag "--lr needs a value" "${base[@]}" --lr --bf16
expect_refused value_is_switch "--recompute-granularity needs a value" "${base[@]}" --recompute-granularity \
    --moe-layer-recompute
"$moert" config --from-megatron "${base[@]}" --lr -1 --bf16 >"$tmp/negative.json" 2>&1 ||
    fail "a negative value refused: $(cat "$tmp/negative.json")"
grep -q '"dtype": "bf16"' "$tmp/negative.json" || fail "--bf16 after a negative value not mapped"
# a switch takes no value, as with Megatron's argparse: --bf16=false is refused, not read as --bf16
expect_refused switch_value "--bf16 is a switch and takes no value (got \"false\")" "${base[@]}" --bf16=false
# inf and nan are refused by name (JSON has no such numbers: the key would be dropped)
expect_refused aux_coeff_inf "--moe-aux-loss-coeff: expected a finite number, got inf" "${base[@]}" \
    --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff inf
expect_refused capacity_inf "--moe-expert-capacity-factor: expected a finite number, got inf" "${base[@]}" \
    --moe-expert-capacity-factor inf
# products of flag values that overflow are refused, naming the flags
expect_refused etp_overflow "the product of --expert-model-parallel-size and --expert-tensor-parallel-size is too large" \
    "${base[@]}" --expert-model-parallel-size 9223372036854775807 --expert-tensor-parallel-size 2
expect_refused tokens_overflow "the product of --seq-length and --micro-batch-size is too large" "${base[@]}" \
    --seq-length 4294967296 --micro-batch-size 4294967296
expect_refused pipeline_overflow "the product of --pipeline-model-parallel-size and 2 (the interleaved schedule) is too large" \
    "${base[@]}" --pipeline-model-parallel-size 4611686018427387904 --virtual-pipeline-model-parallel-size 2
# tokens per rank need both flags (Megatron has no default micro-batch size): one alone is refused, not dropped
expect_refused seq_without_micro_batch "--seq-length needs --micro-batch-size" "${base[@]}" --seq-length 4096
expect_refused micro_batch_without_seq "--micro-batch-size needs --seq-length" "${base[@]}" --micro-batch-size 2

# mappings that need more than one key
"$moert" config --from-megatron "${base[@]}" --fp8-format e4m3 --fp8-recipe blockwise --recompute-granularity selective \
    --recompute-modules moe_act core_attn >"$tmp/fp8.json" 2>&1 || fail "fp8 import: $(cat "$tmp/fp8.json")"
python3 - "$tmp/fp8.json" <<'PY' || fail "fp8 / recompute mapping"
import json, sys
c = json.load(open(sys.argv[1]))
assert c["precision"] == {"plugin": "fp8", "recipe": "blockwise", "format": "e4m3"}, c["precision"]
assert c["memory_policy"] == {"plugin": "default", "swiglu_out": "recompute"}, c["memory_policy"]
assert c["model"]["dtype"] == "bf16" and c["model"]["topk"] == 2, c["model"]
assert "load_balancing" not in c["router"], c["router"]  # Megatron's default: aux_loss with coefficient 0
PY
"$moert" config --from-megatron --num-experts 8 --hidden-size 64 --moe-ffn-hidden-size=32 \
    --moe-token-dispatcher-type=flex --moe-flex-dispatcher-backend=hybridep --moe-layer-recompute >"$tmp/flex.json" 2>&1 ||
    fail "flex import: $(cat "$tmp/flex.json")"
python3 - "$tmp/flex.json" <<'PY' || fail "flex / moe recompute mapping"
import json, sys
c = json.load(open(sys.argv[1]))
assert c["dispatcher"] == {"plugin": "hybridep"}, c["dispatcher"]
assert c["memory_policy"] == {"plugin": "default", "swiglu_out": "recompute", "dispatched_x": "recompute",
                              "fc1_out": "recompute"}, c["memory_policy"]
PY

if [ "$failures" -ne 0 ]; then echo "test_megatron_import: $failures check(s) failed"; exit 1; fi
echo "test_megatron_import: all checks passed"
