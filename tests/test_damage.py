"""Damage costs one object, never the log after it (issue 14): a flipped payload bit of an object
in the last segment, with and without the index, read-only and writable, before and after
`recover`; references to what a repair dropped; one answer from every path."""

from __future__ import annotations

import os
import shutil

import pytest

import tierstore
from tierstore import Blob
from tierstore.engine import repair

LATER = [f"k{i}" for i in range(6)]


def damaged_store(path: str, *, segment_bytes: str = "1GiB") -> None:
    """c has an older version; its newer one, synced (later puts and a clean close follow it),
    gets one flipped payload bit."""
    with tierstore.open(path, segment_bytes=segment_bytes) as s:
        s.put("c", Blob(b"old-c" * 3000), session="s1")
        s.put("c", Blob(b"new-c" * 3000), session="s1")
        for i, k in enumerate(LATER):
            s.put(k, Blob(bytes([i]) * 20000))
        info = s.info("c")
    seg = os.path.join(path, "segments", f"{info.segment:016x}.tseg")
    with open(seg, "r+b") as f:
        f.seek(info.offset + 4096 + 100)
        b = f.read(1)
        f.seek(info.offset + 4096 + 100)
        f.write(bytes([b[0] ^ 1]))


def answers(path: str, **kw) -> dict:
    out = {}
    with tierstore.open(path, **kw) as s:
        for k in s.keys():
            try:
                out[k] = s.get(k).data[:5]
            except tierstore.CorruptionError:
                out[k] = "CorruptionError"
    return out


WANT = {"c": "CorruptionError", **{k: bytes([i]) * 5 for i, k in enumerate(LATER)}}


@pytest.mark.parametrize("how", ["index kept", "index deleted", "index kept, read-only", "index damaged"])
def test_one_answer_with_or_without_the_index(store_path, how):
    damaged_store(store_path)
    if how == "index deleted":
        shutil.rmtree(os.path.join(store_path, "index"))
    if how == "index damaged":
        with open(os.path.join(store_path, "index", "data.mdb"), "r+b") as f:
            f.truncate(8192)
    # never the older version of c, never a later object lost
    assert answers(store_path, readonly=how.endswith("read-only")) == WANT
    report = repair.fsck(store_path, deep=True)
    assert not report.ok and any("checksum" in f.what for f in report.findings)


def test_recover_drops_only_the_damaged_object(store_path):
    damaged_store(store_path)
    result = repair.recover(store_path)
    assert [(d["key"], d["quarantined_to"] is not None) for d in result["damage"]] == [("c", True)]
    after = answers(store_path)
    assert after == {k: v for k, v in WANT.items() if k != "c"}  # c gone, not its older version back
    assert repair.fsck(store_path, deep=True).ok


def test_a_torn_tail_is_still_cut(store_path):
    """The twin: the very last put before a crash, which no SYNC record vouches for, is a torn
    write when its payload is incomplete: the older version of its key is the answer."""
    s = tierstore.open(store_path, index_commit_ms=1e9, index_batch=10**9)
    s.put("c", Blob(b"old-c" * 3000))
    s.put("c", Blob(b"new-c" * 3000))
    info = s.info("c")
    from .conftest import crash

    crash(s)
    seg = os.path.join(store_path, "segments", f"{info.segment:016x}.tseg")
    with open(seg, "r+b") as f:
        f.seek(info.offset + 4096 + 100)
        f.write(b"\x00" * 64)  # the page never reached the disk
    assert answers(store_path) == {"c": b"old-c"}


def test_repair_drops_references_to_what_it_dropped(store_path):
    """In a sealed segment the flip loses only the object; recover also drops the session
    references to it, so fsck --deep is clean afterwards (it was not: issue 14, item 1)."""
    damaged_store(store_path, segment_bytes="64KiB")
    with tierstore.open(store_path) as s:
        assert s.info("c").segment < s.stats()["segments"]  # sealed
    with pytest.raises(tierstore.CorruptionError):
        tierstore.open(store_path, readonly=True).get("c")
    result = repair.recover(store_path)
    assert [r["session"] for r in result["references_dropped"]] == ["s1"]
    assert repair.fsck(store_path, deep=True).ok
    with tierstore.open(store_path) as s:
        assert s.session_keys("s1") == [] and "c" not in s.keys()


