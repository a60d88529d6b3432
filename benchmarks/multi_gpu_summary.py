"""Summary of benchmarks/run_multi_gpu.sh: one table and the loss agreement, as text and JSON.

    python3 benchmarks/multi_gpu_summary.py --runs OUT/runs --log OUT/run.log --out OUT/multi_gpu_summary.json

Reads one examples/train_ddp.py results file per configuration (``runs/<wrap>_<backend>.json``,
one row; wrap in single / ddp / fsdp2, backend in inductor / twell) and the ``### end <config>
rc=...`` lines of the script's log. One row per configuration: median step time, tokens/s, peak
memory (the largest over ranks), FFNs rewritten per rank, the largest |loss - loss of the 1-GPU
run of the same backend| over the steps both ran (``loss_vs_1gpu``: the comparison in full), and
``settings``, what the runs share. The twell row of each wrapper also carries the speed-up twell
over Inductor (step time ratio), its ratio to the 1-GPU speed-up (CRITERION: >= 0.95, "within
5%") and twell's peak memory over Inductor's. A configuration that failed or was cut keeps its
row, with the rc and ``complete: false`` (its numbers are then from the steps it finished, if
any). Rows as benchmarks/rows.py stamps them (gpu, torch, triton and commit from the run's row
where it has them); the table and the report are printed from the rows (``report``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, Optional

if __package__ in (None, ""):                  # run as a file: python3 benchmarks/multi_gpu_summary.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.rows import schema_errors, stamp, write_json  # noqa: E402

WRAPS = ("single", "ddp", "fsdp2")
BACKENDS = ("inductor", "twell")
CONFIGS = tuple(f"{w}_{b}" for w in WRAPS for b in BACKENDS)
CRITERION = 0.95   # speed-up under a wrapper / single-GPU speed-up: within 5%
LOSS_TOL = 0.02   # |loss_2gpu - loss_1gpu|, bf16 autocast: rounding differs with the split, not the math
_END = re.compile(r"^### end (\S+) rc=(\S+) wall_s=(\d+)")


def read_rcs(log: Optional[Path]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    if log is None or not log.exists():
        return out
    for line in log.read_text(errors="replace").splitlines():
        m = _END.match(line)
        if m:
            rc = m.group(2)
            out[m.group(1)] = {"rc": int(rc) if rc.lstrip("-").isdigit() else rc, "wall_s": int(m.group(3))}
    return out


def read_runs(runs: Path) -> dict[str, dict[str, Any]]:
    """Per configuration the one row of its train_ddp.py results file, or {"error": why not}."""
    out = {}
    for name in CONFIGS:
        path = runs / f"{name}.json"
        if path.exists():
            try:
                data = json.loads(path.read_text())
            except json.JSONDecodeError as e:   # cut while writing
                out[name] = {"error": f"unreadable JSON: {e}"}
                continue
            errors = schema_errors(data) or ([] if len(data) == 1 else [f"{len(data)} rows, not one"])
            out[name] = {"error": f"not a one-row results file: {'; '.join(errors)}"} if errors else data[0]
    return out


def _loss_diff(a: list[float], b: list[float]) -> Optional[dict[str, Any]]:
    n = min(len(a), len(b))
    if n == 0:
        return None
    diffs = [abs(x - y) for x, y in zip(a[:n], b[:n])]
    rel = [d / max(abs(y), 1e-12) for d, y in zip(diffs, b[:n])]
    worst = max(range(n), key=diffs.__getitem__)
    return {"max_abs": round(max(diffs), 6), "max_rel": round(max(rel), 6), "worst_step": worst,
            "steps_compared": n, "per_step_abs": [round(d, 6) for d in diffs]}


def _rewrites(run: dict[str, Any]) -> Optional[list[int]]:
    ranks = run.get("ranks")
    if not ranks:
        return None
    return [len(r.get("rewritten", [])) for r in ranks]


def row_of(name: str, run: Optional[dict[str, Any]], rc: Optional[dict[str, Any]], nproc: int) -> dict[str, Any]:
    wrap, backend = name.split("_")
    row: dict[str, Any] = {"config": name, "wrap": wrap, "backend": backend,
                           "gpus": 1 if wrap == "single" else nproc,
                           "rc": None if rc is None else rc["rc"], "wall_s": None if rc is None else rc["wall_s"]}
    measured = {k: (run or {}).get(k) for k in ("gpu", "torch", "triton", "commit")}
    if not run or "error" in run or "losses" not in run:
        row.update(complete=False, error=(run or {}).get("error", "no JSON (run did not reach its first step)"))
        return stamp(row, **measured)
    ranks = run.get("ranks") or []
    row.update(
        complete=bool(run.get("complete")), steps_done=len(run["losses"]), world=run.get("world"),
        accum=run.get("accum"), median_step_ms=run.get("median_step_ms"),
        tokens_per_s=run.get("tokens_per_s"), first_step_s=run.get("first_step_s"),
        peak_memory_mb=run.get("peak_memory_mb_max", run.get("peak_memory_mb_rank0")),
        peak_memory_mb_per_rank=[r["peak_memory_mb"] for r in ranks] or None,
        ffns_rewritten_per_rank=_rewrites(run),
        ffns_left_to_inductor_per_rank=[len(r.get("left_to_inductor", [])) for r in ranks] or None,
        dynamo_graphs_per_rank=[r.get("dynamo_graphs") for r in ranks] or None,
        ddp_graph_pieces_per_rank=[r.get("ddp_graph_pieces") for r in ranks] if wrap == "ddp" and ranks else None,
        setup_s=run.get("setup_s"), calibration_s=run.get("calibration_s"),
        loss_first=run["losses"][0], loss_last=run["losses"][-1])
    return stamp(row, **measured)


def _fmt(v: Any, spec: str, unit: str = "") -> str:
    return "-" if v is None else f"{format(v, spec)}{unit}"


def table(rows: list[dict[str, Any]], gpu: str) -> str:
    lines = ["| GPUs | wrap | backend | step time | tokens/s | peak memory | FFNs rewritten per rank "
             "| max abs loss diff vs 1 GPU | status |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        wrap = {"single": "none (1 GPU)", "ddp": "DDP", "fsdp2": "FSDP2"}[r["wrap"]]
        backend = "twell (prepared)" if r["backend"] == "twell" else "inductor"
        mem = None if r.get("peak_memory_mb") is None else r["peak_memory_mb"] / 1024
        rw = r.get("ffns_rewritten_per_rank")
        status = "ok" if r.get("complete") and r.get("rc") in (0, None) else \
            f"rc={r.get('rc')}" + (f", {r.get('steps_done', 0)} steps" if "steps_done" in r else "")
        lines.append(f"| {r['gpus']}x {gpu} | {wrap} | {backend} | {_fmt(r.get('median_step_ms'), '.1f', ' ms')} "
                     f"| {_fmt(r.get('tokens_per_s'), ',.0f')} | {_fmt(mem, '.2f', ' GiB')} "
                     f"| {'-' if rw is None else ', '.join(map(str, rw))} "
                     f"| {_fmt(r.get('loss_vs_1gpu_max_abs'), '.2e')} | {status} |")
    return "\n".join(lines)


def short_gpu(gpu: Any) -> str:
    """The table's device label: "H200" of "NVIDIA H200", "cpu" of "cpu: <processor>"."""
    return gpu.replace("NVIDIA ", "").split(":")[0] if isinstance(gpu, str) else "?"


