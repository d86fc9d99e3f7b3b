"""Eviction and admission policies of the cache tiers: in which order unpinned entries leave
a full tier, and (``SecondRead``) which misses enter the DRAM tier at all.

A policy is told when an entry is admitted, touched (a hit) or removed, and when a session
becomes active (``Store.prefetch_session``: a new turn arrived) or ends (``drop_session``);
it answers ``victims()``, the eviction order.  An eviction policy owns no bytes and never
decides admission; ``SecondRead``, the one admission policy, decides which misses are promoted
at all, before a promotion is tried.  ``tier.Tier`` does the capacity accounting and skips
pinned entries; nothing here does I/O.  Policies are not thread-safe on their own: a Tier
calls them under its lock.

Entry keys are opaque hashable values; ``sessions`` are the sessions (``session_id``: the
namespace and the session's name, bytes) holding a reference on the object (SPEC.md §5.4),
empty for an object put without a session.  Two namespaces' sessions of one name are two
sessions: one tenant's ``drop_session`` or ``prefetch_session`` never moves another's objects.
"""

from __future__ import annotations

import heapq
import math
import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from typing import Any

from ..errors import InvalidObject


def session_id(ns: bytes, sess: bytes) -> bytes:
    """A session as policies know it: the namespace's length, the namespace, the session's
    name (as reference keys spell them, SPEC.md §5.4: one spelling per pair, none shared)."""
    return bytes((len(ns),)) + ns + sess


class Policy:
    """The interface.  Subclass it to write your own; pass an instance (or a name: "lru",
    "session", "cost") as ``open(..., policy=)`` or ``open(..., ssd_policy=)``.  One instance per
    tier (``Store`` copies it with ``fresh()``)."""

    name = "policy"
    #: Whether ``victims()`` may be consumed in parts, with other calls to the policy in between
    #: (it works on what it snapshotted, or on its own structures, never on a live dict's
    #: iterator): the SSD budget then takes the order a few hundred keys at a time instead of
    #: holding the policy (and the reads and puts that tell it) while it lists every object.
    #: The built-in policies are; a policy of yours is listed whole unless it says so.
    victims_resumable = False

    def admitted(self, key: Hashable, nbytes: int, sessions: tuple[bytes, ...]) -> None:
        raise NotImplementedError

    def touched(self, key: Hashable) -> None:
        raise NotImplementedError

    def readmitted(self, key: Hashable, nbytes: int, sessions: tuple[bytes, ...]) -> None:
        """An object that left comes back without being used: a lossy copy kept in place of a
        victim (``downtier=``), or a victim that stayed.  Policies that learn from uses
        override it; by default it is ``admitted`` (the object re-enters as if just put)."""
        self.admitted(key, nbytes, sessions)

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

    def settings(self) -> str:
        """The policy's kind and settings, as handles of one store that must evict alike compare
        them (``ssd_policy=``): its name and the arguments ``fresh()`` passes on.  A policy of
        yours (a subclass of a built-in one too) is named by its class; override this if it
        takes arguments (``_settings`` formats them)."""
        return self._settings({})

    def _settings(self, given: dict[str, Any]) -> str:
        """``settings()`` of a policy whose arguments differ from their defaults by ``given``:
        values normalised (numbers as floats, dicts by sorted text keys), so that equal
        settings written two ways compare equal."""
        kind = self.name if type(self).__module__ == __name__ else f"{type(self).__module__}.{type(self).__qualname__}"
        if not given:
            return kind
        return kind + "(" + ", ".join(f"{k}={_normal(v)!r}" for k, v in sorted(given.items())) + ")"


def _normal(v: Any) -> Any:
    """A setting's value in one form: numbers as floats, dicts by sorted text keys."""
    if isinstance(v, bool) or v is None:
        return v
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, dict):  # (an empty dict is no dict: models={} is models=None)
        return dict(sorted(((k.decode("utf-8", "backslashreplace") if isinstance(k, (bytes, bytearray))
                             else str(k)), _normal(x)) for k, x in v.items())) or None
    return v


class LRU(Policy):
    """Least recently used first (the default)."""

    name = "lru"
    victims_resumable = True

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
    victims_resumable = True

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
        return type(self)(self.half_life)

    def settings(self) -> str:
        return self._settings({} if self.half_life == 16.0 else {"half_life": self.half_life})

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
DEFAULT_REUSE = 0.8  # CostAware: the prior probability that a use is followed by another
IDLE_HISTORIES = 65536  # CostAware: histories kept of sessions holding nothing in the tier (the most recent)
IDLE_OBJECT_HISTORIES = 4096  # ... and of objects without a session (evicted: a lossy copy or a put may follow)


