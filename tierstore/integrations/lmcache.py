"""An LMCache storage plugin: LMCache's KV chunks in a tierstore store, so they survive restarts,
are checksummed (a damaged chunk is a miss, never returned) and stay within a size limit.

Configuration only (LMCache's ``storage_plugins``), no code:

    storage_plugins: ["tierstore"]
    extra_config:
      storage_plugin.tierstore.module_path: tierstore.integrations.lmcache
      storage_plugin.tierstore.class_name: TierstoreBackend
      tierstore.path: /data/kv
      tierstore.max_bytes: 50GiB        # optional: per worker, as max_local_disk_size; LRU unpinned go first
      tierstore.codec: int8             # optional: the store codec of the chunks (default lossless)
      tierstore.durability: group       # optional (default "group": a put is durable within 10 ms)
      tierstore.remote: redis://cache-1:6379/0   # optional: share chunks between nodes (docs/remote.md)
      tierstore.remote_policy: write-back        # optional (default "write-through")

It owns the mapping between LMCache's ``CacheEngineKey`` / ``MemoryObj`` and tierstore objects:
the key's model, world size, worker id and dtype name the namespace, its chunk hash the key; a
``KV_2LTD`` chunk ``[2, layers, tokens, hidden]`` is stored as a ``KVCache [layers, 2, 1, tokens,
hidden]`` (one extent per layer, written from the chunk's memory without a staging copy), other
formats as a blob.  It uses only tierstore's public API.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

from .. import Blob, InvalidObject, KVCache, NotFound, TierstoreError, codecs, parse_size
from .. import open as open_store

_log = logging.getLogger("tierstore")
CONFIG_PREFIX = "tierstore."
DEFAULT_DURABILITY = "group"
SETTINGS = ("path", "max_bytes", "codec", "durability", "remote", "remote_policy")  # extra_config tierstore.*
MAX_BYTES_MIN = 4096  # tierstore.max_bytes below this holds no chunk (a bare number mistaken for GB)
SYNC_S = 1.0  # at the limit, how often (at most) to take in what other processes stored or removed (seconds)
SYNC_SHARED_S = 0.1  # ... while another process of this worker id was seen storing or evicting ...
SHARED_FOR_S = 60.0  # ... in the last minute


def _setting(config: Any, name: str, default: Any = None) -> Any:
    extra = getattr(config, "extra_config", None) or {}
    return extra.get(CONFIG_PREFIX + name, default)


def namespace_of(key: CacheEngineKey, lossy: str | None = None) -> str:
    """Where a key's chunks live: one namespace per model, world size, worker id, dtype and
    LMCache tags (``lmcache.tag.*``: part of a key's identity in LMCache), and per lossy codec
    (``lossy``: its spec, e.g. ``int8``; a plugin without it never reads those chunks).  The
    name is readable -- ``lmcache~<model>~ws<N>~w<id>~<dtype>~<digest>``, the model name's
    characters other than letters, digits, ``.``, ``_`` and ``-`` as ``~`` and cut to fit -- and
    made exact by the digest: 16 hex digits of SHA-256 over all of those fields in full (a long
    model path, two ranks or two dtypes never share a namespace)."""
    dtype = str(key.dtype).removeprefix("torch.")
    fields = [key.model_name, int(key.world_size), int(key.worker_id), dtype, [list(t) for t in key.tags or ()]]
    ident = json.dumps(fields + ([lossy] if lossy else []), default=str).encode()
    digest = hashlib.sha256(ident).hexdigest()[:16]
    tail = f"~ws{key.world_size}~w{key.worker_id}~{dtype}~{digest}"
    model = re.sub(r"[^A-Za-z0-9._-]", "~", key.model_name)[: 100 - len("lmcache~") - len(tail)]
    return f"lmcache~{model}{tail}"


def worker_of(ns: str) -> int | None:
    """The worker id a ``namespace_of`` name carries (its tail: ``~ws<N>~w<id>~<dtype>~<digest>``),
    None for a name not of that form."""
    parts = ns.split("~")
    if len(parts) < 6 or not parts[-3].startswith("w") or not parts[-3][1:].isdigit():
        return None
    return int(parts[-3][1:])


def key_of(key: CacheEngineKey) -> bytes:
    """A chunk hash as a key (8 bytes, two's complement, little-endian; wider hashes in full)."""
    h = int(key.chunk_hash)
    n = max(8, (h.bit_length() + 8) // 8)
    return h.to_bytes(n, "little", signed=True)


class TierstoreBackend(StoragePluginInterface):
    """LMCache's storage backend interface over a tierstore store (see the module docstring).

    Puts run on one background thread (``batched_submit_put_task`` returns at once; the callback
    runs per key once the chunk is in the store); gets are synchronous.  A chunk that fails its
    checksum is logged once, removed, and reported as a miss.
    """

    def __init__(self, dst_device: str = "cpu", config: Any = None, metadata: Any = None,
                 local_cpu_backend: Any = None, loop: Any = None) -> None:
        super().__init__(dst_device=dst_device, config=config, metadata=metadata,
                         local_cpu_backend=local_cpu_backend, loop=loop)
        if getattr(config, "use_layerwise", False):  # (its keys name a layer each, read back layer by layer)
            raise InvalidObject("the tierstore storage plugin stores whole chunks; LMCache's layerwise mode "
                                "(use_layerwise: true) is not supported", hint="set use_layerwise: false")
        path = _setting(config, "path")
        if not path:
            raise InvalidObject("the tierstore storage plugin needs extra_config 'tierstore.path'",
                                hint="extra_config: {'tierstore.path': '/data/kv', ...}")
        extra = getattr(config, "extra_config", None) or {}
        unknown = sorted(k for k in extra if k.startswith(CONFIG_PREFIX) and k[len(CONFIG_PREFIX):] not in SETTINGS)
        if unknown:  # (a typo would silently drop a limit)
            _log.warning("tierstore: unknown extra_config key(s) %s ignored; the plugin reads %s", ", ".join(unknown),
                         ", ".join(CONFIG_PREFIX + s for s in SETTINGS))
        limit = _setting(config, "max_bytes")
        self.max_bytes = parse_size(limit, "tierstore.max_bytes") if limit is not None else None
        if self.max_bytes is not None and self.max_bytes < MAX_BYTES_MIN:
            raise InvalidObject(f"tierstore.max_bytes={limit!r} is {self.max_bytes} bytes: too small to hold a chunk "
                                f"(at least {MAX_BYTES_MIN} bytes)",
                                hint="a bare number is bytes (LMCache's max_local_disk_size counts GB): write "
                                     "e.g. '50GB' or '64GiB'")
        self._warned_too_big = False
        self.codec = _setting(config, "codec")
        self.lossy: str | None = None  # a lossy codec's spec: its chunks get namespaces of their own
        if self.codec is not None:
            try:
                choice = codecs.parse(self.codec, "kv")  # checked now, not at the first store
            except InvalidObject as e:
                raise InvalidObject(f"tierstore.codec: {e.message}", hint=e.hint) from None
            self.lossy = None if choice.codec.lossless else choice.spec
        self.local_cpu_backend = local_cpu_backend
        remote = {name: _setting(config, name) for name in ("remote", "remote_policy")
                  if _setting(config, name) is not None}
        durability = _setting(config, "durability", DEFAULT_DURABILITY)
        try:
            self.store = open_store(path, durability=durability, **remote)
        except InvalidObject as e:  # the extra_config key the store's option came from
            key = f"{CONFIG_PREFIX}path" if e.path is not None else next(  # (an error about the path says so)
                (f"{CONFIG_PREFIX}{name}" for name in ("remote_policy", "durability", "remote") if name in e.message),
                f"{CONFIG_PREFIX}path")
            message = e.message.replace("remote_policy given without remote=",
                                        f"given without {CONFIG_PREFIX}remote").replace("remote=: ", "")
            raise InvalidObject(f"{key}: {message}", hint=e.hint) from None
        except TierstoreError as e:  # (a path that is a file, damage that stops the open, ...): the key named
            e.message = f"{CONFIG_PREFIX}path={path!r}: {e.message}"
            e.args = (e.message,)
            raise
        except OSError as e:
            raise InvalidObject(f"{CONFIG_PREFIX}path={path!r}: {e.strerror or e}", path=path) from None
        self._lock = threading.Lock()
        self._putting: set[CacheEngineKey] = set()
        self._pins: dict[tuple[str, bytes], int] = {}
        self._lru: OrderedDict[tuple[str, bytes], int] = OrderedDict()  # (ns, key) -> stored bytes, oldest first
        self._synced: float | None = None  # when the LRU order last took in the store's contents
        self._sync_s = 0.0  # how long that took
        self._shared_at = -SHARED_FOR_S  # when a listing last found another process's stores or evictions
        wid, world = getattr(metadata, "worker_id", None), getattr(metadata, "world_size", None)
        self._worker = (int(wid), int(world)) if isinstance(wid, int) and isinstance(world, int) else None
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierstore-lmcache")

    def __str__(self) -> str:
        return "TierstoreBackend"

    # -- the size limit -------------------------------------------------------------------------

    def _mine(self, ns: str) -> bool:
        """Whether the chunks of LMCache namespace ``ns`` count against this worker's limit: its
        worker id's (every model, dtype and world size), and for worker 0 also those of worker
        ids this world size does not have (an earlier run with more workers) or that cannot be
        read from the name."""
        if self._worker is None:
            return True
        me, world = self._worker
        wid = worker_of(ns)
        if wid is None:
            return me == 0
        return wid == me or (me == 0 and wid >= world)

    def _sync(self) -> None:
        """Bring the LRU order up to date with what the store holds of this worker's namespaces
        (``_mine``): written before a restart, or by another process of the same worker id, or
        removed by someone else.  Chunks this process has not seen go in as the newest uses, in
        the order they were written (LSN): after a restart, all of them, oldest written first.
        The store is listed outside the lock; only the differences are applied under it."""
        listed: dict[str, set[bytes]] = {}
        for ns in self.store.namespaces():
            if ns.startswith("lmcache~") and self._mine(ns):
                listed[ns] = set(self.store.keys(namespace=ns))
        with self._lock:
            held: dict[str, set[bytes]] = {}
            for ns, k in self._lru:
                held.setdefault(ns, set()).add(k)
        fresh = []
        for ns, present in listed.items():
            for k in present - held.get(ns, set()):
                try:
                    info = self.store.info(k, namespace=ns)
                except NotFound:  # removed since the listing
                    continue
                fresh.append((info.lsn, (ns, k), info.logical_bytes))
        others = False
        with self._lock:
            for ns, mine in held.items():
                if ns in listed or self._mine(ns):  # (a namespace not listed is empty now)
                    for k in mine - listed.get(ns, set()):
                        others |= self._lru.pop((ns, k), None) is not None
            for _, nk, size in sorted(fresh):
                if nk not in self._lru:
                    self._lru[nk] = size
                    others = True
        if others and self._synced is not None:  # (the first listing takes in an earlier run's chunks)
            self._shared_at = time.monotonic()
        self._synced = time.monotonic()

    def _timed_sync(self) -> None:
        t0 = time.monotonic()
        self._sync()
        self._sync_s = time.monotonic() - t0

    def _used(self) -> int:
        return sum(self._lru.values())

    def _make_room(self, ns: str, incoming: int) -> None:
        """Evict least recently used unpinned chunks until ``incoming`` more bytes fit."""
        if self.max_bytes is None:
            return
        victims: dict[str, list[bytes]] = {}
        with self._lock:
            used = self._used()
        now = time.monotonic()
        every = SYNC_SHARED_S if now - self._shared_at < SHARED_FOR_S else SYNC_S
        if self._synced is None or (used + incoming > self.max_bytes and
                                    now - self._synced >= max(every, 10 * self._sync_s)):
            self._timed_sync()  # (at most a tenth of the time: a big store takes a while to list)
        evicted = False
        for _ in range(2):  # (a second round after a listing when the first found its view stale)
            victims.clear()
            with self._lock:
                used = self._used()
                for nk in list(self._lru):
                    if used + incoming <= self.max_bytes:
                        break
                    if self._pins.get(nk):
                        continue
                    used -= self._lru.pop(nk)
                    victims.setdefault(nk[0], []).append(nk[1])
            stale = False
            for vns, keys in victims.items():
                for i in range(0, len(keys), 1024):
                    gone = self.store.delete_many(keys[i : i + 1024], namespace=vns)
                    stale |= not all(gone)
            evicted |= bool(victims)
            if not stale:
                break
            # a victim was gone already: another process of this worker id evicted it, and what it
            # stored since is not in this view -- freeing nothing, this put would keep the store
            # past max_bytes (two processes: twice the limit, for good, before).  List the store and
            # evict again -- within the tenth of the time listings may take; else at the next put.
            self._shared_at = time.monotonic()
            if time.monotonic() - self._synced < 10 * self._sync_s:
                break
            self._timed_sync()
        if evicted:
            st = self.store.stats()
            if st["dead_bytes"] > st["live_bytes"] // 3:
                self.store.compact(min_dead_ratio=0.25)

    def _touch(self, ns: str, ks: list[bytes]) -> None:
        """Mark the chunks ``ks`` of a prompt, in prompt order, as just used (caller holds the lock):
        the first one last, so eviction takes a prompt's tail before its head -- LMCache uses a
        prefix only, and a head evicted first leaves the tail stored and unreachable."""
        for k in reversed(ks):
            if (ns, k) in self._lru:
                self._lru.move_to_end((ns, k))

    def _fitting(self, items: list[Any]) -> list[Any]:
        """The leading chunks of a batch that fit in ``max_bytes`` at all (the rest are not stored,
        warned once): a batch larger than the limit evicted everything, then passed it anyway."""
        if self.max_bytes is None:
            return items
        total = 0
        for n, (_, _, obj) in enumerate(items):
            total += self._nbytes(obj)
            if total > self.max_bytes:
                if not self._warned_too_big:
                    self._warned_too_big = True
                    _log.warning("tierstore: a batch of %d LMCache chunks is larger than tierstore.max_bytes=%d: "
                                 "the first %d are stored, the rest are misses", len(items), self.max_bytes, n)
                return items[:n]
        return items

    # -- puts --------------------------------------------------------------------------------------

    @staticmethod
    def _nbytes(obj: MemoryObj) -> int:
        """A chunk's bytes as the size limit counts them (the logical bytes of what is stored)."""
        t = obj.tensor
        return int(t.numel() * t.element_size()) if t is not None else len(memoryview(obj.byte_array).cast("B"))

    def _object(self, obj: MemoryObj) -> KVCache | Blob:
        meta = obj.metadata
        t = obj.tensor
        if meta.fmt == MemoryFormat.KV_2LTD and t is not None and t.dim() == 4 and t.shape[0] == 2:
            layers = [(t[0, i].unsqueeze(0), t[1, i].unsqueeze(0)) for i in range(t.shape[1])]
            return KVCache.from_layers(layers)
        return Blob(memoryview(obj.byte_array))

    def _put_batch(self, keys: list[CacheEngineKey], objs: list[MemoryObj],
                   on_complete: Callable[[CacheEngineKey], None] | None) -> None:
        """Write a batch, one ``put_many`` per namespace; ``tierstore.codec`` applies to KV
        chunks (other formats are blobs: stored raw).  LMCache's callback runs for each chunk
        that was stored; a namespace whose write failed is logged and its chunks are misses."""
        stored: list[CacheEngineKey] = []
        try:
            by_ns: dict[str, list[tuple[CacheEngineKey, bytes, MemoryObj]]] = {}
            for key, obj in zip(keys, objs):
                by_ns.setdefault(namespace_of(key, self.lossy), []).append((key, key_of(key), obj))
            for ns, items in by_ns.items():
                try:
                    items = self._fitting(items)
                    self._make_room(ns, sum(self._nbytes(obj) for _, _, obj in items))
                    kv, blobs = [], []
                    for key, k, obj in items:
                        m = obj.metadata
                        meta = {"lmcache_shape": list(m.shape), "lmcache_dtype": str(m.dtype).removeprefix("torch."),
                                "lmcache_fmt": m.fmt.name}
                        value = self._object(obj)
                        (kv if isinstance(value, KVCache) else blobs).append((key, k, obj, value, meta))
                    # written last chunk first: the order of LSNs is then the order a restart's LRU
                    # takes them in, and a prompt's tail goes before its head there too (_touch)
                    for batch, codec in ((kv[::-1], self.codec), (blobs[::-1], None)):
                        for i in range(0, len(batch), 1024):
                            part = batch[i : i + 1024]
                            self.store.put_many([(k, value, meta) for _, k, _, value, meta in part], namespace=ns,
                                                codec=codec)
                            with self._lock:  # counted against the limit as each part lands
                                for _, k, obj, _, _ in part:
                                    self._lru[(ns, k)] = self._nbytes(obj)
                            stored += [key for key, _, _, _, _ in part]
                    with self._lock:  # a prefix's last chunk first in line, its first chunk last (see _touch)
                        self._touch(ns, [k for _, k, _ in items])
                except TierstoreError as e:
                    _log.warning("tierstore: storing %d LMCache chunks failed: %s", len(items), e)
        finally:
            with self._lock:
                self._putting.difference_update(keys)
            for obj in objs:
                obj.ref_count_down()
        if on_complete is not None:
            for key in stored:
                try:
                    on_complete(key)
                except Exception as e:  # LMCache's contract: callback errors are logged, not raised
                    _log.warning("tierstore: an LMCache put callback raised %r", e)

    def batched_submit_put_task(self, keys: Sequence[CacheEngineKey], objs: list[MemoryObj],
                                transfer_spec: Any = None,
                                on_complete_callback: Callable[[CacheEngineKey], None] | None = None
                                ) -> list[Future] | None:
        todo_keys, todo_objs = [], []
        with self._lock:
            for key, obj in zip(keys, objs):
                if key in self._putting:
                    continue
                self._putting.add(key)
                obj.ref_count_up()  # the memory stays ours until the write is done
                todo_keys.append(key)
                todo_objs.append(obj)
        if not todo_keys:
            return None
        return [self._writer.submit(self._put_batch, todo_keys, todo_objs, on_complete_callback)]

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        with self._lock:
            return key in self._putting

    # -- lookups and gets ---------------------------------------------------------------------------

    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        ns, k = namespace_of(key, self.lossy), key_of(key)
        found = self.store.contains(k, namespace=ns)
        if found and pin:
            self.pin(key)
        return found

    def batched_contains(self, keys: list[CacheEngineKey], pin: bool = False) -> int:
        """How many leading keys are stored (LMCache's prefix hit count), in one index snapshot."""
        hits = 0
        by_ns: dict[str, list[bytes]] = {}
        for key in keys:
            by_ns.setdefault(namespace_of(key, self.lossy), []).append(key_of(key))
        if len(by_ns) == 1:
            ((ns, ks),) = by_ns.items()
            found = self.store.contains_many(ks, namespace=ns)
        else:
            found = [self.store.contains(key_of(k), namespace=namespace_of(k, self.lossy)) for k in keys]
        for key, f in zip(keys, found):
            if not f:
                break
            if pin:
                self.pin(key)
            hits += 1
        return hits

    def get_blocking(self, key: CacheEngineKey) -> MemoryObj | None:
        return self.batched_get_blocking([key])[0]

    def _allocated(self, key: CacheEngineKey) -> tuple[Any, MemoryObj] | None:
        """The stored chunk's description and a memory object of LMCache's to read it into;
        None for a miss."""
        ns, k = namespace_of(key, self.lossy), key_of(key)
        try:
            info = self.store.info(k, namespace=ns)
            m = info.meta
            shape = torch.Size(m["lmcache_shape"])
            dtype = getattr(torch, m["lmcache_dtype"])
            fmt = MemoryFormat[m["lmcache_fmt"]]
        except NotFound:
            return None
        except (KeyError, AttributeError) as e:
            _log.warning("tierstore: %s in namespace %r is not an LMCache chunk (%s): a miss", k.hex(), ns, e)
            return None
        obj = self.local_cpu_backend.allocate(shape, dtype, fmt)
        return None if obj is None else (info, obj)

    @staticmethod
    def _destination(info: Any, obj: MemoryObj) -> Any:
        """Where ``get`` puts a chunk: stored ``[layers, 2, 1, tokens, hidden]``, LMCache's object
        is ``[2, layers, tokens, hidden]``: each layer's K and V go straight to their two places
        in it.  None for a blob (its bytes are copied in after)."""
        if info.kind != "kv":
            return None
        t = obj.tensor.view(2, info.shape[0], 1, info.shape[3], info.shape[4])
        return list(zip(t[0].unbind(0), t[1].unbind(0)))  # (t[0, i], t[1, i]) per layer, made at once

    def batched_get_blocking(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        """The chunks of ``keys``, None for a miss.  LMCache's memory is allocated first, key by
        key; then one ``get_many`` per namespace reads the chunks straight into it (the store
        reads chunks that only its disk holds side by side).  A chunk that fails its checksum is
        logged, removed and a miss, and so is every key after it (LMCache uses the hits up to
        the first miss); their memory is given back, on any error too."""
        plans: list[tuple[Any, MemoryObj] | None] = []
        try:
            for key in keys:
                plans.append(self._allocated(key))
            got: list[Any] = [None] * len(keys)
            end = len(keys)  # keys from here on are misses
            by_ns: dict[str, list[int]] = {}
            for n, plan in enumerate(plans):
                if plan is not None:
                    by_ns.setdefault(namespace_of(keys[n], self.lossy), []).append(n)
            for ns, idx in by_ns.items():
                while idx:
                    ks = [key_of(keys[n]) for n in idx]
                    try:
                        objs = self.store.get_many(ks, namespace=ns,
                                                   out=[self._destination(*plans[n]) for n in idx])  # type: ignore[misc]
                    except TierstoreError as e:  # damaged: never returned; removed so the next put replaces it
                        bad = next((n for n, k in zip(idx, ks) if k == e.key), idx[0])
                        _log.warning("tierstore: LMCache chunk %s in namespace %r is unreadable (%s): a miss, "
                                     "removed", e.key.hex() if isinstance(e.key, bytes) else e.key, ns, e)
                        if e.key is not None:
                            self.remove(keys[bad])
                        end = min(end, bad)
                        idx = [n for n in idx if n < bad]  # the keys before it, again (the call returned none)
                        continue
                    for n, obj in zip(idx, objs):
                        got[n] = obj
                    break
            out: list[MemoryObj | None] = [None] * len(keys)
            for n, plan in enumerate(plans):
                if plan is None or n >= end or got[n] is None:
                    continue
                info, mem = plan
                if info.kind != "kv":
                    data = got[n].data
                    memoryview(mem.byte_array).cast("B")[: len(data)] = data
                out[n] = mem
            with self._lock:  # (a prefix's head kept longest, as _put_batch leaves it)
                for ns, idx in by_ns.items():
                    self._touch(ns, [key_of(keys[n]) for n in idx if n < end and out[n] is not None])
        except BaseException:  # LMCache's memory given back before the error goes on
            for plan in plans:
                if plan is not None:
                    plan[1].ref_count_down()
            raise
        for n, plan in enumerate(plans):  # the memory of misses goes back
            if plan is not None and out[n] is None:
                plan[1].ref_count_down()
        return out

    # -- pins, removal, the rest ------------------------------------------------------------------------

    def pin(self, key: CacheEngineKey) -> bool:
        nk = (namespace_of(key, self.lossy), key_of(key))
        with self._lock:
            self._pins[nk] = self._pins.get(nk, 0) + 1
        return True

    def unpin(self, key: CacheEngineKey) -> bool:
        nk = (namespace_of(key, self.lossy), key_of(key))
        with self._lock:
            n = self._pins.get(nk, 0)
            if n <= 1:
                self._pins.pop(nk, None)
            else:
                self._pins[nk] = n - 1
            return n > 0

    def remove(self, key: CacheEngineKey, force: bool = True) -> bool:
        ns, k = namespace_of(key, self.lossy), key_of(key)
        with self._lock:  # (deleted under it: a sync in between would count the chunk again)
            if not force and self._pins.get((ns, k)):
                return False
            self._lru.pop((ns, k), None)
            return self.store.delete(k, namespace=ns)

    def touch_cache(self) -> None:
        return None

    def get_allocator_backend(self) -> Any:
        return self.local_cpu_backend

    def close(self) -> None:
        self._writer.shutdown(wait=True)
        self.store.close()
