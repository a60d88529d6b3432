"""Host (CPU) time per eager call of the inference op against eager's dense FFN and Inductor's
compiled dense FFN, at decode and small prefill sizes, where host time can exceed GPU time.

Each case runs ``--calls`` back-to-back calls with no sync inside the loop: ``host_us`` is the
time to issue one call, ``wall_us`` the time per call once the GPU has finished (max of host and
GPU when the queue stays fed). The variants run interleaved for ``--rounds`` rounds and each
reports its best round (the H200 host's timings of one variant spread by up to 1.5x between
runs). ``op`` replays its own CUDA graph per shape (runtime/decode_graphs.py) where the decode
path runs (and where its dense path is host-bound); ``op_nograph`` is the op with that off
(runtime/launch.py's cached launches), and ``op_standard`` also with Triton's standard launches
(TWELL_TRITON_LAUNCH=standard); both switched around the timing loop, not per call. Inputs:
twell_compile/testing.py, bf16, density 0.005. Rows as benchmarks/rows.py stamps them, to --out
(default runs/<gpu>/host_overhead.json).

    python3 benchmarks/bench_host.py [--M 1 16 64 1024] [--shapes 2048x5632] [--calls 300] [--rounds 5]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):                  # run as a file: python3 benchmarks/bench_host.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.rows import out_path, stamp, write_json  # noqa: E402
from benchmarks.timing import gpu_name  # noqa: E402

import twell_compile.ops  # noqa: E402,F401
from twell_compile.runtime import decode_graphs, decode_state  # noqa: E402
from twell_compile.testing import make_ffn  # noqa: E402


def per_call_us(fn, calls: int) -> tuple[float, float]:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return host / calls * 1e6, wall / calls * 1e6


@contextlib.contextmanager
def variant(name: str):
    """The op's switches for a variant, set around the timing loop (not per call): no graphs of
    its own for op_nograph and op_standard, and Triton's standard launches for op_standard."""
    graphs = decode_graphs.ENABLED and name not in ("op_nograph", "op_standard")
    if name == "op_standard":
        os.environ["TWELL_TRITON_LAUNCH"] = "standard"
    try:
        with decode_graphs.enabled(graphs):
            yield
    finally:
        os.environ.pop("TWELL_TRITON_LAUNCH", None)


def dense(x, wg, wu, wd):
    return F.linear(F.relu(F.linear(x, wg)) * F.linear(x, wu), wd)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--M", type=int, nargs="+", default=[1, 16, 64, 1024])
    ap.add_argument("--shapes", nargs="+", default=["2048x5632", "4096x11008"])
    ap.add_argument("--density", type=float, default=0.005)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the best one counts")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    inductor = torch.compile(dense, dynamic=False)
    rows = []
    names = ("op", "op_nograph", "op_standard", "eager", "inductor")
    print(f"{'K x N':>10} {'M':>5} | host us/call: {'op':>6} {'nogr':>6} {'std':>6} {'eager':>6} {'Ind':>6} | "
          f"wall us/call: {'op':>6} {'nogr':>6} {'std':>6} {'eager':>6} {'Ind':>6}")
    for shape in a.shapes:
        k, n = (int(v) for v in shape.split("x"))
        for m in a.M:
            p = make_ffn(m, k, n, a.density, 0.0, device="cuda", seed=1)
            x, wg, wu, wd = p["x"], p["w_gate"], p["w_up"], p["w_down"]
            decode_state.register(wd)          # as the backend does for a rewritten layer
            layer = f"bench_host/{shape}/{m}"

            def op():
                return torch.ops.twell.ffn(x, wg, None, wu, None, wd, None, layer, False)

            r = stamp({"M": m, "K": k, "N": n, "density": a.density}, "cuda")
            fns = (("op", op), ("op_nograph", op), ("op_standard", op),
                   ("eager", lambda: dense(x, wg, wu, wd)), ("inductor", lambda: inductor(x, wg, wu, wd)))
            best: dict[str, tuple[float, float]] = {}
            with torch.no_grad():
                for _ in range(a.rounds):           # variants interleaved; the best round of each
                    for name, fn in fns:
                        with variant(name):
                            h, w = per_call_us(fn, a.calls)
                        if name not in best or h < best[name][0]:
                            best[name] = (h, w)
            for name, (h, w) in best.items():
                r[f"{name}_host_us"], r[f"{name}_wall_us"] = round(h, 2), round(w, 2)
            rows.append(r)
            print(f"{shape:>10} {m:>5} | {'':>14}" + " ".join(f"{r[v + '_host_us']:6.1f}" for v in names)
                  + f" | {'':>14}" + " ".join(f"{r[v + '_wall_us']:6.1f}" for v in names), flush=True)
            decode_state.clear()
            decode_graphs.clear()
    out = out_path(a.out, gpu_name(), "host_overhead.json")
    write_json(out, rows)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
