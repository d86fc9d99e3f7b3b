"""Handing work to this process's thread pools: ``submit``.

This module owns one rule.  Once the interpreter is shutting down -- its main thread has ended
while other threads still run (a server whose main thread only started its workers), or an
``atexit`` handler runs -- ``concurrent.futures`` pools refuse new work with a RuntimeError.
Then the work runs in the calling thread and its Future is returned done: a put, a read or a
sync goes on as before, only without overlap.  It never decides what runs where otherwise,
and it never hides a pool that was shut down while the interpreter lives (a store closed
meanwhile): that RuntimeError stays the caller's to translate.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any


def shutting_down() -> bool:
    """Whether the interpreter is past its main thread's end (``threading._shutdown`` stops
    the main thread before it runs the pools' exit hooks, which make them refuse work)."""
    return not threading.main_thread().is_alive()


def submit(executor: Executor, fn: Callable[..., Any], *args: Any) -> Future:
    """``executor.submit(fn, *args)``; at interpreter shutdown, ``fn(*args)`` here."""
    try:
        return executor.submit(fn, *args)
    except RuntimeError:
        if not shutting_down():
            raise
    future: Future = Future()
    future.set_running_or_notify_cancel()
    try:
        future.set_result(fn(*args))
    except BaseException as e:  # (the Future carries it, as a pool's would)
        future.set_exception(e)
    return future
