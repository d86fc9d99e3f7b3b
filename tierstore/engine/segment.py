"""Segment files, read side: names, headers (SPEC.md §3), scanning with the torn-tail rules (§7.3),
reading extents with checksum verification, and the cache of read file descriptors.

Appending is ``log.py``'s.  This module never writes a record, never touches the index and
never decides what is live.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import time
import uuid as uuidlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import CorruptionError, FormatVersionError, StoreClosed
from ..format import constants as fmt
from ..format import record as rec
from .fileio import (
    PAGE,
    PARALLEL_CHUNK,
    PARALLEL_MIN,
    DirectIO,
    PosixIO,
    io_error,
    read_all,
)
from .threads import submit

CREATOR = b"tierstore-py"


def segment_name(seg_id: int) -> str:
    return f"{seg_id:0{fmt.SEGMENT_NAME_DIGITS}x}{fmt.SEGMENT_SUFFIX}"


def parse_segment_name(name: str) -> int | None:
    """The segment id of a file name, or None when the name is not a segment's."""
    stem, dot, suffix = name.partition(".")
    if "." + suffix != fmt.SEGMENT_SUFFIX or len(stem) != fmt.SEGMENT_NAME_DIGITS:
        return None
    try:
        return int(stem, 16) if stem == stem.lower() else None
    except ValueError:
        return None


def open_segment(io: PosixIO, path: str, flags: int = os.O_RDONLY) -> int:
    """Open a segment file to read it, with a shared ``flock`` held for as long as the
    descriptor is open (SPEC.md §7.5): a writer shrinks a retired segment away only while it
    holds the exclusive lock, so no descriptor opened here ever sees a segment shrink.  A
    segment being shrunk is gone: FileNotFoundError, as if it had been unlinked.  So is one
    renamed for shrinking between this open and its lock: a writer may have shrunk it whole and
    let go of its lock in that gap (the file is then empty or short), so with the lock held the
    name must still be this file's."""
    fd = io.open(path, flags)
    try:
        io.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
            io.close(fd)
            raise FileNotFoundError(errno.ENOENT, "segment retired (being deleted)", path) from None
        # no flock on this file system: writers cannot take the exclusive lock either, so they
        # unlink retired segments at once (an open descriptor keeps the bytes)
    except BaseException:
        io.close(fd)
        raise
    try:
        named = io.names(path, fd)  # (once the lock is held a rename leaves the bytes alone: the
    except BaseException:  # shrinking writer cannot take its exclusive lock and unlinks it at once)
        io.close(fd)
        raise
    if not named:
        io.close(fd)
        raise FileNotFoundError(errno.ENOENT, "segment retired (being deleted)", path)
    return fd


def list_segments(io: PosixIO, seg_dir: str) -> list[int]:
    """Ids of the segment files in ``seg_dir``, ascending (other files are ignored)."""
    ids = [parse_segment_name(n) for n in io.listdir(seg_dir)]
    return sorted(i for i in ids if i is not None)


# --- segment header (SPEC.md §3) ----------------------------------------------------------


@dataclass(frozen=True)
class SegmentHeader:
    major: int
    minor: int
    incompat: int
    ro_compat: int
    compat: int
    store_uuid: bytes
    segment_id: int
    base_lsn: int
    created_ns: int

    def encode(self) -> bytes:
        fields = fmt.SEGMENT_HEADER.pack(
            fmt.SEGMENT_MAGIC, self.major, self.minor, fmt.SEGMENT_HEADER_SIZE, self.incompat,
            self.ro_compat, self.compat, self.store_uuid, self.segment_id, self.base_lsn,
            self.created_ns, CREATOR, 0,
        )
        body = fields[: fmt.SEGMENT_HEADER_CRC_OFFSET]
        crc = rec.crc32c(body)
        return body + crc.to_bytes(4, "little") + bytes(fmt.SEGMENT_HEADER_SIZE - fmt.SEGMENT_HEADER.size)

    @property
    def writable(self) -> bool:
        """Whether a v1 writer may append to this segment (SPEC.md §3.2)."""
        return self.minor <= fmt.FORMAT_MINOR and not (self.ro_compat & ~fmt.RO_COMPAT_KNOWN)

    def newer(self) -> str:
        """What makes a segment not ``writable``, in words (for ReadOnlyError)."""
        unknown = self.ro_compat & ~fmt.RO_COMPAT_KNOWN
        what = (f"format {self.major}.{self.minor}" if self.minor > fmt.FORMAT_MINOR else
                f"read-only-compatible feature bits {unknown:#x} this tierstore does not know")
        return f"segment written with {what}; this tierstore writes {fmt.FORMAT_MAJOR}.{fmt.FORMAT_MINOR}"