def summarize(runs_dir: Path, log: Optional[Path], nproc: int = 2,
              loss_tol: float = LOSS_TOL) -> list[dict[str, Any]]:
    """One stamped row per configuration found (its run file or its rc line)."""
    runs, rcs = read_runs(runs_dir), read_rcs(log)
    rows = [row_of(n, runs.get(n), rcs.get(n), nproc) for n in CONFIGS if n in runs or n in rcs]
    by = {r["config"]: r for r in rows}
    for wrap in WRAPS[1:]:
        for b in BACKENDS:
            name, ref = f"{wrap}_{b}", f"single_{b}"
            if name in runs and ref in runs and "losses" in runs[name] and "losses" in runs[ref]:
                d = _loss_diff(runs[name]["losses"], runs[ref]["losses"])
                if d is not None:
                    d["within_tol"] = d["max_abs"] <= loss_tol
                    d["steps_both"] = [len(runs[name]["losses"]), len(runs[ref]["losses"])]
                    by[name]["loss_vs_1gpu_max_abs"] = d["max_abs"]
                    by[name]["loss_vs_1gpu"] = d
    for wrap in WRAPS:
        i, t = by.get(f"{wrap}_inductor"), by.get(f"{wrap}_twell")
        if i and t and i.get("median_step_ms") and t.get("median_step_ms"):
            t["speedup_twell_over_inductor"] = round(i["median_step_ms"] / t["median_step_ms"], 4)
        if i and t and i.get("peak_memory_mb") and t.get("peak_memory_mb"):
            t["peak_memory_twell_over_inductor"] = round(t["peak_memory_mb"] / i["peak_memory_mb"], 4)
    single = by.get("single_twell", {}).get("speedup_twell_over_inductor")
    for wrap in WRAPS[1:]:
        t = by.get(f"{wrap}_twell", {})
        if "speedup_twell_over_inductor" in t and single is not None:
            t["speedup_vs_single_gpu"] = round(t["speedup_twell_over_inductor"] / single, 4)
            t["criterion_speedup_ge_95pct_of_single"] = t["speedup_vs_single_gpu"] >= CRITERION
    any_run = next((r for r in runs.values() if "size" in r), {})
    gpu = next((r["gpu"] for r in runs.values() if r.get("gpu")), None) or any_run.get("device", "?")
    keys = ("size", "global_batch", "tokens_per_step", "micro_batch_tokens", "steps", "warmup", "fixed_batch",
            "density_target", "density_calibration_mean", "l1", "bf16", "bucket_cap_mb", "torch", "device")
    settings = {k: any_run.get(k) for k in keys}
    settings.update(gpu=gpu, nproc=nproc, loss_tol=loss_tol, criterion=CRITERION)
    first = runs.get("single_inductor", {}).get("density_first_batch")
    if first:
        settings["density_first_batch_mean"] = round(sum(first) / len(first), 6)
    for row in rows:
        row["settings"] = dict(settings)
    return rows


