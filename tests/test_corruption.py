"""Media corruption: bytes flipped in every region of every file kind, and the log truncated at
every record boundary +-1.  Reads raise CorruptionError naming the segment and offset and
never return wrong bytes; fsck reports the damage; recover quarantines it and keeps every
intact object.  Each hostile case has its twin: the undamaged store reads back whole.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import tierstore
from tierstore import Blob, KVCache, Vectors
from tierstore.engine import repair
from tierstore.engine import segment as seglib
from tierstore.engine.fileio import DEFAULT_IO
from tierstore.format import constants as fmt

from .conftest import segment_files

KV = np.arange(3 * 2 * 2 * 16 * 32, dtype=np.float16).reshape(3, 2, 2, 16, 32)
VEC = np.arange(40 * 24, dtype=np.float32).reshape(40, 24)


def expected() -> dict[str, bytes]:
    return {"kv": KV.tobytes(), "vec": VEC.tobytes(), "small": b"s" * 300, "page": b"p" * 5000,
            "other": b"o" * 700, "last": b"l" * 200}


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("corrupt") / "template")
    with tierstore.open(root, segment_bytes="48KiB") as s:
        s.put("kv", KVCache(KV))
        s.put("vec", Vectors(VEC, ids=np.arange(40)), meta={"m": 1})
        s.put("old", Blob(b"superseded" * 100))
        s.put("small", Blob(b"s" * 300))
        s.put("page", Blob(b"p" * 5000))
        s.delete("old")
        s.put("other", Blob(b"o" * 700))
        s.put("last", Blob(b"l" * 200))
    assert len(segment_files(root)) >= 2
    return root


def read_all(root: str, damage: list | None = None) -> tuple[dict[str, bytes], list[tierstore.CorruptionError]]:
    """Every object that reads back, and the CorruptionErrors of those that do not (``damage``
    collects what opening the store cut from the end of the log)."""
    good, errors = {}, []
    with tierstore.open(root) as s:
        if damage is not None:
            damage.extend(s.recovery.get("damage", []))
        for k in s.keys():
            try:
                obj = s.get(k)
            except tierstore.CorruptionError as e:
                errors.append(e)
                continue
            good[k] = obj.data if isinstance(obj, Blob) else obj.data.tobytes()
    return good, errors


def regions(path: str) -> list[tuple[str, int]]:
    """(region name, offset) of every region of a segment file, found by decoding it."""
    out = [("segment magic", 0), ("segment version", 9), ("segment uuid", 45), ("segment id", 57),
           ("segment crc", 113), ("segment reserved", 2000)]
    fd = os.open(path, os.O_RDONLY)
    try:
        sc = seglib.SegmentScanner(DEFAULT_IO, fd, seglib.parse_segment_name(os.path.basename(path)), path=path)
        for off, h in sc.records():
            name = {fmt.REC_PUT: "put", fmt.REC_DELETE: "delete"}.get(h.type, "other")
            out += [(f"{name} magic", off), (f"{name} crc", off + 5), (f"{name} type", off + 8),
                    (f"{name} lengths", off + 13), (f"{name} lsn", off + 17), (f"{name} key", off + 48 + 2)]
            if h.meta:
                out.append((f"{name} meta", off + 48 + len(h.namespace) + len(h.key) + 3))
            if h.extent_lengths:
                table = h.header_len - 16 * len(h.extent_lengths)
                out += [(f"{name} extent table", table + off + 9)]
                for i, (o, n) in enumerate(zip(h.offsets, h.extent_lengths)):
                    if n:
                        out += [(f"{name} extent {i} start", off + o), (f"{name} extent {i} end", off + o + n - 1)]
                gap_start = off + h.header_len
                if h.offsets and h.offsets[0] > h.header_len + 8:
                    out.append((f"{name} padding", gap_start + 4))
    finally:
        os.close(fd)
    return out


def flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xA5]))


def test_undamaged_twin_reads_whole(template, tmp_path):
    work = str(tmp_path / "w")
    shutil.copytree(template, work)
    good, errors = read_all(work)
    assert good == expected() and not errors


def test_flips_in_every_segment_region(template, tmp_path, capsys):
    want = expected()
    tried = detected_by_read = detected_by_fsck = 0
    cases = [(seg_i, name, off) for seg_i, seg in enumerate(segment_files(template)) for name, off in regions(seg)]
    for seg_i, name, off in cases:
        work = str(tmp_path / f"c{tried}")
        shutil.copytree(template, work)
        seg = segment_files(work)[seg_i]
        if off >= os.path.getsize(seg):
            shutil.rmtree(work)
            continue
        flip(seg, off)
        tried += 1
        cut_at_open: list = []
        try:
            good, errors = read_all(work, cut_at_open)
        except tierstore.TierstoreError as e:  # the damage is in the part replayed at open
            assert isinstance(e, (tierstore.CorruptionError, tierstore.FormatVersionError)), (name, e)
            good, errors = {}, [e]
        for k, v in good.items():
            assert want[k] == v, f"{name}: wrong bytes returned for {k}"  # never wrong bytes
        for e in errors:
            assert e.segment is not None and e.offset is not None and e.path, (name, e)
        detected_by_read += bool(errors)
        # fsck (read-only) must see what reads saw, and --deep whatever touches a checksummed byte
        try:
            with tierstore.open(work, readonly=True) as s:
                shallow = repair.check_store(DEFAULT_IO, work, s._engine.index, deep=False)
                deep = repair.check_store(DEFAULT_IO, work, s._engine.index, deep=True)
        except (tierstore.CorruptionError, tierstore.FormatVersionError):
            shallow = deep = None  # cannot even open: fsck through the CLI reports it (exit code 3)
        if errors and shallow is not None:
            assert not shallow.ok, name
        if "padding" not in name and "reserved" not in name and deep is not None and deep.ok:
            # the damage was invisible to a deep check only if it hit nothing that counts, or if it
            # was the end of the log: indistinguishable from a torn write, cut at open, quarantined
            assert not errors and (good == want and _dead_region(name) or
                                   all(d["quarantined_to"] for d in cut_at_open) and cut_at_open), name
        detected_by_fsck += shallow is None or not deep.ok
        # recover keeps every intact object and quarantines the damage
        result = repair.recover(work)
        after, errors_after = read_all(work)
        assert not errors_after, (name, errors_after)
        for k, v in after.items():
            assert want[k] == v, (name, k)
        lost = set(want) - set(after)
        if lost:  # reported and kept: by recover, or already when the open cut the end of the log
            assert result["damage"] or cut_at_open, (name, lost)
            assert all(os.path.exists(d["quarantined_to"]) for d in result["damage"] if d["quarantined_to"])
        assert len(lost) <= 1 or "segment" in name, (name, lost)  # one damaged record costs one object
        with tierstore.open(work, readonly=True) as s:
            assert repair.check_store(DEFAULT_IO, work, s._engine.index, deep=True).ok, name
        shutil.rmtree(work)
    with capsys.disabled():
        print(f"\ncorruptions tried: {tried}, detected by reads: {detected_by_read}, by fsck: {detected_by_fsck}")
    assert tried >= 60


def _dead_region(name: str) -> bool:
    return name.startswith("delete") or "padding" in name


def test_truncation_at_every_record_boundary(template, tmp_path):
    want = expected()
    last = segment_files(template)[-1]
    fd = os.open(last, os.O_RDONLY)
    try:
        sc = seglib.SegmentScanner(DEFAULT_IO, fd, seglib.parse_segment_name(os.path.basename(last)), path=last)
        bounds = [(off, off + h.record_len) for off, h in sc.records()]
    finally:
        os.close(fd)
    cuts = sorted({c + d for start, end in bounds for c in (start, end) for d in (-1, 0, 1)})
    for cut in cuts:
        work = str(tmp_path / f"t{cut}")
        shutil.copytree(template, work)
        shutil.rmtree(os.path.join(work, "index"))  # the log alone must say what survived
        with open(segment_files(work)[-1], "r+b") as f:
            f.truncate(cut)
        good, errors = read_all(work)
        assert not errors
        allowed = {**want, "old": b"superseded" * 100}  # the DELETE of "old" may be what was cut
        for k, v in good.items():
            assert allowed[k] == v
        if "old" in good:
            assert "other" not in good and "last" not in good  # a prefix: nothing after the lost DELETE
        survivors = {k for k in want if k in good}
        # a prefix of the last segment's records survives: the older segments are untouched
        assert {"kv", "vec"} <= survivors or cut < 4096 + 1, (cut, survivors)
        shutil.rmtree(work)


def test_index_file_flips(template, tmp_path):
    """The index is derived: damage in it is found by fsck --deep (LMDB's verifier, run before
    liblmdb touches the file) or by the header checksums of its entries, and recover rebuilds it."""
    want = expected()
    data = Path(template, "index", "data.mdb").read_bytes()
    offsets = sorted({data.find(b"\x05small"), data.find(b"\x03vec") + 20, 4096 * 2 + 16, 4096 * 3 + 40, 20, 4100})
    for i, off in enumerate(o for o in offsets if 0 <= o < len(data)):
        work = str(tmp_path / f"i{i}")
        shutil.copytree(template, work)
        flip(os.path.join(work, "index", "data.mdb"), off)
        from tierstore.engine.index import Index
        try:
            idx = Index.open(os.path.join(work, "index"), writable=False)
        except tierstore.CorruptionError:
            idx = None  # LMDB itself refuses the file (a damaged meta page)
        try:
            deep = repair.check_store(DEFAULT_IO, work, idx, deep=True) if idx is not None else None
        except tierstore.CorruptionError:
            deep = None
        finally:
            if idx is not None:
                idx.close()
        shutil.copytree(work, work + "-open")
        good, errors = read_all(work + "-open")  # a writable open rebuilds an index it cannot use
        assert good == want and not errors, off
        repair.recover(work)
        good, errors = read_all(work)
        assert good == want and not errors, off
        assert deep is None or deep.ok or deep.findings
        shutil.rmtree(work)


def test_cached_index_values_are_exact_and_bounded(store_path):
    """Decoded index values are cached by the whole value: a damaged copy of a cached value is
    still decoded (and refused), never answered from the cache; the cache has a byte budget."""
    from tierstore.engine import index as ix

    with tierstore.open(store_path) as s:
        s.put("k", tierstore.Blob(b"v" * 100))
        s.flush()
        with s._engine.index.read() as view:
            value = view.txn.get(ix.index_key(b"default", b"k"), db=s._engine.index.objects)
    loc = ix.decode_location(value, b"default", b"k")
    assert value in ix._HEADER_CACHE and loc.header.key == b"k"
    for pos in (30, len(value) - 3):  # past the location, inside the header and its checksums
        bad = bytearray(value)
        bad[pos] ^= 0x01
        with pytest.raises(tierstore.CorruptionError):
            ix.decode_location(bytes(bad), b"default", b"k")
    for i in range(ix._HEADER_CACHE_BYTES // len(value) + 10):  # overflow the budget: it starts over
        ix._remember(value + i.to_bytes(8, "little"), loc)
        assert ix._header_cache_used <= ix._HEADER_CACHE_BYTES
