"""Codecs (SPEC.md §6): how one extent's bytes are transformed, with stable ids and declared bounds.

A codec encodes one extent (a KV layer ``[2, kv_heads, tokens, head_dim]``, a row range of
vectors ``[rows, dim]``, or a blob's bytes) into bytes and back.  Lossless codecs give back
every bit; lossy ones declare a bound on the error of every element, which the tests check
on every input they generate.  The byte layout of each codec is in SPEC.md §6, so other
readers can decode it.

This module is pure functions over numpy arrays and bytes: no I/O, nothing about records,
files or the store.  Decoders validate every length against what the record header says
before allocating, and raise CorruptionError on any inconsistency.  Lossy codecs never run
unless asked for (per put, or per kind and tier when the store is opened).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zstandard

from . import format as fmt
from . import rans
from .errors import CorruptionError, InvalidObject

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


def _finite_f32(raw: np.ndarray, ext: Extent, codec: str) -> np.ndarray:
    assert ext.dtype is not None
    x = to_float32(raw, ext.dtype).reshape(ext.shape)
    if x.size and not (np.isfinite(x).all() and np.abs(x).max() <= FP16_MAX):
        raise InvalidObject(f"codec {codec!r} needs finite values within +-65504; this data has others",
                            hint="use a lossless codec (raw, zstd, shuffle+zstd) for it")
    return x


# --- zstd framing (SPEC.md §6.2) ------------------------------------------------------------------

_ZC: dict[int, zstandard.ZstdCompressor] = {}
_ZD = zstandard.ZstdDecompressor()


def zstd_compress(data: Any, level: int, dictionary: bytes | None = None) -> bytes:
    if dictionary is not None:
        zd = zstandard.ZstdCompressionDict(dictionary)
        return zstandard.ZstdCompressor(level=level, write_content_size=True, dict_data=zd).compress(data)
    c = _ZC.get(level)
    if c is None:
        c = _ZC[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return c.compress(data)


def dictionary_id(dictionary: bytes) -> int:
    """The id a zstd dictionary declares (nonzero for a trained one), or CorruptionError."""
    if len(dictionary) < 8 or dictionary[:4] != b"\x37\xa4\x30\xec":
        raise CorruptionError("not a zstd dictionary (magic)")
    did = int.from_bytes(dictionary[4:8], "little")
    if did == 0:
        raise CorruptionError("zstd dictionary without an id")
    return did


def train_dictionary(samples: list[bytes], size: int = 16 << 10) -> bytes:
    """A zstd dictionary trained on ``samples`` (many small, similar blobs)."""
    try:
        return zstandard.train_dictionary(size, list(samples)).as_bytes()
    except zstandard.ZstdError as e:
        raise InvalidObject(f"cannot train a dictionary on these samples: {e}",
                            hint="give a few hundred samples of the kind of blob to compress") from None


def zstd_bound(n: int) -> int:
    """The largest zstd frame that can hold ``n`` bytes (ZSTD_compressBound, plus headers)."""
    return n + (n >> 8) + (((128 << 10) - n) >> 11 if n < (128 << 10) else 0) + 64


def zstd_decompress(data: Any, expected: int, dictionary: bytes | None = None) -> bytes:
    """A single zstd frame that declares exactly ``expected`` content bytes (checked first),
    and the dictionary id of ``dictionary`` (or none)."""
    try:
        declared = zstandard.frame_content_size(data)
        frame_dict = zstandard.get_frame_parameters(data).dict_id
    except zstandard.ZstdError as e:
        raise CorruptionError(f"bad zstd frame: {e}") from None
    if declared != expected:
        raise CorruptionError(f"zstd frame declares {declared} bytes, the record {expected}")
    want_dict = dictionary_id(dictionary) if dictionary is not None else 0
    if frame_dict != want_dict:
        raise CorruptionError(f"zstd frame names dictionary {frame_dict}, the record {want_dict}")
    try:
        d = _ZD if dictionary is None else zstandard.ZstdDecompressor(
            dict_data=zstandard.ZstdCompressionDict(dictionary))
        out = d.decompress(data, max_output_size=expected)
    except zstandard.ZstdError as e:
        raise CorruptionError(f"bad zstd frame: {e}") from None
    if len(out) != expected:
        raise CorruptionError(f"zstd frame holds {len(out)} bytes, the record {expected}")
    return out


def _level(params: dict[str, Any], key: str = "level") -> int:
    level = params.get(key)
    if type(level) is not int or not 1 <= level <= 22:
        raise CorruptionError(f"codec parameter {key!r} must be an int in 1..22, got {level!r}")
    return level


# --- lossless ---------------------------------------------------------------------------------------

def _shuffle(b: np.ndarray, itemsize: int) -> np.ndarray:
    return np.ascontiguousarray(b.reshape(-1, itemsize).T).reshape(-1)


def _unshuffle(b: np.ndarray, itemsize: int) -> np.ndarray:
    return np.ascontiguousarray(b.reshape(itemsize, -1).T).reshape(-1)


def _itemsize(ext: Extent) -> int:
    return fmt.DTYPES[fmt.DTYPE_IDS[ext.dtype]][1] if ext.dtype else 1


# --- quantisers (SPEC.md §6.3-6.5) ----------------------------------------------------------------

def _f16_up(s: np.ndarray) -> np.ndarray:
    """float32 -> the smallest float16 >= it (so that scaled values never exceed their range)."""
    h = s.astype(np.float16)
    low = h.astype(np.float32) < s
    h[low] = np.nextafter(h[low], np.float16(np.inf))
    return h


def _absmax_int8(x: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 over ``axis``: float16 scales (absmax / 127, rounded up) and codes."""
    s = _f16_up(np.abs(x).max(axis=axis, keepdims=True) / np.float32(127))
    sf = s.astype(np.float32)
    q = np.rint(np.divide(x, sf, out=np.zeros_like(x), where=sf > 0))
    return s, np.clip(q, -127, 127).astype(np.int8)


