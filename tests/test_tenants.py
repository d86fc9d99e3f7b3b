"""What a tenant's handle (``Store.namespace``) gives away about other tenants: nothing.

A handle reaches no other namespace by name (tests/test_prefix.py); these check what comes
back around that check -- a miss's hint, a full store's message, pins, and the eviction order
that one tenant's sessions must not move for another's (the policies know a session by its
namespace and name)."""

from __future__ import annotations

import os

import numpy as np
import pytest

import tierstore
from tierstore import Blob

from .conftest import promotions_held

MiB = 1 << 20


def test_a_miss_through_a_handle_names_only_namespaces_it_may_read(store_path):
    with tierstore.open(store_path, dram_bytes=MiB) as s:
        s.put("report", Blob(b"bob's"), namespace="tenant-bob")
        s.put("prompt", Blob(b"p"), namespace="system")
        alice = s.namespace("tenant-alice", shared=["system"])
        for call in (lambda: alice.get("report"), lambda: alice.info("report"),
                     lambda: alice.stream_layers("report"), lambda: alice.pin("report"),
                     lambda: alice.get(b"report")):
            with pytest.raises(tierstore.NotFound) as e:
                call()
            assert e.value.hint is None and "bob" not in str(e.value)
        with pytest.raises(tierstore.NotFound) as e:  # a namespace it may read is named
            alice.get("prompt")
        assert e.value.hint == "namespace 'system' holds that key"
        with pytest.raises(tierstore.NotFound) as e:  # the store's owner sees every namespace
            s.get("report", namespace="tenant-alice")
        assert "'tenant-bob'" in e.value.hint


@pytest.mark.parametrize("where", ["dram", "ssd"])
def test_one_tenants_sessions_never_move_another_tenants_objects_in_the_eviction_order(tmp_path, where):
    """Tenant A drops (or announces) a session of a name tenant B also uses: B's objects keep
    their place.  Run twice, with and without A's calls: the same objects are evicted."""
    def run(path, meddle: bool) -> dict:
        if where == "dram":
            with tierstore.open(path, dram_bytes=4 * MiB + 4096, policy="session") as s:
                a, b, c = s.namespace("tenant-a"), s.namespace("tenant-b"), s.namespace("tenant-c")
                rng = np.random.default_rng(0)
                for i in range(2):
                    c.put(f"c{i}", Blob(rng.bytes(MiB)), session="old")
                for i in range(2):
                    b.put(f"b{i}", Blob(rng.bytes(MiB)), session="conv")
                c.prefetch(["c0", "c1"]).result()
                b.prefetch(["b0", "b1"]).result()
                b.prefetch_session("conv").result()
                c.put("c-hot", Blob(b"x"), session="old")
                if meddle:
                    assert a.drop_session("conv") == 0
                    a.prefetch_session("old").result()  # (c's session's name, in a's namespace: nothing of c's)
                a.put("a0", Blob(rng.bytes(MiB)))
                a.prefetch(["a0"]).result()  # one MiB must leave the DRAM tier
                return {k: "dram" in h.info(k).tiers for h, ks in ((b, ["b0", "b1"]), (c, ["c0", "c1"]))
                        for k in ks}
        with tierstore.open(path, ssd_bytes=8 * MiB, ssd_policy="session", durability="none", dram_bytes=0) as s:
            a, b, c = s.namespace("tenant-a"), s.namespace("tenant-b"), s.namespace("tenant-c")
            for i in range(10):
                c.put(f"c{i}", Blob(os.urandom(200_000)), session="old")
                s.flush()
            for i in range(10):
                b.put(f"b{i}", Blob(os.urandom(200_000)), session="conv")
                b.get(f"b{i}")
                s.flush()
            if meddle:
                assert a.drop_session("conv") == 0
            for i in range(15):  # a's puts pass the budget: the disk evicts
                a.put(f"a{i}", Blob(os.urandom(200_000)), session="hot")
                s.flush()
                for j in range(i + 1):
                    if a.contains(f"a{j}"):
                        a.get(f"a{j}")
                s.flush()
            return {"b": len(b.keys()), "c": len(c.keys())}

    alone, meddled = run(str(tmp_path / "alone"), False), run(str(tmp_path / "meddled"), True)
    assert meddled == alone
    if where == "dram":
        assert alone == {"b0": True, "b1": True, "c0": True, "c1": False}, alone  # (c's older session goes)
    else:
        assert alone["b"] == 10 and alone["c"] < 10  # (b's session is the active one)


def test_a_tenant_releases_only_the_pins_it_took(store_path):
    with tierstore.open(store_path, dram_bytes=MiB) as s:
        s.put("prompt", Blob(b"p" * 1000), namespace="system")
        a = s.namespace("tenant-a", shared=["system"])
        b = s.namespace("tenant-b", shared=["system"], readonly=True)
        for _ in range(2):  # before and after a's pin: b learns nothing, releases nothing
            with pytest.raises(tierstore.InvalidObject, match="'tenant-b' holds no pin"):
                b.unpin("prompt", namespace="system")
            a.pin("prompt", namespace="system")
        a.unpin(b"prompt", namespace="system")  # (a bytes key is the same key)
        with b.pinned("prompt", namespace="system"):
            # a handle made per request: the tenant's pin taken through another handle is its own
            s.namespace("tenant-a", shared=["system"]).unpin("prompt", namespace="system")
            with pytest.raises(tierstore.InvalidObject):
                a.unpin("prompt", namespace="system")
            assert s.stats()["tiers"]["dram"]["pinned_objects"] == 1
        assert s.stats()["tiers"]["dram"]["pinned_objects"] == 0  # b's pin went with its block
        with pytest.raises(tierstore.NotFound):
            a.pin("missing")
        with pytest.raises(tierstore.InvalidObject, match="holds no pin"):
            a.unpin("missing")  # a failed pin is not held
        with pytest.raises(tierstore.InvalidObject, match="tier must be one of"):
            a.unpin("prompt", namespace="system", tier="bogus")


