#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The tree follows .clang-format: every C, CUDA and header file git tracks is as clang-format writes it. Prints the
# files that are not and how to fix them; exits 1 then. Skipped (77) where clang-format or git is missing, or where
# clang-format is not version 14 (./build.sh test installs Debian's).
# Usage: test_format.sh SOURCE_ROOT
set -u
root=${1:-$(cd "$(dirname "$0")/../.." && pwd)}
command -v clang-format >/dev/null 2>&1 || { echo "test_format: no clang-format (apt-get install clang-format)"; exit 77; }
[ -d "$root/.git" ] || [ -f "$root/.git" ] || { echo "test_format: $root is not a git checkout"; exit 77; }
# another clang-format major version lays some lines out otherwise: the tree is kept as clang-format 14 (Debian 12's)
major=$(clang-format --version | sed -n 's/.*version \([0-9]*\).*/\1/p' | head -1)
[ "$major" = 14 ] || { echo "test_format: clang-format $major here; the tree follows clang-format 14 (skipped)"; exit 77; }
cd "$root" || exit 1
bad=()
while IFS= read -r f; do
    clang-format --dry-run -Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done < <(git ls-files '*.c' '*.h' '*.cu' '*.cuh')
if [ ${#bad[@]} -ne 0 ]; then
    printf 'test_format: not formatted as .clang-format says: %s\n' "${bad[@]}" >&2
    echo "test_format: fix with clang-format -i FILE ($(clang-format --version | head -1))" >&2
    exit 1
fi
echo "test_format: every C, CUDA and header file follows .clang-format ($(git ls-files '*.c' '*.h' '*.cu' '*.cuh' | wc -l) files)"
