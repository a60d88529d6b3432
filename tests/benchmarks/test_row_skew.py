"""benchmarks/probes/row_skew.py: the row kernel's cut of a heavy row and the schedule model."""

from __future__ import annotations

import json

import pytest

from benchmarks.probes import row_skew


@pytest.mark.parametrize("pairs, heavy, parts, seg, want", [
    (149, True, 4, 48, [38, 38, 38, 35]),
    (4, True, 3, 1, [2, 2]),            # no empty part: 4 pairs in 3 parts are 2 + 2
    (7, True, 3, 2, [3, 3, 1]),
    (48, True, 4, 48, [48]),            # at most SEG: whole
    (149, False, 4, 48, [149]),         # not among the first rows in order
    (149, True, 1, 48, [149]),          # split off
])
def test_split_parts_cut_as_the_kernel_does(pairs, heavy, parts, seg, want):
    got = row_skew.split_parts(pairs, heavy, parts, seg)
    assert got == want and sum(got) == pairs


def test_stretch_is_one_when_balanced_and_shows_a_long_row():
    assert row_skew.stretch([10] * 8, slots=4, overhead=0.0) == 1.0
    # one row of 40 among seven of 10 on 4 slots: the balanced time is 110 / 4, the wave waits on 40
    assert row_skew.stretch([40] + [10] * 7, slots=4, overhead=0.0) == pytest.approx(40 / 27.5)
    # cut in four parts of 10 it balances
    assert row_skew.stretch([40] + [10] * 7, slots=4, overhead=0.0, parts=4, seg=10, rows=1) == pytest.approx(30 / 27.5)


def test_rows_per_point(capsys):
    row_skew.main(["--M", "64", "--K", "64", "--N", "256", "--density", "0.05", "--slots", "8", "--split", "2,4,16"])
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["M"] == 64 and row["split"] == [2, 4, 16] and row["max"] >= row["p50"]
    assert row["stretch_8"] >= 1.0 and row["split_stretch_8"] >= 1.0


def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match="--split '4,48'"):
        row_skew.main(["--split", "4,48"])
    with pytest.raises(ValueError, match="--record 'H300'"):
        row_skew.main(["--record", "H300"])
