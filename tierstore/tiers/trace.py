"""Access traces (docs/placement.md): what a store was asked, one JSON object per line, for
``tierstore simulate`` to replay against placement policies without touching real data.

    {"t": 1764590000.123456, "op": "put", "ns": "chat", "key": "c0-3", "bytes": 33558528, "tokens": 256,
     "session": "s0"}

Fields: ``t`` (Unix seconds), ``op`` (below), ``ns`` (namespace), ``key`` (a key that is UTF-8
text) or ``key_hex`` (any other key, hexadecimal), ``bytes`` (the object's stored record: what
the disk holds and a read moves), ``tokens`` (a KV cache's token count; 0 or absent for other
objects), ``session`` (the session of a put, or of a ``session`` / ``drop`` op), ``hit``
(``get``: whether the store held the object).  Ops: ``put``, ``get``, ``delete``, ``session``
(``prefetch_session``: a session's next turn is coming), ``drop`` (``drop_session``), ``evict``
(the SSD budget evicted the object: a decision, which ``simulate --follow`` checks),
``downtier`` (an evicted object came back as a lossy copy of ``bytes``, with the ``sessions``
that reference it: ``open(..., downtier=)``), and ``truncated`` (the trace reached its size bound; nothing after it was
recorded).

It owns the format (``OPS``, ``read_trace``) and the recorder of ``open(...,
trace_to=path)`` (``TraceWriter``: append-only, bounded by ``trace_bytes``, buffered -- a process
that dies loses its last lines).  It never touches a store's data, and recording changes
nothing the store does.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Hashable, Iterator
from typing import Any

from ..engine.options import parse_size
from ..errors import InvalidObject

OPS = ("put", "get", "delete", "session", "drop", "evict", "downtier", "truncated")
TRACE_OPTIONS = ("trace_to", "trace_bytes")
_log = logging.getLogger("tierstore.trace")
DEFAULT_TRACE_BYTES = 1 << 30  # a trace stops (with a "truncated" line) past this many bytes


def trace_options(options: dict[str, Any]) -> dict[str, Any] | None:
    """Pop and check ``trace_to`` and ``trace_bytes``; None when nothing is recorded."""
    path, limit = options.pop("trace_to", None), options.pop("trace_bytes", None)
    if path is None:
        if limit is not None:
            raise InvalidObject("trace_bytes= bounds a trace: give trace_to= (its file) too")
        return None
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidObject(f"trace_to must be a file path, got {type(path).__name__}")
    return {"path": os.fspath(path), "max_bytes": parse_size(limit, "trace_bytes") if limit is not None
            else DEFAULT_TRACE_BYTES}


def key_fields(k: bytes) -> dict[str, str]:
    """A key as trace fields: ``key`` if it is UTF-8 text, else ``key_hex``."""
    try:
        return {"key": k.decode("utf-8")}
    except UnicodeDecodeError:
        return {"key_hex": k.hex()}


def _ends_truncated(path: str) -> bool:
    """Whether the trace file's last line is a ``truncated`` line (a recording that ended)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 256))
            tail = f.read().rstrip(b"\n").rsplit(b"\n", 1)[-1]
        return json.loads(tail).get("op") == "truncated"
    except (OSError, ValueError, AttributeError):  # (not readable, or not a trace line: it did not end so)
        return False


class TraceWriter:
    """Appends one line per operation to ``path``; thread-safe.  Told what a handle does by
    the same calls as the SSD budget (``admitted``, ``touched``, ``missed``, ``removed``,
    ``session_active``, ``session_ended``) and of each eviction (``evicted``, ``downtiered``)."""

    def __init__(self, path: str, *, max_bytes: int = DEFAULT_TRACE_BYTES) -> None:
        self.path, self.max_bytes = path, max_bytes
        self._lock = threading.Lock()
        try:
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())
        except OSError as e:
            raise InvalidObject(f"trace_to={path!r}: {e.strerror}", path=path) from None
        self._written = self._file.tell()
        ended = self._written > 0 and _ends_truncated(path)
        self.truncated = self._written >= max_bytes or ended
        if self.truncated:  # (the bound counts what the file holds: a reopen adds nothing)
            _log.warning("trace_to=%s %s: nothing more is traced (move the file away%s)", path,
                         "already ended at its size bound (a truncated line)" if ended else
                         f"already holds {self._written} bytes, trace_bytes={max_bytes}",
                         "" if ended else ", or raise trace_bytes")

    def _write(self, fields: dict[str, Any]) -> None:
        line = json.dumps({"t": round(time.time(), 6), **fields}, separators=(",", ":")) + "\n"
        with self._lock:
            if self.truncated or self._file.closed:
                return
            if self._written + len(line) > self.max_bytes:
                self.truncated = True
                line = json.dumps({"t": round(time.time(), 6), "op": "truncated"}, separators=(",", ":")) + "\n"
            self._file.write(line)
            self._written += len(line)

    def admitted(self, ns: bytes, k: bytes, nbytes: int, sessions: tuple[bytes, ...], tokens: int = 0) -> None:
        extra = {"session": sessions[0].decode("utf-8", "replace")} if sessions else {}
        self._write({"op": "put", "ns": ns.decode("utf-8"), **key_fields(k), "bytes": nbytes, "tokens": tokens,
                     **extra})

    def touched(self, ns: bytes, k: bytes, nbytes: int = 0, tokens: int = 0) -> None:
        self._write({"op": "get", "ns": ns.decode("utf-8"), **key_fields(k), "bytes": nbytes, "tokens": tokens,
                     "hit": True})

    def missed(self, ns: bytes, keys: list[bytes]) -> None:
        for k in keys:
            self._write({"op": "get", "ns": ns.decode("utf-8"), **key_fields(k), "hit": False})

    def removed(self, ns: bytes, keys: list[bytes]) -> None:
        for k in keys:
            self._write({"op": "delete", "ns": ns.decode("utf-8"), **key_fields(k)})

    def session_active(self, ns: bytes, sess: bytes) -> None:
        self._write({"op": "session", "ns": ns.decode("utf-8"), "session": sess.decode("utf-8", "replace")})

    def session_ended(self, ns: bytes, sess: bytes) -> None:
        self._write({"op": "drop", "ns": ns.decode("utf-8"), "session": sess.decode("utf-8", "replace")})

    def evicted(self, keys: list[Hashable], sizes: list[int]) -> None:
        for (ns, k), n in zip(keys, sizes):  # type: ignore[misc]
            self._write({"op": "evict", "ns": ns.decode("utf-8"), **key_fields(k), "bytes": n})

    def downtiered(self, ns: bytes, k: bytes, nbytes: int, tokens: int, sessions: tuple[bytes, ...] = ()) -> None:
        extra = {"sessions": [x.decode("utf-8", "replace") for x in sessions]} if sessions else {}
        self._write({"op": "downtier", "ns": ns.decode("utf-8"), **key_fields(k), "bytes": nbytes, "tokens": tokens,
                     **extra})

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.close()


