"""benchmarks/probes/row_skew.py: the row kernel's schedule modelled, rows heaviest first or in row order."""

from __future__ import annotations

import json

import pytest

from benchmarks.probes import row_skew


def test_stretch_is_one_when_balanced_and_shows_a_long_row():
    assert row_skew.stretch([10] * 8, slots=4, overhead=0.0) == 1.0
    # one row of 40 among seven of 10 on 4 slots: the balanced time is 110 / 4, the wave waits on 40
    assert row_skew.stretch([40] + [10] * 7, slots=4, overhead=0.0) == pytest.approx(40 / 27.5)
    # taken last, in row order, the long row starts after a short one: 10 + 40 on one slot
    assert row_skew.stretch([10] * 7 + [40], slots=4, overhead=0.0, heaviest_first=False) == pytest.approx(50 / 27.5)


def test_rows_per_point(capsys):
    row_skew.main(["--M", "64", "--K", "64", "--N", "256", "--density", "0.05", "--slots", "8"])
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["M"] == 64 and row["max"] >= row["p50"]
    assert row["stretch_8"] >= 1.0 and row["stretch_rows_8"] >= 1.0


def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match="--record 'H300'"):
        row_skew.main(["--record", "H300"])
