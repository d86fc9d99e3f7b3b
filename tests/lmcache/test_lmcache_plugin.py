"""tierstore.integrations.lmcache.TierstoreBackend driven by LMCache's own engine (LMCacheEngine
store / retrieve on CPU), configured as a user would: storage_plugins + extra_config.  The
serving engine's side -- moving KV between its buffers and LMCache's memory objects -- is played
by a CPU connector over a plain tensor, so every byte retrieved can be compared."""

from __future__ import annotations

import itertools
import logging
import os
import subprocess
import sys
import tempfile
import time

import pytest
import torch
from lmcache.v1.cache_engine import LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.metadata import LMCacheMetadata

import tierstore
from tierstore.integrations.lmcache import TierstoreBackend, key_of, namespace_of

LAYERS, HEADS, DIM, CHUNK = 2, 2, 8, 16
_ids = itertools.count()


class CPUConnector(GPUConnectorInterface):
    """The serving engine's KV buffer: [layers, 2, tokens, heads, dim] on the CPU."""

    def __init__(self, kv: torch.Tensor) -> None:
        self.kv = kv

    def from_gpu(self, memory_obj, start, end, **kw):  # type: ignore[no-untyped-def]
        memory_obj.tensor.copy_(self.kv[:, :, start:end].transpose(0, 1).reshape(memory_obj.tensor.shape))

    def to_gpu(self, memory_obj, start, end, **kw):  # type: ignore[no-untyped-def]
        part = self.kv[:, :, start:end]
        part.copy_(memory_obj.tensor.reshape(2, LAYERS, end - start, HEADS, DIM).transpose(0, 1))

    def batched_from_gpu(self, memory_objs, starts, ends, **kw):  # type: ignore[no-untyped-def]
        for m, s, e in zip(memory_objs, starts, ends):
            self.from_gpu(m, s, e)

    def batched_to_gpu(self, memory_objs, starts, ends, **kw):  # type: ignore[no-untyped-def]
        for m, s, e in zip(memory_objs, starts, ends):
            self.to_gpu(m, s, e)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, LAYERS, num_tokens, HEADS * DIM])


def engine(path: str, kv: torch.Tensor, *, worker: int = 0, extra: dict | None = None, disk: str | None = None,
           model: str = "org/model-7b"):
    """An LMCacheEngine with the tierstore plugin only (no CPU tier), or LMCache's own disk backend."""
    cfg = {"chunk_size": CHUNK, "local_cpu": False, "max_local_cpu_size": 0.05, "save_unfull_chunk": False}
    if disk is not None:
        cfg.update({"local_disk": disk, "max_local_disk_size": 0.1})
    else:
        cfg.update({"storage_plugins": ["tierstore"], "extra_config": {
            "storage_plugin.tierstore.module_path": "tierstore.integrations.lmcache",
            "storage_plugin.tierstore.class_name": "TierstoreBackend",
            "tierstore.path": path, **(extra or {})}})
    meta = LMCacheMetadata(model_name=model, world_size=2, local_world_size=2, worker_id=worker,
                           local_worker_id=worker, kv_dtype=torch.float32, kv_shape=(LAYERS, 2, CHUNK, HEADS, DIM))
    eng = LMCacheEngineBuilder.get_or_create(f"e{next(_ids)}", LMCacheEngineConfig.from_dict(cfg), meta,
                                             CPUConnector(kv), lambda t, r: None, lambda o, r: o)
    eng.post_init()
    return eng


def backend_of(eng) -> TierstoreBackend:  # type: ignore[no-untyped-def]
    return next(b for b in eng.storage_manager.storage_backends.values() if isinstance(b, TierstoreBackend))


def wait_stored(eng, tokens, n):  # type: ignore[no-untyped-def]
    for _ in range(200):
        if eng.lookup(tokens) >= n:
            return
        time.sleep(0.02)
    raise AssertionError(f"only {eng.lookup(tokens)} of {n} tokens stored")


def retrieve(eng, tokens):  # type: ignore[no-untyped-def]
    eng.gpu_connector.kv.zero_()
    got = int(eng.retrieve(tokens).sum())
    return got, eng.gpu_connector.kv


