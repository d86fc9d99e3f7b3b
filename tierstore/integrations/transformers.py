"""A prefix cache for Hugging Face transformers models: the KV of every full chunk of a prompt is
stored once and loaded for any later prompt that starts with the same tokens (across processes and
restarts), so only the new suffix is computed.

    from tierstore.integrations.transformers import PrefixCache
    pc = PrefixCache(store, model, chunk_tokens=256)
    out = pc.generate(input_ids, max_new_tokens=64)   # load the longest stored prefix, generate, save
    cache, n = pc.load(input_ids)                     # a fresh DynamicCache holding n tokens
    pc.save(input_ids, cache)                         # store the full chunks not stored yet

It owns the mapping between transformers' ``DynamicCache`` (per layer ``[batch, kv_heads, seq,
head_dim]``, the un-repeated heads of GQA) and one ``KVCache [layers, 2, kv_heads, tokens,
head_dim]`` per chunk, keyed by ``chunk_hashes`` salted with the model fingerprint (SPEC.md §13.1).
It uses only tierstore's public API and never touches a store's internals.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import inspect
import logging
import threading
from collections.abc import Callable
from typing import Any

try:
    import torch
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer
except ImportError as _missing:  # an optional extra: say which
    raise ImportError(f"tierstore.integrations.transformers needs torch and transformers ({_missing}); "
                      "pip install 'tierstore[transformers]'") from _missing

from .. import CorruptionError, InvalidObject, KVCache, NamespaceHandle, NotFound, TierstoreError, chunk_hashes, codecs
from . import config_json

_log = logging.getLogger("tierstore")

FINGERPRINT_VERSION = b"tierstore/transformers/2"  # 2 (2026-12-03): a sample of the weights by default
WEIGHT_SAMPLES = 64  # elements of each parameter in the weights' sample (SPEC.md §13.1)


def weights_sample_digest(model: Any) -> str:
    """What ``model_fingerprint`` uses when no ``weights_digest`` is given: ``"sample:"`` and the
    SHA-256 (hex) over every parameter, in ``named_parameters()`` order, of its name, shape,
    dtype and ``WEIGHT_SAMPLES`` elements at evenly spaced positions of the flattened tensor, as
    float32 (SPEC.md §13.1).  Two checkpoints of one architecture (a base model and its
    instruction-tuned version, a merged fine-tune) differ there: one never loads the other's KV.
    A few kilobytes are read per model, not the weights.  InvalidObject when a parameter has no
    data here (on the meta device, offloaded): pass ``weights_digest=`` then."""
    h = hashlib.sha256()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.device.type == "meta":
                raise InvalidObject(f"the weights of {name} are not in memory (meta device, offloaded): PrefixCache "
                                    "cannot tell this checkpoint from another",
                                    hint="pass weights_digest= (a string naming the checkpoint, e.g. its revision)")
            try:
                flat = p.detach().reshape(-1)
                n = flat.numel()
                at = torch.arange(WEIGHT_SAMPLES, dtype=torch.int64, device=flat.device) * max(n - 1, 0) \
                    // (WEIGHT_SAMPLES - 1) if n > WEIGHT_SAMPLES else torch.arange(n, device=flat.device)
                values = flat[at].to(torch.float32).cpu().numpy().astype("<f4").tobytes()
            except (RuntimeError, TypeError, ValueError, NotImplementedError) as e:  # a sharded or packed tensor
                raise InvalidObject(f"PrefixCache cannot sample the weights of {name} ({type(p).__name__}: {e})",
                                    hint="pass weights_digest= (a string naming the checkpoint, e.g. its "
                                         "revision)") from None
            for part in (name.encode(), str(tuple(p.shape)).encode(), str(p.dtype).encode(), values):
                h.update(len(part).to_bytes(4, "little") + part)
    return "sample:" + h.hexdigest()


def model_fingerprint(model: Any, *, weights_digest: str | bytes | None = None) -> bytes:
    """The salt of a model's chunk hashes (SPEC.md §13.1): SHA-256 over the fingerprint version,
    the model class, its dtype, its configuration as sorted JSON (fields that do not change the
    KV left out) and the weights' digest: ``weights_digest`` if given (any string naming the
    checkpoint: a revision, a file hash), else ``weights_sample_digest(model)``.  Two models
    whose KV may differ for the same tokens get different salts, so one never loads the
    other's KV -- a fine-tune of the same architecture differs only in its weights."""
    if weights_digest is None:
        weights_digest = weights_sample_digest(model)
    w = weights_digest.encode() if isinstance(weights_digest, str) else bytes(weights_digest)
    h = hashlib.sha256()
    for part in (FINGERPRINT_VERSION, type(model).__name__.encode(), str(model.dtype).encode(),
                 config_json(model.config.to_dict()).encode(), w):
        h.update(len(part).to_bytes(4, "little") + part)
    return h.digest()[:16]


