#!/usr/bin/env bash
# Set up a virtual environment (once) and run one job: demo | test | bench [args].
#   bash scripts/dev.sh demo     write and read KV caches, vectors and blobs; show timings
#   bash scripts/dev.sh test     the test suite (what CI runs)
#   bash scripts/dev.sh bench    the benchmarks (installs the optional peers first)
set -euo pipefail
cd "$(dirname "$0")/.."
job="${1:-test}"
shift || true
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
# torch is pinned: 2.13.0 is the CPU build this machine has on disk (a bare `torch` would pull a
# multi-GB CUDA build).  tierstore itself only needs torch>=2.1, as an optional extra.
"${pip[@]}" "torch==2.13.0" -e ".[dev]"
case "$job" in
  demo) exec .venv/bin/tierstore demo "$@" ;;
  test) exec .venv/bin/python -m pytest -q "$@" ;;
  bench)
    "${pip[@]}" -e ".[bench]"
    exec .venv/bin/tierstore bench "$@" ;;
  *) echo "usage: bash scripts/dev.sh demo|test|bench [args]" >&2; exit 2 ;;
esac
