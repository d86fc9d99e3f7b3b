"""The ``tierstore`` command: a thin shell over library functions; it parses, prints and maps errors
to exit codes, and holds no storage logic of its own.

    tierstore demo    [--path DIR]                 write KV caches, vectors, blobs; read them back
    tierstore bench   [--quick] [--out DIR]        benchmarks against raw-file baselines and peers
    tierstore fsck    PATH [--deep] [--fix]        check a store and every live checksum (read-only)
    tierstore recover PATH                         verify the log, quarantine damage, rebuild the index
    tierstore dump    PATH [KEY] [--namespace NS]  decode the log, one object, or one segment file
    tierstore compact PATH                         reclaim the space of overwritten and deleted objects
    tierstore ls      PATH [--namespace NS]        list objects
    tierstore stats   PATH                         sizes: objects, segments, live and dead bytes
    tierstore quarantine PATH [--clear]            what recoveries set aside; --clear deletes it
    tierstore remote-sync PATH --remote URL        send the remote tier what it lacks of a store
    tierstore fsck --remote URL [--namespace NS]   check the checksums of a remote tier's values

Every command takes --json.  Exit codes: 0 ok; 1 damage found (fsck, or dump of a damaged
file); 2 bad arguments; 3 the store cannot be opened (missing, corrupt, newer format);
4 another writer holds it; 5 the object asked for does not exist.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import unicodedata
from collections.abc import Callable
from typing import Any, NoReturn

from .. import __version__
from ..errors import (
    CorruptionError,
    FormatVersionError,
    InvalidObject,
    NotFound,
    ReadOnlyError,
    StoreIOError,
    StoreLocked,
    StoreNotFound,
    TierstoreError,
)

EXIT_OK, EXIT_FINDINGS, EXIT_USAGE, EXIT_CANNOT_OPEN, EXIT_LOCKED, EXIT_NOT_FOUND = 0, 1, 2, 3, 4, 5
EXIT_REPAIRED = 6  # fsck --fix found damage and repaired it (the store is ok now)
EXIT_PIPE = 128 + 13  # the reader of the output went away (`| head`): what a shell reports for `cat` that SIGPIPE ended


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


def _jsonable(x: Any) -> Any:
    """``x`` as strict JSON values: bytes as ``{"$bytes": hex}``, NaN and infinities as the
    strings "NaN", "Infinity", "-Infinity" (JSON has neither), anything else unknown as str."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (bytes, bytearray, memoryview)):
        return {"$bytes": bytes(x).hex()}
    if isinstance(x, float) and not math.isfinite(x):
        return "NaN" if x != x else ("Infinity" if x > 0 else "-Infinity")
    if x is None or isinstance(x, (str, int, float)):
        return x
    return str(x)


def _print_json(data: Any, indent: int | None = 2) -> None:
    print(json.dumps(_jsonable(data), indent=indent, allow_nan=False))


def _emit(args: argparse.Namespace, data: Any, text: Callable[[], None]) -> None:
    if args.json:
        _print_json(data)
    else:
        text()


def _check(args: argparse.Namespace) -> Any:
    from ..engine import repair

    update, close = _progress(_segments_bytes(args.path), "verifying", not args.json)
    try:
        return repair.fsck(args.path, deep=args.deep, progress=update)
    finally:
        close()


def _remote_fsck(args: argparse.Namespace) -> int:
    from ..names import encode_namespace
    from ..tiers.remote import RemoteDown, RemoteTier

    tier = RemoteTier(args.remote, origin=bytes(16), policy="read-only")
    update, close = _progress(None, "verifying remote values", not args.json)
    try:
        report = tier.verify(encode_namespace(args.namespace) if args.namespace else None, progress=update)
    except RemoteDown as e:
        return _fail(args, EXIT_CANNOT_OPEN, f"remote {tier.url} does not answer: {e}")
    finally:
        close()
        tier.close(0)

    def text() -> None:
        print(f"{report['remote']}: {_n(report['values'], 'value')} and {_n(report['tombstones'], 'tombstone')} "
              f"checked ({report['bytes'] / 2**20:.1f} MiB)")
        for d in report["damaged"]:
            print(f"  error: {d['why']} key={d['key']}")
        print("ok" if report["ok"] else "ERRORS FOUND")

    _emit(args, report, text)
    return EXIT_OK if report["ok"] else EXIT_FINDINGS


