"""Record framing and the metadata schema (SPEC.md §4, §5): bytes <-> RecordHeader.

A record is the unit of the log and of every tier:

    record      := fixed:48 namespace key meta pad8 extent_table padA extent (padA extent)*
    fixed       := magic:4 header_crc:u32 type:u16 flags:u16 header_len:u32 lsn:u64
                   record_len:u64 kind:u8 align_log2:u8 codec:u16 ns_len:u8 reserved:u8
                   key_len:u16 meta_len:u32 n_extents:u32
    extent_table:= (stored_len:u64 crc32c:u32 reserved:u32){n_extents}

This module owns encoding, and validation on decode: magic, then bounds (before anything is
allocated), then the header checksum, then the metadata schema and extent lengths, all with
exact integer arithmetic.  It does no I/O and knows nothing about files or the index.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

import crc32c as _crc32c
import msgpack

from .. import codecs
from ..errors import CorruptionError, InvalidObject
from . import constants as fmt
from .layout import extent_codec, extent_shapes

_ZERO_PAGE = bytes(fmt.PAGE)
_ZERO_VIEW = memoryview(_ZERO_PAGE)
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
INT64_MAX = (1 << 63) - 1
_crc = _crc32c.crc32c
crc32c = _crc32c.crc32c  # crc32c(data, value=0): CRC-32C (Castagnoli), unmasked, of any C-contiguous buffer


_POLY = 0x82F63B78
_COMBINE: dict[int, list[list[int]]] = {}


def _gf2_times(mat: list[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _zeros_operator(nbytes: int) -> list[list[int]]:
    """Byte-indexed tables of the GF(2) operator that appends ``nbytes`` zero bytes to a CRC
    (zlib's crc32_combine method, precomputed once per length)."""
    odd = [_POLY] + [1 << (n - 1) for n in range(1, 32)]  # one zero bit
    result = [1 << n for n in range(32)]  # identity
    length = nbytes * 8
    power = odd
    while length:
        if length & 1:
            result = [_gf2_times(power, v) for v in result]
        length >>= 1
        if length:
            power = [_gf2_times(power, v) for v in power]
    return [[_gf2_times(result, b << (8 * k)) for b in range(256)] for k in range(4)]


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32C of A+B from crc(A), crc(B) and len(B): lets halves be checksummed in parallel."""
    tables = _COMBINE.get(len2)
    if tables is None:
        if len(_COMBINE) > 256:
            _COMBINE.clear()
        tables = _COMBINE[len2] = _zeros_operator(len2)
    t0, t1, t2, t3 = tables
    return t0[crc1 & 0xFF] ^ t1[(crc1 >> 8) & 0xFF] ^ t2[(crc1 >> 16) & 0xFF] ^ t3[crc1 >> 24] ^ crc2


def align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def zeros(n: int) -> memoryview:
    """A read-only view of ``n`` zero bytes (n <= one page) for padding iovecs."""
    return _ZERO_VIEW[:n] if n <= fmt.PAGE else memoryview(bytes(n))


def extent_offsets(header_len: int, align_log2: int, lengths: Sequence[int]) -> tuple[int, ...]:
    """Offsets of the extents relative to the record start (SPEC.md §4.3)."""
    a = 1 << align_log2
    offsets = []
    pos = header_len
    for n in lengths:
        pos = (pos + a - 1) // a * a
        offsets.append(pos)
        pos += n
    return tuple(offsets)


class RecordHeader(NamedTuple):
    """A record header.  ``raw`` is its exact bytes (crc-protected); ``offsets`` are the
    extents' offsets relative to the record start, derived from the lengths."""

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
    extent_lengths: tuple[int, ...]
    extent_crcs: tuple[int, ...]
    header_crc: int
    raw: bytes
    offsets: tuple[int, ...]

    @property
    def header_len(self) -> int:
        return len(self.raw)

    @property
    def key_is_str(self) -> bool:
        return bool(self.flags & fmt.FLAG_KEY_STR)

    def stamped(self, lsn: int) -> "RecordHeader":
        """The same header with LSN ``lsn`` and its checksum computed: used when appending."""
        buf = bytearray(self.raw)
        _U64.pack_into(buf, 16, lsn)
        crc = _crc(memoryview(buf)[8:])
        _U32.pack_into(buf, 4, crc)
        return RecordHeader(self.type, self.flags, lsn, self.record_len, self.kind, self.align_log2, self.codec,
                            self.namespace, self.key, self.meta, self.extent_lengths, self.extent_crcs, crc,
                            bytes(buf), self.offsets)


class Pieces(tuple):  # type: ignore[type-arg]
    """One extent made of several byte buffers that follow each other in the record (a
    scattered put: a KV layer whose K and V are separate tensors).  They are written with one
    gathered write and checksummed in order: the record is the same as from one buffer, with
    no staging copy."""

    __slots__ = ()

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self)

    def tobytes(self) -> bytes:
        return b"".join(self)


