"""The LMCache plugin's tests run in LMCache's own environment (``scripts/lmcache_env.sh`` builds
``.venv-lmcache``; ``scripts/dev.sh test`` runs them there).  Elsewhere they are not collected:
LMCache pins numpy <= 2.2.6 and pulls CUDA packages, so it is not installed in the main venv."""

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("lmcache") is not None else ["test_*.py"]


import os  # noqa: E402
import sys  # noqa: E402

_status = {"exit": 0}


def pytest_sessionfinish(session, exitstatus):  # type: ignore[no-untyped-def]
    _status["exit"] = int(exitstatus)


def pytest_unconfigure(config):  # type: ignore[no-untyped-def]
    """LMCache 0.5.6 sometimes aborts while the interpreter exits, after every test has run and the
    summary is printed ("terminate called without an active exception": a native thread of its
    still joinable when its static object is destroyed; seen once in CI under load, exit 134).
    The result is final here, so leave with pytest's own exit status without running native
    destructors.  (Only in LMCache's environment: this conftest is not used elsewhere.)"""
    if importlib.util.find_spec("lmcache") is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_status["exit"])