def new_segment_header(store_uuid: bytes, seg_id: int, base_lsn: int) -> SegmentHeader:
    return SegmentHeader(fmt.FORMAT_MAJOR, fmt.FORMAT_MINOR, 0, 0, 0, store_uuid, seg_id, base_lsn, time.time_ns())


def decode_segment_header(b: bytes, *, path: str | None = None, seg_id: int | None = None) -> SegmentHeader:
    """Check a segment header: magic, version, checksum, feature bits, then contents."""
    where = {"path": path, "segment": seg_id, "offset": 0}
    if len(b) < fmt.SEGMENT_HEADER.size:
        raise CorruptionError("segment header truncated", **where)
    (magic, major, minor, hsize, incompat, ro_compat, compat, store_uuid, sid, base_lsn, created,
     _creator, crc) = fmt.SEGMENT_HEADER.unpack_from(b, 0)
    if magic != fmt.SEGMENT_MAGIC:
        raise CorruptionError("not a tierstore segment (bad magic)", **where)
    if major != fmt.FORMAT_MAJOR:
        raise FormatVersionError(f"segment format {major}.{minor} is not readable by this tierstore "
                                 f"(reads {fmt.FORMAT_MAJOR}.x)", **where)
    if rec.crc32c(b[: fmt.SEGMENT_HEADER_CRC_OFFSET]) != crc:
        raise CorruptionError("segment header checksum mismatch", **where)
    if incompat & ~fmt.INCOMPAT_KNOWN:
        raise FormatVersionError(f"segment uses unknown incompatible features {incompat:#x}", **where)
    if hsize != fmt.SEGMENT_HEADER_SIZE:
        raise CorruptionError(f"segment header_size {hsize} is not {fmt.SEGMENT_HEADER_SIZE}", **where)
    if seg_id is not None and sid != seg_id:
        raise CorruptionError(f"segment header names id {sid}, file name says {seg_id}", **where,
                              hint=f"a segment file renamed (or copied in under another name): give it back its "
                                   f"name ({sid:016x}.tseg) if that is free, or move it out of segments/; recover "
                                   f"does not rename segments")
    if base_lsn == 0:
        raise CorruptionError("segment base_lsn is zero", **where)
    return SegmentHeader(major, minor, incompat, ro_compat, compat, store_uuid, sid, base_lsn, created)


def read_segment_header(io: PosixIO, fd: int, *, path: str, seg_id: int) -> SegmentHeader:
    return decode_segment_header(io.pread(fd, fmt.SEGMENT_HEADER_SIZE, 0), path=path, seg_id=seg_id)


def new_store_uuid() -> bytes:
    return uuidlib.uuid4().bytes


# --- scanning (SPEC.md §7.3) --------------------------------------------------------------


@dataclass
class ScanStop:
    """Why a scan ended.  ``reason``: "end" (clean end of log), "torn" (an incomplete record
    at the tail), or "invalid" (a record failed validation).  ``valid_after`` is true when a
    valid record header exists past ``offset`` (so the damage is not a plain torn tail)."""

    offset: int
    reason: str
    detail: str = ""
    valid_after: bool = False
    header: rec.RecordHeader | None = None  # set when the header was valid and only the payload failed