def test_a_full_tier_or_a_failed_future_tells_a_tenant_nothing_of_the_others(store_path):
    """Pins and prefetches into a full DRAM tier: the tier's StoreFull named the pinned bytes
    (another tenant's) through a handle's ``pin``, ``pinned`` and ``prefetch``'s Future."""
    with tierstore.open(store_path, dram_bytes=MiB) as s:
        bob, alice = s.namespace("tenant-bob"), s.namespace("tenant-alice")
        bob.put("big", Blob(os.urandom(700_000)))
        bob.pin("big")
        alice.put("mine", Blob(os.urandom(700_000)))
        for call in (lambda: alice.pin("mine"), lambda: alice.prefetch(["mine"]).result(timeout=60)):
            with pytest.raises(tierstore.StoreFull) as e:
                call()
            assert "700" not in str(e.value) and "pinned" not in str(e.value) and e.value.namespace == "tenant-alice"
        with pytest.raises(tierstore.StoreFull) as owner:  # the store's owner sees the figures
            s.pin("mine", namespace="tenant-alice")
        assert "pinned" in str(owner.value)
        with pytest.raises(tierstore.NotFound) as miss:  # a Future's miss is scoped as a call's
            bob.prefetch(["mine"]).result(timeout=60)
        assert miss.value.hint is None
        assert alice.put_async("k", Blob(b"x")).result(timeout=60) is None  # twin: a Future that succeeds


def test_a_full_store_tells_a_tenant_nothing_of_the_others(store_path):
    with tierstore.open(store_path, ssd_bytes=8 * MiB, retain={"tenant-vip": "always"}, durability="none",
                        dram_bytes=MiB) as s:
        vip, other = s.namespace("tenant-vip"), s.namespace("tenant-other")
        with pytest.raises(tierstore.StoreFull) as owner:
            for i in range(40):
                vip.put(f"v{i}", Blob(os.urandom(250_000)))
                s.flush()
        other.put("o", Blob(os.urandom(100_000)))
        other.pin("o")
        with pytest.raises(tierstore.StoreFull) as e:
            s.namespace("tenant-a").put("a-big", Blob(os.urandom(MiB)))
        text = str(e.value)
        assert "tenant-vip" not in text and "pinned" not in text and "ssd_bytes" not in text, text
        assert e.value.namespace == "tenant-a" and e.value.__cause__ is None and e.value.__suppress_context__
        with pytest.raises(tierstore.StoreFull) as full:  # the store itself still says what fills it
            s.put("a-big", Blob(os.urandom(MiB)), namespace="tenant-a")
        assert "tenant-vip" in str(full.value) and "no room" in str(owner.value)


def test_a_namespace_that_is_not_a_plain_str_is_refused(store_path):
    class Lookalike(str):  # equal to a granted name, spelling another
        def __eq__(self, other):
            return other == "system" or str.__eq__(self, other)

        __hash__ = str.__hash__

    with tierstore.open(store_path) as s:
        s.put("k", Blob(b"b's"), namespace="b")
        a = s.namespace("a", shared=["system"])
        for bad in (Lookalike("b"), ["x"], b"system"):
            with pytest.raises(tierstore.AccessDenied, match="must be a str"):
                a.get("k", namespace=bad)
            with pytest.raises(tierstore.AccessDenied):
                a.put("k", Blob(b"x"), namespace=bad)


def test_a_handles_future_cancels_and_runs_as_the_stores_does(store_path):
    """A handle's Future was a copy that could always be cancelled: cancel() said True while the
    put or the promotion went on (and its result or error was lost to the caller)."""
    with tierstore.open(store_path, dram_bytes=MiB) as s:
        a = s.namespace("a")
        a.put("k", Blob(os.urandom(100_000)))
        with promotions_held(s) as (inside, _):  # (held inside the tier thread: the Store's Future is running)
            fut = a.prefetch(["k"])
            assert inside.wait(30) and fut.running() and not fut.done()
            assert fut.cancel() is False  # (work under way: as the Store's own Future says)
        assert fut.result(timeout=30) == 100_000 and not fut.cancelled() and not fut.running()
        assert a.put_async("j", Blob(b"x")).result(timeout=30) is None


def test_a_handles_cancelled_future_is_done_for_concurrent_futures_wait(store_path):
    """A handle's Future cancelled while queued was never reported done to concurrent.futures'
    wait() / as_completed() (wait() without a timeout hung); the running twin completes."""
    import concurrent.futures as cf

    with tierstore.open(store_path, dram_bytes=MiB) as s:
        a = s.namespace("a")
        a.put("k", Blob(os.urandom(1000)))
        with promotions_held(s):
            busy = [a.prefetch(["k"]) for _ in range(s._tiers.executor._max_workers)]  # every tier thread held
            queued = a.prefetch(["k"])
            assert queued.cancel() is True
            done, _ = cf.wait([queued], timeout=5)
            assert done == {queued} and queued.cancelled()
            assert list(cf.as_completed([queued], timeout=5)) == [queued]
        done, not_done = cf.wait(busy, timeout=30)
        assert len(done) == len(busy) and not not_done
