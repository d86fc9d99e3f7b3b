"""Golden files: every store written by an earlier format version still reads, bit for bit,
with the engine and with the independent reader (format/reference_reader.py).

The golden stores under format/v*/ are frozen; only format/make_golden.py writes them, by hand.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import tierstore
from tierstore import Blob, KVCache, MLACache

from .conftest import HAS_TORCH
from .test_reference_reader import reader

FORMAT = Path(__file__).parent.parent / "format"
CASES = sorted(p for p in FORMAT.glob("v*/*") if (p / "expected.json").exists())


def test_golden_files_exist():
    assert {c.name for c in CASES if c.parent.name == "v1"} >= {"kinds", "multi_segment", "torn_tail", "compacted"}
    assert {c.name for c in CASES if c.parent.name == "v1.1"} >= {"kinds", "sessions", "torn_group"}
    assert {c.name for c in CASES if c.parent.name == "v1.2"} >= {"kinds", "codecs"}
    assert {c.name for c in CASES if c.parent.name == "v1.3"} >= {"kinds", "damaged_synced"}
    assert {c.name for c in CASES if c.parent.name == "v1.4"} >= {"kinds", "mla"}
    assert {c.name for c in CASES if c.parent.name == "v1.5"} >= {"kinds", "damaged_header"}
    from tierstore import codecs
    used = {e.get("codec", "raw").split(":")[0] for c in CASES for e in json.loads((c / "expected.json").read_text())}
    used |= {u.removesuffix("+zstd") for u in used}
    assert {c["name"] for c in codecs.available()} <= used  # every codec


REF_CASES = [c for c in CASES if (c / "references.json").exists()]


def _refs_expected(case):
    return {(e["namespace"], e["key"]): e["sessions"] for e in json.loads((case / "references.json").read_text())}


@pytest.mark.parametrize("case", REF_CASES, ids=[f"{c.parent.name}/{c.name}" for c in REF_CASES])
def test_references_in_golden(case, tmp_path):
    """Format 1.1 stores: every object's sessions, read by the engine and the independent reader."""
    want = _refs_expected(case)
    assert {k: v for k, v in reader.references(str(case / "store")).items()} == want
    work = tmp_path / "store"
    shutil.copytree(case / "store", work)
    with tierstore.open(work) as s:
        got = {}
        for ns in s.namespaces():
            for key in s.keys(namespace=ns):
                k = key.encode() if isinstance(key, str) else key
                sessions = sorted("" if x == b"\x00" else x.decode() for x in s._engine.sessions_of(ns.encode(), k))
                if sessions:
                    got[(ns, key if isinstance(key, str) else "0x" + key.hex())] = sessions
        assert got == want


def _raw(x):
    if isinstance(x, np.ndarray):
        return x
    import torch

    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view("<u2")
    if x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return x.view(torch.uint8).numpy()
    return x.numpy()


def _key(item):
    return item["key"] if item["key_type"] == "str" else bytes.fromhex(item["key"][2:])


@pytest.mark.parametrize("case", CASES, ids=[f"{c.parent.name}/{c.name}" for c in CASES])
def test_engine_reads_golden(case, tmp_path):
    expected = json.loads((case / "expected.json").read_text())
    work = tmp_path / "store"
    shutil.copytree(case / "store", work)  # opening writable rebuilds the index and may cut a torn tail
    with tierstore.open(work) as s:
        got = {(ns, k) for ns in s.namespaces() for k in s.keys(namespace=ns)}
        assert got == {(e["namespace"], _key(e)) for e in expected}
        for e in expected:
            info = s.info(_key(e), namespace=e["namespace"])
            assert info.kind == e["kind"] and info.meta == e["meta"] and info.codec == e.get("codec", "raw")
            if e.get("unreadable"):  # 1.3: a damaged synced record stays, and reads as corruption
                with pytest.raises(tierstore.CorruptionError):
                    s.get(_key(e), namespace=e["namespace"])
                continue
            if e["kind"] == "blob":
                obj = s.get(_key(e), namespace=e["namespace"])
                assert isinstance(obj, Blob) and obj.media_type == e["media_type"]
                assert obj.data == (case / e["file"]).read_bytes()
                continue
            if e["dtype"] in ("bfloat16", "float8_e4m3fn", "float8_e5m2") and not HAS_TORCH:
                continue  # returned as torch tensors; the reference reader covers the bytes below
            obj = s.get(_key(e), namespace=e["namespace"])
            assert info.dtype == e["dtype"] and list(info.shape) == e["shape"]
            raw = _raw(obj.data)
            want = np.load(case / e["file"])
            assert raw.dtype == want.dtype and np.array_equal(raw.view(np.uint8), want.view(np.uint8))
            if isinstance(obj, (KVCache, MLACache)):
                assert obj.layer_start == e["layer_start"] and obj.kind == e["kind"]
            else:
                assert obj.metric == e["metric"]
                if "ids_file" in e:
                    assert np.array_equal(_raw(obj.ids), np.load(case / e["ids_file"]))
                else:
                    assert obj.ids is None


@pytest.mark.parametrize("case", CASES, ids=[f"{c.parent.name}/{c.name}" for c in CASES])
def test_reference_reader_reads_golden(case):
    expected = {(e["namespace"], e["key"]): e for e in json.loads((case / "expected.json").read_text())}
    full_state, files = reader.scan(str(case / "store"))
    state = full_state
    def name(ns: bytes, k: bytes, flags: int) -> tuple[str, str]:
        return ns.decode(), k.decode() if flags & 1 else "0x" + k.hex()

    state = {(ns, k): r for (ns, k), r in state.items() if not ns.startswith(b"\x00")}  # references: above
    assert {name(ns, k, r.flags) for (ns, k), r in state.items()} == set(expected)
    for (ns, k), r in state.items():
        e = expected[name(ns, k, r.flags)]
        if e.get("unreadable"):
            with pytest.raises(reader.FormatError):
                reader.decode(r, files[r.segment], reader.dictionary_for(r, full_state, files))
            continue
        obj = reader.decode(r, files[r.segment], reader.dictionary_for(r, full_state, files))
        if e["kind"] == "blob":
            assert hashlib.sha256(obj).hexdigest() == e["sha256"]
        else:
            arr = obj if e["kind"] in ("kv", "mla") else obj[0]
            assert hashlib.sha256(arr.tobytes()).hexdigest() == e["sha256"]
            assert list(arr.shape) == e["shape"] and r.meta.get("meta", {}) == e["meta"]
