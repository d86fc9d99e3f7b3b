"""The codec registry (SPEC.md §6): every codec's permanent id, name, kinds and declared bound; parsing a
codec choice; and encode / decode of one extent, dispatched to the families (zstd.py, kv.py, kvq.py,
vectors.py).  Decoders validate every length against the record header before allocating and raise
CorruptionError on any inconsistency.  Pure: no I/O, nothing about records, files or the store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import CorruptionError, InvalidObject
from ..format import constants as fmt
from . import kv, kvq, vectors
from .base import Codec, Extent, finite_f32, from_float32, itemsize
from .quant import assemble_numpy, assemble_torch, group_param
from .zstd import dict_for, level, shuffle, unshuffle, zstd_bound, zstd_compress, zstd_decompress


def encode(codec: Codec, raw: np.ndarray, ext: Extent, params: dict[str, Any],
           dictionary: bytes | None = None) -> bytes:
    """Encode one extent given as its stored bytes (uint8, C order).  ``dictionary``: the zstd
    dictionary named by ``params["dict"]`` (zstd on blobs only)."""
    cid = codec.id
    if cid == fmt.CODEC_RAW:
        return raw.tobytes()
    if cid == fmt.CODEC_ZSTD:
        return zstd_compress(raw, level(params), dict_for(params, dictionary))
    if cid == fmt.CODEC_SHUFFLE_ZSTD:
        return zstd_compress(shuffle(raw, itemsize(ext)), level(params))
    x = finite_f32(raw, ext, codec.name)
    if cid == fmt.CODEC_KV_ANS:
        return kvq.encode(x, ext, params)
    if cid in kv.IDS:
        body = kv.encode(cid, x, params)
    elif cid in vectors.IDS:
        body = vectors.encode(cid, x)
    else:
        raise InvalidObject(f"codec {codec.name!r} cannot encode")
    if "zstd" in params:
        return zstd_compress(body, level(params, "zstd"))
    return body


def max_length(codec: Codec, ext: Extent, params: dict[str, Any]) -> int:
    """An upper bound of a variable-length codec's stored extent (for validation)."""
    if codec.id == fmt.CODEC_KV_ANS:
        return kvq.max_length(ext, params)
    if codec.lossless or "zstd" in params:
        return zstd_bound(ext.nbytes if codec.lossless else body_length(codec, ext, params))
    return body_length(codec, ext, params)


def body_length(codec: Codec, ext: Extent, params: dict[str, Any]) -> int:
    """The exact byte length of a fixed-size codec's output for ``ext`` (before any zstd stage)."""
    cid = codec.id
    if cid in kv.IDS or cid == fmt.CODEC_KV_ANS:
        if (len(ext.shape) != 4 or ext.shape[0] != 2) and not (ext.kind == "mla" and len(ext.shape) == 2):
            raise CorruptionError("KV codec on an extent that is not one layer")
        if cid == fmt.CODEC_KV_ANS:
            raise CorruptionError("kvq-ans has no fixed length")
        return kv.body_length(cid, ext, params)
    if cid in vectors.IDS:
        return vectors.body_length(cid, ext)
    raise CorruptionError(f"codec {codec.name!r} has no fixed length")


