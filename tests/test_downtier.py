"""Down-tiering under the SSD budget (``open(..., ssd_bytes=, downtier={namespace: codec})``,
docs/placement.md): a victim of a namespace that allows lossy codecs is replaced by a lossy
copy (the same bytes ``put(codec=)`` would have written), which the next eviction that
chooses it removes; nothing else changes, the choice is visible (``info().lossless``), and the
live store and the simulator still decide alike."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import tierstore
from tierstore import Blob, KVCache
from tierstore.engine import repair
from tierstore.tiers import simulate as sim
from tierstore.tiers import trace as tr

MiB = 1 << 20
SHAPE = (2, 2, 4, 256, 64)  # 512 KiB of float16
# Segments of 1/8 of the 8 MiB budgets: the slack the eviction thread keeps (a segment) holds two
# objects, so that with a flush() after each step no put waits for room -- a put that waits makes
# the thread delete its victims instead of down-tiering them (tested on its own below)
SEG = "1MiB"


def kv(i: int, scale: float = 1.0) -> KVCache:
    rng = np.random.default_rng(i)
    return KVCache((rng.standard_normal(SHAPE) * scale).astype(np.float16))


def int4_of(tmp, obj: KVCache) -> np.ndarray:
    """What ``put(codec="int4")`` stores for ``obj``, read back."""
    with tierstore.open(str(tmp / "scratch")) as s:
        s.put("x", obj, codec="int4")
        return s.get("x").data


def test_victims_of_a_lossy_namespace_come_back_as_their_int4_copy_then_go(tmp_path):
    path = str(tmp_path / "s")
    with tierstore.open(path, ssd_bytes=8 * MiB, segment_bytes=SEG, downtier={"chat": "int4"}) as s:
        for i in range(40):
            s.put(f"c{i}", kv(i), namespace="chat")
            s.put(f"b{i}", Blob(os.urandom(20_000)), namespace="chat")  # a kind int4 does not take
            s.put(f"o{i}", kv(1000 + i), namespace="other")  # a namespace without downtier
            s.flush()
        ssd = s.stats()["tiers"]["ssd"]
        lossy, exact, gone = [], [], []
        for i in range(40):
            try:
                info = s.info(f"c{i}", namespace="chat")
            except tierstore.NotFound:
                gone.append(i)
                continue
            (exact if info.lossless else lossy).append(i)
            if not info.lossless:
                assert info.codec == "int4:group=32" and info.stored_bytes < 0.35 * SHAPE[0] * 2 * 4 * 256 * 64 * 2
        for i in lossy:
            got = s.get(f"c{i}", namespace="chat").data
            np.testing.assert_array_equal(got, int4_of(tmp_path / f"x{i}", kv(i)))  # bit for bit put(codec=)'s
        for i in exact:
            np.testing.assert_array_equal(s.get(f"c{i}", namespace="chat").data, kv(i).data)
        others = [s.info(f"o{i}", namespace="other") for i in range(40) if s.contains(f"o{i}", namespace="other")]
        assert all(o.lossless for o in others) and len(others) < 40  # evicted, never down-tiered
        blobs = [i for i in range(40) if s.contains(f"b{i}", namespace="chat")]
    assert lossy and exact and gone and len(blobs) < 40
    assert 39 in exact  # the newest put is never the victim
    assert min(lossy) > min(gone)  # lossy copies are what the oldest became; the oldest copies went next
    assert ssd["downtiered"] >= len(lossy) and ssd["downtiered_bytes"] > 0 and ssd["downtier_failures"] == 0
    assert ssd["evictions"] >= len(gone) + (40 - len(others)) + (40 - len(blobs))
    total = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs
                if not f.endswith(".lock") and f != "LOCK")
    assert total <= 8 * MiB
    with tierstore.open(path, readonly=True) as s:  # the same after reopening
        assert [i for i in range(40) if s.contains(f"c{i}", namespace="chat")] == sorted(lossy + exact)
    assert repair.fsck(path, deep=True).ok


def test_without_downtier_the_same_puts_only_evict(tmp_path):
    """The twin: same puts, no downtier: nothing lossy, more objects gone."""
    with tierstore.open(str(tmp_path / "s"), ssd_bytes=8 * MiB, segment_bytes=SEG) as s:
        for i in range(40):
            s.put(f"c{i}", kv(i), namespace="chat")
            s.flush()
        held = [s.info(f"c{i}", namespace="chat") for i in range(40) if s.contains(f"c{i}", namespace="chat")]
        assert held and all(h.lossless for h in held) and len(held) < 20
        assert s.stats()["tiers"]["ssd"]["downtiered"] == 0


def test_a_lossy_copy_keeps_its_sessions_and_metadata(tmp_path):
    with tierstore.open(str(tmp_path / "s"), ssd_bytes=8 * MiB, segment_bytes=SEG, downtier={"chat": "fp8"}) as s:
        s.put("first", kv(0), namespace="chat", session="u1", meta={"turn": 3})
        for i in range(1, 24):  # referenced too: objects with references go after the others
            s.put(f"c{i}", kv(i), namespace="chat", session=f"s{i}")
            s.flush()
            if not s.info("first", namespace="chat").lossless:
                break
        info = s.info("first", namespace="chat")
        assert not info.lossless and info.codec.startswith("fp8")
        assert info.meta == {"turn": 3} and info.sessions == ("u1",)
        assert s.session_keys("u1", namespace="chat") == ["first"]
        assert s.drop_session("u1", namespace="chat") == 1  # the reference still names it: it goes with the session
        assert not s.contains("first", namespace="chat")


def test_an_object_a_lossy_codec_refuses_is_evicted_instead(tmp_path):
    """Values past float16's range: int4 refuses them (no silent overflow), so the victim is
    deleted as without downtier, and counted."""
    with tierstore.open(str(tmp_path / "s"), ssd_bytes=8 * MiB, segment_bytes=SEG, downtier={"chat": "int4"}) as s:
        big = KVCache(np.full(SHAPE, 1e6, np.float32)[:, :, :2])  # 512 KiB of float32 past float16's range
        s.put("big", big, namespace="chat")
        for i in range(24):
            s.put(f"c{i}", kv(i), namespace="chat")
            s.flush()
        ssd = s.stats()["tiers"]["ssd"]
        assert not s.contains("big", namespace="chat")
        assert ssd["downtier_failures"] >= 1 and ssd["downtiered"] >= 1


def test_downtier_options_are_checked(tmp_path):
    path = str(tmp_path / "s")
    with pytest.raises(tierstore.InvalidObject, match="ssd_bytes"):
        tierstore.open(path, downtier={"chat": "int4"})
    with pytest.raises(tierstore.InvalidObject, match="lossless"):
        tierstore.open(path, ssd_bytes=8 * MiB, downtier={"chat": "zstd"})
    with pytest.raises(tierstore.InvalidObject, match="no lossy codec"):
        tierstore.open(path, ssd_bytes=8 * MiB, downtier={"chat": "nope"})
    with pytest.raises(tierstore.InvalidObject, match="dict"):
        tierstore.open(path, ssd_bytes=8 * MiB, downtier="int4")
    with pytest.raises(tierstore.InvalidObject, match="namespace"):
        tierstore.open(path, ssd_bytes=8 * MiB, downtier={"bad\x00ns": "int4"})
    with pytest.raises(tierstore.InvalidObject, match="remote"):  # refused before anything is contacted
        tierstore.open(path, ssd_bytes=8 * MiB, downtier={"chat": "int4"}, remote="redis://127.0.0.1:1/0")
    assert not os.path.exists(path)  # nothing was created by a refused open
    with tierstore.open(path, ssd_bytes=8 * MiB, downtier={"chat": "int8", "vec": "fp16"}) as s:  # valid twin
        s.put("a", kv(0), namespace="chat")
        assert s.get("a", namespace="chat").data.shape == SHAPE


@pytest.mark.parametrize("policy", ["lru", "cost"])
def test_the_live_store_and_the_simulator_agree_with_lossy_copies(tmp_path, policy):
    """With ``cost``, in four sessions: a copy re-enters the order without a use
    (``Policy.readmitted``), in the store as in the simulator."""
    path, log = str(tmp_path / "s"), str(tmp_path / "trace.jsonl")
    with tierstore.open(path, ssd_bytes=6 * MiB, segment_bytes="768KiB", downtier={"chat": "int4"}, trace_to=log,
                        durability="none", ssd_policy=policy) as s:
        for i in range(40):
            s.put(f"k{i}", kv(i), namespace="chat", session=f"s{i % 4}" if policy == "cost" else None)
            s.flush()  # the eviction thread done: the trace's order is the store's order
            for j in (i // 2, i // 3, 0):
                if s.contains(f"k{j}", namespace="chat"):
                    s.get(f"k{j}", namespace="chat")
            s.flush()
        ssd = s.stats()["tiers"]["ssd"]
    ops = list(tr.read_trace(log))
    assert ssd["downtiered"] > 5 and sum(o["op"] == "downtier" for o in ops) == ssd["downtiered"]
    r = sim.simulate(ops, dram_bytes=0, ssd_bytes=6 * MiB, policy=policy, follow=True)
    assert r["mismatches"] == [] and r["evictions_checked"] > 20 and r["lossy_hits"] > 0
    # twin: a trace whose lossy copy never re-entered the order is caught at the next eviction
    first = next(i for i, o in enumerate(ops) if o["op"] == "downtier")
    assert sim.simulate(ops[:first] + ops[first + 1:], dram_bytes=0, ssd_bytes=6 * MiB, policy=policy,
                        follow=True)["mismatches"]


def test_simulated_down_tiering_worked_by_hand():
    """SSD of 100 bytes, lossy copies of half the bytes: put a(60), b(60) -> a becomes a 30-byte
    copy (a30 b60); get a: a lossy hit (a is now the most recent); put c(60): b becomes a copy
    (a30 b30 c60 = 120), still over, so a's copy, chosen again, goes (b30 c60); get b: a lossy
    hit.  Without copies only one object fits: a goes at b's put, get a misses and stores a
    again (b goes), c's put evicts a, get b misses."""
    ops = [{"op": "put", "ns": "n", "key": "a", "bytes": 60}, {"op": "put", "ns": "n", "key": "b", "bytes": 60},
           {"op": "get", "ns": "n", "key": "a"}, {"op": "put", "ns": "n", "key": "c", "bytes": 60},
           {"op": "get", "ns": "n", "key": "b"}]
    r = sim.simulate(ops, dram_bytes=0, ssd_bytes=100, policy="lru", downtier={"n": 0.5})
    assert (r["downtiered"], r["ssd_evictions"], r["lossy_hits"], r["bytes_lossy"]) == (2, 1, 2, 60)
    assert (r["ssd_hits"], r["misses"], r["bytes_slow"], r["bytes_from_ssd"], r["bytes_written_ssd"]) == \
        (2, 0, 0, 60, 240)
    plain = sim.simulate(ops, dram_bytes=0, ssd_bytes=100, policy="lru")  # the twin: no copies
    assert (plain["downtiered"], plain["misses"], plain["lossy_hits"], plain["ssd_evictions"]) == (0, 2, 0, 4)
    with pytest.raises(tierstore.InvalidObject, match="share"):
        sim.simulate(ops, dram_bytes=0, ssd_bytes=100, policy="lru", downtier={"n": 1.5})


