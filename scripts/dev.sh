#!/usr/bin/env bash
# Set up a virtual environment (once) and run one job: demo | test | bench [args].
#   bash scripts/dev.sh demo     write and read KV caches, vectors and blobs; show timings
#   bash scripts/dev.sh test     the test suite (what CI runs): .venv/, then tests/lmcache in .venv-lmcache/,
#                                then tests/vllm in .venv-vllm/;
#                                installs redis-server first when missing (root, Debian)
#   bash scripts/dev.sh bench    the benchmarks (installs the optional peers first)
# The first run installs into .venv/ (about a minute); later runs skip pip unless pyproject.toml
# or this script changed (a stamp in .venv/ remembers what was installed).
set -euo pipefail
cd "$(dirname "$0")/.."
job="${1:-test}"
shift || true
PY="${PYTHON:-python3}"
say() { echo "dev.sh: $*" >&2; }
if [ ! -x .venv/bin/python ]; then
  say "creating .venv/ with $("$PY" --version 2>&1)"
  "$PY" -m venv .venv
fi
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
stamp=.venv/.tierstore-installed
want="$(cat pyproject.toml scripts/dev.sh | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  say "installing tierstore (editable) with numpy, lmdb, msgpack, crc32c, zstandard, tqdm, torch 2.13.0 (CPU)"
  say "and the test tools into .venv/ -- about a minute the first time"
  # torch is pinned: 2.13.0 is the CPU build this machine has on disk (a bare `torch` would pull a
  # multi-GB CUDA build).  tierstore itself only needs torch>=2.1, as an optional extra.
  "${pip[@]}" "torch==2.13.0" -e ".[dev]"
  echo "$want" > "$stamp"
  say "installed"
fi
# the remote tier's tests start real servers: redis-server and redis-cli (Debian package redis-server)
need_redis() {
  command -v redis-server >/dev/null && command -v redis-cli >/dev/null && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing redis-server (Debian package) for the remote tier's tests"
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
  else
    say "redis-server is missing: install it (apt-get install redis-server); the remote tier's tests need it"
  fi
}
case "$job" in
  demo) exec .venv/bin/tierstore demo "$@" ;;
  test)
    need_redis
    if [ $# -gt 0 ]; then exec .venv/bin/python -m pytest -q "$@"; fi
    .venv/bin/python -m pytest -q
    # the LMCache plugin's tests, in LMCache's own environment (built once by scripts/lmcache_env.sh)
    bash scripts/lmcache_env.sh
    .venv-lmcache/bin/python -m pytest -q -p no:cacheprovider tests/lmcache
    # the vLLM connector's tests, in vLLM's own environment (built once by scripts/vllm_env.sh)
    bash scripts/vllm_env.sh 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; } >&2
    exec .venv-vllm/bin/python -m pytest -q -p no:cacheprovider tests/vllm ;;
  bench)
    if [ ! -f .venv/.tierstore-bench ]; then
      say "installing the benchmark peers (safetensors, h5py, matplotlib)"
      "${pip[@]}" -e ".[bench]" && touch .venv/.tierstore-bench
    fi
    exec .venv/bin/tierstore bench "$@" ;;
  *) echo "usage: bash scripts/dev.sh demo|test|bench [args]" >&2; exit 2 ;;
esac
