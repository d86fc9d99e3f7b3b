"""Torn tails, lost and stale indexes, corrupt extents, sealed-segment damage, rollover."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

import tierstore
from tierstore import Blob, KVCache
from tierstore.engine import recovery, repair
from tierstore.engine import segment as seglib
from tierstore.engine.fileio import DEFAULT_IO
from tierstore.format import constants as fmt
from tierstore.format import record as rec

from .conftest import crash, segment_files


def lagging_store(path, n=5, **kw):
    """A store whose log holds n puts that the index never saw."""
    s = tierstore.open(path, index_commit_ms=1e9, index_batch=10**9, **kw)
    for i in range(n):
        s.put(f"k{i}", Blob(f"v{i}".encode() * 100))
    crash(s)


def test_replay_after_crash(store_path):
    lagging_store(store_path)
    with tierstore.open(store_path) as s:
        assert s.stats()["recovery"]["replayed_records"] == 5
        assert [s.get(f"k{i}").data for i in range(5)] == [f"v{i}".encode() * 100 for i in range(5)]
    with tierstore.open(store_path) as s:
        assert s.stats()["recovery"]["replayed_records"] == 0


def test_readonly_open_sees_unapplied_tail(store_path):
    lagging_store(store_path)
    with tierstore.open(store_path, readonly=True) as r:
        assert sorted(r.keys()) == [f"k{i}" for i in range(5)] and r.get("k3").data == b"v3" * 100


def record_offsets(path):
    """(offset, end) of every record in the single segment of a store."""
    (seg,) = segment_files(path)
    fd = os.open(seg, os.O_RDONLY)
    try:
        sc = seglib.SegmentScanner(DEFAULT_IO, fd, 1, path=seg, verify_payload=True)
        return [(off, off + h.record_len) for off, h in sc.records()
                if h.type not in (fmt.REC_SYNC, fmt.REC_HEADERS)], seg
    finally:
        os.close(fd)


def test_torn_tail_at_every_boundary(tmp_path):
    base = str(tmp_path / "base")
    lagging_store(base, n=3)
    recs, seg = record_offsets(base)
    assert len(recs) == 3
    last_start, last_end = recs[-1]
    cuts = sorted({last_start - 1, last_start, last_start + 1, last_start + 47, last_start + 48, last_start + 100,
                   last_end - 1, last_end, last_end + 1})
    for cut in cuts:
        work = str(tmp_path / f"cut{cut}")
        shutil.copytree(base, work)
        with open(os.path.join(work, "segments", os.path.basename(seg)), "r+b") as f:
            f.truncate(cut)
        with tierstore.open(work) as s:
            assert s.get("k0").data == b"v0" * 100 and s.get("k1").data == b"v1" * 100
            if cut >= last_end:
                assert s.get("k2").data == b"v2" * 100
            else:
                assert not s.contains("k2"), cut
            s.put("after", Blob(b"new"))
        with tierstore.open(work) as s:  # appending after the cut left a valid log
            assert s.get("after").data == b"new"
            rep = repair.check_store(DEFAULT_IO, work, s._engine.index, deep=True)
            assert rep.ok, rep.as_dict()


def test_garbage_tail_is_torn_not_corrupt(store_path):
    lagging_store(store_path, n=2)
    (seg,) = segment_files(store_path)
    with open(seg, "ab") as f:
        f.write(os.urandom(5000))
    with tierstore.open(store_path) as s:
        assert s.keys() == ["k0", "k1"]
        kept = s.stats()["recovery"]["damage"][0]["quarantined_to"]  # non-zero bytes cut: kept, not deleted
        assert kept is not None and os.path.getsize(kept) == 5000


@pytest.mark.parametrize("copies", [True, False])
def test_damage_to_a_synced_record_in_the_last_segment_is_not_a_torn_tail(store_path, monkeypatch, copies):
    """k1 was synced (its put returned; a later SYNC record vouches for it): a damaged header there
    is damage, not a torn write.  A HEADERS record holds a copy of its header (1.5): opening reads
    k1 with it and keeps everything.  Without copies (a 1.4 writer) opening refuses rather than
    cutting k1 and k2; recover then keeps every other record.  (Before SYNC records, opening cut
    the log at k1, losing k2.)"""
    if not copies:
        from tierstore.engine.log import Log

        monkeypatch.setattr(Log, "_write_copies", lambda self: None)
    lagging_store(store_path, n=3)
    recs, seg = record_offsets(store_path)
    with open(seg, "r+b") as f:
        f.seek(recs[1][0] + 20)
        f.write(b"\xff\xff")
    if copies:
        with tierstore.open(store_path) as s:
            assert [s.get(k).data for k in s.keys()] == [f"v{i}".encode() * 100 for i in range(3)]
            (dmg,) = s.stats()["recovery"]["damage"]
            assert dmg["offset"] == recs[1][0] and "HEADERS record" in dmg["reason"]
        return
    with pytest.raises(tierstore.CorruptionError) as e:
        tierstore.open(store_path)
    assert e.value.offset == recs[1][0] and "recover" in e.value.hint
    result = repair.recover(store_path)
    (dmg,) = result["damage"]
    assert dmg["quarantined_to"] and os.path.getsize(dmg["quarantined_to"]) == dmg["bytes_dropped"]
    with tierstore.open(store_path) as s:
        assert s.keys() == ["k0", "k2"]
        s.put("k9", Blob(b"z"))
    with tierstore.open(store_path) as s:
        assert s.keys() == ["k0", "k2", "k9"]


def test_damage_after_the_last_synced_point_is_a_torn_tail(store_path):
    """The twin: the last record, which no SYNC record vouches for (the process died right after its
    put), may be a torn write: the log ends before it, and its bytes are kept in quarantine/."""
    lagging_store(store_path, n=3)
    recs, seg = record_offsets(store_path)
    with open(seg, "r+b") as f:
        f.seek(recs[2][0] + 20)
        f.write(b"\xff\xff")
    with tierstore.open(store_path) as s:
        assert s.keys() == ["k0", "k1"]
        dmg = s.stats()["recovery"]["damage"][0]
        assert dmg["quarantined_to"] and os.path.exists(dmg["quarantined_to"])


def test_index_missing_is_rebuilt(store_path, real_kv):
    with tierstore.open(store_path, segment_bytes="256KiB") as s:
        for i in range(6):
            s.put(f"kv{i}", KVCache(real_kv[:, :, :, :16]))
        s.put("gone", Blob(b"x"))
        s.delete("gone")
        s.put("kv0", Blob(b"overwritten"))
    assert len(segment_files(store_path)) > 1
    shutil.rmtree(os.path.join(store_path, "index"))
    with tierstore.open(store_path) as s:
        assert s.recovery["rebuilt_index"] == "index missing"
        assert sorted(s.keys()) == [f"kv{i}" for i in range(6)]
        assert s.get("kv0").data == b"overwritten"
        assert np.array_equal(s.get("kv5").data, real_kv[:, :, :, :16])
        assert repair.check_store(DEFAULT_IO, store_path, s._engine.index, deep=True).ok


def test_readonly_open_without_index_refuses(store_path):
    with tierstore.open(store_path) as s:
        s.put("a", Blob(b"1"))
    shutil.rmtree(os.path.join(store_path, "index"))
    with pytest.raises(tierstore.CorruptionError):
        tierstore.open(store_path, readonly=True)


@pytest.mark.parametrize("durability", ["none", "sync", "group"])
def test_index_ahead_of_log(tmp_path, durability):
    """An index that names records the log lost.  With durability="none" that is what a power
    cut does (the index applied records only handed to the OS): the index is rebuilt from the
    log, the older versions stand.  With "sync" or "group" the index applies only records the
    writer synced: the log lost durable records (a segment removed or restored from an older
    copy), and rebuilding from the log served the older version of a key overwritten since
    (here x: b"1" for b"2"), with a warning only.  The open now refuses (CorruptionError), and
    `recover` deletes the keys whose newest versions were lost, with the index as its witness."""
    a = str(tmp_path / "a")
    with tierstore.open(a, durability=durability) as s:
        s.put("x", Blob(b"1"))
        s.put("w", Blob(b"w"))
    snapshot = str(tmp_path / "snap")
    shutil.copytree(a, snapshot)
    with tierstore.open(a, durability=durability) as s:
        s.put("y", Blob(b"2"))
        s.put("x", Blob(b"2"))
    # the new index with the old log: the index's applied record does not exist
    shutil.rmtree(os.path.join(snapshot, "index"))
    shutil.copytree(os.path.join(a, "index"), os.path.join(snapshot, "index"))
    if durability == "none":
        with tierstore.open(snapshot) as s:
            assert "rebuilt_index" in s.recovery
            assert s.keys() == ["w", "x"] and s.get("x").data == b"1"
        return
    with pytest.raises(tierstore.CorruptionError, match="synced before the index applied them") as err:
        tierstore.open(snapshot)
    assert "tierstore recover" in err.value.hint
    with pytest.raises(tierstore.CorruptionError, match="synced before the index applied them"):
        tierstore.open(snapshot, readonly=True)  # (it said "open the store writable", which then refused)
    result = repair.recover(snapshot)
    assert result["stale_keys_deleted"] == [{"namespace": "default", "key": "x"}]
    with tierstore.open(snapshot) as s:
        assert s.keys() == ["w"]


def test_corrupt_extent_raises_and_fsck_reports(store_path, real_kv):
    with tierstore.open(store_path) as s:
        s.put("c", KVCache(real_kv))
        s.put("ok", Blob(b"fine"))
        info = s.info("c")
    (seg,) = segment_files(store_path)
    layer = real_kv[0].nbytes
    with open(seg, "r+b") as f:  # flip a byte inside layer 2
        pos = info.offset + (info.stored_bytes - 6 * layer) + 2 * layer + 100
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x01]))
    with tierstore.open(store_path) as s:
        assert s.get("ok").data == b"fine"
        assert np.array_equal(s.get("c", layers=range(0, 2)).data, real_kv[:2])  # other layers still read
        with pytest.raises(tierstore.CorruptionError) as ei:
            s.get("c")
        assert ei.value.segment == 1 and ei.value.offset == info.offset and ei.value.key == "c"
        with pytest.raises(tierstore.CorruptionError):
            s.get("c", layers=2)
        for deep in (False, True):
            report = repair.check_store(DEFAULT_IO, store_path, s._engine.index, deep=deep)
            assert not report.ok and "extent 2 checksum mismatch" in report.findings[0].what


@pytest.mark.parametrize("copies", [True, False])
def test_sealed_segment_damage_needs_recover(store_path, monkeypatch, copies):
    """A damaged record header in a sealed segment, the index deleted: read with the copy a
    HEADERS record holds (1.5: every object served); without copies (a 1.4 writer) opening
    refuses until a repair, which drops only that record."""
    if not copies:
        from tierstore.engine.log import Log

        monkeypatch.setattr(Log, "_write_copies", lambda self: None)
    with tierstore.open(store_path, segment_bytes="64KiB") as s:
        for i in range(40):
            s.put(f"k{i:02d}", Blob(bytes([i]) * 5000))
    segs = segment_files(store_path)
    assert len(segs) >= 3
    with open(segs[0], "r+b") as f:  # damage a record header in the first, sealed segment
        f.seek(4096 + 30)
        f.write(b"\x00\x01\x02")
    shutil.rmtree(os.path.join(store_path, "index"))
    if copies:
        with tierstore.open(store_path) as s:
            assert {k: s.get(k).data for k in s.keys()} == {f"k{i:02d}": bytes([i]) * 5000 for i in range(40)}
        return
    with pytest.raises(tierstore.CorruptionError) as ei:
        tierstore.open(store_path)
    assert "recover" in str(ei.value)
    scan = recovery.rebuild_index(DEFAULT_IO, store_path, repair=True)
    assert scan.damage and scan.damage[0].quarantined_to
    with tierstore.open(store_path) as s:
        keys = s.keys()
        assert "k00" not in keys and len(keys) == 39
        for k in keys:
            i = int(k[1:])
            assert s.get(k).data == bytes([i]) * 5000


def test_rollover_many_segments(store_path):
    with tierstore.open(store_path, segment_bytes="32KiB", durability="group") as s:
        for i in range(200):
            s.put(f"k{i}", Blob(os.urandom(1000) if i % 2 else bytes([i % 256]) * 3000))
        s.flush()
        n_segs = s.stats()["segments"]
    assert n_segs > 10
    with tierstore.open(store_path) as s:
        assert len(s.keys()) == 200
        assert s.get("k100").data == bytes([100]) * 3000
        assert repair.check_store(DEFAULT_IO, store_path, s._engine.index, deep=True).ok


def test_foreign_segment_is_rejected(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    for p in (a, b):
        with tierstore.open(p) as s:
            s.put("x", Blob(p.encode()))
    shutil.copy(segment_files(b)[0], os.path.join(a, "segments", seglib.segment_name(2)))
    with pytest.raises(tierstore.CorruptionError), tierstore.open(a) as s:
        pass


def test_newer_major_version_refused(store_path):
    with tierstore.open(store_path) as s:
        s.put("x", Blob(b"1"))
    (seg,) = segment_files(store_path)
    with open(seg, "r+b") as f:
        f.seek(8)
        f.write((2).to_bytes(2, "little"))
    shutil.rmtree(os.path.join(store_path, "index"))
    with pytest.raises(tierstore.FormatVersionError):
        tierstore.open(store_path)


def test_newer_minor_version_opens_read_only(store_path):
    with tierstore.open(store_path) as s:
        s.put("x", Blob(b"1"))
    (seg,) = segment_files(store_path)
    with open(seg, "r+b") as f:
        hdr = bytearray(f.read(fmt.SEGMENT_HEADER_SIZE))
        hdr[10:12] = (fmt.FORMAT_MINOR + 1).to_bytes(2, "little")
        hdr[112:116] = seglib.rec.crc32c(bytes(hdr[:112])).to_bytes(4, "little")
        f.seek(0)
        f.write(hdr)
    with pytest.raises(tierstore.ReadOnlyError):
        tierstore.open(store_path)
    with tierstore.open(store_path, readonly=True) as r:
        assert r.get("x").data == b"1"


def test_unsynced_new_segment_header_is_dropped(store_path):
    """A crash after creating a segment file but before its header was durable."""
    with tierstore.open(store_path) as s:
        s.put("x", Blob(b"1"))
    with open(os.path.join(store_path, "segments", seglib.segment_name(2)), "wb") as f:
        f.write(b"\0" * 100)
    with tierstore.open(store_path) as s:
        assert s.get("x").data == b"1"
        s.put("y", Blob(b"2"))
        assert s.recovery["removed_segments"] == [2]
    with tierstore.open(store_path) as s:
        assert s.keys() == ["x", "y"]


def test_unknown_ignorable_record_is_skipped(store_path):
    """A newer minor version may add records with the ignorable bit: they count as LSNs only."""
    s = tierstore.open(store_path, index_commit_ms=1e9, index_batch=10**9)
    s.put("a", Blob(b"1"))
    rtype = fmt.REC_TYPE_IGNORABLE | 42
    raw = rec._pack_header(rtype, 0, 48, 0, 3, 0, 0, b"", b"", b"", b"", 0, checksum=False)
    hdr = rec.RecordHeader(rtype, 0, 0, 48, 0, 3, 0, b"", b"", {}, (), (), 0, raw, ())
    s._engine.log.append(rec.EncodedRecord(hdr))
    s.put("b", Blob(b"2"))
    s._engine.log.sync()
    crash(s)
    with tierstore.open(store_path) as s:  # replayed from the log
        assert s.keys() == ["a", "b"] and s.stats()["recovery"]["replayed_records"] == 2
    shutil.rmtree(os.path.join(store_path, "index"))
    with tierstore.open(store_path) as s:  # rebuilt from segments
        assert s.keys() == ["a", "b"]
        s.put("c", Blob(b"3"))
    with tierstore.open(store_path) as s:
        assert s.keys() == ["a", "b", "c"]


def test_deep_fsck_checks_dead_records_and_lmdb(store_path):
    with tierstore.open(store_path) as s:
        s.put("k", Blob(b"a" * 5000))
        old = s.info("k")
        s.put("k", Blob(b"b" * 5000))  # the first record is now dead
    (seg,) = segment_files(store_path)
    with open(seg, "r+b") as f:
        f.seek(old.offset + 4096 + 10)  # inside the dead record's payload
        f.write(b"\xff")
    with tierstore.open(store_path, readonly=True) as s:
        assert repair.check_store(DEFAULT_IO, store_path, s._engine.index, deep=False).ok  # live data is intact
        deep = repair.check_store(DEFAULT_IO, store_path, s._engine.index, deep=True)
        assert not deep.ok and "log damaged" in deep.findings[0].what
    data = os.path.join(store_path, "index", "data.mdb")
    with open(data, "rb") as f:
        page = f.read().find(b"\x07defaultk") // 4096  # the leaf page holding our entry
    with open(data, "r+b") as f:
        f.seek(page * 4096)  # smash its page header
        f.write(b"\xde\xad\xbe\xef" * 4)
    from tierstore.engine.index import Index
    idx = Index.open(os.path.join(store_path, "index"), writable=False)
    try:  # the verifier runs before liblmdb walks the damaged tree
        findings = [f.what for f in repair.check_store(DEFAULT_IO, store_path, idx, deep=True).findings]
    finally:
        idx.close()
    assert any(w.startswith("index (LMDB)") for w in findings), findings


def _evict(path: str) -> None:
    for seg in segment_files(path):
        fd = os.open(seg, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def test_cold_reads_go_direct_and_are_verified(store_path, real_kv, monkeypatch):
    with tierstore.open(store_path, direct_reads="always") as s:
        s.put("c", KVCache(real_kv))  # 6 layers of 192 KiB: page-aligned extents
        s.flush()
        seg_fd = s._engine.files.acquire(1)
        s._engine.files.release(1)
        if DEFAULT_IO.cached_fraction(seg_fd[0], 0, 4096) is None:
            pytest.skip("cachestat(2) is not available on this kernel: cold reads stay buffered")
        used: list[int] = []
        real = s._engine.io.preadv
        monkeypatch.setattr(s._engine.io, "preadv", lambda fd, b, o, *f: used.append(fd) or real(fd, b, o, *f))
        _evict(store_path)
        assert np.array_equal(s.get("c").data, real_kv)
        assert used and set(used) == {seg_fd[1]}  # the O_DIRECT descriptor
        used.clear()
        assert np.array_equal(s.get("c").data, real_kv)  # now warm (O_DIRECT does not fill the cache,
        info = s.info("c")                                 # so this is cold again: still correct)
    (seg,) = segment_files(store_path)
    with open(seg, "r+b") as f:  # damage layer 3
        pos = info.offset + info.stored_bytes - 3 * real_kv[0].nbytes + 77
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x10]))
    _evict(store_path)
    with tierstore.open(store_path, direct_reads="always") as s:
        with pytest.raises(tierstore.CorruptionError):
            s.get("c")
        _evict(store_path)
        assert np.array_equal(s.get("c", layers=range(0, 3)).data, real_kv[:3])


def test_direct_read_refused_falls_back(store_path, real_kv, monkeypatch):
    with tierstore.open(store_path, direct_reads="always") as s:
        s.put("c", KVCache(real_kv))
        s.flush()
        fd, dfd = s._engine.files.acquire(1)
        s._engine.files.release(1)
        real = s._engine.io.preadv

        def refuse(f, b, o, *flags):
            if f == dfd:
                raise OSError(22, "Invalid argument")
            return real(f, b, o, *flags)

        monkeypatch.setattr(s._engine.io, "preadv", refuse)
        _evict(store_path)
        assert np.array_equal(s.get("c").data, real_kv)
        if DEFAULT_IO.cached_fraction(fd, 0, 4096) is not None:
            assert not s._engine.files.dio.direct


def test_small_reads_fill_the_page_cache(store_path, real_kv):
    """Without a DRAM tier a cold read smaller than 8 MiB goes through the page cache: the next
    one is warm."""
    with tierstore.open(store_path, dram_bytes=0) as s:
        s.put("c", KVCache(real_kv))
        s.flush()
        _evict(store_path)
        s.get("c", layers=2)
        fd, dfd = s._engine.files.acquire(1)
        s._engine.files.release(1)
        frac = DEFAULT_IO.cached_fraction(fd, s.info("c").offset, s.info("c").stored_bytes)
        if frac is None:
            pytest.skip("cachestat(2) is not available on this kernel")
        assert 0 < frac < 0.5  # one layer of six, and nothing else (no readahead)


def test_with_a_dram_tier_cold_layer_reads_go_direct(store_path, real_kv, monkeypatch):
    """With the default DRAM tier a cold read of 64 KiB or more skips the page cache (O_DIRECT):
    the tier, which holds a first read on probation, is where repeated reads find it."""
    with tierstore.open(store_path) as s:
        s.put("c", KVCache(real_kv))
        s.flush()
        fd, dfd = s._engine.files.acquire(1)
        s._engine.files.release(1)
        if DEFAULT_IO.cached_fraction(fd, 0, 4096) is None:
            pytest.skip("cachestat(2) is not available on this kernel: cold reads stay buffered")
        used: list[int] = []
        real = s._engine.io.preadv
        monkeypatch.setattr(s._engine.io, "preadv", lambda f, b, o, *fl: used.append(f) or real(f, b, o, *fl))
        _evict(store_path)
        assert np.array_equal(s.get("c", layers=2).data[0], real_kv[2])  # first read: direct
        assert used == [dfd]
        info = s.info("c")
        assert DEFAULT_IO.cached_fraction(fd, info.offset, info.stored_bytes) == 0  # the page cache untouched
        assert np.array_equal(s.get("c", layers=2).data[0], real_kv[2])  # second: from the tier, no I/O
        assert used == [dfd]
        assert np.array_equal(s.get("c", layers=2).data[0], real_kv[2])  # third: a DRAM hit, no read
        assert used == [dfd] and s.info("c").tiers == ("dram", "ssd")


def test_direct_reads_option_validated(store_path):
    with pytest.raises(tierstore.InvalidObject):
        tierstore.open(store_path, direct_reads=True)
    with tierstore.open(store_path, direct_reads="never") as s:
        s.put("a", Blob(b"1" * 10_000_000))
        assert s._engine.files.acquire(1)[1] == -1
        s._engine.files.release(1)
        assert s.get("a").data == b"1" * 10_000_000


def test_large_warm_extent_read_in_halves_is_verified(store_path):
    """A warm extent of 4 MiB or more is read and checksummed as two halves on two threads
    (CRCs combined): a clean one reads back, damage in either half is CorruptionError."""
    big = np.random.default_rng(5).standard_normal((1, 2, 8, 1024, 128)).astype(np.float16)  # one 4 MiB layer
    assert big[0].nbytes >= seglib.SPLIT_MIN
    with tierstore.open(store_path, dram_bytes=0, direct_reads="never") as s:
        s.put("big", KVCache(big))
        s.flush()
        assert np.array_equal(s.get("big").data, big)
        info = s.info("big")
    (seg,) = segment_files(store_path)
    start = info.offset + info.stored_bytes - big[0].nbytes
    for pos in (start + 100, start + big[0].nbytes - 100):  # first half, second half
        with open(seg, "r+b") as f:
            f.seek(pos)
            b = f.read(1)
            f.seek(pos)
            f.write(bytes([b[0] ^ 0x20]))
        with tierstore.open(store_path, dram_bytes=0, direct_reads="never") as s, \
                pytest.raises(tierstore.CorruptionError):
            s.get("big")
        with open(seg, "r+b") as f:  # repaired: reads back again
            f.seek(pos)
            f.write(b)
        with tierstore.open(store_path, dram_bytes=0, direct_reads="never") as s:
            assert np.array_equal(s.get("big").data, big)


def test_recover_never_deletes_a_put_made_after_it_let_go_of_the_lock(tmp_path, monkeypatch):
    """recover decides which keys lost the record that deleted them (a damaged DELETE with no
    header copy: the key would come back) under the writer lock, lets go of it, then deletes
    them as an ordinary writer: a writer that got in between and put one of those keys again
    keeps its put (it used to be deleted, acknowledged or not).  Its twin: without that put,
    the key stays deleted."""
    import json
    import subprocess
    import sys

    from tierstore.engine import repair

    def damaged_store(path):
        with tierstore.open(path, segment_bytes="1MiB", header_copies=False) as s:
            s.put("K", tierstore.Blob(b"v1" * 1000))
            s.delete("K")
            for i in range(6):
                s.put(f"filler{i}", tierstore.Blob(os.urandom(300_000)))  # seals the DELETE's segment
        out = subprocess.run([sys.executable, "-m", "tierstore", "dump", path, "--json"], capture_output=True,
                             text=True, timeout=120).stdout
        for sg in json.loads(out)["segments"]:
            for r in sg.get("records", []):
                if r["type"] == "delete" and r.get("key") == "K":
                    with open(sg["path"], "r+b") as f:
                        f.seek(r["offset"])
                        f.write(b"\xaa" * 48)
                    return
        raise AssertionError("no DELETE of K")

    twin = str(tmp_path / "twin")
    damaged_store(twin)
    assert [k["key"] for k in repair.recover(twin)["stale_keys_deleted"]] == ["K"]
    with tierstore.open(twin, readonly=True) as r:
        assert not r.contains("K")

    path = str(tmp_path / "s")
    damaged_store(path)
    real_open_engine = repair.open_engine

    def a_writer_gets_in_first(*a, **k):  # the moment between the rebuild and the deletes
        subprocess.run([sys.executable, "-c", "import sys, tierstore\nwith tierstore.open(sys.argv[1]) as s:\n"
                        "    s.put('K', tierstore.Blob(b'v3'))\n", path], check=True, timeout=120)
        return real_open_engine(*a, **k)

    monkeypatch.setattr(repair, "open_engine", a_writer_gets_in_first)
    result = repair.recover(path)
    assert result["stale_keys_deleted"] == []
    with tierstore.open(path, readonly=True) as r:
        assert r.get("K").data == b"v3"


@pytest.mark.parametrize("damage", ["truncate", "zero", "remove"])
def test_recover_consults_the_old_index_when_a_sealed_segment_lost_its_tail(tmp_path, damage):
    """A sealed segment cut at a record boundary (or zeroed from there, or gone) reads as a clean
    end and an LSN gap: no damage found.  recover consulted the previous index only when it found
    damage, so the older version of an overwritten key, and a deleted key, came back (a cold
    review, 2026-12-03; fsck --fix said "repaired, ok").  Now the index is the witness: those
    keys are deleted, not brought back; the rest stay.  Its twin: an intact store keeps all."""
    path = str(tmp_path / "s")
    with tierstore.open(path, segment_bytes=32768) as s:
        s.put("keep", Blob(b"K" * 30))
        s.put("x", Blob(b"OLD" * 10))
        s.put("y", Blob(b"DEL" * 10))
        s.put("pad", Blob(b"p" * 20000))
        s.put("x", Blob(b"NEW" * 10))
        s.delete("y")
        at = s.info("x")
        s.put("big", Blob(b"b" * 40000))  # seals that segment
        s.put("z", Blob(b"Z" * 10))
    seg = os.path.join(path, "segments", f"{at.segment:016x}.tseg")
    assert seg != segment_files(path)[-1]
    if damage == "remove":
        os.remove(seg)
    else:
        with open(seg, "r+b") as f:
            if damage == "truncate":
                f.truncate(at.offset)
            else:
                size = os.path.getsize(seg)
                f.seek(at.offset)
                f.write(bytes(size - at.offset))
    result = repair.recover(path, lock_timeout=0)
    with tierstore.open(path, create=False) as s:
        assert not s.contains("y")
        assert not s.contains("x") or bytes(s.get("x").data) == b"NEW" * 10
        assert bytes(s.get("z").data) == b"Z" * 10
        if damage != "remove":
            assert bytes(s.get("keep").data) == b"K" * 30
    # what is gone is named: the segment's objects when it is gone (its lost tail's replaced
    # and deleted keys otherwise), never "no damage found" (a new user's try, 2026-12-04)
    lost = sorted(k["key"] for k in result["lost_keys"])
    stale = sorted(k["key"] for k in result["stale_keys_deleted"])
    assert (lost, stale) == (["pad"] if damage == "remove" else [], ["x", "y"])


def test_recover_names_the_objects_a_missing_segment_took(tmp_path, capsys):
    """A middle segment removed: recover said "no damage found", exit 0, and fsck then "ok" --
    its objects were gone without a word (fsck --fix the same).  Now both name each one; the
    twin, an intact store, says "no damage found" and lists nothing."""
    from tierstore.cli import main

    def make(path):
        with tierstore.open(path, segment_bytes="64KiB") as s:
            for i in range(12):
                s.put(f"k{i}", Blob(bytes([i]) * 20000), namespace="a")
        return segment_files(path)

    for command in (["recover"], ["fsck", "--fix"]):
        path = str(tmp_path / command[0])
        os.remove(make(path)[1])
        capsys.readouterr()
        assert main([*command, path]) in (0, 6)
        out = capsys.readouterr().out
        gone = [k for k in (f"k{i}" for i in range(12)) if f"a/{k}: LOST" in out]
        with tierstore.open(path, create=False) as s:
            assert sorted(gone) == sorted(set(f"k{i}" for i in range(12)) - set(s.keys(namespace="a")))
        assert gone and "no damage found" not in out
        assert main(["recover", path, "--json"]) == 0  # (a second recover: nothing more is lost)
        assert json.loads(capsys.readouterr().out)["lost_keys"] == []
    twin = str(tmp_path / "twin")
    make(twin)
    capsys.readouterr()
    assert main(["recover", twin]) == 0
    out = capsys.readouterr().out
    assert "no damage found" in out and "LOST" not in out


def test_recover_of_an_intact_store_keeps_every_object(tmp_path):
    path = str(tmp_path / "s")
    with tierstore.open(path, segment_bytes=32768) as s:
        for i in range(20):
            s.put(f"k{i}", Blob(bytes([i]) * 5000))
        s.delete("k3")
        s.put("k4", Blob(b"again"))
    repair.recover(path, lock_timeout=0)
    with tierstore.open(path, create=False) as s:
        assert sorted(s.keys()) == sorted(f"k{i}" for i in range(20) if i != 3)
        assert bytes(s.get("k4").data) == b"again" and bytes(s.get("k7").data) == bytes([7]) * 5000


def test_recover_does_not_take_another_stores_index_as_its_witness(tmp_path):
    """An index copied in from another store (same keys missing, other LSNs) is not this store's
    witness: recover rebuilds and keeps every object of the segments."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    with tierstore.open(a) as s:
        for i in range(10):
            s.put(f"k{i}", Blob(bytes([i]) * 100))
    with tierstore.open(b) as s:
        s.put("other", Blob(b"o"))
    shutil.rmtree(os.path.join(a, "index"))
    shutil.copytree(os.path.join(b, "index"), os.path.join(a, "index"))
    repair.recover(a, lock_timeout=0)
    with tierstore.open(a, create=False) as s:
        assert sorted(s.keys()) == sorted(f"k{i}" for i in range(10))


