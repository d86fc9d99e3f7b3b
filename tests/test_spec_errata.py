"""SPEC.md 1.2 errata 1 (issue 15, items 14-18): where an outside reader found the spec silent or
self-contradictory, the engine and the independent reader (format/reference_reader.py) now give
the same answer on the same bytes.  Each hostile case has its valid twin."""

from __future__ import annotations

import importlib.util
import os
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import zstandard

import tierstore
from tierstore import Blob, KVCache, codecs
from tierstore.errors import CorruptionError
from tierstore.format import constants as fmt
from tierstore.format import record as rec

from .conftest import segment_files

spec = importlib.util.spec_from_file_location("reference_reader",
                                              Path(__file__).parent.parent / "format" / "reference_reader.py")
reader = importlib.util.module_from_spec(spec)
sys.modules["reference_reader"] = reader
spec.loader.exec_module(reader)


def both_refuse(engine_call, reader_call) -> None:
    with pytest.raises(CorruptionError):
        engine_call()
    with pytest.raises(reader.FormatError):
        reader_call()


# -- §6.2: exactly one zstd frame ----------------------------------------------------------------

@pytest.mark.parametrize("extra", [b"", b"x", b"\x00" * 7, "frame", "skippable"])
def test_one_zstd_frame_and_nothing_after_it(extra):
    data = bytes(range(256)) * 40
    frame = zstandard.ZstdCompressor(level=3, write_content_size=True).compress(data)
    if extra == "frame":
        extra = frame
    elif extra == "skippable":
        extra = b"\x50\x2a\x4d\x18" + struct.pack("<I", 4) + b"abcd"
    if not extra:  # the twin: a lone frame decodes in both
        assert codecs.zstd_decompress(frame, len(data)) == reader.unzstd(frame, len(data)) == data
        return
    both_refuse(lambda: codecs.zstd_decompress(frame + extra, len(data)),
                lambda: reader.unzstd(frame + extra, len(data)))


def test_a_skippable_frame_alone_is_not_an_extent():
    skippable = b"\x50\x2a\x4d\x18" + struct.pack("<I", 0)
    both_refuse(lambda: codecs.zstd_decompress(skippable, 0), lambda: reader.unzstd(skippable, 0))


def test_a_frame_naming_a_dictionary_the_record_does_not_name():
    samples = [f'{{"turn": {i}, "role": "user", "text": "hello number {i}"}}'.encode() for i in range(400)]
    d = codecs.train_dictionary(samples, 2048)
    data = samples[7]
    frame = zstandard.ZstdCompressor(level=3, write_content_size=True,
                                     dict_data=zstandard.ZstdCompressionDict(d)).compress(data)
    both_refuse(lambda: codecs.zstd_decompress(frame, len(data)), lambda: reader.unzstd(frame, len(data)))
    assert codecs.zstd_decompress(frame, len(data), d) == reader.unzstd(frame, len(data), d) == data


# -- §6: parameters absent on disk, lossy dtypes, NaN codes, the value limit ----------------------

def kv_layer(seed: int = 0) -> tuple[np.ndarray, codecs.Extent]:
    x = np.random.default_rng(seed).standard_normal((2, 2, 40, 16)).astype(np.float16)
    return x, codecs.Extent("kv", x.shape, "float16", 0)


def test_int4_group_defaults_to_32_when_absent():
    x, ext = kv_layer()
    c = codecs.BY_ID[fmt.CODEC_KV_INT4]
    body = codecs.encode(c, x.reshape(-1).view(np.uint8), ext, {"group": 32})
    engine = codecs.decode(c, body, ext, {})
    ref = reader.to_stored(reader.decode_lossy(4, body, ext.shape, {}), 1)
    assert engine.tobytes() == ref == codecs.decode(c, body, ext, {"group": 32}).tobytes()


