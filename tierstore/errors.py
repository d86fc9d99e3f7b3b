"""The exception tree, and nothing else.

Every error tierstore raises on purpose is a ``TierstoreError``.  Errors carry attributes
(``path``, ``offset``, ``key``, ``namespace``, ``segment``) instead of facts buried in the
message, and a ``hint`` that says how to fix the problem.  Failure is never reported by
returning ``None`` or ``False``.

    TierstoreError
    ├── NotFound            (also KeyError)       no such key in the namespace
    ├── StoreNotFound       (also FileNotFoundError) no store at the path and create=False
    ├── CorruptionError                           bad magic / checksum / length / bounds
    ├── FormatVersionError                        written by a newer, incompatible format
    ├── ReadOnlyError                             write on a read-only handle or file
    ├── InvalidObject       (also ValueError)     bad shape, dtype, key, option or argument
    ├── StoreFull                                 no space (ENOSPC) or a tier is full
    ├── StoreLocked                               another writer holds the store
    ├── StoreClosed                               the handle was closed
    └── StoreIOError        (also OSError)        an I/O call failed; see ``poisoned``
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class TierstoreError(Exception):
    """Root of every error tierstore raises on purpose."""

    hint: str | None = None

    def __init__(self, message: str, *, hint: str | None = None, **attrs: Any) -> None:
        super().__init__(message)
        self.message = message
        if hint is not None:
            self.hint = hint
        self.path = attrs.pop("path", None)
        self.offset = attrs.pop("offset", None)
        self.key = attrs.pop("key", None)
        self.namespace = attrs.pop("namespace", None)
        self.segment = attrs.pop("segment", None)
        for name, value in attrs.items():
            setattr(self, name, value)

    def __str__(self) -> str:
        where = []
        if self.path is not None:
            where.append(f"path={self.path}")
        if self.segment is not None:
            where.append(f"segment={self.segment}")
        if self.offset is not None:
            where.append(f"offset={self.offset}")
        if self.namespace is not None:
            where.append(f"namespace={self.namespace!r}")
        if self.key is not None:
            where.append(f"key={self.key!r}")
        text = self.message
        if where:
            text += " [" + ", ".join(where) + "]"
        if self.hint:
            text += f" (hint: {self.hint})"
        return text


class NotFound(TierstoreError, KeyError):
    """The key does not exist in the namespace (also a ``KeyError``).

    ``hint_from``: a function that works the hint out only when someone reads it (``str(e)``,
    ``e.hint``), so that a miss -- the common case of a cache -- costs no more than the lookup."""

    def __init__(self, message: str, *, hint_from: Callable[[], str | None] | None = None, **attrs: Any) -> None:
        self._hint_from = hint_from
        self._hint: str | None = None
        super().__init__(message, **attrs)

    @property  # type: ignore[override]
    def hint(self) -> str | None:
        if self._hint_from is not None:
            find, self._hint_from = self._hint_from, None
            try:
                self._hint = find()
            except Exception:  # the store closed since, or failed: the message stands without a hint
                self._hint = None
        return self._hint

    @hint.setter
    def hint(self, value: str | None) -> None:
        self._hint_from, self._hint = None, value

    def rehint(self, hint_from: Callable[[], str | None]) -> None:
        """Work the hint out with ``hint_from`` instead (when read): a scoped handle's misses name
        only the namespaces it may read."""
        self._hint_from, self._hint = hint_from, None


class StoreNotFound(TierstoreError, FileNotFoundError):
    """No store exists at the path and ``create=False`` was given."""

    hint = "pass create=True to make a new store"


class CorruptionError(TierstoreError):
    """Stored bytes failed validation: bad magic, checksum, length or bounds.

    Raised instead of ever returning wrong bytes.  ``path``/``segment``/``offset`` say where,
    ``key``/``namespace`` which object when known, ``reason`` the check that failed.
    """

    hint = "run `tierstore fsck PATH --deep` to see the damage and `tierstore recover PATH` to repair"

    def __init__(self, message: str, **attrs: Any) -> None:
        attrs.setdefault("reason", message)
        super().__init__(message, **attrs)


class FormatVersionError(TierstoreError):
    """The file needs a newer tierstore (major version or incompatible feature bits)."""

    hint = "upgrade tierstore to read this store"


class ReadOnlyError(TierstoreError):
    """A write was attempted on a read-only handle, or on files written by a newer minor version."""

    hint = "open the store with readonly=False"


class InvalidObject(TierstoreError, ValueError):
    """Bad input: wrong shape or dtype, empty array, bad key/namespace, unknown option."""


class AccessDenied(TierstoreError, PermissionError):
    """A namespace-scoped handle named a namespace it was not granted (or wrote to a shared one)."""

    hint = "use a handle of that namespace, or grant it with store.namespace(name, shared=[...])"


class StoreFull(TierstoreError):
    """No space left: the disk returned ENOSPC, or a cache tier's capacity was reached.

    ``index_full`` is true when the index could not grow: the records it was applying are in
    the log, nothing is lost, and the handle applies them once there is room."""

    index_full = False

    hint = ("free disk space, or delete objects and run compact() (it reclaims their bytes); a store opened "
            "with ssd_bytes= below the disk's free space evicts instead")


class StoreLocked(TierstoreError):
    """Another handle (in this or another process) holds the store's writer lock."""

    hint = "close the other writer, open with readonly=True, or raise lock_timeout="


class StoreClosed(TierstoreError):
    """The store handle was closed."""

    hint = "open the store again with tierstore.open(path)"


class StoreIOError(TierstoreError, OSError):
    """An I/O call failed.  ``errno`` is the OS error number.

    When ``poisoned`` is true the handle refuses further writes: a failed fsync may have
    dropped dirty pages, so retrying could acknowledge data that is not on disk (see
    docs/guide.md, "I/O errors").  Reopen the store: recovery restarts from durable state.
    """

    hint = "reopen the store; recovery restarts from the durable log"
