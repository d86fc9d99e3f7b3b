"""tierstore.integrations.vllm against the real vLLM package (0.33, CPU): its config classes,
its connector factory (loading the connector by module path, as ``--kv-transfer-config`` does),
its Scheduler (prefix matching, block allocation, the metadata each step) and its per-layer
KV views ``[blocks, heads, block_tokens, K|V]``.  The model's forward pass is played by a
function that writes a known K and V for each token into its blocks, layer by layer, calling
the connector's hooks where vLLM's attention layers call them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

import tierstore

LAYERS, HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS = 2, 2, 16, 16, 64


MLA_DIM = 64 + 16  # kv_lora_rank + qk_rope_head_dim of the tiny DeepSeek-V2 config below


def make_config(tmp_path, store, *, chunk_tokens=32, tp=1, extra=None, policy="fail", mla=False, role="kv_both"):
    if mla:
        model = tmp_path / "tiny-deepseek"
        model.mkdir(exist_ok=True)
        (model / "config.json").write_text(json.dumps({
            "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 128,
            "intermediate_size": 256, "moe_intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4,
            "num_hidden_layers": LAYERS, "vocab_size": 1000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
            "kv_lora_rank": 64, "q_lora_rank": None, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32,
            "v_head_dim": 32, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
            "first_k_dense_replace": LAYERS, "torch_dtype": "bfloat16", "rope_theta": 10000.0}))
        return _config(model, store, chunk_tokens, extra, policy, "bfloat16", role)
    model = tmp_path / "tiny-llama"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HEADS * 2 * HEAD_DIM,
        "intermediate_size": 128, "num_attention_heads": HEADS * 2, "num_key_value_heads": HEADS,
        "num_hidden_layers": LAYERS, "vocab_size": 1000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
        "torch_dtype": "float16", "head_dim": HEAD_DIM}))
    return _config(model, store, chunk_tokens, extra, policy, "float16", role)


def _config(model, store, chunk_tokens, extra, policy, dtype, role="kv_both"):
    mc = ModelConfig(model=str(model), skip_tokenizer_init=True, dtype=dtype, max_model_len=2048)
    kv = KVTransferConfig(kv_connector="TierstoreConnector", kv_role=role, kv_load_failure_policy=policy,
                          kv_connector_module_path="tierstore.integrations.vllm",
                          kv_connector_extra_config={"path": str(store), "chunk_tokens": chunk_tokens,
                                                     "durability": "sync", **(extra or {})})
    cfg = VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=BLOCK), kv_transfer_config=kv,
                     device_config=DeviceConfig(device="cpu"))
    cfg.cache_config.num_gpu_blocks = NUM_BLOCKS  # what the engine sets after profiling memory
    cfg.scheduler_config.async_scheduling = False  # Engine below schedules a step once the last one is done
    return cfg


def kv_cache_config(mla=False):
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=MLA_DIM, dtype=torch.bfloat16) if mla else \
        FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float16)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)])


def paged_caches(hnd: bool, num_blocks: int = NUM_BLOCKS):
    """One standardised [blocks, heads, block_tokens, K|V] view per layer, NHD or HND in memory."""
    out = {}
    for i in range(LAYERS):
        if hnd:
            t = torch.zeros(num_blocks, HEADS, BLOCK, 2 * HEAD_DIM, dtype=torch.float16)
        else:
            t = torch.zeros(num_blocks, BLOCK, HEADS, 2 * HEAD_DIM, dtype=torch.float16).permute(0, 2, 1, 3)
        out[f"model.layers.{i}.self_attn.attn"] = t
    return out


def token_kv(layer: int, tokens: list[int], start: int, mla: bool = False) -> torch.Tensor:
    """The K|V a model would compute for tokens[start:]: [n, heads, 2*head_dim], a function of the
    layer, the token and every token before it (so a different prefix gives different KV)."""
    heads, width, dtype = (1, MLA_DIM, torch.bfloat16) if mla else (HEADS, 2 * HEAD_DIM, torch.float16)
    out = []
    for pos in range(start, len(tokens)):
        g = torch.Generator().manual_seed(hash((layer, tuple(tokens[: pos + 1]))) & 0x7FFFFFFF)
        out.append(torch.randn(heads, width, generator=g))
    return torch.stack(out).to(dtype) if out else torch.zeros(0, heads, width, dtype=dtype)


def serve(tmp_path, store, prompts, *, hnd=False, chunk_tokens=32, extra=None):
    """A fresh engine (scheduler + worker, as after a restart) that runs each prompt to its end;
    every token's KV is checked at every step (``Engine``).  Returns, per prompt, the tokens vLLM
    took as computed when it first scheduled it, its blocks and the blocks that failed to load,
    and the worker connector."""
    e = Engine(tmp_path, store, chunk_tokens=chunk_tokens, extra=extra, hnd=hnd)
    results = []
    try:
        for n, tokens in enumerate(prompts):
            e.add(f"r{n}", tokens)
            new = e.step().scheduled_new_reqs[0]
            results.append({"loaded": new.num_computed_tokens, "blocks": list(new.block_ids[0]),
                            "failed": e.last_failed})
            e.run()
    finally:
        e.close()
    assert e.errors == []  # the KV of every token, loaded or computed, bit for bit
    return results, e.worker


@pytest.mark.parametrize("hnd", [False, True], ids=["NHD", "HND"])
def test_a_restarted_engine_loads_the_stored_prefix_bit_exact(tmp_path, hnd):
    store = tmp_path / "kv"
    a = list(range(100, 200))  # 100 tokens: 3 full chunks of 32
    first, w1 = serve(tmp_path, store, [a], hnd=hnd)
    assert first[0]["loaded"] == 0 and w1.counters["chunks_saved"] == 3
    b = a[:70] + [7] * 30  # shares 70 tokens: 2 whole chunks (64 tokens)
    second, w2 = serve(tmp_path, store, [b], hnd=not hnd)  # the other layout after the restart
    assert second[0]["loaded"] == 64 and w2.counters["chunks_loaded"] == 2  # serve checked every token's KV
    with tierstore.open(store, readonly=True) as s:
        assert len(s.keys(namespace="vllm")) == 3 + 1  # b's third chunk differs: stored too


def test_the_last_prompt_token_is_always_computed(tmp_path):
    store = tmp_path / "kv"
    a = list(range(64))  # exactly two chunks
    serve(tmp_path, store, [a])
    again, w = serve(tmp_path, store, [a])
    assert again[0]["loaded"] == 32  # not 64: vLLM must compute the last token itself (KV checked by serve)


def test_another_model_or_layout_never_shares_entries(tmp_path):
    store = tmp_path / "kv"
    a = list(range(300, 400))
    serve(tmp_path, store, [a])
    other, w = serve(tmp_path, store, [a], extra={"model_id": "fine-tune-2"})
    assert other[0]["loaded"] == 0


def test_a_damaged_chunk_is_reported_and_recomputed_never_loaded(tmp_path):
    store = tmp_path / "kv"
    a = list(range(500, 600))
    serve(tmp_path, store, [a])
    with tierstore.open(store) as s:  # flip a byte in the second chunk's layer 1
        keys = [k for k in s.keys(namespace="vllm")]
        infos = sorted((s.info(k, namespace="vllm") for k in keys), key=lambda i: i.lsn)
        victim = infos[1]
    seg = store / "segments" / f"{victim.segment:016x}.tseg"
    with open(seg, "r+b") as f:
        f.seek(victim.offset + victim.stored_bytes - 10)
        byte = f.read(1)
        f.seek(victim.offset + victim.stored_bytes - 10)
        f.write(bytes([byte[0] ^ 0xFF]))
    again, w = serve(tmp_path, store, [a])
    assert again[0]["loaded"] == 96  # the scheduler matched all three chunks
    assert again[0]["failed"] == set(again[0]["blocks"][2:4])  # the damaged chunk's blocks: reported
    assert w.counters["load_errors"] == 1


def test_bad_options_are_clear_errors(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # (a path given as a number was opened as a directory of that name, here)
    cfg = make_config(tmp_path, tmp_path / "kv", chunk_tokens=24)
    with pytest.raises(ValueError, match="multiple of the block size"):
        KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config())
    for extra, match in (({"chunk_token": 64}, "unknown .*'chunk_token' \\(did you mean 'chunk_tokens'\\?\\)"),
                         ({"max_pending_byte": "1GiB"}, "did you mean 'max_pending_bytes'"),
                         ({"namespace": "a/b"}, "namespace"), ({"namespace": ""}, "namespace"),
                         ({"chunk_tokens": "256"}, "chunk_tokens"), ({"path": 12345}, "path is the store's directory"),
                         ({"tp_rank": "x"}, "tp_rank is this worker's rank"), ({"tp_rank": -5}, "tp_rank"),
                         ({"tp_rank": True}, "tp_rank"), ({"tp_rank": 1}, "tp_rank"),  # (tensor parallel 1)
                         ({"pp_rank": 1}, "pp_rank")):
        cfg = make_config(tmp_path, tmp_path / "kv", extra=extra)  # refused at start, for both roles
        for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
            with pytest.raises(ValueError, match=match):
                KVConnectorFactory.create_connector(cfg, role, kv_cache_config())
    cfg = make_config(tmp_path, tmp_path / "kv", extra={"namespace": "vllm-a", "max_pending_bytes": "1GiB",
                                                        "tp_rank": 0, "pp_rank": np.int64(0)})  # (numpy's ints too)
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):  # the valid twin
        KVConnectorFactory.create_connector(cfg, role, kv_cache_config()).shutdown()
    assert not (tmp_path / "12345").exists()


def test_max_pending_bytes_under_one_chunk_is_refused_when_the_chunk_is_known(tmp_path):
    """A chunk here is 2 layers x 2 x 2 heads x 32 tokens x 16 dims x 2 bytes = 8 KiB: a bound of
    8191 bytes would drop every save, and is refused once the worker knows its layers (a role
    that only loads keeps no saves, and is not); 8192 bytes is the valid twin."""
    for bound, role, refused in ((8191, "kv_both", True), (8191, "kv_consumer", False), (8192, "kv_both", False)):
        cfg = make_config(tmp_path, tmp_path / "kv", extra={"max_pending_bytes": bound}, role=role)
        w = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kv_cache_config())
        try:
            if refused:
                with pytest.raises(ValueError, match="max_pending_bytes=8191 is less than one chunk .*8192 bytes"):
                    w.register_kv_caches(paged_caches(True))
            else:
                w.register_kv_caches(paged_caches(True))
        finally:
            w.shutdown()


# -- many steps: chunked prefill, preemption, decode (a model runner's bookkeeping, played here) ---

class Engine:
    """vLLM's real Scheduler and a worker connector over many steps, keeping block tables as a
    model runner does (new requests, appended blocks, a resumed request's whole list), writing
    each scheduled token's K|V, checking every scheduled request's KV after each step, and
    feeding one sampled token back per finished prefill (``update_from_output``)."""

    def __init__(self, tmp_path, store, *, chunk_tokens=32, max_batched=None, extra=None, num_blocks=NUM_BLOCKS,
                 prefix_caching=True, policy="fail", mla=False, role="kv_both", hnd=True, async_scheduling=False):
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        self._outputs = (KVConnectorOutput, ModelRunnerOutput)
        cfg = make_config(tmp_path, store, chunk_tokens=chunk_tokens, extra=extra, policy=policy, mla=mla, role=role)
        cfg.cache_config.enable_prefix_caching = prefix_caching
        self.mla = mla
        cfg.cache_config.num_gpu_blocks = num_blocks
        if max_batched:
            cfg.scheduler_config.max_num_scheduled_tokens = max_batched
            cfg.scheduler_config.long_prefill_token_threshold = max_batched
        cfg.scheduler_config.async_scheduling = async_scheduling
        self.cfg = cfg
        kcc = kv_cache_config(mla)
        kcc.num_blocks = num_blocks
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler

        self.sched = (AsyncScheduler if async_scheduling else Scheduler)(
            vllm_config=cfg, kv_cache_config=kcc, structured_output_manager=StructuredOutputManager(cfg),
            block_size=BLOCK)
        self.worker = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kcc)
        self.caches = {n: torch.zeros(num_blocks, 1, BLOCK, MLA_DIM, dtype=torch.bfloat16) for n in paged_caches(hnd)} \
            if mla else paged_caches(hnd, num_blocks)
        self.worker.register_kv_caches(self.caches)
        self.reqs, self.tables, self.errors, self.next_token, self.last_failed = {}, {}, [], 900, set()

    def add(self, rid, tokens, max_tokens=1, **kw):
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        init_none_hash(sha256)
        r = Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens, ignore_eos=True), None,
                    block_hasher=get_request_block_hasher(BLOCK, sha256), **kw)
        self.reqs[rid] = r
        self.sched.add_request(r)

    def scheduled(self, out):
        """Follow a step's block tables; each scheduled request's first computed token."""
        for n in out.scheduled_new_reqs:
            self.tables[n.req_id] = list(n.block_ids[0])
        c = out.scheduled_cached_reqs
        for i, rid in enumerate(c.req_ids):
            if rid in c.resumed_req_ids:
                self.tables[rid] = list(c.new_block_ids[i][0])
            elif c.new_block_ids[i]:
                self.tables[rid].extend(c.new_block_ids[i][0])
        starts = {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs}
        starts.update({rid: c.num_computed_tokens[i] for i, rid in enumerate(c.req_ids)})
        return starts

    def step(self):
        out = self.sched.schedule()
        starts = self.scheduled(out)
        failed = self.last_failed = self.forward(out, starts)
        for rid, n in out.num_scheduled_tokens.items():  # every token the model attends to: right
            end, table = starts[rid] + n, self.tables[rid]
            if failed & set(table):  # a failed load: vLLM drops this step's output and recomputes
                continue
            toks = self.reqs[rid].all_token_ids[:end]
            for li, layer in enumerate(self.caches.values()):
                got = torch.stack([layer[table[p // BLOCK], :, p % BLOCK] for p in range(end)])
                if not torch.equal(got, token_kv(li, toks, 0, self.mla)):
                    self.errors.append((rid, li))
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            done = starts[rid] + out.num_scheduled_tokens[rid] >= self.reqs[rid].num_tokens
            sampled.append([self.next_token] if done else [])
            self.next_token += 1
        kv_out, mro = self._outputs
        self.sched.update_from_output(out, mro(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                               sampled_token_ids=sampled,
                                               kv_connector_output=kv_out(invalid_block_ids=failed)))
        return out

    def forward(self, out, starts):
        """The worker's part of a step: the model's forward pass, writing each scheduled token's K|V
        into its block layer by layer, with the connector's hooks in the order vLLM's model runner
        calls them (its own context manager: metadata bound, ``start_load_kv`` before the forward
        pass when the step has loads, after it when not).  Returns the blocks that failed to load.
        (A token not sampled yet -- asynchronous scheduling -- stands in as 0: its KV is not saved.)"""
        from vllm.distributed.kv_transfer import kv_transfer_state
        from vllm.forward_context import set_forward_context
        from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

        w = self.worker
        kv_transfer_state._KV_CONNECTOR_AGENT = w
        try:
            with set_forward_context(None, self.cfg), \
                    KVConnectorModelRunnerMixin._get_kv_connector_output(out) as connector_output:
                for name, layer in self.caches.items():
                    li = int(name.split(".")[2])
                    w.wait_for_layer_load(name)
                    for rid, n in out.num_scheduled_tokens.items():
                        done, table = starts[rid], self.tables[rid]
                        toks = (list(self.reqs[rid].all_token_ids) + [0] * n)[: done + n]
                        kv = token_kv(li, toks, done, self.mla)
                        for j, pos in enumerate(range(done, done + n)):
                            layer[table[pos // BLOCK], :, pos % BLOCK] = kv[j]
                    w.save_kv_layer(name, layer, None)
        finally:
            kv_transfer_state._KV_CONNECTOR_AGENT = None
        return set(connector_output.invalid_block_ids)

    def run(self, limit=500):
        for _ in range(limit):
            if not self.sched.has_requests() if hasattr(self.sched, "has_requests") else not self.sched.requests:
                break
            self.step()

    def close(self):
        self.worker.shutdown()
        self.sched.shutdown()


@pytest.mark.parametrize("chunk,budget", [(32, 40), (64, 24), (32, 16)])
def test_chunked_prefill_saves_each_chunk_once_and_a_restart_loads_it(tmp_path, chunk, budget):
    store = tmp_path / "kv"
    a = list(range(1000, 1200))
    e = Engine(tmp_path, store, chunk_tokens=chunk, max_batched=budget)
    e.add("a", a, max_tokens=3)
    e.run()
    e.close()
    assert e.errors == [] and e.worker.counters["chunks_saved"] == 200 // chunk
    b = a[:150] + list(range(5000, 5050))
    e2 = Engine(tmp_path, store, chunk_tokens=chunk, max_batched=budget)
    e2.add("b", b, max_tokens=2)
    first = e2.step()
    assert first.scheduled_new_reqs[0].num_computed_tokens == 150 // chunk * chunk
    check = e2.worker.check_last_loads()
    assert check == {"chunks": 150 // chunk, "layers_checked": 150 // chunk * LAYERS, "mismatches": 0}
    e2.run()
    e2.close()
    assert e2.errors == [] and e2.worker.counters["chunks_loaded"] == 150 // chunk


@pytest.mark.parametrize("v2", ["0", "1"], ids=["v1-runner", "v2-runner"])
def test_preempted_requests_resume_with_the_right_kv(tmp_path, monkeypatch, v2):
    """The KV pool runs out under three long decodes: requests are preempted, their blocks reused,
    and they resume (the V1 model runner: as cached requests with a new block list; V2: as new
    requests), loading their prefix from the store (vLLM's own prefix cache is off, so nothing
    else holds it).  Every step's KV is checked."""
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", v2)
    e = Engine(tmp_path, tmp_path / "kv", chunk_tokens=32, num_blocks=48, prefix_caching=False)
    for i in range(3):
        e.add(f"r{i}", [i * 1000 + t for t in range(300)], max_tokens=120)
    e.run()
    e.close()
    assert sum(r.num_preemptions for r in e.reqs.values()) > 0  # the scenario happened
    assert e.errors == [] and e.worker.counters["load_errors"] == 0 and e.worker.counters["chunks_loaded"] > 0


def test_cache_salt_and_lora_separate_entries(tmp_path):
    store = tmp_path / "kv"
    a = list(range(100, 200))
    e = Engine(tmp_path, store)
    e.add("plain", a)
    e.run()
    e.add("salted", a, cache_salt="tenant-1")  # same tokens, another tenant: nothing shared
    out = e.step()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0
    e.run()
    e.close()
    with tierstore.open(store, readonly=True) as s:
        assert len(s.keys(namespace="vllm")) == 2 * 3


def worker_for(tmp_path, store, *, cache_dtype="auto", dtype=torch.float16):
    from vllm.config import CacheConfig as CC

    cfg = make_config(tmp_path, store)
    cfg.cache_config = CC(block_size=BLOCK, cache_dtype=cache_dtype)
    cfg.cache_config.num_gpu_blocks = NUM_BLOCKS
    w = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kv_cache_config())
    caches = {n: torch.zeros(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM, dtype=dtype) for n in paged_caches(False)}
    w.register_kv_caches(caches)
    return w, caches