def close(eng) -> None:  # type: ignore[no-untyped-def]
    """LMCache's own teardown: its stats logger too, then the engine (as vLLM's shutdown does)."""
    for iid, e in list(LMCacheEngineBuilder._instances.items()):
        if e is eng:
            LMCacheEngineBuilder.destroy(iid)
            return
    eng.close()


@pytest.fixture
def path(tmp_path):
    return str(tmp_path / "kv")


def test_store_and_retrieve_bit_exact(path):
    src = torch.randn(LAYERS, 2, 64, HEADS, DIM)
    eng = engine(path, src.clone())
    tokens = torch.arange(64)
    eng.store(tokens)
    wait_stored(eng, tokens, 64)
    got, kv = retrieve(eng, tokens)
    assert got == 64 and torch.equal(kv, src)
    b = backend_of(eng)
    ns = namespace_of(_keys(eng, tokens)[0])
    assert ns.startswith("lmcache~org~model-7b~ws2~w0~float32~") and len(ns) == 52  # (+ a 16-digit digest)
    assert len(b.store.keys(namespace=ns)) == 4
    info = b.store.info(b.store.keys(namespace=ns)[0], namespace=ns)
    assert info.kind == "kv" and info.shape == (LAYERS, 2, 1, CHUNK, HEADS * DIM)  # typed, one extent per layer
    close(eng)


RESTART = """
import sys, time, torch
sys.path.insert(0, {tests!r})
from test_lmcache_plugin import engine, retrieve, wait_stored, close
path, mode, disk = sys.argv[1], sys.argv[2], sys.argv[3] or None
src = torch.load(sys.argv[4])
tokens = torch.arange(100, 164)
eng = engine(path, src.clone() if mode == "store" else torch.zeros_like(src), disk=disk)
if mode == "store":
    eng.store(tokens)
    wait_stored(eng, tokens, 64)
    print(64)
else:
    got, kv = retrieve(eng, tokens)
    print(got if torch.equal(kv[:, :, :got], src[:, :, :got]) else -1)
close(eng)
"""


