"""The writer lock of a store directory: an exclusive ``flock`` on LOCK, held by the one writable engine.

It owns taking the lock with a deadline and nothing else; closing the returned fd (or the
process dying) releases it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time

from ..errors import StoreLocked
from ..format import constants as fmt
from .fileio import PosixIO, io_error


def acquire_writer_lock(io: PosixIO, root: str, timeout: float) -> int:
    """Take the exclusive writer lock (``flock`` on LOCK), waiting up to ``timeout`` seconds.

    Returns the fd holding it; closing the fd releases the lock (so does process death).
    """
    path = os.path.join(root, fmt.LOCK_FILE)
    fd = io.open(path, os.O_RDWR | os.O_CREAT)
    deadline = time.monotonic() + timeout
    delay = 0.001
    while True:
        try:
            io.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                io.close(fd)
                raise io_error(e, "lock store", path=path) from None
        if time.monotonic() >= deadline:
            io.close(fd)
            raise StoreLocked(f"another writer holds the store (waited {timeout:g}s)", path=root)
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


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
