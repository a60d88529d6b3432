"""benchmarks/check_perf.py: which committed row a point is judged against, and the verdict."""

import math

from benchmarks import check_perf


def _row(m, ratio_, time, **extra):
    return {"M": m, "K": 2048, "N": 5632, "density": 0.005, "tail": 0.0, "inductor_ms": ratio_, "twell_ms": 1.0,
            "time": time, **extra}


def test_the_latest_iid_gated_row_of_the_same_point_is_the_baseline():
    rows = [_row(16384, 1.40, "2026-11-20"), _row(16384, 1.50, "2026-11-25"),
            _row(16384, 9.0, "2026-11-26", activity="profile.json:layer3"), _row(16384, 8.0, "2026-11-27", gated=False),
            _row(65536, 1.6, "2026-11-26")]
    base = check_perf.committed_row(rows, check_perf.key_of(_row(16384, 0, "")))
    assert check_perf.ratio(base, "inductor_ms", "twell_ms") == 1.50
    assert check_perf.committed_row(rows, check_perf.key_of(_row(4096, 0, ""))) is None
    # the non-gated suite's baseline: the non-gated FFN's row only
    ng = check_perf.committed_row(rows, check_perf.key_of(_row(16384, 0, "")), gated=False)
    assert check_perf.ratio(ng, "inductor_ms", "twell_ms") == 8.0
    assert check_perf.committed_row(rows, check_perf.key_of(_row(65536, 0, "")), gated=False) is None


def test_a_loss_beyond_tolerance_and_spread_is_slower():
    assert check_perf.judge(1.50, [1.49, 1.47], 0.05)[0] == "ok"
    assert check_perf.judge(1.50, [1.40, 1.41], 0.05)[0] == "slower"        # 1.405 < 1.425 - 0.01
    assert check_perf.judge(1.50, [1.30, 1.50], 0.05)[0] == "ok"            # spread 0.2: not a finding
    assert check_perf.judge(None, [1.2], 0.05)[0] == "no baseline"
    verdict, med, _ = check_perf.judge(1.5, [float("nan")], 0.05)
    assert verdict == "not measured" and math.isnan(med)


def test_every_suite_names_a_harness_and_a_committed_file():
    for name, (module, argv_of, fname, num, den, gated) in check_perf.SUITES.items():
        assert callable(check_perf.main_of(module)), name
        assert "--out" in argv_of("x.json") and fname.endswith(".json") and num.endswith("_ms") and den == "twell_ms"
        assert ("--non-gated" in argv_of("x.json")) == (not gated), name


def test_a_confirmation_adds_samples_to_the_slow_points_only():
    runs = {(16384,): [_row(16384, 1.13, "a"), _row(16384, 1.17, "a")], (4096,): [_row(4096, 1.2, "a")]}
    more = {(16384,): [_row(16384, 1.31, "b"), _row(16384, 1.33, "b")], (4096,): [_row(4096, 9.0, "b")]}
    check_perf.add_samples(runs, more, [(16384,)])
    assert [r["inductor_ms"] for r in runs[(16384,)]] == [1.13, 1.17, 1.31, 1.33]
    assert [r["inductor_ms"] for r in runs[(4096,)]] == [1.2]
    # judged on every sample: a slow first pair that the second does not repeat passes (the H100
    # training point of results/h100/check_perf.json), a loss that repeats stays slower
    assert check_perf.judge(1.369, [1.13, 1.17], 0.05)[0] == "slower"
    assert check_perf.judge(1.369, [1.13, 1.17, 1.31, 1.33], 0.05)[0] == "ok"
    assert check_perf.judge(1.369, [1.13, 1.17, 1.14, 1.16], 0.05)[0] == "slower"
