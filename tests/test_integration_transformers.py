"""tierstore.integrations.transformers.PrefixCache against real transformers models built from a
config with random weights (no download): a restored prefix gives the logits and greedy tokens
of a full prefill, and nothing stale, damaged or of another model is ever loaded."""

from __future__ import annotations

import copy
import logging
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import tierstore  # noqa: E402
from tierstore import InvalidObject  # noqa: E402
from tierstore.integrations.transformers import PrefixCache, model_fingerprint, weights_sample_digest  # noqa: E402

from .conftest import segment_files  # noqa: E402

VOCAB = 256


def _model(arch: str = "llama", dtype=torch.float32, seed: int = 0, **extra):
    torch.manual_seed(seed)
    common = dict(num_hidden_layers=3, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=1024, **extra)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**common)
        cls = transformers.Qwen2ForCausalLM
    else:
        cfg = transformers.MistralConfig(**{"sliding_window": None, **common})
        cls = transformers.MistralForCausalLM
    return cls(cfg).to(dtype).eval()


def _ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def _greedy(model, ids, n=32):
    return model.generate(ids, max_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(ids))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_restored_prefix_gives_the_full_prefill_logits_and_tokens(store_path, arch):
    model = _model(arch)
    ids = _ids(100)
    with tierstore.open(store_path) as store, torch.no_grad():
        pc = PrefixCache(store, model, chunk_tokens=16)
        first = pc.generate(ids, max_new_tokens=4, do_sample=False)  # stores the prompt's chunks
        assert store.stats()["objects_indexed"] == 6  # 103 tokens in the cache: 6 full chunks
        cache, n = pc.load(ids)
        assert n == 96 and cache.get_seq_length() == 96
        k0 = cache.layers[0].keys
        assert k0.shape == (1, 2, 96, 16) and k0.dtype == model.dtype  # the un-repeated GQA heads
        full = model(ids).logits[:, n:]
        rest = model(ids[:, n:], **{pc.cache_argument: cache}).logits
        assert (full - rest).abs().max().item() <= 1e-4
        ref = _greedy(model, ids)
        again = pc.generate(ids, max_new_tokens=32, do_sample=False)
        assert torch.equal(again, ref) and torch.equal(first, ref[:, :104])


def test_bf16_greedy_tokens_are_identical(store_path):
    model = _model("llama", torch.bfloat16)
    ids = _ids(80)
    with tierstore.open(store_path) as store, torch.no_grad():
        pc = PrefixCache(store, model, chunk_tokens=16)
        pc.generate(ids, max_new_tokens=2, do_sample=False)
        assert pc.cached_tokens(ids) == 64
        assert torch.equal(pc.generate(ids, max_new_tokens=32, do_sample=False), _greedy(model, ids))
        assert store.info(pc.hashes(ids[0])[0], namespace="transformers").dtype == "bfloat16"


def test_int8_chunks_stay_within_the_documented_logit_bound(store_path, capsys):
    model = _model("llama")
    ids = _ids(100)
    with tierstore.open(store_path) as store, torch.no_grad():
        pc = PrefixCache(store, model, chunk_tokens=16, codec="int8")
        pc.generate(ids, max_new_tokens=1, do_sample=False)
        assert store.info(pc.hashes(ids[0])[0], namespace="transformers").codec == "int8"
        cache, n = pc.load(ids)
        full = model(ids).logits[:, n:]
        rest = model(ids[:, n:], **{pc.cache_argument: cache}).logits
        diff = (full - rest).abs().max().item()
        scale = full.abs().max().item()
    with capsys.disabled():
        print(f"\nint8 chunks: max |logit difference| {diff:.5f} (max |logit| {scale:.3f})")
    assert diff <= 0.02 * scale  # docs/integrations.md: within 2% of the largest logit


def test_the_last_prompt_token_is_always_computed(store_path):
    model = _model()
    ids = _ids(64)  # exactly four chunks
    with tierstore.open(store_path) as store, torch.no_grad():
        pc = PrefixCache(store, model, chunk_tokens=16)
        cache = transformers.DynamicCache(config=model.config)
        model(ids, **{pc.cache_argument: cache})
        assert pc.save(ids, cache) == 4
        assert pc.save(ids, cache) == 0  # nothing new
        assert pc.cached_tokens(ids) == 48
        _, n = pc.load(ids)
        assert n == 48


def test_another_model_dtype_or_weights_never_loads_these_chunks(store_path):
    ids = _ids(50)
    base = _model()
    with tierstore.open(store_path) as store, torch.no_grad():
        PrefixCache(store, base, chunk_tokens=16).generate(ids, max_new_tokens=1, do_sample=False)
        assert PrefixCache(store, base, chunk_tokens=16).cached_tokens(ids) == 48
        others = [PrefixCache(store, _model(dtype=torch.bfloat16), chunk_tokens=16),
                  PrefixCache(store, _model(rope_theta=5000.0), chunk_tokens=16),
                  PrefixCache(store, _model("qwen2"), chunk_tokens=16),
                  PrefixCache(store, base, chunk_tokens=16, weights_digest="fine-tune-2"),
                  PrefixCache(store, base, chunk_tokens=8)]
        for pc in others:
            assert pc.cached_tokens(ids) == 0
            _, n = pc.load(ids)
            assert n == 0
    # same config and dtype, other weights: another salt (a sample of the weights), unless the caller
    # names the checkpoint itself
    assert model_fingerprint(base) != model_fingerprint(_model(seed=5))
    assert model_fingerprint(base, weights_digest="a") == model_fingerprint(_model(seed=5), weights_digest="a")
    assert model_fingerprint(base, weights_digest="a") != model_fingerprint(base, weights_digest="b")


