"""Runs the twell passes the way the backend does and keeps what they produced.

``PassBackend`` is a torch.compile backend that applies ``twell_compile.passes.run_passes`` and
then runs the rewritten graph eagerly (no Inductor: fast), keeping every rewritten graph module
and the merged report for inspection. ``check_close`` compares against eager with the
tolerance rules of the test suite.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F
from torch import fx

from tests.helpers import check_close, max_err  # noqa: F401  (re-exported for the pass tests)
from twell_compile.config import TwellConfig
from twell_compile.passes import report_of, run_passes
from twell_compile.report import Report

TWELL_OPS = {"twell.ffn.default": "twell::ffn", "twell.ffn_train.default": "twell::ffn_train"}

# Targets the rewrite must have removed from a graph holding only FFNs.
REPLACED_FNS = {torch._C._nn.linear, F.linear, operator.matmul, torch.matmul, torch.mm, torch.addmm,
                F.relu, torch.relu, torch.relu_, operator.mul, torch.mul, operator.pow, torch.pow, torch.square}
REPLACED_METHODS = {"relu", "relu_", "mul", "matmul", "__matmul__", "pow", "square"}


class PassBackend:
    def __init__(self, config: TwellConfig | None = None):
        # the matcher's view: every match rewritten, whatever the speed rules (twell.skip_dense,
        # tested on their own in tests/runtime/test_select.py) would leave to Inductor
        self.config = config or TwellConfig(skip_dense=False)
        self.graphs: list[fx.GraphModule] = []
        self.report = Report()

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any], **_: Any) -> Callable:
        gm = run_passes(gm, self.config)
        self.graphs.append(gm)
        self.report.extend(report_of(gm))
        return gm.forward

    def nodes(self) -> Iterable[fx.Node]:
        for gm in self.graphs:
            for sub in gm.modules():
                if isinstance(sub, fx.GraphModule):
                    yield from sub.graph.nodes

    def twell_ops(self) -> list[str]:
        """The twell ops in the rewritten graphs, e.g. ['twell::ffn', 'twell::ffn']."""
        return [TWELL_OPS[str(n.target)] for n in self.nodes()
                if n.op == "call_function" and str(n.target) in TWELL_OPS]

    def leftovers(self) -> list[str]:
        """Linear/matmul/relu/mul nodes still in the rewritten graphs."""
        out = []
        for n in self.nodes():
            if (n.op == "call_function" and n.target in REPLACED_FNS) or (
                    n.op == "call_method" and n.target in REPLACED_METHODS):
                out.append(f"{n.op} {getattr(n.target, '__name__', n.target)}")
        return out


