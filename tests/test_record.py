"""Record framing: round trips, and hostile headers -- each with a twin showing a valid one passes."""

from __future__ import annotations

import struct
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore.errors import CorruptionError, InvalidObject
from tierstore.format import constants as fmt
from tierstore.format import record as rec


def kv_record(lsn=7, layers=3, ns=b"ns", key=b"key"):
    arr = np.arange(layers * 2 * 2 * 4 * 8, dtype=np.float16).reshape(layers, 2, 2, 4, 8)
    meta = {"dtype": fmt.DTYPE_IDS["float16"], "shape": list(arr.shape), "layer_start": 0}
    exts = [memoryview(arr[i]).cast("B") for i in range(layers)]
    r = rec.encode_put(ns, key, 0, fmt.KIND_KV, meta, exts, fmt.ALIGN_PAGE_LOG2)
    return r._replace(header=r.header.stamped(lsn)), arr


def flat(r: rec.EncodedRecord) -> bytes:
    return b"".join(bytes(b) for b in r.iovecs())


def hdr_bytes(r: rec.EncodedRecord) -> bytes:
    return r.header.raw


def test_crc32c_check_value():
    assert rec.crc32c(b"123456789") == 0xE3069283


def test_roundtrip_kv():
    r, arr = kv_record()
    data = flat(r)
    assert len(data) == r.record_len
    h = rec.decode_header(data)
    assert (h.type, h.lsn, h.kind, h.namespace, h.key) == (fmt.REC_PUT, 7, fmt.KIND_KV, b"ns", b"key")
    assert h.extent_lengths == (arr[0].nbytes,) * 3
    for i, off in enumerate(h.offsets):
        assert off % fmt.PAGE == 0
        assert data[off : off + arr[i].nbytes] == arr[i].tobytes()
        assert rec.crc32c(arr[i].tobytes()) == h.extent_crcs[i]


def test_stamped_keeps_record_valid():
    r, _ = kv_record(lsn=1)
    stamped = r.header.stamped(99)
    h = rec.decode_header(stamped.raw)
    assert h.lsn == 99 and h == stamped


def test_delete_and_pad():
    d = rec.encode_delete(b"n", b"k", fmt.FLAG_KEY_STR).header.stamped(5)
    h = rec.decode_header(d.raw)
    assert h.type == fmt.REC_DELETE and h.key_is_str and h.record_len == len(d.raw) and h == d
    pad = rec.encode_pad(200)
    assert len(pad) == 200
    h = rec.decode_header(pad)
    assert h.type == fmt.REC_PAD and h.record_len == 200
    with pytest.raises(ValueError):
        rec.encode_pad(10)


# --- hostile headers ----------------------------------------------------------------------


def mutate(header: bytes, offset: int, fmt_: str, value: int, fix_crc: bool = True) -> bytes:
    b = bytearray(header)
    struct.pack_into(fmt_, b, offset, value)
    if fix_crc:
        struct.pack_into("<I", b, 4, rec.crc32c(bytes(b[8:])))
    return bytes(b)


def test_valid_header_twin_decodes():
    r, _ = kv_record()
    assert rec.decode_header(r.header.raw).lsn == 7


@pytest.mark.parametrize(
    "name,offset,fmt_,value,fix_crc",
    [
        ("bad magic", 0, "<I", 0x12345678, True),
        ("checksum", 4, "<I", 1, False),
        ("header_len too small", 12, "<I", 8, True),
        ("header_len huge", 12, "<I", 0xFFFFFFF0, True),
        ("header_len misaligned", 12, "<I", 4100, True),
        ("record_len below header", 24, "<Q", 16, True),
        ("record_len overflow", 24, "<Q", 2**64 - 1, True),
        ("record_len vs extents", 24, "<Q", 999_999, True),
        ("unknown type", 8, "<H", 77, True),
        ("unknown flags", 10, "<H", 0x40, True),
        ("align too large", 33, "<B", 40, True),
        ("unknown codec", 34, "<H", 999, True),
        ("reserved byte", 37, "<B", 1, True),
        ("ns_len mismatch", 36, "<B", 9, True),
        ("meta_len huge", 40, "<I", 0xFFFFFFFF, True),
        ("n_extents huge", 44, "<I", 0xFFFFFFFF, True),
        ("lsn zero", 16, "<Q", 0, True),
        ("kind unknown", 32, "<B", 9, True),
    ],
)
def test_hostile_fixed_fields(name, offset, fmt_, value, fix_crc):
    r, _ = kv_record()
    with pytest.raises(CorruptionError):
        rec.decode_header(mutate(r.header.raw, offset, fmt_, value, fix_crc))


