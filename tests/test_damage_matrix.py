"""A sample of scripts/damage_matrix.py in CI (the full table, with more trials, is in
docs/reliability.md): one flipped byte in each region at each position of a three-segment store.
Whatever it hits, no process crashes, no wrong value is ever returned (an older version counts as
wrong), damage costs at most the one object it hit (none for padding, the segment header or the
index), no object gets two values from two paths, and fsck --deep is clean after recover."""

from __future__ import annotations

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location("damage_matrix",
                                              Path(__file__).parent.parent / "scripts" / "damage_matrix.py")
matrix = importlib.util.module_from_spec(spec)
spec.loader.exec_module(matrix)


def test_damage_costs_one_object_at_most(capsys):
    rows = matrix.run(trials=1, seed=14)
    with capsys.disabled():
        print("\n" + matrix.markdown(rows))
    assert {r["region"] for r in rows} == set(matrix.REGIONS)
    for r in rows:
        cell = (r["region"], r["position"])
        assert r["crashes"] == 0 and r["wrong"] == 0, cell
        assert r["max_lost"] <= 1, cell  # no damaged byte cost more than the object it hit
        if r["region"] in ("padding", "segment header", "LMDB index"):
            assert r["lost"] == 0, cell
        assert r["one_value"] == r["cases"] and r["fsck_clean"] == r["cases"], cell
