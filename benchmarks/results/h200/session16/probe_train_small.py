"""Session 16: where the training op's time goes at small M (1024 tokens, K=2048, N=5632,
d=0.005, bf16). Per variant: host us per step (issue only) and wall us per step (to the GPU's
end), 200 back-to-back steps, best of 3 rounds. Variants: eager dense FFN; the op through
torch.autograd (custom_op autograd); the op's python implementation called directly (no
custom_op, no autograd); the FFN module compiled with backend="twell" and "inductor"
(dynamic=True). Then cProfile and torch.profiler (CPU) of the op step.

    python3 probe_train_small.py [M]
"""
import cProfile, io, pstats, sys, time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from synthetic import make_ffn  # noqa: E402
import twell_compile  # noqa: E402,F401
import twell_compile.ops  # noqa: E402,F401
from twell_compile import dispatch  # noqa: E402
from twell_compile.reference import ffn_dense  # noqa: E402

m = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
k, n = 2048, 5632
p = make_ffn(m, k, n, 0.005, 0.0, device="cuda", seed=1)
x, wg, wu, wd = (p[a].requires_grad_() for a in ("x", "w_gate", "w_up", "w_down"))
params = (x, wg, wu, wd)
dy = torch.randn(m, k, device="cuda", dtype=x.dtype)


def eager():
    return torch.autograd.grad(ffn_dense(x, wg, None, wu, None, wd, None), params, dy)


def op():
    y = torch.ops.twell.ffn_train(x, wg, None, wu, None, wd, None, 256, 16, 0.0, "probe", False)[0]
    return torch.autograd.grad(y, params, dy)


def direct():
    with torch.no_grad():
        out = dispatch.ffn_train_forward(x, wg, None, wu, None, wd, None, 256, 16, "probe2", False)
        return dispatch.ffn_train_backward(dy, x, wg, None, wu, None, wd, *out[1:], 0.0)


class FFN(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(k, n, bias=False)
        self.up = nn.Linear(k, n, bias=False)
        self.down = nn.Linear(n, k, bias=False)

    def forward(self, h):
        return self.down(F.relu(self.gate(h)) * self.up(h))


def compiled(backend):
    mod = FFN().cuda().to(torch.bfloat16)
    with torch.no_grad():
        mod.gate.weight.copy_(wg); mod.up.weight.copy_(wu); mod.down.weight.copy_(wd)
    cm = torch.compile(mod, backend=backend, dynamic=True)
    xx = x.detach().clone().requires_grad_()

    def step():
        return torch.autograd.grad(cm(xx), (xx, *mod.parameters()), dy)
    return step


def timeit(fn, calls=200, rounds=3):
    best = (1e9, 1e9)
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        host = (time.perf_counter() - t0) / calls * 1e6
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / calls * 1e6
        best = min(best, (wall, host))
    return best


variants = {"eager": eager, "op": op, "direct": direct,
            "compiled_twell": compiled("twell"), "compiled_inductor": compiled("inductor")}
for name, fn in variants.items():
    for _ in range(10):
        fn()
torch.cuda.synchronize()
for name, fn in variants.items():
    wall, host = timeit(fn)
    print(f"M={m} {name:>18}: wall {wall:8.1f} us/step, host {host:8.1f}", flush=True)

prof = cProfile.Profile()
prof.enable()
for _ in range(200):
    op()
prof.disable()
torch.cuda.synchronize()
s = io.StringIO()
pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
print(s.getvalue(), flush=True)

from torch.profiler import ProfilerActivity, profile  # noqa: E402
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
    for _ in range(20):
        op()
    torch.cuda.synchronize()
print(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=30), flush=True)