@pytest.mark.parametrize("field", ["minor", "ro_compat", "incompat", "major", "major-flipped"])
def test_a_writer_refuses_a_store_with_a_sealed_segment_of_a_newer_format(tmp_path, field):
    """SPEC.md §3.1: a writer MUST refuse a store holding a segment of a newer minor version, or
    with read-only-compatible bits it does not know.  Only the segments replayed at open were
    checked, so a sealed one was let through and written beside (a cold review, 2026-12-03).
    Readers still read it; recover exits 3 (cannot open), not 2 (usage)."""
    import struct
    import subprocess
    import sys

    from tierstore.format import constants as fmt
    from tierstore.format import record as rec

    path = str(tmp_path / "s")
    with tierstore.open(path, segment_bytes=16384) as s:
        for i in range(4):
            s.put(f"k{i}", Blob(bytes([65 + i]) * 9000))
    segs = segment_files(path)
    assert len(segs) > 2
    with open(segs[1], "r+b") as f:  # a sealed segment
        at, value = {"minor": (10, struct.pack("<H", fmt.FORMAT_MINOR + 1)),
                     "ro_compat": (24, struct.pack("<Q", 1 << 40)),
                     "incompat": (16, struct.pack("<Q", 1 << 40))}.get(field, (8, struct.pack("<H", 2)))
        f.seek(at)
        f.write(value)
        if field != "major-flipped":  # (a written header: its checksum holds; a flipped byte: it fails)
            f.seek(0)
            head = f.read(fmt.SEGMENT_HEADER_CRC_OFFSET)
            f.seek(fmt.SEGMENT_HEADER_CRC_OFFSET)
            f.write(struct.pack("<I", rec.crc32c(head)))
    if field == "major-flipped":  # damage, not a newer format: the store opens, and reads
        with tierstore.open(path, create=False) as s:
            assert bytes(s.get("k3").data) == b"D" * 9000
        return
    newer = tierstore.ReadOnlyError if field in ("minor", "ro_compat") else tierstore.FormatVersionError
    with pytest.raises(newer) as err:
        tierstore.open(path, create=False)
    assert {"minor": "format 1.", "ro_compat": "feature bits 0x10000000000", "incompat": "incompatible features",
            "major": "format 2."}[field] in err.value.message
    if newer is tierstore.ReadOnlyError:  # readers still read it
        with tierstore.open(path, create=False, readonly=True) as r:
            assert bytes(r.get("k0").data) == b"A" * 9000
    else:  # no reader may
        with pytest.raises(tierstore.FormatVersionError):
            tierstore.open(path, create=False, readonly=True)
    out = subprocess.run([sys.executable, "-m", "tierstore", "recover", path], capture_output=True, text=True)
    assert out.returncode == 3, out.stderr


