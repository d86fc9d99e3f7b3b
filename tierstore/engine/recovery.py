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
5. The caller applies the returned records to the index in one durable transaction.

This module owns those decisions.  It never changes a record that is part of the valid log.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ..errors import CorruptionError, FormatVersionError, ReadOnlyError, TierstoreError
from ..format import constants as fmt
from ..format import record as rec
from . import segment as seglib
from .fileio import PosixIO, write_all
from .index import Applied, Index, Location, Op, stamp, untrusted


class IndexAhead(TierstoreError):
    """The index names log positions the log does not have: it must be rebuilt."""


# a rebuild reads a sealed segment whose header fails its checksum with the header a repair would
# write (SPEC.md §7.4) only when the damaged header differs from that one in at most this many bytes
# of the fields that name the segment (§3.1 offsets; not format_minor, created_ns, creator or crc)
IMPLIED_HEADER_FIELDS = ((0, 10), (12, 72))
IMPLIED_HEADER_SLACK = 2


@dataclass
class Damage:
    segment: int
    offset: int
    reason: str
    bytes_dropped: int
    quarantined_to: str | None = None
    namespace: str | None = None  # the object that was lost, when its header could still be read
    key: str | None = None
    kept: bool = False  # the object survived (its header restored from a copy): only bytes were set aside


@dataclass
class LogScan:
    """What a scan of the log found: the records to apply and where the valid log ends."""

    ops: list[Op] = field(default_factory=list)
    old_index: str | None = None  # what a rebuild did with the index it replaced
    active: int = 0
    tail: int = fmt.SEGMENT_HEADER_SIZE
    next_lsn: int = 1
    last: Applied = Applied(0, 0, 0, 0)
    damage: list[Damage] = field(default_factory=list)
    removed_segments: list[int] = field(default_factory=list)
    bytes_scanned: int = 0
    store_uuid: bytes | None = None  # the store's, from the segment headers read
    # (segment, offset, LSN, header) of each DELETE a repair wrote in place of a damaged record:
    # its copy goes into the next HEADERS record, superseding the damaged record's (SPEC.md §7.6)
    rewritten: list[tuple[int, int, int, bytes]] = field(default_factory=list)


@dataclass
class _Group:
    offset: int
    header: rec.RecordHeader
    left: int  # records still to come
    ops: list[Op]


def _op(seg: int, off: int, hdr: rec.RecordHeader) -> Op | None:
    """The index operation of a PUT or DELETE record (None for records that change nothing)."""
    if hdr.type == fmt.REC_PUT:
        return Op(hdr.namespace, hdr.key, hdr.lsn, seg, off, hdr.record_len, Location(seg, off, hdr))
    if hdr.type == fmt.REC_DELETE:
        return Op(hdr.namespace, hdr.key, hdr.lsn, seg, off, hdr.record_len, None)
    return None


def shown_key(key: bytes) -> str:
    """A key for a report: its text when it is printable UTF-8, else ``0x`` and its hex (as ``ls``
    shows bytes keys); never raw control bytes on a terminal."""
    try:
        text = key.decode("utf-8")
    except UnicodeDecodeError:
        return "0x" + key.hex()
    return text if text.isprintable() else "0x" + key.hex()


def _stamp() -> str:
    """A name prefix for quarantined files: time, then a nanosecond tie-breaker."""
    return time.strftime("%Y%m%dT%H%M%S") + f".{time.time_ns() % 10**9:09d}"


def quarantine_bytes(io: PosixIO, root: str, fd: int, seg_id: int, start: int, end: int, reason: str) -> str:
    """Copy bytes [start, end) of a segment into quarantine/ (synced); returns the file path."""
    qdir = os.path.join(root, fmt.QUARANTINE_DIR)
    os.makedirs(qdir, exist_ok=True)
    name = f"{_stamp()}-{seglib.segment_name(seg_id)}-{start:x}-{end:x}.bin"
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
    with open(path + ".txt", "w") as f:
        f.write(f"segment {seg_id} bytes [{start}, {end}): {reason}\n")
    io.fsync_dir(qdir)
    return path


def quarantine_file(io: PosixIO, root: str, path: str) -> str:
    """Move a whole file into quarantine/ (both directories synced)."""
    qdir = os.path.join(root, fmt.QUARANTINE_DIR)
    os.makedirs(qdir, exist_ok=True)
    dest = os.path.join(qdir, f"{_stamp()}-{os.path.basename(path)}")
    io.rename(path, dest)
    io.fsync_dir(os.path.dirname(path))
    io.fsync_dir(qdir)
    return dest


def damaged_v1_header(io: PosixIO, fd: int) -> bool:
    """Is this a format-1 segment header that fails its checksum (so a "newer version" in it is
    a damaged byte, not a newer format)?"""
    b = io.pread(fd, fmt.SEGMENT_HEADER.size, 0)
    if len(b) < fmt.SEGMENT_HEADER.size:
        return True
    return rec.crc32c(b[: fmt.SEGMENT_HEADER_CRC_OFFSET]) != int.from_bytes(b[fmt.SEGMENT_HEADER_CRC_OFFSET:
                                                                            fmt.SEGMENT_HEADER.size], "little")


def _store_uuid_of_others(io: PosixIO, seg_dir: str, skip: int) -> bytes | None:
    for seg in seglib.list_segments(io, seg_dir):
        if seg == skip:
            continue
        path = os.path.join(seg_dir, seglib.segment_name(seg))
        fd = seglib.open_segment(io, path)
        try:
            return seglib.read_segment_header(io, fd, path=path, seg_id=seg).store_uuid
        except TierstoreError:
            continue
        finally:
            io.close(fd)
    return None


