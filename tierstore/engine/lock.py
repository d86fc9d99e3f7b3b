"""The locks of a store directory (SPEC.md §7.8): the writer lock on LOCK, the append lock on
APPEND, the compaction lock on COMPACT, the index commits' turn on COMMIT.

Writable handles hold a *shared* ``flock`` on LOCK for their life; a handle that finds no
other writer takes it exclusively while it opens (it may then recover and rebuild), and tools
that need the store to themselves (``recover``, ``quarantine --clear``) hold it exclusively.
Appends are serialised across processes by an exclusive ``flock`` on APPEND, held per append.

It owns taking and releasing those locks and nothing else: what happens under them (catching
up with other writers' records, publishing the log's end) is the engine's, run through the
hooks of ``AppendLock``.  Closing a descriptor (or the process dying) releases its lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import StoreLocked
from ..format import constants as fmt
from .fileio import PosixIO, io_error

_BUSY = (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK)


def _poll(io: PosixIO, fd: int, ops: tuple[int, ...], path: str, timeout: float, busy: str) -> int:
    """Take the first of ``ops`` (non-blocking flock operations) that succeeds, retrying until
    ``timeout``; returns the index of the one taken.  StoreLocked(``busy``) after the deadline."""
    deadline = time.monotonic() + timeout
    delay = 0.001
    while True:
        for n, op in enumerate(ops):
            try:
                io.flock(fd, op | fcntl.LOCK_NB)
                return n
            except OSError as e:
                if e.errno not in _BUSY:
                    raise io_error(e, "lock store", path=path) from None
        if time.monotonic() >= deadline:
            raise StoreLocked(f"{busy} (waited {timeout:g}s)", path=os.path.dirname(path))
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def acquire_writer_lock(io: PosixIO, root: str, timeout: float) -> int:
    """Take the writer lock exclusively (a tool that needs the store to itself), waiting up to
    ``timeout`` seconds for every writable handle to close.

    Returns the fd holding it; closing the fd releases the lock (so does process death).
    """
    path = os.path.join(root, fmt.LOCK_FILE)
    fd = io.open(path, os.O_RDWR | os.O_CREAT)
    try:
        _poll(io, fd, (fcntl.LOCK_EX,), path, timeout, "another writer holds the store")
    except BaseException:
        io.close(fd)
        raise
    return fd


def join_writers(io: PosixIO, root: str, timeout: float) -> tuple[int, bool]:
    """Take the writer lock of a writable handle: exclusively when no other writer has the store
    open (``alone``: the caller may recover the log and rebuild the index, then ``downgrade``),
    shared beside other writers otherwise.  Waits up to ``timeout`` seconds only while a tool
    holds the store to itself.  Returns (fd, alone)."""
    path = os.path.join(root, fmt.LOCK_FILE)
    fd = io.open(path, os.O_RDWR | os.O_CREAT)
    try:
        n = _poll(io, fd, (fcntl.LOCK_EX, fcntl.LOCK_SH), path, timeout,
                  "the store is held exclusively (by a tool such as recover, or a writer opened with "
                  "exclusive=True): it has the store to itself")
    except BaseException:
        io.close(fd)
        raise
    return fd, n == 0


def downgrade(io: PosixIO, fd: int) -> None:
    """Exclusive -> shared, so other writers may join (call it holding the append lock: the
    change is not atomic, and every joiner takes the append lock first)."""
    io.flock(fd, fcntl.LOCK_SH)


def alone_now(io: PosixIO, fd: int) -> bool:
    """Whether this handle is the only writer now (call it holding the append lock).  Leaves the
    shared lock held either way (a failed upgrade drops it on Linux: it is taken again)."""
    try:
        io.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in _BUSY:
            raise io_error(e, "lock store") from None
        io.flock(fd, fcntl.LOCK_SH)
        return False
    io.flock(fd, fcntl.LOCK_SH)
    return True


def writer_active(io: PosixIO, root: str) -> bool:
    """Whether another handle holds the writer lock now (a probe: the lock is released at once)."""
    path = os.path.join(root, fmt.LOCK_FILE)
    try:
        fd = io.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        io.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        io.close(fd)  # closing releases a lock the probe took


class AppendLock:
    """The append lock: in this process a re-entrant thread lock; across processes an exclusive
    ``flock`` on APPEND, taken when the outermost holder enters and released when it leaves.

    ``on_enter`` runs once the flock is taken (the engine catches up with the records other
    processes appended meanwhile); ``on_leave`` runs before it is released (the log hands its
    buffer to the file and publishes where the log ends).  Nothing a process appends stays in
    its memory across a release: the file is the log.
    """

    def __init__(self, io: PosixIO, root: str) -> None:
        self.io = io
        self.path = os.path.join(root, fmt.APPEND_FILE)
        self.fd = io.open(self.path, os.O_RDWR | os.O_CREAT)
        self._lock = threading.RLock()
        self._depth = 0
        self._owner: int | None = None  # the thread that holds it (None: no thread)
        self.on_enter: Callable[[], None] | None = None
        self.on_leave: Callable[[], None] | None = None

    def acquire(self, timeout: float | None = None) -> None:
        """Take the lock; ``timeout`` (seconds) bounds the wait for another process's append
        (StoreLocked), None waits as long as it takes (appends are short)."""
        self._lock.acquire()
        if self._depth or self.fd < 0:  # re-entered, or closed (a handle being torn down)
            self._depth += 1
            return
        try:
            if timeout is None:
                self.io.flock(self.fd, fcntl.LOCK_EX)
            else:
                _poll(self.io, self.fd, (fcntl.LOCK_EX,), self.path, timeout,
                      "another process is opening or appending to the store")
        except BaseException:
            self._lock.release()
            raise
        self._depth = 1
        self._owner = threading.get_ident()
        if self.on_enter is not None:
            try:
                self.on_enter()
            except BaseException:
                self._unlock()
                raise

    def release(self) -> None:
        if self._depth > 1 or self.fd < 0:
            self._depth -= 1
            self._lock.release()
            return
        try:
            if self.on_leave is not None:
                self.on_leave()
        finally:
            self._unlock()

    def _unlock(self) -> None:
        self._depth = 0
        self._owner = None
        try:
            self.io.flock(self.fd, fcntl.LOCK_UN)
        finally:
            self._lock.release()

    def held_here(self) -> bool:
        """Whether the calling thread holds the lock."""
        return self._owner == threading.get_ident()

    def __enter__(self) -> "AppendLock":
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    # APPEND's bytes are coordination, not data: they are read and written directly (not
    # through ``io``, whose faults and crash states are the log's), and never synced

    def read_state(self) -> bytes:
        """The bytes the last holder left in APPEND (its end of the log; see the engine)."""
        return os.pread(self.fd, fmt.APPEND_STATE.size, 0)

    def write_state(self, data: bytes) -> None:
        os.pwrite(self.fd, data, 0)

    def close(self) -> None:
        if self.fd >= 0:  # (-1 first: a fork meanwhile must not close a number reused by another file)
            fd, self.fd = self.fd, -1
            self.io.close(fd)


class CommitTurn:
    """Index commits of writers beside others take turns (SPEC.md §7.8): an exclusive ``flock``
    on COMMIT is held while a commit reads other writers' records and applies them, so that a
    record is read by one writer's commit, not by each one's -- the next in turn finds the index
    applied past most of what it would have read.  Correctness does not rest on it (a commit
    skips what another applied, turn or no turn): it saves CPU.  A thread that holds the append
    lock never waits for a turn (the holder of the turn may be waiting for the append lock)."""

    def __init__(self, io: PosixIO, root: str) -> None:
        self.io = io
        self.fd = io.open(os.path.join(root, fmt.COMMIT_FILE), os.O_RDWR | os.O_CREAT)

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        self.io.flock(self.fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            self.io.flock(self.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self.fd >= 0:  # (-1 first: a fork meanwhile must not close a number reused by another file)
            fd, self.fd = self.fd, -1
            self.io.close(fd)


def claim(io: PosixIO, root: str, name: str, busy: str) -> int:
    """An exclusive ``flock`` on coordination file ``name`` of the store, not waiting: the fd
    (close it to let go), or StoreLocked(``busy``) when another process holds it."""
    path = os.path.join(root, name)
    fd = io.open(path, os.O_RDWR | os.O_CREAT)
    try:
        _poll(io, fd, (fcntl.LOCK_EX,), path, 0, busy)
    except BaseException:
        io.close(fd)
        raise
    return fd


def compaction_lock(io: PosixIO, root: str) -> int:
    """Take the compaction lock (one compaction at a time across processes; waits for one in
    progress).  Returns the fd; closing it releases the lock."""
    fd = io.open(os.path.join(root, fmt.COMPACT_FILE), os.O_RDWR | os.O_CREAT)
    try:
        io.flock(fd, fcntl.LOCK_EX)
    except BaseException:
        io.close(fd)
        raise
    return fd
