"""The memtable: the newest record not yet applied to the index, per (namespace, key).

Owns: that map, and each namespace's keys in key order for listings.  The order is kept
lazily: recording a new key appends it to its namespace's unsorted list (O(1) on the put
path), and the first listing after sorts those few and merges them in; a key dropped is
skipped by listings until the namespace's list is mostly dropped keys, then rebuilt.  A
namespace whose records are all applied is forgotten, so a listing, ``match_prefix`` or a
``contains`` costs what the namespace it reads holds, never what the others hold.

Never: reads the log or the index, decides what is applied, or takes a lock -- every call is
made under the engine's ``_pending_lock``, which guards the memtable with the pending list.
"""

from __future__ import annotations

import bisect
from collections.abc import ItemsView
from typing import Any

Op = Any  # engine.Op (namespace, key, lsn, location): only its ``location`` is read here


class _Space:
    """One namespace's unapplied records: ``live`` (key -> newest record), and its keys in
    order: ``order`` (sorted; may hold dropped keys, ``stale`` of them) + ``fresh`` (in the
    order recorded, none in ``order``).  ``listed`` is the set of keys in ``order``."""

    __slots__ = ("live", "order", "fresh", "listed", "stale")

    def __init__(self) -> None:
        self.live: dict[bytes, Op] = {}
        self.order: list[bytes] = []
        self.fresh: dict[bytes, None] = {}  # (a dict: O(1) to drop one)
        self.listed: set[bytes] = set()
        self.stale = 0

    def ordered(self) -> list[bytes]:
        """``order`` with the fresh keys merged in (and rebuilt without dropped keys once they
        are more than half of it)."""
        if self.stale > len(self.live):
            live = self.live
            self.order = [k for k in self.order if k in live]
            self.listed = set(self.order)
            self.stale = 0
        if self.fresh:
            fresh = sorted(self.fresh)
            self.fresh = {}
            self.listed.update(fresh)
            if len(fresh) <= 8:
                for k in fresh:
                    bisect.insort(self.order, k)
            else:
                self.order += fresh
                self.order.sort()  # (two sorted runs: one merge)
        return self.order


class Memtable:
    """(namespace, key) -> the newest unapplied record (``Op``), with per-namespace order.
    ``get((ns, key))`` is the map's own ``get`` (the hot path of every lookup)."""

    __slots__ = ("_ops", "_spaces", "get")

    def __init__(self) -> None:
        self._ops: dict[tuple[bytes, bytes], Op] = {}
        self._spaces: dict[bytes, _Space] = {}
        self.get = self._ops.get

    def __len__(self) -> int:
        return len(self._ops)

    def __bool__(self) -> bool:
        return bool(self._ops)

    def items(self) -> ItemsView[tuple[bytes, bytes], Op]:
        return self._ops.items()

    def set(self, ns: bytes, k: bytes, op: Op) -> None:
        """Record ``op`` as the newest unapplied record of (ns, k)."""
        sp = self._spaces.get(ns)
        if sp is None:
            sp = self._spaces[ns] = _Space()
        if k not in sp.live:
            if k in sp.listed:
                sp.stale -= 1  # (back in: listed already)
            else:
                sp.fresh[k] = None
        sp.live[k] = op
        self._ops[(ns, k)] = op

    def drop(self, ns: bytes, k: bytes) -> None:
        """Forget (ns, k) (its record is applied, or was taken back)."""
        if self._ops.pop((ns, k), None) is None:
            return
        sp = self._spaces[ns]
        del sp.live[k]
        if not sp.live:
            del self._spaces[ns]
        elif k in sp.listed:
            sp.stale += 1
        else:
            del sp.fresh[k]  # (dropped before a listing sorted it in)

    def prune(self, ns: bytes, applied: int) -> int:
        """Forget ``ns``'s records at or below LSN ``applied`` (the index holds them): a read-only
        handle's memtable, which no committer empties; how many went."""
        sp = self._spaces.get(ns)
        if sp is None:
            return 0
        gone = [k for k, m in sp.live.items() if m.lsn <= applied]
        for k in gone:
            self.drop(ns, k)
        return len(gone)

    def namespaces(self) -> list[bytes]:
        """The namespaces holding unapplied records."""
        return list(self._spaces)

    def has_puts(self, ns: bytes) -> bool:
        """Whether an unapplied record of ``ns`` is a put (not a delete)."""
        sp = self._spaces.get(ns)
        return sp is not None and any(m.location is not None for m in sp.live.values())

    def of(self, ns: bytes) -> dict[bytes, Op]:
        """key -> record of every unapplied record of ``ns`` (a copy)."""
        sp = self._spaces.get(ns)
        return dict(sp.live) if sp is not None else {}

    def scan(self, ns: bytes, prefix: bytes = b"", after: bytes | None = None,
             puts: int | None = None) -> list[tuple[bytes, Op]]:
        """(key, record) of ``ns``'s unapplied records whose key starts with ``prefix``, past
        ``after``, in key order; with ``puts``, it stops at the record that makes ``puts``
        puts (deletes before it are all included)."""
        sp = self._spaces.get(ns)
        if sp is None:
            return []
        order, live = sp.ordered(), sp.live
        if after is not None and after >= prefix:
            i = bisect.bisect_right(order, after)
        else:
            i = bisect.bisect_left(order, prefix)
        out: list[tuple[bytes, Op]] = []
        n, end = 0, len(order)
        while i < end:
            k = order[i]
            i += 1
            if prefix and not k.startswith(prefix):
                break  # (the keys with a prefix are side by side)
            m = live.get(k)
            if m is None:
                continue
            out.append((k, m))
            if m.location is not None:
                n += 1
                if puts is not None and n >= puts:
                    break
        return out