LOG_SCALE_BIAS = 180  # one-byte scales: s = 2^((c - 180) / 8), c in 0..255 (SPEC.md §6.3)


def _log_scale(c: np.ndarray, m: int = 127) -> np.ndarray:
    """The binary32 nearest to 2^((c - 180) / 8) * 127 / m (computed in binary64, then rounded):
    with codes in [-m, m] the largest magnitude is 127 * 2^((c - 180) / 8) whatever m is."""
    return (np.exp2((c.astype(np.float64) - LOG_SCALE_BIAS) / 8) * (127 / m)).astype(np.float32)


def _log_int8(x: np.ndarray, axis: int, m: int = 127) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric quantisation to [-m, m] over ``axis`` with one-byte log-scale codes: the
    smallest c with m * s(c) >= absmax, s(c) = 2^((c-180)/8) * 127 / m (absmax 0: c = 0)."""
    a = np.abs(x).max(axis=axis, keepdims=True)
    with np.errstate(divide="ignore"):
        c = np.ceil(np.log2(a / np.float32(127)) * 8) + LOG_SCALE_BIAS
    c = np.where(a > 0, np.clip(c, 0, 255), 0).astype(np.uint8)
    low = (_log_scale(c, m) * m < a) & (c < 255)  # float rounding at a code boundary: one code up
    c[low] += 1
    s = _log_scale(c, m)
    q = np.rint(np.divide(x, s, out=np.zeros_like(x), where=a > 0))
    return c, np.clip(q, -m, m).astype(np.int8 if m <= 127 else np.int16)


def _groups(n: int, g: int) -> int:
    return -(-n // g)


def _minmax_codes(x: np.ndarray, bits: int, group: int, axis: int,
                  levels: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Asymmetric quantisation in groups of ``group`` along ``axis`` (KIVI): per group a float16
    minimum (rounded down) and step (rounded up), codes in [0, levels] (levels = 2^bits - 1)."""
    levels = (1 << bits) - 1 if levels is None else levels
    n = x.shape[axis]
    pad = _groups(n, group) * group - n
    xm = np.moveaxis(x, axis, -1)
    if pad:  # pad with the group's own values (edge), so min/max are those of the real elements
        xm = np.concatenate([xm, np.repeat(xm[..., -1:], pad, axis=-1)], axis=-1)
    xg = xm.reshape(*xm.shape[:-1], -1, group)
    lo = xg.min(axis=-1).astype(np.float16)
    lo_f = lo.astype(np.float32)
    too_high = lo_f > xg.min(axis=-1)
    lo[too_high] = np.nextafter(lo[too_high], np.float16(-np.inf))
    lo_f = lo.astype(np.float32)
    step = _f16_up((xg.max(axis=-1) - lo_f) / np.float32(levels))
    step_f = step.astype(np.float32)[..., None]
    q = np.rint(np.divide(xg - lo_f[..., None], step_f, out=np.zeros_like(xg), where=step_f > 0))
    q = np.clip(q, 0, levels).astype(np.uint8).reshape(*xm.shape[:-1], -1)[..., :n]
    return lo, step, np.moveaxis(q, -1, axis)


