"""A damaged index cannot take the process down or give a wrong answer (issue 14, item 3).

The index is derived data (SPEC.md §9): whatever happens to ``index/data.mdb`` -- truncated at a
page, a page zeroed, a bit flipped in a value -- opening the store, listing it, reading every
object and fsck never crash the process (each case runs in a child process, so a SIGBUS or an
abort inside liblmdb fails the test), never list or return a wrong object, and the store is whole
again after at most one more open (the damaged index is quarantined and rebuilt from the log).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import tierstore
from tierstore import Blob
from tierstore.engine import repair

N = 600
CHILD = r"""
import json, os, shutil, sys, tierstore
from tierstore.engine import repair
base, work, n, cases = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
for kind, at, bit in cases:
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(base, work)
    with open(os.path.join(work, "index", "data.mdb"), "r+b") as f:
        if kind == "truncate":
            f.truncate(at)
        elif kind == "zero":
            f.seek(at)
            f.write(bytes(4096))
        elif kind == "flip":
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ (1 << bit)]))
    print("case", kind, at, bit, flush=True)  # a crash below names its case
    out = []
    for attempt in range(2):
        try:
            with tierstore.open(work) as s:
                keys = s.keys()
                bad = sum(1 for k in keys if s.get(k).data != int(k[1:]).to_bytes(4, "little") * 30)
                out.append(f"keys={len(keys)},bad={bad},refs={len(s.session_keys('s1'))}")
        except tierstore.CorruptionError as e:
            out.append("index" if getattr(e, "index", False) else "corruption:" + e.message)
    out.append(f"fsck={repair.fsck(work, deep=True).ok}")
    print("|".join(out), flush=True)
