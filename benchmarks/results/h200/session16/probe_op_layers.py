"""Session 16: host cost of each layer between a training step and our kernels at 1024 tokens
(K=2048, N=5632, d=0.005, bf16): the forward op under no_grad vs dispatch's forward; the
backward op called directly vs dispatch's backward; a trivial custom_op and a trivial
Library op (x.clone()); the step through autograd. us per call, best of 3 rounds of 200."""
import sys, time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from synthetic import make_ffn  # noqa: E402
import twell_compile.ops  # noqa: E402,F401
from twell_compile import dispatch  # noqa: E402

m, k, n = 1024, 2048, 5632
p = make_ffn(m, k, n, 0.005, 0.0, device="cuda", seed=1)
x, wg, wu, wd = p["x"], p["w_gate"], p["w_up"], p["w_down"]
dy = torch.randn(m, k, device="cuda", dtype=x.dtype)
state = dispatch.ffn_train_forward(x, wg, None, wu, None, wd, None, 256, 16, "pl", False)


@torch.library.custom_op("probe::clone", mutates_args=())
def clone_op(t: torch.Tensor) -> torch.Tensor:
    return t.clone()


_lib = torch.library.Library("probe2", "FRAGMENT")
_lib.define("clone(Tensor t) -> Tensor")
_lib.impl("clone", lambda t: t.clone(), "CompositeExplicitAutograd")

xg = x.detach().clone().requires_grad_()
params = (xg, wg.requires_grad_(), wu.requires_grad_(), wd.requires_grad_())


def step():
    y = torch.ops.twell.ffn_train(xg, wg, None, wu, None, wd, None, 256, 16, 0.0, "pl2", False)[0]
    return torch.autograd.grad(y, params, dy)


cases = {
    "fwd_op_nograd": lambda: torch.ops.twell.ffn_train(x, wg, None, wu, None, wd, None, 256, 16, 0.0, "pl", False),
    "fwd_direct": lambda: dispatch.ffn_train_forward(x, wg, None, wu, None, wd, None, 256, 16, "pl", False),
    "bwd_op": lambda: torch.ops.twell.ffn_train_bwd(dy, x, wg, None, wu, None, wd, *state[1:], 0.0),
    "bwd_direct": lambda: dispatch.ffn_train_backward(dy, x, wg, None, wu, None, wd, *state[1:], 0.0),
    "custom_op_clone": lambda: clone_op(x),
    "library_clone": lambda: torch.ops.probe2.clone(x),
    "aten_clone": lambda: x.clone(),
    "step_autograd": step,
}
with torch.no_grad():
    for name, fn in cases.items():
        if name == "step_autograd":
            continue
        for _ in range(10):
            fn()
for _ in range(10):
    step()
torch.cuda.synchronize()
for name, fn in cases.items():
    best = 1e9
    for _ in range(3):
        with torch.set_grad_enabled(name == "step_autograd"):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(200):
                fn()
            host = (time.perf_counter() - t0) / 200 * 1e6
            torch.cuda.synchronize()
        best = min(best, host)
    print(f"{name:>16}: host {best:8.1f} us/call", flush=True)
