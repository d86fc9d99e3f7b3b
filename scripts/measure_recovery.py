"""Measure recovery on a store of several GB (for docs/reliability.md).

    python scripts/measure_recovery.py /tmp/recovery-store --gb 4

1. Writes GB of 32 MiB KV chunks (durability "group"), plus 20k small blobs; closes it.
2. Crash with an unapplied log tail: appends N more puts with the index held back, abandons
   the handle (no close), then times the next open (replay of the tail).
3. Deletes the index and times the open that rebuilds it from the segments (headers only:
   sealed segments were synced before they were sealed; the last one is fully verified).
4. Times `tierstore recover` (every checksum of every record verified, index rebuilt).
Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import time

import numpy as np

import tierstore
from tierstore import Blob, KVCache
from tierstore.engine import repair


def _crash_after_tail(path: str, tail: int) -> None:
    """Puts that are durable in the log but never applied to the index, then a crash (no close)."""
    s = tierstore.open(path, durability="sync", index_commit_ms=1e9, index_batch=10**9)
    for i in range(tail):
        s.put(f"tail-{i}", Blob(b"t" * 1000))  # synced to the log before put returns
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--gb", type=float, default=4.0)
    ap.add_argument("--tail", type=int, default=2000, help="puts left unapplied before the crash")
    args = ap.parse_args()
    if os.path.exists(args.path):
        shutil.rmtree(args.path)
    chunk = np.random.default_rng(0).standard_normal((32, 2, 8, 256, 128), dtype=np.float32).astype(np.float16)
    n_chunks = int(args.gb * 1024 / 32)
    t0 = time.perf_counter()
    with tierstore.open(args.path, durability="group") as s:
        for i in range(n_chunks):
            s.put(i.to_bytes(8, "big"), KVCache(chunk), namespace="llama3-8b")
        for i in range(20_000):
            s.put(f"blob-{i}", Blob(i.to_bytes(4, "little") * 256))
    write_s = time.perf_counter() - t0
    child = multiprocessing.get_context("fork").Process(target=_crash_after_tail, args=(args.path, args.tail))
    child.start()
    child.join()
    seg_bytes = sum(os.path.getsize(os.path.join(args.path, "segments", f))
                    for f in os.listdir(os.path.join(args.path, "segments")))
    t0 = time.perf_counter()
    with tierstore.open(args.path) as s:
        replay_s = time.perf_counter() - t0
        replayed = s.recovery["replayed_records"]
        assert s.contains(f"tail-{args.tail - 1}")
    shutil.rmtree(os.path.join(args.path, "index"))
    t0 = time.perf_counter()
    with tierstore.open(args.path) as s:
        rebuild_s = time.perf_counter() - t0
        objects = s.stats()["objects_indexed"]
    result = repair.recover(args.path)
    print(json.dumps({
        "segment_gb": round(seg_bytes / 1e9, 2), "objects": objects, "write_seconds": round(write_s, 1),
        "open_with_unapplied_tail": {"records": replayed, "seconds": round(replay_s, 3)},
        "open_rebuilding_missing_index": {"seconds": round(rebuild_s, 2),
                                          "gb_per_second": round(seg_bytes / 1e9 / rebuild_s, 2)},
        "recover_verifying_every_checksum": {"seconds": round(result["seconds"], 2),
                                             "gb_per_second": round(result["gb_per_second"], 2),
                                             "damage": result["damage"]},
    }, indent=2))


if __name__ == "__main__":
    main()