def extent_crc(ext: Any) -> int:
    """CRC-32C of an extent buffer or of ``Pieces`` (chained over the pieces)."""
    if type(ext) is not Pieces:
        return _crc(ext)
    value = 0
    for p in ext:
        value = _crc(p, value)
    return value


class EncodedRecord(NamedTuple):
    """A record ready for ``pwritev``: its header plus the buffers of its extents.

    ``body`` replaces ``extents`` when a record is copied byte for byte (compaction): it
    holds every byte after the header.
    """

    header: RecordHeader
    extents: tuple[memoryview, ...] = ()
    body: memoryview | None = None

    @property
    def record_len(self) -> int:
        return self.header.record_len

    @property
    def align_log2(self) -> int:
        return self.header.align_log2

    def iovecs(self, header: RecordHeader | None = None) -> list[memoryview | bytes]:
        """Buffers covering [0, record_len): header, zero padding, extents."""
        h = header or self.header
        out: list[memoryview | bytes] = [h.raw]
        if self.body is not None:
            out.append(self.body)
            return out
        pos = len(h.raw)
        for off, ext in zip(h.offsets, self.extents):
            if off > pos:
                out.append(zeros(off - pos))
            if type(ext) is Pieces:
                out.extend(p for p in ext if p.nbytes)
            elif ext.nbytes:
                out.append(ext)
            pos = off + ext.nbytes
        return out


def header_length(namespace: bytes, key: bytes, meta_bytes: bytes, n_extents: int) -> int:
    body_end = fmt.RECORD_HEADER_SIZE + len(namespace) + len(key) + len(meta_bytes)
    return (body_end + 7) // 8 * 8 + fmt.EXTENT_ENTRY.size * n_extents


def _pack_header(rtype: int, lsn: int, record_len: int, kind: int, align_log2: int, codec: int, flags: int,
                 namespace: bytes, key: bytes, meta_bytes: bytes, table: bytes, n_extents: int,
                 checksum: bool = True) -> bytes:
    """The header bytes; without ``checksum`` the crc field is left 0 (``stamped`` fills it)."""
    body = namespace + key + meta_bytes
    pad = -(fmt.RECORD_HEADER_SIZE + len(body)) % 8
    header_len = fmt.RECORD_HEADER_SIZE + len(body) + pad + len(table)
    raw = b"".join((
        fmt.RECORD_HEADER.pack(fmt.RECORD_MAGIC, 0, rtype, flags, header_len, lsn, record_len, kind, align_log2,
                               codec, len(namespace), 0, len(key), len(meta_bytes), n_extents),
        body, _ZERO_PAGE[:pad], table,
    ))
    if not checksum:
        return raw
    return raw[:4] + _U32.pack(_crc(memoryview(raw)[8:])) + raw[8:]


def byte_view(buf: Any) -> memoryview:
    """A 1-d unsigned-byte memoryview of any C-contiguous buffer (no copy)."""
    m = memoryview(buf)
    return m if m.format == "B" and m.ndim == 1 else m.cast("B")


_HEADER_PACK = fmt.RECORD_HEADER.pack
_ENTRY_PACK = fmt.EXTENT_ENTRY.pack


def encode_put(
    namespace: bytes,
    key: bytes,
    flags: int,
    kind: int,
    meta: dict[str, Any],
    extents: Sequence[memoryview],
    align_log2: int,
    codec: int = fmt.CODEC_RAW,
) -> EncodedRecord:
    """Frame a PUT record (LSN 0: ``RecordHeader.stamped`` sets it).

    ``extents`` are byte-format memoryviews (``block.encode_block`` makes them); their
    CRC-32C is computed here, without copying them.
    """
    meta_bytes = pack_meta(meta)
    lengths = tuple([e.nbytes for e in extents])
    crcs = tuple([_crc(e) if type(e) is not Pieces else extent_crc(e) for e in extents])
    n = len(lengths)
    body = namespace + key + meta_bytes
    pad = -(fmt.RECORD_HEADER_SIZE + len(body)) % 8
    header_len = fmt.RECORD_HEADER_SIZE + len(body) + pad + fmt.EXTENT_ENTRY.size * n
    offsets = extent_offsets(header_len, align_log2, lengths)
    record_len = offsets[-1] + lengths[-1] if n else header_len
    raw = b"".join([
        _HEADER_PACK(fmt.RECORD_MAGIC, 0, fmt.REC_PUT, flags, header_len, 0, record_len, kind, align_log2, codec,
                     len(namespace), 0, len(key), len(meta_bytes), n),
        body, _ZERO_PAGE[:pad], *[_ENTRY_PACK(ln, c, 0) for ln, c in zip(lengths, crcs)],
    ])
    header = RecordHeader(fmt.REC_PUT, flags, 0, record_len, kind, align_log2, codec, namespace, key, meta,
                          lengths, crcs, 0, raw, offsets)
    return EncodedRecord(header, tuple(extents))