def first_lsn_from(io: PosixIO, fd: int, seg: int, path: str, offset: int, size: int) -> int | None:
    """The LSN of the first record with one (PAD records have none) from ``offset`` on."""
    scanner = seglib.SegmentScanner(io, fd, seg, path=path, start=offset, verify_payload=False, size=size)
    for _, hdr in scanner.records():
        return hdr.lsn
    return None


def certified_after(io: PosixIO, fd: int, seg: int, path: str, offset: int, size: int) -> int:
    """The largest LSN that valid SYNC records after ``offset`` of a segment vouch for (0: none),
    scanning on past any further damage (SPEC.md §7.3)."""
    probe = seglib.SegmentScanner(io, fd, seg, path=path, verify_payload=False, size=size)
    best, q = 0, probe.next_valid(offset)
    while q is not None and q < size:
        scanner = seglib.SegmentScanner(io, fd, seg, path=path, start=q, verify_payload=False, size=size)
        for _, hdr in scanner.records():
            if hdr.type == fmt.REC_SYNC:
                best = max(best, hdr.meta["durable"])
        stop = scanner.stop
        if stop is None or stop.reason == "end" or stop.offset <= q:
            break
        q = probe.next_valid(stop.offset)
    return best


def base_disagrees(io: PosixIO, fd: int, seg: int, path: str, base_lsn: int) -> int | None:
    """The LSN of the valid record at the start of a segment when it is not the header's
    ``base_lsn`` (SPEC.md §7.1: they are equal), else None (equal, or no valid record there)."""
    scanner = seglib.SegmentScanner(io, fd, seg, path=path, verify_payload=False)
    if not scanner.header_at(fmt.SEGMENT_HEADER_SIZE):
        return None
    first = first_lsn_from(io, fd, seg, path, fmt.SEGMENT_HEADER_SIZE, io.size(fd))
    return first if first is not None and first != base_lsn else None


def has_no_records(io: PosixIO, fd: int) -> bool:
    """True when nothing past the segment header parses as a record header."""
    if io.size(fd) <= fmt.SEGMENT_HEADER_SIZE:
        return True
    try:
        rec.parse_fixed(io.pread(fd, fmt.RECORD_HEADER_SIZE, fmt.SEGMENT_HEADER_SIZE))
        return False
    except CorruptionError:
        return True


