"""Session 17 probe: the column-split down projection (csrc/twell_down.cu + twell_rows_kernel's
SPLIT mode) against the fused per-row kernel, by parts, on anchors.md's generator.
The code is in the package at commit 464a896 only (removed after this probe: slower, see
README.md). Check that commit out, then from the repo root:
python3 benchmarks/results/h200/session17/probe_down.py OUT.json"""
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from synthetic import make_ffn  # noqa: E402
from timing import median_ms, rel  # noqa: E402

from twell_compile.kernels import cuda_infer as ci, weight_cache  # noqa: E402
from twell_compile.reference import ffn_dense  # noqa: E402


def bench(fn):
    return median_ms(fn, 60, warmup=15)


def main():
    out = sys.argv[1]
    torch.backends.cuda.matmul.allow_tf32 = False
    t0 = time.time()
    ci._down_module()
    print(f"build/load twell_down: {time.time() - t0:.1f} s", flush=True)
    res = []
    cases = [(16384, 2048, 5632, 0.005, 0.0), (16384, 2048, 5632, 0.005, 0.2),
             (16384, 2048, 5632, 0.01, 0.0), (16384, 2048, 5632, 0.02, 0.0),
             (65536, 2048, 5632, 0.005, 0.0), (65536, 2048, 5632, 0.005, 0.2),
             (16384, 4096, 11008, 0.005, 0.0), (65536, 4096, 11008, 0.005, 0.2)]
    for (m, k, n, d, t) in cases:
        p = make_ffn(m, k, n, d, t, device="cuda", seed=7)
        x, wg, wu, wd = p["x"], p["w_gate"], p["w_up"], p["w_down"]
        weight_cache.register(wd)
        nnz = float((F.linear(x, wg) > 0).sum()) / m
        width = ci.list_width(n, nnz)
        r = ci.gate_rows(x, wg, None, width)
        row = dict(M=m, K=k, N=n, density=d, tail=t, nnz=nnz, W=width,
                   over=int((r.cnt > width).sum()))
        row["linear_ms"] = bench(lambda: F.linear(x, wg))
        row["gate_rows_ms"] = bench(lambda: ci.gate_rows(x, wg, None, width))
        for split in (False, True):
            ci.ROW_SPLIT = split
            tag = "split" if split else "fused"
            # timing reuses r (SPLIT overwrites list values with h: same work, other numbers)
            row[f"{tag}_rows_ms"] = bench(lambda: ci.fused_rows(x, r, wu, None, wd, None))
            row[f"{tag}_op_ms"] = bench(lambda: ci.twell_forward(x, wg, None, wu, None, wd, None, width=width))
            row[f"{tag}_nongated_ms"] = bench(lambda: ci.fused_rows(x, r, None, None, wd, None))
            y = ci.twell_forward(x[:8192], wg, None, wu, None, wd, None, width=width)[0]
            ref = ffn_dense(x[:8192].float(), wg.float(), None, wu.float(), None, wd.float(), None)
            row[f"{tag}_err"] = rel(y, ref)
        row["eager_err"] = rel(ffn_dense(x[:8192], wg, None, wu, None, wd, None), ref)
        # the two parts of the split alone
        ci.ROW_SPLIT = True
        from twell_compile.kernels.twell_rows import twell_rows_kernel
        wdt = weight_cache.transposed(wd)
        cols = ci.down_cols_width(n, k, 2, x.device)
        nl = torch.empty((m,), dtype=torch.int32, device="cuda")
        y = torch.empty((m, k), dtype=x.dtype, device="cuda")
        hsum = torch.empty((m,), dtype=torch.float32, device="cuda")

        def up(warps=ci.warps_by_width(k, ci.ROW_COLS_PER_WARP)):
            twell_rows_kernel[(m,)](
                x, x.stride(0), x.stride(1), r.g, r.g.stride(0), r.lst, r.cnt, r.order,
                wu, wu.stride(0), wu.stride(1), x, wdt, wdt.stride(0), wdt.stride(1), x,
                y, y.stride(0), y.stride(1), hsum, nl, k, n, k, width,
                GATED=True, HAS_BU=False, HAS_BD=False, K_P=ci._pow2(k), KO_P=ci._pow2(k),
                PAIRS=ci.ROW_PAIRS, CH=min(ci.TAIL_CH, ci._pow2(n)), PF=ci.ROW_PF, SPLIT=True,
                num_warps=warps)
        up()
        row["cols"] = cols
        for w in (1, 2, 4):
            row[f"up_w{w}_ms"] = bench(lambda: up(w))
        stream = torch.cuda.current_stream().cuda_stream
        for span_div in (1, 2):
            span = -(-m // span_div)
            row[f"down_s{span_div}_ms"] = bench(lambda: ci._down_module().down_cols(
                r.lst, nl, wdt, None, y, cols, span, stream))
        print(json.dumps({kk: (round(v, 4) if isinstance(v, float) else v) for kk, v in row.items()}), flush=True)
        res.append(row)
        Path(out).write_text(json.dumps(res, indent=1))
        weight_cache.clear()
        del p, x, wg, wu, wd, r, y, nl
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
