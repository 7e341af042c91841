#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The `moert` command: help, version, unknown commands, `plugins`, and `check` on good and broken configs.
# Usage: test_cli.sh PATH/TO/moert   (meson test runs it with MOERT_TEST_SOURCE_ROOT set)
set -u
moert="$(cd "$(dirname "$1")" && pwd)/$(basename "$1")" # absolute: some checks run from other folders
# the tests' fixture plugins: the build tree's moert does not search them by itself
export MOERT_PLUGIN_PATH="$(cd "$(dirname "$moert")/.." && pwd)/tests/fixtures"
src="${MOERT_TEST_SOURCE_ROOT:-$(cd "$(dirname "$0")/../.." && pwd)}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
. "$(dirname "$0")/cli_lib.sh"

# help, version, usage errors
run help 0 --help
expect_line help out "usage: moert COMMAND [ARGS]"
expect_match help out "^  check CONFIG"
run version 0 --version
expect_line version out "moert 0.1.0 (plugin ABI 1.2)"
run bogus 2 bogus
expect_line bogus err 'moert: unknown command "bogus"'
expect_line bogus err "usage: moert COMMAND [ARGS]"
run noargs 2
run check_noargs 2 check
expect_line check_noargs err "usage: moert check CONFIG [--set KEY=VALUE]..."

# plugins: the four built-in ones, each with its kind, version, devices and path
run plugins 0 plugins
expect_match plugins out "^KIND +NAME +VERSION +DEVICES +DTYPES +FLAGS +PATH$"
expect_match plugins out "^router +topk +[0-9.]+ +[a-z_,]*cpu.* /.*/libmoert-router-topk\.so$"
expect_match plugins out "^dispatcher +alltoall +[0-9.]+ +[a-z_,]*cpu.* /.*/libmoert-dispatch-alltoall\.so$"
# the header's flags by name: deepep's prepare may run on the compute stream under the overlap, alltoall's may not
expect_match plugins out "^dispatcher +deepep +[0-9.]+ +[a-z_,]*cpu.* host_sync,auto_overlap,prepare_own_stream +/.*/libmoert-dispatch-deepep\.so$"
expect_match plugins out "^dispatcher +alltoall +[0-9.]+ +[a-z_,]*cpu.* host_sync +/.*/libmoert-dispatch-alltoall\.so$"
# allgather holds every rank's tokens, which the memory estimate counts
expect_match plugins out "^dispatcher +allgather +[0-9.]+ +[a-z_,]*cpu.* host_sync,gathers_tokens +/.*/libmoert-dispatch-allgather\.so$"
expect_match plugins out "^precision +bf16 +[0-9.]+ +[a-z_,]*cpu.* /.*/libmoert-precision-bf16\.so$"
expect_match plugins out "^memory_policy +default +[0-9.]+ +[a-z_,]*cpu.* /.*/libmoert-memory-default\.so$"
expect_match plugins out "fixture-bad-abi\.so was built for ABI 2\.0, this moert supports ABI 1\.x$"
run plugins_options 0 plugins --options
expect_match plugins_options out "^router topk \(/.*/libmoert-router-topk\.so\)$"
expect_match plugins_options out "^  OPTION +TYPE +DEFAULT +RANGE +HELP$"
expect_match plugins_options out "^  reason +string +it is a test fixture +- +what the refusal says$"
expect_match plugins_options out "^  fail +bool +true +true\|false +refuse to start$"
run plugins_bad 2 plugins --bogus

