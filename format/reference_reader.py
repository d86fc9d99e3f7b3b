"""An independent reader of tierstore stores, written from SPEC.md alone.

It does not import tierstore, nor LMDB: it scans the segments (SPEC.md §12), which is also
the format's recovery path.  Dependencies: the standard library, numpy, and zstandard (for the
zstd codecs of SPEC.md §6, imported only when a store uses them).  It carries its
own CRC-32C (Appendix A) and a decoder for the msgpack subset of SPEC.md §5.2.

    python format/reference_reader.py STORE_DIR          # lists every live object
    python format/reference_reader.py STORE_DIR --json   # ... as JSON

If this reader and tierstore ever disagree on a store, SPEC.md is incomplete or wrong.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

# --- Appendix A: CRC-32C ---------------------------------------------------------------------
_TABLE = []
for _n in range(256):
    _c = _n
    for _ in range(8):
        _c = (_c >> 1) ^ 0x82F63B78 if _c & 1 else _c >> 1
    _TABLE.append(_c)


def crc32c(data: bytes, crc: int = 0) -> int:
    crc ^= 0xFFFFFFFF
    table = _TABLE
    for b in data:
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


assert crc32c(b"123456789") == 0xE3069283


class FormatError(Exception):
    """The bytes do not follow SPEC.md."""


# --- §5.2: the msgpack subset ------------------------------------------------------------------


def unpack(data: bytes) -> Any:
    value, pos = _unpack(data, 0, 1)
    if pos != len(data):
        raise FormatError("trailing bytes after metadata")
    return value


def _unpack(d: bytes, p: int, depth: int) -> tuple[Any, int]:
    if depth > 16:
        raise FormatError("metadata nested deeper than 16 levels")
    if p >= len(d):
        raise FormatError("metadata truncated")
    t = d[p]
    p += 1

    def take(n: int) -> bytes:
        nonlocal p
        if p + n > len(d):
            raise FormatError("metadata truncated")
        out = d[p : p + n]
        p += n
        return out

    def length(fmt_: str) -> int:  # msgpack lengths are big-endian
        return struct.unpack(">" + fmt_, take(struct.calcsize(fmt_)))[0]

    if t <= 0x7F:
        return t, p
    if t >= 0xE0:
        return t - 0x100, p
    if 0x80 <= t <= 0x8F:
        return _map(d, p, t & 0x0F, depth)
    if 0x90 <= t <= 0x9F:
        return _array(d, p, t & 0x0F, depth)
    if 0xA0 <= t <= 0xBF:
        return take(t & 0x1F).decode("utf-8"), p
    simple = {0xC0: None, 0xC2: False, 0xC3: True}
    if t in simple:
        return simple[t], p
    ints = {0xCC: "B", 0xCD: "H", 0xCE: "I", 0xCF: "Q", 0xD0: "b", 0xD1: "h", 0xD2: "i", 0xD3: "q"}
    if t in ints:
        return struct.unpack(">" + ints[t], take(struct.calcsize(ints[t])))[0], p
    if t == 0xCA:
        return struct.unpack(">f", take(4))[0], p
    if t == 0xCB:
        return struct.unpack(">d", take(8))[0], p
    if t in (0xD9, 0xDA, 0xDB):
        n = length({0xD9: "B", 0xDA: "H", 0xDB: "I"}[t])
        return take(n).decode("utf-8"), p
    if t in (0xC4, 0xC5, 0xC6):
        n = length({0xC4: "B", 0xC5: "H", 0xC6: "I"}[t])
        return bytes(take(n)), p
    if t in (0xDC, 0xDD):
        n = length("H" if t == 0xDC else "I")
        return _array(d, p, n, depth)
    if t in (0xDE, 0xDF):
        n = length("H" if t == 0xDE else "I")
        return _map(d, p, n, depth)
    raise FormatError(f"msgpack type byte {t:#x} is not allowed in metadata")


def _array(d: bytes, p: int, n: int, depth: int) -> tuple[list[Any], int]:
    if n > len(d) - p:
        raise FormatError("metadata array longer than its bytes")
    out = []
    for _ in range(n):
        v, p = _unpack(d, p, depth + 1)
        out.append(v)
    return out, p


def _map(d: bytes, p: int, n: int, depth: int) -> tuple[dict[str, Any], int]:
    if n > len(d) - p:
        raise FormatError("metadata map longer than its bytes")
    out: dict[str, Any] = {}
    for _ in range(n):
        k, p = _unpack(d, p, depth + 1)
        if not isinstance(k, str):
            raise FormatError("metadata map key is not a string")
        v, p = _unpack(d, p, depth + 1)
        out[k] = v
    return out, p


# --- §3, §4: segments and records --------------------------------------------------------------

SEGMENT_MAGIC = b"\x89TSG\r\n\x1a\n"
RECORD_MAGIC = b"\xd4TRC"
PAGE = 4096
PUT, DELETE, PAD, HOLE, IGNORABLE, GROUP, SYNC, HEADERS = 1, 2, 3, 4, 0x8000, 0x8005, 0x8006, 0x8007
REF_NAMESPACE, REF_KIND = b"\x00ref", 4  # SPEC.md §5.4
KINDS = {1: "kv", 2: "vectors", 3: "blob", 5: "mla"}  # 5: 1.4
DTYPES = {1: ("float16", "<f2"), 2: ("bfloat16", "<u2"), 3: ("float32", "<f4"), 4: ("float64", "<f8"),
          5: ("float8_e4m3fn", "u1"), 6: ("float8_e5m2", "u1"), 7: ("int8", "i1"), 8: ("uint8", "u1"),
          9: ("int16", "<i2"), 10: ("int32", "<i4"), 11: ("int64", "<i8")}


def align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass
class Record:
    segment: str
    offset: int
    type: int
    flags: int
    lsn: int
    record_len: int
    kind: int
    align_log2: int
    codec: int
    namespace: bytes
    key: bytes
    meta: dict[str, Any]
    extents: list[tuple[int, int, int]] = field(default_factory=list)  # (offset, length, crc32c)


def read_segment_header(data: bytes, name: str) -> dict[str, Any]:
    if data[:8] != SEGMENT_MAGIC:
        raise FormatError(f"{name}: not a segment")
    if len(data) < 116:  # the fields and checksum of §3.1 (the header page may be cut short)
        raise FormatError(f"{name}: segment header cut by end of file")
    major, minor, hsize, incompat, ro_compat, compat = struct.unpack_from("<HHIQQQ", data, 8)
    if major != 1:
        raise FormatError(f"{name}: format {major}.{minor} is not 1.x")
    if crc32c(data[:112]) != struct.unpack_from("<I", data, 112)[0]:
        raise FormatError(f"{name}: segment header checksum")
    if incompat or hsize != PAGE:
        raise FormatError(f"{name}: unknown incompatible features or header size")
    store_uuid = data[40:56]
    seg_id, base_lsn = struct.unpack_from("<QQ", data, 56)
    if f"{seg_id:016x}.tseg" != name or base_lsn == 0:
        raise FormatError(f"{name}: segment id / base LSN")
    return {"store_uuid": store_uuid, "segment_id": seg_id, "base_lsn": base_lsn, "minor": minor}


def parse_record(data: bytes, p: int, name: str, header_only: bool = False) -> Record:
    """Decode and validate the record at p (SPEC.md §4.4); FormatError if invalid or cut
    (``header_only``: ``data`` holds just the header, a HEADERS record's copy, §4.5)."""
    if p + 48 > len(data):
        raise FormatError("record header cut by end of file")
    (magic, crc, rtype, flags, header_len, lsn, record_len, kind, align_log2, codec, ns_len, reserved, key_len,
     meta_len, n_ext) = struct.unpack_from("<4sIHHIQQBBHBBHII", data, p)
    if magic != RECORD_MAGIC:
        raise FormatError("bad record magic")
    if not (48 <= header_len <= 2 << 20 and header_len % 8 == 0 and n_ext <= 65536 and meta_len <= 1 << 20):
        raise FormatError("header length fields out of range")
    if header_len != align_up(48 + ns_len + key_len + meta_len, 8) + 16 * n_ext or not header_len <= record_len < 2**63:
        raise FormatError("inconsistent header_len / record_len")
    if p + header_len > len(data):
        raise FormatError("record header cut by end of file")
    header = data[p : p + header_len]
    if crc32c(header[8:]) != crc:
        raise FormatError("record header checksum")
    if reserved or flags & ~1 or not 3 <= align_log2 <= 21 or p % (1 << align_log2):
        raise FormatError("reserved / flags / alignment")
    q = 48
    namespace, key = header[q : q + ns_len], header[q + ns_len : q + ns_len + key_len]
    meta_bytes = header[q + ns_len + key_len : q + ns_len + key_len + meta_len]
    meta = unpack(meta_bytes) if meta_len else {}
    if not isinstance(meta, dict):
        raise FormatError("metadata is not a map")
    table = align_up(48 + ns_len + key_len + meta_len, 8)
    extents, pos = [], header_len
    for i in range(n_ext):
        length, ecrc, zero = struct.unpack_from("<QII", header, table + 16 * i)
        if zero:
            raise FormatError("reserved extent word")
        pos = align_up(pos, 1 << align_log2)
        extents.append((pos, length, ecrc))
        pos += length
    rec = Record(name, p, rtype, flags, lsn, record_len, kind, align_log2, codec, namespace, key, meta, extents)
    if rtype == PAD:
        if lsn or kind or ns_len or key_len or meta_len or n_ext or header_len != 48:
            raise FormatError("PAD with content")
    elif rtype == HOLE:
        if kind or ns_len or key_len or n_ext or lsn == 0 or type(meta.get("count")) is not int or meta["count"] < 1:
            raise FormatError("bad HOLE record")
    elif rtype == GROUP:
        count = meta.get("count")
        if kind or ns_len or key_len or n_ext or lsn == 0 or record_len != header_len or type(count) is not int \
                or not 1 <= count <= 4096:
            raise FormatError("bad GROUP record")
    elif rtype == SYNC:  # (1.3) every record up to LSN `durable` was synced before this one (§7.3)
        durable = meta.get("durable")
        if kind or ns_len or key_len or n_ext or lsn == 0 or record_len != header_len or type(durable) is not int \
                or not 0 <= durable < lsn:
            raise FormatError("bad SYNC record")
    elif rtype == HEADERS:  # (1.5) copies of record headers (§4.5)
        count = meta.get("count")
        if kind or ns_len or key_len or codec or n_ext != 1 or lsn == 0 or type(count) is not int or count < 1 \
                or record_len != extents[0][0] + extents[0][1]:
            raise FormatError("bad HEADERS record")
    elif rtype == DELETE:
        if kind or meta_len or n_ext or record_len != header_len or lsn == 0 or not ns_len or not key_len:
            raise FormatError("DELETE with content")
    elif rtype == PUT:
        if lsn == 0 or not 1 <= ns_len <= 100 or not 1 <= key_len <= 400 or codec not in CODECS:
            raise FormatError("PUT fields")
        lengths = expected_lengths(kind, meta)
        if codec == 0 and [e[1] for e in extents] != lengths or len(extents) != len(lengths) \
                or (pos if extents else header_len) != record_len:
            raise FormatError("extents do not match the metadata")
        if codec and KINDS.get(kind) not in CODECS[codec][1]:
            raise FormatError("codec does not apply to this kind")
        if codec >= 3 and meta.get("dtype") not in (1, 2, 3, 4):  # §6: lossy codecs take float data only
            raise FormatError("lossy codec on a dtype that is not float16/bfloat16/float32/float64")
        if (namespace == REF_NAMESPACE) != (kind == REF_KIND):
            raise FormatError("ref records belong to the reserved namespace, and only they do")
        if kind == REF_KIND:
            target = meta["key"]
            nl = key[0]
            sl = key[1 + nl] if len(key) > 1 + nl else 0
            if flags or not 1 <= nl <= 100 or not 1 <= sl <= 64 or len(key) != 2 + nl + sl + 16 \
                    or key[2 + nl + sl :] != hashlib.blake2b(target, digest_size=16).digest():
                raise FormatError("bad ref key")
    elif not rtype & IGNORABLE:
        raise FormatError(f"unknown record type {rtype}")
    if not header_only and p + record_len > len(data):
        raise FormatError("record cut by end of file")
    return rec


def header_copies(seg_dir: str, names: list[str], i: int, p: int) -> list[tuple[str, int, Record]]:
    """§4.5 (1.5): (file, offset of the HEADERS record, copy) for every copy of the header at
    offset p of segment names[i] that a valid HEADERS record after it holds, in log order
    (found by magic: ``copy_at`` keeps those that belong to the log)."""
    want, out = (int(names[i][:16], 16), p), []
    for j in range(i, len(names)):
        with open(os.path.join(seg_dir, names[j]), "rb") as f:
            data = f.read()
        q = data.find(RECORD_MAGIC, p + 1 if j == i else PAGE)
        while q != -1:
            try:
                r = parse_record(data, q, names[j]) if q % 8 == 0 else None
            except FormatError:
                r = None
            if r is not None and r.type == HEADERS and extents_ok(r, data):
                off, n, _ = r.extents[0]
                body, e = data[q + off : q + off + n], 0
                for _ in range(r.meta["count"]):
                    seg_id, hlen, at = struct.unpack_from("<IIQ", body, e)
                    if (seg_id, at) == want and body[e + 16 : e + 20] == bytes(4):  # a copy's magic: zeros
                        try:
                            copy = parse_record(RECORD_MAGIC + body[e + 20 : e + 16 + hlen], 0, names[j],
                                                header_only=True)
                            out.append((names[j], q, copy))
                        except FormatError:
                            pass
                    e += 16 + hlen
            q = data.find(RECORD_MAGIC, q + 1)
    return out


def reaches(seg_dir: str, names: list[str], i: int, p: int, lsn: int, target: tuple[str, int]) -> bool:
    """Reading valid records from offset p of names[i] (expecting LSN ``lsn``), and on through
    the later segments from their first record: does the log arrive at the record at ``target``?"""
    for j in range(i, len(names)):
        with open(os.path.join(seg_dir, names[j]), "rb") as f:
            data = f.read()
        q = p if j == i else PAGE
        while q < len(data):
            if q % PAGE and PAGE - q % PAGE < 48:
                q = align_up(q, PAGE)
                continue
            if data[q : q + 4] == b"\0\0\0\0":
                break
            if (names[j], q) >= target:
                return (names[j], q) == target
            try:
                r = parse_record(data, q, names[j])
            except FormatError:
                return False
            if r.type != PAD and j == i:
                if r.lsn != lsn:
                    return False
                lsn += r.meta["count"] if r.type == HOLE else 1
            q = align_up(q + r.record_len, 8)
        if names[j] >= target[0]:
            return False
    return False


def copy_at(seg_dir: str, names: list[str], i: int, p: int, lsn: int, size: int) -> Record | None:
    """§7.3 (1.5): the copy a damaged header at offset p of names[i] is read with: the LSN
    expected there, within the file, and its HEADERS record reached by reading the log from the
    end of the record it describes; the newest of them (a repair's copy supersedes)."""
    best = None
    for name, q, c in header_copies(seg_dir, names, i, p):
        if c.lsn != lsn or p % (1 << c.align_log2) or p + c.record_len > size:
            continue
        if reaches(seg_dir, names, i, align_up(p + c.record_len, 8), lsn + (c.meta["count"] if c.type == HOLE
                                                                            else 1), (name, q)):
            best = c
    return best


def expected_lengths(kind: int, meta: dict[str, Any]) -> list[int]:
    """SPEC.md §5.3."""
    def ints(v: Any) -> bool:
        return isinstance(v, list) and all(type(x) is int and x >= 1 for x in v)
    if kind == 1:
        shape, dt = meta.get("shape"), meta.get("dtype")
        if not ints(shape) or len(shape) != 5 or shape[1] != 2 or dt not in range(1, 7):
            raise FormatError("kv metadata")
        if type(meta.get("layer_start")) is not int or meta["layer_start"] < 0:
            raise FormatError("kv layer_start")
        layer = int(np.prod(shape[1:], dtype=object)) * np.dtype(DTYPES[dt][1]).itemsize
        return [layer] * shape[0]
    if kind == 5:  # 1.4: [layers, tokens, dim], one extent per layer
        shape, dt = meta.get("shape"), meta.get("dtype")
        if not ints(shape) or len(shape) != 3 or dt not in range(1, 7):
            raise FormatError("mla metadata")
        if type(meta.get("layer_start")) is not int or meta["layer_start"] < 0:
            raise FormatError("mla layer_start")
        return [shape[1] * shape[2] * np.dtype(DTYPES[dt][1]).itemsize] * shape[0]
    if kind == 2:
        shape, dt, rpe = meta.get("shape"), meta.get("dtype"), meta.get("rows_per_extent")
        if not ints(shape) or len(shape) != 2 or dt not in range(1, 9) or type(rpe) is not int or rpe < 1:
            raise FormatError("vectors metadata")
        if meta.get("metric") not in ("cosine", "l2", "ip") or type(meta.get("ids")) is not bool:
            raise FormatError("vectors metric / ids")
        n, dim = shape
        rows = [min(rpe, n - s) for s in range(0, n, rpe)]
        out = [r * dim * np.dtype(DTYPES[dt][1]).itemsize for r in rows]
        return out + [r * 8 for r in rows] if meta["ids"] else out
    if kind == REF_KIND:
        t = meta.get("key")
        if type(t) is not bytes or not 1 <= len(t) <= 400 or type(meta.get("key_str")) is not bool:
            raise FormatError("ref metadata")
        return []
    if kind == 3:
        if type(meta.get("size")) is not int or meta["size"] < 0 or not isinstance(meta.get("media_type"), str):
            raise FormatError("blob metadata")
        return [meta["size"]]
    raise FormatError(f"unknown kind {kind}")


def vouched_lsn(data: bytes, name: str) -> int:
    """§7.3: the largest LSN the valid SYNC records of a segment say was synced (0: none)."""
    best, p = 0, data.find(RECORD_MAGIC, PAGE)
    while p != -1:
        if p % 8 == 0:
            try:
                r = parse_record(data, p, name)
                if r.type == SYNC:
                    best = max(best, r.meta["durable"])
            except FormatError:
                pass
        p = data.find(RECORD_MAGIC, p + 1)
    return best


def extents_ok(r: Record, data: bytes) -> bool:
    """Every extent of a record matches its CRC-32C (§4.3)."""
    return all(crc32c(data[r.offset + off : r.offset + off + n]) == c for off, n, c in r.extents)


def scan(store: str) -> tuple[dict[tuple[bytes, bytes], Record], dict[str, bytes]]:
    """SPEC.md §12: the live records of a store, and each segment's bytes."""
    seg_dir = os.path.join(store, "segments")
    names = sorted(n for n in os.listdir(seg_dir) if n.endswith(".tseg") and len(n) == 21)
    if not names:
        raise FormatError("no segments")
    state: dict[tuple[bytes, bytes], Record] = {}
    files: dict[str, bytes] = {}
    group: list[Record] | None = None
    left = 0

    def apply(r: Record) -> None:
        if r.type == PUT:
            state[(r.namespace, r.key)] = r
        elif r.type == DELETE:
            state.pop((r.namespace, r.key), None)

    lsn = None
    uuid = None
    for i, name in enumerate(names):
        with open(os.path.join(seg_dir, name), "rb") as f:
            data = f.read()
        files[name] = data
        try:
            hdr = read_segment_header(data, name)
        except FormatError:
            # §7.4: the last of several segments, created but never durable (no record follows)
            if i == len(names) - 1 and i > 0 and data[PAGE : PAGE + 4] != RECORD_MAGIC:
                break
            raise
        if uuid is not None and hdr["store_uuid"] != uuid:
            raise FormatError(f"{name}: belongs to another store")
        uuid = hdr["store_uuid"]
        if lsn is not None and hdr["base_lsn"] < lsn:
            raise FormatError(f"{name}: base LSN {hdr['base_lsn']} goes back (below {lsn})")
        lsn = hdr["base_lsn"]  # LSNs are dense within a segment; compaction may leave gaps between
        last = i == len(names) - 1
        vouched = vouched_lsn(data, name) if last else 0  # §7.3: what SYNC records say was synced
        p = PAGE
        while p < len(data):
            if p % PAGE and PAGE - p % PAGE < 48:
                if any(data[p : align_up(p, PAGE)]):
                    break
                p = align_up(p, PAGE)
                continue
            if data[p : p + 4] == b"\0\0\0\0":
                if not last and any(data[p:]):  # §12: a sealed segment ends in zeros only
                    raise FormatError(f"{name}@{p}: zeros, then data, in a sealed segment")
                break
            try:
                r = parse_record(data, p, name)
                if last and r.type == PUT and r.lsn > vouched and not extents_ok(r, data):
                    raise FormatError("extent checksum")  # after the last synced point: a torn write
            except FormatError:
                if last and not (lsn is not None and lsn <= vouched):
                    break  # the end of the valid log (a torn tail) in the last segment
                # a sealed segment, or a record a SYNC record says was synced: damage -- unless
                # (1.5) a HEADERS record after it holds a copy of its header (§7.3)
                c = copy_at(seg_dir, names, i, p, lsn, len(data)) if lsn is not None else None
                if c is None:
                    raise
                r = replace(c, segment=name, offset=p)  # its object reads as corruption if an extent fails
            if r.type != PAD:
                if r.lsn != lsn:
                    if i != len(names) - 1:
                        raise FormatError(f"{name}@{p}: LSN {r.lsn}, expected {lsn}")
                    break
                lsn += r.meta["count"] if r.type == HOLE else 1
                if r.type == GROUP:  # §7.7: the next `count` records apply together or not at all
                    if group is not None:
                        raise FormatError(f"{name}@{p}: a group inside a group")
                    group, left = [], r.meta["count"]
                elif group is not None:
                    group.append(r)
                    left -= 1
                    if not left:
                        for g in group:
                            apply(g)
                        group = None
                else:
                    apply(r)
            p = align_up(p + r.record_len, 8)
        if group is not None:
            if i != len(names) - 1:
                raise FormatError(f"{name}: a sealed segment ends inside a group")
            group = None  # a crash cut the group: none of it happened
    return state, files


# --- §6: codecs -------------------------------------------------------------------------------
CODECS = {0: ("raw", ("kv", "vectors", "blob", "mla")),
          1: ("zstd", ("kv", "vectors", "blob", "mla")),
          2: ("shuffle+zstd", ("kv", "vectors", "mla")), 3: ("int8", ("kv", "mla")), 4: ("int4", ("kv",)),
          5: ("int2", ("kv",)), 6: ("fp8", ("kv", "mla")), 7: ("fp16", ("vectors",)), 8: ("int8", ("vectors",)),
          9: ("binary", ("vectors",)),
          10: ("kvq-ans", ("kv",))}


def rans_decode(b: bytes, f: np.ndarray, n: int) -> tuple[np.ndarray, int]:
    """§6.5: the n symbols of the rANS stream at the start of b, and the stream's length."""
    if int(f.sum()) != 4096:
        raise FormatError("rANS table does not sum to 4096")
    lanes = min(256, n)
    steps = -(-n // lanes)
    if len(b) < 4 * lanes + 4:
        raise FormatError("rANS stream cut")
    x = np.frombuffer(b, "<u4", lanes).astype(np.int64)
    n_words = struct.unpack_from("<I", b, 4 * lanes)[0]
    start = 4 * lanes + 4
    if len(b) < start + 2 * n_words or (x < 1 << 16).any():
        raise FormatError("rANS stream cut or bad state")
    words = np.frombuffer(b, "<u2", n_words, start).astype(np.int64)
    cum = np.concatenate([[0], np.cumsum(f)])
    symbol_of_slot = np.searchsorted(cum, np.arange(4096), side="right") - 1
    out = np.empty((steps, lanes), np.int64)
    used = 0
    for i in range(steps):
        slot = x % 4096
        s = symbol_of_slot[slot]
        out[i] = s
        x = f[s] * (x // 4096) + slot - cum[s]
        need = np.nonzero(x < 1 << 16)[0]  # increasing lane order
        if used + len(need) > n_words:
            raise FormatError("rANS stream ends early")
        x[need] = x[need] * 65536 + words[used : used + len(need)]
        used += len(need)
    if used != n_words or (x != 1 << 16).any():
        raise FormatError("rANS stream does not end cleanly")
    return out.reshape(-1)[:n], start + 2 * n_words


def zstd_frame_length(b: bytes) -> int:
    """RFC 8878 §3.1.1: the length of the frame at the start of `b` (header, blocks, checksum)."""
    import zstandard
    if b[:4] != b"\x28\xb5\x2f\xfd":
        raise FormatError("not a zstd frame")
    p = zstandard.frame_header_size(b)
    while True:
        if p + 3 > len(b):
            raise FormatError("zstd frame cut short")
        h = int.from_bytes(b[p : p + 3], "little")
        if (h >> 1) & 3 == 3:
            raise FormatError("reserved zstd block type")
        p += 3 + (1 if (h >> 1) & 3 == 1 else h >> 3)
        if h & 1:
            break
    return p + (4 if zstandard.get_frame_parameters(b).has_checksum else 0)


def unzstd(b: bytes, size: int | None, dictionary: bytes | None = None, limit: int = 0) -> bytes:
    """§6.2: exactly one frame (nothing after it) declaring exactly `size` bytes -- or, when `size`
    is None, whatever it declares up to `limit` -- checked before decompressing."""
    import zstandard
    try:
        declared = zstandard.frame_content_size(b)
        if zstd_frame_length(b) != len(b):
            raise FormatError("bytes after the zstd frame")
        if zstandard.get_frame_parameters(b).dict_id != (0 if dictionary is None else
                                                        int.from_bytes(dictionary[4:8], "little")):
            raise FormatError("zstd frame names another dictionary")
        if size is None:
            size = declared if 0 <= declared <= limit else -1
        if declared != size or declared < 0:
            raise FormatError(f"zstd frame declares {declared} bytes, expected {size}")
        if dictionary is None:
            dec = zstandard.ZstdDecompressor()
        else:
            dec = zstandard.ZstdDecompressor(dict_data=zstandard.ZstdCompressionDict(dictionary))
        out = dec.decompress(b, max_output_size=size)
    except zstandard.ZstdError as e:
        raise FormatError(f"zstd: {e}") from None
    if len(out) != size:
        raise FormatError("zstd frame size")
    return out


def f16_up_down(b: bytes) -> np.ndarray:
    return np.frombuffer(b, "<f2").astype(np.float32)


E4M3 = np.array([(-1.0) ** (c >> 7) * ((c & 7) / 8 * 2.0**-6 if (c >> 3) & 15 == 0
                                       else (1 + (c & 7) / 8) * 2.0 ** (((c >> 3) & 15) - 7)) for c in range(256)],
                dtype=np.float32)  # every value is exact in binary32
F32 = np.float32


def unpack_bits(b: bytes, bits: int, n: int) -> np.ndarray:
    a = np.frombuffer(b, np.uint8)
    per = 8 // bits
    return np.stack([(a >> (j * bits)) & ((1 << bits) - 1) for j in range(per)], axis=1).reshape(-1)[:n]


def decode_lossy(codec: int, b: bytes, shape: tuple[int, ...], params: dict[str, Any], layer: int = 0) -> np.ndarray:
    """§6.3-6.4: one extent's float32 values."""
    def take(n: int) -> bytes:
        nonlocal b
        if len(b) < n:
            raise FormatError("coded extent too short")
        out, b = b[:n], b[n:]
        return out
    if codec == 10:
        _, h, t, d = shape
        bins, shallow = params["bins"], params["shallow"]
        nb = bins[0] if layer < shallow else bins[1]
        p = f16_up_down(take(4 * h * d)).reshape(h, d, 2)
        mm = nb // 2 - 1
        sv = (2.0 ** ((np.frombuffer(take(h * t), np.uint8).astype(np.float64) - 180) / 8) * (127 / mm)).astype(F32)
        fk = np.frombuffer(take(2 * nb), "<u2").astype(np.int64)
        fv = np.frombuffer(take(2 * nb), "<u2").astype(np.int64)
        if fv[nb - 1]:
            raise FormatError("kvq-ans V table")
        ck, used = rans_decode(b, fk, h * t * d)
        take(used)
        cv, used = rans_decode(b, fv, h * t * d)
        take(used)
        lo, st = p[:, :, 0][:, None, :], p[:, :, 1][:, None, :]  # [h, 1, d]
        k = lo + ck.reshape(h, t, d).astype(F32) * st
        v = (cv.reshape(h, t, d) - (nb // 2 - 1)).astype(F32) * sv.reshape(h, t, 1)
        x = np.stack([k, v])
    elif codec in (3, 6) and len(shape) == 2:  # an MLA layer [t, c]: coded as a V half with one head
        t, c = shape
        if codec == 3:
            sv = (2.0 ** ((np.frombuffer(take(t), np.uint8).astype(np.float64) - 180) / 8)).astype(F32)
            q = np.frombuffer(take(t * c), np.int8).astype(F32)
        else:
            sv = f16_up_down(take(2 * t))
            q = np.frombuffer(take(t * c), np.uint8)
            if ((q & 0x7F) == 0x7F).any():
                raise FormatError("fp8 NaN code (never written)")
            q = E4M3[q]
        x = q.reshape(t, c) * sv.reshape(t, 1)
    elif codec in (3, 4, 5, 6):
        _, h, t, d = shape
        if codec in (3, 6):
            sk = f16_up_down(take(2 * h * d)).reshape(h, 1, d)
            if codec == 3:  # the binary32 nearest to 2^((cv - 180) / 8)
                sv = (2.0 ** ((np.frombuffer(take(h * t), np.uint8).astype(np.float64) - 180) / 8)).astype(F32)
            else:
                sv = f16_up_down(take(2 * h * t))
            sv = sv.reshape(h, t, 1)
            def fp8(q: bytes) -> np.ndarray:
                c = np.frombuffer(q, np.uint8)
                if ((c & 0x7F) == 0x7F).any():
                    raise FormatError("fp8 NaN code (never written)")  # §6.3
                return E4M3[c]
            table = (lambda q: np.frombuffer(q, np.int8).astype(F32)) if codec == 3 else fp8
            k = table(take(h * t * d)).reshape(h, t, d) * sk
            v = table(take(h * t * d)).reshape(h, t, d) * sv
        else:
            bits, g = (4 if codec == 4 else 2), params.get("group", 32)  # §6: group defaults to 32
            gt, gd = -(-t // g), -(-d // g)
            pk = f16_up_down(take(4 * h * d * gt)).reshape(h, d, gt, 2)
            pv = f16_up_down(take(4 * h * t * gd)).reshape(h, t, gd, 2)
            nbytes = -(-h * t * d // (8 // bits))
            ck = unpack_bits(take(nbytes), bits, h * t * d).reshape(h, t, d).astype(F32)
            cv = unpack_bits(take(nbytes), bits, h * t * d).reshape(h, t, d).astype(F32)
            ti, di = np.arange(t) // g, np.arange(d) // g
            k = pk[:, :, ti, 0].transpose(0, 2, 1) + ck * pk[:, :, ti, 1].transpose(0, 2, 1)
            v = pv[:, :, di, 0] + cv * pv[:, :, di, 1]
        x = np.stack([k, v])
    else:
        rows, n = shape
        if codec == 7:
            x = np.frombuffer(take(2 * rows * n), "<f2").astype(F32).reshape(rows, n)
        elif codec == 8:
            p = np.frombuffer(take(8 * rows), "<f4").reshape(rows, 2)
            x = p[:, :1] + np.frombuffer(take(rows * n), np.uint8).reshape(rows, n).astype(F32) * p[:, 1:]
        else:
            m = np.frombuffer(take(4 * rows), "<f4").reshape(rows, 1)
            bits = np.unpackbits(np.frombuffer(take(rows * -(-n // 8)), np.uint8).reshape(rows, -1), axis=1,
                                 count=n, bitorder="little")
            x = np.where(bits == 1, m, -m)
    if b:
        raise FormatError("coded extent too long")
    if x.size and not np.abs(x).max() <= 66000:  # §6.6 (NaN fails the comparison too)
        raise FormatError("decoded lossy value out of range")
    return x.astype(np.float32)


def to_stored(x: np.ndarray, dtype: int) -> bytes:
    """§6.1: binary32 values -> the record's dtype, round to nearest even."""
    name = DTYPES[dtype][0]
    if name == "bfloat16":
        u = x.view(np.uint32).astype(np.uint64)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2").tobytes()
    return x.astype({"float16": "<f2", "float32": "<f4", "float64": "<f8"}[name]).tobytes()


def decode_extent(r: Record, i: int, b: bytes, dictionary: bytes | None = None) -> bytes:
    """§6: the logical bytes of extent i from its stored bytes."""
    codec, m = r.codec, r.meta
    params = m.get("codec_params", {})
    logical = expected_lengths(r.kind, m)[i]
    if codec == 0:
        return b
    n_data = len(r.extents) // 2 if r.kind == 2 and m["ids"] else len(r.extents)
    if r.kind == 2 and i >= n_data:  # id extents: raw under a lossy codec (§6)
        if codec >= 3:
            return b
        width = 8
    else:
        width = 1 if r.kind == 3 else np.dtype(DTYPES[m["dtype"]][1]).itemsize
    if codec == 1:
        if ("dict" in params) != (dictionary is not None):
            raise FormatError("zstd dictionary missing")
        return unzstd(b, logical, dictionary)
    if codec == 2:
        s = np.frombuffer(unzstd(b, logical), np.uint8)
        return s.reshape(width, -1).T.tobytes()
    if r.kind in (1, 5):
        shape: tuple[int, ...] = tuple(m["shape"][1:])
    else:
        rpe = m["rows_per_extent"]
        shape = (min(rpe, m["shape"][0] - i * rpe), m["shape"][1])
    if "zstd" in params:  # §6.2: the codec's output in a zstd frame (decode_lossy checks its length)
        b = unzstd(b, None, limit=2 * logical + 8 * shape[0] + 4096)  # the codec's output is shorter
    layer = m["layer_start"] + i if r.kind in (1, 5) else 0
    out = to_stored(decode_lossy(codec, b, shape, params, layer), m["dtype"])
    if len(out) != logical:
        raise FormatError("decoded extent size")
    return out


def decode(r: Record, data: bytes, dictionary: bytes | None = None) -> Any:
    """The object of a PUT record, every extent checksum verified and decoded (§6);
    ``dictionary``: the zstd dictionary its `codec_params.dict` names (see `dictionary_for`)."""
    parts = []
    for i, (off, length, ecrc) in enumerate(r.extents):
        b = data[r.offset + off : r.offset + off + length]
        if len(b) != length or crc32c(b) != ecrc:
            raise FormatError(f"{r.segment}@{r.offset}: extent checksum")
        parts.append(decode_extent(r, i, b, dictionary))
    m = r.meta
    if r.kind == 3:
        return parts[0]
    name, storage = DTYPES[m["dtype"]]
    if r.kind in (1, 5):
        return np.frombuffer(b"".join(parts), dtype=storage).reshape(m["shape"])
    n, dim = m["shape"]
    e = -(-n // m["rows_per_extent"])
    arr = np.frombuffer(b"".join(parts[:e]), dtype=storage).reshape(n, dim)
    ids = np.frombuffer(b"".join(parts[e:]), dtype="<i8") if m["ids"] else None
    return arr, ids


def dictionary_for(r: Record, state: dict[tuple[bytes, bytes], Record], files: dict[str, bytes]) -> bytes | None:
    """§6.2: the zstd dictionary a record names: a blob in namespace "\\x00dict" whose key is
    ns_len ns dict_id:u32be."""
    did = r.meta.get("codec_params", {}).get("dict")
    if did is None:
        return None
    d = state.get((b"\x00dict", bytes((len(r.namespace),)) + r.namespace + struct.pack(">I", did)))
    if d is None:
        raise FormatError(f"zstd dictionary {did} missing")
    return decode(d, files[d.segment])


def describe(store: str) -> list[dict[str, Any]]:
    state, files = scan(store)
    out = []
    for (ns, key), r in sorted(state.items()):
        if ns.startswith(b"\x00"):
            continue  # reserved for the engine (§5.4, §6.2): references and dictionaries, not objects
        obj = decode(r, files[r.segment], dictionary_for(r, state, files))
        item: dict[str, Any] = {"namespace": ns.decode(), "key": key.decode() if r.flags & 1 else "0x" + key.hex(),
                                "kind": KINDS[r.kind], "lsn": r.lsn, "meta": r.meta.get("meta", {})}
        if r.kind == 3:
            item.update(size=len(obj), media_type=r.meta["media_type"], crc32c=crc32c(obj))
        else:
            arr = obj if r.kind in (1, 5) else obj[0]
            item.update(dtype=DTYPES[r.meta["dtype"]][0], shape=list(arr.shape), crc32c=crc32c(arr.tobytes()))
            if r.kind in (1, 5):
                item["layer_start"] = r.meta["layer_start"]
            else:
                item["metric"] = r.meta["metric"]
                item["ids_crc32c"] = None if obj[1] is None else crc32c(obj[1].tobytes())
        out.append(item)
    return out


def references(store: str) -> dict[tuple[str, str], list[str]]:
    """SPEC.md §5.4: (namespace, key) -> the sessions holding a reference ("" is the anchor)."""
    state, _ = scan(store)
    out: dict[tuple[str, str], list[str]] = {}
    for (ns, key), r in state.items():
        if ns != REF_NAMESPACE:
            continue
        nl = key[0]
        target_ns, session = key[1 : 1 + nl], key[2 + nl : 2 + nl + key[1 + nl]]
        target = r.meta["key"]
        if (target_ns, target) not in state:
            raise FormatError(f"reference of session {session!r} on a missing object")
        shown = target.decode() if r.meta["key_str"] else "0x" + target.hex()
        out.setdefault((target_ns.decode(), shown), []).append("" if session == b"\x00" else session.decode())
    return {k: sorted(v) for k, v in sorted(out.items())}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 2
    items = describe(argv[0])
    if "--json" in argv:
        print(json.dumps(items, indent=2))
    else:
        for it in items:
            size = it.get("shape", it.get("size"))
            print(f"{it['namespace']}\t{it['key']}\t{it['kind']}\t{size}\t{it.get('dtype', '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
