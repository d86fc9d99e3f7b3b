"""Property tests of the codecs (issue 6): a lossless codec returns every bit it was given.

Codec 0 (raw) is the only codec of format 1.0; these properties apply to every lossless codec
added later (run them with its id).  Inputs are arbitrary bit patterns, so NaNs with payloads,
signed zeros, infinities and denormals all occur; shapes are arbitrary and include zero-size
ones, which the API rejects with ``InvalidObject`` before writing anything (docs/guide.md).
Whole reads and partial reads (``layers=``, ``rows=``) are both checked, byte for byte.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tierstore
from tierstore import Blob, InvalidObject, KVCache, Vectors

from .conftest import needs_torch

NUMPY_DTYPES = ["float16", "float32", "float64"]
TORCH_DTYPES = ["float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2"]
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def store():
    d = tempfile.mkdtemp(prefix="tierstore-props-")
    s = tierstore.open(d, durability="none")
    yield s
    s.close()
    shutil.rmtree(d)


_keys = itertools.count()


def _bits(shape: tuple[int, ...], itemsize: int, seed: int) -> np.ndarray:
    """Arbitrary bit patterns (every float class occurs), as raw bytes of the given shape."""
    n = int(np.prod(shape)) * itemsize
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _np_array(shape: tuple[int, ...], dtype: str, seed: int) -> np.ndarray:
    dt = np.dtype(dtype)
    return _bits(shape, dt.itemsize, seed).view(dt).reshape(shape)


def _torch_array(shape: tuple[int, ...], dtype: str, seed: int):
    import torch

    dt = getattr(torch, dtype)
    if 0 in shape:
        return torch.empty(shape, dtype=dt)
    raw = torch.from_numpy(_bits(shape, torch.empty(0, dtype=dt).element_size(), seed).copy())
    return raw.view(dt).reshape(shape)


def _raw(a) -> bytes:
    if isinstance(a, np.ndarray):
        return np.ascontiguousarray(a).tobytes()
    import torch

    return a.contiguous().view(torch.uint8).numpy().tobytes()


def _put_or_reject(store, obj_fn, shape):
    """Put an object; a zero-size shape must be rejected with InvalidObject, writing nothing."""
    key = f"k{next(_keys)}"
    if 0 in shape:
        before = store.stats()["counters"]["bytes_written"]
        with pytest.raises(InvalidObject):
            store.put(key, obj_fn())
        assert not store.contains(key) and store.stats()["counters"]["bytes_written"] == before
        return None
    store.put(key, obj_fn())
    return key


kv_shapes = st.tuples(st.integers(0, 5), st.just(2), st.integers(0, 3), st.integers(0, 9), st.integers(0, 9))


def _check_kv(store, arr, shape, layer_start, data):
    key = _put_or_reject(store, lambda: KVCache(arr, layer_start=layer_start), shape)
    if key is None:
        return
    got = store.get(key)
    assert got.layer_start == layer_start and tuple(got.data.shape) == shape
    assert str(got.data.dtype) == str(arr.dtype) and _raw(got.data) == _raw(arr)
    lo = data.draw(st.integers(0, shape[0] - 1))
    hi = data.draw(st.integers(lo + 1, shape[0]))
    part = store.get(key, layers=range(layer_start + lo, layer_start + hi))
    assert _raw(part.data) == _raw(arr[lo:hi]) and part.layer_start == layer_start + lo


@SETTINGS
@given(shape=kv_shapes, dtype=st.sampled_from(NUMPY_DTYPES), seed=st.integers(0, 2**32 - 1),
       layer_start=st.integers(0, 100), data=st.data())
def test_kv_numpy_round_trips_every_bit(store, shape, dtype, seed, layer_start, data):
    _check_kv(store, _np_array(shape, dtype, seed), shape, layer_start, data)


@needs_torch
@SETTINGS
@given(shape=kv_shapes, dtype=st.sampled_from(TORCH_DTYPES), seed=st.integers(0, 2**32 - 1),
       layer_start=st.integers(0, 100), data=st.data())
def test_kv_torch_round_trips_every_bit(store, shape, dtype, seed, layer_start, data):
    _check_kv(store, _torch_array(shape, dtype, seed), shape, layer_start, data)


@SETTINGS
@given(n=st.integers(0, 300), dim=st.integers(0, 40), dtype=st.sampled_from(NUMPY_DTYPES),
       seed=st.integers(0, 2**32 - 1), with_ids=st.booleans(), data=st.data())
def test_vectors_round_trip_every_bit(store, n, dim, dtype, seed, with_ids, data):
    arr = _np_array((n, dim), dtype, seed)
    ids = np.random.default_rng(seed).integers(-(2**63), 2**63 - 1, n, dtype=np.int64) if with_ids else None
    key = _put_or_reject(store, lambda: Vectors(arr, ids=ids), (n, dim))
    if key is None:
        return
    got = store.get(key)
    assert got.data.dtype == arr.dtype and _raw(got.data) == _raw(arr)
    assert (got.ids is None) == (ids is None) and (ids is None or np.array_equal(got.ids, ids))
    rows = sorted(set(data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=12))))
    part = store.get(key, rows=rows)
    assert _raw(part.data) == _raw(arr[rows])
    assert ids is None or np.array_equal(part.ids, ids[rows])


@SETTINGS
@given(payload=st.binary(max_size=20_000))
def test_blobs_round_trip_every_byte(store, payload):
    key = f"b{next(_keys)}"
    store.put(key, Blob(payload))
    assert store.get(key).data == payload  # empty blobs included

