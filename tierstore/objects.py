"""The typed objects a store holds (KVCache, MLACache, Vectors, Blob) and ObjectInfo.

This module owns argument validation of objects: shapes, dtypes, ids and media types are
checked when an object is constructed, so a bad object never reaches the log.  Objects keep
a reference to the caller's array (no copy); the store reads it during ``put``.  It never does
I/O and never knows the on-disk layout (format/block.py maps objects to extents).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import arrays
from .errors import InvalidObject
from .format import constants as fmt


def _check_dims(shape: tuple[int, ...], what: str) -> None:
    if any(d == 0 for d in shape):
        raise InvalidObject(f"{what} is empty (shape {tuple(shape)}): there is nothing to store")


class KVCache:
    """A chunk of attention key/value cache.

    ``data`` is shaped ``[layers, 2, kv_heads, tokens, head_dim]`` (index 0 of dim 1 is K,
    1 is V), a numpy array or torch tensor of a floating dtype (float16, bfloat16, float32,
    float64, float8_e4m3fn, float8_e5m2).  ``layer_start`` is the model layer of ``data[0]``.
    ``KVCache.from_layers`` builds one from separate per-layer tensors without stacking them.
    """

    kind = "kv"
    __slots__ = ("_data", "pieces", "shape", "layer_start", "meta")

    def __init__(self, data: Any, *, layer_start: int = 0) -> None:
        name = arrays.dtype_name(data)
        if name not in fmt.FLOAT_DTYPES:
            raise InvalidObject(f"KVCache needs a floating dtype, got {name}")
        shape = tuple(int(d) for d in data.shape)
        if len(shape) != 5 or shape[1] != 2:
            why = f"it has {len(shape)} dimensions" if len(shape) != 5 else \
                f"dimension 1 is {shape[1]}, not 2 (K and V)"
            raise InvalidObject(
                f"KVCache data must be shaped [layers, 2, kv_heads, tokens, head_dim], got {list(shape)}: {why}",
                hint="stack K and V of each layer on dimension 1: np.stack([k, v], axis=1), "
                     "or pass the layers as they are to KVCache.from_layers")
        _check_dims(shape, "KVCache data")
        self.data = data
        self.layer_start = _layer_start(layer_start)
        self.meta: dict[str, Any] = {}  # the user metadata a get returns (put(meta=)); {} when none

    @classmethod
    def from_layers(cls, layers: Any, *, layer_start: int = 0) -> "KVCache":
        """A KVCache over per-layer tensors as a model keeps them, without stacking: ``layers``
        is a sequence with, per layer, either a pair ``(k, v)`` of arrays shaped
        ``[kv_heads, tokens, head_dim]`` or one array shaped ``[2, kv_heads, tokens, head_dim]``.
        All of one dtype, shape and framework.  ``put`` writes the pieces with one gathered
        write (no staging copy; a non-contiguous piece, e.g. a view into a paged cache, is made
        contiguous first); what is stored is the same as ``KVCache(stacked)``.  Reading
        ``.data`` stacks them (one copy)."""
        if isinstance(layers, (str, bytes)) or not hasattr(layers, "__len__") or not len(layers):
            raise InvalidObject("KVCache.from_layers takes a non-empty sequence of layers: (k, v) pairs or "
                                "[2, kv_heads, tokens, head_dim] arrays")
        pieces = []
        ref: tuple[str, tuple[int, ...], str] | None = None
        for i, layer in enumerate(layers):
            parts = tuple(layer) if isinstance(layer, (tuple, list)) else (layer,)
            if len(parts) == 2:
                want = 3
            elif len(parts) == 1:
                want = 4
            else:
                raise InvalidObject(f"layer {i}: expected (k, v) or one [2, kv_heads, tokens, head_dim] array, "
                                    f"got {len(parts)} items")
            for p in parts:
                if not hasattr(p, "shape") or not hasattr(p, "dtype"):
                    raise InvalidObject(f"layer {i}: expected numpy arrays or torch tensors, got {type(p).__name__}")
            shapes = {tuple(int(d) for d in p.shape) for p in parts}
            if len(shapes) != 1:
                raise InvalidObject(f"layer {i}: K and V have different shapes {sorted(shapes)}")
            shape = shapes.pop()
            if len(shape) != want or (want == 4 and shape[0] != 2):
                raise InvalidObject(f"layer {i}: shape {list(shape)}; expected "
                                    + ("[kv_heads, tokens, head_dim] for K and V" if want == 3
                                       else "[2, kv_heads, tokens, head_dim]"))
            layer_shape = shape if want == 4 else (2, *shape)
            names = {arrays.dtype_name(p) for p in parts}
            fws = {arrays.framework_of(p) for p in parts}
            if len(names) != 1 or len(fws) != 1:
                raise InvalidObject(f"layer {i}: K and V differ in dtype or framework ({sorted(names | fws)})")
            this = (names.pop(), layer_shape, fws.pop())
            if ref is None:
                ref = this
                if this[0] not in fmt.FLOAT_DTYPES:
                    raise InvalidObject(f"KVCache needs a floating dtype, got {this[0]}")
                _check_dims(layer_shape, "KVCache layer")
            elif this != ref:
                raise InvalidObject(f"layer {i} is {this[0]} {list(this[1])} ({this[2]}); layer 0 is "
                                    f"{ref[0]} {list(ref[1])} ({ref[2]}): every layer must match")
            pieces.append(parts)
        assert ref is not None
        obj = cls.__new__(cls)
        obj._data, obj.pieces = None, tuple(pieces)
        obj.shape = (len(pieces), *ref[1])
        obj.layer_start = _layer_start(layer_start)
        obj.meta = {}
        return obj

    @classmethod
    def over_layers(cls, pieces: tuple[tuple[Any, ...], ...], shape: tuple[int, ...]) -> "KVCache":
        """``from_layers`` for pieces the caller has already checked (same dtype, framework and
        shape; ``shape`` the stacked one): no checks, for hot read paths."""
        obj = cls.__new__(cls)
        obj._data, obj.pieces, obj.shape, obj.layer_start, obj.meta = None, pieces, shape, 0, {}
        return obj

    @property
    def data(self) -> Any:
        """The ``[layers, 2, kv_heads, tokens, head_dim]`` array (stacked on first use after
        ``from_layers``)."""
        if self._data is None:
            self._data = _stack_layers(self.pieces)
        return self._data

    @data.setter
    def data(self, value: Any) -> None:
        self._data, self.pieces = value, None
        self.shape = tuple(int(d) for d in value.shape)

    @property
    def num_layers(self) -> int:
        return int(self.shape[0])

    def __repr__(self) -> str:
        first = self._data if self._data is not None else self.pieces[0][0]
        return f"KVCache(shape={list(self.shape)}, dtype={arrays.dtype_name(first)}, layer_start={self.layer_start})"


def _layer_start(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise InvalidObject(f"layer_start must be a non-negative int, got {value!r}")
    return int(value)


def _stack_layers(pieces: Any) -> Any:
    """[layers, 2, ...] from per-layer (k, v) pairs or [2, ...] arrays (one copy)."""
    first = pieces[0][0]
    if arrays.is_torch_tensor(first):
        torch = arrays.torch_module()
        return torch.stack([torch.stack(p) if len(p) == 2 else p[0] for p in pieces])
    return np.stack([np.stack(p) if len(p) == 2 else p[0] for p in pieces])


class MLACache:
    """A chunk of a latent attention cache (multi-head latent attention, DeepSeek-V2/V3): one
    vector per token and layer instead of K and V per head.

    ``data`` is shaped ``[layers, tokens, dim]`` (``dim`` = ``kv_lora_rank + rope_dim``, e.g.
    512 + 64), a numpy array or torch tensor of a floating dtype.  ``layer_start`` is the model
    layer of ``data[0]``.  Stored with one extent per layer (SPEC.md §5.3, format 1.4), so
    ``get(layers=...)`` and ``stream_layers`` read only the layers asked for; codecs: zstd,
    shuffle+zstd, and the lossy int8 and fp8 (per token scales, §6.3).
    """

    kind = "mla"
    __slots__ = ("data", "layer_start", "meta")

    def __init__(self, data: Any, *, layer_start: int = 0) -> None:
        name = arrays.dtype_name(data)
        if name not in fmt.FLOAT_DTYPES:
            raise InvalidObject(f"MLACache needs a floating dtype, got {name}")
        shape = tuple(int(d) for d in data.shape)
        if len(shape) != 3:
            raise InvalidObject(f"MLACache data must be shaped [layers, tokens, dim], got {list(shape)}",
                                hint="a model's per-layer latent caches [tokens, dim] stacked on a new first dimension")
        _check_dims(shape, "MLACache data")
        self.data = data
        self.layer_start = _layer_start(layer_start)
        self.meta: dict[str, Any] = {}

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.data.shape)

    @property
    def num_layers(self) -> int:
        return int(self.data.shape[0])

    def __repr__(self) -> str:
        return (f"MLACache(shape={list(self.shape)}, dtype={arrays.dtype_name(self.data)}, "
                f"layer_start={self.layer_start})")


def stored_mla(data: Any, layer_start: int) -> MLACache:
    """An MLACache read back (shape and dtype from checked metadata: no validation)."""
    obj = MLACache.__new__(MLACache)
    obj.data, obj.layer_start, obj.meta = data, layer_start, {}
    return obj


class Vectors:
    """A shard of embedding vectors: ``data`` ``[n, dim]`` with optional int64 ``ids`` ``[n]``.

    ``metric`` is one of "cosine", "l2", "ip" (recorded for readers; not enforced on data).
    """

    kind = "vectors"
    __slots__ = ("data", "ids", "metric", "meta")

    def __init__(self, data: Any, *, ids: Any = None, metric: str = "cosine") -> None:
        try:
            name = arrays.dtype_name(data)
        except InvalidObject as e:  # (not the list of every kind's dtypes: int16-64 are not vectors')
            if not e.message.startswith("unsupported dtype"):
                raise
            name = str(getattr(data, "dtype", type(data).__name__)).removeprefix("torch.")
        if name not in fmt.VECTOR_DTYPES:
            raise InvalidObject(f"Vectors need a floating or int8/uint8 dtype, got {name}",
                                hint=f"supported for vectors: {', '.join(sorted(fmt.VECTOR_DTYPES))}")
        shape = tuple(int(d) for d in data.shape)
        if len(shape) != 2:
            raise InvalidObject(f"Vectors data must be shaped [n, dim], got {list(shape)}")
        _check_dims(shape, "Vectors data")
        if metric not in fmt.METRICS:
            raise InvalidObject(f"metric must be one of {', '.join(fmt.METRICS)}, got {metric!r}")
        if ids is not None:
            ids = _as_ids(ids, shape[0])
        self.data = data
        self.ids = ids
        self.metric = metric
        self.meta: dict[str, Any] = {}

    def __len__(self) -> int:
        return int(self.data.shape[0])

    def __repr__(self) -> str:
        return (
            f"Vectors(shape={list(self.data.shape)}, dtype={arrays.dtype_name(self.data)}, "
            f"ids={'yes' if self.ids is not None else 'no'}, metric={self.metric!r})"
        )


def _as_ids(ids: Any, n: int) -> Any:
    """Validate ids: integers, shape [n]; returned as int64 (numpy or torch as given)."""
    if arrays.is_torch_tensor(ids):
        torch = arrays.torch_module()
        if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.dtype.is_complex:
            raise InvalidObject(f"ids must be integers, got {ids.dtype}")
        if tuple(ids.shape) != (n,):
            raise InvalidObject(f"ids must be shaped [{n}], got {list(ids.shape)}")
        out = ids.to(torch.int64)
        if ids.dtype == getattr(torch, "uint64", None) and n and bool((out < 0).any()):  # (it wraps)
            raise InvalidObject("ids do not fit in int64")
        return out
    if isinstance(ids, (list, tuple)) and any(type(i) is int and not -(1 << 63) <= i < (1 << 63) for i in ids):
        raise InvalidObject("ids do not fit in int64")  # (numpy would make them float64 or uint64)
    arr = np.asarray(ids)
    if arr.dtype.kind not in "iu":
        raise InvalidObject(f"ids must be integers, got {arr.dtype}")
    if arr.shape != (n,):
        raise InvalidObject(f"ids must be shaped [{n}], got {list(arr.shape)}")
    if arr.dtype == np.uint64 and n and int(arr.max()) > np.iinfo(np.int64).max:
        raise InvalidObject("ids do not fit in int64")
    return arr.astype("<i8", copy=False)


def stored_kv(data: Any, layer_start: int) -> KVCache:
    """A KVCache read back: its shape and dtype come from checked metadata, so the
    constructor's validation is skipped (it costs more than a hit's copy of a layer)."""
    obj = KVCache.__new__(KVCache)
    obj._data, obj.pieces, obj.shape, obj.layer_start, obj.meta = data, None, tuple(data.shape), layer_start, {}
    return obj


class Blob:
    """Opaque bytes with a media type (e.g. "image/png")."""

    kind = "blob"
    __slots__ = ("data", "media_type", "meta")

    def __init__(self, data: bytes | bytearray | memoryview, *, media_type: str = "application/octet-stream") -> None:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidObject(f"Blob data must be bytes, bytearray or memoryview, got {type(data).__name__}")
        if isinstance(data, memoryview) and not data.c_contiguous:
            raise InvalidObject("Blob memoryview must be C-contiguous")
        if not isinstance(media_type, str) or not media_type or len(media_type.encode()) > 255 or "\x00" in media_type:
            raise InvalidObject(f"media_type must be a non-empty str of at most 255 bytes, got {media_type!r}")
        self.data = data
        self.media_type = media_type
        self.meta: dict[str, Any] = {}

    def __len__(self) -> int:
        return memoryview(self.data).nbytes

    def __repr__(self) -> str:
        return f"Blob({len(self)} bytes, media_type={self.media_type!r})"


@dataclass(frozen=True)
class ObjectInfo:
    """What the store knows about one stored object (``Store.info``)."""

    namespace: str
    key: str | bytes
    kind: str  # "kv" | "mla" | "vectors" | "blob"
    shape: tuple[int, ...]  # () for blobs
    dtype: str | None  # None for blobs
    logical_bytes: int  # bytes of the decoded object (array bytes; ids included for vectors)
    stored_bytes: int  # bytes the object occupies in its segment (header, padding, extents)
    codec: str  # name and parameters, e.g. "raw", "int8+zstd", "int4:group=32"
    lossless: bool
    bound: str  # the codec's declared error bound ("exact" for lossless codecs)
    checksum: str  # "crc32c:<hex>" over the record header, which holds every extent's crc32c
    extent_checksums: tuple[int, ...] = field(repr=False)  # one per extent: hundreds for a large object
    tiers: tuple[str, ...]
    lsn: int
    segment: int
    offset: int
    layer_start: int | None = None
    metric: str | None = None
    media_type: str | None = None
    has_ids: bool | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    sessions: tuple[str, ...] = ()  # sessions holding a reference on it (SPEC.md §5.4)


def stored_blob(data: bytes, media_type: str) -> Blob:
    """A Blob read back from a verified record (its fields were validated when it was put)."""
    b = Blob.__new__(Blob)
    b.data, b.media_type, b.meta = data, media_type, {}
    return b
