"""A file layer that simulates power loss: what survives is only what was synced.

``CrashSimIO`` wraps the real file system and remembers, per file, the size it had at its
last fsync/fdatasync, which files were created or unlinked since their directory's last
fsync, and calls ``on_persist`` at every persistence point.  ``image(dest)`` materialises the
state a power loss at that moment could leave (RocksDB's DropUnsyncedData plus
DeleteFilesCreatedAfterLastDirSync): unsynced appends dropped, unsynced creates undone,
unsynced unlinks undone.  The LMDB index does its own I/O, so images take the index's last
committed state with ``env.copy`` (its commits are synced).

The engine only appends to segments (and truncates during recovery), so "content at the
last sync" is "the first synced_size bytes".
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import Any

from tierstore.fileio import PosixIO


class CrashSimIO(PosixIO):
    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.fd_path: dict[int, str] = {}
        self.synced: dict[str, int] = {}
        self.created: set[str] = set()
        self.unlinked: dict[str, bytes] = {}
        self.on_persist: Callable[[str], None] | None = None
        self.index_env: Any = None

    def _mine(self, path: str) -> bool:
        return os.path.abspath(path).startswith(self.root)

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        path = os.path.abspath(path)
        existed = os.path.exists(path)
        fd = super().open(path, flags, mode)
        if self._mine(path):
            self.fd_path[fd] = path
            if not existed:
                self.created.add(path)
                self.synced[path] = 0
            else:
                self.synced.setdefault(path, os.path.getsize(path))
        return fd

    def close(self, fd: int) -> None:
        self.fd_path.pop(fd, None)
        super().close(fd)

    def _synced(self, fd: int, what: str) -> None:
        path = self.fd_path.get(fd)
        if path is not None:
            self.synced[path] = os.fstat(fd).st_size
        if self.on_persist is not None:
            self.on_persist(what)

    def fdatasync(self, fd: int) -> None:
        if self.on_persist is not None:
            self.on_persist("before-fdatasync")
        super().fdatasync(fd)
        self._synced(fd, "fdatasync")

    def fsync(self, fd: int) -> None:
        super().fsync(fd)
        self._synced(fd, "fsync")

    def fsync_dir(self, path: str) -> None:
        super().fsync_dir(path)
        path = os.path.abspath(path)
        self.created = {p for p in self.created if os.path.dirname(p) != path}
        self.unlinked = {p: c for p, c in self.unlinked.items() if os.path.dirname(p) != path}
        if self.on_persist is not None:
            self.on_persist("fsync_dir")

    def unlink(self, path: str) -> None:
        path = os.path.abspath(path)
        if self._mine(path) and path not in self.created:
            with open(path, "rb") as f:
                self.unlinked[path] = f.read(self.synced.get(path, os.path.getsize(path)))
        super().unlink(path)
        self.created.discard(path)

    def image(self, dest: str) -> None:
        """Write the state a power loss now could leave into ``dest``."""
        shutil.copytree(self.root, dest, ignore=shutil.ignore_patterns("index", "LOCK"))
        for path, size in self.synced.items():
            rel = os.path.relpath(path, self.root)
            target = os.path.join(dest, rel)
            if path in self.created:
                if os.path.exists(target):
                    os.unlink(target)
            elif os.path.exists(target) and os.path.getsize(target) > size:
                with open(target, "r+b") as f:
                    f.truncate(size)
        for path, content in self.unlinked.items():
            target = os.path.join(dest, os.path.relpath(path, self.root))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "wb") as f:
                f.write(content)
        if self.index_env is not None:
            os.makedirs(os.path.join(dest, "index"))
            self.index_env.copy(os.path.join(dest, "index"))
