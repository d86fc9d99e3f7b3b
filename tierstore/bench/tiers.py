"""The cache tiers' benchmark section of ``tierstore bench`` (``--sections tiers``).

Three measurements, each against a baseline run in the same process:
  - DRAM-hit get of a 1 MiB layer and of a 32 MiB chunk vs a plain numpy copy of the bytes;
  - SSD -> DRAM promotion (``prefetch(tier="dram")``) vs raw ``os.preadv`` of the same bytes
    from the segment file, both from the page cache and both cold (pages dropped first);
  - a multi-turn chat trace replayed against the LRU and the session-aware policy with a
    DRAM budget of 10% of the data: hit rate and bytes read from the log.
It uses only the public API (and the segment file's bytes, read as SPEC.md describes them);
it measures and never asserts.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import KVCache
from .. import open as open_store
from ..engine.segment import segment_name
from ..format import constants as fmt
from ..format import record as rec
from .common import drop_pages, pyplot, time_ms


def bench_hits_and_promotion(root: str, *, reps: int, say: Callable[..., None]) -> dict[str, Any]:
    kv = np.random.default_rng(0).standard_normal((32, 2, 8, 256, 128)).astype(np.float16)
    layer = np.ascontiguousarray(kv[5])
    out: dict[str, Any] = {}
    with open_store(root, dram_bytes="256MiB", durability="none") as s:
        s.put("chunk", KVCache(kv))
        s.flush()
        s.prefetch("chunk").result()
        for name, get, copy in (("layer_1mib", lambda: s.get("chunk", layers=5), layer.copy),
                                ("chunk_32mib", lambda: s.get("chunk"), kv.copy)):
            get()
            t_get, t_copy = time_ms(get, reps * 10), time_ms(copy, reps * 10)
            out[name] = {"dram_hit_get_ms": round(t_get, 4), "numpy_copy_ms": round(t_copy, 4),
                         "ratio_vs_copy": round(t_get / t_copy, 2)}
            say(f"  DRAM-hit get, {name}: {t_get:.3f} ms vs numpy copy {t_copy:.3f} ms "
                f"({t_get / t_copy:.2f}x; target <= 1.3x)")
        info = s.info("chunk")
        path = os.path.join(root, fmt.SEGMENTS_DIR, segment_name(info.segment))
        fd = os.open(path, os.O_RDONLY)
        hdr = rec.decode_header(os.pread(fd, 1 << 16, info.offset))  # where the extents are, from SPEC.md §4
        start, nbytes = info.offset + hdr.offsets[0], sum(hdr.extent_lengths)
        buf = np.empty(nbytes, np.uint8)

        def promote() -> None:
            s.drop_cached(tier="dram")
            s.prefetch("chunk").result()

        def raw() -> None:
            os.preadv(fd, [buf], start)

        try:
            for mode in ("warm", "cold"):
                if mode == "cold":
                    def prep() -> None:
                        drop_pages(path)
                else:
                    def prep() -> None:
                        pass
                tp, tr = [], []
                for _ in range(reps * 2):  # interleaved, so drift hits both alike
                    prep()
                    tr.append(time_ms(raw, 1))
                    prep()
                    tp.append(time_ms(promote, 1))
                p, r = sorted(tp)[len(tp) // 2], sorted(tr)[len(tr) // 2]
                mib = nbytes / (1 << 20)
                out[f"promotion_{mode}"] = {"promote_ms": round(p, 3), "raw_pread_ms": round(r, 3),
                                            "promote_gib_s": round(mib / 1024 / (p / 1000), 2),
                                            "raw_pread_gib_s": round(mib / 1024 / (r / 1000), 2),
                                            "throughput_vs_raw": round(r / p, 2)}
                say(f"  SSD->DRAM promotion of 32 MiB ({mode} page cache): {p:.2f} ms vs raw pread {r:.2f} ms "
                    f"({r / p:.2f}x the throughput; target >= 0.8x)")
        finally:
            os.close(fd)
    return out


def chat_trace(*, sessions: int, zipf_a: float, turns: tuple[int, int], seed: int) -> list[tuple[int, int]]:
    """(session, turn) events: each event picks a session with Zipf-distributed probability
    (rank^-a) among those with turns left; sessions have ``turns`` (inclusive range) turns."""
    rng = np.random.default_rng(seed)
    budget = rng.integers(turns[0], turns[1] + 1, sessions)
    weight = 1.0 / np.arange(1, sessions + 1) ** zipf_a
    done = np.zeros(sessions, np.int64)
    events = []
    for _ in range(int(budget.sum())):
        live = done < budget
        p = np.where(live, weight, 0.0)
        sid = int(rng.choice(sessions, p=p / p.sum()))
        events.append((sid, int(done[sid])))
        done[sid] += 1
    return events


def replay(root: str, events: list[tuple[int, int]], chunk: np.ndarray, dram_bytes: int, policy: Any,
           lookahead: int) -> dict[str, Any]:
    """Each turn reads the session's earlier chunks (its growing context), then stores the
    turn's new chunk (tagged with the session), as a serving engine would.  A request is
    queued ``lookahead`` turns before it is served; when it is queued the engine calls
    ``prefetch_session`` (AttentionStore's look-ahead prefetch), whatever the policy."""
    shutil.rmtree(root, ignore_errors=True)
    requested = 0
    t0 = time.perf_counter()
    with open_store(root, dram_bytes=dram_bytes, durability="none", policy=policy) as s:
        for n, (sid, turn) in enumerate(events):
            if lookahead and n + lookahead < len(events) and events[n + lookahead][1]:
                s.prefetch_session(f"s{events[n + lookahead][0]}", namespace="chat").result()
            for t in range(turn):
                s.get(f"{sid}-{t}", namespace="chat")
            requested += turn * chunk.nbytes
            s.put(f"{sid}-{turn}", KVCache(chunk), namespace="chat", session=f"s{sid}")
        st = s.stats()["tiers"]["dram"]
    seconds = time.perf_counter() - t0
    gets = st["hits"] + st["misses"]
    return {"policy": getattr(policy, "name", policy), "lookahead": lookahead, "gets": gets,
            "hit_rate": round(st["hits"] / gets, 4), "bytes_requested": requested,
            "bytes_from_log": st["bytes_in"] + st["bytes_read_through"], "evictions": st["evictions"],
            "seconds": round(seconds, 2)}


def bench_trace(root: str, *, quick: bool, say: Callable[..., None]) -> dict[str, Any]:
    sessions = 200
    events = chat_trace(sessions=sessions, zipf_a=1.0, turns=(4, 20), seed=1)
    chunk = np.random.default_rng(2).standard_normal((4, 2, 2, 16 if quick else 64, 64)).astype(np.float16)
    data = len(events) * chunk.nbytes
    dram = data // 10
    out: dict[str, Any] = {"sessions": sessions, "turns": len(events), "chunk_bytes": chunk.nbytes,
                           "data_bytes": data, "dram_bytes": dram, "zipf_a": 1.0, "turns_per_session": [4, 20],
                           "runs": []}
    for lookahead in (0, 8, 32):
        for policy in ("lru", "session"):
            r = replay(os.path.join(root, policy), events, chunk, dram, policy, lookahead)
            out["runs"].append(r)
            say(f"  chat trace, look-ahead {lookahead:>2}, {policy:>7}: hit rate {r['hit_rate'] * 100:.1f}%, "
                f"{r['bytes_from_log'] / 2**20:,.0f} MiB read from the log for "
                f"{r['bytes_requested'] / 2**20:,.0f} MiB requested ({r['seconds']} s)")
    shutil.rmtree(root, ignore_errors=True)
    return out


def bench_tiers(root: str, *, quick: bool, say: Callable[..., None]) -> dict[str, Any]:
    out = bench_hits_and_promotion(os.path.join(root, "hits"), reps=5 if quick else 15, say=say)
    shutil.rmtree(os.path.join(root, "hits"), ignore_errors=True)
    out["trace"] = bench_trace(os.path.join(root, "trace"), quick=quick, say=say)
    return out


def markdown_tiers(t: dict[str, Any]) -> list[str]:
    """The tiers section's tables, for docs/benchmarks.md."""
    lines = ["DRAM-hit gets (medians) against a numpy copy of the same bytes, in the same process:", "",
             "| object | DRAM-hit get ms | numpy copy ms | ratio (target <= 1.3x) |", "| --- | --- | --- | --- |"]
    for name in ("layer_1mib", "chunk_32mib"):
        r = t[name]
        lines.append(f"| {name.replace('_', ' ')} | {r['dram_hit_get_ms']} | {r['numpy_copy_ms']} | "
                     f"{r['ratio_vs_copy']}x |")
    lines += ["", "SSD -> DRAM promotion of a 32 MiB chunk (`prefetch(tier=\"dram\")`, checksums verified) "
              "against raw `os.preadv` of the same bytes:", "",
              "| page cache | promote ms | raw preadv ms | promote GiB/s | throughput vs raw (target >= 0.8x) |",
              "| --- | --- | --- | --- | --- |"]
    for mode in ("warm", "cold"):
        r = t[f"promotion_{mode}"]
        lines.append(f"| {mode} | {r['promote_ms']} | {r['raw_pread_ms']} | {r['promote_gib_s']} | "
                     f"{r['throughput_vs_raw']}x |")
    tr = t["trace"]
    lines += ["", f"Multi-turn chat trace: {tr['sessions']} sessions of {tr['turns_per_session'][0]}-"
              f"{tr['turns_per_session'][1]} turns ({tr['turns']:,} turns), Zipf (a={tr['zipf_a']}) returns, one "
              f"{tr['chunk_bytes'] // 1024} KiB KV chunk per turn (each turn reads its whole context); DRAM "
              f"budget {tr['dram_bytes'] / 2**20:.0f} MiB = 10% of the {tr['data_bytes'] / 2**20:.0f} MiB "
              "written.  Look-ahead n: a request is queued n turns before it is served and "
              "`prefetch_session` is called when it is queued (both policies get the same calls).", "",
              "| look-ahead | policy | hit rate | MiB read from the log | of MiB requested | seconds |",
              "| --- | --- | --- | --- | --- | --- |"]
    for r in tr["runs"]:
        lines.append(f"| {r['lookahead']} | {r['policy']} | {r['hit_rate'] * 100:.1f}% | "
                     f"{r['bytes_from_log'] / 2**20:,.0f} | {r['bytes_requested'] / 2**20:,.0f} | {r['seconds']} |")
    return lines


def plot_tiers(t: dict[str, Any], path: str) -> None:
    """Hit rate and log bytes per policy and look-ahead (skipped without matplotlib)."""

    plt = pyplot()
    if plt is None:
        return
    runs = t["trace"]["runs"]
    las = sorted({r["lookahead"] for r in runs})
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for j, policy in enumerate(("lru", "session")):
        rs = [next(r for r in runs if r["lookahead"] == la and r["policy"] == policy) for la in las]
        xs = [i + j * 0.4 for i in range(len(las))]
        axes[0].bar(xs, [r["hit_rate"] * 100 for r in rs], 0.4, label=policy)
        axes[1].bar(xs, [r["bytes_from_log"] / r["bytes_requested"] for r in rs], 0.4, label=policy)
    for ax, title in zip(axes, ("DRAM hit rate (%)", "bytes read from the log / bytes requested")):
        ax.set_xticks([i + 0.2 for i in range(len(las))], [f"look-ahead {la}" for la in las])
        ax.set_title(title)
        ax.legend()
    fig.suptitle("chat trace, DRAM = 10% of the data: LRU vs session-aware")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
