"""The zstd family (SPEC.md §6.2): zstd frames, trained dictionaries, and the byte shuffle of shuffle+zstd.
Pure functions over bytes, no I/O; a frame is checked against what the record says before it is
decompressed, and nothing is allocated for a size the record does not state.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np
import zstandard

from ..errors import CorruptionError, InvalidObject
from ..format import constants as fmt

# python-zstandard's compressors and decompressors must not be used by two threads at once (a
# shared one gave wrong bytes, false CorruptionErrors and crashes under get_many's reader
# threads): each call takes one from a small pool and gives it back -- not one per thread, which
# kept ~80 MiB per thread and level at level 19 for the thread's life
_pool_lock = threading.Lock()
_compressors: dict[int, list[zstandard.ZstdCompressor]] = {}
_decompressors: list[zstandard.ZstdDecompressor] = []
POOL_MAX = 4  # idle contexts kept per level (and decompressors): the rest are freed


def _forked() -> None:
    """A fork()ed child starts with an unheld lock and no contexts (a thread of the parent may
    have held the lock at the fork: the child would wait for it for ever)."""
    global _pool_lock
    _pool_lock = threading.Lock()
    _compressors.clear()
    _decompressors.clear()


os.register_at_fork(after_in_child=_forked)


def zstd_compress(data: Any, level: int, dictionary: bytes | None = None) -> bytes:
    if dictionary is not None:
        zd = zstandard.ZstdCompressionDict(dictionary)
        return zstandard.ZstdCompressor(level=level, write_content_size=True, dict_data=zd).compress(data)
    with _pool_lock:
        idle = _compressors.get(level)
        c = idle.pop() if idle else None
    if c is None:
        c = zstandard.ZstdCompressor(level=level, write_content_size=True)
    out = c.compress(data)
    with _pool_lock:
        idle = _compressors.setdefault(level, [])
        if len(idle) < POOL_MAX:
            idle.append(c)
    return out


def _decompress(data: Any, expected: int) -> bytes:
    with _pool_lock:
        d = _decompressors.pop() if _decompressors else None
    if d is None:
        d = zstandard.ZstdDecompressor()
    out = d.decompress(data, max_output_size=expected)
    with _pool_lock:
        if len(_decompressors) < POOL_MAX:
            _decompressors.append(d)
    return out


def dictionary_id(dictionary: bytes) -> int:
    """The id a zstd dictionary declares (nonzero for a trained one), or CorruptionError."""
    if len(dictionary) < 8 or dictionary[:4] != fmt.ZSTD_DICT_MAGIC:
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


def frame_length(data: Any) -> int:
    """The length of the zstd frame at the start of ``data`` (RFC 8878 §3.1.1: the frame header,
    then blocks of 3-byte headers -- last flag, type, size; an RLE block holds one byte -- then
    the optional 4-byte checksum), or CorruptionError if it runs past the end."""
    mv = memoryview(data)
    if bytes(mv[:4]) != fmt.ZSTD_FRAME_MAGIC:
        raise CorruptionError("not a zstd frame (magic; a skippable frame is not allowed)")
    p = zstandard.frame_header_size(mv)
    while True:
        if p + 3 > len(mv):
            raise CorruptionError("zstd frame cut short")
        b = mv[p] | mv[p + 1] << 8 | mv[p + 2] << 16
        kind, size = (b >> 1) & 3, b >> 3
        if kind == 3:
            raise CorruptionError("zstd block of the reserved type")
        p += 3 + (1 if kind == 1 else size)
        if b & 1:
            break
    if zstandard.get_frame_parameters(mv).has_checksum:
        p += 4
    if p > len(mv):
        raise CorruptionError("zstd frame cut short")
    return p


def zstd_decompress(data: Any, expected: int, dictionary: bytes | None = None) -> bytes:
    """Exactly one zstd frame and nothing after it, declaring exactly ``expected`` content
    bytes (checked first) and the dictionary id of ``dictionary`` (or none) -- SPEC.md §6.2."""
    try:
        declared = zstandard.frame_content_size(data)
        frame_dict = zstandard.get_frame_parameters(data).dict_id
        if frame_length(data) != len(data):
            raise CorruptionError("bytes after the zstd frame (a second frame, or garbage)")
    except zstandard.ZstdError as e:
        raise CorruptionError(f"bad zstd frame: {e}") from None
    if declared != expected:
        raise CorruptionError(f"zstd frame declares {declared} bytes, the record {expected}")
    want_dict = dictionary_id(dictionary) if dictionary is not None else 0
    if frame_dict != want_dict:
        raise CorruptionError(f"zstd frame names dictionary {frame_dict}, the record {want_dict}")
    try:
        if dictionary is None:
            out = _decompress(data, expected)
        else:
            out = zstandard.ZstdDecompressor(dict_data=zstandard.ZstdCompressionDict(dictionary)).decompress(
                data, max_output_size=expected)
    except zstandard.ZstdError as e:
        raise CorruptionError(f"bad zstd frame: {e}") from None
    if len(out) != expected:
        raise CorruptionError(f"zstd frame holds {len(out)} bytes, the record {expected}")
    return out


def level(params: dict[str, Any], key: str = "level") -> int:
    """A stored zstd level parameter, checked."""
    level = params.get(key)
    if type(level) is not int or not 1 <= level <= 22:
        raise CorruptionError(f"codec parameter {key!r} must be an int in 1..22, got {level!r}")
    return level


def shuffle(b: np.ndarray, itemsize: int) -> np.ndarray:
    """Byte shuffle: byte j of every element together (SPEC.md §6.2, shuffle+zstd)."""
    return np.ascontiguousarray(b.reshape(-1, itemsize).T).reshape(-1)


def unshuffle(b: np.ndarray, itemsize: int) -> np.ndarray:
    return np.ascontiguousarray(b.reshape(itemsize, -1).T).reshape(-1)


def dict_for(params: dict[str, Any], dictionary: bytes | None) -> bytes | None:
    """The dictionary a ``dict`` parameter names, checked against the one given (or None)."""
    if "dict" not in params:
        return None
    if dictionary is None or dictionary_id(dictionary) != params["dict"]:
        raise CorruptionError(f"zstd dictionary {params['dict']} is missing")
    return dictionary