"""
WHOLE = f"keys={N},bad=0,refs={len(range(0, N, 7))}"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("index-damage") / "store")
    with tierstore.open(path) as s:
        for i in range(N):
            s.put(f"k{i:05d}", Blob(i.to_bytes(4, "little") * 30), session="s1" if i % 7 == 0 else None)
    return path


def run_cases(base: str, work: str, cases: list[tuple[str, int, int]]) -> list[tuple[str, list[str]]]:
    """Damage a copy of ``base`` each way, in one child process; (case, [first open, second open,
    fsck]) for each.  A crash of the child (SIGBUS, an abort in liblmdb) fails the test, naming the case."""
    proc = subprocess.run([sys.executable, "-c", CHILD, base, work, str(N), json.dumps(cases)],
                          capture_output=True, text=True, timeout=600)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0, f"the process died (rc {proc.returncode}) after {lines[-1:]}: {proc.stderr[-500:]}"
    return [(lines[i], lines[i + 1].split("|")) for i in range(0, len(lines), 2)]


def check(results: list[tuple[str, list[str]]], n_cases: int) -> None:
    assert len(results) == n_cases
    for case, (first, second, fsck) in results:
        # the whole store, or "the index is damaged" (and so rebuilt): never a wrong answer
        assert first in (WHOLE, "index"), case
        assert second == WHOLE and fsck == "fsck=True", case


def pages(base: str) -> int:
    return os.path.getsize(os.path.join(base, "index", "data.mdb")) // 4096


def test_an_undamaged_index_is_trusted_without_a_rebuild(base, tmp_path):
    work = str(tmp_path / "w")
    assert run_cases(base, work, [("none", 0, 0)])[0][1] == [WHOLE, WHOLE, "fsck=True"]
    with tierstore.open(work) as s:
        assert "rebuilt_index" not in s.recovery


def test_truncated_at_every_page(base, tmp_path):
    cases = [("truncate", page * 4096, 0) for page in range(pages(base))]
    check(run_cases(base, str(tmp_path / "w"), cases), len(cases))


def test_each_page_zeroed(base, tmp_path):
    cases = [("zero", page * 4096, 0) for page in range(pages(base))]
    check(run_cases(base, str(tmp_path / "w"), cases), len(cases))


def test_random_bit_flips(base, tmp_path):
    rng = np.random.default_rng(14)
    cases = [("flip", int(off), int(bit)) for off, bit in
             zip(rng.integers(2 * 4096, pages(base) * 4096, 40), rng.integers(0, 8, 40))]
    check(run_cases(base, str(tmp_path / "w"), cases), len(cases))


def test_a_value_damaged_while_open_is_index_damage_and_is_rebuilt(base, tmp_path):
    """The key-type flag of one entry flipped under a live handle (the case that raised
    UnicodeDecodeError from keys()): listings that read it (keys(), by prefix too) raise
    CorruptionError, once logged; the next open rebuilds the index and everything is there.
    (namespaces() reads one entry of each namespace: it lists them right.)"""
    work = str(tmp_path / "w")
    shutil.copytree(base, work)
    s = tierstore.open(work)
    with open(os.path.join(work, "index", "data.mdb"), "rb") as f:
        data = f.read()
    # every copy of the entry (LMDB keeps old pages too): flip the flags of the record header in
    # the value that follows the key in the leaf page
    at = data.find(b"k00042")
    assert at != -1
    with open(os.path.join(work, "index", "data.mdb"), "r+b") as f:
        while at != -1:
            value = data.find(b"\xd4TRC", at)
            f.seek(value + 10)
            f.write(bytes([data[value + 10] ^ 1]))
            at = data.find(b"k00042", at + 1)
    assert s.namespaces() == ["default"]
    for call in (s.keys, lambda: s.keys(prefix="k0004")):
        with pytest.raises(tierstore.CorruptionError) as e:
            call()
        assert e.value.index and "rebuilt" in e.value.hint
    s.close()
    assert any(n.endswith("-index") for n in os.listdir(os.path.join(work, "quarantine")))
    with tierstore.open(work) as s:
        assert len(s.keys()) == N and s.recovery["rebuilt_index"] == "index missing"
    assert repair.fsck(work, deep=True).ok


@pytest.mark.parametrize("objects", [0, 3])
def test_an_index_without_its_store_identity_is_rebuilt(tmp_path, objects):
    """A writer killed while it created the store (after the first segment, before the index
    got the store's identity), or such damage later: the next writable open rebuilds the index
    from the segments, as for any damaged index (found by the SIGKILL test; it refused to open).
    A read-only open says what to do.  The twin: the same store with its index opens as is."""
    from tierstore.engine.index import Index

    path = str(tmp_path / "store")
    with tierstore.open(path) as s:
        for i in range(objects):
            s.put(f"k{i}", Blob(bytes([i]) * 50))
    with tierstore.open(path) as s:  # the twin
        assert "rebuilt_index" not in s.recovery and len(s.keys()) == objects
    index_dir = os.path.join(path, "index")
    shutil.rmtree(index_dir)
    Index.open(index_dir, writable=True, map_size=1 << 24).close()  # made, never given the identity
    with pytest.raises(tierstore.CorruptionError, match="no store identity"):
        tierstore.open(path, readonly=True)
    with tierstore.open(path) as s:
        assert "no store identity" in s.recovery["rebuilt_index"]
        assert [s.get(f"k{i}").data for i in range(objects)] == [bytes([i]) * 50 for i in range(objects)]
        s.put("after", Blob(b"x"))
    assert repair.fsck(path, deep=True).ok


def test_recover_when_index_is_a_file_not_a_directory(tmp_path):
    """An `index` that is a plain file: recover quarantined it as a directory and stopped with a
    raw "[Errno 20] Not a directory" (a cold review, 2026-12-03); now it is kept in quarantine/
    with its reason beside it, and the index rebuilt."""
    path = str(tmp_path / "s")
    with tierstore.open(path) as s:
        s.put("a", tierstore.Blob(b"x"))
    shutil.rmtree(os.path.join(path, "index"))
    with open(os.path.join(path, "index"), "w") as f:
        f.write("junk")
    repair.recover(path, lock_timeout=0)
    with tierstore.open(path, create=False) as s:
        assert bytes(s.get("a").data) == b"x"
    assert any(n.endswith(".txt") for n in os.listdir(os.path.join(path, "quarantine")))


def _counted(data: str) -> tuple[int, int]:
    """(data.mdb's size, the bytes its newest meta page counts: (last_pg + 1) * 4096)."""
    import struct

    with open(data, "rb") as f:
        head = f.read(8192)
    last_pg, _ = max((struct.unpack_from("<QQ", head, off + 136) for off in (0, 4096)), key=lambda m: m[1])
    return os.path.getsize(data), (last_pg + 1) * 4096


def _drop_a_session(path: str) -> None:
    with tierstore.open(path) as s:
        h = s.namespace("user-1")
        h.put_many([(f"m{i}", Blob(b"memory text " * 5), {"ts": i}) for i in range(100)], session="chat-1")
        h.put("profile", Blob(b"keep me"))
        assert h.drop_session("chat-1") == 100
        # and, surely (how many pages a drop takes and frees again depends on the tree's shape):
        # a transaction that takes pages and frees them again before its commit, never written
        meta = s._engine.index.meta
        s._engine.index._write(lambda txn: (txn.put(b"zz-tmp", b"x" * (256 << 10), db=meta),
                                            txn.delete(b"zz-tmp", db=meta)))


OPENS = ("import sys, tierstore\n"
         "for ro in (True, False, True):\n"
         "    with tierstore.open(sys.argv[1], readonly=ro) as s:\n"
         "        assert bytes(s.get('profile', namespace='user-1').data) == b'keep me'\n"
         "        assert s.keys(namespace='user-1') == ['profile'] and 'rebuilt_index' not in s.recovery\n")


def test_a_dropped_session_leaves_an_index_every_open_takes(tmp_path):
    """(A new user's try: drop_session of 100 objects, then a clean close, left a store no open,
    read-only or writable, nor fsck, recover or dump could open for good: LMDB counts the pages a
    transaction took and freed again before its commit in last_pg and never writes them, and the
    check before liblmdb maps the file refused it as cut.)  A writer now keeps data.mdb as long
    as its count.  Opens run in a child: a wrong pass would be a SIGBUS."""
    path = str(tmp_path / "s")
    _drop_a_session(path)
    size, counted = _counted(os.path.join(path, "index", "data.mdb"))
    assert size >= counted
    proc = subprocess.run([sys.executable, "-c", OPENS, path], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-800:]
    assert repair.fsck(path, deep=True).ok


@pytest.mark.parametrize("stamped", [True, False])
def test_a_short_index_an_older_writer_left_is_checked_whole_and_opens(tmp_path, monkeypatch, stamped):
    """A data.mdb shorter than its count (written before writers kept it covered) is judged by the
    whole-file checks -- its stamp, or LMDB's verifier walking every reachable page -- not refused;
    the first writable open then covers it."""
    from tierstore.engine import index as index_mod

    path = str(tmp_path / "s")
    monkeypatch.setattr(index_mod.Index, "_cover_pages", lambda self: None)
    _drop_a_session(path)
    monkeypatch.undo()
    data = os.path.join(path, "index", "data.mdb")
    size, counted = _counted(data)
    assert size < counted, "the case this test is for: a file shorter than its count"
    if not stamped:
        os.unlink(os.path.join(path, "index", index_mod.STAMP_FILE))
    proc = subprocess.run([sys.executable, "-c", OPENS, path], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-800:]
    size, counted = _counted(data)
    assert size >= counted


def test_an_index_cut_beside_a_live_writer_is_refused_not_mapped(tmp_path):
    """(A cold review: checking only the trees' roots let a file cut past them through while a
    writer ran -- pages below the roots' numbers are not all the pages a tree reaches -- and a
    read-only open died of SIGBUS.)  The size check counts every page again; a short file beside a
    live writer is walked, and one whose trees reach past its end is refused."""
    import struct

    path = str(tmp_path / "s")
    with tierstore.open(path) as s:  # page reuse: the roots end up below pages the trees still reach
        h = s.namespace("u")
        h.put_many([(f"junk{i}", Blob(b"j" * 200), {}) for i in range(2000)], session="tmp")
        s.put_many([(f"keep{i}", Blob(b"k" * 200), {}) for i in range(3000)])
        h.drop_session("tmp")
        for i in range(6):
            s.put(f"small{i}", Blob(b"s"))
            s.flush()
    writer = subprocess.Popen([sys.executable, "-c", "import sys, time, tierstore\ns = tierstore.open(sys.argv[1])\n"
                               "print('open', flush=True)\ntime.sleep(120)", path], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "open"
        data = os.path.join(path, "index", "data.mdb")
        with open(data, "rb") as f:
            head = f.read(8192)
        newest = max((0, 4096), key=lambda off: struct.unpack_from("<Q", head, off + 144)[0])
        roots = [struct.unpack_from("<Q", head, newest + at)[0] for at in (80, 128)]
        os.truncate(data, (max(r for r in roots if r < 1 << 63) + 1) * 4096)  # damage: cut past the roots
        reader = ("import sys, tierstore\ntry:\n    tierstore.open(sys.argv[1], readonly=True).keys()\n"
                  "except tierstore.CorruptionError as e:\n    print('refused', getattr(e, 'index', False))\n")
        proc = subprocess.run([sys.executable, "-c", reader, path], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"rc {proc.returncode}: {proc.stderr[-500:]}"  # (-7: SIGBUS)
        assert proc.stdout.strip() == "refused True"
    finally:
        writer.kill()
        writer.wait()


OLD_BUSY_WRITER = """
import sys, time, tierstore
from tierstore import Blob
from tierstore.engine import index as im
im.Index._cover_pages = lambda self: None  # a writer of an older tierstore: it leaves data.mdb short
s = tierstore.open(sys.argv[1])
idx = s._engine.index
n, short = 0, 0
def take_and_free(txn):  # pages a transaction takes and frees before its commit (as drop_session does)
    txn.put(b"zz-tmp", b"x" * ((32 << 10) + (n % 64) * 4096), db=idx.meta)
    txn.delete(b"zz-tmp", db=idx.meta)
print("open", flush=True)
t0 = time.monotonic()
while time.monotonic() - t0 < float(sys.argv[2]):
    s.put_many([(f"k{(n * 50 + i) % 20000}", Blob(b"v" * 100)) for i in range(50)])
    s.flush()
    idx._write(take_and_free)
    n += 1
    if n % 100 == 0 and im._meta_problems(idx.path)[1] is not None:
        short += 1
print("short", short, flush=True)
s.close()
"""


def test_a_short_index_beside_a_busy_writer_is_never_called_damaged(tmp_path):
    """(A cold review: LMDB's verifier holds no reader slot, so a writer committing while it walks
    reuses pages the walk still reaches, and the walk reports damage that is not there -- a read-only
    open beside an older, busy writer that leaves data.mdb short raised CorruptionError on a sound
    store, ~5% of opens here; fsck --deep the same.)  A walk counts only when no commit passed
    during it; one that raced every time is StoreLocked (try again), never damage."""
    import time

    path = str(tmp_path / "s")
    with tierstore.open(path) as s:
        for j in range(20):
            s.put_many([(f"k{j * 1000 + i}", Blob(b"v" * 100)) for i in range(1000)])
    writer = subprocess.Popen([sys.executable, "-c", OLD_BUSY_WRITER, path, "9"], stdout=subprocess.PIPE, text=True)
    counts = {"ok": 0, "locked": 0}
    try:
        assert writer.stdout.readline().strip() == "open"
        t0 = time.monotonic()
        while time.monotonic() - t0 < 5:
            try:
                with tierstore.open(path, readonly=True) as s:
                    assert bytes(s.get("k1").data) == b"v" * 100
                counts["ok"] += 1
            except tierstore.StoreLocked:
                counts["locked"] += 1
        report = repair.fsck(path, deep=True)
        assert report.ok, [f.what for f in report.findings]
        out = writer.communicate(timeout=60)[0]
    finally:
        writer.kill()
        writer.wait()
    assert int(out.split()[-1]) > 0, "the case this test is for: the writer left data.mdb short"
    assert counts["ok"] > 20, counts


def test_an_index_no_walk_could_judge_is_busy_not_damaged(tmp_path, monkeypatch, capsys):
    """When every walk of a short index beside a live writer raced one of its commits (walk_live
    gives None), a read-only open is StoreLocked with its own hint (try again), never
    CorruptionError; fsck --deep says the same with exit 4 (a cold review: it escaped as "wait
    longer with --lock-timeout", which fsck without --fix does not take)."""
    from tierstore.cli import main as cli
    from tierstore.engine import index as index_mod

    path = str(tmp_path / "s")
    monkeypatch.setattr(index_mod.Index, "_cover_pages", lambda self: None)
    _drop_a_session(path)
    monkeypatch.undo()
    idle = subprocess.Popen([sys.executable, "-c", "import sys, time, tierstore\nfrom tierstore.engine import index\n"
                             "index.Index._cover_pages = lambda self: None\ns = tierstore.open(sys.argv[1])\n"
                             "print('open', flush=True)\ntime.sleep(120)", path], stdout=subprocess.PIPE, text=True)
    try:
        assert idle.stdout.readline().strip() == "open"
        assert index_mod._meta_problems(os.path.join(path, "index"))[1] is not None, "the case: a short file"
        monkeypatch.setattr(index_mod, "walk_live", lambda p: None)
        monkeypatch.setattr(repair, "walk_live", lambda p: None)
        with pytest.raises(tierstore.StoreLocked) as e:
            tierstore.open(path, readonly=True)
        assert e.value.busy_index and "quieter" in e.value.hint
        assert cli(["fsck", "--deep", path]) == 4
        assert "quieter" in capsys.readouterr().err
        monkeypatch.undo()
        with tierstore.open(path, readonly=True) as s:  # the twin: a walk that answers
            assert bytes(s.get("profile", namespace="user-1").data) == b"keep me"
    finally:
        idle.kill()
        idle.wait()


def test_the_stamp_is_written_after_data_mdb_is_synced_and_unstamping_is_durable(tmp_path, monkeypatch):
    """LMDB (metasync=False) leaves its last meta page to the OS, and the stamp was computed from
    the page cache: a power cut after a clean close kept an older meta page beside a stamp of the
    newer file, and the sound index was judged changed at rest (quarantined by recover, no
    witness).  The close now syncs data.mdb before it stamps, and the directory after it stamps
    and after a writer's open unstamps (a cold review, 2026-12-04; LMDB's own writes do not go
    through FileIO, so the order of syncs is what is checked)."""
    synced: list[str] = []
    real = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    path = str(tmp_path / "s")
    index = os.path.realpath(os.path.join(path, "index"))
    with tierstore.open(path) as s:
        s.put("k", Blob(b"v"))
        monkeypatch.setattr(os, "fsync", fsync)
    order = [p for p in synced if p.startswith(index)]
    data, tmp = os.path.join(index, "data.mdb"), os.path.join(index, "tierstore-checksum.tmp")
    assert data in order and tmp in order and order.index(data) < order.index(tmp), order
    assert index in order[order.index(tmp):], order  # the rename, durable
    synced.clear()
    with tierstore.open(path) as s:  # a writer's open unstamps, durably, before it writes
        assert not os.path.exists(os.path.join(index, "tierstore-checksum"))
        assert index in synced
