"""The ``paged`` section: the vLLM connector's copies between a paged KV pool and stored chunk
layers (tierstore/integrations/paged.py), against a memcpy of the same blocks' bytes in the same
process.  A Llama-3-8B layer (8 KV heads, head_dim 128, fp16) in blocks of 16 tokens, vLLM 0.33's
``[blocks, heads, block_tokens, K|V]`` view over NHD and HND memory; a 256-token chunk is 16
blocks, scattered over a 4,096-block pool or consecutive.  Each block is one contiguous 64 KiB
page of the pool: the baselines copy those pages as they are, out of the pool (gather's) or
into it (scatter's); gather and scatter also reorder them into (out of) the stored
``[2, heads, tokens, head_dim]``.  Needs torch; measures only."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

BLOCKS, BLOCK, HEADS, DIM, CHUNK = 4096, 16, 8, 128, 256


def bench_paged(*, quick: bool = False, say: Callable[..., None] = print) -> dict[str, Any]:
    import torch

    from ..integrations.paged import PagedLayer, PagedLayout

    rng = np.random.default_rng(0)
    n = CHUNK // BLOCK
    reps = 100 if quick else 300
    rows = []
    for memory in ("NHD", "HND"):
        phys = torch.randn(BLOCKS, BLOCK, HEADS, 2 * DIM).half() if memory == "NHD" else \
            torch.randn(BLOCKS, HEADS, BLOCK, 2 * DIM).half()
        view = phys.permute(0, 2, 1, 3) if memory == "NHD" else phys  # vLLM's [B, H, N, K|V]
        layer = PagedLayer(view, PagedLayout.of(view, num_blocks=BLOCKS, block_size=BLOCK))
        chunk = torch.empty(layer.layout.chunk_shape(CHUNK), dtype=torch.float16)
        raw, pages = phys.numpy(), np.empty((n, *phys.shape[1:]), np.float16)
        for placement in ("scattered", "consecutive"):
            sets = [rng.choice(BLOCKS, n, replace=False).tolist() for _ in range(reps)] if placement == "scattered" \
                else [list(range(s, s + n)) for s in rng.choice(BLOCKS - n, reps).tolist()]

            def memcpy_out(ids: list[int], raw: Any = raw, pages: Any = pages) -> None:
                for j, b in enumerate(ids):
                    np.copyto(pages[j], raw[b])

            def memcpy_in(ids: list[int], raw: Any = raw, pages: Any = pages) -> None:
                for j, b in enumerate(ids):
                    np.copyto(raw[b], pages[j])

            ops = {"gather": lambda ids, lay=layer, c=chunk: lay.gather(ids, c),
                   "scatter": lambda ids, lay=layer, c=chunk: lay.scatter(ids, c),
                   "memcpy": memcpy_out, "memcpy_in": memcpy_in}
            best = {k: float("inf") for k in ops}
            for _ in range(3):  # the best of three passes: this machine's noise is one-sided
                for name, op in ops.items():
                    t0 = time.perf_counter()
                    for ids in sets:
                        op(ids)
                    best[name] = min(best[name], (time.perf_counter() - t0) / len(sets))
            row = {"memory": memory, "blocks": placement, "gather_us": round(best["gather"] * 1e6, 1),
                   "scatter_us": round(best["scatter"] * 1e6, 1), "memcpy_us": round(best["memcpy"] * 1e6, 1),
                   "memcpy_in_us": round(best["memcpy_in"] * 1e6, 1),
                   "gather_vs_memcpy": round(best["memcpy"] / best["gather"], 2),
                   "scatter_vs_memcpy": round(best["memcpy_in"] / best["scatter"], 2),
                   "memcpy_gib_s": round(chunk.nbytes / best["memcpy"] / 2**30, 2)}
            rows.append(row)
            say(f"  {memory} {placement}: gather {row['gather_vs_memcpy']}x, scatter {row['scatter_vs_memcpy']}x "
                f"a memcpy of the blocks ({row['memcpy_gib_s']} GiB/s)")
    return {"chunk_bytes": CHUNK * HEADS * DIM * 2 * 2, "rows": rows}


def markdown_paged(r: dict[str, Any]) -> list[str]:
    lines = ["", "### Paged copies (the vLLM connector): one 256-token chunk layer, Llama-3-8B, vs memcpy", "",
             "| memory | blocks | gather | scatter | memcpy of the pages out / in | gather vs memcpy out | "
             "scatter vs memcpy in |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for x in r["rows"]:
        lines.append(f"| {x['memory']} | {x['blocks']} | {x['gather_us']} us | {x['scatter_us']} us | "
                     f"{x['memcpy_us']} us ({x['memcpy_gib_s']} GiB/s) / {x.get('memcpy_in_us', '-')} us | "
                     f"{x['gather_vs_memcpy']}x | "
                     f"{x['scatter_vs_memcpy']}x |")
    return lines
