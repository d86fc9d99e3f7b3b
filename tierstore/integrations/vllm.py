"""A vLLM v1 KV connector: prompts that share a stored prefix load it from tierstore instead of
recomputing it, in this process or in one that ran before a restart.

    vllm serve <model> --kv-transfer-config '{"kv_connector": "TierstoreConnector",
      "kv_role": "kv_both", "kv_connector_module_path": "tierstore.integrations.vllm",
      "kv_connector_extra_config": {"path": "/data/kv", "chunk_tokens": 256}}'

Options (``kv_connector_extra_config``): ``path`` (required), ``chunk_tokens`` (256; a multiple
of the block size), ``namespace`` ("vllm"), ``codec`` (None: lossless raw; e.g. "fp8"),
``durability`` ("group": saves become durable within ``group_commit_ms``), ``model_id`` (a
string that names the weights, e.g. a checkpoint digest, added to the fingerprint),
``max_pending_bytes`` ("2GiB": host memory of saves handed to the writer thread before a step
waits for the disk; one step also stages at most this much, and chunks past it are not saved:
saves hold at most twice this much host memory; a step's loads hold one buffer per chunk),
``tp_rank`` / ``pp_rank`` (this worker's ranks, when vLLM's process groups cannot say), and
any other ``tierstore.open`` option under ``store_options`` (e.g. ``{"ssd_bytes": "500GiB"}``).
``kv_role``: "kv_both" loads and saves, "kv_consumer" only loads, "kv_producer" only saves.

How it maps vLLM's interface onto tierstore (SPEC.md §13 for the keys):

- Keys: the chained ``chunk_hashes`` of the prompt's token ids, salted with a fingerprint
  (``model_fingerprint``: model name, revision, dtype, KV cache dtype, attention kind, tensor-
  and pipeline-parallel sizes, the worker's stage and rank, the KV cache's layer names,
  ``model_id``) and, per request, its LoRA adapter and ``cache_salt``: each worker stores the KV
  of its own heads of its own layers under its own keys, so two models, two parallel layouts,
  two adapters or two tenants never share an entry.  An MLA model's latent cache is the same on
  every tensor rank: rank 0 of each stage stores it once and every rank loads it.
- Scheduler side: ``get_num_new_matched_tokens`` is ``match_prefix`` over every rank's keys
  (it changes nothing in the store), whole chunks only, never the prompt's last token (vLLM recomputes it).
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
  recomputes them or fails the request, as its ``kv_load_failure_policy`` says; the saves of
  that step computed on top of it are dropped (other requests' are kept), and so are, with asynchronous
  scheduling or pipeline stages, the saves of chunks computed from those blocks in the steps
  vLLM built before it heard of the failure.  Chunks saved by the
  other tensor ranks in those steps (their loads succeeded, but their KV depends on the failed
  rank's through the layers' all-reduce) are deleted by every worker at the step after the
  scheduler hears of the failure (``update_connector_output``), and saved again once recomputed.

It uses only tierstore's public API and vLLM's connector interface.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import logging
import math
import operator
import os
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

import tierstore

from .. import CorruptionError, InvalidObject, KVCache, MLACache, TierstoreError, chunk_hashes
from ..names import check_namespace
from . import config_json, stable_json
from .paged import PagedLayer, PagedLayout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

_log = logging.getLogger("tierstore")
FINGERPRINT_VERSION = b"tierstore/vllm/3"  # 3 (2026-12-03): the loaded configuration

def model_fingerprint(vllm_config: Any, *, pp_rank: int, tp_rank: int | None, model_id: str | None = None,
                      layers: tuple[str, ...] = (), codec: str | None = None, epoch: int = 0) -> bytes:
    """The salt of one rank's chunk hashes: SHA-256 over the fingerprint version, the model
    (name, revision, dtype, quantization, config overrides, its configuration as loaded less
    the fields that do not change the KV), the KV cache dtype, the attention
    kind, the tensor- and pipeline-parallel sizes, the pipeline stage ``pp_rank`` (its layers),
    the tensor-parallel ``tp_rank`` (its heads; None: shared by every tensor rank, for MLA
    latents), ``model_id``, the names of the KV cache's layers in the order a chunk stores them
    (a drafter's layers added change what a chunk holds), the codec (a lossy entry is never
    loaded by a deployment that stores losslessly) and ``epoch`` (``reset_cache``).  16 bytes."""
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    overrides = getattr(mc, "hf_overrides", None)
    # the model's configuration as loaded (config.json and overrides): a config.json edited at the
    # same path (rope_scaling, say) changes the KV, and so the keys
    hf = getattr(mc, "hf_config", None)
    config = config_json(hf.to_dict() if hasattr(hf, "to_dict") else {})
    parts = [FINGERPRINT_VERSION, str(mc.model), str(getattr(mc, "revision", None)), str(mc.dtype),
             str(getattr(mc, "quantization", None)),
             stable_json(overrides),
             config,
             str(cc.cache_dtype), b"mla" if mc.use_mla else b"kv", str(pc.tensor_parallel_size),
             str(pc.pipeline_parallel_size), f"pp{pp_rank}", "tp-shared" if tp_rank is None else f"tp{tp_rank}",
             str(model_id), "\n".join(layers), str(codec), f"epoch{epoch}"]
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
    keys: list[bytes]  # one per worker (pipeline stage x tensor rank; one per stage for MLA)
    block_ids: list[int]
    positions: list[int]


@dataclass
class ChunkSave:
    """Store the ``block_ids`` (a whole chunk) of a request computed in this step; ``prefix``:
    the blocks of the request's chunks before it, whose KV this chunk's was computed from."""

    req_id: str
    keys: list[bytes]
    block_ids: list[int]
    prefix: list[int] = field(default_factory=list)

    def reads(self, blocks: set[int]) -> bool:
        """Whether this chunk's KV was computed from (or is) any of ``blocks``."""
        return not blocks.isdisjoint(self.prefix) or not blocks.isdisjoint(self.block_ids)


