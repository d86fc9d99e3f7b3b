"""Cut the small slices of real model data that tests use from ../shared/data (run once).

Source: all-MiniLM-L6-v2 activations (see ../shared/data/README.md).  Tests must not need
../shared, so the slices are committed under tests/data/.
"""

import sys
from pathlib import Path

import numpy as np

src = Path(sys.argv[1] if len(sys.argv) > 1 else "../shared/data")
dst = Path(__file__).resolve().parent.parent / "tests" / "data"
dst.mkdir(parents=True, exist_ok=True)
z = np.load(src / "minilm_qkv_sample.npz")
doc = "gpl3_legal"
tokens = 128
q = z[f"{doc}_q"][:, :, :tokens]  # [layers, heads, tokens, head_dim]
kv = np.stack([z[f"{doc}_k"][:, :, :tokens], z[f"{doc}_v"][:, :, :tokens]], axis=1)  # [L, 2, H, T, D]
np.savez(dst / "minilm_qkv_128tok.npz", q=q, kv=kv)
emb = np.load(src / "minilm_embeddings_8k_fp16.npy")[:1024]
np.save(dst / "minilm_embeddings_1k_fp16.npy", emb)
print("wrote", sorted(p.name for p in dst.iterdir()))
