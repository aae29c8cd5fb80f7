#!/usr/bin/env bash
# The official Tinker SDK (and its cookbook), for the tests of `rlhost serve --tinker`
# (issue 49).
#
#   bash scripts/tinker.sh install          # the tinker SDK in its own venv
#   bash scripts/tinker.sh python           # prints that venv's python
#   bash scripts/tinker.sh cookbook         # tinker-cookbook (and torch) in another venv
#   bash scripts/tinker.sh cookbook-python  # prints that venv's python
#
# The SDK's venv lives in $RLHOST_TINKER_VENV (default ~/.cache/rlhost/tinker-venv), the
# cookbook's in $RLHOST_COOKBOOK_VENV (default ~/.cache/rlhost/cookbook-venv), each made once.
# tinker brings transformers (for get_tokenizer), numpy and its HTTP stacks; nothing here
# downloads a model: the tokenizer comes from the served model's own directory.
set -euo pipefail

VENV="${RLHOST_TINKER_VENV:-$HOME/.cache/rlhost/tinker-venv}"
# jinja2 renders the served model's chat template in the tests (transformers' apply_chat_template).
PINS=(tinker==0.38.0 jinja2==3.1.6)
READY='import tinker, transformers, jinja2; assert tinker.__version__ == "0.38.0", tinker.__version__'

COOKBOOK_VENV="${RLHOST_COOKBOOK_VENV:-$HOME/.cache/rlhost/cookbook-venv}"
# tinker-cookbook 0.6.1 requires tml-renderers>=0.4.1, which the registry does not have
# (0.2.1 is its newest): it is overridden to 0.2.1, which only the cookbook's renderers for
# Thinking Machines' own models use. torch is pinned to scripts/vllm.sh's build, so that uv's
# cache serves both venvs from one download. [math-rl] brings what recipes/rl_basic imports.
COOKBOOK_PINS=("tinker-cookbook[math-rl]==0.6.1" tinker==0.38.0 transformers==5.19.0 jinja2==3.1.6)
COOKBOOK_OVERRIDES='tml-renderers==0.2.1
torch==2.13.0'
COOKBOOK_READY='import tinker_cookbook.recipes.sl_basic, tinker_cookbook.recipes.rl_basic, transformers, jinja2'

die() { echo "scripts/tinker.sh: $*" >&2; exit 1; }

# venv NAME DIR READY OVERRIDES PIN...: makes DIR once (uv, from the registry) with PINS,
# OVERRIDES (newline-separated, may be empty) forced over what they require; READY is the
# Python that says it is usable.
venv() {
    local name=$1 dir=$2 ready=$3 overrides=$4
    shift 4
    if [ -x "$dir/bin/python" ] && "$dir/bin/python" -c "$ready" 2>/dev/null; then
        echo "$name already installed in $dir"
        return
    fi
    command -v uv >/dev/null || python3 -m pip install --quiet --disable-pip-version-check uv
    mkdir -p "$(dirname "$dir")"
    [ -x "$dir/bin/python" ] || uv venv --quiet --python python3 "$dir"
    local file
    file=$(mktemp)
    printf '%s\n' "$overrides" > "$file"
    VIRTUAL_ENV="$dir" uv pip install --quiet "$@" --override "$file"
    rm -f "$file"
    "$dir/bin/python" -c "$ready; print('$name ready')"
}

case "${1:-}" in
    install) venv tinker "$VENV" "$READY" "" "${PINS[@]}" ;;
    python) echo "$VENV/bin/python" ;;
    cookbook) venv tinker-cookbook "$COOKBOOK_VENV" "$COOKBOOK_READY" "$COOKBOOK_OVERRIDES" "${COOKBOOK_PINS[@]}" ;;
    cookbook-python) echo "$COOKBOOK_VENV/bin/python" ;;
    *) die "usage: install | python | cookbook | cookbook-python" ;;
esac
