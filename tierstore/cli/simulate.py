"""``tierstore simulate``: replay a trace (recorded with ``open(..., trace_to=)``, generated, or
read from a ShareGPT file) against placement policies, and report hit rates, bytes per tier and
recompute tokens per policy, Belady's optimum included (docs/placement.md).

It owns the command's arguments and output; the replay is ``tiers.simulate``, the shapes
``tiers.workloads``.  It touches no store.
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any

from ..engine.options import parse_size
from ..errors import InvalidObject
from ..tiers import simulate as sim
from ..tiers import trace as tr
from ..tiers import workloads


def tier_size(text: str, data: int, name: str) -> int:
    """``--dram`` / ``--ssd``: a size ("4GiB") or a share of the trace's data ("10%")."""
    text = text.strip()
    if text.endswith("%"):
        try:
            share = float(text[:-1]) / 100.0
        except ValueError:
            raise InvalidObject(f"--{name}: a size like 4GiB or a share like 10%, got {text!r}") from None
        if not math.isfinite(share) or share < 0:
            raise InvalidObject(f"--{name}: a share is a number from 0%, got {text!r}")
        return int(data * share)
    return 0 if text == "0" else parse_size(text, f"--{name}")


def load_ops(args: Any) -> tuple[list[dict[str, Any]], str]:
    given = [x for x in (args.trace, args.generate, args.sharegpt) if x]
    if len(given) != 1:
        raise InvalidObject("give one of --trace FILE, --generate SHAPE, --sharegpt FILE")
    if args.trace:
        if args.seed:
            raise InvalidObject("--seed applies to --generate and --sharegpt, not to a recorded --trace")
        ops = list(tr.read_trace(args.trace))
        if any(op.get("op") == "truncated" for op in ops):
            print(f"tierstore simulate: {args.trace} was cut at its size bound (trace_bytes): the replay ends "
                  "where the recording stopped", file=sys.stderr)
        return ops, args.trace
    if args.seed < 0:
        raise InvalidObject(f"--seed must be 0 or more, got {args.seed}")
    if args.sharegpt:
        return workloads.sharegpt(args.sharegpt, seed=args.seed), f"sharegpt:{args.sharegpt}"
    return workloads.generate(args.generate, seed=args.seed), f"generated:{args.generate}"


def run(args: Any) -> dict[str, Any]:
    if args.save:  # (before the trace is read or generated: a path that cannot be written is a bad argument)
        where = os.path.dirname(os.path.abspath(args.save))
        why = ("its directory does not exist" if not os.path.isdir(where) else "it is a directory"
               if os.path.isdir(args.save) else "it cannot be written"
               if not os.access(args.save if os.path.exists(args.save) else where, os.W_OK) else None)
        if why is not None:
            raise InvalidObject(f"--save {args.save}: {why}", path=args.save)
    ops, source = load_ops(args)
    if args.save:
        with open(args.save, "w", encoding="utf-8") as f:
            for op in ops:
                f.write(json.dumps(op, separators=(",", ":")) + "\n")
    if not ops:
        raise InvalidObject(f"{source}: the trace holds no operation")
    data = sim.data_bytes(ops)
    dram, ssd = tier_size(args.dram, data, "dram"), tier_size(args.ssd, data, "ssd")
    if ssd <= 0:
        raise InvalidObject(f"--ssd must hold something: got {args.ssd!r} ({ssd} bytes)",
                            hint="a size like 100GiB or a share of the trace's data like 50%")
    if dram > ssd:
        raise InvalidObject(f"--dram ({dram:,} bytes) is larger than --ssd ({ssd:,}): the DRAM tier holds copies "
                            "of what the SSD holds")
    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    if not policies:
        raise InvalidObject(f"--policy: one or more of {', '.join(sim.POLICY_NAMES)}, comma-separated")
    for p in policies:
        if p not in sim.POLICY_NAMES:
            raise InvalidObject(f"--policy: each of {', '.join(sim.POLICY_NAMES)}, got {p!r}")
    if args.follow and (not args.trace or len(policies) != 1 or policies == ["belady"]):
        raise InvalidObject("--follow checks a recorded trace (--trace) against the one policy the store ran "
                            "(--policy lru, session or cost)")
    if args.retain and not args.follow:
        raise InvalidObject("--retain applies to --follow (the store's retain= namespaces)")
    retain = args.retain or []
    models = parse_models(args.models) if args.models else \
        (dict(workloads.MIXED_MODELS) if args.generate == "mixed" else None)
    downtier = parse_shares(args.downtier) if args.downtier else None
    if downtier and args.follow:
        raise InvalidObject("--downtier makes the simulator keep lossy copies; --follow replays the ones the "
                            "store kept (its trace's downtier lines)")
    runs = [sim.simulate(ops, dram_bytes=dram, ssd_bytes=ssd, policy=p, follow=args.follow, retain=retain,
                         models=models, downtier=downtier) for p in policies]
    best = next((r for r in runs if r["policy"] == "belady"), None)
    for r in runs:
        if best is not None and best["bytes_slow"]:
            r["slow_bytes_vs_belady"] = round(r["bytes_slow"] / best["bytes_slow"], 3)
    return {"source": source, "ops": len(ops), "data_bytes": data, "dram_bytes": dram, "ssd_bytes": ssd,
            "models": models, "downtier": downtier, "runs": runs}


