"""A full disk (issue 14, item 6): ENOSPC is StoreFull wherever it comes from, and the way out the
error names -- delete objects, then compact() -- works even on a disk with no byte left, because
the store holds back a reserve (RESERVE, ``reserve_bytes``) and gives it up then."""

from __future__ import annotations

import errno
import os

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
