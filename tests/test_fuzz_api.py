"""Property tests of the public API against eager: ``torch.compile(backend="twell")``,
``twell_compile.prepare`` and ``twell_compile.explain`` on small ReLU FFNs drawn at random.

Three families of inputs, each once a source of silent wrong results or crashes:

* torch.func transforms (vmap, grad, jacrev, jvp, forward-mode AD) around a compiled model,
  inside a compiled function, and around a prepared model in eager;
* biases that broadcast ([1], 0-d, [1, N]) besides [N] and none, on every linear spelling;
* in-place writes between the projections into the input, a view or slice of it, a weight
  or a bias (rejected), or into fresh tensors (still rewritten).

Every example compares with eager PyTorch through ``check_close`` (outputs, and gradients of
the input and every parameter where one is taken). Example counts are kept small: the file
runs in well under a minute on two CPU cores.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, given, settings, strategies as st

import twell_compile

from tests.helpers import REWRITE_ALL, check_close  # noqa: E402

FUZZ = settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), derandomize=False)
LINEARS = ("F.linear", "addmm", "matmul+add")
BIASES = (None, "W", (1,), (), (1, "W"))          # "W": the projection's width


class FFN(nn.Module):
    """down(relu(gate(x)) * up(x)) or down(relu(gate(x))), gate and up optionally one fused
    projection split by chunk; each projection spelled ``linear`` with a bias of ``biases[i]``
    (None, or a shape in which "W" stands for the projection's width)."""

    def __init__(self, linear: str, biases: tuple, gated: bool, fused: bool, k: int, n: int):
        super().__init__()
        self.linear, self.gated, self.fused = linear, gated, fused and gated
        widths = {"gate": 2 * n if self.fused else n, "up": n, "down": k}
        inputs = {"gate": k, "up": k, "down": n}
        names = ["gate", "down"] if not gated or self.fused else ["gate", "up", "down"]
        for name, bias in zip(names, biases):
            setattr(self, f"w_{name}", nn.Parameter(torch.randn(widths[name], inputs[name]) / inputs[name] ** 0.5))
            shape = None if bias is None else tuple(widths[name] if d == "W" else d for d in bias)
            setattr(self, f"b_{name}", nn.Parameter(torch.randn(shape) / 4) if shape is not None else None)

    def proj(self, x: torch.Tensor, name: str) -> torch.Tensor:
        w, b = getattr(self, f"w_{name}"), getattr(self, f"b_{name}")
        if self.linear == "F.linear":
            return F.linear(x, w, b)
        if self.linear == "addmm":          # GPT-2's Conv1D: tokens flattened, then viewed back
            x2 = x.reshape(-1, x.shape[-1])
            y = torch.addmm(b, x2, w.t()) if b is not None else torch.mm(x2, w.t())
            return y.view(x.shape[:-1] + (w.shape[0],))
        y = x @ w.t()
        return y + b if b is not None else y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            g, u = self.proj(x, "gate").chunk(2, dim=-1)
        else:
            g = self.proj(x, "gate")
            u = self.proj(x, "up") if self.gated else None
        h = F.relu(g)
        return self.proj(h * u if u is not None else h, "down")


class Builder:
    """Makes a fresh FFN with the same weights at each call; prints its arguments."""

    def __init__(self, seed: int, *args: Any):
        self.seed, self.args = seed, args

    def __call__(self) -> FFN:
        torch.manual_seed(self.seed)
        return FFN(*self.args)

    def __repr__(self) -> str:
        return f"Builder(seed={self.seed}, linear, biases, gated, fused, k, n={self.args})"


@st.composite
def ffns(draw, biases=st.sampled_from(BIASES)) -> Builder:
    linear = draw(st.sampled_from(LINEARS))
    gated, fused = draw(st.booleans()), draw(st.booleans())
    bs = tuple(draw(biases) for _ in range(3))
    k, n = draw(st.integers(1, 9)), draw(st.integers(1, 13))
    return Builder(draw(st.integers(0, 2 ** 16)), linear, bs, gated, fused, k, n)


def _tuple(v: Any) -> tuple:
    if isinstance(v, dict):
        return tuple(v.values())
    return v if isinstance(v, tuple) else (v,)


def _compare(name: str, got: Any, want: Any) -> None:
    for i, (a, b) in enumerate(zip(_tuple(got), _tuple(want), strict=True)):
        if isinstance(b, tuple):
            _compare(f"{name}[{i}]", a, b)
        else:
            check_close(f"{name}[{i}]", a, b)


def _param_grads(model: nn.Module, x: torch.Tensor, out: torch.Tensor, dy: torch.Tensor) -> tuple:
    leaves = [x] + list(model.parameters())
    return torch.autograd.grad(out, leaves, dy, allow_unused=True)


# ------------------------------------------------------------------------------ transforms
def _dual(fn: Callable, x: torch.Tensor, t: torch.Tensor) -> tuple:
    with fwAD.dual_level():
        out = fwAD.unpack_dual(fn(fwAD.make_dual(x, t)))
        return out.primal, out.tangent


def _functional(m: nn.Module, p: dict, x: torch.Tensor) -> torch.Tensor:
    return torch.func.functional_call(m, p, (x,))


def _compiled(fn: Callable) -> Callable:
    return torch.compile(fn, backend="twell", options=REWRITE_ALL)


# name: (run(model, x, t, wrap) -> result); ``wrap`` compiles (or not) the right callable:
# around the model for "of_compiled", around the whole transform for "compiled_".
TRANSFORMS: dict[str, Callable[..., Any]] = {
    "plain": lambda m, x, t, w: w(m)(x),
    "vmap": lambda m, x, t, w: w(torch.func.vmap(m))(x.unsqueeze(1)),
    "grad_of_compiled": lambda m, x, t, w: torch.func.grad(lambda x: w(m)(x).sum())(x),
    "compiled_grad": lambda m, x, t, w: w(torch.func.grad(lambda x: m(x).sum()))(x),
    "jacrev_of_compiled": lambda m, x, t, w: torch.func.jacrev(w(m))(x),
    "compiled_jacrev": lambda m, x, t, w: w(torch.func.jacrev(m))(x),
    "jvp_of_compiled": lambda m, x, t, w: torch.func.jvp(w(m), (x,), (t,)),
    "compiled_jvp": lambda m, x, t, w: w(lambda x: torch.func.jvp(m, (x,), (t,)))(x),
    "compiled_dual_level": lambda m, x, t, w: w(lambda x: _dual(m, x, t))(x),
    "grad_params_of_compiled": lambda m, x, t, w: torch.func.grad(
        lambda p: w(_functional)(m, p, x).square().sum())({k: v.detach() for k, v in m.named_parameters()}),
}


@FUZZ
@given(build=ffns(), transform=st.sampled_from(list(TRANSFORMS)), grad=st.booleans(),
       tokens=st.integers(1, 5))
def test_fuzz_transforms_of_compiled_models(build, transform: str, grad: bool, tokens: int) -> None:
    """Every transform, around a compiled model or compiled around the transform, equals the
    same transform of the eager model; under vmap in grad mode the weights get gradients."""
    torch._dynamo.reset()
    model, ref = build(), build()
    k = model.w_gate.shape[1]
    x = torch.randn(tokens, k)
    t = torch.randn(tokens, k)
    run = TRANSFORMS[transform]
    xs = [x.clone().requires_grad_(grad and transform in ("plain", "vmap")) for _ in range(2)]
    with torch.set_grad_enabled(grad):
        got = run(model, xs[0], t, _compiled)
        want = run(ref, xs[1], t, lambda f: f)
    _compare(transform, got, want)
    if grad and transform in ("plain", "vmap"):
        dy = torch.randn_like(want)
        g_got, g_want = _param_grads(model, xs[0], got, dy), _param_grads(ref, xs[1], want, dy)
        for (name, _), a, b in zip([("x", None)] + list(model.named_parameters()), g_got, g_want, strict=True):
            assert (a is None) == (b is None), f"grad {name}: {a} vs {b}"
            if b is not None:
                check_close(f"grad {name}", a, b)


PREPARED_TRANSFORMS: dict[str, Callable[..., Any]] = {
    "grad": lambda m, x, t: torch.func.grad(lambda x: m(x).sum())(x),
    "jacrev": lambda m, x, t: torch.func.jacrev(m)(x),
    "jvp": lambda m, x, t: torch.func.jvp(m, (x,), (t,)),
    "vmap": lambda m, x, t: torch.func.vmap(m)(x.unsqueeze(1)),
    "forward_ad": lambda m, x, t: _dual(m, x, t),
    "grad_params": lambda m, x, t: torch.func.grad(
        lambda p: torch.func.functional_call(m, p, (x,)).square().sum())({k: v.detach() for k, v in m.named_parameters()}),
}


@FUZZ
@given(build=ffns(biases=st.sampled_from((None, "W", (1,)))), transform=st.sampled_from(list(PREPARED_TRANSFORMS)),
       grad=st.booleans(), tokens=st.integers(1, 4))
def test_fuzz_transforms_of_prepared_models(build, transform: str, grad: bool, tokens: int) -> None:
    """A prepared model under torch.func transforms and forward-mode AD equals the eager
    model (it runs its original forward while a transform is active)."""
    model, ref = build(), build()
    report = twell_compile.prepare(model)
    assert len(report.rewrites) == 1, str(report)
    k = model.w_gate.shape[1]
    x, t = torch.randn(tokens, k), torch.randn(tokens, k)
    with torch.set_grad_enabled(grad):
        got = PREPARED_TRANSFORMS[transform](model, x, t)
        want = PREPARED_TRANSFORMS[transform](ref, x, t)
    _compare(transform, got, want)


# ------------------------------------------------------------------------------ bias shapes
@FUZZ
@given(build=ffns(), grad=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
       batch=st.sampled_from([(3,), (2, 3), (1,)]))
def test_fuzz_bias_shapes(build, grad: bool, dtype: torch.dtype, batch: tuple) -> None:
    """Any per-feature bias shape is rewritten (broadcast ones expanded to [N]); outputs and
    the gradients of x and every parameter (biases summed over their broadcast) equal eager."""
    if dtype == torch.bfloat16 and (grad or build.args[0] == "matmul+add"):
        # bf16 ``x @ w.t() + b`` rounds twice in eager, the op once (as eager's F.linear), and
        # at a few tokens a bf16 gradient of eager's can be exact by luck where ours is 1 ulp
        # off: beyond check_close's rule, and not what this test is about (shapes). fp32 there.
        dtype = torch.float32
    torch._dynamo.reset()
    model, ref, ref64 = build().to(dtype), build().to(dtype), build().double()
    k = model.w_gate.shape[1]
    x = torch.randn(*batch, k)
    xs = [x.to(dtype).requires_grad_(grad) for _ in range(2)]
    x64 = x.double().requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        report = twell_compile.explain(model, xs[0], options=REWRITE_ALL)
        got = torch.compile(model, backend="twell", options=REWRITE_ALL)(xs[0])
        want = ref(xs[1])
        y64 = ref64(x64)
    assert len(report.rewrites) == 1 and not report.rejections, str(report)
    assert report.rewrites[0].op == ("twell::ffn_train" if grad else "twell::ffn")
    check_close("output", got, want, y64)
    if grad:
        dy = torch.randn(want.shape)
        g = [_param_grads(m, xx, y, dy.to(y.dtype)) for m, xx, y in ((model, xs[0], got), (ref, xs[1], want),
                                                                     (ref64, x64, y64))]
        names = ["x"] + [name for name, _ in model.named_parameters()]
        for name, a, b, c in zip(names, *g, strict=True):
            assert a.shape == b.shape, name
            check_close(f"grad {name}", a, b, c)


# ------------------------------------------------------------------------------ in-place writes
def _assign_row(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    x[0] = 0.5          # setitem
    return x


def _writes() -> dict[str, tuple[Callable[[nn.Module, torch.Tensor], Any], bool]]:
    """name: (write(model, x) run between the projections, whether it may touch what the
    block reads: then the FFN must be left to Inductor)."""
    return {
        "x_slice_mul_": (lambda m, x: x[..., :1].mul_(2), True),
        "x_view_add_": (lambda m, x: x.view(-1).add_(1), True),
        "x_transpose_row_zero_": (lambda m, x: x.transpose(0, 1)[0].zero_(), True),
        "x_setitem": (_assign_row, True),
        "x_out": (lambda m, x: torch.mul(x.detach(), 3, out=x), True),
        "x_copy_": (lambda m, x: x.copy_(x.flip(0)), True),
        "gate_weight_data": (lambda m, x: m.w_gate.data.mul_(2), True),
        "down_weight_data_t": (lambda m, x: m.w_down.data.t()[0].fill_(0.25), True),
        "gate_bias_data": (lambda m, x: m.b_gate.data.add_(1) if m.b_gate is not None else m.w_gate.data.neg_(), True),
        "fresh_tensor": (lambda m, x: torch.ones(2).mul_(3), False),
        "fresh_from_x": (lambda m, x: (x * 2).add_(1), False),
    }


class Written(nn.Module):
    """An FFN whose forward runs ``write`` after its gate projection (``where="after_gate"``)
    or after its up projection, before the rest of the block."""

    def __init__(self, ffn: FFN, write: Callable, where: str):
        super().__init__()
        self.ffn, self.write, self.where = ffn, write, where

    def forward(self, x: torch.Tensor):
        f = self.ffn
        if f.fused:
            gu = f.proj(x, "gate")
            junk = self.write(f, x)
            g, u = gu.chunk(2, dim=-1)
        else:
            if self.where == "after_up" and f.gated:
                u = f.proj(x, "up")
                junk = self.write(f, x)
                g = f.proj(x, "gate")
            else:
                g = f.proj(x, "gate")
                junk = self.write(f, x)
                u = f.proj(x, "up") if f.gated else None
        h = F.relu(g)
        return f.proj(h * u if u is not None else h, "down"), junk


@FUZZ
@given(build=ffns(biases=st.sampled_from((None, "W", (1,)))), write=st.sampled_from(list(_writes())),
       where=st.sampled_from(["after_gate", "after_up"]), grad=st.booleans())
def test_fuzz_inplace_writes_between_projections(build, write: str, where: str, grad: bool) -> None:
    """Writes that may reach the block's input, weights or biases leave it to Inductor (the
    report names the in-place write); writes into fresh tensors keep the rewrite. Compiled
    equals eager either way, each run from the same weights and input."""
    # In grad mode autograd saved x for the weight gradients: writing it is eager's error at
    # backward and AOTAutograd's at compile time (Inductor's too), not a case to compare.
    assume(not (grad and write.startswith("x_")))
    fn, touches = _writes()[write]
    tokens = 3

    def fresh() -> Written:
        return Written(build(), fn, where)

    k = fresh().ffn.w_gate.shape[1]
    x = torch.randn(2, tokens, k)
    with torch.set_grad_enabled(grad):
        torch._dynamo.reset()
        report = twell_compile.explain(fresh(), x.clone(), options=REWRITE_ALL)
        torch._dynamo.reset()
        got, _ = torch.compile(fresh(), backend="twell", options=REWRITE_ALL)(x.clone())
        want, _ = fresh()(x.clone())
    if touches:
        assert not report.rewrites, str(report)
        assert any("modified in place" in r.reason for r in report.rejections), str(report)
    else:
        assert len(report.rewrites) == 1 and not report.rejections, str(report)
    check_close(write, got, want)
