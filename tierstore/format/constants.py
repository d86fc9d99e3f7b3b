"""Every on-disk constant of tierstore format v1, and nothing else.

This module owns the numbers that are written to disk: magics, version numbers, struct
layouts, record types, object kinds, dtype ids, codec ids and limits.  Each group cites the
SPEC.md section that defines it; SPEC.md and this module change in the same commit.

Ids written to disk are permanent: never change a value, never reuse a retired one (list
retired ids in the RETIRED_* tuples instead).  This module performs no I/O.
"""

from __future__ import annotations

import struct

# --- SPEC.md §2 Conventions --------------------------------------------------------------
PAGE = 4096  # the alignment unit of the format (O_DIRECT / GDS / power-safe overwrite)
RECORD_ALIGN = 8  # every record starts at a multiple of 8

# --- SPEC.md §3 Segment header -----------------------------------------------------------
SEGMENT_MAGIC = b"\x89TSG\r\n\x1a\n"
FORMAT_MAJOR = 1
FORMAT_MINOR = 5  # 1.1: groups, refs (sessions); 1.2: codecs; 1.3: SYNC records; 1.4: mla kind;
# 1.5: HEADERS records (copies of record headers); SPEC.md Changelog
SEGMENT_HEADER_SIZE = PAGE
# magic, major, minor, header_size, incompat, ro_compat, compat, store_uuid, segment_id,
# base_lsn, created_ns, creator, header_crc
SEGMENT_HEADER = struct.Struct("<8sHHIQQQ16sQQQ32sI")
SEGMENT_HEADER_CRC_OFFSET = SEGMENT_HEADER.size - 4  # crc32c covers bytes [0, this)
# Feature bits (ext4 semantics).  Unknown incompat bit: refuse to read.  Unknown ro_compat
# bit: read only.  Unknown compat bit: ignore.  v1 defines none.
INCOMPAT_KNOWN = 0
RO_COMPAT_KNOWN = 0
COMPAT_KNOWN = 0
SEGMENT_SUFFIX = ".tseg"
RETIRED_SUFFIX = ".dead"  # §1, §7.5: a retired segment being shrunk away (<id>.tseg.dead); never read
SEGMENT_NAME_DIGITS = 16  # segments/<16 lower-case hex digits>.tseg

# --- SPEC.md §4 Records ------------------------------------------------------------------
RECORD_MAGIC = b"\xd4TRC"
# magic, header_crc, type, flags, header_len, lsn, record_len, kind, align_log2, codec,
# ns_len, reserved, key_len, meta_len, n_extents
RECORD_HEADER = struct.Struct("<4sIHHIQQBBHBBHII")
RECORD_HEADER_SIZE = RECORD_HEADER.size  # 48
EXTENT_ENTRY = struct.Struct("<QII")  # stored_len, crc32c, reserved (must be 0)
MIN_RECORD_GAP = RECORD_HEADER_SIZE  # no record starts within 48 bytes before a page end

# Record types (u16).  Written to disk; never change.
REC_PUT = 1
REC_DELETE = 2
REC_PAD = 3
REC_HOLE = 4  # written by repair: LSNs [lsn, lsn + count) were lost to damage (bytes quarantined)
REC_TYPE_IGNORABLE = 0x8000  # an unknown type with this bit set may be skipped
REC_GROUP = 0x8005  # 1.1: the next ``count`` records form one atomic group (ignorable for 1.0 readers)
REC_SYNC = 0x8006  # 1.3: records through LSN ``durable`` were synced before this one was written (§7.3)
REC_HEADERS = 0x8007  # 1.5: copies of headers of records its writer appended before it (§4.5, §7.3)
HEADER_COPY = struct.Struct("<IIQ")  # a HEADERS entry: segment_id, header_len, offset; then the header
HEADERS_MAX_BYTES = 4 << 20  # the entries of one HEADERS record
GROUP_MAX = 4096  # records in one group
RETIRED_RECORD_TYPES: tuple[int, ...] = ()

# Record flags (u16).
FLAG_KEY_STR = 0x0001  # the key was given as a str (UTF-8); listing returns a str
FLAGS_KNOWN = FLAG_KEY_STR

# Object kinds (u8).  Written to disk; never change.
KIND_NONE = 0  # DELETE and PAD records
KIND_KV = 1
KIND_VECTORS = 2
KIND_BLOB = 3
KIND_REF = 4  # 1.1: a session's reference to an object; only in REF_NAMESPACE
KIND_MLA = 5  # 1.4: a latent (MLA) cache, one vector per token and layer (SPEC.md §5.1, §5.3, §6.3)
KIND_NAMES = {KIND_KV: "kv", KIND_VECTORS: "vectors", KIND_BLOB: "blob", KIND_REF: "ref", KIND_MLA: "mla"}
OBJECT_KINDS = (KIND_KV, KIND_VECTORS, KIND_BLOB, KIND_MLA)
LAYERED_KINDS = (KIND_KV, KIND_MLA)  # one extent per model layer (§5.3)
RETIRED_KINDS: tuple[int, ...] = ()

