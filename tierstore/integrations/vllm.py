"""A vLLM v1 KV connector: prompts that share a stored prefix load it from tierstore instead of
recomputing it, in this process or in one that ran before a restart.

    vllm serve <model> --kv-transfer-config '{"kv_connector": "TierstoreConnector",
      "kv_role": "kv_both", "kv_connector_module_path": "tierstore.integrations.vllm",
      "kv_connector_extra_config": {"path": "/data/kv", "chunk_tokens": 256}}'

Options (``kv_connector_extra_config``): ``path`` (required), ``chunk_tokens`` (256; a multiple
of the block size), ``namespace`` ("vllm"), ``codec`` (None: lossless raw; e.g. "fp8"),
``durability`` ("group": saves become durable within ``group_commit_ms``), ``model_id`` (a
string that names the weights, e.g. a checkpoint digest, added to the fingerprint), and any
``tierstore.open`` option under ``store_options`` (e.g. ``{"ssd_bytes": "500GiB"}``).

How it maps vLLM's interface onto tierstore (SPEC.md §13 for the keys):

- Keys: the chained ``chunk_hashes`` of the prompt's token ids, salted with a fingerprint of the
  model (name, revision, dtype, KV cache dtype, attention kind), the tensor-parallel size and
  the rank: each rank stores the KV of its own heads under its own keys, so two models or two
  TP layouts never share an entry.  An MLA model's latent cache is the same on every rank:
  rank 0 stores it once (salt without the rank) and every rank loads it.
- Scheduler side: ``get_num_new_matched_tokens`` is ``match_prefix`` over every rank's keys
  (no side effects), whole chunks only, never the prompt's last token (vLLM recomputes it).
  ``build_connector_meta`` names, per request, the chunks to load (and which of their blocks:
  those vLLM's own prefix cache does not hold) and the prompt chunks this step completes (to
  save).  ``request_finished`` returns False: a save copies its blocks out during the step.
- Worker side: ``register_kv_caches`` reads each layer's paged layout from its tensor (paged.py).
  ``start_load_kv`` starts a thread that reads layer 0 of every chunk, scatters it into the
  blocks, then layer 1, ...; ``wait_for_layer_load(layer)`` waits for that layer only, so
  layer i+1 is read while layer i computes.  ``save_kv_layer`` gathers the chunk's blocks of
  that layer into a host buffer (the only time the forward pass waits);
  ``wait_for_save`` hands the buffers to a writer thread and returns.
- A chunk that cannot be read (evicted since the match, damaged: CorruptionError) is never
  loaded as KV: its blocks are reported by ``get_block_ids_with_load_errors`` and vLLM
  recomputes them or fails the request, as its ``kv_load_failure_policy`` says.

It uses only tierstore's public API and vLLM's connector interface.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

import tierstore

from .. import CorruptionError, KVCache, MLACache, NotFound, StoreIOError, TierstoreError, chunk_hashes
from .paged import PagedLayout, gather, scatter

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

_log = logging.getLogger("tierstore")
FINGERPRINT_VERSION = b"tierstore/vllm/1"

# One handle per store and process, shared by the scheduler side and the workers that live in
# the same process (vLLM's single-process executor): LMDB allows one environment per process.
_HANDLES: dict[str, list[Any]] = {}
_HANDLES_LOCK = threading.Lock()


def _acquire(path: str, options: dict[str, Any]) -> tierstore.Store:
    real = os.path.realpath(path)
    with _HANDLES_LOCK:
        entry = _HANDLES.get(real)
        if entry is None or entry[0].closed:
            entry = _HANDLES[real] = [tierstore.open(path, **options), 0]
        entry[1] += 1
        return entry[0]


def _release(store: tierstore.Store) -> None:
    with _HANDLES_LOCK:
        for real, entry in list(_HANDLES.items()):
            if entry[0] is store:
                entry[1] -= 1
                if entry[1] <= 0:
                    del _HANDLES[real]
                    store.close()
                return


def model_fingerprint(vllm_config: Any, *, rank: int | None, model_id: str | None = None) -> bytes:
    """The salt of one rank's chunk hashes: SHA-256 over the fingerprint version, the model
    (name, revision, dtype), the KV cache dtype, the attention kind, the tensor- and
    pipeline-parallel sizes and ``rank`` (None: shared by every rank, for MLA latents), and
    ``model_id``.  16 bytes."""
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    parts = [FINGERPRINT_VERSION, str(mc.model), str(getattr(mc, "revision", None)), str(mc.dtype),
             str(cc.cache_dtype), b"mla" if mc.use_mla else b"kv", str(pc.tensor_parallel_size),
             str(pc.pipeline_parallel_size), "shared" if rank is None else str(rank), str(model_id)]
    h = hashlib.sha256()
    for p in parts:
        b = p if isinstance(p, bytes) else p.encode()
        h.update(len(b).to_bytes(4, "little") + b)
    return h.digest()[:16]


@dataclass
class ChunkLoad:
    """Load one stored chunk into some of a request's blocks (``positions``: which of the
    chunk's blocks go into ``block_ids``)."""

    req_id: str
    keys: list[bytes]  # one per tensor-parallel rank (one shared key for MLA)
    block_ids: list[int]
    positions: list[int]


