"""What a new user hits first (issue 15): reopening in the same process, handles dropped without
close(), careless arguments, counters, bounds, option typos, keys, compact on a small store,
quarantine, and directories that are not stores.  Each bug of the issue has a test here."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import tierstore
from tierstore import Blob, InvalidObject, KVCache, Vectors
from tierstore.engine import repair
from tierstore.format import record as rec

from .conftest import HAS_TORCH, needs_torch, segment_files

# -- 1. same-process reopen and garbage-collected handles -----------------------------------------

def test_second_open_in_the_same_process_shares_the_writer_at_once(store_path):
    a = tierstore.open(store_path, lock_timeout=30)
    a.put("x", Blob(b"1"))
    t0 = time.monotonic()
    b = tierstore.open(store_path, lock_timeout=30)  # a notebook re-running its cell
    assert time.monotonic() - t0 < 5  # no wait for itself
    assert b.get("x").data == b"1"
    b.put("y", Blob(b"2"))
    assert a.get("y").data == b"2"  # one engine: each handle sees the other's writes at once
    a.close()
    b.put("z", Blob(b"3"))  # the other handle keeps working
    b.close()
    with tierstore.open(store_path) as s:
        assert s.keys() == ["x", "y", "z"]


def test_shared_handles_keep_their_own_tiers_coherent(store_path):
    a = tierstore.open(store_path, dram_bytes="8MiB")
    b = tierstore.open(store_path, dram_bytes="8MiB")
    kv = np.ones((2, 2, 2, 64, 64), np.float16)
    a.put("k", KVCache(kv))
    b.get("k")  # cached in b's DRAM tier
    a.put("k", KVCache(kv * 2))  # b's copy must go
    assert np.array_equal(b.get("k").data, kv * 2)
    a.close()
    b.close()


def test_closed_and_dropped_shared_handles_leave_no_listeners(store_path):
    a = tierstore.open(store_path, dram_bytes="1MiB")
    b = tierstore.open(store_path, dram_bytes="1MiB")
    engine = a._engine
    assert len(engine._listeners) == 2 and engine.users == 2
    b.close()
    b.close()  # idempotent: the other handle's share is untouched
    assert len(engine._listeners) == 1 and engine.users == 1
    c = tierstore.open(store_path)
    del c
    gc.collect()
    deadline = time.monotonic() + 10
    # released on a thread of its own: the listener first, then the engine's share
    while (len(engine._listeners) > 1 or engine.users > 1) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(engine._listeners) == 1 and engine.users == 1
    a.put("k", Blob(b"v"))
    a.close()
    assert engine.closed


def test_sharing_needs_the_same_io_layer(store_path):
    from tierstore.engine.fileio import PosixIO

    with tierstore.open(store_path), pytest.raises(InvalidObject, match="io="):
        tierstore.Store(store_path, _io=PosixIO())


def test_second_open_with_other_settings_says_why(store_path):
    with tierstore.open(store_path) as a:
        with pytest.raises(InvalidObject, match="durability='sync'"):
            tierstore.open(store_path, durability="none")
        a.put("x", Blob(b"1"))  # the first handle is untouched


def test_a_dropped_handle_releases_the_lock_and_keeps_its_writes(store_path):
    s = tierstore.open(store_path, durability="group", group_commit_ms=1e6)
    s.put("x", Blob(b"kept"))
    del s
    gc.collect()
    code = (f"import tierstore; s = tierstore.open({store_path!r}, lock_timeout=2); "
            "print(s.get('x').data.decode()); s.close()")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr  # another process could take the writer lock
    assert proc.stdout.strip() == "kept"  # and the group-committed put was made durable


def test_recover_refuses_at_once_while_this_process_writes(store_path):
    with tierstore.open(store_path) as s:
        s.put("x", Blob(b"1"))
        t0 = time.monotonic()
        with pytest.raises(tierstore.StoreLocked, match="this process"):
            repair.recover(store_path, lock_timeout=30)
        assert time.monotonic() - t0 < 5


# -- 3. careless arguments raise InvalidObject, short and to the point ----------------------------

@pytest.fixture
def objects(store_path):
    s = tierstore.open(store_path)
    s.put("v", Vectors(np.arange(800, dtype=np.float32).reshape(100, 8), ids=np.arange(100)))
    s.put("k", KVCache(np.ones((4, 2, 2, 8, 4), np.float16), layer_start=10))
    yield s
    s.close()


@pytest.mark.parametrize("rows", [[], slice(50, 50), slice(90, 10), np.array([], np.int64)])
def test_empty_row_selections_return_zero_rows(objects, rows):
    v = objects.get("v", rows=rows)
    assert v.data.shape == (0, 8) and v.ids.shape == (0,)


def test_empty_row_selection_through_a_dram_tier(store_path):
    with tierstore.open(store_path, dram_bytes="4MiB") as s:
        s.put("v", Vectors(np.ones((100, 8), np.float32)))
        s.get("v")  # cached
        assert s.get("v", rows=[]).data.shape == (0, 8)


@pytest.mark.parametrize("kw, message", [
    (dict(rows=slice(0, 10, 0)), "step cannot be zero"),
    (dict(rows="abc"), "rows must be"),
    (dict(rows=[1, 500]), r"rows \[500\] out of range"),
])
def test_bad_rows(objects, kw, message):
    with pytest.raises(InvalidObject, match=message):
        objects.get("v", **kw)


def test_bad_layers_messages_stay_short(objects):
    with pytest.raises(InvalidObject, match="selects 10000000 layers; the object holds 4") as e:
        objects.get("k", layers=range(0, 10**7))
    assert len(str(e.value)) < 300
    with pytest.raises(InvalidObject, match=r"\[0, 1, 2, 3, 4, 5, 6, 7, \.\.\. \(2 more\)\]"):
        objects.get("k", layers=slice(0, 100))  # ten bad ids, listed briefly
    with pytest.raises(InvalidObject, match="step cannot be zero"):
        objects.get("k", layers=slice(10, 14, 0))
    assert objects.get("k", layers=range(11, 13)).layer_start == 11  # the valid twin


def test_unencodable_text_is_invalid_object(objects):
    for call in (lambda: objects.put("\ud800", Blob(b"x")), lambda: objects.put("k2", Blob(b"x"), namespace="\udfff"),
                 lambda: objects.put("k3", Blob(b"x"), session="a\ud800")):
        with pytest.raises(InvalidObject, match="not valid text"):
            call()
    assert objects.keys() == ["k", "v"]  # nothing written


def test_option_type_errors_are_invalid_object(store_path):
    with pytest.raises(InvalidObject, match="direct_reads"):
        tierstore.open(store_path, direct_reads={})


@needs_torch
@pytest.mark.parametrize("device", ["mps", "xla:0", "meta"])
def test_unsupported_device_types(objects, device):
    with pytest.raises(InvalidObject, match="cpu.*cuda"):
        objects.get("k", device=device)


def test_match_prefix_of_one_hash_says_so(objects):
    h = tierstore.chunk_hashes(np.arange(512))
    with pytest.raises(InvalidObject, match="sequence of hashes"):
        objects.match_prefix(h[0])
    assert objects.match_prefix(h) == 0


# -- 4. counters --------------------------------------------------------------------------------

def test_bytes_read_counts_what_gets_read(objects):
    before = objects.stats()["counters"]["bytes_read"]
    objects.get("k", layers=11)
    layer = 2 * 2 * 8 * 4 * 2
    assert objects.stats()["counters"]["bytes_read"] - before == layer
    objects.get("k")
    assert objects.stats()["counters"]["bytes_read"] - before == 5 * layer


def test_syncs_show_that_concurrent_sync_puts_share_an_fdatasync(store_path):
    from .conftest import run_threads

    with tierstore.open(store_path) as s:
        c0 = s.stats()["counters"]
        run_threads(lambda i: [s.put(f"{i}-{j}", Blob(b"x" * 100)) for j in range(50)], 4)
        c1 = s.stats()["counters"]
    requests, syncs = c1["sync_requests"] - c0["sync_requests"], c1["syncs"] - c0["syncs"]
    assert requests >= 200  # every durable put asked for one
    assert 0 < syncs <= requests  # fdatasyncs made; fewer when puts overlapped


# -- 5. bounds name the object's own parameters ---------------------------------------------------

def test_bound_names_the_group_size(store_path):
    kv = np.random.default_rng(0).standard_normal((2, 2, 2, 64, 64)).astype(np.float16)
    with tierstore.open(store_path) as s:
        s.put("a", KVCache(kv), codec="int4:group=64")
        s.put("b", KVCache(kv), codec="int4")
        s.put("c", KVCache(kv), codec="kvq-ans:bins=12/12,shallow=1")
        assert "per group of 64" in s.info("a").bound and "32" not in s.info("a").bound
        assert "per group of 32" in s.info("b").bound
        assert "B = 12 for layers below 1, 12 from there" in s.info("c").bound


# -- 6. option typos ---------------------------------------------------------------------------

def test_unknown_option_lists_every_option_and_guesses(store_path):
    with pytest.raises(InvalidObject) as e:
        tierstore.open(store_path, dram_byte="1GiB")
    msg = str(e.value)
    assert "did you mean dram_bytes?" in msg
    for name in ("dram_bytes", "gpu_bytes", "gpu_device", "policy", "dram_admit", "codecs", "segment_bytes"):
        assert name in msg
    assert not os.path.exists(store_path)  # nothing created


# -- 7. keys with "/" ---------------------------------------------------------------------------

def test_path_like_text_keys(store_path):
    with tierstore.open(store_path) as s:
        s.put("images/cat.png", Blob(b"png"))
        s.put("https://example.com/a?b=c", Blob(b"url"))
        assert s.keys() == ["https://example.com/a?b=c", "images/cat.png"]
    with tierstore.open(store_path) as s:  # and after a restart (replayed, then from the index)
        assert s.get("images/cat.png").data == b"png"
    assert repair.fsck(store_path, deep=True).ok


@pytest.mark.parametrize("key, where", [("a\\b", "'\\\\\\\\' at position 1"), ("x\ny", "'\\\\n' at position 1")])
def test_bad_key_names_the_character(store_path, key, where):
    with tierstore.open(store_path) as s, pytest.raises(InvalidObject, match=where):
        s.put(key, Blob(b"x"))


def test_namespaces_still_refuse_slashes(store_path):
    with tierstore.open(store_path) as s, pytest.raises(InvalidObject, match="'/' at position 1"):
        s.put("k", Blob(b"x"), namespace="a/b")


# -- 8. compact on a small store reclaims -------------------------------------------------------

def test_compact_reclaims_on_a_store_smaller_than_a_quarter_segment(store_path):
    with tierstore.open(store_path) as s:  # 1 GiB segments: everything sits in the active one
        for i in range(20):
            s.put("k", Blob(bytes([i]) * 100_000))
        s.delete("k")
        s.put("keep", Blob(b"kept"))
        before = s.stats()["segment_bytes"]
        result = s.compact()
        after = s.stats()
        assert result["victims"] and after["segment_bytes"] < before / 10
        assert after["dead_bytes"] == 0 and s.get("keep").data == b"kept"
        s.compact()  # again: no growing number of files
        assert len(segment_files(store_path)) <= 2
    assert repair.fsck(store_path, deep=True).ok


def test_compact_leaves_a_small_clean_active_segment_open(store_path):
    with tierstore.open(store_path) as s:
        s.put("a", Blob(b"1"))
        s.compact()
        s.compact()
        assert len(segment_files(store_path)) == 1


def test_store_full_hint_is_true():
    assert "capacity" not in tierstore.StoreFull("x").hint and "compact()" in tierstore.StoreFull("x").hint


# -- 9. recover and quarantine ----------------------------------------------------------------------

def test_recover_on_a_healthy_store_quarantines_nothing(store_path):
    with tierstore.open(store_path) as s:
        s.put("a", Blob(b"1"))
    result = repair.recover(store_path)
    assert result["damage"] == [] and "passed" in result["old_index"]
    assert repair.quarantine_list(store_path) == []
    report = repair.fsck(store_path)
    assert report.ok and not report.findings


def test_a_cut_tail_that_held_bytes_is_quarantined_and_can_be_cleared(store_path):
    with tierstore.open(store_path) as s:
        s.put("a", Blob(b"1"))
    (seg,) = segment_files(store_path)
    with open(seg, "ab") as f:
        f.write(b"\xd4TRC" + os.urandom(500))  # a torn record
    with tierstore.open(store_path) as s:
        assert s.get("a").data == b"1"
        (d,) = s.stats()["recovery"]["damage"]
        assert d["quarantined_to"]
    items = repair.quarantine_list(store_path)
    assert len(items) == 1 and items[0]["bytes"] == 504 and "segment" in items[0]["reason"]
    assert any("tierstore quarantine" in f.what for f in repair.fsck(store_path).findings)
    assert repair.quarantine_clear(store_path) == 1
    assert repair.quarantine_list(store_path) == [] and not repair.fsck(store_path).findings


def test_a_zero_filled_tail_is_cut_without_quarantine(store_path):
    with tierstore.open(store_path) as s:
        s.put("a", Blob(b"1"))
    (seg,) = segment_files(store_path)
    with open(seg, "ab") as f:
        f.write(b"\xd4TRC" + bytes(100))
    with tierstore.open(store_path):
        pass
    assert len(repair.quarantine_list(store_path)) == 1  # magic bytes are not zero: kept
    repair.quarantine_clear(store_path)
    with open(seg, "ab") as f:
        f.write(bytes(5000))  # preallocated space: nothing to keep
    with tierstore.open(store_path):
        pass
    assert repair.quarantine_list(store_path) == []


# -- 12. API details ---------------------------------------------------------------------------

def test_chunk_hashes_default_to_256_tokens():
    toks = np.arange(1000)
    assert tierstore.chunk_hashes(toks) == tierstore.chunk_hashes(toks, chunk_tokens=256)
    assert len(tierstore.chunk_hashes(toks)) == 3


def test_get_returns_the_objects_meta_and_a_copy_keeps_it(store_path):
    with tierstore.open(store_path) as s:
        s.put("a", Blob(b"1"), meta={"turn": 3})
        s.put("b", KVCache(np.ones((1, 2, 1, 4, 4), np.float16)))
        a = s.get("a")
        assert a.meta == {"turn": 3} and s.get("b").meta == {} and Blob(b"new").meta == {}
        s.put("a2", a)  # a copy keeps its metadata ...
        assert s.info("a2").meta == {"turn": 3}
        s.put("a3", a, meta={"turn": 4})  # ... unless given other
        assert s.get("a3").meta == {"turn": 4}


def test_put_stores_a_copy_of_meta_and_gets_back_what_was_stored(store_path):
    """Changing the dict given to put changes nothing stored; a tuple comes back as a list in
    this process as in any other (what the log holds)."""
    m = {"tokens": [1, 2, 3], "pair": (4, 5)}
    with tierstore.open(store_path) as s:
        s.put("b", Blob(b"x"), meta=m)
        s.put_many([("c", Blob(b"y"), m)])
        m["tokens"].clear()
        m["late"] = True
        want = {"tokens": [1, 2, 3], "pair": [4, 5]}
        assert s.get("b").meta == want and s.info("b").meta == want and s.get("c").meta == want
        s.put("b2", s.get("b"))
        assert s.get("b2").meta == want
    with tierstore.open(store_path, readonly=True) as s:
        assert s.get("b").meta == s.get("b2").meta == s.get("c").meta == want


def test_meta_depth_counts_dicts_and_lists():
    def nested(levels: int) -> dict:
        d: dict = {"leaf": 1}
        for _ in range(levels - 1):
            d = {"d": d}
        return d

    assert rec.check_user_meta(nested(8)) == nested(8)  # 8 levels, as documented
    assert rec.check_user_meta({"a": [[[[[[[1]]]]]]]})  # a dict and 7 lists
    with pytest.raises(InvalidObject, match="deeper than 8"):
        rec.check_user_meta(nested(9))


def test_namespace_handles_reach_the_tiers(store_path):
    with tierstore.open(store_path, dram_bytes="8MiB") as s:
        s.put("sys", KVCache(np.ones((2, 2, 1, 8, 4), np.float16)), namespace="system")
        t = s.namespace("tenant", shared=["system"])
        t.put("k", KVCache(np.zeros((2, 2, 1, 8, 4), np.float16)))
        assert t.prefetch("k").result() > 0
        assert [lid for lid, _ in t.stream_layers("sys", namespace="system")] == [0, 1]
        with t.pinned("sys", namespace="system"):
            assert "dram" in s.info("sys", namespace="system").tiers
        with pytest.raises(tierstore.AccessDenied):
            t.prefetch("x", namespace="other")


def test_namespace_handles_have_the_batch_calls(store_path):
    with tierstore.open(store_path) as s:
        s.put("sys", Blob(b"system"), namespace="system")
        t = s.namespace("tenant", shared=["system"])
        t.put_many([("a", Blob(b"1")), ("b", Blob(b"2"))])
        assert t.put_async("c", Blob(b"3")).result() is None
        assert [o.data for o in t.get_many(["a", "b", "c"])] == [b"1", b"2", b"3"]
        assert t.get_many(["sys", "x"], namespace="system")[0].data == b"system"
        assert t.contains_many(["a", "x"]) == [True, False]
        assert t.delete_many(["a", "x"], namespace="tenant") == [True, False]
        assert s.keys(namespace="tenant") == ["b", "c"]
        for write in (lambda: t.put_many([("d", Blob(b"4"))], namespace="system"),
                      lambda: t.put("d", Blob(b"4"), namespace="other"),
                      lambda: t.delete_many(["sys"], namespace="system")):
            with pytest.raises(tierstore.AccessDenied):
                write()
        with pytest.raises(tierstore.AccessDenied):
            t.get_many(["a"], namespace="other")
        assert s.keys(namespace="system") == ["sys"] and s.keys(namespace="tenant") == ["b", "c"]
        with pytest.raises(tierstore.ReadOnlyError):
            s.namespace("tenant", readonly=True).put_many([("e", Blob(b"5"))])


def test_readonly_namespace_handle_hint(store_path):
    with tierstore.open(store_path) as s:
        ro = s.namespace("t", readonly=True)
        with pytest.raises(tierstore.ReadOnlyError) as e:
            ro.put("k", Blob(b"x"))
        assert "readonly=True" in str(e.value) and "create=True" not in str(e.value)


def test_a_namespace_handle_shared_with_one_name_as_a_string_is_refused(store_path):
    """shared="system" meant ["system"]: as a string it granted the tenants s, y, t, e and m."""
    with tierstore.open(store_path) as s:
        s.put("secret", Blob(b"tenant s"), namespace="s")
        with pytest.raises(InvalidObject, match=r"shared=\['system'\]"):
            s.namespace("tenant-a", shared="system")
        with pytest.raises(InvalidObject, match="readonly"):
            s.namespace("tenant-a", readonly="no")
        t = s.namespace("tenant-a", shared=("system",))  # the twin: a tuple is a list of names
        with pytest.raises(tierstore.AccessDenied):
            t.get("secret", namespace="s")


def test_options_and_errors_a_newcomer_met(store_path):
    """dram_bytes="0" is 0 (it raised "must be positive"); compact's ratio is checked (2 did nothing);
    a writable open beside this process's read-only handle is StoreLocked with a hint (a bare
    TierstoreError); a read-only refusal's hint does not talk about format versions."""
    for off in ("0", "0GiB", 0):
        with tierstore.open(store_path, dram_bytes=off) as s:
            assert "dram" not in s.stats()["tiers"]
    with tierstore.open(store_path) as s:
        for bad in (2, -0.1, "0.5", True):
            with pytest.raises(InvalidObject, match="min_dead_ratio"):
                s.compact(min_dead_ratio=bad)
        assert s.compact(min_dead_ratio=1)["victims"] == []  # the twin: in range
    with tierstore.open(store_path, readonly=True) as r:
        with pytest.raises(tierstore.StoreLocked) as e:
            tierstore.open(store_path)
        assert "read-only handles" in e.value.hint
        with pytest.raises(tierstore.ReadOnlyError) as e2:
            r.put("k", Blob(b"x"))
        assert "format version" not in str(e2.value)


