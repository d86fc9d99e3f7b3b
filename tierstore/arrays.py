"""Arrays in and out: dtype ids, zero-copy byte views of numpy arrays / torch tensors, and
wrapping bytes read from disk back into arrays of the caller's framework.

This module owns the mapping between the format's dtype ids (SPEC.md §5.2) and numpy/torch
dtypes.  It never copies an array that is already C-contiguous on the CPU, and it never
imports torch unless torch is installed (torch is an optional extra).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import numpy as np

from .errors import InvalidObject
from .format import constants as fmt

FRAMEWORK_NUMPY = "numpy"
FRAMEWORK_TORCH = "torch"

_OPTIONAL: dict[str, Any] = {}


def optional_module(name: str) -> Any:
    """An optional dependency's module, or None when it is not installed (imported lazily)."""
    if name not in _OPTIONAL:
        _OPTIONAL[name] = importlib.import_module(name) if importlib.util.find_spec(name) else None
    return _OPTIONAL[name]


def torch_module() -> Any:
    """The torch module, or None when torch is not installed."""
    return optional_module("torch")


def _ml_dtypes_module() -> Any:
    return optional_module("ml_dtypes")


def is_torch_tensor(x: Any) -> bool:
    cls = type(x)
    if cls is np.ndarray:  # (the common case, answered without importing anything)
        return False
    torch = torch_module() if cls.__module__.startswith("torch") else None
    return torch is not None and isinstance(x, torch.Tensor)


_TORCH_NAMES = {
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float32": "float32",
    "float64": "float64",
    "float8_e4m3fn": "float8_e4m3fn",
    "float8_e5m2": "float8_e5m2",
    "int8": "int8",
    "uint8": "uint8",
    "int16": "int16",
    "int32": "int32",
    "int64": "int64",
}
NUMPY_NATIVE = {"float16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64"}


def torch_dtype(name: str) -> Any:
    """The torch dtype of a format dtype name (torch must be installed)."""
    return getattr(torch_module(), _TORCH_NAMES[name])


def dtype_name(x: Any) -> str:
    """The format dtype name of a numpy array or torch tensor; InvalidObject if unsupported."""
    if is_torch_tensor(x):
        name = str(x.dtype).removeprefix("torch.")
    elif isinstance(x, np.ndarray):
        name = x.dtype.name
        if x.dtype.byteorder == ">":
            raise InvalidObject(f"big-endian arrays are not supported (dtype {x.dtype}); use .astype('<...')")
    else:
        raise InvalidObject(f"expected a numpy array or torch tensor, got {type(x).__name__}")
    if name not in fmt.DTYPE_IDS:
        raise InvalidObject(f"unsupported dtype {name}; supported: {', '.join(sorted(fmt.DTYPE_IDS))}")
    return name


def framework_of(x: Any) -> str:
    return FRAMEWORK_TORCH if is_torch_tensor(x) else FRAMEWORK_NUMPY


def as_bytes_view(x: Any) -> np.ndarray:
    """A C-contiguous CPU numpy view of the array's bytes, shaped like the array.

    Zero-copy for C-contiguous CPU arrays; a non-contiguous array is made contiguous (one
    copy) and a GPU tensor is copied to the host once.  The returned array's dtype is the
    storage dtype of SPEC.md §5.2 (bfloat16 and fp8 are viewed as unsigned integers).
    """
    name = dtype_name(x)
    storage = np.dtype(fmt.DTYPES[fmt.DTYPE_IDS[name]][2])
    if is_torch_tensor(x):
        torch = torch_module()
        t = x.detach()
        if t.device.type != "cpu":
            t = t.to("cpu")
        if not t.is_contiguous():
            t = t.contiguous()
        if name in NUMPY_NATIVE:
            return t.numpy()
        view_as = torch.int16 if storage.itemsize == 2 else torch.uint8
        return t.view(view_as).numpy().view(storage)
    arr = np.ascontiguousarray(x)
    return arr.view(storage) if arr.dtype != storage else arr


def wrap(buf: np.ndarray, name: str, shape: tuple[int, ...], framework: str, device: str | None) -> Any:
    """Wrap a uint8 numpy buffer holding C-order data as an array of ``framework``.

    ``device`` (e.g. "cpu", "cuda:0") forces a torch tensor on that device.  Without torch,
    data stored from torch comes back as numpy when numpy can represent the dtype.
    """
    storage = np.dtype(fmt.DTYPES[fmt.DTYPE_IDS[name]][2])
    flat = buf.view(storage)
    torch = torch_module() if device is not None or framework == FRAMEWORK_TORCH else None
    if device is not None or (framework == FRAMEWORK_TORCH and torch is not None):
        if torch is None:
            raise InvalidObject(
                f"device={device!r} needs torch", hint="pip install 'tierstore[torch]'"
            )
        t = torch.from_numpy(flat)
        if name not in NUMPY_NATIVE:
            t = t.view(getattr(torch, _TORCH_NAMES[name]))
        t = t.reshape(shape)
        if device is not None and device != "cpu":
            try:
                dev = torch.device(device)
            except RuntimeError:
                raise InvalidObject(f"bad device {device!r}: tierstore reads into \"cpu\" or "
                                    "\"cuda:N\" memory") from None
            if dev.type != "cpu":
                t = t.to(dev, non_blocking=False)
        return t
    if name in NUMPY_NATIVE:
        return flat.reshape(shape)
    ml = _ml_dtypes_module()
    if ml is None:
        raise InvalidObject(
            f"{name} data needs torch or ml_dtypes to be returned as an array",
            hint="pip install 'tierstore[torch]' (or ml_dtypes)",
        )
    return flat.view(getattr(ml, name)).reshape(shape)


