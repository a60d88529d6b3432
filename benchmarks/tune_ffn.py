"""Time the two TwELL kernels apart, over launch variants (the numbers behind cuda_infer's
constants). python3 benchmarks/tune_ffn.py [--M 16384] [--density 0.005 0.02] [--tail 0 0.2]"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from synthetic import make_ffn  # noqa: E402

from twell_compile.kernels import cuda_infer  # noqa: E402


def bench(fn) -> float:
    from triton.testing import do_bench
    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--M", type=int, nargs="+", default=[16384])
    ap.add_argument("--K", type=int, default=2048)
    ap.add_argument("--N", type=int, default=5632)
    ap.add_argument("--density", type=float, nargs="+", default=[0.005, 0.02])
    ap.add_argument("--tail", type=float, nargs="+", default=[0.0, 0.2])
    ap.add_argument("--pairs", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--gate", nargs="+", default=["128,8,4", "128,8,3", "64,4,4"], help="BLOCK_M,warps,stages")
    a = ap.parse_args()
    for m in a.M:
        for d in a.density:
            for t in a.tail:
                p = make_ffn(m, a.K, a.N, d, t)
                x, wg, wu, wd = p["x"], p["w_gate"], p["w_up"], p["w_down"]
                lin = bench(lambda: F.linear(x, wg))
                line = f"M={m} d={d} t={t}: F.linear {lin:.3f}"
                for g in a.gate:
                    bm, w, s = (int(v) for v in g.split(","))
                    cuda_infer.GATE_BLOCK_M, cuda_infer.GATE_WARPS, cuda_infer.GATE_STAGES = bm, w, s
                    line += f" | gate[{g}] {bench(lambda: cuda_infer.gate_pack(x, wg, None, 128, 16)):.3f}"
                cuda_infer.GATE_BLOCK_M, cuda_infer.GATE_WARPS, cuda_infer.GATE_STAGES = 128, 8, 4
                pk = cuda_infer.gate_pack(x, wg, None, 128, 16)
                nnz = float(pk.counts.sum()) / m
                ovf = int(pk.ocount)
                line += f" | nnz/row {nnz:.1f} ovf tiles {ovf}"
                print(line, flush=True)
                for pairs in a.pairs:
                    for warps in a.warps:
                        cuda_infer.PAIRS, cuda_infer.FUSED_WARPS = pairs, warps
                        ms = bench(lambda: cuda_infer.fused(x, pk, wg, None, wu, None, wd, None))
                        gb = nnz * m * 2 * a.K * 2 / 1e9
                        print(f"    fused pairs={pairs} warps={warps}: {ms:.3f} ms "
                              f"({gb / ms:.1f} TB/s of weight rows)", flush=True)
                cuda_infer.PAIRS, cuda_infer.FUSED_WARPS = 4, 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
