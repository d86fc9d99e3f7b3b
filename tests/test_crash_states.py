"""Power loss, simulated: every workload of up to 2 operations (3 with TIERSTORE_DEEP=1) over
puts, overwrites, deletes, flushes and compactions, crashed at every persistence point into
states A, B, C and D of tests/faultfs.py, each checked against the oracle:

- the store opens;
- every acknowledged operation is present and bit-exact, no acknowledged delete reappears,
  nothing never written is visible: the state equals the model after m operations, for some
  m between the number acknowledged and the number issued;
- fsck is clean after recovery;
- recovering twice gives the same state;
- an index rebuilt from the segments alone gives the same state.

The figures (workloads, persistence points, crash states, violations) are printed with -s and
recorded in docs/reliability.md.
"""

from __future__ import annotations

import itertools
import os
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

import tierstore
from tierstore import Blob, KVCache
from tierstore.engine import compaction, repair
from tierstore.engine.fileio import DEFAULT_IO
from tierstore.engine.index import Index

from .conftest import checked_state
from .faultfs import FaultFS

DEEP = os.environ.get("TIERSTORE_DEEP") == "1"
OPS = ["put_new", "overwrite", "delete", "compact", "flush"]
MODES = [("A", 0), ("B", 0), ("C", 1), ("C", 2), ("D", 1), ("D", 2)]


def _value(step: int) -> bytes:
    return bytes([step % 251 + 1]) * (300 + 997 * step)


def _apply(model: dict, op: str, step: int) -> None:
    if op == "put_new":
        model[f"n{step}"] = _value(step)
    elif op == "overwrite":
        model["k0"] = _value(step)
    elif op == "delete":
        model.pop("k1", None)


def _base(tmp: Path, segment_bytes: str) -> tuple[str, dict]:
    """A durable store that existed before the workload: two blobs and a KV chunk."""
    root = str(tmp / "template")
    kv = np.arange(2 * 2 * 2 * 8 * 16, dtype=np.float16).reshape(2, 2, 2, 8, 16)
    with tierstore.open(root, segment_bytes=segment_bytes) as s:
        s.put("k0", Blob(b"zero" * 100))
        s.put("k1", Blob(b"one" * 3000))
        s.put("kv", KVCache(kv))
        s.put("junk", Blob(b"j" * 20000))
        s.delete("junk")  # garbage for compaction to reclaim
    return root, {"k0": b"zero" * 100, "k1": b"one" * 3000, "kv": kv.tobytes()}


