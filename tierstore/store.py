"""The Store handle: the public API, and the only module that knows all the others.

Write path:  Store.put -> encode_block -> (apply_codec) -> record.encode_put -> Log.append
             -> (Log.sync) -> memtable -> committer -> Index.apply
Read path:   Store.get -> _lookup (memtable, then Index) -> block.read_object
             -> segment.read_extents (preadv into a preallocated buffer, checksums verified)

The segment log is the write-ahead log: a put is durable once its record is synced; the
index is applied after, in batches, by a committer thread, and records the log position it
has applied.  Until then the memtable (records appended but not yet in the index) serves
reads in this process.  A memtable entry is used only while its LSN is newer than the
index's applied LSN, read in the same snapshot, so the two never disagree.

Threads: a Store may be shared by threads.  Processes: one writer at a time (an exclusive
``flock`` on LOCK, held for the life of a writable handle); any number of read-only handles.
Never use a Store across ``fork()``.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import os
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import arrays, recovery
from . import block as blk
from . import codecs as cdc
from . import format as fmt
from . import policy as pol
from . import record as rec
from . import segment as seglib
from .errors import (
    CorruptionError,
    FormatVersionError,
    InvalidObject,
    NotFound,
    ReadOnlyError,
    StoreClosed,
    StoreLocked,
    StoreNotFound,
    TierstoreError,
)
from .fileio import DEFAULT_IO, PosixIO, io_error
from .hierarchy import Hierarchy
from .index import Applied, Index, Location, Op
from .objects import Blob, KVCache, ObjectInfo, Vectors

if TYPE_CHECKING:
    from .scoped import NamespaceHandle

DURABILITY = ("sync", "group", "none")

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)


def parse_size(value: int | str, name: str) -> int:
    """Bytes from an int or a string like "16GiB", "512MB", "4096"."""
    if isinstance(value, bool):
        raise InvalidObject(f"{name} must be a size, got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str) and (m := _SIZE_RE.match(value)):
        unit = (m.group(2) or "B").upper()
        base = 1024 if "I" in unit or unit in ("K", "M", "G", "T") else 1000
        power = "BKMGT".index(unit[0]) if unit != "B" else 0
        n = int(float(m.group(1)) * base**power)
    else:
        raise InvalidObject(f"{name} must be an int or a size string like '16GiB', got {value!r}")
    if n <= 0:
        raise InvalidObject(f"{name} must be positive, got {value!r}")
    return n


@dataclass(frozen=True)
class Options:
    """Tuning knobs of ``tierstore.open`` (all optional).  Sizes take ints or "64MiB" strings."""

    segment_bytes: int = 1 << 30  # roll over to a new segment past this size
    group_commit_ms: float = 10.0  # durability="group": sync at most this long after a put
    group_commit_bytes: int = 64 << 20  # durability="group": or once this much is unsynced
    index_commit_ms: float = 50.0  # apply the index at most this long after a durable record
    index_batch: int = 1024  # or once this many records are waiting
    lock_timeout: float = 60.0  # seconds to wait for another writer to close
    vector_extent_bytes: int = 64 << 10  # target extent size of a vector row range
    index_map_size: int = 64 << 20  # initial LMDB map size (it doubles when full)
    direct_reads: str = "auto"  # cold, page-aligned reads via O_DIRECT: "auto" (8 MiB and more), "always", "never"

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> "Options":
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise InvalidObject(f"unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        vals: dict[str, Any] = {}
        for k, v in kwargs.items():
            if k.endswith("_bytes") or k == "index_map_size":
                vals[k] = parse_size(v, k)
            elif k == "direct_reads":
                if v not in seglib.DIRECT_READS:
                    raise InvalidObject(f"{k} must be one of {', '.join(seglib.DIRECT_READS)}, got {v!r}")
                vals[k] = v
            elif k in ("index_batch",):
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise InvalidObject(f"{k} must be a positive int, got {v!r}")
                vals[k] = v
            else:
                if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                    raise InvalidObject(f"{k} must be a non-negative number, got {v!r}")
                vals[k] = float(v)
        if vals.get("segment_bytes", cls.segment_bytes) < 2 * fmt.PAGE:
            raise InvalidObject("segment_bytes must be at least 8 KiB")
        return cls(**vals)


_NAMESPACES: dict[str, bytes] = {}


def _encode_namespace(namespace: Any) -> bytes:
    b = _NAMESPACES.get(namespace) if type(namespace) is str else None
    if b is not None:
        return b
    b = _check_namespace(namespace)
    if len(_NAMESPACES) < 4096:
        _NAMESPACES[namespace] = b
    return b


def _check_namespace(namespace: Any) -> bytes:
    if not isinstance(namespace, str):
        raise InvalidObject(f"namespace must be a str, got {type(namespace).__name__}")
    b = namespace.encode("utf-8")
    if not 1 <= len(b) <= fmt.NAMESPACE_MAX_BYTES:
        raise InvalidObject(f"namespace must be 1 to {fmt.NAMESPACE_MAX_BYTES} bytes of UTF-8, got {len(b)}")
    if _bad_text(namespace):
        raise InvalidObject(f"namespace {namespace!r} contains a control character, a path separator, or is . / ..")
    return b


_BAD_CHARS = re.compile(r"[\x00-\x1f\x7f/\\]")


def _bad_text(text: str) -> bool:
    """Control characters (NUL included), path separators, or a name that is . or .."""
    return _BAD_CHARS.search(text) is not None or text in (".", "..")


def _encode_key(key: Any) -> tuple[bytes, int]:
    if isinstance(key, str):
        b, flags = key.encode("utf-8"), fmt.FLAG_KEY_STR
        if _bad_text(key):
            raise InvalidObject(f"str key {key!r} contains a control character (NUL included) or a path separator, "
                                "or is . / ..", hint="bytes keys are opaque and may hold any byte")
    elif isinstance(key, (bytes, bytearray, memoryview)):
        b, flags = bytes(key), 0
    else:
        raise InvalidObject(f"key must be str or bytes, got {type(key).__name__}")
    if not 1 <= len(b) <= fmt.KEY_MAX_BYTES:
        raise InvalidObject(f"key must be 1 to {fmt.KEY_MAX_BYTES} bytes, got {len(b)}",
                            hint="hash long identifiers (e.g. hashlib.sha256(x).digest())")
    return b, flags


def _encode_session(session: Any) -> bytes:
    if not isinstance(session, str):
        raise InvalidObject(f"session must be a str, got {type(session).__name__}")
    b = session.encode("utf-8")
    if _bad_text(session) or not 1 <= len(b) <= fmt.SESSION_MAX_BYTES:
        raise InvalidObject(f"session id {session!r} must be 1 to {fmt.SESSION_MAX_BYTES} bytes of UTF-8 without "
                            "control characters or path separators, and not . / ..")
    return b


TIERS = ("ssd", "dram", "gpu")
KIND_IDS = {name: kind for kind, name in fmt.KIND_NAMES.items() if kind in fmt.OBJECT_KINDS}


def _codec_table(spec: Any) -> dict[tuple[str | None, str], cdc.Choice]:
    """``codecs={(kind, tier): "int8", (namespace, kind, tier): "zstd", ...}`` -> parsed choices.

    Only the "ssd" tier (the log) takes a codec in this release: the DRAM tier caches the
    stored bytes and the GPU tier decodes them, so naming those tiers is an error rather
    than a setting that silently does nothing.
    """
    out: dict[tuple[str | None, str], cdc.Choice] = {}
    if spec is None:
        return out
    if not isinstance(spec, dict):
        raise InvalidObject("codecs= is a dict {(kind, tier): codec} or {(namespace, kind, tier): codec}")
    for key, name in spec.items():
        if not isinstance(key, tuple) or len(key) not in (2, 3):
            raise InvalidObject(f"codecs= key {key!r}: expected (kind, tier) or (namespace, kind, tier)")
        ns = key[0] if len(key) == 3 else None
        kind, tier = key[-2], key[-1]
        if ns is not None:
            _check_namespace(ns)
        if kind not in KIND_IDS:
            raise InvalidObject(f"codecs= key {key!r}: kind must be one of {', '.join(KIND_IDS)}")
        if tier not in TIERS:
            raise InvalidObject(f"codecs= key {key!r}: tier must be one of {', '.join(TIERS)}")
        if tier != "ssd":
            raise InvalidObject(f"codecs= key {key!r}: a codec of its own for the {tier} tier (transcoding at "
                                "the tier boundary) is not supported yet; the DRAM tier holds the stored bytes "
                                "and the GPU tier holds them decoded",
                                hint="set the codec of the log, (kind, \"ssd\"): every tier serves what it holds")
        out[(ns, kind)] = cdc.parse(name, kind)
    return out


DRAM_AUTO_MAX = 1 << 30  # dram_bytes="auto": at most 1 GiB ...
DRAM_AUTO_SHARE = 16  # ... and at most 1/16 of memory (physical, or the cgroup limit)


CGROUP_MEMORY_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")  # v2, v1


def memory_limit() -> int:
    """Physical memory, or the container's (cgroup) memory limit when that is lower."""
    try:
        limit = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        limit = 16 * DRAM_AUTO_MAX
    for path in CGROUP_MEMORY_LIMITS:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < limit:  # "max" (v2) or a huge number: no limit
            limit = int(text)
    return limit


