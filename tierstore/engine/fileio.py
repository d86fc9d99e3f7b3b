"""The one I/O layer: every file system call the engine makes goes through a ``FileIO``.

``PosixIO`` is the production implementation (thin wrappers over ``os``).  Tests substitute
a recording or fault-injecting implementation with the same methods to simulate power loss
and I/O errors (LMDB does its own I/O inside C and is not routed here).

This module owns short-write/short-read loops and the iovec batching limit; it never
interprets file contents.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import platform
import sys
from collections.abc import Sequence
from typing import Any

from ..errors import StoreFull, StoreIOError
from .threads import submit

EINTR_RETRIES = 100  # consecutive EINTRs tolerated by one transfer before it fails
PARALLEL_MIN = 8 << 20  # transfers at least this large are split across the I/O threads
PARALLEL_CHUNK = 4 << 20
PAGE = 4096
O_DIRECT = getattr(os, "O_DIRECT", 0)


class DirectIO:
    """Whether O_DIRECT works here; switched off at the first EINVAL/EOPNOTSUPP (tmpfs, some
    network and FUSE file systems), so callers fall back to buffered I/O."""

    def __init__(self) -> None:
        self.direct = bool(O_DIRECT)
        self.read_min = 8 << 20  # the smallest cold read that goes O_DIRECT

    @staticmethod
    def unsupported(e: OSError) -> bool:
        return e.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP)

    def open_direct(self, io: "PosixIO", path: str, flags: int) -> int:
        """An O_DIRECT fd of ``path``, or -1 when direct I/O is not available."""
        if not self.direct:
            return -1
        try:
            return io.open(path, flags | O_DIRECT)
        except OSError as e:
            if self.unsupported(e):
                self.direct = False
                return -1
            raise

IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
_MAX_RW = 0x7FFFF000  # Linux transfers at most this many bytes per read/write call


class PosixIO:
    """Production file I/O: direct calls into the OS."""

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        return os.open(path, flags | os.O_CLOEXEC, mode)

    def close(self, fd: int) -> None:
        os.close(fd)

    def pwritev(self, fd: int, bufs: Sequence[memoryview | bytes], offset: int) -> int:
        return os.pwritev(fd, bufs, offset)

    def preadv(self, fd: int, bufs: Sequence[memoryview], offset: int, flags: int = 0) -> int:
        return os.preadv(fd, bufs, offset, flags) if flags else os.preadv(fd, bufs, offset)

    def pread(self, fd: int, n: int, offset: int) -> bytes:
        return os.pread(fd, n, offset)

    def fdatasync(self, fd: int) -> None:
        os.fdatasync(fd)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def ftruncate(self, fd: int, length: int) -> None:
        os.ftruncate(fd, length)

    def fallocate(self, fd: int, offset: int, length: int) -> None:
        os.posix_fallocate(fd, offset, length)

    def size(self, fd: int) -> int:
        return os.fstat(fd).st_size

    def rename(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def mkdir(self, path: str) -> None:
        os.mkdir(path)

    def listdir(self, path: str) -> list[str]:
        return os.listdir(path)

    def fadvise(self, fd: int, offset: int, length: int, advice: int) -> None:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, offset, length, advice)

    def flock(self, fd: int, op: int) -> None:
        fcntl.flock(fd, op)

    def names(self, path: str, fd: int) -> bool:
        """Whether ``path`` is (still) the name of the file open as ``fd``."""
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return False
        own = os.fstat(fd)
        return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)

    def cached_fraction(self, fd: int, offset: int, length: int) -> float | None:
        """The fraction of [offset, offset+length) in the page cache (Linux cachestat), or None
        when the kernel cannot say."""
        return _cachestat(fd, offset, length)


class _CacheRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _CacheStat(ctypes.Structure):
    _fields_ = [("nr_cache", ctypes.c_uint64), ("nr_dirty", ctypes.c_uint64), ("nr_writeback", ctypes.c_uint64),
                ("nr_evicted", ctypes.c_uint64), ("nr_recently_evicted", ctypes.c_uint64)]


_SYS_CACHESTAT = 451 if sys.platform == "linux" and platform.machine() in ("x86_64", "aarch64") else None
_libc: Any = None


def _cachestat(fd: int, offset: int, length: int) -> float | None:
    """cachestat(2) (Linux 6.5+): how much of a file range is resident.  None if unavailable."""
    global _SYS_CACHESTAT, _libc
    if _SYS_CACHESTAT is None or length <= 0:
        return None
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    rng, st = _CacheRange(offset, length), _CacheStat()
    if _libc.syscall(_SYS_CACHESTAT, fd, ctypes.byref(rng), ctypes.byref(st), 0) != 0:
        _SYS_CACHESTAT = None  # ENOSYS (older kernel) or blocked: stop asking
        return None
    return min(1.0, st.nr_cache * PAGE / length)


DEFAULT_IO = PosixIO()


def io_error(e: OSError, what: str, **attrs: object) -> Exception:
    """Map an OSError to the tierstore error for it (ENOSPC/EDQUOT -> StoreFull)."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return StoreFull(f"{what}: {e.strerror}", errno=e.errno, **attrs)
    return StoreIOError(f"{what}: {e.strerror or e}", errno=e.errno, poisoned=False, **attrs)


