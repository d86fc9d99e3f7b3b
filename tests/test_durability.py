"""The commit protocol under crashes: simulated power loss at every persistence point, and
real SIGKILLs of a writer process.

Oracle for every crash state: the store opens; every acknowledged operation is present and
bit-exact; no acknowledged delete reappears; nothing never written is visible; the
recovered state is the state after a prefix of the operations; fsck is clean; an index
rebuilt from the segments alone agrees with the recovered one.
"""

from __future__ import annotations

import os
import random
import select
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

import tierstore
from tierstore import Blob
from tierstore.engine import repair
from tierstore.engine.fileio import DEFAULT_IO

from .conftest import checked_state, open_files
from .faultfs import FaultFS


def value(key: str, version: int) -> bytes:
    rnd = random.Random(f"{key}/{version}")
    size = rnd.choice([0, 10, 300, 4095, 4096, 9000])
    return bytes(rnd.getrandbits(8) for _ in range(size))


def make_ops(seed: int, n: int) -> list[tuple]:
    rnd = random.Random(seed)
    ops: list[tuple] = []
    for i in range(n):
        r = rnd.random()
        key = f"k{rnd.randrange(6)}"
        if r < 0.65:
            ops.append(("put", key, i))
        elif r < 0.85:
            ops.append(("delete", key, i))
        else:
            ops.append(("compact", None, i))
    return ops


def apply_model(model: dict, op: tuple) -> None:
    kind, key, version = op
    if kind == "put":
        model[key] = value(key, version)
    elif kind == "delete":
        model.pop(key, None)


def check_image(path: str, ops: list[tuple], acked: int, flushed: int) -> None:
    """The recovered state must equal the model after some prefix m of ops, flushed <= m <= acked+1."""
    state = checked_state(path)
    model: dict = {}
    candidates = []
    for m in range(len(ops) + 1):
        if m >= flushed and dict(model) == state:
            candidates.append(m)
        if m < len(ops):
            apply_model(model, ops[m])
    assert candidates, f"state {sorted(state)} is no prefix of the operations (acked {acked}, durable {flushed})"
    assert any(m <= acked + 1 for m in candidates), (candidates, acked)
    assert checked_state(path) == state  # recovering twice gives the same state
    shutil.rmtree(os.path.join(path, "index"))
    assert checked_state(path) == state  # the index rebuilt from segments agrees


@pytest.mark.parametrize("durability,seed", [("sync", 1), ("sync", 2), ("group", 3), ("none", 4)])
def test_power_loss_at_every_persistence_point(tmp_path, durability, seed):
    root = str(tmp_path / "store")
    os.makedirs(root)
    io = FaultFS(root)
    ops = make_ops(seed, 24)
    images: list[tuple[str, int, int]] = []
    progress = {"acked": 0, "durable": 0}

    def persist(what: str) -> None:
        d = str(tmp_path / f"img{len(images)}")
        io.image(d)
        images.append((d, progress["acked"], progress["durable"]))

    io.on_persist = persist
    s = tierstore.open(root, durability=durability, _io=io, segment_bytes="64KiB", index_commit_ms=0.0)
    io.index_env = s._engine.index.env
    for i, op in enumerate(ops):
        kind, key, version = op
        if kind == "put":
            s.put(key, Blob(value(key, version)))
        elif kind == "delete":
            s.delete(key)
        else:
            s.compact()
        progress["acked"] = i + 1
        if durability == "sync" or kind == "compact" or i % 5 == 4:
            if durability != "sync" and kind != "compact":
                s.flush()
            progress["durable"] = i + 1
    s.close()
    io.on_persist = None
    assert len(images) > 20
    for d, acked, durable in images:
        check_image(d, ops, acked, durable)


