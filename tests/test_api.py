"""The public API end to end: typed objects, partial reads, info/keys/stats, bad input."""

from __future__ import annotations

import os

import numpy as np
import pytest

import tierstore
from tierstore import Blob, KVCache, Vectors

from .conftest import HAS_TORCH, needs_torch

if HAS_TORCH:
    import torch


def test_kv_roundtrip_real_data(store_path, real_kv):
    with tierstore.open(store_path) as s:
        s.put(b"\x12\x34", KVCache(real_kv, layer_start=3), namespace="minilm")
        got = s.get(b"\x12\x34", namespace="minilm")
    assert isinstance(got, KVCache) and isinstance(got.data, np.ndarray)
    assert got.data.dtype == np.float16 and got.layer_start == 3
    assert np.array_equal(got.data.view(np.uint16), real_kv.view(np.uint16))


def test_kv_partial_layers(store_path, real_kv):
    with tierstore.open(store_path) as s:
        s.put("chunk", KVCache(real_kv, layer_start=10))
        for sel, want in [(range(10, 14), slice(0, 4)), (12, slice(2, 3)), ([14, 15], slice(4, 6)),
                          (slice(11, 13), slice(1, 3)), (range(10, 16), slice(0, 6))]:
            got = s.get("chunk", layers=sel)
            assert np.array_equal(got.data, real_kv[want])
            assert got.layer_start == 10 + want.start
        with pytest.raises(tierstore.InvalidObject):
            s.get("chunk", layers=range(0, 4))  # not stored: layers are absolute ids
        with pytest.raises(tierstore.InvalidObject):
            s.get("chunk", layers=[10, 12])  # not contiguous
        with pytest.raises(tierstore.InvalidObject):
            s.get("chunk", rows=[1])


def test_partial_layer_read_reads_only_that_layer(store_path, monkeypatch):
    kv = np.random.default_rng(0).standard_normal((8, 2, 4, 64, 32)).astype(np.float16)
    layer_bytes = kv[0].nbytes
    with tierstore.open(store_path) as s:
        s.put("c", KVCache(kv))
        s.flush()
        reads: list[int] = []
        real = s._engine.io.preadv

        def counting(fd, bufs, offset, *flags):
            reads.append(sum(memoryview(b).nbytes for b in bufs))
            return real(fd, bufs, offset, *flags)

        monkeypatch.setattr(s._engine.io, "preadv", counting)
        got = s.get("c", layers=5)
        assert np.array_equal(got.data, kv[5:6])
    assert sum(reads) == layer_bytes


def test_vectors_roundtrip_and_rows(store_path, real_emb):
    ids = np.arange(5000, 5000 + len(real_emb), dtype=np.int64)
    with tierstore.open(store_path, vector_extent_bytes=8192) as s:
        s.put("doc-17", Vectors(real_emb, ids=ids, metric="ip"), namespace="rag")
        full = s.get("doc-17", namespace="rag")
        assert np.array_equal(full.data, real_emb) and np.array_equal(full.ids, ids) and full.metric == "ip"
        rows = [5, 9, 11, 1023, 0, 9, -1]
        part = s.get("doc-17", namespace="rag", rows=rows)
        assert np.array_equal(part.data, real_emb[rows]) and np.array_equal(part.ids, ids[rows])
        part = s.get("doc-17", namespace="rag", rows=slice(100, 300, 7))
        assert np.array_equal(part.data, real_emb[100:300:7])
        with pytest.raises(tierstore.InvalidObject):
            s.get("doc-17", namespace="rag", rows=[1024])
        with pytest.raises(tierstore.InvalidObject):
            s.get("doc-17", namespace="rag", rows=[[1, 2]])
        s.put("noids", Vectors(real_emb[:10]))
        assert s.get("noids").ids is None and s.get("noids", rows=[3]).ids is None


