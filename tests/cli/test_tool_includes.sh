#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# tools/ (the moert command) and harness/ (moert's own trainer) are clients of libmoert like any training framework:
# they include the public headers (moert/*.h), their own folder's headers and, from tools/, the harness's; never a
# core-internal header (anything under core/src). The build enforces the same: their include paths leave core/src
# out (harness/meson.build). No file is exempt: the trainer's step loop (harness/runtime.c) is a client of the public
# API too (docs/api.md, "moert's own trainer").
# Usage: test_tool_includes.sh [SOURCE_ROOT]
set -u
src="${1:-${MOERT_TEST_SOURCE_ROOT:-$(cd "$(dirname "$0")/../.." && pwd)}}"
cd "$src" || exit 1
failures=0
checked=0
for file in tools/*.c tools/*.h harness/*.c harness/*.h harness/*.cu; do
    [ -e "$file" ] || continue
    checked=$((checked + 1))
    dir=$(dirname "$file")
    while IFS= read -r line; do
        name=$(printf '%s\n' "$line" | sed -nE 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*["<]([^">]+)[">].*/\1/p')
        [ -n "$name" ] || continue
        ok=0
        case "$name" in
        moert/*) [ -e "core/include/$name" ] && ok=1 ;;
        *)
            if [ -e "core/src/$name" ] || [ -e "core/src/cuda/$name" ] || [ "${name#*../}" != "$name" ]; then ok=0
            elif [ -e "$dir/$name" ]; then ok=1
            elif [ "$dir" = tools ] && [ -e "harness/$name" ]; then ok=1
            elif ! printf '%s\n' "$line" | grep -q '"'; then ok=1 # a system header (<stdio.h>, <sys/wait.h>)
            fi
            ;;
        esac
        if [ "$ok" -ne 1 ]; then
            echo "FAIL: $file includes \"$name\", which is not a public header (moert/*.h) nor its own" >&2
            echo "  | $line" >&2
            failures=$((failures + 1))
        fi
    done < <(grep -E '^[[:space:]]*#[[:space:]]*include' "$file")
done
[ "$checked" -gt 0 ] || { echo "FAIL: no file checked under tools/ and harness/" >&2; exit 1; }
if [ "$failures" -ne 0 ]; then echo "test_tool_includes: $failures include(s) reach into the core"; exit 1; fi
echo "test_tool_includes: $checked files include only public and their own headers"