def _full_attention_only(config: Any) -> None:
    """Refuse models whose cache layers are not plain full attention (sliding windows, chunked
    or linear attention, shared KV): their caches cannot be cut into reusable chunks this way."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs

        types = get_layer_types_and_kwargs(text)[0]
    except (ImportError, AttributeError, TypeError):  # an older release: the config fields themselves
        types = getattr(text, "layer_types", None) or [
            "sliding_attention" if getattr(text, "sliding_window", None) is not None else "full_attention"]
    other = sorted({t for t in types if t != "full_attention"})
    if other:
        sliding = any("sliding" in t for t in other)
        raise InvalidObject(f"PrefixCache stores plain full-attention KV; this model has {', '.join(other)} layers",
                            hint="a sliding-window cache keeps only the last window of tokens, so its chunks are "
                                 "not a prefix; use a config without sliding_window (if the model allows) or no cache"
                            if sliding else "these layers' caches are not a per-token prefix of K and V: generate "
                                            "without PrefixCache")
    v_dim = getattr(text, "v_head_dim", None)
    qk_dim = getattr(text, "qk_head_dim", None) or (
        (getattr(text, "qk_nope_head_dim", 0) or 0) + (getattr(text, "qk_rope_head_dim", 0) or 0)) or None
    if v_dim is not None and qk_dim is not None and v_dim != qk_dim:
        raise InvalidObject(f"PrefixCache stores K and V of one head size; this model's keys have {qk_dim} and its "
                            f"values {v_dim} per head (multi-head latent attention, e.g. DeepSeek-V2/V3)",
                            hint="generate without PrefixCache")


class PrefixCache:
    """Chunks of a model's KV cache in a tierstore ``store``, keyed by their token prefix.

    ``chunk_tokens``: tokens per stored chunk (a prompt's trailing partial chunk is not stored);
    ``namespace``: where the chunks go (default "transformers"); ``codec``: the store codec of
    the chunks (e.g. "int8"; default lossless); ``session``: tie the chunks to a conversation
    so ``store.drop_session(session, namespace=...)`` frees what only it used;
    ``weights_digest``: a string naming the checkpoint (a revision, a file hash) instead of
    the sample of the weights the fingerprint takes by default (``model_fingerprint``);
    ``overlap_load``: whether ``generate`` reads the prefix layer by layer behind the first
    forward pass (``load(background=True)``; default False: on a 2-core CPU it measured no
    faster than reading the prefix whole first, docs/benchmarks.md, and it has not yet been
    measured on a GPU).  Over a
    read-only store (or a tenant's handle, ``store.namespace(...)``, reading a namespace it was
    only granted) it loads and generates but saves nothing (``save`` raises ReadOnlyError /
    AccessDenied).  A chunk found damaged is deleted (over a writable store), so the next
    ``save`` stores it again.
    """

    def __init__(self, store: Any, model: Any, *, chunk_tokens: int = 256, namespace: str = "transformers",
                 codec: str | None = None, session: str | None = None,
                 weights_digest: str | bytes | None = None, overlap_load: bool = False) -> None:
        if type(chunk_tokens) is not int or chunk_tokens < 1:
            raise InvalidObject(f"chunk_tokens must be a positive int, got {chunk_tokens!r}")
        if type(overlap_load) is not bool:
            raise InvalidObject(f"overlap_load must be True or False, got {overlap_load!r}")
        _full_attention_only(model.config)
        choice = codecs.parse(codec, "kv") if codec is not None else None  # refused now, not after a generation
        store.match_prefix([], namespace=namespace)  # checks the namespace's name (and a tenant's access) now
        if session is not None:
            store.session_keys(session, namespace=namespace)  # checks the session's name
        # a read-only store, or a tenant's handle (store.namespace(...)) over another namespace it
        # may only read: load and generate, save nothing, delete nothing
        self.writable = not store.readonly and (not isinstance(store, NamespaceHandle) or store.name == namespace)
        self._warned: set[bytes] = set()  # damaged chunks it cannot delete: warned once each
        self._warned_beams = False
        self._warned_assisted = False
        self._warned_lossy = False
        self._warned_padding = False
        self.store, self.model = store, model
        self.chunk_tokens, self.namespace, self.codec, self.session = chunk_tokens, namespace, codec, session
        self.overlap_load = overlap_load
        self.lossless = choice is None or choice.codec.lossless  # what load accepts
        self.salt = model_fingerprint(model, weights_digest=weights_digest)
        if choice is not None and not choice.codec.lossless:  # lossy chunks under keys of their own (SPEC.md
            spec = choice.spec.encode()  # §13.1): a PrefixCache without the codec never loads them
            self.salt = hashlib.sha256(b"tierstore/transformers/lossy" + self.salt + spec).digest()[:16]
        forward = inspect.signature(type(model).forward).parameters
        # the name of the model's cache argument: "cache" in transformers 5, "past_key_values" before
        self.cache_argument = "cache" if "cache" in forward else "past_key_values"

    # -- keys ---------------------------------------------------------------------------------

    def _rows(self, input_ids: Any) -> torch.Tensor:
        ids = torch.as_tensor(input_ids)
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        if ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
            raise InvalidObject(f"input_ids must be integer token ids shaped [seq] or [batch, seq], got "
                                f"{tuple(ids.shape)} {ids.dtype}")
        return ids

    def hashes(self, tokens: Any) -> list[bytes]:
        """The keys of the full chunks of ``tokens`` (one row of token ids)."""
        return chunk_hashes(torch.as_tensor(tokens).reshape(-1).cpu().numpy(), chunk_tokens=self.chunk_tokens,
                            salt=self.salt)

    def cached_tokens(self, input_ids: Any) -> int:
        """How many leading tokens of ``input_ids`` (one row) ``load`` would restore: whole stored
        chunks, never the last token (the model must compute it to give the next token's logits)."""
        ids = self._rows(input_ids)
        if ids.shape[0] != 1:
            raise InvalidObject("cached_tokens takes one row of token ids")
        return len(self._matched(ids)) * self.chunk_tokens

    def _matched(self, ids: torch.Tensor) -> list[bytes]:
        """The keys of the stored chunks that start one row, never its last token."""
        usable = (ids.shape[1] - 1) // self.chunk_tokens
        hashes = self.hashes(ids[0, : usable * self.chunk_tokens])
        return hashes[: self.store.match_prefix(hashes, namespace=self.namespace)]

    # -- load and save --------------------------------------------------------------------------

    def load(self, input_ids: Any, *, background: bool = False) -> tuple[DynamicCache, int]:
        """A fresh ``DynamicCache`` holding the longest stored prefix of ``input_ids`` (one row),
        on the model's device, in the dtype its chunks were saved in (the cache's: the model's
        unless it ran under autocast), and its length in tokens (0: nothing stored; the cache
        is then empty).  A chunk that is missing or damaged ends the prefix there, with one logged
        warning: the rest is recomputed, never loaded wrong.

        ``background=True`` returns as soon as the index has answered and reads the chunks
        layer by layer in a thread, in layer order, straight into the cache's tensors: a
        forward pass over the cache computes layer i while layer i+1 is read (each layer's
        ``keys`` / ``values`` wait for its data on first use).  The length is then the
        index's: a chunk found damaged (or deleted) during the read cannot shorten it, so
        using that layer raises the TierstoreError that stopped the read (a copy per use,
        caused by it; the damaged chunk is deleted, as here) -- load again, without
        ``background``, for the shorter prefix (``generate`` does).  Never wrong KV either way."""
        ids = self._rows(input_ids)
        if ids.shape[0] != 1:
            raise InvalidObject("load takes one row of token ids (a DynamicCache holds one prefix length)",
                                hint="call it per row; save() takes a batch")
        chunks, n, versions = self._stored_chunks(ids)
        if background and chunks:
            try:
                dest = self._destination(chunks[0], n)
            except (TierstoreError, AttributeError, TypeError, ValueError):
                pass  # the synchronous read below names what is wrong and shortens the prefix
            else:
                cache = self._arriving(chunks, dest, versions)
                if cache is not None:
                    return cache, n
        dest: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer: K and V [1, kv_heads, n, head_dim]
        tc = self.chunk_tokens
        got, todo = 0, len(chunks)
        while todo:
            try:
                if not dest:
                    dest = self._destination(chunks[0], n)
                # each layer's K and V straight into their place in the cache's own tensors (one view
                # per chunk: split makes them all at once); the chunks only the disk holds are read
                # side by side
                objs = self.store.get_many(chunks[:todo], namespace=self.namespace,
                                           out=self._views(dest, todo, range(len(dest))))
            except (TierstoreError, AttributeError, TypeError, ValueError) as e:
                todo = self._failed(e, chunks[:todo])  # the chunks before it, again (the call returned none)
                continue
            got = next((i for i, obj in enumerate(objs) if obj is None), todo)
            if got < todo:  # deleted or evicted since match_prefix: a shorter prefix
                _log.warning("tierstore: chunk %d of a stored prefix is gone; recomputing from token %d",
                             got, got * tc)
            changed = self._replaced(chunks[:got], versions)
            if changed is not None:  # (the version read may not be the one found lossless)
                got = changed[0]
                _log.warning("tierstore: chunk %d of a stored prefix %s while it was read; recomputing from token %d",
                             got, "is gone" if changed[1] else "was replaced", got * tc)
            break
        cache = DynamicCache(config=self.model.config)
        if not got:
            return cache, 0
        n = got * self.chunk_tokens
        for layer, (k, v) in zip(cache.layers, dest):
            k, v = k[:, :, :n].contiguous(), v[:, :, :n].contiguous()  # (a copy only when a chunk failed)
            if type(layer).__name__ == "DynamicLayer":  # take the tensors as they are (update would copy them)
                layer.lazy_initialization(k, v)
                layer.keys, layer.values = k, v
            else:
                layer.update(k, v)
        return cache, n

    def _stored_chunks(self, ids: torch.Tensor) -> tuple[list[bytes], int, list[Any] | None]:
        """The keys of the stored chunks ``load`` may read for one row, their tokens, and
        (where lossless KV is expected) the versions found lossless, by content (their extents'
        checksums: a compaction's copy is the same version): ``match_prefix``, ended before the
        first lossy chunk."""
        chunks = self._matched(ids)
        tc = self.chunk_tokens
        n = len(chunks) * tc
        if not self.lossless:
            return chunks, n, None
        versions: list[Any] = []
        # lossy chunks under lossless keys (a store whose default codec for KV is lossy,
        # open(codecs=...)): the prefix ends before the first
        for i, h in enumerate(chunks):
            try:
                info = self.store.info(h, namespace=self.namespace)
                lossless = info.lossless
            except (TierstoreError, AttributeError, TypeError, ValueError) as e:
                _log.warning("tierstore: chunk %d (key %s...) of a stored prefix could not be described (%s); "
                             "recomputing from token %d", i, h.hex()[:16], getattr(e, "message", e), i * tc)
                return chunks[:i], i * tc, versions  # (the prefix ends there: nothing unchecked is loaded)
            if not lossless:
                if not self._warned_lossy:
                    self._warned_lossy = True
                    _log.warning("tierstore: stored chunk %d is lossy where this PrefixCache expects lossless "
                                 "KV: the prefix ends there (the store's default codec for KV, "
                                 "open(codecs=...), made it lossy)", i)
                return chunks[:i], i * tc, versions
            versions.append(info.extent_checksums)
        return chunks, n, versions

    def _replaced(self, chunks: list[bytes], versions: list[Any] | None) -> tuple[int, bool] | None:
        """The first of ``chunks`` whose content is no longer the one ``_stored_chunks`` found
        lossless (replaced meanwhile: the read may have taken the new one), and whether it is
        gone (deleted) rather than replaced; or None."""
        if versions is None:
            return None
        for i, h in enumerate(chunks):
            try:
                if self.store.info(h, namespace=self.namespace).extent_checksums != versions[i]:
                    return i, False
            except NotFound:
                return i, True
            except TierstoreError:
                return i, False
        return None

    def _destination(self, first: bytes, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the K and V tensors ``[1, kv_heads, n, head_dim]`` a prefix of ``n``
        tokens is read into, shaped and typed as the first chunk was stored."""
        info = self.store.info(first, namespace=self.namespace)
        heads, _, hd = info.shape[2:]
        dtype = getattr(torch, info.dtype)  # as saved (the cache's dtype, e.g. under autocast)
        device = self.model.device
        # normal tensors even under torch.inference_mode(): the store's reader threads fill them,
        # and an inference tensor may not be changed outside inference mode
        with torch.inference_mode(False):
            return [(torch.empty(1, heads, n, hd, dtype=dtype, device=device),
                     torch.empty(1, heads, n, hd, dtype=dtype, device=device)) for _ in range(info.shape[0])]

    def _views(self, dest: list[tuple[torch.Tensor, torch.Tensor]], chunks: int,
               layers: Any) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """``get_many``'s ``out=``: for each of the first ``chunks`` chunks, the views of
        ``layers`` of ``dest`` that chunk's tokens fill."""
        tc = self.chunk_tokens
        per_layer = [(dest[li][0][0].split(tc, dim=1), dest[li][1][0].split(tc, dim=1)) for li in layers]
        return [[(ks[i], vs[i]) for ks, vs in per_layer] for i in range(chunks)]

    def _failed(self, e: Exception, chunks: list[bytes], *, background: bool = False) -> int:
        """A read of ``chunks`` that raised ``e``: warn (once per chunk), delete the chunk if it
        is damaged and the store writable (the next ``save`` stores it again), and return the
        index of the chunk that failed (0 when ``e`` names none): the prefix ends there.
        (``background``: a background load, which does not recompute: it stops there.)"""
        i = chunks.index(e.key) if isinstance(e, TierstoreError) and e.key in chunks else 0
        why = "is damaged" if isinstance(e, CorruptionError) else \
            "does not fit this model" if not isinstance(e, TierstoreError) or isinstance(e, InvalidObject) \
            else "could not be read"
        removed = False
        if isinstance(e, CorruptionError) and e.key == chunks[i] and self.writable:
            try:
                removed = self.store.delete(chunks[i], namespace=self.namespace)  # the next save replaces it
            except TierstoreError as gone:  # (it stays: warned about once)
                _log.debug("tierstore: could not delete a damaged chunk: %s", gone)
        if chunks[i] not in self._warned:
            _log.warning("tierstore: chunk %d (key %s...) of a stored prefix %s (%s)%s; %s token %d", i,
                         chunks[i].hex()[:16], why, getattr(e, "message", e), ", deleted" if removed else "",
                         "the background load stops at" if background else "recomputing from", i * self.chunk_tokens)
            if not removed and len(self._warned) < 10_000:
                self._warned.add(chunks[i])
        return i

    def _arriving(self, chunks: list[bytes], dest: list[tuple[torch.Tensor, torch.Tensor]],
                  versions: list[Any] | None) -> DynamicCache | None:
        """A DynamicCache over ``dest`` whose layers a thread reads, in layer order, from
        ``chunks`` (load(background=True)); None where the model's cache layers are not plain
        ``DynamicLayer``s, one per stored layer."""

        def read_layer(li: int) -> None:
            try:
                objs = self.store.get_many(chunks, namespace=self.namespace, layers=[li],
                                           out=self._views(dest, len(chunks), [li]))
            except (TierstoreError, AttributeError, TypeError, ValueError) as e:
                i = self._failed(e, chunks, background=True)
                if isinstance(e, TierstoreError):
                    raise
                raise InvalidObject(f"stored chunk {i} of the prefix does not fit this model: {e}",
                                    key=chunks[i], namespace=self.namespace) from e
            gone = next((i for i, obj in enumerate(objs) if obj is None), None)
            if gone is not None:  # deleted or evicted since match_prefix
                _log.warning("tierstore: chunk %d of a stored prefix is gone; the background load stops at token %d",
                             gone, gone * self.chunk_tokens)
                raise NotFound("a chunk of the stored prefix was deleted while it was being loaded",
                               key=chunks[gone], namespace=self.namespace)
            changed = self._replaced(chunks, versions)  # (each layer is read in a snapshot of its own)
            if changed is not None:
                i, deleted = changed
                _log.warning("tierstore: chunk %d of a stored prefix %s while it was loaded; the background load "
                             "stops at token %d", i, "is gone" if deleted else "was replaced", i * self.chunk_tokens)
                if deleted:
                    raise NotFound("a chunk of the stored prefix was deleted while it was being loaded",
                                   key=chunks[i], namespace=self.namespace, hint="load it again")
                raise TierstoreError("a chunk of the stored prefix was replaced while it was being loaded (its "
                                     "layers could come from two versions)", key=chunks[i],
                                     namespace=self.namespace, hint="load it again")

        cache = DynamicCache(config=self.model.config)
        if len(cache.layers) != len(dest) or any(type(layer) is not DynamicLayer for layer in cache.layers):
            return None  # (the synchronous load fills what the model's own layers are)
        arrival = _Arrival(read_layer, len(dest))
        cache.layers[:] = [_ArrivingLayer(k, v, arrival, li) for li, (k, v) in enumerate(dest)]
        return cache

    def save(self, input_ids: Any, cache: Any, *, attention_mask: Any = None) -> int:
        """Store the full chunks of ``input_ids`` (a row, or a batch: row b from the cache's batch
        index b) that ``cache`` holds and the store does not have yet; returns how many were
        written.  One atomic batch per row (``put_many``).

        ``attention_mask``: the mask the model ran with; required for a batch of several rows
        (``torch.ones_like(input_ids)`` when no row is padded).  The KV of a padded row is not
        what the row alone computes: of a right-padded row only the chunks before its first
        padding are stored, of a left-padded row none (its tokens sat at other positions)."""
        ids = self._rows(input_ids)
        usable = self._unpadded(ids, attention_mask)
        layers = list(cache.layers) if hasattr(cache, "layers") else None
        if not layers:
            raise InvalidObject(f"save takes a DynamicCache, got {type(cache).__name__}")
        other = sorted({type(layer).__name__ for layer in layers if type(layer) not in (DynamicLayer, _ArrivingLayer)})
        if other:  # quantized layers hold only a residual window in .keys, sliding ones the last window
            raise InvalidObject(f"save takes a DynamicCache of full-attention layers; this cache has "
                                f"{', '.join(other)}",
                                hint="generate with a plain DynamicCache (PrefixCache.generate makes one)")
        held = cache.get_seq_length()
        if ids.shape[0] > layers[0].keys.shape[0]:
            raise InvalidObject(f"save: {ids.shape[0]} rows of token ids for a cache of {layers[0].keys.shape[0]}")
        # K and V of one dtype (under CPU autocast K comes out of RoPE in float32, V in bfloat16):
        # the narrower one is widened, which loses nothing; a load gives both in the wider dtype
        wide = functools.reduce(torch.promote_types, [t.dtype for layer in layers for t in (layer.keys, layer.values)])
        written = 0
        # with a session, chunks stored but not yet referenced by it are put too: the same bytes
        # write only its reference (with a remote tier, a new version), so dropping another
        # conversation that shares them keeps them
        mine = set(self.store.session_keys(self.session, namespace=self.namespace)) if self.session else set()
        for b in range(ids.shape[0]):
            n = min(held, usable[b]) // self.chunk_tokens * self.chunk_tokens
            hashes = self.hashes(ids[b, :n])
            have = self.store.contains_many(hashes, namespace=self.namespace) if hashes else []
            items = []
            for i, (h, stored) in enumerate(zip(hashes, have)):
                if stored and (self.session is None or h in mine):
                    continue
                s, e = i * self.chunk_tokens, (i + 1) * self.chunk_tokens
                pieces = [(layer.keys[b, :, s:e].detach().to(wide), layer.values[b, :, s:e].detach().to(wide))
                          for layer in layers]
                items.append((h, KVCache.from_layers(pieces)))
            for j in range(0, len(items), 1024):
                self.store.put_many(items[j : j + 1024], namespace=self.namespace, session=self.session,
                                    codec=self.codec)
            mine.update(h for h, _ in items)  # (a later row of the batch that shares them: referenced now)
            written += have.count(False)
        return written

    def _unpadded(self, ids: torch.Tensor, attention_mask: Any) -> list[int]:
        """Per row of ``ids``, how many leading tokens ran unpadded (``save``'s ``attention_mask``)."""
        if attention_mask is None:
            if ids.shape[0] > 1:
                raise InvalidObject("save of a batch takes the attention_mask the model ran with (padded rows "
                                    "hold KV that is not the row's own)",
                                    hint="pass attention_mask=...; torch.ones_like(input_ids) when no row is padded")
            return [ids.shape[1]]
        mask = torch.as_tensor(attention_mask)
        if mask.dim() == 1:
            mask = mask.unsqueeze(0)
        if tuple(mask.shape) != tuple(ids.shape):
            raise InvalidObject(f"attention_mask is shaped {tuple(mask.shape)}; input_ids {tuple(ids.shape)}")
        ones = mask.bool().cpu()
        # leading ones per row: the index of the first zero (cummin keeps 1 only up to it)
        usable = ones.to(torch.int8).cummin(dim=1).values.sum(dim=1).tolist()
        if any(n < ids.shape[1] for n in usable) and not self._warned_padding:
            self._warned_padding = True
            _log.warning("tierstore: PrefixCache.save stores the chunks of padded rows only up to their first padding "
                         "(none of a left-padded row)")
        return [int(n) for n in usable]

    def generate(self, input_ids: Any, **kwargs: Any) -> Any:
        """``model.generate`` with the longest stored prefix loaded first and the new full chunks
        saved after (prompt and generated tokens alike).  One row of ``input_ids``, unpadded;
        other arguments go to ``generate`` unchanged (``attention_mask`` is made for the full
        row; one with zeros, i.e. padding, is refused: the KV of a padded row is not the row's).
        With beam search (or several sequences returned) the cache's rows are beams, not the
        returned sequence, and assisted decoding (``assistant_model``,
        ``prompt_lookup_num_tokens``, ``assistant_early_exit``) over a cache that holds a prefix
        leaves KV that a full prefill does not give (transformers 5.25): it runs
        ``model.generate`` alone, loading and saving nothing (logged once).  A save that
        fails is logged; the generation is returned all the same.  With ``overlap_load`` (and
        no ``streamer``) the prefix is loaded with ``load(background=True)``: when an error stops
        that read (a chunk damaged -- logged and deleted -- or deleted meanwhile), the
        generation runs again over the prefix a whole read then finds."""
        ids = self._rows(input_ids).to(self.model.device)
        if ids.shape[0] != 1:
            raise InvalidObject("generate takes one row of token ids", hint="call it per row")
        if self.cache_argument in kwargs or "past_key_values" in kwargs:
            raise InvalidObject("PrefixCache.generate makes the cache itself; do not pass one")
        mask = kwargs.get("attention_mask")
        if mask is not None and not bool(torch.as_tensor(mask).bool().all()):
            raise InvalidObject("PrefixCache.generate takes a row without padding: attention_mask has zeros",
                                hint="pass the row's tokens without its padding (the chunks are keyed by tokens)")
        kwargs.setdefault("attention_mask", torch.ones_like(ids))
        config = kwargs.get("generation_config") or self.model.generation_config
        rows = max(int(kwargs.get("num_beams", getattr(config, "num_beams", 1)) or 1),
                   int(kwargs.get("num_return_sequences", getattr(config, "num_return_sequences", 1)) or 1))
        if rows > 1:  # the cache's rows are beams (or samples), not the returned sequence: plain generate
            if not self._warned_beams:
                self._warned_beams = True
                _log.warning("tierstore: PrefixCache.generate neither loads nor saves under beam search or several "
                             "returned sequences (the cache's rows are beams, not one sequence)")
            return self.model.generate(ids, **kwargs)
        assisted = [name for name in ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit")
                    if kwargs.get(name, getattr(config, name, None)) is not None]
        if assisted:  # transformers' assisted decoding over a prefilled cache computes wrong KV
            if not self._warned_assisted:  # (its chunks would poison every later load): plain generate
                self._warned_assisted = True
                _log.warning("tierstore: PrefixCache.generate neither loads nor saves under assisted decoding (%s): "
                             "over a cache that holds a prefix it leaves KV that a full prefill does not give",
                             ", ".join(assisted))
            return self.model.generate(ids, **kwargs)
        # (a streamer is told the prompt once: a generation run again would tell it twice)
        background = self.overlap_load and kwargs.get("streamer") is None
        cache, _ = self.load(ids, background=background)
        try:
            out = self.model.generate(ids, **{self.cache_argument: cache}, **kwargs)
        except TierstoreError:
            arrival = getattr(cache.layers[0], "arrival", None) if cache.layers else None
            if not isinstance(arrival, _Arrival) or arrival.error is None:
                raise
            # a chunk was damaged or deleted while it was being read (logged, and deleted if
            # damaged): the shorter prefix, read whole first
            cache, _ = self.load(ids)
            out = self.model.generate(ids, **{self.cache_argument: cache}, **kwargs)
        sequences = out.sequences if hasattr(out, "sequences") else out
        if not self.writable:
            return out
        layers = list(getattr(cache, "layers", []))
        if sequences.shape[0] != 1 or any(layer.keys is not None and layer.keys.shape[0] != 1 for layer in layers):
            return out  # (rows the arguments above did not announce: saved from no row)
        try:
            self.save(sequences[:, : cache.get_seq_length()], cache)
        except TierstoreError as e:  # the generation stands; its chunks are a later miss
            _log.warning("tierstore: PrefixCache.generate could not save its chunks: %s", e)
        return out


class _Arrival:
    """The layers of a stored prefix, read by a thread in layer order: ``wait(i)`` returns once
    layer i is in place, or raises the error that stopped the read before it."""

    def __init__(self, read_layer: Callable[[int], None], count: int) -> None:
        self._done = 0  # layers in place
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        threading.Thread(target=self._run, args=(read_layer, count), name="tierstore-prefix-load", daemon=True).start()

    def _run(self, read_layer: Callable[[int], None], count: int) -> None:
        for i in range(count):
            try:
                read_layer(i)
            except BaseException as e:  # (handed to whoever waits for this layer: nothing is swallowed)
                with self._cond:
                    self._error = e
                    self._cond.notify_all()
                return
            with self._cond:
                self._done = i + 1
                self._cond.notify_all()

    @property
    def error(self) -> BaseException | None:
        """What stopped the read (None: nothing, so far)."""
        with self._cond:
            return self._error

    def wait(self, i: int) -> None:
        with self._cond:
            while self._done <= i and self._error is None:
                self._cond.wait()
            if self._done <= i:
                assert self._error is not None
                # each waiter its own copy, caused by the original (which keeps the reader thread's
                # traceback): one object raised again and again would pile every raise onto it
                try:
                    err = copy.copy(self._error)
                except TypeError:  # (an exception that cannot be rebuilt from its args)
                    raise self._error from None
                raise err.with_traceback(None) from self._error


class _ArrivingLayer(DynamicLayer):
    """A ``DynamicLayer`` over tensors a background load is filling: its ``keys`` and ``values``
    wait for the layer's data on first use (so nothing reads them half written); its length is
    known at once."""

    _pending = False  # (the base class's __init__ sets keys and values before ours runs)

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, arrival: _Arrival, index: int) -> None:
        super().__init__()
        self.lazy_initialization(keys, values)
        self._keys, self._values = keys, values
        self._tokens = keys.shape[-2]
        self.arrival, self._index, self._pending = arrival, index, True

    def _arrived(self) -> None:
        if self._pending:
            self.arrival.wait(self._index)
            self._pending = False

    @property  # type: ignore[override]
    def keys(self) -> torch.Tensor:
        self._arrived()
        return self._keys

    @keys.setter
    def keys(self, value: torch.Tensor) -> None:
        self._keys = value

    @property  # type: ignore[override]
    def values(self) -> torch.Tensor:
        self._arrived()
        return self._values

    @values.setter
    def values(self, value: torch.Tensor) -> None:
        self._values = value

    def get_seq_length(self) -> int:
        return self._tokens if self._pending else super().get_seq_length()

    def reset(self) -> None:
        self._pending = False  # (what the read still writes goes to tensors this layer dropped)
        super().reset()

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Copied (``copy.deepcopy``) or pickled as the plain ``DynamicLayer`` it is once
        its data has arrived (waits for it): no lock or thread goes along."""
        self._arrived()
        state = {k: v for k, v in self.__dict__.items() if k not in ("arrival", "_index", "_pending", "_tokens",
                                                                        "_keys", "_values")}
        state["keys"], state["values"] = self._keys, self._values
        return _plain_layer, (state,)


def _plain_layer(state: dict[str, Any]) -> DynamicLayer:
    layer = DynamicLayer.__new__(DynamicLayer)
    layer.__dict__.update(state)
    return layer