def parse_pairs(text: str, option: str, example: str, *, below: float | None = None,
                hint: str | None = None) -> dict[str, float]:
    """``NS=NUMBER,...`` -> {namespace: number}: each namespace once, each number positive (and
    under ``below`` when given)."""
    out: dict[str, float] = {}
    for part in text.split(","):
        ns, sep, number = part.partition("=")
        try:
            value = float(number)
        except ValueError:
            value = -1.0
        if not sep or not ns.strip() or not 0 < value < math.inf or (below is not None and not value < below) \
                or ns.strip() in out:
            bound = f" under {below:g}" if below is not None else ""
            raise InvalidObject(f"{option}: namespace=number pairs like {example} (each namespace once, each number "
                                f"above 0{bound}), got {part!r}", hint=hint)
        out[ns.strip()] = value
    return out


def parse_shares(text: str) -> dict[str, float]:
    """``--downtier chat=0.313,...``: namespace -> the share of its bytes a lossy copy keeps."""
    return parse_pairs(text, "--downtier", "chat=0.313", below=1.0,
                       hint="the lossy copy's bytes over the object's: 0.313 for int4 of float16 KV with head_dim "
                            "128 (docs/guide.md's codec table gives each codec's ratio)")


def parse_models(text: str) -> dict[str, float]:
    """``--models m8b=8e9,m70b=70e9``: namespace -> parameter count."""
    return parse_pairs(text, "--models", "m8b=8e9,m70b=70e9")


