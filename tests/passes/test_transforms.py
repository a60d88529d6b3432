"""FFNs under torch.func transforms and forward-mode AD (``passes/transforms.py``): inside a
transform they are rejected with the transform named, outside its region they are
rewritten; results and gradients equal eager's."""

from __future__ import annotations

import pytest
import torch

import twell_compile
from twell_compile.passes.match_ffn import Rejection, find_ffns
from twell_compile.passes.transforms import transform_regions
from twell_compile.testing import GatedMLP

from tests.helpers import REWRITE_ALL
from tests.passes.ffn_zoo import K, N
from tests.passes.graph_capture import dynamo_graph
from tests.passes.rewrite_harness import PassBackend, check_close


def _dual_inside(mlp, t):
    import torch.autograd.forward_ad as fwAD

    def f(x):
        with fwAD.dual_level():
            out = fwAD.unpack_dual(mlp(fwAD.make_dual(x, t)))
            return out.primal, out.tangent
    return f


TRANSFORMS = {
    # name: (function of (mlp, tangent) to compile, input shape, expected reason)
    "vmap": (lambda mlp, t: torch.func.vmap(mlp), (4, 3, K), "torch.func.vmap"),
    "grad": (lambda mlp, t: torch.func.grad(lambda x: mlp(x).sum()), (3, K), "torch.func.grad"),
    "jacrev": (lambda mlp, t: torch.func.jacrev(mlp), (2, K), "torch.func.grad"),
    "jvp": (lambda mlp, t: lambda x: torch.func.jvp(mlp, (x,), (t,)), (2, K), "torch.func.jvp"),
    "dual_level": (_dual_inside, (2, K), "forward_ad.dual_level"),
}


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_ffn_inside_a_functorch_transform_is_left_to_inductor(name: str, grad: bool) -> None:
    """Inside a torch.func transform the traced values are functorch wrappers (vmap's hide
    requires_grad, so the inference op was chosen and the weights got no gradient): such
    FFNs are rejected with the transform named; results and gradients equal eager's."""
    make, shape, reason = TRANSFORMS[name]
    torch.manual_seed(0)
    mlp = GatedMLP(K, N, bias=True)
    t = torch.randn(shape)
    x = torch.randn(shape)
    fn = make(mlp, t)
    with torch.set_grad_enabled(grad):
        gm = dynamo_graph(fn, x)
        report = twell_compile.explain(fn, x, options=REWRITE_ALL)
    found = find_ffns(gm.graph)
    assert len(found) == 1 and isinstance(found[0], Rejection) and reason in found[0].reason, found
    assert not report.rewrites and len(report.rejections) == 1 and reason in report.rejections[0].reason, str(report)

    backend = PassBackend()
    xs = [x.clone().requires_grad_(grad) for _ in range(2)]
    with torch.set_grad_enabled(grad):
        torch._dynamo.reset()
        got = torch.compile(fn, backend=backend)(xs[0])
        want = fn(xs[1])
    assert not backend.twell_ops()
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    for a, b in zip(got, want, strict=True):
        check_close("output", a, b)
    if grad and want[0].requires_grad:
        dy = torch.randn_like(want[0])
        params = list(mlp.parameters())
        g_got = torch.autograd.grad(got[0], [xs[0]] + params, dy, allow_unused=True)
        g_want = torch.autograd.grad(want[0], [xs[1]] + params, dy, allow_unused=True)
        for pname, a, b in zip(["x"] + [n for n, _ in mlp.named_parameters()], g_got, g_want, strict=True):
            assert (a is None) == (b is None), pname
            if b is not None:
                check_close(f"grad {pname}", a, b)


def test_ffn_outside_the_transform_region_is_rewritten() -> None:
    """Only the nodes between a transform's enter and exit are inside it: an FFN before a vmap
    in the same graph is rewritten, the one inside is not."""
    torch.manual_seed(0)
    first, second = GatedMLP(K, N, bias=True), GatedMLP(K, N, bias=True)

    def fn(x):
        return torch.func.vmap(second)(first(x))

    x = torch.randn(4, 3, K)
    with torch.no_grad():
        gm = dynamo_graph(fn, x)
        regions = transform_regions(gm.graph)
        found = find_ffns(gm.graph)
        backend = PassBackend()
        got = torch.compile(fn, backend=backend)(x)
        want = fn(x)
    assert [type(f).__name__ for f in found] == ["Match", "Rejection"], found
    assert found[0].down.out not in regions and "vmap" in regions[found[1].down]
    assert backend.twell_ops() == ["twell::ffn"]
    check_close("output", got, want)
