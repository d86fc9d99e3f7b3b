"""The chunk section of ``tierstore bench``: a 32 MiB Llama-3-8B KV chunk put, read whole (cold and
warm) and one layer at a time, by every system, interleaved, as ratios to file-per-object.
It measures and reports; it never asserts (targets are flagged by report.py).
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .common import SHAPE, drop_pages, median_ms, memcpy_ms, pct_ms, read_bytes
from .systems import FilePerObject, H5py, Lmdb, ODirect, Safetensors, SequentialLog, System, Tierstore, TorchSave


def bench_chunk(root: str, *, reps: int, layer_reps: int, peers: bool, say: Callable[..., None]) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    data = rng.standard_normal(SHAPE, dtype=np.float32).astype(np.float16)
    size = data.nbytes
    layer_bytes = data[0].nbytes
    makers: list[tuple[str, Callable[[], System]]] = [
        ("baseline", lambda: FilePerObject(os.path.join(root, "fpo"), data)),
        ("seqlog", lambda: SequentialLog(os.path.join(root, "seq"), data)),
        ("ts_sync", lambda: Tierstore(os.path.join(root, "ts-sync"), data, "sync")),
        ("ts_group", lambda: Tierstore(os.path.join(root, "ts-group"), data, "group")),
        ("ts_none", lambda: Tierstore(os.path.join(root, "ts-none"), data, "none")),
        ("ts_direct", lambda: Tierstore(os.path.join(root, "ts-direct"), data, "sync", direct_reads="always")),
        ("ts_notier", lambda: Tierstore(os.path.join(root, "ts-notier"), data, "sync", dram_bytes=0)),
    ]
    if peers:
        makers += [("odirect", lambda: ODirect(os.path.join(root, "odirect"), data)),
                   ("safetensors", lambda: Safetensors(os.path.join(root, "st"), data)),
                   ("torch", lambda: TorchSave(os.path.join(root, "pt"), data)),
                   ("h5py", lambda: H5py(os.path.join(root, "h5"), data)),
                   ("lmdb", lambda: Lmdb(os.path.join(root, "lmdb"), data))]
    systems: dict[str, System] = {}
    skipped: dict[str, str] = {}
    for key, make in makers:
        try:
            systems[key] = make()
        except ImportError as e:
            skipped[key] = f"not installed ({e.name})"
    res: dict[str, dict[str, Any]] = {k: {"name": s.name} for k, s in systems.items()}
    # puts, interleaved round-robin so drift in the disk hits every system alike
    put_t: dict[str, list[float]] = {k: [] for k in systems}
    for i in range(reps):
        for k, s in systems.items():
            gc.collect()
            t0 = time.perf_counter()
            s.put(i)
            put_t[k].append(time.perf_counter() - t0)
    say(f"  puts done ({reps} x 32 MiB per system)")
    for k in systems:
        res[k]["put_ms"] = median_ms(put_t[k])
    # full gets: cold (pages evicted) then warm
    for mode in ("cold", "warm"):
        tt: dict[str, list[float]] = {k: [] for k in systems}
        rb: dict[str, list[int]] = {k: [] for k in systems}
        for i in range(reps):
            for k, s in systems.items():
                if mode == "cold":
                    s.before_cold()
                    for p in s.files(i):
                        drop_pages(p)
                else:
                    s.get(i)
                gc.collect()
                r0 = read_bytes()
                t0 = time.perf_counter()
                out = s.get(i)
                tt[k].append(time.perf_counter() - t0)
                rb[k].append(read_bytes() - r0)
                del out
        for k in systems:
            res[k][f"get_{mode}_ms"] = median_ms(tt[k])
            if mode == "cold":
                res[k]["get_cold_read_bytes"] = int(statistics.median(rb[k]))
    say("  full gets done")
    # single-layer gets
    lrng = np.random.default_rng(1)
    for mode, n in (("cold", max(8, layer_reps // 4)), ("warm", layer_reps)):
        tt = {k: [] for k in systems}
        rb = {k: [] for k in systems}
        for _ in range(n):
            i, l = int(lrng.integers(reps)), int(lrng.integers(SHAPE[0]))
            for k, s in systems.items():
                if mode == "cold":
                    s.before_cold()
                    for p in s.files(i):
                        drop_pages(p)
                else:
                    s.layer(i, l)
                r0 = read_bytes()
                t0 = time.perf_counter()
                s.layer(i, l)
                tt[k].append(time.perf_counter() - t0)
                rb[k].append(read_bytes() - r0)
        for k in systems:
            res[k][f"layer_{mode}_p50_ms"] = median_ms(tt[k])
            res[k][f"layer_{mode}_p99_ms"] = pct_ms(tt[k], 0.99)
            if mode == "cold":
                res[k]["layer_cold_read_bytes"] = int(statistics.median(rb[k]))
    say("  layer gets done")
    for s in systems.values():
        s.close()
    base = res["baseline"]
    for r in res.values():
        r["ratios_vs_baseline"] = {m: round(r[m] / base[m], 3) for m in
                                   ("put_ms", "get_cold_ms", "get_warm_ms", "layer_cold_p50_ms", "layer_warm_p50_ms")
                                   if r.get(m) and base.get(m)}
    seq = res["seqlog"]
    out = {"size_bytes": size, "layer_bytes": layer_bytes, "reps": reps, "layer_reps": layer_reps,
           "memcpy_ms": memcpy_ms(data, max(reps, 5)), "systems": res, "skipped": skipped,
           "targets": {
               "durable_put_throughput_vs_sequential_write": round(seq["put_ms"] / res["ts_sync"]["put_ms"], 3),
               "cold_get_throughput_vs_sequential_read": round(seq["get_cold_ms"] / res["ts_sync"]["get_cold_ms"], 3),
               "warm_layer_get_vs_raw_pread": round(res["ts_sync"]["layer_warm_p50_ms"] / seq["layer_warm_p50_ms"], 3),
               "cold_layer_read_bytes_vs_layer": round(res["ts_sync"]["layer_cold_read_bytes"] / layer_bytes, 3),
               "warm_get_vs_file_per_object": round(res["ts_sync"]["get_warm_ms"] / base["get_warm_ms"], 3),
               "warm_layer_get_vs_raw_pread_without_dram_tier": round(
                   res["ts_notier"]["layer_warm_p50_ms"] / seq["layer_warm_p50_ms"], 3),
           }}
    return out