def encode_delete(namespace: bytes, key: bytes, flags: int) -> EncodedRecord:
    """Frame a DELETE record (LSN 0: ``RecordHeader.stamped`` sets it)."""
    n = header_length(namespace, key, b"", 0)
    raw = _pack_header(fmt.REC_DELETE, 0, n, fmt.KIND_NONE, fmt.ALIGN_INLINE_LOG2, fmt.CODEC_RAW, flags,
                       namespace, key, b"", b"", 0, checksum=False)
    header = RecordHeader(fmt.REC_DELETE, flags, 0, n, fmt.KIND_NONE, fmt.ALIGN_INLINE_LOG2, fmt.CODEC_RAW,
                          namespace, key, {}, (), (), 0, raw, ())
    return EncodedRecord(header)


def _control(rtype: int, meta: dict[str, Any]) -> EncodedRecord:
    """A record that changes no object: no namespace, key or extents; LSN stamped at append."""
    meta_bytes = pack_meta(meta)
    n = header_length(b"", b"", meta_bytes, 0)
    raw = _pack_header(rtype, 0, n, fmt.KIND_NONE, fmt.ALIGN_INLINE_LOG2, fmt.CODEC_RAW, 0,
                       b"", b"", meta_bytes, b"", 0, checksum=False)
    return EncodedRecord(RecordHeader(rtype, 0, 0, n, fmt.KIND_NONE, fmt.ALIGN_INLINE_LOG2, fmt.CODEC_RAW,
                                      b"", b"", meta, (), (), 0, raw, ()))


def encode_group(count: int) -> EncodedRecord:
    """Frame a GROUP record: the next ``count`` records are one atomic unit (SPEC.md §7.7)."""
    if not 1 <= count <= fmt.GROUP_MAX:
        raise ValueError(f"a group holds 1 to {fmt.GROUP_MAX} records")
    return _control(fmt.REC_GROUP, {"count": count})


def encode_sync(durable: int) -> EncodedRecord:
    """Frame a SYNC record: every record with an LSN up to ``durable`` was synced before this
    one was written (SPEC.md §4.5, §7.3)."""
    return _control(fmt.REC_SYNC, {"durable": durable})


def encode_headers(copies: Sequence[tuple[int, int, bytes]]) -> EncodedRecord:
    """Frame a HEADERS record (SPEC.md §4.5): copies of the headers of records at (segment,
    offset), so that a reader can still read a record whose own header is damaged (§7.3).  Its
    one extent holds, per copy, ``segment_id:u32 header_len:u32 offset:u64`` and the header with
    its magic written as zeros (outside the header checksum), so that a reader resynchronising
    by magic never takes a copy for the log."""
    body = b"".join(b"".join((fmt.HEADER_COPY.pack(seg, len(raw), off), _NO_MAGIC, memoryview(raw)[4:]))
                    for seg, off, raw in copies)
    ext = memoryview(body)
    meta_bytes = pack_meta({"count": len(copies)})
    crc = _crc(ext)
    header_len = header_length(b"", b"", meta_bytes, 1)
    offsets = extent_offsets(header_len, fmt.ALIGN_INLINE_LOG2, (len(body),))
    record_len = offsets[0] + len(body)
    raw = _pack_header(fmt.REC_HEADERS, 0, record_len, fmt.KIND_NONE, fmt.ALIGN_INLINE_LOG2, fmt.CODEC_RAW, 0,
                       b"", b"", meta_bytes, _ENTRY_PACK(len(body), crc, 0), 1, checksum=False)
    header = RecordHeader(fmt.REC_HEADERS, 0, 0, record_len, fmt.KIND_NONE, fmt.ALIGN_INLINE_LOG2, fmt.CODEC_RAW,
                          b"", b"", {"count": len(copies)}, (len(body),), (crc,), 0, raw, offsets)
    return EncodedRecord(header, (ext,))


_NO_MAGIC = bytes(4)  # a copy's magic, as a HEADERS record holds it


def header_copies(h: RecordHeader, body: Any, want: tuple[int, int] | None = None,
                  **where: Any) -> list[tuple[int, int, RecordHeader]]:
    """The copies a HEADERS record ``h`` holds (``body``: its extent, checksum already checked):
    (segment, offset, header) each, every copy's own checksum and layout checked; with ``want``,
    only the copies of the header at that (segment, offset), the others not decoded."""
    b, out, p, count = memoryview(body), [], 0, 0
    while p < len(b):
        if p + fmt.HEADER_COPY.size > len(b):
            raise CorruptionError("HEADERS record entry truncated", **where)
        seg, n, off = fmt.HEADER_COPY.unpack_from(b, p)
        p += fmt.HEADER_COPY.size
        if n > len(b) - p or n < fmt.RECORD_HEADER_SIZE or b[p : p + 4] != _NO_MAGIC:
            raise CorruptionError("HEADERS record entry is not a header copy", **where)
        if want is None or (seg, off) == want:
            hdr = decode_header(fmt.RECORD_MAGIC + bytes(b[p + 4 : p + n]), **where)
            if hdr.header_len != n:
                raise CorruptionError("HEADERS record entry length mismatch", **where)
            out.append((seg, off, hdr))
        p += n
        count += 1
    if count != h.meta["count"]:
        raise CorruptionError(f"HEADERS record holds {count} copies, says {h.meta['count']}", **where)
    return out


