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


def test_buffers_of_a_size_no_longer_read_give_way_to_new_ones():
    pool = buffers.ReadBuffers(idle_max=8 * MIB)
    old = [pool.take(2 * MIB) for _ in range(4)]
    del old
    gc.collect()
    assert pool.idle_bytes == 8 * MIB  # the pool is full of 2 MiB buffers ...
    for _ in range(3):  # ... and the workload now reads 4 MiB: the oldest idle ones are unmapped
        pool.take(4 * MIB)
        gc.collect()
    assert pool.counters["reused"] == 2 and pool.counters["unmapped"] == 2 and pool.idle_bytes == 8 * MIB


def test_a_forked_child_takes_buffers_while_a_parent_thread_held_the_pool(tmp_path):
    """A fork while another thread holds the pool's lock: the child gets a fresh lock (and no
    idle buffers), so its reads do not hang."""
    import os
    import threading

    pool = buffers.pool()
    held, release = threading.Event(), threading.Event()

    def hold():
        with pool._lock:  # noqa: SLF001 (the lock a reader thread holds at the fork)
            held.set()
            release.wait(30)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(30)
    pid = os.fork()
    if pid == 0:  # the child: a get-sized take, then exit with its answer
        try:
            ok = buffers.pool().idle_bytes == 0 and buffers.take(2 * MIB).nbytes == 2 * MIB
        finally:
            os._exit(0 if ok else 1)
    release.set()
    t.join()
    deadline = __import__("time").monotonic() + 30
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if __import__("time").monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            raise AssertionError("the forked child hung taking a buffer")
        __import__("time").sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0
