"""Session 11 probe: the split per-row path (kernels/twell_split.py, weight slices in L1) against
the fused per-row kernel, M=16384 (and 65536), by knob variants. Needs the tree of commit
ff3dea4 (the split code was removed from the package after this probe; README.md here). Run
from the repo root: python3 benchmarks/results/h200/session11/split/probe_split.py OUT.json [quick]
"""
import ctypes
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
from synthetic import make_ffn  # noqa: E402
from timing import median_ms, rel  # noqa: E402

from twell_compile.kernels import cuda_infer as ci  # noqa: E402
from twell_compile.kernels.twell_split import split_down_kernel, split_up_kernel  # noqa: E402
from twell_compile.reference import ffn_dense  # noqa: E402

_cuda = ctypes.CDLL("libcuda.so.1")
L1 = {"on": False}


def carve(jit, pct):
    """Preferred shared-memory carveout (percent) of every compiled variant of a kernel."""
    n = 0
    for entry in jit.device_caches.values():
        for ck in entry[0].values():
            ck._init_handles()
            rc = _cuda.cuFuncSetAttribute(ctypes.c_void_p(ck.function), 9, int(pct))
            n += rc == 0
    return n


def bench(fn):
    fn()
    torch.cuda.synchronize()
    if L1["on"]:
        carve(split_down_kernel, 0), carve(split_up_kernel, 0)
    return median_ms(fn, 60, warmup=15)


DEF = dict(SPLIT_KS=64, SPLIT_NR=1408, SPLIT_UBT=8, SPLIT_UP=4, SPLIT_ULP=32, SPLIT_UWARPS=4,
           SPLIT_SL=16, SPLIT_DBT=8, SPLIT_DP=8, SPLIT_DWARPS=4, SPLIT_CHUNKS=1)


def setk(**kw):
    for k, v in {**DEF, **kw}.items():
        setattr(ci, k, v)


def main():
    out = sys.argv[1]
    quick = len(sys.argv) > 2
    torch.backends.cuda.matmul.allow_tf32 = False
    res = []
    cases = [(16384, 2048, 5632, 0.005, 0.0), (16384, 2048, 5632, 0.02, 0.0),
             (16384, 2048, 5632, 0.005, 0.2), (65536, 2048, 5632, 0.005, 0.2),
             (16384, 4096, 11008, 0.005, 0.0), (16384, 2048, 5632, 0.05, 0.0)]
    for ci_, (m, k, n, d, t) in enumerate(cases):
        p = make_ffn(m, k, n, d, t)
        x, wg, wu, wd = p["x"], p["w_gate"], p["w_up"], p["w_down"]
        ci.weight_cache.register(wd)
        g = F.linear(x, wg)
        nnz = float((g > 0).sum()) / m
        width = ci.list_width(n, nnz)
        r = ci.gate_rows(x, wg, None, width)
        over = int((r.cnt > width).sum())
        lin = bench(lambda: F.linear(x, wg))
        gr = bench(lambda: ci.gate_rows(x, wg, None, width))
        inductor = None
        fused = bench(lambda: ci.fused_rows(x, r, wu, None, wd, None))
        fused_ng = bench(lambda: ci.fused_rows(x, r, None, None, wd, None))
        rr = 2048
        ref = ffn_dense(x[:rr].float(), wg.float(), None, wu.float(), None, wd.float(), None)
        derr = rel(ffn_dense(x[:rr], wg, None, wu, None, wd, None), ref)
        yf = ci.fused_rows(x, r, wu, None, wd, None)[0]
        line = dict(M=m, K=k, N=n, density=d, tail=t, nnz=nnz, W=width, over=over, linear=lin,
                    gate_rows=gr, fused=fused, fused_nongated=fused_ng, dense_err=derr)
        print(f"== M={m} K={k} N={n} d={d} t={t} nnz {nnz:.1f} W={width} over {over}: linear {lin:.3f} "
              f"gate+compact {gr:.3f} fused {fused:.3f} (non-gated {fused_ng:.3f})", flush=True)
        vars_ = [dict()]
        if ci_ == 0 and not quick:
            vars_ += [dict(SPLIT_DBT=4), dict(SPLIT_DBT=16), dict(SPLIT_DP=4), dict(SPLIT_DP=16),
                      dict(SPLIT_DWARPS=8), dict(SPLIT_SL=32, SPLIT_NR=704, SPLIT_KS=128),
                      dict(SPLIT_CHUNKS=2), dict(SPLIT_UBT=4), dict(SPLIT_UBT=16), dict(SPLIT_UP=8),
                      dict(SPLIT_UWARPS=8), dict(SPLIT_NR=704, SPLIT_KS=128),
                      dict(SPLIT_NR=2816, SPLIT_KS=32), dict(SPLIT_ULP=64)]
        line["split"] = []
        for v in vars_:
            for l1 in (False, True):
                setk(**v)
                L1["on"] = l1
                try:
                    ys = ci.split_rows(x, r, wu, None, wd, None)[0]
                    torch.cuda.synchronize()
                    a = bench(lambda: ci.split_rows(x, r, wu, None, wd, None))
                    b = bench(lambda: ci.split_rows(x, r, None, None, wd, None))
                    err = rel(ys[:rr], ref)
                    dif = rel(ys, yf)
                except Exception as ex:  # noqa: BLE001  (a probe: report and go on)
                    print("   ", v, l1, type(ex).__name__, str(ex)[:300], flush=True)
                    continue
                line["split"].append(dict(knobs=v, l1=l1, gated=a, nongated=b, err=err, vs_fused=dif))
                print(f"    split {v} L1={l1}: gated {a:.3f} (fused {fused:.3f}), non-gated {b:.3f} "
                      f"(fused {fused_ng:.3f}); err {err:.2e} (eager {derr:.2e}) vs fused {dif:.1e}"
                      + ("  ERR>2x" if err > 2 * derr else ""), flush=True)
        setk()
        L1["on"] = False
        res.append(line)
        Path(out).write_text(json.dumps(res, indent=1))
        del p, x, wg, wu, wd, g, r, yf
        torch.cuda.empty_cache()


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"done in {time.time() - t0:.0f} s")