def _run(mode: str, path: str, disk: str, src: str) -> int:
    """One engine in a process of its own: a real restart (LMCache's chunk hashes need a fixed
    PYTHONHASHSEED across processes, as its own warning says)."""
    code = RESTART.format(tests=os.path.dirname(__file__))
    out = subprocess.run([sys.executable, "-c", code, path, mode, disk, src], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONHASHSEED": "0"})
    assert out.returncode == 0, out.stderr[-3000:]
    return int(out.stdout.split()[-1])


def test_chunks_survive_a_restart_of_the_process(path, tmp_path, capsys):
    src = str(tmp_path / "src.pt")
    torch.save(torch.randn(LAYERS, 2, 64, HEADS, DIM), src)
    assert _run("store", path, "", src) == 64
    assert _run("retrieve", path, "", src) == 64  # every token back, bit-exact, in a new process
    disk = str(tmp_path / "lmcache-disk")  # LMCache's own disk backend, the same way
    assert _run("store", path, disk, src) == 64
    own = _run("retrieve", path, disk, src)
    assert own >= 0  # (never wrong bytes)
    with capsys.disabled():
        print(f"\nafter a restart: tierstore plugin 64 of 64 tokens, LMCache's local disk backend {own} of 64")


def test_a_damaged_chunk_is_a_miss_never_returned(path, caplog):
    src = torch.randn(LAYERS, 2, 64, HEADS, DIM)
    tokens = torch.arange(200, 264)
    eng = engine(path, src.clone())
    eng.store(tokens)
    wait_stored(eng, tokens, 64)
    b = backend_of(eng)
    ns = b.store.namespaces()[0]
    keys = [key_of(k) for k in _keys(eng, tokens)]
    info = b.store.info(keys[1], namespace=ns)
    b.store.flush()
    close(eng)
    seg = os.path.join(path, "segments", f"{info.segment:016x}.tseg")
    with open(seg, "r+b") as f:  # flip a byte inside chunk 1's payload
        f.seek(info.offset + info.stored_bytes - 64)
        v = f.read(1)
        f.seek(info.offset + info.stored_bytes - 64)
        f.write(bytes([v[0] ^ 1]))
    eng = engine(path, torch.zeros_like(src))
    with caplog.at_level(logging.WARNING, logger="tierstore"):
        got, kv = retrieve(eng, tokens)
    assert got == 16  # chunk 0 only: the prefix ends at the damaged chunk
    assert torch.equal(kv[:, :, :16], src[:, :, :16]) and not kv[:, :, 16:].any()
    assert any("unreadable" in r.message for r in caplog.records)
    assert not backend_of(eng).store.contains(keys[1], namespace=ns)  # removed: the next store replaces it
    close(eng)


def test_batched_get_keeps_the_order_of_keys_from_disk_and_memory(path):
    """Chunks read on the reader threads (these small ones always come from the log: the DRAM
    tier leaves them to the page cache) come back in the order of the keys, a missing key as
    None, each bit-exact, round after round."""
    src = torch.randn(LAYERS, 2, 64, HEADS, DIM)
    tokens = torch.arange(300, 364)
    eng = engine(path, src.clone())
    eng.store(tokens)
    wait_stored(eng, tokens, 64)
    b = backend_of(eng)
    keys = _keys(eng, tokens)
    b.store.flush()
    b.store.drop_cached()
    assert b.remove(keys[2])
    for rnd in range(3):
        objs = b.batched_get_blocking(keys)
        assert objs[2] is None and all(o is not None for n, o in enumerate(objs) if n != 2)
        for n in (0, 1, 3):
            want = src[:, :, n * CHUNK:(n + 1) * CHUNK].transpose(0, 1).reshape(objs[n].tensor.shape)
            assert torch.equal(objs[n].tensor, want), (rnd, n)
            objs[n].ref_count_down()
        assert b.store.info(key_of(keys[0]), namespace=namespace_of(keys[0])).tiers == ("ssd",)
    close(eng)


def test_batched_get_gives_memory_back_when_a_read_fails_unexpectedly(path, monkeypatch):
    """An error that is not the store's (a bug, an interrupt) reaches LMCache, but only after every
    memory object the batch took has been given back."""
    src = torch.randn(LAYERS, 2, 64, HEADS, DIM)
    tokens = torch.arange(400, 464)
    eng = engine(path, src.clone())
    eng.store(tokens)
    wait_stored(eng, tokens, 64)
    b = backend_of(eng)
    keys = _keys(eng, tokens)
    taken = []
    allocate = b.local_cpu_backend.allocate
    monkeypatch.setattr(b.local_cpu_backend, "allocate", lambda *a, **kw: taken.append(allocate(*a, **kw)) or taken[-1])
    get_many = b.store.get_many

    def failing(*a, **kw):  # type: ignore[no-untyped-def]
        get_many(*a, **kw)  # every chunk read into LMCache's memory, then something else goes wrong
        raise RuntimeError("injected")

    monkeypatch.setattr(b.store, "get_many", failing)
    with pytest.raises(RuntimeError, match="injected"):
        b.batched_get_blocking(keys)
    assert len(taken) == 4 and all(o.get_ref_count() == 0 for o in taken), [o.get_ref_count() for o in taken]
    monkeypatch.setattr(b.store, "get_many", get_many)
    taken.clear()
    objs = b.batched_get_blocking(keys)  # the twin: the same batch reads whole
    assert all(o is not None and o.get_ref_count() == 1 for o in objs)
    for o in objs:
        o.ref_count_down()
    close(eng)


def _keys(eng, tokens):  # type: ignore[no-untyped-def]
    return [k for _, _, k in eng.token_database.process_tokens(tokens)]


def test_max_bytes_holds_across_restarts_evicting_the_oldest(path):
    chunk_bytes = 2 * LAYERS * CHUNK * HEADS * DIM * 4
    extra = {"tierstore.max_bytes": 6 * chunk_bytes}
    src = torch.randn(LAYERS, 2, 64, HEADS, DIM)
    eng = engine(path, src.clone(), extra=extra)
    first = torch.arange(0, 64)
    eng.store(first)
    wait_stored(eng, first, 64)
    close(eng)
    eng = engine(path, src.clone(), extra=extra)  # restarted: the limit still counts the first four
    second = torch.arange(1000, 1064)
    eng.store(second)
    wait_stored(eng, second, 64)
    b = backend_of(eng)
    ns = b.store.namespaces()[0]
    assert len(b.store.keys(namespace=ns)) == 6  # 8 chunks put, the 2 oldest evicted
    # the first prompt's tail went (chunks 3, 2), its head stays usable: before 2026-12-03 its chunks
    # 0 and 1 went, and the 2 left could never be reached (LMCache uses a prefix only)
    assert eng.lookup(first) == 32 and eng.lookup(second) == 64
    close(eng)


def test_max_bytes_evicts_a_prompts_tail_before_its_head_and_refuses_a_tiny_limit(path):
    """A new user's review (2026-12-03): in one process, as across a restart, eviction took a
    prompt's first chunks and left its tail stored and unreachable; `tierstore.max_bytes: 5`
    (LMCache's max_local_disk_size counts GB) meant 5 bytes, and each batch evicted everything,
    then was stored anyway, past the limit."""
    chunk_bytes = 2 * LAYERS * CHUNK * HEADS * DIM * 4
    src = torch.randn(LAYERS, 2, 64, HEADS, DIM)
    eng = engine(path, src.clone(), extra={"tierstore.max_bytes": 6 * chunk_bytes})
    a, b = torch.arange(0, 64), torch.arange(1000, 1064)
    eng.store(a)
    wait_stored(eng, a, 64)
    eng.store(b)
    wait_stored(eng, b, 64)
    assert eng.lookup(a) == 32 and eng.lookup(b) == 64  # a's chunks 3 and 2 went
    close(eng)
    with pytest.raises(tierstore.InvalidObject, match="bare number is bytes"):
        TierstoreBackend(config=LMCacheEngineConfig.from_dict(
            {"chunk_size": CHUNK, "extra_config": {"tierstore.path": path, "tierstore.max_bytes": 5}}))
    eng = engine(path + "-2", src.clone(), extra={"tierstore.max_bytes": 2 * chunk_bytes})
    eng.store(a)  # 4 chunks in one batch, room for 2: the first 2 are stored, within the limit
    wait_stored(eng, a, 32)
    store = backend_of(eng).store
    assert sum(len(store.keys(namespace=ns)) for ns in store.namespaces()) == 2
    close(eng)


def _chunks(store) -> dict[str, int]:  # type: ignore[no-untyped-def]
    return {ns.split("~")[2] + ns.split("~")[4]: len(store.keys(namespace=ns)) for ns in store.namespaces()}


def test_max_bytes_counts_the_chunks_of_another_model_stored_before_a_restart(path):
    """The limit is the store's: a restart with another model (or rank, or dtype) counts what the
    earlier run stored and evicts it first (it was written first)."""
    chunk_bytes = 2 * LAYERS * CHUNK * HEADS * DIM * 4
    extra = {"tierstore.max_bytes": 6 * chunk_bytes}
    src = torch.randn(LAYERS, 2, 64, HEADS, DIM)
    eng = engine(path, src.clone(), extra=extra, model="org/model-a")
    eng.store(torch.arange(0, 64))
    wait_stored(eng, torch.arange(0, 64), 64)
    close(eng)
    eng = engine(path, src.clone(), extra=extra, model="org/model-b")
    eng.store(torch.arange(1000, 1064))
    wait_stored(eng, torch.arange(1000, 1064), 64)
    assert _chunks(backend_of(eng).store) == {"model-aw0": 2, "model-bw0": 4}  # 8 chunks put, model a's 2 oldest went
    close(eng)


def test_max_bytes_bounds_each_worker_and_never_evicts_another_workers_chunks(path):
    """Per worker, as LMCache's max_local_disk_size: two ranks storing the same prompts keep their
    hot prefix (read after every prompt) and a pinned chunk; neither evicts the other's chunks
    (a store-wide count made each rank evict the other's hot and pinned chunks)."""
    chunk_bytes = 2 * LAYERS * CHUNK * HEADS * DIM * 4
    extra = {"tierstore.max_bytes": 4 * chunk_bytes}
    src = torch.randn(LAYERS, 2, 32, HEADS, DIM)
    ranks = [engine(path, src.clone(), worker=w, extra=extra) for w in (0, 1)]
    store = backend_of(ranks[0]).store
    prompts = {n: torch.arange(1000 * n, 1000 * n + 32) for n in range(1, 7)}
    for e in ranks:
        e.store(prompts[1])
        wait_stored(e, prompts[1], 32)
    b0 = backend_of(ranks[0])
    assert b0.batched_contains(_keys(ranks[0], prompts[1]), pin=True) == 2  # worker 0 pins its chunks of it
    for n in range(2, 7):
        for e in ranks:
            e.store(prompts[n])
            wait_stored(e, prompts[n], 32)
        assert [retrieve(e, prompts[1])[0] for e in ranks] == [32, 32]  # hot (and, on worker 0, pinned)
        per_worker = _chunks(store)
        assert per_worker["model-7bw0"] <= 4 and per_worker["model-7bw1"] <= 4
    objs = b0.batched_get_blocking(_keys(ranks[0], prompts[1]))
    assert all(o is not None for o in objs)
    for o in objs:
        o.ref_count_down()
    for e in reversed(ranks):
        close(e)


SAME_WORKER = """
import sys, time, torch
sys.path.insert(0, {tests!r})
from test_lmcache_plugin import backend_of, engine, close, LAYERS, HEADS, DIM
path, seed = sys.argv[1], int(sys.argv[2])
torch.manual_seed(seed)
eng = engine(path, torch.randn(LAYERS, 2, 32, HEADS, DIM), extra={{"tierstore.max_bytes": int(sys.argv[3])}})
try:
    for i in range(16):  # prompts of 2 chunks, back to back; the last one after the other process is done
        if i == 15:
            time.sleep(1.5 * seed)
        eng.store(torch.arange(100000 * seed + 32 * i, 100000 * seed + 32 * (i + 1)))
        # (the put done -- not found: under a limit of 4 chunks the other process may evict them at once)
        deadline = time.monotonic() + 60
        while backend_of(eng)._putting and time.monotonic() < deadline:
            time.sleep(0.005)
        assert not backend_of(eng)._putting, "a put never finished"
finally:
    close(eng)
"""


def test_processes_of_one_worker_id_keep_to_one_max_bytes(path):
    """Two serving processes of worker id 0 (two single-GPU instances on one path) storing at once
    each evicted from a view of the other's chunks taken once a second: chunks the other had
    already evicted (deleting nothing) and never the ones it stored since -- the store kept 2x
    max_bytes for good (a new user's try: 8 chunks under a limit of 4).  Between two listings
    the store may hold what the other stored since; the next put at the limit (here: each
    process's last, one after the other) takes it in and evicts down to the limit."""
    chunk_bytes = 2 * LAYERS * CHUNK * HEADS * DIM * 4
    code = SAME_WORKER.format(tests=os.path.dirname(__file__))
    procs = [subprocess.Popen([sys.executable, "-c", code, path, str(seed), str(4 * chunk_bytes)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONHASHSEED": "0"}) for seed in (1, 2)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    import tierstore

    with tierstore.open(path, readonly=True) as s:
        assert 4 <= _chunks(s)["model-7bw0"] <= 4 + 2  # (4 when the two last puts do not overlap; 8 before)


def test_two_workers_on_one_store(path):
    a, b = torch.randn(LAYERS, 2, 32, HEADS, DIM), torch.randn(LAYERS, 2, 32, HEADS, DIM)
    tokens = torch.arange(32)
    e0, e1 = engine(path, a.clone(), worker=0), engine(path, b.clone(), worker=1)  # the same tokens, two ranks
    e0.store(tokens)
    e1.store(tokens)
    wait_stored(e0, tokens, 32)
    wait_stored(e1, tokens, 32)
    got0, kv0 = retrieve(e0, tokens)
    got1, kv1 = retrieve(e1, tokens)
    assert got0 == got1 == 32 and torch.equal(kv0, a) and torch.equal(kv1, b)  # each rank its own heads
    assert [n[:-17] for n in sorted(backend_of(e0).store.namespaces())] == ["lmcache~org~model-7b~ws2~w0~float32",
                                                                         "lmcache~org~model-7b~ws2~w1~float32"]
    close(e1)
    close(e0)


def test_namespaces_keep_every_part_of_a_keys_identity():
    """A long model path (an HF snapshot), two ranks, two dtypes, LMCache tags, or model names that
    differ only in a character a namespace cannot hold: never one namespace."""
    from lmcache.utils import CacheEngineKey

    snapshot = "/models/hub/models--meta-llama--Llama-3.1-8B-Instruct/snapshots/" + "0e9e39f249a16976918f6564b8830" * 2
    keys = [CacheEngineKey(snapshot, 2, 0, 7, torch.float16), CacheEngineKey(snapshot, 2, 1, 7, torch.float16),
            CacheEngineKey(snapshot, 2, 0, 7, torch.bfloat16), CacheEngineKey(snapshot + "x", 2, 0, 7, torch.float16),
            CacheEngineKey(snapshot, 2, 0, 7, torch.float16, request_configs={"lmcache.tag.user": "bob"}),
            CacheEngineKey("a/b", 1, 0, 7, torch.float16), CacheEngineKey("a~b", 1, 0, 7, torch.float16)]
    names = [namespace_of(k) for k in keys]
    assert len(set(names)) == len(keys)
    assert all(len(n.encode()) <= 100 for n in names) and names[1].startswith("lmcache~~models~hub~models--meta")
    assert namespace_of(CacheEngineKey(snapshot, 2, 0, 9, torch.float16)) == names[0]  # one per model, not per chunk
    with tierstore.open(tempfile.mkdtemp()) as s:  # each a valid name
        for n in names:
            s.put(b"k", tierstore.Blob(b"v"), namespace=n)


def test_a_kv_codec_applies_to_kv_chunks_and_other_formats_are_stored_raw(path):
    """``tierstore.codec: int8`` (a KV codec): KV_2LTD chunks are stored in it; a chunk of another
    format (a blob to the store, e.g. an MLA chunk) is stored raw, not dropped; LMCache's callback
    runs for chunks that were stored, only."""
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.memory_management import MemoryFormat

    eng = engine(path, torch.zeros(LAYERS, 2, 32, HEADS, DIM), extra={"tierstore.codec": "int8"})
    b = backend_of(eng)
    done = []
    for fmt, shape in [(MemoryFormat.KV_MLA_FMT, (1, 2, 16, 16)), (MemoryFormat.KV_2LTD, (2, 2, 16, 16))]:
        o = b.local_cpu_backend.allocate(torch.Size(shape), torch.float32, fmt)
        o.tensor.normal_()
        k = CacheEngineKey("m", 1, 0, hash(fmt.name) & 0xFFFF, torch.float32, {})
        for f in b.batched_submit_put_task([k], [o], on_complete_callback=done.append) or []:
            f.result()
        g = b.get_blocking(k)
        assert g is not None, fmt
        err = (g.tensor - o.tensor).abs().max().item()
        assert (err == 0) if fmt == MemoryFormat.KV_MLA_FMT else (0 < err < 0.05)  # raw blob / int8 KV
        assert b.store.info(key_of(k), namespace=namespace_of(k, "int8")).codec == \
            ("raw" if fmt == MemoryFormat.KV_MLA_FMT else "int8")
        o.ref_count_down()
        g.ref_count_down()
    assert len(done) == 2
    assert not b.store.contains(key_of(k), namespace=namespace_of(k))  # int8 chunks: namespaces of their own
    b.store.close()  # a write that fails: no callback
    o = b.local_cpu_backend.allocate(torch.Size((2, 2, 16, 16)), torch.float32, MemoryFormat.KV_2LTD)
    for f in b.batched_submit_put_task([CacheEngineKey("m", 1, 0, 99, torch.float32, {})], [o],
                                       on_complete_callback=done.append) or []:
        f.result()
    assert len(done) == 2
    close(eng)


def test_layerwise_mode_is_refused(path):
    with pytest.raises(tierstore.InvalidObject, match="layerwise"):
        TierstoreBackend(config=LMCacheEngineConfig.from_dict(
            {"chunk_size": CHUNK, "use_layerwise": True, "extra_config": {"tierstore.path": path}}))


def test_bad_configuration_names_the_key(path):
    with pytest.raises(tierstore.InvalidObject, match="tierstore.path"):
        TierstoreBackend(config=LMCacheEngineConfig.from_dict({"chunk_size": CHUNK, "extra_config": {}}))
    os.makedirs(path, exist_ok=True)
    afile = os.path.join(path, "afile")
    open(afile, "w").close()
    for where in (afile, os.path.join(afile, "kv")):  # (a new user's try: neither message named the key)
        with pytest.raises(tierstore.TierstoreError, match="tierstore.path"):
            TierstoreBackend(config=LMCacheEngineConfig.from_dict({"chunk_size": CHUNK,
                                                                  "extra_config": {"tierstore.path": where}}))
    with pytest.raises(tierstore.InvalidObject, match="tierstore.max_bytes"):
        TierstoreBackend(config=LMCacheEngineConfig.from_dict(
            {"chunk_size": CHUNK, "extra_config": {"tierstore.path": path, "tierstore.max_bytes": "lots"}}))
    for key, value in (("codec", "bogus"), ("durability", "bogus"), ("remote_policy", "bogus"),
                       ("remote", "http://x")):  # each names its key, at start (a bad codec failed every store)
        extra = {"tierstore.path": path, f"tierstore.{key}": value}
        if key == "remote_policy":
            extra["tierstore.remote"] = "redis://127.0.0.1:1/0"
        with pytest.raises(tierstore.InvalidObject, match=f"tierstore.{key}"):
            TierstoreBackend(config=LMCacheEngineConfig.from_dict({"chunk_size": CHUNK, "extra_config": extra}))


def test_an_unknown_tierstore_key_is_warned_about(path, caplog):
    with caplog.at_level(logging.WARNING, logger="tierstore"):
        b = TierstoreBackend(config=LMCacheEngineConfig.from_dict(
            {"chunk_size": CHUNK, "extra_config": {"tierstore.path": path, "tierstore.max_byte": "1GiB"}}))
    b.close()
    assert any("unknown extra_config key(s) tierstore.max_byte ignored" in r.message for r in caplog.records)


def test_which_namespaces_count_against_a_worker():
    """A worker's own worker id (any model or dtype); worker 0 also takes worker ids the world size
    no longer has (an earlier run with more ranks)."""
    from types import SimpleNamespace

    from lmcache.utils import CacheEngineKey

    def ns(model, ws, wid):  # type: ignore[no-untyped-def]
        return namespace_of(CacheEngineKey(model, ws, wid, 7, torch.float16))

    w0, w1 = SimpleNamespace(_worker=(0, 2)), SimpleNamespace(_worker=(1, 2))
    mine = TierstoreBackend._mine
    assert mine(w0, ns("a~b/c", 2, 0)) and not mine(w0, ns("a", 2, 1)) and mine(w0, ns("old", 4, 3))
    assert mine(w1, ns("a", 2, 1)) and mine(w1, ns("other/model", 8, 1)) and not mine(w1, ns("old", 4, 3))
    assert mine(SimpleNamespace(_worker=None), ns("a", 2, 1))  # no metadata: one worker, every namespace


def test_a_plugin_without_the_lossy_codec_never_retrieves_its_chunks(path):
    """Chunks stored with ``tierstore.codec: int8`` live in namespaces of their own: a plugin
    configured without it (lossless, the default) misses them instead of returning int8 KV.
    The twin: the same configuration again retrieves them."""
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.memory_management import MemoryFormat

    k = CacheEngineKey("m", 1, 0, 4242, torch.float32, {})
    for codec, hit in (("int8", None), (None, False), ("int8", True)):
        eng = engine(path, torch.zeros(LAYERS, 2, 32, HEADS, DIM),
                     extra={"tierstore.codec": codec} if codec else None)
        b = backend_of(eng)
        if hit is None:
            o = b.local_cpu_backend.allocate(torch.Size((2, 2, 16, 16)), torch.float32, MemoryFormat.KV_2LTD)
            o.tensor.normal_()
            for f in b.batched_submit_put_task([k], [o]) or []:
                f.result()
            o.ref_count_down()
        else:
            assert b.contains(k) is hit
            g = b.get_blocking(k)
            assert (g is not None) is hit
            if g is not None:
                g.ref_count_down()
        close(eng)
