"""Which bytes each extent of a record holds (SPEC.md §5.3), as the codecs see them: pure, no I/O.

A KVCache or MLACache record has one extent per layer, a Vectors record one per row range (then one per
row range of its ids), a Blob one.  The record decoder checks stored lengths against this and
the block encoder cuts objects along it; neither keeps a second copy of the rule.
"""

from __future__ import annotations

from typing import Any

from .. import codecs as cdc
from . import constants as fmt


def extent_shapes(kind: int, meta: dict[str, Any]) -> list[cdc.Extent]:
    """What each extent of a record holds (SPEC.md §5.3): the codecs' view of them."""
    if kind == fmt.KIND_KV:
        name = fmt.DTYPES[meta["dtype"]][0]
        return [cdc.Extent("kv", tuple(meta["shape"][1:]), name, meta["layer_start"] + i)
                for i in range(meta["shape"][0])]
    if kind == fmt.KIND_MLA:
        name = fmt.DTYPES[meta["dtype"]][0]
        return [cdc.Extent("mla", tuple(meta["shape"][1:]), name, meta["layer_start"] + i)
                for i in range(meta["shape"][0])]
    if kind == fmt.KIND_VECTORS:
        n, dim = meta["shape"]
        rpe = meta["rows_per_extent"]
        name = fmt.DTYPES[meta["dtype"]][0]
        rows = [min(rpe, n - i) for i in range(0, n, rpe)]
        out = [cdc.Extent("vectors", (r, dim), name) for r in rows]
        return out + ([cdc.Extent("ids", (r,), "int64") for r in rows] if meta["ids"] else [])
    return [cdc.Extent("blob", (meta["size"],), None)]


def extent_codec(codec: cdc.Codec, ext: cdc.Extent) -> cdc.Codec:
    """The codec of one extent: the record's, except that id extents of a lossy codec are raw."""
    return codec if codec.lossless or ext.kind != "ids" else cdc.BY_ID[fmt.CODEC_RAW]
