"""The 16-layer model of bench_e2e.py, one forward after another: each call's time, the graphs
the op holds, and the kernels and host ops of a few calls by the profiler.

    python3 benchmarks/probes/e2e_calls.py --density 0.02 --backend twell --policy min_tokens=2048

(default mode, 1 x 2048 tokens; bench_e2e.py's flags after ``--``, e.g. ``-- --batch 2``). Per
call: CUDA-event time and wall time, back to back (no L2 flush), and ``decode_graphs.count()``
(the op's own graphs: a call that captures shows it); then the layers' paths, and the profiler's
tables by CUDA time and by self CPU time over ``--profiled`` calls. bench_e2e.py times the same
forward as a median of 10; this probe shows whether a reading is its kernels or its host.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import bench_e2e  # noqa: E402
from benchmarks.timing import policy_changes  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--density", type=float, default=0.005)
    ap.add_argument("--backend", choices=("twell", "inductor"), default="twell")
    ap.add_argument("--policy", nargs="*", default=[], metavar="FIELD=VALUE")
    ap.add_argument("--calls", type=int, default=12)
    ap.add_argument("--profiled", type=int, default=3)
    ap.add_argument("--rows", type=int, default=22, help="rows of each profiler table")
    ap.add_argument("e2e", nargs="*", help="bench_e2e.py flags (after --)")
    a = ap.parse_args(argv)
    if a.calls < 1 or a.profiled < 0:
        ap.error("--calls must be >= 1, --profiled >= 0")
    e = bench_e2e.parse_args(["--forward", "--compile-mode", "default", "--batch", "1", "--seq", "2048",
                              "--no-energy", *a.e2e])
    from twell_compile.runtime import arch, decode_graphs, density

    dev = torch.device(e.device)
    cuda = dev.type == "cuda"
    with arch.patched(**policy_changes(a.policy)), torch.no_grad():
        model = bench_e2e.build_model(e, getattr(torch, e.dtype), e.seed).eval()
        calib = bench_e2e.token_batch(e, e.calib_batch, e.seq, e.seed + 1)
        ids = bench_e2e.token_batch(e, e.batch, e.seq, e.seed + 2)
        bench_e2e.calibrate(model, calib, a.density, contextlib.nullcontext, e.batch)
        compiled = torch.compile(model, dynamic=False, **bench_e2e.compile_kwargs(a.backend, e, None))

        def fn():
            return compiled(input_ids=ids, use_cache=False).logits

        for i in range(a.calls):
            t0 = time.perf_counter()
            if cuda:
                s, t = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                fn()
                t.record()
                torch.cuda.synchronize(dev)
                gpu = f"event {s.elapsed_time(t):9.3f} ms "
            else:
                fn()
                gpu = ""
            print(f"call {i:3d}: {gpu}wall {1e3 * (time.perf_counter() - t0):9.3f} ms, "
                  f"op graphs held {decode_graphs.count()}", flush=True)
        print("paths:", sorted({p for *_, p in density.snapshot()}), "layers with state:", density.layers())
        if a.profiled:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=acts) as prof:
                for _ in range(a.profiled):
                    fn()
                if cuda:
                    torch.cuda.synchronize(dev)
            table = prof.key_averages()
            if cuda:
                print(table.table(sort_by="cuda_time_total", row_limit=a.rows, max_name_column_width=70))
            print(table.table(sort_by="self_cpu_time_total", row_limit=a.rows, max_name_column_width=70))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
