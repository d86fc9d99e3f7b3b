"""MLACache (format 1.4): latent attention caches [layers, tokens, dim] with layer extents, partial
reads, out=, stream_layers, the codecs that apply (lossless, int8, fp8) and their declared
bounds; bad objects refused; an older reader refuses the kind cleanly."""

from __future__ import annotations

import os

import numpy as np
import pytest

import tierstore
from tierstore import Blob, InvalidObject, MLACache
from tierstore.format import constants as fmt

from .conftest import needs_torch


@pytest.fixture
def latent(real_kv):
    """Real activations as a latent cache: 4 layers, 128 tokens, dim 2 x 32 (K and V of head 0)."""
    x = np.concatenate([real_kv[:4, 0, 0], real_kv[:4, 1, 0]], axis=-1)
    return np.ascontiguousarray(x)  # [4, 128, 64] fp16


def test_round_trip_partial_reads_out_and_stream(store_path, latent):
    with tierstore.open(store_path) as s:
        s.put("c", MLACache(latent, layer_start=10), namespace="ds")
        got = s.get("c", namespace="ds")
        assert isinstance(got, MLACache) and got.layer_start == 10 and np.array_equal(got.data, latent)
        part = s.get("c", namespace="ds", layers=range(11, 13))
        assert part.layer_start == 11 and np.array_equal(part.data, latent[1:3])
        out = np.empty((1, 128, 64), np.float16)
        assert s.get("c", namespace="ds", layers=13, out=out).data is out and np.array_equal(out[0], latent[3])
        assert [(i, np.array_equal(x, latent[i - 10])) for i, x in s.stream_layers("c", namespace="ds")] == \
            [(i, True) for i in range(10, 14)]
        info = s.info("c", namespace="ds")
        assert (info.kind, info.shape, info.layer_start) == ("mla", (4, 128, 64), 10)
        with pytest.raises(InvalidObject, match="rows= applies to Vectors"):
            s.get("c", namespace="ds", rows=[0])
        with pytest.raises(InvalidObject, match="outside the stored layers"):
            s.get("c", namespace="ds", layers=14)
    with tierstore.open(store_path) as s:  # and after reopening, with the index rebuilt from the log
        assert np.array_equal(s.get("c", namespace="ds").data, latent)


@pytest.mark.parametrize("codec", ["zstd", "shuffle+zstd", "int8", "int8+zstd", "fp8", "fp8+zstd"])
def test_codecs_keep_their_declared_bound(store_path, latent, codec):
    x = latent.astype(np.float32)
    with tierstore.open(store_path) as s:
        s.put("c", MLACache(latent), codec=codec)
        got = s.get("c").data.astype(np.float32)
        info = s.info("c")
    absmax = np.abs(x).max(axis=-1, keepdims=True)  # per token
    if codec in ("zstd", "shuffle+zstd"):
        assert np.array_equal(got, x) and info.lossless
    elif codec.startswith("int8"):  # per token: s <= 1.0906 * absmax / 127, error <= s / 2 + fp16 rounding
        assert np.all(np.abs(got - x) <= 0.5 * 1.0906 * absmax / 127 + np.abs(x) / 1024 + 1e-6)
        assert info.codec == codec and not info.lossless
    else:  # fp8: |x|/16 + s/1024, s = absmax / 448
        assert np.all(np.abs(got - x) <= np.abs(x) / 16 + absmax / 448 / 1024 + np.abs(x) / 1024 + 1e-6)


@needs_torch
def test_torch_dtypes_and_device_reads(store_path, latent):
    import torch
    t = torch.from_numpy(latent.astype(np.float32)).to(torch.bfloat16)
    with tierstore.open(store_path) as s:
        s.put("bf16", MLACache(t))
        s.put("q", MLACache(latent), codec="int8")
        assert torch.equal(s.get("bf16").data, t)
        on_cpu = s.get("q", device="cpu").data  # decoded with torch: the same bytes as numpy's decoder
        assert torch.equal(on_cpu, torch.from_numpy(s.get("q").data))


def test_codecs_that_do_not_apply_are_refused(store_path, latent):
    with tierstore.open(store_path) as s:
        for codec in ("int4", "kvq-ans", "binary"):
            with pytest.raises(InvalidObject):
                s.put("c", MLACache(latent), codec=codec)
        assert not s.contains("c")


def test_bad_objects_are_refused():
    with pytest.raises(InvalidObject, match=r"\[layers, tokens, dim\]"):
        MLACache(np.zeros((2, 3), np.float16))
    with pytest.raises(InvalidObject, match="floating dtype"):
        MLACache(np.zeros((2, 3, 4), np.int32))
    with pytest.raises(InvalidObject, match="empty"):
        MLACache(np.zeros((2, 0, 4), np.float16))
    with pytest.raises(InvalidObject, match="layer_start"):
        MLACache(np.zeros((2, 3, 4), np.float16), layer_start=-1)
    assert MLACache(np.zeros((2, 3, 4), np.float16)).num_layers == 2  # the valid twin


def test_an_older_reader_refuses_the_kind_cleanly(store_path, latent, monkeypatch):
    """A 1.3 tierstore knows no kind 5: it may not append to this store (ReadOnlyError), and a
    read-only open refuses the log it cannot parse (CorruptionError), never misreading bytes."""
    with tierstore.open(store_path) as s:
        s.put("blob", Blob(b"readable by every 1.x reader"))
        s.put("c", MLACache(latent))
    monkeypatch.setattr(fmt, "FORMAT_MINOR", 3)
    monkeypatch.setattr(fmt, "KIND_MLA", 0x7F)  # the kind id this older reader does not have
    monkeypatch.setattr(fmt, "LAYERED_KINDS", (fmt.KIND_KV,))
    with pytest.raises(tierstore.ReadOnlyError):
        tierstore.open(store_path)
    with pytest.raises(tierstore.CorruptionError):
        tierstore.open(store_path, readonly=True)
    monkeypatch.undo()  # the valid twin: this tierstore reads it
    with tierstore.open(store_path, readonly=True) as r:
        assert r.get("blob").data == b"readable by every 1.x reader" and r.info("c").kind == "mla"