def test_fp8_nan_codes_are_corruption():
    x, ext = kv_layer()
    c = codecs.BY_ID[fmt.CODEC_KV_FP8]
    body = bytearray(codecs.encode(c, x.reshape(-1).view(np.uint8), ext, {}))
    assert codecs.decode(c, bytes(body), ext, {}).tobytes() == \
        reader.to_stored(reader.decode_lossy(6, bytes(body), ext.shape, {}), 1)  # the twin
    body[-1] = 0x7F  # a NaN code in V
    both_refuse(lambda: codecs.decode(c, bytes(body), ext, {}),
                lambda: reader.decode_lossy(6, bytes(body), ext.shape, {}))


def test_decoded_values_over_66000_are_corruption():
    x, ext = kv_layer()
    c = codecs.BY_ID[fmt.CODEC_KV_INT8]
    body = bytearray(codecs.encode(c, x.reshape(-1).view(np.uint8), ext, {}))
    h, d = ext.shape[1], ext.shape[3]
    body[0:2] = np.float16(60000).tobytes()  # K scale of channel (0, 0): codes up to 127 decode past 66000
    both_refuse(lambda: codecs.decode(c, bytes(body), ext, {}),
                lambda: reader.decode_lossy(3, bytes(body), ext.shape, {}))
    assert 2 * h * d < len(body)


def put_record(meta: dict, extents: list, codec: int, kind: int = fmt.KIND_KV) -> bytes:
    r = rec.encode_put(b"ns", b"k", 0, kind, meta, [memoryview(e) for e in extents], 12, codec)
    return bytes(r.header.stamped(5).raw)


@pytest.mark.parametrize("dtype, ok", [("float16", True), ("int8", False), ("float8_e4m3fn", False)])
def test_lossy_codecs_only_on_float_dtypes(dtype, ok):
    itemsize = fmt.DTYPES[fmt.DTYPE_IDS[dtype]][1]
    meta = {"dtype": fmt.DTYPE_IDS[dtype], "shape": [1, 2, 2, 4, 4], "layer_start": 0}
    if dtype == "int8":
        meta["shape"] = [4, 4]
        meta.update(rows_per_extent=4, ids=False, metric="ip")
        kind, codec, body = fmt.KIND_VECTORS, fmt.CODEC_VEC_INT8, bytes(8 * 4 + 16)
    else:
        kind, codec, body = fmt.KIND_KV, fmt.CODEC_KV_INT8, bytes(2 * 2 * 4 + 2 * 4 + 2 * 2 * 4 * 4)
    del itemsize
    header = put_record(meta, [body], codec, kind)
    if ok:
        rec.decode_header(header)
        reader.parse_record(header + bytes(8192), 0, "x")
    else:
        both_refuse(lambda: rec.decode_header(header), lambda: reader.parse_record(header + bytes(8192), 0, "x"))


# -- §4.5: framing of PAD and DELETE --------------------------------------------------------------

def test_pad_and_delete_carry_no_metadata():
    pad = rec.encode_pad(4096)
    rec.decode_header(pad)
    reader.parse_record(pad, 0, "x")  # the twins
    pad_meta = rec._pack_header(fmt.REC_PAD, 0, 4096, 0, 3, 0, 0, b"", b"", b"\x80", b"", 0)
    pad_meta += bytes(4096 - len(pad_meta))
    both_refuse(lambda: rec.decode_header(pad_meta), lambda: reader.parse_record(pad_meta, 0, "x"))
    dele = bytes(rec.encode_delete(b"ns", b"k", 0).header.stamped(3).raw)
    rec.decode_header(dele)
    reader.parse_record(dele, 0, "x")
    hl = rec.align_up(48 + 3 + 1, 8)
    dele_meta = rec._pack_header(fmt.REC_DELETE, 3, hl, 0, 3, 0, 0, b"ns", b"k", b"\x80", b"", 0)
    both_refuse(lambda: rec.decode_header(dele_meta), lambda: reader.parse_record(dele_meta, 0, "x"))


