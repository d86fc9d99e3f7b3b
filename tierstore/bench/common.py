"""What every benchmark section shares: the chunk shape, timing and percentile helpers, page-cache
eviction, the process's disk-read counter, and matplotlib when it is installed.  Measures nothing itself.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

SHAPE = (32, 2, 8, 256, 128)  # layers, K/V, kv heads, tokens, head dim: Llama-3-8B, 256-token chunk


def drop_pages(path: str) -> None:
    """Evict a (synced) file's pages from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_bytes() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes"):
                return int(line.split()[1])
    return 0


def median_ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1e3, 3)


def pct_ms(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3, 3)


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def memcpy_ms(data: np.ndarray, reps: int) -> float:
    src = data.reshape(-1).view(np.uint8)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst = np.empty_like(src)
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
        del dst
    return median_ms(times)


def time_ms(f: Callable[[], Any], reps: int) -> float:
    """Median wall time of ``reps`` calls of ``f``, in ms (unrounded)."""
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2] * 1000.0


def pyplot() -> Any:
    """matplotlib.pyplot with a file backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
