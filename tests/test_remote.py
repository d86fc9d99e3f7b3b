"""The remote tier against real servers: a standalone redis-server and a 3-master Redis Cluster
(tests/redis_servers.py), two stores ("nodes") sharing them, in one process and in two."""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import redis

import tierstore
from tierstore.bench.servers import RedisCluster, RedisServer
from tierstore.format import constants as fmt
from tierstore.tiers.remote import parse_url, remote_key


@pytest.fixture
def server(tmp_path: Path):
    s = RedisServer(tmp_path).start()
    yield s
    s.stop()


@pytest.fixture
def cluster(tmp_path: Path):
    c = RedisCluster(tmp_path).start()
    yield c
    c.stop()


def kv(seed: int = 0, layers: int = 4, tokens: int = 16) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((layers, 2, 2, tokens, 8)).astype(np.float16)


def node(tmp_path: Path, name: str, url: str, **options) -> tierstore.Store:
    return tierstore.open(str(tmp_path / name), remote=url, **options)


def wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.05)


def held(store: tierstore.Store, key: bytes, ns: str, like: tierstore.Store | None = None) -> None:
    """Wait until ``store`` keeps a fetched object in its own log (done in the background): the
    version ``like`` holds, when given."""
    def kept() -> bool:
        try:
            info = store.info(key, namespace=ns)
        except tierstore.NotFound:
            return False
        return info.tiers != ("remote",) and (
            like is None or info.extent_checksums == like.info(key, namespace=ns).extent_checksums)
    wait_for(kept)


def remote_of(store: tierstore.Store) -> dict:
    return store.stats()["tiers"]["remote"]


# -- sharing ---------------------------------------------------------------------------------------

def test_an_object_put_on_one_node_is_read_on_another(tmp_path, server):
    a, b = node(tmp_path, "a", server.url), node(tmp_path, "b", server.url)
    x = kv(1)
    a.put(b"h1", tierstore.KVCache(x), namespace="llama")
    assert remote_of(a)["puts"] == 1
    got = b.get(b"h1", namespace="llama")
    assert np.array_equal(got.data, x)
    assert remote_of(b)["hits"] == 1
    wait_for(lambda: b.info(b"h1", namespace="llama").tiers != ("remote",))  # kept in b's log (in the background)
    bytes_in = remote_of(b)["bytes_in"]
    got = b.get(b"h1", namespace="llama")  # now local: only the version is asked for
    assert np.array_equal(got.data, x)
    assert remote_of(b)["hits"] == 1 and remote_of(b)["bytes_in"] == bytes_in
    assert b.info(b"h1", namespace="llama").lsn > 0  # kept in b's own log
    assert b.contains(b"h1", namespace="llama")
    assert b.match_prefix([b"h1", b"h2"], namespace="llama") == 1
    assert b.get_many([b"h1", b"nope"], namespace="llama")[1] is None
    a.close()
    b.close()


def test_the_server_holds_the_record_as_stored(tmp_path, server):
    a = node(tmp_path, "a", server.url)
    a.put("k", tierstore.Blob(b"payload"), namespace="ns")
    value = redis.Redis(port=server.port).get(remote_key(b"ns", b"k"))
    assert value[:4] == fmt.REMOTE_MAGIC
    info = a.info("k", namespace="ns")
    record = value[fmt.REMOTE_ENVELOPE.size:]
    assert record[:4] == fmt.RECORD_MAGIC and len(record) == info.stored_bytes
    assert int.from_bytes(record[4:8], "little") == int(info.checksum.split(":")[1], 16)  # the header CRC
    a.close()


def test_misses_everywhere_are_not_found(tmp_path, server):
    b = node(tmp_path, "b", server.url)
    with pytest.raises(tierstore.NotFound):
        b.get(b"absent", namespace="x")
    assert not b.contains(b"absent", namespace="x")
    b.close()


def test_overwrites_and_deletes_reach_other_nodes_on_their_next_read(tmp_path, server):
    a, b = node(tmp_path, "a", server.url), node(tmp_path, "b", server.url)
    a.put(b"h", tierstore.KVCache(kv(1)), namespace="m")
    assert np.array_equal(b.get(b"h", namespace="m").data, kv(1))
    held(b, b"h", "m")
    a.put(b"h", tierstore.KVCache(kv(2)), namespace="m")
    assert np.array_equal(b.get(b"h", namespace="m").data, kv(2))  # b's copy was older: fetched again
    assert remote_of(b)["stale"] == 1
    held(b, b"h", "m", like=a)
    assert a.delete(b"h", namespace="m")
    with pytest.raises(tierstore.NotFound):
        b.get(b"h", namespace="m")
    assert b.keys(namespace="m") == []  # the stale local copy is gone too
    # b overwrites: a sees b's version, and b's delete of a key it never held reaches a
    b.put(b"h", tierstore.KVCache(kv(3)), namespace="m")
    assert np.array_equal(a.get(b"h", namespace="m").data, kv(3))
    a.put(b"only-a", tierstore.Blob(b"a"), namespace="m")
    assert b.delete(b"only-a", namespace="m")  # b holds no copy: the tombstone is still sent
    with pytest.raises(tierstore.NotFound):
        a.get(b"only-a", namespace="m")
    a.close()
    b.close()


def test_a_delete_during_a_fetch_is_not_undone_by_its_cache_copy(tmp_path, server):
    """A fetched object is kept in the local log in the background; a delete that lands between
    the fetch and that copy (nothing local to delete yet) wins: the copy is not kept."""
    a, b = node(tmp_path, "a", server.url), node(tmp_path, "b", server.url)
    a.put(b"k", tierstore.Blob(b"v"), namespace="m")
    deferred = []
    b._tiers.submit = lambda fn, *args: deferred.append((fn, args))  # the copy waits, as on a busy executor
    assert b.get(b"k", namespace="m").data == b"v"
    assert len(deferred) == 1
    assert b.delete(b"k", namespace="m")  # b holds nothing yet: the tombstone goes to the server
    fn, args = deferred.pop()
    fn(*args)  # the background copy, late
    assert b.keys(namespace="m") == [] and not b.contains(b"k", namespace="m")
    # a get that fetches while a delete is in progress (begun, its tombstone not yet sent)
    a.put(b"j", tierstore.Blob(b"w"), namespace="m")
    has, during = b._remote_has, []

    def between(ns, ks, **kw):  # delete() asks the server whether it holds the key: a get comes first
        during.append(b.get(b"j", namespace="m").data)
        return has(ns, ks, **kw)

    b._remote_has = between
    assert b.delete(b"j", namespace="m") and during == [b"w"]
    b._remote_has = has
    fn, args = deferred.pop()
    fn(*args)
    assert b.keys(namespace="m") == []
    server.kill()
    for key in (b"k", b"j"):
        with pytest.raises(tierstore.NotFound):
            b.get(key, namespace="m")  # with the server gone, nothing local answers either
    a.close()
    b.close()


def test_stream_layers_follows_other_nodes_like_get(tmp_path, server):
    a, b = node(tmp_path, "a", server.url), node(tmp_path, "b", server.url)
    a.put(b"h", tierstore.KVCache(kv(1)), namespace="m")
    only_server = [layer for _, layer in b.stream_layers(b"h", namespace="m")]  # b holds nothing: fetched
    assert np.array_equal(np.stack(only_server), kv(1))
    held(b, b"h", "m")
    a.put(b"h", tierstore.KVCache(kv(2)), namespace="m")  # overwritten on another node
    assert np.array_equal(np.stack([x for _, x in b.stream_layers(b"h", namespace="m")]), kv(2))
    assert np.array_equal(np.stack([x for _, x in b.stream_layers(b"h", namespace="m", layers=[1, 2])]), kv(2)[1:3])
    held(b, b"h", "m", like=a)
    assert a.delete(b"h", namespace="m")  # deleted on another node
    with pytest.raises(tierstore.NotFound):
        b.stream_layers(b"h", namespace="m")
    a.close()
    b.close()


def test_a_delete_of_a_key_only_the_server_holds_waits_for_a_server_that_does_not_answer(tmp_path, server):
    a, b = node(tmp_path, "a", server.url), node(tmp_path, "b", server.url, remote_timeout=0.3, remote_retry_s=0.2)
    a.put(b"x", tierstore.Blob(b"old"), namespace="m")
    server.pause()
    try:
        assert b.delete(b"x", namespace="m") is False  # not known: the server did not answer
        assert b.delete_many([b"x"], namespace="m") == [False]
        assert remote_of(b)["tombstones_pending"] >= 1  # ... but its tombstone waits to be sent
    finally:
        server.resume()
    wait_for(lambda: remote_of(b)["tombstones_pending"] == 0)
    with pytest.raises(tierstore.NotFound):
        a.get(b"x", namespace="m")
    a.close()
    b.close()


def test_a_stale_resend_never_resurrects_a_delete(tmp_path, server):
    """b writes while the server is down and closes with the write unsent; a then puts and deletes
    the key.  b reopens: its re-send is older than a's tombstone, so it is refused, and b's own
    read finds the newer tombstone and drops its copy."""
    port = server.port
    server.kill()
    b = node(tmp_path, "b", server.url, remote_timeout=0.5, remote_connect_timeout=0.5)
    b.put(b"k", tierstore.Blob(b"old"), namespace="m")  # local only: the server is gone
    assert remote_of(b)["errors"] >= 1
    b.close()
    assert json.loads((tmp_path / "b" / fmt.REMOTE_FILE).read_text())["dirty"] is True
    server2 = RedisServer(tmp_path, port=port).start()
    try:
        a = node(tmp_path, "a", server2.url)
        a.put(b"k", tierstore.Blob(b"new"), namespace="m")
        assert a.delete(b"k", namespace="m")
        b = node(tmp_path, "b", server2.url)
        wait_for(lambda: remote_of(b)["resent"] >= 1)  # the sweep re-sent the unsent put ...
        assert remote_of(b)["put_conflicts"] >= 1  # ... and the server kept the newer tombstone
        with pytest.raises(tierstore.NotFound):
            b.get(b"k", namespace="m")
        with pytest.raises(tierstore.NotFound):
            a.get(b"k", namespace="m")
        a.close()
        b.close()
    finally:
        server2.stop()


def test_two_processes_share_a_server(tmp_path, server):
    script = """
import sys, numpy as np, tierstore
path, url, op = sys.argv[1:4]
s = tierstore.open(path, remote=url, remote_timeout=10, remote_connect_timeout=10)  # a slow machine is not
if op == "put":                                                                     # what this test is about
    s.put(b"chunk", tierstore.KVCache(np.full((2, 2, 1, 4, 8), float(sys.argv[4]), np.float16)), namespace="m")
else:
    try:
        print(float(s.get(b"chunk", namespace="m").data.ravel()[0]))
    except tierstore.NotFound:
        print("missing")
print(s.stats()["tiers"]["remote"], file=sys.stderr)  # shown when an answer is not the one expected
s.close()
"""
    said: list[str] = []  # each process's remote counters and warnings, shown when an answer is wrong

    def run(*argv: str) -> str:
        out = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        said.append(f"{argv[2]}: {out.stderr}")
        return out.stdout.strip()

    def get() -> str:
        answer = run(str(tmp_path / "p2"), server.url, "get")
        return answer if answer != "missing" else "missing\n" + "\n".join(said)

    run(str(tmp_path / "p1"), server.url, "put", "1")
    assert get() == "1.0"
    run(str(tmp_path / "p1"), server.url, "put", "2")  # p1 overwrites; p2 notices on its next read
    assert get() == "2.0"
    s = node(tmp_path, "p1", server.url)
    s.delete(b"chunk", namespace="m")
    s.close()
    assert get().startswith("missing")