def test_a_damaged_chunk_ends_the_prefix_there(store_path, caplog):
    model = _model()
    ids = _ids(100)
    with tierstore.open(store_path) as store, torch.no_grad():
        pc = PrefixCache(store, model, chunk_tokens=16)
        pc.generate(ids, max_new_tokens=1, do_sample=False)
        info = store.info(pc.hashes(ids[0])[2], namespace="transformers")
    seg = segment_files(store_path)[0]
    assert info.segment == int(os.path.basename(seg).split(".")[0], 16)
    with open(seg, "r+b") as f:  # flip a byte inside chunk 2's payload
        f.seek(info.offset + info.stored_bytes - 100)
        b = f.read(1)
        f.seek(info.offset + info.stored_bytes - 100)
        f.write(bytes([b[0] ^ 0x40]))
    with tierstore.open(store_path) as store, torch.no_grad():
        pc = PrefixCache(store, model, chunk_tokens=16)
        with caplog.at_level(logging.WARNING, logger="tierstore"):
            cache, n = pc.load(ids)
        assert n == 32 and cache.get_seq_length() == 32  # chunks 0 and 1, then recompute
        assert sum("damaged" in r.message for r in caplog.records) == 1
        assert pc.cached_tokens(ids) == 32  # the damaged chunk was deleted: the answers agree
        with caplog.at_level(logging.WARNING, logger="tierstore"):
            assert torch.equal(pc.generate(ids, max_new_tokens=16, do_sample=False), _greedy(model, ids, 16))
            assert pc.cached_tokens(ids) == 96 and pc.load(ids)[1] == 96  # stored again by that generate
        assert sum("damaged" in r.message for r in caplog.records) == 1  # warned once, not per call


def test_over_a_read_only_store_it_loads_and_generates_and_saves_nothing(store_path, caplog):
    model = _model()
    ids = _ids(40)
    with tierstore.open(store_path) as store, torch.no_grad():
        PrefixCache(store, model, chunk_tokens=16).generate(ids, max_new_tokens=1, do_sample=False)
    with tierstore.open(store_path, readonly=True) as store, torch.no_grad():
        pc = PrefixCache(store, model, chunk_tokens=16)
        assert pc.load(ids)[1] == 32
        longer = _ids(80, seed=5)
        assert torch.equal(pc.generate(longer, max_new_tokens=8, do_sample=False), _greedy(model, longer, 8))
        assert len(store.keys(namespace="transformers")) == 2  # nothing saved
        cache = transformers.DynamicCache(config=model.config)
        model(longer, **{pc.cache_argument: cache})
        with pytest.raises(tierstore.ReadOnlyError):
            pc.save(longer, cache)


def test_over_a_tenants_handle(store_path):
    """store.namespace(...) handles: its own namespace with a session; a shared namespace it may only
    read, with a damaged chunk -- loaded up to it, nothing deleted or saved (AccessDenied before)."""
    model = _model()
    ids = _ids(60)
    with tierstore.open(store_path) as store, torch.no_grad():
        PrefixCache(store, model, chunk_tokens=16, namespace="shared").generate(ids, max_new_tokens=1,
                                                                                  do_sample=False)
        info = store.info(PrefixCache(store, model, chunk_tokens=16).hashes(ids[0])[1], namespace="shared")
        own = PrefixCache(store.namespace("t1"), model, chunk_tokens=16, namespace="t1", session="chat-1")
        own.generate(ids, max_new_tokens=1, do_sample=False)
        assert len(store.session_keys("chat-1", namespace="t1")) == 3
    with open(segment_files(store_path)[0], "r+b") as f:  # damage chunk 1 of the shared namespace
        f.seek(info.offset + info.stored_bytes - 100)
        b = f.read(1)
        f.seek(info.offset + info.stored_bytes - 100)
        f.write(bytes([b[0] ^ 0x40]))
    with tierstore.open(store_path) as store, torch.no_grad():
        reader = PrefixCache(store.namespace("t2", shared=["shared"]), model, chunk_tokens=16, namespace="shared")
        assert reader.load(ids)[1] == 16 and not reader.writable
        assert torch.equal(reader.generate(ids, max_new_tokens=4, do_sample=False), _greedy(model, ids, 4))
        assert store.contains(info.key, namespace="shared")  # not deleted: the handle may only read it
        assert PrefixCache(store.namespace("t3", readonly=True), model, namespace="t3").writable is False


