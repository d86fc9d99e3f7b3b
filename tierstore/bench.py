"""``tierstore bench``: tierstore next to raw-file baselines and peers, measured in one run.

Chunk section: a Llama-3-8B-shaped KV chunk (256 tokens x 32 layers x 2 x 8 heads x 128
dims, fp16 = 32 MiB).  Blob section: 4 KiB blobs.  Every system does the same operations on
the same bytes on the same disk, interleaved, and results are reported as medians and as
ratios to the file-per-object baseline (one file per object, ``pwrite`` + ``fdatasync`` to
put, ``preadv`` into a fresh buffer to get).  "Cold" reads first evict the file's pages with
``posix_fadvise(DONTNEED)``; /proc/self/io ``read_bytes`` counts what a cold read fetched.

Peers (safetensors, torch.save, h5py) are optional (``pip install 'tierstore[bench]'``); a
missing one is reported as skipped.  Durable puts of peers are followed by an fsync so
that every system pays for durability.  No assertion here: this module measures.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from . import open as open_store
from .objects import Blob, KVCache

SHAPE = (32, 2, 8, 256, 128)  # layers, K/V, kv heads, tokens, head dim: Llama-3-8B, 256-token chunk


def _drop(path: str) -> None:
    """Evict a (synced) file's pages from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes"):
                return int(line.split()[1])
    return 0


def _median_ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1e3, 3)


def _pct_ms(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3, 3)


class _System:
    """One contender: put(i), get(i), layer(i, l); files(i) for cold reads."""

    name = ""
    durable = True

    def put(self, i: int) -> None: ...
    def get(self, i: int) -> Any: ...
    def layer(self, i: int, l: int) -> Any: ...
    def files(self, i: int) -> list[str]: return []
    def before_cold(self) -> None: ...  # noqa: E704  (e.g. drop mappings that keep pages resident)
    def close(self) -> None: ...


