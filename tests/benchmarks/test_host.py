"""benchmarks/host.py: measuring the CPUs a benchmark may use and keeping it on the fast (or slow) ones."""
import os

import pytest

from benchmarks import host

needs_affinity = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")


def test_choose_keeps_the_cpus_within_the_tolerance_of_the_fastest_or_slowest():
    measured = {0: 50.0, 1: 90.0, 2: 54.0, 3: 80.0, 4: 58.0}
    assert host.choose(measured, "fast") == [0, 2]             # 58 > 50 * 1.15
    assert host.choose(measured, "fast", tolerance=1.2) == [0, 2, 4]
    assert host.choose(measured, "slow") == [1, 3]             # 80 * 1.15 >= 90; 58 * 1.15 < 90
    assert host.choose(measured, "all") == [0, 1, 2, 3, 4]
    assert host.choose({}, "fast") == []


@pytest.mark.parametrize("choice, tolerance, match", [("fastest", 1.15, "host CPUs must be one of"),
                                                      ("fast", 0.9, "tolerance must be >= 1.0")])
def test_bad_choices_are_refused_by_name(choice, tolerance, match):
    with pytest.raises(ValueError, match=match):
        host.choose({0: 1.0}, choice, tolerance)
    if tolerance >= 1.0:
        with pytest.raises(ValueError, match=match):
            host.pin(choice)


@needs_affinity
def test_speeds_times_every_allowed_cpu_and_gives_the_affinity_back():
    before = os.sched_getaffinity(0)
    measured = host.speeds(rounds=1)
    assert os.sched_getaffinity(0) == before
    assert sorted(measured) == sorted(before)
    assert all(ns > 0 for ns in measured.values())


@needs_affinity
@pytest.mark.parametrize("choice", ["fast", "slow", "all"])
def test_pin_keeps_the_thread_on_the_cpus_it_reports(choice):
    before = os.sched_getaffinity(0)
    try:
        got = host.pin(choice)
        assert got["host_cpus"] == choice
        assert set(got["host_cpu_loop_ns"]) == {str(c) for c in before}
        kept = set(got["host_cpus_kept"])
        assert kept and kept <= before
        assert os.sched_getaffinity(0) == (before if choice == "all" else kept)
    finally:
        os.sched_setaffinity(0, before)
