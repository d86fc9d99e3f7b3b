"""The SSD budget (``open(..., ssd_bytes=)``): the bytes a store occupies on disk, held under a
bound by evicting objects in a policy's order and reclaiming their space (SPEC.md §7.9).

Eviction path:  Store.put -> Capacity.make_room(n) -> [past budget - 2 slack] the eviction thread
                (or, past the budget with the thread idle, the put itself) -> _evict_until ->
                _evict (DELETE groups through Engine.append_group, each object with its session
                references; with downtier=, _down_tier then replaces the victims of lossy-allowed
                namespaces by lossy copies instead: the handle's transcode -> Engine.append) ->
                compaction.reclaim (the deadest sealed segments copied forward, then deleted:
                shrunk away a step at a time by the thread, unlinked by a put)

An eviction is a delete (or, with ``downtier=``, a put of a smaller lossy copy of the object):
crash-safe because it goes through the log like any delete or put, and seen as a miss (or a
lossy object) by every handle and process.  Nothing about the budget is kept apart from the log:
the bytes used are the files' sizes, and the eviction order after a restart starts from the
log's order (oldest record first), refined by this handle's reads.

It owns the budget's accounting, the SSD eviction policy (an instance of the classes of
policy.py, which the cache tiers use too) and its counters.  It never reads or writes a
segment itself and never decides what the cache tiers hold; it is given the Engine (public
methods only) and, by the handle, a predicate saying which objects are pinned and a function
that re-encodes an object (down-tiering).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Hashable, Iterator
from typing import Any

from ..codecs import registry as cdc
from ..engine import compaction
from ..engine.engine import Engine
from ..engine.options import parse_size
from ..errors import InvalidObject, StoreFull
from ..format import constants as fmt
from ..format import record as rec
from ..names import encode_namespace
from . import policy as pol
from .inflight import InFlight

CAPACITY_OPTIONS = ("ssd_bytes", "retain", "ssd_policy", "downtier")
RETAIN = ("always",)  # what retain={namespace: ...} may say
SSD_MIN = 1 << 20  # the smallest budget
# slack = a segment, or 1/64 of the budget if more: the thread wakes 2 slack below the budget and
# evicts down to 3 slack below it; a put stops 1 slack below it (and, if it must evict itself,
# evicts down to 2 below), leaving that slack to padding, the thread's deletes and copies, the index
SLACK_SHARE = 64
ORDER_BATCH = 512  # keys of a resumable policy's eviction order taken per hold of the policy lock
LATER = object()  # _candidates: a session references the object (it goes after the others)
EVICT_UNITS = 64  # victims deleted per hold of the write lock: a put waits for that many, not a whole run
# StoreFull names the index's unused pages (and the rebuild that drops them) from this many (or 1/8
# of the budget, if less: a 1 MiB budget's index held 800 KB of unused pages)
INDEX_BLOAT_HINT = 1 << 20
# under a budget, an index transaction applies about this many records (never part of an atomic
# group): the index file counts in the budget, and LMDB grows it for good by the pages two
# transactions in a row rewrite (Engine.index_txn_records; docs/placement.md has the figures:
# 20,000 2 KB puts on 16 MiB, the index 3.2 -> 2.2 MB).  The cost: the committer spends ~16 us a
# record in 64-record transactions, against 7-9 in 1,000-record ones
BUDGET_INDEX_TXN = 64
RESERVE_SHARE = 8  # the reserve is at most 1/8 of a budget (an explicit larger reserve_bytes is refused)
# a put's eviction rounds in a row that evict nothing and compact without freeing before StoreFull
FUTILE_ROUNDS = 2
FREED_MIN = fmt.SEGMENT_HEADER_SIZE + 2 * fmt.PAGE  # a round that frees less is futile (_evict_until)
# what a synced put adds besides its records: the padding to a page, a SYNC and a HEADERS record
SYNC_FOOTPRINT = fmt.PAGE + 512
ROOM_POLL_S = 0.005  # a put over the bound while the thread evicts looks at the files this often
USAGE_REFRESH_S = 0.01  # far from the bound, a put reads the files' sizes at most this often (other writers)
SEGMENTS_PER_BUDGET = 16  # without segment_bytes=, segments of ssd_bytes / 16: reclaim works on small files
SEGMENTS_PER_BUDGET_MIN = 8  # segment_bytes= given with a budget: at most 1/8 of it
SEGMENT_AUTO_MIN = 64 << 10
# evict-and-reclaim rounds: compact segments at least this dead (the live rest is copied
# forward); a lower share only when evicting more did not free enough
RECLAIM_RATIOS = (0.5, 0.5, 0.25, 0.1)
# down-tiering (downtier=): a lossy copy is kept only if at most this share of its object's record
# (else the object is evicted: a lossless codec already stores it small); one eviction run
# re-encodes for at most this long (flush() waits for it) before deleting the victims left
DOWNTIER_MAX_SHARE = 0.8
DOWNTIER_RUN_S = 2.0


def tokens_of(hdr: rec.RecordHeader) -> int:
    """The tokens a stored object holds: a KV cache's token count (shape [layers, 2, heads,
    tokens, dim]) or an MLA cache's ([layers, tokens, dim]), 0 for other kinds (what a
    cost-weighing policy is told)."""
    shape = hdr.meta.get("shape")
    if hdr.kind == fmt.KIND_KV:
        return int(shape[3]) if isinstance(shape, list) and len(shape) == 5 else 0
    if hdr.kind == fmt.KIND_MLA:
        return int(shape[1]) if isinstance(shape, list) and len(shape) == 3 else 0
    return 0


DOWNTIER_KINDS = {"kv": fmt.KIND_KV, "mla": fmt.KIND_MLA, "vectors": fmt.KIND_VECTORS}  # what lossy codecs take


def downtier_options(spec: Any) -> dict[bytes, dict[int, cdc.Choice]]:
    """``downtier={namespace: codec}`` -> {namespace: {kind id: choice}}: the lossy codec each
    namespace's victims are re-encoded with before they are evicted (the kinds it applies to;
    objects of other kinds are evicted as usual).  InvalidObject on a lossless codec or one that
    applies to no kind."""
    if not isinstance(spec, dict):
        raise InvalidObject(f"downtier must be a dict {{namespace: lossy codec}}, got {type(spec).__name__}")
    out: dict[bytes, dict[int, cdc.Choice]] = {}
    for name, codec in spec.items():
        choices = {}
        for kind, kind_id in DOWNTIER_KINDS.items():
            try:
                choice = cdc.parse(codec, kind)
            except InvalidObject:
                continue
            if choice.codec.lossless:
                raise InvalidObject(f"downtier[{name!r}] = {codec!r} is lossless: down-tiering keeps a smaller, "
                                    "lossy copy", hint="name a lossy codec, e.g. 'int4' or 'fp8' (KV caches) or "
                                                       "'int8' (vectors); a lossless one belongs in codecs=")
            choices[kind_id] = choice
        if not choices:
            raise InvalidObject(f"downtier[{name!r}]: {codec!r} is no lossy codec of {', '.join(DOWNTIER_KINDS)}",
                                hint="e.g. 'int4', 'int8', 'fp8' (KV caches), 'fp8' (MLA), 'int8', 'fp16' (vectors)")
        out[encode_namespace(name)] = choices
    return out


def budget_settings(capacity: dict[str, Any] | None) -> dict[str, Any]:
    """What writable handles of one store in one process must agree on (they share its engine,
    and each evicts by its own settings: a handle without another's ``retain`` would evict the
    namespaces that one keeps), in a form that compares and reads well in an error."""
    if capacity is None:  # (as a budget's defaults: a difference of budget alone names ssd_bytes alone)
        return {"ssd_bytes": None, "retain": [], "ssd_policy": "lru", "downtier": {}}
    return {"ssd_bytes": capacity["budget"],
            "retain": sorted(ns.decode("utf-8") for ns in capacity["retain"]),
            "ssd_policy": capacity["policy"].settings(),
            "downtier": {ns.decode("utf-8"): sorted({c.spec for c in by_kind.values()})
                         for ns, by_kind in sorted(capacity["downtier"].items())}}


def capacity_options(options: dict[str, Any]) -> dict[str, Any] | None:
    """Pop and check ``ssd_bytes``, ``retain``, ``ssd_policy`` and ``downtier`` from ``options``;
    None when the store has no budget.  Without ``segment_bytes``, segments of 1/16 of the budget
    (64 KiB to 1 GiB) are chosen: space comes back a segment at a time."""
    budget, retain = options.pop("ssd_bytes", None), options.pop("retain", None)
    policy, downtier = options.pop("ssd_policy", None), options.pop("downtier", None)
    if budget is None:
        if retain is not None or policy is not None or downtier is not None:
            raise InvalidObject("retain=, ssd_policy= and downtier= apply to the SSD budget: give ssd_bytes= too")
        return None
    budget = parse_size(budget, "ssd_bytes")
    if budget < SSD_MIN:
        raise InvalidObject(f"ssd_bytes must be at least {SSD_MIN} (1 MiB), got {budget}")
    kept: set[bytes] = set()
    if retain is not None:
        if not isinstance(retain, dict):
            raise InvalidObject(f"retain must be a dict {{namespace: 'always'}}, got {type(retain).__name__}")
        for name, how in retain.items():
            if how not in RETAIN:
                raise InvalidObject(f"retain[{name!r}] must be one of {', '.join(map(repr, RETAIN))}, got {how!r}")
            kept.add(encode_namespace(name))
    both = kept & set(downtier_options(downtier)) if downtier is not None else set()
    if both:
        raise InvalidObject(f"namespace {sorted(both)[0].decode('utf-8')!r} is both retained (never evicted) and "
                            "down-tiered (kept as a lossy copy when evicted)", hint="name it in one of the two")
    if "segment_bytes" not in options:
        auto = min(1 << 30, max(SEGMENT_AUTO_MIN, budget // SEGMENTS_PER_BUDGET))
        options["segment_bytes"] = auto - auto % fmt.PAGE
    else:  # space comes back a segment at a time, and the eviction keeps 3 segments free
        seg = parse_size(options["segment_bytes"], "segment_bytes")
        if seg > budget // SEGMENTS_PER_BUDGET_MIN:
            raise InvalidObject(f"segment_bytes={seg} is too large for ssd_bytes={budget}: a budget needs "
                                f"segments of at most 1/{SEGMENTS_PER_BUDGET_MIN} of it",
                                hint=f"leave segment_bytes out (a budget picks 1/{SEGMENTS_PER_BUDGET} of itself) "
                                     f"or give at most {budget // SEGMENTS_PER_BUDGET_MIN}")
    try:
        chosen = pol.make(policy)
    except InvalidObject as e:
        raise InvalidObject(f"ssd_policy: {e.message}") from None
    return {"budget": budget, "retain": frozenset(kept), "policy": chosen,
            "downtier": downtier_options(downtier) if downtier is not None else {}}


class _OwnPuts:
    """``Capacity.own_puts``: the keys a thread appends for the handle, in its thread-local."""

    __slots__ = ("local", "keys")

    def __init__(self, local: threading.local, keys: set[Hashable]) -> None:
        self.local, self.keys = local, keys

    def __enter__(self) -> None:
        self.local.own = self.keys

    def __exit__(self, *exc: Any) -> None:
        self.local.own = ()


class _GiveWay(Exception):
    """Raised inside a down-tiering re-encode when a put waits for room: never leaves this module."""


class Capacity:
    """The budget of one writable handle.  Thread-safe: ``make_room`` runs one eviction at a
    time; the policy is told of puts, reads and deletes under a short lock of its own."""

    def __init__(self, engine: Engine, *, budget: int, retain: frozenset[bytes], policy: pol.Policy,
                 pinned: Callable[[Hashable], bool], downtier: dict[bytes, dict[int, cdc.Choice]] | None = None,
                 transcode: Callable[..., rec.EncodedRecord] | None = None) -> None:
        self.engine, self.budget, self.retain, self.policy, self.pinned = engine, budget, retain, policy, pinned
        engine.index_txn_records = min(engine.index_txn_records, BUDGET_INDEX_TXN)
        engine.limit_reserve(budget // RESERVE_SHARE)  # the reserve counts in the budget
        # down-tiering: namespace -> {kind: lossy codec}, and the handle's re-encoder
        # transcode(ns, key, location, choice, between) -> the PUT record of the object in that
        # codec, calling between() before each extent it encodes; nothing is written
        self.downtier, self.transcode = downtier or {}, transcode
        if self.downtier and transcode is None:
            raise InvalidObject("downtier= needs a handle that re-encodes objects")
        self._room_lock = threading.Lock()  # one eviction at a time (a put's or the thread's)
        self._policy_lock = threading.Lock()
        self._cond = threading.Condition()
        self._used, self._used_at = 0, 0.0  # bytes in use as last read from the files (plus puts since), and when
        self._inflight = 0  # bytes of puts make_room let through and not yet appended
        self._waiting = 0  # puts held up by the bound (make_room): down-tiering gives way to them
        self._est_lock = threading.Lock()
        self._due = self._stopped = False
        self._thread: threading.Thread | None = None
        self.background_error: str | None = None
        self._since: set[Hashable] | None = None  # during an eviction: objects put or read since its order was taken
        self._joining: list[tuple[Any, ...]] = []  # new objects put (and read) during a decision: told after it
        self._joining_keys: set[Hashable] = set()
        # a trace: told of what this handle does and of each eviction under the lock the
        # eviction decides under, so its lines come in the order the decisions saw
        self.follower: Any = None
        # other processes' puts in flight near the bound
        self.shared = InFlight(engine.path, limit=budget, alone=engine.alone)
        # a segment, or 1/64 of the budget if that is more: the unit space comes back in
        self.slack = max(budget // SLACK_SHARE, engine.options.segment_bytes)
        # what a put adds to the files besides its records: with durability="sync" its sync also
        # pads the log to a page and appends a SYNC and a HEADERS record (a 200-byte put takes
        # 4 KiB: counted as 200, the estimate between two reads of the files' sizes fell behind by
        # that much a put, and puts passed the budget by 10 %)
        self._sync_extra = SYNC_FOOTPRINT if engine.durability == "sync" else 0
        self._futile = 0  # a put's eviction rounds in a row that compacted but freed nothing
        self._futile_at: int | None = None  # the files' bytes after the thread's last run, if it freed nothing
        self.counters = {"hits": 0, "misses": 0, "evictions": 0, "evicted_bytes": 0, "compacted_bytes": 0,
                         "eviction_runs": 0, "background_runs": 0, "records_copied": 0,
                         "downtiered": 0, "downtiered_bytes": 0, "downtier_failures": 0, "downtier_skipped": 0}
        self._latency: deque[float] = deque(maxlen=4096)  # evictions a put waited for
        self._background_latency: deque[float] = deque(maxlen=4096)
        self._known: set[Hashable] = set()  # the objects the policy holds
        self._local = threading.local()  # .own: keys this thread is appending for the handle (own_puts)
        engine.subscribe(self._on_write, every_record=True)  # other handles' and other processes' records too
        try:
            self._seed()
        except BaseException:  # (no handle is made to close it: the subscription goes now)
            engine.unsubscribe(self._on_write, every_record=True)
            raise

    # -- what the policy is told ----------------------------------------------------------------

    def _seed(self) -> None:
        """Every object the store holds, oldest record first: the order the log gives after a
        restart (a policy learns recency from here on)."""
        engine = self.engine
        sessions: dict[tuple[bytes, bytes], list[bytes]] = defaultdict(list)
        if engine.may_have_refs:
            pairs = {p[:2] for rk in engine.keys(fmt.REF_NAMESPACE) if (p := rec.parse_ref_key(rk)) is not None}
            for ns, sess in sorted(pairs):
                for target in engine.session_refs(ns, sess).values():
                    sessions[(ns, target)].append(sess)
        held = []
        for ns in engine.namespaces():
            ks = list(engine.keys(ns))
            for k, loc in zip(ks, engine.lookup_many(ns, ks)):
                if loc is not None:
                    held.append((loc.header.lsn, ns, k, loc.header.record_len, tokens_of(loc.header)))
        held.sort()
        with self._policy_lock:
            for _, ns, k, nbytes, tokens in held:
                if tokens:
                    self.policy.cost_hint((ns, k), tokens)
                self.policy.admitted((ns, k), nbytes, tuple(pol.session_id(ns, s) for s in sessions.get((ns, k), ())))
                self._known.add((ns, k))

    def _adopt(self) -> None:
        """Objects the index holds that the policy does not know -- another writer process's puts
        that it applied itself, which this engine never read -- join the policy, oldest first,
        as if just put (their reads in that process are not known here)."""
        engine = self.engine
        found = []
        for ns in engine.namespaces():
            ks = [k for k in engine.keys(ns) if (ns, k) not in self._known]
            for k, loc in zip(ks, engine.lookup_many(ns, ks)):
                if loc is not None:
                    found.append((loc.header.lsn, ns, k, loc.header))
        found.sort(key=lambda t: t[0])
        with self._policy_lock:
            for _, ns, k, hdr in found:
                if (ns, k) not in self._known:
                    self._known.add((ns, k))
                    tokens = tokens_of(hdr)
                    if tokens:
                        self.policy.cost_hint((ns, k), tokens)
                    self.policy.admitted((ns, k), hdr.record_len, ())

    def _on_write(self, key: Hashable, hdr: rec.RecordHeader | None) -> None:
        """Every record appended, this handle's or not (Engine.subscribe: under the append lock, in
        LSN order): an object the policy does not know yet joins it (another handle's or another
        writer process's put), a deleted one leaves it."""
        ns = key[0]  # type: ignore[index]
        if ns.startswith(b"\x00") or (hdr is not None and key in getattr(self._local, "own", ())):
            return  # (a put of this handle: ``admitted`` tells the policy once, with its session)
        with self._policy_lock:
            if hdr is None:
                if key in self._known:
                    self._known.discard(key)
                    self.policy.removed(key)
            elif key not in self._known and hdr.type == fmt.REC_PUT:
                self._known.add(key)
                tokens = tokens_of(hdr)
                if tokens:
                    self.policy.cost_hint(key, tokens)
                self.policy.admitted(key, hdr.record_len, ())

    def own_puts(self, ns: bytes, keys: list[bytes]) -> "_OwnPuts":
        """Around the handle's append of puts of ``keys`` (a context manager): ``_on_write``
        leaves them to ``admitted``, which the handle calls next, so that the policy is told of
        each put once (a second admission moves a session policy's clock: the simulator would
        decide otherwise)."""
        return _OwnPuts(self._local, {(ns, k) for k in keys})

    def admitted(self, ns: bytes, k: bytes, nbytes: int, sessions: tuple[bytes, ...], tokens: int = 0) -> None:
        with self._policy_lock:
            key = (ns, k)
            held = key in self._known and key not in self._joining_keys  # (in the policy's order now)
            self._known.add(key)
            if self._since is not None:  # an eviction is deciding: spared by it
                self._since.add(key)
                if not held:  # a new object joins the order (and the trace) after the decision
                    self._joining.append(("put", ns, k, nbytes, sessions, tokens))
                    self._joining_keys.add(key)
                    return
                # an object of the order put again: traced now, before the evictions it is spared from
            self._admit(ns, k, nbytes, sessions, tokens)

    def _admit(self, ns: bytes, k: bytes, nbytes: int, sessions: tuple[bytes, ...], tokens: int) -> None:
        if tokens:
            self.policy.cost_hint((ns, k), tokens)
        self.policy.admitted((ns, k), nbytes, tuple(pol.session_id(ns, s) for s in sessions))
        if self.follower is not None:
            self.follower.admitted(ns, k, nbytes, sessions, tokens)

    def _touch(self, ns: bytes, k: bytes, nbytes: int, tokens: int) -> None:
        self.policy.touched((ns, k))
        if self.follower is not None:
            self.follower.touched(ns, k, nbytes, tokens)

    def _decided(self) -> None:
        """The end of an eviction's decision (under the policy lock): new objects put while it
        decided join the order now, and their reads after them, so that the policy -- and a
        trace's replay -- sees them after it (a session policy may rank a new object first)."""
        self._since = None
        joining, self._joining = self._joining, []
        self._joining_keys = set()
        for op, ns, k, *rest in joining:
            if (ns, k) in self._known:  # (not deleted meanwhile)
                (self._admit if op == "put" else self._touch)(ns, k, *rest)

    def touched(self, ns: bytes, k: bytes, nbytes: int = 0, tokens: int = 0) -> None:
        with self._policy_lock:
            self.counters["hits"] += 1
            if self._since is not None:
                self._since.add((ns, k))
                if (ns, k) in self._joining_keys:  # put during this decision: read after its put
                    self._joining.append(("touch", ns, k, nbytes, tokens))
                    return
            self._touch(ns, k, nbytes, tokens)

    def missed(self, ns: bytes, keys: list[bytes]) -> None:
        with self._policy_lock:
            self.counters["misses"] += len(keys)
            if self.follower is not None:
                self.follower.missed(ns, keys)

    def removed(self, ns: bytes, keys: list[bytes]) -> None:
        """A handle's deletes, after the fact: ``_on_write`` already took the objects out of the
        order when their DELETE records were appended, under the append lock, before a put of
        the same key could come in again; only the follower is told here."""
        if self.follower is not None:
            with self._policy_lock:
                self.follower.removed(ns, keys)

    def session_active(self, ns: bytes, sess: bytes) -> None:
        with self._policy_lock:
            self.policy.session_active(pol.session_id(ns, sess))
            if self.follower is not None:
                self.follower.session_active(ns, sess)

    def session_ended(self, ns: bytes, sess: bytes) -> None:
        with self._policy_lock:
            self.policy.session_ended(pol.session_id(ns, sess))
            if self.follower is not None:
                self.follower.session_ended(ns, sess)

    # -- making room ----------------------------------------------------------------------------

    def make_room(self, nbytes: int) -> int:
        """Before a put of ``nbytes`` (its records' length).  Past ``budget - 2 * slack`` the
        eviction thread is woken (it evicts down to ``budget - 3 * slack`` while puts go on); a
        put that would pass ``budget - slack`` waits for it, or evicts itself (down to ``budget -
        2 * slack``) when the thread is idle.  StoreFull when the put is larger than the budget, or
        when what is left is pinned or retained (the objects evicted before that was found stay
        evicted).  The caller calls ``landed(nbytes, <what this returned>)`` once the put is
        appended (or failed): until then its bytes count as in flight, so that puts in other
        threads count them too -- and, near the bound, puts in other processes (``inflight.py``:
        returns the bytes published there)."""
        # a slack below the budget, a put stops: what else grows the files meanwhile (page padding,
        # the eviction thread's deletes and copies, the index) has that slack to grow into
        budget, slack = self.budget, self.slack
        stop = budget - slack
        nbytes += self._sync_extra  # (what its sync adds)
        waiting = False
        try:
            while True:
                others = 0
                with self._est_lock:
                    used = self._used  # the files' bytes when last read, plus the puts landed since
                    # (a put larger than a slack is judged on fresh sizes: one on sizes up to
                    # USAGE_REFRESH_S old passed the bound by what others landed meanwhile)
                    near = used + self._inflight + nbytes > budget - 3 * slack or nbytes > slack
                    if near or time.monotonic() - self._used_at > USAGE_REFRESH_S:
                        used = self._refresh()  # near the bound, or other processes may have written
                    used += self._inflight  # puts of other threads not appended yet
                    if used + nbytes > budget - 2 * slack:
                        self._wake()
                    if used + nbytes <= stop:
                        # near the bound, or another process's put near it is in flight
                        if not near and not self.shared.busy():
                            self._inflight += nbytes
                            return 0
                        # other processes' puts in flight count too, and this one for them
                        # with the files read again under the table's lock: a put another process
                        # released before is in them, one it has not is in the table
                        def room_for(others: int, nbytes: int = nbytes) -> bool:
                            return self._refresh() + self._inflight + others + nbytes <= stop

                        fits, others = self.shared.reserve(nbytes, room_for)
                        if fits:
                            self._inflight += nbytes
                            return nbytes
                    if not waiting:
                        waiting = True
                        self._waiting += 1
                # over: the thread may be freeing room already; else evict here
                if self._room_lock.acquire(timeout=ROOM_POLL_S):
                    try:
                        self._evict_until(nbytes, self.budget - 2 * self.slack, strict=True,
                                          inflight=self._inflight + others)
                    finally:
                        self._room_lock.release()
        finally:
            if waiting:
                with self._est_lock:
                    self._waiting -= 1

    def landed(self, nbytes: int, shared: int = 0) -> None:
        """A put that ``make_room`` let through was appended (or failed): no longer in flight
        (``shared``: what ``make_room`` returned, the bytes it told other processes of)."""
        nbytes += self._sync_extra  # (what its sync adds)
        with self._est_lock:
            self._inflight -= nbytes
            self._used += nbytes
        if shared:
            self.shared.release(shared)

    def _refresh(self) -> int:
        """The bytes in use, from the files (``disk_bytes``), remembered with when they were read."""
        self._used, self._used_at = self.engine.disk_bytes(), time.monotonic()
        return self._used

    def _evict_until(self, nbytes: int, target: int, *, strict: bool, inflight: int = 0) -> None:
        """Evict and reclaim until ``nbytes`` more, and the ``inflight`` bytes of puts other threads
        are making, fit under ``target``; with ``strict``, StoreFull if ``nbytes`` alone do not fit
        under ``budget - slack`` afterwards (the others land, then this put fits).  The caller holds
        the room lock."""
        engine = self.engine
        budget = self.budget
        stop = budget - self.slack  # where a put stops (make_room)
        used = engine.disk_bytes()
        if used + inflight + nbytes <= (stop if strict else target) or not strict and used == self._futile_at:
            return  # (the thread's last run freed nothing, and nothing changed since: it would not now)
        if engine.limit_reserve(budget // RESERVE_SHARE):  # (a writer process without a budget grew it)
            used = engine.disk_bytes()
            if used + inflight + nbytes <= (stop if strict else target):
                return
        t0 = time.perf_counter()
        if engine.index is not None and engine.index.count() - engine.index.ref_count() > len(self._known):
            self._adopt()
        floor = engine.disk_usage()[1]  # the index, the reserve and quarantine/: not evictable
        if not strict and floor + inflight + nbytes + 2 * fmt.SEGMENT_HEADER_SIZE >= target:
            # evicting every object would not bring the files under the target: the thread evicts
            # nothing (it emptied the store for nothing when quarantine/ alone held more); a put
            # raises StoreFull naming what holds the room
            self._futile_at = used
            return
        if strict and floor + inflight + nbytes + 2 * fmt.SEGMENT_HEADER_SIZE > target:
            # the put's usual target is out of reach with what cannot be evicted: room for this put
            # only (aiming at the target evicted nearly every object at each put, for nothing)
            target = stop
        if strict and nbytes + floor + 2 * fmt.SEGMENT_HEADER_SIZE > stop:
            need = nbytes + floor + 2 * fmt.SEGMENT_HEADER_SIZE - stop
            bloat, fix = self._index_bloat(need)
            held, clear = self._quarantined(need)
            raise StoreFull(f"a put taking {nbytes} bytes on disk cannot fit in ssd_bytes={budget}: puts stop "
                            f"{budget - stop} bytes below the budget (a segment, or 1/{SLACK_SHARE} of the budget if "
                            f"more: room for padding and compaction's copies) and the index and reserve"
                            f"{' and quarantine/' if held else ''} take {floor}{bloat}{held}",
                            hint=f"raise ssd_bytes={fix}{clear}, or store the object in smaller pieces")
        self.counters["eviction_runs" if strict else "background_runs"] += 1
        # first without evicting: segments mostly dead already (deletes, overwrites) and small ones
        # (what evictions leave: their DELETE, HEADERS and SYNC records) free room no object pays for
        def excess() -> int:
            return engine.disk_bytes() + inflight + nbytes - target

        self._reclaim(excess, RECLAIM_RATIOS[0], strict)
        used = engine.disk_bytes()
        if used + inflight + nbytes <= target:
            (self._latency if strict else self._background_latency).append(time.perf_counter() - t0)
            return
        stuck = futile = False
        for ratio in RECLAIM_RATIOS:
            # evict until segments at least ``ratio`` dead hold the deficit, then compact those
            evicted = self._evict(used + inflight + nbytes - target, ratio, lossy=not strict)
            grown = engine.grown_bytes()
            done = self._reclaim(excess, ratio, strict)
            grown = engine.grown_bytes() - grown
            used = engine.disk_bytes()
            # nothing evicted at the lowest share, and nothing compacted or the compaction freed less
            # than a new segment and a sync take (what it retired less what this handle added to the
            # log meanwhile: copies, carried DELETEs, syncs' records and padding, new segments): stuck -- for
            # a put, when it happens again at its next try (it would compact the same records again,
            # for ever), as once may be other writers' puts landing meanwhile, or objects they put
            # while the order was taken (not victims of this run).  (Not by the files' size: other
            # writer processes' puts grow it while a round frees MBs -- two such rounds in a row
            # raised StoreFull with MBs evictable.)
            freed = done["bytes_before"] - grown
            futile = not evicted and ratio == RECLAIM_RATIOS[-1] and (not done["victims"] or freed < FREED_MIN)
            if futile and strict:
                self._futile += 1
                stuck = self._futile >= FUTILE_ROUNDS
            else:
                stuck = futile
                self._futile_at = used if futile else None
            if used + inflight + nbytes <= target or stuck:
                break
        if strict and not futile:
            self._futile = 0
        (self._latency if strict else self._background_latency).append(time.perf_counter() - t0)
        if strict and stuck and used + nbytes > stop:  # (not stuck: other threads' puts took the room; retry)
            self._futile = 0
            left, fixes = self._left_over(used + nbytes - stop, used)
            raise StoreFull(f"ssd_bytes={budget}: {used} bytes are in use and nothing more can be evicted "
                            f"for a put taking {nbytes} on disk: {left}", hint=f"{fixes}, or delete some objects")

    def _left_over(self, need: int, used: int) -> tuple[str, str]:
        """What holds the ``used`` bytes nothing can be evicted from (for StoreFull): each kind
        that holds some -- pinned objects, retained namespaces, internal records (session
        references, dictionaries), objects with more references than a group holds, the index
        and reserve, and the rest: records that hold no object -- with its bytes, and the fixes
        that apply: those of the kinds that hold ``need`` bytes (what the put lacks) or more, and
        of the largest."""
        engine = self.engine
        held = {"pinned": [0, 0], "retained": [0, 0], "internal": [0, 0], "referenced": [0, 0], "other": [0, 0]}
        retained_seen: set[str] = set()
        for ns in [*engine.namespaces(), fmt.REF_NAMESPACE, fmt.DICT_NAMESPACE]:
            ks = list(engine.keys(ns))
            refs = engine.sessions_of_many(ns, ks) if engine.may_have_refs and not ns.startswith(b"\x00") else {}
            for k, loc in zip(ks, engine.lookup_many(ns, ks)):
                if loc is None:
                    continue
                if ns.startswith(b"\x00"):
                    kind = "internal"
                elif ns in self.retain:
                    kind = "retained"
                    retained_seen.add(ns.decode("utf-8", "replace"))
                elif self.pinned((ns, k)):
                    kind = "pinned"
                elif len(refs.get(k, ())) + 1 > fmt.GROUP_MAX:
                    kind = "referenced"
                else:
                    kind = "other"
                held[kind][0] += loc.header.record_len
                held[kind][1] += 1
        floor = engine.disk_usage()[1]
        said = {
            "pinned": ("pinned", "unpin objects (Store.unpin)"),
            "retained": (f"in retained namespaces ({', '.join(sorted(retained_seen))})",
                         "take namespaces out of retain= or delete some of their objects"),
            "internal": ("of session references and dictionaries", "drop sessions (Store.drop_session)"),
            "referenced": (f"referenced by more sessions than one atomic group holds ({fmt.GROUP_MAX - 1})",
                           "drop sessions"),
            "other": ("of other objects (sharing segments with what cannot go, or put or read while "
                      "the eviction ran)", "retry the put"),
        }
        parts, fixes = [], ["raise ssd_bytes="]
        largest = max(held, key=lambda kind: held[kind][0])
        for kind, (nbytes, count) in held.items():
            if nbytes:
                what, fix = said[kind]
                parts.append(f"{nbytes} bytes {what} ({count} record{'s' if count != 1 else ''})")
                if nbytes >= need or kind == largest:
                    fixes.append(fix)
        bloat, fix = self._index_bloat(need)
        rest = used - floor - sum(nbytes for nbytes, _ in held.values())
        quarantined, clear = self._quarantined(need)
        parts.append(f"{floor} bytes of index and reserve{' and quarantine/' if quarantined else ''}{bloat}"
                     f"{quarantined}")
        if rest > 0:  # (what compaction frees, once the segments that hold it are victims)
            parts.append(f"{rest} bytes of log records that hold no live object (overwritten and deleted objects "
                         f"not compacted yet, deletes, header copies, syncs) and page padding")
        return "; ".join(parts), ", ".join(fixes) + fix + clear

    def _quarantined(self, need: int) -> tuple[str, str]:
        """(what quarantine/ holds, the fix) for StoreFull, when it holds anything: its bytes
        count in the budget, and they are the user's to inspect and delete (the fix is named
        when they are at least ``need``, what a put lacks)."""
        held = self.engine.quarantine_bytes()
        if not held:
            return "", ""
        fix = (f", or delete what recoveries kept (`tierstore quarantine {self.engine.path}` lists it, "
               f"`--clear` deletes it while no process has the store open)") if held >= need else ""
        return f" (quarantine/: {held} bytes cut out of the log by recoveries)", fix

    def _index_bloat(self, need: int) -> tuple[str, str]:
        """(what the index file holds beyond its tables' pages, the fix) for StoreFull, when that
        is at least ``need`` (what a put lacks) and 1 MiB; else empty strings."""
        index = self.engine.index
        if index is None:
            return "", ""
        size, used = index.file_bytes()
        spare = size - used
        if spare < max(need, min(INDEX_BLOAT_HINT, self.budget // 8)):  # (a 1 MiB budget's 800 KB too)
            return "", ""
        return (f" (the index file is {size} bytes, its tables use about {used}: LMDB never shrinks its file, "
                f"and a process killed while it read kept freed pages from reuse)",
                f", or rebuild the index small with `tierstore recover {self.engine.path}` while no process "
                f"has the store open")

    def _reclaim(self, excess: Callable[[], int], ratio: float, strict: bool) -> dict[str, Any]:
        """``compaction.reclaim``, counted (a put that evicts unlinks its victims; the eviction
        thread shrinks them away)."""
        done = compaction.reclaim(self.engine, excess, min_dead_ratio=ratio, gradual=not strict,
                                  batch_bytes=self.slack)  # (room comes back a slack at a time)
        self.counters["compacted_bytes"] += done["bytes_before"]
        self.counters["records_copied"] += done["copied"]
        return done

    # -- the eviction thread ---------------------------------------------------------------------

    def opened(self) -> None:
        """The handle is open: a store already past where the eviction thread starts (reopened
        with a smaller ``ssd_bytes``) is brought under it in the background now -- it stayed over
        until its first put (a cold review, 2026-12-03)."""
        if self.engine.disk_bytes() > self.budget - 2 * self.slack:
            self._wake()

    def _wake(self) -> None:
        with self._cond:
            if self._stopped:
                return
            self._due = True
            if self._thread is None:
                self._thread = threading.Thread(target=self._background, name="tierstore-evict", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _background(self) -> None:
        """Evict down to ``budget - 3 * slack`` whenever woken, so that puts seldom wait.  An error
        here is kept for ``stats`` and left to the puts: one that needs room evicts itself and
        raises what it meets."""
        while True:
            with self._cond:
                while not self._due and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
            with self._room_lock:
                with self._cond:
                    if self._stopped:
                        return
                    self._due = False  # cleared under the room lock: wait_idle sees due or busy
                try:
                    self._evict_until(0, self.budget - 3 * self.slack, strict=False)
                    with self._est_lock:
                        self._refresh()
                except Exception as e:  # kept for stats(); a put that needs room evicts itself and raises it
                    self.background_error = f"{type(e).__name__}: {e}"

    def wait_idle(self) -> None:
        """Return once no eviction is due or under way (``Store.flush``)."""
        while True:
            with self._room_lock, self._cond:
                if not self._due or self._stopped or self._thread is None or not self._thread.is_alive():
                    return
            time.sleep(ROOM_POLL_S)

    def close(self) -> None:
        """Stop the eviction thread (an eviction under way finishes first)."""
        self.engine.unsubscribe(self._on_write, every_record=True)
        with self._cond:
            self._stopped = True
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        self.shared.close()

    def _evict(self, deficit: int, ratio: float, *, lossy: bool = True) -> int:
        """Delete objects in the policy's order -- objects no session references before the
        others, skipping pinned ones and retained and reserved namespaces -- until the segments
        at least ``ratio`` dead hold ``deficit`` dead bytes (those compaction then reclaims) and
        the next object lies in a segment no victim is in (or a segment's worth more went to finish
        the segments begun: one larger, written before the budget was set, is compacted instead),
        or 2 x (``deficit`` + a segment) bytes were evicted.  What is evicted is the start of the
        policy's order, which a log written in that order keeps together: whole segments die, and
        reclaiming them copies only the objects the policy keeps (a reused object in an old
        segment is copied forward: reinserted).

        The victims are chosen without the write lock (puts go on meanwhile) and deleted
        ``EVICT_UNITS`` at a time under it, each object with its session references in one
        group; a victim put, deleted, moved, pinned or read since the order was taken stays.
        Returns the bytes evicted."""
        engine = self.engine
        stats = engine.segment_stats()
        sizes: dict[int, int] = {}

        def share(seg: int, dead: int) -> float:
            if seg not in sizes:
                try:
                    sizes[seg] = max(1, os.path.getsize(engine.segment_path(seg)) - fmt.SEGMENT_HEADER_SIZE)
                except FileNotFoundError:
                    sizes[seg] = 1
            return dead / sizes[seg]

        dead = {seg: d for seg, (d, state) in stats.items() if state == 0 and d > 0}
        counted = sum(d for seg, d in dead.items() if share(seg, d) >= ratio)
        if counted >= deficit:
            return 0
        with self._policy_lock:
            order = self._order()
            self._since = set()  # objects put or read from here on are not victims of this run
        gone: list[Hashable] = []
        chosen: list[tuple[Hashable, Any]] = []
        evicted: list[tuple[Hashable, Any]] = []
        copies: list[tuple[Hashable, Any, cdc.Choice]] = []
        freed = 0
        where = None
        cap = 2 * (deficit + engine.options.segment_bytes)
        try:
            later: list[Hashable] = []  # referenced by a live session: after the others
            touched: set[int] = set()

            def take(key: Hashable, loc: Any) -> None:
                nonlocal counted, freed
                seg, n = loc.segment, loc.header.record_len
                before = dead.get(seg, 0)
                dead[seg] = before + n
                if share(seg, before) >= ratio:
                    counted += n
                elif share(seg, before + n) >= ratio:
                    counted += before + n  # the segment now counts whole
                chosen.append((key, loc))
                touched.add(seg)
                freed += n

            enough_at = None  # bytes evicted when the deficit was covered
            for key, loc in self._candidates(order):
                if freed >= cap:
                    break
                if enough_at is None and counted >= deficit:
                    enough_at = freed
                if loc is LATER:
                    later.append(key)
                elif loc is None:
                    gone.append(key)  # deleted meanwhile (here or by another process)
                elif enough_at is not None and (loc.segment not in touched or
                                                freed - enough_at >= engine.options.segment_bytes):
                    # enough, and the segments begun are finished (the next object is elsewhere), or
                    # a segment's worth more went to finish them: one larger than today's segments
                    # (written before the budget was set) is compacted, its live rest copied
                    break
                else:
                    take(key, loc)
            for key in later:
                if counted >= deficit or freed >= cap:
                    break
                loc = engine.lookup(*key)  # type: ignore[misc]
                if loc is None:
                    gone.append(key)
                else:
                    take(key, loc)
            referenced = set(later)  # the others were chosen unreferenced: one referenced since stays
            for start in range(0, len(chosen), EVICT_UNITS):
                done, kept, where = self._delete_victims(chosen[start:start + EVICT_UNITS], referenced, lossy, where)
                evicted += done
                copies += kept
            if gone:
                with engine.write_lock, self._policy_lock:
                    for key in gone:
                        if key in self._known and engine.lookup(*key) is None:  # type: ignore[misc]
                            self._known.discard(key)
                            self.policy.removed(key)
        finally:
            with self._policy_lock:
                self._decided()
        if where is not None:  # durable with the sync that compaction does before it unlinks anything
            engine.settle_later(where)
        freed = sum(loc.header.record_len for _, loc in evicted)
        taken, kept, replaced = self._down_tier(copies) if copies else (0, 0, 0)
        self.counters["evictions"] += len(evicted) - kept
        self.counters["evicted_bytes"] += freed - replaced
        return freed - taken

    def _candidates(self, order: Iterator[Hashable]) -> Iterator[tuple[Hashable, Any]]:
        """(key, its location, None if it is gone, or ``LATER`` if a session references it:
        looked up when its turn comes) for the keys of the eviction order that may be victims --
        not in a retained or reserved namespace, not pinned, not put or read since the order was
        taken -- ``ORDER_BATCH`` at a time, an index snapshot per namespace.  Which keys are
        referenced is read once per namespace (a walk over a store whose objects sessions all
        reference looks nothing else up)."""
        engine = self.engine
        referenced: dict[bytes, set[bytes]] | None = {} if engine.may_have_refs else None
        while True:
            raw = list(itertools.islice(order, ORDER_BATCH))
            if not raw:
                return
            since = self._since or ()
            batch = [key for key in raw if not (key[0] in self.retain or key[0].startswith(b"\x00")  # type: ignore[index]
                                                 or key in since or self.pinned(key))]
            locs: dict[Hashable, Any] = {}
            by_ns: dict[bytes, list[bytes]] = defaultdict(list)
            for ns, k in batch:  # type: ignore[misc]
                if referenced is not None:
                    if ns not in referenced:
                        referenced[ns] = engine.referenced(ns)
                    if rec.ref_target_hash(k) in referenced[ns]:
                        locs[(ns, k)] = LATER
                        continue
                by_ns[ns].append(k)
            for ns, ks in by_ns.items():
                locs.update(zip([(ns, k) for k in ks], engine.lookup_many(ns, ks)))
            for key in batch:
                yield key, locs[key]

    def _delete_victims(self, part: list[tuple[Hashable, Any]], referenced: set[Hashable], lossy: bool,
                        where: Any) -> tuple[list[tuple[Hashable, Any]], list[tuple[Hashable, Any, cdc.Choice]], Any]:
        """Under one hold of the write lock (it sees every writer's records): the victims of
        ``part`` that still hold the record chosen, are not pinned, were not put or read since,
        and -- unless in ``referenced`` (chosen after the unreferenced ones) -- gained no session
        reference since (another process's put of the same bytes), deleted with their references
        (those with a lossy copy to keep are left to ``_down_tier``), traced and taken out of the
        policy.  Returns the victims taken, the copies to make, and the last append position
        (``where`` if none)."""
        engine = self.engine
        with engine.write_lock:
            by_ns: dict[bytes, list[tuple[Hashable, Any]]] = defaultdict(list)
            for key, loc in part:
                by_ns[key[0]].append((key, loc))  # type: ignore[index]
            units = []
            for ns, items in by_ns.items():
                now = engine.lookup_many(ns, [key[1] for key, _ in items])  # type: ignore[index]
                still = [(key, loc) for (key, loc), cur in zip(items, now)
                         if cur is not None and cur.header.lsn == loc.header.lsn and not self.pinned(key)]
                records = engine.deletions(ns, [(key[1], loc.header.flags) for key, loc in still])  # type: ignore[index]
                units += [(key, loc, unit) for (key, loc), unit in zip(still, records)]
            # each object with its references, in one group: one with more than a group holds is kept
            with self._policy_lock:  # a read racing the decision: before it (then spared) or traced after it
                units = [u for u in units if u[0] not in self._since and len(u[2]) <= fmt.GROUP_MAX  # type: ignore[operator]
                         and (len(u[2]) == 1 or u[0] in referenced)]
                taken = [(key, loc) for key, loc, _ in units]
                if self.follower is not None and taken:
                    self.follower.evicted([key for key, _ in taken], [loc.header.record_len for _, loc in taken])
            # victims with a lossy copy to keep are replaced by it later (outside this lock), not deleted
            copies = [(key, loc, choice) for key, loc in taken
                      if (choice := self._lossy_choice(key, loc.header)) is not None]
            if not lossy:  # a put evicting by itself does not wait for re-encodes: deleted, counted
                self.counters["downtier_skipped"] += len(copies)
                copies = []
            spared = {key for key, _, _ in copies}
            batch: list[rec.EncodedRecord] = []
            for _, _, unit in (u for u in units if u[0] not in spared):
                if len(batch) + len(unit) > fmt.GROUP_MAX:
                    where, batch = engine.append_group(batch), []
                batch += unit
            if batch:
                where = engine.append_group(batch)
            with self._policy_lock:  # before a put of the same key can admit it again (it waits for the write lock)
                for key, _ in taken:
                    self._known.discard(key)
                    self.policy.removed(key)
        return taken, copies, where

    def _order(self) -> Iterator[Hashable]:
        """The policy's eviction order (caller holds the policy lock): listed whole now, or --
        for a policy whose order may be taken in parts (``Policy.victims_resumable``) -- ranked
        now and then taken ``ORDER_BATCH`` keys at a time under the policy lock, so that reads
        and puts telling the policy wait for a batch, not for every object to be listed."""
        victims = self.policy.victims()
        if not getattr(self.policy, "victims_resumable", False):
            return iter(list(victims))
        first = list(itertools.islice(victims, ORDER_BATCH))  # the ranking itself, under the caller's lock

        def rest() -> Iterator[Hashable]:
            yield from first
            while True:
                with self._policy_lock:
                    batch = list(itertools.islice(victims, ORDER_BATCH))
                if not batch:
                    return
                yield from batch

        return rest()

    def _lossy_choice(self, key: Hashable, hdr: rec.RecordHeader) -> cdc.Choice | None:
        """The lossy codec that ``key``'s victim is re-encoded with before it is evicted, or None
        (its namespace keeps no lossy copies, the codec does not take its kind, or it is lossy
        already: a lossy copy chosen again is evicted)."""
        by_kind = self.downtier.get(key[0])  # type: ignore[index]
        if by_kind is None or not cdc.BY_ID[hdr.codec].lossless:
            return None
        return by_kind.get(hdr.kind)

    def _down_tier(self, victims: list[tuple[Hashable, Any, cdc.Choice]]) -> tuple[int, int, int]:
        """Replace each victim by a lossy copy (``downtier=``): re-encoded outside the write lock,
        then appended as a PUT of its key -- only while the key still holds the very record that
        was chosen (same LSN: a put, delete or compaction in between wins, and the object stays
        as it now is) and the object is not pinned -- one record at a time, so that no more than
        one copy is held in memory.  The copy keeps the session references (they name the key)
        and re-enters the policy's order at its own size, as an object that came back without a
        use (``Policy.readmitted``: as if just put for LRU and ``session``).

        A victim is deleted instead, as without ``downtier``, when it cannot be re-encoded (an
        integer dtype, values past float16's range, a damaged or unreadable payload: any error
        of the re-encode), when its copy would not be smaller than ``DOWNTIER_MAX_SHARE`` of its
        record (an object a lossless codec already stores small), and when the run must give
        way: a put waits at the bound, the store is closing, or this run has re-encoded for
        ``DOWNTIER_RUN_S`` (re-encoding runs at the codec's speed, ~40 MB/s for int4 here, slower
        than puts can come; the copy under way stops at its next extent).  Returns the bytes the
        copies took, their number, and the record bytes of the objects they replaced."""
        engine = self.engine
        taken = kept = replaced = 0
        where = None
        deadline = time.monotonic() + DOWNTIER_RUN_S

        def between() -> None:
            if self._waiting or self._stopped or time.monotonic() > deadline:
                raise _GiveWay

        todo = list(victims)
        try:
            while todo:
                key, loc, choice = todo[0]
                ns, k = key  # type: ignore[misc]
                record: rec.EncodedRecord | None = None
                try:
                    between()
                    record = self.transcode(ns, k, loc, choice, between)  # type: ignore[misc]
                    if record.header.record_len > DOWNTIER_MAX_SHARE * loc.header.record_len:
                        record = None
                        self.counters["downtier_failures"] += 1
                except _GiveWay:
                    self.counters["downtier_skipped"] += 1
                except Exception:  # noqa: BLE001 -- any failure to re-encode: evicted as without downtier
                    self.counters["downtier_failures"] += 1
                with engine.write_lock:
                    cur = engine.lookup(ns, k)
                    if cur is None or cur.header.lsn != loc.header.lsn or self.pinned(key):
                        todo.pop(0)  # put again, deleted, moved or pinned since it was chosen: it stays as it is
                        self._readmit(key, cur)
                        continue
                    if record is None:
                        unit = engine.deletion(ns, k, loc.header.flags)
                        if len(unit) > fmt.GROUP_MAX:  # references came meanwhile: kept, as _evict would
                            todo.pop(0)
                            self._readmit(key, cur)
                            continue
                        where = engine.append_group(unit)
                        todo.pop(0)
                        continue
                    sessions = tuple(s for s in engine.sessions_of(ns, k) if s != fmt.ANCHOR_SESSION) \
                        if engine.may_have_refs else ()
                    with self._policy_lock:  # admitted here, with its sessions (not by _on_write)
                        self._known.add(key)
                    try:
                        where = engine.append(record)
                    except BaseException:
                        with self._policy_lock:
                            self._known.discard(key)
                        raise
                    todo.pop(0)
                    n, tokens = record.header.record_len, tokens_of(record.header)
                    with self._policy_lock:
                        if tokens:
                            self.policy.cost_hint(key, tokens)
                        self.policy.readmitted(key, n, tuple(pol.session_id(ns, s) for s in sessions))  # (not a use)
                        if self.follower is not None:
                            self.follower.downtiered(ns, k, n, tokens, sessions)
                taken += n
                kept += 1
                replaced += loc.header.record_len
                self.counters["downtiered"] += 1
                self.counters["downtiered_bytes"] += n
        finally:
            for key, _, _ in todo:  # an error left these neither copied nor deleted: they stay known
                self._readmit(key, engine.lookup(*key))  # type: ignore[misc]
            if where is not None:
                engine.settle_later(where)
        return taken, kept, replaced

    def _readmit(self, key: Hashable, loc: Any) -> None:
        """A victim that stays (or came back as another record): back in the policy's order
        without a use (``Policy.readmitted``), unless it is gone or already known again."""
        if loc is None:
            return
        engine = self.engine
        sessions = tuple(s for s in engine.sessions_of(*key) if s != fmt.ANCHOR_SESSION) \
            if engine.may_have_refs else ()  # type: ignore[misc]
        tokens = tokens_of(loc.header)
        with self._policy_lock:
            if key not in self._known:
                self._known.add(key)
                if tokens:  # (priced as every admission is: by the tokens it holds)
                    self.policy.cost_hint(key, tokens)
                self.policy.readmitted(key, loc.header.record_len, tuple(pol.session_id(key[0], s) for s in sessions))

    # -- figures --------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        def pct(samples: deque[float], q: float) -> float | None:
            lat = sorted(samples)
            return 1000.0 * lat[min(len(lat) - 1, int(q * len(lat)))] if lat else None

        return {"capacity_bytes": self.budget, "bytes_used": self.engine.disk_bytes(), **self.counters,
                "policy": self.policy.name, "retained": sorted(n.decode("utf-8") for n in self.retain),
                "downtier": {ns.decode("utf-8"): next(iter(by_kind.values())).spec
                             for ns, by_kind in sorted(self.downtier.items())},
                "eviction_p99_ms": pct(self._latency, 0.99),
                "background_p99_ms": pct(self._background_latency, 0.99),
                "background_error": self.background_error}