def _iov_batches(bufs: Sequence[memoryview | bytes]) -> list[list[memoryview]]:
    """Split buffers into batches of at most IOV_MAX entries and _MAX_RW bytes."""
    batches: list[list[memoryview]] = [[]]
    total = 0
    for b in bufs:
        m = memoryview(b)
        while m.nbytes:
            room = _MAX_RW - total
            if len(batches[-1]) >= IOV_MAX or room == 0:
                batches.append([])
                total, room = 0, _MAX_RW
            piece = m[:room]
            batches[-1].append(piece)
            total += piece.nbytes
            m = m[piece.nbytes :]
    return [b for b in batches if b]


def write_all(io: PosixIO, fd: int, bufs: Sequence[memoryview | bytes], offset: int) -> int:
    """Write every buffer at ``offset`` (gathered, retrying short writes); returns bytes written."""
    written = 0
    interrupted = 0
    for batch in _iov_batches(bufs):
        while batch:
            try:
                n = io.pwritev(fd, batch, offset + written)
            except InterruptedError:
                interrupted += 1  # EINTR: nothing was written; try again (a bounded number of times)
                if interrupted > EINTR_RETRIES:
                    raise
                continue
            interrupted = 0
            if n <= 0:
                raise OSError(errno.EIO, "pwritev wrote nothing")
            written += n
            _consume(batch, n)
    return written


def _consume(batch: list[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes from a list of buffers, in place (after a short transfer)."""
    while batch and n >= batch[0].nbytes:
        n -= batch[0].nbytes
        batch.pop(0)
    if n:
        batch[0] = batch[0][n:]


def split_iov(bufs: Sequence[memoryview | bytes], offset: int, chunk: int) -> list[tuple[int, list[memoryview]]]:
    """Cut a gathered transfer at ``offset`` into pieces of about ``chunk`` bytes: [(offset, iov)]."""
    pieces: list[tuple[int, list[memoryview]]] = [(offset, [])]
    room = chunk
    pos = offset
    for b in bufs:
        m = memoryview(b)
        while m.nbytes:
            if room == 0:
                pieces.append((pos, []))
                room = chunk
            part = m[:room]
            pieces[-1][1].append(part)
            room -= part.nbytes
            pos += part.nbytes
            m = m[part.nbytes :]
    return [p for p in pieces if p[1]]


def write_all_parallel(io: PosixIO, fd: int, bufs: Sequence[memoryview | bytes], offset: int, executor: Any) -> int:
    """``write_all``, split across ``executor``'s threads when the transfer is large.

    Positional writes to disjoint ranges are independent, and copying into the page cache
    is CPU-bound: two threads copy close to twice as fast.
    """
    total = sum(memoryview(b).nbytes for b in bufs)
    if executor is None or total < PARALLEL_MIN:
        return write_all(io, fd, bufs, offset)
    futures = [submit(executor, write_all, io, fd, iov, off) for off, iov in split_iov(bufs, offset, PARALLEL_CHUNK)]
    return sum(f.result() for f in futures)


def read_all(io: PosixIO, fd: int, bufs: Sequence[memoryview], offset: int) -> int:
    """Fill every buffer from ``offset`` (scattered, retrying short reads); returns bytes read.

    Stops early only at end of file; the caller compares the result with what it asked for.
    """
    if len(bufs) <= IOV_MAX:  # the usual case: one call fills everything
        want = sum(b.nbytes for b in bufs)
        if want <= _MAX_RW:
            try:
                got = io.preadv(fd, bufs, offset)
            except InterruptedError:
                return read_all_loop(io, fd, bufs, offset)  # EINTR: nothing was read; retry
            if got == want or got == 0:
                return got
            rest = [memoryview(b) for b in bufs]
            _consume(rest, got)
            return got + read_all(io, fd, rest, offset + got)
    return read_all_loop(io, fd, bufs, offset)


def read_all_loop(io: PosixIO, fd: int, bufs: Sequence[memoryview], offset: int) -> int:
    """read_all's general case: batches, short reads, EINTR."""
    got = 0
    interrupted = 0
    for batch in _iov_batches(bufs):
        while batch:
            try:
                n = io.preadv(fd, batch, offset + got)
            except InterruptedError:
                interrupted += 1
                if interrupted > EINTR_RETRIES:
                    raise
                continue
            interrupted = 0
            if n == 0:
                return got
            got += n
            _consume(batch, n)
    return got
