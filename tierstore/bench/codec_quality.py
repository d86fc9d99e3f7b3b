"""The codecs section of ``tierstore bench``: every codec on the real K/V and embedding sample (ratio,
encode / decode speed, error, recall).  It reads the sample and never writes a store.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np


def sample_paths() -> tuple[str, str]:
    """The real K/V and embedding sample: the project's full one when present, else the slice
    kept in tests/data (128 tokens, 1,024 embeddings)."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
    full = os.path.join(os.path.dirname(here), "shared", "data")
    if os.path.exists(os.path.join(full, "minilm_qkv_sample.npz")):
        return os.path.join(full, "minilm_qkv_sample.npz"), os.path.join(full, "minilm_embeddings_8k_fp16.npy")
    return (os.path.join(here, "tests", "data", "minilm_qkv_128tok.npz"),
            os.path.join(here, "tests", "data", "minilm_embeddings_1k_fp16.npy"))


def bench_codecs(say: Callable[..., None]) -> dict[str, Any]:
    """Every codec on the real sample: ratio, encode / decode MB/s (one thread, of fp16 bytes),
    relative L2 error, attention-output error (KV) and recall@10 against exact search (vectors)."""
    from .. import codecs

    kv_path, emb_path = sample_paths()
    npz = np.load(kv_path)
    if "kv" in npz:  # the slice in tests/data: [layers, 2, H, T, D] and its queries [layers, H, T, D]
        pairs = [(npz["kv"], npz["q"] if "q" in npz.files else None)]
    else:
        docs = sorted({k.rsplit("_", 1)[0] for k in npz.files})
        pairs = [(np.stack([npz[d + "_k"], npz[d + "_v"]], axis=1), npz[d + "_q"]) for d in docs]
    out: dict[str, Any] = {"kv_sample": os.path.basename(kv_path), "kv_shape": list(pairs[0][0].shape),
                           "kv": [], "vectors": []}
    kv_specs = ["raw", "zstd", "shuffle+zstd", "fp8", "int8", "int8+zstd", "int4", "int4+zstd", "int2", "int2+zstd",
                "kvq-ans:bins=64/32", "kvq-ans", "kvq-ans:bins=12/12"]
    codecs.evaluate("kvq-ans", pairs[0][0][:1])  # warm-up: numba compiles (or loads) the rANS loops once
    for spec in kv_specs:
        runs = [codecs.evaluate(spec, kv, queries=q) for kv, q in pairs]
        row = {k: round(float(np.mean([r[k] for r in runs])), 1 if k.endswith("mb_s") else 5)
               for k in ("ratio", "encode_mb_s", "decode_mb_s", "rel_l2", "attention_error")}
        row["codec"] = runs[0]["codec"]
        out["kv"].append(row)
        say(f"  kv {row['codec']:>22}: {row['ratio']:.3f}x, enc {row['encode_mb_s']:.0f} / dec "
            f"{row['decode_mb_s']:.0f} MB/s, attention error {row['attention_error'] * 100:.2f}%")
    emb = np.load(emb_path)
    nq = min(1000, len(emb) // 5)
    q, db = emb[:nq].astype(np.float32), np.ascontiguousarray(emb[nq:])
    exact_scores = q @ db.astype(np.float32).T
    exact = np.argsort(-exact_scores, axis=1)[:, :10]

    def recall(scores: np.ndarray, rescore: int = 0) -> float:
        if rescore:
            cand = np.argsort(-scores, axis=1)[:, : 10 * rescore]
            got = np.take_along_axis(cand, np.argsort(-np.take_along_axis(exact_scores, cand, 1), 1)[:, :10], 1)
        else:
            got = np.argsort(-scores, axis=1)[:, :10]
        return float(np.mean([len(set(a) & set(b)) / 10 for a, b in zip(exact, got)]))

    for spec in ["raw", "shuffle+zstd", "int8", "int8+zstd", "binary"]:
        r = codecs.evaluate(spec, db, kind="vectors")
        ch = codecs.parse(spec, "vectors")
        ext = codecs.Extent("vectors", db.shape, "float16")
        dec = codecs.decode(ch.codec, codecs.encode(ch.codec, db.reshape(-1).view(np.uint8), ext, ch.params), ext,
                            ch.params).view("<f2").reshape(db.shape).astype(np.float32)
        scores = q @ dec.T
        row = {"codec": r["codec"], "ratio": r["ratio"], "encode_mb_s": r["encode_mb_s"],
               "decode_mb_s": r["decode_mb_s"], "recall_at_10": round(recall(scores), 4),
               "recall_at_10_rescored_4x": round(recall(scores, 4), 4)}
        out["vectors"].append(row)
        say(f"  vectors {row['codec']:>16}: {row['ratio']:.3f}x, R@10 {row['recall_at_10']} "
            f"(re-scored 4x: {row['recall_at_10_rescored_4x']})")
    out["vectors_sample"] = {"database": int(len(db)), "queries": int(nq), "dim": int(db.shape[1])}
    return out
