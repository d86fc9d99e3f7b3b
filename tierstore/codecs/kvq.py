"""kvq-ans (SPEC.md §6.5, §6.6): KIVI-axis quantisation with per-layer bins, then interleaved rANS with
per-extent frequency tables.  Pure functions: values -> bytes, bytes -> parts; no I/O.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import CorruptionError
from . import rans
from .base import Extent
from .quant import kv_split, log_int8, log_scale, minmax_codes


def kvq_bins(params: dict[str, Any], layer: int) -> int:
    """The number of bins of ``layer`` (SPEC.md §6.6): the first for shallow layers."""
    bins, shallow = params.get("bins"), params.get("shallow")
    if (not isinstance(bins, list) or len(bins) != 2 or not all(type(b) is int and 4 <= b <= 256 and b % 2 == 0
                                                                for b in bins)):
        raise CorruptionError(f"codec parameter 'bins' must be two even ints in 4..256, got {bins!r}")
    if type(shallow) is not int or not 0 <= shallow <= 1 << 16:
        raise CorruptionError(f"codec parameter 'shallow' must be an int in 0..65536, got {shallow!r}")
    return bins[0] if layer < shallow else bins[1]


def encode(x: np.ndarray, ext: Extent, params: dict[str, Any]) -> bytes:
    """kvq-ans: K per channel (asymmetric, B levels), V per token (symmetric, B - 1 levels,
    one-byte log scales), each half entropy-coded with its own frequency table (rANS)."""
    b = kvq_bins(params, ext.index)
    k, v = kv_split(x)
    _, h, t, d = ext.shape
    lo, st, ck = minmax_codes(k, 8, t, axis=1, levels=b - 1)  # K: one group = all tokens of a channel
    m = b // 2 - 1
    cv, qv = log_int8(v, axis=2, m=m)
    sk = ck.reshape(-1).astype(np.int64)
    sv = qv.reshape(-1).astype(np.int64) + m
    fk = rans.normalize(np.bincount(sk, minlength=b))
    fv = rans.normalize(np.bincount(sv, minlength=b))
    return b"".join([np.stack([lo[..., 0], st[..., 0]], -1).astype("<f2").tobytes(), cv.tobytes(),
                     fk.astype("<u2").tobytes(), fv.astype("<u2").tobytes(), rans.encode(sk, fk), rans.encode(sv, fv)])


def parts(data: Any, ext: Extent, params: dict[str, Any]) -> list[tuple[Any, ...]]:
    """A stored extent -> the K and V parts, every table and stream length checked first."""
    if len(ext.shape) != 4 or ext.shape[0] != 2:
        raise CorruptionError("kvq-ans on an extent that is not one KV layer")
    b = kvq_bins(params, ext.index)
    _, h, t, d = ext.shape
    fixed = 4 * h * d + h * t + 4 * b
    mv = memoryview(data)
    if len(mv) < fixed:
        raise CorruptionError(f"kvq-ans extent of {len(mv)} bytes, shorter than its tables ({fixed})")
    pk = np.frombuffer(mv, "<f2", 2 * h * d).astype(np.float32).reshape(h, d, 1, 2)
    cv = np.frombuffer(mv, np.uint8, h * t, 4 * h * d).reshape(h, t, 1)
    fk = np.frombuffer(mv, "<u2", b, 4 * h * d + h * t).astype(np.int64)
    fv = np.frombuffer(mv, "<u2", b, 4 * h * d + h * t + 2 * b).astype(np.int64)
    if fv[b - 1] != 0:
        raise CorruptionError("kvq-ans V table gives a frequency to a symbol outside [-m, m]")
    n = h * t * d
    ck, used_k = rans.decode(mv[fixed:], fk, n)
    qv, used_v = rans.decode(mv[fixed + used_k :], fv, n)
    if fixed + used_k + used_v != len(mv):
        raise CorruptionError("kvq-ans extent has bytes after its streams")
    m = b // 2 - 1
    return [("minmax", pk[..., 0], pk[..., 1], ck.reshape(h, t, d).astype(np.uint8), t, 1),
            ("scaled", (qv.reshape(h, t, d) - m).astype(np.float32), log_scale(cv, m))]


def max_length(ext: Extent, params: dict[str, Any]) -> int:
    """An upper bound of a stored kvq-ans extent (tables plus two rANS streams at their worst)."""
    _, h, t, d = ext.shape
    n = h * t * d
    stream = 4 * rans.lanes_for(n) + 4 + 2 * (n + rans.lanes_for(n))
    return 4 * h * d + h * t + 4 * kvq_bins(params, ext.index) + 2 * stream