def _minmax_decode(lo: np.ndarray, step: np.ndarray, q: np.ndarray, group: int, axis: int) -> np.ndarray:
    n = q.shape[axis]
    qm = np.moveaxis(q, axis, -1).astype(np.float32)
    idx = np.arange(n) // group
    out = lo.astype(np.float32)[..., idx] + qm * step.astype(np.float32)[..., idx]
    return np.moveaxis(out, -1, axis)


def _pack(codes: np.ndarray, bits: int) -> bytes:
    """Codes (uint8 < 2^bits) in C order, packed little-end first: element i in bits
    [(i % per) * bits, ...) of byte i // per (per = 8 / bits)."""
    per = 8 // bits
    c = codes.reshape(-1)
    pad = (-len(c)) % per
    if pad:
        c = np.concatenate([c, np.zeros(pad, np.uint8)])
    c = c.reshape(-1, per).astype(np.uint8)
    out = np.zeros(len(c), np.uint8)
    for j in range(per):
        out |= c[:, j] << np.uint8(j * bits)
    return out.tobytes()


def _unpack(b: np.ndarray, bits: int, n: int) -> np.ndarray:
    per = 8 // bits
    mask = np.uint8((1 << bits) - 1)
    out = np.empty((len(b), per), np.uint8)
    for j in range(per):
        out[:, j] = (b >> np.uint8(j * bits)) & mask
    return out.reshape(-1)[:n]


# fp8 e4m3fn (OCP): bias 7, 3 mantissa bits, max 448, no infinities
_E4M3 = np.array([((-1) ** (i >> 7)) * (((i & 7) / 8) * 2.0 ** -6 if (i >> 3) & 15 == 0
                                         else (1 + (i & 7) / 8) * 2.0 ** (((i >> 3) & 15) - 7))
                  for i in range(256)], dtype=np.float32)
_E4M3[[0x7F, 0xFF]] = np.nan


def _to_e4m3(y: np.ndarray) -> np.ndarray:
    """float32 in [-448, 448] -> e4m3fn bytes, round to nearest even."""
    a = np.abs(y)
    _, k = np.frexp(np.maximum(a, np.float32(2.0 ** -6)))
    step = np.ldexp(np.float32(1), (k - 1 - 3).astype(np.int32))  # ulp of the binade (subnormals: 2^-9)
    q = np.minimum(np.rint(a / step) * step, np.float32(448))
    m, k2 = np.frexp(q)  # q = m * 2^k2, m in [0.5, 1)
    normal = q >= np.float32(2.0 ** -6)
    e_field = np.where(normal, k2 - 1 + 7, 0)
    mant = np.where(normal, np.rint((m * 2 - 1) * 8), np.rint(q / np.float32(2.0 ** -9)))
    bits = (e_field.astype(np.uint8) << 3) | mant.astype(np.uint8)
    return bits | (np.signbit(y) & (q > 0)).astype(np.uint8) << 7


# --- the codecs ----------------------------------------------------------------------------------------