def report(rows: list[dict[str, Any]]) -> str:
    """The printed summary: the runs' settings, the table, per wrapper the speed-ups, the loss agreement."""
    st = rows[0]["settings"] if rows else {}
    size = st.get("size") or {}
    by = {r["config"]: r for r in rows}
    out = [f"multi-GPU training: {size.get('layers')} layers, hidden {size.get('hidden')}, ffn {size.get('ffn')}, "
           f"{st.get('tokens_per_step')} tokens/step ({st.get('micro_batch_tokens')} per GPU per call), "
           f"{st.get('steps')} steps, density target {st.get('density_target')} (first batch "
           f"{st.get('density_first_batch_mean')}), l1 {st.get('l1')}, {st.get('gpu')}", "",
           table(rows, short_gpu(st.get("gpu"))), ""]
    for wrap in WRAPS:
        t = by.get(f"{wrap}_twell", {})
        line = f"speed-up twell / inductor, {wrap}: {_fmt(t.get('speedup_twell_over_inductor'), '.3f', 'x')}"
        if "speedup_vs_single_gpu" in t:
            ok = t["criterion_speedup_ge_95pct_of_single"]
            line += (f" = {t['speedup_vs_single_gpu']:.3f} of the 1-GPU speed-up "
                     f"({'>=' if ok else '<'} {st['criterion']})")
        mem = t.get("peak_memory_twell_over_inductor")
        if mem is not None:
            line += f"; peak memory twell / inductor {mem:.3f}"
        out.append(line)
    for name, d in ((r["config"], r["loss_vs_1gpu"]) for r in rows if "loss_vs_1gpu" in r):
        out.append(f"loss {name} vs 1 GPU: max |diff| {d['max_abs']:.2e} (step {d['worst_step']}), max rel "
                   f"{d['max_rel']:.2e} over {d['steps_compared']} steps: "
                   f"{'within' if d['within_tol'] else 'OUTSIDE'} {st['loss_tol']}")
    return "\n".join(out)


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", required=True, type=Path, help="folder of <config>.json from examples/train_ddp.py")
    ap.add_argument("--log", type=Path, default=None, help="the script's log (### end <config> rc=... lines)")
    ap.add_argument("--out", type=Path, default=None, help="write the summary JSON here")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--loss-tol", type=float, default=LOSS_TOL)
    a = ap.parse_args(argv)
    rows = summarize(a.runs, a.log, a.nproc, a.loss_tol)
    print(report(rows), flush=True)
    if a.out:
        write_json(a.out, rows)
        print(f"wrote {a.out}")
    return rows


if __name__ == "__main__":
    main()
