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
_BAD_NAME_CHARS = re.compile(r"[\x00-\x1f\x7f/\\]")  # namespaces and session ids
_BAD_KEY_CHARS = re.compile(r"[\x00-\x1f\x7f\\]")  # text keys: "/" is allowed (path- and URL-like keys)


def bad_text(text: str) -> bool:
    """Control characters (NUL included), path separators, or a name that is . or .."""
    return _BAD_NAME_CHARS.search(text) is not None or text in (".", "..")


def _utf8(text: str, what: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidObject(f"{what} {text!r} is not valid text: {e.reason} at position {e.start}",
                            hint="text must be encodable as UTF-8 (a lone surrogate is not)") from None


def _why_bad(text: str, what: str, chars: re.Pattern[str]) -> str:
    m = chars.search(text)
    if m is None:
        return f"{what} {text!r} may not be . or .."
    return f"{what} {text!r} contains {m.group()!r} at position {m.start()} (control characters" + \
        (", / and \\" if "/" in chars.pattern else " and \\") + " are not allowed)"


def check_namespace(namespace: Any) -> bytes:
    """A namespace name's UTF-8 bytes, or InvalidObject."""
    if not isinstance(namespace, str):
        raise InvalidObject(f"namespace must be a str, got {type(namespace).__name__}")
    b = _utf8(namespace, "namespace")
    if not 1 <= len(b) <= fmt.NAMESPACE_MAX_BYTES:
        raise InvalidObject(f"namespace must be 1 to {fmt.NAMESPACE_MAX_BYTES} bytes of UTF-8, got {len(b)}")
    if bad_text(namespace):
        raise InvalidObject(_why_bad(namespace, "namespace", _BAD_NAME_CHARS))
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
        b, flags = _utf8(key, "str key"), fmt.FLAG_KEY_STR
        if _BAD_KEY_CHARS.search(key) is not None or key in (".", ".."):
            raise InvalidObject(_why_bad(key, "str key", _BAD_KEY_CHARS),
                                hint="bytes keys are opaque and may hold any byte")
    elif isinstance(key, (bytes, bytearray, memoryview)):
        b, flags = bytes(key), 0
    else:
        raise InvalidObject(f"key must be str or bytes, got {type(key).__name__}")
    if not 1 <= len(b) <= fmt.KEY_MAX_BYTES:
        raise InvalidObject(f"key must be 1 to {fmt.KEY_MAX_BYTES} bytes, got {len(b)}",
                            hint="hash long identifiers (e.g. hashlib.sha256(x).digest())")
    return b, flags


def key_bytes(keys: list[Any]) -> list[bytes]:
    """``encode_key(k)[0]`` of each of ``keys`` (the bytes a lookup needs), with the same checks
    and errors: the common case -- str and bytes keys, all valid -- checked in a few C-speed
    passes over the whole list instead of key by key (~0.5 us a key less)."""
    try:
        out = [k.encode("utf-8") if type(k) is str else k for k in keys]
    except UnicodeEncodeError:
        out = []
    texts = [k for k in keys if type(k) is str]
    if (len(out) != len(keys) or (texts and (_BAD_KEY_CHARS.search("".join(texts)) is not None  # (one char
                                             or "." in texts or ".." in texts))  # class: joining adds no match)
            or not all(type(b) is bytes and 0 < len(b) <= fmt.KEY_MAX_BYTES for b in out)):
        return [encode_key(k)[0] for k in keys]  # (the slow path names the bad key)
    return out


def decode_key(b: bytes, flags: int) -> str | bytes:
    """A stored key as the caller gave it: str keys back as str, bytes keys as bytes."""
    return b.decode("utf-8") if flags & fmt.FLAG_KEY_STR else b


def encode_session(session: Any) -> bytes:
    """A session id's UTF-8 bytes, or InvalidObject."""
    if not isinstance(session, str):
        raise InvalidObject(f"session must be a str, got {type(session).__name__}")
    b = _utf8(session, "session id")
    if bad_text(session) or not 1 <= len(b) <= fmt.SESSION_MAX_BYTES:
        raise InvalidObject(f"session id {session!r} must be 1 to {fmt.SESSION_MAX_BYTES} bytes of UTF-8 without "
                            "control characters or path separators, and not . / ..")
    return b


def key_list(keys: Any, call: str, one: str) -> list[Any]:
    """The keys of a batch call (``call``) as a list: InvalidObject for one key given alone
    (``one``: the hint, the single-key call) or for something that is not a sequence (None)."""
    if isinstance(keys, (str, bytes, bytearray, memoryview)):
        raise InvalidObject(f"{call} takes a sequence of keys, got one key", hint=one)
    try:
        return list(keys)
    except TypeError:
        raise InvalidObject(f"{call} takes a sequence of keys, got {type(keys).__name__}") from None
