"""The cache hierarchy over the log: GPU tier -> DRAM tier -> SSD segments.

Read path with tiers:  Store.get -> Hierarchy.read -> (GPU tier hit: one device copy)
    | (DRAM tier hit: copy out of the cached extents, decode if the record has a codec)
    | (miss: promote the wanted extents into the nearest tier -- from DRAM, or from the
       segment file by kvikio (GDS) or preadv -- then serve as a hit; if the tier cannot make
       room, read straight from the segment as a store without tiers does).

It owns promotion (SSD -> DRAM, SSD or DRAM -> GPU), demotion (an entry evicted from the
GPU tier is copied back to DRAM when its bytes are the stored bytes and there is room),
``prefetch`` / ``stream_layers`` scheduling on its own threads, and invalidation when a
key's object changes (it subscribes to the engine's writes).  It reads the log through the
engine's read interface (``reader``, ``hold_segment``, ``segment_path``) and never writes
to it: the segments are the durable home of every object and a tier only ever holds copies
(DRAM -> SSD is not a write-back path).
"""

from __future__ import annotations

import ctypes
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from .. import arrays
from .. import codecs as cdc
from ..engine.engine import Engine
from ..engine.index import Location
from ..engine.threads import shut, submit
from ..errors import InvalidObject, StoreClosed
from ..format import block as blk
from ..format import constants as fmt
from ..format import record as rec
from ..format.layout import extent_codec, extent_shapes
from . import policy as pol
from .devio import DeviceIO
from .tier import Entry, Tier

CACHE_TIERS = ("dram", "gpu")
READERS = 4  # threads reading one get_many's objects from the log side by side


