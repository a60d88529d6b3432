"""The FFN matcher on real Dynamo graphs: every spelling matches, every near-miss is rejected.

Property test: hypothesis generates FFN modules over the variant space (ffn_zoo) and checks
that ``find_ffns`` finds exactly that block (the right weights, layout, fused-slice rows,
bias) and that ``explain`` reports exactly one rewrite with the right op. Near-misses must
not match and, when FFN-shaped, come back as rejections with a plain reason; outputs of the
passes-applied graph stay bit-identical to eager.
"""

from __future__ import annotations

import math
import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, given, settings, strategies as st

import twell_compile
from twell_compile.passes.match_ffn import Match, Rejection, find_ffns
from twell_compile.passes.pass_utils import skip

from tests.helpers import REWRITE_ALL
from tests.passes.ffn_zoo import K, N, NearMiss, Spec, build, eager_allows, specs
from tests.passes.graph_capture import dynamo_graph, param_name
from tests.passes.rewrite_harness import PassBackend


def _names(spec: Spec) -> tuple[str, str | None, str]:
    """Expected parameter names of gate, up and down weights."""
    sub = ".lin" if spec.linear == "nn.Linear" else ""
    if spec.gated and spec.split:
        return f"gate_up{sub}.weight", f"gate_up{sub}.weight", f"down{sub}.weight"
    return f"gate{sub}.weight", (f"up{sub}.weight" if spec.gated else None), f"down{sub}.weight"


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(spec=specs(), grad=st.booleans())
def test_matcher_finds_every_spelling(spec: Spec, grad: bool) -> None:
    assume(eager_allows(spec, grad))
    model = build(spec)
    x = torch.randn(*spec.batch, spec.k)
    with torch.set_grad_enabled(grad):
        gm = dynamo_graph(model, x)
    found = find_ffns(gm.graph)
    assert len(found) == 1 and isinstance(found[0], Match), f"{spec.describe()}: {found}"
    m = found[0]
    assert m.gated == spec.gated and m.act == spec.act
    gate_w, up_w, down_w = _names(spec)
    assert param_name(m.gate.weight) == gate_w
    assert param_name(m.down.weight) == down_w
    transposed = spec.linear in ("x@W", "addmm")
    assert m.gate.transposed == m.down.transposed == transposed
    assert (m.gate.bias is not None) == (m.down.bias is not None) == spec.bias
    assert skip(m.x).op == "placeholder" and skip(m.x).target == "L_x_"
    if spec.gated:
        assert param_name(m.up.weight) == up_w
        assert m.up.transposed == transposed and (m.up.bias is not None) == spec.bias
        if spec.split:
            assert (m.gate.rows, m.up.rows) == ((0, spec.n), (spec.n, 2 * spec.n))
        else:
            assert m.gate.rows is None and m.up.rows is None
    else:
        assert m.up is None and m.gate.rows is None

    with torch.set_grad_enabled(grad):
        report = twell_compile.explain(model, x, options=REWRITE_ALL)
    assert len(report.rewrites) == 1 and not report.rejections, str(report)
    r = report.rewrites[0]
    needs_grad = grad  # parameters require grad by default
    assert r.op == ("twell::ffn_train" if needs_grad else "twell::ffn")
    assert (r.gated, r.k, r.n, r.k_out, r.act) == (spec.gated, spec.k, spec.n, spec.k_out, spec.act)


# ------------------------------------------------------------------------------ near-misses (NearMiss: ffn_zoo)
def _split(s, x):
    return s.fused(x).chunk(2, dim=-1)


