"""The log writer (SPEC.md §7): LSNs, appends, padding (§4.2), group-commit sync, rollover to a new segment.

It owns the active segment's write descriptors and the durable / written positions.  It never
reads records back, never touches the index and never decides what is live: the engine hands
it records and is told, under the append lock, where each landed.
"""

from __future__ import annotations

import collections
import itertools
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from ..errors import StoreIOError, TierstoreError
from ..format import constants as fmt
from ..format import record as rec
from .fileio import PAGE, DirectIO, PosixIO, io_error, write_all, write_all_parallel
from .segment import aligned_buffer, new_segment_header, read_segment_header, segment_name
from .threads import submit


class Appended(NamedTuple):
    """Where an appended record landed."""

    segment: int
    offset: int
    lsn: int
    end: int


class Log:
    """The writer side of the segment log: LSNs, appends, padding, group-commit sync, rollover.

    Thread-safe.  ``append`` runs ``on_written`` under the append lock, so callers can keep
    in-memory state in LSN order.  Small records are gathered in a write buffer and reach
    the OS together (``flush_buffer``; every ``sync`` flushes first); large ones are written
    straight from the caller's buffers.  A failed write of buffered records or a failed
    fdatasync poisons the log: every later write raises (the kernel may have dropped the
    dirty pages; retrying would lie).
    """

    SMALL_RECORD = 64 << 10  # records up to this size are buffered
    BUFFER_BYTES = 1 << 20  # the buffer is written out when it grows past this
    COPIES_PENDING_MAX = 16 << 20  # header copies kept for the next HEADERS record (bytes)
    COALESCE_IOVECS, SMALL_PIECE = 64, 16 << 10  # a group of more buffers, this small on average, is joined
    DIRECT_MIN = 4 << 20  # with sync/group durability, records this large are written with O_DIRECT
    BOUNCE_BYTES = 8 << 20  # O_DIRECT writes go through three page-aligned buffers of this size

    def __init__(self, io: PosixIO, seg_dir: str, store_uuid: bytes, *, active: int, tail: int, next_lsn: int,
                 segment_bytes: int, sync_enabled: bool, executor: Any = None, dio: DirectIO | None = None,
                 append_lock: Any = None, alone: Callable[[], bool] | None = None, header_copies: bool = True) -> None:
        self.io, self.seg_dir, self.store_uuid = io, seg_dir, store_uuid
        self.header_copies = header_copies  # False: no HEADERS records (Options.header_copies)
        self.executor = executor
        self.dio = dio or DirectIO()
        self.dfd: int | None = None  # O_DIRECT descriptor of the active segment, opened on first use
        self._bounce: list[memoryview] = []
        self.segment_bytes = segment_bytes
        self.sync_enabled = sync_enabled
        # serialises appends: across processes too when the engine gives an AppendLock (lock.py)
        self.append_lock = append_lock if append_lock is not None else threading.RLock()
        # whether no other process writes the store now (asked, under the append lock, before a
        # failed write is cut back past this process's own records)
        self.alone = alone or (lambda: True)
        # called (under the append lock) before each write to a segment file: other processes
        # learn from it that a writer that dies now may leave a torn record (SPEC.md §7.8)
        self.before_write: Callable[[], None] = lambda: None
        self._sync_lock = threading.Lock()
        self._durable_lock = threading.Lock()  # durable and durable_lsn change together (durable_point)
        self.active = active
        self.tail = tail  # end of the log, buffered bytes included
        self.grown = 0  # bytes this writer added to the log's files (records, padding, segment headers)
        self.next_lsn = next_lsn
        self.fd = io.open(self._path(active), os.O_RDWR)
        # a segment an older minor version began (SPEC.md §11): this writer appends nothing to it,
        # so readers of that version never meet a record of a newer kind in a segment they may read
        # as theirs; the first append starts a new segment
        try:
            self._older_minor = read_segment_header(io, self.fd, path=self._path(active),
                                                    seg_id=active).minor < fmt.FORMAT_MINOR
        except TierstoreError:  # a header recovery salvaged: begin a new segment too
            self._older_minor = True
        self._buf = bytearray()  # bytes [tail - len(_buf), tail) of the active segment, not yet written
        self.written = (active, tail)  # the OS holds every byte before this position
        self.written_lsn = next_lsn - 1
        self.durable = (active, tail)  # every byte before this position is synced
        self.durable_lsn = next_lsn - 1  # (changed with durable, under _durable_lock)
        # the end of the records other writer processes appended, as last adopted (SPEC.md §7.8):
        # a take-back after a failed write never cuts below it
        self._floor, self._floor_lsn = (active, tail), next_lsn - 1
        self.unsynced_bytes = 0
        self.oldest_unsynced: float | None = None
        self.poisoned: BaseException | None = None
        self.fdatasyncs = 0  # fdatasync calls made (concurrent syncs share one)
        # the newest LSN a SYNC record vouches for: at open, none is owed (a later SYNC record names
        # every earlier LSN, and the first is written only after a sync of this process completed)
        self.certified_lsn = next_lsn - 1
        # the LSN of the last record this writer appended that is not a SYNC or HEADERS record (other
        # writers' records are not counted: each vouches for its own, and two writers that sync
        # with nothing new would each write a SYNC record after the other's, a page a sync)
        self.last_data_lsn = next_lsn - 1
        self.on_discard: Callable[[int], None] | None = None  # records from this LSN on were taken back
        # (lsn, segment, offset, header bytes) of records this writer appended whose header copy
        # no HEADERS record holds yet (SPEC.md §4.5): the next sync writes them
        self._copies: collections.deque[tuple[int, int, int, bytes]] = collections.deque()
        self._copies_bytes = 0
        self.copies_dropped = 0  # copies never written (more were pending than COPIES_PENDING_MAX)
        self._sealed_unsynced: list[int] = []  # fds of sealed segments not yet synced (durability="none")
        # a segment's directory entry may not be durable: a writer with durability "none" created it
        # without syncing the directory (this one, or another -- this log did not create the active
        # segment): the next sync syncs the directory too, or a power cut could take the segment,
        # and an acknowledged put with it, away (a review, 2026-12-03).  Read and cleared under the
        # append lock, with what it covers
        self._dir_unsynced = True
        self._sealed_in_flight = 0  # syncs between taking sealed segments and having synced them
        # with other writer processes (the owner sets it to {}): this writer's records, (segment,
        # offset) -> (end, first LSN, last LSN), a group as one entry from its GROUP record on, so
        # that reading the others' records passes over them unread (SegmentScanner's ``skip``)
        self.mine: dict[tuple[int, int], tuple[int, int, int]] | None = None
        self._mine_order: collections.deque[tuple[tuple[int, int], int]] = collections.deque()
        self._mine_lock = threading.Lock()  # (the committer forgets while appends note)
        self._to_close: list[int] = []  # fds of sealed segments, closed by the next sync
        if tail % fmt.PAGE:
            self.sync()  # start on a page boundary: never write into a page holding recovered records

    def _path(self, seg_id: int) -> str:
        return os.path.join(self.seg_dir, segment_name(seg_id))

    def check(self) -> None:
        if self.poisoned is not None:
            raise StoreIOError(f"the store handle is poisoned by an earlier I/O failure: {self.poisoned}",
                               poisoned=True, errno=getattr(self.poisoned, "errno", None))

    @staticmethod
    def create_segment(io: PosixIO, seg_dir: str, store_uuid: bytes, seg_id: int, base_lsn: int, sync: bool) -> None:
        """Create a segment file holding only its header: write, fdatasync, fsync the directory."""
        path = os.path.join(seg_dir, segment_name(seg_id))
        fd = io.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        try:
            write_all(io, fd, [new_segment_header(store_uuid, seg_id, base_lsn).encode()], 0)
            if sync:
                io.fdatasync(fd)
        except BaseException:
            io.close(fd)
            try:
                io.unlink(path)  # nothing was appended to it: take it back so a retry can create it
            except OSError:
                pass  # recovery removes a segment whose header never became durable
            raise
        io.close(fd)
        if sync:
            io.fsync_dir(seg_dir)

    # -- appending ------------------------------------------------------------------------

    def _pad_iov(self, start: int, target: int) -> list[bytes]:
        """Bytes that take the log from ``start`` to ``target``: a PAD record, or zeros when the
        gap is a page-end gap shorter than a record header (SPEC.md §4.2)."""
        gap = target - start
        if gap == 0:
            return []
        if gap < fmt.MIN_RECORD_GAP:
            return [bytes(gap)]
        return [rec.encode_pad(gap)]

    def _start_for(self, align_log2: int, p: int | None = None) -> int:
        p = self.tail if p is None else p
        page_end = rec.align_up(p, fmt.PAGE)
        if p % fmt.PAGE and page_end - p < fmt.MIN_RECORD_GAP:
            p = page_end
        return rec.align_up(p, 1 << align_log2)

    def append(self, record: rec.EncodedRecord,
               on_written: Callable[[Appended, rec.RecordHeader], None] | None = None) -> Appended:
        """Stamp the next LSN on ``record`` and write it (or buffer it, if small).

        Not durable until ``sync``.  ``on_written(where, header)`` runs under the append lock.
        """
        with self.append_lock:
            if self.poisoned is not None:
                self.check()
            record_len = record.header.record_len
            start = self._start_for(record.header.align_log2)
            if self._older_minor or (start + record_len > self.segment_bytes and self.tail > fmt.SEGMENT_HEADER_SIZE):
                self._rollover()
                start = self._start_for(record.header.align_log2)
            lsn = self.next_lsn
            header = record.header.stamped(lsn)
            end = start + record_len
            new_tail = (end + 7) & ~7  # the tail stays 8-aligned: no holes
            if new_tail - self.tail <= self.SMALL_RECORD:
                buf = self._buf
                if start > self.tail:
                    buf += self._pad_iov(self.tail, start)[0]
                for b in record.iovecs(header):
                    buf += b
                if new_tail > end:
                    buf += rec.zeros(new_tail - end)
                self._advance(new_tail, lsn, buffered=True)
                if len(buf) >= self.BUFFER_BYTES:
                    self._flush_buffer()
            else:
                self._flush_buffer()
                self.before_write()
                try:
                    if self._direct_ok(start, record_len):
                        write_all(self.io, self.fd, self._pad_iov(self.tail, start), self.tail)
                        self._write_direct(record.iovecs(header), start)
                    else:
                        iov = self._pad_iov(self.tail, start) + record.iovecs(header) + [rec.zeros(new_tail - end)]
                        write_all_parallel(self.io, self.fd, iov, self.tail, self.executor)
                except OSError as e:
                    raise self._write_failed(e) from None
                self._advance(new_tail, lsn, buffered=False)
            where = Appended(self.active, start, lsn, end)
            self._keep_copy(lsn, self.active, start, header.raw)
            if self.mine is not None:
                self._note_mine(start, new_tail, lsn, lsn)
            if on_written is not None:
                on_written(where, header)
            return where

    def append_group(self, records: Sequence[rec.EncodedRecord],
                     on_written: Callable[[Appended, rec.RecordHeader], None] | None = None) -> list[Appended]:
        """Append ``records`` as one atomic group (SPEC.md §7.7): a GROUP record naming their
        count, then the records, contiguous in one segment and handed to the OS in one write,
        so that they become durable together and recovery applies all of them or none.

        A failed write takes the whole group back.  ``on_written`` runs for each record (not
        for the GROUP record) under the append lock.  One record is a plain ``append``.
        """
        if len(records) == 1:
            return [self.append(records[0], on_written)]
        group = [rec.encode_group(len(records)), *records]
        with self.append_lock:
            if self.poisoned is not None:
                self.check()
            if self._older_minor or (self._group_end(group, self.tail) > self.segment_bytes
                                     and self.tail > fmt.SEGMENT_HEADER_SIZE):
                self._rollover()
            pos, lsn = self.tail, self.next_lsn
            iov: list[memoryview | bytes] = []
            placed: list[tuple[Appended, rec.RecordHeader]] = []
            for r in group:
                start = self._start_for(r.header.align_log2, pos)
                header = r.header.stamped(lsn)
                end = start + r.header.record_len
                new_pos = (end + 7) & ~7
                iov += self._pad_iov(pos, start) + r.iovecs(header) + ([rec.zeros(new_pos - end)] if new_pos > end
                                                                          else [])
                placed.append((Appended(self.active, start, lsn, end), header))
                pos, lsn = new_pos, lsn + 1
            if pos - self.tail <= self.SMALL_RECORD:
                for b in iov:
                    self._buf += b
                self._advance(pos, lsn - 1, buffered=True)
                if len(self._buf) >= self.BUFFER_BYTES:
                    self._flush_buffer()
            else:
                self._flush_buffer()
                self.before_write()
                if len(iov) > self.COALESCE_IOVECS and pos - self.tail < len(iov) * self.SMALL_PIECE:
                    iov = [b"".join(iov)]  # many small records (a batch): one copy beats thousands of iovecs
                try:
                    write_all_parallel(self.io, self.fd, iov, self.tail, self.executor)
                except OSError as e:
                    raise self._write_failed(e) from None  # the file is cut where the group began
                self._advance(pos, lsn - 1, buffered=False)
            for where, header in placed:
                self._keep_copy(where.lsn, where.segment, where.offset, header.raw)
            if self.mine is not None:
                self._note_mine(placed[0][0].offset, pos, placed[0][0].lsn, lsn - 1)
            if on_written is not None:
                for where, header in placed[1:]:
                    on_written(where, header)
            return [where for where, _ in placed[1:]]

    def _group_end(self, group: Sequence[rec.EncodedRecord], pos: int) -> int:
        for r in group:
            pos = self._start_for(r.header.align_log2, pos) + r.header.record_len
        return pos

    def _direct_ok(self, start: int, record_len: int) -> bool:
        return (record_len >= self.DIRECT_MIN and start % PAGE == 0
                and self.dio.direct and self._dfd() >= 0)

    def _dfd(self) -> int:
        """The O_DIRECT write descriptor of the active segment (-1 when unsupported)."""
        if self.dfd is None:
            self.dfd = self.dio.open_direct(self.io, self._path(self.active), os.O_WRONLY)
        return self.dfd

    def _write_direct(self, iov: list[memoryview | bytes], start: int) -> None:
        """Write a record with O_DIRECT, through page-aligned bounce buffers (caller holds
        append_lock).  Copying chunk k+1 overlaps the device writing chunk k; the last page is
        zero-filled (those bytes are padding).  Not durable until ``sync``: the page cache is
        bypassed, but the device's own cache still needs the fdatasync.
        """
        total = sum(memoryview(b).nbytes for b in iov)
        size = rec.align_up(total, PAGE)
        if not self._bounce:
            self._bounce = [memoryview(aligned_buffer(self.BOUNCE_BYTES)) for _ in range(3)]
        pieces = [memoryview(b).cast("B") for b in iov]
        futures: list[Any] = []
        for k, pos in enumerate(range(0, size, self.BOUNCE_BYTES)):
            n = min(self.BOUNCE_BYTES, size - pos)
            buf = self._bounce[k % 3]
            if len(futures) >= 3:
                futures[-3].result()  # that buffer's write is done: reuse it
            filled = 0
            while pieces and filled < n:
                take = min(n - filled, pieces[0].nbytes)
                buf[filled : filled + take] = pieces[0][:take]
                filled += take
                pieces[0] = pieces[0][take:]
                if not pieces[0].nbytes:
                    pieces.pop(0)
            if filled < n:
                buf[filled:n] = bytes(n - filled)
            if self.executor is None:
                write_all(self.io, self.dfd, [buf[:n]], start + pos)
            else:
                futures.append(submit(self.executor, write_all, self.io, self.dfd, [buf[:n]], start + pos))
        error = None
        for f in futures:  # wait for every write before the buffers can be reused or returned
            e = f.exception()
            error = error or e
        if error is not None:
            if isinstance(error, OSError) and self.dio.unsupported(error):
                self.dio.direct = False  # the file system refuses O_DIRECT writes: buffered from now on
                write_all(self.io, self.fd, iov, start)
                return
            raise error

    def _advance(self, new_tail: int, lsn: int, *, buffered: bool) -> None:
        self.next_lsn = lsn + 1
        self.last_data_lsn = lsn
        self.unsynced_bytes += new_tail - self.tail
        self.grown += new_tail - self.tail
        self.tail = new_tail
        if not buffered:
            self.written = (self.active, new_tail)
            self.written_lsn = lsn
        if self.oldest_unsynced is None:
            self.oldest_unsynced = time.monotonic()

    def _flush_buffer(self) -> None:
        """Write the buffered records (caller holds append_lock).

        On failure the buffered records are taken back: the file is cut where the buffer
        began, their LSNs are reused, and ``on_discard(first_lsn)`` tells the owner to forget
        them.  None of them was durable, so no acknowledged write is lost.  If the cut itself
        fails the log is poisoned.
        """
        if not self._buf:
            return
        start = self.tail - len(self._buf)
        self.before_write()
        try:
            write_all(self.io, self.fd, [self._buf], start)
        except OSError as e:
            err = io_error(e, "write to segment", path=self._path(self.active), segment=self.active)
            shared = not self.alone()
            if shared:  # never cut other processes' records: only this append's, and stop writing
                self.poisoned = self.poisoned or e
            if not (self.sync_enabled and not shared and self._take_back(err)):
                first = self.written_lsn + 1  # durability "none": the buffered records only
                self._buf = bytearray()
                self.tail = start
                self.next_lsn = first
                self.unsynced_bytes = 0
                self._undo_partial_write()
                self._discarded(first)
                if isinstance(err, TierstoreError):
                    err.taken_back = self.poisoned is None
                    if shared:
                        err.poisoned = True
                        err.hint = ("other processes write this store: records this handle appended before "
                                    "the failed write may appear after a reopen (never torn); reopen it")
            raise err from None
        self._buf = bytearray()
        self.written = (self.active, self.tail)
        self.written_lsn = self.next_lsn - 1

    @property
    def buffered(self) -> bool:
        """Whether appended records wait in the write buffer (only while the append lock is held)."""
        return bool(self._buf)

    def flush_buffer(self) -> None:
        """Hand every appended record to the OS (no fsync)."""
        with self.append_lock:
            self._flush_buffer()

    def _take_back(self, err: BaseException) -> bool:
        """After a failed write or sync: cut the active segment back to the durable position and
        forget every record after it (caller holds append_lock).  None of them is durable, so no
        acknowledged write is lost; the puts that wrote them raise ``err``, which records whether
        they are gone for good (``taken_back``: not in this handle, not after a reopen) or may
        still appear after a reopen (the cut failed; the log is then poisoned).  False when the
        durable position is not in the active segment (durability "none" sealed segments)."""
        # never below the records other writer processes appended (adopted): they are theirs, and
        # acknowledged by them (found by a cold review: a failed write of this process cut them)
        (seg, off), last = max(self.durable, self._floor), max(self.durable_lsn, self._floor_lsn)
        if seg != self.active:
            return False
        first = last + 1
        self._buf = bytearray()
        taken = True
        try:
            self.io.ftruncate(self.fd, off)
        except OSError as e:
            self.poisoned = self.poisoned or e
            taken = False
        self.tail = off
        self.written = (self.active, off)
        self.written_lsn = last
        self.next_lsn = first
        self.unsynced_bytes = 0
        self.oldest_unsynced = None
        self._discarded(first)
        if isinstance(err, TierstoreError):
            err.taken_back = taken
            if not taken:
                err.hint = ("the writes it made could not be cut from the log: they may appear after the store "
                            "is reopened (never torn); reopen to see what is durable")
        return True

    def _note_mine(self, offset: int, end: int, first: int, last: int) -> None:
        """This writer's record(s) from ``offset`` of the active segment to ``end`` (caller holds
        append_lock)."""
        key = (self.active, offset)
        with self._mine_lock:
            self.mine[key] = (end, first, last)  # type: ignore[index]
            self._mine_order.append((key, last))

    def wrote(self, lsn: int) -> bool:
        """Whether this writer appended the record with ``lsn`` (one the index has not applied
        yet): beside other writers, when ``mine`` names it; writing alone, every record is."""
        if self.mine is None:
            return True
        with self._mine_lock:
            for key, last in reversed(self._mine_order):  # (the newest first: the committer asks of those)
                if last < lsn:
                    return False
                ent = self.mine.get(key)
                if ent is not None and ent[1] <= lsn:
                    return True
        return False

    def forget_mine(self, lsn: int) -> None:
        """The index applied the log up to ``lsn``: no reading of the others' records starts
        before it, so this writer's records up to it need not be known any more."""
        order, mine = self._mine_order, self.mine
        if mine is None:
            return
        with self._mine_lock:
            while order and order[0][1] <= lsn:
                mine.pop(order.popleft()[0], None)

    def _discarded(self, first: int) -> None:
        """Records from LSN ``first`` on were taken back: forget their header copies (their
        positions and LSNs will be reused by other records) and tell the owner."""
        order, mine = self._mine_order, self.mine
        with self._mine_lock:
            while mine is not None and order and order[-1][1] >= first:  # (nor are they this writer's)
                mine.pop(order.pop()[0], None)
        self._copies = collections.deque(c for c in self._copies if c[0] < first)
        self._copies_bytes = sum(len(c[3]) + fmt.HEADER_COPY.size for c in self._copies)
        if self.on_discard is not None:
            self.on_discard(first)

    def _keep_copy(self, lsn: int, seg: int, offset: int, raw: bytes) -> None:
        """Remember the header of a record just appended, for the next HEADERS record (caller
        holds append_lock).  Beyond COPIES_PENDING_MAX bytes the oldest copies are dropped (a
        writer that never syncs): those records are then read as before 1.5 if damaged."""
        if not self.header_copies:
            return
        self._copies.append((lsn, seg, offset, raw))
        self._copies_bytes += len(raw) + fmt.HEADER_COPY.size
        while self._copies_bytes > self.COPIES_PENDING_MAX and len(self._copies) > 1:
            old = self._copies.popleft()
            self._copies_bytes -= len(old[3]) + fmt.HEADER_COPY.size
            self.copies_dropped += 1

    def keep_copies(self, copies: Sequence[tuple[int, int, int, bytes]]) -> None:
        """Header copies of records written outside ``append`` -- (LSN, segment, offset, header)
        of each record a repair wrote in place (SPEC.md §7.6) -- for the next HEADERS record."""
        with self.append_lock:
            for lsn, seg, offset, raw in copies:
                self._keep_copy(lsn, seg, offset, raw)

    def _write_failed(self, e: OSError) -> Exception:
        """The error of a failed append (caller holds append_lock): what it may have written past
        the tail is cut (``_undo_partial_write``); ``taken_back`` says whether that worked -- the
        records are then gone for good, not in this handle, not after a reopen."""
        self._undo_partial_write()
        err = io_error(e, "append to segment", path=self._path(self.active), segment=self.active)
        err.taken_back = self.poisoned is None  # type: ignore[attr-defined]
        return err

    def _undo_partial_write(self) -> None:
        """Cut what a failed write may have left past the tail; poison the log if that fails."""
        try:
            self.io.ftruncate(self.fd, self.tail)
        except OSError as e:
            self.poisoned = e

    def seal_if(self, min_tail: int) -> int:
        """Roll over if the active segment's tail is at least ``min_tail``; the active id after."""
        with self.append_lock:
            if self.tail >= min_tail:
                self._rollover()
            return self.active

    def _rollover(self) -> None:
        """Seal the active segment and start the next one (caller holds append_lock).

        The sealed segment is synced first (unless durability is "none", where the next
        ``sync`` does it), so a sealed segment never has a torn tail.
        """
        self.before_write()
        self._pad_to_page()
        self._flush_buffer()
        if self.sync_enabled:
            # (segments other writers sealed, adopted since the last sync: durable before this claims
            # everything before the new segment durable)
            for old in self._sealed_unsynced:
                self._fdatasync(old)
            self._to_close.extend(self._sealed_unsynced)
            self._sealed_unsynced = []
            self._fdatasync(self.fd)
        new_id = self.active + 1
        try:
            self.create_segment(self.io, self.seg_dir, self.store_uuid, new_id, self.next_lsn, self.sync_enabled)
            fd = self.io.open(self._path(new_id), os.O_RDWR)
        except OSError as e:
            raise io_error(e, "create segment", path=self._path(new_id), segment=new_id) from None
        if self.sync_enabled:
            self._to_close.append(self.fd)  # a concurrent sync() may still be using it
        else:  # (only once the new segment exists: a failed rollover leaves the active fd where it was)
            self._sealed_unsynced.append(self.fd)
        if self.dfd is not None and self.dfd >= 0:
            self.io.close(self.dfd)  # only appends use it, and they hold append_lock
        self.dfd = None
        # create_segment synced the directory (every entry in it), unless durability is "none"
        self._dir_unsynced = not self.sync_enabled
        # (not while a sync() is still syncing sealed segments it took: this claim would cover them
        # before they are durable -- and the committer applies up to durable_lsn; that sync's end
        # moves durable on)
        if self.sync_enabled and not self._sealed_in_flight:
            with self._durable_lock:
                self.durable = (new_id, fmt.SEGMENT_HEADER_SIZE)
                self.durable_lsn = self.next_lsn - 1
            self.unsynced_bytes = 0
            self.oldest_unsynced = None
        self.fd, self.active, self.tail = fd, new_id, fmt.SEGMENT_HEADER_SIZE
        self.grown += fmt.SEGMENT_HEADER_SIZE
        self.written = (new_id, self.tail)
        self._older_minor = False

    # -- syncing ----------------------------------------------------------------------------

    def _pad_to_page(self) -> None:
        """Append padding up to the next page boundary (caller holds append_lock)."""
        if self.tail % fmt.PAGE:
            target = rec.align_up(self.tail, fmt.PAGE)
            for b in self._pad_iov(self.tail, target):
                self._buf += b
            self.grown += target - self.tail
            self.tail = target

    def _fdatasync(self, fd: int) -> None:
        self.fdatasyncs += 1
        try:
            self.io.fdatasync(fd)
        except OSError as e:
            self.poisoned = e
            raise StoreIOError(f"fdatasync failed: {e.strerror or e}; the handle is now poisoned",
                               errno=e.errno, poisoned=True, segment=self.active) from None

    def _sync_dir(self) -> None:
        """Make the segments directory's entries durable (the active segment's among them)."""
        try:
            self.io.fsync_dir(self.seg_dir)
        except OSError as e:
            self.poisoned = e
            raise StoreIOError(f"fsync of the segments directory failed: {e.strerror or e}; the handle is now "
                               "poisoned", errno=e.errno, poisoned=True, path=self.seg_dir) from None

    def sync(self, upto: Appended | None = None) -> None:
        """Make every record appended so far (or at least up to ``upto``) durable.

        Group commit: a thread that finds its record already covered by another thread's
        fdatasync returns at once; otherwise it pads the tail to a page boundary (so no later
        write touches a synced page), writes the buffer, and issues one fdatasync for
        everything appended.
        """
        with self._sync_lock:
            self.check()
            if upto is not None and (upto.segment, upto.end) <= self.durable:
                return
            with self.append_lock:
                self.check()
                self._certify()
                self._pad_to_page()
                self._flush_buffer()
                fd, pos, lsn = self.fd, (self.active, self.tail), self.next_lsn - 1
                sealed, self._sealed_unsynced = self._sealed_unsynced, []
                sync_dir, self._dir_unsynced = self._dir_unsynced, False
                to_close, self._to_close = self._to_close, []
                self._sealed_in_flight += bool(sealed)
                self.unsynced_bytes = 0
                self.oldest_unsynced = None
            try:
                for old in sealed:  # older segments first: the log stays a prefix on disk
                    self._fdatasync(old)
                self._fdatasync(fd)  # outside append_lock: appends continue during the sync
                if sync_dir:
                    self._sync_dir()
            except StoreIOError as e:  # poisoned; what was not durable is taken back (when no other
                with self.append_lock:  # process writes: their records after ours are never cut)
                    if fd == self.fd and self.alone():
                        self._take_back(e)
                raise
            finally:
                with self.append_lock:
                    self._sealed_in_flight -= bool(sealed)
                for old in sealed + to_close:  # (on failure too: the handle is poisoned, they would leak)
                    try:
                        self.io.close(old)
                    except OSError:
                        pass
            with self._durable_lock:  # (a rollover on another thread moves both meanwhile)
                self.durable = max(self.durable, pos)
                self.durable_lsn = max(self.durable_lsn, lsn)

    def durable_point(self) -> tuple[int, tuple[int, int]]:
        """The last durable LSN and the position where its record ends (every durable byte lies
        before it), read together: a reader of the log up to that position reads every record
        up to that LSN."""
        with self._durable_lock:
            return self.durable_lsn, self.durable

    def _sync_fits(self) -> bool:
        """Whether a SYNC record fits in the active segment (caller holds append_lock)."""
        record = rec.encode_sync(self.durable_lsn)
        start = self._start_for(record.header.align_log2)
        return start + record.header.record_len <= self.segment_bytes or self.tail <= fmt.SEGMENT_HEADER_SIZE

    def _certify(self) -> None:
        """Append a SYNC record vouching for what earlier syncs made durable, if anything became
        durable since the last one (caller holds append_lock).  Recovery uses it to tell damage
        to a record that was synced from a torn write that never was (SPEC.md §7.3).  It is
        written before the sync that follows, so it only ever vouches for completed syncs."""
        self._write_copies()
        if self.durable_lsn <= self.certified_lsn or self.last_data_lsn <= self.certified_lsn:
            return  # nothing new is durable, or only SYNC records (which need no vouching)
        if not self._sync_fits():
            return  # the segment is full: the rollover that comes next seals (and syncs) it anyway
        record = rec.encode_sync(self.durable_lsn)
        self._buffer_control(record, self._start_for(record.header.align_log2))
        self.certified_lsn = self.durable_lsn

    def _buffer_control(self, record: rec.EncodedRecord, start: int) -> None:
        """Stamp the next LSN on a SYNC or HEADERS record and buffer it at ``start`` (padding
        before it, zeros after it to the next multiple of 8; caller holds append_lock).  It is
        not data: ``last_data_lsn`` stays, as such records need no vouching."""
        header = record.header.stamped(self.next_lsn)
        buf = self._buf
        if start > self.tail:
            buf += self._pad_iov(self.tail, start)[0]
        for b in record.iovecs(header):
            buf += b
        end = start + record.header.record_len
        new_tail = (end + 7) & ~7
        if new_tail > end:
            buf += rec.zeros(new_tail - end)
        data_lsn = self.last_data_lsn
        self._advance(new_tail, header.lsn, buffered=True)
        self.last_data_lsn = data_lsn

    def _write_copies(self) -> None:
        """Append a HEADERS record holding copies of the headers of records this writer appended
        since the last one (caller holds append_lock), up to HEADERS_MAX_BYTES of them (a quarter
        segment in smaller segments: the rest wait for the next sync); when it
        does not fit in the active segment they wait for the next sync (SPEC.md §4.5, §7.3).
        Recovery reads a record whose own header is damaged with its copy instead of refusing."""
        if not self._copies:
            return
        take, size = 0, 0
        # at most a quarter segment a record: one written at a fresh segment's start goes in whatever its
        # size (20,000 small puts between syncs made one 2.8 MB segment of 64 KiB, past an SSD budget)
        most = min(fmt.HEADERS_MAX_BYTES, self.segment_bytes // 4)
        for c in self._copies:
            n = len(c[3]) + fmt.HEADER_COPY.size
            if take and size + n > most:
                break
            take, size = take + 1, size + n
        batch = list(itertools.islice(self._copies, take))
        record = rec.encode_headers([(seg, off, raw) for _, seg, off, raw in batch])
        start = self._start_for(record.header.align_log2)
        room = self.segment_bytes - rec.encode_sync(self.next_lsn).header.record_len - fmt.RECORD_ALIGN
        if start + record.header.record_len > room and self.tail > fmt.SEGMENT_HEADER_SIZE:
            return
        for _ in range(take):
            self._copies.popleft()
        self._copies_bytes -= size
        self._buffer_control(record, start)

    def certify(self) -> None:
        """Make everything durable and vouched for by a SYNC record (a clean close): one sync for
        the records, one for the SYNC record that names them."""
        self.sync()
        if self.durable_lsn > self.certified_lsn and self.last_data_lsn > self.certified_lsn:
            with self._sync_lock, self.append_lock:
                if not self._sync_fits():  # the segment is full: the SYNC record opens the next one,
                    self._rollover()  # so that the last records are vouched for too
            self.sync()

    # -- several writer processes (SPEC.md §7.8) ------------------------------------------

    def position(self) -> tuple[int, int, int]:
        """(active segment, tail, next LSN): where the next record goes (caller holds append_lock)."""
        return self.active, self.tail, self.next_lsn

    def adopt(self, active: int, tail: int, next_lsn: int) -> None:
        """Other processes appended: the log now ends at ``tail`` of segment ``active`` and the
        next LSN is ``next_lsn`` (caller holds append_lock, with nothing buffered).  A segment
        left behind was sealed by another writer: this one syncs it before it next claims
        durability past it.  Their records are theirs to vouch for (``last_data_lsn`` stays)."""
        assert not self._buf
        if active != self.active:
            # segments other writers sealed in between (one with durability "none" syncs none of them):
            # this writer's next sync makes them durable too -- it vouches for every record before its
            # own (SPEC.md §7.8).  Every file is opened before anything changes: a failed open leaves
            # the log as it was, and nothing open
            opened: list[int] = []
            try:
                for between in range(self.active + 1, active):
                    try:
                        opened.append(self.io.open(self._path(between), os.O_RDWR))
                    except FileNotFoundError:  # (removed by a compaction since: its records were copied)
                        pass
                fd = self.io.open(self._path(active), os.O_RDWR)
            except OSError as e:
                for f in opened:
                    self.io.close(f)
                raise io_error(e, "open segment", path=self._path(active), segment=active) from None
            self._sealed_unsynced.append(self.fd)
            self._sealed_unsynced.extend(opened)
            if self.dfd is not None and self.dfd >= 0:
                self.io.close(self.dfd)
            self.dfd = None
            self.fd, self.active = fd, active
            self._dir_unsynced = True  # (another writer created it, maybe without a directory sync)
            self._older_minor = False  # begun by a writer of this version (an older one appends nowhere now)
        self.tail, self.next_lsn = tail, next_lsn
        self.written, self.written_lsn = (active, tail), next_lsn - 1
        self._floor, self._floor_lsn = (active, tail), next_lsn - 1

    def close(self) -> None:
        with self._sync_lock, self.append_lock:
            for fd in self._sealed_unsynced + self._to_close + ([self.fd] if self.fd >= 0 else []):
                self.io.close(fd)
            if self.dfd is not None and self.dfd >= 0:
                self.io.close(self.dfd)
            self._sealed_unsynced, self._to_close, self.fd, self.dfd = [], [], -1, None
