"""Session 10 probe: torch.profiler view of eager op calls (CPU ops and GPU kernels) at M = 1,
16, 64, 2048x5632, d = 0.005, W_down registered; where the host time of a call goes.

    PYTHONPATH=. python3 benchmarks/results/h200/session10/probe_trace.py
"""
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[4]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from synthetic import make_ffn  # noqa: E402

import twell_compile.ops  # noqa: E402,F401
from twell_compile.kernels import weight_cache  # noqa: E402

for m in (1, 16, 64):
    p = make_ffn(m, 2048, 5632, 0.005, 0.0, device="cuda", seed=1)
    x, wg, wu, wd = p["x"], p["w_gate"], p["w_up"], p["w_down"]
    weight_cache.register(wd)
    fn = lambda: torch.ops.twell.ffn(x, wg, None, wu, None, wd, None, 128, 16, f"tr/{m}", False)  # noqa: E731
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    for rep in range(3):
        t = time.perf_counter()
        for _ in range(200):
            fn()
        h = (time.perf_counter() - t) / 200 * 1e6
        torch.cuda.synchronize()
        w = (time.perf_counter() - t) / 200 * 1e6
        print(f"M={m} rep {rep}: host {h:.1f} us/call wall {w:.1f}", flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
    print(f"=== M={m}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=8, max_name_column_width=60))