# env: the registry's variables with their values here; a retired knob is named with what replaced it, and warned
# about when the library starts
MOERT_LOG=info MOERT_FP8_BLOCK_TILE_N=128 run env 0 env
expect_line env out "moert reads:"
expect_line env out "  MOERT_LOG=info"
expect_line env out "  MOERT_BOOTSTRAP_PORT unset (default: MASTER_PORT)"
expect_match env out "^  NCCL_NVLS_ENABLE"
expect_line env out '  MOERT_FP8_BLOCK_TILE_N: no longer read; use the fp8 precision option "block_tile_n"'
# a value that does not read as its type is flagged (a choice, a range); a good one is not
MOERT_LOG=verbose MOERT_BOOTSTRAP_PORT=99999 MOERT_PLUGIN_PATH=/x run env_values 0 env
expect_line env_values out "  MOERT_LOG=verbose   (not a valid value: see the type below)"
expect_line env_values out "  MOERT_BOOTSTRAP_PORT=99999   (not a valid value: see the type below)"
expect_line env_values out "  MOERT_PLUGIN_PATH=/x"
MOERT_BOOTSTRAP_PORT=29500 run env_port_ok 0 env
expect_line env_port_ok out "  MOERT_BOOTSTRAP_PORT=29500"
run env_bad 2 env --bogus
expect_line env_bad err 'moert env: unknown argument "--bogus"'
MOERT_LOG=info MOERT_FP8_BLOCK_TILE_N=128 run env_logged 0 check "$src/configs/demo-cpu.json"
expect_line env_logged err "moert[info] core: environment: MOERT_LOG=info"
expect_line env_logged err 'moert[warn] core: environment: MOERT_FP8_BLOCK_TILE_N is set but no longer read; use the fp8 precision option "block_tile_n"'
MOERT_LOG=loud run env_log_bad 0 check "$src/configs/demo-cpu.json"
expect_line env_log_bad err "moert[warn] core: MOERT_LOG=loud: expected error, warn, info or debug; logging at warn"
run options_fp8 0 plugins --options
expect_match options_fp8 out "^  block_tile_n +int +256 +"

# check: a good config (the CPU demo, or a small one of our own)
good="$src/configs/demo-cpu.json"
if [ ! -f "$good" ]; then
    good="$tmp/demo-cpu.json"
    echo '{"model": {"num_layers": 1}, "parallel": {"ranks": 2}, "router": {"plugin": "topk"}}' >"$good"
fi
run check_good 0 check "$good"
expect_match check_good out "^$good: ok \(router topk, dispatcher alltoall, precision bf16, memory_policy default; layers [0-9]+, ranks [0-9]+\)$"
expect_match check_good out "^memory \(estimate, balanced routing\): parameters [0-9.]+ [KMG]?i?B, gradients [0-9.]+ [KMG]?i?B, optimizer [0-9.]+ [KMG]?i?B, activations [0-9.]+ [KMG]?i?B, dispatcher buffers [0-9.]+ [KMG]?i?B, workspace [0-9.]+ [KMG]?i?B; [0-9.]+ [KMG]?i?B per rank x [0-9]+ ranks = [0-9.]+ [KMG]?i?B, of this machine's memory, shared by the [0-9]+ rank threads \([0-9.]+ GiB\)$"
run check_set 0 check "$good" --set train.steps=3 --set model.num_layers=1
expect_match check_set out "^$good: ok \(.*; layers 1, ranks [0-9]+\)$"
# a start-up warning that every layer's plugin gives on every rank is written once, with a note (4 layers x 2 ranks)
run check_warn_once 0 check "$good" --set model.num_layers=4 --set parallel.ranks=2 \
    --set 'router.load_balancing="aux_loss"' --set router.aux_loss_coeff=0
expect_count check_warn_once err 'load_balancing aux_loss with aux_loss_coeff 0: the loss is 0' 1
expect_match check_warn_once err "^moert\[warn\] router \"topk\" \(layer 0, rank [01]\): load_balancing aux_loss with aux_loss_coeff 0: the loss is 0 \(not repeated for other layers or ranks\)$"
# one rank: the note names the layers alone
run check_warn_once_rank 0 check "$good" --set model.num_layers=4 --set parallel.ranks=1 \
    --set 'router.load_balancing="aux_loss"' --set router.aux_loss_coeff=0
expect_match check_warn_once_rank err "^moert\[warn\] router \"topk\" \(layer 0, rank 0\): load_balancing aux_loss with aux_loss_coeff 0: the loss is 0 \(not repeated for other layers\)$"
expect_count check_warn_once_rank err 'aux_loss_coeff 0: the loss is 0' 1
# options set away from their defaults that change nothing in their combination are warned about, naming their paths
run check_no_effect 0 check "$good" --set router.expert_bias=false --set router.bias_update_rate=0.01 \
    --set 'router.drop_policy="position"' --set router.seed=7 --set dispatcher.capacity_factor=2
