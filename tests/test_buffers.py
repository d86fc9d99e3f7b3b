"""Read buffers (tierstore/buffers.py): reused only once nothing references them."""

import gc

import numpy as np
import pytest

import tierstore
from tierstore import buffers
from tierstore.format import constants as fmt

from .conftest import needs_torch

MIB = 1 << 20


def test_a_buffer_comes_back_only_when_its_last_view_is_gone():
    pool = buffers.ReadBuffers()
    a = pool.take(3 * MIB + 5)
    assert a.nbytes == 3 * MIB + 5 and a.ctypes.data % fmt.PAGE == 0 and a.flags.writeable
    addr = a.ctypes.data
    view = a[100:200].view(np.float32)  # a view keeps it
    del a
    gc.collect()
    b = pool.take(3 * MIB + 5)
    assert b.ctypes.data != addr and pool.counters["reused"] == 0
    addrs = {addr, b.ctypes.data}
    del view, b
    gc.collect()
    assert pool.idle_bytes == 2 * 4 * MIB  # both, each rounded up to whole MiB
    c = pool.take(4 * MIB)  # the same size class
    assert c.ctypes.data in addrs and pool.counters["reused"] == 1
    assert pool.idle_bytes == 4 * MIB


@needs_torch
def test_a_tensor_over_a_buffer_keeps_it():
    import torch

    pool = buffers.ReadBuffers()
    t = torch.from_numpy(pool.take(2 * MIB).view(np.float16))
    addr = t.data_ptr()
    gc.collect()
    assert pool.idle_bytes == 0
    assert pool.take(2 * MIB).ctypes.data != addr  # (dropped at once: it comes back)
    del t
    gc.collect()
    assert pool.idle_bytes == 2 * 2 * MIB


def test_small_buffers_are_not_pooled_and_idle_memory_is_bounded():
    pool = buffers.ReadBuffers(idle_max=5 * MIB)
    small = pool.take(4096)
    assert small.ctypes.data % fmt.PAGE == 0 and pool.counters["taken"] == 0
    held = [pool.take(2 * MIB) for _ in range(4)]
    del held
    gc.collect()
    assert pool.idle_bytes == 4 * MIB  # two kept, two unmapped: at most idle_max
    pool.trim()
    assert pool.idle_bytes == 0


@pytest.mark.parametrize("dram_bytes", [0, "64MiB"])
def test_gets_in_reused_buffers_return_their_own_bytes(store_path, dram_bytes):
    """Objects read one after another into reused memory: each get returns its own values,
    and a result still held is never overwritten by a later get."""
    rng = np.random.default_rng(5)
    kvs = [rng.standard_normal((4, 2, 2, 256, 64)).astype(np.float32) for _ in range(3)]  # 2 MiB each
    with tierstore.open(store_path, dram_bytes=dram_bytes) as s:
        for i, kv in enumerate(kvs):
            s.put(f"c{i}", tierstore.KVCache(kv))
        reused = buffers.pool().counters["reused"]
        kept = s.get("c0").data
        for _ in range(3):
            for i, kv in enumerate(kvs):
                got = s.get(f"c{i}")
                assert np.array_equal(got.data, kv)
                del got
        assert np.array_equal(kept, kvs[0])
        assert buffers.pool().counters["reused"] > reused
