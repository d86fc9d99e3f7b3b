"""kvq-ans (SPEC.md §6.5, §6.6): KIVI-axis quantisation with per-layer bins, then interleaved rANS with
per-extent frequency tables.  Pure functions: values -> bytes, bytes -> parts; no I/O.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import CorruptionError
from . import rans
from .base import Extent
from .quant import code_limit, kv_split, log_int8, log_scale, log_scales, minmax_codes, minmax_scales


def kvq_bins(params: dict[str, Any], layer: int) -> int:
    """The number of bins of ``layer`` (SPEC.md §6.6): the first for shallow layers."""
    bins, shallow = params.get("bins"), params.get("shallow")
    if (not isinstance(bins, list) or len(bins) != 2 or not all(type(b) is int and 4 <= b <= 256 and b % 2 == 0
                                                                for b in bins)):
        raise CorruptionError(f"codec parameter 'bins' must be two even ints in 4..256, got {bins!r}")
    if type(shallow) is not int or not 0 <= shallow <= 1 << 16:
        raise CorruptionError(f"codec parameter 'shallow' must be an int in 0..65536, got {shallow!r}")
    return bins[0] if layer < shallow else bins[1]


def encode(x: np.ndarray, ext: Extent, params: dict[str, Any], *, compiled: bool | None = None) -> bytes:
    """kvq-ans: K per channel (asymmetric, B levels), V per token (symmetric, B - 1 levels,
    one-byte log scales), each half entropy-coded with its own frequency table (rANS).
    ``compiled``: the symbols from the numba loops below (True) or numpy (False); by default
    as ``rans.COMPILED``.  Both give the same bytes."""
    b = kvq_bins(params, ext.index)
    k, v = kv_split(x)
    _, h, t, d = ext.shape
    m = b // 2 - 1  # (b <= 256: m <= 127, V's codes are int8)
    compiled = (rans.COMPILED if compiled is None else compiled) and rans.AVAILABLE and not _TRACED
    kernels = _KERNELS.get() if compiled else None
    if kernels is not None:
        lo, st = minmax_scales(k, t, axis=1, levels=b - 1)  # K: one group = all tokens of a channel
        cv, sv_scale, a = log_scales(v, axis=2, m=m)
        sk, sv = np.empty(h * t * d, np.uint8), np.empty(h * t * d, np.uint8)
        ck_counts, cv_counts = np.zeros(b, np.int64), np.zeros(b, np.int64)
        kernels[0](k, lo[..., 0].astype(np.float32), st[..., 0].astype(np.float32),
                    b - 1, sk, ck_counts)
        kernels[1](v, sv_scale[..., 0], a[..., 0], code_limit(sv_scale, m)[..., 0].astype(np.int64), m, sv,
                    cv_counts)
    else:
        lo, st, ck = minmax_codes(k, 8, t, axis=1, levels=b - 1)
        cv, qv = log_int8(v, axis=2, m=m)
        sk = ck.reshape(-1)  # uint8 codes in [0, b - 1]
        sv = qv.reshape(-1).view(np.uint8) + np.uint8(m)  # int8 codes in [-m, m] -> [0, 2m] (mod 256: exact)
        ck_counts, cv_counts = np.bincount(sk, minlength=b), np.bincount(sv, minlength=b)
    fk, fv = rans.normalize(ck_counts), rans.normalize(cv_counts)
    return b"".join([np.stack([lo[..., 0], st[..., 0]], -1).astype("<f2").tobytes(), cv.tobytes(),
                     fk.astype("<u2").tobytes(), fv.astype("<u2").tobytes(), rans.encode(sk, fk), rans.encode(sv, fv)])


def _k_symbols(k: np.ndarray, lo: np.ndarray, step: np.ndarray, levels: int, out: np.ndarray,
               counts: np.ndarray) -> None:
    """K's symbols (compiled by numba): ``minmax_codes`` with one group per channel, in one
    pass -- rint((x - lo) / step) in float32, clipped to [0, levels], 0 where the step is 0 --
    written in C order with their counts."""
    heads, tokens, dims = k.shape
    for hh in range(heads):
        for tt in range(tokens):
            base = (hh * tokens + tt) * dims
            for dd in range(dims):
                st = step[hh, dd]
                q = 0
                if st > 0:
                    r = np.rint((k[hh, tt, dd] - lo[hh, dd]) / st)
                    q = 0 if r < 0 else levels if r > levels else int(r)
                out[base + dd] = q
                counts[q] += 1


def _v_symbols(v: np.ndarray, scale: np.ndarray, absmax: np.ndarray, limit: np.ndarray, m: int, out: np.ndarray,
               counts: np.ndarray) -> None:
    """V's symbols (compiled by numba): ``log_int8``'s codes in one pass -- rint(x / s) in
    float32, clipped to +-limit (``code_limit``: m, but near float16's largest value), 0 where
    the token's absmax is 0 -- plus m, with their counts."""
    heads, tokens, dims = v.shape
    for hh in range(heads):
        for tt in range(tokens):
            base = (hh * tokens + tt) * dims
            sc = scale[hh, tt]
            top = limit[hh, tt]
            live = absmax[hh, tt] > 0
            for dd in range(dims):
                q = 0
                if live:
                    r = np.rint(v[hh, tt, dd] / sc)
                    q = -top if r < -top else top if r > top else int(r)
                out[base + dd] = q + m
                counts[q + m] += 1


_KERNELS = rans.Lazy(_k_symbols, _v_symbols)  # (compiled at the first use, as rANS's loops)
_TRACED = "_trace_branch" in _k_symbols.__code__.co_names  # (a fuzzer's instrumentation: numba cannot compile it)


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