def _kv_split(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return x[0], x[1]  # K [H, T, D], V [H, T, D]


def encode(codec: Codec, raw: np.ndarray, ext: Extent, params: dict[str, Any],
           dictionary: bytes | None = None) -> bytes:
    """Encode one extent given as its stored bytes (uint8, C order).  ``dictionary``: the zstd
    dictionary named by ``params["dict"]`` (zstd on blobs only)."""
    cid = codec.id
    if cid == fmt.CODEC_RAW:
        return raw.tobytes()
    if cid == fmt.CODEC_ZSTD:
        return zstd_compress(raw, _level(params), _dict_for(params, dictionary))
    if cid == fmt.CODEC_SHUFFLE_ZSTD:
        return zstd_compress(_shuffle(raw, _itemsize(ext)), _level(params))
    x = _finite_f32(raw, ext, codec.name)
    if cid == fmt.CODEC_KV_INT8:
        k, v = _kv_split(x)
        sk, qk = _absmax_int8(k, axis=1)  # K: per channel (head, dim), over the tokens
        cv, qv = _log_int8(v, axis=2)  # V: per token (head, token), over the dims; one-byte scales
        body = b"".join([sk.astype("<f2").tobytes(), cv.tobytes(), qk.tobytes(), qv.tobytes()])
    elif cid in (fmt.CODEC_KV_INT4, fmt.CODEC_KV_INT2):
        bits = 4 if cid == fmt.CODEC_KV_INT4 else 2
        g = params.get("group", 32)
        k, v = _kv_split(x)
        lk, stk, qk = _minmax_codes(k, bits, g, axis=1)  # K per channel, groups of g tokens
        lv, stv, qv = _minmax_codes(v, bits, g, axis=2)  # V per token, groups of g dims
        body = b"".join([np.stack([lk, stk], -1).astype("<f2").tobytes(),
                         np.stack([lv, stv], -1).astype("<f2").tobytes(), _pack(qk, bits), _pack(qv, bits)])
    elif cid == fmt.CODEC_KV_ANS:
        return _kvq_ans_encode(x, ext, params)
    elif cid == fmt.CODEC_KV_FP8:
        k, v = _kv_split(x)
        sk = _f16_up(np.abs(k).max(axis=1, keepdims=True) / np.float32(448))
        sv = _f16_up(np.abs(v).max(axis=2, keepdims=True) / np.float32(448))
        yk = np.divide(k, sk.astype(np.float32), out=np.zeros_like(k), where=sk > 0)
        yv = np.divide(v, sv.astype(np.float32), out=np.zeros_like(v), where=sv > 0)
        body = b"".join([sk.astype("<f2").tobytes(), sv.astype("<f2").tobytes(),
                         _to_e4m3(yk).tobytes(), _to_e4m3(yv).tobytes()])
    elif cid == fmt.CODEC_VEC_FP16:
        body = x.astype("<f2").tobytes()
    elif cid == fmt.CODEC_VEC_INT8:  # per vector: float32 minimum and step, uint8 codes
        lo = x.min(axis=1, keepdims=True)
        step = (x.max(axis=1, keepdims=True) - lo) / np.float32(255)
        q = np.clip(np.rint(np.divide(x - lo, step, out=np.zeros_like(x), where=step > 0)), 0, 255).astype(np.uint8)
        body = np.concatenate([lo, step], axis=1).astype("<f4").tobytes() + q.tobytes()
    elif cid == fmt.CODEC_VEC_BINARY:
        s = np.abs(x).mean(axis=1, dtype=np.float64).astype("<f4")
        body = s.tobytes() + np.packbits(~np.signbit(x), axis=1, bitorder="little").tobytes()
    else:
        raise InvalidObject(f"codec {codec.name!r} cannot encode")
    if "zstd" in params:
        return zstd_compress(body, _level(params, "zstd"))
    return body


def kvq_bins(params: dict[str, Any], layer: int) -> int:
    """The number of bins of ``layer`` (SPEC.md §6.6): the first for shallow layers."""
    bins, shallow = params.get("bins"), params.get("shallow")
    if (not isinstance(bins, list) or len(bins) != 2 or not all(type(b) is int and 4 <= b <= 256 and b % 2 == 0
                                                                for b in bins)):
        raise CorruptionError(f"codec parameter 'bins' must be two even ints in 4..256, got {bins!r}")
    if type(shallow) is not int or not 0 <= shallow <= 1 << 16:
        raise CorruptionError(f"codec parameter 'shallow' must be an int in 0..65536, got {shallow!r}")
    return bins[0] if layer < shallow else bins[1]


def _kvq_ans_encode(x: np.ndarray, ext: Extent, params: dict[str, Any]) -> bytes:
    """kvq-ans: K per channel (asymmetric, B levels), V per token (symmetric, B - 1 levels,
    one-byte log scales), each half entropy-coded with its own frequency table (rANS)."""
    b = kvq_bins(params, ext.index)
    k, v = _kv_split(x)
    _, h, t, d = ext.shape
    lo, st, ck = _minmax_codes(k, 8, t, axis=1, levels=b - 1)  # K: one group = all tokens of a channel
    m = b // 2 - 1
    cv, qv = _log_int8(v, axis=2, m=m)
    sk = ck.reshape(-1).astype(np.int64)
    sv = qv.reshape(-1).astype(np.int64) + m
    fk = rans.normalize(np.bincount(sk, minlength=b))
    fv = rans.normalize(np.bincount(sv, minlength=b))
    return b"".join([np.stack([lo[..., 0], st[..., 0]], -1).astype("<f2").tobytes(), cv.tobytes(),
                     fk.astype("<u2").tobytes(), fv.astype("<u2").tobytes(), rans.encode(sk, fk), rans.encode(sv, fv)])


def _kvq_ans_parts(data: Any, ext: Extent, params: dict[str, Any]) -> list[tuple[Any, ...]]:
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
            ("scaled", (qv.reshape(h, t, d) - m).astype(np.float32), _log_scale(cv, m))]


