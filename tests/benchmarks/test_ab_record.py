"""benchmarks/ab_record.py: record variants' GPU time of the per-row path, rows in the shared
schema, each variant's y compared with the first's; refuses to run without a GPU."""

from __future__ import annotations

import pytest
import torch

from benchmarks import ab_record
from benchmarks.rows import load_rows


def test_needs_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a GPU"):
        ab_record.main(["--variants", "compact_transpose=0"])


def test_rejects_a_bad_activity_spec_before_the_gpu_check():
    with pytest.raises(ValueError, match="--activity 'nope'"):
        ab_record.main(["--activity", "nope", "--variants", "compact_transpose=0"])


def test_rejects_an_unknown_field():
    if not torch.cuda.is_available():
        pytest.skip("checked after the GPU check")
    with pytest.raises(ValueError, match="FIELD=VALUE"):
        ab_record.main(["--M", "64", "--variants", "no_such_field=1"])


@pytest.mark.gpu
def test_rows_per_point_with_every_variant(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    out = tmp_path / "ab.json"
    ab_record.main(["--M", "256", "--K", "256", "--N", "512", "--density", "0.02", "--width", "32",
                    "--gated", "both", "--rounds", "2", "--reps", "20", "--out", str(out),
                    "--variants", "compact_transpose=0", "compact_transpose=1,row_buckets=1"])
    rows = load_rows(out)
    assert [(r["M"], r["gated"]) for r in rows] == [(256, True), (256, False)]
    for r in rows:
        assert set(r["ms"]) == {"compact_transpose=0", "compact_transpose=1,row_buckets=1"}
        assert all(v > 0 for v in r["ms"].values())
        assert all(r["y_bit_equal"].values())
        assert r["y_rel_diff"] == {k: 0.0 for k in r["ms"]} and r["activity"] == "iid"
