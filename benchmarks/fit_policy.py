"""A GPU record's rules against the measurements behind them, and the decode cost model's fit.
Host arithmetic on results JSON: no GPU needed.

    python3 benchmarks/fit_policy.py --check                        # arch.H200 vs the H200 files
    python3 benchmarks/fit_policy.py --check --gpu H100 --inference benchmarks/results/h100/ffn_inference.json \\
        --decode '' --small-m benchmarks/results/h100/ffn_small_m.json   # another record, its files
    python3 benchmarks/fit_policy.py --fit-decode benchmarks/results/h200/ffn_decode.json [--out fit.json]

--check, for one record (runtime/arch.py; --gpu, default H200); a file given as '' is skipped:
  inference  the density rule (select.twell_wins with the record) on a bench_ffn.py grid
             (--inference), rows with M >= min_tokens and a timed forced kernel: where the rule
             runs TwELL, TwELL measured at most 1.03x of Inductor's time (the noise between
             runs of one point); where it runs dense, TwELL was not more than 1.1x faster than
             Inductor. TwELL's time: the forced kernel's, or the op's where the op ran TwELL
             too, whichever is lower (two timings of the same kernels, up to 14% apart at tail
             0.2; H200, 2026-11-23).
  decode     the decode rule (select.decode_pick) on a bench_ffn.py --decode grid (--decode),
             each point at its measured density: it takes the path the op took (except within
             2% of the decision boundary, or between two forms predicted within 2% of each
             other: the op decides on its first layer's measured density, the grid records the
             mean over its layers; at most 2 of each); the op never ran below 0.97x of dense;
             wherever a forced form was >= 1.25x faster than dense the rule decodes; the form it
             picks is never more than 15% slower than the fastest measured there; and it decodes
             at --min-decode-picks points at least (15 of 56 on the H200 grid of 2026-11-25).
  band       the density rule under min_tokens, where calls inside CUDA graphs take the per-row
             path from graphs_min_tokens with graphs_margin, on a bench_ffn.py file of gated and
             non-gated points there (--small-m), with inference's limits against Inductor's
             fastest reading of each point's shape (its dense FFN does not depend on the values).
  fit        the record's decode constants are that grid's fit (--fit-decode) within 0.2%.
It prints one line per check and each violation, and exits 1 on any.

--fit-decode: the decode cost model fitted to a bench_ffn.py --decode JSON (its form_ms: each
form forced): per form the record's ``decode_forms`` tuple (fixed us, W_gate GB/s, the terms'
coefficients, strided us per MB; select.decode_terms' order), by least relative error over the
points within 1.6x of dense; eager's dense FFN as dense_fixed_us + bytes / dense_gbps by least
squares. Printed as record fields (arch.py); --out writes them for bench_decode.py --policy.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any, Iterable, Optional

import torch

if __package__ in (None, ""):                  # run as a file: python3 benchmarks/fit_policy.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.rows import load_rows as load_results  # noqa: E402
from twell_compile.runtime import arch, select  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
INFERENCE = "benchmarks/results/h200/ffn_inference.json"    # relative to the checkout
DECODE = "benchmarks/results/h200/ffn_decode.json"
SMALL_M = "benchmarks/results/h200/ffn_small_m.json"
RECORDS = {"H200": arch.H200, "H100": arch.H100, "FALLBACK": arch.FALLBACK}
TWELL_SLOWER = 1.03       # the rule's TwELL picks: at most this x Inductor's time
DENSE_MISSED = 1.1        # the rule's dense picks: TwELL not this much faster than Inductor
EDGE = 0.02               # decode points this close to the boundary (or to a tied form) may go either way
MAX_EDGE = 2              # ... at most this many of each
OP_FLOOR = 0.97           # the op against dense, every decode point
DECODE_WIN = 1.25         # a forced form this much faster than dense: the rule must decode
FORM_SLACK = 1.15         # the picked form against the fastest one measured
MIN_PICKS = 12            # decode picks on the H200 grid of 2026-11-25: 15 of 56
NEAR = 1.6                # forms are fitted on their points within this x of dense
FIT_REL = 2e-3            # the record's constants against the fit


@dataclasses.dataclass
class Check:
    """One check's summary line and its violations."""
    name: str
    summary: str = ""
    failures: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def report(self) -> str:
        head = f"{self.name}: {self.summary}: {'ok' if self.ok else f'{len(self.failures)} violation(s)'}"
        return "\n".join([head] + [f"  {f}" for f in self.failures])