def test_vectors_rows_read_only_needed_extents(store_path, real_emb, monkeypatch):
    with tierstore.open(store_path, vector_extent_bytes=16 * 768) as s:  # 16 rows per extent
        s.put("v", Vectors(real_emb))
        s.flush()
        reads: list[int] = []
        real = s._engine.io.preadv
        monkeypatch.setattr(s._engine.io, "preadv",
                            lambda fd, b, o, *f: reads.append(sum(x.nbytes for x in b)) or real(fd, b, o, *f))
        got = s.get("v", rows=[5, 9, 11])
        assert np.array_equal(got.data, real_emb[[5, 9, 11]])
    assert sum(reads) == 16 * 768  # one extent of 16 rows


def test_blobs(store_path):
    with tierstore.open(store_path) as s:
        png = bytes(range(256)) * 100
        s.put("img-3", Blob(png, media_type="image/png"))
        s.put("empty", Blob(b""))
        s.put("small", Blob(bytearray(b"x" * 100)))
        s.put("page", Blob(memoryview(b"y" * 4096)))
        got = s.get("img-3")
        assert isinstance(got, Blob) and got.data == png and got.media_type == "image/png"
        assert s.get("empty").data == b"" and s.get("empty").media_type == "application/octet-stream"
        assert s.get("small").data == b"x" * 100 and s.get("page").data == b"y" * 4096
        assert s.info("small").stored_bytes < 4096  # small blobs are packed, not page-aligned
        with pytest.raises(tierstore.InvalidObject):
            s.get("img-3", layers=1)


@needs_torch
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float64"])
def test_torch_dtypes_roundtrip(store_path, dtype):
    g = torch.Generator().manual_seed(1)
    t = torch.randn(3, 2, 2, 5, 8, generator=g).to(getattr(torch, dtype))
    v = torch.randn(7, 16, generator=g).to(getattr(torch, dtype))
    with tierstore.open(store_path) as s:
        s.put("kv", KVCache(t))
        s.put("v", Vectors(v, ids=torch.arange(7)))
        kv = s.get("kv")
        assert isinstance(kv.data, torch.Tensor) and kv.data.dtype == t.dtype
        assert torch.equal(kv.data.view(torch.uint8), t.view(torch.uint8))
        vv = s.get("v", rows=[6, 0])
        assert vv.data.dtype == v.dtype and torch.equal(vv.data.view(torch.uint8), v[[6, 0]].view(torch.uint8))
        assert torch.equal(vv.ids, torch.tensor([6, 0]))
        assert s.info("kv").dtype == dtype


@needs_torch
def test_device_cpu_returns_torch(store_path):
    kv = np.ones((1, 2, 1, 4, 4), dtype=np.float32)
    with tierstore.open(store_path) as s:
        s.put("k", KVCache(kv))
        got = s.get("k", device="cpu")
        assert isinstance(got.data, torch.Tensor) and got.data.device.type == "cpu"
        with pytest.raises(tierstore.InvalidObject):
            s.get("k", device="nonsense:0")
        if not torch.cuda.is_available():
            with pytest.raises(tierstore.InvalidObject):
                s.get("k", device="cuda:0")


def test_non_contiguous_and_nan_inputs(store_path):
    base = np.random.default_rng(2).standard_normal((2, 2, 3, 8, 6)).astype(np.float32)
    nc = base[:, :, :, ::2, :]
    assert not nc.flags.c_contiguous
    special = np.array([[np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45]], dtype=np.float32)
    with tierstore.open(store_path) as s:
        s.put("nc", KVCache(nc))
        s.put("nan", Vectors(special))
        assert np.array_equal(s.get("nc").data, nc)
        got = s.get("nan").data
        assert got.tobytes() == special.tobytes()


