"""Typed objects <-> blocks: which bytes go in which extent (SPEC.md §5.3), and back.

``encode_block`` turns a KVCache / Vectors / Blob into metadata plus zero-copy views of its
extents: one extent per KV layer, one per row range of vectors (and of their ids), one per
blob.  ``read_object`` plans which extents a (partial) get needs, has the caller's reader
fill preallocated buffers, and wraps them as arrays without copying.

This module does no I/O: reading is delegated to an ``ExtentReader``.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np

try:
    from numpy.lib.array_utils import byte_bounds
except ImportError:  # numpy < 2
    byte_bounds = np.byte_bounds

from .. import arrays, buffers
from .. import codecs as cdc
from ..buffers import aligned_empty
from ..errors import CorruptionError, InvalidObject
from ..objects import Blob, KVCache, MLACache, Vectors, stored_blob, stored_kv, stored_mla
from . import constants as fmt
from . import record as rec
from .layout import extent_codec, extent_shapes


class Block(NamedTuple):
    kind: int
    meta: dict[str, Any]
    extents: tuple[memoryview, ...]
    align_log2: int
    logical_bytes: int
    keepalive: Any  # the arrays the extent views point into
    codec: int = fmt.CODEC_RAW


def _mv(a: np.ndarray) -> memoryview:
    return memoryview(a).cast("B") if a.ndim else memoryview(a.reshape(1)).cast("B")


def encode_block(obj: Any, user_meta: dict[str, Any] | None, *, vector_extent_bytes: int) -> Block:
    """Describe ``obj`` as metadata and extent views (no copy of C-contiguous CPU data)."""
    meta: dict[str, Any]
    if type(obj) is Blob:  # the common small-object case first
        view = memoryview(obj.data).cast("B")
        meta = {"size": view.nbytes, "media_type": obj.media_type}
        if user_meta:
            meta["meta"] = user_meta
        align = fmt.ALIGN_INLINE_LOG2 if view.nbytes < fmt.INLINE_BLOB_MAX else fmt.ALIGN_PAGE_LOG2
        return Block(fmt.KIND_BLOB, meta, (view,), align, view.nbytes, obj.data)
    if isinstance(obj, KVCache) and obj.pieces is not None:  # KVCache.from_layers: an extent of pieces per layer
        parts = [[arrays.as_bytes_view(p) for p in layer] for layer in obj.pieces]
        first = obj.pieces[0][0]
        meta = {"dtype": fmt.DTYPE_IDS[arrays.dtype_name(first)], "shape": list(obj.shape),
                "layer_start": obj.layer_start, "fw": arrays.framework_of(first)}
        extents = tuple(rec.Pieces(_mv(p) for p in layer) if len(layer) > 1 else _mv(layer[0]) for layer in parts)
        kind, align, keep = fmt.KIND_KV, fmt.ALIGN_PAGE_LOG2, parts
        logical = sum(e.nbytes for e in extents)
    elif isinstance(obj, KVCache):
        arr = arrays.as_bytes_view(obj.data)
        name = arrays.dtype_name(obj.data)
        meta = {"dtype": fmt.DTYPE_IDS[name], "shape": list(arr.shape), "layer_start": obj.layer_start,
                "fw": arrays.framework_of(obj.data)}
        extents = tuple(_mv(arr[i]) for i in range(arr.shape[0]))
        kind, align, keep, logical = fmt.KIND_KV, fmt.ALIGN_PAGE_LOG2, arr, arr.nbytes
    elif isinstance(obj, MLACache):
        arr = arrays.as_bytes_view(obj.data)
        meta = {"dtype": fmt.DTYPE_IDS[arrays.dtype_name(obj.data)], "shape": list(arr.shape),
                "layer_start": obj.layer_start, "fw": arrays.framework_of(obj.data)}
        extents = tuple(_mv(arr[i]) for i in range(arr.shape[0]))
        kind, align, keep, logical = fmt.KIND_MLA, fmt.ALIGN_PAGE_LOG2, arr, arr.nbytes
    elif isinstance(obj, Vectors):
        arr = arrays.as_bytes_view(obj.data)
        name = arrays.dtype_name(obj.data)
        n, dim = arr.shape
        rpe = max(1, vector_extent_bytes // max(1, dim * arr.itemsize))
        meta = {"dtype": fmt.DTYPE_IDS[name], "shape": [n, dim], "metric": obj.metric, "rows_per_extent": rpe,
                "ids": obj.ids is not None, "fw": arrays.framework_of(obj.data)}
        exts = [_mv(arr[i : i + rpe]) for i in range(0, n, rpe)]
        keep: Any = arr
        logical = arr.nbytes
        if obj.ids is not None:
            ids = arrays.as_bytes_view(obj.ids)
            exts += [_mv(ids[i : i + rpe]) for i in range(0, n, rpe)]
            keep = (arr, ids)
            logical += ids.nbytes
        extents = tuple(exts)
        kind, align = fmt.KIND_VECTORS, fmt.ALIGN_PAGE_LOG2
    elif isinstance(obj, Blob):
        view = memoryview(obj.data).cast("B")
        meta = {"size": view.nbytes, "media_type": obj.media_type}
        extents = (view,)
        kind, keep, logical = fmt.KIND_BLOB, obj.data, view.nbytes
        align = fmt.ALIGN_INLINE_LOG2 if view.nbytes < fmt.INLINE_BLOB_MAX else fmt.ALIGN_PAGE_LOG2
    else:
        raise InvalidObject(f"expected a KVCache, MLACache, Vectors or Blob, got {type(obj).__name__}",
                            hint="wrap arrays as tierstore.KVCache(kv) / tierstore.Vectors(emb) / tierstore.Blob(b)")
    if kind in fmt.LAYERED_KINDS and meta["layer_start"] + meta["shape"][0] > fmt.LAYER_ID_LIMIT:
        raise InvalidObject(f"layer ids past 2^63 - 1: layer_start {meta['layer_start']} and "
                            f"{meta['shape'][0]} layers (SPEC.md §5.2)")
    if user_meta:
        meta["meta"] = user_meta
    return Block(kind, meta, extents, align, logical, keep)


def apply_codec(block: Block, choice: cdc.Choice | None, dictionary: bytes | None = None,
                between: Callable[[], None] | None = None) -> Block:
    """Encode the extents of ``block`` with ``choice`` (None or raw: the block as it is).

    A blob whose media type is already compressed stays raw whatever the choice.
    ``dictionary``: the zstd dictionary a ``zstd:dict=N`` choice names.  ``between``: called
    before each extent is encoded; what it raises stops the encoding (the SSD budget's
    down-tiering gives way to a put that waits).
    """
    if choice is None or choice.codec.id == fmt.CODEC_RAW:
        return block
    kind = fmt.KIND_NAMES[block.kind]
    if kind not in choice.codec.kinds:
        raise InvalidObject(f"codec {choice.codec.name!r} does not apply to {kind}")
    if block.kind == fmt.KIND_BLOB and block.meta["media_type"].startswith(cdc.COMPRESSED_MEDIA):
        return block
    if not choice.codec.lossless and fmt.DTYPES[block.meta["dtype"]][0] not in cdc.LOSSY_DTYPES:
        raise InvalidObject(f"lossy codec {choice.codec.name!r} takes float16/bfloat16/float32/float64 data, "
                            f"not {fmt.DTYPES[block.meta['dtype']][0]}", hint="use zstd or shuffle+zstd")
    exts = extent_shapes(block.kind, block.meta)

    def encode(v: Any, e: Any) -> memoryview:
        if between is not None:
            between()
        return memoryview(cdc.encode(extent_codec(choice.codec, e),
                                     np.frombuffer(v.tobytes() if type(v) is rec.Pieces else v, np.uint8), e,
                                     choice.params, dictionary))

    encoded = tuple(encode(v, e) for v, e in zip(block.extents, exts))
    meta = dict(block.meta)
    if choice.params:
        meta["codec_params"] = dict(choice.params)
    align = block.align_log2 if block.kind != fmt.KIND_BLOB or encoded[0].nbytes >= fmt.INLINE_BLOB_MAX \
        else fmt.ALIGN_INLINE_LOG2
    return Block(block.kind, meta, encoded, align, block.logical_bytes, encoded, choice.codec.id)


class ExtentReader(Protocol):
    def read_into(self, wanted: Sequence[tuple[int, memoryview]]) -> None:
        """Fill each destination with extent ``index``'s bytes, checksums verified."""

    def read_bytes(self, index: int) -> bytes:
        """One extent as bytes, checksum verified."""

    # optional: ``extent_view(index) -> np.ndarray`` (uint8, checksum verified), the extent as the
    # reader already holds it in memory; reads into per-layer destinations copy straight from it