def cmd_remote_sync(args: argparse.Namespace) -> int:
    from ..store import Store

    try:
        store = Store(args.path, create=False, remote=args.remote)
    except StoreLocked as e:
        if "remote tier" not in e.message:
            raise
        e.hint = ("the node that writes the store with remote= sends what it holds: call store.remote_sync() "
                  "in that process (docs/remote.md), or run this command once it has closed")
        raise
    with store:
        total = sum(len(store.keys(namespace=n)) for n in ([args.namespace] if args.namespace else store.namespaces()))
        from tqdm import tqdm

        bar = tqdm(total=total, desc="remote-sync", unit="obj", leave=False,
                   disable=args.json or not sys.stderr.isatty())
        try:
            counts = store.remote_sync(namespace=args.namespace, progress=bar.update)
        finally:
            bar.close()
        counts["remote"] = store.stats()["tiers"]["remote"]["url"]
    if not counts["answered"] or counts["failed"] and not counts["checked"] and not counts["tombstones"]:
        return _fail(args, EXIT_CANNOT_OPEN, f"remote {counts['remote']} does not answer (or refuses every command): "
                                             "nothing was sent; the warning above says why")

    def text() -> None:
        print(f"{args.path} -> {counts['remote']}: {counts['checked']} checked, {counts['sent']} sent, "
              f"{counts['present']} already there, {counts['local_only']} local only (zstd dictionary), "
              f"{counts['tombstones']} deletes sent, {counts['failed']} failed, {counts['refused']} refused by "
              "the server")

    _emit(args, counts, text)
    return EXIT_OK if not counts["failed"] and not counts["refused"] else EXIT_FINDINGS


def cmd_fsck(args: argparse.Namespace) -> int:
    from ..engine import repair

    if args.remote:
        if args.path is not None or args.fix or args.deep:
            return _fail(args, EXIT_USAGE, "fsck --remote checks the server only: no PATH, --deep or --fix")
        return _remote_fsck(args)
    if args.path is None:
        return _fail(args, EXIT_USAGE, "fsck needs a store PATH (or --remote URL)")

    try:
        report = _check(args)
    except (CorruptionError, FormatVersionError) as e:
        if not args.fix:
            raise
        report = None
        first_error = str(e)
    repaired = None
    if args.fix and (report is None or not report.ok):
        _warn_if_waiting(args)
        repaired = repair.recover(args.path, lock_timeout=args.lock_timeout)
        before = report.as_dict() if report is not None else {"ok": False, "error": first_error}
        report = _check(args)

    def text() -> None:
        print(f"{args.path}: {_n(report.objects, 'object')} in {_n(report.segments, 'segment')}, "
              f"{report.bytes_verified / 2**20:.1f} MiB of live extents verified"
              + ("; every log record and the LMDB index file checked" if args.deep else ""))
        for f in report.findings:
            where = " ".join(f"{k}={v}" for k, v in f.as_dict().items() if k not in ("severity", "what"))
            print(f"  {f.severity}: {f.what}" + (f" {where}" if where else ""))
        print("ok" if report.ok else "ERRORS FOUND")

    data = {**report.as_dict(), "deep": bool(args.deep)}
    if repaired is not None:
        data = {"before": before, "repair": repaired, "after": data, "ok": report.ok, "repaired": report.ok}

    def text_fix() -> None:
        if repaired is not None:
            print(f"repaired: {len(repaired['damage'])} damaged region(s) quarantined, index rebuilt")
            for k in repaired["lost_keys"]:
                print(f"  {k['namespace']}/{k['key']}: LOST (a segment gone, emptied or cut held it)")
            for k in repaired["stale_keys_deleted"]:
                print(f"  {k['namespace']}/{k['key']}: deleted (its newer record was lost)")
        text()

    _emit(args, data, text_fix)
    if not report.ok:
        return EXIT_FINDINGS
    return EXIT_REPAIRED if repaired is not None else EXIT_OK


def cmd_recover(args: argparse.Namespace) -> int:
    from ..engine import repair

    path = os.path.abspath(args.path)
    update, close = _progress(_segments_bytes(path), "scanning", not args.json)
    try:
        result = repair.recover(path, lock_timeout=args.lock_timeout, progress=update)
    finally:
        close()

    def text() -> None:
        print(f"{path}: index rebuilt from {result['bytes_scanned'] / 2**20:.1f} MiB of segments "
              f"({result['records']} records, every checksum verified) in {result['seconds']:.2f} s")
        for d in result["damage"]:
            what = "" if d.get("key") is None or d.get("kept") else f" ({d['namespace']}/{d['key']} is gone)"
            q = f", quarantined to {d['quarantined_to']}" if d["quarantined_to"] else ""
            print(f"  segment {d['segment']} offset {d['offset']}: {d['reason']}; {d['bytes_dropped']} bytes "
                  f"dropped{q}{what}")
        for s in result["removed_segments"]:
            print(f"  segment {s}: its header is not there (never made durable, or the file was emptied or cut); "
                  "moved to quarantine/")
        for k in result["lost_keys"]:
            print(f"  {k['namespace']}/{k['key']}: LOST -- the previous index held it (LSN {k['lsn']}) and no record "
                  "of it is left in the log (a segment gone, emptied or cut)")
        for k in result["stale_keys_deleted"]:
            print(f"  {k['namespace']}/{k['key']}: deleted -- the record that replaced or deleted it was lost, and "
                  "its older version is not brought back")
        if not (result["damage"] or result["removed_segments"] or result["lost_keys"] or result["stale_keys_deleted"]):
            print("  no damage found")
        for b in result.get("blobs_without_dictionary", []):
            print(f"  {b['namespace']}/{b['key']}: needs zstd dictionary {b['dictionary']}, which was lost: moved to "
                  f"{b['quarantined_to']}")
        for r in result.get("references_dropped", []):
            who = r["session"] or "(put without a session)"
            print(f"  {r['namespace']}/{r['key']}: reference of {who} dropped (its object is gone)")
        if result.get("old_index"):
            print(f"  the previous index: {result['old_index']}")

    _emit(args, result, text)
    return EXIT_OK