def wanted_extents(hdr: rec.RecordHeader, layers: Any, rows: Any) -> list[int]:
    """The extents a get of ``layers`` / ``rows`` needs (validating them, before any I/O)."""
    meta = hdr.meta
    if hdr.kind in fmt.LAYERED_KINDS:
        if rows is not None:
            raise InvalidObject("rows= applies to Vectors; use layers= for a KVCache or an MLACache")
        count = meta["shape"][0]
        return list(range(count)) if layers is None else blk.select_layers(layers, meta["layer_start"], count)
    if hdr.kind == fmt.KIND_VECTORS:
        if layers is not None:
            raise InvalidObject("layers= applies to a KVCache or an MLACache; use rows= for Vectors")
        n, rpe = meta["shape"][0], meta["rows_per_extent"]
        n_ext = -(-n // rpe)
        exts = list(range(n_ext)) if rows is None else sorted({int(e) for e in blk.select_rows(rows, n) // rpe})
        return exts + ([n_ext + e for e in exts] if meta["ids"] else [])
    if layers is not None or rows is not None:
        raise InvalidObject("layers= and rows= do not apply to a Blob")
    return [0]


def _span(addr: int, nbytes: int) -> np.ndarray:
    """A uint8 array over ``nbytes`` at ``addr`` (memory the caller keeps alive)."""
    return np.ctypeslib.as_array((ctypes.c_ubyte * nbytes).from_address(addr))


class _HostReader:
    """ExtentReader over extents cached in DRAM (stored bytes; checked when they were read).

    Extents adjacent both in the cache buffer and in the destination (a whole object read
    back, as promotion lays it out) are copied with one call: one large copy uses the C
    library's non-temporal stores, 32 copies of 1 MiB do not (measured 1.25-1.36x the time
    of one ``kv.copy()`` for a 32 MiB chunk copied extent by extent).  Copies run on the
    calling thread: splitting them over two threads was faster on average but, with other
    threads in the process, took 30-35 ms instead of 5 now and then (GIL hand-offs)."""

    def __init__(self, extents: dict[int, np.ndarray]) -> None:
        self.extents = extents

    def read_into(self, wanted: Any) -> None:
        n, k = len(wanted), 0
        while k < n:
            i, dest = wanted[k]
            src = self.extents[i]
            d0 = np.frombuffer(dest, np.uint8)
            s_addr, d_addr, total = src.ctypes.data, d0.ctypes.data if d0.size else 0, src.nbytes
            j = k + 1
            while j < n:  # extend the run while source and destination both continue
                src2 = self.extents[wanted[j][0]]
                d2 = np.frombuffer(wanted[j][1], np.uint8)
                if not d2.size or src2.ctypes.data != s_addr + total or d2.ctypes.data != d_addr + total:
                    break
                total += src2.nbytes
                j += 1
            if j == k + 1:
                np.copyto(d0, src)
            else:
                np.copyto(_span(d_addr, total), _span(s_addr, total))
            k = j

    def read_bytes(self, index: int) -> bytes:
        return self.extents[index].tobytes()

    def extent_view(self, index: int) -> np.ndarray:
        """The cached extent itself (uint8; the caller copies out of it, never into it)."""
        return self.extents[index]


class _DeviceReader:
    """The reader ``block.read_on_device`` takes, over decoded extents in the GPU tier."""

    def __init__(self, hdr: rec.RecordHeader, extents: dict[int, Any]) -> None:
        self.extents = extents
        self.shapes = extent_shapes(hdr.kind, hdr.meta)

    def read_tensor(self, i: int, device: str) -> Any:
        ext = self.shapes[i]
        return self.extents[i].view(arrays.torch_dtype(ext.dtype)).reshape(ext.shape)

    def read_bytes(self, index: int) -> bytes:
        return self.extents[index].cpu().numpy().tobytes()


class Hierarchy:
    """The DRAM and GPU tiers over one engine's log (either may be absent) and the threads filling them.

    ``sessions(ns, k)`` names the sessions referencing an object, asked when it is cached
    (the session-aware policy ranks entries by them)."""

    def __init__(self, engine: Engine, *, dram_bytes: int | None, gpu_bytes: int | None, gpu_device: str | None,
                 policy: pol.Policy, dram_admit: str = "first",
                 sessions: Callable[[bytes, bytes], tuple[bytes, ...]] = lambda ns, k: ()) -> None:
        self.engine = engine
        self.sessions = sessions
        self.admission = pol.SecondRead() if dram_admit == "second" else None  # None: every miss
        self.devio = DeviceIO(gpu_device if gpu_bytes else None)
        self.gpu_device = str(self.devio.device) if gpu_bytes else None
        self.dram = Tier("dram", dram_bytes, policy.fresh(), "posix") if dram_bytes else None
        self.gpu = Tier("gpu", gpu_bytes, policy.fresh(), self.devio.io_path, on_evict=self._demote) \
            if gpu_bytes else None
        self.executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tierstore-tiers")
        self._submitted: weakref.WeakSet[Future] = weakref.WeakSet()  # the callers' (prefetch): close reports them
        self._submitted_lock = threading.Lock()
        self._readers: ThreadPoolExecutor | None = None
        self._readers_lock = threading.Lock()
        self._closed = False

    @property
    def active(self) -> bool:
        return self.dram is not None or self.gpu is not None

    def tiers(self) -> dict[str, Tier]:
        return {t.name: t for t in (self.dram, self.gpu) if t is not None}

    def tier(self, name: str) -> Tier:
        if name not in CACHE_TIERS:
            raise InvalidObject(f"tier must be one of {', '.join(CACHE_TIERS)}, got {name!r}")
        t = self.dram if name == "dram" else self.gpu
        if t is None:
            raise InvalidObject(f"the store has no {name} tier", hint=f"open it with {name}_bytes=...")
        return t

    def close(self) -> None:
        with self._submitted_lock:
            submitted = list(self._submitted)
        shut(self.executor, submitted)
        with self._readers_lock:
            self._closed = True
            if self._readers is not None:
                shut(self._readers)

    def readers(self) -> ThreadPoolExecutor:
        """The threads that read a batch's objects from the log side by side (``get_many``):
        one object's device read overlaps another's checksum and copy.  Made on first use."""
        with self._readers_lock:
            if self._closed:
                raise StoreClosed("the store is closed")
            if self._readers is None:
                self._readers = ThreadPoolExecutor(max_workers=READERS, thread_name_prefix="tierstore-read")
            return self._readers

    # -- reading ------------------------------------------------------------------------------

    def _on_gpu(self, device: str | None) -> bool:
        if self.gpu is None or device is None:
            return False
        return str(arrays.torch_module().device(device)) == self.gpu_device

    def read(self, ns: bytes, k: bytes, loc: Location, where: dict[str, Any], *, layers: Any, rows: Any,
             device: str | None, dictionaries: Callable[[int], bytes] | None, out: Any = None) -> Any:
        """Serve a get from the nearest tier holding the extents, promoting them on a miss.
        ``out``: host memory a host read fills directly (``block.read_object``)."""
        hdr = loc.header
        wanted = wanted_extents(hdr, layers, rows)
        key = (ns, k)
        if self._on_gpu(device) and hdr.kind != fmt.KIND_BLOB:
            assert self.gpu is not None
            got = self.gpu.lookup(key, hdr, wanted)
            if got is None and self._promote_gpu(key, loc, where, wanted, dictionaries, required=False):
                got = self.gpu.lookup(key, hdr, wanted, count=False)
            if got is not None:
                return blk.read_on_device(hdr, _DeviceReader(hdr, got), device, layers, rows)
        if self.dram is not None and self._dram_serves(key, hdr, wanted):
            got = self.dram.lookup(key, hdr, wanted)
            if got is None:
                first = (self.admission is not None and key not in self.dram.entries  # holds part: admitted
                         and not self.admission.admit(key, hdr.lsn))
                if self._promote_dram(key, loc, where, wanted, required=False, probation=first):
                    got = self.dram.lookup(key, hdr, wanted, count=False)  # a first read: on probation
                else:  # no room: straight from the log
                    with self.dram.lock:
                        self.dram.counters["bytes_read_through"] += sum(hdr.extent_lengths[i] for i in wanted)
            if got is not None:
                return blk.read_object(hdr, _HostReader(got), layers=layers, rows=rows,
                                       device=device, dictionaries=dictionaries, out=out)
        return blk.read_object(hdr, self.engine.reader(loc, where), layers=layers, rows=rows, device=device,
                               dictionaries=dictionaries, out=out)

    def passes_by(self, key: Hashable, hdr: rec.RecordHeader) -> bool:
        """Whether a whole-object host read of ``key`` goes straight to the log, the tiers
        neither serving nor admitting it (small objects when the DRAM tier admits on the
        second read): a batched get may then read such objects together."""
        return self.dram is None or not self._dram_serves(key, hdr, None)

    def _dram_serves(self, key: Hashable, hdr: rec.RecordHeader, wanted: list[int] | None) -> bool:
        """Whether a get of the extents ``wanted`` (None: all) goes through the DRAM tier: always,
        unless the tier admits on the second read and this is a small read of an object it holds
        nothing of (the page cache's job)."""
        assert self.dram is not None
        if self.admission is None or key in self.dram.entries:
            return True
        small = self.admission.min_bytes
        lengths = hdr.extent_lengths
        return hdr.record_len >= small and (sum(lengths) if wanted is None else
                                            sum([lengths[i] for i in wanted])) >= small

    # -- promotion ----------------------------------------------------------------------------

    def _sessions(self, key: Hashable) -> tuple[bytes, ...]:
        """The sessions referencing the object (for the policy), asked when it is cached."""
        ns, k = key  # type: ignore[misc]
        return self.sessions(ns, k)

    def _promote_dram(self, key: Hashable, loc: Location, where: dict[str, Any], wanted: list[int],
                      *, required: bool, probation: bool = False) -> bool:
        """Read extents ``wanted`` from the segment into the DRAM tier; False if no room.
        ``probation``: a first read, held in the tier's probation share (``Tier.reserve``)."""
        tier, hdr = self.dram, loc.header
        assert tier is not None
        todo = tier.missing(key, hdr, wanted)
        if not todo:
            return True
        lengths = hdr.extent_lengths
        nbytes = sum(lengths[i] for i in todo)
        if not tier.reserve(nbytes, required=required, for_key=key, probation=probation):
            return False
        t0 = time.perf_counter()
        try:
            views = self._read_host(loc, where, todo)
        except BaseException:
            tier.release(nbytes)
            raise
        tier.insert(key, hdr, views, reserved=nbytes, sessions=self._sessions(key), seconds=time.perf_counter() - t0,
                    probation=probation)
        return True

    def _read_host(self, loc: Location, where: dict[str, Any], todo: list[int]) -> dict[int, np.ndarray]:
        """Extents ``todo`` read from the segment (checksums verified) into one new host buffer
        (pinned when a CUDA tier exists), returned as a view per extent.  One contiguous buffer,
        not one per extent: a cold read is one O_DIRECT request into it, and the kernel builds
        far fewer, larger I/Os for one (huge-page backed) buffer than for 32 small ones
        (measured: 17 ms vs 45 ms for a cold 32 MiB chunk on this machine's virtual disk)."""
        lengths = loc.header.extent_lengths
        slab = self.devio.host_buffer(sum(lengths[i] for i in todo))
        views, pos = {}, 0
        for i in todo:
            views[i] = slab[pos : pos + lengths[i]]
            pos += lengths[i]
        self.engine.reader(loc, where).read_into([(i, memoryview(v)) for i, v in views.items()])
        return views

    def _decoded_lengths(self, hdr: rec.RecordHeader) -> list[int]:
        return hdr.extent_lengths if hdr.codec == fmt.CODEC_RAW else rec.expected_extent_lengths(hdr.kind, hdr.meta)

    def _promote_gpu(self, key: Hashable, loc: Location, where: dict[str, Any], wanted: list[int],
                     dictionaries: Callable[[int], bytes] | None, *,
                     required: bool) -> bool:
        """Put extents ``wanted``, decoded, into the GPU tier: from DRAM when it holds them, else
        from the segment (kvikio into device memory for raw page-aligned extents when the
        probe found it; otherwise preadv into pinned host memory and one copy).  Lossy extents
        are decoded on the device."""
        tier, hdr = self.gpu, loc.header
        assert tier is not None
        if hdr.kind == fmt.KIND_BLOB:
            raise InvalidObject("blobs are not cached in the GPU tier (get(device=) does not apply to a Blob)")
        todo = tier.missing(key, hdr, wanted)
        if not todo:
            return True
        dec = self._decoded_lengths(hdr)
        nbytes = sum(dec[i] for i in todo)
        if not tier.reserve(nbytes, required=required, for_key=key):
            return False
        t0 = time.perf_counter()
        try:
            out = self._device_extents(key, loc, where, todo, dictionaries)
        except BaseException:
            tier.release(nbytes)
            raise
        tier.insert(key, hdr, out, reserved=nbytes, sessions=self._sessions(key), seconds=time.perf_counter() - t0)
        return True

    def _device_extents(self, key: Hashable, loc: Location, where: dict[str, Any], todo: list[int],
                        dictionaries: Callable[[int], bytes] | None) -> dict[int, Any]:
        hdr, devio = loc.header, self.devio
        host = self.dram.lookup(key, hdr, todo, count=False) if self.dram is not None else None
        if host is None and hdr.codec == fmt.CODEC_RAW and devio.io_path in ("gds", "kvikio-compat") \
                and all((loc.offset + hdr.offsets[i]) % fmt.PAGE == 0 for i in todo):
            self.engine.reader(loc, where).ensure_written()
            # kvikio opens the file by name: if compaction has unlinked it, FileNotFoundError sends
            # the caller to the object's new location (the handle looks the key up again)
            with self.engine.hold_segment(loc.segment):
                bufs = devio.read_direct(self.engine.segment_path(loc.segment),
                                         [(loc.offset + hdr.offsets[i], hdr.extent_lengths[i], hdr.extent_crcs[i])
                                          for i in todo], where)
            return dict(zip(todo, bufs))
        if host is None:  # stage through (pinned) host memory
            host = self._read_host(loc, where, todo)
        if hdr.codec == fmt.CODEC_RAW:
            return dict(zip(todo, devio.to_device([host[i] for i in todo])))
        codec = cdc.BY_ID[hdr.codec]
        params = hdr.meta.get("codec_params", {})
        shapes = extent_shapes(hdr.kind, hdr.meta)
        did = params.get("dict")
        assert dictionaries is not None  # the handle passes them for every encoded record
        dictionary = dictionaries(did) if did is not None else None
        out = {}
        for i in todo:
            c = extent_codec(codec, shapes[i])
            if c.lossless:  # zstd and friends have no device decoder: decode here, copy once
                out[i] = devio.to_device([cdc.decode(c, host[i].tobytes(), shapes[i], params, dictionary)])[0]
            else:
                out[i] = devio.tensor_to_device(cdc.decode_torch(c, host[i].tobytes(), shapes[i], params,
                                                                 self.gpu_device))
        return out

    def _demote(self, key: Hashable, e: Entry) -> None:
        """An entry left the GPU tier: keep its bytes in DRAM if they are the stored bytes
        (a raw record) and DRAM can make room without touching pinned entries."""
        dram = self.dram
        if dram is None or e.hdr.codec != fmt.CODEC_RAW or dram.holds(key, e.hdr):
            return
        nbytes = e.nbytes
        if not dram.reserve(nbytes, required=False, for_key=key):
            return
        try:
            views = {i: self.devio.host_buffer(int(buf.numel())) for i, buf in e.extents.items()}
            for i, buf in e.extents.items():
                self.devio.to_host(buf, views[i])
        except BaseException:
            dram.release(nbytes)
            raise
        dram.insert(key, e.hdr, views, reserved=nbytes, sessions=e.sessions, demoted=True)

    # -- explicit promotion -------------------------------------------------------------------

    def promote(self, tier: str, ns: bytes, k: bytes, loc: Location, where: dict[str, Any], layers: Any,
                dictionaries: Callable[[int], bytes] | None) -> int:
        """Make ``tier`` hold the object (or its ``layers``); StoreFull if it cannot.  Returns
        the bytes the tier holds for it afterwards."""
        t = self.tier(tier)
        wanted = wanted_extents(loc.header, layers, None)
        if tier == "gpu":
            self._promote_gpu((ns, k), loc, where, wanted, dictionaries, required=True)
        else:
            self._promote_dram((ns, k), loc, where, wanted, required=True)
        with t.lock:
            e = t.entries.get((ns, k))
            return e.nbytes if e is not None else 0

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Work whose Future a caller gets (``prefetch``): cancelled at ``close`` if still queued."""
        future = submit(self.executor, fn, *args)
        with self._submitted_lock:
            self._submitted.add(future)
        return future

    def stream(self, layer_ids: list[int], read_layer: Callable[[int], Any],
               depth: int = 2) -> Iterator[tuple[int, Any]]:
        """Yield ``(layer_id, read_layer(layer_id))`` in order, keeping ``depth`` reads in flight
        ahead of the consumer."""
        pending: list[Future] = []
        nxt = 0
        try:
            for j, lid in enumerate(layer_ids):
                while nxt < len(layer_ids) and nxt <= j + depth - 1:
                    pending.append(submit(self.executor, read_layer, layer_ids[nxt]))
                    nxt += 1
                yield lid, pending[j].result()
        finally:
            for f in pending:
                f.cancel()

    def invalidate(self, key: Hashable, hdr: rec.RecordHeader | None) -> None:
        for t in (self.gpu, self.dram):
            if t is not None:
                t.invalidate(key, hdr)

    def where(self, key: Hashable, hdr: rec.RecordHeader) -> tuple[str, ...]:
        return tuple(t.name for t in (self.gpu, self.dram) if t is not None and t.holds(key, hdr))

    def pinned(self, key: Hashable) -> bool:
        """Whether ``key`` holds a pin in any tier (the SSD budget never evicts it)."""
        return any(t.pins.get(key) for t in (self.gpu, self.dram) if t is not None)
