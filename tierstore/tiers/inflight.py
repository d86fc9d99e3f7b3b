"""Puts in flight across the writer processes that share one SSD budget (SPEC.md §7.9): the
``INFLIGHT`` file of the store, a table of slots (pid, handle token, bytes), read and changed
under its ``flock``.

A put near the bound (capacity.py) counts what other processes' puts are about to add before it
goes: each process counted only its own, and several writers passed the budget by the size of
their puts in flight (3 writers on 8 MiB: 105-116 %; 2 writers of puts up to 2 MiB on 4 MiB:
up to 164 %).  A slot of a process that died is freed by the next reader.

It owns the file and this handle's slot; it never decides whether a put fits (it is given
the test) and never reads anything else of the store.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import secrets
import threading
from collections.abc import Callable

from ..format import constants as fmt

_SIZE = fmt.INFLIGHT_SLOT.size * fmt.INFLIGHT_SLOTS
_ZEROS = bytes(_SIZE)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class InFlight:
    """This handle's slot in the store's ``INFLIGHT`` table.  Thread-safe."""

    def __init__(self, root: str, *, limit: int = 1 << 62, alone: bool = False) -> None:
        """``limit``: a slot holding more is damage, freed (a put that large was refused);
        ``alone``: no other writer process has the store open, so every slot is stale (one of a
        process that died and whose pid another process took since would count until that one
        ended) and the table starts empty."""
        self.path = os.path.join(root, fmt.INFLIGHT_FILE)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        self.limit = limit
        self._map: mmap.mmap | None = None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
            try:
                if alone:  # (zeros, not a truncation: the file never shrinks under a mapping)
                    os.pwrite(self.fd, _ZEROS, 0)
                elif os.fstat(self.fd).st_size < _SIZE:
                    os.ftruncate(self.fd, _SIZE)
            finally:
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            try:  # ``busy`` on every put far from the bound: a look at the mapping, not a pread
                self._map = mmap.mmap(self.fd, _SIZE, mmap.MAP_SHARED, mmap.PROT_READ)
            except (OSError, ValueError):
                pass  # (a file system without shared mappings: pread)
        except BaseException:
            os.close(self.fd)
            raise
        self.pid, self.token = os.getpid(), secrets.randbits(32) or 1
        self.mine = 0  # bytes this handle published
        self._lock = threading.Lock()  # (flock does not exclude this process's threads)

    def _slots(self) -> list[tuple[int, int, int]]:
        raw = os.pread(self.fd, _SIZE, 0).ljust(_SIZE, b"\0")
        return [fmt.INFLIGHT_SLOT.unpack_from(raw, i * fmt.INFLIGHT_SLOT.size) for i in range(fmt.INFLIGHT_SLOTS)]

    def _put(self, i: int, slot: tuple[int, int, int]) -> None:
        os.pwrite(self.fd, fmt.INFLIGHT_SLOT.pack(*slot), i * fmt.INFLIGHT_SLOT.size)

    def _change(self, delta: int, fits: Callable[[int], bool] | None) -> tuple[bool, int]:
        """Under the flock: the bytes other live processes' puts have in flight (their dead
        slots freed); if ``fits(those)`` (or no test), this handle's bytes change by ``delta``."""
        with self._lock:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
            try:
                slots = self._slots()
                others, mine, free = 0, None, None
                for i, (pid, token, n) in enumerate(slots):
                    if (pid, token) == (self.pid, self.token):
                        mine = i
                    elif pid == 0:
                        free = i if free is None else free
                    elif n > self.limit or not _alive(pid):
                        self._put(i, (0, 0, 0))  # a process that died with puts in flight (or damage)
                        free = i if free is None else free
                    else:
                        others += n
                if fits is not None and not fits(others):
                    return False, others
                self.mine += delta
                at = mine if mine is not None else free
                if at is not None:  # (all slots taken by live handles: this one goes uncounted)
                    self._put(at, (self.pid, self.token, self.mine) if self.mine > 0 else (0, 0, 0))
                return True, others
            finally:
                fcntl.flock(self.fd, fcntl.LOCK_UN)

    def busy(self) -> bool:
        """Whether any handle has puts in flight in the table (read without the lock: a hint)."""
        m = self._map
        if m is not None:
            try:
                return m[:] != _ZEROS
            except ValueError:  # (closed meanwhile: the handle is closing, its puts fail anyway)
                return False
        return os.pread(self.fd, _SIZE, 0).strip(b"\0") != b""

    def reserve(self, nbytes: int, fits: Callable[[int], bool]) -> tuple[bool, int]:
        """(whether ``fits(bytes other processes have in flight)``, those bytes); when it fits,
        ``nbytes`` are published as this handle's, until ``release``."""
        return self._change(nbytes, fits)

    def release(self, nbytes: int) -> None:
        """A put published by ``reserve`` landed (or failed)."""
        self._change(-nbytes, None)

    def close(self) -> None:
        """Free this handle's slot (puts it still has in flight stop counting) and the file."""
        if self.fd < 0:
            return
        if self.mine:
            try:
                self._change(-self.mine, None)
            except OSError:
                pass  # (the next reader frees it once this process is gone)
        with self._lock:
            if self._map is not None:
                self._map.close()
                self._map = None
            os.close(self.fd)
            self.fd = -1