def _starts_with_segment_magic(path: str) -> bool:
    """Whether a file begins as a segment does (else it is another file, not a damaged segment)."""
    from ..format.constants import SEGMENT_MAGIC

    with open(path, "rb") as f:
        return f.read(len(SEGMENT_MAGIC)) == SEGMENT_MAGIC


def cmd_dump(args: argparse.Namespace) -> int:
    from .dump import dump_range, dump_segment, dump_store

    if os.path.isfile(args.path) and args.path.endswith(".bin"):  # a range recovery set aside
        ranged = dump_range(args.path)

        def text_range() -> None:
            print(f"{ranged['path']}: {ranged['size']} bytes" + (f" ({ranged['note']})" if ranged["note"] else ""))
            for r in ranged["records"]:
                what = f"{r['namespace']}/{r['key']}" if "key" in r else \
                    f"{r['count']}" if "count" in r else f"durable {r['durable']}" if "durable" in r else ""
                print(f"  @{r['offset']:<10} lsn {r['lsn']:<8} {r['type']:<6} {what} ({r['record_len']} B)")
            for u in ranged["undecodable"]:
                print(f"  @{u['offset']:<10} {u['length']} bytes do not decode: {u['why']}")
            for d in ranged["damaged"]:
                print(f"  @{d['offset']:<10} lsn {d['lsn']:<8} DAMAGED: {d['detail']}")

        _emit(args, ranged, text_range)
        return EXIT_FINDINGS if ranged["undecodable"] or ranged["damaged"] else EXIT_OK
    if args.path.endswith((".tseg", ".bin")) and not os.path.exists(args.path):
        return _fail(args, EXIT_CANNOT_OPEN, f"no segment file {args.path} (hint: check the path)")
    if os.path.isfile(args.path):
        result = dump_segment(args.path)
        if "error" in result["header"] and not args.path.endswith(".tseg") \
                and not _starts_with_segment_magic(args.path):  # (another file: not a damaged segment)
            return _fail(args, EXIT_USAGE, f"{args.path} is not a segment file ({result['header']['error']}) "
                                           "(hint: dump takes a store, a segment file (*.tseg) or a range in "
                                           "quarantine/ (*.bin))")
        segments = [result]
    elif args.key is not None:
        try:
            key: str | bytes = bytes.fromhex(args.key[2:]) if args.key.startswith("0x") and not args.text_key \
                else args.key
        except ValueError:
            return _fail(args, EXIT_USAGE, f"{args.key!r} is not a bytes key in hex (0x...); give --text-key "
                                           "if it is a text key")
        try:
            result = dump_store(args.path, key, namespace=args.namespace)
        except NotFound as e:  # the key as it was typed (0x... rather than its bytes' repr)
            shown = args.key if isinstance(key, bytes) else repr(key)
            hint = f" (hint: {e.hint})" if e.hint else ""
            return _fail(args, EXIT_NOT_FOUND, f"no object {shown} in namespace {args.namespace!r}{hint}")
        segments = []
    else:
        if not os.path.isdir(os.path.join(args.path, "segments")):
            raise StoreNotFound(f"no store at {args.path}", path=args.path)
        return _dump_log(args)
    def text() -> None:
        if args.key is not None and not os.path.isfile(args.path):
            r, i = result["record"], result["info"]
            if r is None:
                print(f"{result['namespace']}/{args.key}: DAMAGED, {result['damaged']['detail']} (segment "
                      f"{result['segment']}, offset {result['damaged']['offset']}; {_DAMAGE_HINT})")
                return
            what = " ".join(x for x in (i["kind"], str(i["shape"]) if i["shape"] else "", i["dtype"] or "") if x)
            print(f"{result['namespace']}/{i['key']}: {what} "
                  f"codec={i['codec']} lsn={i['lsn']} segment={i['segment']} offset={i['offset']}")
            print(f"  meta: {r.get('meta')}")
            for e in r.get("extents", []):
                print(f"  extent @+{e['offset']}: {e['length']} bytes, crc32c {e['crc32c']}")
            if result["damaged"] is not None:
                print(f"  DAMAGED: {result['damaged']['detail']} ({_DAMAGE_HINT})")
            return
        for sg in segments:
            _print_segment_head(sg)
            bad = sorted(sg.get("damaged", []), key=lambda d: d["offset"])
            for r in sg.get("records", []):
                while bad and bad[0]["offset"] < r["offset"]:
                    _print_damage(bad.pop(0))
                _print_record(r)
            for d in bad:
                _print_damage(d)
            if "end" in sg:
                _print_end(sg["end"])

    _emit(args, result, text)
    if args.key is not None and not os.path.isfile(args.path):
        return EXIT_FINDINGS if result["damaged"] is not None else EXIT_OK
    damaged = [sg for sg in segments if "error" in sg["header"] or sg.get("damaged")
               or sg.get("end", {}).get("reason") not in (None, "end", "torn")]
    return EXIT_FINDINGS if damaged else EXIT_OK


