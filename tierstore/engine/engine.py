"""The engine: one store directory's segment log, LMDB index and the commit protocol between them (SPEC.md §7).

Write path:  Engine.append / append_group -> Log.append (LSN stamped; memtable and subscribers
             told under the append lock) -> Engine.settle (Log.sync as the durability mode
             says) -> committer thread -> Engine.commit -> Index.apply
Read path:   Engine.lookup (memtable, then an index snapshot) -> Engine.reader(location)
             -> segment.read_extents (preadv into the caller's buffers, checksums verified)

It owns the segment files, the writer lock, the log (LSNs, group commit), the memtable of
records appended but not yet in the index, the committer thread, and opening a directory
(create, replay the log tail, rebuild a missing or stale index).  A memtable entry is used
only while its LSN is newer than the index's applied LSN, read in the same snapshot, so the
two never disagree.

It knows records, never objects, and never imports the tiers, the handle or the tools: those
are given an Engine and use only its public methods and attributes (``io``, ``index``,
``options``, ``path``); docs/design.md lists them.  Compaction (compaction.py) and the
offline tools (repair.py) are its neighbours, given the engine; recovery.py is below it.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import fcntl
import functools
import heapq
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..errors import (
    CorruptionError,
    FormatVersionError,
    InvalidObject,
    ReadOnlyError,
    StoreClosed,
    StoreFull,
    StoreIOError,
    StoreNotFound,
    TierstoreError,
)
from ..format import constants as fmt
from ..format import record as rec
from . import recovery
from . import segment as seglib
from .fileio import DEFAULT_IO, PosixIO, io_error
from .index import RESIZES, Applied, Index, Location, Op, resized_since, survives_resizes
from .index import damaged as index_damaged
from .index import stamp as index_stamp
from .lock import (
    AppendLock,
    CommitTurn,
    acquire_writer_lock,
    alone_now,
    claim,
    compaction_lock,
    downgrade,
    join_writers,
    writer_active,
)
from .log import Appended, Log
from .memtable import Memtable
from .options import Options
from .threads import submit

DURABILITY = ("sync", "group", "none")
_log = logging.getLogger("tierstore")
_NOWHERE: dict[str, Any] = {}  # an error's where, filled in by whoever catches it (the hot path builds none)
# what a store directory holds (SPEC.md §1); a new store is created only where nothing else is
STORE_ENTRIES = frozenset({fmt.LOCK_FILE, fmt.SEGMENTS_DIR, fmt.INDEX_DIR, fmt.QUARANTINE_DIR,
                           fmt.INDEX_DIR + ".rebuild", fmt.RESERVE_FILE, fmt.REMOTE_FILE,
                           fmt.REMOTE_FILE + ".tmp", fmt.APPEND_FILE, fmt.COMPACT_FILE, fmt.REMOTE_LOCK_FILE,
                           fmt.INFLIGHT_FILE, fmt.STAMPS_FILE, fmt.COMMIT_FILE})
QUARANTINE_RECOUNT_S = 2.0  # quarantine/'s bytes are counted again at least this often (disk_bytes)
RESERVE_AUTO = 8 << 20  # reserve_bytes=None: this much, once the segments hold RESERVE_AUTO_FROM bytes
RESERVE_AUTO_FROM = 256 << 20
# a retired segment shrunk away gradually (retire_segments(gradual=True)) loses this many bytes
# per ftruncate, with this pause between steps: the file system frees (and, mounted with
# `discard`, trims) a little at a time instead of a whole segment in the journal commit that
# the next put's sync waits for (measured: docs/placement.md)
SHRINK_STEP = 16 << 20
SHRINK_PAUSE_S = 0.01
# records another writer appended and the index has not applied after this long are applied by
# any writer's committer (their writer died before applying them): Engine._apply_abandoned
ABANDONED_S = 1.0
# a committer whose index commit found the disk full tries again this much later (or at the next put)
FULL_RETRY_S = 1.0

# The writable engines of this process, by the store's real path: a second writable handle on a
# store this process already writes shares that engine (the writer lock is per process).
_WRITERS: dict[str, "Engine"] = {}
_WRITERS_LOCK = threading.Lock()
_OPENING: dict[str, threading.Lock] = {}  # one open at a time per path
_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()  # every engine of this process (for fork)


def _forked() -> None:
    """In the child of a ``fork()``: the engines it inherited stay the parent's.  They are
    marked ``inherited`` (their handles refuse every call and their close touches nothing: a
    child writing through the parent's log position, or unlocking the parent's flocks, would
    corrupt the store), and a ``tierstore.open`` in the child makes an engine of its own."""
    global _WRITERS_LOCK
    for engine in list(_ENGINES):
        engine.inherited = True
        engine.let_go_of_locks()
    _WRITERS.clear()
    _OPENING.clear()
    _WRITERS_LOCK = threading.Lock()  # another thread of the parent may have held it


os.register_at_fork(after_in_child=_forked)

# called under the log's append lock, in LSN order, for every record appended:
# (namespace, key) and the record's header for a PUT, None for a DELETE
WriteListener = Callable[[tuple[bytes, bytes], "rec.RecordHeader | None"], None]


def _index_reads(fn: Callable[..., Any]) -> Callable[..., Any]:
    """An Engine method that reads the index: damage it finds is noted (``_index_damage``)."""

    retried = survives_resizes(fn)  # (another thread resized the map under this read: read again)

    @functools.wraps(fn)
    def reading(self: "Engine", *args: Any, **kwargs: Any) -> Any:
        try:
            return retried(self, *args, **kwargs)
        except CorruptionError as e:
            raise self._index_damage(e) from None

    return reading


def _live_under(view: Any, ns: bytes, prefix: bytes, ops: dict[bytes, Op]) -> bool:
    """Whether ``ns`` holds a key starting with ``prefix`` in this snapshot with ``ops`` (its
    unapplied records there) on top: a pending put, or an indexed key no pending delete removes
    (at most one more entry read than there are pending deletes)."""
    if any(m.location is not None for m in ops.values()):
        return True
    return any(k not in ops for k, _ in view.keys(ns, prefix, limit=len(ops) + 1))


class ViewLock:
    """``Engine.write_lock`` with other writer processes: the append lock, and then every record
    they appended that a decision must see (``Engine.see_all``).  Re-entrant, as the append lock."""

    def __init__(self, append: AppendLock, see_all: Callable[[], None]) -> None:
        self.append, self.see_all = append, see_all

    def __enter__(self) -> "ViewLock":
        self.append.acquire()
        try:
            self.see_all()
        except BaseException:
            self.append.release()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.append.release()


class HeldSegment:
    """The context manager of ``Engine.hold_segment`` (a class, not a generator: it is on every read)."""

    __slots__ = ("files", "seg")

    def __init__(self, files: seglib.SegmentFiles, seg: int) -> None:
        self.files, self.seg = files, seg

    def __enter__(self) -> tuple[int, int]:
        return self.files.acquire(self.seg)

    def __exit__(self, *exc: Any) -> None:
        self.files.release(self.seg)


class SegmentReader:
    """Reads the extents of one record where ``Engine.lookup`` found it (an ``ExtentReader``,
    format/block.py).  Holds the segment's descriptors only while reading, so compaction may
    retire the segment in between: a read then raises FileNotFoundError and the caller looks
    the key up again."""

    def __init__(self, engine: "Engine", loc: Location, where: dict[str, Any]) -> None:
        self.engine, self.loc, self.where = engine, loc, where

    def ensure_written(self) -> None:
        """Hand the record to the OS if it is still in the log's write buffer."""
        log = self.engine.log
        if log is not None and log.buffered and \
                (self.loc.segment, self.loc.offset + self.loc.header.record_len) > log.written:
            log.flush_buffer()

    def read_into(self, wanted: Sequence[tuple[int, memoryview]]) -> None:
        self.ensure_written()
        e = self.engine
        with e.hold_segment(self.loc.segment) as (fd, dfd):
            seglib.read_extents(e.io, fd, self.loc.offset, self.loc.header, wanted, self.where, e.executor, dfd,
                                e.files.dio)

    def read_bytes(self, index: int) -> bytes:
        self.ensure_written()
        e = self.engine
        with e.hold_segment(self.loc.segment) as (fd, _):
            return seglib.read_extent_bytes(e.io, fd, self.loc.offset, self.loc.header, index, self.where)