class _LogScanner:
    """One pass over the segments; see ``scan_log``."""

    def __init__(self, io: PosixIO, root: str, store_uuid: bytes | None, *, writable: bool, repair: bool,
                 verify_sealed: bool, progress: Callable[[int], None] | None, proven_lsn: int = 0,
                 verify_tail: bool = True,
                 witness: Callable[[int, int], rec.RecordHeader | None] | None = None,
                 skip: dict[tuple[int, int], tuple[int, int, int]] | None = None,
                 stop: tuple[int, int] | None = None) -> None:
        self.proven_lsn = proven_lsn  # records up to this LSN are known to have been synced
        self.stop = stop  # where the log is read as if it ended (scan_log)
        self.skip = skip  # the caller's own records: passed over unread (SegmentScanner)
        # repair: the previous index's copy of the record header at (segment, offset), if it had one
        self.witness = witness
        self._restored: set[tuple[int, int]] = set()
        # copies of damaged record headers found in HEADERS records (SPEC.md §4.5, §7.3), by
        # (segment, offset); None: no copy that verifies
        self._copies_found: dict[tuple[int, int], rec.RecordHeader | None] = {}
        self.verify_tail = verify_tail  # check payload checksums in the last segment
        self.io, self.root, self.store_uuid = io, root, store_uuid
        self.writable, self.repair, self.verify_sealed, self.progress = writable, repair, verify_sealed, progress
        self.seg_dir = os.path.join(root, fmt.SEGMENTS_DIR)
        self._next_seg: int | None = None  # the segment after the one being scanned
        self.result = LogScan()

    def _verify(self, is_last: bool) -> bool:
        return is_last and self.verify_tail or self.verify_sealed

    def run(self, start: Applied | None) -> LogScan:
        segs = seglib.list_segments(self.io, self.seg_dir)
        if not segs:
            raise CorruptionError("store has no segment files", path=self.seg_dir)
        resume = start is not None and start.lsn > 0
        if resume:
            assert start is not None
            segs = [s for s in segs if s >= start.segment]
            if not segs or segs[0] != start.segment:
                raise IndexAhead(f"segment {start.segment} of the applied position is missing")
            self.result.last = start
        if self.stop is not None:
            segs = [s for s in segs if s <= self.stop[0]]
        expect: int | None = start.lsn + 1 if resume and start is not None else None
        for n, seg in enumerate(segs):
            first = resume and n == 0
            offset = rec.align_up(start.end, fmt.RECORD_ALIGN) if first and start is not None else None
            self._next_seg = segs[n + 1] if n + 1 < len(segs) else None
            expect = self._segment(seg, is_first=n == 0, is_last=n == len(segs) - 1, offset=offset, expect=expect)
            if expect is None:
                break  # the last segment was never durably created
        r = self.result
        r.next_lsn = max(r.last.lsn + 1, expect or 1)
        r.store_uuid = self.store_uuid
        return r

    def _segment(self, seg: int, *, is_first: bool, is_last: bool, offset: int | None,
                 expect: int | None) -> int | None:
        io, r = self.io, self.result
        path = os.path.join(self.seg_dir, seglib.segment_name(seg))
        fd = seglib.open_segment(io, path, os.O_RDWR if self.writable else os.O_RDONLY)
        try:
            try:
                header = seglib.read_segment_header(io, fd, path=path, seg_id=seg)
            except (CorruptionError, FormatVersionError) as e:
                if isinstance(e, CorruptionError) and is_last and not is_first and has_no_records(io, fd):
                    # Created, but its header never became durable: nothing in it was acknowledged.
                    if self.writable:
                        io.close(fd)
                        fd = -1
                        quarantine_file(io, self.root, path)
                        r.removed_segments.append(seg)
                    return None
                if not damaged_v1_header(io, fd):
                    raise
                if self.repair and self.writable:
                    header = self._salvage_header(fd, seg, path, e, expect)
                else:
                    # (resuming inside this segment, its base LSN is not used: no bound on it).  The
                    # last segment too: a valid record after its header proves the header was synced
                    # (a segment is created durable before anything is appended to it, §7.2), and a
                    # writer never appends to a segment whose header it cannot read (log.py: it
                    # begins a new one), so the damaged one becomes a sealed segment read this way
                    implied = self._implied_header(fd, seg, path, e, expect if offset is None else None)
                    if implied is None:
                        raise
                    header = implied
            if self.store_uuid is not None and header.store_uuid != self.store_uuid:
                raise CorruptionError("segment belongs to another store (store uuid differs)", path=path, segment=seg,
                                      hint="a segment file of another store (or one whose header names another "
                                           "store) is in segments/: recover cannot repair that; move the file out "
                                           "of segments/ (`tierstore dump FILE` shows what it holds), then run "
                                           "`tierstore recover PATH`")
            self.store_uuid = header.store_uuid
            if self.writable and not header.writable:
                raise ReadOnlyError(header.newer(), path=path, segment=seg,
                                    hint="open it with readonly=True, or upgrade tierstore to write to it")
            if offset is None:
                offset = fmt.SEGMENT_HEADER_SIZE
                first = base_disagrees(io, fd, seg, path, header.base_lsn) if self.repair and self.writable else None
                if first is not None and (expect is None or first >= expect):
                    # a header whose checksum holds but whose base LSN is not its first record's (whose
                    # own checksum holds, and whose LSN does not go back): the header is wrong, not the
                    # record -- rewritten, the record kept (it was quarantined as "LSN x where y was
                    # expected", a review 2026-12-03)
                    header = self._salvage_header(fd, seg, path, CorruptionError(
                        f"base LSN {header.base_lsn} is not its first record's LSN {first}"), expect)
                if expect is not None and header.base_lsn < expect:
                    # LSNs never go back; a gap is legitimate (compaction deletes whole segments)
                    self._sealed_damage(fd, seg, path, offset, None,
                                        f"segment base LSN {header.base_lsn} below {expect}, the next expected")
                expect = header.base_lsn
            size = io.size(fd)
            if self.stop is not None and seg == self.stop[0]:
                size = min(size, max(self.stop[1], offset))
            scanner = seglib.SegmentScanner(io, fd, seg, path=path, start=offset, expect_lsn=expect,
                                            verify_payload=self._verify(is_last), size=size, skip=self.skip)
            group: _Group | None = None  # an atomic group (SPEC.md §7.7) whose records are still coming

            def take(off: int, hdr: rec.RecordHeader, copied: bool = False) -> None:
                nonlocal group
                if hdr.type == fmt.REC_GROUP:
                    if group is not None:  # never written: the open group is incomplete, apply none of it
                        self._incomplete_group(fd, seg, path, group, "a group inside a group")
                    group = _Group(off, hdr, hdr.meta["count"], [])
                    return
                op = _op(seg, off, hdr)
                if group is not None:
                    if op is not None:
                        group.ops.append(op)
                    group.left -= 1
                    if group.left:
                        return
                    r.ops.extend(group.ops)  # complete: all of it
                    group = None
                elif op is not None:
                    r.ops.append(op)
                if hdr.type != fmt.REC_HOLE and not copied:  # an applied position names a record with its
                    r.last = Applied(seg, off, hdr.lsn, off + hdr.record_len)  # own LSN and a valid header

            while True:
                for off, hdr in scanner.records():
                    take(off, hdr)
                stop = scanner.stop
                assert stop is not None
                # in the last segment, damage to what a SYNC record (or the previous index) proves was
                # synced is damage, not a torn write: nothing durable is cut (SPEC.md §7.3)
                proven = is_last and stop.reason != "end" and self._proven(
                    fd, seg, path, stop.header.lsn if stop.header is not None else scanner.expect_lsn,
                    stop.offset, size)
                if proven and stop.header is not None and not self.repair:
                    # a synced record whose payload fails its checksum: kept in the log and the index,
                    # its object unreadable (CorruptionError) until overwritten or deleted; scan on
                    bad = stop.header
                    take(stop.offset, bad)
                    keyed = bad.type == fmt.REC_PUT
                    r.damage.append(Damage(seg, stop.offset, f"{stop.reason}: {stop.detail}; the record was synced "
                                           "(a SYNC record says so): " + (
                                               "kept, its object unreadable" if keyed else
                                               f"a record of type {bad.type:#x} that changes no object, skipped"), 0,
                                           namespace=bad.namespace.decode("utf-8", "replace") if keyed else None,
                                           key=shown_key(bad.key) if keyed else None))
                    scanner = seglib.SegmentScanner(io, fd, seg, path=path,
                                                    start=rec.align_up(stop.offset + bad.record_len, fmt.RECORD_ALIGN),
                                                    expect_lsn=bad.lsn + 1, verify_payload=True, size=size)
                    continue
                if group is not None and not proven and (stop.reason == "end" or is_last):
                    if is_last:  # a crash interrupted the group: the log ends where it began
                        stop = seglib.ScanStop(group.offset, "torn", f"incomplete group ({group.left} of "
                                               f"{group.header.meta['count']} records missing)",
                                               valid_after=stop.reason != "end" and stop.valid_after)
                        scanner.expect_lsn = group.header.lsn
                        break
                    self._incomplete_group(fd, seg, path, group, "incomplete group at the end of a sealed segment")
                    group = None
                if stop.reason == "end" or (is_last and not proven):
                    break  # the end of the log (a torn tail of the last segment is cut below)
                # damage inside the log: corruption, or (repairing) quarantine it and go on
                why = f"{stop.reason}: {stop.detail}"
                bad = stop.header
                expected = scanner.expect_lsn
                if bad is None and self.repair:
                    if self._restore_header(fd, seg, path, stop.offset, expected, size, why):
                        # the header came back from a copy (the previous index's, a HEADERS
                        # record's): read the record again
                        scanner = seglib.SegmentScanner(io, fd, seg, path=path, start=stop.offset,
                                                        expect_lsn=expected, verify_payload=True, size=size)
                        continue
                    # a copy whose extents do not match: the payload is damaged too, but the copy
                    # still names the key (and where the record ends): handled as a damaged payload
                    copy = self._copy_of(seg, stop.offset, expected, size)
                    bad = copy if copy is not None and copy.type in (fmt.REC_PUT, fmt.REC_DELETE) else None
                if bad is not None and self.repair:
                    # the header is intact (or its copy is), the payload is not: quarantine the
                    # record, and put a DELETE of its key in its place so that an older version
                    # does not come back
                    end = rec.align_up(stop.offset + bad.record_len, fmt.RECORD_ALIGN)
                    keyed = bad.type in (fmt.REC_PUT, fmt.REC_DELETE)
                    self._sealed_damage(fd, seg, path, stop.offset, end, why,
                                        key=(bad.namespace, bad.key) if keyed else None)
                    self._rewrite(fd, seg, stop.offset, end, bad.lsn, 1, bad)
                    if keyed:
                        r.ops.append(Op(bad.namespace, bad.key, bad.lsn, seg, stop.offset, 0, None))
                    nxt: int | None = end
                    resume_lsn: int | None = bad.lsn + 1
                elif not self.repair and bad is None and group is None and \
                        (nxt := self._nothing_lost(fd, seg, path, scanner, stop.offset, expected, size)) is not None:
                    # a sealed segment's damaged bytes that held no record (padding, a PAD record):
                    # the log goes on with the LSN expected here; reported, nothing to repair for
                    resume_lsn = expected
                    r.damage.append(Damage(seg, stop.offset, f"{why}; no record in these bytes (the log goes on "
                                           f"with LSN {expected})", 0))
                elif not self.repair and bad is None and \
                        (copy := self._copy_of(seg, stop.offset, expected, size)) is not None:
                    # a record whose header is damaged, read with the copy a HEADERS record holds:
                    # kept, its object readable when every extent matches the copy (SPEC.md §7.3)
                    take(stop.offset, copy, copied=True)
                    intact = self._extents_match(fd, stop.offset, copy)
                    r.damage.append(Damage(seg, stop.offset, f"{why}; read with the copy of its header that a "
                                           "HEADERS record holds: " + ("every extent matches it, the object is kept"
                                                                       if intact else "its payload is damaged too, "
                                                                       "the object is unreadable"), 0,
                                           namespace=copy.namespace.decode("utf-8", "replace") or None,
                                           key=shown_key(copy.key) if copy.key else None))
                    scanner = seglib.SegmentScanner(io, fd, seg, path=path,
                                                    start=rec.align_up(stop.offset + copy.record_len, fmt.RECORD_ALIGN),
                                                    expect_lsn=copy.lsn + rec.lsn_span(copy),
                                                    verify_payload=self._verify(is_last), size=size)
                    continue
                else:
                    nxt = scanner.next_valid(stop.offset)
                    end = size if nxt is None else nxt
                    guess = None
                    if self.repair:
                        guess = rec.salvage(io.pread(fd, fmt.HEADER_MAX_BYTES, stop.offset), expected)
                    key = (guess[1], guess[2]) if guess is not None else None
                    self._sealed_damage(fd, seg, path, stop.offset, end, why, key=key)
                    after = first_lsn_from(io, fd, seg, path, nxt, size) if nxt is not None else None
                    lost = after - expected if after is not None and expected is not None else 0
                    if guess is not None and rec.align_up(stop.offset + guess[4], fmt.RECORD_ALIGN) <= end:
                        # the damaged header still names its key: hide it (as a DELETE in its place)
                        ns_, key_, lsn_ = guess[1], guess[2], guess[3]
                        stand_in = rec.RecordHeader(fmt.REC_PUT, 0, lsn_, guess[4], 0, 3, 0, ns_, key_, {}, (), (),
                                                    0, b"", ())
                        cut = rec.align_up(stop.offset + guess[4], fmt.RECORD_ALIGN)
                        self._rewrite(fd, seg, stop.offset, cut, lsn_, 1, stand_in)
                        self._rewrite(fd, seg, cut, end, lsn_ + 1, max(lost - 1, 0), None)
                        r.ops.append(Op(ns_, key_, lsn_, seg, stop.offset, 0, None))
                    else:
                        self._rewrite(fd, seg, stop.offset, end, expected or 0, max(lost, 0), None)
                    resume_lsn = expected + lost if lost > 0 and expected is not None else None
                if nxt is None or nxt >= size:
                    stop = seglib.ScanStop(size, "end")
                    break
                scanner = seglib.SegmentScanner(io, fd, seg, path=path, start=nxt, expect_lsn=resume_lsn,
                                                verify_payload=self._verify(is_last), size=size)
            r.bytes_scanned += size - offset
            if self.progress is not None:
                self.progress(size - offset)
            r.active = seg
            r.tail = stop.offset if is_last else size
            if is_last and stop.reason != "end":
                self._cut_tail(fd, seg, stop, size)
            return scanner.expect_lsn
        finally:
            if fd >= 0:
                io.close(fd)

    def _implied_header(self, fd: int, seg: int, path: str, error: TierstoreError,
                        expect: int | None) -> seglib.SegmentHeader | None:
        """Not repairing: the header a sealed segment whose own header fails its checksum is read
        with -- the one a repair writes (``_rebuilt_header``) -- when a valid record starts right
        after it, the log's LSNs do not go back there, and the damaged header differs from it in
        at most ``IMPLIED_HEADER_SLACK`` bytes of the fields that name the segment (magic,
        version, sizes, feature bits, store uuid, id, base LSN: one flipped byte, not another
        store's segment or a newer format's); reported as damage.  None otherwise (the caller
        raises)."""
        io = self.io
        scanner = seglib.SegmentScanner(io, fd, seg, path=path, verify_payload=False)
        if not scanner.header_at(fmt.SEGMENT_HEADER_SIZE):
            return None
        header = self._rebuilt_header(fd, seg, path, fmt.SEGMENT_HEADER_SIZE, expect)
        if header is None or (expect is not None and header.base_lsn < expect):
            return None
        old, new = io.pread(fd, fmt.SEGMENT_HEADER.size, 0), header.encode()
        differ = sum(x != y for a, b in IMPLIED_HEADER_FIELDS for x, y in zip(old[a:b], new[a:b]))
        if differ > IMPLIED_HEADER_SLACK:
            return None
        self.result.damage.append(Damage(seg, 0, f"damaged segment header ({error.message}); read as this store's "
                                         f"segment {seg} from LSN {header.base_lsn}: `tierstore recover` rewrites "
                                         "it", 0))
        return header

    def _rebuilt_header(self, fd: int, seg: int, path: str, first: int | None,
                        expect: int | None) -> seglib.SegmentHeader | None:
        """The header a damaged segment header is rewritten as (repair) or read as (a rebuild):
        the store's uuid (this scan's, else another segment's), the id in the file name, and as
        base LSN the LSN of the first record that has one from ``first`` on (PAD records have
        none), else ``expect``.  None when no other segment names the store."""
        uuid = self.store_uuid or _store_uuid_of_others(self.io, self.seg_dir, seg)
        if uuid is None:
            return None
        base = first_lsn_from(self.io, fd, seg, path, first, self.io.size(fd)) if first is not None else None
        return seglib.new_segment_header(uuid, seg, base if base is not None else max(1, expect or 1))

    def _nothing_lost(self, fd: int, seg: int, path: str, scanner: seglib.SegmentScanner, offset: int,
                      expected: int | None, size: int) -> int | None:
        """Not repairing, in a sealed segment (or synced damage of the last one): where the log
        goes on after bytes at ``offset`` that are not a valid record, when they provably held
        none -- they are zero past their first 48 bytes, and the next valid record carries the
        LSN expected here, or none follows in this segment and the next one (its own header)
        begins with it: a damaged byte of padding or of a PAD record.  None when LSNs were lost,
        or may have been (across a gap that compaction left between two segments, for one)."""
        if expected is None:
            return None
        nxt = scanner.next_valid(offset)
        # what a damaged PAD record or gap looks like: zeros past its first 48 bytes (a record with
        # an LSN has its namespace, key or metadata there -- and a record header inside a damaged
        # record's payload is not the log going on)
        if self._nonzero(fd, min(offset + fmt.RECORD_HEADER_SIZE, size), size if nxt is None else nxt):
            return None
        after = first_lsn_from(self.io, fd, seg, path, nxt, size) if nxt is not None else None  # PAD records: none
        if after == expected:
            return nxt
        if after is None and self._next_base() == expected:
            return size if nxt is None else nxt
        return None

    def _next_base(self) -> int | None:
        """The base LSN of the segment after the one being scanned (its header's), or None."""
        if self._next_seg is None:
            return None
        path = os.path.join(self.seg_dir, seglib.segment_name(self._next_seg))
        fd = seglib.open_segment(self.io, path)
        try:
            return seglib.read_segment_header(self.io, fd, path=path, seg_id=self._next_seg).base_lsn
        except TierstoreError:
            return None
        finally:
            self.io.close(fd)

    def _proven(self, fd: int, seg: int, path: str, lsn: int | None, offset: int, size: int) -> bool:
        """Whether the record with ``lsn`` at ``offset`` of the last segment was synced: the
        previous index applied it, or a valid SYNC record after it says so."""
        if lsn is None:
            return False
        if lsn <= self.proven_lsn:
            return True
        return lsn <= certified_after(self.io, fd, seg, path, offset, size)

    def _incomplete_group(self, fd: int, seg: int, path: str, group: "_Group", why: str) -> None:
        """Damage, not a crash (a writer never leaves a group open mid-log): without repair,
        CorruptionError; a repair replaces the GROUP record with a HOLE of one LSN (same
        length), so the records that survive apply one by one, and reports it."""
        g = group.header
        self._sealed_damage(fd, seg, path, group.offset, None, why)
        self._rewrite(fd, seg, group.offset, group.offset + g.record_len, g.lsn, 1, None)
        self.result.ops.extend(group.ops)

    def _restore_header(self, fd: int, seg: int, path: str, offset: int, expected: int | None, size: int,
                        why: str) -> bool:
        """Repair: a record header that cannot be read, whose copy the previous index holds (same
        segment and offset, the LSN the log expects there) and whose every extent matches that
        copy's checksums, is written back from the copy: the object is kept, not quarantined.
        The damaged bytes go to quarantine/ first.  False when there is no such witness."""
        if (seg, offset) in self._restored:  # restored once and still unreadable: damage of another kind
            return False
        hdr = self.witness(seg, offset) if self.witness is not None else None
        source = "the index's copy of the header"
        if hdr is None:
            hdr, source = self._copy_of(seg, offset, expected, size), "the copy of the header a HEADERS record holds"
        if hdr is None or (expected is not None and hdr.lsn != expected) or offset + hdr.record_len > size:
            return False
        self._restored.add((seg, offset))
        try:
            if seglib.verify_extents(self.io, fd, offset, hdr) is not None:
                return False
        except (OSError, TierstoreError):
            return False
        qpath = quarantine_bytes(self.io, self.root, fd, seg, offset, offset + hdr.header_len, why)
        write_all(self.io, fd, [hdr.raw], offset)
        self.io.fdatasync(fd)
        self.result.damage.append(Damage(seg, offset, f"{why}; restored from {source} "
                                                     "(every extent matches its checksums): the object is kept", 0,
                                         quarantined_to=qpath, namespace=hdr.namespace.decode("utf-8", "replace"),
                                         key=shown_key(hdr.key), kept=True))
        return True

    def _copy_of(self, seg: int, offset: int, expected: int | None, size: int) -> rec.RecordHeader | None:
        """The header of the record at ``offset`` of segment ``seg`` as a HEADERS record holds it
        (SPEC.md §4.5, §7.3): a copy of that position with the LSN the log expects there, that
        fits in the file, and whose HEADERS record is reached by reading valid records from the
        end of the record it describes (so a HEADERS record inside some payload -- the damaged
        record's own, or a later one's -- is never taken for the log); the newest such copy (a
        repair's copy of the header it wrote supersedes the original's).  None when there is no
        such copy: a record a pre-1.5 writer appended, or one whose copy's sync never came."""
        if (seg, offset) not in self._copies_found:
            best = None
            for hseg, hoff, copy in self._candidate_copies(seg, offset):
                if (expected is not None and copy.lsn != expected) or offset + copy.record_len > size:
                    continue
                end = rec.align_up(offset + copy.record_len, fmt.RECORD_ALIGN)
                if self._reaches(seg, end, copy.lsn + rec.lsn_span(copy), (hseg, hoff)):
                    best = copy
            self._copies_found[(seg, offset)] = best
        return self._copies_found[(seg, offset)]

    def _segments_from(self, seg: int) -> Iterator[tuple[int, str, int, int]]:
        """(id, path, fd, size) of segment ``seg`` and every later one, each open while the caller
        reads it (closed when the caller moves on)."""
        for s in seglib.list_segments(self.io, self.seg_dir):
            if s < seg:
                continue
            path = os.path.join(self.seg_dir, seglib.segment_name(s))
            try:
                fd = seglib.open_segment(self.io, path)
            except (OSError, TierstoreError):
                continue
            try:
                yield s, path, fd, self.io.size(fd)
            finally:
                self.io.close(fd)

    def _candidate_copies(self, seg: int, offset: int) -> Iterator[tuple[int, int, rec.RecordHeader]]:
        """(segment, offset of the HEADERS record, copy) for every copy of the header at
        (``seg``, ``offset``) in valid HEADERS records after it, in log order, resynchronising
        past damage (``_copy_of`` checks which of them belong to the log)."""
        io = self.io
        for s, path, fd, size in self._segments_from(seg):
            probe = seglib.SegmentScanner(io, fd, s, path=path, verify_payload=False, size=size)
            q = probe.next_valid(offset) if s == seg else fmt.SEGMENT_HEADER_SIZE
            while q is not None and q < size:
                scanner = seglib.SegmentScanner(io, fd, s, path=path, start=q, verify_payload=False, size=size)
                for off, hdr in scanner.records():
                    if hdr.type != fmt.REC_HEADERS:
                        continue
                    body = io.pread(fd, hdr.extent_lengths[0], off + hdr.offsets[0])
                    if len(body) != hdr.extent_lengths[0] or rec.crc32c(body) != hdr.extent_crcs[0]:
                        continue
                    try:
                        copies = rec.header_copies(hdr, body, want=(seg, offset))
                    except CorruptionError:
                        continue  # checksummed, yet not what a writer writes: no copies from it
                    for _, _, copy in copies:
                        yield s, off, copy
                stop = scanner.stop
                if stop is None or stop.reason == "end" or stop.offset <= q:
                    break
                q = probe.next_valid(stop.offset)

    def _reaches(self, seg: int, start: int, lsn: int, target: tuple[int, int]) -> bool:
        """Whether reading valid records from ``start`` of ``seg`` (expecting LSN ``lsn``) and on
        through the later segments from their first record arrives at the record at ``target``."""
        for s, path, fd, size in self._segments_from(seg):
            scanner = seglib.SegmentScanner(self.io, fd, s, path=path, start=start if s == seg else
                                            fmt.SEGMENT_HEADER_SIZE, expect_lsn=lsn if s == seg else None,
                                            verify_payload=False, size=size)
            for off, _ in scanner.records():
                if (s, off) >= target:
                    return (s, off) == target
            stop = scanner.stop
            if s >= target[0] or stop is None or stop.reason != "end":
                return False
        return False

    def _extents_match(self, fd: int, offset: int, hdr: rec.RecordHeader) -> bool:
        try:
            return seglib.verify_extents(self.io, fd, offset, hdr) is None
        except (OSError, TierstoreError):
            return False

    def _rewrite(self, fd: int, seg: int, start: int, end: int, lsn: int, count: int,
                 bad: rec.RecordHeader | None) -> None:
        """Repair: replace quarantined bytes [start, end) so the log reads clean again and keeps
        its LSNs dense: a DELETE of the damaged record's key (when its header was readable) or a
        HOLE record accounting for the lost LSNs, then PAD; zeros when too short for a record."""
        length = end - start
        if length <= 0:
            return
        if length < fmt.MIN_RECORD_GAP:
            data = bytes(length)
        elif bad is not None and bad.type in (fmt.REC_PUT, fmt.REC_DELETE):
            delete = rec.encode_delete(bad.namespace, bad.key, bad.flags).header.stamped(bad.lsn).raw
            rest = length - len(delete)
            if rest == 0 or rest >= fmt.MIN_RECORD_GAP:
                data = delete + (rec.encode_pad(rest) if rest else b"")
            else:
                data = rec.encode_filler(length, lsn, count)
        else:
            try:
                data = rec.encode_filler(length, lsn, count)
            except ValueError:
                data = rec.encode_pad(length)
        write_all(self.io, fd, [data], start)
        self.io.fdatasync(fd)
        if length >= fmt.MIN_RECORD_GAP:
            written = rec.decode_header(data)
            if written.lsn:  # a DELETE or HOLE: its copy supersedes the damaged record's (SPEC.md §7.6)
                self.result.rewritten.append((seg, start, written.lsn, written.raw))

    def _salvage_header(self, fd: int, seg: int, path: str, error: TierstoreError,
                        expect: int | None) -> seglib.SegmentHeader:
        """Repair: rewrite a damaged segment header from what the rest of the store says (the
        store uuid, the id in the file name, the LSN of the first valid record).  The old header
        page goes to quarantine/ first."""
        io = self.io
        quarantine_bytes(io, self.root, fd, seg, 0, fmt.SEGMENT_HEADER_SIZE, f"damaged segment header: {error}")
        scanner = seglib.SegmentScanner(io, fd, seg, path=path, verify_payload=False)
        first = fmt.SEGMENT_HEADER_SIZE if scanner.header_at(fmt.SEGMENT_HEADER_SIZE) \
            else scanner.next_valid(fmt.SEGMENT_HEADER_SIZE)
        header = self._rebuilt_header(fd, seg, path, first, expect)
        if header is None:
            raise CorruptionError("segment header damaged and no other segment names the store", path=path,
                                  segment=seg) from None
        write_all(io, fd, [header.encode()], 0)
        io.fdatasync(fd)
        self.result.damage.append(Damage(seg, 0, f"segment header rewritten ({error.message})", fmt.SEGMENT_HEADER_SIZE,
                                         None))
        return header

    def _cut_tail(self, fd: int, seg: int, stop: seglib.ScanStop, size: int) -> None:
        d = Damage(seg, stop.offset, f"{stop.reason}: {stop.detail}", size - stop.offset)
        if self.writable:
            if stop.valid_after or self._nonzero(fd, stop.offset, size):  # bytes that may be data: kept
                d.quarantined_to = quarantine_bytes(self.io, self.root, fd, seg, stop.offset, size, d.reason)
            self.io.ftruncate(fd, stop.offset)
            self.io.fdatasync(fd)
        self.result.damage.append(d)

    def _nonzero(self, fd: int, start: int, end: int) -> bool:
        """Whether any byte of [start, end) is not zero (preallocated or never-written space is)."""
        pos = start
        while pos < end:
            chunk = self.io.pread(fd, min(end - pos, 8 << 20), pos)
            if not chunk:
                return False
            if chunk.count(0) != len(chunk):
                return True
            pos += len(chunk)
        return False

    def _sealed_damage(self, fd: int, seg: int, path: str, offset: int, end: int | None, reason: str,
                       key: tuple[bytes, bytes] | None = None) -> None:
        if not self.repair:
            raise CorruptionError(f"damaged record in the log ({reason})", path=path, segment=seg,
                                  offset=offset,
                                  hint="run `tierstore recover PATH`: it quarantines the damaged bytes, keeps the rest")
        d = Damage(seg, offset, reason, 0)
        if key is not None:
            d.key = shown_key(key[1])
            d.namespace = key[0].decode("utf-8", "replace")
        if end is not None:
            d.bytes_dropped = end - offset
            d.quarantined_to = quarantine_bytes(self.io, self.root, fd, seg, offset, end, reason)
        self.result.damage.append(d)