def recompute_seconds_per_token(params: float, device_flops: float = DEFAULT_DEVICE_FLOPS,
                      utilisation: float = DEFAULT_UTILISATION) -> float:
    """Seconds to recompute one token's KV in a prefill: 2 * params FLOPs at ``utilisation``
    of ``device_flops`` (attention's quadratic part left out: a lower bound for long contexts)."""
    for name, v in (("params", params), ("device_flops", device_flops), ("utilisation", utilisation)):
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0):
            raise InvalidObject(f"{name} must be a positive number, got {v!r}")
    return 2.0 * params / (device_flops * utilisation)


class _Uses:
    """The use history of one session (or of one object without a session) for ``CostAware``."""

    __slots__ = ("turns", "first", "last", "keys", "ended", "log_per_byte")

    def __init__(self, now: int) -> None:
        self.turns = 0
        self.first = self.last = now  # clock of its first and last turn
        self.keys: OrderedDict[Hashable, None] = OrderedDict()
        self.ended = False
        self.log_per_byte: float | None = None  # log(C / S) shared by all its keys; None: they differ


class CostAware(Policy):
    """What a miss costs per byte, times how likely the object is to be read again soon, and the
    session look-ahead of ``SessionAware``.

    Each entry has a cost per byte ``C / S``: ``S`` its size in bytes, ``C`` the seconds a miss
    costs -- recomputing its tokens (``tokens * seconds_per_token``; per namespace from
    ``models``, a dict namespace -> parameter count, else the default model) or, for an object
    that holds no tokens, reading its bytes again from the next tier (``S /
    refetch_bytes_per_s``).  Reuse is predicted per session (an object put without one, or held
    by several, has its own history): its turns so far give a rate of return ``r``, and the time
    since its last turn, measured in the session's own gaps, says how likely it is to come back
    at all (a session silent for many of its usual gaps has probably ended; one that returns
    every few hundred turns has not, after a hundred).  The entry's worth is ``p_again * r * C / S`` -- the cost it
    saves per byte and per turn of the store kept -- and the least worth goes first (the "hit
    density" of LHD, Beckmann et al., NSDI 2018, with a model of sessions instead of age
    histograms; docs/placement.md gives the formulas).  ``reuse`` is the prior probability that a
    use is followed by another.  Objects of a session announced by ``prefetch_session`` go after
    every other until read; objects of a dropped session go first (one several sessions hold:
    once all of them are dropped); inside a session the newest go first, keeping the prefix a
    later turn reuses.  A history outlives what it held (``IDLE_HISTORIES`` of them): a session's
    next object, or an object put again or kept as a lossy copy, goes on with it.
    (Pure GreedyDual-Size, where cost and recency add up, kept whole finished conversations of
    the costly model and lost to LRU 13x in miss seconds on a mixed trace; docs/placement.md.)
    """

    name = "cost"
    victims_resumable = True

    def __init__(self, *, seconds_per_token: float | None = None, models: dict[str, float] | None = None,
                 refetch_bytes_per_s: float = DEFAULT_REFETCH_BYTES_PER_S,
                 device_flops: float = DEFAULT_DEVICE_FLOPS, utilisation: float = DEFAULT_UTILISATION,
                 reuse: float = DEFAULT_REUSE) -> None:
        self._args = {"seconds_per_token": seconds_per_token, "models": models,
                      "refetch_bytes_per_s": refetch_bytes_per_s, "device_flops": device_flops,
                      "utilisation": utilisation, "reuse": reuse}
        self.spt = seconds_per_token if seconds_per_token is not None else \
            recompute_seconds_per_token(DEFAULT_PARAMS, device_flops, utilisation)
        if not (isinstance(self.spt, (int, float)) and self.spt > 0):
            raise InvalidObject(f"seconds_per_token must be a positive number, got {seconds_per_token!r}")
        if not (isinstance(refetch_bytes_per_s, (int, float)) and refetch_bytes_per_s > 0):
            raise InvalidObject(f"refetch_bytes_per_s must be a positive number, got {refetch_bytes_per_s!r}")
        if isinstance(reuse, bool) or not isinstance(reuse, (int, float)) or not 0 < reuse < 1:
            raise InvalidObject(f"reuse must be a probability in (0, 1), got {reuse!r}")
        self.refetch = float(refetch_bytes_per_s)
        self.reuse = float(reuse)
        self.per_ns: dict[bytes, float] = {}
        for ns, params in (models or {}).items():
            key = ns.encode("utf-8") if isinstance(ns, str) else bytes(ns)
            self.per_ns[key] = recompute_seconds_per_token(params, device_flops, utilisation)
        self._tokens: dict[Hashable, int] = {}
        self._log_per_byte: dict[Hashable, float] = {}  # key -> log(C / S)
        self._clock = 0  # turns of the store: a turn is a run of uses of one session's objects
        self._last: Hashable | None = None
        self._gaps = (0, 0)  # (count, sum) of every session's gaps between turns, in turns
        self._uses: dict[Hashable, _Uses] = {}
        self._group_of: dict[Hashable, Hashable] = {}
        self._active: OrderedDict[Hashable, None] = OrderedDict()  # announced, not yet read
        self._shared: dict[Hashable, tuple[bytes, ...]] = {}  # objects several sessions hold -> their sessions
        self._idle: OrderedDict[Hashable, None] = OrderedDict()  # session histories holding nothing here
        self._idle_objects: OrderedDict[Hashable, None] = OrderedDict()  # the same, of objects' own
        self._held: dict[Hashable, _Uses] = {}  # histories holding objects here (what victims() ranks)

    def fresh(self) -> "CostAware":
        return type(self)(**self._args)  # type: ignore[arg-type]

    def settings(self) -> str:
        defaults = CostAware.__init__.__kwdefaults__
        return self._settings({k: v for k, v in self._args.items() if _normal(v) != _normal(defaults[k])})

    def cost(self, key: Hashable, nbytes: int, tokens: int) -> float:
        """Seconds a miss of this object costs (``C`` above)."""
        if tokens > 0:
            ns = key[0] if isinstance(key, tuple) and key and isinstance(key[0], bytes) else None
            return tokens * self.per_ns.get(ns, self.spt) if ns is not None else tokens * self.spt
        return nbytes / self.refetch

    def cost_hint(self, key: Hashable, tokens: int) -> None:
        self._tokens[key] = int(tokens)

    def _turn(self, gid: Hashable, new_turn: bool = False) -> _Uses:
        u = self._uses.get(gid)
        if u is None:
            u = self._uses[gid] = _Uses(self._clock)
        elif self._last == gid and not new_turn:
            return u  # the same turn goes on
        self._clock += 1
        self._last = gid
        if u.turns:
            n, total = self._gaps
            self._gaps = (n + 1, total + self._clock - u.last)
        else:
            u.first = self._clock
        u.turns += 1
        u.last = self._clock
        u.ended = False
        return u

    def _log_worth(self, u: _Uses) -> float:
        """log(p_again * r) of a history (docs/placement.md), in log space: a long silence
        gives a tiny worth, never 0, so the cost per byte still orders the oldest."""
        n, total = self._gaps
        mean_gap = total / n if n else float(max(1, len(self._uses)))  # no gap seen yet: round robin
        rate = max(1, u.turns) / (u.last - u.first + mean_gap)  # one gap of the store's mean as a prior
        on = math.log(self.reuse) - rate * (self._clock - u.last)  # log(q e^(-r e))
        off = math.log1p(-self.reuse)  # log(1 - q)
        hi, lo = (on, off) if on > off else (off, on)
        return math.log(rate) + on - (hi + math.log1p(math.exp(lo - hi)))

    def worth(self, gid: Hashable) -> float:
        """``p_again * r`` of a session (``("s", id)``) or of an object without one (``("k",
        key)``): its expected uses per turn of the store, given its turns so far and its
        silence since the last one (0.0 for a history this policy does not hold)."""
        u = self._uses.get(gid)
        return 0.0 if u is None else math.exp(self._log_worth(u))

    def admitted(self, key: Hashable, nbytes: int, sessions: tuple[bytes, ...]) -> None:
        self._join(key, nbytes, sessions, use=True)

    def readmitted(self, key: Hashable, nbytes: int, sessions: tuple[bytes, ...]) -> None:
        """Not a use: the object joins its history without adding a turn to it."""
        self._join(key, nbytes, sessions, use=False)

    def _join(self, key: Hashable, nbytes: int, sessions: tuple[bytes, ...], use: bool) -> None:
        per_byte = self.cost(key, nbytes, self._tokens.pop(key, 0)) / max(1, nbytes)
        # one session: its history; none, or several (a shared prefix): the object's own reads
        gid: Hashable = ("s", sessions[0]) if len(sessions) == 1 else ("k", key)
        self.removed(key)
        u = self._uses.get(gid)  # (a history that held nothing goes on, see _forget)
        if use:
            u = self._turn(gid)
        elif u is None:  # not a use, and its history is gone (forgotten): as an object unread
            u = self._uses[gid] = _Uses(0)  # since the first turn, not as a new one
        u.keys[key] = None
        lpb = math.log(per_byte) if per_byte > 0 else -math.inf
        if len(u.keys) == 1:
            u.log_per_byte = lpb
        elif u.log_per_byte != lpb:
            u.log_per_byte = None  # mixed until it holds nothing again
        self._held[gid] = u
        self._idle.pop(gid, None)
        self._idle_objects.pop(gid, None)
        self._group_of[key] = gid
        self._log_per_byte[key] = lpb
        if len(sessions) > 1:
            self._shared[key] = sessions

    def touched(self, key: Hashable) -> None:
        gid = self._group_of.get(key)
        if gid is not None:
            self._active.pop(gid, None)  # the announced turn is being served
            self._turn(gid)

    def removed(self, key: Hashable) -> None:
        self._log_per_byte.pop(key, None)
        self._tokens.pop(key, None)
        self._shared.pop(key, None)
        gid = self._group_of.pop(key, None)
        if gid is None:
            return
        u = self._uses[gid]
        u.keys.pop(key, None)
        if not u.keys:
            del self._held[gid]
            self._forget(gid)

    def _forget(self, gid: Hashable) -> None:
        """A history that holds nothing: kept for the session's next object, the most recent
        ``IDLE_HISTORIES`` of them (a history is ~600 bytes), or for the object's return (put
        again, or kept as a lossy copy: the most recent ``IDLE_OBJECT_HISTORIES`` of those)."""
        idle, bound = (self._idle, IDLE_HISTORIES) if gid[0] == "s" else (self._idle_objects, IDLE_OBJECT_HISTORIES)
        idle[gid] = None
        idle.move_to_end(gid)
        while len(idle) > bound:
            old, _ = idle.popitem(last=False)
            del self._uses[old]
            self._active.pop(old, None)
            if self._last == old:
                self._last = None

    def session_active(self, session: bytes) -> None:
        gid = ("s", session)
        u = self._turn(gid, new_turn=True)  # a turn arrived (its reads follow: one more turn, as in SessionAware)
        if not u.keys:
            self._forget(gid)
        self._active[gid] = None
        self._active.move_to_end(gid)
        while len(self._active) > ACTIVE_MAX:
            self._active.popitem(last=False)

    def session_ended(self, session: bytes) -> None:
        gid = ("s", session)
        self._active.pop(gid, None)
        u = self._uses.get(gid)
        if u is not None:
            u.ended = True

    def _rank(self, gid: Hashable, u: _Uses) -> int:
        """0: every session holding its objects was dropped; 2: one of them is announced; else 1."""
        shared = self._shared.get(gid[1]) if gid[0] == "k" else None
        if shared is None:
            return 0 if u.ended else 2 if gid in self._active else 1
        groups = [self._uses.get(("s", s)) for s in shared]
        if all(g is not None and g.ended for g in groups):
            return 0
        return 2 if any(("s", s) in self._active for s in shared) else 1

    def victims(self) -> Iterator[Hashable]:
        # least worth first; then the longest silent, newest first.  A history's objects of one
        # cost per byte (the common case) are one item, newest first, listed when it comes up
        # (a heap: a caller that needs the first few pays for ranking the histories, not for
        # listing and sorting every object); the newest key breaks ties, so the payloads are
        # never compared.
        ranked: list[tuple[int, float, int, int, Hashable, Any]] = []
        add, log_per_byte = ranked.append, self._log_per_byte
        for gid, u in self._held.items():
            rank, worth, last = self._rank(gid, u), self._log_worth(u), u.last
            if u.log_per_byte is not None:
                add((rank, worth + u.log_per_byte, last, 0, next(reversed(u.keys)), u))
                continue
            keys = list(reversed(u.keys))
            values = [log_per_byte[k] for k in keys]
            lo = min(values)
            if lo == max(values):
                add((rank, worth + lo, last, 0, keys[0], keys))
            else:
                for newest, (key, v) in enumerate(zip(keys, values)):
                    add((rank, worth + v, last, newest, key, None))
        heapq.heapify(ranked)
        while ranked:
            *_, first, payload = heapq.heappop(ranked)
            if payload is None:
                yield first
            elif type(payload) is list:
                yield from payload
            else:  # a history: its keys as they are now (the caller may have gone on meanwhile)
                yield from list(reversed(payload.keys))


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