def dict_key(namespace: bytes, dict_id: int) -> bytes:
    """The key, in the reserved namespace ``"\\x00dict"``, of the zstd dictionary ``dict_id`` of
    ``namespace`` (SPEC.md §6.2): ``ns_len:u8 namespace dict_id:u32be``."""
    return bytes((len(namespace),)) + namespace + dict_id.to_bytes(4, "big")


def ref_target_hash(key: bytes) -> bytes:
    """The hash of a referenced key that ends its ref keys (SPEC.md §5.4)."""
    return hashlib.blake2b(key, digest_size=fmt.REF_KEY_HASH_BYTES).digest()


def ref_key(namespace: bytes, session: bytes, key: bytes) -> bytes:
    """The key of the ref record of ``session`` on (namespace, key) (SPEC.md §5.4)."""
    return bytes((len(namespace),)) + namespace + bytes((len(session),)) + session + ref_target_hash(key)


def ref_prefix(namespace: bytes, session: bytes | None = None) -> bytes:
    """Leading bytes shared by the ref keys of a namespace (and session)."""
    p = bytes((len(namespace),)) + namespace
    return p if session is None else p + bytes((len(session),)) + session


def parse_ref_key(k: bytes) -> tuple[bytes, bytes, bytes] | None:
    """(namespace, session, key hash) of a ref key, or None if it is not one."""
    if len(k) < 2:
        return None
    nl = k[0]
    if not 1 <= nl <= fmt.NAMESPACE_MAX_BYTES or len(k) < 2 + nl:
        return None
    sl = k[1 + nl]
    if not 1 <= sl <= fmt.SESSION_MAX_BYTES or len(k) != 2 + nl + sl + fmt.REF_KEY_HASH_BYTES:
        return None
    return k[1 : 1 + nl], k[2 + nl : 2 + nl + sl], k[2 + nl + sl :]


def encode_ref(namespace: bytes, session: bytes, key: bytes, key_is_str: bool) -> EncodedRecord:
    """Frame the PUT of a ref record: ``session`` holds a reference on (namespace, key)."""
    return encode_put(fmt.REF_NAMESPACE, ref_key(namespace, session, key), 0, fmt.KIND_REF,
                      {"key": key, "key_str": key_is_str}, (), fmt.ALIGN_INLINE_LOG2)


def lsn_span(h: RecordHeader) -> int:
    """How many LSNs a record accounts for: 0 for PAD, ``count`` for HOLE, 1 otherwise."""
    if h.type == fmt.REC_PAD:
        return 0
    return h.meta["count"] if h.type == fmt.REC_HOLE else 1


def encode_filler(length: int, lsn: int = 0, count: int = 0) -> bytes:
    """``length`` bytes (>= 48) that stand in for damaged ones: a HOLE record accounting for the
    LSNs [lsn, lsn + count) when count > 0, else a PAD record; zero-filled after the header."""
    if count:
        meta = pack_meta({"count": count})
        hlen = header_length(b"", b"", meta, 0)
        if hlen > length:
            raise ValueError("no room for a HOLE record")
        header = _pack_header(fmt.REC_HOLE, lsn, length, fmt.KIND_NONE, fmt.ALIGN_INLINE_LOG2, fmt.CODEC_RAW,
                              0, b"", b"", meta, b"", 0)
        return header + bytes(length - len(header))
    return encode_pad(length)


def encode_pad(length: int) -> bytes:
    """A PAD record covering ``length`` bytes (>= 48): header plus zeros."""
    if length < fmt.RECORD_HEADER_SIZE:
        raise ValueError("pad shorter than a record header")
    header = _pack_header(fmt.REC_PAD, 0, length, fmt.KIND_NONE, fmt.ALIGN_INLINE_LOG2, fmt.CODEC_RAW,
                          0, b"", b"", b"", b"", 0)
    return header + bytes(length - len(header))


# --- decoding -----------------------------------------------------------------------------


META_LEN_FIELD = 13  # index of meta_len in fmt.RECORD_HEADER's fields (magic first)


class Fixed(NamedTuple):
    """The 48-byte fixed part, magic and length-checked but not yet checksum-verified."""

    header_crc: int
    type: int
    flags: int
    header_len: int
    lsn: int
    record_len: int
    kind: int
    align_log2: int
    codec: int
    ns_len: int
    reserved: int
    key_len: int
    meta_len: int
    n_extents: int


