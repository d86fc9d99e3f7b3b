"""Recovery: replay the log tail into the index, rebuild the index from segments, check a store.

Algorithm (SPEC.md §7.4), run under the writer lock when a store opens writable:

1. Read the index's applied position (segment, offset, LSN).  If the record there is not a
   valid record with that LSN, the index is ahead of (or inconsistent with) the log:
   rebuild it from segments.
2. Scan from the applied position, checking headers, dense LSNs and payload checksums.
3. The last segment ends at its first invalid or incomplete record: cut it there (a torn
   tail is a clean end of log).  If a valid record follows the damage, the cut bytes are
   first copied to ``quarantine/``: nothing that might be user data is deleted silently.
4. Damage inside a sealed (synced) segment is corruption: ``CorruptionError`` unless
   repairing (``tierstore recover``), which quarantines the damaged bytes and resumes at the
   next valid record.
5. Apply the replayed records to the index in one durable transaction.

This module owns those decisions.  It never changes a record that is part of the valid log.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from . import format as fmt
from . import record as rec
from . import segment as seglib
from .errors import CorruptionError, TierstoreError
from .fileio import PosixIO, read_all, write_all
from .index import Applied, Index, Location, Op


@dataclass
class Damage:
    segment: int
    offset: int
    reason: str
    bytes_dropped: int
    quarantined_to: str | None = None


@dataclass
class LogScan:
    """What a scan of the log found: the records to apply and where the valid log ends."""

    ops: list[Op] = field(default_factory=list)
    active: int = 0
    tail: int = fmt.SEGMENT_HEADER_SIZE
    next_lsn: int = 1
    last: Applied = Applied(0, 0, 0, 0)
    damage: list[Damage] = field(default_factory=list)
    removed_segments: list[int] = field(default_factory=list)
    bytes_scanned: int = 0


def _op(seg: int, off: int, hdr: rec.RecordHeader) -> Op:
    loc = Location(seg, off, hdr) if hdr.type == fmt.REC_PUT else None
    return Op(hdr.namespace, hdr.key, hdr.lsn, seg, off, hdr.record_len, loc)


def quarantine_bytes(io: PosixIO, root: str, fd: int, seg_id: int, start: int, end: int, reason: str) -> str:
    """Copy bytes [start, end) of a segment into quarantine/ (synced); returns the file path."""
    qdir = os.path.join(root, fmt.QUARANTINE_DIR)
    os.makedirs(qdir, exist_ok=True)
    name = f"{time.strftime('%Y%m%dT%H%M%S')}-{seglib.segment_name(seg_id)}-{start:x}-{end:x}.bin"
    path = os.path.join(qdir, name)
    out = io.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        pos = start
        while pos < end:
            chunk = io.pread(fd, min(end - pos, 8 << 20), pos)
            if not chunk:
                break
            write_all(io, out, [chunk], pos - start)
            pos += len(chunk)
        io.fsync(out)
    finally:
        io.close(out)
    with open(os.path.join(qdir, name + ".txt"), "w") as f:
        f.write(f"segment {seg_id} bytes [{start}, {end}): {reason}\n")
    io.fsync_dir(qdir)
    return path


def scan_log(io: PosixIO, root: str, store_uuid: bytes | None, start: Applied | None, *, writable: bool,
             repair: bool, verify_sealed: bool = False,
             progress: Callable[[int], None] | None = None) -> LogScan:
    """Scan the log from ``start`` (None: from the first segment) and fix its end if writable.

    Returns the records past ``start`` in LSN order.  See the module docstring for the rules.
    """
    seg_dir = os.path.join(root, fmt.SEGMENTS_DIR)
    segs = seglib.list_segments(io, seg_dir)
    result = LogScan()
    if not segs:
        raise CorruptionError("store has no segment files", path=seg_dir)
    if start is not None and start.lsn:
        segs = [s for s in segs if s >= start.segment]
        if not segs or segs[0] != start.segment:
            raise _IndexAhead(f"segment {start.segment} of the applied position is missing")
    expect: int | None = start.lsn + 1 if start is not None and start.lsn else None
    result.last = start if start is not None else Applied(0, 0, 0, 0)
    for n, seg in enumerate(segs):
        is_last = n == len(segs) - 1
        path = os.path.join(seg_dir, seglib.segment_name(seg))
        fd = io.open(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            try:
                header = seglib.read_segment_header(io, fd, path=path, seg_id=seg)
            except CorruptionError:
                if is_last and n > 0 and _no_records(io, fd):
                    # Created but its header never became durable: no record was acknowledged in it.
                    if writable:
                        io.close(fd)
                        fd = -1
                        _quarantine_file(io, root, path)
                        result.removed_segments.append(seg)
                    break
                raise
            if store_uuid is not None and header.store_uuid != store_uuid:
                raise CorruptionError("segment belongs to another store (store uuid differs)", path=path, segment=seg)
            store_uuid = header.store_uuid
            if writable and not header.writable:
                from .errors import ReadOnlyError
                raise ReadOnlyError(f"segment written by format {header.major}.{header.minor}; this tierstore "
                                    f"writes {fmt.FORMAT_MAJOR}.{fmt.FORMAT_MINOR}", path=path, segment=seg)
            first = start is not None and start.lsn and seg == start.segment
            offset = rec.align_up(start.end, fmt.RECORD_ALIGN) if first else fmt.SEGMENT_HEADER_SIZE
            if not first:
                if expect is not None and header.base_lsn != expect:
                    _sealed_damage(result, io, root, fd, seg, fmt.SEGMENT_HEADER_SIZE,
                                   f"segment base LSN {header.base_lsn} where {expect} was expected", repair, path)
                expect = header.base_lsn
            size = io.size(fd)
            scanner = seglib.SegmentScanner(io, fd, seg, path=path, start=offset, expect_lsn=expect,
                                            verify_payload=is_last or verify_sealed, size=size)
            while True:
                for off, hdr in scanner.records():
                    result.ops.append(_op(seg, off, hdr))
                    result.last = Applied(seg, off, hdr.lsn, off + hdr.record_len)
                stop = scanner.stop
                assert stop is not None
                if stop.reason == "end" or is_last:
                    break
                # damage inside a sealed segment: corruption (or, repairing, skip past it)
                nxt = _resync(io, fd, seg, path, stop.offset, size)
                _sealed_damage(result, io, root, fd, seg, stop.offset, f"{stop.reason}: {stop.detail}", repair, path,
                               end=nxt)
                if nxt >= size:
                    break
                scanner = seglib.SegmentScanner(io, fd, seg, path=path, start=nxt, expect_lsn=None,
                                                verify_payload=verify_sealed, size=size)
            expect = scanner.expect_lsn
            result.bytes_scanned += size - offset
            if progress is not None:
                progress(size - offset)
            result.active = seg
            result.tail = stop.offset if is_last else size
            if is_last and stop.reason != "end":
                dropped = size - stop.offset
                d = Damage(seg, stop.offset, f"{stop.reason}: {stop.detail}", dropped)
                if writable:
                    if stop.valid_after:
                        d.quarantined_to = quarantine_bytes(io, root, fd, seg, stop.offset, size, d.reason)
                    io.ftruncate(fd, stop.offset)
                    io.fdatasync(fd)
                result.damage.append(d)
        finally:
            if fd >= 0:
                io.close(fd)
    if result.last.lsn:
        result.next_lsn = result.last.lsn + 1
    elif expect is not None:
        result.next_lsn = expect
    return result


class _IndexAhead(TierstoreError):
    """The index names log positions that the log does not have: rebuild it."""


def _no_records(io: PosixIO, fd: int) -> bool:
    size = io.size(fd)
    if size <= fmt.SEGMENT_HEADER_SIZE:
        return True
    head = io.pread(fd, fmt.RECORD_HEADER_SIZE, fmt.SEGMENT_HEADER_SIZE)
    try:
        rec.parse_fixed(head)
        return False
    except CorruptionError:
        return True


def _quarantine_file(io: PosixIO, root: str, path: str) -> str:
    qdir = os.path.join(root, fmt.QUARANTINE_DIR)
    os.makedirs(qdir, exist_ok=True)
    dest = os.path.join(qdir, f"{time.strftime('%Y%m%dT%H%M%S')}-{os.path.basename(path)}")
    io.rename(path, dest)
    io.fsync_dir(os.path.dirname(path))
    io.fsync_dir(qdir)
    return dest


def _resync(io: PosixIO, fd: int, seg: int, path: str, offset: int, size: int) -> int:
    """The offset of the next record with a valid header after ``offset`` (or ``size``)."""
    scanner = seglib.SegmentScanner(io, fd, seg, path=path, size=size)
    win = seglib._Window(io, fd, size)
    off = rec.align_up(offset + 1, fmt.RECORD_ALIGN)
    step = 1 << 20
    while off < size:
        chunk = win.get(off, step + fmt.RECORD_HEADER_SIZE)
        i = chunk.find(fmt.RECORD_MAGIC)
        while i != -1:
            q = off + i
            if q % fmt.RECORD_ALIGN == 0 and scanner._header_ok(win, q):
                return q
            i = chunk.find(fmt.RECORD_MAGIC, i + 1)
        off += step
    return size


def _sealed_damage(result: LogScan, io: PosixIO, root: str, fd: int, seg: int, offset: int, reason: str,
                   repair: bool, path: str, end: int | None = None) -> None:
    if not repair:
        raise CorruptionError(f"damaged record in sealed segment ({reason})", path=path, segment=seg, offset=offset,
                              hint="run `tierstore recover PATH`: it quarantines the damaged bytes and keeps the rest")
    if end is None:
        result.damage.append(Damage(seg, offset, reason, 0))
        return
    q = quarantine_bytes(io, root, fd, seg, offset, end, reason)
    result.damage.append(Damage(seg, offset, reason, end - offset, q))


# --- index rebuild -------------------------------------------------------------------------

REBUILD_BATCH = 20_000


def rebuild_index(io: PosixIO, root: str, *, repair: bool = False, verify_payloads: bool = False,
                  progress: Callable[[int], None] | None = None) -> LogScan:
    """Build a fresh index from the segments alone and swap it in (the old one is kept in
    quarantine/).  The store must not be open in this process."""
    seg_dir = os.path.join(root, fmt.SEGMENTS_DIR)
    segs = seglib.list_segments(io, seg_dir)
    if not segs:
        raise CorruptionError("store has no segment files: nothing to rebuild from", path=seg_dir)
    first_path = os.path.join(seg_dir, seglib.segment_name(segs[0]))
    fd = io.open(first_path, os.O_RDONLY)
    try:
        store_uuid = seglib.read_segment_header(io, fd, path=first_path, seg_id=segs[0]).store_uuid
    finally:
        io.close(fd)
    scan = scan_log(io, root, store_uuid, None, writable=True, repair=repair, verify_sealed=verify_payloads,
                    progress=progress)
    tmp = os.path.join(root, fmt.INDEX_DIR + ".rebuild")
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    idx = Index.open(tmp, writable=True)
    try:
        idx.initialise(store_uuid)
        ops = scan.ops
        for i in range(0, max(len(ops), 1), REBUILD_BATCH):
            batch = ops[i : i + REBUILD_BATCH]
            last = batch[-1] if batch else None
            pos = Applied(last.segment, last.offset, last.lsn, last.offset + last.record_len) if last else Applied(0, 0, 0, 0)
            idx.apply(batch, pos)
        idx.sync()
    finally:
        idx.close()
    final = os.path.join(root, fmt.INDEX_DIR)
    if os.path.exists(final):
        qdir = os.path.join(root, fmt.QUARANTINE_DIR)
        os.makedirs(qdir, exist_ok=True)
        io.rename(final, os.path.join(qdir, f"{time.strftime('%Y%m%dT%H%M%S')}-{fmt.INDEX_DIR}-{os.getpid()}"))
    io.rename(tmp, final)
    io.fsync_dir(root)
    return scan


def check_applied(io: PosixIO, root: str, applied: Applied) -> bool:
    """Is the record at the index's applied position in the log, with that LSN?"""
    if applied.lsn == 0:
        return True
    path = os.path.join(root, fmt.SEGMENTS_DIR, seglib.segment_name(applied.segment))
    try:
        fd = io.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        head = io.pread(fd, fmt.HEADER_MAX_BYTES, applied.offset)
        hdr = rec.decode_header(head)
        return hdr.lsn == applied.lsn and applied.offset + hdr.record_len == applied.end and io.size(fd) >= applied.end
    except CorruptionError:
        return False
    finally:
        io.close(fd)


