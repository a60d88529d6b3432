"""Where a training step's GPU time goes, twell against Inductor: bench_e2e.py --train's model
and step (fp32 weights, bf16 autocast, AdamW), torch.profiler over a few steps after warm-up.

    python3 benchmarks/profile_train_step.py --layers 4 --batch 8 --seq 2048 --density 0.005 \
        --twell-opt twell.l1=12 [--warm 12] [--prof-steps 3] [--top 25] [--neurons] \
        [--policy wg_chunk=256 ...]

Takes bench_e2e.py's flags (the model, the calibration, --twell-opt). Per backend: the step's
wall time (CUDA events, median of the profiled steps), then its GPU time by kernel, summed over
the profiled steps and divided by them (ms per step), the top --top, and the same grouped into
GEMMs, the twell kernels, Inductor's Triton kernels, the optimizer and the rest. --neurons: after
twell's steps, each layer's per-neuron activity on the batch (a forward hook on gate_proj):
tokens per neuron (mean, median, p99, max), dead neurons, and the share of active (token,
neuron) pairs held by the busiest 1% and 10% of neurons. --policy: twell runs with these fields
of the GPU record replaced (arch.patched).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):                  # run as a file
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import activity_profile, bench_e2e  # noqa: E402
from benchmarks.timing import policy_changes  # noqa: E402
from twell_compile.config import TwellConfig  # noqa: E402
from twell_compile.runtime import arch  # noqa: E402

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


def neuron_activity(model, ids: torch.Tensor, amp) -> None:
    """Per layer: how the active (token, neuron) pairs of relu(gate_proj(x)) spread over neurons
    (activity_profile.activity's hooks), and the rows busier than the default ELL width (the
    dense backup holds M / backup_rows of them; the rest are recomputed per neuron in the sparse
    backward)."""
    cfg = TwellConfig()
    tokens = ids.numel()
    for name, act in activity_profile.activity(model, ids, amp).items():
        on = act.reshape(tokens, -1)
        c = on.sum(0).double()
        n, total = c.numel(), float(c.sum())
        top = c.sort(descending=True).values
        busy = int((on.sum(1) > cfg.ell_width).sum())
        print(f"  {name}: density {total / (n * tokens):.4f}; tokens per neuron mean {float(c.mean()):.0f} "
              f"median {float(c.median()):.0f} p99 {float(top[n // 100]):.0f} max {float(c.max()):.0f}; "
              f"dead {float((c == 0).double().mean()):.1%}; busiest 1% hold {float(top[:n // 100].sum()) / total:.1%}, "
              f"10% {float(top[:n // 10].sum()) / total:.1%} of pairs; rows over ELL width {cfg.ell_width}: "
              f"{busy} (backup {-(-tokens // cfg.backup_rows)})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--warm", type=int, default=12)
    ap.add_argument("--prof-steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--neurons", action="store_true", help="per-neuron activity of each layer after twell's steps")
    ap.add_argument("--policy", nargs="*", default=[], metavar="FIELD=VALUE")
    own, rest = ap.parse_known_args(argv)
    with arch.patched(**policy_changes(own.policy)):
        return _run(own, rest)


def _run(own, rest) -> int:
    a = bench_e2e.parse_args(["--train", *rest])
    dev = torch.device(a.device)
    amp = lambda: torch.autocast("cuda", dtype=torch.bfloat16)  # noqa: E731
    ids = bench_e2e.token_batch(a, a.batch, a.seq, a.seed + 2)
    state = bench_e2e.cpu_state(bench_e2e.calibrated_model(a, amp)[0])
    from torch.profiler import ProfilerActivity, profile

    for name in a.backends:
        model, opt, fwd = bench_e2e.training_setup(a, state, name)

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
            if own.neurons:
                neuron_activity(model, ids, amp)
        del model, opt, fwd
        torch._dynamo.reset()
    return 0


if __name__ == "__main__":
    sys.exit(main())