def _resolve(path: Path | str) -> Path:
    """A path as given, else relative to the checkout (the defaults, from any directory)."""
    path = Path(path)
    return path if path.exists() or path.is_absolute() else ROOT / path


def load_rows(path: Path | str) -> list[dict[str, Any]]:
    """The rows of a results file (benchmarks/rows.py's schema; ValueError for any other shape)."""
    return load_results(_resolve(path))


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


# --------------------------------------------------------------------------- inference
def twell_ms(r: dict[str, Any]) -> float:
    """TwELL's time at a bench_ffn.py point: the forced kernel's, or the op's where the op ran
    TwELL too, the lower. Rows before the product column time the op as twell_ms (path)."""
    op_ms, op_path = r.get("op_ms", r["twell_ms"]), r.get("op_path", r["path"])
    return min(r["kernel_ms"], op_ms) if op_path == "twell" else r["kernel_ms"]


def _judge(c: Check, p: arch.GpuPolicy, points: Iterable[tuple[str, dict[str, Any], bool, float, Optional[int]]]
           ) -> tuple[int, float, float]:
    """The density rule (select.twell_wins) at each point (where, row, gated, Inductor's time,
    the token count it decides for or None): a TwELL pick at most TWELL_SLOWER x Inductor's
    time, a dense pick missing at most DENSE_MISSED; violations into ``c``. Returns (TwELL
    picks, the worst of their TwELL / Inductor, the best Inductor / TwELL among dense picks)."""
    picked, worst, best_missed = 0, 0.0, 0.0
    for where, r, gated, ind, m in points:
        d = r["nnz_per_row"] / r["N"]
        t = twell_ms(r)
        if select.twell_wins(p, d, gated, r["K"], r["N"], r.get("K_out", r["K"]), 2, m):
            picked += 1
            worst = max(worst, t / ind)
            if t > TWELL_SLOWER * ind:
                c.failures.append(f"{where}: rule runs TwELL at {t:.3f} ms, Inductor {ind:.3f} ms ({t / ind:.2f}x)")
        else:
            best_missed = max(best_missed, ind / t)
            if t * DENSE_MISSED < ind:
                c.failures.append(f"{where}: rule runs dense, TwELL {t:.3f} ms was {ind / t:.2f}x faster than "
                                  f"Inductor {ind:.3f} ms")
    return picked, worst, best_missed


def check_inference(p: arch.GpuPolicy, rows: Iterable[dict[str, Any]], min_rows: int = 20) -> Check:
    """The density rule with record ``p`` against bench_ffn.py rows (gated FFNs, bf16)."""
    c = Check(f"inference rule ({p.name})")
    used = [r for r in rows if r["M"] >= p.min_tokens and _finite(r.get("kernel_ms")) and _finite(r.get("inductor_ms"))]
    picked, worst, best_missed = _judge(c, p, (
        (f"M={r['M']} K={r['K']} N={r['N']} d={r['density']} tail={r.get('tail')}", r, True, r["inductor_ms"], None)
        for r in used))
    if len(used) < min_rows:
        c.failures.append(f"{len(used)} rows at M >= {p.min_tokens} with a forced kernel and Inductor timed, "
                          f"fewer than {min_rows}")
    c.summary = (f"{len(used)} rows at M >= {p.min_tokens}; TwELL at {picked} (its time at most {worst:.2f}x "
                 f"Inductor's, limit {TWELL_SLOWER}), dense at {len(used) - picked} (Inductor at most "
                 f"{best_missed:.2f}x TwELL's time, limit {DENSE_MISSED})")
    return c


