"""``tierstore bench``: tierstore next to raw-file baselines and peers, measured in one run.

Chunk section: a Llama-3-8B-shaped KV chunk (256 tokens x 32 layers x 2 x 8 heads x 128
dims, fp16 = 32 MiB).  Blob section: 4 KiB blobs.  Every system does the same operations on
the same bytes on the same disk, interleaved, and results are reported as medians and as
ratios to the file-per-object baseline (one file per object, ``pwrite`` + ``fdatasync`` to
put, ``preadv`` into a fresh buffer to get).  "Cold" reads first evict the file's pages with
``posix_fadvise(DONTNEED)``; /proc/self/io ``read_bytes`` counts what a cold read fetched.

Peers (safetensors, torch.save, h5py) are optional (``pip install 'tierstore[bench]'``); a
missing one is reported as skipped.  Durable puts of peers are followed by an fsync so
that every system pays for durability.  No assertion here: this module measures.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from typing import Any

from .blobs import bench_blobs
from .chunk import bench_chunk
from .codec_quality import bench_codecs
from .common import pyplot
from .prefix import bench_prefix
from .report import markdown, plot, print_report

DEFAULT_SECTIONS = ["chunk", "blobs", "batches", "prefix", "codecs", "tiers"]
OTHER_SECTIONS = ["transformers", "remote", "writers", "placement", "paged"]  # (run with --section: slower or heavier)


def run_bench(path: str | None = None, *, quick: bool = False, peers: bool = True, out: str | None = None,
              quiet: bool = False, sections: list[str] | None = None) -> dict[str, Any]:
    say = (lambda *a: None) if quiet else print
    if out:  # (before the run, which takes minutes: a place it cannot write is found now)
        os.makedirs(out, exist_ok=True)
    root = tempfile.mkdtemp(prefix="tierstore-bench-", dir=path)
    sections = sections or DEFAULT_SECTIONS
    result: dict[str, Any] = {"quick": quick, "machine": {"cpus": os.cpu_count()}}
    try:
        if "chunk" in sections:
            say("chunk: Llama-3-8B KV chunk [32, 2, 8, 256, 128] fp16 = 32 MiB")
            result["chunk"] = bench_chunk(os.path.join(root, "chunk"), reps=3 if quick else 10,
                                          layer_reps=40 if quick else 200, peers=peers, say=say)
            shutil.rmtree(os.path.join(root, "chunk"))
        if "blobs" in sections:
            say("blobs: 4 KiB")
            result["blobs"] = bench_blobs(os.path.join(root, "blobs"), n=3000 if quick else 20000, peers=peers, say=say)
        if "batches" in sections:
            from .batches import bench_batches
            say("batches: put_many / get_many / contains_many of 4 KiB blobs; a 32 MiB chunk into a caller's buffer")
            result["batches"] = bench_batches(os.path.join(root, "batches"), n=3000 if quick else 20000,
                                              reps=3 if quick else 7, peers=peers, say=say)
        if "writers" in sections:
            from .writers import bench_writers
            say("writers: 1, 2, 4 writer processes on one store (32 MiB durable puts; 4 KiB put_many)")
            result["writers"] = bench_writers(os.path.join(root, "writers"), quick=quick, say=say)
        if "transformers" in sections:
            from .transformers_ttft import bench_transformers
            say("transformers: time to first token, recompute vs PrefixCache (cold, DRAM tier)")
            result["transformers"] = bench_transformers(os.path.join(root, "transformers"), quick=quick, say=say)
        if "remote" in sections:
            from .remote import bench_remote
            say("remote: a 32 MiB chunk and a 1 MiB layer through the remote tier vs redis-py SET/GET; two nodes")
            result["remote"] = bench_remote(os.path.join(root, "remote"), quick=quick, say=say)
        if "placement" in sections:
            from .placement import bench_placement
            say("placement: generated traces through lru / session / cost / Belady; put latency under ssd_bytes")
            result["placement"] = bench_placement(os.path.join(root, "placement"), quick=quick, say=say)
        if "paged" in sections:
            from .paged import bench_paged
            say("paged: the vLLM connector's block gather / scatter of a 256-token chunk layer vs memcpy")
            result["paged"] = bench_paged(quick=quick, say=say)
        if "codecs" in sections:
            say("codecs: the real K/V and embedding sample")
            result["codecs"] = bench_codecs(say)
        if "prefix" in sections:
            say("prefix: match_prefix of 1,000 chunk hashes")
            result["prefix"] = bench_prefix(os.path.join(root, "prefix"), query=1000, reps=5 if quick else 21,
                                            sizes=(2000, 20000) if quick else (2000, 20000, 200000), say=say)
        if "tiers" in sections:
            from .tiers import bench_tiers
            say("tiers: DRAM hits, SSD->DRAM promotion, a multi-turn chat trace (LRU vs session-aware)")
            result["tiers"] = bench_tiers(os.path.join(root, "tiers"), quick=quick, say=say)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if not quiet:
        print_report(result)
    if out:
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump(result, f, indent=2)
        if pyplot() is None:  # (on stderr: a --json run prints nothing else there)
            print("tierstore bench: plots skipped: matplotlib is not installed (pip install 'tierstore[bench]')",
                  file=sys.stderr)
        else:
            if "chunk" in result:
                plot(result, os.path.join(out, "benchmarks.png"))
            if "tiers" in result:
                from .tiers import plot_tiers
                plot_tiers(result["tiers"], os.path.join(out, "tiers.png"))
            if "writers" in result:
                from .writers import plot_writers
                plot_writers(result["writers"], os.path.join(out, "writers.png"))
            if "placement" in result:
                from .placement import plot_placement
                plot_placement(result["placement"], os.path.join(out, "placement.png"))
        with open(os.path.join(out, "results.md"), "w") as f:
            f.write(markdown(result))
        say(f"results: {os.path.join(out, 'results.json')}, {os.path.join(out, 'results.md')}")
    return result
