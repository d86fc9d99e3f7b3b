"""``tierstore demo``: the main job end to end, with what happened and how long it took.

Writes a Llama-3-8B-shaped prompt's KV cache (chunks of 256 tokens), a shard of embeddings
with ids and a few blobs; reads them back whole and in part; closes and reopens the store
(a restart) and checks everything is still there, bit for bit; then runs fsck.  It uses only
the public API and the repair tools, and writes only under the path it is given.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from typing import Any

import numpy as np

from .. import open as open_store
from ..engine import repair
from ..objects import Blob, KVCache, Vectors

LAYERS, KV_HEADS, HEAD_DIM, CHUNK_TOKENS = 32, 8, 128, 256  # Llama-3-8B, 256-token chunks: 32 MiB fp16


def chunk_hashes(tokens: np.ndarray, chunk_tokens: int, salt: bytes) -> list[bytes]:
    """Chained chunk keys: each covers its parent's key, so equal keys mean equal prefixes."""
    out, parent = [], salt
    for i in range(0, len(tokens) - chunk_tokens + 1, chunk_tokens):
        parent = hashlib.sha256(parent + tokens[i : i + chunk_tokens].astype("<u4").tobytes()).digest()
        out.append(parent)
    return out


def run_demo(path: str, *, quiet: bool = False, chunks: int = 4) -> dict[str, Any]:
    say = (lambda *a: None) if quiet else print
    if os.path.exists(path):
        shutil.rmtree(path)
    rng = np.random.default_rng(2026)
    tokens = rng.integers(0, 128_000, size=chunks * CHUNK_TOKENS)
    keys = chunk_hashes(tokens, CHUNK_TOKENS, b"llama3-8b/tp1")
    kv = [rng.standard_normal((LAYERS, 2, KV_HEADS, CHUNK_TOKENS, HEAD_DIM), dtype=np.float32).astype(np.float16)
          for _ in keys]
    emb = rng.standard_normal((10_000, 384), dtype=np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    emb = emb.astype(np.float16)
    ids = np.arange(1_000_000, 1_010_000, dtype=np.int64)
    png = b"\x89PNG\r\n\x1a\n" + rng.bytes(200_000)
    note = json.dumps({"role": "user", "text": "remember that the launch moved to Tuesday"}).encode()
    result: dict[str, Any] = {"path": path, "timings_ms": {}}
    t = result["timings_ms"]

    def timed(name: str, fn: Any) -> Any:
        t0 = time.perf_counter()
        out = fn()
        t[name] = round((time.perf_counter() - t0) * 1e3, 2)
        return out

    say(f"tierstore demo: store at {path}")
    with open_store(path, durability="sync") as store:
        for i, (k, chunk) in enumerate(zip(keys, kv)):
            timed(f"put kv chunk {i} (32 MiB, durable)",
                  lambda k=k, chunk=chunk: store.put(k, KVCache(chunk), namespace="llama3-8b"))
        say(f"  put {len(keys)} KV chunks [32 layers, 2, 8 heads, 256 tokens, 128] fp16 = "
            f"{kv[0].nbytes / 2**20:.0f} MiB each, durable (fdatasync) on return: "
            + ", ".join(f"{v:.0f} ms" for n, v in t.items() if n.startswith("put kv")))
        timed("put vectors (7.3 MiB)", lambda: store.put("doc-17", Vectors(emb, ids=ids), namespace="rag"))
        timed("put blob png (195 KiB)", lambda: store.put("img-3", Blob(png, media_type="image/png")))
        timed("put blob note", lambda: store.put("note-1", Blob(note, media_type="application/json"),
                                                 meta={"session": "s-42"}))
        say(f"  put vectors [10000, 384] fp16 with ids: {t['put vectors (7.3 MiB)']:.1f} ms; "
            f"2 blobs: {t['put blob png (195 KiB)'] + t['put blob note']:.1f} ms")
        got = timed("get kv chunk (full)", lambda: store.get(keys[0], namespace="llama3-8b"))
        assert np.array_equal(got.data, kv[0])
        four = timed("get kv chunk (layers 0-3)", lambda: store.get(keys[1], namespace="llama3-8b", layers=range(0, 4)))
        assert np.array_equal(four.data, kv[1][:4]) and four.layer_start == 0
        rows = timed("get vectors (rows 5, 9, 11)", lambda: store.get("doc-17", namespace="rag", rows=[5, 9, 11]))
        assert np.array_equal(rows.data, emb[[5, 9, 11]]) and list(rows.ids) == list(ids[[5, 9, 11]])
        timed("get vectors (rows 7, 8, 900), again", lambda: store.get("doc-17", namespace="rag", rows=[7, 8, 900]))
        say(f"  get full chunk {t['get kv chunk (full)']:.1f} ms; layers 0-3 only "
            f"{t['get kv chunk (layers 0-3)']:.1f} ms (reads 4 of 32 layers); 3 vector rows "
            f"{t['get vectors (rows 5, 9, 11)']:.2f} ms (the first rows= call; "
            f"{t['get vectors (rows 7, 8, 900), again']:.2f} ms the next)")
        info = store.info(keys[0], namespace="llama3-8b")
        say(f"  info: kind={info.kind} shape={list(info.shape)} dtype={info.dtype} codec={info.codec} "
            f"checksum={info.checksum} segment={info.segment} offset={info.offset}")
        result["info"] = {"kind": info.kind, "shape": list(info.shape), "dtype": info.dtype, "codec": info.codec,
                          "checksum": info.checksum, "stored_bytes": info.stored_bytes}
    # a restart: everything is read back from disk by a fresh handle
    with open_store(path) as store:
        for k, chunk in zip(keys, kv):
            assert np.array_equal(store.get(k, namespace="llama3-8b").data, chunk)
        assert np.array_equal(store.get("doc-17", namespace="rag").data, emb)
        assert store.get("img-3").data == png and store.get("note-1").data == note
        assert store.info("note-1").meta == {"session": "s-42"}
        st = store.stats()
        say(f"  reopened (a restart): {st['objects_indexed']} objects, all bit-exact; "
            f"{st['segment_bytes'] / 2**20:.0f} MiB in {st['segments']} segment(s); "
            f"replayed {st['recovery']['replayed_records']} log records on open")
    result["stats"] = {k: st[k] for k in ("objects_indexed", "segments", "segment_bytes", "live_bytes")}
    report = repair.fsck(path, deep=True)
    say(f"  fsck --deep: {'ok' if report.ok else 'ERRORS'} ({report.bytes_verified / 2**20:.0f} MiB verified)")
    result["fsck_ok"] = report.ok
    cli = "tierstore" if shutil.which("tierstore") else f"{sys.executable} -m tierstore"
    say(f"done: run `{cli} ls {path}` or `{cli} fsck {path} --deep` to look around")
    return result
