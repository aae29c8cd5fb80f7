#!/usr/bin/env bash
# vendor/CRATE is CRATE as published on crates.io plus vendor/CRATE.patch, for each crate
# the workspace patches (`[patch.crates-io]` in Cargo.toml; vendor/README.md says why).
# This script proves it (default, or `--check`): it fetches each published crate, checks
# its sha256 against the one crates.io lists, applies the patch and compares the result
# with vendor/CRATE file by file. `--write CRATE` rebuilds vendor/CRATE that way instead
# (after editing the patch); `--diff CRATE` prints the patch that vendor/CRATE holds now
# (after editing vendor/CRATE: `bash scripts/vendor.sh --diff wasmtime > vendor/wasmtime.patch`).
set -euo pipefail
cd "$(dirname "$0")/.."

# crate, version, the published .crate's sha256.
CRATES=(
  "wasmtime 48.0.8 a2afcadb2e7d0417cb8f3f322c66eff49338b288f22290c0ca0bd3e9570732aa"
  "candle-core 0.11.1 d11c8be87cfbaef9ebb62fb3f850d1fc8e00cc1d11d393fdbe55a4d5c2cdb325"
)
mode=${1:---check}
only=${2:-}
case "$mode" in --check) ;; --write | --diff) [ -n "$only" ] || { echo "usage: $0 $mode CRATE" >&2; exit 2; } ;; *)
  echo "usage: $0 [--check | --write CRATE | --diff CRATE]" >&2
  exit 2
  ;;
esac

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
status=0
for entry in "${CRATES[@]}"; do
  read -r name version sha256 <<<"$entry"
  [ -z "$only" ] || [ "$only" = "$name" ] || continue
  crate="$work/$name-$version.crate"
  # cargo's own download, when this machine has one; crates.io otherwise.
  cached=$(ls "${CARGO_HOME:-$HOME/.cargo}"/registry/cache/*/"$name-$version.crate" 2>/dev/null | head -n 1 || true)
  if [ -n "$cached" ]; then
    cp "$cached" "$crate"
  else
    curl -sSfL --retry 3 -o "$crate" "https://static.crates.io/crates/$name/$name-$version.crate"
  fi
  echo "$sha256  $crate" | sha256sum --check --quiet - || {
    echo "$name-$version.crate does not have the published sha256" >&2
    exit 1
  }
  tar xzf "$crate" -C "$work"
  pristine="$work/$name-$version"
  # What the build does not need (the crate's own tests, benchmarks, examples and lock
  # file, cargo's bookkeeping).
  rm -rf "$pristine"/{tests,benches,examples,proptest-regressions,Cargo.lock,Cargo.toml.orig,.cargo_vcs_info.json,.cargo-ok}

  if [ "$mode" = --diff ]; then
    (cd "$work" && mv "$name-$version" a && cp -r "$OLDPWD/vendor/$name" b &&
      diff -ruN a b | grep -v '^diff -ruN' | sed -E 's/^(---|\+\+\+) ([^\t]*)\t.*/\1 \2/') || true
    continue
  fi

  (cd "$pristine" && patch -s -p1 <"$OLDPWD/vendor/$name.patch")
  if [ "$mode" = --write ]; then
    rm -rf "vendor/$name"
    cp -r "$pristine" "vendor/$name"
    echo "vendor/$name rebuilt from $name-$version.crate and vendor/$name.patch"
  elif diff -r "$pristine" "vendor/$name" >"$work/differences"; then
    echo "vendor/$name is $name-$version.crate plus vendor/$name.patch"
  else
    cat "$work/differences" >&2
    echo "vendor/$name differs from $name-$version.crate plus vendor/$name.patch" >&2
    status=1
  fi
done
exit $status