def scan_log(io: PosixIO, root: str, store_uuid: bytes | None, start: Applied | None, *, writable: bool,
             repair: bool, verify_sealed: bool = False, progress: Callable[[int], None] | None = None,
             proven_lsn: int = 0, verify_tail: bool = True,
             witness: Callable[[int, int], rec.RecordHeader | None] | None = None,
             skip: dict[tuple[int, int], tuple[int, int, int]] | None = None,
             stop: tuple[int, int] | None = None) -> LogScan:
    """Scan the log from ``start`` (None: from the first segment) and cut a torn tail if writable.
    ``verify_tail=False`` skips the payload checksums of the last segment (a writer catching up
    with records other live writers wrote whole, SPEC.md §7.8).  ``skip``: the caller's own
    records, passed over unread and left out of the result (``SegmentScanner``).  ``stop``: a
    position (segment, offset) at a record boundary where the log is read as if it ended
    there (a writer reading other writers' records up to its own last sync; not with
    ``writable``, which would cut what lies after it).

    Returns the records past ``start`` in LSN order and where the valid log ends.  Raises
    ``IndexAhead`` when ``start`` is not in the log.  See the module docstring for the rules.
    """
    assert stop is None or not writable
    return _LogScanner(io, root, store_uuid, writable=writable, repair=repair, verify_sealed=verify_sealed,
                       progress=progress, proven_lsn=proven_lsn, verify_tail=verify_tail, witness=witness,
                       skip=skip, stop=stop).run(start)


