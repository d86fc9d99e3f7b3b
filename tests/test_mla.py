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
