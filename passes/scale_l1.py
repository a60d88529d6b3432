"""Sets the L1 penalty of every training op once all FFNs of the graph are known.

The paper's penalty is coef x mean over tokens, hidden units and layers of |h|. Each op knows
its own tokens and hidden units; the layer count is the number of training FFNs in this graph
(or ``twell.l1_layers`` when the user gives it, e.g. when graph breaks split the model).
With ``twell.l1`` each op's ``l1_scale`` is l1 / layers. With ``twell.target_density`` an FFN
the target names gets ``l1_scale`` = 1 / layers and ``l1_control``: its coefficient comes from
the controller at run time (a device tensor, twell_compile/control.py), and the backend
declares its target there. FFNs made ops by ``twell_compile.prepare`` keep what prepare gave them.
A MoE block's experts op (``twell::experts_train``) counts as one layer (its penalty is the
mean over every routed row); ``twell.target_density`` does not control experts: a target
naming an experts op raises, and under a target for other layers its ``l1_scale`` stays 0.
"""

from __future__ import annotations

import torch
from torch import fx

from twell_compile.config import PREFIX, TwellConfig, check_target_layers
from twell_compile.ops import arg_index
from twell_compile.passes.adopt_prepared import PREPARED
from twell_compile.passes.pass_utils import graph_modules, report_of, set_op_arg



def scale_l1(gm: fx.GraphModule, config: TwellConfig) -> fx.GraphModule:
    train_op = torch.ops.twell.ffn_train.default
    if config.target_density is not None:      # every FFN found, rewritten or left to Inductor
        report = report_of(gm)
        check_target_layers(config, [e.layer for e in (*report.rewrites, *report.rejections)], "this graph")
    nodes = [n for _, sub in graph_modules(gm) for n in sub.graph.nodes
             if n.op == "call_function" and n.target is train_op]
    prepared = [n for n in nodes if n.meta.get(PREPARED)]
    if prepared and config.penalized:
        given = f"{PREFIX}l1" if config.l1 else f"{PREFIX}target_density"
        layers = ", ".join(str(n.args[arg_index(train_op, "layer")]) for n in prepared)
        raise ValueError(f"{given} was given to torch.compile, but FFNs {layers} were made ops by "
                         f"twell_compile.prepare, which fixes their options: pass {given} to "
                         "prepare(model, options=...) (it counts the model's FFNs; a DDP-split graph cannot)")
    nodes = [n for n in nodes if not n.meta.get(PREPARED)]
    experts_op = torch.ops.twell.experts_train.default
    experts = [n for _, sub in graph_modules(gm) for n in sub.graph.nodes
               if n.op == "call_function" and n.target is experts_op and not n.meta.get(PREPARED)]
    if not nodes and not experts:
        return gm
    layer_pos = arg_index(train_op, "layer")
    if config.target_density is not None:
        for node in experts:
            layer = str(node.args[arg_index(experts_op, "layer")])
            if config.target_for(layer) is not None:
                raise ValueError(f"{PREFIX}target_density asks a density of {layer}, a MoE block's experts, "
                                 "which the controller does not steer: name its other FFNs, or use twell.l1")
        scale = config.layer_scale(len(nodes) + len(experts))
        for node in nodes:
            controlled = config.target_for(str(node.args[layer_pos])) is not None
            set_op_arg(node, train_op, "l1_scale", float(scale) if controlled else 0.0)
            set_op_arg(node, train_op, "l1_control", controlled)
    else:
        scale = config.l1_scale(len(nodes) + len(experts))
        for node in nodes:
            set_op_arg(node, train_op, "l1_scale", float(scale))
        for node in experts:
            set_op_arg(node, experts_op, "l1_scale", float(scale))
    for _, sub in graph_modules(gm):
        sub.recompile()
    return gm
