"""Reports of ``tierstore bench``: markdown tables for docs/benchmarks.md, the terminal summary, and the
chunk plot.  Formats results; measures nothing.
"""

from __future__ import annotations

from typing import Any

from .common import pyplot


def markdown(result: dict[str, Any]) -> str:
    """The result tables, for docs/benchmarks.md."""
    lines: list[str] = []
    if "chunk" in result:
        c = result["chunk"]
        lines += [f"32 MiB chunk: medians of {c['reps']} operations per system (single-layer gets: "
                  f"{c['layer_reps']} warm, {max(8, c['layer_reps'] // 4)} cold); memcpy of 32 MiB: "
                  f"{c['memcpy_ms']} ms.", "",
                  "| system | put ms | get cold ms | get warm ms | 1 layer cold p50 / p99 ms | "
                  "1 layer warm p50 / p99 ms | bytes read, cold layer |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in c["systems"].values():
            lines.append(f"| {r['name']} | {r['put_ms']:.1f} | {r['get_cold_ms']:.1f} | {r['get_warm_ms']:.1f} | "
                         f"{r['layer_cold_p50_ms']:.2f} / {r['layer_cold_p99_ms']:.2f} | "
                         f"{r['layer_warm_p50_ms']:.2f} / {r['layer_warm_p99_ms']:.2f} | "
                         f"{r['layer_cold_read_bytes']:,} |")
        lines += ["", "Time relative to the file-per-object baseline (lower is faster):", "",
                  "| system | put | get cold | get warm | 1 layer cold | 1 layer warm |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for r in c["systems"].values():
            q = r["ratios_vs_baseline"]
            lines.append(f"| {r['name']} | {q.get('put_ms', '-')} | {q.get('get_cold_ms', '-')} | "
                         f"{q.get('get_warm_ms', '-')} | {q.get('layer_cold_p50_ms', '-')} | "
                         f"{q.get('layer_warm_p50_ms', '-')} |")
        lines += ["", "| target | measured | |", "| --- | --- | --- |"]
        lines += [f"| {text} | {value}x | {'met' if ok else '**missed**'} |"
                  for text, value, ok in target_verdicts(result)]
        lines.append(f"| warm full get, time vs file-per-object (LMDB's, the best peer's, in this run: "
                     f"{c['systems'].get('lmdb', {}).get('ratios_vs_baseline', {}).get('get_warm_ms', '-')}x) | "
                     f"{c['targets']['warm_get_vs_file_per_object']}x | |")
        lines.append(f"| (without the DRAM tier, dram_bytes=0) warm 1-layer get vs raw pread | "
                     f"{c['targets']['warm_layer_get_vs_raw_pread_without_dram_tier']}x | |")
        for k, why in c["skipped"].items():
            lines.append(f"\nSkipped {k}: {why}.")
    if "blobs" in result:
        b = result["blobs"]
        lines += ["", f"4 KiB blobs, {b['n']} operations, ops/s:", "", "| measurement | ops/s |", "| --- | --- |"]
        lines += [f"| {k.removesuffix('_ops').replace('_', ' ')} | {v:,} |" for k, v in b.items() if k.endswith("_ops")]
    if "transformers" in result:
        from .transformers_ttft import markdown_transformers
        lines += markdown_transformers(result["transformers"])
    if "batches" in result:
        from .batches import markdown_batches
        lines += markdown_batches(result["batches"])
    if "codecs" in result:
        c = result["codecs"]
        lines += ["", f"Codecs on the real K/V sample ({c['kv_sample']}, {c['kv_shape']} per document, fp16; one "
                  "thread; MB/s of fp16 bytes; attention error = |softmax(QK^T/sqrt d)V - exact| / |exact| with "
                  "the captured queries):", "",
                  "| codec | ratio vs fp16 | encode MB/s | decode MB/s | rel. L2 error | attention error |",
                  "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {r['codec']} | {r['ratio']:.3f} | {r['encode_mb_s']:.0f} | {r['decode_mb_s']:.0f} | "
                  f"{r['rel_l2'] * 100:.2f}% | {r['attention_error'] * 100:.2f}% |" for r in c["kv"]]
        v = c["vectors_sample"]
        lines += ["", f"Vector codecs on {v['database']:,} real embeddings ({v['dim']} dims, fp16), {v['queries']} "
                  "held-out queries, recall@10 against exact search:", "",
                  "| codec | ratio vs fp16 | encode MB/s | decode MB/s | recall@10 | re-scored 4x |",
                  "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {r['codec']} | {r['ratio']:.3f} | {r['encode_mb_s']:.0f} | {r['decode_mb_s']:.0f} | "
                  f"{r['recall_at_10']} | {r['recall_at_10_rescored_4x']} |" for r in c["vectors"]]
    if "prefix" in result:
        p = result["prefix"]
        lines += ["", f"match_prefix of {p['query_hashes']:,} stored chunk hashes (medians), against the same "
                  "gets on a plain LMDB environment (py-lmdb, same process):", "",
                  "| objects in the store | ms per query | us per hash | raw LMDB us per hash | ratio |",
                  "| --- | --- | --- | --- | --- |"]
        lines += [f"| {r['objects']:,} | {r['ms_for_query']} | {r['us_per_hash']} | {r['raw_lmdb_us_per_hash']} | "
                  f"{r['ratio_vs_raw_lmdb']}x |" for r in p["stores"]]
    if "tiers" in result:
        from .tiers import markdown_tiers
        lines += ["", *markdown_tiers(result["tiers"])]
    if "remote" in result:
        from .remote import markdown_remote
        lines += markdown_remote(result["remote"])
    if "writers" in result:
        from .writers import markdown_writers
        lines += markdown_writers(result["writers"])
    if "placement" in result:
        from .placement import markdown_placement
        lines += markdown_placement(result["placement"])
    if "paged" in result:
        from .paged import markdown_paged
        lines += markdown_paged(result["paged"])
    return "\n".join(lines) + "\n"


# (key in result["chunk"]["targets"], what it measures, "min" or "max", the target)
TARGETS = [
    ("durable_put_throughput_vs_sequential_write", "durable put >= 0.85x sequential write+fdatasync (throughput)",
     "min", 0.85),
    ("cold_get_throughput_vs_sequential_read", "cold get >= 0.9x sequential read (throughput)", "min", 0.9),
    ("warm_layer_get_vs_raw_pread", "warm 1-layer get <= 1.5x raw pread of 1 MiB (time)", "max", 1.5),
    ("cold_layer_read_bytes_vs_layer", "cold 1-layer get reads <= the layer's bytes", "max", 1.0),
]


def target_verdicts(result: dict[str, Any]) -> list[tuple[str, float, bool]]:
    """(what, measured ratio, met?) for each target the chunk section measures."""
    if "chunk" not in result:
        return []
    t = result["chunk"]["targets"]
    return [(text, t[key], t[key] >= limit if kind == "min" else t[key] <= limit)
            for key, text, kind, limit in TARGETS if key in t]


def print_report(result: dict[str, Any]) -> None:
    """The terminal summary: the tables of docs/benchmarks.md, then each target met or missed."""
    if "chunk" in result:
        c = result["chunk"]
        print(f"\n32 MiB KV chunk, medians of {c['reps']} (layer gets: {c['layer_reps']}); memcpy {c['memcpy_ms']} ms")
    print()
    print(markdown(result))
    verdicts = target_verdicts(result)
    if verdicts:
        print("targets:")
        for text, value, ok in verdicts:
            print(f"  {'met   ' if ok else 'MISSED'}  {text}: {value}x")


def plot(result: dict[str, Any], path: str) -> None:
    """Bar chart of time ratios to the file-per-object baseline (skipped without matplotlib)."""
    plt = pyplot()
    if plt is None:
        return
    systems = result["chunk"]["systems"]
    metrics = ["put_ms", "get_cold_ms", "get_warm_ms", "layer_cold_p50_ms", "layer_warm_p50_ms"]
    labels = ["put (durable but 'none')", "get (cold)", "get (warm)", "1 layer (cold)", "1 layer (warm)"]
    names = [k for k in systems if k != "baseline"]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(names)
    for j, k in enumerate(names):
        r = systems[k]["ratios_vs_baseline"]
        ax.bar([i + j * width for i in range(len(metrics))], [r.get(m, 0) for m in metrics], width,
               label=systems[k]["name"])
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(metrics))], labels)
    ax.set_ylabel("time / file-per-object baseline (lower is better)")
    ax.set_yscale("log")
    ax.set_title("32 MiB Llama-3-8B KV chunk")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
