"""Chunk hashes for prefix reuse (SPEC.md §13): token ids -> a chain of stable keys.

This module owns the hash chain and nothing else: it does no I/O and knows nothing about
the store.  ``Store.match_prefix`` looks the hashes up.  The encoding is specified byte by
byte so that other engines compute the same keys: never Python's ``hash()``.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from .errors import InvalidObject
from .format import constants as fmt

_ROOT = bytes(fmt.CHUNK_HASH_BYTES)


def _token_bytes(tokens: Any) -> np.ndarray:
    """Token ids as a little-endian u32 array, validated (integers in [0, 2^32))."""
    if hasattr(tokens, "detach"):  # a torch tensor
        tokens = tokens.detach().cpu().numpy()
    try:
        arr = np.asarray(tokens)
    except (ValueError, TypeError) as e:
        raise InvalidObject(f"tokens must be a 1-d sequence of ints: {e}") from None
    if arr.ndim != 1:
        raise InvalidObject(f"tokens must be 1-d, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype="<u4")
    if arr.dtype == object:
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in arr):
            raise InvalidObject("tokens must be ints")
        if not all(0 <= t <= fmt.CHUNK_TOKEN_MAX for t in arr):
            raise InvalidObject(f"token ids must be in [0, {fmt.CHUNK_TOKEN_MAX}]")
        return np.array([int(t) for t in arr], dtype="<u4")
    if arr.dtype.kind not in "iu":
        raise InvalidObject(f"tokens must be integers, got dtype {arr.dtype}")
    if int(arr.min()) < 0 or int(arr.max()) > fmt.CHUNK_TOKEN_MAX:
        raise InvalidObject(f"token ids must be in [0, {fmt.CHUNK_TOKEN_MAX}]")
    return arr.astype("<u4", copy=False)


def chunk_hashes(tokens: Any, *, chunk_tokens: int = 256, salt: str | bytes = b"",
                 include_partial: bool = False) -> list[bytes]:
    """The chained hash of each ``chunk_tokens``-token chunk of ``tokens`` (32-byte keys).
    ``chunk_tokens`` defaults to 256, the chunk size of LMCache and of vLLM's KV connectors.

    Chunk i's hash covers the salt, chunk i-1's hash and chunk i's token ids, so equal hashes
    mean equal prefixes (up to SHA-256 collisions) and a change to one token changes the hash
    of its chunk and of every later one.  A trailing chunk shorter than ``chunk_tokens`` is
    dropped unless ``include_partial``.  ``salt`` (e.g. "llama3-8b/tp1") separates models and
    layouts whose KV differs for the same tokens.  Stable across processes, machines and
    versions: SPEC.md §13 gives the exact bytes.
    """
    if type(chunk_tokens) is not int or chunk_tokens < 1:
        raise InvalidObject(f"chunk_tokens must be a positive int, got {chunk_tokens!r}")
    if isinstance(salt, str):
        salt = salt.encode("utf-8")
    elif not isinstance(salt, (bytes, bytearray)):
        raise InvalidObject(f"salt must be str or bytes, got {type(salt).__name__}")
    if len(salt) > 0xFFFFFFFF:
        raise InvalidObject("salt too long")
    toks = _token_bytes(tokens)
    n = len(toks)
    full = n // chunk_tokens
    ends = [(i + 1) * chunk_tokens for i in range(full)]
    if include_partial and n % chunk_tokens:
        ends.append(n)
    prefix = hashlib.sha256(fmt.CHUNK_HASH_DOMAIN + len(salt).to_bytes(4, "little") + bytes(salt))
    data = toks.tobytes()
    out = []
    parent = _ROOT
    start = 0
    for end in ends:
        h = prefix.copy()
        h.update(parent)
        h.update((end - start).to_bytes(4, "little"))
        h.update(data[start * 4 : end * 4])
        parent = h.digest()
        out.append(parent)
        start = end
    return out
