"""Write the golden stores of the current format version into format/v<MAJOR>/ (run by hand).

    python format/make_golden.py            # refuses to overwrite existing golden files
    python format/make_golden.py --force    # only when a format version is being created

Golden files are frozen: once a version's files are committed, every later tierstore must read
them (tests/test_golden.py); the test suite never regenerates them.  Each case is a store
directory holding only ``segments/`` (the index is derived data and not portable), plus
``expected.json`` (every live object and its metadata) and ``arrays/*.npy`` / ``blobs/*.bin``
(the exact decoded contents).  Content is deterministic; store ids and times are not.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tierstore  # noqa: E402
from tierstore import Blob, KVCache, MLACache, Vectors  # noqa: E402
from tierstore.format import constants as fmt  # noqa: E402

HERE = Path(__file__).resolve().parent
# format/v1/ holds the stores of 1.0; each minor version since has its own directory
OUT = HERE / (f"v{fmt.FORMAT_MAJOR}" if fmt.FORMAT_MINOR == 0 else f"v{fmt.FORMAT_MAJOR}.{fmt.FORMAT_MINOR}")


def _torch() -> Any:
    import torch

    return torch


def objects(rng: np.random.Generator) -> list[tuple[str, str | bytes, Any, dict[str, Any] | None]]:
    """(namespace, key, object, meta) covering every kind, dtype and blob size class of v1."""
    torch = _torch()
    kv = rng.standard_normal((2, 2, 2, 8, 4)).astype(np.float32)
    items: list[tuple[str, str | bytes, Any, dict[str, Any] | None]] = [
        ("llama", b"\x00\x01chunk-fp16", KVCache(kv.astype(np.float16), layer_start=4), {"tokens": [0, 8]}),
        ("llama", "chunk-fp32", KVCache(kv), None),
        ("llama", "chunk-f64", KVCache(kv.astype(np.float64)), None),
        ("llama", "chunk-bf16", KVCache(torch.from_numpy(kv).to(torch.bfloat16)), None),
        ("llama", "chunk-e4m3", KVCache(torch.from_numpy(kv).to(torch.float8_e4m3fn)), None),
        ("llama", "chunk-e5m2", KVCache(torch.from_numpy(kv).to(torch.float8_e5m2)), None),
        ("rag", "emb-ids", Vectors(rng.standard_normal((37, 16)).astype(np.float16), ids=np.arange(37) * 7 + 1,
                                   metric="ip"), {"source": "doc-17"}),
        ("rag", "emb-noids", Vectors(rng.standard_normal((5, 8)).astype(np.float32), metric="l2"), None),
        ("rag", "emb-int8", Vectors(rng.integers(-128, 127, (9, 32)).astype(np.int8)), None),
        ("rag", "emb-uint8", Vectors(rng.integers(0, 255, (3, 16)).astype(np.uint8), metric="cosine"), None),
        ("default", "blob-empty", Blob(b""), None),
        ("default", "blob-small", Blob(b"hello, tierstore", media_type="text/plain"), {"n": 1, "ok": True}),
        ("default", "blob-page", Blob(bytes(range(256)) * 16, media_type="application/octet-stream"), None),
        ("default", "blob-big", Blob(rng.bytes(10_000), media_type="image/png"), None),
        ("default", "ünïcode-kéy", Blob("ünïcode".encode(), media_type="text/plain; charset=utf-8"), None),
        ("special", "nan-inf", Vectors(np.array([[np.nan, np.inf, -np.inf, -0.0, 1e-45, 65504]], np.float32)), None),
    ]
    return items


def write_sessions(s: tierstore.Store, rng: np.random.Generator, *, torn: bool) -> None:
    """Format 1.1: references and groups (SPEC.md §5.4, §7.7): de-duplicated puts, an anchored
    object, a dropped session, a deleted referenced object, prefix-style chunk keys."""
    hashes = tierstore.chunk_hashes(list(range(64)), chunk_tokens=16, salt="golden")
    chunks = [KVCache(rng.standard_normal((2, 2, 2, 16, 8)).astype(np.float16)) for _ in hashes]
    for sess, n in (("s-1", 4), ("s-2", 2), ("s-3", 3)):
        for h, c in zip(hashes[:n], chunks[:n]):
            s.put(h, c, namespace="prefix", session=sess)
    s.put("system", Blob(b"a system prompt shared by every session"), namespace="prefix")
    s.put("system", Blob(b"a system prompt shared by every session"), namespace="prefix", session="s-2")
    s.drop_session("s-3", namespace="prefix")
    s.put("scratch", Blob(b"deleted with its references"), namespace="prefix", session="s-1")
    s.delete("scratch", namespace="prefix")
    if torn:
        s.put(hashes[3], chunks[3], namespace="prefix", session="s-2")  # only a reference: cut below


def write_codecs(s: tierstore.Store, rng: np.random.Generator) -> None:
    """Format 1.2: every registered codec on every kind it applies to (SPEC.md §6)."""
    from tierstore import codecs
    kv = rng.standard_normal((2, 2, 2, 40, 24)).astype(np.float16)  # 40 tokens, 24 dims: partial groups
    vec = rng.standard_normal((50, 20)).astype(np.float32)
    torch = _torch()
    for c in codecs.available():
        for kind in c["kinds"]:
            for spec in [c["name"]] + ([c["name"] + "+zstd"] if c["id"] in codecs.POST_ZSTD else []):
                key = f"{kind}-{spec}"
                if kind == "kv":
                    s.put(key, KVCache(kv, layer_start=3), namespace="codecs", codec=spec)
                    if not c["lossless"]:
                        s.put(key + "-bf16", KVCache(torch.from_numpy(kv.astype(np.float32)).to(torch.bfloat16)),
                              namespace="codecs", codec=spec)
                elif kind == "vectors":
                    s.put(key, Vectors(vec, ids=np.arange(50) * 3 - 7), namespace="codecs", codec=spec)
                elif kind == "mla":
                    continue  # format 1.4: write_mla
                else:
                    s.put(key, Blob(b"a compressible blob " * 300), namespace="codecs", codec=spec)
    s.put("kv-int4-group8", KVCache(kv), namespace="codecs", codec="int4:group=8")
    samples = [json.dumps({"turn": i, "role": ("user", "assistant")[i % 2],
                           "text": f"message {i * 7919 % 1000}"}).encode() for i in range(400)]
    did = s.train_dictionary(samples[:300], namespace="codecs", size=2048)
    for i in (300, 301, 399):
        s.put(f"blob-zstd-dict-{i}", Blob(samples[i], media_type="application/json"), namespace="codecs",
              codec=f"zstd:dict={did}")
    s.put("png-zstd", Blob(b"\x89PNG not recompressed" * 100, media_type="image/png"), namespace="codecs",
          codec="zstd")


def write_mla(s: tierstore.Store, rng: np.random.Generator) -> None:
    """Format 1.4: latent (MLA) caches in every dtype and with every codec that applies (SPEC.md §5.3, §6.3)."""
    from tierstore import codecs
    torch = _torch()
    lat = rng.standard_normal((3, 40, 24)).astype(np.float32)  # 3 layers, 40 tokens, dim 24
    lat[1, 7] = 0.0  # a token whose latent is all zeros: scale code 0
    lat[2, 3, :12] = -0.0  # negative zeros
    lat[2, 3, 12:] = np.linspace(-1, 1, 12) * 1e-3  # with 1e-3 beside them: fp8 subnormal codes, small int8 codes
    lat[0, 9, 0] = 200.0  # one large value: the rest of its token quantises coarsely
    s.put("mla-fp16", MLACache(lat.astype(np.float16), layer_start=5), namespace="mla", meta={"model": "tiny-mla"})
    s.put("mla-fp32", MLACache(lat), namespace="mla")
    s.put("mla-bf16", MLACache(torch.from_numpy(lat).to(torch.bfloat16)), namespace="mla")
    s.put("mla-e4m3", MLACache(torch.from_numpy(lat).to(torch.float8_e4m3fn)), namespace="mla")
    for c in codecs.available():
        if "mla" not in c["kinds"] or c["name"] == "raw":
            continue
        for spec in [c["name"]] + ([c["name"] + "+zstd"] if c["id"] in codecs.POST_ZSTD else []):
            s.put(f"mla-{spec}", MLACache(lat.astype(np.float16), layer_start=2), namespace="codecs", codec=spec)
            if not c["lossless"]:
                s.put(f"mla-{spec}-bf16", MLACache(torch.from_numpy(lat).to(torch.bfloat16)), namespace="codecs",
                      codec=spec)
                s.put(f"mla-{spec}-fp32", MLACache(lat), namespace="codecs", codec=spec)


def write_case(name: str, *, segment_bytes: int = 1 << 20, torn: bool = False, compact: bool = False,
               sessions: bool = False, codecs: bool = False, damaged: bool = False, mla: bool = False,
               damaged_header: bool = False) -> None:
    rng = np.random.default_rng(2026)
    root = OUT / name
    store_dir = root / "store"
    with tierstore.open(store_dir, segment_bytes=segment_bytes) as s:
        for ns, key, obj, meta in objects(rng):
            s.put(key, obj, namespace=ns, meta=meta)
        s.put("to-delete", Blob(b"gone"))
        s.put("chunk-fp32", Blob(b"overwritten: a KV chunk replaced by a blob"), namespace="llama")
        s.delete("to-delete")
        if sessions:
            write_sessions(s, rng, torn=torn)
        if codecs:
            write_codecs(s, rng)
        if mla:
            write_mla(s, rng)
        if compact:
            s.compact()
            s.put("after-compaction", Blob(b"written after compaction"))
        if damaged:  # 1.3: a synced record of the last segment, damaged below; records after it
            s.put("damaged", Blob(b"a synced record whose payload is damaged " * 200))
            s.put("after-damage", Blob(b"written after it, and kept"))
            damaged_at = s.info("damaged")
        if damaged_header:  # 1.5: a record of a sealed segment whose header is damaged below
            s.put("header-damaged", Blob(b"its header is damaged; a HEADERS record holds a copy " * 200))
            header_at = s.info("header-damaged")
            for i in range(4):
                s.put(f"after-header-{i}", Blob(bytes([i]) * 30000))
        if torn and sessions:
            s.put("torn", Blob(b"a group cut after its object" * 200), session="s-9")
        elif torn:
            s.put("torn", Blob(b"this record is cut by the torn tail" * 200))
    if torn and sessions:  # cut the group between its object and its reference
        last = sorted((store_dir / "segments").iterdir())[-1]
        with open(last, "r+b") as f:
            f.truncate(last.stat().st_size - 4096)
    elif torn:
        segs = sorted((store_dir / "segments").iterdir())
        last = segs[-1]
        size = last.stat().st_size
        with open(last, "r+b") as f:
            f.truncate(size - 3000)  # cut the last record: a crash mid-append
    if damaged:  # flip one payload byte: the SYNC records after it say it was synced
        seg = store_dir / "segments" / f"{damaged_at.segment:016x}.tseg"
        with open(seg, "r+b") as f:
            f.seek(damaged_at.offset + 4096 + 100)
            b = f.read(1)
            f.seek(damaged_at.offset + 4096 + 100)
            f.write(bytes([b[0] ^ 0x20]))
    if damaged_header:  # flip one byte of its fixed header (its checksum fails): read with the copy
        with open(store_dir / "segments" / f"{header_at.segment:016x}.tseg", "r+b") as f:
            f.seek(header_at.offset + 20)
            b = f.read(1)
            f.seek(header_at.offset + 20)
            f.write(bytes([b[0] ^ 0x20]))
    shutil.rmtree(store_dir / "index")
    os.remove(store_dir / "LOCK")
    for coordination in ("APPEND", "COMPACT", "COMMIT"):  # several writers' coordination files (SPEC.md §1): not format
        if (store_dir / coordination).exists():
            os.remove(store_dir / coordination)
    if (store_dir / fmt.RESERVE_FILE).exists():
        os.remove(store_dir / fmt.RESERVE_FILE)
    expected = describe_with_engine(store_dir, root)
    (root / "expected.json").write_text(json.dumps(expected, indent=2, ensure_ascii=False) + "\n")
    if sessions:
        (root / "references.json").write_text(json.dumps(references_with_engine(store_dir, root), indent=2) + "\n")


def references_with_engine(store_dir: Path, root: Path) -> list[dict[str, Any]]:
    """Every object's sessions ("" is the anchor: it was also put without a session)."""
    tmp = root / "tmp-open"
    shutil.copytree(store_dir, tmp)
    out = []
    with tierstore.open(tmp) as s:
        for ns in s.namespaces():
            for key in s.keys(namespace=ns):
                k = key.encode() if isinstance(key, str) else key
                sessions = sorted("" if x == fmt.ANCHOR_SESSION else x.decode()
                                  for x in s._engine.sessions_of(ns.encode(), k))
                if sessions:
                    out.append({"namespace": ns, "key": key if isinstance(key, str) else "0x" + key.hex(),
                                "sessions": sessions})
    shutil.rmtree(tmp)
    return out


