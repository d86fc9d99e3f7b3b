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
from .tiers.hierarchy import CACHE_TIERS

F = TypeVar("F", bound=Callable[..., Any])


def _scoped(fn: F) -> F:
    """What comes back from the Store names no other tenant: a miss's hint names only
    namespaces this handle may read, a ``StoreFull`` gives none of the store's figures (other
    tenants' pinned bytes, retained namespaces' names: the operator's, in ``Store.stats()``),
    and so do the exceptions of a Future it returns (``prefetch``, ``put_async``)."""

    @functools.wraps(fn)
    def call(self: "NamespaceHandle", *args: Any, **kwargs: Any) -> Any:
        try:
            out = fn(self, *args, **kwargs)
        except NotFound as e:
            raise self._scoped_error(e) from None
        except StoreFull as e:
            raise self._scoped_error(e) from None
        return self._scoped_future(out) if isinstance(out, Future) else out

    return call  # type: ignore[return-value]


class _ScopedFuture(Future):
    """The Future of a Store call made through a handle: it completes when the Store's does,
    with its result, or its exception scoped (``NotFound``, ``StoreFull``).  ``cancel()`` and
    ``running()`` are the Store's Future's: work under way is not cancelled, and says so."""

    def __init__(self, inner: Future, scope: Callable[[Exception], Exception]) -> None:
        super().__init__()
        self._inner, self._scope = inner, scope
        inner.add_done_callback(self._settle)

    def cancel(self) -> bool:
        return self._inner.cancel()  # (ours follows, in _settle)

    def running(self) -> bool:
        return self._inner.running() and not self.done()

    def _settle(self, inner: Future) -> None:
        if inner.cancelled():
            Future.cancel(self)
            self.set_running_or_notify_cancel()  # (wakes concurrent.futures.wait / as_completed)
        elif (e := inner.exception()) is None:
            self.set_result(inner.result())
        else:
            self.set_exception(self._scope(e) if isinstance(e, (NotFound, StoreFull)) else e)


