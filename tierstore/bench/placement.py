"""The placement section of ``tierstore bench`` (docs/placement.md): the generated traces replayed
by ``tierstore simulate`` at DRAM = 10 % and SSD = 50 % of their data (slow-tier bytes and
recompute tokens per policy, against LRU and Belady; LRU and the cost model also with lossy
int4 copies kept in place of evicted KV chunks), and the SSD budget on a real store: put
latency with the budget full (evicting) against the same puts while it is empty, in one run.
It measures and reports; it never asserts.
"""

from __future__ import annotations

import os
import random
import shutil
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..tiers import simulate as sim
from ..tiers import workloads
from .common import pyplot

LOSSY_POLICIES = ("lru", "cost")  # also run with down-tiering to int4 (as "lru+int4", "cost+int4")


def lossy_share(root: str, codec: str = "int4") -> float:
    """The stored size of a KV chunk in ``codec`` as a share of its lossless record: a Llama-3-8B
    shaped chunk of 4 layers (int4's codes and scales take the same share of any float16 chunk
    of head_dim 128), put both ways into a real store."""
    from .. import KVCache
    from .. import open as open_store

    path = os.path.join(root, "lossy-share")
    shutil.rmtree(path, ignore_errors=True)
    data = np.random.default_rng(2).standard_normal((4, 2, 8, 256, 128)).astype(np.float16)
    with open_store(path) as s:
        s.put("raw", KVCache(data))
        s.put("lossy", KVCache(data), codec=codec)
        share = s.info("lossy").stored_bytes / s.info("raw").stored_bytes
    shutil.rmtree(path, ignore_errors=True)
    return round(share, 4)


def bench_simulation(root: str, *, quick: bool, say: Callable[..., None]) -> dict[str, Any]:
    share = lossy_share(root)
    out: dict[str, Any] = {"dram_share": 0.1, "ssd_share": 0.5, "int4_share": share, "traces": {}}
    small = {"chat": {"sessions": 60}, "mixed": {"sessions": 60}, "tenants": {"requests": 800},
             "rag": {"queries": 500}, "agent": {"agents": 12}} if quick else {}
    for shape in sorted(workloads.SHAPES):
        ops = workloads.generate(shape, seed=0, **small.get(shape, {}))
        data = sim.data_bytes(ops)
        models = dict(workloads.MIXED_MODELS) if shape == "mixed" else None  # else: an 8B model
        kv_namespaces = {o["ns"] for o in ops if o.get("tokens")}
        runs = {}
        for p in (*sim.POLICY_NAMES, *(f"{p}+int4" for p in LOSSY_POLICIES)):
            t0 = time.perf_counter()
            policy, lossy = p.partition("+")[::2]
            r = sim.simulate(ops, dram_bytes=data // 10, ssd_bytes=data // 2, policy=policy, models=models,
                             downtier={ns: share for ns in kv_namespaces} if lossy else None)
            runs[p] = {k: r[k] for k in ("misses", "bytes_slow", "recompute_tokens", "miss_seconds", "bytes_from_ssd",
                                         "dram_hit_rate", "ssd_hit_rate", "miss_rate", "downtiered", "lossy_hits")}
            runs[p]["seconds"] = round(time.perf_counter() - t0, 2)
        lru, best = runs["lru"]["bytes_slow"], runs["belady"]["bytes_slow"]
        for r in runs.values():
            r["slow_vs_lru"] = round(lru / r["bytes_slow"], 3) if r["bytes_slow"] else None  # > 1: fewer bytes
            r["slow_vs_belady"] = round(r["bytes_slow"] / best, 3) if best else None
        out["traces"][shape] = {"ops": len(ops), "data_bytes": data, "runs": runs}
        say(f"  {shape:8} " + "  ".join(f"{p} {r['bytes_slow'] / 2**30:,.1f} GiB" for p, r in runs.items()))
    return out


def _puts(s: Any, keys: range, data: Any, lat: list[float]) -> None:
    from .. import KVCache

    for i in keys:
        t0 = time.perf_counter()
        s.put(f"k{i}", KVCache(data))
        lat.append(time.perf_counter() - t0)