class Explorer:
    def __init__(self, tmp: Path, segment_bytes: str) -> None:
        self.tmp = tmp
        self.template, self.base = _base(tmp, segment_bytes)
        self.segment_bytes = segment_bytes
        self.stats = {"workloads": 0, "points": 0, "states": 0}
        self.images: list[tuple[str, tuple[str, ...], int, int]] = []

    def run(self, ops: tuple[str, ...]) -> None:
        self.stats["workloads"] += 1
        wdir = self.tmp / f"w{self.stats['workloads']}"
        root = str(wdir / "root")
        shutil.copytree(self.template, root)
        fs = FaultFS(root)
        progress = {"acked": 0, "issued": 0}
        store = tierstore.open(root, _io=fs, segment_bytes=self.segment_bytes, index_commit_ms=1e9, index_batch=10**9)
        snap_dir = str(wdir / "snap")
        prev_dir = str(wdir / "prev")  # the index as of the commit before the last one
        rng = random.Random(hash(ops) & 0xFFFF)
        real_write = Index._write

        def write(index: Index, fn, *, durable: bool = False):
            """LMDB commits: keep the state before each non-durable one, which a power loss
            may undo (metasync=False); a durable commit cannot be undone."""
            if not index.path.endswith("index"):
                return real_write(index, fn, durable=durable)
            shutil.rmtree(prev_dir, ignore_errors=True)
            if not durable:
                os.makedirs(prev_dir)
                index.env.copy(prev_dir)
            return real_write(index, fn, durable=durable)

        Index._write = write

        def persist(what: str) -> None:
            if store._engine.index is None or store._engine.index.closed:
                return
            self.stats["points"] += 1
            point = self.stats["points"]
            shutil.rmtree(snap_dir, ignore_errors=True)
            os.makedirs(snap_dir)
            store._engine.index.env.copy(snap_dir)  # the index as last committed
            if os.path.isdir(prev_dir):  # metasync=False: a power loss may undo the last commit
                dest = str(wdir / f"p{point}previndex")
                fs.crash_state(dest, "A", rng, prev_dir)
                self.images.append((dest, ops, progress["acked"], progress["issued"]))
                self.stats["states"] += 1
            for mode, seed in MODES:
                dest = str(wdir / f"p{point}{mode}{seed}")
                fs.crash_state(dest, mode, random.Random(rng.random() + seed), snap_dir)
                self.images.append((dest, ops, progress["acked"], progress["issued"]))
                self.stats["states"] += 1
            # and the index lost entirely: rebuilt from what survived
            dest = str(wdir / f"p{point}noindex")
            fs.crash_state(dest, "A", rng, None)
            self.images.append((dest, ops, progress["acked"], progress["issued"]))
            self.stats["states"] += 1

        fs.on_persist = persist
        try:
            for step, op in enumerate(ops, start=1):
                progress["issued"] = step
                self.do(store, op, step)
                progress["acked"] = step
        finally:
            fs.on_persist = None
            Index._write = real_write
            store.close()

    def do(self, store: tierstore.Store, op: str, step: int) -> None:
        if op in ("put_new", "overwrite"):
            store.put(f"n{step}" if op == "put_new" else "k0", Blob(_value(step)))
        elif op == "delete":
            store.delete("k1")
        elif op == "compact":
            store.compact()
        else:
            store.flush()

    def models(self, ops: tuple[str, ...]) -> list:
        out = []
        model = dict(self.base)
        for m in range(len(ops) + 1):
            if m:
                _apply(model, ops[m - 1], m)
            out.append(dict(model))
        return out

    def state(self, image: str) -> object:
        return checked_state(image, deep=False)

    def explore(self, ops: list[str], lengths: tuple[int, ...] = (1, 2)) -> None:
        """Run every workload of ``ops`` of these lengths and check each crash state as it
        comes (bounded space)."""
        for w in [w for n in lengths for w in itertools.product(ops, repeat=n)]:
            self.run(w)
            for image, done, acked, issued in self.images:
                self.check(image, done, acked, issued)
                shutil.rmtree(image)
            self.images.clear()
            shutil.rmtree(self.tmp / f"w{self.stats['workloads']}")

    def check(self, image: str, ops: tuple[str, ...], acked: int, issued: int) -> None:
        state = self.state(image)
        models = self.models(ops)
        ok = [m for m in range(acked, issued + 1) if models[m] == state]
        assert ok, f"{image}: state {state} is not the model after {acked}..{issued} of {ops}"
        assert self.state(image) == state  # recovering twice gives the same state
        shutil.rmtree(os.path.join(image, "index"))
        assert self.state(image) == state  # the index rebuilt from segments agrees


# -- sessions: objects and their references change atomically (groups, SPEC.md §7.7) ------------

SESSION_OPS = ["put_a", "put_b2", "put_plain", "drop_a", "delete_c", "compact"]
ANCHOR = "(anchor)"
# objects larger than the log's write buffer, ending on a page boundary: an object and its
# reference reach the file in separate writes unless they are one group, and even in one write
# a crash can keep one page and not the next (state D), so the harness catches an engine that
# does not write groups or a recovery that applies part of one
C1, C2 = b"\x01" * (17 * 4096), b"\x02" * (22 * 4096)


def _session_apply(model: tuple[dict, dict], op: str) -> None:
    """The reference semantics of SPEC.md §5.4, on (objects, key -> set of sessions)."""
    objs, refs = model
    if op.startswith("put"):
        sess = {"put_a": "a", "put_b2": "b", "put_plain": None}[op]
        existed = "c" in objs
        objs["c"] = C2 if op == "put_b2" else C1
        r = refs.setdefault("c", set())
        if sess is None:
            if r:
                r.add(ANCHOR)
        else:
            if existed and not r:
                r.add(ANCHOR)
            r.add(sess)
        if not r:
            del refs["c"]
    elif op == "drop_a":
        for k in [k for k, r in refs.items() if "a" in r]:
            refs[k].discard("a")
            if not refs[k]:
                del refs[k], objs[k]
    elif op == "delete_c":
        objs.pop("c", None)
        refs.pop("c", None)


