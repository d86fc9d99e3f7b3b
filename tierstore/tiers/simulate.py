"""Trace replay against placement policies (``tierstore simulate``, docs/placement.md): a DRAM
tier over the SSD budget, byte-accurate, run by the policy classes the live store runs
(policy.py: "lru", "session", "cost") or by Belady's optimum, which knows the future.  No
data is read or written.

The model, per trace op, in order (objects are keyed by namespace and key):
- ``put``: the object is stored on the SSD (a copy in DRAM is dropped: it is stale).
- ``get``: a DRAM hit; else an SSD hit, whose bytes are read and admitted into DRAM; else a
  **miss**: the object comes from the slowest tier -- recomputed (its ``tokens``) or fetched
  again (its ``bytes``) -- and is stored on the SSD, as a serving engine does.
- ``delete``: gone from both; ``session`` / ``drop``: the policies are told.
A tier that must make room evicts in its policy's order, objects no session references
before the others on the SSD (the rule of ``capacity.Capacity``); DRAM holds only what the
SSD holds.  An object larger than a tier is not kept there.  With ``downtier``, an SSD victim
of a namespace that allows it is replaced by a lossy copy of a given share of its bytes (the
rule of ``Capacity._down_tier``), which a later eviction removes.

``follow=True`` checks a trace recorded by a store with ``ssd_bytes`` instead: the
simulator never evicts on its own, and at each run of ``evict`` lines it asks the policy
for its order and checks that the store evicted exactly that many objects from its front --
the live store and the simulator share the policy code, and this shows they decide alike.

It owns the replay and the ``Belady`` policy (offline: it is given each access's next use).
It never touches a store.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any

from ..errors import InvalidObject
from . import policy as pol

POLICY_NAMES = ("lru", "session", "cost", "belady")


class Belady(pol.Policy):
    """Belady's MIN: evict what is read again farthest in the future (never first).  Optimal
    in misses for objects of one size; with sizes it is the classic bound, not the optimum of
    bytes.  Offline: ``future`` (key -> index of its next ``get``, math.inf for none) is kept
    current by the simulator before each access."""

    name = "belady"

    def __init__(self, future: dict[Hashable, float] | None = None) -> None:
        self.future = future if future is not None else {}
        self._keys: dict[Hashable, None] = {}

    def fresh(self) -> "Belady":
        return Belady(self.future)

    def admitted(self, key: Hashable, nbytes: int, sessions: tuple[bytes, ...]) -> None:
        self._keys[key] = None

    def touched(self, key: Hashable) -> None:
        pass

    def removed(self, key: Hashable) -> None:
        self._keys.pop(key, None)

    def victims(self) -> Iterator[Hashable]:
        future = self.future
        heap = [(-future.get(k, math.inf), i, k) for i, k in enumerate(self._keys)]
        heapq.heapify(heap)
        while heap:
            yield heapq.heappop(heap)[2]


def make_policy(name: str | pol.Policy, future: dict[Hashable, float],
                models: dict[str, float] | None = None) -> pol.Policy:
    if name == "belady":
        return Belady(future)
    if name == "cost":
        return pol.CostAware(models=models)
    if isinstance(name, str) and name not in POLICY_NAMES:
        raise InvalidObject(f"policy must be one of {', '.join(POLICY_NAMES)}, got {name!r}")
    return pol.make(name)


def show(key: Hashable) -> str:
    """A (namespace, key) as ``namespace/key`` (bytes keys in hex)."""
    ns, k = key  # type: ignore[misc]
    try:
        return f"{ns.decode('utf-8')}/{k.decode('utf-8')}"
    except UnicodeDecodeError:
        return f"{ns.decode('utf-8', 'replace')}/0x{k.hex()}"


def key_of(op: dict[str, Any]) -> tuple[bytes, bytes]:
    """The (namespace, key) of a trace op, as the store keys its policies."""
    k = op["key"].encode("utf-8") if "key" in op else bytes.fromhex(op["key_hex"])
    return op["ns"].encode("utf-8"), k


class _Tier:
    def __init__(self, name: str, capacity: int, policy: pol.Policy,
                 shrink: Callable[[Hashable], tuple[int, int, tuple[bytes, ...]] | None] | None = None) -> None:
        self.name, self.capacity, self.policy = name, capacity, policy
        # down-tiering: a victim -> (bytes, tokens, sessions) of the lossy copy kept in its place, or None
        self.shrink = shrink
        self.held: dict[Hashable, int] = {}
        self.used = 0
        self.evictions = 0
        self.downtiered = 0

    def remove(self, key: Hashable) -> None:
        n = self.held.pop(key, None)
        if n is not None:
            self.used -= n
            self.policy.removed(key)

    def admit(self, key: Hashable, nbytes: int, sessions: tuple[bytes, ...], tokens: int,
              referenced: dict[Hashable, tuple[bytes, ...]] | None, evicted: list[Hashable]) -> bool:
        """Hold ``key``, evicting in the policy's order (referenced objects last when
        ``referenced`` is given); False if it cannot fit."""
        self.remove(key)
        if nbytes > self.capacity:
            return False
        while self.used + nbytes > self.capacity:  # (a second pass meets the copies the first one kept)
            order = list(self.policy.victims())
            if referenced is not None:
                order = [k for k in order if not referenced.get(k)] + [k for k in order if referenced.get(k)]
            if not order:
                break
            for victim in order:
                if self.used + nbytes <= self.capacity:
                    break
                copy = self.shrink(victim) if self.shrink is not None else None
                self.remove(victim)
                evicted.append(victim)
                if copy is None:
                    self.evictions += 1
                else:  # replaced by its lossy copy, which re-enters the order without a use (Capacity._down_tier)
                    self.downtiered += 1
                    self.hold(victim, *copy, use=False)
        self.hold(key, nbytes, tokens, sessions)
        return True

    def hold(self, key: Hashable, nbytes: int, tokens: int, sessions: tuple[bytes, ...], use: bool = True) -> None:
        """Hold ``key`` (``use``: a put; else a lossy copy kept in place of a victim: not a use)."""
        if tokens:
            self.policy.cost_hint(key, tokens)
        (self.policy.admitted if use else self.policy.readmitted)(key, nbytes, sessions)
        self.held[key] = nbytes
        self.used += nbytes


def next_uses(ops: list[dict[str, Any]]) -> list[float]:
    """For each op, the index of the next ``get`` of its object (math.inf when none)."""
    out = [math.inf] * len(ops)
    nxt: dict[tuple[bytes, bytes], float] = {}
    for i in range(len(ops) - 1, -1, -1):
        op = ops[i]
        if op["op"] in ("put", "get", "delete", "evict", "downtier"):
            key = key_of(op)
            out[i] = nxt.get(key, math.inf)
            if op["op"] == "get":
                nxt[key] = i
    return out


def simulate(ops: Iterable[dict[str, Any]], *, dram_bytes: int, ssd_bytes: int, policy: str | pol.Policy,
             follow: bool = False, retain: Iterable[str] = (), models: dict[str, float] | None = None,
             downtier: dict[str, float] | None = None) -> dict[str, Any]:
    """Replay ``ops`` (trace ops, e.g. from ``trace.read_trace`` or ``workloads.generate``);
    returns the figures of docs/placement.md.  ``follow``: see the module's docstring (the
    ``mismatches`` figure lists any eviction the policy would not have made).  ``models``
    (namespace -> parameter count) prices the misses (``miss_seconds``: the cost model's ``C``)
    and configures the "cost" policy.  ``downtier`` (namespace -> the size of a lossy copy as a
    share of the object's, e.g. 0.31 for int4 KV of float16): an SSD victim of such a namespace
    is replaced by its lossy copy, as ``open(..., downtier=)`` does, and evicted only when chosen
    again; reads of copies count as hits and in ``lossy_hits`` (a recorded trace's ``downtier``
    lines are what ``follow`` replays instead; Belady keeps no copies: it is the lossless bound)."""
    ops = list(ops)
    future: dict[Hashable, float] = {}
    nexts = next_uses(ops) if policy == "belady" else []
    pricing = pol.CostAware(models=models)
    ratios = {ns.encode("utf-8"): float(r) for ns, r in (downtier or {}).items()}
    for ns, r in ratios.items():
        if not 0 < r < 1:
            raise InvalidObject(f"downtier[{ns.decode()!r}]: the lossy copy's share of the bytes is in (0, 1), got {r}")
    if ratios and follow:
        raise InvalidObject("downtier applies to a simulation that evicts; --follow replays the trace's downtier lines")
    lossy: set[Hashable] = set()  # objects the SSD holds as lossy copies

    def shrink(key: Hashable) -> tuple[int, int, tuple[bytes, ...]] | None:
        ratio = ratios.get(key[0])  # type: ignore[index]
        if ratio is None or key in lossy:
            return None
        nbytes, tokens = sizes.get(key, (0, 0))
        lossy.add(key)
        return max(1, int(nbytes * ratio)), tokens, sessions.get(key, ())

    # Belady is the bound of lossless caching: it keeps no copies
    ssd = _Tier("ssd", ssd_bytes, make_policy(policy, future, models),
                shrink if ratios and policy != "belady" else None)
    dram = _Tier("dram", dram_bytes, ssd.policy.fresh()) if dram_bytes > 0 else None
    retained = {r.encode("utf-8") for r in retain}
    sizes: dict[Hashable, tuple[int, int]] = {}  # key -> (bytes, tokens)
    sessions: dict[Hashable, tuple[bytes, ...]] = {}
    f = {"gets": 0, "dram_hits": 0, "ssd_hits": 0, "misses": 0, "bytes_requested": 0, "bytes_from_dram": 0,
         "bytes_from_ssd": 0, "bytes_slow": 0, "recompute_tokens": 0, "miss_seconds": 0.0, "bytes_written_ssd": 0,
         "not_stored": 0, "lossy_hits": 0, "bytes_lossy": 0,
         "unknown_size_misses": 0}
    mismatches: list[dict[str, Any]] = []
    checked = [0]
    evicted: list[Hashable] = []
    pending_evicts: list[Hashable] = []

    def store(key: Hashable, nbytes: int, tokens: int, sess: tuple[bytes, ...]) -> None:
        if dram is not None:
            dram.remove(key)
        lossy.discard(key)
        ssd_cap = ssd.capacity
        if follow:
            ssd.capacity = math.inf  # type: ignore[assignment]  # the trace's evict lines decide
        if not ssd.admit(key, nbytes, sess, tokens, sessions, evicted):
            f["not_stored"] += 1
        ssd.capacity = ssd_cap
        for k in evicted:
            if dram is not None:
                dram.remove(k)  # evicted, or replaced by a lossy copy: a DRAM copy is stale either way
            if k in ssd.held and k in lossy:
                f["bytes_written_ssd"] += ssd.held[k]
            else:
                lossy.discard(k)
        evicted.clear()
        f["bytes_written_ssd"] += nbytes

    def check_follow() -> None:
        if not pending_evicts:
            return
        n = len(pending_evicts)
        order = [k for k in ssd.policy.victims() if k[0] not in retained]  # type: ignore[index]
        order = [k for k in order if not sessions.get(k)] + [k for k in order if sessions.get(k)]
        checked[0] += n
        if set(order[:n]) != set(pending_evicts):
            mismatches.append({"store": [show(k) for k in pending_evicts], "policy": [show(k) for k in order[:n]]})
        for k in pending_evicts:
            ssd.remove(k)
            if dram is not None:
                dram.remove(k)
        ssd.evictions += n  # (the store's evictions, replayed)
        pending_evicts.clear()

    for i, op in enumerate(ops):
        kind = op["op"]
        if follow and kind != "evict":
            check_follow()
        if kind in ("put", "get", "delete", "evict", "downtier"):
            key = key_of(op)
            if nexts:
                future[key] = nexts[i]
        if kind == "put":
            nbytes, tokens = int(op.get("bytes", 0)), int(op.get("tokens", 0))
            sizes[key] = (nbytes, tokens)
            sess = (pol.session_id(key[0], op["session"].encode("utf-8")),) if op.get("session") else ()
            sessions[key] = sess
            store(key, nbytes, tokens, sess)
        elif kind == "get":
            f["gets"] += 1
            nbytes, tokens = sizes.get(key) or (int(op.get("bytes", 0)), int(op.get("tokens", 0)))
            f["bytes_requested"] += nbytes
            if key in lossy and key in ssd.held:  # (DRAM holds only what the SSD holds)
                f["lossy_hits"] += 1
                f["bytes_lossy"] += ssd.held[key]
            if dram is not None and key in dram.held:
                f["dram_hits"] += 1
                f["bytes_from_dram"] += dram.held[key]
                dram.policy.touched(key)
                ssd.policy.touched(key)
            elif key in ssd.held:
                f["ssd_hits"] += 1
                f["bytes_from_ssd"] += ssd.held[key]
                ssd.policy.touched(key)
                if dram is not None:
                    dram.admit(key, ssd.held[key], sessions.get(key, ()), tokens, None, [])
            else:
                f["misses"] += 1
                if not nbytes:
                    f["unknown_size_misses"] += 1
                f["bytes_slow"] += nbytes
                f["recompute_tokens"] += tokens
                f["miss_seconds"] += pricing.cost(key, nbytes, tokens)
                if nbytes and not follow:  # recomputed and stored (a recorded trace has the put)
                    sizes[key] = (nbytes, tokens)
                    store(key, nbytes, tokens, sessions.get(key, ()))
        elif kind == "delete":
            ssd.remove(key)
            if dram is not None:
                dram.remove(key)
            sessions.pop(key, None)
            lossy.discard(key)
        elif kind == "downtier" and follow:  # the store kept a lossy copy of what it just evicted
            n, tokens = int(op.get("bytes", 0)), int(op.get("tokens", 0))
            ssd.remove(key)  # the store admits a copy with every session that references it
            ssd.hold(key, n, tokens, tuple(pol.session_id(key[0], x.encode("utf-8")) for x in op.get("sessions", ())),
                     use=False)
            lossy.add(key)
            f["bytes_written_ssd"] += n
        elif kind in ("session", "drop"):
            sess_id = pol.session_id(op["ns"].encode("utf-8"), op["session"].encode("utf-8"))
            for t in (ssd, dram):
                if t is not None:
                    (t.policy.session_active if kind == "session" else t.policy.session_ended)(sess_id)
        elif kind == "evict" and follow:
            pending_evicts.append(key)
    if follow:
        check_follow()
    gets = max(1, f["gets"])
    name = policy if isinstance(policy, str) else policy.name
    f["miss_seconds"] = round(f["miss_seconds"], 3)
    return {"policy": name, **f, "dram_hit_rate": round(f["dram_hits"] / gets, 4),
            "ssd_hit_rate": round(f["ssd_hits"] / gets, 4), "miss_rate": round(f["misses"] / gets, 4),
            "ssd_evictions": ssd.evictions, "dram_evictions": dram.evictions if dram is not None else 0,
            "downtiered": ssd.downtiered + (sum(op["op"] == "downtier" for op in ops) if follow else 0),
            "dram_bytes": dram_bytes, "ssd_bytes": ssd_bytes,
            **({"mismatches": mismatches, "evictions_checked": checked[0]} if follow else {})}


def data_bytes(ops: Iterable[dict[str, Any]]) -> int:
    """The bytes of the distinct objects a trace puts or reads (what the tiers are sized against)."""
    seen: dict[tuple[bytes, bytes], int] = {}
    for op in ops:
        if op["op"] in ("put", "get") and op.get("bytes"):
            seen[key_of(op)] = int(op["bytes"])
    return sum(seen.values())
