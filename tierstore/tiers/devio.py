"""Tier memory and device copies: the only module that knows CUDA streams, pinned host
memory and kvikio (GPUDirect Storage).

It owns: probing once, at open, which path fills the GPU tier (``io_path``: "gds",
"kvikio-compat", "posix", or "cpu" when the "GPU" tier is CPU memory, as in tests);
allocating tier buffers (host: page-aligned numpy arrays, pinned when a CUDA device is in
use; device: torch uint8 tensors); copying host bytes to the device on a dedicated stream;
and reading file ranges straight into device memory with kvikio.

It never decides what is cached, and never returns before a copy it started has finished:
callers always get complete buffers, and a pinned staging buffer is reused only after the
copy out of it is done.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any

import numpy as np

from .. import arrays
from ..errors import CorruptionError, InvalidObject
from ..format.record import crc32c

IO_PATHS = ("gds", "kvikio-compat", "posix", "cpu")


def _kvikio() -> Any:
    """The kvikio module, or None when it is not installed or cannot load."""
    try:
        return arrays.optional_module("kvikio")
    except (ImportError, OSError):  # an old kvikio that dlopens CUDA at import
        return None


def probe_io_path(device: Any) -> str:
    """How the GPU tier is filled from segment files: "gds" (kvikio with the nvidia-fs driver:
    DMA from the SSD into GPU memory), "kvikio-compat" (kvikio without it: kvikio's own POSIX
    bounce buffers), "posix" (pread into pinned host memory, then a copy on a side stream),
    "cpu" (the tier is CPU memory)."""
    if device is None or device.type != "cuda":
        return "cpu"
    kvikio = _kvikio()
    if kvikio is None:
        return "posix"
    try:
        driver = getattr(kvikio, "cufile_driver", None)
        if driver is None:
            try:
                driver = importlib.import_module("kvikio.cufile_driver")  # kvikio >= 24.12: a submodule
            except ImportError:
                driver = None
        props = driver.properties if driver is not None else kvikio.DriverProperties()  # older kvikio
        gds = bool(props.is_gds_available)
    except (RuntimeError, OSError, AttributeError):  # no libcuda / libcufile: kvikio cannot do I/O
        return "posix"
    return "gds" if gds else "kvikio-compat"


class DeviceIO:
    """Buffers and copies for the tiers of one store (a DRAM tier, a GPU tier on ``device``)."""

    def __init__(self, device: str | None) -> None:
        torch = arrays.torch_module() if device is not None else None
        self.device = torch.device(device) if torch is not None else None
        self.cuda = self.device is not None and self.device.type == "cuda"
        self.io_path = probe_io_path(self.device)
        self._torch = torch
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._stream_lock = threading.Lock()

    # -- buffers ------------------------------------------------------------------------------

    def host_buffer(self, nbytes: int) -> np.ndarray:
        """A uint8 host buffer for the DRAM tier: pinned (page-locked) when a CUDA GPU tier is in
        use, so promotion to the GPU is one asynchronous DMA; page-aligned otherwise."""
        if self.cuda:
            return self._torch.empty(nbytes, dtype=self._torch.uint8, pin_memory=True).numpy()
        from ..format.block import aligned_empty
        return aligned_empty(nbytes)

    def device_buffer(self, nbytes: int) -> Any:
        """An uninitialised uint8 tensor of ``nbytes`` on the GPU tier's device."""
        return self._torch.empty(nbytes, dtype=self._torch.uint8, device=self.device)

    # -- copies -------------------------------------------------------------------------------

    def to_device(self, hosts: list[Any]) -> list[Any]:
        """New device tensors holding each host buffer's bytes (numpy arrays, bytes): the copies
        are queued on the tier's stream and waited for once, before this returns."""
        torch = self._torch
        srcs = [torch.from_numpy(np.ascontiguousarray(h).reshape(-1).view(np.uint8)) if isinstance(h, np.ndarray)
                else torch.frombuffer(bytearray(h), dtype=torch.uint8) for h in hosts]
        outs = [self.device_buffer(src.numel()) for src in srcs]
        if not self.cuda:
            for out, src in zip(outs, srcs):
                out.copy_(src)  # a CPU "device": a copy, never an alias of the caller's buffer
            return outs
        with self._stream_lock, torch.cuda.stream(self._stream):
            for out, src in zip(outs, srcs):
                out.copy_(src, non_blocking=src.is_pinned())
            self._stream.synchronize()
        return outs

    def tensor_to_device(self, t: Any) -> Any:
        """Copy a tensor (any dtype, any device) into a fresh uint8 tier buffer on the device."""
        flat = t.contiguous().reshape(-1).view(self._torch.uint8)
        out = self.device_buffer(flat.numel())
        if self.cuda:
            with self._stream_lock, self._torch.cuda.stream(self._stream):
                out.copy_(flat, non_blocking=True)
                self._stream.synchronize()
        else:
            out.copy_(flat)
        return out

    def to_host(self, dev: Any, dest: np.ndarray) -> None:
        """Copy a device buffer into host ``dest`` (same size)."""
        self._torch.from_numpy(dest).copy_(dev.reshape(-1))

    # -- kvikio ----------------------------------------------------------------------------

    def read_direct(self, path: str, ranges: list[tuple[int, int, int]], where: dict[str, Any]) -> list[Any]:
        """Read each (file_offset, nbytes, crc32c) range of ``path`` straight into a new device
        buffer (kvikio: GDS DMA, or kvikio's compat mode), then verify its CRC-32C.

        The checksum is computed on a host copy of the bytes read (there is no device CRC-32C
        here): the SSD->GPU transfer skips the CPU, the verification does not.  A mismatch
        raises CorruptionError, as every other read path does.  The file is opened for this
        call only (FileNotFoundError if compaction removed it: the caller looks again).
        """
        kvikio = _kvikio()
        if kvikio is None:
            raise InvalidObject("kvikio is not installed", hint="pip install kvikio-cu12")
        out = []
        with kvikio.CuFile(path, "r") as f:
            futures = []
            for file_offset, nbytes, _ in ranges:
                buf = self.device_buffer(nbytes)
                futures.append((buf, f.pread(buf, nbytes, file_offset)))
            for (buf, fut), (file_offset, nbytes, crc) in zip(futures, ranges):
                got = fut.get()
                if got != nbytes:
                    raise CorruptionError(f"short read: {got} of {nbytes} bytes", **{**where, "offset": file_offset})
                if crc32c(memoryview(buf.cpu().numpy())) != crc:
                    raise CorruptionError("extent checksum mismatch (read by kvikio)",
                                          **{**where, "offset": file_offset})
                out.append(buf)
        return out