expect_match check_no_effect err "\\\$\\.router\\.bias_update_rate 0\\.01 has no effect without expert_bias"
expect_match check_no_effect err "\\\$\\.router\\.drop_policy position has no effect without capacity_factor > 0"
expect_match check_no_effect err "\\\$\\.router\\.seed 7 has no effect without input_jitter_eps > 0 or force_load_balancing"
expect_match check_no_effect err "\\\$\\.dispatcher\\.capacity_factor 2 has no effect without pad_to_capacity"
run check_no_effect_quiet 0 check "$good" --set router.seed=7 --set router.input_jitter_eps=0.01
expect_no_match check_no_effect_quiet err "has no effect"

# check: broken configs fail with the message and exit status 1
echo '{"model": {"hiden": 32}}' >"$tmp/typo.json"
run check_typo 1 check "$tmp/typo.json"
expect_line check_typo err "moert check: $tmp/typo.json: config error at \$.model.hiden: unknown key (did you mean \"hidden\"?)"
printf '{\n  "model": {"hidden": 32,}\n}\n' >"$tmp/syntax.json"
run check_syntax 1 check "$tmp/syntax.json"
expect_line check_syntax err "moert check: $tmp/syntax.json:2:26: invalid JSON: string or '}' expected near '}'"
run check_set_bad 1 check "$good" --set model.topk=99
expect_match check_set_bad err "^moert check: --set model.topk=99: config error at \\\$\.model\.topk: got 99, expected an integer in \[1, [0-9]+\]$"
run check_set_form 2 check "$good" --set novalue
expect_line check_set_form err 'moert check: --set expects KEY=VALUE (e.g. train.steps=10), got "novalue"'
echo '{"router": {"plugin": "nope"}}' >"$tmp/missing.json"
run check_missing 1 check "$tmp/missing.json"
expect_match check_missing err "^moert check: $tmp/missing.json: .*no router plugin \"nope\": tried /.*/libmoert-router-nope\.so, "
# a misspelt name is told the names of that kind there are (not the tests' fixtures)
echo '{"dispatcher": {"plugin": "deeepep"}}' >"$tmp/misspelt.json"
run check_misspelt 1 check "$tmp/misspelt.json"
expect_match check_misspelt err '; dispatcher plugins found: ("[a-z]+", )*"deepep"(, "[a-z]+")*$'
echo '{"router": {"plugin": "topk", "capacity_facter": 1.0}}' >"$tmp/option.json"
run check_option 1 check "$tmp/option.json"
expect_match check_option err "config error at \\\$\.router\.capacity_facter: unknown key \(did you mean \"capacity_factor\"\?\)$"
run check_nofile 1 check "$tmp/none.json"
expect_line check_nofile err "moert check: $tmp/none.json: cannot open config: No such file or directory"

# the build tree's moert lists its plugins, never the tests' fixtures
MOERT_PLUGIN_PATH= "$moert" plugins >"$tmp/plugins_plain.out" 2>&1 || fail "moert plugins failed"
grep -qE "^router +topk" "$tmp/plugins_plain.out" || fail "moert plugins does not list topk"
if grep -q fixture "$tmp/plugins_plain.out"; then fail "moert plugins lists the tests' fixtures"; fi
# plugins: a plugin whose init aborts (fixture-init-crashes, probed in a child) does not hide the others
run plugins_crash 0 plugins --options
expect_match plugins_crash out "^router topk \(/.*/libmoert-router-topk\.so\)$"
expect_match plugins_crash out "^  /.*/libmoert-router-fixture-init-crashes\.so: crashed \(signal 6, Aborted\) while starting it with the default options \(--options\)$"
expect_match plugins_crash out "^router fixture-init-crashes \(/.*\)$"
expect_match plugins_crash out "^memory_policy default \(/.*/libmoert-memory-default\.so\)$"
expect_match plugins_crash out "^options go in the plugin's section of a config"
expect_match plugins_crash out "^  router plugin /.*/libmoert-router-fixture-null-member\.so has no backward function$"

