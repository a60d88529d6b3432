"""Session 14 probe (H200): where generate() spends a decode step, per backend. bench_e2e's
generate() model (batch 1, 16 layers, d=0.005), compiled as bench_e2e compiles it; after two
warm generate() calls, one more under torch.profiler (CPU + CUDA). In run 7 generate() took
1.976 (Inductor) / 1.884 ms (twell) per step against a step loop of 1.232 / 0.930: twell's
generate() adds 0.95 ms per step to its step loop, Inductor's 0.74. Writes per backend: the
tables of the top ops by self CPU and by device time, kernels per step, device busy time per
step, and the sync calls (argv[1] .json; the tables also go to stdout).

    python3 benchmarks/results/h200/session14/probe_generate.py OUT.json
"""
import copy
import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "session9"))
from probe_io import emit  # noqa: E402  (puts the repo root and benchmarks/ on sys.path)
import torch  # noqa: E402
import transformers  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import bench_e2e as be  # noqa: E402

NEW = 48
a = be.parse_args(["--generate", "--batch", "1", "--seq", "128", "--new-tokens", str(NEW), "--density", "0.005",
                   "--no-energy"])
model = be.build_model(a, torch.bfloat16, a.seed).eval()
calib = be.token_batch(a, a.calib_batch, a.seq, a.seed + 1)
prompt = be.token_batch(a, 1, a.seq, a.seed + 2)
be.calibrate(model, calib, 0.005, contextlib.nullcontext, 16)
for name in ("inductor", "twell"):
    m = copy.deepcopy(model)
    cc = transformers.CompileConfig(**be.compile_kwargs(name, a, "reduce-overhead"))
    if name == "twell":
        be.reset_twell_policy()
    kw = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=NEW, do_sample=False,
              cache_implementation="static", compile_config=cc)
    with torch.no_grad():
        for _ in range(3):
            m.generate(prompt, **kw)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            m.generate(prompt, **kw)
            torch.cuda.synchronize()
    ka = prof.key_averages()
    cpu = ka.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70)
    dev = ka.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=70)
    print(f"===== {name}: by self CPU\n{cpu}\n===== {name}: by device time\n{dev}", flush=True)
    kern = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_us = sum(e.device_time for e in kern) if kern else 0.0
    syncs = {e.key: e.count for e in ka if "ynchronize" in e.key or "Memcpy" in e.key or "item" in e.key
             or "is_nonzero" in e.key or "local_scalar" in e.key}
    emit(dict(backend=name, new_tokens=NEW, kernels=len(kern), kernels_per_step=len(kern) / NEW,
              device_busy_ms_per_step=busy_us / 1e3 / NEW, syncs=syncs,
              top_cpu=[(e.key, e.count, round(e.self_cpu_time_total / 1e3, 3)) for e in
                       sorted(ka, key=lambda e: -e.self_cpu_time_total)[:25]],
              top_dev=[(e.key, e.count, round(e.self_device_time_total / 1e3, 3)) for e in
                       sorted(ka, key=lambda e: -e.self_device_time_total)[:25]]))
    del m
    torch._dynamo.reset()
