"""``twell_compile.export``: torch.export with the twell rewrite applied.

torch.export traces below the level our pass works at, so the model is first captured by
Dynamo (torch-level graph), rewritten by the same passes as the backend, then exported. The
program calls ``torch.ops.twell.*``: a process that runs it, also through an AOTInductor
package, must ``import twell_compile.ops`` first (the ops are Python custom ops). Without
that, loading fails with "Could not find schema for twell::ffn". AOTInductor packages need
torch >= 2.13: on torch 2.11 running the package segfaulted in its call of the Python op.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections import defaultdict, deque
from typing import Any, Mapping, Optional

import torch
from torch import fx
from torch.utils import _pytree as pytree

from twell_compile.config import TwellConfig
from twell_compile.ops import arg_index
from twell_compile.passes import report_of, run_passes
from twell_compile.report import Report

# What Dynamo says when a model returns a Hugging Face cache object (transformers 5.x:
# "... outputs with type `<class 'transformers.cache_utils.DynamicCache'>` is not supported").
_HF_CACHE = re.compile(r"transformers\.cache_utils\.(\w+)")


def export(model: torch.nn.Module, args: tuple, kwargs: Optional[Mapping[str, Any]] = None, *,
           dynamic_shapes: Any = None, dynamic_batch: bool = False,
           options: Optional[Mapping[str, Any]] = None) -> tuple[torch.export.ExportedProgram, Report]:
    """Export ``model(*args, **kwargs)`` with its ReLU FFNs replaced by twell ops.

    Returns ``(program, report)``: the ``torch.export.ExportedProgram`` and the rewrite report,
    whose token shapes are the program's (concrete sizes for a static export, the ``Dim``'s
    name for a dynamic one). The program is for inference: it holds the model's own parameters
    and reads them detached, so it runs with grad mode on and sees every change to them; an
    input that requires grad raises (run it under ``torch.no_grad()``).

    Shapes are static unless ``dynamic_shapes`` (passed to ``torch.export.export``) or
    ``dynamic_batch=True`` (dim 0 of every tensor input whose dim 0 equals the first one's, as
    one ``Dim("batch")``; the example batch must be >= 2) makes them dynamic. ``options``
    takes the ``twell.*`` keys of torch.compile. A Hugging Face model must be exported with
    ``kwargs={"use_cache": False}`` (torch.export cannot output its cache object).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(args, tuple):
        raise TypeError(f"args must be a tuple of inputs, got {type(args).__name__}")
    config, rest = TwellConfig.from_options(options)
    if rest:
        raise ValueError(f"export takes only twell.* options, got {sorted(rest)}")
    kwargs = dict(kwargs or {})
    names = _bound_arguments(model, args, kwargs)
    if dynamic_batch:
        if dynamic_shapes is not None:
            raise ValueError("pass either dynamic_shapes or dynamic_batch=True, not both "
                             "(dynamic_batch=True is dynamic_shapes with dim 0 of the batch inputs as Dim('batch'))")
        dynamic_shapes = _batch_shapes(names)
    try:
        with torch.no_grad():
            # Static by default: the rewrite (and its report) sees the sizes the program is fixed at.
            gm, _guards = torch._dynamo.export(model, dynamic_shapes=dynamic_shapes,
                                               assume_static_by_default=True)(*args, **kwargs)
            gm = run_passes(gm, config)
            _detach_parameters(gm)
            ep = torch.export.export(gm, args, kwargs, dynamic_shapes=dynamic_shapes)
    except Exception as e:
        cache = _HF_CACHE.search(str(e))
        if cache is None:
            raise
        raise ValueError(f"export: the model returns a Hugging Face cache ({cache.group(0)}), which torch.export "
                         "cannot output: pass kwargs={'use_cache': False} (or set model.config.use_cache = False)"
                         ) from e
    return ep, _program_report(report_of(gm), ep, dynamic_shapes if isinstance(dynamic_shapes, dict) else {})