class _Window:
    """Buffered positional reads over a file for header scanning."""

    def __init__(self, io: PosixIO, fd: int, size: int, chunk: int = 64 << 10) -> None:
        self.io, self.fd, self.size, self.chunk = io, fd, size, chunk
        self.start = 0
        self.buf = b""

    def get(self, off: int, n: int) -> bytes:
        n = max(0, min(n, self.size - off))
        if off < self.start or off + n > self.start + len(self.buf):
            self.start = off
            self.buf = self.io.pread(self.fd, max(n, self.chunk), off)
        return self.buf[off - self.start : off - self.start + n]


class SegmentScanner:
    """Iterate the valid records of one segment from ``start``.

    After iteration ``stop`` says where and why the valid prefix ended.  ``expect_lsn`` (if
    given) enforces dense LSNs; ``verify_payload`` checks every extent checksum (recovery of
    the log tail does; header-only scans are for sealed, synced segments).  ``skip``: records
    the caller wrote itself and needs no header of (a writer reading the others' records,
    SPEC.md §7.8), (segment, offset) -> (end, first LSN, last LSN): passed over unread when
    the scan meets one there with the LSN it expects (never where it expects none).
    """

    def __init__(self, io: PosixIO, fd: int, seg_id: int, *, path: str, start: int = fmt.SEGMENT_HEADER_SIZE,
                 expect_lsn: int | None = None, verify_payload: bool = True, size: int | None = None,
                 skip: dict[tuple[int, int], tuple[int, int, int]] | None = None) -> None:
        self.io, self.fd, self.seg_id, self.path = io, fd, seg_id, path
        self.skip = skip
        self.start = start
        self.expect_lsn = expect_lsn
        self.verify_payload = verify_payload
        self.size = io.size(fd) if size is None else size
        self.stop: ScanStop | None = None
        self.last_lsn: int | None = None

    def _where(self, off: int) -> dict[str, Any]:
        return {"path": self.path, "segment": self.seg_id, "offset": off}

    def records(self) -> Iterator[tuple[int, rec.RecordHeader]]:
        win = _Window(self.io, self.fd, self.size)
        p = self.start
        skip, seg = self.skip, self.seg_id
        while True:
            if skip:
                hop = skip.get((seg, p))
                if hop is not None and hop[1] == self.expect_lsn and hop[0] <= self.size:
                    p, self.last_lsn, self.expect_lsn = hop[0], hop[2], hop[2] + 1
                    continue
            stop = self._next(win, p)
            if isinstance(stop, ScanStop):
                if stop.reason != "end":
                    stop.valid_after = self._valid_after(win, stop.offset)
                self.stop = stop
                return
            off, hdr = stop
            if hdr.type != fmt.REC_PAD:
                span = rec.lsn_span(hdr)
                self.last_lsn = hdr.lsn + span - 1
                self.expect_lsn = hdr.lsn + span
                yield off, hdr
            p = rec.align_up(off + hdr.record_len, fmt.RECORD_ALIGN)

    def _next(self, win: _Window, p: int) -> ScanStop | tuple[int, rec.RecordHeader]:
        if p >= self.size:
            return ScanStop(p, "end")
        page_end = rec.align_up(p + 1, fmt.PAGE)
        if p % fmt.PAGE and page_end - p < fmt.MIN_RECORD_GAP:
            gap = win.get(p, page_end - p)
            if gap.strip(b"\0"):
                return ScanStop(p, "invalid", "non-zero bytes in a page-end gap")
            p = page_end
            if p >= self.size:
                return ScanStop(p, "end")
        head = win.get(p, fmt.RECORD_HEADER_SIZE)
        if head[:4] == b"\0\0\0\0":
            return ScanStop(p, "end") if self._zero_to_eof(win, p) else ScanStop(p, "torn", "zeros then data")
        if len(head) < fmt.RECORD_HEADER_SIZE:
            return ScanStop(p, "torn", "record header cut by end of file")
        try:
            fixed = rec.parse_fixed(head, **self._where(p))
        except CorruptionError as e:
            return ScanStop(p, "invalid", e.message)
        if p + fixed.header_len > self.size:
            return ScanStop(p, "torn", "record header cut by end of file")
        try:
            hdr = rec.decode_header(win.get(p, fixed.header_len), fixed, **self._where(p))
        except CorruptionError as e:
            return ScanStop(p, "invalid", e.message)
        if p % (1 << hdr.align_log2):
            return ScanStop(p, "invalid", "record start not aligned to its payload alignment")
        if p + hdr.record_len > self.size:
            return ScanStop(p, "torn", "record payload cut by end of file")
        if hdr.type != fmt.REC_PAD:
            if self.expect_lsn is not None and hdr.lsn != self.expect_lsn:
                return ScanStop(p, "invalid", f"LSN {hdr.lsn} where {self.expect_lsn} was expected")
            if self.verify_payload and hdr.extent_lengths:
                bad = verify_extents(self.io, self.fd, p, hdr)
                if bad is not None:
                    return ScanStop(p, "invalid", f"extent {bad} checksum mismatch", header=hdr)
        return p, hdr

    def _zero_to_eof(self, win: _Window, p: int) -> bool:
        step = 1 << 20
        return all(not win.get(off, step).strip(b"\0") for off in range(p, self.size, step))

    def _valid_after(self, win: _Window, p: int) -> bool:
        return self.next_valid(p, win) is not None

    def next_valid(self, p: int, win: _Window | None = None) -> int | None:
        """The offset of the first record with a valid header after ``p`` (resync), or None."""
        win = win or _Window(self.io, self.fd, self.size)
        off = rec.align_up(p + 1, fmt.RECORD_ALIGN)
        step = 1 << 20
        while off < self.size:
            chunk = win.get(off, step + fmt.RECORD_HEADER_SIZE)
            i = chunk.find(fmt.RECORD_MAGIC)
            while i != -1:
                q = off + i
                if q % fmt.RECORD_ALIGN == 0 and self._header_ok(win, q):
                    return q
                i = chunk.find(fmt.RECORD_MAGIC, i + 1)
            off += step
        return None

    def header_at(self, q: int) -> bool:
        """Whether a valid record header starts at offset ``q``."""
        return self._header_ok(_Window(self.io, self.fd, self.size), q)

    def _header_ok(self, win: _Window, q: int) -> bool:
        try:
            fixed = rec.parse_fixed(win.get(q, fmt.RECORD_HEADER_SIZE))
            if q + fixed.header_len > self.size:
                return False
            rec.decode_header(win.get(q, fixed.header_len), fixed)
            return True
        except CorruptionError:
            return False


