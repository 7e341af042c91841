#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# No plugin reaches into a sibling plugin's folder: what plugins share lives in plugins/lib. Each plugin's sources and
# meson.build may name ../lib (and nothing else above their own folder).
# Usage: test_plugin_layout.sh [SOURCE_ROOT]
set -u
src="${1:-${MOERT_TEST_SOURCE_ROOT:-$(cd "$(dirname "$0")/../.." && pwd)}}"
failures=0
cd "$src/plugins" || exit 1
for dir in */; do
    dir=${dir%/}
    [ "$dir" = lib ] && continue
    # a path that leaves the plugin's folder for anywhere but ../lib
    hits=$(grep -nE '\.\./' "$dir"/*.c "$dir"/*.h "$dir"/*.cu "$dir"/*.cuh "$dir"/meson.build 2>/dev/null |
           grep -vE '^[^:]+:[0-9]+:[[:space:]]*#[^i]' | grep -E '\.\./' | grep -vE '\.\./lib(/|'"'"'|")' || true)
    if [ -n "$hits" ]; then
        echo "FAIL: plugins/$dir reaches outside its folder (only ../lib is shared):" >&2
        echo "$hits" | sed 's/^/  | /' >&2
        failures=$((failures + 1))
    fi
done
# the build checks plugins/lib has no plugin of its own
if ls lib/*vtable* >/dev/null 2>&1 || grep -lE 'MOERT_[A-Z_]+_V1_EXPORT' lib/*.c >/dev/null 2>&1; then
    echo "FAIL: plugins/lib holds a plugin's vtable" >&2
    failures=$((failures + 1))
fi
if [ "$failures" -ne 0 ]; then echo "test_plugin_layout: $failures check(s) failed"; exit 1; fi
echo "test_plugin_layout: all checks passed"