def describe_with_engine(store_dir: Path, root: Path) -> list[dict[str, Any]]:
    """Expected content, written with the engine right after the store was made."""
    tmp = root / "tmp-open"
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(store_dir, tmp)
    out = []
    (root / "arrays").mkdir(exist_ok=True)
    (root / "blobs").mkdir(exist_ok=True)
    with tierstore.open(tmp, readonly=False) as s:
        for ns in s.namespaces():
            for key in s.keys(namespace=ns):
                info = s.info(key, namespace=ns)
                item: dict[str, Any] = {
                    "namespace": ns, "key": key if isinstance(key, str) else "0x" + key.hex(),
                    "key_type": "str" if isinstance(key, str) else "bytes", "kind": info.kind, "meta": info.meta,
                }
                try:
                    obj = s.get(key, namespace=ns)
                except tierstore.CorruptionError:  # 1.3: a damaged synced record: listed, unreadable
                    out.append({**item, "unreadable": True})
                    continue
                fname = hashlib.sha256(f"{ns}/{key!r}".encode()).hexdigest()[:16]
                if info.codec != "raw":
                    item["codec"] = info.codec
                if isinstance(obj, Blob):
                    (root / "blobs" / f"{fname}.bin").write_bytes(obj.data)
                    item.update(media_type=obj.media_type, size=len(obj.data), file=f"blobs/{fname}.bin",
                                sha256=hashlib.sha256(obj.data).hexdigest())
                else:
                    raw = _raw_numpy(obj.data)
                    np.save(root / "arrays" / f"{fname}.npy", raw)
                    item.update(dtype=info.dtype, shape=list(info.shape), file=f"arrays/{fname}.npy",
                                sha256=hashlib.sha256(raw.tobytes()).hexdigest())
                    if isinstance(obj, (KVCache, MLACache)):
                        item["layer_start"] = obj.layer_start
                    else:
                        item["metric"] = obj.metric
                        if obj.ids is not None:
                            ids = _raw_numpy(obj.ids)
                            np.save(root / "arrays" / f"{fname}.ids.npy", ids)
                            item["ids_file"] = f"arrays/{fname}.ids.npy"
                out.append(item)
    shutil.rmtree(tmp)
    return out


