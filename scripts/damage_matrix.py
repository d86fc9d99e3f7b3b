"""Damage, region by region and position by position (docs/reliability.md; tests/test_damage_matrix.py
runs a sample of it in CI).

    python scripts/damage_matrix.py [--trials N] [--seed S] [--json]

A store of three segments holds KV chunks, vectors and blobs.  For each region -- segment header,
record header, metadata, an extent, padding, the LMDB index -- and each position -- the first,
a middle and the last segment, and the last record of the log (only the log's final batch
follows it) -- one byte is flipped, ``--trials`` times at random places, in a fresh copy.  A child
process then (1) opens the store and reads every object, (2) does the same with the index
deleted (rebuilt from the log), (3) runs fsck --deep, (4) runs `recover` and reads every object
again.  Per cell: objects lost (not readable after recover) per damaged byte, wrong bytes ever
returned, process crashes, and whether reopen, the rebuilt index and fsck agree.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tierstore  # noqa: E402
from tierstore import Blob, KVCache, Vectors  # noqa: E402
from tierstore.engine import segment as seglib  # noqa: E402
from tierstore.engine.fileio import DEFAULT_IO  # noqa: E402
from tierstore.format import constants as fmt  # noqa: E402

REGIONS = ["segment header", "record header", "metadata", "extent", "padding", "LMDB index"]
POSITIONS = ["first segment", "middle segment", "last segment", "last record", "whole file"]

CHILD = r'''
import json, os, shutil, sys, hashlib
import tierstore
from tierstore.engine import repair
work, expected = sys.argv[1], json.loads(sys.argv[2])

def read(path):
    try:
        s = tierstore.open(path)
    except tierstore.TierstoreError as e:
        return {"refused": type(e).__name__}
    out = {}
    with s:
        for ns in s.namespaces():
            for k in s.keys(namespace=ns):
                try:
                    obj = s.get(k, namespace=ns)
                    data = obj.data if isinstance(obj, tierstore.Blob) else obj.data.tobytes()
                    out[f"{ns}/{k}"] = hashlib.sha256(data).hexdigest()
                except tierstore.CorruptionError:
                    out[f"{ns}/{k}"] = "unreadable"
    return out

rebuilt = work + "-rebuilt"
shutil.copytree(work, rebuilt)
shutil.rmtree(os.path.join(rebuilt, "index"), ignore_errors=True)
res = {"reopen": read(work), "rebuilt": read(rebuilt)}
res["fsck_ok"] = repair.fsck(work, deep=True).ok if "refused" not in res["reopen"] else False
try:
    repair.recover(work)
    res["recovered"] = read(work)
    res["fsck_after_recover"] = repair.fsck(work, deep=True).ok
except tierstore.TierstoreError as e:
    res["recovered"] = {"refused": type(e).__name__}
    res["fsck_after_recover"] = False
print(json.dumps(res))
'''


def build(path: str) -> dict[str, str]:
    """The store, and the SHA-256 of every object's bytes."""
    import hashlib

    rng = np.random.default_rng(0)
    expected: dict[str, str] = {}
    with tierstore.open(path, segment_bytes="32KiB", reserve_bytes=0) as s:
        for i in range(18):
            if i % 3 == 0:
                obj: Any = KVCache(rng.standard_normal((2, 2, 2, 16, 16)).astype(np.float16))
                data = obj.data.tobytes()
            elif i % 3 == 1:
                obj = Vectors(rng.standard_normal((40, 24)).astype(np.float32))
                data = obj.data.tobytes()
            else:
                data = rng.bytes(int(rng.integers(100, 9000)))
                obj = Blob(data)
            s.put(f"o{i:02d}", obj)
            expected[f"default/o{i:02d}"] = hashlib.sha256(data).hexdigest()
    return expected


def rec_end(off: int, h: Any) -> int:
    """Where a record's bytes end (what follows, up to the next record, is padding)."""
    return off + h.record_len


def _records(seg_dir: str, seg: int) -> list[tuple[int, Any]]:
    f = os.path.join(seg_dir, seglib.segment_name(seg))
    fd = os.open(f, os.O_RDONLY)
    try:
        return list(seglib.SegmentScanner(DEFAULT_IO, fd, seg, path=f).records())
    finally:
        os.close(fd)