CHILD = """
import sys
import numpy as np
import tierstore
from tierstore import KVCache
path, start = sys.argv[1], int(sys.argv[2])
with tierstore.open(path, ssd_bytes=8 << 20, segment_bytes="1MiB", downtier={"chat": "int4"}) as s:
    for i in range(start, start + 1000):
        rng = np.random.default_rng(i)
        s.put(f"c{i}", KVCache(rng.standard_normal((2, 2, 4, 256, 64)).astype(np.float16)), namespace="chat")
        print(i, flush=True)
        if i % 2:
            s.flush()  # the eviction thread's copies done; on even puts it may still be at work when killed
"""


def test_sigkill_with_down_tiering_leaves_each_object_exact_or_its_int4_copy(tmp_path):
    path = str(tmp_path / "s")
    start, kills = 0, 0
    acked: list[int] = []
    while kills < 4:
        p = subprocess.Popen([sys.executable, "-c", CHILD, path, str(start)], stdout=subprocess.PIPE, text=True)
        got = []
        deadline = time.monotonic() + 60
        while len(got) < 14 + 3 * kills and time.monotonic() < deadline:
            line = p.stdout.readline()
            if not line:
                break
            got.append(int(line))
        p.send_signal(signal.SIGKILL)
        p.wait()
        p.stdout.close()
        assert got, "the child wrote nothing"
        acked += got
        start = got[-1] + 1
        kills += 1
    expect4 = {}
    with tierstore.open(path) as s:
        held = [i for i in range(start + 1) if s.contains(f"c{i}", namespace="chat")]
        assert acked[-1] in held  # the newest acknowledged put is never the first victim
        lossy = 0
        for i in held:
            got = s.get(f"c{i}", namespace="chat").data
            if s.info(f"c{i}", namespace="chat").lossless:
                np.testing.assert_array_equal(got, kv(i).data)
            else:
                lossy += 1
                expect4[i] = int4_of(tmp_path / f"x{i}", kv(i))
                np.testing.assert_array_equal(got, expect4[i])
        assert lossy > 0
    assert repair.fsck(path, deep=True).ok
    shutil.rmtree(os.path.join(path, "index"))
    with tierstore.open(path) as s:  # a rebuilt index gives the same answers
        assert [i for i in range(start + 1) if s.contains(f"c{i}", namespace="chat")] == held
        assert all(not s.info(f"c{i}", namespace="chat").lossless for i in expect4)


