"""Where a training step's GPU time goes, twell against Inductor: bench_e2e.py --train's model
and step (fp32 weights, bf16 autocast, AdamW), torch.profiler over a few steps after warm-up.

    python3 benchmarks/profile_train_step.py --layers 4 --batch 8 --seq 2048 --density 0.005 \
        --twell-opt twell.l1=12 [--warm 12] [--steps 3] [--top 25]

Takes bench_e2e.py's flags (the model, the calibration, --twell-opt). Per backend: the step's
wall time (CUDA events, median of the profiled steps), then its GPU time by kernel, summed over
the profiled steps and divided by them (ms per step), the top --top, and the same grouped into
GEMMs, the twell kernels, Inductor's Triton kernels, the optimizer and the rest.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):                  # run as a file
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import bench_e2e  # noqa: E402

GROUPS = (("GEMM (cuBLAS)", ("gemm", "nvjet", "cutlass", "sm90_xmma", "ampere")),
          ("twell kernels", ("_rows_kernel", "train_", "rank_kernel", "scatter_kernel", "wgrad_kernel",
                             "transpose_kernel", "relu_mul", "row_stats", "densify")),
          ("optimizer", ("multi_tensor", "adam", "foreach")),
          ("Inductor Triton", ("triton_",)),
          ("flash attention", ("flash", "fmha", "attention")))


def group(name: str) -> str:
    low = name.lower()
    for label, keys in GROUPS:
        if any(k in low for k in keys):
            return label
    return "other"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--warm", type=int, default=12)
    ap.add_argument("--prof-steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=25)
    own, rest = ap.parse_known_args(argv)
    a = bench_e2e.parse_args(["--train", *rest])
    dev = torch.device(a.device)
    amp = lambda: torch.autocast("cuda", dtype=torch.bfloat16)  # noqa: E731
    calib = bench_e2e.token_batch(a, a.calib_batch, a.seq, a.seed + 1)
    ids = bench_e2e.token_batch(a, a.batch, a.seq, a.seed + 2)
    master = bench_e2e.build_model(a, torch.float32, a.seed).eval()
    bench_e2e.calibrate(master, calib, a.density[0], amp, a.batch)
    state = {k: v.detach().to("cpu", copy=True) for k, v in master.state_dict().items()}
    del master
    from torch.profiler import ProfilerActivity, profile

    for name in a.backends:
        model = bench_e2e.build_model(a, torch.float32, a.seed + 100)
        model.load_state_dict(state)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
        fwd = torch.compile(model, **bench_e2e.compile_kwargs(name, a, None))
        if name == "twell":
            bench_e2e.reset_twell_policy()

        def step():
            with amp():
                loss = fwd(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(own.warm):
            step()
        torch.cuda.synchronize(dev)
        times = []
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(own.prof_steps):
                ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                ev[0].record()
                step()
                ev[1].record()
                times.append(ev)
            torch.cuda.synchronize(dev)
        wall = statistics.median(s.elapsed_time(e) for s, e in times)
        kernels: dict[str, float] = {}
        for evt in prof.key_averages():
            t = getattr(evt, "self_device_time_total", 0.0) or getattr(evt, "self_cuda_time_total", 0.0)
            if t > 0 and evt.device_type == torch.autograd.DeviceType.CUDA:
                kernels[evt.key] = kernels.get(evt.key, 0.0) + t / 1e3 / own.prof_steps
        total = sum(kernels.values())
        print(f"=== {name}: step {wall:.2f} ms (profiled), GPU kernels {total:.2f} ms per step")
        groups: dict[str, float] = {}
        for k, v in kernels.items():
            groups[group(k)] = groups.get(group(k), 0.0) + v
        for k, v in sorted(groups.items(), key=lambda kv: -kv[1]):
            print(f"  {k:<18} {v:8.2f} ms")
        for k, v in sorted(kernels.items(), key=lambda kv: -kv[1])[:own.top]:
            print(f"    {v:8.3f} ms  {k[:100]}")
        if name == "twell":
            print("  layer densities:", {k: round(v, 4) for k, v in bench_e2e.twell_stats_density().items()})
        del model, opt, fwd
        torch._dynamo.reset()
    return 0


if __name__ == "__main__":
    sys.exit(main())