def parse_fixed(b: Any, **where: Any) -> Fixed:
    """Check magic and the length fields of a fixed header (SPEC.md §4.4 steps 1-3)."""
    if len(b) < fmt.RECORD_HEADER_SIZE:
        raise CorruptionError("record header truncated", **where)
    (magic, crc, rtype, flags, header_len, lsn, record_len, kind, align_log2, codec, ns_len, reserved,
     key_len, meta_len, n_extents) = fmt.RECORD_HEADER.unpack_from(b, 0)
    if magic != fmt.RECORD_MAGIC:
        raise CorruptionError("bad record magic", **where)
    if not fmt.RECORD_HEADER_SIZE <= header_len <= fmt.HEADER_MAX_BYTES or header_len % 8:
        raise CorruptionError(f"bad header_len {header_len}", **where)
    if n_extents > fmt.MAX_EXTENTS or meta_len > fmt.META_MAX_BYTES:
        raise CorruptionError("extent count or metadata length over the limit", **where)
    expect = align_up(fmt.RECORD_HEADER_SIZE + ns_len + key_len + meta_len, 8) + fmt.EXTENT_ENTRY.size * n_extents
    if expect != header_len:
        raise CorruptionError(f"header_len {header_len} does not match its parts ({expect})", **where)
    if record_len < header_len or record_len > INT64_MAX:
        raise CorruptionError(f"bad record_len {record_len}", **where)
    return Fixed(crc, rtype, flags, header_len, lsn, record_len, kind, align_log2, codec, ns_len, reserved,
                 key_len, meta_len, n_extents)


def salvage(b: bytes, expect_lsn: int | None) -> tuple[int, bytes, bytes, int, int] | None:
    """Best effort for repair: (type, namespace, key, lsn, record_len) of a damaged PUT/DELETE
    header whose framing still adds up and whose LSN is the expected one, ignoring its magic and
    checksum; None when it does not look like one.  Used only to hide the key of a record that
    was lost, so that an older version of it does not come back."""
    if len(b) < fmt.RECORD_HEADER_SIZE:
        return None
    (_, _, rtype, _, header_len, lsn, record_len, _, _, _, ns_len, _, key_len, meta_len,
     n_extents) = fmt.RECORD_HEADER.unpack_from(b, 0)
    if rtype not in (fmt.REC_PUT, fmt.REC_DELETE) or (expect_lsn is not None and lsn != expect_lsn):
        return None
    if not (1 <= ns_len <= fmt.NAMESPACE_MAX_BYTES and 1 <= key_len <= fmt.KEY_MAX_BYTES):
        return None
    if header_len != align_up(fmt.RECORD_HEADER_SIZE + ns_len + key_len + meta_len, 8) + 16 * n_extents:
        return None
    if not header_len <= record_len <= INT64_MAX or len(b) < fmt.RECORD_HEADER_SIZE + ns_len + key_len:
        return None
    p = fmt.RECORD_HEADER_SIZE
    return rtype, bytes(b[p : p + ns_len]), bytes(b[p + ns_len : p + ns_len + key_len]), lsn, record_len


def decode_header(b: Any, fixed: Fixed | None = None, *, verify: bool = True, **where: Any) -> RecordHeader:
    """Validate and decode a record header from ``b`` (which holds at least header_len bytes).

    Order of checks: magic and lengths (parse_fixed), checksum, then contents.  Raises
    CorruptionError naming the failed check; never allocates more than header_len bytes.
    """
    f = fixed or parse_fixed(b, **where)
    if len(b) < f.header_len:
        raise CorruptionError("record header truncated", **where)
    raw = bytes(b[: f.header_len])
    if verify and crc32c(memoryview(raw)[8:]) != f.header_crc:
        raise CorruptionError("record header checksum mismatch", **where)
    if f.reserved != 0:
        raise CorruptionError("reserved header byte is not zero", **where)
    if f.type & fmt.REC_TYPE_IGNORABLE == 0 and f.type not in (fmt.REC_PUT, fmt.REC_DELETE, fmt.REC_PAD,
                                                                fmt.REC_HOLE):
        raise CorruptionError(f"unknown record type {f.type}", **where)
    if f.flags & ~fmt.FLAGS_KNOWN:
        raise CorruptionError(f"unknown record flags {f.flags:#x}", **where)
    if not fmt.ALIGN_LOG2_MIN <= f.align_log2 <= fmt.ALIGN_LOG2_MAX:
        raise CorruptionError(f"bad align_log2 {f.align_log2}", **where)
    p = fmt.RECORD_HEADER_SIZE
    namespace = raw[p : p + f.ns_len]
    p += f.ns_len
    key = raw[p : p + f.key_len]
    p += f.key_len
    meta_bytes = raw[p : p + f.meta_len]
    p = align_up(p + f.meta_len, 8)
    lengths, crcs = [], []
    for n, c, r in fmt.EXTENT_ENTRY.iter_unpack(raw[p : p + fmt.EXTENT_ENTRY.size * f.n_extents]):
        if r != 0:
            raise CorruptionError("reserved extent field is not zero", **where)
        lengths.append(n)
        crcs.append(c)
    lengths_t = tuple(lengths)
    memo = (f.kind, f.codec, meta_bytes, lengths_t) if f.type == fmt.REC_PUT and f.kind != fmt.KIND_REF \
        and f.meta_len <= _CHECKED_META_ENTRY_MAX else None
    meta = _CHECKED_META.get(memo) if memo is not None else None
    checked = meta is not None
    if meta is None:
        meta = unpack_meta(meta_bytes, **where) if f.meta_len else {}
    hdr = RecordHeader(f.type, f.flags, f.lsn, f.record_len, f.kind, f.align_log2, f.codec, namespace, key,
                       meta, lengths_t, tuple(crcs), f.header_crc, raw,
                       extent_offsets(f.header_len, f.align_log2, lengths_t))
    _check_layout(hdr, contents_checked=checked, **where)
    if memo is not None and not checked:
        global _checked_meta_bytes
        if len(_CHECKED_META) >= _CHECKED_META_MAX or _checked_meta_bytes >= _CHECKED_META_BYTES:
            _CHECKED_META.clear()
            _checked_meta_bytes = 0
        _CHECKED_META[memo] = meta
        _checked_meta_bytes += f.meta_len
    return hdr


