"""Vector codecs (SPEC.md §6.4): fp16, int8 (per-vector minimum and step) and binary (signs and one
magnitude per vector) on a row range ``[rows, dim]``.  Pure functions: values -> bytes, bytes -> parts;
no I/O, no codec registry (registry.py dispatches here), nothing about records.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..format import constants as fmt
from .base import Extent

IDS = frozenset({fmt.CODEC_VEC_FP16, fmt.CODEC_VEC_INT8, fmt.CODEC_VEC_BINARY})


def encode(cid: int, x: np.ndarray) -> bytes:
    """float32 values ``[rows, dim]`` -> the codec's body (before any zstd stage)."""
    if cid == fmt.CODEC_VEC_FP16:
        return x.astype("<f2").tobytes()
    if cid == fmt.CODEC_VEC_INT8:  # per vector: float32 minimum and step, uint8 codes
        lo = x.min(axis=1, keepdims=True)
        step = (x.max(axis=1, keepdims=True) - lo) / np.float32(255)
        q = np.clip(np.rint(np.divide(x - lo, step, out=np.zeros_like(x), where=step > 0)), 0, 255).astype(np.uint8)
        return np.concatenate([lo, step], axis=1).astype("<f4").tobytes() + q.tobytes()
    assert cid == fmt.CODEC_VEC_BINARY
    s = np.abs(x).mean(axis=1, dtype=np.float64).astype("<f4")
    return s.tobytes() + np.packbits(~np.signbit(x), axis=1, bitorder="little").tobytes()


def body_length(cid: int, ext: Extent) -> int:
    """The exact length of the body of ``ext``."""
    rows, dim = ext.shape
    if cid == fmt.CODEC_VEC_FP16:
        return 2 * rows * dim
    if cid == fmt.CODEC_VEC_INT8:
        return 8 * rows + rows * dim
    return 4 * rows + rows * -(-dim // 8)


def parts(cid: int, b: np.ndarray, ext: Extent) -> list[tuple[Any, ...]]:
    """A body of the checked length -> its part (quant.py's assemble_* make values)."""
    if cid == fmt.CODEC_VEC_FP16:
        return [("plain", b.view("<f2").astype(np.float32).reshape(ext.shape))]
    rows, dim = ext.shape
    if cid == fmt.CODEC_VEC_INT8:
        p_ = b[: 8 * rows].view("<f4").reshape(rows, 2)
        return [("minmax", p_[:, :1], p_[:, 1:], b[8 * rows :].reshape(rows, dim), dim, 1)]
    m = b[: 4 * rows].view("<f4").reshape(rows, 1)
    bits_ = np.unpackbits(b[4 * rows :].reshape(rows, -1), axis=1, count=dim, bitorder="little")
    return [("sign", m, bits_)]
