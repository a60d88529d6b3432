"""torch.func transforms and forward-mode AD in an FX graph: the nodes inside a transform or
dual level (``transform_regions``), graph inputs that are dual tensors (``dual_inputs``),
values that are functorch-wrapped tensors (``wrapped_reason``). FFNs there stay with Inductor,
each with the reason.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.autograd.forward_ad as fwAD
from torch import fx

from twell_compile.passes.pass_utils import example


# Dynamo inlines torch.func transforms (and forward_ad.dual_level) into the graph as calls that
# enter and leave a transform level. Inside one, the recorded values are functorch wrappers
# (BatchedTensor, GradTrackingTensor) whose requires_grad says nothing about the gradient the
# transform takes, and the twell ops have no batching rule, no forward-mode derivative, and an
# autograd formula (register_autograd) that torch.func cannot run: such FFNs stay with Inductor.
_NO_FORWARD_AD = "the twell ops have no forward-mode derivative"
_TRANSFORM_ENTER = {
    "_vmap_increment_nesting": "inside torch.func.vmap: the twell ops have no batching rule, and the traced "
                               "values do not show whether a gradient is needed",
    "_grad_increment_nesting": "inside torch.func.grad/vjp/jacrev: twell's autograd formula does not run "
                               "under torch.func transforms",
    "_jvp_increment_nesting": f"inside torch.func.jvp/jacfwd (forward-mode AD): {_NO_FORWARD_AD}",
    "_enter_dual_level": f"inside torch.autograd.forward_ad.dual_level (forward-mode AD): {_NO_FORWARD_AD}",
    "_func_increment_nesting": "inside torch.func.functionalize: left to Inductor",
}
_TRANSFORM_EXIT = {"_vmap_decrement_nesting", "_grad_decrement_nesting", "_jvp_decrement_nesting",
                   "_exit_dual_level", "_func_decrement_nesting"}
_WRAPPED = "its values are torch.func-wrapped tensors (a torch.func transform is active)"
_DUAL_INPUT = f"an input is a forward-mode dual tensor (torch.autograd.forward_ad): {_NO_FORWARD_AD}"


def _call_name(node: fx.Node) -> str:
    return str(getattr(node.target, "__name__", "")) if node.op == "call_function" else ""


def transform_regions(graph: fx.Graph) -> dict[fx.Node, str]:
    """The nodes inside a torch.func transform or dual level, each with the innermost one's
    reason for leaving FFNs there to Inductor. A graph that leaves a level it never entered
    counts as inside from its start."""
    regions: dict[fx.Node, str] = {}
    stack: list[str] = []
    before: list[fx.Node] = []
    for node in graph.nodes:
        name = _call_name(node)
        if name in _TRANSFORM_ENTER:
            jvp = _TRANSFORM_ENTER["_jvp_increment_nesting"]
            # torch.func.jvp enters a dual level of its own: name the transform, not the level
            stack.append(jvp if name == "_enter_dual_level" and stack and stack[-1] == jvp
                         else _TRANSFORM_ENTER[name])
        elif name in _TRANSFORM_EXIT:
            if stack:
                stack.pop()
            else:
                for n in before:
                    regions.setdefault(n, "inside a torch.func transform entered before this graph")
        if stack:
            regions[node] = stack[-1]
        before.append(node)
    return regions


def _wrapped(node: Any) -> bool:
    ev = example(node)
    return ev is not None and torch._C._functorch.is_functorch_wrapped_tensor(ev)


def wrapped_reason(*nodes: Any) -> Optional[str]:
    """The reason when any of ``nodes`` holds a functorch-wrapped tensor (a transform entered
    outside the graph), else None."""
    return _WRAPPED if any(_wrapped(n) for n in nodes) else None


def dual_inputs(graph: fx.Graph) -> Optional[str]:
    """The reason when a graph input is a forward-mode dual tensor (compiled and called inside
    ``forward_ad.dual_level`` with ``make_dual`` inputs; Dynamo guards on the dual level)."""
    if fwAD._current_level < 0:
        return None
    for node in graph.nodes:
        if node.op != "placeholder":
            continue
        arg = node.meta.get("grapharg")
        try:
            real = getattr(arg, "example", None)
        except Exception:     # a freed weak reference
            real = None
        if isinstance(real, torch.Tensor) and not isinstance(real, torch._subclasses.FakeTensor):
            if fwAD.unpack_dual(real).tangent is not None:
                return _DUAL_INPUT
    return None


def transform_reason(graph: fx.Graph) -> Optional[str]:
    """Why no FFN anywhere in a graph's subgraphs may be rewritten: the graph runs a torch.func
    transform or dual level somewhere, or takes dual inputs. Subgraphs (higher-order ops) are
    judged by the graph holding them, conservatively as a whole."""
    regions = transform_regions(graph)
    if regions:
        return next(iter(regions.values()))
    return dual_inputs(graph)