def _dtype_name(meta: dict[str, Any]) -> str:
    return fmt.DTYPES[meta["dtype"]][0]


def _shown(values: Any, limit: int = 8) -> str:
    """A list for an error message: at most ``limit`` values, then how many more."""
    values = list(values)
    head = ", ".join(str(v) for v in values[:limit])
    return f"[{head}{f', ... ({len(values) - limit} more)' if len(values) > limit else ''}]"


def select_layers(layers: Any, start: int, count: int) -> list[int]:
    """Absolute layer ids -> positions in the stored chunk; a contiguous ascending run."""
    if isinstance(layers, (int, np.integer)) and not isinstance(layers, bool):
        sel = [int(layers)]
    elif isinstance(layers, slice):
        if layers.step == 0:
            raise InvalidObject("layers: a slice step cannot be zero")
        for bound in (layers.start, layers.stop, layers.step):
            if bound is not None and (isinstance(bound, bool) or not isinstance(bound, (int, np.integer))):
                raise InvalidObject(f"layers: a slice's bounds are ints, got {layers!r}")
        # absolute ids; an open start is the first stored layer (negative bounds count from the end);
        # a range, sliced arithmetically: no list of every id below the object's (ids reach 2^63)
        lo = layers.start if layers.start is not None or (layers.step or 1) < 0 else start
        ids = range(start + count)[slice(lo, layers.stop, layers.step)]
        asc = ids if ids.step > 0 else ids[::-1]
        below = asc[: max(0, -(-(start - asc.start) // asc.step))]  # (the ids under start: none past the end)
        if below:
            n = (below.stop - below.start + below.step - 1) // below.step  # (len() overflows past 2^63)
            raise InvalidObject(f"layers [{', '.join(map(str, below[:8]))}{f', ... ({n - 8} more)' if n > 8 else ''}]"
                                f" outside the stored layers [{start}, {start + count})")
        sel = list(ids)
    else:
        if isinstance(layers, (str, bytes)) or not hasattr(layers, "__iter__"):
            raise InvalidObject(f"layers must be an int, a range, a slice or a sequence of ints, got {layers!r}")
        if hasattr(layers, "__len__") and len(layers) > count:
            raise InvalidObject(f"layers selects {len(layers)} layers; the object holds {count} "
                                f"([{start}, {start + count}))")
        try:  # (operator.index: 1.5 or True is not a layer id; int() read 1.5 as layer 1)
            sel = [operator.index(x) if not isinstance(x, bool) else operator.index(None) for x in layers]
        except (TypeError, ValueError):
            raise InvalidObject(f"layers must be an int, a range, a slice or a sequence of ints, "
                                f"got {layers!r}") from None
    if not sel:
        raise InvalidObject("layers selects no layer")
    bad = [x for x in sel if not start <= x < start + count]
    if bad:
        raise InvalidObject(f"layers {_shown(bad)} outside the stored layers [{start}, {start + count})")
    if any(b != a + 1 for a, b in zip(sel, sel[1:])):
        raise InvalidObject(f"layers must be a contiguous ascending run, got {_shown(sel)}",
                            hint="call get() once per run of layers")
    return [x - start for x in sel]


def select_rows(rows: Any, n: int) -> np.ndarray:
    """Row selectors (an int, a sequence of ints, negative from the end, or a slice) -> row
    numbers; an empty selection is allowed (it reads nothing and returns zero rows)."""
    if isinstance(rows, slice):
        if rows.step == 0:
            raise InvalidObject("rows: a slice step cannot be zero")
        return np.arange(n, dtype=np.int64)[rows]
    if isinstance(rows, (int, np.integer)) and not isinstance(rows, bool):
        rows = [rows]
    if isinstance(rows, (str, bytes)):
        raise InvalidObject(f"rows must be a slice or a sequence of ints, got {rows!r}")
    try:
        arr = np.asarray(rows)
    except (TypeError, ValueError):
        raise InvalidObject(f"rows must be a slice or a sequence of ints, got {rows!r}") from None
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise InvalidObject(f"rows must be a slice or a 1-d sequence of ints, got {rows!r}"[:300])
    arr = arr.astype(np.int64)
    arr = np.where(arr < 0, arr + n, arr)
    if arr.size and (arr.min() < 0 or arr.max() >= n):
        bad = arr[(arr < 0) | (arr >= n)]
        raise InvalidObject(f"rows {_shown(bad)} out of range for {n} vectors")
    return arr


class _Decoding:
    """An ExtentReader that reads encoded extents and decodes them into the destinations."""

    def __init__(self, hdr: rec.RecordHeader, reader: ExtentReader,
                 dictionaries: Callable[[int], bytes] | None) -> None:
        self.reader = reader
        self.codec = cdc.BY_ID[hdr.codec]
        self.params = hdr.meta.get("codec_params", {})
        self.exts = extent_shapes(hdr.kind, hdr.meta)
        did = self.params.get("dict")
        if did is not None and dictionaries is None:
            raise CorruptionError(f"record needs zstd dictionary {did} and none can be looked up")
        self.dictionary = dictionaries(did) if did is not None and dictionaries is not None else None

    def read_into(self, wanted: Sequence[tuple[int, memoryview]]) -> None:
        for i, dest in wanted:
            out = self.read_array(i)
            if out.nbytes != dest.nbytes:
                raise CorruptionError(f"extent {i} decodes to {out.nbytes} bytes, expected {dest.nbytes}")
            dest[:] = memoryview(out).cast("B")

    def extent_view(self, i: int) -> np.ndarray:
        """Extent ``i`` decoded, as its bytes (a new array)."""
        return self.read_array(i).reshape(-1).view(np.uint8)

    def read_array(self, i: int) -> np.ndarray:
        ext = self.exts[i]
        return cdc.decode(extent_codec(self.codec, ext), self.reader.read_bytes(i), ext, self.params, self.dictionary)

    def read_bytes(self, index: int) -> bytes:
        return self.read_array(index).tobytes()

    def read_tensor(self, i: int, device: str) -> Any:
        """Extent ``i`` decoded with torch on ``device`` (lossy codecs: SPEC.md §6, bit for bit)."""
        ext = self.exts[i]
        return cdc.decode_torch(self.codec, self.reader.read_bytes(i), ext, self.params, device)


def read_on_device(hdr: rec.RecordHeader, reader: _Decoding, device: str, layers: Any, rows: Any) -> Any:
    """A lossy object headed for ``device``: codes and scales go there, values are computed
    there (the CPU never materialises the decoded array)."""
    torch = arrays.torch_module()
    meta = hdr.meta
    if hdr.kind in fmt.LAYERED_KINDS:
        if rows is not None:
            raise InvalidObject("rows= applies to Vectors; use layers= for a KVCache or an MLACache")
        count = meta["shape"][0]
        idx = list(range(count)) if layers is None else select_layers(layers, meta["layer_start"], count)
        data = torch.stack([reader.read_tensor(i, device) for i in idx])
        return (stored_kv if hdr.kind == fmt.KIND_KV else stored_mla)(data, meta["layer_start"] + idx[0])
    if layers is not None:
        raise InvalidObject("layers= applies to a KVCache or an MLACache; use rows= for Vectors")
    n, dim = meta["shape"]
    rpe, n_ext = meta["rows_per_extent"], -(-n // meta["rows_per_extent"])
    sel = None if rows is None else select_rows(rows, n)
    wanted = range(n_ext) if sel is None else sorted({int(e) for e in sel // rpe})
    parts = {e: reader.read_tensor(e, device) for e in wanted}
    ids = None
    if meta["ids"]:
        id_parts = {e: torch.from_numpy(np.frombuffer(reader.read_bytes(n_ext + e), "<i8").copy()) for e in wanted}
    if sel is None:
        data = torch.cat([parts[e] for e in range(n_ext)])
        if meta["ids"]:
            ids = torch.cat([id_parts[e] for e in range(n_ext)]).to(device)
    else:
        order = {e: j for j, e in enumerate(wanted)}
        flat = torch.from_numpy(np.array([order[int(e)] for e in sel // rpe], dtype=np.int64) * rpe + sel % rpe)
        stacked = torch.cat([torch.nn.functional.pad(parts[e], (0, 0, 0, rpe - parts[e].shape[0])) for e in wanted])
        data = stacked[flat.to(stacked.device)]
        if meta["ids"]:
            id_stack = torch.cat([torch.nn.functional.pad(id_parts[e], (0, rpe - id_parts[e].shape[0]))
                                  for e in wanted])
            ids = id_stack[flat].to(device)
    v = Vectors.__new__(Vectors)
    v.data, v.ids, v.metric, v.meta = data, ids, meta["metric"], {}
    return v


def result_shape(hdr: rec.RecordHeader, layers: Any, rows: Any) -> tuple[str, tuple[int, ...]]:
    """(dtype name, shape) of the array a read of ``hdr`` (with ``layers`` / ``rows``) returns:
    what ``get(out=...)`` must match, checked before any I/O."""
    meta = hdr.meta
    if hdr.kind in fmt.LAYERED_KINDS:
        if rows is not None:
            raise InvalidObject("rows= applies to Vectors; use layers= for a KVCache or an MLACache")
        count = meta["shape"][0]
        n = count if layers is None else len(select_layers(layers, meta["layer_start"], count))
        return _dtype_name(meta), (n, *meta["shape"][1:])
    if hdr.kind == fmt.KIND_VECTORS:
        if layers is not None:
            raise InvalidObject("layers= applies to a KVCache or an MLACache; use rows= for Vectors")
        n, dim = meta["shape"]
        return _dtype_name(meta), (n if rows is None else len(select_rows(rows, n)), dim)
    raise InvalidObject(f"out= applies to a KVCache or Vectors, not a {fmt.KIND_NAMES.get(hdr.kind, hdr.kind)}",
                        hint="a Blob's bytes come back as bytes")


class LayerDest(NamedTuple):
    """Per-layer destinations of a read (``layer_destination``): the KVCache over them that the
    read returns, per layer the (K, V) numpy views of host pieces (None for CUDA ones), and the
    pieces' memory as (first byte, end, host view or None, layer)."""

    kv: KVCache
    views: list[tuple[Any, Any]]
    spans: list[tuple[int, int, Any, int]]


def layer_destination(hdr: rec.RecordHeader, layers: Any, out: Any) -> LayerDest:
    """``get(out=[...])`` with per-layer destinations, checked before any I/O: ``out`` is a
    sequence with, per layer read, a pair ``(k, v)`` shaped ``[kv_heads, tokens, head_dim]`` or
    one array shaped ``[2, kv_heads, tokens, head_dim]`` (what ``KVCache.from_layers`` takes),
    of the stored dtype, writable, any strides (views into a model's cache or a paged pool).
    Returns them as a ``LayerDest``, which ``read_object`` fills."""
    if hdr.kind != fmt.KIND_KV:
        kind = fmt.KIND_NAMES.get(hdr.kind, hdr.kind)
        raise InvalidObject(f"out= as per-layer pieces applies to a KVCache; this object is of kind {kind!r}",
                            hint="out= takes one array for Vectors and MLA caches; a blob comes back as bytes")
    name, shape = result_shape(hdr, layers, None)
    layer_shape = tuple(shape[1:])
    form = (f"per layer, a (k, v) pair of {list(layer_shape[1:])} arrays or one {list(layer_shape)} array, "
            f"dtype {name}")
    if not len(out):
        raise InvalidObject(f"out= is an empty list; this read returns {shape[0]} layers", hint=form)
    if len(out) != shape[0]:
        raise InvalidObject(f"out= holds {len(out)} layers; this read returns {shape[0]} layers of "
                            f"{list(layer_shape)}", hint="info(key).shape is the stored shape; layers= selects part "
                                                         "of it")
    fast = _host_destination(out, layer_shape, name)
    if fast is not None:
        return fast
    for i, layer in enumerate(out):  # each piece against what is stored, before the pieces against each other
        parts = tuple(layer) if isinstance(layer, (tuple, list)) else (layer,)
        want = layer_shape[1:] if len(parts) == 2 else layer_shape
        for which, p in zip(("K", "V") if len(parts) == 2 else ("the array",), parts):
            if not hasattr(p, "shape") or not hasattr(p, "dtype"):
                continue  # (from_layers names it)
            got = arrays.dtype_name(p)
            if tuple(int(d) for d in p.shape) != want or got != name:
                raise InvalidObject(f"out= layer {i}: {which} is {got} {list(p.shape)}; this read needs {name} "
                                    f"{list(want)}", hint=form + " (info(key) has the stored shape and dtype)")
    dest = KVCache.from_layers(out)
    spans = []  # (first byte, end, the piece's host view or None, layer) of every piece
    views = []  # per layer: (K, V) host views
    for i, layer in enumerate(dest.pieces):
        mine = []
        for p in layer:
            if arrays.is_torch_tensor(p):
                import torch

                if p.layout != torch.strided or p.device.type not in ("cpu", "cuda"):
                    raise InvalidObject(f"out= layer {i} is a {p.layout} tensor on {p.device}: tierstore fills "
                                        "dense tensors in CPU, pinned or CUDA memory")
                unwritable, strides = p.requires_grad, p.stride()
            else:
                unwritable, strides = not p.flags.writeable, p.strides
            if unwritable:
                raise InvalidObject(f"out= layer {i} is not writable (a read-only array, or a tensor that "
                                    "requires grad)")
            if any(st == 0 and n > 1 for st, n in zip(strides, p.shape)):
                raise InvalidObject(f"out= layer {i} repeats memory (a stride of 0, e.g. an expanded tensor): "
                                    "it cannot hold distinct values")
            lo, hi = _bounds(p)
            mine.append(arrays.host_view(p))
            spans.append((lo, hi, mine[-1] if mine[-1] is not None else _DeviceLayout.of(p), i))
        if len(mine) == 1:  # one [2, ...] piece: its two halves
            mine = [None, None] if mine[0] is None else [mine[0][0], mine[0][1]]
        views.append((mine[0], mine[1]))
    _check_disjoint(spans)
    return LayerDest(dest, views, spans)


def _host_destination(out: Any, layer_shape: tuple[int, ...], name: str) -> LayerDest | None:
    """``layer_destination``'s common case, checked at a few microseconds a piece: every piece a
    host array of the right shape and dtype (all numpy, or all CPU torch tensors), writable, no
    repeated memory.  None for anything else: the general checks then run, and name what is
    wrong."""
    torch: Any = None  # imported when a piece is not a numpy array (numpy-only callers never load it)
    pair, whole = layer_shape[1:], layer_shape
    first = None
    views: list[tuple[Any, Any]] = []
    pieces = []
    spans = []
    for i, layer in enumerate(out):
        parts = tuple(layer) if type(layer) in (tuple, list) else (layer,)
        if not parts or len(parts) > 2:
            return None
        shape = pair if len(parts) == 2 else whole
        mine = []
        for p in parts:
            cls = type(p)
            if first is None:
                first = cls
            elif cls is not first:
                return None  # (mixed frameworks: from_layers says so)
            if cls is np.ndarray:
                if p.dtype.name != name or p.dtype.byteorder == ">" or p.shape != shape or not p.flags.writeable \
                        or 0 in p.strides:
                    return None
                v = p
                lo, hi = _bounds(p)
            elif arrays.is_torch_tensor(p):
                if torch is None:
                    torch = arrays.torch_module()
                    want_dtype = arrays.torch_dtype(name)
                    same = None if name in arrays.NUMPY_NATIVE else \
                        (torch.int16 if fmt.DTYPES[fmt.DTYPE_IDS[name]][1] == 2 else torch.uint8)  # bfloat16, fp8
                if p.dtype != want_dtype or p.requires_grad or not p.is_cpu or p.layout != torch.strided \
                        or p.shape != shape:
                    return None
                strides = p.stride()
                if 0 in strides:
                    return None
                lo, hi = _bounds(p)
                v = (p if same is None else p.view(same)).numpy()
            else:
                return None
            spans.append((lo, hi, v, i))
            mine.append(v)
        pieces.append(parts)
        views.append((mine[0], mine[1]) if len(mine) == 2 else (mine[0][0], mine[0][1]))
    _check_disjoint(spans)
    return LayerDest(KVCache.over_layers(tuple(pieces), (len(pieces), *whole)), views, spans)


def _bounds(p: Any) -> tuple[int, int]:
    """The first byte of a numpy array or torch tensor (CPU or CUDA) and the end of its last."""
    if not arrays.is_torch_tensor(p):
        return byte_bounds(p)
    size, start = p.element_size(), p.data_ptr()
    strides = p.stride()
    lo = start + sum(st * (n - 1) for st, n in zip(strides, p.shape) if st < 0) * size
    return lo, start + sum(st * (n - 1) for st, n in zip(strides, p.shape) if st > 0) * size + size


@dataclasses.dataclass(frozen=True)
class _DeviceLayout:
    """The layout of a piece in GPU memory (no numpy view of it exists), for ``_shared_runs``:
    its shape, its strides in bytes and its element size."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int

    @classmethod
    def of(cls, t: Any) -> _DeviceLayout:
        size = t.element_size()
        return cls(tuple(int(n) for n in t.shape), tuple(int(st) * size for st in t.stride()), size)


def _shares(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays share memory (exactly; a case too costly to decide counts as shared)."""
    try:
        return bool(np.shares_memory(a, b, max_work=1 << 20))
    except getattr(np, "exceptions", np).TooHardError:
        return True


RUNS_MAX = 256  # contiguous runs of one host piece that _shared_runs lists; more: compared pair by pair


def _run_offsets(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> tuple[np.ndarray, int] | None:
    """A piece of this layout as contiguous runs of bytes: (their offsets from its first
    element, their length), or None when it has more than ``RUNS_MAX`` runs or a negative
    stride."""
    dims = [(n, st) for n, st in zip(shape, strides) if n != 1]
    run = itemsize
    while dims and dims[-1][1] == run:
        run *= dims[-1][0]
        dims.pop()
    if any(st < 0 for _, st in dims) or math.prod(n for n, _ in dims) > RUNS_MAX:
        return None
    offsets = np.zeros(1, dtype=np.int64)
    for n, st in dims:
        offsets = (offsets[:, None] + np.arange(n, dtype=np.int64) * st).ravel()
    return offsets, run


def _shared_runs(spans: list[tuple[int, int, Any, Any]]) -> tuple[Any, Any] | None | bool:
    """``_first_shared`` for host pieces of few runs each (views into a model's cache, LMCache's
    slabs): every run of every piece sorted once, and two that overlap are shared memory
    (exact: a run's bytes all belong to its piece).  Pieces of one layout are expanded to runs
    together.  False when a piece is not of that kind."""
    layouts: dict[tuple[Any, ...], list[int]] = {}
    for j, (_, _, view, _) in enumerate(spans):
        if view is None:
            return False
        layouts.setdefault((view.shape, view.strides, view.itemsize), []).append(j)
    firsts, ends, owner = [], [], []
    for (shape, strides, itemsize), js in layouts.items():
        runs = _run_offsets(shape, strides, itemsize)
        if runs is None:
            return False
        offsets, length = runs
        bases = np.array([spans[j][0] for j in js], dtype=np.int64)  # (no negative stride: lo is the first element)
        starts = (bases[:, None] + offsets[None, :]).ravel()
        firsts.append(starts)
        ends.append(starts + length)
        owner.append(np.repeat(np.array(js, dtype=np.int64), len(offsets)))
    lo, hi, who = np.concatenate(firsts), np.concatenate(ends), np.concatenate(owner)
    order = np.argsort(lo, kind="stable")
    lo, hi, who = lo[order], hi[order], who[order]
    reach = np.maximum.accumulate(hi)
    hit = np.flatnonzero(lo[1:] < reach[:-1])
    if not len(hit):
        return None
    i = int(hit[0]) + 1
    j = int(np.argmax(hi[:i]))  # a run before it that reaches past its start
    return spans[int(who[j])][3], spans[int(who[i])][3]


def _first_shared(spans: list[tuple[int, int, Any, Any]],
                  apart: Callable[[Any, Any], bool] | None = None) -> tuple[Any, Any] | None:
    """The tags of two spans (first byte, end, host view or None, tag) whose memory is shared,
    or None: pieces whose byte ranges overlap are compared exactly (K and V interleaved in one
    tensor do not share memory, though their ranges overlap); CUDA pieces by their layouts
    when there are many (``_shared_runs``: the per-chunk views of a model's cache), else by
    their ranges.  Pairs for which ``apart(tag, tag2)`` is false are not compared."""
    spans = sorted(spans, key=lambda x: x[0])
    reach = -1
    for lo, hi, _, _ in spans:  # (the common case: no two byte ranges overlap)
        if lo < reach:
            break
        reach = max(reach, hi)
    else:
        return None
    if len(spans) > 8:
        found = _shared_runs(spans)
        if found is None or (found is not False and (apart is None or apart(*found))):
            return found  # type: ignore[return-value]
    for n in range(len(spans)):
        _, hi, view, tag = spans[n]
        for m in range(n + 1, len(spans)):
            lo2, _, view2, tag2 = spans[m]
            if lo2 >= hi:
                break
            if apart is not None and not apart(tag, tag2):
                continue
            if view is None or view2 is None or isinstance(view, _DeviceLayout) or isinstance(view2, _DeviceLayout) \
                    or _shares(view, view2):
                return tag, tag2  # (a GPU piece: by its byte range)
    return None


def _check_disjoint(spans: list[tuple[int, int, Any, int]]) -> None:
    """No two destination pieces of one read share memory (each would get one of two values)."""
    shared = _first_shared(spans)
    if shared is not None:
        layer, layer2 = shared
        what = f"K and V of layer {layer}" if layer == layer2 else \
            f"pieces of layers {min(layer, layer2)} and {max(layer, layer2)}"
        raise InvalidObject(f"out= {what} share memory: every destination must be its own")


def _spans_of(dest: Any) -> list[tuple[int, int, Any, int]]:
    """The memory of a read's destination (``LayerDest``, or one array or tensor) as spans."""
    if isinstance(dest, LayerDest):
        return dest.spans
    view = arrays.host_view(dest)
    return [(*_bounds(dest), view if view is not None else _DeviceLayout.of(dest), 0)]


def check_apart(dests: list[tuple[int, Any, Any]]) -> None:
    """The destinations of several reads (``get_many``: (position in ``out``, key, the
    destination ``get`` checked)) share no memory; InvalidObject naming two whose destinations
    do.  Each read would write its object into the shared bytes, in an order nobody chose."""
    spans = [(lo, hi, view, (n, key)) for n, key, dest in dests for lo, hi, view, _ in _spans_of(dest)]
    shared = _first_shared(spans, apart=lambda a, b: a[0] != b[0])
    if shared is not None:
        (n, key), (m, key2) = sorted(shared, key=lambda t: t[0])
        raise InvalidObject(f"out[{n}] and out[{m}] (keys {key!r} and {key2!r}) share memory: each key needs "
                            "its own destination", key=key2,  # (the later one: callers keep the keys before it)
                            hint="give every key its own array (or its own views), or None for a new one")


LAYER_SCRATCH_BYTES = 8 << 20  # read_object into per-layer pieces: layers read per request, at most
_scratch = threading.local()


def _scratch_buffer(nbytes: int) -> np.ndarray:
    """A page-aligned buffer of this thread, kept for the next call (warm memory)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.nbytes < nbytes:
        buf = _scratch.buf = aligned_empty(nbytes)
    return buf[:nbytes]


def _fill_layers(hdr: rec.RecordHeader, reader: Any, idx: list[int], dest: LayerDest) -> None:
    """The layers ``idx`` of the record, each copied into its destination pieces: straight
    from the reader's verified extents when it holds them in memory (the DRAM tier, a
    decoder), else read into a reused scratch buffer a few MiB at a time first."""
    meta = hdr.meta
    name, layer_shape = _dtype_name(meta), tuple(meta["shape"][1:])
    lb = math.prod(layer_shape) * fmt.DTYPES[meta["dtype"]][1]

    def put(j: int, src: np.ndarray) -> None:
        # host pieces: numpy copies (one thread each: torch's copies of many small pieces each
        # start its thread pool, which stalls whenever another thread holds a core); CUDA: torch
        parts = dest.kv.pieces[j]
        if len(parts) == 1:
            parts = (parts[0][0], parts[0][1])
        for half, (p, v) in enumerate(zip(parts, dest.views[j])):
            if v is not None:  # (the bytes as the piece's numpy dtype: bfloat16 is int16 there)
                np.copyto(v, src.view(v.dtype).reshape(layer_shape)[half])
            else:  # (torch wants writable memory to wrap: a decoder's output may not be)
                p.copy_(arrays.wrap(src if src.flags.writeable else src.copy(), name, layer_shape,
                                    arrays.FRAMEWORK_TORCH, None)[half])

    views = getattr(reader, "extent_view", None)
    if views is not None:
        for j, i in enumerate(idx):
            src = views(i)
            if src.nbytes != lb:
                raise CorruptionError(f"extent {i} holds {src.nbytes} bytes, expected {lb}")
            put(j, src)
        return
    per = max(1, LAYER_SCRATCH_BYTES // lb) if lb else len(idx)
    scratch = _scratch_buffer(min(per, len(idx)) * lb)
    for g in range(0, len(idx), per):
        group = idx[g : g + per]
        reader.read_into([(i, memoryview(scratch[j * lb : (j + 1) * lb])) for j, i in enumerate(group)])
        for j in range(len(group)):
            put(g + j, scratch[j * lb : (j + 1) * lb])


def read_object(hdr: rec.RecordHeader, reader: ExtentReader, *, layers: Any = None, rows: Any = None,
                device: str | None = None, dictionaries: Callable[[int], bytes] | None = None,
                out: Any = None) -> Any:
    """Read the object described by ``hdr`` (or the selected layers / rows of it).
    ``dictionaries(id)`` gives the zstd dictionary a record may name.  ``out`` (checked
    against ``result_shape`` by the caller): host memory that the extents are read (or
    decoded) into directly, returned as the object's data; the caller copies other reads
    into it.  Or per-layer destinations (``layer_destination``): each layer is copied into
    its pieces, and that KVCache is returned."""
    meta = hdr.meta
    if hdr.codec != fmt.CODEC_RAW:
        reader = _Decoding(hdr, reader, dictionaries)
        if device is not None and not reader.codec.lossless:
            return read_on_device(hdr, reader, device, layers, rows)
    if hdr.kind in fmt.LAYERED_KINDS:
        if rows is not None:
            raise InvalidObject("rows= applies to Vectors; use layers= for a KVCache or an MLACache")
        count = meta["shape"][0]
        idx = list(range(count)) if layers is None else select_layers(layers, meta["layer_start"], count)
        if isinstance(out, LayerDest):
            _fill_layers(hdr, reader, idx, out)
            out.kv.layer_start = meta["layer_start"] + idx[0]
            return out.kv
        lb = math.prod(meta["shape"][1:]) * fmt.DTYPES[meta["dtype"]][1]
        host = None if out is None else arrays.host_bytes(out)
        buf = host if host is not None else buffers.take(lb * len(idx))
        reader.read_into([(i, memoryview(buf[j * lb : (j + 1) * lb])) for j, i in enumerate(idx)])
        shape = (len(idx), *meta["shape"][1:])
        data = out if host is not None else arrays.wrap(buf, _dtype_name(meta), shape, meta.get("fw", "numpy"), device)
        return (stored_kv if hdr.kind == fmt.KIND_KV else stored_mla)(data, meta["layer_start"] + idx[0])
    if hdr.kind == fmt.KIND_VECTORS:
        if layers is not None:
            raise InvalidObject("layers= applies to a KVCache or an MLACache; use rows= for Vectors")
        return _read_vectors(hdr, reader, rows, device, out)
    if hdr.kind == fmt.KIND_BLOB:
        if layers is not None or rows is not None:
            raise InvalidObject("layers= and rows= do not apply to a Blob")
        if device is not None:
            raise InvalidObject("device= does not apply to a Blob")
        return stored_blob(reader.read_bytes(0), meta["media_type"])
    raise InvalidObject(f"unknown object kind {hdr.kind}")


def _read_vectors(hdr: rec.RecordHeader, reader: ExtentReader, rows: Any, device: str | None,
                  out: Any = None) -> Vectors:
    meta = hdr.meta
    n, dim = meta["shape"]
    rpe, has_ids = meta["rows_per_extent"], meta["ids"]
    name, fw = _dtype_name(meta), meta.get("fw", "numpy")
    row_bytes = dim * fmt.DTYPES[meta["dtype"]][1]
    n_ext = -(-n // rpe)
    host = None if out is None or rows is not None else arrays.host_bytes(out)
    if rows is None:
        data = host if host is not None else buffers.take(n * row_bytes)
        ids = np.empty(n, dtype="<i8") if has_ids else None
        wanted = [(e, memoryview(data[e * rpe * row_bytes : min(n, (e + 1) * rpe) * row_bytes])) for e in range(n_ext)]
        if ids is not None:
            idv = ids.view(np.uint8)
            wanted += [(n_ext + e, memoryview(idv[e * rpe * 8 : min(n, (e + 1) * rpe) * 8])) for e in range(n_ext)]
        reader.read_into(wanted)
        got = out if host is not None else arrays.wrap(data, name, (n, dim), fw, device)
        return Vectors(got, ids=None if ids is None else _ids_like(ids, fw, device), metric=meta["metric"])
    sel = select_rows(rows, n)
    exts = np.unique(sel // rpe)
    pos = {int(e): i for i, e in enumerate(exts)}
    # every needed extent is read whole (checksums cover whole extents); rows gathered after
    buf = np.empty((len(exts), rpe * row_bytes), dtype=np.uint8)
    idbuf = np.empty((len(exts), rpe), dtype="<i8") if has_ids else None
    wanted = []
    for e, i in pos.items():
        rows_in = min(n, (e + 1) * rpe) - e * rpe
        wanted.append((e, memoryview(buf[i, : rows_in * row_bytes])))
        if idbuf is not None:
            wanted.append((n_ext + e, memoryview(idbuf[i].view(np.uint8)[: rows_in * 8])))
    wanted.sort(key=lambda w: w[0])
    if wanted:  # zero rows selected: nothing to read
        reader.read_into(wanted)
    flat_rows = np.array([pos[int(e)] for e in sel // rpe], dtype=np.int64) * rpe + sel % rpe
    gathered = np.ascontiguousarray(buf.reshape(len(exts) * rpe, row_bytes)[flat_rows]).reshape(-1)
    out = arrays.wrap(gathered, name, (len(sel), dim), fw, device)
    ids_out = None
    if idbuf is not None:
        ids_out = _ids_like(np.ascontiguousarray(idbuf.reshape(-1)[flat_rows]), fw, device)
    return Vectors(out, ids=ids_out, metric=meta["metric"]) if len(sel) else _empty_vectors(out, ids_out, meta)


def _empty_vectors(out: Any, ids: Any, meta: dict[str, Any]) -> Vectors:
    # A selection of zero rows is a valid answer but not a storable object: build it directly.
    v = Vectors.__new__(Vectors)
    v.data, v.ids, v.metric, v.meta = out, ids, meta["metric"], {}
    return v


def _ids_like(ids: np.ndarray, fw: str, device: str | None) -> Any:
    return arrays.wrap(ids.view(np.uint8), "int64", (ids.shape[0],), fw, device)