def check_applied(io: PosixIO, root: str, applied: Applied) -> bool:
    """Is the record at the index's applied position in the log, with that LSN?"""
    if applied.lsn == 0:
        return True
    path = os.path.join(root, fmt.SEGMENTS_DIR, seglib.segment_name(applied.segment))
    try:
        fd = seglib.open_segment(io, path)
    except FileNotFoundError:
        return False
    try:
        size = io.size(fd)
        try:
            hdr: rec.RecordHeader | None = rec.decode_header(io.pread(fd, fmt.HEADER_MAX_BYTES, applied.offset))
        except CorruptionError:  # damaged since: a HEADERS record's copy of it will do (SPEC.md §7.3)
            hdr = _LogScanner(io, root, None, writable=False, repair=False, verify_sealed=False,
                              progress=None)._copy_of(applied.segment, applied.offset, applied.lsn, size)
        return hdr is not None and hdr.lsn == applied.lsn and applied.offset + hdr.record_len == applied.end <= size
    finally:
        io.close(fd)


def abandoned_creation(io: PosixIO, root: str) -> bool:
    """A crash during store creation: no index, one segment whose header never became durable."""
    seg_dir = os.path.join(root, fmt.SEGMENTS_DIR)
    segs = seglib.list_segments(io, seg_dir)
    if len(segs) != 1 or Index.exists(os.path.join(root, fmt.INDEX_DIR)):
        return False
    path = os.path.join(seg_dir, seglib.segment_name(segs[0]))
    fd = seglib.open_segment(io, path)
    try:
        seglib.read_segment_header(io, fd, path=path, seg_id=segs[0])
        return False
    except CorruptionError:
        return has_no_records(io, fd)
    finally:
        io.close(fd)