def decode(codec: Codec, data: Any, ext: Extent, params: dict[str, Any],
           dictionary: bytes | None = None) -> np.ndarray:
    """Decode one extent to its stored bytes (uint8, C order, ``ext.nbytes`` long).

    Every length is checked against ``ext`` (from the record header) before anything is
    allocated; any inconsistency is CorruptionError.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        return _decode(codec, data, ext, params, dictionary)


def _decode(codec: Codec, data: Any, ext: Extent, params: dict[str, Any], dictionary: bytes | None) -> np.ndarray:
    cid = codec.id
    want = ext.nbytes
    if cid == fmt.CODEC_RAW:
        if len(data) != want:
            raise CorruptionError(f"raw extent of {len(data)} bytes, expected {want}")
        return np.frombuffer(data, np.uint8)
    if cid == fmt.CODEC_ZSTD:
        return np.frombuffer(zstd_decompress(data, want, dict_for(params, dictionary)), np.uint8)
    if cid == fmt.CODEC_SHUFFLE_ZSTD:
        return unshuffle(np.frombuffer(zstd_decompress(data, want), np.uint8), itemsize(ext))
    x = assemble_numpy(lossy_parts(codec, data, ext, params))
    return _checked_out(codec, x, ext.dtype)


def lossy_parts(codec: Codec, data: Any, ext: Extent, params: dict[str, Any]) -> list[tuple[Any, ...]]:
    """A lossy extent's bytes, checked and parsed into parts (see quant.py)."""
    cid = codec.id
    if ext.dtype is None:
        raise CorruptionError("lossy codec on an extent without a dtype")
    if cid == fmt.CODEC_KV_ANS:
        return kvq.parts(data, ext, params)
    n = body_length(codec, ext, params)
    if "zstd" in params:
        level(params, "zstd")
        data = zstd_decompress(data, n)
    if len(data) != n:
        raise CorruptionError(f"{codec.name} extent of {len(data)} bytes, expected {n}")
    b = np.frombuffer(data, np.uint8)
    if cid in kv.IDS:
        return kv.parts(cid, b, ext, params)
    if cid in vectors.IDS:
        return vectors.parts(cid, b, ext)
    raise CorruptionError(f"codec {codec.name!r} cannot decode")


def decode_torch(codec: Codec, data: Any, ext: Extent, params: dict[str, Any], device: str) -> Any:
    """Decode one lossy extent with the arithmetic on ``device`` (torch): only the codes and
    scales cross to the device, where the values are computed and rounded to the stored
    dtype, bit for bit as ``decode`` does (one binary32 operation at a time, SPEC.md §6.1).
    Returns a tensor of the stored dtype shaped like the extent.  (kvq-ans entropy-decodes
    its symbols on the CPU first.)"""
    from ..arrays import torch_dtype

    if codec.lossless:
        raise InvalidObject("decode_torch is for lossy array codecs")
    x = assemble_torch(lossy_parts(codec, data, ext, params), device)
    if x.numel() and not bool((x.abs().max() <= fmt.LOSSY_VALUE_MAX).item()):
        raise CorruptionError(f"{codec.name} extent decodes to values out of range (a damaged scale)")
    return x.to(torch_dtype(ext.dtype))


def _checked_out(codec: Codec, x: np.ndarray, dtype: str) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        out_of_range = x.size and not (np.abs(x).max() <= fmt.LOSSY_VALUE_MAX)  # NaN compares false
    if out_of_range:  # encoders take |x| <= 65504: anything else was damaged
        raise CorruptionError(f"{codec.name} extent decodes to values out of range (a damaged scale)")
    return from_float32(x, dtype)


# --- the registry ---------------------------------------------------------------------------------------

