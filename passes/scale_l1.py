"""Sets the L1 penalty scale of every training op once all FFNs of the graph are known.

The paper's penalty is coef x mean over tokens, hidden units and layers of |h|. Each op knows
its own tokens and hidden units; the layer count is the number of training FFNs in this graph
(or ``twell.l1_layers`` when the user gives it, e.g. when graph breaks split the model).
FFNs made ops by ``twell_compile.prepare`` keep the scale prepare gave them.
"""

from __future__ import annotations

import torch
from torch import fx

from twell_compile.config import TwellConfig
from twell_compile.ops import arg_index
from twell_compile.passes.adopt_prepared import PREPARED
from twell_compile.passes.pass_utils import graph_modules


def scale_l1(gm: fx.GraphModule, config: TwellConfig) -> fx.GraphModule:
    train_op = torch.ops.twell.ffn_train.default
    nodes = [n for _, sub in graph_modules(gm) for n in sub.graph.nodes
             if n.op == "call_function" and n.target is train_op]
    prepared = [n for n in nodes if n.meta.get(PREPARED)]
    if prepared and config.l1:
        layers = ", ".join(str(n.args[arg_index(train_op, "layer")]) for n in prepared)
        raise ValueError(f"twell.l1 was given to torch.compile, but FFNs {layers} were made ops by "
                         "twell_compile.prepare, which fixes their options: pass twell.l1 to "
                         "prepare(model, options=...) (it counts the model's FFNs; a DDP-split graph cannot)")
    nodes = [n for n in nodes if not n.meta.get(PREPARED)]
    if not nodes:
        return gm
    scale = config.l1_scale(len(nodes))
    pos = arg_index(train_op, "l1_scale")
    for node in nodes:
        args = list(node.args)
        args[pos] = float(scale)
        node.args = tuple(args)
    for _, sub in graph_modules(gm):
        sub.recompile()
    return gm
