#!/usr/bin/env bash
# OpenEnv's own Python client and server, for the tests of `rlhost env serve` and of
# training against OpenEnv servers (issue 47).
#
#   bash scripts/openenv.sh install     # openenv-core in its own venv (~200 MB)
#   bash scripts/openenv.sh python      # prints the venv's python
#
# The venv lives in $RLHOST_OPENENV_VENV (default ~/.cache/rlhost/openenv-venv), made once.
# openenv-core 0.3.0's full install is 474 MB (gradio, pandas, numpy for its web UI and
# providers); the tests need none of them: the package without its dependencies, then what
# `from openenv import GenericEnvClient` imports (its env_server package imports fastapi
# and fastmcp; the container providers requests), uvicorn to serve environments as the
# template's server/app.py does, and what the `openenv` CLI imports for `openenv init`
# (typer, huggingface_hub, openai, pyyaml).
set -euo pipefail

VENV="${RLHOST_OPENENV_VENV:-$HOME/.cache/rlhost/openenv-venv}"
OPENENV_CORE=0.3.0
PINS=(websockets==17.4 pydantic==2.14.4 typing_extensions==4.16.0 fastapi==0.165.0
      fastmcp==4.2.3 requests==2.34.2 uvicorn==0.54.0 typer==0.29.2 huggingface_hub==2.4.0
      openai==3.57.0 pyyaml==6.0.4)
READY='from openenv import GenericEnvClient; import uvicorn, openenv.cli.__main__'

die() { echo "scripts/openenv.sh: $*" >&2; exit 1; }

install() {
    if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "$READY" 2>/dev/null; then
        echo "openenv-core already installed in $VENV"
        return
    fi
    command -v uv >/dev/null || python3 -m pip install --quiet --disable-pip-version-check uv
    mkdir -p "$(dirname "$VENV")"
    [ -x "$VENV/bin/python" ] || uv venv --quiet --python python3 "$VENV"
    VIRTUAL_ENV="$VENV" uv pip install --quiet --no-deps "openenv-core==$OPENENV_CORE"
    VIRTUAL_ENV="$VENV" uv pip install --quiet "${PINS[@]}"
    "$VENV/bin/python" -c "$READY; print('openenv-core client, server and CLI ready')"
}

case "${1:-}" in
    install) install ;;
    python) echo "$VENV/bin/python" ;;
    *) die "usage: install | python" ;;
esac
