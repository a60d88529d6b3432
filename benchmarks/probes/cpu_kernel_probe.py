"""The CPU kernel's design choices timed side by side, in one process (csrc/cpu_ffn.cpp,
docs/cpu.md): what each constant of the kernel and the CPU record rests on.

    python3 benchmarks/probes/cpu_kernel_probe.py [--rounds 9] [--studies blocks line_cost w_down_t] [--out FILE]

fp32, K=2048, N=5632, gated, anchors.md's inputs, all cores; the op forced to path="cpu".
  blocks      tokens per block of the sparse part (CpuPolicy.block_tokens, through
              arch.patched, the sparse part forced at every density): 128 against 2048, at
              M = 256 and 2048, d = 0.005 and 0.02
  line_cost   phase B's parallel region at M = 16, d = 0.005: the kernel as shipped (its packed
              W_down elements counted as 8 element operations: 2 threads) against a variant built
              with -DTWELL_PHASE_B_LINE_COST=1 (one thread), called directly
  w_down_t    W_down as nn.Linear stores it against transposed storage of the same shape
              (w.t().contiguous().t(): its active rows read in place), M = 1 and 16, d = 0.005
Each row: the variant's median ms over interleaved rounds and Inductor's compiled dense FFN's.
Rows as benchmarks/rows.py stamps them, to --out (default runs/cpu-<processor>/cpu_kernel_probe.json).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):                  # run as a file
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.bench_ffn_cpu import cpu_model  # noqa: E402
from benchmarks.rows import out_path, stamp, write_json  # noqa: E402

import twell_compile.ops  # noqa: E402,F401
from twell_compile import build  # noqa: E402
from twell_compile.reference import ffn_dense  # noqa: E402
from twell_compile.runtime import arch, cpu_ffn  # noqa: E402
from twell_compile.testing import make_ffn  # noqa: E402

K, N = 2048, 5632


def timed(fns: dict, rounds: int) -> dict[str, float]:
    """Median ms per function, one call of each per round (after one warm-up call each)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def line_cost_variant():
    """The CPU kernel built with phase B's packed elements counted as 1 element operation."""
    flags = build.CXX_FLAGS + ["-fopenmp", "-march=native", "-DTWELL_PHASE_B_LINE_COST=1"]
    directory = build.build_directory("cpu_ffn_line_cost_1", flags + ["-fopenmp"])
    return build.build("twell_cpu_ffn_line_cost_1", build.sources("cpu_ffn"), directory, flags, ["-fopenmp"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--studies", nargs="+", default=["blocks", "line_cost", "w_down_t"],
                    choices=["blocks", "line_cost", "w_down_t"])
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    dense = lambda x, wg, wu, wd: ffn_dense(x, wg, None, wu, None, wd, None)  # noqa: E731
    rows = []

    def point(study: str, m: int, d: float, variants: dict) -> None:
        torch._dynamo.reset()
        inductor = torch.compile(dense, dynamic=False)
        f = make_ffn(m, K, N, d, tail=0.0, dtype=torch.float32, device="cpu")
        args = (f["x"], f["w_gate"], f["w_up"], f["w_down"])
        fns = {"inductor": lambda: inductor(*args)}
        for name, fn in variants.items():
            own = fn.prepare(*args) if hasattr(fn, "prepare") else args      # layout made once, outside the timing
            fns[name] = lambda fn=fn, own=own: fn(*own)
        ms = timed(fns, a.rounds)
        for name in variants:
            rows.append(stamp({"study": study, "variant": name, "M": m, "K": K, "N": N, "density": d,
                               "ms": round(ms[name], 3), "inductor_ms": round(ms["inductor"], 3),
                               "speedup_vs_inductor": round(ms["inductor"] / ms[name], 3),
                               "threads": torch.get_num_threads()}, "cpu"))
            print(f"{study:9} M={m:5d} d={d:<6} {name:22} {ms[name]:9.3f} ms  x{ms['inductor'] / ms[name]:.2f} "
                  f"(Inductor {ms['inductor']:.3f})", flush=True)

    def op(block: int | None = None, transposed: bool = False):
        def run(x, wg, wu, wd):
            if block is None:
                return torch.ops.twell.ffn(x, wg, None, wu, None, wd, None, "probe", False, 0, "cpu")
            with arch.patched(block_tokens=block, max_density_small=1.0, max_density_mid=1.0, max_density_large=1.0):
                return torch.ops.twell.ffn(x, wg, None, wu, None, wd, None, "probe", False, 0, "cpu")
        if transposed:
            run.prepare = lambda x, wg, wu, wd: (x, wg, wu, wd.t().contiguous().t())
        return run

    if "blocks" in a.studies:
        for m, d in ((256, 0.005), (2048, 0.005), (2048, 0.02)):
            point("blocks", m, d, {"block_tokens=128": op(128), "block_tokens=2048": op(2048)})
    if "line_cost" in a.studies:
        shipped, variant = cpu_ffn.extension(), line_cost_variant()
        policy = arch.policy_for("cpu")

        def direct(mod):
            return lambda x, wg, wu, wd: mod.ffn_forward(x, wg, None, wu, None, wd, None,
                                                        policy.max_density(x.shape[0]), False, policy.block_tokens)
        point("line_cost", 16, 0.005, {"line_cost=8 (shipped)": direct(shipped), "line_cost=1": direct(variant)})
    if "w_down_t" in a.studies:
        for m in (1, 16):
            point("w_down_t", m, 0.005, {"nn.Linear layout": op(), "transposed storage": op(transposed=True)})
    out = out_path(a.out, f"cpu-{cpu_model()}", "cpu_kernel_probe.json")
    write_json(out, rows)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
