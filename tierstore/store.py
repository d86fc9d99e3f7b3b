"""The Store handle: the public API over one store directory.  It checks arguments, turns objects into
records and back (with codecs), keeps namespaces and sessions, and composes the engine (the log and
the index) with the cache tiers.  It never touches a file descriptor or an LMDB transaction itself.

Write path:  Store.put -> block.encode_block -> (block.apply_codec) -> record.encode_put
             -> Engine.append -> Log.append -> Engine.settle (Log.sync) -> committer -> Index.apply
Read path:   Store.get -> Engine.lookup (memtable, then Index) -> Hierarchy.read (a tier hit, or
             a promotion) | block.read_object(Engine.reader) -> segment.read_extents (preadv into a
             preallocated buffer, or the caller's ``out=``; checksums verified)
Batches:     Store.put_many -> (encode every item first) -> Engine.append_group (one atomic group)
             -> Engine.settle;  Store.get_many -> Engine.lookup_many (one snapshot) ->
             Engine.read_first_extents (small blobs, one pread per run) | Store._read

Threads: a Store may be shared by threads.  Processes: any number of writers (the engine holds a
shared ``flock`` on LOCK for a writable handle's life and serialises each append across processes,
SPEC.md §7.8) and any number of read-only handles.
Never use a Store across ``fork()``: a child opens its own (an inherited handle raises
StoreClosed; the engine and index modules forget the parent's state in the child).
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import functools
import itertools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, Future
from contextlib import contextmanager
from typing import Any

from . import arrays
from . import codecs as cdc
from .engine import compaction
from .engine.engine import Engine, open_engine
from .engine.fileio import PosixIO, io_error
from .engine.index import Location
from .engine.options import Options
from .engine.threads import submit
from .errors import (
    CorruptionError,
    InvalidObject,
    NotFound,
    StoreClosed,
    StoreFull,
    StoreIOError,
    StoreLocked,
    TierstoreError,
)
from .format import block as blk
from .format import constants as fmt
from .format import record as rec
from .names import (
    check_namespace,
    decode_key,
    encode_key,
    encode_namespace,
    encode_session,
    key_bytes,
    key_list,
)
from .objects import Blob, KVCache, MLACache, ObjectInfo, Vectors, stored_blob
from .scoped import NamespaceHandle, TenantPins
from .tiers.capacity import (
    CAPACITY_OPTIONS,
    RESERVE_SHARE,
    Capacity,
    budget_settings,
    capacity_options,
    tokens_of,
)
from .tiers.config import TIER_OPTIONS, tier_options
from .tiers.hierarchy import Hierarchy, wanted_extents
from .tiers.policy import session_id
from .tiers.remote import (
    REMOTE_OPTIONS,
    Remote,
    RemoteDown,
    RemoteRefused,
    RemoteTier,
    Stamps,
    Version,
    remote_options,
    version_of,
)
from .tiers.trace import TRACE_OPTIONS, TraceWriter, trace_options

_log = logging.getLogger("tierstore")
TIERS = ("ssd", "dram", "gpu")
SMALL_READ = 64 << 10  # get_many reads raw blobs of records up to this size together (one pread per run)
PREFIX_BATCH = 1024  # match_prefix checks and looks up hashes this many at a time (one index snapshot each)
KIND_IDS = {name: kind for kind, name in fmt.KIND_NAMES.items() if kind in fmt.OBJECT_KINDS}


def codec_table(spec: Any) -> dict[tuple[str | None, str], cdc.Choice]:
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
            check_namespace(ns)
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


def cache_sessions(engine: Engine, ns: bytes, k: bytes) -> tuple[bytes, ...]:
    """Sessions referencing (ns, k), for the tiers' policy and ``info`` (the anchor is not a session)."""
    if not engine.may_have_refs:
        return ()
    return tuple(s for s in engine.sessions_of(ns, k) if s != fmt.ANCHOR_SESSION)


def policy_sessions(engine: Engine, ns: bytes, k: bytes) -> tuple[bytes, ...]:
    """``cache_sessions`` as the tiers' policies know them (``policy.session_id``)."""
    return tuple(session_id(ns, s) for s in cache_sessions(engine, ns, k))


# engines (shared by a process's handles on a store) with a writable remote tier -> the fd of their
# claim on REMOTE.lock (one process per store sends to the remote: it owns the REMOTE file)
_REMOTE_ENGINES: dict[int, int] = {}
_REMOTE_LOCK = threading.Lock()


def _forked() -> None:
    """In the child of a ``fork()``: the parent's remote handles are not the child's.  Its
    copies of their REMOTE.lock descriptors are closed (closing a copy never releases the
    parent's lock, and a child that outlives its parent would keep it)."""
    global _REMOTE_LOCK
    for fd in list(_REMOTE_ENGINES.values()):
        with contextlib.suppress(OSError):
            os.close(fd)
    _REMOTE_ENGINES.clear()
    _REMOTE_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forked)


def release(engine: Engine, tiers: Hierarchy, remote: RemoteTier | None = None,
            capacity: Capacity | None = None, trace: TraceWriter | None = None) -> None:
    """Close a handle's tiers and its share of the engine (what ``close`` does); the eviction
    thread and the remote tier first, while they can still use the log.  In a fork()ed
    child a handle inherited from the parent releases nothing: all of it is the parent's."""
    if engine.inherited:
        engine.close()
        return
    try:
        if capacity is not None:
            capacity.close()
        if trace is not None:
            trace.close()
        if remote is not None:
            try:
                remote.close()
            finally:
                with _REMOTE_LOCK:
                    fd = _REMOTE_ENGINES.pop(id(engine), -1)
                if fd >= 0:
                    os.close(fd)
    finally:
        engine.unsubscribe(tiers.invalidate)
        try:
            tiers.close()
        finally:
            engine.close()


def remote_record(engine: Engine, origin: bytes | None, ns: bytes, k: bytes
                  ) -> tuple[rec.EncodedRecord, Version] | None:
    """The current local record of (ns, k) as the remote tier's queue sends it: only a version
    this store wrote (``origin``; copies of other nodes' objects are theirs to send; None: any
    version, as ``remote_sync`` sends), and not one that needs a zstd dictionary (dictionaries
    stay local in this release)."""
    for _ in range(3):
        loc = engine.lookup(ns, k)
        if loc is None:
            return None
        version = version_of(loc.header)
        if (origin is not None and version.origin != origin) or uses_dictionary(loc.header):
            return None
        reader = engine.reader(loc, {"segment": loc.segment, "offset": loc.offset, "namespace": ns, "key": k})
        try:
            extents = tuple(memoryview(reader.read_bytes(i)) for i in range(len(loc.header.extent_lengths)))
        except FileNotFoundError:  # compaction moved it: look again
            continue
        return rec.EncodedRecord(loc.header, extents), version
    return None


def local_versions(engine: Engine) -> Iterator[tuple[bytes, bytes, Version]]:
    """(namespace, key, version) of every local object (the remote queue's sweep)."""
    for ns in engine.namespaces():
        for k in engine.keys(ns):
            loc = engine.lookup(ns, k)
            if loc is not None:
                yield ns, k, version_of(loc.header)


def uses_dictionary(h: rec.RecordHeader) -> bool:
    return "dict" in h.meta.get("codec_params", {})


_EXIT_HOOKED = False
_EXITING = False  # set at interpreter exit, before weakref runs the finalizers still pending


def _destination(hdr: rec.RecordHeader, layers: Any, rows: Any, out: Any, device: str | None) -> tuple[Any, Any]:
    """``get``'s ``out`` checked against the record before any I/O, as ``read_object`` takes it
    (one array, or per-layer pieces as a KVCache), and the device a CUDA array is read on."""
    if out is None:
        return None, device
    if isinstance(out, (list, tuple)):
        return blk.layer_destination(hdr, layers, out), None
    name, shape = blk.result_shape(hdr, layers, rows)
    arrays.check_out(out, name, shape)
    if arrays.host_bytes(out) is None:
        device = str(out.device)  # a CUDA destination: read there, then copy
    return out, device


def _exiting() -> None:
    global _EXITING
    _EXITING = True


def collected(engine: Engine, tiers: Hierarchy, remote: RemoteTier | None, capacity: Capacity | None,
              trace: TraceWriter | None) -> None:
    """A handle was garbage-collected without ``close()``: release it on a thread of its own
    (the collector may run on a thread that holds one of the engine's locks), or inline at
    interpreter exit, when no new thread may start."""
    if _EXITING:
        release(engine, tiers, remote, capacity, trace)
    else:
        threading.Thread(target=release, args=(engine, tiers, remote, capacity, trace),
                         name="tierstore-release").start()


class _Room:
    """``Store._room_for`` with a budget: ``make_room`` on entry, ``landed`` on exit."""

    __slots__ = ("capacity", "nbytes", "shared")

    def __init__(self, capacity: Capacity, nbytes: int) -> None:
        self.capacity, self.nbytes, self.shared = capacity, nbytes, 0

    def __enter__(self) -> None:
        self.shared = self.capacity.make_room(self.nbytes)

    def __exit__(self, *exc: Any) -> None:
        self.capacity.landed(self.nbytes, self.shared)


_NO_BUDGET = contextlib.nullcontext()