# Payload alignment (log2) a v1 writer uses; a reader accepts any value in the range.
ALIGN_INLINE_LOG2 = 3  # small payloads packed after the header
ALIGN_PAGE_LOG2 = 12  # tensor payloads: 4 KiB aligned extents
ALIGN_LOG2_MIN = 3
ALIGN_LOG2_MAX = 21
INLINE_BLOB_MAX = 64 << 10  # blobs smaller than this are stored 8-aligned (a writer choice: readers follow align_log2)

# --- SPEC.md §5 Metadata -----------------------------------------------------------------
META_MAX_DEPTH = 16  # nesting of the whole metadata map, user metadata included
USER_META_MAX_DEPTH = 8
USER_META_MAX_BYTES = 64 * 1024

# dtype ids (unsigned, msgpack int).  Written to disk; never change.
# id: (name, itemsize in bytes, numpy storage dtype string)
DTYPES: dict[int, tuple[str, int, str]] = {
    1: ("float16", 2, "<f2"),
    2: ("bfloat16", 2, "<u2"),
    3: ("float32", 4, "<f4"),
    4: ("float64", 8, "<f8"),
    5: ("float8_e4m3fn", 1, "u1"),
    6: ("float8_e5m2", 1, "u1"),
    7: ("int8", 1, "i1"),
    8: ("uint8", 1, "u1"),
    9: ("int16", 2, "<i2"),
    10: ("int32", 4, "<i4"),
    11: ("int64", 8, "<i8"),
}
DTYPE_IDS = {name: i for i, (name, _, _) in DTYPES.items()}
FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2"})
VECTOR_DTYPES = FLOAT_DTYPES | {"int8", "uint8"}
RETIRED_DTYPES: tuple[int, ...] = ()

METRICS = ("cosine", "l2", "ip")

# --- SPEC.md §6 Codecs -------------------------------------------------------------------
CODEC_RAW = 0
CODEC_ZSTD = 1  # 1.2: lossless, any kind
CODEC_SHUFFLE_ZSTD = 2  # 1.2: lossless, byte planes then zstd
CODEC_KV_INT8 = 3  # 1.2: lossy, KV: K per channel / V per token, float16 scales
CODEC_KV_INT4 = 4  # 1.2: lossy, KV: KIVI groups
CODEC_KV_INT2 = 5  # 1.2: lossy, KV: KIVI groups
CODEC_KV_FP8 = 6  # 1.2: lossy, KV: e4m3 with K per channel / V per token float16 scales
CODEC_VEC_FP16 = 7  # 1.2: lossy, vectors
CODEC_VEC_INT8 = 8  # 1.2: lossy, vectors: per-vector float32 scale
CODEC_VEC_BINARY = 9  # 1.2: lossy, vectors: sign bits and the mean magnitude
CODEC_KV_ANS = 10  # 1.2: lossy, KV: quantised with per-layer bins, then rANS-coded
ZSTD_FRAME_MAGIC = b"\x28\xb5\x2f\xfd"  # §6.2: a zstd frame (RFC 8878 §3.1.1); skippable frames are refused
ZSTD_DICT_MAGIC = b"\x37\xa4\x30\xec"  # §6.2: a zstd dictionary; its id is the next 4 bytes, little-endian
LOSSY_VALUE_MAX = 66000  # §6.6: a decoded lossy value of larger magnitude is corruption (never written)
CODEC_NAMES = {CODEC_RAW: "raw", CODEC_ZSTD: "zstd", CODEC_SHUFFLE_ZSTD: "shuffle+zstd", CODEC_KV_INT8: "int8",
               CODEC_KV_INT4: "int4", CODEC_KV_INT2: "int2", CODEC_KV_FP8: "fp8", CODEC_VEC_FP16: "fp16",
               CODEC_VEC_INT8: "int8", CODEC_VEC_BINARY: "binary", CODEC_KV_ANS: "kvq-ans"}
RETIRED_CODECS: tuple[int, ...] = ()

# --- SPEC.md §8 Limits -------------------------------------------------------------------
NAMESPACE_MAX_BYTES = 100
KEY_MAX_BYTES = 400  # 1 + 100 + 400 = 501 <= LMDB's 511-byte key limit
META_MAX_BYTES = 1 << 20  # the msgpack metadata block of one record
HEADER_MAX_BYTES = 2 << 20  # a whole record header (fixed part + key + meta + extents)
MAX_EXTENTS = 1 << 16
LAYER_ID_LIMIT = 1 << 63  # writers keep every layer id (layer_start + position, §5.2) below it: an int64
MAX_RANK = 8

