"""Session 15: the per-row gathering kernels over launch configs (warps, pairs per step), with
registers and spills: inference twell_rows_kernel, training train_fwd_kernel and
dx_rows_kernel, and the weight-gradient passes at 1-2 warps. Each kernel's launch is captured
once from the shipped path, then relaunched with the overrides. M=16384 K=2048 N=5632
d=0.005 tail 0 (bench_ffn_train's generator, seed 1), or M K N from the command line."""
import importlib
import os
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))   # benchmarks/
from synthetic import make_ffn  # noqa: E402
from twell_compile.kernels import cuda_infer, cuda_train  # noqa: E402
from twell_compile.kernels.torch_impl import backup_capacity  # noqa: E402

M, K, N = (int(v) for v in sys.argv[1:4]) if len(sys.argv) > 3 else (16384, 2048, 5632)
D = 0.005
print(f"M={M} K={K} N={N} d={D}", flush=True)
p = make_ffn(M, K, N, D, 0.0, device="cuda", seed=1)
x, wg, wu, wd = p["x"], p["w_gate"], p["w_up"], p["w_down"]
dy = torch.randn(M, K, device="cuda", dtype=x.dtype)
cap = int(backup_capacity(M, 16))
SPY = {"twell_rows": "twell_rows_kernel", "twell_train_fwd": "train_fwd_kernel",
       "twell_train_bwd": "dx_rows_kernel", "twell_train_wgrad": "wgrad_kernel"}
calls, real = [], {}
for mod, name in SPY.items():
    mm = importlib.import_module(f"twell_compile.kernels.{mod}")
    real[name] = getattr(mm, name)

    class Spy:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            def run(*args, **kw):
                calls.append((self.name, grid, args, dict(kw)))
                return real[self.name][grid](*args, **kw)
            return run
    setattr(mm, name, Spy(name))

cuda_infer.twell_forward(x, wg, None, wu, None, wd, None)
_, _, *st, _ = cuda_train.forward_sparse(x, wg, None, wu, None, wd, None, 256, cap)
cuda_train.backward_sparse(dy, x, wg, None, wu, None, wd, *st, 0.0)
for mod, name in SPY.items():
    setattr(importlib.import_module(f"twell_compile.kernels.{mod}"), name, real[name])
torch.cuda.synchronize()

WARPS = (2, 4) if K <= 2048 else (2, 4, 8)
VARIANTS = {
    "twell_rows_kernel": [dict(num_warps=w, PAIRS=pp, PF=pf) for w in WARPS for pp in (1, 2, 4) for pf in (0, 1, 2)],
    "train_fwd_kernel": [dict(num_warps=w, PAIRS=pp) for w in WARPS for pp in (1, 2, 4)],
    "dx_rows_kernel": [dict(num_warps=w, PAIRS=pp) for w in WARPS for pp in (1, 2, 4)],
    "wgrad_kernel": [dict(num_warps=w, E=e) for w in (1, 2, 4) for e in (1, 2)],
}
if os.environ.get("PROBE_SET") == "evict":   # L2 eviction hints (kernel params of commit 6e4b648, reverted)
    VARIANTS["twell_rows_kernel"] = [dict(WPOL=w, XPOL=x) for w in ("", "evict_last") for x in ("", "evict_first")]
ONLY = os.environ.get("PROBE_ONLY", "").split(",")   # kernel names, empty: all
for name, grid, args, kw in calls:
    if ONLY != [""] and name not in ONLY:
        continue
    tag = name + ("" if name != "wgrad_kernel" else (" DY" if kw["DY"] else " X"))
    shipped = {k: kw.get(k) for k in VARIANTS[name][0]}
    res = []
    for v in [shipped] + [v for v in VARIANTS[name] if v != shipped]:
        kk = dict(kw, **v)
        try:
            h = real[name][grid](*args, **kk)
            t = triton.testing.do_bench(lambda: real[name][grid](*args, **kk), warmup=25, rep=200)
        except Exception as ex:  # resource limits
            print(f"{tag} {v}: {type(ex).__name__} {str(ex)[:80]}", flush=True)
            continue
        res.append((t, str(v)))
        print(f"{tag} {v}: {t * 1e3:7.1f} us  regs {h.n_regs} spills {h.n_spills}"
              + ("   <- shipped" if v is shipped else ""), flush=True)
    best = min(res)
    print(f"{tag} best: {best[1]} {best[0] * 1e3:.1f} us", flush=True)
