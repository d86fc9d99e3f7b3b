#!/usr/bin/env bash
# Build LMCache's own environment (.venv-lmcache/) once, for the LMCache plugin's tests
# (tests/lmcache) and benchmark: LMCache 0.5.6 pins numpy <= 2.2.6 and pulls CUDA Python packages,
# so it cannot share .venv/.  torch is pinned to the CPU build first, so that LMCache's bare
# `torch` requirement does not pull a multi-GB CUDA build.  Reused while this script and
# pyproject.toml are unchanged (a stamp remembers what was installed); about 5 minutes the first time.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VENV=.venv-lmcache
stamp="$VENV/.tierstore-installed"
want="$(cat pyproject.toml scripts/lmcache_env.sh | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi
echo "lmcache_env.sh: building $VENV (torch 2.13.0 CPU, lmcache 0.5.6, tierstore editable)" >&2
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" "torch==2.13.0"
"${pip[@]}" "lmcache==0.5.6" "torch==2.13.0"
"${pip[@]}" -e . pytest "torch==2.13.0"
echo "$want" > "$stamp"
echo "lmcache_env.sh: built" >&2
