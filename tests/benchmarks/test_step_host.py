"""benchmarks/probes/step_host.py: the training op's step timed with the collector on and off,
every collection inside a timed loop recorded (CPU: the plain-PyTorch path, tiny shapes)."""

from __future__ import annotations

import gc
import json

import pytest

from benchmarks.probes import step_host

TINY = ["--M", "16", "--K", "8", "--N", "24", "--steps", "6", "--warmup", "1", "--rounds", "1", "--cpu"]


def test_rows_count_the_collections_of_each_mode(tmp_path):
    out = tmp_path / "rows.json"
    old = gc.get_threshold()
    gc.set_threshold(1, 1, 1)                   # a collection every few allocations: gc_on must see some
    try:
        assert step_host.main(TINY + ["--out", str(out)]) == 0
    finally:
        gc.set_threshold(*old)
    on, off = json.loads(out.read_text())
    assert (on["mode"], off["mode"]) == ("gc_on", "gc_off") and on["steps"] == off["steps"] == 6
    assert on["flush"] is False
    assert sum(on["collections"]) > 0 and on["gc_ms"] > 0
    assert off["collections"] == [0, 0, 0] and off["gc_ms"] == 0
    assert gc.isenabled() and step_host.Collections not in map(type, gc.callbacks)   # left as found
    for row in (on, off):
        assert 0 < row["median_ms"] <= row["p90_ms"] <= row["max_ms"] and row["loop_ms"] > 0


@pytest.mark.parametrize("flag, value", [("--steps", "0"), ("--M", "0"), ("--warmup", "-1")])
def test_bad_arguments_name_the_flag(flag, value):
    with pytest.raises(ValueError, match=flag):
        step_host.main(TINY + [flag, value])


def test_the_flush_is_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="--flush"):
        step_host.main(TINY + ["--flush"])