def test_a_session_owns_its_chunks(store_path):
    model = _model()
    with tierstore.open(store_path) as store, torch.no_grad():
        PrefixCache(store, model, chunk_tokens=16, session="conv-1").generate(_ids(40), max_new_tokens=1,
                                                                             do_sample=False)
        shared = _ids(40)  # a second conversation over the same prompt, and one of its own
        PrefixCache(store, model, chunk_tokens=16, session="conv-2").generate(shared, max_new_tokens=1,
                                                                             do_sample=False)
        PrefixCache(store, model, chunk_tokens=16, session="conv-2").generate(_ids(40, seed=9), max_new_tokens=1,
                                                                             do_sample=False)
        assert len(store.keys(namespace="transformers")) == 4
        assert store.drop_session("conv-2", namespace="transformers") == 2  # only conv-2's own chunks
        assert PrefixCache(store, model, chunk_tokens=16).cached_tokens(_ids(40)) == 32  # conv-1's survive


def test_save_takes_a_batch_row_by_row(store_path):
    model = _model()
    ids = torch.cat([_ids(48, seed=3), _ids(48, seed=4)])
    with tierstore.open(store_path) as store, torch.no_grad():
        pc = PrefixCache(store, model, chunk_tokens=16)
        cache = transformers.DynamicCache(config=model.config)
        model(ids, **{pc.cache_argument: cache})
        assert pc.save(ids, cache, attention_mask=torch.ones_like(ids)) == 6
        for row in ids:
            cache1, n = pc.load(row)
            assert n == 32
            ref = transformers.DynamicCache(config=model.config)
            model(row[None, :32], **{pc.cache_argument: ref})
            assert torch.allclose(cache1.layers[1].values, ref.layers[1].values, atol=1e-6)
        with pytest.raises(InvalidObject, match="one row"):
            pc.load(ids)


def test_refuses_sliding_window_models_and_bad_arguments(store_path):
    with tierstore.open(store_path) as store:
        sliding = transformers.MistralForCausalLM(transformers.MistralConfig(
            num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=VOCAB, sliding_window=32))
        with pytest.raises(InvalidObject, match="sliding_attention"):
            PrefixCache(store, sliding)
        pc = PrefixCache(store, _model(), chunk_tokens=16)
        with pytest.raises(InvalidObject, match="chunk_tokens"):
            PrefixCache(store, _model(), chunk_tokens=0)
        with pytest.raises(InvalidObject, match="int9"):  # refused before any generation, not after it
            PrefixCache(store, _model(), codec="int9")
        with pytest.raises(InvalidObject, match="session"):
            PrefixCache(store, _model(), session="a/b")
        with pytest.raises(InvalidObject, match="namespace"):
            PrefixCache(store, _model(), session="ok", namespace="")
        for bad in ("", "a/b", "x" * 300):  # without a session too (a new user found them refused only at generate)
            with pytest.raises(InvalidObject, match="namespace"):
                PrefixCache(store, _model(), namespace=bad)
        with pytest.raises(InvalidObject, match="integer token ids"):
            pc.load(torch.rand(1, 20))
        with pytest.raises(InvalidObject, match="DynamicCache"):
            pc.save(_ids(20), object())
        model = _model()
        static = transformers.StaticCache(config=model.config, max_cache_len=64)
        with torch.no_grad():
            model(_ids(40), use_cache=True, **{pc.cache_argument: static})  # (the release's name for it)
        with pytest.raises(InvalidObject, match="StaticLayer"):  # (its layers are not DynamicLayers)
            pc.save(_ids(40), static)
        assert store.keys(namespace=pc.namespace) == []
        with pytest.raises(InvalidObject, match="makes the cache itself"):
            pc.generate(_ids(20), past_key_values=transformers.DynamicCache())


