"""benchmarks/bench_moe.py --tiny runs on the CPU: one row with both backends' times, the
experts rewritten (a measured density) and twell's output as Inductor's."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")


def test_tiny_moe_row(tmp_path) -> None:
    from benchmarks import bench_moe

    out = tmp_path / "moe.json"
    assert bench_moe.main(["--tiny", "--reps", "1", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["bench"] == "moe" and row["experts"] == 8 and row["top_k"] == 2 and row["mode"] == "forward"
    assert row["inductor_ms"] > 0 and row["twell_ms"] > 0
    assert 0 < row["density_measured"] < 0.05 and row["rows_per_expert"] > 0
    assert row["max_abs_err"] <= 1e-5
