"""Handing work to this process's thread pools, and taking it back: ``submit``, ``shut``.

This module owns two rules of ``concurrent.futures`` pools.
- Once the interpreter is shutting down -- its main thread has ended while other threads still
  run (a server whose main thread only started its workers), an ``atexit`` handler runs, or a
  child was forked from such a process -- every pool refuses new work ("cannot schedule new
  futures after interpreter shutdown", before the work is queued).  ``submit`` then runs the
  work in the calling thread and returns its Future done: a put, a read or a sync goes on as
  before, without overlap.  Any other refusal (a pool shut down: its store closed) is raised.
- A pool shut down with ``cancel_futures`` cancels the queued Futures without waking
  ``concurrent.futures.wait`` / ``as_completed``: ``shut`` wakes them.
It never decides what runs where otherwise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any

REFUSED_AT_EXIT = "cannot schedule new futures after interpreter shutdown"  # (CPython 3.9 on)


def submit(executor: Executor, fn: Callable[..., Any], *args: Any) -> Future:
    """``executor.submit(fn, *args)``; when pools refuse work at interpreter shutdown,
    ``fn(*args)`` here, its outcome in the Future returned."""
    try:
        return executor.submit(fn, *args)
    except RuntimeError as e:
        if str(e) != REFUSED_AT_EXIT:
            raise
    future: Future = Future()
    future.set_running_or_notify_cancel()
    try:
        future.set_result(fn(*args))
    except BaseException as e:  # (the Future carries it, as a pool's would)
        future.set_exception(e)
    return future


def shut(executor: ThreadPoolExecutor, futures: Iterable[Future] = ()) -> None:
    """Shut ``executor`` down: the work under way finishes, the queued work is cancelled, and
    those of ``futures`` it cancelled are reported to waiters (``wait``, ``as_completed``)."""
    executor.shutdown(wait=True, cancel_futures=True)
    for f in futures:  # (its threads have ended: nothing else changes these futures now)
        if f.cancelled():
            with contextlib.suppress(RuntimeError):  # (cancelled earlier and already reported)
                f.set_running_or_notify_cancel()