# a plugin whose init crashes or exits is named, with the call, layer and rank
# (139: killed by SIGSEGV; 1 in a sanitized build, whose handler reports the SEGV and exits)
run init_segv "139|1" check "$good" --set router.plugin=fixture-init-crashes --set router.how=segv
expect_match init_segv err "^moert: router plugin \"fixture-init-crashes\" \(/.*/libmoert-router-fixture-init-crashes\.so\) crashed \(SIGSEGV, invalid memory access\) in init \(layer 0, rank [0-9]+\)$"
run init_exit 1 check "$good" --set router.plugin=fixture-init-crashes --set router.how=exit
expect_match init_exit err "^moert: router plugin \"fixture-init-crashes\" \(/.*\) called exit\(\) \(a plugin must return an error instead\) in init \(layer 0, rank [0-9]+\)$"
# a NULL vtable member is refused when the plugin loads, naming the member
run null_member 1 check "$good" --set router.plugin=fixture-null-member
expect_match null_member err "config error at \\\$\.router\.plugin: router plugin \"fixture-null-member\" \(/.*\) has no backward function$"

# a relative plugin path in a config is taken from the config's folder, not from the current directory
build_root="${MOERT_TEST_BUILD_ROOT:-$(cd "$(dirname "$moert")/.." && pwd)}"
mkdir -p "$tmp/sub/plug"
cp "$build_root/plugins/router/libmoert-router-topk.so" "$tmp/sub/plug/"
echo '{"model": {"num_layers": 1}, "parallel": {"ranks": 2}, "router": {"plugin": "plug/libmoert-router-topk.so"}}' \
    >"$tmp/sub/rel.json"
(cd "$tmp" && "$moert" check sub/rel.json) >"$tmp/relative.out" 2>"$tmp/relative.err" || fail "relative: check failed"
expect_line relative out "sub/rel.json: ok (router $tmp/sub/plug/libmoert-router-topk.so, dispatcher alltoall, precision bf16, memory_policy default; layers 1, ranks 2)"

# memory: what cannot fit is refused by check and run before any plugin starts, with the estimate per rank
huge="--set parallel.device=cpu --set train.tokens_per_rank=16777216 --set model.hidden=4096 --set model.ffn_hidden=4096"
run memory_check 1 check "$good" $huge
expect_match memory_check err "^moert check: $good: config \"demo-cpu\" does not fit: it needs an estimated [0-9.]+ [GT]iB, more than 90% of this machine's memory, shared by the 4 rank threads \\([0-9.]+ GiB\\); parameters .*, activations [0-9.]+ TiB, .* per rank\\. Shrink \\\$\.model or \\\$\.train\.tokens_per_rank, use more ranks, or run it on GPUs"
run memory_run 1 run "$good" --steps 1 $huge
expect_match memory_run err "^moert run: config \"demo-cpu\" does not fit: it needs an estimated"
expect_no_match memory_run out "^step "
# the qwen3-30b-a3b preset needs about 32.5 GiB on the CPU: refused (not killed) wherever that does not fit
mem_kib=$(sed -n 's/^MemTotal: *\([0-9]*\) kB$/\1/p' /proc/meminfo)
if [ -n "$mem_kib" ] && [ "$mem_kib" -lt 35000000 ]; then
    run memory_qwen 1 check "$src/configs/qwen3-30b-a3b.json" --set parallel.device=cpu
    expect_match memory_qwen err "config \"qwen3-30b-a3b\" does not fit: it needs an estimated 3[0-9]\.[0-9] GiB"
fi