class FilePerObject(_System):
    name = "file-per-object (baseline)"

    def __init__(self, root: str, data: np.ndarray) -> None:
        self.root, self.buf = root, memoryview(data).cast("B")
        self.layer_bytes = data[0].nbytes
        os.makedirs(root)

    def _p(self, i: int) -> str:
        return os.path.join(self.root, f"{i}.bin")

    def put(self, i: int) -> None:
        fd = os.open(self._p(i), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            os.pwrite(fd, self.buf, 0)
            os.fdatasync(fd)
        finally:
            os.close(fd)

    def get(self, i: int) -> np.ndarray:
        out = np.empty(len(self.buf), np.uint8)
        fd = os.open(self._p(i), os.O_RDONLY)
        try:
            os.preadv(fd, [out], 0)
        finally:
            os.close(fd)
        return out

    def layer(self, i: int, l: int) -> np.ndarray:
        out = np.empty(self.layer_bytes, np.uint8)
        fd = os.open(self._p(i), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            os.preadv(fd, [out], l * self.layer_bytes)
        finally:
            os.close(fd)
        return out

    def files(self, i: int) -> list[str]:
        return [self._p(i)]


class SequentialLog(FilePerObject):
    """Appends into one file (pwrite + fdatasync): the physical limit of a log writer."""

    name = "sequential write+fdatasync (baseline)"

    def __init__(self, root: str, data: np.ndarray) -> None:
        super().__init__(root, data)
        self.fd = os.open(os.path.join(root, "log"), os.O_RDWR | os.O_CREAT | os.O_TRUNC)

    def put(self, i: int) -> None:
        os.pwrite(self.fd, self.buf, i * len(self.buf))
        os.fdatasync(self.fd)

    def get(self, i: int) -> np.ndarray:
        out = np.empty(len(self.buf), np.uint8)
        os.preadv(self.fd, [out], i * len(self.buf))
        return out

    def layer(self, i: int, l: int) -> np.ndarray:
        out = np.empty(self.layer_bytes, np.uint8)
        os.preadv(self.fd, [out], i * len(self.buf) + l * self.layer_bytes)
        return out

    def files(self, i: int) -> list[str]:
        return [os.path.join(self.root, "log")]

    def close(self) -> None:
        os.close(self.fd)


class Tierstore(_System):
    def __init__(self, root: str, data: np.ndarray, durability: str, **options: Any) -> None:
        extra = "".join(f", {k}={v}" for k, v in options.items())
        self.name = f"tierstore ({durability}{extra})"
        self.durable = durability == "sync"
        self.root, self.data, self.durability = root, data, durability
        self.store = open_store(root, durability=durability, **options)

    def put(self, i: int) -> None:
        self.store.put(f"chunk-{i}", KVCache(self.data))
        if self.durability == "group":
            self.store.flush()  # one put per group: what a durable group costs

    def get(self, i: int) -> Any:
        return self.store.get(f"chunk-{i}")

    def layer(self, i: int, l: int) -> Any:
        return self.store.get(f"chunk-{i}", layers=l)

    def files(self, i: int) -> list[str]:
        seg = os.path.join(self.root, "segments")
        return [os.path.join(seg, n) for n in os.listdir(seg)]

    def before_cold(self) -> None:
        # a cold read must not be a cache hit (the DRAM tier's memory of first reads stays: a
        # cold read of an object read once before is promoted, as it would be in use)
        for tier in self.store._tiers.tiers().values():
            tier.clear()

    def close(self) -> None:
        self.store.close()


class _FileEach(_System):
    """A peer that keeps one file per object in ``root``, named ``<i><suffix>``."""

    suffix = ""

    def __init__(self, root: str, data: np.ndarray) -> None:
        self.root, self.data = root, data
        os.makedirs(root)

    def _p(self, i: int) -> str:
        return os.path.join(self.root, f"{i}{self.suffix}")

    def files(self, i: int) -> list[str]:
        return [self._p(i)]


class Safetensors(_FileEach):
    name, suffix = "safetensors", ".safetensors"

    def __init__(self, root: str, data: np.ndarray) -> None:
        from safetensors.numpy import save_file  # noqa: F401  (skipped when not installed)

        super().__init__(root, data)

    def put(self, i: int) -> None:
        from safetensors.numpy import save_file

        save_file({f"layer.{l}": self.data[l] for l in range(self.data.shape[0])}, self._p(i))
        _fsync_path(self._p(i))

    def get(self, i: int) -> Any:
        from safetensors.numpy import load_file

        return load_file(self._p(i))

    def layer(self, i: int, l: int) -> Any:
        from safetensors import safe_open

        with safe_open(self._p(i), framework="numpy") as f:
            return f.get_tensor(f"layer.{l}")


class TorchSave(_FileEach):
    name, suffix = "torch.save/load", ".pt"

    def __init__(self, root: str, data: np.ndarray) -> None:
        import torch

        super().__init__(root, data)
        self.t = torch.from_numpy(data)

    def put(self, i: int) -> None:
        import torch

        torch.save(self.t, self._p(i))
        _fsync_path(self._p(i))

    def get(self, i: int) -> Any:
        import torch

        return torch.load(self._p(i), weights_only=True)

    def layer(self, i: int, l: int) -> Any:
        return self.get(i)[l]  # the format has no partial read


class H5py(_FileEach):
    name, suffix = "h5py", ".h5"

    def __init__(self, root: str, data: np.ndarray) -> None:
        import h5py  # noqa: F401

        super().__init__(root, data)

    def put(self, i: int) -> None:
        import h5py

        with h5py.File(self._p(i), "w") as f:
            f.create_dataset("kv", data=self.data, chunks=(1, *self.data.shape[1:]))
        _fsync_path(self._p(i))

    def get(self, i: int) -> Any:
        import h5py

        with h5py.File(self._p(i), "r") as f:
            return f["kv"][:]

    def layer(self, i: int, l: int) -> Any:
        import h5py

        with h5py.File(self._p(i), "r") as f:
            return f["kv"][l]


class ODirect(_FileEach):
    """One file per object written and read with O_DIRECT, LMCache's local-disk style (plus
    an fdatasync so the put is durable)."""

    name, suffix = "O_DIRECT file per object (LMCache-style)", ".bin"

    def __init__(self, root: str, data: np.ndarray) -> None:
        if not hasattr(os, "O_DIRECT"):
            raise ImportError("O_DIRECT", name="O_DIRECT")
        super().__init__(root, data)
        from .block import aligned_empty

        self.buf = aligned_empty(data.nbytes)
        self.buf[:] = data.reshape(-1).view(np.uint8)
        self.layer_bytes = data[0].nbytes

    def put(self, i: int) -> None:
        fd = os.open(self._p(i), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT)
        try:
            os.pwritev(fd, [self.buf], 0)
            os.fdatasync(fd)
        finally:
            os.close(fd)

    def _read(self, i: int, nbytes: int, offset: int) -> np.ndarray:
        from .block import aligned_empty

        out = aligned_empty(nbytes)
        fd = os.open(self._p(i), os.O_RDONLY | os.O_DIRECT)
        try:
            os.preadv(fd, [out], offset)
        finally:
            os.close(fd)
        return out

    def get(self, i: int) -> np.ndarray:
        return self._read(i, self.buf.nbytes, 0)

    def layer(self, i: int, l: int) -> np.ndarray:
        return self._read(i, self.layer_bytes, l * self.layer_bytes)


class Lmdb(_System):
    name = "LMDB (one value per layer)"

    def __init__(self, root: str, data: np.ndarray) -> None:
        import lmdb

        self.env = lmdb.open(root, map_size=1 << 36, lib_version=0)
        self.root, self.data = root, data

    def put(self, i: int) -> None:
        with self.env.begin(write=True) as txn:
            for l in range(self.data.shape[0]):
                txn.put(f"{i}/{l}".encode(), memoryview(self.data[l]).cast("B"))

    def get(self, i: int) -> Any:
        out = np.empty(self.data.shape, self.data.dtype)
        with self.env.begin(buffers=True) as txn:
            for l in range(self.data.shape[0]):
                out[l] = np.frombuffer(txn.get(f"{i}/{l}".encode()), self.data.dtype).reshape(self.data.shape[1:])
        return out

    def layer(self, i: int, l: int) -> Any:
        with self.env.begin() as txn:
            return txn.get(f"{i}/{l}".encode())

    def files(self, i: int) -> list[str]:
        return [os.path.join(self.root, "data.mdb")]

    def before_cold(self) -> None:
        # LMDB reads through a memory map: pages mapped into this process survive
        # POSIX_FADV_DONTNEED, so reopen the environment to make a cold read cold
        import lmdb

        self.env.close()
        self.env = lmdb.open(self.root, map_size=1 << 36, lib_version=0)

    def close(self) -> None:
        self.env.close()


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _memcpy(data: np.ndarray, reps: int) -> float:
    src = data.reshape(-1).view(np.uint8)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst = np.empty_like(src)
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
        del dst
    return _median_ms(times)


def bench_chunk(root: str, *, reps: int, layer_reps: int, peers: bool, say: Callable[..., None]) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    data = rng.standard_normal(SHAPE, dtype=np.float32).astype(np.float16)
    size = data.nbytes
    layer_bytes = data[0].nbytes
    makers: list[tuple[str, Callable[[], _System]]] = [
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
    systems: dict[str, _System] = {}
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
        res[k]["put_ms"] = _median_ms(put_t[k])
    # full gets: cold (pages evicted) then warm
    for mode in ("cold", "warm"):
        tt: dict[str, list[float]] = {k: [] for k in systems}
        rb: dict[str, list[int]] = {k: [] for k in systems}
        for i in range(reps):
            for k, s in systems.items():
                if mode == "cold":
                    s.before_cold()
                    for p in s.files(i):
                        _drop(p)
                else:
                    s.get(i)
                gc.collect()
                r0 = _read_bytes()
                t0 = time.perf_counter()
                out = s.get(i)
                tt[k].append(time.perf_counter() - t0)
                rb[k].append(_read_bytes() - r0)
                del out
        for k in systems:
            res[k][f"get_{mode}_ms"] = _median_ms(tt[k])
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
                        _drop(p)
                else:
                    s.layer(i, l)
                r0 = _read_bytes()
                t0 = time.perf_counter()
                s.layer(i, l)
                tt[k].append(time.perf_counter() - t0)
                rb[k].append(_read_bytes() - r0)
        for k in systems:
            res[k][f"layer_{mode}_p50_ms"] = _median_ms(tt[k])
            res[k][f"layer_{mode}_p99_ms"] = _pct_ms(tt[k], 0.99)
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
           "memcpy_ms": _memcpy(data, max(reps, 5)), "systems": res, "skipped": skipped,
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


def bench_prefix(root: str, *, sizes: tuple[int, ...], query: int, reps: int,
                 say: Callable[..., None]) -> dict[str, Any]:
    """match_prefix of ``query`` stored chunk hashes (a 256K-token context at 256 tokens a chunk),
    in stores of several sizes, against the same lookups done with py-lmdb on a plain LMDB
    environment holding the same keys (the raw-index baseline), in the same process."""
    import lmdb

    from .prefix import chunk_hashes
    from .store import Store

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
            ts_us, raw_us = _median_ms(ts_t) * 1000 / len(q), _median_ms(raw_t) * 1000 / len(q)
            out["stores"].append({"objects": n, "matched": matched, "us_per_hash": round(ts_us, 2),
                                  "raw_lmdb_us_per_hash": round(raw_us, 2),
                                  "ratio_vs_raw_lmdb": round(ts_us / raw_us, 2),
                                  "ms_for_query": round(ts_us * len(q) / 1000, 3)})
            say(f"  {n:,} objects: match_prefix of {len(q)} hashes {ts_us * len(q) / 1000:.2f} ms "
                f"({ts_us:.2f} us/hash; raw LMDB gets {raw_us:.2f} us/hash)")
        shutil.rmtree(d)
    return out


def _sample_paths() -> tuple[str, str]:
    """The real K/V and embedding sample: the project's full one when present, else the slice
    kept in tests/data (128 tokens, 1,024 embeddings)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    full = os.path.join(os.path.dirname(here), "shared", "data")
    if os.path.exists(os.path.join(full, "minilm_qkv_sample.npz")):
        return os.path.join(full, "minilm_qkv_sample.npz"), os.path.join(full, "minilm_embeddings_8k_fp16.npy")
    return (os.path.join(here, "tests", "data", "minilm_qkv_128tok.npz"),
            os.path.join(here, "tests", "data", "minilm_embeddings_1k_fp16.npy"))


def bench_codecs(say: Callable[..., None]) -> dict[str, Any]:
    """Every codec on the real sample: ratio, encode / decode MB/s (one thread, of fp16 bytes),
    relative L2 error, attention-output error (KV) and recall@10 against exact search (vectors)."""
    from . import codecs

    kv_path, emb_path = _sample_paths()
    npz = np.load(kv_path)
    if "kv" in npz:  # the slice in tests/data: [layers, 2, H, T, D], no queries
        pairs = [(npz["kv"], None)]
    else:
        docs = sorted({k.rsplit("_", 1)[0] for k in npz.files})
        pairs = [(np.stack([npz[d + "_k"], npz[d + "_v"]], axis=1), npz[d + "_q"]) for d in docs]
    out: dict[str, Any] = {"kv_sample": os.path.basename(kv_path), "kv_shape": list(pairs[0][0].shape),
                           "kv": [], "vectors": []}
    kv_specs = ["raw", "zstd", "shuffle+zstd", "fp8", "int8", "int8+zstd", "int4", "int4+zstd", "int2", "int2+zstd",
                "kvq-ans:bins=64/32", "kvq-ans", "kvq-ans:bins=12/12"]
    for spec in kv_specs:
        runs = [codecs.evaluate(spec, kv, queries=q) for kv, q in pairs]
        row = {k: round(float(np.mean([r[k] for r in runs])), 1 if k.endswith("mb_s") else 5)
               for k in ("ratio", "encode_mb_s", "decode_mb_s", "rel_l2", "attention_error")}
        row["codec"] = runs[0]["codec"]
        out["kv"].append(row)
        say(f"  kv {row['codec']:>22}: {row['ratio']:.3f}x, enc {row['encode_mb_s']:.0f} / dec "
            f"{row['decode_mb_s']:.0f} MB/s, attention error {row['attention_error'] * 100:.2f}%")
    emb = np.load(emb_path)
    nq = min(1000, len(emb) // 5)
    q, db = emb[:nq].astype(np.float32), np.ascontiguousarray(emb[nq:])
    exact_scores = q @ db.astype(np.float32).T
    exact = np.argsort(-exact_scores, axis=1)[:, :10]

    def recall(scores: np.ndarray, rescore: int = 0) -> float:
        if rescore:
            cand = np.argsort(-scores, axis=1)[:, : 10 * rescore]
            got = np.take_along_axis(cand, np.argsort(-np.take_along_axis(exact_scores, cand, 1), 1)[:, :10], 1)
        else:
            got = np.argsort(-scores, axis=1)[:, :10]
        return float(np.mean([len(set(a) & set(b)) / 10 for a, b in zip(exact, got)]))

    for spec in ["raw", "shuffle+zstd", "int8", "int8+zstd", "binary"]:
        r = codecs.evaluate(spec, db, kind="vectors")
        ch = codecs.parse(spec, "vectors")
        ext = codecs.Extent("vectors", db.shape, "float16")
        dec = codecs.decode(ch.codec, codecs.encode(ch.codec, db.reshape(-1).view(np.uint8), ext, ch.params), ext,
                            ch.params).view("<f2").reshape(db.shape).astype(np.float32)
        scores = q @ dec.T
        row = {"codec": r["codec"], "ratio": r["ratio"], "encode_mb_s": r["encode_mb_s"],
               "decode_mb_s": r["decode_mb_s"], "recall_at_10": round(recall(scores), 4),
               "recall_at_10_rescored_4x": round(recall(scores, 4), 4)}
        out["vectors"].append(row)
        say(f"  vectors {row['codec']:>16}: {row['ratio']:.3f}x, R@10 {row['recall_at_10']} "
            f"(re-scored 4x: {row['recall_at_10_rescored_4x']})")
    out["vectors_sample"] = {"database": int(len(db)), "queries": int(nq), "dim": int(db.shape[1])}
    return out


def run_bench(path: str | None = None, *, quick: bool = False, peers: bool = True, out: str | None = None,
              quiet: bool = False, sections: list[str] | None = None) -> dict[str, Any]:
    say = (lambda *a: None) if quiet else print
    root = tempfile.mkdtemp(prefix="tierstore-bench-", dir=path)
    sections = sections or ["chunk", "blobs", "prefix", "codecs", "tiers"]
    result: dict[str, Any] = {"quick": quick, "machine": {"cpus": os.cpu_count()}}
    try:
        if "chunk" in sections:
            say("chunk: Llama-3-8B KV chunk [32, 2, 8, 256, 128] fp16 = 32 MiB")
            result["chunk"] = bench_chunk(os.path.join(root, "chunk"), reps=3 if quick else 10,
                                          layer_reps=40 if quick else 200, peers=peers, say=say)
            shutil.rmtree(os.path.join(root, "chunk"))
        if "blobs" in sections:
            say("blobs: 4 KiB")
            result["blobs"] = bench_blobs(os.path.join(root, "blobs"), n=3000 if quick else 20000, peers=peers, say=say)
        if "codecs" in sections:
            say("codecs: the real K/V and embedding sample")
            result["codecs"] = bench_codecs(say)
        if "prefix" in sections:
            say("prefix: match_prefix of 1,000 chunk hashes")
            result["prefix"] = bench_prefix(os.path.join(root, "prefix"), query=1000, reps=5 if quick else 21,
                                            sizes=(2000, 20000) if quick else (2000, 20000, 200000), say=say)
        if "tiers" in sections:
            from .bench_tiers import bench_tiers
            say("tiers: DRAM hits, SSD->DRAM promotion, a multi-turn chat trace (LRU vs session-aware)")
            result["tiers"] = bench_tiers(os.path.join(root, "tiers"), quick=quick, say=say)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if not quiet:
        print_report(result)
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump(result, f, indent=2)
        if "chunk" in result:
            plot(result, os.path.join(out, "benchmarks.png"))
        if "tiers" in result:
            from .bench_tiers import plot_tiers
            plot_tiers(result["tiers"], os.path.join(out, "tiers.png"))
        with open(os.path.join(out, "results.md"), "w") as f:
            f.write(markdown(result))
    return result


def markdown(result: dict[str, Any]) -> str:
    """The result tables, for docs/benchmarks.md."""
    lines: list[str] = []
    if "chunk" in result:
        c = result["chunk"]
        lines += [f"32 MiB chunk: medians of {c['reps']} operations per system (single-layer gets: "
                  f"{c['layer_reps']} warm, {max(8, c['layer_reps'] // 4)} cold); memcpy of 32 MiB: "
                  f"{c['memcpy_ms']} ms.", "",
                  "| system | put ms | get cold ms | get warm ms | 1 layer cold p50 / p99 ms | "
                  "1 layer warm p50 / p99 ms | bytes read, cold layer |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in c["systems"].values():
            lines.append(f"| {r['name']} | {r['put_ms']:.1f} | {r['get_cold_ms']:.1f} | {r['get_warm_ms']:.1f} | "
                         f"{r['layer_cold_p50_ms']:.2f} / {r['layer_cold_p99_ms']:.2f} | "
                         f"{r['layer_warm_p50_ms']:.2f} / {r['layer_warm_p99_ms']:.2f} | "
                         f"{r['layer_cold_read_bytes']:,} |")
        lines += ["", "Time relative to the file-per-object baseline (lower is faster):", "",
                  "| system | put | get cold | get warm | 1 layer cold | 1 layer warm |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for r in c["systems"].values():
            q = r["ratios_vs_baseline"]
            lines.append(f"| {r['name']} | {q.get('put_ms', '-')} | {q.get('get_cold_ms', '-')} | "
                         f"{q.get('get_warm_ms', '-')} | {q.get('layer_cold_p50_ms', '-')} | "
                         f"{q.get('layer_warm_p50_ms', '-')} |")
        t = c["targets"]
        lines += ["", "| target | measured |", "| --- | --- |",
                  f"| durable put >= 0.85x sequential write+fdatasync (throughput) | "
                  f"{t['durable_put_throughput_vs_sequential_write']}x |",
                  f"| cold get >= 0.9x sequential read (throughput) | {t['cold_get_throughput_vs_sequential_read']}x |",
                  f"| warm 1-layer get <= 1.5x raw pread of 1 MiB (time) | {t['warm_layer_get_vs_raw_pread']}x |",
                  f"| cold 1-layer get reads <= the layer's bytes | {t['cold_layer_read_bytes_vs_layer']}x |",
                  f"| warm full get, time vs file-per-object (LMDB's, the best peer's, in this run: "
                  f"{c['systems'].get('lmdb', {}).get('ratios_vs_baseline', {}).get('get_warm_ms', '-')}x) | "
                  f"{t['warm_get_vs_file_per_object']}x |",
                  f"| (without the DRAM tier, dram_bytes=0) warm 1-layer get vs raw pread | "
                  f"{t['warm_layer_get_vs_raw_pread_without_dram_tier']}x |"]
        for k, why in c["skipped"].items():
            lines.append(f"\nSkipped {k}: {why}.")
    if "blobs" in result:
        b = result["blobs"]
        lines += ["", f"4 KiB blobs, {b['n']} operations, ops/s:", "", "| measurement | ops/s |", "| --- | --- |"]
        lines += [f"| {k.removesuffix('_ops').replace('_', ' ')} | {v:,} |" for k, v in b.items() if k.endswith("_ops")]
    if "codecs" in result:
        c = result["codecs"]
        lines += ["", f"Codecs on the real K/V sample ({c['kv_sample']}, {c['kv_shape']} per document, fp16; one "
                  "thread; MB/s of fp16 bytes; attention error = |softmax(QK^T/sqrt d)V - exact| / |exact| with "
                  "the captured queries):", "",
                  "| codec | ratio vs fp16 | encode MB/s | decode MB/s | rel. L2 error | attention error |",
                  "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {r['codec']} | {r['ratio']:.3f} | {r['encode_mb_s']:.0f} | {r['decode_mb_s']:.0f} | "
                  f"{r['rel_l2'] * 100:.2f}% | {r['attention_error'] * 100:.2f}% |" for r in c["kv"]]
        v = c["vectors_sample"]
        lines += ["", f"Vector codecs on {v['database']:,} real embeddings ({v['dim']} dims, fp16), {v['queries']} "
                  "held-out queries, recall@10 against exact search:", "",
                  "| codec | ratio vs fp16 | encode MB/s | decode MB/s | recall@10 | re-scored 4x |",
                  "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {r['codec']} | {r['ratio']:.3f} | {r['encode_mb_s']:.0f} | {r['decode_mb_s']:.0f} | "
                  f"{r['recall_at_10']} | {r['recall_at_10_rescored_4x']} |" for r in c["vectors"]]
    if "prefix" in result:
        p = result["prefix"]
        lines += ["", f"match_prefix of {p['query_hashes']:,} stored chunk hashes (medians), against the same "
                  "gets on a plain LMDB environment (py-lmdb, same process):", "",
                  "| objects in the store | ms per query | us per hash | raw LMDB us per hash | ratio |",
                  "| --- | --- | --- | --- | --- |"]
        lines += [f"| {r['objects']:,} | {r['ms_for_query']} | {r['us_per_hash']} | {r['raw_lmdb_us_per_hash']} | "
                  f"{r['ratio_vs_raw_lmdb']}x |" for r in p["stores"]]
    if "tiers" in result:
        from .bench_tiers import markdown_tiers
        lines += ["", *markdown_tiers(result["tiers"])]
    return "\n".join(lines) + "\n"


def print_report(result: dict[str, Any]) -> None:
    if "chunk" in result:
        c = result["chunk"]
        print(f"\n32 MiB KV chunk, medians of {c['reps']} (layer gets: {c['layer_reps']}); memcpy {c['memcpy_ms']} ms")
        cols = ["put_ms", "get_cold_ms", "get_warm_ms", "layer_cold_p50_ms", "layer_cold_p99_ms",
                "layer_warm_p50_ms", "layer_warm_p99_ms", "layer_cold_read_bytes"]
        print(f"{'system':40s}" + "".join(f"{h:>14s}" for h in
              ["put", "get cold", "get warm", "layer cold", "p99", "layer warm", "p99", "cold bytes"]))
        for r in c["systems"].values():
            print(f"{r['name']:40s}" + "".join(f"{r.get(h, float('nan')):>14,.2f}" if not h.endswith("bytes")
                                              else f"{r.get(h, 0):>14,d}" for h in cols))
        print("ratios to file-per-object (time; < 1 is faster):")
        for r in c["systems"].values():
            print(f"  {r['name']:38s} " + "  ".join(f"{k.removesuffix('_ms')}={v}" for k, v in
                                                    r["ratios_vs_baseline"].items()))
        print("targets:", json.dumps(c["targets"]))
        for k, why in c["skipped"].items():
            print(f"  skipped {k}: {why}")
    if "blobs" in result:
        print("\n4 KiB blobs (ops/s):", json.dumps({k: v for k, v in result["blobs"].items() if k.endswith("ops")}))
    if "prefix" in result:
        print("\nmatch_prefix:", json.dumps(result["prefix"]["stores"]))
    if "tiers" in result:
        print("\ntiers:", json.dumps({k: v for k, v in result["tiers"].items() if k != "trace"}),
              json.dumps(result["tiers"]["trace"]["runs"]))
    if "codecs" in result:
        print("\ncodecs:", json.dumps(result["codecs"]["kv"]), json.dumps(result["codecs"]["vectors"]))


def pyplot() -> Any:
    """matplotlib.pyplot with a file backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot(result: dict[str, Any], path: str) -> None:
    """Bar chart of time ratios to the file-per-object baseline (skipped without matplotlib)."""
    plt = pyplot()
    if plt is None:
        return
    systems = result["chunk"]["systems"]
    metrics = ["put_ms", "get_cold_ms", "get_warm_ms", "layer_cold_p50_ms", "layer_warm_p50_ms"]
    labels = ["put (durable but 'none')", "get (cold)", "get (warm)", "1 layer (cold)", "1 layer (warm)"]
    names = [k for k in systems if k != "baseline"]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(names)
    for j, k in enumerate(names):
        r = systems[k]["ratios_vs_baseline"]
        ax.bar([i + j * width for i in range(len(metrics))], [r.get(m, 0) for m in metrics], width,
               label=systems[k]["name"])
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(metrics))], labels)
    ax.set_ylabel("time / file-per-object baseline (lower is better)")
    ax.set_yscale("log")
    ax.set_title("32 MiB Llama-3-8B KV chunk")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