def test_a_damaged_dictionary_is_found_and_its_blobs_are_set_aside(store_path):
    """fsck --deep finds a blob whose zstd dictionary is gone; recover moves such blobs to
    quarantine/ (unreadable without it) and leaves a clean store (issue 14, item 5)."""
    samples = [f'{{"turn": {i}, "text": "hello number {i}"}}'.encode() for i in range(300)]
    with tierstore.open(store_path, segment_bytes="64KiB") as s:
        did = s.train_dictionary(samples, size=1024)
        s.put("doc", Blob(samples[7]), codec=f"zstd:dict={did}")
        s.put("plain", Blob(b"p" * 100))
        for i in range(4):
            s.put(f"pad{i}", Blob(bytes([i]) * 30000))  # the dictionary's segment is sealed
    from tierstore.engine import segment as seglib

    seg = os.path.join(store_path, "segments", seglib.segment_name(1))
    with open(seg, "rb") as f:
        data = f.read()
    at = data.find(bytes([0x37, 0xA4, 0x30, 0xEC]))  # the dictionary's bytes (its magic)
    with open(seg, "r+b") as f:
        f.seek(at + 64)
        f.write(b"\xff")
    assert not repair.fsck(store_path, deep=True).ok
    result = repair.recover(store_path)
    assert [b["key"] for b in result["blobs_without_dictionary"]] == ["doc"]
    assert os.path.exists(result["blobs_without_dictionary"][0]["quarantined_to"])
    report = repair.fsck(store_path, deep=True)
    assert report.ok, [f.what for f in report.findings]
    with tierstore.open(store_path) as s:
        assert "doc" not in s.keys() and s.get("plain").data == b"p" * 100


def test_a_full_last_segment_still_gets_its_sync_record(store_path):
    """The last put fills its segment to within a SYNC record's length: the clean close opens the
    next segment for the SYNC record, so a damaged last record is CorruptionError with the index
    and without it (it used to be cut as a torn tail when the index was rebuilt)."""
    seg_bytes = 64 << 10
    with tierstore.open(store_path, segment_bytes=seg_bytes) as s:
        s.put("a1", Blob(b"a" * 1000))
        a = s.info("a1")
        header = a.stored_bytes - 1000
        start = -(-(a.offset + a.stored_bytes) // 4096) * 4096  # a synced put ends its page
        n = seg_bytes - 16 - start - header
        s.put("b2", Blob(b"b" * n))
        b = s.info("b2")
        assert b.segment == a.segment and seg_bytes - 64 < b.offset + b.stored_bytes <= seg_bytes
    segs = sorted(os.listdir(os.path.join(store_path, "segments")))
    assert len(segs) == 2  # the second holds the SYNC record alone
    with open(os.path.join(store_path, "segments", segs[0]), "r+b") as f:
        f.seek(b.offset + b.stored_bytes - 10)
        byte = f.read(1)
        f.seek(b.offset + b.stored_bytes - 10)
        f.write(bytes([byte[0] ^ 1]))
    kept = answers(store_path)
    shutil.rmtree(os.path.join(store_path, "index"))
    assert answers(store_path) == kept == {"a1": b"aaaaa", "b2": "CorruptionError"}


def _sealed_store(path: str) -> tuple[dict[str, bytes], object]:
    """Twelve 20 KB blobs over 64 KiB segments; returns their bytes and the info of one in a sealed segment."""
    with tierstore.open(path, segment_bytes=64 << 10) as s:
        for i in range(12):
            s.put(f"k{i}", Blob(os.urandom(20000)))
        data = {f"k{i}": s.get(f"k{i}").data for i in range(12)}
        victim = s.info("k2")
    return data, victim


def _flip(path: str, seg: int, offset: int) -> None:
    with open(os.path.join(path, "segments", f"{seg:016x}.tseg"), "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def test_recover_restores_a_damaged_header_from_the_index(store_path):
    """A record header in a sealed segment that cannot be read, with an intact index: recover writes
    it back from the index's checksummed copy (every extent matches it), so no object is lost, and
    the store is clean afterwards (issue: recover used to drop the object)."""
    data, victim = _sealed_store(store_path)
    assert victim.segment < 3  # sealed
    _flip(store_path, victim.segment, victim.offset + 20)  # inside the fixed header: its checksum fails
    report = repair.recover(store_path)
    assert [d["key"] for d in report["damage"]] == ["k2"] and "restored" in report["damage"][0]["reason"]
    assert report["damage"][0]["quarantined_to"]  # the damaged bytes kept for inspection
    with tierstore.open(store_path) as s:
        assert {k: s.get(k).data for k in s.keys()} == data
    assert repair.fsck(store_path, deep=True).ok


def test_without_the_index_recover_still_drops_only_that_object(store_path):
    """The twin: no index to vouch for the header, so the object is quarantined -- and nothing else."""
    data, victim = _sealed_store(store_path)
    _flip(store_path, victim.segment, victim.offset + 20)
    shutil.rmtree(os.path.join(store_path, "index"))
    repair.recover(store_path)
    with tierstore.open(store_path) as s:
        assert {k: s.get(k).data for k in s.keys()} == {k: v for k, v in data.items() if k != "k2"}


def test_a_header_copy_is_not_restored_over_a_damaged_payload(store_path):
    """Header and payload both damaged: the index's copy does not match the payload, so nothing is
    written back; the object is dropped as before, and no wrong bytes are ever served."""
    data, victim = _sealed_store(store_path)
    _flip(store_path, victim.segment, victim.offset + 20)
    _flip(store_path, victim.segment, victim.offset + victim.stored_bytes - 100)  # in the blob's bytes
    report = repair.recover(store_path)
    assert not any("restored" in d["reason"] for d in report["damage"])
    with tierstore.open(store_path) as s:
        assert {k: s.get(k).data for k in s.keys()} == {k: v for k, v in data.items() if k != "k2"}