def check_graphs_band(p: arch.GpuPolicy, rows: Iterable[dict[str, Any]], min_rows: int = 6) -> Check:
    """The density rule under min_tokens, where only calls inside CUDA graphs take the per-row
    path (graphs_min_tokens <= M < min_tokens; select.twell_wins with M: graphs_margin), against
    bench_ffn.py rows of gated and non-gated FFNs, with the limits of ``check_inference``.
    Inductor's time of a point is its fastest reading over the file's rows of the same M, shape
    and form: its dense FFN does not depend on the values, and its slower readings are the host's
    (an H100 read 0.139-0.224 ms for the same non-gated FFN at 2048 tokens)."""
    c = Check(f"inference rule under min_tokens ({p.name})")
    lo = p.graphs_min_tokens or p.min_tokens
    used = [r for r in rows if lo <= r["M"] < p.min_tokens and _finite(r.get("kernel_ms"))
            and _finite(r.get("inductor_ms"))]

    def shape(r: dict[str, Any]) -> tuple:
        return r["M"], r["K"], r["N"], r.get("gated", True)

    fastest: dict[tuple, float] = {}
    for r in used:
        fastest[shape(r)] = min(fastest.get(shape(r), math.inf), r["inductor_ms"])
    picked, worst, best_missed = _judge(c, p, (
        (f"M={r['M']} K={r['K']} N={r['N']} d={r['density']} {'gated' if shape(r)[3] else 'non-gated'}", r,
         shape(r)[3], fastest[shape(r)], r["M"]) for r in used))
    if len(used) < min_rows:
        c.failures.append(f"{len(used)} rows at {lo} <= M < {p.min_tokens}, fewer than {min_rows}")
    c.summary = (f"{len(used)} rows at {lo} <= M < {p.min_tokens}; TwELL at {picked} (at most {worst:.2f}x "
                 f"Inductor's fastest, limit {TWELL_SLOWER}), dense at {len(used) - picked} (Inductor at most "
                 f"{best_missed:.2f}x TwELL's time, limit {DENSE_MISSED})")
    return c


# --------------------------------------------------------------------------- decode
def check_decode(p: arch.GpuPolicy, rows: Iterable[dict[str, Any]], min_picks: int = MIN_PICKS) -> Check:
    """The decode rule with record ``p`` against bench_decode.py rows (gated, bf16)."""
    c = Check(f"decode rule ({p.name})")
    used = [r for r in rows if r.get("kernel") == "decode" and r["M"] <= p.decode_max_m]
    picked = near = tied = 0
    for r in used:
        m, k, n = r["M"], r["K"], r["N"]
        k_out = r.get("K_out", k)
        d = r["nnz_per_row"] / n
        where = f"M={m} K={k} N={n} d={r['density']}"
        form = select.decode_form(p, d, m, k, n, k_out)
        wins = select.decode_wins(p, d, m, k, n, k_out, True)
        want = f"decode-{form}" if wins else "dense"
        edge = p.decode_margin * select.dense_us(p, k, n, k_out, True)
        ts = sorted(select.decode_us(p, d, m, k, n, k_out).values())
        if abs(ts[0] / edge - 1) <= EDGE:
            near += 1
        elif wins and len(ts) > 1 and ts[1] <= (1 + EDGE) * ts[0]:     # two forms predicted alike: either
            tied += r["path"] != want
            if not r["path"].startswith("decode-"):
                c.failures.append(f"{where}: rule decodes ({want}, tied), the op ran {r['path']}")
        elif r["path"] != want:
            c.failures.append(f"{where}: rule takes {want}, the op ran {r['path']}")
        if r["dense_ms"] / r["twell_ms"] < OP_FLOOR:
            c.failures.append(f"{where}: the op ran {r['dense_ms'] / r['twell_ms']:.2f}x of dense ({r['path']})")
        if r["dense_ms"] / r["kernel_ms"] >= DECODE_WIN and not wins:
            c.failures.append(f"{where}: forced {r.get('kernel_form')} ran {r['dense_ms'] / r['kernel_ms']:.2f}x of "
                              f"dense, the rule stays dense")
        if wins and r["form_ms"][form] > FORM_SLACK * min(r["form_ms"].values()):
            c.failures.append(f"{where}: the rule's form {form} {r['form_ms'][form] * 1e3:.1f} us, fastest "
                              f"{min(r['form_ms'].values()) * 1e3:.1f} us")
        picked += wins
    if picked < min_picks:
        c.failures.append(f"decode picked at {picked} points, fewer than {min_picks}")
    if near > MAX_EDGE or tied > MAX_EDGE:
        c.failures.append(f"{near} points within {EDGE:.0%} of the boundary and {tied} tied forms taken otherwise "
                          f"(at most {MAX_EDGE} each)")
    c.summary = (f"{len(used)} rows; decode at {picked} (>= {min_picks}), {near} within {EDGE:.0%} of the "
                 f"boundary, {tied} tied forms taken otherwise")
    return c