# --- index rebuild -------------------------------------------------------------------------


REBUILD_BATCH = 20_000


def rebuild_index(io: PosixIO, root: str, *, repair: bool = False, verify_payloads: bool = False,
                  progress: Callable[[int], None] | None = None, proven_lsn: int = 0,
                  witness: Callable[[int, int], rec.RecordHeader | None] | None = None) -> LogScan:
    """Build a fresh index from the segments alone and swap it in (the old one is moved to
    quarantine/).  The caller holds the writer lock; the index must not be open in-process.
    ``witness``: repairing, the previous index's header copies (see ``_restore_header``)."""
    scan = scan_log(io, root, None, None, writable=True, repair=repair, verify_sealed=verify_payloads,
                    progress=progress, proven_lsn=proven_lsn, witness=witness)
    store_uuid = scan.store_uuid
    if store_uuid is None:  # (a scan that read no segment header raised already)
        raise CorruptionError("no segment header names the store", path=root)
    tmp = os.path.join(root, fmt.INDEX_DIR + ".rebuild")
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    idx = Index.open(tmp, writable=True)
    try:
        idx.initialise(store_uuid)
        for i in range(0, len(scan.ops), REBUILD_BATCH):
            batch = scan.ops[i : i + REBUILD_BATCH]
            last = batch[-1]
            applied = Applied(last.segment, last.offset, last.lsn, last.offset + last.record_len)
            if i + REBUILD_BATCH >= len(scan.ops) and scan.last.lsn >= last.lsn:
                applied = scan.last  # the last record read with its own valid header (SPEC.md §7.4 step 2)
            idx.apply(batch, applied)
        idx.sync()
    finally:
        idx.close()
    stamp(tmp)  # built here and closed: trusted at the next open without a walk
    final = os.path.join(root, fmt.INDEX_DIR)
    if os.path.exists(final):
        # the old index is derived data: an intact one is simply replaced; a damaged one is kept
        # in quarantine/ for inspection (and said so in the scan's result)
        # (damaged: changed at rest since the stamp of its last clean close -- fsck's verdict --
        # or, without a stamp, failing LMDB's verifier; it passed that verifier with bytes
        # flipped in a page, and was replaced unkept: a new user's try, 2026-12-04)
        problem = untrusted(final) if Index.exists(final) else "no data.mdb"
        if problem:
            qdir = os.path.join(root, fmt.QUARANTINE_DIR)
            os.makedirs(qdir, exist_ok=True)
            dest = os.path.join(qdir, f"{_stamp()}-{fmt.INDEX_DIR}-{os.getpid()}")
            io.rename(final, dest)
            why = f"index replaced by one rebuilt from the segments; it was damaged: {problem}\n"
            # (an `index` that is a file, not a directory, gets its reason beside it)
            with open(os.path.join(dest, "REASON.txt") if os.path.isdir(dest) else dest + ".txt", "w") as f:
                f.write(why)
            scan.old_index = f"quarantined to {dest} ({problem})"
        else:
            shutil.rmtree(final)
            scan.old_index = "replaced (it matched the stamp of its last clean close, or passed LMDB's verifier)"
    io.rename(tmp, final)
    io.fsync_dir(root)
    return scan
