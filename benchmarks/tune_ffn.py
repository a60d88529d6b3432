"""Time the per-row TwELL kernels apart, over launch variants: the numbers behind the GPU
record's compaction, row-kernel and dense relu*mul launch fields (runtime/arch.py).

    python3 benchmarks/tune_ffn.py [--M 16384] [--density 0.005 0.02] [--tail 0 0.2]
    python3 benchmarks/tune_ffn.py --compact 16,256,4 8,256,4 --fused 1,1,1024 4,1,512
    python3 benchmarks/tune_ffn.py --dense 1024,4 2048,8 --no-twell --M 16384 65536 --tail 0

Per point: cuBLAS's gate GEMM, the compaction pass over its output per variant (compact_bm,
compact_ch, compact_warps and optionally compact_stages), the fused row kernel per variant (row_pairs,
row_prefetch, row_cols_per_warp) with the weight-row bytes it moves per ms, the whole
twell_forward and eager's dense FFN at the record's fields, and the kernel's error against
fp32 next to eager bf16's. --dense: the dense path's relu*mul pass (with its counts) per variant
(dense_block, dense_warps) against Inductor's fused relu*mul and eager's two passes, and the
dense path's whole FFN against Inductor's. Each variant runs under arch.patched: the record's
fields replaced for that variant only. A variant the device cannot launch (out of shared memory or registers)
is reported and skipped. Prints only; nothing is written.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

if __package__ in (None, ""):                  # run as a file: python3 benchmarks/tune_ffn.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.timing import median_ms, rel  # noqa: E402

from twell_compile.reference import ffn_dense  # noqa: E402
from twell_compile.runtime import arch, cuda_infer, select  # noqa: E402
from twell_compile.testing import make_ffn  # noqa: E402

LAUNCH_ERRORS = (triton.runtime.errors.OutOfResources, triton.compiler.errors.CompilationError)


def bench(fn) -> float:
    return median_ms(fn, 100, warmup=25)


def variants(specs: list[str], fields: tuple[str, ...], flag: str, optional: int = 0) -> list[dict[str, int]]:
    """Comma-separated integers per variant as record fields (``fields``) for arch.patched; the
    last ``optional`` fields may be left out (the record's value stays)."""
    out = []
    for spec in specs:
        values = spec.split(",")
        if not len(fields) - optional <= len(values) <= len(fields) or not all(v.strip().lstrip("-").isdigit() for v in values):
            raise ValueError(f"{flag} takes {','.join(fields)} as integers, got {spec!r}")
        out.append(dict(zip(fields, (int(v) for v in values))))
    return out


def cases(a):
    """(M, density, tail, x, w_gate, w_up, w_down, gate GEMM ms) over the grid of ``a``."""
    for m in a.M:
        for d in a.density:
            for t in a.tail:
                p = make_ffn(m, a.K, a.N, d, t)
                x, wg, wu, wd = p["x"], p["w_gate"], p["w_up"], p["w_down"]
                yield m, d, t, x, wg, wu, wd, bench(lambda: F.linear(x, wg))
                del p, x, wg, wu, wd  # free this case before the next one is drawn


def rows(a, compact: list[dict[str, int]], fused: list[dict[str, int]]) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    record = arch.policy_for(torch.device("cuda"))
    for m, d, t, x, wg, wu, wd, lin in cases(a):
        dense = bench(lambda: ffn_dense(x, wg, None, wu, None, wd, None))
        nnz = float((F.linear(x, wg) > 0).sum()) / m
        width = select.list_width(record, a.N, nnz) if a.width == 0 else a.width
        line = f"M={m} d={d} t={t} nnz/row {nnz:.1f} W={width}: F.linear {lin:.3f} dense {dense:.3f}"
        g = F.linear(x, wg)
        for c in compact:
            with arch.patched(**c, compact_programs=1):     # exactly compact_bm rows per program
                try:
                    ms = bench(lambda: cuda_infer.compact_rows(g, width, buckets=record.row_buckets))
                except LAUNCH_ERRORS as ex:
                    print("   ", c, type(ex).__name__, str(ex)[:200])
                    continue
            line += f" | compact[{','.join(map(str, c.values()))}] {ms:.3f}"
        r = cuda_infer.gate_rows(x, wg, None, width)
        over = int((r.cnt > width).sum())
        print(line + f" | rows over W {over}", flush=True)
        for f in fused:
            with arch.patched(**f):
                try:
                    ms = bench(lambda: cuda_infer.fused_rows(x, r, wu, None, wd, None))
                except LAUNCH_ERRORS as ex:
                    print("   ", f, type(ex).__name__, str(ex)[:200])
                    continue
            gb = nnz * m * 2 * a.K * 2 / 1e9
            print(f"    fused {' '.join(f'{k}={v}' for k, v in f.items())}: {ms:.3f} ms ({gb / ms:.1f} TB/s of weight rows)",
                  flush=True)
        tot = bench(lambda: cuda_infer.twell_forward(x, wg, None, wu, None, wd, None, width))
        rr = min(m, 4096)
        y = cuda_infer.twell_forward(x, wg, None, wu, None, wd, None, width)[0][:rr]
        ref = ffn_dense(x[:rr].float(), wg.float(), None, wu.float(), None, wd.float(), None)
        err, derr = rel(y, ref), rel(ffn_dense(x[:rr], wg, None, wu, None, wd, None), ref)
        print(f"    twell_forward {tot:.3f} ms = {dense / tot:.2f}x eager dense; "
              f"err {err:.2e} eager {derr:.2e}" + ("  ERR>2x" if err > 2 * derr else ""), flush=True)
        del x, wg, wu, wd, r


def dense_variants(a, dense: list[dict[str, int]]) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    fused = torch.compile(lambda g, u: torch.relu(g) * u, dynamic=False)
    whole = torch.compile(lambda x, wg, wu, wd: ffn_dense(x, wg, None, wu, None, wd, None), dynamic=False)
    for m, d, t, x, wg, wu, wd, lin in cases(a):
        g, u = F.linear(x, wg), F.linear(x, wu)
        ind, eager = bench(lambda: fused(g, u)), bench(lambda: torch.relu(g) * u)
        ind_ffn = bench(lambda: whole(x, wg, wu, wd))
        line = f"M={m} d={d} t={t}: relu*mul Inductor {ind:.3f} eager {eager:.3f}; FFN Inductor {ind_ffn:.3f}"
        print(line, flush=True)
        want = torch.relu(g) * u
        for v in dense:
            with arch.patched(**v):
                try:
                    ms = bench(lambda: cuda_infer.relu_mul_rows(g, u))
                    ffn = bench(lambda: cuda_infer.dense_forward(x, wg, None, wu, None, wd, None, counts=True))
                except LAUNCH_ERRORS as ex:
                    print("   ", v, type(ex).__name__, str(ex)[:200])
                    continue
                same = torch.equal(cuda_infer.relu_mul_rows(g, u)[0], want)
            print(f"    dense {','.join(map(str, v.values()))}: relu*mul {ms:.3f} ms ({ind / ms:.2f}x Inductor's), "
                  f"dense path {ffn:.3f} ms ({ind_ffn / ffn:.2f}x Inductor's FFN)"
                  + ("" if same else "  NOT BIT-IDENTICAL"), flush=True)
        del g, u, want


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compact", nargs="+", default=["16,256,4", "8,256,4", "4,512,4"],
                    help="compact_bm,compact_ch,compact_warps[,compact_stages] of the compaction pass")
    ap.add_argument("--fused", nargs="+", default=["1,1,1024", "4,1,512", "2,1,512", "1,1,512"],
                    help="row_pairs,row_prefetch,row_cols_per_warp[,row_stages] of the fused row kernel")
    ap.add_argument("--dense", nargs="*", default=[],
                    help="dense_block,dense_warps of the dense path's relu*mul pass")
    ap.add_argument("--no-twell", action="store_true", help="only the --dense variants")
    ap.add_argument("--width", type=int, default=0, help="list width (0: from the density, as the rules pick it)")
    ap.add_argument("--M", type=int, nargs="+", default=[16384])
    ap.add_argument("--K", type=int, default=2048)
    ap.add_argument("--N", type=int, default=5632)
    ap.add_argument("--density", type=float, nargs="+", default=[0.005, 0.02])
    ap.add_argument("--tail", type=float, nargs="+", default=[0.0, 0.2])
    a = ap.parse_args(argv)
    compact = variants(a.compact, ("compact_bm", "compact_ch", "compact_warps", "compact_stages"), "--compact", optional=1)
    fused = variants(a.fused, ("row_pairs", "row_prefetch", "row_cols_per_warp", "row_stages"), "--fused", optional=1)
    dense = variants(a.dense, ("dense_block", "dense_warps"), "--dense")
    if not torch.cuda.is_available():
        raise SystemExit("tune_ffn.py needs a CUDA device")
    if dense:
        dense_variants(a, dense)
    if not a.no_twell:
        rows(a, compact, fused)
    return 0


if __name__ == "__main__":
    sys.exit(main())