def _rebuild(meta: dict, extents: list[bytes], kind=fmt.KIND_KV) -> bytes:
    """A header with arbitrary (possibly inconsistent) metadata and a valid checksum."""
    mb = msgpack.packb(meta)
    table = b"".join(fmt.EXTENT_ENTRY.pack(len(e), rec.crc32c(e), 0) for e in extents)
    header_len = rec.header_length(b"n", b"k", mb, len(extents))
    offsets = rec.extent_offsets(header_len, 12, [len(e) for e in extents])
    record_len = offsets[-1] + len(extents[-1]) if extents else header_len
    return rec._pack_header(fmt.REC_PUT, 1, record_len, kind, 12, 0, 0, b"n", b"k", mb, table, len(extents))


GOOD_META = {"dtype": 1, "shape": [2, 2, 1, 1, 2], "layer_start": 0}


def test_valid_rebuilt_header_twin():
    h = rec.decode_header(_rebuild(GOOD_META, [b"\0" * 8, b"\0" * 8]))
    assert h.meta["shape"] == [2, 2, 1, 1, 2]
    for top in (2**63 - 2, 2**64 - 1):  # (writers keep ids below 2^63; earlier ones wrote up to 2^64 + layers)
        h = rec.decode_header(_rebuild({**GOOD_META, "layer_start": top}, [b"\0" * 8] * 2))
        assert h.meta["layer_start"] == top


@pytest.mark.parametrize(
    "meta,extents",
    [
        ({**GOOD_META, "shape": [2, 2, 1, 1, 2**62]}, [b"\0" * 8, b"\0" * 8]),  # size overflows 63 bits
        ({**GOOD_META, "shape": [2, 3, 1, 1, 2]}, [b"\0" * 12, b"\0" * 12]),
        ({**GOOD_META, "shape": [2, 2, 1, 1, 0]}, [b"", b""]),
        ({**GOOD_META, "shape": [2, 2, 1, 1]}, [b"\0" * 8, b"\0" * 8]),
        ({**GOOD_META, "dtype": 99}, [b"\0" * 8, b"\0" * 8]),
        ({**GOOD_META, "dtype": fmt.DTYPE_IDS["int32"]}, [b"\0" * 16, b"\0" * 16]),
        ({**GOOD_META, "layer_start": -1}, [b"\0" * 8, b"\0" * 8]),
        ({**GOOD_META, "layer_start": True}, [b"\0" * 8, b"\0" * 8]),
        ({"shape": [2, 2, 1, 1, 2], "layer_start": 0}, [b"\0" * 8, b"\0" * 8]),
        (GOOD_META, [b"\0" * 8]),  # fewer extents than layers
        (GOOD_META, [b"\0" * 8, b"\0" * 9]),  # wrong extent length
        ({**GOOD_META, "shape": "big"}, [b"\0" * 8, b"\0" * 8]),
    ],
)
def test_hostile_metadata(meta, extents):
    with pytest.raises(CorruptionError):
        rec.decode_header(_rebuild(meta, extents))


def test_hostile_msgpack():
    good = _rebuild(GOOD_META, [b"\0" * 8, b"\0" * 8])
    assert rec.decode_header(good)
    deep: object = 1
    for _ in range(40):
        deep = [deep]
    for meta_bytes in [
        b"\xc1",  # never-used byte
        b"\x92\x01\x02",  # an array, not a map
        msgpack.packb({"a": 1}) + b"\x00",  # trailing bytes
        b"\xdf\xff\xff\xff\xff",  # map claiming 4G entries
        msgpack.packb({"a": msgpack.ExtType(1, b"x")}),
        msgpack.packb({1: 2}),  # non-str key
        msgpack.packb({"deep": deep}),
    ]:
        with pytest.raises(CorruptionError):
            rec.unpack_meta(meta_bytes)


def test_truncated_header():
    r, _ = kv_record()
    for cut in (0, 10, 47, 48, len(r.header.raw) - 1):
        with pytest.raises(CorruptionError):
            rec.decode_header(r.header.raw[:cut])


