"""Performance check: a short, fixed set of points on the machine at hand, each ratio compared
with the committed results file of that machine. Run it on the device before a change to
kernels, launch sizes or records lands; it exits 1 when a point lost speed.

    python3 benchmarks/check_perf.py                      # the points of this machine's kind
    python3 benchmarks/check_perf.py --suites inference --repeats 3

Suites (each runs its harness ``--repeats`` times, in this process, with the harness's own
interleaved timing; the rows are the harness's, benchmarks/rows.py's schema):
  inference  bench_ffn.py  M = 4096, 16384, 65536; d = 0.005, tail 0, 2048x5632   inductor_ms / twell_ms
  nongated   bench_ffn.py --non-gated  M = 4096, 8192; the same                   inductor_ms / twell_ms
  decode     bench_ffn.py --decode  M = 1, 16; d = 0.005, 2048x5632            dense_ms / twell_ms
  training   bench_ffn_train.py  M = 16384; d = 0.005, tail 0, 2048x5632      inductor_ms / twell_ms
  cpu        bench_ffn_cpu.py  M = 1, 16, 256; d = 0.005, 2 threads           inductor_ms / twell_ms
(the CUDA suites by default on a GPU, ``cpu`` without one; nongated watches the
calls whose CUDA-graph decision sits near the host/GPU crossover: the H100's eager non-gated call
at 8192 tokens ran host-bound, 0.74x-0.92x of Inductor, until its record's threshold moved). The
committed file of a suite is benchmarks/results/<tag>/<file> with <tag> the GPU's ("h100",
"h200") or "cpu-<processor>", the row the latest one of the same M, K, N, density and tail (and
activity "iid" where rows have one, the suite's FFN, gated or not, where rows say).

A point fails when the median of its new ratios is below the committed ratio x (1 - tolerance)
minus their spread (max - min over the repeats): a loss over ``--tolerance`` (default 5%) beyond
the run-to-run spread measured here. A point found slower is measured again (its suite
``--repeats`` more times, after the first runs; ``--no-confirm`` skips this) and judged on all its
samples: a fresh machine's slow first minutes (an H100's training point read 1.151 against a
committed 1.369, then 1.313 minutes later; results/h100/check_perf.json) widen the spread and
pass, a lost speed stays below. Points without a committed row are listed, not judged.
Writes one row per point (stamped; fields below) to --out (default runs/<tag>/check_perf.json).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Callable, Optional

import torch

if __package__ in (None, ""):                  # run as a file
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.rows import load_rows, out_path, stamp, write_json  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
KEY = ("M", "K", "N", "density", "tail")


def _inference(out: str) -> list[str]:
    return ["--M", "4096", "16384", "65536", "--density", "0.005", "--tail", "0", "--shapes", "2048x5632",
            "--rounds", "3", "--out", out]


def _nongated(out: str) -> list[str]:
    return ["--non-gated", "--M", "4096", "8192", "--density", "0.005", "--tail", "0", "--shapes", "2048x5632",
            "--rounds", "3", "--out", out]


def _decode(out: str) -> list[str]:
    return ["--decode", "--M", "1", "16", "--density", "0.005", "--shapes", "2048x5632", "--out", out]


def _training(out: str) -> list[str]:
    return ["--M", "16384", "--density", "0.005", "--tail", "0", "--out", out]


def _cpu(out: str) -> list[str]:
    return ["--m", "1,16,256", "--density", "0.005", "--threads", "all", "--budget", "4", "--out", out]


def main_of(module: str) -> Callable[[list[str]], int]:
    import importlib

    return importlib.import_module(f"benchmarks.{module}").main


# suite: (harness module, its arguments, the committed file's name, the ratio's numerator, denominator,
# whether its FFN is gated)
SUITES = {
    "inference": ("bench_ffn", _inference, "ffn_inference.json", "inductor_ms", "twell_ms", True),
    "nongated": ("bench_ffn", _nongated, "ffn_inference_nongated.json", "inductor_ms", "twell_ms", False),
    "decode": ("bench_ffn", _decode, "ffn_decode.json", "dense_ms", "twell_ms", True),
    "training": ("bench_ffn_train", _training, "ffn_training.json", "inductor_ms", "twell_ms", True),
    "cpu": ("bench_ffn_cpu", _cpu, "ffn_inference.json", "inductor_ms", "twell_ms", True),
}


def machine_tag() -> str:
    """The results folder of the machine at hand: the GPU's tag, else cpu-<processor>."""
    if torch.cuda.is_available():
        from benchmarks.timing import gpu_name

        return gpu_name()
    from benchmarks.bench_ffn_cpu import cpu_model

    return f"cpu-{cpu_model()}"


def key_of(row: dict) -> tuple:
    return tuple(float(row[k]) for k in KEY)


def committed_row(rows: list[dict], key: tuple, gated: bool = True) -> Optional[dict]:
    """The latest committed row of a point (i.i.d. activity, and the FFN gated or not as ``gated``
    says, where rows record them; a row without ``gated`` is a gated FFN's)."""
    same = [r for r in rows if all(k in r for k in KEY) and key_of(r) == key and r.get("activity", "iid") == "iid"
            and r.get("gated", True) == gated]
    return max(same, key=lambda r: r.get("time", "")) if same else None


