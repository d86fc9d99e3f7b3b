"""Interleaved rANS entropy coding with static frequency tables (SPEC.md §6.6).

One job: symbols <-> bytes, given a frequency table that sums to 2^12.  The coder is the
textbook byte-exact rANS with a 32-bit state and 16-bit renormalisation, run on many lanes
at once (symbol j goes to lane j mod lanes) so that numpy can vectorise it; all lanes share
one word stream.  Every step is integer arithmetic, so any reader that follows SPEC.md
decodes the same symbols.  No I/O; decoders validate everything and raise CorruptionError.

Two implementations of the same arithmetic: loops compiled by numba when it is installed
(``pip install 'tierstore[fast]'``; compiled on first use, ~20x faster), else numpy, one
vectorised step over all lanes at a time.  They produce and accept the same bytes (tests
compare them on the real K/V sample and on damaged streams); ``COMPILED`` says which one
runs, and ``TIERSTORE_RANS=numpy`` in the environment chooses numpy.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
from typing import Any

import numpy as np

from ..errors import CorruptionError

_log = logging.getLogger("tierstore.codecs")

PROB_BITS = 12
PROB_SCALE = 1 << PROB_BITS
STATE_LOW = 1 << 16  # states live in [2^16, 2^32)
MAX_LANES = 256


def lanes_for(n: int) -> int:
    return max(1, min(MAX_LANES, n))


def normalize(counts: np.ndarray) -> np.ndarray:
    """Symbol counts -> uint16 frequencies summing to 2^12, nonzero wherever a count is."""
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    if total == 0:
        raise ValueError("no symbols")
    f = counts * PROB_SCALE // total
    f[(counts > 0) & (f == 0)] = 1
    f[int(np.argmax(counts))] += PROB_SCALE - int(f.sum())
    if f.min() < 0 or (f[counts > 0] < 1).any():
        raise ValueError("cannot normalise these counts")  # (more than 2^11 rare symbols)
    return f.astype(np.uint16)


def pad_symbol(freqs: np.ndarray) -> int:
    """The symbol that fills the last step of lanes: the most frequent (lowest on ties)."""
    return int(np.argmax(freqs))


_U32 = np.uint32  # (the encoder's loop runs in 32-bit integers: a 32-bit division costs less)


def _encode_loops(sym: np.ndarray, n: int, pad: int, lanes: int, steps: int, f: np.ndarray, cum: np.ndarray,
                  x: np.ndarray, words: np.ndarray) -> int:
    """The encoder one symbol at a time (compiled by numba): the same arithmetic as the numpy
    steps below, lanes visited in reverse; symbols past ``n`` are ``pad``.  ``f``, ``cum`` and
    the states ``x`` are uint32 (x < f * 2^20 <= 2^32 is tested as x >> 20 >= f, which cannot
    overflow).  The words are written from the end of ``words`` backwards, so that its last k
    (k returned) are the stream in order."""
    k = 0
    cap = words.shape[0]
    for i in range(steps - 1, -1, -1):
        base = i * lanes
        for j in range(lanes - 1, -1, -1):
            s = sym[base + j] if base + j < n else pad
            fs = f[s]
            xj = x[j]
            if (xj >> _U32(20)) >= fs:
                k += 1
                words[cap - k] = xj & _U32(0xFFFF)
                xj >>= _U32(16)
            q = xj // fs  # (one division: the remainder is xj - q * fs)
            x[j] = (q << _U32(12)) + (xj - q * fs) + cum[s]
    return k


def _decode_loops(x: np.ndarray, words: np.ndarray, f: np.ndarray, cum: np.ndarray, slot_sym: np.ndarray,
                  out: np.ndarray, lanes: int, steps: int) -> int:
    """The decoder one symbol at a time (compiled by numba); -1 if the words run out."""
    pos = 0
    n_words = words.shape[0]
    for i in range(steps):
        base = i * lanes
        for j in range(lanes):
            xj = x[j]
            slot = xj & 4095
            s = slot_sym[slot]
            out[base + j] = s
            xj = f[s] * (xj >> 12) + slot - cum[s]
            if xj < 65536:
                if pos >= n_words:
                    return -1
                xj = (xj << 16) | words[pos]
                pos += 1
            x[j] = xj
    return pos


def _available() -> bool:
    """Whether the numba loops may run: numba installed (looked for, not imported: that takes
    ~0.1 s, paid at the first compiled call instead), numpy not asked for, and the code not
    instrumented by a fuzzer (numba cannot compile that)."""
    if os.environ.get("TIERSTORE_RANS") == "numpy" or "_trace_branch" in _decode_loops.__code__.co_names:
        return False
    return importlib.util.find_spec("numba") is not None


def jit(*fns: Any) -> tuple[Any, ...]:
    """``fns`` compiled by numba (installed), cached on disk where numba finds a writable place:
    beside the package or under the user's cache; with neither (a read-only package and home,
    e.g. a read-only container), compiled anew in each process instead of failing."""
    import numba

    try:
        return tuple(numba.njit(cache=True, nogil=True, boundscheck=False)(f) for f in fns)
    except RuntimeError:  # "cannot cache function ...: no locator available"
        return tuple(numba.njit(cache=False, nogil=True, boundscheck=False)(f) for f in fns)


class Lazy:
    """Functions compiled by ``jit`` at their first use, once (thread-safe): ``get()`` returns
    them, or None where numba is installed but does not import (e.g. a numpy newer than it
    supports): numpy runs then, as without numba, and that is logged once."""

    _failed: str | None = None  # (shared: numba's import failed once, it fails for every Lazy)

    def __init__(self, *fns: Any) -> None:
        self.fns, self.compiled, self._lock = fns, None, threading.Lock()

    def get(self) -> tuple[Any, ...] | None:
        if self.compiled is None and Lazy._failed is None:
            with self._lock:
                if self.compiled is None and Lazy._failed is None:
                    try:
                        self.compiled = jit(*self.fns)
                    except ImportError as e:
                        Lazy._failed = f"{type(e).__name__}: {e}"
                        _log.warning("tierstore: numba is installed but does not import (%s); kvq-ans runs "
                                     "its numpy loops (~15x slower, same bytes)", Lazy._failed)
        return self.compiled


AVAILABLE = _available()  # (a forced compiled=True runs numpy without it)
COMPILED = AVAILABLE  # the default
_KERNELS = Lazy(_encode_loops, _decode_loops)


def encode(symbols: np.ndarray, freqs: np.ndarray, *, compiled: bool | None = None) -> bytes:
    """``symbols`` (ints < len(freqs), each with a nonzero frequency) -> the stream:
    ``state u32[lanes]``, ``n_words u32``, ``words u16[n_words]``.  ``compiled``: force the
    numba (True) or numpy (False) implementation; by default numba when installed."""
    n = len(symbols)
    lanes = lanes_for(n)
    steps = -(-n // lanes)
    kernels = _KERNELS.get() if (COMPILED if compiled is None else compiled) and AVAILABLE else None
    if kernels is not None:
        x32 = np.full(lanes, STATE_LOW, dtype=np.uint32)
        buf = np.empty(steps * lanes, dtype=np.uint16)  # (at most one word per symbol)
        f32 = freqs.astype(np.uint32)
        cum32 = np.concatenate([[0], np.cumsum(f32)[:-1]]).astype(np.uint32)
        sym = np.ascontiguousarray(symbols)
        if sym.dtype.kind not in "iu" or sym.dtype.itemsize > 4:  # (numba would mix uint64 and the pad as floats)
            sym = sym.astype(np.int64)
        k = kernels[0](sym, n, pad_symbol(freqs), lanes, steps, f32, cum32, x32, buf)
        return b"".join([x32.astype("<u4", copy=False).tobytes(), np.uint32(k).astype("<u4").tobytes(),
                         buf[len(buf) - k:].astype("<u2", copy=False).tobytes()])
    sym = np.full(steps * lanes, pad_symbol(freqs), dtype=np.int64)
    sym[:n] = symbols
    sym = sym.reshape(steps, lanes)
    f_all = freqs.astype(np.uint64)
    cum = np.concatenate([[0], np.cumsum(f_all)[:-1]]).astype(np.uint64)
    x = np.full(lanes, STATE_LOW, dtype=np.uint64)
    chunks: list[np.ndarray] = []
    for i in range(steps - 1, -1, -1):
        s = sym[i]
        f = f_all[s]
        c = cum[s]
        out = x >= (f << np.uint64(20))  # renormalise first: the next state must stay < 2^32
        if out.any():
            chunks.append((x[out] & np.uint64(0xFFFF)).astype(np.uint16)[::-1])
            x[out] >>= np.uint64(16)
        x = (x // f << np.uint64(PROB_BITS)) + x % f + c
    words = np.concatenate(chunks)[::-1] if chunks else np.zeros(0, np.uint16)
    return b"".join([x.astype("<u4").tobytes(), np.uint32(len(words)).astype("<u4").tobytes(),
                     words.astype("<u2").tobytes()])


def decode(data: memoryview | bytes, freqs: np.ndarray, n: int, *, compiled: bool | None = None
           ) -> tuple[np.ndarray, int]:
    """The first ``n`` symbols of the stream at the start of ``data``, and the stream's length."""
    if freqs.ndim != 1 or int(freqs.astype(np.int64).sum()) != PROB_SCALE:
        raise CorruptionError("rANS frequency table does not sum to 2^12")
    lanes = lanes_for(n)
    steps = -(-n // lanes)
    head = 4 * lanes + 4
    if len(data) < head:
        raise CorruptionError("rANS stream truncated")
    x = np.frombuffer(data, "<u4", lanes).astype(np.uint64)
    n_words = int(np.frombuffer(data, "<u4", 1, 4 * lanes)[0])
    end = head + 2 * n_words
    if len(data) < end or (x < STATE_LOW).any():
        raise CorruptionError("rANS stream truncated or with a bad state")
    words = np.frombuffer(data, "<u2", n_words, head).astype(np.uint64)
    f_all = freqs.astype(np.uint64)
    cum = np.concatenate([[0], np.cumsum(f_all)[:-1]]).astype(np.uint64)
    slot_sym = np.repeat(np.arange(len(freqs)), freqs.astype(np.int64))
    kernels = _KERNELS.get() if (COMPILED if compiled is None else compiled) and AVAILABLE else None
    if kernels is not None:
        x64 = x.astype(np.int64)
        flat = np.empty(steps * lanes, dtype=np.int64)
        f64 = freqs.astype(np.int64)
        cum64 = np.concatenate([[0], np.cumsum(f64)[:-1]]).astype(np.int64)
        used = kernels[1](x64, words.astype(np.int64), f64, cum64, slot_sym.astype(np.int64), flat, lanes, steps)
        if used < 0:
            raise CorruptionError("rANS stream ends early")
        if used != n_words or (x64 != STATE_LOW).any():
            raise CorruptionError("rANS stream does not end where it should")
        return flat[:n], end
    out = np.empty((steps, lanes), dtype=np.int64)
    pos = 0
    mask = np.uint64(PROB_SCALE - 1)
    for i in range(steps):
        slot = x & mask
        s = slot_sym[slot.astype(np.int64)]
        out[i] = s
        x = f_all[s] * (x >> np.uint64(PROB_BITS)) + slot - cum[s]
        low = x < STATE_LOW
        k = int(low.sum())
        if k:
            if pos + k > n_words:
                raise CorruptionError("rANS stream ends early")
            x[low] = (x[low] << np.uint64(16)) | words[pos : pos + k]
            pos += k
    if pos != n_words or (x != STATE_LOW).any():
        raise CorruptionError("rANS stream does not end where it should")
    return out.reshape(-1)[:n], end
