"""Does Python's garbage collector stall the training op's eager step? Per-step times of
``torch.ops.twell.ffn_train`` forward + ``torch.autograd.grad`` (bench_ffn_train.py's step, its
inputs), with the collector on and off, alternating rounds in one process, and every collection
that ran inside a timed loop (``gc.callbacks``: its generation and host duration).

    python3 benchmarks/probes/step_host.py --M 16384 --steps 200 --rounds 2 --out runs/step_host.json
    python3 benchmarks/probes/step_host.py --M 64 --K 64 --N 160 --steps 20     # CPU: plain PyTorch path

Why: bench_ffn_train.py's auto-path column read 3.16-5.18 ms between runs of one code on one
H100 while the forced path's held (results/h100/ffn_training_ab.json): a step there spends
about as much host time as GPU time, and a full collection walks every tracked object (285k
in a probe process that had run the step; its length here unmeasured), a stall do_bench's
per-step events would spread over the steps around it. This probe tells that apart from other
host noise.

A loop issues ``--steps`` steps without synchronizing (as do_bench does; ``--flush`` adds its L2
flush, a 256 MB memset before each step, outside the step's events: train_parts.py's auto step
read 0.34 ms over the forced one under do_bench, equal in a plain loop) and records a CUDA event
pair per step (the host clock on the CPU); mode "gc_off" runs it under
``gc.disable()`` after a ``gc.collect()``, mode "gc_on" after the same collection with the
collector as the process has it. Rows (benchmarks/rows.py's stamp, then): M, K, N, density,
path, mode, flush, round, steps, median_ms, p90_ms, max_ms, mean_ms, loop_ms (the loop's wall time per
step, synchronized at its end), collections (count per generation 0-2), gc_ms (their summed
host time). Probe code: it ships nothing.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.rows import save_rows, stamp  # noqa: E402
from benchmarks.timing import gpu_name, train_inputs  # noqa: E402

import twell_compile.ops  # noqa: E402,F401  (registers torch.ops.twell)
from twell_compile.config import TwellConfig  # noqa: E402


class Collections:
    """gc.callbacks recorder: (generation, host ms) of each collection while ``on``."""

    def __init__(self) -> None:
        self.on, self.seen, self._t0 = False, [], 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if not self.on:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seen.append((info["generation"], 1e3 * (time.perf_counter() - self._t0)))


def timed_loop(step: Callable[[], object], steps: int, cuda: bool,
               flush: Optional[torch.Tensor] = None) -> tuple[list[float], float]:
    """(ms per step, the loop's wall ms per step): steps issued back to back; ``flush``: zeroed
    before each step, outside its events (do_bench's L2 flush)."""
    if cuda:
        torch.cuda.synchronize()
        evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
        t0 = time.perf_counter()
        for a, b in evs:
            if flush is not None:
                flush.zero_()
            a.record()
            step()
            b.record()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3 / steps
        return [a.elapsed_time(b) for a, b in evs], wall
    t, t0 = [], time.perf_counter()
    for _ in range(steps):
        s = time.perf_counter()
        step()
        t.append(1e3 * (time.perf_counter() - s))
    return t, (time.perf_counter() - t0) * 1e3 / steps


def run(args) -> list[dict]:
    cuda = torch.cuda.is_available() and not args.cpu
    dev = torch.device("cuda" if cuda else "cpu")
    cfg = TwellConfig()
    dt = torch.bfloat16
    x, wg, wu, wd, dy = train_inputs(args.M, args.K, args.N, args.density, 0.0, 1234, dev, dt)
    params = (x, wg, wu, wd)

    def step():
        y = torch.ops.twell.ffn_train(x, wg, None, wu, None, wd, None, cfg.ell_width, cfg.backup_rows, 0.0,
                                      "step_host", False, path=args.path)[0]
        return torch.autograd.grad(y, params, dy)

    for _ in range(args.warmup):
        step()
    # do_bench's L2 flush: 256 MB zeroed before each timed step
    flush = torch.empty(256 * 2 ** 20, dtype=torch.int8, device=dev) if args.flush and cuda else None
    rec = Collections()
    gc.callbacks.append(rec)
    rows = []
    try:
        for r in range(args.rounds):
            for mode in ("gc_on", "gc_off"):
                gc.collect()
                was = gc.isenabled()
                if mode == "gc_off":
                    gc.disable()
                rec.seen, rec.on = [], True
                try:
                    t, wall = timed_loop(step, args.steps, cuda, flush)
                finally:
                    rec.on = False
                    if was:
                        gc.enable()
                q = sorted(t)
                per_gen = [sum(1 for g, _ in rec.seen if g == i) for i in range(3)]
                row = stamp(dict(M=args.M, K=args.K, N=args.N, density=args.density, path=args.path, mode=mode,
                                 flush=flush is not None,
                                 round=r + 1, steps=args.steps, median_ms=statistics.median(t),
                                 p90_ms=q[int(0.9 * (len(q) - 1))], max_ms=q[-1], mean_ms=statistics.fmean(t),
                                 loop_ms=wall, collections=per_gen, gc_ms=sum(ms for _, ms in rec.seen)), dev)
                rows.append(row)
                print(f"round {r + 1} {mode:6}  median {row['median_ms']:7.3f}  p90 {row['p90_ms']:7.3f}  "
                      f"max {row['max_ms']:8.3f}  mean {row['mean_ms']:7.3f}  loop {wall:7.3f} ms/step  "
                      f"collections {per_gen} ({row['gc_ms']:.1f} ms)", flush=True)
    finally:
        gc.callbacks.remove(rec)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--M", type=int, default=16384)
    ap.add_argument("--K", type=int, default=2048)
    ap.add_argument("--N", type=int, default=5632)
    ap.add_argument("--density", type=float, default=0.005)
    ap.add_argument("--path", default="auto", help="the op's path= (auto, twell, ...)")
    ap.add_argument("--steps", type=int, default=200, help="steps per timed loop")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2, help="gc_on / gc_off loops alternating, this many each")
    ap.add_argument("--flush", action="store_true", help="zero 256 MB before each step, as do_bench does (CUDA)")
    ap.add_argument("--cpu", action="store_true", help="on the CPU even where CUDA is available")
    ap.add_argument("--out", default=None, help="JSON path (default runs/<tag>/step_host.json)")
    a = ap.parse_args(argv)
    for name in ("M", "K", "N", "steps", "rounds"):
        if getattr(a, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(a, name)}")
    if a.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {a.warmup}")
    cuda = torch.cuda.is_available() and not a.cpu
    if a.flush and not cuda:
        raise ValueError("--flush times do_bench's L2 flush on a GPU: drop it on the CPU (or --cpu)")
    rows = run(a)
    save_rows(rows, a.out, gpu_name() if cuda else "cpu", "step_host.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