def test_simulate_cli_downtier(capsys):
    from tierstore.cli import main as cli

    assert cli(["simulate", "--generate", "tenants", "--seed", "1", "--policy", "lru", "--ssd", "20%",
                "--downtier", "tenants=0.3", "--json"]) == 0
    import json

    run = json.loads(capsys.readouterr().out)["runs"][0]
    assert run["downtiered"] > 0 and run["lossy_hits"] > 0
    assert cli(["simulate", "--generate", "tenants", "--seed", "1", "--policy", "lru", "--ssd", "20%"]) == 0
    assert "lossy copies" not in capsys.readouterr().out  # the twin: no copies, no line about them
    assert cli(["simulate", "--generate", "tenants", "--policy", "lru", "--downtier", "tenants=oops"]) == 2
    for bad in ("tenants=1.5", "tenants=0", "tenants=int4", "tenants=0.3,tenants=0.4"):
        assert cli(["simulate", "--generate", "tenants", "--policy", "lru", "--downtier", bad]) == 2, bad
    capsys.readouterr()


def test_a_put_waiting_for_room_makes_the_eviction_delete_instead(tmp_path, monkeypatch):
    """Re-encoding runs at the codec's speed, slower than puts can come: once a put waits at the
    bound, the victims left are deleted and the one being re-encoded stops at its next extent."""
    from tierstore.tiers import capacity

    real = capacity.Capacity._down_tier

    def with_a_waiting_put(self, victims):
        self._waiting += 1  # what make_room does for a put held up at the bound
        try:
            return real(self, victims)
        finally:
            self._waiting -= 1

    monkeypatch.setattr(capacity.Capacity, "_down_tier", with_a_waiting_put)
    with tierstore.open(str(tmp_path / "s"), ssd_bytes=8 * MiB, segment_bytes=SEG, downtier={"chat": "int4"}) as s:
        for i in range(30):
            s.put(f"c{i}", kv(i), namespace="chat")
            s.flush()
        ssd = s.stats()["tiers"]["ssd"]
        held = [s.info(f"c{i}", namespace="chat") for i in range(30) if s.contains(f"c{i}", namespace="chat")]
    assert ssd["downtiered"] == 0 and ssd["downtier_skipped"] > 5 and ssd["evictions"] >= ssd["downtier_skipped"]
    assert held and all(h.lossless for h in held)


