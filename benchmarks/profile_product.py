"""Where the product's time goes against the op's: one FFN point, the module compiled with
backend="twell" beside the op called directly and the module under Inductor.

    python3 benchmarks/profile_product.py --M 8192 --density 0.005 [--calls 200] [--top 15]
    python3 benchmarks/profile_product.py --M 4096 --policy min_tokens=4096   # a record's field changed
    python3 benchmarks/profile_product.py --M 2048 --down-layout transposed  # W_down stored transposed
    python3 benchmarks/profile_product.py --M 8192 --non-gated     # down(relu(gate(x))) (testing.PlainMLP)
    python3 benchmarks/profile_product.py --M 4096 --activity benchmarks/profiles/h100_activity.json:model.layers.3.mlp

Variants: the compiled module (product), the op it calls called directly without statistics (op)
and with them (op_stats, as the module calls it: the difference between op and op_stats is the
statistics' cost, between op_stats and product the module's own), Inductor's module (inductor).
Per variant: the path it ran (the product's from its own op instance's state), host us per call
(calls issued back to back, no sync), wall us per call (then synchronised), whether a call syncs
(torch.cuda.set_sync_debug_mode("error") around one call), and torch.profiler's top ops by CUDA
and by CPU time over --calls calls; then cProfile's top Python functions of the --cprofile variants' calls
(the product's by default).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):                  # run as a file
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.timing import policy_changes  # noqa: E402

import twell_compile  # noqa: E402,F401  (backend="twell")
from twell_compile.runtime import arch, density  # noqa: E402
from twell_compile.testing import GatedMLP, PlainMLP, make_ffn_for, parse_activity  # noqa: E402


def per_call_us(fn, calls: int) -> tuple[float, float]:
    """(host us per call, wall us per call) over ``calls`` calls issued back to back. Where the
    GPU time per call exceeds the host time, the launches fill the launch queue and the host
    then waits on the GPU: Inductor's module read 108 us of host time at 2048 tokens and 203 at
    4096 for the same host work (H100). Host times sampled otherwise read higher still on the
    device's hosts: bursts of 8 calls after a synchronisation 1.6x (172.6 us at 2048), behind a
    GPU sleep 1.7x (189.2), the op's graphed call 89 and 161 us against 52 back to back."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return host, (time.perf_counter() - t0) / calls * 1e6


def syncs(fn) -> str:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return "no"
    except RuntimeError as e:
        return f"yes ({str(e).splitlines()[0][:80]})"
    finally:
        torch.cuda.set_sync_debug_mode("default")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--M", type=int, default=8192)
    ap.add_argument("--K", type=int, default=2048)
    ap.add_argument("--N", type=int, default=5632)
    ap.add_argument("--density", type=float, default=0.005)
    ap.add_argument("--tail", type=float, default=0.0)
    ap.add_argument("--activity", default="iid", metavar="iid|PROFILE.json[:LAYER]|checkpoint:PATH",
                    help="the inputs' activity, as bench_ffn.py's (a profile's or checkpoint's own "
                         "density; --density and --tail apply to iid only)")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--host-only", action="store_true",
                    help="print the paths and the host / wall times only (no profiler tables, no cProfile)")
    ap.add_argument("--cprofile", nargs="*", default=["product"], choices=("product", "op", "op_stats", "inductor"),
                    help="the variants whose Python functions cProfile lists (default: product)")
    ap.add_argument("--policy", nargs="*", default=[], metavar="FIELD=VALUE",
                    help="run with these fields of the GPU record replaced (arch.patched)")
    ap.add_argument("--non-gated", action="store_true",
                    help="the non-gated FFN down(relu(gate(x))) (testing.PlainMLP) in every variant")
    ap.add_argument("--down-layout", choices=("linear", "transposed"), default="linear",
                    help="W_down's storage: nn.Linear's [K_out, N] rows, or [N, K_out] rows behind the same "
                         "shape (the per-row kernels then read it without a per-call transpose); both modules")
    a = ap.parse_args(argv)
    try:
        parse_activity(a.activity)
    except ValueError as e:
        ap.error(str(e))
    with arch.patched(**policy_changes(a.policy)):
        return _run(a)


def modules(a, device: str = "cuda") -> tuple[torch.Tensor, list[torch.nn.Module]]:
    """The point's x and two bf16 copies of its FFN module (GatedMLP or PlainMLP, with biases
    where the inputs carry them), weights from ``a.activity``'s generator."""
    p = make_ffn_for(a.activity, a.M, a.K, a.N, a.density, a.tail, gated=not a.non_gated, device=device, seed=7)
    bias = p["b_gate"] is not None            # a checkpoint's FFN may carry biases
    mods = [(PlainMLP if a.non_gated else GatedMLP)(a.K, a.N, bias=bias).to(device, torch.bfloat16)
            for _ in range(2)]
    with torch.no_grad():
        for m in mods:
            for lin, w, b in ((m.gate, "w_gate", "b_gate"), (None if a.non_gated else m.up, "w_up", "b_up"),
                              (m.down, "w_down", "b_down")):
                if lin is not None:
                    lin.weight.copy_(p[w])
                    if bias:
                        lin.bias.copy_(p[b])
            if a.down_layout == "transposed":
                m.down.weight.data = m.down.weight.detach().t().contiguous().t()
    return p["x"], mods


def _run(a) -> int:
    torch.set_grad_enabled(False)
    x, mods = modules(a)
    tw = torch.compile(mods[0], backend="twell", dynamic=False)
    ind = torch.compile(mods[1], dynamic=False)
    w = mods[0]
    args7 = (x, w.gate.weight, w.gate.bias, None if a.non_gated else w.up.weight,
             None if a.non_gated else w.up.bias, w.down.weight, w.down.bias)
    fns = {"product": lambda: tw(x), "op": lambda: torch.ops.twell.ffn(*args7, "profile/op", False),
           "op_stats": lambda: torch.ops.twell.ffn(*args7, "profile/op_stats", True), "inductor": lambda: ind(x)}
    for fn in fns.values():
        for _ in range(40):
            fn()
    torch.cuda.synchronize()
    paths = {(key[0] if inst == 0 else f"product (op instance {inst})"): path
             for inst, key, _, path in density.snapshot()}
    point = f"d={a.density} tail={a.tail}" if a.activity == "iid" else f"activity {a.activity}"
    print(f"M={a.M} K={a.K} N={a.N} {point} {'non-gated' if a.non_gated else 'gated'} "
          f"W_down {a.down_layout} "
          f"policy {a.policy} on {torch.cuda.get_device_name()}")
    print("paths:", paths)
    for name, fn in fns.items():
        host, wall = per_call_us(fn, a.calls)
        print(f"{name:>9}: host {host:7.1f} us/call, wall {wall:7.1f} us/call, syncs: {syncs(fn)}")
    if a.host_only:
        return 0
    from torch.profiler import ProfilerActivity, profile

    for name, fn in fns.items():
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(a.calls):
                fn()
            torch.cuda.synchronize()
        ka = prof.key_averages()
        print(f"=== {name}: by CUDA time")
        print(ka.table(sort_by="cuda_time_total", row_limit=a.top, max_name_column_width=60))
        print(f"=== {name}: by CPU time")
        print(ka.table(sort_by="self_cpu_time_total", row_limit=a.top, max_name_column_width=60))
    import cProfile
    import io
    import pstats

    for name in a.cprofile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(a.calls):
            fns[name]()
        prof.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(a.top)
        print(f"=== {name}: cProfile over {a.calls} calls")
        print("\n".join(s.getvalue().splitlines()[:a.top + 12]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