def test_a_store_an_older_minor_began_gets_a_new_segment_before_any_append(store_path, latent, monkeypatch):
    """A 1.3 writer's last segment is never appended to by this version, so a 1.3 reader or writer
    never meets an mla record in a segment whose header says 1.3 (SPEC.md §11)."""
    monkeypatch.setattr(fmt, "FORMAT_MINOR", 3)
    with tierstore.open(store_path) as s:  # "a 1.3 writer"
        s.put("old", Blob(b"written by 1.3"))
    monkeypatch.undo()
    seg_dir = os.path.join(store_path, "segments")
    before = sorted(os.listdir(seg_dir))
    with tierstore.open(store_path) as s:
        assert s.get("old").data == b"written by 1.3"
        s.put("c", MLACache(latent))
        assert s.info("c").segment > int(before[-1].split(".")[0], 16)  # a segment of this version
    with tierstore.open(store_path) as s:  # a store this version began: appends go on in place
        s.put("d", MLACache(latent))
        assert s.info("d").segment == s.info("c").segment


def test_layer_selections_are_ids_never_truncated_floats(store_path, latent):
    """From a new user's try: ``layers=[1.5]`` read layer 1 (``int()`` of each item), ``[True]``
    layer 1; a slice's open start meant id 0, so ``slice(None, None)`` of an object stored from
    layer 5 was refused."""
    with tierstore.open(store_path) as s:
        s.put("m", MLACache(latent, layer_start=5))
        for bad in ([6.5], [True], [5.0], ["6"], slice(5.5, 7), slice(None, 7.0)):
            with pytest.raises(InvalidObject, match="layers"):
                s.get("m", layers=bad)
            with pytest.raises(InvalidObject, match="layers"):
                list(s.stream_layers("m", layers=bad))
        for sel, ids in ((slice(None, None), [5, 6, 7, 8]), (slice(-2, None), [7, 8]), (slice(6, 8), [6, 7]),
                         ([np.int64(6), 7], [6, 7]), (range(5, 7), [5, 6]), (8, [8])):
            got = s.get("m", layers=sel)
            assert got.layer_start == ids[0] and np.array_equal(got.data, latent[ids[0] - 5 : ids[-1] - 4])
            assert [lid for lid, _ in s.stream_layers("m", layers=sel)] == ids


def test_layer_ids_past_2_63_are_refused_before_anything_is_written(store_path, latent):
    """``layer_start`` of 2^64 failed inside msgpack (OverflowError); ids past 2^64 were stored."""
    kv = np.zeros((2, 2, 1, 4, 8), np.float16)
    with tierstore.open(store_path) as s:
        for obj in (MLACache(latent[:3], layer_start=2**64 - 1), MLACache(latent[:1], layer_start=2**63),
                    tierstore.KVCache(kv, layer_start=2**64), tierstore.KVCache(kv, layer_start=2**63 - 1)):
            with pytest.raises(InvalidObject, match="2\\^63"):
                s.put("m", obj)
        assert s.keys() == []
        s.put("top", MLACache(latent[:2], layer_start=2**63 - 2))  # twin: the largest ids fit
        assert [lid for lid, _ in s.stream_layers("top")] == [2**63 - 2, 2**63 - 1]
        # and are selected by slices too (a slice listed every id below the object's: OverflowError)
        for sel, first in ((slice(None, None), 2**63 - 2), (slice(-1, None), 2**63 - 1), (2**63 - 1, 2**63 - 1)):
            assert s.get("top", layers=sel).layer_start == first
        assert [lid for lid, _ in s.stream_layers("top", layers=slice(None, None))] == [2**63 - 2, 2**63 - 1]
        with pytest.raises(InvalidObject, match="outside the stored layers"):
            s.get("top", layers=slice(0, 2))


def test_a_codec_can_be_evaluated_on_an_mla_sample(latent):
    from tierstore.codecs import evaluate

    class Mine(MLACache):  # (a subclass: its kind by isinstance)
        pass

    for sample, kind in ((latent, None), (MLACache(latent), None), (latent, "mla"), (Mine(latent), None)):
        r = evaluate("int8", sample, kind=kind)
        assert not r["bit_exact"] and 0 < r["rel_l2"] < 0.02 and r["ratio"] > 1.9
        assert evaluate("zstd", sample, kind=kind)["bit_exact"]
    with pytest.raises(InvalidObject, match="no codec 'int4' for mla"):
        evaluate("int4", latent)
    with pytest.raises(InvalidObject, match="got shape"):
        evaluate("int8", latent, kind="kv")
    with pytest.raises(InvalidObject, match="kind="):
        evaluate("int8", MLACache(latent), kind="vectors")


def test_slices_of_an_older_record_past_2_63_are_refused_cleanly():
    """Writers before 2026-12-04 wrote layer ids up to 2^64 + layers, which readers still read
    (SPEC.md §5.2): a slice outside such a record is InvalidObject (len() of its range overflowed:
    OverflowError), one inside it selects."""
    from tierstore.format.block import select_layers

    for start in (2**63 + 5, 2**64):
        for sel in (slice(0, None), slice(None, None, -1), slice(1, None)):
            with pytest.raises(InvalidObject, match="outside the stored layers"):
                select_layers(sel, start, 3)
        assert select_layers(slice(None, None), start, 3) == [0, 1, 2]
        assert select_layers(slice(-1, None), start, 3) == [2]