def test_a_re_encode_stops_at_the_next_extent_when_told():
    from tierstore.format import block as blk

    calls = []

    class Stop(Exception):
        pass

    def between():
        calls.append(1)
        if len(calls) == 3:
            raise Stop

    block = blk.encode_block(KVCache(np.zeros((5, 2, 4, 256, 64), np.float16)), None, vector_extent_bytes=1 << 20)
    with pytest.raises(Stop):
        blk.apply_codec(block, tierstore.codecs.parse("int4", "kv"), None, between)
    assert len(calls) == 3  # two extents encoded, the third not begun
    calls.clear()
    assert len(blk.apply_codec(block, tierstore.codecs.parse("int4", "kv"), None, lambda: calls.append(1)).extents) \
        == 5 == len(calls)  # the twin: told nothing, every extent


def slow_copies(monkeypatch, seconds: float, hook=None):
    """Make each re-encode take ``seconds`` more (checking ``between`` as an extent would), and
    run ``hook(store, ns, key)`` first when given."""
    real = tierstore.Store._lossy_copy

    def copy(self, ns, k, loc, choice, between=None):
        if hook is not None:
            hook(self, ns, k)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(0.01)
            if between is not None:
                between()
        return real(self, ns, k, loc, choice, between)

    monkeypatch.setattr(tierstore.Store, "_lossy_copy", copy)


