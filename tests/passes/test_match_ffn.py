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
from torch import fx

import twell_compile
from twell_compile.passes.match_ffn import (Match, Rejection, find_ffns, layer_name, module_path, skip,
                                           transform_regions)

from tests.helpers import REWRITE_ALL
from tests.passes.ffn_zoo import Spec, build, eager_allows, specs
from tests.passes.graph_capture import dynamo_graph, param_name
from tests.passes.rewrite_harness import PassBackend, check_close
from twell_compile.testing import GatedMLP


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


# ------------------------------------------------------------------------------ near-misses
K, N = 8, 12


class NearMiss(nn.Module):
    """Parameters for the near-miss bodies below: gate, up, down, and a spare projection."""

    def __init__(self, body):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(K, N), nn.Linear(K, N), nn.Linear(N, K)
        self.fused = nn.Linear(K, 2 * N)
        self.body = body

    def forward(self, x, x2):
        return self.body(self, x, x2)


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


@pytest.mark.parametrize("source, path", [
    ("L['self'].model.layers[0].mlp", "model.layers.0.mlp"),
    ("L['args'][0].model.layers.0.mlp", "model.layers.0.mlp"),          # a decorated forward
    ("L['self']._modules['model']._modules['layers']._modules['3'].mlp", "model.layers.3.mlp"),
    ("G['net'].transformer.h.1.mlp", "transformer.h.1.mlp"),
    ("L[\"mod\"].blocks[12].ffn", "blocks.12.ffn"),
    ("L['kwargs']['model'].encoder.layer.0", "encoder.layer.0"),
    ("layers.0.mlp", "layers.0.mlp"),                                   # an fx / export path
    ("L['self']", ""),
    ("L['self']._modules['mlp']._modules['gate']._parameters['weight']", "mlp.gate.weight"),   # a lifted parameter
])
def test_module_path_drops_any_source_prefix(source: str, path: str) -> None:
    assert module_path(source) == path


def test_layer_name_compares_module_paths_not_source_spellings() -> None:
    """Projections whose module stacks spell the same modules differently (``layers[0]`` and
    ``layers._modules['0']``) share the FFN's module, not just the layer; a map of source
    roots puts the frame's root at its path in the model."""
    graph = fx.Graph()
    spellings = ["L['self'].layers[0].mlp", "L['self']._modules['layers']._modules['0'].mlp", "L['self'].layers.0.mlp"]
    nodes = []
    for i, mlp in enumerate(spellings):
        n = graph.placeholder(f"p{i}")
        n.meta["nn_module_stack"] = {"a": (mlp.rsplit(".", 1)[0], nn.Module), "b": (mlp, nn.Module),
                                     "c": (f"{mlp}.proj{i}", nn.Linear)}
        nodes.append(n)
    assert layer_name(nodes) == "layers.0.mlp"
    assert layer_name(nodes, {"L['self']": "model"}) == "model.layers.0.mlp"
    assert layer_name(nodes, {"L['other']": "model"}) == "layers.0.mlp"
    nodes[2].meta["nn_module_stack"] = {"a": ("L['self'].layers.0", nn.Module), "b": ("L['self'].layers.0.attn", nn.Module)}
    assert layer_name(nodes) == "layers.0"
    bare = graph.placeholder("bare")       # a frame's own forward: no module entered
    assert layer_name([bare]) == "root" and layer_name([bare], {"L['self']": "model.layers.1.mlp"}) == "model.layers.1.mlp"


