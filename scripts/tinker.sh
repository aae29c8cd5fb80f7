#!/usr/bin/env bash
# The official Tinker SDK (and its cookbook), for the tests of `rlhost serve --tinker`
# (issue 49).
#
#   bash scripts/tinker.sh install     # tinker and tinker-cookbook in their own venv
#   bash scripts/tinker.sh python      # prints the venv's python
#
# The venv lives in $RLHOST_TINKER_VENV (default ~/.cache/rlhost/tinker-venv), made once.
# tinker brings transformers (for get_tokenizer), numpy and its HTTP stacks; nothing here
# downloads a model: the tokenizer comes from the served model's own directory.
set -euo pipefail

VENV="${RLHOST_TINKER_VENV:-$HOME/.cache/rlhost/tinker-venv}"
# jinja2 renders the served model's chat template in the tests (transformers' apply_chat_template).
PINS=(tinker==0.38.0 jinja2==3.1.6)
READY='import tinker, transformers, jinja2; assert tinker.__version__ == "0.38.0", tinker.__version__'

die() { echo "scripts/tinker.sh: $*" >&2; exit 1; }

install() {
    if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "$READY" 2>/dev/null; then
        echo "tinker already installed in $VENV"
        return
    fi
    command -v uv >/dev/null || python3 -m pip install --quiet --disable-pip-version-check uv
    mkdir -p "$(dirname "$VENV")"
    [ -x "$VENV/bin/python" ] || uv venv --quiet --python python3 "$VENV"
    VIRTUAL_ENV="$VENV" uv pip install --quiet "${PINS[@]}"
    "$VENV/bin/python" -c "$READY; print('tinker', tinker.__version__, 'ready')"
}

case "${1:-}" in
    install) install ;;
    python) echo "$VENV/bin/python" ;;
    *) die "usage: install | python" ;;
esac