def test_object_info_repr_is_short(store_path):
    with tierstore.open(store_path) as s:
        s.put("k", KVCache(np.ones((300, 2, 1, 4, 4), np.float16)))
        info = s.info("k")
        assert len(info.extent_checksums) == 300 and len(repr(info)) < 1000


# -- 13. directories that are not stores ------------------------------------------------------------

def test_open_refuses_a_non_empty_directory_without_a_store(tmp_path):
    d = tmp_path / "photos"
    d.mkdir()
    (d / "cat.png").write_bytes(b"png")
    with pytest.raises(InvalidObject, match="not empty and holds no store"):
        tierstore.open(str(d))
    assert sorted(os.listdir(d)) == ["cat.png"]  # nothing added beside the user's file
    empty = tmp_path / "empty"
    empty.mkdir()
    with tierstore.open(str(empty)) as s:  # the twin: an empty directory becomes a store
        s.put("a", Blob(b"1"))


def test_home_relative_paths_expand(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    with tierstore.open("~/kv") as s:
        assert s.path == str(tmp_path / "kv")
    assert not (tmp_path / "~").exists()


def test_more_messages_say_what_to_do(store_path, tmp_path):
    with pytest.raises(tierstore.StoreNotFound) as e:
        tierstore.open(str(tmp_path / "none"), readonly=True)
    assert "read-only open never creates" in str(e.value)
    with pytest.raises(InvalidObject, match="path must be a str"):
        tierstore.open(None)
    with pytest.raises(InvalidObject, match="dimension 1 is 3, not 2"):
        KVCache(np.ones((2, 3, 2, 4, 4), np.float16))
    with tierstore.open(store_path) as s:
        s.put("doc", Blob(b"x"), namespace="rag")
        with pytest.raises(tierstore.NotFound) as e:
            s.get("doc")
        assert "namespace 'rag' holds that key" in str(e.value)
        if HAS_TORCH:
            with pytest.raises(InvalidObject, match='"cpu" or "cuda:N"') as e:
                s.get("doc", namespace="rag", device="gpu")
            assert "ipu" not in str(e.value)


def test_a_miss_costs_only_its_lookup(store_path, monkeypatch):
    """The namespace hint of NotFound is worked out only when the error is shown, not on every
    miss (a cache's common case)."""
    with tierstore.open(store_path) as s:
        s.put("doc", Blob(b"x"), namespace="rag")
        calls = []
        real = s._engine.holders
        monkeypatch.setattr(s._engine, "holders", lambda *a, **k: calls.append(1) or real(*a, **k))
        for _ in range(100):
            with pytest.raises(tierstore.NotFound):
                s.get("doc")
        assert calls == []
        with pytest.raises(tierstore.NotFound) as e:
            s.get("doc")
        assert "namespace 'rag' holds that key" in str(e.value) and calls == [1]
