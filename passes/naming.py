"""Layer names for what the matcher finds: the module path (``model.layers.0.mlp``) of the
projections' innermost shared module, read from the ``nn_module_stack`` Dynamo records,
whatever spelling each source has (``module_path``), and placed in the whole model where
Dynamo compiled a block's frame on its own (``module_roots``).
"""

from __future__ import annotations

import re
from typing import Optional

import torch
from torch import fx

from twell_compile.ops import caller_modules
from twell_compile.passes.pass_utils import real_value
from twell_compile.report import ROOT_LAYER


# Dynamo names a module by the source it was reached through: the compiled callable's own
# argument (L['self'], L['mod'], or L['args'][0] where a decorator wraps forward, as in
# transformers 5.24), or a global (G['model']), then the attribute path from there.
SELF_ROOT = "L['self']"          # the source root of a module frame's own module
_ROOT_SOURCE = re.compile(r"""^[LG]\[(?:'[^']*'|"[^"]*")\](?:\[[^\]]*\])*""")


def source_root(source: str) -> str:
    """The root of a Dynamo source (``L['self']`` of ``L['self'].model.layers[0]``); "" for
    an fx / export path, which has none."""
    m = _ROOT_SOURCE.match(source)
    return m.group(0) if m else ""


def module_path(source: str) -> str:
    """The module path (``model.layers.0.mlp``) of a Dynamo module source, whatever its root:
    ``L['self'].model.layers[0].mlp``, ``L['args'][0]._modules['model'].layers.0.mlp`` and
    ``G['net'].model.layers.0.mlp`` all give ``model.layers.0.mlp``."""
    rest = _ROOT_SOURCE.sub("", source, count=1)
    rest = re.sub(r"""\._(?:modules|parameters|buffers)\[(?:'([^']*)'|"([^"]*)")\]""", lambda m: "." + (m.group(1) or m.group(2)), rest)
    rest = re.sub(r"""\[(?:'([^']*)'|"([^"]*)"|(-?\d+))\]""", lambda m: "." + next(g for g in m.groups() if g is not None), rest)
    return rest.lstrip(".")


def layer_name(nodes: list[fx.Node], roots: Optional[dict[str, str]] = None) -> str:
    """The innermost module path shared by the projections (e.g. 'model.layers.0.mlp'); "root"
    (report.ROOT_LAYER) when they share none: the compiled model's own forward holds them.

    Paths are compared as module paths, whatever spelling Dynamo gave each source
    (``layers[0]``, ``layers._modules['0']``, ``layers.0``). ``roots`` maps a source root
    (``L['self']``) to that module's own path in the model (``module_roots``): a
    frame Dynamo compiles on its own after a graph break (an inner block's forward) names its
    FFNs as the whole model's frame does."""
    stacks = [list((n.meta.get("nn_module_stack") or {}).values()) for n in nodes]
    common: Optional[str] = None
    for entries in zip(*stacks):
        sources = [e[0] if isinstance(e, tuple) else str(e) for e in entries]
        keys = {(source_root(s), module_path(s)) for s in sources}
        if len(keys) != 1:
            break
        common = sources[0]
    if common is None:       # the frame's own forward: its module's path, when it is a module's
        return (roots or {}).get(SELF_ROOT) or ROOT_LAYER
    prefix = (roots or {}).get(source_root(common), "")
    return ".".join(p for p in (prefix, module_path(common)) if p) or ROOT_LAYER


def module_roots(gm: fx.GraphModule) -> dict[str, str]:
    """For each source root of a Dynamo graph (``L['self']``, ``L['args'][0]``) whose
    parameters it lifts as inputs: that root module's path in the outermost module on the
    call stack that holds those parameters ("" for the model itself). A frame Dynamo compiles
    on its own (a block's forward after a graph break in its caller, gradient checkpointing)
    roots its sources at that block; with this map its FFNs keep the names the whole model's
    frame gives them. Empty where nothing can be told (no lifted parameters, a plain
    function's frame). Computed once per graph (kept in ``gm.meta``)."""
    if "twell_module_roots" in gm.meta:
        return gm.meta["twell_module_roots"]
    params: dict[str, list[tuple[torch.Tensor, str]]] = {}
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        t = real_value(gm, node)
        source = getattr(getattr(node.meta.get("grapharg"), "source", None), "name", None)
        if t is None or not isinstance(source, str) or not callable(getattr(t, "data_ptr", None)):
            continue
        root = source_root(source)
        if root and "_parameters[" in source:
            params.setdefault(root, []).append((t, module_path(source)))
    roots: dict[str, str] = {}
    if params:
        for model in caller_modules():
            names = {}
            for name, p in model.named_parameters(remove_duplicate=False):
                names.setdefault(id(p), []).append(name)
            for root, items in params.items():
                if root in roots:
                    continue
                for t, rel in items:
                    found = [n for n in names.get(id(t), ()) if n == rel or n.endswith("." + rel)]
                    if found:
                        roots[root] = found[0][:len(found[0]) - len(rel)].rstrip(".")
                        break
            if len(roots) == len(params):
                break
    gm.meta["twell_module_roots"] = roots
    return roots
