"""Namespace-scoped handles: a tenant's view of a store (``Store.namespace``).

A handle owns one namespace (read and write) and may be granted shared namespaces that it
can only read (e.g. system prompts).  It can name no other namespace: every method checks
the namespace it is asked for before touching the store.  This module holds no state of its
own and never bypasses the Store's checks.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

from .errors import AccessDenied, InvalidObject, ReadOnlyError
from .names import check_namespace
from .objects import Blob, KVCache, ObjectInfo, Vectors


class NamespaceHandle:
    """The part of a Store one tenant may use: its own namespace, plus read-only shared ones.

    ``namespace=`` arguments default to the handle's own namespace; naming a shared one is
    allowed for reads (``get``, ``get_many``, ``contains``, ``contains_many``, ``keys``,
    ``info``, ``match_prefix``, and the tiers' ``prefetch``, ``stream_layers``, ``pin`` /
    ``unpin`` / ``pinned``); any other raises ``AccessDenied``.  Writes (``put``,
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

    @property
    def shared(self) -> frozenset[str]:
        return self._shared

    def __repr__(self) -> str:
        return f"NamespaceHandle({self.name!r}, shared={sorted(self._shared)!r}, readonly={self.readonly})"

    def _read_ns(self, namespace: str | None) -> str:
        if namespace is None or namespace == self.name:
            return self.name
        if namespace in self._shared:
            return namespace
        raise AccessDenied(f"this handle may not read namespace {namespace!r}", namespace=namespace)

    def _write_ns(self, namespace: str | None = None) -> str:
        if namespace is not None and namespace != self.name:
            raise AccessDenied(f"this handle writes only to namespace {self.name!r}, not {namespace!r}",
                               namespace=namespace, hint="leave namespace= out: a handle writes to its own")
        if self.readonly:
            raise ReadOnlyError(f"this handle of namespace {self.name!r} is read-only", namespace=self.name,
                                hint="write through a handle from store.namespace(name) without readonly=True, "
                                     "on a store opened writable")
        return self.name

    # -- reads -------------------------------------------------------------------------------

    def get(self, key: str | bytes, *, namespace: str | None = None, layers: Any = None, rows: Any = None,
            device: str | None = None, out: Any = None) -> KVCache | Vectors | Blob:
        return self._store.get(key, namespace=self._read_ns(namespace), layers=layers, rows=rows, device=device,
                               out=out)

    def get_many(self, keys: Any, *, namespace: str | None = None, layers: Any = None, rows: Any = None,
                 device: str | None = None, out: Any = None) -> list[Any]:
        return self._store.get_many(keys, namespace=self._read_ns(namespace), layers=layers, rows=rows,
                                    device=device, out=out)

    def contains(self, key: str | bytes, *, namespace: str | None = None) -> bool:
        return self._store.contains(key, namespace=self._read_ns(namespace))

    def contains_many(self, keys: Any, *, namespace: str | None = None) -> list[bool]:
        return self._store.contains_many(keys, namespace=self._read_ns(namespace))

    def __contains__(self, key: str | bytes) -> bool:
        return self.contains(key)

    def keys(self, *, namespace: str | None = None, prefix: str | bytes | None = None,
             after: str | bytes | None = None, limit: int | None = None) -> list[str | bytes]:
        return self._store.keys(namespace=self._read_ns(namespace), prefix=prefix, after=after, limit=limit)

    def sessions(self, *, namespace: str | None = None) -> list[str]:
        return self._store.sessions(namespace=self._read_ns(namespace))

    def info(self, key: str | bytes, *, namespace: str | None = None) -> ObjectInfo:
        return self._store.info(key, namespace=self._read_ns(namespace))

    def match_prefix(self, hashes: Any, *, namespace: str | None = None) -> int:
        return self._store.match_prefix(hashes, namespace=self._read_ns(namespace))

    def session_keys(self, session: str, *, namespace: str | None = None) -> list[str | bytes]:
        return self._store.session_keys(session, namespace=self._read_ns(namespace))

    # -- cache tiers (reads: its own namespace and the shared ones) --------------------------

    def prefetch(self, keys: Any, *, namespace: str | None = None, tier: str = "dram", layers: Any = None) -> Any:
        return self._store.prefetch(keys, namespace=self._read_ns(namespace), tier=tier, layers=layers)

    def prefetch_session(self, session: str, *, tier: str = "dram") -> Any:
        return self._store.prefetch_session(session, namespace=self.name, tier=tier)

    def stream_layers(self, key: str | bytes, *, namespace: str | None = None, device: str | None = None,
                      layers: Any = None) -> Iterator[tuple[int, Any]]:
        return self._store.stream_layers(key, namespace=self._read_ns(namespace), device=device, layers=layers)

    def pin(self, key: str | bytes, *, namespace: str | None = None, tier: str = "dram", layers: Any = None) -> None:
        self._store.pin(key, namespace=self._read_ns(namespace), tier=tier, layers=layers)

    def unpin(self, key: str | bytes, *, namespace: str | None = None, tier: str = "dram") -> None:
        self._store.unpin(key, namespace=self._read_ns(namespace), tier=tier)

    @contextmanager
    def pinned(self, key: str | bytes, *, namespace: str | None = None, tier: str = "dram",
               layers: Any = None) -> Iterator["NamespaceHandle"]:
        with self._store.pinned(key, namespace=self._read_ns(namespace), tier=tier, layers=layers):
            yield self

    # -- writes ------------------------------------------------------------------------------

    def put(self, key: str | bytes, obj: KVCache | Vectors | Blob, *, namespace: str | None = None,
            meta: dict[str, Any] | None = None, session: str | None = None, codec: str | None = None) -> None:
        self._store.put(key, obj, namespace=self._write_ns(namespace), meta=meta, session=session, codec=codec)

    def put_many(self, items: Any, *, namespace: str | None = None, session: str | None = None,
                 codec: str | None = None) -> None:
        self._store.put_many(items, namespace=self._write_ns(namespace), session=session, codec=codec)

    def put_async(self, key: str | bytes, obj: KVCache | Vectors | Blob, *, namespace: str | None = None,
                  meta: dict[str, Any] | None = None, session: str | None = None,
                  codec: str | None = None) -> Future:
        return self._store.put_async(key, obj, namespace=self._write_ns(namespace), meta=meta, session=session,
                                     codec=codec)

    def delete(self, key: str | bytes, *, namespace: str | None = None) -> bool:
        return self._store.delete(key, namespace=self._write_ns(namespace))

    def delete_many(self, keys: Any, *, namespace: str | None = None) -> list[bool]:
        return self._store.delete_many(keys, namespace=self._write_ns(namespace))

    def drop_session(self, session: str, *, namespace: str | None = None) -> int:
        return self._store.drop_session(session, namespace=self._write_ns(namespace))