_VERIFY_CHUNK = 8 << 20
_verify_pool: Any = None


def verify_extents(io: PosixIO, fd: int, offset: int, hdr: rec.RecordHeader) -> int | None:
    """Index of the first extent whose bytes fail their checksum (or are cut short), else None.

    Reads the record's payload in 8 MiB pieces into two reused buffers, the next piece being
    read (on a helper thread: the copy releases the GIL) while this one is checksummed.
    """
    global _verify_pool
    if not hdr.extent_lengths:
        return None
    offsets, lengths = hdr.offsets, hdr.extent_lengths
    start, end = offsets[0], offsets[-1] + lengths[-1]
    crcs = [0] * len(lengths)
    bufs = [bytearray(min(_VERIFY_CHUNK, end - start)) for _ in range(2 if end - start > _VERIFY_CHUNK else 1)]

    def read(k: int, pos: int) -> int:
        n = min(_VERIFY_CHUNK, end - pos)
        return read_all(io, fd, [memoryview(bufs[k])[:n]], offset + pos)

    if len(bufs) > 1 and _verify_pool is None:
        from concurrent.futures import ThreadPoolExecutor

        _verify_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierstore-verify")
    pending = None
    got = read(0, start)
    pos, k, e = start, 0, 0
    while pos < end:
        n = min(_VERIFY_CHUNK, end - pos)
        if got != n:
            while e < len(lengths) and offsets[e] + lengths[e] <= pos + got:
                e += 1
            return min(e, len(lengths) - 1)  # cut short: the extent being read
        if pos + n < end:
            pending = submit(_verify_pool, read, 1 - k, pos + n)
        view = memoryview(bufs[k])[:n]
        for i in range(e, len(lengths)):  # the extents this piece overlaps
            a, b = max(offsets[i], pos), min(offsets[i] + lengths[i], pos + n)
            if a >= pos + n:
                break
            if a < b:
                crcs[i] = rec.crc32c(view[a - pos : b - pos], crcs[i])
            if offsets[i] + lengths[i] <= pos + n:
                if crcs[i] != hdr.extent_crcs[i]:
                    if pending is not None:
                        pending.result()
                    return i
                e = i + 1
        pos += n
        k = 1 - k
        got = pending.result() if pending is not None else 0
        pending = None
    return None