def _dump_log(args: argparse.Namespace) -> int:
    """``dump PATH``: every segment of the store, printed as it is read (text, or the JSON that
    ``dump_store`` makes, written a record at a time): a log of millions of records is never
    held whole.  An error midway ends the JSON with ``error`` and ``exit_code`` members."""
    from .dump import store_segment_events

    out = sys.stdout.write
    verdicts: list[list[bool]] = []  # per segment: [damaged, its log ends torn]
    # the segment being written: its records so far (-1: no records list open), its damage and end
    seg: dict[str, Any] = {"records": -1, "damaged": [], "end": {}}

    def close_records() -> str:
        text = "" if seg["records"] < 0 else ("\n  ]" if seg["records"] else "]")
        seg["records"] = -1
        return text

    def cut(message: str, code: int) -> None:  # (``_fail``: the document ends with the error)
        cut_segment = "" if seg["records"] < 0 else _indented(close_records() + "\n}", 4)
        out(cut_segment + ("\n  ]" if verdicts else "]") + f',\n  "error": {json.dumps(message)},\n'
            f'  "exit_code": {code}\n}}\n')

    if args.json:
        out(json.dumps({"path": args.path, "segments": []}, indent=2).rsplit("[]", 1)[0] + "[")
        _OPEN_JSON.append(cut)
    for kind, item in store_segment_events(args.path):
        if kind == "segment":
            verdicts.append(["error" in item["header"], False])
            seg["damaged"] = []
            if not args.json:
                _print_segment_head(item)
                continue
            body = json.dumps(_jsonable(item), indent=2, allow_nan=False)
            out(("\n    " if len(verdicts) == 1 else ",\n    ") + _indented(body[:-2], 4))
            if "error" in item["header"]:
                out(_indented("\n}", 4))
            else:
                out(_indented(',\n  "records": [', 4))
                seg["records"] = 0
        elif kind == "record":
            if args.json:
                out(_indented(("\n    " if seg["records"] == 0 else ",\n    ") +
                              _indented(json.dumps(_jsonable(item), indent=2, allow_nan=False), 4), 4))
                seg["records"] += 1
            else:
                _print_record(item)
        elif kind == "damaged":
            verdicts[-1][0] = True
            if args.json:
                seg["damaged"].append(item)
            else:
                _print_damage(item)
        else:  # "end"
            verdicts[-1][0] |= item["reason"] not in ("end", "torn")
            verdicts[-1][1] = item["reason"] == "torn"
            if args.json:
                rest = json.dumps(_jsonable({"damaged": seg["damaged"], "end": item}), indent=2, allow_nan=False)
                out(_indented(close_records() + "," + rest[1:], 4))
            else:
                _print_end(item)
    if args.json:
        _OPEN_JSON.clear()
        out(("\n  ]" if verdicts else "]") + "\n}\n")
    # a torn end is where a crash cut the log -- in its last segment; in a sealed one it is damage
    bad = [i for i, (dmg, torn) in enumerate(verdicts) if dmg or torn and i != len(verdicts) - 1]
    return EXIT_FINDINGS if bad else EXIT_OK


def _indented(text: str, n: int) -> str:
    return text.replace("\n", "\n" + " " * n)


def _print_segment_head(sg: dict[str, Any]) -> None:
    h = sg["header"]
    print(f"{sg['path']}: {sg['size']} bytes, " + (f"format {h['format']}, segment {h['segment_id']}, "
                                                  f"base LSN {h['base_lsn']}" if "error" not in h
                                                  else f"bad header: {h['error']}"))


def _print_record(r: dict[str, Any]) -> None:
    if r["type"] == "pad":
        return
    if r["type"] == "sync":
        what, extra = f"records through LSN {r['durable']} were synced before this one", ""
    elif r["type"] in ("group", "hole"):
        what, extra = f"{r['count']} record(s)" if r["type"] == "group" else f"{r['count']} LSN(s)", ""
    elif r["type"] == "headers":  # (SPEC.md §4.5)
        what, extra = f"copies of {_n(r['count'], 'record header')} written before it", ""
    elif "session" in r:  # a session's reference on an object (SPEC.md §5.4)
        who = r["session"]
        if r["type"] == "put":
            what = f"{r['namespace']}/{r['key']}"
            extra = f" referenced by {who}"
        else:
            what = f"{r['namespace']}/(key hash {r['key_hash'][:12]})"
            extra = f" reference of {who} released"
    else:
        what = f"{r.get('namespace')}/{r.get('key')}"
        extra = f" {r['kind']} {_n(len(r['extents']), 'extent')}" if r["type"] == "put" else ""
    print(f"  @{r['offset']:<10} lsn {r['lsn']:<8} {r['type']:<6} {what}{extra} ({r['record_len']} B)")


def _print_end(e: dict[str, Any]) -> None:
    print(f"  end @{e['offset']}: {e['reason']}" + (f" ({e['detail']})" if e["detail"] else ""))


