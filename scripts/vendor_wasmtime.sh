#!/usr/bin/env bash
# vendor/wasmtime is wasmtime 48.0.8 as published on crates.io plus vendor/wasmtime.patch.
# This script proves it (default, or `--check`): it fetches the published crate, checks its
# sha256 against the one crates.io lists, applies the patch and compares the result with
# vendor/wasmtime file by file. `--write` rebuilds vendor/wasmtime that way instead (after
# editing the patch); `--diff` prints the patch that vendor/wasmtime holds now (after
# editing vendor/wasmtime: `bash scripts/vendor_wasmtime.sh --diff > vendor/wasmtime.patch`).
set -euo pipefail
cd "$(dirname "$0")/.."

version=48.0.8
sha256=a2afcadb2e7d0417cb8f3f322c66eff49338b288f22290c0ca0bd3e9570732aa
mode=${1:---check}
case "$mode" in --check | --write | --diff) ;; *)
  echo "usage: $0 [--check | --write | --diff]" >&2
  exit 2
  ;;
esac

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
crate="$work/wasmtime-$version.crate"
# cargo's own download, when this machine has one; crates.io otherwise.
cached=$(ls "${CARGO_HOME:-$HOME/.cargo}"/registry/cache/*/"wasmtime-$version.crate" 2>/dev/null | head -n 1 || true)
if [ -n "$cached" ]; then
  cp "$cached" "$crate"
else
  curl -sSfL --retry 3 -o "$crate" "https://static.crates.io/crates/wasmtime/wasmtime-$version.crate"
fi
echo "$sha256  $crate" | sha256sum --check --quiet - || {
  echo "wasmtime-$version.crate does not have the published sha256" >&2
  exit 1
}
tar xzf "$crate" -C "$work"
pristine="$work/wasmtime-$version"
# What the build does not need (the crate's own tests and lock file, cargo's bookkeeping).
rm -rf "$pristine"/{tests,proptest-regressions,Cargo.lock,Cargo.toml.orig,.cargo_vcs_info.json,.cargo-ok}

if [ "$mode" = --diff ]; then
  (cd "$work" && mv "wasmtime-$version" a && cp -r "$OLDPWD/vendor/wasmtime" b &&
    diff -ruN a b | grep -v '^diff -ruN' | sed -E 's/^(---|\+\+\+) ([^\t]*)\t.*/\1 \2/') || true
  exit 0
fi

(cd "$pristine" && patch -s -p1 <"$OLDPWD/vendor/wasmtime.patch")
if [ "$mode" = --write ]; then
  rm -rf vendor/wasmtime
  cp -r "$pristine" vendor/wasmtime
  echo "vendor/wasmtime rebuilt from wasmtime-$version.crate and vendor/wasmtime.patch"
elif diff -r "$pristine" vendor/wasmtime >"$work/differences"; then
  echo "vendor/wasmtime is wasmtime-$version.crate plus vendor/wasmtime.patch"
else
  cat "$work/differences" >&2
  echo "vendor/wasmtime differs from wasmtime-$version.crate plus vendor/wasmtime.patch" >&2
  exit 1
fi
