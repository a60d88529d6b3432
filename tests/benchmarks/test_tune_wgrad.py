"""benchmarks/tune_wgrad.py: record variants of the weight-gradient passes timed side by side,
rows in the shared schema, each variant's gradients compared with the first's."""

from __future__ import annotations

import pytest
import torch

from benchmarks import tune_wgrad
from benchmarks.rows import load_rows


def test_rejects_an_unknown_field_before_anything_runs():
    with pytest.raises(ValueError, match="FIELD=VALUE"):
        tune_wgrad.main(["--variants", "no_such_field=1"])


def test_needs_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a GPU"):
        tune_wgrad.main(["--variants", "wg_programs_per_sm=8"])


@pytest.mark.gpu
def test_rows_per_variant_with_gradients_that_agree(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    out = tmp_path / "w.json"
    tune_wgrad.main(["--M", "8192", "--K", "512", "--N", "1024", "--rounds", "2", "--reps", "20", "--out", str(out),
                     "--variants", "wg_programs_per_sm=8", "wg_programs_per_sm=3", "wg_dy_entries=2"])
    rows = load_rows(out)
    assert [r["variant"] for r in rows] == ["wg_programs_per_sm=8", "wg_programs_per_sm=3", "wg_dy_entries=2"]
    assert all(r["dy_ms"] > 0 and r["x_ms"] > 0 for r in rows)
    # other program counts and entries per step sum in other orders (split neurons' chunks add
    # atomically): the same gradients to fp32 rounding (H100: 1.1e-7)
    assert rows[0]["equal"] and rows[0]["max_rel"] == 0.0
    assert all(r["max_rel"] < 1e-5 for r in rows)