def test_importing_tierstore_does_not_import_transformers():
    code = "import sys, tierstore; print('transformers' in sys.modules, 'tierstore.integrations' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_fingerprint_matches_the_worked_example_of_the_spec():
    class Config:
        def to_dict(self):
            return {"hidden_size": 64, "num_hidden_layers": 2, "_name_or_path": "ignored", "use_cache": True}

    LlamaForCausalLM = type("LlamaForCausalLM", (), {"config": Config(), "dtype": torch.float32})
    assert model_fingerprint(LlamaForCausalLM(), weights_digest="rev-1").hex() == \
        "e65d6d304c8ea1eac1091ecc52b769eb"  # SPEC.md §13.1

    class Weights(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
            self.b = torch.nn.Parameter(torch.arange(100, dtype=torch.float16))

    assert weights_sample_digest(Weights()) == \
        "sample:dccf70010e9b6811e841974b979859ae5a7d2855fe60081b0aa24affa3c9731d"  # SPEC.md §13.1


def test_another_checkpoint_of_the_same_configuration_misses(store_path):
    """Two checkpoints of one architecture (a base model and its instruction-tuned version) have
    the same configuration; the fingerprint covered the configuration only, so the second loaded
    the first's KV and generated other tokens than it does alone (a new user's review,
    2026-12-03).  A sample of the weights is now part of it; a given weights_digest= replaces
    the sample, and the same checkpoint loaded again still hits."""
    first, second = _model("llama"), _model("llama")
    with torch.no_grad():
        for p in second.parameters():
            p.add_(0.01)
    ids = _ids(40)
    with tierstore.open(store_path) as store, torch.no_grad():
        PrefixCache(store, first, chunk_tokens=16).generate(ids, max_new_tokens=1, do_sample=False)
        assert PrefixCache(store, second, chunk_tokens=16).cached_tokens(ids) == 0
        assert PrefixCache(store, first, chunk_tokens=16).cached_tokens(ids) == 32
        again = copy.deepcopy(first)  # the same weights, another object: hits
        assert PrefixCache(store, again, chunk_tokens=16).cached_tokens(ids) == 32
        assert PrefixCache(store, second, chunk_tokens=16, weights_digest="base").cached_tokens(ids) == 0


def test_save_of_a_padded_batch_stores_only_what_each_row_computed_unpadded(store_path):
    """save() of a padded batch stored the KV of padding (and of tokens after it) under the
    row's token ids: a later prompt of those tokens loaded KV that is not its own (a new user's
    review, 2026-12-03).  A batch now takes the attention_mask it ran with: a right-padded row
    gives only its chunks before the padding, a left-padded row none; without a mask a batch is
    refused.  Twin: the unpadded row's chunks load and generate as the model does alone."""
    model = _model("llama")
    long, short = _ids(40), _ids(20, seed=2)
    pad = torch.zeros(1, 20, dtype=long.dtype)
    with tierstore.open(store_path) as store, torch.no_grad():
        pc = PrefixCache(store, model, chunk_tokens=16)
        right = torch.cat([long, torch.cat([short, pad], dim=1)])
        mask = torch.cat([torch.ones(1, 40), torch.cat([torch.ones(1, 20), torch.zeros(1, 20)], dim=1)]).long()
        out = model(right, attention_mask=mask, use_cache=True)
        with pytest.raises(tierstore.InvalidObject, match="attention_mask"):
            pc.save(right, out.past_key_values)
        assert pc.save(right, out.past_key_values, attention_mask=mask) == 3  # 2 of the long row, 1 of the short
        padded_row = torch.cat([short, pad], dim=1)[:, :33]
        assert pc.cached_tokens(padded_row) == 16  # never the chunk holding padding
        left = torch.cat([long, torch.cat([pad, short], dim=1)])
        lmask = torch.cat([torch.ones(1, 40), torch.cat([torch.zeros(1, 20), torch.ones(1, 20)], dim=1)]).long()
        out = model(left, attention_mask=lmask, use_cache=True)
        assert pc.save(left, out.past_key_values, attention_mask=lmask) == 0  # (the long row's are stored)
        assert pc.cached_tokens(torch.cat([pad, short], dim=1)) == 0
        plain = model.generate(short, max_new_tokens=4, do_sample=False, attention_mask=torch.ones_like(short))
        assert torch.equal(pc.generate(short, max_new_tokens=4, do_sample=False), plain)


# -- a new user's review (2026-12-03) ---------------------------------------------------------------

def test_beam_search_saves_nothing_and_the_next_prompt_stays_exact(store_path, caplog):
    """Under beam search the cache's rows are beams in beam order, not the returned sequence:
    saving row 0 stored another beam's KV under the sequence's keys.  Nothing is saved now (one
    warning); the prefix of a greedy run before it still loads, and a later prompt is exact."""
    model = _model("llama")
    ids = _ids(40)
    with tierstore.open(store_path) as store, torch.no_grad():
        pc = PrefixCache(store, model, chunk_tokens=16)
        pc.generate(ids, max_new_tokens=1, do_sample=False)  # stores 2 chunks of the prompt
        before = store.stats()["objects_indexed"]
        with caplog.at_level(logging.WARNING, logger="tierstore"):
            out = pc.generate(ids, max_new_tokens=40, num_beams=4, do_sample=False)
        assert store.stats()["objects_indexed"] == before
        assert any("beam search" in m for m in caplog.messages)
        assert torch.equal(out, model.generate(ids, max_new_tokens=40, num_beams=4, do_sample=False,
                                               attention_mask=torch.ones_like(ids)))
        follow = out[:, :-1]
        assert torch.equal(pc.generate(follow, max_new_tokens=8, do_sample=False), _greedy(model, follow, 8))


def test_a_padded_row_is_refused_before_anything_runs(store_path):
    model = _model("llama")
    ids = _ids(40)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    with tierstore.open(store_path) as store, torch.no_grad():
        pc = PrefixCache(store, model, chunk_tokens=16)
        with pytest.raises(InvalidObject, match="padding"):
            pc.generate(ids, attention_mask=mask, max_new_tokens=2)
        assert store.stats()["objects_indexed"] == 0
        pc.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False)  # the valid twin
        assert store.stats()["objects_indexed"] == 2


def test_a_model_whose_k_and_v_differ_in_head_size_is_refused_at_construction(store_path):
    cfg = transformers.DeepseekV3Config(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                        moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=4,
                                        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                        first_k_dense_replace=2, kv_lora_rank=16, q_lora_rank=16,
                                        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, vocab_size=VOCAB)
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with tierstore.open(store_path) as store, pytest.raises(InvalidObject, match="head size"):
        PrefixCache(store, model, chunk_tokens=16)


