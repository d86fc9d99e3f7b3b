"""The fuzz harnesses run (a bounded number of executions each, from their seed corpora).

Longer campaigns: `fuzz/run.sh SECONDS`.  Each harness fails (non-zero exit) on any exception
other than the documented ones, a hang (-timeout) or excessive memory (-rss_limit_mb).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
HARNESSES = {"record": "record", "segment": "segment", "meta": "meta", "codec": "codec", "recover": "recover",
             "reader": "segment"}


@pytest.mark.parametrize("name", sorted(HARNESSES))
def test_harness_runs_clean(name, tmp_path):
    corpus = ROOT / "fuzz" / "corpus" / HARNESSES[name]
    assert any(corpus.iterdir()), f"no seeds in {corpus}"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "fuzz" / f"fuzz_{name}.py"), str(tmp_path), str(corpus), "-runs=400",
         "-timeout=20", "-rss_limit_mb=2048", f"-artifact_prefix={tmp_path}/", "-seed=1"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Done 400 runs" in proc.stderr or "DONE" in proc.stderr, proc.stderr[-2000:]
    # coverage feedback works: the harness's target is instrumented and the seeds load (an
    # uninstrumented target reports no coverage and fuzzes blind)
    cov = [int(c) for c in re.findall(r"INITED cov: (\d+)", proc.stderr)]
    assert cov and cov[0] >= 20, proc.stderr[-2000:]