def _bound_arguments(model: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """model.forward's parameter names -> the inputs given for them (empty if they do not bind)."""
    try:
        return dict(inspect.signature(model.forward).bind(*args, **kwargs).arguments)
    except (TypeError, ValueError):
        return {}


def _batch_shapes(names: dict[str, Any]) -> dict[str, Any]:
    """dynamic_shapes by argument name: dim 0 of each tensor input whose dim 0 equals the first
    tensor input's, as one Dim("batch"); everything else static."""
    tensors = [t for t in pytree.tree_leaves(list(names.values())) if isinstance(t, torch.Tensor) and t.dim()]
    if not names or not tensors:
        raise ValueError("dynamic_batch=True needs tensor inputs that bind to model.forward's parameters; "
                         "pass dynamic_shapes=... instead")
    size = tensors[0].shape[0]
    if size < 2:
        raise ValueError(f"dynamic_batch=True needs an example batch of at least 2, got {size} (torch.export "
                         "specializes sizes 0 and 1): export with a batch of 2 or more; the program then runs any batch")
    batch = torch.export.Dim("batch")
    return {name: pytree.tree_map(lambda t: {0: batch} if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == size
                                  else None, value)
            for name, value in names.items()}


def _detach_parameters(gm: fx.GraphModule) -> None:
    """Read every parameter through a ``detach`` in the graph: the program then runs with grad
    mode on (twell::ffn is inference only and refuses an input that requires grad), while it
    keeps the model's own Parameter objects, so every change to them is seen by the next call
    (in place, ``.data =``, ``set_``, ``load_state_dict``), as a plain torch.export program's are."""
    params = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
    for node in list(gm.graph.nodes):
        if node.op == "get_attr" and node.target in params and node.users:
            with gm.graph.inserting_after(node):
                detached = gm.graph.call_function(torch.ops.aten.detach.default, (node,))
            node.replace_all_uses_with(detached, delete_user_cb=lambda user: user is not detached)
    gm.recompile()


def _program_report(report: Report, ep: torch.export.ExportedProgram, specs: dict[str, Any]) -> Report:
    """The report with each rewrite's token shape read from the exported program: concrete
    sizes where static, the Dim's name (else torch's symbol, s0...) where dynamic."""
    dim_names: dict[str, str] = {}
    for node in ep.graph.nodes:   # user inputs are named after model.forward's parameters
        spec, val = specs.get(node.name), node.meta.get("val")
        if node.op != "placeholder" or not isinstance(val, torch.Tensor) or not isinstance(spec, (dict, list, tuple)):
            continue
        for d, dim in (spec.items() if isinstance(spec, dict) else enumerate(spec)):
            if getattr(dim, "__name__", None) and d < val.dim():
                dim_names.setdefault(str(val.shape[d]), dim.__name__)
    shapes: dict[str, deque[str]] = defaultdict(deque)
    ops = (torch.ops.twell.ffn.default, torch.ops.twell.ffn_train.default, torch.ops.twell.experts.default)
    symbols = re.compile(r"\b(?:" + "|".join(map(re.escape, dim_names)) + r")\b") if dim_names else None
    for sub in ep.graph_module.modules():
        if not isinstance(sub, fx.GraphModule):
            continue
        for node in sub.graph.nodes:
            if node.op == "call_function" and node.target in ops:
                x = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
                if isinstance(x, torch.Tensor):
                    # an expert op's rows are a product of the program's dims (tokens x top-k)
                    dims = [str(s) if symbols is None else symbols.sub(lambda m: dim_names[m.group(0)], str(s))
                            for s in x.shape[:-1]]
                    shapes[str(node.args[arg_index(node.target, "layer")])].append("[" + ", ".join(dims) + "]")
    return dataclasses.replace(report, rewrites=[
        dataclasses.replace(r, tokens_shape=shapes[r.layer].popleft()) if shapes[r.layer] else r
        for r in report.rewrites])