# ------------------------------------------------------------------------------ in-place writes
WEIGHT_WRITES = {
    # name: a body writing a parameter the block reads, after its first projection
    "gate_weight_data": lambda s, x, x2: (lambda g: (s.gate.weight.data.mul_(2), s.down(F.relu(g) * s.up(x)))[1])(s.gate(x)),
    "gate_bias_data": lambda s, x, x2: (lambda g: (s.gate.bias.data.zero_(), s.down(F.relu(g) * s.up(x)))[1])(s.gate(x)),
    "up_weight_data_slice": lambda s, x, x2: (lambda u: (s.up.weight.data[:2].add_(1), s.down(F.relu(s.gate(x)) * u))[1])(s.up(x)),
    "down_weight_transposed_view": lambda s, x, x2: (lambda g: (s.down.weight.data.t()[0].fill_(0.5),
                                                                 s.down(F.relu(g) * s.up(x)))[1])(s.gate(x)),
}


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("name", list(WEIGHT_WRITES))
def test_weight_written_inside_block_is_not_rewritten(name: str, grad: bool) -> None:
    """A weight or bias written (through .data, a slice or a transposed view) between the
    projections: rejected with the reason; compiled equals eager, each from fresh weights."""
    def fresh() -> NearMiss:
        torch.manual_seed(0)
        return NearMiss(WEIGHT_WRITES[name]).eval()

    x, x2 = torch.randn(2, 3, K), torch.randn(2, 3, K)
    with torch.set_grad_enabled(grad):
        report = twell_compile.explain(fresh(), x, x2, options=REWRITE_ALL)
        backend = PassBackend()
        got = torch.compile(fresh(), backend=backend)(x, x2)
        want = fresh()(x, x2)
    assert not report.rewrites and len(report.rejections) == 1, str(report)
    assert "modified in place" in report.rejections[0].reason, str(report)
    assert not backend.twell_ops() and torch.equal(got, want)


FRESH_WRITES = {
    # in-place writes that cannot touch what the block reads: the block is still rewritten
    "new_tensor": lambda s, x, x2: (lambda g: (lambda t: (s.down(F.relu(g) * s.up(x)), t))(torch.zeros(3).add_(1)))(s.gate(x)),
    "computed_from_input": lambda s, x, x2: (lambda g: (lambda t: (s.down(F.relu(g) * s.up(x)), t))((x + 1).mul_(2)))(s.gate(x)),
    "inplace_relu_on_gate": lambda s, x, x2: s.down(F.relu(s.gate(x), inplace=True) * s.up(x)),
}


@pytest.mark.parametrize("name", list(FRESH_WRITES))
def test_writes_to_fresh_tensors_keep_the_rewrite(name: str) -> None:
    torch.manual_seed(0)
    model = NearMiss(FRESH_WRITES[name]).eval()
    x, x2 = torch.randn(2, 3, K), torch.randn(2, 3, K)
    with torch.no_grad():
        gm = dynamo_graph(model, x, x2)
        found = find_ffns(gm.graph)
        backend = PassBackend()
        got = torch.compile(model, backend=backend)(x, x2)
        want = model(x, x2)
    assert len(found) == 1 and isinstance(found[0], Match), found
    assert backend.twell_ops() == ["twell::ffn"] and not backend.leftovers()
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------ torch.func transforms
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


# ------------------------------------------------------------------------------ grouped (MoE experts)
class GroupedExperts(nn.Module):
    """Experts through torch._grouped_mm, as transformers' grouped_mm implementation writes them:
    x sorted by expert, offs each expert's end row, weights [E, 2N, K] and [E, K, N]."""

    def __init__(self, body: str, experts: int = 3, k: int = 16, n: int = 8, transposed: bool = False):
        super().__init__()
        shape_up, shape_down = (experts, 2 * n, k), (experts, k, n)
        if transposed:
            shape_up, shape_down = (experts, k, 2 * n), (experts, n, k)
        self.gate_up_proj = nn.Parameter(torch.randn(shape_up) / k ** 0.5)
        self.down_proj = nn.Parameter(torch.randn(shape_down) / n ** 0.5)
        self.body, self.transposed = body, transposed

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        up = self.gate_up_proj if self.transposed else self.gate_up_proj.transpose(-2, -1)
        down = self.down_proj if self.transposed else self.down_proj.transpose(-2, -1)
        gate, u = torch._grouped_mm(x, up, offs=offs).chunk(2, dim=-1)
        h = {"relu": lambda: F.relu(gate) * u, "relu2": lambda: F.relu(gate) ** 2 * u,
             "drelu": lambda: F.relu(gate) * F.relu(u), "silu": lambda: F.silu(gate) * u,
             "relu_after_down": lambda: gate * u}[self.body]()
        y = torch._grouped_mm(h, down, offs=offs)
        return F.relu(y) if self.body == "relu_after_down" else y