def test_fp8_kv_caches_held_as_bytes_round_trip(tmp_path):
    """vLLM allocates an fp8 KV cache as uint8: saved as float8_e4m3fn values, loaded bit-exact."""
    from tierstore.integrations.vllm import ChunkLoad, ChunkSave, TierstoreConnectorMetadata

    store = tmp_path / "kv"
    w, caches = worker_for(tmp_path, store, cache_dtype="fp8", dtype=torch.uint8)
    g = torch.Generator().manual_seed(0)
    for layer in caches.values():
        layer.copy_(torch.randint(0, 0x7F, layer.shape, generator=g, dtype=torch.uint8))  # no NaN codes
    key = [b"k" * 32]
    w.bind_connector_metadata(TierstoreConnectorMetadata(saves=[ChunkSave("r", key, [3, 9])]))
    w.start_load_kv(None)
    for name, layer in caches.items():
        w.wait_for_layer_load(name)
        w.save_kv_layer(name, layer, None)
    w.wait_for_save()
    w.clear_connector_metadata()
    w.shutdown()
    assert w.counters["chunks_saved"] == 1
    with tierstore.open(store, readonly=True) as s:
        assert s.info(key[0], namespace="vllm").dtype == "float8_e4m3fn"
    w2, fresh = worker_for(tmp_path, store, cache_dtype="fp8", dtype=torch.uint8)
    w2.bind_connector_metadata(TierstoreConnectorMetadata(loads=[ChunkLoad("r", key, [5, 6], [0, 1])]))
    w2.start_load_kv(None)
    for name in fresh:
        w2.wait_for_layer_load(name)
    assert w2.get_block_ids_with_load_errors() == set()
    w2.shutdown()
    for name in caches:
        assert torch.equal(fresh[name][5], caches[name][3]) and torch.equal(fresh[name][6], caches[name][9])


