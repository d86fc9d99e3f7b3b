"""LMCache's engine on CPU storing and retrieving the same chunks through the tierstore plugin and
through LMCache's own local disk backend (buffered and O_DIRECT), in one run; prints a markdown
table (docs/benchmarks.md).  With ``--remote``: through the plugin with a remote tier and through
LMCache's Redis remote backend, on one redis-server started for the run; "cold" is then a
retrieve by a second engine ("node") with nothing local.  Runs in LMCache's environment:

    bash scripts/lmcache_env.sh && .venv-lmcache/bin/python scripts/bench_lmcache.py [--tokens 4096] [--remote]
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


def make(kind: str, root: str, kv: torch.Tensor, url: str | None = None):  # type: ignore[no-untyped-def]
    cfg = {"chunk_size": CHUNK, "local_cpu": False, "max_local_cpu_size": 2.0, "save_unfull_chunk": False}
    if kind.startswith("tierstore"):
        cfg.update({"storage_plugins": ["tierstore"], "extra_config": {
            "storage_plugin.tierstore.module_path": "tierstore.integrations.lmcache",
            "storage_plugin.tierstore.class_name": "TierstoreBackend", "tierstore.path": root,
            # "none" is the guarantee LMCache's disk backend gives (a chunk survives a process crash, not
            # power loss: it never syncs); "group" syncs at least every 64 MiB
            "tierstore.durability": "none" if kind == "tierstore-none" else "group",
            **({"tierstore.remote": url} if kind == "tierstore-remote" else {})}})
    elif kind == "lmcache-redis":
        cfg.update({"remote_url": url, "remote_serde": "naive"})
    else:
        cfg.update({"local_disk": root, "max_local_disk_size": 20.0,
                    "extra_config": {"use_odirect": kind == "lmcache-odirect"}})
    meta = LMCacheMetadata(model_name="bench", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                           kv_dtype=torch.float16, kv_shape=(LAYERS, 2, CHUNK, HEADS, DIM))
    eng = LMCacheEngineBuilder.get_or_create(f"b{next(_ids)}", LMCacheEngineConfig.from_dict(cfg), meta,
                                             CPUConnector(kv), lambda t, r: None, lambda o, r: o)
    eng.post_init()
    return eng


_OPEN: list[object] = []


def close(kind: str, eng) -> None:  # type: ignore[no-untyped-def]
    """Close an engine; LMCache 0.5.6's Redis backend hangs in close(), so those stay open (the
    script ends with os._exit)."""
    if kind == "lmcache-redis":
        _OPEN.append(eng)
    else:
        eng.close()


def drop_caches(root: str) -> None:
    for d, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def wire_once(url: str, src: torch.Tensor, rep: int, r: dict[str, list[float]]) -> None:
    """redis-py SET then GET of every chunk's bytes (the physical limit of the server, client and
    loopback on this machine: no serialisation, no checksum, bytes prepared outside the timing)."""
    import redis

    client = redis.Redis.from_url(url)
    chunks = [src[:, :, i:i + CHUNK].contiguous().numpy().tobytes() for i in range(0, src.shape[2], CHUNK)]
    names = [f"wire:{rep}:{i}" for i in range(len(chunks))]
    t0 = time.perf_counter()
    for name, c in zip(names, chunks):
        client.set(name, c)
    r["store"].append(time.perf_counter() - t0)
    for mode in ("cold", "warm"):
        t0 = time.perf_counter()
        got = [client.get(name) for name in names]
        r[mode].append(time.perf_counter() - t0)
        assert got == chunks
    client.delete(*names)
    client.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--remote", action="store_true", help="the remote tier vs LMCache's Redis backend")
    args = ap.parse_args()
    if args.reps < 1 or args.tokens < CHUNK or args.tokens % CHUNK:
        ap.error(f"--reps must be 1 or more and --tokens a positive multiple of {CHUNK} (LMCache's chunk), "
                 f"got --reps {args.reps} --tokens {args.tokens}")
    server = scratch = None
    kinds = ("tierstore", "tierstore-none", "lmcache-disk", "lmcache-odirect")
    if args.remote:
        from pathlib import Path

        from tierstore.bench.servers import RedisServer
        scratch = tempfile.mkdtemp(prefix="bench-redis-")
        kinds = ("tierstore-remote", "lmcache-redis")
    try:
        if scratch is not None:
            server = RedisServer(Path(scratch)).start()  # (in the try: a failed start leaves no directory)
        run(args, kinds, server.url if server else None)
    finally:
        if server is not None:
            server.stop()
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def run(args: argparse.Namespace, kinds: tuple[str, ...], url: str | None) -> None:
    n = args.tokens
    src = torch.randn(LAYERS, 2, n, HEADS, DIM).half()
    nbytes = src.numel() * 2
    res: dict[str, dict[str, list[float]]] = {}
    for rep in range(args.reps):
        for kind in kinds:
            root = tempfile.mkdtemp(prefix=f"bench-{kind}-", dir=os.environ.get("BENCH_DIR"))
            r = res.setdefault(kind, {"store": [], "cold": [], "warm": []})
            eng = make(kind, root, src.clone(), url)
            tokens = torch.arange(rep * n, (rep + 1) * n)
            gc.collect()
            t0 = time.perf_counter()
            eng.store(tokens)
            while eng.lookup(tokens) < n:  # stores are asynchronous: done when all are found
                time.sleep(0.001)
            if kind == "tierstore-remote":  # ... and, for the remote tier, once the server holds them
                stores = [b.store for b in eng.storage_manager.storage_backends.values() if hasattr(b, "store")]
                while sum(st.stats()["tiers"]["remote"]["puts"] for st in stores) < n // CHUNK:
                    time.sleep(0.001)
            r["store"].append(time.perf_counter() - t0)
            if kind in ("tierstore", "tierstore-none"):
                for b in eng.storage_manager.storage_backends.values():
                    if hasattr(b, "store") and hasattr(b.store, "drop_cached"):
                        b.store.flush()
                        b.store.drop_cached()
            drop_caches(root)
            if url is not None:  # a second node, with nothing local, retrieves from the server
                close(kind, eng)
                root2 = root + "-node2"
                eng = make(kind, root2, torch.zeros_like(src), url)
            for mode in ("cold", "warm"):
                eng.gpu_connector.kv.zero_()
                t0 = time.perf_counter()
                got = int(eng.retrieve(tokens).sum())
                r[mode].append(time.perf_counter() - t0)
                assert got == n and torch.equal(eng.gpu_connector.kv, src), (kind, mode, got)
            close(kind, eng)
            shutil.rmtree(root, ignore_errors=True)
            shutil.rmtree(root + "-node2", ignore_errors=True)
        if url is not None:  # the wire: redis-py SET / GET of the same chunks' bytes, prepared untimed
            wire = res.setdefault("redis-py SET / GET (the wire)", {"store": [], "cold": [], "warm": []})
            wire_once(url, src, rep, wire)
    gb = nbytes / 1e9
    print(f"\nLMCache engine on CPU, {n} tokens x {LAYERS} layers x 2 x {HEADS} heads x {DIM} dims fp16 "
          f"({nbytes / 2**20:.0f} MiB, {n // CHUNK} chunks of {CHUNK} tokens), median of {args.reps}, GB/s:\n")
    print("| backend | store | retrieve (cold) | retrieve (second) |")
    print("| --- | --- | --- | --- |")
    for kind, r in res.items():
        print(f"| {kind} | {gb / statistics.median(r['store']):.2f} | {gb / statistics.median(r['cold']):.2f} | "
              f"{gb / statistics.median(r['warm']):.2f} |")
    d = res["lmcache-redis"] if url else res["lmcache-disk"]
    peer = "Redis" if url else "disk"
    if url is not None:
        w = res["redis-py SET / GET (the wire)"]
        print(f"\nLMCache Redis / the wire: store "
              f"{statistics.median(w['store']) / statistics.median(d['store']):.2f}x, cold retrieve "
              f"{statistics.median(w['cold']) / statistics.median(d['cold']):.2f}x "
              f"(1.0x: as fast as redis-py moving the bytes)")
    for kind in ("tierstore-remote",) if url else ("tierstore", "tierstore-none"):
        t = res[kind]
        print(f"\n{kind} / LMCache {peer}: store {statistics.median(d['store']) / statistics.median(t['store']):.2f}x, "
              f"cold retrieve {statistics.median(d['cold']) / statistics.median(t['cold']):.2f}x, "
              f"second retrieve {statistics.median(d['warm']) / statistics.median(t['warm']):.2f}x")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # engines left open (see close) have non-daemon threads