def test_overwrite_delete_contains_keys(store_path):
    with tierstore.open(store_path) as s:
        s.put("a", Blob(b"1"))
        s.put("a", Blob(b"2"))
        s.put(b"\x00\xff", Blob(b"3"))
        s.put("z", Blob(b"4"), namespace="other")
        assert s.get("a").data == b"2"
        assert s.contains("a") and "a" in s and not s.contains("b")
        assert s.keys() == [b"\x00\xff", "a"]
        assert s.keys(namespace="other") == ["z"] and s.keys(namespace="none") == []
        assert s.namespaces() == ["default", "other"]
        assert s.delete("a") is True and s.delete("a") is False
        with pytest.raises(tierstore.NotFound) as ei:
            s.get("a")
        assert isinstance(ei.value, KeyError) and ei.value.key == "a" and ei.value.namespace == "default"
        with pytest.raises(tierstore.NotFound):
            s.info("a")
        s.flush()
        assert s.keys() == [b"\x00\xff"]
    with tierstore.open(store_path) as s:
        assert s.keys() == [b"\x00\xff"] and s.get("z", namespace="other").data == b"4"


def test_str_and_bytes_keys_are_the_same_key(store_path):
    with tierstore.open(store_path) as s:
        s.put("k", Blob(b"1"))
        assert s.get(b"k").data == b"1"
        s.put(b"k", Blob(b"2"))
        assert s.get("k").data == b"2" and s.keys() == [b"k"]


def test_namespaces_isolate(store_path):
    with tierstore.open(store_path) as s:
        s.put("k", Blob(b"a"), namespace="tenant-a")
        s.put("k", Blob(b"b"), namespace="tenant-b")
        assert s.get("k", namespace="tenant-a").data == b"a"
        assert s.get("k", namespace="tenant-b").data == b"b"
        with pytest.raises(tierstore.NotFound):
            s.get("k")


def test_info_and_meta(store_path, real_kv):
    with tierstore.open(store_path) as s:
        s.put("c", KVCache(real_kv), meta={"model": "minilm", "tokens": [0, 128], "nested": {"a": None}})
        info = s.info("c")
        assert info.kind == "kv" and info.shape == real_kv.shape and info.dtype == "float16"
        assert info.logical_bytes == real_kv.nbytes and info.stored_bytes >= real_kv.nbytes
        assert info.codec == "raw" and info.lossless and info.tiers == ("ssd",)
        assert info.checksum.startswith("crc32c:") and len(info.extent_checksums) == real_kv.shape[0]
        assert info.meta == {"model": "minilm", "tokens": [0, 128], "nested": {"a": None}}
        assert info.layer_start == 0
        s.put("b", Blob(b"xyz", media_type="text/plain"))
        assert s.info("b").media_type == "text/plain" and s.info("b").shape == ()


def test_stats(store_path, real_kv):
    with tierstore.open(store_path) as s:
        s.put("c", KVCache(real_kv))
        s.put("c", KVCache(real_kv))
        st = s.stats()
        assert st["objects_indexed"] == 1 and st["segments"] == 1
        assert st["live_bytes"] >= real_kv.nbytes and st["dead_bytes"] >= real_kv.nbytes
        assert st["counters"]["puts"] == 2 and st["durability"] == "sync"
        on_disk = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(store_path)
                      for f in files if root.endswith(("segments", "index")) or f == "RESERVE")
        assert st["tiers"]["ssd"]["bytes_used"] == on_disk > st["segment_bytes"]  # as ssd_bytes counts them


# --- bad input: the documented exception, and the store unchanged --------------------------


def _snapshot(path):
    seg = os.path.join(path, "segments")
    return {n: os.path.getsize(os.path.join(seg, n)) for n in os.listdir(seg)}