def ratio(row: dict, num: str, den: str) -> float:
    a, b = row.get(num), row.get(den)
    if a is None or b is None or not b or b != b or a != a:
        return float("nan")
    return float(a) / float(b)


def judge(committed: Optional[float], new: list[float], tolerance: float) -> tuple[str, float, float]:
    """(verdict, median of the new ratios, their spread): "ok", "slower" or "no baseline"."""
    new = [v for v in new if v == v]
    if not new:
        return "not measured", float("nan"), float("nan")
    med, spread = statistics.median(new), max(new) - min(new)
    if committed is None or committed != committed:
        return "no baseline", med, spread
    return ("slower" if med < committed * (1 - tolerance) - spread else "ok"), med, spread


def measure(name: str, repeats: int) -> dict[tuple, list[dict]]:
    """Suite ``name``'s harness run ``repeats`` times in this process: its rows by point."""
    module, argv_of = SUITES[name][:2]
    runs: dict[tuple, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(repeats):
            out = str(Path(tmp) / f"{name}_{i}.json")
            with torch.enable_grad():       # (a harness may turn grad mode off for the rest of the process)
                rc = main_of(module)(argv_of(out))
            if rc:
                raise RuntimeError(f"{module} exited with {rc}")
            for row in load_rows(Path(out)):
                runs.setdefault(key_of(row), []).append(row)
    return runs


def add_samples(runs: dict[tuple, list[dict]], more: dict[tuple, list[dict]], keys) -> None:
    """Points ``keys`` of ``runs`` take ``more``'s rows as further samples (the confirmation of a
    point found slower: judged again on every sample, so its spread counts both runs)."""
    for key in keys:
        runs.setdefault(key, []).extend(more.get(key, []))


def run_suite(name: str, tag: str, repeats: int, tolerance: float, confirm: bool = True, log=print) -> list[dict]:
    """Suite ``name`` measured and judged. ``confirm``: points found slower are measured
    ``repeats`` more times (the whole harness, after the first runs) and judged on all their
    samples: a slow period of the machine widens the spread and passes, a lost speed stays."""
    _, _, fname, num, den, gated = SUITES[name]
    committed_path = RESULTS / tag / fname
    committed = load_rows(committed_path) if committed_path.exists() else []

    def verdicts(runs):
        out = {}
        for key, got in runs.items():
            base = committed_row(committed, key, gated)
            base_ratio = ratio(base, num, den) if base else None
            out[key] = (base, base_ratio, *judge(base_ratio, [ratio(r, num, den) for r in got], tolerance))
        return out

    runs = measure(name, repeats)
    judged = verdicts(runs)
    slow = [key for key, v in judged.items() if v[2] == "slower"]
    added = {}
    if confirm and slow:
        log(f"{name:9} {len(slow)} point(s) slower: measuring again ({repeats} more runs)")
        add_samples(runs, measure(name, repeats), slow)
        added = {key: repeats for key in slow}
        judged = verdicts(runs)
    rows = []
    for key, got in runs.items():
        base, base_ratio, verdict, med, spread = judged[key]
        rows.append(stamp({
            "suite": name, **dict(zip(KEY, key)), "ratio": f"{num} / {den}",
            "new_ratios": [round(ratio(r, num, den), 4) for r in got], "new_median": round(med, 4),
            "spread": round(spread, 4), "committed_ratio": None if base_ratio is None else round(base_ratio, 4),
            "committed_file": str(committed_path.relative_to(RESULTS.parent.parent)) if base else None,
            "committed_commit": base.get("commit") if base else None, "tolerance": tolerance,
            "verdict": verdict, "confirm_runs": added.get(key, 0), "path": got[-1].get("path"),
        }, "cpu" if name == "cpu" else "cuda"))
        again = f" (with {added[key]} confirming runs)" if key in added else ""
        log(f"{name:9} M={int(key[0]):6d} d={key[3]:<6} tail={key[4]:<4} new {med:6.3f} (spread {spread:.3f}) "
            f"committed {'-' if base_ratio is None else f'{base_ratio:6.3f}'}  {verdict}{again}")
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suites", nargs="+", choices=list(SUITES), default=None,
                    help="default: inference, nongated, decode and training on a GPU; cpu without one")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each harness (the spread's sample)")
    ap.add_argument("--tolerance", type=float, default=0.05, help="loss allowed beyond the spread (fraction)")
    ap.add_argument("--no-confirm", action="store_true",
                    help="judge a point found slower on the first runs alone (default: measure its suite "
                         "--repeats more times and judge on every sample)")
    ap.add_argument("--out", default=None, help="JSON path (default runs/<tag>/check_perf.json)")
    a = ap.parse_args(argv)
    if a.repeats < 1 or not 0 <= a.tolerance < 1:
        ap.error("--repeats must be >= 1 and --tolerance in [0, 1)")
    tag = machine_tag()
    suites = a.suites or (["inference", "nongated", "decode", "training"] if torch.cuda.is_available() else ["cpu"])
    rows = []
    for name in suites:
        rows += run_suite(name, tag, a.repeats, a.tolerance, confirm=not a.no_confirm)
    out = out_path(a.out, tag, "check_perf.json")
    write_json(out, rows)
    slower = [r for r in rows if r["verdict"] == "slower"]
    print(f"check_perf on {tag}: {len(rows)} points, {len(slower)} slower than committed; wrote {out}")
    return 1 if slower else 0


if __name__ == "__main__":
    sys.exit(main())