def test_generate_under_cpu_autocast_saves_and_reloads_exactly(store_path):
    """Under CPU autocast K leaves RoPE in float32 and V in bfloat16: V is widened (lossless) and
    the chunk stored; a generation under autocast from the loaded prefix gives the same tokens."""
    model = _model("llama")
    ids = _ids(40)
    with tierstore.open(store_path) as store, torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        pc = PrefixCache(store, model, chunk_tokens=16)
        first = pc.generate(ids, max_new_tokens=8, do_sample=False)
        assert store.stats()["objects_indexed"] == 2  # 47 tokens in the cache: 2 full chunks
        assert store.info(pc.hashes(ids[0])[0], namespace="transformers").dtype == "float32"
        assert torch.equal(pc.generate(ids, max_new_tokens=8, do_sample=False), first)


def test_a_prefix_two_sessions_share_outlives_dropping_either(store_path):
    model = _model("llama")
    system = _ids(32, seed=7)
    a = torch.cat([system, _ids(40, seed=8)], dim=1)
    b = torch.cat([system, _ids(40, seed=9)], dim=1)
    with tierstore.open(store_path) as store, torch.no_grad():
        pa = PrefixCache(store, model, chunk_tokens=16, session="conv-a")
        pb = PrefixCache(store, model, chunk_tokens=16, session="conv-b")
        pa.generate(a, max_new_tokens=1, do_sample=False)
        assert pb.cached_tokens(b) == 32
        pb.generate(b, max_new_tokens=1, do_sample=False)
        store.drop_session("conv-a", namespace="transformers")
        assert pb.cached_tokens(b) == 64  # the shared 32 and b's own 32
        store.drop_session("conv-b", namespace="transformers")
        assert pb.cached_tokens(b) == 0


def test_lossy_chunks_are_never_loaded_by_a_cache_without_the_codec(store_path):
    model = _model("llama")
    ids = _ids(40)
    with tierstore.open(store_path) as store, torch.no_grad():
        lossy = PrefixCache(store, model, chunk_tokens=16, codec="int8")
        lossy.generate(ids, max_new_tokens=1, do_sample=False)
        assert lossy.cached_tokens(ids) == 32
        assert PrefixCache(store, model, chunk_tokens=16).cached_tokens(ids) == 0  # lossless: its own keys
        assert PrefixCache(store, model, chunk_tokens=16, codec="zstd").salt == \
            PrefixCache(store, model, chunk_tokens=16).salt  # a lossless codec shares them


def test_chunks_a_lossy_store_default_wrote_are_not_loaded_as_lossless(tmp_path, caplog):
    model = _model("llama")
    ids = _ids(40)
    path = str(tmp_path / "s")
    with tierstore.open(path, codecs={("kv", "ssd"): "int8"}) as store, torch.no_grad():
        pc = PrefixCache(store, model, chunk_tokens=16)  # lossless asked for; the store's default is int8
        pc.generate(ids, max_new_tokens=1, do_sample=False)
        assert store.info(pc.hashes(ids[0])[0], namespace="transformers").codec == "int8"
        with caplog.at_level(logging.WARNING, logger="tierstore"):
            cache, n = pc.load(ids)
        assert n == 0 and any("lossy" in m for m in caplog.messages)
        lossy = PrefixCache(store, model, chunk_tokens=16, codec="int8")
        lossy.generate(ids, max_new_tokens=1, do_sample=False)
        assert lossy.load(ids)[1] == 32  # the twin: asked for int8, it loads int8


def test_a_prefix_ends_at_its_first_lossy_chunk_when_lossless_kv_is_asked_for(tmp_path):
    model = _model("llama")
    ids = _ids(70)
    path = str(tmp_path / "s")
    with tierstore.open(path) as store, torch.no_grad():  # lossless: the first two chunks
        PrefixCache(store, model, chunk_tokens=16).generate(ids[:, :33], max_new_tokens=1, do_sample=False)
    with tierstore.open(path, codecs={("kv", "ssd"): "int8"}) as store, torch.no_grad():  # int8 from here on
        pc = PrefixCache(store, model, chunk_tokens=16)
        pc.generate(ids, max_new_tokens=1, do_sample=False)
        assert pc.cached_tokens(ids) == 64
        cache, n = pc.load(ids)
        assert n == 32 and cache.get_seq_length() == 32  # the raw chunks only


def test_a_batch_whose_rows_share_chunks_references_them_once_per_session(tmp_path):
    """With a remote tier a put of stored bytes is a new version (written and sent in full): a
    second row of a batch that shares the first row's chunks must not put them again."""
    from tierstore.bench.servers import RedisServer

    model = _model("llama")
    row = _ids(64)
    server = RedisServer(tmp_path).start()
    try:
        with tierstore.open(str(tmp_path / "s"), remote=server.url) as store, torch.no_grad():
            pc = PrefixCache(store, model, chunk_tokens=16, session="conv")
            batch = torch.cat([row, row])
            out = model(batch, use_cache=True)
            assert pc.save(batch, out.past_key_values, attention_mask=torch.ones_like(batch)) == 4
            assert store.stats()["tiers"]["remote"]["puts"] == 4  # each chunk once, not once per row
            assert len(store.session_keys("conv", namespace="transformers")) == 4
    finally:
        server.stop()


