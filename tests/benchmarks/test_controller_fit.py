"""benchmarks/probes/controller_fit.py: the windows of a controlled run, the replay of the rule that
ran at 54e2707, and the plant fit (CPU, no model)."""

import json
import math
from pathlib import Path

import pytest

from benchmarks.probes import controller_fit as CF

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "benchmarks/results/h200/e2e_train_target.json"


def test_windows_average_the_log_error_and_count_the_band():
    per_step = {"a": [0.005] * 10 + [0.01] * 10, "b": [0.005 * 1.2] * 10 + [0.0025] * 10}
    (w0, w1) = CF.windows(per_step, 0.005, [0, 10, 20])
    assert w0[:2] == (0, 10) and w0[2] == pytest.approx(math.log(1.2) / 2) and w0[3] == 1.0
    assert w1[2] == pytest.approx(math.log(2)) and w1[3] == 0.0


def test_the_replay_is_the_rule_that_ran():
    """Replayed from the committed run's densities, each layer ends at the coefficient the run
    reported: the rule and its lag are the ones that ran."""
    row = json.loads(RUN.read_text())[0]
    tw = row["backends"]["twell"]
    init = row["config"]["twell_options"]["twell.target_l1_init"]
    for layer, dens in tw["twell_layer_density_per_step"].items():
        final = CF.replay(dens, 0.005, init)[-1]          # the coefficient of the last step
        assert final == pytest.approx(tw["twell_layer_l1_coef"][layer], rel=1e-4), layer


def test_the_fit_recovers_a_plant_of_the_grid():
    truth = dict(gain=3.0, fall=2.0, rise=8.0, offset=9.5, delay=2)
    coefs = [40.0 * 0.9 ** t if t < 12 else 12.0 * 1.05 ** (t - 12) for t in range(26)]
    dens = [math.exp(v) for v in CF.simulate(coefs, 0.006, 0.005, **truth, steps=26)]
    err, *best = CF.fit(dens, coefs, 0.005, 26, top=1)[0]
    assert err < 1e-20 and best == list(truth.values())


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="--windows"):
        CF.main([str(RUN), "--windows", "50,20"])
    empty = tmp_path / "rows.json"
    empty.write_text(json.dumps([{"backends": {"twell": {}}}]))
    with pytest.raises(ValueError, match="per-step densities"):
        CF.main([str(empty)])


def test_a_fixed_coefficient_row_prints_its_spread(tmp_path, capsys):
    """A row without a target (twell.l1 fixed) gives each layer's spread over the second half
    (bench_e2e.layer_spreads: |log 1.5| / 2 for l0; one positive density for l1, so none), the
    floor a controller works above; a controlled row of the same file gets its windows too."""
    fixed = {"commit": "f" * 40, "config": {"twell_options": {"twell.l1": 5.0}, "data": "text"},
             "backends": {"twell": {"twell_layer_density_per_step": {"l0": [0.004, 0.006, 0.004, 0.006],
                                                                     "l1": [0.005, 0.005, 0.0, 0.005]}}}}
    controlled = json.loads(RUN.read_text())[0]
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([fixed, controlled]))
    assert CF.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "(no target)" in out and "l0: sd of log density over the second half 0.203" in out
    assert "l1: sd of log density over the second half -" in out
    assert "within 25%" in out