def test_a_copy_that_would_not_be_smaller_is_not_kept(tmp_path):
    """A chunk zstd already stores in a few KiB: its int4 copy would be ~160 KiB, so it is evicted."""
    with tierstore.open(str(tmp_path / "s"), ssd_bytes=8 * MiB, segment_bytes=SEG, downtier={"chat": "int4"}) as s:
        for i in range(40):
            s.put(f"z{i}", KVCache(np.zeros(SHAPE, np.float16)), namespace="chat", codec="zstd")
            s.put(f"c{i}", kv(i), namespace="chat")
            s.flush()
        ssd = s.stats()["tiers"]["ssd"]
        zs = [s.info(f"z{i}", namespace="chat") for i in range(40) if s.contains(f"z{i}", namespace="chat")]
        assert all(z.lossless for z in zs)
    assert ssd["downtier_failures"] > 0 and ssd["downtiered"] > 0  # the twin: the random chunks were kept as copies


@pytest.mark.parametrize("what", ["put", "delete"])
def test_a_put_or_delete_while_the_copy_is_made_wins(tmp_path, monkeypatch, what):
    done = []

    def hook(store, ns, k):
        if not done:
            done.append(k.decode())
            if what == "put":  # the same bytes again: a newer record all the same
                store.put(k.decode(), kv(int(k[1:])), namespace=ns.decode())
            else:
                store.delete(k.decode(), namespace=ns.decode())

    slow_copies(monkeypatch, 0.0, hook)
    with tierstore.open(str(tmp_path / "s"), ssd_bytes=8 * MiB, segment_bytes=SEG, downtier={"chat": "int4"}) as s:
        for i in range(20):
            s.put(f"c{i}", kv(i), namespace="chat")
            s.flush()
            if done:
                break
        assert done
        if what == "put":
            info = s.info(done[0], namespace="chat")
            assert info.lossless  # the user's put stands: not replaced by the copy of the older record
            np.testing.assert_array_equal(s.get(done[0], namespace="chat").data, kv(int(done[0][1:])).data)
        else:
            assert not s.contains(done[0], namespace="chat")  # no copy brought it back
        assert s.stats()["tiers"]["ssd"]["background_error"] is None


def test_an_error_while_re_encoding_evicts_the_object_as_without_downtier(tmp_path, monkeypatch):
    def hook(store, ns, k):
        raise OSError(5, "Input/output error")

    slow_copies(monkeypatch, 0.0, hook)
    with tierstore.open(str(tmp_path / "s"), ssd_bytes=8 * MiB, segment_bytes=SEG, downtier={"chat": "int4"}) as s:
        for i in range(20):
            s.put(f"c{i}", kv(i), namespace="chat")
            s.flush()
        ssd = s.stats()["tiers"]["ssd"]
        held = [i for i in range(20) if s.contains(f"c{i}", namespace="chat")]
    assert ssd["background_error"] is None and ssd["downtiered"] == 0 and ssd["downtier_failures"] > 3
    assert len(held) < 20 and 19 in held


def test_a_put_waiting_at_the_bound_stops_the_copy_under_way(tmp_path, monkeypatch):
    """Puts back to back, re-encodes slowed to 0.3 s each and no time limit on a run: only a put
    that waits (make_room) can make the eviction thread give way, and it does."""
    from tierstore.tiers import capacity

    monkeypatch.setattr(capacity, "DOWNTIER_RUN_S", 1000.0)
    slow_copies(monkeypatch, 0.3)
    with tierstore.open(str(tmp_path / "s"), ssd_bytes=8 * MiB, segment_bytes=SEG, downtier={"chat": "int4"}) as s:
        t0 = time.monotonic()
        for i in range(40):
            s.put(f"c{i}", kv(i), namespace="chat")
        elapsed = time.monotonic() - t0
        ssd = s.stats()["tiers"]["ssd"]
    assert ssd["downtier_skipped"] > 5
    assert elapsed < 0.3 * ssd["downtier_skipped"]  # the puts did not wait for each slowed re-encode


