"""What every codec shares: the ``Extent`` a codec codes, the ``Codec`` record, and the float conversions
of SPEC.md §6.1.  Pure functions over numpy arrays: no I/O, nothing about records or files.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import InvalidObject
from ..format import constants as fmt

FP16_MAX = 65504.0
LOSSY_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})


@dataclass(frozen=True)
class Extent:
    """What a codec knows about the extent it codes: its kind ("kv", "vectors", "ids", "blob"),
    the logical shape of the extent, and the stored dtype name (None for bytes)."""

    kind: str
    shape: tuple[int, ...]
    dtype: str | None
    index: int = 0  # KV: the model layer of this extent (layer_start + position)

    @property
    def nbytes(self) -> int:
        n = math.prod(self.shape)
        return n * (fmt.DTYPES[fmt.DTYPE_IDS[self.dtype]][1] if self.dtype else 1)


@dataclass(frozen=True)
class Codec:
    """A registered codec.  ``id`` is written to disk and permanent."""

    id: int
    name: str
    lossless: bool
    kinds: tuple[str, ...]
    bound: str  # the declared error bound, per element
    expected_ratio: str  # versus the raw bytes, on the project's real sample (docs/benchmarks.md)
    defaults: dict[str, Any] = field(default_factory=dict)

    def bound_for(self, params: dict[str, Any]) -> str:
        """The declared bound with this object's parameters filled in (group size, bins)."""
        text = self.bound
        if "group" in params:
            text = text.replace("per group of 32", f"per group of {params['group']}")
        if "bins" in params:
            bins, shallow = params["bins"], params.get("shallow", 0)
            text += f" (B = {bins[0]} for layers below {shallow}, {bins[1]} from there)"
        return text

    def describe(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "lossless": self.lossless, "kinds": list(self.kinds),
                "bound": self.bound, "expected_ratio": self.expected_ratio, "defaults": dict(self.defaults)}


# --- float conversions (SPEC.md §6.1) -------------------------------------------------------------

def to_float32(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Stored bytes (a little-endian view of ``dtype``) -> float32 values."""
    if dtype == "float16":
        return raw.view("<f2").astype(np.float32)
    if dtype == "bfloat16":
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    if dtype == "float32":
        return raw.view("<f4").astype(np.float32, copy=False)
    if dtype == "float64":
        return raw.view("<f8").astype(np.float32)
    raise InvalidObject(f"lossy codecs take float16, bfloat16, float32 or float64 data, not {dtype}")


def from_float32(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values -> the bytes of ``dtype`` (round to nearest even), as uint8."""
    if dtype == "float16":
        out = x.astype("<f2")
    elif dtype == "bfloat16":
        u = x.astype(np.float32).view(np.uint32)
        out = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype("<u2")
    elif dtype == "float32":
        out = x.astype("<f4")
    elif dtype == "float64":
        out = x.astype("<f8")
    else:
        raise InvalidObject(f"cannot decode to {dtype}")
    return np.ascontiguousarray(out).reshape(-1).view(np.uint8)


def finite_f32(raw: np.ndarray, ext: Extent, codec: str) -> np.ndarray:
    """An extent's stored bytes as float32 values shaped like it; InvalidObject unless every value
    is finite and within float16's range (what every lossy encoder takes)."""
    assert ext.dtype is not None
    x = to_float32(raw, ext.dtype).reshape(ext.shape)
    if x.size and not (np.isfinite(x).all() and np.abs(x).max() <= FP16_MAX):
        raise InvalidObject(f"codec {codec!r} needs finite values within +-65504; this data has others",
                            hint="use a lossless codec (raw, zstd, shuffle+zstd) for it")
    return x


def itemsize(ext: Extent) -> int:
    """Bytes per element of the extent's stored dtype (1 for bytes)."""
    return fmt.DTYPES[fmt.DTYPE_IDS[ext.dtype]][1] if ext.dtype else 1
