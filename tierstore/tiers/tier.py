"""One cache tier (DRAM or GPU): its entries, byte-accurate capacity, pins, policy, counters.

An entry holds some extents of one stored object, keyed by (namespace, key) and tagged with
the record header its bytes came from: an entry whose header is not the object's current
one (``record.same_object``) is stale and never served.  The DRAM tier holds extents exactly
as the segment stores them (encoded, if the record has a codec); the GPU tier holds them
decoded, in the raw extent layout of SPEC.md §5.3, so a GPU hit is one device copy.

This module owns accounting and eviction order; it does no I/O (``hierarchy`` fills tiers)
and never waits for room: a reservation that cannot be met fails at once (``StoreFull``
when the caller asked for the bytes to be cached, a quiet "no" for an opportunistic
promotion).  Invariant, under the lock: used + reserved <= capacity.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..errors import StoreFull
from ..format import record as rec
from .policy import Policy

PROBATION_SHARE = 4  # first-read (probation) entries hold at most 1/4 of a tier that admits on the second read


@dataclass
class Entry:
    hdr: rec.RecordHeader
    extents: dict[int, Any] = field(default_factory=dict)  # extent index -> buffer (uint8)
    nbytes: int = 0
    sessions: tuple[bytes, ...] = ()


def _nbytes(buf: Any) -> int:
    return int(buf.nbytes) if hasattr(buf, "nbytes") else int(buf.numel())


class Tier:
    """Entries of one tier.  Thread-safe; eviction callbacks run outside the lock."""

    def __init__(self, name: str, capacity: int, policy: Policy, io_path: str,
                 on_evict: Callable[[Hashable, Entry], None] | None = None) -> None:
        self.name, self.capacity, self.policy, self.io_path = name, capacity, policy, io_path
        self.on_evict = on_evict
        self.lock = threading.RLock()
        self.entries: dict[Hashable, Entry] = {}
        self.pins: dict[Hashable, int] = {}
        self.used = 0
        self.reserved = 0
        self.counters = {"hits": 0, "misses": 0, "bytes_in": 0, "bytes_out": 0, "evictions": 0,
                         "promotions": 0, "demotions_in": 0, "admissions_refused": 0, "bytes_read_through": 0,
                         "probation_admissions": 0, "probation_hits": 0}
        self._latency: deque[float] = deque(maxlen=4096)
        # entries admitted on a first read (SLRU's probation segment, at most 1/PROBATION_SHARE of
        # the tier): evicted first, oldest first; a probation insert never evicts anything else,
        # so a one-pass scan churns only this share; a second read moves an entry out of it
        self.probation: OrderedDict[Hashable, None] = OrderedDict()
        self.probation_bytes = 0
        self.probation_cap = capacity // PROBATION_SHARE

    # -- lookups ------------------------------------------------------------------------------

    def _valid(self, key: Hashable, hdr: rec.RecordHeader) -> Entry | None:
        e = self.entries.get(key)
        if e is not None and not rec.same_object(e.hdr, hdr):
            self._remove(key)  # an older version of the object: never served
            return None
        return e

    def lookup(self, key: Hashable, hdr: rec.RecordHeader, wanted: list[int], *, count: bool = True
               ) -> dict[int, Any] | None:
        """Buffers of extents ``wanted`` if the tier holds all of them for this version of the
        object (a hit), else None (a miss).  Either way a read of an object the tier holds
        (all of the extents wanted, or some: the rest is read and added) is a use, which the
        policy is told of; a hit on an entry on probation keeps it from then on (reading the
        rest of an object, e.g. layer by layer, does not)."""
        with self.lock:
            e = self._valid(key, hdr)
            if count and e is not None:
                self.policy.touched(key)
            if e is not None and all(i in e.extents for i in wanted):
                if count:
                    if key in self.probation:  # read again: kept (protected) from now on
                        del self.probation[key]
                        self.probation_bytes -= e.nbytes
                        self.counters["probation_hits"] += 1
                    self.counters["hits"] += 1
                    self.counters["bytes_out"] += sum(_nbytes(e.extents[i]) for i in wanted)
                return {i: e.extents[i] for i in wanted}
            if count:
                self.counters["misses"] += 1
            return None

    def missing(self, key: Hashable, hdr: rec.RecordHeader, wanted: list[int]) -> list[int]:
        with self.lock:
            e = self._valid(key, hdr)
            return list(wanted) if e is None else [i for i in wanted if i not in e.extents]

    def holds(self, key: Hashable, hdr: rec.RecordHeader) -> bool:
        with self.lock:
            return self._valid(key, hdr) is not None

    # -- room -------------------------------------------------------------------------------

    def reserve(self, nbytes: int, *, required: bool, for_key: Hashable | None = None,
                probation: bool = False) -> bool:
        """Set aside ``nbytes`` for an insert, evicting unpinned entries: probation entries
        first (oldest first), then in policy order.  A ``probation`` insert (a first read)
        evicts only probation entries and must fit in the probation share.

        False (nothing evicted) if it cannot be done; with ``required`` StoreFull instead.
        """
        evicted: list[tuple[Hashable, Entry]] = []
        with self.lock:
            free = self.capacity - self.used - self.reserved
            over = self.probation_bytes + nbytes - self.probation_cap if probation else 0
            if nbytes > free or over > 0:
                plan, gain, pgain = [], 0, 0
                order: Iterable[Hashable] = list(self.probation)
                if not probation:  # taken as far as needed (under the lock: nothing changes meanwhile)
                    order = itertools.chain(order, (k for k in self.policy.victims() if k not in self.probation))
                for key in order:
                    if free + gain >= nbytes and pgain >= over:
                        break
                    if key == for_key or self.pins.get(key):
                        continue
                    plan.append(key)
                    n = self.entries[key].nbytes
                    gain += n
                    pgain += n if key in self.probation else 0
                if free + gain < nbytes or pgain < over:
                    self.counters["admissions_refused"] += 1
                    if required:
                        pinned = sum(e.nbytes for k, e in self.entries.items() if self.pins.get(k))
                        raise StoreFull(f"the {self.name} tier cannot make room for {nbytes} bytes "
                                        f"(capacity {self.capacity}, {pinned} bytes pinned, "
                                        f"{self.reserved} bytes being promoted)",
                                        hint="unpin objects or open the store with a larger "
                                             f"{self.name}_bytes")
                    return False
                for key in plan:
                    evicted.append((key, self.entries[key]))
                    self._remove(key)
                    self.counters["evictions"] += 1
            self.reserved += nbytes
        if self.on_evict is not None:
            for key, e in evicted:
                self.on_evict(key, e)
        return True

    def release(self, nbytes: int) -> None:
        """Give back a reservation that was not used (a failed read)."""
        with self.lock:
            self.reserved -= nbytes

    def insert(self, key: Hashable, hdr: rec.RecordHeader, extents: dict[int, Any], *, reserved: int,
               sessions: tuple[bytes, ...] = (), seconds: float | None = None, demoted: bool = False,
               probation: bool = False) -> None:
        """Add extents (their bytes were reserved) to the entry of ``key``'s version ``hdr``;
        ``probation``: a first read's entry (see ``reserve``)."""
        with self.lock:
            self.reserved -= reserved
            e = self._valid(key, hdr)
            new = e is None
            if e is None:
                e = self.entries[key] = Entry(hdr, {}, 0, sessions)
                if probation:
                    self.probation[key] = None
                    self.counters["probation_admissions"] += 1
            elif not probation and key in self.probation:  # promoted on purpose: protected
                del self.probation[key]
                self.probation_bytes -= e.nbytes
            added = 0
            for i, buf in extents.items():
                if i not in e.extents:
                    e.extents[i] = buf
                    added += _nbytes(buf)
            e.nbytes += added
            self.used += added
            # told with the bytes it now holds; more extents of an entry held are not a use (the
            # read that wanted them was: ``lookup`` told the policy)
            (self.policy.admitted if new else self.policy.readmitted)(key, e.nbytes, e.sessions)
            if key in self.probation:
                self.probation_bytes += added
            self.counters["bytes_in"] += added
            self.counters["demotions_in" if demoted else "promotions"] += 1
            if seconds is not None:
                self._latency.append(seconds)
            assert added <= reserved, "inserted more bytes than were reserved"

    def invalidate(self, key: Hashable, hdr: rec.RecordHeader | None = None) -> None:
        """Drop ``key``'s entry unless it holds the same object as ``hdr`` (None: drop it)."""
        with self.lock:
            e = self.entries.get(key)
            if e is not None and (hdr is None or not rec.same_object(e.hdr, hdr)):
                self._remove(key)

    def clear(self) -> None:
        """Drop every unpinned entry (not counted as evictions)."""
        with self.lock:
            for key in [k for k in self.entries if not self.pins.get(k)]:
                self._remove(key)

    def _remove(self, key: Hashable) -> None:
        e = self.entries.pop(key)
        self.used -= e.nbytes
        if key in self.probation:
            del self.probation[key]
            self.probation_bytes -= e.nbytes
        self.policy.removed(key)

    # -- pins ---------------------------------------------------------------------------------

    def pin(self, key: Hashable) -> None:
        with self.lock:
            self.pins[key] = self.pins.get(key, 0) + 1

    def unpin(self, key: Hashable) -> bool:
        """Release one pin; False if ``key`` was not pinned."""
        with self.lock:
            n = self.pins.get(key, 0)
            if n == 0:
                return False
            if n == 1:
                del self.pins[key]
            else:
                self.pins[key] = n - 1
            return True

    # -- figures ------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        with self.lock:
            lat = sorted(self._latency)
            pinned = sum(e.nbytes for k, e in self.entries.items() if self.pins.get(k))
            out: dict[str, Any] = {
                "bytes_used": self.used, "capacity_bytes": self.capacity, "bytes_reserved": self.reserved,
                "objects": len(self.entries), "pinned_objects": sum(1 for k in self.entries if self.pins.get(k)),
                "pinned_bytes": pinned, "probation_bytes": self.probation_bytes,
                "probation_capacity_bytes": self.probation_cap, **self.counters, "io_path": self.io_path,
                "policy": self.policy.name,
                "promotion_p50_ms": _pct(lat, 0.50), "promotion_p99_ms": _pct(lat, 0.99),
            }
        return out


def _pct(sorted_s: list[float], q: float) -> float | None:
    if not sorted_s:
        return None
    return 1000.0 * sorted_s[min(len(sorted_s) - 1, int(q * len(sorted_s)))]