_ALL = [
    Codec(fmt.CODEC_RAW, "raw", True, ("kv", "vectors", "blob", "mla"), "exact", "1.0"),
    Codec(fmt.CODEC_ZSTD, "zstd", True, ("kv", "vectors", "blob", "mla"), "exact", "1.08 (fp16 KV)", {"level": 3}),
    Codec(fmt.CODEC_SHUFFLE_ZSTD, "shuffle+zstd", True, ("kv", "vectors", "mla"), "exact", "1.17 (fp16 KV)",
          {"level": 1}),
    Codec(fmt.CODEC_KV_INT8, "int8", False, ("kv", "mla"),
          "|x - x'| <= 0.5 * s + stored-dtype rounding; K: s = absmax / 127 per channel over the chunk's tokens "
          "(float16, rounded up); V (and an MLA latent): s <= max(1.0906 * absmax / 127, 2^-22.5) per token "
          "(one-byte log scale)",
          "1.96 (head_dim 32), 1.99 (128)"),
    Codec(fmt.CODEC_KV_INT4, "int4", False, ("kv",),
          "|x - x'| <= 0.5 * s + stored-dtype rounding, s = (max - min) / 15 (float16, rounded up) per group of 32: "
          "K tokens of one channel, V dims of one token", "3.2", {"group": 32}),
    Codec(fmt.CODEC_KV_INT2, "int2", False, ("kv",),
          "|x - x'| <= 0.5 * s + stored-dtype rounding, s = (max - min) / 3 per group of 32 (as int4)", "5.3",
          {"group": 32}),
    Codec(fmt.CODEC_KV_FP8, "fp8", False, ("kv", "mla"),
          "|x - x'| <= |x| / 16 + s / 1024 + stored-dtype rounding, s = absmax / 448 (float16, rounded up) per K "
          "channel and per V token (per token of an MLA latent)", "1.94"),
    Codec(fmt.CODEC_KV_ANS, "kvq-ans", False, ("kv",),
          "|x - x'| <= 0.5 * s + stored-dtype rounding; K: s = (max - min) / (B - 1) per channel over the chunk's "
          "tokens (float16: min rounded down, s up); V: s <= max(1.0906 * absmax, 127 * 2^-22.5) / (B/2 - 1) per "
          "token; B = bins of the "
          "layer", "3.5 at 6% attention error (bins=32/26, the default); 4.9 (bins=12/12)",
          {"bins": [32, 26], "shallow": 2}),
    Codec(fmt.CODEC_VEC_FP16, "fp16", False, ("vectors",),
          "float16 rounding: |x - x'| <= |x| / 2048 (+ 2^-25 for subnormals)", "2.0 (fp32 input)"),
    Codec(fmt.CODEC_VEC_INT8, "int8", False, ("vectors",),
          "|x - x'| <= 0.5 * s + stored-dtype rounding, s = (max - min) / 255 per vector (float32)",
          "1.96 (fp16 input, dim 384)"),
    Codec(fmt.CODEC_VEC_BINARY, "binary", False, ("vectors",),
          "sign only: x' = +m where x >= 0, -m elsewhere, m = mean |x| of the vector (a coarse first pass; "
          "re-score with exact vectors)", "16 (fp16 input)"),
]
BY_ID: dict[int, Codec] = {c.id: c for c in _ALL}
BY_NAME: dict[tuple[str, str], Codec] = {(c.name, k): c for c in _ALL for k in c.kinds}
POST_ZSTD = frozenset({fmt.CODEC_KV_INT8, fmt.CODEC_KV_INT4, fmt.CODEC_KV_INT2, fmt.CODEC_KV_FP8,
                       fmt.CODEC_VEC_FP16, fmt.CODEC_VEC_INT8, fmt.CODEC_VEC_BINARY})
# blobs of these media types are already compressed: a blob codec stores them raw
COMPRESSED_MEDIA = ("image/png", "image/jpeg", "image/webp", "image/gif", "video/", "audio/", "application/zstd",
                    "application/gzip", "application/zip", "application/x-xz", "application/x-bzip2")


def available() -> list[dict[str, Any]]:
    """Every registered codec: id, name, lossless, kinds, declared bound, expected ratio, defaults."""
    return [c.describe() for c in _ALL]


@dataclass(frozen=True)
class Choice:
    """A codec with its parameters, as chosen for one put."""

    codec: Codec
    params: dict[str, Any]

    @property
    def spec(self) -> str:
        extra = ",".join(f"{k}={'/'.join(map(str, v)) if isinstance(v, list) else v}"
                         for k, v in sorted(self.params.items()) if k != "zstd")
        name = self.codec.name + ("+zstd" if "zstd" in self.params else "")
        return name + (f":{extra}" if extra else "")


def _base_name(name: str) -> str:
    """The codec a name runs first: ``int8`` of ``int8+zstd`` (``shuffle+zstd`` is one codec)."""
    return name[: -len("+zstd")] if name.endswith("+zstd") and name != "shuffle+zstd" else name


