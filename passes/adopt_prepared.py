"""Reports twell op nodes already in the graph: FFNs made one op by ``twell_compile.prepare``.

Runs first, so ``fuse_ffn`` keeps their layer names unique and ``scale_l1`` can tell them from
the FFNs it scales: a prepared op carries its own options (L1 scale, tile sizes, stats flag),
fixed by ``prepare`` for the whole model. Nodes are marked ``meta["twell_prepared"]``.
Inference nodes get a fresh ``instance`` number: a new compile starts from fresh runtime
state (marked for CUDA graphs, as fuse_ffn's are, where the graph runs inside them). Training nodes carry the module's tag (ops.tag), which names the instance and layer at
run time: the tag's layer name is written into the node's ``layer`` for the passes and reports
(a graph shared by several blocks shows the first block's name; each call runs as its own).
"""

from __future__ import annotations

import torch
from torch import fx

from twell_compile.config import TwellConfig
from twell_compile.ops import arg_index, mark_graphs, next_instance, tagged
from twell_compile.passes.pass_utils import arg, example, graph_modules, real_value, report_of, set_op_arg, tokens_str
from twell_compile.report import RewriteEntry

PREPARED = "twell_prepared"


def _size(node: object, dim: int) -> int:
    ev = example(node)
    return int(ev.shape[dim]) if ev is not None else -1



def _report_experts(report, node: fx.Node, op: torch._ops.OpOverload, sub_name: str) -> None:
    """A prepared MoE experts op (twell_compile.moe): one row with its experts count."""
    xe = example(node.args[0])
    wg = node.args[arg_index(op, "w_gate")]
    report.add_rewrite(RewriteEntry(
        str(node.args[arg_index(op, "layer")]), node.args[arg_index(op, "w_up")] is not None, str(op.name()),
        tokens_str(xe.shape) if xe is not None else "?", _size(wg, 2), _size(wg, 1),
        _size(node.args[arg_index(op, "w_down")], 1), str(xe.dtype).replace("torch.", "") if xe is not None else "?",
        sub_name, via="prepare", act=str(arg(node, arg_index(op, "act"), "act", "relu")), experts=_size(wg, 0)))


def _fresh_instance(node: fx.Node, op: torch._ops.OpOverload, config: TwellConfig) -> None:
    """A new instance number for the node; an inference op's is marked where the graph runs
    inside CUDA graphs, as fuse_ffn marks the ops it inserts (density.mark_graphs)."""
    instance = next_instance()
    set_op_arg(node, op, "instance", instance)
    if config.in_cudagraphs and op in (torch.ops.twell.ffn.default, torch.ops.twell.experts.default):
        mark_graphs(instance)


def adopt_prepared(gm: fx.GraphModule, config: TwellConfig) -> fx.GraphModule:
    report = report_of(gm)
    for sub_name, sub in graph_modules(gm):
        changed = False
        for node in sub.graph.nodes:
            op = node.target
            if node.op == "call_function" and op in (torch.ops.twell.experts.default,
                                                     torch.ops.twell.experts_train.default):
                node.meta[PREPARED] = True
                changed = True
                _fresh_instance(node, op, config)
                _report_experts(report, node, op, sub_name)
                continue
            if node.op != "call_function" or op not in (torch.ops.twell.ffn.default, torch.ops.twell.ffn_train.default):
                continue
            node.meta[PREPARED] = True
            changed = True
            tag_arg = arg(node, arg_index(op, "tag"), "tag") if op is torch.ops.twell.ffn_train.default else None
            tag = real_value(sub, tag_arg)
            if tag is not None:
                set_op_arg(node, op, "layer", tagged(tag)[1])
            elif tag_arg is not None:      # a tag whose value the graph does not keep: named at run time
                set_op_arg(node, op, "layer", "prepared FFN (layer named at run time)")
            else:
                _fresh_instance(node, op, config)
            x = node.args[0]
            xe = example(x)
            tokens = tokens_str(xe.shape) if xe is not None else "?"
            report.add_rewrite(RewriteEntry(
                str(node.args[arg_index(op, "layer")]), node.args[arg_index(op, "w_up")] is not None,
                str(op.name()), tokens, _size(node.args[arg_index(op, "w_gate")], 1),
                _size(node.args[arg_index(op, "w_gate")], 0), _size(node.args[arg_index(op, "w_down")], 0),
                str(xe.dtype).replace("torch.", "") if xe is not None else "?", sub_name, via="prepare",
                act=str(arg(node, arg_index(op, "act"), "act", "relu"))))
        if changed:
            sub.recompile()
    return gm
