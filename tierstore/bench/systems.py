"""The contenders of the chunk and blob sections: tierstore and its raw-file baselines and peers, each
behind one small interface (put, get, layer, files, before_cold, close).  No timing here.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from .. import open as open_store
from ..objects import KVCache
from .common import fsync_path


class System:
    """One contender: put(i), get(i), layer(i, l); files(i) for cold reads."""

    name = ""
    durable = True

    def put(self, i: int) -> None: ...
    def get(self, i: int) -> Any: ...
    def layer(self, i: int, l: int) -> Any: ...
    def files(self, i: int) -> list[str]: return []
    def before_cold(self) -> None: ...  # noqa: E704  (e.g. drop mappings that keep pages resident)
    def close(self) -> None: ...


class FilePerObject(System):
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


class Tierstore(System):
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
        self.store.drop_cached()

    def close(self) -> None:
        self.store.close()


class FileEach(System):
    """A peer that keeps one file per object in ``root``, named ``<i><suffix>``."""

    suffix = ""

    def __init__(self, root: str, data: np.ndarray) -> None:
        self.root, self.data = root, data
        os.makedirs(root)

    def _p(self, i: int) -> str:
        return os.path.join(self.root, f"{i}{self.suffix}")

    def files(self, i: int) -> list[str]:
        return [self._p(i)]


class Safetensors(FileEach):
    name, suffix = "safetensors", ".safetensors"

    def __init__(self, root: str, data: np.ndarray) -> None:
        from safetensors.numpy import save_file  # noqa: F401  (skipped when not installed)

        super().__init__(root, data)

    def put(self, i: int) -> None:
        from safetensors.numpy import save_file

        save_file({f"layer.{l}": self.data[l] for l in range(self.data.shape[0])}, self._p(i))
        fsync_path(self._p(i))

    def get(self, i: int) -> Any:
        from safetensors.numpy import load_file

        return load_file(self._p(i))

    def layer(self, i: int, l: int) -> Any:
        from safetensors import safe_open

        with safe_open(self._p(i), framework="numpy") as f:
            return f.get_tensor(f"layer.{l}")


class TorchSave(FileEach):
    name, suffix = "torch.save/load", ".pt"

    def __init__(self, root: str, data: np.ndarray) -> None:
        import torch

        super().__init__(root, data)
        self.t = torch.from_numpy(data)

    def put(self, i: int) -> None:
        import torch

        torch.save(self.t, self._p(i))
        fsync_path(self._p(i))

    def get(self, i: int) -> Any:
        import torch

        return torch.load(self._p(i), weights_only=True)

    def layer(self, i: int, l: int) -> Any:
        return self.get(i)[l]  # the format has no partial read


class H5py(FileEach):
    name, suffix = "h5py", ".h5"

    def __init__(self, root: str, data: np.ndarray) -> None:
        import h5py  # noqa: F401

        super().__init__(root, data)

    def put(self, i: int) -> None:
        import h5py

        with h5py.File(self._p(i), "w") as f:
            f.create_dataset("kv", data=self.data, chunks=(1, *self.data.shape[1:]))
        fsync_path(self._p(i))

    def get(self, i: int) -> Any:
        import h5py

        with h5py.File(self._p(i), "r") as f:
            return f["kv"][:]

    def layer(self, i: int, l: int) -> Any:
        import h5py

        with h5py.File(self._p(i), "r") as f:
            return f["kv"][l]


class ODirect(FileEach):
    """One file per object written and read with O_DIRECT, LMCache's local-disk style (plus
    an fdatasync so the put is durable)."""

    name, suffix = "O_DIRECT file per object (LMCache-style)", ".bin"

    def __init__(self, root: str, data: np.ndarray) -> None:
        if not hasattr(os, "O_DIRECT"):
            raise ImportError("O_DIRECT", name="O_DIRECT")
        super().__init__(root, data)
        from ..format.block import aligned_empty

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
        from ..format.block import aligned_empty

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


class Lmdb(System):
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
