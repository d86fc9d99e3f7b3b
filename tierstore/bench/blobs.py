"""The blob section of ``tierstore bench``: 4 KiB blobs put (group-committed) and read, against
file-per-object and LMDB in the same process.  It measures and reports; it never asserts.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import open as open_store
from ..objects import Blob


def bench_blobs(root: str, *, n: int, peers: bool, say: Callable[..., None]) -> dict[str, Any]:
    payload = np.random.default_rng(3).bytes(4096)
    res: dict[str, Any] = {"n": n, "blob_bytes": 4096}
    order = np.random.default_rng(4).permutation(n)
    # tierstore, group commit: the durable batch is made by flush() at the end
    path = os.path.join(root, "ts-blobs")
    with open_store(path, durability="group") as s:
        gc.collect()
        t0 = time.perf_counter()
        for i in range(n):
            s.put(f"blob-{i}", Blob(payload))
        s.flush()
        res["tierstore_group_put_ops"] = round(n / (time.perf_counter() - t0))
        for i in order:  # warm: every blob read once before (page cache, decoded headers)
            s.get(f"blob-{i}")
        t0 = time.perf_counter()
        for i in order:
            s.get(f"blob-{i}")
        res["tierstore_warm_get_ops"] = round(n / (time.perf_counter() - t0))
    m = max(50, n // 40)
    with open_store(os.path.join(root, "ts-blobs-sync"), durability="sync") as s:
        t0 = time.perf_counter()
        for i in range(m):
            s.put(f"blob-{i}", Blob(payload))
        res["tierstore_sync_put_ops"] = round(m / (time.perf_counter() - t0))
    # baseline: one file per blob, written, then one syncfs for the whole batch
    d = os.path.join(root, "fpo-blobs")
    os.makedirs(d)
    t0 = time.perf_counter()
    for i in range(n):
        fd = os.open(os.path.join(d, str(i)), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.pwrite(fd, payload, 0)
        os.close(fd)
    os.sync()
    res["file_per_object_put_ops"] = round(n / (time.perf_counter() - t0))
    for i in order:
        with open(os.path.join(d, str(i)), "rb") as f:
            f.read()
    t0 = time.perf_counter()
    for i in order:
        fd = os.open(os.path.join(d, str(i)), os.O_RDONLY)
        os.pread(fd, 4096, 0)
        os.close(fd)
    res["file_per_object_warm_get_ops"] = round(n / (time.perf_counter() - t0))
    if peers:
        import lmdb

        env = lmdb.open(os.path.join(root, "lmdb-blobs"), map_size=1 << 34, lib_version=0, metasync=False)
        t0 = time.perf_counter()
        with env.begin(write=True) as txn:  # LMDB's best case: the whole batch in one transaction
            for i in range(n):
                txn.put(f"blob-{i}".encode(), payload)
        res["lmdb_one_txn_put_ops"] = round(n / (time.perf_counter() - t0))
        for _ in range(2):  # a warm-up pass, then the timed one
            t0 = time.perf_counter()
            for i in order:
                with env.begin() as txn:
                    txn.get(f"blob-{i}".encode())
        res["lmdb_warm_get_ops"] = round(n / (time.perf_counter() - t0))
        env.close()
    say(f"  blobs done ({n} x 4 KiB)")
    return res
