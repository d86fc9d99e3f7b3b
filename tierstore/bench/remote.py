"""The remote section of ``tierstore bench``: the remote tier on a real ``redis-server`` started
for the run (loopback), against redis-py's own ``SET`` / ``GET`` of the same bytes on the same
server (the physical limit here), and two stores ("nodes") sharing it on a multi-turn chat trace.
It measures and reports; it never asserts.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .. import open as open_store
from ..format import block as blk
from ..format import constants as fmt
from ..format import record as rec
from ..objects import KVCache
from ..tiers.remote import RemoteTier, Version, remote_key
from .common import SHAPE, time_ms
from .servers import RedisServer
from .tiers import chat_trace


def _remote_stats(store: Any) -> dict[str, Any]:
    return store.stats()["tiers"]["remote"]


def _chunk_record(kv: np.ndarray, version: Version) -> rec.EncodedRecord:
    """The PUT record a store with a remote writes for ``kv`` (key b"chunk", namespace b"bench")."""
    block = blk.encode_block(KVCache(kv), None, vector_extent_bytes=1 << 20)
    meta = {**block.meta, fmt.META_VERSION: [version.stamp, version.origin]}
    r = rec.encode_put(b"bench", b"chunk", 0, block.kind, meta, block.extents, block.align_log2, block.codec)
    return rec.EncodedRecord(r.header.stamped(1), r.extents)


def bench_chunks(root: str, url: str, port: int, *, reps: int, say: Callable[..., None]) -> dict[str, Any]:
    """A 32 MiB chunk and a 1 MiB layer: the tier's send / fetch vs SET / GET of the same bytes."""
    import redis

    r = redis.Redis(port=port)
    kv = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float16)
    out: dict[str, Any] = {"chunk_bytes": kv.nbytes, "layer_bytes": kv[0].nbytes}
    tier = RemoteTier(url, origin=os.urandom(16))  # the tier alone, as a store drives it
    with open_store(os.path.join(root, "a"), remote=url) as a, open_store(os.path.join(root, "b"), remote=url) as b:
        a.put(b"chunk", KVCache(kv), namespace="bench")
        value = r.get(remote_key(b"bench", b"chunk"))
        raw = bytes(value)
        out["set_ms"] = time_ms(lambda: r.set(b"bench:raw", raw), reps)
        out["get_ms"] = time_ms(lambda: r.get(b"bench:raw"), reps)
        pushes = []
        for _ in range(reps):  # each a new version (its own stamp in the record and the envelope)
            v = Version(tier.clock.next(), tier.origin)
            fresh = _chunk_record(kv, v)
            t0 = time.perf_counter()
            tier.push(fresh, v)
            pushes.append(time.perf_counter() - t0)
        out["push_ms"] = sorted(pushes)[len(pushes) // 2] * 1e3
        out["fetch_ms"] = time_ms(lambda: tier.fetch(b"bench", b"chunk"), reps)
        b.get(b"chunk", namespace="bench")  # b now holds a copy
        t_store = []
        for i in range(reps):  # a node without a copy: fetch, check, decode, keep in its log
            with open_store(os.path.join(root, f"cold{i}"), remote=url) as c:
                t0 = time.perf_counter()
                c.get(b"chunk", namespace="bench")
                t_store.append(time.perf_counter() - t0)
        out["store_get_cold_ms"] = sorted(t_store)[len(t_store) // 2] * 1e3
        local = []
        for _ in range(reps):
            t0 = time.perf_counter()
            b.get(b"chunk", namespace="bench")
            local.append(time.perf_counter() - t0)
        out["store_get_local_ms"] = sorted(local)[len(local) // 2] * 1e3  # the version check + a local read
        layer_t = []
        for i in range(reps):
            with open_store(os.path.join(root, f"layer{i}"), remote=url) as c:
                t0 = time.perf_counter()
                c.get(b"chunk", namespace="bench", layers=7)
                layer_t.append(time.perf_counter() - t0)
                moved = _remote_stats(c)["bytes_in"]
        layer_raw = bytes(kv[7])
        r.set(b"bench:layer", layer_raw)
        out["layer_get_ms"] = sorted(layer_t)[len(layer_t) // 2] * 1e3
        out["layer_raw_get_ms"] = time_ms(lambda: r.get(b"bench:layer"), reps)
        out["layer_bytes_moved"] = moved
        out["layer_bytes_ratio"] = round(moved / kv[7].nbytes, 4)
    tier.close(0)
    gib = kv.nbytes / 2**30
    out["push_vs_set"] = round(out["set_ms"] / out["push_ms"], 3)
    out["fetch_vs_get"] = round(out["get_ms"] / out["fetch_ms"], 3)
    for k in ("set", "get", "push", "fetch"):
        out[f"{k}_gib_s"] = round(gib / (out[f"{k}_ms"] / 1e3), 2)
    say(f"  32 MiB chunk: SET {out['set_ms']:.1f} ms, tier push {out['push_ms']:.1f} ms "
        f"({out['push_vs_set']:.2f}x SET throughput); GET {out['get_ms']:.1f} ms, tier fetch "
        f"{out['fetch_ms']:.1f} ms ({out['fetch_vs_get']:.2f}x GET throughput)")
    say(f"  store.get on a node without a copy {out['store_get_cold_ms']:.1f} ms; with its own copy "
        f"{out['store_get_local_ms']:.1f} ms")
    say(f"  one 1 MiB layer from the remote: {out['layer_get_ms']:.2f} ms, {out['layer_bytes_ratio']:.4f}x the "
        f"layer's bytes moved (GET of 1 MiB: {out['layer_raw_get_ms']:.2f} ms)")
    return out


def bench_two_nodes(root: str, url: str, *, quick: bool, say: Callable[..., None]) -> dict[str, Any]:
    """The 200-session chat trace with each turn sent to one of two nodes at random (no session
    affinity): a turn reads its session's earlier chunks, then stores its own.  Local-only nodes
    miss what the other node stored; with the remote tier they fetch it."""
    events = chat_trace(sessions=200, zipf_a=1.0, turns=(4, 20), seed=1)
    if quick:
        events = events[:600]
    chunk = np.random.default_rng(2).standard_normal((2, 2, 2, 16, 64)).astype(np.float16)  # 16 KiB
    route = np.random.default_rng(3).integers(0, 2, len(events))
    out: dict[str, Any] = {"sessions": 200, "turns": len(events), "chunk_bytes": chunk.nbytes}
    for mode in ("local-only", "remote"):
        kw = {"remote": url} if mode == "remote" else {}
        if mode == "remote":
            import redis
            redis.Redis.from_url(url).flushdb()
        nodes = [open_store(os.path.join(root, f"{mode}-{n}"), dram_bytes=0, **kw) for n in range(2)]
        reads = hits = 0
        t0 = time.perf_counter()
        try:
            for (sid, turn), n in zip(events, route):
                s = nodes[n]
                got = s.get_many([f"{sid}-{t}" for t in range(turn)], namespace="chat")
                reads += len(got)
                hits += sum(g is not None for g in got)
                s.put(f"{sid}-{turn}", KVCache(chunk), namespace="chat")
            remote_hits = sum(_remote_stats(s)["hits"] for s in nodes) if mode == "remote" else 0
        finally:
            for s in nodes:
                s.close()
        out[mode] = {"chunk_reads": reads, "hits": hits, "hit_rate": round(hits / max(1, reads), 4),
                     "remote_fetches": remote_hits, "seconds": round(time.perf_counter() - t0, 2)}
        say(f"  {mode}: {hits}/{reads} chunk reads hit ({100 * hits / max(1, reads):.1f}%)"
            + (f", {remote_hits} fetched from the remote" if mode == "remote" else ""))
    return out


def bench_remote(root: str, *, quick: bool, say: Callable[..., None]) -> dict[str, Any]:
    os.makedirs(root, exist_ok=True)
    server = RedisServer(Path(root)).start()
    try:
        version = server.cli("info", "server").split("redis_version:")[1].split()[0]
        out: dict[str, Any] = {"server": f"redis-server {version}, loopback, no persistence",
                               "envelope_bytes": fmt.REMOTE_ENVELOPE.size}
        out["chunks"] = bench_chunks(os.path.join(root, "chunks"), server.url, server.port,
                                     reps=3 if quick else 9, say=say)
        out["two_nodes"] = bench_two_nodes(os.path.join(root, "trace"), server.url, quick=quick, say=say)
        return out
    finally:
        server.stop()


def markdown_remote(r: dict[str, Any]) -> list[str]:
    c, t = r["chunks"], r["two_nodes"]
    mib = c["chunk_bytes"] >> 20
    lines = ["", f"Remote tier on {r['server']} (medians; redis-py on the same server in the same run is the "
             "baseline):", "",
             "| operation | tierstore remote tier | redis-py | ratio (throughput) |", "| --- | --- | --- | --- |",
             f"| put {mib} MiB chunk (staged, compare-and-set) vs SET | {c['push_ms']:.1f} ms | {c['set_ms']:.1f} ms | "
             f"{c['push_vs_set']}x |",
             f"| get {mib} MiB chunk (GET + every checksum) vs GET | {c['fetch_ms']:.1f} ms | {c['get_ms']:.1f} ms | "
             f"{c['fetch_vs_get']}x |",
             f"| one 1 MiB layer of a chunk not held locally vs GET of 1 MiB | {c['layer_get_ms']:.2f} ms "
             f"({c['layer_bytes_ratio']}x the layer's bytes) | {c['layer_raw_get_ms']:.2f} ms | |",
             f"| store.get of the chunk on a node without a copy (fetch, check, decode, keep) | "
             f"{c['store_get_cold_ms']:.1f} ms | | |",
             f"| store.get on a node holding the chunk (version check + local read) | "
             f"{c['store_get_local_ms']:.1f} ms | | |",
             "", f"Two nodes, the {t['sessions']}-session chat trace ({t['turns']:,} turns) with each turn sent to "
             "a node at random (no session affinity); a turn reads its session's earlier chunks:", "",
             "| nodes | chunk reads that hit | fetched from the remote |", "| --- | --- | --- |"]
    for mode in ("local-only", "remote"):
        m = t[mode]
        lines.append(f"| {mode} | {m['hits']:,} / {m['chunk_reads']:,} ({100 * m['hit_rate']:.1f}%) | "
                     f"{m['remote_fetches']:,} |")
    return lines
