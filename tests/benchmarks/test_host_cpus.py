"""benchmarks/probes/host_cpus.py: every allowed CPU timed per pass, the affinity given back."""
import os

import pytest

from benchmarks.probes import host_cpus

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")


def test_speeds_times_every_allowed_cpu_and_gives_the_affinity_back():
    before = os.sched_getaffinity(0)
    got = host_cpus.speeds(sorted(before), rounds=1)
    assert os.sched_getaffinity(0) == before
    assert sorted(got) == sorted(before)
    assert all(ns > 0 for ns in got.values())


def test_main_prints_a_row_per_pass_with_a_column_per_cpu(capsys):
    assert host_cpus.main(["--passes", "2", "--every", "0", "--rounds", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    cpus = len(os.sched_getaffinity(0))
    assert len(lines) == 3 and len(lines[0].split()) == cpus + 1
    assert all(len(line.split()) == cpus + 1 and float(line.split()[-1]) > 0 for line in lines[1:])


def test_bad_counts_are_refused():
    with pytest.raises(SystemExit):
        host_cpus.main(["--passes", "0"])