def _lstsq(rows: list[list[float]], ts: list[float]) -> list[float]:
    """Least squares with every coefficient >= 0 (a cost has no negative part): terms whose
    coefficient comes out negative are dropped (0) and the rest refitted."""
    a = torch.tensor(rows, dtype=torch.float64)
    b = torch.tensor(ts, dtype=torch.float64)
    keep = list(range(a.shape[1]))
    while True:
        sol = torch.linalg.lstsq(a[:, keep], b.unsqueeze(1)).solution.squeeze(1)
        neg = [j for j, v in zip(keep, sol.tolist()) if v < 0]
        if not neg or len(keep) == 1:
            out = [0.0] * a.shape[1]
            for j, v in zip(keep, sol.tolist()):
                out[j] = max(v, 0.0)
            return out
        keep.remove(min(neg, key=lambda j: sol[keep.index(j)].item()))


def decode_points(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fit points of bench_decode.py rows (decode-sized; form_ms: each form forced): M, K, N,
    K_out, union (neurons active in some row), density, dense_us, forms {form: us}."""
    return [dict(M=r["M"], K=r["K"], N=r["N"], K_out=r.get("K_out", r["K"]), union=r["union"],
                 density=r["nnz_per_row"] / r["N"], dense_us=r["dense_ms"] * 1e3,
                 forms={f: t * 1e3 for f, t in r["form_ms"].items()})
            for r in rows if r.get("kernel") == "decode"]


# Each form is fitted by least relative error (the rule compares forms by ratio): an absolute
# fit let K=4096's larger times steer the small-M forms (M=2 K=2048 took rows at 1.16x the
# pairs form's time, H200, 2026-11-22). Tiles' per-row cost is its atomics (R x K_out per
# active block): a per-row term over K + K_out missed N's share (K=4096 M=16 d=0.02 ran 0.96x
# of dense).
def fit_decode(p: arch.GpuPolicy, points: list[dict[str, Any]], near: float = NEAR) -> dict[str, Any]:
    """The decode cost model's record fields from measured points (``decode_points``): dense
    (eager's calls) as fixed + bytes(W_g, W_u, W_d) / rate; each form's tuple of constants for
    select.decode_terms' terms (with u = union / N measured), fitted to its points within
    ``near`` x of dense (where the rule decides; all its points where fewer than its constants
    + 1 are). A form that still has too few points keeps the record's tuple (listed under
    "kept")."""
    if not points:
        raise ValueError("no decode points to fit")
    dense = _lstsq([[1.0, 2e-6 * q["N"] * (2 * q["K"] + q["K_out"])] for q in points], [q["dense_us"] for q in points])
    forms, kept = {}, []
    for form, base in p.decode_forms.items():
        for limit in (near, float("inf")):   # a form never near dense (list: its deterministic
            a, t = [], []                     # use) is fitted on all its points
            for q in points:
                us = q["forms"].get(form)
                if us is None or us > limit * q["dense_us"]:
                    continue
                a.append(select.decode_terms(p, q["density"], q["union"] / q["N"], q["M"], q["K"], q["N"],
                                             q["K_out"])[form])
                t.append(us)
            if len(a) > len(base):
                break
        if len(a) <= len(base):
            forms[form] = tuple(base)
            kept.append(form)
            continue
        sol = _lstsq([[v / ti for v in row] for row, ti in zip(a, t)], [1.0] * len(t))   # relative error
        # (+ 0.0: a coefficient fitted at a hair under zero rounds to 0.0, not -0.0, whatever
        # the sign lstsq's summation order left it)
        forms[form] = tuple((round(1e3 / v, 0) if v > 0 else math.inf) if i == 1 else round(v, 2 if i == 0 else 4) + 0.0
                            for i, v in enumerate(sol))
    if len(kept) == len(forms):
        raise ValueError(f"too few decode points within {near}x of dense: nothing to fit")
    return {"decode_forms": forms, "dense_fixed_us": round(dense[0], 2) + 0.0,
            "dense_gbps": round(1e3 / dense[1], 0) if dense[1] > 0 else math.inf, "kept": kept}


def policy_json(fit: dict[str, Any]) -> str:
    """The fit as bench_decode.py --policy reads it."""
    return json.dumps({k: v for k, v in fit.items() if k != "kept"}, indent=1) + "\n"


def record_text(fit: dict[str, Any]) -> str:
    """The fit as arch.py's record fields."""
    lines = ["decode_forms=_frozen({"]
    lines += [f"    {form!r}: ({', '.join(repr(v) for v in values)}),"
              + ("  # too few points: the record's" if form in fit["kept"] else "")
              for form, values in fit["decode_forms"].items()]
    lines += ["}),", f"dense_fixed_us={fit['dense_fixed_us']!r}, dense_gbps={fit['dense_gbps']!r},"]
    return "\n".join(lines)


def check_fit(p: arch.GpuPolicy, rows: Iterable[dict[str, Any]], rel: float = FIT_REL) -> Check:
    """The record's decode constants against the fit of a bench_decode.py grid."""
    c = Check(f"decode constants ({p.name})")
    fit = fit_decode(p, decode_points(rows))
    pairs = [("dense_fixed_us", fit["dense_fixed_us"], p.dense_fixed_us), ("dense_gbps", fit["dense_gbps"], p.dense_gbps)]
    for form, values in fit["decode_forms"].items():
        if form not in fit["kept"]:
            pairs += [(f"decode_forms[{form!r}][{i}]", v, p.decode_forms[form][i]) for i, v in enumerate(values)]
    for name, got, have in pairs:
        if not math.isclose(got, have, rel_tol=rel, abs_tol=1e-9):
            c.failures.append(f"{name}: record {have}, fit {got}")
    c.summary = f"{len(pairs)} constants against the grid's fit (within {rel:.1%})"
    return c


# --------------------------------------------------------------------------- main
def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="check the record's rules against the results files")
    ap.add_argument("--fit-decode", metavar="BENCH_JSON", default=None,
                    help="fit the decode cost model to a bench_ffn.py --decode JSON and print it")
    ap.add_argument("--gpu", choices=sorted(RECORDS), default="H200", help="the record (runtime/arch.py)")
    ap.add_argument("--inference", default=INFERENCE, help="bench_ffn.py JSON ('' skips)")
    ap.add_argument("--decode", default=DECODE, help="bench_ffn.py --decode JSON ('' skips)")
    ap.add_argument("--small-m", default=SMALL_M,
                    help="bench_ffn.py JSON at token counts under min_tokens, gated and non-gated ('' skips)")
    ap.add_argument("--min-decode-picks", type=int, default=MIN_PICKS)
    ap.add_argument("--out", default=None, help="--fit-decode: write the fit as JSON (bench_decode.py --policy)")
    a = ap.parse_args(argv)
    if not (a.check or a.fit_decode):
        ap.error("give --check and/or --fit-decode BENCH_JSON")
    p = RECORDS[a.gpu]
    status = 0
    if a.fit_decode:
        fit = fit_decode(p, decode_points(load_rows(a.fit_decode)))
        print(f"decode cost model fitted to {a.fit_decode} ({p.name} record's terms):")
        print(record_text(fit))
        if a.out:
            Path(a.out).write_text(policy_json(fit))
            print(f"wrote {a.out}")
    if a.check:
        print(f"record {p.name}: {p.measured_on}")
        checks = []
        if a.inference:
            checks.append(check_inference(p, load_rows(a.inference)))
            checks[-1].summary += f" [{a.inference}]"
        if a.small_m and (p.graphs_min_tokens or p.min_tokens) < p.min_tokens:
            checks.append(check_graphs_band(p, load_rows(a.small_m)))
            checks[-1].summary += f" [{a.small_m}]"
        if a.decode:
            rows = load_rows(a.decode)
            checks += [check_decode(p, rows, a.min_decode_picks), check_fit(p, rows)]
            for c in checks[-2:]:
                c.summary += f" [{a.decode}]"
        for c in checks:
            print(c.report())
        bad = [c.name for c in checks if not c.ok]
        print(f"check: {'ok' if not bad else 'FAILED: ' + ', '.join(bad)}")
        status = 1 if bad else 0
    return status


if __name__ == "__main__":
    sys.exit(main())
