"""GPU check (run it where a CUDA device exists; it is not part of CI, which has none).

    python scripts/gpu_check.py [--device cuda:0] [--json]
    .venv-vllm/bin/python scripts/gpu_check.py --vllm [--json]   # the vLLM connector (vllm installed)

Checks what cannot be checked on a CPU-only machine:
1. lossy objects read with get(device=...) dequantise on the GPU bit for bit as the CPU
   decoder does (SPEC.md §6.1 fixes the binary32 arithmetic; every codec, bfloat16 and float16);
2. raw objects come back on the device with the stored bytes;
3. the time of a 32 MiB KV chunk get to the device, raw and int8, against a plain
   torch.from_numpy(...).to(device) of the same bytes (same process);
4. the CUDA GPU tier: the I/O path the probe chose (gds / kvikio-compat / posix), pinned
   DRAM buffers, SSD->GPU and DRAM->GPU promotion with device-side decoding (bit-exact
   against the CPU decoder), a GPU hit's latency against a device copy, stream_layers to
   the device in order, and eviction from the GPU tier falling back to DRAM;
5. transformers' PrefixCache on the device (if transformers is installed): a prefix loaded
   with load(background=True) gives the logits of one loaded whole, and the time to first
   token of a 4,096-token prompt (3,840 stored) loaded whole vs layer by layer behind the
   forward pass (the overlap that docs/benchmarks.md measured as no gain on a 2-core CPU).
Exits 1 on any mismatch.  Runs in well under a minute.

``--vllm`` checks the vLLM connector instead (tierstore.integrations.vllm): ``vllm.LLM`` with
``load_format="dummy"`` from a local Llama-3-8B-shaped config (no download, no tokenizer), the
same 16,384-token prompt in two processes one after the other (a restart): the first computes
and stores the prompt's chunks, the second loads them (counted by the worker's connector) and
must give the same output tokens.  Prints both runs' time to first token and the store's load path.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tierstore  # noqa: E402
from tierstore import KVCache, TierstoreError, Vectors, codecs  # noqa: E402


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--vllm", action="store_true", help="check the vLLM connector (needs vllm installed)")
    ap.add_argument("--vllm-run", help=argparse.SUPPRESS)  # one engine run: STORE_DIR (a child process)
    ap.add_argument("--tokens", type=int, default=16384, help="prompt length for --vllm")
    ap.add_argument("--graphs", action="store_true", help=argparse.SUPPRESS)  # a --vllm-run with CUDA graphs
    args = ap.parse_args(argv)
    if args.vllm_run:
        return vllm_run(args.vllm_run, args.tokens, eager=not args.graphs)
    if args.vllm:
        return check_vllm(args)
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 2
    dev = args.device
    out: dict = {"device": torch.cuda.get_device_name(torch.device(dev)), "torch": torch.__version__, "checks": []}
    ok = True
    rng = np.random.default_rng(0)
    kv = rng.standard_normal((4, 2, 8, 256, 128)).astype(np.float32)
    emb = rng.standard_normal((500, 384)).astype(np.float32)
    with tempfile.TemporaryDirectory() as d, tierstore.open(d, durability="none") as s:
        for c in codecs.available():
            for kind in c["kinds"]:
                if kind == "blob" or c["lossless"]:
                    continue
                for dtype in (torch.float16, torch.bfloat16):
                    key = f"{kind}-{c['name']}-{dtype}"
                    if kind == "kv":
                        s.put(key, KVCache(torch.from_numpy(kv).to(dtype)), codec=c["name"])
                    else:
                        s.put(key, Vectors(torch.from_numpy(emb).to(dtype)), codec=c["name"])
                    cpu = s.get(key).data  # the numpy decoder (torch-stored: wrapped as a CPU tensor)
                    gpu = s.get(key, device=dev).data
                    same = gpu.device.type == "cuda" and torch.equal(gpu.cpu().view(torch.int16), cpu.view(torch.int16))
                    out["checks"].append({"object": key, "bit_exact_on_device": same})
                    ok &= same
        raw = torch.from_numpy(kv[:, :, :8].astype(np.float16))
        s.put("raw", KVCache(raw))
        got = s.get("raw", device=dev).data
        same = torch.equal(got.cpu(), raw)
        out["checks"].append({"object": "raw fp16 chunk", "bytes_equal_on_device": same})
        ok &= same
        chunk = rng.standard_normal((32, 2, 8, 256, 128)).astype(np.float16)  # Llama-3-8B, 256 tokens: 32 MiB
        s.put("c-raw", KVCache(chunk))
        s.put("c-int8", KVCache(chunk), codec="int8")
        s.flush()
        times: dict = {"baseline_from_numpy_to_device": [], "raw": [], "int8": []}
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            torch.from_numpy(chunk).to(dev)
            torch.cuda.synchronize()
            times["baseline_from_numpy_to_device"].append(time.perf_counter() - t0)
            for key, name in (("c-raw", "raw"), ("c-int8", "int8")):
                t0 = time.perf_counter()
                s.get(key, device=dev)
                torch.cuda.synchronize()
                times[name].append(time.perf_counter() - t0)
        out["chunk_get_to_device_ms"] = {k: round(float(np.median(v)) * 1000, 2) for k, v in times.items()}
    ok &= check_gpu_tier(dev, out, rng)
    ok &= check_prefix_cache(dev, out)
    out["ok"] = bool(ok)
    print(json.dumps(out, indent=2) if args.json else out)
    return 0 if ok else 1


def check_gpu_tier(dev: str, out: dict, rng: np.random.Generator) -> bool:
    import torch

    ok = True
    chunk = rng.standard_normal((32, 2, 8, 256, 128)).astype(np.float16)
    res: dict = {}
    with tempfile.TemporaryDirectory() as d, tierstore.open(d, durability="none", dram_bytes="256MiB",
                                                            gpu_bytes="80MiB", gpu_device=dev) as s:
        s.put("raw", KVCache(chunk))
        s.put("int8", KVCache(chunk), codec="int8")
        s.put("kvq", KVCache(chunk), codec="kvq-ans")
        s.flush()
        res["io_path"] = s.stats()["tiers"]["gpu"]["io_path"]
        reference = {k: torch.from_numpy(np.asarray(s.get(k).data)) for k in ("raw", "int8", "kvq")}
        s.prefetch("raw", tier="dram").result()
        res["dram_buffers_pinned"] = all(
            torch.from_numpy(b).is_pinned() for b in s._tiers.dram.entries[(b"default", b"raw")].extents.values())
        ok &= res["dram_buffers_pinned"]
        for key in ("raw", "int8", "kvq"):  # raw: DRAM -> GPU; int8/kvq: SSD -> GPU, decoded on the device
            t0 = time.perf_counter()
            s.prefetch(key, tier="gpu").result()
            res[f"promote_{key}_ms"] = round((time.perf_counter() - t0) * 1000, 2)
            got = s.get(key, device=dev).data
            same = got.device.type == "cuda" and torch.equal(got.cpu().view(torch.int16),
                                                            reference[key].view(torch.int16))
            res[f"gpu_hit_bit_exact_{key}"] = same
            ok &= same
        hit, copy = [], []
        src = torch.from_numpy(chunk).to(dev)
        for _ in range(20):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            s.get("raw", device=dev)
            torch.cuda.synchronize()
            hit.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            src.clone()
            torch.cuda.synchronize()
            copy.append(time.perf_counter() - t0)
        res["gpu_hit_ms"], res["device_clone_ms"] = (round(float(np.median(hit)) * 1000, 3),
                                                     round(float(np.median(copy)) * 1000, 3))
        order = [lid for lid, t in s.stream_layers("int8", device=dev) if t.device.type == "cuda"]
        res["stream_layers_in_order"] = order == list(range(32))
        ok &= res["stream_layers_in_order"]
        s.get("kvq", device=dev)  # 80 MiB holds two decoded chunks: "raw" is the LRU victim
        gpu = s.stats()["tiers"]["gpu"]
        res["gpu_tier"] = {k: gpu[k] for k in ("bytes_used", "capacity_bytes", "hits", "misses", "evictions",
                                                "promotion_p50_ms", "promotion_p99_ms", "io_path")}
        res["raw_fell_back_to_dram"] = s.info("raw").tiers == ("dram", "ssd")
        ok &= gpu["bytes_used"] <= gpu["capacity_bytes"]
    out["gpu_tier"] = res
    return ok


def check_prefix_cache(dev: str, out: dict) -> bool:
    import torch

    try:
        import transformers

        from tierstore.integrations.transformers import PrefixCache
    except ImportError as e:
        out["prefix_cache"] = {"skipped": f"transformers not installed ({e})"}
        return True
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=12, hidden_size=768, intermediate_size=2048,
                                   num_attention_heads=12, num_key_value_heads=4, vocab_size=32000,
                                   max_position_embeddings=4160)
    model = transformers.LlamaForCausalLM(cfg).to(dev).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 4096), generator=torch.Generator().manual_seed(1)).to(dev)
    res: dict = {}
    sync = torch.cuda.synchronize if dev.startswith("cuda") else (lambda: None)  # (also runs on "cpu")
    with tempfile.TemporaryDirectory() as d, tierstore.open(d) as s, torch.no_grad():
        pc = PrefixCache(s, model, chunk_tokens=256)
        kw = pc.cache_argument
        cache = transformers.DynamicCache(config=model.config)
        model(ids[:, :3840], **{kw: cache})
        pc.save(ids[:, :3840], cache)
        s.flush()
        whole, n = pc.load(ids)
        behind, m = pc.load(ids, background=True)
        a = model(ids[:, n:], **{kw: whole}).logits
        b = model(ids[:, m:], **{kw: behind}).logits
        res["background_equals_whole"] = n == m == 3840 and torch.equal(a, b)
        times: dict = {"whole": [], "background": [], "recompute": []}
        for _ in range(5):
            for mode in times:
                s.drop_cached()
                sync()
                t0 = time.perf_counter()
                if mode == "recompute":
                    model(ids, logits_to_keep=1)
                else:
                    c, k = pc.load(ids, background=mode == "background")
                    model(ids[:, k:], logits_to_keep=1, **{kw: c})
                sync()
                times[mode].append(time.perf_counter() - t0)
        res["ttft_ms"] = {k: round(float(np.median(v)) * 1000, 2) for k, v in times.items()}
    out["prefix_cache"] = res
    return bool(res["background_equals_whole"])


LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32,
             "vocab_size": 128256, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
             "torch_dtype": "bfloat16", "head_dim": 128, "tie_word_embeddings": False}


def vllm_run(store: str, tokens: int, eager: bool = True) -> int:
    """One engine: build vllm.LLM with the connector, prefill the prompt, print one JSON line
    (output tokens, time to first token, the worker connector's counters, and whether the blocks
    it loaded hold the store's bytes exactly).  ``eager=False``: CUDA graphs (vLLM's PIECEWISE
    mode, which the connector asks for) instead of eager mode."""
    import os

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the worker in this process: its counters
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    model = Path(store).parent / "llama3-8b-shaped"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(LLAMA3_8B))
    llm = LLM(model=str(model), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=eager,
              max_model_len=tokens + 64, gpu_memory_utilization=0.8, seed=0,
              kv_transfer_config={"kv_connector": "TierstoreConnector", "kv_role": "kv_both",
                                  "kv_connector_module_path": "tierstore.integrations.vllm",
                                  "kv_connector_extra_config": {"path": store, "chunk_tokens": 256,
                                                                "durability": "sync"}})
    prompt = {"prompt_token_ids": [int(t) for t in np.random.default_rng(1).integers(10, 100000, tokens)]}
    params = SamplingParams(max_tokens=1, temperature=0.0)
    t0 = time.perf_counter()
    out = llm.generate([prompt], params, use_tqdm=False)
    ttft = time.perf_counter() - t0
    conn = get_kv_transfer_group()
    loads = conn.check_last_loads()  # before anything reuses the blocks
    conn.flush()
    io_path = None
    try:
        io_path = conn.store.stats()["tiers"].get("gpu", {}).get("io_path")
    except (AttributeError, TierstoreError):
        pass
    print(json.dumps({"ttft_s": round(ttft, 3), "output": list(out[0].outputs[0].token_ids), "eager": eager,
                      "counters": dict(conn.counters), "loaded_blocks_check": loads,
                      "io_path": io_path or "posix (pread into pinned host memory)"}))
    return 0


def check_vllm(args: argparse.Namespace) -> int:
    import subprocess

    try:
        import vllm
    except ImportError:
        print("vllm is not installed here: run this with .venv-vllm/bin/python (scripts/vllm_env.sh)", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 2
    res: dict = {"vllm": vllm.__version__, "device": torch.cuda.get_device_name(0), "prompt_tokens": args.tokens}
    with tempfile.TemporaryDirectory() as d:
        store = str(Path(d) / "kv")
        runs = []
        for name, graphs in (("first", []), ("after_restart", ["--graphs"])):  # the second with CUDA graphs
            p = subprocess.run([sys.executable, __file__, "--vllm-run", store, "--tokens", str(args.tokens), *graphs],
                               capture_output=True, text=True, timeout=600)
            line = next((ln for ln in reversed(p.stdout.splitlines()) if ln.startswith("{")), None)
            if p.returncode != 0 or line is None:
                print(p.stdout[-3000:], p.stderr[-6000:], file=sys.stderr)
                res[name] = {"error": f"exit {p.returncode}"}
                break
            runs.append(json.loads(line))
            res[name] = {k: v for k, v in runs[-1].items() if k != "output"}
    ok = len(runs) == 2
    if ok:
        full = (args.tokens - 1) // 256
        res["chunks_stored_first"] = runs[0]["counters"]["chunks_saved"]
        res["chunks_loaded_after_restart"] = runs[1]["counters"]["chunks_loaded"]
        res["same_output"] = runs[0]["output"] == runs[1]["output"]
        res["ttft_speedup"] = round(runs[0]["ttft_s"] / max(runs[1]["ttft_s"], 1e-9), 2)
        check = runs[1]["loaded_blocks_check"]
        ok = (res["chunks_loaded_after_restart"] == full and runs[1]["counters"]["load_errors"] == 0
              and check["chunks"] == full and check["mismatches"] == 0)  # same_output: reported (dummy weights
        # make the output nearly independent of the KV, so it is a weak check; the bytes are the strong one)
    res["ok"] = bool(ok)
    print(json.dumps(res, indent=2) if args.json else res)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