def text(result: dict[str, Any]) -> None:
    unit, scale = ("GiB", 2**30) if result["data_bytes"] >= 2**32 else ("MiB", 2**20)
    print(f"{result['source']}: {result['ops']:,} ops over {result['data_bytes'] / scale:,.1f} {unit} of objects; "
          f"DRAM {result['dram_bytes'] / scale:,.1f} {unit}, SSD {result['ssd_bytes'] / scale:,.1f} {unit}")
    print(f"{'policy':8} {'DRAM hits':>9} {'SSD hits':>9} {'misses':>8} {unit + ' from SSD':>13} "
          f"{unit + ' slow tier':>14} {'recompute tokens':>17} {'miss seconds':>13}")
    for r in result["runs"]:
        print(f"{r['policy']:8} {r['dram_hit_rate'] * 100:8.1f}% {r['ssd_hit_rate'] * 100:8.1f}% "
              f"{r['misses']:8,} {r['bytes_from_ssd'] / scale:13,.1f} {r['bytes_slow'] / scale:14,.1f} "
              f"{r['recompute_tokens']:17,} {r['miss_seconds']:13,.2f}")
        if r["downtiered"] or r["lossy_hits"]:
            print(f"  lossy copies: {r['downtiered']:,} kept in place of evicted objects, {r['lossy_hits']:,} of the "
                  f"hits above served lossy ({r['bytes_lossy'] / scale:,.1f} {unit})")
        if "mismatches" in r:
            bad = r["mismatches"]
            print(f"  --follow: {r['evictions_checked']:,} evictions checked, {len(bad):,} not the front of the "
                  f"policy's order" + (" (the first 3 below)" if bad else ""))
            for m in bad[:3]:
                print(f"    evicted by the store {', '.join(m['store'])}; first in the policy's order "
                      f"{', '.join(m['policy'])}")
            if bad:
                print("    (the replay follows the store only with its settings -- --retain for retained "
                      "namespaces, --models -- and a trace of one run: trace_to= appends to a file that exists; "
                      "--ssd does not matter: the trace's evict lines decide)")
    print("slow tier: bytes of reads that missed DRAM and SSD (recomputed, or fetched from a remote tier); "
          "miss seconds: what those misses cost (docs/placement.md, the cost model's C)")


def plot(result: dict[str, Any], path: str) -> bool:
    """A bar chart of slow-tier bytes per policy; False when matplotlib is missing."""
    from ..bench.common import pyplot

    plt = pyplot()
    if plt is None:
        return False
    runs = result["runs"]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.bar([r["policy"] for r in runs], [r["bytes_slow"] / 2**30 for r in runs], color="#4c72b0")
    ax.set_ylabel("GiB from the slow tier")
    ax.set_title(f"{os.path.basename(result['source'])}: DRAM {result['dram_bytes'] / 2**30:.0f} GiB, "
                 f"SSD {result['ssd_bytes'] / 2**30:.0f} GiB", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def add_arguments(sp: Any) -> None:
    sp.add_argument("--trace", default=None, help="a trace file (JSON lines; open(..., trace_to=FILE) records one)")
    sp.add_argument("--generate", default=None, choices=sorted(workloads.SHAPES),
                    help="a generated trace of this shape (docs/placement.md)")
    sp.add_argument("--sharegpt", default=None, metavar="FILE", help="a chat trace from a ShareGPT-style JSON file")
    sp.add_argument("--seed", type=int, default=0, help="seed of --generate / --sharegpt")
    sp.add_argument("--dram", default="10%", help="DRAM tier: a size (4GiB) or a share of the data (default 10%%)")
    sp.add_argument("--ssd", default="50%", help="SSD budget: a size or a share of the data (default 50%%)")
    sp.add_argument("--policy", default="lru,session,cost,belady",
                    help="comma-separated: lru, session, cost, belady (default: all four)")
    sp.add_argument("--follow", action="store_true",
                    help="check a recorded trace's evictions against the policy instead of evicting")
    sp.add_argument("--retain", action="append", default=None, metavar="NAMESPACE",
                    help="with --follow: a namespace the store never evicted (its retain=)")
    sp.add_argument("--models", default=None, metavar="NS=PARAMS,...",
                    help="parameter count per namespace (m8b=8e9,m70b=70e9): prices misses and configures the cost "
                         "policy (default: an 8B model everywhere; --generate mixed: its two models)")
    sp.add_argument("--downtier", default=None, metavar="NS=SHARE,...",
                    help="keep a lossy copy of an SSD victim of these namespaces, of this share of its bytes "
                         "(chat=0.31: int4 KV of float16), as open(..., downtier=) does; evict it when chosen again")
    sp.add_argument("--save", default=None, metavar="FILE", help="also write the replayed ops as a trace file")
    sp.add_argument("--plot", default=None, metavar="PNG", help="a bar chart of slow-tier bytes per policy")