GROUPED_OFFS = torch.tensor([3, 3, 9], dtype=torch.int32)      # expert 1 gets no rows; 3 rows past the end
BF16 = torch.bfloat16           # torch._grouped_mm's meta function (Dynamo's fake run) takes bfloat16 only


def _grouped_ref(mod: GroupedExperts, x: torch.Tensor) -> torch.Tensor:
    """The experts in float64, expert by expert (rows past the end: zeros)."""
    up, down = mod.gate_up_proj.double(), mod.down_proj.double()
    if mod.transposed:
        up, down = up.transpose(-2, -1), down.transpose(-2, -1)
    out, start = [], 0
    for e, end in enumerate(GROUPED_OFFS.tolist()):
        gate, u = F.linear(x[start:end].double(), up[e]).chunk(2, dim=-1)
        h = {"relu": lambda: F.relu(gate) * u, "relu2": lambda: F.relu(gate) ** 2 * u,
             "drelu": lambda: F.relu(gate) * F.relu(u)}[mod.body]()
        out.append(F.linear(h, down[e]))
        start = end
    return torch.cat(out)


@pytest.mark.parametrize("body,transposed", [("relu", False), ("relu", True), ("relu2", False), ("drelu", False)])
@pytest.mark.parametrize("grad", [False, True])
def test_grouped_experts_rewritten(body: str, transposed: bool, grad: bool) -> None:
    torch.manual_seed(0)
    mod = GroupedExperts(body, transposed=transposed).to(BF16)
    x = torch.randn(12, 16, dtype=BF16)
    backend = PassBackend()
    with torch.set_grad_enabled(grad):
        got = torch.compile(mod, backend=backend)(x, GROUPED_OFFS)
        want = mod(x, GROUPED_OFFS)
        ref = _grouped_ref(mod, x)
    op = "twell.experts_train.default" if grad else "twell.experts.default"
    calls = [n for n in backend.nodes() if n.op == "call_function"]
    assert [str(n.target) for n in calls].count(op) == 1
    assert not [n for n in calls if n.target in (F.relu, torch._grouped_mm, operator.mul, operator.pow)]
    assert not [n for n in backend.nodes() if n.op == "call_method" and n.target == "chunk"]
    assert [(r.experts, r.act, r.n, r.k) for r in backend.report.rewrites] == [(3, body, 8, 16)]
    # rows past offs[-1]: torch._grouped_mm leaves them unset, the op writes zeros
    check_close("y", got[:9], want[:9], ref)
    assert not got[9:].any()
    if grad:
        dy = torch.randn(9, 16, dtype=torch.float64)
        params = [mod.gate_up_proj, mod.down_proj]
        ref_params = [p.detach().double().requires_grad_() for p in params]
        ref_mod = GroupedExperts(body, transposed=transposed).double()
        ref_mod.gate_up_proj, ref_mod.down_proj = (nn.Parameter(p) for p in ref_params)
        g_ref = torch.autograd.grad(_grouped_ref(ref_mod, x), list(ref_mod.parameters()), dy)
        for a, b, c in zip(torch.autograd.grad(got[:9], params, dy.to(BF16)),
                           torch.autograd.grad(want[:9], params, dy.to(BF16)), g_ref):
            check_close("grad", a, b, c)


@pytest.mark.parametrize("body,reason", [("silu", "gate activation is SiLU, not ReLU"),
                                         ("relu_after_down", "gated product has no activation (bilinear), not ReLU")])
def test_grouped_experts_near_miss(body: str, reason: str) -> None:
    mod = GroupedExperts(body).to(BF16)
    x = torch.randn(12, 16, dtype=BF16)
    backend = PassBackend()
    with torch.no_grad():
        torch.compile(mod, backend=backend)(x, GROUPED_OFFS)
    assert not backend.report.rewrites
    assert [r.reason for r in backend.report.rejections] == [reason]
    assert sum(n.op == "call_function" and n.target is torch._grouped_mm for n in backend.nodes()) == 2