class Store:
    """A handle on a tierstore directory.  Create with ``tierstore.open``.

    Thread-safe.  Use as a context manager or call ``close()``: it makes every write durable
    and visible to other processes, stops the committer thread and releases the writer lock.
    """

    def __init__(self, path: str | os.PathLike[str], *, create: bool = True, readonly: bool = False,
                 durability: str = "sync", _io: PosixIO | None = None, **options: Any) -> None:
        self._closed = True
        for name, flag in (("create", create), ("readonly", readonly)):
            if not isinstance(flag, bool):  # ("no" would be true)
                raise InvalidObject(f"{name}= must be True or False, got {flag!r}")
        self.codecs = codec_table(options.pop("codecs", None))
        tiers = tier_options(options)
        remote = remote_options(options)
        capacity = capacity_options(options)
        if capacity is not None and capacity["downtier"] and remote is not None:
            raise InvalidObject("downtier= with a remote tier is not supported: a lossy copy kept here would "
                                "carry the version of the lossless one the server holds",
                                hint="leave downtier= out, or the remote tier")
        trace = trace_options(options)
        self.options = Options.from_kwargs(options, also=(*TIER_OPTIONS, *REMOTE_OPTIONS, *CAPACITY_OPTIONS,
                                                          *TRACE_OPTIONS, "codecs"))
        reserve = self.options.reserve_bytes
        if capacity is not None and reserve is not None and reserve > capacity["budget"] // RESERVE_SHARE:
            # (the reserve counts in the budget: one this large left every put StoreFull)
            most = capacity["budget"] // RESERVE_SHARE
            raise InvalidObject(f"reserve_bytes={reserve} is too large for ssd_bytes={capacity['budget']}: the "
                                f"reserve counts in the budget", hint=f"give reserve_bytes at most {most} "
                                f"(1/{RESERVE_SHARE} of the budget), or 0, or leave it out")
        if not isinstance(path, (str, os.PathLike)):
            raise InvalidObject(f"path must be a str or os.PathLike, got {type(path).__name__}")
        self.path = os.path.abspath(os.path.expanduser(os.fspath(path)))
        self.readonly = readonly
        self.durability = durability
        self._dicts: dict[bytes, bytes] = {}  # zstd dictionaries read so far
        self._tenant_pins = TenantPins()  # (the pins tenants took through their handles: Store.namespace)
        self._counters = {"puts": 0, "gets": 0, "deletes": 0, "bytes_written": 0, "bytes_read": 0, "dedup_puts": 0}
        self._deletes_begun = self._deletes_ended = 0  # deletes (and delete_many calls) of this handle: see
        # _cache_fetched
        self._tiers: Hierarchy | None = None
        self._remote: RemoteTier | None = None
        self._remote_beside = False  # a REMOTE file: another handle sends this store to a remote
        self._remote_checked = 0.0  # (looked for again at most once a second until found)
        self._stamps: Stamps | None = None  # the stamps of puts beside a remote (SPEC.md §14.6)
        self._capacity: Capacity | None = None
        self._trace: TraceWriter | None = None
        # told of puts, reads, misses, deletes and sessions: the SSD budget's policy, a trace
        self._watchers: tuple[Capacity | TraceWriter, ...] = ()
        self._engine = open_engine(self.path, create=create, readonly=readonly, durability=durability,
                                   options=self.options, io=_io, dram_tier=tiers["dram_bytes"] is not None,
                                   agree=budget_settings(capacity))
        try:
            self._tiers = Hierarchy(self._engine, sessions=functools.partial(policy_sessions, self._engine), **tiers)
            if capacity is not None and not readonly:  # a read-only handle evicts nothing
                self._capacity = Capacity(self._engine, pinned=self._tiers.pinned, transcode=self._lossy_copy,
                                          **capacity)
            if trace is not None:
                self._trace = TraceWriter(trace["path"], max_bytes=trace["max_bytes"])
            if self._capacity is not None:  # the trace is told by the budget, in the order it decides
                self._capacity.follower = self._trace
                self._watchers = (self._capacity,)
            elif self._trace is not None:
                self._watchers = (self._trace,)
            if remote is not None:
                self._remote = self._open_remote(remote)
        except BaseException:
            if self._capacity is not None:
                self._capacity.close()
            if self._trace is not None:
                self._trace.close()
            if self._tiers is not None:
                self._tiers.close()
            self._engine.close()
            raise
        self._engine.subscribe(self._tiers.invalidate)  # a cached copy of an older object goes
        # a handle dropped without close() is closed when it is garbage-collected (or at exit):
        # nothing below refers back to the Store, so dropping the last reference is enough
        self._finalizer = weakref.finalize(self, collected, self._engine, self._tiers, self._remote,
                                           self._capacity, self._trace)
        global _EXIT_HOOKED
        if not _EXIT_HOOKED:  # registered after weakref's own exit hook, so it runs before it
            atexit.register(_exiting)
            _EXIT_HOOKED = True
        self._closed = False
        if self._capacity is not None:  # a store past its budget (reopened with a smaller one) shrinks now
            self._capacity.opened()

    def _open_remote(self, opts: dict[str, Any]) -> RemoteTier:
        engine = self._engine
        assert engine.store_uuid is not None
        if self.readonly:
            opts["policy"] = "read-only"  # a read-only handle writes nowhere
        writes = opts.get("policy", "write-through") != "read-only"
        if writes:
            with _REMOTE_LOCK:  # one queue and one REMOTE file per store: one remote handle per process
                if id(engine) in _REMOTE_ENGINES:
                    raise InvalidObject(f"{self.path} already has a writable handle with remote= in this process",
                                        path=self.path, hint="share that handle between threads (it is thread-safe)")
                try:
                    _REMOTE_ENGINES[id(engine)] = engine.claim(
                        fmt.REMOTE_LOCK_FILE, "another process writes this store with a writable remote tier")
                except StoreLocked as e:
                    e.hint = ("one process per store sends to the remote (it owns the REMOTE file): open this "
                              "handle with remote_policy='read-only', or without remote=")
                    raise
        try:
            tier = RemoteTier(opts.pop("url"), origin=engine.store_uuid, **opts,
                              state_path=os.path.join(self.path, fmt.REMOTE_FILE) if writes else None,
                              stamps_path=os.path.join(self.path, fmt.STAMPS_FILE) if writes else None)
        except BaseException:
            with _REMOTE_LOCK:
                fd = _REMOTE_ENGINES.pop(id(engine), -1)
            if fd >= 0:
                os.close(fd)
            raise
        tier.queue.load = functools.partial(remote_record, engine, engine.store_uuid)
        tier.queue.sweep_source = functools.partial(local_versions, engine)
        tier.queue.start()
        return tier

    @property
    def recovery(self) -> dict[str, Any]:
        """What opening found and did: records replayed, an index rebuilt (and why), damage."""
        return self._engine.recovery

    # -- closing ----------------------------------------------------------------------------

    def close(self) -> None:
        """Make every write durable and visible, then release the handle.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._finalizer.detach() is not None:  # None: the collector got there first
            release(self._engine, self._tiers, self._remote, self._capacity, self._trace)

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if isinstance(exc, NotFound):
            exc.hint  # noqa: B018  (a miss leaving the block: work its hint out while the store is open)
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("read-only" if self.readonly else f"durability={self.durability}")
        remote = f" remote={self._remote.url} ({self._remote.policy})" if self._remote is not None else ""
        return f"<tierstore.Store {self.path!r} {state}{remote}>"

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed("the store is closed", path=self.path)
        self._engine.check_process()

    def _check_writable(self) -> None:
        self._check_open()
        self._engine.check_writable()

    # -- writing ----------------------------------------------------------------------------

    def put(self, key: str | bytes, obj: KVCache | MLACache | Vectors | Blob, *, namespace: str = "default",
            meta: dict[str, Any] | None = None, session: str | None = None, codec: str | None = None) -> None:
        """Store ``obj`` under ``key`` in ``namespace``, replacing any previous object.

        With durability="sync" the object survives a crash or power loss once put returns;
        with "group" once ``flush()`` returns or the group-commit bound passes; with "none"
        it survives a process crash (it is in the OS page cache) but not power loss.  Other
        processes see it once the index batch commits (``index_commit_ms``) or after ``flush()``.

        ``meta`` is an optional dict of str -> (str, bytes, int, float, bool, None, list,
        dict) stored with the object and returned by ``get`` (as ``obj.meta``) and ``info``;
        without it, an object that came from ``get`` keeps the metadata it was read with.

        ``session`` tags the object with a session id: the session holds a reference on it
        (``session_keys``, ``drop_session``).  If the key already holds the same object
        (same metadata, extent lengths and checksums) only the reference is recorded: no second
        copy of the bytes is written.  A new object and its reference are written as one
        atomic group.  A put without ``session`` leaves existing references as they are.

        ``codec`` (e.g. "zstd", "int8", "int4:group=32", "int8+zstd"; ``tierstore.codecs.available()``)
        overrides the store's ``codecs=`` setting for this put.  The default is lossless: data
        is stored raw unless a codec was asked for; ``info(key)`` shows the codec and its bound.

        Raises InvalidObject on bad input (nothing is written), ReadOnlyError, StoreFull,
        StoreIOError.  A put that raised is not in the store afterwards (``error.taken_back``),
        unless the error says otherwise (the log could not be cut; the write may then appear,
        whole, after a reopen).
        """
        where, record = self._put_one(key, obj, namespace, meta, session, codec)
        self._settle_puts(where, [record])

    def _put_one(self, key: Any, obj: Any, namespace: str, meta: dict[str, Any] | None, session: str | None,
                 codec: str | None) -> tuple[Any, rec.EncodedRecord]:
        """Check, encode and append one put (with its references); the caller settles it."""
        self._check_writable()
        ns = encode_namespace(namespace)
        k, kflags = encode_key(key)
        sess = encode_session(session) if session is not None else None
        record = self._encode_put(ns, k, kflags, obj, meta, namespace, codec)
        try:
            with self._room_for(record.header.record_len), self._engine.append_lock:  # _append_puts reads
                where = self._append_puts([(k, kflags, record)], ns, sess)             # what it decides on
        except BaseException:
            self._remote_unsent([record])
            raise
        return where, record

    def _room_for(self, nbytes: int) -> Any:
        """With ``ssd_bytes``: make room for a put of ``nbytes`` first, and count it in flight
        until it is appended (or failed).  A context manager."""
        return _NO_BUDGET if self._capacity is None else _Room(self._capacity, nbytes)

    def _settle_puts(self, where: Any, records: list[rec.EncodedRecord]) -> None:
        """Make appended puts durable, then send them to the remote tier (when there is one).

        "write-through" with durability="group": when the settle syncs (enough is waiting), the
        sends run during the sync.  Nothing is promised durable before that sync in this mode
        (other handles already see the puts), and a sync that fails poisons the handle with
        the puts possibly still appearing after a reopen, so sending first promises no less."""
        engine, remote = self._engine, self._remote
        if remote is not None and remote.policy == "write-through" and engine.settle_syncs():
            failed: list[BaseException] = []

            def settle() -> None:
                try:
                    engine.settle(where)
                except BaseException as e:  # raised below, in the caller's thread
                    failed.append(e)

            syncer = threading.Thread(target=settle, name="tierstore-settle")
            syncer.start()
            try:
                self._remote_put(records, now=True)
            finally:
                syncer.join()
            if failed:
                raise failed[0]
            return
        try:
            engine.settle(where)
        except BaseException:
            self._remote_unsent(records)
            raise
        if remote is not None:
            self._remote_put(records, now=True)

    def _remote_unsent(self, records: list[rec.EncodedRecord]) -> None:
        """Puts that failed locally: their stamps are no longer waiting to be sent."""
        remote = self._remote
        if remote is not None:
            for r in records:
                v = version_of(r.header)
                if v.stamp and v.origin == remote.origin:
                    remote.queue.sent(v.stamp)

    def _remote_put(self, records: list[rec.EncodedRecord], *, now: bool) -> None:
        """Send durable puts to the remote: at once ("write-through", ``now``), else through the
        queue; a send that fails is queued (the local put stands, the remote catches up)."""
        remote = self._remote
        assert remote is not None
        for r in records:
            v = version_of(r.header)
            if not v.stamp or v.origin != remote.origin:
                continue  # a session reference, or a record of an earlier open
            h = r.header
            if uses_dictionary(h):
                remote.queue.sent(v.stamp)
            elif remote.policy == "write-through" and now:
                loc = self._engine.lookup(h.namespace, h.key)  # the header as appended (its LSN, its CRC)
                if loc is None or version_of(loc.header) != v:  # deleted or replaced meanwhile: nothing to send
                    remote.queue.sent(v.stamp)
                    continue
                try:
                    remote.push(rec.EncodedRecord(loc.header, r.extents), v)
                except RemoteRefused:  # the server takes no retry of it: the object stays local
                    remote.count("refused")
                    remote.queue.sent(v.stamp)
                except RemoteDown:
                    remote.queue.add(h.namespace, h.key, v.stamp)
                else:
                    remote.queue.sent(v.stamp)
            else:
                remote.queue.add(h.namespace, h.key, v.stamp)

    def _remote_deleted(self, ns: bytes, ks: list[bytes]) -> None:
        """Deletes made durable locally: tombstones to the remote (queued, and saved in REMOTE,
        when it does not answer or in "write-back")."""
        remote = self._remote
        if remote is None or not remote.writes:
            return
        for k in ks:
            try:
                stamp = remote.next_stamp()
            except StoreIOError as e:  # the delete is done here: it must reach the server, or the
                # value comes back from there -- with a stamp not reserved in STAMPS (only a clock
                # set back before the next open could then order it below this store's older ones)
                _log.warning("tierstore: %s: reserving a version stamp failed (%s); a delete is sent with "
                             "one not reserved", self.path, e.message)
                stamp = remote.clock.next()
            v = Version(stamp, remote.origin)
            if remote.policy == "write-back":
                remote.queue.add_tombstone(ns, k, v)
                continue
            try:
                remote.tombstone(ns, k, v)
            except RemoteRefused:  # (a key of another type under the name: nothing of ours to hide)
                remote.count("refused")
            except RemoteDown:
                remote.queue.add_tombstone(ns, k, v)

    def _encode_put(self, ns: bytes, k: bytes, kflags: int, obj: Any, meta: dict[str, Any] | None,
                    namespace: str, codec: str | None) -> rec.EncodedRecord:
        """``obj`` as a PUT record (validated, codec applied); nothing is written."""
        if meta is None:
            meta = getattr(obj, "meta", None) or None  # an object read back keeps its metadata
        user_meta = rec.check_user_meta(meta) if meta is not None else None
        block = blk.encode_block(obj, user_meta, vector_extent_bytes=self.options.vector_extent_bytes)
        choice = self._codec_for(block.kind, namespace, codec)
        if choice is not None:
            did = choice.params.get("dict")
            dictionary = self._dictionary(ns, did, missing=InvalidObject) if did is not None else None
            block = blk.apply_codec(block, choice, dictionary)
        remote = self._remote
        if remote is None or not remote.writes:
            if not self._beside_remote():
                return rec.encode_put(ns, k, kflags, block.kind, block.meta, block.extents, block.align_log2,
                                      block.codec)
            # another handle sends this store to a remote: a version, so that its reads keep this put
            # (newer than the server's) instead of the server's older value; it reaches the server by
            # that handle's next sweep or remote_sync (this handle sends nothing)
            if self._stamps is None:  # (once: it reads STAMPS, and may take a reservation into the clock)
                self._stamps = Stamps(os.path.join(self.path, fmt.STAMPS_FILE))
            meta = {**block.meta, fmt.META_VERSION: [self._stamps.next(), self._engine.store_uuid]}
            return rec.encode_put(ns, k, kflags, block.kind, meta, block.extents, block.align_log2, block.codec)
        stamp = remote.queue.issue()  # the version other nodes compare (SPEC.md §14.2)
        try:
            meta = {**block.meta, fmt.META_VERSION: [stamp, remote.origin]}
            return rec.encode_put(ns, k, kflags, block.kind, meta, block.extents, block.align_log2, block.codec)
        except BaseException:
            remote.queue.sent(stamp)
            raise

    def _beside_remote(self) -> bool:
        """Whether the store has a remote tier that another handle (of any process) sends to:
        its REMOTE file exists (SPEC.md §14.5).  Looked for at most once a second until found."""
        if not self._remote_beside:
            now = time.monotonic()
            if now < self._remote_checked:
                return False
            self._remote_checked = now + 1.0
            self._remote_beside = os.path.exists(os.path.join(self.path, fmt.REMOTE_FILE))
        return self._remote_beside

    def _append_puts(self, puts: list[tuple[bytes, int, rec.EncodedRecord]], ns: bytes, sess: bytes | None) -> Any:
        """Append encoded puts of namespace ``ns`` (with their session references) as one atomic
        group; the caller holds the append lock and settles the returned position."""
        engine = self._engine
        if sess is None and not engine.may_have_refs:  # nothing to decide: append as they are
            records = [r for _, _, r in puts]
            dedup = 0
        else:
            engine.see_all()  # references decide what is written: see other writers' first
            records = []
            dedup = 0
            for k, kflags, record in puts:
                got = self._put_records(ns, k, kflags, record, sess)
                dedup += all(r is not record for r in got)
                records += got
        if len(records) > fmt.GROUP_MAX:
            per = -(-len(records) // len(puts))  # records per put, rounded up
            raise InvalidObject(f"a batch of {len(puts)} puts makes {len(records)} records; one atomic group "
                                f"holds at most {fmt.GROUP_MAX}",
                                hint=f"split it into batches of {fmt.GROUP_MAX // per} puts or fewer")
        own = self._capacity.own_puts(ns, [k for k, _, _ in puts]) if self._capacity is not None \
            else contextlib.nullcontext()
        if not records:  # every object already stored and referenced: make sure they are durable
            locs = [engine.lookup(ns, k) for k, _, _ in puts]
            where = max((engine.appended_at(loc) for loc in locs if loc is not None), key=lambda a: a.lsn)
        elif len(records) == 1:
            with own:
                where = engine.append(records[0])
        else:
            with own:
                where = engine.append_group(records)
        for w in self._watchers:
            for k, _, record in puts:
                w.admitted(ns, k, record.header.record_len, (sess,) if sess is not None else (),
                           tokens_of(record.header))
        counters = self._counters
        counters["puts"] += len(puts)
        counters["dedup_puts"] += dedup
        counters["bytes_written"] += sum(r.header.record_len for r in records)
        return where

    def delete(self, key: str | bytes, *, namespace: str = "default") -> bool:
        """Delete the object; True if it existed, False if there was nothing to delete.

        Durability follows the store's mode, as for ``put``.
        """
        self._deletes_begun += 1  # (a fetched copy on its way to the log meanwhile is not kept: _cache_fetched)
        try:
            return self._delete(key, namespace)
        finally:
            self._deletes_ended += 1

    def _delete(self, key: Any, namespace: str) -> bool:
        self._check_writable()
        engine = self._engine
        ns = encode_namespace(namespace)
        k, kflags = encode_key(key)
        given = engine.reserve_released  # (the committer may give the reserve up meanwhile)
        for attempt in (0, 1):
            try:
                with engine.write_lock:
                    where = None
                    if engine.lookup(ns, k) is not None:  # with its references, atomically
                        where = engine.append_group(engine.deletion(ns, k, kflags))
                if where is None:  # not held here; the server is asked outside the lock
                    return self._remote_only_deleted(ns, [k])[0]
                engine.settle(where)
                break
            except StoreFull:  # the write was taken back; the reserve makes room for it (once)
                if attempt or not engine.release_reserve(given):
                    raise
        self._counters["deletes"] += 1
        for w in self._watchers:
            w.removed(ns, [k])
        self._remote_deleted(ns, [k])
        return True

    def _remote_only_deleted(self, ns: bytes, ks: list[bytes]) -> list[bool]:
        """Deletes of keys this store does not hold: a tombstone for each one the remote holds
        (deletes propagate whoever stored the object).  Per key, whether there was one."""
        remote = self._remote
        if remote is None or not remote.writes:
            return [False] * len(ks)
        try:
            found = self._remote_has(ns, ks, raise_down=True, sound=False)  # a damaged value is deleted too
        except RemoteDown:  # it may hold them: a tombstone for each, sent when it answers (False: not known)
            self._remote_deleted(ns, ks)
            return [False] * len(ks)
        self._remote_deleted(ns, [k for k, f in zip(ks, found) if f])
        return found

    def put_many(self, items: Any, *, namespace: str = "default", session: str | None = None,
                 codec: str | None = None) -> None:
        """Store many objects in ``namespace`` as one atomic group: ``items`` is an iterable of
        ``(key, obj)`` or ``(key, obj, meta)``.  Every item is checked (and encoded) before
        anything is written; then all of them are appended together and made durable with one
        sync: after a crash either every object of the batch is in the store or none is.

        ``session`` and ``codec`` apply to every item, as for ``put``.  A key may appear once
        per batch (InvalidObject otherwise); a batch holds at most ``GROUP_MAX`` (4096)
        records, session references included (InvalidObject with a hint when larger).
        Raises what ``put`` raises; a batch that raised left nothing in the store.
        """
        self._check_writable()
        engine = self._engine
        ns = encode_namespace(namespace)
        sess = encode_session(session) if session is not None else None
        if codec is not None:  # (checked as the argument it is: the items' kinds choose the codec)
            cdc.check_any(codec)
        puts: list[tuple[bytes, int, rec.EncodedRecord]] = []
        seen: set[bytes] = set()
        try:
            if isinstance(items, dict):
                raise InvalidObject("put_many takes (key, obj) items, not a dict (iterating one gives its keys)",
                                    hint="put_many(d.items()) stores each key of the dict with its object")
            try:
                items = iter(items)
            except TypeError:
                raise InvalidObject(f"put_many takes an iterable of (key, obj) items, got {type(items).__name__}") \
                    from None
            for n, item in enumerate(items):
                if not isinstance(item, tuple) or len(item) not in (2, 3):
                    raise InvalidObject(f"put_many item {n}: expected (key, obj) or (key, obj, meta), "
                                        f"got {type(item).__name__}")
                key, obj, meta = item if len(item) == 3 else (*item, None)
                try:
                    k, kflags = encode_key(key)
                except InvalidObject as e:
                    e.message = f"put_many item {n}: {e.message}"
                    raise
                if k in seen:
                    raise InvalidObject(f"put_many: key {key!r} appears twice in the batch", key=key,
                                        namespace=namespace, hint="a batch is one atomic group: give each key once")
                seen.add(k)
                try:
                    puts.append((k, kflags, self._encode_put(ns, k, kflags, obj, meta, namespace, codec)))
                except TierstoreError as e:  # which of a batch's items was refused
                    e.key = key if e.key is None else e.key
                    e.message = f"put_many item {n}: {e.message}"
                    raise
        except BaseException:  # nothing is written: the stamps of the items encoded so far go
            self._remote_unsent([r for _, _, r in puts])
            raise
        if not puts:
            return
        records = [r for _, _, r in puts]
        try:
            with self._room_for(sum(r.header.record_len for r in records)), engine.append_lock:
                where = self._append_puts(puts, ns, sess)  # under the lock: it reads what it decides on
        except BaseException:
            self._remote_unsent(records)
            raise
        self._settle_puts(where, records)

    def put_async(self, key: str | bytes, obj: KVCache | MLACache | Vectors | Blob, *, namespace: str = "default",
                  meta: dict[str, Any] | None = None, session: str | None = None,
                  codec: str | None = None) -> Future:
        """``put`` that returns once the object's bytes are written to the log (the caller may
        reuse its buffers and other handles' reads see it), before they are durable.  The
        returned ``concurrent.futures.Future`` completes (result None) once the put is durable
        against power loss: synced, whatever the durability mode, sharing one sync with other
        puts in flight.  Bad input raises here, as for ``put``, with nothing written; a failed
        sync is the Future's exception (StoreIOError)."""
        engine = self._engine
        where, record = self._put_one(key, obj, namespace, meta, session, codec)
        engine.settle_later(where)  # the committer applies it; the sync below makes it durable
        if self._remote is not None:
            self._remote_put([record], now=False)
        return engine.sync_async(where)

    def delete_many(self, keys: Any, *, namespace: str = "default") -> list[bool]:
        """Delete many keys of ``namespace`` as one atomic group (with their session references):
        after a crash all of them are gone or none is.  Returns, per key, whether it existed.
        A key may appear once per batch (InvalidObject otherwise, and nothing is deleted); a
        batch holds at most ``GROUP_MAX`` (4096) records, each key's session references
        included (InvalidObject with a hint when larger: delete in smaller batches)."""
        self._deletes_begun += 1  # (as in delete)
        try:
            return self._delete_many(keys, namespace)
        finally:
            self._deletes_ended += 1

    def _delete_many(self, keys: Any, namespace: str) -> list[bool]:
        self._check_writable()
        engine = self._engine
        ns = encode_namespace(namespace)
        keys = key_list(keys, "delete_many", "delete(key) deletes one")
        encoded = [encode_key(key) for key in keys]
        seen: set[bytes] = set()
        for key, (k, _) in zip(keys, encoded):
            if k in seen:
                raise InvalidObject(f"delete_many: key {key!r} appears twice in the batch", key=key,
                                    namespace=namespace, hint="a batch is one atomic group: give each key once")
            seen.add(k)
        given = engine.reserve_released  # (the committer may give the reserve up meanwhile)
        for attempt in (0, 1):
            try:
                with engine.write_lock:
                    found = engine.lookup_many(ns, [k for k, _ in encoded])
                    records = [r for unit in engine.deletions(ns, [kf for kf, loc in zip(encoded, found)
                                                                   if loc is not None]) for r in unit]
                    if records and len(records) > fmt.GROUP_MAX:
                        per = -(-len(records) // max(1, sum(loc is not None for loc in found)))
                        raise InvalidObject(f"a batch of {len(encoded)} deletes makes {len(records)} records; one "
                                            f"atomic group holds at most {fmt.GROUP_MAX}",
                                            hint=f"split it into batches of {fmt.GROUP_MAX // per} deletes or fewer")
                    where = engine.append_group(records) if records else None
                if where is None:  # nothing held here; the server is asked outside the lock
                    return self._remote_only_deleted(ns, [k for k, _ in encoded])
                engine.settle(where)
                break
            except StoreFull:  # as in delete: the reserve makes room (once)
                if attempt or not engine.release_reserve(given):
                    raise
        self._counters["deletes"] += sum(loc is not None for loc in found)
        for w in self._watchers:
            w.removed(ns, [k for (k, _), loc in zip(encoded, found) if loc is not None])
        self._remote_deleted(ns, [k for (k, _), loc in zip(encoded, found) if loc is not None])
        elsewhere = iter(self._remote_only_deleted(ns, [k for (k, _), loc in zip(encoded, found) if loc is None]))
        return [loc is not None or next(elsewhere) for loc in found]

    def train_dictionary(self, samples: Any, *, namespace: str = "default", size: int = 16 << 10) -> int:
        """Train a zstd dictionary on ``samples`` (bytes of many small, similar blobs), store it
        in ``namespace`` and return its id: then ``put(..., codec=f"zstd:dict={id}")`` (or the
        same in ``codecs=``) compresses blobs with it.  A dictionary is kept for good."""
        self._check_writable()
        engine = self._engine
        ns = encode_namespace(namespace)
        data = cdc.train_dictionary([bytes(x) for x in samples], size)
        did = cdc.dictionary_id(data)
        key = rec.dict_key(ns, did)
        where = None
        with engine.write_lock:
            if engine.lookup(fmt.DICT_NAMESPACE, key) is None:
                block = blk.encode_block(Blob(data, media_type=fmt.DICT_MEDIA_TYPE), None,
                                         vector_extent_bytes=self.options.vector_extent_bytes)
                record = rec.encode_put(fmt.DICT_NAMESPACE, key, 0, block.kind, block.meta, block.extents,
                                        block.align_log2)
                where = engine.append(record)
        if where is not None:  # never sync under the write lock (it is the append lock)
            engine.settle(where)
        return did

    def _dictionary(self, ns: bytes, did: int, missing: type[TierstoreError] = CorruptionError) -> bytes:
        """The zstd dictionary ``did`` of namespace ``ns`` (dictionaries never change: cached)."""
        key = rec.dict_key(ns, did)
        data = self._dicts.get(key)
        if data is None:
            loc = self._engine.lookup(fmt.DICT_NAMESPACE, key)
            if loc is None:
                raise missing(f"no zstd dictionary {did} in namespace {ns.decode('utf-8', 'replace')!r}",
                              hint="train one with store.train_dictionary(samples, namespace=...)")
            where = {"segment": loc.segment, "offset": loc.offset}
            data = blk.read_object(loc.header, self._engine.reader(loc, where)).data
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

    def _lossy_copy(self, ns: bytes, k: bytes, loc: Location, choice: cdc.Choice,
                    between: Callable[[], None] | None = None) -> rec.EncodedRecord:
        """The object at ``loc`` as a PUT record in the lossy codec ``choice``, for the SSD budget's
        down-tiering (``downtier=``): read from the log (not through the cache tiers, which it
        would only disturb), decoded, and encoded again with its metadata (``between`` is
        called before each extent is encoded: what it raises stops); nothing is written.
        NotFound when compaction moved it meanwhile (the budget then deletes it, as without a
        down-tier)."""
        h = loc.header
        namespace = ns.decode("utf-8")
        where = {"segment": loc.segment, "offset": loc.offset, "key": decode_key(k, h.flags), "namespace": namespace}
        dicts = None if h.codec == fmt.CODEC_RAW else functools.partial(self._dictionary, ns)
        try:
            obj = blk.read_object(h, self._engine.reader(loc, where), dictionaries=dicts)
        except FileNotFoundError:
            raise NotFound("moved by compaction while it was down-tiered", **where) from None
        block = blk.encode_block(obj, h.meta.get("meta"), vector_extent_bytes=self.options.vector_extent_bytes)
        if "fw" in h.meta:  # read back as numpy where torch is missing: still a torch tensor to its readers
            block = block._replace(meta={**block.meta, "fw": h.meta["fw"]})
        block = blk.apply_codec(block, choice, None, between)
        return rec.encode_put(ns, k, h.flags, block.kind, block.meta, block.extents, block.align_log2, block.codec)

    def flush(self) -> None:
        """Make every earlier write durable (whatever the durability mode) and visible to
        other processes (the index is committed).  With ``ssd_bytes``, an eviction under way
        in the background finishes first."""
        self._check_open()
        if self._capacity is not None:
            self._capacity.wait_idle()
        self._engine.flush()

    # -- sessions -------------------------------------------------------------------------------

    def _put_records(self, ns: bytes, k: bytes, kflags: int, record: rec.EncodedRecord,
                     sess: bytes | None) -> list[rec.EncodedRecord]:
        """What a put writes once references are involved (SPEC.md §5.4); caller holds the write lock.

        An object with references is deleted when its last one goes; the anchor reference
        (session id 0x00) stands for "also put without a session", which no session drop removes.
        """
        engine = self._engine
        cur = engine.lookup(ns, k)
        refs = set(engine.sessions_of(ns, k)) if cur is not None else set()
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
        return out

    def session_keys(self, session: str, *, namespace: str = "default") -> list[str | bytes]:
        """Keys in ``namespace`` that ``session`` holds a reference on, sorted like ``keys``."""
        self._check_open()
        ns = encode_namespace(namespace)
        sess = encode_session(session)
        out = []
        for target in self._engine.session_refs(ns, sess).values():
            loc = self._engine.lookup(ns, target)
            if loc is not None:
                out.append((target, loc.header.flags))
        return [decode_key(k, flags) for k, flags in sorted(out)]

    def drop_session(self, session: str, *, namespace: str = "default") -> int:
        """Release every reference ``session`` holds in ``namespace`` and delete the objects
        that nothing else references: no other session, and never put without a session.

        Atomic per object (an object and its references change in one group; up to
        4096 records per group): after a crash each object is either kept with its
        references or gone with them, and calling ``drop_session`` again finishes the job.
        Returns how many objects were deleted.  Durability follows the store's mode.  On a full
        disk it uses the store's reserve, as ``delete`` does.
        """
        self._check_writable()
        given = self._engine.reserve_released  # (the committer may give the reserve up meanwhile)
        for attempt in (0, 1):
            try:
                return self._drop_session(session, namespace)
            except StoreFull:  # the failed group was taken back; the reserve makes room (once), and
                if attempt or not self._engine.release_reserve(given):  # a second pass finishes the job
                    raise
        raise AssertionError("unreachable")

    def _drop_session(self, session: str, namespace: str) -> int:
        engine = self._engine
        ns = encode_namespace(namespace)
        sess = encode_session(session)
        deleted = 0
        gone: list[bytes] = []
        where = None
        with engine.write_lock:
            batch: list[rec.EncodedRecord] = []
            refs = sorted(engine.session_refs(ns, sess).items())
            # each object's location and holders, read once before any group is appended (one pass
            # over the unapplied references: a key at a time it was quadratic, 50,000 keys took
            # 12 minutes); the groups below change only this session's references
            targets = [target for _, target in refs]
            locs = dict(zip(targets, engine.lookup_many(ns, targets)))
            holders = engine.sessions_of_many(ns, list(dict.fromkeys(targets)))
            for rk, target in refs:
                unit = [rec.encode_delete(fmt.REF_NAMESPACE, rk, 0)]
                loc = locs[target]
                if loc is not None and set(holders[target]) <= {sess}:
                    unit.insert(0, rec.encode_delete(ns, target, loc.header.flags & fmt.FLAG_KEY_STR))
                    deleted += 1
                    gone.append(target)
                if len(batch) + len(unit) > fmt.GROUP_MAX:
                    where = engine.append_group(batch)
                    batch = []
                batch += unit
            if batch:
                where = engine.append_group(batch)
        self._counters["deletes"] += deleted
        for w in self._watchers:
            w.removed(ns, gone)
            w.session_ended(ns, sess)
        if self._tiers is not None:
            for t in self._tiers.tiers().values():
                with t.lock:
                    t.policy.session_ended(session_id(ns, sess))
        if where is not None:
            engine.settle(where)
        self._remote_deleted(ns, gone)
        return deleted

    def match_prefix(self, hashes: Any, *, namespace: str = "default") -> int:
        """How many leading ``hashes`` (keys, e.g. from ``chunk_hashes``) are stored in
        ``namespace``: the length of the longest stored prefix.  Costs one index lookup per
        matched hash (plus one for the first miss), whatever the size of the store; hashes are
        checked (as ``contains`` checks a key) ``PREFIX_BATCH`` at a time, up to the batch
        holding the first miss."""
        self._check_open()
        ns = encode_namespace(namespace)
        if isinstance(hashes, (str, bytes, bytearray, memoryview)):
            raise InvalidObject("match_prefix takes a sequence of hashes (chunk_hashes' list), got one key",
                                hint="match_prefix([h]) asks about one hash; contains(h) does too")
        it, n, local = iter(hashes), 0, True
        while True:  # hashes checked and looked up PREFIX_BATCH at a time: a run that ends early reads no more
            batch = key_bytes(list(itertools.islice(it, PREFIX_BATCH)))
            if not batch:
                return n
            if local:
                run = self._engine.prefix_run(ns, batch)
                n += run
                if run == len(batch):
                    continue
                if self._remote is None:
                    return n
                local, batch = False, batch[run:]  # the rest of the run, from the remote
            for i in range(0, len(batch), 256):  # one pipeline per 256 hashes
                has = self._remote_has(ns, batch[i:i + 256])
                run = has.index(False) if False in has else len(has)
                n += run
                if run < len(has):
                    return n

    def namespace(self, name: str, *, shared: Any = (), readonly: bool = False) -> NamespaceHandle:
        """A handle scoped to namespace ``name`` (a tenant's view): it reads and writes ``name``,
        reads the ``shared`` namespaces, and cannot name any other (``AccessDenied``)."""
        self._check_open()
        return NamespaceHandle(self, name, shared=shared, readonly=readonly or self.readonly, pins=self._tenant_pins)

    # -- reading ----------------------------------------------------------------------------

    def _locate(self, key: Any, namespace: Any, *, read: bool = True) -> tuple[bytes, bytes, Location]:
        """Where ``key`` is; NotFound if nowhere.  ``read``: a miss of a read, which the SSD
        budget's policy and a trace are told of (``info`` and ``pin`` are not reads)."""
        self._check_open()
        ns = encode_namespace(namespace)
        k, _ = encode_key(key)
        loc = self._engine.lookup(ns, k)
        if loc is None:
            for w in self._watchers if read else ():
                w.missed(ns, [k])
            raise NotFound(f"no object {key!r} in namespace {namespace!r}", key=key, namespace=namespace,
                           hint_from=functools.partial(self._elsewhere, k, ns))
        return ns, k, loc

    def _elsewhere(self, k: bytes, ns: bytes) -> str | None:
        """For a NotFound, when its hint is read: the other namespaces that hold the key, if any."""
        if self._closed:
            return None
        names = self._engine.holders(k, exclude=ns)
        if not names:
            return None
        shown = ", ".join(repr(n.decode("utf-8")) for n in names[:3])
        return f"namespace {shown} {'holds' if len(names) == 1 else 'hold'} that key"

    def get(self, key: str | bytes, *, namespace: str = "default", layers: Any = None, rows: Any = None,
            device: str | None = None, out: Any = None) -> KVCache | MLACache | Vectors | Blob:
        """Read an object, or part of one, returning the kind that was stored.

        ``layers`` (KVCache): absolute layer ids, an int / range / slice / contiguous
        ascending sequence; only those layers' bytes are read.  ``rows`` (Vectors): ints,
        a sequence or a slice; only the row ranges holding them are read.  ``device``:
        "cpu" or "cuda:N" returns torch tensors there; by default arrays come back in the
        framework they were stored from (numpy or torch).

        ``out``: a numpy array or torch tensor (CPU, pinned or CUDA) of the stored dtype and of
        the shape this read returns (``info(key).shape``, or its selected layers / rows):
        the data is read (and decoded) into it, and the returned object's ``data`` is ``out``.
        Host memory is filled in place, with no staging copy; a CUDA tensor is filled from
        host memory (or the GPU tier).  For a KVCache, ``out`` may instead be a list with one
        destination per layer read, as ``KVCache.from_layers`` takes them (a pair ``(k, v)`` of
        ``[kv_heads, tokens, head_dim]`` arrays, or one ``[2, kv_heads, tokens, head_dim]``),
        with any strides (no two sharing memory): views into a model's own cache tensors are
        filled layer by layer, with no whole-chunk staging buffer, and a KVCache over them is
        returned (``layer_start``: the first layer read).  A mismatch is InvalidObject,
        raised before any I/O.  ``device`` and ``out`` exclude
        each other (``out`` says where).

        Every byte returned was checked against its CRC-32C: a mismatch raises
        CorruptionError naming the segment and offset, never wrong data.  NotFound if the
        key does not exist.
        """
        if device is not None:
            if out is not None:
                raise InvalidObject("get(device=..., out=...): out= already says where the data goes")
            arrays.validate_device(device)
        if self._remote is None:
            ns, k, loc = self._locate(key, namespace)
        else:
            ns, k, loc, fetched = self._locate_everywhere(key, namespace, layers, rows)
            if fetched is not None:
                return self._read_fetched(fetched, ns, layers=layers, rows=rows, device=device, out=out)
        if out is None and device is None and layers is None and rows is None and self._small_blob(ns, k, loc.header):
            return self._read_small_blob(key, namespace, ns, k, loc)  # the short path of small blobs
        try:
            out, device = _destination(loc.header, layers, rows, out, device)
        except TierstoreError as e:
            e.key = key if e.key is None else e.key  # (as get_many names a refused destination's key)
            raise
        # (out was checked against this very object: a replaced one is NotFound)
        obj, loc = self._read(key, namespace, ns, k, loc, same=out is not None, layers=layers, rows=rows,
                              device=device, out=out)
        if out is not None and not isinstance(out, blk.LayerDest) and obj.data is not out:
            arrays.copy_into(out, obj.data)
            obj.data = out
        return self._delivered(obj, loc, layers, rows)

    def remote_sync(self, *, namespace: str | None = None, progress: Any = None) -> dict[str, Any]:
        """Send the remote tier every local object it lacks, or holds an older version of (of
        ``namespace``, or of all): objects written before the store had a remote, while it was
        unreachable, or evicted from it.  A newer version or a tombstone on the server is never
        replaced.  Deletes not yet sent (the server was down, or "write-back") are sent first.
        ``progress(n)`` is called with each batch's count.  Returns counts: ``checked``, ``sent``,
        ``present`` (the server holds this or a newer version), ``local_only`` (objects that need
        a zstd dictionary, which stay local), ``tombstones`` (deletes sent), ``failed`` (objects
        and deletes not sent: no answer), ``refused`` (the server refused the value: larger than
        it takes, or another type of key under its name) and ``answered`` (False: the server
        never answered).
        (``tierstore remote-sync PATH --remote URL``.)"""
        self._check_writable()
        remote = self._remote
        if remote is None or not remote.writes:
            raise InvalidObject("remote_sync needs a store opened with remote= and a policy that writes",
                                hint='tierstore.open(path, remote="redis://host:6379/0")')
        engine = self._engine
        names = [encode_namespace(namespace)] if namespace is not None else engine.namespaces()
        counts: dict[str, Any] = {"checked": 0, "sent": 0, "present": 0, "local_only": 0, "tombstones": 0,
                                  "failed": 0, "refused": 0, "answered": True}
        try:
            remote.ping()
        except RemoteDown:
            counts["answered"] = False
        counts["tombstones"], not_sent, refused = remote.queue.send_tombstones()
        counts["failed"] += not_sent
        counts["refused"] += refused
        for ns in names:
            keys = sorted(engine.keys(ns))
            for i in range(0, len(keys), 256):
                batch = keys[i:i + 256]
                try:
                    states = remote.states(ns, batch)
                except RemoteDown:
                    counts["failed"] += len(batch)
                    continue
                for k, st in zip(batch, states):
                    counts["checked"] += 1
                    got = remote_record(engine, None, ns, k)
                    if got is None:
                        loc = engine.lookup(ns, k)
                        counts["local_only" if loc is not None else "present"] += 1
                        continue
                    record, version = got
                    if st is not None and st.version >= version:
                        counts["present"] += 1
                        continue
                    try:
                        counts["sent" if remote.push(record, version) == 1 else "present"] += 1
                    except RemoteRefused:
                        remote.count("refused")
                        counts["refused"] += 1
                    except RemoteDown:
                        counts["failed"] += 1
                if progress is not None:
                    progress(len(batch))
        return counts

    # -- the remote tier's side of reads ----------------------------------------------------------

    def _locate_everywhere(self, key: Any, namespace: Any, layers: Any,
                           rows: Any) -> tuple[bytes, bytes, Location, Any]:
        """``_locate`` with the remote tier: (ns, k, location, None) to read locally, or (ns, k,
        location of the fetched record, its reader) for an object the remote holds newer."""
        self._check_open()
        assert self._remote is not None
        ns = encode_namespace(namespace)
        k, _ = encode_key(key)
        loc = self._engine.lookup(ns, k)
        if loc is None:  # nothing to compare: fetch at once (one round trip fewer)
            loc, fetched = self._reconcile(ns, k, None, None, layers, rows, ask=False)
        else:
            try:
                st = self._remote.state(ns, k)
            except RemoteDown:
                st = None
            loc, fetched = self._reconcile(ns, k, loc, st, layers, rows)
        if loc is None:
            raise NotFound(f"no object {key!r} in namespace {namespace!r}", key=key, namespace=namespace,
                           hint_from=functools.partial(self._elsewhere, k, ns))
        return ns, k, loc, fetched

    def _reconcile(self, ns: bytes, k: bytes, loc: Location | None, st: Remote | None, layers: Any,
                   rows: Any, *, ask: bool = True) -> tuple[Location | None, Any]:
        """The rule of SPEC.md §14.4: serve the local copy unless the remote holds a newer
        version; a newer tombstone removes the local copy (NotFound); a newer object is fetched,
        checked, cached in the local log (a read of some ``layers`` / ``rows`` of an object not
        held locally fetches only their extents and caches nothing) and served from the fetched bytes.  A remote
        that fails, or holds a damaged value, leaves the local answer standing.  ``st`` is the
        remote's state of the key; without ``ask`` (no local copy) it is not known, and fetched."""
        remote = self._remote
        assert remote is not None
        mine = version_of(loc.header) if loc is not None else None
        ended = self._deletes_ended  # (before the fetch: a delete in progress then, or begun since,
        deletes = self._deletes_begun if self._deletes_begun == ended else -1  # cancels keeping the copy)
        tomb = remote.queue.tombstone_of(ns, k) if loc is None else None
        if tomb is not None and (not ask or st is None or st.version <= tomb):
            return None, None  # deleted here, the tombstone not yet sent: the delete is the local version
        if ask:
            if st is None or (mine is not None and st.version <= mine):
                return loc, None
            if st.tombstone:
                self._drop_stale(ns, k, loc)
                return None, None
        ranged = (layers is not None or rows is not None) and loc is None
        try:
            if ranged:
                got = remote.fetch_extents(ns, k, functools.partial(wanted_extents, layers=layers, rows=rows))
            else:
                got = remote.fetch(ns, k)
        except RemoteDown:
            return loc, None
        if got is None:
            return loc, None
        env, reader = got
        if mine is not None and env.version <= mine:
            return loc, None
        if reader is None:
            self._drop_stale(ns, k, loc)
            return None, None
        if mine is not None:
            remote.count("stale")
        if not ranged:  # kept in the background: the caller gets the bytes without waiting for the log
            if self._tiers is not None:
                self._tiers.submit(self._cache_fetched, ns, k, reader, mine, deletes)
            else:
                self._cache_fetched(ns, k, reader, mine, deletes)
        return Location(0, 0, reader.hdr), reader

    def _drop_stale(self, ns: bytes, k: bytes, loc: Location | None) -> None:
        """Another node deleted the object after the version held here: delete the local copy
        (no tombstone to send: the remote has it)."""
        if loc is None or self.readonly:
            return
        engine = self._engine
        with engine.write_lock:
            cur = engine.lookup(ns, k)
            if cur is None or version_of(cur.header) != version_of(loc.header):
                return
            where = engine.append_group(engine.deletion(ns, k, loc.header.flags & fmt.FLAG_KEY_STR))
        engine.settle_later(where)
        assert self._remote is not None
        self._remote.count("stale")

    def _cache_fetched(self, ns: bytes, k: bytes, reader: Any, mine: Version | None, deletes: int) -> None:
        """Keep a fetched record in the local log (its bytes as fetched, with a local LSN) unless
        the local copy changed since the fetch was decided (``mine``: its version then, None for
        none) or a delete was in progress then or began since (``deletes``: ``_deletes_begun``
        then, -1 if a delete was in progress; a delete of a key held only by the server writes
        nothing here, so only this says it happened).  Durable with the log's next sync: a cache
        copy."""
        if self.readonly or self._closed:
            return
        engine = self._engine
        try:
            record = reader.record()
            with self._room_for(record.header.record_len), engine.write_lock:
                cur = engine.lookup(ns, k)
                if (version_of(cur.header) if cur is not None else None) != mine or self._deletes_begun != deletes \
                        or deletes < 0:
                    return
                where = engine.append(record)
            engine.settle_later(where)
            for w in self._watchers:
                w.admitted(ns, k, record.header.record_len, (), tokens_of(record.header))
        except StoreFull:  # no room for a copy: served from the fetched bytes, not kept
            assert self._remote is not None
            self._remote.count("not_cached")

    def _read_fetched(self, reader: Any, ns: bytes, *, layers: Any, rows: Any, device: str | None,
                      out: Any, delivered: bool = True) -> Any:
        """An object (or its layers / rows) from a fetched record (checksums verified at fetch);
        ``delivered=False``: not counted as a get (``stream_layers`` counts its call once)."""
        hdr = reader.hdr
        out, device = _destination(hdr, layers, rows, out, device)
        dicts = None if hdr.codec == fmt.CODEC_RAW else functools.partial(self._dictionary, ns)
        obj = blk.read_object(hdr, reader, layers=layers, rows=rows, device=device, dictionaries=dicts, out=out)
        if out is not None and not isinstance(out, blk.LayerDest) and obj.data is not out:
            arrays.copy_into(out, obj.data)
            obj.data = out
        return self._delivered(obj, Location(0, 0, hdr), layers, rows) if delivered else obj

    def _remote_has(self, ns: bytes, ks: list[bytes], *, raise_down: bool = False, sound: bool = True) -> list[bool]:
        """Whether the remote holds an object (not a tombstone) for each key; False where it
        does not answer (``raise_down``: RemoteDown instead).  ``sound``: not counting values
        known damaged (``RemoteTier.states``)."""
        remote = self._remote
        if remote is None or not ks:
            return [False] * len(ks)
        # deletes made here and not yet sent, read before the server is asked: one sent between
        # the two is then on the server when it answers (read after, it could be in neither)
        tombs = [remote.queue.tombstone_of(ns, k) for k in ks]
        try:
            states = remote.states(ns, ks, sound=sound)
        except RemoteDown:
            if raise_down:
                raise
            return [False] * len(ks)
        return [st is not None and not st.tombstone and (t is None or st.version > t) for st, t in zip(states, tombs)]

    def _delivered(self, obj: Any, loc: Location, layers: Any, rows: Any) -> Any:
        """A read object, given its user metadata and counted."""
        user_meta = loc.header.meta.get("meta")
        if user_meta:
            obj.meta = copy.deepcopy(user_meta)  # the caller's to change: not the cached header's
        counters = self._counters
        counters["gets"] += 1
        for w in self._watchers:
            w.touched(loc.header.namespace, loc.header.key, loc.header.record_len, tokens_of(loc.header))
        lengths = loc.header.extent_lengths
        counters["bytes_read"] += sum(lengths) if layers is None and rows is None else \
            sum(lengths[i] for i in wanted_extents(loc.header, layers, rows))
        return obj

    def get_many(self, keys: Any, *, namespace: str = "default", layers: Any = None, rows: Any = None,
                 device: str | None = None, out: Any = None) -> list[KVCache | MLACache | Vectors | Blob | None]:
        """``get`` of many keys of ``namespace``: a list in the order of ``keys``, None where a
        key does not exist (a miss is an answer here, as in Redis' MGET).  The keys are looked
        up in one index snapshot and read in it (a ``put_many`` group is read in one version,
        even if it is replaced and compacted meanwhile); small blobs stored near each other are read with one system
        call per run; larger objects that no memory tier holds are read side by side on a few
        threads (one object's device read overlaps another's checksum and copy).
        ``layers`` / ``rows`` / ``device`` apply to every key.  ``out``: a list with one
        destination per key, as ``get`` takes it (None: a new array), all checked before any
        I/O, each against its object and against the others (two keys' destinations that share
        memory are refused); a missing key's destination is neither checked nor written.  Any
        other error (CorruptionError, bad arguments) raises, as ``get`` does, once every read
        has ended: the error of the first key (in the order of ``keys``) that failed; the
        objects of the keys before it were read whole.  Never wrong data."""
        self._check_open()
        if device is not None:
            if out is not None:
                raise InvalidObject("get_many(device=..., out=...): out= already says where the data goes")
            arrays.validate_device(device)
        keys = key_list(keys, "get_many", "get(key) reads one")
        if out is not None and (not isinstance(out, (list, tuple)) or len(out) != len(keys)):
            raise InvalidObject(f"get_many: out= must be a list with one destination (or None) per key: "
                                f"{len(keys)} key{'s' * (len(keys) != 1)}, got {type(out).__name__}"
                                + (f" of {len(out)}" if isinstance(out, (list, tuple)) else ""))
        ns = encode_namespace(namespace)
        ks = key_bytes(keys)
        locs, held = self._held_snapshot(ns, ks)
        with held:
            return self._get_many_at(keys, namespace, ns, ks, locs, layers=layers, rows=rows, device=device, out=out)

    def _held_snapshot(self, ns: bytes, ks: list[bytes]) -> tuple[list[Location | None], Any]:
        """The keys' locations in one index snapshot, with their segments held open
        (``Engine.hold_segments``) until the batch's reads end: compaction moving the objects
        meanwhile cannot send one key's read to a newer version while another read the
        snapshot's (a ``put_many`` group is read whole in one version).  A segment already gone
        when held: the snapshot is taken again."""
        engine = self._engine
        for _ in range(3):
            locs = engine.lookup_many(ns, ks)
            try:
                return locs, engine.hold_segments(loc.segment for loc in locs if loc is not None)
            except FileNotFoundError:
                continue
        return locs, contextlib.nullcontext()  # (compaction keeps racing: each read follows its object)

    def _get_many_at(self, keys: list[Any], namespace: str, ns: bytes, ks: list[bytes], locs: list[Location | None],
                     *, layers: Any, rows: Any, device: str | None, out: Any) -> list[Any]:
        """``get_many`` of the located keys (their segments held)."""
        result: list[Any] = [None] * len(keys)
        for w in self._watchers:
            w.missed(ns, [k for k, loc in zip(ks, locs) if loc is None])
        dests: list[Any] = [None] * len(keys)
        if out is not None:  # every destination checked before anything is read, and apart from the others
            for n, loc in enumerate(locs):
                if loc is not None and out[n] is not None:
                    try:
                        dests[n] = _destination(loc.header, layers, rows, out[n], None)
                    except TierstoreError as e:
                        e.key = keys[n] if e.key is None else e.key
                        raise
            given = [(n, keys[n], d[0]) for n, d in enumerate(dests) if d is not None]
            if len(given) > 1:
                blk.check_apart(given)
        if device is not None and device.split(":")[0] == "cuda" and ":" not in device:
            torch = arrays.torch_module()  # the caller's current device, not the reader threads'
            if torch.cuda.is_available():
                device = f"cuda:{torch.cuda.current_device()}"
        if self._remote is not None:  # one pipeline of versions, then the rule of _reconcile per key
            try:
                states = self._remote.states(ns, ks)
            except RemoteDown:
                states = [None] * len(ks)
            else:  # held nowhere (or deleted everywhere): misses, as a get's fetch counts them
                self._remote.count("misses", sum(1 for st, loc in zip(states, locs)
                                                 if loc is None and (st is None or st.tombstone)))
            for n, st in enumerate(states):
                locs[n], fetched = self._reconcile(ns, ks[n], locs[n], st, layers, rows)
                if fetched is not None:
                    result[n] = self._read_fetched(fetched, ns, layers=layers, rows=rows, device=device,
                                                   out=None if out is None else out[n])
                    locs[n] = None
        batch = []  # small raw blobs the tiers leave to the log: read together
        aside = []  # larger objects only the log holds: read side by side
        plain = layers is None and rows is None and device is None
        tiers = self._tiers
        assert tiers is not None
        passes_by = tiers.passes_by if tiers.active else None
        for n, loc in enumerate(locs):  # (_small_blob's test, inline: the loop of a 4 KiB get_many)
            if loc is None:
                continue
            h = loc.header
            if plain and h.kind == fmt.KIND_BLOB and h.codec == fmt.CODEC_RAW and h.record_len <= SMALL_READ \
                    and (passes_by is None or passes_by((ns, ks[n]), h)):
                batch.append(n)
            elif passes_by is None or not tiers.where((ns, ks[n]), h):
                aside.append(n)
        in_batch = set(batch)
        errors: dict[int, BaseException] = {}

        def read(n: int) -> Any:
            dest, dev = dests[n] if dests[n] is not None else (None, device)
            try:  # (a destination was checked against this very object: a replaced one is a miss)
                obj, locs[n] = self._read(keys[n], namespace, ns, ks[n], locs[n], same=dest is not None,
                                          layers=layers, rows=rows, device=dev, out=dest)
            except NotFound:
                locs[n] = None
                return None
            if dest is not None and not isinstance(dest, blk.LayerDest) and obj.data is not dest:
                arrays.copy_into(dest, obj.data)
                obj.data = dest
            return obj

        futures: dict[int, Future] = {}
        try:
            if len(aside) > 1:
                pool = tiers.readers()
                for n in aside:
                    try:
                        futures[n] = submit(pool, read, n)
                    except RuntimeError:  # (the pool was shut down: closed meanwhile)
                        raise StoreClosed("the store was closed during get_many", path=self.path) from None
            for n, loc in enumerate(locs):
                if loc is None or n in futures or n in in_batch:
                    continue
                try:
                    result[n] = read(n)
                except TierstoreError as e:
                    errors[n] = e
                    break  # (the first failure in key order is below every later one)
            if batch and not (errors and min(errors) < batch[0]):  # (a blob may be the first failure)
                try:
                    blobs = self._read_small_blobs([keys[n] for n in batch], namespace, ns, [ks[n] for n in batch],
                                                   [locs[n] for n in batch])  # type: ignore[misc]
                except TierstoreError as e:  # (named by its key)
                    errors[next((n for n in batch if keys[n] == e.key), batch[0])] = e
                else:
                    for n, blob in zip(batch, blobs):
                        result[n] = blob
        finally:
            for f in futures.values():  # every read ends before the call returns or raises (one
                try:  # at a time: wait() never wakes for a future that close() cancelled)
                    f.exception()
                except CancelledError:
                    pass
        for n, f in futures.items():
            try:
                result[n] = f.result()
            except TierstoreError as e:
                errors[n] = e
            except CancelledError:  # the store was closed meanwhile
                raise StoreClosed("the store was closed during get_many", path=self.path) from None
        if errors:
            raise errors[min(errors)]
        for n, loc in enumerate(locs):
            if result[n] is not None and loc is not None and n not in in_batch:
                result[n] = self._delivered(result[n], loc, layers, rows)
        return result

    def _small_blob(self, ns: bytes, k: bytes, h: rec.RecordHeader) -> bool:
        """Whether a whole-object read of this record may skip the tiers and the decoder: a raw
        blob small enough for the page cache that no tier holds or would admit."""
        if h.kind != fmt.KIND_BLOB or h.codec != fmt.CODEC_RAW or h.record_len > SMALL_READ:
            return False
        return self._tiers is None or self._tiers.passes_by((ns, k), h)

    def _read_small_blob(self, key: Any, namespace: str, ns: bytes, k: bytes, loc: Location) -> Blob:
        """One blob chosen by ``_small_blob``: one ``pread`` of its extent (``Engine.read_extent0``)."""
        try:
            data = self._engine.read_extent0(loc)
        except FileNotFoundError:  # compaction moved it meanwhile: the long way, following it
            return self._delivered(*self._read(key, namespace, ns, k, loc), None, None)
        except CorruptionError as e:
            e.key, e.namespace = key, namespace
            raise
        return self._delivered(stored_blob(data, loc.header.meta["media_type"]), loc, None, None)

    def _read_small_blobs(self, keys: list[Any], namespace: str, ns: bytes, ks: list[bytes],
                          locs: list[Location]) -> list[Blob | None]:
        """Blobs chosen by ``_small_blob``, read together (``Engine.read_first_extents``) and
        counted as ``_delivered`` counts them, once for the batch; None for a key deleted while
        it was read (the batch is then read one by one).  A damaged blob raises CorruptionError
        naming the first such key in the order of ``keys``."""
        try:
            datas = self._engine.read_first_extents(locs, lambda n: {
                "segment": locs[n].segment, "offset": locs[n].offset, "key": keys[n], "namespace": namespace})
        except FileNotFoundError:  # compaction moved some meanwhile: one by one, following them
            out: list[Blob | None] = []
            for key, k, loc in zip(keys, ks, locs):
                try:
                    out.append(self._delivered(*self._read(key, namespace, ns, k, loc), None, None))
                except NotFound:  # (deleted meanwhile: a miss, as get_many answers one)
                    out.append(None)
            return out
        except CorruptionError as e:
            if e.path is None and e.segment is not None:
                e.path = self._engine.segment_path(e.segment)
            raise
        blobs = []
        for data, loc in zip(datas, locs):
            meta = loc.header.meta
            blob = stored_blob(data, meta["media_type"])
            if meta.get("meta"):
                blob.meta = copy.deepcopy(meta["meta"])
            blobs.append(blob)
        counters = self._counters
        counters["gets"] += len(blobs)
        counters["bytes_read"] += sum([len(data) for data in datas])  # (a raw blob: one extent, all read)
        for w in self._watchers:
            for loc in locs:
                w.touched(ns, loc.header.key, loc.header.record_len, 0)
        return blobs

    def contains_many(self, keys: Any, *, namespace: str = "default") -> list[bool]:
        """``contains`` of many keys of ``namespace`` in one index snapshot: a list of bools."""
        self._check_open()
        ks = key_bytes(key_list(keys, "contains_many", "contains(key) asks about one"))
        ns = encode_namespace(namespace)
        found = self._engine.contains_many(ns, ks)
        if self._remote is not None and not all(found):
            elsewhere = iter(self._remote_has(ns, [k for k, f in zip(ks, found) if not f]))
            found = [f or next(elsewhere) for f in found]
        return found

    def _read(self, key: Any, namespace: str, ns: bytes, k: bytes, loc: Location, *, same: bool = False,
              **sel: Any) -> tuple[Any, Location]:
        """Read the object at ``loc`` (through the tiers when the store has them); returns it and
        the location it was read at (another one if compaction moved it meanwhile, or if it
        was replaced then, unless ``same``): the header that describes what was read."""
        sel.setdefault("layers", None)
        sel.setdefault("rows", None)
        sel.setdefault("device", None)
        dicts = None if loc.header.codec == fmt.CODEC_RAW else functools.partial(self._dictionary, ns)

        def read(at: Location, where: dict[str, Any]) -> tuple[Any, Location]:
            if self._tiers is not None and self._tiers.active:
                return self._tiers.read(ns, k, at, where, dictionaries=dicts, **sel), at
            return blk.read_object(at.header, self._engine.reader(at, where), dictionaries=dicts, **sel), at

        try:
            return self._follow(key, namespace, ns, k, loc, read, same=same)
        except InvalidObject as e:  # a selection that does not apply to this object: name it
            if e.key is None:
                e.key, e.namespace = key, namespace
            raise

    def _follow(self, key: Any, namespace: str, ns: bytes, k: bytes, loc: Location,
                fn: Callable[[Location, dict[str, Any]], Any], *, same: bool = False) -> Any:
        """``fn(location, where)`` at the object's location; if compaction moved the object
        meanwhile (its old segment is gone: FileNotFoundError), look the key up again and retry
        there (with ``same``: only while it is still the same object, else NotFound).  Errors
        name the segment file."""
        engine = self._engine
        for attempt in range(3):
            where = {"segment": loc.segment, "offset": loc.offset, "key": key, "namespace": namespace}
            try:
                return fn(loc, where)
            except FileNotFoundError:
                if attempt == 2:
                    raise CorruptionError("segment file missing", path=engine.segment_path(loc.segment),
                                          **where) from None
                new = engine.lookup(ns, k)
                if new is None:
                    raise NotFound(f"no object {key!r} in namespace {namespace!r}", key=key,
                                   namespace=namespace) from None
                if same and not rec.same_object(new.header, loc.header):
                    raise NotFound(f"object {key!r} in namespace {namespace!r} was replaced while it was read",
                                   key=key, namespace=namespace) from None
                loc = new
            except CorruptionError as e:
                if e.path is None:
                    e.path = engine.segment_path(loc.segment)
                raise
            except OSError as e:
                if isinstance(e, TierstoreError):
                    raise
                raise io_error(e, "read", path=engine.segment_path(loc.segment), **where) from None
        raise AssertionError("unreachable")

    def contains(self, key: str | bytes, *, namespace: str = "default") -> bool:
        """Whether ``key`` exists in ``namespace``."""
        self._check_open()
        ns = encode_namespace(namespace)
        k, _ = encode_key(key)
        return self._engine.lookup(ns, k) is not None or self._remote_has(ns, [k])[0]

    def __contains__(self, key: str | bytes) -> bool:
        return self.contains(key)

    def keys(self, *, namespace: str = "default", prefix: str | bytes | None = None,
             after: str | bytes | None = None, limit: int | None = None) -> list[str | bytes]:
        """The keys in ``namespace`` (str keys come back as str, bytes keys as bytes), sorted by
        their UTF-8 / raw bytes.  ``prefix``: only keys whose bytes start with its bytes (a str
        prefix by its UTF-8).  ``after`` and ``limit`` page through a large namespace: the
        first ``limit`` keys sorted after the key ``after`` (give the last key of a page to get
        the next; each page is one index read, not a listing of the whole namespace)::

            page = store.keys(namespace="chat", limit=1000)
            while page:
                ...
                page = store.keys(namespace="chat", after=page[-1], limit=1000)
        """
        self._check_open()
        ns = encode_namespace(namespace)
        if prefix is None:
            pre = b""
        elif isinstance(prefix, str):
            try:
                pre = prefix.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidObject(f"prefix {prefix!r} is not valid UTF-8 text (a lone surrogate)") from None
        elif isinstance(prefix, (bytes, bytearray, memoryview)):
            pre = bytes(prefix)
        else:
            raise InvalidObject(f"prefix must be a str or bytes, got {type(prefix).__name__}")
        try:
            start = None if after is None else encode_key(after)[0]
        except InvalidObject as e:
            raise InvalidObject(f"after must be a key (the last of the previous page; None: from the first): "
                                f"{e.message}") from None
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            raise InvalidObject(f"limit must be an int >= 0 (or None: every key), got {limit!r}")
        found = self._engine.keys(ns, prefix=pre, after=start, limit=limit)
        return [decode_key(k, flags) for k, flags in found.items()]

    def sessions(self, *, namespace: str = "default") -> list[str]:
        """The sessions holding a reference on at least one object of ``namespace``
        (``put(..., session=)``; ``drop_session`` releases them), sorted."""
        self._check_open()
        return [s.decode("utf-8") for s in self._engine.sessions(encode_namespace(namespace))]

    def namespaces(self) -> list[str]:
        """Namespaces holding at least one object."""
        self._check_open()
        return [n.decode("utf-8") for n in self._engine.namespaces()]

    def info(self, key: str | bytes, *, namespace: str = "default") -> ObjectInfo:
        """Describe a stored object without reading its payload.  With a remote tier, an object
        only the server holds is described from its header (fetched alone; ``tiers`` is
        ``("remote",)``, ``segment`` and ``offset`` are None)."""
        tiers: tuple[str, ...] | None = None
        try:
            ns, k, loc = self._locate(key, namespace, read=False)
        except NotFound:
            if self._remote is None:
                raise
            ns, k = encode_namespace(namespace), encode_key(key)[0]
            try:
                got = self._remote.fetch_extents(ns, k, lambda h: [])
            except RemoteDown:
                got = None
            tomb = self._remote.queue.tombstone_of(ns, k)  # deleted here, the tombstone not yet sent
            if got is None or got[1] is None or tomb is not None and got[0].version <= tomb:
                raise
            loc, tiers = Location(None, None, got[1].hdr), ("remote",)  # type: ignore[arg-type]
        h = loc.header
        if tiers is None:
            tiers = (*self._tiers.where((ns, k), h), "ssd") if self._tiers is not None else ("ssd",)
        sessions = tuple(x.decode("utf-8", "replace") for x in cache_sessions(self._engine, ns, k))
        meta = h.meta
        kind = fmt.KIND_NAMES[h.kind]
        dtype = fmt.DTYPES[meta["dtype"]][0] if "dtype" in meta else None
        shape = tuple(meta["shape"]) if "shape" in meta else ()
        return ObjectInfo(
            namespace=namespace, key=decode_key(h.key, h.flags), kind=kind, shape=shape, dtype=dtype,
            logical_bytes=sum(rec.expected_extent_lengths(h.kind, meta)), stored_bytes=h.record_len,
            codec=cdc.Choice(cdc.BY_ID[h.codec], meta.get("codec_params", {})).spec,
            lossless=cdc.BY_ID[h.codec].lossless, bound=cdc.BY_ID[h.codec].bound_for(meta.get("codec_params", {})),
            checksum=f"crc32c:{h.header_crc:08x}", extent_checksums=h.extent_crcs,
            tiers=tiers, lsn=h.lsn, segment=loc.segment, offset=loc.offset, layer_start=meta.get("layer_start"),
            metric=meta.get("metric"), media_type=meta.get("media_type"),
            has_ids=meta.get("ids") if h.kind == fmt.KIND_VECTORS else None,
            meta=copy.deepcopy(meta.get("meta", {})),  # the caller's to change: not the cached header's
            sessions=sessions,
        )

    def stats(self) -> dict[str, Any]:
        """Counters and sizes: objects, segments, bytes live/dead, log position, tiers."""
        self._check_open()
        engine = self._engine.stats()
        return {
            "path": self.path,
            "readonly": self.readonly,
            "durability": self.durability,
            **engine,
            "counters": {**self._counters, **engine.pop("counters")},
            "recovery": dict(self.recovery),
            # bytes_used: what ssd_bytes would bound (segments, index, reserve), with a budget or without
            "tiers": {"ssd": {"bytes_used": self._engine.disk_bytes(), "capacity_bytes": None, "io_path": "posix",
                              **(self._capacity.stats() if self._capacity is not None else {})},
                      **{name: t.stats() for name, t in (self._tiers.tiers().items() if self._tiers else ())},
                      **({"remote": self._remote.stats()} if self._remote is not None else {})},
        }

    # -- cache tiers ----------------------------------------------------------------------------

    def _cache_tier(self, tier: str) -> Any:
        self._check_open()
        assert self._tiers is not None
        return self._tiers.tier(tier)

    def _promote(self, tier: str, key: Any, namespace: str, ns: bytes, k: bytes, loc: Location, layers: Any) -> int:
        assert self._tiers is not None
        tiers, dicts = self._tiers, functools.partial(self._dictionary, ns)
        return self._follow(key, namespace, ns, k, loc,
                            lambda at, where: tiers.promote(tier, ns, k, at, where, layers, dicts))

    def prefetch(self, keys: Any, *, namespace: str = "default", tier: str = "dram", layers: Any = None) -> Future:
        """Promote objects into ``tier`` ("dram" or "gpu") in the background.

        ``keys``: one key or an iterable of keys; ``layers``: only those layers of KV objects.
        Returns a ``concurrent.futures.Future`` whose result is the bytes ``tier`` holds for
        them once done; its exception is NotFound for a missing key, StoreFull if the tier
        cannot make room (pinned entries are never evicted).  A ``get`` meanwhile is served
        from wherever the bytes are: it never waits for the prefetch.
        """
        self._cache_tier(tier)
        ns = encode_namespace(namespace)
        if isinstance(keys, (str, bytes, bytearray, memoryview)):
            keys = [keys]
        todo = [(key, encode_key(key)[0]) for key in keys]
        assert self._tiers is not None
        return self._tiers.submit(self._prefetch_now, tier, namespace, ns, todo, layers)

    def _prefetch_now(self, tier: str, namespace: str, ns: bytes, todo: list[tuple[Any, bytes]], layers: Any,
                      gone_ok: bool = False) -> int:
        """Promote ``todo``; with ``gone_ok`` (a session's objects, listed by the store, not by
        the caller) an object deleted or evicted since it was listed is skipped."""
        total = 0
        for key, k in todo:
            loc = self._engine.lookup(ns, k)
            try:
                if loc is None:
                    raise NotFound(f"no object {key!r} in namespace {namespace!r}", key=key, namespace=namespace)
                total += self._promote(tier, key, namespace, ns, k, loc, layers)
            except NotFound:
                if not gone_ok:
                    raise
        return total

    def prefetch_session(self, session: str, *, namespace: str = "default", tier: str = "dram") -> Future:
        """A new turn of ``session`` arrived: tell the tier's policy the session is active and
        promote every object it references (AttentionStore's session prefetch).  Returns the
        Future of ``prefetch``; an object deleted or evicted before its turn is skipped (the
        store listed it, not the caller)."""
        t = self._cache_tier(tier)
        sess = encode_session(session)
        with t.lock:
            t.policy.session_active(session_id(encode_namespace(namespace), sess))
        for w in self._watchers:
            w.session_active(encode_namespace(namespace), sess)
        ns = encode_namespace(namespace)
        todo = [(key, encode_key(key)[0]) for key in self.session_keys(session, namespace=namespace)]
        assert self._tiers is not None  # (an object deleted or evicted before its turn is skipped)
        return self._tiers.submit(self._prefetch_now, tier, namespace, ns, todo, None, True)

    def stream_layers(self, key: str | bytes, *, namespace: str = "default", device: str | None = None,
                      layers: Any = None) -> Iterator[tuple[int, Any]]:
        """Yield ``(layer_id, kv_layer)`` for each layer of a KVCache (or of ``layers``), in
        order; ``kv_layer`` is shaped [2, kv_heads, tokens, head_dim] (K, V), on ``device``
        (an MLACache's layers: [tokens, dim]).

        Layer i+1 is being read (from the nearest tier, promoting by policy) while the
        caller uses layer i.  Every layer comes from the one version of the object found
        when the call was made; if compaction or eviction removes that version meanwhile, the
        layers not yet read raise NotFound instead (never a mix of versions).  Bad arguments
        raise here, before anything is read.
        """
        if device is not None:
            arrays.validate_device(device)
        fetched = None
        if self._remote is None:
            ns, k, loc = self._locate(key, namespace)
        else:  # as get: another node's overwrite or delete is seen, an object only the server holds is read
            ns, k, loc, fetched = self._locate_everywhere(key, namespace, None, None)
        hdr = loc.header
        if hdr.kind not in fmt.LAYERED_KINDS:
            raise InvalidObject(f"stream_layers reads a KVCache or an MLACache; {key!r} is a "
                                f"{fmt.KIND_NAMES[hdr.kind]}")
        start = hdr.meta["layer_start"]
        count = hdr.meta["shape"][0]
        pos = list(range(count)) if layers is None else blk.select_layers(layers, start, count)
        counters = self._counters
        counters["gets"] += 1  # (a read: the policies and a trace are told, as of a get)
        for w in self._watchers:
            w.touched(hdr.namespace, hdr.key, hdr.record_len, tokens_of(hdr))

        def read_layer(lid: int) -> Any:
            if fetched is not None:  # (the whole record, fetched and checked once)
                data = self._read_fetched(fetched, ns, layers=lid, rows=None, device=device, out=None,
                                          delivered=False).data[0]
            else:
                data = self._read(key, namespace, ns, k, loc, same=True, layers=lid, rows=None,
                                  device=device)[0].data[0]
            counters["bytes_read"] += sum(hdr.extent_lengths[i] for i in wanted_extents(hdr, lid, None))
            return data

        assert self._tiers is not None
        return self._streamed(self._tiers.stream([start + p for p in pos], read_layer))

    def _streamed(self, layers: Iterator[tuple[int, Any]]) -> Iterator[tuple[int, Any]]:
        """``stream_layers``' layers; once the store is closed, StoreClosed (its reader threads are
        gone: a read is refused, one in flight cancelled)."""
        try:
            yield from layers
        except (RuntimeError, CancelledError):
            if not self._closed:
                raise
            raise StoreClosed("the store was closed while its layers were streamed", path=self.path) from None

    def pin(self, key: str | bytes, *, namespace: str = "default", tier: str = "dram", layers: Any = None) -> None:
        """Promote the object into ``tier`` (now) and keep it there until ``unpin``: a pinned
        object is never evicted.  Pins count: pin twice, unpin twice.  StoreFull if the tier
        cannot make room.  If the key is later overwritten, the pin stays on the key and the
        new object is kept once something promotes it.  Prefer ``with store.pinned(...)``."""
        t = self._cache_tier(tier)
        # with a budget, an eviction checks each victim for a pin under the write lock, just before
        # its delete: it sees the pin, or the key is gone
        with self._engine.write_lock if self._capacity is not None else contextlib.nullcontext():
            ns, k, loc = self._locate(key, namespace, read=False)
            t.pin((ns, k))
        try:
            self._promote(tier, key, namespace, ns, k, loc, layers)
        except BaseException:
            t.unpin((ns, k))
            raise

    def unpin(self, key: str | bytes, *, namespace: str = "default", tier: str = "dram") -> None:
        """Release one pin taken by ``pin``; InvalidObject if the key holds no pin in ``tier``."""
        t = self._cache_tier(tier)
        ns, (k, _) = encode_namespace(namespace), encode_key(key)
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

    def drop_cached(self, *, tier: str | None = None) -> None:
        """Empty the cache tiers (or only ``tier``, "dram" or "gpu") of every unpinned copy; the
        log is untouched, so the next read of an object comes from the segments (a cold read)."""
        self._check_open()
        assert self._tiers is not None
        for t in ([self._tiers.tier(tier)] if tier is not None else self._tiers.tiers().values()):
            t.clear()

    # -- maintenance --------------------------------------------------------------------------

    def compact(self, *, min_dead_ratio: float = 0.0, progress: Any = None) -> dict[str, Any]:
        """Rewrite the live records of sealed segments holding dead bytes, then delete them.

        Crash-safe at every step: copies are appended to the log and synced, the index is
        repointed in one durable transaction, and only then are old segments unlinked.
        Writers are paused only while each record is copied.  Returns what was done.
        ``progress(n)``, if given, is called with the bytes of each batch of victims compacted.
        """
        self._check_writable()
        if isinstance(min_dead_ratio, bool) or not isinstance(min_dead_ratio, (int, float)) \
                or not 0 <= min_dead_ratio <= 1:
            raise InvalidObject(f"min_dead_ratio must be a share of a segment's bytes in [0, 1], got "
                                f"{min_dead_ratio!r}")
        given = self._engine.reserve_released  # (the committer may give the reserve up meanwhile)
        for attempt in (0, 1):
            try:
                # under a budget, victims go a slack at a time: the copies of a batch land before they go
                batch = {} if self._capacity is None else {"batch_bytes": self._capacity.slack}
                result = compaction.compact(self._engine, min_dead_ratio=min_dead_ratio, progress=progress, **batch)
                self._engine.ensure_reserve()  # space was reclaimed: hold the reserve again
                return result
            except StoreFull:  # a full disk: give up the reserve (once) and go on, it frees more than it takes
                if attempt or not self._engine.release_reserve(given):
                    raise
            except OSError as e:
                if isinstance(e, TierstoreError):
                    raise
                raise io_error(e, "compact", path=self.path) from None
        raise AssertionError("unreachable")
