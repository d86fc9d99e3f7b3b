"""tierstore: an embedded storage engine for the long-term memory of LLM systems.

Typed objects (KV-cache chunks, vector shards, blobs) in one versioned, checksummed block
format, with a segment log as write-ahead log and an LMDB index.  See README.md, SPEC.md and
docs/guide.md.  This module is the public face only: it defines ``open`` and names the public
classes, errors and modules, and holds no logic of its own.

    import tierstore
    with tierstore.open("/data/kv") as store:
        store.put(b"chunk-hash", tierstore.KVCache(kv), namespace="llama3-8b")
        kv4 = store.get(b"chunk-hash", namespace="llama3-8b", layers=range(0, 4))
"""

from __future__ import annotations

import os
import sys
from typing import Any

from . import codecs
from .engine.options import parse_size
from .errors import (
    AccessDenied,
    CorruptionError,
    FormatVersionError,
    InvalidObject,
    NotFound,
    ReadOnlyError,
    StoreClosed,
    StoreFull,
    StoreIOError,
    StoreLocked,
    StoreNotFound,
    TierstoreError,
)
from .objects import Blob, KVCache, MLACache, ObjectInfo, Vectors
from .prefix import chunk_hashes
from .scoped import NamespaceHandle
from .store import Store
from .tiers import policy

sys.modules[__name__ + ".policy"] = policy  # `tierstore.policy` as before the tiers became a package

__version__ = "0.1.0"

__all__ = [
    "open", "Store", "NamespaceHandle", "KVCache", "MLACache", "Vectors", "Blob", "ObjectInfo", "chunk_hashes",
    "codecs", "policy", "parse_size",
    "TierstoreError", "AccessDenied", "NotFound", "StoreNotFound", "CorruptionError", "FormatVersionError", "StoreFull",
    "ReadOnlyError", "InvalidObject", "StoreLocked", "StoreClosed", "StoreIOError", "__version__",
]


def open(path: str | os.PathLike[str], *, create: bool = True, readonly: bool = False, durability: str = "sync",
         **options: Any) -> Store:
    """Open (or create) the store at ``path``.

    ``durability``: "sync" (a put returns once it survives power loss: one fdatasync),
    "group" (puts are made durable together by ``flush()`` or within ``group_commit_ms``),
    "none" (no fsync; survives a process crash, not power loss).  Any number of processes may
    open a store writable at once (SPEC.md §7.8); ``exclusive=True`` keeps other writers out.
    ``readonly=True`` opens without taking the writer lock; any number of read-only handles
    may coexist with the writers.  ``options``: see ``tierstore.engine.options.Options``
    (segment_bytes, group_commit_ms, group_commit_bytes, index_commit_ms, index_batch,
    lock_timeout, exclusive, header_copies, vector_extent_bytes, index_map_size); the memory
    tiers (dram_bytes, dram_admit, gpu_bytes, gpu_device, policy); the disk budget (ssd_bytes,
    retain, ssd_policy, downtier) and traces (trace_to, trace_bytes); codecs per namespace and
    kind (codecs); a remote tier (remote, remote_policy, remote_timeout, remote_connect_timeout,
    remote_retry_s, remote_queue).  docs/guide.md describes each.
    """
    return Store(path, create=create, readonly=readonly, durability=durability, **options)
