"""Session 16: what the autograd layer costs per training step at 1024 tokens (K=2048, N=5632,
d=0.005, bf16). Steps (y = ffn(...); autograd.grad of x and 3 weights): eager; twell::ffn_train
(custom_op + register_autograd); the same Python implementations registered through
torch.library.Library with a plain autograd.Function at the Autograd key (probe3::); that
Function applied directly (no dispatcher). Also a trivial op (clone) with a backward: aten,
custom_op + register_autograd, Library + Function. Host and wall us per step, best of 3
rounds of 200, variants interleaved per round."""
import sys, time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from synthetic import make_ffn  # noqa: E402
import twell_compile.ops  # noqa: E402,F401
from twell_compile import dispatch  # noqa: E402
from twell_compile.reference import ffn_dense  # noqa: E402

m, k, n = (int(sys.argv[1]) if len(sys.argv) > 1 else 1024), 2048, 5632
p = make_ffn(m, k, n, 0.005, 0.0, device="cuda", seed=1)
x, wg, wu, wd = (p[a].requires_grad_() for a in ("x", "w_gate", "w_up", "w_down"))
params = (x, wg, wu, wd)
dy = torch.randn(m, k, device="cuda", dtype=x.dtype)

lib = torch.library.Library("probe3", "FRAGMENT")
lib.define("ffn_train(Tensor x, Tensor w_gate, Tensor? b_gate, Tensor? w_up, Tensor? b_up, Tensor w_down, "
           "Tensor? b_down, int ell_width, int backup_rows, float l1_scale, str layer, bool stats) -> "
           "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
lib.define("ffn_train_bwd(Tensor dy, Tensor x, Tensor w_gate, Tensor? b_gate, Tensor? w_up, Tensor? b_up, "
           "Tensor w_down, Tensor counts, Tensor cols, Tensor ell_g, Tensor ell_u, Tensor backup_idx, "
           "Tensor backup_g, Tensor backup_u, float l1_scale) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")


def fwd_impl(x, wg, bg, wu, bu, wd, bd, width, rows, l1, layer, stats):
    return tuple(dispatch.ffn_train_forward(x, wg, bg, wu, bu, wd, bd, width, rows, layer, stats))


def bwd_impl(dy, x, wg, bg, wu, bu, wd, *rest):
    g = dispatch.ffn_train_backward(dy, x, wg, bg, wu, bu, wd, *rest)
    return tuple(t if t is not None else x.new_empty(0) for t in g)


lib.impl("ffn_train", fwd_impl, "CUDA")
lib.impl("ffn_train_bwd", bwd_impl, "CUDA")


class Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, wg, bg, wu, bu, wd, bd, width, rows, l1, layer, stats):
        with torch._C._AutoDispatchBelowAutograd():
            out = torch.ops.probe3.ffn_train(x, wg, bg, wu, bu, wd, bd, width, rows, l1, layer, stats)
        ctx.save_for_backward(x, wg, bg, wu, bu, wd, *out[1:])
        ctx.mark_non_differentiable(*out[1:])
        ctx.set_materialize_grads(False)
        ctx.l1 = l1
        return out

    @staticmethod
    def backward(ctx, dy, *_):
        x, wg, bg, wu, bu, wd, *saved = ctx.saved_tensors
        g = torch.ops.probe3.ffn_train_bwd(dy, x, wg, bg, wu, bu, wd, *saved, ctx.l1)
        return g[0], g[1], None, g[3], None, g[5], None, None, None, None, None, None


lib.impl("ffn_train", lambda *a: Fn.apply(*a), "Autograd")


class FnDirect(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, wg, wu, wd):
        out = dispatch.ffn_train_forward(x, wg, None, wu, None, wd, None, 256, 16, "pd", False)
        ctx.save_for_backward(x, wg, wu, wd, *out[1:])
        return out[0]

    @staticmethod
    def backward(ctx, dy):
        x, wg, wu, wd, *saved = ctx.saved_tensors
        g = dispatch.ffn_train_backward(dy, x, wg, None, wu, None, wd, *saved, 0.0)
        return g[0], g[1], g[3], g[5]


@torch.library.custom_op("probe4::clone", mutates_args=())
def clone_c(t: torch.Tensor) -> torch.Tensor:
    return t.clone()


clone_c.register_autograd(lambda ctx, g: g, setup_context=lambda ctx, inputs, output: None)
lib5 = torch.library.Library("probe5", "FRAGMENT")
lib5.define("clone(Tensor t) -> Tensor")
lib5.impl("clone", lambda t: t.clone(), "CUDA")


class CloneFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        with torch._C._AutoDispatchBelowAutograd():
            return torch.ops.probe5.clone(t)

    @staticmethod
    def backward(ctx, g):
        return g


lib5.impl("clone", lambda t: CloneFn.apply(t), "Autograd")


def grad_of(f):
    return lambda: torch.autograd.grad(f(), params, dy)


xs = x[:, :64].detach().clone().requires_grad_()
gs = torch.randn_like(xs)
cases = {
    "eager": grad_of(lambda: ffn_dense(x, wg, None, wu, None, wd, None)),
    "custom_op": grad_of(lambda: torch.ops.twell.ffn_train(x, wg, None, wu, None, wd, None, 256, 16, 0.0, "p1", False)[0]),
    "library_fn": grad_of(lambda: torch.ops.probe3.ffn_train(x, wg, None, wu, None, wd, None, 256, 16, 0.0, "p2", False)[0]),
    "fn_direct": grad_of(lambda: FnDirect.apply(x, wg, wu, wd)),
    "clone_aten": lambda: torch.autograd.grad(xs.clone(), xs, gs),
    "clone_custom_op": lambda: torch.autograd.grad(clone_c(xs), xs, gs),
    "clone_library_fn": lambda: torch.autograd.grad(torch.ops.probe5.clone(xs), xs, gs),
}
ref = cases["eager"]()
for name, fn in cases.items():
    for _ in range(10):
        out = fn()
    if name in ("custom_op", "library_fn", "fn_direct"):
        err = max(float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(out, ref))
        print(f"{name}: max rel diff of grads vs eager {err:.2e}")
torch.cuda.synchronize()
best = {name: (1e9, 1e9) for name in cases}
for _ in range(3):
    for name, fn in cases.items():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        host = (time.perf_counter() - t0) / 200 * 1e6
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / 200 * 1e6
        best[name] = min(best[name], (wall, host))
for name, (wall, host) in best.items():
    print(f"M={m} {name:>17}: wall {wall:8.1f} us/step, host {host:8.1f}", flush=True)
