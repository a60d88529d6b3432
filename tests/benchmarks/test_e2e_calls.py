"""benchmarks/probes/e2e_calls.py on the CPU tiny model: a line per call, the layers' paths, the profiler's table."""
import pytest

from benchmarks.probes import e2e_calls


def test_tiny_model_prints_each_call_and_a_profile(capsys):
    assert e2e_calls.main(["--density", "0.1", "--calls", "2", "--profiled", "1", "--rows", "5",
                           "--", "--tiny", "--seq", "64"]) == 0
    out = capsys.readouterr().out
    calls = [line for line in out.splitlines() if line.startswith("call ")]
    assert len(calls) == 2 and all("wall" in line and "op graphs held 0" in line for line in calls)
    assert "paths:" in out and "Self CPU" in out


def test_bad_counts_are_refused():
    with pytest.raises(SystemExit):
        e2e_calls.main(["--calls", "0"])
