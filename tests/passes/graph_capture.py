"""The Dynamo (torch-level) FX graph of a call, before any twell pass, for matcher tests."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import fx


def dynamo_graphs(fn: Callable[..., Any], *args: Any) -> list[fx.GraphModule]:
    """Every graph Dynamo hands to a backend while running ``fn(*args)`` once."""
    graphs: list[fx.GraphModule] = []

    def backend(gm: fx.GraphModule, example_inputs: list[Any], **_: Any):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend)(*args)
    return graphs


def dynamo_graph(fn: Callable[..., Any], *args: Any) -> fx.GraphModule:
    graphs = dynamo_graphs(fn, *args)
    assert len(graphs) == 1, f"expected one graph, Dynamo produced {len(graphs)} (graph break?)"
    return graphs[0]


def param_name(node: Any) -> str:
    """'gate.weight' for the placeholder of parameter ``gate.weight`` (Dynamo's naming)."""
    assert isinstance(node, fx.Node) and node.op == "placeholder", f"not a placeholder: {node}"
    name = node.target
    for prefix in ("L_self_modules_", "L_self_", "L_fn_modules_"):
        if name.startswith(prefix):
            name = name[len(prefix):]
    return name.replace("_modules_", ".").replace("_parameters_", ".").rstrip("_")
