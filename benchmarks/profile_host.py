"""Host (Python) cost per call of the twell ops, by function: cProfile over N eager calls of
the inference op (M = 1, 64, 1024) and the training op's forward + backward (M = 1024), after
warm-up, with the GPU synchronised only at the end. Compare ``wall us/call`` with the kernels'
GPU time to see whether a size is host-bound.

    python3 benchmarks/profile_host.py [--calls 200] [--top 25] [--cases infer:1 train:16384 ...]
        [--path twell]

``--cases KIND:M``: which op (infer or train) at how many tokens; ``--path``: the path the op is
forced to (default auto: its rules pick).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

import torch

import twell_compile.ops  # noqa: F401
from twell_compile.testing import make_ffn


def parse_case(text: str) -> tuple[str, int]:
    """"train:16384" -> ("train", 16384); a clear error for anything else."""
    kind, _, m = text.partition(":")
    if kind not in ("infer", "train") or not m.isdigit() or int(m) < 1:
        raise argparse.ArgumentTypeError(f"--cases takes KIND:M with KIND infer or train and M >= 1, got {text!r}")
    return kind, int(m)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--cases", nargs="+", type=parse_case, metavar="KIND:M",
                    default=[("infer", 1), ("infer", 64), ("infer", 1024), ("train", 1024)],
                    help="infer or train, and the tokens per call")
    ap.add_argument("--path", default="auto", help="the path the ops are forced to (twell.path's values)")
    a = ap.parse_args(argv)
    k, n = 2048, 5632
    cases = a.cases
    for kind, m in cases:
        p = make_ffn(m, k, n, 0.005, 0.0, device="cuda", seed=1)
        args7 = [p["x"], p["w_gate"], None, p["w_up"], None, p["w_down"], None]
        if kind == "infer":
            fn = lambda: torch.ops.twell.ffn(*args7, f"prof/{m}", False, path=a.path)
        else:
            leaves = [t.requires_grad_() if t is not None else None for t in args7]
            dy = torch.randn(m, k, device="cuda", dtype=p["x"].dtype)
            params = [t for t in leaves if t is not None]

            def fn():
                y = torch.ops.twell.ffn_train(*leaves, 256, 16, 0.0, f"prof/t{m}", False, path=a.path)[0]
                return torch.autograd.grad(y, params, dy)
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(a.calls):
            fn()
        plain_host = (time.perf_counter() - t0) / a.calls * 1e6
        torch.cuda.synchronize()
        plain_wall = (time.perf_counter() - t0) / a.calls * 1e6
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        for _ in range(a.calls):
            fn()
        prof.disable()
        host = (time.perf_counter() - t0) / a.calls * 1e6
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / a.calls * 1e6
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(a.top)
        print(f"=== {kind} M={m}: unprofiled host {plain_host:.0f} us/call, wall {plain_wall:.0f}; "
              f"profiled host {host:.0f}, wall {wall:.0f}")
        print("\n".join(s.getvalue().splitlines()[:a.top + 12]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