@dataclass
class TierstoreConnectorMetadata(KVConnectorMetadata):
    loads: list[ChunkLoad] = field(default_factory=list)
    saves: list[ChunkSave] = field(default_factory=list)
    forget: list[list[bytes]] = field(default_factory=list)  # chunks saved on top of a failed load: delete


@dataclass
class _Tracked:
    """A request the scheduler side follows from its first schedule to ``request_finished``."""

    tokens: list[int]
    block_ids: list[int]
    next_chunk: int  # the first prompt chunk not yet saved (or known stored)


# vLLM's KV cache dtypes held as raw bytes (torch.uint8) that are plain fp8 values
_FP8_CACHE = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
# KV cache dtypes whose pool holds plain values of a float dtype (others pack scales or bits)
# the keys of kv_connector_extra_config this connector reads (docs/integrations.md)
EXTRA_KEYS = ("path", "chunk_tokens", "namespace", "codec", "durability", "model_id", "max_pending_bytes", "tp_rank",
              "pp_rank", "store_options")
UNLOADABLE_S = 300.0  # a consumer does not match a chunk whose load failed for this long (seconds)
UNLOADABLE_MAX = 100_000  # such chunks remembered, at most (the oldest are forgotten first)
_PLAIN_CACHE = frozenset({"auto", "half", "float16", "bfloat16", "float", "float32", "fp8_inc"})


