"""Inspecting stores and segment files without opening anything for writing (``tierstore dump``).

``dump_segment`` decodes one segment file, header and records, from its bytes alone (no
index, no lock): it works on a copy, a whole segment moved to quarantine/ or a damaged store;
``dump_range`` decodes what still decodes in a quarantined byte range (``quarantine/*.bin``).  ``dump_store``
lists a store's log (every record, live or not) or describes one object in detail.  Both
return plain dicts for ``--json``; this module never writes.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import Any

from ..engine import segment as seglib
from ..engine.fileio import DEFAULT_IO, PosixIO
from ..errors import CorruptionError, TierstoreError
from ..format import constants as fmt
from ..format import record as rec


def _key_text(key: bytes, flags: int) -> str:
    return key.decode("utf-8", "replace") if flags & fmt.FLAG_KEY_STR else "0x" + key.hex()


def describe_record(off: int, h: rec.RecordHeader) -> dict[str, Any]:
    types = {fmt.REC_PUT: "put", fmt.REC_DELETE: "delete", fmt.REC_PAD: "pad", fmt.REC_HOLE: "hole",
             fmt.REC_GROUP: "group", fmt.REC_SYNC: "sync", fmt.REC_HEADERS: "headers"}
    out: dict[str, Any] = {"offset": off, "lsn": h.lsn, "type": types.get(h.type, f"unknown({h.type:#x})"),
                           "record_len": h.record_len, "header_len": h.header_len,
                           "header_crc": f"{h.header_crc:08x}"}
    if h.type in (fmt.REC_GROUP, fmt.REC_HOLE, fmt.REC_HEADERS):
        out["count"] = h.meta["count"]  # HEADERS: how many header copies it holds (SPEC.md §4.5)
    if h.type == fmt.REC_SYNC:
        out["durable"] = h.meta["durable"]
    ref = rec.parse_ref_key(h.key) if h.namespace == fmt.REF_NAMESPACE else None
    if ref is not None:  # a session's reference (SPEC.md §5.4): show what it points at
        ns, session, _ = ref
        out.update(namespace=ns.decode("utf-8", "replace"),
                   session="the object's own (it was put without a session)" if session == fmt.ANCHOR_SESSION
                   else f"session {session.decode('utf-8', 'replace')!r}",
                   key_hash=h.key[-fmt.REF_KEY_HASH_BYTES:].hex(), ref_key="0x" + h.key.hex())
        if h.type == fmt.REC_PUT:
            out.update(kind="ref", key=_key_text(h.meta["key"], fmt.FLAG_KEY_STR if h.meta["key_str"] else 0))
        return out
    if h.type in (fmt.REC_PUT, fmt.REC_DELETE):
        out.update(namespace=h.namespace.decode("utf-8", "replace"), key=_key_text(h.key, h.flags),
                   key_type="text" if h.flags & fmt.FLAG_KEY_STR else "bytes")
    if h.type == fmt.REC_PUT:
        meta = dict(h.meta)
        if "dtype" in meta:
            meta["dtype"] = fmt.DTYPES.get(meta["dtype"], ("?",))[0]
        out.update(kind=fmt.KIND_NAMES.get(h.kind, str(h.kind)), codec=fmt.CODEC_NAMES.get(h.codec, str(h.codec)),
                   align=1 << h.align_log2, meta=meta,
                   extents=[{"offset": o, "length": n, "crc32c": f"{c:08x}"}
                            for o, n, c in zip(h.offsets, h.extent_lengths, h.extent_crcs)])
    return out


def dump_segment(path: str, *, io: PosixIO = DEFAULT_IO, verify: bool = True) -> dict[str, Any]:
    """Header and records of one segment file, where its log ends (``end``) and the damage on
    the way (``damaged``: each record whose payload fails its checksums, with its header, and
    each run of bytes that does not decode; the scan goes on after it, as reads do)."""
    return _gathered(segment_events(path, io=io, verify=verify))[0]


def _gathered(events: Iterable[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """``segment_events`` (of one segment or several) gathered into one dict per segment."""
    out: list[dict[str, Any]] = []
    for kind, item in events:
        if kind == "segment":
            out.append(dict(item))
            if "error" not in item["header"]:
                out[-1]["records"], out[-1]["damaged"] = [], []
        elif kind == "end":
            out[-1]["end"] = item
        else:
            out[-1]["records" if kind == "record" else "damaged"].append(item)
    return out


def segment_events(path: str, *, io: PosixIO = DEFAULT_IO, verify: bool = True) -> Iterator[tuple[str, dict[str, Any]]]:
    """``dump_segment``'s contents as they are read, in file order: ("segment", {path, size,
    header}) first, then ("record", ...) and ("damaged", ...) as the scan meets them, then
    ("end", ...) (none after a header that does not decode): a segment of millions of records
    is never held whole."""
    name = os.path.basename(path)
    seg_id = seglib.parse_segment_name(name)
    fd = seglib.open_segment(io, path)
    try:
        head: dict[str, Any] = {"path": path, "size": io.size(fd)}
        try:
            h = seglib.read_segment_header(io, fd, path=path, seg_id=seg_id)
            head["header"] = {"format": f"{h.major}.{h.minor}", "store_uuid": h.store_uuid.hex(),
                              "segment_id": h.segment_id, "base_lsn": h.base_lsn, "created_ns": h.created_ns}
        except TierstoreError as e:
            head["header"] = {"error": e.message}
            yield "segment", head
            return
        yield "segment", head
        start = fmt.SEGMENT_HEADER_SIZE
        while True:
            scanner = seglib.SegmentScanner(io, fd, h.segment_id, path=path, start=start, verify_payload=verify)
            for off, hdr in scanner.records():
                yield "record", describe_record(off, hdr)
            stop = scanner.stop
            assert stop is not None
            if stop.reason == "end" or not stop.valid_after:
                break
            bad: dict[str, Any] = {"offset": stop.offset, "reason": stop.reason, "detail": stop.detail}
            if stop.header is not None:  # only its payload failed: the next record follows it
                bad["record"] = describe_record(stop.offset, stop.header)
                nxt = rec.align_up(stop.offset + stop.header.record_len, fmt.RECORD_ALIGN)
            else:
                nxt = scanner.next_valid(stop.offset)
                assert nxt is not None  # (valid_after)
                bad["length"] = nxt - stop.offset
            yield "damaged", bad
            start = nxt
        yield "end", {"offset": stop.offset, "reason": stop.reason, "detail": stop.detail,
                      "valid_records_after": stop.valid_after}
    finally:
        io.close(fd)


def dump_range(path: str) -> dict[str, Any]:
    """A range of a segment that a recovery moved to ``quarantine/`` (``*.bin``, its note beside it):
    the records that still decode in it, from its first byte (a damaged record's start), where
    bytes do not decode (resuming at the next record magic, 8-aligned), and each decoded record
    that is not whole (``damaged``: cut by the range's end, or an extent failing its checksum)."""
    with open(path, "rb") as f:
        data = f.read()
    note = None
    if os.path.exists(path + ".txt"):
        with open(path + ".txt") as f:
            note = f.read().strip()
    out: dict[str, Any] = {"path": path, "size": len(data), "note": note, "records": [], "undecodable": [],
                           "damaged": []}
    p = 0
    while p + fmt.RECORD_HEADER_SIZE <= len(data):
        try:
            hdr = rec.decode_header(data[p : p + fmt.HEADER_MAX_BYTES])
        except TierstoreError as e:
            nxt = data.find(fmt.RECORD_MAGIC, p + fmt.RECORD_ALIGN)
            while nxt != -1 and nxt % fmt.RECORD_ALIGN:
                nxt = data.find(fmt.RECORD_MAGIC, nxt + 1)
            end = len(data) if nxt == -1 else nxt
            out["undecodable"].append({"offset": p, "length": end - p, "why": e.message})
            p = end
            continue
        out["records"].append(describe_record(p, hdr))
        why = _not_whole(data, p, hdr)
        if why is not None:
            out["damaged"].append({"offset": p, "lsn": hdr.lsn, "detail": why})
        p = rec.align_up(p + hdr.record_len, fmt.RECORD_ALIGN)
    if p < len(data) and any(data[p:]):  # (a torn record header, shorter than one: zeros are no record)
        out["undecodable"].append({"offset": p, "length": len(data) - p,
                                   "why": f"shorter than a record header ({fmt.RECORD_HEADER_SIZE} bytes): torn"})
    return out


def _not_whole(data: bytes, p: int, hdr: rec.RecordHeader) -> str | None:
    """Why the record whose header decoded at ``data[p:]`` is not whole there, or None."""
    if p + hdr.record_len > len(data):
        return f"torn: the record's {hdr.record_len} bytes run {p + hdr.record_len - len(data)} past the range's end"
    view = memoryview(data)
    for i, (o, n, c) in enumerate(zip(hdr.offsets, hdr.extent_lengths, hdr.extent_crcs)):
        if rec.crc32c(view[p + o : p + o + n]) != c:
            return f"extent {i} checksum mismatch"
    return None


def store_segment_events(path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """``segment_events`` of every segment of the store at ``path``, one after another."""
    seg_dir = os.path.join(path, fmt.SEGMENTS_DIR)
    for s in seglib.list_segments(DEFAULT_IO, seg_dir):
        try:
            yield from segment_events(os.path.join(seg_dir, seglib.segment_name(s)))
        except FileNotFoundError:  # retired since the listing by another writer (a compaction, the
            continue  # SSD budget): its records live on in later segments, or are gone for good


def dump_store(path: str, key: str | bytes | None = None, *, namespace: str = "default") -> dict[str, Any]:
    """The log of a store (every segment), or, with ``key``, one object: its info and record."""
    from .. import open as open_store

    if key is None:
        return {"path": path, "segments": _gathered(store_segment_events(path))}
    with open_store(path, create=False, readonly=True) as store:
        for attempt in range(3):  # the object moves if a compaction retires its segment meanwhile
            info = store.info(key, namespace=namespace)
            seg = os.path.join(path, fmt.SEGMENTS_DIR, seglib.segment_name(info.segment))
            try:
                fd = seglib.open_segment(DEFAULT_IO, seg)
                break
            except FileNotFoundError:
                if attempt == 2:
                    raise
        try:
            hdr = rec.decode_header(DEFAULT_IO.pread(fd, fmt.HEADER_MAX_BYTES, info.offset))
            bad = seglib.verify_extents(DEFAULT_IO, fd, info.offset, hdr)
        except CorruptionError as e:  # the record's header in the segment (the index held a good copy)
            return {"path": path, "namespace": namespace, "segment": info.segment, "record": None, "info": None,
                    "damaged": {"extent": None, "offset": info.offset, "detail": f"record header: {e.message}"}}
        finally:
            DEFAULT_IO.close(fd)
        return {"path": path, "namespace": namespace, "segment": info.segment,
                "record": describe_record(info.offset, hdr),
                "damaged": None if bad is None else {"extent": bad, "detail": f"extent {bad} checksum mismatch"},
                "info": {k: (list(v) if isinstance(v, tuple) else v) for k, v in info.__dict__.items()
                         if k not in ("key",)} | {"key": _key_text(hdr.key, hdr.flags),
                                                   "key_type": "text" if hdr.flags & fmt.FLAG_KEY_STR else "bytes"}}
