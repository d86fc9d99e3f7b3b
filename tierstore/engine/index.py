"""The LMDB index (SPEC.md §9): (namespace, key) -> where the record lives, plus its header.

The index is derived state.  It is applied after the log, in batches, and records the log
position it has applied (``Applied``), so recovery replays only the tail; segments alone are
enough to rebuild it (``recovery.rebuild_index``).  This module owns the LMDB environment,
its schema and its growth (the map doubles on MapFullError, as far as the process's address
space allows; every resize of an environment holds its write lock: ``_remap``); it never reads
segments.

One environment per path per process: LMDB forbids opening the same environment twice in a
process, so handles share it through ``Index.open`` (reference counted).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import functools
import mmap
import os
import struct
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import lmdb
import lmdb.verify

from ..errors import CorruptionError, StoreFull, StoreIOError, StoreLocked, TierstoreError
from ..format import constants as fmt
from ..format import record as rec
from .fileio import DEFAULT_IO

_LOC = struct.Struct("<QQ")  # segment id, record offset; followed by the record header bytes
_APPLIED = struct.Struct("<QQQQ")  # segment, offset of the last applied record, its LSN, log end
_SYNCED = struct.Struct("<Q")  # meta `synced`: an applied LSN whose records were all synced when applied
_SEGSTAT = struct.Struct("<QB")  # dead bytes, state
_FORMAT = struct.Struct("<HH")

# a writer clears the reader slots of dead processes (liblmdb's reader_check) at most this often
# before an index commit: every commit (2.5 us with 5 reader processes here; once a second let a
# stress run's synced puts grow the file by 4.5 MB in the second after a kill)
READER_CHECK_S = 0.0
FULL_BELOW = 1 << 20  # an index write that fails with less free space than this: the disk is full
REBUILD_CHECK_S = 0.2  # how often a read-only index looks whether a rebuild replaced its file


def _file_id(path: str) -> tuple[int, int] | None:
    """(st_dev, st_ino) of the index's data file, None if it is not there."""
    try:
        st = os.stat(os.path.join(path, "data.mdb"))
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino

SEG_LIVE = 0
SEG_DEAD = 1  # superseded by compaction; its file may be deleted


class Applied(NamedTuple):
    """The log position the index reflects: every record up to ``lsn`` is applied."""

    segment: int
    offset: int  # start of the record with LSN ``lsn`` (0 when nothing is applied)
    lsn: int
    end: int  # byte after that record: replay resumes here


class Location(NamedTuple):
    """A live object: the segment and offset of its PUT record, and that record's header."""

    segment: int
    offset: int
    header: rec.RecordHeader


class Op(NamedTuple):
    """One log record to apply: a PUT (``location`` set) or a DELETE (``location`` None)."""

    namespace: bytes
    key: bytes
    lsn: int
    segment: int
    offset: int
    record_len: int
    location: Location | None
    single: bool = False  # appended alone, not in an atomic group (a transaction may end next to it)


def index_key(namespace: bytes, key: bytes) -> bytes:
    return bytes((len(namespace),)) + namespace + key


def encode_location(loc: Location) -> bytes:
    value = _LOC.pack(loc.segment, loc.offset) + loc.header.raw
    _remember(value, loc)  # the header was built or verified by this process: a get need not decode it
    return value


class _reading:
    """LMDB read failures (a damaged index file) become CorruptionError: the index is derived
    data, and `tierstore recover` rebuilds it from the segments.  (A class, not a
    ``@contextmanager``: it wraps every index read of the get path, and costs a fifth as much.)"""

    __slots__ = ("path",)

    def __init__(self, path: str) -> None:
        self.path = path

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, e: Any, tb: Any) -> None:
        if isinstance(e, lmdb.Error) and not isinstance(e, lmdb.MapResizedError):
            raise _unreadable(self.path, e) from None


INDEX_HINT = ("the index is derived data: open the store writable and it is rebuilt from the segments "
              "(or run `tierstore recover PATH`)")


def _unreadable(path: str, e: lmdb.Error) -> CorruptionError:
    return damaged(f"index unreadable: {e}", path)


# Map resizes of this process, each counted before and after (odd: one under way).  py-lmdb's
# set_mapsize invalidates every transaction of the environment, and a read transaction begun
# meanwhile fails (EINVAL): a read that failed while the count moved is run again, not called
# damage (``Engine``'s index reads).
RESIZES = [0]


RESIZE_RETRIES = 5


def resized_since(resizes: int) -> bool:
    """Whether a map resize of this process overlapped a read that began when the count was
    ``resizes`` (``RESIZES``): its failure is not damage.  Returns once no resize is under way
    (a read transaction begun during one fails), so the read can run again."""
    if not (resizes & 1 or RESIZES[0] != resizes):
        return False
    deadline = time.monotonic() + 5
    while RESIZES[0] & 1 and time.monotonic() < deadline:
        time.sleep(0.001)
    return True


def survives_resizes(fn: Any) -> Any:
    """A read that a map resize in another thread made fail (``RESIZES``) is run again, up to
    ``RESIZE_RETRIES`` times (then StoreLocked, ``busy_index``: never damage); other failures
    are raised as they are."""

    @functools.wraps(fn)
    def reading(*args: Any, **kwargs: Any) -> Any:
        for attempt in range(RESIZE_RETRIES + 1):
            resizes = RESIZES[0]
            try:
                return fn(*args, **kwargs)
            except CorruptionError as e:
                if not resized_since(resizes):
                    raise
                if attempt == RESIZE_RETRIES:  # (busy, not damaged: another process grows it fast)
                    raise StoreLocked(f"the index's map was resized under this read {attempt + 1} times in a row",
                                      path=e.path, busy_index=True,
                                      hint="try again; a larger index_map_size= makes resizes rarer") from None
        raise AssertionError("unreachable")

    return reading


def _spare_address_space(extra: int) -> bool:
    """Whether this process can map ``extra`` more bytes (``ulimit -v``): probed with an
    anonymous mapping that reserves no memory, unmapped at once."""
    if extra <= 0:
        return True
    try:
        probe = mmap.mmap(-1, extra, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0),
                          prot=0)
    except (OSError, OverflowError, ValueError):
        return False
    probe.close()
    return True