class SessionExplorer(Explorer):
    """The same crash states over session puts (dedup and overwrite), drops and deletes; the
    oracle also compares every object's set of references."""

    def __init__(self, tmp: Path, segment_bytes: str) -> None:
        super().__init__(tmp, segment_bytes)
        with tierstore.open(self.template) as s:  # a chunk two sessions share
            s.put("s", Blob(b"shared" * 50), session="a")
            s.put("s", Blob(b"shared" * 50), session="b")
        self.base_refs = {"s": {"a", "b"}}
        self.base = dict(self.base, s=b"shared" * 50)

    def do(self, store: tierstore.Store, op: str, step: int) -> None:
        if op.startswith("put"):
            sess = {"put_a": "a", "put_b2": "b", "put_plain": None}[op]
            store.put("c", Blob(C2 if op == "put_b2" else C1), session=sess)
        elif op == "drop_a":
            store.drop_session("a")
        elif op == "delete_c":
            store.delete("c")
        else:
            store.compact()

    def models(self, ops: tuple[str, ...]) -> list:
        model: tuple[dict, dict] = (dict(self.base), {k: set(v) for k, v in self.base_refs.items()})
        out = [(dict(model[0]), {k: frozenset(v) for k, v in model[1].items()})]
        for op in ops:
            _session_apply(model, op)
            out.append((dict(model[0]), {k: frozenset(v) for k, v in model[1].items()}))
        return out

    def state(self, image: str) -> object:
        objs = checked_state(image, deep=False)
        with tierstore.open(image, readonly=True) as s:
            refs = {}
            for k in objs:
                r = {ANCHOR if x == b"\x00" else x.decode() for x in s._engine.sessions_of(b"default", k.encode())}
                if r:
                    refs[k] = frozenset(r)
            assert s._engine.index.ref_count() == sum(len(r) for r in refs.values()), "a reference outlived its object"
            for sess in ("a", "b"):
                assert set(s.session_keys(sess)) == {k for k, r in refs.items() if sess in r}
        return objs, refs


def test_power_loss_states_with_sessions(fast_tmp, capsys):
    ex = SessionExplorer(fast_tmp, "16KiB")
    ex.explore(SESSION_OPS)
    with capsys.disabled():
        print(f"\ncrash states (sessions): {ex.stats}")
    assert ex.stats["states"] >= 1000


def workloads(max_len: int) -> list[tuple[str, ...]]:
    return [w for n in range(1, max_len + 1) for w in itertools.product(OPS, repeat=n)]


@pytest.fixture
def fast_tmp(tmp_path):
    """Crash images are many small stores opened several times each: keep them in memory
    (tmpfs) when the machine has one; the engine falls back to buffered I/O there."""
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tmp_path
    d = Path(tempfile.mkdtemp(prefix="tierstore-crash-", dir=base))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_power_loss_states(fast_tmp, capsys, monkeypatch):
    monkeypatch.setattr(compaction, "BATCH_SEGMENTS", 1)  # each victim its own batch: cover batch boundaries
    per_compaction: list[int] = []  # how many batches each compaction ran
    real_batch = compaction.compact_batch

    def counted_batch(*a, **kw):
        per_compaction[-1] += 1
        return real_batch(*a, **kw)

    real_compact = compaction.compact
    monkeypatch.setattr(compaction, "compact_batch", counted_batch)
    monkeypatch.setattr(compaction, "compact", lambda *a, **k: (per_compaction.append(0), real_compact(*a, **k))[1])
    totals = {"workloads": 0, "points": 0, "states": 0}
    # one store in one segment, and one in five 16 KiB segments (compactions with several victims)
    for segment_bytes in ("64KiB", "16KiB"):
        tmp = fast_tmp / segment_bytes
        tmp.mkdir()
        ex = Explorer(tmp, segment_bytes)
        for w in workloads(3 if DEEP else 2):
            ex.run(w)
            for image, ops, acked, issued in ex.images:  # check as we go: bounded space
                ex.check(image, ops, acked, issued)
                shutil.rmtree(image)
            ex.images.clear()
            shutil.rmtree(tmp / f"w{ex.stats['workloads']}")
        for k in totals:
            totals[k] += ex.stats[k]
    totals["violations"] = 0
    with capsys.disabled():
        print(f"\ncrash states: {totals}")
    assert totals["states"] >= (16000 if DEEP else 2000)
    assert max(per_compaction) >= 2, per_compaction  # crashes between batches were explored


# -- eviction under a budget (SPEC.md §7.9): every put passes ssd_bytes, evicts and compacts ------

