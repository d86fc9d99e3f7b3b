"""The transformers section of ``tierstore bench``: time to first token on the CPU for a
random-weight Llama-style model, recomputing a long prompt vs loading its stored prefix with
``PrefixCache`` (from the segments, cold, and from the DRAM tier), and the load against the
store's plain ``get`` of the same chunks.  It measures and reports; it never asserts.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable
from typing import Any

from .. import open as open_store
from .common import drop_pages, median_ms


def bench_transformers(root: str, *, quick: bool, say: Callable[..., None]) -> dict[str, Any]:
    import torch
    import transformers

    from ..integrations.transformers import PrefixCache

    layers, prompt, stored = (6, 2048, 1792) if quick else (12, 4096, 3840)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=768, intermediate_size=2048,
                                   num_attention_heads=12, num_key_value_heads=4, vocab_size=32000,
                                   max_position_embeddings=prompt + 64)
    model = transformers.LlamaForCausalLM(cfg).eval()
    params = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, cfg.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(1))
    reps = 1 if quick else 2
    out: dict[str, Any] = {"layers": layers, "params_m": round(params / 1e6, 1), "prompt_tokens": prompt,
                           "stored_tokens": stored, "dtype": "float32", "threads": torch.get_num_threads()}
    path = os.path.join(root, "ts-ttft")
    with open_store(path) as store, torch.no_grad():
        pc = PrefixCache(store, model, chunk_tokens=256)
        kw = pc.cache_argument
        full = []
        for _ in range(reps):
            gc.collect()
            t0 = time.perf_counter()
            model(ids, logits_to_keep=1)
            full.append(time.perf_counter() - t0)
        cache = transformers.DynamicCache(config=model.config)
        model(ids[:, :stored], **{kw: cache})
        pc.save(ids[:, :stored], cache)
        store.flush()
        del cache
        hashes = pc.hashes(ids[0, :stored])
        segs = [os.path.join(path, "segments", n) for n in os.listdir(os.path.join(path, "segments"))]
        t: dict[str, list[float]] = {k: [] for k in ("load_cold", "ttft_cold", "load_warm", "ttft_warm", "get_cold",
                                                     "get_warm", "ttft_cold_behind", "ttft_warm_behind")}
        for _ in range(reps):
            for mode in ("cold", "warm", "cold_behind", "warm_behind"):
                if mode.startswith("cold"):
                    store.drop_cached()
                    for s in segs:
                        drop_pages(s)
                gc.collect()
                t0 = time.perf_counter()
                cache, n = pc.load(ids, background=mode.endswith("behind"))  # behind: layer i+1 read while i computes
                t1 = time.perf_counter()
                model(ids[:, n:], logits_to_keep=1, **{kw: cache})
                t2 = time.perf_counter()
                assert n == stored
                if not mode.endswith("behind"):
                    t[f"load_{mode}"].append(t1 - t0)
                t[f"ttft_{mode}"].append(t2 - t0)
                del cache
            for mode in ("cold", "warm"):  # the store's plain get of the same chunks
                if mode == "cold":
                    store.drop_cached()
                    for s in segs:
                        drop_pages(s)
                t0 = time.perf_counter()
                for h in hashes:
                    store.get(h, namespace=pc.namespace)
                t[f"get_{mode}"].append(time.perf_counter() - t0)
        nbytes = sum(store.info(h, namespace=pc.namespace).logical_bytes for h in hashes)
    ms = {k: median_ms(v) for k, v in t.items()}
    ms["full_prefill"] = median_ms(full)
    out["ms"] = ms
    out["prefix_bytes"] = nbytes
    out["ratios"] = {
        "ttft_cold_vs_recompute": round(ms["full_prefill"] / ms["ttft_cold"], 2),
        "ttft_warm_vs_recompute": round(ms["full_prefill"] / ms["ttft_warm"], 2),
        "ttft_cold_behind_vs_recompute": round(ms["full_prefill"] / ms["ttft_cold_behind"], 2),
        "ttft_warm_behind_vs_recompute": round(ms["full_prefill"] / ms["ttft_warm_behind"], 2),
        "load_cold_vs_get_cold": round(ms["get_cold"] / ms["load_cold"], 2),
        "load_warm_vs_get_warm": round(ms["get_warm"] / ms["load_warm"], 2),
    }
    say(f"  transformers TTFT done ({out['params_m']}M params, {prompt} tokens)")
    return out


def markdown_transformers(r: dict[str, Any]) -> list[str]:
    ms, q = r["ms"], r["ratios"]
    mb = r["prefix_bytes"] / 1e6
    return ["", f"Time to first token, a random-weight Llama-style model ({r['layers']} layers, hidden 768, 12 heads, "
            f"4 KV heads, {r['params_m']}M parameters, {r['dtype']}, {r['threads']} CPU threads), a "
            f"{r['prompt_tokens']}-token prompt whose first {r['stored_tokens']} tokens are stored "
            f"({mb:.0f} MB of KV), medians in ms:", "",
            "| measurement | ms | vs recompute |", "| --- | --- | --- |",
            f"| full prefill (recompute) | {ms['full_prefill']} | 1.0x |",
            f"| PrefixCache, cold (segments): load + suffix | {ms['ttft_cold']} | {q['ttft_cold_vs_recompute']}x |",
            f"| of which the load | {ms['load_cold']} | ({q['load_cold_vs_get_cold']}x the store's plain get of "
            f"the same chunks: {ms['get_cold']} ms) |",
            f"| PrefixCache, DRAM tier: load + suffix | {ms['ttft_warm']} | {q['ttft_warm_vs_recompute']}x |",
            f"| of which the load | {ms['load_warm']} | ({q['load_warm_vs_get_warm']}x the plain get: "
            f"{ms['get_warm']} ms) |",
            f"| load(background=True), cold: layer i+1 read while layer i computes | {ms['ttft_cold_behind']} | "
            f"{q['ttft_cold_behind_vs_recompute']}x |",
            f"| load(background=True), DRAM tier | {ms['ttft_warm_behind']} | {q['ttft_warm_behind_vs_recompute']}x |"]