def test_grouped_and_plain_projections_do_not_mix() -> None:
    """A plain down projection after grouped gate/up: no grouped FFN to rewrite."""

    class Mixed(GroupedExperts):
        def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
            gate, u = torch._grouped_mm(x, self.gate_up_proj.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
            return F.linear(F.relu(gate) * u, self.down_proj[0])

    backend = PassBackend()
    with torch.no_grad():
        torch.compile(Mixed("relu").to(BF16), backend=backend)(torch.randn(12, 16, dtype=BF16), GROUPED_OFFS)
    assert not backend.report.rewrites
    assert [r.reason for r in backend.report.rejections] == ["mixes grouped (per-expert) and plain projections"]


class SentinelExperts(nn.Module):
    """transformers 5.17's ``grouped_mm_experts_forward`` (gated experts, [E, 2N, K] and [E, K, N]
    weights), written out: rows sorted by expert, offsets from histc, expert ids >= E (expert
    parallel's sentinels) sorted to the tail and masked with ``masked_fill`` before the up
    projection (in place), after it, and after the down projection; ``.to(weight.dtype)`` on
    each grouped_mm input. ``variant`` changes one thing to make a near-miss."""

    def __init__(self, variant: str = "5.17", experts: int = 3, k: int = 16, n: int = 8):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * n, k) / k ** 0.5)
        self.down_proj = nn.Parameter(torch.randn(experts, k, n) / n ** 0.5)
        self.num_experts, self.variant = experts, variant

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                feature_mask: torch.Tensor) -> torch.Tensor:
        v, e = self.variant, self.num_experts
        num_tokens, num_top_k = top_k_index.shape
        sample_weights, expert_ids = top_k_weights.reshape(-1), top_k_index.reshape(-1)
        expert_ids_g, perm = torch.sort(expert_ids)
        selected = hidden_states[perm // num_top_k]
        sample_weights_g = sample_weights[perm]
        tokens_per_expert = torch.histc(expert_ids_g.float(), bins=e, min=0, max=e - 1)
        offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
        sentinel_mask = (expert_ids_g >= e).unsqueeze(-1)
        expert_ids_g.clamp_(max=e - 1)
        selected.masked_fill_(sentinel_mask, 0.0)
        w = self.gate_up_proj
        proj_out = torch._grouped_mm(selected.to(w.dtype), w.transpose(-2, -1), offs=offsets)
        up_mask = feature_mask if v == "feature_mask" else sentinel_mask
        proj_out = proj_out.masked_fill(up_mask, 1.0 if v == "fill_one" else 0.0)
        gate, up = proj_out.chunk(2, dim=-1)
        proj_out = F.relu(gate) * up
        if v == "mask_written":
            sentinel_mask.logical_not_()
        w = self.down_proj
        proj_out = torch._grouped_mm(proj_out.to(w.dtype), w.transpose(-2, -1), offs=offsets)
        if v == "other_mask":
            proj_out = proj_out.masked_fill((expert_ids_g >= e).unsqueeze(-1), 0.0)
        elif v != "no_final":
            proj_out = proj_out.masked_fill(sentinel_mask, 0.0)
        weighted = proj_out * sample_weights_g.unsqueeze(-1)
        inv_perm = torch.empty_like(perm)
        inv_perm[perm] = torch.arange(perm.size(0), device=hidden_states.device)
        return weighted[inv_perm].view(num_tokens, num_top_k, -1).sum(dim=1)


def _sentinel_inputs(seed: int = 0) -> tuple[torch.Tensor, ...]:
    """8 tokens, top-2 of 3 experts, 3 of the 16 routed slots sentinels (id 3), expert 1 unused."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 16, generator=g, dtype=torch.float64).to(BF16)
    idx = torch.tensor([[0, 2], [2, 3], [0, 2], [3, 0], [2, 0], [0, 2], [2, 3], [0, 2]])
    weights = torch.rand(8, 2, generator=g, dtype=torch.float64).to(BF16)
    feature_mask = torch.rand(16, 16, generator=g) < 0.2
    return x, idx, weights, feature_mask


def _sentinel_ref(mod: SentinelExperts, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The experts in float64, token by token; sentinel slots add nothing."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j, ex in enumerate(idx[t].tolist()):
            if ex >= mod.num_experts:
                continue
            gate, u = F.linear(x[t].double(), mod.gate_up_proj[ex].double()).chunk(2, dim=-1)
            out[t] += weights[t, j].double() * F.linear(F.relu(gate) * u, mod.down_proj[ex].double())
    return out


@pytest.mark.parametrize("grad", [False, True])
def test_sentinel_masked_experts_rewritten(grad: bool) -> None:
    """transformers 5.17's experts: one twell::experts op; the masked_fill before the activation
    goes with the block, the one after the down projection stays on the op's output; output and
    weight gradients within 2x of eager bfloat16's error against float64, with sentinel rows."""
    torch.manual_seed(0)
    mod = SentinelExperts().to(BF16)
    x, idx, weights, fmask = _sentinel_inputs()
    backend = PassBackend()
    with torch.set_grad_enabled(grad):
        got = torch.compile(mod, backend=backend)(x, idx, weights, fmask)
        want = mod(x, idx, weights, fmask)
        ref = _sentinel_ref(mod, x, idx, weights)
    op = "twell.experts_train.default" if grad else "twell.experts.default"
    calls = [n for n in backend.nodes() if n.op == "call_function"]
    assert [str(n.target) for n in calls].count(op) == 1
    assert not [n for n in calls if n.target in (F.relu, torch._grouped_mm)]
    fills = [n for n in backend.nodes() if n.op == "call_method" and n.target == "masked_fill"]
    assert len(fills) == 1, fills
    y = fills[0].args[0]
    assert "twell" in str(y.target) or "twell" in str(y.args[0].target), y
    assert [(r.experts, r.act, r.n, r.k) for r in backend.report.rewrites] == [(3, "relu", 8, 16)]
    assert not backend.report.rejections
    check_close("y", got, want, ref)
    if grad:
        dy = torch.randn(8, 16, dtype=torch.float64)
        params = [mod.gate_up_proj, mod.down_proj]
        ref_mod = SentinelExperts()
        ref_mod.gate_up_proj, ref_mod.down_proj = (nn.Parameter(p.detach().double()) for p in params)
        g_ref = torch.autograd.grad(_sentinel_ref(ref_mod, x, idx, weights), list(ref_mod.parameters()), dy)
        for a, b, c in zip(torch.autograd.grad(got, params, dy.to(BF16)),
                           torch.autograd.grad(want, params, dy.to(BF16)), g_ref):
            check_close("grad", a, b, c)


_SENTINEL_NEAR_MISSES = {
    "fill_one": "a grouped projection's output is masked_fill-ed with 1.0 before the activation, not 0",
    "feature_mask": "a grouped projection's output is masked_fill-ed by a mask that is not one value per row",
    "no_final": ("the grouped projections' output rows are masked_fill-ed before the activation but the down "
                 "projection's output is not masked_fill-ed with 0 by the same mask"),
    "other_mask": ("the grouped projections' output rows are masked_fill-ed before the activation but the down "
                   "projection's output is not masked_fill-ed with 0 by the same mask"),
    "mask_written": ("a tensor that may alias the row mask is modified in place (call_method logical_not_ on "
                     "sentinel_mask) between the masked_fill calls"),
}


@pytest.mark.parametrize("variant", list(_SENTINEL_NEAR_MISSES))
def test_sentinel_masked_experts_near_miss(variant: str) -> None:
    """Masked experts whose masking the rewrite would change: left to Inductor with the reason,
    both grouped matmuls still in the graph, the output eager's."""
    torch.manual_seed(0)
    mod = SentinelExperts(variant).to(BF16)
    x, idx, weights, fmask = _sentinel_inputs(1)
    backend = PassBackend()
    with torch.no_grad():
        got = torch.compile(mod, backend=backend)(x, idx, weights, fmask)
        want = mod(x, idx, weights, fmask)
    assert not backend.report.rewrites
    assert [r.reason for r in backend.report.rejections] == [_SENTINEL_NEAR_MISSES[variant]]
    assert sum(n.op == "call_function" and n.target is torch._grouped_mm for n in backend.nodes()) == 2
    # tokens with a sentinel slot may read the rows past offs[-1] that torch._grouped_mm leaves unset
    # (no_final, other_mask: the clamp_ has already cleared the recomputed mask; mask_written)
    plain = (idx < mod.num_experts).all(dim=1)
    assert torch.equal(got[plain], want[plain])
