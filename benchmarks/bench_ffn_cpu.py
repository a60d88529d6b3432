"""CPU inference FFN benchmark: twell (C++ kernel) vs eager dense vs Inductor dense, one run.

    python -m benchmarks.bench_ffn_cpu                      # full grid, fp32, threads 1 and all
    python -m benchmarks.bench_ffn_cpu --m 1,16 --density 0.005 --threads all
    python -m benchmarks.bench_ffn_cpu --shapes 256x704,1024x2816 --path cpu   # the kernel at any size

Shapes: K x N (default 2048x5632, the paper's 1.5B FFN; K_out = K), gated, inputs from the
anchors generator. ``--path`` is the op's (default "auto": the CPU record decides, as a user's
model gets; "cpu" forces the C++ kernel).
Each (M, density, threads) point times the four calls interleaved, round after round, and keeps
medians: on a shared 2-core machine load comes and goes, and interleaving spreads it evenly.
Rows as benchmarks/rows.py stamps them (keys as the GPU file, plus threads, dtype, measured
density, ``op_path`` (the plan's path for the call: "cpu" the C++ kernel, "torch" eager's calls)
and ``path`` (what the kernel does inside: "sparse", or "dense" above the CPU record's
max_density), to --out (default runs/cpu-<model>/ffn_inference.json; the canonical file:
benchmarks/results/README.md). ``benchmarks/bench_ffn.py --device cpu`` delegates here through
``main(argv)``.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch
import torch.nn.functional as F

if __package__ in (None, ""):                  # run as a file: python3 benchmarks/bench_ffn_cpu.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.rows import out_path, processor, stamp, write_json  # noqa: E402

import twell_compile.ops  # noqa: E402,F401  (registers torch.ops.twell)
from twell_compile.reference import ffn_dense  # noqa: E402
from twell_compile.runtime import arch, cpu_ffn, select  # noqa: E402
from twell_compile.testing import make_ffn  # noqa: E402  (the anchors.md generator, as the GPU bench)

K, N = 2048, 5632


def cpu_model() -> str:
    """A short directory-safe CPU name, e.g. 'intel-xeon-processor'."""
    name = re.sub(r"\((r|tm)\)", "", processor().lower())
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "unknown"


def _dense(x, w_gate, w_up, w_down):
    return ffn_dense(x, w_gate, None, w_up, None, w_down, None)


def _twell(x, w_gate, w_up, w_down, path="auto"):
    return torch.ops.twell.ffn(x, w_gate, None, w_up, None, w_down, None, "bench", False, 0, path)


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).norm() / ref.norm())


def _time_interleaved(fns: dict[str, Callable[[], object]], budget_s: float, min_rounds: int = 3,
                      max_rounds: int = 25) -> dict[str, float]:
    """Median milliseconds per function, timed round-robin until the budget or max_rounds."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    start = time.perf_counter()
    rounds = 0
    while rounds < min_rounds or (rounds < max_rounds and time.perf_counter() - start < budget_s):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
        rounds += 1
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def run_grid(ms: Iterable[int] = (1, 16, 256, 2048), densities: Iterable[float] = (0.005, 0.02, 0.05, 0.2),
             threads: Iterable[int] = (1, 0), dtype: torch.dtype = torch.float32, tail: float = 0.0,
             budget_s: float = 6.0, log: Optional[Callable[[str], None]] = print,
             shapes: Iterable[tuple[int, int]] = ((K, N),), path: str = "auto") -> list[dict]:
    """Benchmark every point; threads 0 means all cores. Returns the result rows."""
    all_threads = os.cpu_count() or 1
    thread_list = [t if t > 0 else all_threads for t in threads]
    rows: list[dict] = []
    saved = torch.get_num_threads()
    try:
        for (k, n), m, d in ((s, m, d) for s in shapes for m in ms for d in densities):
            f = make_ffn(m, k, n, d, tail=tail, dtype=dtype, device="cpu")
            torch._dynamo.reset()         # a fresh compile per point: past 8 shapes Dynamo would run eager
            inductor = torch.compile(_dense, dynamic=False)
            x, w_gate, w_up, w_down = f["x"], f["w_gate"], f["w_up"], f["w_down"]
            ref = _dense(*(t.double() for t in (x, w_gate, w_up, w_down)))
            with torch.no_grad():
                y_dense = _dense(x, w_gate, w_up, w_down)
                y_twell = _twell(x, w_gate, w_up, w_down, path)
                op_path = select.plan_infer(x, n, k, True, "bench", path).path
                measured = float((F.linear(x, w_gate) > 0).float().mean())
            err, dense_err = _rel_err(y_twell, ref), _rel_err(y_dense, ref)
            del ref
            for t in thread_list:
                torch.set_num_threads(t)
                with torch.no_grad():
                    fns = {
                        "dense": lambda: _dense(x, w_gate, w_up, w_down),
                        "inductor": lambda: inductor(x, w_gate, w_up, w_down),
                        "gate": lambda: F.linear(x, w_gate),
                        "twell": lambda: _twell(x, w_gate, w_up, w_down, path),
                    }
                    for fn in fns.values():  # warm-up: compile, build, weight caches
                        fn()
                    ms_ = _time_interleaved(fns, budget_s)
                row = stamp({
                    "M": m, "K": k, "N": n, "density": d, "tail": tail, "op_path": op_path,
                    "dense_ms": round(ms_["dense"], 3), "inductor_ms": round(ms_["inductor"], 3),
                    "gate_ms": round(ms_["gate"], 3), "twell_ms": round(ms_["twell"], 3),
                    "rel_err": err, "dense_rel_err": dense_err, "threads": t,
                    "dtype": str(dtype).replace("torch.", ""), "measured_density": round(measured, 5),
                    "path": "dense" if measured > arch.policy_for("cpu").max_density(m) else "sparse",
                    "speedup_vs_inductor": round(ms_["inductor"] / ms_["twell"], 3),
                }, "cpu")
                rows.append(row)
                if log:
                    log(f"K={k:5d} N={n:5d} M={m:5d} d={d:<6} T={t} {op_path:5s} dense {row['dense_ms']:9.3f} "
                        f"inductor {row['inductor_ms']:9.3f} "
                        f"gate {row['gate_ms']:9.3f} twell {row['twell_ms']:9.3f} "
                        f"x{row['speedup_vs_inductor']:.2f} ({row['path']}) err {err:.1e} / {dense_err:.1e}")
    finally:
        torch.set_num_threads(saved)
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu"], help="accepted for bench_ffn.py's delegation")
    ap.add_argument("--m", default="1,16,256,2048")
    ap.add_argument("--shapes", default=f"{K}x{N}", help="comma list of KxN (K_out = K)")
    ap.add_argument("--path", default="auto", choices=["auto", "cpu"], help="the op's path")
    ap.add_argument("--density", default="0.005,0.02,0.05,0.2")
    ap.add_argument("--threads", default="1,all", help="comma list; 'all' = every core")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--tail", type=float, default=0.0)
    ap.add_argument("--budget", type=float, default=6.0, help="seconds of timing per point (>= 3 rounds)")
    ap.add_argument("--out", default=None, help="JSON path (default runs/cpu-<model>/ffn_inference.json)")
    args = ap.parse_args(argv)
    print(f"twell CPU implementation: {cpu_ffn.active_impl()}; cores {os.cpu_count()}; "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    rows = run_grid(
        ms=[int(v) for v in args.m.split(",")],
        densities=[float(v) for v in args.density.split(",")],
        threads=[0 if v == "all" else int(v) for v in args.threads.split(",")],
        dtype=getattr(torch, args.dtype), tail=args.tail, budget_s=args.budget,
        log=lambda s: print(s, flush=True), path=args.path,
        shapes=[tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")])
    out = out_path(args.out, f"cpu-{cpu_model()}", "ffn_inference.json")
    write_json(out, rows)
    print(f"load average after: {os.getloadavg()[0]:.2f}; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
