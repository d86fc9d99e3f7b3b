"""The cache tiers (DRAM, and the GPU tier run in CPU memory with gpu_device="cpu"):
promotion, eviction, pinning, streaming order, concurrent prefetch + get, stats, capacity."""

from __future__ import annotations

import os
import random
import tempfile

import numpy as np
import pytest

import tierstore
from tierstore.errors import InvalidObject, NotFound, StoreFull
from tierstore.tiers import policy as pol

from .conftest import needs_torch, run_threads

LAYER = 2 * 2 * 32 * 16 * 2  # bytes of one layer of kv(): 4 KiB


def kv(layers: int = 4, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((layers, 2, 2, 32, 16)).astype(np.float16)


def tier_stats(store: tierstore.Store, tier: str) -> dict:
    return store.stats()["tiers"][tier]


def assert_within_capacity(store: tierstore.Store) -> None:
    for name, t in store._tiers.tiers().items():
        with t.lock:
            held = sum(e.nbytes for e in t.entries.values())
            assert t.used == held, (name, t.used, held)  # byte-accurate accounting
            assert t.used + t.reserved <= t.capacity, name


# -- DRAM tier ---------------------------------------------------------------------------------


def test_get_promotes_to_dram_and_hits_after(store_path):
    a = kv()
    with tierstore.open(store_path, dram_bytes="1MiB") as s:
        s.put("a", tierstore.KVCache(a))
        assert s.info("a").tiers == ("ssd",)
        assert np.array_equal(s.get("a").data, a)  # miss: promoted
        assert s.info("a").tiers == ("dram", "ssd")
        st = tier_stats(s, "dram")
        assert (st["hits"], st["misses"], st["bytes_used"], st["bytes_in"]) == (0, 1, 4 * LAYER, 4 * LAYER)
        got = s.get("a", layers=[1, 2])
        assert np.array_equal(got.data, a[1:3]) and got.layer_start == 1
        st = tier_stats(s, "dram")
        assert (st["hits"], st["bytes_out"], st["promotions"]) == (1, 2 * LAYER, 1)
        assert st["promotion_p50_ms"] is not None and st["promotion_p99_ms"] >= st["promotion_p50_ms"]


def test_a_hit_is_served_from_dram_not_the_file(store_path):
    a = kv()
    with tierstore.open(store_path, dram_bytes="1MiB") as s:
        s.put("a", tierstore.KVCache(a))
        s.prefetch("a").result()
        s._engine.files.close_all()
        # a hit must not touch the segment: make any segment read fail loudly
        s._engine.files.acquire = lambda seg: (_ for _ in ()).throw(AssertionError("read the segment"))
        assert np.array_equal(s.get("a").data, a)
        # the returned array is a copy: changing it leaves the cached bytes alone
        out = s.get("a")
        out.data[:] = 0
        assert np.array_equal(s.get("a").data, a)


def test_partial_promotion_then_rest(store_path):
    a = kv(8)
    with tierstore.open(store_path, dram_bytes="1MiB") as s:
        s.put("a", tierstore.KVCache(a))
        assert s.prefetch("a", layers=range(0, 2)).result() == 2 * LAYER
        assert tier_stats(s, "dram")["bytes_used"] == 2 * LAYER
        assert np.array_equal(s.get("a", layers=1).data[0], a[1])
        assert tier_stats(s, "dram")["hits"] == 1
        assert np.array_equal(s.get("a").data, a)  # the other six layers are promoted now
        assert tier_stats(s, "dram")["bytes_used"] == 8 * LAYER
        assert_within_capacity(s)


def test_lru_eviction_is_byte_accurate(store_path):
    with tierstore.open(store_path, dram_bytes=10 * LAYER) as s:
        for i in range(6):
            s.put(f"k{i}", tierstore.KVCache(kv(2, seed=i)))
        for i in range(5):  # 5 objects x 2 layers = the whole capacity
            s.get(f"k{i}")
        assert tier_stats(s, "dram")["bytes_used"] == 10 * LAYER
        s.get("k0")  # k0 is now the most recent: k1 is the LRU victim
        s.get("k5")
        st = tier_stats(s, "dram")
        assert (st["evictions"], st["bytes_used"], st["objects"]) == (1, 10 * LAYER, 5)
        assert s.info("k1").tiers == ("ssd",) and s.info("k0").tiers == ("dram", "ssd")
        assert np.array_equal(s.get("k1").data, kv(2, seed=1))  # evicted objects still read from the log
        assert_within_capacity(s)


def test_object_larger_than_the_tier_is_read_from_the_log(store_path):
    a = kv(8)
    with tierstore.open(store_path, dram_bytes=4 * LAYER) as s:
        s.put("a", tierstore.KVCache(a))
        assert np.array_equal(s.get("a").data, a)
        st = tier_stats(s, "dram")
        assert st["bytes_used"] == 0 and st["admissions_refused"] == 1
        with pytest.raises(StoreFull) as e:
            s.prefetch("a").result()
        assert "dram_bytes" in e.value.hint


def test_overwrite_and_delete_drop_the_cached_copy(store_path):
    with tierstore.open(store_path, dram_bytes="1MiB") as s:
        s.put("a", tierstore.KVCache(kv(seed=1)))
        s.get("a")
        s.put("a", tierstore.KVCache(kv(seed=2)))
        assert tier_stats(s, "dram")["bytes_used"] == 0
        assert np.array_equal(s.get("a").data, kv(seed=2))
        s.delete("a")
        assert tier_stats(s, "dram")["bytes_used"] == 0
        with pytest.raises(NotFound):
            s.get("a")


def test_compaction_keeps_cached_copies_valid(store_path):
    with tierstore.open(store_path, dram_bytes="1MiB", segment_bytes=64 << 10) as s:
        for i in range(40):
            s.put(f"k{i}", tierstore.KVCache(kv(1, seed=i)))
        for i in range(0, 40, 2):
            s.delete(f"k{i}")
        s.get("k1")
        s.compact()
        assert s.info("k1").tiers == ("dram", "ssd")  # same bytes, new position: still valid
        assert np.array_equal(s.get("k1").data, kv(1, seed=1))
        assert tier_stats(s, "dram")["hits"] == 1


def test_codec_records_are_cached_encoded_in_dram(store_path):
    a = kv()
    with tierstore.open(store_path, dram_bytes="1MiB") as s:
        s.put("q", tierstore.KVCache(a), codec="int8")
        direct = s.get("q").data
        st = tier_stats(s, "dram")
        stored = s._engine.lookup(b"default", b"q").header.extent_lengths
        assert st["bytes_used"] == sum(stored) < a.nbytes  # the int8 codes, not the decoded fp16
        assert np.array_equal(s.get("q").data, direct)


def test_blobs_and_vectors_in_dram(store_path):
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((300, 64)).astype(np.float32)
    ids = np.arange(300, dtype=np.int64) * 7
    with tierstore.open(store_path, dram_bytes="4MiB", vector_extent_bytes=4096) as s:
        s.put("v", tierstore.Vectors(emb, ids=ids))
        s.put("b", tierstore.Blob(b"x" * 5000, media_type="text/plain"))
        s.prefetch(["v", "b"]).result()
        got = s.get("v", rows=[3, 250, 17])
        assert np.array_equal(got.data, emb[[3, 250, 17]]) and np.array_equal(got.ids, ids[[3, 250, 17]])
        assert s.get("b").data == b"x" * 5000
        assert tier_stats(s, "dram")["hits"] == 2


def test_readonly_handle_has_tiers_too(store_path):
    with tierstore.open(store_path) as w:
        w.put("a", tierstore.KVCache(kv()))
    with tierstore.open(store_path, readonly=True, dram_bytes="1MiB") as r:
        r.get("a")
        r.get("a")
        assert tier_stats(r, "dram")["hits"] == 1


# -- pins --------------------------------------------------------------------------------------


def test_pinned_objects_are_never_evicted_and_full_pins_raise(store_path):
    with tierstore.open(store_path, dram_bytes=4 * LAYER) as s:
        for i in range(4):
            s.put(f"k{i}", tierstore.KVCache(kv(2, seed=i)))
        s.pin("k0")
        s.pin("k1")
        assert tier_stats(s, "dram")["pinned_bytes"] == 4 * LAYER
        assert np.array_equal(s.get("k2").data, kv(2, seed=2))  # no room: read from the log, nothing evicted
        assert s.info("k0").tiers == ("dram", "ssd") and s.info("k2").tiers == ("ssd",)
        with pytest.raises(StoreFull):
            s.pin("k3")
        with pytest.raises(StoreFull):
            s.prefetch("k2").result()
        s.unpin("k1")
        s.pin("k3")  # k1 (unpinned now) makes room
        assert s.info("k1").tiers == ("ssd",) and s.info("k3").tiers == ("dram", "ssd")
        assert_within_capacity(s)


def test_pins_count_and_unpin_without_pin_is_an_error(store_path):
    with tierstore.open(store_path, dram_bytes=2 * LAYER) as s:
        s.put("a", tierstore.KVCache(kv(2)))
        s.put("b", tierstore.KVCache(kv(2, seed=1)))
        s.pin("a")
        s.pin("a")
        s.unpin("a")
        s.get("b")  # one pin left: a stays
        assert s.info("a").tiers == ("dram", "ssd")
        s.unpin("a")
        with pytest.raises(InvalidObject):
            s.unpin("a")
        with pytest.raises(NotFound):
            s.pin("missing")
        assert tier_stats(s, "dram")["pinned_objects"] == 0


def test_pinned_context_manager_releases_on_error(store_path):
    with tierstore.open(store_path, dram_bytes="1MiB") as s:
        s.put("a", tierstore.KVCache(kv()))
        with pytest.raises(RuntimeError), s.pinned("a"):
            assert tier_stats(s, "dram")["pinned_objects"] == 1
            raise RuntimeError("caller failed")
        assert tier_stats(s, "dram")["pinned_objects"] == 0
        assert not s._tiers.dram.pins  # no leaked pin


# -- prefetch, streaming ---------------------------------------------------------------------


def test_prefetch_future_reports_missing_keys(store_path):
    with tierstore.open(store_path, dram_bytes="1MiB") as s:
        s.put("a", tierstore.KVCache(kv()))
        f = s.prefetch(["a", "nope"])
        with pytest.raises(NotFound):
            f.result()
        with pytest.raises(InvalidObject):
            s.prefetch("a", tier="gpu")  # no GPU tier: refused at once
        with pytest.raises(InvalidObject):
            s.prefetch("a", tier="hbm")


def test_store_without_tiers_refuses_tier_calls_but_streams(store_path):
    a = kv(3)
    with tierstore.open(store_path, dram_bytes=0) as s:
        s.put("a", tierstore.KVCache(a, layer_start=5))
        with pytest.raises(InvalidObject):
            s.pin("a")
        got = list(s.stream_layers("a"))
        assert [i for i, _ in got] == [5, 6, 7]
        assert all(np.array_equal(x, a[i - 5]) for i, x in got)
        assert "dram" not in s.stats()["tiers"]


@needs_torch
def test_stream_layers_order_subset_and_overlap(store_path):
    import torch

    a = kv(6)
    with tierstore.open(store_path, dram_bytes="1MiB") as s:
        s.put("a", tierstore.KVCache(a, layer_start=10))
        seen = []
        submitted = []
        pool = s._tiers.executor
        orig = pool.submit

        def traced(fn, *args):
            submitted.append(args[0])
            return orig(fn, *args)

        pool.submit = traced
        for lid, layer in s.stream_layers("a", device="cpu", layers=range(11, 15)):
            assert isinstance(layer, torch.Tensor) and tuple(layer.shape) == (2, 2, 32, 16)
            assert torch.equal(layer, torch.from_numpy(a[lid - 10]))
            seen.append(lid)
            # the next layer's read was under way before this one was handed over (pipelining)
            assert lid + 1 in submitted or lid == 14
        assert seen == [11, 12, 13, 14]
        with pytest.raises(InvalidObject):
            s.stream_layers("a", layers=[11, 13])
        s.put("b", tierstore.Blob(b"x"))
        with pytest.raises(InvalidObject):
            s.stream_layers("b")


def test_stream_layers_reads_one_version(store_path):
    with tierstore.open(store_path, dram_bytes="1MiB") as s:
        s.put("a", tierstore.KVCache(kv(4, seed=1)))
        it = s.stream_layers("a")
        first = next(it)
        s.put("a", tierstore.KVCache(kv(4, seed=2)))  # overwritten mid-stream
        rest = list(it)
        layers = [first] + rest
        assert all(np.array_equal(x, kv(4, seed=1)[i]) for i, x in layers)


def test_concurrent_prefetch_and_get(store_path):
    objs = {f"k{i}": kv(2, seed=i) for i in range(24)}
    with tierstore.open(store_path, dram_bytes=20 * LAYER) as s:
        for k, v in objs.items():
            s.put(k, tierstore.KVCache(v))

        def reader(seed: int) -> None:
            rnd = random.Random(seed)
            for _ in range(150):
                k = rnd.choice(list(objs))
                if rnd.random() < 0.3:
                    s.prefetch([k, rnd.choice(list(objs))]).result()
                else:
                    assert np.array_equal(s.get(k).data, objs[k])
                assert_within_capacity(s)

        run_threads(reader, 4)
        st = tier_stats(s, "dram")
        assert st["bytes_used"] <= 20 * LAYER and st["bytes_reserved"] == 0 and st["evictions"] > 0
        assert_within_capacity(s)


# -- the GPU tier, in CPU memory -----------------------------------------------------------------


@needs_torch
def test_gpu_tier_promotion_hit_and_demotion(store_path):
    import torch

    with tierstore.open(store_path, dram_bytes="1MiB", gpu_bytes=4 * LAYER, gpu_device="cpu") as s:
        for i in range(3):
            s.put(f"k{i}", tierstore.KVCache(kv(2, seed=i)))
        out = s.get("k0", device="cpu")
        assert torch.equal(out.data, torch.from_numpy(kv(2, seed=0)))
        assert s.info("k0").tiers == ("gpu", "ssd")  # SSD -> GPU directly
        st = tier_stats(s, "gpu")
        assert st["io_path"] == "cpu" and st["misses"] == 1 and st["bytes_used"] == 2 * LAYER
        out.data.zero_()  # the caller's tensor is not the cached copy
        assert torch.equal(s.get("k0", device="cpu").data, torch.from_numpy(kv(2, seed=0)))
        assert tier_stats(s, "gpu")["hits"] == 1
        s.get("k1", device="cpu")
        s.get("k2", device="cpu")  # evicts k0 from the GPU tier: it falls back to DRAM
        assert s.info("k0").tiers == ("dram", "ssd")
        assert tier_stats(s, "dram")["demotions_in"] == 1
        assert tier_stats(s, "gpu")["evictions"] == 1
        s._engine.files.close_all()
        s._engine.files.acquire = lambda seg: (_ for _ in ()).throw(AssertionError("read the segment"))
        assert np.array_equal(s.get("k0").data, kv(2, seed=0))  # served by DRAM
        assert_within_capacity(s)


@needs_torch
def test_gpu_tier_decodes_lossy_records_on_the_device(store_path, real_kv):
    import torch

    with tierstore.open(store_path, gpu_bytes="8MiB", gpu_device="cpu") as s:
        for codec in ("int8", "int4", "fp8", "kvq-ans"):
            s.put(codec, tierstore.KVCache(real_kv), codec=codec)
            reference = torch.from_numpy(np.asarray(s.get(codec).data))  # CPU numpy decode
            s.prefetch(codec, tier="gpu").result()
            assert tier_stats(s, "gpu")["bytes_used"] >= real_kv.nbytes  # held decoded
            hit = s.get(codec, device="cpu", layers=range(1, 4))
            assert torch.equal(hit.data, reference[1:4]), codec
        assert tier_stats(s, "gpu")["hits"] == 4


@needs_torch
def test_gpu_tier_vectors_rows(store_path):
    import torch

    rng = np.random.default_rng(1)
    emb = rng.standard_normal((500, 32)).astype(np.float16)
    ids = rng.integers(0, 1 << 40, 500)
    with tierstore.open(store_path, gpu_bytes="1MiB", gpu_device="cpu", vector_extent_bytes=2048) as s:
        s.put("v", tierstore.Vectors(emb, ids=ids))
        s.prefetch("v", tier="gpu").result()
        got = s.get("v", rows=[499, 0, 77], device="cpu")
        assert torch.equal(got.data, torch.from_numpy(emb[[499, 0, 77]]))
        assert torch.equal(got.ids, torch.from_numpy(ids[[499, 0, 77]]))
        assert tier_stats(s, "gpu")["hits"] == 1
        s.put("b", tierstore.Blob(b"abc"))
        with pytest.raises(InvalidObject):
            s.prefetch("b", tier="gpu").result()


def test_tier_options_are_checked(store_path):
    with pytest.raises(InvalidObject):
        tierstore.open(store_path, gpu_device="cpu")
    with pytest.raises(InvalidObject):
        tierstore.open(store_path, dram_bytes="lots")
    with pytest.raises(InvalidObject):
        tierstore.open(store_path, dram_bytes=-1)
    with pytest.raises(InvalidObject):
        tierstore.open(store_path, dram_bytes="1MiB", policy="fifo")
    with pytest.raises(InvalidObject):
        tierstore.open(store_path, dram_admit="third")
    with tierstore.open(store_path, dram_bytes=None) as s:  # None and 0: no DRAM tier
        assert "dram" not in s.stats()["tiers"]


def big_kv(layers: int, seed: int = 0) -> np.ndarray:  # 128 KiB layers: above SecondRead.min_bytes
    return np.random.default_rng(seed).standard_normal((layers, 2, 8, 64, 64)).astype(np.float16)


def test_default_dram_tier_serves_a_second_read_from_memory(store_path):
    a, b = big_kv(4), big_kv(2, seed=1)
    with tierstore.open(store_path) as s:
        dram = s._tiers.dram
        assert dram is not None and dram.capacity == tierstore.tiers.config.auto_dram_bytes() > 0
        s.put("a", tierstore.KVCache(a))
        s.put("b", tierstore.KVCache(b))
        assert np.array_equal(s.get("a").data, a)  # first read: from the log, held on probation
        assert dram.used == a.nbytes == dram.probation_bytes and s.info("a").tiers == ("dram", "ssd")
        st = s.stats()["tiers"]["dram"]
        assert st["probation_admissions"] == 1 and st["probation_bytes"] == a.nbytes
        reads, acquire = [], s._engine.files.acquire
        s._engine.files.acquire = lambda seg: (reads.append(seg), acquire(seg))[1]
        assert np.array_equal(s.get("a", layers=[1, 2]).data, a[1:3])  # second read: from memory, kept
        assert np.array_equal(s.get("a").data, a)  # third: a hit
        s._engine.files.acquire = acquire
        assert reads == [] and dram.probation_bytes == 0 and tier_stats(s, "dram")["probation_hits"] == 1
        assert np.array_equal(s.get("b", layers=1).data[0], b[1])  # another object's first read
        assert dram.probation_bytes == b[1].nbytes
        s.put("a", tierstore.KVCache(b))  # a new version is a new object: first read again
        assert np.array_equal(s.get("a").data, b) and dram.probation_bytes == b[1].nbytes + b.nbytes
        s.prefetch("b").result()  # explicit promotions are kept at once
        assert "dram" in s.info("b").tiers and (b"default", b"b") not in dram.probation
        s.put("small", tierstore.Blob(b"x" * 4096))
        for _ in range(3):  # small reads are left to the page cache: never admitted
            assert s.get("small").data == b"x" * 4096
        assert s.info("small").tiers == ("ssd",)
        s.prefetch("small").result()  # unless promoted explicitly: then served from the tier
        hits = tier_stats(s, "dram")["hits"]
        assert s.get("small").data == b"x" * 4096 and tier_stats(s, "dram")["hits"] == hits + 1


def test_a_one_pass_scan_churns_only_the_probation_share(store_path):
    """Scan resistance: objects read twice stay while a scan reads many others once."""
    layer = big_kv(1)[0].nbytes  # 128 KiB
    with tierstore.open(store_path, dram_bytes=16 * layer, dram_admit="second") as s:
        dram = s._tiers.dram
        assert dram.probation_cap == 4 * layer
        hot = {f"hot{i}": big_kv(2, seed=i) for i in range(4)}  # 8 layers: half the tier
        for k, v in hot.items():
            s.put(k, tierstore.KVCache(v))
            s.get(k)
            s.get(k)  # read twice: protected
        assert dram.probation_bytes == 0 and dram.used == 8 * layer
        for i in range(30):  # a scan: 30 objects read once each
            s.put(f"scan{i}", tierstore.KVCache(big_kv(1, seed=100 + i)))
            s.get(f"scan{i}")
            assert dram.probation_bytes <= dram.probation_cap
        assert all("dram" in s.info(k).tiers for k in hot)  # the hot set survived the scan
        assert dram.probation_bytes == 4 * layer  # the last four scanned objects, on probation
        assert sum("dram" in s.info(f"scan{i}").tiers for i in range(30)) == 4
        big = big_kv(5, seed=7)  # larger than the probation share: read through, nothing evicted
        s.put("big", tierstore.KVCache(big))
        assert np.array_equal(s.get("big").data, big) and "dram" not in s.info("big").tiers
        assert all("dram" in s.info(k).tiers for k in hot)
        assert np.array_equal(s.get("big").data, big) and "dram" in s.info("big").tiers  # read twice: kept


def test_auto_dram_size_follows_the_container_memory_limit(tmp_path, monkeypatch):
    from tierstore.tiers import config as st

    phys = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    v2, v1 = tmp_path / "memory.max", tmp_path / "limit_in_bytes"
    monkeypatch.setattr(st, "CGROUP_MEMORY_LIMITS", (str(v2), str(v1)))
    assert st.memory_limit() == phys  # no cgroup files
    v2.write_text("max\n")
    v1.write_text("9223372036854771712\n")  # v1's "no limit"
    assert st.memory_limit() == phys
    v1.write_text(f"{2 << 30}\n")  # a 2 GiB container
    assert st.memory_limit() == min(phys, 2 << 30)
    assert st.auto_dram_bytes() == min(st.DRAM_AUTO_MAX, min(phys, 2 << 30) // st.DRAM_AUTO_SHARE)
    v2.write_text(f"{64 << 20}\n")  # 64 MiB: a 4 MiB tier
    assert st.auto_dram_bytes() == 4 << 20


def test_first_read_admission_is_kept_when_a_size_is_given(store_path):
    a = big_kv(2)
    with tierstore.open(store_path, dram_bytes="1MiB") as s, tierstore.open(
            store_path, readonly=True, dram_bytes="1MiB", dram_admit="second") as r:
        s.put("a", tierstore.KVCache(a))
        s.flush()
        s.get("a")
        assert s.info("a").tiers == ("dram", "ssd") and not s._tiers.dram.probation  # kept at once
        r.get("a")
        assert r.info("a").tiers == ("dram", "ssd") and r._tiers.dram.probation_bytes == a.nbytes  # on probation
        r.get("a")
        assert r.info("a").tiers == ("dram", "ssd") and r._tiers.dram.probation_bytes == 0  # kept


def test_second_read_memory_is_bounded():
    adm = tierstore.tiers.policy.SecondRead(remember=3)
    assert not adm.admit("a", 1)
    assert adm.admit("a", 1)  # admitted: forgotten again
    assert not adm.admit("a", 1)
    assert not adm.admit("a", 2)  # another version of the object
    for k in "bcd":
        assert not adm.admit(k, 1)
    assert not adm.admit("a", 2)  # pushed out by three newer first reads
    assert len(adm._seen) == 3


@needs_torch
def test_cuda_gpu_tier_without_cuda_says_how_to_test(store_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal is not reachable")
    with pytest.raises(InvalidObject) as e:
        tierstore.open(store_path, gpu_bytes="1GiB")
    assert 'gpu_device="cpu"' in e.value.hint


# -- policies ----------------------------------------------------------------------------------


def test_lru_policy_order():
    p = pol.LRU()
    for k in "abc":
        p.admitted(k, 1, ())
    p.touched("a")
    assert list(p.victims()) == ["b", "c", "a"]
    p.removed("c")
    assert list(p.victims()) == ["b", "a"]


def test_session_policy_keeps_frequent_sessions_and_drops_ended_first():
    p = pol.SessionAware(half_life=8)
    for turn in range(5):  # session "hot" returns five times
        p.session_active(b"hot")
        p.admitted(("hot", turn), 1, (b"hot",))
    p.session_active(b"once")
    p.admitted(("once", 0), 1, (b"once",))
    p.admitted(("once", 1), 1, (b"once",))
    order = list(p.victims())
    # the one-turn session goes first although it is the more recent; its newest entry first
    assert order[:2] == [("once", 1), ("once", 0)]
    p.session_ended(b"hot")
    assert list(p.victims())[:5] == [("hot", t) for t in reversed(range(5))]
    p.admitted(("queued", 0), 1, (b"queued",))  # one old turn: the lowest score of all
    assert list(p.victims())[-1] != ("queued", 0)
    p.session_active(b"queued")  # its next turn is waiting: kept over every other session
    assert list(p.victims())[-1] == ("queued", 0)
    p.touched(("queued", 0))  # the turn is served: ranked by score again
    p.session_active(b"once")
    assert list(p.victims())[-1] == ("once", 0)
    for k in list(p.victims()):
        p.removed(k)
    assert list(p.victims()) == []
    with pytest.raises(InvalidObject):
        pol.SessionAware(half_life=0)


def _tick(p: pol.Policy, n: int, tag: str = "tick") -> None:
    """``n`` turns of the store: reads of objects no session holds, each its own."""
    for i in range(n):
        p.admitted((tag, i), 1, ())


def test_cost_policy_evicts_a_session_silent_for_many_of_its_own_gaps_before_a_slow_one():
    p, lru = pol.CostAware(), pol.LRU()
    for q in (p, lru):
        q.admitted(("slow", 0), 1, (b"slow",))  # returns once in ~15 turns
        for turn in range(15):  # "fast" returns every other turn ...
            q.admitted(("fast", turn), 1, (b"fast",))
            _tick(q, 1, f"t{turn}")
            if turn == 7:
                q.touched(("slow", 0))
        _tick(q, 25)  # ... then falls silent for 12 of its gaps: most likely over
    first = list(p.victims())
    assert first.index(("fast", 14)) < first.index(("slow", 0))  # the slow one, silent for 2 of its gaps, stays
    assert first.index(("fast", 14)) < first.index(("fast", 0))  # newest of a session first: its prefix stays
    lru_order = list(lru.victims())
    assert lru_order.index(("slow", 0)) < lru_order.index(("fast", 14))  # LRU: the other way round
    assert p.worth(("s", b"fast")) < p.worth(("s", b"slow"))


def test_cost_policy_weighs_what_a_miss_costs_per_byte():
    p = pol.CostAware(models={"m70b": 70e9, "m8b": 8e9})
    for ns in (b"m70b", b"m8b"):  # the same tokens in the same bytes: the 70B chunk costs 8.75x to recompute
        p.cost_hint((ns, b"k"), 256)
        p.admitted((ns, b"k"), 32 << 20, ())
    assert list(p.victims()) == [(b"m8b", b"k"), (b"m70b", b"k")]  # the cheap one goes although newer
    blob, kv = (b"ns", b"blob"), (b"ns", b"kv")
    assert p.cost(blob, 10**9, 0) == pytest.approx(1.0)  # refetched at 1 GB/s
    assert p.cost(kv, 0, 256) == pytest.approx(256 * 2 * 8e9 / (989e12 * 0.5))


def test_cost_policy_keeps_announced_sessions_and_drops_ended_ones_first():
    p = pol.CostAware()
    for s in (b"a", b"b", b"c"):
        p.admitted((s, 0), 1, (s,))
        _tick(p, 2, s.decode())
    p.session_active(b"a")  # a's next turn is waiting: kept over every other object
    assert list(p.victims())[-1] == (b"a", 0)
    p.session_ended(b"c")  # dropped: first, although the most recent
    assert list(p.victims())[0] == (b"c", 0)
    p.touched((b"a", 0))  # the turn is served: ranked by worth again (the most recent: last)
    p.session_active(b"b")
    assert list(p.victims())[-1] == (b"b", 0)
    for k in list(p.victims()):
        p.removed(k)
    assert list(p.victims()) == []
    for bad in (0, 1, 1.5, True, "0.8"):
        with pytest.raises(InvalidObject):
            pol.CostAware(reuse=bad)
    assert isinstance(pol.CostAware(reuse=0.5).fresh(), pol.CostAware)


def test_cost_policy_edge_cases_found_in_review():
    p = pol.CostAware()
    _tick(p, 5)
    p.admitted("blob", 100, ())
    p.admitted("blob", 100, ())  # put again at once: a use, never a history without turns (worth 0: evicted first)
    assert p.worth(("k", "blob")) > 0 and list(p.victims())[0] != "blob"
    p.readmitted("blob", 50, ())  # more of it held (a tier's extents), not a use: its history stays
    assert p._uses[("k", "blob")].turns == 1  # (and a run of uses of one object is one turn)
    _tick(p, 1, "other")
    p.admitted("blob", 100, ())
    assert p._uses[("k", "blob")].turns == 2
    # an object several sessions hold: dropped only when all of them are, ranked by its own reads
    p.admitted(("s1", 0), 1, (b"s1",))
    p.admitted(("s2", 0), 1, (b"s2",))
    p.admitted("shared", 1, (b"s1", b"s2"))
    p.session_ended(b"s1")
    order = list(p.victims())
    assert order[0] == ("s1", 0) and order.index("shared") > 0  # s1's own object first, not the shared one
    p.touched("shared")  # read by s2: it does not revive s1
    assert list(p.victims())[0] == ("s1", 0)
    p.session_ended(b"s2")
    assert set(list(p.victims())[:3]) == {("s1", 0), ("s2", 0), "shared"}
    # a long silence: ranked in log space, so the cost per byte still orders the oldest
    q = pol.CostAware(models={"big": 70e9})
    for _ in range(3):  # three turns each, 2 apart: a fast rate
        for ns in (b"big", b"small"):
            q.cost_hint((ns, b"k"), 256)
            q.admitted((ns, b"k"), 1 << 20, ())
    _tick(q, 5000)
    assert q.worth(("k", (b"small", b"k"))) == 0.0  # (in floating point: ~e^-2500) ...
    assert [k for k in q.victims() if k[0] in (b"small", b"big")] == [(b"small", b"k"), (b"big", b"k")]


def test_cost_policy_counts_reads_that_fill_in_a_cached_object_and_not_copies_put_back():
    # a read of more layers of an object the tier holds in part is a use of it (the rest is
    # read and added: the insert itself is not a use, the read that wanted it is)
    with tierstore.open(tempfile.mkdtemp(), dram_bytes="64MiB", policy="cost") as s:
        data = np.random.default_rng(0).random((4, 2, 2, 16, 8)).astype(np.float16)
        s.put("a", tierstore.KVCache(data))
        s.put("b", tierstore.KVCache(data))
        s.get("a", layers=[0])
        s.get("b", layers=[0])
        s.get("a")  # a, read again (all of it): b goes first now, as under LRU
        assert [k for _, k in s._tiers.dram.policy.victims()] == [b"b", b"a"]
        assert tier_stats(s, "dram")["probation_hits"] == 0  # (reading the rest is no re-read)
    # an object without a session, evicted (removed), then put back as a copy: not a use, and its
    # own history goes on -- the oldest stays first, a recently read one stays last
    p = pol.CostAware()
    for i in range(20):
        p.admitted(("k", i), 1, ())
        _tick(p, 1, f"t{i}")
    p.touched(("k", 5))
    assert list(p.victims())[0] == ("k", 0) and list(p.victims())[-1] == ("k", 5)
    for key in (("k", 0), ("k", 5)):
        p.removed(key)
        p.readmitted(key, 1, ())
    assert list(p.victims())[0] == ("k", 0) and list(p.victims())[-1] == ("k", 5)
    assert p._uses[("k", ("k", 5))].turns == 2  # (no turn added by the copy)


def test_cost_policy_keeps_a_bounded_number_of_idle_session_histories(monkeypatch):
    monkeypatch.setattr(pol, "IDLE_HISTORIES", 10)
    p = pol.CostAware()
    for i in range(50):  # sessions whose objects all left the tier
        p.admitted(("s", i), 1, (f"s{i}".encode(),))
        p.removed(("s", i))
    p.session_active(b"never-held")
    assert len(p._uses) == 10 and ("s", b"never-held") in p._uses and ("s", b"s49") in p._uses
    p.admitted(("s", 49), 1, (b"s49",))  # a kept history goes on: one more turn
    assert p._uses[("s", b"s49")].turns == 2


def test_session_policy_in_a_store(store_path):
    with tierstore.open(store_path, dram_bytes=6 * LAYER, policy="session") as s:
        for turn in range(3):
            s.put(f"hot{turn}", tierstore.KVCache(kv(1, seed=turn)), session="hot")
        s.put("cold0", tierstore.KVCache(kv(1, seed=9)), session="cold")
        for _ in range(3):  # three turns of "hot": announced, then served
            s.prefetch_session("hot").result()
            for turn in range(3):
                s.get(f"hot{turn}")
        s.prefetch_session("cold").result()
        s.get("cold0")
        assert tier_stats(s, "dram")["policy"] == "session"
        for i in range(3):  # new objects without a session push the cold session out first
            s.put(f"x{i}", tierstore.KVCache(kv(1, seed=20 + i)))
            s.get(f"x{i}")
        assert s.info("cold0").tiers == ("ssd",)
        assert all(s.info(f"hot{t}").tiers == ("dram", "ssd") for t in range(3))
        s.drop_session("hot")
        assert_within_capacity(s)


def test_random_operations_keep_every_invariant(store_path):
    rnd = random.Random(7)
    model: dict[str, np.ndarray] = {}
    with tierstore.open(store_path, dram_bytes=12 * LAYER, durability="none") as s:
        pinned: dict[str, int] = {}
        for step in range(400):
            k = f"k{rnd.randrange(10)}"
            op = rnd.random()
            if op < 0.25:
                model[k] = kv(rnd.randint(1, 4), seed=step)
                s.put(k, tierstore.KVCache(model[k]))
            elif op < 0.35 and k in model:
                s.delete(k)
                del model[k]
                # a deleted key's pins stay on the key (released by unpin)
            elif op < 0.45 and k in model:
                try:
                    s.pin(k)
                    pinned[k] = pinned.get(k, 0) + 1
                except StoreFull:
                    pass
            elif op < 0.55 and pinned.get(k):
                s.unpin(k)
                pinned[k] -= 1
            elif k in model:
                lay = model[k].shape[0]
                lo = rnd.randrange(lay)
                got = s.get(k, layers=range(lo, lay))
                assert np.array_equal(got.data, model[k][lo:])
            assert_within_capacity(s)
            t = s._tiers.dram
            with t.lock:
                for key, n in pinned.items():
                    assert t.pins.get((b"default", key.encode()), 0) == n


class _FakeCuFile:
    """Stands in for kvikio.CuFile: pread into a (CPU) tensor, returning a future."""

    flip = False
    opened: list = []

    def __init__(self, path, mode):
        import os

        self.fd = os.open(path, os.O_RDONLY)
        _FakeCuFile.opened.append(path)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        import os

        os.close(self.fd)

    def pread(self, buf, size, file_offset):
        import os

        data = bytearray(os.pread(self.fd, size, file_offset))
        if _FakeCuFile.flip:
            data[0] ^= 1
        buf.numpy()[: len(data)] = np.frombuffer(bytes(data), np.uint8)

        class _F:
            def get(self_inner):
                return len(data)

        return _F()


@needs_torch
def test_gds_branch_reads_by_kvikio_and_verifies_checksums(store_path, monkeypatch):
    """The kvikio branch (GDS / compat) run on CPU with a stand-in CuFile: ranges, the
    checksum check of what it read, and the fallback for coded records."""
    import types

    import torch

    from tierstore import arrays

    fake = types.SimpleNamespace(CuFile=_FakeCuFile)
    monkeypatch.setitem(arrays._OPTIONAL, "kvikio", fake)
    a = kv(4)
    with tierstore.open(store_path, gpu_bytes="1MiB", gpu_device="cpu") as s:
        s._tiers.devio.io_path = "gds"  # as if the probe had found GDS
        s.put("a", tierstore.KVCache(a))
        s.put("q", tierstore.KVCache(a), codec="int8")
        _FakeCuFile.opened.clear()
        assert torch.equal(s.get("a", device="cpu").data, torch.from_numpy(a))
        assert len(_FakeCuFile.opened) == 1  # the raw record went through kvikio
        reference = torch.from_numpy(np.asarray(s.get("q").data))
        assert torch.equal(s.get("q", device="cpu").data, reference)
        assert len(_FakeCuFile.opened) == 1  # a coded record is staged through host memory
        s.put("b", tierstore.KVCache(a * 2))
        _FakeCuFile.flip = True
        try:
            with pytest.raises(tierstore.CorruptionError):
                s.get("b", device="cpu")
        finally:
            _FakeCuFile.flip = False
        assert s.info("b").tiers == ("ssd",)  # nothing cached from a bad read
        assert tier_stats(s, "gpu")["bytes_reserved"] == 0
        assert torch.equal(s.get("b", device="cpu").data, torch.from_numpy(a * 2))


def test_io_path_probe(monkeypatch):
    import types

    from tierstore import arrays
    from tierstore.tiers import devio

    cuda = types.SimpleNamespace(type="cuda")
    assert devio.probe_io_path(None) == "cpu"
    assert devio.probe_io_path(types.SimpleNamespace(type="cpu")) == "cpu"
    monkeypatch.setitem(arrays._OPTIONAL, "kvikio", None)
    assert devio.probe_io_path(cuda) == "posix"  # no kvikio: pinned preadv

    def props(gds):
        return types.SimpleNamespace(cufile_driver=types.SimpleNamespace(
            properties=types.SimpleNamespace(is_gds_available=gds)))

    monkeypatch.setitem(arrays._OPTIONAL, "kvikio", props(True))
    assert devio.probe_io_path(cuda) == "gds"
    monkeypatch.setitem(arrays._OPTIONAL, "kvikio", props(False))
    assert devio.probe_io_path(cuda) == "kvikio-compat"

    class NoDriver:  # kvikio installed, libcuda missing: it raises when asked
        @property
        def is_gds_available(self):
            raise RuntimeError("libcuda.so.1: cannot open shared object file")

    monkeypatch.setitem(arrays._OPTIONAL, "kvikio", types.SimpleNamespace(
        cufile_driver=types.SimpleNamespace(properties=NoDriver())))
    assert devio.probe_io_path(cuda) == "posix"


def test_clear_keeps_pinned_entries(store_path):
    with tierstore.open(store_path, dram_bytes="1MiB") as s:
        s.put("a", tierstore.KVCache(kv(2)))
        s.put("b", tierstore.KVCache(kv(2, seed=1)))
        s.pin("a")
        s.get("b")
        s._tiers.dram.clear()
        assert s.info("a").tiers == ("dram", "ssd") and s.info("b").tiers == ("ssd",)
        assert tier_stats(s, "dram")["bytes_used"] == 2 * LAYER
        assert np.array_equal(s.get("b").data, kv(2, seed=1))


@pytest.mark.parametrize("dram", [0, "auto"])
def test_stream_layers_after_close_raises_store_closed(store_path, dram):
    """(A new user's try: a bare RuntimeError "cannot schedule new futures after shutdown".)"""
    kv = np.random.default_rng(3).standard_normal((6, 2, 2, 16, 8)).astype(np.float16)
    s = tierstore.open(store_path, dram_bytes=dram)
    s.put("k", tierstore.KVCache(kv))
    it = s.stream_layers("k")
    assert np.array_equal(next(it)[1], kv[0])
    s.close()
    with pytest.raises(tierstore.StoreClosed):
        for _ in it:
            pass
    with tierstore.open(store_path, dram_bytes=dram) as s:  # the twin: a stream read to its end
        assert [lid for lid, _ in s.stream_layers("k")] == list(range(6))