def regions_of(path: str) -> dict[tuple[str, str], list[tuple[str, int, int]]]:
    """(region, position) -> [(file, start, end)] byte ranges where damage lands there."""
    seg_dir = os.path.join(path, fmt.SEGMENTS_DIR)
    segs = seglib.list_segments(DEFAULT_IO, seg_dir)
    assert len(segs) >= 3, segs
    out: dict[tuple[str, str], list[tuple[str, int, int]]] = {}
    with_puts = [seg for seg in segs if any(h.type == fmt.REC_PUT for _, h in _records(seg_dir, seg))]
    # "last segment": the last that holds objects (a clean close may open one for its SYNC record alone)
    picks = {"first segment": segs[0], "middle segment": segs[len(segs) // 2], "last segment": with_puts[-1]}
    last_put = None
    for position, seg in picks.items():
        f = os.path.join(seg_dir, seglib.segment_name(seg))
        recs = _records(seg_dir, seg)
        puts = [(off, h) for off, h in recs if h.type == fmt.REC_PUT]
        if position == "last segment" and puts:
            last_put = (f, *puts[-1])
            puts = puts[:-1] or puts
        out[("segment header", position)] = [(f, 0, fmt.SEGMENT_HEADER.size)]
        out[("record header", position)] = [(f, off, off + fmt.RECORD_HEADER_SIZE) for off, h in puts]
        meta = []
        for off, h in puts:
            p = off + fmt.RECORD_HEADER_SIZE + len(h.namespace) + len(h.key)
            meta.append((f, p, p + struct.unpack_from("<I", h.raw, 40)[0]))  # meta_len (SPEC.md §4.1)
        out[("metadata", position)] = meta
        out[("extent", position)] = [(f, off + o, off + o + n) for off, h in puts
                                     for o, n in zip(h.offsets, h.extent_lengths)]
        # padding: the bytes between one record's end and the next record (PAD bodies, zero gaps)
        ends = [(rec_end(off, h), nxt) for (off, h), (nxt, _) in zip(recs, recs[1:])]
        out[("padding", position)] = [(f, a, b) for a, b in ends if b - a > fmt.RECORD_HEADER_SIZE]
    if last_put is not None:
        f, off, h = last_put
        out[("record header", "last record")] = [(f, off, off + fmt.RECORD_HEADER_SIZE)]
        out[("extent", "last record")] = [(f, off + o, off + o + n) for o, n in zip(h.offsets, h.extent_lengths)]
        p = off + fmt.RECORD_HEADER_SIZE + len(h.namespace) + len(h.key)
        out[("metadata", "last record")] = [(f, p, p + struct.unpack_from("<I", h.raw, 40)[0])]
    index = os.path.join(path, fmt.INDEX_DIR, "data.mdb")
    out[("LMDB index", "whole file")] = [(index, 0, os.path.getsize(index))]
    return {k: v for k, v in out.items() if v}


def judge(expected: dict[str, str], res: dict[str, Any]) -> dict[str, Any]:
    """lost: objects not readable after recover; wrong: values returned that are not the object's
    (an older version counts); same: the store answers the same with its index and with the index
    rebuilt (or refuses to open both ways until recovered); one_value: no object is ever returned
    with two different values; fsck_clean: fsck --deep is clean after recover."""
    def readable(ans: dict[str, str]) -> set[str]:
        return {k for k, v in ans.items() if expected.get(k) == v}

    answers = (res["reopen"], res["rebuilt"], res["recovered"])
    wrong = sum(1 for ans in answers for k, v in ans.items() if k in expected and v not in (expected[k], "unreadable"))
    lost = len(expected) - len(readable(res["recovered"])) if "refused" not in res["recovered"] else len(expected)
    same = (res["reopen"] == res["rebuilt"]) or ("refused" in res["reopen"] and "refused" in res["rebuilt"])
    refused = any("refused" in a for a in answers[:2])
    values: dict[str, set[str]] = {}
    for ans in answers:
        for k, v in ans.items():
            if v != "unreadable" and k in expected:
                values.setdefault(k, set()).add(v)
    return {"lost": lost, "wrong": wrong, "same": same, "refused": refused,
            "one_value": all(len(v) == 1 for v in values.values()), "fsck_clean": res["fsck_after_recover"]}


def run(trials: int = 3, seed: int = 0, cells: list[tuple[str, str]] | None = None) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    tmp = Path(tempfile.mkdtemp(prefix="tierstore-damage-"))
    try:
        base = str(tmp / "base")
        expected = build(base)
        where = regions_of(base)
        rows = []
        for (region, position), ranges in sorted(where.items(), key=lambda kv: (REGIONS.index(kv[0][0]),
                                                                                 POSITIONS.index(kv[0][1]))):
            if cells is not None and (region, position) not in cells:
                continue
            row = {"region": region, "position": position, "cases": 0, "lost": 0, "wrong": 0, "crashes": 0,
                   "max_lost": 0, "same": 0, "refused": 0, "one_value": 0, "fsck_clean": 0}
            for _ in range(trials):
                work = str(tmp / "work")
                shutil.rmtree(work, ignore_errors=True)
                shutil.rmtree(work + "-rebuilt", ignore_errors=True)
                shutil.copytree(base, work)
                f, lo, hi = rng.choice(ranges)
                at = rng.randrange(lo, hi)
                target = f.replace(base, work)
                with open(target, "r+b") as fh:
                    fh.seek(at)
                    b = fh.read(1)
                    fh.seek(at)
                    fh.write(bytes([b[0] ^ (1 << rng.randrange(8))]))
                proc = subprocess.run([sys.executable, "-c", CHILD, work, json.dumps(expected)], capture_output=True,
                                      text=True, timeout=600)
                row["cases"] += 1
                if proc.returncode != 0:
                    row["crashes"] += 1
                    row.setdefault("errors", []).append(proc.stderr.strip().splitlines()[-1:] if proc.stderr else [])
                    continue
                verdict = judge(expected, json.loads(proc.stdout.strip().splitlines()[-1]))
                for k in ("lost", "wrong", "same", "refused", "one_value", "fsck_clean"):
                    row[k] += verdict[k]
                row["max_lost"] = max(row["max_lost"], verdict["lost"])
            rows.append(row)
        return rows
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| region | position | damaged bytes | objects lost per damaged byte (after recover) | wrong values "
             "returned | process crashes | one value per object | same answer with the index and rebuilt | "
             "open refused until recover | fsck --deep clean after recover |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        n = r["cases"]
        lines.append(f"| {r['region']} | {r['position']} | {n} | {r['lost'] / n:.2f} | {r['wrong']} | {r['crashes']} | "
                     f"{r['one_value']}/{n} | {r['same']}/{n} | {r['refused']}/{n} | {r['fsck_clean']}/{n} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = run(args.trials, args.seed)
    print(json.dumps(rows, indent=2) if args.json else markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