def bench_budget(root: str, *, quick: bool, say: Callable[..., None]) -> dict[str, Any]:
    """Durable puts of KV chunks into a store with ``ssd_bytes``: while it is empty (no eviction),
    then once it is full (every put past the bound, evicting in the background)."""
    from .. import open as open_store

    out: dict[str, Any] = {}
    budget = (256 if quick else 1024) << 20
    for chunk_mib in (4, 32):
        path = os.path.join(root, f"budget-{chunk_mib}")
        shutil.rmtree(path, ignore_errors=True)
        data = np.random.default_rng(1).standard_normal(((chunk_mib << 20) // (2 * 8 * 256 * 128 * 2), 2, 8, 256,
                                                         128)).astype(np.float16)
        per = budget // data.nbytes
        empty: list[float] = []
        full: list[float] = []
        peak = 0
        with open_store(path, ssd_bytes=budget, durability="sync") as s:
            _puts(s, range(0, per // 2), data, empty)  # half the budget: no eviction
            _puts(s, range(per // 2, per), data, [])  # fill
            n = max(50, 3 * per)
            for i in range(per, per + n):
                _puts(s, range(i, i + 1), data, full)
                peak = max(peak, s.stats()["tiers"]["ssd"]["bytes_used"]) if i % 8 == 0 else peak
            st = s.stats()["tiers"]["ssd"]
        shutil.rmtree(path, ignore_errors=True)

        def pct(xs: list[float], q: float) -> float:
            xs = sorted(xs)
            return round(1000 * xs[min(len(xs) - 1, int(q * len(xs)))], 2)

        r = {"chunk_bytes": data.nbytes, "budget": budget, "puts_empty": len(empty), "puts_full": len(full),
             "empty_p50_ms": pct(empty, 0.5), "empty_p99_ms": pct(empty, 0.99),
             "full_p50_ms": pct(full, 0.5), "full_p99_ms": pct(full, 0.99),
             "evictions": st["evictions"], "evicted_bytes": st["evicted_bytes"],
             "compacted_bytes": st["compacted_bytes"], "records_copied": st["records_copied"],
             "puts_that_evicted_themselves": st["eviction_runs"], "background_runs": st["background_runs"],
             "peak_bytes_used_sampled": peak}
        r["p99_full_vs_empty"] = round(r["full_p99_ms"] / r["empty_p99_ms"], 2)
        out[f"{chunk_mib}MiB"] = r
        say(f"  budget {budget >> 20} MiB, {chunk_mib} MiB puts: p99 {r['empty_p99_ms']} ms empty, "
            f"{r['full_p99_ms']} ms full ({r['p99_full_vs_empty']}x); {r['evictions']} evictions, "
            f"{r['records_copied']} records copied")
    return out


def bench_budget_small(root: str, *, quick: bool, say: Callable[..., None]) -> dict[str, Any]:
    """4 KiB blobs, each put under one of 2,000 sessions, with a read of an earlier key after
    30 % of the puts (durability="none": the eviction's own cost, not the disk's sync), into a
    store without a budget and into one whose budget fills early (every policy): put latency,
    and the puts that waited over 100 ms (the eviction thread fell behind, or held a lock)."""
    from .. import Blob, NotFound
    from .. import open as open_store

    n, budget = (8_000, 16 << 20) if quick else (30_000, 48 << 20)
    blob = Blob(np.random.default_rng(0).integers(0, 255, 4096, dtype=np.uint8).tobytes())
    out: dict[str, Any] = {}
    for policy in (None, "lru", "session", "cost"):
        path = os.path.join(root, f"budget-small-{policy}")
        shutil.rmtree(path, ignore_errors=True)
        opts = {} if policy is None else {"ssd_bytes": budget, "ssd_policy": policy}
        rng = random.Random(1)
        lat: list[float] = []
        with open_store(path, durability="none", segment_bytes=budget // 12 - budget // 12 % 4096, **opts) as s:
            for i in range(n):
                t0 = time.perf_counter()
                s.put(f"k{i}", blob, session=f"s{rng.randrange(2000)}")
                lat.append(time.perf_counter() - t0)
                if rng.random() < 0.3:
                    try:
                        s.get(f"k{rng.randrange(i + 1)}")
                    except NotFound:  # (evicted)
                        pass
            st = s.stats()["tiers"].get("ssd", {})
        shutil.rmtree(path, ignore_errors=True)
        lat.sort()
        name = policy or "no budget"
        out[name] = {"puts": n, "budget": budget if policy else None,
                     "p50_ms": round(1000 * lat[n // 2], 3), "p99_ms": round(1000 * lat[int(0.99 * n)], 3),
                     "max_ms": round(1000 * lat[-1], 1), "over_100ms": sum(x > 0.1 for x in lat),
                     "seconds": round(sum(lat), 2),
                     "evictions": st.get("evictions", 0), "records_copied": st.get("records_copied", 0)}
        r = out[name]
        say(f"  4 KiB puts, {name}: {r['seconds']} s, p50 {r['p50_ms']} ms, p99 {r['p99_ms']} ms, max {r['max_ms']} "
            f"ms, {r['over_100ms']} over 100 ms, {r['evictions']} evictions")
    return out


def bench_placement(root: str, *, quick: bool, say: Callable[..., None]) -> dict[str, Any]:
    return {"simulation": bench_simulation(root, quick=quick, say=say),
            "budget": bench_budget(root, quick=quick, say=say),
            "budget_small": bench_budget_small(root, quick=quick, say=say)}


def markdown_placement(r: dict[str, Any]) -> list[str]:
    sim_r = r["simulation"]
    lines = ["", "## Placement: generated traces at DRAM 10 %, SSD 50 % of their data", "",
             f"`+int4`: SSD victims of KV namespaces kept as int4 copies of {sim_r.get('int4_share', 0):.1%} of "
             "their bytes (`downtier=`), evicted when chosen again; their reads are hits, counted as lossy hits.", "",
             "| trace | policy | misses | GiB from the slow tier | recompute tokens | miss seconds | "
             "fewer slow bytes than LRU | slow bytes vs Belady | lossy hits |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for shape, t in sim_r["traces"].items():
        for p, x in t["runs"].items():
            vs_lru = f"{x['slow_vs_lru']}x" if x["slow_vs_lru"] else "-"
            vs_best = f"{x['slow_vs_belady']}x" if x["slow_vs_belady"] is not None else "- (Belady: 0)"
            lines.append(f"| {shape} | {p} | {x['misses']:,} | {x['bytes_slow'] / 2**30:,.1f} | "
                         f"{x['recompute_tokens']:,} | {x['miss_seconds']:,.2f} | {vs_lru} | {vs_best} | "
                         f"{x.get('lossy_hits', 0):,} |")
    lines += ["", "## The SSD budget: durable put latency, budget full (evicting) vs empty", "",
              "| chunk | budget | p50 empty / full ms | p99 empty / full ms | p99 full / empty | evictions | "
              "records copied | puts that evicted themselves |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, b in r["budget"].items():
        lines.append(f"| {name} | {b['budget'] >> 20} MiB | {b['empty_p50_ms']} / {b['full_p50_ms']} | "
                     f"{b['empty_p99_ms']} / {b['full_p99_ms']} | {b['p99_full_vs_empty']}x | {b['evictions']} | "
                     f"{b['records_copied']} | {b['puts_that_evicted_themselves']} |")
    small = r.get("budget_small")
    if small:
        lines += ["", "## The SSD budget: 4 KiB puts with sessions and reads (durability none), by policy", "",
                  "| policy | budget | seconds in puts | p50 ms | p99 ms | max ms | puts over 100 ms | evictions | "
                  "records copied |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for name, b in small.items():
            budget = f"{b['budget'] >> 20} MiB" if b["budget"] else "-"
            lines.append(f"| {name} | {budget} | {b['seconds']} | {b['p50_ms']} | {b['p99_ms']} | {b['max_ms']} | "
                         f"{b['over_100ms']} | {b['evictions']} | {b['records_copied']} |")
    return lines


def plot_placement(r: dict[str, Any], path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    traces = r["simulation"]["traces"]
    fig, axes = plt.subplots(1, len(traces), figsize=(3 * len(traces), 3.2))
    for ax, (shape, t) in zip(axes, traces.items()):
        names = list(t["runs"])
        ax.bar(names, [t["runs"][p]["bytes_slow"] / 2**30 for p in names],
               color=["#999999", "#4c72b0", "#dd8452", "#55a868", "#bbbbbb", "#8172b3"][:len(names)])
        ax.set_title(shape, fontsize=10)
        ax.tick_params(axis="x", labelsize=7, labelrotation=60)
    axes[0].set_ylabel("GiB from the slow tier")
    fig.suptitle("Slow-tier bytes per policy (DRAM 10 %, SSD 50 % of the data)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