def _writer(path: str, wfd: int, round_: int) -> None:
    """The child: two writer threads (puts, deletes; thread 0 also compacts) and an ack pipe.
    Each thread owns its keys, so the order of one key's operations is known."""
    store = tierstore.open(path, durability="sync", segment_bytes="256KiB", lock_timeout=5)
    os.write(wfd, b"ready\n")

    def emit(line: str) -> None:
        os.write(wfd, (line + "\n").encode())  # one write under PIPE_BUF: atomic

    def work(t: int) -> None:
        rnd = random.Random(round_ * 100 + t)
        for i in range(10**9):
            key = f"t{t}-{rnd.randrange(8)}"
            r = rnd.random()
            if t == 0 and r < 0.03:
                store.compact()
            elif r < 0.8:
                emit(f"begin put {key} {round_} {i}")
                store.put(key, Blob(_kill_value(key, round_, i)))
                emit(f"ack put {key} {round_} {i}")
            else:
                emit(f"begin del {key} {round_} {i}")
                store.delete(key)
                emit(f"ack del {key} {round_} {i}")

    threads = [threading.Thread(target=work, args=(t,), daemon=True) for t in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()


def _kill_value(key: str, round_: int, i: int) -> bytes:
    return f"{key}/{round_}/{i}|".encode() * (1 + (i * 37) % 500)


READY_S = 60.0  # how long a forked writer may take to open the store


def _run_and_kill(writer, path: str, round_: int, rnd: random.Random) -> list[str]:
    """Fork ``writer(path, pipe_fd, round_)``, SIGKILL it after a random moment, and return the
    lines it wrote to the pipe (the last one possibly cut).  The moment counts from the writer's
    ``ready`` line (the store is open), except in every eighth round, which kills it at a moment
    counted from the fork (during its open, often): on a busy host an open can take longer than
    any moment drawn, and the rounds would then test nothing but opens."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        try:
            writer(path, w, round_)
        finally:
            os._exit(0)
    os.close(w)
    chunks = []
    if round_ % 8:
        deadline = time.monotonic() + READY_S
        while b"ready\n" not in b"".join(chunks):
            left = deadline - time.monotonic()
            ready = left > 0 and select.select([r], [], [], left)[0]
            assert ready, f"round {round_}: the writer did not open the store in {READY_S} s"
            data = os.read(r, 1 << 16)
            assert data, f"round {round_}: the writer exited before it opened the store"
            chunks.append(data)
    time.sleep(rnd.uniform(0.005, 0.12))
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    while data := os.read(r, 1 << 16):
        chunks.append(data)
    os.close(r)
    return b"".join(chunks).decode().splitlines()


def test_sigkill_writer_loses_nothing_acknowledged(tmp_path):
    """Hundreds of SIGKILLs at random moments (TIERSTORE_KILLS, default 200): after each, every
    acknowledged put and delete holds, in-flight ones landed entirely or not at all, and fsck
    is clean.  Writers are forked from this process, which holds no open store while forking."""
    path = str(tmp_path / "store")
    kills = int(os.environ.get("TIERSTORE_KILLS", "200"))
    must: dict[str, bytes | None] = {}
    rnd = random.Random(7)
    landed_inflight = 0
    for round_ in range(kills):
        inflight: dict[str, bytes | None] = {}
        for line in _run_and_kill(_writer, path, round_, rnd):
            parts = line.split()
            if len(parts) != 5:
                continue  # the kill cut the last line
            phase, kind, key, rnd_, i = parts[0], parts[1], parts[2], int(parts[3]), int(parts[4])
            value = _kill_value(key, rnd_, i) if kind == "put" else None
            if phase == "begin":
                inflight[key] = value
            else:
                inflight.pop(key, None)
                must[key] = value
        with tierstore.open(path) as s:
            for key in set(must) | set(inflight):
                got = s.get(key).data if s.contains(key) else None
                allowed = {must.get(key)} | ({inflight[key]} if key in inflight else set())
                assert got in allowed, (round_, key)
                if key in inflight and got == inflight[key] and got != must.get(key):
                    landed_inflight += 1
                must[key] = got  # an in-flight op that landed is now the truth
            assert set(s.keys()) <= set(must)
            report = repair.check_store(DEFAULT_IO, path, s._engine.index, deep=True)
            assert report.ok, report.as_dict()
    assert len(must) >= 10
    print(f"\nkills: {kills}, keys tracked: {len(must)}, in-flight operations that landed: {landed_inflight}")


def _chunk(key: str) -> bytes:
    return f"{key}|".encode() * (50 + 997 * int(key[1:]))  # one content per key: repeat puts dedup


def _session_writer(path: str, wfd: int, round_: int) -> None:
    """The child: one thread of session puts, drops, deletes and compactions, acked on a pipe."""
    store = tierstore.open(path, durability="sync", segment_bytes="256KiB", lock_timeout=5)
    os.write(wfd, b"ready\n")
    rnd = random.Random(round_)
    for _ in range(10**9):
        key, sess, r = f"c{rnd.randrange(6)}", f"s{rnd.randrange(4)}", rnd.random()
        op = ("put", key, sess) if r < 0.6 else ("drop", "-", sess) if r < 0.8 else \
            ("del", key, "-") if r < 0.95 else ("compact", "-", "-")
        os.write(wfd, f"begin {' '.join(op)}\n".encode())
        if op[0] == "put":
            store.put(key, Blob(_chunk(key)), session=sess)
        elif op[0] == "drop":
            store.drop_session(sess)
        elif op[0] == "del":
            store.delete(key)
        else:
            store.compact()
        os.write(wfd, f"ack {' '.join(op)}\n".encode())


def _session_model(model: dict[str, set[str]], op: tuple[str, str, str]) -> dict[str, set[str]]:
    """key -> sessions holding it, after ``op`` (SPEC.md §5.4; every put here has a session)."""
    out = {k: set(v) for k, v in model.items()}
    kind, key, sess = op
    if kind == "put":
        out.setdefault(key, set()).add(sess)
    elif kind == "drop":
        for k in [k for k, v in out.items() if sess in v]:
            out[k].discard(sess)
            if not out[k]:
                del out[k]
    elif kind == "del":
        out.pop(key, None)
    return out


def test_sigkill_session_writer_keeps_reference_counts(tmp_path):
    """Reference counts survive kill -9 (TIERSTORE_KILLS // 2 kills, default 100): after each, the
    objects and their sessions are exactly the model after the acknowledged operations, or
    after those plus the one in flight; no reference outlives its object, no object outlives
    its last reference, every object's bytes are intact, and fsck is clean."""
    path = str(tmp_path / "store")
    kills = int(os.environ.get("TIERSTORE_KILLS", "200")) // 2
    model: dict[str, set[str]] = {}
    rnd = random.Random(11)
    landed = ops_acked = 0
    for round_ in range(kills):
        inflight = None
        for line in _run_and_kill(_session_writer, path, round_, rnd):
            parts = line.split()
            if len(parts) != 4:
                continue  # the kill cut the last line
            if parts[0] == "begin":
                inflight = (parts[1], parts[2], parts[3])
            else:
                model = _session_model(model, inflight)
                inflight = None
                ops_acked += 1
        with tierstore.open(path) as s:
            seen = {k: {x.decode() for x in s._engine.sessions_of(b"default", k.encode())} for k in s.keys()}
            allowed = [model] + ([_session_model(model, inflight)] if inflight else [])
            assert seen in allowed, (round_, inflight, seen, model)
            landed += seen != model
            model = seen
            assert s._engine.index.ref_count() == sum(len(v) for v in seen.values())
            for k in seen:
                assert s.get(k).data == _chunk(k)
                assert set(seen[k]) and all(k in s.session_keys(x) for x in seen[k])
            report = repair.check_store(DEFAULT_IO, path, s._engine.index, deep=True)
            assert report.ok, report.as_dict()
    assert ops_acked >= kills
    print(f"\nsession kills: {kills}, operations acknowledged: {ops_acked}, in-flight that landed: {landed}")


def test_group_mode_flush_is_durable_across_kill(tmp_path):
    path = str(tmp_path / "store")
    src = os.path.dirname(os.path.dirname(os.path.abspath(tierstore.__file__)))
    script = (
        f"import sys; sys.path.insert(0, {src!r})\n"
        "import tierstore, os\n"
        f"s = tierstore.open({path!r}, durability='group', group_commit_ms=1e6)\n"
        "for i in range(50): s.put(f'k{i}', tierstore.Blob(b'x' * i))\n"
        "s.flush(); print('flushed', flush=True)\n"
        "for i in range(50, 60): s.put(f'k{i}', tierstore.Blob(b'y'))\n"
        "os.kill(os.getpid(), 9)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert "flushed" in proc.stdout
    with tierstore.open(path) as s:
        for i in range(50):
            assert s.get(f"k{i}").data == b"x" * i
        # unflushed puts may be lost (they may still have been in the write buffer), but
        # what survives is a prefix: never a later put without an earlier one
        present = [s.contains(f"k{i}") for i in range(50, 60)]
        assert present == sorted(present, reverse=True)


def test_fsync_failure_poisons_handle(store_path, monkeypatch):
    s = tierstore.open(store_path)
    s.put("a", Blob(b"1"))

    def failing(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(s._engine.io, "fdatasync", failing)
    with pytest.raises(tierstore.StoreIOError) as ei:
        s.put("b", Blob(b"2"))
    assert ei.value.poisoned
    monkeypatch.undo()
    with pytest.raises(tierstore.StoreIOError):  # no retry: the handle stays poisoned
        s.put("c", Blob(b"3"))
    assert s.get("a").data == b"1"
    s.close()
    with tierstore.open(store_path) as s:
        assert s.get("a").data == b"1" and not s.contains("c")


def test_enospc_raises_store_full_and_keeps_store(store_path, monkeypatch):
    s = tierstore.open(store_path)
    s.put("a", Blob(b"1" * 5000))

    def full(fd, bufs, offset):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(s._engine.io, "pwritev", full)
    with pytest.raises(tierstore.StoreFull):
        s.put("b", Blob(b"2" * 5000))
    monkeypatch.undo()
    s.put("c", Blob(b"3"))
    s.close()
    with tierstore.open(store_path) as s:
        assert s.keys() == ["a", "c"] and s.get("a").data == b"1" * 5000


def test_power_loss_with_large_records(tmp_path):
    """Records >= 4 MiB take the O_DIRECT write path: the same guarantees hold."""
    root = str(tmp_path / "store")
    os.makedirs(root)
    io = FaultFS(root)
    big = [bytes([i]) * (5 << 20) for i in range(3)]
    images: list[tuple[str, int]] = []
    acked = {"n": 0}
    io.on_persist = lambda what: (io.image(d := str(tmp_path / f"img{len(images)}")), images.append((d, acked["n"])))
    s = tierstore.open(root, _io=io, index_commit_ms=0.0)
    io.index_env = s._engine.index.env
    for i, data in enumerate(big):
        s.put(f"big{i}", Blob(data))
        acked["n"] = i + 1
    s.close()
    io.on_persist = None
    assert s._engine.files.dio.direct, "O_DIRECT was not available: this test did not cover the direct path"
    for d, n in images:
        with tierstore.open(d) as r:
            keys = r.keys()
            assert keys == [f"big{i}" for i in range(len(keys))] and len(keys) >= n
            assert all(r.get(k).data == big[int(k[3:])] for k in keys)


def test_direct_io_unsupported_falls_back(store_path, monkeypatch):
    """A file system that refuses O_DIRECT (EINVAL) gets buffered I/O, with the same bytes."""
    s = tierstore.open(store_path)
    real = s._engine.io.pwritev

    def no_direct(fd, bufs, offset):
        if fd == s._engine.log.dfd:
            raise OSError(22, "Invalid argument")
        return real(fd, bufs, offset)

    monkeypatch.setattr(s._engine.io, "pwritev", no_direct)
    data = os.urandom(6 << 20)
    s.put("big", Blob(data))
    assert not s._engine.files.dio.direct  # switched off for this store
    s.put("big2", Blob(data[::-1]))
    s.close()
    with tierstore.open(store_path) as s:
        assert s.get("big").data == data and s.get("big2").data == data[::-1]


def test_a_sync_put_into_a_segment_a_none_writer_created_survives_a_power_cut(tmp_path):
    """A writer with durability="none" rolled the log over into a new segment without syncing
    the directory; a later "sync" writer appended to that segment and synced only the file.  A
    power cut that undoes unsynced directory changes took the segment, and an acknowledged put
    with it (a review, 2026-12-03; the index, which said the put was synced, then refused the
    store).  The first sync of a segment this log did not create syncs the directory too."""
    root = str(tmp_path / "s")
    with tierstore.open(root, segment_bytes="1MiB") as s:
        s.put("base", Blob(b"b" * 100))
    fs = FaultFS(root)
    with tierstore.open(root, _io=fs, durability="none", segment_bytes="1MiB") as s:
        for i in range(6):
            s.put(f"n{i}", Blob(bytes([i + 1]) * 300_000))  # rolls over: a new segment, no directory sync
    s = tierstore.open(root, _io=fs, durability="sync", segment_bytes="1MiB")
    s.put("acked", Blob(b"A" * 1000))  # acknowledged: durable
    s._engine.commit(force=True, sync=True)
    snap = str(tmp_path / "snap")
    os.makedirs(snap)
    s._engine.index.env.copy(snap)
    dest = str(tmp_path / "crash")
    fs.crash_state(dest, "B", random.Random(1), snap)  # directory changes since the last fsync undone
    s.close()
    with tierstore.open(dest) as t:
        assert t.get("acked").data == b"A" * 1000


def test_flush_of_a_none_writer_makes_its_new_segments_durable(tmp_path):
    """flush() makes every earlier write durable, whatever the mode; with durability="none" a
    rollover creates a segment without syncing the directory, and flush() synced the files
    only: a power cut that undoes unsynced directory changes took the segment and its puts
    (a review, 2026-12-03)."""
    root = str(tmp_path / "s")
    with tierstore.open(root, segment_bytes="1MiB") as s:
        s.put("base", Blob(b"b" * 100))
    fs = FaultFS(root)
    s = tierstore.open(root, _io=fs, durability="none", segment_bytes="1MiB")
    for i in range(6):
        s.put(f"n{i}", Blob(bytes([i + 1]) * 300_000))
    s.put("last", Blob(b"L" * 100))
    s.flush()
    snap = str(tmp_path / "snap")
    os.makedirs(snap)
    s._engine.index.env.copy(snap)
    dest = str(tmp_path / "crash")
    fs.crash_state(dest, "B", random.Random(1), snap)
    s.close()
    with tierstore.open(dest) as t:
        assert t.get("n5").data == bytes([6]) * 300_000 and t.get("last").data == b"L" * 100


def test_a_sync_writer_makes_the_segments_a_none_writer_sealed_beside_it_durable(tmp_path):
    """Two writers on one store (separate engines, as two processes): one with durability
    "none" rolls the log over twice; the other's next put adopted the newest segment and synced
    it, but not the two the "none" writer sealed in between, nor their directory entries.  After
    a power cut the store refused to open ("segment header truncated") although a sync put was
    acknowledged after them (SPEC.md §7.8: a sync makes durable everything written before it,
    whoever wrote it; a review, 2026-12-03)."""
    from tierstore.engine import engine as eng

    root = str(tmp_path / "s")
    with tierstore.open(root, segment_bytes="1MiB") as s:
        s.put("base", Blob(b"b" * 100))
        s.put("k", Blob(b"v1"))
    fs = FaultFS(root)
    synced = tierstore.open(root, _io=fs, durability="sync", segment_bytes="1MiB", index_commit_ms=100_000)
    synced.put("s0", Blob(b"s" * 100))
    synced._engine.commit(force=True, sync=True)
    snap = str(tmp_path / "snap")
    os.makedirs(snap)
    synced._engine.index.env.copy(snap)
    saved = dict(eng._WRITERS)
    eng._WRITERS.clear()  # a second engine, as another process has
    try:
        loose = tierstore.open(root, _io=fs, durability="none", segment_bytes="1MiB", index_commit_ms=100_000)
        for i in range(12):
            loose.put(f"n{i}", Blob(bytes([i + 1]) * 300_000))
            if i == 4:
                loose.put("k", Blob(b"v2"))
        synced.put("acked", Blob(b"A" * 1000))  # acknowledged: everything before it is durable too
        dest = str(tmp_path / "crash")
        fs.crash_state(dest, "B", random.Random(1), snap)
        loose.close()
        synced.close()
        with tierstore.open(dest) as t:
            assert t.get("acked").data == b"A" * 1000 and t.get("k").data == b"v2"
            assert t.get("n11").data == bytes([12]) * 300_000
    finally:
        eng._WRITERS.clear()
        eng._WRITERS.update(saved)


def test_a_failed_adopt_changes_nothing_and_leaks_no_descriptor(tmp_path):
    """adopt() of segments another writer made put the active descriptor among the segments to
    sync before it had opened them all: an open that failed (EMFILE) left the active descriptor
    there -- the next sync closed it, twice -- and leaked the new one (a review, 2026-12-03).
    Every file is opened first now."""
    import errno

    from tierstore.engine import engine as eng

    root = str(tmp_path / "s")
    with tierstore.open(root, segment_bytes="1MiB") as s:
        s.put("base", Blob(b"b" * 100))
    fs = FaultFS(root)

    saved = dict(eng._WRITERS)
    synced = tierstore.open(root, _io=fs, durability="sync", segment_bytes="1MiB", index_commit_ms=100_000)
    eng._WRITERS.clear()  # a second engine, as another process has
    try:
        loose = tierstore.open(root, _io=fs, durability="none", segment_bytes="1MiB", index_commit_ms=100_000)
        for i in range(12):  # three segments further on
            loose.put(f"n{i}", Blob(bytes([i + 1]) * 300_000))
        log = synced._engine.log
        opening = fs.open

        def refused_once(path, flags, mode=0o644):  # type: ignore[no-untyped-def]
            name = os.path.basename(path)
            if name.endswith(".tseg") and log.active < int(name.split(".")[0], 16) < loose._engine.log.active:
                fs.open = opening
                raise OSError(errno.EMFILE, "injected EMFILE")
            return opening(path, flags, mode)

        fs.open = refused_once
        with pytest.raises(tierstore.TierstoreError):
            synced.put("x", Blob(b"x" * 100))
        fs.open = opening
        assert log.fd not in log._sealed_unsynced
        synced.put("y", Blob(b"y" * 100))
        synced.put("z", Blob(b"z" * 100))
        loose.close()
        synced.close()
        assert open_files(os.path.join(root, "segments")) == []
    finally:
        eng._WRITERS.clear()
        eng._WRITERS.update(saved)
    with tierstore.open(root) as s:
        assert s.get("y").data == b"y" * 100 and s.get("z").data == b"z" * 100