def test_a_chunk_gone_between_the_match_and_the_load_ends_the_prefix_there(store_path, monkeypatch, caplog):
    model = _model("llama")
    ids = _ids(70)
    with tierstore.open(store_path) as store, torch.no_grad():
        pc = PrefixCache(store, model, chunk_tokens=16)
        pc.generate(ids, max_new_tokens=1, do_sample=False)
        assert pc.cached_tokens(ids) == 64
        monkeypatch.setattr(store, "match_prefix", lambda hashes, **kw: 4)  # matched before chunk 2 went
        store.delete(pc.hashes(ids[0])[2], namespace="transformers")
        with caplog.at_level(logging.WARNING, logger="tierstore"):
            cache, n = pc.load(ids)
        assert n == 32 and cache.get_seq_length() == 32
        assert any("chunk 2" in m for m in caplog.messages)


def test_the_lossy_scan_ends_the_prefix_where_it_cannot_look(tmp_path, monkeypatch):
    """A store whose default KV codec is int8 (every chunk lossy) and a lossless PrefixCache: a
    chunk that cannot be described during the scan (gone and stored again meanwhile) ends the
    prefix there -- the chunks after it were loaded unchecked, int8 into a lossless cache."""
    model = _model("llama")
    ids = _ids(70)
    with tierstore.open(str(tmp_path / "s"), codecs={("kv", "ssd"): "int8"}) as store, torch.no_grad():
        pc = PrefixCache(store, model, chunk_tokens=16)
        pc.generate(ids, max_new_tokens=1, do_sample=False)
        first = pc.hashes(ids[0])[0]
        real_info, failed = store.info, []

        def info_once_gone(key, **kw):
            if key == first and not failed:
                failed.append(key)
                raise tierstore.NotFound("gone meanwhile", key=key)
            return real_info(key, **kw)

        monkeypatch.setattr(store, "info", info_once_gone)
        assert pc.load(ids)[1] == 0


def _flip_chunk_byte(store_path, key: bytes) -> None:
    """Flip one byte near the end of a stored chunk's payload (its last layer)."""
    with tierstore.open(store_path, readonly=True) as store:
        info = store.info(key, namespace="transformers")
    seg = [s for s in segment_files(store_path) if int(os.path.basename(s).split(".")[0], 16) == info.segment][0]
    with open(seg, "r+b") as f:
        f.seek(info.offset + info.stored_bytes - 100)
        b = f.read(1)
        f.seek(info.offset + info.stored_bytes - 100)
        f.write(bytes([b[0] ^ 0x40]))


def test_a_background_load_gives_what_a_whole_load_gives(store_path):
    model = _model("llama")
    ids = _ids(100)
    with tierstore.open(store_path) as store, torch.no_grad():
        pc = PrefixCache(store, model, chunk_tokens=16)
        pc.generate(ids, max_new_tokens=1, do_sample=False)
        whole, n = pc.load(ids)
        behind, m = pc.load(ids, background=True)
        assert n == m == 96 and behind.get_seq_length() == 96  # the length before any layer is waited for
        rest = model(ids[:, n:], **{pc.cache_argument: behind}).logits
        assert torch.equal(rest, model(ids[:, n:], **{pc.cache_argument: whole}).logits)
        assert (model(ids).logits[:, n:] - rest).abs().max().item() <= 1e-4
        fresh, _ = pc.load(ids, background=True)
        again, _ = pc.load(ids)
        for a, b in zip(fresh.layers, again.layers):  # read directly, before any forward: waits, never half
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        empty, none = pc.load(_ids(100, seed=9), background=True)  # nothing stored: a plain empty cache
        assert none == 0 and empty.get_seq_length() == 0


