"""The offline tools over a store directory: ``recover`` (verify every record, quarantine damage, rebuild
the index) and ``check_store`` (fsck: index and log checked against each other, every live checksum).

``check_store`` never changes a byte.  ``recover`` works under the writer lock and never deletes
user data (damaged bytes go to quarantine/).  Both are given paths or an Engine; the scanning
itself is recovery.py's.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lmdb

from ..errors import CorruptionError, StoreLocked, StoreNotFound, TierstoreError
from ..format import constants as fmt
from ..format import record as rec
from . import segment as seglib
from .engine import Engine, open_engine, writing_in_process
from .fileio import PosixIO
from .index import WALKS, Applied, Index, Location, decode_location, untrusted, walk_live
from .lock import acquire_writer_lock, writer_active
from .options import Options
from .recovery import base_disagrees, certified_after, check_applied, quarantine_bytes, rebuild_index, shown_key


def _previous_index(root: str) -> tuple[dict[tuple[bytes, bytes], int], Applied, bytes | None, bool] | None:
    """The old index's view -- {(namespace, key): LSN}, its applied position, its store uuid and
    whether the writer that applied that position had synced it (``Index.applied_synced``) --
    when the index is there and sound: it matches the stamp of its last clean close, or, without
    a stamp (a writer that did not close), passes LMDB's offline verifier; None otherwise (an
    index changed at rest is no witness: its LSNs could delete live objects as stale)."""
    path = os.path.join(root, fmt.INDEX_DIR)
    if not Index.exists(path) or untrusted(path):  # (changed at rest since its stamp: no witness)
        return None
    try:
        idx = Index.open(path, writable=False)
    except TierstoreError:
        return None
    try:
        with idx.read() as view:
            keys = {(ns, key): loc.header.lsn for ns, key, loc in view.items()}
            return keys, view.applied(), idx.store_uuid(), view.applied_synced()
    except TierstoreError:
        return None
    finally:
        idx.close()


class _HeaderWitness:
    """The previous index's copies of record headers, by (segment, offset): read one segment at a
    time, only when recovery meets a header it cannot read there (damage is rare)."""

    def __init__(self, root: str) -> None:
        self.path = os.path.join(root, fmt.INDEX_DIR)
        self.by_segment: dict[int, dict[int, Any]] = {}

    def __call__(self, seg: int, offset: int) -> Any:
        if seg not in self.by_segment:
            self.by_segment[seg] = {}
            try:
                idx = Index.open(self.path, writable=False)
            except TierstoreError:
                return None
            try:
                with idx.read() as view:
                    self.by_segment[seg] = {loc.offset: loc.header for _, _, loc in view.items() if loc.segment == seg}
            except TierstoreError:
                pass
            finally:
                idx.close()
        return self.by_segment[seg].get(offset)


def recover(path: str, *, io: PosixIO | None = None, lock_timeout: float = 60.0,
            progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """``tierstore recover``: under the writer lock, scan every segment verifying every
    checksum, cut a torn tail, quarantine damaged records (hiding their keys, so that older
    versions do not come back in their place) and damaged segment headers (rewritten), and
    rebuild the index from what remains.  Nothing is deleted: damaged bytes go to quarantine/.

    When the previous index is readable, it is a second witness: a key it did not hold (or
    held at a newer LSN) whose rebuilt version is older than what it had applied lost the
    record that deleted or replaced it, and is deleted rather than brought back; and a record
    header that cannot be read is written back from the index's checksummed copy when every
    extent of the record matches it (the object is kept, the damaged bytes quarantined)."""
    io = io or PosixIO()
    root = os.path.abspath(path)
    if not os.path.isdir(os.path.join(root, fmt.SEGMENTS_DIR)):
        raise StoreNotFound(f"no store at {root}", path=root)
    if writing_in_process(root):
        raise StoreLocked("this process has the store open for writing", path=root,
                          hint="close that handle first: recover rewrites segments under the writer lock")
    lock = acquire_writer_lock(io, root, lock_timeout)
    t0 = time.perf_counter()
    try:
        previous = _previous_index(root)
        # the record the old index applied last is still in the log: what the index held was in the
        # log, and a key it holds newer than the rebuild lost a record to damage.  Not in the log:
        # the log ends before it -- after a power cut with durability="none" (the index applied
        # records that were only handed to the OS), or damage at its end: the older versions then
        # stand, as a writable open gives them -- unless the writer that applied it had synced it:
        # then the log lost durable records (a segment removed or cut), and the index is a witness
        in_log = previous is not None and (check_applied(io, root, previous[1]) or previous[3])
        scan = rebuild_index(io, root, repair=True, verify_payloads=True, progress=progress,
                             proven_lsn=previous[1].lsn if previous is not None else 0,
                             witness=_HeaderWitness(root) if previous is not None else None)
        leftover = os.path.join(root, fmt.INDEX_DIR + ".rebuild")
        if os.path.exists(leftover):
            shutil.rmtree(leftover)
    finally:
        io.close(lock)
    stale: list[tuple[bytes, bytes, int]] = []
    lost: list[tuple[bytes, bytes, int]] = []
    # consulted whether or not the scan found damage: a sealed segment cut at a record boundary, or
    # gone, reads as a clean end and an LSN gap, and the versions it held the newer records of
    # would come back (a cold review, 2026-12-03) -- but only an index of this store
    if previous is not None and previous[2] == scan.store_uuid and (scan.damage or in_log):
        known, applied = previous[0], previous[1].lsn
        idx = Index.open(os.path.join(root, fmt.INDEX_DIR), writable=False)
        present: set[tuple[bytes, bytes]] = set()
        try:
            with idx.read() as view:
                for ns, key, loc in view.items():
                    present.add((ns, key))
                    was = known.get((ns, key))
                    if loc.header.lsn <= applied and (was is None or was > loc.header.lsn):
                        stale.append((ns, key, loc.header.lsn))
        finally:
            idx.close()
        # objects the previous index held that no record of the log accounts for any more (a
        # segment gone or emptied took them): named, not dropped in silence (a new user's try:
        # recover said "no damage found" and fsck then "ok")
        newest: dict[tuple[bytes, bytes], int] = {}
        for op in scan.ops:
            if op.lsn > newest.get((op.namespace, op.key), 0):
                newest[(op.namespace, op.key)] = op.lsn
        named = {(d.namespace, d.key) for d in scan.damage if d.key is not None}
        lost = sorted((ns, key, lsn) for (ns, key), lsn in known.items()
                      if not ns.startswith(b"\x00") and (ns, key) not in present and lsn <= applied
                      and newest.get((ns, key), 0) <= lsn
                      and (ns.decode("utf-8", "replace"), shown_key(key)) not in named)
    dangling: list[dict[str, str]] = []
    orphans: list[dict[str, Any]] = []
    deleted: list[tuple[bytes, bytes]] = []
    engine = open_engine(root, create=False, options=Options(lock_timeout=lock_timeout), io=io)
    try:
        with engine.write_lock:
            for ns, key, lsn in stale:
                loc = engine.lookup(ns, key)
                # the object goes with its session references, as a delete does -- unless a writer
                # that opened between the rebuild and this has put it since (the lock was let go;
                # a compaction's copy keeps the LSN)
                if loc is not None and loc.header.lsn == lsn:
                    deleted.append((ns, key))
                    engine.append_group(engine.deletion(ns, key, loc.header.flags))
            orphans = _drop_blobs_without_dictionary(engine)
            dangling = _drop_dangling_references(engine)
        assert engine.log is not None
        # copies of the DELETE and HOLE records written in place of damaged ones: they supersede
        # the damaged records' own copies (SPEC.md §7.6)
        engine.log.keep_copies([(lsn, seg, off, raw) for seg, off, lsn, raw in scan.rewritten])
        engine.flush()
    finally:
        engine.close()
    seconds = time.perf_counter() - t0
    return {"path": root, "records": len(scan.ops), "bytes_scanned": scan.bytes_scanned, "seconds": seconds,
            "gb_per_second": scan.bytes_scanned / 1e9 / seconds if seconds else None,
            "damage": [d.__dict__ for d in scan.damage], "removed_segments": scan.removed_segments,
            "stale_keys_deleted": [{"namespace": ns.decode("utf-8", "replace"), "key": shown_key(key)}
                                   for ns, key in deleted],
            "lost_keys": [{"namespace": ns.decode("utf-8", "replace"), "key": shown_key(key), "lsn": lsn}
                          for ns, key, lsn in lost],
            "next_lsn": scan.next_lsn, "old_index": scan.old_index, "references_dropped": dangling,
            "blobs_without_dictionary": orphans}


def _drop_blobs_without_dictionary(engine: Engine) -> list[dict[str, Any]]:
    """Blobs whose zstd dictionary was lost to damage can never be decoded: copy each record to
    quarantine/ (with the dictionary, someone could still restore it), then delete it with its
    references.  The caller holds the write lock; returns what was moved."""
    assert engine.index is not None
    with engine.index.read() as view:
        orphans = [(ns, key, loc) for ns, key, loc in view.items()
                   if not ns.startswith(b"\x00") and "dict" in loc.header.meta.get("codec_params", {})
                   and not view.contains(fmt.DICT_NAMESPACE, rec.dict_key(ns, loc.header.meta["codec_params"]["dict"]))]
    out = []
    for ns, key, loc in orphans:
        did = loc.header.meta["codec_params"]["dict"]
        with engine.hold_segment(loc.segment) as (fd, _):
            end = loc.offset + loc.header.record_len
            kept = quarantine_bytes(engine.io, engine.path, fd, loc.segment, loc.offset, end,
                                    f"blob {_ns(ns)}/{shown_key(key)} needs zstd dictionary {did}, lost to damage")
        engine.append_group(engine.deletion(ns, key, loc.header.flags))
        out.append({"namespace": _ns(ns), "key": shown_key(key), "dictionary": did, "quarantined_to": kept})
    return out


def _drop_dangling_references(engine: Engine) -> list[dict[str, str]]:
    """Delete every session reference whose object is gone (its record was damaged and dropped),
    so the repair is complete: SPEC.md §5.4 says every reference names a live object.  The
    caller holds the write lock; returns what was dropped."""
    dropped, batch = [], []
    for rk in sorted(engine.keys(fmt.REF_NAMESPACE)):
        parsed = rec.parse_ref_key(rk)
        loc = engine.lookup(fmt.REF_NAMESPACE, rk)
        if parsed is None or loc is None:
            continue
        ns, session, _ = parsed
        target = loc.header.meta["key"]
        if engine.lookup(ns, target) is not None:
            continue
        dropped.append({"namespace": _ns(ns), "key": shown_key(target),
                        "session": "" if session == fmt.ANCHOR_SESSION else _ns(session)})
        batch.append(rec.encode_delete(fmt.REF_NAMESPACE, rk, 0))
        if len(batch) == fmt.GROUP_MAX:
            engine.append_group(batch)
            batch = []
    if batch:
        engine.append_group(batch)
    return dropped


# --- quarantine/ ---------------------------------------------------------------------------------


def quarantine_list(path: str) -> list[dict[str, Any]]:
    """What ``quarantine/`` holds: one entry per quarantined item (a file or an old index),
    with its size, time and the reason recorded beside it."""
    qdir = os.path.join(os.path.abspath(path), fmt.QUARANTINE_DIR)
    if not os.path.isdir(qdir):
        return []
    out = []
    for name in sorted(os.listdir(qdir)):
        full = os.path.join(qdir, name)
        if name.endswith(".txt") and os.path.exists(full[: -len(".txt")]):
            continue  # the reason beside a quarantined file
        if os.path.isdir(full):
            size = sum(os.path.getsize(os.path.join(full, f)) for f in os.listdir(full))
            why_file = os.path.join(full, "REASON.txt")
        else:
            size, why_file = os.path.getsize(full), full + ".txt"
        reason = None
        if os.path.exists(why_file):
            with open(why_file) as f:
                reason = f.read().strip()
        out.append({"name": name, "bytes": size, "mtime": os.path.getmtime(full), "reason": reason})
    return out


def quarantine_clear(path: str, *, lock_timeout: float = 60.0, io: PosixIO | None = None) -> int:
    """Delete everything in ``quarantine/`` (under the writer lock); returns how many items went.
    Quarantined bytes are never part of the store: recover already kept every intact record."""
    io = io or PosixIO()
    root = os.path.abspath(path)
    if not os.path.isdir(os.path.join(root, fmt.SEGMENTS_DIR)):
        raise StoreNotFound(f"no store at {root}", path=root)
    items = quarantine_list(root)
    if not items:
        return 0
    if writing_in_process(root):
        raise StoreLocked("this process has the store open for writing", path=root, hint="close that handle first")
    lock = acquire_writer_lock(io, root, lock_timeout)
    try:
        qdir = os.path.join(root, fmt.QUARANTINE_DIR)
        for item in items:
            full = os.path.join(qdir, item["name"])
            if os.path.isdir(full):
                shutil.rmtree(full)
            else:
                os.unlink(full)
                if os.path.exists(full + ".txt"):
                    os.unlink(full + ".txt")
        io.fsync_dir(qdir)
    finally:
        io.close(lock)
    return len(items)


# --- checking (fsck) ---------------------------------------------------------------------------


@dataclass
class Finding:
    severity: str  # "error" | "warning"
    what: str
    segment: int | None = None
    offset: int | None = None
    namespace: str | None = None
    key: Any = None

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if v is not None}
        if "key" in d:  # as `tierstore ls --json` shows keys
            d["key_type"] = "bytes" if isinstance(d["key"], bytes) else "text"
        if isinstance(d.get("key"), bytes):
            d["key"] = "0x" + d["key"].hex()
        return d


@dataclass
class Report:
    findings: list[Finding] = field(default_factory=list)
    objects: int = 0
    references: int = 0
    segments: int = 0
    bytes_verified: int = 0

    @property
    def ok(self) -> bool:
        return not any(f.severity == "error" for f in self.findings)

    def error(self, what: str, **where: Any) -> None:
        self.findings.append(Finding("error", what, **where))

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "objects": self.objects, "references": self.references, "segments": self.segments,
                "bytes_verified": self.bytes_verified, "findings": [f.as_dict() for f in self.findings]}


def _ns(b: bytes) -> str:
    return b.decode("utf-8", "replace")


def fsck(path: str, *, deep: bool = False, progress: Callable[[int], None] | None = None) -> Report:
    """``tierstore fsck``: open the store read-only and ``check_store`` it."""
    root = os.path.abspath(path)
    index_dir = os.path.join(root, fmt.INDEX_DIR)
    walk = deep and Index.exists(index_dir)
    walked = walk_live(index_dir) if walk else []
    if walked:
        # verify-then-trust: LMDB's offline verifier walks the file in Python before liblmdb maps it
        return _index_report(root, [f"index (LMDB): {p}" for p in walked])
    try:
        engine = Engine(root, create=False, readonly=True)
    except CorruptionError as e:
        if not getattr(e, "index", False):
            raise
        return _index_report(root, [e.message])
    try:
        assert engine.index is not None
        report = check_store(engine.io, engine.path, engine.index, deep=deep, progress=progress, walked=walk)
        if walked is None:
            report.findings.append(_unwalked())
        return report
    finally:
        engine.close()


def _unwalked() -> Finding:
    return Finding("warning", f"the index was not walked by LMDB's verifier: a live writer committed during each of "
                              f"{WALKS} walks (run fsck --deep again when it is quieter)")


def _index_report(root: str, problems: list[str]) -> Report:
    """fsck of a store whose index cannot be read: the findings, and that the log was not checked."""
    report = Report()
    for problem in problems:
        report.error(problem)
    report.error("the index is damaged and was not read; `tierstore recover PATH` (or fsck --fix) rebuilds it from "
                 "the segments")
    report.segments = len(seglib.list_segments(PosixIO(), os.path.join(root, fmt.SEGMENTS_DIR)))
    return report


def check_store(io: PosixIO, root: str, index: Index, *, deep: bool,
                progress: Callable[[int], None] | None = None, walked: bool = False) -> Report:
    """Check the store at ``root`` against its open ``index`` without changing either.

    Always: both directions (every index entry points at a record with the same header
    bytes; the newest record of every key in the applied log is what the index holds) and
    every checksum of every live object.  ``deep`` adds every record of the log (overwritten
    and deleted ones too) and LMDB's own structural verifier over the index file (unless
    ``walked``: the caller walked it).  A live writer that commits during each walk leaves the
    walk without an answer: a warning, not a finding of damage (``walk_live``).
    """
    report = Report()
    seg_dir = os.path.join(root, fmt.SEGMENTS_DIR)
    fds: dict[int, int] = {}
    _open_segments(io, seg_dir, fds)
    report.segments = len(fds)
    try:
        if deep:
            # verify-then-trust: LMDB's offline verifier walks the file in Python first, since
            # liblmdb itself may crash on a damaged file
            problems = [] if walked else walk_live(index.path)
            if problems is None:
                problems = []
                report.findings.append(_unwalked())
            for problem in problems:
                report.error(f"index (LMDB): {problem}")
            if problems:
                report.error("index failed verification and was not read; `tierstore recover PATH` rebuilds it")
                return report
        try:
            with index.read() as view:
                # segments other writers made since the listing (a rollover, a compaction's copies)
                # hold records this snapshot of the index may name: open them too (SPEC.md §7.8)
                _open_segments(io, seg_dir, fds)
                applied = view.applied()
                indexed = _check_index_to_log(io, view, fds, report, progress)
                if view.t.refs is not None and view.txn.stat(view.t.refs)["entries"] != report.references:
                    report.error(f"the index's refs table holds {view.txn.stat(view.t.refs)['entries']} entries "
                                 f"for {report.references} references")
        except (CorruptionError, lmdb.Error) as e:
            report.error(f"index unreadable: {getattr(e, 'message', e)}; `tierstore recover PATH` rebuilds it")
            return report
        segs = sorted(fds)
        report.segments = len(segs)
        _check_log_to_index(io, seg_dir, segs, fds, applied, indexed, report, deep)
        qdir = os.path.join(root, fmt.QUARANTINE_DIR)
        if os.path.isdir(qdir) and os.listdir(qdir):
            n = len(quarantine_list(root))
            report.findings.append(Finding("warning", f"quarantine/ holds {n} item(s) set aside earlier (by "
                                                      "recover, or by an open that cut a torn tail); "
                                                      "`tierstore quarantine PATH` lists them, --clear deletes them"))
        if os.path.exists(os.path.join(root, fmt.INDEX_DIR + ".rebuild")):
            report.findings.append(Finding("warning", "an interrupted index rebuild left index.rebuild/ "
                                                      "(the next recover removes it)"))
        for seg, (_dead, state) in index.segment_stats().items():
            if state == 1 and seg in fds:
                report.findings.append(Finding("warning", "segment marked dead by compaction is still on disk "
                                                          "(a compaction in progress deletes it when done; one "
                                                          "interrupted: the next writer that opens alone, or the "
                                                          "next compaction)", segment=seg))
    finally:
        for fd in fds.values():
            io.close(fd)
    return report


def _open_segments(io: PosixIO, seg_dir: str, fds: dict[int, int]) -> None:
    """Open (and lock shared) the listed segments not yet in ``fds``: held open for the whole
    check, so that a compaction cannot shrink them."""
    for seg in seglib.list_segments(io, seg_dir):
        if seg in fds:
            continue
        try:
            fds[seg] = seglib.open_segment(io, os.path.join(seg_dir, seglib.segment_name(seg)))
        except FileNotFoundError:
            continue  # retired by a compaction since the listing


def _check_index_to_log(io: PosixIO, view: Any, fds: dict[int, int], report: Report,
                        progress: Callable[[int], None] | None) -> dict[tuple[bytes, bytes], Location]:
    indexed: dict[tuple[bytes, bytes], Location] = {}
    for k, v in view.txn.cursor(db=view.t.objects):
        ns, key = k[1 : 1 + k[0]], k[1 + k[0] :]
        try:
            loc = decode_location(v, ns, key)
        except CorruptionError as e:
            report.error(f"bad index entry: {e.message}", namespace=_ns(ns), key=key)
            continue
        indexed[(ns, key)] = loc
        did = loc.header.meta.get("codec_params", {}).get("dict")
        if did is not None and not view.contains(fmt.DICT_NAMESPACE, rec.dict_key(ns, did)):
            shown_ = key.decode("utf-8", "replace") if loc.header.key_is_str else key
            report.error(f"blob compressed with zstd dictionary {did}, which is missing (it cannot be read)",
                         namespace=_ns(ns), key=shown_, segment=loc.segment, offset=loc.offset)
        if ns == fmt.REF_NAMESPACE:
            _check_reference(view, key, loc, report)
        else:
            report.objects += 1
        shown = key.decode("utf-8", "replace") if loc.header.key_is_str else key
        where = {"segment": loc.segment, "offset": loc.offset, "namespace": _ns(ns), "key": shown}
        fd = fds.get(loc.segment)
        if fd is None:
            report.error("index entry points at a missing segment", **where)
        elif io.pread(fd, loc.header.header_len, loc.offset) != loc.header.raw:
            report.error("index entry does not match the record in the segment", **where)
        elif io.size(fd) < loc.offset + loc.header.record_len:
            report.error("record extends past the end of its segment", **where)
        else:
            bad = seglib.verify_extents(io, fd, loc.offset, loc.header)
            if bad is not None:
                report.error(f"extent {bad} checksum mismatch", **where)
            report.bytes_verified += sum(loc.header.extent_lengths)
            if progress is not None:
                progress(sum(loc.header.extent_lengths))
    return indexed


def _stop_severity(io: PosixIO, fd: int, seg: int, path: str, stop: seglib.ScanStop,
                   scanner: seglib.SegmentScanner, base_lsn: int, applied: Applied, *, last: bool) -> tuple[str, str]:
    """How bad the damage where a scan of segment ``seg`` stopped is, and what it is, by
    recovery's rule (SPEC.md §7.3): in a sealed segment, an error; in the last one, an error
    only when the record there was synced -- its LSN (the one expected there, when its header
    does not decode) is at most the index's applied LSN or a valid SYNC record after it vouches
    for it -- else a torn write that the next writer cuts (a warning, naming the records
    after it that the cut drops, their bytes kept in quarantine/)."""
    if not last:
        return "error", stop.detail
    size = io.size(fd)
    lsn = stop.header.lsn if stop.header is not None else scanner.expect_lsn or base_lsn
    if lsn <= applied.lsn or lsn <= certified_after(io, fd, seg, path, stop.offset, size):
        return "error", stop.detail + "; the record was synced (the index or a SYNC record says so)"
    nxt = scanner.next_valid(stop.offset)
    dropped = 0
    if nxt is not None:
        after = seglib.SegmentScanner(io, fd, seg, path=path, start=nxt, verify_payload=False, size=size)
        dropped = sum(hdr.type != fmt.REC_PAD for _, hdr in after.records())
    return "warning", stop.detail + "; no SYNC record vouches for it: a torn write, which the next writer cuts" + (
        f" (the {dropped} record(s) after it go too, their bytes kept in quarantine/)" if dropped else "")


def _in_flight(io: PosixIO, fd: int, seg: int, path: str, stop: seglib.ScanStop, seg_dir: str) -> bool:
    """Whether the record cut by the end of the last segment where a scan stopped is one a live
    writer was appending (it is whole a moment later) rather than a torn write."""
    if not writer_active(io, os.path.dirname(seg_dir)):
        return False
    time.sleep(0.2)
    again = seglib.SegmentScanner(io, fd, seg, path=path, start=stop.offset, verify_payload=False, size=io.size(fd))
    if next(iter(again.records()), None) is not None:
        return True  # (a record read whole from there now)
    return again.stop is not None and again.stop.offset > stop.offset  # (passed over padding whole now)


def _check_tail_record(io: PosixIO, fd: int, off: int, hdr: Any, seg_dir: str) -> int | None:
    """The first extent of a PUT record no index commit has applied yet that fails its checksum
    (None: all match) -- looked at again a moment later when a writer of this store is active
    (the record may be being written)."""
    bad = seglib.verify_extents(io, fd, off, hdr)
    if bad is not None and writer_active(io, os.path.dirname(seg_dir)):
        time.sleep(0.2)
        bad = seglib.verify_extents(io, fd, off, hdr)
    return bad


def _check_reference(view: Any, key: bytes, loc: Location, report: Report) -> None:
    """A session reference (SPEC.md §5.4) points at a live object and is in the derived refs table."""
    report.references += 1
    ns, session, digest = rec.parse_ref_key(key) or (b"", b"", b"")  # decode_location validated it
    target = loc.header.meta["key"]
    where = {"namespace": _ns(ns), "key": target, "segment": loc.segment, "offset": loc.offset}
    if not view.contains(ns, target):
        report.error(f"session {_ns(session)!r} holds a reference on a missing object", **where)
    refs = view.t.refs
    if refs is None or view.txn.get(bytes((len(ns),)) + ns + digest + session, db=refs) is None:
        report.error("reference missing from the index's refs table", **where)


def _check_log_to_index(io: PosixIO, seg_dir: str, segs: list[int], fds: dict[int, int], applied: Applied,
                        indexed: dict[tuple[bytes, bytes], Location], report: Report, deep: bool) -> None:
    # key -> (lsn, segment, offset, flags); segment -1: deleted
    newest: dict[tuple[bytes, bytes], tuple[int, int, int, int]] = {}
    tail = 0  # records past the index's applied position (a writer's last ones, not applied yet)
    cut = False  # a scan stopped at damage before its segment's end: records after it were not read
    for seg in segs:
        path = os.path.join(seg_dir, seglib.segment_name(seg))
        try:
            base_lsn = seglib.read_segment_header(io, fds[seg], path=path, seg_id=seg).base_lsn
        except TierstoreError as e:
            report.error(f"bad segment header: {e.message}", segment=seg, offset=0)
            continue
        first = base_disagrees(io, fds[seg], seg, path, base_lsn)
        if first is not None:
            report.error(f"segment header's base LSN {base_lsn} is not its first record's LSN {first}: a reader "
                         "rejects that record (`tierstore recover PATH` rewrites the header)", segment=seg, offset=0)
        scanner = seglib.SegmentScanner(io, fds[seg], seg, path=path, verify_payload=deep)
        vouched = 0  # the largest LSN this segment's SYNC records say was synced (SPEC.md §7.3)
        bad: list[tuple[int, Any, int]] = []
        for off, hdr in scanner.records():
            if hdr.type == fmt.REC_SYNC:
                vouched = max(vouched, hdr.meta.get("durable", 0))
            if hdr.lsn > applied.lsn:
                # readers serve these already (the memtable of a read-only open): their checksums
                # are checked too (before 2026-12-03 fsck stopped here, and said "ok" of damage a
                # writer killed before its index commit left)
                tail += hdr.type in (fmt.REC_PUT, fmt.REC_DELETE)
                if hdr.type == fmt.REC_PUT and not deep:
                    extent = _check_tail_record(io, fds[seg], off, hdr, seg_dir)
                    if extent is not None:
                        bad.append((off, hdr, extent))
                continue
            if hdr.type == fmt.REC_PUT:
                newest[(hdr.namespace, hdr.key)] = (hdr.lsn, seg, off, hdr.flags)
            elif hdr.type == fmt.REC_DELETE:
                newest[(hdr.namespace, hdr.key)] = (hdr.lsn, -1, -1, hdr.flags)
        for off, hdr, extent in bad:
            shown = hdr.key.decode("utf-8", "replace") if hdr.key_is_str else hdr.key
            where = {"segment": seg, "offset": off, "namespace": _ns(hdr.namespace), "key": shown}
            if seg == segs[-1] and hdr.lsn > vouched:  # not known synced: a torn write, which the next
                report.findings.append(Finding(  # writer cuts, as recovery cuts a torn tail (§7.3)
                    "warning", f"extent {extent} checksum mismatch in a record no SYNC record vouches for: a "
                               "torn write (the next writer to open the store cuts it)", **where))
            else:
                report.error(f"extent {extent} checksum mismatch (a record not applied to the index yet)", **where)
        stop = scanner.stop
        if stop is not None and stop.reason == "torn" and seg == segs[-1] and _in_flight(io, fds[seg], seg, path,
                                                                                         stop, seg_dir):
            stop = None  # a record a live writer was appending as the scan reached it: the end of the log
        if stop is not None and stop.reason != "end":
            severity, stop.detail = _stop_severity(io, fds[seg], seg, path, stop, scanner, base_lsn, applied,
                                                   last=seg == segs[-1])
            cut = cut or severity == "error"
            report.findings.append(Finding(severity, f"log damaged ({stop.reason}: {stop.detail})", segment=seg,
                                           offset=stop.offset))
    if tail:
        report.findings.append(Finding("warning", f"{tail} record(s) past the index's applied position, "
                                                  "checked here: the newest records of writers -- one still "
                                                  "running applies its own within index_commit_ms; those of a "
                                                  "writer that died, the next writer that opens the store "
                                                  "applies (and cuts a torn write)"))
    if cut:  # a newer record of any key may be in what was not read: "not indexed" would be a guess
        report.findings.append(Finding("warning", "live records were not looked for in the index: a scan "
                                                  "stopped at damage, and a key's newer record may lie past it "
                                                  "(recover repairs both)"))
    for (ns, key), (lsn, seg, off, flags) in newest.items():
        loc = indexed.get((ns, key))
        where = {"namespace": _ns(ns), "key": key.decode("utf-8", "replace") if flags & fmt.FLAG_KEY_STR else key}
        if seg == -1:
            if loc is not None and loc.header.lsn < lsn:
                report.error("deleted object is still indexed", **where)
        elif loc is None:
            if not cut:
                report.error("live record is not indexed", segment=seg, offset=off, **where)
        elif (loc.segment, loc.offset) != (seg, off) and loc.header.lsn < lsn:
            report.error("index points at an older version", segment=seg, offset=off, **where)
