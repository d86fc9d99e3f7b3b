"""A full disk (issue 14, item 6): ENOSPC is StoreFull wherever it comes from, and the way out the
error names -- delete objects, then compact() -- works even on a disk with no byte left, because
the store holds back a reserve (RESERVE, ``reserve_bytes``) and gives it up then."""

from __future__ import annotations

import errno
import os
import time

import pytest

import tierstore
from tierstore import Blob
from tierstore.engine import repair
from tierstore.format import constants as fmt

from .faultfs import FaultFS


class FullDisk(FaultFS):
    """A disk that is full while ``full`` is set: every write that needs new space fails with
    ENOSPC; deleting the reserve frees space (clears ``full``)."""

    full = False

    def _nospace(self) -> None:
        if self.full:
            raise OSError(errno.ENOSPC, "injected: no space left on device")

    def pwritev(self, fd, bufs, offset):  # type: ignore[no-untyped-def]
        self._nospace()
        return super().pwritev(fd, bufs, offset)

    def fallocate(self, fd, offset, length):  # type: ignore[no-untyped-def]
        self._nospace()
        return super().fallocate(fd, offset, length)

    def unlink(self, path):  # type: ignore[no-untyped-def]
        super().unlink(path)
        if os.path.basename(path) == fmt.RESERVE_FILE:
            self.full = False


def test_delete_and_compact_work_on_a_full_disk(store_path):
    with tierstore.open(store_path, segment_bytes="64KiB", reserve_bytes="256KiB") as s:
        for i in range(12):
            s.put(f"k{i}", Blob(bytes([i]) * 30000))
    assert os.path.getsize(os.path.join(store_path, fmt.RESERVE_FILE)) == 256 << 10
    fs = FullDisk(store_path)
    s = tierstore.open(store_path, _io=fs, segment_bytes="64KiB", reserve_bytes="256KiB")
    fs.full = True
    with pytest.raises(tierstore.StoreFull) as e:
        s.put("more", Blob(b"x" * 30000))
    assert "compact()" in e.value.hint
    assert s.delete("k0") and s.delete("k1")  # the first gives up the reserve; both succeed
    assert not os.path.exists(os.path.join(store_path, fmt.RESERVE_FILE))
    assert "more" not in s.keys() and s.stats()["recovery"]["reserve_released"]
    before = s.stats()["segment_bytes"]
    s.compact()
    assert s.stats()["segment_bytes"] < before
    assert os.path.exists(os.path.join(store_path, fmt.RESERVE_FILE))  # held again
    s.put("more", Blob(b"x" * 30000))
    s.close()
    with tierstore.open(store_path) as s:
        assert sorted(s.keys()) == sorted(["more"] + [f"k{i}" for i in range(2, 12)])
    assert repair.fsck(store_path, deep=True).ok


def test_drop_session_and_delete_many_work_on_a_full_disk(store_path):
    with tierstore.open(store_path, segment_bytes="64KiB", reserve_bytes="256KiB") as s:
        for i in range(12):
            s.put(f"k{i}", Blob(bytes([i]) * 30000), session="conv" if i < 6 else None)
    fs = FullDisk(store_path)
    s = tierstore.open(store_path, _io=fs, segment_bytes="64KiB", reserve_bytes="256KiB")
    fs.full = True
    with pytest.raises(tierstore.StoreFull):
        s.put("more", Blob(b"x" * 30000))
    assert s.drop_session("conv") == 6  # gives up the reserve, then finishes
    assert not os.path.exists(os.path.join(store_path, fmt.RESERVE_FILE))
    assert sorted(s.keys()) == sorted(f"k{i}" for i in range(6, 12)) and s.session_keys("conv") == []
    s.close()
    with tierstore.open(store_path, segment_bytes="64KiB", reserve_bytes="256KiB") as s:  # the reserve again
        s.compact()
    fs = FullDisk(store_path)
    s = tierstore.open(store_path, _io=fs, segment_bytes="64KiB", reserve_bytes="256KiB")
    fs.full = True
    assert s.delete_many(["k6", "k7", "nope"]) == [True, True, False]
    s.close()
    assert repair.fsck(store_path, deep=True).ok