class Engine:
    """The log and the index of one store directory, opened for writing (any number of processes,
    SPEC.md §7.8) or read-only (any number).  Thread-safe.

    ``write_lock`` serialises read-modify-write sequences of callers (look a key up, decide,
    append) across threads and processes: it is the append lock, and taking it first catches up
    with the records other processes appended; ``append`` itself needs no lock.  Never sync
    (``settle``, ``flush``) while holding it.  ``close`` makes every write durable and visible,
    stops the committer and releases the locks.
    """

    def __init__(self, path: str | os.PathLike[str], *, create: bool = True, readonly: bool = False,
                 durability: str = "sync", options: Options | None = None, io: PosixIO | None = None,
                 dram_tier: bool = False) -> None:
        self.path = os.path.abspath(os.fspath(path))
        self.readonly = readonly
        self.durability = durability
        self.options = options or Options()
        self.io = io or DEFAULT_IO
        self.closed = True
        if durability not in DURABILITY:
            raise InvalidObject(f"durability must be one of {', '.join(DURABILITY)}, got {durability!r}")
        self.index: Index | None = None
        self.log: Log | None = None
        self.store_uuid: bytes | None = None
        self.recovery: dict[str, Any] = {}  # what opening found and did (replay, rebuild, damage)
        # (and "syncs", from the log: stats)
        self.counters = {"sync_requests": 0, "index_commits": 0, "abandoned_catch_ups": 0}
        self.write_lock: Any = threading.RLock()  # the append lock once opened writable
        self._append: AppendLock | None = None
        self._turn: CommitTurn | None = None  # beside other writers: the index commits' turn (COMMIT)
        self._hear_all = 0  # listeners that must hear of every other process's record (subscribe)
        self._held_fds: set[int] = set()  # compaction locks held now (compaction_lock)
        self.alone = True  # no other process had the store open for writing when this one opened
        self._entered_at: tuple[int, int, int] | None = None  # the log's end when the append lock was taken
        self._marked = False  # APPEND says "writing" (this process wrote under the append lock it holds)
        self._hold_start: tuple[int, int, int] | None = None  # the log's end when this hold began
        self._behind: tuple[int, int, int] | None = None  # records from here on were appended by others, unread
        self._merge_lock = threading.Lock()  # merging others' records into the pending list vs applying it
        self._syncer: ThreadPoolExecutor | None = None  # put_async's syncs, started on first use
        self._syncer_lock = threading.Lock()
        self.executor = ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 2)),
                                           thread_name_prefix="tierstore-io")
        self.seg_dir = os.path.join(self.path, fmt.SEGMENTS_DIR)
        self.files = seglib.SegmentFiles(self.io, self.seg_dir, direct_reads=self.options.direct_reads,
                                         dram_tier=dram_tier)
        self._lock_fd = -1
        self._listeners: list[WriteListener] = []
        self._mem = Memtable()  # newest unapplied record per key
        self._refs_seen = False  # the store holds (or held) session references
        self._sealed_sizes: dict[int, int] = {}  # disk_bytes: sealed segments never grow
        self._shrinking = 0  # disk_bytes: what is left of retired segments being shrunk away
        self._quarantined: tuple[int, int, float] | None = None  # disk_bytes: (its mtime, bytes, counted at)
        self.agreed: dict[str, Any] = {}  # open_engine: what the handles sharing this engine must agree on
        self.index_txn_records = self.options.index_batch  # the most records one index transaction applies
        self.reserve_cap: int | None = None  # limit_reserve: a budget's bound on the automatic reserve
        self.reserve_released = 0  # times this handle gave the reserve up (release_reserve)
        self._reserve_lock = threading.Lock()
        self._shrink_lock = threading.Lock()
        self._pending: list[Op] = []
        self._pending_lock = threading.Lock()
        self._oldest_pending: float | None = None
        self._commit_lock = threading.Lock()
        self._cv = threading.Condition()
        self._stopping = False
        self._committer: threading.Thread | None = None
        self._committer_error: BaseException | None = None
        self._full_logged = False  # the committer said that the disk is full (until a commit succeeds)
        self.users = 1  # handles sharing this engine (open_engine); the last close closes it
        self.inherited = False  # True in a fork()ed child: the engine is the parent's (_forked)
        self._next_abandoned_check = 0.0  # _apply_abandoned
        self._put_keys: dict[int, frozenset[int]] = {}  # put_keys, per sealed segment
        self._put_keys_lock = threading.Lock()
        self._abandoned_suspect = 0
        self.index_damage: str | None = None  # damage a read found in the index (rebuilt at the next open)
        self._warned_index = False
        self._close_lock = threading.Lock()
        try:
            self._open(create)
        except OSError as e:
            self._teardown()
            if isinstance(e, TierstoreError):
                raise
            err = io_error(e, "open store", path=self.path)
            if isinstance(err, StoreIOError):  # nothing was open yet: no recovery to restart
                err.hint = ("check that the directory (or its parent) exists and this user may create and write "
                            "files there" if e.errno in (errno.ENOENT, errno.EACCES, errno.EPERM, errno.EROFS)
                            else "check the path and the file system it is on")
            raise err from None
        except BaseException:
            self._teardown()
            raise
        self.closed = False
        _ENGINES.add(self)

    # -- opening ----------------------------------------------------------------------------

    def _open(self, create: bool) -> None:
        io = self.io
        if not os.path.exists(self.path):
            if not create or self.readonly:
                raise StoreNotFound(f"no store at {self.path}", path=self.path, hint=self._not_found_hint(create))
            os.makedirs(self.path, exist_ok=True)
        elif not os.path.isdir(self.path):
            raise InvalidObject(f"{self.path} exists and is not a directory", path=self.path)
        elif not create and not self.readonly and not Index.exists(os.path.join(self.path, fmt.INDEX_DIR)) \
                and not (os.path.isdir(self.seg_dir) and seglib.list_segments(io, self.seg_dir)):
            # (before any lock file is made: `tierstore compact` of a wrong directory left LOCK,
            # APPEND and COMMIT in it)
            raise StoreNotFound(f"no store at {self.path}", path=self.path, hint=self._not_found_hint(create))
        elif create and not self.readonly and not Index.exists(os.path.join(self.path, fmt.INDEX_DIR)) \
                and not (os.path.isdir(self.seg_dir) and seglib.list_segments(io, self.seg_dir)):
            others = sorted(set(os.listdir(self.path)) - STORE_ENTRIES)
            if others:  # never scatter LOCK, index/ and segments/ among someone's files
                raise InvalidObject(f"{self.path} is not empty and holds no store "
                                    f"({', '.join(others[:5])}{', ...' if len(others) > 5 else ''})",
                                    path=self.path, hint="create a store in a new or empty directory")
        if self.readonly:
            self._open_files(create)
            return
        if self.options.exclusive:  # one writer for the handle's life (SPEC.md §7.2): no append lock
            self._lock_fd = acquire_writer_lock(io, self.path, self.options.lock_timeout)
            self._open_files(create)
            return
        # every writer takes the append lock, then the writer lock: exclusively when no other
        # writer has the store open (then this one may recover the log and rebuild the index),
        # shared beside them otherwise (SPEC.md §7.8)
        self._append = append = AppendLock(io, self.path)
        self._turn = CommitTurn(io, self.path)
        append.acquire(timeout=self.options.lock_timeout)
        try:
            self._lock_fd, self.alone = join_writers(io, self.path, self.options.lock_timeout)
            self._open_files(create)
            assert self.log is not None
            append.on_enter, append.on_leave = self._catch_up, self._publish
            self.log.before_write = self._mark_writing
            if self.alone:
                downgrade(io, self._lock_fd)
        finally:
            append.release()  # publishes where the log ends
        self.write_lock = ViewLock(append, self.see_all)

    def _open_files(self, create: bool) -> None:
        io = self.io
        joining = not self.readonly and not self.alone
        index_dir = os.path.join(self.path, fmt.INDEX_DIR)
        has_segments = os.path.isdir(self.seg_dir) and bool(seglib.list_segments(io, self.seg_dir))
        has_index = Index.exists(index_dir)
        if joining and not (has_segments and has_index):
            raise CorruptionError("the index or the segments are missing while other processes write the store",
                                  path=self.path, hint="close the other writers; the next writer to open the "
                                                       "store alone rebuilds the index")
        if has_segments and recovery.abandoned_creation(io, self.path) and not self.readonly:
            seg = seglib.list_segments(io, self.seg_dir)[0]
            recovery.quarantine_file(io, self.path, self.files.path(seg))  # a crash during creation
            has_segments = False
        if not has_segments and not has_index:
            if self.readonly or not create:
                raise StoreNotFound(f"no store at {self.path}", path=self.path, hint=self._not_found_hint(create))
            self._create_store()
        elif not has_segments:
            raise CorruptionError("the index exists but no segment files do", path=self.seg_dir,
                                  hint="restore the segments/ directory; the index alone holds no data")
        elif not has_index:
            if self.readonly:
                raise CorruptionError("the index is missing", path=index_dir,
                                      hint="open the store writable (or run `tierstore recover PATH`) to rebuild it")
            self._rebuild("index missing")
        try:
            self.index = Index.open(index_dir, writable=not self.readonly, map_size=self.options.index_map_size,
                                    at_rest=self.alone if not self.readonly else not writer_active(self.io, self.path))
            scan = self._replay()
        except CorruptionError as e:
            if self.readonly or joining or not getattr(e, "index", False):
                if joining and getattr(e, "index", False):
                    e.hint = ("other processes write this store: close them, and the next writer to open it "
                              "alone rebuilds the index")
                raise
            if self.index is not None:
                self.index.close()
                self.index = None
            self.warn_index(f"index unreadable ({e.message})")
            self._rebuild(f"index unreadable ({e.message})")  # derived data: rebuild it from the log
            self.index = Index.open(index_dir, writable=True, map_size=self.options.index_map_size)
            scan = self._replay()
        self._refuse_newer_segments()
        if self.readonly:
            for op in scan.ops:
                self._mem.set(op.namespace, op.key, op)
            return
        if scan.ops:
            self.index.apply(scan.ops, scan.last, durable=True)
        self._refs_seen = self.index.ref_count() > 0
        if self.alone:  # a compaction in another process may be unlinking them right now
            self._drop_dead_segments(keep=scan.active)
        assert self.store_uuid is not None
        self.log = Log(io, self.seg_dir, self.store_uuid, active=scan.active, tail=scan.tail,
                       next_lsn=scan.next_lsn, segment_bytes=self.options.segment_bytes,
                       sync_enabled=self.durability != "none", executor=self.executor, dio=self.files.dio,
                       append_lock=self._append, alone=self._alone_now if self._append is not None else None,
                       header_copies=self.options.header_copies)
        self.log.on_discard = self._on_discard
        if self._append is not None:  # other writers' records are read past this one's
            self.log.mine = {}
        self.ensure_reserve()

    def _refuse_newer_segments(self) -> None:
        """No reader may read a store holding a segment of a newer major version or with
        incompatible feature bits it does not know (FormatVersionError), and no writer may write
        to one with a segment of a newer minor version or unknown read-only-compatible bits
        (ReadOnlyError; SPEC.md §3.1, §11): every segment's header is read, not only those of the
        log replayed at open (a sealed one was let through).  A header that cannot be read is
        recovery's business, not this check's."""
        for seg in seglib.list_segments(self.io, self.seg_dir):
            path = self.files.path(seg)
            try:
                fd = self.io.open(path, os.O_RDONLY)
            except OSError:
                continue  # (removed by a compaction meanwhile)
            try:
                header = seglib.read_segment_header(self.io, fd, path=path, seg_id=seg)
            except FormatVersionError:
                # a newer major version or unknown incompat bits: no writer, no reader -- unless the
                # header fails its checksum read as format 1 (a damaged byte: recovery's business)
                if recovery.damaged_v1_header(self.io, fd):
                    continue
                raise
            except TierstoreError:
                continue
            finally:
                self.io.close(fd)
            if not header.writable and not self.readonly:
                raise ReadOnlyError(header.newer(), path=path, segment=seg,
                                    hint="open it with readonly=True, or upgrade tierstore to write to it")

    def _not_found_hint(self, create: bool) -> str:
        if self.readonly:
            return "a read-only open never creates a store: open it writable once to create it"
        return "pass create=True to make a new store" if not create else "check the path"

    def _create_store(self) -> None:
        io = self.io
        uuid = seglib.new_store_uuid()
        if not os.path.isdir(self.seg_dir):
            io.mkdir(self.seg_dir)
        Log.create_segment(io, self.seg_dir, uuid, 1, 1, sync=True)
        io.fsync_dir(self.path)
        idx = Index.open(os.path.join(self.path, fmt.INDEX_DIR), writable=True, map_size=self.options.index_map_size)
        try:
            idx.initialise(uuid)
        finally:
            idx.close()
        index_stamp(os.path.join(self.path, fmt.INDEX_DIR))
        io.fsync_dir(self.path)

    def _rebuild(self, why: str) -> None:
        t0 = time.perf_counter()
        scan = recovery.rebuild_index(self.io, self.path, repair=False)
        self.recovery.update({"rebuilt_index": why, "rebuild_seconds": time.perf_counter() - t0,
                              "rebuild_bytes_scanned": scan.bytes_scanned})
        self.recovery.setdefault("damage", []).extend(d.__dict__ for d in scan.damage)
        self.recovery.setdefault("removed_segments", []).extend(scan.removed_segments)

    def _scan_from_applied(self, uuid: bytes) -> recovery.LogScan:
        """The log from the index's applied position on.  Beside other writers (or read-only),
        compaction in another process may commit its copies and remove the segment that
        position named between our reads of the two: while the applied position keeps moving
        the scan starts again from the new one; only a position that stays missing is
        IndexAhead."""
        assert self.index is not None
        for attempt in range(50):
            applied = self.index.applied()
            try:
                if not recovery.check_applied(self.io, self.path, applied):
                    raise recovery.IndexAhead("the index's applied position is not in the log")
                return recovery.scan_log(self.io, self.path, uuid, applied, writable=not self.readonly, repair=False)
            except (recovery.IndexAhead, FileNotFoundError):
                if self.alone and not self.readonly or attempt == 49 or self.index.applied() == applied:
                    raise
                time.sleep(0.001 * attempt)  # another process moved the index on: look again
        raise AssertionError("unreachable")

    def _replay(self) -> recovery.LogScan:
        """Bring the index up to the end of the log (see recovery.py)."""
        assert self.index is not None
        t0 = time.perf_counter()
        uuid = self.index.store_uuid()
        version = self.index.format_version()
        if uuid is None or version is None:  # a kill while the store was created, or damage: derived, rebuilt
            raise index_damaged("index has no store identity", self.index.path)
        if version[0] != fmt.FORMAT_MAJOR:
            raise FormatVersionError(f"index written by format {version[0]}.{version[1]}", path=self.index.path)
        self.store_uuid = uuid
        try:
            scan = self._scan_from_applied(uuid)
        except recovery.IndexAhead as e:
            if self.index.applied_synced():
                self._refuse_newer_segments()  # (a newer writer's records this version cannot read: not damage)
                # the writer that applied it had synced it: the log lost durable records (a segment
                # removed or cut), not what a power cut takes with durability="none" -- rebuilt from
                # the log, the keys they wrote would read older versions, or deleted ones come back
                raise CorruptionError(f"the log lost records that were synced before the index applied them "
                                      f"({e.message})", path=self.path,
                                      hint="restore the missing segment files if you can; else run `tierstore "
                                           "recover PATH`: it rebuilds the index from the log and deletes the "
                                           "keys whose newest versions were lost (the index is its witness)") from None
            if self.readonly or not self.alone:
                raise CorruptionError(f"index and log disagree ({e.message})", path=self.path,
                                      hint="open the store writable (or run `tierstore recover PATH`) "
                                           "to rebuild the index") from None
            self.index.close()
            self.index = None
            # said aloud, not only in ``recovery``: records the index had applied are not in the log
            # any more -- lost by a power cut with durability="none" (nothing promised them), or by
            # damage to the log (then the keys they replaced read their older versions; `tierstore
            # recover`, run instead, deletes those keys, with the index as its witness)
            _log.warning("tierstore: %s: the index is ahead of the log (%s): records it had applied are gone "
                         "from the log; the index is rebuilt from the log", self.path, e.message)
            self._rebuild(e.message)
            self.index = Index.open(os.path.join(self.path, fmt.INDEX_DIR), writable=True,
                                    map_size=self.options.index_map_size)
            applied = self.index.applied()
            scan = recovery.scan_log(self.io, self.path, uuid, applied, writable=True, repair=False)
        self.recovery.update({"replayed_records": len(scan.ops), "replay_seconds": time.perf_counter() - t0})
        self.recovery.setdefault("damage", []).extend(d.__dict__ for d in scan.damage)
        self.recovery.setdefault("removed_segments", []).extend(scan.removed_segments)
        return scan

    def _drop_dead_segments(self, keep: int) -> None:
        """Unlink segments a finished compaction marked dead, and what is left of retired
        segments that were being shrunk away (a crash may have left them)."""
        assert self.index is not None
        dead = [s for s, (_, state) in self.index.segment_stats().items() if state == 1 and s != keep]
        for seg in dead:
            path = self.files.path(seg)
            if os.path.exists(path):
                self.io.unlink(path)
        shrunk = [n for n in self.io.listdir(self.seg_dir) if n.endswith(fmt.SEGMENT_SUFFIX + fmt.RETIRED_SUFFIX)]
        for name in shrunk:  # a crash while a retired segment was shrunk away left the rest of it
            self.io.unlink(os.path.join(self.seg_dir, name))
        if dead or shrunk:
            self.io.fsync_dir(self.seg_dir)
        if dead:
            self.index.forget_segments(dead)

    # -- closing ----------------------------------------------------------------------------

    def let_go_of_locks(self) -> None:
        """In a forked child: close the inherited descriptors of the store's coordination files.
        A ``flock`` belongs to the open file, which parent and child share: the parent's locks
        stay as long as the parent holds them, but a child that outlives a parent killed
        mid-commit no longer keeps COMMIT (or APPEND, LOCK, COMPACT) locked for every other
        writer."""
        for holder in (self._turn, self._append):
            if holder is not None and holder.fd >= 0:
                fd, holder.fd = holder.fd, -1
                with contextlib.suppress(OSError):
                    os.close(fd)
        if self._lock_fd >= 0:
            fd, self._lock_fd = self._lock_fd, -1
            with contextlib.suppress(OSError):
                os.close(fd)
        for fd in list(self._held_fds):  # a compaction in progress (COMPACT)
            self._held_fds.discard(fd)
            with contextlib.suppress(OSError):
                os.close(fd)

    def close(self) -> None:
        """Make every write durable and visible; the last of the handles sharing this engine
        (``open_engine``) also releases everything.  Each handle that opened the engine closes
        it once (``Store`` makes its own ``close`` idempotent).  In a fork()ed child the
        parent's engine is left as it is."""
        if self.inherited:
            self.closed = True
            return
        with self._close_lock:  # a closer never commits on an engine another closer tears down
            with _WRITERS_LOCK:
                if self.closed:
                    return
                self.users -= 1
                last = self.users == 0
                real = os.path.realpath(self.path)
                if last and _WRITERS.get(real) is self:
                    del _WRITERS[real]
            healthy = self.log is not None and self.log.poisoned is None and self._committer_error is None
            if not last:  # outside the process-wide lock: an fdatasync holds up no other store
                if healthy:
                    self.commit(force=True, sync=True)
                return
            try:
                if healthy and self.index_damage is None:
                    self.commit(force=True, sync=True)
                if healthy:
                    assert self.log is not None
                    self.log.certify()  # a SYNC record names everything: damage is never a torn tail
            finally:
                self.closed = True
                self._teardown(healthy)

    def _at_rest(self, healthy: bool) -> None:
        """The last writer leaves (the caller holds the writer lock exclusively): stamp a clean
        index, or move a damaged one to quarantine/ for the next writable open to rebuild."""
        if healthy and self.index_damage is None:
            index_stamp(os.path.join(self.path, fmt.INDEX_DIR))  # closed cleanly: the next open trusts it
        if self.index_damage is not None:
            index_dir = os.path.join(self.path, fmt.INDEX_DIR)
            if os.path.isdir(index_dir):  # the next writable open rebuilds it from the log
                dest = recovery.quarantine_file(self.io, self.path, index_dir)
                with open(os.path.join(dest, "REASON.txt"), "w") as f:
                    f.write(f"index damaged: {self.index_damage}\n")

    def _teardown(self, healthy: bool = False) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._committer is not None and self._committer is not threading.current_thread():
            self._committer.join()
        if self._syncer is not None:  # futures of put_async: their syncs finish first
            self._syncer.shutdown(wait=True)
        if self.log is not None:
            self.log.close()
        self.files.close_all()
        self.executor.shutdown(wait=True)
        last = False  # the last writer: no other process can join until the writer lock is let go
        if self._lock_fd >= 0 and self.log is not None:
            try:
                self.io.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                last = True
            except OSError:
                pass  # other writers remain (a failed upgrade drops the shared lock: this one is leaving)
        if self.index is not None:
            self.index.close()
        try:
            if last:
                self._at_rest(healthy)
        except TierstoreError:
            raise
        except OSError as e:  # (the locks below are let go whatever happened: a full disk kept the store
            raise io_error(e, "closing the index", path=self.path) from None  # locked for good)
        finally:
            if self._lock_fd >= 0:
                self.io.close(self._lock_fd)  # closing the fd releases the flock
                self._lock_fd = -1
            if self._append is not None:
                self._append.close()
            if self._turn is not None:
                self._turn.close()

    @property
    def append_lock(self) -> Any:
        """The lock around appends that decide nothing (plain puts): ``write_lock`` without
        reading other processes' records first (call ``see_all`` under it before deciding)."""
        return self._append if self._append is not None else self.write_lock

    def check_process(self) -> None:
        """StoreClosed in a fork()ed child: the engine (and every handle on it) is the parent's."""
        if self.inherited:
            raise StoreClosed("this handle was opened before fork(): it belongs to the parent process",
                              path=self.path, hint="open the store again in this process (tierstore.open(path)); "
                                                   "a handle is never used across fork()")

    def check_writable(self) -> Log:
        """The log, if this engine may write now; else why not (ReadOnlyError, the committer's
        error, or the log's poisoning)."""
        self.check_process()
        if self.readonly or self.log is None:
            raise ReadOnlyError("the store was opened read-only", path=self.path)
        if self._committer_error is not None:  # (a copy each time: one instance raised again and again
            err = _again(self._committer_error)  # grew its traceback for good)
            raise err from (self._committer_error if err is not self._committer_error else None)
        self.log.check()
        return self.log

    # -- writing ----------------------------------------------------------------------------

    def subscribe(self, listener: WriteListener, *, every_record: bool = False) -> None:
        """Call ``listener((namespace, key), header or None)`` for every record appended from now
        on, under the append lock, in LSN order (the cache tiers drop stale copies this way).
        Other processes' records reach it as the index commits read them: by default only those
        this process's commits read (up to its own last sync, in turn with the others: SPEC.md
        §7.8); ``every_record``: every one (an SSD budget's policy), each commit then reading
        them all, as every writer beside it does."""
        if every_record:
            self._hear_all += 1
        log = self.log
        if log is None:
            self._listeners = [*self._listeners, listener]
            return
        with log.append_lock:  # a new list: an append in flight keeps iterating the old one
            self._listeners = [*self._listeners, listener]

    def unsubscribe(self, listener: WriteListener, *, every_record: bool = False) -> None:
        """Stop calling ``listener`` (a handle sharing this engine closed; ``every_record`` as it
        subscribed).  Bound methods compare equal, not identical, so this compares with ``==``."""
        if every_record:
            self._hear_all -= 1
        log = self.log
        if log is None:
            self._listeners = [x for x in self._listeners if x != listener]
            return
        with log.append_lock:
            self._listeners = [x for x in self._listeners if x != listener]

    def append(self, record: rec.EncodedRecord) -> Appended:
        """Append one record (not yet durable: ``settle``).  Callers check ``check_writable``
        first; the log itself refuses to append once poisoned."""
        log = self.log
        if log is None:
            raise ReadOnlyError("the store was opened read-only", path=self.path)
        return log.append(record, self._on_written_single)

    def append_group(self, records: Sequence[rec.EncodedRecord]) -> Appended:
        """Append records as one atomic group (SPEC.md §7.7): after a crash all of them are in
        the log or none is.  Returns where the last one landed."""
        log = self.log
        if log is None:
            raise ReadOnlyError("the store was opened read-only", path=self.path)
        return log.append_group(records, self._on_written if len(records) > 1 else self._on_written_single)[-1]

    def settle(self, where: Appended) -> None:
        """After an append: make it as durable as the store's mode promises ("sync": synced
        before this returns, sharing one fdatasync with concurrent callers; "group": synced
        once enough is waiting or by the committer's deadline; "none": never), and wake the
        committer that applies it to the index."""
        log = self.log
        assert log is not None  # something was appended
        if self.durability == "sync":
            self.counters["sync_requests"] += 1
            log.sync(where)
        elif self.durability == "group" and log.unsynced_bytes >= self.options.group_commit_bytes:
            self.counters["sync_requests"] += 1
            log.sync()
        self._wake_committer()

    def settle_syncs(self) -> bool:
        """Whether ``settle`` would sync now in "group" mode (enough is waiting)."""
        log = self.log
        return (self.durability == "group" and log is not None
                and log.unsynced_bytes >= self.options.group_commit_bytes)

    def settle_later(self, where: Appended) -> None:
        """``settle`` for a write whose durability a ``sync_async`` future reports: the
        "group" mode's size bound still applies; the committer is woken."""
        log = self.log
        assert log is not None
        if self.durability == "group" and log.unsynced_bytes >= self.options.group_commit_bytes:
            self.counters["sync_requests"] += 1
            log.sync()
        self._wake_committer()

    def sync_async(self, where: Appended) -> Future:
        """A Future completing once the log is durable up to ``where`` (one thread syncs for
        every caller: a sync covers all writes appended before it, so they share it).  It is
        running when returned: ``cancel()`` is False (the write it reports on is made; a
        cancelled sync would only hide when it became durable)."""
        log = self.log
        assert log is not None
        done: Future = Future()
        done.set_running_or_notify_cancel()
        with self._syncer_lock:
            if self._syncer is None:
                self._syncer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierstore-sync")
            self.counters["sync_requests"] += 1
            sync = submit(self._syncer, log.sync, where)

        def settle(f: Future) -> None:
            if f.cancelled():  # (nothing cancels the syncer's work; were it to, the caller still hears)
                done.set_exception(StoreClosed("the sync of this put was cancelled: the store closed",
                                               path=self.path))
                return
            e = f.exception()
            if e is None:
                done.set_result(f.result())
            else:
                done.set_exception(e)

        sync.add_done_callback(settle)
        return done

    def appended_at(self, loc: Location) -> Appended:
        """The append position of the record at ``loc`` (to ``settle`` a write that found its
        record already in the log)."""
        return Appended(loc.segment, loc.offset, loc.header.lsn, loc.offset + loc.header.record_len)

    def flush(self) -> None:
        """Make every earlier write durable and visible to other processes (index committed)."""
        self.check_writable()
        self.commit(force=True, sync=True)

    def deletion(self, ns: bytes, k: bytes, flags: int) -> list[rec.EncodedRecord]:
        """The records that delete (ns, k) together with every session reference on it (SPEC.md
        §5.4), to be appended as one group.  The caller holds ``write_lock``."""
        return self.deletions(ns, [(k, flags)])[0]

    def deletions(self, ns: bytes, items: Sequence[tuple[bytes, int]]) -> list[list[rec.EncodedRecord]]:
        """``deletion`` of each (key, flags) of ``ns``, the references read in one pass."""
        refs = self.sessions_of_many(ns, [k for k, _ in items]) if self.may_have_refs else {}
        return [[rec.encode_delete(ns, k, flags & fmt.FLAG_KEY_STR),
                 *(rec.encode_delete(fmt.REF_NAMESPACE, rec.ref_key(ns, s, k), 0) for s in refs.get(k, ()))]
                for k, flags in items]

    def _on_written(self, where: Appended, hdr: rec.RecordHeader, single: bool = False) -> None:
        """Runs under the log's append lock, in LSN order."""
        loc = Location(where.segment, where.offset, hdr) if hdr.type == fmt.REC_PUT else None
        self._took(Op(hdr.namespace, hdr.key, where.lsn, where.segment, where.offset, hdr.record_len, loc, single))

    def _on_written_single(self, where: Appended, hdr: rec.RecordHeader) -> None:
        self._on_written(where, hdr, True)

    def _took(self, op: Op) -> None:
        """A record joined the log (this process's or another's, under the append lock, in LSN
        order): the listeners are told, the memtable holds it until the index applies it."""
        if op.namespace == fmt.REF_NAMESPACE:
            self._refs_seen = True
        for listener in self._listeners:
            listener((op.namespace, op.key), op.location.header if op.location is not None else None)
        with self._pending_lock:
            self._mem.set(op.namespace, op.key, op)
            self._pending.append(op)
            if self._oldest_pending is None:
                self._oldest_pending = time.monotonic()

    # -- several writer processes (SPEC.md §7.8) ------------------------------------------------

    def _catch_up(self) -> None:
        """The append lock was just taken: continue the log where other processes left it.

        APPEND says where the log ended when the last holder that wrote let go, and whether a
        holder is writing now: a holder marks it "writing" (with where it starts) before its
        first write, and "clean" with the new end when it lets go.  Clean: this log continues at
        that end -- the records in between are not read now (``see_all`` reads them when a
        decision needs them, the committer when the index does).  Still "writing": that holder
        died holding the lock and may have left a torn record -- the log is scanned from where
        it started, payloads checked, and what is torn is cut (non-zero bytes to quarantine/),
        as recovery cuts a torn tail; no live writer can be writing now."""
        log = self.log
        append = self._append
        assert log is not None and append is not None
        self._marked = False
        here = log.position()
        raw = append.read_state()
        state = fmt.APPEND_STATE.unpack(raw) if len(raw) == fmt.APPEND_STATE.size else None
        if state is None or state[0] != fmt.APPEND_MAGIC:
            state = (fmt.APPEND_MAGIC, fmt.APPEND_WRITING, *here)  # unknown: check from here
        flags, published = state[1], state[2:]
        if (published[2] != here[2] if published[:2] == here[:2]
                else published[1] > self._segment_size(published[0])):
            # damaged: the log ends where this handle left it but at another LSN, or past its file's
            # end (a clean state taken as it was gave puts LSNs the log did not continue: they were
            # acknowledged, then lost) -- check the log from here, as after a writer died
            flags, published = flags | fmt.APPEND_WRITING, here
        if flags & fmt.APPEND_REFS:
            self._refs_seen = True
        if published == here and not flags & fmt.APPEND_WRITING:
            self._entered_at = self._hold_start = here
            return
        if published[:2] < here[:2] or published[2] < here[2]:
            raise CorruptionError("the log is shorter than this handle last saw it", path=self.path,
                                  segment=published[0], offset=published[1],
                                  hint="another process cut the log under the append lock; reopen the store")
        if self._behind is None:
            self._behind = here
        if not flags & fmt.APPEND_WRITING:
            log.adopt(*published)
            self._entered_at = self._hold_start = published
            return
        scan = self._scan_from(published, verify=True)  # a writer died mid-append
        self._report_damage(scan, "a writer process died mid-append")
        log.adopt(scan.active, scan.tail, scan.next_lsn)
        self._entered_at = None  # say where the log ends now, at release
        self._hold_start = log.position()

    def _segment_size(self, seg: int) -> int:
        """The size of segment ``seg``'s file, or -1 when there is none (never smaller than a tail)."""
        try:
            return os.path.getsize(self.files.path(seg))
        except OSError:
            return -1

    def see_all(self) -> None:
        """Read the records other processes appended that this one has not seen and the index
        has not applied, into the memtable in LSN order (the caller holds the append lock): a
        read-modify-write decision then sees every earlier record.  ``write_lock`` calls it."""
        behind, self._behind = self._behind, None
        if behind is not None:
            assert self.log is not None
            self._see_range(behind, self.log.position())

    def _see_for_commit(self, limit: int, upto: tuple[int, int] | None) -> None:
        """What the committer needs of ``see_all``: the range is noted under the append lock (no
        ``see_all`` is then half done), then read without it -- the records before the end this
        log adopted are whole and never change -- so appends go on meanwhile.  The range stays
        marked unseen for decisions (``see_all`` reads what the index has not applied since).
        ``upto``: where the record at LSN ``limit`` ends (the log's last sync): nothing after it
        is read -- the commit applies nothing past the limit, and another writer's commit may
        apply those records before this one needs them."""
        assert self.log is not None and self._append is not None and self.index is not None
        with self._append:
            behind, end = self._behind, self.log.position()
        if behind is not None and behind[2] <= limit and self.index.applied().lsn < limit:
            if upto is not None and upto < end[:2]:
                end = (upto[0], upto[1], limit + 1)
            self._see_range(behind, end)

    def _see_range(self, start: tuple[int, int, int], end: tuple[int, int, int]) -> None:
        """Merge other processes' records in [start, end) that the index has not applied (the
        segments are read up to ``end``, a record boundary, and no further)."""
        assert self.index is not None
        applied = self.index.applied()
        after = (applied.segment, rec.align_up(applied.end, fmt.RECORD_ALIGN), applied.lsn + 1)
        if applied.lsn > 0 and after > start:
            start = after
        if start[:2] >= end[:2]:
            return
        assert self.store_uuid is not None
        frm = Applied(start[0], start[1], start[2] - 1, start[1])
        for attempt in range(3):
            try:
                scan = recovery.scan_log(self.io, self.path, self.store_uuid, frm, writable=False, repair=False,
                                         verify_tail=False, skip=self.log.mine if self.log is not None else None,
                                         stop=end[:2])
                break
            except (recovery.IndexAhead, FileNotFoundError):
                # another process's compaction retired a segment (the first, or one listed before it
                # was unlinked): its records are applied, go on from the index's position
                if attempt == 2:
                    raise
                frm = self.index.applied()
        # past ``end`` the scan meets appends in progress (another writer's, not yet published):
        # a record cut there is not torn, only not finished
        scan.damage = [d for d in scan.damage if (d.segment, d.offset) < end[:2]]
        self._report_damage(scan, "reading other writers' records")
        foreign = [op for op in scan.ops if applied.lsn < op.lsn < end[2]]
        if foreign:
            self._took_many(foreign)

    def _report_damage(self, scan: recovery.LogScan, when: str) -> None:
        """Damage a scan of other writers' records met (a torn append it cut; a damaged segment
        header or padding it read past, SPEC.md §7.3/§7.4): in ``recovery["damage"]`` and
        warned about, each place once."""
        if not scan.damage:  # (the common case, on every catch-up with other writers)
            return
        seen = {(d["segment"], d["offset"], d["reason"]) for d in self.recovery.get("damage", [])}
        new = [d for d in scan.damage if (d.segment, d.offset, d.reason) not in seen]
        if new:
            self.recovery.setdefault("damage", []).extend(d.__dict__ for d in new)
            _log.warning("tierstore: %s: %s: %s", self.path, when, "; ".join(d.reason for d in new))

    def _took_many(self, ops: list[Op]) -> None:
        """Other processes' records, in LSN order, merged into the memtable and the pending list
        (which stays in LSN order; records already there are skipped); the listeners are told."""
        with self._merge_lock, self._pending_lock:
            have = {op.lsn for op in self._pending}
            ops = [op for op in ops if op.lsn not in have]
            for op in ops:
                m = self._mem.get((op.namespace, op.key))
                if m is None or m.lsn < op.lsn:
                    self._mem.set(op.namespace, op.key, op)
            self._pending = list(heapq.merge(self._pending, ops, key=lambda o: o.lsn))
            if ops and self._oldest_pending is None:
                self._oldest_pending = time.monotonic()
        for op in ops:
            if op.namespace == fmt.REF_NAMESPACE:
                self._refs_seen = True
            for listener in self._listeners:
                listener((op.namespace, op.key), op.location.header if op.location is not None else None)

    def _mark_writing(self) -> None:
        """The log is about to write under the append lock: say so in APPEND (once per hold), so
        that if this process dies before it lets go, the next holder checks what it left."""
        if not self._marked:  # where this hold began: records buffered since are not written yet
            assert self._append is not None and self._hold_start is not None
            self._append.write_state(fmt.APPEND_STATE.pack(fmt.APPEND_MAGIC, fmt.APPEND_WRITING | self._flags(),
                                                           *self._hold_start))
            self._marked = True

    def _flags(self) -> int:
        return fmt.APPEND_REFS if self._refs_seen else 0

    def _scan_from(self, here: tuple[int, int, int], *, verify: bool) -> recovery.LogScan:
        """The records after position ``here`` (see ``_catch_up``); ``verify`` checks payloads
        and cuts a torn tail."""
        assert self.store_uuid is not None
        try:
            return recovery.scan_log(self.io, self.path, self.store_uuid, Applied(here[0], here[1], here[2] - 1,
                                                                               here[1]),
                                     writable=True, repair=False, verify_tail=verify)
        except recovery.IndexAhead:  # compaction retired the segment this log stood in: every
            assert self.index is not None  # record of it is applied; go on from the index's position
            return recovery.scan_log(self.io, self.path, self.store_uuid, self.index.applied(), writable=True,
                                     repair=False, verify_tail=verify)

    def _publish(self) -> None:
        """The append lock is being let go: hand buffered records to the file, then, if the log
        moved while it was held, say where it ends (the next holder skips its scan when nothing
        changed, and knows a writer that died holding the lock by records past that end)."""
        log = self.log
        assert log is not None and self._append is not None
        try:
            if log.poisoned is None:
                log.flush_buffer()
        finally:
            if log.poisoned is None and (self._marked or self._entered_at is None):  # poisoned: stays
                self._append.write_state(fmt.APPEND_STATE.pack(fmt.APPEND_MAGIC, self._flags(),  # "writing"
                                                               *log.position()))
            self._marked = False

    def _alone_now(self) -> bool:
        """Whether no other process writes the store now (the caller holds the append lock)."""
        return self._lock_fd < 0 or alone_now(self.io, self._lock_fd)

    def claim(self, name: str, busy: str) -> int:
        """An exclusive ``flock`` on coordination file ``name`` of the store (not waiting): the fd
        to close when done, or StoreLocked(``busy``) when another process holds it."""
        return claim(self.io, self.path, name, busy)

    def compaction_lock(self) -> int:
        """Take the compaction lock (one compaction at a time across processes); returns the fd
        to give to ``let_go`` when done."""
        fd = compaction_lock(self.io, self.path)
        self._held_fds.add(fd)  # (a forked child closes its copy: let_go_of_locks)
        return fd

    def let_go(self, fd: int) -> None:
        """Release a lock ``compaction_lock`` took."""
        self._held_fds.discard(fd)  # (first: a fork meanwhile must not close a reused number)
        self.io.close(fd)

    def _on_discard(self, first_lsn: int) -> None:
        """The log took back records from ``first_lsn`` on (a failed write): forget them."""
        with self._pending_lock:
            dropped = {(op.namespace, op.key) for op in self._pending if op.lsn >= first_lsn}
            self._pending = [op for op in self._pending if op.lsn < first_lsn]
            for k in dropped:
                older = [op for op in self._pending if (op.namespace, op.key) == k]
                if older:
                    self._mem.set(*k, older[-1])
                else:
                    self._mem.drop(*k)

    # -- the committer ------------------------------------------------------------------------

    def _wake_committer(self) -> None:
        if self._committer is None:
            with self._cv:
                if self._committer is None and not self._stopping:
                    self._committer = threading.Thread(target=self._committer_loop, name="tierstore-committer",
                                                       daemon=True)
                    self._committer.start()
        if len(self._pending) >= self.options.index_batch:
            with self._cv:
                self._cv.notify()

    def _committer_loop(self) -> None:
        while True:
            with self._cv:
                if self._stopping:
                    return
                self._cv.wait(timeout=self._next_due())
                if self._stopping:
                    return
            try:
                self.commit(force=False, sync=False)
                self.files.sweep()  # segments other processes' compaction removed: their space freed
                self._apply_abandoned()
            except (StoreFull, StoreIOError) as e:
                # an index this process cannot map (ulimit -v): grown past what it can address
                address_space = getattr(e, "address_space", False) or (
                    isinstance(e, StoreIOError) and e.errno == errno.ENOMEM and not getattr(e, "poisoned", True))
                if not (address_space or isinstance(e, StoreFull) and e.index_full):
                    # (the log's: its records were taken back, or the log is poisoned -- the next
                    # call must hear of it)
                    self._committer_error = e
                    return
                # the index cannot grow on a full disk (or in this process's address space):
                # nothing is lost -- the records stay pending (in the log: reads find them in the
                # memtable) and a later commit applies them once room is made, for which the
                # reserve is given up now (a full disk killed the handle for good: every delete
                # and compact() then raised the committer's error)
                if not self._full_logged:
                    self._full_logged = True
                    if address_space:
                        _log.warning("tierstore: %s: the index cannot commit: %s; retrying every %.0f s -- %s",
                                     self.path, e.message, FULL_RETRY_S, e.hint)
                    else:
                        _log.warning("tierstore: %s: the index cannot commit, the disk is full (%s); retrying "
                                     "every %.0f s -- delete objects and run compact() to make room", self.path,
                                     e.message, FULL_RETRY_S)
                if not address_space:
                    with contextlib.suppress(OSError):  # (a failure here must not end the committer)
                        self.release_reserve()
                try:
                    self._log_duties_until(time.monotonic() + FULL_RETRY_S)
                except BaseException as e2:  # (the log's own error, as above: the next call's)
                    self._committer_error = e2
                    return
                continue
            except BaseException as e:  # surfaced to the next caller; the engine stops writing
                self._committer_error = e
                return
            self._full_logged = False

    def _log_duties_until(self, retry: float) -> None:
        """While the index cannot commit, until ``retry`` (not sooner: every put past
        ``index_batch`` wakes the committer): the log's own duties go on -- a due sync with
        durability "group" (puts that returned are durable within ``group_commit_ms``, index or
        not: a cold review measured 1 s), buffered records handed to the OS with "none"."""
        log = self.log
        tick = (self.options.group_commit_ms if self.durability == "group" else self.options.index_commit_ms) / 1000
        while True:
            with self._cv:
                now = time.monotonic()
                if self._stopping or now >= retry:
                    return
                wait = retry - now
                if self.durability != "sync":
                    oldest = log.oldest_unsynced if log is not None else None
                    wait = min(wait, tick if oldest is None else max(oldest + tick - now, 0.0005))
                self._cv.wait(timeout=wait)
            if log is not None:
                self._log_duty(log, time.monotonic(), sync=False)

    def _log_duty(self, log: Log, now: float, *, sync: bool) -> None:
        """The log's part of a commit: a sync when asked or due (durability "group"), or with
        "none", which never syncs, the buffered records handed to the OS promptly."""
        due_sync = self.durability == "group" and log.oldest_unsynced is not None and (
            now - log.oldest_unsynced >= self.options.group_commit_ms / 1000.0)
        if sync or due_sync:
            self.counters["sync_requests"] += 1
            log.sync()
        elif self.durability == "none":
            log.flush_buffer()

    def _apply_abandoned(self) -> None:
        """Records another writer appended that the index still has not applied a whole
        ``ABANDONED_S`` later (that writer died before its committer applied them, or stalls):
        applied here, as ``flush`` would, so that a writer that only reads sees another's
        acknowledged puts too (it saw them only at its next append, flush or reopen).  Costs a
        read of APPEND and of the index's position once per period, nothing more while the
        index keeps up."""
        now = time.monotonic()
        if self._append is None or self.index is None or now < self._next_abandoned_check:
            return
        self._next_abandoned_check = now + ABANDONED_S
        raw = self._append.read_state()
        if len(raw) != fmt.APPEND_STATE.size:
            return
        magic, _, _, _, next_lsn = fmt.APPEND_STATE.unpack(raw)
        behind = magic == fmt.APPEND_MAGIC and self.index.applied().lsn < next_lsn - 1
        suspect, self._abandoned_suspect = self._abandoned_suspect, next_lsn if behind else 0
        if behind and suspect and self.index.applied().lsn < suspect - 1:  # still not applied a period later
            self.counters["abandoned_catch_ups"] += 1
            self.commit(force=True, sync=True)

    def _next_due(self) -> float:
        """Seconds until the committer has work: the oldest pending record's index deadline
        (``index_commit_ms`` after it was appended) or, with durability "group", the oldest
        unsynced record's sync deadline -- so a put is visible to other processes within
        ``index_commit_ms`` (plus the commit itself), not up to twice that."""
        commit_s = self.options.index_commit_ms / 1000.0
        wait = commit_s
        now = time.monotonic()
        oldest = self._oldest_pending
        if oldest is not None:
            wait = min(wait, oldest + commit_s - now)
        log = self.log
        if self.durability == "group" and log is not None and log.oldest_unsynced is not None:
            wait = min(wait, log.oldest_unsynced + self.options.group_commit_ms / 1000.0 - now)
        return max(wait, 0.0005)

    def commit(self, *, force: bool, sync: bool) -> None:
        """Sync the log if due (or ``sync``), then apply durable pending records to the index
        (all of them with ``force``, else only once a batch is due)."""
        log = self.log
        if log is None or self.index is None:
            return
        with self._commit_lock:
            now = time.monotonic()
            self._log_duty(log, now, sync=sync)
            with log.append_lock:  # (an append_group advances the log before it hands its records to the
                # memtable: read under the lock, the limit never names part of a group not yet pending)
                if self.durability == "none":
                    limit, upto = log.written_lsn, None
                else:  # (and where the record at the limit ends)
                    limit, upto = log.durable_point()
                if self._hear_all:  # a listener hears of every record: read them all, not in turn
                    upto = None
            with self._commit_turn():
                if self._append is not None:  # other processes' records below the limit: read them first
                    self._see_for_commit(limit, upto)
                with self._merge_lock:  # no other process's records merge in below the batch meanwhile
                    self._apply_pending(limit, force, sync, now)

    def _commit_turn(self) -> contextlib.AbstractContextManager[None]:
        """Beside other writers, the commits' turn (SPEC.md §7.8): one process at a time reads
        other writers' records and applies them; a process waiting for its turn then finds most
        of them applied, and reads only the rest.  Not while this thread holds the append lock
        (the turn's holder may be waiting for it): the commit then reads what it needs alone, as
        without the turn."""
        if self._turn is None or self._turn.fd < 0 or self._hear_all or (
                self._append is not None and self._append.held_here()):
            return contextlib.nullcontext()
        return self._turn.turn()

    def _apply_pending(self, limit: int, force: bool, sync: bool, now: float) -> None:
        """Apply the pending records up to LSN ``limit`` (the caller holds the commit and merge locks)."""
        assert self.index is not None
        with self._pending_lock:
            if not self._pending:
                return
            old = self._oldest_pending or now
            if not (force or len(self._pending) >= self.options.index_batch
                    or now - old >= self.options.index_commit_ms / 1000.0):
                return
            n = 0
            while n < len(self._pending) and self._pending[n].lsn <= limit:
                n += 1
            batch = self._pending[:n]
        if not batch:
            return
        last = batch[-1]
        # transactions of about ``index_txn_records``: LMDB writes a page it changes to a new page
        # and reuses the old one only two transactions later, so a transaction that touches most
        # of the tree (random keys, a committer that fell behind) grows the file for good by as
        # much (80,000 puts of random keys: a 50 MB file for a 24 MB tree; 31 MB at 1024).  A
        # transaction ends only where no atomic group is open (SPEC.md §7.7) -- readers and a
        # crash see a put_many whole or not at all: where the LSNs jump (a GROUP, SYNC or HEADERS
        # record lies between two records), or next to a record this process appended alone
        # (another process's records are known to be alone only by such a jump)
        step, start, last_gap, cuts = self.index_txn_records, 0, -1, []
        for i in range(len(batch)):
            if i + 1 < len(batch) and batch[i + 1].lsn == batch[i].lsn + 1 and not (
                    batch[i].single or batch[i + 1].single):
                continue  # (no jump, neither record alone: possibly inside a group)
            if i + 1 - start > step and last_gap >= start:  # this unit would overflow: end before it
                cuts.append((start, last_gap + 1))
                start = last_gap + 1
            last_gap = i
            if i + 1 - start >= step or i + 1 == len(batch):
                cuts.append((start, i + 1))
                start = i + 1
        for a, b in cuts:
            end = batch[b - 1]
            # (a record this writer appended and synced itself: the index may say so, SPEC.md §9 --
            # another writer's may lie in a segment it sealed without syncing, with durability "none")
            synced = self.durability != "none" and self.log is not None and self.log.wrote(end.lsn)
            self.index.apply(batch[a:b], Applied(end.segment, end.offset, end.lsn, end.offset + end.record_len),
                             durable=sync and b == len(batch), synced=synced)
            self.counters["index_commits"] += 1
        if self.log is not None:
            self.log.forget_mine(last.lsn)
        with self._pending_lock:
            del self._pending[:n]
            self._oldest_pending = time.monotonic() if self._pending else None
            for op in batch:
                m = self._mem.get((op.namespace, op.key))
                if m is not None and m.lsn <= last.lsn:
                    self._mem.drop(op.namespace, op.key)

    # -- looking up ---------------------------------------------------------------------------

    def _index_damage(self, e: CorruptionError) -> CorruptionError:
        """Index damage found while reading (``e.index``): say so once, and have the index rebuilt
        from the segments -- the index is moved to quarantine/ when the engine closes, so the next
        writable open rebuilds it.  Returns ``e`` for the caller to raise."""
        if getattr(e, "index", False) and self.index_damage is None:
            self.index_damage = e.message
            self.warn_index(e.message)
        return e

    def warn_index(self, why: str) -> None:
        """Log, once per engine, that the index is damaged and what happens to it."""
        if not self._warned_index:
            self._warned_index = True
            _log.warning("tierstore: the index of %s is damaged (%s); it is derived data and is rebuilt from the "
                         "segments%s", self.path, why,
                         "" if self.readonly else " (now, or when this store is next opened writable)")

    def lookup(self, ns: bytes, k: bytes) -> Location | None:
        """The newest location of a key, or None.  Memtable first, then an index snapshot."""
        assert self.index is not None
        resizes = RESIZES[0]
        try:
            # (None: nothing unapplied for this key, the index holds its newest record)
            return self.index.lookup(ns, k, self._mem.get((ns, k)))
        except CorruptionError as e:
            if resized_since(resizes):  # (another thread resized the map under this read)
                return self._lookup_again(ns, k)
            raise self._index_damage(e) from None

    @_index_reads
    def _lookup_again(self, ns: bytes, k: bytes) -> Location | None:
        assert self.index is not None
        return self.index.lookup(ns, k, self._mem.get((ns, k)))

    def _memtable(self, ns: bytes, prefix: bytes = b"") -> dict[bytes, Op]:
        """Unapplied records of namespace ``ns`` whose key starts with ``prefix``.  Take it
        *before* the index snapshot (as ``lookup`` does): the committer deletes entries once
        applied, so an entry missing here is in any snapshot taken after."""
        with self._pending_lock:
            return dict(self._mem.scan(ns, prefix)) if prefix else self._mem.of(ns)

    def keys(self, ns: bytes, *, prefix: bytes = b"", after: bytes | None = None,
             limit: int | None = None) -> dict[bytes, int]:
        """key -> flags of the objects in namespace ``ns`` whose key starts with ``prefix``,
        past ``after``, the first ``limit`` of them, in key order.  Costs the keys listed (and
        the unapplied deletes among them), not the size of the namespace or of the memtable."""
        out: dict[bytes, int] = {}
        if limit is not None and limit <= 0:
            return out
        while True:
            page, exact_to = self._keys_page(ns, prefix, after, None if limit is None else limit - len(out))
            out.update(page)
            if exact_to is None or (limit is not None and len(out) >= limit):
                return out
            after = exact_to  # (rare: records applied and overwritten between the two reads)

    @_index_reads
    def _keys_page(self, ns: bytes, prefix: bytes, after: bytes | None,
                   limit: int | None) -> tuple[dict[bytes, int], bytes | None]:
        """Up to ``limit`` keys of ``keys``, and None when the answer is complete (no more keys),
        else the key up to which it is (a page shorter than ``limit`` then goes on from there).
        The memtable is read up to its ``limit``-th put (every key before it is known there),
        the index to ``limit`` keys and as many more as there are unapplied deletes among them;
        the answer is exact up to the first of the two ends."""
        assert self.index is not None
        with self._pending_lock:  # (before the snapshot: see _memtable)
            mem = self._mem.scan(ns, prefix, after, limit)
        mem_end = mem[-1][0] if limit is not None and sum(m.location is not None for _, m in mem) >= limit else None
        with self.index.read() as view:
            applied = view.applied().lsn
            scanned = len(mem)
            mem = [(k, m) for k, m in mem if m.lsn > applied]
            gone = sum(1 for _, m in mem if m.location is None)  # (read as many more: they may be listed)
            found = view.keys(ns, prefix, after=after, limit=None if limit is None else limit + gone)
        if self.readonly and len(mem) < scanned:  # (no committer forgets what the writer applied since)
            with self._pending_lock:
                self._mem.prune(ns, applied)
        index_end = found[-1][0] if limit is not None and len(found) == limit + gone and found else None
        ends = [e for e in (mem_end, index_end) if e is not None]
        exact_to = min(ends) if ends else None
        out: dict[bytes, int] = dict(found)
        if not mem and exact_to is None:
            return out, None  # (in key order already)
        for k, m in mem:
            if m.location is None:
                out.pop(k, None)
            else:
                out[k] = m.location.header.flags
        ordered = sorted(out)
        if exact_to is not None:
            ordered = [k for k in ordered if k <= exact_to]
        if limit is not None and len(ordered) >= limit:
            return {k: out[k] for k in ordered[:limit]}, None
        return {k: out[k] for k in ordered}, exact_to

    @_index_reads
    def sessions(self, ns: bytes) -> list[bytes]:
        """The sessions holding at least one reference in namespace ``ns``, sorted: one pass
        over the memtable's unapplied references, one index snapshot."""
        assert self.index is not None
        pending = self._memtable(fmt.REF_NAMESPACE, rec.ref_prefix(ns))  # (before the snapshot)
        with self.index.read() as view:
            applied = view.applied().lsn
            names = set(view.sessions(ns))
            by_session: dict[bytes, dict[bytes, Op]] = {}
            for rk, m in pending.items():
                parsed = rec.parse_ref_key(rk)
                if m.lsn > applied and parsed is not None and parsed[0] == ns and parsed[1] != fmt.ANCHOR_SESSION:
                    by_session.setdefault(parsed[1], {})[rk] = m
            for sess, ops in by_session.items():  # (a pending release may have been its last reference)
                live = _live_under(view, fmt.REF_NAMESPACE, rec.ref_prefix(ns, sess), ops)
                (names.add if live else names.discard)(sess)
        return sorted(names)

    @_index_reads
    def namespaces(self) -> list[bytes]:
        """Names of the namespaces holding at least one object (reserved ones left out), sorted:
        one pass over the memtable, one index snapshot, a few entries read per namespace."""
        assert self.index is not None
        with self._pending_lock:  # (before the snapshot)
            pending = {ns: self._mem.of(ns) for ns in self._mem.namespaces() if not ns.startswith(b"\x00")}
        with self.index.read() as view:
            applied = view.applied().lsn
            by_ns = {ns: live for ns, ops in pending.items()
                     if (live := {k: m for k, m in ops.items() if m.lsn > applied})}
            names = set(view.namespaces()) | set(by_ns)
            return sorted(n for n in names if _live_under(view, n, b"", by_ns.get(n, {})))

    @_index_reads
    def holders(self, k: bytes, *, exclude: bytes, limit: int = 1000) -> list[bytes]:
        """The user namespaces (other than ``exclude``; the first ``limit`` looked at) in which
        key ``k`` exists: one lookup per namespace, no listing."""
        assert self.index is not None
        with self.index.read() as view:
            names = set(view.namespaces())
        with self._pending_lock:
            names.update(n for n in self._mem.namespaces() if not n.startswith(b"\x00") and self._mem.has_puts(n))
        return [n for n in sorted(names)[:limit] if n != exclude and self.lookup(n, k) is not None]

    @_index_reads
    def prefix_run(self, ns: bytes, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` exist in ``ns``: one index get per key up to the first miss."""
        assert self.index is not None
        mem = self._pending_for(ns, keys)  # before the snapshot (see _memtable)
        with self.index.read() as view:
            applied = view.applied().lsn
            pending = {k: m.location is not None for k, m in mem.items() if m.lsn > applied}
            return view.prefix_run(ns, keys, pending)

    @_index_reads
    def lookup_many(self, ns: bytes, keys: Sequence[bytes]) -> list[Location | None]:
        """``lookup`` of many keys of one namespace in one index snapshot."""
        assert self.index is not None
        mem = self._pending_for(ns, keys)  # before the snapshot (see _memtable)
        with self.index.read() as view:
            applied = view.applied().lsn
            pending = {k: m.location for k, m in mem.items() if m.lsn > applied}
            return view.get_many(ns, keys, pending)

    @_index_reads
    def contains_many(self, ns: bytes, keys: Sequence[bytes]) -> list[bool]:
        """Whether each of ``keys`` exists in ``ns``, in one index snapshot, nothing decoded."""
        assert self.index is not None
        mem = self._pending_for(ns, keys)
        with self.index.read() as view:
            applied = view.applied().lsn
            pending = {k: m.location is not None for k, m in mem.items() if m.lsn > applied}
            return view.contains_many(ns, keys, pending)

    def _pending_for(self, ns: bytes, keys: Sequence[bytes]) -> dict[bytes, Op]:
        """The memtable's entries for ``keys`` of ``ns`` (take it before the index snapshot)."""
        mem = self._mem
        if not mem:
            return {}
        with self._pending_lock:
            return {k: m for k in keys if (m := mem.get((ns, k))) is not None}

    @property
    def may_have_refs(self) -> bool:
        """Whether session references must be consulted: the store holds (or held) some, or this
        handle is read-only and another process may be adding them."""
        return self._refs_seen or self.readonly

    def sessions_of(self, ns: bytes, k: bytes) -> list[bytes]:
        """Sessions holding a reference on (ns, k) (SPEC.md §5.4): the index, then the memtable."""
        return self.sessions_of_many(ns, [k])[k]

    @_index_reads
    def sessions_of_many(self, ns: bytes, keys: Sequence[bytes]) -> dict[bytes, list[bytes]]:
        """``sessions_of`` of many keys of one namespace: one index snapshot, one pass over the
        memtable's unapplied references (not one per key)."""
        assert self.index is not None
        pending = self._memtable(fmt.REF_NAMESPACE, rec.ref_prefix(ns))
        with self.index.read() as view:
            applied = view.applied().lsn
            out = {k: set(view.sessions_of(ns, k)) for k in keys}
        if pending:
            by_hash = {rec.ref_target_hash(k): k for k in keys}
            for rk, m in pending.items():
                parsed = rec.parse_ref_key(rk) if m.lsn > applied else None
                if parsed is not None and parsed[0] == ns and (k := by_hash.get(parsed[2])) is not None:
                    (out[k].add if m.location is not None else out[k].discard)(parsed[1])
        return {k: sorted(sessions) for k, sessions in out.items()}

    @_index_reads
    def referenced(self, ns: bytes) -> set[bytes]:
        """The ``rec.ref_target_hash`` of every key of ``ns`` some session references (the
        index, then the memtable): one pass, for a walk over many keys (eviction)."""
        assert self.index is not None
        pending = self._memtable(fmt.REF_NAMESPACE, rec.ref_prefix(ns))
        with self.index.read() as view:
            applied = view.applied().lsn
            refs = view.references(ns)
        for rk, m in pending.items():
            parsed = rec.parse_ref_key(rk) if m.lsn > applied else None
            if parsed is not None and parsed[0] == ns:
                held = refs.setdefault(parsed[2], set())
                (held.add if m.location is not None else held.discard)(parsed[1])
        return {h for h, sessions in refs.items() if sessions}

    @_index_reads
    def kept_bytes(self) -> dict[int, int]:
        """segment id -> what compacting it would write to keep its live objects (their records
        and header copies), as the index has them applied (the memtable's records are not
        counted: ``commit(force=True)`` first for all of this process's).  The rest of a segment
        -- dead records, SYNC and HEADERS records, page padding -- a compaction frees."""
        assert self.index is not None
        with self.index.read() as view:
            return view.kept_bytes()

    @_index_reads
    def session_refs(self, ns: bytes, sess: bytes) -> dict[bytes, bytes]:
        """ref key -> target key of every reference session ``sess`` holds in ``ns``."""
        assert self.index is not None
        pending = self._memtable(fmt.REF_NAMESPACE, rec.ref_prefix(ns, sess))
        with self.index.read() as view:
            applied = view.applied().lsn
            refs = dict(view.session_refs(ns, sess))
        for rk, m in pending.items():
            parsed = rec.parse_ref_key(rk)
            if m.lsn <= applied or parsed is None or parsed[1] != sess:
                continue
            if m.location is not None:
                refs[rk] = m.location.header.meta["key"]
            else:
                refs.pop(rk, None)
        return refs

    # -- reading ------------------------------------------------------------------------------

    def reader(self, loc: Location, where: dict[str, Any]) -> SegmentReader:
        """An ExtentReader over the record at ``loc``; ``where`` names it in errors."""
        return SegmentReader(self, loc, where)

    def read_extent0(self, loc: Location) -> bytes:
        """Extent 0 of the record at ``loc`` (a small blob's get): one ``pread``, checksum
        verified (CorruptionError naming the segment file and offset; the caller adds the key).
        Raises FileNotFoundError if compaction retired the segment meanwhile."""
        log = self.log
        if log is not None and log.buffered and (loc.segment, loc.offset + loc.header.record_len) > log.written:
            log.flush_buffer()  # (only while another thread of this process appends)
        files = self.files
        fd = files.acquire(loc.segment)[0]
        try:
            return seglib.read_extent_bytes(self.io, fd, loc.offset, loc.header, 0, _NOWHERE)
        except CorruptionError as e:
            e.path, e.segment, e.offset = self.segment_path(loc.segment), loc.segment, loc.offset
            raise
        finally:
            files.release(loc.segment)

    def read_first_extents(self, locs: Sequence[Location], where: Callable[[int], dict[str, Any]]) -> list[bytes]:
        """Extent 0 of each record at ``locs`` (small records, e.g. the blobs of a batched get):
        one ``pread`` per run of nearby records of a segment, checksums verified.  Damage raises
        CorruptionError for the first damaged record in the order of ``locs``, named by
        ``where(i)``, once all are read.  Raises FileNotFoundError if compaction retired one of
        the segments meanwhile (look again)."""
        log = self.log
        if log is not None and log.buffered:  # (only while another thread of this process appends)
            written = log.written
            for loc in locs:
                if (loc.segment, loc.offset + loc.header.record_len) > written:
                    log.flush_buffer()
                    break
        by_seg: dict[int, list[int]] = {}
        for n, loc in enumerate(locs):
            by_seg.setdefault(loc.segment, []).append(n)
        out: list[bytes] = [b""] * len(locs)
        bad: dict[int, str] = {}
        for seg, ns in by_seg.items():
            with self.hold_segment(seg) as (fd, _):
                got, damaged = seglib.read_first_extents(self.io, fd, [(locs[n].offset, locs[n].header) for n in ns])
            for n, data in zip(ns, got):
                out[n] = data
            bad.update((ns[i], why) for i, why in damaged.items())
        if bad:
            first = min(bad)
            raise CorruptionError(bad[first], **where(first))
        return out

    def hold_segment(self, seg: int) -> "HeldSegment":
        """``with engine.hold_segment(seg) as (fd, dfd)``: the segment's descriptors (dfd: O_DIRECT,
        or -1), kept open for the block even if compaction retires it meanwhile;
        FileNotFoundError if it is already gone."""
        return HeldSegment(self.files, seg)

    def put_keys(self, seg: int, *, limit: int) -> tuple[frozenset[int] | None, int]:
        """``hash((namespace, key))`` of every PUT record in sealed segment ``seg`` (a collision
        only makes compaction carry a DELETE it could drop), from its record headers (payloads
        are not read); kept while the segment lives (it never changes).  None when it holds
        more than ``limit`` records or cannot be read to its end (then nothing is kept).  With
        it, how many record headers this call read (0 when kept from before).  Compaction's
        rule for carrying DELETEs forward (compaction._carry_rule)."""
        with self._put_keys_lock:
            got = self._put_keys.get(seg)
        if got is not None:
            return got, 0
        keys: set[int] = set()
        path = self.files.path(seg)
        n = 0
        with self.hold_segment(seg) as (fd, _):
            scanner = seglib.SegmentScanner(self.io, fd, seg, path=path, verify_payload=False)
            for _, hdr in scanner.records():
                if n >= limit:
                    return None, n
                n += 1
                if hdr.type == fmt.REC_PUT:
                    keys.add(hash((hdr.namespace, hdr.key)))
            if scanner.stop is not None and scanner.stop.reason != "end":
                return None, n  # not read to its end (damage): it may hold any key
        got = frozenset(keys)
        with self._put_keys_lock:
            self._put_keys[seg] = got
        return got, n

    def prune_put_keys(self, alive: Iterable[int]) -> None:
        """Forget ``put_keys`` of segments not in ``alive`` (another process retired them)."""
        keep = set(alive)
        with self._put_keys_lock:
            for seg in [s for s in self._put_keys if s not in keep]:
                del self._put_keys[seg]

    def hold_segments(self, segs: Iterable[int]) -> contextlib.ExitStack:
        """``hold_segment`` of several segments at once, for reads of one index snapshot: a
        context manager; FileNotFoundError, with none held, if one is already gone."""
        stack = contextlib.ExitStack()
        try:
            for seg in sorted(set(segs)):
                stack.enter_context(HeldSegment(self.files, seg))
        except BaseException:
            stack.close()
            raise
        return stack

    def segment_path(self, seg: int) -> str:
        return self.files.path(seg)

    def segment_stats(self) -> dict[int, tuple[int, int]]:
        """segment id -> (dead bytes, state: 0 live, 1 dead), from the index (SPEC.md §9)."""
        assert self.index is not None
        return self.index.segment_stats()

    def segments(self) -> list[int]:
        """Ids of the segment files, ascending."""
        return seglib.list_segments(self.io, self.seg_dir)

    # -- the reserve: a full disk can still delete and compact ---------------------------------

    def limit_reserve(self, cap: int) -> bool:
        """A budget's bound on the reserve, which counts in it (``ssd_bytes``): the automatic
        reserve is at most ``cap``, and a RESERVE file larger than the reserve now wanted is cut
        down (a store of 264 MiB reopened with an 8 MiB budget kept an 8 MiB reserve: every put
        was StoreFull; a writer process without a budget may grow it back).  True if it was cut."""
        self.reserve_cap = cap
        if self.readonly:
            return False
        path = os.path.join(self.path, fmt.RESERVE_FILE)
        try:
            size = os.path.getsize(path)
            if size <= cap:  # (the usual case: one stat)
                return False
            want = self._reserve_size()
            if size > want:
                os.truncate(path, want)
                return True
        except OSError:
            pass  # (another handle's doing, or gone: the reserve is best effort)
        return False

    def _reserve_size(self) -> int:
        if self.options.reserve_bytes is not None:
            return self.options.reserve_bytes
        auto = self._auto_reserve()
        return auto if self.reserve_cap is None else min(auto, max(0, self.reserve_cap))

    def _auto_reserve(self) -> int:
        total = 0
        for s in self.segments():
            try:
                total += os.path.getsize(self.files.path(s))
            except FileNotFoundError:  # another process's compaction retired it since the listing
                pass
        return RESERVE_AUTO if total >= RESERVE_AUTO_FROM else 0

    def ensure_reserve(self) -> None:
        """Hold ``reserve_bytes`` of disk in the RESERVE file (allocated, not sparse), so that when
        the disk fills, giving it up leaves room for deletes, index commits and compact().  Best
        effort: on a disk already full it is simply not there yet."""
        size = self._reserve_size()
        path = os.path.join(self.path, fmt.RESERVE_FILE)
        if size <= 0 or self.readonly:
            return
        with self._reserve_lock:  # (the committer may give it up meanwhile: release_reserve)
            self._ensure_reserve(path, size)

    def _ensure_reserve(self, path: str, size: int) -> None:
        try:
            if os.path.getsize(path) >= size:
                return
        except OSError:
            pass
        try:
            fd = self.io.open(path, os.O_WRONLY | os.O_CREAT)
            try:
                self.io.fallocate(fd, 0, size)
                self.io.fsync(fd)
            finally:
                self.io.close(fd)
            self.io.fsync_dir(self.path)
        except OSError:
            try:
                os.unlink(path)
            except OSError:
                pass

    def release_reserve(self, seen: int | None = None) -> bool:
        """The disk is full: give the reserve back.  True if there was one to give, or if it was
        given up since ``seen`` (``reserve_released`` read before the caller's write: the
        committer, meeting the full disk too, gave it up meanwhile) -- a write refused for space
        is then worth one more try.  Thread safe (the committer calls it beside callers)."""
        path = os.path.join(self.path, fmt.RESERVE_FILE)
        if self.readonly:
            return False
        with self._reserve_lock:
            if seen is not None and self.reserve_released != seen:
                return True
            try:
                self.io.unlink(path)
            except FileNotFoundError:  # (none, or another process's handle gave it up)
                return False
            self.reserve_released += 1
        self.io.fsync_dir(self.path)
        self.recovery["reserve_released"] = True
        _log.warning("tierstore: %s: the disk is full; the reserve was given up so that deletes and compact() "
                     "work (compact() re-creates it)", self.path)
        return True

    # -- segments' lifecycle (compaction) -----------------------------------------------------

    def applied_position(self) -> Applied:
        """Where the index's applied position is: the last record it applied (of any process)."""
        assert self.index is not None
        return self.index.applied()

    def active_segment(self) -> int:
        """The id of the segment appends go to, taken under the append lock (so after catching
        up with other writers: a file another writer created and died before writing the header
        of is gone by then).  Every lower id is sealed, for good: the active id only grows."""
        log = self.check_writable()
        with self.append_lock:
            return log.active

    def seal_active(self, min_bytes: int) -> int:
        """Roll the log over to a fresh segment if the active one holds at least ``min_bytes``;
        returns the active segment's id afterwards (every older segment is sealed)."""
        log = self.check_writable()
        with self.write_lock:
            return log.seal_if(min_bytes)

    def retire_segments(self, segs: Sequence[int], *, gradual: bool = False) -> None:
        """Segments the index no longer points into: mark them dead (durable), delete them, and
        forget them.  A crash in between leaves dead segments that the next open deletes.
        ``gradual`` (the budget's background eviction): shrink each one away a step at a time
        (``_shrink_away``) instead of unlinking it at once."""
        assert self.index is not None
        self.index.mark_dead(segs)
        for seg in segs:
            path = self.files.path(seg)
            size = 0
            try:
                if gradual:
                    size = os.path.getsize(path)
                    self._count_shrinking(size)  # from before the rename on (disk_usage)
                    try:
                        self.io.rename(path, path + fmt.RETIRED_SUFFIX)
                    except BaseException:
                        self._count_shrinking(-size)
                        size = 0
                        raise
                else:
                    self.io.unlink(path)
            except FileNotFoundError:
                pass  # a writer that opened alone meanwhile deleted it (it was marked dead)
            # the name is gone, so no new descriptor; this process's close once no read uses them
            self.files.retire(seg)
            with self._put_keys_lock:
                self._put_keys.pop(seg, None)
            if size:
                self._shrink_away(path + fmt.RETIRED_SUFFIX, size)
        self.io.fsync_dir(self.seg_dir)
        self.index.forget_segments(segs)

    def _shrink_away(self, dead: str, size: int) -> None:
        """Delete a retired segment, renamed to ``dead`` (``size`` bytes, counted in
        ``disk_usage`` until they are gone), by shrinking it (SPEC.md §7.5): take its exclusive
        ``flock``, which no reader holds (each reader holds a shared one for as long as its
        descriptor is open: ``segment.open_segment``), truncate it ``SHRINK_STEP`` bytes at a
        time, then unlink it.  If a reader holds it (or a step fails), it is unlinked at once:
        a reader's descriptor keeps the bytes it reads, as after any unlink."""
        fd = -1
        try:
            self.io.fsync_dir(self.seg_dir)  # the new name first: never a shortened segment under its own name
            fd = self.io.open(dead, os.O_WRONLY)
            self.io.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # OSError: a reader holds it (or no flock here)
            while size > 0:
                step = min(size, SHRINK_STEP)
                self.io.ftruncate(fd, size - step)
                size -= step
                self._count_shrinking(-step)
                if size:
                    time.sleep(SHRINK_PAUSE_S)
        except OSError:
            pass  # a reader holds it, no flock here, or a step failed: unlinked at once below (a
            # failing disk shows in retire_segments' directory sync)
        finally:
            self._count_shrinking(-size)
            if fd >= 0:
                self.io.close(fd)
            try:
                self.io.unlink(dead)
            except FileNotFoundError:
                pass

    def _count_shrinking(self, nbytes: int) -> None:
        with self._shrink_lock:
            self._shrinking += nbytes

    def grown_bytes(self) -> int:
        """Bytes this handle has added to the log's files since it opened (its records, their
        padding, the headers of segments it began; not other processes')."""
        return self.log.grown if self.log is not None else 0

    def disk_bytes(self) -> int:
        """Bytes the store occupies on disk: its segment files, the index's files, the reserve
        and what recoveries kept in quarantine/ (what ``ssd_bytes`` bounds)."""
        return sum(self.disk_usage())

    def disk_usage(self) -> tuple[int, int]:
        """(bytes of segment files, bytes of the index's files, the reserve and quarantine/).
        Sealed segments never grow, so their sizes are remembered; the active one, the index
        and the reserve are asked each time, quarantine/ when it changed."""
        segs = self.segments()
        known = self._sealed_sizes
        for gone in set(known) - set(segs):
            known.pop(gone, None)  # threads may forget the same retired segment at once
        total = 0
        # sealed: below this writer's active id (which only grows; not the last file listed: a
        # writer that died creating the next one leaves it past the real active segment)
        sealed_below = self.log.active if self.log is not None else (segs[-1] if segs else 0)
        for seg in segs:
            if seg >= sealed_below:
                try:
                    total += os.path.getsize(self.files.path(seg))
                except FileNotFoundError:
                    pass
                continue
            size = known.get(seg)
            if size is None:
                try:
                    size = known[seg] = os.path.getsize(self.files.path(seg))
                except FileNotFoundError:  # retired meanwhile (another process's compaction)
                    size = 0
            total += size
        total += self._shrinking
        other = [os.path.join(self.path, fmt.RESERVE_FILE)]
        index_dir = os.path.join(self.path, fmt.INDEX_DIR)
        try:
            other += [os.path.join(index_dir, name) for name in os.listdir(index_dir)]
        except FileNotFoundError:
            pass
        rest = self.quarantine_bytes()
        for path in other:
            try:
                rest += os.path.getsize(path)
            except FileNotFoundError:
                pass
        return total, rest

    def quarantine_bytes(self) -> int:
        """Bytes of the files in quarantine/ (an old index's too), counted again whenever the
        directory changed (its mtime) and at least every QUARANTINE_RECOUNT_S (a change inside
        an old index's directory, or two in one tick of the clock, leaves the mtime as it was)."""
        qdir = os.path.join(self.path, fmt.QUARANTINE_DIR)
        try:
            mtime = os.stat(qdir).st_mtime_ns
        except FileNotFoundError:
            return 0
        known = self._quarantined
        now = time.monotonic()
        if known is not None and known[0] == mtime and now - known[2] < QUARANTINE_RECOUNT_S:
            return known[1]
        total = 0
        try:
            with os.scandir(qdir) as entries:
                for entry in entries:
                    if not entry.is_dir(follow_symlinks=False):
                        total += entry.stat(follow_symlinks=False).st_size
                        continue
                    with os.scandir(entry.path) as inside:  # an index replaced by a rebuild
                        total += sum(f.stat(follow_symlinks=False).st_size for f in inside
                                     if not f.is_dir(follow_symlinks=False))
        except FileNotFoundError:  # (cleared meanwhile: counted again next time)
            return total
        self._quarantined = (mtime, total, now)
        return total

    # -- figures ------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """The log's and the index's figures (applies what is durable first, so they are current)."""
        assert self.index is not None
        if self.log is not None and self.log.poisoned is None:
            self.commit(force=True, sync=False)
        segs = self.index.segment_stats()
        seg_ids = self.segments()
        sizes = {}
        for s in seg_ids:
            try:
                sizes[s] = os.path.getsize(self.files.path(s))
            except FileNotFoundError:  # retired meanwhile (a compaction, here or in another process)
                pass
        seg_ids = list(sizes)
        dead = sum(segs.get(s, (0, 0))[0] for s in seg_ids)
        total = sum(sizes.values())
        with self._pending_lock:
            pending = len(self._pending)
        log = self.log
        return {
            "objects_indexed": self.index.count(),
            "session_refs_indexed": self.index.ref_count(),
            "pending_index_records": pending,
            "segments": len(seg_ids),
            "segment_bytes": total,
            "live_bytes": total - dead,  # segment bytes not superseded (headers and padding included)
            "dead_bytes": dead,  # overwritten and deleted objects' records, and DELETE records
            "applied_lsn": self.index.applied().lsn,
            "next_lsn": log.next_lsn if log else None,
            "durable_lsn": log.durable_lsn if log else None,
            "counters": {**self.counters, "syncs": log.fdatasyncs if log else 0},
        }


def open_engine(path: str | os.PathLike[str], *, create: bool = True, readonly: bool = False,
                durability: str = "sync", options: Options | None = None, io: PosixIO | None = None,
                dram_tier: bool = False, agree: dict[str, Any] | None = None) -> Engine:
    """An Engine for ``path``: a new one, or -- for a writable open of a store this process
    already has open for writing -- the same engine, shared (its ``close`` then counts the
    handles, and the last one closes it).  The writer lock is per process, so a second
    writable handle in the same process would otherwise wait for itself.  Sharing needs the
    same durability, engine options and I/O layer, and the same ``agree`` (settings of the
    handles above the engine that must match: InvalidObject names the difference otherwise); a
    handle sharing the engine also shares its cold-read path (the O_DIRECT threshold the first
    handle's DRAM tier chose), its recovery report and its counters."""
    options = options or Options()
    if readonly:
        return Engine(path, create=create, readonly=True, durability=durability, options=options, io=io,
                      dram_tier=dram_tier)
    real = os.path.realpath(os.path.abspath(os.fspath(path)))
    with _WRITERS_LOCK:
        opening = _OPENING.setdefault(real, threading.Lock())
    with opening:  # one open of this path at a time in this process; other paths are not held up
        with _WRITERS_LOCK:
            engine = _WRITERS.get(real)
            if engine is not None and not engine.closed:
                mine = {**engine.agreed, "durability": engine.durability, **engine.options.engine_settings(),
                        "io": engine.io}
                asked = {**(agree or {}), "durability": durability, **options.engine_settings(),
                         "io": io or DEFAULT_IO}
                diff = [k for k in mine if mine[k] != asked.get(k)]
                if diff:
                    raise InvalidObject(
                        f"this process already has {engine.path} open for writing with other settings "
                        f"({', '.join(f'{k}={mine[k]!r}' for k in diff)}); a second handle shares that one's engine",
                        path=engine.path, hint="open it with the same settings, or close the other handle first")
                engine.check_writable()
                engine.users += 1
                return engine
        engine = Engine(path, create=create, readonly=False, durability=durability, options=options, io=io,
                        dram_tier=dram_tier)
        engine.agreed = dict(agree or {})
        with _WRITERS_LOCK:
            _WRITERS[real] = engine
        return engine


def writing_in_process(path: str | os.PathLike[str]) -> bool:
    """Whether this process has the store at ``path`` open for writing (a handle not closed)."""
    with _WRITERS_LOCK:
        engine = _WRITERS.get(os.path.realpath(os.path.abspath(os.fspath(path))))
        return engine is not None and not engine.closed


def _again(e: BaseException) -> BaseException:
    """A copy of ``e`` to raise anew (its own short traceback), or ``e`` if it cannot be copied.
    An OSError's ``errno``, ``strerror`` and ``filename`` are copied too (they live outside its
    ``__dict__``: a plain copy of a StoreIOError had ``errno`` None)."""
    try:
        new = copy.copy(e)
    except Exception:  # (an exception type whose constructor copy cannot call)
        return e
    if isinstance(e, OSError) and isinstance(new, OSError):
        new.errno, new.strerror, new.filename = e.errno, e.strerror, e.filename
    return new
