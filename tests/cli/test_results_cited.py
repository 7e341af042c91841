#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""bench/results/ keeps only the figures the docs cite (git history keeps the rest): every file there must be named
by a Markdown file of the tree (docs/, README.md, CHANGELOG.md, plugins/*/*.md), directly or through a pattern the
docs write (`{a,b}` alternatives, `{1..5}` ranges, `*`), or be the raw data (same name, other extension) of a cited
file. Prints the uncited files and exits 1 when there are any.
    usage: tests/cli/test_results_cited.py SOURCE_ROOT"""
import fnmatch
import glob
import os
import re
import sys


def expand(pattern):
    """Every name a brace pattern stands for: {a,b} alternatives and {1..5} ranges, nested or in sequence."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    body = m.group(1)
    r = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    alternatives = [str(i) for i in range(int(r.group(1)), int(r.group(2)) + 1)] if r else body.split(",")
    return [name for alt in alternatives for name in expand(pattern[:m.start()] + alt + pattern[m.end():])]


def main(root):
    text = ""
    for pat in ("docs/**/*.md", "README.md", "CHANGELOG.md", "plugins/**/*.md", "bench/*.md"):
        for f in glob.glob(os.path.join(root, pat), recursive=True):
            with open(f) as fh:
                text += fh.read() + "\n"
    cited = [p.rstrip(".,") for c in set(re.findall(r"20\d\d-\d\d-\d\d-[A-Za-z0-9_.,{}*\-]+", text))
             for p in expand(c)]
    results = os.path.join(root, "bench", "results")
    names = sorted(os.listdir(results))
    direct = {n for n in names if any(fnmatch.fnmatch(n, p) or fnmatch.fnmatch(n, p + ".*") for p in cited)}
    stems = {os.path.splitext(n)[0] for n in direct}
    uncited = [n for n in names if n not in direct and os.path.splitext(n)[0] not in stems]
    for n in uncited:
        print("bench/results/%s: cited by no document (cite it where its figure is used, or delete it)" % n)
    print("%d result files, %d cited, %d raw data beside a cited file, %d uncited"
          % (len(names), len(direct), len(names) - len(direct) - len(uncited), len(uncited)))
    return 1 if uncited else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "."))