def test_a_step_that_misses_a_layer_saves_nothing(tmp_path):
    from tierstore.integrations.vllm import ChunkSave, TierstoreConnectorMetadata

    store = tmp_path / "kv"
    w, caches = worker_for(tmp_path, store)
    w.bind_connector_metadata(TierstoreConnectorMetadata(saves=[ChunkSave("r", [b"x" * 32], [1, 2])]))
    first = next(iter(caches))
    w.save_kv_layer(first, caches[first], None)  # layer 1 never handed over
    w.wait_for_save()
    w.clear_connector_metadata()
    w.shutdown()
    assert w.counters["saves_dropped"] == 1 and w.counters["chunks_saved"] == 0
    with tierstore.open(store, readonly=True) as s:
        assert s.keys(namespace="vllm") == []


def test_unsupported_configurations_are_refused(tmp_path):
    from vllm.config import CacheConfig as CC

    cfg = make_config(tmp_path, tmp_path / "kv")
    cfg.cache_config = CC(block_size=BLOCK, cache_dtype="fp8_per_token_head")
    with pytest.raises(ValueError, match="plain KV values"):
        KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config())
    cfg = make_config(tmp_path, tmp_path / "kv")
    cfg.parallel_config.decode_context_parallel_size = 2
    with pytest.raises(ValueError, match="decode_context_parallel_size"):
        KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config())


def test_fingerprints_separate_pipeline_stages_and_tensor_ranks(tmp_path):
    from tierstore.integrations.vllm import model_fingerprint

    cfg = make_config(tmp_path, tmp_path / "kv")
    salts = {model_fingerprint(cfg, pp_rank=p, tp_rank=t) for p in range(2) for t in (None, 0, 1)}
    assert len(salts) == 6