@pytest.mark.parametrize("damaged", [True, False])
def test_recover_keeps_an_index_changed_at_rest_in_quarantine_and_no_witness(tmp_path, damaged, monkeypatch):
    """An index whose bytes changed at rest in a page (fsck: its checksum differs from the stamp)
    passes LMDB's offline verifier, which does not read values: recover consulted it as its
    witness (its LSNs decide which keys are stale) and replaced it unkept (a new user's try,
    2026-12-04).  Now it is quarantined and not consulted; every object is kept.  Twin: an
    intact index is consulted and simply replaced."""
    from tierstore.engine.index import verify_lmdb

    path = str(tmp_path / "s")
    with tierstore.open(path) as s:
        for i in range(50):
            s.put(f"k{i}", Blob(bytes([i]) * 3000))
    if damaged:
        with open(os.path.join(path, "index", "data.mdb"), "r+b") as f:
            f.seek(4096 * 4 + 2000)
            chunk = f.read(64)
            f.seek(4096 * 4 + 2000)
            f.write(bytes(b ^ 0xFF for b in chunk))
        assert verify_lmdb(os.path.join(path, "index")) == []  # (what let it through)
        assert not repair.fsck(path).ok
    consulted = []
    real = repair._previous_index
    monkeypatch.setattr(repair, "_previous_index", lambda root: consulted.append(real(root)) or consulted[-1])
    result = repair.recover(path, lock_timeout=0)
    assert (consulted[0] is None) == damaged  # a witness only when sound
    if damaged:
        assert result["old_index"].startswith("quarantined to ") and "changed at rest" in result["old_index"]
        kept = result["old_index"].split("quarantined to ", 1)[1].split(" (", 1)[0]
        assert os.path.exists(os.path.join(kept, "data.mdb"))
        with open(os.path.join(kept, "REASON.txt")) as f:
            assert "changed at rest" in f.read()
    else:
        assert result["old_index"].startswith("replaced")
    assert result["lost_keys"] == [] and result["stale_keys_deleted"] == []
    with tierstore.open(path, create=False) as s:
        assert {k: bytes(s.get(k).data) for k in s.keys()} == {f"k{i}": bytes([i]) * 3000 for i in range(50)}
    assert repair.fsck(path, deep=True).ok