def test_flush_and_close_wait_for_a_bounded_part_of_the_re_encoding(tmp_path, monkeypatch):
    from tierstore.tiers import capacity

    monkeypatch.setattr(capacity, "DOWNTIER_RUN_S", 0.5)
    slow_copies(monkeypatch, 0.4)
    s = tierstore.open(str(tmp_path / "s"), ssd_bytes=8 * MiB, segment_bytes=SEG, downtier={"chat": "int4"})
    for i in range(12):
        s.put(f"c{i}", kv(i), namespace="chat")
    s.put("big", KVCache(np.zeros((2, 2, 16, 256, 64), np.float16)), namespace="other")  # 2 MiB: many victims
    t0 = time.monotonic()
    s.flush()
    assert time.monotonic() - t0 < 3.0
    s.put("big2", KVCache(np.zeros((2, 2, 16, 256, 64), np.float16)), namespace="other")
    t0 = time.monotonic()
    s.close()  # stops the copy under way at its next extent
    assert time.monotonic() - t0 < 3.0
    with tierstore.open(str(tmp_path / "s"), readonly=True) as r:
        assert r.contains("big2", namespace="other")


def test_simulated_copies_never_hold_more_than_the_tier():
    """Capacity 100: a(90), then b(90) makes a a 45-byte copy -- 135 held -- so the copy, chosen
    again, goes too; get a misses, and storing it again does the same to b."""
    ops = [{"op": "put", "ns": "n", "key": "a", "bytes": 90}, {"op": "put", "ns": "n", "key": "b", "bytes": 90},
           {"op": "get", "ns": "n", "key": "a"}]
    r = sim.simulate(ops, dram_bytes=0, ssd_bytes=100, policy="lru", downtier={"n": 0.5})
    assert (r["downtiered"], r["ssd_evictions"], r["misses"], r["lossy_hits"]) == (2, 2, 1, 0)
    assert sim.simulate(ops, dram_bytes=0, ssd_bytes=100, policy="belady", downtier={"n": 0.5})["downtiered"] == 0


def test_a_torch_tensor_stays_a_torch_tensor(tmp_path):
    torch = pytest.importorskip("torch")
    with tierstore.open(str(tmp_path / "s"), ssd_bytes=8 * MiB, segment_bytes=SEG, downtier={"chat": "int4"}) as s:
        s.put("t", KVCache(torch.from_numpy(kv(0).data)), namespace="chat", meta={"m": 1})
        for i in range(1, 30):
            s.put(f"c{i}", kv(i), namespace="chat")
            s.flush()
            if not s.info("t", namespace="chat").lossless:
                break
        got = s.get("t", namespace="chat")
        assert not s.info("t", namespace="chat").lossless and isinstance(got.data, torch.Tensor)
        assert got.meta == {"m": 1}


def test_a_put_that_evicts_by_itself_deletes_and_counts_what_it_could_have_copied(tmp_path):
    """4 MiB budget, 512 KiB objects, auto segments of 256 KiB: puts pass the bound before the
    thread runs and evict by themselves, which never re-encode -- counted, not silent."""
    with tierstore.open(str(tmp_path / "s"), ssd_bytes=4 * MiB, downtier={"chat": "int4"}) as s:
        for i in range(16):
            s.put(f"c{i}", kv(i), namespace="chat")
        ssd = s.stats()["tiers"]["ssd"]
    assert ssd["eviction_runs"] > 0 and ssd["downtier_skipped"] > 0
    assert ssd["downtier"] == {"chat": "int4:group=32"}


def test_info_and_pin_of_a_missing_key_are_not_read_misses(tmp_path):
    log = str(tmp_path / "t.jsonl")
    with tierstore.open(str(tmp_path / "s"), ssd_bytes=8 * MiB, trace_to=log) as s:
        for _ in range(3):
            with pytest.raises(tierstore.NotFound):
                s.info("zz")
        with pytest.raises(tierstore.NotFound):
            s.pin("zz")
        assert s.stats()["tiers"]["ssd"]["misses"] == 0
        with pytest.raises(tierstore.NotFound):
            s.get("zz")  # the twin: a read's miss is one
        assert s.stats()["tiers"]["ssd"]["misses"] == 1
    assert [o["op"] for o in tr.read_trace(log)] == ["get"]


def test_retained_and_down_tiered_at_once_is_refused(tmp_path):
    with pytest.raises(tierstore.InvalidObject, match="both retained"):
        tierstore.open(str(tmp_path / "s"), ssd_bytes=8 * MiB, retain={"chat": "always"}, downtier={"chat": "int4"})
    with tierstore.open(str(tmp_path / "s"), ssd_bytes=8 * MiB, retain={"rag": "always"},
                        downtier={"chat": "int4"}) as s:  # the twin: two namespaces
        assert s.stats()["tiers"]["ssd"]["retained"] == ["rag"]