def test_requests_sharing_a_prefix_in_one_step_save_it_once(tmp_path):
    """Two prompts with a common 64-token system prompt and a third unrelated one, admitted in the
    same step: every chunk is stored, the shared ones once (a batch with a key twice would be
    refused whole)."""
    store = tmp_path / "kv"
    e = Engine(tmp_path, store)
    system = list(range(7000, 7064))
    e.add("x", system + list(range(100, 140)))
    e.add("y", system + list(range(200, 240)))
    e.add("z", list(range(300, 400)))
    e.run()
    e.close()
    assert e.errors == [] and e.worker.counters["save_errors"] == 0
    with tierstore.open(store, readonly=True) as s:
        assert len(s.keys(namespace="vllm")) == 2 + 1 + 1 + 3  # shared 2, x's 3rd, y's 3rd, z's 3


def damage_second_chunk(store):
    """Flip a byte of the second chunk stored (by LSN): its last extent fails its checksum.
    Returns the chunk's info as it was."""
    with tierstore.open(store) as s:
        victim = sorted((s.info(k, namespace="vllm") for k in s.keys(namespace="vllm")), key=lambda i: i.lsn)[1]
    with open(store / "segments" / f"{victim.segment:016x}.tseg", "r+b") as f:
        f.seek(victim.offset + victim.stored_bytes - 10)
        byte = f.read(1)
        f.seek(victim.offset + victim.stored_bytes - 10)
        f.write(bytes([byte[0] ^ 0xFF]))
    return victim


def test_a_damaged_chunk_is_deleted_recomputed_and_saved_again(tmp_path):
    """With kv_load_failure_policy "recompute": the damaged chunk's blocks are recomputed (right KV),
    the entry is deleted so it is never matched again, and the recomputed chunk is stored anew."""
    store = tmp_path / "kv"
    a = list(range(500, 600))
    serve(tmp_path, store, [a])
    victim = damage_second_chunk(store)
    e2 = Engine(tmp_path, store, policy="recompute", prefix_caching=False)
    e2.add("again", a)
    e2.run()
    e2.close()
    assert e2.errors == [] and e2.worker.counters["load_errors"] == 1
    with tierstore.open(store, readonly=True) as s:
        again = s.info(victim.key, namespace="vllm")  # stored anew, readable
        assert again.lsn > victim.lsn and s.get(victim.key, namespace="vllm") is not None


@pytest.mark.parametrize("readonly", [True, False])
def test_a_chunk_whose_load_failed_is_not_matched_again(tmp_path, readonly):
    """A consumer over a read-only store cannot delete a damaged chunk (a cold review): the
    scheduler stops matching a chunk whose load failed, so only the first request with that
    prefix fails (kv_load_failure_policy "fail"), the later ones compute it.  The twin: a
    writable consumer deletes it."""
    store = tmp_path / "kv"
    a = list(range(500, 600))
    serve(tmp_path, store, [a])
    damage_second_chunk(store)
    extra = {"store_options": {"readonly": True}} if readonly else None
    e = Engine(tmp_path, store, role="kv_consumer", extra=extra, prefix_caching=False)
    for i in range(4):  # four requests, one after another, sharing the damaged prefix
        e.add(f"r{i}", a + [i])
        e.run()
    e.close()
    assert e.worker.counters["load_errors"] == 1
    status = [e.reqs[f"r{i}"].status.name for i in range(4)]
    assert status[0] == "FINISHED_ERROR" and "FINISHED_ERROR" not in status[1:]
    assert e.worker.counters["chunks_loaded"] >= 3  # (the first chunk still loads for the later ones)


@pytest.mark.parametrize("role", ["kv_both", "kv_consumer"])
def test_a_chunk_whose_load_failed_once_for_a_passing_reason_is_matched_again(tmp_path, role, monkeypatch):
    """An I/O error that passes (the entry is sound, not deleted): a role that saves matches it
    again at once, a consumer once UNLOADABLE_S has passed -- not never (a cold review of the
    rule above)."""
    from tierstore.errors import StoreIOError
    from tierstore.integrations import vllm as connector

    store = tmp_path / "kv"
    a = list(range(100, 200))
    serve(tmp_path, store, [a])
    with tierstore.open(store, readonly=True) as s:
        victim = sorted((s.info(k, namespace="vllm") for k in s.keys(namespace="vllm")), key=lambda i: i.lsn)[1].key
    monkeypatch.setattr(connector, "UNLOADABLE_S", 0.5)
    e = Engine(tmp_path, store, role=role, policy="recompute", prefix_caching=False)
    real_get, failed = e.worker._store.get, []

    def failing_once(key, *args, **kwargs):
        if not failed and key == victim:
            failed.append(key)
            raise StoreIOError("EIO (injected, once)")
        return real_get(key, *args, **kwargs)

    monkeypatch.setattr(e.worker._store, "get", failing_once)
    loaded = []
    for i in range(3):
        if i == 2:
            time.sleep(0.6)  # (past UNLOADABLE_S)
        e.add(f"r{i}", a + [i])
        loaded.append(e.step().scheduled_new_reqs[0].num_computed_tokens)
        e.run()
    e.close()
    assert failed and e.errors == [] and e.worker.counters["load_errors"] == 1
    assert loaded == ([96, 96, 96] if role == "kv_both" else [96, 32, 96])


def test_a_one_chunk_prompt_is_saved(tmp_path):
    store = tmp_path / "kv"
    e = Engine(tmp_path, store)
    e.add("one", list(range(32)))  # exactly one chunk: never loadable itself (its last token), but stored
    e.run()
    e.close()
    with tierstore.open(store, readonly=True) as s:
        assert len(s.keys(namespace="vllm")) == 1


def test_a_lora_adapter_at_another_path_shares_nothing(tmp_path):
    from vllm.lora.request import LoRARequest

    store = tmp_path / "kv"
    a = list(range(100, 200))
    e = Engine(tmp_path, store)
    e.sched.connector.get_num_new_matched_tokens  # noqa: B018 (the scheduler built its connector)
    conn = e.sched.connector
    r1 = Request("v1", a, SamplingParams(max_tokens=1), None, lora_request=LoRARequest("sql", 1, "/adapters/sql-v1"))
    r2 = Request("v2", a, SamplingParams(max_tokens=1), None, lora_request=LoRARequest("sql", 1, "/adapters/sql-v2"))
    r3 = Request("p", a, SamplingParams(max_tokens=1), None)
    keys = [conn._keys_for(r)[0][0] for r in (r1, r2, r3)]
    e.close()
    assert len(set(keys)) == 3


def test_an_mla_model_stores_one_latent_per_chunk_and_loads_it(tmp_path):
    """A DeepSeek-V2-shaped config (use_mla): the paged latent view [blocks, 1, block_tokens,
    kv_lora_rank + rope] is stored as MLACache chunks (format 1.4) and loaded bit-exact after a restart."""
    store = tmp_path / "kv"
    a = list(range(100, 200))
    e = Engine(tmp_path, store, mla=True)
    assert e.cfg.model_config.use_mla
    e.add("a", a)
    e.run()
    e.close()
    assert e.errors == [] and e.worker.counters["chunks_saved"] == 3
    with tierstore.open(store, readonly=True) as s:
        infos = [s.info(k, namespace="vllm") for k in s.keys(namespace="vllm")]
        assert {(i.kind, i.shape, i.dtype) for i in infos} == {("mla", (LAYERS, 32, MLA_DIM), "bfloat16")}
    e2 = Engine(tmp_path, store, mla=True)
    e2.add("b", a[:70] + [5] * 30)
    first = e2.step()
    assert first.scheduled_new_reqs[0].num_computed_tokens == 64
    assert e2.worker.check_last_loads()["mismatches"] == 0
    e2.run()
    e2.close()
    assert e2.errors == [] and e2.worker.counters["chunks_loaded"] == 2


