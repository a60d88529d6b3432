"""Graph helpers shared by the passes, ``prepare`` and ``explain``: node kinds (the spellings
Dynamo records for linear maps, ReLU, products, casts; the names of known activations that
rejections give), identity-like nodes, the report the passes write, and the graph with its
subgraphs.
"""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import fx

from twell_compile.ops import arg_index
from twell_compile.report import Report

LINEAR_FNS = {torch._C._nn.linear, F.linear}
MATMUL_FNS = {operator.matmul, torch.matmul, torch.mm}
MATMUL_METHODS = {"matmul", "mm", "__matmul__"}
ADD_FNS = {operator.add, torch.add, operator.iadd}
ADD_METHODS = {"add", "add_", "__add__"}
MUL_FNS = {operator.mul, torch.mul, operator.imul}
MUL_METHODS = {"mul", "mul_", "__mul__"}
RELU_FNS = {torch.relu, torch.relu_, F.relu, F.relu_, torch.nn.functional.relu}
RELU_METHODS = {"relu", "relu_"}
DROPOUT_FNS = {F.dropout, torch.dropout, torch.nn.functional.dropout}
VIEW_METHODS = {"view", "reshape", "flatten", "unflatten", "contiguous"}
VIEW_FNS = {torch.reshape, torch.flatten, torch.unflatten}
CAST_METHODS = {"to", "type", "float", "half", "bfloat16", "double", "type_as"}
CHUNK_FNS = {torch.chunk, torch.split, torch.tensor_split}

# Known activations, named in rejections (function objects and method names).
ACTIVATIONS: dict[Any, str] = {
    F.silu: "SiLU", torch.nn.functional.silu: "SiLU", F.gelu: "GELU", torch.tanh: "tanh",
    torch.sigmoid: "sigmoid", F.sigmoid: "sigmoid", F.tanh: "tanh", F.relu6: "ReLU6",
    F.leaky_relu: "LeakyReLU", F.elu: "ELU", F.selu: "SELU", F.celu: "CELU", F.mish: "Mish",
    F.softplus: "Softplus", F.hardswish: "Hardswish", F.hardtanh: "Hardtanh",
    F.hardsigmoid: "Hardsigmoid", torch.clamp: "clamp", torch.clamp_min: "clamp_min",
    torch.square: "square", torch.pow: "pow", F.glu: "GLU", torch.exp: "exp", torch.abs: "abs",
    F.threshold: "threshold", F.prelu: "PReLU", F.rrelu: "RReLU", torch.erf: "erf",
}
ACTIVATION_METHODS = {"sigmoid": "sigmoid", "tanh": "tanh", "clamp": "clamp", "clamp_min": "clamp_min",
                       "pow": "pow", "square": "square", "abs": "abs", "exp": "exp"}


def is_fn(node: fx.Node, fns: set) -> bool:
    return node.op == "call_function" and node.target in fns


def is_method(node: fx.Node, names: set) -> bool:
    return node.op == "call_method" and node.target in names


def is_relu(node: fx.Node) -> bool:
    return is_fn(node, RELU_FNS) or is_method(node, RELU_METHODS)


def activation_name(node: fx.Node) -> Optional[str]:
    """Name of a known non-ReLU activation, else None."""
    if node.op == "call_function":
        name = ACTIVATIONS.get(node.target)
        if name is None and node.target in (torch.nn.functional.gelu,):
            name = "GELU"
        return name
    if node.op == "call_method":
        return ACTIVATION_METHODS.get(node.target)
    if node.op == "call_module":
        return str(node.target)
    return None


def describe(node: Any) -> str:
    """A node as a rejection reason names it: its activation's name, its function's name, or
    its op and target."""
    if not isinstance(node, fx.Node):
        return repr(node)
    act = activation_name(node)
    if act:
        return act
    if node.op == "call_function":
        return getattr(node.target, "__name__", str(node.target))
    return f"{node.op} {node.target}"


def arg(node: fx.Node, i: int, name: str, default: Any = None) -> Any:
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def example(node: Any) -> Optional[torch.Tensor]:
    """The fake tensor Dynamo recorded for a node, if it is a tensor."""
    if not isinstance(node, fx.Node):
        return None
    ev = node.meta.get("example_value", node.meta.get("val"))
    return ev if isinstance(ev, torch.Tensor) else None


def real_value(gm: fx.GraphModule, node: Any) -> Optional[torch.Tensor]:
    """The real tensor behind a graph input, for values a pass reads rather than traces
    (ops.tag): a placeholder's GraphArg (Dynamo keeps the example it lifted) or a get_attr's
    attribute; None for anything else or a fake."""
    t: Any = None
    if isinstance(node, fx.Node) and node.op == "placeholder":
        t = getattr(node.meta.get("grapharg"), "example", None)
    elif isinstance(node, fx.Node) and node.op == "get_attr":
        t = gm
        for part in str(node.target).split("."):
            t = getattr(t, part, None)
    if not isinstance(t, torch.Tensor) or isinstance(t, torch._subclasses.FakeTensor):
        return None
    return t


def shape_key(t: torch.Tensor) -> tuple[str, ...]:
    # Compare symbolic sizes by their expression, without adding guards.
    return tuple(str(d) for d in t.shape)


def is_transparent(node: fx.Node) -> bool:
    """Identity-like on values: eval dropout, contiguous, same-dtype casts, last-dim-keeping views."""
    if node.op not in ("call_function", "call_method") or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    src, out = example(node.args[0]), example(node)
    if src is None or out is None:
        return False
    if is_fn(node, DROPOUT_FNS):
        p = arg(node, 1, "p", 0.5)
        training = arg(node, 2, "training" if node.target is not torch.dropout else "train", True)
        return training is False or p == 0
    if is_method(node, CAST_METHODS):
        return out.dtype == src.dtype and out.device == src.device
    if is_method(node, VIEW_METHODS) or is_fn(node, VIEW_FNS):
        return out.dim() >= 1 and src.dim() >= 1 and str(out.shape[-1]) == str(src.shape[-1])
    return False


def skip(node: Any) -> Any:
    """Follow identity-like nodes up to the node that produced the value."""
    while isinstance(node, fx.Node) and is_transparent(node):
        node = node.args[0]
    return node


def chain(start: fx.Node, end: Any) -> list[fx.Node]:
    """The transparent nodes from ``start`` (inclusive) up to, excluding, ``end``."""
    out = []
    node = start
    while node is not end:
        out.append(node)
        node = node.args[0]
    return out




def set_op_arg(node: fx.Node, op: torch._ops.OpOverload, name: str, value: object) -> None:
    """Set argument ``name`` of an ``op`` call node: in place where it is positional, else as
    a keyword (schema defaults stay keywords)."""
    pos = arg_index(op, name)
    if len(node.args) > pos:
        node.args = node.args[:pos] + (value,) + node.args[pos + 1:]
    else:
        node.kwargs = {**node.kwargs, name: value}


def report_of(gm: fx.GraphModule) -> Report:
    """The report the passes write into, kept on the root graph module."""
    return gm.meta.setdefault("twell_report", Report())


def graph_modules(gm: fx.GraphModule) -> list[tuple[str, fx.GraphModule]]:
    """The graph and every subgraph (higher-order ops such as activation checkpointing)."""
    return [(name, m) for name, m in gm.named_modules() if isinstance(m, fx.GraphModule)]


def tokens_str(shape: Any) -> str:
    """The leading (token) dims of a shape as the report writes them: ``[2, 16]``."""
    return "[" + ", ".join(str(d) for d in shape[:-1]) + "]"
