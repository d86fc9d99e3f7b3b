"""Codecs (SPEC.md §6): how one extent's bytes are transformed, with stable ids and declared bounds.

A codec encodes one extent (a KV layer ``[2, kv_heads, tokens, head_dim]``, a row range of
vectors ``[rows, dim]``, or a blob's bytes) into bytes and back.  Lossless codecs give back
every bit; lossy ones declare a bound on the error of every element, which the tests check
on every input they generate.  The byte layout of each codec is in SPEC.md §6, so other
readers can decode it.  Lossy codecs never run unless asked for (per put, or per kind and
tier when the store is opened).

The package is pure functions over numpy arrays and bytes: no I/O, nothing about records,
files or the store.  Its modules, lowest first: base.py (Extent, Codec, float conversions),
zstd.py, quant.py (quantiser arithmetic), rans.py (entropy coder), kv.py, kvq.py, vectors.py
(the families), registry.py (ids, parsing, encode / decode dispatch), evaluation.py.  This
module is the package's public face: ``tierstore.codecs.available()``, ``parse``, ``encode``,
``decode``, ``evaluate``.
"""

from __future__ import annotations

from .base import FP16_MAX, LOSSY_DTYPES, Codec, Extent, from_float32, to_float32
from .evaluation import attention_error, evaluate
from .kvq import kvq_bins
from .registry import (
    BY_ID,
    BY_NAME,
    COMPRESSED_MEDIA,
    POST_ZSTD,
    Choice,
    available,
    body_length,
    check_any,
    check_params,
    decode,
    decode_torch,
    encode,
    max_length,
    parse,
)
from .zstd import dictionary_id, train_dictionary, zstd_bound, zstd_compress, zstd_decompress

__all__ = [
    "BY_ID", "BY_NAME", "COMPRESSED_MEDIA", "FP16_MAX", "LOSSY_DTYPES", "POST_ZSTD", "Choice", "Codec", "Extent",
    "attention_error", "available", "body_length", "check_any", "check_params", "decode", "decode_torch",
    "dictionary_id", "encode", "evaluate", "from_float32", "kvq_bins", "max_length", "parse", "to_float32",
    "train_dictionary", "zstd_bound", "zstd_compress", "zstd_decompress",
]
