"""The LMCache plugin's tests run in LMCache's own environment (``scripts/lmcache_env.sh`` builds
``.venv-lmcache``; ``scripts/dev.sh test`` runs them there).  Elsewhere they are not collected:
LMCache pins numpy <= 2.2.6 and pulls CUDA packages, so it is not installed in the main venv."""

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("lmcache") is not None else ["test_*.py"]