# -- damage ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("damage", ["flip-payload", "flip-header", "truncate", "other-key", "garbage"])
def test_a_damaged_remote_value_is_a_miss_never_data(tmp_path, server, damage, caplog):
    a, b = node(tmp_path, "a", server.url), node(tmp_path, "b", server.url)
    a.put(b"k", tierstore.KVCache(kv(1)), namespace="m")
    a.put(b"other", tierstore.KVCache(kv(2)), namespace="m")
    r = redis.Redis(port=server.port)
    name = remote_key(b"m", b"k")
    value = r.get(name)
    if damage == "flip-payload":
        r.setrange(name, len(value) - 10, bytes([value[-10] ^ 1]))
    elif damage == "flip-header":
        r.setrange(name, fmt.REMOTE_ENVELOPE.size + 60, bytes([value[fmt.REMOTE_ENVELOPE.size + 60] ^ 1]))
    elif damage == "truncate":
        r.set(name, value[:len(value) // 2])
    elif damage == "other-key":
        r.set(name, r.get(remote_key(b"m", b"other")))
    else:
        r.set(name, b"not a tierstore value")
    with caplog.at_level(logging.WARNING, logger="tierstore.remote"):
        # contains reads the envelope and the length: a body not read yet counts (documented)
        assert b.contains(b"k", namespace="m") is (damage in ("flip-payload", "flip-header", "other-key"))
        with pytest.raises(tierstore.NotFound):
            b.get(b"k", namespace="m")
        with pytest.raises(tierstore.NotFound):
            b.get(b"k", namespace="m")
        assert b.contains_many([b"k", b"other"], namespace="m") == [False, True]  # once read: known damaged
        assert b.match_prefix([b"k"], namespace="m") == 0
    assert remote_of(b)["bad_values"] >= 1
    assert len([m for m in caplog.messages if "damaged" in m]) == 1  # logged once
    assert np.array_equal(a.get(b"k", namespace="m").data, kv(1))  # the writer's own copy is untouched
    assert np.array_equal(b.get(b"other", namespace="m").data, kv(2))  # the twin: a valid value still loads
    if damage == "flip-payload":  # the same version sent again after the server lost it: present again
        r.delete(name)
        assert a.remote_sync(namespace="m")["sent"] == 1
        assert b.contains(b"k", namespace="m") is False  # (known damaged until a read finds it sound)
        assert b.get_many([b"k"], namespace="m")[0] is not None  # get_many does not go by that
        assert b.contains_many([b"k"], namespace="m") == [True] and b.match_prefix([b"k"], namespace="m") == 1
    a.put(b"k", tierstore.KVCache(kv(3)), namespace="m")  # replaced: present again
    assert b.contains(b"k", namespace="m") and np.array_equal(b.get(b"k", namespace="m").data, kv(3))
    a.close()
    b.close()


# -- faults -----------------------------------------------------------------------------------------------

def test_a_killed_server_degrades_to_local_and_the_remote_catches_up(tmp_path, server):
    a = node(tmp_path, "a", server.url, remote_timeout=0.5, remote_connect_timeout=0.5, remote_retry_s=0.2)
    a.put(b"before", tierstore.Blob(b"1"), namespace="m")
    port = server.port
    server.kill()
    t0 = time.monotonic()
    for i in range(20):
        a.put(b"during%d" % i, tierstore.Blob(b"2" * 1000), namespace="m")
    assert a.get(b"before", namespace="m").data == b"1"
    assert a.get(b"during3", namespace="m").data == b"2" * 1000
    assert time.monotonic() - t0 < 10  # one timeout per retry period, not one per call
    st = remote_of(a)
    assert st["errors"] >= 1 and st["queue_length"] >= 1
    server2 = RedisServer(tmp_path, port=port).start()  # back, empty (no persistence)
    try:
        wait_for(lambda: remote_of(a)["queue_length"] == 0)
        b = node(tmp_path, "b", server2.url)
        for i in range(20):
            assert b.get(b"during%d" % i, namespace="m").data == b"2" * 1000
        b.close()
        a.close()
    finally:
        server2.stop()


def test_a_paused_server_costs_a_timeout_not_a_hang(tmp_path, server):
    a = node(tmp_path, "a", server.url, remote_timeout=0.3, remote_retry_s=5)
    a.put(b"k", tierstore.Blob(b"v"), namespace="m")
    server.pause()
    try:
        t0 = time.monotonic()
        a.put(b"k2", tierstore.Blob(b"v2"), namespace="m")
        assert a.get(b"k", namespace="m").data == b"v"
        assert a.get(b"k2", namespace="m").data == b"v2"
        assert time.monotonic() - t0 < 3
        assert 1 <= remote_of(a)["errors"] <= 2 and remote_of(a)["down"]  # one timeout per thread in flight
    finally:
        server.resume()
    a.close()


def test_close_gives_a_put_that_failed_one_more_try(tmp_path, server):
    """A write-through send that timed out once is sent by close(), not left for the next open."""
    a = node(tmp_path, "a", server.url, remote_timeout=0.3, remote_retry_s=2)  # no retry before close()
    server.pause()
    try:
        a.put(b"k", tierstore.Blob(b"v"), namespace="m")  # the send times out: queued, the tier down
        assert remote_of(a)["errors"] >= 1 and remote_of(a)["queue_length"] == 1
    finally:
        server.resume()
    a.close()  # the retry (after remote_retry_s) reaches the server
    assert redis.Redis(port=server.port).exists(remote_key(b"m", b"k"))


def test_close_of_a_node_whose_server_is_gone_costs_one_more_try(tmp_path, server):
    a = node(tmp_path, "a", server.url, remote_timeout=0.3, remote_connect_timeout=0.3, remote_retry_s=0.2)
    server.kill()
    a.put(b"k", tierstore.Blob(b"v"), namespace="m")
    t0 = time.monotonic()
    a.close()
    assert time.monotonic() - t0 < 3  # one retry, not the whole 5 s drain
    assert json.loads((tmp_path / "a" / fmt.REMOTE_FILE).read_text())["dirty"]  # the put waits for the next open


def test_close_does_not_wait_for_a_retry_past_its_drain(tmp_path, server):
    a = node(tmp_path, "a", server.url, remote_timeout=0.3, remote_connect_timeout=0.3, remote_retry_s=30)
    server.kill()
    a.put(b"k", tierstore.Blob(b"v"), namespace="m")  # fails: the next try is 30 s away
    t0 = time.monotonic()
    a.close()
    assert time.monotonic() - t0 < 2  # not the whole 5 s drain for a retry that cannot come in it


def test_write_through_sends_during_a_group_sync(tmp_path, server):
    """durability="group": a put that makes the group sync sends to the server during the sync,
    not after it.  Here the sync itself waits until the server holds the put (and fails if it
    never does), so a send that came only after the sync would fail the put."""
    from tierstore.engine.fileio import PosixIO

    client = redis.Redis.from_url(server.url)
    big_name = remote_key(b"m", b"big")

    class SyncAfterTheSend(PosixIO):
        armed = False

        def fdatasync(self, fd: int) -> None:
            deadline = time.monotonic() + 5
            while self.armed and not client.exists(big_name):
                if time.monotonic() > deadline:
                    raise OSError(errno.EIO, "the put was not sent during the sync")
                time.sleep(0.01)
            super().fdatasync(fd)

    io = SyncAfterTheSend()
    a = tierstore.open(str(tmp_path / "a"), remote=server.url, durability="group", group_commit_bytes="64KiB",
                       group_commit_ms=60_000, _io=io)  # no timed syncs: only the size bound
    small, big = tierstore.Blob(b"s"), tierstore.Blob(os.urandom(256 << 10))
    a.put(b"small", small, namespace="m")
    io.armed = True
    a.put(b"big", big, namespace="m")  # past the bound: this put's settle syncs
    io.armed = False
    st = a.stats()
    assert st["durable_lsn"] == st["next_lsn"] - 1  # both puts durable when it returned
    b = node(tmp_path, "b", server.url)
    assert b.get(b"big", namespace="m").data == big.data
    assert b.get(b"small", namespace="m").data == small.data
    b.close()
    a.close()
    client.close()


def test_a_sender_that_outlives_close_writes_no_remote_state(tmp_path, server):
    """close waits for the sender a bounded time; a send still in flight after that must not
    rewrite REMOTE afterwards (it would overwrite what the next open of the store saves)."""
    a = node(tmp_path, "a", server.url, remote_policy="write-back", remote_timeout=0.2,
             remote_connect_timeout=0.2)
    queue = a._remote.queue
    load, stuck, release = queue.load, threading.Event(), threading.Event()

    def slow_load(ns, k):
        stuck.set()
        release.wait(30)
        return load(ns, k)

    queue.load = slow_load
    a.put(b"k", tierstore.Blob(b"v"), namespace="m")
    assert stuck.wait(10)
    state = tmp_path / "a" / "REMOTE"
    a._remote.close(drain_s=0.1)  # the store's close, with a short drain: the sender is still stuck
    sender = queue._thread
    assert sender is not None and sender.is_alive()
    saved = state.read_bytes()
    assert json.loads(saved)["dirty"]  # the put was not sent: the next open sweeps
    release.set()
    sender.join(10)
    assert not sender.is_alive()
    assert state.read_bytes() == saved
    a.close()


@pytest.mark.parametrize("closed_before", [False, True], ids=["first-open", "after-a-clean-close"])
def test_unsent_puts_are_resent_after_a_crash(tmp_path, server, closed_before):
    """The process dies before its queue drains: the next open re-sends from the log -- also
    after an earlier clean close (REMOTE says "dirty" from open until a clean close)."""
    if closed_before:
        a = node(tmp_path, "a", server.url)
        a.put(b"k", tierstore.Blob(b"v"), namespace="m")
        a.close()  # clean: REMOTE says so
    port = server.port
    server.kill()
    script = f"""
import os, tierstore
s = tierstore.open({str(tmp_path / 'a')!r}, remote="redis://127.0.0.1:{port}/0", remote_timeout=0.3,
                   remote_connect_timeout=0.3)
for i in range(5):
    s.put(b"k%d" % i, tierstore.Blob(b"v%d" % i), namespace="m")
assert s.stats()["tiers"]["remote"]["queue_length"] == 5
os._exit(0)  # no close: the queue is lost with the process
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    server2 = RedisServer(tmp_path, port=port).start()
    try:
        a = node(tmp_path, "a", server2.url)
        wait_for(lambda: remote_of(a)["resent"] >= 5)
        b = node(tmp_path, "b", server2.url)
        assert [b.get(b"k%d" % i, namespace="m").data for i in range(5)] == [b"v%d" % i for i in range(5)]
        a.close()
        b.close()
    finally:
        server2.stop()


def test_a_full_server_is_an_error_counted_not_a_failed_put(tmp_path):
    s = RedisServer(tmp_path, "--maxmemory", "3mb", "--maxmemory-policy", "noeviction").start()
    try:
        a = node(tmp_path, "a", s.url)
        for i in range(8):
            a.put(b"k%d" % i, tierstore.Blob(os.urandom(1 << 20)), namespace="m")
        assert remote_of(a)["full"] >= 1
        assert len(a.keys(namespace="m")) == 8
        a.close()
    finally:
        s.stop()


def test_an_evicted_value_is_a_miss(tmp_path):
    s = RedisServer(tmp_path, "--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru").start()
    try:
        a = node(tmp_path, "a", s.url)
        for i in range(12):
            a.put(b"k%d" % i, tierstore.Blob(bytes([i]) * (1 << 20)), namespace="m")
        b = node(tmp_path, "b", s.url)
        results = b.get_many([b"k%d" % i for i in range(12)], namespace="m")
        assert any(r is None for r in results)  # evicted: misses
        assert all(r.data == bytes([i]) * (1 << 20) for i, r in enumerate(results) if r is not None)
        assert remote_of(b)["errors"] == 0
        a.close()
        b.close()
    finally:
        s.stop()


# -- policies --------------------------------------------------------------------------------------------

def test_write_back_returns_first_and_sends_later(tmp_path, server):
    a = node(tmp_path, "a", server.url, remote_policy="write-back")
    a.put(b"k", tierstore.KVCache(kv(4)), namespace="m")
    a.delete(b"gone", namespace="m")
    wait_for(lambda: remote_of(a)["queue_length"] == 0 and remote_of(a)["puts"] == 1)
    b = node(tmp_path, "b", server.url)
    assert np.array_equal(b.get(b"k", namespace="m").data, kv(4))
    a.close()
    b.close()


def test_read_only_policy_never_writes_to_the_server(tmp_path, server):
    slow = {"remote_timeout": 10, "remote_connect_timeout": 10}  # a loaded machine is not what this tests
    a = node(tmp_path, "a", server.url, **slow)
    a.put(b"shared", tierstore.Blob(b"s"), namespace="m")
    r = node(tmp_path, "r", server.url, remote_policy="read-only", **slow)
    r.put(b"mine", tierstore.Blob(b"m"), namespace="m")
    r.delete(b"shared", namespace="m")
    assert redis.Redis(port=server.port).get(remote_key(b"m", b"mine")) is None
    assert a.get(b"shared", namespace="m").data == b"s"
    assert r.get(b"shared", namespace="m").data == b"s"  # read from the remote (the delete stayed local)
    a.close()
    r.close()


# -- layers ------------------------------------------------------------------------------------------------

def test_a_single_layer_get_moves_about_the_layers_bytes(tmp_path, server):
    x = np.random.default_rng(0).standard_normal((4, 2, 8, 256, 128)).astype(np.float16)  # 1 MiB per layer
    a, b = node(tmp_path, "a", server.url), node(tmp_path, "b", server.url)
    a.put(b"chunk", tierstore.KVCache(x), namespace="m")
    got = b.get(b"chunk", namespace="m", layers=2)
    assert np.array_equal(got.data, x[2:3])
    moved = remote_of(b)["bytes_in"]
    assert moved <= 1.1 * x[2].nbytes, moved
    info = b.info(b"chunk", namespace="m")  # a ranged read caches nothing locally: described from the server
    assert info.tiers == ("remote",) and info.segment is None and info.shape == x.shape
    with pytest.raises(tierstore.NotFound):
        b.info(b"nothing", namespace="m")
    assert np.array_equal(b.get(b"chunk", namespace="m").data, x)
    a.close()
    b.close()


def test_get_out_and_device_from_the_remote(tmp_path, server):
    x = kv(5)
    a, b = node(tmp_path, "a", server.url), node(tmp_path, "b", server.url)
    a.put(b"c", tierstore.KVCache(x), namespace="m")
    out = np.empty_like(x)
    got = b.get(b"c", namespace="m", out=out)
    assert got.data is out and np.array_equal(out, x)
    with pytest.raises(tierstore.InvalidObject):
        node(tmp_path, "c", server.url).get(b"c", namespace="m", out=np.empty((1,), np.float16))
    a.close()
    b.close()


# -- security ------------------------------------------------------------------------------------------------

def test_auth_and_credentials_never_shown(tmp_path, caplog, monkeypatch):
    s = RedisServer(tmp_path, "--requirepass", "s3cret-pw").start()
    try:
        url = f"redis://:s3cret-pw@127.0.0.1:{s.port}/0"
        a = node(tmp_path, "a", url, remote_timeout=10)  # a loaded machine is not what this test is about
        a.put(b"k", tierstore.Blob(b"v"), namespace="m")
        assert remote_of(a)["puts"] == 1
        shown = json.dumps(a.stats(), default=str) + repr(a)
        assert "s3cret" not in shown
        a.close()
        monkeypatch.setenv("TIERSTORE_REMOTE_PASSWORD", "s3cret-pw")  # from the environment
        b = node(tmp_path, "b", f"redis://127.0.0.1:{s.port}/0", remote_timeout=10)
        assert b.get(b"k", namespace="m").data == b"v"
        b.close()
        monkeypatch.delenv("TIERSTORE_REMOTE_PASSWORD")
        with caplog.at_level(logging.WARNING, logger="tierstore.remote"):
            c = node(tmp_path, "c", f"redis://:wrong-pw@127.0.0.1:{s.port}/0")
            c.put(b"x", tierstore.Blob(b"y"), namespace="m")  # refused by the server: local only
            assert c.get(b"x", namespace="m").data == b"y"
            assert remote_of(c)["errors"] >= 1
            c.close()
        assert caplog.messages and not any("wrong-pw" in m for m in caplog.messages)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tierstore.remote"):  # no password at all: Redis only
            d = node(tmp_path, "d", f"redis://127.0.0.1:{s.port}/0")  # says "HELLO must be called with the
            d.put(b"x", tierstore.Blob(b"y"), namespace="m")  # client already authenticated"
            d.close()
        assert any("wants a password" in m for m in caplog.messages), caplog.messages
    finally:
        s.stop()


def test_urls_are_checked_before_anything_opens(tmp_path):
    # (options in the URL were dropped unread: a new user's review, 2026-12-03)
    for bad in ("http://x", "redis://h:99999", "redis://a:1,b:2", "redis+cluster://h:1/3", "redis://h/x",
                "redis://h:1/0?socket_timeout=abc", "redis://h:1/0#x"):
        with pytest.raises(tierstore.InvalidObject):
            tierstore.open(str(tmp_path / "s"), remote=bad)
    assert not (tmp_path / "s").exists()
    with pytest.raises(tierstore.InvalidObject):
        tierstore.open(str(tmp_path / "s"), remote_policy="write-back")  # without remote=
    # an infinite (or past time_t) timeout passed the check, then every put, get and close() raised
    # OverflowError from inside redis-py (a new user's try, 2026-12-04)
    for name in ("remote_timeout", "remote_connect_timeout"):
        for bad in (float("inf"), 1e12, 86400.5):
            with pytest.raises(tierstore.InvalidObject, match=f"{name} must be at most 86400 seconds"):
                tierstore.open(str(tmp_path / "s"), remote="redis://127.0.0.1:1/0", **{name: bad})
    assert not (tmp_path / "s").exists()
    t = parse_url("rediss://user:pw@h:7000/2")
    assert t.tls and t.username == "user" and t.password == "pw" and t.db == 2 and "pw" not in t.shown
    assert not parse_url("redis://h").tls and parse_url("valkeys+cluster://a:1,b:2").cluster


def test_a_scoped_handle_stays_in_its_namespace_prefix(tmp_path, server):
    a = node(tmp_path, "a", server.url)
    tenant = a.namespace("tenant-a")
    tenant.put(b"k", tierstore.Blob(b"v"))
    names = redis.Redis(port=server.port).keys(b"*")
    assert names == [remote_key(b"tenant-a", b"k")]
    assert names[0].startswith(fmt.REMOTE_PREFIX + b"tenant-a".hex().encode() + b":{")
    with pytest.raises(tierstore.AccessDenied):
        tenant.get(b"k", namespace="tenant-b")
    a.close()


# -- cluster -------------------------------------------------------------------------------------------------

def test_a_cluster_shares_chunks_across_nodes_and_survives_a_lost_master(tmp_path, cluster):
    a = node(tmp_path, "a", cluster.url, remote_timeout=0.5, remote_connect_timeout=0.5, remote_retry_s=0.2)
    b = node(tmp_path, "b", cluster.url, remote_timeout=0.5, remote_connect_timeout=0.5, remote_retry_s=0.2)
    hashes = [b"chunk-%02d" % i for i in range(24)]
    for i, h in enumerate(hashes):
        a.put(h, tierstore.KVCache(kv(i)), namespace="m")
    masters = {n.port: n.cli("dbsize") for n in cluster.nodes}
    assert sum(int(v) for v in masters.values()) == 24 and all(int(v) > 0 for v in masters.values())
    assert b.match_prefix(hashes, namespace="m") == 24  # sees chunks another node stored
    assert np.array_equal(b.get(hashes[5], namespace="m").data, kv(5))
    assert remote_of(b)["hits"] == 1
    cluster.nodes[1].kill()  # a master is gone (no replica to fail over to)
    a.put(b"new", tierstore.Blob(b"local"), namespace="m")
    assert a.get(b"new", namespace="m").data == b"local"
    assert np.array_equal(b.get(hashes[5], namespace="m").data, kv(5))  # b's local copy
    got = 0
    for h in hashes:
        try:
            got += np.array_equal(b.get(h, namespace="m").data, kv(hashes.index(h)))
        except tierstore.NotFound:
            pass
    assert got >= 1
    assert remote_of(a)["errors"] + remote_of(b)["errors"] >= 1
    a.close()
    b.close()


# -- tools ----------------------------------------------------------------------------------------------------

def test_remote_sync_sends_what_the_server_lacks_and_fsck_checks_it(tmp_path, server):
    from tierstore.cli import main

    path = str(tmp_path / "a")
    with tierstore.open(path) as s:  # written before the store had a remote
        for i in range(5):
            s.put(b"k%d" % i, tierstore.KVCache(kv(i)), namespace="m")
    assert main(["remote-sync", path, "--remote", server.url, "--json"]) == 0
    b = node(tmp_path, "b", server.url)
    assert all(np.array_equal(b.get(b"k%d" % i, namespace="m").data, kv(i)) for i in range(5))
    b.close()
    with tierstore.open(path, remote=server.url) as a:  # a second sync finds everything there
        assert a.remote_sync() == {"checked": 5, "sent": 0, "present": 5, "local_only": 0, "tombstones": 0,
                                   "failed": 0, "refused": 0, "answered": True}
        a.delete(b"k0", namespace="m")
    assert main(["fsck", "--remote", server.url, "--namespace", "m"]) == 0
    r = redis.Redis(port=server.port)
    name = remote_key(b"m", b"k3")
    r.setrange(name, len(r.get(name)) - 1, b"\x00" if r.get(name)[-1] else b"\x01")
    assert main(["fsck", "--remote", server.url, "--json"]) == 1
    with tierstore.open(path, remote=server.url) as a:  # the tombstone of k0 is not overwritten by a sync
        counts = a.remote_sync()
        assert counts["checked"] == 4
    assert redis.Redis(port=server.port).get(remote_key(b"m", b"k0"))[5] & fmt.REMOTE_FLAG_TOMBSTONE


def test_remote_sync_beside_the_node_that_sends_says_what_to_do(tmp_path, server):
    """The hint was open()'s ("open this handle with remote_policy='read-only'"), which a command
    line cannot follow; a day-long timeout is the valid twin of the caps."""
    import subprocess
    import sys

    from tierstore.cli import EXIT_LOCKED, main

    path = str(tmp_path / "a")
    src = os.path.dirname(os.path.dirname(os.path.abspath(tierstore.__file__)))
    with tierstore.open(path, remote=server.url, remote_timeout=86400, remote_connect_timeout=86400) as s:
        s.put(b"k", tierstore.Blob(b"v"), namespace="m")
        cli = subprocess.run([sys.executable, "-m", "tierstore", "remote-sync", path, "--remote", server.url],
                             capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": src})
        assert cli.returncode == EXIT_LOCKED, cli.stderr
        assert "call store.remote_sync() in that process" in cli.stderr and "remote_policy" not in cli.stderr
    assert main(["remote-sync", path, "--remote", server.url]) == 0  # closed: the command runs


def test_a_cluster_failover_keeps_serving_and_remote_sync_refills_what_it_lost(tmp_path):
    c = RedisCluster(tmp_path, replicas=1).start()
    try:
        a = node(tmp_path, "a", c.url, remote_timeout=0.5, remote_connect_timeout=0.5, remote_retry_s=0.3)
        hashes = [b"chunk-%02d" % i for i in range(12)]
        for i, h in enumerate(hashes):
            a.put(h, tierstore.Blob(b"%d" % i), namespace="m")
        c.masters()[0].kill()
        a.put(b"during", tierstore.Blob(b"x"), namespace="m")  # local, whatever the cluster does
        assert a.get(b"during", namespace="m").data == b"x"
        wait_for(lambda: len(c.masters()) == 3, 30)  # a replica takes over (cluster-node-timeout 1 s)
        time.sleep(0.5)  # past a's retry window
        # replication is asynchronous: the failover may have lost the newest writes; the node that
        # wrote them still has them and sends them again
        wait_for(lambda: a.remote_sync(namespace="m")["failed"] == 0, 30)
        b = node(tmp_path, "b", c.url)
        got = b.get_many([*hashes, b"during"], namespace="m")
        assert [g.data for g in got] == [b"%d" % i for i in range(12)] + [b"x"]
        a.close()
        b.close()
    finally:
        c.stop()


def test_a_full_queue_drops_keys_from_memory_and_a_sweep_resends_them(tmp_path, server):
    a = node(tmp_path, "a", server.url, remote_policy="write-back", remote_queue=3, remote_timeout=0.3,
             remote_connect_timeout=0.3, remote_retry_s=0.2)
    port = server.port
    server.kill()
    for i in range(10):
        a.put(b"k%d" % i, tierstore.Blob(b"v%d" % i), namespace="m")
    st = remote_of(a)
    assert st["queue_length"] <= 3 and st["queue_dropped"] >= 7
    server2 = RedisServer(tmp_path, port=port).start()
    try:
        wait_for(lambda: remote_of(a)["queue_length"] == 0 and remote_of(a)["resent"] >= 7, 20)
        b = node(tmp_path, "b", server2.url)
        assert [g.data for g in b.get_many([b"k%d" % i for i in range(10)], namespace="m")] == \
            [b"v%d" % i for i in range(10)]
        a.close()
        b.close()
    finally:
        server2.stop()


def test_tls_with_a_ca_file(tmp_path, monkeypatch):
    from tierstore.bench.servers import self_signed

    cert, key = self_signed(tmp_path)
    s = RedisServer(tmp_path, tls=(cert, key)).start()
    try:
        monkeypatch.setenv("TIERSTORE_REMOTE_CA", cert)
        a, b = node(tmp_path, "a", s.url), node(tmp_path, "b", s.url)
        assert s.url.startswith("rediss://")
        a.put(b"k", tierstore.KVCache(kv(7)), namespace="m")
        assert np.array_equal(b.get(b"k", namespace="m").data, kv(7))
        assert remote_of(a)["errors"] == 0
        a.close()
        b.close()
        monkeypatch.delenv("TIERSTORE_REMOTE_CA")  # an unknown certificate: refused, local only
        c = node(tmp_path, "c", s.url, remote_timeout=0.5)
        c.put(b"x", tierstore.Blob(b"y"), namespace="m")
        assert remote_of(c)["errors"] >= 1 and c.get(b"x", namespace="m").data == b"y"
        c.close()
    finally:
        s.stop()


def test_scattered_layers_travel_as_one_record(tmp_path, server):
    """``KVCache.from_layers`` (an extent of two pieces per layer, as the LMCache plugin writes)."""
    import torch

    x = torch.from_numpy(kv(9))
    a, b = node(tmp_path, "a", server.url), node(tmp_path, "b", server.url)
    a.put_many([(b"c", tierstore.KVCache.from_layers([(x[i, 0], x[i, 1]) for i in range(x.shape[0])]))],
               namespace="m")
    assert remote_of(a)["puts"] == 1 and remote_of(a)["errors"] == 0
    assert torch.equal(b.get(b"c", namespace="m").data, x)
    a.close()
    b.close()


def test_a_delete_waiting_to_be_sent_is_the_local_answer(tmp_path, server):
    """write-back: until the tombstone reaches the server, reads on this node see the delete."""
    a = node(tmp_path, "a", server.url)
    for i in range(20):
        a.put(b"k%d" % i, tierstore.Blob(b"v"), namespace="m")
    a.close()
    w = node(tmp_path, "a", server.url, remote_policy="write-back")
    server.pause()  # nothing reaches the server meanwhile
    try:
        for i in range(20):
            assert w.delete(b"k%d" % i, namespace="m")
        assert remote_of(w)["tombstones_pending"] == 20
        server.resume()
        for i in range(20):
            with pytest.raises(tierstore.NotFound):
                w.get(b"k%d" % i, namespace="m")
            assert not w.contains(b"k%d" % i, namespace="m")
        assert w.keys(namespace="m") == []
        wait_for(lambda: remote_of(w)["tombstones"] == 20)
        b = node(tmp_path, "b", server.url)
        assert b.get_many([b"k%d" % i for i in range(20)], namespace="m") == [None] * 20
        b.close()
    finally:
        server.resume()
    w.close()


def test_many_deletes_in_write_back_save_remote_safely(tmp_path, server):
    a = node(tmp_path, "a", server.url, remote_policy="write-back")
    for i in range(50):
        a.put(b"k%d" % i, tierstore.Blob(b"v"), namespace="m")
    wait_for(lambda: remote_of(a)["queue_length"] == 0)
    for i in range(50):
        assert a.delete(b"k%d" % i, namespace="m")  # REMOTE is rewritten by this thread and the sender's
    wait_for(lambda: remote_of(a)["tombstones"] == 50)
    a.close()
    state = json.loads((tmp_path / "a" / fmt.REMOTE_FILE).read_text())
    assert state["tombstones"] == [] and state["dirty"] is False


def test_a_password_with_slashes_is_never_echoed():
    with pytest.raises(tierstore.InvalidObject) as e:
        parse_url("redis://user:pa/ss,w@h:notaport/0")
    assert "pa/ss" not in str(e.value) and "ss,w" not in str(e.value)
    t = parse_url("redis://user:pa%2Fss@h:1/0")
    assert t.password == "pa/ss" and t.hosts == (("h", 1),)
    t = parse_url("redis://user:pa/ss@h:1/0")
    assert t.password == "pa/ss" and t.hosts == (("h", 1),)


def test_one_remote_handle_per_store_and_process(tmp_path, server):
    a = node(tmp_path, "a", server.url)
    with pytest.raises(tierstore.InvalidObject) as e:
        node(tmp_path, "a", server.url)
    assert "thread-safe" in e.value.hint
    plain = tierstore.open(str(tmp_path / "a"))  # a handle without remote= shares the engine as before
    plain.close()
    a.close()
    node(tmp_path, "a", server.url).close()  # released with the first


def test_one_process_per_store_sends_to_the_remote(tmp_path, server):
    """Several writer processes may share a store (SPEC.md §7.8), but its REMOTE file has one
    owner: a second process asking for a writable remote tier is refused with a hint, and may
    open it read-only (or write without remote=)."""
    import subprocess
    import sys

    src = os.path.dirname(os.path.dirname(os.path.abspath(tierstore.__file__)))
    code = (f"import sys; sys.path.insert(0, {src!r})\n"
            "import tierstore\n"
            "path, url = sys.argv[1], sys.argv[2]\n"
            "try:\n"
            "    tierstore.open(path, remote=url).close()\n"
            "    print('opened')\n"
            "except tierstore.StoreLocked as e:\n"
            "    print('refused', 'read-only' in e.hint)\n"
            "with tierstore.open(path, remote=url, remote_policy='read-only') as s:\n"
            "    s.put('theirs', tierstore.Blob(b'2'))\n"
            "    print(s.get('mine').data.decode())\n")
    with node(tmp_path, "a", server.url) as a:
        a.put("mine", tierstore.Blob(b"1"))
        a.flush()
        out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "a"), server.url], capture_output=True,
                             text=True, timeout=120)
        assert out.stdout.split() == ["refused", "True", "1"], out.stderr
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "a"), server.url], capture_output=True,
                         text=True, timeout=120)
    assert out.stdout.split()[0] == "opened", out.stderr  # the claim went with the first process's close


def test_a_refused_database_is_logged_and_remote_sync_says_the_server_does_not_answer(tmp_path, server, caplog):
    from tierstore.cli import main

    with caplog.at_level(logging.WARNING, logger="tierstore.remote"):
        a = node(tmp_path, "a", f"redis://127.0.0.1:{server.port}/99")  # the server has databases 0-15
        a.put(b"k", tierstore.Blob(b"v"), namespace="m")
        assert a.get(b"k", namespace="m").data == b"v"
        assert remote_of(a)["errors"] >= 1
        a.close()
    assert any("DB index" in m for m in caplog.messages)
    port = server.port
    server.kill()
    assert main(["remote-sync", str(tmp_path / "a"), "--remote", f"redis://127.0.0.1:{port}/0"]) == 3


def test_two_sends_of_one_version_at_once_leave_a_value_that_verifies(tmp_path, server):
    """A write-through push and the queue's sweep may send the same version at the same moment (CI
    saw it: the server then held a value whose extent checksum failed, a miss for every node).  Each
    send stages its bytes under its own key (SPEC.md §14.3), so however the two interleave, the
    value the server holds verifies.  300 rounds of two sends of a 64 KiB record, the second
    started a random fraction of a send later (with one staging key shared, the second send's
    allocation zeroed the last byte of the first's staged value just before it was swapped in:
    the test failed in 3 runs of 3)."""
    import random
    import threading

    from tierstore.format import block as blk
    from tierstore.format import record as rec
    from tierstore.tiers.remote import RemoteTier, Version, check_fetched

    tier = RemoteTier(server.url, origin=os.urandom(16), timeout=30, connect_timeout=10)
    plain = redis.Redis(port=server.port)
    rng = random.Random(7)
    try:
        for stamp in range(1, 301):
            data = os.urandom(64 << 10)
            block = blk.encode_block(tierstore.Blob(data), None, vector_extent_bytes=1 << 20)
            version = Version(stamp, tier.origin)
            record = rec.encode_put(b"ns", b"k", fmt.FLAG_KEY_STR, block.kind,
                                    {**block.meta, fmt.META_VERSION: [stamp, tier.origin]}, block.extents,
                                    block.align_log2, block.codec)
            record = record._replace(header=record.header.stamped(stamp))  # as the log appended it
            start, results = threading.Barrier(2), []

            def send(delay: float, record=record, version=version, start=start, results=results) -> None:
                start.wait()
                time.sleep(delay)
                results.append(tier.push(record, version))

            threads = [threading.Thread(target=send, args=(d,)) for d in (0.0, rng.uniform(0, 0.002))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert sorted(results) == [1, 2]  # one swapped it in; the other found it there
            env, hdr = check_fetched(b"ns", b"k", plain.get(remote_key(b"ns", b"k")))  # every checksum
            assert env.version == version and hdr.extent_crcs == record.header.extent_crcs, stamp
        assert not [k for k in plain.keys(b"*") if b":w:" in k]  # no staged value left behind
    finally:
        tier.close()
        plain.close()


# -- refusals, clocks, handles beside (a cold review, 2026-12-03) ------------------------------------------

def test_a_value_the_server_refuses_is_dropped_not_retried_ahead_of_the_others(tmp_path):
    """A value larger than the server's proto-max-bulk-len is never sent (refused before any byte
    moves: no staging key, so nothing without an expiry), counted in ``refused``; the keys
    behind it in the write-back queue are sent.  Its twin, an object that fits, is sent."""
    s = RedisServer(tmp_path, "--proto-max-bulk-len", "1mb").start()
    try:
        a = node(tmp_path, "a", s.url, remote_policy="write-back")
        a.put(b"big", tierstore.KVCache(kv(1, layers=8, tokens=2048)), namespace="m")  # 2 MiB record
        for i in range(5):
            a.put(b"k%d" % i, tierstore.Blob(b"v%d" % i), namespace="m")
        wait_for(lambda: remote_of(a)["puts"] == 5 and remote_of(a)["queue_length"] == 0)
        assert remote_of(a)["refused"] == 1
        r = redis.Redis(port=s.port)
        assert not [k for k in r.keys(b"*") if b":w:" in k]  # no staging key left behind
        assert r.exists(remote_key(b"m", b"k4")) and not r.exists(remote_key(b"m", b"big"))
        assert a.get(b"big", namespace="m").data.shape == (8, 2, 2, 2048, 8)  # local, untouched
        a.close()
        b = node(tmp_path, "b", s.url, remote_policy="write-through")
        b.put(b"big", tierstore.KVCache(kv(1, layers=8, tokens=2048)), namespace="m")  # write-through too
        assert remote_of(b)["refused"] == 1 and not remote_of(b)["down"]
        b.close()
    finally:
        s.stop()


@pytest.mark.parametrize("policy", ["write-through", "write-back"])
def test_a_refusal_that_passes_is_retried_not_dropped(tmp_path, server, policy):
    """NOREPLICAS (like MISCONF or BUSY) refuses every write for a while: the sends are tried
    again once the server takes writes, so a delete is not undone by the server's older value
    and another node reads the newer put (a review found both dropped for good)."""
    r = redis.Redis(port=server.port)
    a = node(tmp_path, "a", server.url, remote_policy=policy)
    b = node(tmp_path, "b", server.url)
    a.put("doomed", tierstore.Blob(b"v1"))
    a.put("k", tierstore.Blob(b"v1"))
    wait_for(lambda: remote_of(a)["queue_length"] == 0 and remote_of(a)["puts"] == 2)
    r.config_set("min-replicas-to-write", 1)
    try:
        a.delete("doomed")
        a.put("k", tierstore.Blob(b"v2"))
        time.sleep(0.5)
    finally:
        r.config_set("min-replicas-to-write", 0)
    wait_for(lambda: remote_of(a)["queue_length"] == 0 and remote_of(a)["tombstones_pending"] == 0)
    assert remote_of(a)["refused"] == 0
    with pytest.raises(tierstore.NotFound):
        a.get("doomed")
    assert b.get("k").data == b"v2"
    with pytest.raises(tierstore.NotFound):
        b.get("doomed")
    a.close()
    b.close()


def test_a_sweep_goes_on_past_an_object_the_server_refuses(tmp_path):
    """A sweep (here a store's first open with a remote) meets an object larger than the server
    takes before others: it counts it and sends the rest (it stopped there, and retried the whole
    sweep every retry_s, for good)."""
    s = RedisServer(tmp_path, "--proto-max-bulk-len", "1mb").start()
    try:
        path = str(tmp_path / "a")
        crash = ("import os, sys, numpy as np, tierstore\n"
                 "s = tierstore.open(sys.argv[1], remote='redis://127.0.0.1:1/0', remote_policy='write-back',\n"
                 "                   remote_connect_timeout=0.2)\n"
                 "s.put(b'a', tierstore.KVCache(np.zeros((8, 2, 2, 2048, 8), np.float16)), namespace='m')\n"
                 "s.put(b'b', tierstore.Blob(b'small'), namespace='m')\n"
                 "os._exit(0)\n")  # nothing sent (no server there), then a crash: REMOTE says dirty
        subprocess.run([sys.executable, "-c", crash, path], check=True, timeout=120)
        a = tierstore.open(path, remote=s.url)  # a sweep of what the crash left unsent
        wait_for(lambda: redis.Redis(port=s.port).exists(remote_key(b"m", b"b")))
        wait_for(lambda: remote_of(a)["refused"] == 1)
        a.close()
    finally:
        s.stop()


def test_a_foreign_key_type_under_a_name_blocks_only_that_key(tmp_path, server):
    r = redis.Redis(port=server.port)
    r.rpush(remote_key(b"m", b"k0"), b"someone else's list")
    a = node(tmp_path, "a", server.url, remote_policy="write-back")
    for i in range(4):
        a.put(b"k%d" % i, tierstore.Blob(b"v%d" % i), namespace="m")
    wait_for(lambda: remote_of(a)["puts"] == 3 and remote_of(a)["queue_length"] == 0)
    assert remote_of(a)["refused"] == 1
    a.close()
    out = subprocess.run([sys.executable, "-m", "tierstore", "fsck", "--remote", server.url, "--json"],
                         capture_output=True, text=True, timeout=120)
    report = json.loads(out.stdout)
    assert out.returncode == 1 and len(report["damaged"]) == 1 and "WRONGTYPE" in report["damaged"][0]["why"]
    assert report["values"] == 3  # the others were checked


def test_a_stamp_far_in_the_future_is_a_damaged_value_not_a_clock(tmp_path, server):
    """A well-formed envelope with a stamp of 2^64-1 (crafted, or a clock gone wild) is a miss
    and moves no clock: later puts still work, across a reopen.  Its twin: a stamp an hour
    ahead (clock skew) is a value."""
    from tierstore.tiers.remote import CLOCK, Version, envelope, parse_envelope

    a = node(tmp_path, "a", server.url)
    a.put(b"k", tierstore.Blob(b"v"), namespace="m")
    r = redis.Redis(port=server.port)
    r.set(remote_key(b"m", b"evil"), envelope(Version((1 << 64) - 1, bytes(16)), 8) + bytes(8))
    assert not a.contains(b"evil", namespace="m")
    with pytest.raises(tierstore.NotFound):
        a.get(b"evil", namespace="m")
    a.put(b"k2", tierstore.Blob(b"v2"), namespace="m")
    a.close()
    a = node(tmp_path, "a", server.url)
    a.put(b"k3", tierstore.Blob(b"v3"), namespace="m")
    assert remote_of(a)["puts"] == 1
    a.put(b"evil", tierstore.Blob(b"mine"), namespace="m")  # the damaged value is replaced, whatever it says
    assert remote_of(a)["put_conflicts"] == 0
    r.set(remote_key(b"m", b"p"), envelope(Version((1 << 63) - 1, bytes(16)), 0, tombstone=True))
    assert not a.contains(b"p", namespace="m")  # a sound tombstone stamped 2262: read, not taken into the clock
    a.put(b"q", tierstore.Blob(b"q"), namespace="m")
    assert parse_envelope(r.get(remote_key(b"m", b"q"))).version.stamp < time.time_ns() + 60 * 10**9
    c = node(tmp_path, "c", server.url)
    assert c.get(b"q", namespace="m").data == b"q" and c.get(b"evil", namespace="m").data == b"mine"
    c.close()
    CLOCK.seen(time.time_ns() + 3600 * 10**9)  # a node whose clock runs an hour ahead: its values count
    a.put(b"k4", tierstore.Blob(b"v4"), namespace="m")
    a.close()
    assert parse_envelope(r.get(remote_key(b"m", b"k4"))).version.stamp > time.time_ns() + 3000 * 10**9
    b = node(tmp_path, "b", server.url)
    assert b.get(b"k4", namespace="m").data == b"v4"
    b.close()


def test_a_put_of_a_handle_beside_the_remote_handle_is_kept(tmp_path, server):
    """A handle without remote= on a store that another handle sends to a remote: its put is
    newer than the server's value, and the remote handle serves it (it used to fetch the
    server's older value and write it back over the put)."""
    a = node(tmp_path, "a", server.url)
    a.put(b"k", tierstore.Blob(b"old"), namespace="m")
    plain = tierstore.open(str(tmp_path / "a"))
    plain.put(b"k", tierstore.Blob(b"new"), namespace="m")
    assert a.get(b"k", namespace="m").data == b"new"
    assert plain.get(b"k", namespace="m").data == b"new"
    assert remote_of(a)["stale"] == 0
    plain.close()
    assert a.remote_sync()["sent"] == 1  # sent by the remote handle's sync
    b = node(tmp_path, "b", server.url)
    assert b.get(b"k", namespace="m").data == b"new"
    a.close()
    b.close()


def test_a_repeated_put_of_the_same_bytes_is_a_new_version_with_a_remote(tmp_path, server):
    """With a remote tier a put of bytes the store already holds (a second session's) is written
    as a new version: node B's delete or overwrite in between must not win over it (a review
    found the put lost when it was deduplicated into a reference only)."""
    a = node(tmp_path, "a", server.url)
    b = node(tmp_path, "b", server.url)
    chunk = tierstore.KVCache(kv(7))
    a.put(b"c", chunk, namespace="m", session="s1")
    assert b.contains(b"c", namespace="m")
    b.delete(b"c", namespace="m")
    a.put(b"c", chunk, namespace="m", session="s2")
    assert np.array_equal(a.get(b"c", namespace="m").data, kv(7))
    assert np.array_equal(b.get(b"c", namespace="m").data, kv(7))
    assert a.session_keys("s2", namespace="m") == [b"c"]
    b.put(b"d", tierstore.Blob(b"Y"), namespace="m")  # the overwrite case: A's X after B's Y
    a.put(b"d", tierstore.Blob(b"X"), namespace="m")
    b.put(b"d", tierstore.Blob(b"Y2"), namespace="m")
    a.put(b"d", tierstore.Blob(b"X"), namespace="m")
    assert a.get(b"d", namespace="m").data == b"X" and b.get(b"d", namespace="m").data == b"X"
    a.close()
    b.close()


def test_a_user_without_a_password_in_the_url_takes_it_from_the_environment(monkeypatch):
    monkeypatch.setenv("TIERSTORE_REMOTE_PASSWORD", "pw")
    t = parse_url("redis://alice@127.0.0.1:6379/0")
    assert (t.username, t.password) == ("alice", "pw")
    t = parse_url("redis://:other@127.0.0.1:6379/0")
    assert (t.username, t.password) == (None, "other")


def test_get_many_counts_misses_like_get(tmp_path, server):
    a = node(tmp_path, "a", server.url)
    assert a.get_many([b"x%d" % i for i in range(10)], namespace="m") == [None] * 10
    assert remote_of(a)["misses"] == 10
    with pytest.raises(tierstore.NotFound):
        a.get(b"y", namespace="m")
    assert remote_of(a)["misses"] == 11
    a.close()


def test_info_of_a_key_deleted_here_waits_for_no_tombstone(tmp_path, server):
    a = node(tmp_path, "a", server.url)
    b = node(tmp_path, "b", server.url, remote_policy="write-back")
    a.put(b"k", tierstore.Blob(b"v"), namespace="m")
    b._remote.queue._stopping = True  # (the sender sends nothing: the tombstone stays pending)
    b.delete(b"k", namespace="m")
    assert b._remote.queue.tombstone_of(b"m", b"k") is not None
    with pytest.raises(tierstore.NotFound):
        b.info(b"k", namespace="m")
    b._remote.queue._stopping = False
    a.close()
    b.close()


def test_crafted_stamps_do_not_ratchet_a_clock():
    """Each crafted stamp a day past the clock's last one was taken in when the bound was
    measured from the clock itself: 86,000 of them carried it to 2^63.  Measured from the wall
    clock, the second is ignored.  The store's own stamps (REMOTE) are taken in further."""
    from tierstore.tiers.remote import FUTURE_NS, Clock

    c = Clock()
    day = time.time_ns() + FUTURE_NS - 10**9
    c.seen(day)
    assert c.last == day
    c.seen(c.last + FUTURE_NS - 10**9)
    assert c.last == day
    c.seen(day + 5 * FUTURE_NS, own=True)  # a clock of this store that once ran five days fast
    assert c.last == day + 5 * FUTURE_NS


def test_a_node_whose_clock_ran_fast_still_wins_over_its_own_versions(tmp_path, server):
    """A node's clock ran two days fast, then was set right: its next puts must still outrank
    the versions it wrote before (REMOTE's pushed_to carries them across the reopen), and a
    delete it saved in REMOTE while the server was away is sent (a REMOTE whose pushed_to is
    out of range used to lose its tombstones)."""
    from tierstore.tiers.remote import CLOCK

    CLOCK.seen(time.time_ns() + 2 * 86_400 * 10**9, own=True)  # (the process clock: fast)
    a = node(tmp_path, "a", server.url)
    a.put(b"k", tierstore.Blob(b"old"), namespace="m")
    a.put(b"gone", tierstore.Blob(b"v"), namespace="m")
    a.close()
    CLOCK._last = time.time_ns()  # set right (what a new process with a correct clock has)
    a = node(tmp_path, "a", server.url)
    a.put(b"k", tierstore.Blob(b"new"), namespace="m")
    b = node(tmp_path, "b", server.url)
    assert a.get(b"k", namespace="m").data == b"new" and b.get(b"k", namespace="m").data == b"new"
    assert remote_of(a)["put_conflicts"] == 0
    a.close()
    state_path = tmp_path / "a" / fmt.REMOTE_FILE
    state = json.loads(state_path.read_text())
    stamp = time.time_ns() + 3 * 86_400 * 10**9  # above the server's version of "gone"
    state.update(pushed_to=(1 << 62) + 5, tombstones=[[b"m".hex(), b"gone".hex(), stamp, bytes(16).hex()]])
    state_path.write_text(json.dumps(state))
    a = node(tmp_path, "a", server.url)  # pushed_to out of range: set aside; the tombstone is kept
    wait_for(lambda: remote_of(a)["tombstones_pending"] == 0)
    with pytest.raises(tierstore.NotFound):
        b.get(b"gone", namespace="m")
    a.close()
    b.close()


def test_a_bad_tombstone_entry_in_remote_is_set_aside_and_the_others_are_sent(tmp_path, server, caplog):
    """A damaged REMOTE file: a tombstone whose stamp does not fit (the sender thread died on it,
    for good, and nothing behind it was sent) or a malformed one (the entries after it were
    dropped): each bad entry is set aside with a warning, the good ones are sent."""
    a = node(tmp_path, "a", server.url)
    for k in (b"g1", b"g2"):
        a.put(k, tierstore.Blob(b"v"), namespace="m")
    a.close()
    from tierstore.tiers.remote import CLOCK

    state_path = tmp_path / "a" / fmt.REMOTE_FILE
    state = json.loads(state_path.read_text())
    stamp = max(time.time_ns(), CLOCK.last) + 10**9  # above the puts' (the process clock may run ahead)
    state["tombstones"] = [[b"m".hex(), b"x".hex(), -1, bytes(16).hex()], ["zz"],
                           [b"m".hex(), b"g1".hex(), stamp, bytes(16).hex()],
                           [b"m".hex(), b"g2".hex(), stamp, bytes(16).hex()]]
    state_path.write_text(json.dumps(state))
    with caplog.at_level(logging.WARNING, logger="tierstore.remote"):
        a = node(tmp_path, "a", server.url)
        wait_for(lambda: remote_of(a)["tombstones_pending"] == 0)
    assert sum("set aside" in m for m in caplog.messages) == 2
    b = node(tmp_path, "b", server.url)
    for k in (b"g1", b"g2"):
        with pytest.raises(tierstore.NotFound):
            b.get(k, namespace="m")
    a.close()
    b.close()


_CLOCK_SCRIPT = """
import os, sys, time, tierstore
path, url, shift, end = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
real = time.time_ns
time.time_ns = lambda: real() + shift  # this machine's clock: fast, or set right
s = tierstore.open(path, remote=url, remote_timeout=10, remote_connect_timeout=10)
for op in sys.argv[5:]:
    verb, _, rest = op.partition(":")
    key, _, value = rest.partition("=")
    if verb == "del":
        s.delete(key.encode(), namespace="m")
    else:
        s.put(key.encode(), tierstore.Blob(value.encode()), namespace="m")
if end == "crash":
    os._exit(0)  # no close: REMOTE keeps what its last save said
s.close()
"""


@pytest.mark.parametrize("end", ["crash", "close"])
def test_a_clock_set_back_while_no_handle_ran_still_stamps_above_the_stores_versions(tmp_path, server, end):
    """A node's clock ran two hours fast; it wrote (and deleted) keys and stopped -- crashed, or
    closed -- and its clock was set right before it ran again.  Its next puts must outrank the
    versions it wrote before: STAMPS holds a reservation above every stamp it issued.  (Before
    it, after a crash the new puts lost to the node's own older versions and tombstones on the
    server: the node read back its old value, and a key put again after a delete was missing.)"""
    def run(shift: int, *ops: str) -> None:
        out = subprocess.run([sys.executable, "-c", _CLOCK_SCRIPT, str(tmp_path / "a"), server.url, str(shift), end,
                              *ops], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr

    run(2 * 3600 * 10**9, "put:k=old", "put:g=old", "del:g")
    run(0, "put:k=new", "put:g=new")
    a, b = node(tmp_path, "a", server.url), node(tmp_path, "b", server.url)
    try:
        assert b.get(b"k", namespace="m").data == b"new"
        assert b.get(b"g", namespace="m").data == b"new"
        assert a.get(b"k", namespace="m").data == b"new" and a.get(b"g", namespace="m").data == b"new"
    finally:
        a.close()
        b.close()


def test_stamps_keeps_its_reservation_through_a_torn_slot_and_does_not_drift(tmp_path):
    """STAMPS (SPEC.md §14.6): each reservation goes to the slot not holding the valid one, so a
    damaged slot leaves the other; a file with no valid slot is a warning, not a failure.  A
    handle whose clock is below the largest stamp that reserved (set back) takes the reservation
    in; one reopened at once, or later, does not."""
    from tierstore.tiers.remote import RESERVE_AHEAD_NS, Clock, Stamps, _best_slot

    path = str(tmp_path / fmt.STAMPS_FILE)
    clock = Clock()
    stamps = Stamps(path, clock)
    first = stamps.next()
    data = Path(path).read_bytes()
    assert len(data) == fmt.STAMPS_SLOT.size  # one slot so far
    reserved, stamp = _best_slot(data)[1:]
    assert stamp == first and first + RESERVE_AHEAD_NS <= reserved < first + 2 * RESERVE_AHEAD_NS
    second = stamps.next()  # within the reservation: no write
    assert Path(path).read_bytes() == data
    stamps.reserved = 0  # (as if a second passed) the next stamp reserves again, in slot 1
    third = stamps.next()
    data = Path(path).read_bytes()
    assert len(data) == 2 * fmt.STAMPS_SLOT.size and _best_slot(data)[0] == 1
    assert first < second < third

    again = Clock()  # reopened at once, the clock not set back: nothing taken in (a live handle's
    Stamps(path, again)  # reservation is always a second ahead: taking it in stamped ahead of it)
    assert again.last == 0
    torn = bytearray(data)
    torn[fmt.STAMPS_SLOT.size + 3] ^= 0xFF  # slot 1 (the newest) damaged: slot 0 still counts
    Path(path).write_bytes(bytes(torn))
    future = time.time_ns() + 3600 * 10**9
    with open(path, "r+b") as f:  # slot 0 says stamps up to an hour ahead were issued
        body = fmt.STAMPS_SLOT.pack(future + RESERVE_AHEAD_NS, future, 0, 0)[:16]
        f.write(body + tierstore.format.record.crc32c(body).to_bytes(4, "little") + bytes(4))
    set_back = Clock()
    s2 = Stamps(path, set_back)
    assert set_back.last == future + RESERVE_AHEAD_NS and s2.next() > future + RESERVE_AHEAD_NS
    assert _best_slot(Path(path).read_bytes())[0] == 1  # the new reservation replaced the damaged slot
    # stamps an hour ahead of the wall clock: the next reservation is a millisecond past them
    assert _best_slot(Path(path).read_bytes())[1] < future + RESERVE_AHEAD_NS + 2 * 10**6

    Path(path).write_bytes(b"\xff" * 48)  # no valid slot: stamps go on (a warning), and reserve afresh
    fresh = Clock()
    s3 = Stamps(path, fresh)
    assert fresh.last == 0
    stamp = s3.next()
    assert _best_slot(Path(path).read_bytes())[2] == stamp
    late = Clock()  # a reservation the wall clock has passed: nothing taken in
    Path(path).write_bytes(b"")
    with open(path, "r+b") as f:
        body = fmt.STAMPS_SLOT.pack(10**18, 10**18 - 5, 0, 0)[:16]  # (2001)
        f.write(body + tierstore.format.record.crc32c(body).to_bytes(4, "little") + bytes(4))
    Stamps(path, late)
    assert late.last == 0


def test_a_delete_whose_stamp_cannot_be_reserved_still_reaches_the_server(tmp_path, server, monkeypatch):
    """The delete is durable locally before its tombstone is stamped: when STAMPS cannot be
    synced then (a disk error), the delete raised StoreIOError, no tombstone was sent, and the
    value came back from the server on the next read (a review, 2026-12-03).  Now the tombstone
    goes with a stamp not reserved (a warning), and the delete holds everywhere."""
    import errno

    import tierstore.tiers.remote as remote_mod

    a, b = node(tmp_path, "a", server.url), node(tmp_path, "b", server.url)
    try:
        a.put(b"k", tierstore.Blob(b"v1"), namespace="m")
        assert b.get(b"k", namespace="m").data == b"v1"

        def failing(fd):
            raise OSError(errno.EIO, "Input/output error")

        import types

        fake_os = types.SimpleNamespace(**{n: getattr(os, n) for n in dir(os) if not n.startswith("__")})
        fake_os.fdatasync = failing  # (the remote module's os alone: the log syncs as before)
        monkeypatch.setattr(remote_mod, "os", fake_os)
        a._remote.stamps.reserved = 0  # (as a second later: the next stamp reserves)
        assert a.delete(b"k", namespace="m")
        monkeypatch.undo()
        for n in (a, b):
            with pytest.raises(tierstore.NotFound):
                n.get(b"k", namespace="m")
    finally:
        a.close()
        b.close()


def test_stamps_ahead_of_the_wall_clock_do_not_drift_further_at_each_reopen(tmp_path, server):
    """A store whose stamps ran a minute ahead (a fast clock, or another node's stamp taken in):
    every reopen took in the reservation, a second above them, and its first put reserved a
    second above that -- 20 reopens moved the stamps 20 s further ahead while the wall clock moved
    14 s (a review, 2026-12-03).  A clean close records the last stamp issued; a reopen after one
    takes that in, not the reservation."""
    from tierstore.tiers.remote import _best_slot

    def run(shift: int) -> tuple[int, int, int]:
        out = subprocess.run([sys.executable, "-c", _CLOCK_SCRIPT, str(tmp_path / "a"), server.url, str(shift),
                              "close", "put:k=v"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return _best_slot((tmp_path / "a" / fmt.STAMPS_FILE).read_bytes())

    run(60 * 10**9)
    first = run(0)
    for _ in range(4):
        last = run(0)
    assert last[2] - first[2] < 10**9 // 10, (last, first)  # (each reopen: a nanosecond, not a second)


# -- a fleet operator's review (2026-12-03) ------------------------------------------------------------------

def test_a_value_whose_envelope_is_damaged_is_replaced_by_the_next_put(tmp_path, server):
    """A flipped stamp byte (0x18 -> 0x38: a stamp in the year 2099, the envelope's CRC broken)
    reads as no value, but the compare-and-set still went by its stamp: every node's later put
    of the key was refused, and remote_sync counted it present, until 2099.  A damaged envelope
    is no version now.  Twin: an intact newer value still wins over an older put."""
    a, c = node(tmp_path, "a", server.url), node(tmp_path, "c", server.url)
    a.put(b"k1", tierstore.Blob(b"one"), namespace="m")
    r = redis.Redis(port=server.port)
    name = remote_key(b"m", b"k1")
    r.setrange(name, 8, bytes([r.getrange(name, 8, 8)[0] ^ 0x20]))
    with pytest.raises(tierstore.NotFound):
        c.get(b"k1", namespace="m")  # a miss, never data
    a.put(b"k1", tierstore.Blob(b"two"), namespace="m")
    assert remote_of(a)["put_conflicts"] == 0
    assert c.get(b"k1", namespace="m").data == b"two"
    r.setrange(name, 8, bytes([r.getrange(name, 8, 8)[0] ^ 0x20]))  # damaged again: remote_sync replaces it
    assert a.remote_sync(namespace="m")["sent"] == 1
    d = node(tmp_path, "d", server.url)
    assert d.get(b"k1", namespace="m").data == b"two"
    c.put(b"k1", tierstore.Blob(b"three"), namespace="m")  # the twin: newer wins, and stays
    from tierstore.tiers.remote import Version

    loc = a._engine.lookup(b"m", b"k1")
    from tierstore.format import record as rec

    assert a._remote.push(rec.EncodedRecord(loc.header, ()), Version(1, bytes(16))) == 0  # older: refused
    assert d.get(b"k1", namespace="m").data == b"three"
    # an envelope with a valid CRC but an unknown flag (no reader takes it) is no version either
    from tierstore.tiers.remote import envelope

    env = bytearray(envelope(Version(1 << 62, bytes(16)), 0))
    env[5] = 0x80
    env[44:48] = rec.crc32c(bytes(env[:44])).to_bytes(4, "big")
    r.set(name, bytes(env))
    a.put(b"k1", tierstore.Blob(b"four"), namespace="m")
    assert d.get(b"k1", namespace="m").data == b"four"
    for s_ in (a, c, d):
        s_.close()


def test_a_repeated_send_is_not_a_conflict(tmp_path, server):
    """put_conflicts ("the server held a newer version") also counted sends of the version the
    server already held (a re-send after a timeout, a restart or a sweep)."""
    a = node(tmp_path, "a", server.url)
    a.put(b"k", tierstore.Blob(b"v"), namespace="m")
    from tierstore.format import record as rec
    from tierstore.tiers.remote import version_of

    loc = a._engine.lookup(b"m", b"k")
    record = rec.EncodedRecord(loc.header, (memoryview(a.get(b"k", namespace="m").data),))
    assert a._remote.push(record, version_of(loc.header)) == 2
    st = remote_of(a)
    assert st["put_repeats"] == 1 and st["put_conflicts"] == 0 and st["puts"] == 1
    a.close()


def test_remote_sync_sends_the_deletes_not_yet_sent_and_says_when_the_server_is_down(tmp_path):
    """remote-sync counted objects only: with deletes kept in REMOTE (the server down when they
    were made) it said "0 sent" and exited 0 whether or not they reached the server, and exited
    0 for an empty store beside a dead server (docs: 3)."""
    from tierstore.cli import main

    server = RedisServer(tmp_path).start()
    path = str(tmp_path / "a")
    try:
        with node(tmp_path, "a", server.url) as a:
            a.put(b"x", tierstore.Blob(b"1"), namespace="m")
            a.put(b"y", tierstore.Blob(b"2"), namespace="m")
            server.kill()
            a.delete(b"x", namespace="m")
            a.delete(b"y", namespace="m")
            assert remote_of(a)["tombstones_pending"] == 2
        assert main(["remote-sync", path, "--remote", server.url]) == 3  # down: nothing was sent
        server = RedisServer(tmp_path, port=server.port).start()
        assert main(["remote-sync", path, "--remote", server.url, "--json"]) == 0
        r = redis.Redis(port=server.port)  # (restarted empty: the tombstones are there now, none left to send)
        assert all(r.get(remote_key(b"m", k))[5] & fmt.REMOTE_FLAG_TOMBSTONE for k in (b"x", b"y"))
        with node(tmp_path, "a", server.url) as a:
            assert remote_of(a)["tombstones_pending"] == 0
        with node(tmp_path, "a", server.url) as a:  # a delete the server refuses (another type under the
            from tierstore.tiers.remote import Version  # name) is counted as refused, not lost from the counts

            r.rpush(remote_key(b"m", b"z"), b"a list")
            a._remote.queue._tombs[(b"m", b"z")] = Version(a._remote.next_stamp(), a._remote.origin)
            counts = a.remote_sync()
            assert counts["refused"] == 1 and counts["tombstones"] == 0
        empty = str(tmp_path / "empty")
        tierstore.open(empty).close()
        server.kill()
        assert main(["remote-sync", empty, "--remote", server.url]) == 3
    finally:
        server.stop()


# -- fetching in pieces ----------------------------------------------------------------------------------

def test_fetch_plan_joins_neighbours_and_cuts_long_spans():
    from tierstore.tiers.remote import fetch_plan, gather

    assert fetch_plan([(48, 100), (104, 200)], 0, 1000) == [(48, 200)]  # joined across the padding
    assert fetch_plan([(48, 100), (104, 200)], 120, 1000) == [(120, 200)]  # the head holds the rest
    assert fetch_plan([(0, 2500)], 0, 1000) == [(0, 1000), (1000, 2000), (2000, 2500)]
    assert fetch_plan([(0, 600), (600, 1200)], 0, 1000) == [(0, 600), (600, 1200)]  # each whole
    assert fetch_plan([(0, 10)], 10, 1000) == []
    bufs = [(0, memoryview(b"abcd")), (4, memoryview(b"efgh")), (8, memoryview(b"ij"))]
    assert bytes(gather(bufs, 1, 3)) == b"bc"  # one buffer: a view
    got = gather(bufs, 2, 9)
    assert got.tobytes() == b"cdefghi" and got.nbytes == 7
    assert gather(bufs, 8, 12).nbytes == 2  # the value ended first: short, the caller's check fails


@pytest.mark.parametrize("where", ["server", "cluster"])
def test_a_value_larger_than_a_piece_is_fetched_in_pieces(tmp_path, where, request, monkeypatch):
    from tierstore.tiers import remote as remote_mod

    monkeypatch.setattr(remote_mod, "FETCH_PIECE", 1000)  # extents cut across pieces and joined
    url = request.getfixturevalue(where).url
    a, b = node(tmp_path, "a", url), node(tmp_path, "b", url)
    x = kv(1, layers=4, tokens=40)  # 4 layers of 2,560 bytes
    blob = np.random.default_rng(2).bytes(10_000)
    a.put(b"chunk", tierstore.KVCache(x), namespace="m")
    a.put(b"blob", tierstore.Blob(blob), namespace="m")
    size = fmt.REMOTE_ENVELOPE.size + a.info(b"chunk", namespace="m").stored_bytes
    assert np.array_equal(b.get(b"chunk", namespace="m", layers=2).data, x[2:3])
    assert np.array_equal(b.get(b"chunk", namespace="m").data, x)
    assert b.get(b"blob", namespace="m").data == blob
    assert remote_of(b)["hits"] == 3 and remote_of(b)["bad_values"] == 0
    c = node(tmp_path, "c", url)
    c.get(b"chunk", namespace="m")
    assert x.nbytes < remote_of(c)["bytes_in"] <= size + 2 * fmt.REMOTE_ENVELOPE.size  # (and the envelope twice)
    r = redis.Redis(port=request.getfixturevalue(where).nodes[0].port) if where == "cluster" else None
    if r is None:  # a padded and a truncated value are misses, as a whole GET found them
        r = redis.Redis(port=request.getfixturevalue(where).port)
        name = remote_key(b"m", b"blob")
        r.append(name, b"\0" * 5)
        with pytest.raises(tierstore.NotFound):
            c.get(b"blob", namespace="m")
        r.set(name, r.get(name)[:-3005])
        with pytest.raises(tierstore.NotFound):
            c.get(b"blob", namespace="m")
        assert remote_of(c)["bad_values"] == 2
    a.close()
    b.close()
    c.close()


@pytest.mark.parametrize("layers", [None, 2])
def test_a_value_replaced_between_the_reads_of_a_fetch_is_read_again(tmp_path, server, layers, monkeypatch,
                                                                     caplog):
    from tierstore.tiers import remote as remote_mod

    monkeypatch.setattr(remote_mod, "FETCH_PIECE", 1000)
    a, b = node(tmp_path, "a", server.url), node(tmp_path, "b", server.url)
    a.put(b"k", tierstore.KVCache(kv(1, tokens=40)), namespace="m")
    client = b._remote.client
    getrange, replaced = client.getrange, []

    def first_read_then_replace(*args, **kwargs):  # between the head and the rest: another node's put
        out = getrange(*args, **kwargs)
        if not replaced:
            replaced.append(True)
            a.put(b"k", tierstore.KVCache(kv(2, tokens=40)), namespace="m")
        return out

    monkeypatch.setattr(client, "getrange", first_read_then_replace)
    with caplog.at_level(logging.WARNING, logger="tierstore.remote"):
        got = b.get(b"k", namespace="m", layers=layers)
    assert replaced
    assert np.array_equal(got.data, kv(2, tokens=40) if layers is None else kv(2, tokens=40)[2:3])
    assert remote_of(b)["bad_values"] == 0 and not [m for m in caplog.messages if "damaged" in m]
    a.close()
    b.close()


def test_a_fetch_in_pieces_follows_a_slot_moving_between_cluster_masters(tmp_path, cluster):
    """Resharding: reads while the slot migrates (ASK redirects) and across its handover between a
    fetch's two round trips (MOVED).  (redis-py's cluster MULTI follows neither: such reads failed
    and marked the remote down.)"""
    a = node(tmp_path, "a", cluster.url)
    data = np.random.default_rng(0).bytes(3 << 20)
    x = kv(1, tokens=64)
    a.put(b"k", tierstore.Blob(data), namespace="m")  # 3 MiB: a first read, then the pieces
    a.put(b"k", tierstore.KVCache(x), namespace="kv")  # (one slot: the hash tag is the key)
    names = [remote_key(b"m", b"k"), remote_key(b"kv", b"k")]
    nodes = [redis.Redis(port=n.port) for n in cluster.nodes]
    ids = [r.execute_command("CLUSTER", "MYID").decode() for r in nodes]
    slot = redis.RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port).keyslot(names[0])
    src = next(i for i, r in enumerate(nodes) if r.cluster("countkeysinslot", slot) > 0)
    dst = (src + 1) % len(nodes)
    b, c = node(tmp_path, "b", cluster.url), node(tmp_path, "c", cluster.url)
    for s in (b, c):
        assert not s.contains(b"absent", namespace="m")  # connected: its slot map says src holds the slot

    def migrate() -> None:
        nodes[dst].execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[src])
        nodes[src].execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[dst])
        nodes[src].execute_command("MIGRATE", "127.0.0.1", cluster.nodes[dst].port, "", 0, 5000, "KEYS", *names)

    migrate()  # keys moved, the slot still migrating: ASK
    assert b.get(b"k", namespace="m").data == data
    assert np.array_equal(b.get(b"k", namespace="kv", layers=1).data, x[1:2])
    for r in nodes:
        r.execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[dst])
    assert b.get(b"k", namespace="m").data == data  # (b keeps a copy now: read here, from its log)
    st = remote_of(b)
    assert st["errors"] == 0 and not st["down"] and st["bad_values"] == 0

    src, dst = dst, (dst + 1) % len(nodes)  # and back, between c's two round trips
    client = c._remote.client
    getrange, moved = client.getrange, []

    def first_read_then_hand_over(*args, **kwargs):
        out = getrange(*args, **kwargs)
        if not moved:
            moved.append(True)
            migrate()
            for r in nodes:
                r.execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[dst])
        return out

    client.getrange = first_read_then_hand_over
    assert c.get(b"k", namespace="m").data == data
    st = remote_of(c)
    assert moved and st["errors"] == 0 and not st["down"] and st["hits"] == 1
    for s in (a, b, c):
        s.close()