def max_length(codec: Codec, ext: Extent, params: dict[str, Any]) -> int:
    """An upper bound of a variable-length codec's stored extent (for validation)."""
    if codec.id == fmt.CODEC_KV_ANS:
        _, h, t, d = ext.shape
        n = h * t * d
        stream = 4 * rans.lanes_for(n) + 4 + 2 * (n + rans.lanes_for(n))
        return 4 * h * d + h * t + 4 * kvq_bins(params, ext.index) + 2 * stream
    if codec.lossless or "zstd" in params:
        return zstd_bound(ext.nbytes if codec.lossless else body_length(codec, ext, params))
    return body_length(codec, ext, params)


def body_length(codec: Codec, ext: Extent, params: dict[str, Any]) -> int:
    """The exact byte length of a fixed-size codec's output for ``ext`` (before any zstd stage)."""
    cid = codec.id
    if cid in (fmt.CODEC_KV_INT8, fmt.CODEC_KV_FP8, fmt.CODEC_KV_INT4, fmt.CODEC_KV_INT2, fmt.CODEC_KV_ANS):
        if len(ext.shape) != 4 or ext.shape[0] != 2:
            raise CorruptionError("KV codec on an extent that is not one layer")
        if cid == fmt.CODEC_KV_ANS:
            raise CorruptionError("kvq-ans has no fixed length")
        _, h, t, d = ext.shape
        if cid == fmt.CODEC_KV_INT8:
            return 2 * h * d + h * t + 2 * h * t * d
        if cid == fmt.CODEC_KV_FP8:
            return 2 * (h * d + h * t) + 2 * h * t * d
        bits = 4 if cid == fmt.CODEC_KV_INT4 else 2
        g = _group(params)
        per = 8 // bits
        return 4 * h * (_groups(t, g) * d + t * _groups(d, g)) + 2 * (-(-h * t * d // per))
    rows, dim = ext.shape
    if cid == fmt.CODEC_VEC_FP16:
        return 2 * rows * dim
    if cid == fmt.CODEC_VEC_INT8:
        return 8 * rows + rows * dim
    if cid == fmt.CODEC_VEC_BINARY:
        return 4 * rows + rows * -(-dim // 8)
    raise CorruptionError(f"codec {codec.name!r} has no fixed length")


def _group(params: dict[str, Any]) -> int:
    g = params.get("group", 32)
    if type(g) is not int or not 1 <= g <= 1 << 16:
        raise CorruptionError(f"codec parameter 'group' must be an int in 1..65536, got {g!r}")
    return g


def _dict_for(params: dict[str, Any], dictionary: bytes | None) -> bytes | None:
    if "dict" not in params:
        return None
    if dictionary is None or dictionary_id(dictionary) != params["dict"]:
        raise CorruptionError(f"zstd dictionary {params['dict']} is missing")
    return dictionary


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
        return np.frombuffer(zstd_decompress(data, want, _dict_for(params, dictionary)), np.uint8)
    if cid == fmt.CODEC_SHUFFLE_ZSTD:
        isz = _itemsize(ext)
        return _unshuffle(np.frombuffer(zstd_decompress(data, want), np.uint8), isz)
    x = _assemble_numpy(_lossy_parts(codec, data, ext, params))
    return _checked_out(codec, x, ext.dtype)


# A lossy extent decodes in two steps: its bytes are parsed and checked into parts (codes and
# scales, numpy, on the CPU), then the parts are assembled into values with numpy or, for an
# object headed for a device, with torch there.  Each half of a KV layer (or a vectors block) is
# one of: ("scaled", q, s): x = q * s; ("minmax", lo, st, c, group, axis): x = lo + c * st of
# the element's group; ("plain", x); ("sign", m, bits): x = m where the bit is 1, else -m.


def _lossy_parts(codec: Codec, data: Any, ext: Extent, params: dict[str, Any]) -> list[tuple[Any, ...]]:
    cid = codec.id
    if ext.dtype is None:
        raise CorruptionError("lossy codec on an extent without a dtype")
    if cid == fmt.CODEC_KV_ANS:
        if len(ext.shape) != 4 or ext.shape[0] != 2:
            raise CorruptionError("kvq-ans on an extent that is not one KV layer")
        return _kvq_ans_parts(data, ext, params)
    n = body_length(codec, ext, params)
    if "zstd" in params:
        _level(params, "zstd")
        data = zstd_decompress(data, n)
    if len(data) != n:
        raise CorruptionError(f"{codec.name} extent of {len(data)} bytes, expected {n}")
    b = np.frombuffer(data, np.uint8)
    if cid in (fmt.CODEC_KV_INT8, fmt.CODEC_KV_FP8):
        _, h, t, d = ext.shape
        sk = b[: 2 * h * d].view("<f2").astype(np.float32).reshape(h, 1, d)
        p = 2 * h * d
        if cid == fmt.CODEC_KV_INT8:
            sv, p = _log_scale(b[p : p + h * t]).reshape(h, t, 1), p + h * t
            qk = b[p : p + h * t * d].view(np.int8).reshape(h, t, d).astype(np.float32)
            qv = b[p + h * t * d :].view(np.int8).reshape(h, t, d).astype(np.float32)
        else:
            sv, p = b[p : p + 2 * h * t].view("<f2").astype(np.float32).reshape(h, t, 1), p + 2 * h * t
            qk = _E4M3[b[p : p + h * t * d]].reshape(h, t, d)
            qv = _E4M3[b[p + h * t * d :]].reshape(h, t, d)
            if np.isnan(qk).any() or np.isnan(qv).any():
                raise CorruptionError("fp8 extent holds a NaN code (never written)")
        return [("scaled", qk, sk), ("scaled", qv, sv)]
    if cid in (fmt.CODEC_KV_INT4, fmt.CODEC_KV_INT2):
        bits = 4 if cid == fmt.CODEC_KV_INT4 else 2
        g = _group(params)
        _, h, t, d = ext.shape
        nk = 4 * h * _groups(t, g) * d
        nv = 4 * h * t * _groups(d, g)
        pk = b[:nk].view("<f2").astype(np.float32).reshape(h, d, _groups(t, g), 2)  # K: (head, channel, group)
        pv = b[nk : nk + nv].view("<f2").astype(np.float32).reshape(h, t, _groups(d, g), 2)
        half = -(-h * t * d // (8 // bits))
        codes = b[nk + nv :]
        ck = _unpack(codes[:half], bits, h * t * d).reshape(h, t, d)
        cv = _unpack(codes[half:], bits, h * t * d).reshape(h, t, d)
        return [("minmax", pk[..., 0], pk[..., 1], ck, g, 1), ("minmax", pv[..., 0], pv[..., 1], cv, g, 2)]
    if cid == fmt.CODEC_VEC_FP16:
        return [("plain", b.view("<f2").astype(np.float32).reshape(ext.shape))]
    rows, dim = ext.shape
    if cid == fmt.CODEC_VEC_INT8:
        p_ = b[: 8 * rows].view("<f4").reshape(rows, 2)
        return [("minmax", p_[:, :1], p_[:, 1:], b[8 * rows :].reshape(rows, dim), dim, 1)]
    if cid == fmt.CODEC_VEC_BINARY:
        m = b[: 4 * rows].view("<f4").reshape(rows, 1)
        bits_ = np.unpackbits(b[4 * rows :].reshape(rows, -1), axis=1, count=dim, bitorder="little")
        return [("sign", m, bits_)]
    raise CorruptionError(f"codec {codec.name!r} cannot decode")


def _assemble_numpy(parts: list[tuple[Any, ...]]) -> np.ndarray:
    out = []
    for kind, *a in parts:
        if kind == "scaled":
            out.append(a[0] * a[1])
        elif kind == "minmax":
            out.append(_minmax_decode(*a))
        elif kind == "plain":
            out.append(a[0])
        else:
            out.append(np.where(a[1] == 1, a[0], -a[0]).astype(np.float32))
    return np.stack(out) if len(out) == 2 else out[0]


def _assemble_torch(parts: list[tuple[Any, ...]], device: str) -> Any:
    """As ``_assemble_numpy``, with the arithmetic on ``device`` (the parts are copied there)."""
    import torch

    dev = torch.device(device)

    def t(a: np.ndarray) -> Any:
        a = np.ascontiguousarray(a)
        return torch.from_numpy(a if a.flags.writeable else a.copy()).to(dev)

    out = []
    for kind, *a in parts:
        if kind == "scaled":
            out.append(t(a[0]) * t(a[1]))
        elif kind == "minmax":
            lo, st, c, group, axis = t(a[0]), t(a[1]), t(a[2]).to(torch.float32), a[3], a[4]
            idx = torch.arange(c.shape[axis], device=dev) // group
            cm = c.movedim(axis, -1)
            out.append((lo[..., idx] + cm * st[..., idx]).movedim(-1, axis))
        elif kind == "plain":
            out.append(t(a[0]))
        else:
            m = t(a[0])
            out.append(torch.where(t(a[1]) == 1, m, -m))
    return torch.stack(out) if len(out) == 2 else out[0]


def decode_torch(codec: Codec, data: Any, ext: Extent, params: dict[str, Any], device: str) -> Any:
    """Decode one lossy extent with the arithmetic on ``device`` (torch): only the codes and
    scales cross to the device, where the values are computed and rounded to the stored
    dtype, bit for bit as ``decode`` does (one binary32 operation at a time, SPEC.md §6.1).
    Returns a tensor of the stored dtype shaped like the extent.  (kvq-ans entropy-decodes
    its symbols on the CPU first.)"""
    from .arrays import torch_dtype

    if codec.lossless:
        raise InvalidObject("decode_torch is for lossy array codecs")
    x = _assemble_torch(_lossy_parts(codec, data, ext, params), device)
    if x.numel() and not bool((x.abs().max() <= 66000).item()):
        raise CorruptionError(f"{codec.name} extent decodes to values out of range (a damaged scale)")
    return x.to(torch_dtype(ext.dtype))


def _checked_out(codec: Codec, x: np.ndarray, dtype: str) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        out_of_range = x.size and not (np.abs(x).max() <= 66000)  # NaN compares false
    if out_of_range:  # encoders take |x| <= 65504: anything else was damaged
        raise CorruptionError(f"{codec.name} extent decodes to values out of range (a damaged scale)")
    return from_float32(x, dtype)


# --- the registry ---------------------------------------------------------------------------------------

_ALL = [
    Codec(fmt.CODEC_RAW, "raw", True, ("kv", "vectors", "blob"), "exact", "1.0"),
    Codec(fmt.CODEC_ZSTD, "zstd", True, ("kv", "vectors", "blob"), "exact", "1.08 (fp16 KV)", {"level": 3}),
    Codec(fmt.CODEC_SHUFFLE_ZSTD, "shuffle+zstd", True, ("kv", "vectors"), "exact", "1.17 (fp16 KV)", {"level": 1}),
    Codec(fmt.CODEC_KV_INT8, "int8", False, ("kv",),
          "|x - x'| <= 0.5 * s + stored-dtype rounding; K: s = absmax / 127 per channel over the chunk's tokens "
          "(float16, rounded up); V: s <= 1.0906 * absmax / 127 per token (one-byte log scale, >= 2^-22.5)",
          "1.96 (head_dim 32), 1.99 (128)"),
    Codec(fmt.CODEC_KV_INT4, "int4", False, ("kv",),
          "|x - x'| <= 0.5 * s + stored-dtype rounding, s = (max - min) / 15 (float16, rounded up) per group of 32: "
          "K tokens of one channel, V dims of one token", "3.2", {"group": 32}),
    Codec(fmt.CODEC_KV_INT2, "int2", False, ("kv",),
          "|x - x'| <= 0.5 * s + stored-dtype rounding, s = (max - min) / 3 per group of 32 (as int4)", "5.3",
          {"group": 32}),
    Codec(fmt.CODEC_KV_FP8, "fp8", False, ("kv",),
          "|x - x'| <= |x| / 16 + s / 1024 + stored-dtype rounding, s = absmax / 448 (float16, rounded up) per K "
          "channel and per V token", "1.94"),
    Codec(fmt.CODEC_KV_ANS, "kvq-ans", False, ("kv",),
          "|x - x'| <= 0.5 * s + stored-dtype rounding; K: s = (max - min) / (B - 1) per channel over the chunk's "
          "tokens (float16: min rounded down, s up); V: s <= 1.0906 * absmax / (B/2 - 1) per token; B = bins of the "
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
_BY_NAME: dict[tuple[str, str], Codec] = {(c.name, k): c for c in _ALL for k in c.kinds}
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
    base = name
    if name.endswith("+zstd") and name != "shuffle+zstd":
        base = name[: -len("+zstd")]
    codec = _BY_NAME.get((base, kind))
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


def check_params(codec: Codec, params: Any) -> None:
    """Validate stored parameters (a decoded record): the names a codec knows, sane values."""
    if not isinstance(params, dict):
        raise CorruptionError("codec parameters are not a map")
    allowed = set(codec.defaults) | ({"zstd"} if codec.id in POST_ZSTD else set()) | \
        ({"dict"} if codec.id == fmt.CODEC_ZSTD else set())
    if set(params) - allowed:
        raise CorruptionError(f"unknown parameters {sorted(set(params) - allowed)} for codec {codec.name}")
    if "level" in params:
        _level(params)
    if "zstd" in params:
        _level(params, "zstd")
    if "group" in params:
        _group(params)
    if "dict" in params and (type(params["dict"]) is not int or not 1 <= params["dict"] < 1 << 32):
        raise CorruptionError(f"codec parameter 'dict' must be an int in 1..2^32-1, got {params['dict']!r}")
    if "bins" in params or codec.id == fmt.CODEC_KV_ANS:
        kvq_bins(params, 0)


# --- evaluation ------------------------------------------------------------------------------------------

def evaluate(spec: str, sample: Any, *, kind: str | None = None, queries: Any = None) -> dict[str, Any]:
    """Encode and decode ``sample`` (a KV chunk ``[layers, 2, H, T, D]`` or vectors ``[n, dim]``,
    numpy, float16/bfloat16/float32) with codec ``spec``: ratio to the raw bytes, encode and
    decode MB/s (of raw bytes, one thread), relative L2 error, max error over the declared
    bound, and for KV the attention-output error ``|softmax(QK^T/sqrt d)V - exact| / |exact|``
    (with ``queries`` ``[layers, H, T, D]``, else K as queries)."""
    arr = np.asarray(sample)
    kind = kind or ("kv" if arr.ndim == 5 else "vectors")
    choice = parse(spec, kind)
    dtype = {np.dtype("float16"): "float16", np.dtype("float32"): "float32",
             np.dtype("float64"): "float64"}.get(arr.dtype)
    if dtype is None:
        raise InvalidObject(f"evaluate takes float16/32/64 numpy samples, got {arr.dtype}")
    parts = [arr[i] for i in range(arr.shape[0])] if kind == "kv" else [arr]
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
