"""In-place writes inside an FFN block (the alias analysis of ``passes/alias.py`` as the block
checks use it): a write into a weight or bias the block reads, through any view, leaves the
block to Inductor; writes into tensors allocated apart from its inputs keep the rewrite.
Writes into the input are among the near-misses of ``test_match_ffn.py``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import twell_compile
from twell_compile.passes.match_ffn import Match, find_ffns

from tests.helpers import REWRITE_ALL
from tests.passes.ffn_zoo import K, NearMiss
from tests.passes.graph_capture import dynamo_graph
from tests.passes.rewrite_harness import PassBackend


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