@pytest.mark.parametrize("where", ["server", "cluster"])
def test_fsck_remote_reads_values_in_pipelines(tmp_path, where, request, monkeypatch):
    from tierstore.tiers import remote as remote_mod
    from tierstore.tiers.remote import RemoteTier

    monkeypatch.setattr(remote_mod, "VERIFY_BATCH", 64)
    monkeypatch.setattr(remote_mod, "VERIFY_BATCH_BYTES", 20_000)
    url = request.getfixturevalue(where).url
    a = node(tmp_path, "a", url)
    a.put_many([(b"b%03d" % i, tierstore.Blob(b"v%d" % i * 20)) for i in range(200)], namespace="m")
    for i in range(3):
        a.put(b"chunk%d" % i, tierstore.KVCache(kv(i, tokens=40)), namespace="m")
    a.delete(b"b000", namespace="m")
    tier = RemoteTier(url, origin=bytes(16), policy="read-only")
    pipelines, gets = [], []
    pipeline, get = tier.client.pipeline, tier.client.get
    monkeypatch.setattr(tier.client, "pipeline", lambda *args, **kw: pipelines.append(1) or pipeline(*args, **kw))
    monkeypatch.setattr(tier.client, "get", lambda *args, **kw: gets.append(args) or get(*args, **kw))  # (none)
    report = tier.verify()
    assert (report["values"], report["tombstones"], report["damaged"], report["ok"]) == (202, 1, [], True)
    # 204 values: 4 batches of names, each a pipeline of lengths and one of GETs, plus at most two
    # more per chunk (a pipeline holds at most 20,000 bytes of values: a ~19 KB chunk and the
    # blobs after it do not share one) -- not a round trip per value
    assert len(pipelines) <= 4 * 2 + 3 * 2 and not gets
    sizes = [fmt.REMOTE_ENVELOPE.size + a.info(k, namespace="m").stored_bytes
             for k in [*(b"b%03d" % i for i in range(1, 200)), b"chunk0", b"chunk1", b"chunk2"]]
    assert report["bytes"] == sum(sizes) + fmt.REMOTE_ENVELOPE.size

    # damaged: a blob's last byte, a chunk's middle byte, a foreign type under the layout's name
    servers = request.getfixturevalue(where)
    r = redis.RedisCluster(host="127.0.0.1", port=servers.nodes[0].port) if where == "cluster" else \
        redis.Redis(port=servers.port)
    for k, at in ((b"b007", -1), (b"chunk1", -1500)):  # (in an extent: not the padding before it)
        name = remote_key(b"m", k)
        value = r.get(name)
        at %= len(value)
        r.setrange(name, at, bytes([value[at] ^ 1]))
    r.delete(remote_key(b"m", b"b008"))
    r.rpush(remote_key(b"m", b"b008"), b"x")
    r.set(remote_key(b"m", b"b009"), b"")  # (STRLEN 0, as for a key gone since the scan: read, and damaged)
    report = tier.verify()
    assert not report["ok"] and report["values"] == 198, report["damaged"]
    assert sorted(d["key"] for d in report["damaged"]) == sorted(
        remote_key(b"m", k).decode() for k in (b"b007", b"b008", b"b009", b"chunk1"))
    assert any("refused" in d["why"] and "WRONGTYPE" in d["why"] for d in report["damaged"])
    tier.close(0)
    a.close()


