#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Outputs of `moert run` and `moert ab`: checked before anything runs (never an input, never a link, a writable
# folder), written atomically (a failed write leaves the previous file), and `ab` writes what it has when a step fails.
# Usage: test_outputs.sh PATH/TO/moert   (meson test runs it with MOERT_TEST_SOURCE_ROOT set)
set -u
moert="$(cd "$(dirname "$1")" && pwd)/$(basename "$1")" # absolute: some checks run from other folders
# the tests' fixture plugins: the build tree's moert does not search them by itself
export MOERT_PLUGIN_PATH="$(cd "$(dirname "$moert")/.." && pwd)/tests/fixtures"
src="${MOERT_TEST_SOURCE_ROOT:-$(cd "$(dirname "$0")/../.." && pwd)}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
run_dir="$tmp" # the command runs in $tmp: relative paths are the tests' files
. "$(dirname "$0")/cli_lib.sh"
same() { cmp -s "$1" "$2" || fail "$3: $1 was changed"; }

# a small, quick config
cat >"$tmp/c.json" <<JSON
{"model": {"hidden": 16, "ffn_hidden": 32, "num_experts": 4, "topk": 2, "num_layers": 1},
 "parallel": {"ranks": 2, "device": "cpu"}, "train": {"steps": 3, "tokens_per_rank": 32}}
JSON
cp "$tmp/c.json" "$tmp/c.orig"

# --report onto the input config: refused before the run, the config untouched
run onto_config 1 run c.json --report c.json
expect_line onto_config err "moert run: --report c.json is the input c.json: refusing to overwrite an input"
expect_no_match onto_config out "^step "
same "$tmp/c.json" "$tmp/c.orig" onto_config
ln "$tmp/c.json" "$tmp/hard.json"
run onto_config_hardlink 1 run c.json --report hard.json
expect_line onto_config_hardlink err "moert run: --report hard.json is the input c.json: refusing to overwrite an input"
same "$tmp/c.json" "$tmp/c.orig" onto_config_hardlink

# an unwritable place is found before the training, not after it
run no_folder 1 run c.json --report missing/r.json
expect_line no_folder err "moert run: --report missing/r.json: its folder missing: No such file or directory"
expect_no_match no_folder out "^step "

# a symbolic link is not followed
echo '{"mine": true}' >"$tmp/target.json"
cp "$tmp/target.json" "$tmp/target.orig"
ln -s target.json "$tmp/link.json"
run symlink 1 run c.json --report link.json
expect_line symlink err "moert run: --report link.json is a symbolic link: moert writes outputs only to plain files (give the link's target, or another path)"
same "$tmp/target.json" "$tmp/target.orig" symlink

# a good report, then a rewrite that fails half-way (file size limit): the previous report stays whole
run report 0 run c.json --report r.json --quiet
cp "$tmp/r.json" "$tmp/r.orig"
(cd "$tmp" && trap '' XFSZ && ulimit -f 1 && "$moert" run c.json --steps 3 --report r.json --quiet) \
    >"$tmp/rewrite.out" 2>"$tmp/rewrite.err"
[ $? = 1 ] || fail "rewrite: a failed write did not exit 1"
grep -qE "^moert run: writing r\.json failed \(File too large\); the file was left as it was$" "$tmp/rewrite.err" ||
    { fail "rewrite: unexpected message"; cat "$tmp/rewrite.err" >&2; }
same "$tmp/r.json" "$tmp/r.orig" rewrite
ls -a "$tmp" | grep -q '\.tmp-' && fail "rewrite: a temporary file was left behind"

# ab: a Markdown file beside the report that ab did not write is not overwritten, and nothing runs
echo "my notes" >"$tmp/ab.md"
run ab_md 1 ab c.json c.json --steps 2 --warmup 0 --report ab.json
expect_line ab_md err "moert ab: --report ab.json: the table beside it, ab.md, exists and was not written by moert ab; move it away or choose another report name"
expect_no_match ab_md out "step"
[ "$(cat "$tmp/ab.md")" = "my notes" ] || fail "ab_md: ab.md was overwritten"
[ -e "$tmp/ab.json" ] && fail "ab_md: ab.json was written"
run ab_onto_config 1 ab c.json c.json --steps 2 --report c.json
expect_line ab_onto_config err "moert ab: --report c.json is the input c.json: refusing to overwrite an input"
same "$tmp/c.json" "$tmp/c.orig" ab_onto_config

