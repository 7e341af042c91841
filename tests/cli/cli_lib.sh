# SPDX-License-Identifier: Apache-2.0
# What the CLI tests share, sourced after they set `moert` (the command), `tmp` (a scratch folder, or cli_scratch
# makes one) and optionally `run_dir` (the folder the command runs in; default: the test's own).
failures=0

# cli_scratch: makes $tmp, a scratch folder removed on exit, and runs the commands there (run_dir)
cli_scratch() {
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    run_dir="$tmp"
}

fail() { echo "FAIL: $*" >&2; failures=$((failures + 1)); }

# run NAME EXPECTED_STATUS ARGS...: runs moert (EXPECTED_STATUS may list several, "139|1"), keeps stdout/stderr in
# $tmp/NAME.out/.err
run() {
    local name="$1" want="$2"
    shift 2
    (cd "${run_dir:-.}" && "$moert" "$@") >"$tmp/$name.out" 2>"$tmp/$name.err"
    local got=$?
    case "|$want|" in
    *"|$got|"*) ;;
    *)
        fail "$name: moert $* exited $got, expected $want"
        sed 's/^/  | /' "$tmp/$name.out" "$tmp/$name.err" >&2
        ;;
    esac
}
# expect_line NAME FILE(out|err) EXACT_LINE
expect_line() {
    grep -qxF -- "$3" "$tmp/$1.$2" || { fail "$1: $2 lacks the line: $3"; sed 's/^/  | /' "$tmp/$1.$2" >&2; }
}
# expect_match NAME FILE(out|err) EXTENDED_REGEX
expect_match() {
    grep -qE -- "$3" "$tmp/$1.$2" || { fail "$1: $2 does not match: $3"; sed 's/^/  | /' "$tmp/$1.$2" >&2; }
}
# expect_count NAME FILE(out|err) FIXED_STRING COUNT: the lines holding FIXED_STRING are exactly COUNT
expect_count() {
    local got
    got=$(grep -cF -- "$3" "$tmp/$1.$2")
    [ "$got" = "$4" ] || { fail "$1: $2 has $got lines with \"$3\", expected $4"; sed 's/^/  | /' "$tmp/$1.$2" >&2; }
}
# expect_no_match NAME FILE(out|err) EXTENDED_REGEX
expect_no_match() {
    if grep -qE -- "$3" "$tmp/$1.$2"; then fail "$1: $2 matches: $3"; sed 's/^/  | /' "$tmp/$1.$2" >&2; fi
}