@pytest.mark.parametrize("where", ["server", "cluster"])
def test_fsck_remote_raises_remote_down_when_a_server_stops_answering_during_it(tmp_path, where, request,
                                                                               monkeypatch):
    from tierstore.tiers import remote as remote_mod
    from tierstore.tiers.remote import RemoteDown, RemoteTier

    monkeypatch.setattr(remote_mod, "VERIFY_BATCH", 32)
    servers = request.getfixturevalue(where)
    a = node(tmp_path, "a", servers.url)
    a.put_many([(b"b%03d" % i, tierstore.Blob(b"v%d" % i * 200)) for i in range(300)], namespace="m")
    a.close()
    tier = RemoteTier(servers.url, origin=bytes(16), policy="read-only", timeout=0.3, connect_timeout=0.3)
    paused = servers.nodes[1] if where == "cluster" else servers
    seen = []

    def progress(n):  # a server (of a cluster: one master) stops answering part-way
        seen.append(n)
        if len(seen) == 5:
            paused.pause()

    try:  # (a cluster pipeline keeps a node's timeout as that command's answer: not a size, not a value)
        with pytest.raises(RemoteDown):
            tier.verify(progress=progress)
    finally:
        paused.resume()
        tier.close(0)


def test_fsck_remote_without_permission_to_read_every_key_is_remote_down_not_damage(tmp_path, server):
    from tierstore.tiers.remote import RemoteDown, RemoteTier

    a = node(tmp_path, "a", server.url)
    for ns in ("m", "n"):
        a.put_many([(b"b%d" % i, tierstore.Blob(b"v")) for i in range(3)], namespace=ns)
    a.close()
    prefix = remote_key(b"m", b"").decode()[:-3]  # an ACL user that may read namespace m's keys only
    redis.Redis(port=server.port).execute_command("ACL", "SETUSER", "ro", "on", ">pw", f"~{prefix}*", "+@read",
                                                  "+@connection")
    tier = RemoteTier(f"redis://ro:pw@127.0.0.1:{server.port}/0", origin=bytes(16), policy="read-only")
    with pytest.raises(RemoteDown, match="no permissions"):  # (not keys to delete: they are sound)
        tier.verify()
    tier.close(0)
    tier = RemoteTier(f"redis://ro:pw@127.0.0.1:{server.port}/0", origin=bytes(16), policy="read-only")
    assert tier.verify(b"m")["values"] == 3  # the twin: what it may read is checked
    tier.close(0)


def test_layers_streamed_from_the_server_count_one_read(tmp_path, server):
    """stream_layers of an object only the server holds: one get, its layers' bytes once, one
    trace line (each layer counted as a get of the whole record, then the call once more: 5
    gets, the bytes twice, 5 trace lines -- a cold review)."""
    x = kv(0)
    a = node(tmp_path, "a", server.url)
    b = node(tmp_path, "b", server.url, trace_to=str(tmp_path / "b.jsonl"))
    try:
        a.put(b"h", tierstore.KVCache(x), namespace="m")
        a.flush()
        before = dict(b.stats()["counters"])
        got = [layer for _, layer in b.stream_layers(b"h", namespace="m")]
        after = b.stats()["counters"]
        assert np.array_equal(np.stack([np.asarray(g) for g in got]), x)
        assert after["gets"] - before["gets"] == 1 and after["bytes_read"] - before["bytes_read"] == x.nbytes
    finally:
        b.close()
        a.close()
    with open(tmp_path / "b.jsonl") as f:
        assert sum('"op":"get"' in line for line in f) == 1