def test_a_chunk_found_damaged_by_a_background_load_raises_on_use_and_generate_recomputes(store_path, caplog):
    model = _model("llama")
    ids = _ids(100)
    with tierstore.open(store_path) as store, torch.no_grad():
        pc = PrefixCache(store, model, chunk_tokens=16)
        pc.generate(ids, max_new_tokens=1, do_sample=False)
        bad = pc.hashes(ids[0])[2]
    _flip_chunk_byte(store_path, bad)
    with tierstore.open(store_path) as store, torch.no_grad():
        pc = PrefixCache(store, model, chunk_tokens=16)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tierstore"):
            cache, n = pc.load(ids, background=True)
            assert n == 96  # the index's answer: the damage is found while reading the last layer
            with pytest.raises(tierstore.CorruptionError) as e:
                model(ids[:, n:], **{pc.cache_argument: cache})
        assert e.value.key == bad
        # a direct load recomputes nothing: its warning says where the read stopped
        (warned,) = [r.message for r in caplog.records if "damaged" in r.message]
        assert "the background load stops at token 32" in warned and "recomputing" not in warned
        with pytest.raises(tierstore.CorruptionError) as again:  # each use its own error, caused by the read's
            _ = cache.layers[-1].keys
        assert again.value is not e.value and again.value.key == bad
        assert again.value.__cause__ is e.value.__cause__ is not None
        assert pc.cached_tokens(ids) == 32  # deleted: the next load is the shorter prefix
        assert pc.load(ids)[1] == 32
        pc.generate(ids, max_new_tokens=1, do_sample=False)  # stored again
        assert pc.cached_tokens(ids) == 96
    _flip_chunk_byte(store_path, bad)
    with tierstore.open(store_path) as store, torch.no_grad():
        pc = PrefixCache(store, model, chunk_tokens=16, overlap_load=True)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tierstore"):
            assert torch.equal(pc.generate(ids, max_new_tokens=16, do_sample=False), _greedy(model, ids, 16))
        assert sum("damaged" in r.message for r in caplog.records) == 1
        assert pc.cached_tokens(ids) == 96  # stored again by that generate


def test_a_chunk_deleted_between_two_layers_of_a_background_load_is_not_found_not_replaced(store_path, monkeypatch,
                                                                                         caplog):
    """A delete landing just after a layer's read (a new user's script): the layer's check saw the
    chunk gone and called it "replaced" (a plain TierstoreError); it is NotFound, and the warning
    says where the read stopped."""
    model = _model("llama")
    ids = _ids(70)
    with tierstore.open(store_path) as store, torch.no_grad():
        pc = PrefixCache(store, model, chunk_tokens=16)
        pc.generate(ids, max_new_tokens=1, do_sample=False)
        victim = pc.hashes(ids[0])[2]
        real = store.get_many

        def deleting_after_layer_0(keys, **kw):
            out = real(keys, **kw)
            if kw.get("layers") == [0]:
                store.delete(victim, namespace="transformers")
            return out

        monkeypatch.setattr(store, "get_many", deleting_after_layer_0)
        with caplog.at_level(logging.WARNING, logger="tierstore"):
            cache, n = pc.load(ids, background=True)
            with pytest.raises(tierstore.NotFound) as e:
                model(ids[:, n:], **{pc.cache_argument: cache})
        assert e.value.key == victim
        assert any("chunk 2" in m and "is gone" in m and "stops at token 32" in m for m in caplog.messages)


def test_a_chunk_deleted_during_a_background_load_is_recomputed_by_generate(store_path, monkeypatch, caplog):
    model = _model("llama")
    ids = _ids(70)
    with tierstore.open(store_path) as store, torch.no_grad():
        pc = PrefixCache(store, model, chunk_tokens=16)
        pc.generate(ids, max_new_tokens=1, do_sample=False)
        pc = PrefixCache(store, model, chunk_tokens=16, overlap_load=True)
        real, gone, asked = store.get_many, [], []

        def deleting_one_first(keys, **kw):  # another process deletes chunk 2 after the match
            asked.append(kw.get("layers"))
            if not gone and len(keys) == 4:
                gone.append(store.delete(keys[2], namespace="transformers"))
            return real(keys, **kw)

        monkeypatch.setattr(store, "get_many", deleting_one_first)
        with caplog.at_level(logging.WARNING, logger="tierstore"):
            assert torch.equal(pc.generate(ids, max_new_tokens=8, do_sample=False), _greedy(model, ids, 8))
        assert gone == [True] and any("chunk 2" in m and "gone" in m for m in caplog.messages)
        assert asked[0] == [0] and asked[1] is None  # layer 0 in the background, then the whole shorter prefix
        assert pc.cached_tokens(ids) == 64  # stored again


def test_generate_overlaps_the_load_only_when_asked(store_path, monkeypatch):
    model = _model("llama")
    ids = _ids(70)
    with tierstore.open(store_path) as store, torch.no_grad():
        PrefixCache(store, model, chunk_tokens=16).generate(ids, max_new_tokens=1, do_sample=False)
        real, asked = store.get_many, []
        monkeypatch.setattr(store, "get_many", lambda keys, **kw: asked.append(kw.get("layers")) or real(keys, **kw))
        for overlap, first in (({}, None), ({"overlap_load": False}, None), ({"overlap_load": True}, [0])):
            asked.clear()
            pc = PrefixCache(store, model, chunk_tokens=16, **overlap)
            assert torch.equal(pc.generate(ids, max_new_tokens=4, do_sample=False), _greedy(model, ids, 4))
            assert asked[0] == first
        with pytest.raises(InvalidObject, match="overlap_load"):
            PrefixCache(store, model, overlap_load=None)