def test_small_stores_hold_no_reserve_by_default(store_path):
    with tierstore.open(store_path) as s:
        s.put("a", Blob(b"1"))
    assert not os.path.exists(os.path.join(store_path, fmt.RESERVE_FILE))


def test_index_enospc_is_store_full():
    import lmdb

    from tierstore.engine.index import Index, Tables

    class Env:
        def begin(self, write=False):  # type: ignore[no-untyped-def]
            raise lmdb.DiskError("mdb_txn_begin: No space left on device")

        def reader_check(self) -> int:  # (no dead readers to clear)
            return 0

    idx = Index.__new__(Index)
    idx.path, idx._write_lock = "/x", __import__("threading").Lock()
    idx.tables = Tables(Env(), None, None, None, None)
    idx._readers_checked = 0.0
    with pytest.raises(tierstore.StoreFull):
        idx._write(lambda txn: None)


def test_a_put_refused_for_space_says_it_was_taken_back(store_path):
    """(A new user's try on a 3 MiB tmpfs: a 100 KB put's StoreFull had no ``taken_back``, which
    the guide's I/O errors section promises.)"""
    with tierstore.open(store_path, reserve_bytes="256KiB") as s:
        s.put("a", Blob(b"a" * 100_000))
    fs = FullDisk(store_path)
    with tierstore.open(store_path, _io=fs, reserve_bytes="256KiB") as s:
        fs.full = True
        for size in (100_000, 300):  # written at once, and buffered then written at its sync
            with pytest.raises(tierstore.StoreFull) as e:
                s.put("b", Blob(b"b" * size))
            assert e.value.taken_back is True
            assert "b" not in s.keys()
        fs.full = False
        s.put("c", Blob(b"c" * 100_000))  # the twin: with room, a put lands
    with tierstore.open(store_path) as s:
        assert sorted(s.keys()) == ["a", "c"]


def test_close_lets_the_store_go_when_the_disk_is_full(store_path, monkeypatch):
    """(A new user's try on a full tmpfs: close() raised a bare OSError from writing the index's
    stamp, left its .tmp file, and kept the store locked: the next open waited 60 s.)"""
    from tierstore.engine import engine as engine_mod
    from tierstore.engine import index as index_mod

    real_open = open

    def no_space(path, *args, **kwargs):  # the stamp's file cannot be written
        if str(path).endswith(".tmp") and os.path.basename(os.path.dirname(str(path))) == fmt.INDEX_DIR:
            f = real_open(path, *args, **kwargs)
            f.close()
            raise OSError(errno.ENOSPC, "injected: no space left on device")
        return real_open(path, *args, **kwargs)

    s = tierstore.open(store_path)
    s.put("k", Blob(b"v"))
    monkeypatch.setattr("builtins.open", no_space)
    s.close()  # the stamp is an optimisation: without it the next open checks the index
    monkeypatch.setattr("builtins.open", real_open)
    assert not [n for n in os.listdir(os.path.join(store_path, fmt.INDEX_DIR)) if n.endswith(".tmp")]
    with tierstore.open(store_path, lock_timeout=1) as s:
        assert s.get("k").data == b"v"

    def failing(self, healthy):  # anything else at rest that fails: a TierstoreError, the locks let go
        raise OSError(errno.ENOSPC, "injected: no space left on device")

    monkeypatch.setattr(engine_mod.Engine, "_at_rest", failing)
    s = tierstore.open(store_path)
    with pytest.raises(tierstore.StoreFull):
        s.close()
    monkeypatch.undo()
    with tierstore.open(store_path, lock_timeout=1) as s:
        assert s.get("k").data == b"v"
    # an index write that fails on a full disk is StoreFull (LMDB reports a short write as EIO)
    import lmdb

    idx = index_mod.Index.__new__(index_mod.Index)
    idx.path = store_path
    monkeypatch.setattr(index_mod.os, "statvfs", lambda p: os.statvfs_result((4096, 4096, 100, 0, 0, 10, 0, 0, 0,
                                                                                255)))
    err = idx._failed("index write failed", lmdb.Error("mdb_txn_commit: Input/output error"))
    assert isinstance(err, tierstore.StoreFull) and "readonly=True" in err.hint
    monkeypatch.undo()
    assert isinstance(idx._failed("index write failed", lmdb.Error("mdb_txn_commit: Input/output error")),
                      tierstore.StoreIOError)  # the twin: with room, an I/O error


