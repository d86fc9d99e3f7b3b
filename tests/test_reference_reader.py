"""The independent reader (format/reference_reader.py, written from SPEC.md alone) agrees with
the engine on a store holding every kind, dtypes, deletes, overwrites and a torn tail."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

import tierstore
from tierstore import Blob, KVCache, MLACache, Vectors

from .conftest import HAS_TORCH, segment_files

spec = importlib.util.spec_from_file_location("reference_reader",
                                              Path(__file__).parent.parent / "format" / "reference_reader.py")
reader = importlib.util.module_from_spec(spec)
sys.modules["reference_reader"] = reader  # dataclasses look their module up by name
spec.loader.exec_module(reader)


def engine_view(path: str) -> list[dict]:
    out = []
    with tierstore.open(path, readonly=True) as s:
        for ns in s.namespaces():
            for key in s.keys(namespace=ns):
                info = s.get(key, namespace=ns)
                meta = s.info(key, namespace=ns).meta
                item = {"namespace": ns, "key": key if isinstance(key, str) else "0x" + key.hex(), "meta": meta}
                if isinstance(info, Blob):
                    item.update(kind="blob", size=len(info.data), crc32c=reader.crc32c(info.data))
                else:
                    arr = info.data
                    raw = arr.view(torch.uint8).numpy().tobytes() if HAS_TORCH and not isinstance(arr, np.ndarray) \
                        else arr.tobytes()
                    item.update(kind=info.kind, shape=list(arr.shape),
                                crc32c=reader.crc32c(raw))
                out.append(item)
    return sorted(out, key=lambda i: (i["namespace"], i["key"]))


if HAS_TORCH:
    import torch


def test_reader_agrees_with_engine(store_path, real_kv, real_emb):
    with tierstore.open(store_path, segment_bytes="512KiB", index_commit_ms=1e9, index_batch=10**9) as s:
        s.put(b"\x00chunk", KVCache(real_kv[:2, :, :4, :32], layer_start=7), namespace="minilm", meta={"m": [1]})
        s.put("emb", Vectors(real_emb[:300], ids=np.arange(300) * 3, metric="ip"), namespace="rag")
        s.put("emb-noids", Vectors(real_emb[:5].astype(np.float32)), namespace="rag")
        s.put("empty", Blob(b""))
        s.put("small", Blob(b"x" * 100, media_type="text/plain"))
        s.put("big", Blob(bytes(range(256)) * 64))
        s.put("gone", Blob(b"1"))
        s.delete("gone")
        s.put("small", Blob(b"overwritten"))
        if HAS_TORCH:
            s.put("bf16", KVCache(torch.randn(2, 2, 1, 4, 8).to(torch.bfloat16)))
            s.put("fp8", Vectors(torch.randn(4, 16).to(torch.float8_e4m3fn)))
    ref = sorted(({k: v for k, v in i.items() if k in ("namespace", "key", "kind", "meta", "crc32c", "shape", "size")}
                  for i in reader.describe(store_path)), key=lambda i: (i["namespace"], i["key"]))
    assert ref == engine_view(store_path)
    assert len(ref) == (8 if HAS_TORCH else 6)


def test_reader_stops_at_torn_tail_like_engine(store_path):
    # (durability="none": records only handed to the OS, which a power cut may tear; cut from a
    # "sync" store, synced records are damage, and a writer's open refuses)
    with tierstore.open(store_path, durability="none") as s:
        for i in range(5):
            s.put(f"k{i}", Blob(bytes([i]) * 6000))
    (seg,) = segment_files(store_path)
    with open(seg, "r+b") as f:
        f.truncate(last_put_end(seg) - 3000)  # cut the last record (and the SYNC records after it)
    keys = [i["key"] for i in reader.describe(store_path)]
    assert keys == ["k0", "k1", "k2", "k3"]
    with tierstore.open(store_path) as s:
        assert s.keys() == keys


def test_reader_rejects_bad_checksum(store_path):
    with tierstore.open(store_path) as s:
        s.put("k", Blob(b"y" * 5000))
    (seg,) = segment_files(store_path)
    with open(seg, "r+b") as f:
        f.seek(8192 + 10)
        f.write(b"z")
    with pytest.raises(reader.FormatError):
        reader.describe(store_path)


def test_reader_rejects_a_segment_cut_inside_its_header(store_path):
    """Found by fuzz_reader (once it was instrumented): a file holding the segment magic but
    fewer bytes than the header's fields raised struct.error instead of FormatError."""
    with tierstore.open(store_path) as s:
        s.put("k", Blob(b"y"))
    reader.describe(store_path)  # the twin: the whole file reads
    (seg,) = segment_files(store_path)
    data = Path(seg).read_bytes()
    for cut in (8, 9, 40, 115):
        with open(seg, "wb") as f:
            f.write(data[:cut])
        with pytest.raises(reader.FormatError):
            reader.describe(store_path)


