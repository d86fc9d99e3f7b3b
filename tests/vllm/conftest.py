"""The vLLM connector's tests run in vLLM's own environment (``scripts/vllm_env.sh`` builds
``.venv-vllm``; ``scripts/dev.sh test`` runs them there).  Elsewhere they are not collected:
vLLM brings its own CUDA build of torch, so it is not installed in the main venv.  The paged
gather/scatter they rely on is tested in the main suite too (tests/test_paged.py)."""

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("vllm") is not None else ["test_*.py"]
