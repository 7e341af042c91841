#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# DeepEP's public source as one tarball for the GPU machine (which has no internet), taken from the mirror that the
# `fetch` tool keeps of github:deepseek-ai/DeepEP. Run HERE, not on the GPU machine; the tarball goes into the
# git-ignored carry folder build-pack/ and is never committed.
#
# Which commit: REF when given; otherwise the newest commit of the mirror's HEAD line (first parents) that can be
# built intranode-only without NVSHMEM, i.e. whose setup.py has DeepEP v1's no-NVSHMEM path (it compiles with
# -DDISABLE_NVSHMEM when no NVSHMEM is found) and whose tree has v1's layout (deep_ep/buffer.py, csrc/deep_ep.cpp),
# which is what bench/deepep_peer_build.sh and bench/deepep_peer.py are written for. HEAD itself when it qualifies.
# (DeepEP 2.x, from April 2026 on, always compiles and links NVSHMEM and needs NCCL >= 2.30.4; its legacy intranode
# kernels are v1's, so the last v1 commit measures them.)
#
# The tarball holds DeepEP/ (git archive of the commit, without figures/: pictures only) and DeepEP/DEEPEP_COMMIT
# (the full hash). Prints the commit taken on stdout's last line, as "deepep commit <hash> (<date>)".
#   usage: bench/deepep_peer_src.sh DEST_TGZ [REF]          e.g. bench/deepep_peer_src.sh build-pack/deepep-src.tgz
#   environment: DEEPEP_MIRROR (default /work/.mirror/deepseek-ai+DeepEP/repo, the fetch tool's bare git dir)
set -euo pipefail
DEST=${1:?usage: bench/deepep_peer_src.sh DEST_TGZ [REF]}
REF=${2:-}
MIRROR=${DEEPEP_MIRROR:-/work/.mirror/deepseek-ai+DeepEP/repo}
die() { echo "deepep_peer_src.sh: $*" >&2; exit 1; }
[ -d "$MIRROR" ] || die "no DeepEP mirror at $MIRROR (fetch github:deepseek-ai/DeepEP first, or set DEEPEP_MIRROR)"
g() { git --git-dir="$MIRROR" "$@"; }
head=$(g rev-parse --verify "HEAD^{commit}") || die "the mirror at $MIRROR has no HEAD commit"

# v1_intranode COMMIT: true when COMMIT has v1's layout and its setup.py's no-NVSHMEM build, and its deep_ep.cpp does
# not call the low-latency mask kernel (internode_ll::update_mask_buffer, added with elastic EP in Sep 2025 outside the
# DISABLE_NVSHMEM guards: a no-NVSHMEM build then compiles but its module fails to load on that undefined symbol)
v1_intranode() {
  g cat-file -e "$1:deep_ep/buffer.py" 2>/dev/null && g cat-file -e "$1:csrc/deep_ep.cpp" 2>/dev/null &&
    g show "$1:setup.py" 2>/dev/null | grep -q 'DISABLE_NVSHMEM' &&
    ! g show "$1:csrc/deep_ep.cpp" 2>/dev/null | grep -q 'internode_ll::update_mask_buffer'
}

if [ -n "$REF" ]; then
  commit=$(g rev-parse --verify "$REF^{commit}") || die "REF $REF is not a commit of the mirror"
  v1_intranode "$commit" ||
    echo "deepep_peer_src.sh: warning: $REF has no v1 no-NVSHMEM build; bench/deepep_peer_build.sh will refuse it" >&2
else
  commit=
  for c in $(g rev-list --first-parent HEAD); do
    if v1_intranode "$c"; then commit=$c; break; fi
  done
  [ -n "$commit" ] || die "no commit of the mirror's HEAD line has DeepEP v1's no-NVSHMEM build"
  if [ "$commit" != "$head" ]; then
    echo "deepep_peer_src.sh: HEAD $(g log -1 --format='%h (%ad, %s)' --date=short "$head") cannot be built" \
      "without NVSHMEM; taking the newest commit that can:" \
      "$(g log -1 --format='%h (%ad, %s)' --date=short "$commit")," \
      "$(g rev-list --count --first-parent "$commit..$head") first-parent commits behind HEAD" >&2
  fi
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
g archive --format=tar --prefix=DeepEP/ "$commit" -- . ':(exclude)figures' | tar -x -C "$tmp"
echo "$commit" >"$tmp/DeepEP/DEEPEP_COMMIT"
mkdir -p "$(dirname "$DEST")"
# byte-stable for one commit: sorted names, the commit's time on every file, no owner, no gzip time stamp
when=$(g log -1 --format=%ct "$commit")
tar --sort=name --owner=0 --group=0 --numeric-owner --mtime="@$when" -C "$tmp" -cf - DeepEP | gzip -n -9 >"$DEST.part"
mv "$DEST.part" "$DEST"
echo "wrote $DEST ($(du -k "$DEST" | cut -f1) KiB, $(tar -tzf "$DEST" | grep -vc '/$') files)"
echo "deepep commit $commit ($(g log -1 --format=%cd --date=short "$commit"))"
