#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Installs moert into a temporary prefix (a fresh `meson setup --prefix` of this source tree), builds the
# out-of-tree example plugin with its Makefile through pkg-config, and uses it with the installed `moert`:
# `check` on a config naming the .so by path, and by name through MOERT_PLUGIN_PATH, `plugins`, and a
# short `run`. The fresh build tree is deleted before the installed files are used, so nothing is found
# there by accident. Also compiles and runs a small program against libmoert through pkg-config.
set -eu
src="${MOERT_TEST_SOURCE_ROOT:-$(cd "$(dirname "$0")/../.." && pwd)}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
prefix="$tmp/prefix"
unset MOERT_PLUGIN_PATH

step() { echo "== $*"; }
fail() { echo "FAIL: $*" >&2; exit 1; }

step "configure, build and install into $prefix"
meson setup "$tmp/build" "$src" --prefix="$prefix" -Dcuda=disabled -Dbuildtype=debugoptimized >"$tmp/setup.log" 2>&1 ||
    { cat "$tmp/setup.log"; fail "meson setup"; }
# only what is installed: the library, the command and the plugins
targets=$(cd "$tmp/build" && ninja -t targets all | sed -n 's/^\(core\/libmoert\.so[^:]*\|tools\/moert\|tests\/moert-conformance\|plugins\/[^:]*\.so\): .*/\1/p')
ninja -C "$tmp/build" $targets >"$tmp/build.log" 2>&1 || { tail -40 "$tmp/build.log"; fail "build"; }
meson install -C "$tmp/build" --no-rebuild >"$tmp/install.log" 2>&1 || { tail -40 "$tmp/install.log"; fail "install"; }
rm -rf "$tmp/build"

pc=$(find "$prefix" -name moert.pc | head -1)
[ -n "$pc" ] || fail "no moert.pc under $prefix"
export PKG_CONFIG_PATH="$(dirname "$pc")"
libdir="$(pkg-config --variable=libdir moert)"
plugindir="$(pkg-config --variable=plugindir moert)"
[ "$libdir" = "$(dirname "$(dirname "$pc")")" ] || fail "pkg-config libdir $libdir is not where moert.pc is"
for h in moert.h layers.h tensor.h plugin.h router.h dispatcher.h precision.h memory_policy.h; do
    [ -f "$prefix/include/moert/$h" ] || fail "header moert/$h not installed"
done
for p in router-topk dispatch-alltoall precision-bf16 memory-default; do
    [ -f "$plugindir/libmoert-$p.so" ] || fail "plugin libmoert-$p.so not installed in $plugindir"
done
moert="$prefix/bin/moert"
[ -x "$moert" ] || fail "no $moert"

step "build the example plugin out of tree"
cp -r "$src/examples/vendor_plugin" "$tmp/vendor"
make -C "$tmp/vendor" >"$tmp/make.log" 2>&1 || { cat "$tmp/make.log"; fail "make"; }
so="$tmp/vendor/libmoert-router-roundrobin.so"
[ -f "$so" ] || fail "make did not produce $so"
nm -D --defined-only "$so" | grep -q ' moert_router_v1$' || fail "$so does not export moert_router_v1"
if nm -D --defined-only "$so" | grep -v ' moert_router_v1$' | grep -q ' [TDR] '; then
    fail "$so exports more than moert_router_v1"
fi

step "the installed conformance tool passes the out-of-tree plugin on its own"
[ -x "$prefix/bin/moert-conformance" ] || fail "moert-conformance is not installed"
out=$("$prefix/bin/moert-conformance" "$so" 2>&1) || { echo "$out"; fail "moert-conformance refused the example plugin"; }
echo "$out" | grep -qE "^router +roundrobin +ok$" || { echo "$out"; fail "moert-conformance did not check the plugin"; }
if "$prefix/bin/moert-conformance" "$tmp/vendor/vendor_router.c" >/dev/null 2>&1; then fail "moert-conformance passed a non-plugin"; fi

step "moert check with the plugin given by path"
cat >"$tmp/vendor.json" <<JSON
{"model": {"hidden": 16, "ffn_hidden": 32, "num_experts": 4, "topk": 2, "num_layers": 1},
 "parallel": {"ranks": 2, "device": "cpu"},
 "train": {"steps": 2, "tokens_per_rank": 32},
 "router": {"plugin": "$so", "offset": 1}}
JSON
out=$("$moert" check "$tmp/vendor.json" | head -1) || fail "moert check: $out"
[ "$out" = "$tmp/vendor.json: ok (router $so, dispatcher alltoall, precision bf16, memory_policy default; layers 1, ranks 2)" ] ||
    fail "unexpected check output: $out"

step "moert check with an option the plugin does not have"
sed 's/"offset": 1/"ofset": 1/' "$tmp/vendor.json" >"$tmp/typo.json"
if out=$("$moert" check "$tmp/typo.json" 2>&1); then fail "check accepted a misspelt option"; fi
case "$out" in
*'config error at $.router.ofset: unknown key (did you mean "offset"?)') ;;
*) fail "unexpected message: $out" ;;
esac