_DAMAGE_HINT = "tierstore fsck PATH reports it, recover quarantines it"


def _print_damage(d: dict[str, Any]) -> None:
    r = d.get("record")
    if r is not None:
        what = f"{r.get('namespace')}/{r.get('key')}" if "key" in r else r["type"]
        print(f"  @{d['offset']:<10} lsn {r['lsn']:<8} {r['type']:<6} {what} ({r['record_len']} B): DAMAGED, "
              f"{d['detail']}")
    else:
        print(f"  @{d['offset']:<10} {d['length']} bytes do not decode: {d['detail']} (the log goes on after them)")


def cmd_compact(args: argparse.Namespace) -> int:
    from .. import open as open_store

    with open_store(args.path, create=False, lock_timeout=args.lock_timeout) as store:
        before = store.stats()
        update, close = _progress(before["segment_bytes"], "compacting", not args.json)
        try:
            result = store.compact(min_dead_ratio=args.min_dead_ratio, progress=update)
        finally:
            close()
        after = store.stats()
    result.update(segment_bytes_before=before["segment_bytes"], segment_bytes_after=after["segment_bytes"])

    def text() -> None:
        freed = before["segment_bytes"] - after["segment_bytes"]
        print(f"{args.path}: {_n(len(result['victims']), 'segment')} rewritten, {_n(result['copied'], 'record')} "
              f"copied, {result['dropped']} dropped; {_size(before['segment_bytes'])} -> "
              f"{_size(after['segment_bytes'])} ({_size(max(freed, 0))} reclaimed) in {result['seconds']:.2f} s")

    _emit(args, result, text)
    return EXIT_OK