def parse(spec: str | Choice, kind: str) -> Choice:
    """``"int8"``, ``"int8+zstd"``, ``"zstd:level=9"``, ``"int4:group=64"`` -> a Choice for ``kind``."""
    if isinstance(spec, Choice):
        if kind not in spec.codec.kinds:
            raise InvalidObject(f"codec {spec.codec.name!r} does not apply to {kind}")
        return spec
    if not isinstance(spec, str) or not spec:
        raise InvalidObject(f"a codec is named by a string such as 'int8' or 'zstd:level=9', got {spec!r}")
    name, _, args = spec.partition(":")
    params: dict[str, Any] = {}
    base = _base_name(name)
    codec = BY_NAME.get((base, kind))
    if codec is None:
        names = sorted({c.name for c in _ALL if kind in c.kinds})
        raise InvalidObject(f"no codec {name!r} for {kind}; available: {', '.join(names)}")
    params.update(codec.defaults)
    if base != name:
        if codec.id not in POST_ZSTD:
            raise InvalidObject(f"{base}+zstd is not a codec")
        params["zstd"] = 3
    for item in filter(None, args.split(",")):
        k, eq, v = item.partition("=")
        if k == "bins" and "bins" in params:  # kvq-ans: bins=SHALLOW/DEEP
            parts = v.split("/")
            if len(parts) != 2 or not all(p.isdigit() and 4 <= int(p) <= 256 and int(p) % 2 == 0 for p in parts):
                raise InvalidObject(f"codec parameter {item!r}: expected bins=SHALLOW/DEEP, even numbers in 4..256")
            params["bins"] = [int(parts[0]), int(parts[1])]
            continue
        if not eq or not v.lstrip("-").isdigit():
            raise InvalidObject(f"codec parameter {item!r}: expected name=integer")
        key = "zstd" if k == "level" and "zstd" in params and codec.id in POST_ZSTD else k
        if key == "dict" and codec.id == fmt.CODEC_ZSTD and kind == "blob":
            if not 1 <= int(v) < 1 << 32:
                raise InvalidObject(f"dictionary id must be 1..2^32-1, got {v}")
            params["dict"] = int(v)
            continue
        if key not in params:
            raise InvalidObject(f"codec {codec.name!r} has no parameter {k!r}")
        params[key] = int(v)
    for key in ("level", "zstd"):
        if key in params and not 1 <= params[key] <= 22:
            raise InvalidObject(f"zstd level must be 1..22, got {params[key]}")
    if "group" in params and not 1 <= params["group"] <= 1 << 16:
        raise InvalidObject(f"group must be 1..65536, got {params['group']}")
    return Choice(codec, params)


def check_any(spec: str | Choice) -> None:
    """InvalidObject unless ``spec`` parses for some kind of object: a batch's ``codec=``
    checked before its items (whose kinds choose) are read, so that an empty batch, or a
    name no codec has, is refused as the argument it is."""
    if isinstance(spec, Choice):
        return
    base = _base_name(spec.partition(":")[0]) if isinstance(spec, str) else ""
    kinds = sorted(k for n, k in BY_NAME if n == base)
    if not kinds:
        names = sorted({n for n, _ in BY_NAME})
        raise InvalidObject(f"codec={spec!r}: no such codec; available: {', '.join(names)}")
    error: InvalidObject | None = None
    for kind in kinds:  # (a parameter one kind's codec refuses: that kind's error)
        try:
            parse(spec, kind)
            return
        except InvalidObject as e:
            error = error or e
    assert error is not None
    raise error


def check_params(codec: Codec, params: Any) -> None:
    """Validate stored parameters (a decoded record): the names a codec knows, sane values."""
    if not isinstance(params, dict):
        raise CorruptionError("codec parameters are not a map")
    allowed = set(codec.defaults) | ({"zstd"} if codec.id in POST_ZSTD else set()) | \
        ({"dict"} if codec.id == fmt.CODEC_ZSTD else set())
    if set(params) - allowed:
        raise CorruptionError(f"unknown parameters {sorted(set(params) - allowed)} for codec {codec.name}")
    if "level" in params:
        level(params)
    if "zstd" in params:
        level(params, "zstd")
    if "group" in params:
        group_param(params)
    if "dict" in params and (type(params["dict"]) is not int or not 1 <= params["dict"] < 1 << 32):
        raise CorruptionError(f"codec parameter 'dict' must be an int in 1..2^32-1, got {params['dict']!r}")
    if "bins" in params or codec.id == fmt.CODEC_KV_ANS:
        kvq.kvq_bins(params, 0)