VALUE_MAX = 1 << 60  # bytes and tokens of one trace line at most (an exabyte: past it, a wrong line)


def read_trace(path: str) -> Iterator[dict[str, Any]]:
    """The operations of a trace file, checked: InvalidObject naming the line on anything that
    is not a trace line (JSON object, known ``op``, ``ns`` and a key where the op needs them)."""
    try:
        with open(path, "rb") as f:
            for n, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise InvalidObject(f"{path}:{n}: not a trace line (not UTF-8 text)", path=path) from None
                if not line.strip():
                    continue
                try:
                    op = json.loads(line)
                except ValueError as e:
                    raise InvalidObject(f"{path}:{n}: not JSON ({e})", path=path) from None
                yield check_op(op, f"{path}:{n}")
                if op["op"] == "truncated":
                    return  # (the recording stopped there: nothing after it was recorded)
    except OSError as e:
        raise InvalidObject(f"{path}: cannot read the trace ({e.strerror})", path=path) from None


def _utf8(value: Any) -> bool:
    """A JSON string that is UTF-8 text (JSON may hold lone surrogates, which no name is)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_op(op: Any, where: str) -> dict[str, Any]:
    if not isinstance(op, dict) or op.get("op") not in OPS:
        raise InvalidObject(f"{where}: a trace line is a JSON object with op one of {', '.join(OPS)}")
    for f in ("ns", "key", "session"):
        if isinstance(op.get(f), str) and not _utf8(op[f]):
            raise InvalidObject(f"{where}: {f} is not UTF-8 text (a lone surrogate): {op[f][:40]!r}")
    if isinstance(op.get("sessions"), list) and not all(_utf8(x) for x in op["sessions"] if isinstance(x, str)):
        raise InvalidObject(f"{where}: a session of sessions is not UTF-8 text (a lone surrogate)")
    if op["op"] in ("put", "get", "delete", "evict", "downtier"):
        keyed = isinstance(op.get("key"), str) != isinstance(op.get("key_hex"), str)
        if not isinstance(op.get("ns"), str) or not keyed:
            raise InvalidObject(f"{where}: a {op['op']} needs ns and one of key, key_hex")
        if "key_hex" in op:
            try:
                bytes.fromhex(op["key_hex"])
            except ValueError:
                raise InvalidObject(f"{where}: key_hex is not hexadecimal: {op['key_hex'][:40]!r}") from None
        for f in ("bytes", "tokens"):
            if f in op and (not isinstance(op[f], int) or isinstance(op[f], bool) or not 0 <= op[f] <= VALUE_MAX):
                raise InvalidObject(f"{where}: {f} must be an int from 0 to {VALUE_MAX}, got {op[f]!r}")
        if "session" in op and not isinstance(op["session"], str):
            raise InvalidObject(f"{where}: session must be a session id (a string), got {op['session']!r}")
        if "hit" in op and not isinstance(op["hit"], bool):
            raise InvalidObject(f"{where}: hit must be true or false, got {op['hit']!r}")
    if op["op"] == "downtier" and not (isinstance(op.get("sessions", []), list) and
                                       all(isinstance(x, str) for x in op.get("sessions", []))):
        raise InvalidObject(f"{where}: a downtier's sessions are a list of session ids")
    if op["op"] in ("session", "drop") and not (isinstance(op.get("session"), str) and isinstance(op.get("ns"), str)):
        raise InvalidObject(f"{where}: a {op['op']} needs ns and session (a session is one namespace's)")
    return op