step "moert plugins and check by name with MOERT_PLUGIN_PATH"
listing=$(MOERT_PLUGIN_PATH="$tmp/vendor" "$moert" plugins)
echo "$listing" | grep -qE "^router +roundrobin +1\.0\.0 +cpu +fp32,fp64,bf16 +- +$so$" ||
    { echo "$listing"; fail "moert plugins does not list roundrobin"; }
echo "$listing" | grep -qE "^router +topk .* $plugindir/libmoert-router-topk\.so$" ||
    { echo "$listing"; fail "moert plugins does not list the installed topk router"; }
sed "s|\"plugin\": \"$so\"|\"plugin\": \"roundrobin\"|" "$tmp/vendor.json" >"$tmp/byname.json"
out=$(MOERT_PLUGIN_PATH="$tmp/vendor" "$moert" check "$tmp/byname.json") || fail "check by name: $out"
if "$moert" check "$tmp/byname.json" >/dev/null 2>"$tmp/err"; then fail "found roundrobin without MOERT_PLUGIN_PATH"; fi
grep -qF "no router plugin \"roundrobin\": tried " "$tmp/err" || { cat "$tmp/err"; fail "unexpected not-found message"; }
grep -qF "$plugindir/libmoert-router-roundrobin.so" "$tmp/err" || { cat "$tmp/err"; fail "install dir not searched"; }

step "moert run with the plugin"
"$moert" run "$tmp/vendor.json" >"$tmp/run.log" 2>&1 || { cat "$tmp/run.log"; fail "moert run"; }

step "make install puts the plugin in plugindir, where it is found by name"
make -C "$tmp/vendor" install >/dev/null || fail "make install"
[ -f "$plugindir/libmoert-router-roundrobin.so" ] || fail "make install did not copy the plugin"
"$moert" check "$tmp/byname.json" >/dev/null || fail "roundrobin not found in the install dir"

step "the installed moert, started through PATH from a folder that looks like a build tree, ignores it"
# a folder holding an entry named moert whose parent has build.ninja and plugins/*/: the installed moert used to
# resolve its argv[0] against the current directory here and load the plugins it found (docs/abi.md says never)
mkdir -p "$tmp/trap/bin" "$tmp/trap/plugins/evil"
touch "$tmp/trap/build.ninja" "$tmp/trap/bin/moert"
cp "$plugindir/libmoert-router-topk.so" "$tmp/trap/plugins/evil/libmoert-router-trapped.so"
listing=$(cd "$tmp/trap/bin" && PATH="$prefix/bin:$PATH" moert plugins) || fail "moert plugins through PATH"
case "$listing" in
*"$tmp/trap"*) echo "$listing"; fail "the installed moert searched the build-tree look-alike around the current directory" ;;
esac
echo "$listing" | grep -qE "^router +topk .* $plugindir/libmoert-router-topk\.so$" || { echo "$listing"; fail "topk not listed"; }

step "a program linked against libmoert through pkg-config"
cat >"$tmp/user.c" <<'C'
#include <moert/moert.h>
#include <string.h>
int main(void)
{
    moert_config *cfg = NULL;
    if (strcmp(moert_version(), MOERT_VERSION_STRING) != 0) return 1;
    if (moert_config_load_string("{\"model\": {\"hiden\": 1}}", "x", &cfg) != MOERT_ERR_CONFIG) return 2;
    if (!strstr(moert_last_error(), "did you mean \"hidden\"")) return 3;
    if (moert_config_load_string("{}", "x", &cfg) != MOERT_OK) return 4;
    moert_launch launch = {.struct_size = sizeof launch, .rank = 0, .world_size = 1, .device = moert_cpu()};
    moert_layers *layers = NULL;
    if (moert_layers_create(cfg, &launch, &layers) != MOERT_OK) return 5; /* plugins from the install dir */
    moert_layers_destroy(layers);
    char plugin[1600];
    if (moert_config_get_string(cfg, "router.plugin", plugin, sizeof plugin) != MOERT_OK) return 6;
    if (strcmp(plugin, "topk") != 0) return 7;
    moert_config_free(cfg);
    return 0;
}
C
cc -std=c11 "$tmp/user.c" $(pkg-config --cflags --libs moert) -o "$tmp/user" || fail "compiling against libmoert"
LD_LIBRARY_PATH="$libdir" "$tmp/user" || fail "the program linked against libmoert failed ($?)"