class TenantPins:
    """The pins each tenant took through its handles (one ledger per Store): a tenant releases
    only its own, whichever handle of it took them.  ``Store.unpin`` does not see it."""

    def __init__(self) -> None:
        self._held: dict[tuple[str, str, bytes, str], int] = {}  # (tenant, namespace, key, tier) -> pins
        self._lock = threading.Lock()

    def took(self, pid: tuple[str, str, bytes, str]) -> None:
        with self._lock:
            self._held[pid] = self._held.get(pid, 0) + 1

    def release(self, pid: tuple[str, str, bytes, str]) -> bool:
        """Take one of the tenant's pins off the ledger; False if it holds none."""
        with self._lock:
            held = self._held.get(pid, 0)
            if held <= 1:
                self._held.pop(pid, None)
            else:
                self._held[pid] = held - 1
            return held > 0


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

    def __init__(self, store: Any, namespace: str, *, shared: Iterable[str] = (), readonly: bool = False,
                 pins: TenantPins | None = None) -> None:
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
        self._pins = pins if pins is not None else TenantPins()  # (the Store's: shared by a tenant's handles)

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

    def _scoped_error(self, e: Exception) -> Exception:
        """``e`` (NotFound or StoreFull from the Store) as this handle may tell it."""
        if isinstance(e, NotFound):
            e.rehint(functools.partial(self._held_where, e.key, e.namespace))
            return e
        assert isinstance(e, StoreFull)
        what = ("the store's index cannot grow now: the write is kept and applied once there is room"
                if e.index_full else "the store has no room for this (a disk budget, a cache tier or the disk is full)")
        return StoreFull(what, namespace=self.name, index_full=e.index_full, errno=getattr(e, "errno", None),
                         hint="delete objects of this namespace, or ask the store's operator for room")

    def _scoped_future(self, fut: Future) -> Future:
        """A Future of the Store's, its exception scoped as the handle's own calls' are."""
        return _ScopedFuture(fut, self._scoped_error)

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

    @_scoped
    def get(self, key: str | bytes, *, namespace: str | None = None, layers: Any = None, rows: Any = None,
            device: str | None = None, out: Any = None) -> KVCache | Vectors | Blob:
        return self._store.get(key, namespace=self._read_ns(namespace), layers=layers, rows=rows, device=device,
                               out=out)

    @_scoped
    def get_many(self, keys: Any, *, namespace: str | None = None, layers: Any = None, rows: Any = None,
                 device: str | None = None, out: Any = None) -> list[Any]:
        return self._store.get_many(keys, namespace=self._read_ns(namespace), layers=layers, rows=rows,
                                    device=device, out=out)

    @_scoped
    def contains(self, key: str | bytes, *, namespace: str | None = None) -> bool:
        return self._store.contains(key, namespace=self._read_ns(namespace))

    @_scoped
    def contains_many(self, keys: Any, *, namespace: str | None = None) -> list[bool]:
        return self._store.contains_many(keys, namespace=self._read_ns(namespace))

    def __contains__(self, key: str | bytes) -> bool:
        return self.contains(key)

    @_scoped
    def keys(self, *, namespace: str | None = None, prefix: str | bytes | None = None,
             after: str | bytes | None = None, limit: int | None = None) -> list[str | bytes]:
        return self._store.keys(namespace=self._read_ns(namespace), prefix=prefix, after=after, limit=limit)

    @_scoped
    def sessions(self, *, namespace: str | None = None) -> list[str]:
        return self._store.sessions(namespace=self._read_ns(namespace))

    @_scoped
    def info(self, key: str | bytes, *, namespace: str | None = None) -> ObjectInfo:
        return self._store.info(key, namespace=self._read_ns(namespace))

    @_scoped
    def match_prefix(self, hashes: Any, *, namespace: str | None = None) -> int:
        return self._store.match_prefix(hashes, namespace=self._read_ns(namespace))

    @_scoped
    def session_keys(self, session: str, *, namespace: str | None = None) -> list[str | bytes]:
        return self._store.session_keys(session, namespace=self._read_ns(namespace))

    # -- cache tiers (reads: its own namespace and the shared ones) --------------------------

    @_scoped
    def prefetch(self, keys: Any, *, namespace: str | None = None, tier: str = "dram", layers: Any = None) -> Any:
        return self._store.prefetch(keys, namespace=self._read_ns(namespace), tier=tier, layers=layers)

    @_scoped
    def prefetch_session(self, session: str, *, tier: str = "dram") -> Any:
        return self._store.prefetch_session(session, namespace=self.name, tier=tier)

    @_scoped
    def stream_layers(self, key: str | bytes, *, namespace: str | None = None, device: str | None = None,
                      layers: Any = None) -> Iterator[tuple[int, Any]]:
        return self._store.stream_layers(key, namespace=self._read_ns(namespace), device=device, layers=layers)

    @_scoped
    def pin(self, key: str | bytes, *, namespace: str | None = None, tier: str = "dram", layers: Any = None) -> None:
        """``Store.pin``, on this tenant's ledger: ``unpin`` releases only pins the tenant took
        (through this handle or another of the same namespace)."""
        ns = self._read_ns(namespace)
        self._store.pin(key, namespace=ns, tier=tier, layers=layers)
        self._pins.took((self.name, ns, encode_key(key)[0], tier))

    @_scoped
    def unpin(self, key: str | bytes, *, namespace: str | None = None, tier: str = "dram") -> None:
        """Release one pin this tenant took (``InvalidObject`` if it holds none on the key:
        another tenant's pins are not this one's to release, nor to learn of)."""
        ns = self._read_ns(namespace)
        if tier not in CACHE_TIERS:
            raise InvalidObject(f"tier must be one of {', '.join(CACHE_TIERS)}, got {tier!r}")
        if not self._pins.release((self.name, ns, encode_key(key)[0], tier)):
            raise InvalidObject(f"namespace {self.name!r} holds no pin on {key!r} in namespace {ns!r} in the {tier} "
                                f"tier", key=key, namespace=ns, hint="a tenant releases the pins it took with pin()")
        self._store.unpin(key, namespace=ns, tier=tier)

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

    @_scoped
    def put(self, key: str | bytes, obj: KVCache | Vectors | Blob, *, namespace: str | None = None,
            meta: dict[str, Any] | None = None, session: str | None = None, codec: str | None = None) -> None:
        self._store.put(key, obj, namespace=self._write_ns(namespace), meta=meta, session=session, codec=codec)

    @_scoped
    def put_many(self, items: Any, *, namespace: str | None = None, session: str | None = None,
                 codec: str | None = None) -> None:
        self._store.put_many(items, namespace=self._write_ns(namespace), session=session, codec=codec)

    @_scoped
    def put_async(self, key: str | bytes, obj: KVCache | Vectors | Blob, *, namespace: str | None = None,
                  meta: dict[str, Any] | None = None, session: str | None = None,
                  codec: str | None = None) -> Future:
        return self._store.put_async(key, obj, namespace=self._write_ns(namespace), meta=meta, session=session,
                                     codec=codec)

    @_scoped
    def delete(self, key: str | bytes, *, namespace: str | None = None) -> bool:
        return self._store.delete(key, namespace=self._write_ns(namespace))

    @_scoped
    def delete_many(self, keys: Any, *, namespace: str | None = None) -> list[bool]:
        return self._store.delete_many(keys, namespace=self._write_ns(namespace))

    @_scoped
    def drop_session(self, session: str, *, namespace: str | None = None) -> int:
        return self._store.drop_session(session, namespace=self._write_ns(namespace))
