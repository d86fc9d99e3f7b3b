"""Compaction: reclaim the space of overwritten and deleted objects (SPEC.md §7.5).

Steps, each crash-safe:

1. Flush, so the index reflects the whole log, and roll the log over to a fresh segment
   unless the active segment is still small and holds no dead bytes: victims are always
   sealed segments, and every dead byte is in one.
2. Victims: sealed segments whose dead fraction is at least ``min_dead_ratio``, and sealed
   segments smaller than a quarter of ``segment_bytes`` (merged, so that frequent
   compactions or restarts never leave a growing number of small files).
3. For each record of each victim, under the engine's write lock (taken for a run of records
   that looked live without it: a record not its key's newest never becomes it again): a PUT that is still the
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

It is given the Engine (engine.py) and uses only its public methods.  It never rewrites a
record in place and never deletes a segment the index uses.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from ..errors import CorruptionError
from ..format import constants as fmt
from ..format import record as rec
from . import segment as seglib
from .engine import Engine

# victims are compacted (copied, applied, unlinked) in batches of at most this many bytes or segments
BATCH_BYTES = 64 << 20
BATCH_SEGMENTS = 16
# step 3 copies the live records of a victim this many (or bytes) at a time under the write lock: a
# put waits for one such run, and the lock's cost (other writers' records, the log's buffer) is paid once
COPY_RECORDS = 32
COPY_BYTES = 1 << 20
# sealed segments smaller than segment_bytes / SMALL_FRACTION are merged whatever their dead
# fraction, and compaction rolls the log over only when the active segment is at least that big
SMALL_FRACTION = 4
# at most this many record headers of surviving segments are read to decide exactly which
# DELETEs a compaction must carry forward (_carry_rule); past it, the rule is conservative
CARRY_SCAN_RECORDS = 250_000  # (~55k headers/s here: a few seconds at most, once per segment)


def compact(engine: Engine, *, min_dead_ratio: float, progress: Callable[[int], None] | None = None,
            batch_bytes: int = BATCH_BYTES) -> dict[str, Any]:
    """Steps 1-5 above; returns what was done (victims, records copied / carried / dropped).
    ``progress(n)`` is told the bytes of each victim segment once it is done.  ``batch_bytes``:
    victims are retired each time about this many were compacted (a budget's slack: the copies
    of a batch land before its victims go)."""
    engine.check_writable()
    lock = engine.compaction_lock()  # one compaction at a time, across processes too
    try:
        return _compact(engine, min_dead_ratio, progress, batch_bytes)
    finally:
        engine.let_go(lock)


def _compact(engine: Engine, min_dead_ratio: float, progress: Callable[[int], None] | None,
             batch_bytes: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    engine.commit(force=True, sync=True)
    small = engine.options.segment_bytes // SMALL_FRACTION
    stats = engine.segment_stats()
    active = engine.segments()[-1]
    # a small active segment stays open (the copies join it) unless it holds dead bytes itself:
    # then it is sealed and merged like any small segment, so that compact() always reclaims
    active = engine.seal_active(1 if stats.get(active, (0, 0))[0] > 0 else small)
    stats = engine.segment_stats()
    victims = []
    for seg in engine.segments():
        if seg >= active:
            continue
        file_size = os.path.getsize(engine.segment_path(seg))
        size = file_size - fmt.SEGMENT_HEADER_SIZE
        dead = stats.get(seg, (0, 0))[0]
        if size <= 0 or file_size < small or dead > 0 and dead / size >= min_dead_ratio:
            victims.append(seg)
    got = _compact_victims(engine, victims, progress, batch_bytes=batch_bytes)
    del got["blockers"]  # (reclaim's business)
    return {"victims": victims, **got, "seconds": time.perf_counter() - t0}


def reclaim(engine: Engine, excess: Callable[[], int], *, min_dead_ratio: float,
            gradual: bool = False, batch_bytes: int = BATCH_BYTES) -> dict[str, Any]:
    """Compact sealed segments whose dead fraction is at least ``min_dead_ratio``, the largest
    fraction first (the fewest live bytes copied per byte freed), until ``excess()`` (bytes
    still to free) is 0 or none is left: the SSD budget's eviction (capacity.py), after it deleted
    its victims.  Victims are taken together while their dead bytes cover the excess (one sync
    and one index commit per batch).  The active segment is sealed and joins them when the
    sealed ones do not suffice and it holds dead bytes itself.  ``gradual``: victims are shrunk
    away (``Engine.retire_segments``), for a background eviction beside puts.  ``batch_bytes``:
    victims are retired (their room given back) each time about this many were compacted.  When those do
    not cover the excess, small sealed segments (under ``segment_bytes / SMALL_FRACTION``) are
    merged too, the largest first: what they hold besides objects is not counted dead."""
    engine.check_writable()
    small = engine.options.segment_bytes // SMALL_FRACTION
    lock = engine.compaction_lock()
    try:
        t0 = time.perf_counter()
        engine.commit(force=True, sync=True)
        done: list[int] = []
        counts = {"copied": 0, "carried_deletes": 0, "dropped": 0, "bytes_before": 0, "stalled": 0}
        sealed = False
        sealed_free = -1  # the active segment sealed for what it frees besides dead records
        last_need = None
        blockers: set[int] = set()  # survivors whose dead PUTs made the last pass carry DELETEs
        tried: set[int] = set()
        kept: dict[int, int] | None = None  # (kept_bytes, read when first needed)
        kept_of: set[int] = set()
        kept_applied = None  # the applied position read before them
        while (need := excess()) > 0:
            if last_need is not None and need >= last_need and not blockers:
                counts["stalled"] = 1  # a pass freed nothing: stop rather than compact the same bytes again
                break
            last_need = need
            # the active id under the append lock, not the last file listed: another writer that
            # died after creating the next file, before its header, leaves a file past it
            active = engine.active_segment()
            stats = engine.segment_stats()
            segs = [seg for seg in engine.segments() if seg < active]
            ranked, small_ones = [], []
            for seg in segs:
                dead = stats.get(seg, (0, 0))[0]
                size = max(1, os.path.getsize(engine.segment_path(seg)) - fmt.SEGMENT_HEADER_SIZE)
                if dead > 0 and dead / size >= min_dead_ratio:
                    ranked.append((-dead / size, seg, dead))
                elif size + fmt.SEGMENT_HEADER_SIZE < small:
                    small_ones.append((size, seg))
            victims, covered = [], 0
            for _, seg, dead in sorted(ranked):
                if covered >= need:
                    break
                victims.append(seg)
                covered += dead
            # then small sealed segments, as compact() merges them: records that change no object
            # (SYNC, HEADERS, padding) are not counted dead, and segments of little else -- an
            # eviction seals the active segment -- would otherwise fill the budget, never victims
            for size, seg in sorted(small_ones, reverse=True):
                if covered >= need:
                    break
                victims.append(seg)
                covered += size
            if covered < need:
                # then segments of few live objects whatever their dead bytes: SYNC and HEADERS
                # records and page padding change no object and are not counted dead, and a
                # segment of little else (small synced puts, evictions' deletes) holds room for good
                # only segments the index had applied every record of when the kept bytes were read:
                # another writer's records not applied yet are live bytes they do not count (read
                # again for segments sealed since, or once the index applied more: a segment read
                # before loses live bytes, never gains, unless it held records not applied then)
                now_applied = engine.applied_position()
                if kept is None or not kept_of.issuperset(segs) or now_applied != kept_applied:
                    kept_applied = now_applied  # (first: the kept bytes count at least what it names)
                    kept, kept_of = engine.kept_bytes(), set(segs)
                applied = kept_applied.segment
                taken = set(victims)
                spare = []
                for seg in (seg for seg in segs if seg < applied or seg == sealed_free):
                    size = max(1, os.path.getsize(engine.segment_path(seg)) - fmt.SEGMENT_HEADER_SIZE)
                    free = size - kept.get(seg, 0)
                    if seg not in taken and free > 0 and free / size >= min_dead_ratio:
                        spare.append((-free / size, seg, free))
                for _, seg, free in sorted(spare):
                    if covered >= need:
                        break
                    victims.append(seg)
                    covered += free
            active_dead = stats.get(active, (0, 0))[0]
            active_size = max(1, os.path.getsize(engine.segment_path(active)) - fmt.SEGMENT_HEADER_SIZE)
            # what compacting the active segment would free besides its dead records: HEADERS and
            # SYNC records, padding (a HEADERS record of 651 small records' copies, 52 KB of a 64 KiB
            # segment, held a 1 MiB budget with no object left full for good: every put StoreFull)
            active_free = active_size - kept.get(active, 0) if kept is not None else 0
            if covered < need and not sealed and not blockers and active_free >= small and not (
                    active_dead > 0 and active_dead / active_size >= min_dead_ratio):
                # it would free that much besides dead records: confirmed on the index as it is now
                # (puts that landed since the kept bytes were read are live, not free: a busy active
                # segment must not be sealed and copied for them)
                engine.commit(force=True, sync=True)
                active_free = active_size - engine.kept_bytes().get(active, 0)
            if covered < need and not sealed and not blockers and (
                    active_dead > 0 and active_dead / active_size >= min_dead_ratio
                    or active_free >= small and active_free / active_size >= min_dead_ratio):
                # (a share as sealed ones, or a small segment's worth: one that only holds a DELETE
                # carried forward -- the applied position's -- would be sealed and its DELETE carried
                # on into the next, round and round)
                engine.seal_active(1)  # its dead bytes join in (next pass)
                sealed = True
                if active_free >= small:  # (this process's records are all applied: commit above)
                    sealed_free = active
                last_need = None  # (sealing freed nothing yet)
                continue
            # the survivors that held the PUTs of DELETEs the last pass had to carry join in, whatever
            # their dead share: with them gone those DELETEs are dropped (carried again and again
            # otherwise, their dead bytes never freed) -- those whose live bytes a batch may copy: a
            # batch's copies land before its victims go, and a blocker that is nearly all live (a
            # large object beside its session's dropped reference) copied whole passed the budget
            # by its size to free a hundred bytes; its DELETEs are carried on instead
            victims = sorted(set(victims) | {seg for seg in blockers & set(segs) if _live_bytes(engine, seg, stats)
                                             <= batch_bytes})
            blockers = set()
            if not victims:
                break
            got = _compact_victims(engine, victims, None, gradual=gradual, batch_bytes=batch_bytes)
            blockers = set(got.pop("blockers")) - tried
            tried |= blockers
            for k, v in got.items():
                counts[k] += v
            done += victims
        return {"victims": done, **counts, "seconds": time.perf_counter() - t0}
    finally:
        engine.let_go(lock)


def _live_bytes(engine: Engine, seg: int, stats: dict[int, tuple[int, int]]) -> int:
    """What compacting sealed segment ``seg`` copies at most: its bytes that are not dead."""
    try:
        size = os.path.getsize(engine.segment_path(seg)) - fmt.SEGMENT_HEADER_SIZE
    except FileNotFoundError:
        return 0
    return max(0, size - stats.get(seg, (0, 0))[0])


def _compact_victims(engine: Engine, victims: list[int], progress: Callable[[int], None] | None, *,
                     gradual: bool = False, batch_bytes: int = BATCH_BYTES) -> dict[str, Any]:
    """Steps 3-5 on ``victims`` (ascending), oldest first, in batches: an interrupted compaction
    keeps what it finished."""
    carry, blockers = _carry_rule(engine, set(victims))
    bytes_before = sum(os.path.getsize(engine.segment_path(s)) for s in victims)
    counts = {"copied": 0, "carried_deletes": 0, "dropped": 0}
    batch: list[int] = []
    size = 0
    for seg in victims:
        n = os.path.getsize(engine.segment_path(seg))
        if batch and size + n > batch_bytes:
            # a batch's copies land before its victims go: it holds at most batch_bytes of victims
            # (or one larger victim); it closed only once past them (a budget's slack and a segment more)
            compact_batch(engine, batch, carry, counts, progress, gradual=gradual)
            batch, size = [], 0
        batch.append(seg)
        size += n
        if size >= batch_bytes or len(batch) >= BATCH_SEGMENTS or seg == victims[-1]:
            compact_batch(engine, batch, carry, counts, progress, gradual=gradual)
            batch, size = [], 0
    return {**counts, "bytes_before": bytes_before, "blockers": sorted(blockers)}


def _carry_rule(engine: Engine, victims: set[int]) -> tuple[Callable[[bytes, bytes, int], bool], set[int]]:
    """Whether a DELETE of (namespace, key) in victim segment ``seg`` must be carried forward:
    a segment that survives and is older than ``seg`` holds a PUT of that key (dropping the
    DELETE would bring that PUT back at the next index rebuild).  A PUT of a deleted key is dead,
    so only survivors with dead bytes can hold one; their PUT keys are read from their record
    headers when first needed (``Engine.put_keys``: once per sealed segment), and past
    ``CARRY_SCAN_RECORDS`` records any older survivor with dead bytes counts.  (Carrying every
    DELETE while any older segment survived -- say one of a retained namespace -- kept every
    eviction's DELETE forever,
    and the budget's reclaim compacted them round and round: SPEC.md §7.5.)  Also returns the
    set it fills with the survivors that made a DELETE carried (reclaim compacts them next)."""
    # the victims are sealed: every DELETE in them is applied to the index now, so the dead bytes
    # of every segment holding a PUT they delete are counted below (not only those applied so far)
    engine.commit(force=True, sync=True)
    stats = engine.segment_stats()
    engine.prune_put_keys(engine.segments())  # (segments other processes retired: not kept)
    newest = max(victims, default=0)  # (survivors older than a victim are sealed: their keys never change)
    # a segment marked dead but still on disk counts too (an index rebuild would read it)
    survivors = [seg for seg in engine.segments()
                 if seg < newest and seg not in victims and (stats.get(seg, (0, 0))[0] > 0 or
                                                            stats.get(seg, (0, 0))[1] != 0)]
    keys: dict[int, frozenset[int] | None] = {}
    blockers: set[int] = set()
    left = CARRY_SCAN_RECORDS

    def keys_of(seg: int) -> frozenset[int] | None:
        """A survivor's PUT keys, read when first needed (None: unknown, it may hold any)."""
        nonlocal left
        if seg not in keys:
            read = 0
            try:
                got, read = engine.put_keys(seg, limit=left) if left > 0 else (None, 0)
            except FileNotFoundError:  # (retired meanwhile: it holds nothing any more)
                got = frozenset()
            left = 0 if got is None else left - read  # None: too many, or damaged: unknown from here on
            keys[seg] = got
        return keys[seg]

    def carry(ns: bytes, k: bytes, seg: int) -> bool:
        holders = []  # older survivors that hold (or, unknown, may hold) a PUT of the key
        h = hash((ns, k))
        for s in survivors:
            if s >= seg:
                break
            got = keys_of(s)
            if got is None or h in got:
                holders.append(s)
        blockers.update(holders)  # reclaim compacts them next: then the DELETE goes
        return bool(holders)

    return carry, blockers


def _move_applied_out(engine: Engine, batch: list[int], counts: dict[str, int]) -> None:
    """The index's applied position must name a record in the log (opens and other writers
    resume from it: a missing segment is "index ahead", and the index was rebuilt at the next
    open, or another writer's open and puts failed).  If it is in a victim, the last record
    applied was one this compaction dropped (a live PUT there was copied, and the position
    moved on with its copy): a DELETE, which is carried -- harmless, nothing after it -- or a
    record that changes no object (a SYNC or HEADERS record: an open that replayed the log's
    tail, or rebuilt the index, ends at the last record it read), for which a DELETE of a key
    that never exists is appended (``MARK_NAMESPACE``).  Either is applied, so the position
    moves out of the victims (SPEC.md §7.5 step 4)."""
    for _ in range(3):
        applied = engine.applied_position()
        if applied.lsn == 0 or applied.segment not in batch:
            return
        with engine.hold_segment(applied.segment) as (fd, _):
            hdr = rec.decode_header(engine.io.pread(fd, fmt.HEADER_MAX_BYTES, applied.offset))
        if hdr.lsn != applied.lsn or hdr.type == fmt.REC_PUT:
            raise AssertionError(f"the applied position (LSN {applied.lsn}) is a live record in victim "
                                 f"segment {applied.segment}")
        record = rec.EncodedRecord(hdr) if hdr.type == fmt.REC_DELETE else \
            rec.encode_delete(fmt.MARK_NAMESPACE, fmt.MARK_KEY, 0)
        with engine.write_lock:
            where = engine.append(record)
        if where.segment in batch:
            raise AssertionError(f"compaction carried a DELETE into victim segment {where.segment}")
        counts["carried_deletes"] += hdr.type == fmt.REC_DELETE
        engine.commit(force=True, sync=True)
    raise AssertionError("the applied position stays in the victims")


def compact_batch(engine: Engine, batch: list[int], carry: Callable[[bytes, bytes, int], bool],
                  counts: dict[str, int], progress: Callable[[int], None] | None = None, *,
                  gradual: bool = False) -> None:
    """Steps 3-5 for some of the victims: copy, sync and apply, mark dead, delete (``gradual``:
    shrunk away, ``Engine.retire_segments``)."""
    io = engine.io
    active = engine.active_segment()
    if any(seg >= active for seg in batch):  # (never: the callers take sealed segments only)
        raise AssertionError(f"compaction asked to rewrite segments {batch} with {active} active")
    moved: list[tuple[bytes, bytes]] = []
    sizes = {seg: os.path.getsize(engine.segment_path(seg)) for seg in batch}
    with engine.write_lock:  # reads every record other writers appended: the victims' (sealed) are all known
        pass  # to ``lookup`` from here, so the look without the lock below sees each key's newest record
    for seg in batch:
        path = engine.segment_path(seg)
        with engine.hold_segment(seg) as (fd, _):
            scanner = seglib.SegmentScanner(io, fd, seg, path=path, verify_payload=False)
            live: list[tuple[int, rec.RecordHeader]] = []  # copied or carried next, under the write lock
            live_bytes = 0
            for off, hdr in scanner.records():
                # (outside the write lock: a record that is not its key's newest never becomes it
                # again, so what is dropped here is dead for good; what looks live is looked at
                # again under the lock.  ``carry`` may read survivors' headers; they never change)
                if hdr.type == fmt.REC_PUT:
                    cur = engine.lookup(hdr.namespace, hdr.key)
                    keep = cur is not None and (cur.segment, cur.offset) == (seg, off)
                elif hdr.type == fmt.REC_DELETE:
                    keep = engine.lookup(hdr.namespace, hdr.key) is None and carry(hdr.namespace, hdr.key, seg)
                else:
                    continue
                if not keep:
                    counts["dropped"] += 1
                    continue
                live.append((off, hdr))
                live_bytes += hdr.record_len
                if len(live) >= COPY_RECORDS or live_bytes >= COPY_BYTES:
                    moved += _copy_live(engine, fd, seg, batch, live, counts)
                    live, live_bytes = [], 0
            if live:
                moved += _copy_live(engine, fd, seg, batch, live, counts)
            if scanner.stop is not None and scanner.stop.reason != "end":
                # never drop a segment we could not read to its end
                raise CorruptionError(f"cannot compact a damaged segment ({scanner.stop.detail})", path=path,
                                      segment=seg, offset=scanner.stop.offset)
    engine.commit(force=True, sync=True)
    _move_applied_out(engine, batch, counts)
    for ns, key in moved:  # the index must no longer point into a victim
        loc = engine.lookup(ns, key)
        if loc is not None and loc.segment in batch:
            raise AssertionError(f"compaction left {key!r} in victim segment {loc.segment}")
    engine.retire_segments(batch, gradual=gradual)
    if progress is not None:
        progress(sum(sizes.values()))


def _copy_live(engine: Engine, fd: int, seg: int, batch: list[int], live: list[tuple[int, rec.RecordHeader]],
               counts: dict[str, int]) -> list[tuple[bytes, bytes]]:
    """Step 3 for records of victim ``seg`` that looked live, under one hold of the write lock
    (a put or delete of the same key waits for it): a PUT still its key's newest is copied, a
    DELETE of a key still absent is carried.  Returns the (namespace, key) of the PUTs copied."""
    moved = []
    with engine.write_lock:
        for off, hdr in live:
            cur = engine.lookup(hdr.namespace, hdr.key)
            if hdr.type == fmt.REC_PUT:
                if cur is None or (cur.segment, cur.offset) != (seg, off):
                    counts["dropped"] += 1
                    continue
                _copy_record(engine, fd, off, hdr)
                moved.append((hdr.namespace, hdr.key))
                counts["copied"] += 1
            else:
                if cur is not None:
                    counts["dropped"] += 1
                    continue
                where = engine.append(rec.EncodedRecord(hdr))
                if where.segment in batch:
                    raise AssertionError(f"compaction carried a DELETE into victim segment {where.segment}")
                counts["carried_deletes"] += 1
    return moved


def _copy_record(engine: Engine, src_fd: int, off: int, hdr: rec.RecordHeader) -> None:
    """Append a byte-for-byte copy of a PUT record (new LSN) through the log."""
    body_len = hdr.record_len - hdr.header_len
    body = engine.io.pread(src_fd, body_len, off + hdr.header_len) if body_len else b""
    if len(body) != body_len:
        raise CorruptionError("record extends past the end of its segment", offset=off, key=hdr.key)
    engine.append(rec.EncodedRecord(hdr, body=memoryview(body)))