# (kind, codec, metadata bytes, extent lengths) of PUT records whose contents passed
# _check_put_contents -> their metadata, decoded once: the records of a batch or of one model's
# chunks share them, and a scan decodes thousands.  Exact (the whole key is what the check
# reads); the dicts are shared, as headers are (readers never change them: user metadata is
# copied out).  Bounded by entries and by metadata bytes (cleared when full); metadata over
# 4 KiB (large user metadata: a hit saves little) is not remembered.  With a remote tier each
# put's ``version`` makes its metadata unique: no hits, a small bounded cost.
_CHECKED_META: dict[tuple[int, int, bytes, tuple[int, ...]], dict[str, Any]] = {}
_CHECKED_META_MAX = 4096
_CHECKED_META_BYTES = 1 << 20
_CHECKED_META_ENTRY_MAX = 4096
_checked_meta_bytes = 0


def _check_layout(h: RecordHeader, *, contents_checked: bool = False, **where: Any) -> None:
    """Type-specific rules: key/namespace presence, extent placement, metadata schema
    (``contents_checked``: a PUT whose kind, codec, metadata and extent lengths passed
    ``_check_put_contents`` before, in another record)."""
    if h.type == fmt.REC_PAD:
        if (h.kind or h.namespace or h.key or h.meta or h.extent_lengths or h.lsn
                or h.header_len != fmt.RECORD_HEADER_SIZE):  # header_len 48: meta_len 0 (§4.5)
            raise CorruptionError("PAD record with content", **where)
        return
    if h.type == fmt.REC_HOLE:
        count = h.meta.get("count")
        if (h.kind or h.namespace or h.key or h.extent_lengths or not h.lsn or type(count) is not int
                or not 1 <= count < 2**32):
            raise CorruptionError("bad HOLE record", **where)
        return
    if h.type == fmt.REC_GROUP:
        count = h.meta.get("count")
        if (h.kind or h.namespace or h.key or h.extent_lengths or not h.lsn or h.record_len != h.header_len
                or type(count) is not int or not 1 <= count <= fmt.GROUP_MAX):
            raise CorruptionError("bad GROUP record", **where)
        return
    if h.type == fmt.REC_SYNC:
        durable = h.meta.get("durable")
        if (h.kind or h.namespace or h.key or h.extent_lengths or not h.lsn or h.record_len != h.header_len
                or type(durable) is not int or not 0 <= durable < h.lsn):
            raise CorruptionError("bad SYNC record", **where)
        return
    if h.type == fmt.REC_HEADERS:
        count = h.meta.get("count")
        if (h.kind or h.namespace or h.key or len(h.extent_lengths) != 1 or not h.lsn or h.codec
                or type(count) is not int or not 1 <= count <= h.extent_lengths[0] // fmt.HEADER_COPY.size
                or h.record_len != h.offsets[0] + h.extent_lengths[0]):
            raise CorruptionError("bad HEADERS record", **where)
        return
    if h.type & fmt.REC_TYPE_IGNORABLE:
        return  # unknown but ignorable: framing is all a v1 reader checks
    if not 1 <= len(h.namespace) <= fmt.NAMESPACE_MAX_BYTES or not 1 <= len(h.key) <= fmt.KEY_MAX_BYTES:
        raise CorruptionError("namespace or key length out of range", **where)
    if h.lsn == 0:
        raise CorruptionError("record LSN is zero", **where)
    if h.type == fmt.REC_DELETE:
        if (h.kind != fmt.KIND_NONE or h.extent_lengths or h.meta or h.record_len != h.header_len
                or fmt.RECORD_HEADER.unpack_from(h.raw)[META_LEN_FIELD]):
            raise CorruptionError("DELETE record with content", **where)  # meta_len 0 (§4.5)
        return
    if (h.namespace == fmt.REF_NAMESPACE) != (h.kind == fmt.KIND_REF):
        raise CorruptionError("ref records live in the reserved ref namespace, and only they do", **where)
    if h.kind == fmt.KIND_REF:
        target = h.meta.get("key")
        parsed = parse_ref_key(h.key)
        if (type(target) is not bytes or not 1 <= len(target) <= fmt.KEY_MAX_BYTES or parsed is None
                or type(h.meta.get("key_str")) is not bool or h.flags
                or parsed[2] != ref_target_hash(target)):
            raise CorruptionError("bad ref record", **where)
    if not contents_checked:
        _check_put_contents(h, **where)
    offsets = h.offsets
    end = offsets[-1] + h.extent_lengths[-1] if offsets else h.header_len
    if end != h.record_len:
        raise CorruptionError(f"record_len {h.record_len} does not match its extents ({end})", **where)


