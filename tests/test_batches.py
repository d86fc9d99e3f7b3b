"""Many callers: batched calls (put_many, get_many, contains_many, delete_many), put_async,
get(out=) into caller-owned memory, and scattered KV puts (KVCache.from_layers).

Batches are atomic where they say so: the power-loss harness of test_crash_states.py is run
over them (every crash state equals the model after a whole number of operations, so a batch
is never half applied), and every batch checks all of its items before writing any.
"""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest

import tierstore
from tierstore import Blob, CorruptionError, InvalidObject, KVCache, Vectors
from tierstore.format import constants as fmt

from .conftest import needs_torch, promotions_held, segment_files
from .test_crash_states import Explorer, _value, fast_tmp  # noqa: F401  (fixture)

# -- crash states: a batch is all or nothing ------------------------------------------------

BATCH_OPS = ["put_many", "delete_many", "put_async", "overwrite_many", "compact"]
BATCH_KEYS = ("b1", "b2", "b3")


def _batch_value(step: int, i: int) -> bytes:
    # together larger than the log's write buffer and not page-aligned: the batch reaches the
    # file in one large write that a crash can cut anywhere (states C and D)
    return bytes([(step * 3 + i) % 251 + 1]) * (9000 + 4096 * i + 131 * step)


class BatchExplorer(Explorer):
    def do(self, store: tierstore.Store, op: str, step: int) -> None:
        if op == "put_many":
            store.put_many([(k, Blob(_batch_value(step, i))) for i, k in enumerate(BATCH_KEYS)])
        elif op == "overwrite_many":
            store.put_many([("k0", Blob(_value(step))), ("b2", Blob(_batch_value(step, 7)))])
        elif op == "delete_many":
            store.delete_many(["k1", "b1", "kv"])
        elif op == "put_async":
            store.put_async(f"a{step}", Blob(_value(step))).result()
        else:
            store.compact()

    def models(self, ops: tuple[str, ...]) -> list:
        model = dict(self.base)
        out = [dict(model)]
        for step, op in enumerate(ops, start=1):
            if op == "put_many":
                model.update({k: _batch_value(step, i) for i, k in enumerate(BATCH_KEYS)})
            elif op == "overwrite_many":
                model.update({"k0": _value(step), "b2": _batch_value(step, 7)})
            elif op == "delete_many":
                for k in ("k1", "b1", "kv"):
                    model.pop(k, None)
            elif op == "put_async":
                model[f"a{step}"] = _value(step)
            out.append(dict(model))
        return out


def test_power_loss_states_with_batches(fast_tmp, capsys):  # noqa: F811
    ex = BatchExplorer(fast_tmp, "64KiB")
    ex.explore(BATCH_OPS)
    with capsys.disabled():
        print(f"\ncrash states (batches): {ex.stats}")
    assert ex.stats["states"] >= 1000


# -- put_many -----------------------------------------------------------------------------------


def test_put_many_round_trip_one_sync(store_path):
    with tierstore.open(store_path) as s:
        before = s.stats()["counters"]["syncs"]
        kv = np.random.default_rng(0).standard_normal((2, 2, 2, 8, 4)).astype(np.float16)
        s.put_many([("a", Blob(b"x" * 10)), ("b", KVCache(kv)), ("c", Blob(b"y"), {"turn": 3})], namespace="n")
        assert s.stats()["counters"]["syncs"] - before == 1  # one fdatasync for the batch
        assert s.get("a", namespace="n").data == b"x" * 10
        assert np.array_equal(s.get("b", namespace="n").data, kv)
        assert s.get("c", namespace="n").meta == {"turn": 3}
        assert s.stats()["counters"]["puts"] == 3
    with tierstore.open(store_path) as s:  # and after a reopen
        assert sorted(s.keys(namespace="n")) == ["a", "b", "c"]


@pytest.mark.parametrize("bad, codec", [
    ([("a", Blob(b"1")), ("b", "not an object")], None),
    ([("a", Blob(b"1")), ("a", Blob(b"2"))], None),
    ([("a", Blob(b"1")), ("b",)], None),
    ([("a", Blob(b"1")), ("b", Blob(b"2"), None, "extra")], None),
    ([("a", Blob(b"1")), ("", Blob(b"2"))], None),
    ([("a", Blob(b"1")), ("b", Blob(b"2"), {"x": object()})], None),
    ([("a", KVCache(np.ones((1, 2, 1, 1, 1), np.float32))), ("b", Blob(b"2"))], "int8"),  # int8 takes no blob
])
def test_put_many_checks_everything_before_writing(store_path, bad, codec):
    with tierstore.open(store_path) as s:
        s.put("keep", Blob(b"k"))
        tail = (s.stats()["next_lsn"], s.stats()["segment_bytes"])
        with pytest.raises(InvalidObject):
            s.put_many(bad, codec=codec)
        assert s.keys() == ["keep"]  # nothing of the batch was written
        assert (s.stats()["next_lsn"], s.stats()["segment_bytes"]) == tail


def test_put_many_checks_its_codec_argument_even_for_an_empty_batch(store_path):
    """A codec no object could take was accepted with an empty batch, and blamed on item 0
    otherwise; a codec that some kind takes is left to each item's kind (the twins)."""
    with tierstore.open(store_path) as s:
        for codec, match in ((3, "codec=3: no such codec"), ("nope", "no such codec; available: .*int8"),
                             ("zstd:level=99", "zstd level"), ("raw+zstd", "not a codec")):
            for items in ([], [("a", Blob(b"1"))]):
                with pytest.raises(InvalidObject, match=match) as e:
                    s.put_many(items, codec=codec)
                assert "item 0" not in str(e.value)
        for codec in ("int8", "zstd", "int8+zstd", "shuffle+zstd"):
            s.put_many([], codec=codec)
        s.put_many([("a", Blob(b"1"))], codec="zstd")
        with pytest.raises(InvalidObject, match="item 0: no codec 'int8' for blob"):
            s.put_many([("b", Blob(b"1"))], codec="int8")
        assert s.keys() == ["a"]


def test_put_many_of_a_dict_says_to_pass_its_items(store_path):
    """(A new user's try: "put_many item 0: expected (key, obj) ..., got str".)"""
    with tierstore.open(store_path) as s:
        with pytest.raises(InvalidObject, match="not a dict") as e:
            s.put_many({"a": Blob(b"A")})
        assert "d.items()" in e.value.hint and s.keys() == []
        s.put_many({"a": Blob(b"A")}.items())  # the twin
        assert s.get("a").data == b"A"


def test_put_many_refuses_a_batch_larger_than_a_group(store_path):
    with tierstore.open(store_path) as s:
        with pytest.raises(InvalidObject, match="at most 4096") as e:
            s.put_many([(f"k{i}", Blob(b"x")) for i in range(fmt.GROUP_MAX + 1)])
        assert "split" in e.value.hint
        assert s.keys() == []
        s.put_many([(f"k{i}", Blob(b"x")) for i in range(fmt.GROUP_MAX)])  # the largest batch fits
        assert len(s.keys()) == fmt.GROUP_MAX


def test_put_many_with_a_session_dedups_and_references(store_path):
    with tierstore.open(store_path) as s:
        s.put("a", Blob(b"A"))
        s.put_many([("a", Blob(b"A")), ("b", Blob(b"B"))], session="s1")
        assert sorted(s.session_keys("s1")) == ["a", "b"]
        assert s.stats()["counters"]["dedup_puts"] == 1  # "a" was stored already: only its reference
        assert s.drop_session("s1") == 1  # "b" goes, "a" was put without a session and stays
        assert s.keys() == ["a"]
        s.put_many([("a", Blob(b"A"))], session="s2")
        s.put_many([("a", Blob(b"A"))], session="s2")  # nothing to write: still returns, durable


# -- get_many / contains_many / delete_many -----------------------------------------------------


