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
    "session", "cost") as ``open(..., policy=)`` or ``open(..., ssd_policy=)``.  One instance per
    tier (``Store`` copies it with ``fresh()``)."""

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

    def cost_hint(self, key: Hashable, tokens: int) -> None:
        """Before ``admitted``: how many tokens the object holds (a KV cache: its token count;
        0 otherwise).  Policies that weigh what a miss costs use it; others ignore it."""

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


# CostAware's defaults: an 8B-parameter model's prefill (2 FLOPs per parameter per token) on a
# 989 TFLOP/s (dense bf16) accelerator at half its peak; objects without tokens come back from the
# next tier at 1 GB/s
DEFAULT_PARAMS = 8e9
DEFAULT_DEVICE_FLOPS = 989e12
DEFAULT_UTILISATION = 0.5
DEFAULT_REFETCH_BYTES_PER_S = 1e9


def recompute_seconds_per_token(params: float, device_flops: float = DEFAULT_DEVICE_FLOPS,
                      utilisation: float = DEFAULT_UTILISATION) -> float:
    """Seconds to recompute one token's KV in a prefill: 2 * params FLOPs at ``utilisation``
    of ``device_flops`` (attention's quadratic part left out: a lower bound for long contexts)."""
    for name, v in (("params", params), ("device_flops", device_flops), ("utilisation", utilisation)):
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0):
            raise InvalidObject(f"{name} must be a positive number, got {v!r}")
    return 2.0 * params / (device_flops * utilisation)


class CostAware(Policy):
    """What a miss costs, per byte kept -- within recency -- and the session look-ahead of
    ``SessionAware``.

    Each entry has a cost per byte ``C / S``: ``S`` its size in bytes, ``C`` the seconds a miss
    costs -- recomputing its tokens (``tokens * seconds_per_token``; per namespace from
    ``models``, a dict namespace -> parameter count, else the default model) or, for an object
    that holds no tokens, reading its bytes again from the next tier (``S /
    refetch_bytes_per_s``).  The eviction order is the LRU order cut into windows of
    ``1 / window_share`` of the entries (at least 4): inside a window, the cheapest per byte goes
    first (least recently used first among equals).  Recency decides which objects are
    candidates, cost decides among them, so a costly object outlives cheap ones of about its
    age but not recently used ones.  Objects of a session announced by ``prefetch_session`` go
    after every other until read; objects of a dropped session go first.  (Pure GreedyDual-Size,
    where cost and recency add up, kept whole finished conversations of the costly model and lost
    to LRU 13x in miss seconds on a mixed trace; docs/placement.md.)
    """

    name = "cost"

    def __init__(self, *, seconds_per_token: float | None = None, models: dict[str, float] | None = None,
                 refetch_bytes_per_s: float = DEFAULT_REFETCH_BYTES_PER_S,
                 device_flops: float = DEFAULT_DEVICE_FLOPS, utilisation: float = DEFAULT_UTILISATION,
                 window_share: int = 64) -> None:
        self._args = {"seconds_per_token": seconds_per_token, "models": models,
                      "refetch_bytes_per_s": refetch_bytes_per_s, "device_flops": device_flops,
                      "utilisation": utilisation, "window_share": window_share}
        self.spt = seconds_per_token if seconds_per_token is not None else \
            recompute_seconds_per_token(DEFAULT_PARAMS, device_flops, utilisation)
        if not (isinstance(self.spt, (int, float)) and self.spt > 0):
            raise InvalidObject(f"seconds_per_token must be a positive number, got {seconds_per_token!r}")
        if not (isinstance(refetch_bytes_per_s, (int, float)) and refetch_bytes_per_s > 0):
            raise InvalidObject(f"refetch_bytes_per_s must be a positive number, got {refetch_bytes_per_s!r}")
        if isinstance(window_share, bool) or not isinstance(window_share, int) or window_share < 1:
            raise InvalidObject(f"window_share must be a positive int, got {window_share!r}")
        self.refetch = float(refetch_bytes_per_s)
        self.window_share = window_share
        self.per_ns: dict[bytes, float] = {}
        for ns, params in (models or {}).items():
            key = ns.encode("utf-8") if isinstance(ns, str) else bytes(ns)
            self.per_ns[key] = recompute_seconds_per_token(params, device_flops, utilisation)
        self._tokens: dict[Hashable, int] = {}
        self._entries: dict[Hashable, list[float]] = {}  # key -> [C / S, seq of its last admit or read]
        self._sessions: dict[Hashable, tuple[bytes, ...]] = {}
        self._active: OrderedDict[bytes, None] = OrderedDict()
        self._ended: set[bytes] = set()
        self._seq = 0

    def fresh(self) -> "CostAware":
        return CostAware(**self._args)  # type: ignore[arg-type]

    def cost(self, key: Hashable, nbytes: int, tokens: int) -> float:
        """Seconds a miss of this object costs (``C`` above)."""
        if tokens > 0:
            ns = key[0] if isinstance(key, tuple) and key and isinstance(key[0], bytes) else None
            return tokens * self.per_ns.get(ns, self.spt) if ns is not None else tokens * self.spt
        return nbytes / self.refetch

    def cost_hint(self, key: Hashable, tokens: int) -> None:
        self._tokens[key] = int(tokens)

    def admitted(self, key: Hashable, nbytes: int, sessions: tuple[bytes, ...]) -> None:
        self._seq += 1
        self._entries[key] = [self.cost(key, nbytes, self._tokens.pop(key, 0)) / max(1, nbytes), self._seq]
        self._sessions[key] = sessions

    def touched(self, key: Hashable) -> None:
        e = self._entries.get(key)
        if e is None:
            return
        self._seq += 1
        e[1] = self._seq
        for s in self._sessions.get(key, ()):
            self._active.pop(s, None)  # the announced turn is being served

    def removed(self, key: Hashable) -> None:
        self._entries.pop(key, None)
        self._sessions.pop(key, None)
        self._tokens.pop(key, None)

    def session_active(self, session: bytes) -> None:
        self._ended.discard(session)
        self._active[session] = None
        self._active.move_to_end(session)
        while len(self._active) > ACTIVE_MAX:
            self._active.popitem(last=False)

    def session_ended(self, session: bytes) -> None:
        self._active.pop(session, None)
        self._ended.add(session)

    def victims(self) -> Iterator[Hashable]:
        def rank(key: Hashable) -> int:
            ss = self._sessions.get(key, ())
            if ss and all(s in self._ended for s in ss):
                return 0
            return 2 if any(s in self._active for s in ss) else 1

        ordered = sorted((rank(k), e[1], e[0], k) for k, e in self._entries.items())  # rank, then LRU
        width = max(4, len(ordered) // self.window_share)
        for i in range(0, len(ordered), width):
            for item in sorted(ordered[i:i + width], key=lambda t: (t[0], t[2], t[1])):
                yield item[3]


POLICIES: dict[str, type[Policy]] = {"lru": LRU, "session": SessionAware, "cost": CostAware}

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
    """A policy from a name ("lru", "session", "cost") or an instance; None means LRU."""
    if policy is None:
        return LRU()
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str) and policy in POLICIES:
        return POLICIES[policy]()
    raise InvalidObject(f"policy must be one of {', '.join(POLICIES)} or a tierstore.policy.Policy, got {policy!r}")
