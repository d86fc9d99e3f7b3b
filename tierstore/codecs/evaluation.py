"""Codec evaluation on a sample: compression ratio, speed, error against the declared bound, and for KV the
attention-output error.  Measures; stores nothing and does no I/O.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from ..errors import InvalidObject
from .base import Extent, to_float32
from .registry import decode, encode, parse


def evaluate(spec: str, sample: Any, *, kind: str | None = None, queries: Any = None) -> dict[str, Any]:
    """Encode and decode ``sample`` (a KV chunk ``[layers, 2, H, T, D]``, an MLA latent cache
    ``[layers, tokens, dim]`` or vectors ``[n, dim]``: a numpy array of float16/32/64, or a
    ``KVCache`` / ``MLACache`` / ``Vectors`` holding one) with codec ``spec``: ratio to the raw
    bytes, encode and decode MB/s (of raw bytes, one thread), relative L2 error, and for KV the
    attention-output error ``|softmax(QK^T/sqrt d)V - exact| / |exact|`` (with ``queries``
    ``[layers, H, T, D]``, else K as queries).  ``kind`` ("kv", "mla", "vectors") is read from
    the object, else from the array's rank (5, 3, 2)."""
    from ..objects import KVCache, MLACache, Vectors  # (the objects import the codecs)

    if isinstance(sample, (KVCache, MLACache, Vectors)):
        given = "kv" if isinstance(sample, KVCache) else "mla" if isinstance(sample, MLACache) else "vectors"
        if kind is not None and kind != given:
            raise InvalidObject(f"evaluate: kind={kind!r} given for a {type(sample).__name__}")
        kind, sample = given, sample.data
    arr = np.asarray(sample)
    ranks = {"kv": 5, "mla": 3, "vectors": 2}
    kind = kind or {5: "kv", 3: "mla", 2: "vectors"}.get(arr.ndim)
    if kind not in ranks or arr.ndim != ranks[kind]:
        raise InvalidObject(f"evaluate takes a KV chunk [layers, 2, H, T, D], an MLA cache [layers, tokens, dim] or "
                            f"vectors [n, dim]; got shape {list(arr.shape)}" + (f" for kind={kind!r}" if kind else ""))
    choice = parse(spec, kind)
    dtype = {np.dtype("float16"): "float16", np.dtype("float32"): "float32",
             np.dtype("float64"): "float64"}.get(arr.dtype)
    if dtype is None:
        raise InvalidObject(f"evaluate takes float16/32/64 numpy samples, got {arr.dtype}")
    parts = [arr[i] for i in range(arr.shape[0])] if kind in ("kv", "mla") else [arr]
    exts = [Extent(kind, p.shape, dtype, i) for i, p in enumerate(parts)]
    raws = [np.ascontiguousarray(p).reshape(-1).view(np.uint8) for p in parts]
    t0 = time.perf_counter()
    enc = [encode(choice.codec, r, e, choice.params) for r, e in zip(raws, exts)]
    t1 = time.perf_counter()
    dec = [decode(choice.codec, b, e, choice.params) for b, e in zip(enc, exts)]
    t2 = time.perf_counter()
    raw_bytes = sum(r.nbytes for r in raws)
    x = np.concatenate([to_float32(r, dtype) for r in raws]).astype(np.float64)
    y = np.concatenate([to_float32(d, dtype) for d in dec]).astype(np.float64)
    out: dict[str, Any] = {
        "codec": choice.spec, "id": choice.codec.id, "lossless": choice.codec.lossless,
        "ratio": round(raw_bytes / max(1, sum(len(b) for b in enc)), 3),
        "encode_mb_s": round(raw_bytes / 1e6 / max(t1 - t0, 1e-9), 1),
        "decode_mb_s": round(raw_bytes / 1e6 / max(t2 - t1, 1e-9), 1),
        "rel_l2": float(np.linalg.norm(x - y) / max(np.linalg.norm(x), 1e-30)),
        "bit_exact": bool(all(np.array_equal(r, d) for r, d in zip(raws, dec))),
    }
    if kind == "kv":
        dk = np.stack([to_float32(d, dtype).reshape(e.shape) for d, e in zip(dec, exts)])
        xk = arr.astype(np.float32)
        q = np.asarray(queries, dtype=np.float32) if queries is not None else xk[:, 0]
        out["attention_error"] = attention_error(q, xk, dk)
    return out


def attention_error(q: np.ndarray, kv: np.ndarray, kv_hat: np.ndarray) -> float:
    """Mean over layers of |softmax(Q K^T / sqrt d) V - same with decoded K, V| / |exact|."""
    errs = []
    for layer in range(kv.shape[0]):
        outs = []
        for k, v in ((kv[layer, 0], kv[layer, 1]), (kv_hat[layer, 0], kv_hat[layer, 1])):
            s = np.einsum("htd,hsd->hts", q[layer], k) / math.sqrt(k.shape[-1])
            s = np.exp(s - s.max(-1, keepdims=True))
            outs.append(np.einsum("hts,hsd->htd", s / s.sum(-1, keepdims=True), v))
        errs.append(float(np.linalg.norm(outs[0] - outs[1]) / max(np.linalg.norm(outs[0]), 1e-30)))
    return float(np.mean(errs))