def _raw_numpy(x: Any) -> np.ndarray:
    """Array bytes as numpy with the storage dtype of SPEC.md §5.2 (bf16 -> <u2, fp8 -> u1)."""
    torch = _torch()
    if isinstance(x, torch.Tensor):
        if x.dtype in (torch.bfloat16,):
            return x.view(torch.int16).numpy().view("<u2")
        if x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            return x.view(torch.uint8).numpy()
        return x.numpy()
    return np.asarray(x)


CASES = {
    "kinds": {},
    "multi_segment": {"segment_bytes": 64 << 10},
    "torn_tail": {"torn": True},
    "compacted": {"segment_bytes": 64 << 10, "compact": True},
}
if fmt.FORMAT_MINOR == 1:  # 1.1: references and groups
    CASES.update({
        "sessions": {"sessions": True, "segment_bytes": 64 << 10, "compact": True},
        "torn_group": {"sessions": True, "torn": True},
    })
if fmt.FORMAT_MINOR == 2:  # 1.2: codecs (the 1.1 cases are not written again)
    CASES = {"kinds": {}, "codecs": {"codecs": True, "segment_bytes": 256 << 10, "compact": True}}
if fmt.FORMAT_MINOR == 3:  # 1.3: SYNC records, and a damaged synced record that stays (SPEC.md §7.3)
    CASES = {"kinds": {}, "damaged_synced": {"damaged": True, "segment_bytes": 64 << 10}}
if fmt.FORMAT_MINOR == 4:  # 1.4: the mla kind, raw and coded, after a compaction
    CASES = {"kinds": {}, "mla": {"mla": True, "segment_bytes": 64 << 10, "compact": True}}
if fmt.FORMAT_MINOR == 5:  # 1.5: HEADERS records, and a sealed record read with its header's copy (§7.3)
    CASES = {"kinds": {}, "damaged_header": {"damaged_header": True, "segment_bytes": 64 << 10}}


def main(argv: list[str]) -> int:
    if OUT.exists() and "--force" not in argv:
        print(f"{OUT} exists: golden files are frozen (pass --force only when creating a format version)")
        return 1
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    for name, kw in CASES.items():
        write_case(name, **kw)
        print("wrote", OUT / name)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