def test_options_are_checked_at_start(tmp_path):
    from vllm.config import CacheConfig as CC

    def create(cfg):
        return KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config())

    with pytest.raises(ValueError, match="codec"):
        create(make_config(tmp_path, tmp_path / "kv", extra={"codec": "no-such-codec"}))
    with pytest.raises(ValueError, match="codec"):
        create(make_config(tmp_path, tmp_path / "kv", extra={"codec": "int4"}, mla=True))  # not for MLA latents
    for fp8 in ("fp8", "fp8_inc"):  # (fp8_inc: a pool of plain fp8 values, accepted with int8 before)
        cfg = make_config(tmp_path, tmp_path / "kv", extra={"codec": "int8"})
        cfg.cache_config = CC(block_size=BLOCK, cache_dtype=fp8)
        with pytest.raises(ValueError, match="already fp8"):
            create(cfg)
    with pytest.raises(ValueError, match="durability"):
        create(make_config(tmp_path, tmp_path / "kv", extra={"store_options": {"durability": "none"}}))
    create(make_config(tmp_path, tmp_path / "kv", extra={"codec": "int8"})).shutdown()  # the valid twin


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_a_producer_only_saves_and_a_consumer_only_loads(tmp_path, role):
    store = tmp_path / "kv"
    a = list(range(100, 200))
    serve(tmp_path, store, [a])
    e2 = Engine(tmp_path, store, role=role)
    e2.add("b", a[:70] + list(range(900, 960)))  # 64 tokens stored; 2 new full chunks after them
    first = e2.step()
    e2.run()
    e2.close()
    assert first.scheduled_new_reqs[0].num_computed_tokens == (0 if role == "kv_producer" else 64)
    assert e2.errors == []
    with tierstore.open(store, readonly=True) as s:
        assert len(s.keys(namespace="vllm")) == 3 + (2 if role == "kv_producer" else 0)


# -- after a cold review (2026-12-01) ----------------------------------------------------------------


def test_sliding_window_and_other_non_prefix_layer_groups_are_refused(tmp_path):
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    spec = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float16,
                             sliding_window=16)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    swa = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)])
    cfg = make_config(tmp_path, tmp_path / "kv")
    with pytest.raises(ValueError, match="SlidingWindowSpec"):
        KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, swa)
    KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config())  # twin: full attention


def test_a_failed_load_drops_the_saves_of_its_step(tmp_path):
    """Chunks computed in the step whose load failed attended to the failed blocks: never stored
    from that step (vLLM recomputes them, and they are stored then)."""
    store = tmp_path / "kv"
    a = list(range(700, 800))
    serve(tmp_path, store, [a])
    victim = damage_second_chunk(store)
    e = Engine(tmp_path, store, policy="recompute", prefix_caching=False)
    e.add("longer", a + list(range(900, 964)))  # three stored chunks (the second damaged), two more computed
    first = e.step()
    assert first.kv_connector_metadata.saves and e.last_failed  # saves planned in the step whose load failed
    e.run()
    e.close()
    assert e.errors == [] and e.worker.counters["saves_dropped"] >= len(first.kv_connector_metadata.saves)
    with tierstore.open(store, readonly=True) as s:  # stored later, once recomputed
        assert len(s.keys(namespace="vllm")) == 5 and s.info(victim.key, namespace="vllm").lsn > victim.lsn


def test_a_failed_load_keeps_the_saves_of_unrelated_requests_of_its_step(tmp_path):
    """Only the chunks computed from the failed blocks are dropped: a request of the same step
    that never attended to them had its chunks dropped too, and never saved (its next chunk had
    moved past them) -- found by a cold review."""
    store = tmp_path / "kv"
    a, other = list(range(500, 600)), list(range(3000, 3100))
    serve(tmp_path, store, [a])
    damage_second_chunk(store)
    e = Engine(tmp_path, store, policy="recompute", prefix_caching=False)
    e.add("again", a)
    e.add("other", other)
    e.step()
    assert e.last_failed  # the step that failed a load also computed "other"
    e.run()
    e.close()
    want = Engine(tmp_path, store).sched.connector._keys_for(Request("x", other, SamplingParams(max_tokens=1),
                                                                      None))[0]
    with tierstore.open(store, readonly=True) as s:
        assert all(s.contains_many(want, namespace="vllm"))


@pytest.mark.parametrize("first", [40, 20])
def test_a_streaming_session_saves_the_chunks_of_its_later_input(tmp_path, first):
    """vLLM appends a streaming session's next input to the same request's prompt, and asks the
    connector no match for it: the keys of the first input were kept, and nothing past it was
    ever saved -- found by a cold review; nor, by another, when the first input was shorter
    than a chunk (no keys were made for it at all)."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher

    store = tmp_path / "kv"
    e = Engine(tmp_path, store)
    e.add("s", list(range(100, 100 + first)), max_tokens=3, resumable=True)
    sess = e.sched.requests["s"]
    for _ in range(10):
        if sess.status.name == "WAITING_FOR_STREAMING_REQ":
            break
        e.step()
    e.sched.add_request(Request("s", list(range(500, 560)), SamplingParams(max_tokens=3, ignore_eos=True), None,
                                block_hasher=get_request_block_hasher(BLOCK, sha256), resumable=True))
    assert len(sess.prompt_token_ids) // 32 == (3 if first == 40 else 2)
    for _ in range(10):
        if sess.status.name == "WAITING_FOR_STREAMING_REQ":
            break
        e.step()
    full = list(sess.prompt_token_ids)
    e.close()
    want = Engine(tmp_path, store).sched.connector._keys_for(Request("x", full, SamplingParams(max_tokens=1),
                                                                      None))[0]
    with tierstore.open(store, readonly=True) as s:
        assert s.contains_many(want, namespace="vllm") == [True] * len(want)


def _worker_step(w, caches, meta):
    """One step of a worker connector alone (no model: the blocks hold what they hold), its hooks
    in vLLM's order: ``start_load_kv`` before the forward pass with loads, after it without."""
    w.bind_connector_metadata(meta)
    if meta.loads:
        w.start_load_kv(None)
    for name, layer in caches.items():
        w.wait_for_layer_load(name)
        w.save_kv_layer(name, layer, None)
    if not meta.loads:
        w.start_load_kv(None)
    w.wait_for_save()
    failed = w.get_block_ids_with_load_errors()
    w.clear_connector_metadata()
    return failed


def test_with_asynchronous_scheduling_the_next_step_drops_saves_computed_from_failed_blocks(tmp_path):
    """With async scheduling vLLM built the next step before it heard of the failure: what that step
    computes from the failed blocks (for any request whose prefix holds them) is garbage too, even
    when the failing step itself had saves to drop."""
    from tierstore.integrations.vllm import ChunkLoad, ChunkSave
    from tierstore.integrations.vllm import TierstoreConnectorMetadata as M

    cfg = make_config(tmp_path, tmp_path / "kv", policy="recompute")
    cfg.scheduler_config.async_scheduling = True
    w = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kv_cache_config())
    caches = paged_caches(False)
    w.register_kv_caches(caches)
    # step N: a chunk evicted since its match fails to load into blocks 0, 1; a save of the step
    failed = _worker_step(w, caches, M(loads=[ChunkLoad("r", [b"E" * 16], [0, 1], [0, 1])],
                                       saves=[ChunkSave("r", [b"A" * 16], [2, 3], [0, 1])]))
    assert failed == {0, 1}
    # step N+1, built before the failure was known: r's next chunk, another request's chunk on the
    # same (cached) prefix, and a request that does not read the failed blocks
    _worker_step(w, caches, M(saves=[ChunkSave("r", [b"B" * 16], [4, 5], [0, 1, 2, 3]),
                                     ChunkSave("s", [b"S" * 16], [6, 7], [0, 1]),
                                     ChunkSave("q", [b"Q" * 16], [8, 9], [10, 11])]))
    _worker_step(w, caches, M(saves=[ChunkSave("t", [b"T" * 16], [12, 13], [0, 1])]))  # N+2: recomputed by then
    w.shutdown()
    assert w.counters["saves_dropped"] == 3
    with tierstore.open(tmp_path / "kv", readonly=True) as s:
        assert sorted(s.keys(namespace="vllm")) == [b"Q" * 16, b"T" * 16]