def _check_put_contents(h: RecordHeader, **where: Any) -> None:
    """A PUT's codec, metadata schema and extent lengths: a function of its kind, codec,
    metadata and extent lengths alone (``decode_header`` remembers which passed)."""
    if h.codec not in fmt.CODEC_NAMES:
        raise CorruptionError(f"unknown codec id {h.codec}", **where)
    expected = expected_extent_lengths(h.kind, h.meta, **where)
    if h.codec == fmt.CODEC_RAW:
        if "codec_params" in h.meta:
            raise CorruptionError("codec parameters on a raw record", **where)
        if tuple(expected) != h.extent_lengths:
            raise CorruptionError("extent lengths do not match the object's metadata", **where)
    else:
        _check_coded_lengths(h, expected, **where)


def _check_coded_lengths(h: RecordHeader, logical: list[int], **where: Any) -> None:
    """A record with a codec (SPEC.md §6): its kind, parameters and stored extent lengths."""
    codec = codecs.BY_ID[h.codec]
    kind = fmt.KIND_NAMES.get(h.kind)
    if kind not in codec.kinds:
        raise CorruptionError(f"codec {codec.name!r} on a {kind} record", **where)
    params = h.meta.get("codec_params", {})
    try:
        codecs.check_params(codec, params)
    except CorruptionError as e:
        raise CorruptionError(e.message, **where) from None
    if len(logical) != len(h.extent_lengths):
        raise CorruptionError("extent count does not match the object's metadata", **where)
    if "dict" in params and kind != "blob":
        raise CorruptionError("a zstd dictionary on a record that is not a blob", **where)
    if not codec.lossless and fmt.DTYPES[h.meta["dtype"]][0] not in codecs.LOSSY_DTYPES:
        raise CorruptionError(f"lossy codec {codec.name!r} on {fmt.DTYPES[h.meta['dtype']][0]} data", **where)
    for ext, n, stored in zip(extent_shapes(h.kind, h.meta), logical, h.extent_lengths):
        c = extent_codec(codec, ext)
        if c.id == fmt.CODEC_RAW:
            ok = stored == n
        elif c.lossless or "zstd" in params or c.id == fmt.CODEC_KV_ANS:
            ok = stored <= codecs.max_length(c, ext, params)
        else:
            ok = stored == codecs.body_length(c, ext, params)
        if not ok:
            raise CorruptionError(f"stored extent length {stored} impossible for {codec.name} of {n} bytes", **where)


# --- metadata (SPEC.md §5) -----------------------------------------------------------------


def _ext_hook(code: int, data: bytes) -> Any:
    raise ValueError("msgpack ext types are not allowed")


def pack_meta(meta: dict[str, Any]) -> bytes:
    return msgpack.packb(meta, use_bin_type=True)


def unpack_meta(data: bytes, **where: Any) -> dict[str, Any]:
    try:
        meta = msgpack.unpackb(data, raw=False, strict_map_key=True, ext_hook=_ext_hook)
    except (ValueError, TypeError, msgpack.UnpackException) as e:  # ExtraData, FormatError, StackError, OutOfData
        raise CorruptionError(f"bad metadata: {type(e).__name__}: {e}", **where) from None
    if not isinstance(meta, dict):
        raise CorruptionError("metadata is not a map", **where)
    if _depth(meta) > fmt.META_MAX_DEPTH:
        raise CorruptionError("metadata nested too deeply", **where)
    return meta


def _depth(x: Any, limit: int = fmt.META_MAX_DEPTH + 1) -> int:
    if isinstance(x, dict) and not any(type(v) in (dict, list) for v in x.values()):
        return 1  # the common case: a flat map
    stack = [(x, 1)]
    deepest = 0
    while stack:
        v, d = stack.pop()
        deepest = max(deepest, d)
        if deepest > limit:
            return deepest
        if isinstance(v, dict):
            stack.extend((w, d + 1) for w in v.values())
        elif isinstance(v, list):
            stack.extend((w, d + 1) for w in v)
    return deepest


