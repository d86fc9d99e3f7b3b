"""Read buffers: page-aligned host memory for the objects a get returns, reused.

It owns the idle buffers of reads whose arrays the caller has dropped, so that the next read
of about the same size lands in memory whose pages are already mapped: a fresh buffer costs
its page faults on first touch (about 0.5 ms per MiB on the 2-core development VM, as much as
the read itself), a reused one costs nothing.  It never hands out memory that any array still
references: each buffer is given out through a *lease* object that every array made from it
holds (numpy's ``base`` chain, and torch's ``from_numpy``); the buffer comes back only when
the last of them is garbage (a ``weakref.finalize`` on the lease).  It keeps at most
``IDLE_MAX_BYTES`` of idle buffers per process, the most recently returned (a forked child
starts with none).  It does no I/O and knows nothing of records.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import weakref

import numpy as np

from .format import constants as fmt

POOLED_MIN_BYTES = 1 << 20  # smaller buffers come from malloc, whose small blocks are reused warm
GRAIN = 1 << 20  # pooled buffers are whole MiB, so that reads of nearly one size share them
IDLE_MAX_BYTES = 256 << 20  # idle buffers kept per process, at most (the rest is unmapped)


def aligned_empty(nbytes: int, align: int = fmt.PAGE) -> np.ndarray:
    """An uninitialised uint8 buffer whose address is a multiple of ``align`` (for O_DIRECT/GDS),
    fresh from malloc (not pooled)."""
    raw = np.empty(nbytes + align, dtype=np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start : start + nbytes]


class ReadBuffers:
    """Page-aligned buffers of at least ``POOLED_MIN_BYTES``, reused once unreferenced.
    Thread-safe; one per process (``take`` below)."""

    def __init__(self, idle_max: int = IDLE_MAX_BYTES) -> None:
        self.idle_max = idle_max
        self._idle: list[tuple[int, mmap.mmap]] = []  # (size, region), oldest returned first
        self._idle_bytes = 0
        self._reset_lock()
        self.counters = {"taken": 0, "reused": 0, "unmapped": 0}

    def _reset_lock(self) -> None:
        # reentrant: a finalizer (``_returned``) may run in this thread while it holds the lock,
        # when an allocation under it starts a garbage collection that frees another lease
        self._lock = threading.RLock()

    def after_fork(self) -> None:
        """In a forked child: a fresh lock (another thread of the parent may have held it at the
        fork) and no idle buffers."""
        self._reset_lock()
        self._idle = []
        self._idle_bytes = 0

    def take(self, nbytes: int) -> np.ndarray:
        """A page-aligned uint8 array of ``nbytes`` (uninitialised: old bytes of an earlier read
        may be there until overwritten)."""
        if nbytes < POOLED_MIN_BYTES:
            return aligned_empty(nbytes)
        size = -(-nbytes // GRAIN) * GRAIN
        region = None
        with self._lock:
            self.counters["taken"] += 1
            for i in range(len(self._idle) - 1, -1, -1):  # the most recently returned of this size
                if self._idle[i][0] == size:
                    region = self._idle.pop(i)[1]
                    self._idle_bytes -= size
                    self.counters["reused"] += 1
                    break
        if region is None:  # (private: a forked child never shares it)
            region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        lease = (ctypes.c_ubyte * size).from_buffer(region)
        weakref.finalize(lease, self._returned, size, region).atexit = False
        return np.frombuffer(lease, dtype=np.uint8, count=nbytes)

    def _returned(self, size: int, region: mmap.mmap) -> None:
        """The lease died (no array references the buffer any more): keep it for the next read,
        unmapping the oldest idle buffers when the pool would hold more than ``idle_max`` (a
        workload whose sizes change does not keep the old sizes for good)."""
        if size > self.idle_max:
            return
        with self._lock:
            while self._idle and self._idle_bytes + size > self.idle_max:
                old, _ = self._idle.pop(0)
                self._idle_bytes -= old
                self.counters["unmapped"] += 1
            self._idle.append((size, region))
            self._idle_bytes += size

    def trim(self) -> None:
        """Unmap every idle buffer."""
        with self._lock:
            self._idle = []
            self._idle_bytes = 0

    @property
    def idle_bytes(self) -> int:
        return self._idle_bytes


_POOL = ReadBuffers()
os.register_at_fork(after_in_child=_POOL.after_fork)


def take(nbytes: int) -> np.ndarray:
    """``ReadBuffers.take`` of the process's pool."""
    return _POOL.take(nbytes)


def pool() -> ReadBuffers:
    """The process's pool (its counters; ``trim``)."""
    return _POOL
