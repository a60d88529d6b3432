"""Layer names: Dynamo module sources read as module paths, and the innermost module the
projections share, whatever each source's spelling, placed in the model by a map of source
roots."""

from __future__ import annotations

import pytest
import torch.nn as nn
from torch import fx

from twell_compile.passes.naming import layer_name, module_path


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