# sizes: keys beyond their bound are refused before anything is allocated (these wrapped size products and wrote
# past the heap in the bf16 CPU GEMM and the task's buffers; num_experts 2^28 zero-filled 32 GiB in check)
run size_ffn 1 run "$good" --steps 1 --set model.ffn_hidden=2305843009213693953
expect_line size_ffn err "moert run: --set model.ffn_hidden=2305843009213693953: config error at \$.model.ffn_hidden: got 2305843009213693953, expected an integer in [1, 262144]"
run size_hidden 1 run "$good" --steps 1 --set model.hidden=2305843009213693952
expect_line size_hidden err "moert run: --set model.hidden=2305843009213693952: config error at \$.model.hidden: got 2305843009213693952, expected an integer in [1, 65536]"
# keys that must agree change together across --set options (one at a time the first is refused half-set); where
# they cannot, the first refusal is reported
sed 's/"ranks": 4,/"ranks": 4, "expert_parallel": 4,/' "$good" >"$tmp/ep4.json"
run coupled_one 1 check "$tmp/ep4.json" --set parallel.ranks=8
run coupled_sets 0 check "$tmp/ep4.json" --set parallel.ranks=8 --set parallel.expert_parallel=8
expect_match coupled_sets out "ranks 8\)$"
run coupled_sets_bad 1 check "$tmp/ep4.json" --set parallel.ranks=8 --set parallel.expert_parallel=3
expect_match coupled_sets_bad err "^moert check: --set parallel.ranks=8: config error at \\\$.parallel.expert_parallel: "
# a folder given as the config; a --set value with a key twice (a file is refused for it too); a malformed --set is a
# usage error (exit 2), in every command
run check_folder 1 check "$tmp"
expect_line check_folder err "moert check: $tmp: cannot open config: it is a folder, expected a JSON file"
run set_duplicate 1 check "$good" --set 'router={"plugin":"topk","plugin":"x"}'
expect_match set_duplicate err "^moert check: --set router=.*: config --set router: invalid JSON: duplicate object key"
run set_malformed_run 2 run "$good" --set =5
expect_line set_malformed_run err 'moert run: --set expects KEY=VALUE (e.g. train.steps=10), got "=5"'
run set_malformed_check 2 check "$good" --set model.hidden
run set_malformed_ab 2 ab "$good" "$good" --set-b nokey
# rows padded to the experts' capacity count in the memory estimate (they were left out: check said 36.7 MiB and the
# run grew past the machine's memory)
run check_padding 1 check "$good" --set parallel.device=cpu --set dispatcher.pad_to_capacity=true --set dispatcher.capacity_factor=100000
expect_match check_padding err "config \"demo-cpu\" does not fit: it needs an estimated [0-9.]+ TiB"
# options that would break a run silently: an fp8 margin that quantizes every operand to 0 is refused; deepep's
# bench aid in a layer is warned about
run fp8_margin 1 check "$good" --set 'precision={"plugin": "fp8", "recipe": "delayed", "margin": 20}'
expect_match fp8_margin err "config error at \\\$.precision.margin: got 20, expected an integer in \\[0, 16\\]"
run deepep_bench_aid 0 check "$good" --set dispatcher.plugin=deepep --set dispatcher.bench_nvlink_only=true
expect_match deepep_bench_aid err "bench_nvlink_only: the calls write no outputs"
# a capacity factor past the plugins' bound is their range error, not a memory estimate
run padding_range 1 check "$good" --set router.pad_to_capacity=true --set router.capacity_factor=2e6
expect_match padding_range err "capacity_factor: got 2000000"
# refused by moert check as by moert run (they failed only at the first step): a sequence length that does not
# divide a rank's tokens, CUDA graphs "on" with ranks on the CPU
run check_seq_length 1 check "$good" --set train.seq_length=7
expect_line check_seq_length err "moert check: $good: config error at \$.train.seq_length: got 7, expected a divisor of \$.train.tokens_per_rank (256): a rank's micro-batch holds whole sequences"
run check_graph_cpu 1 check "$good" --set parallel.device=cpu --set parallel.cuda_graph=on
expect_match check_graph_cpu err "config error at \\\$.parallel.cuda_graph: \"on\" needs a layer step that can be captured in a CUDA graph, but the ranks run on the CPU"
# steps: a record is kept for each, so their count is bounded (it failed as "step records" past the memory)
run size_steps 1 check "$good" --set train.steps=1000000000000
expect_line size_steps err "moert check: --set train.steps=1000000000000: config error at \$.train.steps: got 1000000000000, expected an integer in [0, 100000000]"
run size_steps_flag 2 run "$good" --steps 99999999999999999999999
expect_line size_steps_flag err 'moert run: --steps expects an integer from 1 to 100000000, got "99999999999999999999999"'
run size_experts 1 check "$good" --set model.num_experts=268435456
expect_line size_experts err "moert check: --set model.num_experts=268435456: config error at \$.model.num_experts: got 268435456, expected an integer in [1, 16384]"

if [ "$failures" -ne 0 ]; then
    echo "test_cli: $failures check(s) failed" >&2
    exit 1
fi
echo "test_cli: all checks passed"