BAD_PUTS = [
    ("kv wrong rank", lambda: KVCache(np.zeros((2, 2, 3), np.float16))),
    ("kv dim1 != 2", lambda: KVCache(np.zeros((2, 3, 1, 4, 4), np.float16))),
    ("kv int dtype", lambda: KVCache(np.zeros((2, 2, 1, 4, 4), np.int32))),
    ("kv empty", lambda: KVCache(np.zeros((2, 2, 1, 0, 4), np.float16))),
    ("kv negative layer_start", lambda: KVCache(np.zeros((1, 2, 1, 1, 1), np.float16), layer_start=-1)),
    ("kv bool layer_start", lambda: KVCache(np.zeros((1, 2, 1, 1, 1), np.float16), layer_start=True)),
    ("kv object dtype", lambda: KVCache(np.zeros((1, 2, 1, 1, 1), object))),
    ("kv complex", lambda: KVCache(np.zeros((1, 2, 1, 1, 1), np.complex64))),
    ("kv big-endian", lambda: KVCache(np.zeros((1, 2, 1, 1, 1), ">f4"))),
    ("kv list", lambda: KVCache([[1.0]])),
    ("vectors rank 1", lambda: Vectors(np.zeros(4, np.float32))),
    ("vectors empty", lambda: Vectors(np.zeros((0, 4), np.float32))),
    ("vectors bad metric", lambda: Vectors(np.zeros((1, 4), np.float32), metric="hamming")),
    ("vectors float ids", lambda: Vectors(np.zeros((2, 4), np.float32), ids=np.zeros(2, np.float32))),
    ("vectors ids wrong length", lambda: Vectors(np.zeros((2, 4), np.float32), ids=np.arange(3))),
    ("blob str", lambda: Blob("text")),
    ("blob bad media type", lambda: Blob(b"", media_type="")),
]


@pytest.mark.parametrize("name,make", BAD_PUTS, ids=[b[0] for b in BAD_PUTS])
def test_bad_objects_raise_invalid_object(name, make):
    with pytest.raises(tierstore.InvalidObject):
        make()


@pytest.mark.parametrize(
    "key,namespace,obj,meta",
    [
        ("x" * 401, "default", Blob(b"1"), None),
        (b"", "default", Blob(b"1"), None),
        ("a\x00b", "default", Blob(b"1"), None),
        (123, "default", Blob(b"1"), None),
        ("k", "", Blob(b"1"), None),
        ("k", "a/b", Blob(b"1"), None),
        ("k", "..", Blob(b"1"), None),
        ("k", "n" * 101, Blob(b"1"), None),
        ("k", b"ns", Blob(b"1"), None),
        ("k", "default", np.zeros(3), None),
        ("k", "default", Blob(b"1"), {"a": object()}),
        ("k", "default", Blob(b"1"), {1: "a"}),
        ("k", "default", Blob(b"1"), {"deep": [[[[[[[[[[1]]]]]]]]]]}),
        ("k", "default", Blob(b"1"), {"big": b"x" * 70000}),
        ("k", "default", Blob(b"1"), "notadict"),
    ],
)
def test_bad_put_arguments_leave_store_unchanged(store_path, key, namespace, obj, meta):
    with tierstore.open(store_path) as s:
        s.put("keep", Blob(b"kept"))
        s.flush()
        before = _snapshot(store_path)
        with pytest.raises(tierstore.InvalidObject):
            s.put(key, obj, namespace=namespace, meta=meta)
        assert _snapshot(store_path) == before
        assert s.keys() == ["keep"] and s.get("keep").data == b"kept"


def test_closed_store_raises(store_path):
    s = tierstore.open(store_path)
    s.put("a", Blob(b"1"))
    s.close()
    s.close()  # idempotent
    assert s.closed
    for call in (lambda: s.get("a"), lambda: s.put("b", Blob(b"2")), lambda: s.keys(), lambda: s.stats(),
                 lambda: s.delete("a"), lambda: s.info("a"), lambda: s.contains("a"), lambda: s.flush()):
        with pytest.raises(tierstore.StoreClosed):
            call()


