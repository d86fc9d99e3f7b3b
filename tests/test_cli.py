"""The `tierstore` command on real stores: exit codes, --json, fsck/recover/ls/stats, demo, bench."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import tierstore
from tierstore import Blob, KVCache, Vectors
from tierstore.bench import bench_blobs, bench_chunk
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
    assert code == 1 and not json.loads(out)["ok"]


def test_output_into_a_closed_pipe_stops_quietly(store_path):
    """`tierstore ls PATH | head -1`: no traceback, no error message, exit code 0."""
    with tierstore.open(store_path, durability="none") as s:
        for i in range(3000):  # a listing well over a pipe buffer (64 KiB)
            s.put(f"a-rather-long-key-name-so-the-listing-is-large-{i:06d}", Blob(b"x"))
    proc = subprocess.Popen([sys.executable, "-m", "tierstore", "ls", store_path],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline().startswith(b"default\t")
    proc.stdout.close()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and err == b"", err


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
    assert code == 0 and "exit codes" in out and "fsck found errors" in out


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
