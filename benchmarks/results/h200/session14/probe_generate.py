"""Session 14 probe (H200): where generate() spends a decode step, per backend. bench_e2e's
generate() model (batch 1, 16 layers, d=0.005), compiled as bench_e2e compiles it; after two
warm generate() calls, one more under torch.profiler (CPU + CUDA). In run 7 generate() took
1.976 (Inductor) / 1.884 ms (twell) per step against a step loop of 1.232 / 0.930: twell's
generate() adds 0.95 ms per step to its step loop, Inductor's 0.74. Writes per backend: the
tables of the top ops by self CPU and by device time, kernels per step, device busy time per
step, and the sync calls (argv[1] .json; the tables also go to stdout).

    python3 benchmarks/results/h200/session14/probe_generate.py OUT.json [BATCH ...]

Run 11 adds batch 16 (run 10: generate() 2.265 vs 2.417 ms per step, twell slower, while its
step loop is 1.19x faster), the wall time of a plain and of the profiled call, and counts of
CUDA-graph recording and capture events, Dynamo recompiles and the op's own decode graphs.
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "session9"))
from probe_io import backend_generate, calibrated_model, emit  # noqa: E402  (puts the repo root and benchmarks/ on sys.path)
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import bench_e2e as be  # noqa: E402

NEW = 48
BATCHES = [int(v) for v in sys.argv[2:]] or [1]
a, model = calibrated_model(max(BATCHES), NEW)
prompts = {b: be.token_batch(a, b, a.seq, a.seed + 2) for b in BATCHES}
for (batch, prompt), name in ((bp, nm) for bp in prompts.items() for nm in ("inductor", "twell")):
    from torch._dynamo.utils import counters
    from twell_compile.kernels import decode_graphs
    counters.clear()
    m, kw = backend_generate(name, a, model, prompt)
    with torch.no_grad():
        for _ in range(3):
            m.generate(prompt, **kw)
        torch.cuda.synchronize()
        graphs0 = len(decode_graphs._graphs)
        walls = []
        for _ in range(3):
            t0 = time.perf_counter()
            m.generate(prompt, **kw)
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            m.generate(prompt, **kw)
            torch.cuda.synchronize()
    prof_ms = (time.perf_counter() - t0) * 1e3
    ka = prof.key_averages()
    cpu = ka.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70)
    dev = ka.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=70)
    print(f"===== {name} batch {batch}: by self CPU\n{cpu}\n===== {name}: by device time\n{dev}", flush=True)
    kern = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_us = sum(e.device_time for e in kern) if kern else 0.0
    syncs = {e.key: e.count for e in ka if "ynchronize" in e.key or "Memcpy" in e.key or "item" in e.key
             or "is_nonzero" in e.key or "local_scalar" in e.key}
    events = {e.key: e.count for e in ka if any(w in e.key for w in ("record", "Instantiate", "Capture", "warmup",
                                                                          "Cache Lookup", "cudaGraphLaunch"))}
    emit(dict(backend=name, batch=batch, new_tokens=NEW, generate_wall_ms=sorted(walls)[1], profiled_wall_ms=prof_ms,
              events=events, recompiles=dict(counters["recompiles"]), stats=dict(counters["stats"]),
              op_graphs_before=graphs0, op_graphs_after=len(decode_graphs._graphs), kernels=len(kern), kernels_per_step=len(kern) / NEW,
              device_busy_ms_per_step=busy_us / 1e3 / NEW, syncs=syncs,
              top_cpu=[(e.key, e.count, round(e.self_cpu_time_total / 1e3, 3)) for e in
                       sorted(ka, key=lambda e: -e.self_cpu_time_total)[:25]],
              top_dev=[(e.key, e.count, round(e.self_device_time_total / 1e3, 3)) for e in
                       sorted(ka, key=lambda e: -e.self_device_time_total)[:25]]))
    del m
    torch._dynamo.reset()
