"""Eviction and admission policies of the cache tiers: in which order unpinned entries leave
a full tier, and (``SecondRead``) which misses enter the DRAM tier at all.

A policy is told when an entry is admitted, touched (a hit) or removed, and when a session
becomes active (``Store.prefetch_session``: a new turn arrived) or ends (``drop_session``);
it answers ``victims()``, the eviction order.  An eviction policy owns no bytes and never
decides admission; ``SecondRead``, the one admission policy, decides which misses are promoted
at all, before a promotion is tried.  ``tier.Tier`` does the capacity accounting and skips
pinned entries; nothing here does I/O.  Policies are not thread-safe on their own: a Tier
calls them under its lock.

Entry keys are opaque hashable values; ``sessions`` are the session ids (bytes) holding a
reference on the object (SPEC.md §5.4), empty for an object put without a session.
"""

from __future__ import annotations

import heapq
import math
import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterator

from ..errors import InvalidObject


class Policy:
    """The interface.  Subclass it to write your own; pass an instance (or a name: "lru",
    "session") as ``open(..., policy=)``.  One instance per tier (``Store`` copies it with
    ``fresh()``)."""

    name = "policy"

    def admitted(self, key: Hashable, nbytes: int, sessions: tuple[bytes, ...]) -> None:
        raise NotImplementedError

    def touched(self, key: Hashable) -> None:
        raise NotImplementedError

    def removed(self, key: Hashable) -> None:
        raise NotImplementedError

    def victims(self) -> Iterator[Hashable]:
        """Entry keys, first to evict first (every admitted key not yet removed)."""
        raise NotImplementedError

    def session_active(self, session: bytes) -> None:
        """A session has a new turn (its objects are about to be read)."""

    def session_ended(self, session: bytes) -> None:
        """A session was dropped: its objects are the first to go."""

    def fresh(self) -> "Policy":
        """A new, empty policy of the same kind and settings (one per tier)."""
        return type(self)()