def _n(count: int, noun: str) -> str:
    """ "1 segment", "2 segments"."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _count(text: str) -> int:
    """An argparse type: a whole number >= 0."""
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0, got {text!r}")
    return n


LS_PAGE = 1000  # keys per index read of ``ls``, and rows per block of its table


def _cell_width(text: str) -> int:
    """Columns ``text`` takes on a terminal: wide (CJK) characters two; marks, format characters
    (zero-width space, variation selectors) and Hangul medial vowels and finals none."""
    if text.isascii():
        return len(text)
    return sum(0 if unicodedata.category(c) in ("Mn", "Me", "Cf") or "\u1160" <= c <= "\u11ff"
               else 2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def _typed_key(text: str | None, text_key: bool) -> str | bytes | None:
    """A key (or prefix) as typed: ``0x...`` is bytes in hex unless ``--text-key`` (as ``dump``)."""
    if text is None or text_key or not text.startswith("0x"):
        return text
    return bytes.fromhex(text[2:])


def cmd_ls(args: argparse.Namespace) -> int:
    from .. import open as open_store

    if args.after is not None and args.namespace is None:  # (a key of one namespace: no place in the others)
        return _fail(args, EXIT_USAGE, "--after pages through one namespace: give --namespace too")
    try:
        prefix, after = _typed_key(args.prefix, args.text_key), _typed_key(args.after, args.text_key)
    except ValueError:
        return _fail(args, EXIT_USAGE, "--prefix/--after starting with 0x are bytes in hex; give --text-key if "
                                       "they are text")

    def objects(store: Any) -> Any:
        """Rows, one index page of keys at a time (a listing of millions starts printing at once)."""
        left = args.limit
        for ns in [args.namespace] if args.namespace else store.namespaces():
            start = after
            while left is None or left > 0:
                page = store.keys(namespace=ns, prefix=prefix, after=start,
                                  limit=LS_PAGE if left is None else min(left, LS_PAGE))
                if not page:
                    break
                start = page[-1]
                for key in page:
                    try:
                        info = store.info(key, namespace=ns)
                    except NotFound:  # (deleted by a writer since the listing: not an object asked for)
                        continue
                    if left is not None:
                        left -= 1
                    yield {"namespace": ns, "key": key if isinstance(key, str) else "0x" + key.hex(),
                           "key_type": "text" if isinstance(key, str) else "bytes",
                           "kind": info.kind, "shape": list(info.shape), "dtype": info.dtype,
                           "bytes": info.logical_bytes, "stored_bytes": info.stored_bytes, "codec": info.codec,
                           "lsn": info.lsn}

    with open_store(args.path, create=False, readonly=True) as store:
        if args.json:  # one JSON array, a row per line as it is read
            rows = 0

            def cut(message: str, code: int) -> None:  # (``_fail``: the last row is the error)
                sys.stdout.write(("\n  " if rows == 0 else ",\n  ") +
                                 json.dumps({"error": message, "exit_code": code}) + "\n]\n")

            sys.stdout.write("[")
            _OPEN_JSON.append(cut)
            for r in objects(store):
                sys.stdout.write(("\n  " if rows == 0 else ",\n  ") + json.dumps(_jsonable(r), allow_nan=False))
                rows += 1
            _OPEN_JSON.clear()
            print("\n]")
            return EXIT_OK
        header = ("NAMESPACE", "KEY", "KIND", "SHAPE", "DTYPE", "CODEC", "SIZE", "STORED")
        widths = [_cell_width(c) for c in header]
        count = logical = stored = 0
        block: list[tuple[str, ...]] = []

        def flush(first: bool) -> None:  # (a block's widths never narrow a column the blocks before had)
            for i in range(len(widths)):
                widths[i] = max([widths[i], *(_cell_width(row[i]) for row in block)])
            for row in ([header] if first else []) + block:
                cells = [c + " " * (w - _cell_width(c)) if i < 6 else " " * (w - _cell_width(c)) + c
                         for i, (c, w) in enumerate(zip(row, widths))]
                print("  ".join(cells).rstrip())
            block.clear()

        first = True
        for r in objects(store):
            key = repr(r["key"]) if r["key_type"] == "text" and r["key"].startswith(("0x", "'")) else r["key"]
            block.append((r["namespace"], key, r["kind"], "x".join(map(str, r["shape"])) or "-",
                          r["dtype"] or "-", r["codec"], _size(r["bytes"]), _size(r["stored_bytes"])))
            count, logical, stored = count + 1, logical + r["bytes"], stored + r["stored_bytes"]
            if len(block) == LS_PAGE:
                flush(first)
                first = False
        flush(first)
        print(f"{count} object(s), {_size(logical)} ({_size(stored)} stored)")
    return EXIT_OK


def cmd_stats(args: argparse.Namespace) -> int:
    from .. import open as open_store
    from ..engine import repair

    with open_store(args.path, create=False, readonly=True) as store:
        st = store.stats()
        st["namespaces"] = {ns: len(store.keys(namespace=ns)) for ns in store.namespaces()}
    # operation counters and cache tiers belong to a handle (this command's own is new and empty):
    # a process that writes reads them from its Store.stats()
    for k in ("counters", "tiers", "recovery", "readonly", "durability", "pending_index_records", "next_lsn",
              "durable_lsn"):
        st.pop(k, None)
    st["quarantine"] = repair.quarantine_list(args.path)

    def text() -> None:
        print(f"{st['path']}: {sum(st['namespaces'].values())} objects in {len(st['namespaces'])} namespace(s)")
        dead = f"dead {_size(st['dead_bytes'])}" + (": `tierstore compact` reclaims it" if st["dead_bytes"] else "")
        print(f"  {_n(st['segments'], 'segment')} ({_size(st['segment_bytes'])}; live {_size(st['live_bytes'])}, "
              f"{dead})")
        print(f"  applied LSN: {st['applied_lsn']}; session references: {st['session_refs_indexed']}")
        for ns, n in st["namespaces"].items():
            print(f"  {ns}: {n}")
        if st["quarantine"]:
            print(f"  quarantine/: {len(st['quarantine'])} item(s) (`tierstore quarantine {args.path}`)")

    _emit(args, st, text)
    return EXIT_OK


def cmd_quarantine(args: argparse.Namespace) -> int:
    from ..engine import repair

    if not os.path.isdir(os.path.join(args.path, "segments")):
        raise StoreNotFound(f"no store at {args.path}", path=args.path)
    items = repair.quarantine_list(args.path)
    cleared = repair.quarantine_clear(args.path, lock_timeout=args.lock_timeout) if args.clear else None

    def text() -> None:
        if not items:
            print(f"{args.path}: quarantine/ is empty")
            return
        for it in items:
            print(f"  {it['name']}  {_size(it['bytes'])}  {it['reason'] or ''}")
        if cleared is not None:
            print(f"deleted {cleared} item(s)")
        else:
            print(f"{len(items)} item(s); `tierstore quarantine {args.path} --clear` deletes them "
                  "(they are not part of the store: recover kept every intact record)")

    _emit(args, {"items": items, "cleared": cleared}, text)
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    result = run_demo(args.path, quiet=args.json)
    if args.json:
        _print_json(result)
    return EXIT_OK


def cmd_bench(args: argparse.Namespace) -> int:
    import signal

    from ..bench import run_bench

    for option, where in (("--out", args.out), ("--path", args.path)):  # (bad arguments: before the run)
        if where:  # (--out "": no output, as before)
            try:
                os.makedirs(where, exist_ok=True)  # made if missing
            except OSError as e:
                raise InvalidObject(f"{option} {where}: {e.strerror}", path=where) from None
            if not os.access(where, os.W_OK):
                raise InvalidObject(f"{option} {where}: not writable", path=where)

    def stop(signum: int, frame: Any) -> None:  # SIGTERM (timeout, a CI job's end): clean up as Ctrl-C does
        raise SystemExit(128 + signum)

    # (a section's finally stops its servers; a SIGTERM the caller ignores stays ignored)
    main = threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) != signal.SIG_IGN
    before = signal.signal(signal.SIGTERM, stop) if main else None
    try:
        result = run_bench(args.path or None, quick=args.quick, peers=not args.no_peers, out=args.out or None,
                           quiet=args.json, sections=args.section)
    finally:
        if main:
            signal.signal(signal.SIGTERM, before if before is not None else signal.SIG_DFL)
    if args.json:
        _print_json(result)
    return EXIT_OK


def cmd_simulate(args: argparse.Namespace) -> int:
    from ..bench.common import pyplot
    from ..errors import InvalidObject
    from . import simulate

    if args.plot and pyplot() is None:  # (asked for: refused before the replay, not skipped after it)
        raise InvalidObject("--plot needs matplotlib, which is not installed", hint="pip install 'tierstore[bench]'")
    result = simulate.run(args)
    plotted = simulate.plot(result, args.plot) if args.plot else None

    def text() -> None:
        simulate.text(result)
        if plotted:
            print(f"plot: {args.plot}")

    _emit(args, result, text)
    follow = [m for r in result["runs"] for m in r.get("mismatches", [])]
    return EXIT_FINDINGS if follow else EXIT_OK


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad command line given ``--json`` also says so as JSON on stdout (as
    every other error does), before the usual usage message on stderr and exit code 2."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        if "--json" in (_ARGV if _ARGV is not None else sys.argv[1:]):
            _print_json({"error": f"{self.prog}: {message}", "exit_code": EXIT_USAGE}, indent=None)
        super().error(message)


_ARGV: list[str] | None = None  # main()'s argv (tests call main with a list)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="tierstore", description="tierstore: typed KV-cache / vector / blob storage for LLM systems.",
        epilog="exit codes: 0 ok; 1 damage found (fsck, dump); 2 bad arguments; 3 the store cannot be opened "
               "(missing, corrupt, newer format); 4 another writer holds the store; 5 no such object; "
               "6 damage found and repaired (fsck --fix)",
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
    sp.add_argument("--section", action="append",
                    choices=["chunk", "blobs", "batches", "prefix", "codecs", "tiers", "transformers", "remote",
                             "writers", "placement", "paged"],
                    help="run only this section (repeat --section for several); without it: chunk, blobs, "
                         "batches, prefix, codecs, tiers (transformers, remote, writers, placement and paged run "
                         "only when named)")
    sp = add("fsck", cmd_fsck, "check a store: index against segments both ways and the checksum of every live "
                               "object; exit code 1 on any error")
    sp.add_argument("path", nargs="?", default=None)
    sp.add_argument("--remote", default=None, metavar="URL",
                    help="check the values on a remote tier (redis://..., redis+cluster://...) instead of a store")
    sp.add_argument("--namespace", default=None, help="with --remote: only this namespace")
    sp.add_argument("--deep", action="store_true",
                    help="also verify every record of the log (overwritten and deleted ones too) and run LMDB's "
                         "structural verifier on the index")
    sp.add_argument("--fix", action="store_true", help="repair what it finds (as `recover` does); read-only without")
    sp.add_argument("--lock-timeout", type=float, default=60.0,
                    help="with --fix: seconds to wait for running writers (the repair needs the store alone)")
    sp = add("recover", cmd_recover, "verify every record, cut a torn tail, quarantine damage (never deleting it) "
                                     "and rebuild the index from the segments")
    sp.add_argument("path")
    sp.add_argument("--lock-timeout", type=float, default=60.0, help="seconds to wait for a running writer")
    sp = add("dump", cmd_dump, "decode a store's log, one object (KEY), or a single segment file, read-only")
    sp.add_argument("path", help="a store directory or a .tseg segment file")
    sp.add_argument("key", nargs="?", default=None, help="an object's key (0x... for bytes keys)")
    sp.add_argument("--namespace", default="default", help="the namespace of KEY (default: default)")
    sp.add_argument("--text-key", action="store_true",
                    help="KEY is a text key even if it starts with 0x (ls shows such keys quoted)")
    sp = add("compact", cmd_compact, "reclaim the space of overwritten and deleted objects (crash-safe)")
    sp.add_argument("path")
    sp.add_argument("--min-dead-ratio", type=float, default=0.0,
                    help="rewrite only segments with at least this fraction of dead bytes")
    sp.add_argument("--lock-timeout", type=float, default=60.0,
                    help="seconds to wait while a tool (recover) has the store to itself; other writers never hold "
                         "it up")
    sp = add("ls", cmd_ls, "list the objects of a store")
    sp.add_argument("path")
    sp.add_argument("--namespace", default=None)
    sp.add_argument("--prefix", default=None, help="only keys that start with this (0x... for bytes keys)")
    sp.add_argument("--after", default=None, metavar="KEY",
                    help="with --namespace: only keys sorted after KEY, the last key of the previous page "
                         "(0x... for a bytes key)")
    sp.add_argument("--limit", type=_count, default=None, metavar="N", help="at most N objects (in key order)")
    sp.add_argument("--text-key", action="store_true", help="--prefix/--after are text even if they start with 0x")
    sp = add("stats", cmd_stats, "sizes of a store: objects per namespace, segments, live and dead bytes")
    sp.add_argument("path")
    sp = add("remote-sync", cmd_remote_sync, "send a remote tier every object of a store it lacks (or holds "
                                             "an older version of); never replaces newer values or deletes")
    sp.add_argument("path")
    sp.add_argument("--remote", required=True, metavar="URL", help="redis://host:6379/0, redis+cluster://h1:p1,...")
    sp.add_argument("--namespace", default=None, help="only this namespace")
    sp = add("simulate", cmd_simulate, "replay a trace against placement policies (lru, session, cost, Belady's "
                                       "optimum): hit rates, bytes per tier, recompute tokens; no data touched")
    from .simulate import add_arguments

    add_arguments(sp)
    sp = add("quarantine", cmd_quarantine, "list what recoveries set aside in quarantine/, or --clear it")
    sp.add_argument("path")
    sp.add_argument("--clear", action="store_true", help="delete everything in quarantine/")
    sp.add_argument("--lock-timeout", type=float, default=60.0, help="seconds to wait for a running writer")
    return p


def _fail(args: argparse.Namespace, code: int, message: str) -> int:
    """An error: one line on stderr, and with --json also ``{"error", "exit_code"}`` on stdout (a
    listing already streaming ends with it: ``_OPEN_JSON``)."""
    print(f"tierstore: {message}", file=sys.stderr)
    if _OPEN_JSON:  # a streamed document cut short: it ends with the error, still one JSON document
        _OPEN_JSON.pop()(message, code)
    elif getattr(args, "json", False):
        _print_json({"error": message, "exit_code": code}, indent=None)  # one line
    return code


# the closer of the JSON document a command is streaming to stdout (``ls``, ``dump PATH``): an error
# midway (``_fail``) ends the document with the error rather than print a second one after it
_OPEN_JSON: list[Callable[[str, int], None]] = []


def _quarantined(path: str) -> bool:
    """Whether quarantine/ holds anything (``--clear`` of an empty one takes no lock)."""
    from ..format.constants import QUARANTINE_DIR

    try:
        return bool(os.listdir(os.path.join(path, QUARANTINE_DIR)))
    except OSError:
        return False


def _warn_if_waiting(args: argparse.Namespace, *, beside_writers: bool = False) -> None:
    """Say so before a command waits for another process's writer lock (up to --lock-timeout):
    any writer's, or with ``beside_writers`` (compact) only one that holds the store to itself."""
    from ..engine.fileio import DEFAULT_IO
    from ..engine.lock import acquire_writer_lock, join_writers

    if not os.path.isdir(os.path.join(args.path, "segments")):
        return  # the command itself says there is no store
    try:
        DEFAULT_IO.close(join_writers(DEFAULT_IO, args.path, 0)[0] if beside_writers
                         else acquire_writer_lock(DEFAULT_IO, args.path, 0))
    except StoreLocked:
        who = "holds the store to itself (exclusive=True, or a tool)" if beside_writers else "is writing to it"
        print(f"tierstore: another process {who}: {args.path}; waiting up to {args.lock_timeout:g} s "
              "for it to close (--lock-timeout)", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    global _ARGV
    _ARGV = argv
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command == "dump" and args.key is None and len(extra) == 1 and not extra[0].startswith("-"):
        args.key = extra[0]  # `dump PATH --namespace NS KEY`: KEY after an option
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        # recover and quarantine --clear need the store to themselves; compact runs beside writers
        if args.command == "recover" or args.command == "quarantine" and args.clear and _quarantined(args.path):
            _warn_if_waiting(args)
        elif args.command == "compact":
            _warn_if_waiting(args, beside_writers=True)
        _OPEN_JSON.clear()  # (none left from an earlier call in this process)
        return args.fn(args)
    except BrokenPipeError:  # output piped into `head` and the like: stop quietly, like cat -- and not
        devnull = os.open(os.devnull, os.O_WRONLY)  # with 0, which would say a dump or fsck cut short found no damage
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush does not fail
        return EXIT_PIPE
    except StoreLocked as e:
        if not hasattr(args, "lock_timeout") or getattr(e, "busy_index", False):
            # a command that does not wait (remote-sync), or an index a busy writer kept changing: its own hint
            return _fail(args, EXIT_LOCKED, f"{e.message} (hint: {e.hint or 'stop the process that holds it'})")
        return _fail(args, EXIT_LOCKED, f"{e.message} (hint: stop the process that writes to the store, or wait "
                                        "longer with --lock-timeout SECONDS)")
    except StoreNotFound as e:
        return _fail(args, EXIT_CANNOT_OPEN, f"{e.message} (hint: check the path; a store is created by "
                                             "tierstore.open(path) from Python, or try `tierstore demo --path DIR`)")
    except NotFound as e:
        return _fail(args, EXIT_NOT_FOUND, str(e))
    except (CorruptionError, FormatVersionError, ReadOnlyError, StoreIOError) as e:
        # (ReadOnlyError: a newer format's segment; StoreIOError: an I/O error, an index this
        # process cannot map)
        return _fail(args, EXIT_CANNOT_OPEN, str(e))
    except TierstoreError as e:
        return _fail(args, EXIT_USAGE, str(e))
    except OSError as e:  # e.g. permission denied on the store directory
        return _fail(args, EXIT_CANNOT_OPEN, str(e))


if __name__ == "__main__":
    sys.exit(main())
