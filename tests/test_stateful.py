"""Model-based test: the Store against a plain dict, under random interleavings of put, get,
partial get, delete, overwrite, session puts and drops, reopen, compact and crash-and-recover
(simulated power loss through tests/faultfs.py).  With durability="sync" every acknowledged operation survives a
crash, so after recovery the store must equal the model exactly.

TIERSTORE_STATEFUL_EXAMPLES scales the run (CI: 40 examples of up to 30 steps, derandomized).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
from hypothesis import HealthCheck, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import tierstore
from tierstore import Blob, KVCache, Vectors
from tierstore.engine import repair

from .conftest import crash
from .faultfs import FaultFS

KEYS = st.sampled_from(["a", "b", "c", "ü-key", "d" * 400])
BYTES_KEYS = st.sampled_from([b"\x00\xff", b"\x12\x34\x56"])
NAMESPACES = st.sampled_from(["default", "tenant-b"])


def _k(key: str | bytes) -> bytes:
    return key.encode() if isinstance(key, str) else key


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.mkdtemp(prefix="tierstore-stateful-")
        self.generation = 0
        self.model: dict[tuple[str, bytes], tuple] = {}
        self.refs: dict[tuple[str, bytes], set[str]] = {}  # sessions per object ("" = the anchor), SPEC.md §5.4
        self._open(os.path.join(self.tmp, "s0"))

    def _open(self, root: str) -> None:
        os.makedirs(root, exist_ok=True)
        self.root = root
        self.io = FaultFS(root)
        # the index applies every 3 records (not on a timer), so runs are deterministic
        self.store = tierstore.open(root, _io=self.io, segment_bytes="64KiB", index_commit_ms=1e9, index_batch=3)
        self.io.index_env = self.store._engine.index.env

    # -- writes ---------------------------------------------------------------------------

    @rule(key=KEYS | BYTES_KEYS, ns=NAMESPACES, layers=st.integers(1, 4), tokens=st.integers(1, 9),
          dtype=st.sampled_from(["float16", "float32"]), start=st.integers(0, 30), seed=st.integers(0, 999))
    def put_kv(self, key, ns, layers, tokens, dtype, start, seed):
        arr = np.random.default_rng(seed).standard_normal((layers, 2, 2, tokens, 8)).astype(dtype)
        note(f"put_kv {ns}/{key!r} {arr.shape} {dtype}")
        self.store.put(key, KVCache(arr, layer_start=start), namespace=ns)
        self._put_model(ns, key, ("kv", arr, start), None)

    @rule(key=KEYS | BYTES_KEYS, ns=NAMESPACES, n=st.integers(1, 60), dim=st.integers(1, 24),
          with_ids=st.booleans(), seed=st.integers(0, 999))
    def put_vectors(self, key, ns, n, dim, with_ids, seed):
        rng = np.random.default_rng(seed)
        arr = rng.standard_normal((n, dim)).astype(np.float16)
        ids = rng.integers(-(2**40), 2**40, n) if with_ids else None
        note(f"put_vectors {ns}/{key!r} {arr.shape} ids={with_ids}")
        self.store.put(key, Vectors(arr, ids=ids), namespace=ns)
        self._put_model(ns, key, ("vectors", arr, ids), None)

    @rule(key=KEYS | BYTES_KEYS, ns=NAMESPACES, size=st.sampled_from([0, 1, 100, 4095, 4096, 9000]),
          seed=st.integers(0, 255), session=st.sampled_from([None, None, "s1", "s2"]))
    def put_blob(self, key, ns, size, seed, session):
        data = bytes((seed + i) % 256 for i in range(size))
        note(f"put_blob {ns}/{key!r} {size} session={session}")
        self.store.put(key, Blob(data, media_type="x/y"), namespace=ns, meta={"seed": seed}, session=session)
        self._put_model(ns, key, ("blob", data, seed), session)

    def _put_model(self, ns, key, value, session) -> None:
        k = (ns, _k(key))
        existed = k in self.model
        self.model[k] = value
        refs = self.refs.setdefault(k, set())
        if session is None:
            if refs:
                refs.add("")
        else:
            if existed and not refs:
                refs.add("")
            refs.add(session)
        if not refs:
            del self.refs[k]

    @rule(session=st.sampled_from(["s1", "s2"]), ns=NAMESPACES)
    def drop_session(self, session, ns):
        note(f"drop_session {session} in {ns}")
        gone = 0
        for k in [k for k, r in self.refs.items() if k[0] == ns and session in r]:
            self.refs[k].discard(session)
            if not self.refs[k]:
                del self.refs[k], self.model[k]
                gone += 1
        assert self.store.drop_session(session, namespace=ns) == gone

    @rule(key=KEYS | BYTES_KEYS, ns=NAMESPACES)
    def delete(self, key, ns):
        note(f"delete {ns}/{key!r}")
        existed = self.store.delete(key, namespace=ns)
        assert existed == ((ns, _k(key)) in self.model)
        self.model.pop((ns, _k(key)), None)
        self.refs.pop((ns, _k(key)), None)

    # -- reads ------------------------------------------------------------------------------

    @rule(key=KEYS | BYTES_KEYS, ns=NAMESPACES)
    def get(self, key, ns):
        want = self.model.get((ns, _k(key)))
        if want is None:
            try:
                self.store.get(key, namespace=ns)
            except tierstore.NotFound:
                return
            raise AssertionError(f"{ns}/{key!r} should not exist")
        self._check(key, ns, want, self.store.get(key, namespace=ns))

    @precondition(lambda self: any(v[0] in ("kv", "vectors") for v in self.model.values()))
    @rule(data=st.data())
    def get_partial(self, data):
        (ns, key), want = data.draw(st.sampled_from(sorted((k, v) for k, v in self.model.items()
                                                           if v[0] in ("kv", "vectors"))), label="object")
        if want[0] == "kv":
            arr, start = want[1], want[2]
            lo = data.draw(st.integers(0, arr.shape[0] - 1))
            hi = data.draw(st.integers(lo + 1, arr.shape[0]))
            got = self.store.get(key, namespace=ns, layers=range(start + lo, start + hi))
            assert np.array_equal(got.data.view(np.uint8), arr[lo:hi].view(np.uint8)) and got.layer_start == start + lo
        else:
            arr, ids = want[1], want[2]
            rows = data.draw(st.lists(st.integers(-arr.shape[0], arr.shape[0] - 1), min_size=1, max_size=8))
            got = self.store.get(key, namespace=ns, rows=rows)
            assert np.array_equal(got.data.view(np.uint8), arr[rows].view(np.uint8))
            assert (got.ids is None) if ids is None else np.array_equal(got.ids, ids[rows])

    def _check(self, key, ns, want, got) -> None:
        kind = want[0]
        if kind == "kv":
            assert isinstance(got, KVCache) and got.layer_start == want[2]
            assert got.data.dtype == want[1].dtype and np.array_equal(got.data.view(np.uint8), want[1].view(np.uint8))
        elif kind == "vectors":
            assert isinstance(got, Vectors) and np.array_equal(got.data.view(np.uint8), want[1].view(np.uint8))
            assert (got.ids is None) if want[2] is None else np.array_equal(got.ids, want[2])
        else:
            assert isinstance(got, Blob) and got.data == want[1]
            assert self.store.info(key, namespace=ns).meta == {"seed": want[2]}

    # -- lifecycle ----------------------------------------------------------------------------

    @rule()
    def reopen(self):
        note("reopen")
        self.store.close()
        self._open(self.root)

    @rule()
    def compact(self):
        note("compact")
        self.store.compact()

    @rule()
    def crash_and_recover(self):
        """Power loss now: only what was synced survives (every acknowledged op, in sync mode)."""
        self.generation += 1
        image = os.path.join(self.tmp, f"s{self.generation}")
        note(f"crash -> {image}")
        self.io.image(image)
        crash(self.store)
        self._open(image)
        report = repair.check_store(self.store._engine.io, image, self.store._engine.index, deep=True)
        assert report.ok, report.as_dict()

    @invariant()
    def keys_match(self):
        for ns in ("default", "tenant-b"):
            listed = sorted(_k(k) for k in self.store.keys(namespace=ns))
            assert listed == sorted(k for (n, k) in self.model if n == ns), ns
            for sess in ("s1", "s2"):
                got = sorted(_k(k) for k in self.store.session_keys(sess, namespace=ns))
                assert got == sorted(k for (n, k), r in self.refs.items() if n == ns and sess in r), (ns, sess)
        for (ns, k), r in self.refs.items():
            got = {x.decode() if x != b"\x00" else "" for x in self.store._engine.sessions_of(ns.encode(), k)}
            assert got == r, (ns, k)

    def teardown(self) -> None:
        if not self.store.closed:
            self.store.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


EXAMPLES = int(os.environ.get("TIERSTORE_STATEFUL_EXAMPLES", "40"))
StoreMachine.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=30, deadline=None,
                                          derandomize=EXAMPLES <= 40,
                                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TestStoreMachine = StoreMachine.TestCase


class TieredStoreMachine(StoreMachine):
    """The same model, the store opened with small DRAM and GPU (CPU memory) tiers and the
    session-aware policy: every get goes through the tiers (hits, misses, evictions,
    demotions, invalidation by puts, deletes, drops and compaction), and must still equal
    the model; the tiers' accounting must stay within capacity."""

    def _open(self, root: str) -> None:
        os.makedirs(root, exist_ok=True)
        self.root = root
        self.io = FaultFS(root)
        self.store = tierstore.open(root, _io=self.io, segment_bytes="64KiB", index_commit_ms=1e9, index_batch=3,
                                    dram_bytes="6KiB", gpu_bytes="3KiB", gpu_device="cpu", policy="session")
        self.io.index_env = self.store._engine.index.env

    @precondition(lambda self: any(v[0] == "kv" for v in self.model.values()))
    @rule(data=st.data())
    def get_on_device(self, data):
        (ns, key), want = data.draw(st.sampled_from(sorted((k, v) for k, v in self.model.items() if v[0] == "kv")),
                                    label="object")
        got = self.store.get(key, namespace=ns, device="cpu")
        assert np.array_equal(got.data.numpy().view(np.uint8), want[1].view(np.uint8))

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data(), tier=st.sampled_from(["dram", "gpu"]))
    def prefetch(self, data, tier):
        (ns, key), want = data.draw(st.sampled_from(sorted(self.model.items())), label="object")
        try:
            self.store.prefetch(key, namespace=ns, tier=tier).result()
        except (tierstore.StoreFull, tierstore.InvalidObject):  # too large, or a blob for the GPU
            return

    @invariant()
    def tiers_within_capacity(self):
        for t in self.store._tiers.tiers().values():
            with t.lock:
                assert t.used == sum(e.nbytes for e in t.entries.values()) and t.used + t.reserved <= t.capacity
                assert set(t.probation) <= set(t.entries)
                assert t.probation_bytes == sum(t.entries[k].nbytes for k in t.probation) <= t.probation_cap


TieredStoreMachine.TestCase.settings = StoreMachine.TestCase.settings
TestTieredStoreMachine = TieredStoreMachine.TestCase


class SecondReadStoreMachine(TieredStoreMachine):
    """The tiered model with the default store's admission (a first read enters the DRAM tier's
    probation share, a second read keeps it; here of any size): probation entries, their
    eviction by later first reads, promotions of partly cached objects and versions replaced
    between two reads must all still equal the model."""

    def _open(self, root: str) -> None:
        os.makedirs(root, exist_ok=True)
        self.root = root
        self.io = FaultFS(root)
        self.store = tierstore.open(root, _io=self.io, segment_bytes="64KiB", index_commit_ms=1e9, index_batch=3,
                                    dram_bytes="6KiB", dram_admit="second")
        assert self.store._tiers.admission is not None
        self.store._tiers.admission.min_bytes = 0  # the model's objects are small: let them in
        self.io.index_env = self.store._engine.index.env


SecondReadStoreMachine.TestCase.settings = StoreMachine.TestCase.settings
TestSecondReadStoreMachine = SecondReadStoreMachine.TestCase
