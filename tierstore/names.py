"""Names: keys, namespaces and session ids checked and encoded to the bytes the format stores (SPEC.md §5.1).

Pure functions: no I/O, no state beyond a small cache of encoded namespace names.  Every
public entry point that takes a name goes through here before anything is written or read,
so a bad name is an ``InvalidObject`` naming what is wrong, never a half-done operation.
"""

from __future__ import annotations

import re
from typing import Any

from .errors import InvalidObject
from .format import constants as fmt

_NAMESPACES: dict[str, bytes] = {}
_BAD_CHARS = re.compile(r"[\x00-\x1f\x7f/\\]")


def bad_text(text: str) -> bool:
    """Control characters (NUL included), path separators, or a name that is . or .."""
    return _BAD_CHARS.search(text) is not None or text in (".", "..")


def check_namespace(namespace: Any) -> bytes:
    """A namespace name's UTF-8 bytes, or InvalidObject."""
    if not isinstance(namespace, str):
        raise InvalidObject(f"namespace must be a str, got {type(namespace).__name__}")
    b = namespace.encode("utf-8")
    if not 1 <= len(b) <= fmt.NAMESPACE_MAX_BYTES:
        raise InvalidObject(f"namespace must be 1 to {fmt.NAMESPACE_MAX_BYTES} bytes of UTF-8, got {len(b)}")
    if bad_text(namespace):
        raise InvalidObject(f"namespace {namespace!r} contains a control character, a path separator, or is . / ..")
    return b


def encode_namespace(namespace: Any) -> bytes:
    """``check_namespace``, remembering the names seen most (the get path's common case)."""
    b = _NAMESPACES.get(namespace) if type(namespace) is str else None
    if b is not None:
        return b
    b = check_namespace(namespace)
    if len(_NAMESPACES) < 4096:
        _NAMESPACES[namespace] = b
    return b


def encode_key(key: Any) -> tuple[bytes, int]:
    """A key's bytes and its flags (``FLAG_KEY_STR`` for a str key), or InvalidObject."""
    if isinstance(key, str):
        b, flags = key.encode("utf-8"), fmt.FLAG_KEY_STR
        if bad_text(key):
            raise InvalidObject(f"str key {key!r} contains a control character (NUL included) or a path separator, "
                                "or is . / ..", hint="bytes keys are opaque and may hold any byte")
    elif isinstance(key, (bytes, bytearray, memoryview)):
        b, flags = bytes(key), 0
    else:
        raise InvalidObject(f"key must be str or bytes, got {type(key).__name__}")
    if not 1 <= len(b) <= fmt.KEY_MAX_BYTES:
        raise InvalidObject(f"key must be 1 to {fmt.KEY_MAX_BYTES} bytes, got {len(b)}",
                            hint="hash long identifiers (e.g. hashlib.sha256(x).digest())")
    return b, flags


def decode_key(b: bytes, flags: int) -> str | bytes:
    """A stored key as the caller gave it: str keys back as str, bytes keys as bytes."""
    return b.decode("utf-8") if flags & fmt.FLAG_KEY_STR else b


def encode_session(session: Any) -> bytes:
    """A session id's UTF-8 bytes, or InvalidObject."""
    if not isinstance(session, str):
        raise InvalidObject(f"session must be a str, got {type(session).__name__}")
    b = session.encode("utf-8")
    if bad_text(session) or not 1 <= len(b) <= fmt.SESSION_MAX_BYTES:
        raise InvalidObject(f"session id {session!r} must be 1 to {fmt.SESSION_MAX_BYTES} bytes of UTF-8 without "
                            "control characters or path separators, and not . / ..")
    return b
