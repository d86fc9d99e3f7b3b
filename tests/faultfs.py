"""A file layer for crash and fault testing: it records every mutation the engine makes, and can
write out the states a power loss could leave, or fail the n-th I/O call.

Recording (``FaultFS``): per file, the content as of its last fsync/fdatasync and the writes and
truncations since; per directory, the entry changes (create, unlink, rename) since its last
fsync.  ``crash_state(dest, mode, rng)`` materialises one possible post-crash state:

- ``A``: unsynced data dropped (RocksDB DropUnsyncedData); directory changes kept.
- ``B``: A, and directory changes since the last directory fsync undone
  (RocksDB DeleteFilesCreatedAfterLastDirSync, generalised to unlinks and renames).
- ``C``: each unsynced write kept, dropped or replaced by garbage, with probabilities
  3/8, 3/8, 1/4 (SQLite's crash VFS, src/test6.c); directory changes as in B or A at random.
- ``D``: unsynced appends land zero-filled or garbage-filled in 4 KiB pieces of which a random
  prefix is correct (ALICE's append model), other unsynced writes split at 4 KiB and a
  random prefix of the pieces kept.

LMDB does its own I/O in C, so the index is handled as "last committed": the caller passes a
snapshot of the environment (``index_snapshot``) taken at the persistence point.

Faults (``fail_at``): the n-th call to a named I/O method raises an OSError (EIO, ENOSPC) or
InterruptedError, or (``short``) writes only part of the buffer, once or persistently.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tierstore.engine.fileio import PosixIO

PAGE = 4096


@dataclass
class _File:
    durable: bytearray = field(default_factory=bytearray)
    pending: list[tuple] = field(default_factory=list)  # ("write", off, bytes) | ("truncate", n)


def _apply(content: bytearray, op: tuple) -> None:
    if op[0] == "write":
        _, off, data = op
        if len(content) < off:
            content.extend(bytes(off - len(content)))
        content[off : off + len(data)] = data
    else:
        del content[op[1] :]
        if len(content) < op[1]:
            content.extend(bytes(op[1] - len(content)))


class FaultFS(PosixIO):
    """PosixIO that records what is durable; see the module docstring."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.files: dict[str, _File] = {}  # by path, for files under root
        self.fd_path: dict[int, str] = {}
        self.dir_pending: dict[str, list[tuple]] = {}  # dir -> [("create", path) | ("unlink", path, content) |
        #                                                         ("rename", src, dst, src_content)]
        self.on_persist: Callable[[str], None] | None = None
        self.index_env: Any = None  # for image(): the open store's LMDB environment
        self.calls: dict[str, int] = {}
        self._faults: list[dict[str, Any]] = []
        self.fired = 0  # how many injected faults went off
        self.scan_existing()

    # -- bookkeeping ---------------------------------------------------------------------------

    def scan_existing(self) -> None:
        """Files already under root count as durable as they are."""
        for dirpath, _, names in os.walk(self.root):
            for n in names:
                p = os.path.join(dirpath, n)
                if "/index" in p[len(self.root):] or n == "LOCK":
                    continue
                with open(p, "rb") as f:
                    self.files[p] = _File(bytearray(f.read()))

    def _mine(self, path: str) -> bool:
        p = os.path.abspath(path)
        return p.startswith(self.root + os.sep) and os.sep + "index" not in p[len(self.root):] and \
            os.path.basename(p) != "LOCK"

    def _persist(self, what: str) -> None:
        if self.on_persist is not None:
            self.on_persist(what)

    # -- faults --------------------------------------------------------------------------------

    def fail_at(self, method: str, n: int, kind: str = "EIO", persistent: bool = False) -> None:
        """Make the n-th call (counted from now) of ``method`` fail with ``kind``:
        "EIO", "ENOSPC", "EINTR" or "short" (a write that stores half its bytes)."""
        self._faults.append({"method": method, "at": self.calls.get(method, 0) + n, "kind": kind,
                             "persistent": persistent})

    def clear_faults(self) -> None:
        """No more injected faults (the ones set so far are dropped)."""
        self._faults.clear()

    def _fault(self, method: str) -> str | None:
        self.calls[method] = self.calls.get(method, 0) + 1
        c = self.calls[method]
        for f in self._faults:
            if f["method"] == method and (c == f["at"] or (f["persistent"] and c > f["at"])):
                self.fired += 1
                if f["kind"] == "EINTR":
                    raise InterruptedError(errno.EINTR, "injected EINTR")
                if f["kind"] != "short":
                    code = errno.ENOSPC if f["kind"] == "ENOSPC" else errno.EIO
                    raise OSError(code, f"injected {f['kind']} in {method}")
                return "short"
        return None

    # -- the I/O layer -----------------------------------------------------------------------------

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        self._fault("open")
        path = os.path.abspath(path)
        existed = os.path.exists(path)
        fd = super().open(path, flags, mode)
        if self._mine(path):
            self.fd_path[fd] = path
            if not existed:
                self.files[path] = _File()
                self.dir_pending.setdefault(os.path.dirname(path), []).append(("create", path))
            elif path not in self.files:
                with open(path, "rb") as f:
                    self.files[path] = _File(bytearray(f.read()))
            if flags & os.O_TRUNC:
                self.files[path].pending.append(("truncate", 0))
        return fd

    def close(self, fd: int) -> None:
        self.fd_path.pop(fd, None)
        super().close(fd)

    def pwritev(self, fd: int, bufs: Sequence[Any], offset: int) -> int:
        short = self._fault("pwritev")
        data = b"".join(bytes(memoryview(b).cast("B")) for b in bufs)
        if short:
            data = data[: max(1, len(data) // 2)]
            n = os.pwrite(fd, data, offset)
        else:
            n = super().pwritev(fd, bufs, offset)
        path = self.fd_path.get(fd)
        if path is not None:
            self.files[path].pending.append(("write", offset, data[:n]))
        return n

    def preadv(self, fd: int, bufs: Sequence[memoryview], offset: int, flags: int = 0) -> int:
        self._fault("preadv")
        return super().preadv(fd, bufs, offset, flags)

    def pread(self, fd: int, n: int, offset: int) -> bytes:
        self._fault("pread")
        return super().pread(fd, n, offset)

    def ftruncate(self, fd: int, length: int) -> None:
        self._fault("ftruncate")
        super().ftruncate(fd, length)
        path = self.fd_path.get(fd)
        if path is not None:
            self.files[path].pending.append(("truncate", length))

    def _sync(self, fd: int, what: str) -> None:
        self._persist("before-" + what)
        self._fault(what)
        getattr(os, what)(fd)
        path = self.fd_path.get(fd)
        if path is not None:
            f = self.files[path]
            for op in f.pending:
                _apply(f.durable, op)
            f.pending.clear()
        self._persist(what)

    def fdatasync(self, fd: int) -> None:
        self._sync(fd, "fdatasync")

    def fsync(self, fd: int) -> None:
        self._sync(fd, "fsync")

    def fsync_dir(self, path: str) -> None:
        self._persist("before-fsync_dir")
        self._fault("fsync_dir")
        super().fsync_dir(path)
        self.dir_pending.pop(os.path.abspath(path), None)
        self._persist("fsync_dir")

    def unlink(self, path: str) -> None:
        self._fault("unlink")
        path = os.path.abspath(path)
        f = self.files.pop(path, None)
        super().unlink(path)
        if f is not None:
            self.dir_pending.setdefault(os.path.dirname(path), []).append(("unlink", path, f))
        self._persist("unlink")

    def rename(self, src: str, dst: str) -> None:
        self._fault("rename")
        src, dst = os.path.abspath(src), os.path.abspath(dst)
        super().rename(src, dst)
        f = self.files.pop(src, None)
        if f is not None:
            self.files[dst] = f
            self.dir_pending.setdefault(os.path.dirname(src), []).append(("rename", src, dst, f))
        self._persist("rename")

    def mkdir(self, path: str) -> None:
        self._fault("mkdir")
        super().mkdir(path)

    # -- crash states ------------------------------------------------------------------------------

    def crash_state(self, dest: str, mode: str, rng: random.Random, index_snapshot: str | None) -> None:
        """Write one possible post-power-loss state of the store into ``dest``."""
        undo_dirs = mode == "B" or (mode in ("C", "D") and rng.random() < 0.5)
        files: dict[str, _File] = dict(self.files)
        if undo_dirs:
            for ops in self.dir_pending.values():
                for op in reversed(ops):
                    if op[0] == "create":
                        files.pop(op[1], None)
                    elif op[0] == "unlink":
                        files[op[1]] = op[2]
                    else:  # rename: the file is back under its old name
                        files.pop(op[2], None)
                        files[op[1]] = op[3]
        os.makedirs(dest)
        for path, f in files.items():
            content = bytearray(f.durable)
            for op in f.pending:
                self._crash_op(content, op, mode, rng)
            target = os.path.join(dest, os.path.relpath(path, self.root))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "wb") as out:
                out.write(content)
        if index_snapshot is not None:
            shutil.copytree(index_snapshot, os.path.join(dest, "index"))

    def image(self, dest: str) -> None:
        """The state a power loss now leaves when the disk loses exactly what was not synced
        (mode B), with the index as of its last commit, copied from ``self.index_env`` (the
        open store's LMDB environment) when the caller set it."""
        self.crash_state(dest, "B", random.Random(0), None)
        if self.index_env is not None:
            os.makedirs(os.path.join(dest, "index"))
            self.index_env.copy(os.path.join(dest, "index"))

    @staticmethod
    def _crash_op(content: bytearray, op: tuple, mode: str, rng: random.Random) -> None:
        if mode in ("A", "B"):
            return  # unsynced: dropped
        if op[0] == "truncate":
            if rng.random() < 0.5:
                _apply(content, op)
            return
        _, off, data = op
        if mode == "C":
            r = rng.random()
            if r < 3 / 8:
                _apply(content, op)
            elif r >= 3 / 4:
                _apply(content, ("write", off, rng.randbytes(len(data))))
            return
        # D: split at 4 KiB; a random prefix of the pieces lands; appends may land as zeros/garbage
        pieces = [(off + i, data[i : i + PAGE]) for i in range(0, len(data), PAGE)] or [(off, b"")]
        keep = rng.randint(0, len(pieces))
        appending = off >= len(content)
        for i, (o, piece) in enumerate(pieces):
            if i < keep:
                _apply(content, ("write", o, piece))
            elif appending:
                filler = bytes(len(piece)) if rng.random() < 0.5 else rng.randbytes(len(piece))
                _apply(content, ("write", o, filler))
            else:
                break
