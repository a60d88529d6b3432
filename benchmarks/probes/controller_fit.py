"""The numbers behind twell.target_density's controller (twell_compile/control.py), from the
per-step per-layer densities that ``bench_e2e.py --train --twell-opt twell.target_density=...``
writes (``twell_layer_density_per_step``).

    python3 benchmarks/probes/controller_fit.py benchmarks/results/h200/e2e_train_target_text.json
    python3 benchmarks/probes/controller_fit.py --fit benchmarks/results/h200/e2e_train_target.json

Windows (default): per row, the mean over layers and steps of |log(density / target)| and the
share of layer-steps within 25% of the target, in the step windows ``--windows`` bounds
(docs/training.md's table), after each layer's spread about its own level over the second half
of the steps (bench_e2e's ``twell_layer_density_log_sd``, computed from the densities, so rows
written before that field get it too); rows of a fixed coefficient (``twell.l1``, no target)
print the spread alone: the batches' own, which no controller removes.

``--fit`` (the first row of the file: the run of 54e2707, whose controller was the walking rule
alone): each step's coefficient replayed from the densities by that rule (REPLAYED, below, its
constants then; the update at step t uses the densities of steps < t - 1, as the controller's
one step of lag), then per layer a grid fit of a first-order plant over the first ``--steps``
steps: log d(t+1) = log d(t) + (goal - log d(t)) / tau, goal = log target + offset - gain *
log c(t - delay), tau = fall when goal < log d(t) else rise, by the least squared error of the
simulated log density. Prints each layer's best fits (control.py's gains were tuned to them).
Probe code: it ships nothing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path
from typing import Sequence

if __package__ in (None, ""):                  # run as a file
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.bench_e2e import layer_spreads  # noqa: E402  (the field's own formula)

# the walking rule as it ran at 54e2707 (results/h200/e2e_train_target.json's first row)
REPLAYED = dict(gain=2.0, horizon=100.0, pace=0.02, smooth=0.1, max_up=0.08, max_down=0.15)
GRID = dict(gain=(0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0), fall=(1.0, 2.0, 3.0, 4.0, 6.0),
            rise=(2.0, 4.0, 6.0, 8.0, 12.0, 16.0), offset=tuple(x / 2 for x in range(-4, 41)), delay=(0, 1, 2, 3))


def windows(per_step: dict[str, list[float]], target: float, bounds: Sequence[int]) -> list[tuple[int, int, float, float]]:
    """(first, end, mean |log(d / target)|, share within 25%) over every layer's steps [first, end)."""
    out = []
    for lo, hi in zip(bounds, bounds[1:]):
        ds = [d for v in per_step.values() for d in v[lo:hi]]
        if ds:
            err = sum(abs(math.log(max(d, 1e-12) / target)) for d in ds) / len(ds)
            out.append((lo, hi, err, sum(abs(d / target - 1) <= 0.25 for d in ds) / len(ds)))
    return out


def replay(dens: Sequence[float], target: float, init: float, r: dict = REPLAYED) -> list[float]:
    """The coefficient each step ran with under the smoothed walking rule (lagged one step)."""
    log_c, smooth, prev, out = math.log(init), None, None, []
    for t in range(len(dens)):
        out.append(math.exp(log_c))
        if t >= 1:
            ld = math.log(max(dens[t - 1], 1e-6))
            smooth = ld if smooth is None else smooth + r["smooth"] * (ld - smooth)
            err = smooth - math.log(target)
            step = r["gain"] * ((err - (err if prev is None else prev)) + max(-r["pace"], min(r["pace"], err / r["horizon"])))
            log_c += max(-r["max_down"], min(r["max_up"], step))
            prev = err
    return out


def simulate(coefs: Sequence[float], d0: float, target: float, gain: float, fall: float, rise: float,
             offset: float, delay: int, steps: int) -> list[float]:
    """Log densities of the plant driven by ``coefs`` from ``d0``, steps 0..steps-1."""
    ld, out = math.log(d0), []
    for t in range(steps):
        out.append(ld)
        goal = math.log(target) + offset - gain * math.log(coefs[max(t - delay, 0)])
        ld += (goal - ld) / (fall if goal < ld else rise)
    return out


def fit(dens: Sequence[float], coefs: Sequence[float], target: float, steps: int, top: int = 3) -> list[tuple]:
    """The ``top`` (squared error, gain, fall, rise, offset, delay) of GRID on steps [0, steps)."""
    obs = [math.log(max(d, 1e-12)) for d in dens[:steps]]
    res = []
    for g, f, r, o, dl in itertools.product(*GRID.values()):
        sim = simulate(coefs, dens[0], target, g, f, r, o, dl, len(obs))
        res.append((sum((a - b) ** 2 for a, b in zip(sim, obs)), g, f, r, o, dl))
    return sorted(res)[:top]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", help="a bench_e2e --train results file with twell.target_density rows")
    ap.add_argument("--windows", default="20,50,80,100", help="step window bounds (default 20,50,80,100)")
    ap.add_argument("--fit", action="store_true", help="fit the plant to the first row (see above)")
    ap.add_argument("--steps", type=int, default=26, help="--fit: the steps fitted (default 26)")
    a = ap.parse_args(argv)
    try:
        bounds = [int(v) for v in a.windows.split(",")]
    except ValueError:
        raise ValueError(f"--windows takes comma-separated step numbers, got {a.windows!r}") from None
    if len(bounds) < 2 or bounds != sorted(bounds) or bounds[0] < 0:
        raise ValueError(f"--windows needs two or more increasing step numbers >= 0, got {a.windows!r}")
    rows = [r for r in json.loads(Path(a.results).read_text())
            if "twell_layer_density_per_step" in r.get("backends", {}).get("twell", {})]
    if not rows:
        raise ValueError(f"{a.results}: no row with per-step densities (bench_e2e --train)")
    if a.fit:
        rows = [r for r in rows if "twell.target_density" in r["config"]["twell_options"]][:1]
    for r in rows:
        opts = r["config"]["twell_options"]
        per_step = r["backends"]["twell"]["twell_layer_density_per_step"]
        target = opts.get("twell.target_density")
        print(f"{r['commit'][:7]} data={r['config'].get('data', 'fixed')} lr_warmup={r['config'].get('lr_warmup', 0)} "
              f"options={opts}{'' if target is not None else ' (no target)'}")
        if not a.fit:
            # the spread about each layer's own level (with a fixed coefficient the batches' own,
            # the floor under a controller), from the densities: rows written before the field too
            for layer, sd in layer_spreads(per_step).items():
                print(f"  {layer}: sd of log density over the second half {'-' if sd is None else f'{sd:.3f}'}")
            if target is not None:
                for lo, hi, err, share in windows(per_step, float(target), bounds):
                    print(f"  steps {lo:3d}-{hi:3d}: mean |log(d / target)| {err:.2f}, within 25% {share:.0%}")
            continue
        target = float(target)
        init = float(opts.get("twell.target_l1_init", 0.5) or 0.5)
        for layer, dens in per_step.items():
            coefs = replay(dens, target, init)
            print(f"  {layer}: final replayed coefficient {coefs[-1]:.2f}")
            for err, g, f, rr, o, dl in fit(dens, coefs, target, a.steps):
                print(f"    error {err:.3f}: gain -{g}, fall {f}, rise {rr}, offset {o}, delay {dl}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
