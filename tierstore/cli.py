"""The ``tierstore`` command: a thin shell over library functions.

    tierstore demo    [--path DIR]                 write KV caches, vectors, blobs; read them back
    tierstore bench   [--quick] [--out DIR]        benchmarks against raw-file baselines and peers
    tierstore fsck    PATH [--deep]                check a store and every live checksum (read-only)
    tierstore recover PATH                         rebuild the index from the segments
    tierstore ls      PATH [--namespace NS]        list objects
    tierstore stats   PATH                         sizes and counters

Every command takes --json.  Exit codes: 0 ok; 1 fsck found errors; 2 bad arguments;
3 the store cannot be opened (missing, corrupt, newer format); 4 another writer holds it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from . import __version__
from .errors import CorruptionError, FormatVersionError, StoreLocked, StoreNotFound, TierstoreError

EXIT_OK, EXIT_FINDINGS, EXIT_USAGE, EXIT_CANNOT_OPEN, EXIT_LOCKED = 0, 1, 2, 3, 4


def _progress(total: int | None, desc: str, enabled: bool) -> tuple[Callable[[int], None] | None, Callable[[], None]]:
    """A byte-progress callback backed by tqdm (only on a terminal and without --json)."""
    if not enabled or not sys.stderr.isatty():
        return None, lambda: None
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False)
    return bar.update, bar.close


def _segments_bytes(path: str) -> int:
    seg = os.path.join(path, "segments")
    return sum(os.path.getsize(os.path.join(seg, n)) for n in os.listdir(seg)) if os.path.isdir(seg) else 0


def _emit(args: argparse.Namespace, data: Any, text: Callable[[], None]) -> None:
    if args.json:
        print(json.dumps(data, indent=2, default=str))
    else:
        text()


def cmd_fsck(args: argparse.Namespace) -> int:
    from . import open as open_store
    from . import recovery

    with open_store(args.path, create=False, readonly=True) as store:
        update, close = _progress(_segments_bytes(args.path), "verifying", not args.json)
        try:
            assert store._index is not None
            report = recovery.check_store(store._io, store.path, store._index, deep=args.deep, progress=update)
        finally:
            close()

    def text() -> None:
        print(f"{args.path}: {report.objects} objects in {report.segments} segments, "
              f"{report.bytes_verified / 2**20:.1f} MiB of live extents verified"
              + ("; every log record and the LMDB index file checked" if args.deep else ""))
        for f in report.findings:
            where = " ".join(f"{k}={v}" for k, v in f.as_dict().items() if k not in ("severity", "what"))
            print(f"  {f.severity}: {f.what} {where}")
        print("ok" if report.ok else "ERRORS FOUND")

    _emit(args, report.as_dict(), text)
    return EXIT_OK if report.ok else EXIT_FINDINGS


def cmd_recover(args: argparse.Namespace) -> int:
    from . import recovery
    from .fileio import DEFAULT_IO
    from .store import Store

    path = os.path.abspath(args.path)
    if not os.path.isdir(os.path.join(path, "segments")):
        raise StoreNotFound(f"no store at {path}", path=path)
    # take the writer lock so no writer runs while the index is swapped
    lock = Store._lock_only(path, timeout=args.lock_timeout)
    try:
        update, close = _progress(_segments_bytes(path), "scanning", not args.json)
        try:
            scan = recovery.rebuild_index(DEFAULT_IO, path, repair=True, verify_payloads=args.deep, progress=update)
        finally:
            close()
    finally:
        os.close(lock)
    result = {"path": path, "records_replayed": len(scan.ops), "bytes_scanned": scan.bytes_scanned,
              "damage": [d.__dict__ for d in scan.damage], "removed_segments": scan.removed_segments,
              "next_lsn": scan.next_lsn}

    def text() -> None:
        print(f"{path}: index rebuilt from {scan.bytes_scanned / 2**20:.1f} MiB of segments "
              f"({len(scan.ops)} records)")
        for d in scan.damage:
            q = f", quarantined to {d.quarantined_to}" if d.quarantined_to else ""
            print(f"  segment {d.segment} offset {d.offset}: {d.reason}; {d.bytes_dropped} bytes dropped{q}")
        for s in scan.removed_segments:
            print(f"  segment {s}: header never became durable; moved to quarantine/")

    _emit(args, result, text)
    return EXIT_OK


def cmd_ls(args: argparse.Namespace) -> int:
    from . import open as open_store

    rows = []
    with open_store(args.path, create=False, readonly=True) as store:
        namespaces = [args.namespace] if args.namespace else store.namespaces()
        for ns in namespaces:
            for key in store.keys(namespace=ns):
                info = store.info(key, namespace=ns)
                rows.append({"namespace": ns, "key": key if isinstance(key, str) else "0x" + key.hex(),
                             "kind": info.kind, "shape": list(info.shape), "dtype": info.dtype,
                             "bytes": info.logical_bytes, "codec": info.codec, "lsn": info.lsn})

    def text() -> None:
        for r in rows:
            shape = "x".join(map(str, r["shape"])) or "-"
            print(f"{r['namespace']}\t{r['key']}\t{r['kind']}\t{shape}\t{r['dtype'] or '-'}\t{r['bytes']}")

    _emit(args, rows, text)
    return EXIT_OK


def cmd_stats(args: argparse.Namespace) -> int:
    from . import open as open_store

    with open_store(args.path, create=False, readonly=True) as store:
        st = store.stats()
        st["namespaces"] = {ns: len(store.keys(namespace=ns)) for ns in store.namespaces()}

    def text() -> None:
        print(f"{st['path']}: {sum(st['namespaces'].values())} objects in {len(st['namespaces'])} namespaces")
        print(f"  segments: {st['segments']} ({st['segment_bytes'] / 2**20:.1f} MiB; "
              f"live {st['live_bytes'] / 2**20:.1f} MiB, dead {st['dead_bytes'] / 2**20:.1f} MiB)")
        print(f"  applied LSN: {st['applied_lsn']}")
        for ns, n in st["namespaces"].items():
            print(f"  {ns}: {n}")

    _emit(args, st, text)
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    result = run_demo(args.path, quiet=args.json)
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    return EXIT_OK


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import run_bench

    result = run_bench(args.path, quick=args.quick, peers=not args.no_peers, out=args.out, quiet=args.json,
                       sections=args.section)
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tierstore", description="tierstore: typed KV-cache / vector / blob storage for LLM systems.",
        epilog="exit codes: 0 ok; 1 fsck found errors; 2 bad arguments; 3 the store cannot be opened "
               "(missing, corrupt, newer format); 4 another writer holds the store",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"tierstore {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    def add(name: str, fn: Callable[[argparse.Namespace], int], help_: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_, description=help_)
        sp.add_argument("--json", action="store_true", help="machine-readable output")
        sp.set_defaults(fn=fn)
        return sp

    sp = add("demo", cmd_demo, "write KV caches, vectors and blobs to a store, read them back, show timings")
    sp.add_argument("--path", default=os.path.join(os.getcwd(), ".tierstore-demo"),
                    help="store directory (default: ./.tierstore-demo)")
    sp = add("bench", cmd_bench, "benchmark against raw-file baselines and peers, in one run")
    sp.add_argument("--path", default=None, help="scratch directory on the disk to measure (default: a temp dir)")
    sp.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    sp.add_argument("--no-peers", action="store_true", help="skip safetensors / torch.save / h5py / LMDB")
    sp.add_argument("--out", default=None, help="write results.json and plots here")
    sp.add_argument("--section", action="append", choices=["chunk", "blobs"], help="run only these sections")
    sp = add("fsck", cmd_fsck, "check a store: index against segments both ways and the checksum of every live "
                               "object; exit code 1 on any error")
    sp.add_argument("path")
    sp.add_argument("--deep", action="store_true",
                    help="also verify every record of the log (overwritten and deleted ones too) and run LMDB's "
                         "structural verifier on the index")
    sp = add("recover", cmd_recover, "rebuild the index from the segments; quarantine damaged records")
    sp.add_argument("path")
    sp.add_argument("--deep", action="store_true", help="also verify every payload checksum while scanning")
    sp.add_argument("--lock-timeout", type=float, default=60.0, help="seconds to wait for a running writer")
    sp = add("ls", cmd_ls, "list the objects of a store")
    sp.add_argument("path")
    sp.add_argument("--namespace", default=None)
    sp = add("stats", cmd_stats, "sizes and counters of a store")
    sp.add_argument("path")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except StoreLocked as e:
        print(f"tierstore: {e}", file=sys.stderr)
        return EXIT_LOCKED
    except (StoreNotFound, CorruptionError, FormatVersionError) as e:
        print(f"tierstore: {e}", file=sys.stderr)
        return EXIT_CANNOT_OPEN
    except TierstoreError as e:
        print(f"tierstore: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