# -- §6.3 / §6.5: the log scale's exact values ------------------------------------------------------

SCALE_VECTORS = {(0, 127): 0x343504F3, (100, 127): 0x3A800000, (180, 127): 0x3F800000, (255, 127): 0x4425FED7,
                 (0, 12): 0x35EF7937, (100, 12): 0x3C295555, (180, 12): 0x41295555, (255, 12): 0x45DB9921}


def test_log_scale_test_vectors_of_the_spec():
    from tierstore.codecs.quant import log_scale

    spec_text = (Path(__file__).parent.parent / "SPEC.md").read_text()
    for (c, m), bits in SCALE_VECTORS.items():
        got = int(log_scale(np.array([c], np.uint8), m).view(np.uint32)[0])
        ref = int(np.array([2.0 ** ((c - 180) / 8) * (127 / m)]).astype(np.float32).view(np.uint32)[0])
        assert got == ref == bits, (c, m)
        assert f"{bits:08X}" in spec_text  # the table in SPEC.md is this one


# -- §7.4 / §12: a last segment whose header never became durable -------------------------------------

def test_last_segment_without_a_header_or_records_is_skipped_by_both(store_path):
    with tierstore.open(store_path, segment_bytes="16KiB") as s:
        for i in range(4):
            s.put(f"k{i}", Blob(bytes([i]) * 9000))
    segs = segment_files(store_path)
    nxt = os.path.join(os.path.dirname(segs[-1]), f"{int(os.path.basename(segs[-1])[:16], 16) + 1:016x}.tseg")
    with open(nxt, "wb") as f:
        f.write(b"\x89TSG" + os.urandom(200))  # a header that never reached the disk whole, no records
    state, _ = reader.scan(store_path)
    assert sorted(k.decode() for (_, k) in state) == ["k0", "k1", "k2", "k3"]
    with tierstore.open(store_path) as s:
        assert s.keys() == ["k0", "k1", "k2", "k3"]
        assert s.stats()["recovery"]["removed_segments"]


def test_a_bad_header_with_records_after_it_is_refused_by_both(store_path):
    with tierstore.open(store_path, segment_bytes="16KiB") as s:
        for i in range(4):
            s.put(f"k{i}", Blob(bytes([i]) * 9000))
    last = segment_files(store_path)[-1]
    with open(last, "r+b") as f:
        f.seek(60)
        f.write(b"\xff\xff\xff\xff")  # damage the last segment's header; its records stay
    with pytest.raises(reader.FormatError):
        reader.scan(store_path)
    with pytest.raises(CorruptionError):
        tierstore.open(store_path, readonly=True).keys()


# -- §5.4: every namespace starting with 00 is reserved, dictionaries included -------------------------

def test_listings_skip_every_reserved_namespace(store_path):
    with tierstore.open(store_path) as s:
        did = s.train_dictionary([f"sample {i} " .encode() * 8 for i in range(300)], size=1024)
        s.put("doc", Blob(b"sample 7 " * 8), codec=f"zstd:dict={did}", session="s")
        assert s.namespaces() == ["default"]
    assert {r["namespace"] for r in reader.describe(store_path)} == {"default"}


def test_a_kv_in_the_spec_is_layer_numbered_absolutely(store_path):
    kv = np.random.default_rng(1).standard_normal((3, 2, 2, 32, 16)).astype(np.float16)
    with tierstore.open(store_path) as s:
        s.put("k", KVCache(kv, layer_start=2), codec="kvq-ans:bins=32/12,shallow=3")
        info = s.info("k")
        got = s.get("k").data
    # layer 2 (< shallow) uses 32 bins, layers 3 and 4 use 12: the first layer is the most precise
    err = [float(np.abs(got[i].astype(np.float32) - kv[i]).max()) for i in range(3)]
    assert err[0] < err[1] and err[0] < err[2]
    assert "B = 32 for layers below 3" in info.bound