def test_a_full_disk_under_the_committer_leaves_the_handle_working(store_path, monkeypatch):
    """(A cold review: the committer's index commit failing for space stored its error, and every
    later call -- the deletes and compact() the guide names as the way out included -- raised it
    for good; the reserve was never given up; and the one stored exception, raised again each
    time, grew a traceback of 10,000 frames.)  Now the records stay pending, the committer gives
    the reserve up and tries again, and deletes and compact() work."""
    from tierstore.engine import engine as engine_mod
    from tierstore.engine import index as index_mod

    monkeypatch.setattr(engine_mod, "FULL_RETRY_S", 0.05)
    with tierstore.open(store_path, segment_bytes="64KiB", reserve_bytes="256KiB") as s:
        for i in range(6):
            s.put(f"k{i}", Blob(bytes([i]) * 30000))
    fs = FullDisk(store_path)
    real_apply = index_mod.Index.apply

    def apply(self, *args, **kwargs):  # LMDB's writes do not go through FaultFS: a full disk for them too
        if fs.full:
            raise tierstore.StoreFull("index write failed: mdb_txn_commit: Input/output error", path=self.path,
                                      index_full=True)
        return real_apply(self, *args, **kwargs)

    monkeypatch.setattr(index_mod.Index, "apply", apply)
    s = tierstore.open(store_path, _io=fs, segment_bytes="64KiB", reserve_bytes="256KiB", durability="none")
    s.put("late", Blob(b"l" * 100))  # buffered ("none"): the committer finds the disk full
    fs.full = True
    deadline = time.monotonic() + 10
    while os.path.exists(os.path.join(store_path, fmt.RESERVE_FILE)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not os.path.exists(os.path.join(store_path, fmt.RESERVE_FILE))  # given up by the committer
    assert s.get("late").data == b"l" * 100  # (pending: read from the memtable)
    assert s.delete("k0") and s.delete("k1")  # the way out works on the same handle
    s.compact()
    s.flush()  # the pending records are applied now that there is room
    s.close()
    with tierstore.open(store_path) as s:
        assert sorted(s.keys()) == ["k2", "k3", "k4", "k5", "late"]


def test_the_committers_error_is_raised_as_a_fresh_copy_each_time(store_path, monkeypatch):
    from tierstore.engine import index as index_mod

    s = tierstore.open(store_path, durability="none")
    monkeypatch.setattr(index_mod.Index, "apply", lambda *a, **k: (_ for _ in ()).throw(
        tierstore.StoreIOError("injected: index write failed", path=store_path, errno=errno.EIO)))
    s.put("a", Blob(b"a"))
    deadline = time.monotonic() + 10
    errors = []
    while len(errors) < 50 and time.monotonic() < deadline:
        try:
            s.put("b", Blob(b"b"))
            time.sleep(0.01)
        except tierstore.StoreIOError as e:
            errors.append(e)
    assert len(errors) == 50 and len({id(e) for e in errors}) == 50

    def depth(tb) -> int:
        n = 0
        while tb is not None:
            n, tb = n + 1, tb.tb_next
        return n

    assert depth(errors[-1].__traceback__) <= depth(errors[0].__traceback__) + 2  # (it grew by a call each)
    assert errors[-1].__cause__ is errors[0].__cause__  # the committer's own, kept once
    assert errors[-1].errno == errno.EIO  # (a plain copy of an OSError had errno None: a cold review)
    monkeypatch.undo()
    s.close()  # (unhealthy: nothing more is committed; the next open recovers from the log)
    with tierstore.open(store_path) as s:
        assert set(s.keys()) <= {"a", "b"}  # (recovered from the log; "none": maybe never synced)


@pytest.mark.parametrize("durability,exclusive", [("group", True), ("none", True)])  # (exclusive: the
# committer writes the buffer; a shared handle writes each put at once, and its puts fail themselves)
def test_puts_the_committer_could_not_write_for_space_are_reported(store_path, durability, exclusive):
    """(A cold review: the committer's retry on a full disk caught the log's StoreFull too -- puts
    that had returned were taken back from the log when its write or sync was refused, and no call
    ever raised: they were silently gone.)  Only the index's StoreFull is retried; the log's is
    the next call's error (taken back), and every put acknowledged before it stays."""
    with tierstore.open(store_path) as s:
        s.put("base", Blob(b"b" * 100))
    fs = FullDisk(store_path)
    s = tierstore.open(store_path, _io=fs, durability=durability, exclusive=exclusive, reserve_bytes=0,
                       group_commit_ms=1000, index_commit_ms=1000)
    try:
        for i in range(20):  # returned: in the write buffer, or in the page cache but not synced
            s.put(f"late{i}", Blob(b"l" * 100))
        fs.full = True  # before the committer's sync or write, due in a second
        deadline = time.monotonic() + 10
        with pytest.raises(tierstore.StoreFull) as e:
            while time.monotonic() < deadline:
                s.put("after", Blob(b"a"))
                time.sleep(0.05)
        assert e.value.taken_back is True and not e.value.index_full
        fs.full = False
        with pytest.raises(tierstore.StoreFull):  # (the handle stops writing: reopen)
            s.put("after", Blob(b"a"))
    finally:
        fs.full = False
        try:
            s.close()
        except tierstore.TierstoreError:
            pass
    with tierstore.open(store_path) as s:
        assert sorted(s.keys()) == ["base"]  # nothing torn; the taken-back puts are gone, and were reported


def test_the_reserve_is_given_up_once_among_threads(store_path):
    """(A cold review: release_reserve checked, then unlinked: the committer and a delete giving it
    up together raised FileNotFoundError, which delete does not catch.)  One caller gives it up;
    one whose write was refused meanwhile is told to try again."""
    import threading

    s = tierstore.open(store_path, reserve_bytes="64KiB")
    engine = s._engine
    try:
        for _ in range(200):
            engine.ensure_reserve()
            given = engine.reserve_released
            results, errors = [], []

            def release(results: list = results, errors: list = errors) -> None:
                try:
                    results.append(engine.release_reserve())
                except BaseException as e:  # (any: the assertion below names it)
                    errors.append(e)

            threads = [threading.Thread(target=release) for _ in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert not errors and sorted(results) == [False, False, True]
            assert engine.release_reserve(given) is True  # given up since: worth one more try
            assert engine.release_reserve(engine.reserve_released) is False  # nothing left to give
    finally:
        s.close()


def test_group_syncs_go_on_while_the_index_cannot_grow(store_path, monkeypatch):
    """(A cold review: while the committer waited to retry an index that could not grow, the log
    was synced once per retry -- a put of durability "group" stayed unsynced 1 s, against
    group_commit_ms=10.)  The log's own syncs keep their deadline; the index's retry its pace."""
    from tierstore.engine import engine as engine_mod
    from tierstore.engine import index as index_mod

    monkeypatch.setattr(engine_mod, "FULL_RETRY_S", 30.0)
    full = {"on": False}
    real_apply = index_mod.Index.apply

    def apply(self, *args, **kwargs):
        if full["on"]:
            raise tierstore.StoreFull("index write failed: injected", path=self.path, index_full=True)
        return real_apply(self, *args, **kwargs)

    monkeypatch.setattr(index_mod.Index, "apply", apply)
    with tierstore.open(store_path, durability="group", group_commit_ms=10, index_commit_ms=10, reserve_bytes=0) as s:
        s.put("a", Blob(b"a"))
        full["on"] = True
        time.sleep(0.2)  # the committer meets the full index and waits 30 s to retry
        log = s._engine.log
        for i in range(5):
            s.put(f"b{i}", Blob(b"b"))
            lsn = log.next_lsn - 1
            deadline = time.monotonic() + 5
            while log.durable_lsn < lsn and time.monotonic() < deadline:
                time.sleep(0.005)
            assert log.durable_lsn >= lsn  # synced well before the index's retry
            time.sleep(0.05)
        assert s.get("b4").data == b"b"  # (pending: read from the memtable)
        full["on"] = False
        s.flush()
    with tierstore.open(store_path) as s:
        assert sorted(s.keys()) == ["a", "b0", "b1", "b2", "b3", "b4"]
