"""The batches section of ``tierstore bench``: many callers.  4 KiB blobs through put_many /
get_many / contains_many against LMDB in the same process; a 32 MiB chunk read into a caller's
buffer (``get(out=)``) against a raw ``preadv`` of the same bytes into the same buffer, first and
repeated reads; a chunk put from separate K and V tensors (``KVCache.from_layers``) against the
put of a pre-stacked tensor and against stacking first; the durability modes' put times; and
``put_async`` against ``put``.  Runs alternate between the compared systems so drift in the
disk hits both.  It measures and reports; it never asserts.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import open as open_store
from ..objects import Blob, KVCache
from .common import SHAPE, drop_pages, median_ms, time_ms


def _rate(n: int, seconds: float) -> int:
    return round(n / seconds) if seconds > 0 else 0


def bench_batches(root: str, *, n: int, reps: int, peers: bool, say: Callable[..., None]) -> dict[str, Any]:
    os.makedirs(root, exist_ok=True)
    res: dict[str, Any] = {"n": n, "blob_bytes": 4096, "batch": 1000}
    res.update(_small(root, n, peers, say))
    res.update(_chunk(root, reps, say))
    return res


def _small(root: str, n: int, peers: bool, say: Callable[..., None]) -> dict[str, Any]:
    payload = np.random.default_rng(3).bytes(4096)
    keys = [f"blob-{i}" for i in range(n)]
    order = [keys[i] for i in np.random.default_rng(4).permutation(n)]
    batches = [order[i : i + 1000] for i in range(0, n, 1000)]
    out: dict[str, Any] = {}
    with open_store(os.path.join(root, "ts-small"), durability="sync") as s:
        gc.collect()
        t0 = time.perf_counter()
        for i in range(0, n, 1000):  # each batch one atomic group and one fdatasync
            s.put_many([(k, Blob(payload)) for k in keys[i : i + 1000]])
        out["put_many_ops"] = _rate(n, time.perf_counter() - t0)
        s.flush()
        for b in batches:  # warm-up: page cache and headers
            s.get_many(b)
        t0 = time.perf_counter()
        for b in batches:
            s.get_many(b)
        out["get_many_ops"] = _rate(n, time.perf_counter() - t0)
        t0 = time.perf_counter()
        for k in order:
            s.get(k)
        out["get_ops"] = _rate(n, time.perf_counter() - t0)
        hashes = order[:1000]
        out["contains_many_1000_ms"] = round(time_ms(lambda: s.contains_many(hashes), 21), 3)
        out["match_prefix_1000_ms"] = round(time_ms(lambda: s.match_prefix(hashes), 21), 3)
        m = 200
        t0 = time.perf_counter()
        for i in range(m):
            s.put(f"sync-{i}", Blob(payload))
        out["sync_put_ops"] = _rate(m, time.perf_counter() - t0)
        t0 = time.perf_counter()
        futures = [s.put_async(f"async-{i}", Blob(payload)) for i in range(m)]
        for f in futures:
            f.result()
        out["put_async_ops"] = _rate(m, time.perf_counter() - t0)
    if peers:
        import lmdb

        env = lmdb.open(os.path.join(root, "lmdb-small"), map_size=1 << 34, lib_version=0, metasync=False)
        t0 = time.perf_counter()
        with env.begin(write=True) as txn:
            for k in keys:
                txn.put(k.encode(), payload)
        out["lmdb_one_txn_put_ops"] = _rate(n, time.perf_counter() - t0)
        for _ in range(2):
            t0 = time.perf_counter()
            for k in order:
                with env.begin() as txn:
                    txn.get(k.encode())
        out["lmdb_get_ops"] = _rate(n, time.perf_counter() - t0)
        t0 = time.perf_counter()
        for b in batches:
            with env.begin() as txn:
                for k in b:
                    txn.get(k.encode())
        out["lmdb_batch_get_ops"] = _rate(n, time.perf_counter() - t0)
        env.close()
    say(f"  small objects done ({n} x 4 KiB)")
    return out


def _raw_file(path: str, data: np.ndarray) -> None:
    with open(path, "wb") as f:
        f.write(memoryview(data.reshape(-1).view(np.uint8)))
        f.flush()
        os.fsync(f.fileno())


def _preadv(path: str, out: np.ndarray) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        view = memoryview(out.reshape(-1).view(np.uint8))
        pos = 0
        while pos < view.nbytes:
            got = os.preadv(fd, [view[pos:]], pos)
            if got <= 0:
                raise OSError("short read")
            pos += got
    finally:
        os.close(fd)


def _chunk(root: str, reps: int, say: Callable[..., None]) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    data = rng.standard_normal(SHAPE, dtype=np.float32).astype(np.float16)
    ks = [np.ascontiguousarray(data[i, 0]) for i in range(SHAPE[0])]
    vs = [np.ascontiguousarray(data[i, 1]) for i in range(SHAPE[0])]
    raw = os.path.join(root, "raw.bin")
    _raw_file(raw, data)
    out = np.empty_like(data)
    out.reshape(-1).view(np.uint8)[::4096] = 0  # warm: the destination's pages exist
    t: dict[str, list[float]] = {k: [] for k in (
        "raw_cold", "raw_warm", "out_cold", "out_second", "out_third", "get_cold", "put_stacked", "put_layers",
        "put_stack_first", "put_sync", "put_none")}
    path = os.path.join(root, "ts-chunk")
    with open_store(path, durability="sync") as s, open_store(os.path.join(root, "ts-none"), durability="none") as sn:
        for i in range(reps):
            gc.collect()
            for name, store, key, make in (
                ("put_stacked", s, "st", lambda: KVCache(data)),
                ("put_layers", s, "ly", lambda: KVCache.from_layers(list(zip(ks, vs)))),
                ("put_stack_first", s, "sf", lambda: KVCache(np.stack([np.stack(p) for p in zip(ks, vs)]))),
                ("put_sync", s, "sy", lambda: KVCache(data)),
                ("put_none", sn, "no", lambda: KVCache(data)),
            ):
                t0 = time.perf_counter()
                store.put(f"{key}{i}", make())
                t[name].append(time.perf_counter() - t0)
        s.flush()
        for i in range(reps):
            drop_pages(raw)
            t0 = time.perf_counter()
            _preadv(raw, out)
            t["raw_cold"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            _preadv(raw, out)
            t["raw_warm"].append(time.perf_counter() - t0)
            key = f"st{i}"
            s.drop_cached()
            for seg in os.listdir(os.path.join(path, "segments")):
                drop_pages(os.path.join(path, "segments", seg))
            for name in ("out_cold", "out_second", "out_third"):
                t0 = time.perf_counter()
                s.get(key, out=out)
                t[name].append(time.perf_counter() - t0)
            s.drop_cached()
            for seg in os.listdir(os.path.join(path, "segments")):
                drop_pages(os.path.join(path, "segments", seg))
            t0 = time.perf_counter()
            got = s.get(f"ly{i}")
            t["get_cold"].append(time.perf_counter() - t0)
            del got
        assert np.array_equal(s.get("ly0").data, data)  # the scattered put stored the same chunk
    ms = {k: median_ms(v) for k, v in t.items()}
    say("  chunk reads and puts done (32 MiB)")
    return {"chunk_ms": ms, "chunk_bytes": data.nbytes,
            "ratios": {
                "out_cold_vs_raw_cold": round(ms["raw_cold"] / ms["out_cold"], 2),
                "out_second_vs_raw_warm": round(ms["raw_warm"] / ms["out_second"], 2),
                "out_third_vs_raw_warm": round(ms["raw_warm"] / ms["out_third"], 2),
                "get_cold_vs_raw_warm_memory": round(ms["raw_cold"] / ms["get_cold"], 2),
                "put_layers_vs_stacked": round(ms["put_stacked"] / ms["put_layers"], 2),
                "put_stack_first_vs_stacked": round(ms["put_stacked"] / ms["put_stack_first"], 2),
                "none_vs_sync": round(ms["put_sync"] / ms["put_none"], 2),
            }}


def markdown_batches(b: dict[str, Any]) -> list[str]:
    """The section's tables (docs/benchmarks.md)."""
    lines = ["", f"Batches of 1,000 4 KiB blobs, {b['n']:,} operations (durability=\"sync\": one fdatasync per "
             "batch), ops/s, LMDB in the same process:", "", "| measurement | ops/s |", "| --- | --- |"]
    lines += [f"| {k.removesuffix('_ops').replace('_', ' ')} | {v:,} |" for k, v in b.items() if k.endswith("_ops")]
    lines += [f"| contains_many of 1,000 keys | {b['contains_many_1000_ms']} ms |",
              f"| match_prefix of 1,000 hashes | {b['match_prefix_1000_ms']} ms |"]
    ms, r = b["chunk_ms"], b["ratios"]
    lines += ["", "A 32 MiB chunk (medians, ms; ratios > 1 mean tierstore is faster):", "",
              "| measurement | ms | ratio |", "| --- | --- | --- |",
              f"| raw preadv into a warm buffer, cold file | {ms['raw_cold']} | |",
              f"| raw preadv into a warm buffer, page cache | {ms['raw_warm']} | |",
              f"| get(out=) first read (cold) | {ms['out_cold']} | {r['out_cold_vs_raw_cold']}x raw cold |",
              f"| get(out=) second read | {ms['out_second']} | {r['out_second_vs_raw_warm']}x raw page cache |",
              f"| get(out=) third read | {ms['out_third']} | {r['out_third_vs_raw_warm']}x raw page cache |",
              f"| get() cold, fresh buffer | {ms['get_cold']} | {r['get_cold_vs_raw_warm_memory']}x raw cold "
              "into warm memory |",
              f"| put, pre-stacked tensor | {ms['put_stacked']} | |",
              f"| put, KVCache.from_layers (separate K, V) | {ms['put_layers']} | {r['put_layers_vs_stacked']}x "
              "pre-stacked |",
              f"| put, np.stack first | {ms['put_stack_first']} | {r['put_stack_first_vs_stacked']}x pre-stacked |",
              f"| put, durability=\"sync\" | {ms['put_sync']} | |",
              f"| put, durability=\"none\" | {ms['put_none']} | {r['none_vs_sync']}x sync |"]
    return lines