def test_with_asynchronous_scheduling_a_request_sharing_failed_blocks_stores_no_garbage(tmp_path):
    """vLLM's AsyncScheduler: R's load of chunk 1 fails in step N; S, with the same prefix, was
    scheduled in step N+1 before vLLM heard of it and reuses R's blocks from vLLM's prefix cache.
    S's chunks computed from them are not stored; a restarted engine loads only right KV."""

    store = tmp_path / "kv"
    a = list(range(100, 200))
    serve(tmp_path, store, [a])  # chunks 0, 1, 2 of a
    with tierstore.open(store) as s:
        victim = sorted((s.info(k, namespace="vllm") for k in s.keys(namespace="vllm")), key=lambda i: i.lsn)[1].key
    e = Engine(tmp_path, store, policy="recompute", async_scheduling=True)
    e.add("R", a, max_tokens=4)
    out_n = e.sched.schedule()  # R: 96 tokens matched
    with tierstore.open(store) as s:
        s.delete(victim, namespace="vllm")  # evicted between the match and the load
    e.add("S", a[:96] + list(range(5000, 5040)), max_tokens=1)
    out_n1 = e.sched.schedule()  # before step N's output is known
    assert [sv.req_id for sv in out_n1.kv_connector_metadata.saves] == ["S", "S"]
    for out in (out_n, out_n1):
        for n in out.scheduled_new_reqs:
            e.tables[n.req_id] = list(n.block_ids[0])
        starts = {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        starts.update({rid: cached.num_computed_tokens[i] for i, rid in enumerate(cached.req_ids)})
        e.forward(out, starts)
    e.close()
    assert e.worker.counters["saves_dropped"] >= 2
    with tierstore.open(store, readonly=True) as s:
        assert not s.contains(victim, namespace="vllm")
    serve(tmp_path, store, [a, a[:96] + list(range(5000, 5040))])  # every token's KV checked


def test_other_tensor_ranks_delete_what_they_saved_on_top_of_a_failed_load(tmp_path):
    """Rank 0's copy of chunk A was evicted, rank 1's was not: rank 1's load succeeds, but chunk B
    computed on top of A depends on rank 0's garbage heads.  Once the scheduler hears of the
    failure (any rank's failed blocks), the next step's metadata has every worker delete B, so
    that B is saved again, right, once recomputed -- rank 1 never keeps a wrong B that rank 0's
    later save would complete into a match."""
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput

    from tierstore.integrations.vllm import ChunkLoad, ChunkSave
    from tierstore.integrations.vllm import TierstoreConnectorMetadata as M

    def config(rank=None):
        cfg = make_config(tmp_path, tmp_path / "kv", policy="recompute",
                          extra=None if rank is None else {"tp_rank": rank, "pp_rank": 0})
        cfg.parallel_config.tensor_parallel_size = 2
        return cfg

    ranks = []
    for rank in (0, 1):
        w = KVConnectorFactory.create_connector(config(rank), KVConnectorRole.WORKER, kv_cache_config())
        caches = paged_caches(False)
        w.register_kv_caches(caches)
        ranks.append((w, caches))
    sched = KVConnectorFactory.create_connector(config(), KVConnectorRole.SCHEDULER, kv_cache_config())
    a, b = [b"A0" * 8, b"A1" * 8], [b"B0" * 8, b"B1" * 8]
    for w, caches in ranks:
        _worker_step(w, caches, M(saves=[ChunkSave("p", a, [0, 1])]))
        w.flush()
    ranks[0][0].store.delete(a[0], namespace="vllm")  # evicted for rank 0 only
    step = M(loads=[ChunkLoad("r", a, [0, 1], [0, 1])], saves=[ChunkSave("r", b, [2, 3], [0, 1])])
    sched._recent.append(step)  # (what build_connector_meta recorded when it planned the step)
    failed = set().union(*(_worker_step(w, caches, step) for w, caches in ranks))
    assert failed == {0, 1}
    ranks[1][0].flush()
    with tierstore.open(tmp_path / "kv", readonly=True) as s:
        assert s.contains(b[1], namespace="vllm") and not s.contains(b[0], namespace="vllm")  # the wrong B
    sched.update_connector_output(KVConnectorOutput(invalid_block_ids=failed))
    nxt = sched.build_connector_meta(SchedulerOutput.make_empty())
    assert nxt.forget == [b]
    assert sched.build_connector_meta(SchedulerOutput.make_empty()).forget == []  # once
    for w, caches in ranks:
        _worker_step(w, caches, nxt)
    assert [w.counters["saves_forgotten"] for w, _ in ranks] == [0, 1]
    for w, _ in ranks:
        w.shutdown()
    sched.shutdown()
    with tierstore.open(tmp_path / "kv", readonly=True) as s:
        assert s.keys(namespace="vllm") == [a[1]]


@pytest.mark.parametrize("pp, async_scheduling, steps", [(1, False, 1), (1, True, 2), (2, False, 2)])
def test_the_scheduler_forgets_saves_of_every_step_built_before_it_heard_of_a_failure(tmp_path, pp,
                                                                                      async_scheduling, steps):
    """vLLM builds up to ``max_concurrent_batches`` steps before it hears how the oldest ended
    (pipeline stages, async scheduling): the saves of all of them that read a failed block are
    forgotten, and no older ones."""
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput

    from tierstore.integrations.vllm import ChunkSave
    from tierstore.integrations.vllm import TierstoreConnectorMetadata as M

    cfg = make_config(tmp_path, tmp_path / "kv", policy="recompute")
    cfg.parallel_config.pipeline_parallel_size = pp
    cfg.scheduler_config.async_scheduling = async_scheduling
    assert cfg.max_concurrent_batches == steps
    sched = KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config())
    for n in range(3):  # three steps built, each saving a chunk computed from block 0 (and one that is not)
        sched._recent.append(M(saves=[ChunkSave(f"r{n}", [b"%d" % n * 16], [10 + n], [0]),
                                      ChunkSave(f"q{n}", [b"q%d" % n * 8], [20 + n], [30])]))
    sched.update_connector_output(KVConnectorOutput(invalid_block_ids={0}))
    forget = sched.build_connector_meta(SchedulerOutput.make_empty()).forget
    assert forget == [[b"%d" % n * 16] for n in range(3 - steps, 3)]
    sched.shutdown()


def test_saves_staged_by_a_step_that_never_reached_wait_for_save_are_not_written(tmp_path):
    from tierstore.integrations.vllm import ChunkSave
    from tierstore.integrations.vllm import TierstoreConnectorMetadata as M

    w = KVConnectorFactory.create_connector(make_config(tmp_path, tmp_path / "kv"), KVConnectorRole.WORKER,
                                            kv_cache_config())
    caches = paged_caches(False)
    w.register_kv_caches(caches)
    w.bind_connector_metadata(M(saves=[ChunkSave("r", [b"A" * 16], [0, 1])]))
    w.start_load_kv(None)
    for name, layer in caches.items():
        w.save_kv_layer(name, layer, None)  # ... and the step dies before wait_for_save
    w.clear_connector_metadata()
    _worker_step(w, caches, M())  # the next step has nothing to save
    w.shutdown()
    assert w.counters["saves_dropped"] == 1
    with tierstore.open(tmp_path / "kv", readonly=True) as s:
        assert s.keys(namespace="vllm") == []  # the twin above: a step that ends saves