@dataclass
class ChunkSave:
    """Store the ``block_ids`` (a whole chunk) of a request computed in this step."""

    req_id: str
    keys: list[bytes]
    block_ids: list[int]


@dataclass
class TierstoreConnectorMetadata(KVConnectorMetadata):
    loads: list[ChunkLoad] = field(default_factory=list)
    saves: list[ChunkSave] = field(default_factory=list)


@dataclass
class _Tracked:
    """A request whose prompt chunks are not all saved yet (scheduler side)."""

    tokens: list[int]
    block_ids: list[int]
    next_chunk: int  # the first prompt chunk not yet saved (or known stored)


class TierstoreConnector(KVConnectorBase_V1):
    """vLLM's KV connector over a tierstore store (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        path = extra.get("path")
        if not path:
            raise ValueError("TierstoreConnector needs kv_connector_extra_config.path (the store's directory)")
        self._block_size = int(vllm_config.cache_config.block_size)
        self._chunk = int(extra.get("chunk_tokens", 256))
        if self._chunk <= 0 or self._chunk % self._block_size:
            raise ValueError(f"chunk_tokens={self._chunk} must be a positive multiple of the block size "
                             f"({self._block_size})")
        self._namespace = str(extra.get("namespace", "vllm"))
        self._codec = extra.get("codec")
        self._mla = bool(vllm_config.model_config.use_mla)
        tp = int(vllm_config.parallel_config.tensor_parallel_size)
        model_id = extra.get("model_id")
        ranks: list[int | None] = [None] if self._mla else list(range(tp))
        self._salts = [model_fingerprint(vllm_config, rank=r, model_id=model_id) for r in ranks]
        options = {"durability": extra.get("durability", "group"), **dict(extra.get("store_options") or {})}
        self._store = _acquire(str(path), options)
        # scheduler side
        self._hashes: dict[str, list[list[bytes]]] = {}  # per request: per rank, its chunk keys
        self._planned: dict[str, tuple[int, int]] = {}  # req -> tokens [start, end) to load
        self._tracked: dict[str, _Tracked] = {}
        # worker side
        self._rank = 0 if role == KVConnectorRole.SCHEDULER else self._worker_rank(extra)
        self._layers: list[tuple[str, Any, PagedLayout]] = []
        self._layer_index: dict[str, int] = {}
        self._loaded: list[threading.Event] = []
        self._load_thread: threading.Thread | None = None
        self._load_error: BaseException | None = None
        self._failed: set[int] = set()
        self._staged: list[tuple[ChunkSave, Any]] = []
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierstore-vllm-save")
        self._pending: list[Future] = []
        self.counters = {"chunks_loaded": 0, "chunks_saved": 0, "load_errors": 0, "save_errors": 0}

    @staticmethod
    def _worker_rank(extra: dict[str, Any]) -> int:
        if "tp_rank" in extra:
            return int(extra["tp_rank"])
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            return int(get_tensor_model_parallel_rank())
        except (AssertionError, ImportError, RuntimeError):  # no process group: a single rank
            return 0

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        return None  # any: the layout is read from each layer's tensor

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # loads and saves run between layers

    # -- scheduler side -------------------------------------------------------------------------

    def _keys(self, req_id: str, tokens: list[int]) -> list[list[bytes]]:
        keys = self._hashes.get(req_id)
        if keys is None:
            keys = [chunk_hashes(tokens, chunk_tokens=self._chunk, salt=s) for s in self._salts]
            self._hashes[req_id] = keys
        return keys

    def _chunk_keys(self, keys: list[list[bytes]], c: int) -> list[bytes]:
        return [k[c] for k in keys]

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        tokens = list(request.prompt_token_ids or [])
        usable = max(0, len(tokens) - 1) // self._chunk  # whole chunks, never the last prompt token
        if usable == 0:
            return 0, False
        keys = self._keys(request.request_id, tokens)
        matched = min(self._store.match_prefix(k[:usable], namespace=self._namespace) for k in keys)
        end = matched * self._chunk
        if end <= num_computed_tokens:
            return 0, False
        self._planned[request.request_id] = (num_computed_tokens, end)
        return end - num_computed_tokens, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            self._planned.pop(request.request_id, None)
            return
        start, _ = self._planned[request.request_id]
        self._planned[request.request_id] = (start, start + num_external_tokens)

    def _plan_loads(self, req_id: str, tokens: list[int], block_ids: list[int],
                    meta: TierstoreConnectorMetadata) -> int:
        """Loads of the planned token range; returns the first chunk not loaded."""
        start, end = self._planned.pop(req_id)
        keys = self._keys(req_id, tokens)
        bs, per = self._block_size, self._chunk // self._block_size
        for c in range(start // self._chunk, -(-end // self._chunk)):
            pos = [p for p in range(per) if start <= (c * per + p) * bs and (c * per + p + 1) * bs <= end]
            if pos:
                meta.loads.append(ChunkLoad(req_id, self._chunk_keys(keys, c),
                                            [block_ids[c * per + p] for p in pos], pos))
        return end // self._chunk

    def _plan_saves(self, req_id: str, t: _Tracked, computed: int, meta: TierstoreConnectorMetadata) -> None:
        """Saves of the prompt chunks computed by the end of this step (and not stored yet)."""
        per = self._chunk // self._block_size
        done = min(computed, len(t.tokens)) // self._chunk
        if done <= t.next_chunk:
            return
        keys = self._keys(req_id, t.tokens)
        todo = list(range(t.next_chunk, min(done, len(keys[0]))))
        have = self._store.contains_many([keys[0][c] for c in todo], namespace=self._namespace) if todo else []
        for c, stored in zip(todo, have):
            if not stored and len(t.block_ids) >= (c + 1) * per:
                meta.saves.append(ChunkSave(req_id, self._chunk_keys(keys, c), t.block_ids[c * per:(c + 1) * per]))
        t.next_chunk = done

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = TierstoreConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tokens = list(new.prompt_token_ids or [])
            block_ids = list(new.block_ids[0]) if new.block_ids else []
            first = 0
            if new.req_id in self._planned:
                first = self._plan_loads(new.req_id, tokens, block_ids, meta)
            t = self._tracked[new.req_id] = _Tracked(tokens, block_ids, first)
            self._plan_saves(new.req_id, t, new.num_computed_tokens + scheduled.get(new.req_id, 0), meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            t = self._tracked.get(req_id)
            if t is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # after a preemption: the whole block list, anew
                t.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                t.block_ids.extend(new_ids[0])
            if req_id in self._planned:  # a resumed request whose prefix loads again
                t.next_chunk = max(t.next_chunk, self._plan_loads(req_id, t.tokens, t.block_ids, meta))
            self._plan_saves(req_id, t, cached.num_computed_tokens[i] + scheduled.get(req_id, 0), meta)
            if t.next_chunk * self._chunk >= len(t.tokens) - len(t.tokens) % self._chunk:
                del self._tracked[req_id]  # every full prompt chunk handled
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        for d in (self._hashes, self._planned, self._tracked):
            d.pop(request.request_id, None)
        return False, None  # saves copied the blocks out during their step

    # -- worker side ----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = int(self._kv_cache_config.num_blocks) if self._kv_cache_config is not None else None
        self._layers = []
        for name, tensor in kv_caches.items():
            n = num_blocks if num_blocks is not None else int(tensor.shape[0])
            self._layers.append((name, tensor, PagedLayout.of(tensor, num_blocks=n, block_size=self._block_size,
                                                              mla=self._mla)))
        self._layer_index = {name: i for i, (name, _, _) in enumerate(self._layers)}

    def _key(self, keys: list[bytes]) -> bytes:
        return keys[0] if self._mla else keys[self._rank]

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, TierstoreConnectorMetadata)
        self._loaded = [threading.Event() for _ in self._layers]
        if not meta.loads:
            for e in self._loaded:
                e.set()
            return
        self._load_error = None
        self._load_thread = threading.Thread(target=self._load_layers, args=(list(meta.loads),),
                                             name="tierstore-vllm-load", daemon=True)
        self._load_thread.start()

    def _load_layers(self, loads: list[ChunkLoad]) -> None:
        """Layer by layer: every chunk's layer i into its blocks, then layer i's event."""
        failed: set[int] = set()
        bufs: dict[tuple[int, ...], Any] = {}
        try:
            for i, (_, tensor, layout) in enumerate(self._layers):
                for j, ld in enumerate(loads):
                    if j in failed:
                        continue
                    shape = layout.chunk_shape(self._chunk)
                    buf = bufs.get(shape)
                    if buf is None:
                        buf = bufs[shape] = torch.empty(shape, dtype=tensor.dtype,
                                                        pin_memory=tensor.device.type == "cuda")
                    try:
                        self._store.get(self._key(ld.keys), namespace=self._namespace, layers=i, out=buf[None])
                    except (NotFound, CorruptionError, StoreIOError) as e:  # evicted, damaged: recomputed
                        failed.add(j)
                        self._failed.update(ld.block_ids)
                        self.counters["load_errors"] += 1
                        _log.warning("tierstore: chunk %s not loaded (%s); vLLM recomputes its %d blocks",
                                     self._key(ld.keys).hex()[:16], e, len(ld.block_ids))
                        continue
                    scatter(tensor, layout, ld.block_ids, buf.to(tensor.device, non_blocking=True),
                            positions=ld.positions)
                if tensor.device.type == "cuda":
                    torch.cuda.current_stream(tensor.device).synchronize()
                self._loaded[i].set()
            self.counters["chunks_loaded"] += len(loads) - len(failed)
        except BaseException as e:  # handed to the forward pass by wait_for_layer_load
            self._load_error = e
        finally:
            for ev in self._loaded:
                ev.set()

    def wait_for_layer_load(self, layer_name: str) -> None:
        i = self._layer_index.get(layer_name)
        if i is None or i >= len(self._loaded):
            return
        self._loaded[i].wait()
        if self._load_error is not None:
            raise self._load_error

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, TierstoreConnectorMetadata)
        if not meta.saves or (self._mla and self._rank != 0):
            return
        i = self._layer_index.get(layer_name)
        if i is None:
            return
        _, _, layout = self._layers[i]
        if not self._staged:
            shape = (len(self._layers), *layout.chunk_shape(self._chunk))
            pin = kv_layer.device.type == "cuda"
            self._staged = [(s, torch.empty(shape, dtype=kv_layer.dtype, pin_memory=pin)) for s in meta.saves]
        for s, buf in self._staged:
            gather(kv_layer, layout, s.block_ids, buf[i])

    def wait_for_save(self) -> None:
        self._raise_save_error()
        if not self._staged:
            return
        if any(t.device.type == "cuda" for _, t, _ in self._layers):
            torch.cuda.synchronize()
        staged, self._staged = self._staged, []
        self._pending.append(self._writer.submit(self._write, staged))

    def _write(self, staged: list[tuple[ChunkSave, Any]]) -> None:
        kind = MLACache if self._mla else KVCache
        items = [(self._key(s.keys), kind(buf)) for s, buf in staged]
        try:
            self._store.put_many(items, namespace=self._namespace, codec=self._codec)
            self.counters["chunks_saved"] += len(items)
        except TierstoreError as e:  # a save that failed is a later miss, never an error of the request
            self.counters["save_errors"] += len(items)
            _log.warning("tierstore: %d chunks not saved: %s", len(items), e)

    def _raise_save_error(self) -> None:
        done = [f for f in self._pending if f.done()]
        self._pending = [f for f in self._pending if not f.done()]
        for f in done:
            f.result()  # anything but a TierstoreError is a bug: raised in the step that follows

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._load_thread is not None:
            self._load_thread.join()
        failed, self._failed = self._failed, set()
        return failed

    def flush(self) -> None:
        """Wait for every save handed to the writer, and make them durable."""
        for f in list(self._pending):
            f.result()
        self._pending = []
        self._store.flush()

    def shutdown(self) -> None:
        if self._store is None:
            return
        try:
            if self._load_thread is not None:
                self._load_thread.join()
            self.flush()
        finally:
            self._writer.shutdown(wait=True)
            _release(self._store)
            self._store = None  # type: ignore[assignment]
