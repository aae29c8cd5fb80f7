#!/usr/bin/env bash
# Installs rlhost and its plugins so that it works from any folder, outside this checkout:
# the binary with `cargo install --path host`, and the plugins (plugins/dist/*.wasm, built
# first when missing) where the binary looks for plugins by name: with --root PREFIX, in
# PREFIX/share/rlhost/plugins beside PREFIX/bin/rlhost; else in
# ${XDG_DATA_HOME:-~/.local/share}/rlhost/plugins (the binary goes to ~/.cargo/bin).
# Then the built-in runs find their task plugins, and `--plugin code_trigger.wasm` or
# `rlhost plugin test code_tests.wasm` name a plugin without its path.
#
#   bash scripts/install.sh                    # ~/.cargo/bin/rlhost, ~/.local/share/rlhost/plugins
#   bash scripts/install.sh --root /opt/rlhost # /opt/rlhost/bin/rlhost, /opt/rlhost/share/rlhost/plugins
#   bash scripts/install.sh --cuda             # with the cuda feature (scripts/build_cuda.sh's toolchain)
#   bash scripts/install.sh --root DIR --bin target/release/rlhost
#                                              # an already built binary (packaging, tests)
set -euo pipefail
cd "$(dirname "$0")/.."

root="" cuda=0 bin=""
while [ $# -gt 0 ]; do
    case "$1" in
        --root) root=${2:?--root needs a directory}; shift 2 ;;
        --cuda) cuda=1; shift ;;
        --bin) bin=${2:?--bin needs a file}; shift 2 ;;
        *) echo "install.sh: unknown argument $1 (see the header of scripts/install.sh)" >&2; exit 2 ;;
    esac
done

if [ ! -f plugins/dist/multiply.wasm ]; then
    bash plugins/build.sh
fi

if [ -n "$root" ]; then
    mkdir -p "$root"
    root=$(cd "$root" && pwd)
    plugins="$root/share/rlhost/plugins"
else
    plugins="${XDG_DATA_HOME:-$HOME/.local/share}/rlhost/plugins"
fi

if [ -n "$bin" ]; then
    dest="${root:-${CARGO_HOME:-$HOME/.cargo}}/bin"
    mkdir -p "$dest"
    install -m 755 "$bin" "$dest/rlhost"
    echo "installed $bin as $dest/rlhost"
else
    args=(install --path host --locked --force)
    if [ -n "$root" ]; then args+=(--root "$root"); fi
    if [ "$cuda" = 1 ]; then
        bash scripts/build_cuda.sh "${args[@]}"
    else
        cargo "${args[@]}"
    fi
fi

mkdir -p "$plugins"
for f in plugins/dist/*.wasm; do
    case "$(basename "$f")" in
        # Test components (the host's loading errors, the sandbox's hostile cases, the
        # calculator kept on WIT 0.1.0 to prove old plugins load), not plugins.
        future_version.wasm | not_a_plugin.wasm | hostile.wasm | calculator_v0_1_0.wasm) continue ;;
    esac
    cp -f "$f" "$plugins/"
done
echo "installed $(ls "$plugins" | wc -l) plugins in $plugins"