# outputs that would land on each other however spelt are refused before anything runs
run run_same_spelt 1 run c.json --steps 2 --report o1.json --trace ./o1.json
expect_line run_same_spelt err 'moert run: --report and --trace name the same file "./o1.json"'
[ -e "$tmp/o1.json" ] && fail "run_same_spelt: o1.json was written"
run ab_plot_report 1 ab c.json c.json --steps 2 --warmup 0 --report o2.json --plot ./o2.json
expect_line ab_plot_report err "moert ab: --plot ./o2.json is also the report or its table"
[ -e "$tmp/o2.json" ] && fail "ab_plot_report: o2.json was written"
# the plot's data file (FILE.png -> FILE.plot.json) is an output too: never an input, the report, a link, or a
# file moert did not write
cp "$tmp/c.json" "$tmp/in.plot.json"
run ab_plot_data_input 1 ab in.plot.json in.plot.json --steps 2 --warmup 0 --plot in.png
expect_line ab_plot_data_input err "moert ab: --plot in.png: its data file in.plot.json would be config A, in.plot.json"
same "$tmp/in.plot.json" "$tmp/c.orig" ab_plot_data_input
run ab_plot_data_report 1 ab c.json c.json --steps 2 --warmup 0 --report rp.plot.json --plot rp.png
expect_line ab_plot_data_report err "moert ab: --plot rp.png: its data file rp.plot.json would be --report, rp.plot.json"
ln -s target.json "$tmp/lp.plot.json"
run ab_plot_data_link 1 ab c.json c.json --steps 2 --warmup 0 --plot lp.png
expect_match ab_plot_data_link err "^moert ab: --plot's data lp.plot.json is a symbolic link"
same "$tmp/target.json" "$tmp/target.orig" ab_plot_data_link
echo '{"my": "data"}' >"$tmp/mine.plot.json"
run ab_plot_data_mine 1 ab c.json c.json --steps 2 --warmup 0 --plot mine.png
expect_line ab_plot_data_mine err "moert ab: --plot's data mine.plot.json (named after mine.png) exists and was not written by moert: move it away or choose another name"
[ "$(cat "$tmp/mine.plot.json")" = '{"my": "data"}' ] || fail "ab_plot_data_mine: mine.plot.json was overwritten"
[ -e "$tmp/mine.png" ] && fail "ab_plot_data_mine: a plot was drawn"

# ab: a step of B fails at step 3 (decide is called 3 times a step: fail_after 6): the report holds what
# both sides did, says it is incomplete, and the status is 1
rm -f "$tmp/ab.md"
run ab_fail 1 ab c.json c.json --steps 3 --warmup 1 --quiet --report ab.json --set-b memory_policy.plugin=fixture-misbehave \
    --set-b memory_policy.fail_after=6
[ -f "$tmp/ab.json" ] || fail "ab_fail: no report written"
grep -qF '"complete": false' "$tmp/ab.json" || fail "ab_fail: the report does not say it is incomplete"
grep -qE '"failure": "B \(c\.json\), step 3: rank [01]: memory_policy \\"fixture-misbehave\\" decide failed' "$tmp/ab.json" ||
    { fail "ab_fail: the report does not name the failure"; grep failure "$tmp/ab.json" >&2; }
[ "$(grep -c '"completed_steps": ' "$tmp/ab.json")" = 2 ] || fail "ab_fail: no completed_steps per side"
grep -qF '"completed_steps": 3' "$tmp/ab.json" || fail "ab_fail: A's 3 steps are not in the report"
grep -qF '"completed_steps": 2' "$tmp/ab.json" || fail "ab_fail: B's 2 steps are not in the report"
grep -qE '^- INCOMPLETE: B \(c\.json\), step 3: ' "$tmp/ab.md" || fail "ab_fail: the table does not say it is incomplete"

if [ "$failures" -ne 0 ]; then
    echo "test_outputs: $failures check(s) failed" >&2
    exit 1
fi
echo "test_outputs: all checks passed"
