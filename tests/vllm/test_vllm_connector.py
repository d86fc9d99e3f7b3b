"""tierstore.integrations.vllm against the real vLLM package (0.33, CPU): its config classes,
its connector factory (loading the connector by module path, as ``--kv-transfer-config`` does),
its Scheduler (prefix matching, block allocation, the metadata each step) and its per-layer
KV views ``[blocks, heads, block_tokens, K|V]``.  The model's forward pass is played by a
function that writes a known K and V for each token into its blocks, layer by layer, calling
the connector's hooks where vLLM's attention layers call them."""

from __future__ import annotations

import json

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


def make_config(tmp_path, store, *, chunk_tokens=32, tp=1, extra=None):
    model = tmp_path / "tiny-llama"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HEADS * 2 * HEAD_DIM,
        "intermediate_size": 128, "num_attention_heads": HEADS * 2, "num_key_value_heads": HEADS,
        "num_hidden_layers": LAYERS, "vocab_size": 1000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
        "torch_dtype": "float16", "head_dim": HEAD_DIM}))
    mc = ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="float16", max_model_len=2048)
    kv = KVTransferConfig(kv_connector="TierstoreConnector", kv_role="kv_both",
                          kv_connector_module_path="tierstore.integrations.vllm",
                          kv_connector_extra_config={"path": str(store), "chunk_tokens": chunk_tokens,
                                                     "durability": "sync", **(extra or {})})
    cfg = VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=BLOCK), kv_transfer_config=kv,
                     device_config=DeviceConfig(device="cpu"))
    cfg.cache_config.num_gpu_blocks = NUM_BLOCKS  # what the engine sets after profiling memory
    return cfg


def kv_cache_config():
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float16)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)])


def paged_caches(hnd: bool):
    """One standardised [blocks, heads, block_tokens, K|V] view per layer, NHD or HND in memory."""
    out = {}
    for i in range(LAYERS):
        if hnd:
            t = torch.zeros(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM, dtype=torch.float16)
        else:
            t = torch.zeros(NUM_BLOCKS, BLOCK, HEADS, 2 * HEAD_DIM, dtype=torch.float16).permute(0, 2, 1, 3)
        out[f"model.layers.{i}.self_attn.attn"] = t
    return out


def token_kv(layer: int, tokens: list[int], start: int) -> torch.Tensor:
    """The K|V a model would compute for tokens[start:]: [n, heads, 2*head_dim], a function of the
    layer, the token and every token before it (so a different prefix gives different KV)."""
    out = []
    for pos in range(start, len(tokens)):
        g = torch.Generator().manual_seed(hash((layer, tuple(tokens[: pos + 1]))) & 0x7FFFFFFF)
        out.append(torch.randn(HEADS, 2 * HEAD_DIM, generator=g))
    return torch.stack(out).half() if out else torch.zeros(0, HEADS, 2 * HEAD_DIM).half()


def forward(worker, caches, out, requests):
    """One step of the model: the connector's hooks around each layer, as vLLM's attention layers
    call them, and the step's tokens written into their blocks."""
    worker.bind_connector_metadata(out.kv_connector_metadata)
    worker.start_load_kv(None)
    sched = {r.req_id: (r.num_computed_tokens, r.block_ids[0]) for r in out.scheduled_new_reqs}
    for name, layer in caches.items():
        i = int(name.split(".")[2])
        worker.wait_for_layer_load(name)
        for rid, (done, blocks) in sched.items():
            tokens = requests[rid].prompt_token_ids
            n = out.num_scheduled_tokens[rid]
            kv = token_kv(i, tokens[: done + n], done)
            for j, pos in enumerate(range(done, done + n)):
                layer[blocks[pos // BLOCK], :, pos % BLOCK] = kv[j]
        worker.save_kv_layer(name, layer, None)
    worker.wait_for_save()
    failed = worker.get_block_ids_with_load_errors()
    worker.clear_connector_metadata()
    return failed


def gathered(caches, blocks, n):
    """The K|V held for the first n tokens of a request's blocks, per layer."""
    return [torch.stack([layer[blocks[p // BLOCK], :, p % BLOCK] for p in range(n)]) for layer in caches.values()]


def serve(tmp_path, store, prompts, *, hnd=False, chunk_tokens=32, extra=None):
    """A fresh engine (scheduler + worker, as after a restart) that prefills each prompt."""
    cfg = make_config(tmp_path, store, chunk_tokens=chunk_tokens, extra=extra)
    kcc = kv_cache_config()
    sched = Scheduler(vllm_config=cfg, kv_cache_config=kcc, structured_output_manager=StructuredOutputManager(cfg),
                      block_size=BLOCK)
    worker = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kcc)
    caches = paged_caches(hnd)
    worker.register_kv_caches(caches)
    results = []
    try:
        for n, tokens in enumerate(prompts):
            req = Request(f"r{n}", tokens, SamplingParams(max_tokens=1), None)
            sched.add_request(req)
            out = sched.schedule()
            failed = forward(worker, caches, out, {req.request_id: req})
            new = out.scheduled_new_reqs[0]
            results.append({"loaded": new.num_computed_tokens, "blocks": new.block_ids[0], "failed": failed,
                            "kv": gathered(caches, new.block_ids[0], len(tokens))})
            sched.finish_requests([req.request_id], __import__("vllm.v1.request", fromlist=["RequestStatus"])
                                  .RequestStatus.FINISHED_ABORTED)
    finally:
        worker.shutdown()
        sched.shutdown() if hasattr(sched, "shutdown") else None
    return results, worker


def expected(tokens):
    return [token_kv(i, tokens, 0) for i in range(LAYERS)]


@pytest.mark.parametrize("hnd", [False, True], ids=["NHD", "HND"])
def test_a_restarted_engine_loads_the_stored_prefix_bit_exact(tmp_path, hnd):
    store = tmp_path / "kv"
    a = list(range(100, 200))  # 100 tokens: 3 full chunks of 32
    first, w1 = serve(tmp_path, store, [a], hnd=hnd)
    assert first[0]["loaded"] == 0 and w1.counters["chunks_saved"] == 3
    b = a[:70] + [7] * 30  # shares 70 tokens: 2 whole chunks (64 tokens)
    second, w2 = serve(tmp_path, store, [b], hnd=not hnd)  # the other layout after the restart
    assert second[0]["loaded"] == 64 and w2.counters["chunks_loaded"] == 2
    for got, want in zip(second[0]["kv"], expected(b)):
        assert torch.equal(got, want)  # loaded prefix and computed suffix, bit for bit
    with tierstore.open(store, readonly=True) as s:
        assert len(s.keys(namespace="vllm")) == 3 + 1  # b's third chunk differs: stored too


def test_the_last_prompt_token_is_always_computed(tmp_path):
    store = tmp_path / "kv"
    a = list(range(64))  # exactly two chunks
    serve(tmp_path, store, [a])
    again, w = serve(tmp_path, store, [a])
    assert again[0]["loaded"] == 32  # not 64: vLLM must compute the last token itself
    for got, want in zip(again[0]["kv"], expected(a)):
        assert torch.equal(got, want)


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


def test_bad_options_are_clear_errors(tmp_path):
    cfg = make_config(tmp_path, tmp_path / "kv", chunk_tokens=24)
    with pytest.raises(ValueError, match="multiple of the block size"):
        KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config())