def check_out(out: Any, name: str, shape: tuple[int, ...]) -> None:
    """Check a caller's destination (``get(out=...)``) before any I/O: a C-contiguous, writable
    numpy array or torch tensor (CPU, pinned or CUDA) of dtype ``name`` and shape ``shape``."""
    if is_torch_tensor(out):
        if out.layout != torch_module().strided or out.device.type not in ("cpu", "cuda"):
            raise InvalidObject(f"out= is a {out.layout} tensor on {out.device}: tierstore fills dense tensors in "
                                "CPU, pinned or CUDA memory")
        ok_layout, writable, shape_of = out.is_contiguous(), not out.requires_grad, tuple(out.shape)
    elif isinstance(out, np.ndarray):
        ok_layout, writable, shape_of = out.flags.c_contiguous, out.flags.writeable, out.shape
    else:
        raise InvalidObject(f"out= takes a numpy array or a torch tensor, got {type(out).__name__}",
                            hint="for a KVCache, also a list of per-layer destinations: [(k0, v0), (k1, v1), ...]")
    got = dtype_name(out)
    if got != name:
        raise InvalidObject(f"out= has dtype {got}; the object holds {name}", hint="allocate out with the stored dtype "
                            "(info(key).dtype)")
    if shape_of != shape:
        raise InvalidObject(f"out= has shape {shape_of}; this read returns {shape}",
                            hint="info(key).shape is the stored shape; layers=/rows= select part of it")
    if not ok_layout:
        raise InvalidObject("out= must be C-contiguous (a strided view cannot be filled in place)",
                            hint="for a KVCache, per-layer pieces take any strides: out=[(k, v), ...], one "
                                 "pair of [kv_heads, tokens, head_dim] views per layer")
    if not writable:
        raise InvalidObject("out= is not writable (a read-only array, or a tensor that requires grad)")


def host_bytes(out: Any) -> np.ndarray | None:
    """A flat uint8 numpy view of ``out``'s memory when it lives in host memory (numpy, a CPU or
    pinned tensor), else None (a GPU tensor).  ``out`` was checked by ``check_out``."""
    if is_torch_tensor(out):
        if out.device.type != "cpu":
            return None
        return out.detach().reshape(-1).view(torch_module().uint8).numpy()
    return out.reshape(-1).view(np.uint8)


def itemsize(x: Any) -> int:
    """Bytes per element of a numpy array or torch tensor."""
    return int(x.element_size()) if is_torch_tensor(x) else int(x.itemsize)


def host_view(x: Any) -> np.ndarray | None:
    """A numpy view sharing ``x``'s memory, any strides, in the storage dtype of SPEC.md §5.2
    (bfloat16 and fp8 as unsigned integers): ``x`` itself for numpy, a view of a CPU or pinned
    tensor; None for a tensor on a GPU."""
    if not is_torch_tensor(x):
        return x
    if x.device.type != "cpu":
        return None
    t = x.detach()
    name = dtype_name(t)
    if name not in NUMPY_NATIVE:
        torch = torch_module()
        t = t.view(torch.int16 if t.element_size() == 2 else torch.uint8)
    return t.numpy()


def copy_into(out: Any, data: Any) -> None:
    """Copy ``data`` (an array of the same shape and dtype) into ``out``."""
    if is_torch_tensor(out):
        src = data if is_torch_tensor(data) else torch_module().from_numpy(np.ascontiguousarray(data))
        if src.dtype != out.dtype:
            src = src.view(out.dtype)
        out.copy_(src.reshape(out.shape))
    else:
        np.copyto(out.reshape(-1).view(np.uint8), as_bytes_view(data).reshape(-1).view(np.uint8))


def validate_device(device: str | None) -> None:
    """Reject a device string that is not "cpu" or a torch device name, before any I/O."""
    if device is None:
        return
    if not isinstance(device, str):
        raise InvalidObject(f"device must be a string like 'cpu' or 'cuda:0', got {type(device).__name__}")
    torch = torch_module()
    if torch is None:
        raise InvalidObject(f"device={device!r} needs torch", hint="pip install 'tierstore[torch]'")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise InvalidObject(f"bad device {device!r}: tierstore reads into \"cpu\" or \"cuda:N\" memory") from None
    if dev.type not in ("cpu", "cuda"):
        raise InvalidObject(f"device {device!r}: tierstore reads into \"cpu\" or \"cuda:N\" memory, not {dev.type}",
                            hint='read with device="cpu", then move the tensor with .to(...)')
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidObject(f"device {device!r} requested but CUDA is not available")