def test_reset_cache_starts_a_new_epoch(tmp_path):
    store = tmp_path / "kv"
    a = list(range(1000, 1100))
    serve(tmp_path, store, [a])
    e = Engine(tmp_path, store)
    conn = e.sched.connector
    r = Request("x", a, SamplingParams(max_tokens=1), None)
    assert conn.get_num_new_matched_tokens(r, 0)[0] == 96
    assert conn.reset_cache() is True
    assert conn.get_num_new_matched_tokens(r, 0)[0] == 0  # stored before the reset: never loaded again
    e.close()


def test_the_codec_and_the_layer_order_are_in_the_fingerprint(tmp_path):
    from tierstore.integrations.vllm import model_fingerprint

    cfg = make_config(tmp_path, tmp_path / "kv")
    names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(LAYERS))
    base = model_fingerprint(cfg, pp_rank=0, tp_rank=0, layers=names)
    assert model_fingerprint(cfg, pp_rank=0, tp_rank=0, layers=names, codec="int8") != base
    assert model_fingerprint(cfg, pp_rank=0, tp_rank=0, layers=names[::-1]) != base
    assert model_fingerprint(cfg, pp_rank=0, tp_rank=0, layers=names, epoch=1) != base
    assert model_fingerprint(cfg, pp_rank=0, tp_rank=0, layers=names) == base  # twin: deterministic


def test_ranks_come_from_vllm_and_unknown_ones_are_refused(tmp_path):
    cfg = make_config(tmp_path, tmp_path / "kv")
    cfg.parallel_config.tensor_parallel_size = 2  # with no process groups of that size in this process
    with pytest.raises(ValueError, match="cannot tell this worker's ranks"):
        KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kv_cache_config())
    cfg = make_config(tmp_path, tmp_path / "kv", extra={"tp_rank": 1})
    cfg.parallel_config.tensor_parallel_size = 2
    w = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kv_cache_config())
    assert w._worker == 1 and w.requires_kv_delivery is False


def test_one_step_stages_at_most_max_pending_bytes(tmp_path):
    """Three full chunks complete in one step, room for one (a chunk here: 2 layers x 2 x 2 heads
    x 32 tokens x 16 dims x 2 bytes = 8 KiB): one is saved, two are counted as dropped -- a later
    miss, never pinned memory past the bound.  The twin with the default bound saves all three."""
    results = {}
    for name, extra in (("bounded", {"max_pending_bytes": 12_000}), ("default", None)):
        store = tmp_path / name
        e = Engine(tmp_path, store, extra=extra)
        e.add("a", list(range(100, 200)))
        e.run()
        e.close()
        assert e.errors == []
        with tierstore.open(store, readonly=True) as s:
            results[name] = (len(s.keys(namespace="vllm")), e.worker.counters["saves_dropped"])
    assert results == {"bounded": (1, 2), "default": (3, 0)}


