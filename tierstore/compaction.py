"""Compaction: reclaim the space of overwritten and deleted objects (SPEC.md §7.5).

Steps, each crash-safe:

1. Flush, so the index reflects the whole log, and roll the log over to a fresh segment
   unless the active segment is still small: victims are always sealed segments.
2. Victims: sealed segments whose dead fraction is at least ``min_dead_ratio``, and sealed
   segments smaller than a quarter of ``segment_bytes`` (merged, so that frequent
   compactions or restarts never leave a growing number of small files).
3. For each record of each victim, under the store's write lock: a PUT that is still the
   key's live version is copied to the log head (header restamped with a new LSN, payload
   copied byte for byte with its checksums); a DELETE is carried forward only if an older,
   surviving segment may still hold a PUT of that key.  Everything else is dropped.
4. Sync the log and apply the copies to the index in one durable transaction.  A crash
   before this point leaves duplicates with newer LSNs: replay makes them the live copies.
5. Mark the victims dead in the index (durable), then unlink them.  A crash in between
   leaves dead segments that the next open unlinks.

Steps 3-5 run on batches of victims (oldest first, ``BATCH_BYTES`` or ``BATCH_SEGMENTS`` at a time), so a
compaction that is interrupted (a crash, a kill) keeps the space it already reclaimed and a
store that is killed often still makes progress.

This module never rewrites a record in place and never deletes a segment the index uses.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from . import format as fmt
from . import record as rec
from . import segment as seglib
from .errors import CorruptionError

if TYPE_CHECKING:
    from .store import Store

# victims are compacted (copied, applied, unlinked) in batches of at most this many bytes or segments
BATCH_BYTES = 64 << 20
BATCH_SEGMENTS = 16
# sealed segments smaller than segment_bytes / SMALL_FRACTION are merged whatever their dead
# fraction, and compaction rolls the log over only when the active segment is at least that big
SMALL_FRACTION = 4


def compact(store: "Store", log: seglib.Log, *, min_dead_ratio: float) -> dict[str, Any]:
    t0 = time.perf_counter()
    io = store._io
    index = store._index
    assert index is not None
    store._commit(force=True, sync=True)
    small = log.segment_bytes // SMALL_FRACTION
    with store._write_lock:
        with log.append_lock:
            if log.tail >= small:  # a small active segment stays open: the copies join it
                log._rollover()
        active = log.active
    stats = index.segment_stats()
    victims = []
    for seg in seglib.list_segments(io, store._seg_dir):
        if seg >= active:
            continue
        file_size = os.path.getsize(store._files.path(seg))
        size = file_size - fmt.SEGMENT_HEADER_SIZE
        dead = stats.get(seg, (0, 0))[0]
        if size <= 0 or file_size < small or dead > 0 and dead / size >= min_dead_ratio:
            victims.append(seg)
    victim_set = set(victims)
    # the oldest segment that survives: a DELETE must be carried forward from any victim newer than it
    oldest_survivor = min((s for s in seglib.list_segments(io, store._seg_dir) if s not in victim_set), default=None)
    bytes_before = sum(os.path.getsize(store._files.path(s)) for s in victims)
    counts = {"copied": 0, "carried_deletes": 0, "dropped": 0}
    batch: list[int] = []
    batch_bytes = 0
    for seg in victims:  # oldest first, in batches: an interrupted compaction keeps what it finished
        batch.append(seg)
        batch_bytes += os.path.getsize(store._files.path(seg))
        if batch_bytes >= BATCH_BYTES or len(batch) >= BATCH_SEGMENTS or seg == victims[-1]:
            _compact_batch(store, log, batch, oldest_survivor, counts)
            batch, batch_bytes = [], 0
    return {"victims": victims, **counts, "bytes_before": bytes_before, "seconds": time.perf_counter() - t0}


def _compact_batch(store: "Store", log: seglib.Log, batch: list[int], oldest_survivor: int | None,
                   counts: dict[str, int]) -> None:
    """Steps 3-5 for some of the victims: copy, sync and apply, mark dead, unlink."""
    io = store._io
    index = store._index
    assert index is not None
    moved: list[tuple[bytes, bytes]] = []
    for seg in batch:
        older_survivor = oldest_survivor is not None and oldest_survivor < seg
        path = store._files.path(seg)
        with store._segment_fd(seg) as (fd, _):
            scanner = seglib.SegmentScanner(io, fd, seg, path=path, verify_payload=False)
            for off, hdr in scanner.records():
                with store._write_lock:
                    cur = store._lookup(hdr.namespace, hdr.key)
                    if hdr.type == fmt.REC_PUT:
                        if cur is None or (cur.segment, cur.offset) != (seg, off):
                            counts["dropped"] += 1
                            continue
                        _copy_record(log, store, fd, off, hdr)
                        moved.append((hdr.namespace, hdr.key))
                        counts["copied"] += 1
                    elif hdr.type == fmt.REC_DELETE:
                        if cur is not None or not older_survivor:
                            counts["dropped"] += 1
                            continue
                        log.append(rec.EncodedRecord(hdr), store._on_written)
                        counts["carried_deletes"] += 1
            if scanner.stop is not None and scanner.stop.reason != "end":
                # never drop a segment we could not read to its end
                raise CorruptionError(f"cannot compact a damaged segment ({scanner.stop.detail})", path=path,
                                      segment=seg, offset=scanner.stop.offset)
    store._commit(force=True, sync=True)
    for ns, key in moved:  # the index must no longer point into a victim
        loc = store._lookup(ns, key)
        if loc is not None and loc.segment in batch:
            raise AssertionError(f"compaction left {key!r} in victim segment {loc.segment}")
    index.mark_dead(batch)
    for seg in batch:
        io.unlink(store._files.path(seg))
        store._files.retire(seg)
    io.fsync_dir(store._seg_dir)
    index.forget_segments(batch)


def _copy_record(log: seglib.Log, store: "Store", src_fd: int, off: int, hdr: rec.RecordHeader) -> None:
    """Append a byte-for-byte copy of a PUT record (new LSN) through the log."""
    io = store._io
    body_len = hdr.record_len - hdr.header_len
    body = io.pread(src_fd, body_len, off + hdr.header_len) if body_len else b""
    if len(body) != body_len:
        raise CorruptionError("record extends past the end of its segment", offset=off, key=hdr.key)
    log.append(rec.EncodedRecord(hdr, body=memoryview(body)), store._on_written)
