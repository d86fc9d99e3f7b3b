"""The `tierstore` command on real stores: exit codes, --json, fsck/recover/ls/stats, demo, bench."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

import tierstore
from tierstore import Blob, KVCache, Vectors
from tierstore.bench import bench_blobs, bench_chunk
from tierstore.cli import _jsonable as cli_jsonable
from tierstore.cli import main

from .conftest import segment_files


def run(*args: str) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, "-m", "tierstore", *args], capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.fixture
def filled(store_path, real_kv, real_emb):
    with tierstore.open(store_path) as s:
        s.put(b"\x01\x02", KVCache(real_kv), namespace="minilm")
        s.put("doc", Vectors(real_emb[:100], ids=np.arange(100)), namespace="rag")
        s.put("note", Blob(b"hello", media_type="text/plain"))
    return store_path


def test_ls_stats_fsck_json(filled, capsys):
    assert main(["ls", filled, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {(r["namespace"], r["kind"]) for r in rows} == {("minilm", "kv"), ("rag", "vectors"), ("default", "blob")}
    assert [r["key"] for r in rows if r["kind"] == "kv"] == ["0x0102"]
    assert main(["stats", filled, "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["namespaces"] == {"default": 1, "minilm": 1, "rag": 1}
    assert main(["fsck", filled, "--deep", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["ok"] and rep["objects"] == 3 and rep["bytes_verified"] > 0


def test_fsck_exit_code_on_bad_checksum(filled):
    code, out = run("fsck", filled, "--deep")
    assert code == 0 and "ok" in out
    (seg,) = segment_files(filled)
    with open(seg, "r+b") as f:  # flip a payload byte of the KV chunk's second layer
        f.seek(4096 * 2 + 200_000)
        b = f.read(1)
        f.seek(4096 * 2 + 200_000)
        f.write(bytes([b[0] ^ 0xFF]))
    code, out = run("fsck", filled)  # the default already checks every live checksum
    assert code == 1 and "checksum mismatch" in out and "ERRORS FOUND" in out
    assert "key=0x0102" in out  # a bytes key is shown in hex
    code, out = run("fsck", filled, "--deep", "--json")
    assert code == 1 and not json.loads(out)["ok"] and json.loads(out)["deep"]
    code, out = run("fsck", filled, "--fix", "--json")  # damage found and repaired: a code of its own
    rep = json.loads(out[: out.rindex("}") + 1])
    assert code == 6 and not rep["before"]["ok"] and rep["ok"] and rep["repaired"]
    assert run("fsck", filled, "--fix")[0] == 0  # nothing left to repair


def test_json_output_is_strict_json(store_path, capsys):
    """NaN, infinities and bytes in metadata: JSON has no NaN and no bytes (Python's json wrote
    NaN, and str() of bytes, which reads as a string)."""
    with tierstore.open(store_path) as s:
        s.put("k", Blob(b"x"), meta={"a": float("nan"), "i": float("-inf"), "b": b"\xff\x00", "s": "0xff00"})
    assert main(["dump", store_path, "k", "--json"]) == 0
    out = capsys.readouterr().out
    meta = json.loads(out, parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))["info"]["meta"]
    assert meta == {"a": "NaN", "i": "-Infinity", "b": {"$bytes": "ff00"}, "s": "0xff00"}


def test_output_into_a_closed_pipe_stops_quietly(store_path):
    """`tierstore ls PATH | head -1`: no traceback, no error message, exit code 141 as a shell reports for
    `cat` that SIGPIPE ended (it was 0: `dump | head` then said that a dump cut short found no damage)."""
    with tierstore.open(store_path, durability="none") as s:
        for i in range(3000):  # a listing well over a pipe buffer (64 KiB)
            s.put(f"a-rather-long-key-name-so-the-listing-is-large-{i:06d}", Blob(b"x"))
    proc = subprocess.Popen([sys.executable, "-m", "tierstore", "ls", store_path],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline().startswith(b"NAMESPACE")
    proc.stdout.close()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 141 and err == b"", (proc.returncode, err)


def test_recover_rebuilds_missing_index(filled):
    shutil.rmtree(os.path.join(filled, "index"))
    code, out = run("recover", filled, "--json")
    assert code == 0, out
    assert json.loads(out)["records"] == 3
    with tierstore.open(filled, readonly=True) as s:
        assert s.get("note").data == b"hello"


def test_cannot_open_exit_codes(tmp_path, filled):
    code, out = run("fsck", str(tmp_path / "nothing"))
    assert code == 3 and "no store" in out
    code, _ = run("ls", str(tmp_path / "nothing"))
    assert code == 3
    with tierstore.open(filled):  # a live writer: recover must wait for it, and gives up
        code, out = run("recover", filled, "--lock-timeout", "0.2")
    assert code == 4 and "another writer" in out
    code, _ = run("fsck")  # missing argument
    assert code == 2


def test_help_documents_exit_codes():
    code, out = run("--help")
    assert code == 0 and "exit codes" in out and "1 damage found" in out and "5 no such object" in out
    assert "6 damage found and repaired" in out


def test_exit_codes_of_dump(filled, tmp_path):
    code, out = run("dump", filled, "no-such-key")
    assert code == 5 and "no object 'no-such-key'" in out  # not "bad arguments"
    assert run("dump", filled, "note")[0] == 0  # the twin
    code, out = run("dump", filled, "0x1234")
    assert code == 5 and "no object 0x1234 in namespace 'default'" in out  # as typed, not b'\x124'
    bad = tmp_path / "0000000000000009.tseg"
    bad.write_bytes(b"not a segment" * 400)
    code, out = run("dump", str(bad))
    assert code == 1 and "bad header" in out
    code, out = run("ls", str(tmp_path / "nothing"))
    assert code == 3 and "create=True" not in out and "check the path" in out
    code, out = run("dump", str(tmp_path / "0000000000000001.tseg"))
    assert code == 3 and "no segment file" in out and "demo" not in out


def test_dump_reports_a_damaged_object_and_goes_on_past_it(filled, capsys):
    """dump KEY checks the object's checksums (exit 1 when they fail); dump of the log shows the
    damaged record and every record after it, as the store still serves them."""
    assert main(["dump", filled, "0x0102", "--namespace", "minilm", "--json"]) == 0  # the twin: intact
    assert json.loads(capsys.readouterr().out)["damaged"] is None
    info = tierstore.open(filled, readonly=True).info(b"\x01\x02", namespace="minilm")
    (seg,) = segment_files(filled)
    with open(seg, "r+b") as f:  # flip a payload byte of the KV chunk's first layer
        at = info.offset + info.stored_bytes // 2
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))
    assert main(["dump", filled, "0x0102", "--namespace", "minilm", "--json"]) == 1
    got = json.loads(capsys.readouterr().out)
    assert "checksum mismatch" in got["damaged"]["detail"] and got["info"]["key_type"] == "bytes"
    assert main(["dump", filled, "--json"]) == 1
    (sg,) = json.loads(capsys.readouterr().out)["segments"]
    assert [d["record"]["key"] for d in sg["damaged"]] == ["0x0102"]
    assert {(r.get("namespace"), r.get("key"), r.get("key_type")) for r in sg["records"] if r["type"] == "put"} \
        == {("rag", "doc", "text"), ("default", "note", "text")}  # the records after it
    assert sg["end"]["reason"] == "end"
    assert main(["dump", filled]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED" in out and "default/note" in out
    with tierstore.open(filled) as s:  # (sealed: a damaged header in the active segment's tail stops the open)
        s._engine.seal_active(1)
    with open(seg, "r+b") as f:  # now its record header too: still the object's damage (1), not the store's (3)
        f.seek(info.offset + 40)
        b = f.read(1)
        f.seek(info.offset + 40)
        f.write(bytes([b[0] ^ 0xFF]))
    assert main(["dump", filled, "0x0102", "--namespace", "minilm"]) == 1
    assert "DAMAGED" in capsys.readouterr().out


def test_ls_has_a_header_codec_and_stored_size(filled):
    code, out = run("ls", filled)
    lines = out.splitlines()
    assert code == 0 and lines[0].split() == ["NAMESPACE", "KEY", "KIND", "SHAPE", "DTYPE", "CODEC", "SIZE", "STORED"]
    assert any("note" in x and "raw" in x and "5 B" in x for x in lines)
    assert lines[-1].startswith("3 object(s)")


def test_stats_shows_no_per_handle_counters(filled):
    code, out = run("stats", filled, "--json")
    st = json.loads(out)
    assert code == 0 and "counters" not in st and "tiers" not in st and st["namespaces"]["rag"] == 1


def test_dump_shows_session_references_plainly(store_path):
    with tierstore.open(store_path) as s:
        s.put("k", Blob(b"x"), session="chat-7")
        s.put("k", Blob(b"x"))  # also put without a session
        s.drop_session("chat-7")
    code, out = run("dump", store_path)
    assert code == 0
    assert "default/k referenced by session 'chat-7'" in out
    assert "referenced by the object's own (it was put without a session)" in out
    assert "reference of session 'chat-7' released" in out
    assert "(anchor)" not in out and "ref_key" not in out


def test_dump_names_every_record_type(store_path):
    with tierstore.open(store_path) as s:
        s.put_many([("a", Blob(b"x")), ("b", Blob(b"y"))])
    code, out = run("dump", store_path)
    assert code == 0 and "None" not in out
    assert "group  2 record(s)" in out and "copies of 3 record headers written before it" in out
    assert "default/a blob 1 extent" in out and "records through LSN" in out


def test_quarantine_command(filled):
    (seg,) = segment_files(filled)
    with open(seg, "ab") as f:
        f.write(b"\xd4TRC" + b"\x01" * 300)  # a torn record that held bytes
    with tierstore.open(filled):
        pass
    code, out = run("quarantine", filled, "--json")
    items = json.loads(out)["items"]
    assert code == 0 and len(items) == 1 and items[0]["bytes"] == 304
    code, out = run("quarantine", filled, "--clear")
    assert code == 0 and "deleted 1 item(s)" in out
    assert json.loads(run("quarantine", filled, "--json")[1])["items"] == []


def test_demo(tmp_path):
    code, out = run("demo", "--path", str(tmp_path / "demo"), "--json")
    assert code == 0, out
    result = json.loads(out)
    assert result["fsck_ok"] and result["stats"]["objects_indexed"] == 7


def test_bench_smoke(tmp_path):
    """The benchmark runs end to end (tiny repetitions); figures come from `tierstore bench`."""
    quiet = lambda *a: None  # noqa: E731
    chunk = bench_chunk(str(tmp_path / "c"), reps=1, layer_reps=4, peers=False, say=quiet)
    systems = chunk["systems"]
    assert {"baseline", "seqlog", "ts_sync", "ts_group", "ts_none"} <= set(systems)
    assert all(r["put_ms"] > 0 and r["get_warm_ms"] > 0 for r in systems.values())
    assert chunk["targets"]["cold_layer_read_bytes_vs_layer"] > 0
    blobs = bench_blobs(str(tmp_path / "b"), n=200, peers=False, say=quiet)
    assert blobs["tierstore_group_put_ops"] > 0 and blobs["tierstore_warm_get_ops"] > 0


def test_cli_says_it_waits_for_a_writer_and_gives_a_cli_hint(filled):
    with tierstore.open(filled):  # this process writes
        code, out = run("compact", filled, "--lock-timeout", "0.5")
        assert code == 0 and "waiting" not in out  # compaction runs beside writers (SPEC.md §7.8)
        code, out = run("recover", filled, "--lock-timeout", "0.5")  # recover needs the store to itself
    assert code == 4
    assert "waiting up to 0.5 s" in out and "--lock-timeout" in out and "readonly=True" not in out
    with tierstore.open(filled, exclusive=True):  # (a new user: compact waited 60 s without a word)
        code, out = run("compact", filled, "--lock-timeout", "0.5")
    assert code == 4 and "holds the store to itself" in out and "waiting up to 0.5 s" in out


def test_json_errors_are_json(filled):
    code, out = run("dump", filled, "nope", "--json")
    assert code == 5
    doc = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    assert doc["exit_code"] == 5 and "nope" in doc["error"]


def test_missing_key_names_the_namespace_that_has_it(filled):
    code, out = run("dump", filled, "doc")  # it lives in namespace "rag"
    assert code == 5 and "namespace 'rag' holds that key" in out


def test_recover_reports_bytes_keys_in_hex_and_dump_reads_the_quarantined_range(filled):
    (seg,) = segment_files(filled)
    with tierstore.open(filled) as s:
        info = s.info(b"\x01\x02", namespace="minilm")
    with open(seg, "r+b") as f:  # damage the KV chunk's payload
        f.seek(info.offset + 4096 * 2)
        f.write(b"\xff" * 8)
    code, out = run("recover", filled)
    assert code == 0 and "minilm/0x0102 is gone" in out and "\x01" not in out
    (item,) = json.loads(run("quarantine", filled, "--json")[1])["items"]
    code, out = run("dump", os.path.join(filled, "quarantine", item["name"]))
    # its checksums are checked as in a segment (a new user: a damaged record was listed as sound, exit 0)
    assert code == 1 and "minilm/0x0102" in out and "put" in out and "DAMAGED: extent" in out
    doc = json.loads(run("dump", os.path.join(filled, "quarantine", item["name"]), "--json")[1])
    assert doc["damaged"][0]["detail"].startswith("extent ")


def test_dump_of_a_range_tells_whole_records_from_torn_and_damaged_ones(filled, tmp_path):
    """The twin: a range of whole records dumps with exit 0; cut short, its last record is torn."""
    (seg,) = segment_files(filled)
    with tierstore.open(filled, readonly=True) as s:
        info = s.info("doc", namespace="rag")
    from tierstore.format import constants as fmt
    from tierstore.format import record as rec

    with open(seg, "rb") as f:
        f.seek(info.offset)
        length = rec.decode_header(f.read(fmt.HEADER_MAX_BYTES)).record_len
        f.seek(info.offset)
        record = f.read(length)
    whole, cut = str(tmp_path / "whole.bin"), str(tmp_path / "cut.bin")
    with open(whole, "wb") as f:
        f.write(record)
    with open(cut, "wb") as f:
        f.write(record[:-8])
    code, out = run("dump", whole)
    assert code == 0 and "rag/doc" in out and "DAMAGED" not in out
    code, out = run("dump", cut, "--json")
    doc = json.loads(out)
    assert code == 1 and len(doc["records"]) == 1 and doc["damaged"][0]["detail"].startswith("torn")
    with open(cut, "wb") as f:  # (a cold review: a tail shorter than a record header was passed over, exit 0)
        f.write(record + record[:40])
    code, out = run("dump", cut, "--json")
    doc = json.loads(out)
    assert code == 1 and len(doc["records"]) == 1 and "shorter than a record header" in doc["undecodable"][0]["why"]


def test_text_and_bytes_keys_that_look_alike_are_told_apart(store_path, capsys):
    with tierstore.open(store_path) as s:
        s.put("0xab", Blob(b"text key"), namespace="n")
        s.put(b"\xab", Blob(b"bytes key"), namespace="n")
    assert main(["ls", store_path]) == 0
    out = capsys.readouterr().out
    keys = [line.split()[1] for line in out.splitlines()[1:3]]
    assert sorted(keys) == ["'0xab'", "0xab"]  # the text key quoted, the bytes key bare
    assert main(["dump", store_path, "--namespace", "n", "0xab", "--json"]) == 0  # KEY after an option
    assert json.loads(capsys.readouterr().out)["info"]["key"] in ("0xab", "0xAB")
    assert main(["dump", store_path, "0xab", "--namespace", "n", "--text-key", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["info"]["key"] == "0xab"
    assert main(["dump", store_path, "0xzz", "--namespace", "n"]) == 2  # not hex: a usage error, with a hint
    assert "--text-key" in capsys.readouterr().err


def test_bad_arguments_with_json_say_so_as_json(capsys):
    with pytest.raises(SystemExit) as e:
        main(["stats", "somewhere", "--bogus", "--json"])
    assert e.value.code == 2
    doc = json.loads(capsys.readouterr().out)
    assert doc["exit_code"] == 2 and "--bogus" in doc["error"]


def test_bench_makes_its_scratch_directory(tmp_path):
    code, out = run("bench", "--quick", "--section", "codecs", "--json", "--path", str(tmp_path / "new" / "dir"))
    assert code == 0, out


def test_bench_checks_where_it_writes_before_it_runs(tmp_path):
    """A new user's try: --out naming a file was found after the whole run (exit 3), and with
    --json the results were lost."""
    (tmp_path / "afile").write_text("x")
    for option in ("--out", "--path"):
        for where in (tmp_path / "afile", tmp_path / "afile" / "x"):
            t0 = time.monotonic()
            code, out = run("bench", "--quick", "--section", "chunk", "--json", option, str(where))
            assert code == 2 and option in json.loads(out.splitlines()[0])["error"], out
            assert time.monotonic() - t0 < 60  # (refused before the run; not a timing claim: the run takes minutes)


def test_bench_stopped_by_sigterm_stops_its_server_and_removes_its_scratch(tmp_path):
    """SIGTERM (a timeout, a CI job's end) left the remote section's redis-server running and
    its scratch directory (73 MB) behind: nothing turned the signal into the cleanup Ctrl-C ran."""
    import signal

    scratch = tmp_path / "scratch"
    proc = subprocess.Popen([sys.executable, "-m", "tierstore", "bench", "--quick", "--section", "remote",
                             "--path", str(scratch)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        servers: list[int] = []
        while not servers and time.monotonic() < deadline:  # (wait for the section's server)
            out = subprocess.run(["pgrep", "-P", str(proc.pid), "redis-server"], capture_output=True, text=True)
            servers = [int(p) for p in out.stdout.split()]
            time.sleep(0.2)
        assert servers, "the remote section started no redis-server"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for pid in servers:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        os.kill(pid, signal.SIGKILL)
        raise AssertionError(f"redis-server {pid} outlived the bench")
    assert list(scratch.iterdir()) == []  # (--path itself is the user's: what the run made in it is gone)


def test_clearing_an_empty_quarantine_beside_a_writer_does_not_say_it_waits(store_path):
    with tierstore.open(store_path) as s:
        s.put("k", Blob(b"x"))
        code, out = run("quarantine", store_path, "--clear", "--lock-timeout", "1")
        assert code == 0 and "is empty" in out and "waiting" not in out


# -- the tools beside live writers (a cold review, 2026-12-03) ----------------------------------------------

def test_a_read_only_handle_follows_an_index_that_recover_rebuilt(store_path):
    """recover renames a rebuilt index over index/: a read-only handle opened before it mapped
    the old, unlinked file and never saw a later put or delete.  Its twin: a handle opened after
    recover sees the same."""
    import time

    with tierstore.open(store_path) as w:
        w.put("a", Blob(b"1"))
    ro = tierstore.open(store_path, readonly=True)
    assert ro.contains("a")
    code, out = run("recover", store_path, "--json")
    assert code in (0, 6), out
    writer = ("import sys, tierstore\nwith tierstore.open(sys.argv[1]) as w:\n"
              "    w.put('b', tierstore.Blob(b'2'))\n    w.delete('a')\n")
    subprocess.run([sys.executable, "-c", writer, store_path], check=True, timeout=120)  # (this one reads)
    time.sleep(0.3)  # (a read-only index looks for a rebuilt file at most every 0.2 s)
    assert ro.contains("b") and not ro.contains("a") and ro.get("b").data == b"2"
    assert ro.keys() == ["b"]
    ro.close()
    with tierstore.open(store_path, readonly=True) as fresh:
        assert fresh.keys() == ["b"]


def test_fsck_finds_the_segments_a_writer_made_after_its_listing(store_path, monkeypatch):
    """fsck lists the segments, then reads the index: a segment another writer started in
    between (here: forced with a rollover at the moment fsck opens its index snapshot) is
    named by the index and holds records it applied.  Reported as missing before; checked now."""
    from tierstore.engine import index as index_mod
    from tierstore.engine import repair

    with tierstore.open(store_path, segment_bytes="1MiB") as w:
        w.put("first", Blob(os.urandom(4096)))
    writer = tierstore.open(store_path, segment_bytes="1MiB")
    real_read = index_mod.Index.read

    def read_after_a_rollover(self):
        if sys._getframe(1).f_code.co_name == "check_store" and not getattr(read_after_a_rollover, "done", False):
            read_after_a_rollover.done = True
            for i in range(3):  # 3 MiB: new segments, indexed before the snapshot below
                writer.put(f"late-{i}", Blob(os.urandom(1 << 20)))
            writer.flush()
        return real_read(self)

    monkeypatch.setattr(index_mod.Index, "read", read_after_a_rollover)
    report = repair.fsck(store_path)
    monkeypatch.undo()
    writer.close()
    assert getattr(read_after_a_rollover, "done", False)  # (the rollover did happen in the gap)
    assert report.ok, [f.what for f in report.findings]
    assert report.objects == 4
    assert repair.fsck(store_path).ok  # the twin: the same store at rest


def test_dump_of_a_store_goes_on_past_a_segment_retired_after_its_listing(filled, monkeypatch, capsys):
    from tierstore.cli import dump as dump_mod

    real = dump_mod.segment_events
    calls = []

    def retired_first(path, **kw):
        calls.append(path)
        if len(calls) == 1:
            raise FileNotFoundError(path)  # what open_segment raises for a segment renamed away
        yield from real(path, **kw)

    with tierstore.open(filled) as s:
        s.put("more", Blob(b"x" * 100))
    monkeypatch.setattr(dump_mod, "segment_events", retired_first)
    assert main(["dump", filled, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["segments"]) == len(calls) - 1


def test_dump_of_a_store_prints_each_record_as_it_is_read(tmp_path, monkeypatch, capsys):
    """(A new user's try: `dump --json` of a 27 MB store wrote 833 MB, all of it held in memory
    first -- 1.1 GB of RSS for a 61 MB segment here.)  A store's log is printed a record at a
    time, the same JSON as ``dump_store`` makes, and the same exit code; its text too."""
    from tierstore.cli import dump as dump_mod

    path = str(tmp_path / "s")
    with tierstore.open(path, segment_bytes="1MiB") as s:
        s.put_many([(f"k{i}", Blob(b"x" * 20_000)) for i in range(120)])
        s.put(b"\x01", Blob(b"b"), session="c1")
        s.delete("k3")
    first, *_ = segment_files(path)
    with open(first, "r+b") as f:  # a payload byte: damage mid-segment, the scan goes on
        f.seek(300_000)
        b = f.read(1)
        f.seek(300_000)
        f.write(bytes([b[0] ^ 0xFF]))
    expected = json.loads(json.dumps(cli_jsonable(dump_mod.dump_store(path))))
    printed, real = [], dump_mod.segment_events

    def watched(p, **kw):
        for kind, item in real(p, **kw):
            yield kind, item
            printed.append(len(capsys.readouterr().out))  # (what was printed before the next one is read)

    monkeypatch.setattr(dump_mod, "segment_events", watched)
    assert main(["dump", path, "--json"]) == 1
    assert sum(1 for n in printed if n) > 100  # (printed as it went, not at the end)
    capsys.readouterr()
    monkeypatch.setattr(dump_mod, "segment_events", real)
    assert main(["dump", path, "--json"]) == 1
    whole = capsys.readouterr().out
    assert json.loads(whole) == expected and expected["segments"][0]["damaged"]
    assert whole == json.dumps(cli_jsonable(expected), indent=2) + "\n"
    assert main(["dump", path]) == 1
    text = capsys.readouterr().out
    assert "DAMAGED" in text and "default/k119 blob 1 extent" in text


def test_dump_cut_short_by_an_error_is_still_one_json_document(tmp_path, capsys):
    """(A cold review: an error midway through `dump PATH --json` printed the error object after
    the segments already written: no longer JSON.)  The document ends with "error" and
    "exit_code" members after the segments dumped."""
    path = str(tmp_path / "s")
    with tierstore.open(path, segment_bytes="1MiB") as s:
        s.put_many([(f"k{i}", Blob(b"x" * 20_000)) for i in range(120)])
        s.put("last", Blob(b"y"))
    segs = segment_files(path)
    assert len(segs) >= 2
    os.remove(segs[1])
    os.mkdir(segs[1])  # (reading it fails: EISDIR)
    assert main(["dump", path, "--json"]) == 3
    out = json.loads(capsys.readouterr().out)
    assert len(out["segments"]) == 1 and out["exit_code"] == 3 and "directory" in out["error"]


def test_fsck_fix_waits_as_long_as_asked_and_says_so(filled):
    (seg,) = segment_files(filled)
    with open(seg, "r+b") as f:  # damage: fsck finds an error, --fix needs the store alone
        f.seek(4096 * 2 + 200_000)
        b = f.read(1)
        f.seek(4096 * 2 + 200_000)
        f.write(bytes([b[0] ^ 0xFF]))
    with tierstore.open(filled):
        code, out = run("fsck", filled, "--fix", "--lock-timeout", "0.5")
    assert code == 4 and "waiting up to 0.5 s" in out


@pytest.mark.parametrize("flip", [None, "a5", "b5"])
def test_fsck_checks_the_records_a_killed_writer_left_unapplied(tmp_path, flip):
    """A writer killed after two put_many returned and before its index commit leaves records
    past the index's applied position, which read-only handles already serve.  fsck stopped at
    the applied position and said "ok" of damage there (a cold review, 2026-12-03); now it checks
    them.  Damage in the first batch, which the second's sync vouched for with a SYNC record, is
    an error; in the last batch, which no SYNC record vouches for, it reads as a torn write (a
    warning: the next writer cuts it, SPEC.md §7.3).  Twin: without damage, ok."""
    path = str(tmp_path / "s")
    code = f"""
import os, signal, hashlib, tierstore
s = tierstore.open({path!r}, index_commit_ms=60_000, index_batch=100_000)
s.put_many([(f"a{{i}}", tierstore.Blob(hashlib.sha256(b"%d" % i).digest() * 150)) for i in range(100)])
s.put_many([(f"b{{i}}", tierstore.Blob(hashlib.sha256(b"b%d" % i).digest() * 150)) for i in range(100)])
for k in ("a5", "b5"):
    i = s.info(k); print(i.segment, i.offset, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    at = dict(zip(("a5", "b5"), (tuple(map(int, line.split())) for line in out.stdout.splitlines())))
    if flip is not None:
        seg, off = at[flip]
        with open(os.path.join(path, "segments", f"{seg:016x}.tseg"), "r+b") as f:
            f.seek(off + 1000)
            b = f.read(1)
            f.seek(off + 1000)
            f.write(bytes([b[0] ^ 1]))
    rc, text = run("fsck", path)
    assert "past the index's applied position" in text, text
    if flip == "a5":
        assert rc == 1 and "checksum mismatch" in text and "key=a5" in text, text
    elif flip == "b5":
        assert rc == 0 and "torn write" in text and "key=b5" in text, text
        rc, text = run("fsck", path, "--deep")  # the same answer (it called it an error)
        assert rc == 0 and "torn write" in text, text
    else:
        assert rc == 0 and "ok" in text and "mismatch" not in text, text


@pytest.mark.parametrize("what", ["the closing SYNC record", "a record a SYNC record vouches for"])
@pytest.mark.parametrize("deep", [False, True])
def test_fsck_says_of_damage_in_the_last_segment_what_a_writer_does_with_it(tmp_path, what, deep):
    """fsck called damage in the last segment an error whenever a valid record header lay after
    it -- a PAD record is enough -- while a writer opening the store cuts it as a torn write when
    no SYNC record (nor the index) vouches for it, as it does for the SYNC record a clean close
    writes last; --deep was no better.  It now applies recovery's rule (SPEC.md §7.3).  Twin:
    damage to a record that the closing SYNC record vouches for is an error (recover repairs
    it)."""
    path = str(tmp_path / "s")
    with tierstore.open(path) as s:
        for i in range(5):
            s.put(f"k{i}", Blob(bytes([i]) * 1000))
        at = s.info("k3")
    (seg,) = segment_files(path)
    from tierstore.engine import segment as seglib
    from tierstore.engine.fileio import PosixIO

    io = PosixIO()
    fd = seglib.open_segment(io, seg)
    try:
        syncs = [off for off, h in seglib.SegmentScanner(io, fd, 1, path=seg).records() if h.type == 0x8006]
    finally:
        io.close(fd)
    off = syncs[-1] if what == "the closing SYNC record" else at.offset
    with open(seg, "r+b") as f:
        f.seek(off + 20)  # inside the record header: its checksum fails
        b = f.read(1)
        f.seek(off + 20)
        f.write(bytes([b[0] ^ 0xFF]))
    rc, text = run("fsck", path, *(["--deep"] if deep else []))
    if what == "the closing SYNC record":
        assert rc == 0 and "torn write" in text, text
        with tierstore.open(path) as s:  # the writer cuts it, every object is kept
            assert [s.get(f"k{i}").data[:1] for i in range(5)] == [bytes([i]) for i in range(5)]
        assert run("fsck", path)[0] == 0
    else:
        assert rc == 1 and "was synced" in text, text
        rc, text = run("recover", path)  # the header comes back from the index's copy of it
        assert "the object is kept" in text and "is gone" not in text, text  # (it said both)
        assert run("fsck", path)[0] == 0
        with tierstore.open(path) as s:
            assert [s.get(f"k{i}").data[:1] for i in range(5)] == [bytes([i]) for i in range(5)]


def test_fsck_past_damage_in_a_sealed_segment_reports_no_false_unindexed_records(tmp_path):
    """A damaged record header in a sealed segment stops fsck's scan of it; a key deleted after
    the damage was then reported "live record is not indexed" (the index was right), and a text
    key was shown as bytes (a cold review, 2026-12-03).  The damage is the error; the comparison
    that cannot be made is said to be skipped."""
    path = str(tmp_path / "s")
    with tierstore.open(path, segment_bytes=65536) as s:
        s.put("y", Blob(b"Y" * 10))
        s.put("z", Blob(b"Z" * 10))
        s.delete("y")
        at = s.info("z")
        s.put("fill", Blob(b"f" * 70000))  # seals the segment
    with open(os.path.join(path, "segments", f"{at.segment:016x}.tseg"), "r+b") as f:
        f.seek(at.offset + 5)  # the header's checksum
        b = f.read(1)
        f.seek(at.offset + 5)
        f.write(bytes([b[0] ^ 1]))
    rc, text = run("fsck", path)
    assert rc == 1 and "log damaged" in text, text
    assert "not indexed" not in text and "key=0x79" not in text, text
    assert "were not looked for in the index" in text


def test_dump_exits_1_for_a_sealed_segment_cut_mid_record(tmp_path):
    """A torn end is a crash's cut of the log's last segment; in a sealed segment it is damage,
    and `dump STORE` said it (end: torn) but exited 0 (a cold review, 2026-12-03).  Twin: the
    intact store exits 0."""
    path = str(tmp_path / "s")
    with tierstore.open(path, segment_bytes=16384) as s:
        for i in range(6):
            s.put(f"k{i}", Blob(bytes([65 + i]) * 9000))
    assert run("dump", path)[0] == 0
    segs = segment_files(path)
    assert len(segs) > 2
    with open(segs[1], "r+b") as f:
        f.truncate(os.path.getsize(segs[1]) - 3000)
    rc, text = run("dump", path)
    assert rc == 1 and "torn" in text, text


def test_dump_of_a_file_that_is_no_segment_is_bad_input(tmp_path, filled):
    """(A new user: `dump writer.py` exited 1, the code of damage found.)  Its twin: a segment copied
    under another name, its header damaged, is damage (exit 1)."""
    other = tmp_path / "writer.py"
    other.write_text("print('hello')\n")
    code, out = run("dump", str(other))
    assert code == 2 and "is not a segment file" in out
    (seg,) = segment_files(filled)
    copy = tmp_path / "copy-of-segment"
    with open(seg, "rb") as f:
        data = bytearray(f.read())
    data[20] ^= 0xFF  # inside the header, past its magic
    copy.write_bytes(bytes(data))
    code, out = run("dump", str(copy))
    assert code == 1 and "bad header" in out


def test_tools_pointed_at_a_directory_that_is_not_a_store_leave_nothing_there(tmp_path):
    """`tierstore compact` of a wrong directory, and open(create=False), exited with "no store"
    and left LOCK, APPEND and COMMIT in it (a new user's try, 2026-12-04); the twin: a store."""
    d = tmp_path / "data"
    d.mkdir()
    (d / "mine.txt").write_text("someone's file")
    rc, text = run("compact", str(d))
    assert rc == 3 and "no store" in text, text
    with pytest.raises(tierstore.StoreNotFound):
        tierstore.open(d, create=False)
    assert sorted(os.listdir(d)) == ["mine.txt"]
    with tierstore.open(tmp_path / "s") as s:
        s.put("k", Blob(b"v"))
    assert run("compact", str(tmp_path / "s"))[0] == 0
