"""Namespace-scoped handles: a tenant's view of a store (``Store.namespace``).

A handle owns one namespace (read and write) and may be granted shared namespaces that it
can only read (e.g. system prompts).  It can name no other namespace: every method checks
the namespace it is asked for before touching the store, and what comes back names none
either (a miss's hint, a full store's message).  Its only state is the pins it took (a handle
releases its own, never another's).  It never bypasses the Store's checks.  It is a boundary
against untrusted *names* (a tenant's requests), not against untrusted code in the process.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any, TypeVar

from .errors import AccessDenied, InvalidObject, NotFound, ReadOnlyError, StoreFull
from .names import check_namespace, encode_key
from .objects import Blob, KVCache, ObjectInfo, Vectors

F = TypeVar("F", bound=Callable[..., Any])


def _reads(fn: F) -> F:
    """A read: a miss's hint names only namespaces this handle may read (the Store's names any)."""

    @functools.wraps(fn)
    def read(self: "NamespaceHandle", *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except NotFound as e:
            e.rehint(functools.partial(self._held_where, e.key, e.namespace))
            raise

    return read  # type: ignore[return-value]


def _writes(fn: F) -> F:
    """A write: a full store is told without the store's figures (other tenants' bytes, pins,
    retained namespaces' names) -- those are for the store's operator (``Store.stats()``)."""

    @functools.wraps(fn)
    def write(self: "NamespaceHandle", *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except StoreFull as e:
            raise StoreFull(("the store's index cannot grow now: the write is kept and applied once there is room"
                             if e.index_full else "the store has no room for this write"), namespace=self.name,
                            index_full=e.index_full,
                            hint="delete objects of this namespace, or ask the store's operator for room") from None

    return write  # type: ignore[return-value]


class NamespaceHandle:
    """The part of a Store one tenant may use: its own namespace, plus read-only shared ones.

    ``namespace=`` arguments default to the handle's own namespace; naming a shared one is
    allowed for reads (``get``, ``get_many``, ``contains``, ``contains_many``, ``keys``,
    ``info``, ``match_prefix``, ``sessions``, ``session_keys``, and the tiers' ``prefetch``,
    ``stream_layers``, ``pin`` / ``unpin`` / ``pinned``); any other raises ``AccessDenied``
    (``prefetch_session`` announces a session of the handle's own namespace).  Writes (``put``,
    ``put_many``, ``put_async``, ``delete``, ``delete_many``, ``drop_session``) go only to the
    handle's own namespace (``readonly=True`` forbids them too); a ``namespace=`` given to
    a write must be that namespace (``AccessDenied`` otherwise).  Each method is the Store's
    method of the same name, scoped.
    """

    def __init__(self, store: Any, namespace: str, *, shared: Iterable[str] = (), readonly: bool = False) -> None:
        check_namespace(namespace)
        if isinstance(shared, (str, bytes)):  # one name, not its letters
            raise InvalidObject(f"shared must be a list of namespace names, got the string {shared!r}",
                                hint=f"shared=[{shared!r}]")
        if not isinstance(readonly, bool):
            raise InvalidObject(f"readonly must be True or False, got {readonly!r}")
        self._shared = frozenset(shared)
        for name in self._shared:
            check_namespace(name)
        self._store = store
        self.name = namespace
        self.readonly = readonly or bool(getattr(store, "readonly", False))  # (over a read-only store: too)
        self._pins: dict[tuple[str, bytes, str], int] = {}  # (namespace, key, tier) -> pins this handle holds
        self._pins_lock = threading.Lock()

    @property
    def shared(self) -> frozenset[str]:
        return self._shared

    def __repr__(self) -> str:
        return f"NamespaceHandle({self.name!r}, shared={sorted(self._shared)!r}, readonly={self.readonly})"

    def _read_ns(self, namespace: str | None) -> str:
        if namespace is None:
            return self.name
        if type(namespace) is not str:  # (a str subclass may compare equal to a name it does not spell)
            raise AccessDenied(f"namespace must be a str, got {type(namespace).__name__}", namespace=None)
        if namespace == self.name:
            return self.name
        if namespace in self._shared:
            return namespace
        raise AccessDenied(f"this handle may not read namespace {namespace!r}", namespace=namespace)

    def _held_where(self, key: Any, asked: Any) -> str | None:
        """For a miss: the other namespaces this handle may read that hold ``key``."""
        names = [n for n in sorted({self.name, *self._shared}) if n != asked
                 and self._store.contains(key, namespace=n)]
        if not names:
            return None
        return f"namespace {', '.join(map(repr, names[:3]))} {'holds' if len(names) == 1 else 'hold'} that key"

    def _write_ns(self, namespace: str | None = None) -> str:
        if namespace is not None and type(namespace) is not str:
            raise AccessDenied(f"namespace must be a str, got {type(namespace).__name__}", namespace=None)
        if namespace is not None and namespace != self.name:
            raise AccessDenied(f"this handle writes only to namespace {self.name!r}, not {namespace!r}",
                               namespace=namespace, hint="leave namespace= out: a handle writes to its own")
        if self.readonly:
            raise ReadOnlyError(f"this handle of namespace {self.name!r} is read-only", namespace=self.name,
                                hint="write through a handle from store.namespace(name) without readonly=True, "
                                     "on a store opened writable")
        return self.name

    # -- reads -------------------------------------------------------------------------------

    @_reads
    def get(self, key: str | bytes, *, namespace: str | None = None, layers: Any = None, rows: Any = None,
            device: str | None = None, out: Any = None) -> KVCache | Vectors | Blob:
        return self._store.get(key, namespace=self._read_ns(namespace), layers=layers, rows=rows, device=device,
                               out=out)

    @_reads
    def get_many(self, keys: Any, *, namespace: str | None = None, layers: Any = None, rows: Any = None,
                 device: str | None = None, out: Any = None) -> list[Any]:
        return self._store.get_many(keys, namespace=self._read_ns(namespace), layers=layers, rows=rows,
                                    device=device, out=out)

    @_reads
    def contains(self, key: str | bytes, *, namespace: str | None = None) -> bool:
        return self._store.contains(key, namespace=self._read_ns(namespace))

    @_reads
    def contains_many(self, keys: Any, *, namespace: str | None = None) -> list[bool]:
        return self._store.contains_many(keys, namespace=self._read_ns(namespace))

    def __contains__(self, key: str | bytes) -> bool:
        return self.contains(key)

    @_reads
    def keys(self, *, namespace: str | None = None, prefix: str | bytes | None = None,
             after: str | bytes | None = None, limit: int | None = None) -> list[str | bytes]:
        return self._store.keys(namespace=self._read_ns(namespace), prefix=prefix, after=after, limit=limit)

    @_reads
    def sessions(self, *, namespace: str | None = None) -> list[str]:
        return self._store.sessions(namespace=self._read_ns(namespace))

    @_reads
    def info(self, key: str | bytes, *, namespace: str | None = None) -> ObjectInfo:
        return self._store.info(key, namespace=self._read_ns(namespace))

    @_reads
    def match_prefix(self, hashes: Any, *, namespace: str | None = None) -> int:
        return self._store.match_prefix(hashes, namespace=self._read_ns(namespace))

    @_reads
    def session_keys(self, session: str, *, namespace: str | None = None) -> list[str | bytes]:
        return self._store.session_keys(session, namespace=self._read_ns(namespace))

    # -- cache tiers (reads: its own namespace and the shared ones) --------------------------

    @_reads
    def prefetch(self, keys: Any, *, namespace: str | None = None, tier: str = "dram", layers: Any = None) -> Any:
        return self._store.prefetch(keys, namespace=self._read_ns(namespace), tier=tier, layers=layers)

    @_reads
    def prefetch_session(self, session: str, *, tier: str = "dram") -> Any:
        return self._store.prefetch_session(session, namespace=self.name, tier=tier)

    @_reads
    def stream_layers(self, key: str | bytes, *, namespace: str | None = None, device: str | None = None,
                      layers: Any = None) -> Iterator[tuple[int, Any]]:
        return self._store.stream_layers(key, namespace=self._read_ns(namespace), device=device, layers=layers)

    @_reads
    def pin(self, key: str | bytes, *, namespace: str | None = None, tier: str = "dram", layers: Any = None) -> None:
        """``Store.pin``, counted in this handle: ``unpin`` releases only pins this handle took."""
        ns = self._read_ns(namespace)
        self._store.pin(key, namespace=ns, tier=tier, layers=layers)
        pid = (ns, encode_key(key)[0], tier)
        with self._pins_lock:
            self._pins[pid] = self._pins.get(pid, 0) + 1

    def unpin(self, key: str | bytes, *, namespace: str | None = None, tier: str = "dram") -> None:
        """Release one pin this handle took (``InvalidObject`` if it holds none on the key: another
        handle's pins are not this one's to release, nor to learn of)."""
        ns = self._read_ns(namespace)
        pid = (ns, encode_key(key)[0], tier)
        with self._pins_lock:
            held = self._pins.get(pid, 0)
            if not held:
                raise InvalidObject(f"this handle holds no pin on {key!r} in namespace {ns!r} in the {tier} tier",
                                    key=key, namespace=ns, hint="a handle releases the pins it took with pin()")
            if held == 1:
                del self._pins[pid]
            else:
                self._pins[pid] = held - 1
        try:
            self._store.unpin(key, namespace=ns, tier=tier)
        except BaseException:
            with self._pins_lock:
                self._pins[pid] = self._pins.get(pid, 0) + 1
            raise

    @contextmanager
    def pinned(self, key: str | bytes, *, namespace: str | None = None, tier: str = "dram",
               layers: Any = None) -> Iterator["NamespaceHandle"]:
        self.pin(key, namespace=namespace, tier=tier, layers=layers)
        try:
            yield self
        finally:
            if not self._store.closed:
                self.unpin(key, namespace=namespace, tier=tier)

    # -- writes ------------------------------------------------------------------------------

    @_writes
    def put(self, key: str | bytes, obj: KVCache | Vectors | Blob, *, namespace: str | None = None,
            meta: dict[str, Any] | None = None, session: str | None = None, codec: str | None = None) -> None:
        self._store.put(key, obj, namespace=self._write_ns(namespace), meta=meta, session=session, codec=codec)

    @_writes
    def put_many(self, items: Any, *, namespace: str | None = None, session: str | None = None,
                 codec: str | None = None) -> None:
        self._store.put_many(items, namespace=self._write_ns(namespace), session=session, codec=codec)

    @_writes
    def put_async(self, key: str | bytes, obj: KVCache | Vectors | Blob, *, namespace: str | None = None,
                  meta: dict[str, Any] | None = None, session: str | None = None,
                  codec: str | None = None) -> Future:
        return self._store.put_async(key, obj, namespace=self._write_ns(namespace), meta=meta, session=session,
                                     codec=codec)

    @_writes
    def delete(self, key: str | bytes, *, namespace: str | None = None) -> bool:
        return self._store.delete(key, namespace=self._write_ns(namespace))

    @_writes
    def delete_many(self, keys: Any, *, namespace: str | None = None) -> list[bool]:
        return self._store.delete_many(keys, namespace=self._write_ns(namespace))

    @_writes
    def drop_session(self, session: str, *, namespace: str | None = None) -> int:
        return self._store.drop_session(session, namespace=self._write_ns(namespace))
