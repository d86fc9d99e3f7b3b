"""The writers section of ``tierstore bench``: several writer processes on one store (SPEC.md §7.8).

N = 1, 2, 4 processes each put the same work into one store at once -- durable 32 MiB KV chunks,
and 4 KiB blobs in group-committed batches of 1,000 -- and the aggregate rate is compared with
N = 1 (a shared disk can do no more; the cross-process append lock must not make it do much
less).  N = 1 with ``exclusive=True`` (no append lock) is the reference for the lock's own cost.
Each process opens the store first and starts when all are ready; the wall time runs from the
start signal to the last process's end.  It measures and reports; it never asserts.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from .common import SHAPE, pyplot

_WORKER = r"""
import sys, time
import numpy as np
import tierstore
from tierstore import Blob, KVCache
path, what, count, exclusive, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1", int(sys.argv[5])
shape = tuple(int(x) for x in sys.argv[6].split(","))
s = tierstore.open(path, durability="sync", exclusive=exclusive, lock_timeout=120)
rng = np.random.default_rng(seed)
if what == "chunks":
    kv = rng.standard_normal(shape).astype(np.float16)
else:
    payload = rng.bytes(4096)
print("ready", flush=True)
sys.stdin.readline()
for i in range(count):
    if what == "chunks":
        s.put(f"{seed}-{i}", KVCache(kv))
    else:
        s.put_many([(f"{seed}-{i}-{j}", Blob(payload)) for j in range(1000)])
s.close()
print("done", flush=True)
"""


def _round(root: str, what: str, n: int, count: int, exclusive: bool) -> float:
    """Seconds for ``n`` processes to each do ``count`` units of ``what`` into one fresh store."""
    path = os.path.join(root, f"{what}-{n}-{int(exclusive)}")
    shutil.rmtree(path, ignore_errors=True)
    from .. import open as open_store

    open_store(path).close()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, path, what, str(count), "1" if exclusive else "0",
                               str(w), ",".join(map(str, SHAPE))], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=env) for w in range(n)]
    try:
        for p in procs:
            if p.stdout is None or p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a writer process failed to open the store ({p.wait()})")
        t0 = time.perf_counter()
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        for p in procs:
            assert p.stdout is not None
            if p.stdout.readline().strip() != "done":
                raise RuntimeError(f"a writer process failed ({p.wait()})")
        seconds = time.perf_counter() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    shutil.rmtree(path, ignore_errors=True)
    return seconds


def bench_writers(root: str, *, quick: bool, say: Callable[..., None]) -> dict[str, Any]:
    os.makedirs(root, exist_ok=True)
    chunk_bytes = 2
    for d in SHAPE:
        chunk_bytes *= d
    chunks = 3 if quick else 8  # per process
    batches = 3 if quick else 10  # per process, 1,000 blobs each
    reps = 1 if quick else 3
    res: dict[str, Any] = {"chunk_bytes": chunk_bytes, "chunks_per_process": chunks,
                           "blob_batches_per_process": batches, "chunks_gib_s": {}, "blobs_ops": {}}
    for label, n, exclusive in (("1 exclusive", 1, True), ("1", 1, False), ("2", 2, False), ("4", 4, False)):
        best_c = min(_round(root, "chunks", n, chunks, exclusive) for _ in range(reps))
        best_b = min(_round(root, "blobs", n, batches, exclusive) for _ in range(reps))
        res["chunks_gib_s"][label] = n * chunks * chunk_bytes / best_c / 2**30
        res["blobs_ops"][label] = round(n * batches * 1000 / best_b)
        say(f"  N={label:12s} 32 MiB durable puts {res['chunks_gib_s'][label]:.2f} GiB/s aggregate, "
            f"4 KiB put_many {res['blobs_ops'][label]:,}/s aggregate")
    for what in ("chunks_gib_s", "blobs_ops"):
        base = res[what]["1"]
        res[what + "_vs_1"] = {k: v / base for k, v in res[what].items()}
    return res


def markdown_writers(r: dict[str, Any]) -> list[str]:
    lines = ["", "## Several writer processes (aggregate, vs N = 1)", "",
             "| N | 32 MiB durable puts | vs N=1 | 4 KiB put_many | vs N=1 |", "| --- | --- | --- | --- | --- |"]
    for k in r["chunks_gib_s"]:
        lines.append(f"| {k} | {r['chunks_gib_s'][k]:.2f} GiB/s | {r['chunks_gib_s_vs_1'][k]:.2f}x | "
                     f"{r['blobs_ops'][k]:,}/s | {r['blobs_ops_vs_1'][k]:.2f}x |")
    return lines


def plot_writers(r: dict[str, Any], path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    labels = list(r["chunks_gib_s"])
    for ax, what, title in ((axes[0], "chunks_gib_s", "32 MiB durable puts (GiB/s)"),
                            (axes[1], "blobs_ops", "4 KiB put_many (objects/s)")):
        ax.bar(labels, [r[what][k] for k in labels], color=["#999999", "#4c72b0", "#4c72b0", "#4c72b0"])
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("writer processes")
        for i, k in enumerate(labels):
            ax.annotate(f"{r[what + '_vs_1'][k]:.2f}x", (i, r[what][k]), ha="center", va="bottom", fontsize=8)
    fig.suptitle("Several writer processes on one store: aggregate rate, ratio to N = 1", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