def _forward_on_garbage(e, out, starts, memo):
    """A step's forward in which a token's KV at layer l is wrong when an earlier position of its
    request holds wrong KV at a layer below l (attention reads it): what a real model does with
    the garbage of a failed load."""
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.forward_context import set_forward_context
    from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

    def kv_at(li, toks, pos):
        k = (li, tuple(toks[: pos + 1]))
        if k not in memo:
            memo[k] = token_kv(li, toks[: pos + 1], pos)[0]
        return memo[k]

    w = e.worker
    kv_transfer_state._KV_CONNECTOR_AGENT = w
    try:
        with set_forward_context(None, e.cfg), KVConnectorModelRunnerMixin._get_kv_connector_output(out) as co:
            wrong: dict[str, int] = {}
            for name, layer in e.caches.items():
                li = int(name.split(".")[2])
                w.wait_for_layer_load(name)
                for rid, n in out.num_scheduled_tokens.items():
                    done, table = starts[rid], e.tables[rid]
                    toks = (list(e.reqs[rid].all_token_ids) + [0] * n)[: done + n]
                    wrong.setdefault(rid, 99)
                    if wrong[rid] == 99 and any(not torch.equal(layer[table[p // BLOCK], :, p % BLOCK],
                                                                kv_at(li, toks, p)) for p in range(done)):
                        wrong[rid] = li
                    for p in range(done, done + n):
                        layer[table[p // BLOCK], :, p % BLOCK] = kv_at(li, toks, p) + (1 if li > wrong[rid] else 0)
                w.save_kv_layer(name, layer, None)
    finally:
        kv_transfer_state._KV_CONNECTOR_AGENT = None
    return set(co.invalid_block_ids)


def test_a_request_sharing_a_block_whose_load_failed_never_stores_what_it_computed_on_it(tmp_path):
    """R's load of its first chunk fails (evicted between match and load); the step vLLM built
    before it heard of it schedules S, which shares R's first block through vLLM's prefix cache,
    on top of that garbage.  vLLM keeps S's tokens (R is to recompute the block), and S's first
    chunk, completed in a later step, was saved with wrong KV above layer 0 (cold review; a
    fuzzer found the same with chunked prefill).  A request that shares a failed block it did
    not load saves nothing from then on; every stored chunk holds its tokens' exact KV."""
    store = tmp_path / "kv"
    base = list(range(100, 132))
    serve(tmp_path, store, [base + [7] * 8])  # chunk 0 (32 tokens) of `base` stored
    r_tokens = base + list(range(200, 208))  # loads chunk 0, computes 8
    s_tokens = base[:16] + list(range(300, 340))  # shares R's first block only
    e = Engine(tmp_path, store, policy="recompute", async_scheduling=True, max_batched=8, prefix_caching=True)
    kv_out, mro = e._outputs
    e.add("R", r_tokens, max_tokens=6)
    pending, step, memo, failures = None, 0, {}, []
    while step < 40 and (e.sched.get_num_unfinished_requests() or pending):
        out = e.sched.schedule()
        if step == 0:
            assert out.kv_connector_metadata.loads
            with tierstore.open(store) as s:  # evicted between the match and the load
                s.delete(out.kv_connector_metadata.loads[0].keys[0], namespace="vllm")
            e.add("S", s_tokens, max_tokens=2)  # scheduled in the next step, before this one's outcome
        if pending is not None:
            e.sched.update_from_output(*pending)
            pending = None
        starts = e.scheduled(out)
        failed = _forward_on_garbage(e, out, starts, memo)
        failures += failed
        ids = list(out.num_scheduled_tokens)
        sampled = [[900 + step] if starts[r] + out.num_scheduled_tokens[r] >= e.reqs[r].num_prompt_tokens else []
                   for r in ids]
        pending = (out, mro(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                            sampled_token_ids=sampled, kv_connector_output=kv_out(invalid_block_ids=failed)))
        step += 1
    e.close()
    assert failures  # the load did fail
    conn = Engine(tmp_path, store).sched.connector
    checked = 0
    with tierstore.open(store, readonly=True) as s:
        for name, toks in (("R", r_tokens), ("S", s_tokens)):
            for ci, k in enumerate(conn._keys_for(Request("x" + name, toks, SamplingParams(max_tokens=1), None))[0]):
                if not s.contains(k, namespace="vllm"):
                    continue
                obj = s.get(k, namespace="vllm", device="cpu").data
                for li in range(LAYERS):
                    want = token_kv(li, toks[: (ci + 1) * 32], ci * 32)
                    got = torch.cat([obj[li, 0], obj[li, 1]], dim=-1).permute(1, 0, 2)
                    assert torch.equal(got, want), (name, ci, li)
                    checked += 1
    assert checked  # R's chunk, recomputed, is stored again


# one tensor-parallel rank's worker in its own process, as vLLM runs them: its own paged caches
# (random contents, seeded by the rank), saving chunk c from blocks 2c, 2c+1, one chunk a step
RANK_WORKER = r"""
import json, pathlib, sys
sys.path.insert(0, ROOT)
import torch
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from tests.vllm.test_vllm_connector import _rank_caches, _tp_config, _worker_step, kv_cache_config
from tierstore.integrations.vllm import ChunkSave, TierstoreConnectorMetadata as M
tmp, rank, keys = pathlib.Path(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
w = KVConnectorFactory.create_connector(_tp_config(tmp, rank), KVConnectorRole.WORKER, kv_cache_config())
caches = _rank_caches(rank)
w.register_kv_caches(caches)
for c, ks in enumerate(keys):
    _worker_step(w, caches, M(saves=[ChunkSave("r", [bytes.fromhex(k) for k in ks], [2 * c, 2 * c + 1])]))
w.shutdown()
print(json.dumps(w.counters))
""".replace("ROOT", repr(str(__import__("pathlib").Path(__file__).resolve().parents[2])))


def _tp_config(tmp_path, rank=None):
    cfg = make_config(tmp_path, tmp_path / "kv", extra=None if rank is None else {"tp_rank": rank, "pp_rank": 0})
    cfg.parallel_config.tensor_parallel_size = 2
    return cfg


def _rank_caches(rank, zero=False):
    caches = paged_caches(False)
    g = torch.Generator().manual_seed(rank)
    for t in caches.values():
        t.copy_(torch.zeros(t.shape) if zero else torch.randn(t.shape, generator=g).to(t.dtype))
    return caches


def test_tensor_parallel_ranks_in_separate_processes_share_one_store(tmp_path):
    """Each tensor-parallel rank is its own process and stores its own heads: two rank processes
    save the chunks of one prompt into one store at the same time (several writer processes), the
    scheduler then matches the whole prefix (each chunk counted once every rank stored it), and
    each rank loads back its own heads, bit exact, never the other rank's."""
    import subprocess
    import sys

    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    from tierstore.integrations.vllm import ChunkLoad
    from tierstore.integrations.vllm import TierstoreConnectorMetadata as M

    chunks = 12
    make_config(tmp_path, tmp_path / "kv")  # (the model's config.json, before the ranks read it)
    sched = KVConnectorFactory.create_connector(_tp_config(tmp_path), KVConnectorRole.SCHEDULER, kv_cache_config())
    init_none_hash(sha256)
    req = Request("r", list(range(100, 100 + 32 * chunks + 1)), SamplingParams(max_tokens=1), None,
                  block_hasher=get_request_block_hasher(BLOCK, sha256))
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    per_rank = sched._keys_for(req)  # [rank][chunk]
    keys = [[per_rank[r][c].hex() for r in range(2)] for c in range(chunks)]
    procs = [subprocess.Popen([sys.executable, "-c", RANK_WORKER, str(tmp_path), str(rank), json.dumps(keys)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        assert json.loads(out.strip().splitlines()[-1])["chunks_saved"] == chunks
    assert sched.get_num_new_matched_tokens(req, 0) == (32 * chunks, False)
    sched.shutdown()
    for rank in (0, 1):
        w = KVConnectorFactory.create_connector(_tp_config(tmp_path, rank), KVConnectorRole.WORKER, kv_cache_config())
        caches = _rank_caches(rank, zero=True)
        w.register_kv_caches(caches)
        loads = [ChunkLoad("r", [bytes.fromhex(k) for k in ks], [2 * c, 2 * c + 1], [0, 1])
                 for c, ks in enumerate(keys)]
        assert _worker_step(w, caches, M(loads=loads)) == set()
        w.shutdown()
        want, other = _rank_caches(rank), _rank_caches(1 - rank)
        for name, t in caches.items():
            assert torch.equal(t[: 2 * chunks], want[name][: 2 * chunks])
            assert not torch.equal(t[: 2 * chunks], other[name][: 2 * chunks])
    with tierstore.open(tmp_path / "kv", readonly=True) as s:
        assert len(s.keys(namespace="vllm")) == 2 * chunks


def test_store_options_errors_name_the_option_and_a_read_only_consumer_shuts_down(tmp_path):
    """From a new user's review (2026-12-03): store_options given as a string raised "dictionary
    update sequence element #0 has length 1"; store_options.readonly was accepted by a role that
    saves (its saves then failed one by one), and a read-only consumer's shutdown raised
    ReadOnlyError from flush().  Now: the option is named, a saving role over a read-only store is
    refused at start, and a kv_consumer over one loads and shuts down cleanly."""
    store = tmp_path / "kv"
    tierstore.open(str(store)).close()
    with pytest.raises(ValueError, match="store_options must be a dict"):
        KVConnectorFactory.create_connector(make_config(tmp_path, store, extra={"store_options": "ssd_bytes=1GiB"}),
                                            KVConnectorRole.SCHEDULER, kv_cache_config())
    with pytest.raises(ValueError, match="kv_consumer"):
        KVConnectorFactory.create_connector(make_config(tmp_path, store, extra={"store_options": {"readonly": True}}),
                                            KVConnectorRole.SCHEDULER, kv_cache_config())
    cfg = make_config(tmp_path, store, extra={"store_options": {"readonly": True}}, role="kv_consumer")
    c = KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config())
    c.shutdown()


def test_a_config_json_edited_at_the_same_path_changes_the_fingerprint(tmp_path):
    """The fingerprint named the model by its path: a config.json edited there (rope_theta,
    rope_scaling) changes the KV but kept the keys, and stale KV was loaded (a new user's review,
    2026-12-03).  The configuration as loaded is part of it now; fields that do not change the
    KV (eos_token_id) are not."""
    from tierstore.integrations.vllm import model_fingerprint

    base = model_fingerprint(make_config(tmp_path, tmp_path / "kv"), pp_rank=0, tp_rank=0)
    model = tmp_path / "tiny-llama"
    original = json.loads((model / "config.json").read_text())

    def edited(**fields):  # the same path, config.json edited (make_config would write it again)
        (model / "config.json").write_text(json.dumps({**original, **fields}))
        return model_fingerprint(_config(model, tmp_path / "kv", 32, None, "fail", "float16"), pp_rank=0, tp_rank=0)

    assert edited() == base
    assert edited(eos_token_id=7) == base
    assert edited(rope_theta=5000.0) != base


def test_the_fingerprint_is_the_same_in_every_process(tmp_path):
    """hf_overrides may be a function, which str() prints with its memory address: each process
    (scheduler, workers) got its own salt and nothing stored was ever matched; a set in the
    configuration printed in hash-seed order (a review, 2026-12-03).  Two interpreters with
    different hash seeds agree now."""
    code = f"""
import sys, json
sys.path.insert(0, {str(os.path.dirname(__file__))!r})
from test_vllm_connector import make_config
from tierstore.integrations.vllm import model_fingerprint
def override(config):
    return config
cfg = make_config(__import__("pathlib").Path({str(tmp_path)!r}), __import__("pathlib").Path({str(tmp_path / "kv")!r}))
cfg.model_config.hf_overrides = override
print(model_fingerprint(cfg, pp_rank=0, tp_rank=0).hex())
"""
    outs = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        outs.add(out.stdout.split()[-1])
    assert len(outs) == 1
