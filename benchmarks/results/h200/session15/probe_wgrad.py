"""Session 15: the two per-neuron weight-gradient passes of the sparse backward timed apart,
over launch configs (entries per step E, warps, prefetch PF), with registers and spills.
M=16384 K=2048 N=5632 d=0.005 tail 0 (bench_ffn_train's generator, seed 1)."""
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))   # benchmarks/
from synthetic import make_ffn  # noqa: E402
from twell_compile.kernels import cuda_train, twell_train_wgrad  # noqa: E402
from twell_compile.kernels.torch_impl import backup_capacity  # noqa: E402

M, K, N, D = 16384, 2048, 5632, 0.005
p = make_ffn(M, K, N, D, 0.0, device="cuda", seed=1)
x, wg, wu, wd = p["x"], p["w_gate"], p["w_up"], p["w_down"]
dy = torch.randn(M, K, device="cuda", dtype=x.dtype)
cap = int(backup_capacity(M, 16))
_, _, *st, _ = cuda_train.forward_sparse(x, wg, None, wu, None, wd, None, 256, cap)

calls = []
real = twell_train_wgrad.wgrad_kernel


class Spy:
    def __getitem__(self, grid):
        def run(*args, **kw):
            calls.append((grid, args, dict(kw)))
            return real[grid](*args, **kw)
        return run


twell_train_wgrad.wgrad_kernel = Spy()
cuda_train.backward_sparse(dy, x, wg, None, wu, None, wd, *st, 0.0)
twell_train_wgrad.wgrad_kernel = real
torch.cuda.synchronize()
entries = int(st[0].clamp(max=256).sum())
print(f"entries {entries}  ({entries / M:.1f} per row), gathered bytes per pass {entries * K * 2 / 1e9:.2f} GB")

for grid, args, kw in calls:
    name = "DY" if kw["DY"] else "X"
    res = []
    for e in (1, 2, 4, 8):
        for w in (2, 4, 8):
            for pf in (0, 1):
                kk = dict(kw, E=e, num_warps=w, PF=pf)
                try:
                    h = real[grid](*args, **kk)
                    t = triton.testing.do_bench(lambda: real[grid](*args, **kk), warmup=25, rep=200)
                except Exception as ex:  # resource limits (shared memory) at big tiles
                    print(f"{name} E={e} warps={w} PF={pf}: {type(ex).__name__} {str(ex)[:80]}")
                    continue
                res.append((t, e, w, pf, h.n_regs, h.n_spills))
                print(f"{name} E={e} warps={w} PF={pf}: {t * 1e3:7.1f} us  {entries * K * 2 / t / 1e9:5.2f} TB/s"
                      f"  regs {h.n_regs} spills {h.n_spills}"
                      + ("   <- shipped" if (e, w, pf) == (kw["E"], kw["num_warps"], kw["PF"]) else ""), flush=True)
    best = min(res)
    print(f"{name} best: E={best[1]} warps={best[2]} PF={best[3]} {best[0] * 1e3:.1f} us", flush=True)