def test_reader_agrees_on_sessions_and_groups(store_path):
    """Format 1.1: GROUP records and references (SPEC.md §5.4, §7.7), a torn group at the end."""
    with tierstore.open(store_path) as s:
        s.put("shared", Blob(b"s" * 5000))
        for sess in ("s1", "s2"):
            s.put("shared", Blob(b"s" * 5000), session=sess)
            s.put(b"\x01chunk", Blob(b"c" * 100), namespace="m", session=sess)
        s.put("mine", Blob(b"m"), session="s3")
        s.drop_session("s1", namespace="m")
        s.delete("mine")
        s.put("last", Blob(b"l" * 9000), session="s4")  # a group, cut below
    assert reader_view(store_path) == engine_view(store_path)
    assert reader.references(store_path) == {("default", "last"): ["s4"], ("default", "shared"): ["", "s1", "s2"],
                                             ("m", "0x01" + b"chunk".hex()): ["s2"]}
    (seg,) = segment_files(store_path)
    with open(seg, "r+b") as f:  # cut the last group's reference off: the whole group is gone
        f.truncate(last_put_end(seg) - 8)
    assert ("default", "last") not in reader.references(store_path)
    assert [i["key"] for i in reader.describe(store_path) if i["namespace"] == "default"] == ["shared"]
    shutil.rmtree(os.path.join(store_path, "index"))  # (the index had applied the group: rebuild it)
    tierstore.open(store_path).close()
    assert reader_view(store_path) == engine_view(store_path)  # the engine cuts it the same way


def last_put_end(seg: str) -> int:
    """Where the last PUT record of a segment ends (SYNC records and padding may follow it)."""
    from tierstore.engine import segment as seglib
    from tierstore.engine.fileio import DEFAULT_IO
    from tierstore.format import constants as fmt

    fd = os.open(seg, os.O_RDONLY)
    try:
        return max(off + h.record_len for off, h in seglib.SegmentScanner(DEFAULT_IO, fd, 1, path=seg).records()
                   if h.type == fmt.REC_PUT)
    finally:
        os.close(fd)


def reader_view(path: str) -> list[dict]:
    return sorted(({k: v for k, v in i.items() if k in ("namespace", "key", "kind", "meta", "crc32c", "shape", "size")}
                   for i in reader.describe(path)), key=lambda i: (i["namespace"], i["key"]))


def test_reader_decodes_every_codec_like_the_engine(store_path, real_kv, real_emb):
    """Format 1.2: each codec of SPEC.md §6, decoded by the independent reader, gives the very
    bytes the engine returns (lossy ones included: the decoders are specified exactly)."""
    from tierstore import codecs
    kv, emb = np.ascontiguousarray(real_kv[:3, :, :4, :40]), np.ascontiguousarray(real_emb[:200])
    names = []
    with tierstore.open(store_path, vector_extent_bytes=16 << 10) as s:
        for c in codecs.available():
            for kind in c["kinds"]:
                for spec in [c["name"]] + ([c["name"] + "+zstd"] if c["id"] in codecs.POST_ZSTD else []):
                    key = f"{kind}-{spec}"
                    if kind == "kv":
                        s.put(key, KVCache(kv), codec=spec)
                        if HAS_TORCH and not c["lossless"]:
                            s.put(key + "-bf16", KVCache(torch.from_numpy(kv.astype(np.float32)).to(torch.bfloat16)),
                                  codec=spec)
                            names.append(key + "-bf16")
                    elif kind == "vectors":
                        s.put(key, Vectors(emb.astype(np.float32), ids=np.arange(200) * 7), codec=spec)
                    elif kind == "mla":  # format 1.4: real activations as a [layers, tokens, dim] latent
                        s.put(key, MLACache(np.ascontiguousarray(real_kv[:3, 1, 0, :40]), layer_start=1), codec=spec)
                    else:
                        s.put(key, Blob(b"a blob " * 500), codec=spec)
                    names.append(key)
        s.put("kv-int4-g8", KVCache(kv), codec="int4:group=8")
        names.append("kv-int4-g8")
        samples = [f"message {i} from the chat of user {i % 7}".encode() for i in range(300)]
        did = s.train_dictionary(samples, size=1024)
        s.put("blob-dict", Blob(samples[5]), codec=f"zstd:dict={did}")
    assert reader_view(store_path) == engine_view(store_path)
    assert len(names) >= 20


def test_reader_refuses_zeros_then_data_in_a_sealed_segment(store_path):
    """A page of zeros in the middle of a sealed segment ended that segment's log as if it were
    its end, and the reader listed the older version of a key overwritten past the zeros (a cold
    review, 2026-12-03; SPEC.md §12 now says a sealed segment ends in zeros only).  The engine
    refuses too ("torn: zeros then data").  Twin: the intact store reads."""
    with tierstore.open(store_path, segment_bytes=65536) as s:
        s.put("x", Blob(b"OLD" * 10))
        s.put("fill", Blob(b"f" * 60000))  # rolls over
        s.put("victim", Blob(b"v" * 10))
        victim = s.info("victim")
        s.put("x", Blob(b"NEW" * 10))
        s.put("fill2", Blob(b"g" * 60000))  # rolls over: the segment of victim and the new x is sealed
    assert {i["key"]: i["lsn"] for i in reader.describe(store_path)}["x"] > 1
    with open(os.path.join(store_path, "segments", f"{victim.segment:016x}.tseg"), "r+b") as f:
        f.seek(victim.offset)
        f.write(bytes(4096))
    with pytest.raises(reader.FormatError, match="zeros, then data"):
        reader.describe(store_path)