def test_ignorable_unknown_type_decodes():
    h = rec._pack_header(fmt.REC_TYPE_IGNORABLE | 42, 3, 48, 0, 3, 0, 0, b"", b"", b"", b"", 0)
    assert rec.decode_header(h).type == fmt.REC_TYPE_IGNORABLE | 42


def test_user_meta_validation():
    assert rec.check_user_meta(None) == {}
    assert rec.check_user_meta({"a": [1, 2.5, None, True, b"x", {"b": "c"}]})
    for bad in ({"a": {1, 2}}, {"a": 2**70}, {"a": np.float32(1)}):
        with pytest.raises(InvalidObject):
            rec.check_user_meta(bad)


@settings(max_examples=200, deadline=None)
@given(
    ns=st.binary(min_size=1, max_size=100).filter(lambda n: n != fmt.REF_NAMESPACE),  # (only refs live there)
    key=st.binary(min_size=1, max_size=400),
    lsn=st.integers(min_value=1, max_value=2**63),
    sizes=st.lists(st.integers(min_value=0, max_value=5000), min_size=1, max_size=4),
    align=st.sampled_from([3, 12]),
)
def test_blob_roundtrip_property(ns, key, lsn, sizes, align):
    size = sizes[0]
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    meta = {"size": size, "media_type": "x/y"}
    r = rec.encode_put(ns, key, 0, fmt.KIND_BLOB, meta, [memoryview(data)], align)
    r = r._replace(header=r.header.stamped(lsn))
    raw = flat(r)
    h = rec.decode_header(raw)
    assert (h.namespace, h.key, h.lsn) == (ns, key, lsn)
    off = h.offsets[0]
    assert off % (1 << align) == 0 and raw[off : off + size] == data and len(raw) == h.record_len


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=0, max_size=400), st.integers(min_value=0, max_value=300))
def test_random_bytes_never_crash_decoder(junk, where):
    """Any byte string decodes to a header or raises CorruptionError -- nothing else."""
    r, _ = kv_record()
    for candidate in (junk, r.header.raw[:where] + junk, fmt.RECORD_MAGIC + junk):
        try:
            rec.decode_header(candidate)
        except CorruptionError:
            pass


def test_fuzz_corpus_replays():
    """Every input of the fuzzing corpus decodes or raises CorruptionError, in both checksum modes."""
    corpus = Path(__file__).parent.parent / "fuzz" / "corpus" / "record"
    files = sorted(corpus.iterdir())
    assert len(files) >= 5
    for f in files:
        data = f.read_bytes()
        assert rec.decode_header(data).lsn == (0 if f.name == "pad" else 7)  # the seeds are valid
        for verify in (True, False):
            for cut in (len(data) // 2, len(data) - 1):
                try:
                    rec.decode_header(data[:cut], verify=verify)
                except CorruptionError:
                    pass


def test_reserved_namespace_rules():
    """(1.1) A ref record decodes; a blob in the ref namespace, or a ref elsewhere, does not."""
    ok = rec.encode_ref(b"ns", b"s-1", b"key", True).header.stamped(5).raw
    h = rec.decode_header(ok)
    assert h.kind == fmt.KIND_REF and h.meta == {"key": b"key", "key_str": True}
    blob = rec.encode_put(fmt.REF_NAMESPACE, rec.ref_key(b"ns", b"s", b"k"), 0, fmt.KIND_BLOB,
                          {"size": 1, "media_type": "x"}, (memoryview(b"x"),), 3)
    with pytest.raises(CorruptionError, match="reserved"):
        rec.decode_header(blob.header.stamped(5).raw)
    elsewhere = rec.encode_put(b"ns", rec.ref_key(b"ns", b"s", b"k"), 0, fmt.KIND_REF, {"key": b"k", "key_str": False},
                               (), 3)
    with pytest.raises(CorruptionError, match="reserved"):
        rec.decode_header(elsewhere.header.stamped(5).raw)
    wrong_hash = rec.encode_put(fmt.REF_NAMESPACE, rec.ref_key(b"ns", b"s", b"k"), 0, fmt.KIND_REF,
                                {"key": b"other", "key_str": False}, (), 3)
    with pytest.raises(CorruptionError, match="bad ref record"):
        rec.decode_header(wrong_hash.header.stamped(5).raw)