def check_user_meta(meta: Any) -> dict[str, Any]:
    """Validate the ``meta=`` argument of put: a msgpack-able map of bounded depth (maps and
    lists, the top-level map being level 1) and size.  Returns the metadata as stored and as
    every reader gets it back (a copy: the caller's dict may change afterwards; tuples are
    lists)."""
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        raise InvalidObject(f"meta must be a dict, got {type(meta).__name__}")

    def walk(v: Any, depth: int) -> None:
        if isinstance(v, (dict, list, tuple)) and depth > fmt.USER_META_MAX_DEPTH:
            raise InvalidObject(f"meta is nested deeper than {fmt.USER_META_MAX_DEPTH} levels of maps and lists")
        if isinstance(v, dict):
            for k, w in v.items():
                if not isinstance(k, str):
                    raise InvalidObject(f"meta keys must be str, got {type(k).__name__}")
                walk(w, depth + 1)
        elif isinstance(v, (list, tuple)):
            for w in v:
                walk(w, depth + 1)
        elif isinstance(v, bool) or v is None or isinstance(v, (str, bytes, float)):
            pass
        elif isinstance(v, int):
            if not -(1 << 63) <= v < (1 << 64):
                raise InvalidObject("meta integers must fit in 64 bits")
        else:
            raise InvalidObject("meta values must be str, bytes, int, float, bool, None, list or dict; "
                                f"got {type(v).__name__}")

    walk(meta, 1)
    packed = pack_meta(meta)
    if len(packed) > fmt.USER_META_MAX_BYTES:
        raise InvalidObject(f"meta is larger than {fmt.USER_META_MAX_BYTES} bytes packed")
    return unpack_meta(packed)


def _req(meta: dict[str, Any], name: str, typ: type | tuple[type, ...], **where: Any) -> Any:
    v = meta.get(name)
    if v is None or not isinstance(v, typ) or isinstance(v, bool) and typ is not bool:
        raise CorruptionError(f"metadata field {name!r} missing or of the wrong type", **where)
    return v


def _shape(meta: dict[str, Any], rank: int, **where: Any) -> list[int]:
    shape = _req(meta, "shape", list, **where)
    if len(shape) != rank or not all(type(d) is int and 1 <= d <= INT64_MAX for d in shape):
        raise CorruptionError(f"metadata shape {shape!r} is not {rank} positive ints", **where)
    return shape


def _itemsize(meta: dict[str, Any], allowed: frozenset[str], **where: Any) -> int:
    dtype_id = _req(meta, "dtype", int, **where)
    entry = fmt.DTYPES.get(dtype_id)
    if entry is None or entry[0] not in allowed:
        raise CorruptionError(f"dtype id {dtype_id} not allowed here", **where)
    return entry[1]


def _checked_product(values: Sequence[int], **where: Any) -> int:
    p = 1
    for v in values:
        p *= v
        if p > INT64_MAX:
            raise CorruptionError("object size overflows 63 bits", **where)
    return p


def same_object(a: RecordHeader, b: RecordHeader) -> bool:
    """Same stored bytes: kind, codec, key flags, metadata, extent lengths and checksums
    (two records of one object, e.g. before and after compaction copied it).  With a remote
    tier the metadata holds the put's ``version`` (SPEC.md §14.2), so two puts of the same bytes
    differ: a repeated put is a new version, which must win over what other nodes wrote in
    between."""
    return a.lsn == b.lsn or (a.kind == b.kind and a.codec == b.codec and a.flags == b.flags and a.meta == b.meta
                              and a.extent_lengths == b.extent_lengths and a.extent_crcs == b.extent_crcs)


def expected_extent_lengths(kind: int, meta: dict[str, Any], **where: Any) -> list[int]:
    """Raw extent lengths implied by the metadata of a PUT (SPEC.md §5.3)."""
    if kind in fmt.LAYERED_KINDS:  # kv [layers, 2, heads, tokens, dim]; mla [layers, tokens, dim]
        shape = _shape(meta, 5 if kind == fmt.KIND_KV else 3, **where)
        if kind == fmt.KIND_KV and shape[1] != 2:
            raise CorruptionError("KV shape[1] must be 2", **where)
        isz = _itemsize(meta, fmt.FLOAT_DTYPES, **where)
        if _req(meta, "layer_start", int, **where) < 0:
            raise CorruptionError("negative layer_start", **where)
        layer = _checked_product(shape[1:] + [isz], **where)
        _checked_product([layer, shape[0]], **where)
        return [layer] * shape[0]
    if kind == fmt.KIND_VECTORS:
        n, dim = _shape(meta, 2, **where)
        isz = _itemsize(meta, fmt.VECTOR_DTYPES, **where)
        if _req(meta, "metric", str, **where) not in fmt.METRICS:
            raise CorruptionError("unknown metric", **where)
        rpe = _req(meta, "rows_per_extent", int, **where)
        has_ids = _req(meta, "ids", bool, **where)
        if rpe < 1:
            raise CorruptionError("rows_per_extent must be positive", **where)
        row = _checked_product([dim, isz], **where)
        _checked_product([row, n], **where)
        n_ext = -(-n // rpe)
        if n_ext * (2 if has_ids else 1) > fmt.MAX_EXTENTS:
            raise CorruptionError("too many extents", **where)
        rows = [min(rpe, n - i * rpe) for i in range(n_ext)]
        out = [r * row for r in rows]
        if has_ids:
            out += [r * 8 for r in rows]
        return out
    if kind == fmt.KIND_BLOB:
        size = _req(meta, "size", int, **where)
        _req(meta, "media_type", str, **where)
        if not 0 <= size <= INT64_MAX:
            raise CorruptionError("bad blob size", **where)
        return [size]
    if kind == fmt.KIND_REF:
        return []
    raise CorruptionError(f"unknown object kind {kind}", **where)
