"""Generated access traces for ``tierstore simulate`` (docs/placement.md): the shapes the serving
literature reports, since public traces of KV reuse are scarce, and a reader of ShareGPT-style
conversation files.

Every shape is a list of trace ops (trace.py's format, ``t`` a running counter) over KV chunks
of ``chunk_tokens`` tokens of ``bytes_per_token`` bytes each (defaults: 256 tokens of a
Llama-3-8B-shaped cache, 32 layers x 2 x 8 heads x 128 dims x fp16 = 128 KiB per token, so
32 MiB per chunk).  A ``get`` asks for a chunk a request can reuse; one the store does not
hold is recomputed and stored (the simulator counts it as a miss).  A ``put`` stores new
content.  Shapes and their parameters (all seeded, reproducible):

- ``chat``: multi-turn conversations (LMSYS-Chat / ShareGPT statistics: 4-20 turns), each
  turn picking a session with Zipf-distributed popularity (rank^-a); a turn reads the
  session's earlier chunks (its growing context) and stores 1-2 new ones; ``lookahead``
  turns ahead, the engine announces the session (``session`` op: prefetch_session).
- ``tenants``: shared system prompts (multi-tenant serving): each request picks a tenant
  (Zipf), reads its system prompt's chunks (shared by every request of that tenant) and
  stores one chunk of its own.
- ``rag``: retrieval-augmented generation over a corpus: each query picks ``k`` documents
  (Zipf popularity), reads their chunks (shared across queries) and stores its own.
- ``mixed``: ``chat`` with half the sessions on a 70B model and half on an 8B one (two
  namespaces; their chunks differ in bytes and in recompute cost).
- ``agent``: agent loops with long, growing contexts: agents take steps in random order,
  each step reading every earlier chunk of its agent's context and storing a new one; the
  engine announces the agent ``lookahead`` steps ahead (its request queue).
It owns no store and does no I/O but reading a ShareGPT file.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import InvalidObject

CHUNK_TOKENS = 256
BYTES_PER_TOKEN = 32 * 2 * 8 * 128 * 2  # Llama-3-8B, fp16: 128 KiB per token
CHARS_PER_TOKEN = 4  # ShareGPT text -> tokens (the usual rough rule for English)


class Ops:
    """Builds a list of trace ops with a running clock."""

    def __init__(self, chunk_tokens: int, bytes_per_token: int) -> None:
        self.ops: list[dict[str, Any]] = []
        self.tokens, self.bytes = chunk_tokens, chunk_tokens * bytes_per_token

    def add(self, op: str, ns: str, key: str | None = None, session: str | None = None) -> None:
        o: dict[str, Any] = {"t": len(self.ops), "op": op, "ns": ns}
        if key is not None:
            o.update(key=key, bytes=self.bytes, tokens=self.tokens)
        if session is not None:
            o["session"] = session
        self.ops.append(o)


def _zipf(n: int, a: float) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1) ** a
    return w / w.sum()


def chat(*, sessions: int = 200, turns: tuple[int, int] = (4, 20), zipf_a: float = 1.0, lookahead: int = 8,
         seed: int = 0, chunk_tokens: int = CHUNK_TOKENS, bytes_per_token: int = BYTES_PER_TOKEN
         ) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    left = rng.integers(turns[0], turns[1] + 1, sessions)
    p = _zipf(sessions, zipf_a)
    order = []
    done = np.zeros(sessions, np.int64)
    for _ in range(int(left.sum())):
        live = np.where(done < left, p, 0.0)
        sid = int(rng.choice(sessions, p=live / live.sum()))
        order.append(sid)
        done[sid] += 1
    b = Ops(chunk_tokens, bytes_per_token)
    chunks = [0] * sessions
    for n, sid in enumerate(order):
        if lookahead and n + lookahead < len(order):
            b.add("session", "chat", session=f"s{order[n + lookahead]}")
        for c in range(chunks[sid]):
            b.add("get", "chat", f"s{sid}-{c}")
        for _ in range(int(rng.integers(1, 3))):
            b.add("put", "chat", f"s{sid}-{chunks[sid]}", session=f"s{sid}")
            chunks[sid] += 1
    return b.ops


def tenants(*, tenants: int = 50, prompt_chunks: tuple[int, int] = (2, 16), requests: int = 3000, zipf_a: float = 1.1,
            seed: int = 0, chunk_tokens: int = CHUNK_TOKENS, bytes_per_token: int = BYTES_PER_TOKEN
            ) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    sizes = rng.integers(prompt_chunks[0], prompt_chunks[1] + 1, tenants)
    p = _zipf(tenants, zipf_a)
    b = Ops(chunk_tokens, bytes_per_token)
    for r in range(requests):
        t = int(rng.choice(tenants, p=p))
        for c in range(int(sizes[t])):
            b.add("get", "tenants", f"sys{t}-{c}")
        b.add("put", "tenants", f"req{r}")
    return b.ops


def rag(*, documents: int = 1000, doc_chunks: tuple[int, int] = (1, 4), queries: int = 2000, k: int = 3,
        zipf_a: float = 0.9, seed: int = 0, chunk_tokens: int = CHUNK_TOKENS, bytes_per_token: int = BYTES_PER_TOKEN
        ) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    sizes = rng.integers(doc_chunks[0], doc_chunks[1] + 1, documents)
    p = _zipf(documents, zipf_a)
    b = Ops(chunk_tokens, bytes_per_token)
    for q in range(queries):
        for d in rng.choice(documents, size=k, replace=False, p=p):
            for c in range(int(sizes[int(d)])):
                b.add("get", "rag", f"doc{int(d)}-{c}")
        b.add("put", "rag", f"q{q}")
    return b.ops


def agent(*, agents: int = 40, steps: tuple[int, int] = (10, 50), lookahead: int = 8, seed: int = 0,
          chunk_tokens: int = CHUNK_TOKENS, bytes_per_token: int = BYTES_PER_TOKEN) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    left = rng.integers(steps[0], steps[1] + 1, agents)
    order = []
    done = np.zeros(agents, np.int64)
    while (done < left).any():
        a = int(rng.choice(np.flatnonzero(done < left)))
        order.append(a)
        done[a] += 1
    b = Ops(chunk_tokens, bytes_per_token)
    done[:] = 0
    for n, a in enumerate(order):
        if lookahead and n + lookahead < len(order):
            b.add("session", "agent", session=f"a{order[n + lookahead]}")
        for c in range(int(done[a])):
            b.add("get", "agent", f"a{a}-{c}")
        b.add("put", "agent", f"a{a}-{int(done[a])}", session=f"a{a}")
        done[a] += 1
    return b.ops


# ``mixed``: two models served from one store, each in its namespace (parameters; KV bytes per token,
# fp16: an 8B model with 32 layers x 8 KV heads x 128 dims, a 70B one with 80 layers x 8 x 128)
MIXED_MODELS = {"m8b": 8e9, "m70b": 70e9}
MIXED_BYTES_PER_TOKEN = {"m8b": 32 * 2 * 8 * 128 * 2, "m70b": 80 * 2 * 8 * 128 * 2}


def mixed(*, sessions: int = 200, turns: tuple[int, int] = (4, 20), zipf_a: float = 1.0, lookahead: int = 8,
          seed: int = 0, chunk_tokens: int = CHUNK_TOKENS) -> list[dict[str, Any]]:
    """``chat`` with every other session on the 70B model (namespace ``m70b``: 2.5x the bytes per
    token, 8.75x the recompute FLOPs) and the rest on the 8B one (``m8b``): a trace whose misses
    do not all cost the same per byte."""
    ops = chat(sessions=sessions, turns=turns, zipf_a=zipf_a, lookahead=lookahead, seed=seed,
               chunk_tokens=chunk_tokens)
    for o in ops:
        sid = int((o.get("key") or o.get("session") or "s0")[1:].split("-")[0])
        ns = "m70b" if sid % 2 else "m8b"
        o["ns"] = ns
        if "key" in o:
            o["bytes"] = chunk_tokens * MIXED_BYTES_PER_TOKEN[ns]
    return ops


SHAPES: dict[str, Callable[..., list[dict[str, Any]]]] = {"chat": chat, "tenants": tenants, "rag": rag,
                                                          "agent": agent, "mixed": mixed}


def generate(shape: str, **params: Any) -> list[dict[str, Any]]:
    """The ops of a generated trace of ``shape`` (``SHAPES``) with its parameters."""
    if shape not in SHAPES:
        raise InvalidObject(f"shape must be one of {', '.join(SHAPES)}, got {shape!r}")
    return SHAPES[shape](**params)


def sharegpt(path: str, *, zipf_a: float = 1.0, seed: int = 0, chunk_tokens: int = CHUNK_TOKENS,
             bytes_per_token: int = BYTES_PER_TOKEN, limit: int | None = None) -> list[dict[str, Any]]:
    """A chat trace from a ShareGPT-style file (a JSON list of ``{"conversations": [{"from":
    ..., "value": text}, ...]}``): each conversation is a session, each of its turns appends
    its text's tokens (characters / 4) to the context; a turn reads the chunks of the context
    so far and stores the chunks its text completes.  Sessions interleave as in ``chat``
    (Zipf-popular sessions come back sooner)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise InvalidObject(f"{path}: not a readable ShareGPT JSON file ({e})", path=path) from None
    if not isinstance(data, list):
        raise InvalidObject(f"{path}: a ShareGPT file is a JSON list of conversations", path=path)
    convs = []
    for item in data[:limit]:
        turns = item.get("conversations") if isinstance(item, dict) else None
        if isinstance(turns, list):
            if any(isinstance(t, dict) and not isinstance(t.get("value", ""), str) for t in turns):
                bad = next(t["value"] for t in turns if isinstance(t, dict) and not isinstance(t.get("value", ""), str))
                raise InvalidObject(f"{path}: conversation {len(convs) + 1}: a turn's value is its text (a string), "
                                    f"got {type(bad).__name__}", path=path)
            lens = [len(t.get("value", "")) // CHARS_PER_TOKEN for t in turns if isinstance(t, dict)]
            if lens:
                convs.append(lens)
    if not convs:
        raise InvalidObject(f"{path}: no conversations found", path=path)
    rng = np.random.default_rng(seed)
    p = _zipf(len(convs), zipf_a)
    next_turn = [0] * len(convs)
    tokens = [0] * len(convs)
    b = Ops(chunk_tokens, bytes_per_token)
    while True:
        live = np.array([p[i] if next_turn[i] < len(c) else 0.0 for i, c in enumerate(convs)])
        if live.sum() == 0:
            return b.ops
        sid = int(rng.choice(len(convs), p=live / live.sum()))
        have = tokens[sid] // chunk_tokens
        for c in range(have):
            b.add("get", "chat", f"c{sid}-{c}")
        tokens[sid] += convs[sid][next_turn[sid]]
        next_turn[sid] += 1
        for c in range(have, tokens[sid] // chunk_tokens):
            b.add("put", "chat", f"c{sid}-{c}", session=f"c{sid}")
