"""GPU check (run it where a CUDA device exists; it is not part of CI, which has none).

    python scripts/gpu_check.py [--device cuda:0] [--json]

Checks what cannot be checked on a CPU-only machine:
1. lossy objects read with get(device=...) dequantise on the GPU bit for bit as the CPU
   decoder does (SPEC.md §6.1 fixes the binary32 arithmetic; every codec, bfloat16 and float16);
2. raw objects come back on the device with the stored bytes;
3. the time of a 32 MiB KV chunk get to the device, raw and int8, against a plain
   torch.from_numpy(...).to(device) of the same bytes (same process).
Exits 1 on any mismatch.  Runs in well under a minute.
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
from tierstore import KVCache, Vectors, codecs  # noqa: E402


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
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
    out["ok"] = bool(ok)
    print(json.dumps(out, indent=2) if args.json else out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
