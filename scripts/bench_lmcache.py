"""LMCache's engine on CPU storing and retrieving the same chunks through the tierstore plugin and
through LMCache's own local disk backend (buffered and O_DIRECT), in one run; prints a markdown
table (docs/benchmarks.md).  Runs in LMCache's environment:

    bash scripts/lmcache_env.sh && .venv-lmcache/bin/python scripts/bench_lmcache.py [--tokens 4096]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
from lmcache.v1.cache_engine import LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.metadata import LMCacheMetadata

LAYERS, HEADS, DIM, CHUNK = 16, 8, 128, 256
_ids = itertools.count()


class CPUConnector(GPUConnectorInterface):
    """The serving engine's KV buffer [layers, 2, tokens, heads, dim] on the CPU."""

    def __init__(self, kv: torch.Tensor) -> None:
        self.kv = kv

    def from_gpu(self, memory_obj, start, end, **kw):  # type: ignore[no-untyped-def]
        memory_obj.tensor.copy_(self.kv[:, :, start:end].transpose(0, 1).reshape(memory_obj.tensor.shape))

    def to_gpu(self, memory_obj, start, end, **kw):  # type: ignore[no-untyped-def]
        self.kv[:, :, start:end].copy_(memory_obj.tensor.reshape(2, LAYERS, end - start, HEADS, DIM).transpose(0, 1))

    def batched_from_gpu(self, objs, starts, ends, **kw):  # type: ignore[no-untyped-def]
        for m, s, e in zip(objs, starts, ends):
            self.from_gpu(m, s, e)

    def batched_to_gpu(self, objs, starts, ends, **kw):  # type: ignore[no-untyped-def]
        for m, s, e in zip(objs, starts, ends):
            self.to_gpu(m, s, e)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, LAYERS, num_tokens, HEADS * DIM])


def make(kind: str, root: str, kv: torch.Tensor):  # type: ignore[no-untyped-def]
    cfg = {"chunk_size": CHUNK, "local_cpu": False, "max_local_cpu_size": 2.0, "save_unfull_chunk": False}
    if kind == "tierstore":
        cfg.update({"storage_plugins": ["tierstore"], "extra_config": {
            "storage_plugin.tierstore.module_path": "tierstore.integrations.lmcache",
            "storage_plugin.tierstore.class_name": "TierstoreBackend", "tierstore.path": root,
            "tierstore.durability": "group"}})
    else:
        cfg.update({"local_disk": root, "max_local_disk_size": 20.0,
                    "extra_config": {"use_odirect": kind == "lmcache-odirect"}})
    meta = LMCacheMetadata(model_name="bench", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                           kv_dtype=torch.float16, kv_shape=(LAYERS, 2, CHUNK, HEADS, DIM))
    eng = LMCacheEngineBuilder.get_or_create(f"b{next(_ids)}", LMCacheEngineConfig.from_dict(cfg), meta,
                                             CPUConnector(kv), lambda t, r: None, lambda o, r: o)
    eng.post_init()
    return eng


def drop_caches(root: str) -> None:
    for d, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    n = args.tokens
    src = torch.randn(LAYERS, 2, n, HEADS, DIM).half()
    nbytes = src.numel() * 2
    res: dict[str, dict[str, list[float]]] = {}
    for rep in range(args.reps):
        for kind in ("tierstore", "lmcache-disk", "lmcache-odirect"):
            root = tempfile.mkdtemp(prefix=f"bench-{kind}-", dir=os.environ.get("BENCH_DIR"))
            r = res.setdefault(kind, {"store": [], "cold": [], "warm": []})
            eng = make(kind, root, src.clone())
            tokens = torch.arange(rep * n, (rep + 1) * n)
            gc.collect()
            t0 = time.perf_counter()
            eng.store(tokens)
            while eng.lookup(tokens) < n:  # stores are asynchronous: done when all are found
                time.sleep(0.001)
            r["store"].append(time.perf_counter() - t0)
            if kind == "tierstore":
                for b in eng.storage_manager.storage_backends.values():
                    if hasattr(b, "store") and hasattr(b.store, "drop_cached"):
                        b.store.flush()
                        b.store.drop_cached()
            drop_caches(root)
            for mode in ("cold", "warm"):
                eng.gpu_connector.kv.zero_()
                t0 = time.perf_counter()
                got = int(eng.retrieve(tokens).sum())
                r[mode].append(time.perf_counter() - t0)
                assert got == n and torch.equal(eng.gpu_connector.kv, src), (kind, mode, got)
            eng.close()
            shutil.rmtree(root, ignore_errors=True)
    gb = nbytes / 1e9
    print(f"\nLMCache engine on CPU, {n} tokens x {LAYERS} layers x 2 x {HEADS} heads x {DIM} dims fp16 "
          f"({nbytes / 2**20:.0f} MiB, {n // CHUNK} chunks of {CHUNK} tokens), median of {args.reps}, GB/s:\n")
    print("| backend | store | retrieve (cold) | retrieve (second) |")
    print("| --- | --- | --- | --- |")
    for kind, r in res.items():
        print(f"| {kind} | {gb / statistics.median(r['store']):.2f} | {gb / statistics.median(r['cold']):.2f} | "
              f"{gb / statistics.median(r['warm']):.2f} |")
    t, d = res["tierstore"], res["lmcache-disk"]
    print(f"\ntierstore / LMCache disk: store {statistics.median(d['store']) / statistics.median(t['store']):.2f}x, "
          f"cold retrieve {statistics.median(d['cold']) / statistics.median(t['cold']):.2f}x, "
          f"second retrieve {statistics.median(d['warm']) / statistics.median(t['warm']):.2f}x")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
