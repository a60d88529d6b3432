"""Time the TwELL kernels apart, over launch variants (the numbers behind cuda_infer's and
cuda_policy's constants).

    python3 benchmarks/tune_ffn.py --path rows [--M 16384] [--density 0.005 0.02] [--tail 0 0.2]
    python3 benchmarks/tune_ffn.py --path tiles ...      # the tile path (Triton gate epilogue)

rows: cuBLAS gate, compaction variants (BM,CH,warps), fused variants (PAIRS,PF,columns per warp), the
whole twell_forward, eager dense, and the kernel's error vs fp32 next to eager bf16's."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from twell_compile.testing import make_ffn  # noqa: E402
from timing import median_ms, rel  # noqa: E402

from twell_compile.kernels import cuda_infer  # noqa: E402


def bench(fn) -> float:
    return median_ms(fn, 100, warmup=25)


def cases(a):
    """(M, density, tail, x, w_gate, w_up, w_down, gate GEMM ms) over the grid of ``a``."""
    for m in a.M:
        for d in a.density:
            for t in a.tail:
                p = make_ffn(m, a.K, a.N, d, t)
                x, wg, wu, wd = p["x"], p["w_gate"], p["w_up"], p["w_down"]
                yield m, d, t, x, wg, wu, wd, bench(lambda: F.linear(x, wg))
                del p, x, wg, wu, wd  # free this case before the next one is drawn


def rows(a) -> None:
    from twell_compile.reference import ffn_dense
    torch.backends.cuda.matmul.allow_tf32 = False
    for m, d, t, x, wg, wu, wd, lin in cases(a):
        dense = bench(lambda: ffn_dense(x, wg, None, wu, None, wd, None))
        g = F.linear(x, wg)
        nnz = float((g > 0).sum()) / m
        width = cuda_infer.list_width(a.N, nnz) if a.width == 0 else a.width
        line = f"M={m} d={d} t={t} nnz/row {nnz:.1f} W={width}: F.linear {lin:.3f} dense {dense:.3f}"
        for c in a.compact:
            bm, ch, w = (int(v) for v in c.split(","))
            cuda_infer.COMPACT_BM, cuda_infer.COMPACT_CH, cuda_infer.COMPACT_WARPS = bm, ch, w
            ms = bench(lambda: cuda_infer.gate_rows(x, wg, None, width)) - lin
            line += f" | compact[{c}] {ms:.3f}"
        cuda_infer.COMPACT_BM, cuda_infer.COMPACT_CH, cuda_infer.COMPACT_WARPS = 16, 256, 4
        r = cuda_infer.gate_rows(x, wg, None, width)
        over = int((r.cnt > width).sum())
        print(line + f" | rows over W {over}", flush=True)
        shipped = cuda_infer.ROW_PAIRS, cuda_infer.ROW_PF, cuda_infer.ROW_COLS_PER_WARP
        for f in a.fused:
            pairs, pf, cpw = (int(v) for v in f.split(","))
            cuda_infer.ROW_PAIRS, cuda_infer.ROW_PF, cuda_infer.ROW_COLS_PER_WARP = pairs, pf, cpw
            try:
                ms = bench(lambda: cuda_infer.fused_rows(x, r, wu, None, wd, None))
            except Exception as ex:
                print("   ", f, type(ex).__name__, str(ex)[:200])
                continue
            gb = nnz * m * 2 * a.K * 2 / 1e9
            print(f"    fused PAIRS={pairs} PF={pf} cols/warp={cpw}: {ms:.3f} ms "
                  f"({gb / ms:.1f} TB/s of weight rows)", flush=True)
        cuda_infer.ROW_PAIRS, cuda_infer.ROW_PF, cuda_infer.ROW_COLS_PER_WARP = shipped
        tot = bench(lambda: cuda_infer.twell_forward(x, wg, None, wu, None, wd, None, width=width))
        rr = min(m, 4096)
        y = cuda_infer.twell_forward(x, wg, None, wu, None, wd, None, width=width)[0][:rr]
        ref = ffn_dense(x[:rr].float(), wg.float(), None, wu.float(), None, wd.float(), None)
        err, derr = rel(y, ref), rel(ffn_dense(x[:rr], wg, None, wu, None, wd, None), ref)
        print(f"    twell_forward {tot:.3f} ms = {dense / tot:.2f}x eager dense; "
              f"err {err:.2e} eager {derr:.2e}" + ("  ERR>2x" if err > 2 * derr else ""), flush=True)
        del x, wg, wu, wd, g, r


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--path", choices=["rows", "tiles"], default="rows")
    ap.add_argument("--compact", nargs="+", default=["16,256,4", "8,256,4", "4,512,4"],
                    help="rows: BM,CH,warps of the compaction pass")
    ap.add_argument("--rows-fused", dest="rfused", nargs="+", default=["1,1,1024", "4,1,512", "2,1,512", "1,1,512"],
                    help="rows: PAIRS,PF,columns of max(K, K_out) per warp of the fused kernel")
    ap.add_argument("--width", type=int, default=0, help="rows: list width (0: from the density)")
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
    if a.path == "rows":
        a.fused = a.rfused
        rows(a)
        return 0
    for m, d, t, x, wg, wu, wd, lin in cases(a):
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