class EvictExplorer(Explorer):
    """Workloads on a store with an SSD budget that every put passes: each put evicts the
    least recently used objects (DELETE groups) and compacts their segments, in the put's own
    thread (the eviction thread is kept off, so the harness sees every write in order).  A
    crash state may miss evicted objects -- an eviction is a delete -- but every object it holds
    has the model's bytes, no deleted object comes back, and the newest acknowledged put is
    there (the most recently used: never the first victim)."""

    def __init__(self, tmp: Path, segment_bytes: str) -> None:
        self.tmp = tmp
        self.segment_bytes = segment_bytes
        self.stats = {"workloads": 0, "points": 0, "states": 0}
        self.images = []
        self.template, self.base = _base(tmp, segment_bytes)
        with tierstore.open(self.template, segment_bytes=segment_bytes) as s:
            s.put("old", Blob(b"o" * 1_000_000))  # a first put past the budget evicts the base, oldest first
            self.base["old"] = b"o" * 1_000_000
            self.budget = max(1 << 20, s._engine.disk_bytes() + 16_000)

    def run(self, ops: tuple[str, ...]) -> None:
        real_open = tierstore.open
        tierstore.open = lambda root, **kw: real_open(root, ssd_bytes=self.budget, **kw)  # type: ignore[assignment]
        try:
            super().run(ops)
        finally:
            tierstore.open = real_open  # type: ignore[assignment]

    def do(self, store: tierstore.Store, op: str, step: int) -> None:
        if op == "put_new":
            store.put(f"n{step}", Blob(_value(step) * 40))
        else:
            super().do(store, op, step)

    def models(self, ops: tuple[str, ...]) -> list:
        out = super().models(ops)
        for m, op in enumerate(ops, start=1):  # this explorer's new objects are 40 times larger
            if op == "put_new":
                for later in out[m:]:
                    later[f"n{m}"] = _value(m) * 40
        return out

    def check(self, image: str, ops: tuple[str, ...], acked: int, issued: int) -> None:
        state = self.state(image)
        models = self.models(ops)
        newest = max((i for i in range(1, acked + 1) if ops[i - 1] == "put_new"), default=None)
        ok = [m for m in range(acked, issued + 1)
              if all(models[m].get(k) == v for k, v in state.items()) and (newest is None or f"n{newest}" in state)]
        assert ok, f"{image}: state {sorted(state)} is not the model after {acked}..{issued} of {ops} less evictions"
        assert self.state(image) == state
        shutil.rmtree(os.path.join(image, "index"))
        assert self.state(image) == state


@pytest.mark.parametrize("gradual", [False, True], ids=["unlinked", "shrunk"])
def test_power_loss_states_with_eviction(fast_tmp, capsys, monkeypatch, gradual):
    """``shrunk``: retired segments are shrunk away a step at a time (what the eviction thread
    does, SPEC.md §7.5), here in the put's thread so that the harness sees every step."""
    from tierstore.engine import compaction
    from tierstore.engine import engine as engine_mod
    from tierstore.tiers import capacity

    monkeypatch.setattr(capacity.Capacity, "_wake", lambda self: None)  # evictions in the put's thread
    if gradual:
        real_reclaim = compaction.reclaim
        monkeypatch.setattr(compaction, "reclaim", lambda *a, **kw: real_reclaim(*a, **{**kw, "gradual": True}))
        monkeypatch.setattr(engine_mod, "SHRINK_STEP", 16 << 10)
        monkeypatch.setattr(engine_mod, "SHRINK_PAUSE_S", 0.0)
    ex = EvictExplorer(fast_tmp, "64KiB")
    evictions = []
    real_evict = capacity.Capacity._evict
    monkeypatch.setattr(capacity.Capacity, "_evict",
                        lambda self, *a, **kw: evictions.append(real_evict(self, *a, **kw)) or evictions[-1])
    ex.explore(["put_new", "overwrite", "delete", "compact"])
    with capsys.disabled():
        print(f"\ncrash states (eviction): {ex.stats}, evicting runs: {sum(1 for e in evictions if e)}")
    assert ex.stats["states"] >= 500 and sum(1 for e in evictions if e) >= 10


def test_fsck_runs_on_crash_states_without_index(tmp_path):
    """Sanity of the harness: a state with a torn append really is torn, and recovery cuts it."""
    root = str(tmp_path / "s")
    with tierstore.open(root) as s:
        s.put("a", Blob(b"x" * 100))
    fs = FaultFS(root)
    states = []
    with tierstore.open(root, _io=fs, index_commit_ms=1e9, index_batch=10**9) as s:
        fs.on_persist = lambda what: what == "before-fdatasync" and states.append(
            fs.crash_state(str(tmp_path / f"c{len(states)}"), "D", random.Random(len(states)), None) or
            str(tmp_path / f"c{len(states)}"))
        s.put("b", Blob(b"y" * 50000))
        fs.on_persist = None
    assert states
    for st in states:
        with tierstore.open(st) as s:
            assert s.get("a").data == b"x" * 100
            assert not s.contains("b") or s.get("b").data == b"y" * 50000
        with tierstore.open(st, readonly=True) as s:
            idx = s._engine.index
            assert isinstance(idx, Index) and repair.check_store(DEFAULT_IO, st, idx, deep=True).ok


if __name__ == "__main__":  # python -m tests.test_crash_states: the deep run
    os.environ["TIERSTORE_DEEP"] = "1"
    raise SystemExit(pytest.main([__file__, "-s", "-q"]))