SPLIT_MIN = 4 << 20  # a warm extent this large is read and checksummed as two halves in parallel
COLD_FRACTION = 0.5  # a read with less than this fraction in the page cache counts as cold
DIRECT_READS = {"auto": 8 << 20, "always": 1, "never": None}  # smallest cold read that goes O_DIRECT
SWEEP_S = 1.0  # how often a handle looks for segments another process removed (SegmentFiles.sweep)
DIRECT_READS_WITH_DRAM_TIER = 64 << 10  # "auto" when a DRAM tier caches repeated reads instead


def read_extents(io: PosixIO, fd: int, offset: int, hdr: rec.RecordHeader,
                 wanted: Sequence[tuple[int, memoryview]], where: dict[str, Any], executor: Any = None,
                 dfd: int = -1, dio: DirectIO | None = None) -> None:
    """Read extents ``wanted`` = [(index, destination)] (ascending indices) of the record at
    ``offset`` and verify each one's checksum.

    Cold data (mostly not in the page cache, per ``cachestat``) that is page-aligned in the
    file and in memory is read with O_DIRECT from ``dfd``: one large request per contiguous
    run, no readahead, no copy through the page cache.  Warm data is copied out of the page
    cache: adjacent extents with one scattered ``preadv`` (alignment padding to a scratch
    page); with an ``executor``, large reads in ~4 MiB pieces on its threads, the calling
    thread taking the first (copying and CRC-32C release the GIL), and a lone large extent
    as two halves whose checksums are combined (``record.crc32c_combine``).
    """
    offsets, lengths = hdr.offsets, hdr.extent_lengths
    runs = _runs(wanted, lengths, None)
    first, last = wanted[0][0], wanted[-1][0]
    span = offsets[last] + lengths[last] - offsets[first]
    if (dfd >= 0 and dio is not None and dio.direct and span >= dio.read_min
            and all(_page_aligned(offset + offsets[r[0][0]], [d for _, d in r], lengths, r) for r in runs)):
        cached = io.cached_fraction(fd, offset + offsets[first], span)
        if cached is not None and cached < COLD_FRACTION:
            try:
                for r in runs:
                    _read_run(io, dfd, offset, hdr, r, where)
            except OSError as e:
                if not dio.unsupported(e):
                    raise
                dio.direct = False  # the file system refuses O_DIRECT: read buffered from now on
            else:
                _verify(hdr, wanted, where, executor)
                return
    total = sum(lengths[i] for i, _ in wanted)
    if executor is not None and len(wanted) == 1 and total >= SPLIT_MIN:
        _read_split(io, fd, offset, hdr, wanted[0], where, executor)
        return
    parallel = executor is not None and total >= PARALLEL_MIN
    tasks = _runs(wanted, lengths, max(1 << 20, min(PARALLEL_CHUNK, total // 4)) if parallel else None)

    def run(task: list[tuple[int, memoryview]]) -> None:
        _read_run(io, fd, offset, hdr, task, where)
        _verify(hdr, task, where, None)

    if parallel and len(tasks) > 1:
        _run_all(executor, run, tasks)
    else:
        for t in tasks:
            run(t)


def _runs(wanted: Sequence[tuple[int, memoryview]], lengths: Sequence[int],
          limit: int | None) -> list[list[tuple[int, memoryview]]]:
    """Group wanted extents into runs of consecutive indices (at most ``limit`` bytes each)."""
    runs: list[list[tuple[int, memoryview]]] = []
    size = 0
    for idx, dest in wanted:
        if not runs or idx != runs[-1][-1][0] + 1 or (limit is not None and size + lengths[idx] > limit):
            runs.append([])
            size = 0
        runs[-1].append((idx, dest))
        size += lengths[idx]
    return runs


def _read_run(io: PosixIO, fd: int, offset: int, hdr: rec.RecordHeader, run: list[tuple[int, memoryview]],
              where: dict[str, Any]) -> None:
    """Read consecutive extents with one scattered preadv (padding goes to a scratch page)."""
    offsets, lengths = hdr.offsets, hdr.extent_lengths
    start = pos = offsets[run[0][0]]
    iov: list[memoryview] = []
    scratch: memoryview | None = None
    for idx, dest in run:
        gap = offsets[idx] - pos
        if gap:
            scratch = scratch or memoryview(bytearray(fmt.PAGE))
            while gap > 0:
                iov.append(scratch[: min(gap, fmt.PAGE)])
                gap -= min(gap, fmt.PAGE)
        if dest.nbytes:
            iov.append(dest)
        pos = offsets[idx] + lengths[idx]
    want = pos - start
    if want and read_all(io, fd, iov, offset + start) != want:
        raise CorruptionError("record extends past the end of its segment", **where)


def _verify(hdr: rec.RecordHeader, wanted: Sequence[tuple[int, memoryview]], where: dict[str, Any],
            executor: Any) -> None:
    """Check each extent's CRC-32C (on the executor's threads when there are many bytes)."""
    def check(item: tuple[int, memoryview]) -> None:
        idx, dest = item
        if rec.crc32c(dest) != hdr.extent_crcs[idx]:
            raise CorruptionError(f"extent {idx} checksum mismatch", **where)

    if executor is not None and len(wanted) > 1 and sum(d.nbytes for _, d in wanted) >= PARALLEL_MIN:
        _run_all(executor, check, list(wanted))
    else:
        for item in wanted:
            check(item)


def _run_all(executor: Any, fn: Callable[[Any], None], items: list[Any]) -> None:
    """fn over items: all but the first on the executor, the first on this thread.  Returns
    (or raises the first error) only once every call has finished with its buffers."""
    futures = [submit(executor, fn, it) for it in items[1:]]
    error: BaseException | None = None
    try:
        fn(items[0])
    except BaseException as e:  # re-raised below, after the other calls are done
        error = e
    errors = [f.exception() for f in futures]
    for e in [error, *errors]:
        if e is not None:
            raise e


def aligned_buffer(nbytes: int) -> bytearray | np.ndarray:
    """A zeroed, page-aligned buffer."""
    raw = np.zeros(nbytes + PAGE, dtype=np.uint8)
    start = (-raw.ctypes.data) % PAGE
    return raw[start : start + nbytes]


def _page_aligned(file_offset: int, bufs: Sequence[memoryview], lengths: Sequence[int],
                  run: Sequence[tuple[int, memoryview]]) -> bool:
    """Can this run use O_DIRECT: page-aligned file offset, extent lengths and buffer addresses?"""
    if file_offset % PAGE or any(lengths[idx] % PAGE for idx, _ in run):
        return False
    return all(np.frombuffer(b, dtype=np.uint8).ctypes.data % PAGE == 0 for b in bufs if b.nbytes)


def _read_split(io: PosixIO, fd: int, offset: int, hdr: rec.RecordHeader, item: tuple[int, memoryview],
                where: dict[str, Any], executor: Any) -> None:
    idx, dest = item
    n = hdr.extent_lengths[idx]
    base = offset + hdr.offsets[idx]
    half = rec.align_up(n // 2, fmt.PAGE)

    def part(lo: int, hi: int) -> int:
        view = dest[lo:hi]
        if read_all(io, fd, [view], base + lo) != hi - lo:
            raise CorruptionError("record extends past the end of its segment", **where)
        return rec.crc32c(view)

    future = submit(executor, part, half, n)
    try:
        first = part(0, half)
    finally:
        second = future.result()  # never return while the other half still writes into dest
    if rec.crc32c_combine(first, second, n - half) != hdr.extent_crcs[idx]:
        raise CorruptionError(f"extent {idx} checksum mismatch", **where)


def read_extent_bytes(io: PosixIO, fd: int, offset: int, hdr: rec.RecordHeader, idx: int,
                      where: dict[str, Any]) -> bytes:
    """One extent as a new bytes object (one read, no extra copy), checksum verified."""
    n = hdr.extent_lengths[idx]
    data = io.pread(fd, n, offset + hdr.offsets[idx]) if n else b""
    if len(data) != n:
        raise CorruptionError("record extends past the end of its segment", **where)
    if rec.crc32c(data) != hdr.extent_crcs[idx]:
        raise CorruptionError(f"extent {idx} checksum mismatch", **where)
    return data


def read_first_extents(io: PosixIO, fd: int, items: Sequence[tuple[int, rec.RecordHeader]], *,
                       gap: int = 16 << 10, span_max: int = 4 << 20) -> tuple[list[bytes], dict[int, str]]:
    """Extent 0 of each record ``items`` = [(offset, header)] of one segment (small records:
    a batched get of blobs), checksums verified: the bytes of each item (``b""`` for a damaged
    one) and, for each damaged item, why.  Records lying close together (ascending offsets,
    less than ``gap`` bytes apart, ``span_max`` bytes at most) are fetched with one ``pread``:
    a batch of records written together costs one system call, not one each.  (``gap``:
    copying 16 KiB out of the page cache costs about one ``pread``; with 64 KiB, a batch of
    keys scattered over a segment read 1.15-1.25x slower.)"""
    starts = [off + hdr.offsets[0] for off, hdr in items]
    lengths = [hdr.extent_lengths[0] for _, hdr in items]
    order = sorted(range(len(items)), key=starts.__getitem__)
    out: list[bytes] = [b""] * len(items)
    bad: dict[int, str] = {}
    i = 0
    while i < len(order):
        lo = starts[order[i]]
        hi = lo + lengths[order[i]]
        j = i + 1
        while j < len(order):
            start = starts[order[j]]
            end = start + lengths[order[j]]
            if start - hi > gap or end - lo > span_max:
                break
            hi = max(hi, end)
            j += 1
        span = io.pread(fd, hi - lo, lo) if hi > lo else b""
        for n in order[i:j]:
            a = starts[n] - lo
            # (a copy, unless the span is this extent alone: a blob must not pin the whole span)
            data = span if j == i + 1 else span[a:a + lengths[n]]
            if len(data) != lengths[n]:
                bad[n] = "record extends past the end of its segment"
            elif rec.crc32c(data) != items[n][1].extent_crcs[0]:
                bad[n] = "extent 0 checksum mismatch"
            else:
                out[n] = data
        i = j
    return out, bad


# --- read file descriptors -----------------------------------------------------------------


class SegmentFiles:
    """Read file descriptors of segments, shared by threads, reference counted.

    Each segment has a buffered descriptor (``POSIX_FADV_RANDOM``: a one-layer read fetches
    that layer, not 8 MiB of readahead) and, unless ``direct_reads="never"`` and where the file
    system supports it, an O_DIRECT one for cold reads.  With ``direct_reads="auto"``, cold
    reads of 8 MiB or more go O_DIRECT, or of 64 KiB or more when the store has a DRAM tier
    (``dram_tier``): that tier, not the page cache, is then where a repeated read finds them.
    A segment retired by compaction is closed when its last reader releases it, so a read in
    flight never sees its descriptor closed (or reused) under it.  A segment that compaction in
    another process removed is found by ``sweep`` (its link count is 0) and retired the same
    way: an open descriptor would keep its disk space in use for as long as this handle lives.
    """

    def __init__(self, io: PosixIO, seg_dir: str, dio: DirectIO | None = None, *, direct_reads: str = "auto",
                 dram_tier: bool = False) -> None:
        self.io, self.seg_dir = io, seg_dir
        self.dio = dio or DirectIO()
        self.direct_reads = DIRECT_READS[direct_reads] is not None
        self.dio.read_min = DIRECT_READS_WITH_DRAM_TIER if direct_reads == "auto" and dram_tier else \
            DIRECT_READS[direct_reads] or 0
        self._lock = threading.Lock()
        self._fds: dict[int, list[int]] = {}  # id -> [fd, direct fd or -1, refs]
        self._retired: set[int] = set()
        self._next_sweep = 0.0
        self._closed = False  # close_all ran: nothing opens a segment any more

    def path(self, seg_id: int) -> str:
        return os.path.join(self.seg_dir, segment_name(seg_id))

    def acquire(self, seg_id: int) -> tuple[int, int]:
        """(fd, O_DIRECT fd or -1) of a segment, opened on first use; FileNotFoundError if gone."""
        with self._lock:
            if time.monotonic() >= self._next_sweep:
                self._sweep()
            ent = self._fds.get(seg_id)
            if ent is None:
                if self._closed:  # (a read that began before the store closed: no fd it would leak)
                    raise StoreClosed("the store was closed during the read", path=self.seg_dir)
                path = self.path(seg_id)
                try:
                    fd = open_segment(self.io, path)
                except FileNotFoundError:
                    raise
                except OSError as e:  # (an I/O error is the caller's StoreIOError, never a bare OSError)
                    raise io_error(e, "open segment", path=path, segment=seg_id) from None
                self.io.fadvise(fd, 0, 0, getattr(os, "POSIX_FADV_RANDOM", 1))
                try:
                    dfd = self.dio.open_direct(self.io, path, os.O_RDONLY) if self.direct_reads else -1
                except OSError as e:
                    self.io.close(fd)
                    if isinstance(e, FileNotFoundError):
                        raise
                    raise io_error(e, "open segment", path=path, segment=seg_id) from None
                ent = self._fds[seg_id] = [fd, dfd, 0]
            ent[2] += 1
            return ent[0], ent[1]

    def release(self, seg_id: int) -> None:
        with self._lock:
            ent = self._fds.get(seg_id)
            if ent is None:  # (closed meanwhile: close_all with no read in flight on it)
                return
            ent[2] -= 1
            if ent[2] == 0 and seg_id in self._retired:
                self._close(seg_id)

    def retire(self, seg_id: int) -> None:
        """Close the segment's fds once no read uses them (called once the file's name is gone:
        unlinked, or renamed to be shrunk away)."""
        with self._lock:
            ent = self._fds.get(seg_id)
            if ent is not None and ent[2] == 0:
                self._close(seg_id)
            elif ent is not None:
                self._retired.add(seg_id)

    def sweep(self) -> None:
        """Retire the segments whose files another process removed (at most once per
        ``SWEEP_S``; reads call it too, so an idle handle's committer is not the only one)."""
        with self._lock:
            if time.monotonic() >= self._next_sweep:
                self._sweep()

    def _sweep(self) -> None:
        self._next_sweep = time.monotonic() + SWEEP_S
        for seg_id, ent in list(self._fds.items()):
            if seg_id in self._retired or os.fstat(ent[0]).st_nlink:
                continue
            if ent[2] == 0:
                self._close(seg_id)
            else:
                self._retired.add(seg_id)

    def _close(self, seg_id: int) -> None:
        fd, dfd, _ = self._fds.pop(seg_id)
        self._retired.discard(seg_id)
        self.io.close(fd)
        if dfd >= 0:
            self.io.close(dfd)

    def close_all(self) -> None:
        """Close every segment's fds; those a read still uses (a read that began before the
        store closed) when it lets go -- never under it, where the fd's number could be
        reused by another file."""
        with self._lock:
            self._closed = True
            for seg, ent in list(self._fds.items()):
                if ent[2] == 0:
                    self._close(seg)
                else:
                    self._retired.add(seg)
