"""The two implementations of rANS (SPEC.md §6.6): loops compiled by numba and numpy steps.
They must write the same bytes and read any input, valid or damaged, the same way: the same
symbols, or CorruptionError from both.  The kvq-ans extents of the real K/V sample are the
golden case (their bytes are fixed by the format: tests/test_golden.py reads the stored ones).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore import CorruptionError, codecs
from tierstore.codecs import rans

needs_numba = pytest.mark.skipif(not rans.COMPILED or rans._KERNELS.get() is None,
                                 reason="numba not installed (the 'fast' extra) or not importable")


def _decode_both(data: bytes, freqs: np.ndarray, n: int) -> tuple[object, object]:
    out = []
    for compiled in (False, True):
        try:
            sym, used = rans.decode(data, freqs, n, compiled=compiled)
            out.append((sym.tolist(), used))
        except CorruptionError as e:
            out.append(("CorruptionError", str(e)))
    return out[0], out[1]


@needs_numba
@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 3000), alphabet=st.integers(2, 64), seed=st.integers(0, 2**32 - 1))
def test_both_implementations_write_the_same_stream(n, alphabet, seed):
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 50, size=alphabet)
    counts[rng.integers(alphabet)] += 1
    freqs = rans.normalize(counts)
    symbols = rng.choice(alphabet, size=n, p=freqs / freqs.sum())
    a = rans.encode(symbols, freqs, compiled=False)
    b = rans.encode(symbols, freqs, compiled=True)
    assert a == b
    sym, used = rans.decode(a, freqs, n, compiled=True)
    assert used == len(a) and np.array_equal(sym, symbols)


@needs_numba
@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 2000), seed=st.integers(0, 2**32 - 1), cuts=st.integers(0, 3), flips=st.integers(0, 4))
def test_both_implementations_agree_on_damaged_streams(n, seed, cuts, flips):
    rng = np.random.default_rng(seed)
    freqs = rans.normalize(rng.integers(1, 30, size=12))
    data = bytearray(rans.encode(rng.choice(12, size=n, p=freqs / freqs.sum()), freqs))
    for _ in range(flips):
        data[rng.integers(len(data))] ^= 1 << int(rng.integers(8))
    if cuts:
        data = data[: int(rng.integers(len(data) + 1))]
    plain, compiled = _decode_both(bytes(data), freqs, n)
    assert plain == compiled


@needs_numba
def test_kvq_ans_extents_of_the_real_sample_are_the_same_bytes(real_kv, monkeypatch):
    choice = codecs.parse("kvq-ans", "kv")
    for layer in range(real_kv.shape[0]):
        ext = codecs.Extent("kv", tuple(real_kv.shape[1:]), "float16", layer)
        raw = np.ascontiguousarray(real_kv[layer]).reshape(-1).view(np.uint8)
        got = {}
        for compiled in (False, True):
            monkeypatch.setattr(rans, "COMPILED", compiled)
            data = bytes(codecs.encode(choice.codec, raw, ext, choice.params))
            got[compiled] = (data, codecs.decode(choice.codec, data, ext, choice.params).tobytes())
        assert got[False] == got[True]


def test_numpy_implementation_round_trips_without_numba():
    """What runs when numba is absent (or TIERSTORE_RANS=numpy)."""
    rng = np.random.default_rng(7)
    freqs = rans.normalize(rng.integers(1, 100, size=20))
    symbols = rng.choice(20, size=5000, p=freqs / freqs.sum())
    data = rans.encode(symbols, freqs, compiled=False)
    sym, used = rans.decode(data, freqs, 5000, compiled=False)
    assert used == len(data) and np.array_equal(sym, symbols)
    with pytest.raises(CorruptionError):
        rans.decode(data[:-2], freqs, 5000, compiled=False)


@needs_numba
@settings(max_examples=120, deadline=None)
@given(heads=st.integers(1, 4), tokens=st.integers(1, 40), dims=st.integers(1, 16), seed=st.integers(0, 2**32 - 1),
       scale=st.sampled_from([1e-7, 1e-3, 1.0, 300.0, 3e4]), bins=st.sampled_from(["64/32", "32/26", "12/12", "256/4"]))
def test_kvq_ans_symbols_from_the_compiled_loops_are_numpys(heads, tokens, dims, seed, scale, bins):
    """kvq-ans's K and V symbols and their counts, one compiled pass each (codecs/kvq.py), against
    numpy's minmax_codes / log_int8: all-zero heads, constant channels, zero tokens, ties."""
    from tierstore.codecs import kvq

    rng = np.random.default_rng(seed)
    x = np.clip(rng.standard_normal((2, heads, tokens, dims)) * scale, -65504, 65504)
    x[:, 0, : tokens // 2] = 0  # zero tokens (V: absmax 0) and zero stretches of channels
    x[0, -1, :, 0] = x[0, -1, 0, 0]  # a constant K channel (step 0)
    x[1, -1, -1] = np.round(x[1, -1, -1])  # integers: ties after scaling are likelier
    x = x.astype(np.float16).astype(np.float32)
    params = codecs.parse(f"kvq-ans:bins={bins}", "kv").params
    ext = codecs.Extent("kv", x.shape, "float16", int(rng.integers(3)))
    assert kvq.encode(x, ext, params, compiled=True) == kvq.encode(x, ext, params, compiled=False)


@needs_numba
def test_without_a_writable_cache_directory_the_loops_still_compile(monkeypatch):
    """A read-only package and home (a read-only container): numba cannot cache, and the import
    must not fail for it (a cold review: it raised RuntimeError at import)."""
    import numba

    real = numba.njit

    def njit(*args, cache=False, **kwargs):
        if cache:
            def refuse(fn):
                raise RuntimeError(f"cannot cache function {fn.__name__!r}: no locator available for file")
            return refuse
        return real(*args, cache=cache, **kwargs)

    monkeypatch.setattr(numba, "njit", njit)
    monkeypatch.setattr(rans, "_KERNELS", rans.Lazy(rans._encode_loops, rans._decode_loops))  # compiled below
    rng = np.random.default_rng(3)
    freqs = rans.normalize(rng.integers(1, 50, size=16))
    symbols = rng.choice(16, size=3000, p=freqs / freqs.sum())
    data = rans.encode(symbols, freqs, compiled=True)
    assert data == rans.encode(symbols, freqs, compiled=False)
    assert np.array_equal(rans.decode(data, freqs, 3000, compiled=True)[0], symbols)


@needs_numba
@pytest.mark.parametrize("dtype", [np.uint8, np.int16, np.uint32, np.int64, np.uint64])
def test_symbols_of_any_integer_dtype_encode_alike(dtype):
    rng = np.random.default_rng(4)
    freqs = rans.normalize(rng.integers(1, 9, size=200))
    symbols = rng.choice(200, size=1000, p=freqs / freqs.sum())
    assert rans.encode(symbols.astype(dtype), freqs, compiled=True) == rans.encode(symbols, freqs, compiled=False)


def test_importing_tierstore_does_not_import_numba():
    """numba is imported at the first compiled call: its import (~0.1 s and ~30,000 objects the
    garbage collector then scans) is not paid by every process and command that imports tierstore."""
    code = ("import sys, tierstore, tierstore.codecs.kvq; assert 'numba' not in sys.modules; "
            "import numpy as np; from tierstore.codecs import rans; f = rans.normalize(np.ones(4)); "
            "rans.encode(np.arange(4).repeat(100), f); print('numba' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(rans.COMPILED and rans._KERNELS.get() is not None)


def test_a_numba_that_is_installed_but_does_not_import_leaves_numpy_running(tmp_path):
    """numba is found but its import fails (e.g. "Numba needs NumPy 2.2 or less"): kvq-ans encodes
    and decodes with numpy, the same bytes, and says so once -- as when numba was imported with
    tierstore and a failed import was caught there."""
    fake = tmp_path / "site" / "numba"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise ImportError("Numba needs NumPy 2.2 or less")\n')
    code = f"""
import logging, sys, numpy as np
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
import tierstore
from tierstore.codecs import rans
assert rans.AVAILABLE  # (found, not imported)
x = np.random.default_rng(0).standard_normal((2, 2, 4, 64, 16)).astype(np.float16)
with tierstore.open({str(tmp_path / "s")!r}) as s:
    s.put("k", tierstore.KVCache(x), codec="kvq-ans")
    s.put("j", tierstore.KVCache(x), codec="kvq-ans")
    y = s.get("k").data
f = rans.normalize(np.ones(4))
sym = np.arange(4).repeat(50)
assert rans.encode(sym, f, compiled=True) == rans.encode(sym, f, compiled=False)
print("ok", float(np.abs(y.astype(np.float32) - x.astype(np.float32)).max()) < 0.5)
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), *sys.path])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[-1] == "ok True"
    assert [m for m in lines if "does not import" in m and "NumPy 2.2" in m] == lines[:1]  # said once
