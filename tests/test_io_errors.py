"""I/O errors: for each API operation, fail its n-th call of each I/O method (EIO, ENOSPC,
EINTR, a short write), once and persistently, for n = 1, 2, ... until the operation completes
before reaching the fault.  Every time: the call returns or raises a TierstoreError (never
another exception), nothing acknowledged before it is lost, and the store, reopened, is
consistent (fsck clean); the operation itself is all there or not there at all.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

import tierstore
from tierstore import Blob, KVCache

from .conftest import checked_state, crash
from .faultfs import FaultFS

METHODS = ["pwritev", "fdatasync", "fsync", "fsync_dir", "open", "ftruncate", "preadv", "pread", "unlink", "rename"]
KINDS = ["EIO", "ENOSPC", "EINTR", "short"]
BIG = bytes(range(256)) * (18 << 10)  # 4.5 MiB: the O_DIRECT write path


def _base(root: str) -> dict[str, bytes]:
    kv = np.arange(2 * 2 * 2 * 8 * 16, dtype=np.float16).reshape(2, 2, 2, 8, 16)
    model = {"a": b"alpha" * 50, "b": b"beta" * 3000}
    with tierstore.open(root, segment_bytes="64KiB") as s:
        for k, v in model.items():
            s.put(k, Blob(v))
        s.put("kv", KVCache(kv))
        s.put("junk", Blob(b"j" * 30000))
        s.delete("junk")
    model["kv"] = kv.tobytes()
    return model


def _torn(root: str, model: dict[str, bytes]) -> dict[str, bytes]:
    """A copy of the base whose last puts never reached the index and whose log ends in a torn
    record: opening it replays and cuts (the "recover" case)."""
    s = tierstore.open(root, index_commit_ms=1e9, index_batch=10**9)
    s.put("t1", Blob(b"t1" * 900))
    s.put("t2", Blob(b"t2" * 5))
    crash(s)  # a crash: the index never saw t1, t2
    seg = sorted(Path(root, "segments").iterdir())[-1]
    with open(seg, "ab") as f:
        f.write(b"\xd4TRC" + os.urandom(3000))  # a torn record after them
    return {**model, "t1": b"t1" * 900, "t2": b"t2" * 5}


WRITES = ("put", "overwrite", "put_big", "delete", "group_flush")
OPS = {
    # name: (run, expected effect on the model, durability)
    "put": (lambda s: s.put("c", Blob(b"gamma" * 700)), lambda m: m.update(c=b"gamma" * 700), "sync"),
    "overwrite": (lambda s: s.put("a", Blob(b"new-a" * 9)), lambda m: m.update(a=b"new-a" * 9), "sync"),
    "put_big": (lambda s: s.put("big", Blob(BIG)), lambda m: m.update(big=BIG), "sync"),
    "delete": (lambda s: s.delete("b"), lambda m: m.pop("b"), "sync"),
    "group_flush": (lambda s: (s.put("c", Blob(b"g" * 5000)), s.flush()), lambda m: m.update(c=b"g" * 5000), "group"),
    "compact": (lambda s: s.compact(), lambda m: None, "sync"),
    "get": (lambda s: s.get("kv"), lambda m: None, "sync"),
    "recover": (None, lambda m: None, "sync"),  # opening the torn template is the operation
}


def _run_case(work: Path, template: str, model: dict, op: str, method: str, n: int, kind: str,
              persistent: bool) -> bool:
    """One faulty run; returns whether the fault was reached."""
    root = str(work / "store")
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(template, root)
    fs = FaultFS(root)
    run, effect, durability = OPS[op]
    store = None
    if run is not None:
        store = tierstore.open(root, _io=fs, durability=durability, segment_bytes="64KiB")
    fs.fail_at(method, n, kind, persistent)
    error = None
    try:
        if run is None:
            store = tierstore.open(root, _io=fs, segment_bytes="64KiB")
        else:
            run(store)
        ok = True
    except tierstore.TierstoreError as e:
        ok, error = False, e
    reached = fs.fired > 0
    where = (op, method, n, kind, persistent)
    if not ok and op in WRITES and store is not None and not store.closed and getattr(error, "taken_back", None):
        # taken back: the handle no longer shows the failed write
        fs.clear_faults()  # no more faults while we look
        seen = {k: store.get(k).data for k in store.keys()}
        want_seen = {k: (v if isinstance(v, bytes) else v) for k, v in model.items()}
        assert set(seen) == set(want_seen), where
    try:
        if store is not None:
            store.close()
    except tierstore.TierstoreError:
        crash(store)
    after = checked_state(root)  # reopened with the real file system
    want = dict(model)
    effect(want)
    if ok:
        assert after == want, where  # acknowledged: durable
    elif op in WRITES and getattr(error, "taken_back", None) is not False:
        assert after == model, where  # a failed write is not there afterwards ...
    else:
        assert after in (model, want), where  # ... unless its error says it may be (never torn)
    return reached


@pytest.fixture(scope="module")
def templates():
    d = Path(tempfile.mkdtemp(prefix="tierstore-ioerr-"))
    model = _base(str(d / "template"))
    shutil.copytree(d / "template", d / "torn")
    torn_model = _torn(str(d / "torn"), model)
    yield {"base": (str(d / "template"), model), "torn": (str(d / "torn"), torn_model)}
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("op", sorted(OPS))
def test_io_errors(op, templates, tmp_path, capsys):
    tpl, model = templates["torn" if op == "recover" else "base"]
    # cases are many small stores opened twice each: keep them in memory where possible (tmpfs
    # has no O_DIRECT, so put_big stays on disk to cover that write path)
    work = tmp_path if op == "put_big" or not os.access("/dev/shm", os.W_OK) else \
        Path(tempfile.mkdtemp(prefix="tierstore-ioerr-", dir="/dev/shm"))
    cases = 0
    for method in METHODS:
        for kind in KINDS:
            for persistent in (False, True):
                for n in range(1, 200):
                    cases += 1
                    if not _run_case(work, tpl, model, op, method, n, kind, persistent):
                        break  # the operation finished before the n-th call: every position was covered
    if work != tmp_path:
        shutil.rmtree(work, ignore_errors=True)
    with capsys.disabled():
        print(f"\nI/O error cases for {op}: {cases}")
    assert cases > len(METHODS) * len(KINDS) * 2


def test_fsync_eio_poisons_and_reopen_recovers(tmp_path):
    root = str(tmp_path / "s")
    with tierstore.open(root) as s:
        s.put("a", Blob(b"1"))
    fs = FaultFS(root)
    s = tierstore.open(root, _io=fs)
    fs.fail_at("fdatasync", 1, "EIO")
    with pytest.raises(tierstore.StoreIOError) as ei:
        s.put("b", Blob(b"2"))
    assert ei.value.poisoned
    with pytest.raises(tierstore.StoreIOError):
        s.put("c", Blob(b"3"))  # no retry on a poisoned handle, even though fsync would now succeed
    crash(s)
    with tierstore.open(root) as s:
        assert s.get("a").data == b"1" and not s.contains("c")
