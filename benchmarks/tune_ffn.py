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
    ap.add_argument("--fused", nargs="+", default=["4,4", "8,4", "8,8", "2,4"], help="PAIRS,warps")
    ap.add_argument("--gate", nargs="+", default=["128,8,4,2", "128,8,4,1", "128,8,4,0", "128,8,3,2", "256,8,3,2"],
                    help="BLOCK_M,warps,stages,epilogue (2 full, 1 no overflow part, 0 counts only)")
    ap.add_argument("--tiles", nargs="+", default=["128,16"], help="tile_n,slots")
    a = ap.parse_args()
    for m in a.M:
        for d in a.density:
            for t in a.tail:
                p = make_ffn(m, a.K, a.N, d, t)
                x, wg, wu, wd = p["x"], p["w_gate"], p["w_up"], p["w_down"]
                lin = bench(lambda: F.linear(x, wg))
                line = f"M={m} d={d} t={t}: F.linear {lin:.3f}"
                for tile in a.tiles:
                    tn, sl = (int(v) for v in tile.split(","))
                    for g in a.gate:
                        bm, w, s, e = (int(v) for v in g.split(","))
                        if tn * bm > 128 * 256:
                            continue
                        cuda_infer.GATE_BLOCK_M, cuda_infer.GATE_WARPS, cuda_infer.GATE_STAGES = bm, w, s
                        cuda_infer.GATE_EPI = e
                        try:
                            ms = bench(lambda: cuda_infer.gate_pack(x, wg, None, tn, sl))
                        except Exception as ex:  # e.g. out of shared memory
                            ms = float("nan")
                            print("   ", tile, g, type(ex).__name__, str(ex)[:200])
                        line += f" | gate[{tile}:{g}] {ms:.3f}"
                cuda_infer.GATE_BLOCK_M, cuda_infer.GATE_WARPS, cuda_infer.GATE_STAGES = 128, 8, 4
                cuda_infer.GATE_EPI = 2
                pk = cuda_infer.gate_pack(x, wg, None, 128, 16)
                nnz = float(pk.counts.sum()) / m
                ovf = int(pk.ocount)
                line += f" | nnz/row {nnz:.1f} ovf tiles {ovf}"
                print(line, flush=True)
                for f in a.fused:
                    pairs, warps = (int(v) for v in f.split(","))
                    if True:
                        cuda_infer.PAIRS, cuda_infer.FUSED_WARPS = pairs, warps
                        ms = bench(lambda: cuda_infer.fused(x, pk, wg, None, wu, None, wd, None))
                        gb = nnz * m * 2 * a.K * 2 / 1e9
                        print(f"    fused pairs={pairs} warps={warps}: {ms:.3f} ms "
                              f"({gb / ms:.1f} TB/s of weight rows)", flush=True)
                cuda_infer.PAIRS, cuda_infer.FUSED_WARPS = 4, 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
