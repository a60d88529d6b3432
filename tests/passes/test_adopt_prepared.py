"""passes/adopt_prepared.py on hand-built graphs: prepared training nodes take their layer name
from the tag's value where the graph keeps it (Dynamo's GraphArg), say it is named at run time
where it does not; inference nodes get a fresh instance; every node is reported."""

from types import SimpleNamespace

import pytest
import torch
from torch import fx

from twell_compile.config import TwellConfig
from twell_compile.ops import arg_index, tag
from twell_compile.passes.adopt_prepared import PREPARED, adopt_prepared
from twell_compile.passes.pass_utils import report_of

TRAIN, INFER = torch.ops.twell.ffn_train.default, torch.ops.twell.ffn.default


def _graph(op, with_tag: bool, grapharg=None) -> fx.GraphModule:
    g = fx.Graph()
    x, wg, wd = g.placeholder("x"), g.placeholder("wg"), g.placeholder("wd")
    if op is TRAIN:
        t = g.placeholder("tag") if with_tag else None
        if t is not None and grapharg is not None:
            t.meta["grapharg"] = grapharg
        out = g.call_function(op, (x, wg, None, None, None, wd, None, 8, 16, 0.0, "", True, 0, "auto", t))
    else:
        out = g.call_function(op, (x, wg, None, None, None, wd, None, "blocks.1.mlp", True, 0, "auto"))
    g.output(out)
    return fx.GraphModule(torch.nn.Module(), g)


def _node(gm):
    return next(n for n in gm.graph.nodes if n.op == "call_function")


def test_tag_kept_by_the_graph_names_the_layer():
    t = tag("model.layers.3.mlp")
    gm = adopt_prepared(_graph(TRAIN, True, SimpleNamespace(example=t)), TwellConfig())
    node = _node(gm)
    assert node.meta[PREPARED] and node.args[arg_index(TRAIN, "layer")] == "model.layers.3.mlp"
    assert node.args[arg_index(TRAIN, "instance")] == 0          # the tag names it at run time
    assert [r.layer for r in report_of(gm).rewrites] == ["model.layers.3.mlp"]


def test_tag_without_its_value_is_named_at_run_time():
    gm = adopt_prepared(_graph(TRAIN, True), TwellConfig())
    assert _node(gm).args[arg_index(TRAIN, "layer")] == "prepared FFN (layer named at run time)"
    fake = torch._subclasses.FakeTensorMode().from_tensor(tag("x"))   # a fake is no value either
    gm = adopt_prepared(_graph(TRAIN, True, SimpleNamespace(example=fake)), TwellConfig())
    assert _node(gm).args[arg_index(TRAIN, "layer")] == "prepared FFN (layer named at run time)"


@pytest.mark.parametrize("cudagraphs, marked", [("on", True), ("", True), ("off", False)])
def test_adopted_inference_ops_are_marked_for_cuda_graphs_as_fused_ones_are(cudagraphs, marked):
    from twell_compile.runtime import density

    config = TwellConfig(cudagraphs=cudagraphs)
    for op, want in ((INFER, marked), (TRAIN, False)):
        gm = adopt_prepared(_graph(op, False), config)
        with density.scope(_node(gm).args[arg_index(op, "instance")]):
            assert density.in_graphs() == want, (cudagraphs, op)


def test_nodes_without_tag_get_a_fresh_instance():
    a = adopt_prepared(_graph(INFER, False), TwellConfig())
    b = adopt_prepared(_graph(TRAIN, False), TwellConfig())
    ia, ib = _node(a).args[arg_index(INFER, "instance")], _node(b).args[arg_index(TRAIN, "instance")]
    assert ia > 0 and ib > 0 and ia != ib
    assert [r.layer for r in report_of(a).rewrites] == ["blocks.1.mlp"]