def auto_dram_bytes() -> int:
    """The DRAM tier's size when ``dram_bytes`` is not given."""
    return max(0, min(DRAM_AUTO_MAX, memory_limit() // DRAM_AUTO_SHARE))


def _tier_options(options: dict[str, Any]) -> dict[str, Any]:
    """Pop and check the cache tiers' options: dram_bytes, dram_admit, gpu_bytes, gpu_device,
    policy.  ``dram_bytes`` "auto" (the default) sizes the DRAM tier from the memory available
    (``auto_dram_bytes``) and admits on the second read; a size given admits on the first; 0 or
    None: no DRAM tier."""
    dram, gpu = options.pop("dram_bytes", "auto"), options.pop("gpu_bytes", None)
    device, policy = options.pop("gpu_device", None), options.pop("policy", None)
    admit = options.pop("dram_admit", None)
    if admit is not None and admit not in pol.ADMISSIONS:
        raise InvalidObject(f"dram_admit must be one of {', '.join(pol.ADMISSIONS)}, got {admit!r}")
    if dram == "auto":
        dram, admit = auto_dram_bytes() or None, admit or "second"
    elif dram is not None and not (type(dram) is int and dram == 0):
        dram = parse_size(dram, "dram_bytes")
    else:
        dram = None
    admit = admit or "first"
    gpu = parse_size(gpu, "gpu_bytes") if gpu is not None else None
    if device is not None and gpu is None:
        raise InvalidObject("gpu_device= without gpu_bytes= (the GPU tier's size)")
    if gpu is not None:
        device = "cuda:0" if device is None else device
        try:
            arrays.validate_device(device)
        except InvalidObject as e:
            raise InvalidObject(f"gpu_device: {e.message}",
                                hint='gpu_device="cpu" runs the GPU tier in CPU memory (tests, CI)') from None
    return {"dram_bytes": dram, "dram_admit": admit, "gpu_bytes": gpu, "gpu_device": device,
            "policy": pol.make(policy)}


def _decode_key(b: bytes, flags: int) -> str | bytes:
    return b.decode("utf-8") if flags & fmt.FLAG_KEY_STR else b


def acquire_writer_lock(io: PosixIO, root: str, timeout: float) -> int:
    """Take the exclusive writer lock (``flock`` on LOCK), waiting up to ``timeout`` seconds.

    Returns the fd holding it; closing the fd releases the lock (so does process death).
    """
    path = os.path.join(root, fmt.LOCK_FILE)
    fd = io.open(path, os.O_RDWR | os.O_CREAT)
    deadline = time.monotonic() + timeout
    delay = 0.001
    while True:
        try:
            io.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                io.close(fd)
                raise io_error(e, "lock store", path=path) from None
        if time.monotonic() >= deadline:
            io.close(fd)
            raise StoreLocked(f"another writer holds the store (waited {timeout:g}s)", path=root)
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


class _Reader:
    """ExtentReader over one record in one segment (holds the segment fd while reading)."""

    def __init__(self, store: "Store", loc: Location, where: dict[str, Any]) -> None:
        self.store, self.loc, self.where = store, loc, where

    def _ensure_written(self) -> None:
        log = self.store._log
        if log is not None and (self.loc.segment, self.loc.offset + self.loc.header.record_len) > log.written:
            log.flush_buffer()  # the record is still in the write buffer

    def read_into(self, wanted: Any) -> None:
        self._ensure_written()
        files = self.store._files
        with self.store._segment_fd(self.loc.segment) as (fd, dfd):
            seglib.read_extents(self.store._io, fd, self.loc.offset, self.loc.header, wanted, self.where,
                                self.store._pool, dfd, files.dio)

    def read_bytes(self, index: int) -> bytes:
        self._ensure_written()
        with self.store._segment_fd(self.loc.segment) as (fd, _):
            return seglib.read_extent_bytes(self.store._io, fd, self.loc.offset, self.loc.header, index, self.where)


class _SegFd:
    def __init__(self, files: seglib.SegmentFiles, seg: int) -> None:
        self.files, self.seg = files, seg

    def __enter__(self) -> tuple[int, int]:
        return self.files.acquire(self.seg)

    def __exit__(self, *exc: Any) -> None:
        self.files.release(self.seg)


class Store:
    """A handle on a tierstore directory.  Create with ``tierstore.open``.

    Thread-safe.  Use as a context manager or call ``close()``: it makes every write durable
    and visible to other processes, stops the committer thread and releases the writer lock.
    """

    def __init__(self, path: str | os.PathLike[str], *, create: bool = True, readonly: bool = False,
                 durability: str = "sync", _io: PosixIO | None = None, **options: Any) -> None:
        if durability not in DURABILITY:
            raise InvalidObject(f"durability must be one of {', '.join(DURABILITY)}, got {durability!r}")
        self.codecs = _codec_table(options.pop("codecs", None))
        tier_opts = _tier_options(options)
        self.options = Options.from_kwargs(options)
        self.path = os.path.abspath(os.fspath(path))
        self.readonly = readonly
        self.durability = durability
        self._io = _io or DEFAULT_IO
        self._closed = True
        self._lock_fd = -1
        self._index: Index | None = None
        self._log: seglib.Log | None = None
        self._mem: dict[tuple[bytes, bytes], Op] = {}  # newest unapplied record per key
        self._refs_seen = False  # the store holds (or held) session references: puts must consult them
        self._dicts: dict[bytes, bytes] = {}  # zstd dictionaries read so far
        self._pending: list[Op] = []
        self._pending_lock = threading.Lock()
        self._oldest_pending: float | None = None
        self._write_lock = threading.RLock()
        self._commit_lock = threading.Lock()
        self._cv = threading.Condition()
        self._stopping = False
        self._committer: threading.Thread | None = None
        self._committer_error: BaseException | None = None
        self._counters = {"puts": 0, "gets": 0, "deletes": 0, "bytes_written": 0, "bytes_read": 0,
                          "index_commits": 0, "syncs": 0, "dedup_puts": 0}
        self.recovery: dict[str, Any] = {}
        self._pool = ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 2)),
                                        thread_name_prefix="tierstore-io")
        self._tiers: Hierarchy | None = None
        self._seg_dir = os.path.join(self.path, fmt.SEGMENTS_DIR)
        self._files = seglib.SegmentFiles(self._io, self._seg_dir, direct_reads=self.options.direct_reads,
                                          dram_tier=tier_opts["dram_bytes"] is not None)
        try:
            self._tiers = Hierarchy(self, **tier_opts)
            self._open(create)
        except OSError as e:
            self._teardown()
            if isinstance(e, TierstoreError):
                raise
            raise io_error(e, "open store", path=self.path) from None
        except BaseException:
            self._teardown()
            raise
        self._closed = False

    # -- opening ----------------------------------------------------------------------------

    def _open(self, create: bool) -> None:
        io = self._io
        if not os.path.exists(self.path):
            if not create or self.readonly:
                raise StoreNotFound(f"no store at {self.path}", path=self.path)
            os.makedirs(self.path, exist_ok=True)
        elif not os.path.isdir(self.path):
            raise InvalidObject(f"{self.path} exists and is not a directory", path=self.path)
        if not self.readonly:
            self._take_writer_lock()
        index_dir = os.path.join(self.path, fmt.INDEX_DIR)
        has_segments = os.path.isdir(self._seg_dir) and bool(seglib.list_segments(io, self._seg_dir))
        has_index = Index.exists(index_dir)
        if has_segments and recovery.abandoned_creation(io, self.path) and not self.readonly:
            seg = seglib.list_segments(io, self._seg_dir)[0]
            recovery.quarantine_file(io, self.path, self._files.path(seg))  # a crash during creation
            has_segments = False
        if not has_segments and not has_index:
            if self.readonly or not create:
                raise StoreNotFound(f"no store at {self.path}", path=self.path)
            self._create_store()
        elif not has_segments:
            raise CorruptionError("the index exists but no segment files do", path=self._seg_dir,
                                  hint="restore the segments/ directory; the index alone holds no data")
        elif not has_index:
            if self.readonly:
                raise CorruptionError("the index is missing", path=index_dir,
                                      hint="open the store writable (or run `tierstore recover PATH`) to rebuild it")
            self._rebuild("index missing")
        try:
            self._index = Index.open(index_dir, writable=not self.readonly, map_size=self.options.index_map_size)
        except CorruptionError as e:
            if self.readonly:
                raise
            self._rebuild(f"index unreadable ({e.message})")  # derived data: rebuild it from the log
            self._index = Index.open(index_dir, writable=True, map_size=self.options.index_map_size)
        scan = self._replay()
        if self.readonly:
            for op in scan.ops:
                self._mem[(op.namespace, op.key)] = op
            return
        if scan.ops:
            self._index.apply(scan.ops, scan.last, durable=True)
        self._refs_seen = self._index.ref_count() > 0
        self._drop_dead_segments(keep=scan.active)
        self._log = seglib.Log(io, self._seg_dir, self._store_uuid, active=scan.active, tail=scan.tail,
                               next_lsn=scan.next_lsn, segment_bytes=self.options.segment_bytes,
                               sync_enabled=self.durability != "none", executor=self._pool,
                               dio=self._files.dio)
        self._log.on_discard = self._on_discard

    def _take_writer_lock(self) -> None:
        self._lock_fd = acquire_writer_lock(self._io, self.path, self.options.lock_timeout)

    @staticmethod
    def _lock_only(path: str, *, timeout: float) -> int:
        """Hold the writer lock of ``path`` without opening the store (for offline tools)."""
        return acquire_writer_lock(DEFAULT_IO, path, timeout)

    def _create_store(self) -> None:
        io = self._io
        uuid = seglib.new_store_uuid()
        if not os.path.isdir(self._seg_dir):
            io.mkdir(self._seg_dir)
        seglib.Log.create_segment(io, self._seg_dir, uuid, 1, 1, sync=True)
        io.fsync_dir(self.path)
        idx = Index.open(os.path.join(self.path, fmt.INDEX_DIR), writable=True, map_size=self.options.index_map_size)
        try:
            idx.initialise(uuid)
        finally:
            idx.close()
        io.fsync_dir(self.path)

    def _rebuild(self, why: str) -> None:
        t0 = time.perf_counter()
        scan = recovery.rebuild_index(self._io, self.path, repair=False)
        self.recovery.update({"rebuilt_index": why, "rebuild_seconds": time.perf_counter() - t0,
                              "rebuild_bytes_scanned": scan.bytes_scanned})
        self.recovery.setdefault("damage", []).extend(d.__dict__ for d in scan.damage)
        self.recovery.setdefault("removed_segments", []).extend(scan.removed_segments)

    def _replay(self) -> recovery.LogScan:
        """Bring the index up to the end of the log (see recovery.py)."""
        assert self._index is not None
        t0 = time.perf_counter()
        uuid = self._index.store_uuid()
        version = self._index.format_version()
        if uuid is None or version is None:
            raise CorruptionError("index has no store identity", path=self._index.path)
        if version[0] != fmt.FORMAT_MAJOR:
            raise FormatVersionError(f"index written by format {version[0]}.{version[1]}", path=self._index.path)
        self._store_uuid = uuid
        applied = self._index.applied()
        try:
            if not recovery.check_applied(self._io, self.path, applied):
                raise recovery.IndexAhead("the index's applied position is not in the log")
            scan = recovery.scan_log(self._io, self.path, uuid, applied, writable=not self.readonly, repair=False)
        except recovery.IndexAhead as e:
            if self.readonly:
                raise CorruptionError(f"index and log disagree ({e.message})", path=self.path,
                                      hint="open the store writable (or run `tierstore recover PATH`) "
                                           "to rebuild the index") from None
            self._index.close()
            self._index = None
            self._rebuild(e.message)
            self._index = Index.open(os.path.join(self.path, fmt.INDEX_DIR), writable=True,
                                     map_size=self.options.index_map_size)
            applied = self._index.applied()
            scan = recovery.scan_log(self._io, self.path, uuid, applied, writable=True, repair=False)
        self.recovery.update({"replayed_records": len(scan.ops), "replay_seconds": time.perf_counter() - t0})
        self.recovery.setdefault("damage", []).extend(d.__dict__ for d in scan.damage)
        self.recovery.setdefault("removed_segments", []).extend(scan.removed_segments)
        return scan

    def _drop_dead_segments(self, keep: int) -> None:
        """Unlink segments a finished compaction marked dead (a crash may have left them)."""
        assert self._index is not None
        dead = [s for s, (_, state) in self._index.segment_stats().items() if state == 1 and s != keep]
        for seg in dead:
            path = self._files.path(seg)
            if os.path.exists(path):
                self._io.unlink(path)
        if dead:
            self._io.fsync_dir(self._seg_dir)
            self._index.forget_segments(dead)

    # -- closing ----------------------------------------------------------------------------

    def close(self) -> None:
        """Make every write durable and visible, then release the handle.  Idempotent."""
        if self._closed:
            return
        try:
            if self._log is not None and self._log.poisoned is None and self._committer_error is None:
                self._commit(force=True, sync=True)
        finally:
            self._closed = True
            self._teardown()

    def _teardown(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._committer is not None and self._committer is not threading.current_thread():
            self._committer.join()
        if self._tiers is not None:
            self._tiers.close()
        if self._log is not None:
            self._log.close()
        self._files.close_all()
        self._pool.shutdown(wait=True)
        if self._index is not None:
            self._index.close()
        if self._lock_fd >= 0:
            self._io.close(self._lock_fd)  # closing the fd releases the flock
            self._lock_fd = -1

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("read-only" if self.readonly else f"durability={self.durability}")
        return f"<tierstore.Store {self.path!r} {state}>"

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed("the store is closed", path=self.path)

    def _check_writable(self) -> seglib.Log:
        self._check_open()
        if self.readonly or self._log is None:
            raise ReadOnlyError("the store was opened read-only", path=self.path)
        if self._committer_error is not None:
            raise self._committer_error
        self._log.check()
        return self._log

    # -- writing ----------------------------------------------------------------------------

    def put(self, key: str | bytes, obj: KVCache | Vectors | Blob, *, namespace: str = "default",
            meta: dict[str, Any] | None = None, session: str | None = None, codec: str | None = None) -> None:
        """Store ``obj`` under ``key`` in ``namespace``, replacing any previous object.

        With durability="sync" the object survives a crash or power loss once put returns;
        with "group" once ``flush()`` returns or the group-commit bound passes; with "none"
        it survives a process crash (it is in the OS page cache) but not power loss.  Other
        processes see it once the index batch commits (``index_commit_ms``) or after ``flush()``.

        ``meta`` is an optional dict of str -> (str, bytes, int, float, bool, None, list,
        dict) stored with the object and returned by ``info``.

        ``session`` tags the object with a session id: the session holds a reference on it
        (``session_keys``, ``drop_session``).  If the key already holds the same object
        (same metadata, extent lengths and checksums) only the reference is recorded: no second
        copy of the bytes is written.  A new object and its reference are written as one
        atomic group.  A put without ``session`` leaves existing references as they are.

        ``codec`` (e.g. "zstd", "int8", "int4:group=32", "int8+zstd"; ``tierstore.codecs.available()``)
        overrides the store's ``codecs=`` setting for this put.  The default is lossless: data
        is stored raw unless a codec was asked for; ``info(key)`` shows the codec and its bound.

        Raises InvalidObject on bad input (nothing is written), ReadOnlyError, StoreFull,
        StoreIOError.
        """
        log = self._check_writable()
        ns = _encode_namespace(namespace)
        k, kflags = _encode_key(key)
        sess = _encode_session(session) if session is not None else None
        user_meta = rec.check_user_meta(meta) if meta is not None else None
        block = blk.encode_block(obj, user_meta, vector_extent_bytes=self.options.vector_extent_bytes)
        choice = self._codec_for(block.kind, namespace, codec)
        if choice is not None:
            did = choice.params.get("dict")
            dictionary = self._dictionary(ns, did, missing=InvalidObject) if did is not None else None
            block = blk.apply_codec(block, choice, dictionary)
        record = rec.encode_put(ns, k, kflags, block.kind, block.meta, block.extents, block.align_log2, block.codec)
        counters = self._counters
        with self._write_lock:
            if sess is None and not self._refs_seen:
                records = [record]
                where = log.append(record, self._on_written)
            else:
                records = self._put_records(ns, k, kflags, record, sess)
                if records:
                    where = log.append_group(records, self._on_written)[-1]
                else:  # already stored and referenced: make sure it is durable, as a put would
                    cur = self._lookup(ns, k)
                    assert cur is not None
                    where = seglib.Appended(cur.segment, cur.offset, cur.header.lsn,
                                            cur.offset + cur.header.record_len)
        counters["puts"] += 1
        counters["dedup_puts"] += all(r is not record for r in records)
        counters["bytes_written"] += sum(r.header.record_len for r in records)
        self._after_write(log, where)

    def delete(self, key: str | bytes, *, namespace: str = "default") -> bool:
        """Delete the object; True if it existed, False if there was nothing to delete.

        Durability follows the store's mode, as for ``put``.
        """
        log = self._check_writable()
        ns = _encode_namespace(namespace)
        k, kflags = _encode_key(key)
        with self._write_lock:
            if self._lookup(ns, k) is None:
                return False
            records = [rec.encode_delete(ns, k, kflags)]
            if self._refs_seen:  # the references go with the object, atomically
                records += [rec.encode_delete(fmt.REF_NAMESPACE, rec.ref_key(ns, s, k), 0)
                            for s in self._sessions_of(ns, k)]
            where = log.append_group(records, self._on_written)[-1]
        self._counters["deletes"] += 1
        self._after_write(log, where)
        return True

    def train_dictionary(self, samples: Any, *, namespace: str = "default", size: int = 16 << 10) -> int:
        """Train a zstd dictionary on ``samples`` (bytes of many small, similar blobs), store it
        in ``namespace`` and return its id: then ``put(..., codec=f"zstd:dict={id}")`` (or the
        same in ``codecs=``) compresses blobs with it.  A dictionary is kept for good."""
        log = self._check_writable()
        ns = _encode_namespace(namespace)
        data = cdc.train_dictionary([bytes(x) for x in samples], size)
        did = cdc.dictionary_id(data)
        key = bytes((len(ns),)) + ns + did.to_bytes(4, "big")
        with self._write_lock:
            if self._lookup(fmt.DICT_NAMESPACE, key) is None:
                block = blk.encode_block(Blob(data, media_type=fmt.DICT_MEDIA_TYPE), None,
                                         vector_extent_bytes=self.options.vector_extent_bytes)
                record = rec.encode_put(fmt.DICT_NAMESPACE, key, 0, block.kind, block.meta, block.extents,
                                        block.align_log2)
                where = log.append(record, self._on_written)
                self._after_write(log, where)
        return did

    def _dictionary(self, ns: bytes, did: int, missing: type[TierstoreError] = CorruptionError) -> bytes:
        """The zstd dictionary ``did`` of namespace ``ns`` (dictionaries never change: cached)."""
        key = bytes((len(ns),)) + ns + did.to_bytes(4, "big")
        data = self._dicts.get(key)
        if data is None:
            loc = self._lookup(fmt.DICT_NAMESPACE, key)
            if loc is None:
                raise missing(f"no zstd dictionary {did} in namespace {ns.decode('utf-8', 'replace')!r}",
                              hint="train one with store.train_dictionary(samples, namespace=...)")
            where = {"segment": loc.segment, "offset": loc.offset}
            data = blk.read_object(loc.header, _Reader(self, loc, where)).data
            if cdc.dictionary_id(data) != did:
                raise CorruptionError(f"dictionary record {did} holds dictionary {cdc.dictionary_id(data)}", **where)
            self._dicts[key] = data
        return data

    def _codec_for(self, kind: int, namespace: str, codec: str | None) -> cdc.Choice | None:
        name = fmt.KIND_NAMES[kind]
        if codec is not None:
            return cdc.parse(codec, name)
        if not self.codecs:
            return None
        return self.codecs.get((namespace, name)) or self.codecs.get((None, name))

    # -- sessions -------------------------------------------------------------------------------

    def _put_records(self, ns: bytes, k: bytes, kflags: int, record: rec.EncodedRecord,
                     sess: bytes | None) -> list[rec.EncodedRecord]:
        """What a put writes once references are involved (SPEC.md §5.4); caller holds the write lock.

        An object with references is deleted when its last one goes; the anchor reference
        (session id 0x00) stands for "also put without a session", which no session drop removes.
        """
        cur = self._lookup(ns, k)
        refs = set(self._sessions_of(ns, k)) if cur is not None else set()
        out = []
        if cur is None or not rec.same_object(cur.header, record.header):
            out.append(record)
        if sess is None:
            if refs and fmt.ANCHOR_SESSION not in refs:
                out.append(rec.encode_ref(ns, fmt.ANCHOR_SESSION, k, bool(kflags)))
            return out
        if cur is not None and not refs:  # it was put without a session: keep it when sessions go
            out.append(rec.encode_ref(ns, fmt.ANCHOR_SESSION, k, bool(kflags)))
        if sess not in refs:
            out.append(rec.encode_ref(ns, sess, k, bool(kflags)))
        self._refs_seen = True
        return out

    def _memtable(self, ns: bytes, prefix: bytes = b"") -> dict[bytes, Op]:
        """Unapplied records of namespace ``ns`` whose key starts with ``prefix``.  Take it
        *before* the index snapshot (as ``_lookup`` does): the committer deletes entries once
        applied, so an entry missing here is in any snapshot taken after."""
        with self._pending_lock:
            return {k: m for (n, k), m in self._mem.items() if n == ns and k.startswith(prefix)}

    def _sessions_of(self, ns: bytes, k: bytes) -> list[bytes]:
        """Sessions holding a reference on (ns, k): the index, then the memtable."""
        assert self._index is not None
        pending = self._memtable(fmt.REF_NAMESPACE, rec.ref_prefix(ns))
        with self._index.read() as view:
            applied = view.applied().lsn
            sessions = set(view.sessions_of(ns, k))
        for rk, m in pending.items():
            if m.lsn <= applied:
                continue
            parsed = rec.parse_ref_key(rk)
            if parsed is not None and rk == rec.ref_key(ns, parsed[1], k):
                (sessions.add if m.location is not None else sessions.discard)(parsed[1])
        return sorted(sessions)

    def _session_refs(self, ns: bytes, sess: bytes) -> dict[bytes, bytes]:
        """ref key -> target key of every reference ``sess`` holds in ``ns``."""
        assert self._index is not None
        pending = self._memtable(fmt.REF_NAMESPACE, rec.ref_prefix(ns, sess))
        with self._index.read() as view:
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

    def session_keys(self, session: str, *, namespace: str = "default") -> list[str | bytes]:
        """Keys in ``namespace`` that ``session`` holds a reference on, sorted like ``keys``."""
        self._check_open()
        ns = _encode_namespace(namespace)
        sess = _encode_session(session)
        out = []
        for target in self._session_refs(ns, sess).values():
            loc = self._lookup(ns, target)
            if loc is not None:
                out.append((target, loc.header.flags))
        return [_decode_key(k, flags) for k, flags in sorted(out)]

    def drop_session(self, session: str, *, namespace: str = "default") -> int:
        """Release every reference ``session`` holds in ``namespace`` and delete the objects
        that nothing else references: no other session, and never put without a session.

        Atomic per object (an object and its references change in one group; up to
        4096 records per group): after a crash each object is either kept with its
        references or gone with them, and calling ``drop_session`` again finishes the job.
        Returns how many objects were deleted.  Durability follows the store's mode.
        """
        log = self._check_writable()
        ns = _encode_namespace(namespace)
        sess = _encode_session(session)
        deleted = 0
        where = None
        with self._write_lock:
            batch: list[rec.EncodedRecord] = []
            for rk, target in sorted(self._session_refs(ns, sess).items()):
                unit = [rec.encode_delete(fmt.REF_NAMESPACE, rk, 0)]
                loc = self._lookup(ns, target)
                if loc is not None and set(self._sessions_of(ns, target)) <= {sess}:
                    unit.insert(0, rec.encode_delete(ns, target, loc.header.flags & fmt.FLAG_KEY_STR))
                    deleted += 1
                if len(batch) + len(unit) > fmt.GROUP_MAX:
                    where = log.append_group(batch, self._on_written)[-1]
                    batch = []
                batch += unit
            if batch:
                where = log.append_group(batch, self._on_written)[-1]
        self._counters["deletes"] += deleted
        if self._tiers is not None:
            for t in self._tiers.tiers().values():
                with t.lock:
                    t.policy.session_ended(sess)
        if where is not None:
            self._after_write(log, where)
        return deleted

    def match_prefix(self, hashes: Any, *, namespace: str = "default") -> int:
        """How many leading ``hashes`` (keys, e.g. from ``chunk_hashes``) are stored in
        ``namespace``: the length of the longest stored prefix.  Costs one index lookup per
        matched hash (plus one for the first miss), whatever the size of the store."""
        self._check_open()
        ns = _encode_namespace(namespace)
        assert self._index is not None
        keys = (h if type(h) is bytes and 1 <= len(h) <= fmt.KEY_MAX_BYTES else _encode_key(h)[0] for h in hashes)
        mem = self._memtable(ns)  # before the snapshot (see _memtable)
        with self._index.read() as view:
            applied = view.applied().lsn
            pending = {k: m.location is not None for k, m in mem.items() if m.lsn > applied}
            return view.prefix_run(ns, keys, pending)

    def namespace(self, name: str, *, shared: Any = (), readonly: bool = False) -> "NamespaceHandle":
        """A handle scoped to namespace ``name`` (a tenant's view): it reads and writes ``name``,
        reads the ``shared`` namespaces, and cannot name any other (``AccessDenied``)."""
        from .scoped import NamespaceHandle
        self._check_open()
        return NamespaceHandle(self, name, shared=shared, readonly=readonly or self.readonly)

    def _on_written(self, where: seglib.Appended, hdr: rec.RecordHeader) -> None:
        """Runs under the log's append lock, in LSN order."""
        loc = Location(where.segment, where.offset, hdr) if hdr.type == fmt.REC_PUT else None
        op = Op(hdr.namespace, hdr.key, where.lsn, where.segment, where.offset, hdr.record_len, loc)
        if self._tiers is not None and self._tiers.active:  # a cached copy of an older object goes
            self._tiers.invalidate((hdr.namespace, hdr.key), hdr if loc is not None else None)
        with self._pending_lock:
            self._mem[(op.namespace, op.key)] = op
            self._pending.append(op)
            if self._oldest_pending is None:
                self._oldest_pending = time.monotonic()

    def _on_discard(self, first_lsn: int) -> None:
        """The log took back records from ``first_lsn`` on (a failed write): forget them."""
        with self._pending_lock:
            dropped = {(op.namespace, op.key) for op in self._pending if op.lsn >= first_lsn}
            self._pending = [op for op in self._pending if op.lsn < first_lsn]
            for k in dropped:
                older = [op for op in self._pending if (op.namespace, op.key) == k]
                if older:
                    self._mem[k] = older[-1]
                else:
                    self._mem.pop(k, None)

    def _after_write(self, log: seglib.Log, where: seglib.Appended) -> None:
        if self.durability == "sync":
            log.sync(where)
            self._counters["syncs"] += 1
        elif self.durability == "group" and log.unsynced_bytes >= self.options.group_commit_bytes:
            log.sync()
            self._counters["syncs"] += 1
        self._wake_committer()

    def flush(self) -> None:
        """Make every earlier write durable (whatever the durability mode) and visible to
        other processes (the index is committed)."""
        self._check_writable()
        self._commit(force=True, sync=True)

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
        tick = min(self.options.group_commit_ms if self.durability == "group" else self.options.index_commit_ms,
                   self.options.index_commit_ms) / 1000.0
        while True:
            with self._cv:
                if self._stopping:
                    return
                self._cv.wait(timeout=max(tick, 0.001))
                if self._stopping:
                    return
            try:
                self._commit(force=False, sync=False)
            except BaseException as e:  # surfaced to the next caller; the handle stops writing
                self._committer_error = e
                return

    def _commit(self, *, force: bool, sync: bool) -> None:
        """Sync the log if due (or ``sync``), then apply durable pending records to the index."""
        log = self._log
        if log is None or self._index is None:
            return
        with self._commit_lock:
            now = time.monotonic()
            due_sync = self.durability == "group" and log.oldest_unsynced is not None and (
                now - log.oldest_unsynced >= self.options.group_commit_ms / 1000.0)
            if sync or due_sync:
                log.sync()
                self._counters["syncs"] += 1
            elif self.durability == "none":
                log.flush_buffer()  # "none" never syncs, but hands records to the OS promptly
            limit = log.written_lsn if self.durability == "none" else log.durable_lsn
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
            self._index.apply(batch, Applied(last.segment, last.offset, last.lsn, last.offset + last.record_len),
                              durable=sync)
            self._counters["index_commits"] += 1
            with self._pending_lock:
                del self._pending[:n]
                self._oldest_pending = time.monotonic() if self._pending else None
                for op in batch:
                    k = (op.namespace, op.key)
                    m = self._mem.get(k)
                    if m is not None and m.lsn <= last.lsn:
                        del self._mem[k]

    # -- reading ----------------------------------------------------------------------------

    def _lookup(self, ns: bytes, k: bytes) -> Location | None:
        """The newest location of a key, or None.  Memtable first, then an index snapshot."""
        assert self._index is not None
        m = self._mem.get((ns, k))
        if m is None:  # nothing unapplied for this key: the index holds its newest record
            return self._index.lookup(ns, k)
        with self._index.read() as view:
            if m.lsn > view.applied().lsn:
                return m.location  # None for a delete
            return view.get(ns, k)

    def _locate(self, key: Any, namespace: Any) -> tuple[bytes, bytes, Location]:
        self._check_open()
        ns = _encode_namespace(namespace)
        k, _ = _encode_key(key)
        loc = self._lookup(ns, k)
        if loc is None:
            raise NotFound(f"no object {key!r} in namespace {namespace!r}", key=key, namespace=namespace)
        return ns, k, loc

    def _segment_fd(self, seg: int) -> _SegFd:
        return _SegFd(self._files, seg)

    def get(self, key: str | bytes, *, namespace: str = "default", layers: Any = None, rows: Any = None,
            device: str | None = None) -> KVCache | Vectors | Blob:
        """Read an object, or part of one, returning the kind that was stored.

        ``layers`` (KVCache): absolute layer ids, an int / range / slice / contiguous
        ascending sequence; only those layers' bytes are read.  ``rows`` (Vectors): ints,
        a sequence or a slice; only the row ranges holding them are read.  ``device``:
        "cpu" or "cuda:N" returns torch tensors there; by default arrays come back in the
        framework they were stored from (numpy or torch).

        Every byte returned was checked against its CRC-32C: a mismatch raises
        CorruptionError naming the segment and offset, never wrong data.  NotFound if the
        key does not exist.
        """
        if device is not None:
            arrays.validate_device(device)
        ns, k, loc = self._locate(key, namespace)
        obj = self._read(key, namespace, ns, k, loc, layers=layers, rows=rows, device=device)
        self._counters["gets"] += 1
        return obj

    def _read(self, key: Any, namespace: str, ns: bytes, k: bytes, loc: Location, *, same: bool = False,
              **sel: Any) -> Any:
        """Read the object at ``loc`` (through the tiers when the store has them).  If compaction
        moved it meanwhile, follow it to its new location (with ``same``: only if it is still
        the same object, else NotFound)."""
        for attempt in range(3):
            where = {"segment": loc.segment, "offset": loc.offset, "key": key, "namespace": namespace}
            try:
                dicts = None if loc.header.codec == fmt.CODEC_RAW else functools.partial(self._dictionary, ns)
                if self._tiers is not None and self._tiers.active:
                    return self._tiers.read(ns, k, loc, where, dictionaries=dicts, **sel)
                return blk.read_object(loc.header, _Reader(self, loc, where), dictionaries=dicts, **sel)
            except FileNotFoundError:
                if attempt == 2:
                    raise CorruptionError("segment file missing", path=self._files.path(loc.segment),
                                          **where) from None
                new = self._lookup(ns, k)  # compaction moved the object between lookup and read
                if new is None:
                    raise NotFound(f"no object {key!r} in namespace {namespace!r}", key=key,
                                   namespace=namespace) from None
                if same and not rec.same_object(new.header, loc.header):
                    raise NotFound(f"object {key!r} in namespace {namespace!r} was replaced while it was read",
                                   key=key, namespace=namespace) from None
                loc = new
            except CorruptionError as e:
                if e.path is None:
                    e.path = self._files.path(loc.segment)
                raise
            except OSError as e:
                raise io_error(e, "read", path=self._files.path(loc.segment), **where) from None
        raise AssertionError("unreachable")

    def _ssd_reader(self, loc: Location, where: dict[str, Any]) -> "_Reader":
        return _Reader(self, loc, where)

    def _cache_sessions(self, ns: bytes, k: bytes) -> tuple[bytes, ...]:
        """Sessions referencing (ns, k), for the tiers' policy (the anchor is not a session)."""
        if not (self._refs_seen or self.readonly):
            return ()
        return tuple(s for s in self._sessions_of(ns, k) if s != fmt.ANCHOR_SESSION)

    def contains(self, key: str | bytes, *, namespace: str = "default") -> bool:
        """Whether ``key`` exists in ``namespace``."""
        self._check_open()
        ns = _encode_namespace(namespace)
        k, _ = _encode_key(key)
        return self._lookup(ns, k) is not None

    def __contains__(self, key: str | bytes) -> bool:
        return self.contains(key)

    def keys(self, *, namespace: str = "default") -> list[str | bytes]:
        """Every key in ``namespace`` (str keys come back as str, bytes keys as bytes), sorted by
        their UTF-8 / raw bytes."""
        self._check_open()
        ns = _encode_namespace(namespace)
        assert self._index is not None
        with self._pending_lock:
            mem = {k: m for (n, k), m in self._mem.items() if n == ns}
        with self._index.read() as view:
            applied = view.applied().lsn
            out: dict[bytes, int] = {k: flags for k, flags in view.keys(ns)}
        for k, m in mem.items():
            if m.lsn > applied:
                if m.location is None:
                    out.pop(k, None)
                else:
                    out[k] = m.location.header.flags
        return [_decode_key(k, out[k]) for k in sorted(out)]

    def namespaces(self) -> list[str]:
        """Namespaces holding at least one object."""
        self._check_open()
        assert self._index is not None
        with self._index.read() as view:
            names = set(view.namespaces())
        with self._pending_lock:
            pending = list(self._mem.items())
        for (ns, _), m in pending:
            if m.location is not None and not ns.startswith(b"\x00"):
                names.add(ns)
        return sorted(n.decode("utf-8") for n in names if self.keys(namespace=n.decode("utf-8")))

    def info(self, key: str | bytes, *, namespace: str = "default") -> ObjectInfo:
        """Describe a stored object without reading its payload."""
        ns, k, loc = self._locate(key, namespace)
        h = loc.header
        sessions = tuple(x.decode("utf-8", "replace") for x in self._sessions_of(ns, k)
                         if x != fmt.ANCHOR_SESSION) if self._refs_seen or self.readonly else ()
        meta = h.meta
        kind = fmt.KIND_NAMES[h.kind]
        dtype = fmt.DTYPES[meta["dtype"]][0] if "dtype" in meta else None
        shape = tuple(meta["shape"]) if "shape" in meta else ()
        return ObjectInfo(
            namespace=namespace, key=_decode_key(h.key, h.flags), kind=kind, shape=shape, dtype=dtype,
            logical_bytes=sum(rec.expected_extent_lengths(h.kind, meta)), stored_bytes=h.record_len,
            codec=cdc.Choice(cdc.BY_ID[h.codec], meta.get("codec_params", {})).spec,
            lossless=cdc.BY_ID[h.codec].lossless, bound=cdc.BY_ID[h.codec].bound,
            checksum=f"crc32c:{h.header_crc:08x}", extent_checksums=h.extent_crcs,
            tiers=(*self._tiers.where((ns, k), h), "ssd") if self._tiers is not None else ("ssd",),
            lsn=h.lsn, segment=loc.segment, offset=loc.offset, layer_start=meta.get("layer_start"),
            metric=meta.get("metric"), media_type=meta.get("media_type"),
            has_ids=meta.get("ids") if h.kind == fmt.KIND_VECTORS else None, meta=meta.get("meta", {}),
            sessions=sessions,
        )

    def stats(self) -> dict[str, Any]:
        """Counters and sizes: objects, segments, bytes live/dead, log position, tiers."""
        self._check_open()
        assert self._index is not None
        if self._log is not None and self._log.poisoned is None:
            self._commit(force=True, sync=False)  # apply what is durable, so the figures are current
        segs = self._index.segment_stats()
        seg_ids = seglib.list_segments(self._io, self._seg_dir)
        sizes = {s: os.path.getsize(self._files.path(s)) for s in seg_ids}
        dead = sum(segs.get(s, (0, 0))[0] for s in seg_ids)
        total = sum(sizes.values())
        with self._pending_lock:
            pending = len(self._pending)
        applied = self._index.applied()
        log = self._log
        out: dict[str, Any] = {
            "path": self.path,
            "readonly": self.readonly,
            "durability": self.durability,
            "objects_indexed": self._index.count(),
            "session_refs_indexed": self._index.ref_count(),
            "pending_index_records": pending,
            "segments": len(seg_ids),
            "segment_bytes": total,
            "live_bytes": total - dead,  # segment bytes not superseded (headers and padding included)
            "dead_bytes": dead,  # overwritten and deleted objects' records, and DELETE records
            "applied_lsn": applied.lsn,
            "next_lsn": log.next_lsn if log else None,
            "durable_lsn": log.durable_lsn if log else None,
            "counters": dict(self._counters),
            "recovery": dict(self.recovery),
            "tiers": {"ssd": {"bytes_used": total, "capacity_bytes": None, "io_path": "posix"},
                      **{name: t.stats() for name, t in (self._tiers.tiers().items() if self._tiers else ())}},
        }
        return out

    # -- cache tiers ----------------------------------------------------------------------------

    def _cache_tier(self, tier: str) -> Any:
        self._check_open()
        assert self._tiers is not None
        return self._tiers.tier(tier)

    def _promote(self, tier: str, key: Any, namespace: str, ns: bytes, k: bytes, loc: Location, layers: Any) -> int:
        assert self._tiers is not None
        for attempt in range(3):
            where = {"segment": loc.segment, "offset": loc.offset, "key": key, "namespace": namespace}
            try:
                return self._tiers.promote(tier, ns, k, loc, where, layers, functools.partial(self._dictionary, ns))
            except FileNotFoundError:  # compaction moved it: promote it from where it is now
                new = self._lookup(ns, k)
                if new is None or attempt == 2:
                    raise NotFound(f"no object {key!r} in namespace {namespace!r}", key=key,
                                   namespace=namespace) from None
                loc = new
        raise AssertionError("unreachable")

    def prefetch(self, keys: Any, *, namespace: str = "default", tier: str = "dram", layers: Any = None) -> Future:
        """Promote objects into ``tier`` ("dram" or "gpu") in the background.

        ``keys``: one key or an iterable of keys; ``layers``: only those layers of KV objects.
        Returns a ``concurrent.futures.Future`` whose result is the bytes ``tier`` holds for
        them once done; its exception is NotFound for a missing key, StoreFull if the tier
        cannot make room (pinned entries are never evicted).  A ``get`` meanwhile is served
        from wherever the bytes are: it never waits for the prefetch.
        """
        self._cache_tier(tier)
        ns = _encode_namespace(namespace)
        if isinstance(keys, (str, bytes, bytearray, memoryview)):
            keys = [keys]
        todo = [(key, _encode_key(key)[0]) for key in keys]
        assert self._tiers is not None
        return self._tiers.submit(self._prefetch_now, tier, namespace, ns, todo, layers)

    def _prefetch_now(self, tier: str, namespace: str, ns: bytes, todo: list[tuple[Any, bytes]], layers: Any) -> int:
        total = 0
        for key, k in todo:
            loc = self._lookup(ns, k)
            if loc is None:
                raise NotFound(f"no object {key!r} in namespace {namespace!r}", key=key, namespace=namespace)
            total += self._promote(tier, key, namespace, ns, k, loc, layers)
        return total

    def prefetch_session(self, session: str, *, namespace: str = "default", tier: str = "dram") -> Future:
        """A new turn of ``session`` arrived: tell the tier's policy the session is active and
        promote every object it references (AttentionStore's session prefetch).  Returns the
        Future of ``prefetch``."""
        t = self._cache_tier(tier)
        sess = _encode_session(session)
        with t.lock:
            t.policy.session_active(sess)
        return self.prefetch(self.session_keys(session, namespace=namespace), namespace=namespace, tier=tier)

    def stream_layers(self, key: str | bytes, *, namespace: str = "default", device: str | None = None,
                      layers: Any = None) -> Iterator[tuple[int, Any]]:
        """Yield ``(layer_id, kv_layer)`` for each layer of a KVCache (or of ``layers``), in
        order; ``kv_layer`` is shaped [2, kv_heads, tokens, head_dim] (K, V), on ``device``.

        Layer i+1 is being read (from the nearest tier, promoting by policy) while the
        caller uses layer i.  Every layer comes from the one version of the object found
        when the call was made.  Bad arguments raise here, before anything is read.
        """
        if device is not None:
            arrays.validate_device(device)
        ns, k, loc = self._locate(key, namespace)
        hdr = loc.header
        if hdr.kind != fmt.KIND_KV:
            raise InvalidObject(f"stream_layers reads a KVCache; {key!r} is a {fmt.KIND_NAMES[hdr.kind]}")
        start = hdr.meta["layer_start"]
        count = hdr.meta["shape"][0]
        pos = list(range(count)) if layers is None else blk._select_layers(layers, start, count)

        def read_layer(lid: int) -> Any:
            obj = self._read(key, namespace, ns, k, loc, same=True, layers=lid, rows=None, device=device)
            return obj.data[0]

        assert self._tiers is not None
        return self._tiers.stream([start + p for p in pos], read_layer)

    def pin(self, key: str | bytes, *, namespace: str = "default", tier: str = "dram", layers: Any = None) -> None:
        """Promote the object into ``tier`` (now) and keep it there until ``unpin``: a pinned
        object is never evicted.  Pins count: pin twice, unpin twice.  StoreFull if the tier
        cannot make room.  If the key is later overwritten, the pin stays on the key and the
        new object is kept once something promotes it.  Prefer ``with store.pinned(...)``."""
        t = self._cache_tier(tier)
        ns, k, loc = self._locate(key, namespace)
        t.pin((ns, k))
        try:
            self._promote(tier, key, namespace, ns, k, loc, layers)
        except BaseException:
            t.unpin((ns, k))
            raise

    def unpin(self, key: str | bytes, *, namespace: str = "default", tier: str = "dram") -> None:
        """Release one pin taken by ``pin``; InvalidObject if the key holds no pin in ``tier``."""
        t = self._cache_tier(tier)
        ns, (k, _) = _encode_namespace(namespace), _encode_key(key)
        if not t.unpin((ns, k)):
            raise InvalidObject(f"{key!r} in namespace {namespace!r} is not pinned in the {tier} tier",
                                key=key, namespace=namespace)

    @contextmanager
    def pinned(self, key: str | bytes, *, namespace: str = "default", tier: str = "dram",
               layers: Any = None) -> Iterator["Store"]:
        """``with store.pinned(key, tier="gpu"): ...`` pins for the block and always unpins."""
        self.pin(key, namespace=namespace, tier=tier, layers=layers)
        try:
            yield self
        finally:
            if not self._closed:
                self.unpin(key, namespace=namespace, tier=tier)

    # -- maintenance --------------------------------------------------------------------------

    def compact(self, *, min_dead_ratio: float = 0.0) -> dict[str, Any]:
        """Rewrite the live records of sealed segments holding dead bytes, then delete them.

        Crash-safe at every step: copies are appended to the log and synced, the index is
        repointed in one durable transaction, and only then are old segments unlinked.
        Writers are paused only while each record is copied.  Returns what was done.
        """
        from .compaction import compact
        log = self._check_writable()
        try:
            return compact(self, log, min_dead_ratio=min_dead_ratio)
        except OSError as e:
            if isinstance(e, TierstoreError):
                raise
            raise io_error(e, "compact", path=self.path) from None