# --- checking (fsck) ---------------------------------------------------------------------------


@dataclass
class Finding:
    severity: str  # "error" | "warning"
    what: str
    segment: int | None = None
    offset: int | None = None
    namespace: str | None = None
    key: Any = None

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if v is not None}
        if isinstance(d.get("key"), bytes):
            d["key"] = d["key"].hex()
        return d


@dataclass
class Report:
    findings: list[Finding] = field(default_factory=list)
    objects: int = 0
    segments: int = 0
    bytes_verified: int = 0

    @property
    def ok(self) -> bool:
        return not any(f.severity == "error" for f in self.findings)

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "objects": self.objects, "segments": self.segments,
                "bytes_verified": self.bytes_verified, "findings": [f.as_dict() for f in self.findings]}


def check_store(io: PosixIO, root: str, index: Index, *, deep: bool,
                progress: Callable[[int], None] | None = None) -> Report:
    """Check both directions (index -> records, log -> index); with ``deep``, every checksum.

    Read-only.  Every indexed object must point at a record with the same header bytes, and
    every record of the log that is the newest for its key must be what the index holds.
    """
    report = Report()
    seg_dir = os.path.join(root, fmt.SEGMENTS_DIR)
    segs = seglib.list_segments(io, seg_dir)
    report.segments = len(segs)
    fds: dict[int, int] = {}
    try:
        for seg in segs:
            fds[seg] = io.open(os.path.join(seg_dir, seglib.segment_name(seg)), os.O_RDONLY)
        with index.read() as view:
            applied = view.applied()
            indexed: dict[tuple[bytes, bytes], Location] = {}
            for ns, key, loc in _items_checked(view, report):
                indexed[(ns, key)] = loc
                report.objects += 1
                where = {"segment": loc.segment, "offset": loc.offset, "namespace": ns.decode("utf-8", "replace"),
                         "key": key}
                fd = fds.get(loc.segment)
                if fd is None:
                    report.findings.append(Finding("error", "index entry points at a missing segment", **where))
                    continue
                on_disk = io.pread(fd, loc.header.header_len, loc.offset)
                if on_disk != loc.header.raw:
                    report.findings.append(Finding("error", "index entry does not match the record in the segment", **where))
                    continue
                if io.size(fd) < loc.offset + loc.header.record_len:
                    report.findings.append(Finding("error", "record extends past the end of its segment", **where))
                    continue
                if deep:
                    bad = seglib.verify_extents(io, fd, loc.offset, loc.header)
                    if bad is not None:
                        report.findings.append(Finding("error", f"extent {bad} checksum mismatch", **where))
                    report.bytes_verified += sum(loc.header.extent_lengths)
                    if progress is not None:
                        progress(sum(loc.header.extent_lengths))
        # the other direction: the newest record of every key in the applied log is indexed
        newest: dict[tuple[bytes, bytes], tuple[int, int, int]] = {}
        for seg in segs:
            path = os.path.join(seg_dir, seglib.segment_name(seg))
            try:
                seglib.read_segment_header(io, fds[seg], path=path, seg_id=seg)
            except TierstoreError as e:
                report.findings.append(Finding("error", f"bad segment header: {e.message}", segment=seg, offset=0))
                continue
            scanner = seglib.SegmentScanner(io, fds[seg], seg, path=path, verify_payload=False)
            for off, hdr in scanner.records():
                if hdr.lsn > applied.lsn:
                    break
                newest[(hdr.namespace, hdr.key)] = (hdr.lsn, seg, off) if hdr.type == fmt.REC_PUT else (hdr.lsn, -1, -1)
            stop = scanner.stop
            if stop is not None and stop.reason != "end":
                sev = "error" if stop.valid_after or seg != segs[-1] else "warning"
                report.findings.append(Finding(sev, f"log damaged ({stop.reason}: {stop.detail})", segment=seg,
                                               offset=stop.offset))
        for (ns, key), (lsn, seg, off) in newest.items():
            loc = indexed.get((ns, key))
            where = {"namespace": ns.decode("utf-8", "replace"), "key": key}
            if seg == -1:
                if loc is not None and loc.header.lsn < lsn:
                    report.findings.append(Finding("error", "deleted object is still indexed", **where))
            elif loc is None:
                report.findings.append(Finding("error", "live record is not indexed", segment=seg, offset=off, **where))
            elif (loc.segment, loc.offset) != (seg, off) and loc.header.lsn < lsn:
                report.findings.append(Finding("error", "index points at an older version", segment=seg, offset=off, **where))
        qdir = os.path.join(root, fmt.QUARANTINE_DIR)
        if os.path.isdir(qdir) and os.listdir(qdir):
            report.findings.append(Finding("warning", f"quarantine/ holds {len(os.listdir(qdir))} file(s) from earlier recoveries"))
    finally:
        for fd in fds.values():
            io.close(fd)
    return report


def _items_checked(view: Any, report: Report) -> Any:
    it = iter(view.txn.cursor(db=view.index.objects))
    from .index import decode_location
    for k, v in it:
        ns, key = k[1 : 1 + k[0]], k[1 + k[0] :]
        try:
            yield ns, key, decode_location(v, ns, key)
        except CorruptionError as e:
            report.findings.append(Finding("error", f"bad index entry: {e.message}", namespace=ns.decode("utf-8", "replace"), key=key))