class LRU(Policy):
    """Least recently used first (the default)."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def admitted(self, key: Hashable, nbytes: int, sessions: tuple[bytes, ...]) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touched(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def removed(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def victims(self) -> Iterator[Hashable]:
        return iter(list(self._order))


class _Group:
    __slots__ = ("log_score", "keys", "ended")

    def __init__(self) -> None:
        self.log_score = -math.inf  # log2 of the session's decayed activity, at clock 0
        self.keys: OrderedDict[Hashable, None] = OrderedDict()
        self.ended = False


ACTIVE_MAX = 256  # sessions announced by prefetch_session and not yet read: protected


class SessionAware(Policy):
    """Keeps the objects of sessions likely to come back (AttentionStore-style).

    Each session has a score: its turns, each worth 1 when it happens and halving every
    ``half_life`` turns of the whole store after (recency and frequency in one number: a
    session that returns often outranks one seen once, a little more recently).  A turn is
    a ``prefetch_session`` call or a run of touches of the session's objects not
    interrupted by another session.  A session announced by ``prefetch_session`` (a turn
    waiting to be served: AttentionStore's scheduler-aware eviction) is kept over every
    session not waiting, until its objects are read.  Eviction takes whole sessions, lowest score first;
    inside a session, the newest entries go first, so what stays is the leading part of the
    conversation (the prefix a later turn can reuse).  Dropped sessions go before all
    others.  Objects without a session are ranked as one-object sessions.
    """

    name = "session"

    def __init__(self, half_life: float = 16.0) -> None:
        if not half_life > 0:
            raise InvalidObject(f"half_life must be positive, got {half_life!r}")
        self.half_life = float(half_life)
        self._clock = 0
        self._last: bytes | Hashable | None = None
        self._groups: dict[Hashable, _Group] = {}
        self._group_of: dict[Hashable, Hashable] = {}
        self._active: OrderedDict[Hashable, None] = OrderedDict()  # queued turns, not yet served

    def fresh(self) -> "SessionAware":
        return SessionAware(self.half_life)

    def _activate(self, gid: Hashable, new_turn: bool = False) -> _Group:
        g = self._groups.get(gid)
        if g is None:
            g = self._groups[gid] = _Group()
        if self._last != gid or new_turn:
            self._clock += 1
            self._last = gid
            # score = 2**log_score * 2**(-clock / half_life): add one turn now, in log space
            now = self._clock / self.half_life
            g.log_score = now + math.log2(1.0 + 2.0 ** (g.log_score - now)) if g.log_score > -math.inf else now
            g.ended = False
        return g

    def admitted(self, key: Hashable, nbytes: int, sessions: tuple[bytes, ...]) -> None:
        self.removed(key)
        gid: Hashable = ("s", sessions[0]) if len(sessions) == 1 else ("k", key)
        if len(sessions) > 1:  # shared by several sessions: ranked with the most active one
            gid = max((("s", s) for s in sessions),
                      key=lambda s: self._groups[s].log_score if s in self._groups else -math.inf)
        g = self._activate(gid)
        g.keys[key] = None
        self._group_of[key] = gid

    def touched(self, key: Hashable) -> None:
        gid = self._group_of.get(key)
        if gid is not None:
            self._active.pop(gid, None)  # the queued turn is being served
            self._activate(gid)

    def removed(self, key: Hashable) -> None:
        gid = self._group_of.pop(key, None)
        if gid is None:
            return
        g = self._groups[gid]
        g.keys.pop(key, None)
        if not g.keys and gid[0] == "k":
            del self._groups[gid]

    def session_active(self, session: bytes) -> None:
        gid = ("s", session)
        self._activate(gid, new_turn=True)
        self._active[gid] = None
        self._active.move_to_end(gid)
        while len(self._active) > ACTIVE_MAX:
            self._active.popitem(last=False)

    def session_ended(self, session: bytes) -> None:
        g = self._groups.get(("s", session))
        if g is not None and g.keys:
            g.ended = True
        elif g is not None:
            del self._groups[("s", session)]

    def victims(self) -> Iterator[Hashable]:
        ranked = [(not g.ended, gid in self._active, g.log_score, i, gid)
                  for i, (gid, g) in enumerate(self._groups.items()) if g.keys]
        heapq.heapify(ranked)
        while ranked:
            *_, gid = heapq.heappop(ranked)
            g = self._groups.get(gid)
            if g is not None:
                yield from reversed(list(g.keys))


POLICIES: dict[str, type[Policy]] = {"lru": LRU, "session": SessionAware}

ADMISSIONS = ("first", "second")
SECOND_READ_MEMORY = 16384  # objects whose first read SecondRead remembers
SECOND_READ_MIN_BYTES = 64 << 10  # smaller reads are left to the page cache


class SecondRead:
    """Admission on the second read: a get's miss is cached only if the same object (same
    record LSN) missed before, among the last ``remember`` objects that missed.

    A store read once per object (a scan, a put followed by one get, a recovery pass) then
    leaves the tier as it was, and nothing of the object's size is held that the caller did
    not ask twice for (the "doorkeeper" of TinyLFU and of CDN caches).  Reads of fewer than
    ``min_bytes`` are never admitted: the log writes and reads small records through the page
    cache, which serves them as fast as a tier hit (measured: 4 KiB blobs 8.5 us per get from
    the page cache, 9.5 us from the tier).  Explicit promotions (``prefetch``, ``pin``,
    ``stream_layers``) do not ask.  Thread-safe.
    """

    def __init__(self, remember: int = SECOND_READ_MEMORY, min_bytes: int = SECOND_READ_MIN_BYTES) -> None:
        self.remember, self.min_bytes = remember, min_bytes
        self._seen: OrderedDict[Hashable, int] = OrderedDict()
        self._lock = threading.Lock()

    def admit(self, key: Hashable, lsn: int) -> bool:
        with self._lock:
            if self._seen.pop(key, None) == lsn:
                return True
            self._seen[key] = lsn
            if len(self._seen) > self.remember:
                self._seen.popitem(last=False)
            return False


def make(policy: str | Policy | None) -> Policy:
    """A policy from a name ("lru", "session") or an instance; None means LRU."""
    if policy is None:
        return LRU()
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str) and policy in POLICIES:
        return POLICIES[policy]()
    raise InvalidObject(f"policy must be one of {', '.join(POLICIES)} or a tierstore.policy.Policy, got {policy!r}")