def test_get_many_order_misses_and_kinds(store_path):
    rng = np.random.default_rng(1)
    kv = rng.standard_normal((3, 2, 2, 4, 8)).astype(np.float32)
    emb = rng.standard_normal((10, 6)).astype(np.float32)
    with tierstore.open(store_path) as s:
        s.put_many([(f"b{i}", Blob(bytes([i]) * (i * 100 + 1))) for i in range(50)])
        s.put("kv", KVCache(kv, layer_start=2), meta={"m": 1})
        s.put("big", Blob(b"z" * (200 << 10)))
        s.put("vec", Vectors(emb))
        s.put("zb", Blob(b"q" * 5000), codec="zstd")
        keys = ["kv", "missing", *[f"b{i}" for i in reversed(range(50))], "big", "vec", "zb", b"bytes-miss"]
        got = s.get_many(keys)
        assert len(got) == len(keys)
        assert got[1] is None and got[-1] is None
        assert np.array_equal(got[0].data, kv) and got[0].layer_start == 2 and got[0].meta == {"m": 1}
        for i, obj in zip(reversed(range(50)), got[2:52]):
            assert obj.data == bytes([i]) * (i * 100 + 1)
        assert got[52].data == b"z" * (200 << 10)
        assert np.array_equal(got[53].data, emb)
        assert got[54].data == b"q" * 5000
        layer = s.get_many(["kv", "nope"], layers=3)
        assert np.array_equal(layer[0].data, kv[1:2]) and layer[1] is None
        assert s.get_many([]) == []
        with pytest.raises(InvalidObject, match="sequence of keys"):
            s.get_many("kv")
        s.flush()
    with tierstore.open(store_path, dram_bytes="1MiB") as s:  # through a DRAM tier that admits at once
        for _ in range(2):
            got = s.get_many(["b3", "kv", "b4"])
            assert got[0].data == bytes([3]) * 301 and np.array_equal(got[1].data, kv)
        assert s.stats()["tiers"]["dram"]["hits"] >= 1


def test_get_many_sees_unflushed_writes_and_deletes(store_path):
    with tierstore.open(store_path, durability="group", index_commit_ms=1e6) as s:
        s.put("a", Blob(b"1"))
        s.put_many([("b", Blob(b"2")), ("c", Blob(b"3"))])
        s.delete("a")
        assert [None if o is None else o.data for o in s.get_many(["a", "b", "c"])] == [None, b"2", b"3"]
        assert s.contains_many(["a", "b", "c", "d"]) == [False, True, True, False]


def test_get_many_detects_damage_and_a_valid_batch_still_reads(store_path):
    with tierstore.open(store_path) as s:
        s.put_many([(f"k{i}", Blob(bytes([65 + i]) * 3000)) for i in range(5)])
    seg = segment_files(store_path)[-1]
    with open(seg, "rb") as f:
        data = f.read()
    pos = data.index(bytes([67]) * 3000) + 1500  # inside k2's payload
    with open(seg, "r+b") as f:
        f.seek(pos)
        f.write(b"\x00")
    with tierstore.open(store_path) as s:
        assert [o.data[:1] for o in s.get_many(["k0", "k1", "k3", "k4"])] == [b"A", b"B", b"D", b"E"]  # the twin
        with pytest.raises(CorruptionError) as e:
            s.get_many(["k0", "k2", "k4"])
        assert e.value.key == "k2" and e.value.path == seg and e.value.segment is not None


def test_contains_many_and_delete_many(store_path):
    with tierstore.open(store_path) as s:
        s.put_many([(k, Blob(k.encode())) for k in ("a", "b", "c")])
        s.put("c", Blob(b"c"), session="s")
        assert s.contains_many(["a", "x", "c", b"a"]) == [True, False, True, True]  # as contains: b"a" is "a"
        assert s.delete_many(["a", "x", "c"]) == [True, False, True]
        assert s.keys() == ["b"] and s.session_keys("s") == []  # c's reference went with it
        assert s.delete_many(["x"]) == [False]
        with pytest.raises(InvalidObject):
            s.delete_many(["b", "b"])
        with pytest.raises(InvalidObject):
            s.contains_many("b")
        assert s.keys() == ["b"]


@pytest.mark.parametrize("bad", ["k\x00", "a\\b", ".", "..", "", "x" * 2000, "\ud800", 7, None, b""])
def test_lookups_of_many_keys_check_every_key_as_one_key_is_checked(store_path, bad):
    """contains_many / match_prefix / get_many check a batch's keys in a few passes over the
    whole list (names.key_bytes); a bad key anywhere is the InvalidObject ``contains`` raises."""
    from tierstore.names import encode_key, key_bytes

    good = [f"k{i}" for i in range(500)] + [b"\xff\x00raw", bytearray(b"ba"), "caf\u00e9/x"]
    assert key_bytes(good) == [encode_key(k)[0] for k in good]  # the twin: valid keys pass, same bytes
    keys = good[:300] + [bad] + good[300:]
    with pytest.raises(InvalidObject) as one:
        encode_key(bad)
    with pytest.raises(InvalidObject) as many:
        key_bytes(keys)
    assert str(many.value) == str(one.value)
    with tierstore.open(store_path) as s:
        s.put("k0", Blob(b"0"))
        for fn in (s.contains_many, s.match_prefix, s.get_many):
            with pytest.raises(InvalidObject):
                fn(keys)
        assert s.contains_many(good[:3]) == [True, False, False] and s.match_prefix(good) == 1
        # match_prefix reads hashes a batch at a time: an endless generator ends at its first miss
        assert s.match_prefix(f"k{i}" for i in itertools.count()) == 1


def test_batches_through_a_scoped_namespace(store_path):
    with tierstore.open(store_path) as s:
        s.put_many([("a", Blob(b"1"))], namespace="t")
        assert s.get_many(["a"], namespace="t")[0].data == b"1"
        assert s.get_many(["a"])[0] is None


# -- put_async ----------------------------------------------------------------------------------


@pytest.mark.parametrize("durability", ["sync", "group", "none"])
def test_put_async_completes_when_synced(store_path, durability):
    with tierstore.open(store_path, durability=durability) as s:
        futures = [s.put_async(f"k{i}", Blob(bytes([i]) * 5000)) for i in range(20)]
        assert s.get("k19").data == bytes([19]) * 5000  # readable at once, before it is durable
        for f in futures:
            assert f.result(timeout=30) is None
        syncs = s.stats()["counters"]["syncs"]
        assert syncs <= 21  # syncs are shared (often far fewer than 20)
        with pytest.raises(InvalidObject):
            s.put_async("bad", "not an object")  # bad input raises at once, nothing written
        assert "bad" not in s


def test_put_async_futures_finish_before_close(store_path):
    s = tierstore.open(store_path)
    futures = [s.put_async(f"k{i}", Blob(b"x" * 100_000)) for i in range(8)]
    s.close()
    assert all(f.done() and f.exception() is None for f in futures)
    with tierstore.open(store_path) as s:
        assert len(s.keys()) == 8


def test_put_async_futures_are_running_and_cannot_be_cancelled(store_path):
    """cancel() of a queued sync said True while the put stayed stored (and result() then raised
    CancelledError for an object in the store): the Future is running when returned."""
    import concurrent.futures as cf

    with tierstore.open(store_path, durability="none") as s:
        futures = [s.put_async(f"k{i}", Blob(b"x" * 10)) for i in range(50)]
        assert not any(f.cancel() for f in futures)
        done, not_done = cf.wait(futures, timeout=30)
        assert len(done) == 50 and not not_done
        assert all(f.result() is None for f in futures) and all(s.contains_many([f"k{i}" for i in range(50)]))


