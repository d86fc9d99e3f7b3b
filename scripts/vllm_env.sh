#!/usr/bin/env bash
# Build vLLM's own environment (.venv-vllm/) once, for the vLLM connector's tests (tests/vllm):
# vllm 0.33.0 brings its own CUDA build of torch (about 9.4 GB installed), so it cannot share
# .venv/ (torch 2.13.0 CPU).  Its KV connector base, scheduler request and config classes import
# without a GPU; the tests run the connector's scheduler side and its gather/scatter over paged
# tensors on CPU.  Reused while this script and pyproject.toml are unchanged (a stamp remembers
# what was installed); about 6 minutes the first time.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VENV=.venv-vllm
stamp="$VENV/.tierstore-installed"
want="$(cat pyproject.toml scripts/vllm_env.sh | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi
echo "vllm_env.sh: building $VENV (vllm 0.33.0 with its own torch, tierstore editable)" >&2
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" "vllm==0.33.0"
"${pip[@]}" -e . pytest
echo "$want" > "$stamp"
echo "vllm_env.sh: built" >&2