def test_a_chunk_replaced_by_a_lossy_version_during_a_background_load_is_never_used(store_path, monkeypatch):
    """Each layer of a background load is read in a snapshot of its own: a chunk replaced by an
    int8 version between two layers gave layer 0 lossless KV and the rest lossy, unwarned (a
    review, 2026-12-03).  The read checks that every chunk is still the version found
    lossless after each layer; a replaced one stops it (and generate loads again)."""
    model = _model("llama")
    ids = _ids(70)
    with tierstore.open(store_path) as store, torch.no_grad():
        PrefixCache(store, model, chunk_tokens=16).generate(ids, max_new_tokens=1, do_sample=False)
        pc = PrefixCache(store, model, chunk_tokens=16, overlap_load=True)
        h = pc.hashes(ids[0])[1]
        lossless = store.get(h, namespace="transformers")
        real, done = store.get_many, []

        def replacing_between_layers(keys, **kw):
            if kw.get("layers") == [1] and not done:
                done.append(store.put(h, lossless, namespace="transformers", codec="int8"))
            return real(keys, **kw)

        monkeypatch.setattr(store, "get_many", replacing_between_layers)
        cache, n = pc.load(ids, background=True)
        assert n == 64
        with pytest.raises(tierstore.TierstoreError, match="replaced"):
            model(ids[:, n:], **{pc.cache_argument: cache})
        done.clear()
        store.put(h, lossless, namespace="transformers")  # lossless again; replaced once more mid-load
        assert torch.equal(pc.generate(ids, max_new_tokens=4, do_sample=False), _greedy(model, ids, 4))
        monkeypatch.setattr(store, "get_many", real)
        assert pc.load(ids)[1] == 16  # chunk 1 is int8 now: a lossless prefix ends before it


def test_a_background_loaded_cache_copies_resets_and_fills_inference_mode_tensors_normally(store_path):
    model = _model("llama")
    ids = _ids(70)
    with tierstore.open(store_path) as store, torch.inference_mode():
        pc = PrefixCache(store, model, chunk_tokens=16)
        pc.generate(ids, max_new_tokens=1, do_sample=False)
        whole, n = pc.load(ids)
        assert not whole.layers[0].keys.is_inference()  # (the store's reader threads may fill it)
        behind, _ = pc.load(ids, background=True)
        twin = copy.deepcopy(behind)  # transformers' prefix reuse idiom: a plain copy, no thread or lock
        assert all(type(layer).__name__ == "DynamicLayer" for layer in twin.layers)
        for a, b in zip(twin.layers, whole.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        rest = model(ids[:, n:], **{pc.cache_argument: twin}).logits
        assert torch.equal(rest, model(ids[:, n:], **{pc.cache_argument: whole}).logits)
        again, _ = pc.load(ids, background=True)
        again.reset()
        assert again.get_seq_length() == 0  # (it said 64 until a layer was used)


def test_generate_under_assisted_decoding_loads_and_saves_nothing(store_path, caplog):
    """transformers' assisted decoding over a cache that holds a prefix leaves KV a full prefill
    does not give (chunks differing by 0.75, a review 2026-12-03): saved, it would poison every
    later load."""
    model = _model("llama")
    ids = _ids(100)
    with tierstore.open(store_path) as store, torch.no_grad():
        pc = PrefixCache(store, model, chunk_tokens=16)
        with caplog.at_level(logging.WARNING, logger="tierstore"):
            out = pc.generate(ids, max_new_tokens=8, do_sample=False, prompt_lookup_num_tokens=3)
        assert torch.equal(out, model.generate(ids, max_new_tokens=8, do_sample=False, prompt_lookup_num_tokens=3,
                                               attention_mask=torch.ones_like(ids)))
        assert store.keys(namespace="transformers") == [] and any("assisted" in m for m in caplog.messages)


def test_a_compaction_during_a_load_is_not_taken_for_a_replaced_chunk(store_path, monkeypatch, caplog):
    """The load's check that no chunk was replaced while it read compared LSNs, and a
    compaction copies a record forward under a new LSN: a load racing one was cut short (a
    review, 2026-12-03).  It compares the chunks' content (their extents' checksums) now."""
    model = _model("llama")
    ids = _ids(70)
    with tierstore.open(store_path, segment_bytes="1MiB") as store, torch.no_grad():
        pc = PrefixCache(store, model, chunk_tokens=16)
        pc.generate(ids, max_new_tokens=1, do_sample=False)
        for i in range(20):  # dead records beside the chunks: compaction copies the chunks forward
            store.put(f"f{i}", tierstore.Blob(bytes(50_000)), namespace="other")
            store.delete(f"f{i}", namespace="other")
        first = pc.hashes(ids[0])[0]
        before = store.info(first, namespace="transformers").lsn
        real, compacted = store.get_many, []

        def compacting_first(keys, **kw):
            if not compacted:
                compacted.append(store.compact(min_dead_ratio=0.0))
            return real(keys, **kw)

        monkeypatch.setattr(store, "get_many", compacting_first)
        with caplog.at_level(logging.WARNING, logger="tierstore"):
            cache, n = pc.load(ids)
            assert n == 64
            behind, m = pc.load(ids, background=True)
            rest = model(ids[:, m:], **{pc.cache_argument: behind}).logits
        assert store.info(first, namespace="transformers").lsn != before  # (copied forward)
        assert torch.equal(rest, model(ids[:, n:], **{pc.cache_argument: cache}).logits)
        assert not any("replaced" in m for m in caplog.messages)
