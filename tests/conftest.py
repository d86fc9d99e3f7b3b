"""Shared fixtures: store paths, real activations from tests/data, torch availability."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

import numpy as np
import pytest

DATA = Path(__file__).parent / "data"

try:
    import torch  # noqa: F401

    HAS_TORCH = True
except ImportError:  # torch is an optional extra
    HAS_TORCH = False

needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch not installed (optional extra)")


@pytest.fixture
def store_path(tmp_path: Path) -> str:
    return str(tmp_path / "store")


@pytest.fixture(scope="session")
def real_kv() -> np.ndarray:
    """Real K/V of all-MiniLM-L6-v2: [layers=6, 2, heads=12, tokens=128, head_dim=32] fp16."""
    return np.load(DATA / "minilm_qkv_128tok.npz")["kv"]


@pytest.fixture(scope="session")
def real_emb() -> np.ndarray:
    """1024 real MiniLM sentence embeddings [1024, 384] fp16."""
    return np.load(DATA / "minilm_embeddings_1k_fp16.npy")


def segment_files(path: str) -> list[str]:
    seg = os.path.join(path, "segments")
    return sorted(os.path.join(seg, n) for n in os.listdir(seg) if n.endswith(".tseg"))


def checked_state(path: str, *, deep: bool = True) -> dict:
    """Open the store at ``path``: every object's bytes by key (default namespace), after
    asserting that fsck finds nothing wrong."""
    import tierstore
    from tierstore import Blob
    from tierstore.engine import repair
    from tierstore.engine.fileio import DEFAULT_IO

    with tierstore.open(path) as s:
        state = {}
        for k in s.keys():
            obj = s.get(k)
            state[k] = obj.data if isinstance(obj, Blob) else obj.data.tobytes()
        report = repair.check_store(DEFAULT_IO, path, s._engine.index, deep=deep)
        assert report.ok, report.as_dict()
    return state


def crash(store) -> None:
    """Abandon a handle like a killed process would: no flush, no index commit."""
    store._closed = True
    store._finalizer.detach()
    store._tiers.close()
    store._engine.closed = True
    store._engine._teardown()


def run_threads(target, n: int) -> None:
    """Run ``target(i)`` on ``n`` threads and re-raise the first exception any of them raised."""
    import threading

    errors: list[BaseException] = []

    def wrapped(i: int) -> None:
        try:
            target(i)
        except BaseException as e:  # collected and re-raised in the calling thread
            errors.append(e)

    threads = [threading.Thread(target=wrapped, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def open_files(prefix: str) -> list[str]:
    """The files this process holds open whose path starts with ``prefix`` (from /proc/self/fd;
    a deleted one ends in " (deleted)")."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(prefix):
            out.append(target)
    return out


@contextlib.contextmanager
def promotions_held(store):
    """In the block, every promotion of ``store``'s tier threads waits inside its thread (a
    ``prefetch``'s Future is then running) until ``hold`` is set, at the latest when the block
    ends.  Yields ``(inside, hold)``: ``inside`` is set once a promotion waits."""
    inside, hold = threading.Event(), threading.Event()
    real = store._tiers.promote

    def slow(*args, **kwargs):
        inside.set()
        hold.wait(30)
        return real(*args, **kwargs)

    store._tiers.promote = slow
    try:
        yield inside, hold
    finally:
        hold.set()
        store._tiers.promote = real