def test_readonly_store_rejects_writes(store_path):
    with tierstore.open(store_path) as s:
        s.put("a", Blob(b"1"))
    before = _snapshot(store_path)
    with tierstore.open(store_path, readonly=True) as r:
        for call in (lambda: r.put("b", Blob(b"2")), lambda: r.delete("a"), lambda: r.flush(), lambda: r.compact()):
            with pytest.raises(tierstore.ReadOnlyError):
                call()
        assert r.get("a").data == b"1"
    assert _snapshot(store_path) == before


def test_open_errors(tmp_path):
    with pytest.raises(tierstore.StoreNotFound) as ei:
        tierstore.open(tmp_path / "missing", create=False)
    assert isinstance(ei.value, FileNotFoundError)
    with pytest.raises(tierstore.StoreNotFound):
        tierstore.open(tmp_path / "missing", readonly=True)
    assert not (tmp_path / "missing").exists()
    with pytest.raises(tierstore.InvalidObject):
        tierstore.open(tmp_path / "s", durability="maybe")
    with pytest.raises(tierstore.InvalidObject):
        tierstore.open(tmp_path / "s", no_such_option=1)
    with pytest.raises(tierstore.InvalidObject):
        tierstore.open(tmp_path / "s", segment_bytes="lots")
    (tmp_path / "file").write_text("x")
    with pytest.raises(tierstore.InvalidObject):
        tierstore.open(tmp_path / "file")


def test_size_strings(store_path):
    with tierstore.open(store_path, segment_bytes="1MiB", vector_extent_bytes="4KiB", index_map_size="1MB") as s:
        assert s.options.segment_bytes == 1 << 20 and s.options.vector_extent_bytes == 4096
        assert s.options.index_map_size == 1_000_000


def test_errors_form_one_tree():
    for name in ("NotFound", "StoreNotFound", "CorruptionError", "FormatVersionError", "StoreFull", "ReadOnlyError",
                 "InvalidObject", "StoreLocked", "StoreClosed", "StoreIOError"):
        assert issubclass(getattr(tierstore, name), tierstore.TierstoreError)
    assert issubclass(tierstore.NotFound, KeyError) and issubclass(tierstore.InvalidObject, ValueError)
    e = tierstore.CorruptionError("bad", path="/p", offset=7, segment=3)
    assert "offset=7" in str(e) and "hint" in str(e) and e.reason == "bad"


def test_create_and_readonly_must_be_bools(store_path):
    for bad in ({"create": "no"}, {"readonly": 1}):
        with pytest.raises(tierstore.InvalidObject, match="must be True or False"):
            tierstore.open(store_path, **bad)
    assert not os.path.exists(store_path)  # nothing was created


def test_an_uncreatable_path_says_what_to_check_not_to_recover():
    with pytest.raises(tierstore.StoreIOError) as e:
        tierstore.open("/proc/no-such-dir/kv")
    assert "exists" in (e.value.hint or "") and "recover" not in (e.value.hint or "")


def test_a_bad_remote_policy_is_named_before_the_missing_url(tmp_path):
    with pytest.raises(tierstore.InvalidObject, match="remote_policy must be one of"):
        tierstore.open(str(tmp_path / "s"), remote_policy="write-around")


@needs_torch
def test_vector_ids_past_int64_are_refused_not_wrapped():
    """ids are stored as int64: a torch uint64 id of 2^63 or more was converted unchecked and came
    back negative (a cold review, 2026-12-03); a Python int that large made numpy pick float64, and
    the error said "got float64".  Each is refused as not fitting; ids that fit are kept."""
    import torch

    for ids in (torch.tensor([2**63, 5], dtype=torch.uint64), [2**63, 1], np.array([2**63, 5], np.uint64)):
        with pytest.raises(tierstore.InvalidObject, match="do not fit in int64"):
            Vectors(np.ones((2, 4), np.float32), ids=ids)
    top = 2**63 - 1
    assert Vectors(torch.ones(2, 4), ids=torch.tensor([7, top], dtype=torch.uint64)).ids.tolist() == [7, top]
