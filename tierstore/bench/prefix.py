"""The prefix section of ``tierstore bench``: ``match_prefix`` of 1,000 chunk hashes in stores of several
sizes, against the same lookups on a plain LMDB environment.  It measures; it never asserts.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..objects import Blob
from .common import median_ms


def bench_prefix(root: str, *, sizes: tuple[int, ...], query: int, reps: int,
                 say: Callable[..., None]) -> dict[str, Any]:
    """match_prefix of ``query`` stored chunk hashes (a 256K-token context at 256 tokens a chunk),
    in stores of several sizes, against the same lookups done with py-lmdb on a plain LMDB
    environment holding the same keys (the raw-index baseline), in the same process."""
    import lmdb

    from .. import Store
    from ..prefix import chunk_hashes

    out: dict[str, Any] = {"query_hashes": query, "stores": []}
    for n in sizes:
        d = os.path.join(root, f"p{n}")
        hashes = chunk_hashes(np.arange(n * 4, dtype=np.int64), chunk_tokens=4, salt=f"bench{n}")
        with Store(os.path.join(d, "ts"), durability="none") as s:
            for h in hashes:
                s.put(h, Blob(h), namespace="m")
            s.flush()
            env = lmdb.open(os.path.join(d, "raw"), map_size=1 << 32, lib_version=0)
            with env.begin(write=True) as txn:
                for h in hashes:
                    txn.put(b"\x01m" + h, h)
            q = hashes[n // 2 : n // 2 + query]  # stored, in the middle of the key space
            ts_t, raw_t = [], []
            for _ in range(reps):
                t0 = time.perf_counter()
                matched = s.match_prefix(q, namespace="m")
                ts_t.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                with env.begin() as txn:
                    raw = 0
                    for h in q:
                        if txn.get(b"\x01m" + h) is None:
                            break
                        raw += 1
                raw_t.append(time.perf_counter() - t0)
            env.close()
            assert matched == raw == len(q)
            ts_us, raw_us = median_ms(ts_t) * 1000 / len(q), median_ms(raw_t) * 1000 / len(q)
            out["stores"].append({"objects": n, "matched": matched, "us_per_hash": round(ts_us, 2),
                                  "raw_lmdb_us_per_hash": round(raw_us, 2),
                                  "ratio_vs_raw_lmdb": round(ts_us / raw_us, 2),
                                  "ms_for_query": round(ts_us * len(q) / 1000, 3)})
            say(f"  {n:,} objects: match_prefix of {len(q)} hashes {ts_us * len(q) / 1000:.2f} ms "
                f"({ts_us:.2f} us/hash; raw LMDB gets {raw_us:.2f} us/hash)")
        shutil.rmtree(d)
    return out