def _gelu_new(x):
    """GPT-2's activation, written out as Hugging Face's NewGELUActivation does."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def _assign_row(t):
    t[0] = 1.0      # setitem
    return t


NEAR_MISSES = {
    # name: (body, expected rejection reason or None when not FFN-shaped)
    "silu_gate": (lambda s, x, x2: s.down(F.silu(s.gate(x)) * s.up(x)), "gate activation is SiLU"),
    "gelu_gate": (lambda s, x, x2: s.down(F.gelu(s.gate(x)) * s.up(x)), "gate activation is GELU"),
    "gelu_tanh_gate": (lambda s, x, x2: s.down(F.gelu(s.gate(x), approximate="tanh") * s.up(x)),
                       "gate activation is GELU"),
    "tanh_gate": (lambda s, x, x2: s.down(torch.tanh(s.gate(x)) * s.up(x)), "gate activation is tanh"),
    "silu_fused": (lambda s, x, x2: (lambda g, u: s.down(F.silu(g) * u))(*_split(s, x)),
                   "gate activation is SiLU"),
    "gelu_non_gated": (lambda s, x, x2: s.down(F.gelu(s.gate(x))), "activation is GELU"),
    "silu_module_non_gated": (lambda s, x, x2: s.down(nn.SiLU()(s.gate(x))), "activation is SiLU"),
    "composite_gelu_non_gated": (lambda s, x, x2: s.down(_gelu_new(s.gate(x))), "elementwise expression"),
    "composite_gelu_gated": (lambda s, x, x2: s.down(_gelu_new(s.gate(x)) * s.up(x)), "gate activation is an elementwise"),
    "quick_gelu_non_gated": (lambda s, x, x2: (lambda g: s.down(g * torch.sigmoid(1.702 * g)))(s.gate(x)),
                             "elementwise expression"),
    "bilinear": (lambda s, x, x2: s.down(s.gate(x) * s.up(x)), "no activation"),
    # the ReLU family's neighbours: only relu(.)^2 (squared ReLU: relu(g)^2 [* up]) and
    # relu(g) * relu(u) (dReLU) are rewritten (test_fuse_ffn.py), these not
    "relu_cubed": (lambda s, x, x2: s.down(F.relu(s.gate(x)) ** 3), "raised to the power 3"),
    "relu_cubed_gated": (lambda s, x, x2: s.down(F.relu(s.gate(x)) ** 3 * s.up(x)), "raised to the power 3"),
    "relu_pow_half_gated": (lambda s, x, x2: s.down(s.up(x) * torch.pow(F.relu(s.gate(x)), 0.5)), "power 0.5"),
    "squared_gate_relu_up": (lambda s, x, x2: s.down(F.relu(s.gate(x)) ** 2 * F.relu(s.up(x))),
                             "squared ReLU takes the up projection as it is"),
    "relu_of_product": (lambda s, x, x2: s.down(F.relu(s.gate(x) * s.up(x))), None),
    "square_of_product": (lambda s, x, x2: s.down(torch.square(F.relu(s.gate(x)) * s.up(x))), "goes through square"),
    "relu_times_relu_of_two_projections": (lambda s, x, x2: s.down(F.relu(s.gate(x)) * F.relu(s.gate(x2))),
                                           "read different inputs"),
    "relu_squared_then_scaled": (lambda s, x, x2: s.down(F.relu(s.gate(x)) ** 2 * 0.5), "goes through mul"),
    "relu_returned": (lambda s, x, x2: (lambda h: (s.down(h * s.up(x)), h))(F.relu(s.gate(x))),
                      "has other users"),
    "relu_into_residual": (lambda s, x, x2: (lambda h: s.down(h) + h.sum(-1, keepdim=True))(F.relu(s.gate(x))),
                           "has other users"),
    "gate_returned": (lambda s, x, x2: (lambda g: (s.down(F.relu(g) * s.up(x)), g))(s.gate(x)),
                      "has other users"),
    "up_into_residual": (lambda s, x, x2: (lambda u: s.down(F.relu(s.gate(x)) * u) + u[..., :K])(s.up(x)),
                         "has other users"),
    "product_returned": (lambda s, x, x2: (lambda h: (s.down(h), h))(F.relu(s.gate(x)) * s.up(x)),
                         "has other users"),
    "train_dropout_gated": (lambda s, x, x2: s.down(F.dropout(F.relu(s.gate(x)) * s.up(x), 0.5, True)),
                            "dropout in training mode"),
    "train_dropout_non_gated": (lambda s, x, x2: s.down(F.dropout(F.relu(s.gate(x)), 0.3, True)),
                                "dropout in training mode"),
    "different_inputs": (lambda s, x, x2: s.down(F.relu(s.gate(x)) * s.up(x2)), "read different inputs"),
    "scaled_product": (lambda s, x, x2: s.down(F.relu(s.gate(x)) * s.up(x) * 0.5), "goes through mul"),
    "inplace_relu_reused": (lambda s, x, x2: (lambda g: s.down(F.relu(g, inplace=True) * g))(s.gate(x)),
                            "in-place ReLU"),
    "inplace_relu_overlapping_slices": (
        lambda s, x, x2: (lambda gu: s.down(F.relu(gu[..., :N], inplace=True) * gu[..., 2:N + 2]))(s.fused(x)),
        "in-place ReLU"),
    "input_written_between": (lambda s, x, x2: (lambda g: (x.mul_(2), s.down(F.relu(g) * s.up(x)))[1])(s.gate(x)),
                              "modified in place"),
    # In-place writes between the projections into anything that may share storage with the
    # input: eager's gate and up read different values, the one op would read one.
    "input_slice_written": (lambda s, x, x2: (lambda g: (x[..., :2].mul_(2), s.down(F.relu(g) * s.up(x)))[1])(s.gate(x)),
                            "modified in place"),
    "input_view_written": (lambda s, x, x2: (lambda g: (x.view(-1).add_(1), s.down(F.relu(g) * s.up(x)))[1])(s.gate(x)),
                           "modified in place"),
    "input_transposed_row_zeroed": (
        lambda s, x, x2: (lambda g: (x.transpose(0, 1)[0].zero_(), s.down(F.relu(g) * s.up(x)))[1])(s.gate(x)),
        "modified in place"),
    "input_row_assigned": (lambda s, x, x2: (lambda g: (_assign_row(x), s.down(F.relu(g) * s.up(x)))[1])(s.gate(x)),
                           "modified in place"),
    "input_written_by_out": (lambda s, x, x2: (lambda g: (torch.add(x2, 1, out=x), s.down(F.relu(g) * s.up(x)))[1])(s.gate(x)),
                             "modified in place"),
    "input_copied_into": (lambda s, x, x2: (lambda g: (x.copy_(x2), s.down(F.relu(g) * s.up(x)))[1])(s.gate(x)),
                          "modified in place"),
    "input_written_after_up": (lambda s, x, x2: (lambda u: (x.mul_(2), s.down(F.relu(s.gate(x)) * u))[1])(s.up(x)),
                               "modified in place"),
    "computed_input_written": (
        lambda s, x, x2: (lambda h: (lambda g: (h.add_(1), s.down(F.relu(g) * s.up(h)))[1])(s.gate(h)))(x * 2),
        "modified in place"),
    "bias_per_token": (lambda s, x, x2: s.down(F.relu(F.linear(x, s.gate.weight, s.gate.bias.expand(3, N))) * s.up(x)),
                       "not one value per output feature"),
    # Not FFN-shaped: nothing to rewrite and nothing to report.
    "relu_after_last_linear": (lambda s, x, x2: F.relu(s.gate(x)), None),
    "relu_before_first_linear": (lambda s, x, x2: s.gate(F.relu(x)), None),
    "relu_of_input_times_projection": (lambda s, x, x2: s.down(F.relu(x2[..., :1].expand(*x.shape[:-1], N)) * s.up(x)),
                                       "ReLU's input is"),
}


def _run_exact(model: nn.Module, x: torch.Tensor, x2: torch.Tensor, grad: bool):
    backend = PassBackend()
    with torch.set_grad_enabled(grad):
        torch.manual_seed(1)
        got = torch.compile(model, backend=backend)(x.clone(), x2.clone())
        torch.manual_seed(1)
        want = model(x.clone(), x2.clone())
    return backend, got, want


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("name", list(NEAR_MISSES))
def test_near_miss_is_not_rewritten(name: str, grad: bool) -> None:
    body, reason = NEAR_MISSES[name]
    torch.manual_seed(0)
    model = NearMiss(body).eval()
    x, x2 = torch.randn(2, 3, K), torch.randn(2, 3, K)
    with torch.set_grad_enabled(grad):
        torch.manual_seed(1)
        report = twell_compile.explain(model, x.clone(), x2.clone(), options=REWRITE_ALL)
    assert not report.rewrites, str(report)
    if reason is None:
        assert not report.rejections, str(report)
    else:
        assert len(report.rejections) == 1, str(report)
        assert reason in report.rejections[0].reason, str(report)

    backend, got, want = _run_exact(model, x, x2, grad)
    assert not backend.twell_ops()
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------ several FFNs
def _linear_relu_stack(*widths: int, relu_after: tuple[int, ...]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        layers.append(nn.Linear(a, b))
        if i in relu_after:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


@pytest.mark.parametrize("widths, relu_after, expected", [
    ((8, 20, 8), (0,), 1),                    # classic 2-layer MLP
    ((8, 20, 20, 8), (0, 1), 1),              # L R L R L: the first pair is claimed, the rest stays
    ((8, 20, 8, 20, 8), (0, 2), 2),           # two FFNs back to back: the second reads the first's output
    ((8, 20, 8, 20, 8, 20, 8), (0, 2, 4), 3),
    ((8, 20, 8), (), 0),                      # no ReLU at all
    ((8, 20, 8), (1,), 0),                    # ReLU after the last linear only
])
def test_linear_relu_stacks(widths, relu_after, expected) -> None:
    torch.manual_seed(0)
    model = _linear_relu_stack(*widths, relu_after=relu_after).eval()
    x = torch.randn(3, widths[0])
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            report = twell_compile.explain(model, x, options=REWRITE_ALL)
        assert len(report.rewrites) == expected, str(report)
        backend = PassBackend()
        with torch.set_grad_enabled(grad):
            torch._dynamo.reset()
            got = torch.compile(model, backend=backend)(x)
            want = model(x)
        assert len(backend.twell_ops()) == expected
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_rejections_name_the_layer() -> None:
    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = NearMiss(NEAR_MISSES["silu_gate"][0])

        def forward(self, x):
            return self.mlp(x, x)

    report = twell_compile.explain(Outer().eval(), torch.randn(4, K), options=REWRITE_ALL)
    assert [r.layer for r in report.rejections] == ["mlp"], str(report)
    assert "SiLU" in str(report)


def test_inplace_relu_on_disjoint_fused_slices_is_rewritten() -> None:
    """relu_ on the gate half of a fused projection leaves the up half alone: safe to rewrite."""
    torch.manual_seed(0)
    model = NearMiss(lambda s, x, x2: (lambda gu: s.down(gu[..., :N].relu_() * gu[..., N:]))(s.fused(x))).eval()
    x = torch.randn(5, K)
    with torch.no_grad():
        report = twell_compile.explain(model, x, x, options=REWRITE_ALL)
        backend = PassBackend()
        torch._dynamo.reset()
        got = torch.compile(model, backend=backend)(x, x)
        want = model(x, x)
    assert len(report.rewrites) == 1 and not report.rejections, str(report)
    assert backend.twell_ops() == ["twell::ffn"]
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_find_ffns_reports_operator_spellings() -> None:
    """operator.mul with the ReLU on the right and the up branch on the left still matches."""
    torch.manual_seed(0)
    model = NearMiss(lambda s, x, x2: s.down(operator.mul(s.up(x), torch.relu(s.gate(x))))).eval()
    gm = dynamo_graph(model, torch.randn(3, K), torch.randn(3, K))
    found = find_ffns(gm.graph)
    assert len(found) == 1 and isinstance(found[0], Match) and not isinstance(found[0], Rejection)
    assert param_name(found[0].gate.weight) == "gate.weight"
    assert param_name(found[0].up.weight) == "up.weight"


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_transformer_encoder_layer(grad: bool) -> None:
    """With a gradient the layer runs its Python path and the ReLU FFN is rewritten; without one
    PyTorch takes the fused fast path (one ATen op for the layer): reported, not rewritten."""
    torch.manual_seed(0)
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 40, batch_first=True), 2,
                                  enable_nested_tensor=False).eval()
    x = torch.randn(2, 5, 16)
    with torch.set_grad_enabled(grad):
        report = twell_compile.explain(model, x, options=REWRITE_ALL)
        backend = PassBackend()
        torch._dynamo.reset()
        got = torch.compile(model, backend=backend)(x)
        want = model(x)
    if grad:
        assert len(report.rewrites) == 2 and not report.rejections, str(report)
        assert backend.twell_ops() == ["twell::ffn_train"] * 2
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        assert not report.rewrites and len(report.rejections) == 2, str(report)
        assert all("fast path" in r.reason for r in report.rejections)
        assert torch.equal(got, want)
