"""benchmarks/reference.py without a GPU: a folder that is not the reference is refused with the
fix named, and a reference that crashes its process leaves a row marked crashed, not a dead
benchmark."""

from __future__ import annotations

import math

import pytest

from benchmarks import reference


def test_a_folder_without_the_reference_is_refused(tmp_path):
    with pytest.raises(ValueError, match="sparser-faster-llms"):
        reference.run_point(str(tmp_path), 16, 64, 128, 0.01, 0.0, 1)


def test_a_crashing_reference_gives_a_crashed_row(tmp_path):
    mod = tmp_path / "custom_models" / "twell_modules"
    mod.mkdir(parents=True)
    (mod / "twell.py").write_text("import os\nos.abort()\n")      # dies as a segfault would
    row = reference.run_point(str(tmp_path), 16, 64, 128, 0.01, 0.0, 1, reps=10, rounds=1, timeout=120)
    assert row["ref_status"].startswith("crashed rc="), row
    assert math.isnan(row["ref_ms"]) and math.isnan(row["ref_rel_err"])