def _check_spec(spec: Any) -> None:
    """Refuse a KV cache group other than plain full attention or MLA: a sliding-window or
    chunked-local group hands the connector block lists with the null block where tokens left
    the window (and frees blocks as they leave it), a recurrent one holds no per-token KV."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    inner = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs: one spec per layer
    for one in (inner.values() if isinstance(inner, dict) else [spec]):
        if type(one) not in (FullAttentionSpec, MLAAttentionSpec):
            raise ValueError(f"TierstoreConnector stores full-attention and MLA KV caches only; this model has a "
                             f"{type(one).__name__} layer group (sliding window, chunked local, recurrent or another "
                             f"kind whose blocks are not a plain prefix)")


class TierstoreConnector(KVConnectorBase_V1):
    """vLLM's KV connector over a tierstore store (see the module docstring)."""

    _cache_hit_source = CacheHitSource.DISK  # vLLM's metrics: prompt tokens whose KV came from here

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        unknown = sorted(set(extra) - set(EXTRA_KEYS))
        if unknown:  # a typo would otherwise fall back to a default without a word
            close = {k: difflib.get_close_matches(k, EXTRA_KEYS, n=1) for k in unknown}
            raise ValueError("TierstoreConnector: unknown kv_connector_extra_config keys: " + ", ".join(
                f"{k!r}" + (f" (did you mean {close[k][0]!r}?)" if close[k] else "") for k in unknown)
                + f"; known: {', '.join(EXTRA_KEYS)}")
        path = extra.get("path")
        if not path:
            raise ValueError("TierstoreConnector needs kv_connector_extra_config.path (the store's directory)")
        if not isinstance(path, (str, os.PathLike)):  # (a number was opened as a directory of that name, here)
            raise ValueError(f"kv_connector_extra_config.path is the store's directory, a string; got "
                             f"{type(path).__name__} {path!r}")
        self._block_size = int(vllm_config.cache_config.block_size)
        self._chunk = extra.get("chunk_tokens", 256)
        if type(self._chunk) is not int or self._chunk <= 0 or self._chunk % self._block_size:
            raise ValueError(f"chunk_tokens={self._chunk} must be a positive multiple of the block size "
                             f"({self._block_size})")
        pc = vllm_config.parallel_config
        for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
            if int(getattr(pc, name, 1) or 1) > 1:
                raise ValueError(f"TierstoreConnector does not support {name} > 1 (tokens sharded across ranks)")
        cache_dtype = str(vllm_config.cache_config.cache_dtype)
        if cache_dtype not in _PLAIN_CACHE and cache_dtype not in _FP8_CACHE:
            raise ValueError(f"TierstoreConnector stores plain KV values; kv_cache_dtype={cache_dtype!r} is not one "
                             f"(supported: {', '.join(sorted(_PLAIN_CACHE | set(_FP8_CACHE)))})")
        if self._kv_transfer_config.kv_load_failure_policy == "fail":
            _log.warning("tierstore: kv_load_failure_policy is 'fail': a chunk evicted or damaged between its match "
                         "and its load fails the request; 'recompute' recomputes its blocks instead")
        self._fp8 = _FP8_CACHE.get(cache_dtype)
        self._namespace = extra.get("namespace", "vllm")
        try:  # checked now: a bad name would fail the scheduler at the first request
            check_namespace(self._namespace)
        except TierstoreError as e:
            raise ValueError(f"kv_connector_extra_config.namespace: {e}") from None
        self._mla = bool(vllm_config.model_config.use_mla)
        self._codec = extra.get("codec")
        if self._codec is not None:  # checked now: a codec refused at each save would store nothing, quietly
            try:
                choice = tierstore.codecs.parse(str(self._codec), "mla" if self._mla else "kv")
            except TierstoreError as e:
                raise ValueError(f"kv_connector_extra_config.codec: {e}") from None
            if not choice.codec.lossless and cache_dtype.startswith("fp8"):
                raise ValueError(f"codec {self._codec!r} is lossy; this KV cache is already fp8 ({cache_dtype}): "
                                 f"use a lossless codec (zstd) or none")
        for group in getattr(kv_cache_config, "kv_cache_groups", None) or ():
            _check_spec(group.kv_cache_spec)
        kv_role = self._kv_transfer_config.kv_role
        self._loads = kv_role in ("kv_both", "kv_consumer")
        self._saves = kv_role in ("kv_both", "kv_producer")
        self._tp = int(pc.tensor_parallel_size)
        self._pp = int(pc.pipeline_parallel_size)
        for name, size in (("tp_rank", self._tp), ("pp_rank", self._pp)):  # checked now, in both roles
            rank = extra.get(name)
            if rank is None:
                continue
            try:  # (an int of any kind -- JSON's, numpy's -- but not a bool or a string)
                value = operator.index(rank) if not isinstance(rank, bool) else None
            except TypeError:
                value = None
            if value is None or not 0 <= value < size:
                raise ValueError(f"kv_connector_extra_config.{name} is this worker's rank, an int in [0, {size}) "
                                 f"(the parallel size is {size}); got {rank!r}")
            extra[name] = value
        self._vllm_config, self._model_id = vllm_config, extra.get("model_id")
        # the order a chunk stores its layers in (register_kv_caches follows it)
        self._layer_names = tuple(name for g in getattr(kv_cache_config, "kv_cache_groups", None) or ()
                                  for name in g.layer_names)
        self._epoch = 0
        self._salts = self._salts_of(0)
        raw_options = extra.get("store_options") or {}
        if not isinstance(raw_options, dict):
            raise ValueError(f"kv_connector_extra_config.store_options must be a dict of tierstore.open options "
                             f"(e.g. {{\"ssd_bytes\": \"500GiB\"}}), got {type(raw_options).__name__} "
                             f"{raw_options!r}")
        store_options = dict(raw_options)
        if "durability" in store_options:
            raise ValueError("give durability as kv_connector_extra_config.durability, not in store_options")
        if store_options.get("readonly") and self._saves:
            raise ValueError(f"store_options.readonly: a read-only store cannot save, and kv_role {kv_role!r} saves "
                             "what it computes; use kv_role \"kv_consumer\" to load only")
        options = {"durability": extra.get("durability", "group"), **store_options}
        # the scheduler side and an in-process worker each open a handle: writable handles on one store
        # in one process share its engine (tierstore.open), so this costs no second LMDB environment
        self._store = tierstore.open(str(path), **options)
        # scheduler side
        self._hashes: dict[str, list[list[bytes]]] = {}  # per request: per worker, its chunk keys
        self._planned: dict[str, tuple[int, int]] = {}  # req -> tokens [start, end) to load
        self._tracked: dict[str, _Tracked] = {}
        # the loads and saves of the last steps built (2 with asynchronous scheduling: vLLM builds a step before
        # it hears how the one before ended), and the chunks the next step's workers delete
        # steps in flight: vLLM builds up to this many before it hears how the oldest ended (async
        # scheduling, pipeline stages)
        self._in_flight = max(1, int(getattr(vllm_config, "max_concurrent_batches", 1) or 1))
        self._recent: deque[TierstoreConnectorMetadata] = deque(maxlen=self._in_flight)
        self._to_forget: list[list[bytes]] = []
        # a consumer's chunks (their keys on every worker) whose load failed, and when: not matched
        # for UNLOADABLE_S (a worker deletes a damaged entry, but over a read-only store it cannot,
        # and the entry would be matched, and fail its load, for every later request with that
        # prefix; a role that saves recomputes and saves it again, and an error that passes --
        # an I/O error -- must not keep a sound chunk from matching for good)
        self._unloadable: dict[tuple[bytes, ...], float] = {}
        # worker side
        self._tp_rank = 0
        self._worker = 0 if role == KVConnectorRole.SCHEDULER else self._worker_index(extra)
        self._layers: list[tuple[str, Any, PagedLayer]] = []
        self._layer_index: dict[str, int] = {}
        self._loaded: list[threading.Event] = []
        self._cuda_loaded: list[Any] = []  # per layer: a CUDA event recorded after its scatters
        self._load_thread: threading.Thread | None = None
        self._load_error: BaseException | None = None
        self._load_stream: Any = None
        self._failed: set[int] = set()
        self._failed_lock = threading.Lock()
        self._step_failed = False  # a load of this step failed: its saves may hold KV computed on garbage
        # per step in flight, the blocks whose load failed in it: the steps vLLM built before it heard
        # of a failure compute from those blocks (for any request whose prefix holds them) on garbage
        self._bad_steps: deque[set[int]] = deque([set()], maxlen=self._in_flight)
        self._staged_meta: Any = None
        self._staged: list[tuple[ChunkSave, Any]] = []
        self._staged_layers: set[int] = set()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierstore-vllm-save")
        self._pending: list[tuple[Future, int]] = []  # saves handed to the writer, and their pinned bytes
        self._max_pending = int(tierstore.parse_size(extra.get("max_pending_bytes", "2GiB"), "max_pending_bytes"))
        self._warned_staging = False
        self.last_loads: list[ChunkLoad] = []  # the loads of the last step with any (for checks)
        self.counters = {"chunks_loaded": 0, "chunks_saved": 0, "load_errors": 0, "save_errors": 0,
                         "saves_dropped": 0, "saves_forgotten": 0}

    def _salts_of(self, epoch: int) -> list[bytes]:
        """One salt per worker, in the order ``_worker_index`` gives: stage-major, then tensor rank."""
        return [model_fingerprint(self._vllm_config, pp_rank=p, tp_rank=None if self._mla else t,
                                  model_id=self._model_id, layers=self._layer_names,
                                  codec=None if self._codec is None else str(self._codec), epoch=epoch)
                for p in range(self._pp) for t in ([None] if self._mla else range(self._tp))]

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save that does not happen is a later miss

    def reset_cache(self) -> bool:
        """vLLM resets its caches (``pause_generation(clear_cache=True)``, e.g. after a weight
        update): from now on this process stores and matches under a new epoch of the
        fingerprint, so nothing stored before is loaded again by it.  The epoch lives in this
        process only: a restarted server is told apart by ``model_id`` (or the model's name and
        revision), as always."""
        self._epoch += 1
        self._salts = self._salts_of(self._epoch)
        self._hashes.clear()
        self._unloadable.clear()
        return True

    @property
    def store(self) -> tierstore.Store:
        """The store handle this connector uses (one per store and process, shared)."""
        return self._store

    def _worker_index(self, extra: dict[str, Any]) -> int:
        """This worker's place in ``_salts``: stage-major, then tensor rank (MLA: the stage).
        The ranks come from vLLM's process groups; ``tp_rank`` / ``pp_rank`` of the extra config
        only where those cannot say (a single worker without them is rank 0)."""
        try:
            from vllm.distributed.parallel_state import (
                get_pp_group,
                get_tensor_model_parallel_rank,
                get_tensor_model_parallel_world_size,
            )

            if int(get_tensor_model_parallel_world_size()) != self._tp or int(get_pp_group().world_size) != self._pp:
                raise RuntimeError("vLLM's process groups are not this configuration's")
            tp_rank, pp_rank = int(get_tensor_model_parallel_rank()), int(get_pp_group().rank_in_group)
        except (AssertionError, AttributeError, ImportError, RuntimeError):  # no process group
            tp_rank, pp_rank = extra.get("tp_rank"), extra.get("pp_rank")  # (checked in __init__)
            if (tp_rank is None and self._tp > 1) or (pp_rank is None and self._pp > 1):
                raise ValueError(f"TierstoreConnector cannot tell this worker's ranks (tensor parallel {self._tp}, "
                                 f"pipeline parallel {self._pp}): vLLM's process groups are not set up; give "
                                 f"kv_connector_extra_config tp_rank and pp_rank") from None
            tp_rank, pp_rank = tp_rank or 0, pp_rank or 0
        if not (0 <= tp_rank < self._tp and 0 <= pp_rank < self._pp):
            raise ValueError(f"TierstoreConnector: ranks tp {tp_rank} / pp {pp_rank} outside the parallel sizes "
                             f"{self._tp} / {self._pp}")
        self._tp_rank = tp_rank
        return pp_rank if self._mla else pp_rank * self._tp + tp_rank

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        return None  # any: the layout is read from each layer's tensor

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # loads and saves run between layers

    # -- scheduler side -------------------------------------------------------------------------

    def _request_salt(self, request: Any) -> bytes | None:
        """What else the KV of a request depends on besides its tokens (vLLM's own block hashes
        add the same): the LoRA adapter and the cache salt.  None: not cacheable here (inputs
        other than tokens, e.g. images, whose content the token ids do not carry)."""
        if getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) is not None:
            return None
        parts = []
        lora = getattr(request, "lora_request", None)
        if lora is not None:
            parts.append(f"lora:{getattr(lora, 'lora_name', '')}:{getattr(lora, 'lora_int_id', '')}:"
                         f"{getattr(lora, 'lora_path', '')}")
        salt = getattr(request, "cache_salt", None)
        if salt:
            parts.append(f"salt:{salt}")
        return "\x00".join(parts).encode()

    def _keys_for(self, request: Any) -> list[list[bytes]] | None:
        keys = self._hashes.get(request.request_id)
        if keys is None or len(request.prompt_token_ids or ()) >= (len(keys[0]) + 1) * self._chunk:
            # (new, or a streaming session's request whose prompt grew by a chunk or more)
            extra = self._request_salt(request)
            if extra is None:
                return None
            tokens = list(request.prompt_token_ids or [])
            keys = [chunk_hashes(tokens, chunk_tokens=self._chunk, salt=s + extra) for s in self._salts]
            self._hashes[request.request_id] = keys
            t = self._tracked.get(request.request_id)
            if t is not None:  # (a streaming session's new input: its chunks are saved once computed)
                t.tokens = tokens
        return keys

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        tokens = request.prompt_token_ids or []
        usable = max(0, len(tokens) - 1) // self._chunk  # whole chunks, never the last prompt token
        keys = self._keys_for(request) if len(tokens) >= self._chunk else None  # (saved even if never loaded)
        if not keys or not usable or not self._loads:
            return 0, False
        matched = min(self._store.match_prefix(k[:usable], namespace=self._namespace) for k in keys)
        if self._unloadable:  # the prefix ends before a chunk whose load failed lately
            now = time.monotonic()
            matched = next((c for c in range(matched)
                            if self._unloadable.get(tuple(k[c] for k in keys), now) > now), matched)
        end = matched * self._chunk
        if end <= num_computed_tokens:
            return 0, False
        self._planned[request.request_id] = (num_computed_tokens, end)
        return end - num_computed_tokens, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        # a streaming session's next input is asked no match: its keys anew (or first, when its
        # first input was shorter than a chunk)
        if request.request_id in self._hashes or len(request.prompt_token_ids or ()) >= self._chunk:
            self._keys_for(request)
        if num_external_tokens <= 0:
            self._planned.pop(request.request_id, None)
            return
        start, _ = self._planned[request.request_id]
        self._planned[request.request_id] = (start, start + num_external_tokens)

    def _plan_loads(self, req_id: str, block_ids: list[int], meta: TierstoreConnectorMetadata) -> int:
        """Loads of the planned token range; returns the first chunk not loaded."""
        start, end = self._planned.pop(req_id)
        keys = self._hashes[req_id]
        bs, per = self._block_size, self._chunk // self._block_size
        for c in range(start // self._chunk, -(-end // self._chunk)):
            pos = [p for p in range(per) if start <= (c * per + p) * bs and (c * per + p + 1) * bs <= end]
            if pos:
                meta.loads.append(ChunkLoad(req_id, [k[c] for k in keys], [block_ids[c * per + p] for p in pos], pos))
        return end // self._chunk

    def _plan_saves(self, req_id: str, t: _Tracked, computed: int, meta: TierstoreConnectorMetadata) -> None:
        """Saves of the prompt chunks computed by the end of this step that some worker lacks
        (once per step: requests sharing a prefix compute the same chunks)."""
        keys = self._hashes.get(req_id)
        per = self._chunk // self._block_size
        done = min(computed, len(t.tokens)) // self._chunk
        if keys is None or done <= t.next_chunk or not self._saves:
            return
        todo = list(range(t.next_chunk, min(done, len(keys[0]))))
        have = [self._store.contains_many([k[c] for c in todo], namespace=self._namespace) for k in keys]
        planned = {tuple(sv.keys) for sv in meta.saves}
        for i, c in enumerate(todo):
            chunk_keys = [k[c] for k in keys]
            if not all(h[i] for h in have) and len(t.block_ids) >= (c + 1) * per and tuple(chunk_keys) not in planned:
                planned.add(tuple(chunk_keys))
                meta.saves.append(ChunkSave(req_id, chunk_keys, t.block_ids[c * per:(c + 1) * per],
                                            t.block_ids[:c * per]))
        t.next_chunk = done

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = TierstoreConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tokens = list(new.prompt_token_ids or [])
            block_ids = list(new.block_ids[0]) if new.block_ids else []
            first = self._plan_loads(new.req_id, block_ids, meta) if new.req_id in self._planned else 0
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
                t.next_chunk = max(t.next_chunk, self._plan_loads(req_id, t.block_ids, meta))
            self._plan_saves(req_id, t, cached.num_computed_tokens[i] + scheduled.get(req_id, 0), meta)
        meta.forget, self._to_forget = self._to_forget, []
        self._recent.append(meta)
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        """Blocks that failed to load (on any worker) are recomputed by vLLM: their chunks are
        saved again once computed (the worker deleted a damaged entry; an evicted one is gone).
        Chunks saved in the steps that computed from those blocks -- by the other tensor ranks,
        whose own loads succeeded, and with asynchronous scheduling in the step vLLM built
        before it heard of the failure -- are deleted by every worker at the next step, so that
        their recomputed KV is saved in their place."""
        bad = set(getattr(connector_output, "invalid_block_ids", None) or ())
        if not bad:
            return
        for meta in self._recent:
            self._to_forget += [sv.keys for sv in meta.saves if sv.reads(bad)]
        failed = [ld for meta in self._recent for ld in meta.loads if not bad.isdisjoint(ld.block_ids)]
        if not self._saves:
            until = time.monotonic() + UNLOADABLE_S
            for ld in failed:
                self._unloadable.pop(tuple(ld.keys), None)  # (re-inserted last: the oldest go first)
                self._unloadable[tuple(ld.keys)] = until
            while len(self._unloadable) > UNLOADABLE_MAX:
                del self._unloadable[next(iter(self._unloadable))]
        owners = {ld.req_id for ld in failed}
        per = self._chunk // self._block_size
        for req_id, t in self._tracked.items():
            hit = [i for i, b in enumerate(t.block_ids) if b in bad]
            if not hit:
                continue
            if req_id in owners and t.next_chunk != sys.maxsize:  # vLLM recomputes from the first failed block
                t.next_chunk = min(t.next_chunk, hit[0] // per)
            else:
                # it shares a failed block (vLLM's prefix cache) that its owner recomputes: what this
                # request computed on top of it meanwhile, vLLM keeps -- never saved from here on
                t.next_chunk = sys.maxsize  # (nor a chunk a streaming session adds later: it reads these)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        for d in (self._hashes, self._planned, self._tracked):
            d.pop(request.request_id, None)
        return False, None  # saves copied the blocks out during their step

    # -- worker side ----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = int(self._kv_cache_config.num_blocks) if self._kv_cache_config is not None else None
        self._layers = []
        order = {name: i for i, name in enumerate(self._layer_names)}  # the order the fingerprint names
        for name, tensor in sorted(kv_caches.items(), key=lambda item: order.get(item[0], len(order))):
            if tensor.dtype == torch.uint8 and self._fp8 is not None:  # fp8 values held as bytes
                tensor = tensor.view(getattr(torch, self._fp8))
            n = num_blocks if num_blocks is not None else int(tensor.shape[0])
            layout = PagedLayout.of(tensor, num_blocks=n, block_size=self._block_size, mla=self._mla)
            self._layers.append((name, tensor, PagedLayer(tensor, layout)))
        dtypes = {str(tensor.dtype) for _, tensor, _ in self._layers}
        if len(dtypes) > 1:
            raise ValueError(f"TierstoreConnector stores a chunk's layers as one object; these layers differ "
                             f"in dtype ({sorted(dtypes)}, e.g. --kv-cache-dtype-skip-layers)")
        shapes = {paged.layout.chunk_shape(self._chunk) for _, _, paged in self._layers}
        if len(shapes) > 1:
            raise ValueError(f"TierstoreConnector stores a chunk's layers as one object; these layers differ "
                             f"in shape ({sorted(shapes)})")
        self._layer_index = {name: i for i, (name, _, _) in enumerate(self._layers)}
        if self._saves and self._layers:  # (a budget under one chunk would drop every save, quietly)
            _, tensor, paged = self._layers[0]
            chunk_bytes = len(self._layers) * math.prod(paged.layout.chunk_shape(self._chunk)) * tensor.element_size()
            if self._max_pending < chunk_bytes:
                raise ValueError(f"kv_connector_extra_config.max_pending_bytes={self._max_pending} is less than one "
                                 f"chunk of this model ({chunk_bytes} bytes: {self._chunk} tokens of "
                                 f"{len(self._layers)} layers), so no chunk could ever be saved; raise it, or lower "
                                 f"chunk_tokens")

    def _key(self, keys: list[bytes]) -> bytes:
        return keys[self._worker]

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """A step begins: vLLM binds its metadata first, then runs the forward pass, and calls
        ``start_load_kv`` before it (a step with loads) or after it (without).  So what belongs
        to the step's start is done here: saves a step staged without reaching ``wait_for_save``
        are discarded, a new set of failed blocks begins, and the chunks the scheduler names
        in ``forget`` are deleted before any ``save_kv_layer`` checks what is stored."""
        super().bind_connector_metadata(connector_metadata)
        if self._load_thread is not None:  # (the last step's: reported, or finished now)
            self._load_thread.join()
            self._load_thread = None
        if self._staged:
            self.counters["saves_dropped"] += len(self._staged)
            self._staged, self._staged_layers, self._staged_meta = [], set(), None
        with self._failed_lock:
            self._bad_steps.append(set())
        meta = connector_metadata
        if isinstance(meta, TierstoreConnectorMetadata) and meta.forget and self._saves and \
                not (self._mla and self._tp_rank != 0):
            self._forget_saved(meta.forget)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._load_thread is not None:  # the last step's loads: all waited for, or finished now
            self._load_thread.join()
            self._load_thread = None
        self._load_error = None
        self._step_failed = False
        meta = self._get_connector_metadata()
        assert isinstance(meta, TierstoreConnectorMetadata)
        events = [threading.Event() for _ in self._layers]
        self._loaded, self._cuda_loaded = events, [None] * len(self._layers)
        if not meta.loads or not self._layers:
            for e in events:
                e.set()
            return
        start = None
        if self._layers[0][1].device.type == "cuda":  # after what the compute stream queued (block zeroing)
            start = torch.cuda.Event()
            start.record(torch.cuda.current_stream(self._layers[0][1].device))
        self.last_loads = list(meta.loads)
        self._load_thread = threading.Thread(target=self._load_layers, args=(list(meta.loads), events, start),
                                             name="tierstore-vllm-load", daemon=True)
        self._load_thread.start()

    def _load_layers(self, loads: list[ChunkLoad], events: list[threading.Event], start: Any) -> None:
        """Layer by layer: every chunk's layer i into its blocks, then layer i's event.  Each chunk
        has its own host buffer; on a GPU the copies run on a stream of their own, after ``start``,
        and a buffer is refilled only once the copy out of it (one layer earlier) completed."""
        failed: set[int] = set()
        bufs: list[Any] = [None] * len(loads)
        cuda = self._layers[0][1].device.type == "cuda"
        stream, prev = None, None
        try:
            if cuda:
                if self._load_stream is None:
                    self._load_stream = torch.cuda.Stream(self._layers[0][1].device)
                stream = self._load_stream
                stream.wait_event(start)
            for i, (_, tensor, paged) in enumerate(self._layers):
                if prev is not None:
                    prev.synchronize()  # the last layer's host-to-device copies: done with the buffers
                with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
                    for j, ld in enumerate(loads):
                        if j in failed:
                            continue
                        if bufs[j] is None:
                            bufs[j] = torch.empty(paged.layout.chunk_shape(self._chunk), dtype=tensor.dtype,
                                                  pin_memory=cuda)
                        try:
                            self._store.get(self._key(ld.keys), namespace=self._namespace, layers=i, out=bufs[j][None])
                        except TierstoreError as e:
                            # evicted since the match, damaged, stored with other layers: recomputed, never loaded
                            failed.add(j)
                            with self._failed_lock:
                                self._failed.update(ld.block_ids)
                                self._bad_steps[-1].update(ld.block_ids)
                                self._step_failed = True
                            self.counters["load_errors"] += 1
                            _log.warning("tierstore: chunk %s not loaded (%s); its %d blocks are recomputed (or the "
                                         "request fails: kv_load_failure_policy)", self._key(ld.keys).hex()[:16], e,
                                         len(ld.block_ids))
                            if isinstance(e, (CorruptionError, InvalidObject)):  # damaged for good: never matched again
                                self._forget(self._key(ld.keys))
                            continue
                        src = bufs[j].to(tensor.device, non_blocking=True) if cuda else bufs[j]
                        paged.scatter(ld.block_ids, src, positions=ld.positions)
                    if cuda:
                        prev = torch.cuda.Event()
                        prev.record(stream)
                        self._cuda_loaded[i] = prev
                events[i].set()
            self.counters["chunks_loaded"] += len(loads) - len(failed)
        except BaseException as e:  # handed to the forward pass by wait_for_layer_load
            self._load_error = e
        finally:
            for ev in events:
                ev.set()

    def _forget_saved(self, forget: list[list[bytes]]) -> None:
        """Delete this worker's entries of chunks saved on top of a failed load (``forget`` of the
        metadata), once every save handed to the writer has landed (one of them may be such a
        chunk): an entry computed on garbage must never outlive the step that learns of it."""
        for f, _ in self._pending:
            with contextlib.suppress(TierstoreError):  # (a failed save: nothing to delete)
                f.result()
        self._pending = []
        keys = list(dict.fromkeys(self._key(k) for k in forget))
        try:
            gone = sum(self._store.delete_many(keys, namespace=self._namespace))
        except TierstoreError as e:
            _log.warning("tierstore: could not delete %d chunks saved on top of a failed load: %s", len(keys), e)
            return
        self.counters["saves_forgotten"] += gone

    def _forget(self, key: bytes) -> None:
        """Delete an entry that cannot be loaded (damaged, or stored with other layers), so later
        prompts recompute and save it again instead of matching it forever."""
        try:
            self._store.delete(key, namespace=self._namespace)
        except TierstoreError as e:
            _log.warning("tierstore: could not delete the unreadable chunk %s: %s", key.hex()[:16], e)

    def wait_for_layer_load(self, layer_name: str) -> None:
        i = self._layer_index.get(layer_name)
        if i is None or i >= len(self._loaded):
            return
        self._loaded[i].wait()
        if self._load_error is not None:
            raise self._load_error
        ev = self._cuda_loaded[i]
        if ev is not None:  # the compute stream waits for the copies, the host does not
            torch.cuda.current_stream(self._layers[i][1].device).wait_event(ev)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, TierstoreConnectorMetadata)
        if not meta.saves or (self._mla and self._tp_rank != 0):  # an MLA latent: stored by tensor rank 0 only
            return
        i = self._layer_index.get(layer_name)
        if i is None:
            return
        _, tensor, paged = self._layers[i]
        if meta is not self._staged_meta:  # the step's first layer (a step without wait_for_save leaves nothing)
            self._staged, self._staged_layers, self._staged_meta = [], set(), meta
            with self._failed_lock:  # (this step's own failures: _step_failed drops all of its saves)
                bad = set().union(*self._bad_steps) if self._in_flight > 1 else set()
            saves = [sv for sv in meta.saves if not (bad and sv.reads(bad))]
            self.counters["saves_dropped"] += len(meta.saves) - len(saves)
            keys = [self._key(sv.keys) for sv in saves]
            have = self._store.contains_many(keys, namespace=self._namespace)
            shape = (len(self._layers), *paged.layout.chunk_shape(self._chunk))
            pin = tensor.device.type == "cuda"
            todo = [sv for sv, h in zip(saves, have) if not h]
            fit = self._max_pending // max(1, math.prod(shape) * tensor.element_size())
            if len(todo) > fit:  # one step stages at most max_pending_bytes: the rest is a later miss
                self.counters["saves_dropped"] += len(todo) - fit
                if not self._warned_staging:
                    self._warned_staging = True
                    _log.warning("tierstore: a step completed %d chunks to save, %d fit in max_pending_bytes=%d; "
                                 "the others are not saved (raise max_pending_bytes to keep them)",
                                 len(todo), fit, self._max_pending)
                todo = todo[:fit]
            self._staged = [(sv, torch.empty(shape, dtype=tensor.dtype, pin_memory=pin)) for sv in todo]
        self._staged_layers.add(i)
        for sv, buf in self._staged:
            if tensor.device.type == "cuda":  # gathered on the device, then one copy to pinned memory
                tmp = paged.gather(sv.block_ids, torch.empty(buf.shape[1:], dtype=tensor.dtype, device=tensor.device))
                buf[i].copy_(tmp, non_blocking=True)
            else:
                paged.gather(sv.block_ids, buf[i])

    def wait_for_save(self) -> None:
        self._raise_save_error()
        staged, layers = self._staged, self._staged_layers
        self._staged, self._staged_layers = [], set()
        if not staged:
            return
        if len(layers) != len(self._layers):  # a layer was not handed over this step: its buffer holds garbage
            self.counters["saves_dropped"] += len(staged)
            _log.warning("tierstore: %d chunks not saved: %d of %d layers were seen this step", len(staged),
                         len(layers), len(self._layers))
            return
        if self._load_thread is not None:
            self._load_thread.join()  # every layer was waited for: it is done
        if self._step_failed:  # chunks computed in this step from blocks whose load failed: not saved
            with self._failed_lock:
                bad = set(self._bad_steps[-1])
            kept = [(sv, buf) for sv, buf in staged if not sv.reads(bad)]
            if len(kept) < len(staged):
                self.counters["saves_dropped"] += len(staged) - len(kept)
                _log.warning("tierstore: %d chunks of this step not saved: they were computed from blocks whose "
                             "load failed", len(staged) - len(kept))
            staged = kept
            if not staged:
                return
        copied = None
        if any(t.device.type == "cuda" for _, t, _ in self._layers):  # the writer waits for the copies, not us
            copied = torch.cuda.Event()
            copied.record(torch.cuda.current_stream(self._layers[0][1].device))
        nbytes = sum(buf.nbytes for _, buf in staged)
        while self._pending and sum(n for _, n in self._pending) + nbytes > self._max_pending:
            self._pending.pop(0)[0].result()  # the disk is behind: wait rather than pin more memory
        self._pending.append((self._writer.submit(self._write, staged, copied), nbytes))

    def _write(self, staged: list[tuple[ChunkSave, Any]], copied: Any = None) -> None:
        if copied is not None:
            copied.synchronize()
        kind = MLACache if self._mla else KVCache
        items = [(self._key(sv.keys), kind(buf)) for sv, buf in staged]  # keys unique: build_connector_meta
        try:
            self._store.put_many(items, namespace=self._namespace, codec=self._codec)
            self.counters["chunks_saved"] += len(items)
        except TierstoreError as e:  # a save that failed is a later miss, never an error of the request
            self.counters["save_errors"] += len(items)
            _log.warning("tierstore: %d chunks not saved: %s", len(items), e)

    def _raise_save_error(self) -> None:
        done = [f for f, _ in self._pending if f.done()]
        self._pending = [(f, n) for f, n in self._pending if not f.done()]
        for f in done:
            f.result()  # anything but a TierstoreError is a bug: raised in the step that follows

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._load_thread is not None:
            self._load_thread.join()
            self._load_thread = None
        with self._failed_lock:
            failed, self._failed = self._failed, set()
        return failed

    def check_last_loads(self) -> dict[str, int]:
        """Compare what the last loads put in the paged cache with the store's bytes, block by
        block and layer by layer (a check for tests and scripts/gpu_check.py, run once the blocks
        are not yet reused): ``{"chunks", "layers_checked", "mismatches"}``."""
        if self._load_thread is not None:
            self._load_thread.join()
        checked = mismatches = 0
        bs = self._block_size
        for ld in self.last_loads:
            for i, (_, tensor, paged) in enumerate(self._layers):
                stored = self._store.get(self._key(ld.keys), namespace=self._namespace, layers=i, device="cpu").data[0]
                got = paged.gather(ld.block_ids, torch.empty(paged.layout.chunk_shape(len(ld.block_ids) * bs),
                                                             dtype=tensor.dtype, device=tensor.device)).cpu()
                axis = 2 if paged.layout.kind == "kv" else 0
                want = torch.cat([stored.narrow(axis, p * bs, bs) for p in ld.positions], dim=axis)
                checked += 1
                mismatches += not torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8))
        return {"chunks": len(self.last_loads), "layers_checked": checked, "mismatches": mismatches}

    def flush(self) -> None:
        """Wait for every save handed to the writer, and make them durable."""
        for f, _ in list(self._pending):
            f.result()
        self._pending = []
        if not self._store.readonly:  # (a consumer over a read-only store wrote nothing)
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
            self._store.close()
            self._store = None  # type: ignore[assignment]

