"""KV-layer quantisers (SPEC.md §6.3, §6.4): int8 (K per channel, V per token with one-byte log scales),
int4 / int2 (KIVI groups) and fp8 (e4m3, per-channel / per-token scales), on one layer ``[2, H, T, D]``.

Pure functions: values -> body bytes, body bytes -> parts (quant.py assembles them).  No I/O; the
optional zstd stage and the registry's checks are registry.py's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import CorruptionError
from ..format import constants as fmt
from .base import Extent
from .quant import (
    E4M3,
    absmax_int8,
    e4m3_within,
    f16_up,
    group_param,
    groups,
    kv_split,
    log_int8,
    log_scale,
    minmax_codes,
    pack,
    to_e4m3,
    unpack,
)

IDS = frozenset({fmt.CODEC_KV_INT8, fmt.CODEC_KV_INT4, fmt.CODEC_KV_INT2, fmt.CODEC_KV_FP8})


def encode(cid: int, x: np.ndarray, params: dict[str, Any]) -> bytes:
    """One KV layer's float32 values ``[2, H, T, D]`` -> the codec's body (before any zstd stage).
    An MLA layer ``[T, C]`` (int8 and fp8 only) is coded as the V half of a KV layer with one
    head: per token scales, then the codes (SPEC.md §6.3)."""
    if x.ndim == 2:
        v = x[None]
        if cid == fmt.CODEC_KV_INT8:
            cv, qv = log_int8(v, axis=2)
            return cv.tobytes() + qv.tobytes()
        assert cid == fmt.CODEC_KV_FP8
        sv = f16_up(np.abs(v).max(axis=2, keepdims=True) / np.float32(448))
        yv = np.divide(v, sv.astype(np.float32), out=np.zeros_like(v), where=sv > 0)
        return sv.astype("<f2").tobytes() + e4m3_within(to_e4m3(yv), sv).tobytes()
    k, v = kv_split(x)
    if cid == fmt.CODEC_KV_INT8:
        sk, qk = absmax_int8(k, axis=1)  # K: per channel (head, dim), over the tokens
        cv, qv = log_int8(v, axis=2)  # V: per token (head, token), over the dims; one-byte scales
        return b"".join([sk.astype("<f2").tobytes(), cv.tobytes(), qk.tobytes(), qv.tobytes()])
    if cid in (fmt.CODEC_KV_INT4, fmt.CODEC_KV_INT2):
        bits = 4 if cid == fmt.CODEC_KV_INT4 else 2
        g = params.get("group", 32)
        lk, stk, qk = minmax_codes(k, bits, g, axis=1)  # K per channel, groups of g tokens
        lv, stv, qv = minmax_codes(v, bits, g, axis=2)  # V per token, groups of g dims
        return b"".join([np.stack([lk, stk], -1).astype("<f2").tobytes(),
                         np.stack([lv, stv], -1).astype("<f2").tobytes(), pack(qk, bits), pack(qv, bits)])
    assert cid == fmt.CODEC_KV_FP8
    sk = f16_up(np.abs(k).max(axis=1, keepdims=True) / np.float32(448))
    sv = f16_up(np.abs(v).max(axis=2, keepdims=True) / np.float32(448))
    yk = np.divide(k, sk.astype(np.float32), out=np.zeros_like(k), where=sk > 0)
    yv = np.divide(v, sv.astype(np.float32), out=np.zeros_like(v), where=sv > 0)
    return b"".join([sk.astype("<f2").tobytes(), sv.astype("<f2").tobytes(),
                     e4m3_within(to_e4m3(yk), sk).tobytes(), e4m3_within(to_e4m3(yv), sv).tobytes()])


def body_length(cid: int, ext: Extent, params: dict[str, Any]) -> int:
    """The exact length of the body of ``ext`` (one layer)."""
    if ext.kind == "mla":
        t, c = ext.shape
        if cid == fmt.CODEC_KV_INT8:
            return t + t * c
        if cid == fmt.CODEC_KV_FP8:
            return 2 * t + t * c
        raise CorruptionError(f"codec id {cid} does not apply to an MLA layer")
    _, h, t, d = ext.shape
    if cid == fmt.CODEC_KV_INT8:
        return 2 * h * d + h * t + 2 * h * t * d
    if cid == fmt.CODEC_KV_FP8:
        return 2 * (h * d + h * t) + 2 * h * t * d
    bits = 4 if cid == fmt.CODEC_KV_INT4 else 2
    g = group_param(params)
    per = 8 // bits
    return 4 * h * (groups(t, g) * d + t * groups(d, g)) + 2 * (-(-h * t * d // per))


def parts(cid: int, b: np.ndarray, ext: Extent, params: dict[str, Any]) -> list[tuple[Any, ...]]:
    """A body of the checked length -> the K and V parts (quant.py's assemble_* make values);
    for an MLA layer, its one part."""
    if ext.kind == "mla":
        t, c = ext.shape
        if cid == fmt.CODEC_KV_INT8:
            sv = log_scale(b[:t]).reshape(t, 1)
            qv = b[t:].view(np.int8).reshape(t, c).astype(np.float32)
        else:
            sv = b[: 2 * t].view("<f2").astype(np.float32).reshape(t, 1)
            qv = E4M3[b[2 * t:]].reshape(t, c)
            if np.isnan(qv).any():
                raise CorruptionError("fp8 extent holds a NaN code (never written)")
        return [("scaled", qv, sv)]
    _, h, t, d = ext.shape
    if cid in (fmt.CODEC_KV_INT8, fmt.CODEC_KV_FP8):
        sk = b[: 2 * h * d].view("<f2").astype(np.float32).reshape(h, 1, d)
        p = 2 * h * d
        if cid == fmt.CODEC_KV_INT8:
            sv, p = log_scale(b[p : p + h * t]).reshape(h, t, 1), p + h * t
            qk = b[p : p + h * t * d].view(np.int8).reshape(h, t, d).astype(np.float32)
            qv = b[p + h * t * d :].view(np.int8).reshape(h, t, d).astype(np.float32)
        else:
            sv, p = b[p : p + 2 * h * t].view("<f2").astype(np.float32).reshape(h, t, 1), p + 2 * h * t
            qk = E4M3[b[p : p + h * t * d]].reshape(h, t, d)
            qv = E4M3[b[p + h * t * d :]].reshape(h, t, d)
            if np.isnan(qk).any() or np.isnan(qv).any():
                raise CorruptionError("fp8 extent holds a NaN code (never written)")
        return [("scaled", qk, sk), ("scaled", qv, sv)]
    bits = 4 if cid == fmt.CODEC_KV_INT4 else 2
    g = group_param(params)
    nk = 4 * h * groups(t, g) * d
    nv = 4 * h * t * groups(d, g)
    pk = b[:nk].view("<f2").astype(np.float32).reshape(h, d, groups(t, g), 2)  # K: (head, channel, group)
    pv = b[nk : nk + nv].view("<f2").astype(np.float32).reshape(h, t, groups(d, g), 2)
    half = -(-h * t * d // (8 // bits))
    codes = b[nk + nv :]
    ck = unpack(codes[:half], bits, h * t * d).reshape(h, t, d)
    cv = unpack(codes[half:], bits, h * t * d).reshape(h, t, d)
    return [("minmax", pk[..., 0], pk[..., 1], ck, g, 1), ("minmax", pv[..., 0], pv[..., 1], cv, g, 2)]