# --- SPEC.md §5.4 Session references ------------------------------------------------------
# Namespaces whose first byte is 0x00 are reserved for the engine (user namespaces cannot
# contain control characters).  Ref keys: ns_len:u8 ns session_len:u8 session blake2b-128(key).
REF_NAMESPACE = b"\x00ref"
DICT_NAMESPACE = b"\x00dict"  # 1.2: zstd dictionaries; key ns_len:u8 ns dict_id:u32be (SPEC.md §6.2)
DICT_MEDIA_TYPE = "application/zstd-dictionary"
# a namespace that never holds a PUT: compaction appends a DELETE of MARK_KEY there to move the
# index's applied position out of its victims when it is on a record that changes no object (§7.5)
MARK_NAMESPACE = b"\x00mark"
MARK_KEY = b"applied"
SESSION_MAX_BYTES = 64
ANCHOR_SESSION = b"\x00"  # the reference of "put without a session" on an object sessions also hold
REF_KEY_HASH_BYTES = 16

# --- SPEC.md §13 Chunk hashes ------------------------------------------------------------
CHUNK_HASH_DOMAIN = b"tierstore/chunk/v1"
CHUNK_HASH_BYTES = 32  # SHA-256
CHUNK_TOKEN_MAX = (1 << 32) - 1  # token ids are encoded as u32le

# --- SPEC.md §9 Index --------------------------------------------------------------------
LMDB_LIB_VERSION = 0  # py-lmdb engine: LMDB 0.9.x, data format v1
INDEX_DIR = "index"
SEGMENTS_DIR = "segments"
QUARANTINE_DIR = "quarantine"
LOCK_FILE = "LOCK"
# --- SPEC.md §7.8 Several writer processes (coordination files, not data) -------------------
APPEND_FILE = "APPEND"  # flock held per append; holds the log end its last holder left
COMPACT_FILE = "COMPACT"  # flock held by a compaction
COMMIT_FILE = "COMMIT"  # flock held by a writer beside others while its index commit reads and applies
APPEND_MAGIC = b"TSAP"
APPEND_CLEAN, APPEND_WRITING = 0, 1  # state bit 0: the holder let go / is writing (or died writing)
APPEND_REFS = 2  # state bit 1: the log holds (or held) session references (§5.4)
# magic, state, active segment id, tail offset, next LSN (where the log ended when the state was
# written).  Little-endian, never synced (after a crash the first writer opens alone, runs
# recovery and writes it again)
APPEND_STATE = struct.Struct("<4sIQQQ")
# SPEC.md §1, §7.9 (informative): puts in flight of the writer processes that share a budget
# (ssd_bytes), INFLIGHT_SLOTS slots of (pid, handle token, bytes; a free slot is all zeros),
# little-endian, read and changed under the file's flock, never synced
INFLIGHT_FILE = "INFLIGHT"
INFLIGHT_SLOT = struct.Struct("<IIQ")
INFLIGHT_SLOTS = 64
RESERVE_FILE = "RESERVE"  # §1 (informative): space a writer gives up when the disk is full
REMOTE_FILE = "REMOTE"  # §1, §14.5 (informative): what the remote tier has not been sent yet
REMOTE_LOCK_FILE = "REMOTE.lock"  # §1, §14.5 (informative): flock of the one process whose remote tier writes
# §1, §14.6 (informative): the highest version stamp the store's handles may have issued, so that
# a clock set back while no handle ran still stamps above them.  STAMPS_SLOTS slots of (reserved,
# stamp, crc32c of the slot's first 16 bytes, zero), little-endian; the valid slot with the larger
# ``reserved`` counts; changed under the file's flock, one slot at a time, each change synced
STAMPS_FILE = "STAMPS"
STAMPS_SLOT = struct.Struct("<QQII")
STAMPS_SLOTS = 2

# --- SPEC.md §14 The remote tier (informative: a layout on Redis / Valkey, not a file) ------
REMOTE_PREFIX = b"ts1:"  # §14.1: ts1:<namespace hex>:{<key hex>}; the braces are Redis Cluster's hash tag
REMOTE_MAGIC = b"TSRV"
REMOTE_LAYOUT = 1
# magic, layout, flags, reserved, stamp (ns), origin store uuid, record_len, reserved, crc32c of [0, 44)
REMOTE_ENVELOPE = struct.Struct(">4sBBHQ16sQII")  # big-endian: bytes [8, 32) sort in version order
REMOTE_ENVELOPE_CRC_OFFSET = REMOTE_ENVELOPE.size - 4
REMOTE_FLAG_TOMBSTONE = 0x01
REMOTE_FLAGS_KNOWN = REMOTE_FLAG_TOMBSTONE
META_VERSION = "version"  # §5.2, §14.2: [stamp, origin store uuid] of a PUT written by a store with a remote