SHUTDOWN_SCRIPT = """
import atexit, os, sys, threading
import numpy as np
import tierstore
from tierstore import Blob, KVCache

path, where = sys.argv[1], sys.argv[2]
kv = np.arange(2 * 2 * 2 * 64 * 64, dtype=np.float16).reshape(2, 2, 2, 64, 64)

def filled(p):
    st = tierstore.open(p, dram_bytes=0)
    st.put("a", KVCache(kv)); st.put("b", KVCache(kv))
    return st

def work(st, tag):
    fut = st.put_async("late", Blob(b"1"))
    print(tag, "put_async", fut.done(), fut.result(timeout=30))
    big = np.arange(4 << 20, dtype=np.float32)  # 16 MiB: written by the I/O threads
    st.put("big", KVCache(big.reshape(1, 2, 1, 2 << 20, 1)))
    print(tag, "big", np.array_equal(st.get("big").data.reshape(-1), big))
    print(tag, "get_many", all(np.array_equal(o.data, kv) for o in st.get_many(["a", "b"])))
    print(tag, "stream", [i for i, _ in st.stream_layers("a")], flush=True)
    st.close()

s = filled(path)

def late():
    import concurrent.futures.thread as pools, time
    deadline = time.monotonic() + 60
    while not pools._shutdown:  # (a thread: until the ended main thread has closed the pools to new work)
        assert time.monotonic() < deadline
        time.sleep(0.01)
    if where == "fork":  # a child forked now: its main thread (this one) lives, its pools refuse work
        pid = os.fork()
        if pid == 0:
            try:
                work(filled(path + "-child"), "child")
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
    work(s, "parent")

if where == "atexit":
    atexit.register(late)
else:
    threading.Thread(target=late).start()  # the main thread ends now
"""


@pytest.mark.parametrize("where", ["thread", "atexit", "fork"])
def test_calls_work_after_the_main_thread_ended(tmp_path, where):
    """Once the main thread has ended (a server whose main thread only started its workers), in
    an atexit handler, or in a child forked then, Python's thread pools refuse new work:
    put_async raised RuntimeError with its put made, a 16 MiB put raised it, get_many said the
    open store was closed, and stream_layers raised RuntimeError.  Each now works, in the
    calling thread."""
    import subprocess
    import sys

    script = tmp_path / "late.py"
    script.write_text(SHUTDOWN_SCRIPT)
    src = str(__import__("pathlib").Path(tierstore.__file__).parents[1])
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "s"), where], capture_output=True, text=True,
                         timeout=120, env={**__import__("os").environ, "PYTHONPATH": src})
    assert out.returncode == 0 and "Error" not in out.stderr, out.stderr
    lines = ["put_async True None", "big True", "get_many True", "stream [0, 1]"]
    tags = ["child", "parent"] if where == "fork" else ["parent"]
    assert out.stdout.splitlines() == [f"{t} {line}" for t in tags for line in lines], out.stdout
    for p in [tmp_path / "s"] + ([tmp_path / "s-child"] if where == "fork" else []):
        with tierstore.open(p) as s:
            assert sorted(s.keys()) == ["a", "b", "big", "late"]


def test_prefetches_cancelled_by_close_are_done_for_concurrent_futures_wait(store_path):
    """close() cancels the prefetches still queued; concurrent.futures' wait() / as_completed()
    never heard of it (a pool shut down with cancel_futures does not tell them)."""
    import concurrent.futures as cf

    s = tierstore.open(store_path, dram_bytes="1MiB")
    s.put("k", Blob(b"x" * 1000))
    with promotions_held(s) as (_, hold):
        busy = [s.prefetch(["k"]) for _ in range(s._tiers.executor._max_workers)]  # every tier thread held
        queued = s.prefetch(["k"])
        closing = threading.Thread(target=s.close)
        closing.start()
        for _ in range(3000):
            if queued.cancelled():
                break
            threading.Event().wait(0.01)
        hold.set()
        closing.join(30)
    assert queued.cancelled() and not closing.is_alive()
    done, not_done = cf.wait([queued, *busy], timeout=5)
    assert queued in done and not not_done
    assert list(cf.as_completed([queued], timeout=5)) == [queued]


# -- get(out=) ----------------------------------------------------------------------------------


