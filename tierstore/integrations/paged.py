"""Paged KV buffers <-> stored chunks: the block gather and scatter of serving engines' connectors.

A serving engine (vLLM) keeps each layer's KV in a pool of fixed-size blocks; a request's tokens
live in the blocks its block table names, token ``t`` at slot ``block_ids[t // block_size] *
block_size + t % block_size``.  tierstore stores a chunk's layer as ``[2, kv_heads, tokens,
head_dim]`` (a KVCache layer, SPEC.md §5.3) or, for latent (MLA) caches, ``[tokens, dim]`` (an
MLACache layer).  This module copies between the two, one layer at a time:

    layout = PagedLayout.of(kv_layer, num_blocks=..., block_size=...)   # read from the tensor
    paged = PagedLayer(kv_layer, layout)       # once per layer
    paged.gather(block_ids, out)               # the blocks' tokens -> out (a chunk's layer)
    paged.scatter(block_ids, src)              # a chunk's layer -> the blocks, in place

The layout is read from the tensor at run time, never assumed.  vLLM 0.33 hands connectors a
standardised per-layer view ``[blocks, heads, block_tokens, K|V]`` (K and V of a head side by
side in the last dimension; one head slot holding the latent for MLA), whose memory order
varies with the backend (NHD, HND, layer-interleaved: only the strides differ), and whose
kernel blocks may split each scheduler block in ``r`` pieces (``blocks = r * num_blocks``).
Older releases used ``[2, blocks, block_size, heads, dim]`` (FlashAttention),
``[blocks, 2, block_size, heads, dim]`` (FlashInfer) and ``[blocks, block_size, dim]`` (MLA);
they are read too.  Copies between host tensors run a loop compiled by numba when it is
installed (the ``fast`` extra; vLLM depends on it): it walks each block in the pool's memory
order, one ``head_dim`` row at a time, at about the speed of a memcpy of the same pages
(docs/benchmarks.md).  Without numba, numpy copies views whose elements are whole rows (0.5-0.9x
a memcpy: numpy's per-element loop).  Device tensors use torch copies on their device.

It owns the copy and nothing else: no I/O, no engine state, no imports of the engines.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import InvalidObject


@dataclass(frozen=True)
class PagedLayout:
    """How one layer's paged tensor is laid out (read from its shape, see ``of``)."""

    kind: str  # "kv": K and V of each head; "mla": one latent vector per token
    form: str  # "bhnc" (vLLM >= 0.33), "kv_first" ([2, B, N, H, D]), "blocks_first" ([B, 2, N, H, D]), "bnc"
    ratio: int  # kernel blocks per scheduler block
    block_tokens: int  # tokens per kernel block
    heads: int  # kv heads (1 for mla)
    dim: int  # head_dim (kv) or the latent dim (mla)

    @classmethod
    def of(cls, layer: Any, *, num_blocks: int, block_size: int, mla: bool = False) -> PagedLayout:
        """Read the layout of ``layer``, one layer's paged tensor for ``num_blocks`` blocks of
        ``block_size`` tokens (``mla``: the model caches one latent per token).  A shape this
        module does not know is InvalidObject, never a guess."""
        shape = tuple(int(d) for d in layer.shape)
        if len(shape) == 4 and num_blocks and shape[0] % num_blocks == 0:
            r = shape[0] // num_blocks
            if shape[2] * r == block_size:
                if mla and shape[1] == 1:
                    return cls("mla", "bhnc", r, shape[2], 1, shape[3])
                if not mla and shape[3] % 2 == 0:
                    return cls("kv", "bhnc", r, shape[2], shape[1], shape[3] // 2)
        if mla and len(shape) == 3 and shape[:2] == (num_blocks, block_size):
            return cls("mla", "bnc", 1, block_size, 1, shape[2])
        if not mla and len(shape) == 5 and shape[2] == block_size:
            if shape[0] == 2 and shape[1] == num_blocks:
                return cls("kv", "kv_first", 1, block_size, shape[3], shape[4])
            if shape[0] == num_blocks and shape[1] == 2:
                return cls("kv", "blocks_first", 1, block_size, shape[3], shape[4])
        raise InvalidObject(f"a paged {'MLA' if mla else 'KV'} layer of shape {list(shape)} is not a layout tierstore "
                            f"knows (num_blocks={num_blocks}, block_size={block_size})",
                            hint="known: [blocks, heads, block_tokens, K|V] (vLLM 0.33), [2, blocks, block_size, "
                                 "heads, dim], [blocks, 2, block_size, heads, dim], [blocks, block_size, dim] (MLA)")

    def chunk_shape(self, tokens: int) -> tuple[int, ...]:
        """The shape of one stored layer holding ``tokens`` tokens."""
        return (2, self.heads, tokens, self.dim) if self.kind == "kv" else (tokens, self.dim)

    @property
    def block_size(self) -> int:
        """Tokens per scheduler block."""
        return self.ratio * self.block_tokens

    def kernel_blocks(self, block_ids: Any) -> list[int]:
        """Scheduler block ids -> the kernel blocks that hold their tokens, in token order."""
        r = self.ratio
        return list(map(int, block_ids)) if r == 1 else [int(b) * r + i for b in block_ids for i in range(r)]

    def blocks(self, layer: Any) -> Any:
        """``layer`` with the kernel block first and, per block, ``[2, heads, tokens, dim]``
        (kv) or ``[tokens, dim]`` (mla): views, no copy."""
        if self.form == "bhnc":
            if self.kind == "mla":
                return layer[:, 0]
            return layer.unflatten(3, (2, self.dim)).permute(0, 3, 1, 2, 4)
        if self.form == "kv_first":
            return layer.permute(1, 0, 3, 2, 4)
        if self.form == "blocks_first":
            return layer.permute(0, 1, 3, 2, 4)
        return layer


def _rows(t: Any) -> np.ndarray:
    """A host tensor as a numpy array whose elements are its last dimension's rows (one void
    item per row), sharing memory: any dtype, any strides above the last dimension."""
    if t.stride(-1) != 1:
        raise InvalidObject("the last dimension of a paged KV tensor must be contiguous")
    b = t.view(torch.uint8) if t.element_size() == 1 else t.view({2: torch.int16, 4: torch.int32,
                                                                   8: torch.int64}[t.element_size()])
    a = b.numpy()
    return a.view(np.dtype((np.void, a.shape[-1] * a.itemsize)))[..., 0]


def _bytes(t: Any) -> np.ndarray:
    """A host tensor as a numpy uint8 array sharing its memory (the last dimension in bytes)."""
    if t.stride(-1) != 1:
        raise InvalidObject("the last dimension of a paged KV tensor must be contiguous")
    b = t.view(torch.uint8) if t.element_size() == 1 else t.view({2: torch.int16, 4: torch.int32,
                                                                   8: torch.int64}[t.element_size()])
    return b.numpy().view(np.uint8)


def _copy_blocks(pool: np.ndarray, chunk: np.ndarray, js: np.ndarray, bs: np.ndarray, tok: int, to_chunk: bool) -> None:
    """``chunk``'s block ``js[i]`` <- ``pool[bs[i]]`` (or back) for each ``i``.  ``pool``:
    ``[blocks, X, Y, Z, bytes]``, ``chunk``: ``[X, Y, Z * blocks, bytes]`` with axis ``tok`` (0-2) of
    X, Y, Z the tokens, any strides (the caller orders X, Y, Z by the pool's strides, so the rows
    are visited in its memory order).  The caller checks every index: this loop does not."""
    nx, ny, nz, w = pool.shape[1], pool.shape[2], pool.shape[3], pool.shape[4]
    for i in range(bs.shape[0]):
        b = bs[i]
        j = js[i] * (nx, ny, nz)[tok]
        dx, dy, dz = (j, 0, 0) if tok == 0 else ((0, j, 0) if tok == 1 else (0, 0, j))
        for x in range(nx):
            for y in range(ny):
                for z in range(nz):
                    src, dst = pool[b, x, y, z], chunk[x + dx, y + dy, z + dz]
                    if to_chunk:
                        for k in range(w):
                            dst[k] = src[k]
                    else:
                        for k in range(w):
                            src[k] = dst[k]


@functools.lru_cache(maxsize=1)
def compiled_kernel() -> Any:
    """``_copy_blocks`` compiled by numba (cached on disk by numba), or None: numba is not
    installed, or ``TIERSTORE_PAGED=numpy`` asks for the numpy copies."""
    if os.environ.get("TIERSTORE_PAGED") == "numpy":
        return None
    try:
        import numba
    except ImportError:
        return None
    sig = "void(u1[:,:,:,:,:], u1[:,:,:,:], i8[:], i8[:], i8, b1)"
    try:
        return numba.njit(sig, cache=True, nogil=True, boundscheck=False)(_copy_blocks)
    except RuntimeError:  # no writable cache directory (a read-only install): compiled in each process
        return numba.njit(sig, nogil=True, boundscheck=False)(_copy_blocks)


_ARANGE = np.arange(1024, dtype=np.int64)  # a gather's chunk blocks: 0, 1, ... (read-only to the loop)


class PagedLayer:
    """One layer's paged tensor with its layout, and (on the host) the views the copies use,
    made once: a connector keeps one per layer (building the views costs more than a block's
    copy).  ``compiled``: the numba loop (True), numpy's copies (False), or numba when it is
    installed (None)."""

    def __init__(self, layer: Any, layout: PagedLayout, *, compiled: bool | None = None) -> None:
        self.tensor, self.layout = layer, layout
        try:
            self.blocks = layout.blocks(layer)
        except (RuntimeError, IndexError) as e:  # (torch: a view this layout cannot make of the tensor)
            raise InvalidObject(f"a paged layer of shape {list(layer.shape)} is not laid out as {layout}: {e}",
                                hint="read each layer's layout from it: PagedLayout.of(layer, ...)") from None
        want = (2, layout.heads, layout.block_tokens, layout.dim) if layout.kind == "kv" else \
            (layout.block_tokens, layout.dim)
        if tuple(self.blocks.shape[1:]) != want:  # (a layout read from another layer: never copied by)
            raise InvalidObject(f"a paged layer of shape {list(layer.shape)} is not laid out as {layout}",
                                hint="read each layer's layout from it: PagedLayout.of(layer, ...)")
        host = self.blocks.device.type == "cpu"
        self.kernel = compiled_kernel() if host and compiled is not False else None
        if compiled and self.kernel is None:
            raise InvalidObject("compiled paged copies need numba (pip install 'tierstore[fast]')")
        self.rows = _rows(self.blocks) if host and self.kernel is None else None
        if self.kernel is not None:  # [blocks, 2|1, heads|1, n, bytes], and the order of its strides
            b5 = self.blocks if layout.kind == "kv" else self.blocks.unsqueeze(1).unsqueeze(1)
            order = sorted((0, 1, 2), key=lambda d: -b5.stride(d + 1))
            self.pool = _bytes(b5).transpose(0, *(d + 1 for d in order), 4)
            self.order, self.tok = (*order, 3), order.index(2)  # the chunk's axes in that order; its tokens

    def gather(self, block_ids: Any, out: Any) -> Any:
        """The tokens of the scheduler blocks ``block_ids`` (in order) into ``out``, a chunk layer of
        ``len(block_ids) * block_size`` tokens (``layout.chunk_shape``).  Returns ``out``."""
        layout = self.layout
        ids = layout.kernel_blocks(block_ids)
        want = layout.chunk_shape(len(ids) * layout.block_tokens)
        if tuple(out.shape) != want:
            raise InvalidObject(f"a chunk layer of shape {list(out.shape)} for {len(block_ids)} blocks; "
                                f"expected {list(want)}")
        self._copy(out, None, ids, to_chunk=True)
        return out

    def scatter(self, block_ids: Any, src: Any, *, positions: Any = None) -> None:
        """A chunk layer ``src`` into the scheduler blocks ``block_ids`` (in place).  ``positions``:
        which blocks of the chunk go where (block ``positions[i]`` of the chunk into
        ``block_ids[i]``); by default all of them, in order."""
        layout = self.layout
        bs = layout.block_size
        pos = list(range(len(block_ids))) if positions is None else [int(p) for p in positions]
        if len(pos) != len(block_ids):
            raise InvalidObject(f"scatter: {len(block_ids)} block ids for {len(pos)} positions")
        tokens = src.shape[2] if layout.kind == "kv" and src.dim() == 4 else src.shape[0]
        if tuple(src.shape) != layout.chunk_shape(tokens) or tokens % bs or \
                any(not 0 <= p < tokens // bs for p in pos):
            raise InvalidObject(f"scatter: a chunk layer of shape {list(src.shape)} does not fit blocks of {bs} "
                                f"tokens at positions {pos[:8]}")
        r = layout.ratio
        self._copy(src, [p * r + i for p in pos for i in range(r)], layout.kernel_blocks(block_ids), to_chunk=False)

    def _copy(self, chunk: Any, js: list[int] | None, bs: list[int], *, to_chunk: bool) -> None:
        """Between the chunk layer ``chunk``'s blocks ``js`` (None: 0, 1, ... in order) and this
        layer's kernel blocks ``bs``."""
        n, kv = self.layout.block_tokens, self.layout.kind == "kv"
        host = chunk.device.type == "cpu" and chunk.dtype == self.tensor.dtype
        blocks, room = self.blocks.shape[0], (chunk.shape[2] if kv else chunk.shape[0]) // n
        if js is None and len(bs) > room:
            raise InvalidObject(f"{len(bs)} blocks for a chunk of {room}")
        if bs and (min(bs) < 0 or max(bs) >= blocks or js is not None and (min(js) < 0 or max(js) >= room)):
            js = range(len(bs)) if js is None else js
            bad = sorted({(j, b) for j, b in zip(js, bs) if not (0 <= b < blocks and 0 <= j < room)})
            raise InvalidObject(f"block ids outside the pool of {blocks} kernel blocks or a chunk of {room} blocks "
                                f"(chunk block, pool block): {bad[:8]}")
        if host and self.kernel is not None:
            if not bs:
                return
            c = (_bytes(chunk) if kv else _bytes(chunk)[None, None]).transpose(self.order)
            if any(c.shape[d] != self.pool.shape[d + 1] for d in range(4) if d != self.tok):
                raise InvalidObject(f"a chunk of {list(chunk.shape)} does not fit blocks of "
                                    f"{list(self.blocks.shape[1:])}")
            jarr = _ARANGE[:len(bs)] if js is None and len(bs) <= len(_ARANGE) else \
                np.array(range(len(bs)) if js is None else js, dtype=np.int64)
            self.kernel(self.pool, c, jarr, np.array(bs, dtype=np.int64), self.tok,
                        to_chunk)  # the loop checks no index: checked above
            return
        if self.rows is not None and host:
            p, c = self.rows, _rows(chunk)  # pool [blocks, 2, heads, n] / [blocks, n]; chunk [2, heads, T] / [T]
            for j, b in zip(range(len(bs)) if js is None else js, bs):
                cv = c[..., j * n:(j + 1) * n] if kv else c[j * n:(j + 1) * n]
                np.copyto(cv, p[b]) if to_chunk else np.copyto(p[b], cv)
            return
        self._copy_torch(chunk, list(zip(range(len(bs)) if js is None else js, bs)), to_chunk=to_chunk)

    def _copy_torch(self, chunk: Any, pairs: list[tuple[int, int]], *, to_chunk: bool) -> None:
        """The same with torch on the layer's device: one gather (index_select) or scatter
        (index_copy_) of all the blocks, not one small copy per block."""
        n, kv, p = self.layout.block_tokens, self.layout.kind == "kv", self.blocks
        if not pairs:
            return
        pool = torch.tensor([b for _, b in pairs], dtype=torch.long, device=p.device)
        cpos = [j for j, _ in pairs]
        # the chunk as [blocks, ...] in the pool's block form: [k, 2, heads, n, dim] or [k, n, dim]
        cv = chunk.unflatten(2, (chunk.shape[2] // n, n)).permute(2, 0, 1, 3, 4) if kv else \
            chunk.unflatten(0, (chunk.shape[0] // n, n))
        if to_chunk:
            sel = p.index_select(0, pool)
            if cpos == list(range(len(cpos))) and len(cpos) == cv.shape[0]:
                cv.copy_(sel, non_blocking=True)
            else:
                for i, j in enumerate(cpos):
                    cv[j].copy_(sel[i], non_blocking=True)
        else:
            src = cv[torch.tensor(cpos, dtype=torch.long, device=cv.device)].to(p.device, non_blocking=True)
            p.index_copy_(0, pool, src)


def gather(layer: Any, layout: PagedLayout, block_ids: Any, out: Any) -> Any:
    """``PagedLayer(layer, layout).gather(block_ids, out)``: for one copy (a connector keeps a
    PagedLayer per layer instead)."""
    return PagedLayer(layer, layout).gather(block_ids, out)


def scatter(layer: Any, layout: PagedLayout, block_ids: Any, src: Any, *, positions: Any = None) -> None:
    """``PagedLayer(layer, layout).scatter(block_ids, src, positions=positions)``."""
    PagedLayer(layer, layout).scatter(block_ids, src, positions=positions)