def _remap(env: lmdb.Environment, path: str, want: int, *, growing: bool, writing: bool) -> None:
    """Map ``env`` larger, at the largest step this process can map: py-lmdb's set_mapsize
    closes the environment for good when the new map fails (and its 0, "the size another
    process recorded", is 32 GiB that a process under ``ulimit -v`` cannot map), so the
    address space is probed first.  The caller holds the environment's write
    lock (``Index._write_lock``): every resize of an environment is one at a time (py-lmdb
    refuses two at once) and none runs while a write transaction is open (it refuses that
    too).  ``growing``: a commit needs more room (steps from double down to 16 MiB more),
    else the file grew past this process's map (another process's commits): ``want`` (the map
    asked for at open) or twice the pages in use if more, or twice them, or just them.  When
    nothing fits: StoreFull(index_full) for a commit (``writing``: its records stay in the log),
    StoreIOError(ENOMEM) for a read; neither is damage."""
    with _REMAP_LOCK:  # (one probe and map at a time in the process: two stores' probes may fit, not both maps)
        info = env.info()
        current = info["map_size"]
        used = (info["last_pgno"] + 1) * env.stat()["psize"]
        need = used + _MAP_SLACK  # (slack: what other processes commit between this look and the map)
        steps = ((current * 2, current * 3 // 2, current * 5 // 4, current + (16 << 20)) if growing else
                 (max(want, need * 2), need * 2, need))
        for size in steps:
            size = -(-max(size, need) // _MAP_ROUND) * _MAP_ROUND
            if size > current and _spare_address_space(size - current):
                break
        else:
            what = ("cannot grow the index's map" if growing else
                    f"the index has grown to {used >> 20} MiB, past the {current >> 20} MiB this process can map")
            raise StoreFull(f"{what}: no address space left for more than {current >> 20} MiB (ulimit -v)",
                            path=path, index_full=True, address_space=True, hint=ADDRESS_SPACE_HINT) \
                if writing else StoreIOError(what, path=path, errno=errno.ENOMEM, poisoned=False,
                                             hint=ADDRESS_SPACE_HINT)
        RESIZES[0] += 1
        try:
            env.set_mapsize(size)
        except lmdb.Error as e:  # (py-lmdb closed the environment: no transaction of it can begin again)
            _LOST_MAPS[id(env)] = env
            raise _map_lost(path, e) from None
        finally:
            RESIZES[0] += 1


ADDRESS_SPACE_HINT = ("the process's address space is limited (ulimit -v): raise the limit, or open the store in "
                      "a process that has more")
_REMAP_LOCK = threading.Lock()
_MAP_SLACK = 4 << 20  # the pages another process may commit between a look at the file and the map
_LOST_MAPS: dict[int, lmdb.Environment] = {}  # id -> an environment py-lmdb closed when its new map failed


def _map_lost(path: str, e: lmdb.Error | None = None) -> StoreIOError:
    return StoreIOError("the index's map could not be resized" + (f": {e}" if e else "") + "; py-lmdb closed it",
                        path=path, errno=errno.ENOMEM, poisoned=True,
                        hint="close every handle of the store in this process and open it again (" +
                             ADDRESS_SPACE_HINT + ")")


def damaged(message: str, path: str | None, **where: Any) -> CorruptionError:
    """A CorruptionError of the index itself (``index=True``): the engine rebuilds the index
    rather than failing (SPEC.md §9: the index is derived)."""
    return CorruptionError(message, path=path, hint=INDEX_HINT, index=True, **where)


# LMDB's meta pages (pages 0 and 1; lmdb.h MDB_meta, 64-bit): after the 16-byte page header,
# magic, version, address, map size, two MDB_db records (the first's md_pad is the page size),
# the last page number used and the transaction id.
_MDB_MAGIC = 0xBEEFC0DE
_META_MAGIC = struct.Struct("<II")  # magic, version at page offset 16
_META_PSIZE = struct.Struct("<I")  # at page offset 40
_META_LAST = struct.Struct("<QQ")  # last_pg, txnid at page offset 136


def verify_lmdb(path: str) -> list[str]:
    """LMDB's offline structural verifier (pure Python: safe on any bytes): its problems."""
    try:
        return list(lmdb.verify.verify(path))
    except lmdb.verify.VerifyError as e:
        return [str(e)]


WALKS = 3  # walks of a live file (walk_live) before its writer's commits are blamed


def walk_live(path: str) -> list[str] | None:
    """``verify_lmdb`` of a file a live writer may commit to meanwhile: the verifier holds no
    reader slot, so a commit during its walk reuses pages the walk's meta page still reaches
    and the walk sees damage that is not there (a busy 30 MB index: 75 of 76 walks).  A walk
    that finds problems counts only if no commit passed during it (the newest meta page's
    txnid the same before and after); up to ``WALKS`` walks, then None: every one raced."""
    for _ in range(WALKS):
        before = _newest_meta(path)
        problems = verify_lmdb(path)
        if not problems or _newest_meta(path) == before:
            return problems
    return None


def _newest_meta(path: str) -> tuple[int, int] | None:
    """(txnid, last_pg) of data.mdb's newest valid meta page, or None."""
    found = _read_metas(path)
    return None if isinstance(found, str) else found[1][:2]


STAMP_FILE = "tierstore-checksum"  # beside data.mdb: its size and CRC-32C when a writer last closed it cleanly


def _file_crc(path: str) -> tuple[int, int]:
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            crc = rec.crc32c(chunk, crc)
            size += len(chunk)
    return size, crc


def stamp(path: str) -> None:
    """Record data.mdb's size and checksum after a clean close (``trusted`` then need not walk it).
    data.mdb is synced first (LMDB, opened with metasync=False, leaves its last meta page to the
    OS: a power cut after the close kept an older page beside a stamp of the newer one, and the
    sound index was judged changed at rest -- a cold review, 2026-12-04), the directory after."""
    data = os.path.join(path, "data.mdb")
    tmp = os.path.join(path, STAMP_FILE + ".tmp")
    try:
        fd = os.open(data, os.O_RDONLY | os.O_CLOEXEC)
        try:
            DEFAULT_IO.fsync(fd)
        finally:
            os.close(fd)
        size, crc = _file_crc(data)
        with open(tmp, "w") as f:
            f.write(f"{size} {crc:08x}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(path, STAMP_FILE))
        DEFAULT_IO.fsync_dir(path)
    except OSError:  # (a full disk: no stamp -- the next open walks the index instead of trusting it)
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def unstamp(path: str) -> None:
    """A writer is about to change data.mdb: the stamp no longer describes it -- durably, before
    the change (a stamp back after a power cut would vouch for a file changed since)."""
    try:
        os.unlink(os.path.join(path, STAMP_FILE))
    except FileNotFoundError:
        return
    with contextlib.suppress(OSError):
        DEFAULT_IO.fsync_dir(path)


def untrusted(path: str) -> str | None:
    """Why data.mdb at rest cannot be handed to liblmdb (which is not hardened against damaged
    files: a zeroed page can abort the process), or None.  Cheap when the file still matches
    the stamp its last clean close wrote (one CRC pass); otherwise LMDB's offline verifier
    walks it (after a crash, or damage at rest).  A file shorter than its meta page counts is
    judged by these too (an older tierstore's writer left such files: ``Index._cover_pages``)."""
    problem, short = _meta_problems(path)
    if problem is not None:
        return problem
    try:
        with open(os.path.join(path, STAMP_FILE)) as f:
            size_text, crc_text = f.read().split()
        expected = (int(size_text), int(crc_text, 16))
    except (OSError, ValueError):
        expected = None  # no stamp (a writer did not close it cleanly, or an older store): verify
    if expected is not None:
        if _file_crc(os.path.join(path, "data.mdb")) == expected:
            return None
        return "data.mdb changed at rest since its last clean close (its checksum differs from the stamp)"
    problems = verify_lmdb(path)
    return f"{problems[0]}" + (f" ({short})" if short else "") if problems else None


def check_file(path: str, *, waits: int = 0) -> str | None:
    """What is wrong with ``path``/data.mdb against its own meta pages, before LMDB maps it (a
    file shorter than its newest meta page counts makes liblmdb die of SIGBUS at a page past
    its end), or None.  Beside a live writer: that writer keeps the file as long as the count
    (``Index._cover_pages``) right after each commit, under its writer lock, so a short file
    is looked at again up to ``waits`` times 10 ms apart (a commit between the two); one still
    short is walked by LMDB's offline verifier (``walk_live``), which reads every page a tree
    reaches (a writer of an older tierstore left such files; they are sound when every
    reachable page is in them).  StoreLocked when every walk raced a commit: no answer yet."""
    for attempt in range(waits + 1):
        problem, short = _meta_problems(path)
        if problem is not None or short is None:
            return problem
        if attempt < waits:
            time.sleep(0.01)
    problems = walk_live(path)
    if problems is None:
        raise StoreLocked(f"{short}, and a writer committed during each of {WALKS} walks of it by LMDB's verifier",
                          path=path, busy_index=True,
                          hint="the writer is probably an older tierstore, which does not keep data.mdb covered: "
                               "try again when it is quieter, or upgrade it")
    return f"{short}, and {problems[0]}" if problems else None


def _read_metas(path: str) -> str | tuple[int, tuple[int, int, int]]:
    """data.mdb's (size, (txnid, last_pg, page size) of its newest valid meta page), or what
    makes it unusable (unreadable, no valid meta page)."""
    data_path = os.path.join(path, "data.mdb")
    try:
        with open(data_path, "rb") as f:
            head = f.read(8192)  # (the meta pages first, then the size: a commit between the two
            psize = _META_PSIZE.unpack_from(head, 40)[0] if len(head) >= 44 else 4096  # makes it longer)
            if 4096 < psize <= 32768:  # (page 1 of larger pages; LMDB 0.9 caps them at 32 KiB)
                f.seek(psize)
                head = head.ljust(psize, b"\0") + f.read(152)
            size = os.fstat(f.fileno()).st_size
    except OSError as e:
        return f"cannot read data.mdb: {e.strerror or e}"
    metas = []
    for off in sorted({0, 4096, psize}):
        if off + 152 > len(head):
            continue
        magic, version = _META_MAGIC.unpack_from(head, off + 16)
        psize = _META_PSIZE.unpack_from(head, off + 40)[0]
        last_pg, txnid = _META_LAST.unpack_from(head, off + 136)
        if magic == _MDB_MAGIC and version == 1 and psize in (4096, 8192, 16384, 32768) and off in (0, psize):
            metas.append((txnid, last_pg, psize))
    if not metas:
        return "no valid LMDB meta page"
    return size, max(metas)


def _meta_problems(path: str) -> tuple[str | None, str | None]:
    """(what makes data.mdb unusable -- unreadable, no valid meta page -- or None; why it is
    shorter than its newest meta page counts, ``(last_pg + 1) * page_size``, or None)."""
    found = _read_metas(path)
    if isinstance(found, str):
        return found, None
    size, (txnid, last_pg, psize) = found
    if size < (last_pg + 1) * psize:
        return None, f"data.mdb is {size} bytes; its meta page (txn {txnid}) counts {(last_pg + 1) * psize}"
    return None, None


_HEADER_CACHE: dict[bytes, "Location"] = {}  # index value -> its decoded Location
_HEADER_CACHE_BYTES = 8 << 20  # of index values; the decoded objects take ~5-7x that
_header_cache_used = 0


def _remember(value: bytes, loc: "Location") -> None:
    global _header_cache_used
    if _header_cache_used + len(value) > _HEADER_CACHE_BYTES:
        _HEADER_CACHE.clear()
        _header_cache_used = 0
    _HEADER_CACHE[value] = loc
    _header_cache_used += len(value)


def decode_location(value: bytes, namespace: bytes | None = None, key: bytes | None = None) -> Location:
    """Decode an index value; the embedded header is checksum-verified like one read from disk.

    A value decodes to the same Location every time, so decoded values are cached (by the
    whole value: exact, whichever store it came from).
    """
    loc = _HEADER_CACHE.get(value)
    if loc is None:
        where = {"namespace": namespace.decode("utf-8", "replace") if namespace else None, "key": key}
        if len(value) < _LOC.size:
            raise damaged("index entry truncated", None, **where)
        seg, off = _LOC.unpack_from(value)
        try:
            hdr = rec.decode_header(memoryview(value)[_LOC.size :], segment=seg, offset=off, **where)
        except CorruptionError as e:
            raise damaged(f"index entry damaged: {e.message}", None, segment=seg, offset=off, **where) from None
        if hdr.type != fmt.REC_PUT:
            raise damaged("index entry is not a PUT record", None, segment=seg, offset=off, **where)
        loc = Location(seg, off, hdr)
        _remember(value, loc)
    if namespace is not None and (loc.header.namespace != namespace or loc.header.key != key):
        raise damaged("index entry does not describe this key", None, segment=loc.segment, offset=loc.offset,
                      namespace=namespace.decode("utf-8", "replace"), key=key)
    return loc


MAP_SIZE = 32 << 30  # of address space reserved for an index's map (``_open_env``)
_MAP_ROUND = 1 << 20  # a map is resized in whole MiB
_ENVS: dict[str, list[Any]] = {}  # realpath -> [env, handles, write lock, writable, file, replaced, tables]
_ENVS_LOCK = threading.Lock()


def _open_env(path: str, map_size: int, writable: bool) -> lmdb.Environment:
    """``lmdb.open`` with ``map_size`` of address space reserved (virtual memory only: without
    writemap the file grows by what LMDB writes, never to the map's size).  A map grown later
    invalidates every read transaction of the process (py-lmdb's set_mapsize), so a large one
    keeps that rare; where the address space is limited (``ulimit -v``), 64 MiB, or the file
    and a little room (lmdb.MemoryError when even that cannot be mapped)."""
    try:  # (the last resort: the file as it is, and some room; LMDB raises a smaller map to its pages)
        least = os.stat(os.path.join(path, "data.mdb")).st_size + _MAP_SLACK
    except OSError:
        least = 1 << 20
    sizes = sorted({map_size, min(map_size, 64 << 20), min(map_size, least)}, reverse=True)
    for size in sizes:  # (64 MiB: what tierstore reserved before 32 GiB)
        try:
            return lmdb.open(path, map_size=size, subdir=True, readonly=not writable, metasync=False, sync=True,
                             max_dbs=8, max_readers=1024, lock=True, create=writable,
                             lib_version=fmt.LMDB_LIB_VERSION if writable else None)
        except lmdb.MemoryError:
            if size == sizes[-1]:
                raise
    raise AssertionError("unreachable")


FORK_CLOSE_S = 0.5  # how long a forked child waits for its copies of the parent's environments to close
_FORKED_BUSY: set[str] = set()  # (in a forked child) stores whose parent environment would not close


def _forked() -> None:
    """In the child of a ``fork()``: an LMDB environment is not usable across fork (LMDB's
    documentation) and py-lmdb refuses a second open of one still open in the process, so the
    child closes its copies of the parent's (which releases nothing of the parent's: LMDB's
    fcntl locks are not inherited and a reader slot is cleared only by the process that owns
    it) and opens its own when a handle of its own needs one.  py-lmdb's close waits for the
    calls other threads had under way in that environment, and those threads do not exist in
    the child: a fork while one read or committed hung the child for good.  So the copies are
    closed in a thread the child does not wait for past ``FORK_CLOSE_S``; a store whose copy
    stayed open cannot be opened in this child (``Index.open`` says so)."""
    global _ENVS_LOCK
    envs = [(real, env) for real, ent in _ENVS.items() for env in (*ent[5], ent[0])]
    _ENVS.clear()
    _ENVS_LOCK = threading.Lock()
    RESIZES[0] = 0  # (a resize under way in another thread of the parent never ends here)
    if not envs:
        return
    _FORKED_BUSY.update(real for real, _ in envs)
    closed = threading.Event()

    def close() -> None:
        left = collections.Counter(real for real, _ in envs)
        for real, env in envs:
            with contextlib.suppress(lmdb.Error):  # (a closed copy needs nothing more)
                env.close()
            left[real] -= 1
            if not left[real]:
                _FORKED_BUSY.discard(real)
        closed.set()

    threading.Thread(target=close, name="tierstore-forked-close", daemon=True).start()
    closed.wait(FORK_CLOSE_S)


_HELD_FOR_FORK: dict[int, list[threading.Lock]] = {}  # forking thread -> the locks it holds over its fork


def _before_fork() -> None:
    """Before a ``fork()``: wait (up to 1 s per store) for this process's index commits under
    way to end, and hold their locks over the fork, so the child's copies close (``_forked``)
    unless a read is mid-call in another thread."""
    held = _HELD_FOR_FORK.setdefault(threading.get_ident(), [])
    for ent in list(_ENVS.values()):
        if ent[2].acquire(timeout=1.0):  # (a timeout, not a hang: the forking thread may be the one that holds it)
            held.append(ent[2])


def _after_fork_in_parent() -> None:
    for lock in _HELD_FOR_FORK.pop(threading.get_ident(), []):
        lock.release()


def _after_fork_in_child() -> None:
    _after_fork_in_parent()  # (the child's copies of the locks: its own, free)
    _HELD_FOR_FORK.clear()  # (other threads' of the parent: they do not exist here)
    _forked()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)


class Tables(NamedTuple):
    """An LMDB environment and its tables: a transaction of ``env`` reads only these handles."""

    env: lmdb.Environment
    objects: Any
    meta: Any
    segments: Any
    refs: Any  # None: a 1.0 index opened read-only (no session references)

    @classmethod
    def of(cls, env: lmdb.Environment, writable: bool) -> "Tables":
        """The tables of ``env``, once per environment (``Index.open`` shares them: handles stay
        valid for the environment's life).  A writable environment's are opened (or created)
        in a write transaction begun here: py-lmdb's open_db without one begins it holding the
        GIL, so it waited on the writer lock while a thread of this process that held it
        waited for the GIL (a deadlock: a read-only handle opened beside a writing one)."""
        if not writable:  # (a read-only environment: open_db reads them in a read transaction)
            try:  # session references (format 1.1); a 1.0 index opened read-only has none
                refs: Any = env.open_db(b"refs", create=False)
            except lmdb.NotFoundError:
                refs = None
            return cls(env, env.open_db(b"objects", create=False), env.open_db(b"meta", create=False),
                       env.open_db(b"segments", create=False), refs)
        with env.begin(write=True) as txn:
            return cls(env, *(env.open_db(name, txn=txn) for name in (b"objects", b"meta", b"segments", b"refs")))


class Index:
    """Handle on the shared LMDB environment of one store.

    ``tables`` is swapped whole (one attribute) when a read-only index follows a rebuilt file:
    each read takes it once and uses that environment's transaction with that environment's
    table handles, whatever another thread swaps meanwhile."""

    def __init__(self, path: str, tables: Tables, lock: threading.Lock, writable: bool,
                 file: tuple[int, int] | None = None, map_size: int = MAP_SIZE) -> None:
        self.path = path
        self.writable = writable
        self._write_lock = lock
        self.tables = tables
        self.closed = False
        self._readers_checked = time.monotonic()  # (open checks them: Index.open)
        self._file = file  # the data file this environment maps (a rebuild replaces it)
        self._file_checked = time.monotonic()
        self._covered = 0  # data.mdb is known to be at least this long (_cover_pages)
        self._map_size = map_size  # the map asked for: what a file grown past this process's map is mapped at

    # the current environment's handles (the write side: a writable index is never swapped)
    env = property(lambda self: self.tables.env)
    objects = property(lambda self: self.tables.objects)
    meta = property(lambda self: self.tables.meta)
    segments = property(lambda self: self.tables.segments)
    refs = property(lambda self: self.tables.refs)

    # -- lifecycle ------------------------------------------------------------------------

    @classmethod
    def exists(cls, path: str) -> bool:
        return os.path.exists(os.path.join(path, "data.mdb"))

    @classmethod
    def open(cls, path: str, *, writable: bool, map_size: int = MAP_SIZE, at_rest: bool = False) -> "Index":
        """Open (or create, when writable) the environment at ``path``, shared in-process.
        ``at_rest``: no other process writes it, so it is checked (``untrusted``) before liblmdb
        maps it; otherwise only its size is (a live writer checked it when it opened)."""
        real = os.path.realpath(path)
        checked = False
        with _ENVS_LOCK:
            mapped = real in _ENVS
        if not mapped and cls.exists(real):  # (checked outside the lock: a walk may take seconds)
            problem = untrusted(real) if at_rest else check_file(real, waits=5)
            if problem is not None:
                raise damaged(f"index file damaged: {problem}", real)
            checked = True
        with _ENVS_LOCK:
            ent = _ENVS.get(real)
            if ent is None:
                if real in _FORKED_BUSY:
                    raise StoreLocked("this process was forked while another thread of its parent was inside the "
                                      "store's index; that copy of it cannot be closed here, so the store cannot "
                                      "be opened in this process", path=real,
                                      hint="start worker processes with multiprocessing's 'spawn' or 'forkserver' "
                                           "method, or fork before the parent opens the store")
                if writable:
                    os.makedirs(real, exist_ok=True)
                if cls.exists(real):
                    if not checked:  # (created, or another thread's environment closed since)
                        problem = untrusted(real) if at_rest else check_file(real, waits=5)
                        if problem is not None:
                            raise damaged(f"index file damaged: {problem}", real)
                    if writable:
                        unstamp(real)
                try:
                    env = _open_env(real, map_size, writable)
                except lmdb.MemoryError as e:  # (the file is larger than the address space left: not damage)
                    raise StoreIOError(f"cannot map the index: {e}", path=real, errno=errno.ENOMEM, poisoned=False,
                                       hint=ADDRESS_SPACE_HINT) from None
                except lmdb.InvalidError as e:
                    raise damaged(f"index is not a valid LMDB environment: {e}", real) from None
                except lmdb.VersionMismatchError as e:
                    # tierstore always writes LMDB data format v1 (lib_version=0): another version
                    # means a damaged meta page or a foreign file; the index is derived, so rebuild
                    raise damaged(f"index is not LMDB data format v1: {e}", real) from None
                except lmdb.Error as e:
                    raise damaged(f"cannot open index: {e}", real) from None
                try:
                    tables = Tables.of(env, writable)
                except lmdb.Error as e:
                    env.close()
                    raise damaged(f"index is missing its tables: {e}", real) from None
                # [env, handles, write lock, writable, the data file it maps, environments replaced, tables]
                ent = _ENVS[real] = [env, 0, threading.Lock(), writable, _file_id(real), [], tables]
            elif writable and not ent[3]:
                raise StoreLocked("the store is open read-only in this process: a writable handle cannot open "
                                  "beside it", path=real,
                                  hint="close this process's read-only handles of the store first, or open the "
                                       "writable handle before them")
            ent[1] += 1
            idx = cls(real, ent[6], ent[2], writable, ent[4], map_size)
        if writable:
            idx.env.reader_check()
            with idx._write_lock:  # (no resize of the map while its write transaction is open)
                idx._cover_pages()  # (a file an older tierstore's writer left short, checked above)
        return idx

    def _cover_pages(self) -> None:
        """Keep data.mdb at least as long as the pages its newest meta page counts
        (``last_pgno``): LMDB counts there the pages a transaction took and freed again before
        its commit, and never writes them, and a file shorter than the count looks cut to the
        check other processes make before they map it (``check_file``; a new user's store,
        after a drop_session of 100 objects, was refused by every open).  Done inside a write
        transaction that changes nothing: LMDB's writer lock keeps every other process's writer
        from committing or writing a page meanwhile, so the size read is the size extended
        (never shrinking it); it is ended by a commit, which writes nothing for it (py-lmdb 3.0's
        abort waits for an Environment.copy in another thread that waits for the writer lock:
        a deadlock).  The file is extended, not written (``ftruncate``: the bytes added are a
        hole that reads as zeros and takes no disk space, so a full disk does not stop it, and
        no emulation writes bytes LMDB may own).  Best effort: a file left short is walked by
        the other processes' checks instead (slower, as safe)."""
        try:
            want = (self.env.info()["last_pgno"] + 1) * self.env.stat()["psize"]
            if want <= self._covered:
                return
            if os.stat(os.path.join(self.path, "data.mdb")).st_size >= want:
                self._covered = want  # (LMDB's own writes covered it, as they mostly do: no one shrinks it)
                return
            txn = self.env.begin(write=True)
            try:
                want = (self.env.info()["last_pgno"] + 1) * self.env.stat()["psize"]  # (now no commit can pass it)
                fd = os.open(os.path.join(self.path, "data.mdb"), os.O_WRONLY)
                try:
                    if os.fstat(fd).st_size < want:
                        os.ftruncate(fd, want)
                finally:
                    os.close(fd)
                self._covered = want
            finally:
                txn.commit()
        except (OSError, lmdb.Error):
            pass

    @staticmethod
    def _release(real: str) -> None:
        with _ENVS_LOCK:
            ent = _ENVS[real]
            ent[1] -= 1
            if ent[1] == 0:
                for env in (*ent[5], ent[0]):
                    env.close()
                    _LOST_MAPS.pop(id(env), None)
                del _ENVS[real]

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._release(self.path)

    # -- reading ----------------------------------------------------------------------------

    def _follow_rebuild(self) -> None:
        """A read-only index whose file a recovery (or a writer that opened alone) replaced with a
        rebuilt one (SPEC.md §9: the rebuild is renamed over ``index/``) maps the old, unlinked
        file, which nobody writes any more: switch to the new file.  Looked at at most every
        ``REBUILD_CHECK_S``.  The old environment stays open (another thread may be reading
        it) until the last handle of the store in this process closes."""
        now = time.monotonic()
        if now - self._file_checked < REBUILD_CHECK_S:
            return
        self._file_checked = now
        current = _file_id(self.path)
        if current is None or current == self._file:  # (None: between the rename and its replacement)
            return
        with _ENVS_LOCK:
            ent = _ENVS.get(self.path)
            if ent is None:
                return
            followed = ent[4] == current  # (another handle opened the new file already)
        if not followed:
            try:  # (outside the lock: a short file is walked)
                if check_file(self.path) is not None:
                    return  # (not a usable file yet: a later look)
            except StoreLocked:
                return
        with _ENVS_LOCK:
            ent = _ENVS.get(self.path)
            if ent is None:
                return
            if ent[4] != current:  # the first handle to notice opens the new file for all of them
                if _file_id(self.path) != current:
                    return  # (replaced again since the check: a later look)
                try:
                    env = _open_env(self.path, MAP_SIZE, False)
                except lmdb.Error:
                    return
                try:
                    tables = Tables.of(env, False)
                except lmdb.Error:
                    env.close()
                    return
                ent[5].append(ent[0])
                ent[0], ent[4], ent[6] = env, current, tables
            tables = ent[6]
        self.tables, self._file = tables, current  # (one assignment: readers take one or the other)

    def _begin(self) -> tuple[lmdb.Transaction, Tables]:
        """A read transaction and the tables it reads (of one environment)."""
        if not self.writable:
            self._follow_rebuild()
        t = self.tables
        try:
            return t.env.begin(buffers=False), t
        except lmdb.MapResizedError:
            pass
        except lmdb.Error as e:
            if id(t.env) in _LOST_MAPS:  # (not damage: this process could not map it)
                raise _map_lost(self.path) from None
            raise _unreadable(self.path, e) from None
        with self._write_lock:  # another process's commits grew the file past this map: map more of it
            while True:  # (first: another thread of this process may have meanwhile)
                try:
                    return t.env.begin(buffers=False), t
                except lmdb.MapResizedError:
                    _remap(t.env, self.path, self._map_size, growing=False, writing=False)
                except lmdb.Error as e:
                    if id(t.env) in _LOST_MAPS:
                        raise _map_lost(self.path) from None
                    raise _unreadable(self.path, e) from None

    def read(self) -> "ReadView":
        return ReadView(self, *self._begin())

    def lookup(self, namespace: bytes, key: bytes, pending: Op | None = None) -> Location | None:
        """One key's location in a fresh snapshot (the get path: one transaction, one get).
        ``pending``: the key's newest record not yet applied when the caller looked (a
        memtable entry): its location (None for a DELETE) unless this snapshot applied it."""
        txn, t = self._begin()
        try:
            if pending is not None:
                v = txn.get(b"applied", db=t.meta)
                if v is None or len(v) != _APPLIED.size:
                    raise damaged("index has no valid applied position", self.path)
                if pending.lsn > _APPLIED.unpack(v)[2]:
                    return pending.location
            v = txn.get(index_key(namespace, key), db=t.objects)
        except lmdb.MapResizedError:
            raise
        except lmdb.Error as e:
            raise _unreadable(self.path, e) from None
        finally:
            with contextlib.suppress(lmdb.Error):  # (a transaction a map resize invalidated: raised above)
                txn.abort()
        return None if v is None else decode_location(v, namespace, key)

    @survives_resizes
    def get_meta(self, name: bytes) -> bytes | None:
        with self.read() as view, _reading(self.path):
            return view.txn.get(name, db=view.t.meta)

    @survives_resizes
    def applied(self) -> Applied:
        with self.read() as view:
            return view.applied()

    @survives_resizes
    def applied_synced(self) -> bool:
        with self.read() as view:
            return view.applied_synced()

    def store_uuid(self) -> bytes | None:
        return self.get_meta(b"store_uuid")

    def format_version(self) -> tuple[int, int] | None:
        v = self.get_meta(b"format")
        return _FORMAT.unpack(v) if v is not None else None

    @survives_resizes
    def segment_stats(self) -> dict[int, tuple[int, int]]:
        """segment id -> (dead bytes, state)."""
        with self.read() as view, _reading(self.path):
            return {struct.unpack(">Q", k)[0]: _SEGSTAT.unpack(v) for k, v in view.txn.cursor(db=view.t.segments)}

    @survives_resizes
    def file_bytes(self) -> tuple[int, int]:
        """(data.mdb's size, the bytes its tables' pages take): LMDB never shrinks its file, and
        pages freed while a reader -- a process killed mid-read holds its slot until a writer
        checks the table -- still needed them are not reused, so the first may be far larger."""
        with _reading(self.path), self.read() as view:
            t = view.t
            main = t.env.stat()  # (the table of table names)
            pages = 2 + main["branch_pages"] + main["leaf_pages"] + main["overflow_pages"]  # + the meta pages
            for db in (t.objects, t.meta, t.segments, t.refs):
                if db is not None:
                    st = view.txn.stat(db)
                    pages += st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]
        psize = main["psize"]
        return os.path.getsize(os.path.join(self.path, "data.mdb")), pages * psize

    @survives_resizes
    def count(self) -> int:
        """Objects indexed (session references not counted)."""
        with self.read() as view, _reading(self.path):
            return view.txn.stat(view.t.objects)["entries"] - view.ref_count()

    @survives_resizes
    def ref_count(self) -> int:
        """Session references indexed."""
        with self.read() as view, _reading(self.path):
            return view.ref_count()

    # -- writing ----------------------------------------------------------------------------

    def _write(self, fn: Any, *, durable: bool = False) -> Any:
        """Run ``fn(txn)`` in one write transaction, growing the map and replaying on MapFullError.

        The environment runs with metasync=False, so a commit is atomic but a power loss may
        undo the last one (replay from the log covers it); ``durable`` also syncs the meta page.
        """
        with self._write_lock:
            now = time.monotonic()
            if now - self._readers_checked >= READER_CHECK_S:
                # slots of reader processes that died (killed mid-read) pin the pages their snapshot
                # used: freed pages are not reused while they stay, and the file grows for good
                self._readers_checked = now
                self.env.reader_check()
            while True:
                try:
                    txn = self.env.begin(write=True)
                except lmdb.MapResizedError:  # another process's commits grew the file past this map
                    _remap(self.env, self.path, self._map_size, growing=False, writing=True)
                    continue
                except lmdb.Error as e:
                    if id(self.env) in _LOST_MAPS:
                        raise _map_lost(self.path) from None
                    raise self._failed("index write failed", e) from None
                try:
                    result = fn(txn)
                    txn.commit()
                    self._cover_pages()
                    break
                except lmdb.MapFullError:
                    txn.abort()
                    _remap(self.env, self.path, 0, growing=True, writing=True)
                except lmdb.Error as e:
                    txn.abort()
                    raise self._failed("index write failed", e) from None
                except BaseException:
                    txn.abort()
                    raise
            if durable:
                try:
                    self.env.sync(True)
                except lmdb.Error as e:
                    raise self._failed("index sync failed", e, poisoned=False) from None
            return result

    def _failed(self, what: str, e: lmdb.Error, **attrs: Any) -> TierstoreError:
        """The error of a failed index write: StoreFull when the disk is full -- LMDB reports a
        short write as EIO, so the free space is looked at -- else StoreIOError."""
        try:
            st = os.statvfs(self.path)  # (root may write into the blocks kept for it)
            full = (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize < FULL_BELOW
        except OSError:
            full = False
        # (a short write is EIO: an lmdb.Error of that text, not a panic or a corrupted file's error)
        # (strerror's text in the process's locale, as LMDB's message has it)
        if isinstance(e, lmdb.DiskError) or full and type(e) is lmdb.Error and os.strerror(errno.EIO) in str(e):
            return StoreFull(f"{what}: {e}", path=self.path, index_full=True,
                             hint="delete objects and run compact(), or free space on the disk that holds the "
                                  "store (the index needs some to commit, and to open writable); "
                                  "tierstore.open(path, readonly=True) reads every object meanwhile")
        return StoreIOError(f"{what}: {e}", path=self.path, **attrs)

    def initialise(self, store_uuid: bytes) -> None:
        def fn(txn: lmdb.Transaction) -> None:
            txn.put(b"store_uuid", store_uuid, db=self.meta)
            txn.put(b"format", _FORMAT.pack(fmt.FORMAT_MAJOR, fmt.FORMAT_MINOR), db=self.meta)
            txn.put(b"lmdb_lib_version", str(fmt.LMDB_LIB_VERSION).encode(), db=self.meta)
            txn.put(b"applied", _APPLIED.pack(0, 0, 0, 0), db=self.meta)
        self._write(fn, durable=True)

    def apply(self, ops: Sequence[Op], applied: Applied, *, durable: bool = False, synced: bool = False) -> None:
        """Apply log records in LSN order and record the new applied position, atomically.

        ``synced``: the record at ``applied`` was synced in the log before this commit (by this
        writer, durability "sync" or "group"); recorded as meta ``synced`` = its LSN, else 0, so
        that an index found ahead of the log tells damage from a power cut that took records of
        durability "none" (SPEC.md §9).

        Dead-byte accounting per segment (for compaction) is updated in the same transaction:
        a PUT record becomes dead when a later PUT or DELETE of its key is applied; a DELETE
        record is dead from the start (compaction drops it, or carries it forward while an
        older segment may still hold a PUT it hides).
        """
        def fn(txn: lmdb.Transaction) -> None:
            # several writer processes apply the same log (SPEC.md §7.8): what another one applied
            # already is skipped, and the applied position never goes back
            cur = txn.get(b"applied", db=self.meta)
            done = _APPLIED.unpack(cur)[2] if cur is not None else 0
            if applied.lsn <= done:
                return
            deltas: dict[int, int] = {}
            for op in ops:
                if op.lsn <= done:
                    continue
                ik = index_key(op.namespace, op.key)
                old = txn.get(ik, db=self.objects)
                if old is not None:
                    oseg = _LOC.unpack_from(old)[0]
                    deltas[oseg] = deltas.get(oseg, 0) + _record_len_of(old)
                if op.location is not None:
                    txn.put(ik, encode_location(op.location), db=self.objects)
                else:
                    deltas[op.segment] = deltas.get(op.segment, 0) + op.record_len
                    if old is not None:
                        txn.delete(ik, db=self.objects)
                if op.namespace == fmt.REF_NAMESPACE:
                    self._apply_ref(txn, op)
            self._add_dead(txn, deltas)
            txn.put(b"applied", _APPLIED.pack(applied.segment, applied.offset, applied.lsn, applied.end), db=self.meta)
            txn.put(b"synced", _SYNCED.pack(applied.lsn if synced else 0), db=self.meta)
        self._write(fn, durable=durable)

    def _apply_ref(self, txn: lmdb.Transaction, op: Op) -> None:
        """Keep the derived ``refs`` table (target -> sessions) in step with ref records."""
        parsed = rec.parse_ref_key(op.key)
        if parsed is None:
            raise CorruptionError("bad ref key in the log", segment=op.segment, offset=op.offset)
        ns, session, digest = parsed
        rk = bytes((len(ns),)) + ns + digest + session
        if op.location is not None:
            txn.put(rk, b"", db=self.refs)
        else:
            txn.delete(rk, db=self.refs)

    def _add_dead(self, txn: lmdb.Transaction, deltas: dict[int, int]) -> None:
        for seg, d in deltas.items():
            k = struct.pack(">Q", seg)
            v = txn.get(k, db=self.segments)
            dead, state = _SEGSTAT.unpack(v) if v is not None else (0, SEG_LIVE)
            txn.put(k, _SEGSTAT.pack(dead + d, state), db=self.segments)

    def mark_dead(self, segs: Sequence[int]) -> None:
        """Compaction's commit point: these segments are superseded and may be deleted; durable."""
        def fn(txn: lmdb.Transaction) -> None:
            for seg in segs:
                txn.put(struct.pack(">Q", seg), _SEGSTAT.pack(0, SEG_DEAD), db=self.segments)
        self._write(fn, durable=True)

    def forget_segments(self, segs: Sequence[int]) -> None:
        def fn(txn: lmdb.Transaction) -> None:
            for seg in segs:
                txn.delete(struct.pack(">Q", seg), db=self.segments)
        self._write(fn)

    def sync(self) -> None:
        self.env.sync(True)


def _checked_flags(value: bytes, namespace: bytes, key: bytes, path: str) -> int:
    """The flags of an index entry's record header, after checking that the header's checksum holds
    and that it names this namespace and key (SPEC.md §4.1 offsets)."""
    cached = _HEADER_CACHE.get(value)
    if cached is not None and cached.header.namespace == namespace and cached.header.key == key:
        return cached.header.flags
    p = _LOC.size
    ok = len(value) >= p + fmt.RECORD_HEADER_SIZE
    if ok:
        magic, crc, _type, flags, header_len = struct.unpack_from("<4sIHHI", value, p)
        ns_len, key_len = value[p + 36], struct.unpack_from("<H", value, p + 38)[0]
        ok = (magic == fmt.RECORD_MAGIC and len(value) == p + header_len
              and rec.crc32c(memoryview(value)[p + 8 :]) == crc
              and value[p + 48 : p + 48 + ns_len] == namespace
              and value[p + 48 + ns_len : p + 48 + ns_len + key_len] == key)
    if not ok:
        raise damaged("index entry does not match its key (damaged)", path,
                      namespace=namespace.decode("utf-8", "replace"), key=key)
    return flags


def _record_len_of(value: bytes) -> int:
    # record_len sits at offset 24 of the fixed header, after the 16-byte location prefix
    return struct.unpack_from("<Q", value, _LOC.size + 24)[0]


def _header_len_of(value: bytes) -> int:
    # header_len sits at offset 12 of the fixed header
    return struct.unpack_from("<I", value, _LOC.size + 12)[0]


class ReadView:
    """A consistent snapshot of the index (one LMDB read transaction).  Use as a context manager."""

    def __init__(self, index: Index, txn: lmdb.Transaction, tables: Tables) -> None:
        self.index = index
        self.txn = txn
        self.t = tables  # the tables of the transaction's environment

    def ref_count(self) -> int:
        """Session references in this snapshot."""
        return 0 if self.t.refs is None else self.txn.stat(self.t.refs)["entries"]

    def __enter__(self) -> "ReadView":
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.txn.abort()
        except lmdb.Error as e:  # (invalidated by a map resize: the read's own error says it)
            if exc[1] is None:
                raise _unreadable(self.index.path, e) from None

    def applied(self) -> Applied:
        with _reading(self.index.path):
            v = self.txn.get(b"applied", db=self.t.meta)
        if v is None or len(v) != _APPLIED.size:
            raise damaged("index has no valid applied position", self.index.path)
        return Applied(*_APPLIED.unpack(v))

    def applied_synced(self) -> bool:
        """Whether the last commit said the record at the applied position was synced in the log
        before it was applied (``Index.apply(synced=True)``): that record then missing from the
        log is damage to the log, not a record of durability "none" lost in a power cut.  False
        when unknown (an index of an older version, a rebuild, a record of another writer)."""
        with _reading(self.index.path):
            v = self.txn.get(b"synced", db=self.t.meta)
        return v is not None and len(v) == _SYNCED.size and _SYNCED.unpack(v)[0] == self.applied().lsn != 0

    def prefix_run(self, namespace: bytes, keys: Iterable[bytes], pending: dict[bytes, bool]) -> int:
        """How many leading ``keys`` exist in ``namespace``; ``pending`` (key -> exists) overrides
        the snapshot for records not yet applied.  One LMDB cursor seek per key, no decoding."""
        prefix = bytes((len(namespace),)) + namespace
        n = 0
        with _reading(self.index.path), self.txn.cursor(db=self.t.objects) as cur:
            seek = cur.set_key  # (a cursor's seek copies no value: ~1.7x txn.get for 1,000 keys)
            for k in keys:
                live = pending.get(k) if pending else None
                if not (seek(prefix + k) if live is None else live):
                    break
                n += 1
        return n

    def get_many(self, namespace: bytes, keys: Sequence[bytes], pending: dict[bytes, Any]) -> list[Location | None]:
        """The locations of ``keys`` in this snapshot (None: absent); ``pending`` (key ->
        Location or None) overrides it for records not yet applied.  One LMDB get per key."""
        prefix = bytes((len(namespace),)) + namespace
        get, db, cached = self.txn.get, self.t.objects, _HEADER_CACHE.get
        out: list[Location | None] = []
        with _reading(self.index.path):
            for k in keys:
                if pending and k in pending:
                    out.append(pending[k])
                    continue
                v = get(prefix + k, db=db)
                if v is None:
                    out.append(None)
                    continue
                loc = cached(v)  # (decode_location's own first step, inline: ~0.15 us a key)
                if loc is None or loc.header.key != k or loc.header.namespace != namespace:
                    loc = decode_location(v, namespace, k)
                out.append(loc)
        return out

    def contains_many(self, namespace: bytes, keys: Sequence[bytes], pending: dict[bytes, bool]) -> list[bool]:
        """Whether each of ``keys`` exists (``pending`` as in ``prefix_run``), without decoding."""
        prefix = bytes((len(namespace),)) + namespace
        with _reading(self.index.path), self.txn.cursor(db=self.t.objects) as cur:
            seek = cur.set_key
            if not pending:
                return [seek(prefix + k) for k in keys]
            return [pending[k] if k in pending else seek(prefix + k) for k in keys]

    def contains(self, namespace: bytes, key: bytes) -> bool:
        with _reading(self.index.path):
            return self.txn.get(index_key(namespace, key), db=self.t.objects) is not None

    def get(self, namespace: bytes, key: bytes) -> Location | None:
        with _reading(self.index.path):
            v = self.txn.get(index_key(namespace, key), db=self.t.objects)
        return None if v is None else decode_location(v, namespace, key)

    def keys(self, namespace: bytes, prefix: bytes = b"", *, after: bytes | None = None,
             limit: int | None = None) -> list[tuple[bytes, int]]:
        """(key, flags) of every object in ``namespace`` (whose key starts with ``prefix``; past
        ``after``; the first ``limit``), in key order.  Each entry's header checksum and its
        namespace and key are checked (without decoding the metadata): a damaged entry is
        index damage, never a wrong listing."""
        strip = len(index_key(namespace, b""))
        prefix = index_key(namespace, prefix)
        start = prefix if after is None else max(prefix, index_key(namespace, after) + b"\0")
        out: list[tuple[bytes, int]] = []
        if limit == 0:
            return out
        with _reading(self.index.path):
            cur = self.txn.cursor(db=self.t.objects)
            if not cur.set_range(start):
                return out
            for k, v in cur:
                if not k.startswith(prefix):
                    break
                key = k[strip:]
                out.append((key, _checked_flags(v, namespace, key, self.index.path)))
                if len(out) == limit:
                    break
        return out

    def sessions(self, namespace: bytes) -> list[bytes]:
        """The sessions holding at least one reference in ``namespace`` (the anchor of puts
        without a session left out), in order: one cursor step per session."""
        base = index_key(fmt.REF_NAMESPACE, rec.ref_prefix(namespace))
        out = []
        with _reading(self.index.path):
            cur = self.txn.cursor(db=self.t.objects)
            ok = cur.set_range(base)
            while ok:
                k = cur.key()
                parsed = rec.parse_ref_key(k[len(index_key(fmt.REF_NAMESPACE, b"")):]) if k.startswith(base) else None
                if parsed is None or parsed[0] != namespace:
                    break
                session = parsed[1]
                if session != fmt.ANCHOR_SESSION:
                    out.append(session)
                # jump past this session's references: their keys end in a fixed-length key hash
                ok = cur.set_range(index_key(fmt.REF_NAMESPACE, rec.ref_prefix(namespace, session))
                                   + b"\xff" * (fmt.REF_KEY_HASH_BYTES + 1))
        return out

    def _refs_under(self, prefix: bytes) -> list[bytes]:
        """The keys of the derived refs table (``ns_len ns key_hash session``) under ``prefix``."""
        out: list[bytes] = []
        if self.t.refs is None:
            return out
        with _reading(self.index.path):
            cur = self.txn.cursor(db=self.t.refs)
            if cur.set_range(prefix):
                for k in cur.iternext(keys=True, values=False):
                    if not k.startswith(prefix):
                        break
                    out.append(k)
        return out

    def references(self, namespace: bytes) -> dict[bytes, set[bytes]]:
        """key hash -> the sessions referencing it, of every referenced object of ``namespace``
        (one pass over the derived refs table)."""
        out: dict[bytes, set[bytes]] = {}
        start = len(namespace) + 1
        cut = start + fmt.REF_KEY_HASH_BYTES
        for k in self._refs_under(bytes((len(namespace),)) + namespace):
            out.setdefault(k[start:cut], set()).add(k[cut:])
        return out

    def sessions_of(self, namespace: bytes, key: bytes) -> list[bytes]:
        """The sessions holding a reference on (namespace, key), from the derived refs table."""
        prefix = bytes((len(namespace),)) + namespace + rec.ref_target_hash(key)
        return [k[len(prefix) :] for k in self._refs_under(prefix)]

    def session_refs(self, namespace: bytes, session: bytes) -> list[tuple[bytes, bytes]]:
        """(ref key, target key) of every reference ``session`` holds in ``namespace``."""
        out = []
        for rk, _flags in self.keys(fmt.REF_NAMESPACE, prefix=rec.ref_prefix(namespace, session)):
            loc = self.get(fmt.REF_NAMESPACE, rk)
            if loc is not None:
                out.append((rk, loc.header.meta["key"]))
        return out

    def namespaces(self) -> list[bytes]:
        out = []
        with _reading(self.index.path):
            cur = self.txn.cursor(db=self.t.objects)
            ok = cur.first()
            while ok:
                k = cur.key()
                ns = k[1 : 1 + k[0]]
                if not ns.startswith(b"\x00"):  # reserved for the engine (SPEC.md §5.4)
                    out.append(ns)
                # jump past this namespace: next key with a greater (len, ns) prefix
                ok = cur.set_range(bytes((k[0],)) + ns + b"\xff" * (fmt.KEY_MAX_BYTES + 1))
        return out

    def kept_bytes(self) -> dict[int, int]:
        """segment id -> what copying its live PUT records forward writes (every namespace,
        reserved ones too): each record (aligned to 8) and its header's copy in a HEADERS record,
        read from each entry's lengths without decoding its header."""
        out: dict[int, int] = {}
        copy = fmt.HEADER_COPY.size
        with _reading(self.index.path):
            for v in self.txn.cursor(db=self.t.objects).iternext(keys=False, values=True):
                seg = _LOC.unpack_from(v)[0]
                n = ((_record_len_of(v) + 7) & ~7) + _header_len_of(v) + copy
                out[seg] = out.get(seg, 0) + n
        return out

    def items(self) -> list[tuple[bytes, bytes, Location]]:
        out = []
        with _reading(self.index.path):
            for k, v in self.txn.cursor(db=self.t.objects):
                ns, key = k[1 : 1 + k[0]], k[1 + k[0] :]
                out.append((ns, key, decode_location(v, ns, key)))
        return out