def _kv(shape=(4, 2, 2, 16, 8), dtype=np.float32, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("codec", [None, "zstd", "shuffle+zstd"])
def test_get_into_a_numpy_buffer(store_path, codec):
    kv = _kv()
    with tierstore.open(store_path) as s:
        s.put("kv", KVCache(kv, layer_start=5), codec=codec)
        out = np.zeros_like(kv)
        obj = s.get("kv", out=out)
        assert obj.data is out and np.array_equal(out, kv) and obj.layer_start == 5
        part = np.zeros((2, *kv.shape[1:]), np.float32)
        assert s.get("kv", layers=[6, 7], out=part).data is part
        assert np.array_equal(part, kv[1:3])


def test_get_into_a_buffer_from_the_dram_tier(store_path):
    kv = _kv()
    with tierstore.open(store_path, dram_bytes="64MiB") as s:
        s.put("kv", KVCache(kv))
        s.get("kv")  # promoted
        out = np.empty_like(kv)
        s.get("kv", out=out)
        assert np.array_equal(out, kv) and s.stats()["tiers"]["dram"]["hits"] >= 1


def test_get_into_vectors_buffer(store_path):
    emb = np.random.default_rng(2).standard_normal((1000, 24)).astype(np.float16)
    with tierstore.open(store_path, vector_extent_bytes=4096) as s:
        s.put("v", Vectors(emb, ids=np.arange(1000) * 3))
        out = np.empty_like(emb)
        v = s.get("v", out=out)
        assert v.data is out and np.array_equal(out, emb) and np.array_equal(v.ids, np.arange(1000) * 3)
        rows = np.empty((3, 24), np.float16)
        assert np.array_equal(s.get("v", rows=[5, 900, 7], out=rows).data, emb[[5, 900, 7]])


@pytest.mark.parametrize("out, why", [
    (np.empty((3, 2, 2, 16, 8), np.float32), "shape"),
    (np.empty((4, 2, 2, 16, 8), np.float16), "dtype"),
    (np.empty((4, 2, 2, 16, 16), np.float32)[..., ::2], "C-contiguous"),
    (np.empty((4, 2, 2, 16, 8), np.float32), "writable"),
    (bytearray(4 * 2 * 2 * 16 * 8 * 4), "numpy array"),
])
def test_get_out_mismatch_is_refused_before_any_io(store_path, out, why):
    with tierstore.open(store_path) as s:
        s.put("kv", KVCache(_kv()))
        s.put("blob", Blob(b"x"))
        if why == "writable":
            out.flags.writeable = False
        before = s.stats()["counters"]
        with pytest.raises(InvalidObject, match=why):
            s.get("kv", out=out)
        after = s.stats()["counters"]
        assert after["gets"] == before["gets"] and after["bytes_read"] == before["bytes_read"]
        with pytest.raises(InvalidObject, match="KVCache or Vectors"):
            s.get("blob", out=np.empty(1, np.uint8))
        with pytest.raises(InvalidObject, match="out= already says"):
            s.get("kv", out=np.empty((4, 2, 2, 16, 8), np.float32), device="cpu")


@needs_torch
def test_a_torch_destination_that_is_not_dense_host_or_cuda_memory_is_refused(store_path):
    """A meta tensor has no memory: get(out=) returned it as filled, with nothing read (a cold
    user's try); a sparse one was refused as "not C-contiguous"."""
    import torch

    with tierstore.open(store_path) as s:
        s.put("kv", KVCache(_kv()))
        for out in (torch.empty((4, 2, 2, 16, 8), dtype=torch.float32, device="meta"),
                    torch.zeros((4, 2, 2, 16, 8), dtype=torch.float32).to_sparse()):
            with pytest.raises(InvalidObject, match="dense tensors in CPU, pinned or CUDA memory"):
                s.get("kv", out=out)
            with pytest.raises(InvalidObject, match="dense tensors"):
                s.get_many(["kv"], out=[out])
        out = torch.empty((4, 2, 2, 16, 8), dtype=torch.float32)  # the twin: a CPU tensor is filled
        assert s.get("kv", out=out).data is out and np.array_equal(out.numpy(), _kv())


@needs_torch
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_get_into_a_torch_tensor(store_path, dtype):
    import torch

    kv = torch.randn(3, 2, 2, 8, 4).to(getattr(torch, dtype))
    with tierstore.open(store_path) as s:
        s.put("kv", KVCache(kv))
        s.put("q", KVCache(kv.float()), codec="int8")
        out = torch.zeros_like(kv)
        assert s.get("kv", out=out).data is out and torch.equal(out, kv)
        q = torch.zeros(3, 2, 2, 8, 4)
        s.get("q", out=q)
        assert torch.equal(q, s.get("q").data)  # the decoded values, into the caller's tensor
        with pytest.raises(InvalidObject, match="writable"):
            s.get("kv", out=torch.zeros_like(kv).requires_grad_() if dtype == "float32" else
                  torch.zeros(3, 2, 2, 8, 4, dtype=kv.dtype, requires_grad=True))


# -- get(out=[per-layer pieces]): scattered gets ------------------------------------------------


@pytest.mark.parametrize("tiers", [{"dram_bytes": 0}, {"dram_bytes": "64MiB", "dram_admit": "first"},
                                   {}])  # no tier; the DRAM tier's extents; the default (probation)
@pytest.mark.parametrize("codec", [None, "zstd", "int8"])
def test_get_into_per_layer_views_of_bigger_tensors(store_path, tiers, codec):
    """Each layer's K and V land in strided views of the caller's own tensors (a model cache's
    token range), the rest of those tensors untouched; a second read (from memory) too."""
    kv = _kv((5, 2, 3, 16, 8), seed=4)
    with tierstore.open(store_path, **tiers) as s:
        s.put("kv", KVCache(kv, layer_start=2), codec=codec)
        want = s.get("kv").data  # the stored values (decoded: int8 is lossy)
        for _ in range(2):
            ks = [np.full((3, 40, 8), 7.0, np.float32) for _ in range(5)]
            vs = [np.full((3, 40, 8), 7.0, np.float32) for _ in range(5)]
            got = s.get("kv", out=[(k[:, 10:26], v[:, 10:26]) for k, v in zip(ks, vs)])
            assert isinstance(got, KVCache) and got.layer_start == 2 and got.pieces is not None
            for i in range(5):
                assert np.array_equal(ks[i][:, 10:26], want[i, 0]) and np.array_equal(vs[i][:, 10:26], want[i, 1])
                assert (ks[i][:, :10] == 7).all() and (vs[i][:, 26:] == 7).all()
            assert np.array_equal(got.data, want)
        part = [np.zeros((2, 3, 16, 8), np.float32) for _ in range(2)]  # layers= with [2, ...] pieces
        assert s.get("kv", layers=[4, 5], out=part).layer_start == 4
        assert np.array_equal(np.stack(part), want[2:4])


def test_get_into_per_layer_pieces_reads_large_chunks_in_groups(store_path, monkeypatch):
    """Without a DRAM tier the layers are read into a reused scratch buffer a few at a time."""
    import tierstore.format.block as block

    monkeypatch.setattr(block, "LAYER_SCRATCH_BYTES", 3 * 2 * 3 * 16 * 8 * 4)  # three layers at a time
    kv = _kv((7, 2, 3, 16, 8), seed=5)
    with tierstore.open(store_path, dram_bytes=0) as s:
        s.put("kv", KVCache(kv))
        out = [(np.empty((3, 16, 8), np.float32), np.empty((3, 16, 8), np.float32)) for _ in range(7)]
        s.get("kv", out=out)
        assert all(np.array_equal(k, kv[i, 0]) and np.array_equal(v, kv[i, 1]) for i, (k, v) in enumerate(out))


def _f32(*shape):
    return np.empty(shape, np.float32)


@pytest.mark.parametrize("out, why", [
    ([(_f32(2, 16, 8), _f32(2, 16, 8)) for _ in range(3)], "holds 3 layers; this read returns 4"),
    ([(np.empty((2, 16, 8), np.float16),) * 2] * 4, r"layer 0: K is float16 \[2, 16, 8\]; this read needs float32"),
    ([(_f32(2, 8, 8), _f32(2, 8, 8)) for _ in range(4)], r"layer 0: K is float32 \[2, 8, 8\]"),
    ([(_f32(2, 16, 8), _f32(2, 16, 4)) for _ in range(4)], r"layer 0: V is float32 \[2, 16, 4\]"),
    ([_f32(2, 2, 16, 8) for _ in range(3)] + [np.empty((2, 2, 16, 8), np.float64)], "layer 3: the array is float64"),
    ([(_f32(2, 16, 8), _f32(2, 16, 8)) for _ in range(3)] + [(_f32(2, 16, 8), "v")], "numpy arrays"),
    ([_f32(2, 16, 8) for _ in range(4)], r"layer 0: the array is float32 \[2, 16, 8\]; this read needs float32 \[2, 2"),
    ([], "empty list"),
])
def test_get_into_per_layer_pieces_refuses_mismatches_before_any_io(store_path, out, why):
    with tierstore.open(store_path) as s:
        s.put("kv", KVCache(_kv()))
        s.put("v", Vectors(np.zeros((4, 8), np.float32)))
        before = s.stats()["counters"]
        with pytest.raises(InvalidObject, match=why):
            s.get("kv", out=out)
        after = s.stats()["counters"]
        assert after["gets"] == before["gets"] and after["bytes_read"] == before["bytes_read"]
        with pytest.raises(InvalidObject, match="applies to a KVCache; this object is of kind 'vectors'"):
            s.get("v", out=[np.zeros((2, 2, 16, 8), np.float32)])
        with pytest.raises(InvalidObject, match=r"got generator \[key=.kv.\] \(hint: for a KVCache, also a list"):
            s.get("kv", out=(x for x in [_f32(2, 2, 16, 8)] * 4))
        ro = np.empty((2, 16, 8), np.float32)
        ro.flags.writeable = False
        with pytest.raises(InvalidObject, match="not writable"):
            s.get("kv", out=[(np.empty((2, 16, 8), np.float32), ro)] * 4)
        # the twin: the same store answers a well-formed request
        good = [(np.empty((2, 16, 8), np.float32), np.empty((2, 16, 8), np.float32)) for _ in range(4)]
        s.get("kv", out=good)
        assert np.array_equal(good[3][1], _kv()[3, 1])


def test_get_into_per_layer_pieces_of_a_damaged_chunk_raises(store_path):
    kv = _kv(seed=6)
    with tierstore.open(store_path, dram_bytes=0) as s:
        s.put("kv", KVCache(kv))
    path = segment_files(store_path)[0]
    with open(path, "r+b") as f:
        at = f.read().find(kv[2].tobytes()[:64])
        assert at > 0
        f.seek(at + 5)
        byte = f.read(1)[0]
        f.seek(at + 5)
        f.write(bytes([byte ^ 0x10]))
    with tierstore.open(store_path, dram_bytes=0) as s:
        out = [np.empty((2, 2, 16, 8), np.float32) for _ in range(4)]
        with pytest.raises(tierstore.CorruptionError):
            s.get("kv", out=out)
        assert np.array_equal(s.get("kv", layers=1).data[0], kv[1])  # the other layers still read


@pytest.mark.parametrize("tiers", [{"dram_bytes": 0}, {}])
def test_get_many_into_destinations(store_path, tiers):
    """get_many(out=): one destination per key (an array, per-layer pieces or None); the
    objects only the log holds are read side by side; a missing key's destination is untouched."""
    kvs = [_kv((3, 2, 2, 64, 8), seed=10 + i) for i in range(5)]
    with tierstore.open(store_path, **tiers) as s:
        for i, kv in enumerate(kvs):
            s.put(f"c{i}", KVCache(kv))
        s.put("v", Vectors(np.arange(24, dtype=np.float32).reshape(3, 8)))
        for _ in range(2):  # from the log (side by side), then (default open) from the DRAM tier
            flat = np.zeros_like(kvs[0])
            pairs = [(np.zeros((2, 64, 8), np.float32), np.zeros((2, 64, 8), np.float32)) for _ in range(3)]
            untouched = np.full_like(kvs[0], 5.0)
            vec = np.zeros((3, 8), np.float32)
            keys = ["c0", "c1", "gone", "c3", "c4", "v"]
            got = s.get_many(keys, out=[flat, pairs, untouched, None, None, vec])
            assert got[2] is None and (untouched == 5).all()
            assert got[0].data is flat and np.array_equal(flat, kvs[0])
            assert all(np.array_equal(k, kvs[1][i, 0]) and np.array_equal(v, kvs[1][i, 1])
                       for i, (k, v) in enumerate(pairs))
            assert np.array_equal(got[3].data, kvs[3]) and np.array_equal(got[4].data, kvs[4])
            assert got[5].data is vec and vec[2, 7] == 23
        assert s.stats()["counters"]["gets"] == 10


def test_get_many_out_mismatch_is_refused_before_any_io(store_path):
    with tierstore.open(store_path, dram_bytes=0) as s:
        s.put("a", KVCache(_kv()))
        s.put("b", KVCache(_kv(seed=1)))
        before = s.stats()["counters"]
        with pytest.raises(InvalidObject, match="one destination .* per key: 2 keys, got list of 1"):
            s.get_many(["a", "b"], out=[None])
        with pytest.raises(InvalidObject, match="dtype float16") as e:  # the second key's: nothing read for the first
            s.get_many(["a", "b"], out=[np.empty((4, 2, 2, 16, 8), np.float32), np.empty((4, 2, 2, 16, 8), np.float16)])
        assert e.value.key == "b"  # named: a caller keeps the keys before it
        with pytest.raises(InvalidObject, match="out= already says"):
            s.get_many(["a"], out=[None], device="cpu")
        with pytest.raises(InvalidObject, match="dtype float16") as e:  # get names the key too
            s.get("b", out=np.empty((4, 2, 2, 16, 8), np.float16))
        assert e.value.key == "b"
        after = s.stats()["counters"]
        assert after["gets"] == before["gets"] and after["bytes_read"] == before["bytes_read"]
        assert np.array_equal(s.get_many(["a", "b"], out=[None, None])[1].data, _kv(seed=1))  # the twin


@pytest.mark.parametrize("dram_bytes", [0, "64MiB"])
def test_get_many_refuses_destinations_shared_between_keys(store_path, dram_bytes):
    """Two keys' destinations in the same memory (one array twice, overlapping slices, the same
    per-layer pieces): refused before any read, naming both (found by a new user: the shared
    array got whichever key was written last, or a read raised a false CorruptionError).  The
    twins, disjoint or interleaved views of one array, read."""
    kvs = [_kv(seed=40 + i) for i in range(3)]  # [4, 2, 2, 16, 8]
    with tierstore.open(store_path, dram_bytes=dram_bytes) as s:
        for i, kv in enumerate(kvs):
            s.put(f"c{i}", KVCache(kv))
        base = np.zeros((12, 2, 2, 16, 8), np.float32)
        pieces = [(np.zeros((2, 16, 8), np.float32), np.zeros((2, 16, 8), np.float32)) for _ in range(4)]
        for out in ([None, base[:4], base[:4]], [base[0:4], None, base[3:7]], [pieces, None, pieces]):
            before = s.stats()["counters"]["bytes_read"]
            with pytest.raises(InvalidObject, match=r"out\[0\] and out\[2\] \(keys 'c0' and 'c2'\) share memory|"
                                                    r"out\[1\] and out\[2\] \(keys 'c1' and 'c2'\) share memory") as e:
                s.get_many(["c0", "c1", "c2"], out=out)
            assert e.value.key == "c2"
            assert s.stats()["counters"]["bytes_read"] == before
            assert not base.any() and not any(p.any() for layer in pieces for p in layer)
        got = s.get_many(["c0", "c1", "c2"], out=[base[0:4], base[4:8], None])
        assert np.array_equal(base[0:4], kvs[0]) and np.array_equal(base[4:8], kvs[1])
        assert np.array_equal(got[2].data, kvs[2])
        inter = np.zeros((4, 2, 16, 2, 8), np.float32)  # two keys' K interleaved on one axis
        s.get_many(["c0", "c1"], out=[[(inter[i, :, :, 0], np.zeros((2, 16, 8), np.float32)) for i in range(4)],
                                      [(inter[i, :, :, 1], np.zeros((2, 16, 8), np.float32)) for i in range(4)]])
        assert np.array_equal(inter[..., 0, :], kvs[0][:, 0]) and np.array_equal(inter[..., 1, :], kvs[1][:, 0])


def test_get_many_writes_no_destination_after_it_raised(store_path, monkeypatch):
    """Any error (not only the store's) ends the call only once every read on the reader threads
    has ended: no destination is written after get_many raised."""
    import time

    kvs = [_kv((3, 2, 2, 64, 8), seed=30 + i) for i in range(4)]
    with tierstore.open(store_path, dram_bytes=0) as s:
        for i, kv in enumerate(kvs):
            s.put(f"c{i}", KVCache(kv))
        read = tierstore.Store._read

        def slow(self, key, *a, **kw):  # type: ignore[no-untyped-def]
            if key == "c0":
                raise RuntimeError("injected")
            time.sleep(0.3)
            return read(self, key, *a, **kw)

        monkeypatch.setattr(tierstore.Store, "_read", slow)
        outs = [np.zeros_like(kv) for kv in kvs]
        with pytest.raises(RuntimeError, match="injected"):
            s.get_many(["c0", "c1", "c2", "c3"], out=outs)
        assert all(np.array_equal(outs[i], kvs[i]) for i in (1, 2, 3))  # ended before the call raised


def test_get_many_raises_the_first_damaged_key_after_every_read_ended(store_path):
    kvs = [_kv((3, 2, 2, 64, 8), seed=20 + i) for i in range(4)]
    with tierstore.open(store_path, dram_bytes=0) as s:
        for i, kv in enumerate(kvs):
            s.put(f"c{i}", KVCache(kv))
    path = segment_files(store_path)[0]
    with open(path, "r+b") as f:
        data = f.read()
        for i in (1, 3):  # two damaged chunks: the error names the first in the order of the keys
            at = data.find(kvs[i][2].tobytes()[:64])
            assert at > 0
            f.seek(at + 9)
            f.write(bytes([data[at + 9] ^ 0x04]))
    with tierstore.open(store_path, dram_bytes=0) as s:
        outs = [np.zeros_like(kv) for kv in kvs]
        for order in (["c0", "c1", "c2", "c3"], ["c3", "c2", "c1", "c0"]):
            with pytest.raises(CorruptionError) as e:
                s.get_many(order, out=[outs[int(k[1])] for k in order])
            assert e.value.key == order[0 if order[0] == "c3" else 1]
        assert np.array_equal(outs[0], kvs[0]) and np.array_equal(outs[2], kvs[2])  # read whole meanwhile
        assert np.array_equal(s.get_many(["c0", "c2"])[1].data, kvs[2])


def test_get_many_of_small_blobs_names_the_first_damaged_key_in_key_order(store_path):
    with tierstore.open(store_path, segment_bytes=16384) as s:  # blobs over several segments
        for i in range(20):
            s.put(f"k{i}", Blob(bytes([65 + i]) * (100 * i + 1)))
    with tierstore.open(store_path) as s:
        locs = {k: s._engine.lookup(b"default", k.encode()) for k in ("k2", "k15")}
        paths = {k: s._engine.segment_path(loc.segment) for k, loc in locs.items()}
    assert locs["k2"].segment != locs["k15"].segment
    for k, loc in locs.items():
        with open(paths[k], "r+b") as f:
            f.seek(loc.offset + loc.header.offsets[0])
            f.write(b"\x00")
    with tierstore.open(store_path) as s:
        assert [b.data[:1] for b in s.get_many(["k16", "k1"])] == [b"Q", b"B"]  # the twin: undamaged ones read
        for order in (["k16", "k2", "k15"], ["k15", "k2"], ["k1", "k15", "k2"]):
            with pytest.raises(CorruptionError) as e:
                s.get_many(order)
            first = next(k for k in order if k in locs)
            assert e.value.key == first and e.value.path == paths[first]
            assert (e.value.segment, e.value.offset) == (locs[first].segment, locs[first].offset)
        for k, loc in locs.items():  # a single get (its short path) names the same
            with pytest.raises(CorruptionError) as e:
                s.get(k, namespace="default")
            assert (e.value.key, e.value.namespace, e.value.path) == (k, "default", paths[k])
            assert (e.value.segment, e.value.offset) == (loc.segment, loc.offset)
        assert s.get("k16").data[:1] == b"Q"


def test_get_many_names_a_damaged_blob_before_a_damaged_chunk_in_key_order(store_path):
    kv = _kv((3, 2, 2, 64, 8), seed=5)
    with tierstore.open(store_path, dram_bytes=0) as s:
        s.put("blob", Blob(b"B" * 3000))
        s.put("chunk", KVCache(kv))
    path = segment_files(store_path)[0]
    with open(path, "r+b") as f:
        data = f.read()
        for at in (data.index(b"B" * 3000) + 100, data.find(kv[2].tobytes()[:64]) + 9):
            f.seek(at)
            f.write(bytes([data[at] ^ 0x04]))
    with tierstore.open(store_path, dram_bytes=0) as s:
        for order in (["blob", "chunk"], ["chunk", "blob"]):
            with pytest.raises(CorruptionError) as e:
                s.get_many(order)
            assert e.value.key == order[0]


@pytest.mark.parametrize("meanwhile", ["deleted", "replaced"])
def test_get_many_follows_small_blobs_that_compaction_moved_meanwhile(store_path, meanwhile):
    # between the index snapshot and the reads, another thread deletes or replaces a key and
    # compaction retires its segment: a deleted key is a miss (None), a replaced one is read
    # with the metadata of what was read, never the old record's
    with tierstore.open(store_path, segment_bytes=16384) as s:
        s.put("a", Blob(b"1"))
        s.put("b", Blob(b"old"), meta={"v": 1})
        for i in range(40):
            s.put(f"f{i}", Blob(b"x" * 500))
        engine = s._engine
        lookup_many = engine.lookup_many

        def racing(ns, ks):
            found = lookup_many(ns, ks)
            engine.lookup_many = lookup_many
            if meanwhile == "deleted":
                s.delete("b")
            else:
                s.put("b", Blob(b"new", media_type="text/plain"), meta={"v": 2})
            s.compact(min_dead_ratio=0.0)
            return found

        engine.lookup_many = racing
        a, b = s.get_many(["a", "b"])
        assert a.data == b"1"
        if meanwhile == "deleted":
            assert b is None
        else:
            assert (b.data, b.meta, b.media_type) == (b"new", {"v": 2}, "text/plain")


def _shared_pieces():
    """Destinations that would each get two values: refused.  Their twin below: pieces whose
    byte ranges overlap without sharing memory (K and V interleaved in one array) are fine."""
    base = np.zeros((2, 16, 8), np.float32)
    one = [(np.zeros((2, 16, 8), np.float32), np.zeros((2, 16, 8), np.float32)) for _ in range(3)]
    return {
        "the same pair twice": one + [one[0]],
        "k is v": one + [(base, base)],
        "a stride of 0": one + [(np.lib.stride_tricks.as_strided(np.zeros((16, 8), np.float32), (2, 16, 8),
                                                                    (0, 32, 4), writeable=True), base)],
        "overlapping slices": one + [(np.zeros((3, 16, 8), np.float32)[:2], base)],
    }


@pytest.mark.parametrize("case", sorted(_shared_pieces()))
def test_get_into_per_layer_pieces_that_share_memory_is_refused(store_path, case):
    out = _shared_pieces()[case]
    if case == "overlapping slices":  # layer 3's k overlaps layer 0's v
        big = np.zeros((3, 16, 8), np.float32)
        out = [(np.zeros((2, 16, 8), np.float32), big[:2])] + out[1:3] + [(big[1:], np.zeros((2, 16, 8), np.float32))]
    with tierstore.open(store_path) as s:
        s.put("kv", KVCache(_kv()))
        with pytest.raises(InvalidObject, match="K and V of layer 3 share memory" if case == "k is v" else
                           "share memory|repeats memory"):
            s.get("kv", out=out)
        # the twin: K and V of each layer interleaved in one array ([heads, tokens, 2, dim])
        inter = [np.zeros((2, 16, 2, 8), np.float32) for _ in range(4)]
        s.get("kv", out=[(x[:, :, 0], x[:, :, 1]) for x in inter])
        kv = _kv()
        assert all(np.array_equal(x[:, :, 0], kv[i, 0]) and np.array_equal(x[:, :, 1], kv[i, 1])
                   for i, x in enumerate(inter))


@needs_torch
def test_get_into_per_layer_pieces_refuses_tensors_it_cannot_fill(store_path):
    import torch

    with tierstore.open(store_path) as s:
        s.put("kv", KVCache(torch.randn(2, 2, 2, 4, 3)))
        dense = [(torch.zeros(2, 4, 3), torch.zeros(2, 4, 3)) for _ in range(2)]
        for bad, why in (((torch.zeros(2, 4, 3).to_sparse(), torch.zeros(2, 4, 3)), "sparse"),
                         ((torch.zeros(2, 4, 3, device="meta"), torch.zeros(2, 4, 3, device="meta")), "meta"),
                         ((torch.zeros(4, 3).expand(2, 4, 3), torch.zeros(2, 4, 3)), "repeats memory")):
            before = s.stats()["counters"]["bytes_read"]
            with pytest.raises(InvalidObject, match=why):
                s.get("kv", out=[dense[0], bad])
            assert s.stats()["counters"]["bytes_read"] == before
        s.get("kv", out=dense)


@needs_torch
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_get_into_per_layer_torch_views(store_path, dtype):
    """LMCache's layout: one [2, layers, tokens, hidden] tensor; each stored layer's K and V are
    two slabs of it."""
    import torch

    kv = torch.randn(4, 2, 1, 8, 12).to(getattr(torch, dtype))
    with tierstore.open(store_path) as s:
        s.put("kv", KVCache(kv))
        for _ in range(3):  # cold (probation), then from the DRAM tier
            t = torch.zeros(2, 4, 1, 8, 12, dtype=kv.dtype)
            s.get("kv", out=[(t[0, i], t[1, i]) for i in range(4)])
            assert torch.equal(t.transpose(0, 1), kv)
        with pytest.raises(InvalidObject, match="not writable"):
            s.get("kv", out=[(torch.zeros(1, 8, 12, dtype=kv.dtype, requires_grad=True),
                              torch.zeros(1, 8, 12, dtype=kv.dtype))] * 4)


@needs_torch
def test_get_into_per_layer_torch_pieces_that_share_memory_is_refused(store_path):
    """The host fast path (CPU tensors, checked by address) refuses what the general checks
    refuse; its twins (K and V interleaved in one tensor, one [2, ...] tensor per layer) read."""
    import torch

    kv = torch.randn(3, 2, 2, 16, 8)
    with tierstore.open(store_path) as s:
        s.put("kv", KVCache(kv))
        pairs = [(torch.zeros(2, 16, 8), torch.zeros(2, 16, 8)) for _ in range(3)]
        big = torch.zeros(3, 16, 8)
        for bad, why in ((pairs[:2] + [pairs[0]], "pieces of layers 0 and 2 share memory"),
                         (pairs[:2] + [(big[:2], big[:2])], "K and V of layer 2 share memory"),
                         ([(big[:2], pairs[0][1])] + pairs[1:2] + [(big[1:], pairs[2][1])],
                          "pieces of layers 0 and 2 share memory")):
            before = s.stats()["counters"]["bytes_read"]
            with pytest.raises(InvalidObject, match=why):
                s.get("kv", out=bad)
            assert s.stats()["counters"]["bytes_read"] == before
            assert all((p == 0).all() for layer in pairs for p in layer)
        inter = [torch.zeros(2, 16, 2, 8) for _ in range(3)]
        s.get("kv", out=[(x[:, :, 0], x[:, :, 1]) for x in inter])
        assert all(torch.equal(x[:, :, 0], kv[i, 0]) and torch.equal(x[:, :, 1], kv[i, 1]) for i, x in enumerate(inter))
        whole = [torch.zeros(2, 2, 16, 8) for _ in range(3)]
        got = s.get("kv", out=whole)
        assert torch.equal(torch.stack(whole), kv) and torch.equal(got.data, kv)


def test_get_into_numpy_pieces_never_imports_torch(store_path):
    """numpy callers of get(out=[pieces]) do not pay torch's import; an empty layer is named."""
    import subprocess
    import sys

    script = f"""
import sys, numpy as np, tierstore
from tierstore.errors import InvalidObject
with tierstore.open({str(store_path)!r}) as s:
    s.put("kv", tierstore.KVCache(np.ones((2, 2, 2, 4, 3), np.float32)))
    pieces = [(np.zeros((2, 4, 3), np.float32), np.zeros((2, 4, 3), np.float32)) for _ in range(2)]
    s.get("kv", out=pieces)
    assert all((k == 1).all() and (v == 1).all() for k, v in pieces)
    try:
        s.get("kv", out=[(), ()])
    except InvalidObject as e:
        assert "layer 0" in str(e), e
    else:
        raise AssertionError("an empty layer was accepted")
print("torch" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# -- scattered puts: KVCache.from_layers --------------------------------------------------------


def test_from_layers_stores_what_a_stacked_put_stores(store_path):
    rng = np.random.default_rng(3)
    ks = [rng.standard_normal((2, 16, 8)).astype(np.float16) for _ in range(3)]
    vs = [rng.standard_normal((2, 16, 8)).astype(np.float16) for _ in range(3)]
    stacked = np.stack([np.stack([k, v]) for k, v in zip(ks, vs)])
    with tierstore.open(store_path) as s:
        s.put("pairs", KVCache.from_layers(list(zip(ks, vs)), layer_start=1))
        s.put("layers", KVCache.from_layers([np.stack([k, v]) for k, v in zip(ks, vs)], layer_start=1))
        s.put("stacked", KVCache(stacked, layer_start=1))
        ref = s.info("stacked")
        for key in ("pairs", "layers"):
            info = s.info(key)
            assert info.extent_checksums == ref.extent_checksums and info.shape == ref.shape
            assert info.stored_bytes == ref.stored_bytes
            assert np.array_equal(s.get(key).data, stacked)
        s.put("z", KVCache.from_layers(list(zip(ks, vs))), codec="shuffle+zstd")
        assert np.array_equal(s.get("z").data, stacked)
        k_strided = np.stack(ks, axis=1)[:, 0]  # a non-contiguous view of ks[0]
        assert not k_strided.flags.c_contiguous
        s.put("views", KVCache.from_layers([(k_strided, vs[0])]))
        assert np.array_equal(s.get("views").data, np.stack([ks[0], vs[0]])[None])
    cache = KVCache.from_layers(list(zip(ks, vs)))
    assert cache.num_layers == 3 and np.array_equal(cache.data, stacked)  # .data stacks on demand


def test_from_layers_with_non_contiguous_pieces(store_path):
    rng = np.random.default_rng(4)
    paged = rng.standard_normal((2, 8, 2, 16, 4)).astype(np.float32)  # [K/V, blocks, heads, block, dim]
    k, v = paged[0][[1, 5]].transpose(1, 0, 2, 3), paged[1][[1, 5]].transpose(1, 0, 2, 3)  # [heads, 2, 16, 4]
    k, v = k.reshape(2, 32, 4), v.reshape(2, 32, 4)
    with tierstore.open(store_path) as s:
        s.put("c", KVCache.from_layers([(k[:, ::2], v[:, ::2])]))
        assert np.array_equal(s.get("c").data[0], np.stack([k[:, ::2], v[:, ::2]]))


@pytest.mark.parametrize("layers, match", [
    ([], "non-empty"),
    ("kv", "non-empty"),
    ([(np.ones((2, 3, 4), np.float32), np.ones((2, 3, 5), np.float32))], "different shapes"),
    ([(np.ones((2, 3, 4), np.float32), np.ones((2, 3, 4), np.float16))], "differ in dtype"),
    ([(np.ones((2, 3, 4), np.float32),) * 3], "got 3 items"),
    ([np.ones((3, 2, 3, 4), np.float32)], r"\[2, kv_heads"),
    ([(np.ones((2, 3, 4), np.int32),) * 2], "floating"),
    ([(np.ones((2, 3, 4), np.float32),) * 2, (np.ones((2, 4, 4), np.float32),) * 2], "every layer must match"),
    ([(np.ones((2, 0, 4), np.float32),) * 2], "empty"),
    ([(b"ab", b"cd")], "numpy arrays or torch"),
])
def test_from_layers_refuses_bad_layers(layers, match):
    with pytest.raises(InvalidObject, match=match):
        KVCache.from_layers(layers)


@needs_torch
def test_from_layers_torch_bf16(store_path):
    import torch

    ks = [torch.randn(4, 8, 16).bfloat16() for _ in range(2)]
    vs = [torch.randn(4, 8, 16).bfloat16() for _ in range(2)]
    with tierstore.open(store_path) as s:
        s.put("c", KVCache.from_layers(list(zip(ks, vs))))
        got = s.get("c").data
        assert got.dtype == torch.bfloat16 and torch.equal(got, torch.stack([torch.stack(p) for p in zip(ks, vs)]))


def test_large_scattered_put_is_one_gathered_write(store_path):
    """A chunk larger than the O_DIRECT threshold from per-layer pieces, read back exactly."""
    rng = np.random.default_rng(5)
    layers = [(rng.standard_normal((4, 256, 64)).astype(np.float16),
               rng.standard_normal((4, 256, 64)).astype(np.float16)) for _ in range(20)]
    with tierstore.open(store_path) as s:
        s.put("c", KVCache.from_layers(layers))
        assert s.info("c").logical_bytes > 4 << 20
    with tierstore.open(store_path) as s:
        assert np.array_equal(s.get("c").data, np.stack([np.stack(p) for p in layers]))


def test_repr_of_a_scattered_chunk():
    c = KVCache.from_layers([(np.ones((1, 2, 3), np.float32), np.zeros((1, 2, 3), np.float32))], layer_start=4)
    assert repr(c) == "KVCache(shape=[1, 2, 1, 2, 3], dtype=float32, layer_start=4)"


def test_get_many_reads_a_group_in_one_version_while_compaction_moves_it(store_path, monkeypatch):
    """The keys are looked up in one snapshot and their segments held while the batch reads:
    a put_many group replaced and its old segment compacted away between two keys' reads is
    still read whole in the snapshot's version (it was read half old, half new)."""
    from tierstore.store import Store

    size = 200_000  # not a small blob: each is read on its own
    s = tierstore.open(store_path)
    s.put_many([(f"grp-{j}", Blob(b"v1" * (size // 2))) for j in range(4)])
    orig, calls, lock, replaced = Store._read, [], threading.Lock(), threading.Event()

    def read_then_replace(self, *a, **k):  # type: ignore[no-untyped-def]
        with lock:  # (the reads run on several threads)
            first = not calls
            calls.append(1)
        if not first:  # the other keys are read once the group was replaced and compacted
            assert replaced.wait(10)
            return orig(self, *a, **k)
        try:
            return orig(self, *a, **k)
        finally:  # after the first key's read: a new group, and compaction retires the old segment
            self.put_many([(f"grp-{j}", Blob(b"v2" * (size // 2))) for j in range(4)])
            assert self.compact()["victims"]
            replaced.set()

    monkeypatch.setattr(Store, "_read", read_then_replace)
    got = s.get_many([f"grp-{j}" for j in range(4)])
    monkeypatch.setattr(Store, "_read", orig)
    assert [bytes(g.data[:2]) for g in got] == [b"v1"] * 4
    assert [bytes(g.data[:2]) for g in s.get_many([f"grp-{j}" for j in range(4)])] == [b"v2"] * 4
    s.close()


def test_batch_refusals_name_the_key_and_give_a_true_limit(store_path):
    with tierstore.open(store_path) as s:
        s.put_many([("a", Blob(b"1")), ("b", Blob(b"2"))])
        with pytest.raises(InvalidObject, match="key 'a' appears twice") as e:
            s.delete_many(k for k in ["a", "zz", "a"])  # (a generator: read once)
        assert e.value.key == "a" and e.value.hint
        assert s.keys() == ["a", "b"]  # nothing deleted
        with pytest.raises(InvalidObject) as e:  # no session: one record per put, so 4096 fit
            s.put_many([(f"k{i}", Blob(b"x")) for i in range(5000)])
        assert f"batches of {fmt.GROUP_MAX} puts or fewer" in e.value.hint
        s.put_many([(f"k{i}", Blob(b"x")) for i in range(fmt.GROUP_MAX)])  # the hint is true
        s.put("kv", KVCache(np.ones((2, 2, 1, 4, 4), np.float16)))
        with pytest.raises(InvalidObject, match="do not apply to a Blob") as e:
            s.get_many(["kv", "a"], layers=range(1, 2))
        assert e.value.key == "a"


def test_a_refused_put_many_item_is_named_by_its_index_and_key(tmp_path):
    """A batch of 1,000 items with one the codec refuses: nothing is written, and the error says
    which item (before, it named neither the key nor the position)."""
    with tierstore.open(str(tmp_path / "s")) as s:
        ok = np.random.default_rng(0).standard_normal((1, 2, 1, 4, 8)).astype(np.float16)
        items = [(f"k{i}", tierstore.KVCache(ok)) for i in range(1000)]
        items[537] = ("k537", tierstore.KVCache(np.full((1, 2, 1, 4, 8), np.inf, np.float16)))
        with pytest.raises(tierstore.InvalidObject) as err:
            s.put_many(items, codec="int8")
        assert err.value.key == "k537" and err.value.message.startswith("put_many item 537: ")
        assert s.keys() == []


@pytest.mark.parametrize("bad", [None, 5])
def test_batch_calls_refuse_what_is_not_a_sequence_as_invalid_object(store_path, bad):
    """put_many(None), get_many(None), contains_many(None), delete_many(None) raised a bare
    TypeError (a cold review, 2026-12-03); bad arguments are InvalidObject, naming the type."""
    with tierstore.open(store_path) as s:
        for call in (s.put_many, s.get_many, s.contains_many, s.delete_many):
            with pytest.raises(InvalidObject, match=type(bad).__name__):
                call(bad)
        s.put_many(iter([("a", Blob(b"x"))]))  # any iterable is a sequence here
        assert s.contains_many(iter(["a", "b"])) == [True, False]


def test_a_get_many_the_store_closes_under_ends_with_store_closed_never_hangs(tmp_path):
    """close() cancels the reads get_many queued on its reader threads; concurrent.futures'
    wait() never wakes for a future cancelled that way, so the call hung for good (4 to 21 of
    40 tries, a review 2026-12-03), or a read still in flight let go of a segment close() had
    already forgotten (KeyError).  It ends with StoreClosed (or its objects) now."""
    import random
    import time

    kv = np.random.default_rng(0).standard_normal((8, 2, 4, 256, 64)).astype(np.float32)  # 4 MiB each
    path = str(tmp_path / "s")
    with tierstore.open(path) as s:
        s.put_many([(f"c{i}", KVCache(kv)) for i in range(12)])
    rng = random.Random(0)
    outcomes: dict[str, int] = {}
    for _ in range(25):
        s = tierstore.open(path, dram_bytes=0)
        box: list[str] = []
        t = threading.Thread(target=_read_all, args=(s, box), daemon=True)
        t.start()
        time.sleep(rng.random() * 0.004)
        s.close()
        t.join(20)
        assert box, "get_many hung after close()"
        outcomes[box[0]] = outcomes.get(box[0], 0) + 1
    assert set(outcomes) <= {"objects", "StoreClosed"}, outcomes


def _read_all(s, box: list[str]) -> None:
    try:
        s.get_many([f"c{i}" for i in range(12)])
        box.append("objects")
    except tierstore.StoreClosed:
        box.append("StoreClosed")
    except Exception as e:  # noqa: BLE001 (the test reports what else came out)
        box.append(f"{type(e).__name__}: {e}")


@needs_torch
def test_gpu_destinations_that_are_chunk_views_of_one_cache_are_not_taken_for_shared(store_path, monkeypatch):
    """Pieces in GPU memory have no numpy view, and were compared by their byte ranges only: the
    per-chunk views of a model's cache tensors ([1, kv_heads, tokens, head_dim] split by tokens)
    overlap in range whenever kv_heads > 1, so a load of several chunks into a CUDA cache was
    refused as "sharing memory" (a review, 2026-12-03; no GPU here: GPU pieces are emulated by
    hiding the host views of CPU tensors, as tierstore sees a CUDA tensor).  Their layouts are
    compared now; views that do overlap are still refused."""
    import torch

    from tierstore import arrays
    from tierstore.format import block

    monkeypatch.setattr(arrays, "host_view", lambda t: None if arrays.is_torch_tensor(t) else t)
    monkeypatch.setattr(block, "_host_destination", lambda *a, **k: None)
    kv = np.random.default_rng(0).standard_normal((3, 2, 4, 16, 8)).astype(np.float32)
    with tierstore.open(store_path) as s:
        s.put_many([(f"c{i}", KVCache(kv * (i + 1))) for i in range(4)])
        dest = [(torch.empty(1, 4, 64, 8), torch.empty(1, 4, 64, 8)) for _ in range(3)]
        views = [(k[0].split(16, dim=1), v[0].split(16, dim=1)) for k, v in dest]
        out = [[(ks[i], vs[i]) for ks, vs in views] for i in range(4)]
        s.get_many([f"c{i}" for i in range(4)], out=out)
        for i in range(4):
            for layer, (k, v) in enumerate(dest):
                assert np.array_equal(k[0, :, 16 * i:16 * (i + 1)].numpy(), kv[layer, 0] * (i + 1))
                assert np.array_equal(v[0, :, 16 * i:16 * (i + 1)].numpy(), kv[layer, 1] * (i + 1))
        out[3] = out[1]  # two keys into the same views
        with pytest.raises(InvalidObject, match="share memory"):
            s.get_many([f"c{i}" for i in range(4)], out=out)


def test_a_memmap_destination_whose_k_and_v_interleave_is_not_taken_for_shared(tmp_path):
    """np.memmap pieces (an ndarray subclass) were compared by byte range alone once GPU pieces
    got layouts of their own: K and V interleaved in one mapped buffer were refused as sharing
    memory (a review, 2026-12-03).  Only GPU pieces go by range; host ones are compared exactly."""
    kv = np.random.default_rng(0).standard_normal((1, 2, 2, 4, 8)).astype(np.float32)
    with tierstore.open(str(tmp_path / "s")) as s:
        s.put("a", KVCache(kv))
        buf = np.memmap(str(tmp_path / "mm"), dtype=np.float32, mode="w+", shape=(1, 2, 4, 2, 8))
        s.get("a", out=[(buf[0, :, :, 0, :], buf[0, :, :, 1, :])])
        assert np.array_equal(buf[0, :, :, 0, :], kv[0, 0]) and np.array_equal(buf[0, :, :, 1, :], kv[0, 1])
        with pytest.raises(InvalidObject, match="share memory"):  # (the same piece twice still is)
            s.get("a", out=[(buf[0, :, :, 0, :], buf[0, :, :, 0, :])])