step "libmoert exports exactly the functions its installed headers mark MOERT_API"
lib=$(ls "$libdir"/libmoert.so.* | head -1)
grep -h '^MOERT_API' "$prefix"/include/moert/*.h | grep -oE 'moert_[a-z0-9_]+\(' | tr -d '(' | sort -u >"$tmp/declared"
nm -D --defined-only "$lib" | awk '$2 ~ /^[TDRBW]$/ {print $3}' | sort -u >"$tmp/exported"
[ -s "$tmp/declared" ] || fail "no MOERT_API declaration found in the installed headers"
diff -u "$tmp/declared" "$tmp/exported" >"$tmp/exports.diff" ||
    { cat "$tmp/exports.diff"; fail "exported symbols (+) differ from the public declarations (-)"; }

step "examples/embed: built out of tree with pkg-config, run against the installed library"
cp -r "$src/examples/embed" "$tmp/embed"
make -C "$tmp/embed" >"$tmp/embed-make.log" 2>&1 || { cat "$tmp/embed-make.log"; fail "make examples/embed"; }
# the installed libraries only (meson test's LD_LIBRARY_PATH names the build tree's, sanitized in CI's ASan build)
LD_LIBRARY_PATH="$libdir" "$tmp/embed/embed" >"$tmp/embed.log" 2>&1 || { cat "$tmp/embed.log"; fail "examples/embed failed"; }
grep -qx "embed: ok" "$tmp/embed.log" || { cat "$tmp/embed.log"; fail "examples/embed did not say ok"; }

step "moert ab --plot's drawing script is installed where the installed moert looks for it"
[ -r "$prefix/share/moert/ab_plot.py" ] || fail "ab_plot.py not installed in $prefix/share/moert"
"$moert" ab "$tmp/vendor.json" "$tmp/vendor.json" --warmup 0 --steps 1 --quiet --plot "$tmp/ab.png" >"$tmp/ab.log" 2>&1 ||
    grep -qF "draw it later with python3 $prefix/share/moert/ab_plot.py $tmp/ab.plot.json" "$tmp/ab.log" ||
    { cat "$tmp/ab.log"; fail "the installed moert ab --plot neither drew nor named the installed script"; }

# Only where nvcc is found: the CUDA example builds with it; run here on the CPU path (a GPU run is the same config
# with "parallel": {"device": "cuda"}).
if command -v nvcc >/dev/null 2>&1; then
    step "examples/vendor_plugin_cuda: a router with a CUDA kernel, built out of tree with pkg-config and nvcc"
    cp -r "$src/examples/vendor_plugin_cuda" "$tmp/vendor_cuda"
    make -C "$tmp/vendor_cuda" >"$tmp/make-cuda.log" 2>&1 || { cat "$tmp/make-cuda.log"; fail "make vendor_plugin_cuda"; }
    cso="$tmp/vendor_cuda/libmoert-router-stride.so"
    [ -f "$cso" ] || fail "make did not produce $cso"
    nm -D --defined-only "$cso" | grep -q ' moert_router_v1$' || fail "$cso does not export moert_router_v1"
    sed "s|\"plugin\": \"$so\", \"offset\": 1|\"plugin\": \"$cso\", \"stride\": 3|" "$tmp/vendor.json" >"$tmp/cuda.json"
    out=$("$moert" check "$tmp/cuda.json" | head -1) || fail "moert check with the CUDA example: $out"
    [ "$out" = "$tmp/cuda.json: ok (router $cso, dispatcher alltoall, precision bf16, memory_policy default; layers 1, ranks 2)" ] ||
        fail "unexpected check output: $out"
    "$moert" run "$tmp/cuda.json" >"$tmp/run-cuda.log" 2>&1 || { cat "$tmp/run-cuda.log"; fail "moert run with the CUDA example"; }
    listing=$(MOERT_PLUGIN_PATH="$tmp/vendor_cuda" "$moert" plugins)
    echo "$listing" | grep -qE "^router +stride +1\.0\.0 +cpu,cuda +fp32,fp64,bf16 +graph +$cso$" ||
        { echo "$listing"; fail "moert plugins does not list stride"; }
else
    step "examples/vendor_plugin_cuda: skipped (no nvcc)"
fi

step "a relocated install: libmoert finds the plugins installed beside it (moert/plugins in its folder)"
mv "$prefix" "$tmp/moved"
mlib=$(dirname "$(find "$tmp/moved" -name 'libmoert.so' | head -1)")
[ -d "$mlib/moert/plugins" ] || fail "no moert/plugins beside the moved libmoert.so ($mlib)"
cc -std=c11 -I"$tmp/moved/include" "$src/examples/embed/embed.c" -o "$tmp/embed-moved" "$mlib/libmoert.so" \
    -Wl,-rpath,"$mlib" -lm || fail "compiling the embedding example against the moved library"
LD_LIBRARY_PATH="$mlib" "$tmp/embed-moved" >"$tmp/embed-moved.log" 2>&1 || { cat "$tmp/embed-moved.log"; fail "the moved install's plugins were not found"; }
grep -qx "embed: ok" "$tmp/embed-moved.log" || { cat "$tmp/embed-moved.log"; fail "examples/embed against the moved install"; }

echo "test_install: all checks passed"
